"""Proxy runners: ``rollout-ledger serve`` in front of the simulated engine, both real processes
on loopback, driven by raw httpx from the benchmark process.

* :func:`load`: concurrent rollouts through the capture route (calls/s, latency, per turn);
* :func:`overhead`: proxy round trip minus direct-upstream round trip for the same request
  (the body the proxy sends upstream, built by ``api.dialects.build_chat_upstream``);
  :func:`overhead_interleaved` does it for several proxies sample by sample, and
  :func:`compare_overhead` (``python -m bench.proxy``) for the bare pass-through proxy, the
  ledger and optionally ``serve`` from another source tree (``--before DIR``), in one run;
* :class:`RssSampler`: peak resident memory of the serve process while it works.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil

from api.dialects import build_chat_upstream
from bench.stats import summarize
from bench.workload import ChatRollout, Workload, text

if TYPE_CHECKING:
    from bench.dbs import DbFactory

__all__ = [
    "RssSampler",
    "ServerProcess",
    "compare_overhead",
    "load",
    "overhead",
    "overhead_interleaved",
    "serve_command",
    "sim_command",
]

ROOT = Path(__file__).resolve().parent.parent
JSON = {"content-type": "application/json"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(db_url: str, upstream: str, port: int) -> list[str]:
    """``rollout-ledger serve`` as installed next to this interpreter (default log level)."""
    exe = Path(sys.executable).with_name("rollout-ledger")
    head = [str(exe)] if exe.exists() else [sys.executable, "-c", "from api.cli import app; app()"]
    return [*head, "serve", "--db", db_url, "--upstream", upstream, "--port", str(port)]


def sim_command(port: int, gen_tokens: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.simserver",
        "--port",
        str(port),
        "--gen-tokens",
        str(gen_tokens),
    ]


class ServerProcess:
    """A child process serving HTTP on loopback, ready once ``health`` answers 200."""

    def __init__(
        self, argv: list[str], port: int, health: str, log: Path, root: Path = ROOT
    ) -> None:
        self.argv, self.port, self.health, self.log = argv, port, health, log
        self.root = root  # the source tree the child imports (another checkout: "before")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> ServerProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LEDGER_")}
        env["PYTHONPATH"] = str(self.root) + os.pathsep + env.get("PYTHONPATH", "")
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.argv, cwd=self.root, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.argv[0]} exited with {self.proc.returncode}: "
                    + self.log.read_text(errors="replace")[-2000:]
                )
            try:
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.argv} did not become healthy in {timeout} s")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@contextlib.contextmanager
def running(server: ServerProcess) -> Iterator[ServerProcess]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


class RssSampler:
    """Samples a process's RSS every ``interval`` s in a thread; ``mark`` starts a new phase."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.phase = "startup"
        self.peaks: dict[str, int] = {}
        self.last = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = self.proc.memory_info().rss
            except psutil.Error:
                return
            self.last = rss
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            self._stop.wait(self.interval)

    def mark(self, phase: str) -> None:
        self.phase = phase

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def report(self) -> dict[str, Any]:
        mib = 1024 * 1024
        return {
            "peak_mib": max(self.peaks.values(), default=0) / mib,
            "by_phase_peak_mib": {k: v / mib for k, v in self.peaks.items()},
            "final_mib": self.last / mib,
        }


def _capture_url(base: str, rollout_id: str) -> str:
    return f"{base}/ng-rollout/{rollout_id}/training-token-capture/v1/chat/completions"


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            pass
    return out


