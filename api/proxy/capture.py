"""Training capture of one generating call (design §5.1, §5.2): an intent is recorded before
dispatch (if it cannot be, the call fails with 503 and nothing goes upstream), the upstream is
asked for token ids, the record is committed before the harness gets its answer.  Capture
never fails the call: a response without ids, a malformed payload or a failed write marks the
rollout incomplete with its reason.  The one exception is prefix supply (``api.prefix``): a
call whose required prefix the engine did not prove fails.  An upstream attempt that put
nothing in front of the harness stays open for a retry of the same request to cancel it
(issue 11); a refused connection is retried once here.

What differs by dialect comes from the call's ``DialectHandler`` (``api.proxy.handlers``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from fastapi import Request, Response
from fastapi.responses import JSONResponse

from api import dialects as d
from api import prefix
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
from api.limits import OFFLOAD_BYTES, OFFLOAD_TOKENS, parse_json_body
from api.metrics import Metrics
from api.proxy.handlers import HANDLERS, DialectHandler
from api.proxy.headers import auth_headers, json_headers
from api.proxy.known_prompts import KnownPrompts, Parsed
from api.proxy.reply import (
    custody_failure,
    error_response,
    harness_answer,
    unreadable_answer,
)
from api.upstream import UpstreamAnswer, UpstreamFailure, UpstreamPoster
from ledger import jsonio
from ledger.config import Settings
from ledger.errors import LedgerError, RolloutFrozen
from ledger.fingerprint import continuation_fingerprint, model_authored_fingerprint
from ledger.ids import MAX_CALL_ID_LEN, is_valid_id
from ledger.records import TokenEntry
from ledger.store import Ledger
from ledger.token_rules import MAX_CREATED_AT

log = logging.getLogger("rollout_ledger.proxy")


@dataclass(frozen=True, slots=True)
class CallContext:
    rollout_id: str
    model_call_id: str
    handler: DialectHandler
    route: str
    request_fingerprint: str
    request_items: list[dict[str, Any]]
    metrics: Metrics
    # Extra record fields (prefix supply's flags and context digest).
    record_extra: dict[str, Any] = field(default_factory=dict)
    # Digest of the harness's request bytes: an SDK retry sends the same bytes (issue 11).
    retry_key: str = ""

    @property
    def dialect(self) -> d.Dialect:
        return self.handler.dialect


@dataclass(frozen=True, slots=True)
class _Answer:
    """The upstream's parsed answer, with what the prompt-id cache (``KnownPrompts``) needs:
    the engine's text of its prompt ids (None: not found once at a known place) and, when the
    leading ids came from the rollout's last prompt, that parse."""

    body: dict[str, Any]
    prompt_text: bytes | None = None
    parsed: Parsed | None = None


