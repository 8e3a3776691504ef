"""Issue #6 points 3, 4 and 9 for the OpenAI dialects, driven by the real `openai` SDK.

The SDK talks to the proxy over real HTTP (uvicorn on loopback); the proxy talks to the
simulated vLLM over real HTTP.  Every loop ends by rebuilding the rollout and comparing the
delivered chain with what the engine sampled, token for token and log-prob for log-prob.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

import api.proxy.capture as capture_module
from api.proxy.known_prompts import KnownPrompts
from rollout_sim import Reply, SimEngine
from tests.proxy_support import Stack, delivered, sampled_chain, start_stack
from tests.support.smollm2 import load_smollm2_tokenizer
from tests.support.stacks import shared_stack_as_stack  # noqa: F401  (the fixture `stack`)

Rid = Callable[[str], str]

TOKEN_FIELDS = ("prompt_token_ids", "token_ids", "generation_token_ids", "generation_log_probs")
PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAA"
    "AAfFcSJAAAADUlEQVR42mP8/5+hHgAHggJ/PchI7wAAAABJRU5ErkJggg=="
)
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather by city.", "parameters": PARAMS},
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather by city.",
    "parameters": PARAMS,
    "strict": False,
}


def client_for(stack: Stack, rollout_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base(rollout_id) + "/v1", api_key="sk-test", max_retries=0)


def assert_no_token_arrays(value: Any) -> None:
    """No token field anywhere in what the harness got (log-probs only when it asked)."""
    text = json.dumps(value)
    for field in TOKEN_FIELDS:
        assert f'"{field}"' not in text, field
    assert "token_id:" not in text


def assert_exact_chain(stack: Stack, rollout_id: str, response_id: str, n_calls: int) -> None:
    result: dict[str, Any] = {"_ng_rollout_id": rollout_id, "response": {"id": response_id}}
    result["response"]["output"] = []
    build = stack.finalize(result)
    assert build["outcome"] == "delivered", build["mask_reasons"]
    assert len(stack.sampled) == n_calls
    assert delivered(result) == sampled_chain(stack, list(range(n_calls)))


# --------------------------------------------------------------------------- chat


def _echo(message: Any) -> dict[str, Any]:
    """The assistant turn as an agent loop sends it back."""
    echo: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        echo["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in message.tool_calls
        ]
    reasoning = (message.model_extra or {}).get("reasoning")
    if reasoning:
        echo["reasoning"] = reasoning
    return echo


def _chat_turn(
    stack: Stack, rollout_id: str, messages: list[dict[str, Any]], *, stream: bool, turn: int
) -> Any:
    client = client_for(stack, rollout_id)
    if not stream:
        completion = client.chat.completions.create(
            model="smol",
            messages=messages,  # type: ignore[arg-type]
            tools=[CHAT_TOOL],  # type: ignore[list-item]
        )
        assert stack.captured(rollout_id) == turn  # committed before the answer arrived
        assert_no_token_arrays(completion.model_dump())
        return completion
    with client.chat.completions.stream(
        model="smol",
        messages=messages,  # type: ignore[arg-type]
        tools=[CHAT_TOOL],  # type: ignore[list-item]
        stream_options={"include_usage": True},
    ) as events:
        first = True
        for event in events:
            if first:  # the record is committed before the first byte of the stream
                assert stack.captured(rollout_id) == turn
                first = False
            assert_no_token_arrays(event.model_dump())
        completion = events.get_final_completion()
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    return completion


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_tool_loop_rebuilds_exactly(stack: Stack, rid: Rid, stream: bool) -> None:
    r = rid("chat")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
    ]
    plan: list[tuple[str, dict[str, Any]]] = [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_weather", {"city": "Rome"}),
    ]
    for turn, (name, args) in enumerate(plan, start=1):
        stack.engine.script_tool_call(name, args, content="Checking." if turn == 1 else "")
        completion = _chat_turn(stack, r, messages, stream=stream, turn=turn)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == (name, args)
        messages.append(_echo(choice.message))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"{turn * 9}C"})
    stack.engine.script("Paris 9C, Rome 18C.")
    final = _chat_turn(stack, r, messages, stream=stream, turn=3)
    assert final.choices[0].message.content == "Paris 9C, Rome 18C."
    assert final.choices[0].finish_reason == "stop"
    # The proxy sent the harness's tool definitions and results upstream as they were.
    sent = stack.engine.bodies("/v1/chat/completions")[-1]
    assert sent["tools"] == [CHAT_TOOL]
    assert [m["role"] for m in sent["messages"]][-2:] == ["assistant", "tool"]
    assert_exact_chain(stack, r, final.id, 3)


def test_a_continuations_prompt_ids_come_from_the_last_prompt_and_rebuild_exactly(
    stack: Stack, rid: Rid, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the second call of a rollout on, the proxy takes the prompt ids the last call
    already had from its cache (``api.proxy.known_prompts``) and parses only the rest; the
    records still rebuild exactly what the engine sampled."""
    reused: list[int] = []
    parse = KnownPrompts.parse

    def counted(self: KnownPrompts, rollout_id: str, raw: bytes, where: Any, text: bytes) -> Any:
        parsed = parse(self, rollout_id, raw, where, text)
        if parsed is not None and rollout_id == r:
            reused.append(parsed.reused)
        return parsed

    monkeypatch.setattr(KnownPrompts, "parse", counted)
    checked: list[int] = []  # how many leading prompt ids extraction took as checked
    extract = capture_module.extract_chat_tokens

    def recorded(answer: dict[str, Any], *, checked_prompt: int = 0) -> Any:
        checked.append(checked_prompt)
        return extract(answer, checked_prompt=checked_prompt)

    monkeypatch.setattr(capture_module, "extract_chat_tokens", recorded)
    r = rid("known")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    stack.engine.script_tool_call("get_weather", {"city": "Paris"}, content="")
    first = _chat_turn(stack, r, messages, stream=False, turn=1)
    messages.append(_echo(first.choices[0].message))
    messages.append({"role": "tool", "tool_call_id": "x", "content": "9C"})
    stack.engine.script("Sunny.")
    second = _chat_turn(stack, r, messages, stream=False, turn=2)
    messages += [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Rome?"}]
    stack.engine.script("Also sunny.")
    final = _chat_turn(stack, r, messages, stream=False, turn=3)
    assert second.choices[0].message.content == "Sunny."
    prompts = [len(answer["prompt_token_ids"]) for answer in stack.sampled]
    assert reused == prompts[:2]  # calls 2 and 3 each reused the whole last prompt
    assert checked == [0, *reused]  # and only their new ids were checked again
    assert_exact_chain(stack, r, final.id, 3)


def test_chat_logprobs_only_when_the_harness_asks(stack: Stack, rid: Rid) -> None:
    r = rid("lp")
    client = client_for(stack, r)
    stack.engine.script("Two words.")
    asked = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
    )
    content: Any = asked.choices[0].logprobs.content  # type: ignore[union-attr]
    sampled = stack.sampled[-1]["choices"][0]["logprobs"]["content"]
    assert [c.logprob for c in content] == [s["logprob"] for s in sampled]
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert stack.engine.requests[-1].body["top_logprobs"] == 2
    assert "token_ids" not in asked.choices[0].model_dump()
    stack.engine.script("No log-probs.")
    plain = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "x"}]
    )
    assert plain.choices[0].logprobs is None
    assert_no_token_arrays(plain.model_dump())


