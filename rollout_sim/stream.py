"""Sampled choices and how they travel: chunking, delta text, SSE framing, JSON bodies."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from starlette.responses import Response, StreamingResponse

from rollout_sim.faults import Fault, SimulatedDisconnect
from rollout_sim.parsers import ParsedOutput

if TYPE_CHECKING:
    from rollout_sim.engine import Tokenizer


@dataclass(frozen=True)
class Step:
    """Log-probs of one sampled position: the sampled token first, then the top-k."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # vLLM's dict order: sampled token, then top-k


@dataclass
class Sample:
    """One sampled choice, as the response builders and the stream plans read it."""

    index: int
    ids: list[int]
    steps: list[Step]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    parsed: ParsedOutput | None = None
    tool_ids: list[str] = field(default_factory=list)
    inline_ids: list[int] | None = None  # differs from ids under a "mismatch" fault


@dataclass(frozen=True)
class Chunk:
    """One SSE chunk of one choice."""

    lo: int  # tokens [lo, hi)
    hi: int
    a: int  # text [a, b) those tokens reveal
    b: int
    last: bool


class StreamPlan:
    """How one choice's tokens split into chunks, and which text each chunk reveals."""

    def __init__(self, tokenizer: Tokenizer, sample: Sample, interval: int) -> None:
        self.sample = sample
        n, ends = len(sample.ids), text_offsets(tokenizer, sample.ids, len(sample.text))
        starts = range(0, max(n, 1), interval)
        self.chunks = [
            Chunk(lo, min(lo + interval, n), ends[lo], ends[min(lo + interval, n)], False)
            for lo in starts
        ]
        # The last chunk reveals everything, even text a stop string or bad UTF-8 held back.
        self.chunks[-1] = replace(self.chunks[-1], b=len(sample.text), last=True)
        calls = sample.parsed.tool_calls if sample.parsed else ()
        self._named = [False] * len(calls)
        self._sent = [0] * len(calls)

    def delta(self, c: Chunk) -> dict[str, Any]:
        """The delta for text [a, b): content, reasoning, and the tool-call pieces in it."""
        parsed, text = self.sample.parsed, self.sample.text
        assert parsed is not None
        delta: dict[str, Any] = {}
        if content := "".join(text[max(c.a, lo) : min(c.b, hi)] for lo, hi in parsed.content_spans):
            delta["content"] = content
        if parsed.reasoning_span is not None:
            lo, hi = parsed.reasoning_span
            if piece := text[max(c.a, lo) : min(c.b, hi)]:
                delta["reasoning"] = piece
        calls = [entry for i in range(len(parsed.tool_calls)) if (entry := self._call_delta(i, c))]
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _call_delta(self, i: int, c: Chunk) -> dict[str, Any]:
        """vLLM's order: the name once (with id and type), then argument fragments."""
        assert self.sample.parsed is not None
        call = self.sample.parsed.tool_calls[i]
        entry: dict[str, Any] = {}
        if not self._named[i] and (call.name_at <= c.b or c.last):
            self._named[i] = True
            entry = {
                "id": self.sample.tool_ids[i],
                "type": "function",
                "index": i,
                "function": {"name": call.name},
            }
        if not self._named[i]:
            return entry
        if c.last or (call.args_span is None and call.end_at <= c.b):
            upto = len(call.arguments)
        elif call.args_span is not None:
            upto = max(0, min(c.b, call.args_span[1]) - call.args_span[0])
        else:
            upto = 0
        if upto > self._sent[i]:
            entry.setdefault("index", i)
            entry.setdefault("function", {})["arguments"] = call.arguments[self._sent[i] : upto]
            self._sent[i] = upto
        return entry


def interleave(
    tokenizer: Tokenizer, samples: list[Sample], interval: int
) -> Iterator[tuple[StreamPlan, Chunk]]:
    """Chunks of all choices, one engine step at a time (as n>1 streams arrive)."""
    plans = [StreamPlan(tokenizer, s, interval) for s in samples]
    for step in range(max(len(p.chunks) for p in plans)):
        for plan in plans:
            if step < len(plan.chunks):
                yield plan, plan.chunks[step]


def text_offsets(tokenizer: Tokenizer, ids: Sequence[int], limit: int) -> list[int]:
    """Text length revealed after each token prefix (held back inside a UTF-8 character).

    Decodes from the last complete character only, so a long stream stays linear.
    """
    ends, committed, start = [0], 0, 0
    for k in range(1, len(ids) + 1):
        piece = tokenizer.decode(ids[start:k], skip_special_tokens=True)
        whole = piece.rstrip("\ufffd")
        if whole == piece:  # ends on a character boundary: later decodes start here
            committed, start = committed + len(piece), k
            ends.append(min(committed, limit))
        else:
            ends.append(min(committed + len(whole), limit))
    return ends


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status_code=status, media_type="application/json")


def sse(events: list[dict[str, Any]], fault: Fault | None) -> Response:
    """`data: <json>` events and `data: [DONE]`; a stream fault cuts in after a few events."""

    async def body() -> AsyncIterator[bytes]:
        for sent, event in enumerate(events):
            if fault is not None and sent >= fault.after_chunks:
                if fault.kind == "drop":
                    raise SimulatedDisconnect("simulated connection drop (fault injection)")
                if fault.kind == "stream_error":
                    yield b"data: " + dumps({"error": _STREAM_ERROR}) + b"\n\n"
                    break
            yield b"data: " + dumps(event) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


_STREAM_ERROR = {
    "message": "Simulated engine failure mid-stream (fault injection).",
    "type": "InternalServerError",
    "param": None,
    "code": 500,
}
