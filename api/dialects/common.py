"""Shared vocabulary of the translation layer: dialects, request errors, small JSON helpers.

Everything under ``api.dialects`` is pure: dicts in, dicts (or bytes) out, no I/O.  The
exception tree is::

    ledger.errors.RequestRefused (a LedgerError and a ValueError)
    └── DialectError                   a harness request the proxy cannot send upstream: 400
        ├── InvalidRequest             the body is malformed for its dialect
        └── UnsupportedRequest         well-formed, but capture cannot serve it (n != 1, ...)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from ledger.errors import RequestRefused

__all__ = [
    "Dialect",
    "DialectError",
    "InvalidRequest",
    "JSONDict",
    "UnsupportedRequest",
    "content_value",
    "dumps_compact",
    "list_or_empty",
    "mapping_or_empty",
    "parse_tool_input",
    "reasoning_text",
    "single_choice",
    "token_count",
]

JSONDict = dict[str, Any]


class Dialect(StrEnum):
    """The API a harness spoke; answers (bodies, SSE, errors) go back in the same one."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"
    ANTHROPIC = "anthropic"


class DialectError(RequestRefused):
    """A harness request that cannot be sent upstream; the message says what to change.

    ``param`` names the offending request field when there is one (OpenAI error envelopes
    carry it); ``details`` is what an Anthropic envelope carries as ``error.details`` (the
    Anthropic SDK reads ``error_code`` there to recover by itself).
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.details = dict(details) if details else None


class InvalidRequest(DialectError):
    """The body does not have the shape its dialect requires."""


class UnsupportedRequest(DialectError):
    """The body is valid, but training-token capture cannot serve it as asked."""


def dumps_compact(value: Any) -> str:
    """JSON text without spaces, non-ASCII kept as is (what the SSE frames carry)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def content_value(parts: list[JSONDict]) -> str | list[JSONDict]:
    """Chat message content for some parts: a lone text part becomes a plain string, which
    every chat template accepts; anything else stays a list of parts."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def mapping_or_empty(value: Any) -> Mapping[str, Any]:
    """``value`` if it is a JSON object, else an empty one (for optional sub-objects)."""
    if type(value) is dict:  # what JSON parses to: skip the ABC check
        return value
    return value if isinstance(value, Mapping) else {}


def list_or_empty(value: Any) -> list[Any]:
    """``value`` if it is a JSON array, else an empty one (for optional lists)."""
    return value if isinstance(value, list) else []


def token_count(value: Any) -> int:
    """A usage count as an int: a non-negative integer (or integral float) as is, anything
    else (null, a string, infinity, NaN) as 0; usage numbers are informational here."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(value, 0)
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return 0


# --- readers of a chat completion (shared by the response translators and SSE) ---


def single_choice(completion: Mapping[str, Any]) -> Mapping[str, Any]:
    """The one choice of a completion (capture always asks for n = 1)."""
    choices = completion.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], Mapping):
        raise ValueError("expected a completion with exactly one choice")
    return choices[0]


def reasoning_text(message: Mapping[str, Any]) -> str:
    """The reasoning a parser split off (``reasoning``, or the pre-0.16 ``reasoning_content``)."""
    for field in ("reasoning", "reasoning_content"):
        value = message.get(field)
        if isinstance(value, str) and value:
            return value
    return ""


def parse_tool_input(arguments: Any) -> JSONDict:
    """A chat tool call's JSON-string arguments as the object Anthropic ``input`` must be.

    Arguments that are not a JSON object (unparsable text, cut by ``max_tokens``) become
    ``{}``: the tool's own validation then reports the problem to the model.
    """
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, str) and arguments.strip():
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}
