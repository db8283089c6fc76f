"""The viewer: server-rendered pages to browse a user's conversations and read transcripts.

A browser signs in once with a service token on a form (posted from this
site, a limited number of wrong tries per client); the service answers with a
signed, HttpOnly, SameSite=Strict session cookie scoped to `/viewer` that
names a server-side session (never holds the token). Signing out ends that
session on the server. Tokens never travel in URLs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from agent_store.core import (
    AgentMessage,
    Conversation,
    InvalidInput,
    NotFound,
    StoreError,
    Unsupported,
)
from agent_store.store import validate_identifier
from app.auth import Authenticator, audit_record
from app.http_errors import HttpProblem, note_store_error
from app.presentation import (
    PAGE_SHOWS,
    TranscriptPages,
    calls_made_before,
    hidden_shown,
    legacy_turn_views,
    message_views,
    search_hit_view,
    when,
    whole_within,
    within_page,
)
from app.routing import read_body, whole_number
from app.service import Store
from app.sessions import SESSION_COOKIE, SESSION_SECONDS, ViewerSessions
from app.throttle import SignInLimiter

MAX_FORM_BYTES = 4096
MAX_LEGACY_TURNS = 2000
"""The most legacy turns a page of the legacy comparison shows (fewer when they fill it)."""
CONVERSATIONS_PER_PAGE = 25
MESSAGES_PER_PAGE = 100
"""The most messages a page of a transcript shows, by `seq` (fewer when they fill it:
`within_page`, `PAGE_SHOWS`)."""
SEARCH_HITS = 50
NO_TEXT_INDEX = (
    "This database cannot search messages: full-text search needs the store's text index, "
    "which it does not have (MongoDB builds it at start-up; an in-process test database "
    "has none). Browse by user instead."
)
_TEMPLATES = Path(__file__).resolve().parent / "templates"


def _printed(value: Any) -> Any:
    """What a page prints of a value (`{{ … }}`), before it is escaped for HTML: its text as
    `hidden_shown` shows it, so no stored text (a prompt's params, a file's name, a tool's)
    prints a direction override or a control as itself; markup (what has `__html__`: a
    macro's output) had its own values printed so, and is printed as it is."""
    return value if hasattr(value, "__html__") else hidden_shown(str(value))


_environment = jinja2.Environment(
    loader=jinja2.FileSystemLoader(_TEMPLATES),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    finalize=_printed,
)
_environment.filters["when"] = when
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    # `same-origin`, not `no-referrer`: with the latter Chromium sends `Origin: null` on
    # form posts, and the sign-in form checks its Origin.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def render(template: str, status: int = 200, **context: Any) -> HTMLResponse:
    html = _environment.get_template(template).render(**context)
    return HTMLResponse(html, status, headers=_SECURITY_HEADERS)


def _same_origin(request: Request) -> bool:
    """Whether a form post names this site as its origin: by `Origin`, else by `Referer`.

    A post with neither is refused: a browser always sends one of them (the pages set
    `Referrer-Policy: same-origin`), so only a forged request lacks both.
    """
    own = f"{request.url.scheme}://{request.url.netloc}"
    origin = request.headers.get("origin")
    if origin is not None:
        return origin == own
    referer = urlsplit(request.headers.get("referer", ""))
    return bool(referer.scheme) and f"{referer.scheme}://{referer.netloc}" == own


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _store_error_page(request: Request, exc: StoreError) -> Response:
    note_store_error(request, exc)
    return render("error.html", exc.status, code=exc.code, message=exc.message)


Page = Callable[[Request, Store], Awaitable[Response]]


def _signed_in(page: Page) -> Callable[[Request], Awaitable[Response]]:
    async def run(request: Request) -> Response:
        sessions: ViewerSessions = request.app.state.viewer_sessions
        try:
            cookie = request.cookies.get(SESSION_COOKIE)
            service = await sessions.service_of(cookie, time.time())
            if service is None:
                return RedirectResponse("/viewer/login", 303, headers=_SECURITY_HEADERS)
            audit_record(request.scope).service = service
            return await page(request, request.app.state.store)
        except StoreError as exc:
            return _store_error_page(request, exc)

    return run


async def login_form(request: Request) -> Response:
    return render("login.html")


async def _posted_form(request: Request) -> dict[str, str] | None:
    """A small urlencoded form's fields (the first value of each); None over `MAX_FORM_BYTES`."""
    try:
        body = await read_body(request, MAX_FORM_BYTES)
    except HttpProblem:
        return None
    fields = parse_qs(body.decode("utf-8", "replace"))
    return {name: values[0].strip() for name, values in fields.items()}


async def login(request: Request) -> Response:
    if not _same_origin(request):
        return render("login.html", 403, problem="Sign-in must come from this site's own form.")
    limiter: SignInLimiter = request.app.state.sign_in_limiter
    client = _client(request)
    # Held before the form is read: forms sent late cannot all slip past the limit at once.
    wait = limiter.reserve(client)
    if wait:
        limited = render("login.html", 429, problem=f"Too many wrong tokens: wait {wait} s.")
        limited.headers["Retry-After"] = str(wait)
        return limited
    try:
        return await _sign_in(request, limiter, client)
    finally:
        limiter.release(client)


async def _sign_in(request: Request, limiter: SignInLimiter, client: str) -> Response:
    """Read the form, check its token, and open a session for the right one."""
    form = await _posted_form(request)
    if form is None:
        return render("login.html", 413, problem="The sign-in form was too large.")
    token = form.get("token", "")
    authenticator: Authenticator = request.app.state.authenticator
    service = authenticator.service_actor(token)
    if service is None:
        limiter.failed(client)
        return render("login.html", 401, problem="That token is not accepted.")
    limiter.succeeded(client)
    audit_record(request.scope).service = service
    try:
        cookie = await request.app.state.viewer_sessions.open(service, time.time())
    except StoreError as exc:
        return _store_error_page(request, exc)
    response = RedirectResponse("/viewer", 303, headers=_SECURITY_HEADERS)
    response.set_cookie(
        SESSION_COOKIE,
        cookie,
        max_age=SESSION_SECONDS,
        path="/viewer",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


async def logout(request: Request) -> Response:
    if not _same_origin(request):
        message = "Sign-out must come from this site's own pages."
        return render("error.html", 403, code="forbidden", message=message)
    sessions: ViewerSessions = request.app.state.viewer_sessions
    try:
        await sessions.close(request.cookies.get(SESSION_COOKIE), time.time())
    except StoreError as exc:
        return _store_error_page(request, exc)
    response = RedirectResponse("/viewer/login", 303, headers=_SECURITY_HEADERS)
    response.delete_cookie(SESSION_COOKIE, path="/viewer", httponly=True, samesite="strict")
    return response


_STATIC = {"viewer.css": "text/css", "icon.svg": "image/svg+xml"}


async def static_file(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in _STATIC:
        return Response("not found", 404, media_type="text/plain")
    content = (_TEMPLATES / name).read_bytes()
    return Response(content, media_type=_STATIC[name], headers=_SECURITY_HEADERS)


async def index(request: Request, store: Store) -> Response:
    user_id = request.query_params.get("user_id")
    if user_id:
        user_id = validate_identifier(user_id.strip(), "user_id")
        return RedirectResponse(f"/viewer/users/{quote(user_id)}", 303)
    cursor = request.query_params.get("cursor")
    page = await store.conversations.recent_conversations(
        limit=CONVERSATIONS_PER_PAGE, cursor=cursor
    )
    legacy = await store.legacy.with_turns([c.id for c in page.data])
    return render("index.html", page=page, legacy=legacy, paged=cursor is not None)


async def conversations(request: Request, store: Store) -> Response:
    user_id = validate_identifier(request.path_params["user_id"], "user_id")
    cursor = request.query_params.get("cursor")
    page = await store.conversations.list_conversations(
        user_id, limit=CONVERSATIONS_PER_PAGE, cursor=cursor
    )
    legacy = await store.legacy.with_turns([c.id for c in page.data])
    return render("conversations.html", user_id=user_id, page=page, legacy=legacy)


async def search(request: Request, store: Store) -> Response:
    text = request.query_params.get("q", "").strip()
    user_id = request.query_params.get("user_id", "").strip()
    context: dict[str, Any] = {"q": text, "user_id": user_id, "hits": [], "note": None}
    if not text or not user_id:
        context["note"] = "Type words to find and the user whose messages to search."
        return render("search.html", **context)
    user_id = validate_identifier(user_id, "user_id")
    try:
        hits = await store.conversations.search(text, user_id=user_id, limit=SEARCH_HITS)
    except Unsupported:
        context["note"] = NO_TEXT_INDEX
        return render("search.html", 501, **context)
    except InvalidInput as exc:
        context["note"] = exc.message
        return render("search.html", 422, **context)
    context["hits"] = [search_hit_view(hit) for hit in hits]
    return render("search.html", **context)


def _seq(text: str, name: str, kind: str = "a seq") -> int:
    """A seq (or another `kind` of whole number) given as text (`whole_number`); InvalidInput
    (422) naming `name` for anything else."""
    seq = whole_number(text)
    if seq is None:
        raise InvalidInput(
            f"invalid {name}: it must be {kind}, a whole number from 0 in digits 0-9"
        )
    return seq


def _from_seq(request: Request) -> int:
    return _seq(request.query_params.get("from_seq", "0"), "from_seq")


@dataclass(frozen=True)
class _MessagePage:
    conversation: Conversation
    messages: list[AgentMessage]
    """Up to `MESSAGES_PER_PAGE` messages from `from_seq` on, fewer when they pass
    `PAGE_BYTES` (one at least: `ConversationStore.seq_page`)."""
    more: bool
    """Whether more messages follow them."""
    before: list[AgentMessage]
    """Messages before the page making or answering the calls its results may answer, as
    far back as pairing them needs (`calls_made_before`, `ConversationStore.calls_before`)."""
    stored: bool
    """Whether the conversation is read from its stored messages (migrated, and no migration
    run writing it)."""
    being_migrated: bool = False
    """Whether a migration run is writing it, or was stopped while writing it (`migrating`):
    read from its legacy turns until a run finishes it."""


_PAGE_READS = 3
"""How many times a transcript page is read while its conversation goes (deleted, or
deleted and started again under its id) between the page's reads, before the page is 404."""


async def _message_page(store: Store, conversation_id: str, from_seq: int) -> _MessagePage:
    """A page of the conversation's messages from `from_seq` on, with the messages before it
    that pair its results with their calls: one conversation's, read again from its start
    when the one read first is gone by the time its messages are read (`_message_page_of`).
    """
    attempts = _PAGE_READS
    while True:
        attempts -= 1
        try:
            return await _message_page_of(store, conversation_id, from_seq)
        except _LifeGone as gone:
            if not attempts:
                raise gone.not_found from None


class _LifeGone(Exception):
    """The conversation a page read first is no longer under its id as its messages are read."""

    def __init__(self, not_found: NotFound) -> None:
        super().__init__(not_found.message)
        self.not_found = not_found


async def _message_page_of(store: Store, conversation_id: str, from_seq: int) -> _MessagePage:
    """`_message_page`, read once.

    A conversation not migrated yet, or one a migration run is writing (read from its legacy
    turns until a run finishes it, as the store reads it), is read from its converted legacy
    turns, whole, cut the same way, by `seq`, on every page; the calls before a page are among
    them. A stored one's are one more read, only when the page holds a result that may answer
    a call not on it (`ConversationStore.calls_before`). Both reads of a stored one's messages
    are of the conversation read first (`life`): `_LifeGone` when it went meanwhile, so no
    page shows one conversation's name, owner and prompt over another's messages.
    """
    conversations = store.conversations
    try:
        conversation = await conversations.stored_conversation(conversation_id)
    except NotFound:
        conversation = None
    if conversation is None or conversation.migrating:
        being_migrated = conversation is not None
        conversation = await conversations.get_conversation(conversation_id)
        converted = await conversations.transcript(conversation_id)
        after = [m for m in converted if m.seq is not None and m.seq >= from_seq]
        earlier = [m for m in converted if m.seq is not None and m.seq < from_seq]
        more = len(after) > MESSAGES_PER_PAGE
        return _MessagePage(
            conversation, after[:MESSAGES_PER_PAGE], more, earlier, False, being_migrated
        )
    try:
        page = await conversations.seq_page(
            conversation.id, start=from_seq, limit=MESSAGES_PER_PAGE, life=conversation
        )
        before = await conversations.calls_before(
            conversation.id,
            calls_made_before(page.data),
            before_seq=from_seq,
            life=conversation,
        )
    except NotFound as gone:
        raise _LifeGone(gone) from gone
    return _MessagePage(conversation, page.data, page.has_more, before, stored=True)


async def transcript(request: Request, store: Store) -> Response:
    from_seq = _from_seq(request)
    page = await _message_page(store, request.path_params["conversation_id"], from_seq)
    conversation = page.conversation
    messages = page.messages

    full = request.query_params.get("full") == "true"
    if full:  # the whole texts of as many as the page can show (fewer, their texts larger)
        messages = await store.conversations.with_full_texts(whole_within(messages, PAGE_SHOWS))
    # Up to `MESSAGES_PER_PAGE`, as many as fit the page (`within_page`).
    views = message_views(
        messages, pending=conversation.pending_hitl, before=page.before, room=PAGE_SHOWS
    )
    shown = within_page(views, PAGE_SHOWS)[0]
    return render(
        "transcript.html",
        conversation=conversation,
        messages=shown,
        full=full,
        pages=TranscriptPages.of(page.messages, len(shown), page.more, from_seq, MESSAGES_PER_PAGE),
        # The store forks stored conversations only: one not migrated yet offers no fork.
        can_fork=page.stored,
        being_migrated=page.being_migrated,
        fork_id=_fork_id(),
        version=conversation.version,
        has_legacy=bool(await store.legacy.with_turns([conversation.id])),
        page_shows=PAGE_SHOWS,
    )


def _fork_id() -> str:
    """The id a transcript page's forms fork into, drawn as the page is rendered: each form
    sends it with its `seq` (`<id>-<seq>`), so a form sent again retries the same fork."""
    return uuid.uuid4().hex


async def fork(request: Request, store: Store) -> Response:
    """ "Continue from here": a new conversation with the messages up to a seq, then its page.
    The form names the new conversation (`_fork_id`): sent again after a failure, it retries
    that fork, which the store makes once, rather than leaving it half made and making
    another."""
    if not _same_origin(request):
        message = "A fork must come from this site's own pages."
        return render("error.html", 403, code="forbidden", message=message)
    form = await _posted_form(request) or {}
    at_seq = _seq(form.get("at_seq", ""), "at_seq")
    if not form.get("new_conversation_id"):
        raise InvalidInput(
            "invalid fork: the form names no new_conversation_id; continue from a message of "
            "the conversation's page, which names one"
        )
    new_id = validate_identifier(form["new_conversation_id"], "new_conversation_id")
    # The conversation the page showed (its version), never another started under its id since.
    version = form.get("version") or None
    forked = await store.logger.fork(
        request.path_params["conversation_id"], at_seq, new_id, version=version
    )
    return RedirectResponse(
        f"/viewer/conversations/{quote(forked.conversation_id)}", 303, headers=_SECURITY_HEADERS
    )


async def legacy(request: Request, store: Store) -> Response:
    """Legacy turns beside stored messages, each column a page of its own (`from_turn`, a
    position among the turns oldest first; `from_seq`), bounded as every page is: up to
    `MAX_LEGACY_TURNS` turns and `MESSAGES_PER_PAGE` messages, fewer once the column's reads
    pass `PAGE_BYTES` or what it prints half of `PAGE_SHOWS` (`within_page`)."""
    conversation_id = validate_identifier(request.path_params["conversation_id"], "conversation_id")
    from_turn = _seq(request.query_params.get("from_turn", "0"), "from_turn", "a position")
    from_seq = _from_seq(request)
    turns, more_turns = await store.legacy.turns_page(
        conversation_id, skip=from_turn, limit=MAX_LEGACY_TURNS
    )
    try:  # what is stored, one a migration run is writing (`migrating`) among them
        conversation = await store.conversations.stored_conversation(conversation_id)
        page = await store.conversations.seq_page(
            conversation_id, start=from_seq, limit=MESSAGES_PER_PAGE, being_migrated=True
        )
        messages, more_messages = page.data, page.has_more
    except NotFound:
        if not turns:
            raise
        conversation, messages, more_messages = None, [], False  # the legacy side alone
    room = PAGE_SHOWS // 2  # each column's
    shown_turns, turns_cut = within_page(legacy_turn_views(turns, room), room)
    pending = conversation.pending_hitl if conversation else None
    shown = within_page(message_views(messages, pending=pending, room=room), room)[0]
    return render(
        "legacy.html",
        conversation_id=conversation_id,
        conversation=conversation,
        turns=shown_turns,
        from_turn=from_turn,
        next_turn=from_turn + len(shown_turns) if turns_cut or more_turns else None,
        messages=shown,
        pages=TranscriptPages.of(messages, len(shown), more_messages, from_seq, MESSAGES_PER_PAGE),
        page_shows=room,
    )


def viewer_routes() -> list[BaseRoute]:
    return [
        Route("/viewer/login", login_form, methods=["GET"]),
        Route("/viewer/login", login, methods=["POST"]),
        Route("/viewer/logout", logout, methods=["POST"]),
        Route("/viewer/static/{name}", static_file, methods=["GET"]),
        Route("/viewer", _signed_in(index), methods=["GET"]),
        Route("/viewer/users/{user_id}", _signed_in(conversations), methods=["GET"]),
        Route("/viewer/search", _signed_in(search), methods=["GET"]),
        Route("/viewer/conversations/{conversation_id}", _signed_in(transcript), methods=["GET"]),
        Route("/viewer/conversations/{conversation_id}/forks", _signed_in(fork), methods=["POST"]),
        Route(
            "/viewer/conversations/{conversation_id}/legacy", _signed_in(legacy), methods=["GET"]
        ),
    ]
