"""Issue #5 point 4: fault evidence, scripted and repeatable.

a. ``rollout-ledger serve`` (a real OS process) is SIGKILLed under load from concurrent harness
   clients and restarted on the same port: every call a harness got a 200 for is in the ledger
   byte-for-byte (what the upstream sampled, what the harness saw), nothing is half-written, a
   call caught in flight leaves a dangling intent that masks its rollout, and every other
   rollout rebuilds exactly.  Runs on SQLite and Postgres.
b. A private Postgres (``initdb`` + ``pg_ctl`` in a temp dir; the machine's shared cluster is
   never touched) is stopped (``-m fast``, later ``-m immediate``) and started mid-run:
   acknowledged records survive, calls during the outage fail with 503 in the harness's dialect
   before anything goes upstream, the call caught in flight masks its rollout
   (``dangling_intent``), and service resumes without a restart of the proxy.
c. The upstream answers 500, hangs past ``upstream_timeout_s``, or drops the connection
   (before the answer, or half-way through its body): the OpenAI and Anthropic SDKs raise the
   right error classes (a streaming Responses harness gets ``response.failed``), the rollout
   (no retry succeeds) is incomplete at freeze with reason ``upstream_error``, and nothing is
   half-written.  Both backends.

Waits are polls with deadlines or bounded waits on events and processes; nothing sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from api.app import create_app
from ledger import migrate
from ledger.config import load_settings
from rollout_sim import ByteTokenizer, SimEngine, ThreadedServer
from tests.helpers.fault_harness import Session, check_acks_byte_for_byte, expected_chain, finalize
from tests.helpers.fault_support import (
    ServeProcess,
    UpstreamTap,
    call_rows,
    half_written,
    incomplete_reasons,
    poll,
    private_postgres,
    run_async,
)
from tests.proxy_support import delivered

Rid = Callable[[str], str]
DEADLINE_S = 60.0


def new_engine(seed: int = 11) -> SimEngine:
    return SimEngine(ByteTokenizer(), model_name="smol", max_model_len=16384, seed=seed)


# --------------------------------------------------------------------------- 4a: SIGKILL


N_SESSIONS = 10
TURNS = 6
KILL_AFTER_ACKS = 24


@pytest.mark.slow
def test_serve_sigkill_under_load_loses_no_acknowledged_call(
    backend: str, db_url: str, rid: Rid, tmp_path: Path
) -> None:
    engine = new_engine()
    tap = UpstreamTap(engine.app)
    sessions = [Session(rid(f"kill{i}"), f"topic {i}") for i in range(N_SESSIONS)]
    victim = Session(rid("killgate"), "GATE-KILL-inflight")
    gate = tap.gate("GATE-KILL-inflight")
    up = threading.Event()  # set while the proxy is serving
    stop = threading.Event()
    acked = [0]
    lock = threading.Lock()
    in_flight_at_kill: list[str] = []
    busy: set[str] = set()

    def run_session(s: Session, base: str) -> None:
        with httpx.Client(base_url=base, timeout=30.0) as client:
            while len(s.acks) < TURNS and not stop.is_set():
                if not up.wait(DEADLINE_S):
                    s.failures.append("proxy never came back")
                    return
                with lock:
                    busy.add(s.rollout_id)
                try:
                    resp = client.post("/v1/chat/completions", json=s.body())
                    ok = resp.status_code == 200
                    detail = f"HTTP {resp.status_code}: {resp.text[:200]}"
                except httpx.HTTPError as exc:
                    ok, detail = False, f"{type(exc).__name__}: {exc}"
                finally:
                    with lock:
                        busy.discard(s.rollout_id)
                if ok:
                    s.accept(resp.json())
                    with lock:
                        acked[0] += 1
                else:
                    s.failures.append(detail)

    def run_victim(base: str) -> None:
        with httpx.Client(base_url=base, timeout=30.0) as client:
            try:
                resp = client.post("/v1/chat/completions", json=victim.body())
                victim.failures.append(f"HTTP {resp.status_code}")
            except httpx.HTTPError as exc:
                victim.failures.append(type(exc).__name__)

    with ThreadedServer(tap) as upstream:
        serve = ServeProcess(db_url, upstream.url + "/v1", tmp_path).start()
        try:

            def base(s: Session) -> str:
                return f"{serve.url}/ng-rollout/{s.rollout_id}/training-token-capture"

            up.set()
            with ThreadPoolExecutor(N_SESSIONS + 1) as pool:
                victim_done = pool.submit(run_victim, base(victim))
                # The victim's intent is committed before dispatch; it waits at the upstream.
                poll(lambda: bool(tap.arrived), deadline_s=DEADLINE_S, what="the gated call")
                futures = [pool.submit(run_session, s, base(s)) for s in sessions]
                poll(
                    lambda: acked[0] >= KILL_AFTER_ACKS,
                    deadline_s=DEADLINE_S,
                    what=f"{KILL_AFTER_ACKS} acknowledged calls",
                )
                up.clear()
                with lock:
                    in_flight_at_kill.extend(busy)
                serve.kill()
                acked_at_kill = acked[0]
                gate.set()  # the upstream answers a connection nobody holds any more
                victim_done.result(timeout=DEADLINE_S)
                serve.start()
                up.set()
                for fut in futures:
                    fut.result(timeout=DEADLINE_S * 2)
        finally:
            stop.set()
            up.set()
            gate.set()
            serve.stop()
        answers = tap.answers()

    assert serve.starts == 2
    assert acked_at_kill < N_SESSIONS * TURNS, "the kill came after the load ended"
    assert all(len(s.acks) == TURNS for s in sessions), [s.failures for s in sessions]
    assert victim.failures and not victim.acks
    everyone = [*sessions, victim]
    ids = [s.rollout_id for s in everyone]
    assert run_async(lambda led: half_written(led, ids), db_url) == []

    counts = check_acks_byte_for_byte(db_url, answers, sessions)
    for s in sessions:
        # A call killed after its commit but before its answer is recorded, not acknowledged.
        assert len(s.acks) <= counts[s.rollout_id] <= len(s.acks) + len(s.failures), s.failures
    # The gated call: intent committed, no record (its process died), so its rollout masks.
    rows = run_async(lambda led: call_rows(led, victim.rollout_id), db_url)
    assert [r.status for r in rows] == ["intent"]
    result, build = finalize(db_url, victim.rollout_id, None)
    assert build["outcome"] == "masked" and "capture_incomplete" in build["mask_reasons"]
    assert "dangling_intent" in build["metrics"]["incomplete_reasons"]

    outcomes: dict[str, int] = {}
    for s in sessions:
        result, build = finalize(db_url, s.rollout_id, s.acks[-1].response_id)
        outcomes[build["outcome"]] = outcomes.get(build["outcome"], 0) + 1
        if build["outcome"] == "delivered":
            assert delivered(result) == expected_chain(answers, s.acks), s.rollout_id
        else:
            # Only a call caught by the kill may mask a rollout, and only as a dangling intent.
            assert s.failures, (s.rollout_id, build)
            assert build["mask_reasons"] == ["capture_incomplete"], build
            assert set(build["metrics"]["incomplete_reasons"]) == {"dangling_intent"}, build
    extra = sum(counts[s.rollout_id] - len(s.acks) for s in sessions)
    print(
        f"sigkill[{backend}]: acked at kill {acked_at_kill}, in flight {len(in_flight_at_kill)}, "
        f"failed attempts {sum(len(s.failures) for s in sessions)}, recorded but unacknowledged "
        f"{extra}, outcomes {outcomes}"
    )
    assert outcomes.get("delivered", 0) >= N_SESSIONS - len(in_flight_at_kill), (
        outcomes,
        in_flight_at_kill,
    )


# --------------------------------------------------------------------------- 4b: Postgres restart


def _chat(client: httpx.Client, s: Session) -> httpx.Response:
    return client.post(
        f"/ng-rollout/{s.rollout_id}/training-token-capture/v1/chat/completions", json=s.body()
    )


def _anthropic(client: httpx.Client, rollout_id: str, text: str) -> httpx.Response:
    return client.post(
        f"/ng-rollout/{rollout_id}/training-token-capture/v1/messages",
        json={
            "model": "smol",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": text}],
        },
    )


def _turn(client: httpx.Client, s: Session) -> None:
    resp = _chat(client, s)
    assert resp.status_code == 200, resp.text
    s.accept(resp.json())


@pytest.mark.postgres
def test_postgres_restart_mid_run(rid: Rid) -> None:
    with private_postgres() as pg:
        url = pg.create_database("rl_h10_restart")
        migrate.upgrade(url)
        engine = new_engine(seed=5)
        tap = UpstreamTap(engine.app)
        sessions = [Session(rid(f"pg{i}"), f"subject {i}") for i in range(4)]
        caught = sessions[0]
        with ThreadedServer(tap) as upstream:
            settings = load_settings(db=url, upstream=upstream.url + "/v1")
            app = create_app(settings)
            with (
                ThreadedServer(app, lifespan="on", startup_timeout=60) as proxy,
                httpx.Client(base_url=proxy.url, timeout=30.0) as client,
            ):
                for _ in range(2):
                    for s in sessions:
                        _turn(client, s)
                acked_before = {s.rollout_id: len(s.acks) for s in sessions}

                # A call caught in flight: intent committed, upstream holds it at a gate.
                caught.turns[-1] = ("user", caught.turns[-1][1] + " GATE-PG-inflight")
                gate = tap.gate("GATE-PG-inflight")
                with ThreadPoolExecutor(1) as pool:
                    inflight = pool.submit(_chat, client, caught)
                    poll(lambda: bool(tap.arrived), deadline_s=DEADLINE_S, what="gated call")
                    pg.stop("fast")
                    gate.set()
                    caught_resp = inflight.result(timeout=DEADLINE_S)
                # Capture never fails the model call: the harness has its answer; the ledger
                # holds only the intent (the record and the incomplete mark could not be written).
                assert caught_resp.status_code == 200, caught_resp.text
                caught.accept(caught_resp.json())
                lost_id = caught.acks[-1].response_id

                sent_upstream = len(engine.requests)
                outage = _outage_checks(client, sessions[1], proxy.url)
                assert len(engine.requests) == sent_upstream, "a call went upstream unrecorded"

                pg.start()
                # Service resumes without restarting the proxy (stale pooled connections).
                statuses: list[int] = []

                def resumed() -> bool:
                    resp = _chat(client, sessions[1])
                    statuses.append(resp.status_code)
                    if resp.status_code == 200:
                        sessions[1].accept(resp.json())
                        return True
                    return False

                poll(resumed, deadline_s=DEADLINE_S, what="calls to resume", step_s=0.1)
                # The first call after the restart already succeeds (stale pooled connections
                # are pre-pinged and replaced), without restarting the proxy.
                assert statuses == [200], statuses
                for s in sessions:
                    if s is not sessions[1]:
                        _turn(client, s)

                # A crash-like stop (immediate: no checkpoint, WAL recovery on start).
                pg.stop("immediate")
                resp = _chat(client, sessions[2])
                assert resp.status_code == 503, resp.text
                pg.start()
                poll(
                    lambda: _chat_ok(client, sessions[2]),
                    deadline_s=DEADLINE_S,
                    what="calls to resume after the crash",
                    step_s=0.1,
                )
                for s in sessions:
                    if s is not sessions[2]:
                        _turn(client, s)
            answers = tap.answers()

        # Nothing acknowledged before, between or after the outages was lost.
        good = sessions[1:]
        assert all(len(s.acks) > acked_before[s.rollout_id] for s in sessions)
        check_acks_byte_for_byte(url, answers, good)
        ids = [s.rollout_id for s in sessions]
        assert run_async(lambda led: half_written(led, ids), url) == []
        for s in good:
            rows = run_async(partial(call_rows, rollout_id=s.rollout_id), url)
            # The refused calls left nothing behind: only the acknowledged ones are there.
            assert [r.status for r in rows] == ["captured"] * len(s.acks), rows
            result, build = finalize(url, s.rollout_id, s.acks[-1].response_id)
            assert build["outcome"] == "delivered", build
            assert delivered(result) == expected_chain(answers, s.acks)

        # The caught call: everything before it is intact; its own record is missing and its
        # rollout is masked for it, never delivered with a hole.
        rows = run_async(lambda led: call_rows(led, caught.rollout_id), url)
        statuses_by_response = {r.response_id: r.status for r in rows}
        assert lost_id not in statuses_by_response
        assert sum(r.status == "intent" for r in rows) == 1
        result, build = finalize(url, caught.rollout_id, caught.acks[-1].response_id)
        assert build["outcome"] == "masked"
        assert "capture_incomplete" in build["mask_reasons"]
        assert set(build["metrics"]["incomplete_reasons"]) == {"dangling_intent"}
        assert outage["healthz"] == 503


def _chat_ok(client: httpx.Client, s: Session) -> bool:
    resp = _chat(client, s)
    if resp.status_code == 200:
        s.accept(resp.json())
        return True
    return False


def _outage_checks(client: httpx.Client, s: Session, base: str) -> dict[str, Any]:
    """While the database is down: every capture call fails with 503 in its dialect."""
    resp = _chat(client, s)
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "capture_unavailable" and "not sent to the model" in error["message"]
    sdk = openai.OpenAI(
        base_url=f"{base}/ng-rollout/{s.rollout_id}/training-token-capture/v1",
        api_key="sk-test",
        max_retries=0,
    )
    with pytest.raises(openai.InternalServerError) as oai:
        sdk.chat.completions.create(model="smol", messages=s.body()["messages"])
    assert oai.value.status_code == 503
    resp = _anthropic(client, s.rollout_id, "hello")
    assert resp.status_code == 503
    assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "api_error"
    ant = anthropic.Anthropic(
        base_url=f"{base}/ng-rollout/{s.rollout_id}/training-token-capture",
        api_key="sk-test",
        max_retries=0,
    )
    with pytest.raises(anthropic.ServiceUnavailableError):
        ant.messages.create(
            model="smol", max_tokens=32, messages=[{"role": "user", "content": "hi"}]
        )
    # The ledger API says the same thing, with its own error body.
    put = client.put(
        f"/ledger/v1/rollouts/{s.rollout_id}/calls/outage-1",
        json={
            "record": {
                "prompt_token_ids": [1, 2],
                "generation_token_ids": [3],
                "generation_log_probs": [-0.5],
            }
        },
    )
    assert put.status_code == 503 and put.json()["error"]["code"] == "unavailable", put.text
    return {"healthz": client.get("/healthz").status_code}


# --------------------------------------------------------------------------- 4c: upstream faults


@dataclass
class FaultStack:
    engine: SimEngine
    tap: UpstreamTap
    url: str
    db_url: str

    def base(self, rollout_id: str) -> str:
        return f"{self.url}/ng-rollout/{rollout_id}/training-token-capture"


@pytest.fixture
def fault_stack(db_url: str, request: pytest.FixtureRequest) -> Iterator[FaultStack]:
    timeout = getattr(request, "param", 600.0)
    engine = new_engine(seed=3)
    tap = UpstreamTap(engine.app)
    with ThreadedServer(tap) as upstream:
        settings = load_settings(
            db=db_url, upstream=upstream.url + "/v1", upstream_timeout_s=timeout
        )
        with ThreadedServer(create_app(settings), lifespan="on", startup_timeout=60) as proxy:
            yield FaultStack(engine, tap, proxy.url, db_url)


CLIENTS = ["chat", "chat-stream", "responses", "responses-stream", "anthropic", "anthropic-stream"]
# ``drop``: the connection closes after the status line and headers, before any body byte;
# ``cut``: it closes half-way through the body.  (The simulator's own ``drop`` fault cannot
# serve here: on a non-streaming request, which is all the proxy sends, uvicorn turns its
# exception into a plain 500 answer instead of a broken connection.)
FAULT_STATUS = {"http_500": 500, "hang": 504, "drop": 502, "cut": 502}
CUT_FRACTION = {"drop": 0.0, "cut": 0.5}


def _inject(stack: FaultStack, fault: str, marker: str) -> None:
    if fault in CUT_FRACTION:
        stack.tap.cut(marker, CUT_FRACTION[fault])
    else:
        stack.engine.faults.next(fault)  # type: ignore[arg-type]


def _call_through_sdk(stack: FaultStack, client: str, rollout_id: str, text: str) -> Any:
    """Make one call with the harness's SDK; return what the SDK raised, or the stream's
    failure event (a streaming Responses harness gets a failed stream on HTTP 200)."""
    msgs = [{"role": "user", "content": text}]
    if client.startswith("anthropic"):
        ant = anthropic.Anthropic(
            base_url=stack.base(rollout_id), api_key="sk-test", max_retries=0, timeout=30.0
        )
        try:
            if client == "anthropic":
                ant.messages.create(model="smol", max_tokens=64, messages=msgs)  # type: ignore[arg-type]
            else:
                with ant.messages.stream(model="smol", max_tokens=64, messages=msgs) as events:  # type: ignore[arg-type]
                    for _ in events:
                        pass
        except anthropic.APIError as exc:
            return exc
        raise AssertionError("the Anthropic SDK raised nothing")
    oai = openai.OpenAI(
        base_url=stack.base(rollout_id) + "/v1", api_key="sk-test", max_retries=0, timeout=30.0
    )
    try:
        if client == "chat":
            oai.chat.completions.create(model="smol", messages=msgs)  # type: ignore[arg-type]
        elif client == "chat-stream":
            for _ in oai.chat.completions.create(model="smol", messages=msgs, stream=True):  # type: ignore[arg-type]
                pass
        elif client == "responses":
            oai.responses.create(model="smol", input=text)
        else:
            frames = list(oai.responses.create(model="smol", input=text, stream=True))
            return frames[-1]
    except openai.APIError as exc:
        return exc
    raise AssertionError("the OpenAI SDK raised nothing")


def _check_error(client: str, fault: str, outcome: Any) -> None:
    status = FAULT_STATUS[fault]
    if client == "responses-stream":
        assert outcome.type == "response.failed", outcome
        assert outcome.response.error.code == "server_error"
        return
    if client.startswith("anthropic"):
        expected: type[anthropic.APIStatusError] = {
            500: anthropic.InternalServerError,
            502: anthropic.InternalServerError,
            504: anthropic.GatewayTimeoutError,
        }[status]
        assert type(outcome) is expected, repr(outcome)
        assert outcome.status_code == status
        body: Any = outcome.body
        kind = body["error"]["type"]  # the Anthropic envelope, not OpenAI's
        assert kind == ("timeout_error" if status == 504 else "api_error"), outcome.body
        return
    assert type(outcome) is openai.InternalServerError, repr(outcome)
    assert outcome.status_code == status
    assert isinstance(outcome.body, dict) and "message" in outcome.body, outcome.body
    if status != 500:
        code = "upstream_timeout" if status == 504 else "upstream_unavailable"
        assert outcome.body.get("code") == code, outcome.body


def _check_rollout_after_fault(stack: FaultStack, rollout_id: str, fault: str) -> None:
    # Nothing reached the harness: the attempt stays open for a retry to settle (issue 11);
    # none comes here, so freeze counts it as a lost call.
    reasons = run_async(lambda led: incomplete_reasons(led, rollout_id), stack.db_url)
    assert reasons == [], reasons
    rows = run_async(lambda led: call_rows(led, rollout_id), stack.db_url)
    assert [r.status for r in rows] == ["intent"], rows
    assert run_async(lambda led: half_written(led, [rollout_id]), stack.db_url) == []
    _, build = finalize(stack.db_url, rollout_id, None)
    reasons = run_async(lambda led: incomplete_reasons(led, rollout_id), stack.db_url)
    assert reasons == ["upstream_error"], reasons
    assert build["outcome"] == "masked" and "capture_incomplete" in build["mask_reasons"]
    assert "upstream_error" in build["metrics"]["incomplete_reasons"]


def _run_fault_matrix(stack: FaultStack, fault: str, rid: Rid) -> None:
    for client in CLIENTS:
        r = rid(f"{fault}-{client}")
        marker = f"CUT-{r}"
        _inject(stack, fault, marker)
        outcome = _call_through_sdk(stack, client, r, f"please answer {marker}")
        _check_error(client, fault, outcome)
        assert stack.engine.faults.pending == 0
        _check_rollout_after_fault(stack, r, fault)
        if fault in CUT_FRACTION:
            assert stack.tap.statuses(marker) == [200]  # the upstream did answer, half-way


@pytest.mark.parametrize("fault", ["http_500", "drop", "cut"])
def test_upstream_fault_reaches_harness_in_its_dialect(
    fault_stack: FaultStack, fault: str, rid: Rid
) -> None:
    _run_fault_matrix(fault_stack, fault, rid)
    # The service is unharmed: the next call is captured and rebuilds.
    r = rid("after")
    sdk = openai.OpenAI(base_url=fault_stack.base(r) + "/v1", api_key="sk-test", max_retries=0)
    out = sdk.chat.completions.create(model="smol", messages=[{"role": "user", "content": "ok"}])
    _, build = finalize(fault_stack.db_url, r, out.id)
    assert build["outcome"] == "delivered", build


@pytest.mark.parametrize("fault_stack", [1.0], indirect=True)
def test_upstream_hang_times_out_in_its_dialect(fault_stack: FaultStack, rid: Rid) -> None:
    _run_fault_matrix(fault_stack, "hang", rid)
    # The hung upstream requests were released when the proxy gave up on them.
    poll(
        lambda: fault_stack.engine.faults.hanging == 0,
        deadline_s=DEADLINE_S,
        what="hung upstream requests to end",
    )
