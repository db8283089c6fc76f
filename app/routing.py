"""Routes declared as data: how one endpoint is called, validated and described.

The same `Endpoint` declaration builds the Starlette route, validates its
path, query and body, and feeds `/openapi.json` (app/openapi.py).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from agent_store.core import describe_validation_error
from agent_store.store import validate_identifier
from app.api_models import NoBody, NoQuery
from app.auth import Caller, audit_record
from app.etags import version_named
from app.http_errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from app.json_body import decode_body
from app.service import Store

Q = TypeVar("Q", bound=BaseModel)
B = TypeVar("B", bound=BaseModel)


@dataclass(frozen=True)
class Call(Generic[Q, B]):
    """One validated request, as a handler sees it."""

    request: Request
    store: Store
    caller: Caller
    path: dict[str, str]
    """Path parameters, each a validated identifier."""
    query: Q
    body: B

    @property
    def conversation_id(self) -> str:
        return self.path["conversation_id"]

    @property
    def scope(self) -> str | None:
        """The user whose data this request may see: None for a service acting alone."""
        return self.caller.user_id


Handler = Callable[[Call[Any, Any]], Awaitable[Response]]
ResponseShapes = Mapping[int, type[BaseModel] | Mapping[str, type[BaseModel]]]


@dataclass(frozen=True)
class Endpoint:
    """One route: how to call it, what it accepts and returns, and which errors it may give."""

    method: str
    path: str
    handler: Handler
    summary: str
    tag: str
    responses: ResponseShapes
    query: type[BaseModel] = NoQuery
    body: type[BaseModel] = NoBody
    errors: tuple[str, ...] = ()
    """Error codes besides the ones every route may give."""
    authenticated: bool = True
    carries_turns: bool = False
    """The body holds a whole turn: capped at `max_turn_bytes`, not `max_request_bytes`."""
    serves_etag: bool = False
    """Its answer carries the conversation's version as `ETag` (app/etags.py)."""
    checks_version: bool = False
    """Its store call takes the version `If-Match` names and checks it with its write (a
    DELETE, a PATCH); every other route naming one conversation has it checked as the
    request starts (`_evaluate_if_match`)."""
    idempotency_key: bool = False
    """It takes `Idempotency-Key` as the id of what it writes: a retry under it is answered
    what the first attempt stored. Another POST refuses the header (`_refuse_unread_headers`)."""

    @property
    def if_match(self) -> bool:
        """It honours `If-Match` naming a conversation's version (it names one conversation):
        412 `precondition_failed` when the conversation under the id is not the one named.
        A route naming none refuses the header (`_evaluate_if_match`)."""
        return "{conversation_id}" in self.path


# -- request parsing -------------------------------------------------------------------

MAX_DIGITS = 18
"""The most digits `whole_number` reads: below 2**63, so a database takes it as a 64-bit
integer, and far below the 4,300 digits past which `int()` refuses text."""
_DIGITS = re.compile(r"[0-9]+")


def whole_number(text: str) -> int | None:
    """The whole number from 0 that `text` writes in decimal, in ASCII digits (`0`-`9`) only
    and at most `MAX_DIGITS` of them; None for anything else (a sign, a space, an exponent).

    The one reading of a number the service takes from text (a `Content-Length`, the
    viewer's `from_seq` and `at_seq`). `str.isdigit` is no such test: it holds for `"²"`,
    which `int()` refuses, and for `"٣"`, which `int()` reads as 3.
    """
    if len(text) > MAX_DIGITS or not _DIGITS.fullmatch(text):
        return None
    return int(text)


