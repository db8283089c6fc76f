"""The ownership model, cell by cell: every conversation state, every kind of caller, every
route that reads, writes or deletes one conversation.

A conversation is owned by a user, unowned (only services write to it), exists
only as legacy turns (owned by the user they name), or exists nowhere. A user
token acts only on what it owns or on ids that exist nowhere; a service acts on
anything, but a turn naming another user than the owner is a conflict, and an
id that exists only as legacy turns waits for its migration. Each cell's status
is written out below; a digest of every collection proves that a refused call
changed nothing and an accepted one changed only its own conversation.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any

import pytest
from bson import ObjectId

from agent_store.core import utc_now
from agent_store.legacy import LEGACY_TURNS, SESSION_HITL, parse_turns
from agent_store.store import CONVERSATIONS, MESSAGES
from tests.api_harness import (
    OTHER,
    OWNER,
    Served,
    api_settings,
    auth_headers,
    hitl_turn,
    mongomock_db,
    serve,
)
from tests.conftest import Backend

MALLORY = "user-mallory"
STATES = (
    "mine", "another", "unowned", "legacy-another", "legacy-mine", "absent", "legacy-mine-beside",
)  # fmt: skip
"""`legacy-mine-beside`: OWNER's legacy turns under the id of another user's conversation (a
late turn the old service wrote there during the transition): to OWNER's token that
conversation is as if absent, so every answer is the one `legacy-mine` gets."""
LEGACY_OID = ObjectId("6b0d2c1e9f1a4b3c2d1e0f1a")
SPELLED: dict[str, tuple[str, dict[str, Any]]] = {
    # Another user's legacy-only conversation, under each id its turns may be known by.
    "legacy-objectid": (str(LEGACY_OID), {"_id": "lt-oid", "conversation_id": LEGACY_OID}),
    "legacy-number": ("424242", {"_id": "lt-number", "conversation_id": 424242}),
    "legacy-unnamed": ("legacy-turn-lt-unnamed", {"_id": "lt-unnamed"}),
}
"""Read as `legacy-another` in every table: the same conversation, spelled otherwise."""
CALLERS = ("service", "service-naming-another", "owner-token", "another-token")
ROUTES = (
    "get", "rename", "delete", "transcript", "messages", "log-turn", "pending", "resolve",
)  # fmt: skip

# Rows: routes; columns: STATES. One table per caller.
EXPECTED: dict[str, dict[str, tuple[int, ...]]] = {
    "service": {
        #              mine another unowned legacy-another legacy-mine absent beside
        "get":        (200, 200, 200, 200, 200, 404, 200),
        "rename":     (200, 200, 200, 409, 409, 404, 200),
        "delete":     (200, 200, 200, 200, 200, 404, 200),
        "transcript": (200, 200, 200, 200, 200, 404, 200),
        "messages":   (200, 200, 200, 200, 200, 404, 200),
        "log-turn":   (201, 201, 201, 409, 409, 201, 201),
        "pending":    (200, 200, 200, 200, 200, 404, 200),
        "resolve":    (200, 200, 200, 409, 409, 404, 200),
    },
    "service-naming-another": {  # the service names MALLORY as the turn's user
        "get":        (200, 200, 200, 200, 200, 404, 200),
        "rename":     (200, 200, 200, 409, 409, 404, 200),
        "delete":     (200, 200, 200, 200, 200, 404, 200),
        "transcript": (200, 200, 200, 200, 200, 404, 200),
        "messages":   (200, 200, 200, 200, 200, 404, 200),
        "log-turn":   (409, 409, 201, 409, 409, 201, 409),
        "pending":    (200, 200, 200, 200, 200, 404, 200),
        "resolve":    (200, 200, 200, 409, 409, 404, 200),
    },
    "owner-token": {
        "get":        (200, 404, 404, 404, 200, 404, 200),
        "rename":     (200, 404, 404, 404, 409, 404, 409),
        "delete":     (200, 404, 404, 404, 200, 404, 200),
        "transcript": (200, 404, 404, 404, 200, 404, 200),
        "messages":   (200, 404, 404, 404, 200, 404, 200),
        "log-turn":   (201, 404, 404, 404, 409, 201, 409),
        "pending":    (200, 404, 404, 404, 200, 404, 200),
        "resolve":    (200, 404, 404, 404, 409, 404, 409),
    },
    "another-token": {  # MALLORY's token: owns none of these
        "get":        (404, 404, 404, 404, 404, 404, 404),
        "rename":     (404, 404, 404, 404, 404, 404, 404),
        "delete":     (404, 404, 404, 404, 404, 404, 404),
        "transcript": (404, 404, 404, 404, 404, 404, 404),
        "messages":   (404, 404, 404, 404, 404, 404, 404),
        "log-turn":   (404, 404, 404, 404, 404, 201, 404),
        "pending":    (404, 404, 404, 404, 404, 404, 404),
        "resolve":    (404, 404, 404, 404, 404, 404, 404),
    },
}  # fmt: skip


def conversation_id(state: str) -> str:
    return SPELLED[state][0] if state in SPELLED else f"conv-state-{state}"


async def seed_states(api: Served) -> None:
    logger = api.store.logger
    owners = {"mine": OWNER, "another": OTHER, "unowned": None, "legacy-mine-beside": OTHER}
    for state, owner in owners.items():
        await logger.log_messages(
            conversation_id(state), hitl_turn(f"req-{state}"), user_id=owner, turn_id="t-1"
        )
    legacy_owners = (("legacy-another", OTHER), ("legacy-mine", OWNER))
    for state, owner in (*legacy_owners, ("legacy-mine-beside", OWNER)):
        await api.db[LEGACY_TURNS].insert_one(
            {
                "_id": f"legacy-{state}",
                "conversation_id": conversation_id(state),
                "user_id": owner,
                "user_message": "secret of the legacy owner",
                "response_parts": [{"type": "text", "content": "a legacy answer"}],
            }
        )
    for _, turn in SPELLED.values():
        await api.db[LEGACY_TURNS].insert_one(
            turn
            | {
                "user_id": OTHER,
                "user_message": "secret of the legacy owner",
                "response_parts": [{"type": "text", "content": "a legacy answer"}],
            }
        )


def request_for(route: str, state: str, caller: str) -> tuple[str, str, dict[str, Any] | None]:
    url = f"/v1/conversations/{conversation_id(state)}"
    turn: dict[str, Any] = {"turn_id": "t-matrix", "messages": [{"role": "user", "content": "hi"}]}
    if caller == "service-naming-another":
        turn["user_id"] = MALLORY
    return {
        "get": ("GET", url, None),
        "rename": ("PATCH", url, {"name": "Renamed"}),
        "delete": ("DELETE", url, None),
        "transcript": ("GET", f"{url}/transcript", None),
        "messages": ("GET", f"{url}/messages?limit=5", None),
        "log-turn": ("POST", f"{url}/turns", turn),
        "pending": ("GET", f"{url}/hitl", None),
        "resolve": ("POST", f"{url}/hitl/resolve", {"request_id": f"req-{state}"}),
    }[route]


def headers_for(caller: str) -> dict[str, str]:
    if caller == "owner-token":
        return auth_headers(user=OWNER)
    if caller == "another-token":
        return auth_headers(user=MALLORY)
    return auth_headers()


async def digests(db: Any, excluding: str | None = None) -> str:
    """Every collection's documents, leaving out those of conversation `excluding`."""
    hasher = hashlib.sha256()
    for name in (CONVERSATIONS, MESSAGES, LEGACY_TURNS, SESSION_HITL):
        for doc in await db[name].find({}).sort("_id", 1).to_list(None):
            names = (doc.get("_id"), str(doc.get("conversation_id")), f"legacy-turn-{doc['_id']}")
            if excluding is not None and excluding in names:
                continue
            hasher.update(json.dumps(doc, sort_keys=True, default=str).encode())
    return hasher.hexdigest()


