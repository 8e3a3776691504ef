"""The README quickstart runs as written (issue 14 point 9), and ``rollout-ledger sim`` makes
tool calls when tools are offered.

The quickstart's commands are read from README.md (between ``<!-- quickstart -->`` markers)
and run by bash in an empty directory, as a user would after installing: only the install line
is skipped (the test already runs inside that environment) and the two ports are swapped for
free ones.  Then a second rollout under a retired id shows the proxy's client error (point 8).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_cli import ROOT, Served, clean_env, cli, free_port

README = ROOT / "README.md"


def quickstart_blocks() -> tuple[str, str]:
    text = README.read_text()
    section = text.split("<!-- quickstart -->", 1)[1].split("<!-- /quickstart -->", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)
    python = re.search(r"```python\n(.*?)```", section, re.S)
    assert bash and python, "README quickstart must hold a bash and a python block"
    return bash.group(1), python.group(1)


@pytest.fixture
def served() -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for s in started:
        s.stop()


def test_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    bash, agent = quickstart_blocks()
    sim_port, proxy_port = free_port(), free_port()
    assert "pip install" in bash.splitlines()[0]
    script = "\n".join(bash.splitlines()[1:])  # the install line: this venv already has it
    script = script.replace(". .venv/bin/activate", "")
    script = script.replace("8000", str(sim_port)).replace("8080", str(proxy_port))
    (tmp_path / "quickstart_agent.py").write_text(agent.replace("8080", str(proxy_port)))
    bindir = str(Path(sys.executable).parent)
    env = clean_env(PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    # Background jobs are the quickstart's own servers: stop them (by pid) when bash exits.
    wrapped = f"set -e\ntrap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n{script}"
    res = subprocess.run(
        ["bash", "-c", wrapped],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (row,) = [json.loads(x) for x in (tmp_path / "rebuilt.jsonl").read_text().splitlines()]
    assert "mask_sample" not in row, row.get("_ng_token_capture")
    items = row["response"]["output"]
    assert any(i.get("type") == "function_call" for i in items)  # the sim called the tool
    generated = [i for i in items if i.get("generation_token_ids")]
    assert generated and all(
        len(i["generation_token_ids"]) == len(i["generation_log_probs"]) for i in generated
    )
    assert row["_ng_token_capture"]["n_calls"] >= 2
    assert row["_ng_rollout_id"] in res.stdout  # audit list shows it


def test_a_retired_rollout_id_is_a_client_error_the_sdk_does_not_retry(
    tmp_path: Path, served: list[Served]
) -> None:
    """Point 8: reusing a retired (or frozen) id answers 400 with a message, not 503/409."""
    import openai

    db = f"sqlite+aiosqlite:///{tmp_path / 'l.db'}"
    sim = Served("sim", probe="/v1/models")
    served.append(sim)
    proxy = Served("serve", "--db", db, "--upstream", sim.url + "/v1")
    served.append(proxy)
    _, agent = quickstart_blocks()
    agent = agent.replace("http://127.0.0.1:8080", proxy.url)
    agent = re.sub(
        r'rollout_id = f"qs-\{uuid.uuid4\(\).hex\[:8\]\}"', 'rollout_id = "qs-once"', agent
    )
    (tmp_path / "agent.py").write_text(agent)
    run = subprocess.run(
        [sys.executable, "agent.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    res = cli(
        "collect",
        "--db",
        db,
        "-i",
        str(tmp_path / "results.jsonl"),
        "-o",
        str(tmp_path / "out.jsonl"),
    )
    assert res.returncode == 0, res.stderr

    requests: list[httpx.Request] = []
    client = openai.OpenAI(
        base_url=f"{proxy.url}/ng-rollout/qs-once/training-token-capture/v1",
        api_key="unused",
        max_retries=3,
        http_client=httpx.Client(event_hooks={"request": [requests.append]}),
    )
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 400
    assert "rollout qs-once is retired" in str(info.value) and "new id" in str(info.value)
    assert len(requests) == 1  # not retried

    # A frozen (not yet retired) rollout: the same kind of answer.
    frozen = httpx.post(f"{proxy.url}/ledger/v1/rollouts/qs-frozen/freeze", json={})
    assert frozen.status_code == 200, frozen.text
    resp = httpx.post(
        f"{proxy.url}/ng-rollout/qs-frozen/training-token-capture/v1/chat/completions",
        json={"model": "smol", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert resp.status_code == 400 and resp.headers["x-should-retry"] == "false"
    assert resp.json()["error"]["code"] == "rollout_frozen"
    assert "is frozen" in resp.json()["error"]["message"]


def test_sim_calls_an_offered_tool_then_answers_after_its_result(served: list[Served]) -> None:
    sim = Served("sim", "--model", "smol", probe="/v1/models")
    served.append(sim)
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer"}, "q": {"type": "string"}},
                "required": ["n", "q"],
            },
        },
    }
    ask = [{"role": "user", "content": "look it up"}]
    first = httpx.post(
        f"{sim.url}/v1/chat/completions",
        json={"model": "smol", "messages": ask, "tools": [tool], "logprobs": True},
        timeout=30,
    ).json()
    message = first["choices"][0]["message"]
    (call,) = message["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "lookup" and isinstance(args["n"], int)
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    follow = [
        *ask,
        {"role": "assistant", "content": message.get("content"), "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "42"},
    ]
    second = httpx.post(
        f"{sim.url}/v1/chat/completions",
        json={"model": "smol", "messages": follow, "tools": [tool]},
        timeout=30,
    ).json()
    assert not second["choices"][0]["message"].get("tool_calls")
    assert second["choices"][0]["message"]["content"]
    # Without tools it never calls one.
    plain = httpx.post(
        f"{sim.url}/v1/chat/completions", json={"model": "smol", "messages": ask}, timeout=30
    ).json()
    assert not plain["choices"][0]["message"].get("tool_calls")
