"""Issue #14: the audit page in a real browser (Debian's headless ``chromium``, driven by
Playwright with that binary as its executable; never a browser Playwright downloads).

A harness re-serialises a tool call's arguments through the capture proxy (the simulated vLLM
with SmolLM2's real tokenizer and template), so the ledger stores a drifted edge; finalizing
masks the rollout.  The page asks for the audit token, lists the masked rollout with its
reason, opens it, and shows its calls and the drift position, with SmolLM2's decoded text on
both sides.  Every request the page makes goes to the ledger that served it.

SQLite only: the page is the same over both backends, and its JSON endpoints are tested on
SQLite and Postgres in ``tests/test_ui_api.py``.  Without chromium or playwright the test
skips locally with the reason and fails under ``CI=true``.  With
``ROLLOUT_LEDGER_UI_SCREENSHOT=docs/ui-rollout.png`` it refreshes the screenshots in the docs
(that file and ``ui-overview.png`` beside it).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ledger import migrate
from ledger.store import Ledger
from rollout_sim import SimEngine
from tests.helpers.ui_seed import first_mismatch, seed_delivered, seed_masked_drift
from tests.proxy_support import Stack, start_stack
from tests.support.smollm2 import cache_dir, load_smollm2_tokenizer

Rid = Callable[[str], str]
TOKEN = "browser-audit-token"
# The harness writes through the proxy, which wants a capture credential once tokens are set.
INGEST_TOKEN = "ui-ingest-token-0123456789"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}


def chromium_path() -> str:
    """Debian's chromium, or a loud skip (a failure under CI=true, where .ci/run installs it)."""
    path = os.environ.get("ROLLOUT_LEDGER_CHROMIUM") or shutil.which("chromium")
    problem = None
    if not path:
        problem = (
            "no `chromium` on PATH: install Debian's package (apt-get install -y chromium) "
            "or set ROLLOUT_LEDGER_CHROMIUM to a Chromium binary"
        )
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            problem = "the playwright package is missing: pip install -e '.[test]'"
    if problem is None:
        assert path is not None
        return path
    message = f"BROWSER TEST NOT RUN: {problem}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
def smol_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    """Proxy + simulated vLLM (SmolLM2 tokenizer) on a fresh SQLite ledger, audit tokens on,
    the page decoding with the same tokenizer.json."""
    smol = load_smollm2_tokenizer()
    monkeypatch.setenv("ROLLOUT_LEDGER_TOKENS", f"{TOKEN}=audit;{INGEST_TOKEN}=ingest")
    monkeypatch.setenv("ROLLOUT_LEDGER_TOKENIZER", str(cache_dir() / "tokenizer.json"))
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    migrate.upgrade(url)
    engine = SimEngine(smol, model_name="smol", max_model_len=8192, seed=11)
    yield from start_stack(url, engine=engine)


def drifted_tool_loop(stack: Stack, rollout_id: str) -> int:
    """Two calls whose conversation continues but whose tokens do not; the drift position,
    computed from the engine's own answers."""
    client = openai.OpenAI(
        base_url=stack.base(rollout_id) + "/v1", api_key=INGEST_TOKEN, max_retries=0
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    stack.engine.script_tool_call("get_weather", {"city": "Paris", "days": 2})
    first = client.chat.completions.create(model="smol", messages=messages, tools=[TOOL])  # type: ignore[arg-type, list-item]
    call: Any = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    # The harness writes the arguments back its own way: keys reversed, no spaces.
    rewritten = json.dumps(
        dict(sorted(json.loads(call.function.arguments).items(), reverse=True)),
        separators=(",", ":"),
    )
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": rewritten},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18C, sunny"},
    ]
    stack.engine.script("It is 18C and sunny in Paris.")
    client.chat.completions.create(model="smol", messages=messages, tools=[TOOL])  # type: ignore[arg-type, list-item]
    parent, child = stack.sampled[0], stack.sampled[1]
    return first_mismatch(
        parent["prompt_token_ids"] + parent["choices"][0]["token_ids"], child["prompt_token_ids"]
    )


