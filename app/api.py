"""The HTTP face of the store (Starlette). Routes are thin: parse, call one method, shape.

Routes are declared as data (`ENDPOINTS`, see app/routing.py).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, Response, StreamingResponse

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

from agent_store.core import (
    AgentMessage,
    Conversation,
    ConversationPage,
    InvalidInput,
    MessagePage,
    voice_marker,
)
from agent_store.store import (
    Claimed,
    ConversationExport,
    Deleted,
    LoggedTurn,
    RuntimeContextMarkers,
    SteeringInbox,
    refuse_own_turn_id,
    validate_identifier,
    without_runtime_context,
)
from app.api_models import (
    ClaimBody,
    CloseInboxBody,
    ConversationListQuery,
    DeliverBody,
    Delivered,
    Delivery,
    ExportQuery,
    ForkBody,
    Health,
    HitlResolved,
    InboxClosing,
    InboxOpened,
    InboxQuery,
    LogTurnBody,
    MessagePageQuery,
    NoBody,
    NoQuery,
    PendingHitlState,
    Readiness,
    RenameBody,
    ResolveHitlBody,
    SearchQuery,
    SearchResults,
    Transcript,
    TranscriptQuery,
    UserExport,
)
from app.auth import Authenticator
from app.demo import load_demo
from app.etags import etag_headers, version_named
from app.headers import SecurityHeadersMiddleware
from app.http_errors import EXCEPTION_HANDLERS, Forbidden
from app.logs import configure_logging
from app.metrics import ServiceMetrics, TurnCounter
from app.openapi import build_openapi
from app.public_pages import public_routes
from app.request_log import RequestLogMiddleware
from app.routing import IDEMPOTENCY_KEY, Call, Endpoint, routes_of
from app.service import Store, open_store
from app.sessions import ViewerSessions
from app.settings import Settings, settings_from_environment
from app.streamed_json import (
    export_document,
    export_lines,
    opened_exports,
    transcript_document,
)
from app.throttle import SignInLimiter
from app.tracing import Tracing
from app.viewer import viewer_routes


def _json(model: BaseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json", by_alias=True), status)


# -- handlers --------------------------------------------------------------------------


async def health(call: Call[NoQuery, NoBody]) -> Response:
    return _json(Health())


async def ready(call: Call[NoQuery, NoBody]) -> Response:
    await call.store.conversations.ping()
    return _json(Readiness())


async def list_conversations(call: Call[ConversationListQuery, NoBody]) -> Response:
    user_id = call.path["user_id"]
    call.caller.require_user(user_id)
    page = await call.store.conversations.list_conversations(
        user_id, limit=call.query.limit, cursor=call.query.cursor
    )
    return _json(page)


async def get_conversation(call: Call[NoQuery, NoBody]) -> Response:
    conversation = await call.store.conversations.get_conversation(
        call.conversation_id, user_id=call.scope
    )
    return _json_with_etag(conversation)


async def rename_conversation(call: Call[NoQuery, RenameBody]) -> Response:
    conversation = await call.store.conversations.rename(
        call.conversation_id,
        call.body.name,
        user_id=call.scope,
        version=version_named(call.request.headers),
    )
    return _json_with_etag(conversation)


async def delete_conversation(call: Call[NoQuery, NoBody]) -> Response:
    deleted = await call.store.conversations.delete(
        call.conversation_id, user_id=call.scope, version=version_named(call.request.headers)
    )
    return _json(deleted)


def _json_with_etag(conversation: Conversation) -> JSONResponse:
    response = _json(conversation)
    response.headers.update(etag_headers(conversation))
    return response


async def transcript(call: Call[TranscriptQuery, NoBody]) -> Response:
    batches = call.store.conversations.stream_transcript(
        call.conversation_id, user_id=call.scope, full=call.query.full
    )
    first = await anext(batches)  # a missing conversation is a 404 before any byte is sent
    document = transcript_document(call.conversation_id, first, batches)
    return StreamingResponse(document, media_type="application/json")


async def messages_page(call: Call[MessagePageQuery, NoBody]) -> Response:
    page = await call.store.conversations.messages_page(
        call.conversation_id,
        after=call.query.after,
        limit=call.query.limit,
        order=call.query.order,
        user_id=call.scope,
    )
    return _json(page)


async def log_turn(call: Call[NoQuery, LogTurnBody]) -> Response:
    body = call.body
    if body.user_id is not None:
        call.caller.require_user(body.user_id)
    logged = await call.store.logger.log_messages(
        call.conversation_id,
        body.messages,
        user_id=call.scope or body.user_id,
        turn_id=_turn_id(call),
        name=body.name,
        owner_only=call.scope is not None,
        refused_prompts=body.refused_prompts,
        answers_to=body.answers_to,
    )
    return _json(logged, 200 if logged.replayed else 201)


def _turn_id(call: Call[NoQuery, LogTurnBody]) -> str | None:
    """The turn's id: the body's `turn_id`, else the `Idempotency-Key` header (`_keyed`); 422
    for one of the exact shape of the store's own turn ids (`refuse_own_turn_id`)."""
    turn_id = _keyed(call, call.body.turn_id, "turn_id", "turn")
    if turn_id is not None:
        refuse_own_turn_id(turn_id)
    return turn_id


