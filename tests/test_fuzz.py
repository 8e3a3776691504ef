"""Issue #5 point 5: bad input, fuzzed with hypothesis (bounded, deterministic, no deadline).

(i)   The ledger API (ingest routes, and the trainer/audit routes beside them) with arbitrary
      JSON bodies, ids, arrays, huge ints, ``NaN``/``Infinity`` literals and strings, raw bytes:
      never a 5xx; a 4xx changes no table (a payload conflict adds exactly its incomplete
      event, as promise 2 says); every error has the ``{"error": {code, message}}`` body; a
      record the API accepted can be frozen.
(ii)  The proxy's request parsing: arbitrary and mutated bodies to each dialect route: never a
      5xx from the proxy itself (an upstream 5xx relayed is not the proxy's); a refused
      request records nothing (no intent left open, no record, no incomplete mark); an
      answered one is captured whole or marked incomplete with a reason.
(iii) Upstream-answer parsing as pure functions: ``extract_*_tokens`` raise only
      ``TokenExtractionError``; ``strip_*_response`` never raise; the dialect translators and
      SSE synthesizers raise only ``ValueError`` (their documented refusal).
(iv)  The same mutated upstream answers through the running proxy: never a bare 5xx, and never a
      silent hole (an answered call is captured, or its rollout is incomplete with a reason).

Examples are derandomized (the same every run, so CI is repeatable); set
``ROLLOUT_LEDGER_FUZZ_SCALE`` (e.g. 10) for a longer local run and
``ROLLOUT_LEDGER_FUZZ_RANDOM=1`` to explore new examples.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api import dialects as d
from api.app import create_app
from api.extract import (
    TokenExtractionError,
    extract_chat_tokens,
    extract_completion_tokens,
    strip_chat_response,
    strip_completion_response,
    with_tokenized_prompt,
)
from ledger import migrate
from ledger.config import load_settings
from ledger.store import Ledger
from rollout_sim import ByteTokenizer, Reply, SimEngine, ThreadedServer
from tests.helpers.fault_support import (
    LedgerThread,
    ServerErrors,
    UpstreamTap,
    call_rows,
    exception_signature,
    half_written,
    incomplete_reasons,
    ledger_thread,
    rollouts_among,
    table_counts,
)

SCALE = float(os.environ.get("ROLLOUT_LEDGER_FUZZ_SCALE", "1"))
RANDOM = os.environ.get("ROLLOUT_LEDGER_FUZZ_RANDOM") == "1"
RUN = uuid.uuid4().hex[:6]


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


# --------------------------------------------------------------------------- value strategies

NASTY_CONSTANTS: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**31 - 1,
    2**31,
    -(2**31) - 1,
    2**62,
    2**63,
    -(2**63) - 1,
    2**64,
    10**40,
    1e308,
    -1e308,
    5e-324,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "NaN",
    "Infinity",
    "-Infinity",
    "\x00",
    "a\x00b",
    "\ud800",
    "x" * 5000,
    "🦙",
    "AAAA",
    "AAECAwQ=",
    "!!not base64",
    "AAA",
    [],
    {},
    [None],
    [math.nan],
    [math.inf],
    [2**40],
    [2**64],
    [-1, 0, 1],
    ["1"],
    [[1]],
    [True],
    {"a": 2**64},
    {"\x00": 1},
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
# Deep copies: a mutation must never edit the shared constants (hypothesis replays examples).
# The hand-picked constants are drawn half the time.
_CONSTANTS = st.sampled_from(NASTY_CONSTANTS)
NASTY = st.one_of(_CONSTANTS, _CONSTANTS, SCALARS, JSON_VALUES).map(copy.deepcopy)
RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [b"", b"{", b"[]", b"null", b"NaN", b'{"a": NaN}', b"\xff\xfe", b'"text"', b"{}" * 3]
    ),
)


def _slots(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a JSON document a mutation can touch (the root is ``()``)."""
    yield path
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _slots(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _slots(v, (*path, i))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


@st.composite
def mutated(draw: st.DrawFn, base: Any, keys: tuple[str, ...] = ()) -> Any:
    """``base`` with one to four edits: a value replaced, removed, added, or a list grown."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 4))):
        slots = list(_slots(doc))
        names = sorted({str(p[-1]) for p in slots if p and p[-1] in keys})
        by_name: bool = draw(st.booleans())
        if names and by_name:
            # Half the edits go to a field the parsers know by name, each name as likely as
            # the next (long token lists would otherwise soak up nearly every edit).
            name = draw(st.sampled_from(names))
            path = draw(st.sampled_from([p for p in slots if p and p[-1] == name]))
        else:
            path = draw(st.sampled_from(slots))
        target = _get(doc, path)
        action = draw(st.sampled_from(["replace", "delete", "add", "grow"]))
        if action == "replace" or (not path and not isinstance(target, (dict, list))):
            if not path:
                doc = draw(NASTY)
                continue
            _get(doc, path[:-1])[path[-1]] = draw(NASTY)
        elif action == "delete" and path:
            del _get(doc, path[:-1])[path[-1]]
        elif action == "add" and isinstance(target, dict):
            key = draw(st.sampled_from(keys) | st.text(max_size=8)) if keys else draw(st.text())
            target[key] = draw(NASTY)
        elif action == "grow" and isinstance(target, list):
            pick = st.sampled_from(target) if target else NASTY
            target.insert(draw(st.integers(0, len(target))), copy.deepcopy(draw(pick | NASTY)))
    return doc


def fuzz_client(url: str) -> httpx.Client:
    """A fresh connection per request: a server that closes after a 500 must not make the next
    example fail with a reset keep-alive connection."""
    return httpx.Client(
        base_url=url, timeout=60.0, limits=httpx.Limits(max_keepalive_connections=0)
    )


def encode(body: Any) -> tuple[bytes, dict[str, str]]:
    if isinstance(body, bytes):
        return body, {"content-type": "application/json"}
    # allow_nan: NaN/Infinity travel as the literals Python's json (and the server) accepts.
    return json.dumps(body, allow_nan=True).encode(), {"content-type": "application/json"}


def seg(value: str) -> str:
    """One URL path segment holding exactly ``value`` after the server decodes it."""
    out = []
    for ch in value:
        if ch.isascii() and ch.isalnum():
            out.append(ch)
        else:
            out.append("".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass")))
    return "".join(out)


# --------------------------------------------------------------------------- (i) ledger API

POOL = [f"fz{RUN}-{k}" for k in ("a", "b", "c")]
CALL_POOL = ["c1", "c2", "call.3"]
VALID_IDS = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,24}\Z", fullmatch=True)
WEIRD_IDS = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", ".", "..", "-a", "_a", "a b", "a/b", "a" * 201, "é", "a\x00", "\ud800"]),
)
ROLLOUT_IDS = st.one_of(st.sampled_from(POOL), VALID_IDS, WEIRD_IDS)
CALL_IDS = st.one_of(st.sampled_from(CALL_POOL), VALID_IDS, WEIRD_IDS)

RECORD = {
    "schema_version": 1,
    "model": "smol",
    "prompt_token_ids": [1, 2, 3],
    "generation_token_ids": [4, 5],
    "generation_log_probs": [-0.5, -1.25],
    "output_items": [{"type": "message", "role": "assistant", "content": "hi"}],
    "token_item_index": 0,
    "created_at": 1.5,
    "response_id": "chatcmpl-1",
}
PUT_BASES = [
    {"record": RECORD},
    {"record": {**RECORD, "prompt_token_ids": [1, 2, 3, 4, 5, 6]}, "route": "POST /v1/x"},
    {
        "record": {
            **RECORD,
            "prompt_token_ids": "AQAAAAIAAAADAAAA",
            "generation_token_ids": "BAAAAA==",
            "generation_log_probs": "AAAAAAAA4L8=",
        },
        "token_encoding": "packed-v1",
    },
]
RECORD_KEYS = (*RECORD, "rollout_id", "model_call_id", "routed_experts", "token_encoding", "x")


@dataclass(frozen=True)
class ApiRoute:
    method: str
    path: str  # {r}: rollout id, {c}: call id, {n}: delivery id
    bases: tuple[Any, ...]
    keys: tuple[str, ...] = ()
    query: tuple[str, ...] = ()


API_ROUTES = [
    ApiRoute("PUT", "/ledger/v1/rollouts/{r}/calls/{c}", tuple(PUT_BASES), RECORD_KEYS),
    ApiRoute(
        "POST",
        "/ledger/v1/rollouts/{r}/calls/{c}/intent",
        ({"route": "POST /v1/chat/completions", "model": "smol"}, {}),
        ("route", "model"),
    ),
    ApiRoute("POST", "/ledger/v1/rollouts/{r}/calls/{c}/cancel", (None,)),
    ApiRoute(
        "POST",
        "/ledger/v1/rollouts/{r}/incomplete",
        ({"model_call_id": "c1", "reason": "capture_failed", "detail": "x"}, {}),
        ("model_call_id", "reason", "detail"),
    ),
    ApiRoute(
        "POST",
        "/ledger/v1/rollouts/{r}/lineage/resolve",
        (
            {"prompt_token_ids": [1, 2, 3, 4, 5, 9]},
            {"prompt_token_ids": "AQAAAAIAAAA=", "token_encoding": "packed-v1"},
        ),
        ("prompt_token_ids", "token_encoding"),
    ),
    ApiRoute("POST", "/ledger/v1/rollouts/{r}/freeze", (None,), query=("token_encoding",)),
    ApiRoute(
        "POST",
        "/ledger/v1/rollouts/{r}/retire",
        ({"snapshot_id": "0" * 32, "version": 1},),
        ("snapshot_id", "version"),
    ),
    ApiRoute(
        "POST",
        "/ledger/v1/finalize",
        ({"result": {"_ng_rollout_id": POOL[0], "response": {"id": "x", "output": []}}},),
        ("result", "deliver", "consumer"),
    ),
    ApiRoute("POST", "/ledger/v1/deliveries/{n}/ack", ({"durable": True}, {}), ("durable",)),
    ApiRoute(
        "GET",
        "/ledger/v1/rollouts",
        (None,),
        query=("state", "outcome", "masked", "reason", "since", "limit", "cursor"),
    ),
    ApiRoute("GET", "/ledger/v1/rollouts/{r}", (None,)),
    ApiRoute("GET", "/ledger/v1/stats", (None,), query=("since",)),
]
QUERY_VALUES = st.one_of(
    st.sampled_from(
        ["open", "frozen", "delivered", "true", "1", "0", "-1", "9" * 30, "packed-v1", "json"]
    ),
    st.sampled_from(["2024-01-01T00:00:00", "9999-12-31T23:59:59Z", "0001-01-01", "NaN"]),
    st.text(max_size=12),
)


@pytest.fixture
def api_stack(db_url: str) -> Iterator[tuple[str, LedgerThread]]:
    """The app with a simulated upstream (paths that miss the ledger API fall through to it)."""
    engine = SimEngine(ByteTokenizer(), model_name="smol", max_model_len=4096, seed=1)
    with ThreadedServer(engine.app) as upstream:
        settings_ = load_settings(db=db_url, upstream=upstream.url + "/v1")
        with (
            ThreadedServer(create_app(settings_), lifespan="on", startup_timeout=60) as app,
            ledger_thread(db_url) as lt,
        ):
            yield app.url, lt


def _ledger_shaped(resp: httpx.Response) -> bool:
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err.get("code"), str) and isinstance(err.get("message"), str)


class Violations:
    """Contract breaches found by a fuzz run, one example per kind: the run goes on after a
    breach (so one run names every kind), and the test fails at the end with the table."""

    def __init__(self) -> None:
        self.found: dict[str, str] = {}
        self.count = 0

    def add(self, kind: str, example: str) -> None:
        self.count += 1
        self.found.setdefault(kind, example[:700])

    def table(self) -> str:
        rows = [f"- {kind}\n    e.g. {ex}" for kind, ex in sorted(self.found.items())]
        return f"{self.count} breaches of {len(self.found)} kinds:\n" + "\n".join(rows)


def _server_error(errors: ServerErrors, n: int, resp: httpx.Response) -> str:
    sigs = errors.since(n) if resp.status_code == 500 else []
    return sigs[0] if sigs else f"HTTP {resp.status_code} {resp.text[:80]}"


def _put_heavy(routes: list[ApiRoute]) -> list[ApiRoute]:
    return [*routes, *[r for r in routes if r.method == "PUT"] * 3]


def test_ledger_api_fuzz_never_5xx_and_4xx_changes_nothing(
    api_stack: tuple[str, LedgerThread],
) -> None:
    url, lt = api_stack
    seen: dict[int, int] = {}
    bad = Violations()

    with ServerErrors().attached() as errors, fuzz_client(url) as client:

        @fuzz_settings(160)
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            route = data.draw(st.sampled_from(_put_heavy(API_ROUTES)), label="route")
            r = data.draw(ROLLOUT_IDS, label="rollout_id")
            c = data.draw(CALL_IDS, label="call_id")
            n = data.draw(
                st.one_of(st.integers(-5, 50), st.sampled_from([2**62, 2**63, 10**30])),
                label="delivery_id",
            )
            path = route.path.format(r=seg(r), c=seg(c), n=n)
            base = data.draw(st.sampled_from(route.bases), label="base")
            shape = data.draw(st.sampled_from(["valid", "mutated", "mutated", "json", "raw"]))
            body: Any
            if base is None and shape in ("valid", "mutated"):
                body = None
            elif shape == "valid":
                body = base
            elif shape == "mutated":
                body = data.draw(mutated(base, route.keys), label="body")
            elif shape == "json":
                body = data.draw(JSON_VALUES, label="body")
            else:
                body = data.draw(RAW_BODIES, label="body")
            params = {}
            for name in route.query:
                if data.draw(st.booleans()):
                    params[name] = data.draw(QUERY_VALUES, label=name)
            content, headers = (b"", {}) if body is None else encode(body)
            example = f"{route.method} {path} {params or ''} body={content[:400]!r}"
            check_freeze = data.draw(st.booleans(), label="check_freeze")

            before = lt.run(table_counts)
            n_err = len(errors.records)
            resp = client.request(
                route.method, path, content=content, headers=headers, params=params
            )
            after = lt.run(table_counts)
            status = resp.status_code
            seen[status] = seen.get(status, 0) + 1
            if status >= 500:
                bad.add(
                    f"{route.method} {route.path} -> {_server_error(errors, n_err, resp)}", example
                )
            if 400 <= status < 500:
                delta = {k: after[k] - before[k] for k in after if after[k] != before[k]}
                conflict = status == 409 and "payload_conflict" in resp.text
                # A payload conflict is refused but marks the rollout incomplete (promise 2).
                if delta != ({"incomplete_events": 1} if conflict else {}):
                    bad.add(f"{route.method} {route.path} {status} changed tables {delta}", example)
                routed = "/" not in r and "/" not in c and r != "" and c != ""
                if routed and status != 405 and not _ledger_shaped(resp):
                    bad.add(f"{route.method} {route.path} {status} without the error body", example)
            if route.method == "PUT" and status == 201 and check_freeze:
                # What the API accepted must come back out: freeze reads every stored field.
                try:
                    lt.run(lambda led: led.freeze(r))
                except Exception as exc:
                    bad.add(f"freeze after an accepted PUT: {exception_signature(exc)}", example)

        run()

    print(f"ledger API fuzz statuses: {dict(sorted(seen.items()))}")
    assert not bad.found, bad.table()
    assert any(200 <= s < 300 for s in seen) and any(400 <= s < 500 for s in seen)


SWEEP_VALUES: list[Any] = [
    None,
    True,
    0,
    -1,
    2**31,
    2**63,
    2**64,
    10**40,
    1e308,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "NaN",
    "-Infinity",
    "\x00",
    "\ud800",
    "x" * 5000,
    [],
    {},
    [None],
    [math.nan],
    [2**64],
    ["1"],
    {"a": 2**64},
]


def _freezer(rollout_id: str) -> Callable[[Ledger], Any]:
    async def freeze(led: Ledger) -> Any:
        return await led.freeze(rollout_id)

    return freeze


def _reader(fn: Callable[[Ledger, str], Any], rollout_id: str) -> Callable[[Ledger], Any]:
    def read(led: Ledger) -> Any:
        return fn(led, rollout_id)

    return read


def _put_edits() -> Iterator[tuple[str, dict[str, Any]]]:
    """The PUT body with one field (record, top level, an extra one) set to each value."""
    base = {"record": RECORD}
    for path in _slots(base):
        if len(path) < 2 and path != ():
            continue
        for value in SWEEP_VALUES:
            if not path:
                continue
            doc = copy.deepcopy(base)
            _get(doc, path[:-1])[path[-1]] = copy.deepcopy(value)
            yield ".".join(map(str, path)), doc
    for name in ("x", "routed_experts", "token_encoding", "route", "request_fingerprint"):
        for value in SWEEP_VALUES:
            doc = copy.deepcopy(base)
            target = (
                doc if name in ("token_encoding", "route", "request_fingerprint") else doc["record"]
            )
            target[name] = copy.deepcopy(value)
            yield name, doc


def test_ledger_put_single_field_sweep(api_stack: tuple[str, LedgerThread]) -> None:
    """Every field of a record set to every nasty value, each on a fresh rollout: never a 5xx,
    a refused PUT leaves no rollout behind, an accepted one can be frozen."""
    url, lt = api_stack
    bad = Violations()
    refused: dict[str, str] = {}
    accepted = 0
    with ServerErrors().attached() as errors, fuzz_client(url) as client:
        for k, (field, body) in enumerate(_put_edits()):
            rid = f"sw{RUN}-{k}"
            content, headers = encode(body)
            example = f"{field}: body={content[:300]!r}"
            n_err = len(errors.records)
            resp = client.put(
                f"/ledger/v1/rollouts/{rid}/calls/c1", content=content, headers=headers
            )
            if resp.status_code >= 500:
                bad.add(f"PUT record {field} -> {_server_error(errors, n_err, resp)}", example)
            elif resp.status_code >= 400:
                refused[rid] = example
                if not _ledger_shaped(resp):
                    bad.add(f"PUT {resp.status_code} without the error body", example)
            else:
                accepted += 1
                try:
                    lt.run(_freezer(rid))
                except Exception as exc:
                    bad.add(f"freeze after an accepted PUT: {exception_signature(exc)}", example)
    left = lt.run(lambda led: rollouts_among(led, list(refused)))
    for rid in left:
        bad.add("a refused PUT left its rollout behind", refused[rid])
    print(f"PUT sweep: {len(refused)} refused, {accepted} accepted")
    assert not bad.found, bad.table()


# --------------------------------------------------------------------------- (ii) proxy requests

USER = {"role": "user", "content": "Hello there"}
DIALECT_BASES: dict[str, list[dict[str, Any]]] = {
    "/v1/chat/completions": [
        {"model": "smol", "messages": [USER], "max_tokens": 16},
        {
            "model": "smol",
            "messages": [{"role": "system", "content": "s"}, USER],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
                }
            ],
            "tool_choice": "auto",
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 2,
        },
    ],
    "/v1/completions": [
        {"model": "smol", "prompt": "Once upon", "max_tokens": 8},
        {"model": "smol", "prompt": [1, 2, 3], "max_tokens": 8, "stream": True, "logprobs": 1},
    ],
    "/v1/responses": [
        {"model": "smol", "input": "Hello", "max_output_tokens": 16},
        {
            "model": "smol",
            "instructions": "be brief",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "x"}],
                }
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "stream": True,
        },
    ],
    "/v1/messages": [
        {"model": "smol", "max_tokens": 16, "messages": [USER]},
        {
            "model": "smol",
            "max_tokens": 16,
            "system": [{"type": "text", "text": "s"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "stream": True,
        },
    ],
}
REQUEST_KEYS = (
    "model",
    "messages",
    "prompt",
    "input",
    "stream",
    "stream_options",
    "n",
    "best_of",
    "use_beam_search",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "max_tokens",
    "max_output_tokens",
    "temperature",
    "seed",
    "system",
    "instructions",
    "previous_response_id",
    "background",
    "echo",
    "stop",
    "stop_sequences",
    "content",
    "role",
    "type",
    "text",
)


@dataclass
class ProxyStack:
    url: str
    tap: UpstreamTap
    lt: LedgerThread


@pytest.fixture
def proxy_stack(db_url: str) -> Iterator[ProxyStack]:
    engine = SimEngine(ByteTokenizer(), model_name="smol", max_model_len=4096, seed=2)
    tap = UpstreamTap(engine.app)
    with ThreadedServer(tap) as upstream:
        settings_ = load_settings(db=db_url, upstream=upstream.url + "/v1")
        with (
            ThreadedServer(create_app(settings_), lifespan="on", startup_timeout=60) as app,
            ledger_thread(db_url) as lt,
        ):
            yield ProxyStack(app.url, tap, lt)


def _refused(resp: httpx.Response) -> bool:
    if 400 <= resp.status_code < 500:
        return True
    # A streaming Responses harness gets its failure as a failed stream on HTTP 200.
    return resp.status_code == 200 and "event: response.failed" in resp.text


def test_proxy_request_fuzz_never_5xx_and_refusals_record_nothing(proxy_stack: ProxyStack) -> None:
    stack = proxy_stack
    counter = iter(range(10**9))
    outcomes: dict[str, int] = {}
    relayed: list[str] = []
    bad = Violations()

    with (
        ServerErrors().attached() as errors,
        fuzz_client(stack.url) as client,
    ):

        @fuzz_settings(160)
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            route = data.draw(st.sampled_from(sorted(DIALECT_BASES)), label="route")
            base = data.draw(st.sampled_from(DIALECT_BASES[route]), label="base")
            shape = data.draw(st.sampled_from(["valid", "mutated", "mutated", "mutated", "json"]))
            body: Any
            if shape == "valid":
                body = base
            elif shape == "mutated":
                body = data.draw(mutated(base, REQUEST_KEYS), label="body")
            else:
                body = data.draw(st.one_of(JSON_VALUES, RAW_BODIES), label="body")
            rid = f"pf{RUN}-{next(counter)}"
            content, headers = encode(body)
            example = f"POST {route} body={content[:400]!r}"
            n_up = len(stack.tap.records)
            n_err = len(errors.records)
            resp = client.post(
                f"/ng-rollout/{rid}/training-token-capture{route}", content=content, headers=headers
            )
            upstream = stack.tap.records[n_up:]
            status = resp.status_code
            if status >= 500:
                if any(u.status >= 500 for u in upstream):
                    relayed.append(f"{route}: {resp.text[:120]} for {example}")
                else:
                    # Only an upstream 5xx may come back as a 5xx: relayed, not the proxy's own.
                    bad.add(f"{route} -> {_server_error(errors, n_err, resp)}", example)
            rows = stack.lt.run(lambda led: call_rows(led, rid))
            reasons = stack.lt.run(lambda led: incomplete_reasons(led, rid))
            if stack.lt.run(lambda led: half_written(led, [rid])):
                bad.add(f"{route}: half-written call", example)
            if _refused(resp):
                kind = "refused_upstream" if upstream else "refused"
                # Nothing recorded: no record, no open intent, no incomplete mark; the intent of
                # a call the engine refused is closed (cancelled).
                left = [r.status for r in rows if r.status != "cancelled"]
                if left or reasons or (rows and not upstream):
                    bad.add(f"{route} refused ({status}) but recorded {left} {reasons}", example)
            elif status == 200:
                captured = [r for r in rows if r.status == "captured"]
                kind = "captured" if captured else f"incomplete:{','.join(reasons)}"
                # Answered: captured whole, or incomplete with a reason (never a silent hole).
                if not (len(rows) == 1 and (len(captured) == 1 or reasons)):
                    bad.add(f"{route} answered 200 but recorded {rows} {reasons}", example)
            else:
                kind = f"status {status}"
            outcomes[kind] = outcomes.get(kind, 0) + 1

        run()

    print(f"proxy request fuzz outcomes: {outcomes}; upstream 5xx relayed: {relayed[:5]}")
    assert not bad.found, bad.table()
    assert outcomes.get("captured", 0) > 0 and outcomes.get("refused", 0) > 0


REQUEST_SWEEP_VALUES: list[Any] = [
    None,
    True,
    -1,
    2**64,
    1e308,
    math.nan,
    math.inf,
    "",
    "\x00",
    "\ud800",
    [None],
    {"a": 2**64},
]


def _request_edits() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Each dialect's plain request with one field (or one message field) set to each value."""
    for route, bases in sorted(DIALECT_BASES.items()):
        base = bases[0]
        paths = [p for p in _slots(base) if p and not any(isinstance(x, int) and x > 0 for x in p)]
        for path in paths:
            for value in REQUEST_SWEEP_VALUES:
                doc = copy.deepcopy(base)
                _get(doc, path[:-1])[path[-1]] = copy.deepcopy(value)
                yield route, ".".join(map(str, path)), doc
        for name in ("temperature", "stream", "tools"):
            for value in REQUEST_SWEEP_VALUES:
                yield route, name, {**copy.deepcopy(base), name: copy.deepcopy(value)}


def test_proxy_request_single_field_sweep(tmp_path: Path) -> None:
    """Every field of each dialect's request set to every nasty value (SQLite: what is swept
    here is the proxy's parsing, the random fuzz above runs on both backends)."""
    db = f"sqlite+aiosqlite:///{tmp_path / 'sweep.db'}"
    migrate.upgrade(db)
    engine = SimEngine(ByteTokenizer(), model_name="smol", max_model_len=4096, seed=6)
    tap = UpstreamTap(engine.app)
    bad = Violations()
    outcomes: dict[str, int] = {}
    relayed: dict[str, str] = {}
    with ThreadedServer(tap) as upstream:
        settings_ = load_settings(db=db, upstream=upstream.url + "/v1")
        with (
            ThreadedServer(create_app(settings_), lifespan="on", startup_timeout=60) as app,
            ledger_thread(db) as lt,
            fuzz_client(app.url) as client,
            ServerErrors().attached() as errors,
        ):
            for k, (route, field, body) in enumerate(_request_edits()):
                rid = f"ps{RUN}-{k}"
                content, headers = encode(body)
                example = f"POST {route} {field}: body={content[:300]!r}"
                n_up, n_err = len(tap.records), len(errors.records)
                resp = client.post(
                    f"/ng-rollout/{rid}/training-token-capture{route}",
                    content=content,
                    headers=headers,
                )
                upstream_statuses = [u.status for u in tap.records[n_up:]]
                status = resp.status_code
                if status >= 500 and any(u >= 500 for u in upstream_statuses):
                    relayed.setdefault(f"{route} {field}", example)
                elif status >= 500:
                    bad.add(f"{route} {field} -> {_server_error(errors, n_err, resp)}", example)
                rows = lt.run(_reader(call_rows, rid))
                reasons = lt.run(_reader(incomplete_reasons, rid))
                if _refused(resp):
                    left = [r.status for r in rows if r.status != "cancelled"]
                    if left or reasons or (rows and not upstream_statuses):
                        bad.add(
                            f"{route} refused ({status}) but recorded {left} {reasons}", example
                        )
                    kind = "refused"
                elif status == 200:
                    captured = [r for r in rows if r.status == "captured"]
                    if not (len(rows) == 1 and (captured or reasons)):
                        bad.add(f"{route} answered 200 but recorded {rows} {reasons}", example)
                    kind = "captured" if captured else "incomplete"
                else:
                    kind = f"status {status}"
                outcomes[kind] = outcomes.get(kind, 0) + 1
            assert lt.run(lambda led: half_written(led)) == []
    print(f"proxy request sweep: {outcomes}; upstream 5xx relayed: {sorted(relayed)}")
    assert not bad.found, bad.table()


# --------------------------------------------------------------------------- (iii) pure parsing


def _sample_answers() -> dict[str, list[dict[str, Any]]]:
    """Real answers of the simulated vLLM to capture requests (what the parsers meet)."""
    plain = SimEngine(ByteTokenizer(), model_name="smol", max_model_len=4096, seed=4)
    reasoning = SimEngine(
        ByteTokenizer(), model_name="smol", max_model_len=4096, seed=4, reasoning_parser=True
    )
    reasoning.script(Reply("Sure.", reasoning="Let me think."))
    chat_bodies = [
        d.build_chat_upstream({"model": "smol", "messages": [USER], "max_tokens": 6}).body,
        d.build_chat_upstream(
            {"model": "smol", "messages": [USER], "logprobs": True, "top_logprobs": 2}
        ).body,
        d.build_chat_upstream(
            {
                "model": "smol",
                "messages": [USER],
                "tools": DIALECT_BASES["/v1/chat/completions"][1]["tools"],
                "tool_choice": "required",
            }
        ).body,
    ]
    completion_body = d.build_completions_upstream(
        {"model": "smol", "prompt": "Once upon", "max_tokens": 6, "logprobs": 1}
    ).body
    chats: list[dict[str, Any]] = []
    completions: list[dict[str, Any]] = []
    for engine in (plain, reasoning):
        with ThreadedServer(engine.app) as server, httpx.Client(base_url=server.url) as client:
            for body in chat_bodies:
                chats.append(client.post("/v1/chat/completions", json=body).json())
            completions.append(client.post("/v1/completions", json=completion_body).json())
    # An upstream that already did capture: the message-level bundle.
    bundled = copy.deepcopy(chats[0])
    choice = bundled["choices"][0]
    choice["message"]["prompt_token_ids"] = bundled.pop("prompt_token_ids")
    choice["message"]["generation_token_ids"] = choice.pop("token_ids")
    choice["message"]["generation_log_probs"] = [
        c["logprob"] for c in choice.pop("logprobs")["content"]
    ]
    chats.append(bundled)
    for answer in chats + completions:
        assert "choices" in answer, answer
    return {"chat": chats, "completion": completions}


_ANSWERS_LOCK = threading.Lock()
_ANSWERS: dict[str, list[dict[str, Any]]] = {}


def sample_answers() -> dict[str, list[dict[str, Any]]]:
    with _ANSWERS_LOCK:
        if not _ANSWERS:
            _ANSWERS.update(_sample_answers())
        return _ANSWERS


ANSWER_KEYS = (
    "prompt_token_ids",
    "token_ids",
    "logprobs",
    "content",
    "usage",
    "choices",
    "message",
    "tool_calls",
    "reasoning",
    "reasoning_content",
    "finish_reason",
    "stop_reason",
    "generation_token_ids",
    "generation_log_probs",
    "prompt_tokens",
    "completion_tokens",
    "token",
    "logprob",
    "text",
    "tokens",
    "token_logprobs",
    "id",
    "created",
    "model",
)


def answers_of(kind: str) -> st.SearchStrategy[Any]:
    def build(i: int) -> st.SearchStrategy[Any]:
        answers = sample_answers()[kind]  # sampled on first use, not at collection
        base = answers[i % len(answers)]
        return st.one_of(st.just(base), mutated(base, ANSWER_KEYS), mutated(base, ANSWER_KEYS))

    return st.integers(0, 63).flatmap(build)


TOKENIZED = st.one_of(
    st.just({"count": 3, "tokens": [1, 2, 3], "max_model_len": 4096}),
    mutated({"count": 3, "tokens": [1, 2, 3], "max_model_len": 4096}, ("count", "tokens")),
    JSON_VALUES,
)


def _check_payload(payload: Any) -> None:
    assert len(payload.generation_token_ids) == len(payload.generation_log_probs)
    assert all(type(t) is int for t in payload.generation_token_ids)
    assert all(isinstance(x, float) and not math.isnan(x) for x in payload.generation_log_probs)
    if payload.prompt_token_ids is not None:
        assert all(type(t) is int for t in payload.prompt_token_ids)


def _translators(harness: dict[str, Any], completion: bool) -> list[Callable[[], Any]]:
    if completion:
        return [lambda: list(d.completion_sse(harness, include_usage=True))]
    return [
        lambda: list(d.chat_completion_sse(harness, include_usage=True)),
        lambda: list(d.anthropic_sse(d.chat_to_anthropic_message(harness))),
        lambda: list(d.responses_sse(d.chat_to_responses_response(harness, request={}))),
    ]


def _parse_everything(answer: Any, tokenized: Any, *, completion: bool) -> None:
    if not isinstance(answer, dict):
        return  # the proxy refuses a non-object answer before parsing (502)
    strip = strip_completion_response if completion else strip_chat_response
    extract = extract_completion_tokens if completion else extract_chat_tokens
    for keep in (False, True):
        stripped = strip(answer, keep_logprobs=keep)  # never raises
        assert "prompt_token_ids" not in stripped.harness_body
        choices = stripped.harness_body.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if isinstance(choice, dict):
                assert "token_ids" not in choice and "prompt_token_ids" not in choice
    try:
        payload = extract(answer)
    except TokenExtractionError:
        payload = None
    if payload is not None:
        _check_payload(payload)
        if payload.needs_tokenize:
            with contextlib.suppress(TokenExtractionError):
                _check_payload(with_tokenized_prompt(payload, tokenized, usage=answer.get("usage")))
    for translate in _translators(stripped.harness_body, completion):
        # ValueError is the translators' documented refusal (single_choice, DialectError).
        with contextlib.suppress(ValueError):
            translate()


def _single_edits(doc: Any) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every field of ``doc`` (first element of each list) replaced by every nasty constant,
    or removed (``_DELETE``)."""
    for path in _slots(doc):
        if not path or any(isinstance(p, int) and p > 0 for p in path):
            continue
        for value in [*SWEEP_VALUES, _DELETE]:
            edited = copy.deepcopy(doc)
            parent = _get(edited, path[:-1])
            if value is _DELETE:
                del parent[path[-1]]
            else:
                parent[path[-1]] = copy.deepcopy(value)
            yield path, edited


_DELETE = object()
SWEEP_PICKS = {"chat": [0, 2, 3, 6], "completion": [0, 1]}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_answer_parsing_single_field_sweep(kind: str) -> None:
    """Exhaustive single edits of every real answer: one table of every contract breach."""
    breaches: dict[str, str] = {}
    runs = 0
    answers = sample_answers()[kind]
    # Short answers of every shape: plain, tool call, reasoning, message-level bundle.
    picked = [answers[i] for i in SWEEP_PICKS[kind]]
    for answer in picked:
        for path, edited in _single_edits(answer):
            runs += 1
            try:
                _parse_everything(edited, {"count": 1, "tokens": [1]}, completion=kind != "chat")
            except Exception as exc:
                # By type and place only: one row per breach, whatever the message.
                key = exception_signature(exc).split(": ", 1)[0]
                breaches.setdefault(
                    key, f"{'.'.join(map(str, path))} = {_get_value(edited, path)!r}"
                )
    print(f"{kind} single-field sweep: {runs} edited answers")
    assert not breaches, "\n".join(f"{k}  (e.g. {v})" for k, v in sorted(breaches.items()))


def _get_value(doc: Any, path: tuple[Any, ...]) -> Any:
    try:
        return repr(_get(doc, path))[:60]
    except (KeyError, IndexError, TypeError):
        return "<removed>"


@pytest.mark.parametrize(("kind", "examples"), [("chat", 500), ("completion", 250)])
def test_answer_parsing_fuzz_raises_only_typed_errors(kind: str, examples: int) -> None:
    """Mutated answers (several edits at once, nested values): every breach, one table."""
    bad = Violations()

    @fuzz_settings(examples)
    @given(answer=answers_of(kind), tokenized=TOKENIZED)
    def run(answer: Any, tokenized: Any) -> None:
        try:
            _parse_everything(answer, tokenized, completion=kind != "chat")
        except Exception as exc:
            bad.add(exception_signature(exc), repr(answer)[:600])

    run()
    assert not bad.found, bad.table()


@fuzz_settings(200)
@given(status=st.integers(100, 999), body=st.one_of(JSON_VALUES, RAW_BODIES, st.text()))
def test_upstream_error_parsing_never_raises(status: int, body: Any) -> None:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    error = d.parse_upstream_error(status, raw)
    for dialect in d.Dialect:
        reply = d.upstream_error_reply(dialect, error)
        assert 400 <= reply.status <= 599
        json.dumps(reply.body, allow_nan=False)
        list(d.responses_failed_sse({"id": "x"}, code=reply.failure_code, message=reply.message))


# --------------------------------------------------------------------------- (iv) answers via proxy

HARNESS_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "smol", "messages": [USER]}),
    ("/v1/chat/completions", {"model": "smol", "messages": [USER], "logprobs": True}),
    ("/v1/chat/completions", {"model": "smol", "messages": [USER], "stream": True}),
    ("/v1/completions", {"model": "smol", "prompt": "Once"}),
    ("/v1/responses", {"model": "smol", "input": "hi"}),
    ("/v1/responses", {"model": "smol", "input": "hi", "stream": True}),
    ("/v1/messages", {"model": "smol", "max_tokens": 16, "messages": [USER]}),
    ("/v1/messages", {"model": "smol", "max_tokens": 16, "messages": [USER], "stream": True}),
]


@dataclass
class FakeUpstream:
    """Answers every generating request with whatever the test set last."""

    status: int = 200
    body: bytes = b"{}"

    async def respond(self, request: Request) -> Response:
        await request.body()
        return Response(self.body, status_code=self.status, media_type="application/json")

    async def tokenize(self, request: Request) -> Response:
        return Response(b'{"count": 2, "tokens": [1, 2], "max_model_len": 4096}')

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.respond, methods=["POST"]),
                Route("/v1/completions", self.respond, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
            ]
        )


@dataclass
class AnswerProbe:
    """The proxy in front of a :class:`FakeUpstream`, and the checks of one call through it."""

    fake: FakeUpstream
    client: httpx.Client
    lt: LedgerThread
    errors: ServerErrors
    bad: Violations
    outcomes: dict[str, int]

    def call(
        self, route: str, harness: dict[str, Any], answer: Any, status: int, label: str = ""
    ) -> None:
        kind = "completion" if route == "/v1/completions" else "chat"
        self.fake.status = status
        self.fake.body = answer if isinstance(answer, bytes) else encode(answer)[0]
        rid = f"uf{RUN}-{uuid.uuid4().hex[:10]}"
        dialect = f"{route}{' stream' if harness.get('stream') else ''}"
        if harness.get("logprobs"):
            dialect += " logprobs"
        if label:
            dialect += f" [{label}]"
        example = f"upstream {status} {self.fake.body[:500]!r}"
        n_err = len(self.errors.records)
        resp = self.client.post(f"/ng-rollout/{rid}/training-token-capture{route}", json=harness)
        got = resp.status_code
        relayed = got == status and got >= 500
        if got >= 500 and not relayed and got not in (502, 504):
            self.bad.add(f"{dialect} -> {_server_error(self.errors, n_err, resp)}", example)
        elif got >= 500 and "error" not in resp.text:
            self.bad.add(f"{dialect} -> {got} without an error body", example)
        rows = self.lt.run(lambda led: call_rows(led, rid))
        reasons = self.lt.run(lambda led: incomplete_reasons(led, rid))
        if self.lt.run(lambda led: half_written(led, [rid])):
            self.bad.add(f"{dialect}: half-written call", example)
        captured = [r for r in rows if r.status == "captured"]
        answered = got == 200 and "event: response.failed" not in resp.text
        if answered and not (captured or reasons):
            self.bad.add(f"{dialect}: answered 200, nothing captured, not incomplete", example)
        if captured:
            extract = extract_completion_tokens if kind == "completion" else extract_chat_tokens
            try:
                expected = extract(answer).generation_token_ids
                if _stored_tokens(self.lt, rid)[0] != expected:
                    self.bad.add(f"{dialect}: stored tokens differ from the answer's", example)
            except TokenExtractionError as exc:
                self.bad.add(f"{dialect}: captured an answer extraction refuses ({exc})", example)
        label = "captured" if captured else ("incomplete" if reasons else f"s{got}")
        self.outcomes[label] = self.outcomes.get(label, 0) + 1


@contextlib.contextmanager
def answer_probe(db_url: str) -> Iterator[AnswerProbe]:
    fake = FakeUpstream()
    with ThreadedServer(fake.app()) as upstream:
        settings_ = load_settings(db=db_url, upstream=upstream.url + "/v1")
        with (
            ThreadedServer(create_app(settings_), lifespan="on", startup_timeout=60) as app,
            ledger_thread(db_url) as lt,
            fuzz_client(app.url) as client,
            ServerErrors().attached() as errors,
        ):
            yield AnswerProbe(fake, client, lt, errors, Violations(), {})


def _malformed_answers(kind: str) -> list[tuple[str, Any]]:
    """One real answer with one field broken the way a misbehaving upstream (or a proxy in
    between) might break it."""
    base = sample_answers()[kind][0]

    def edit(path: tuple[Any, ...], value: Any) -> Any:
        doc = copy.deepcopy(base)
        _get(doc, path[:-1])[path[-1]] = value
        return doc

    answers = [
        ("empty object", {}),
        ("no choices", edit(("choices",), [])),
        ("usage.prompt_tokens Infinity", edit(("usage", "prompt_tokens"), math.inf)),
        ("usage.completion_tokens 'abc'", edit(("usage", "completion_tokens"), "abc")),
        ("created NaN", edit(("created",), math.nan)),
        ("id lone surrogate", edit(("id",), "\ud800")),
        ("choices[0] a number", edit(("choices", 0), 7)),
        ("first log-prob -Infinity", _first_logprob(base, -math.inf)),
    ]
    if kind == "chat":
        answers.append(("message.tool_calls 5", edit(("choices", 0, "message", "tool_calls"), 5)))
    return answers


def _first_logprob(answer: dict[str, Any], value: float) -> dict[str, Any]:
    doc = copy.deepcopy(answer)
    logprobs = doc["choices"][0].get("logprobs") or {}
    if isinstance(logprobs.get("content"), list):
        logprobs["content"][0]["logprob"] = value
    elif isinstance(logprobs.get("token_logprobs"), list):
        logprobs["token_logprobs"][0] = value
    return doc


def test_upstream_malformed_answers_through_proxy(db_url: str) -> None:
    """Each harness dialect against each kind of malformed 200 answer: never a bare 500, never
    a silent hole.  (The fuzz below explores the same space at random.)"""
    with answer_probe(db_url) as probe:
        for route, harness in HARNESS_CALLS:
            kind = "completion" if route == "/v1/completions" else "chat"
            for name, answer in _malformed_answers(kind):
                probe.call(route, harness, answer, 200, label=name)
    print(f"malformed answers outcomes: {probe.outcomes}")
    assert not probe.bad.found, probe.bad.table()


def test_upstream_answer_fuzz_through_proxy_no_5xx_no_silent_hole(db_url: str) -> None:
    """Mutated upstream answers through the running proxy, every dialect: the harness never
    gets a bare 500 (only an upstream 500 relayed, or a 502 in its dialect), and an answered
    call is captured with the upstream's tokens or its rollout is incomplete with a reason."""
    with answer_probe(db_url) as probe:

        @fuzz_settings(70)
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            route, harness = data.draw(st.sampled_from(HARNESS_CALLS), label="harness")
            kind = "completion" if route == "/v1/completions" else "chat"
            answer = data.draw(st.one_of(answers_of(kind), JSON_VALUES), label="answer")
            status = data.draw(st.sampled_from([200, 200, 200, 200, 400, 500, 503]))
            probe.call(route, harness, answer, status)

        run()

    print(f"upstream answer fuzz outcomes: {probe.outcomes}")
    assert not probe.bad.found, probe.bad.table()


def _stored_tokens(lt: LedgerThread, rid: str) -> tuple[list[int], list[float]]:
    async def load(led: Ledger) -> tuple[list[int], list[float]]:
        snap = await led.freeze(rid)
        entry = snap.entries[0]
        return entry.generation_token_ids, entry.generation_log_probs

    result: tuple[list[int], list[float]] = lt.run(load)
    return result
