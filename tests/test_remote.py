"""Remote transports (issue #4 points 4 and 5), on SQLite and Postgres.

The NeMo Gym classes and ``RemoteLedger`` talk to a running ledger service (the ``serve`` app on
a loopback port, with bearer tokens): they pass ``run_conformance``, retry safely (a put or a
retire whose answer was lost is reconciled, never duplicated) and carry large prompts exactly in
both token encodings, ``-inf`` log-probs included.
"""

from __future__ import annotations

import math
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from api.app import create_app
from api.cli import app as cli
from ledger import migrate
from ledger.client import RemoteLedger
from ledger.config import load_settings, parse_tokens
from ledger.conformance import CHECKS, ConformanceError, run_conformance
from ledger.delivery import finalize_rollout_token_capture, retire_rollout_token_capture
from ledger.errors import AccessDenied, PayloadConflict, RolloutFrozen, RolloutRetired, Unavailable
from ledger.gym import CaptureLineageStore, CaptureSink, CaptureSource
from ledger.records import TokenEntry
from ledger.store import Ledger
from rollout_sim import ThreadedServer
from tests.test_gym_conformance import VersionBlindSource

Rid = Callable[[str], str]

TOKENS = "w-tok=ingest;t-tok=trainer;a-tok=audit;root-tok=admin"


