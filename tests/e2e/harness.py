"""The end-to-end tier's machinery: a recorder in front of vLLM, `rollout-ledger serve` as a real
process, and one oracle that checks a rollout's capture against vLLM's own answers.

    harness (SDK / framework) -> `rollout-ledger serve` -> Recorder -> vLLM

The oracle never looks at model text.  Everything it expects is computed from what crossed the
wire to vLLM (the recorder keeps each request and vLLM's JSON answer verbatim), so the same
checks hold whatever the CPU makes SmolLM2 say:

1. **Upstream.**  Every generating request vLLM answered with 200, with one choice, sampled ids
   and one log-prob per id.  Without a supplied prefix, vLLM's ``prompt_token_ids`` equal its own
   ``/tokenize`` of the messages (and tools) the proxy sent; with one, they equal the supplied
   ids.  Each request after the first carries the whole history of the one before it (a
   dialect that dropped history would show here).
2. **Ledger records.**  One captured call per upstream answer, with vLLM's prompt and
   generation lengths; no incomplete events.
3. **Lineage**, derived from vLLM's ids alone: the token parent of call ``k`` is the earlier call
   whose prompt + generation is the longest prefix of ``k``'s prompt.  The ledger must store a
   ``verified`` edge exactly to it (with that shared length), and, wherever ``k``'s token parent
   is not ``k - 1`` (the call the conversation continues), a ``drifted`` edge to ``k - 1`` whose
   mismatch position is the first position where vLLM's ids really differ.
4. **Delivery** (``finalize_rollout_token_capture``, ``deliver="one"``): the terminal is the last
   call.  If its token-parent path reaches the first call, the rollout must be ``delivered``,
   every delivered call's prompt, sampled ids and log-probs equal to vLLM's (log-probs
   compared exactly), ``delivered_fraction`` = the path's sampled ids / all sampled ids.
   Otherwise it must be ``masked`` with a reason and no tokens.  A delivery that breaks either
   rule is a *false delivery*; the tier allows none.
5. **Collect** (``rollout-ledger collect --deliver all-chains``, the CLI): it writes exactly the
   root-to-leaf paths of the token-parent forest, each equal to vLLM's ids call by call; a
   delivered rollout is then retired, a masked one stays frozen with its records.

Finish reasons are reported, never asserted: a turn cut by ``max_tokens`` is just another
capture.  Each rollout's summary (framework, outcome, delivered fraction, drift positions, ...)
is appended to ``ROLLOUT_LEDGER_E2E_REPORT`` when set; ``scripts/e2e-vllm.sh`` tabulates it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ledger.client import RemoteLedger
from ledger.delivery import finalize_rollout_token_capture
from tests.support.net import free_port

VLLM_URL = os.environ.get("ROLLOUT_LEDGER_VLLM_URL", "").rstrip("/")
PG_URL = os.environ.get("ROLLOUT_LEDGER_TEST_PG_URL", "")
MODEL = os.environ.get("ROLLOUT_LEDGER_VLLM_MODEL", "smol")
# E2E_SUPPLY_PREFIX=1 serves with `supply_prefix_token_ids: true` (issue #11 point 1).
SUPPLY_PREFIX = os.environ.get("E2E_SUPPLY_PREFIX", "0") == "1"
# How many tool-using rollouts each framework drives per ledger backend (bounded: 1..8).
ROLLOUTS_PER_FRAMEWORK = max(1, min(8, int(os.environ.get("E2E_ROLLOUTS_PER_FRAMEWORK", "2"))))
# Every test module of the tier starts with `pytestmark = E2E_MARKS`.
E2E_MARKS = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLM_URL,
        reason="real vLLM not configured: run scripts/e2e-vllm.sh (it sets "
        "ROLLOUT_LEDGER_VLLM_URL)",
    ),
]
GENERATING = ("/v1/chat/completions", "/v1/completions")
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "upgrade", "host", "content-length", "te"}
)
REQUEST_TIMEOUT_S = 300.0
# Upper bound on the calls of one rollout: every agent loop below is bounded by its own
# framework limit too (max_turns, recursion_limit, max_iterations, a for loop).
MAX_CALLS_PER_ROLLOUT = 8

# The tool every tool-using rollout offers.  `city` is an enum so that a forced, strict tool
# call is short and bounded on any CPU (the grammar leaves no free-text string to ramble in).
CITIES = ("Paris", "London", "Tokyo", "Rome")
WEATHER = {
    "Paris": "Sunny, 22 C",
    "London": "Light rain, 14 C",
    "Tokyo": "Cloudy, 18 C",
    "Rome": "Clear, 25 C",
}
WEATHER_TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": list(CITIES), "description": "City name"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_DESCRIPTION = "Get the current weather for a city."
SYSTEM_TOOLS = "You are a weather assistant. Use the tools."
TOOL_MAX_TOKENS = 128
ANSWER_MAX_TOKENS = 48


def weather(city: Any) -> str:
    """The tool's answer: known cities by name, anything else a fixed fallback."""
    text = str(city or "")
    return next((v for k, v in WEATHER.items() if k.lower() in text.lower()), "Unknown city")


