"""The simulated vLLM 0.32 engine reproduces the wire formats the capture proxy reads.

Shapes are checked against shared/reference/wire-formats.md §1 (field names, order,
nulls), streams against §1.3's grammar and reassembly rules, and token ids against the
tokenizer (including the real SmolLM2 one, §5.2).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from rollout_sim import (
    ByteTokenizer,
    Reply,
    SimEngine,
    SimRequest,
    ThreadedServer,
    create_sim_vllm_app,
    engine_of,
)
from rollout_sim.engine import Tokenizer
from tests.support import parse_sse, reassemble
from tests.support.smollm2 import REFERENCE_PROMPT_IDS, load_smollm2_tokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
CAPTURE_FIELDS = {
    "logprobs": True,
    "top_logprobs": 0,
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
}
USER = [{"role": "user", "content": "Say hi in three words."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOL_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{16}$")


@pytest.fixture
def engine() -> SimEngine:
    return SimEngine(ByteTokenizer(), max_model_len=4096, seed=7)


@pytest.fixture
async def client(engine: SimEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(engine.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as c:
        yield c


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "smol", "messages": USER, "temperature": 0, **CAPTURE_FIELDS, **extra}


def is_f32(x: float) -> bool:
    return bool(struct.unpack("<f", struct.pack("<f", x))[0] == x)


def token_of(entry: dict[str, Any]) -> int:
    assert entry["token"].startswith("token_id:")
    return int(entry["token"].removeprefix("token_id:"))


# ----------------------------------------------------------------- chat, non-streaming


async def test_chat_response_has_vllm_032_shape(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    engine.script("Hi there, friend!")
    r = await client.post(CHAT, json=chat())
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert list(body) == [
        "id", "object", "created", "model", "choices", "system_fingerprint", "usage",
        "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
        "ec_transfer_params", "metrics",
    ]  # fmt: skip
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", body["id"])
    assert body["object"] == "chat.completion" and body["model"] == "smol"
    assert body["system_fingerprint"].startswith("vllm-0.32.0-")
    (choice,) = body["choices"]
    assert list(choice) == [
        "index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids",
        "routed_experts",
    ]  # fmt: skip
    assert choice["message"] == {
        "role": "assistant",
        "content": "Hi there, friend!",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    tok = engine.tokenizer
    assert body["prompt_token_ids"] == tok.render_chat(USER, None, True)
    assert choice["token_ids"] == [*tok.encode("Hi there, friend!"), tok.eos_id]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    content = choice["logprobs"]["content"]
    assert [token_of(e) for e in content] == choice["token_ids"]
    for entry, token in zip(content, choice["token_ids"], strict=True):
        assert list(entry) == ["token", "logprob", "bytes", "top_logprobs"]
        assert entry["bytes"] == list(tok.decode([token]).encode())  # decoded text, id mode too
        assert entry["top_logprobs"] == []
        assert entry["logprob"] <= 0 and is_f32(entry["logprob"])
    assert body["usage"] == {
        "prompt_tokens": len(body["prompt_token_ids"]),
        "total_tokens": len(body["prompt_token_ids"]) + len(choice["token_ids"]),
        "completion_tokens": len(choice["token_ids"]),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


async def test_token_fields_are_null_unless_requested(client: httpx.AsyncClient) -> None:
    r = await client.post(CHAT, json={"model": "smol", "messages": USER, "max_tokens": 5})
    body = r.json()
    assert body["prompt_token_ids"] is None
    assert body["choices"][0]["token_ids"] is None
    assert body["choices"][0]["logprobs"] is None


async def test_logprobs_in_text_mode_name_the_decoded_token(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    engine.script("héllo")
    r = await client.post(CHAT, json=chat(return_tokens_as_token_ids=False))
    choice = r.json()["choices"][0]
    tokens = [e["token"] for e in choice["logprobs"]["content"]]
    # Byte tokens: "é" is two tokens, each decoding to the replacement character.
    assert tokens == ["h", "\ufffd", "\ufffd", "l", "l", "o", "<|im_end|>"]
    assert choice["logprobs"]["content"][1]["bytes"] == list("\ufffd".encode())


async def test_log_probs_are_realistic_and_reproducible(client: httpx.AsyncClient) -> None:
    body = chat(max_tokens=400, temperature=1.0, seed=3)
    runs = [(await client.post(CHAT, json=body)).json() for _ in range(2)]
    values = [e["logprob"] for e in runs[0]["choices"][0]["logprobs"]["content"]]
    assert runs[0]["choices"][0]["token_ids"] == runs[1]["choices"][0]["token_ids"]
    assert values == [e["logprob"] for e in runs[1]["choices"][0]["logprobs"]["content"]]
    assert all(v <= 0 and is_f32(v) for v in values)
    assert any(-1e-6 < v <= 0 for v in values), "expected some near-certain tokens"
    assert any(v < -5 for v in values), "expected some surprising tokens"
    assert len(set(values)) > len(values) // 2


async def test_sampling_depends_on_seed_and_temperature(client: httpx.AsyncClient) -> None:
    async def ids(**extra: Any) -> list[int]:
        r = await client.post(CHAT, json=chat(**extra))
        return list(r.json()["choices"][0]["token_ids"])

    assert await ids(temperature=0, seed=1) == await ids(temperature=0, seed=2)  # greedy
    assert await ids(temperature=1, seed=1) == await ids(temperature=1, seed=1)
    assert await ids(temperature=1, seed=1) != await ids(temperature=1, seed=2)
    assert await ids(temperature=1) != await ids(temperature=1)  # unseeded draws differ


async def test_max_tokens_ends_with_length_and_no_eos(client: httpx.AsyncClient) -> None:
    r = await client.post(CHAT, json=chat(max_completion_tokens=3))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 3 and 2 not in choice["token_ids"]
    assert len(choice["message"]["content"].encode()) == 3


async def test_top_logprobs_start_with_the_sampled_token_when_greedy(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post(CHAT, json=chat(top_logprobs=3))
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == entry["token"]
        assert [list(t) for t in top] == [["token", "logprob", "bytes"]] * 3
        assert all(t["logprob"] <= entry["logprob"] for t in top)
        assert sum(math.exp(t["logprob"]) for t in top) <= 1 + 1e-6
        assert len({t["token"] for t in top}) == 3


async def test_stop_string_cuts_text_but_keeps_its_tokens(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    engine.script("Hello world. Bye.")
    r = await client.post(CHAT, json=chat(stop=["world", "zzz"]))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Hello "
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "world")
    assert choice["token_ids"] == engine.tokenizer.encode("Hello world")


async def test_stop_token_ids_and_include_stop_str(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    b = engine.tokenizer.encode("b")[0]
    engine.script("abc")
    choice = (await client.post(CHAT, json=chat(stop_token_ids=[b]))).json()["choices"][0]
    assert choice["token_ids"] == engine.tokenizer.encode("ab")  # the stop token is kept
    assert (choice["message"]["content"], choice["stop_reason"]) == ("a", b)

    engine.script("abc")
    body = chat(stop_token_ids=[b], include_stop_str_in_output=True)
    assert (await client.post(CHAT, json=body)).json()["choices"][0]["message"]["content"] == "ab"

    engine.script("Hello world. Bye.")
    body = chat(stop=["Bye", "world"], include_stop_str_in_output=True)
    choice = (await client.post(CHAT, json=body)).json()["choices"][0]
    assert (choice["message"]["content"], choice["stop_reason"]) == ("Hello world", "world")


async def test_stop_string_in_a_stream(engine: SimEngine, client: httpx.AsyncClient) -> None:
    engine.script("Hello world. Bye.")
    r = await client.post(CHAT, json=chat(stop="rld", stream=True))
    got = reassemble(parse_sse(r.text))[0][0]
    assert (got.text, got.finish_reason, got.stop_reason) == ("Hello wo", "stop", "rld")
    assert got.token_ids == engine.tokenizer.encode("Hello world")


async def test_n_gives_independent_choices(client: httpx.AsyncClient) -> None:
    r = await client.post(CHAT, json=chat(n=3, temperature=0.8, seed=11))
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) == 3
    generated = sum(len(c["token_ids"]) for c in body["choices"])
    assert body["usage"]["completion_tokens"] == generated


async def test_prompt_logprobs_shape(engine: SimEngine, client: httpx.AsyncClient) -> None:
    r = await client.post(CHAT, json=chat(prompt_logprobs=2, max_tokens=2))
    body = r.json()
    plp, prompt = body["prompt_logprobs"], body["prompt_token_ids"]
    assert len(plp) == len(prompt) and plp[0] is None
    for entry, token in zip(plp[1:], prompt[1:], strict=True):
        assert str(token) in entry and 1 <= len(entry) <= 3
        assert set(entry[str(token)]) == {"logprob", "rank", "decoded_token"}


async def test_unknown_fields_are_ignored(client: httpx.AsyncClient) -> None:
    body = chat(required_prefix_token_ids=[1, 2, 3], max_tokens=2)
    body["messages"] = [{**USER[0], "prompt_token_ids": [9], "generation_log_probs": [0.0]}]
    assert (await client.post(CHAT, json=body)).status_code == 200


# ----------------------------------------------------------------- chat, streaming


async def test_stream_follows_sse_grammar_and_reassembles(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    plain = (await client.post(CHAT, json=chat(max_tokens=40))).json()
    r = await client.post(
        CHAT, json=chat(max_tokens=40, stream=True, stream_options={"include_usage": True})
    )
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = parse_sse(r.text)
    first = events[0]
    assert list(first) == [
        "id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text",
    ]  # fmt: skip
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}
    ]  # fmt: skip
    middle = events[1]
    assert list(middle) == ["id", "object", "created", "model", "choices"]
    assert list(middle["choices"][0]) == [
        "index",
        "delta",
        "logprobs",
        "finish_reason",
        "token_ids",
    ]
    assert len({e["id"] for e in events}) == 1
    finish = events[-2]["choices"][0]
    assert list(finish) == [
        "index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids",
    ]  # fmt: skip
    usage_chunk = events[-1]
    assert usage_chunk["choices"] == [] and "system_fingerprint" in usage_chunk
    assert list(usage_chunk["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens"]

    choices, usage = reassemble(events)
    got, want = choices[0], plain["choices"][0]
    assert got.prompt_token_ids == plain["prompt_token_ids"]
    assert got.token_ids == want["token_ids"]
    assert got.logprobs == want["logprobs"]["content"]
    assert got.text == want["message"]["content"]
    assert got.finish_reason == want["finish_reason"]
    assert usage["completion_tokens"] == len(want["token_ids"])


async def test_stream_chunks_may_carry_several_tokens() -> None:
    engine = SimEngine(ByteTokenizer(), max_model_len=4096, stream_interval=4)
    engine.script("héllo wörld, 12345")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(engine.app), base_url="http://s"
    ) as c:
        events = parse_sse((await c.post(CHAT, json=chat(stream=True))).text)
    chunks = [e["choices"][0] for e in events[1:]]
    assert max(len(c["token_ids"]) for c in chunks) == 4
    for c in chunks:
        assert len(c["logprobs"]["content"]) == len(c["token_ids"])
    choice = reassemble(events)[0][0]
    assert choice.text == "héllo wörld, 12345"
    assert choice.token_ids == [*engine.tokenizer.encode(choice.text), 2]


async def test_stream_with_n_choices_reassembles_per_index(client: httpx.AsyncClient) -> None:
    body = chat(n=2, temperature=1, seed=5, max_tokens=30)
    plain = (await client.post(CHAT, json=body)).json()
    events = parse_sse((await client.post(CHAT, json={**body, "stream": True})).text)
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]  # role chunks first
    choices, usage = reassemble(events)
    assert usage is None
    for want in plain["choices"]:
        assert choices[want["index"]].token_ids == want["token_ids"]
        assert choices[want["index"]].prompt_token_ids == plain["prompt_token_ids"]


# ----------------------------------------------------------------- tool calls and reasoning


async def test_hermes_tool_call_is_parsed_and_raw_tokens_kept(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    engine.script_tool_call("get_weather", {"city": "Paris"}, content="Let me check.")
    r = await client.post(CHAT, json=chat(tools=[WEATHER_TOOL]))
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert message["content"] == "Let me check."
    (call,) = message["tool_calls"]
    assert TOOL_ID.match(call["id"])
    assert call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert list(message) == [
        "role", "content", "refusal", "annotations", "audio", "function_call", "tool_calls",
        "reasoning",
    ]  # fmt: skip
    assert choice["finish_reason"] == "tool_calls"
    raw = engine.tokenizer.decode(choice["token_ids"])
    call_text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert raw == f"Let me check.<tool_call>\n{call_text}\n</tool_call><|im_end|>"


async def test_tool_call_stream_sends_name_once_then_argument_fragments(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    for _ in range(2):
        engine.script_tool_call("get_weather", {"city": "Paris"})
    plain = (await client.post(CHAT, json=chat(tools=[WEATHER_TOOL]))).json()["choices"][0]
    events = parse_sse((await client.post(CHAT, json=chat(tools=[WEATHER_TOOL], stream=True))).text)
    deltas = [e["choices"][0]["delta"] for e in events[1:]]
    assert sum(1 for d in deltas if d == {}) > 10  # held-back tokens still arrive, as {}
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert list(calls[0]) == ["id", "type", "index", "function"]  # vLLM's DeltaToolCall order
    assert calls[0]["function"] == {"name": "get_weather"}
    assert len(calls) > 2
    assert all(list(c) == ["index", "function"] for c in calls[1:])
    got = reassemble(events)[0][0]
    assert plain["message"]["content"] is None  # hermes: no text before the call -> null
    assert got.token_ids == plain["token_ids"]
    assert got.finish_reason == "tool_calls"
    assert got.text == ""
    call = got.tool_calls[0]
    assert TOOL_ID.match(call["id"]) and call["type"] == "function"
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Paris"}')


async def test_forced_tool_choice_uses_structured_output(client: httpx.AsyncClient) -> None:
    r = await client.post(CHAT, json=chat(tools=[WEATHER_TOOL], tool_choice="required"))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}

    named = {"type": "function", "function": {"name": "get_weather"}}
    r = await client.post(CHAT, json=chat(tools=[WEATHER_TOOL], tool_choice=named))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    text = ByteTokenizer().decode(choice["token_ids"], skip_special_tokens=True)
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == text


async def test_truncated_tool_call_falls_back_to_content(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    engine.script_tool_call("get_weather", {"city": "Paris"})
    r = await client.post(CHAT, json=chat(tools=[WEATHER_TOOL], max_tokens=30))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].startswith("<tool_call>")
    assert "tool_calls" not in choice["message"]


async def test_tool_calls_stay_text_without_tool_choice(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    engine.script_tool_call("get_weather", {"city": "Paris"})
    r = await client.post(CHAT, json=chat(tools=[WEATHER_TOOL], tool_choice="none"))
    assert r.json()["choices"][0]["message"]["content"].startswith("<tool_call>")


async def test_reasoning_parser_and_include_reasoning() -> None:
    engine = SimEngine(ByteTokenizer(), max_model_len=4096, reasoning_parser=True)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(engine.app), base_url="http://s"
    ) as c:
        engine.script(Reply("Paris.", reasoning="The capital of France."))
        body = (await c.post(CHAT, json=chat())).json()
        message = body["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("The capital of France.", "Paris.")
        assert engine.tokenizer.decode(body["choices"][0]["token_ids"]).startswith("<think>")

        engine.script(Reply("Paris.", reasoning="The capital of France."))
        events = parse_sse((await c.post(CHAT, json=chat(stream=True))).text)
        got = reassemble(events)[0][0]
        assert (got.reasoning, got.text) == ("The capital of France.", "Paris.")

        # include_reasoning=false hides the reasoning, the logprobs and the token ids.
        engine.script(Reply("Paris.", reasoning="The capital of France."))
        choice = (await c.post(CHAT, json=chat(include_reasoning=False))).json()["choices"][0]
        assert choice["message"]["reasoning"] is None
        assert choice["token_ids"] is None and choice["logprobs"] is None


# ----------------------------------------------------------------- re-rendered history


def smollm2() -> Tokenizer:
    return load_smollm2_tokenizer()


@pytest.mark.parametrize("make_tokenizer", [ByteTokenizer, smollm2], ids=["byte", "smollm2"])
async def test_echoed_history_extends_the_sampled_tokens(
    make_tokenizer: Callable[[], Tokenizer],
) -> None:
    """The next prompt starts with prompt + generation of the previous call (text and tools)."""
    engine = SimEngine(make_tokenizer(), max_model_len=8192)
    transport = httpx.ASGITransport(engine.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as c:

        async def turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
            r = await c.post(CHAT, json=chat(messages=messages, tools=[WEATHER_TOOL]))
            assert r.status_code == 200, r.text
            return dict(r.json())

        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        engine.script("Sure. I will look it up for you.")
        first = await turn(messages)
        messages.append({k: v for k, v in first["choices"][0]["message"].items() if v is not None})
        messages.append({"role": "user", "content": "Go on."})

        engine.script_tool_call("get_weather", {"city": "Paris", "days": 2})
        second = await turn(messages)
        assert_extends(first, second)
        call_message = second["choices"][0]["message"]
        assert call_message["tool_calls"]
        messages.append({k: v for k, v in call_message.items() if v is not None})
        messages.append(
            {"role": "tool", "tool_call_id": call_message["tool_calls"][0]["id"], "content": "18C"}
        )

        engine.script("It is 18C in Paris.")
        third = await turn(messages)
        assert_extends(second, third)


def assert_extends(parent: dict[str, Any], child: dict[str, Any]) -> None:
    chain = parent["prompt_token_ids"] + parent["choices"][0]["token_ids"]
    prompt = child["prompt_token_ids"]
    assert prompt[: len(chain)] == chain
    assert len(prompt) > len(chain)


async def test_smollm2_renders_the_reference_prompt_ids() -> None:
    tok = load_smollm2_tokenizer()
    assert tok.render_chat(USER, None, True) == REFERENCE_PROMPT_IDS  # wire-formats.md §5.2
    assert tok.eos_id == 2 and tok.vocab_size == 49152
    assert tok.decode([49, 103, 14143, 17, 339, 5248, 18948, 346]) == "Awesome! I'm glad you"
    engine = SimEngine(tok)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(engine.app), base_url="http://s"
    ) as c:
        body = (await c.post(CHAT, json=chat(max_tokens=8))).json()
        assert body["prompt_token_ids"] == REFERENCE_PROMPT_IDS
        assert body["usage"]["prompt_tokens"] == 36
        r = await c.post(
            "/tokenize", json={"model": "smol", "prompt": "hello world", "return_token_strs": True}
        )
        assert r.json()["token_strs"] == ["hello", "Ġworld"]


# ----------------------------------------------------------------- completions


async def test_completions_with_text_and_id_prompts(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    engine.script("Hello.")
    body = {"model": "smol", "prompt": "Hi", "max_tokens": 10, "logprobs": 1,
            "return_token_ids": True, "return_tokens_as_token_ids": True}  # fmt: skip
    r = await client.post(COMPLETIONS, json=body)
    data = r.json()
    assert list(data) == [
        "id", "object", "created", "model", "choices", "system_fingerprint", "usage",
        "kv_transfer_params", "ec_transfer_params", "metrics",
    ]  # fmt: skip
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    (choice,) = data["choices"]
    assert list(choice) == [
        "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
        "prompt_logprobs", "prompt_token_ids", "routed_experts",
    ]  # fmt: skip
    tok = engine.tokenizer
    assert choice["prompt_token_ids"] == tok.encode("Hi")
    assert choice["token_ids"] == [*tok.encode("Hello."), tok.eos_id]
    assert choice["text"] == "Hello."
    lp = choice["logprobs"]
    assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    # vLLM advances text_offset by the length of each token *string* ("token_id:N").
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    assert all(lp["tokens"][k] in lp["top_logprobs"][k] for k in range(len(lp["tokens"])))
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"])

    ids = tok.encode("Once upon")
    r = await client.post(COMPLETIONS, json={**body, "prompt": ids, "max_tokens": 3})
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == ids and choice["finish_reason"] == "length"


async def test_completions_default_to_16_tokens_and_accept_prompt_lists(
    client: httpx.AsyncClient,
) -> None:
    body = {"model": "smol", "prompt": ["a", "b"], "n": 2, "return_token_ids": True}
    r = await client.post(COMPLETIONS, json={**body, "temperature": 0.5})
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in data["choices"]] == [[113]] * 2 + [[114]] * 2
    assert all(len(c["token_ids"]) <= 16 for c in data["choices"])
    assert data["usage"]["prompt_tokens"] == 2


async def test_completions_stream_reassembles(client: httpx.AsyncClient) -> None:
    body = {"model": "smol", "prompt": "Tell me", "max_tokens": 12, "logprobs": 0,
            "temperature": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True}  # fmt: skip
    plain = (await client.post(COMPLETIONS, json=body)).json()["choices"][0]
    r = await client.post(
        COMPLETIONS, json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    events = parse_sse(r.text)
    chunk = events[0]["choices"][0]
    assert list(chunk) == [
        "index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids",
        "token_ids",
    ]  # fmt: skip
    assert all(e["choices"][0]["prompt_token_ids"] is None for e in events[1:-1])
    choices, usage = reassemble(events)
    got = choices[0]
    assert got.prompt_token_ids == plain["prompt_token_ids"]
    assert got.token_ids == plain["token_ids"]
    assert got.text == plain["text"]
    assert [t for lp in got.logprobs for t in lp["tokens"]] == plain["logprobs"]["tokens"]
    assert usage == {"prompt_tokens": 7, "total_tokens": 19, "completion_tokens": 12}


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize("stream", [False, True])
async def test_context_errors_vllm_032(
    engine: SimEngine, client: httpx.AsyncClient, stream: bool
) -> None:
    engine.max_model_len = 64
    long = [{"role": "user", "content": "x" * 100}]
    r = await client.post(CHAT, json=chat(messages=long, stream=stream))
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json() == {
        "error": {
            "message": "This model's maximum context length is 64 tokens. However, your prompt "
            "contains at least 65 input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt. "
            "(parameter=input_tokens, value=65)",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
    }
    r = await client.post(CHAT, json=chat(max_tokens=100, stream=stream))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "max_tokens=100 cannot be greater than max_model_len=64. Please request fewer output "
        "tokens. (parameter=max_tokens, value=100)"
    )
    assert r.json()["error"]["param"] == "max_tokens"
    r = await client.post(CHAT, json=chat(max_completion_tokens=100))
    assert r.json()["error"]["param"] == "max_completion_tokens"


async def test_prompt_plus_max_tokens_overflow_is_clamped(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    engine.max_model_len = 60
    engine.script("word " * 50)
    r = await client.post(CHAT, json=chat(max_tokens=50))
    body = r.json()
    assert r.status_code == 200
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == 60


async def test_context_errors_old_style() -> None:
    engine = SimEngine(ByteTokenizer(), max_model_len=64, error_style="old")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(engine.app), base_url="http://s"
    ) as c:
        prompt_len = len(engine.tokenizer.render_chat(USER, None, True))
        r = await c.post(CHAT, json=chat(max_tokens=30))
        assert r.status_code == 400
        assert r.json() == {
            "object": "error",
            "message": f"'max_tokens' or 'max_completion_tokens' is too large: 30. This model's "
            f"maximum context length is 64 tokens and your request has {prompt_len} input tokens "
            f"(30 > 64 - {prompt_len}).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        long = [{"role": "user", "content": "x" * 100}]
        long_len = len(engine.tokenizer.render_chat(long, None, True))
        r = await c.post(CHAT, json=chat(messages=long))
        assert r.json()["message"] == (
            f"This model's maximum context length is 64 tokens. However, you requested {long_len} "
            "tokens in the messages, Please reduce the length of the messages."
        )
        r = await c.post(CHAT, json=chat(model="gpt-4"))
        assert r.status_code == 404 and r.json()["type"] == "NotFoundError"


@pytest.mark.parametrize(
    ("extra", "param", "text"),
    [
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs", "when using `top_logprobs`"),
        ({"tools": []}, "tools", "`tools` must not be an empty array"),
        ({"tool_choice": "auto"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
        ({"stream_options": {"include_usage": True}}, "stream_options", "Stream options"),
        ({"max_tokens": "many"}, "max_tokens", "`max_tokens` must be int"),
        ({"messages": []}, "messages", "`messages` must be a non-empty list."),
        ({"n": 0}, "n", "n must be at least 1, got 0."),
        ({"stop": ["x", ""]}, "stop", "stop cannot contain an empty string."),
    ],
)
async def test_request_validation_errors(
    client: httpx.AsyncClient, extra: dict[str, Any], param: str, text: str
) -> None:
    r = await client.post(CHAT, json=chat(**extra))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param and error["message"].startswith(text)


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    r = await client.post(CHAT, json=chat(model="claude"))
    assert r.status_code == 404
    assert r.json() == {
        "error": {"message": "The model `claude` does not exist.", "type": "NotFoundError",
                  "param": "model", "code": 404}
    }  # fmt: skip


# ----------------------------------------------------------------- other endpoints


async def test_tokenize_detokenize_models_health_version(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    r = await client.post("/tokenize", json={"model": "smol", "messages": USER})
    assert r.json() == {
        "count": len(r.json()["tokens"]),
        "max_model_len": 4096,
        "tokens": engine.tokenizer.render_chat(USER, None, True),
        "token_strs": None,
    }
    r = await client.post(
        "/tokenize", json={"model": "smol", "prompt": "Hi", "return_token_strs": True}
    )
    assert r.json()["token_strs"] == ["H", "i"]
    r = await client.post("/detokenize", json={"model": "smol", "tokens": [88, 121]})
    assert r.json() == {"prompt": "Hi"}
    r = await client.get("/v1/models")
    card = r.json()["data"][0]
    assert r.json()["object"] == "list"
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (
        "smol", "model", "vllm", 4096,
    )  # fmt: skip
    r = await client.get("/health")
    assert (r.status_code, r.content) == (200, b"")
    assert (await client.get("/version")).json() == {"version": "0.32.0"}


# ----------------------------------------------------------------- scripting and recording


async def test_scripts_responders_and_recorded_requests(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    engine.script("For the second.", when=lambda req: req.last_user_text == "second")
    engine.script("For anyone.")
    seen: list[SimRequest] = []

    def responder(req: SimRequest) -> str:
        seen.append(req)
        return f"echo {req.last_user_text}"

    engine.responder = responder

    async def say(text: str) -> str:
        body = chat(messages=[{"role": "user", "content": text}])
        r = await client.post(CHAT, json=body, headers={"X-Test": "1"})
        return str(r.json()["choices"][0]["message"]["content"])

    assert await say("first") == "For anyone."
    assert await say("second") == "For the second."
    assert await say("third") == "echo third"
    assert engine.scripts_pending == 0
    assert seen[0].prompt_ids == tuple(engine.tokenizer.render_chat(seen[0].messages, None, True))
    bodies = engine.bodies(CHAT)
    assert [b["messages"][0]["content"] for b in bodies] == ["first", "second", "third"]
    assert engine.requests[0].headers["x-test"] == "1"


async def test_exact_token_ids_can_be_scripted(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    # Ids the tokenizer would never produce from text ("a" as two byte tokens is not possible
    # here, so use a special token inside the text): they are returned verbatim.
    engine.script(Reply(token_ids=(113, 1, 114, 2)))
    choice = (await client.post(CHAT, json=chat())).json()["choices"][0]
    assert choice["token_ids"] == [113, 1, 114, 2]
    assert choice["message"]["content"] == "ab"  # special tokens are skipped in the text


async def test_create_sim_vllm_app_exposes_its_engine() -> None:
    app = create_sim_vllm_app(ByteTokenizer(), model_name="policy", max_model_len=128)
    engine = engine_of(app)
    assert (engine.model_name, engine.max_model_len) == ("policy", 128)


# ----------------------------------------------------------------- faults


async def test_fault_http_500(engine: SimEngine, client: httpx.AsyncClient) -> None:
    engine.faults.next("http_500")
    r = await client.post(CHAT, json=chat())
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "InternalServerError"
    assert (await client.post(CHAT, json=chat())).status_code == 200  # one-shot
    assert len(engine.bodies(CHAT)) == 2  # failed requests are recorded too


async def test_fault_hang_is_cancellable(engine: SimEngine, client: httpx.AsyncClient) -> None:
    engine.faults.next("hang")
    task = asyncio.create_task(client.post(CHAT, json=chat()))
    deadline = asyncio.get_running_loop().time() + 5
    while engine.faults.hanging == 0:
        assert asyncio.get_running_loop().time() < deadline, "request never reached the hang"
        await asyncio.sleep(0)  # yield to the request task; polled with a deadline
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.faults.hanging == 0


async def test_fault_drop_cuts_the_stream(engine: SimEngine, client: httpx.AsyncClient) -> None:
    engine.faults.next("drop", after_chunks=3)
    r = await client.post(CHAT, json=chat(stream=True))
    assert "[DONE]" not in r.text
    assert len(parse_sse(r.text, done=False)) == 3


async def test_fault_stream_error_event(engine: SimEngine, client: httpx.AsyncClient) -> None:
    engine.faults.next("stream_error", after_chunks=2)
    events = parse_sse((await client.post(CHAT, json=chat(stream=True))).text)
    assert len(events) == 3
    assert events[-1]["error"]["code"] == 500


async def test_fault_no_token_ids(engine: SimEngine, client: httpx.AsyncClient) -> None:
    engine.faults.next("no_token_ids")
    body = (await client.post(CHAT, json=chat())).json()
    assert body["prompt_token_ids"] is None
    assert body["choices"][0]["token_ids"] is None and body["choices"][0]["logprobs"] is None

    engine.faults.next("no_token_ids", keep_logprobs=True)
    body = (await client.post(CHAT, json=chat())).json()
    assert body["choices"][0]["token_ids"] is None and body["choices"][0]["logprobs"] is not None

    engine.faults.next("no_token_ids")
    events = parse_sse((await client.post(CHAT, json=chat(stream=True))).text)
    choice, _ = reassemble(events)
    assert choice[0].prompt_token_ids is None and choice[0].token_ids == []


@pytest.mark.parametrize("stream", [False, True])
async def test_fault_malformed_tokens(
    engine: SimEngine, client: httpx.AsyncClient, stream: bool
) -> None:
    async def fetch() -> tuple[list[int], list[int], int]:
        r = await client.post(
            CHAT,
            json=chat(stream=stream, stream_options={"include_usage": True} if stream else None),
        )
        if stream:
            choices, usage = reassemble(parse_sse(r.text))
            return (
                choices[0].token_ids,
                [token_of(e) for e in choices[0].logprobs],
                usage["completion_tokens"],
            )
        c = r.json()["choices"][0]
        return (
            c["token_ids"],
            [token_of(e) for e in c["logprobs"]["content"]],
            r.json()["usage"]["completion_tokens"],
        )

    engine.faults.next("malformed_tokens", variant="length")
    ids, lp_ids, _ = await fetch()
    assert len(ids) == len(lp_ids) + 1
    engine.faults.next("malformed_tokens", variant="mismatch")
    ids, lp_ids, _ = await fetch()
    assert len(ids) == len(lp_ids) and ids[:-1] == lp_ids[:-1] and ids[-1] != lp_ids[-1]
    engine.faults.next("malformed_tokens", variant="usage")
    ids, lp_ids, completion = await fetch()
    assert ids == lp_ids and completion == len(ids) + 1


async def test_fault_route_filter(engine: SimEngine, client: httpx.AsyncClient) -> None:
    engine.faults.next("http_500", route="/tokenize")
    assert (await client.post(CHAT, json=chat())).status_code == 200
    assert (await client.post("/tokenize", json={"prompt": "x"})).status_code == 500
    assert engine.faults.pending == 0


# ----------------------------------------------------------------- a real socket


async def test_real_uvicorn_server_streams_and_drops() -> None:
    engine = SimEngine(ByteTokenizer(), max_model_len=4096)
    with ThreadedServer(engine.app) as server:
        assert server.port != 0
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            assert (await c.get("/health")).status_code == 200
            engine.script("Over a real socket.")
            async with c.stream("POST", CHAT, json=chat(stream=True)) as r:
                text = "".join([chunk async for chunk in r.aiter_text()])
            assert reassemble(parse_sse(text))[0][0].text == "Over a real socket."

            engine.faults.next("drop", after_chunks=2)
            with pytest.raises(httpx.RemoteProtocolError):
                await c.post(CHAT, json=chat(stream=True))

            engine.faults.next("hang")
            with pytest.raises(httpx.ReadTimeout):
                await c.post(CHAT, json=chat(), timeout=0.5)
            # The client hung up: the server notices and releases the request.
            deadline = asyncio.get_running_loop().time() + 5
            while engine.faults.hanging:
                assert asyncio.get_running_loop().time() < deadline, "hang not released"
                await asyncio.sleep(0.01)
            assert (await c.post(CHAT, json=chat())).status_code == 200
