"""The capture proxy (design §5.1, §5.2): routing, custody, capture and answering.

``/ng-rollout/<id>/training-token-capture/<rest>`` is training capture: an intent is recorded
before dispatch (if it cannot be, the call fails with 503 and nothing goes upstream), the
upstream is asked for token ids, the record is committed before the harness gets its answer,
and the answer goes back in the harness's dialect (JSON, or SSE replayed from the complete
response).  Capture never fails the call: a response without ids, a malformed payload or a
failed write marks the rollout incomplete with its reason.  The one exception is prefix
supply (``api.prefix``): a call whose required prefix the engine did not prove fails.  An
upstream attempt that put nothing in front of the harness stays open for a retry of the same
request to cancel it (issue 11); a refused connection is retried once here.

``/ng-rollout/<id>/<rest>`` is evaluation correlation and any other path is plain
pass-through: forwarded as is (streamed both ways), nothing recorded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import orjson
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from api import dialects as d
from api import prefix
from api.capability import check_proxy_credential, upstream_credentials
from api.extract import (
    MalformedTokenPayload,
    StrippedResponse,
    TokenExtractionError,
    TokenPayload,
    extract_chat_tokens,
    extract_completion_tokens,
    strip_chat_response,
    strip_completion_response,
    tokenize_request_body,
    with_tokenized_prompt,
)
from api.guard import local_answer, public_answer_headers
from api.limits import parse_json_body
from api.metrics import Metrics
from ledger.config import NonGeneratingRoute, Settings
from ledger.errors import LedgerError, RolloutFrozen, RolloutRetired
from ledger.fingerprint import continuation_fingerprint, model_authored_fingerprint
from ledger.ids import ALLOWED_ID_TEXT, MAX_ROLLOUT_ID_LEN, is_valid_id
from ledger.store import Ledger

log = logging.getLogger("rollout_ledger.proxy")

TRAINING = "training-token-capture"
PREFIX_RE = re.compile(
    r"^/ng-rollout/(?P<id>[^/]*)(?P<training>/training-token-capture)?(?P<rest>/.*)?$"
)
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
GENERATING: dict[str, d.Dialect] = {
    "/v1/chat/completions": d.Dialect.CHAT,
    "/v1/completions": d.Dialect.COMPLETIONS,
    "/v1/responses": d.Dialect.RESPONSES,
    "/v1/messages": d.Dialect.ANTHROPIC,
}
COUNT_TOKENS = "/v1/messages/count_tokens"
_PATH_SAFE = "/:@!$&'()*+,;=~"  # RFC 3986 pchar delimiters kept as they are
# Routes of a vLLM upstream whose successful answers cannot carry policy text.
DEFAULT_NON_GENERATING = (
    ("GET", "/v1/models"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/health"),
    ("GET", "/version"),
    ("GET", "/ping"),
    ("HEAD", "/api/hello"),
    ("GET", "/api/hello"),
)


@dataclass(frozen=True, slots=True)
class CallContext:
    rollout_id: str
    model_call_id: str
    dialect: d.Dialect
    route: str
    request_fingerprint: str
    request_items: list[dict[str, Any]]
    metrics: Metrics
    # Extra record fields (prefix supply's flags and context digest).
    record_extra: dict[str, Any] = field(default_factory=dict)
    # Digest of the harness's request bytes: an SDK retry sends the same bytes (issue 11).
    retry_key: str = ""


def _declared(settings: Settings) -> frozenset[tuple[str, str]]:
    extra = [(r.method, r.path) for r in settings.token_id_capture_non_generating_requests]
    return frozenset([*DEFAULT_NON_GENERATING, *extra])


def install_proxy(app: FastAPI, settings: Settings) -> None:
    """Register the catch-all proxy route (after the ledger API, so those paths win)."""
    declared = _declared(settings)
    # Validate declarations once more at startup (config already refuses bad ones).
    for method, path in declared:
        NonGeneratingRoute(method=method, path=path)

    @app.api_route(
        "/{full_path:path}",
        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
        include_in_schema=False,
    )
    async def proxy(request: Request, full_path: str) -> Response:
        path = "/" + full_path
        if (local := local_answer(request, path)) is not None:
            return local
        if settings.upstream is None:
            return _no_upstream(path)
        match = PREFIX_RE.match(path)
        if match is None:
            if (refused := check_proxy_credential(request, settings, None, path)) is not None:
                return refused
            return await _forward(request, path)
        rollout_id = match.group("id")
        if not is_valid_id(rollout_id):
            return JSONResponse(
                {
                    "error": {
                        "code": "invalid_rollout_id",
                        "message": (
                            f"rollout id in the URL must be {ALLOWED_ID_TEXT}, at most "
                            f"{MAX_ROLLOUT_ID_LEN} characters; got {rollout_id!r}"
                        ),
                    }
                },
                status_code=400,
            )
        rest = match.group("rest") or "/"
        if (refused := check_proxy_credential(request, settings, rollout_id, rest)) is not None:
            return refused
        if not match.group("training"):
            return await _forward(request, rest)
        return await _capture(request, rollout_id, rest, settings, declared)


def _no_upstream(path: str) -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "code": "no_upstream",
                "message": (
                    f"no upstream is configured, so {path} cannot be proxied: start the "
                    "service with --upstream URL (for example http://127.0.0.1:8000/v1)"
                ),
            }
        },
        status_code=503,
    )


def _upstream_headers(request: Request) -> dict[str, str]:
    """The harness's headers minus hop-by-hop ones; credentials as api.capability says."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    if "authorization" not in {k.lower() for k in headers} and "x-api-key" in request.headers:
        headers["authorization"] = f"Bearer {request.headers['x-api-key']}"
    return upstream_credentials(request, headers)


