"""The audit web page at ``/ui`` and the JSON it reads (``/ui/api/...``, ``audit`` scope).

The page itself (HTML, JS, CSS under ``static/``) holds no data and needs no token; every JSON
endpoint checks the bearer token exactly as the ledger API's audit routes do.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from api.auth import require
from api.errors import COMMON_ERRORS
from api.routes.common import LedgerDep, RolloutId
from api.schemas import ID_PATTERN, REASON_PATTERN
from api.ui.tokens import Decoder
from ledger.audit_views import AuditViews, DriftWindow
from ledger.ids import MAX_ROLLOUT_ID_LEN
from ledger.store import Audit

STATIC = Path(__file__).parent / "static"
WINDOWS: dict[str, timedelta] = {
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(days=1),
    "7d": timedelta(days=7),
    "30d": timedelta(days=30),
}
Window = Literal["1h", "6h", "24h", "7d", "30d"]
# The page only talks to the server that served it; nothing loads from anywhere else.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

router = APIRouter(prefix="/ui", responses=COMMON_ERRORS)
api = APIRouter(
    prefix="/ui/api",
    tags=["audit page"],
    dependencies=[Depends(require("audit"))],
    responses=COMMON_ERRORS,
)


def _page() -> FileResponse:
    return FileResponse(
        STATIC / "index.html",
        media_type="text/html; charset=utf-8",
        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"},
    )


@router.get("", include_in_schema=False)
async def page() -> FileResponse:
    """The audit page (the data comes from ``/ui/api``)."""
    return _page()


@router.get("/", include_in_schema=False)
async def page_slash() -> RedirectResponse:
    return RedirectResponse("/ui", status_code=308)


def _json(value: Any) -> Any:
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    return value


@api.get("/health")
async def health(
    led: LedgerDep,
    window: Annotated[Window, Query(description="How far back to look.")] = "24h",
    buckets: Annotated[int, Query(ge=1, le=200, description="Number of time buckets.")] = 48,
) -> dict[str, Any]:
    """Calls captured, rollouts started, and latest builds by outcome and mask reason, per
    time bucket over the window; incomplete causes and consumers seen in it."""
    until = datetime.now(UTC)
    views = AuditViews(led)
    report = await views.health(since=until - WINDOWS[window], until=until, buckets=buckets)
    out: dict[str, Any] = _json(asdict(report))
    out["window"] = window
    return out


@api.get("/rollouts")
async def rollouts(
    led: LedgerDep,
    state: Literal["open", "frozen", "retired"] | None = None,
    outcome: Annotated[
        Literal["delivered", "masked", "failed", "none"] | None,
        Query(description="Latest build: delivered, masked (or failed), failed, none (unbuilt)."),
    ] = None,
    reason: Annotated[
        str | None,
        Query(
            max_length=64,
            pattern=REASON_PATTERN,
            description="A mask reason, incomplete cause or quarantine reason.",
        ),
    ] = None,
    consumer: Annotated[str | None, Query(max_length=200)] = None,
    window: Annotated[Window | None, Query(description="Changed within this window.")] = None,
    id_prefix: Annotated[
        str | None, Query(max_length=MAX_ROLLOUT_ID_LEN, pattern=ID_PATTERN)
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[
        str | None, Query(max_length=300, description="next_cursor of the previous page.")
    ] = None,
) -> dict[str, Any]:
    """Rollouts, most recently changed first, with their latest build and incomplete causes."""
    since = datetime.now(UTC) - WINDOWS[window] if window else None
    page = await AuditViews(led).rollouts(
        state=state,
        outcome=outcome,
        reason=reason,
        consumer=consumer,
        since=since,
        id_prefix=id_prefix,
        limit=limit,
        cursor=cursor,
    )
    return {"items": _json([asdict(i) for i in page.items]), "next_cursor": page.next_cursor}


def _tokens(ids: list[int], decoder: Decoder | None) -> list[dict[str, Any]]:
    if decoder is None:
        return [{"id": i} for i in ids]
    return [{"id": i, "text": decoder.piece(i)} for i in ids]


def _window_json(w: DriftWindow, decoder: Decoder | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "child": w.child,
        "parent": w.parent,
        "position": w.position,
        "kind": w.kind,
        "unavailable": w.unavailable,
        "shared_start": w.shared_start,
        "shared": _tokens(w.shared, decoder),
        "parent_next": _tokens(w.parent_next, decoder),
        "child_next": _tokens(w.child_next, decoder),
        "decoded": None,
    }
    if decoder is not None and w.unavailable is None:
        out["decoded"] = {
            "shared": decoder.decode(w.shared),
            "parent_next": decoder.decode(w.parent_next),
            "child_next": decoder.decode(w.child_next),
        }
    return out


@api.get("/rollouts/{rollout_id}")
async def rollout(
    request: Request,
    rollout_id: RolloutId,
    led: LedgerDep,
    context: Annotated[int, Query(ge=1, le=200, description="Tokens each side.")] = 12,
) -> dict[str, Any]:
    """One rollout: calls, lineage edges (with proof method), drift windows, quarantines,
    incomplete events and deliveries with their receipts."""
    detail = await Audit(led).rollout_detail(rollout_id)
    decoder: Decoder | None = getattr(request.app.state, "ui_tokenizer", None)
    windows = await AuditViews(led).drift_windows(rollout_id, detail["edges"], context=context)
    detail["drift"] = [_window_json(w, decoder) for w in windows]
    source = getattr(decoder, "source", None) if decoder is not None else None
    # The file and its folder (e.g. smollm2/tokenizer.json), not the server's full path.
    detail["tokenizer"] = "/".join(Path(source).parts[-2:]) if source else None
    return detail


def install_ui(app: FastAPI, *, tokenizer: Decoder | None = None) -> None:
    """Mount the page, its static files and its JSON endpoints on ``app``.

    Call before any catch-all route (the proxy's), so ``/ui`` paths win."""
    app.state.ui_tokenizer = tokenizer
    app.include_router(router)
    app.include_router(api)
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
