"""Configuration: one YAML file, overridden by environment variables, overridden by CLI flags.

Secrets never live in the file: API tokens come from the environment variable named by
``auth.tokens_env`` (default ``ROLLOUT_LEDGER_TOKENS``), formatted
``TOKEN=scope,scope;TOKEN2=scope``.  Scopes: ingest, trainer, audit, admin.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ledger.engine import DEFAULT_DB_URL

__all__ = [
    "SCOPES",
    "CaptureConfig",
    "ConfigError",
    "NonGeneratingRoute",
    "Settings",
    "load_settings",
    "parse_tokens",
]

SCOPES = ("ingest", "trainer", "audit", "admin")
_METHOD_RE = re.compile(r"^[A-Za-z]+$")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the bad entry."""


class NonGeneratingRoute(BaseModel):
    """An exact (method, path) whose successful response cannot carry policy text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    path: str

    @field_validator("method", mode="before")
    @classmethod
    def _method(cls, v: Any) -> str:
        if not isinstance(v, str) or not _METHOD_RE.match(v):
            raise ValueError(f"method must be a string of ASCII letters; got {v!r}")
        return v.upper()

    @field_validator("path", mode="before")
    @classmethod
    def _path(cls, v: Any) -> str:
        if not isinstance(v, str) or not v.startswith("/"):
            raise ValueError(f"path must be a string starting with '/'; got {v!r}")
        bad = [c for c in "?#*{}" if c in v]
        if bad:
            raise ValueError(
                f"path must be exact (no wildcards, templates or query strings); {v!r} has {bad}"
            )
        return v


class CaptureConfig(BaseModel):
    """The seed's ``token_id_capture`` keys that apply to a standalone ledger."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    delta_records: bool = True
    rebuild_response: bool = True
    max_mask_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    mask_fraction_min_samples: int = Field(default=50, ge=0)


class AuthConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens_env: str = "ROLLOUT_LEDGER_TOKENS"
    allow_unauthenticated_remote: bool = False
    # Per-rollout capture capabilities (HMAC of the rollout id) are minted under this secret;
    # the proxy sends the key in ``upstream_key_env`` upstream, never what the harness presented.
    capture_secret_env: str = "ROLLOUT_LEDGER_CAPTURE_SECRET"
    upstream_key_env: str = "ROLLOUT_LEDGER_UPSTREAM_API_KEY"
    # Host names accepted besides loopback ones when no tokens are configured (DNS rebinding).
    allowed_hosts: list[str] = Field(default_factory=list)


class ServerConfig(BaseModel):
    """Connection limits of ``rollout-ledger serve`` (slow or idle clients cannot pile up)."""

    model_config = ConfigDict(extra="forbid")

    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=120.0, gt=0)
    # Longer than the clients' own idle pools (httpx 5 s, aiohttp and NeMo Gym's client 15 s,
    # Rust's reqwest/hyper 90 s: the Codex CLI's client keeps that default): a client reusing a
    # connection the server is closing that moment gets a reset instead of an answer (the
    # keep-alive race), so the client, not serve, should close idle ones.
    keep_alive_s: float = Field(default=120.0, gt=0)
    max_connections: int = Field(default=1024, ge=1)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    db: str = DEFAULT_DB_URL
    upstream: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    token_id_capture: CaptureConfig = Field(default_factory=CaptureConfig)
    sampling_overrides: dict[str, Any] | None = None
    token_id_capture_non_generating_requests: list[NonGeneratingRoute] = Field(default_factory=list)
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    upstream_connect_timeout_s: float = Field(default=10.0, gt=0)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    # Prompt + generation tokens one record may hold; unset: the upstream's context length
    # (vLLM's max_model_len, read at startup), else 262144.
    max_record_tokens: int | None = Field(default=None, gt=0)
    server: ServerConfig = Field(default_factory=ServerConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    # Prefix supply (issue 11): give a continuation whose parent is proven the parent's exact
    # cumulative tokens as its prompt prefix; see api/prefix.py and docs/integration.md.
    supply_prefix_token_ids: bool = False
    prefix_supply_backend: Literal["kv_transfer_params", "required_prefix_token_ids"] = (
        "kv_transfer_params"
    )
    tokens: dict[str, frozenset[str]] = Field(default_factory=dict, exclude=True)
    capture_secret: str | None = Field(default=None, exclude=True)
    upstream_api_key: str | None = Field(default=None, exclude=True)

    @model_validator(mode="after")
    def _prefix_supply(self) -> Settings:
        problems = prefix_supply_problems(self)
        if problems:
            raise ValueError("supply_prefix_token_ids: true is refused: " + "; ".join(problems))
        return self

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, v: str | None) -> str | None:
        """Accept the upstream with or without a trailing ``/v1`` (the proxy adds paths)."""
        if v is None or v == "":
            return None
        v = v.rstrip("/")
        if v.endswith("/v1"):
            v = v[: -len("/v1")]
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"upstream must be an http(s) URL; got {v!r}")
        return v


# Upstream request fields prefix supply sets or that make the engine ignore supplied ids.
_PREFIX_CONFLICTS = ("kv_transfer_params", "required_prefix_token_ids", "echo")


def prefix_supply_problems(settings: Settings) -> list[str]:
    """Why this configuration cannot serve prefix supply (empty when it can or it is off)."""
    if not settings.supply_prefix_token_ids:
        return []
    problems = []
    if not settings.token_id_capture.enabled:
        problems.append(
            "it needs token-id information (token_id_capture.enabled: true): the proof is the "
            "engine's generation-time prompt ids"
        )
    pinned = sorted(k for k in settings.sampling_overrides or {} if k in _PREFIX_CONFLICTS)
    if pinned:
        problems.append(
            f"sampling_overrides pins {pinned}, which would replace or disable the supplied prefix"
        )
    return problems


def parse_tokens(raw: str) -> dict[str, frozenset[str]]:
    """``TOKEN=scope,scope;TOKEN2=scope`` → {token: scopes}; unknown scopes are an error."""
    out: dict[str, frozenset[str]] = {}
    for part in filter(None, (p.strip() for p in raw.split(";"))):
        token, sep, scopes = part.partition("=")
        if not sep or not token.strip():
            raise ConfigError("API tokens must look like TOKEN=scope,scope;TOKEN2=scope")
        names = frozenset(s.strip() for s in scopes.split(",") if s.strip())
        unknown = names - set(SCOPES)
        if unknown or not names:
            got = sorted(unknown) or "none"
            raise ConfigError(f"API token scopes must be among {', '.join(SCOPES)}; got {got}")
        out[token.strip()] = names
    return out


_ENV = {
    "ROLLOUT_LEDGER_DB": "db",
    "ROLLOUT_LEDGER_UPSTREAM": "upstream",
    "ROLLOUT_LEDGER_HOST": "host",
    "ROLLOUT_LEDGER_PORT": "port",
}


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """File, then environment, then explicit overrides (``None`` values are ignored)."""
    data: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a mapping at the top level")
        data.update(loaded)
    for env, key in _ENV.items():
        if os.environ.get(env):
            data[key] = os.environ[env]
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        settings = Settings.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False):
            loc = ".".join(str(p) for p in err["loc"])
            lines.append(f"{loc}: {err['msg']}")
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None
    settings.tokens = parse_tokens(os.environ.get(settings.auth.tokens_env, ""))
    settings.capture_secret = os.environ.get(settings.auth.capture_secret_env) or None
    settings.upstream_api_key = os.environ.get(settings.auth.upstream_key_env) or None
    return settings