# --------------------------------------------------------------------------- completions


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_completions_capture_and_answer(stack: Stack, rid: Rid, stream: bool) -> None:
    r = rid("cmpl")
    client = client_for(stack, r)
    stack.engine.script(" there was a proxy.")
    if stream:
        chunks = list(
            client.completions.create(
                model="smol",
                prompt="Once upon a time",
                max_tokens=64,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert stack.captured(r) == 1
        for chunk in chunks:
            assert_no_token_arrays(chunk.model_dump())
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        response_id = chunks[0].id
        assert chunks[-1].usage is not None
    else:
        completion = client.completions.create(
            model="smol", prompt="Once upon a time", max_tokens=64
        )
        assert_no_token_arrays(completion.model_dump())
        text, response_id = completion.choices[0].text, completion.id
    assert text == " there was a proxy."
    sent = stack.engine.bodies("/v1/completions")[-1]
    assert sent["logprobs"] == 0 and sent["return_token_ids"] is True
    assert "stream" not in sent  # the proxy always reads the whole answer upstream
    assert_exact_chain(stack, r, response_id, 1)


# --------------------------------------------------------------------------- responses


def _responses_turn(
    stack: Stack, rollout_id: str, items: list[dict[str, Any]], *, stream: bool, turn: int
) -> Any:
    client = client_for(stack, rollout_id)
    kwargs: dict[str, Any] = {
        "model": "smol",
        "instructions": "You check the weather.",
        "input": items,
        "tools": [RESPONSES_TOOL],
        "store": False,
    }
    if not stream:
        response = client.responses.create(**kwargs)
        assert stack.captured(rollout_id) == turn
    else:
        kinds: list[str] = []
        with client.responses.stream(**kwargs) as events:
            for event in events:
                if not kinds:
                    assert stack.captured(rollout_id) == turn
                kinds.append(event.type)
                assert_no_token_arrays(event.model_dump())
            response = events.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert_no_token_arrays(response.model_dump())
    return response


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_responses_tool_loop_rebuilds_exactly(stack: Stack, rid: Rid, stream: bool) -> None:
    r = rid("resp")
    items: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    stack.engine.script_tool_call("get_weather", {"city": "Oslo", "days": 1}, content="Sure.")
    first = _responses_turn(stack, r, items, stream=stream, turn=1)
    kinds = [item.type for item in first.output]
    assert kinds == ["message", "function_call"]
    call = first.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo", "days": 1})
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "-3C"})

    stack.engine.script("It is -3C in Oslo.")
    second = _responses_turn(stack, r, items, stream=stream, turn=2)
    assert second.output_text == "It is -3C in Oslo."
    sent = stack.engine.bodies("/v1/chat/completions")[-1]
    assert sent["messages"][0] == {"role": "system", "content": "You check the weather."}
    assert sent["messages"][-2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert sent["messages"][-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "-3C"}
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert_exact_chain(stack, r, second.id, 2)


@pytest.fixture
def thinking_stack(shared_thinking_stack: Stack) -> Stack:
    return shared_thinking_stack


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_responses_reasoning_round_trips(thinking_stack: Stack, rid: Rid, stream: bool) -> None:
    stack, r = thinking_stack, rid("think")
    items: list[dict[str, Any]] = [{"role": "user", "content": "Is 7 prime?"}]
    stack.engine.script(Reply("Yes.", reasoning="7 has no divisor but 1 and 7."))
    first = _responses_turn(stack, r, items, stream=stream, turn=1)
    reasoning = [i for i in first.output if i.type == "reasoning"]
    assert reasoning[0].content[0].text == "7 has no divisor but 1 and 7."
    assert first.output_text == "Yes."
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"role": "user", "content": "And 9?"})
    stack.engine.script(Reply("No.", reasoning="9 = 3 * 3."))
    second = _responses_turn(stack, r, items, stream=stream, turn=2)
    echoed = stack.engine.bodies("/v1/chat/completions")[-1]["messages"][2]
    assert echoed == {
        "role": "assistant",
        "content": "Yes.",
        "reasoning_content": "7 has no divisor but 1 and 7.",
    }
    assert_exact_chain(stack, r, second.id, 2)


