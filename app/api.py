"""The HTTP face of the store (Starlette). Routes are thin: parse, call one method, shape."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.errors import StoreError
from app.models import messages_adapter
from app.service import Store, open_store
from app.settings import Settings


class ApiError(BaseModel):
    code: str
    message: str


def error_response(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": ApiError(code=code, message=message).model_dump()}, status)


async def _store_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StoreError)
    return error_response(exc.status, exc.code, exc.message)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}
    return error_response(exc.status_code, code.get(exc.status_code, "http_error"), exc.detail)


def _authorize(request: Request) -> None:
    tokens: Sequence[str] = request.app.state.service_tokens
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    presented = token.strip().encode()
    # Compare with every configured token so timing does not reveal which one nearly matched.
    matches = [hmac.compare_digest(presented, t.encode()) for t in tokens]
    if scheme.lower() != "bearer" or not any(matches):
        raise HTTPException(401, "a valid service bearer token is required")


def _store(request: Request) -> Store:
    _authorize(request)
    store: Store = request.app.state.store
    return store


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def transcript(request: Request) -> Response:
    store = _store(request)
    conversation_id = request.path_params["conversation_id"]
    messages = await store.conversations.transcript(conversation_id)
    data: list[Any] = messages_adapter.dump_python(messages, mode="json", by_alias=True)
    return JSONResponse({"conversation_id": conversation_id, "data": data})


def create_app(settings: Settings, *, store: Store | None = None) -> Starlette:
    """The application. Pass `store` to serve an existing one (tests do); else it connects."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if store is not None:
            yield
            return
        async with open_store(settings) as opened:
            app.state.store = opened
            yield

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/conversations/{conversation_id}/transcript", transcript),
        ],
        exception_handlers={StoreError: _store_error, HTTPException: _http_error},
        lifespan=lifespan,
    )
    app.state.service_tokens = list(settings.service_tokens)
    if store is not None:
        app.state.store = store
    return app
