"""End to end against real vLLM (CPU build) serving SmolLM2-135M (issue #6 point 10).

    SDK (openai / anthropic) -> `rollout-ledger serve` (a real process) -> recorder -> vLLM

The recorder is a small HTTP shim in this process that forwards every request to vLLM and
keeps each chat-completions answer exactly as vLLM sent it: those are the ids and log-probs
the engine sampled, and the ground truth every check here compares with.  Nothing is
compared with the ledger's own view of itself.

Skipped unless ``ROLLOUT_LEDGER_VLLM_URL`` names a running vLLM (``scripts/e2e-vllm.sh`` starts
one and sets it).  Every test runs on a SQLite file, and on Postgres too when
``ROLLOUT_LEDGER_TEST_PG_URL`` is set.  Each test drives one rollout, then:

1. checks the ledger's calls and lineage edges (``GET /ledger/v1/rollouts/<id>``) against
   vLLM's ids: lengths per call; a ``verified`` edge wherever vLLM's next prompt really
   extends the previous prompt + generation; a ``drifted`` edge whose mismatch position is
   the first position where vLLM's ids actually diverge, wherever they do not;
2. finalizes it through the service (``finalize_rollout_token_capture`` with the HTTP
   backend, ``deliver="one"``): a verified chain must be delivered with every call's prompt,
   generated ids and log-probs equal to vLLM's, token for token; a drifted rollout must be
   masked, never delivered;
3. runs ``rollout-ledger collect --deliver all-chains`` (the CLI, against the service): every
   chain it writes, masked or not, must equal vLLM's ids call by call, and the chains must
   split the conversation exactly at the drifted edges; a delivered rollout is then retired,
   a masked one keeps its records.

What SmolLM2 + vLLM 0.32 actually do (docs/vllm-e2e.md): free-text turns re-render to the
same ids, so a free-text conversation is one verified chain.  A tool call comes from
structured decoding (``tool_choice`` required/any), its ids do not re-tokenize to its text,
and the SmolLM2 chat template renders an assistant tool-call turn as its (empty) content
only, so the turn after a tool call never extends the tool call's tokens: lineage drift,
diagnosed and masked.  The tool definitions are ``strict`` so the grammar also constrains
the arguments to the schema (without it vLLM fills ``arguments`` with a bare JSON string).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ledger.client import RemoteLedger
from ledger.delivery import finalize_rollout_token_capture
from ledger.sim import ThreadedServer

VLLM_URL = os.environ.get("ROLLOUT_LEDGER_VLLM_URL", "").rstrip("/")
PG_URL = os.environ.get("ROLLOUT_LEDGER_TEST_PG_URL", "")
MODEL = os.environ.get("ROLLOUT_LEDGER_VLLM_MODEL", "smol")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLM_URL,
        reason="real vLLM not configured: run scripts/e2e-vllm.sh (it sets "
        "ROLLOUT_LEDGER_VLLM_URL)",
    ),
]

# Not marked `postgres`: that marker turns a skip into a failure under ROLLOUT_LEDGER_REQUIRE_PG,
# and this whole module skips without vLLM.
BACKENDS = ["sqlite", *(["postgres"] if PG_URL else [])]
GENERATING = ("/v1/chat/completions", "/v1/completions")
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "upgrade", "host", "content-length", "te"}
)
REQUEST_TIMEOUT_S = 300.0

WEATHER_TOOL_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "City name"}},
    "required": ["city"],
    "additionalProperties": False,
}
OPENAI_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            "parameters": WEATHER_TOOL_SCHEMA,
            "strict": True,
        },
    }
]
ANTHROPIC_TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "input_schema": WEATHER_TOOL_SCHEMA,
        "strict": True,
    }
]
# anthropic >= 2 has no `temperature` argument (newer Claude models refuse sampling params);
# the proxy passes the body field on to vLLM, so greedy decoding goes in extra_body.
GREEDY = {"temperature": 0}
WEATHER = {"Paris": "Sunny, 22 C", "London": "Light rain, 14 C"}


# --------------------------------------------------------------------------- recorder


@dataclass
class Exchange:
    """One generating request as it crossed the wire to vLLM, and vLLM's answer."""

    path: str
    request: dict[str, Any]
    status: int
    response: dict[str, Any]
    seconds: float

    @property
    def prompt(self) -> list[int]:
        ids = self.response.get("prompt_token_ids")
        if ids is None:  # completions carry it on the choice
            ids = self.choice["prompt_token_ids"]
        return list(ids)

    @property
    def choice(self) -> dict[str, Any]:
        choices = self.response["choices"]
        assert len(choices) == 1, f"expected one choice, vLLM sent {len(choices)}"
        return dict(choices[0])

    @property
    def generated(self) -> list[int]:
        return list(self.choice["token_ids"])

    @property
    def log_probs(self) -> list[float]:
        return [float(e["logprob"]) for e in self.choice["logprobs"]["content"]]

    @property
    def cumulative(self) -> list[int]:
        return self.prompt + self.generated