def test_chat_reasoning_reaches_the_harness(thinking_stack: Stack, rid: Rid) -> None:
    stack, r = thinking_stack, rid("cthink")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Is 7 prime?"}]
    stack.engine.script(Reply("Yes.", reasoning="No divisors."))
    first = client_for(stack, r).chat.completions.create(model="smol", messages=messages)  # type: ignore[arg-type]
    assert (first.choices[0].message.model_extra or {})["reasoning"] == "No divisors."
    messages += [_echo(first.choices[0].message), {"role": "user", "content": "Sure?"}]
    stack.engine.script(Reply("Sure.", reasoning="Checked."))
    second = client_for(stack, r).chat.completions.create(model="smol", messages=messages)  # type: ignore[arg-type]
    assert_exact_chain(stack, r, second.id, 2)


def test_images_reach_the_upstream(stack: Stack, rid: Rid) -> None:
    r = rid("img")
    client = client_for(stack, r)
    stack.engine.script("A pixel.")
    client.chat.completions.create(
        model="smol",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": PNG}},
                ],
            }
        ],
    )
    sent = stack.engine.bodies("/v1/chat/completions")[-1]["messages"][0]["content"]
    assert sent[1] == {"type": "image_url", "image_url": {"url": PNG}}

    stack.engine.script_tool_call("screenshot", {})
    shot_tool = {"type": "function", "name": "screenshot", "parameters": {"type": "object"}}
    items: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Look:"},
                {"type": "input_image", "image_url": PNG, "detail": "low"},
            ],
        }
    ]
    first = client.responses.create(model="smol", input=items, tools=[shot_tool])  # type: ignore[arg-type, list-item]
    sent = stack.engine.bodies("/v1/chat/completions")[-1]["messages"][0]["content"]
    assert sent[1] == {"type": "image_url", "image_url": {"url": PNG, "detail": "low"}}
    call: Any = first.output[-1]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append(
        {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": [
                {"type": "input_text", "text": "the screen"},
                {"type": "input_image", "image_url": PNG},
            ],
        }
    )
    stack.engine.script("A tiny screen.")
    client.responses.create(model="smol", input=items, tools=[shot_tool])  # type: ignore[arg-type, list-item]
    sent_messages = stack.engine.bodies("/v1/chat/completions")[-1]["messages"]
    assert sent_messages[-2] == {
        "role": "tool",
        "tool_call_id": call.call_id,
        "content": "the screen",
    }
    assert sent_messages[-1] == {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": PNG}}],
    }
    assert stack.captured(r) == 3 and stack.reasons(r) == []


