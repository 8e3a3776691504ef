"""Issue #14, the audit web page: its JSON endpoints, auth, the offline /docs page and the
``rollout-ledger ui`` command, on SQLite and Postgres.

Rollouts are written through real ledger operations (``tests/helpers/ui_seed.py``); the drift
position and the tokens around it are computed in the test from the tokens that were written,
independently of the ledger's diagnosis.  The page itself is driven in a real browser in
``tests/test_ui_browser.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.ui import create_ui_app
from api.ui.tokens import TokenizerError, load_tokenizer
from ledger.config import load_settings, parse_tokens
from ledger.store import Ledger
from tests.helpers.ui_seed import seed_delivered, seed_masked_drift
from tests.support.net import free_port as _free_port

Rid = Callable[[str], str]
AUDIT = {"Authorization": "Bearer aud-token"}
TOKENS = "aud-token=audit;ing-token=ingest;adm-token=admin"


@pytest.fixture
async def client(ledger: Ledger, db_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The app ``serve`` runs (proxy + ledger API + page), with audit tokens configured."""
    settings = load_settings(db=db_url)
    settings.tokens = parse_tokens(TOKENS)
    app = create_app(settings, ledger=ledger)
    app.state.ledger = ledger  # ASGITransport runs no lifespan
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ui.test") as c:
        yield c


async def get(client: httpx.AsyncClient, path: str, **params: Any) -> Any:
    resp = await client.get(path, params=params, headers=AUDIT)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def test_a_masked_drifted_rollout_is_listed_with_its_reason_and_cause(
    client: httpx.AsyncClient, ledger: Ledger, rid: Rid
) -> None:
    before = await get(client, "/ui/api/health", window="1h")
    masked, good = rid("uimask"), rid("uigood")
    seeded = await seed_masked_drift(ledger, masked, consumer="trainer-a")
    await seed_delivered(ledger, good, consumer="trainer-b")
    assert seeded.build["outcome"] == "masked"
    mask_reasons = seeded.build["mask_reasons"]
    assert mask_reasons

    page = await get(client, "/ui/api/rollouts", id_prefix=masked)
    [row] = page["items"]
    assert row["rollout_id"] == masked
    assert (row["outcome"], row["mask_reasons"]) == ("masked", mask_reasons)
    assert row["causes"] == ["upstream_error"]
    assert (row["state"], row["incomplete"], row["consumer"]) == ("frozen", True, "trainer-a")
    assert row["n_calls"] == 2  # captured calls; the third never got a record

    # Filters: the cause, the mask reason, outcome, state and consumer each find it (or not).
    async def ids(**filters: Any) -> set[str]:
        got = await get(client, "/ui/api/rollouts", limit=500, **filters)
        return {i["rollout_id"] for i in got["items"]}

    assert masked in await ids(reason="upstream_error")
    assert good not in await ids(reason="upstream_error")
    assert good in await ids(reason="retry_not_kept")  # a quarantine reason
    assert masked not in await ids(reason="retry_not_kept")
    assert masked in await ids(reason=mask_reasons[0])
    assert masked not in await ids(reason="missing_token_ids")
    assert masked in await ids(outcome="masked", window="1h")
    assert good not in await ids(outcome="masked")
    assert good in await ids(outcome="delivered", state="retired")
    assert masked not in await ids(state="retired")
    assert masked in await ids(consumer="trainer-a")
    assert masked not in await ids(consumer="trainer-b")
    assert good in await ids(consumer="trainer-b")

    # Health over the last hour grew by exactly these two rollouts.
    after = await get(client, "/ui/api/health", window="1h")
    t0, t1 = before["totals"], after["totals"]
    assert t1["delivered"] - t0["delivered"] == 1
    assert t1["masked"] - t0["masked"] == 1
    assert t1["calls_captured"] - t0["calls_captured"] == 5
    assert t1["rollouts_started"] - t0["rollouts_started"] == 2
    for reason in mask_reasons:
        grown = t1["masked_by_reason"].get(reason, 0) - t0["masked_by_reason"].get(reason, 0)
        assert grown == 1, reason
    grown = after["incomplete_by_reason"].get("upstream_error", 0) - before[
        "incomplete_by_reason"
    ].get("upstream_error", 0)
    assert grown == 1
    assert {"trainer-a", "trainer-b"} <= set(after["consumers"])
    # The buckets add up to the totals and cover the window in order.
    assert sum(b["delivered"] for b in after["buckets"]) == t1["delivered"]
    assert sum(b["calls_captured"] for b in after["buckets"]) == t1["calls_captured"]
    starts = [datetime.fromisoformat(b["start"]) for b in after["buckets"]]
    width = timedelta(seconds=after["bucket_s"])
    assert all(b - a == width for a, b in itertools.pairwise(starts))
    assert starts[0] <= datetime.fromisoformat(after["since"])
    assert starts[-1] + width > datetime.fromisoformat(after["until"])


