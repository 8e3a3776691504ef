"""Anthropic Messages <-> chat translation, count_tokens, and Anthropic-dialect errors.

Bodies follow wire-formats §4.1 (a Claude Code turn) and §1.2 (vLLM 0.32 chat answers with
real SmolLM2 token ids).  Outputs are validated with the Anthropic SDK's own types, and the
translated chat requests with the OpenAI SDK's request types.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import pytest
from anthropic.types import Message
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from pydantic import TypeAdapter

from api.dialects import (
    Dialect,
    InvalidRequest,
    UnsupportedRequest,
    anthropic_count_tokens_response,
    anthropic_count_tokens_tokenize_body,
    anthropic_to_chat_request,
    build_anthropic_upstream,
    chat_to_anthropic_message,
    parse_upstream_error,
    request_error_reply,
    transport_error_reply,
    upstream_error_reply,
)
from api.dialects.errors import ContextOverflow, anthropic_overflow_message
from api.extract import strip_chat_response
from tests.support.vllm import vllm_chat_answer

PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28]
PROMPT_IDS += [7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 36218, 15876, 281, 1296]
PROMPT_IDS += [1924, 30, 2, 198, 1, 520, 9531, 198]

CHAT_MESSAGES = TypeAdapter(list[ChatCompletionMessageParam])
CHAT_TOOLS = TypeAdapter(list[ChatCompletionToolParam])


def claude_code_body() -> dict[str, Any]:
    """The §4.1 request: system blocks, thinking, a tool round trip, a system reminder."""
    return {
        "model": "claude-sonnet-4-6",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}
        ],
        "metadata": {"user_id": "user_abc"},
        "thinking": {"type": "enabled", "budget_tokens": 8000},
        "tools": [
            {
                "name": "Bash",
                "description": "Run a shell command",
                "input_schema": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"],
                },
            }
        ],
        "tool_choice": {"type": "auto"},
        "messages": [
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
                        "input": {"command": "ls"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": "a.txt\nb.txt",
                        "is_error": False,
                    },
                    {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
                ],
            },
        ],
    }


# A vLLM 0.32 chat completion as §1.2 shows it (return_token_ids + token_id logprobs).
vllm_chat = functools.partial(vllm_chat_answer, prompt_ids=PROMPT_IDS)


def harness_message(completion: dict[str, Any]) -> dict[str, Any]:
    """What the proxy answers Claude Code with: strip, then translate."""
    return chat_to_anthropic_message(strip_chat_response(completion).harness_body)


# --------------------------------------------------------------------------- request


def test_claude_code_turn_translates_to_chat_messages_in_template_order() -> None:
    chat = anthropic_to_chat_request(claude_code_body())

    assert chat["messages"] == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "List files"},
        {
            "role": "assistant",
            "content": "Running ls.",
            "tool_calls": [
                {
                    "id": "toolu_01",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
                }
            ],
            "reasoning_content": "I should run ls",
        },
        {"role": "tool", "tool_call_id": "toolu_01", "content": "a.txt\nb.txt"},
        {"role": "user", "content": "<system-reminder>be brief</system-reminder>"},
    ]
    CHAT_MESSAGES.validate_python(chat["messages"])


def test_tools_choice_and_sampling_fields_map_and_anthropic_only_fields_drop() -> None:
    body = claude_code_body()
    body.update(temperature=0.7, top_p=0.9, top_k=40, stop_sequences=["\nHuman:"])
    chat = anthropic_to_chat_request(body)

    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "Bash",
                "parameters": body["tools"][0]["input_schema"],
                "description": "Run a shell command",
            },
        }
    ]
    CHAT_TOOLS.validate_python(chat["tools"])
    assert chat["tool_choice"] == "auto"
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"], chat["top_k"]) == (
        32000,
        0.7,
        0.9,
        40,
    )
    assert chat["stop"] == ["\nHuman:"]
    for dropped in ("metadata", "thinking", "system", "stream", "stop_sequences"):
        assert dropped not in chat


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, {"tool_choice": "auto"}),
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "none"}, {"tool_choice": "none"}),
        (
            {"type": "tool", "name": "Bash"},
            {"tool_choice": {"type": "function", "function": {"name": "Bash"}}},
        ),
        (
            {"type": "auto", "disable_parallel_tool_use": True},
            {"tool_choice": "auto", "parallel_tool_calls": False},
        ),
    ],
)
def test_tool_choice_mapping(choice: dict[str, Any], expected: dict[str, Any]) -> None:
    body = claude_code_body()
    body["tool_choice"] = choice
    chat = anthropic_to_chat_request(body)
    assert {k: chat[k] for k in expected} == expected
    if "parallel_tool_calls" not in expected:
        assert "parallel_tool_calls" not in chat


def test_server_tools_are_dropped_and_no_tools_means_no_tool_choice() -> None:
    body = claude_code_body()
    body["tools"] = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    chat = anthropic_to_chat_request(body)
    assert "tools" not in chat
    assert "tool_choice" not in chat


def test_system_string_and_multiple_blocks() -> None:
    body = claude_code_body()
    body["system"] = "Be terse."
    assert anthropic_to_chat_request(body)["messages"][0] == {
        "role": "system",
        "content": "Be terse.",
    }
    body["system"] = [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]
    assert anthropic_to_chat_request(body)["messages"][0] == {
        "role": "system",
        "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
    }
    body.pop("system")
    assert anthropic_to_chat_request(body)["messages"][0]["role"] == "user"


def test_images_base64_and_url_become_image_url_parts() -> None:
    body = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"},
                    },
                    {"type": "image", "source": {"type": "url", "url": "https://x.test/a.jpg"}},
                    {"type": "text", "text": "What is shown?"},
                ],
            }
        ],
    }
    (user,) = anthropic_to_chat_request(body)["messages"]
    assert user == {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
            {"type": "image_url", "image_url": {"url": "https://x.test/a.jpg"}},
            {"type": "text", "text": "What is shown?"},
        ],
    }
    CHAT_MESSAGES.validate_python([user])


def test_tool_result_blocks_error_flag_and_images() -> None:
    body = {
        "model": "m",
        "messages": [
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"p": "a"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "Shot", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "<tool_use_error>no such file"}],
                        "is_error": True,
                    },
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [
                            {"type": "text", "text": "screenshot taken"},
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "QQ",
                                },
                            },
                        ],
                    },
                ],
            },
        ],
    }
    messages = anthropic_to_chat_request(body)["messages"]
    assert messages[0]["content"] is None
    assert [c["function"]["arguments"] for c in messages[0]["tool_calls"]] == ['{"p": "a"}', "{}"]
    assert messages[1:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "<tool_use_error>no such file"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "screenshot taken"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,QQ"}}],
        },
    ]
    CHAT_MESSAGES.validate_python(messages)


def test_nonstandard_roles_map_to_user_and_redacted_thinking_is_dropped() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "ctx", "content": "context"},
            {"role": "msg", "content": [{"type": "text", "text": "hello"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "thinking", "thinking": "", "signature": ""},
                    {"type": "text", "text": "hi"},
                ],
            },
        ],
    }
    assert anthropic_to_chat_request(body)["messages"] == [
        {"role": "user", "content": "context"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
    ]


def test_plain_text_document_is_a_text_part_other_documents_are_refused() -> None:
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "X"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [doc]}]}
    assert anthropic_to_chat_request(body)["messages"] == [{"role": "user", "content": "X"}]
    doc["source"] = {"type": "base64", "media_type": "application/pdf", "data": "JVBER"}
    with pytest.raises(UnsupportedRequest, match="plain-text"):
        anthropic_to_chat_request(body)


@pytest.mark.parametrize(
    ("body", "error", "match"),
    [
        ({"model": "m"}, InvalidRequest, "messages"),
        ({"model": "m", "messages": [{"role": "system", "content": "x"}]}, InvalidRequest, "role"),
        ({"model": "m", "messages": [{"role": "user", "content": 3}]}, InvalidRequest, "content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"text": "no type"}]}]},
            InvalidRequest,
            "type",
        ),
        (
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": [{"type": "search_result", "source": "s"}]}
                ],
            },
            UnsupportedRequest,
            "search_result",
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "assistant", "content": [{"type": "image", "source": {}}]}],
            },
            UnsupportedRequest,
            "image",
        ),
    ],
)
def test_malformed_and_unsupported_requests_are_refused_with_a_reason(
    body: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        anthropic_to_chat_request(body)


def test_upstream_request_carries_capture_fields_stream_flag_and_pinned_sampling() -> None:
    body = claude_code_body()
    body["temperature"] = 0.2
    original = copy.deepcopy(body)
    upstream = build_anthropic_upstream(
        body, sampling_overrides={"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    )
    assert body == original  # never mutates the harness body
    assert upstream.dialect is Dialect.ANTHROPIC
    assert upstream.path == "/v1/chat/completions"
    assert upstream.stream is True
    assert upstream.include_usage is False
    assert upstream.keep_logprobs is False
    sent = upstream.body
    assert "stream" not in sent and "stream_options" not in sent
    assert sent["logprobs"] is True and sent["top_logprobs"] == 0
    assert sent["return_token_ids"] is True and sent["return_tokens_as_token_ids"] is True
    assert sent["include_reasoning"] is True
    assert (sent["temperature"], sent["top_p"], sent["top_k"]) == (1.0, 1.0, -1)

    body["stream"] = "yes"  # only a boolean true streams
    assert build_anthropic_upstream(body).stream is False


# --------------------------------------------------------------------------- response


def test_answer_with_reasoning_text_and_tool_use_is_a_valid_anthropic_message() -> None:
    completion = vllm_chat(
        "Running ls.",
        [40, 1115, 5248, 2],
        finish_reason="tool_calls",
        reasoning="I should run ls",
        tool_calls=[
            {
                "id": "chatcmpl-tool-8c1f2",
                "type": "function",
                "function": {"name": "Bash", "arguments": '{"command": "ls -la"}'},
            }
        ],
    )
    message = harness_message(completion)

    parsed = Message.model_validate(message)
    assert parsed.id == "chatcmpl-a3314b09b486737c"  # upstream id reused
    assert [block.type for block in parsed.content] == ["thinking", "text", "tool_use"]
    assert message["content"][0] == {
        "type": "thinking",
        "thinking": "I should run ls",
        "signature": "",
    }
    assert message["content"][2]["input"] == {"command": "ls -la"}
    assert parsed.stop_reason == "tool_use"
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens) == (len(PROMPT_IDS), 4)
    text = json.dumps(message)
    for token_field in ("token_ids", "prompt_token_ids", "logprobs", "token_id:"):
        assert token_field not in text


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason", "expected"),
    [
        ("stop", None, ("end_turn", None)),
        ("stop", 2, ("end_turn", None)),  # a stop token id, not a stop string
        ("stop", "\nHuman:", ("stop_sequence", "\nHuman:")),
        ("length", None, ("max_tokens", None)),
        ("content_filter", None, ("refusal", None)),
    ],
)
def test_stop_reason_mapping(
    finish_reason: str, stop_reason: Any, expected: tuple[Any, ...]
) -> None:
    message = harness_message(
        vllm_chat("Hi", [19556], finish_reason=finish_reason, stop_reason=stop_reason)
    )
    assert (message["stop_reason"], message["stop_sequence"]) == expected
    Message.model_validate(message)


def test_named_tool_choice_finishing_with_stop_is_still_tool_use() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}
    message = harness_message(vllm_chat("", [5, 6], tool_calls=[call]))
    assert message["stop_reason"] == "tool_use"
    assert message["content"] == [{"type": "tool_use", "id": "c1", "name": "Bash", "input": {}}]


def test_old_reasoning_content_name_and_blank_text_beside_a_tool_call() -> None:
    completion = vllm_chat(
        "\n\n",
        [5, 6, 7],
        finish_reason="tool_calls",
        tool_calls=[
            {"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": "not json"}}
        ],
    )
    message_body = completion["choices"][0]["message"]
    message_body["reasoning_content"] = message_body.pop("reasoning") or "old field"
    message = harness_message(completion)
    assert [b["type"] for b in message["content"]] == ["thinking", "tool_use"]
    assert message["content"][0]["thinking"] == "old field"
    assert message["content"][1]["input"] == {}  # unparsable arguments
    Message.model_validate(message)


def test_empty_answer_has_one_empty_text_block() -> None:
    message = harness_message(vllm_chat("", [2]))
    assert message["content"] == [{"type": "text", "text": ""}]
    Message.model_validate(message)


# --------------------------------------------------------------------------- count_tokens


def test_count_tokens_tokenize_body_and_answer() -> None:
    body = {
        "model": "claude-haiku",
        "system": "S",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": claude_code_body()["tools"],
    }
    tokenize = anthropic_count_tokens_tokenize_body(body)
    assert tokenize["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
    ]
    assert tokenize["tools"][0]["function"]["name"] == "Bash"
    assert tokenize["add_generation_prompt"] is True
    assert set(tokenize) == {"model", "messages", "tools", "add_generation_prompt"}

    vllm_answer = {"count": 36, "max_model_len": 2048, "tokens": PROMPT_IDS, "token_strs": None}
    assert anthropic_count_tokens_response(vllm_answer) == {"input_tokens": 36}
    assert anthropic_count_tokens_response({"tokens": [1, 2, 3]}) == {"input_tokens": 3}
    assert anthropic_count_tokens_response(12) == {"input_tokens": 12}
    with pytest.raises(ValueError, match="count"):
        anthropic_count_tokens_response({"max_model_len": 2048})


# --------------------------------------------------------------------------- errors

OLD_PROMPT_OVERFLOW = (
    "This model's maximum context length is 32768 tokens. However, you requested 32818 tokens "
    "in the messages, Please reduce the length of the messages. None"
)
NEW_PROMPT_OVERFLOW = (
    "This model's maximum context length is 2048 tokens. However, your prompt contains at least "
    "2049 input tokens, which exceeds this limit even without any output tokens. Please reduce "
    "the length of the input prompt. (parameter=input_tokens, value=2049)"
)
OLD_MAX_TOKENS_OVERFLOW = (
    "'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context "
    "length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778)."
)
MAIN_OVERFLOW = (
    "You passed 3000 input tokens and requested 100 output tokens. However, the model's "
    "context length is only 2048 tokens, resulting in a maximum input length of 1948 tokens. "
    "Please reduce the length of the input prompt."
)
SGLANG_OVERFLOW = "The input (5000 tokens) is longer than the model's context length (4096 tokens)."


@pytest.mark.parametrize(
    ("body", "expected_message"),
    [
        (
            {
                "object": "error",
                "message": OLD_PROMPT_OVERFLOW,
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            "prompt is too long: 32818 tokens > 32768 maximum",
        ),
        (
            {
                "error": {
                    "message": NEW_PROMPT_OVERFLOW,
                    "type": "BadRequestError",
                    "param": "input_tokens",
                    "code": 400,
                }
            },
            "prompt is too long: 2049 tokens > 2048 maximum",
        ),
        (
            {
                "error": {
                    "message": OLD_MAX_TOKENS_OVERFLOW,
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
            },
            "input length and `max_tokens` exceed context limit: 2778 + 8000 > 4096, "
            "decrease input length or `max_tokens` and try again",
        ),
        (
            {
                "error": {
                    "message": MAIN_OVERFLOW,
                    "type": "BadRequestError",
                    "param": "input_tokens",
                    "code": 400,
                }
            },
            "prompt is too long: 3000 tokens > 2048 maximum",
        ),
        (
            {
                "object": "error",
                "message": SGLANG_OVERFLOW,
                "type": "BadRequest",
                "param": None,
                "code": 400,
            },
            "prompt is too long: 5000 tokens > 4096 maximum",
        ),
        (
            {
                "error": {
                    "message": "too many characters (at most 8192 characters)",
                    "type": "BadRequestError",
                    "param": "input_text",
                    "code": 400,
                }
            },
            "prompt is too long: too many characters (at most 8192 characters)",
        ),
    ],
)
def test_context_overflow_is_reworded_for_claude_code(
    body: dict[str, Any], expected_message: str
) -> None:
    error = parse_upstream_error(400, json.dumps(body).encode())
    assert error.is_context_overflow
    reply = upstream_error_reply(Dialect.ANTHROPIC, error)
    assert reply.status == 400
    assert reply.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": expected_message},
    }


def test_overflow_wording_when_output_alone_exceeds_the_limit() -> None:
    text = (
        "max_tokens=5000 cannot be greater than max_model_len=2048. Please request fewer output "
        "tokens. (parameter=max_tokens, value=5000)"
    )
    error = parse_upstream_error(400, {"error": {"message": text, "param": "max_tokens"}})
    assert error.overflow == ContextOverflow(None, 2048, 5000)
    assert anthropic_overflow_message(error.overflow, text) == f"prompt is too long: {text}"


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (
            400,
            {"error": {"message": "bad temperature", "type": "BadRequestError"}},
            "invalid_request_error",
        ),
        (401, {"error": {"message": "no key"}}, "authentication_error"),
        (404, {"detail": "Not Found"}, "not_found_error"),
        (429, {"error": {"message": "slow down"}}, "rate_limit_error"),
        (500, b"Internal Server Error", "api_error"),
        (503, {"object": "error", "message": "engine overloaded", "code": 503}, "overloaded_error"),
        (504, b"", "timeout_error"),
    ],
)
def test_other_upstream_errors_keep_status_and_wording(status: int, body: Any, kind: str) -> None:
    error = parse_upstream_error(status, body)
    assert not error.is_context_overflow
    reply = upstream_error_reply(Dialect.ANTHROPIC, error)
    assert reply.status == status
    assert reply.body["type"] == "error"
    assert reply.body["error"]["type"] == kind
    assert reply.body["error"]["message"] == error.message
    assert error.message  # never empty, even for an empty body


def test_non_400_is_never_an_overflow_and_messages_are_read_from_every_envelope() -> None:
    assert not parse_upstream_error(500, {"error": {"message": NEW_PROMPT_OVERFLOW}}).overflow
    assert parse_upstream_error(404, {"detail": "Not Found"}).message == "Not Found"
    assert parse_upstream_error(500, "plain text").message == "plain text"
    assert parse_upstream_error(400, {"error": "flat string"}).message == "flat string"
    anthropic_envelope = {"type": "error", "error": {"type": "BadRequestError", "message": "m"}}
    assert parse_upstream_error(400, anthropic_envelope).type == "BadRequestError"


def test_transport_and_request_errors_in_anthropic_shape() -> None:
    timeout = transport_error_reply(Dialect.ANTHROPIC, timeout=True, detail="read timeout")
    assert timeout.status == 504
    assert timeout.body["error"]["type"] == "timeout_error"
    down = transport_error_reply(Dialect.ANTHROPIC, timeout=False, detail="connection refused")
    assert (down.status, down.body["error"]["type"]) == (502, "api_error")
    assert "connection refused" in down.body["error"]["message"]

    refused = request_error_reply(Dialect.ANTHROPIC, UnsupportedRequest("n must be 1", param="n"))
    assert refused.status == 400
    assert refused.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "n must be 1"},
    }