class Recorder:
    """An HTTP shim between the proxy and vLLM that keeps every generating answer."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.url = ""
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._client: httpx.AsyncClient | None = None
        self.app = Starlette(
            routes=[
                Route(
                    "/{path:path}",
                    self._forward,
                    methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                )
            ],
            lifespan=self._lifespan,
        )

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with httpx.AsyncClient(base_url=self.upstream, timeout=REQUEST_TIMEOUT_S) as client:
            self._client = client
            yield

    async def _forward(self, request: Request) -> Response:
        assert self._client is not None
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        started = time.perf_counter()
        resp = await self._client.request(
            request.method,
            request.url.path,
            params=request.url.query or None,
            content=body,
            headers=headers,
        )
        seconds = time.perf_counter() - started
        if request.method == "POST" and request.url.path in GENERATING:
            try:
                answer = json.loads(resp.content)
            except ValueError:
                answer = {"_raw": resp.text}
            with self._lock:
                self.exchanges.append(
                    Exchange(request.url.path, json.loads(body), resp.status_code, answer, seconds)
                )
        out = {
            k: v
            for k, v in resp.headers.items()
            if k.lower() not in HOP_BY_HOP and k.lower() != "content-encoding"
        }
        return Response(resp.content, status_code=resp.status_code, headers=out)

    def by_id(self, response_id: str) -> Exchange:
        with self._lock:
            found = [e for e in self.exchanges if e.response.get("id") == response_id]
        assert len(found) == 1, f"{len(found)} recorded vLLM answers with id {response_id!r}"
        return found[0]


# --------------------------------------------------------------------------- the proxy process


@dataclass
class Proxy:
    backend: str
    url: str
    db_url: str
    recorder: Recorder
    log_path: Path
    proc: subprocess.Popen[bytes]
    workdir: Path

    def base(self, rollout_id: str) -> str:
        return f"{self.url}/ng-rollout/{rollout_id}/training-token-capture"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("rollout-ledger")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from ledger.cli import main; main()"]


def _child_env() -> dict[str, str]:
    # Only this test's settings: no API tokens or ledger settings leak in from the caller.
    return {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LEDGER_")}


def _start_serve(backend: str, db_url: str, recorder: Recorder, workdir: Path) -> Proxy:
    port = _free_port()
    log_path = workdir / f"serve-{backend}.log"
    cmd = [
        *_cli(),
        "serve",
        "--upstream",
        recorder.url + "/v1",
        "--db",
        db_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), cwd=workdir
        )
    proxy = Proxy(backend, f"http://127.0.0.1:{port}", db_url, recorder, log_path, proc, workdir)
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"rollout-ledger serve exited with {proc.returncode}:\n{proxy.log_tail()}"
            )
        try:
            if httpx.get(proxy.url + "/healthz", timeout=2).status_code == 200:
                return proxy
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            _stop(proc)
            raise TimeoutError(f"rollout-ledger serve did not become healthy:\n{proxy.log_tail()}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the serve process this module started (its pid only)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def recorder() -> Iterator[Recorder]:
    try:
        version = httpx.get(VLLM_URL + "/version", timeout=10).json().get("version")
    except (httpx.HTTPError, ValueError) as exc:
        pytest.fail(f"ROLLOUT_LEDGER_VLLM_URL={VLLM_URL} does not answer: {exc}")
    print(f"\n[e2e] vLLM {version} at {VLLM_URL}, model {MODEL!r}")
    rec = Recorder(VLLM_URL)
    with ThreadedServer(rec.app, lifespan="on", startup_timeout=30) as server:
        rec.url = server.url
        yield rec


@pytest.fixture(scope="module", params=BACKENDS)
def proxy(
    request: pytest.FixtureRequest, recorder: Recorder, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    backend = str(request.param)
    workdir = tmp_path_factory.mktemp(f"e2e-{backend}")
    if backend == "sqlite":
        db_url = f"sqlite+aiosqlite:///{workdir / 'ledger.db'}"
    else:
        db_url = PG_URL
        if db_url.startswith("postgresql://"):
            db_url = "postgresql+asyncpg://" + db_url[len("postgresql://") :]
    started = time.perf_counter()
    proxy = _start_serve(backend, db_url, recorder, workdir)
    took = time.perf_counter() - started
    print(f"[e2e] rollout-ledger serve ({backend}) healthy in {took:.1f} s")
    try:
        yield proxy
    finally:
        _stop(proxy.proc)
        print(f"[e2e] rollout-ledger serve ({backend}) stopped (pid {proxy.proc.pid})")


# --------------------------------------------------------------------------- conversations


@dataclass
class Turn:
    label: str
    response_id: str
    seconds: float
    dialect: str
    text: str  # what the harness got: the answer's text ...
    calls: list[tuple[str, str, Any]]  # ... and its tool calls (id, name, arguments)


@dataclass
class Conversation:
    rollout_id: str
    turns: list[Turn] = field(default_factory=list)

    def add(self, label: str, answer: Any, started: float) -> None:
        """Keep what the harness got back (an openai ChatCompletion or anthropic Message)."""
        seconds = time.perf_counter() - started
        assert answer.id, f"{label}: the harness got no response id"
        if isinstance(answer, anthropic.types.Message):
            text = "".join(b.text for b in answer.content if b.type == "text")
            calls = [(b.id, b.name, b.input) for b in answer.content if b.type == "tool_use"]
            dialect = "anthropic"
        else:
            message = answer.choices[0].message
            text = message.content or ""
            calls = [
                (c.id, c.function.name, json.loads(c.function.arguments))
                for c in message.tool_calls or ()
            ]
            dialect = "openai"
        self.turns.append(Turn(label, answer.id, seconds, dialect, text, calls))


def _rid(proxy: Proxy, name: str) -> str:
    return f"e2e-{proxy.backend}-{name}-{uuid.uuid4().hex[:8]}"


def _openai(proxy: Proxy, rid: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=proxy.base(rid) + "/v1",
        api_key="sk-e2e",
        max_retries=0,
        timeout=REQUEST_TIMEOUT_S,
    )


def _anthropic(proxy: Proxy, rid: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=proxy.base(rid), api_key="sk-e2e", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )


def _assistant_echo(message: Any) -> dict[str, Any]:
    """What an OpenAI-SDK harness appends to its history for an assistant answer."""
    echo: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        echo["tool_calls"] = [call.model_dump(exclude_none=True) for call in message.tool_calls]
    return echo


def _only_tool_call(message: Any, label: str) -> Any:
    calls = message.tool_calls or []
    assert len(calls) == 1, f"{label}: expected one tool call, got {message!r}"
    call = calls[0]
    assert call.function.name == "get_weather", f"{label}: called {call.function.name!r}"
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict) and isinstance(args.get("city"), str), (
        f"{label}: arguments {call.function.arguments!r} are not {{'city': str}}"
    )
    return call


def _city(arguments: dict[str, Any], fallback: str) -> str:
    city = str(arguments.get("city") or "")
    return next((c for c in WEATHER if c.lower() in city.lower()), fallback)


# --------------------------------------------------------------------------- checks


@dataclass
class Expect:
    """Turns whose prompt does NOT extend the previous turn's ids (drift after a tool call)."""

    drift_after_tool_call: frozenset[int] = frozenset()

    @property
    def delivered(self) -> bool:
        return not self.drift_after_tool_call


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _token_parent(exchanges: list[Exchange], k: int) -> int | None:
    """From vLLM's ids alone: the earlier call whose prompt + generation is the longest
    prefix of call ``k``'s prompt (what the ledger must prove as the verified parent)."""
    prompt = exchanges[k].prompt
    best: int | None = None
    for j in range(k):
        cumulative = exchanges[j].cumulative
        longer = best is None or len(cumulative) > len(exchanges[best].cumulative)
        if longer and exchanges[j].generated and prompt[: len(cumulative)] == cumulative:
            best = j
    return best