@pytest.mark.parametrize("state", [*STATES, *SPELLED])
@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("route", ROUTES)
async def test_each_caller_gets_the_status_the_ownership_model_gives(
    route: str, caller: str, state: str
) -> None:
    column = "legacy-another" if state in SPELLED else state
    expected = EXPECTED[caller][route][STATES.index(column)]
    async with serve(mongomock_db()) as api:
        await seed_states(api)
        target = conversation_id(state)
        everything, others = await digests(api.db), await digests(api.db, excluding=target)
        method, url, body = request_for(route, state, caller)

        response = await api.http.request(method, url, json=body, headers=headers_for(caller))

        assert response.status_code == expected, response.text
        if expected >= 400:
            assert await digests(api.db) == everything, "a refused call changed data"
        else:
            assert await digests(api.db, excluding=target) == others, "another conversation changed"
        if caller == "another-token" or (caller == "owner-token" and "another" in state):
            assert "secret of the legacy owner" not in response.text
        if caller.endswith("-token") and column not in ("mine", "absent"):
            assert "Please pay the invoice" not in response.text


@pytest.mark.parametrize("message_id", ["msg-taken", "msg-unused"])
async def test_a_chosen_message_id_is_refused_alike_whether_it_exists_or_not(
    message_id: str,
) -> None:
    """No existence oracle: the answer does not depend on what is stored."""
    async with serve(mongomock_db()) as api:
        await api.db[MESSAGES].insert_one({"_id": "msg-taken", "conversation_id": "elsewhere"})
        before = await digests(api.db)
        body = {"messages": [{"role": "user", "content": "hi", "_id": message_id}]}

        response = await api.http.post(
            "/v1/conversations/conv-squat/turns", json=body, headers=auth_headers(user=MALLORY)
        )

        assert response.status_code == 422
        assert "message ids are the store's" in response.json()["error"]["message"]
        assert await digests(api.db) == before


DERIVED_ONLY: dict[str, tuple[dict[str, Any], int]] = {
    # A legacy id the migration cannot keep: it stores it under a digest of it, which nothing
    # traces back to the turns before the migration has run.
    "a conversation id that is not an identifier": (
        {"_id": "lt-odd", "conversation_id": "c of b"}, 422
    ),
    # A turn naming no conversation is found under its digest: it is another user's legacy
    # conversation, which a service may not take turns into either (409).
    "a turn naming no conversation, by an odd id": ({"_id": "turn of b"}, 409),
}  # fmt: skip


@pytest.mark.parametrize(("turn", "to_a_service"), DERIVED_ONLY.values(), ids=list(DERIVED_ONLY))
@pytest.mark.parametrize("caller", CALLERS)
async def test_no_caller_creates_a_conversation_under_an_id_the_migration_derives(
    caller: str, turn: dict[str, Any], to_a_service: int
) -> None:
    """Ids starting `legacy-conversation-` or `legacy-turn-` are the migration's: a service is
    told why (422, or 409 when the id is found to be another user's legacy conversation); a
    user token gets 404, as for another user's conversation."""
    async with serve(mongomock_db()) as api:
        await api.db[LEGACY_TURNS].insert_one(
            turn | {"user_id": OTHER, "user_message": "secret of the legacy owner"}
        )
        target = parse_turns([turn])[0].stored_conversation_id
        before = await digests(api.db)
        _, url, body = request_for("log-turn", "absent", caller)

        response = await api.http.post(
            url.replace(conversation_id("absent"), target), json=body, headers=headers_for(caller)
        )

        assert response.status_code == (to_a_service if caller.startswith("service") else 404)
        assert await digests(api.db) == before


