"""Issue 11 point 1: prefix supply through the proxy, driven by the real OpenAI and Anthropic
SDKs against the simulated vLLM 0.32 (which honours ``kv_transfer_params.prompt_token_ids``
as vLLM 0.32 does).

The harnesses here drift the way real ones do (tool arguments written back in another key
order), so without prefix supply the continuation's prompt does not extend the parent's
tokens and the rollout masks; with it, the engine generates over the parent's exact tokens,
the proof holds and the chain is delivered, token for token what the engine sampled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from typer.testing import CliRunner

from api.cli import app as cli_app
from api.prefix import PrefixPlan, _missing_closing
from ledger.config import ConfigError, load_settings
from rollout_sim import ByteTokenizer, SimEngine
from tests.proxy_support import Stack, delivered, reset, sampled_chain, start_stack

Rid = Callable[[str], str]
TOK = ByteTokenizer()
NL = TOK.encode("\n")
EOT = [TOK.eos_id]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}


@pytest.fixture(scope="session")
def _session_prefix_stack(session_db_url: str) -> Iterator[Stack]:
    yield from start_stack(session_db_url, supply_prefix_token_ids=True)


@pytest.fixture
def stack(_session_prefix_stack: Stack) -> Stack:
    return reset(_session_prefix_stack)


def oai(stack: Stack, rollout_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base(rollout_id) + "/v1", api_key="sk", max_retries=0)


def chat_bodies(stack: Stack) -> list[dict[str, Any]]:
    return [b for b in stack.engine.bodies("/v1/chat/completions") if b.get("return_token_ids")]


def supplied_ids(body: dict[str, Any]) -> list[int] | None:
    kv = body.get("kv_transfer_params")
    return None if kv is None else kv["prompt_token_ids"]


def cumulative(answer: dict[str, Any]) -> list[int]:
    return answer["prompt_token_ids"] + answer["choices"][0]["token_ids"]


def expected_prompt(stack: Stack, index: int, parent: int, closing: list[int]) -> list[int]:
    """The supplied prompt of upstream call ``index``, computed here with the tokenizer itself:
    parent cumulative ids + the closing tokens it lacks + the template's rendering of the turns
    after the last assistant turn (and the generation prompt)."""
    body = chat_bodies(stack)[index]
    messages, tools = body["messages"], body.get("tools")
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    full = TOK.render_chat(messages, tools, True)
    prefix = TOK.render_chat(messages[: last + 1], tools, False)
    assert full[: len(prefix)] == prefix
    return cumulative(stack.sampled[parent]) + closing + full[len(prefix) :]


def rewritten_tool_turn(call: Any) -> dict[str, Any]:
    """The harness writes the call back its own way: keys reversed, no spaces (drift)."""
    args = json.loads(call.function.arguments)
    text = json.dumps(dict(sorted(args.items(), reverse=True)), separators=(",", ":"))
    function = {"name": call.function.name, "arguments": text}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call.id, "type": "function", "function": function}],
    }


def weather_turn(
    stack: Stack, client: openai.OpenAI, messages: list[dict[str, Any]], city: str
) -> Any:
    stack.engine.script_tool_call("get_weather", {"city": city, "days": 2})
    answer = client.chat.completions.create(model="smol", messages=messages, tools=[TOOL])  # type: ignore[arg-type, list-item]
    call = answer.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages += [
        rewritten_tool_turn(call),
        {"role": "tool", "tool_call_id": call.id, "content": "18C"},
    ]
    return answer


def metric(stack: Stack, name: str) -> float:
    text = httpx.get(stack.url + "/metrics").text
    lines = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(lines[0].split()[1]) if lines else 0.0


def calls_of(stack: Stack, rollout_id: str) -> list[dict[str, Any]]:
    detail = stack.detail(rollout_id)
    assert detail is not None
    return list(detail["calls"])


def finalize(stack: Stack, rollout_id: str, response_id: str) -> tuple[dict[str, Any], Any]:
    result: dict[str, Any] = {"_ng_rollout_id": rollout_id, "response": {"id": response_id}}
    result["response"]["output"] = []
    return result, stack.finalize(result)


# --------------------------------------------------------------------------- the main path


def test_drifting_tool_loop_is_delivered_with_supplied_prefixes(stack: Stack, rid: Rid) -> None:
    r = rid("supply")
    client = oai(stack, r)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer weather questions."},
        {"role": "user", "content": "Weather in Paris, then Rome?"},
    ]
    weather_turn(stack, client, messages, "Paris")
    weather_turn(stack, client, messages, "Rome")
    stack.engine.script("Paris 18C, Rome 18C.")
    final = client.chat.completions.create(model="smol", messages=messages, tools=[TOOL])  # type: ignore[arg-type, list-item]

    bodies = chat_bodies(stack)
    assert supplied_ids(bodies[0]) is None  # a root goes unchanged
    for i in (1, 2):
        # The end-of-turn token was sampled: only the template's "\n" after it is supplied.
        expected = expected_prompt(stack, i, i - 1, NL)
        assert supplied_ids(bodies[i]) == expected
        assert stack.sampled[i]["prompt_token_ids"] == expected  # what the engine used
        # Without supply the template's rendering would not extend the sampled tokens.
        rendered = TOK.render_chat(bodies[i]["messages"], bodies[i]["tools"], True)
        assert rendered[: len(cumulative(stack.sampled[i - 1]))] != cumulative(stack.sampled[i - 1])

    calls = calls_of(stack, r)
    assert [c["parent_call_id"] for c in calls[1:]] == [c["model_call_id"] for c in calls[:-1]]
    detail = stack.detail(r)
    assert detail is not None
    edges = [(e["method"], e["status"]) for e in detail["edges"]]
    assert edges == [("supplied_prefix", "verified")] * 2
    result, build = finalize(stack, r, final.id)
    assert build["outcome"] == "delivered", build["mask_reasons"]
    assert delivered(result) == sampled_chain(stack, [0, 1, 2])
    capture = result["_ng_token_capture"]
    assert (capture["prefix_supply_total"], capture["prefix_supply_eligible"]) == (3, 2)
    assert capture["prefix_supply_supplied"] == 2


def test_metrics_count_total_eligible_and_supplied(stack: Stack, rid: Rid) -> None:
    names = {
        "total": "rollout_ledger_prefix_supply_calls_total",
        "eligible": "rollout_ledger_prefix_supply_eligible_total",
        "supplied": "rollout_ledger_prefix_supply_supplied_total",
    }
    before = {k: metric(stack, n) for k, n in names.items()}
    client = oai(stack, rid("metrics"))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    weather_turn(stack, client, messages, "Oslo")
    stack.engine.script("Cold.")
    client.chat.completions.create(model="smol", messages=messages, tools=[TOOL])  # type: ignore[arg-type, list-item]
    after = {k: metric(stack, n) for k, n in names.items()}
    assert {k: after[k] - before[k] for k in names} == {"total": 2, "eligible": 1, "supplied": 1}


def test_records_carry_prefix_requested_and_supplied(stack: Stack, rid: Rid) -> None:
    r = rid("flags")
    client = oai(stack, r)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Bern?"}]
    weather_turn(stack, client, messages, "Bern")
    stack.engine.script("Mild.")
    client.chat.completions.create(model="smol", messages=messages, tools=[TOOL])  # type: ignore[arg-type, list-item]
    snapshot = stack.ledger_call("freeze", r)
    flags = [(e.prefix_requested, e.prefix_supplied) for e in snapshot.entries]  # type: ignore[attr-defined]
    assert flags == [(False, False), (True, True)]


def test_a_turn_cut_by_max_tokens_gets_its_end_of_turn_token_on_the_prompt_side(
    stack: Stack, rid: Rid
) -> None:
    r = rid("cut")
    client = oai(stack, r)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Tell me a story."}]
    stack.engine.script("Once upon a time there was a model.")
    first = client.chat.completions.create(model="smol", messages=messages, max_tokens=9)  # type: ignore[arg-type]
    assert first.choices[0].finish_reason == "length"
    assert stack.sampled[0]["choices"][0]["token_ids"][-1] != TOK.eos_id
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Go on."},
    ]
    stack.engine.script("It learned.")
    second = client.chat.completions.create(model="smol", messages=messages)  # type: ignore[arg-type]

    expected = expected_prompt(stack, 1, 0, EOT + NL)  # the whole closing, <|im_end|> included
    assert supplied_ids(chat_bodies(stack)[1]) == expected
    result, build = finalize(stack, r, second.id)
    assert build["outcome"] == "delivered", build["mask_reasons"]
    assert delivered(result) == sampled_chain(stack, [0, 1])


def test_closing_tokens_the_sample_lacks() -> None:
    closing = [2, 16 + 10]
    assert _missing_closing([5, 6, 2], closing) == [16 + 10]  # sampled end-of-turn token
    assert _missing_closing([5, 6, 2, 16 + 10], closing) == []  # sampled the whole closing
    assert _missing_closing([5, 6, 7], closing) == closing  # cut by max_tokens
    assert _missing_closing([16 + 10], closing) == closing  # "\n" alone is content, not closing


# --------------------------------------------------------------------------- unchanged requests


def test_a_changed_system_prompt_is_unresolved_and_goes_unchanged(stack: Stack, rid: Rid) -> None:
    r = rid("ctx")
    client = oai(stack, r)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Nice?"},
    ]
    weather_turn(stack, client, messages, "Nice")
    messages[0] = {"role": "system", "content": "Be verbose."}  # the harness rewrote history
    stack.engine.script("Sunny.")
    client.chat.completions.create(model="smol", messages=messages, tools=[TOOL])  # type: ignore[arg-type, list-item]
    assert supplied_ids(chat_bodies(stack)[1]) is None
    assert [c["parent_call_id"] for c in calls_of(stack, r)] == [None, None]


def test_media_requests_go_unchanged(stack: Stack, rid: Rid) -> None:
    """vLLM ignores supplied ids when a message has an image, so none are sent."""
    r = rid("media")
    client = oai(stack, r)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Lima?"}]
    weather_turn(stack, client, messages, "Lima")
    messages.append({"role": "user", "content": [{"type": "text", "text": "See:"}, image]})
    stack.engine.script("Foggy.")
    client.chat.completions.create(model="smol", messages=messages, tools=[TOOL])  # type: ignore[arg-type, list-item]
    assert supplied_ids(chat_bodies(stack)[1]) is None


def test_forks_get_their_own_parents_prefix(stack: Stack, rid: Rid) -> None:
    r = rid("fork")
    client = oai(stack, r)
    base: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    weather_turn(stack, client, base, "Oslo")  # call 0
    after_first = list(base)
    weather_turn(stack, client, base, "Bergen")  # call 1, child of 0
    # A fork continues call 0 again, with another tool result.
    fork = [*after_first[:-1], {**after_first[-1], "content": "-3C"}]
    stack.engine.script("Cold.")
    client.chat.completions.create(model="smol", messages=fork, tools=[TOOL])  # type: ignore[arg-type, list-item]
    bodies = chat_bodies(stack)
    assert supplied_ids(bodies[2]) == expected_prompt(stack, 2, 0, NL)
    calls = calls_of(stack, r)
    assert calls[2]["parent_call_id"] == calls[0]["model_call_id"]
    assert calls[1]["parent_call_id"] == calls[0]["model_call_id"]


# --------------------------------------------------------------------------- Anthropic


def test_anthropic_tool_loop_with_rewritten_input_is_delivered(stack: Stack, rid: Rid) -> None:
    r = rid("claude")
    client = anthropic.Anthropic(base_url=stack.base(r), api_key="sk", max_retries=0)
    tool = {
        "name": "get_weather",
        "input_schema": TOOL["function"]["parameters"],  # type: ignore[index]
    }
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    stack.engine.script_tool_call("get_weather", {"city": "Paris", "days": 2})
    first = client.messages.create(model="smol", max_tokens=256, messages=messages, tools=[tool])  # type: ignore[arg-type, list-item]
    use = next(b for b in first.content if b.type == "tool_use")
    reordered = dict(sorted(use.input.items(), reverse=True))  # type: ignore[union-attr]
    messages += [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": reordered}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18C"}],
        },
    ]
    stack.engine.script("It is 18C.")
    second = client.messages.create(model="smol", max_tokens=256, messages=messages, tools=[tool])  # type: ignore[arg-type, list-item]
    assert supplied_ids(chat_bodies(stack)[1]) == expected_prompt(stack, 1, 0, NL)
    result, build = finalize(stack, r, second.id)
    assert build["outcome"] == "delivered", build["mask_reasons"]
    assert delivered(result) == sampled_chain(stack, [0, 1])


# --------------------------------------------------------------------------- proof and backends


@pytest.fixture
def required_stack(db_url: str) -> Iterator[Stack]:
    """Backend (b): `required_prefix_token_ids`, against stock-vLLM behaviour (ignored)."""
    yield from start_stack(
        db_url, supply_prefix_token_ids=True, prefix_supply_backend="required_prefix_token_ids"
    )


def test_an_ignored_prefix_fails_the_call_in_each_dialect(required_stack: Stack, rid: Rid) -> None:
    """Stock vLLM ignores `required_prefix_token_ids` (HTTP 200): the proof is missing, the
    model call fails in the harness's dialect and nothing off-policy is captured."""
    stack, r = required_stack, rid("unproven")
    client = oai(stack, r)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    weather_turn(stack, client, messages, "Paris")
    stack.engine.script("It is 18C.")
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="smol", messages=messages, tools=[TOOL])  # type: ignore[arg-type, list-item]
    assert err.value.status_code == 502
    assert "prefix supply failed" in err.value.message
    body = chat_bodies(stack)[1]
    assert body["required_prefix_token_ids"] == cumulative(stack.sampled[0])
    assert [c["status"] for c in calls_of(stack, r)] == ["captured", "intent"]
    assert stack.reasons(r) == ["prefix_supply_unproven"]


