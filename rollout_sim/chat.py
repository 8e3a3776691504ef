"""Chat text conventions shared by the simulated engine and the test chat templates.

One rule makes token chains provable in tests: the text the engine samples for an
assistant turn is exactly the text a chat template renders back for that turn when
the harness echoes it (`assistant_text`). Tool calls use the hermes form
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, which is also what
vLLM's hermes parser reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def message_text(content: Any) -> str:
    """Flatten OpenAI message content to the string a chat template sees.

    vLLM's "string" content format joins text parts with a newline; non-text parts
    carry no text for a text-only model.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type", "text") == "text"
        ]
        return "\n".join(texts)
    raise TypeError(f"message content must be a string, a list of parts or null, not {content!r}")


# vLLM 0.32 (`renderers/chat_utils.py`): part types that are text, and keys that mark media.
TEXT_PART_TYPES = frozenset(
    {"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"}
)
MEDIA_PART_KEYS = frozenset(
    {
        "input_image",
        "image_url",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "video_url",
    }
)


def has_non_text_content(messages: Any) -> bool:
    """Whether a message has a non-text content part (vLLM's ``has_non_text_content``): only
    list content counts; a part with a media key, or a type that is not a text type."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, Mapping) and (
                any(key in part for key in MEDIA_PART_KEYS)
                or not isinstance(kind := part.get("type", "text"), str)
                or kind not in TEXT_PART_TYPES
            ):
                return True
    return False


def hermes_block(name: str, arguments: Any) -> str:
    """One hermes tool-call block, serialised the way the simulated model writes it."""
    payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


def parse_arguments(raw: Any) -> Any:
    """OpenAI tool-call arguments are a JSON string; keep anything unparsable as it is."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def assistant_text(
    content: str | None,
    tool_calls: Sequence[Mapping[str, Any]] = (),
    reasoning: str | None = None,
) -> str:
    """The full text of an assistant turn: optional reasoning, content, hermes tool calls.

    `tool_calls` items are OpenAI-shaped (`{"function": {"name", "arguments"}}`) or flat
    (`{"name", "arguments"}`).
    """
    blocks = []
    for call in tool_calls:
        fn = call.get("function", call)
        blocks.append(hermes_block(str(fn["name"]), parse_arguments(fn.get("arguments", {}))))
    text = (content or "") + "\n".join(blocks)
    if reasoning is not None:
        text = f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{text}"
    return text


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages with string content, assistant tool calls folded into the content.

    For templates that know nothing about tools (SmolLM2's): what the model sampled as
    text is rendered back as the same text. Reasoning (`reasoning` or the older
    `reasoning_content`) is folded back as `<think>…</think>` so it is not lost.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping) or "role" not in message:
            raise TypeError(f"each message needs a role: {message!r}")
        role = str(message["role"])
        text = message_text(message.get("content"))
        if role == "assistant":
            reasoning = message.get("reasoning", message.get("reasoning_content"))
            text = assistant_text(text, message.get("tool_calls") or (), reasoning)
        out.append({"role": role, "content": text})
    return out
