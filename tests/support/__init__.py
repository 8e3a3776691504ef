"""Helpers shared by tests: strict SSE parsing and reassembly of vLLM streams."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def parse_sse(text: str, *, done: bool = True) -> list[dict[str, Any]]:
    """The JSON events of a vLLM SSE body, checking the grammar strictly.

    Every event is exactly one `data: <json>` line followed by a blank line, with no
    `event:` names; with `done`, the body ends with `data: [DONE]` and nothing after it.
    """
    assert text.endswith("\n\n") or not done, (
        f"stream does not end with a blank line: {text[-80:]!r}"
    )
    blocks = text.split("\n\n")
    tail = blocks.pop()
    assert tail == "" or not done, f"bytes after the last event: {tail!r}"
    events: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        assert block.startswith("data: ") and "\n" not in block, f"not one data line: {block!r}"
        payload = block[len("data: ") :]
        if payload == "[DONE]":
            assert i == len(blocks) - 1, "[DONE] is not the last event"
            return events
        event = json.loads(payload)
        assert isinstance(event, dict)
        events.append(event)
    assert not done, "stream has no data: [DONE]"
    return events


@dataclass
class StreamedChoice:
    """One choice rebuilt from its stream deltas."""

    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    text: str = ""  # content (chat) or text (completions)
    reasoning: str = ""
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    stop_reason: Any = None
    chunks: int = 0


def reassemble(events: list[dict[str, Any]]) -> tuple[dict[int, StreamedChoice], Any]:
    """Concatenate chat or completions deltas per choice index; returns (choices, usage).

    Checks the rules a capture proxy relies on: `prompt_token_ids` arrives once per
    choice and first, the usage chunk (if any) has `choices: []` and comes last.
    """
    choices: dict[int, StreamedChoice] = {}
    usage = None
    for event in events:
        assert usage is None, "an event after the usage chunk"
        if not event["choices"]:
            usage = event["usage"]
            continue
        (choice,) = event["choices"]
        out = choices.setdefault(choice["index"], StreamedChoice())
        prompt_ids = event.get("prompt_token_ids", choice.get("prompt_token_ids"))
        if prompt_ids is not None:
            assert out.prompt_token_ids is None and out.chunks == 0, "prompt ids twice or late"
            out.prompt_token_ids = prompt_ids
        out.chunks += 1
        assert out.finish_reason is None, "a chunk after the finish chunk"
        out.token_ids += choice.get("token_ids") or []
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            out.logprobs += logprobs.get("content", [logprobs])  # chat, or one legacy block
        delta = choice.get("delta")
        if delta is None:  # completions
            out.text += choice["text"]
        else:
            out.text += delta.get("content") or ""
            out.reasoning += delta.get("reasoning") or ""
            for call in delta.get("tool_calls", []):
                slot = out.tool_calls.setdefault(call["index"], {"arguments": ""})
                for key in ("id", "type"):
                    if key in call:
                        assert key not in slot, f"tool call {key} sent twice"
                        slot[key] = call[key]
                fn = call.get("function", {})
                if "name" in fn:
                    assert "name" not in slot, "tool name sent twice"
                    slot["name"] = fn["name"]
                slot["arguments"] += fn.get("arguments", "")
        out.finish_reason = choice.get("finish_reason")
        out.stop_reason = choice.get("stop_reason")
    return choices, usage