def test_required_prefix_backend_is_proven_when_the_engine_honours_it(
    db_url: str, rid: Rid
) -> None:
    engine = SimEngine(TOK, max_model_len=16384, seed=7, required_prefix_extension=True)
    for stack in start_stack(
        db_url,
        engine=engine,
        supply_prefix_token_ids=True,
        prefix_supply_backend="required_prefix_token_ids",
    ):
        r = rid("nemorl")
        client = oai(stack, r)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
        stack.engine.script("Hello.")
        first = client.chat.completions.create(model="smol", messages=messages)  # type: ignore[arg-type]
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Bye"},
        ]
        stack.engine.script("Goodbye.")
        second = client.chat.completions.create(model="smol", messages=messages)  # type: ignore[arg-type]
        body = chat_bodies(stack)[1]
        assert body["required_prefix_token_ids"] == cumulative(stack.sampled[0])
        assert "kv_transfer_params" not in body
        result, build = finalize(stack, r, second.id)
        assert build["outcome"] == "delivered", build["mask_reasons"]
        assert result["_ng_token_capture"]["prefix_supply_supplied"] == 1


def test_prefix_plan_eligibility() -> None:
    assert PrefixPlan("requested").eligible and PrefixPlan("unrenderable").eligible
    assert not PrefixPlan("root").eligible and not PrefixPlan("unresolved").eligible


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"token_id_capture": {"enabled": False}}, "token-id information"),
        ({"sampling_overrides": {"echo": True}}, "sampling_overrides pins ['echo']"),
        ({"sampling_overrides": {"kv_transfer_params": {}}}, "kv_transfer_params"),
    ],
)
def test_incompatible_configuration_is_refused_at_startup(
    extra: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(supply_prefix_token_ids=True, **extra)
    assert "supply_prefix_token_ids: true is refused" in str(err.value)
    assert needle in str(err.value)


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ConfigError):
        load_settings(supply_prefix_token_ids=True, prefix_supply_backend="render")


