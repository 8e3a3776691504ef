"""Bearer tokens with scopes (ingest, trainer, audit, admin) for the ledger API.

Tokens come from the environment (see ``ledger.config``).  With no tokens configured every
ledger route is open, and ``rollout-ledger serve`` then refuses to listen beyond loopback unless
``--allow-unauthenticated`` is given.  Proxy routes are guarded by ``api.capability``: with
tokens configured they need a per-rollout capture capability (or an ingest token), and the
harness's credential is never forwarded upstream.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

# Declares the scheme in the OpenAPI contract; the checks below do the work (and say why).
bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="ledgerToken",
    description="An API token from ROLLOUT_LEDGER_TOKENS with the scope the route names "
    "(ingest, trainer, audit; admin may do everything).",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]


def scopes_of(tokens: dict[str, frozenset[str]], presented: str) -> frozenset[str] | None:
    """The scopes of a presented token (every token compared in constant time), or None."""
    found: frozenset[str] | None = None
    for token, scopes in tokens.items():
        if hmac.compare_digest(token.encode(), presented.encode()):
            found = scopes
    return found


def require(scope: str) -> Callable[..., Awaitable[None]]:
    async def check(request: Request, _credentials: Credentials) -> None:
        tokens: dict[str, frozenset[str]] = request.app.state.settings.tokens
        if not tokens:
            return
        header = request.headers.get("authorization", "")
        kind, _, presented = header.partition(" ")
        if kind.lower() != "bearer" or not presented:
            raise HTTPException(
                401,
                detail=f"missing bearer token: this route needs a token with the '{scope}' scope",
                headers={"WWW-Authenticate": "Bearer"},
            )
        scopes = scopes_of(tokens, presented)
        if scopes is None:
            raise HTTPException(
                401, detail="unknown bearer token", headers={"WWW-Authenticate": "Bearer"}
            )
        if scope not in scopes and "admin" not in scopes:
            raise HTTPException(403, detail=f"this token lacks the '{scope}' scope")

    return check