async def _forward(request: Request, path: str) -> Response:
    """Plain pass-through: stream the request up and the answer back, record nothing."""
    client: httpx.AsyncClient = request.app.state.upstream
    headers = _upstream_headers(request)
    if "accept-encoding" not in {k.lower() for k in headers}:
        # Not httpx's default (gzip, ...): the raw answer goes back to a harness that did
        # not offer to decode anything.
        headers["accept-encoding"] = "identity"
    try:
        upstream_req = client.build_request(
            request.method,
            # The decoded path, percent-encoded again (a %00 or a space must not reach the
            # URL builder raw).
            quote(path, safe=_PATH_SAFE),
            params=request.url.query or None,
            headers=headers,
            content=request.stream(),
        )
    except httpx.InvalidURL as exc:
        return JSONResponse({"error": {"code": "invalid_path", "message": str(exc)}}, 400)
    try:
        upstream = await client.send(upstream_req, stream=True)
    except httpx.TimeoutException as exc:
        return JSONResponse({"error": {"code": "upstream_timeout", "message": str(exc)}}, 504)
    except httpx.HTTPError as exc:
        return JSONResponse({"error": {"code": "upstream_unavailable", "message": str(exc)}}, 502)
    # The raw bytes go back still encoded, so their content-encoding goes with them.
    answer_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
    answer_headers = public_answer_headers(answer_headers, str(client.base_url))
    return StreamingResponse(
        upstream.aiter_raw(),
        status_code=upstream.status_code,
        headers=answer_headers,
        background=BackgroundTask(upstream.aclose),
    )


# --------------------------------------------------------------------------- capture


