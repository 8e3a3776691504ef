"""The one place that maps the ledger's exception tree to HTTP status codes, and the error
answers the OpenAPI document names for every ledger route; ``new_app`` makes an application
that answers in that shape (the service's and the audit page's)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from api.schemas import ErrorBody
from ledger.config import Settings
from ledger.errors import (
    AccessDenied,
    InvalidInput,
    LedgerError,
    NotFound,
    RolloutRetired,
    StateConflict,
    Unavailable,
)
from ledger.redact import redact_text

STATUS: list[tuple[type[LedgerError], int]] = [
    (RolloutRetired, 410),
    (StateConflict, 409),
    (NotFound, 404),
    (AccessDenied, 403),
    (InvalidInput, 422),
    (Unavailable, 503),
]


def error_response(description: str) -> dict[str, Any]:
    """An OpenAPI ``responses`` entry: the shared error body with a description."""
    return {"model": ErrorBody, "description": description}


COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    401: error_response("Missing or unknown bearer token."),
    403: error_response("The token lacks the scope this route needs."),
    413: error_response(
        "The request body exceeds max_body_bytes, or the record max_record_tokens."
    ),
    422: error_response("Invalid input; the message names the failing field."),
    503: error_response("The database cannot be reached."),
}


class BodyTooLarge(Exception):
    """Raised by the body-limit middleware (``api.app.BodyLimit``) when a body passes the limit."""


def status_for(exc: LedgerError) -> int:
    for cls, code in STATUS:
        if isinstance(exc, cls):
            return code
    return 500


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, **extra}}


def new_app(
    settings: Settings,
    *,
    title: str,
    summary: str,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]],
) -> FastAPI:
    """A rollout-ledger application: ``settings`` on its state, the ledger's error bodies
    (``install`` and ``install_http``), and no CDN-loaded /docs (``api.ui`` serves them)."""
    app = FastAPI(
        title=title,
        version="0.1.0",
        summary=summary,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    install(app)
    install_http(app)
    return app


def install(app: FastAPI) -> None:
    @app.exception_handler(LedgerError)
    async def _ledger_error(_request: Request, exc: LedgerError) -> JSONResponse:
        extra = {"rollout_id": exc.rollout_id} if exc.rollout_id else {}
        message = exc.message
        if isinstance(exc, Unavailable):
            # Driver messages append the SQL and its parameters: keep only the first line.
            message = message.split("\n", 1)[0]
        message = redact_text(message)  # a driver may name the database URL it tried
        return JSONResponse(error_body(exc.code, message, **extra), status_code=status_for(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors()[:10]:
            loc = ".".join(str(p) for p in err.get("loc", ()))
            problems.append({"field": loc, "message": str(err.get("msg", ""))})
        first = problems[0] if problems else {"field": "", "message": "invalid request"}
        return JSONResponse(
            error_body(
                "invalid_request",
                f"{first['field']}: {first['message']}" if first["field"] else first["message"],
                problems=problems,
            ),
            status_code=422,
        )


def install_http(app: FastAPI) -> None:
    """Give HTTPException (auth, size limits, not found) the same error body shape."""
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and _is_body_limit(exc.__cause__):
            # FastAPI wraps any error raised while it reads a body (here: the body-limit
            # middleware stopping a chunked upload) in a generic 400; restore the 413.
            limit = request.app.state.settings.max_body_bytes
            return JSONResponse(
                error_body(
                    "payload_too_large",
                    f"request body exceeds the configured limit of {limit} bytes (max_body_bytes)",
                ),
                status_code=413,
            )
        code = {
            400: "bad_request",
            401: "unauthorized",
            403: "forbidden",
            404: "not_found",
            405: "method_not_allowed",
            413: "payload_too_large",
            422: "invalid_request",
        }.get(exc.status_code, f"http_{exc.status_code}")
        return JSONResponse(
            error_body(code, str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )


def _is_body_limit(exc: BaseException | None) -> bool:
    return isinstance(exc, BodyTooLarge)
