"""Anthropic Messages <-> chat completions (wire-formats §4.1, §1.6).

vLLM's own ``/v1/messages`` cannot return token ids, so the proxy translates a Messages
request to chat completions, captures, and translates the chat answer back.

Request mapping (harness -> upstream chat):

- ``system`` (string or text blocks) -> one leading ``system`` message; ``cache_control``
  and ``citations`` are dropped everywhere.
- ``user`` content: ``text`` -> text parts; ``image`` (base64 or url) -> ``image_url`` parts
  (base64 as a ``data:`` URL); a plain-text ``document`` -> a text part; ``tool_result``
  blocks -> ``role: "tool"`` messages, emitted *before* the user's other parts so they
  follow the assistant turn that called the tools.  A tool result's text becomes the tool
  message content; its images go into the user message that follows.  ``is_error`` has no
  chat field and is dropped: the result text is all the model sees (Claude Code's error
  results already say ``<tool_use_error>``).
- ``assistant`` content: ``text`` -> ``content``; ``tool_use`` -> ``tool_calls`` with the
  ``input`` as a JSON string; ``thinking`` -> ``reasoning_content`` (so a reasoning parser's
  output round-trips into the template); ``redacted_thinking`` is opaque and dropped.
- the non-standard roles ``ctx``/``msg`` (Claude Code >= 2.1.154) -> ``user``.
- ``tools`` -> chat function tools (``input_schema`` -> ``parameters``); Anthropic server
  tools (no ``input_schema``) cannot run on a chat backend and are dropped.
- ``tool_choice`` auto/any/tool/none -> "auto"/"required"/named function/"none";
  ``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``.
- ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` kept; ``stop_sequences`` -> ``stop``;
  ``output_config.format`` / ``output_format`` (json_schema) -> ``response_format``;
  ``metadata``, ``thinking`` (a model-specific template switch: pin it with
  ``sampling_overrides``/``chat_template_kwargs`` instead), ``output_config.effort``,
  ``service_tier`` and other serving fields are dropped.
- ``thread``, ``compaction``, ``context_management`` edits and ``mcp_servers`` are refused
  (``api.dialects.refusals``; the table of every field is in ``docs/dialects.md``).

Response mapping (chat completion -> Anthropic ``message``) is :func:`chat_to_anthropic_message`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from api.dialects.chat import UpstreamRequest, translated_chat_upstream
from api.dialects.common import (
    Dialect,
    InvalidRequest,
    JSONDict,
    UnsupportedRequest,
    content_value,
    list_or_empty,
    mapping_or_empty,
    parse_tool_input,
    reasoning_text,
    single_choice,
    token_count,
)

__all__ = [
    "anthropic_count_tokens_response",
    "anthropic_count_tokens_tokenize_body",
    "anthropic_to_chat_request",
    "build_anthropic_upstream",
    "chat_to_anthropic_message",
]

_USER_ROLES = frozenset({"user", "ctx", "msg"})
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k")
_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


# --------------------------------------------------------------------------- request


def build_anthropic_upstream(
    body: Mapping[str, Any], *, sampling_overrides: Mapping[str, Any] | None = None
) -> UpstreamRequest:
    """The upstream chat request (with capture fields) for a Messages request."""
    return translated_chat_upstream(
        Dialect.ANTHROPIC, anthropic_to_chat_request, body, sampling_overrides
    )


def anthropic_to_chat_request(body: Mapping[str, Any]) -> JSONDict:
    """Translate a Messages request body to a chat-completions body (no capture fields)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest("`messages` must be a list", param="messages")
    chat: JSONDict = {"model": body.get("model"), "messages": _chat_messages(body, messages)}
    for field in _SAMPLING_FIELDS:
        if body.get(field) is not None:
            chat[field] = body[field]
    stop = body.get("stop_sequences")
    if stop:
        chat["stop"] = list(stop)
    tools = _chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        chat.update(_chat_tool_choice(body.get("tool_choice")))
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def _response_format(body: Mapping[str, Any]) -> JSONDict | None:
    """Structured output (``output_config.format``, or the older beta ``output_format``) as a
    chat ``response_format``: the engine then decodes under the same JSON schema."""
    fmt = mapping_or_empty(mapping_or_empty(body.get("output_config")).get("format"))
    fmt = fmt or mapping_or_empty(body.get("output_format"))
    if not fmt:
        return None
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), Mapping):
        raise UnsupportedRequest(
            f"output format {fmt.get('type')!r} is not supported (only json_schema with a "
            "`schema` object)",
            param="output_config",
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _chat_messages(body: Mapping[str, Any], messages: list[Any]) -> list[JSONDict]:
    chat_messages: list[JSONDict] = []
    system = _system_content(body.get("system"))
    if system:
        chat_messages.append({"role": "system", "content": system})
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"messages[{index}] must be an object", param="messages")
        chat_messages.extend(_translate_message(message, index))
    return chat_messages