async def load(
    proxy_url: str, w: Workload, *, prefix: str, cpu_pids: dict[str, int] | None = None
) -> dict[str, Any]:
    """``w.rollouts`` concurrent rollouts of ``w.turns`` chat calls through the capture route.

    ``cpu_pids`` (name -> pid): processes whose CPU time per call is reported (the server, the
    upstream); the benchmark client's own is always reported."""
    pids = {**(cpu_pids or {}), "client": os.getpid()}
    cpu0 = _cpu_seconds(pids)
    samples: list[dict[str, Any]] = []
    finals: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    limits = httpx.Limits(max_connections=2 * w.rollouts + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def one(r: int) -> None:
            ro = ChatRollout(w, r, prefix)
            gen_total = 0
            data: dict[str, Any] = {}
            for t in range(1, w.turns + 1):
                raw = json.dumps(ro.body()).encode()
                t0 = time.perf_counter()
                try:
                    resp = await client.post(
                        _capture_url(proxy_url, ro.rollout_id), content=raw, headers=JSON
                    )
                except httpx.TransportError as exc:  # counted, as a refused answer is
                    errors.append(f"{ro.rollout_id} turn {t}: {type(exc).__name__}: {exc}")
                    return
                t1 = time.perf_counter()
                if resp.status_code != 200:
                    errors.append(f"{ro.rollout_id} turn {t}: {resp.status_code} {resp.text[:200]}")
                    return
                data = resp.json()
                usage = data.get("usage") or {}
                gen_total += int(usage.get("completion_tokens") or 0)
                samples.append(
                    {
                        "rollout": ro.rollout_id,
                        "turn": t,
                        "kind": "turn",
                        "prompt_len": usage.get("prompt_tokens"),
                        "call_ms": (t1 - t0) * 1e3,
                    }
                )
                ro.add_turn(data)
            usage = data.get("usage") or {}
            distinct = int(usage.get("prompt_tokens") or 0) + int(
                usage.get("completion_tokens") or 0
            )
            finals[ro.rollout_id] = {
                "response_id": data.get("id"),
                "raw": {
                    "distinct_tokens": distinct,
                    "generated_tokens": gen_total,
                    "raw_bytes": 4 * distinct + 4 * gen_total,
                },
            }

        t0 = time.perf_counter()
        await asyncio.gather(*(one(r) for r in range(w.rollouts)))
        wall = time.perf_counter() - t0
    cpu1 = _cpu_seconds(pids)
    from bench.direct import by_turn

    n = len(samples)
    return {
        "calls": n,
        "rollouts": w.rollouts,
        "wall_s": wall,
        "calls_per_s": n / wall if wall else None,
        "cpu_ms_per_call": {k: (cpu1[k] - cpu0[k]) * 1e3 / n for k in cpu1 if k in cpu0 and n},
        "call_ms": summarize([s["call_ms"] for s in samples]),
        "by_turn": by_turn(samples),
        "errors": errors[:10],
        "error_count": len(errors),
        "final_prompt_tokens": max((s["prompt_len"] or 0) for s in samples) if samples else None,
        "_finals": finals,
    }


async def overhead(
    proxy_url: str,
    upstream_url: str,
    *,
    samples: int,
    prompt_tokens: int,
    tool_tokens: int,
    prefix: str,
    warmup: int = 3,
) -> dict[str, Any]:
    """Sequential pairs: the same request direct to the upstream and through the proxy.

    Each sample is a fresh rollout: a root call with a ``prompt_tokens`` prompt (the ledger stores
    the full prompt), then a continuation (tool output appended; the ledger proves the parent and
    stores the suffix).  Order within a pair alternates.  The direct request is the exact body
    the proxy sends upstream (capture fields added), so the upstream does the same work."""
    out = await overhead_interleaved(
        {prefix: proxy_url},
        upstream_url,
        samples=samples,
        prompt_tokens=prompt_tokens,
        tool_tokens=tool_tokens,
        warmup=warmup,
    )
    return out[prefix]


async def overhead_interleaved(
    proxies: dict[str, str],
    upstream_url: str,
    *,
    samples: int,
    prompt_tokens: int,
    tool_tokens: int,
    warmup: int = 3,
    forwards_as_is: frozenset[str] = frozenset(),
) -> dict[str, dict[str, Any]]:
    """:func:`overhead` for several proxies (name -> URL) at once, interleaved: sample ``i``
    runs one rollout through each proxy, in an order that rotates with ``i``, so a change in
    the machine's load falls on every proxy alike (the machine is shared).  A proxy named in
    ``forwards_as_is`` sends the harness's request upstream unchanged, so its direct anchor is
    that request, not the capture request."""
    names = list(proxies)
    rows: dict[str, dict[str, list[dict[str, float]]]] = {
        name: {"root": [], "continuation": []} for name in names
    }
    async with httpx.AsyncClient(timeout=300) as client:

        async def timed(url: str, raw: bytes) -> tuple[float, dict[str, Any]]:
            t0 = time.perf_counter()
            resp = await client.post(url, content=raw, headers=JSON)
            dt = (time.perf_counter() - t0) * 1e3
            if resp.status_code != 200:
                raise RuntimeError(f"{url}: {resp.status_code} {resp.text[:300]}")
            return dt, resp.json()

        async def rollout(name: str, i: int) -> None:
            rng = random.Random(10_000 + i)
            rid = f"{name}{i + warmup:04d}"
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": text(rng, prompt_tokens - 80)},
                {"role": "user", "content": text(rng, 50)},
            ]
            for step in ("root", "continuation"):
                body = {
                    "model": "smol",
                    "messages": messages,
                    "max_tokens": 400,
                    "temperature": 1.0,
                }
                raw_proxy = json.dumps(body).encode()
                raw_direct = (
                    raw_proxy
                    if name in forwards_as_is
                    else json.dumps(build_chat_upstream(body).body).encode()
                )
                pair: dict[str, float] = {}
                answer: dict[str, Any] = {}
                order = ("direct", "proxy") if i % 2 else ("proxy", "direct")
                for side in order:
                    if side == "direct":
                        pair["direct_ms"], direct = await timed(
                            upstream_url + "/v1/chat/completions", raw_direct
                        )
                        pair["prompt_tokens"] = direct["usage"]["prompt_tokens"]
                    else:
                        pair["proxy_ms"], answer = await timed(
                            _capture_url(proxies[name], rid), raw_proxy
                        )
                pair["overhead_ms"] = pair["proxy_ms"] - pair["direct_ms"]
                if i >= 0:
                    rows[name][step].append(pair)
                content = answer["choices"][0]["message"].get("content") or ""
                messages = [
                    *messages,
                    {"role": "assistant", "content": content},
                    {"role": "user", "content": text(rng, tool_tokens)},
                ]

        for i in range(-warmup, samples):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                await rollout(name, i)
    return {name: _overhead_summary(rows[name]) for name in names}


