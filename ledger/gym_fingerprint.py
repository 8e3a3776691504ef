"""NeMo Gym 0.7.0's request-time lineage hashes (fingerprint version 2), written from its spec.

Two hashes over conversation items (chat messages, Responses input/output items, Anthropic
messages, in any mix):

- ``assistant_fingerprint(items)``: the lookup key.  Only model-authored items count (role
  ``assistant``, or a Responses ``function_call`` item; reasoning items do not).  Per item, in
  order: each typed content part, then each tool call as (id, name, canonical arguments).
  ``""`` when no item is model-authored.  An assistant item with nothing in it still counts as
  an item, but adds no bytes.
- ``conversation_digest(items)``: verifies the context a parent was recorded with.  Every item
  counts: its role (or type), its content parts, its tool calls and its tool results (Responses
  ``function_call_output``, chat ``role: tool``, Anthropic ``tool_result`` blocks).

Content parts: a string is one ``text`` part (empty text adds nothing); a list holds strings
(``text``) and blocks; ``tool_use``/``tool_result`` blocks are left to the tool hashes; a block
with a string ``text`` and type ``""``/``text``/``input_text``/``output_text`` is a ``text``
part; any other typed block is (type, canonical JSON of the whole block); an untyped block
without text, a non-object block or non-list content is an error (``ValueError``).

Canonical tool arguments: ``None`` is ``""``; a string is parsed as JSON and re-dumped with
sorted keys, or only stripped when it does not parse; any other value is dumped with sorted
keys.  A Responses ``function_call`` with a ``namespace`` hashes the name ``<namespace>__<name>``.

Layout: SHA-256 over a domain string, then per field a one-byte tag, the UTF-8 length as 8 bytes
big-endian, and the UTF-8 bytes.  Tags: fingerprint ``0`` part type, ``1`` part text, ``2`` call
id, ``3`` tool name, ``4`` arguments; context digest ``0`` role, ``1``/``2`` part, ``3``/``4``/``5``
tool call, ``6`` result call id, ``7`` result payload.

This is hash-for-hash the release's algorithm (the Gym docs tell external resolvers to agree with
it exactly); ``tests/test_gym_release.py`` compares both on generated conversations.  The
ledger's own model-authored fingerprint (``ledger.fingerprint``, version 1, used by the proxy to
diagnose template drift) is a different hash with a different job.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import orjson

__all__ = [
    "FINGERPRINT_VERSION",
    "assistant_fingerprint",
    "canonicalize_tool_arguments",
    "conversation_digest",
]

FINGERPRINT_VERSION = 2

_LOOKUP_DOMAIN = b"nemo-gym-lineage"
_CONTEXT_DOMAIN = b"nemo-gym-lineage-context"
_TEXT_TYPES = frozenset({"", "text", "input_text", "output_text"})
_TOOL_BLOCKS = frozenset({"tool_use", "tool_result"})


def assistant_fingerprint(items: Sequence[Any]) -> str:
    """The lookup key of a request: its model-authored items, in order ("" if none)."""
    hasher = hashlib.sha256(_LOOKUP_DOMAIN)
    authored = 0
    for item in _objects(items):
        if not _model_authored(item):
            continue
        authored += 1
        _parts_and_calls(hasher, item, tag=0)
    return hasher.hexdigest() if authored else ""


def conversation_digest(items: Sequence[Any]) -> str:
    """The digest of every item of a conversation (the recorded request context)."""
    hasher = hashlib.sha256(_CONTEXT_DOMAIN)
    for item in _objects(items):
        _field(hasher, 0, str(item.get("role") or item.get("type") or ""))
        _parts_and_calls(hasher, item, tag=1)
        for call_id, payload in _tool_results(item):
            _field(hasher, 6, call_id)
            _field(hasher, 7, payload)
    return hasher.hexdigest()


def _parts_and_calls(hasher: Any, item: Mapping[str, Any], *, tag: int) -> None:
    """Hash an item's content parts (tags ``tag``, ``tag + 1``: type, text) and then its tool
    calls (``tag + 2`` .. ``tag + 4``: id, name, arguments); both hashes share this layout,
    the context digest one tag higher (after its role)."""
    for kind, payload in _parts(item.get("content")):
        _field(hasher, tag, kind)
        _field(hasher, tag + 1, payload)
    for call_id, name, arguments in _tool_calls(item):
        _field(hasher, tag + 2, call_id)
        _field(hasher, tag + 3, name)
        _field(hasher, tag + 4, arguments)


def canonicalize_tool_arguments(value: Any) -> str:
    """Tool-call arguments in one comparable text, however the dialect carried them."""
    if value is None:
        return ""
    if isinstance(value, str):
        try:
            parsed: Any = json.loads(value)
        except (TypeError, ValueError):
            return value.strip()
        return _json(parsed)
    return _json(value)


def _objects(items: Sequence[Any]) -> Iterator[Mapping[str, Any]]:
    for item in items or ():
        if not isinstance(item, dict):
            raise ValueError(f"request item is not an object: {type(item).__name__}")
        yield item


def _model_authored(item: Mapping[str, Any]) -> bool:
    return item.get("role") == "assistant" or item.get("type") == "function_call"


def _parts(content: Any) -> list[tuple[str, str]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [("text", content)] if content else []
    if not isinstance(content, list):
        raise ValueError(f"unsupported message content: {type(content).__name__}")
    parts: list[tuple[str, str]] = []
    for block in content:
        if isinstance(block, str):
            if block:
                parts.append(("text", block))
            continue
        if not isinstance(block, dict):
            raise ValueError(f"unsupported content block: {type(block).__name__}")
        kind = str(block.get("type") or "")
        if kind in _TOOL_BLOCKS:
            continue
        text = block.get("text")
        if isinstance(text, str) and kind in _TEXT_TYPES:
            if text:
                parts.append(("text", text))
            continue
        if not kind:
            raise ValueError("content block has no supported type")
        parts.append((kind, _json(block)))
    return parts


def _tool_calls(item: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    calls: list[tuple[str, str, str]] = []
    if item.get("type") == "function_call":
        name = str(item.get("name", ""))
        if item.get("namespace"):
            name = f"{item['namespace']}__{name}"
        call_id = str(item.get("call_id") or item.get("id") or "")
        calls.append((call_id, name, canonicalize_tool_arguments(item.get("arguments"))))
    content = item.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                calls.append(
                    (
                        str(block.get("id") or ""),
                        str(block.get("name", "")),
                        canonicalize_tool_arguments(block.get("input")),
                    )
                )
    for call in item.get("tool_calls") or ():
        call = call or {}
        function = call.get("function") or {}
        calls.append(
            (
                str(call.get("id") or ""),
                str(function.get("name", "")),
                canonicalize_tool_arguments(function.get("arguments")),
            )
        )
    return calls


def _tool_results(item: Mapping[str, Any]) -> list[tuple[str, str]]:
    results: list[tuple[str, str]] = []
    if item.get("type") == "function_call_output":
        output = item.get("output")
        call_id = str(item.get("call_id") or item.get("id") or "")
        results.append((call_id, output if isinstance(output, str) else _json(output)))
    elif item.get("role") == "tool":
        content = item.get("content")
        call_id = str(item.get("tool_call_id") or "")
        results.append((call_id, content if isinstance(content, str) else _json(content)))
    content = item.get("content")
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                inner = block.get("content")
                call_id = str(block.get("tool_use_id") or block.get("id") or "")
                results.append((call_id, inner if isinstance(inner, str) else _json(inner)))
    return results


def _json(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode("utf-8")
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise ValueError(f"unsupported prompt content: {type(value).__name__}") from exc


def _field(hasher: Any, tag: int, value: str) -> None:
    data = value.encode("utf-8")
    hasher.update(bytes((tag,)))
    hasher.update(len(data).to_bytes(8, "big"))
    hasher.update(data)
