"""OpenAI Responses <-> chat translation, and OpenAI-dialect errors.

Request bodies follow what Codex CLI sends (wire-formats §4.3); answers are vLLM 0.32 chat
completions (§1.2) and are validated with the OpenAI SDK's ``Response`` type.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import Response
from pydantic import TypeAdapter

from api.dialects import (
    Dialect,
    InvalidRequest,
    UnsupportedRequest,
    build_responses_upstream,
    chat_to_responses_response,
    parse_upstream_error,
    request_error_reply,
    responses_to_chat_request,
    transport_error_reply,
    upstream_error_reply,
)
from api.dialects.responses import ToolOrigin, tool_origins
from api.extract import strip_chat_response
from tests.support.vllm import vllm_chat_answer

CHAT_MESSAGES = TypeAdapter(list[ChatCompletionMessageParam])
PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28]

SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"],
    },
}
PATCH_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}
NAMESPACE_TOOL = {
    "type": "namespace",
    "name": "crm",
    "description": "CRM tools",
    "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}],
}


def codex_body() -> dict[str, Any]:
    """A second Codex turn: history replayed verbatim, the 12 top-level fields of §4.3."""
    return {
        "model": "gpt-5-codex",
        "instructions": "You are Codex.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "<permissions>never</permissions>"}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "list the repo"}],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Use ls."}],
                "encrypted_content": None,
            },
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Listing.", "annotations": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "chatcmpl-tool-aa",
                "name": "shell",
                "arguments": '{"command":["ls"]}',
            },
            {"type": "function_call_output", "call_id": "chatcmpl-tool-aa", "output": "README.md"},
        ],
        "tools": [SHELL_TOOL, {"type": "web_search"}, PATCH_TOOL, NAMESPACE_TOOL],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "session-1",
        "client_metadata": {"x": "y"},
    }


# A vLLM 0.32 chat completion (§1.2) with inline ids and token_id log-probs.
vllm_chat = functools.partial(
    vllm_chat_answer,
    prompt_ids=PROMPT_IDS,
    log_probs=-0.5,
    answer_id="chatcmpl-9ac3b2",
    prompt_tokens_details={"cached_tokens": 8},
    completion_tokens_details={"reasoning_tokens": 3},
)


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def harness_response(completion: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    return chat_to_responses_response(strip_chat_response(completion).harness_body, request=request)


# --------------------------------------------------------------------------- request


def test_codex_turn_translates_to_chat_messages() -> None:
    chat = responses_to_chat_request(codex_body())
    assert chat["messages"] == [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "<permissions>never</permissions>"},
        {"role": "user", "content": "list the repo"},
        {
            "role": "assistant",
            "content": "Listing.",
            "tool_calls": [tool_call("chatcmpl-tool-aa", "shell", '{"command":["ls"]}')],
            "reasoning_content": "Use ls.",
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-aa", "content": "README.md"},
    ]
    CHAT_MESSAGES.validate_python(chat["messages"])
    assert chat["model"] == "gpt-5-codex"
    assert chat["tool_choice"] == "auto"
    assert chat["parallel_tool_calls"] is False
    for dropped in (
        "reasoning",
        "store",
        "include",
        "prompt_cache_key",
        "client_metadata",
        "stream",
    ):
        assert dropped not in chat


def test_tools_flatten_namespaces_bridge_custom_tools_and_drop_hosted_ones() -> None:
    tools = responses_to_chat_request(codex_body())["tools"]
    assert [t["function"]["name"] for t in tools] == ["shell", "apply_patch", "crm__lookup"]
    shell, patch, lookup = (t["function"] for t in tools)
    assert shell == {
        "name": "shell",
        "description": "Runs a shell command",
        "parameters": SHELL_TOOL["parameters"],
        "strict": False,
    }
    assert patch["parameters"] == {
        "type": "object",
        "properties": {"input": {"type": "string"}},
        "required": ["input"],
    }
    assert patch["description"].startswith("Apply a patch")
    assert '"*** Begin Patch"' in patch["description"]  # the grammar reaches the model
    assert lookup["parameters"] == {"type": "object"}
    assert tool_origins(codex_body()["tools"]) == {
        "shell": ToolOrigin("shell"),
        "apply_patch": ToolOrigin("apply_patch", custom=True),
        "crm__lookup": ToolOrigin("lookup", "crm"),
    }


def test_consecutive_model_items_fold_into_turns_in_order() -> None:
    body = {
        "model": "m",
        "input": [
            {"role": "user", "content": "go"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}]},
            {"type": "function_call", "call_id": "a", "name": "shell", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "shell", "arguments": ""},
            {"type": "function_call_output", "call_id": "a", "output": "1"},
            {"type": "function_call_output", "call_id": "b", "output": "2"},
            {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},  # no text: skipped
            {"role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
            {"type": "function_call", "call_id": "c", "name": "shell", "arguments": "{}"},
            {"role": "assistant", "content": "After the call."},
            {"type": "custom_tool_call", "call_id": "d", "name": "apply_patch", "input": "*** P"},
            {"type": "custom_tool_call_output", "call_id": "d", "output": "ok"},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r1"}]},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r2"}]},
            {"role": "assistant", "content": "Final."},
        ],
    }
    assert responses_to_chat_request(body)["messages"] == [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [tool_call("a", "shell", "{}"), tool_call("b", "shell", "{}")],
            "reasoning_content": "plan",
        },
        {"role": "tool", "tool_call_id": "a", "content": "1"},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "assistant", "content": "Done.", "tool_calls": [tool_call("c", "shell", "{}")]},
        {
            "role": "assistant",
            "content": "After the call.",
            "tool_calls": [tool_call("d", "apply_patch", '{"input": "*** P"}')],
        },
        {"role": "tool", "tool_call_id": "d", "content": "ok"},
        {"role": "assistant", "content": "Final.", "reasoning_content": "r1\nr2"},
    ]


def test_string_input_images_and_tool_output_parts() -> None:
    assert responses_to_chat_request({"model": "m", "input": "hi"})["messages"] == [
        {"role": "user", "content": "hi"}
    ]
    body = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look"},
                    {"type": "input_image", "image_url": "https://x.test/a.png", "detail": "low"},
                ],
            },
            {"type": "function_call", "call_id": "s", "name": "screenshot", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "s",
                "output": [
                    {"type": "input_text", "text": "taken"},
                    {"type": "input_image", "image_url": "data:image/png;base64,QQ"},
                ],
            },
            {"role": "user", "content": "and now?"},
        ],
    }
    messages = responses_to_chat_request(body)["messages"]
    assert messages[0]["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "https://x.test/a.png", "detail": "low"}},
    ]
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "s", "content": "taken"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,QQ"}}],
        },
        {"role": "user", "content": "and now?"},
    ]
    CHAT_MESSAGES.validate_python(messages)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("previous_response_id", "resp_123"),
        ("conversation", "conv_1"),
        ("prompt", {"id": "pmpt_1"}),
        ("background", True),
    ],
)
def test_server_side_state_is_refused_with_a_clear_message(field: str, value: Any) -> None:
    body = {"model": "m", "input": "hi", field: value}
    with pytest.raises(UnsupportedRequest) as caught:
        responses_to_chat_request(body)
    assert caught.value.param == field
    assert f"`{field}`" in caught.value.message
    if field != "background":
        assert "send the whole conversation in `input`" in caught.value.message


@pytest.mark.parametrize(
    ("item", "error", "match"),
    [
        ({"type": "item_reference", "id": "msg_1"}, UnsupportedRequest, "item_reference"),
        ({"type": "local_shell_call", "call_id": "x"}, UnsupportedRequest, "local_shell_call"),
        (
            {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
            UnsupportedRequest,
            "input_file",
        ),
        ({"role": "tool", "content": "x"}, InvalidRequest, "role"),
        ({"type": "function_call", "name": "shell"}, InvalidRequest, "call_id"),
        ("just a string", InvalidRequest, "object"),
    ],
)
def test_untranslatable_input_items_are_refused(
    item: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        responses_to_chat_request({"model": "m", "input": [item]})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ({"format": {"type": "text"}}, None),
        ({"format": {"type": "json_object"}}, {"type": "json_object"}),
        (
            {
                "format": {
                    "type": "json_schema",
                    "name": "out",
                    "schema": {"type": "object"},
                    "strict": True,
                }
            },
            {
                "type": "json_schema",
                "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
            },
        ),
    ],
)
def test_text_format_maps_to_response_format(text: Any, expected: Any) -> None:
    chat = responses_to_chat_request({"model": "m", "input": "hi", "text": text})
    assert chat.get("response_format") == expected


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("required", "required"),
        ("none", "none"),
        (
            {"type": "function", "name": "shell"},
            {"type": "function", "function": {"name": "shell"}},
        ),
        (
            {"type": "custom", "name": "apply_patch"},
            {"type": "function", "function": {"name": "apply_patch"}},
        ),
        (
            {"type": "function", "name": "lookup", "namespace": "crm"},
            {"type": "function", "function": {"name": "crm__lookup"}},
        ),
    ],
)
def test_tool_choice_mapping(choice: Any, expected: Any) -> None:
    body = codex_body()
    body["tool_choice"] = choice
    assert responses_to_chat_request(body).get("tool_choice") == expected


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "name": "unknown"},
        {"type": "allowed_tools", "mode": "auto", "tools": []},
    ],
)
def test_tool_choice_that_cannot_be_honoured_is_refused(choice: Any) -> None:
    """Issue 11: dropping it would let the model call what the harness did not allow."""
    body = codex_body()
    body["tool_choice"] = choice
    with pytest.raises(UnsupportedRequest) as caught:
        build_responses_upstream(body)
    assert caught.value.param == "tool_choice"


def test_max_output_tokens_sampling_and_no_tools_means_no_parallel_flag() -> None:
    body = {
        "model": "m",
        "input": "hi",
        "max_output_tokens": 64,
        "temperature": 0.3,
        "top_p": 0.8,
        "parallel_tool_calls": True,
        "tools": [{"type": "web_search"}],
    }
    chat = responses_to_chat_request(body)
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"]) == (64, 0.3, 0.8)
    assert "tools" not in chat and "parallel_tool_calls" not in chat and "tool_choice" not in chat


def test_upstream_request_has_capture_fields_and_overrides_win() -> None:
    body = codex_body()
    body["temperature"] = 0.1
    original = copy.deepcopy(body)
    upstream = build_responses_upstream(body, sampling_overrides={"temperature": 1.0})
    assert body == original
    assert upstream.dialect is Dialect.RESPONSES
    assert upstream.stream is True
    assert upstream.body["temperature"] == 1.0
    assert upstream.body["return_token_ids"] is True
    assert upstream.body["include_reasoning"] is True
    assert "stream" not in upstream.body


# --------------------------------------------------------------------------- response


def test_answer_becomes_a_valid_response_with_reasoning_message_and_calls() -> None:
    request = codex_body()
    completion = vllm_chat(
        "Reading the README.",
        [40, 11, 5, 2],
        finish_reason="tool_calls",
        reasoning="Need contents.",
        tool_calls=[
            tool_call("chatcmpl-tool-bb", "shell", '{"command":["cat","README.md"]}'),
            tool_call("chatcmpl-tool-cc", "apply_patch", '{"input": "*** Begin Patch"}'),
            tool_call("chatcmpl-tool-dd", "crm__lookup", '{"id": 7}'),
        ],
    )
    response = harness_response(completion, request)
    parsed = Response.model_validate(response)

    assert parsed.id == "chatcmpl-9ac3b2"  # the upstream id, unchanged
    assert parsed.status == "completed" and parsed.incomplete_details is None
    assert [item.type for item in parsed.output] == [
        "reasoning",
        "message",
        "function_call",
        "custom_tool_call",
        "function_call",
    ]
    reasoning, message, shell, patch, lookup = response["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Need contents."}]
    assert message["content"][0]["text"] == "Reading the README."
    assert (shell["call_id"], shell["name"], shell["arguments"]) == (
        "chatcmpl-tool-bb",
        "shell",
        '{"command":["cat","README.md"]}',
    )
    assert (patch["name"], patch["input"], patch["call_id"]) == (
        "apply_patch",
        "*** Begin Patch",
        "chatcmpl-tool-cc",
    )
    assert (lookup["name"], lookup["namespace"]) == ("lookup", "crm")
    assert len({item["id"] for item in response["output"]}) == 5
    assert parsed.usage is not None
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens, parsed.usage.total_tokens) == (
        len(PROMPT_IDS),
        4,
        len(PROMPT_IDS) + 4,
    )
    assert parsed.usage.input_tokens_details.cached_tokens == 8
    assert parsed.usage.output_tokens_details.reasoning_tokens == 3
    assert (parsed.parallel_tool_calls, parsed.tool_choice) == (False, "auto")
    text = json.dumps(response)
    for token_field in ("token_ids", "prompt_token_ids", "token_id:", "generation_log_probs"):
        assert token_field not in text


def test_length_finish_is_incomplete_with_max_output_tokens() -> None:
    response = harness_response(
        vllm_chat("Awesome! I'm glad you", [49, 103], finish_reason="length"), {}
    )
    parsed = Response.model_validate(response)
    assert parsed.status == "incomplete"
    assert parsed.incomplete_details is not None
    assert parsed.incomplete_details.reason == "max_output_tokens"
    assert response["output"][0]["status"] == "incomplete"


def test_tool_call_without_text_has_no_message_item_and_empty_answer_has_one() -> None:
    only_call = harness_response(
        vllm_chat("", [5], finish_reason="tool_calls", tool_calls=[tool_call("c", "shell", "{}")]),
        {"tools": [SHELL_TOOL]},
    )
    assert [item["type"] for item in only_call["output"]] == ["function_call"]
    empty = harness_response(vllm_chat(None, [2]), {})
    assert [item["type"] for item in empty["output"]] == ["message"]
    assert empty["output"][0]["content"][0]["text"] == ""
    Response.model_validate(only_call)
    Response.model_validate(empty)


def test_output_echoed_back_as_input_rebuilds_the_same_assistant_turn() -> None:
    """Codex replays output items verbatim; the next prompt must hold the same turn."""
    request = codex_body()
    calls = [tool_call("chatcmpl-tool-bb", "shell", '{"command":["ls"]}')]
    completion = vllm_chat("Checking.", [1, 2], tool_calls=calls, reasoning="think")
    response = harness_response(completion, request)
    follow_up = {"model": "m", "input": [*response["output"]], "tools": request["tools"]}
    (assistant,) = responses_to_chat_request(follow_up)["messages"]
    assert assistant == {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": calls,
        "reasoning_content": "think",
    }


# --------------------------------------------------------------------------- errors

OVERFLOW = {
    "error": {
        "message": "This model's maximum context length is 2048 tokens. However, your prompt "
        "contains at least 2049 input tokens, which exceeds this limit even without any "
        "output tokens. Please reduce the length of the input prompt. "
        "(parameter=input_tokens, value=2049)",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
}


@pytest.mark.parametrize("dialect", [Dialect.CHAT, Dialect.COMPLETIONS, Dialect.RESPONSES])
def test_context_overflow_gets_the_openai_code_and_keeps_the_message(dialect: Dialect) -> None:
    error = parse_upstream_error(400, json.dumps(OVERFLOW))
    reply = upstream_error_reply(dialect, error)
    assert reply.status == 400
    assert reply.body == {
        "error": {
            "message": OVERFLOW["error"]["message"],
            "type": "invalid_request_error",
            "param": "input_tokens",
            "code": "context_length_exceeded",
        }
    }
    assert reply.failure_code == "context_length_exceeded"


def test_old_flat_envelope_overflow_is_classified_too() -> None:
    flat = {
        "object": "error",
        "message": "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's "
        "maximum context length is 4096 tokens and your request has 2778 input tokens "
        "(8000 > 4096 - 2778).",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    reply = upstream_error_reply(Dialect.CHAT, parse_upstream_error(400, flat))
    assert reply.body["error"]["code"] == "context_length_exceeded"
    assert reply.body["error"]["message"] == flat["message"]


@pytest.mark.parametrize(
    ("status", "body", "kind", "failure"),
    [
        (
            400,
            {
                "error": {
                    "message": "temperature must be >= 0",
                    "type": "BadRequestError",
                    "param": "temperature",
                    "code": 400,
                }
            },
            "invalid_request_error",
            "invalid_prompt",
        ),
        (
            404,
            {
                "error": {
                    "message": "The model `x` does not exist.",
                    "type": "NotFoundError",
                    "code": 404,
                }
            },
            "not_found_error",
            "invalid_prompt",
        ),
        (
            429,
            {"error": {"message": "slow", "code": "rate_limit_exceeded"}},
            "rate_limit_error",
            "rate_limit_exceeded",
        ),
        (500, b"Internal Server Error", "server_error", "server_error"),
        (200, {"error": {"message": "odd"}}, "server_error", "server_error"),
    ],
)
def test_other_errors_keep_wording_in_the_nested_envelope(
    status: int, body: Any, kind: str, failure: str
) -> None:
    error = parse_upstream_error(status, body)
    reply = upstream_error_reply(Dialect.RESPONSES, error)
    assert reply.status == (status if status >= 400 else 502)
    assert reply.body["error"]["type"] == kind
    assert reply.body["error"]["message"] == error.message
    assert reply.failure_code == failure
    code = body["error"].get("code") if isinstance(body, dict) else None
    assert reply.body["error"]["code"] == (code if isinstance(code, str) else None)
    if status == 400:
        assert reply.body["error"]["param"] == "temperature"


def test_transport_and_request_errors_in_openai_shape() -> None:
    timeout = transport_error_reply(Dialect.CHAT, timeout=True, detail="ReadTimeout")
    assert timeout.status == 504
    assert timeout.body["error"]["code"] == "upstream_timeout"
    down = transport_error_reply(Dialect.RESPONSES, timeout=False, detail="refused")
    assert (down.status, down.body["error"]["code"], down.failure_code) == (
        502,
        "upstream_unavailable",
        "server_error",
    )
    refused = request_error_reply(
        Dialect.RESPONSES,
        UnsupportedRequest("`previous_response_id` ...", param="previous_response_id"),
    )
    assert refused.status == 400
    assert refused.body["error"] == {
        "message": "`previous_response_id` ...",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": None,
    }
