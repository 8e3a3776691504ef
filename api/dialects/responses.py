"""OpenAI Responses <-> chat completions (wire-formats §1.5, §4.3).

vLLM's ``/v1/responses`` returns no token ids, so a Responses request (Codex CLI, the Agents
SDK) is translated to chat completions, captured, and the chat answer translated back.

Request mapping (harness -> upstream chat):

- ``instructions`` -> a leading ``system`` message; ``developer`` messages -> ``system``.
- ``input``: a string is one user message.  Message items keep their role; ``input_text`` /
  ``output_text`` parts -> text parts, ``input_image`` -> ``image_url`` parts.  Consecutive
  model-authored items (``reasoning``, assistant messages, ``function_call``,
  ``custom_tool_call``) fold into one assistant message (``reasoning_content``, ``content``,
  ``tool_calls``), the shape chat templates expect; a new turn starts when an item comes
  "earlier" in that order than what the turn already holds.  ``function_call_output`` /
  ``custom_tool_call_output`` -> ``role: "tool"`` messages (images in an output go into a
  user message after the run of tool messages).  ``item_reference`` and unknown item types
  are refused: they need server-side state or have no chat form.
- ``tools``: ``function`` tools (flattened ``name``/``parameters``) -> chat function tools;
  ``namespace`` groups are flattened to ``<namespace>__<name>``; a freeform ``custom`` tool
  is bridged as a function with one string parameter ``input`` (its grammar appended to the
  description); hosted tools (web_search, file_search, ...) cannot run on a chat backend
  and are dropped.  ``tool_choice`` follows the same mapping.
- ``max_output_tokens`` -> ``max_tokens``; ``temperature``, ``top_p``, ``top_k``, ``seed``,
  ``parallel_tool_calls`` kept; ``text.format`` json_schema/json_object -> ``response_format``.
  ``reasoning`` (effort levels vLLM does not all accept), ``store``, ``include``,
  ``prompt_cache_key``, ``client_metadata``, ``metadata``, ``user``, ``truncation`` dropped.
- ``previous_response_id``, ``conversation``, ``prompt`` and ``background`` are refused
  with :class:`~api.dialects.common.UnsupportedRequest`: the proxy keeps no server-side
  conversation state, so the harness must send the whole conversation in ``input``.

The response mapping is :func:`chat_to_responses_response`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
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
    reasoning_text,
    single_choice,
    token_count,
)
from ledger.fingerprint import CUSTOM_TOOL_INPUT_KEY, NAMESPACE_SEPARATOR

__all__ = [
    "ToolOrigin",
    "build_responses_upstream",
    "chat_to_responses_response",
    "responses_to_chat_request",
    "tool_origins",
]

_STATEFUL_FIELDS = ("previous_response_id", "conversation", "prompt")
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "parallel_tool_calls")
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_TOOL_CHOICE_STRINGS = frozenset({"auto", "none", "required"})
_INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


# --------------------------------------------------------------------------- tools


@dataclass(frozen=True, slots=True)
class ToolOrigin:
    """Where a chat tool name came from in the Responses request."""

    name: str
    namespace: str | None = None
    custom: bool = False

    @property
    def chat_name(self) -> str:
        return f"{self.namespace}{NAMESPACE_SEPARATOR}{self.name}" if self.namespace else self.name


def tool_origins(tools: Any) -> dict[str, ToolOrigin]:
    """Chat tool name -> the Responses tool it stands for (namespaced or freeform)."""
    return {origin.chat_name: origin for origin, _ in _expressible_tools(tools)}


def _expressible_tools(tools: Any) -> Iterator[tuple[ToolOrigin, Mapping[str, Any]]]:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequest("`tools` must be a list", param="tools")
    for tool in map(mapping_or_empty, tools):
        if tool.get("type") == "namespace":
            for inner in map(mapping_or_empty, list_or_empty(tool.get("tools"))):
                yield from _leaf_tool(inner, str(tool.get("name")))
        else:
            yield from _leaf_tool(tool, None)


def _leaf_tool(
    tool: Mapping[str, Any], namespace: str | None
) -> Iterator[tuple[ToolOrigin, Mapping[str, Any]]]:
    kind = tool.get("type")
    if kind in ("function", "custom") and isinstance(tool.get("name"), str):
        yield ToolOrigin(str(tool["name"]), namespace, custom=kind == "custom"), tool


def _chat_tool(origin: ToolOrigin, tool: Mapping[str, Any]) -> JSONDict:
    function: JSONDict = {"name": origin.chat_name}
    description = tool.get("description")
    if origin.custom:
        function["description"] = _custom_tool_description(description, tool.get("format"))
        function["parameters"] = {
            "type": "object",
            "properties": {CUSTOM_TOOL_INPUT_KEY: {"type": "string"}},
            "required": [CUSTOM_TOOL_INPUT_KEY],
        }
    else:
        if description is not None:
            function["description"] = description
        function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _custom_tool_description(description: Any, input_format: Any) -> str:
    text = description if isinstance(description, str) else ""
    fmt = mapping_or_empty(input_format)
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        text += f"\n\nThe `{CUSTOM_TOOL_INPUT_KEY}` must follow this {fmt.get('syntax')} grammar:\n"
        text += str(fmt["definition"])
    return text


def _chat_tool_choice(choice: Any, origins: Mapping[str, ToolOrigin]) -> Any:
    """The chat ``tool_choice`` for a Responses one, or ``None`` to leave it out."""
    if isinstance(choice, str):
        return choice if choice in _TOOL_CHOICE_STRINGS else None
    choice = mapping_or_empty(choice)
    if choice.get("type") in ("function", "custom") and isinstance(choice.get("name"), str):
        name = str(choice["name"])
        namespace = choice.get("namespace")
        flat = ToolOrigin(name, namespace if isinstance(namespace, str) else None).chat_name
        if flat in origins:
            return {"type": "function", "function": {"name": flat}}
    return None


# --------------------------------------------------------------------------- request


def build_responses_upstream(
    body: Mapping[str, Any], *, sampling_overrides: Mapping[str, Any] | None = None
) -> UpstreamRequest:
    """The upstream chat request (with capture fields) for a Responses request."""
    return translated_chat_upstream(
        Dialect.RESPONSES, responses_to_chat_request, body, sampling_overrides
    )


def responses_to_chat_request(body: Mapping[str, Any]) -> JSONDict:
    """Translate a Responses request body to a chat-completions body (no capture fields)."""
    _refuse_server_state(body)
    builder = _ChatBuilder()
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        builder.add_message({"role": "system", "content": instructions})
    _add_input(builder, body.get("input"))
    chat: JSONDict = {"model": body.get("model"), "messages": builder.finish()}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for name in _SAMPLING_FIELDS:
        if body.get(name) is not None:
            chat[name] = body[name]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    tools = list(_expressible_tools(body.get("tools")))
    if tools:
        chat["tools"] = [_chat_tool(origin, tool) for origin, tool in tools]
        tool_choice = _chat_tool_choice(body.get("tool_choice"), tool_origins(body.get("tools")))
        if tool_choice is not None:
            chat["tool_choice"] = tool_choice
        elif isinstance(body.get("tool_choice"), Mapping):
            raise UnsupportedRequest(
                "`tool_choice` names a tool that is not among the function or custom tools "
                "the request declares; the model could not be made to call it",
                param="tool_choice",
            )
    else:
        chat.pop("parallel_tool_calls", None)
    return chat


def _refuse_server_state(body: Mapping[str, Any]) -> None:
    for name in _STATEFUL_FIELDS:
        if body.get(name) is not None:
            raise UnsupportedRequest(
                f"`{name}` is not supported: the capture proxy keeps no server-side responses "
                "or conversations; send the whole conversation in `input` (store: false)",
                param=name,
            )
    if body.get("background") is True:
        raise UnsupportedRequest(
            "`background` must be false: the capture proxy answers each request synchronously",
            param="background",
        )


def _response_format(text: Any) -> JSONDict | None:
    fmt = mapping_or_empty(mapping_or_empty(text).get("format"))
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {
            key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt
        }
        return {"type": "json_schema", "json_schema": schema}
    return None


@dataclass
class _Turn:
    """One assistant turn being assembled from consecutive model-authored items."""

    reasoning: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    tool_calls: list[JSONDict] = field(default_factory=list)

    def message(self) -> JSONDict:
        content: str | None = "".join(self.texts)
        message: JSONDict = {"role": "assistant", "content": content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
            if not self.texts:
                message["content"] = None
        if self.reasoning:
            message["reasoning_content"] = "\n".join(self.reasoning)
        return message


@dataclass
class _ChatBuilder:
    """Chat messages in order, folding model-authored items into assistant turns."""

    messages: list[JSONDict] = field(default_factory=list)
    turn: _Turn | None = None
    deferred_images: list[JSONDict] = field(default_factory=list)

    def add_reasoning(self, text: str) -> None:
        turn = self._turn(starts_new=lambda t: bool(t.texts or t.tool_calls))
        turn.reasoning.append(text)

    def add_assistant_text(self, text: str) -> None:
        self._turn(starts_new=lambda t: bool(t.tool_calls)).texts.append(text)

    def add_tool_call(self, call: JSONDict) -> None:
        self._turn(starts_new=lambda t: False).tool_calls.append(call)

    def add_tool_output(self, message: JSONDict, images: list[JSONDict]) -> None:
        self._close_turn()
        self.messages.append(message)
        self.deferred_images.extend(images)

    def add_message(self, message: JSONDict) -> None:
        self._close_turn()
        self._flush_images()
        self.messages.append(message)

    def finish(self) -> list[JSONDict]:
        self._close_turn()
        self._flush_images()
        return self.messages

    def _turn(self, starts_new: Callable[[_Turn], bool]) -> _Turn:
        if self.turn is not None and starts_new(self.turn):
            self._close_turn()
        if self.turn is None:
            self._flush_images()
            self.turn = _Turn()
        return self.turn

    def _close_turn(self) -> None:
        if self.turn is not None:
            self.messages.append(self.turn.message())
            self.turn = None

    def _flush_images(self) -> None:
        if self.deferred_images:
            self.messages.append({"role": "user", "content": self.deferred_images})
            self.deferred_images = []


def _add_input(builder: _ChatBuilder, items: Any) -> None:
    if isinstance(items, str):
        builder.add_message({"role": "user", "content": items})
        return
    if not isinstance(items, list):
        raise InvalidRequest("`input` must be a string or a list of items", param="input")
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise InvalidRequest(f"input[{index}] must be an object", param="input")
        _add_item(builder, item, index)


def _add_item(builder: _ChatBuilder, item: Mapping[str, Any], index: int) -> None:
    kind = item.get("type") or ("message" if "role" in item else None)
    if kind == "message":
        _add_message_item(builder, item, index)
    elif kind == "reasoning":
        text = _reasoning_item_text(item)
        if text:
            builder.add_reasoning(text)
    elif kind in ("function_call", "custom_tool_call"):
        builder.add_tool_call(_tool_call(item, index))
    elif kind in ("function_call_output", "custom_tool_call_output"):
        builder.add_tool_output(*_tool_output(item, index))
    else:
        raise UnsupportedRequest(
            f"input[{index}] has type {kind!r}, which the capture proxy cannot translate for a "
            "chat-completions backend (supported: message, reasoning, function_call, "
            "function_call_output, custom_tool_call, custom_tool_call_output)",
            param="input",
        )


def _add_message_item(builder: _ChatBuilder, item: Mapping[str, Any], index: int) -> None:
    role = item.get("role")
    parts = _content_parts(item.get("content"), index)
    if role == "assistant":
        for part in parts:
            if part["type"] != "text":
                raise UnsupportedRequest(f"input[{index}]: assistant messages carry text only")
            builder.add_assistant_text(str(part["text"]))
    elif role in ("user", "system", "developer"):
        chat_role = "system" if role == "developer" else role
        builder.add_message({"role": chat_role, "content": content_value(parts)})
    else:
        raise InvalidRequest(f"input[{index}].role {role!r} is not user/system/developer/assistant")


def _content_parts(content: Any, index: int) -> list[JSONDict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"input[{index}].content must be a string or a list of parts")
    return [_content_part(mapping_or_empty(part), index) for part in content]


def _content_part(part: Mapping[str, Any], index: int) -> JSONDict:
    kind = part.get("type")
    if isinstance(kind, str) and kind in _TEXT_PARTS:
        return {"type": "text", "text": str(part.get("text") or "")}
    if kind == "refusal":
        return {"type": "text", "text": str(part.get("refusal") or "")}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        image: JSONDict = {"url": part["image_url"]}
        if part.get("detail") in ("low", "high", "auto"):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    raise UnsupportedRequest(
        f"input[{index}] has a {kind!r} content part the capture proxy cannot send to a "
        "chat-completions backend (supported: input_text, output_text, input_image by URL)"
    )


def _reasoning_item_text(item: Mapping[str, Any]) -> str:
    """The reasoning text to replay: full ``content`` if kept, else the summaries."""
    content = [mapping_or_empty(part).get("text") for part in list_or_empty(item.get("content"))]
    texts = [text for text in content if isinstance(text, str)]
    if texts:
        return "".join(texts)
    summary = [mapping_or_empty(part).get("text") for part in list_or_empty(item.get("summary"))]
    return "\n".join(text for text in summary if isinstance(text, str))


def _tool_call(item: Mapping[str, Any], index: int) -> JSONDict:
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise InvalidRequest(f"input[{index}] ({item.get('type')}) needs string call_id and name")
    namespace = item.get("namespace")
    chat_name = ToolOrigin(name, namespace if isinstance(namespace, str) else None).chat_name
    if item.get("type") == "custom_tool_call":
        arguments = json.dumps({CUSTOM_TOOL_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
    else:
        raw = item.get("arguments")
        arguments = raw if isinstance(raw, str) and raw.strip() else "{}"
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": chat_name, "arguments": arguments},
    }


def _tool_output(item: Mapping[str, Any], index: int) -> tuple[JSONDict, list[JSONDict]]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise InvalidRequest(f"input[{index}] ({item.get('type')}) needs a string call_id")
    output = item.get("output")
    if isinstance(output, str) or output is None:
        return {"role": "tool", "tool_call_id": call_id, "content": output or ""}, []
    parts = _content_parts(output, index)
    texts = [part for part in parts if part["type"] == "text"]
    images = [part for part in parts if part["type"] != "text"]
    content = content_value(texts) if texts else ""
    return {"role": "tool", "tool_call_id": call_id, "content": content}, images


# --------------------------------------------------------------------------- response


def chat_to_responses_response(
    completion: Mapping[str, Any], *, request: Mapping[str, Any] | None = None
) -> JSONDict:
    """The Responses ``response`` object for a (token-stripped) chat completion.

    ``id`` is the upstream completion id, unchanged (``chatcmpl-...``): the recorded
    ``response_id`` and the id the harness later reports are then the same string, which is
    what terminal attribution joins on.  Item ids derive from it (``msg_<id>``,
    ``rs_<id>``, ``fc_<id>_<k>``), so replaying the same completion gives the same object.
    ``request`` (the harness's Responses body) supplies the echoed fields and maps
    namespaced and freeform tool names back.
    """
    request = request or {}
    choice = single_choice(completion)
    message = mapping_or_empty(choice.get("message"))
    response_id = str(completion.get("id"))
    incomplete = _INCOMPLETE_REASONS.get(str(choice.get("finish_reason")))
    status = "incomplete" if incomplete else "completed"
    output = _output_items(message, response_id, status, tool_origins(request.get("tools")))
    return {
        "id": response_id,
        "object": "response",
        "created_at": completion.get("created") or 0,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": request.get("instructions"),
        "model": completion.get("model"),
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "temperature": request.get("temperature"),
        "top_p": request.get("top_p"),
        "max_output_tokens": request.get("max_output_tokens"),
        "reasoning": request.get("reasoning"),
        "text": request.get("text") or {"format": {"type": "text"}},
        "metadata": request.get("metadata") or {},
        "store": False,
        "usage": _responses_usage(completion.get("usage")),
    }


def _output_items(
    message: Mapping[str, Any], response_id: str, status: str, origins: Mapping[str, ToolOrigin]
) -> list[JSONDict]:
    items: list[JSONDict] = []
    reasoning = reasoning_text(message)
    if reasoning:
        items.append(
            {
                "id": f"rs_{response_id}",
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
            }
        )
    calls = [mapping_or_empty(call) for call in list_or_empty(message.get("tool_calls"))]
    text = message.get("content")
    text = text if isinstance(text, str) else ""
    if text.strip() or not calls:
        items.append(
            {
                "id": f"msg_{response_id}",
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [
                    {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                ],
            }
        )
    for k, call in enumerate(calls):
        items.append(_tool_call_item(call, f"{response_id}_{k}", origins))
    return items


def _tool_call_item(
    call: Mapping[str, Any], suffix: str, origins: Mapping[str, ToolOrigin]
) -> JSONDict:
    function = mapping_or_empty(call.get("function"))
    chat_name = str(function.get("name"))
    arguments = function.get("arguments")
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
    call_id = call.get("id") if isinstance(call.get("id"), str) else f"call_{suffix}"
    origin = origins.get(chat_name, ToolOrigin(chat_name))
    if origin.custom:
        item: JSONDict = {
            "id": f"ctc_{suffix}",
            "type": "custom_tool_call",
            "call_id": call_id,
            "name": origin.name,
            "input": _custom_tool_input(arguments),
        }
    else:
        item = {
            "id": f"fc_{suffix}",
            "type": "function_call",
            "call_id": call_id,
            "name": origin.name,
            "arguments": arguments,
            "status": "completed",
        }
    if origin.namespace:
        item["namespace"] = origin.namespace
    return item


def _custom_tool_input(arguments: str) -> str:
    """The freeform input out of the bridge's ``{"input": ...}`` arguments (raw text if the
    model wrote something else)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    value = parsed.get(CUSTOM_TOOL_INPUT_KEY) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


def _responses_usage(usage: Any) -> JSONDict | None:
    if not isinstance(usage, Mapping):
        return None
    prompt = token_count(usage.get("prompt_tokens"))
    completion = token_count(usage.get("completion_tokens"))
    cached = mapping_or_empty(usage.get("prompt_tokens_details")).get("cached_tokens")
    reasoning = mapping_or_empty(usage.get("completion_tokens_details")).get("reasoning_tokens")
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": token_count(cached), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": token_count(reasoning)},
        "total_tokens": token_count(usage.get("total_tokens")) or prompt + completion,
    }