def _keyed(call: Call[Any, Any], named: str | None, field: str, noun: str) -> str | None:
    """The id of what the call writes (a `noun`): the body's `field` (`named`), else the
    `Idempotency-Key` header HTTP clients retry with, as it is when it is an identifier, else
    `idempotency-` and its digest. 422 for a header sent twice, empty, or naming another
    than the body's `field`."""
    keys = call.request.headers.getlist(IDEMPOTENCY_KEY)
    if len(keys) > 1:
        raise InvalidInput(f"the {IDEMPOTENCY_KEY} header is sent twice or more: send it once")
    if not keys:
        return named
    key = keys[0]
    if not key.strip():
        raise InvalidInput(f"the {IDEMPOTENCY_KEY} header is empty: send a key naming the {noun}")
    try:
        keyed = validate_identifier(key, field)
    except InvalidInput:
        keyed = "idempotency-" + hashlib.sha256(key.encode()).hexdigest()[:32]
    if named not in (None, keyed):
        raise InvalidInput(
            f"{field} {named!r} and the {IDEMPOTENCY_KEY} header name two {noun}s: "
            f"send one of them, or both naming the same {noun}"
        )
    return keyed


def _inbox(call: Call[Any, Any]) -> SteeringInbox:
    return SteeringInbox(call.store.logger)


def _only_the_runtime(call: Call[Any, Any], action: str) -> None:
    """The steering inbox is the running turn's, opened and closed by its runtime (a
    service): a person's token opening inboxes would keep the runtime from opening one
    (`TurnRules.open_inboxes`), closing one would stop the person's own steering."""
    if call.scope is not None:
        raise Forbidden(
            f"a steering inbox is its running turn's: only a service (the runtime, without a "
            f"user token) may {action} one; a user token delivers into it and reads it"
        )


async def open_inbox(call: Call[NoQuery, NoBody]) -> Response:
    _only_the_runtime(call, "open")
    turn_id = call.path["turn_id"]
    await _inbox(call).open_turn(call.conversation_id, turn_id)
    return _json(InboxOpened(conversation_id=call.conversation_id, turn_id=turn_id))


async def deliver(call: Call[NoQuery, DeliverBody]) -> Response:
    if call.scope is not None:
        _refuse_what_a_person_does_not_send(call.body.message, call.store.logger.rules.markers)
    delivered = await _inbox(call).try_deliver(
        call.conversation_id,
        call.path["turn_id"],
        call.body.message,
        delivery_id=_keyed(call, call.body.delivery_id, "delivery_id", "delivery"),
        user_id=call.scope,
        owner_only=call.scope is not None,
    )
    return _json(Delivery(delivered=delivered))


def _refuse_what_a_person_does_not_send(
    message: AgentMessage, markers: RuntimeContextMarkers
) -> None:
    """A user token steers what a person sends: a message of role `user`, with no runtime
    form (`native`), which would make a runtime read it as another role, a system prompt or
    a tool's result. Only a service token delivers those."""
    if message.role != "user":
        raise InvalidInput(
            f"invalid delivery: a user token steers what a person sends, a message of role "
            f"'user', not {message.role!r}; only a service token delivers other roles"
        )
    if message.native is not None:
        raise InvalidInput(
            "invalid delivery: a user token steers what a person sends, without `native` (a "
            "runtime's own form of a message); only a service token delivers one"
        )
    _refuse_another_voice(message, markers, "delivery")


