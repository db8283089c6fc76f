"""What the API tests share: settings, tokens, a seeded store served in-process, digests.

The store is seeded with the demo data (the DESIGN example for `user-ada`, a
second conversation of hers, one of `user-grace`) and one conversation per
user with a pending HITL prompt.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import httpx
import jwt
import pytest

from agent_store import AgentMessageLogger, ConversationStore, LegacyTurns
from agent_store.core import InvalidInput, NotFound, utc_now
from agent_store.legacy import LEGACY_TURNS
from agent_store.store import CONVERSATIONS, MESSAGES
from app.api import create_app
from app.demo import OTHER_USER_ID, load_demo
from app.examples import EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID
from app.service import Store
from app.settings import Settings

SERVICE_TOKEN = "service-token-for-tests-0123456789abcdef"
NAMED_TOKEN = "admin-ui-token-for-tests-0123456789abcdef"
JWT_SECRET = "a-shared-secret-for-user-tokens-in-tests"
ISSUER = "https://auth.example.test"
AUDIENCE = "agent-store"
OWNER = EXAMPLE_USER_ID
OTHER = OTHER_USER_ID
OWNER_CONVERSATION = EXAMPLE_CONVERSATION_ID
OWNER_HITL_CONVERSATION = "conv-ada-hitl"
OTHER_HITL_CONVERSATION = "conv-grace-hitl"
OWNER_SECRETS = ("ADA LOVELACE", "Paris: 18", "id-card.pdf")
"""Text only the owner's conversations hold: must never reach another user."""


def api_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "service_tokens": [SERVICE_TOKEN],
        "named_service_tokens": {"admin-ui": NAMED_TOKEN},
        "jwt_secret": JWT_SECRET,
        "jwt_issuer": ISSUER,
        "jwt_audience": AUDIENCE,
    }
    return Settings(**(values | overrides))


def user_token(
    sub: str | None,
    /,
    *,
    key: Any = JWT_SECRET,
    algorithm: str = "HS256",
    expires_in: int = 3600,
    **claims: Any,
) -> str:
    """A user token signed now. It lives an hour by default, the longest lifetime the
    service accepts: tests build tokens as their module is collected, and a parallel run on
    a loaded machine may use one half an hour later; the tests of expiry set `expires_in`."""
    now = int(time.time())
    payload = {"sub": sub, "aud": AUDIENCE, "iss": ISSUER, "iat": now, "exp": now + expires_in}
    payload.update(claims)  # a claim given as None is left out
    return jwt.encode({k: v for k, v in payload.items() if v is not None}, key, algorithm)