def _overhead_summary(rows: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for step, pairs in rows.items():
        direct = [p["direct_ms"] for p in pairs]
        proxied = [p["proxy_ms"] for p in pairs]
        out[step] = {
            "samples": len(pairs),
            "prompt_tokens": summarize([p["prompt_tokens"] for p in pairs]).get("p50"),
            "direct_ms": summarize(direct),
            "proxy_ms": summarize(proxied),
            "overhead_ms": summarize([p["overhead_ms"] for p in pairs]),
            # The target's definition: p50(proxy) - p50(direct).
            "overhead_p50_ms": summarize(proxied)["p50"] - summarize(direct)["p50"],
        }
    return out


def bare_command(port: int, upstream: str, *, capture_body: bool = False) -> list[str]:
    """The bare pass-through proxy (``bench.bareproxy``): the anchor the ledger is held to;
    ``capture_body``: the one that also asks the upstream for tokens (the ledger's own share)."""
    argv = [sys.executable, "-m", "bench.bareproxy", "--port", str(port), "--upstream", upstream]
    return [*argv, "--capture-body"] if capture_body else argv


async def compare_overhead(
    tmp: Path,
    db_url: Callable[[str], Awaitable[str]],
    *,
    samples: int,
    prompt_tokens: int = 16_000,
    tool_tokens: int = 200,
    before: Path | None = None,
    warmup: int = 3,
) -> dict[str, Any]:
    """Proxy overhead of the bare pass-through proxy and of ``rollout-ledger serve`` (and, with
    ``before``, of ``serve`` from that other source tree), each against the same simulated
    upstream, in this one run, interleaved (:func:`overhead_interleaved`).  ``db_url(label)``
    gives a fresh migrated database per server.  ``above_bare_<step>_ms``: p50 through the
    ledger minus p50 through the bare proxy; ``overhead_above_bare_<step>_ms``: the ledger's
    overhead minus the bare proxy's, each against the engine sent what that proxy sends."""
    kinds = ["bare", "bare_capture", *(["before"] if before is not None else []), "ledger"]
    out: dict[str, Any] = {}
    sim_port = free_port()
    sim = ServerProcess(sim_command(sim_port, 300), sim_port, "/health", tmp / "sim.log")
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(sim))
        servers: dict[str, ServerProcess] = {}
        for kind in kinds:
            port = free_port()
            if kind in ("bare", "bare_capture"):
                argv = bare_command(port, sim.url, capture_body=kind == "bare_capture")
            else:
                argv = serve_command(await db_url(kind), sim.url, port)
            root = before if kind == "before" and before is not None else ROOT
            srv = ServerProcess(argv, port, "/healthz", tmp / f"{kind}.log", root=root)
            servers[kind] = stack.enter_context(running(srv))
        pids = {kind: srv.proc.pid for kind, srv in servers.items() if srv.proc is not None}
        cpu0 = _cpu_seconds(pids)
        res = await overhead_interleaved(
            {kind: srv.url for kind, srv in servers.items()},
            sim.url,
            samples=samples,
            prompt_tokens=prompt_tokens,
            tool_tokens=tool_tokens,
            warmup=warmup,
            forwards_as_is=frozenset({"bare"}),
        )
        cpu1 = _cpu_seconds(pids)
    calls = 2 * (samples + warmup)  # a root and a continuation per rollout
    for kind in kinds:
        out[kind] = res[kind]
        # CPU time of the proxy process per proxied call (all its threads): less sensitive
        # to a loaded machine than the latencies.
        out[kind]["server_cpu_ms_per_call"] = (cpu1[kind] - cpu0[kind]) * 1e3 / calls
        print(
            f"proxy {kind}: overhead p50 root {res[kind]['root']['overhead_p50_ms']:.1f} ms, "
            f"continuation {res[kind]['continuation']['overhead_p50_ms']:.1f} ms; server CPU "
            f"{out[kind]['server_cpu_ms_per_call']:.1f} ms/call",
            file=sys.stderr,
            flush=True,
        )
    for kind in kinds[1:]:
        for step in ("root", "continuation"):
            key = "above_bare" if kind == "ledger" else f"{kind}_above_bare"
            out[f"{key}_{step}_ms"] = (
                out[kind][step]["proxy_ms"]["p50"] - out["bare"][step]["proxy_ms"]["p50"]
            )
    for step in ("root", "continuation"):
        # The ledger's own share: above the pass-through that also asks for the tokens.
        out[f"above_bare_capture_{step}_ms"] = (
            out["ledger"][step]["proxy_ms"]["p50"] - out["bare_capture"][step]["proxy_ms"]["p50"]
        )
        # Overhead against overhead: each proxy against the engine answering what that proxy
        # asks (the bare one's request has no capture fields, so the engine's answer to it
        # is shorter and quicker; the latency difference above counts that as the proxy's).
        out[f"overhead_above_bare_{step}_ms"] = (
            out["ledger"][step]["overhead_p50_ms"] - out["bare"][step]["overhead_p50_ms"]
        )
    return out