async def capture(
    request: Request,
    rollout_id: str,
    rest: str,
    settings: Settings,
    handler: DialectHandler,
) -> Response:
    """One generating call: intent, upstream, record, answer (see the module docstring)."""
    dialect = handler.dialect
    ledger: Ledger = request.app.state.ledger
    metrics: Metrics = request.app.state.metrics
    raw = await request.body()
    try:
        body = await parse_json_body(raw)
        if not isinstance(body, dict):
            raise d.InvalidRequest("the request body must be a JSON object")
        upstream = handler.build_upstream(body, sampling_overrides=settings.sampling_overrides)
        payload = _json_bytes(upstream.body)
    except Exception as exc:  # nothing was dispatched: refuse with a 400 that says why
        error = _request_error(exc)
        metrics.proxy_calls.labels(dialect.value, "bad_request").inc()
        reply = d.request_error_reply(dialect, error)
        return error_response(reply, stream=False, handler=handler)
    items = handler.request_items(body)
    ctx = CallContext(
        rollout_id=rollout_id,
        model_call_id=uuid.uuid4().hex,
        handler=handler,
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
            headers=auth_headers(request),
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
        return custody_failure(handler, exc)
    answer = await _call_upstream(request, ctx, upstream, payload, metrics)
    if isinstance(answer, Response):
        return answer
    if plan is not None and plan.requested:
        unproven = await _prove_prefix(ledger, ctx, plan, answer.body, upstream)
        if unproven is not None:
            return unproven
    # The record's transaction also cancels earlier failed attempts of this same request;
    # when the record was not stored (extraction or capture failed), they are cancelled on
    # their own, still before the answer.
    stripped, settled = await _record(request, ctx, upstream, answer, ledger, metrics)
    await _settle_retried(ledger, ctx, settled)
    try:
        response = harness_answer(handler, upstream, stripped.harness_body, body)
    except Exception as exc:  # a 200 without a usable choice: an upstream error, not ours
        log.warning("unanswerable upstream answer rollout=%s: %s", rollout_id, exc)
        metrics.upstream_errors.labels("bad_answer").inc()
        return unreadable_answer(handler, upstream, f"{type(exc).__name__}: {exc}")
    metrics.proxy_calls.labels(dialect.value, "ok").inc()
    return response


def _json_bytes(value: Any) -> bytes:
    """``value`` as the JSON the upstream gets; NaN, infinities and unpaired surrogates (which
    Python's parser accepts) cannot be sent, so they are the harness's error, not ours.

    orjson writes it (the same compact text, fifty times faster on a long prompt) unless it
    refuses the value (a lone surrogate, a non-string key, an integer beyond 64 bits) or would
    write a non-finite float as ``null``: then the stdlib decides, as before."""
    try:
        content = orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        pass
    else:
        if b"null" not in content or not jsonio.has_non_finite(value):
            return content
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
) -> _Answer | Response:
    """POST upstream; on failure answer in the dialect and settle the intent."""
    poster: UpstreamPoster = request.app.state.upstream_post
    ledger: Ledger = request.app.state.ledger
    started = time.perf_counter()
    try:
        resp = await _post_upstream(poster, upstream.path, payload, json_headers(request), metrics)
        raw = resp.body
    except UpstreamFailure as exc:
        timeout = exc.kind == "timeout"
        kind = "timeout" if timeout else "transport"
        metrics.upstream_errors.labels(kind).inc()
        await _failed_attempt(ledger, ctx, f"{kind}: {exc}")
        reply = d.transport_error_reply(ctx.dialect, timeout=timeout, detail=str(exc) or kind)
        return error_response(reply, stream=upstream.stream, handler=ctx.handler)
    finally:
        metrics.upstream_seconds.labels(upstream.path).observe(time.perf_counter() - started)
    if resp.status >= 400:
        error = d.parse_upstream_error(resp.status, raw)
        metrics.upstream_errors.labels(str(resp.status)).inc()
        if resp.status < 500:
            # The engine refused the request: nothing was generated, so the intent is closed.
            await _cancel(ledger, ctx)
        else:
            await _failed_attempt(ledger, ctx, f"HTTP {resp.status}: {error.message}")
        reply = d.upstream_error_reply(ctx.dialect, error)
        return error_response(reply, stream=upstream.stream, handler=ctx.handler)
    # A chat answer's prompt ids: the leading ones the rollout's last prompt already had are
    # taken from it, not parsed again (``api.proxy.known_prompts``); the rest of the answer is
    # then parsed on the event loop, so only when it is as short as an answer parsed there.
    known: KnownPrompts = request.app.state.known_prompts
    where = known.locate(raw) if HANDLERS[upstream.dialect].chat_answer else None
    prompt_text = None
    parsed = None
    if where is not None:
        prompt_text = raw[where[0] : where[1]]
        if len(raw) - len(prompt_text) <= OFFLOAD_BYTES:
            parsed = known.parse(ctx.rollout_id, raw, where, prompt_text)
    try:
        if parsed is not None:
            answer = parsed.answer
        elif len(raw) > OFFLOAD_BYTES:  # parsed in a worker thread (the event loop keeps serving)
            answer = await asyncio.to_thread(jsonio.loads, raw)
        else:
            answer = jsonio.loads(raw)
        if not isinstance(answer, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        metrics.upstream_errors.labels("bad_json").inc()
        await _settle(ledger, ctx, "malformed_token_payload", f"upstream answer is not JSON: {exc}")
        return unreadable_answer(ctx.handler, upstream, "not a JSON object")
    return _Answer(answer, prompt_text, parsed)


async def _post_upstream(
    poster: UpstreamPoster,
    path: str,
    payload: bytes,
    headers: dict[str, str],
    metrics: Metrics,
) -> UpstreamAnswer:
    """POST a generating request; a refused connection (nothing was sent, so nothing can have
    been generated) is retried once, at once."""
    try:
        return await poster.post(path, payload, headers)
    except UpstreamFailure as exc:
        if exc.kind != "connect":
            raise
        metrics.upstream_retries.inc()
        return await poster.post(path, payload, headers)


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


async def _settle_retried(
    ledger: Ledger, ctx: CallContext, settled: tuple[str, ...] | None
) -> None:
    """This call succeeded: earlier failed attempts of the same request are cancelled, by the
    record's transaction (``settled``: what it cancelled) or, when the record was not stored
    (None), here."""
    if settled is None:
        try:
            settled = tuple(await ledger.settle_failed_attempts(ctx.rollout_id, ctx.retry_key))
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
    return error_response(reply, stream=upstream.stream, handler=ctx.handler)


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
    upstream_answer: _Answer,
    ledger: Ledger,
    metrics: Metrics,
) -> tuple[StrippedResponse, tuple[str, ...] | None]:
    """Extract, cross-check and commit the call's record; never raises.  Also returns the
    failed attempts of the same request the record's transaction cancelled (None: it did not
    commit)."""
    answer = upstream_answer.body
    settled: tuple[str, ...] | None = None
    chat = HANDLERS[upstream.dialect].chat_answer
    strip = strip_chat_response if chat else strip_completion_response
    stripped = strip(answer, keep_logprobs=upstream.keep_logprobs)
    # A chat answer's leading prompt ids taken from the rollout's last prompt were checked
    # when that prompt was extracted: only the new ones are checked again.
    reused = upstream_answer.parsed.reused if upstream_answer.parsed is not None else 0
    extract = (
        functools.partial(extract_chat_tokens, checked_prompt=reused)
        if chat
        else extract_completion_tokens
    )
    try:
        if _token_count(answer) - reused > OFFLOAD_TOKENS:  # C-speed, but over long arrays
            payload = await asyncio.to_thread(extract, answer)
        else:
            payload = extract(answer)
        if payload.needs_tokenize:
            payload = await _tokenize(request, upstream, payload, answer)
    except TokenExtractionError as exc:
        await _settle(ledger, ctx, exc.reason, str(exc))
        return stripped, None
    except Exception as exc:  # a capture bug must not fail the model call (§4.9)
        log.exception("extraction failed rollout=%s call=%s", ctx.rollout_id, ctx.model_call_id)
        await _settle(ledger, ctx, "capture_failed", f"{type(exc).__name__}: {exc}")
        return stripped, None
    if chat:
        stripped = _as_response_items(stripped)
    record = _entry(ctx, payload, stripped, answer)
    packed = _known_prompt(request.app.state.known_prompts, ctx, upstream_answer, record)
    try:
        cont = continuation_fingerprint(ctx.request_items, ctx.handler.echoed_output(stripped))
    except Exception:  # best effort: without it only drift goes undiagnosed
        cont = ""
    try:
        result = await ledger.put(
            _checked_entry(record, packed),
            route=ctx.route,
            request_fingerprint=ctx.request_fingerprint,
            continuation_fingerprint=cont,
            settle_retry_key=ctx.retry_key,
        )
        settled = result.settled
        # One line per call at debug level (``serve --log-level debug``): at INFO it cost
        # ~0.3 ms of the answer path, and a cluster's calls are counted in /metrics.
        log.debug(
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
    return stripped, settled


def _known_prompt(
    known: KnownPrompts, ctx: CallContext, answer: _Answer, record: Mapping[str, Any]
) -> bytes | None:
    """The record's prompt ids packed (reusing the packed ids the parse took from the cache),
    remembered for the rollout's next call when the answer carried them at its top level; None
    when they are not (the ledger packs them itself)."""
    ids = record["prompt_token_ids"]
    if answer.prompt_text is None or not isinstance(answer.body.get("prompt_token_ids"), list):
        return None
    try:
        packed = known.packed(ids, answer.parsed)
        if packed is not None:
            known.remember(ctx.rollout_id, answer.prompt_text, ids, packed)
    except Exception:  # the cache only saves work: a bug in it must not fail the call (§4.9)
        log.exception("prompt-id cache failed rollout=%s", ctx.rollout_id)
        return None
    return packed


def _token_count(answer: Mapping[str, Any]) -> int:
    """About how many token ids an answer carries (its prompt ids, wherever the dialect puts
    them); 0 when it carries none inline."""
    ids = answer.get("prompt_token_ids")
    if ids is None:
        choices = answer.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
            ids = choices[0].get("prompt_token_ids")
    return len(ids) if isinstance(ids, list) else 0


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


async def _tokenize(
    request: Request, upstream: d.UpstreamRequest, payload: TokenPayload, answer: dict[str, Any]
) -> TokenPayload:
    client: httpx.AsyncClient = request.app.state.upstream
    try:
        resp = await client.post(
            "/tokenize", json=tokenize_request_body(upstream.body), headers=auth_headers(request)
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


def _checked_entry(
    record: dict[str, Any], packed_prompt: bytes | None = None
) -> TokenEntry | dict[str, Any]:
    """The record as a ``TokenEntry``, without pydantic checking again what the extractor just
    checked with the same rules (``ledger.token_rules``: token ids, log-probs, their lengths).
    ``packed_prompt``: its prompt ids already packed, which the ledger then does not pack again.

    A record is validated once: the fields the extractor does not produce (ids, time, item
    index) are checked here, in O(1); a record that fails any of them goes to ``put`` as a
    dict, whose full validation then refuses it with the ledger's own error.  Validating a
    16k-token record again costs milliseconds on the answer path."""
    index = record["token_item_index"]
    created = record["created_at"]
    if not (
        is_valid_id(record["rollout_id"])
        and is_valid_id(record["model_call_id"], MAX_CALL_ID_LEN)
        and len(record["generation_token_ids"]) == len(record["generation_log_probs"])
        and (index is None or 0 <= index < len(record["output_items"]))
        and isinstance(created, float)
        and 0.0 <= created <= MAX_CREATED_AT
        and isinstance(record["prompt_token_ids"], list)
    ):
        return record
    entry = TokenEntry.model_construct(**record)
    if packed_prompt is not None:
        ids = record["prompt_token_ids"]
        entry._packed = {"prompt_token_ids": (ids, len(ids), packed_prompt)}
    return entry


async def count_tokens(request: Request) -> Response:
    """Anthropic ``count_tokens`` (an Anthropic-only route), answered from the upstream's
    ``/tokenize``."""
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
        resp = await client.post("/tokenize", content=tokenize, headers=json_headers(request))
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