def _chains(parents: list[int | None]) -> list[list[int]]:
    """Root-to-leaf paths of the token-parent forest, by leaf."""
    has_child = {p for p in parents if p is not None}
    chains = []
    for leaf in range(len(parents)):
        if leaf in has_child:
            continue
        path: list[int] = [leaf]
        while (up := parents[path[-1]]) is not None:
            path.append(up)
        chains.append(path[::-1])
    return chains


def _assert_harness_saw_vllm_answer(turn: Turn, ex: Exchange) -> None:
    """The answer the SDK parsed (JSON or replayed SSE, in its dialect) is vLLM's message."""
    message = ex.choice["message"]
    assert turn.text == (message.get("content") or ""), (turn.label, turn.text, message)
    vllm_calls = message.get("tool_calls") or []
    assert len(turn.calls) == len(vllm_calls), (turn.label, turn.calls, vllm_calls)
    for (call_id, name, arguments), call in zip(turn.calls, vllm_calls, strict=True):
        assert (call_id, name) == (call["id"], call["function"]["name"]), (turn.label, call)
        sent = json.loads(call["function"]["arguments"])
        if turn.dialect == "anthropic" and not isinstance(sent, dict):
            # Anthropic `input` must be an object: the dialect maps anything else to {}.
            assert arguments == {}, (turn.label, arguments, sent)
        else:
            assert arguments == sent, (turn.label, arguments, sent)