def test_responses_tool_loop_with_rewritten_arguments_is_delivered(stack: Stack, rid: Rid) -> None:
    """Codex / the Agents SDK: function_call items echoed back with arguments re-serialised."""
    r = rid("codex")
    client = oai(stack, r)
    tool = {"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}  # type: ignore[index]
    items: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    stack.engine.script_tool_call("get_weather", {"city": "Paris", "days": 2})
    first = client.responses.create(
        model="smol", input=items, tools=[tool], instructions="Be brief."
    )  # type: ignore[arg-type, list-item]
    call = next(o for o in first.output if o.type == "function_call")
    items += [
        {
            "type": "function_call",
            "call_id": call.call_id,  # type: ignore[union-attr]
            "name": call.name,  # type: ignore[union-attr]
            "arguments": '{"days":2,"city":"Paris"}',
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C"},  # type: ignore[union-attr]
    ]
    stack.engine.script("It is 18C.")
    second = client.responses.create(
        model="smol", input=items, tools=[tool], instructions="Be brief."
    )  # type: ignore[arg-type, list-item]
    assert supplied_ids(chat_bodies(stack)[1]) == expected_prompt(stack, 1, 0, NL)
    result, build = finalize(stack, r, second.id)
    assert build["outcome"] == "delivered", build["mask_reasons"]
    assert delivered(result) == sampled_chain(stack, [0, 1])


def test_streaming_harness_gets_the_supplied_continuation(stack: Stack, rid: Rid) -> None:
    r = rid("stream")
    client = oai(stack, r)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Riga?"}]
    weather_turn(stack, client, messages, "Riga")
    stack.engine.script("Windy.")
    chunks = list(
        client.chat.completions.create(
            model="smol",
            messages=messages,  # type: ignore[arg-type]
            tools=[TOOL],  # type: ignore[list-item]
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == stack.sampled[1]["choices"][0]["message"]["content"]  # the engine's answer
    assert supplied_ids(chat_bodies(stack)[1]) == expected_prompt(stack, 1, 0, NL)
    result, build = finalize(stack, r, chunks[0].id)
    assert build["outcome"] == "delivered", build["mask_reasons"]
    assert delivered(result) == sampled_chain(stack, [0, 1])


def test_serve_refuses_an_incompatible_prefix_config_at_startup(tmp_path: Path) -> None:
    config = tmp_path / "capture.yaml"
    config.write_text("supply_prefix_token_ids: true\ntoken_id_capture: {enabled: false}\n")
    db = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    result = CliRunner().invoke(cli_app, ["serve", "--config", str(config), "--db", db])
    assert result.exit_code == 2
    assert "supply_prefix_token_ids: true is refused" in result.output