async def test_the_rollout_view_shows_calls_edges_drift_and_receipts(
    client: httpx.AsyncClient, ledger: Ledger, rid: Rid
) -> None:
    r = rid("uiview")
    seeded = await seed_masked_drift(ledger, r)
    d = await get(client, f"/ui/api/rollouts/{r}", context=4)
    assert [c["model_call_id"] for c in d["calls"]] == seeded.calls
    assert [c["status"] for c in d["calls"]] == ["captured", "captured", "cancelled"]
    [edge] = d["edges"]
    assert (edge["parent"], edge["child"]) == (seeded.calls[0], seeded.calls[1])
    assert (edge["method"], edge["status"]) == ("conversation", "drifted")
    pos = seeded.drift_position
    assert edge["mismatch_pos"] == pos == len(seeded.child_prompt) - 5
    [w] = d["drift"]
    assert (w["child"], w["parent"], w["position"]) == (seeded.calls[1], seeded.calls[0], pos)
    assert w["unavailable"] is None
    assert [t["id"] for t in w["shared"]] == seeded.child_prompt[pos - 4 : pos]
    assert [t["id"] for t in w["shared"]] == seeded.parent_sequence[pos - 4 : pos]
    assert [t["id"] for t in w["parent_next"]] == seeded.parent_sequence[pos : pos + 4]
    assert [t["id"] for t in w["child_next"]] == seeded.child_prompt[pos : pos + 4]
    assert w["parent_next"][0]["id"] != w["child_next"][0]["id"]
    assert w["decoded"] is None and d["tokenizer"] is None  # no tokenizer configured
    [event] = d["incomplete_events"]
    assert (event["model_call_id"], event["reason"]) == (seeded.calls[2], "upstream_error")
    [delivery] = d["deliveries"]
    assert delivery["outcome"] == "masked" and delivery["handed_off_at"] is not None
    assert delivery["durable_ack_at"] is None and delivery["retired_at"] is None

    good = rid("uireceipt")
    await seed_delivered(ledger, good)
    d = await get(client, f"/ui/api/rollouts/{good}")
    assert [(e["method"], e["status"]) for e in d["edges"]] == [("token_prefix", "verified")]
    [q] = d["quarantines"]
    assert (q["model_call_id"], q["reason"]) == ("c0-abandoned", "retry_not_kept")
    assert q["delivery_id"] == d["deliveries"][0]["id"]
    [delivery] = d["deliveries"]
    assert delivery["outcome"] == "delivered"
    for receipt in ("built_at", "handed_off_at", "durable_ack_at", "retired_at"):
        assert delivery[receipt] is not None, receipt
    assert d["drift"] == []


async def test_drift_tokens_of_a_retired_rollout_say_why_they_are_gone(
    client: httpx.AsyncClient, ledger: Ledger, rid: Rid
) -> None:
    r = rid("uiretired")
    seeded = await seed_masked_drift(ledger, r)
    # Retire it as an operator would after diagnosis: its token payloads are deleted.
    state = await ledger.get_state(r)
    assert await ledger.retire(r, snapshot_id=state.snapshot_id or "", version=state.version)
    d = await get(client, f"/ui/api/rollouts/{r}")
    [w] = d["drift"]
    assert w["position"] == seeded.drift_position
    assert w["unavailable"] and w["shared"] == [] and w["parent_next"] == []


