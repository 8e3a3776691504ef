"""SSE synthesis: the exact grammars, proven by the real SDKs' stream parsers.

Each stream is served through an ``httpx2.MockTransport`` to the OpenAI / Anthropic Python
SDKs, which parse it with their own SSE decoders and accumulate the final object with their
own stream state machines (the same code paths agent harnesses use).  Every event is also
validated against the SDKs' event types, and the framing is checked byte by byte.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import httpx2
import pytest
from anthropic import Anthropic
from anthropic.types import Message, RawMessageStreamEvent
from openai import OpenAI
from openai.types.chat import ChatCompletionChunk
from openai.types.completion import Completion
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from api.dialects import (
    aiter_sse,
    anthropic_sse,
    chat_completion_sse,
    chat_to_anthropic_message,
    chat_to_responses_response,
    completion_sse,
    responses_failed_sse,
    responses_sse,
)
from api.extract import strip_chat_response, strip_completion_response
from tests.support.vllm import vllm_chat_answer

RESPONSES_EVENT = TypeAdapter(ResponseStreamEvent)
ANTHROPIC_EVENT = TypeAdapter(RawMessageStreamEvent)
TOKEN_MARKERS = ("token_ids", "prompt_token_ids", "token_id:", "generation_log_probs")
PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28]


# A vLLM 0.32 chat completion (wire-formats §1.2) on this module's prompt.
vllm_chat = functools.partial(vllm_chat_answer, prompt_ids=PROMPT_IDS, log_probs=-1.5)


def vllm_text_completion() -> dict[str, Any]:
    """The §1.4 completions answer."""
    return {
        "id": "cmpl-82fd",
        "object": "text_completion",
        "created": 1795940059,
        "model": "smol",
        "choices": [
            {
                "index": 0,
                "text": "Hello.",
                "logprobs": {
                    "text_offset": [0, 14, 25],
                    "token_logprobs": [-2.19, -1.53, -0.35],
                    "tokens": ["token_id:19556", "token_id:30", "token_id:2"],
                    "top_logprobs": [
                        {"token_id:19556": -2.19},
                        {"token_id:30": -1.53},
                        {"token_id:2": -0.35},
                    ],
                },
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": [19556, 30, 2],
                "prompt_logprobs": None,
                "prompt_token_ids": [1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198],
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
    }


TOOL_CALLS = [
    {
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },
    {
        "id": "chatcmpl-tool-2",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"tz": "CET"}'},
    },
]


def harness_chat(completion: dict[str, Any]) -> dict[str, Any]:
    return strip_chat_response(completion).harness_body


def frames_of(raw: bytes) -> list[tuple[str | None, str]]:
    """Strict framing: every frame is optional ``event:`` + exactly one ``data:`` line."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n")
    frames: list[tuple[str | None, str]] = []
    for frame in text[:-2].split("\n\n"):
        lines = frame.split("\n")
        event = lines.pop(0).removeprefix("event: ") if lines[0].startswith("event: ") else None
        assert len(lines) == 1 and lines[0].startswith("data: "), frame
        frames.append((event, lines[0].removeprefix("data: ")))
    return frames


def transport(raw: bytes) -> httpx2.Client:
    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=raw)

    return httpx2.Client(transport=httpx2.MockTransport(answer))


def openai_client(raw: bytes) -> OpenAI:
    return OpenAI(
        api_key="test", base_url="http://proxy.test/v1", http_client=transport(raw), max_retries=0
    )


def anthropic_client(raw: bytes) -> Anthropic:
    return Anthropic(
        api_key="test", base_url="http://proxy.test", http_client=transport(raw), max_retries=0
    )


def assert_no_tokens(raw: bytes) -> None:
    for marker in TOKEN_MARKERS:
        assert marker.encode() not in raw


# --------------------------------------------------------------------------- chat


