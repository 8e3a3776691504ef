"""Terminal attribution (``ledger.terminal``): each witness, each abstention, the verdict.

The calls form a three-turn tool-using conversation in Responses items; each call's
``continuation_fingerprint`` is computed the way ingest computes it (request items followed by
the call's own output, ``ledger.fingerprint``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import pytest

from ledger.fingerprint import continuation_fingerprint
from ledger.model import CallView
from ledger.terminal import attribute_terminal, collapse_identical

USER = {"role": "user", "content": "What is the weather in Paris and in Rome?"}
CALL_PARIS = {
    "type": "function_call",
    "call_id": "call_paris",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
}
RESULT_PARIS = {"type": "function_call_output", "call_id": "call_paris", "output": "18C, sunny"}
CALL_ROME = {
    "type": "function_call",
    "call_id": "call_rome",
    "name": "get_weather",
    "arguments": '{"city":"Rome"}',
}
RESULT_ROME = {"type": "function_call_output", "call_id": "call_rome", "output": "24C, clear"}
FINAL = {
    "type": "message",
    "role": "assistant",
    "content": [{"type": "output_text", "text": "Paris: 18C and sunny. Rome: 24C and clear."}],
}
REASONING = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "done"}]}


def view(
    call_id: str,
    request: list[dict[str, Any]],
    output: list[dict[str, Any]],
    *,
    tokens: str | None = None,
    response_id: str | None = None,
) -> CallView:
    """A captured call; ``tokens`` names its full token sequence (same name, same tokens)."""
    sequence = (tokens or call_id).encode()
    return CallView(
        model_call_id=call_id,
        prompt_len=40,
        generation_len=10,
        cumulative_len=50,
        cumulative_digest=hashlib.sha256(sequence).hexdigest(),
        prompt_digest=hashlib.sha256(b"prompt-" + sequence).hexdigest(),
        created_at=1_700_000_000.0,
        response_id=response_id if response_id is not None else f"chatcmpl-{call_id}",
        output_items=output,
        token_item_index=len(output) - 1 if output else None,
        continuation_fingerprint=continuation_fingerprint(request, output),
    )


def conversation() -> list[CallView]:
    return [
        view("c1", [USER], [CALL_PARIS]),
        view("c2", [USER, CALL_PARIS, RESULT_PARIS], [CALL_ROME]),
        view("c3", [USER, CALL_PARIS, RESULT_PARIS, CALL_ROME, RESULT_ROME], [REASONING, FINAL]),
    ]


def attribute(result: dict[str, Any] | None, calls: list[CallView] | None = None) -> Any:
    return attribute_terminal(conversation() if calls is None else calls, result)


def reasons(attribution: Any) -> list[str]:
    return attribution.reason.split(",") if attribution.reason else []


# --------------------------------------------------------------------------------- explicit


def test_explicit_witness_names_the_call() -> None:
    got = attribute({"_ng_terminal_model_call_id": "c2"})
    assert (got.method, got.call_id, got.declared) == ("explicit", "c2", False)
    assert reasons(got) == ["no_response_object"]
    assert got.chain == ""


def test_explicit_unknown_id_abstains_and_other_witnesses_still_attribute() -> None:
    got = attribute({"_ng_terminal_model_call_id": "ghost", "response": {"id": "chatcmpl-c3"}})
    assert (got.method, got.call_id) == ("response_id", "c3")
    assert reasons(got) == ["explicit_terminal_not_captured", "response_has_no_output"]


def test_explicit_non_string_abstains() -> None:
    got = attribute({"_ng_terminal_model_call_id": 7})
    assert got.call_id is None
    assert reasons(got) == ["explicit_terminal_invalid", "no_response_object"]


# --------------------------------------------------------------------------------- declared


def test_declared_witness_is_reported_and_flagged() -> None:
    got = attribute({"terminal_response_id": "chatcmpl-c3"})
    assert (got.method, got.call_id, got.declared) == ("declared", "c3", True)


def test_declared_unmatched_attributes_nothing_even_with_other_evidence() -> None:
    result = {
        "terminal_response_id": "chatcmpl-never-served",
        "_ng_terminal_model_call_id": "c3",
        "response": {"id": "chatcmpl-c3", "output": [FINAL]},
    }
    got = attribute(result)
    assert (got.method, got.call_id, got.declared) == ("none", None, True)
    assert reasons(got) == ["declared_terminal_not_captured"]


def test_declared_ambiguous_attributes_nothing() -> None:
    calls = conversation()
    calls.append(view("c3b", [USER], [FINAL], response_id="chatcmpl-c3"))
    got = attribute({"terminal_response_id": "chatcmpl-c3"}, calls)
    assert (got.call_id, got.declared) == (None, True)
    assert reasons(got) == ["declared_ambiguous"]


def test_declared_non_string_is_a_declaration_that_cannot_match() -> None:
    got = attribute({"terminal_response_id": 42})
    assert (got.call_id, got.declared) == (None, True)
    assert reasons(got) == ["declared_terminal_invalid"]


def test_declared_matching_identical_tokens_collapses_to_the_smallest_id() -> None:
    calls = [
        view("z", [USER], [FINAL], tokens="same", response_id="r"),
        view("a", [USER], [FINAL], tokens="same", response_id="r"),
    ]
    got = attribute({"terminal_response_id": "r"}, calls)
    assert (got.method, got.call_id) == ("declared", "a")


# ------------------------------------------------------------------------------ response_id


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        ({"output": [FINAL]}, "response_has_no_id"),
        ({"id": "", "output": [FINAL]}, "response_has_no_id"),
        ({"id": 12, "output": [FINAL]}, "response_has_no_id"),
        ({"id": "resp_unknown", "output": [FINAL]}, "response_id_no_match"),
    ],
)
def test_response_id_abstentions(response: dict[str, Any], reason: str) -> None:
    got = attribute({"response": response})
    assert reasons(got)[0] == reason
    assert got.method == "content_output"  # the content witness still attributes


def test_response_id_ambiguous_abstains() -> None:
    calls = conversation()
    calls.append(view("c9", [USER], [CALL_PARIS], response_id="chatcmpl-c3"))
    got = attribute({"response": {"id": "chatcmpl-c3", "output": []}}, calls)
    assert got.call_id is None
    assert reasons(got) == ["response_id_ambiguous", "response_has_no_output"]


def test_response_id_identical_tokens_collapse() -> None:
    calls = [
        view("b", [USER], [FINAL], tokens="same", response_id="dup"),
        view("a", [USER], [FINAL], tokens="same", response_id="dup"),
    ]
    got = attribute({"response": {"id": "dup"}}, calls)
    assert (got.method, got.call_id) == ("response_id", "a")


# ---------------------------------------------------------------------------------- content


def test_content_cumulative_for_a_full_transcript() -> None:
    transcript = [USER, CALL_PARIS, RESULT_PARIS, CALL_ROME, RESULT_ROME, REASONING, FINAL]
    got = attribute({"response": {"id": "resp_x", "output": transcript}})
    assert (got.method, got.call_id) == ("content_cumulative", "c3")
    assert reasons(got) == ["response_id_no_match"]


def test_content_cumulative_survives_reserialized_tool_arguments() -> None:
    reformatted = dict(CALL_PARIS, arguments='{ "city" : "Paris" }')
    transcript = [reformatted, RESULT_PARIS, CALL_ROME, RESULT_ROME, FINAL]
    got = attribute({"response": {"output": transcript}})
    assert (got.method, got.call_id) == ("content_cumulative", "c3")


def test_content_output_for_a_final_turn_only_response() -> None:
    got = attribute({"response": {"output": [FINAL]}})
    assert (got.method, got.call_id) == ("content_output", "c3")


def test_content_output_reads_the_trailing_block_for_a_merged_transcript() -> None:
    # The harness merged a sub-agent's tool call into the transcript: the whole-transcript
    # fingerprint matches no call, its trailing model-authored block is c3's own output.
    foreign = {"type": "function_call", "call_id": "sub_1", "name": "search", "arguments": "{}"}
    merged = [foreign, {"type": "function_call_output", "call_id": "sub_1", "output": "x"}, FINAL]
    got = attribute({"response": {"output": merged}})
    assert (got.method, got.call_id) == ("content_output", "c3")


def test_content_output_trailing_block_includes_reasoning_items() -> None:
    foreign = {"type": "function_call", "call_id": "sub_1", "name": "search", "arguments": "{}"}
    merged = [foreign, RESULT_ROME, FINAL, REASONING]
    got = attribute({"response": {"output": merged}})
    assert (got.method, got.call_id) == ("content_output", "c3")


def test_content_output_trailing_block_includes_empty_assistant_messages() -> None:
    foreign = {"type": "function_call", "call_id": "sub_1", "name": "search", "arguments": "{}"}
    blank = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": ""}],
    }
    got = attribute({"response": {"output": [foreign, RESULT_ROME, FINAL, blank]}})
    assert (got.method, got.call_id) == ("content_output", "c3")


def test_trailing_block_is_skipped_when_the_transcript_ends_in_a_tool_result() -> None:
    foreign = {"type": "function_call", "call_id": "sub_1", "name": "search", "arguments": "{}"}
    pending = [foreign, RESULT_ROME, FINAL, RESULT_PARIS]
    got = attribute({"response": {"output": pending}})
    assert got.call_id is None
    assert reasons(got) == ["response_has_no_id", "no_content_match"]


def test_content_ambiguous_when_different_tokens_said_the_same() -> None:
    calls = conversation()
    calls.append(view("c3-retry", [USER], [FINAL]))
    got = attribute({"response": {"output": [FINAL]}}, calls)
    assert got.call_id is None
    assert reasons(got) == ["response_has_no_id", "content_ambiguous"]


def test_content_matches_with_identical_tokens_collapse() -> None:
    calls = [view("b", [USER], [FINAL], tokens="same"), view("a", [USER], [FINAL], tokens="same")]
    got = attribute({"response": {"output": [FINAL]}}, calls)
    assert (got.method, got.call_id) == ("content_cumulative", "a")


@pytest.mark.parametrize(
    ("output", "reason"),
    [
        ([], "response_has_no_output"),
        (None, "response_has_no_output"),
        ([RESULT_PARIS, USER], "no_model_authored_output"),
        ([FINAL, "not an item"], "response_output_unfingerprintable"),
    ],
)
def test_content_abstentions(output: Any, reason: str) -> None:
    got = attribute({"response": {"output": output}})
    assert got.call_id is None
    assert reasons(got) == ["response_has_no_id", reason]


def test_unreadable_stored_output_testifies_to_nothing() -> None:
    calls = conversation()
    unreadable: list[Any] = ["not an item"]
    broken = dataclasses.replace(
        calls[0], model_call_id="bad", output_items=unreadable, continuation_fingerprint=""
    )
    got = attribute({"response": {"output": [FINAL]}}, [*calls, broken])
    assert (got.method, got.call_id) == ("content_output", "c3")
    assert reasons(got) == ["response_has_no_id"]


def test_no_response_object() -> None:
    for result in (None, {}, {"response": "just text"}):
        got = attribute(result)
        assert (got.method, got.call_id) == ("none", None)
        assert reasons(got) == ["no_response_object"]


# ---------------------------------------------------------------------------------- verdict


def test_agreeing_witnesses_report_the_first_and_corroborate() -> None:
    result = {
        "_ng_terminal_model_call_id": "c3",
        "terminal_response_id": "chatcmpl-c3",
        "response": {"id": "chatcmpl-c3", "output": [FINAL]},
    }
    got = attribute(result)
    assert (got.method, got.call_id, got.declared) == ("explicit", "c3", True)
    assert reasons(got) == ["corroborated_by=declared+response_id+content_output"]


def test_witnesses_naming_identical_tokens_agree() -> None:
    calls = [view("a", [USER], [FINAL], tokens="same"), view("b", [USER], [FINAL], tokens="same")]
    got = attribute({"_ng_terminal_model_call_id": "b", "response": {"id": "chatcmpl-a"}}, calls)
    # They agree; the first witness names the call, as in NeMo Gym 0.7.0: the explicit id is
    # the attempt the harness kept, so its log-probs are the ones delivered.
    assert (got.method, got.call_id) == ("explicit", "b")
    assert "corroborated_by=response_id" in reasons(got)


def test_witness_disagreement_attributes_nothing_and_keeps_the_trail() -> None:
    result = {
        "_ng_terminal_model_call_id": "c1",
        "response": {"id": "chatcmpl-c2", "output": [FINAL]},
    }
    got = attribute(result)
    assert (got.method, got.call_id, got.declared) == ("none", None, False)
    assert reasons(got) == ["witness_disagreement[explicit=c1;response_id=c2;content_output=c3]"]
    assert got.as_metrics() == {
        "method": "none",
        "call_id": None,
        "reason": "witness_disagreement[explicit=c1;response_id=c2;content_output=c3]",
        "chain": "",
    }


def test_attribution_ignores_input_order() -> None:
    calls = conversation()
    result = {"response": {"id": "x", "output": [FINAL]}}
    assert attribute(result, calls) == attribute(result, calls[::-1])


def test_collapse_identical() -> None:
    a, b = view("a", [USER], [FINAL], tokens="t"), view("b", [USER], [FINAL], tokens="t")
    c = view("c", [USER], [FINAL], tokens="other")
    assert collapse_identical([]) is None
    assert collapse_identical([b, a]) is a
    assert collapse_identical([a, c]) is None
