"""Model-authored fingerprints: one conversation, any dialect, one fingerprint; a call's
continuation fingerprint equals the next request's fingerprint whatever the harness speaks.

The continuation tests run the real translators: the proxy records the chat answer as the
call's output item, the harness receives it in its own dialect and echoes it back.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import pytest

from api.dialects import chat_to_anthropic_message, chat_to_responses_response
from api.extract import strip_chat_response
from ledger.fingerprint import (
    FINGERPRINT_VERSION,
    canonical_arguments,
    continuation_fingerprint,
    model_authored_contributions,
    model_authored_fingerprint,
)
from tests.support.vllm import vllm_chat_answer


def chat_conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "List files"},
        {
            "role": "assistant",
            "content": "Running ls.",
            "reasoning_content": "I should run ls",
            "tool_calls": [
                {
                    "id": "toolu_01",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command": "ls", "timeout": 5}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_01", "content": "a.txt\nb.txt"},
        {"role": "user", "content": "<system-reminder>be brief</system-reminder>"},
        {"role": "assistant", "content": "Two files."},
    ]


def anthropic_conversation() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": [{"type": "text", "text": "List files"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should run ls", "signature": "EqQB"},
                {"type": "text", "text": "Running ls."},
                {
                    "type": "tool_use",
                    "id": "toolu_01",
                    "name": "Bash",
                    "input": {"timeout": 5, "command": "ls"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "a.txt\nb.txt"},
                {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
            ],
        },
        {"role": "assistant", "content": "Two files."},
    ]


def responses_conversation() -> list[dict[str, Any]]:
    return [
        {"type": "message", "role": "developer", "content": "You are Codex."},
        {"role": "user", "content": [{"type": "input_text", "text": "List files"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "x"}]},
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Running ls.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "toolu_01",
            "name": "Bash",
            "arguments": '{"timeout":5,"command":"ls"}',
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "toolu_01", "output": "different output"},
        {"role": "user", "content": "<system-reminder>be brief</system-reminder>"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Two files."}],
        },
    ]


def test_same_conversation_in_every_dialect_has_one_fingerprint() -> None:
    chat = model_authored_fingerprint(chat_conversation())
    assert len(chat) == 64 and int(chat, 16) >= 0
    assert model_authored_fingerprint(anthropic_conversation()) == chat
    assert model_authored_fingerprint(responses_conversation()) == chat


def test_golden_value_pins_the_version_1_encoding() -> None:
    assert FINGERPRINT_VERSION == 1
    items = [{"role": "assistant", "content": "hi"}]
    # domain, version byte, then tag "T" and the text length-prefixed (8 bytes, big-endian)
    by_hand = b"rollout-ledger/model-authored-fingerprint" + b"\x01" + b"T" + (2).to_bytes(8, "big")
    assert hashlib.sha256(by_hand + b"hi").hexdigest() == (
        "2e721396f96866578c3ed4adecc6cd50f2819a04c60c67b3e97de853be8d9344"
    )
    assert model_authored_fingerprint(items) == hashlib.sha256(by_hand + b"hi").hexdigest()


def test_only_model_authored_turns_count() -> None:
    base = model_authored_fingerprint(chat_conversation())
    edited = chat_conversation()
    edited[0]["content"] = "Another system prompt"
    edited[1]["content"] = "List all files"
    edited[3]["content"] = "truncated"
    edited[2]["reasoning_content"] = "different reasoning"
    assert model_authored_fingerprint(edited) == base

    assert model_authored_fingerprint([{"role": "user", "content": "hi"}]) == ""
    assert model_authored_fingerprint([]) == ""
    reasoning_only: list[dict[str, Any]] = [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""}]},
        {"role": "assistant", "content": "  \n"},
        {"role": "assistant", "content": None},
    ]
    assert model_authored_fingerprint(reasoning_only) == ""


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c[5].update(content="Three files."),
        lambda c: c[2].update(content="Running ls -la."),
        lambda c: c[2]["tool_calls"][0].update(id="toolu_02"),
        lambda c: c[2]["tool_calls"][0]["function"].update(name="Shell"),
        lambda c: c[2]["tool_calls"][0]["function"].update(
            arguments='{"command": "ls -la", "timeout": 5}'
        ),
        lambda c: c.pop(5),
    ],
)
def test_any_model_authored_change_changes_the_fingerprint(edit: Any) -> None:
    edited = chat_conversation()
    edit(edited)
    assert model_authored_fingerprint(edited) != model_authored_fingerprint(chat_conversation())


def test_fields_are_length_prefixed_and_order_matters() -> None:
    def texts(*contents: str) -> str:
        return model_authored_fingerprint([{"role": "assistant", "content": c} for c in contents])

    assert texts("ab", "c") != texts("a", "bc")
    assert texts("a", "b") != texts("b", "a")
    assert texts("ab") != texts("a", "b")


def test_message_boundaries_do_not_count() -> None:
    one_message = [
        {
            "role": "assistant",
            "content": "Calling.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        }
    ]
    split_items: list[dict[str, Any]] = [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Calling."}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": ""},
    ]
    assert model_authored_fingerprint(one_message) == model_authored_fingerprint(split_items)


@pytest.mark.parametrize(
    ("arguments", "canonical"),
    [
        ('{"b": 1, "a": [1, 2]}', '{"a":[1,2],"b":1}'),
        ({"b": 1, "a": [1, 2]}, '{"a":[1,2],"b":1}'),
        ('{"city": "Zürich"}', '{"city":"Zürich"}'),
        ("  not json  ", "not json"),
        ("", "{}"),
        (None, "{}"),
        ({}, "{}"),
        ("5", "5"),
    ],
)
def test_canonical_arguments(arguments: Any, canonical: str) -> None:
    assert canonical_arguments(arguments) == canonical


def test_namespaced_and_freeform_tool_calls_match_their_chat_bridge_form() -> None:
    def call(name: str, arguments: str) -> list[dict[str, Any]]:
        function = {"name": name, "arguments": arguments}
        return [{"role": "assistant", "tool_calls": [{"id": "c", "function": function}]}]

    namespaced = [
        {
            "type": "function_call",
            "call_id": "c",
            "namespace": "crm",
            "name": "lookup",
            "arguments": "{}",
        }
    ]
    assert model_authored_fingerprint(namespaced) == model_authored_fingerprint(
        call("crm__lookup", "{}")
    )
    custom = [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": "*** P"}]
    assert model_authored_fingerprint(custom) == model_authored_fingerprint(
        call("apply_patch", '{"input": "*** P"}')
    )


def test_other_parts_contribute_canonical_json() -> None:
    items = [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]
    assert model_authored_contributions(items) == [("J", '{"refusal":"no","type":"refusal"}')]


@pytest.mark.parametrize(
    "items",
    [
        ["not an object"],
        [{"role": "assistant", "content": [3]}],
        [{"role": "assistant", "tool_calls": ["x"]}],
    ],
)
def test_items_that_are_not_objects_are_type_errors(items: list[Any]) -> None:
    with pytest.raises(TypeError):
        model_authored_fingerprint(items)


# --------------------------------------------------------------------------- continuation


def vllm_answer(content: str, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    return vllm_chat_answer(
        content,
        [],
        tool_calls=tool_calls,
        reasoning="plan",
        finish_reason="tool_calls",
        prompt_ids=[1, 2, 3],
        answer_id="chatcmpl-77",
    )


ANSWER_CALL = {
    "id": "chatcmpl-tool-9f",
    "type": "function",
    "function": {"name": "Bash", "arguments": '{"command": "cat a.txt"}'},
}


def test_continuation_equals_the_next_request_in_every_dialect() -> None:
    answer = strip_chat_response(vllm_answer("Reading a.txt.", [ANSWER_CALL]))
    recorded_output = answer.output_items

    chat_request = chat_conversation()
    expected = continuation_fingerprint(chat_request, recorded_output)
    assert expected != model_authored_fingerprint(chat_request)

    echoed = {key: value for key, value in recorded_output[0].items() if key != "type"}
    chat_next = [
        *chat_request,
        copy.deepcopy(echoed),
        {"role": "tool", "tool_call_id": "chatcmpl-tool-9f", "content": "hello"},
    ]
    assert model_authored_fingerprint(chat_next) == expected

    anthropic_reply = chat_to_anthropic_message(answer.harness_body)
    anthropic_next = [
        *anthropic_conversation(),
        {"role": "assistant", "content": anthropic_reply["content"]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "chatcmpl-tool-9f", "content": "hi"}
            ],
        },
    ]
    assert continuation_fingerprint(anthropic_conversation(), recorded_output) == expected
    assert model_authored_fingerprint(anthropic_next) == expected

    responses_reply = chat_to_responses_response(answer.harness_body, request={})
    responses_next = [
        *responses_conversation(),
        *responses_reply["output"],
        {"type": "function_call_output", "call_id": "chatcmpl-tool-9f", "output": "hi"},
    ]
    assert model_authored_fingerprint(responses_next) == expected


def test_continuation_of_a_call_without_output_is_the_request_fingerprint() -> None:
    request = chat_conversation()
    assert continuation_fingerprint(request, []) == model_authored_fingerprint(request)
    assert continuation_fingerprint([], []) == ""