async def test_unknown_rollouts_and_bad_filters_are_client_errors(
    client: httpx.AsyncClient, rid: Rid
) -> None:
    resp = await client.get(f"/ui/api/rollouts/{rid('absent')}", headers=AUDIT)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    for params in (
        {"reason": "Bogus Reason"},
        {"state": "melted"},
        {"window": "2y"},
        {"cursor": "not-a-cursor"},
    ):
        resp = await client.get("/ui/api/rollouts", params=params, headers=AUDIT)
        assert resp.status_code == 422, (params, resp.text)
        assert resp.json()["error"]["message"]


async def test_pages_of_rollouts_follow_the_cursor_without_repeats(
    client: httpx.AsyncClient, ledger: Ledger, rid: Rid
) -> None:
    prefix = rid("uipage")
    for i in range(5):
        await ledger.begin_call(f"{prefix}-{i}", "c0")
    seen: list[str] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"id_prefix": prefix, "limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = await get(client, "/ui/api/rollouts", **params)
        seen += [i["rollout_id"] for i in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert sorted(seen) == [f"{prefix}-{i}" for i in range(5)]
    assert len(seen) == len(set(seen))
    unbuilt = await get(client, "/ui/api/rollouts", id_prefix=prefix, outcome="none")
    assert len(unbuilt["items"]) == 5


async def test_json_endpoints_need_the_audit_scope_and_the_page_does_not(
    client: httpx.AsyncClient,
) -> None:
    for path in ("/ui/api/health", "/ui/api/rollouts", "/ui/api/rollouts/x-1"):
        resp = await client.get(path)
        assert resp.status_code == 401, path
        assert "audit" in resp.json()["error"]["message"]
        resp = await client.get(path, headers={"Authorization": "Bearer wrong"})
        assert resp.status_code == 401, path
        resp = await client.get(path, headers={"Authorization": "Bearer ing-token"})
        assert resp.status_code == 403, path
        assert "'audit' scope" in resp.json()["error"]["message"]
    for token in ("aud-token", "adm-token"):
        resp = await client.get("/ui/api/rollouts", headers={"Authorization": f"Bearer {token}"})
        assert resp.status_code == 200
    # The page and its files hold no data: they load without a token, from this server only.
    page = await client.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)
    for asset in ("/ui/static/app.js", "/ui/static/app.css"):
        resp = await client.get(asset)
        assert resp.status_code == 200 and len(resp.content) > 1000, asset
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", resp.text), asset


async def test_docs_page_names_no_external_url(client: httpx.AsyncClient) -> None:
    resp = await client.get("/docs")
    assert resp.status_code == 200
    html = resp.text
    assert "SwaggerUIBundle" in html
    assert not re.findall(r"https?://", html), re.findall(r"https?://\S+", html)
    assets = re.findall(r"(?:src|href)=['\"]([^'\"]+)['\"]", html)
    assert {a.rsplit("/", 1)[-1] for a in assets} >= {
        "swagger-ui-bundle.js",
        "swagger-ui.css",
        "favicon-32x32.png",
    }
    for asset in assets:
        got = await client.get(asset)
        assert got.status_code == 200 and len(got.content) > 500, asset
    assert '"validatorUrl": null' in html  # no badge fetched from validator.swagger.io
    spec = (await client.get("/openapi.json")).json()
    assert "/ui/api/rollouts" in spec["paths"]


# --------------------------------------------------------------------------- tokenizer