def _refuse_another_voice(
    message: AgentMessage, markers: RuntimeContextMarkers, subject: str
) -> None:
    """A person's words are sent in the person's voice: a user token's user message whose
    `error` is a runtime's marker (`voice_marker`: the application's retry feedback, a
    tool's content), which a runtime sends the model in that voice, is refused. Only a
    service token, a runtime's, sends one. Judged on the message as it would be stored, its
    runtime context removed (`without_runtime_context`, its error's message too): what a
    runtime reads back, where a block could leave a marker the message as sent did not hold
    (`[RUNTIME CONTEXT]…[/RUNTIME CONTEXT]tool content`)."""
    stored = without_runtime_context(message, markers)
    marker = voice_marker(stored)
    if marker is not None:
        removed = "" if stored is message else " once its runtime context is removed"
        raise InvalidInput(
            f"invalid {subject}: a user token sends a person's words, without `error` "
            f"{marker!r}{removed} (a runtime's marker: a runtime would send the text as the "
            f"application's or a tool's, not the person's); only a service token sends one"
        )


async def drain_inbox(call: Call[InboxQuery, NoBody]) -> Response:
    page = await _inbox(call).drain_page(
        call.conversation_id, call.path["turn_id"], call.query.after_seq, user_id=call.scope
    )
    return _json(Delivered(data=page.data, has_more=page.has_more))


async def close_inbox(call: Call[NoQuery, CloseInboxBody]) -> Response:
    _only_the_runtime(call, "close")
    late = await _inbox(call).close_inbox_page(
        call.conversation_id, call.path["turn_id"], call.body.last_seen_seq
    )
    return _json(InboxClosing(closed=not late.data, data=late.data, has_more=late.has_more))


async def fork(call: Call[NoQuery, ForkBody]) -> Response:
    forked = await call.store.logger.fork(
        call.conversation_id,
        call.body.at_seq,
        call.body.new_conversation_id,
        user_id=call.scope,
        owner_only=call.scope is not None,
    )
    return _json(forked, 200 if forked.replayed else 201)


async def pending_hitl(call: Call[NoQuery, NoBody]) -> Response:
    pending = await call.store.conversations.pending_hitl(call.conversation_id, user_id=call.scope)
    return _json(PendingHitlState(pending=pending))


async def resolve_hitl(call: Call[NoQuery, ResolveHitlBody]) -> Response:
    body = call.body
    calls = None if body.calls is None else [c.model_dump() for c in body.calls]
    await call.store.conversations.resolve_hitl(
        call.conversation_id,
        body.request_id,
        user_id=call.scope,
        call_ids=body.call_ids,
        calls=calls,
    )
    return _json(HitlResolved(request_id=call.body.request_id))


async def search(call: Call[SearchQuery, NoBody]) -> Response:
    query = call.query
    if query.user_id is not None:
        call.caller.require_user(query.user_id)
    page = await call.store.conversations.search_page(
        query.q,
        user_id=call.scope or query.user_id,
        conversation_id=query.conversation_id,
        limit=query.limit,
        cursor=query.cursor,
    )
    return _json(
        SearchResults(data=page.data, has_more=page.has_more, next_cursor=page.next_cursor)
    )


async def export_user(call: Call[ExportQuery, NoBody]) -> Response:
    user_id = call.path["user_id"]
    call.caller.require_user(user_id)
    disposition = {
        "Content-Disposition": f'attachment; filename="{user_id}.{call.query.format}"',
    }
    # The first conversation is read before any byte is sent: a database down is a 503.
    exports = await opened_exports(call.store.conversations, user_id, full=call.query.full)
    if call.query.format == "jsonl":
        lines = export_lines(exports)
        return StreamingResponse(lines, media_type="application/x-ndjson", headers=disposition)
    document = export_document(user_id, exports)
    return StreamingResponse(document, media_type="application/json", headers=disposition)


async def erase_user(call: Call[NoQuery, NoBody]) -> Response:
    user_id = call.path["user_id"]
    call.caller.require_user(user_id)
    return _json(await call.store.conversations.erase_user(user_id))


async def claim(call: Call[NoQuery, ClaimBody]) -> Response:
    if call.scope is not None:
        raise Forbidden(
            "a claim moves data between two users; only a service (without a user token) "
            "may claim, since only it knows both accounts belong to one person"
        )
    claimed = await call.store.conversations.claim(call.body.from_user_id, call.body.to_user_id)
    return _json(claimed)


