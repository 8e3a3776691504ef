"""A dependency-free byte tokenizer with a ChatML + hermes chat template.

Deterministic and tiny (272 ids), so it suits unit tests and the demo. Ids 0..15 are
special (three used, the rest reserved), every byte b is id 16 + b. Byte-level ids make
every text round-trip exactly, so a re-rendered history always extends the sampled
tokens; use the real SmolLM2 tokenizer (tests/support/smollm2.py) to meet BPE merges.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from rollout_sim.chat import assistant_text, message_text

SPECIAL_TOKENS: dict[str, int] = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
BYTE_OFFSET = 16
_SPECIAL_BY_ID = {i: s for s, i in SPECIAL_TOKENS.items()}
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))

# Qwen2.5-style tool preamble: the hermes convention the simulated model answers in.
_TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class TemplateTokenizer(ABC):
    """A tokenizer with a chat template that renders text: `render_chat` (what
    `rollout_sim.engine.Tokenizer` asks for) is the ids of `render_text`."""

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> list[int]:
        return self.encode(self.render_text(messages, tools, add_generation_prompt))


class ByteTokenizer(TemplateTokenizer):
    """Implements `rollout_sim.engine.Tokenizer` without any third-party package."""

    eos_id: int = SPECIAL_TOKENS["<|im_end|>"]
    vocab_size: int = BYTE_OFFSET + 256

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for match in _SPECIAL_RE.finditer(text):
            ids.extend(b + BYTE_OFFSET for b in text[pos : match.start()].encode("utf-8"))
            ids.append(SPECIAL_TOKENS[match.group()])
            pos = match.end()
        ids.extend(b + BYTE_OFFSET for b in text[pos:].encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        out: list[str] = []
        pending = bytearray()
        for i in ids:
            if i >= BYTE_OFFSET:
                pending.append(i - BYTE_OFFSET)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special_tokens:
                out.append(_SPECIAL_BY_ID.get(i, f"<|reserved_{i}|>"))
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def id_to_token(self, token_id: int) -> str:
        """The token's own string, as `/tokenize` reports it in `token_strs`."""
        if token_id < BYTE_OFFSET:
            return _SPECIAL_BY_ID.get(token_id, f"<|reserved_{token_id}|>")
        byte = token_id - BYTE_OFFSET
        return chr(byte) if 0x20 <= byte < 0x7F else f"<0x{byte:02X}>"

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        """ChatML. Tools go into the system turn; tool results come back as user turns."""
        msgs = list(messages)
        system: str | None = None
        if msgs and msgs[0].get("role") in ("system", "developer"):
            system = message_text(msgs.pop(0).get("content"))
        if tools:
            lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
            system = (system or "You are a helpful assistant.") + _TOOLS_HEADER + lines
            system += _TOOLS_FOOTER
        parts = [] if system is None else [f"<|im_start|>system\n{system}<|im_end|>\n"]
        for message in msgs:
            role = str(message["role"])
            text = message_text(message.get("content"))
            if role == "assistant":
                reasoning = message.get("reasoning", message.get("reasoning_content"))
                text = assistant_text(text, message.get("tool_calls") or (), reasoning)
            elif role == "tool":
                role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
            parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)