async def test_a_fork_into_an_id_the_migration_derives_is_refused() -> None:
    async with serve(mongomock_db()) as api:
        await seed_states(api)
        before = await digests(api.db)

        response = await api.http.post(
            f"/v1/conversations/{conversation_id('mine')}/forks",
            json={"at_seq": 0, "new_conversation_id": "legacy-turn-mine"},
            headers=auth_headers(user=OWNER),
        )

        assert response.status_code == 404
        assert await digests(api.db) == before


# Steering a conversation that exists only as legacy turns: opening, delivering into and
# closing an inbox are writes, answered as every write to it (409 "not migrated yet"; a user
# token opens and closes none: 403); reading the inbox is a read, served as GET serves the
# conversation: no inbox is open in it. Another user's token gets 404 throughout.
INBOX_ON_LEGACY: dict[str, dict[str, int]] = {
    #                  open  deliver close read
    "service":       {"open": 409, "deliver": 409, "close": 409, "read": 200},
    "owner-token":   {"open": 403, "deliver": 409, "close": 403, "read": 200},
    "another-token": {"open": 403, "deliver": 404, "close": 403, "read": 404},
}  # fmt: skip


@pytest.mark.parametrize("caller", list(INBOX_ON_LEGACY))
async def test_the_inbox_of_a_conversation_only_legacy_turns_hold_answers_as_every_write_to_it(
    caller: str,
) -> None:
    async with serve(mongomock_db()) as api:
        await seed_states(api)
        before = await digests(api.db)
        base = f"/v1/conversations/{conversation_id('legacy-mine')}/turns/run-1/inbox"
        message = {"message": {"role": "user", "content": "steer"}, "delivery_id": "d1"}
        calls = {
            "open": ("POST", base, None),
            "deliver": ("POST", f"{base}/messages", message),
            "close": ("POST", f"{base}/close", {"last_seen_seq": -1}),
            "read": ("GET", base, None),
        }

        for action, status in INBOX_ON_LEGACY[caller].items():
            method, url, body = calls[action]
            answer = await api.http.request(method, url, json=body, headers=headers_for(caller))

            assert answer.status_code == status, (action, answer.text)
            if status == 409:
                assert "not migrated yet" in answer.json()["error"]["message"], action
            if status == 200:
                assert answer.json() == {"data": [], "has_more": False}
        assert await digests(api.db) == before


@pytest.mark.parametrize("caller", ["service", "owner-token"])
@pytest.mark.parametrize("state", ["mine", "another", "unowned", "legacy-another", "legacy-mine"])
async def test_a_fork_into_an_id_that_is_taken_is_told_the_id_exists_already(
    caller: str, state: str
) -> None:
    """A fork never writes into an existing id, whoever holds it: 409 "exists already; fork
    into a new id", naming no other user and advising no claim or migration (neither makes
    the fork). To a user token an id it may not see (another user's, unowned, another user's
    legacy turns) is 404, as every write of it there is. Nothing written."""
    async with serve(mongomock_db()) as api:
        await seed_states(api)
        said = {"turn_id": "s-1", "messages": [{"role": "user", "content": "to fork"}]}
        made = await api.http.post(
            "/v1/conversations/conv-fork-source/turns", json=said, headers=auth_headers(user=OWNER)
        )
        assert made.status_code == 201, made.text
        before = await digests(api.db)
        target = conversation_id(state)

        answer = await api.http.post(
            "/v1/conversations/conv-fork-source/forks",
            json={"at_seq": 0, "new_conversation_id": target},
            headers=headers_for(caller),
        )

        seen = caller == "service" or state in ("mine", "legacy-mine")
        if seen:
            assert answer.status_code == 409, answer.text
            said_back = answer.json()["error"]["message"]
            assert said_back == f"conversation {target!r} exists already; fork into a new id"
        else:
            assert answer.status_code == 404, answer.text
            assert OTHER not in answer.text
        assert await digests(api.db) == before


async def test_no_upsert_creates_a_conversation_under_an_id_the_migration_derives() -> None:
    """`upsert_conversation` (the LangGraph saver's way in) refuses what a turn refuses."""
    from agent_store import InvalidInput

    async with serve(mongomock_db()) as api:
        logger = api.store.logger
        with pytest.raises(InvalidInput, match="name migrated legacy conversations"):
            await logger.upsert_conversation("legacy-conversation-0123", user_id=MALLORY)
        assert await api.db[CONVERSATIONS].count_documents({"_id": {"$regex": "^legacy-"}}) == 0


def said(text: str, turn_id: str, **extra: Any) -> dict[str, Any]:
    return {"turn_id": turn_id, "messages": [{"role": "user", "content": text}], **extra}


ASSIGNED = "/v1/conversations/conv-assigned"


async def assign_after_an_unowned_turn(api: Served, before: str) -> None:
    """A service logs a turn naming no user (the conversation is unowned), then one naming
    OWNER: that turn assigns the conversation to OWNER."""
    service = auth_headers()
    first = await api.http.post(f"{ASSIGNED}/turns", json=said(before, "t-1"), headers=service)
    assert first.status_code == 201, first.text
    second = await api.http.post(
        f"{ASSIGNED}/turns", json=said("after", "t-2", user_id=OWNER), headers=service
    )
    assert second.status_code == 201, second.text


