"""Errors of the HTTP layer and the one place that turns every error into a JSON response.

Every error body is `{"error": {"code", "message"}}`; codes are stable and listed in `ERROR_CODES`.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from agent_store.core import StoreError
from app.headers import SECURITY_HEADERS
from app.metrics import count_store_error

log = logging.getLogger("agent_store.api")

ERROR_CODES: dict[str, tuple[int, str]] = {
    "invalid_json": (400, "the body is not a JSON object in UTF-8"),
    "unauthorized": (401, "no valid service token, or an invalid user token"),
    "forbidden": (403, "the user token may not act on this user's data"),
    "not_found": (404, "no such route, or no such conversation visible to the caller"),
    "method_not_allowed": (405, "the route exists but not with this method"),
    "conflict": (409, "the request contradicts what is stored"),
    "precondition_failed": (
        412,
        "If-Match names another conversation than the one under the id (deleted and started "
        "again since it was read); nothing was changed",
    ),
    "payload_too_large": (
        413,
        "the body is over the configured limit of bytes, or holds more JSON values than a body "
        "may (the message names the limit)",
    ),
    "unsupported_media_type": (415, "a body must be application/json"),
    "invalid_input": (422, "a path, query or body value is invalid; the message names it"),
    "internal_error": (500, "an unexpected failure; the server log has details"),
    "storage_failure": (500, "the database refused an operation"),
    "unsupported": (501, "the connected database cannot do this"),
    "storage_unavailable": (
        503,
        "the database is unreachable, or a turn lost every race with other writers (nothing "
        "written); retry as it is",
    ),
}
"""code → (HTTP status, when it is used)."""


class ApiErrorDetail(BaseModel):
    code: str
    """Stable, machine-readable; see the README's table."""
    message: str
    """What was wrong, for a person."""


class ApiErrorBody(BaseModel):
    """The body of every error response."""

    error: ApiErrorDetail


class HttpProblem(Exception):
    """A request refused by the HTTP layer itself (before or besides the store)."""

    code = "invalid_input"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def status(self) -> int:
        return ERROR_CODES[self.code][0]


class InvalidJson(HttpProblem):
    code = "invalid_json"


class Unauthorized(HttpProblem):
    code = "unauthorized"


class Forbidden(HttpProblem):
    code = "forbidden"


class PayloadTooLarge(HttpProblem):
    code = "payload_too_large"


class UnsupportedMediaType(HttpProblem):
    code = "unsupported_media_type"


class InvalidRequest(HttpProblem):
    """A query parameter or body field failed validation."""

    code = "invalid_input"


def error_response(status: int, code: str, message: str) -> JSONResponse:
    body = ApiErrorBody(error=ApiErrorDetail(code=code, message=message))
    # Set here too: a 500 is sent from outside every middleware.
    headers = dict(SECURITY_HEADERS)
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body.model_dump(), status, headers=headers)


def note_store_error(request: Request, exc: StoreError) -> None:
    """Count a store error, and log a server-side one with its cause (the driver's words,
    which the client never gets)."""
    count_store_error(request, exc)
    if exc.status >= 500:
        log.error("%s on %s %s", exc.code, request.method, request.url.path, exc_info=exc)


async def _store_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StoreError)
    note_store_error(request, exc)
    return error_response(exc.status, exc.code, exc.message)


async def _http_problem(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HttpProblem)
    return error_response(exc.status, exc.code, exc.message)


_STARLETTE_CODES = {
    400: "invalid_json",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_input",
}


async def _starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _STARLETTE_CODES.get(exc.status_code, "invalid_input")
    # Never the raw path or method: an error message does not repeat what the client sent.
    allowed = ", ".join(
        sorted(m for m in (exc.headers or {}).get("Allow", "").split(", ") if m != "HEAD")
    )
    message = {
        404: "no such route",
        405: f"this route accepts {allowed}",
    }.get(exc.status_code, exc.detail)
    response = error_response(exc.status_code, code, message)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client hung up before its body arrived: routine on any network; nothing was read,
    nothing is written, and the answer has no one to read it."""
    log.info("client disconnected during %s %s", request.method, request.url.path)
    return error_response(400, "invalid_input", "the client closed the request")


async def _unexpected(request: Request, exc: Exception) -> Response:
    if type(exc) is RuntimeError and isinstance(exc.__cause__, StoreError):
        return _store_error_after_the_start(request, exc.__cause__)
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal_error", "an unexpected error occurred")


def _store_error_after_the_start(request: Request, exc: StoreError) -> Response:
    """A store error raised while a streamed answer (a transcript, an export) was being sent,
    which Starlette raises again as a RuntimeError once the status is out: the client sees the
    answer cut (the connection closes before its end), and the metrics and the log see the
    store error it is, not an unexpected one. The response made here is never sent."""
    count_store_error(request, exc)
    server_side = exc.status >= 500
    log.log(
        logging.ERROR if server_side else logging.WARNING,
        "%s on %s %s after its answer started: it is cut",
        exc.code,
        request.method,
        request.url.path,
        exc_info=exc if server_side else None,
    )
    return error_response(exc.status, exc.code, exc.message)


EXCEPTION_HANDLERS = {
    StoreError: _store_error,
    HttpProblem: _http_problem,
    HTTPException: _starlette_error,
    ClientDisconnect: _client_gone,
    Exception: _unexpected,
}
