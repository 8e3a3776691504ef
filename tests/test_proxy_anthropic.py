"""Issue #6 points 3 and 9 for the Anthropic Messages dialect, driven by the real `anthropic`
SDK over real HTTP: a multi-turn tool-use loop (JSON and SSE, the beta client's
`?beta=true` included), thinking, images, count_tokens, and the rebuilt chain compared with
what the engine sampled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import pytest

from rollout_sim import Reply
from tests.proxy_support import Stack, delivered, sampled_chain
from tests.support.stacks import shared_stack_as_stack  # noqa: F401  (the fixture `stack`)

Rid = Callable[[str], str]

PNG_B64 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAA"
    "DUlEQVR42mP8/5+hHgAHggJ/PchI7wAAAABJRU5ErkJggg=="
)
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
BASH = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}
SYSTEM = [
    {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}
]
TOKEN_FIELDS = ("prompt_token_ids", "token_ids", "generation_token_ids", "logprobs", "token_id:")


def client_for(stack: Stack, rollout_id: str) -> anthropic.Anthropic:
    # Claude Code's ANTHROPIC_BASE_URL: the origin plus the rollout prefix, without /v1.
    return anthropic.Anthropic(base_url=stack.base(rollout_id), api_key="sk-test", max_retries=0)


def assert_no_token_arrays(value: Any) -> None:
    text = json.dumps(value)
    for field in TOKEN_FIELDS:
        assert field not in text, field


def assert_exact_chain(stack: Stack, rollout_id: str, response_id: str, n_calls: int) -> None:
    result: dict[str, Any] = {"_ng_rollout_id": rollout_id, "response": {"id": response_id}}
    result["response"]["output"] = []
    build = stack.finalize(result)
    assert build["outcome"] == "delivered", build["mask_reasons"]
    assert len(stack.sampled) == n_calls
    assert delivered(result) == sampled_chain(stack, list(range(n_calls)))


def send(
    stack: Stack,
    rollout_id: str,
    messages: list[dict[str, Any]],
    *,
    stream: bool,
    turn: int,
    **extra: Any,
) -> Any:
    """One Messages call as Claude Code makes it; checks the record is committed first."""
    client = client_for(stack, rollout_id)
    kwargs: dict[str, Any] = {
        "model": "smol",
        "max_tokens": 1024,
        "system": SYSTEM,
        "messages": messages,
        "tools": [BASH],
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "u-1"},
        **extra,
    }
    if not stream:
        message = client.messages.create(**kwargs)
        assert stack.captured(rollout_id) == turn
    else:
        # The beta client, as Claude Code uses it: POST /v1/messages?beta=true.
        kinds: list[str] = []
        with client.beta.messages.stream(**kwargs, betas=["interleaved-thinking-2025-05-14"]) as s:
            for event in s:
                if not kinds:  # recorded before the first byte of the stream
                    assert stack.captured(rollout_id) == turn
                kinds.append(event.type)
                assert_no_token_arrays(event.model_dump())
            message = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert_no_token_arrays(message.model_dump())
    return message


def echo(message: Any) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": [b.model_dump(exclude_none=True) for b in message.content],
    }


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_tool_use_loop_rebuilds_exactly(stack: Stack, rid: Rid, stream: bool) -> None:
    r = rid("claude")
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "List files, then show a.txt"}]}
    ]
    commands = ["ls", "cat a.txt"]
    for turn, command in enumerate(commands, start=1):
        stack.engine.script_tool_call(
            "Bash", {"command": command}, content="Running it." if turn == 1 else ""
        )
        message = send(stack, r, messages, stream=stream, turn=turn)
        assert message.stop_reason == "tool_use"
        use = [b for b in message.content if b.type == "tool_use"]
        assert [(u.name, u.input) for u in use] == [("Bash", {"command": command})]
        if turn == 1:
            assert message.content[0].type == "text" and message.content[0].text == "Running it."
        messages.append(echo(message))
        result = "a.txt\nb.txt" if turn == 1 else [{"type": "text", "text": "hello"}]
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use[0].id, "content": result},
                    {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
                ],
            }
        )
    stack.engine.script("a.txt says hello.")
    final = send(stack, r, messages, stream=stream, turn=3)
    assert final.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in final.content] == [("text", "a.txt says hello.")]
    assert final.usage.input_tokens == len(stack.sampled[-1]["prompt_token_ids"])

    sent = stack.engine.bodies("/v1/chat/completions")[-1]
    assert sent["messages"][0] == {"role": "system", "content": "You are a coding agent."}
    assert sent["tools"][0]["function"]["name"] == "Bash"
    assert sent["tools"][0]["function"]["parameters"] == BASH["input_schema"]
    assert sent["tool_choice"] == "auto"
    roles = [m["role"] for m in sent["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "user", "assistant", "tool", "user"]
    assert sent["messages"][3]["content"] == "a.txt\nb.txt"
    if stream:
        assert {req.query for req in stack.engine.requests} == {""}  # not forwarded upstream
    assert_exact_chain(stack, r, final.id, 3)


@pytest.fixture
def thinking_stack(shared_thinking_stack: Stack) -> Stack:
    return shared_thinking_stack


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_thinking_round_trips(thinking_stack: Stack, rid: Rid, stream: bool) -> None:
    stack, r = thinking_stack, rid("think")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Run ls."}]
    stack.engine.script(
        Reply(
            "Listing.",
            reasoning="The user wants ls.",
            tool_calls=(),
        )
    )
    thinking = {"type": "enabled", "budget_tokens": 2000}
    first = send(stack, r, messages, stream=stream, turn=1, thinking=thinking)
    assert [b.type for b in first.content] == ["thinking", "text"]
    assert first.content[0].thinking == "The user wants ls."
    messages += [echo(first), {"role": "user", "content": "Go on."}]
    stack.engine.script(Reply("Done.", reasoning="Nothing left."))
    second = send(stack, r, messages, stream=stream, turn=2, thinking=thinking)
    sent = stack.engine.bodies("/v1/chat/completions")[-1]["messages"]
    assert sent[2] == {
        "role": "assistant",
        "content": "Listing.",
        "reasoning_content": "The user wants ls.",
    }
    assert "thinking" not in stack.engine.bodies("/v1/chat/completions")[-1]
    assert_exact_chain(stack, r, second.id, 2)


def test_images_reach_the_upstream(stack: Stack, rid: Rid) -> None:
    r = rid("img")
    stack.engine.script_tool_call("Bash", {"command": "screenshot"})
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [IMAGE, {"type": "text", "text": "What is this?"}]}
    ]
    first = send(stack, r, messages, stream=False, turn=1)
    sent = stack.engine.bodies("/v1/chat/completions")[-1]["messages"][1]["content"]
    data_url = f"data:image/png;base64,{PNG_B64}"
    assert sent[0] == {"type": "image_url", "image_url": {"url": data_url}}
    assert sent[1] == {"type": "text", "text": "What is this?"}
    messages.append(echo(first))
    messages.append(
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": first.content[-1].id,
                    "content": [{"type": "text", "text": "captured"}, IMAGE],
                    "is_error": False,
                }
            ],
        }
    )
    stack.engine.script("A pixel.")
    second = send(stack, r, messages, stream=True, turn=2)
    sent_messages = stack.engine.bodies("/v1/chat/completions")[-1]["messages"]
    assert sent_messages[-2] == {
        "role": "tool",
        "tool_call_id": first.content[-1].id,
        "content": "captured",
    }
    assert sent_messages[-1] == {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": data_url}}],
    }
    assert second.content[0].text == "A pixel."
    assert stack.reasons(r) == []


def test_count_tokens_is_answered_by_the_proxy(stack: Stack, rid: Rid) -> None:
    r = rid("count")
    client = client_for(stack, r)
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    counted = client.messages.count_tokens(
        model="smol",
        system=SYSTEM,  # type: ignore[arg-type]
        messages=messages,  # type: ignore[arg-type]
        tools=[BASH],  # type: ignore[list-item]
    )
    beta = client.beta.messages.count_tokens(
        model="smol",
        system=SYSTEM,  # type: ignore[arg-type]
        messages=messages,  # type: ignore[arg-type]
        tools=[BASH],  # type: ignore[list-item]
    )
    assert counted.input_tokens == beta.input_tokens > 0
    assert stack.engine.requests[-1].path == "/tokenize"
    assert stack.detail(r) is None  # nothing recorded, nothing marked
    stack.engine.script("Six.")
    message = send(stack, r, messages, stream=False, turn=1)
    assert message.usage.input_tokens == counted.input_tokens  # the same rendered prompt