def parse_query(request: Request, model: type[Q]) -> Q:
    items = request.query_params.multi_items()
    names = [name for name, _ in items]
    known = sorted(model.model_fields)
    if any(name not in model.model_fields for name in names):
        accepted = ", ".join(known) if known else "none"
        raise InvalidRequest(f"invalid query: an unknown parameter; this route accepts {accepted}")
    repeated = sorted(name for name, n in Counter(names).items() if n > 1)
    if repeated:
        raise InvalidRequest(f"invalid query: parameters given more than once: {repeated}")
    try:
        return model.model_validate(dict(items))
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc, subject="query")) from exc


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing with 413 as soon as it is known to be over `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        size = whole_number(declared)
        if size is None:
            raise InvalidRequest(
                "invalid Content-Length: it must be a number of bytes, "
                f"in digits 0-9 (at most {MAX_DIGITS})"
            )
        if size > limit:
            raise PayloadTooLarge(f"the body has {size} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[B], limit: int) -> B:
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise UnsupportedMediaType(
            "the body must be application/json"
            + ("" if media_type else "; the Content-Type header is missing")
        )
    codings = {c.strip().lower() for v in request.headers.getlist("content-encoding")
               for c in v.split(",")} - {"", "identity"}  # fmt: skip
    if codings:  # read as plain, a compressed body would be refused or stored as sent
        raise UnsupportedMediaType(
            "the body must be sent uncompressed: the service reads no Content-Encoding but identity"
        )
    raw = await read_body(request, limit)
    decode_body(raw)  # the rules pydantic cannot apply: depth, 64-bit numbers
    try:
        # Strict, as JSON Schema reads the body: `false` is no integer, `"1"` no number.
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc, subject="body")) from exc


_JSON_WHITE_SPACE = b" \t\r\n"


async def _no_body(endpoint: Endpoint, request: Request, limit: int) -> NoBody:
    """What a route that takes no body reads: an empty one (no bytes, or only white space).
    Any other is refused, not passed over (a client may think it asked for something):
    415 when it is not JSON, as a body elsewhere, else 422."""
    raw = await read_body(request, limit)
    if not raw.strip(_JSON_WHITE_SPACE):
        return NoBody()
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    refusal = f"{endpoint.method} {endpoint.path} takes no body: send the request without one"
    if media_type != "application/json":
        raise UnsupportedMediaType(f"{refusal} (a body must be application/json where one is)")
    raise InvalidRequest(f"{refusal} (its options, if any, are query parameters)")


async def _run(endpoint: Endpoint, request: Request) -> Response:
    state = request.app.state
    caller = Caller(service="")
    if endpoint.authenticated:
        caller = state.authenticator.authenticate(request.headers, audit_record(request.scope))
    path = {name: validate_identifier(v, name) for name, v in request.path_params.items()}
    query = parse_query(request, endpoint.query)
    _refuse_unread_headers(endpoint, request)
    limit = state.max_turn_bytes if endpoint.carries_turns else state.max_request_bytes
    if endpoint.body is NoBody:
        body: BaseModel = await _no_body(endpoint, request, limit)
    else:
        body = await parse_body(request, endpoint.body, limit)
    call = Call(request, state.store, caller, path, query, body)
    await _evaluate_if_match(endpoint, call)
    return await endpoint.handler(call)


IDEMPOTENCY_KEY = "Idempotency-Key"


def _refuse_unread_headers(endpoint: Endpoint, request: Request) -> None:
    """422 for a header the route would otherwise pass over, misleading a client relying on
    it: `If-Match` where no conversation is named, `Idempotency-Key` on a POST that names
    what it writes otherwise (or is idempotent as it is)."""
    where = f"{endpoint.method} {endpoint.path}"
    if "if-match" in request.headers and not endpoint.if_match:
        raise InvalidRequest(
            f"the If-Match header names a conversation's version (its ETag), and {where} "
            "names no conversation, so it cannot evaluate it: send the request without it"
        )
    unread = endpoint.method == "POST" and not endpoint.idempotency_key
    if unread and IDEMPOTENCY_KEY.lower() in request.headers:
        raise InvalidRequest(
            f"{where} does not take the {IDEMPOTENCY_KEY} header (it is idempotent by its "
            "path and body, or not retried under a key): send the request without it"
        )


async def _evaluate_if_match(endpoint: Endpoint, call: Call[Any, Any]) -> None:
    """The conversation's version `If-Match` names (`version_named`), checked before a route
    naming one conversation does anything, as DELETE checks it: 412 `precondition_failed`
    when the conversation under the id is another, 404 when there is none (one round trip).
    `*` names any conversation, but one (RFC 9110 13.1.1: it is false where there is none):
    404 too when there is none, so a turn sent with it never creates its conversation. A
    route whose store call checks it (`checks_version`) is left to do so with its write."""
    headers = call.request.headers
    if "if-match" not in headers or not endpoint.if_match or endpoint.checks_version:
        return
    # `*` (None) names any; a write into a conversation being deleted answers as without
    # If-Match (503), a read as the read does (404).
    what = None if endpoint.method == "GET" else "the request"
    await call.store.conversations.require_version(
        call.conversation_id, version_named(headers), user_id=call.scope, what=what
    )


def routes_of(endpoints: Sequence[Endpoint]) -> list[BaseRoute]:
    """One Starlette route per path, so a 405 names every method the path accepts."""
    by_path: dict[str, dict[str, Endpoint]] = {}
    for endpoint in endpoints:
        by_path.setdefault(endpoint.path, {})[endpoint.method] = endpoint

    def route(path: str, methods: dict[str, Endpoint]) -> Route:
        async def dispatch(request: Request) -> Response:
            method = "GET" if request.method == "HEAD" else request.method
            return await _run(methods[method], request)

        return Route(path, dispatch, methods=list(methods))

    return [route(path, methods) for path, methods in by_path.items()]