async def test_a_conversation_a_service_turn_assigns_shows_its_owner_every_message(
    backend: Backend,
) -> None:
    """'unowned | service naming another user: a turn assigns it', and the owner then reads
    all of it: the messages logged before the assignment are the owner's too."""
    async with serve(backend.db) as api:
        await assign_after_an_unowned_turn(api, "before")
        owner = auth_headers(user=OWNER)

        transcript = await api.http.get(f"{ASSIGNED}/transcript", headers=owner)
        page = await api.http.get(f"{ASSIGNED}/messages", headers=owner)
        export = await api.http.get(f"/v1/users/{OWNER}/export", headers=owner)

        assert [m["content"] for m in transcript.json()["data"]] == ["before", "after"]
        assert [m["content"] for m in page.json()["data"]] == ["before", "after"]
        assert "before" in export.text
        if "text_search" not in backend.lacks:
            found = await api.http.get("/v1/search", params={"q": "before"}, headers=owner)
            assert [h["message"]["content"] for h in found.json()["data"]] == ["before"]
        stored = await api.db[MESSAGES].find({"conversation_id": "conv-assigned"}).to_list(None)
        assert {m["user_id"] for m in stored} == {OWNER}


async def test_erasing_a_user_frees_the_id_of_a_conversation_a_turn_assigned_them(
    backend: Backend,
) -> None:
    """Erasing OWNER removes every message of OWNER's conversations; the id then exists
    nowhere, and another user's first turn there creates a conversation of its own."""
    async with serve(backend.db) as api:
        await assign_after_an_unowned_turn(api, "secret before")
        erased = await api.http.delete(f"/v1/users/{OWNER}", headers=auth_headers(user=OWNER))
        assert erased.status_code == 200, erased.text

        fresh = await api.http.post(
            f"{ASSIGNED}/turns", json=said("mine", "t-1"), headers=auth_headers(user=MALLORY)
        )

        assert fresh.status_code == 201, fresh.text
        assert [m["content"] for m in fresh.json()["messages"]] == ["mine"]
        left = await api.db[MESSAGES].find({"conversation_id": "conv-assigned"}).to_list(None)
        assert [(m["content"], m["user_id"]) for m in left] == [("mine", MALLORY)]


async def test_naming_an_owner_for_an_unowned_conversation_hands_them_its_messages(
    backend: Backend,
) -> None:
    """`upsert_conversation` naming a user assigns an unowned conversation as a turn does:
    its earlier messages become the owner's (every message carries the owner)."""
    from agent_store import AgentMessageLogger, ConversationStore

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-up", [{"role": "user", "content": "before"}], turn_id="t1")
    await logger.upsert_conversation("c-up", user_id=OWNER)
    await logger.log_messages(
        "c-up", [{"role": "user", "content": "after"}], user_id=OWNER, turn_id="t2"
    )

    assert [m.content for m in await store.transcript("c-up", user_id=OWNER)] == [
        "before", "after"
    ]  # fmt: skip


async def test_a_retried_turn_naming_a_user_assigns_an_unowned_conversation_as_a_new_one_does(
    backend: Backend,
) -> None:
    """A turn logged unowned, retried by a service naming OWNER: the replay assigns the
    conversation to OWNER as the same turn logged fresh would, and every message is OWNER's;
    retried naming another user than the owner then, it is a Conflict, nothing written."""
    from agent_store import AgentMessageLogger, Conflict, ConversationStore

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    first = [{"role": "user", "content": "hello", "created_at": "2026-12-01T00:00:00Z"}]
    await logger.log_messages("c-re", first, turn_id="t1")

    again = await logger.log_messages("c-re", first, user_id=OWNER, turn_id="t1")

    assert again.replayed
    assert [m.user_id for m in again.messages] == [OWNER]
    assert (await store.get_conversation("c-re")).user_id == OWNER
    assert [m.content for m in await store.transcript("c-re", user_id=OWNER)] == ["hello"]
    stored = await backend.db[MESSAGES].find({"conversation_id": "c-re"}).to_list(None)
    assert {m["user_id"] for m in stored} == {OWNER}
    with pytest.raises(Conflict, match="belongs to another user"):
        await logger.log_messages("c-re", first, user_id=OTHER, turn_id="t1")
    assert (await store.get_conversation("c-re")).user_id == OWNER


async def test_a_retried_turn_naming_a_user_over_http_assigns_the_unowned_conversation(
    backend: Backend,
) -> None:
    """POST …/turns retried with `user_id` for an unowned conversation: 200 replayed, and the
    conversation is that user's, whose token reads it."""
    async with serve(backend.db) as api:
        turn = said("before", "t-1")
        first = await api.http.post(f"{ASSIGNED}/turns", json=turn, headers=auth_headers())
        assert first.status_code == 201, first.text

        retried = await api.http.post(
            f"{ASSIGNED}/turns", json={**turn, "user_id": OWNER}, headers=auth_headers()
        )

        assert retried.status_code == 200, retried.text
        assert [m["user_id"] for m in retried.json()["messages"]] == [OWNER]
        read = await api.http.get(f"{ASSIGNED}/transcript", headers=auth_headers(user=OWNER))
        assert read.status_code == 200, read.text
        assert [m["content"] for m in read.json()["data"]] == ["before"]


