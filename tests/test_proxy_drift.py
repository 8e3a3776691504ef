"""Issue #6 point 7: drift diagnosis through the proxy.

A request that continues an earlier call by conversation (its model-authored turns are that
call's request plus output) but whose prompt tokens do not extend that call's tokens is
stored with a drifted lineage edge carrying the first mismatching token position, and
`rollout-ledger audit show` shows it.  The harnesses here drift the way real ones do: one
re-serialises tool arguments with another key order, the others strip reasoning from history.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest
from typer.testing import CliRunner

from api.cli import app as cli_app
from rollout_sim import Reply
from tests.proxy_support import Stack
from tests.support.stacks import shared_stack_as_stack  # noqa: F401  (the fixture `stack`)

Rid = Callable[[str], str]
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


def first_mismatch(parent: dict[str, Any], child: dict[str, Any]) -> int:
    """Where the child's prompt stops following the parent's prompt + generation (computed
    here from the engine's own answers, independently of the ledger)."""
    sequence = parent["prompt_token_ids"] + parent["choices"][0]["token_ids"]
    prompt = child["prompt_token_ids"]
    return next(i for i, (a, b) in enumerate(zip(sequence, prompt, strict=False)) if a != b)


def drifted_edges(stack: Stack, rollout_id: str) -> list[dict[str, Any]]:
    detail = stack.detail(rollout_id)
    assert detail is not None
    return [e for e in detail["edges"] if e["status"] == "drifted"]


def audit_show(stack: Stack, rollout_id: str, *extra: str) -> str:
    result = CliRunner().invoke(
        cli_app,
        ["audit", "show", rollout_id, "--db", stack.db_url, *extra],
        env={"COLUMNS": "400"},
    )
    assert result.exit_code == 0, result.output
    return result.output


def test_reordered_tool_arguments_are_diagnosed_as_drift(stack: Stack, rid: Rid) -> None:
    r = rid("drift")
    client = openai.OpenAI(base_url=stack.base(r) + "/v1", api_key="sk", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    stack.engine.script_tool_call("get_weather", {"city": "Paris", "days": 2})
    first = client.chat.completions.create(model="smol", messages=messages, tools=[TOOL])  # type: ignore[arg-type, list-item]
    call: Any = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.arguments == '{"city": "Paris", "days": 2}'
    # The harness parses the arguments and writes them back its own way: keys sorted in
    # reverse, no spaces.  Same call by conversation, different tokens after the template.
    rewritten = json.dumps(
        dict(sorted(json.loads(call.function.arguments).items(), reverse=True)),
        separators=(",", ":"),
    )
    assert rewritten == '{"days":2,"city":"Paris"}'
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": rewritten},
                }
            ],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18C"})
    stack.engine.script("It is 18C.")
    client.chat.completions.create(model="smol", messages=messages, tools=[TOOL])  # type: ignore[arg-type, list-item]

    expected = first_mismatch(stack.sampled[0], stack.sampled[1])
    prompt_len = len(stack.sampled[0]["prompt_token_ids"])
    assert expected > prompt_len  # inside the sampled tool call, not in the history before it
    detail = stack.detail(r)
    assert detail is not None
    first_id, second_id = (c["model_call_id"] for c in detail["calls"])
    assert detail["calls"][1]["parent_call_id"] is None  # no token parent: not extended
    [edge] = drifted_edges(stack, r)
    assert (edge["child"], edge["parent"], edge["method"]) == (second_id, first_id, "conversation")
    assert (edge["mismatch_pos"], edge["mismatch_kind"]) == (expected, "token_mismatch")
    assert edge["shared_len"] == expected

    table = audit_show(stack, r)
    assert "drifted" in table and "conversation" in table
    assert f"{expected} (token_mismatch)" in table
    shown = json.loads(audit_show(stack, r, "--json"))
    assert [e for e in shown["edges"] if e["status"] == "drifted"] == [edge]


@pytest.fixture
def thinking_stack(shared_thinking_stack: Stack) -> Stack:
    return shared_thinking_stack


def test_stripped_reasoning_is_diagnosed_as_drift(thinking_stack: Stack, rid: Rid) -> None:
    """Claude Code (like many harnesses) drops thinking from the history it sends back."""
    stack, r = thinking_stack, rid("nothink")
    client = anthropic.Anthropic(base_url=stack.base(r), api_key="sk", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Is 7 prime?"}]
    stack.engine.script(Reply("Yes.", reasoning="It has no divisors."))
    first = client.messages.create(model="smol", max_tokens=256, messages=messages)  # type: ignore[arg-type]
    assert [b.type for b in first.content] == ["thinking", "text"]
    kept = [b.model_dump(exclude_none=True) for b in first.content if b.type != "thinking"]
    messages += [{"role": "assistant", "content": kept}, {"role": "user", "content": "And 9?"}]
    stack.engine.script(Reply("No.", reasoning="3 divides 9."))
    client.messages.create(model="smol", max_tokens=256, messages=messages)  # type: ignore[arg-type]

    expected = first_mismatch(stack.sampled[0], stack.sampled[1])
    # The first generated token (<think>'s "<") is where the re-rendered history departs.
    assert expected == len(stack.sampled[0]["prompt_token_ids"])
    [edge] = drifted_edges(stack, r)
    assert (edge["mismatch_pos"], edge["mismatch_kind"]) == (expected, "token_mismatch")
    assert f"{expected} (token_mismatch)" in audit_show(stack, r)


def test_stripped_reasoning_in_a_responses_loop(thinking_stack: Stack, rid: Rid) -> None:
    stack, r = thinking_stack, rid("rsdrift")
    client = openai.OpenAI(base_url=stack.base(r) + "/v1", api_key="sk", max_retries=0)
    items: list[dict[str, Any]] = [{"role": "user", "content": "Is 7 prime?"}]
    stack.engine.script(Reply("Yes.", reasoning="It has no divisors."))
    first = client.responses.create(model="smol", input=items)  # type: ignore[arg-type]
    items += [i.model_dump(exclude_none=True) for i in first.output if i.type != "reasoning"]
    items.append({"role": "user", "content": "And 9?"})
    stack.engine.script(Reply("No.", reasoning="3 divides 9."))
    client.responses.create(model="smol", input=items)  # type: ignore[arg-type]
    expected = first_mismatch(stack.sampled[0], stack.sampled[1])
    [edge] = drifted_edges(stack, r)
    assert edge["mismatch_pos"] == expected


def test_a_faithful_echo_is_verified_not_drifted(thinking_stack: Stack, rid: Rid) -> None:
    """The control: the same loop with the reasoning kept extends the tokens."""
    stack, r = thinking_stack, rid("faithful")
    client = anthropic.Anthropic(base_url=stack.base(r), api_key="sk", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Is 7 prime?"}]
    stack.engine.script(Reply("Yes.", reasoning="It has no divisors."))
    first = client.messages.create(model="smol", max_tokens=256, messages=messages)  # type: ignore[arg-type]
    echo = [b.model_dump(exclude_none=True) for b in first.content]
    messages += [{"role": "assistant", "content": echo}, {"role": "user", "content": "And 9?"}]
    stack.engine.script(Reply("No.", reasoning="3 divides 9."))
    client.messages.create(model="smol", max_tokens=256, messages=messages)  # type: ignore[arg-type]
    detail = stack.detail(r)
    assert detail is not None
    assert [(e["method"], e["status"]) for e in detail["edges"]] == [("token_prefix", "verified")]
