"""CPU cost of each step the proxy runs per captured call, on a real simulated-engine answer.

Explains the proxy overhead: what the event loop spends per call besides waiting for the
database.  ``proposed_*`` are candidate fixes measured side by side (and checked to give the
same result); they are not used by the ledger.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import time
import timeit
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from api import extract
from api.dialects import build_chat_upstream
from bench.simserver import make_engine
from bench.workload import text
from ledger.records import TokenEntry, coerce_entry
from ledger.store import _prepare

__all__ = ["proxy_steps"]

_BUNDLE = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts")


def proposed_strip_chat_response(
    response: Mapping[str, Any], *, keep_logprobs: bool = False
) -> extract.StrippedResponse:
    """``strip_chat_response`` that drops the token arrays *before* copying (same result)."""
    body = {k: v for k, v in response.items() if k != "prompt_token_ids"}
    choices = body.get("choices")
    if isinstance(choices, list):
        out = []
        for choice in choices:
            if isinstance(choice, dict):
                drop = {"token_ids", "routed_experts"} | (set() if keep_logprobs else {"logprobs"})
                choice = {k: v for k, v in choice.items() if k not in drop}
                if isinstance(choice.get("message"), dict):
                    choice["message"] = {
                        k: v for k, v in choice["message"].items() if k not in _BUNDLE
                    }
            out.append(choice)
        body["choices"] = out
    body = copy.deepcopy(body)  # small now: no prompt ids, no per-token log-prob objects
    first = out[0] if isinstance(choices, list) and out and isinstance(out[0], dict) else {}
    message = body["choices"][0].get("message") if first else None
    items = (
        [{**message, "type": "message", "role": "assistant"}] if isinstance(message, dict) else []
    )
    rid = response.get("id")
    return extract.StrippedResponse(
        body,
        copy.deepcopy(items),
        rid if isinstance(rid, str) and rid else None,
        0 if items else None,
    )


def proposed_id_list(value: Any) -> list[int]:
    """``_id_list`` with the element checks done by C loops (``type`` set, ``min``)."""
    if value and not (set(map(type, value)) == {int} and min(value) >= 0):
        raise ValueError("not token ids")
    return list(value)


def _answer(prompt_tokens: int, gen_tokens: int) -> tuple[dict[str, Any], bytes]:
    engine = make_engine(gen_tokens, 4 * prompt_tokens + 4096)
    rng = random.Random(prompt_tokens)
    body = {
        "model": "smol",
        "messages": [
            {"role": "system", "content": text(rng, prompt_tokens - 80)},
            {"role": "user", "content": text(rng, 50)},
        ],
        "max_tokens": gen_tokens + 50,
        "temperature": 1.0,
    }

    async def post() -> bytes:
        transport = httpx.ASGITransport(app=engine.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            resp = await client.post("/v1/chat/completions", json=build_chat_upstream(body).body)
            resp.raise_for_status()
            return resp.content

    return body, asyncio.run(post())


def _ms(fn: Callable[[], Any], budget_s: float = 0.4) -> float:
    fn()
    n = 1
    while True:
        t = timeit.timeit(fn, number=n)
        if t > budget_s / 4 or n >= 512:
            break
        n *= 2
    best = min(timeit.repeat(fn, number=n, repeat=5))
    return best / n * 1e3


def proxy_steps(prompt_tokens: int = 16_000, gen_tokens: int = 300) -> dict[str, Any]:
    """Best-of-5 CPU ms per step for one call with a ``prompt_tokens`` prompt."""
    t0 = time.perf_counter()
    _, raw = _answer(prompt_tokens, gen_tokens)
    answer = json.loads(raw)
    payload = extract.extract_chat_tokens(answer)
    stripped = extract.strip_chat_response(answer)
    assert proposed_strip_chat_response(answer) == stripped, "proposed strip differs"
    ids = answer["prompt_token_ids"]
    assert proposed_id_list(ids) == extract._id_list(ids, "prompt_token_ids")
    entry = {
        "rollout_id": "r1",
        "model_call_id": "c1",
        "model": "smol",
        "prompt_token_ids": payload.prompt_token_ids,
        "generation_token_ids": payload.generation_token_ids,
        "generation_log_probs": payload.generation_log_probs,
        "output_items": stripped.output_items,
        "token_item_index": stripped.token_item_index,
        "response_id": stripped.response_id,
    }
    validated = coerce_entry(entry)
    steps = {
        "json.loads(upstream answer)": _ms(lambda: json.loads(raw)),
        "strip_chat_response": _ms(lambda: extract.strip_chat_response(answer)),
        "  of which copy.deepcopy(answer)": _ms(lambda: copy.deepcopy(answer)),
        "extract_chat_tokens": _ms(lambda: extract.extract_chat_tokens(answer)),
        "  of which _id_list(prompt ids)": _ms(lambda: extract._id_list(ids, "p")),
        "TokenEntry validation (coerce_entry)": _ms(lambda: coerce_entry(entry)),
        "  of which TokenEntry._shape int32 loop": _ms(lambda: TokenEntry._shape(validated)),
        "Ledger _prepare (pack + 3 digests)": _ms(lambda: _prepare(validated)),
    }
    proposed = {
        "strip_chat_response, arrays dropped before copying": _ms(
            lambda: proposed_strip_chat_response(answer)
        ),
        "_id_list with C-level checks": _ms(lambda: proposed_id_list(ids)),
        "int32 range check with min()/max()": _ms(
            lambda: min(ids) >= -(2**31) and max(ids) < 2**31
        ),
    }
    top = {k: v for k, v in steps.items() if not k.startswith("  ")}
    return {
        "prompt_tokens": len(ids),
        "answer_bytes": len(raw),
        "steps_ms": steps,
        "total_ms": sum(top.values()),
        "proposed_ms": proposed,
        "elapsed_s": time.perf_counter() - t0,
    }


if __name__ == "__main__":
    print(json.dumps(proxy_steps(), indent=2))
