"""The capture proxy's pure translation layer: request building, dialect translation, SSE
synthesis and error mapping.  No I/O happens here; the proxy routes call these functions.

Flow for one captured call::

    upstream = build_<dialect>_upstream(body, sampling_overrides=...)   # UpstreamRequest
    answer = POST upstream.path, upstream.body                          # (the proxy's I/O)
    stripped = api.extract.strip_chat_response(answer, keep_logprobs=upstream.keep_logprobs)
    tokens = api.extract.extract_chat_tokens(answer)                    # may raise
    body = chat_to_anthropic_message(stripped.harness_body)             # or Responses / as is
    frames = anthropic_sse(body) if upstream.stream else None
"""

from api.dialects.anthropic import (
    anthropic_count_tokens_response,
    anthropic_count_tokens_tokenize_body,
    anthropic_to_chat_request,
    build_anthropic_upstream,
    chat_to_anthropic_message,
)
from api.dialects.chat import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    UpstreamRequest,
    build_chat_upstream,
    build_completions_upstream,
)
from api.dialects.common import Dialect, DialectError, InvalidRequest, UnsupportedRequest
from api.dialects.errors import (
    ContextOverflow,
    ErrorReply,
    UpstreamError,
    classify_context_overflow,
    parse_upstream_error,
    request_error_reply,
    transport_error_reply,
    upstream_error_reply,
)
from api.dialects.responses import (
    build_responses_upstream,
    chat_to_responses_response,
    responses_to_chat_request,
)
from api.dialects.sse import (
    SSE_MEDIA_TYPE,
    aiter_sse,
    anthropic_sse,
    chat_completion_sse,
    completion_sse,
    responses_failed_sse,
    responses_sse,
)

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "SSE_MEDIA_TYPE",
    "ContextOverflow",
    "Dialect",
    "DialectError",
    "ErrorReply",
    "InvalidRequest",
    "UnsupportedRequest",
    "UpstreamError",
    "UpstreamRequest",
    "aiter_sse",
    "anthropic_count_tokens_response",
    "anthropic_count_tokens_tokenize_body",
    "anthropic_sse",
    "anthropic_to_chat_request",
    "build_anthropic_upstream",
    "build_chat_upstream",
    "build_completions_upstream",
    "build_responses_upstream",
    "chat_completion_sse",
    "chat_to_anthropic_message",
    "chat_to_responses_response",
    "classify_context_overflow",
    "completion_sse",
    "parse_upstream_error",
    "request_error_reply",
    "responses_failed_sse",
    "responses_sse",
    "responses_to_chat_request",
    "transport_error_reply",
    "upstream_error_reply",
]
