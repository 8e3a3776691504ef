"""One handler per dialect, in one table: everything the capture proxy does differently for a
harness that speaks Chat Completions, Completions, Responses or Anthropic Messages.

The proxy's modules never branch on the dialect; they look its handler up in ``HANDLERS``.
The translations themselves live in ``api.dialects`` (pure); a handler only names which of
them serves its dialect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from api import dialects as d
from api.extract import StrippedResponse

ErrorKind = Literal["unavailable", "invalid_request"]
# What a harness gets for a built answer: the JSON body and, when it asked to stream, the SSE
# frames replaying it.
Reply = tuple[Any, Iterator[bytes] | None]


def _openai_error(kind: ErrorKind, message: str, code: str) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": "server_error" if kind == "unavailable" else "invalid_request_error",
            "param": None,
            "code": code,
        }
    }


def _as_recorded(stripped: StrippedResponse) -> list[dict[str, Any]]:
    return stripped.output_items


@dataclass(frozen=True, slots=True)
class DialectHandler:
    """How the proxy treats one dialect, from the request it reads to the answer it writes.

    The defaults are the OpenAI dialects' (chat-form upstream, ``messages``, OpenAI error
    envelopes, the recorded output echoed back as it is)."""

    dialect: d.Dialect
    # Harness body -> the vLLM request (capture fields added, sampling pinned).
    build_upstream: Callable[..., d.UpstreamRequest]
    # The upstream's (chat or completions) answer -> what the harness gets.
    reply: Callable[[d.UpstreamRequest, dict[str, Any], dict[str, Any]], Reply]
    # The request key holding the conversation items (for the model-authored fingerprint).
    items_key: str = "messages"
    # Whether the upstream answers in chat form (else the Completions form).
    chat_answer: bool = True
    # This call's output as the harness sees it, and so echoes it in its next request.
    echoed_output: Callable[[StrippedResponse], list[dict[str, Any]]] = _as_recorded
    # An error body in the dialect's envelope.
    error_body: Callable[[ErrorKind, str, str], dict[str, Any]] = _openai_error
    # A streamed request whose call failed is answered as a failed stream on HTTP 200
    # (Codex expects that of Responses), not as an HTTP error.
    failed_stream_on_200: bool = False

    def request_items(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The conversation items of a request, for the model-authored fingerprint."""
        items = body.get(self.items_key)
        if not isinstance(items, list):
            return []
        return [i for i in items if isinstance(i, dict)]


def _anthropic_error(kind: ErrorKind, message: str, code: str) -> dict[str, Any]:
    del code  # Anthropic envelopes carry a type, no code
    kind_type = "api_error" if kind == "unavailable" else "invalid_request_error"
    return {"type": "error", "error": {"type": kind_type, "message": message}}


def _anthropic_echo(stripped: StrippedResponse) -> list[dict[str, Any]]:
    """An Anthropic harness gets ``tool_use.input`` objects derived from the chat
    ``arguments`` (arguments that are not a JSON object become ``{}``), so its continuation
    must be fingerprinted from that message, or the next request never matches it and drift
    goes undiagnosed."""
    content = d.chat_to_anthropic_message(stripped.harness_body)["content"]
    return [{"role": "assistant", "content": content}]


def _chat_reply(up: d.UpstreamRequest, body: dict[str, Any], _request: dict[str, Any]) -> Reply:
    frames = d.chat_completion_sse(body, include_usage=up.include_usage) if up.stream else None
    return body, frames


def _completions_reply(
    up: d.UpstreamRequest, body: dict[str, Any], _request: dict[str, Any]
) -> Reply:
    frames = d.completion_sse(body, include_usage=up.include_usage) if up.stream else None
    return body, frames


def _responses_reply(up: d.UpstreamRequest, body: dict[str, Any], request: dict[str, Any]) -> Reply:
    out = d.chat_to_responses_response(body, request=request)
    return out, d.responses_sse(out) if up.stream else None


def _anthropic_reply(
    up: d.UpstreamRequest, body: dict[str, Any], _request: dict[str, Any]
) -> Reply:
    out = d.chat_to_anthropic_message(body)
    return out, d.anthropic_sse(out) if up.stream else None


HANDLERS: dict[d.Dialect, DialectHandler] = {
    d.Dialect.CHAT: DialectHandler(d.Dialect.CHAT, d.build_chat_upstream, _chat_reply),
    d.Dialect.COMPLETIONS: DialectHandler(
        d.Dialect.COMPLETIONS, d.build_completions_upstream, _completions_reply, chat_answer=False
    ),
    d.Dialect.RESPONSES: DialectHandler(
        d.Dialect.RESPONSES,
        d.build_responses_upstream,
        _responses_reply,
        items_key="input",
        failed_stream_on_200=True,
    ),
    d.Dialect.ANTHROPIC: DialectHandler(
        d.Dialect.ANTHROPIC,
        d.build_anthropic_upstream,
        _anthropic_reply,
        echoed_output=_anthropic_echo,
        error_body=_anthropic_error,
    ),
}
# The generating routes a harness may call, by path.
GENERATING: dict[str, DialectHandler] = {
    "/v1/chat/completions": HANDLERS[d.Dialect.CHAT],
    "/v1/completions": HANDLERS[d.Dialect.COMPLETIONS],
    "/v1/responses": HANDLERS[d.Dialect.RESPONSES],
    "/v1/messages": HANDLERS[d.Dialect.ANTHROPIC],
}
