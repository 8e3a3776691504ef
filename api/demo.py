"""``rollout-ledger demo``: the whole lifecycle on a laptop, with a simulated engine.

A scripted agent (a title side call, a tool-using turn, a retried turn, a final answer) talks to
the capture proxy, which talks to the built-in *simulated* vLLM engine; the ledger is a SQLite
file.  Then the rollout is frozen, rebuilt and delivered, and the captured calls, the rebuilt
chain and the health table are printed.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from api.app import create_app
from ledger.config import load_settings
from ledger.delivery import finalize_rollout_token_capture, retire_rollout_token_capture
from ledger.store import Audit, Ledger
from rollout_sim import ByteTokenizer, SimEngine, ThreadedServer

REAL_VLLM_HINT = (
    "rollout-ledger serve --upstream http://127.0.0.1:8000/v1   "
    "# in front of a real `vllm serve MODEL --enable-auto-tool-choice --tool-call-parser hermes`"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _script(engine: SimEngine) -> None:
    engine.script("Weather in Paris")  # the harness's title-generation side call
    engine.script_tool_call("get_weather", {"city": "Paris"}, content="Let me check.")
    engine.script("It is sunny, 2")  # first attempt at the answer: the harness retries it
    engine.script("It is sunny and 21 C in Paris today.")


def _chat(
    client: httpx.Client, base: str, messages: list[dict[str, Any]], **kw: Any
) -> dict[str, Any]:
    resp = client.post(
        f"{base}/v1/chat/completions", json={"model": "smol", "messages": messages, **kw}
    )
    resp.raise_for_status()
    data: dict[str, Any] = resp.json()
    return data


def run_agent(proxy_url: str, rollout_id: str) -> dict[str, Any]:
    """The scripted harness; returns the rollout result a verifier would score."""
    base = f"{proxy_url}/ng-rollout/{rollout_id}/training-token-capture"
    question = {"role": "user", "content": "What is the weather in Paris?"}
    with httpx.Client(timeout=60) as client:
        _chat(client, base, [{"role": "user", "content": f"Title for: {question['content']}"}])
        first = _chat(client, base, [question], tools=[WEATHER_TOOL])
        call = first["choices"][0]["message"]
        messages = [
            question,
            {"role": "assistant", "content": call["content"], "tool_calls": call["tool_calls"]},
            {
                "role": "tool",
                "tool_call_id": call["tool_calls"][0]["id"],
                "content": json.dumps({"temp_c": 21, "sky": "sunny"}),
            },
        ]
        _chat(client, base, messages, tools=[WEATHER_TOOL])  # abandoned by the harness: a retry
        final = _chat(client, base, messages, tools=[WEATHER_TOOL])
    text = final["choices"][0]["message"]["content"]
    return {
        "_ng_rollout_id": rollout_id,
        "reward": 1.0,
        "response": {
            "id": final["id"],
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text}],
                }
            ],
        },
    }


async def _deliver(
    db_url: str, result: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], bool]:
    led = Ledger(db_url)
    try:
        detail_before = await Audit(led).rollout_detail(result["_ng_rollout_id"])
        build = await finalize_rollout_token_capture(result, led, consumer="demo")
        assert build is not None
        retired = await retire_rollout_token_capture(result["_ng_rollout_id"], led, build)
        return detail_before, build, retired
    finally:
        await led.close()


def _calls_table(detail: dict[str, Any]) -> Table:
    t = Table(title="captured calls (ledger)")
    for col in ("call", "prompt", "generated", "parent (proven by tokens)", "stored prompt"):
        t.add_column(col)
    for c in detail["calls"]:
        t.add_row(
            c["model_call_id"][:8],
            str(c["prompt_len"]),
            str(c["generation_len"]),
            (c["parent_call_id"] or "root")[:8],
            "suffix only (delta)" if c["prompt_is_delta"] else "full",
        )
    return t


def _chain_table(result: dict[str, Any]) -> Table:
    t = Table(title="rebuilt chain (response.output)")
    for col in ("item", "type", "prompt tokens", "generated", "first log-probs", "text"):
        t.add_column(col)
    for i, item in enumerate(result["response"]["output"]):
        gen = item.get("generation_token_ids")
        lps = item.get("generation_log_probs") or []
        text = ""
        if item.get("type") == "message":
            parts = item.get("content") or []
            text = " ".join(p.get("text", "") for p in parts if isinstance(p, dict))
        elif item.get("type") == "function_call":
            text = f"{item.get('name')}({item.get('arguments')})"
        t.add_row(
            str(i),
            str(item.get("type")),
            str(len(item["prompt_token_ids"])) if gen is not None else "",
            str(len(gen)) if gen is not None else "",
            ", ".join(f"{x:.2f}" for x in lps[:3]),
            text[:48],
        )
    return t


def _health_table(metrics: dict[str, Any], retired: bool) -> Table:
    t = Table(title="health (_ng_token_capture)")
    t.add_column("field")
    t.add_column("value")
    t.add_column("healthy")
    checks = {
        "n_calls": ("> 1 for a tool-using rollout", metrics.get("n_calls", 0) > 1),
        "chains": ("1, or more with an attributed terminal", True),
        "delivered_fraction": ("1.0, lower when side calls are excluded", True),
        "quarantined_calls": ("0 unless retries were set aside", True),
        "empty_generation_calls": ("0", metrics.get("empty_generation_calls") == 0),
        "unresolved_parent_calls": ("0", metrics.get("unresolved_parent_calls") == 0),
        "capture_incomplete": ("false", metrics.get("capture_incomplete") is False),
    }
    for key, (hint, ok) in checks.items():
        t.add_row(key, json.dumps(metrics.get(key)), ("ok  " if ok else "LOOK ") + hint)
    ta = metrics.get("terminal_attribution") or {}
    t.add_row("terminal_attribution", f"{ta.get('method')} → {ta.get('chain')}", "delivered")
    t.add_row("mask_reasons", json.dumps(metrics.get("mask_reasons")), "[]")
    t.add_row("records retired after delivery", json.dumps(retired), "true")
    return t


def run_demo(db: str | None = None, console: Console | None = None) -> dict[str, Any]:
    """Run the scripted demo; returns the delivered rollout result.

    Each run uses a fresh rollout id (so a second run on the same ``--db`` works) and removes
    its temporary directory (and the default SQLite ledger in it) when it ends.
    """
    console = console or Console()
    workdir = Path(tempfile.mkdtemp(prefix="rollout-ledger-demo-"))
    try:
        return _run_demo(db, console, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_demo(db: str | None, console: Console, workdir: Path) -> dict[str, Any]:
    db_url = db or f"sqlite+aiosqlite:///{workdir / 'demo.db'}"
    rollout_id = f"demo-{uuid.uuid4().hex[:8]}"
    console.print(
        Panel.fit(
            "[bold yellow]The inference engine in this demo is SIMULATED[/] (a built-in fake "
            "vLLM with a byte-level tokenizer).\n"
            "The proxy, the ledger and the rebuild are the real ones.\n"
            f"For a real vLLM:  [bold]{REAL_VLLM_HINT}[/]",
            title="rollout-ledger demo",
        )
    )
    engine = SimEngine(ByteTokenizer(), model_name="smol", max_model_len=8192, seed=1)
    _script(engine)
    with ThreadedServer(engine.app) as upstream:
        settings = load_settings(db=db_url, upstream=upstream.url)
        with ThreadedServer(create_app(settings), lifespan="on", startup_timeout=60) as proxy:
            console.print(f"engine {upstream.url} · proxy {proxy.url} · ledger {db_url}")
            result = run_agent(proxy.url, rollout_id)
    detail, build, retired = asyncio.run(_deliver(db_url, result))
    console.print(_calls_table(detail))
    console.print(_chain_table(result))
    console.print(_health_table(result["_ng_token_capture"], retired))
    verdict = (
        "[green]delivered[/]" if build["outcome"] == "delivered" else f"[red]{build['outcome']}[/]"
    )
    console.print(f"rollout {rollout_id}: {verdict}; the chain above is what a trainer reads.")
    return result
