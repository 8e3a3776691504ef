"""Upstream failures, re-stated in the harness's dialect (wire-formats §1.9, §2.1, §4.1-4.3).

An upstream error reaches the harness in its own envelope with the upstream's wording kept
(harnesses match on it), with one deliberate rewrite: a context overflow.  Claude Code
compacts on ``prompt is too long: N tokens > M maximum`` (or lowers ``max_tokens`` on
``input length and `max_tokens` exceed context limit: N + K > M, ...``), and Codex / OpenAI
clients react to ``code: "context_length_exceeded"``, so an overflow is re-worded for them.

The overflow classifier accepts vLLM's old and new envelopes (``{"error": {...}}`` since
v0.10.1, flat before) and texts, and SGLang's: status 400 and (``param`` in
{input_tokens, input_text, max_tokens, max_completion_tokens} or the message contains one
of the overflow phrases).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from api.dialects.common import Dialect, DialectError, JSONDict

__all__ = [
    "ContextOverflow",
    "ErrorReply",
    "UpstreamError",
    "anthropic_overflow_message",
    "classify_context_overflow",
    "parse_upstream_error",
    "request_error_reply",
    "transport_error_reply",
    "upstream_error_reply",
]

_MAX_MESSAGE_CHARS = 4000
_OVERFLOW_PARAMS = frozenset({"input_tokens", "input_text", "max_tokens", "max_completion_tokens"})
_OVERFLOW_PHRASES = (
    "maximum context length",
    "context length is only",
    "is too large",
    "cannot be greater than max_model_len",
    "longer than the model's context length",
)
# Numbers in the overflow texts: the context limit (M), the input size (N), the output asked (K).
_CONTEXT_LIMIT = re.compile(
    r"maximum context length (?:is|of) (\d+)|context length is only (\d+)"
    r"|model's context length \((\d+) tokens\)|max_model_len=(\d+)"
)
_INPUT_TOKENS = re.compile(
    r"you requested (\d+) tokens in the messages|prompt contains at least (\d+) input tokens"
    r"|request has (\d+) input tokens|You passed (\d+) input tokens|The input \((\d+) tokens\)"
    r"|(\d+) tokens from the input messages"
)
_OUTPUT_TOKENS = re.compile(
    r"is too large: (\d+)|max_tokens=(\d+)|requested (\d+) output tokens"
    r"|(\d+) tokens for the completion"
)

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


@dataclass(frozen=True, slots=True)
class ContextOverflow:
    """What an overflow text says: input tokens (N), the context limit (M), and the output
    tokens asked for (K) when the overflow is input + output.  ``None`` where the text is
    silent."""

    input_tokens: int | None = None
    context_limit: int | None = None
    output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class UpstreamError:
    """An upstream error answer, envelope removed."""

    status: int
    message: str
    type: str | None = None
    param: str | None = None
    code: str | int | None = None
    overflow: ContextOverflow | None = None

    @property
    def is_context_overflow(self) -> bool:
        return self.overflow is not None


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """What the harness gets: an HTTP status and a JSON body in its dialect.

    ``failure_code`` and ``message`` are what a Responses ``response.failed`` event carries
    when the harness streams (Codex wants a failed stream on HTTP 200, not an HTTP error).
    """

    status: int
    body: JSONDict
    failure_code: str
    message: str


# --------------------------------------------------------------------------- parsing


def parse_upstream_error(
    status: int, body: bytes | str | Mapping[str, Any] | None
) -> UpstreamError:
    """Read an upstream error answer, whatever its envelope (nested, flat, FastAPI, text)."""
    payload = _decode(body)
    fields = _error_fields(payload)
    message = _message_text(fields.get("message"), payload)
    param = fields.get("param") if isinstance(fields.get("param"), str) else None
    code = fields.get("code")
    return UpstreamError(
        status=status,
        message=message,
        type=fields.get("type") if isinstance(fields.get("type"), str) else None,
        param=param,
        code=code if isinstance(code, (str, int)) and not isinstance(code, bool) else None,
        overflow=classify_context_overflow(status, message, param),
    )


def classify_context_overflow(
    status: int, message: str, param: str | None
) -> ContextOverflow | None:
    """The overflow a 400 describes, or ``None`` when it is not a context overflow."""
    if status != 400:
        return None
    lowered = message.lower()
    if param not in _OVERFLOW_PARAMS and not any(p in lowered for p in _OVERFLOW_PHRASES):
        return None
    return ContextOverflow(
        input_tokens=_first_number(_INPUT_TOKENS, message),
        context_limit=_first_number(_CONTEXT_LIMIT, message),
        output_tokens=_first_number(_OUTPUT_TOKENS, message),
    )


def _decode(body: bytes | str | Mapping[str, Any] | None) -> Any:
    if isinstance(body, bytes):
        body = body.decode("utf-8", errors="replace")
    if isinstance(body, str):
        try:
            return json.loads(body)
        except ValueError:
            return body
    return body


def _error_fields(payload: Any) -> Mapping[str, Any]:
    """The object holding message/type/param/code in any known envelope."""
    if not isinstance(payload, Mapping):
        return {}
    inner = payload.get("error")
    if isinstance(inner, Mapping):
        return inner
    if isinstance(inner, str):
        return {"message": inner}
    if "detail" in payload and "message" not in payload:
        return {"message": payload["detail"]}
    return payload


def _message_text(message: Any, payload: Any) -> str:
    if isinstance(message, str) and message:
        text = message
    elif message is not None:
        text = json.dumps(message, ensure_ascii=False)
    elif isinstance(payload, str) and payload.strip():
        text = payload.strip()
    else:
        text = "the inference server answered with an error and no message"
    return text[:_MAX_MESSAGE_CHARS]


def _first_number(pattern: re.Pattern[str], text: str) -> int | None:
    match = pattern.search(text)
    if match is None:
        return None
    return int(next(group for group in match.groups() if group is not None))


# --------------------------------------------------------------------------- replies


def upstream_error_reply(dialect: Dialect, error: UpstreamError) -> ErrorReply:
    """The harness-facing answer for an upstream error."""
    status = error.status if 400 <= error.status <= 599 else 502
    if error.overflow is not None:
        status = 400
    if dialect is Dialect.ANTHROPIC:
        message = error.message
        if error.overflow is not None:
            message = anthropic_overflow_message(error.overflow, error.message)
        body = _anthropic_body(_anthropic_type(status), message)
        return ErrorReply(status, body, _failure_code(status), error.message)
    if error.overflow is not None:
        body = _openai_body(
            error.message, "invalid_request_error", error.param, "context_length_exceeded"
        )
        return ErrorReply(400, body, "context_length_exceeded", error.message)
    code = error.code if isinstance(error.code, str) else None
    body = _openai_body(error.message, _openai_type(status), error.param, code)
    return ErrorReply(status, body, _failure_code(status), error.message)


def transport_error_reply(dialect: Dialect, *, timeout: bool, detail: str) -> ErrorReply:
    """The harness-facing answer when the upstream could not be reached or timed out."""
    if timeout:
        status, message = 504, f"the inference server did not answer in time: {detail}"
    else:
        status, message = 502, f"the inference server could not be reached: {detail}"
    if dialect is Dialect.ANTHROPIC:
        kind = "timeout_error" if timeout else "api_error"
        return ErrorReply(status, _anthropic_body(kind, message), "server_error", message)
    code = "upstream_timeout" if timeout else "upstream_unavailable"
    return ErrorReply(
        status, _openai_body(message, "server_error", None, code), "server_error", message
    )


def request_error_reply(dialect: Dialect, error: DialectError) -> ErrorReply:
    """The 400 for a harness request the proxy cannot send upstream."""
    if dialect is Dialect.ANTHROPIC:
        body = _anthropic_body("invalid_request_error", error.message)
        if error.details:
            body["error"]["details"] = error.details
    else:
        code = error.details.get("error_code") if error.details else None
        body = _openai_body(error.message, "invalid_request_error", error.param, code)
    return ErrorReply(400, body, "invalid_prompt", error.message)


def anthropic_overflow_message(overflow: ContextOverflow, original: str) -> str:
    """The overflow in the wording Claude Code reacts to.

    Input alone over the limit -> ``prompt is too long: N tokens > M maximum`` (compaction);
    input + ``max_tokens`` over it -> ``input length and `max_tokens` exceed context limit:
    N + K > M, ...`` (Claude Code retries with a smaller ``max_tokens``).  Without N and M in
    the text, the original message follows ``prompt is too long: ``.
    """
    n, m, k = overflow.input_tokens, overflow.context_limit, overflow.output_tokens
    if n is not None and m is not None:
        if k is not None and n < m:
            return (
                f"input length and `max_tokens` exceed context limit: {n} + {k} > {m}, "
                "decrease input length or `max_tokens` and try again"
            )
        return f"prompt is too long: {n} tokens > {m} maximum"
    return f"prompt is too long: {original}"


def _anthropic_body(kind: str, message: str) -> JSONDict:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _openai_body(message: str, kind: str, param: str | None, code: str | None) -> JSONDict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def _openai_type(status: int) -> str:
    return _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def _failure_code(status: int) -> str:
    """The Responses ``response.failed`` code for a status (Codex: 4xx fatal, 5xx retried)."""
    if status == 429:
        return "rate_limit_exceeded"
    return "server_error" if status >= 500 else "invalid_prompt"
