"""Issue 11 point 2: dialects never drop meaning.

A field that changes what the model sees but that the proxy cannot honour is refused with a
400 in the harness's own dialect.  The Anthropic SDK's ``tool_runner`` (message threads) then
re-sends the full history by itself, and the rollout is delivered with every prompt holding
the whole conversation.  Real SDKs against the simulated vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic import beta_tool

from tests.proxy_support import Stack, delivered, sampled_chain

Rid = Callable[[str], str]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


def chat_bodies(stack: Stack) -> list[dict[str, Any]]:
    return [b for b in stack.engine.bodies("/v1/chat/completions") if b.get("return_token_ids")]


def refused(stack: Stack) -> float:
    """Anthropic requests the proxy refused with a 400 so far (its own counter)."""
    name = 'rollout_ledger_proxy_calls_total{dialect="anthropic",outcome="bad_request"} '
    for line in httpx.get(stack.url + "/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    return 0.0


@beta_tool
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city
    """
    return f"18C in {city}"


def test_tool_runner_falls_back_to_full_history_and_is_delivered(stack: Stack, rid: Rid) -> None:
    r = rid("runner")
    refused_before = refused(stack)
    client = anthropic.Anthropic(base_url=stack.base(r), api_key="sk", max_retries=0)
    stack.engine.script_tool_call("get_weather", {"city": "Paris"})
    stack.engine.script("It is 18C in Paris.")
    runner = client.beta.messages.tool_runner(
        model="smol",
        max_tokens=256,
        system="You report the weather.",
        tools=[get_weather],
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    messages = list(runner)
    assert [m.stop_reason for m in messages] == ["tool_use", "end_turn"]
    assert refused(stack) == refused_before + 1  # its threaded first request

    # The first request (thread: create) was refused before anything went upstream; every
    # request that reached the engine carries the whole conversation.
    bodies = chat_bodies(stack)
    assert len(bodies) == 2
    roles = [[m["role"] for m in b["messages"]] for b in bodies]
    assert roles == [["system", "user"], ["system", "user", "assistant", "tool"]]
    assert all("thread" not in b for b in bodies)
    result: dict[str, Any] = {"_ng_rollout_id": r, "response": {"id": messages[-1].id}}
    result["response"]["output"] = []
    build = stack.finalize(result)
    assert build["outcome"] == "delivered", build["mask_reasons"]
    assert delivered(result) == sampled_chain(stack, [0, 1])


def test_thread_continue_is_a_400_in_the_anthropic_envelope(stack: Stack, rid: Rid) -> None:
    r = rid("thread")
    resp = httpx.post(
        stack.base(r) + "/v1/messages",
        json={
            "model": "smol",
            "max_tokens": 16,
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}
            ],
            "thread": {"type": "continue", "previous_message_id": "msg_1"},
        },
    )
    assert resp.status_code == 400
    error = resp.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["details"] == {
        "error_code": "thread_unsupported_request",
        "unsupported": ["thread"],
    }
    assert "`thread` is not supported" in error["error"]["message"]
    assert chat_bodies(stack) == []  # nothing went upstream
    assert stack.detail(r) is None  # nothing recorded


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("compaction", {"type": "compact_20260112"}),
        ("context_management", {"edits": [{"type": "clear_tool_uses_20250919"}]}),
        ("mcp_servers", [{"type": "url", "url": "https://mcp.example", "name": "x"}]),
    ],
)
def test_anthropic_server_side_features_are_refused(
    stack: Stack, rid: Rid, field: str, value: Any
) -> None:
    client = anthropic.Anthropic(base_url=stack.base(rid("srv")), api_key="sk", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model="smol",
            max_tokens=16,
            messages=HI,  # type: ignore[arg-type]
            extra_body={field: value},
        )
    assert err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert f"`{field}`" in err.value.message
    assert chat_bodies(stack) == []


def test_anthropic_structured_output_reaches_the_engine(stack: Stack, rid: Rid) -> None:
    client = anthropic.Anthropic(base_url=stack.base(rid("fmt")), api_key="sk", max_retries=0)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    stack.engine.script('{"a": 1}')
    client.messages.create(
        model="smol",
        max_tokens=32,
        messages=HI,  # type: ignore[arg-type]
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    [body] = chat_bodies(stack)
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
        ("function_call", "auto"),
        ("web_search_options", {"search_context_size": "low"}),
        ("modalities", ["text", "audio"]),
    ],
)
def test_chat_fields_vllm_would_ignore_are_refused(
    stack: Stack, rid: Rid, field: str, value: Any
) -> None:
    client = openai.OpenAI(base_url=stack.base(rid("chat")) + "/v1", api_key="sk", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smol", messages=HI, extra_body={field: value})  # type: ignore[arg-type]
    assert err.value.code is None or isinstance(err.value.code, str)
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == field
    assert chat_bodies(stack) == []


@pytest.mark.parametrize(
    "tool_choice",
    [
        {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "f"}]},
        {"type": "web_search_preview"},
        {"type": "function", "name": "not_declared"},
    ],
)
def test_responses_tool_choice_that_cannot_be_honoured_is_refused(
    stack: Stack, rid: Rid, tool_choice: dict[str, Any]
) -> None:
    client = openai.OpenAI(base_url=stack.base(rid("resp")) + "/v1", api_key="sk", max_retries=0)
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="smol", input="hi", tools=[tool], tool_choice=tool_choice)  # type: ignore[arg-type]
    assert "tool_choice" in err.value.message
    assert chat_bodies(stack) == []


def test_responses_previous_response_id_is_still_refused(stack: Stack, rid: Rid) -> None:
    client = openai.OpenAI(base_url=stack.base(rid("prev")) + "/v1", api_key="sk", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="smol", input="hi", previous_response_id="resp_1")
    assert "previous_response_id" in err.value.message