def test_the_page_lists_a_masked_rollout_opens_it_and_shows_the_drift(
    smol_stack: Stack, rid: Rid, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    executable = chromium_path()
    stack = smol_stack
    r = rid("weather")
    expected_pos = drifted_tool_loop(stack, r)
    build = stack.finalize(
        {"_ng_rollout_id": r, "reward": 0.0, "response": {"id": "unmatched", "output": []}},
        consumer="grpo-trainer",
    )
    assert build["outcome"] == "masked" and build["mask_reasons"]
    reason = build["mask_reasons"][0]
    detail = stack.detail(r)
    assert detail is not None
    call_ids = [c["model_call_id"] for c in detail["calls"]]
    assert len(call_ids) == 2

    neighbour, failing = rid("tools"), rid("flaky")

    async def neighbours() -> None:
        led = Ledger(stack.db_url)
        try:
            await seed_delivered(led, neighbour, consumer="grpo-trainer")
            await seed_masked_drift(led, failing, consumer="grpo-trainer")
        finally:
            await led.close()

    asyncio.run(neighbours())

    requested: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1320, "height": 900})
            # Waits, not limits: a loaded CI machine can take seconds to render.
            page.set_default_timeout(60_000)
            expect.set_options(timeout=60_000)
            page.on("request", lambda req: requested.append(req.url))
            page.goto(stack.url + "/ui")
            # No token yet: the page asks for one, keeps it in sessionStorage, and retries.
            expect(page.locator("#token-dialog")).to_be_visible()
            page.fill("#token-input", TOKEN)
            page.click("#token-save")
            row = page.locator(f'tr[data-rollout="{r}"]')
            expect(row).to_be_visible()
            expect(row.locator("td.reasons")).to_contain_text(reason)
            expect(row).to_contain_text("masked")
            expect(row).to_contain_text("grpo-trainer")
            expect(page.locator("#health-totals")).to_contain_text("calls captured")
            # The cause behind a mask (an upstream error) is shown next to the mask reasons.
            cause = page.locator(f'tr[data-rollout="{failing}"] td.reasons .badge.cause')
            expect(cause).to_have_text("upstream_error")
            expect(page.locator("#health")).to_contain_text("upstream_error")
            expect(page.locator("#health svg rect").first).to_be_visible()
            overview = tmp_path / "ui-overview.png"
            page.screenshot(path=str(overview), full_page=True)

            # The reason filter keeps it; another reason filters it out.
            page.fill('input[name="reason"]', "missing_token_ids")
            page.click('#filters button[type="submit"]')
            expect(page.locator("#list-status")).to_contain_text("No rollout matches")
            page.fill('input[name="reason"]', reason)
            page.click('#filters button[type="submit"]')
            expect(row).to_be_visible()

            row.locator("a").click()
            expect(page.locator("#rollout-id")).to_have_text(r)
            for call_id in call_ids:
                expect(page.locator(f'#calls tr[data-call="{call_id}"]')).to_be_visible()
                expect(page.locator(f'#call-graph [data-call="{call_id}"]')).to_have_count(1)
            expect(page.locator("#call-graph")).to_contain_text(f"drift @ {expected_pos}")
            expect(page.locator("#drift .drift-pos")).to_have_text(str(expected_pos))
            # SmolLM2's text on both sides of the mismatch: the arguments as sampled
            # ({"city"...) and as the harness wrote them back ({"days"...).
            expect(page.locator("#drift .decoded").first).to_contain_text("city")
            expect(page.locator("#drift .decoded").nth(1)).to_contain_text("days")
            shot = tmp_path / "ui-rollout.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if target := os.environ.get("ROLLOUT_LEDGER_UI_SCREENSHOT"):
                shutil.copyfile(shot, target)
                shutil.copyfile(overview, Path(target).with_name("ui-overview.png"))

            # The token survives a reload in this tab.
            page.reload()
            expect(page.locator("#rollout-id")).to_have_text(r)

            # The delivered neighbour: its quarantined retry and every delivery receipt.
            page.goto(f"{stack.url}/ui#/rollout/{neighbour}")
            expect(page.locator("#quarantines")).to_contain_text("retry_not_kept")
            expect(page.locator("#quarantines")).to_contain_text("c0-abandoned")
            receipt = page.locator("#deliveries tbody tr").first
            expect(receipt).to_contain_text("delivered")
            cells = receipt.locator("td")  # ... built, handed off, durable ack, retired, ...
            for i in (5, 6, 7, 8):
                expect(cells.nth(i)).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d "))

            # /docs renders Swagger UI from the package.
            page.goto(stack.url + "/docs")
            expect(page.locator(".swagger-ui .opblock").first).to_be_visible()
        finally:
            browser.close()
    outside = [u for u in requested if not u.startswith((stack.url + "/", "data:"))]
    assert outside == [], outside
    assert any(u.startswith(stack.url + "/ui/api/rollouts/") for u in requested)


def test_a_missing_chromium_skips_locally_and_fails_under_ci(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("ROLLOUT_LEDGER_CHROMIUM", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="BROWSER TEST NOT RUN: no `chromium`"):
        chromium_path()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="BROWSER TEST NOT RUN: no `chromium`"):
        chromium_path()