async def _capture(
    request: Request,
    rollout_id: str,
    rest: str,
    settings: Settings,
    declared: frozenset[tuple[str, str]],
) -> Response:
    method = request.method.upper()
    if method == "POST" and rest == COUNT_TOKENS:
        return await _count_tokens(request)
    dialect = GENERATING.get(rest) if method == "POST" else None
    if dialect is None:
        return await _non_generating(request, rollout_id, method, rest, declared)
    ledger: Ledger = request.app.state.ledger
    metrics: Metrics = request.app.state.metrics
    raw = await request.body()
    try:
        body = await parse_json_body(raw)
        if not isinstance(body, dict):
            raise d.InvalidRequest("the request body must be a JSON object")
        upstream = _build_upstream(dialect, body, settings)
        payload = _json_bytes(upstream.body)
    except Exception as exc:  # nothing was dispatched: refuse with a 400 that says why
        error = _request_error(exc)
        metrics.proxy_calls.labels(dialect.value, "bad_request").inc()
        return _error_response(d.request_error_reply(dialect, error), stream=False, dialect=dialect)
    items = _request_items(dialect, body)
    ctx = CallContext(
        rollout_id=rollout_id,
        model_call_id=uuid.uuid4().hex,
        dialect=dialect,
        route=f"POST {rest}",
        request_fingerprint=_fingerprint(items),
        request_items=items,
        metrics=metrics,
        retry_key=hashlib.sha256(f"{rest}\n".encode() + raw).hexdigest(),
    )
    plan: prefix.PrefixPlan | None = None
    if settings.supply_prefix_token_ids:
        upstream, plan = await prefix.prepare(
            ledger=ledger,
            client=request.app.state.upstream,
            headers=_auth_headers(request),
            rollout_id=rollout_id,
            fingerprint=ctx.request_fingerprint,
            upstream=upstream,
            backend=settings.prefix_supply_backend,
            metrics=metrics,
        )
        payload = _json_bytes(upstream.body)
        ctx.record_extra.update(prefix.record_fields(upstream, plan))
    try:
        await ledger.begin_call(
            rollout_id, ctx.model_call_id, route=ctx.route, model=str(body.get("model") or "")
        )
    except LedgerError as exc:
        metrics.proxy_calls.labels(dialect.value, "no_custody").inc()
        log.error("intent not recorded rollout=%s call=%s: %s", rollout_id, ctx.model_call_id, exc)
        return _custody_failure(dialect, exc)
    answer = await _call_upstream(request, ctx, upstream, payload, metrics)
    if isinstance(answer, Response):
        return answer
    if plan is not None and plan.requested:
        unproven = await _prove_prefix(ledger, ctx, plan, answer, upstream)
        if unproven is not None:
            return unproven
    stripped = await _record(request, ctx, upstream, answer, ledger, metrics)
    await _settle_retried(ledger, ctx)
    try:
        response = _answer(dialect, upstream, stripped.harness_body, body)
    except Exception as exc:  # a 200 without a usable choice: an upstream error, not ours
        log.warning("unanswerable upstream answer rollout=%s: %s", rollout_id, exc)
        metrics.upstream_errors.labels("bad_answer").inc()
        return _unreadable_answer(dialect, upstream, f"{type(exc).__name__}: {exc}")
    metrics.proxy_calls.labels(dialect.value, "ok").inc()
    return response