# --------------------------------------------------------------------------- upstream fields


def test_capture_fields_are_forced_on_every_chat_route(stack: Stack, rid: Rid) -> None:
    """Whatever the harness sent, the upstream is asked for ids and log-probs (point 4)."""
    r = rid("fields")
    harness = {"include_reasoning": False, "return_token_ids": False, "logprobs": False}
    bodies = {
        "/v1/chat/completions": {
            "model": "smol",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            **harness,
        },
        "/v1/responses": {"model": "smol", "input": "hi", "stream": True, **harness},
        "/v1/messages": {
            "model": "smol",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}],
        },
    }
    for path, body in bodies.items():
        stack.engine.script("ok")
        resp = httpx.post(stack.base(r) + path, json=body)
        assert resp.status_code == 200, (path, resp.text)
        sent = stack.engine.requests[-1]
        assert sent.path == "/v1/chat/completions"
        assert sent.body["logprobs"] is True
        assert sent.body["top_logprobs"] == 0
        assert sent.body["return_tokens_as_token_ids"] is True
        assert sent.body["return_token_ids"] is True
        assert sent.body["include_reasoning"] is True
        assert sent.body.get("n", 1) == 1 and "stream" not in sent.body
    stack.engine.script("ok")
    resp = httpx.post(
        stack.base(r) + "/v1/completions",
        json={"model": "smol", "prompt": "hi", "return_token_ids": False, "max_tokens": 8},
    )
    assert resp.status_code == 200
    sent = stack.engine.requests[-1]
    assert sent.path == "/v1/completions"
    assert (sent.body["logprobs"], sent.body["return_token_ids"]) == (0, True)
    assert sent.body["return_tokens_as_token_ids"] is True
    assert stack.captured(r) == 4 and stack.reasons(r) == []


