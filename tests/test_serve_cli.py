"""``rollout-ledger serve`` and authentication (issue #4 point 3).

With no API tokens the service listens on loopback only and says so; a non-loopback host is
refused (before anything is bound or migrated) unless ``--allow-unauthenticated`` is given.
``uvicorn.run`` is replaced by a recorder, so the refusal and the permissions are checked without
binding a socket; one test starts the app for real on a loopback port.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from typer.testing import CliRunner

from api.cli import app
from rollout_sim import ThreadedServer


@dataclass
class Recorder:
    calls: list[dict[str, Any]] = field(default_factory=list)
    serve_for_real: bool = False
    answers: list[tuple[int, str]] = field(default_factory=list)

    def __call__(self, asgi_app: Any, **kw: Any) -> None:
        self.calls.append(kw)
        if self.serve_for_real:
            # Serve on an ephemeral loopback port and ask a ledger route without a token.
            assert kw["host"] == "127.0.0.1"
            with ThreadedServer(asgi_app, lifespan="on", startup_timeout=60) as server:
                for path in ("/healthz", "/ledger/v1/stats"):
                    resp = httpx.get(server.url + path, timeout=30)
                    self.answers.append((resp.status_code, path))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    rec = Recorder()
    monkeypatch.setattr(uvicorn, "run", rec)
    for var in (
        "ROLLOUT_LEDGER_TOKENS",
        "ROLLOUT_LEDGER_HOST",
        "ROLLOUT_LEDGER_PORT",
        "ROLLOUT_LEDGER_DB",
        "ROLLOUT_LEDGER_UPSTREAM",
    ):
        monkeypatch.delenv(var, raising=False)
    yield rec


def flat(text: str) -> str:
    """The output with rich's line wrapping undone."""
    return " ".join(text.split())


def serve(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, ["serve", *args], env=env)


def test_non_loopback_without_tokens_is_refused_before_binding(
    recorder: Recorder, tmp_path: Path
) -> None:
    db = tmp_path / "never.db"
    for host in ("0.0.0.0", "10.1.2.3", "::"):
        result = serve("--host", host, "--db", f"sqlite+aiosqlite:///{db}")
        assert result.exit_code == 2, result.output
        out = flat(result.output)
        assert "no API tokens are configured" in out
        assert "ROLLOUT_LEDGER_TOKENS" in out
        assert f"open to the network on {host}" in out
        assert "--allow-unauthenticated" in out
    assert recorder.calls == []  # nothing was bound
    assert not db.exists()  # nor migrated


def test_loopback_without_tokens_starts_and_says_auth_is_off(
    recorder: Recorder, tmp_path: Path
) -> None:
    recorder.serve_for_real = True
    result = serve("--db", f"sqlite+aiosqlite:///{tmp_path / 'l.db'}", "--port", "0")
    assert result.exit_code == 0, result.output
    out = flat(result.output)
    assert "auth NONE (loopback only)" in out
    assert recorder.calls[0]["host"] == "127.0.0.1"
    # Really serving: ledger routes answer without a token.
    assert recorder.answers == [(200, "/healthz"), (200, "/ledger/v1/stats")]


@pytest.mark.parametrize("host", ["localhost", "::1"])
def test_other_loopback_names_are_allowed(recorder: Recorder, tmp_path: Path, host: str) -> None:
    result = serve("--host", host, "--db", f"sqlite+aiosqlite:///{tmp_path / 'h.db'}")
    assert result.exit_code == 0, result.output
    assert recorder.calls[0]["host"] == host


def test_allow_unauthenticated_permits_a_network_host(recorder: Recorder, tmp_path: Path) -> None:
    result = serve(
        "--host",
        "0.0.0.0",
        "--allow-unauthenticated",
        "--db",
        f"sqlite+aiosqlite:///{tmp_path / 'a.db'}",
    )
    assert result.exit_code == 0, result.output
    assert recorder.calls[0]["host"] == "0.0.0.0"
    assert "auth NONE" in flat(result.output)


def test_config_can_allow_unauthenticated_too(recorder: Recorder, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("auth:\n  allow_unauthenticated_remote: true\n")
    result = serve(
        "--host",
        "0.0.0.0",
        "--config",
        str(cfg),
        "--db",
        f"sqlite+aiosqlite:///{tmp_path / 'c.db'}",
    )
    assert result.exit_code == 0, result.output
    assert recorder.calls[0]["host"] == "0.0.0.0"


def test_unauthenticated_network_listen_is_not_called_loopback_only(
    recorder: Recorder, tmp_path: Path
) -> None:
    result = serve(
        "--host",
        "0.0.0.0",
        "--allow-unauthenticated",
        "--db",
        f"sqlite+aiosqlite:///{tmp_path / 'x.db'}",
    )
    assert result.exit_code == 0
    assert "loopback only" not in flat(result.output)


def test_tokens_from_the_environment_permit_a_network_host(
    recorder: Recorder, tmp_path: Path
) -> None:
    result = serve(
        "--host",
        "0.0.0.0",
        "--db",
        f"sqlite+aiosqlite:///{tmp_path / 't.db'}",
        env={
            "ROLLOUT_LEDGER_TOKENS": "secret-0123456789abcdef=ingest,trainer;"
            "ops-0123456789abcdef=audit"
        },
    )
    assert result.exit_code == 0, result.output
    assert "auth bearer tokens" in flat(result.output)
    assert "secret-0123" not in result.output  # the token itself is never printed
    assert recorder.calls[0]["host"] == "0.0.0.0"


def test_malformed_tokens_are_refused_with_the_format(recorder: Recorder, tmp_path: Path) -> None:
    for raw, needle in (("justatoken", "TOKEN=scope"), ("t=superuser", "scopes must be among")):
        result = serve(
            "--db",
            f"sqlite+aiosqlite:///{tmp_path / 'm.db'}",
            env={"ROLLOUT_LEDGER_TOKENS": raw},
        )
        assert result.exit_code != 0
        assert needle in flat(result.output), result.output
    assert recorder.calls == []
