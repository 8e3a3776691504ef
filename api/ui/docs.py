"""The Swagger ``/docs`` page, served entirely from the installed package.

FastAPI's default page loads Swagger UI from a CDN (blank offline) and a favicon from
fastapi's web site.  Here the Swagger UI files come from the ``swagger-ui-bundle-v2`` wheel
(Swagger UI 5, which renders OpenAPI 3.1) and the page names no external URL.  The app must be
built with ``docs_url=None`` so this route is the only ``/docs``.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"


def swagger_dir() -> Path:
    import swagger_ui_bundle

    return Path(str(swagger_ui_bundle.swagger_ui_path))


def install_docs(app: FastAPI) -> None:
    """Serve ``/docs`` (Swagger UI) and its assets offline."""
    app.mount(ASSETS, StaticFiles(directory=swagger_dir()), name="swagger-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
            oauth2_redirect_url="/docs/oauth2-redirect",
            # The validator badge would fetch an image from validator.swagger.io.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
