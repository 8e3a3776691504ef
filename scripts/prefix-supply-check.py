"""Prefix supply against a real vLLM (issue 11): tool-using multi-turn rollouts through
`rollout-ledger serve`, delivered vs masked, with prefix supply on and off.

    python scripts/prefix-supply-check.py --vllm http://127.0.0.1:18020 --rollouts 6

Each rollout is a tool loop driven by the real OpenAI or Anthropic SDK: two forced tool calls
(`tool_choice` names the tool, so a call always comes whatever the model), tool results, and
a final answer; every third rollout cuts its first answer turn with a small `max_tokens`
before going on.  The harness asks for log-probs, so it sees the sampled ids (`token_id:N`)
and log-probs of every answer: a delivered chain is checked against exactly those (0 wrong
tokens), never against model text.  Prints one JSON summary per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ledger.delivery import finalize_rollout_token_capture
from ledger.store import Ledger

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Kyoto", "Cairo", "Quito", "Perth"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, deadline_s: float = 60) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy")


def sampled(choice_logprobs: Any) -> tuple[list[int], list[float]]:
    ids, lps = [], []
    for entry in choice_logprobs.content or []:
        ids.append(int(entry.token.removeprefix("token_id:")))
        lps.append(entry.logprob)
    return ids, lps


def openai_rollout(base: str, city: str, cut: bool) -> tuple[str, list[int], list[float]]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="sk", max_retries=2)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a travel assistant. Use the tools."},
        {"role": "user", "content": f"What is the weather and the time in {city}?"},
    ]
    gen: list[int] = []
    lps: list[float] = []
    last = ""
    plan: list[tuple[Any, int]] = [({"type": "function", "function": {"name": "get_weather"}}, 96)]
    if cut:
        plan.append(("none", 3))  # an answer cut by max_tokens, then the loop goes on
    plan += [({"type": "function", "function": {"name": "get_time"}}, 96), ("none", 24)]
    for choice, max_tokens in plan:
        answer = client.chat.completions.create(
            model="smol",
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,
            max_tokens=max_tokens,
            temperature=0.7,
            logprobs=True,
        )
        last = answer.id
        ids, values = sampled(answer.choices[0].logprobs)
        gen += ids
        lps += values
        message = answer.choices[0].message
        turn: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            turn["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        messages.append(turn)
        for call in message.tool_calls or []:
            result = f"{call.function.name}: 18C" if "weather" in call.function.name else "09:00"  # type: ignore[union-attr]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if not message.tool_calls:
            # A forced call cut by max_tokens comes back as text; the harness nudges and goes on.
            messages.append({"role": "user", "content": "Go on, use the tools."})
    return last, gen, lps


def anthropic_rollout(base: str, city: str) -> tuple[str, list[int], list[float]]:
    """The Anthropic SDK loop; it cannot ask for log-probs, so only the rollout outcome counts."""
    client = anthropic.Anthropic(base_url=base, api_key="sk", max_retries=2)
    tools = [
        {
            "name": t["function"]["name"],  # type: ignore[index]
            "description": t["function"]["description"],  # type: ignore[index]
            "input_schema": t["function"]["parameters"],  # type: ignore[index]
        }
        for t in TOOLS
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"What is the weather and the time in {city}?"}
    ]
    last = ""
    for name in ("get_weather", "get_time", None):
        choice = {"type": "tool", "name": name} if name else {"type": "none"}
        message = client.messages.create(
            model="smol",
            max_tokens=96 if name else 24,
            system="You are a travel assistant. Use the tools.",
            messages=messages,  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
        )
        last = message.id
        blocks = [b.model_dump(exclude_none=True) for b in message.content]
        messages.append({"role": "assistant", "content": blocks})
        uses = [b for b in message.content if b.type == "tool_use"]
        if uses:
            results = [
                {"type": "tool_result", "tool_use_id": u.id, "content": "18C"}
                for u in uses  # type: ignore[union-attr]
            ]
            messages.append({"role": "user", "content": results})
        else:
            messages.append({"role": "user", "content": "Go on, use the tools."})
    return last, [], []


async def finalize(db: str, rollout_id: str, response_id: str) -> dict[str, Any]:
    led = Ledger(db)
    try:
        result: dict[str, Any] = {
            "_ng_rollout_id": rollout_id,
            "response": {"id": response_id, "output": []},
        }
        build = await finalize_rollout_token_capture(result, led)
        assert build is not None
        return {"result": result, "build": build}
    finally:
        await led.close()


def run_mode(vllm: str, rollouts: int, supply: bool, workdir: Path) -> dict[str, Any]:
    port = free_port()
    db = f"sqlite+aiosqlite:///{workdir / f'ledger-{int(supply)}.db'}"
    config = workdir / f"config-{int(supply)}.yaml"
    config.write_text(f"supply_prefix_token_ids: {str(supply).lower()}\n")
    log = (workdir / f"serve-{int(supply)}.log").open("w")
    exe = Path(sys.executable).with_name("rollout-ledger")
    cmd = [str(exe), "serve", "--config", str(config), "--db", db]
    cmd += ["--upstream", vllm + "/v1", "--port", str(port)]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[1]
    )
    url = f"http://127.0.0.1:{port}"
    outcome: dict[str, Any] = {"supply": supply, "delivered": 0, "masked": 0, "wrong_tokens": 0}
    reasons: dict[str, int] = {}
    try:
        wait_healthy(url)
        for i in range(rollouts):
            rid = f"check-{int(supply)}-{i}-{os.getpid()}"
            base = f"{url}/ng-rollout/{rid}/training-token-capture"
            city = CITIES[i % len(CITIES)]
            if i % 4 == 3:
                last, gen, lps = anthropic_rollout(base, city)
            else:
                last, gen, lps = openai_rollout(base, city, cut=i % 3 == 2)
            done = asyncio.run(finalize(db, rid, last))
            build, result = done["build"], done["result"]
            if build["outcome"] == "delivered":
                outcome["delivered"] += 1
                carriers = [o for o in result["response"]["output"] if "generation_token_ids" in o]
                got = [t for c in carriers for t in c["generation_token_ids"]]
                got_lps = [v for c in carriers for v in c["generation_log_probs"]]
                if gen and (got != gen or got_lps != lps):
                    outcome["wrong_tokens"] += 1
            else:
                outcome["masked"] += 1
                for reason in build["mask_reasons"]:
                    reasons[reason] = reasons.get(reason, 0) + 1
        metrics = httpx.get(url + "/metrics").text
        outcome["counters"] = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("rollout_ledger_prefix_supply_") and "_created" not in line
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    outcome["mask_reasons"] = reasons
    outcome["rollouts"] = rollouts
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", required=True, help="base URL of a running vLLM (no /v1)")
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--modes", default="on,off", help="on, off or both (on,off)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prefix-check-") as tmp:
        for mode in args.modes.split(","):
            summary = run_mode(args.vllm, args.rollouts, mode == "on", Path(tmp))
            print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    main()