def question(k: int) -> str:
    return f"What is the weather in {CITIES[k % len(CITIES)]}?"


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

    @property
    def finish_reason(self) -> str:
        return str(self.choice.get("finish_reason"))

    @property
    def tool_calls(self) -> int:
        message = self.choice.get("message") or {}
        return len(message.get("tool_calls") or [])

    @property
    def supplied_prompt(self) -> list[int] | None:
        """The prompt ids the proxy supplied (prefix supply), if any."""
        kv = self.request.get("kv_transfer_params")
        if isinstance(kv, dict) and isinstance(kv.get("prompt_token_ids"), list):
            return [int(t) for t in kv["prompt_token_ids"]]
        return None


class Recorder:
    """An HTTP shim between the proxy and vLLM that keeps every generating exchange."""

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

    def mark(self) -> int:
        with self._lock:
            return len(self.exchanges)

    def since(self, mark: int) -> list[Exchange]:
        with self._lock:
            return list(self.exchanges[mark:])

    def tokenize_chat(self, request: dict[str, Any]) -> list[int]:
        """vLLM's own ``/tokenize`` of a chat request's messages (and tools), as it renders them."""
        body: dict[str, Any] = {
            "model": request.get("model", MODEL),
            "messages": request["messages"],
            "add_generation_prompt": request.get("add_generation_prompt", True),
        }
        for key in ("tools", "continue_final_message", "chat_template_kwargs", "chat_template"):
            if request.get(key) is not None:
                body[key] = request[key]
        resp = httpx.post(self.upstream + "/tokenize", json=body, timeout=60)
        assert resp.status_code == 200, f"vLLM /tokenize answered {resp.status_code}: {resp.text}"
        return [int(t) for t in resp.json()["tokens"]]


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


def cli() -> list[str]:
    script = Path(sys.executable).with_name("rollout-ledger")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from api.cli import app; app()"]