async def test_naming_an_owner_hands_them_a_turn_still_being_written_too(
    backend: Backend,
) -> None:
    """An unowned turn reserved before `upsert_conversation` names the owner, and inserting
    right after it: swept `claim_grace` later, as after an assigning turn."""
    import asyncio
    from datetime import timedelta

    from agent_store import AgentMessageLogger, TurnRules

    rules = TurnRules(claim_grace=timedelta(seconds=0.3))
    base, slow = AgentMessageLogger(backend.db, rules=rules), AgentMessageLogger(backend.db)
    await base.log_messages("c-up", [{"role": "user", "content": "first"}], turn_id="t0")
    real, reached, release = slow._messages, asyncio.Event(), asyncio.Event()

    class Held:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        async def insert_many(self, *args: Any, **kwargs: Any) -> Any:
            reached.set()
            await release.wait()
            return await real.insert_many(*args, **kwargs)

    slow._messages = Held()
    turn = asyncio.create_task(
        slow.log_messages("c-up", [{"role": "user", "content": "second"}], turn_id="t1")
    )
    await reached.wait()
    naming = asyncio.create_task(base.upsert_conversation("c-up", user_id=OWNER))
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.gather(turn, naming)

    stored = (
        await backend.db[MESSAGES].find({"conversation_id": "c-up"}).sort("seq", 1).to_list(None)
    )
    assert [(m["content"], m["user_id"]) for m in stored] == [("first", OWNER), ("second", OWNER)]


def writes_of_a_user(target: str) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """A user token's writes that name `target`: a turn, a delivery, a fork of it, a fork
    into it (from a conversation of her own, `conv-own`)."""
    url = f"/v1/conversations/{target}"
    steer = {"message": {"role": "user", "content": "steer"}}
    return {
        "turn": ("POST", f"{url}/turns", said("hi", "t-new")),
        "delivery": ("POST", f"{url}/turns/run-1/inbox/messages", steer),
        "fork from": ("POST", f"{url}/forks", {"at_seq": 0, "new_conversation_id": "conv-fk"}),
        "fork into": (
            "POST", "/v1/conversations/conv-own/forks", {"at_seq": 0, "new_conversation_id": target}
        ),
    }  # fmt: skip


@pytest.mark.parametrize("holder", [MALLORY, None], ids=["another user's", "unowned"])
async def test_a_users_writes_to_her_legacy_id_answer_alike_whoever_holds_a_conversation_there(
    backend: Backend, holder: str | None
) -> None:
    """OWNER's legacy turns under an id where another user (or a service, unowned) holds a
    conversation: to her token that conversation is as if absent, so each of her writes is
    refused as under an id her legacy turns alone hold (409 not migrated yet, or exists
    already for a fork into it), never told apart by the other conversation; nothing written."""
    async with serve(backend.db, seeded=False) as api:
        await api.store.logger.ensure_indexes()
        await api.store.logger.log_messages("conv-beside", hitl_turn("r"), user_id=holder)
        await api.store.logger.log_messages("conv-own", hitl_turn("r"), user_id=OWNER)
        for target in ("conv-alone", "conv-beside"):
            await api.db[LEGACY_TURNS].insert_one(
                {"_id": f"late-{target}", "conversation_id": target, "user_id": OWNER,
                 "user_message": "mine", "response_parts": [{"type": "text", "content": "ok"}]}
            )  # fmt: skip
        before = await digests(api.db)
        owner = auth_headers(user=OWNER)

        answers = {}
        for target in ("conv-alone", "conv-beside"):
            for write, (method, url, body) in writes_of_a_user(target).items():
                answer = await api.http.request(method, url, json=body, headers=owner)
                answers[write, target] = (answer.status_code, answer.json()["error"]["message"])

        for write in writes_of_a_user(""):
            alone, beside = answers[write, "conv-alone"], answers[write, "conv-beside"]
            assert beside == (alone[0], alone[1].replace("conv-alone", "conv-beside")), write
            assert alone[0] == 409, write
        assert await digests(api.db) == before


def reads_and_delete(target: str) -> dict[str, tuple[str, str]]:
    url = f"/v1/conversations/{target}"
    return {
        "get": ("GET", url), "transcript": ("GET", f"{url}/transcript"),
        "messages": ("GET", f"{url}/messages?limit=5"), "pending": ("GET", f"{url}/hitl"),
        "delete": ("DELETE", url),
    }  # fmt: skip


async def log_live_beside(api: Served, holder: str | None) -> set[Any]:
    """Dual write on: a service logs `conv-beside` unowned, then (for `holder`) a turn naming
    them assigns it; the `_id`s of its rollback copies (the first names no user)."""
    for turn_id, user in (("s0", None), ("s1", holder)):
        said = [{"role": "user", "content": "«LIVE SECRET»"}]
        body = {"turn_id": turn_id, "user_id": user, "messages": said}
        logged = await api.http.post(
            "/v1/conversations/conv-beside/turns", json=body, headers=auth_headers()
        )
        assert logged.status_code == 201, logged.text
    return {c["_id"] for c in await api.db[LEGACY_TURNS].find().to_list(None)}


