"""Server-sent events synthesised from a COMPLETE answer (wire-formats §1.3, §1.5, §4.1).

The proxy never streams from the upstream: it obtains the whole response, records it, and
only then replays it to a streaming harness in that harness's dialect.  Each function here
takes the finished, token-stripped answer object (what the harness would get without
streaming) and yields the exact event grammar of its dialect, as bytes:

- chat: ``data: <chunk>`` frames: role chunk, reasoning, content, tool-call name then
  arguments per call, finish chunk, the optional usage chunk (``choices: []``), ``[DONE]``;
- completions: text chunk, finish chunk, optional usage chunk, ``[DONE]``;
- Responses: ``event: <type>`` + ``data`` with the same ``type`` and an increasing
  ``sequence_number``: created, in_progress, per output item added / part added / deltas /
  done..., then completed (or incomplete / failed); no ``[DONE]``;
- Anthropic: message_start, ping, content_block_start/delta/stop per block (text_delta,
  thinking_delta + signature_delta, input_json_delta), message_delta, message_stop.

Events are built field by field from the answer, so no token array can leak into them.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from itertools import count
from typing import Any

from api.dialects.common import (
    JSONDict,
    dumps_compact,
    list_or_empty,
    mapping_or_empty,
    single_choice,
)

__all__ = [
    "SSE_DONE",
    "SSE_MEDIA_TYPE",
    "aiter_sse",
    "anthropic_sse",
    "chat_completion_sse",
    "completion_sse",
    "responses_failed_sse",
    "responses_sse",
    "sse_data",
    "sse_event",
]

SSE_MEDIA_TYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"


def sse_data(payload: Mapping[str, Any]) -> bytes:
    """One unnamed event (chat and completions grammar)."""
    return f"data: {dumps_compact(payload)}\n\n".encode()


def sse_event(event: str, payload: Mapping[str, Any]) -> bytes:
    """One named event (Responses and Anthropic grammar)."""
    return f"event: {event}\ndata: {dumps_compact(payload)}\n\n".encode()


async def aiter_sse(frames: Iterable[bytes]) -> AsyncIterator[bytes]:
    """The frames as an async iterator (for a streaming HTTP response)."""
    for frame in frames:
        yield frame


# --------------------------------------------------------------------------- chat


def chat_completion_sse(
    completion: Mapping[str, Any], *, include_usage: bool = False
) -> Iterator[bytes]:
    """Chat-completions chunks for a finished chat completion."""
    choice = single_choice(completion)
    message = mapping_or_empty(choice.get("message"))
    header = _chunk_header(completion, "chat.completion.chunk")

    def chunk(delta: JSONDict, finish_reason: Any = None, logprobs: Any = None) -> bytes:
        entry = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse_data({**header, "choices": [entry]})

    yield chunk({"role": "assistant", "content": ""})
    for field in ("reasoning", "reasoning_content"):
        if isinstance(message.get(field), str) and message[field]:
            yield chunk({field: message[field]})
    if isinstance(message.get("content"), str) and message["content"]:
        yield chunk({"content": message["content"]})
    for index, call in enumerate(map(mapping_or_empty, list_or_empty(message.get("tool_calls")))):
        yield from _tool_call_chunks(chunk, index, call)
    yield chunk({}, choice.get("finish_reason"), choice.get("logprobs"))
    if include_usage:
        yield sse_data({**header, "choices": [], "usage": completion.get("usage")})
    yield SSE_DONE


def _tool_call_chunks(
    chunk: Callable[[JSONDict], bytes], index: int, call: Mapping[str, Any]
) -> Iterator[bytes]:
    function = mapping_or_empty(call.get("function"))
    opening = {
        "index": index,
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function.get("name"), "arguments": ""},
    }
    yield chunk({"tool_calls": [opening]})
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        yield chunk({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})


def completion_sse(
    completion: Mapping[str, Any], *, include_usage: bool = False
) -> Iterator[bytes]:
    """Completions chunks for a finished text completion."""
    choice = single_choice(completion)
    header = _chunk_header(completion, "text_completion")

    def chunk(text: str, finish_reason: Any = None, logprobs: Any = None) -> bytes:
        entry = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse_data({**header, "choices": [entry]})

    text = choice.get("text")
    if isinstance(text, str) and text:
        yield chunk(text)
    yield chunk("", choice.get("finish_reason"), choice.get("logprobs"))
    if include_usage:
        yield sse_data({**header, "choices": [], "usage": completion.get("usage")})
    yield SSE_DONE


def _chunk_header(completion: Mapping[str, Any], kind: str) -> JSONDict:
    header: JSONDict = {
        "id": completion.get("id"),
        "object": kind,
        "created": completion.get("created") or 0,
        "model": completion.get("model"),
    }
    if completion.get("system_fingerprint") is not None:
        header["system_fingerprint"] = completion["system_fingerprint"]
    return header


# --------------------------------------------------------------------------- Responses


class _ResponsesEvents:
    """Named events with the ``type`` repeated in ``data`` and an increasing sequence."""

    def __init__(self) -> None:
        self._sequence = count()

    def __call__(self, kind: str, **fields: Any) -> bytes:
        return sse_event(kind, {"type": kind, "sequence_number": next(self._sequence), **fields})


def responses_sse(response: Mapping[str, Any]) -> Iterator[bytes]:
    """Responses events for a finished ``response`` object (completed or incomplete)."""
    emit = _ResponsesEvents()
    opening = _in_progress(response)
    yield emit("response.created", response=opening)
    yield emit("response.in_progress", response=opening)
    for index, item in enumerate(response.get("output") or ()):
        yield from _item_events(emit, index, mapping_or_empty(item))
    final = {"incomplete": "response.incomplete", "failed": "response.failed"}
    yield emit(final.get(str(response.get("status")), "response.completed"), response=response)


def responses_failed_sse(
    response: Mapping[str, Any], *, code: str, message: str
) -> Iterator[bytes]:
    """A stream that fails (HTTP 200, terminal ``response.failed``), as Codex expects for a
    backend failure.  ``response`` supplies the identity (id, model, created_at, echoed
    request fields); ``code`` is e.g. ``context_length_exceeded`` or ``server_error``."""
    emit = _ResponsesEvents()
    yield emit("response.created", response=_in_progress(response))
    failed = {
        **response,
        "status": "failed",
        "output": [],
        "usage": None,
        "error": {"code": code, "message": message},
    }
    yield emit("response.failed", response=failed)


def _in_progress(response: Mapping[str, Any]) -> JSONDict:
    opening = copy.deepcopy(dict(response))
    opening.update(status="in_progress", output=[], usage=None, incomplete_details=None, error=None)
    return opening


def _item_events(emit: _ResponsesEvents, index: int, item: Mapping[str, Any]) -> Iterator[bytes]:
    kind = item.get("type")
    if kind == "message":
        yield from _message_events(emit, index, item)
    elif kind == "reasoning":
        yield from _reasoning_events(emit, index, item)
    elif kind == "function_call":
        yield from _argument_events(emit, index, item, "function_call_arguments", "arguments")
    elif kind == "custom_tool_call":
        yield from _argument_events(emit, index, item, "custom_tool_call_input", "input")
    else:
        yield emit("response.output_item.added", output_index=index, item=item)
        yield emit("response.output_item.done", output_index=index, item=item)


def _message_events(emit: _ResponsesEvents, index: int, item: Mapping[str, Any]) -> Iterator[bytes]:
    added = {**item, "status": "in_progress", "content": []}
    yield emit("response.output_item.added", output_index=index, item=added)
    for part_index, part in enumerate(map(mapping_or_empty, item.get("content") or ())):
        text = str(part.get("text") or "")
        where = {"item_id": item.get("id"), "output_index": index, "content_index": part_index}
        empty = {**part, "text": ""} if part.get("type") == "output_text" else part
        yield emit("response.content_part.added", **where, part=empty)
        if part.get("type") == "output_text":
            if text:
                yield emit("response.output_text.delta", **where, delta=text, logprobs=[])
            yield emit("response.output_text.done", **where, text=text, logprobs=[])
        yield emit("response.content_part.done", **where, part=part)
    yield emit("response.output_item.done", output_index=index, item=item)


def _reasoning_events(
    emit: _ResponsesEvents, index: int, item: Mapping[str, Any]
) -> Iterator[bytes]:
    yield emit("response.output_item.added", output_index=index, item={**item, "content": []})
    for part_index, part in enumerate(map(mapping_or_empty, item.get("content") or ())):
        text = str(part.get("text") or "")
        where = {"item_id": item.get("id"), "output_index": index, "content_index": part_index}
        yield emit("response.content_part.added", **where, part={**part, "text": ""})
        if text:
            yield emit("response.reasoning_text.delta", **where, delta=text)
        yield emit("response.reasoning_text.done", **where, text=text)
        yield emit("response.content_part.done", **where, part=part)
    yield emit("response.output_item.done", output_index=index, item=item)


def _argument_events(
    emit: _ResponsesEvents, index: int, item: Mapping[str, Any], event: str, field: str
) -> Iterator[bytes]:
    """Tool-call items: added (empty arguments), one delta, done with the full value."""
    value = str(item.get(field) or "")
    added = {**item, field: ""}
    if "status" in item:
        added["status"] = "in_progress"
    yield emit("response.output_item.added", output_index=index, item=added)
    where = {"item_id": item.get("id"), "output_index": index}
    if value:
        yield emit(f"response.{event}.delta", **where, delta=value)
    done: JSONDict = {**where, field: value}
    if field == "arguments":
        done["name"] = item.get("name")
    yield emit(f"response.{event}.done", **done)
    yield emit("response.output_item.done", output_index=index, item=item)


# --------------------------------------------------------------------------- Anthropic


def anthropic_sse(message: Mapping[str, Any]) -> Iterator[bytes]:
    """Anthropic Messages events for a finished ``message``."""
    usage = mapping_or_empty(message.get("usage"))
    opening: JSONDict = {
        **{key: message.get(key) for key in ("id", "type", "role", "model")},
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 0},
    }
    yield sse_event("message_start", {"type": "message_start", "message": opening})
    yield sse_event("ping", {"type": "ping"})
    for index, block in enumerate(map(mapping_or_empty, message.get("content") or ())):
        yield from _block_events(index, block)
    delta = {
        "stop_reason": message.get("stop_reason"),
        "stop_sequence": message.get("stop_sequence"),
    }
    final_usage = {
        "input_tokens": usage.get("input_tokens"),
        "output_tokens": usage.get("output_tokens", 0),
    }
    yield sse_event(
        "message_delta", {"type": "message_delta", "delta": delta, "usage": final_usage}
    )
    yield sse_event("message_stop", {"type": "message_stop"})


def _block_events(index: int, block: Mapping[str, Any]) -> Iterator[bytes]:
    kind = block.get("type")
    if kind == "text":
        start: JSONDict = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": block.get("text")}] if block.get("text") else []
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": block.get("thinking")}]
        if block.get("signature"):
            deltas.append({"type": "signature_delta", "signature": block.get("signature")})
    elif kind == "tool_use":
        start = {"type": "tool_use", "id": block.get("id"), "name": block.get("name"), "input": {}}
        partial = dumps_compact(block.get("input") or {})
        deltas = [{"type": "input_json_delta", "partial_json": partial}]
    else:
        start, deltas = dict(block), []
    yield sse_event(
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": start},
    )
    for delta in deltas:
        yield sse_event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )
    yield sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