@pytest.mark.parametrize("field", ["chat-n", "completions-n", "completions-best_of"])
def test_several_sequences_are_refused_with_the_reason(stack: Stack, rid: Rid, field: str) -> None:
    r = rid("n")
    before = len(stack.engine.requests)
    client = client_for(stack, r)
    route, name = field.split("-")
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "chat":
            client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "hi"}], n=2
            )
        else:
            client.completions.create(model="smol", prompt="hi", **{name: 3})  # type: ignore[call-overload]
    assert caught.value.status_code == 400
    message = caught.value.message
    assert f"`{name}` must be 1" in message and "one sampled sequence per model call" in message
    assert len(stack.engine.requests) == before  # nothing went upstream
    assert stack.detail(r) is None  # and no intent was registered


@pytest.fixture
def pinned_stack(db_url: str) -> Iterator[Stack]:
    yield from start_stack(
        db_url, sampling_overrides={"temperature": 0.25, "top_p": 0.5, "max_tokens": 300}
    )


def test_sampling_overrides_apply_last_on_every_route(pinned_stack: Stack, rid: Rid) -> None:
    stack, r = pinned_stack, rid("pin")
    client = client_for(stack, r)
    stack.engine.script("a")
    client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "hi"}],
        temperature=1.7,
        top_p=1.0,
        max_tokens=5,
    )
    stack.engine.script("b")
    client.completions.create(model="smol", prompt="hi", temperature=1.3)
    stack.engine.script("c")
    client.responses.create(model="smol", input="hi", temperature=2.0, max_output_tokens=10)
    stack.engine.script("d")
    httpx.post(
        stack.base(r) + "/v1/messages",
        json={
            "model": "smol",
            "max_tokens": 7,
            "temperature": 0.9,
            "messages": [{"role": "user", "content": "hi"}],
        },
    ).raise_for_status()
    sent = [req.body for req in stack.engine.requests if req.body]
    assert len(sent) == 4
    for body in sent:
        assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.25, 0.5, 300)
    assert stack.captured(r) == 4


# --------------------------------------------------------------------------- SmolLM2


@pytest.fixture
def smol_stack(db_url: str) -> Iterator[Stack]:
    engine = SimEngine(load_smollm2_tokenizer(), model_name="smol", max_model_len=8192, seed=11)
    yield from start_stack(db_url, engine=engine)


def test_smollm2_tool_loop_rebuilds_exactly(smol_stack: Stack, rid: Rid) -> None:
    """The real SmolLM2 vocabulary and template (BPE merges, 49152 ids) end to end."""
    stack, r = smol_stack, rid("smol")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    stack.engine.script("Sure. I will look it up for you.")
    first = _chat_turn(stack, r, messages, stream=False, turn=1)
    messages += [_echo(first.choices[0].message), {"role": "user", "content": "Go on."}]
    stack.engine.script_tool_call("get_weather", {"city": "Paris", "days": 2})
    second = _chat_turn(stack, r, messages, stream=True, turn=2)
    call = second.choices[0].message.tool_calls[0]
    messages += [
        _echo(second.choices[0].message),
        {"role": "tool", "tool_call_id": call.id, "content": "18C, sunny"},
    ]
    stack.engine.script("It is 18C and sunny in Paris.")
    third = _chat_turn(stack, r, messages, stream=False, turn=3)
    first_prompt = stack.sampled[0]["prompt_token_ids"]
    assert first_prompt[:3] == [1, 9690, 198]  # <|im_start|>system\n: real SmolLM2 ids
    assert stack.sampled[0]["choices"][0]["token_ids"][-1] == 2  # EOS <|im_end|> is sampled
    assert max(first_prompt) > 272  # beyond the byte tokenizer: BPE ids
    assert_exact_chain(stack, r, third.id, 3)