@pytest.mark.parametrize("holder", [MALLORY, None], ids=["another user's", "unowned"])
async def test_with_dual_write_on_a_users_reads_and_delete_beside_a_live_conversation_are_hers(
    backend: Backend, holder: str | None
) -> None:
    """OWNER's late legacy turn under the id of a live conversation not hers, dual write on:
    the live conversation's rollback copies (one naming no user, logged before a turn
    assigned it) are its own, never her legacy turns, so every read and her delete answer as
    under an id her turn alone holds, and the copies all stay."""
    async with serve(backend.db, api_settings(legacy_dual_write=True), seeded=False) as api:
        await api.store.logger.ensure_indexes()
        copies = await log_live_beside(api, holder)
        for target in ("conv-alone", "conv-beside"):
            await api.db[LEGACY_TURNS].insert_one(
                {"_id": f"late-{target}", "conversation_id": target, "user_id": OWNER,
                 "created_at": utc_now() + timedelta(minutes=1), "user_message": "mine",
                 "response_parts": [{"type": "text", "content": "ok"}]}
            )  # fmt: skip

        answers = {}
        for target in ("conv-alone", "conv-beside"):
            for route, (method, url) in reads_and_delete(target).items():
                answer = await api.http.request(method, url, headers=auth_headers(user=OWNER))
                assert "«LIVE SECRET»" not in answer.text, (route, target)
                body = answer.json()
                said = [m["content"] for m in body.get("data", ())]
                answers[route, target] = (answer.status_code, said, body.get("message_count"))

        for route in reads_and_delete(""):
            assert answers[route, "conv-beside"] == answers[route, "conv-alone"], (route, answers)
            assert answers[route, "conv-alone"][0] == 200, route
        left = {c["_id"] for c in await api.db[LEGACY_TURNS].find().to_list(None)}
        assert left == copies


DUAL_WRITE = pytest.mark.parametrize("dual_write", [True, False], ids=["dual write on", "off"])


async def unnamed_beside(api: Served, target: str) -> None:
    """Under `target`, as an old-service writer leaves them: a legacy turn, a prompt naming
    the conversation and one naming it by `session_id` only, none of them naming a user."""
    secret = "«UNNAMED SECRET»"
    await api.db[LEGACY_TURNS].insert_one(
        {"_id": f"none-{target}", "conversation_id": target, "user_message": secret,
         "created_at": utc_now() + timedelta(minutes=1),
         "response_parts": [{"type": "text", "content": secret}]}
    )  # fmt: skip
    for key in ("conversation_id", "session_id"):
        await api.db[SESSION_HITL].insert_one(
            {"_id": f"{key}-{target}", key: target, "request_id": f"r-{key}", "action": "pay",
             "prompt": secret, "params": {"iban": secret}, "status": "pending",
             "created_at": utc_now() + timedelta(minutes=1)}
        )  # fmt: skip


@DUAL_WRITE
@pytest.mark.parametrize("holder", [MALLORY, None], ids=["another user's", "unowned"])
@pytest.mark.parametrize("after", [None, OTHER], ids=["hers last", "another's after hers"])
async def test_beside_a_live_conversation_a_user_reaches_her_own_legacy_turn_alone(
    backend: Backend, dual_write: bool, holder: str | None, after: str | None
) -> None:
    """OWNER's late legacy turn under the id of a live conversation not hers, beside a legacy
    turn and prompts naming no user (and another user's later turn, `after`), dual write on
    or off: what names no user is the live conversation's, and her turn is hers whoever is
    named last, so every read, her writes and her delete answer as under an id her turn
    alone holds; nothing naming no user is served to her or deleted by her."""
    settings = api_settings(legacy_dual_write=dual_write)
    async with serve(backend.db, settings, seeded=False) as api:
        await api.store.logger.ensure_indexes()
        await api.store.logger.log_messages("conv-own", hitl_turn("r"), user_id=OWNER)
        copies = await log_live_beside(api, holder)
        await unnamed_beside(api, "conv-beside")
        for target, users in (("conv-alone", [OWNER]), ("conv-beside", [OWNER, after])):
            for minutes, user in enumerate(users, start=2):
                if user is not None:
                    await api.db[LEGACY_TURNS].insert_one(
                        {"_id": f"late-{target}-{user}", "conversation_id": target,
                         "user_id": user, "user_message": "mine",
                         "created_at": utc_now() + timedelta(minutes=minutes),
                         "response_parts": [{"type": "text", "content": "ok"}]}
                    )  # fmt: skip
        owner = auth_headers(user=OWNER)

        answers = {}
        for target in ("conv-alone", "conv-beside"):
            calls = {**writes_of_a_user(target), **reads_and_delete(target)}
            for route, (method, url, *body) in calls.items():
                answer = await api.http.request(method, url, json=body[0] if body else None,
                                                headers=owner)  # fmt: skip
                assert "SECRET»" not in answer.text, (route, target)
                found = answer.json()
                said = [m["content"] for m in found.get("data", ())]
                message = found.get("error", {}).get("message", "").replace(target, "ID")
                count = found.get("message_count")
                answers[route, target] = (answer.status_code, said, count, message)

        for route in (*writes_of_a_user(""), *reads_and_delete("")):
            assert answers[route, "conv-beside"] == answers[route, "conv-alone"], (route, answers)
        left = {c["_id"] for c in await api.db[LEGACY_TURNS].find().to_list(None)}
        later = {f"late-conv-beside-{after}"} if after is not None else set()
        assert left == copies | {"none-conv-beside"} | later
        assert await api.db[SESSION_HITL].count_documents({"prompt": {"$regex": "SECRET"}}) == 2


# A runtime acting for a user (an integration given `user_id`) checks that user's ownership as
# the user's token does; its turns stay a runtime's (it steers them: `SteeringInbox`).

ENTRIES = ("agents-session", "langchain-history", "pydantic-ai-run", "langgraph-saver", "stream")
UNSTANDING = {"another-deleting": "deleting_since", "another-forking": "fork_check",
              "another-migrating": "migrating"}  # fmt: skip
"""Another user's conversation that is no conversation here: marked by a delete, a fork not
made yet, being migrated. Over HTTP each is a 404 to OWNER's token, as a missing one."""