def _loads(raw: bytes) -> Any:
    """Parse JSON with orjson (C; about a third of the stdlib's time on a 16k-token answer); the
    stdlib parser only for what orjson refuses but Python's accepts (NaN, lone surrogates), so
    what is accepted is unchanged."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def _json_response(value: Any) -> Response:
    """The harness's answer, serialized by orjson; starlette's stdlib path for what orjson would
    change (non-string keys, NaN, integers beyond 64 bits) so the bytes keep their meaning."""
    try:
        content = orjson.dumps(value)
    except TypeError:
        return JSONResponse(value)
    if b"null" in content and _has_non_finite(value):
        return JSONResponse(value)
    return Response(content, media_type="application/json")


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return value != value or value in (float("inf"), float("-inf"))
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_non_finite(v) for v in value)
    return False


def _json_bytes(value: Any) -> bytes:
    """``value`` as the JSON the upstream gets; NaN, infinities and unpaired surrogates (which
    Python's parser accepts) cannot be sent, so they are the harness's error, not ours."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return text.encode("utf-8")
    except ValueError as exc:  # UnicodeEncodeError is a ValueError
        raise d.InvalidRequest(
            f"the request body holds a value JSON cannot carry (NaN, Infinity or an unpaired "
            f"surrogate such as \\ud800): {exc}"
        ) from exc


def _request_error(exc: Exception) -> d.DialectError:
    """The 400 for a request body the proxy cannot send upstream."""
    if isinstance(exc, d.DialectError):
        return exc
    if isinstance(exc, ValueError):  # json.JSONDecodeError, UnicodeDecodeError
        return d.InvalidRequest(f"the request body is not valid JSON: {exc}")
    # A shape the translators did not foresee (a number where an object belongs, ...).
    log.warning("untranslatable request body: %s: %s", type(exc).__name__, exc)
    return d.InvalidRequest(
        f"the request body has a shape the proxy cannot translate ({type(exc).__name__}: "
        f"{exc}); check it against the API's request schema"
    )


def _build_upstream(
    dialect: d.Dialect, body: dict[str, Any], settings: Settings
) -> d.UpstreamRequest:
    pins = settings.sampling_overrides
    if dialect is d.Dialect.CHAT:
        return d.build_chat_upstream(body, sampling_overrides=pins)
    if dialect is d.Dialect.COMPLETIONS:
        return d.build_completions_upstream(body, sampling_overrides=pins)
    if dialect is d.Dialect.RESPONSES:
        return d.build_responses_upstream(body, sampling_overrides=pins)
    return d.build_anthropic_upstream(body, sampling_overrides=pins)


def _request_items(dialect: d.Dialect, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation items of a request, for the model-authored fingerprint."""
    key = "input" if dialect is d.Dialect.RESPONSES else "messages"
    items = body.get(key)
    if not isinstance(items, list):
        return []
    return [i for i in items if isinstance(i, dict)]


def _fingerprint(items: list[dict[str, Any]]) -> str:
    try:
        return model_authored_fingerprint(items)
    except (TypeError, ValueError):
        return ""


async def _call_upstream(
    request: Request,
    ctx: CallContext,
    upstream: d.UpstreamRequest,
    payload: bytes,
    metrics: Metrics,
) -> dict[str, Any] | Response:
    """POST upstream; on failure answer in the dialect and settle the intent."""
    client: httpx.AsyncClient = request.app.state.upstream
    ledger: Ledger = request.app.state.ledger
    started = time.perf_counter()
    try:
        resp = await _post_upstream(client, upstream.path, payload, _json_headers(request), metrics)
        raw = resp.content
    except (httpx.HTTPError, ConnectionError) as exc:
        timeout = isinstance(exc, httpx.TimeoutException)
        kind = "timeout" if timeout else "transport"
        metrics.upstream_errors.labels(kind).inc()
        await _failed_attempt(ledger, ctx, f"{kind}: {exc}")
        reply = d.transport_error_reply(ctx.dialect, timeout=timeout, detail=str(exc) or kind)
        return _error_response(reply, stream=upstream.stream, dialect=ctx.dialect)
    finally:
        metrics.upstream_seconds.labels(upstream.path).observe(time.perf_counter() - started)
    if resp.status_code >= 400:
        error = d.parse_upstream_error(resp.status_code, raw)
        metrics.upstream_errors.labels(str(resp.status_code)).inc()
        if resp.status_code < 500:
            # The engine refused the request: nothing was generated, so the intent is closed.
            await _cancel(ledger, ctx)
        else:
            await _failed_attempt(ledger, ctx, f"HTTP {resp.status_code}: {error.message}")
        reply = d.upstream_error_reply(ctx.dialect, error)
        return _error_response(reply, stream=upstream.stream, dialect=ctx.dialect)
    try:
        answer = _loads(raw)
        if not isinstance(answer, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        metrics.upstream_errors.labels("bad_json").inc()
        await _settle(ledger, ctx, "malformed_token_payload", f"upstream answer is not JSON: {exc}")
        return _unreadable_answer(ctx.dialect, upstream, "not a JSON object")
    return answer


async def _post_upstream(
    client: httpx.AsyncClient,
    path: str,
    payload: bytes,
    headers: dict[str, str],
    metrics: Metrics,
) -> httpx.Response:
    """POST a generating request; a refused connection (nothing was sent, so nothing can have
    been generated) is retried once, at once."""
    try:
        return await client.post(path, content=payload, headers=headers)
    except httpx.ConnectError:
        metrics.upstream_retries.inc()
        return await client.post(path, content=payload, headers=headers)


async def _failed_attempt(ledger: Ledger, ctx: CallContext, detail: str) -> None:
    """An upstream attempt that put nothing in front of the harness (a transport failure or a
    5xx; the proxy never streams a partial answer): its intent stays open with a note.  A
    successful retry of the same request cancels it; otherwise freeze counts it as a lost
    call (``upstream_error``).  If the note cannot be written the rollout is marked now."""
    try:
        noted = await ledger.note_failed_attempt(
            ctx.rollout_id,
            ctx.model_call_id,
            reason="upstream_error",
            detail=detail,
            retry_key=ctx.retry_key,
        )
    except RolloutFrozen:
        return
    except Exception as exc:  # LedgerError or unexpected: fall back to the immediate mark
        log.error("could not note failed attempt rollout=%s: %s", ctx.rollout_id, exc)
        noted = False
    if noted:
        ctx.metrics.failed_attempts.inc()
        log.warning(
            "rollout=%s call=%s upstream attempt failed without output (%s); a successful "
            "retry cancels it",
            ctx.rollout_id,
            ctx.model_call_id,
            detail[:300],
        )
    else:
        await _settle(ledger, ctx, "upstream_error", detail)


async def _settle_retried(ledger: Ledger, ctx: CallContext) -> None:
    """This call succeeded: earlier failed attempts of the same request are cancelled."""
    try:
        settled = await ledger.settle_failed_attempts(ctx.rollout_id, ctx.retry_key)
    except LedgerError as exc:  # they stay open and mask at freeze: safe
        log.warning("could not settle retried attempts rollout=%s: %s", ctx.rollout_id, exc)
        return
    if settled:
        ctx.metrics.retried_attempts.inc(len(settled))
        log.info("rollout=%s retried attempts cancelled: %s", ctx.rollout_id, settled)


async def _prove_prefix(
    ledger: Ledger,
    ctx: CallContext,
    plan: prefix.PrefixPlan,
    answer: dict[str, Any],
    upstream: d.UpstreamRequest,
) -> Response | None:
    """Fail the model call unless the engine proved it generated over the required prefix
    (design §4.9): the answer is not recorded and the rollout is marked incomplete."""
    problem = prefix.check_answer(plan, answer)
    if problem is None:
        ctx.record_extra["prefix_supplied"] = True
        ctx.metrics.prefix_supplied.inc()
        return None
    ctx.metrics.upstream_errors.labels("prefix_unproven").inc()
    await _settle(ledger, ctx, "prefix_supply_unproven", problem)
    error = d.UpstreamError(status=502, message=f"prefix supply failed: {problem}")
    reply = d.upstream_error_reply(ctx.dialect, error)
    return _error_response(reply, stream=upstream.stream, dialect=ctx.dialect)


def _unreadable_answer(dialect: d.Dialect, upstream: d.UpstreamRequest, detail: str) -> Response:
    """A 502 in the harness's dialect for a successful upstream answer it cannot be given."""
    error = d.UpstreamError(
        status=502, message=f"the inference server answered with something unusable: {detail}"
    )
    reply = d.upstream_error_reply(dialect, error)
    return _error_response(reply, stream=upstream.stream, dialect=dialect)


def _json_headers(request: Request) -> dict[str, str]:
    return {**_auth_headers(request), "content-type": "application/json"}


def _auth_headers(request: Request) -> dict[str, str]:
    headers = _upstream_headers(request)
    keep = {"authorization", "openai-organization", "openai-project", "x-request-id"}
    return {k: v for k, v in headers.items() if k.lower() in keep}


async def _settle(ledger: Ledger, ctx: CallContext, reason: str, detail: str) -> None:
    """Mark the rollout incomplete; a failure to do so is logged, never raised."""
    try:
        await ledger.mark_incomplete(
            ctx.rollout_id, ctx.model_call_id, reason=reason, detail=detail
        )
    except RolloutFrozen:
        pass
    except Exception as exc:  # LedgerError or unexpected: logged, the call goes on
        log.error("could not mark rollout=%s incomplete (%s): %s", ctx.rollout_id, reason, exc)
    else:
        ctx.metrics.incomplete.labels(reason).inc()
        log.warning(
            "rollout=%s call=%s marked incomplete: %s (%s)",
            ctx.rollout_id,
            ctx.model_call_id,
            reason,
            detail[:300],
        )


async def _cancel(ledger: Ledger, ctx: CallContext) -> None:
    try:
        await ledger.cancel_call(ctx.rollout_id, ctx.model_call_id)
    except LedgerError as exc:
        log.warning(
            "could not cancel intent rollout=%s call=%s: %s", ctx.rollout_id, ctx.model_call_id, exc
        )


async def _record(
    request: Request,
    ctx: CallContext,
    upstream: d.UpstreamRequest,
    answer: dict[str, Any],
    ledger: Ledger,
    metrics: Metrics,
) -> StrippedResponse:
    """Extract, cross-check and commit the call's record; never raises."""
    chat = upstream.dialect is not d.Dialect.COMPLETIONS
    strip = strip_chat_response if chat else strip_completion_response
    stripped = strip(answer, keep_logprobs=upstream.keep_logprobs)
    try:
        payload = (extract_chat_tokens if chat else extract_completion_tokens)(answer)
        if payload.needs_tokenize:
            payload = await _tokenize(request, upstream, payload, answer)
    except TokenExtractionError as exc:
        await _settle(ledger, ctx, exc.reason, str(exc))
        return stripped
    except Exception as exc:  # a capture bug must not fail the model call (§4.9)
        log.exception("extraction failed rollout=%s call=%s", ctx.rollout_id, ctx.model_call_id)
        await _settle(ledger, ctx, "capture_failed", f"{type(exc).__name__}: {exc}")
        return stripped
    if chat:
        stripped = _as_response_items(stripped)
    record = _entry(ctx, payload, stripped, answer)
    try:
        cont = continuation_fingerprint(ctx.request_items, _echoed_output(ctx.dialect, stripped))
    except Exception:  # best effort: without it only drift goes undiagnosed
        cont = ""
    try:
        result = await ledger.put(
            record,
            route=ctx.route,
            request_fingerprint=ctx.request_fingerprint,
            continuation_fingerprint=cont,
        )
        log.info(
            "captured rollout=%s call=%s dialect=%s prompt=%d gen=%d parent=%s",
            ctx.rollout_id,
            ctx.model_call_id,
            ctx.dialect.value,
            len(record["prompt_token_ids"]),
            len(record["generation_token_ids"]),
            result.parent_call_id,
        )
    except RolloutFrozen:
        # Frozen while in flight (the harness was stopped): freeze already judged this call
        # from its intent; changing the frozen state would break conditional retirement.
        log.warning("late record dropped rollout=%s call=%s", ctx.rollout_id, ctx.model_call_id)
    except Exception as exc:  # LedgerError, or anything unexpected: never fail the call
        if not isinstance(exc, LedgerError):
            log.exception("record failed rollout=%s call=%s", ctx.rollout_id, ctx.model_call_id)
        await _settle(ledger, ctx, "capture_failed", f"{type(exc).__name__}: {exc}")
    return stripped


def _as_response_items(stripped: StrippedResponse) -> StrippedResponse:
    """Record a chat answer as Responses output items (a message with ``output_text`` parts,
    ``function_call`` items, a ``reasoning`` item): the shape the projection delivers to the
    trainer.  The tokens belong to the last item, as in NeMo Gym's model server."""
    try:
        items = d.chat_to_responses_response(stripped.harness_body)["output"]
    except Exception:  # best effort: an odd answer keeps its chat-shaped item
        return stripped
    if not items:
        return stripped
    return StrippedResponse(stripped.harness_body, items, stripped.response_id, len(items) - 1)


def _echoed_output(dialect: d.Dialect, stripped: StrippedResponse) -> list[dict[str, Any]]:
    """This call's output as the harness sees it, and so echoes it in its next request.

    An Anthropic harness gets ``tool_use.input`` objects derived from the chat ``arguments``
    (arguments that are not a JSON object become ``{}``), so its continuation must be
    fingerprinted from that message, or the next request never matches it and drift goes
    undiagnosed.
    """
    if dialect is d.Dialect.ANTHROPIC:
        content = d.chat_to_anthropic_message(stripped.harness_body)["content"]
        return [{"role": "assistant", "content": content}]
    return stripped.output_items


async def _tokenize(
    request: Request, upstream: d.UpstreamRequest, payload: TokenPayload, answer: dict[str, Any]
) -> TokenPayload:
    client: httpx.AsyncClient = request.app.state.upstream
    try:
        resp = await client.post(
            "/tokenize", json=tokenize_request_body(upstream.body), headers=_auth_headers(request)
        )
        resp.raise_for_status()
        tokenized = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise MalformedTokenPayload(f"no inline prompt ids and /tokenize failed: {exc}") from exc
    return with_tokenized_prompt(payload, tokenized, usage=answer.get("usage"))


def _entry(
    ctx: CallContext, payload: TokenPayload, stripped: StrippedResponse, answer: Mapping[str, Any]
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "schema_version": 1,
        "rollout_id": ctx.rollout_id,
        "model_call_id": ctx.model_call_id,
        "model": str(answer.get("model") or ""),
        "prompt_token_ids": payload.prompt_token_ids,
        "generation_token_ids": payload.generation_token_ids,
        "generation_log_probs": payload.generation_log_probs,
        "routed_experts": payload.routed_experts,
        "output_items": stripped.output_items,
        "token_item_index": stripped.token_item_index,
        "created_at": time.time(),
        "response_id": stripped.response_id,
    }
    if payload.prompt_source == "tokenize":
        entry["prompt_source"] = "tokenize"
    entry.update(ctx.record_extra)
    return entry


# --------------------------------------------------------------------------- answers


def _answer(
    dialect: d.Dialect,
    upstream: d.UpstreamRequest,
    body: dict[str, Any],
    request_body: dict[str, Any],
) -> Response:
    if dialect is d.Dialect.ANTHROPIC:
        out = d.chat_to_anthropic_message(body)
        frames: Iterator[bytes] | None = d.anthropic_sse(out) if upstream.stream else None
    elif dialect is d.Dialect.RESPONSES:
        out = d.chat_to_responses_response(body, request=request_body)
        frames = d.responses_sse(out) if upstream.stream else None
    elif dialect is d.Dialect.COMPLETIONS:
        out = body
        frames = (
            d.completion_sse(out, include_usage=upstream.include_usage) if upstream.stream else None
        )
    else:
        out = body
        frames = (
            d.chat_completion_sse(out, include_usage=upstream.include_usage)
            if upstream.stream
            else None
        )
    if frames is None:
        return _json_response(out)
    return StreamingResponse(
        _aiter(list(frames)), media_type=d.SSE_MEDIA_TYPE, headers={"cache-control": "no-cache"}
    )


async def _aiter(frames: list[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame


def _error_response(reply: d.ErrorReply, *, stream: bool, dialect: d.Dialect) -> Response:
    if stream and dialect is d.Dialect.RESPONSES:
        # Codex expects a failed stream on HTTP 200, not an HTTP error.
        identity = {
            "id": f"resp_failed_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "model": None,
            "output": [],
        }
        frames = list(
            d.responses_failed_sse(identity, code=reply.failure_code, message=reply.message)
        )
        return StreamingResponse(_aiter(frames), media_type=d.SSE_MEDIA_TYPE)
    return JSONResponse(reply.body, status_code=reply.status)


def _custody_failure(dialect: d.Dialect, exc: LedgerError) -> Response:
    if isinstance(exc, RolloutFrozen | RolloutRetired):
        return _closed_rollout(dialect, exc)
    message = (
        f"the capture ledger could not record this call before dispatch ({exc.message}); "
        "the call was not sent to the model"
    )
    if dialect is d.Dialect.ANTHROPIC:
        body: dict[str, Any] = {"type": "error", "error": {"type": "api_error", "message": message}}
    else:
        body = {
            "error": {
                "message": message,
                "type": "server_error",
                "param": None,
                "code": "capture_unavailable",
            }
        }
    return JSONResponse(body, status_code=503)


def _closed_rollout(dialect: d.Dialect, exc: LedgerError) -> Response:
    """A frozen or retired rollout id is the client's mistake: 400, never retried by SDKs."""
    closed = "retired" if isinstance(exc, RolloutRetired) else "frozen"
    message = (
        f"rollout {exc.rollout_id or ''} is {closed}: its capture was already "
        f"{'delivered and retired' if closed == 'retired' else 'frozen for delivery'}, so it "
        "takes no more calls; start the next rollout under a new id "
        "(/ng-rollout/<new id>/training-token-capture/)"
    )
    if dialect is d.Dialect.ANTHROPIC:
        body: dict[str, Any] = {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }
    else:
        body = {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": f"rollout_{closed}",
            }
        }
    # ``x-should-retry: false``: the OpenAI and Anthropic SDKs honour it before the status.
    return JSONResponse(body, status_code=400, headers={"x-should-retry": "false"})


# --------------------------------------------------------------------------- other routes


async def _count_tokens(request: Request) -> Response:
    """Anthropic ``count_tokens``: answered from the upstream's ``/tokenize``."""
    client: httpx.AsyncClient = request.app.state.upstream
    try:
        body = json.loads(await request.body())
        if not isinstance(body, dict):
            raise d.InvalidRequest("the request body must be a JSON object")
        tokenize = _json_bytes(d.anthropic_count_tokens_tokenize_body(body))
    except Exception as exc:  # refused before anything was sent
        reply = d.request_error_reply(d.Dialect.ANTHROPIC, _request_error(exc))
        return JSONResponse(reply.body, status_code=reply.status)
    try:
        resp = await client.post("/tokenize", content=tokenize, headers=_json_headers(request))
    except httpx.HTTPError as exc:
        reply = d.transport_error_reply(
            d.Dialect.ANTHROPIC, timeout=isinstance(exc, httpx.TimeoutException), detail=str(exc)
        )
        return JSONResponse(reply.body, status_code=reply.status)
    if resp.status_code >= 400:
        reply = d.upstream_error_reply(
            d.Dialect.ANTHROPIC, d.parse_upstream_error(resp.status_code, resp.content)
        )
        return JSONResponse(reply.body, status_code=reply.status)
    try:
        return JSONResponse(d.anthropic_count_tokens_response(resp.json()))
    except (ValueError, TypeError, AttributeError) as exc:
        unusable = d.UpstreamError(
            status=502, message=f"the inference server's /tokenize answer is unusable: {exc}"
        )
        reply = d.upstream_error_reply(d.Dialect.ANTHROPIC, unusable)
        return JSONResponse(reply.body, status_code=reply.status)


async def _non_generating(
    request: Request,
    rollout_id: str,
    method: str,
    rest: str,
    declared: frozenset[tuple[str, str]],
) -> Response:
    """Forward an unrecognised training route; mark incomplete unless provably harmless.

    404/405 cannot have produced policy text.  A declared (method, path) passes when it
    succeeds.  Any other outcome (2xx/3xx of an undeclared route, 5xx, an exception, no
    response) may have put policy text in front of the harness: the rollout is incomplete.
    """
    route = f"{method} {rest}"
    try:
        response = await _forward(request, rest)
    except Exception as exc:
        await _mark_route(request, rollout_id, route, f"exception: {exc}")
        raise
    status = response.status_code
    harmless = status in (404, 405) or ((method, rest) in declared and 200 <= status < 300)
    if not harmless:
        await _mark_route(request, rollout_id, route, f"status {status}")
    return response


async def _mark_route(request: Request, rollout_id: str, route: str, outcome: str) -> None:
    ledger: Ledger = request.app.state.ledger
    try:
        await ledger.mark_incomplete(
            rollout_id,
            reason="unrecognized_route",
            detail=f"{route} -> {outcome}; declare it in token_id_capture_non_generating_requests "
            "only if its answers can never carry policy-generated text",
        )
    except LedgerError as exc:
        log.error("could not mark rollout=%s incomplete for %s: %s", rollout_id, route, exc)
    else:
        request.app.state.metrics.incomplete.labels("unrecognized_route").inc()