def _carriers(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in response["output"] if "generation_token_ids" in i]


def _assert_chain_equals_vllm(
    response: dict[str, Any], exchanges: list[Exchange], what: str
) -> None:
    """Each carrier (one per call, in chain order) equals vLLM's answer for that call."""
    carriers = _carriers(response)
    assert len(carriers) == len(exchanges), (
        f"{what}: {len(carriers)} calls delivered, expected {len(exchanges)}"
    )
    for k, (item, ex) in enumerate(zip(carriers, exchanges, strict=True)):
        assert item["prompt_token_ids"] == ex.prompt, (
            f"{what}: call {k} prompt differs from vLLM's prompt_token_ids at "
            f"{_first_difference(item['prompt_token_ids'], ex.prompt)}"
        )
        assert item["generation_token_ids"] == ex.generated, (
            f"{what}: call {k} generated ids differ from vLLM's token_ids"
        )
        assert item["generation_log_probs"] == ex.log_probs, (
            f"{what}: call {k} log-probs differ from vLLM's"
        )
    total_gen = sum(len(e.generated) for e in exchanges)
    assert response["usage"]["output_tokens"] == total_gen, f"{what}: usage.output_tokens"


def _audit(proxy: Proxy, rid: str) -> dict[str, Any]:
    resp = httpx.get(f"{proxy.url}/ledger/v1/rollouts/{rid}", timeout=30)
    assert resp.status_code == 200, resp.text
    detail: dict[str, Any] = resp.json()
    return detail


def _finalize_one(proxy: Proxy, result: dict[str, Any]) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        source = RemoteLedger(proxy.url)
        try:
            build = await finalize_rollout_token_capture(result, source)
            assert build is not None
            return build
        finally:
            await source.close()

    return asyncio.run(run())