async def seed_unstanding(api: Served) -> None:
    for state, field in UNSTANDING.items():
        target = conversation_id(state)
        await api.store.logger.log_messages(target, hitl_turn("req"), user_id=OTHER, turn_id="t-1")
        mark = utc_now() if field == "deleting_since" else {"since": utc_now()}
        await api.db[CONVERSATIONS].update_one({"_id": target}, {"$set": {field: mark}})


async def write_for_owner(api: Served, entry: str, target: str) -> None:
    """One turn written by `entry` acting for OWNER, on the service's legacy-aware logger and
    store (MIGRATION.md, Transition flags)."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.graph import END, START, MessagesState, StateGraph
    from pydantic_ai import messages as pai

    from agent_store.integrations.langchain import ConversationChatHistory
    from agent_store.integrations.langgraph import AgentStoreSaver
    from agent_store.integrations.openai_agents import ConversationSession
    from agent_store.integrations.pydantic_ai import log_run
    from agent_store.integrations.streams import log_streamed_turn, turn_from_metadata

    wired = {"logger": api.store.logger, "store": api.store.conversations}
    if entry == "agents-session":
        session = ConversationSession(target, api.db, user_id=OWNER, **wired)
        await session.add_items([{"role": "user", "content": "hi"}])
    elif entry == "langchain-history":
        history = ConversationChatHistory(target, api.db, user_id=OWNER, **wired)
        await history.aadd_messages([HumanMessage("hi")])
    elif entry == "pydantic-ai-run":
        run = [pai.ModelRequest(parts=[pai.UserPromptPart("hi")])]
        await log_run(api.store.logger, target, run, turn_id="t-matrix", user_id=OWNER)
    elif entry == "langgraph-saver":
        builder = StateGraph(MessagesState)
        builder.add_node("agent", lambda state: {"messages": [AIMessage("ok")]})
        builder.add_edge(START, "agent")
        builder.add_edge("agent", END)
        graph = builder.compile(checkpointer=AgentStoreSaver(api.db, **wired))
        config = {"configurable": {"thread_id": target, "user_id": OWNER}}
        await graph.ainvoke({"messages": [HumanMessage("hi")]}, config)  # type: ignore[arg-type]
    else:
        turn = turn_from_metadata([{"type": "stream_token", "token": "ok"}], complete=True)
        await log_streamed_turn(
            **wired, conversation_id=target, turn=turn, turn_id="t-matrix", prompt="hi",
            user_id=OWNER,
        )  # fmt: skip


@pytest.mark.parametrize("state", [*STATES, *SPELLED, *UNSTANDING])
@pytest.mark.parametrize("entry", ENTRIES)
async def test_a_runtime_acting_for_a_user_writes_where_that_users_token_may(
    entry: str, state: str
) -> None:
    """Its own conversation or a new id: written, and its. A service's unowned one, another
    user's in any state, another user's legacy turns: NotFound with the HTTP 404's very text
    (no state told), nothing written, never adopted. Its own legacy turns: the 409's
    Conflict. The same answers as OWNER's token gets for a turn over HTTP."""
    from agent_store import Conflict, NotFound

    target = conversation_id(state)
    turn = {"turn_id": "t-matrix", "messages": [{"role": "user", "content": "hi"}]}
    async with serve(mongomock_db(), seeded=False) as told:
        await told.store.logger.ensure_indexes()
        await seed_states(told)
        await seed_unstanding(told)
        url = f"/v1/conversations/{target}/turns"
        token = await told.http.post(url, json=turn, headers=auth_headers(user=OWNER))
    async with serve(mongomock_db(), seeded=False) as api:
        await api.store.logger.ensure_indexes()
        await seed_states(api)
        await seed_unstanding(api)
        everything = await digests(api.db)

        if token.status_code == 201:
            await write_for_owner(api, entry, target)
            owner = await api.db[CONVERSATIONS].find_one({"_id": target})
            assert owner is not None
            assert owner["user_id"] == OWNER
            return
        refusal = NotFound if token.status_code == 404 else Conflict
        with pytest.raises(refusal) as refused:
            await write_for_owner(api, entry, target)

        assert str(refused.value) == token.json()["error"]["message"]
        assert await digests(api.db) == everything, "a refused write changed data"


@pytest.mark.parametrize("flag", ["strict_owner", "owner_only"])
@pytest.mark.parametrize("state", ["another", "unowned", "another-deleting", "mine"])
async def test_creating_only_under_an_id_not_the_users_is_not_found_to_her(
    state: str, flag: str
) -> None:
    """`upsert_conversation(create_only=True)` for a user checked strictly: an id another
    user or a service holds, in any state, is the 404's NotFound, as a missing one (never
    "exists already", which would tell her it is taken); her own is "exists already"."""
    from agent_store import Conflict, NotFound

    target = conversation_id(state)
    async with serve(mongomock_db(), seeded=False) as api:
        await seed_states(api)
        await seed_unstanding(api)
        everything = await digests(api.db)
        expected = Conflict if state == "mine" else NotFound
        with pytest.raises(expected) as refused:
            await api.store.logger.upsert_conversation(
                target, user_id=OWNER, create_only=True, **{flag: True}
            )
        if state != "mine":
            assert str(refused.value) == f"conversation {target!r} was not found"
        assert await digests(api.db) == everything