def test_chat_stream_with_reasoning_text_tool_calls_and_usage_accumulates_in_the_sdk() -> None:
    completion = harness_chat(
        vllm_chat(
            "Checking both.",
            [40, 5, 6, 7, 2],
            finish_reason="tool_calls",
            tool_calls=TOOL_CALLS,
            reasoning="Two lookups.",
        )
    )
    raw = b"".join(chat_completion_sse(completion, include_usage=True))

    frames = frames_of(raw)
    assert all(event is None for event, _ in frames)  # no event names in the chat grammar
    assert frames[-1] == (None, "[DONE]")
    chunks = [ChatCompletionChunk.model_validate(json.loads(data)) for _, data in frames[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert {chunk.id for chunk in chunks} == {"chatcmpl-a3314b09b486737c"}
    assert_no_tokens(raw)

    with openai_client(raw).chat.completions.stream(model="smol", messages=[]) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Checking both."
    assert message.tool_calls is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("chatcmpl-tool-1", "get_weather", '{"city": "Paris"}'),
        ("chatcmpl-tool-2", "get_time", '{"tz": "CET"}'),
    ]
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.usage is not None and final.usage.prompt_tokens == len(PROMPT_IDS)
    assert (message.model_extra or {}).get("reasoning") == "Two lookups."


def test_chat_stream_without_usage_has_no_usage_chunk_and_iterates_with_create() -> None:
    raw = b"".join(chat_completion_sse(harness_chat(vllm_chat("Hi there", [5, 6]))))
    chunks = list(
        openai_client(raw).chat.completions.create(model="smol", messages=[], stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hi there"
    assert all(chunk.choices for chunk in chunks)
    assert all(chunk.usage is None for chunk in chunks)


def test_chat_stream_keeps_logprobs_only_when_the_answer_has_them() -> None:
    upstream = vllm_chat("Hi", [5, 6])
    kept = strip_chat_response(upstream, keep_logprobs=True).harness_body
    raw = b"".join(chat_completion_sse(kept))
    with openai_client(raw).chat.completions.stream(model="smol", messages=[]) as stream:
        final = stream.get_final_completion()
    logprobs = final.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [entry.logprob for entry in logprobs.content] == [-1.5, -1.5]
    assert b"token_ids" not in raw


def test_completions_stream() -> None:
    answer = strip_completion_response(vllm_text_completion()).harness_body
    raw = b"".join(completion_sse(answer, include_usage=True))
    frames = frames_of(raw)
    assert frames[-1] == (None, "[DONE]")
    payloads = [json.loads(data) for _, data in frames[:-1]]
    # The SDK's Completion type has no null finish_reason (the legacy API streams one), so
    # only the finish and usage chunks are validated strictly; the SDK parses them all below.
    assert [p["choices"][0]["finish_reason"] for p in payloads[:-1]] == [None, "stop"]
    for payload in payloads[1:]:
        Completion.model_validate(payload)
    chunks = list(openai_client(raw).completions.create(model="smol", prompt="x", stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 13
    assert_no_tokens(raw)


# --------------------------------------------------------------------------- Responses

RESPONSES_REQUEST = {
    "model": "gpt-5-codex",
    "instructions": "You are Codex.",
    "input": "weather?",
    "tools": [
        {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
        {"type": "function", "name": "get_time", "parameters": {"type": "object"}},
        {"type": "custom", "name": "apply_patch", "description": "patch"},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
}


def responses_events(raw: bytes) -> list[dict[str, Any]]:
    """Every frame named, the name equal to the data's ``type``, validated by the SDK."""
    frames = frames_of(raw)
    events = []
    for event, data in frames:
        payload = json.loads(data)
        assert event == payload["type"]
        RESPONSES_EVENT.validate_python(payload)
        events.append(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_responses_stream_event_order_for_a_message_and_a_tool_call() -> None:
    completion = vllm_chat(
        "Looking it up.", [1, 2, 3], finish_reason="tool_calls", tool_calls=TOOL_CALLS[:1]
    )
    response = chat_to_responses_response(harness_chat(completion), request=RESPONSES_REQUEST)
    raw = b"".join(responses_sse(response))
    events = responses_events(raw)

    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    assert events[-1]["response"] == response
    assert b"[DONE]" not in raw
    assert_no_tokens(raw)


def test_responses_stream_accumulates_in_the_sdk_to_the_same_response() -> None:
    completion = vllm_chat(
        "Both.",
        [1, 2, 3, 4],
        finish_reason="tool_calls",
        reasoning="Look up weather and time.",
        tool_calls=[
            *TOOL_CALLS,
            {
                "id": "chatcmpl-tool-3",
                "type": "function",
                "function": {"name": "apply_patch", "arguments": '{"input": "*** Begin Patch"}'},
            },
        ],
    )
    response = chat_to_responses_response(harness_chat(completion), request=RESPONSES_REQUEST)
    raw = b"".join(responses_sse(response))
    responses_events(raw)

    seen: list[str] = []
    text_deltas: list[str] = []
    with openai_client(raw).responses.stream(model="gpt-5-codex", input="weather?") as stream:
        for event in stream:
            seen.append(event.type)
            if event.type == "response.output_text.delta":
                text_deltas.append(event.delta)
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in seen
    assert "response.custom_tool_call_input.delta" in seen
    assert "".join(text_deltas) == "Both."
    expected = Response.model_validate(response)
    assert final.id == expected.id == "chatcmpl-a3314b09b486737c"
    assert [item.type for item in final.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
        "custom_tool_call",
    ]
    assert final.output_text == "Both."
    assert final.output[4].model_dump()["input"] == "*** Begin Patch"
    assert final.usage == expected.usage


def test_responses_stream_ends_incomplete_when_the_answer_was_cut() -> None:
    completion = vllm_chat("Awesome! I'm", [49, 103], finish_reason="length")
    response = chat_to_responses_response(harness_chat(completion), request={})
    events = responses_events(b"".join(responses_sse(response)))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert "response.completed" not in [e["type"] for e in events]


def test_responses_failed_stream_for_a_streaming_codex() -> None:
    base = chat_to_responses_response(harness_chat(vllm_chat("", [2])), request=RESPONSES_REQUEST)
    raw = b"".join(responses_failed_sse(base, code="server_error", message="upstream down"))
    events = responses_events(raw)
    assert [e["type"] for e in events] == ["response.created", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "upstream down"}
    sdk_events = list(openai_client(raw).responses.create(model="m", input="x", stream=True))
    assert sdk_events[-1].type == "response.failed"

    overflow = b"".join(
        responses_failed_sse(base, code="context_length_exceeded", message="too long")
    )
    _, data = frames_of(overflow)[-1]
    assert json.loads(data)["response"]["error"]["code"] == "context_length_exceeded"


# --------------------------------------------------------------------------- Anthropic


def anthropic_events(raw: bytes) -> list[dict[str, Any]]:
    frames = frames_of(raw)
    events = []
    for event, data in frames:
        payload = json.loads(data)
        assert event == payload["type"]
        if payload["type"] != "ping":
            ANTHROPIC_EVENT.validate_python(payload)
        events.append(payload)
    return events


def test_anthropic_stream_grammar_and_sdk_accumulation() -> None:
    completion = vllm_chat(
        "Checking the weather.",
        [40, 5, 6, 2],
        finish_reason="tool_calls",
        tool_calls=TOOL_CALLS[:1],
        reasoning="User wants weather.",
    )
    message = chat_to_anthropic_message(harness_chat(completion))
    raw = b"".join(anthropic_sse(message))
    events = anthropic_events(raw)

    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None),
        ("ping", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta",
        "text_delta",
        "input_json_delta",
    ]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == len(PROMPT_IDS)
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 4
    assert b"[DONE]" not in raw
    assert_no_tokens(raw)

    with anthropic_client(raw).messages.stream(
        model="claude-sonnet-4-6", max_tokens=100, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        final = stream.get_final_message()
    assert final.model_dump() == Message.model_validate(message).model_dump()
    assert final.content[2].type == "tool_use"
    assert final.content[2].input == {"city": "Paris"}


def test_anthropic_thinking_signature_is_streamed_when_present() -> None:
    message = chat_to_anthropic_message(harness_chat(vllm_chat("ok", [1], reasoning="hmm")))
    message["content"][0]["signature"] = "EqQBsig"
    events = anthropic_events(b"".join(anthropic_sse(message)))
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert deltas[:2] == [
        {"type": "thinking_delta", "thinking": "hmm"},
        {"type": "signature_delta", "signature": "EqQBsig"},
    ]
    raw = b"".join(anthropic_sse(message))
    with anthropic_client(raw).messages.stream(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking"
    assert final.content[0].signature == "EqQBsig"


def test_anthropic_empty_answer_streams_one_empty_text_block() -> None:
    message = chat_to_anthropic_message(harness_chat(vllm_chat("", [2])))
    events = anthropic_events(b"".join(anthropic_sse(message)))
    assert [e["type"] for e in events if e["type"].startswith("content_block")] == [
        "content_block_start",
        "content_block_stop",
    ]
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


@pytest.mark.asyncio
async def test_aiter_sse_yields_the_same_frames() -> None:
    frames = list(chat_completion_sse(harness_chat(vllm_chat("Hi", [5]))))
    assert [frame async for frame in aiter_sse(frames)] == frames
