"""The ledger API under ``/ledger/v1/``, one module per route family and scope:
``ingest``, ``trainer``, ``admin``, ``audit`` (in this order in the OpenAPI document).

Routes are thin: parse (bodies and answers in ``api.schemas``), call one ledger operation,
return its result.  The ledger's typed errors are mapped to HTTP once, in ``api.errors``.
"""

from __future__ import annotations

from fastapi import APIRouter

from api.routes import admin, audit, ingest, trainer

router = APIRouter()
for _family in (ingest, trainer, admin, audit):
    router.include_router(_family.router)

__all__ = ["router"]
