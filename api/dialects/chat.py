"""Upstream request building: the body the proxy sends to the inference server.

The proxy always calls the upstream without streaming and with every field vLLM (>= 0.10.2)
needs to return token ids and log-probs (wire-formats §1.1, §4.5).  What the harness asked
for that changes the *answer* (streaming, usage chunk, its own log-probs) is remembered in
:class:`UpstreamRequest` so the answer can be rebuilt in the harness's dialect.

``sampling_overrides`` (config, never the request) are applied last, as a dict update, so
pinned values win over whatever the harness sent and are present when it sent nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from api.dialects.common import Dialect, InvalidRequest, JSONDict, UnsupportedRequest
from api.dialects.refusals import refuse_dropped_meaning

__all__ = [
    "CHAT_CAPTURE_FIELDS",
    "CHAT_PATH",
    "COMPLETIONS_CAPTURE_FIELDS",
    "COMPLETIONS_PATH",
    "UpstreamRequest",
    "build_chat_upstream",
    "build_completions_upstream",
    "finish_chat_upstream",
    "translated_chat_upstream",
]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

# Fields that make vLLM return ids and log-probs.  ``include_reasoning: false`` would also
# suppress ``token_ids`` and ``logprobs`` under a reasoning parser, so it is forced true.
CHAT_CAPTURE_FIELDS: Mapping[str, Any] = {
    "logprobs": True,
    "top_logprobs": 0,
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "include_reasoning": True,
}
COMPLETIONS_CAPTURE_FIELDS: Mapping[str, Any] = {
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
}

_STREAM_FIELDS = ("stream", "stream_options")
_MAX_TOP_LOGPROBS = 20  # OpenAI's limit; a harness asking for more gets the sampled token only


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    """What to send upstream, and what the harness asked for that shapes its answer.

    ``keep_logprobs`` is true when the harness itself asked for log-probs: the answer then
    keeps ``choices[0].logprobs`` (its tokens read ``token_id:N``); otherwise they are
    stripped like every other token field.
    """

    body: JSONDict
    path: str
    dialect: Dialect
    stream: bool
    include_usage: bool
    keep_logprobs: bool = False


def build_chat_upstream(
    body: Mapping[str, Any], *, sampling_overrides: Mapping[str, Any] | None = None
) -> UpstreamRequest:
    """The upstream chat-completions request for a harness chat-completions body."""
    if not isinstance(body.get("messages"), list):
        raise InvalidRequest("`messages` must be a list of chat messages", param="messages")
    refuse_dropped_meaning(Dialect.CHAT, body)
    stream, include_usage = _stream_flags(body)
    return finish_chat_upstream(
        body,
        dialect=Dialect.CHAT,
        stream=stream,
        include_usage=include_usage,
        sampling_overrides=sampling_overrides,
    )


def finish_chat_upstream(
    body: Mapping[str, Any],
    *,
    dialect: Dialect,
    stream: bool,
    include_usage: bool = False,
    sampling_overrides: Mapping[str, Any] | None = None,
) -> UpstreamRequest:
    """Add the capture fields to a chat body (native or translated) and pin sampling."""
    _refuse_several_sequences(body)
    upstream = _without_stream_fields(body)
    keep_logprobs = body.get("logprobs") is True
    upstream.update(CHAT_CAPTURE_FIELDS)
    upstream["top_logprobs"] = _top_logprobs(body) if keep_logprobs else 0
    upstream.update(sampling_overrides or {})
    return UpstreamRequest(
        body=upstream,
        path=CHAT_PATH,
        dialect=dialect,
        stream=stream,
        include_usage=include_usage,
        keep_logprobs=keep_logprobs,
    )


def translated_chat_upstream(
    dialect: Dialect,
    to_chat: Callable[[Mapping[str, Any]], JSONDict],
    body: Mapping[str, Any],
    sampling_overrides: Mapping[str, Any] | None,
) -> UpstreamRequest:
    """The upstream chat request (with capture fields) for a dialect the proxy translates to
    chat (Messages, Responses): its refusals first, then ``to_chat``, then the capture fields."""
    refuse_dropped_meaning(dialect, body)
    return finish_chat_upstream(
        to_chat(body),
        dialect=dialect,
        stream=body.get("stream") is True,
        sampling_overrides=sampling_overrides,
    )


def build_completions_upstream(
    body: Mapping[str, Any], *, sampling_overrides: Mapping[str, Any] | None = None
) -> UpstreamRequest:
    """The upstream completions request for a harness completions body.

    ``logprobs`` is an int there (the number of alternatives): the harness's value is kept
    when it sent one, else 0 (the sampled token only).
    """
    if "prompt" not in body:
        raise InvalidRequest("`prompt` is required", param="prompt")
    _refuse_several_sequences(body)
    _refuse_several_prompts(body["prompt"])
    stream, include_usage = _stream_flags(body)
    asked = body.get("logprobs")
    keep_logprobs = _is_int(asked) and asked >= 0
    upstream = _without_stream_fields(body)
    upstream.update(COMPLETIONS_CAPTURE_FIELDS)
    upstream["logprobs"] = asked if keep_logprobs else 0
    upstream.update(sampling_overrides or {})
    return UpstreamRequest(
        body=upstream,
        path=COMPLETIONS_PATH,
        dialect=Dialect.COMPLETIONS,
        stream=stream,
        include_usage=include_usage,
        keep_logprobs=keep_logprobs,
    )


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """Whether the harness streams (only a boolean ``true`` counts) and wants the usage chunk."""
    stream = body.get("stream") is True
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, Mapping) and options.get("include_usage") is True
    return stream, include_usage


def _without_stream_fields(body: Mapping[str, Any]) -> JSONDict:
    upstream = copy.deepcopy(dict(body))
    for field in _STREAM_FIELDS:
        upstream.pop(field, None)
    return upstream


def _refuse_several_sequences(body: Mapping[str, Any]) -> None:
    """Capture records exactly one sampled sequence per call: refuse ``n``/``best_of`` > 1.

    ``best_of`` > 1 with ``n`` = 1 returns one sequence, but picked among several, so its
    log-probs are not what the policy sampled; it is refused for the same reason.
    """
    for field in ("n", "best_of"):
        value = body.get(field)
        if value is None or (_is_int(value) and value == 1):
            continue
        raise UnsupportedRequest(
            f"`{field}` must be 1 (or absent) on a training-capture route, got {value!r}: "
            "capture records exactly one sampled sequence per model call; send separate "
            "requests instead",
            param=field,
        )
    if body.get("use_beam_search") is True:
        raise UnsupportedRequest(
            "`use_beam_search` is not allowed on a training-capture route: beam search "
            "log-probs are not the policy's sampling distribution",
            param="use_beam_search",
        )


def _refuse_several_prompts(prompt: Any) -> None:
    """A completions ``prompt`` may be a batch (a list of strings or of id lists); capture
    needs exactly one prompt.  A flat list of ints is one tokenized prompt."""
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        raise UnsupportedRequest(
            f"`prompt` holds {len(prompt)} prompts; a training-capture route takes exactly one "
            "prompt per call (a string or one list of token ids)",
            param="prompt",
        )


def _top_logprobs(body: Mapping[str, Any]) -> int:
    """The harness's own ``top_logprobs`` when sane (1..20), else 0 (sampled token only)."""
    value = body.get("top_logprobs")
    if _is_int(value) and 0 < value <= _MAX_TOP_LOGPROBS:
        return int(value)
    return 0


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
