"""vLLM's output parsers as the simulator needs them: reasoning and hermes tool calls.

Besides the parsed message, each parse records *where* in the sampled text every part
lies, so a stream can hand out exactly the slices vLLM would (content deltas, a tool
name once, argument fragments) and hide the rest behind empty deltas.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from rollout_sim.chat import THINK_CLOSE, THINK_OPEN, TOOL_CALL_OPEN

ToolMode = Literal["none", "auto", "required", "named"]
Span = tuple[int, int]

# vLLM's hermes parser regex: complete blocks, or one unterminated block at the end.
_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # the JSON string vLLM puts into `function.arguments`
    name_at: int  # text offset by which the name has been sampled
    args_span: Span | None  # where `arguments` occurs verbatim in the text, if it does
    end_at: int  # text offset by which the whole call has been sampled


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    reasoning: str | None
    tool_calls: tuple[ParsedToolCall, ...]
    content_spans: tuple[Span, ...]
    reasoning_span: Span | None
    tools_called: bool  # finish_reason becomes "tool_calls"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _split_reasoning(text: str) -> tuple[Span | None, int]:
    """(reasoning span, offset where the answer starts), qwen3 style: no `</think>`, no split."""
    end = text.find(THINK_CLOSE)
    if end < 0:
        return None, 0
    start = text.find(THINK_OPEN)
    start = start + len(THINK_OPEN) if 0 <= start < end else 0
    return (start, end), end + len(THINK_CLOSE)


def _locate(text: str, needle: str, start: int, end: int) -> Span | None:
    pos = text.find(needle, start, end)
    return None if pos < 0 else (pos, pos + len(needle))


def _hermes_calls(text: str, body: int) -> tuple[ParsedToolCall, ...] | None:
    calls = []
    for match in _HERMES_RE.finditer(text, body):
        group = 1 if match.group(1) is not None else 2
        raw = match.group(group)
        try:
            obj = json.loads(raw.strip())
            name, arguments = str(obj["name"]), _dumps(obj["arguments"])
        except (ValueError, KeyError, TypeError):
            return None  # vLLM logs the failure and falls back to plain content
        name_span = _locate(text, _dumps(name), match.start(group), match.end(group))
        calls.append(
            ParsedToolCall(
                name=name,
                arguments=arguments,
                name_at=name_span[1] if name_span else match.end(),
                args_span=_locate(text, arguments, match.start(group), match.end(group)),
                end_at=match.end(),
            )
        )
    return tuple(calls)


def _required_calls(text: str, body: int) -> tuple[ParsedToolCall, ...] | None:
    try:
        items = json.loads(text[body:])
        pairs = [(str(item["name"]), _dumps(item["parameters"])) for item in items]
    except (ValueError, KeyError, TypeError):
        return None
    calls, pos = [], body
    for name, arguments in pairs:
        name_span = _locate(text, _dumps(name), pos, len(text))
        args_span = _locate(text, arguments, name_span[1] if name_span else pos, len(text))
        end = args_span[1] if args_span else len(text)
        name_at = name_span[1] if name_span else end
        calls.append(ParsedToolCall(name, arguments, name_at, args_span, end))
        pos = end
    return tuple(calls)


def parse_output(
    text: str, *, reasoning_parser: bool, tool_mode: ToolMode, named_tool: str | None = None
) -> ParsedOutput:
    """Split sampled text into the chat message vLLM 0.32 would return."""
    reasoning_span, body = _split_reasoning(text) if reasoning_parser else (None, 0)
    reasoning = text[reasoning_span[0] : reasoning_span[1]] if reasoning_span else None
    end = len(text)

    if tool_mode == "named" and named_tool is not None:
        # Structured decoding produced the arguments object itself.
        call = ParsedToolCall(named_tool, text[body:], body, (body, end), end)
        return ParsedOutput("", reasoning, (call,), (), reasoning_span, False)
    if tool_mode == "required":
        calls = _required_calls(text, body)
        if calls:
            return ParsedOutput("", reasoning, calls, (), reasoning_span, True)
    if tool_mode == "auto":
        start = text.find(TOOL_CALL_OPEN, body)
        calls = _hermes_calls(text, body) if start >= 0 else None
        if calls:
            content = text[body:start] or None
            return ParsedOutput(content, reasoning, calls, ((body, start),), reasoning_span, True)

    answer: str | None = text[body:]
    if reasoning_span is not None:  # the reasoning parser reports an empty answer as null
        answer = answer or None
    return ParsedOutput(answer, reasoning, (), ((body, end),), reasoning_span, False)