def auth_headers(*, token: str | None = SERVICE_TOKEN, user: str | None = None) -> dict[str, str]:
    headers = {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if user is not None:
        headers["X-User-JWT"] = user_token(user)
    return headers


async def another_users_legacy_turn(
    db: Any, conversation_id: str, user_id: str = "user-mallory"
) -> dict[str, Any]:
    """A legacy turn of `user_id` under `conversation_id`, not migrated yet; returns the
    `logger` and `store` a service wires to the legacy turns (MIGRATION.md, Transition
    flags), as keyword arguments of an integration."""
    await db[LEGACY_TURNS].insert_one(
        {"_id": "lt-1", "conversation_id": conversation_id, "user_id": user_id,
         "user_message": f"{user_id}'s words", "created_at": utc_now(),
         "response_parts": [{"type": "text", "content": "ok"}]}
    )  # fmt: skip
    legacy = LegacyTurns(db)
    return {
        "logger": AgentMessageLogger(db, legacy=legacy),
        "store": ConversationStore(db, legacy=legacy),
    }


STALE_RESUMES = [
    pytest.param(None, "u", id="deleted"),
    pytest.param("u", "u", id="started again"),
    pytest.param("grace", None, id="started again for another user, a service's runtime"),
]
"""What became of the conversation of a run paused for approval (`None`: deleted; else
deleted and started again by that user), and who logs the run's answer (a runtime acting for
"u", or a service, `None`): `@pytest.mark.parametrize(("again_by", "runtime"), STALE_RESUMES)`."""


@dataclass(frozen=True)
class StaleResume:
    """A paused run's conversation deleted, maybe started again, as `STALE_RESUMES` says: how
    the runtime's late answer to `call_id` is refused, and the conversation it must leave."""

    refused: type[Exception]
    said: str
    before: list[Any] | None
    """The new chat's transcript before the answer; None: the conversation is gone."""
    lands: Callable[[], Awaitable[Any]] | None = None
    """The new chat's first turn retried, its first insert lost (`first_insert_lost`); None
    when it was stored at once."""

    async def left_as_it_was(self, store: ConversationStore, conversation_id: str) -> None:
        """Nothing the refused answer wrote: no conversation created again, the new chat as
        it was (once its first turn's retry lands, when its first insert was lost)."""
        if self.before is None:
            with pytest.raises(NotFound):
                await store.get_conversation(conversation_id)
        elif self.lands is not None:
            await self.lands()
            said = [(m.role, m.content) for m in await store.transcript(conversation_id)]
            assert said == [("user", "A new chat.")]
        else:
            assert await store.transcript(conversation_id) == self.before


async def _insert_lost(*args: Any, **kwargs: Any) -> None:
    raise ConnectionError("reserved, its insert lost (the client sees a 503 and retries)")


async def reserved_insert_lost(
    logger: AgentMessageLogger, log: Callable[[], Awaitable[Any]]
) -> None:
    """`log()`, a turn `logger` logs, reserves its block and loses its insert (still being
    written, within `abandon_after`: its writer retries)."""
    messages = logger._messages
    messages.insert_many = _insert_lost
    try:
        with suppress(ConnectionError):
            await log()
    finally:
        del messages.insert_many


async def deleted_while_paused(
    db: Any,
    conversation_id: str,
    again_by: str | None,
    call_id: str,
    *,
    first_insert_lost: bool = False,
) -> StaleResume:
    """The person ("u") deletes the conversation of a run paused on `call_id`; `again_by`
    given, that user starts a new chat under its id. No message of it makes the call then:
    an answer is refused as an `answers_to` naming such a call is (the conversation missing:
    never created, NotFound to a runtime acting for the user; present: InvalidInput). With
    `first_insert_lost`, the new chat's first turn reserved its block but its insert was lost
    (still being written, within `abandon_after`): the answer is refused all the same."""
    store = ConversationStore(db)
    await store.delete(conversation_id, user_id="u")
    if again_by is None:
        return StaleResume(NotFound, "was not found", None)
    chat = [{"role": "user", "content": "A new chat."}]
    new_chat = AgentMessageLogger(db)

    async def first_turn() -> Any:
        return await new_chat.log_messages(conversation_id, chat, user_id=again_by, turn_id="new-1")

    lands = None
    if first_insert_lost:
        await reserved_insert_lost(new_chat, first_turn)
        lands = first_turn
    else:
        await first_turn()
    said = f"no message of this conversation makes call {call_id!r}"
    return StaleResume(InvalidInput, said, await store.transcript(conversation_id), lands)


def hitl_turn(request_id: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Please pay the invoice."},
        {
            "role": "assistant",
            "content": "Shall I pay 120 EUR?",
            "hitl_action": {"action": "confirm_payment", "params": {}, "request_id": request_id},
        },
    ]


async def seed(store: Store) -> None:
    await store.logger.ensure_indexes()
    await load_demo(store)
    await store.logger.log_messages(
        OWNER_HITL_CONVERSATION, hitl_turn("req-ada"), user_id=OWNER, turn_id="t-hitl"
    )
    await store.logger.log_messages(
        OTHER_HITL_CONVERSATION, hitl_turn("req-grace"), user_id=OTHER, turn_id="t-hitl"
    )


async def digest(db: Any) -> str:
    """A fingerprint of every stored document: equal before and after means nothing changed."""
    hasher = hashlib.sha256()
    for name in (CONVERSATIONS, MESSAGES, LEGACY_TURNS):
        docs = await db[name].find({}).sort("_id", 1).to_list(None)
        hasher.update(json.dumps(docs, sort_keys=True, default=str).encode())
    return hasher.hexdigest()


@dataclass
class Served:
    http: httpx.AsyncClient
    store: Store
    db: Any

    async def digest(self) -> str:
        return await digest(self.db)


def mongomock_db() -> Any:
    from mongomock_motor import AsyncMongoMockClient

    return AsyncMongoMockClient(tz_aware=True)[f"api_{uuid.uuid4().hex[:12]}"]


@asynccontextmanager
async def serve(
    db: Any, settings: Settings | None = None, *, seeded: bool = True
) -> AsyncIterator[Served]:
    """The app on `db` (seeded unless told otherwise) behind an in-process ASGI client."""
    settings = settings or api_settings()
    store = Store.on(db, settings)
    if seeded:
        await seed(store)
    app = create_app(settings, store=store)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield Served(http, store, db)
