#!/usr/bin/env python3
"""Smoke-test a running vLLM server for the token-id fields the capture proxy relies on.

Stdlib only; any Python 3.11 works:

    python scripts/vllm-smoke.py                       # http://127.0.0.1:$VLLM_PORT (18000)
    python scripts/vllm-smoke.py --base-url "$(scripts/vllm-serve.sh)" --dump /tmp/smoke

Checks (wire-formats.md §1.2, §1.3, §1.8):
  1. plain chat completion with ``logprobs: true, top_logprobs: 0,
     return_tokens_as_token_ids: true, return_token_ids: true``:
     top-level ``prompt_token_ids`` (the §5.2 reference ids for this prompt), per-choice
     ``token_ids``, ``len(logprobs.content) == len(token_ids)``, every ``token_id:N`` equals
     ``token_ids[k]``, usage counts agree;
  2. the same with ``tools`` (a ``get_weather`` function) and ``tool_choice: "required"``;
  3. the plain request again with ``stream: true``: ``prompt_token_ids`` on the first chunk,
     concatenated ``token_ids`` deltas equal the non-streaming ids (greedy).
Exit status 0 when all pass, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REFERENCE_PROMPT_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
    407, 19712, 8182, 2, 198, 1, 4093, 198, 36218, 15876, 281, 1296, 1924, 30, 2, 198, 1, 520,
    9531, 198,
]  # fmt: skip

CAPTURE_FIELDS: dict[str, Any] = {
    "logprobs": True,
    "top_logprobs": 0,
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}


class SmokeError(AssertionError):
    pass


def check(cond: object, msg: str) -> None:
    if not cond:
        raise SmokeError(msg)


def post(base: str, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as e:
        raise SmokeError(f"POST {path} -> HTTP {e.code}: {e.read()[:2000]!r}") from e


def post_stream(base: str, path: str, body: dict[str, Any], timeout: float) -> list[Any]:
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        method="POST",
    )
    events: list[Any] = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                events.append("[DONE]" if data == "[DONE]" else json.loads(data))
    except urllib.error.HTTPError as e:
        raise SmokeError(f"POST {path} (stream) -> HTTP {e.code}: {e.read()[:2000]!r}") from e
    return events


def check_ids(resp: dict[str, Any], label: str) -> tuple[list[int], list[int]]:
    """The §1.2 invariants; returns (prompt_token_ids, token_ids)."""
    prompt_ids: Any = resp.get("prompt_token_ids")
    check(
        isinstance(prompt_ids, list) and len(prompt_ids) > 0,
        f"{label}: top-level prompt_token_ids missing or empty: {prompt_ids!r}",
    )
    check(all(isinstance(i, int) for i in prompt_ids), f"{label}: non-int prompt id")
    choices = resp.get("choices") or []
    check(len(choices) == 1, f"{label}: expected 1 choice, got {len(choices)}")
    choice = choices[0]
    ids: Any = choice.get("token_ids")
    check(
        isinstance(ids, list) and len(ids) > 0,
        f"{label}: choices[0].token_ids missing or empty: {ids!r}",
    )
    check(all(isinstance(i, int) for i in ids), f"{label}: non-int generated id")
    content: Any = (choice.get("logprobs") or {}).get("content")
    check(isinstance(content, list), f"{label}: choices[0].logprobs.content missing")
    check(
        len(content) == len(ids), f"{label}: {len(content)} logprob entries vs {len(ids)} token_ids"
    )
    for k, (entry, tid) in enumerate(zip(content, ids, strict=True)):
        check(
            entry.get("token") == f"token_id:{tid}",
            f"{label}: logprobs.content[{k}].token={entry.get('token')!r} but token_ids[{k}]={tid}",
        )
        check(isinstance(entry.get("logprob"), (int, float)), f"{label}: logprob[{k}] not a number")
        check(
            entry.get("top_logprobs") == [],
            f"{label}: top_logprobs[{k}] should be [] with top_logprobs: 0",
        )
    usage = resp.get("usage") or {}
    check(
        usage.get("prompt_tokens") == len(prompt_ids),
        f"{label}: usage.prompt_tokens={usage.get('prompt_tokens')} vs {len(prompt_ids)} ids",
    )
    check(
        usage.get("completion_tokens") == len(ids),
        f"{label}: usage.completion_tokens={usage.get('completion_tokens')} vs {len(ids)} ids",
    )
    return prompt_ids, ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_url = os.environ.get("VLLM_BASE_URL") or (
        f"http://127.0.0.1:{os.environ.get('VLLM_PORT', '18000')}"
    )
    ap.add_argument("--base-url", default=default_url, help=f"default {default_url}")
    ap.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--dump", type=Path, help="write each raw response as JSON into this dir")
    args = ap.parse_args()
    base = args.base_url.rstrip("/")

    def dump(name: str, obj: Any) -> None:
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{name}.json").write_text(json.dumps(obj, indent=2) + "\n")

    def say(msg: str) -> None:
        print(f"[vllm-smoke] {msg}", flush=True)

    failures = 0
    t_all = time.monotonic()
    try:
        with urllib.request.urlopen(base + "/version", timeout=10) as r:
            version = json.loads(r.read()).get("version")
    except (OSError, ValueError) as e:
        say(f"FAIL: {base} does not answer ({e}); start it with scripts/vllm-serve.sh")
        return 1
    say(f"server {base}, vLLM {version}")

    plain = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Say hi in three words."}],
        "max_tokens": 16,
        "temperature": 0,
        **CAPTURE_FIELDS,
    }
    plain_ids: list[int] | None = None

    # 1. plain
    try:
        t0 = time.monotonic()
        resp = post(base, "/v1/chat/completions", plain, args.timeout)
        dt = time.monotonic() - t0
        dump("chat_plain", resp)
        prompt_ids, plain_ids = check_ids(resp, "plain")
        check(
            prompt_ids == REFERENCE_PROMPT_IDS,
            f"plain: prompt_token_ids {prompt_ids} differ from the §5.2 reference ids",
        )
        c = resp["choices"][0]
        say(
            f"PASS plain ({dt:.2f} s): prompt {len(prompt_ids)} ids, generated {plain_ids} "
            f"finish={c.get('finish_reason')} content={c['message'].get('content')!r}"
        )
    except SmokeError as e:
        failures += 1
        say(f"FAIL plain: {e}")

    # 2. tools, tool_choice required
    try:
        body = {
            "model": "smol",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
            "max_tokens": 128,
            "temperature": 0,
            **CAPTURE_FIELDS,
        }
        t0 = time.monotonic()
        resp = post(base, "/v1/chat/completions", body, args.timeout)
        dt = time.monotonic() - t0
        dump("chat_tools_required", resp)
        prompt_ids, ids = check_ids(resp, "tools")
        c = resp["choices"][0]
        calls = c["message"].get("tool_calls") or []
        check(
            len(calls) >= 1,
            f"tools: no message.tool_calls (finish={c.get('finish_reason')}, "
            f"content={c['message'].get('content')!r})",
        )
        fn = calls[0]["function"]
        check(fn["name"] == "get_weather", f"tools: called {fn['name']!r}")
        parsed_args = json.loads(fn["arguments"])  # must be a JSON string
        if not isinstance(parsed_args, dict):
            # SmolLM2-135M is tiny: the hermes parser passes through whatever it wrote.
            say(f"NOTE tools: arguments decode to {type(parsed_args).__name__}, not an object")
        say(
            f"PASS tools ({dt:.2f} s): prompt {len(prompt_ids)} ids, {len(ids)} generated ids, "
            f"finish={c.get('finish_reason')}, call {fn['name']}({fn['arguments']}), "
            f"content={c['message'].get('content')!r}"
        )
    except (SmokeError, KeyError, ValueError) as e:
        failures += 1
        say(f"FAIL tools: {type(e).__name__}: {e}")

    # 3. streaming: ids arrive as deltas
    try:
        t0 = time.monotonic()
        events = post_stream(base, "/v1/chat/completions", {**plain, "stream": True}, args.timeout)
        dt = time.monotonic() - t0
        dump("chat_plain_stream", events)
        check(events and events[-1] == "[DONE]", "stream: does not end with data: [DONE]")
        chunks = [e for e in events if isinstance(e, dict)]
        check(bool(chunks), "stream: no chunks")
        check(
            chunks[0].get("prompt_token_ids") == REFERENCE_PROMPT_IDS,
            "stream: first chunk lacks the reference prompt_token_ids",
        )
        later = [c for c in chunks[1:] if c.get("prompt_token_ids") is not None]
        check(not later, f"stream: prompt_token_ids repeated on {len(later)} later chunks")
        sids: list[int] = []
        n_lp = 0
        for ch in chunks:
            for choice in ch.get("choices") or []:
                sids.extend(choice.get("token_ids") or [])
                lp = (choice.get("logprobs") or {}).get("content") or []
                for k, entry in enumerate(lp):
                    pos = n_lp + k
                    check(
                        pos < len(sids) and entry["token"] == f"token_id:{sids[pos]}",
                        f"stream: logprob entry {pos} {entry['token']!r} does not match ids",
                    )
                n_lp += len(lp)
        check(n_lp == len(sids), f"stream: {n_lp} logprob entries vs {len(sids)} ids")
        if plain_ids is not None:
            check(sids == plain_ids, f"stream: ids {sids} differ from non-stream {plain_ids}")
        say(f"PASS stream ({dt:.2f} s): {len(chunks)} chunks, {len(sids)} ids equal non-stream")
    except (SmokeError, KeyError) as e:
        failures += 1
        say(f"FAIL stream: {type(e).__name__}: {e}")

    took = time.monotonic() - t_all
    if failures:
        say(f"{failures} check(s) FAILED ({took:.1f} s)")
        return 1
    say(f"all checks passed ({took:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