def _system_content(system: Any) -> str | list[JSONDict]:
    if system is None or isinstance(system, str):
        return system or ""
    if not isinstance(system, list):
        raise InvalidRequest("`system` must be a string or a list of text blocks", param="system")
    parts = [_text_part(block, "system") for block in system]
    return content_value(parts)


def _translate_message(message: Mapping[str, Any], index: int) -> list[JSONDict]:
    role = message.get("role")
    content = message.get("content")
    if not isinstance(role, str) or (role not in _USER_ROLES and role != "assistant"):
        raise InvalidRequest(f"messages[{index}].role {role!r} is not user or assistant")
    chat_role = "assistant" if role == "assistant" else "user"
    if isinstance(content, str):
        return [{"role": chat_role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"messages[{index}].content must be a string or a list of blocks")
    if chat_role == "assistant":
        return [_assistant_message(content, index)]
    return _user_messages(content, index)


def _user_messages(blocks: list[Any], index: int) -> list[JSONDict]:
    """Tool results first (as tool messages), then the user's own parts in order."""
    tool_messages: list[JSONDict] = []
    result_images: list[JSONDict] = []
    parts: list[JSONDict] = []
    for block in blocks:
        kind = _block_type(block, f"messages[{index}]")
        if kind == "tool_result":
            tool_message, images = _tool_message(block)
            tool_messages.append(tool_message)
            result_images.extend(images)
        else:
            parts.append(_user_part(block, kind, index))
    user_parts = result_images + parts
    if not user_parts:
        return tool_messages
    return [*tool_messages, {"role": "user", "content": content_value(user_parts)}]


def _user_part(block: Mapping[str, Any], kind: str, index: int) -> JSONDict:
    if kind == "text":
        return _text_part(block, f"messages[{index}]")
    if kind == "image":
        return _image_part(block)
    if kind == "document":
        return _document_part(block)
    raise UnsupportedRequest(
        f"messages[{index}] has a {kind!r} block, which a chat-completions backend cannot take "
        "(supported in user turns: text, image, plain-text document, tool_result)"
    )


def _tool_message(block: Mapping[str, Any]) -> tuple[JSONDict, list[JSONDict]]:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str):
        raise InvalidRequest("a tool_result block needs a string `tool_use_id`")
    content = block.get("content")
    texts: list[JSONDict] = []
    images: list[JSONDict] = []
    if isinstance(content, str):
        texts.append({"type": "text", "text": content})
    elif isinstance(content, list):
        for item in content:
            kind = _block_type(item, "tool_result")
            if kind == "image":
                images.append(_image_part(item))
            elif kind == "text":
                texts.append(_text_part(item, "tool_result"))
            else:
                raise UnsupportedRequest(
                    f"a tool_result holds a {kind!r} block; only text and image are supported"
                )
    elif content is not None:
        raise InvalidRequest("tool_result `content` must be a string or a list of blocks")
    value = content_value(texts) if texts else ""
    return {"role": "tool", "tool_call_id": tool_use_id, "content": value}, images


def _assistant_message(blocks: list[Any], index: int) -> JSONDict:
    texts: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[JSONDict] = []
    for block in blocks:
        kind = _block_type(block, f"messages[{index}]")
        if kind == "text":
            texts.append(str(_text_part(block, f"messages[{index}]")["text"]))
        elif kind == "thinking":
            if block.get("thinking"):
                reasoning.append(str(block["thinking"]))
        elif kind == "tool_use":
            tool_calls.append(_tool_call(block))
        elif kind != "redacted_thinking":
            raise UnsupportedRequest(
                f"messages[{index}] (assistant) has a {kind!r} block; supported: text, "
                "thinking, redacted_thinking, tool_use"
            )
    message: JSONDict = {"role": "assistant", "content": "".join(texts)}
    if tool_calls:
        message["tool_calls"] = tool_calls
        if not texts:
            message["content"] = None
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def _tool_call(block: Mapping[str, Any]) -> JSONDict:
    call_id, name = block.get("id"), block.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise InvalidRequest("a tool_use block needs string `id` and `name`")
    arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        raise InvalidRequest(f"{where}: every content block must be an object with a `type`")
    return str(block["type"])


def _text_part(block: Any, where: str) -> JSONDict:
    if not isinstance(block, Mapping) or block.get("type") != "text":
        raise InvalidRequest(f"{where}: expected a text block")
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}: a text block needs a string `text`")
    return {"type": "text", "text": text}


def _image_part(block: Mapping[str, Any]) -> JSONDict:
    source = mapping_or_empty(block.get("source"))
    kind = source.get("type")
    if kind == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
    elif kind == "url":
        url = str(source.get("url"))
    else:
        raise UnsupportedRequest(f"image source type {kind!r} is not supported (base64, url)")
    return {"type": "image_url", "image_url": {"url": url}}


