"""The audit web page (``/ui``) and the offline Swagger page (``/docs``).

``install(app)`` adds both to an app built with ``docs_url=None``; ``create_ui_app`` builds the
small read-only app that ``rollout-ledger ui`` serves on a laptop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api import errors
from api.ui.docs import install_docs
from api.ui.routes import install_ui
from api.ui.tokens import Decoder, tokenizer_from_env
from ledger.config import Settings
from ledger.store import Ledger

__all__ = ["create_ui_app", "install"]


def install(app: FastAPI, *, tokenizer: Decoder | None = None) -> None:
    """Serve ``/ui`` and an offline ``/docs`` from ``app`` (the tokenizer defaults to the one
    ``ROLLOUT_LEDGER_TOKENIZER`` names)."""
    install_ui(app, tokenizer=tokenizer if tokenizer is not None else tokenizer_from_env())
    install_docs(app)


def create_ui_app(
    settings: Settings, *, tokenizer: Decoder | None = None, ledger: Ledger | None = None
) -> FastAPI:
    """The audit page alone over ``settings.db``: reads only, never migrates the database."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = ledger is None
        app.state.ledger = ledger or Ledger(settings.db)
        try:
            yield
        finally:
            if own:
                await app.state.ledger.close()

    app = errors.new_app(
        settings,
        title="rollout-ledger audit",
        summary="The audit page of a rollout ledger (read-only).",
        lifespan=lifespan,
    )
    install_ui(app, tokenizer=tokenizer)
    install_docs(app)
    return app