CONVERSATION = "/v1/conversations/{conversation_id}"
USER = "/v1/users/{user_id}"

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint(
        "GET",
        "/health",
        health,
        "Liveness: the process answers",
        "service",
        {200: Health},
        authenticated=False,
    ),
    Endpoint(
        "GET",
        "/ready",
        ready,
        "Readiness: the database answers a lookup",
        "service",
        {200: Readiness},
        authenticated=False,
    ),
    Endpoint(
        "GET",
        f"{USER}/conversations",
        list_conversations,
        "A user's conversations, most recently updated first",
        "conversations",
        {200: ConversationPage},
        query=ConversationListQuery,
        errors=("forbidden",),
    ),
    Endpoint(
        "GET",
        CONVERSATION,
        get_conversation,
        "One conversation",
        "conversations",
        {200: Conversation},
        errors=("not_found",),
        serves_etag=True,
    ),
    Endpoint(
        "PATCH",
        CONVERSATION,
        rename_conversation,
        "Rename a conversation",
        "conversations",
        {200: Conversation},
        body=RenameBody,
        errors=("not_found", "conflict"),
        serves_etag=True,
        checks_version=True,
    ),
    Endpoint(
        "DELETE",
        CONVERSATION,
        delete_conversation,
        "Delete a conversation and its messages",
        "conversations",
        {200: Deleted},
        errors=("not_found",),
        checks_version=True,
    ),
    Endpoint(
        "GET",
        f"{CONVERSATION}/transcript",
        transcript,
        "Every message of a conversation, by seq",
        "messages",
        {200: Transcript},
        query=TranscriptQuery,
        errors=("not_found",),
    ),
    Endpoint(
        "GET",
        f"{CONVERSATION}/messages",
        messages_page,
        "A page of a conversation's messages",
        "messages",
        {200: MessagePage},
        query=MessagePageQuery,
        errors=("not_found",),
    ),
    Endpoint(
        "POST",
        f"{CONVERSATION}/turns",
        log_turn,
        "Log one turn (idempotent by turn_id)",
        "messages",
        {201: LoggedTurn, 200: LoggedTurn},
        body=LogTurnBody,
        errors=("not_found", "conflict", "forbidden"),
        carries_turns=True,
        idempotency_key=True,
    ),
    Endpoint(
        "POST",
        f"{CONVERSATION}/turns/{{turn_id}}/inbox",
        open_inbox,
        "Open the steering inbox of a running turn (idempotent; a service only)",
        "live",
        {200: InboxOpened},
        errors=("not_found", "conflict", "forbidden"),
    ),
    Endpoint(
        "POST",
        f"{CONVERSATION}/turns/{{turn_id}}/inbox/messages",
        deliver,
        "Deliver a message into a running turn, or learn that its inbox is closed",
        "live",
        {200: Delivery},
        body=DeliverBody,
        errors=("not_found", "conflict"),
        carries_turns=True,
        idempotency_key=True,
    ),
    Endpoint(
        "GET",
        f"{CONVERSATION}/turns/{{turn_id}}/inbox",
        drain_inbox,
        "The messages delivered into a running turn after a seq",
        "live",
        {200: Delivered},
        query=InboxQuery,
        errors=("not_found",),
    ),
    Endpoint(
        "POST",
        f"{CONVERSATION}/turns/{{turn_id}}/inbox/close",
        close_inbox,
        "Close a running turn's inbox, or get what arrived since the runtime last looked "
        "(a service only)",
        "live",
        {200: InboxClosing},
        body=CloseInboxBody,
        errors=("not_found", "storage_unavailable", "forbidden"),
    ),
    Endpoint(
        "POST",
        f"{CONVERSATION}/forks",
        fork,
        "Start a new conversation from this one's messages up to a seq",
        "live",
        {201: LoggedTurn, 200: LoggedTurn},
        body=ForkBody,
        errors=("not_found", "conflict", "storage_unavailable"),
    ),
    Endpoint(
        "GET",
        f"{CONVERSATION}/hitl",
        pending_hitl,
        "The conversation's pending human-in-the-loop prompt",
        "hitl",
        {200: PendingHitlState},
        errors=("not_found",),
    ),
    Endpoint(
        "POST",
        f"{CONVERSATION}/hitl/resolve",
        resolve_hitl,
        "Resolve the pending prompt named by request_id",
        "hitl",
        {200: HitlResolved},
        body=ResolveHitlBody,
        errors=("not_found", "conflict"),
    ),
    Endpoint(
        "GET",
        "/v1/search",
        search,
        "Full-text search in a user's or a conversation's messages",
        "messages",
        {200: SearchResults},
        query=SearchQuery,
        errors=("forbidden", "not_found", "unsupported"),
    ),
    Endpoint(
        "GET",
        f"{USER}/export",
        export_user,
        "Export every conversation of a user with its messages",
        "users",
        {200: {"application/x-ndjson": ConversationExport, "application/json": UserExport}},
        query=ExportQuery,
        errors=("forbidden",),
    ),
    Endpoint(
        "DELETE",
        USER,
        erase_user,
        "Erase every conversation and message of a user",
        "users",
        {200: Deleted},
        errors=("forbidden",),
    ),
    Endpoint(
        "POST",
        "/v1/claims",
        claim,
        "Move every conversation of one user id to another (account claim)",
        "users",
        {200: Claimed},
        body=ClaimBody,
        errors=("forbidden",),
    ),
)


