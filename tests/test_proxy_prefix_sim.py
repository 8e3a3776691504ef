"""The simulated vLLM 0.32 honours ``kv_transfer_params.prompt_token_ids`` as vLLM 0.32 does
(``_reused_prompt_token_ids`` in ``vllm/renderers/online_renderer.py``): the ids are the
prompt, unrendered, and come back as ``prompt_token_ids``; they are ignored when ``echo`` is
set or a message has non-text content; malformed or out-of-vocabulary ids are a 400.  Stock
vLLM ignores ``required_prefix_token_ids``; the engine's opt-in NeMo RL extension honours it.
(The proxy-level tests of prefix supply are in ``test_proxy_prefix.py``.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from rollout_sim import ByteTokenizer, SimEngine

TOK = ByteTokenizer()
USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"


@pytest.fixture
def engine() -> SimEngine:
    return SimEngine(TOK, max_model_len=4096, seed=7)


@pytest.fixture
async def client(engine: SimEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(engine.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as c:
        yield c


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "smol", "messages": USER, "return_token_ids": True, **extra}


async def test_supplied_ids_are_the_prompt_and_are_echoed(
    engine: SimEngine, client: httpx.AsyncClient
) -> None:
    ids = TOK.encode("<|im_start|>user\nsomething else<|im_end|>\n<|im_start|>assistant\n")
    engine.script("Sure.")
    body = (await client.post(CHAT, json=chat(kv_transfer_params={"prompt_token_ids": ids}))).json()
    assert body["prompt_token_ids"] == ids
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["kv_transfer_params"] is None
    assert body["prompt_token_ids"] != TOK.render_chat(USER, None, True)


@pytest.mark.parametrize(
    "extra",
    [
        {"echo": True},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "see"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                    ],
                }
            ]
        },
    ],
    ids=["echo", "media"],
)
async def test_supplied_ids_are_ignored_with_echo_or_media(
    client: httpx.AsyncClient, extra: dict[str, Any]
) -> None:
    ids = TOK.encode("<|im_start|>assistant\n")
    sent = chat(kv_transfer_params={"prompt_token_ids": ids}, **extra)
    body = (await client.post(CHAT, json=sent)).json()
    assert body["prompt_token_ids"] == TOK.render_chat(sent["messages"], None, True)


@pytest.mark.parametrize(
    ("ids", "needle"),
    [
        ([], "non-empty list of non-negative integers"),
        ([1, -2], "non-empty list of non-negative integers"),
        ([1, True], "non-empty list of non-negative integers"),
        ("1,2", "non-empty list of non-negative integers"),
        ([1, TOK.vocab_size], f"Token id {TOK.vocab_size} is out of vocabulary"),
    ],
)
async def test_malformed_supplied_ids_are_a_400(
    client: httpx.AsyncClient, ids: Any, needle: str
) -> None:
    r = await client.post(CHAT, json=chat(kv_transfer_params={"prompt_token_ids": ids}))
    assert r.status_code == 400
    error = r.json()["error"]
    assert needle in error["message"]
    assert error["param"] == "kv_transfer_params.prompt_token_ids"


async def test_required_prefix_is_ignored_by_stock_vllm(client: httpx.AsyncClient) -> None:
    ref = TOK.encode("<|im_start|>system\nother<|im_end|>\n")
    body = (await client.post(CHAT, json=chat(required_prefix_token_ids=ref))).json()
    assert body["prompt_token_ids"] == TOK.render_chat(USER, None, True)


async def test_required_prefix_extension_replaces_the_matching_text() -> None:
    engine = SimEngine(TOK, max_model_len=4096, seed=7, required_prefix_extension=True)
    transport = httpx.ASGITransport(engine.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        rendered = TOK.render_chat(USER, None, True)
        ref = rendered[:5]
        body = (await client.post(CHAT, json=chat(required_prefix_token_ids=ref))).json()
        assert body["prompt_token_ids"] == rendered  # already starts with it: unchanged
        bad = TOK.encode("<|im_start|>system\nother")
        r = await client.post(CHAT, json=chat(required_prefix_token_ids=bad))
        assert r.status_code == 500
        assert "non-monotonically increasing trajectory" in r.json()["error"]["message"]
