"""The public documents: `/openapi.json`, an interactive API page at `/docs`, `/metrics`.

The page is Swagger UI, served from the files the `swagger-ui-bundle-v2` package
ships (no CDN): the browser fetches nothing from another site. Its start-up
script is this service's own file (`api_page/start.js`), so the page runs under a
Content-Security-Policy without inline scripts.
"""

from __future__ import annotations

import functools
from pathlib import Path

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route
from swagger_ui_bundle import swagger_ui_path

from app.auth import audit_record
from app.settings import Settings

_OWN_FILES = Path(__file__).resolve().parent / "api_page"
ASSETS: dict[str, tuple[Path, str]] = {
    "swagger-ui.css": (Path(swagger_ui_path) / "swagger-ui.css", "text/css"),
    "swagger-ui-bundle.js": (Path(swagger_ui_path) / "swagger-ui-bundle.js", "text/javascript"),
    "favicon-32x32.png": (Path(swagger_ui_path) / "favicon-32x32.png", "image/png"),
    "start.js": (_OWN_FILES / "start.js", "text/javascript"),
}
"""The only files `/docs/static/…` serves, by name."""

PAGE_HEADERS = {
    # Swagger UI sets inline styles on its elements; scripts come from this site only.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "Referrer-Policy": "same-origin",
}


async def openapi_document(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


async def metrics_page(request: Request) -> Response:
    """The Prometheus exposition; behind a service token when the settings say `token`."""
    state = request.app.state
    if state.metrics_exposure == "token":
        state.authenticator.authenticate(request.headers, audit_record(request.scope))
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def docs_page(request: Request) -> Response:
    html = _file(_OWN_FILES / "index.html").decode()
    return HTMLResponse(html, headers=PAGE_HEADERS)


async def docs_asset(request: Request) -> Response:
    found = ASSETS.get(request.path_params["name"])
    if found is None:
        return Response("not found", 404, media_type="text/plain")
    path, media_type = found
    headers = {"Cache-Control": "public, max-age=86400"}
    return Response(_file(path), media_type=media_type, headers=headers)


@functools.cache
def _file(path: Path) -> bytes:
    """A file of the API page, read once per process (they ship with the package)."""
    return path.read_bytes()


def public_routes(settings: Settings) -> list[BaseRoute]:
    """The routes of the documents the settings expose."""
    openapi, docs = settings.expose_openapi, settings.expose_docs
    routes: list[BaseRoute] = []
    if settings.metrics != "off":
        routes.append(Route("/metrics", metrics_page, methods=["GET"]))
    if openapi:
        routes.append(Route("/openapi.json", openapi_document, methods=["GET"]))
    if docs:
        routes.append(Route("/docs", docs_page, methods=["GET"]))
        routes.append(Route("/docs/static/{name}", docs_asset, methods=["GET"]))
    return routes
