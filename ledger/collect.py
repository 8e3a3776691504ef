"""``rollout-ledger collect``: finalize rollout results, write them durably, then retire.

Order per row (design §5.4): finalize (freeze, build, mask) → append the output row, flush and
fsync → retire the snapshot it was built from.  A crash at any point loses nothing:

* before the fsync, the row is not in the output and its records are not retired: a re-run
  builds it again (freeze is idempotent, so the same snapshot comes back);
* after the fsync but before the retire, a re-run finds the row in the output, does not write it
  again, and retires its snapshot (retire is conditional, so this is safe to repeat);
* a torn last line (the process died mid-write) was never fsynced: it is cut off on re-run.

Rows are keyed by their capture key (rollout id), or by input line number when they have none.

What ``collect`` refuses to do (issue 14):

* report success when the ledger itself failed: an unreachable database, a missing ledger, a
  refused API token or any other failure of the source (not of one rollout's data) stops the
  run with ``CollectFailed`` before that row is written, so no row is ever masked because the
  infrastructure failed.  A re-run processes every row that was not written; rows an older
  version wrote masked with such a failure (``source_error`` and no snapshot) are dropped
  from the output on resume and built again;
* deliver one rollout twice: when two input rows carry the same rollout id, the first (lowest
  line number) is processed and every later one is reported in ``duplicate_rows``, unwritten;
  a row whose rollout an earlier run already delivered and retired (but whose row is not in
  this output) is reported in ``already_retired``, unwritten: its records are gone;
* read and write the same file, or create an output directory that does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import warnings
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ledger.delivery import Source, finalize, retire, retire_snapshot
from ledger.errors import InvalidRolloutId
from ledger.ids import rollout_id_from_run_body
from ledger.types import Build

__all__ = ["CollectAborted", "CollectFailed", "CollectRefused", "CollectReport", "collect"]

SNAPSHOT_KEY = "_ng_capture_snapshot"
LINE_KEY = "_ng_input_line"


class CollectAborted(RuntimeError):
    """The masked fraction exceeded ``max_mask_fraction``; the report says why."""

    def __init__(self, message: str, report: CollectReport) -> None:
        super().__init__(message)
        self.report = report


class CollectFailed(CollectAborted):
    """The ledger (not a rollout's data) failed: unreachable, missing, or the token refused.

    The row it happened on was not written; rows written before it are durable and retired.
    """


class CollectRefused(ValueError):
    """The arguments cannot work (same input and output, missing output directory, …)."""


# A finalize that raised one of these failed because of the rollout's own data or state: the
# row is masked with ``source_error`` like Gym does.  Any other exception is the ledger itself
# failing (``Unavailable``, ``NoLedger``, ``AccessDenied``, a driver error, …): the run stops.
_ROW_ERRORS = frozenset(
    {
        "InvalidInput",
        "InvalidRolloutId",
        "InvalidRecord",
        "UnsupportedSchemaVersion",
        "NotFound",
        "StateConflict",
        "PayloadConflict",
        "RolloutFrozen",
        "RolloutRetired",
    }
)


@dataclass
class CollectReport:
    rows_in: int = 0
    finalized: int = 0
    written: int = 0
    masked: int = 0
    retired: int = 0
    skipped_already_written: int = 0
    retired_on_resume: int = 0
    malformed_lines: list[tuple[int, str]] = field(default_factory=list)
    duplicate_rows: list[tuple[int, str, int]] = field(default_factory=list)
    # Rows whose rollout an earlier run delivered and retired, but that are not in this output
    # (the output was deleted, or another output was named): they cannot be rebuilt.
    already_retired: list[tuple[int, str]] = field(default_factory=list)
    reprocessed_source_errors: int = 0
    mask_reasons: Counter[str] = field(default_factory=Counter)
    delivered_fraction: Counter[str] = field(default_factory=Counter)
    chains: Counter[str] = field(default_factory=Counter)
    aborted: str | None = None

    @property
    def mask_fraction(self) -> float:
        return self.masked / self.finalized if self.finalized else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows_in": self.rows_in,
            "finalized": self.finalized,
            "written": self.written,
            "masked": self.masked,
            "mask_fraction": round(self.mask_fraction, 4),
            "retired": self.retired,
            "skipped_already_written": self.skipped_already_written,
            "retired_on_resume": self.retired_on_resume,
            "malformed_lines": [{"line": n, "error": e} for n, e in self.malformed_lines],
            "duplicate_rows": [
                {"line": n, "rollout_id": rid, "first_line": first}
                for n, rid, first in self.duplicate_rows
            ],
            "reprocessed_source_errors": self.reprocessed_source_errors,
            "already_retired": [{"line": n, "rollout_id": rid} for n, rid in self.already_retired],
            "mask_reasons": dict(self.mask_reasons.most_common()),
            "delivered_fraction": dict(sorted(self.delivered_fraction.items())),
            "chains": dict(sorted(self.chains.items())),
            "aborted": self.aborted,
        }


def _row_key(row: dict[str, Any], line_no: int) -> str:
    try:
        rid = rollout_id_from_run_body(row)
    except InvalidRolloutId:
        rid = None
    return f"rollout:{rid}" if rid else f"line:{line_no}"


def _bucket(frac: Any) -> str:
    if not isinstance(frac, int | float):
        return "n/a"
    if frac >= 1.0:
        return "1.0"
    lo = int(frac * 10) / 10
    return f"{lo:.1f}-{lo + 0.1:.1f}"


def infrastructure_error(build: Build) -> str | None:
    """The ledger's own failure behind a ``source_error`` build, or ``None`` for a row's own."""
    return _infrastructure_error(build.mask_reasons, build.error)


def _infrastructure_error(reasons: Sequence[str], error: str | None) -> str | None:
    if "source_error" not in reasons:
        return None
    error = error or "the capture source failed"
    kind = error.split(":", 1)[0].strip()
    return None if kind in _ROW_ERRORS else error


def _retired_earlier(build: Build) -> bool:
    """The rollout was delivered and retired before: nothing is left to rebuild."""
    if "source_error" not in build.mask_reasons:
        return False
    return (build.error or "").split(":", 1)[0].strip() == "RolloutRetired"


def _never_built(row: dict[str, Any]) -> bool:
    """A row an older collect wrote masked because the ledger failed (nothing was built)."""
    if not row.get("mask_sample") or row.get(SNAPSHOT_KEY):
        return False
    metrics = row.get("_ng_token_capture")
    if not isinstance(metrics, dict):
        return False
    error = metrics.get("error")
    reasons = metrics.get("mask_reasons") or ()
    return _infrastructure_error(reasons, None if error is None else str(error)) is not None


def _scan_output(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """Rows already written (by key), cutting off a torn final line left by a crash.

    Rows that were never built (masked because the ledger failed) are removed from the file
    (rewritten atomically) so this run builds them; their count is returned.
    """
    done: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return done, 0
    kept: list[bytes] = []
    dropped = 0
    with path.open("rb+") as fh:
        good_end = 0
        for raw in fh:
            if not raw.endswith(b"\n"):
                break  # torn: never fsynced, never acknowledged
            try:
                row = json.loads(raw)
            except ValueError:
                break
            good_end += len(raw)
            if isinstance(row, dict) and _never_built(row):
                dropped += 1
                continue
            kept.append(raw)
            line = row.get(LINE_KEY)
            key = _row_key(row, int(line) if isinstance(line, int) else -1)
            done[key] = row
        fh.truncate(good_end)
    if dropped:
        _rewrite(path, kept)
    return done, dropped


def _rewrite(path: Path, lines: list[bytes]) -> None:
    """Replace ``path`` with ``lines`` atomically (write, fsync, rename, fsync the directory)."""
    tmp = path.with_name(path.name + ".rewrite")
    with tmp.open("wb") as fh:
        fh.writelines(lines)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def check_paths(input_path: Path, output_path: Path) -> None:
    """Refuse arguments that cannot work; raises ``CollectRefused`` saying what to change."""
    if not input_path.is_file():
        raise CollectRefused(f"input file {input_path} does not exist")
    same = output_path.resolve() == input_path.resolve()
    if not same and output_path.exists():
        same = output_path.samefile(input_path)
    if same:
        raise CollectRefused(
            f"--input and --output are the same file ({input_path}): write the rebuilt rows "
            "to another file"
        )
    parent = output_path.parent
    if not parent.is_dir():
        raise CollectRefused(
            f"the output directory {parent} does not exist: create it first or choose another "
            "--output"
        )


def _dumps(row: dict[str, Any]) -> bytes:
    # The standard library keeps -inf log-probs as -Infinity, where orjson would write null.
    return json.dumps(row, separators=(",", ":"), ensure_ascii=False).encode()


class _Writer:
    """Appends rows and fsyncs each before it is acknowledged."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fh: IO[bytes] | None = None  # opened at the first row: a failed run leaves no file
        self._lock = asyncio.Lock()

    async def write(self, rows: list[dict[str, Any]]) -> None:
        data = b"".join(_dumps(r) + b"\n" for r in rows)
        async with self._lock:
            await asyncio.to_thread(self._append, data)

    def _append(self, data: bytes) -> None:
        if self._fh is None:
            self._fh = self._path.open("ab")
        self._fh.write(data)
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()


def _rows_for(result: dict[str, Any], build: Build, deliver: str) -> list[dict[str, Any]]:
    if deliver != "all-chains" or not build.trajectories:
        return [result]
    rows = []
    trajectories = build.trajectories
    for i, traj in enumerate(trajectories):
        row = json.loads(_dumps(result))
        response = row.get("response")
        if isinstance(response, dict):
            response["output"] = traj.response["output"]
            response["usage"] = traj.response["usage"]
        else:
            row["response"] = traj.response
        row["_ng_trajectory"] = {
            "index": i,
            "of": len(trajectories),
            "label": traj.label,
            "role": traj.role,
        }
        rows.append(row)
    return rows


async def _preflight(source: Source) -> None:
    """Fail before the first row when a direct database holds no ledger (nothing is created)."""
    from ledger.presence import require_ledger
    from ledger.store import Ledger

    backend = getattr(source, "backend", source)
    if isinstance(backend, Ledger):
        await require_ledger(backend.url)


async def collect(
    source: Source,
    input_path: Path,
    output_path: Path,
    *,
    max_mask_fraction: float | None = None,
    min_samples: int = 50,
    concurrency: int = 8,
    deliver: str = "one",
    consumer: str = "collect",
    on_progress: Callable[[CollectReport], None] | None = None,
    write_hook: Callable[[], Awaitable[None]] | None = None,
) -> CollectReport:
    """Finalize every row of ``input_path`` into ``output_path``; see the module docstring.

    Raises ``CollectRefused`` (bad paths), ``CollectFailed`` (the ledger failed; nothing masked
    was written for it) or ``CollectAborted`` (the masked fraction passed the limit).
    """
    check_paths(input_path, output_path)
    await _preflight(source)
    report = CollectReport()
    done, report.reprocessed_source_errors = _scan_output(output_path)
    writer = _Writer(output_path)
    sem = asyncio.Semaphore(max(1, concurrency))
    stop = asyncio.Event()
    failure: list[str] = []
    warn_malformed = _warn_once_per_run()

    async def retire_written(row: dict[str, Any]) -> bool:
        snap = row.get(SNAPSHOT_KEY)
        try:
            rid = rollout_id_from_run_body(row)
        except InvalidRolloutId:
            return False
        if not isinstance(snap, dict) or rid is None or row.get("mask_sample"):
            return False
        snapshot_id, version = snap.get("snapshot_id"), snap.get("version")
        if not snapshot_id or not isinstance(version, int):
            return False
        # The row is durable and was delivered unmasked from this snapshot: retire it.
        return await retire_snapshot(rid, source, snapshot_id=str(snapshot_id), version=version)

    async def one(line_no: int, row: dict[str, Any]) -> None:
        async with sem:
            if stop.is_set():
                return
            build = await finalize(row, source, deliver=deliver, consumer=consumer)
            broken = infrastructure_error(build)
            if broken is not None:
                rid = build.rollout_id or "?"
                failure.append(
                    f"the ledger failed on {input_path}:{line_no} (rollout {rid}), so the run "
                    f"stopped and did not write that row: {broken.splitlines()[0]}"
                )
                stop.set()
                return
            if _retired_earlier(build):
                # Never a second (masked) row for a delivered rollout; the caller is told.
                report.already_retired.append((line_no, str(build.rollout_id)))
                return
            report.finalized += 1
            warn_malformed(build)
            masked = bool(row.get("mask_sample"))
            if masked:
                report.masked += 1
                report.mask_reasons.update(build.mask_reasons or ["unknown"])
            metrics = row.get("_ng_token_capture") or {}
            report.delivered_fraction[_bucket(metrics.get("delivered_fraction"))] += 1
            if "chains" in metrics:
                report.chains[str(metrics["chains"])] += 1
            if (
                max_mask_fraction is not None
                and report.finalized >= min_samples
                and report.mask_fraction > max_mask_fraction
            ):
                report.aborted = (
                    f"{report.masked}/{report.finalized} finalized rollouts "
                    f"({report.mask_fraction:.1%}) are masked, exceeding max_mask_fraction="
                    f"{max_mask_fraction}. Mask reasons: {dict(report.mask_reasons.most_common())}"
                )
                stop.set()
                return
            if build.snapshot_id is not None:
                row[SNAPSHOT_KEY] = {"snapshot_id": build.snapshot_id, "version": build.version}
            row[LINE_KEY] = line_no
            if write_hook is not None:
                await write_hook()
            await writer.write(_rows_for(row, build, deliver))
            report.written += 1
            if build.rollout_id and await retire(build.rollout_id, source, build):
                report.retired += 1
            if on_progress:
                on_progress(report)

    tasks: list[asyncio.Task[None]] = []
    first_line: dict[str, int] = {}
    try:
        with input_path.open("rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                if stop.is_set():
                    break
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                    if not isinstance(row, dict):
                        raise ValueError("a row must be a JSON object")
                except ValueError as exc:
                    report.malformed_lines.append((line_no, str(exc)[:200]))
                    continue
                report.rows_in += 1
                key = _row_key(row, line_no)
                if key.startswith("rollout:"):
                    # One delivery per rollout id: the first row wins, whatever the timing.
                    if key in first_line:
                        report.duplicate_rows.append((line_no, key[8:], first_line[key]))
                        continue
                    first_line[key] = line_no
                if key in done:
                    report.skipped_already_written += 1
                    if await retire_written(done[key]):
                        report.retired_on_resume += 1
                    continue
                tasks.append(asyncio.create_task(one(line_no, row)))
                # Bound the backlog: never hold more than a few batches of rows in memory.
                if len(tasks) >= 4 * max(1, concurrency):
                    await _drain(tasks, keep=concurrency)
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        writer.close()
    if failure:
        report.aborted = failure[0]
        raise CollectFailed(failure[0], report)
    if report.aborted:
        raise CollectAborted(report.aborted, report)
    return report


def _warn_once_per_run() -> Callable[[Build], None]:
    """NeMo Gym warns once per collection run, not once per row, about malformed rollout ids:
    such a row is masked and its records (if any) are never retired."""
    warned = False

    def warn(build: Build) -> None:
        nonlocal warned
        if warned or "malformed_rollout_id" not in build.mask_reasons:
            return
        warned = True
        error = build.error or ""
        warnings.warn(
            f"a result carries a malformed rollout id ({error}); it is masked and its token "
            "capture will not be retired (further rows like it are not warned about again).",
            stacklevel=2,
        )

    return warn


async def _drain(tasks: list[asyncio.Task[None]], keep: int) -> None:
    while len(tasks) > keep:
        finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in finished:
            tasks.remove(t)
            t.result()