def child_env() -> dict[str, str]:
    # Only this test's settings: no API tokens or ledger settings leak in from the caller.
    return {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LEDGER_")}


def serve_config() -> str:
    """The serve config this run uses (YAML); empty unless a switch asks for something."""
    lines = []
    if SUPPLY_PREFIX:
        lines.append("supply_prefix_token_ids: true")
    return "\n".join(lines) + ("\n" if lines else "")


def start_serve(backend: str, db_url: str, recorder: Recorder, workdir: Path) -> Proxy:
    port = free_port()
    log_path = workdir / f"serve-{backend}.log"
    cmd = [*cli(), "serve", "--upstream", recorder.url + "/v1", "--db", db_url]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    config = serve_config()
    if config:
        config_path = workdir / "serve.yaml"
        config_path.write_text(config)
        cmd += ["--config", str(config_path)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=workdir
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
            stop(proc)
            raise TimeoutError(f"rollout-ledger serve did not become healthy:\n{proxy.log_tail()}")
        time.sleep(0.2)  # readiness poll with a deadline, not a wait for an outcome


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the serve process this module started (its pid only)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def db_url_for(backend: str, workdir: Path) -> str:
    if backend == "sqlite":
        return f"sqlite+aiosqlite:///{workdir / 'ledger.db'}"
    url = PG_URL
    if url.startswith("postgresql://"):
        url = "postgresql+asyncpg://" + url[len("postgresql://") :]
    return url


# --------------------------------------------------------------------------- rollouts


@dataclass
class Rollout:
    """One rollout as driven: its id, the framework, and what crossed the wire to vLLM."""

    framework: str
    name: str
    rollout_id: str
    exchanges: list[Exchange] = field(default_factory=list)
    seconds: float = 0.0
    stopped_by: str = ""  # a framework limit that ended the loop (reported, not a failure)


def new_rollout_id(proxy: Proxy, name: str) -> str:
    return f"e2e-{proxy.backend}-{name}-{uuid.uuid4().hex[:8]}"


@contextmanager
def driving(proxy: Proxy, framework: str, name: str) -> Iterator[Rollout]:
    """``with driving(proxy, fw, name) as r:`` drive one rollout at ``proxy.base(r.rollout_id)``;
    afterwards ``r.exchanges`` holds exactly the upstream exchanges it caused (tests run one
    rollout at a time)."""
    rollout = Rollout(framework, name, new_rollout_id(proxy, name))
    mark = proxy.recorder.mark()
    started = time.perf_counter()
    try:
        yield rollout
    finally:
        rollout.seconds = time.perf_counter() - started
        rollout.exchanges = proxy.recorder.since(mark)
    assert 0 < len(rollout.exchanges) <= MAX_CALLS_PER_ROLLOUT, (
        f"{name}: {len(rollout.exchanges)} upstream calls (bounded loops allow 1.."
        f"{MAX_CALLS_PER_ROLLOUT})"
    )


# --------------------------------------------------------------------------- the oracle


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def token_parent(exchanges: list[Exchange], k: int) -> int | None:
    """From vLLM's ids alone: the earlier call whose prompt + generation is the longest prefix
    of call ``k``'s prompt (what the ledger must prove as the verified parent)."""
    prompt = exchanges[k].prompt
    best: int | None = None
    for j in range(k):
        cumulative = exchanges[j].cumulative
        longer = best is None or len(cumulative) > len(exchanges[best].cumulative)
        if longer and exchanges[j].generated and prompt[: len(cumulative)] == cumulative:
            best = j
    return best


def chains_of(parents: list[int | None]) -> list[list[int]]:
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


def path_to(parents: list[int | None], k: int) -> list[int]:
    path = [k]
    while (up := parents[path[-1]]) is not None:
        path.append(up)
    return path[::-1]


def _history(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """What a turn's history must keep: roles, and the text of every non-assistant message."""
    view = []
    for m in messages:
        role = str(m.get("role"))
        content = m.get("content")
        text = "" if role == "assistant" else json.dumps(content, sort_keys=True)
        view.append((role, text))
    return view


def carriers(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in response["output"] if "generation_token_ids" in i]


def assert_chain_equals_vllm(
    response: dict[str, Any], exchanges: list[Exchange], what: str
) -> None:
    """Each carrier (one per call, in chain order) equals vLLM's answer for that call."""
    items = carriers(response)
    assert len(items) == len(exchanges), (
        f"{what}: {len(items)} calls delivered, expected {len(exchanges)}"
    )
    for k, (item, ex) in enumerate(zip(items, exchanges, strict=True)):
        assert item["prompt_token_ids"] == ex.prompt, (
            f"{what}: call {k} prompt differs from vLLM's prompt_token_ids at "
            f"{first_difference(item['prompt_token_ids'], ex.prompt)}"
        )
        assert item["generation_token_ids"] == ex.generated, (
            f"{what}: call {k} generated ids differ from vLLM's token_ids"
        )
        assert item["generation_log_probs"] == ex.log_probs, (
            f"{what}: call {k} log-probs differ from vLLM's"
        )
    total_gen = sum(len(e.generated) for e in exchanges)
    assert response["usage"]["output_tokens"] == total_gen, f"{what}: usage.output_tokens"


def audit(proxy: Proxy, rid: str) -> dict[str, Any]:
    resp = httpx.get(f"{proxy.url}/ledger/v1/rollouts/{rid}", timeout=30)
    assert resp.status_code == 200, resp.text
    detail: dict[str, Any] = resp.json()
    return detail


def finalize_one(proxy: Proxy, result: dict[str, Any]) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        source = RemoteLedger(proxy.url)
        try:
            build = await finalize_rollout_token_capture(result, source)
            assert build is not None
            return build
        finally:
            await source.close()

    return asyncio.run(run())


@dataclass
class Verdict:
    """What the oracle derived and checked for one rollout (the collect step uses it)."""

    rollout: Rollout
    terminal_response_id: str
    chains: list[list[int]]
    delivered: bool
    summary: dict[str, Any]


def _check_upstream(recorder: Recorder, r: Rollout) -> None:
    for k, ex in enumerate(r.exchanges):
        label = f"{r.name} call {k}"
        assert ex.status == 200, f"{label}: vLLM answered {ex.status}: {ex.response}"
        assert len(ex.generated) == len(ex.log_probs) > 0, f"{label}: no ids/log-probs"
        supplied = ex.supplied_prompt
        if supplied is not None:
            assert ex.prompt == supplied, (
                f"{label}: vLLM did not use the supplied prompt ids (first difference at "
                f"{first_difference(ex.prompt, supplied)})"
            )
        elif ex.path == "/v1/chat/completions":
            rendered = recorder.tokenize_chat(ex.request)
            assert ex.prompt == rendered, (
                f"{label}: vLLM's prompt_token_ids are not its /tokenize of the messages sent "
                f"(first difference at {first_difference(ex.prompt, rendered)})"
            )
        if k and ex.path == "/v1/chat/completions":
            before = _history(r.exchanges[k - 1].request["messages"])
            now = _history(ex.request["messages"])
            assert len(now) > len(before) and now[: len(before)] == before, (
                f"{label}: the upstream request does not carry the previous turn's history "
                f"({len(before)} messages before, {len(now)} now: {now[:3]}...)"
            )


def _check_records(r: Rollout, detail: dict[str, Any]) -> list[str]:
    """Step 2: one captured call per upstream answer, with vLLM's lengths; their ids in order."""
    exchanges = r.exchanges
    assert detail["incomplete_events"] == [], detail["incomplete_events"]
    by_response = {c["response_id"]: c for c in detail["calls"]}
    calls = [by_response.get(ex.response.get("id")) for ex in exchanges]
    assert all(c is not None for c in calls), (
        f"{r.name}: upstream answers missing from the ledger: {detail['calls']}"
    )
    assert len(detail["calls"]) == len(exchanges), detail["calls"]
    call_ids = []
    for k, (call, ex) in enumerate(zip(calls, exchanges, strict=True)):
        assert call is not None
        assert call["status"] == "captured", f"{r.name} call {k}: {call}"
        assert call["prompt_len"] == len(ex.prompt), f"{r.name} call {k}: prompt_len"
        assert call["generation_len"] == len(ex.generated), f"{r.name} call {k}: generation_len"
        call_ids.append(str(call["model_call_id"]))
    return call_ids


def _check_lineage(
    r: Rollout, detail: dict[str, Any], call_ids: list[str], parents: list[int | None]
) -> list[dict[str, Any]]:
    """Step 3: verified edges exactly to the token parents, drifted edges exactly where the
    previous turn is not the token parent, at vLLM's first differing position."""
    exchanges = r.exchanges
    index = {cid: k for k, cid in enumerate(call_ids)}
    edges: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for e in detail["edges"]:
        edges.setdefault((index[e["child"]], e["status"]), []).append(e)
    assert not [e for e in detail["edges"] if e["status"] not in ("verified", "drifted")], detail
    drift_report = []
    for k in range(1, len(exchanges)):
        verified = edges.get((k, "verified"), [])
        drifts = edges.get((k, "drifted"), [])
        parent = parents[k]
        if parent is None:
            assert not verified, f"{r.name} call {k}: verified edge without a token parent"
        else:
            assert len(verified) == 1 and index[verified[0]["parent"]] == parent, (
                f"{r.name} call {k}: expected a verified edge to call {parent}: {verified}"
            )
            assert verified[0]["shared_len"] == len(exchanges[parent].cumulative), verified
        if parent == k - 1:
            assert not drifts, f"{r.name} call {k}: unexpected drifted edge: {drifts}"
            continue
        pos = first_difference(exchanges[k].prompt, exchanges[k - 1].cumulative)
        assert len(drifts) == 1, (
            f"{r.name} call {k}: its prompt does not extend call {k - 1}'s tokens (first "
            f"difference at {pos}) but the ledger stored no drifted edge: {detail['edges']}"
        )
        edge = drifts[0]
        assert index[edge["parent"]] == k - 1 and edge["method"] == "conversation", edge
        assert edge["mismatch_pos"] == pos, (edge, pos)
        drift_report.append(
            {"call": k, "pos": pos, "of": len(exchanges[k - 1].cumulative),
             "kind": edge["mismatch_kind"]}
        )  # fmt: skip
    return drift_report


def _check_delivery(
    proxy: Proxy, r: Rollout, parents: list[int | None]
) -> tuple[bool, dict[str, Any], dict[str, Any]]:
    """Step 4: finalize (deliver="one") through the service, the terminal being the last call:
    delivered exactly when its token path reaches the first call, and then exactly vLLM's ids;
    otherwise masked.  Returns (delivered, build, _ng_token_capture)."""
    exchanges = r.exchanges
    main = path_to(parents, len(exchanges) - 1)
    expect_delivered = main[0] == 0
    result: dict[str, Any] = {
        "_ng_rollout_id": r.rollout_id,
        "response": {"id": str(exchanges[-1].response["id"]), "output": []},
    }
    build = finalize_one(proxy, result)
    capture: dict[str, Any] = result["_ng_token_capture"]
    if expect_delivered:
        assert build["outcome"] == "delivered", (
            r.name, build["outcome"], build["mask_reasons"], parents,
        )  # fmt: skip
        assert not result.get("mask_sample")
        assert_chain_equals_vllm(
            result["response"], [exchanges[k] for k in main], f"{r.name} delivered"
        )
        total = sum(len(ex.generated) for ex in exchanges)
        on_path = sum(len(exchanges[k].generated) for k in main)
        assert capture["delivered_fraction"] == on_path / total, (capture, on_path, total)
    else:
        assert build["outcome"] == "masked", (
            f"{r.name}: FALSE DELIVERY: the terminal's token path {main} does not reach the "
            f"first call, yet the ledger delivered it ({build})"
        )
        assert result.get("mask_sample") is True
        # The terminal is attributed (its response id); its path starts at a call whose
        # conversation parent it does not extend: the chain is broken, and each such root is an
        # unresolved parent (the drift diagnosed in step 3).
        assert "terminal_broken" in build["mask_reasons"], build
        drifted_roots = sum(1 for k in range(1, len(parents)) if parents[k] is None)
        assert capture["unresolved_parent_calls"] == drifted_roots, (capture, drifted_roots)
        assert result["response"]["output"] == [], "a masked rollout must not deliver tokens"
    return expect_delivered, build, capture


def check_rollout(proxy: Proxy, r: Rollout) -> Verdict:
    """Steps 1-4 of the module docstring for one driven rollout."""
    exchanges = r.exchanges
    _check_upstream(proxy.recorder, r)
    parents = [token_parent(exchanges, k) for k in range(len(exchanges))]
    detail = audit(proxy, r.rollout_id)
    call_ids = _check_records(r, detail)
    drifts = _check_lineage(r, detail, call_ids, parents)
    delivered, build, capture = _check_delivery(proxy, r, parents)
    if SUPPLY_PREFIX and "prefix_supply_supplied" in capture:
        # Each supplied prefix the ledger counts is one vLLM was actually sent (and used, step 1).
        supplied = sum(ex.supplied_prompt is not None for ex in exchanges)
        assert capture["prefix_supply_supplied"] == supplied, (capture, supplied)
    summary = {
        "framework": r.framework,
        "name": r.name,
        "rollout": r.rollout_id,
        "backend": proxy.backend,
        "supply_prefix": SUPPLY_PREFIX,
        "model": MODEL,
        "outcome": build["outcome"],
        "mask_reasons": build["mask_reasons"],
        "delivered_fraction": capture.get("delivered_fraction"),
        "tool_calls": sum(ex.tool_calls for ex in exchanges),
        "tool_using": any(ex.tool_calls for ex in exchanges[:-1]),
        "drifts": drifts,
        "chains": chains_of(parents),
        "stopped_by": r.stopped_by,
        "seconds": round(r.seconds, 2),
        "prefix": {k: v for k, v in capture.items() if k.startswith("prefix")},
        "calls": [
            {
                "prompt": len(ex.prompt),
                "generated": len(ex.generated),
                "finish": ex.finish_reason,
                "tool_calls": ex.tool_calls,
                "supplied": ex.supplied_prompt is not None,
                "vllm_s": round(ex.seconds, 2),
            }
            for ex in exchanges
        ],
    }
    terminal_id = str(exchanges[-1].response["id"])
    return Verdict(r, terminal_id, chains_of(parents), delivered, summary)


def collect_all_chains(proxy: Proxy, verdicts: list[Verdict], name: str) -> None:
    """Step 5: one ``collect --deliver all-chains`` run over the given rollouts."""
    inp = proxy.workdir / f"{name}.in.jsonl"
    out = proxy.workdir / f"{name}.out.jsonl"
    with inp.open("w") as fh:
        for v in verdicts:
            fresh = {
                "_ng_rollout_id": v.rollout.rollout_id,
                "response": {"id": v.terminal_response_id, "output": []},
            }
            fh.write(json.dumps(fresh) + "\n")
    cmd = [*cli(), "collect", "-i", str(inp), "-o", str(out), "--db", proxy.url]
    cmd += ["--deliver", "all-chains", "--json"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=child_env(), timeout=300, check=False
    )
    assert done.returncode == 0, f"collect failed ({done.returncode}): {done.stderr}"
    report = json.loads(done.stdout)
    n = len(verdicts)
    assert report["written"] == n and report["finalized"] == n, report
    delivered = sum(v.delivered for v in verdicts)
    assert report["retired"] == delivered and report["masked"] == n - delivered, report
    rows: dict[str, list[dict[str, Any]]] = {}
    for line in out.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.setdefault(row["_ng_rollout_id"], []).append(row)
    for v in verdicts:
        exchanges = v.rollout.exchanges
        got = rows.get(v.rollout.rollout_id, [])
        assert len(got) == len(v.chains), (
            f"{v.rollout.name}: collect wrote {len(got)} chains, vLLM's ids give {v.chains}"
        )
        remaining = list(v.chains)
        for row in got:
            seen = [
                (c["prompt_token_ids"], c["generation_token_ids"])
                for c in carriers(row["response"])
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
            what = f"{v.rollout.name} chain {match} {row['_ng_trajectory']}"
            assert_chain_equals_vllm(row["response"], [exchanges[k] for k in match], what)
            assert bool(row.get("mask_sample")) is not v.delivered, row.get("_ng_trajectory")
        state = audit(proxy, v.rollout.rollout_id)["rollout"]["state"]
        assert state == ("retired" if v.delivered else "frozen"), (v.rollout.name, state)


def report(verdicts: list[Verdict]) -> None:
    path = os.environ.get("ROLLOUT_LEDGER_E2E_REPORT")
    for v in verdicts:
        s = v.summary
        print(
            f"[e2e] {s['framework']:18} {s['backend']:8} {s['outcome']:9} "
            f"{','.join(s['mask_reasons']) or '-':16} calls={len(s['calls'])} "
            f"tools={s['tool_calls']} drifts={[d['pos'] for d in s['drifts']]} "
            f"fraction={s['delivered_fraction']} {s['stopped_by']}"
        )
        if path:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(s) + "\n")


def verify(proxy: Proxy, rollouts: list[Rollout], name: str) -> list[Verdict]:
    """Check every rollout (steps 1-4), then collect them all at once (step 5), then report."""
    verdicts = [check_rollout(proxy, r) for r in rollouts]
    collect_all_chains(proxy, verdicts, name)
    report(verdicts)
    return verdicts