@dataclass
class Service:
    url: str

    def audit(self, rollout_id: str) -> dict[str, Any]:
        resp = httpx.get(
            f"{self.url}/ledger/v1/rollouts/{rollout_id}",
            headers={"Authorization": "Bearer a-tok"},
            timeout=30,
        )
        assert resp.status_code == 200, resp.text
        data: dict[str, Any] = resp.json()
        return data

    def metric(self, line_prefix: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith(line_prefix + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def _serve(db_url: str) -> Iterator[Service]:
    """What ``rollout-ledger serve`` runs, on a loopback port, with API tokens."""
    settings = load_settings(db=db_url)
    settings.tokens = parse_tokens(TOKENS)
    with ThreadedServer(create_app(settings), lifespan="on", startup_timeout=60) as server:
        yield Service(server.url)


@pytest.fixture
def service(db_url: str) -> Iterator[Service]:
    yield from _serve(db_url)


@pytest.fixture
def sqlite_service(tmp_path: Path) -> Iterator[Service]:
    """For checks of the client side only (the storage side runs on both backends above)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'remote.db'}"
    migrate.upgrade(url)
    yield from _serve(url)


def entry(
    rollout_id: str, call_id: str, prompt: list[int], gen: list[int], **over: Any
) -> TokenEntry:
    data: dict[str, Any] = {
        "rollout_id": rollout_id,
        "model_call_id": call_id,
        "model": "smol",
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": [-0.125 * (i + 1) for i in range(len(gen))],
        "created_at": 1700000000.0,
        "output_items": [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text"}]}
        ],
        "token_item_index": 0,
    }
    data.update(over)
    return TokenEntry.model_validate(data)


def bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]


# --------------------------------------------------------------------------- conformance


@pytest.mark.parametrize("encoding", ["json", "packed-v1"])
async def test_conformance_over_http(service: Service, encoding: str) -> None:
    kw: dict[str, Any] = {"url": service.url, "token_encoding": encoding}
    passed = await run_conformance(
        sink_factory=lambda: CaptureSink(token="w-tok", **kw),
        source_factory=lambda: CaptureSource(token="t-tok", **kw),
        lineage_factory=lambda: CaptureLineageStore(token="w-tok", **kw),
    )
    assert passed == list(CHECKS)


async def test_conformance_over_http_catches_a_broken_source(sqlite_service: Service) -> None:
    service = sqlite_service
    with pytest.raises(ConformanceError) as info:
        await run_conformance(
            sink_factory=lambda: CaptureSink(url=service.url, token="w-tok"),
            source_factory=lambda: VersionBlindSource(url=service.url, token="t-tok"),
        )
    assert info.value.check == "mark_incomplete_durability"


def test_cli_conformance_against_a_running_service(sqlite_service: Service) -> None:
    url = sqlite_service.url
    result = CliRunner().invoke(cli, ["conformance", "--db", url, "-k", "token=root-tok"])
    assert result.exit_code == 0, result.output
    assert f"{len(CHECKS)} checks passed" in result.output


async def test_tokens_and_scopes_are_enforced_remotely(service: Service, rid: Rid) -> None:
    r = rid("scope")
    for token in (None, "wrong", "t-tok"):
        sink = CaptureSink(url=service.url, token=token)
        try:
            with pytest.raises(AccessDenied, match="refused the API token"):
                await sink.put(entry(r, "c1", [1], [2]))
        finally:
            await sink.close()
    source = CaptureSource(url=service.url, token="w-tok")
    try:
        with pytest.raises(AccessDenied, match="'trainer' scope"):
            await source.freeze(r)
    finally:
        await source.close()


async def test_remote_errors_map_to_the_ledger_exceptions(service: Service, rid: Rid) -> None:
    r = rid("errs")
    sink = CaptureSink(url=service.url, token="w-tok")
    source = CaptureSource(url=service.url, token="t-tok")
    try:
        await sink.put(entry(r, "c1", [1, 2], [3]))
        with pytest.raises(PayloadConflict):
            await sink.put(entry(r, "c1", [1, 2], [4]))
        snap = await source.freeze(r)
        assert snap.incomplete
        with pytest.raises(RolloutFrozen):
            await sink.put(entry(r, "c2", [1, 2, 3, 5], [6]))
        assert await source.drop(r, snapshot_id=snap.snapshot_id, version=snap.version)
        with pytest.raises(RolloutRetired):
            await sink.put(entry(r, "c2", [1, 2, 3, 5], [6]))
        # Retire of an unknown rollout is "nothing retired", as with a database URL.
        assert not await source.drop(rid("none"), snapshot_id="0" * 32, version=1)
    finally:
        await sink.close()
        await source.close()


async def test_retire_answers_the_same_locally_and_over_http(
    service: Service, ledger: Ledger, rid: Rid
) -> None:
    """One retire rule, kept by the ledger (issue 9): every case answers the same through a
    database URL and over HTTP, and the rule's outcome names the case."""
    remote = RemoteLedger(service.url, token="t-tok")
    try:
        answers: dict[str, list[bool]] = {"local": [], "http": []}
        for name, led in (("local", ledger), ("http", remote)):
            r, opened = rid(f"rule-{name}"), rid(f"open-{name}")
            await ledger.put(entry(r, "c1", [1, 2], [3]))
            await ledger.put(entry(opened, "c1", [1, 2], [3]))
            snap = await ledger.freeze(r)
            ident = {"snapshot_id": snap.snapshot_id, "version": snap.version}
            stale = {"snapshot_id": snap.snapshot_id, "version": snap.version + 1}
            answers[name] = [
                await led.retire(r, **stale),  # frozen at another identity
                await led.retire(opened, **ident),  # open
                await led.retire(rid("none"), **ident),  # unknown
                await led.retire(r, **ident),  # retires
                await led.retire(r, **ident),  # the repeat
                await led.retire(r, **stale),  # retired at another identity
            ]
            outcome = await ledger.retire_outcome(r, **ident)
            assert (outcome.status, outcome.retired) == ("repeat", True)
            assert (await ledger.retire_outcome(r, **stale)).status == "retired_elsewhere"
            assert (await ledger.retire_outcome(opened, **ident)).status == "stale"
            assert (await ledger.retire_outcome(rid("none"), **ident)).status == "unknown"
        assert answers["local"] == [False, False, False, True, True, False]
        assert answers["http"] == answers["local"]
    finally:
        await remote.close()


# --------------------------------------------------------------------------- retry


class LosingTransport(httpx.AsyncBaseTransport):
    """Forwards every request; for the first ``lose`` matching ones the answer is lost.

    The request reaches the service and is committed there, then the client sees a read
    timeout instead of the response, exactly as when a network blip eats the answer.
    """

    def __init__(self, match: Callable[[httpx.Request], bool], lose: int = 1) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.match = match
        self.lose = lose
        self.log: list[tuple[str, str, int | str]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        await response.aread()
        if self.lose > 0 and self.match(request):
            self.lose -= 1
            self.log.append((request.method, request.url.path, "lost"))
            await response.aclose()
            raise httpx.ReadTimeout("the answer was lost", request=request)
        self.log.append((request.method, request.url.path, response.status_code))
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class FlakyTransport(httpx.AsyncBaseTransport):
    """Answers 503 (without forwarding) the first ``fail`` times, then forwards."""

    def __init__(self, fail: int) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.fail = fail
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.fail > 0:
            self.fail -= 1
            return httpx.Response(
                503, json={"error": {"code": "unavailable", "message": "restarting"}}
            )
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_put_whose_answer_was_lost_is_reconciled_not_duplicated(
    service: Service, rid: Rid
) -> None:
    r = rid("lost")
    lossy = LosingTransport(lambda req: req.method in ("PUT", "POST"), lose=1)
    sink = CaptureSink(url=service.url, token="w-tok", transport=lossy, backoff_s=0.001)
    source = CaptureSource(url=service.url, token="t-tok")
    created_before = service.metric('rollout_ledger_ingest_total{op="put",outcome="created"}')
    dup_before = service.metric('rollout_ledger_ingest_total{op="put",outcome="duplicate"}')
    try:
        await sink.begin_call(r, "c1")  # the intent's answer is lost; the retry is a 200 repeat
        assert [x[2] for x in lossy.log] == ["lost", 200]

        lossy.lose = 1
        first = entry(r, "c1", [1, 2, 3], [4, 5])
        backend = sink.backend
        assert isinstance(backend, RemoteLedger)
        res = await backend.put(first)
        # The first PUT landed (committed) but its answer was lost; the retry is recognised as
        # the identical record: reconciled as a duplicate at the same version.
        assert [x[2] for x in lossy.log[2:]] == ["lost", 200]
        assert res.status == "duplicate"
        assert res.version == 1  # one record, one version bump (an intent does not bump)

        lossy.lose = 1
        child = entry(r, "c2", [1, 2, 3, 4, 5, 6], [7])
        await sink.put(child)  # through the Gym class, too
        assert [x[2] for x in lossy.log[4:]] == ["lost", 200]
    finally:
        await sink.close()

    detail = service.audit(r)
    assert [c["model_call_id"] for c in detail["calls"]] == ["c1", "c2"]  # once each
    assert [c["status"] for c in detail["calls"]] == ["captured", "captured"]
    assert detail["incomplete_events"] == []  # a reconciled retry is not a conflict
    assert detail["rollout"]["incomplete"] is False
    assert detail["rollout"]["version"] == 2  # two records, two bumps, nothing more
    assert [(e["child"], e["parent"]) for e in detail["edges"]] == [("c2", "c1")]
    created = service.metric('rollout_ledger_ingest_total{op="put",outcome="created"}')
    dup = service.metric('rollout_ledger_ingest_total{op="put",outcome="duplicate"}')
    assert (created - created_before, dup - dup_before) == (2, 2)

    try:
        snap = await source.freeze(r)
        assert [e.model_call_id for e in snap.entries] == ["c1", "c2"]
        assert not snap.incomplete
        assert snap.entries[1].prompt_token_ids == [1, 2, 3, 4, 5, 6]
    finally:
        await source.close()


async def test_retire_and_freeze_whose_answers_were_lost_are_reconciled(
    service: Service, rid: Rid
) -> None:
    r = rid("lostret")
    sink = CaptureSink(url=service.url, token="w-tok")
    lossy = LosingTransport(lambda req: req.url.path.endswith(("/freeze", "/retire")), lose=1)
    source = CaptureSource(url=service.url, token="t-tok", transport=lossy, backoff_s=0.001)
    try:
        await sink.put(entry(r, "c1", [1, 2], [3]))
        snap = await source.freeze(r)  # lost once, retried: the same snapshot comes back
        assert [x[2] for x in lossy.log] == ["lost", 200]
        lossy.lose = 1
        assert await source.drop(r, snapshot_id=snap.snapshot_id, version=snap.version)
        assert [x[2] for x in lossy.log[2:]] == ["lost", 200]  # the repeat answered 200
        detail = service.audit(r)
        assert detail["rollout"]["state"] == "retired"
        assert detail["rollout"]["snapshot_id"] == snap.snapshot_id
    finally:
        await sink.close()
        await source.close()


async def test_transient_503_is_retried_and_exhaustion_is_unavailable(
    service: Service, rid: Rid
) -> None:
    r = rid("flaky")
    flaky = FlakyTransport(fail=2)
    led = RemoteLedger(service.url, token="w-tok", transport=flaky, backoff_s=0.001)
    try:
        assert (await led.put(entry(r, "c1", [1], [2]))).status == "created"
        assert flaky.calls == 3
    finally:
        await led.close()

    dead = FlakyTransport(fail=100)
    led = RemoteLedger(service.url, token="w-tok", transport=dead, retries=3, backoff_s=0.001)
    try:
        with pytest.raises(Unavailable, match="503"):
            await led.put(entry(r, "c2", [1], [2]))
        assert dead.calls == 4
    finally:
        await led.close()

    # Nothing listens there: connection errors are retried, then reported as Unavailable.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    led = RemoteLedger(url, token="w-tok", retries=2, backoff_s=0.001, timeout_s=5)
    try:
        with pytest.raises(Unavailable, match="unreachable"):
            await led.put(entry(r, "c3", [1], [2]))
    finally:
        await led.close()


# --------------------------------------------------------------------------- large prompts


class SizeTransport(httpx.AsyncHTTPTransport):
    """Records the size of every request and response body."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, int]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        self.sent.append((request.method, len(body)))
        return await super().handle_async_request(request)


async def test_large_prompts_round_trip_exactly_in_both_encodings(
    service: Service, rid: Rid
) -> None:
    r = rid("large")
    prompt = [(i * 2654435761) % 200003 for i in range(120_000)]
    gen = [7, 0, 2**31 - 1, 3]
    lps = [-math.inf, -0.0, -5e-324, -0.1 - 2**-40]
    follow = [*prompt, *gen, 11, 12]
    sizes: dict[str, int] = {}
    for encoding in ("json", "packed-v1"):
        sized = SizeTransport()
        led = RemoteLedger(service.url, token="root-tok", token_encoding=encoding, transport=sized)
        rr = f"{r}-{encoding}"
        try:
            res = await led.put(entry(rr, "c1", prompt, gen, generation_log_probs=lps))
            assert res.status == "created"
            sizes[encoding] = sized.sent[-1][1]
            res = await led.put(entry(rr, "c2", follow, [9], generation_log_probs=[-math.inf]))
            assert (res.parent_call_id, res.prompt_is_delta) == ("c1", True)
            # The lookup returns the exact cumulative tokens of the proven parent.
            look = await led.resolve(rr, [*follow, 9, 10])
            assert look.model_call_id == "c2" and look.cumulative_token_ids == [*follow, 9]
            snap = await led.freeze(rr)
            e1, e2 = snap.entries
            assert e1.prompt_token_ids == prompt and e1.generation_token_ids == gen
            assert bits(e1.generation_log_probs) == bits(lps)  # -inf, -0.0, subnormal: exact
            assert e2.prompt_token_ids == follow  # rebuilt from the delta record
            assert bits(e2.generation_log_probs) == bits([-math.inf])
        finally:
            await led.close()
    assert sizes["packed-v1"] < sizes["json"] * 0.9  # packed is the compact form


async def test_remote_finalize_and_retire_deliver_exact_tokens(service: Service, rid: Rid) -> None:
    r = rid("deliver")
    sink = CaptureSink(url=service.url, token="w-tok")
    source = CaptureSource(url=service.url, token="t-tok")
    prompt = list(range(1000, 1100))
    try:
        await sink.begin_call(r, "c1")
        await sink.put(
            entry(
                r,
                "c1",
                prompt,
                [5, 6],
                generation_log_probs=[-math.inf, -0.5],
                response_id="resp-1",
            )
        )
        result: dict[str, Any] = {"_ng_rollout_id": r, "response": {"id": "resp-1", "output": []}}
        build = await finalize_rollout_token_capture(result, source)
        assert build is not None and build["outcome"] == "delivered", build
        (carrier,) = [i for i in result["response"]["output"] if "generation_token_ids" in i]
        assert carrier["prompt_token_ids"] == prompt
        assert carrier["generation_token_ids"] == [5, 6]
        # Back as floats, bit-exact, like a database URL gives.
        assert bits(carrier["generation_log_probs"]) == bits([-math.inf, -0.5])
        assert await retire_rollout_token_capture(r, source, build)
        detail = service.audit(r)
        assert detail["rollout"]["state"] == "retired"
        assert detail["deliveries"][-1]["durable_ack_at"] is not None
    finally:
        await sink.close()
        await source.close()
