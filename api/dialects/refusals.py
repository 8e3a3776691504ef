"""Request fields that would change what the model sees but cannot be honoured (issue 11).

The proxy translates Messages and Responses requests to chat completions and passes chat and
completions requests through to an engine (vLLM) that ignores fields it does not know.  A
field whose effect is lost that way would silently change what the model sees (a dropped
conversation state, tools that are never declared, a summary that is never asked for), and
the ledger would deliver a rollout whose prompts are not what the harness meant.  Such
fields are refused with a 400 in the harness's own dialect, like ``previous_response_id``;
the harness (or its SDK) then sends the whole request itself.  The full table of fields and
their handling is in ``docs/dialects.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.dialects.common import Dialect, UnsupportedRequest, mapping_or_empty

__all__ = ["ANTHROPIC_THREAD_DETAILS", "refuse_dropped_meaning"]

# What the Anthropic SDK's thread state reads to continue without a thread (it then re-sends
# the full history): ``error.details.error_code`` with the ``unsupported`` features.
ANTHROPIC_THREAD_DETAILS = {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}

_NO_STATE = "the capture proxy keeps no server-side state; send the whole conversation"


def refuse_dropped_meaning(dialect: Dialect, body: Mapping[str, Any]) -> None:
    """Raise :class:`UnsupportedRequest` for a field the proxy cannot honour that changes
    what the model sees."""
    if dialect is Dialect.ANTHROPIC:
        _anthropic(body)
    elif dialect is Dialect.CHAT:
        _chat(body)
    elif dialect is Dialect.RESPONSES:
        _responses(body)


def _set(value: Any) -> bool:
    """Present with an effect: not null, not false, not an empty list or object."""
    return value is not None and value is not False and value != [] and value != {}


def _refuse_if_set(
    value: Any, param: str, message: str, details: Mapping[str, Any] | None = None
) -> None:
    if _set(value):
        raise UnsupportedRequest(message, param=param, details=details)


def _anthropic(body: Mapping[str, Any]) -> None:
    _refuse_if_set(
        body.get("thread"),
        "thread",
        "`thread` is not supported: " + _NO_STATE + " in `messages` without `thread` (the "
        "Anthropic SDK does so by itself on this error)",
        ANTHROPIC_THREAD_DETAILS,
    )
    _refuse_if_set(
        body.get("compaction"),
        "compaction",
        "`compaction` is not supported: the inference server cannot summarise a "
        "conversation server-side; compact the history in the harness",
    )
    _refuse_if_set(
        mapping_or_empty(body.get("context_management")).get("edits"),
        "context_management",
        "`context_management` edits are not supported: the inference server cannot clear "
        "tool results or thinking server-side; edit the history in the harness",
    )
    _refuse_if_set(
        body.get("mcp_servers"),
        "mcp_servers",
        "`mcp_servers` is not supported: the inference server cannot call MCP servers, "
        "so their tools would never reach the model; declare them as client tools",
    )


def _chat(body: Mapping[str, Any]) -> None:
    for name in ("functions", "function_call"):
        _refuse_if_set(
            body.get(name),
            name,
            f"the legacy `{name}` field is not supported (vLLM ignores it, so the model "
            "would never see the functions); send them as `tools` / `tool_choice`",
        )
    _refuse_if_set(
        body.get("web_search_options"),
        "web_search_options",
        "`web_search_options` is not supported: the inference server cannot search the "
        "web, so the model would answer without the results",
    )
    modalities = body.get("modalities")
    if _set(body.get("audio")) or (
        isinstance(modalities, list) and any(m != "text" for m in modalities)
    ):
        raise UnsupportedRequest(
            "audio output (`audio`, `modalities`) is not supported on a training-capture "
            "route: only text generations are captured",
            param="modalities",
        )


def _responses(body: Mapping[str, Any]) -> None:
    _refuse_if_set(
        body.get("context_management"),
        "context_management",
        "`context_management` is not supported: the inference server cannot compact a "
        "conversation server-side; compact the history in the harness",
    )
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping) and choice.get("type") not in (None, "function", "custom"):
        raise UnsupportedRequest(
            f"`tool_choice` of type {choice.get('type')!r} cannot be honoured on a "
            "chat-completions backend (supported: auto, none, required, a function or custom "
            "tool by name)",
            param="tool_choice",
        )
