"""A first end-to-end pass: OpenAI SDK → proxy → simulated vLLM → ledger → rebuilt chain."""

from __future__ import annotations

from collections.abc import Callable

import openai

from tests.proxy_support import Stack, delivered, sampled_chain

Rid = Callable[[str], str]


def test_openai_chat_two_turns_rebuild_exactly(stack: Stack, rid: Rid) -> None:
    r = rid("smoke")
    client = openai.OpenAI(base_url=stack.base(r) + "/v1", api_key="sk-test", max_retries=0)
    stack.engine.script("Hello there.")
    msgs = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model="smol", messages=msgs)  # type: ignore[arg-type]
    assert first.choices[0].message.content == "Hello there."
    assert not hasattr(first, "prompt_token_ids") or first.prompt_token_ids is None  # type: ignore[attr-defined]
    msgs += [{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "more"}]
    stack.engine.script("Sure.")
    second = client.chat.completions.create(model="smol", messages=msgs)  # type: ignore[arg-type]
    result = {"_ng_rollout_id": r, "response": {"id": second.id, "output": []}}
    build = stack.finalize(result)
    assert build["outcome"] == "delivered", build["mask_reasons"]
    assert delivered(result) == sampled_chain(stack, [0, 1])