# -- the application -------------------------------------------------------------------


def create_app(
    settings: Settings | None = None,
    *,
    store: Store | None = None,
    tracer_provider: TracerProvider | None = None,
) -> Starlette:
    """The application: what `uvicorn --factory app.api:create_app` and gunicorn serve.

    Without `settings` it reads them from the environment (as `python -m app` does) and
    sets up the process's JSON logs; a development token it makes up (embedded server, no
    token configured) is logged once the process holds its database, so a worker refused
    the embedded server's data directory (another worker holds it) logs none. Pass `store`
    to serve an existing one (tests do); else it connects. `tracer_provider` traces with
    that OpenTelemetry provider (tests pass one with an in-memory exporter); otherwise
    `settings.tracing` decides.
    """
    dev_token = None
    if settings is None:
        settings, dev_token = _settings_for_this_process()
    tracing = Tracing.configure(settings, tracer_provider)
    listeners = [tracing.command_listener()] if tracing else []

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if store is not None:
            yield
            return
        async with open_store(settings, command_listeners=listeners) as opened:
            _serve(app, opened)
            _announce(dev_token)
            await app.state.viewer_sessions.ensure_indexes()
            if settings.demo_data:
                await load_demo(opened)
            yield

    routes = routes_of(ENDPOINTS)
    routes += public_routes(settings)
    routes += viewer_routes()
    middleware = [Middleware(SecurityHeadersMiddleware), Middleware(RequestLogMiddleware)]
    if tracing is not None:
        middleware.insert(0, tracing.middleware())
    app = Starlette(
        routes=routes,
        exception_handlers=dict(EXCEPTION_HANDLERS),
        middleware=middleware,
        lifespan=lifespan,
    )
    app.state.authenticator = Authenticator(settings)
    app.state.sign_in_limiter = SignInLimiter()
    app.state.max_request_bytes = settings.max_request_bytes
    app.state.max_turn_bytes = settings.max_turn_bytes
    app.state.openapi = build_openapi(ENDPOINTS)
    app.state.metrics = ServiceMetrics()
    app.state.metrics_exposure = settings.metrics
    if store is not None:
        _serve(app, store)
    return app


def _settings_for_this_process() -> tuple[Settings, str | None]:
    """Read and check the environment's settings and set up JSON logs; the development token
    made up, if any (`_announce` logs it)."""
    settings, dev_token = settings_from_environment()
    configure_logging(settings.log_level)
    return settings, dev_token


def _announce(dev_token: str | None) -> None:
    """Log the development token the process serves with, once it holds its database (the
    embedded server started: its data directory locked for this process)."""
    if dev_token is not None:
        logging.getLogger("agent_store.api").warning(
            "No AGENT_STORE_SERVICE_TOKENS set; development token for this process: %s",
            dev_token,
        )


def _serve(app: Starlette, store: Store) -> None:
    app.state.store = store
    store.logger.add_observer(TurnCounter(app.state.metrics))
    app.state.viewer_sessions = ViewerSessions(store.db, app.state.authenticator)
