"""Answers in the harness's dialect: built answers (JSON or SSE replayed from the complete
response) and the proxy's own refusals, each shaped by the dialect's handler."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api import dialects as d
from api.proxy.handlers import DialectHandler
from ledger.errors import LedgerError, RolloutFrozen, RolloutRetired
from ledger.jsonio import has_non_finite


def json_response(value: Any) -> Response:
    """The harness's answer, serialized by orjson; starlette's stdlib path for what orjson would
    change (non-string keys, NaN, integers beyond 64 bits) so the bytes keep their meaning."""
    try:
        content = orjson.dumps(value)
    except TypeError:
        return JSONResponse(value)
    if b"null" in content and has_non_finite(value):
        return JSONResponse(value)
    return Response(content, media_type="application/json")


def harness_answer(
    handler: DialectHandler,
    upstream: d.UpstreamRequest,
    body: dict[str, Any],
    request_body: dict[str, Any],
) -> Response:
    out, frames = handler.reply(upstream, body, request_body)
    if frames is None:
        return json_response(out)
    return StreamingResponse(
        _aiter(list(frames)), media_type=d.SSE_MEDIA_TYPE, headers={"cache-control": "no-cache"}
    )


async def _aiter(frames: list[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame


def error_response(reply: d.ErrorReply, *, stream: bool, handler: DialectHandler) -> Response:
    if stream and handler.failed_stream_on_200:
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


def unreadable_answer(
    handler: DialectHandler, upstream: d.UpstreamRequest, detail: str
) -> Response:
    """A 502 in the harness's dialect for a successful upstream answer it cannot be given."""
    error = d.UpstreamError(
        status=502, message=f"the inference server answered with something unusable: {detail}"
    )
    reply = d.upstream_error_reply(handler.dialect, error)
    return error_response(reply, stream=upstream.stream, handler=handler)


def custody_failure(handler: DialectHandler, exc: LedgerError) -> Response:
    if isinstance(exc, RolloutFrozen | RolloutRetired):
        return closed_rollout(handler, exc)
    message = (
        f"the capture ledger could not record this call before dispatch ({exc.message}); "
        "the call was not sent to the model"
    )
    body = handler.error_body("unavailable", message, "capture_unavailable")
    return JSONResponse(body, status_code=503)


def closed_rollout(handler: DialectHandler, exc: LedgerError) -> Response:
    """A frozen or retired rollout id is the client's mistake: 400, never retried by SDKs."""
    closed = "retired" if isinstance(exc, RolloutRetired) else "frozen"
    message = (
        f"rollout {exc.rollout_id or ''} is {closed}: its capture was already "
        f"{'delivered and retired' if closed == 'retired' else 'frozen for delivery'}, so it "
        "takes no more calls; start the next rollout under a new id "
        "(/ng-rollout/<new id>/training-token-capture/)"
    )
    body = handler.error_body("invalid_request", message, f"rollout_{closed}")
    # ``x-should-retry: false``: the OpenAI and Anthropic SDKs honour it before the status.
    return JSONResponse(body, status_code=400, headers={"x-should-retry": "false"})