async def load_run(tmp: Path, db: str, w: Workload) -> dict[str, Any]:
    """:func:`load` through a fresh ``serve`` (database ``db``) in front of the simulated
    engine: many concurrent rollouts through one proxy, where its connection pools and caches
    are under pressure (``python -m bench.proxy --load N``)."""
    sim_port, port = free_port(), free_port()
    sim = ServerProcess(sim_command(sim_port, w.gen_tokens), sim_port, "/health", tmp / "sim.log")
    with running(sim):
        srv = ServerProcess(serve_command(db, sim.url, port), port, "/healthz", tmp / "load.log")
        with running(srv):
            assert srv.proc is not None
            return await load(srv.url, w, prefix="load", cpu_pids={"server": srv.proc.pid})


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.proxy``: the proxy-overhead comparison alone (SQLite ledger); with
    ``--load N``, N concurrent rollouts through one proxy instead."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.proxy", description=main.__doc__)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=16_000)
    ap.add_argument(
        "--before", type=Path, default=None, help="also run `serve` from this source tree"
    )
    ap.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    ap.add_argument(
        "--load",
        type=int,
        default=0,
        metavar="N",
        help="instead: N concurrent rollouts (a --prompt-tokens system prompt) through one proxy",
    )
    ap.add_argument("--turns", type=int, default=6, help="calls per rollout with --load")
    args = ap.parse_args(argv)
    if args.load:
        return _main_load(args.load, args.turns, args.prompt_tokens, args.out)

    async def run() -> dict[str, Any]:
        async with _scratch("rl_proxy_") as (tmp, dbs):

            async def db_url(label: str) -> str:
                return (await dbs.create("sqlite", label)).url

            return await compare_overhead(
                tmp,
                db_url,
                samples=args.samples,
                prompt_tokens=args.prompt_tokens,
                before=args.before,
            )

    out = asyncio.run(run())
    for key, value in out.items():
        if key.endswith("_ms"):
            print(f"{key}: {value:.2f}")
    for kind in ("bare", "bare_capture", "before", "ledger"):
        if kind in out:
            for step in ("root", "continuation"):
                r = out[kind][step]
                print(
                    f"{kind} {step}: n={r['samples']} prompt={r['prompt_tokens']} "
                    f"direct p50 {r['direct_ms']['p50']:.2f} proxy p50 {r['proxy_ms']['p50']:.2f} "
                    f"overhead {r['overhead_p50_ms']:.2f} ms"
                )
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


@contextlib.asynccontextmanager
async def _scratch(prefix: str) -> AsyncIterator[tuple[Path, DbFactory]]:
    """A temporary directory and a database factory in it, both removed after."""
    import shutil
    import tempfile

    from bench.dbs import DbFactory

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    dbs = DbFactory(tmp)
    try:
        yield tmp, dbs
    finally:
        await dbs.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def _main_load(rollouts: int, turns: int, system_tokens: int, out: Path | None) -> int:
    w = Workload(rollouts=rollouts, turns=turns, system_tokens=system_tokens)

    async def run() -> dict[str, Any]:
        async with _scratch("rl_load_") as (tmp, dbs):
            return await load_run(tmp, (await dbs.create("sqlite", "load")).url, w)

    res = asyncio.run(run())
    res.pop("_finals", None)
    call = res["call_ms"]
    print(
        f"{rollouts} rollouts x {turns} calls ({system_tokens}-token system prompt): "
        f"{res['calls']} answered, {res['error_count']} failed; {res['calls_per_s']:.1f} calls/s; "
        f"call p50 {call['p50']:.1f} ms, p99 {call['p99']:.1f} ms; server CPU "
        f"{res['cpu_ms_per_call']['server']:.2f} ms/call"
    )
    for error in res["errors"]:
        print("  " + error)
    if out is not None:
        out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 1 if res["error_count"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
