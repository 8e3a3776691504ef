"""Fingerprints of the model-authored turns of a conversation, the same in every dialect.

A captured call stores ``continuation_fingerprint`` = the fingerprint of its request's
model-authored turns followed by its own output.  A later request of the same rollout whose
model-authored turns fingerprint to that value continues the call *by conversation*; when
its tokens nevertheless do not extend the call's tokens, the chat template re-rendered the
history (template drift), and that is what the lineage edge records.

What counts as model-authored, in order of appearance:

- messages with ``role: "assistant"`` (chat ``messages``, Anthropic ``messages``, Responses
  ``input`` message items): each text part contributes its text (plain-string content, or
  ``text``/``input_text``/``output_text``/untyped parts); empty or whitespace-only text
  contributes nothing; tool calls (chat ``tool_calls``, Anthropic ``tool_use`` blocks)
  contribute ``(id, name, canonical arguments)``; reasoning (``thinking``,
  ``redacted_thinking``, ``reasoning_content`` fields) contributes nothing; any other part
  contributes its canonical JSON;
- Responses ``function_call`` items: ``(call_id, name, canonical arguments)``, a
  ``namespace`` folded into the name as ``<namespace>__<name>`` (how the proxy flattens
  namespaced tools for chat backends);
- Responses ``custom_tool_call`` items: ``(call_id, name, canonical {"input": input})``, the
  arguments the proxy's chat bridge gives a freeform tool;
- nothing else (user, system and tool-result turns, Responses ``reasoning`` items).

The stream of contributions is flat: message boundaries do not count, so one chat assistant
message equals the same turn echoed back as several Responses items or Anthropic blocks.

Canonical arguments: JSON text is parsed and re-dumped with sorted keys and compact
separators; an object is dumped the same way; text that does not parse is only stripped;
``None`` and blank text count as ``{}`` (the empty object a tool call without arguments is
translated to in Anthropic ``input``).

Encoding: SHA-256 over a versioned domain string, then for every contribution a one-byte tag
and each field as an 8-byte big-endian length followed by its UTF-8 bytes.  The result is 64
lowercase hex characters, or ``""`` when there is no model-authored turn.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = [
    "CUSTOM_TOOL_INPUT_KEY",
    "FINGERPRINT_VERSION",
    "NAMESPACE_SEPARATOR",
    "canonical_arguments",
    "continuation_fingerprint",
    "model_authored_contributions",
    "model_authored_fingerprint",
]

FINGERPRINT_VERSION = 1
NAMESPACE_SEPARATOR = "__"
CUSTOM_TOOL_INPUT_KEY = "input"

_DOMAIN = b"rollout-ledger/model-authored-fingerprint"
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
_SILENT_PART_TYPES = frozenset(
    {"thinking", "redacted_thinking", "reasoning", "reasoning_text", "summary_text", "tool_result"}
)

# A contribution: a one-letter tag and its string fields.
Contribution = tuple[str, ...]
_TEXT = "T"
_CALL = "C"
_OTHER = "J"


def model_authored_fingerprint(items: Sequence[Mapping[str, Any]]) -> str:
    """The fingerprint of the model-authored turns among ``items`` ("" when there are none).

    ``items`` may be chat messages, Responses input/output items or Anthropic messages, in
    any mix.  Raises ``TypeError`` for an item that is not a JSON object.
    """
    return _digest(model_authored_contributions(items))


def continuation_fingerprint(
    request_items: Sequence[Mapping[str, Any]], output_items: Sequence[Mapping[str, Any]]
) -> str:
    """The fingerprint a request continuing this call will have: the request's model-authored
    turns followed by this call's output items."""
    contributions = model_authored_contributions(request_items)
    contributions.extend(model_authored_contributions(output_items))
    return _digest(contributions)


def model_authored_contributions(items: Sequence[Mapping[str, Any]]) -> list[Contribution]:
    """What the fingerprint hashes, in order (exposed for diagnosis and tests)."""
    contributions: list[Contribution] = []
    for item in items:
        if not isinstance(item, Mapping):
            raise TypeError(f"conversation items must be JSON objects, got {type(item).__name__}")
        contributions.extend(_item_contributions(item))
    return contributions


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments in one canonical text, whatever form the dialect carried them in."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, str):
        stripped = arguments.strip()
        if not stripped:
            return "{}"
        try:
            arguments = json.loads(stripped)
        except ValueError:
            return stripped
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _item_contributions(item: Mapping[str, Any]) -> Iterator[Contribution]:
    kind = item.get("type")
    if kind == "function_call":
        yield _call(item.get("call_id"), _flat_name(item), item.get("arguments"))
    elif kind == "custom_tool_call":
        tool_input = item.get("input")
        arguments = {CUSTOM_TOOL_INPUT_KEY: tool_input if isinstance(tool_input, str) else ""}
        yield _call(item.get("call_id"), _flat_name(item), arguments)
    elif item.get("role") == "assistant" and kind in (None, "message"):
        yield from _assistant_contributions(item)


def _assistant_contributions(message: Mapping[str, Any]) -> Iterator[Contribution]:
    content = message.get("content")
    if isinstance(content, str):
        yield from _text(content)
    elif isinstance(content, list):
        for part in content:
            yield from _part_contributions(part)
    for tool_call in message.get("tool_calls") or ():
        if not isinstance(tool_call, Mapping):
            raise TypeError("chat tool_calls entries must be JSON objects")
        function = tool_call.get("function")
        function = function if isinstance(function, Mapping) else {}
        yield _call(tool_call.get("id"), function.get("name"), function.get("arguments"))


def _part_contributions(part: Any) -> Iterator[Contribution]:
    if isinstance(part, str):
        yield from _text(part)
        return
    if not isinstance(part, Mapping):
        raise TypeError(f"content parts must be strings or objects, got {type(part).__name__}")
    kind = part.get("type")
    if kind in _TEXT_PART_TYPES or (kind is None and "text" in part):
        yield from _text(part.get("text"))
    elif kind == "tool_use":
        yield _call(part.get("id"), part.get("name"), part.get("input"))
    elif kind not in _SILENT_PART_TYPES:
        yield (_OTHER, json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False))


def _text(text: Any) -> Iterator[Contribution]:
    if isinstance(text, str) and text.strip():
        yield (_TEXT, text)


def _call(call_id: Any, name: Any, arguments: Any) -> Contribution:
    return (_CALL, _str(call_id), _str(name), canonical_arguments(arguments))


def _flat_name(item: Mapping[str, Any]) -> str:
    name = _str(item.get("name"))
    namespace = item.get("namespace")
    return (
        f"{namespace}{NAMESPACE_SEPARATOR}{name}"
        if isinstance(namespace, str) and namespace
        else name
    )


def _str(value: Any) -> str:
    return value if isinstance(value, str) else "" if value is None else str(value)


def _digest(contributions: Sequence[Contribution]) -> str:
    if not contributions:
        return ""
    hasher = hashlib.sha256(_DOMAIN)
    hasher.update(FINGERPRINT_VERSION.to_bytes(1, "big"))
    for tag, *fields in contributions:
        hasher.update(tag.encode("ascii"))
        for field in fields:
            data = field.encode("utf-8")
            hasher.update(len(data).to_bytes(8, "big"))
            hasher.update(data)
    return hasher.hexdigest()