def _collect_all_chains(
    proxy: Proxy, result: dict[str, Any], name: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    inp = proxy.workdir / f"{name}.in.jsonl"
    out = proxy.workdir / f"{name}.out.jsonl"
    inp.write_text(json.dumps(result) + "\n")
    cmd = [*_cli(), "collect", "-i", str(inp), "-o", str(out), "--db", proxy.url]
    cmd += ["--deliver", "all-chains", "--json"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=_child_env(), timeout=120, check=False
    )
    assert done.returncode == 0, f"collect failed ({done.returncode}): {done.stderr}"
    report = json.loads(done.stdout)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return report, rows


def check_rollout(proxy: Proxy, conv: Conversation, expect: Expect, name: str) -> dict[str, Any]:
    rid = conv.rollout_id
    exchanges = [proxy.recorder.by_id(t.response_id) for t in conv.turns]
    for t, ex in zip(conv.turns, exchanges, strict=True):
        assert ex.status == 200, f"{t.label}: vLLM answered {ex.status}"
        assert len(ex.generated) == len(ex.log_probs) > 0, f"{t.label}: no ids/log-probs"
        _assert_harness_saw_vllm_answer(t, ex)

    # What vLLM's own ids say: each call's token parent, and where the conversation's parent
    # (the previous turn) is not it.
    parents = [_token_parent(exchanges, k) for k in range(len(exchanges))]
    drifted = frozenset(k for k in range(1, len(exchanges)) if parents[k] != k - 1)
    assert drifted == expect.drift_after_tool_call, (
        f"turns whose prompt does not extend the previous turn: "
        f"{sorted(conv.turns[k].label for k in drifted)}; this test expects "
        f"{sorted(conv.turns[k].label for k in expect.drift_after_tool_call)} (a free-text turn "
        "that no longer re-renders to its sampled ids, or a tool call that now does?)"
    )

    # 1. The ledger: one captured call per turn, lengths and lineage as vLLM's ids say.
    detail = _audit(proxy, rid)
    assert detail["incomplete_events"] == [], detail["incomplete_events"]
    by_response = {c["response_id"]: c for c in detail["calls"]}
    calls = [by_response.get(t.response_id) for t in conv.turns]
    assert all(c is not None for c in calls), f"calls missing from the ledger: {detail['calls']}"
    assert len(detail["calls"]) == len(conv.turns), detail["calls"]
    call_ids = []
    for t, call, ex in zip(conv.turns, calls, exchanges, strict=True):
        assert call is not None
        assert call["status"] == "captured", f"{t.label}: {call}"
        assert call["prompt_len"] == len(ex.prompt), f"{t.label}: prompt_len"
        assert call["generation_len"] == len(ex.generated), f"{t.label}: generation_len"
        call_ids.append(call["model_call_id"])
    index = {cid: k for k, cid in enumerate(call_ids)}
    edges: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for e in detail["edges"]:
        edges.setdefault((index[e["child"]], e["status"]), []).append(e)
    edge_report = []
    for k in range(1, len(conv.turns)):
        label = conv.turns[k].label
        verified = edges.get((k, "verified"), [])
        drifts = edges.get((k, "drifted"), [])
        parent = parents[k]
        if parent is None:
            assert not verified, f"{label}: verified edge without a token parent: {verified}"
        else:
            assert len(verified) == 1 and index[verified[0]["parent"]] == parent, (
                f"{label}: expected a verified edge to {conv.turns[parent].label}: {verified}"
            )
            assert verified[0]["shared_len"] == len(exchanges[parent].cumulative), verified
            edge_report.append(
                f"{label} -> {conv.turns[parent].label}: verified "
                f"({verified[0]['shared_len']} tokens shared)"
            )
        if k in drifted:
            pos = _first_difference(exchanges[k].prompt, exchanges[k - 1].cumulative)
            assert len(drifts) == 1, f"{label}: expected one drifted edge: {detail['edges']}"
            edge = drifts[0]
            assert index[edge["parent"]] == k - 1 and edge["method"] == "conversation", edge
            assert edge["mismatch_pos"] == pos, (edge, pos)
            edge_report.append(
                f"{label} -> {conv.turns[k - 1].label}: drifted at token {pos} of "
                f"{len(exchanges[k - 1].cumulative)} ({edge['mismatch_kind']}; vLLM sampled "
                f"{exchanges[k - 1].cumulative[pos : pos + 3]}..., the re-rendered prompt has "
                f"{exchanges[k].prompt[pos : pos + 3]}...)"
            )
        else:
            assert not drifts, f"{label}: unexpected drifted edge: {drifts}"
    chains = _chains(parents)

    # 2. finalize (deliver="one") through the service.
    result: dict[str, Any] = {
        "_ng_rollout_id": rid,
        "response": {"id": conv.turns[-1].response_id, "output": []},
    }
    build = _finalize_one(proxy, result)
    if expect.delivered:
        assert build["outcome"] == "delivered", (build["outcome"], build["mask_reasons"])
        assert not result.get("mask_sample")
        _assert_chain_equals_vllm(result["response"], exchanges, f"{name} delivered")
        assert result["_ng_token_capture"]["delivered_fraction"] == 1.0, result["_ng_token_capture"]
    else:
        assert build["outcome"] == "masked", (build["outcome"], build["mask_reasons"])
        assert result.get("mask_sample") is True
        assert build["mask_reasons"], build
        assert result["response"]["output"] == [], "a masked rollout must not deliver tokens"
        roots_with_drift = sum(1 for k in drifted if parents[k] is None)
        assert result["_ng_token_capture"]["unresolved_parent_calls"] == roots_with_drift, result[
            "_ng_token_capture"
        ]

    # 3. collect --deliver all-chains (the CLI, against the service): every chain == vLLM.
    fresh = {"_ng_rollout_id": rid, "response": {"id": conv.turns[-1].response_id, "output": []}}
    report, rows = _collect_all_chains(proxy, fresh, name)
    assert report["written"] == 1 and report["finalized"] == 1, report
    assert len(rows) == len(chains), (
        f"collect wrote {len(rows)} chains, expected {len(chains)} "
        f"({[[conv.turns[k].label for k in c] for c in chains]}): "
        f"{[r.get('_ng_trajectory') for r in rows]}"
    )
    remaining = list(chains)
    for row in rows:
        seen = [
            (c["prompt_token_ids"], c["generation_token_ids"]) for c in _carriers(row["response"])
        ]
        match = next(
            (
                c
                for c in remaining
                if [(exchanges[k].prompt, exchanges[k].generated) for k in c] == seen
            ),
            None,
        )
        assert match is not None, f"chain {row.get('_ng_trajectory')} matches no vLLM chain"
        remaining.remove(match)
        what = f"{name} chain {[conv.turns[k].label for k in match]} {row['_ng_trajectory']}"
        _assert_chain_equals_vllm(row["response"], [exchanges[k] for k in match], what)
        assert bool(row.get("mask_sample")) is not expect.delivered, row.get("_ng_trajectory")
    if expect.delivered:
        assert rows[0]["_ng_trajectory"]["role"] == "terminal", rows[0]["_ng_trajectory"]
        assert report["retired"] == 1, report
    else:
        assert report["masked"] == 1 and report["retired"] == 0, report
    state = _audit(proxy, rid)["rollout"]["state"]
    assert state == ("retired" if expect.delivered else "frozen"), state

    summary = {
        "name": name,
        "rollout": rid,
        "backend": proxy.backend,
        "outcome": build["outcome"],
        "mask_reasons": build["mask_reasons"],
        "chains": [[conv.turns[k].label for k in c] for c in chains],
        "calls": [
            {
                "turn": t.label,
                "prompt": len(ex.prompt),
                "generated": len(ex.generated),
                "finish": ex.choice.get("finish_reason"),
                "client_s": round(t.seconds, 2),
                "vllm_s": round(ex.seconds, 2),
            }
            for t, ex in zip(conv.turns, exchanges, strict=True)
        ],
        "edges": edge_report,
    }
    print(f"[e2e] {name} ({proxy.backend}): {build['outcome']} {build['mask_reasons']}")
    for c in summary["calls"]:
        print(f"[e2e]   {c}")
    for e in edge_report:
        print(f"[e2e]   edge {e}")
    _write_report(summary)
    return summary


def _write_report(summary: dict[str, Any]) -> None:
    path = os.environ.get("ROLLOUT_LEDGER_E2E_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(summary) + "\n")


# --------------------------------------------------------------------------- the rollouts


def test_openai_chat_free_text_delivers_verified_chain(proxy: Proxy) -> None:
    """Three free-text turns (the second streamed): one verified chain, delivered exactly."""
    rid = _rid(proxy, "openai-chat")
    client = _openai(proxy, rid)
    conv = Conversation(rid)
    messages: list[Any] = [
        {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "Name a primary color."},
    ]
    t0 = time.perf_counter()
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    conv.add("chat-1", first, t0)
    assert first.model_extra is None or "prompt_token_ids" not in (first.model_extra or {})
    messages += [
        _assistant_echo(first.choices[0].message),
        {"role": "user", "content": "Name another one."},
    ]
    t0 = time.perf_counter()
    with client.chat.completions.stream(
        model=MODEL,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream_options={"include_usage": True},
    ) as stream:
        second = stream.get_final_completion()
    conv.add("chat-2 (stream)", second, t0)
    messages += [
        _assistant_echo(second.choices[0].message),
        {"role": "user", "content": "Thank you. Say goodbye."},
    ]
    t0 = time.perf_counter()
    third = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    conv.add("chat-3", third, t0)
    check_rollout(proxy, conv, Expect(), "openai-chat")


def test_openai_tool_calls_drift_is_diagnosed(proxy: Proxy) -> None:
    """Two tool round trips: each turn after a tool call drifts (and is diagnosed as such);
    the free-text turn before the second tool call still extends its parent."""
    rid = _rid(proxy, "openai-tools")
    client = _openai(proxy, rid)
    conv = Conversation(rid)
    messages: list[Any] = [
        {"role": "system", "content": "You are a weather assistant. Use the tools."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    t0 = time.perf_counter()
    call1 = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=OPENAI_TOOLS,
        tool_choice="required",
        max_tokens=64,
        temperature=0,
    )
    conv.add("tool-call-1", call1, t0)
    tc1 = _only_tool_call(call1.choices[0].message, "tool-call-1")
    messages += [
        _assistant_echo(call1.choices[0].message),
        {
            "role": "tool",
            "tool_call_id": tc1.id,
            "content": WEATHER[_city(json.loads(tc1.function.arguments), "Paris")],
        },
    ]
    t0 = time.perf_counter()
    answer1 = client.chat.completions.create(
        model=MODEL, messages=messages, tools=OPENAI_TOOLS, max_tokens=32, temperature=0
    )
    conv.add("answer-1", answer1, t0)
    assert not answer1.choices[0].message.tool_calls, answer1.choices[0].message
    messages += [
        _assistant_echo(answer1.choices[0].message),
        {"role": "user", "content": "And in London?"},
    ]
    # The second tool call is streamed: the proxy replays the tool call as SSE deltas.
    t0 = time.perf_counter()
    with client.chat.completions.stream(
        model=MODEL,
        messages=messages,
        tools=OPENAI_TOOLS,
        tool_choice="required",
        max_tokens=64,
        temperature=0,
    ) as stream:
        call2 = stream.get_final_completion()
    conv.add("tool-call-2 (stream)", call2, t0)
    tc2 = _only_tool_call(call2.choices[0].message, "tool-call-2")
    messages += [
        _assistant_echo(call2.choices[0].message),
        {
            "role": "tool",
            "tool_call_id": tc2.id,
            "content": WEATHER[_city(json.loads(tc2.function.arguments), "London")],
        },
    ]
    t0 = time.perf_counter()
    answer2 = client.chat.completions.create(
        model=MODEL, messages=messages, tools=OPENAI_TOOLS, max_tokens=32, temperature=0
    )
    conv.add("answer-2", answer2, t0)
    check_rollout(proxy, conv, Expect(drift_after_tool_call=frozenset({1, 3})), "openai-tools")


def test_anthropic_messages_free_text_delivers_verified_chain(proxy: Proxy) -> None:
    """Three free-text Messages turns (the second streamed): delivered exactly."""
    rid = _rid(proxy, "anthropic-chat")
    client = _anthropic(proxy, rid)
    conv = Conversation(rid)
    system = "You are a concise assistant. Answer in one sentence."
    messages: list[Any] = [{"role": "user", "content": "Name a fruit."}]
    t0 = time.perf_counter()
    first = client.messages.create(
        model=MODEL, system=system, messages=messages, max_tokens=24, extra_body=GREEDY
    )
    conv.add("msg-1", first, t0)
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "text", "text": "Name another one."}]},
    ]
    t0 = time.perf_counter()
    with client.messages.stream(
        model=MODEL, system=system, messages=messages, max_tokens=24, extra_body=GREEDY
    ) as stream:
        second = stream.get_final_message()
    conv.add("msg-2 (stream)", second, t0)
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in second.content]},
        {"role": "user", "content": "Thank you. Say goodbye."},
    ]
    t0 = time.perf_counter()
    third = client.messages.create(
        model=MODEL, system=system, messages=messages, max_tokens=24, extra_body=GREEDY
    )
    conv.add("msg-3", third, t0)
    check_rollout(proxy, conv, Expect(), "anthropic-chat")


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "loose"])
def test_anthropic_tool_use_drift_is_diagnosed(proxy: Proxy, strict: bool) -> None:
    """tool_use (tool_choice any) -> tool_result -> text -> user follow-up: the turn after the
    tool call drifts (diagnosed), the follow-up extends the answer.

    ``loose``: without ``strict`` vLLM's grammar leaves the arguments free and SmolLM2 writes a
    bare JSON string (``"\\"Paris\\""``), which the Anthropic dialect hands the harness as
    ``input: {}``; the drift must be diagnosed all the same (the continuation is fingerprinted
    from what the harness saw, not from the chat arguments).
    """
    name = "anthropic-tools" if strict else "anthropic-tools-loose"
    rid = _rid(proxy, name)
    loose = [{k: v for k, v in ANTHROPIC_TOOLS[0].items() if k != "strict"}]
    tools: list[Any] = ANTHROPIC_TOOLS if strict else loose
    client = _anthropic(proxy, rid)
    conv = Conversation(rid)
    system = "You are a weather assistant. Use the tools."
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    t0 = time.perf_counter()
    with client.messages.stream(
        model=MODEL,
        system=system,
        messages=messages,
        tools=tools,
        tool_choice={"type": "any"},
        max_tokens=64,
        extra_body=GREEDY,
    ) as stream:
        call = stream.get_final_message()
    conv.add("tool_use (stream)", call, t0)
    assert call.stop_reason == "tool_use", call
    uses = [b for b in call.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather", call.content
    assert isinstance(uses[0].input, dict), uses
    if strict:
        assert isinstance(uses[0].input.get("city"), str), uses
    print(f"[e2e] {name}: tool_use input {uses[0].input!r}")
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in call.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": uses[0].id,
                    "content": WEATHER[_city(uses[0].input, "Paris")],
                }
            ],
        },
    ]
    t0 = time.perf_counter()
    answer = client.messages.create(
        model=MODEL,
        system=system,
        messages=messages,
        tools=tools,
        max_tokens=32,
        extra_body=GREEDY,
    )
    conv.add("answer", answer, t0)
    assert answer.stop_reason in ("end_turn", "max_tokens"), answer
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in answer.content]},
        {"role": "user", "content": "Thanks. Is that warm?"},
    ]
    t0 = time.perf_counter()
    follow = client.messages.create(
        model=MODEL,
        system=system,
        messages=messages,
        tools=tools,
        max_tokens=32,
        extra_body=GREEDY,
    )
    conv.add("follow-up", follow, t0)
    check_rollout(proxy, conv, Expect(drift_after_tool_call=frozenset({1})), name)