async def test_a_runtime_acting_for_a_user_steers_its_turn_and_logs_it(backend: Backend) -> None:
    """The steering loop of a runtime acting for a user: it logs the prompt for her, opens the
    turn's inbox, and logs the streamed answer under that turn id for her, a retry answered
    as logged; the prompt a run logged for her opens an inbox too. Its turns are a
    runtime's, never a person's: no 409 "only the runtime logs a turn under it"."""
    from pydantic_ai import messages as pai

    from agent_store import AgentMessageLogger, ConversationStore, SteeringInbox
    from agent_store.integrations.pydantic_ai import log_run
    from agent_store.integrations.streams import log_streamed_turn, turn_from_metadata

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages("conv-run", [{"role": "user", "content": "hi"}], user_id=OWNER)
    for opened in ("run-1", "run-2"):
        prompt = [pai.ModelRequest(parts=[pai.UserPromptPart("go")])]
        await log_run(logger, "conv-run", prompt, turn_id=f"{opened}-prompt", user_id=OWNER)
        await inbox.open_turn("conv-run", f"{opened}-prompt", user_id=OWNER)  # its own turn
        await inbox.open_turn("conv-run", opened, user_id=OWNER)
        assert await inbox.close_inbox("conv-run", opened, -1) == []
        turn = turn_from_metadata([{"type": "stream_token", "token": "ok"}], complete=True)
        for _ in range(2):  # the first attempt, then its retry
            logged = await log_streamed_turn(
                logger=logger, store=store, conversation_id="conv-run", turn=turn,
                turn_id=opened, user_id=OWNER,
            )  # fmt: skip
            assert [m.content for m in logged.messages] == ["ok"]
    found = await backend.db[CONVERSATIONS].find_one({"_id": "conv-run"})
    assert found is not None
    assert not any(r.get("u") for r in found["turns"]), "a runtime's turn recorded a person's"


async def test_a_runtime_acting_for_a_user_logs_after_a_persons_turn_in_her_conversation(
    backend: Backend,
) -> None:
    """A person (her token: `owner_only`) logged a turn in her conversation; a runtime acting
    for her logs the next one there, and opens an inbox for its own turn id."""
    from agent_store import AgentMessageLogger, ConversationStore, SteeringInbox
    from agent_store.integrations.streams import log_streamed_turn, turn_from_metadata

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    said = [{"role": "user", "content": "mine"}]
    await logger.log_messages("conv-hers", said, user_id=OWNER, turn_id="p-1", owner_only=True)
    await SteeringInbox(logger).open_turn("conv-hers", "run-9", user_id=OWNER)
    turn = turn_from_metadata([{"type": "stream_token", "token": "ok"}], complete=True)
    await log_streamed_turn(
        logger=logger, store=store, conversation_id="conv-hers", turn=turn, turn_id="run-9",
        prompt="next", user_id=OWNER,
    )  # fmt: skip
    assert [m.content for m in await store.transcript("conv-hers")] == ["mine", "next", "ok"]


async def test_a_runtime_acting_for_a_user_opens_inboxes_in_her_conversations_only(
    backend: Backend,
) -> None:
    """`open_turn(..., strict_owner=True)`: her conversation's inbox opens, and the turn is
    then logged for her; a service's unowned conversation or another user's is NotFound, as
    to her token, nothing changed."""
    from agent_store import AgentMessageLogger, ConversationStore, NotFound, SteeringInbox
    from agent_store.integrations.streams import log_streamed_turn, turn_from_metadata

    logger = AgentMessageLogger(backend.db)
    await logger.log_messages("conv-hers", [{"role": "user", "content": "hi"}], user_id=OWNER)
    await SteeringInbox(logger).open_turn("conv-hers", "run-1", user_id=OWNER, strict_owner=True)
    turn = turn_from_metadata([{"type": "stream_token", "token": "ok"}], complete=True)
    await log_streamed_turn(
        logger=logger, store=ConversationStore(backend.db), conversation_id="conv-hers",
        turn=turn, turn_id="run-1", user_id=OWNER,
    )  # fmt: skip
    await logger.log_messages("conv-svc", [{"role": "user", "content": "job"}], turn_id="s-0")
    await logger.log_messages("conv-other", [{"role": "user", "content": "x"}], user_id=OTHER)
    before = await digests(backend.db)
    for target in ("conv-svc", "conv-other"):
        with pytest.raises(NotFound, match=f"conversation '{target}' was not found"):
            await SteeringInbox(logger).open_turn(target, "run-1", user_id=OWNER, strict_owner=True)
    assert await digests(backend.db) == before


@pytest.mark.parametrize("flag", ["strict_owner", "owner_only"])
async def test_strict_ownership_naming_no_user_owns_nothing_in_an_inbox_either(
    backend: Backend, flag: str
) -> None:
    """Strict ownership with no `user_id` owns no conversation: opening an inbox or delivering
    into one of a service's unowned conversation is NotFound, as logging there is, nothing
    changed (never the unowned conversations a missing `user_id` would match)."""
    from agent_store import AgentMessageLogger, NotFound, SteeringInbox

    logger = AgentMessageLogger(backend.db)
    await logger.log_messages("conv-svc", [{"role": "user", "content": "job"}], turn_id="s-0")
    inbox = SteeringInbox(logger)
    await inbox.open_turn("conv-svc", "run-1")
    before = await digests(backend.db)
    delivery = {"role": "user", "content": "steer"}
    with pytest.raises(NotFound, match="conversation 'conv-svc' was not found"):
        await inbox.open_turn("conv-svc", "run-2", **{flag: True})
    with pytest.raises(NotFound, match="conversation 'conv-svc' was not found"):
        await inbox.try_deliver("conv-svc", "run-1", delivery, delivery_id="d-1", **{flag: True})
    assert await digests(backend.db) == before
