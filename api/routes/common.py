"""What every ledger API route module shares: the path parameters, the ledger dependency and a
router factory (prefix ``/ledger/v1``, the scope tag and token check, the common error answers,
bounded JSON bodies)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from api.auth import require
from api.errors import COMMON_ERRORS
from api.limits import BoundedJsonRoute
from api.schemas import ID_PATTERN
from ledger.ids import MAX_ROLLOUT_ID_LEN
from ledger.store import Ledger

RolloutId = Annotated[
    str, Path(pattern=ID_PATTERN, max_length=MAX_ROLLOUT_ID_LEN, description="Rollout id.")
]
CallId = Annotated[str, Path(pattern=ID_PATTERN, max_length=200, description="Model call id.")]


def ledger_of(request: Request) -> Ledger:
    led: Ledger = request.app.state.ledger
    return led


LedgerDep = Annotated[Ledger, Depends(ledger_of)]


def ledger_router(scope: str) -> APIRouter:
    """A router for one family of ``/ledger/v1`` routes: each of its routes is tagged with
    ``scope`` and needs a token with that scope."""
    return APIRouter(
        prefix="/ledger/v1",
        tags=[scope],
        dependencies=[Depends(require(scope))],
        responses=COMMON_ERRORS,
        route_class=BoundedJsonRoute,
    )