def _document_part(block: Mapping[str, Any]) -> JSONDict:
    source = mapping_or_empty(block.get("source"))
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        return {"type": "text", "text": source["data"]}
    raise UnsupportedRequest(
        f"document source type {source.get('type')!r} is not supported; only plain-text "
        "documents can be sent to a chat-completions backend"
    )


def _chat_tools(tools: Any) -> list[JSONDict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequest("`tools` must be a list", param="tools")
    chat_tools: list[JSONDict] = []
    for tool in tools:
        if not isinstance(tool, Mapping) or "input_schema" not in tool:
            continue  # server tools (web_search, bash_..., text_editor_...) cannot run here
        function: JSONDict = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _chat_tool_choice(choice: Any) -> JSONDict:
    if not isinstance(choice, Mapping):
        return {}
    fields: JSONDict = {}
    kind = choice.get("type")
    if kind == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif isinstance(kind, str) and kind in _TOOL_CHOICE:
        fields["tool_choice"] = _TOOL_CHOICE[str(kind)]
    if choice.get("disable_parallel_tool_use") is True:
        fields["parallel_tool_calls"] = False
    return fields


# --------------------------------------------------------------------------- count_tokens


def anthropic_count_tokens_tokenize_body(body: Mapping[str, Any]) -> JSONDict:
    """The chat-form ``/tokenize`` body that counts a ``count_tokens`` request's input.

    The proxy posts it to the upstream's ``/tokenize`` (which renders the same chat template
    a real call would, generation prompt included) and answers with
    :func:`anthropic_count_tokens_response`.
    """
    chat = anthropic_to_chat_request(body)
    tokenize: JSONDict = {"model": chat["model"], "messages": chat["messages"]}
    if "tools" in chat:
        tokenize["tools"] = chat["tools"]
    tokenize["add_generation_prompt"] = True
    return tokenize


def anthropic_count_tokens_response(tokenized: Mapping[str, Any] | int) -> JSONDict:
    """The ``count_tokens`` answer, from a token count or a ``/tokenize`` response body."""
    if isinstance(tokenized, Mapping):
        count = tokenized.get("count")
        if not isinstance(count, int) or isinstance(count, bool):
            tokens = tokenized.get("tokens")
            if not isinstance(tokens, list):
                raise ValueError("a /tokenize response carries `count` or `tokens`")
            count = len(tokens)
    else:
        count = tokenized
    if count < 0:
        raise ValueError(f"a token count cannot be negative, got {count}")
    return {"input_tokens": count}


# --------------------------------------------------------------------------- response


def chat_to_anthropic_message(completion: Mapping[str, Any]) -> JSONDict:
    """The Anthropic ``message`` for a (token-stripped) chat completion.

    ``id`` is the upstream completion id, unchanged, so the recorded ``response_id`` and what
    the harness saw are the same string.  A stop string vLLM reports as matched
    (``choices[0].stop_reason``, a string) becomes ``stop_sequence``; the proxy only sends
    the harness's own ``stop_sequences`` as ``stop``.  Token fields of the completion are
    never copied: the message is built field by field.
    """
    choice = single_choice(completion)
    message = mapping_or_empty(choice.get("message"))
    content = _anthropic_content(message)
    has_tool_use = any(block["type"] == "tool_use" for block in content)
    stop_reason, stop_sequence = _stop_reason(choice, has_tool_use)
    return {
        "id": completion.get("id"),
        "type": "message",
        "role": "assistant",
        "model": completion.get("model"),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _anthropic_usage(completion.get("usage")),
    }


def _anthropic_content(message: Mapping[str, Any]) -> list[JSONDict]:
    blocks: list[JSONDict] = []
    thinking = reasoning_text(message)
    if thinking:
        blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
    text = message.get("content")
    if isinstance(text, str) and text:
        blocks.append({"type": "text", "text": text})
    for call in map(mapping_or_empty, list_or_empty(message.get("tool_calls"))):
        function = mapping_or_empty(call.get("function"))
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name"),
                "input": parse_tool_input(function.get("arguments")),
            }
        )
    return _drop_blank_text_beside_others(blocks)


def _drop_blank_text_beside_others(blocks: list[JSONDict]) -> list[JSONDict]:
    """Anthropic never sends (and refuses in requests) whitespace-only text blocks; keep one
    only when it is the whole answer, and give an empty answer one empty text block."""
    kept = [b for b in blocks if b["type"] != "text" or str(b["text"]).strip()]
    if kept:
        return kept
    return blocks or [{"type": "text", "text": ""}]


def _stop_reason(choice: Mapping[str, Any], has_tool_use: bool) -> tuple[str, str | None]:
    finish = choice.get("finish_reason")
    if has_tool_use and finish in ("tool_calls", "stop"):
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "content_filter":
        return "refusal", None
    matched = choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _anthropic_usage(usage: Any) -> JSONDict:
    usage = mapping_or_empty(usage)
    return {
        "input_tokens": token_count(usage.get("prompt_tokens")),
        "output_tokens": token_count(usage.get("completion_tokens")),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