def test_a_missing_or_broken_tokenizer_file_is_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer file"):
        load_tokenizer(tmp_path / "absent.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match=r"not a tokenizer\.json"):
        load_tokenizer(tmp_path)


async def test_drift_tokens_are_decoded_with_a_real_tokenizer(
    ledger: Ledger, db_url: str, rid: Rid
) -> None:
    from tests.support.smollm2 import cache_dir, load_smollm2_tokenizer

    smol = load_smollm2_tokenizer()  # fetches and converts SmolLM2's tokenizer once
    decoder = load_tokenizer(cache_dir() / "tokenizer.json")
    r = rid("uidecode")
    seeded = await seed_masked_drift(ledger, r)
    settings = load_settings(db=db_url)
    app = create_ui_app(settings, tokenizer=decoder, ledger=ledger)
    app.state.ledger = ledger
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://ui.test"
    ) as c:
        d = (await c.get(f"/ui/api/rollouts/{r}", params={"context": 6})).json()
    [w] = d["drift"]
    pos = seeded.drift_position
    assert d["tokenizer"] == "smollm2/tokenizer.json"
    assert w["decoded"] == {
        "shared": smol.decode(seeded.child_prompt[pos - 6 : pos]),
        "parent_next": smol.decode(seeded.parent_sequence[pos : pos + 6]),
        "child_next": smol.decode(seeded.child_prompt[pos : pos + 6]),
    }
    assert [t["text"] for t in w["parent_next"]] == [
        smol.decode([i]) for i in seeded.parent_sequence[pos : pos + 6]
    ]


# --------------------------------------------------------------------------- `ui` command


def _cli() -> list[str]:
    exe = Path(sys.executable).with_name("rollout-ledger")
    assert exe.exists(), f"the console entry point is not installed next to {sys.executable}"
    return [str(exe)]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LEDGER_")}
    env.update(extra)
    return env


def test_ui_command_serves_the_page_over_an_existing_ledger(db_url: str, rid: Rid) -> None:
    r = rid("uicli")

    async def seed() -> None:
        led = Ledger(db_url)
        try:
            await seed_masked_drift(led, r)
        finally:
            await led.close()

    asyncio.run(seed())
    port = _free_port()
    proc = subprocess.Popen(
        [*_cli(), "ui", "--db", db_url, "--port", str(port)],
        env=_env(ROLLOUT_LEDGER_TOKENS="cli-audit=audit"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(base + "/ui", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "rollout-ledger ui did not start in 60 s"
            time.sleep(0.1)  # polling a readiness probe with a deadline
        assert httpx.get(base + "/ui/api/rollouts", timeout=10).status_code == 401
        got = httpx.get(
            base + "/ui/api/rollouts",
            params={"id_prefix": r},
            headers={"Authorization": "Bearer cli-audit"},
            timeout=10,
        ).json()
        assert [i["rollout_id"] for i in got["items"]] == [r]
        assert "https://" not in httpx.get(base + "/docs", timeout=10).text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_ui_command_refuses_a_missing_ledger_in_one_line(tmp_path: Path) -> None:
    """No database is involved: the command refuses before it would read one."""
    missing = tmp_path / "absent.db"
    done = subprocess.run(
        [*_cli(), "ui", "--db", f"sqlite+aiosqlite:///{missing}"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    out = (done.stdout + done.stderr).strip()
    assert "no ledger at" in out and "Traceback" not in out
    assert len(out.splitlines()) == 1, out
    assert not missing.exists()  # the viewer never creates a database

    bare = tmp_path / "bare.db"
    bare.write_bytes(b"")
    done = subprocess.run(
        [*_cli(), "ui", "--db", f"sqlite+aiosqlite:///{bare}"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "no ledger at" in done.stderr and "Traceback" not in done.stderr

    done = subprocess.run(
        [*_cli(), "ui", "--db", "sqlite:///x.db", "--host", "0.0.0.0"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no API tokens are configured" in done.stderr

    done = subprocess.run(
        [*_cli(), "ui", "--db", "sqlite:///x.db", "--log-level", "loud"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--log-level must be one of" in done.stderr
    assert "Traceback" not in done.stderr


def test_every_static_file_ships_in_the_wheel() -> None:
    """The page is served from package data: each file under api/ui/static must be declared."""
    import fnmatch
    import tomllib

    from api.ui.routes import STATIC

    root = Path(__file__).resolve().parent.parent
    declared = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["api.ui"]
    files = sorted(p.name for p in STATIC.iterdir() if p.is_file())
    assert {"index.html", "app.js", "app.css"} <= set(files)
    for name in files:
        assert any(fnmatch.fnmatch(f"static/{name}", g) for g in declared), name
