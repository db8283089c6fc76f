"""Every route of the admin API and its error paths, through an in-process ASGI client."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from urllib.parse import quote

import httpx
import pytest

from agent_store.core import StorageUnavailable
from agent_store.legacy import LEGACY_TURNS
from agent_store.store import MAX_PAGE_SIZE
from app.examples import example_legacy_turns
from app.http_errors import ERROR_CODES
from tests.api_harness import (
    NAMED_TOKEN,
    OTHER,
    OTHER_HITL_CONVERSATION,
    OWNER,
    OWNER_CONVERSATION,
    OWNER_HITL_CONVERSATION,
    Served,
    auth_headers,
    mongomock_db,
    serve,
)
from tests.conftest import Backend

SERVICE = auth_headers()
CONV = f"/v1/conversations/{OWNER_CONVERSATION}"


@pytest.fixture
async def api() -> AsyncIterator[Served]:
    async with serve(mongomock_db()) as served:
        yield served


def error_code(response: object) -> str:
    body = response.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message"}
    assert body["error"]["message"]
    code: str = body["error"]["code"]
    assert code in ERROR_CODES
    assert ERROR_CODES[code][0] == response.status_code  # type: ignore[attr-defined]
    return code


async def test_health_answers_without_a_token(api: Served) -> None:
    response = await api.http.get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


async def test_ready_pings_the_database(api: Served) -> None:
    response = await api.http.get("/ready", headers=SERVICE)
    assert response.json() == {"status": "ready", "database": "reachable"}


async def test_list_conversations_pages_newest_first_with_a_cursor(api: Served) -> None:
    url = f"/v1/users/{OWNER}/conversations"
    first = (await api.http.get(url, params={"limit": 2}, headers=SERVICE)).json()
    assert first["has_more"] is True
    assert len(first["data"]) == 2
    second = (
        await api.http.get(
            url, params={"limit": 2, "cursor": first["next_cursor"]}, headers=SERVICE
        )
    ).json()
    ids = [c["_id"] for c in first["data"] + second["data"]]
    assert sorted(ids) == sorted([OWNER_CONVERSATION, "demo-recipe-ideas", OWNER_HITL_CONVERSATION])
    assert second["has_more"] is False
    assert second["next_cursor"] is None
    updated = [c["updated_at"] for c in first["data"] + second["data"]]
    assert updated == sorted(updated, reverse=True)


async def test_get_conversation_returns_the_document(api: Served) -> None:
    body = (await api.http.get(CONV, headers=SERVICE)).json()
    assert body["_id"] == OWNER_CONVERSATION
    assert (body["user_id"], body["turn_count"], body["message_count"]) == (OWNER, 4, 12)


async def test_transcript_returns_every_message_by_seq(api: Served) -> None:
    body = (await api.http.get(f"{CONV}/transcript", headers=SERVICE)).json()
    assert [m["seq"] for m in body["data"]] == list(range(12))
    assert {m["role"] for m in body["data"]} == {"system", "user", "assistant", "tool"}


async def test_messages_page_follows_after_and_order(api: Served) -> None:
    url = f"{CONV}/messages"
    first = (await api.http.get(url, params={"limit": 5}, headers=SERVICE)).json()
    assert [m["seq"] for m in first["data"]] == [0, 1, 2, 3, 4]
    assert first["has_more"]
    after = first["last_id"]
    nxt = (await api.http.get(url, params={"after": after, "limit": 5}, headers=SERVICE)).json()
    assert [m["seq"] for m in nxt["data"]] == [5, 6, 7, 8, 9]
    back = (
        await api.http.get(url, params={"after": after, "order": "desc"}, headers=SERVICE)
    ).json()
    assert [m["seq"] for m in back["data"]] == [3, 2, 1, 0]
    assert not back["has_more"]


async def test_rename_sets_the_name(api: Served) -> None:
    response = await api.http.patch(CONV, json={"name": "  Trip   to Lyon "}, headers=SERVICE)
    assert response.status_code == 200
    assert response.json()["name"] == "Trip to Lyon"
    stored = await api.store.conversations.get_conversation(OWNER_CONVERSATION)
    assert (stored.name, stored.name_source) == ("Trip to Lyon", "set")


async def test_delete_removes_the_conversation_its_messages_and_its_legacy_turns(
    api: Served,
) -> None:
    response = await api.http.delete(CONV, headers=SERVICE)
    # The harness also keeps the example's four legacy turns: they must not come back.
    assert response.json() == {"conversations": 1, "messages": 12, "legacy_turns": 4}
    missing = await api.http.get(CONV, headers=SERVICE)
    assert (missing.status_code, error_code(missing)) == (404, "not_found")


@pytest.mark.parametrize("deleter", [OWNER, None], ids=["owner", "service"])
async def test_delete_takes_and_counts_the_owners_late_legacy_turns(
    api: Served, deleter: str | None
) -> None:
    """Late legacy turns an old-service writer logged under the id into
    `agent_conversations` (naming the owner, or no user) go with the conversation and are
    counted in `legacy_turns`; another user's stays."""
    late = {**example_legacy_turns()[0], "created_at": "2026-03-02T09:00:00Z"}
    await api.db["agent_conversations"].insert_many(
        [{**late, "_id": "late-owner"}, {**late, "_id": "late-none", "user_id": None},
         {**late, "_id": "late-other", "user_id": OTHER}]
    )  # fmt: skip
    headers = SERVICE if deleter is None else auth_headers(user=deleter)

    response = await api.http.delete(CONV, headers=headers)

    assert response.json() == {"conversations": 1, "messages": 12, "legacy_turns": 4 + 2}
    turns = {"user_message": {"$exists": True}}
    left = await api.db["agent_conversations"].find(turns).to_list(None)
    assert [d["_id"] for d in left] == ["late-other"]


# -- ETag and If-Match: a DELETE naming the conversation it read ------------------------

AGAIN = {"turn_id": "t-again", "messages": [{"role": "user", "content": "started again"}]}


async def test_a_conversation_is_served_with_its_version_as_etag(api: Served) -> None:
    """The ETag names the conversation (`Conversation.version`), not its content: a turn
    and a rename leave it as it was. It is never cached: every read asks the service."""
    stored = await api.store.conversations.get_conversation(OWNER_CONVERSATION)
    read = await api.http.get(CONV, headers=SERVICE)
    await api.http.post(f"{CONV}/turns", json=AGAIN, headers=SERVICE)
    renamed = await api.http.patch(CONV, json={"name": "Trip"}, headers=SERVICE)
    for response in (read, renamed):
        assert response.headers["etag"] == f'"{stored.version}"'
        assert response.headers["cache-control"] == "no-store"


async def test_a_delete_naming_the_etag_it_read_deletes_and_its_retry_is_not_found(
    api: Served,
) -> None:
    etag = (await api.http.get(CONV, headers=SERVICE)).headers["etag"]
    deleted = await api.http.delete(CONV, headers=SERVICE | {"If-Match": etag})
    assert (deleted.status_code, deleted.json()["conversations"]) == (200, 1)
    retried = await api.http.delete(CONV, headers=SERVICE | {"If-Match": etag})
    assert (retried.status_code, error_code(retried)) == (404, "not_found")


@pytest.mark.parametrize("caller", [None, OWNER], ids=["a service", "the owner's token"])
async def test_a_second_delete_of_a_double_click_leaves_the_conversation_started_again(
    api: Served, caller: str | None
) -> None:
    """The first DELETE deletes, the id is started again, and the second DELETE of the
    double click, held up on the network, arrives naming the ETag both were sent with:
    412, and the new conversation keeps everything."""
    headers = auth_headers(user=caller)
    etag = (await api.http.get(CONV, headers=headers)).headers["etag"]
    assert (await api.http.delete(CONV, headers=headers | {"If-Match": etag})).status_code == 200
    started = await api.http.post(f"{CONV}/turns", json=AGAIN, headers=headers)
    assert started.status_code == 201
    before = await api.digest()

    second = await api.http.delete(CONV, headers=headers | {"If-Match": etag})

    assert (second.status_code, error_code(second)) == (412, "precondition_failed")
    assert "nothing was deleted" in second.json()["error"]["message"]
    assert await api.digest() == before
    transcript = (await api.http.get(f"{CONV}/transcript", headers=headers)).json()
    assert [m["content"] for m in transcript["data"]] == ["started again"]
    new_etag = (await api.http.get(CONV, headers=headers)).headers["etag"]
    assert new_etag != etag
    assert (await api.http.delete(CONV, headers=headers | {"If-Match": new_etag})).is_success


@pytest.mark.parametrize("if_match", ["read before", "*", None], ids=["etag", "any", "absent"])
async def test_a_delete_failed_part_way_leaves_every_read_404_and_its_retry_finishes_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, if_match: str | None
) -> None:
    """The owner's DELETE marks the conversation, then its removal of the legacy turns kept
    beside it is lost (503): the legacy turns are still there. Until the DELETE is run again
    every read of the conversation is 404, to the owner and a service, with no ETag, as
    without legacy turns: none is served from them. The DELETE run again finishes it, sent
    with the ETag read before the first attempt, with `*` or without If-Match: never 412,
    nobody started the conversation again."""
    async with serve(backend.db) as api:
        owner = auth_headers(user=OWNER)
        legacy = api.store.conversations._legacy_source
        assert legacy is not None
        served = await legacy.conversation(OWNER_CONVERSATION)
        assert served is not None
        etag = await _half_deleted(api, monkeypatch)

        after = {"after": served.messages[1].id}
        reads = [("", {}), ("/hitl", {}), ("/turns/run-1/inbox", {}), ("/transcript", {}),
                 ("/messages", {}), ("/messages", after)]  # fmt: skip
        for headers in (owner, SERVICE):
            for path, params in reads:
                read = await api.http.get(f"{CONV}{path}", params=params, headers=headers)
                assert read.status_code == 404, (path, read.status_code, read.text[:80])
                assert error_code(read) == "not_found"
                assert "etag" not in read.headers

        named = {"read before": {"If-Match": etag}, "*": {"If-Match": "*"}, None: {}}[if_match]
        retried = await api.http.delete(CONV, headers=owner | named)
        assert retried.status_code == 200, retried.text
        assert retried.json() == {"conversations": 1, "messages": 12, "legacy_turns": 4}
        gone = await api.http.get(CONV, headers=owner)
        assert (gone.status_code, error_code(gone)) == (404, "not_found")


async def _half_deleted(api: Served, monkeypatch: pytest.MonkeyPatch) -> str:
    """The owner's DELETE of `CONV` failed part-way: marked, its legacy turns left (503);
    the ETag it named."""
    owner = auth_headers(user=OWNER)
    etag: str = (await api.http.get(CONV, headers=owner)).headers["etag"]
    legacy = api.store.conversations._legacy_source
    assert legacy is not None

    async def lost(conversation_id: str, *, owner: str | None) -> int:
        raise StorageUnavailable("the connection dropped")

    monkeypatch.setattr(legacy, "delete", lost)
    failed = await api.http.delete(CONV, headers=owner | {"If-Match": etag})
    monkeypatch.undo()
    assert (failed.status_code, error_code(failed)) == (503, "storage_unavailable")
    return etag


async def test_a_claim_leaves_a_half_deleted_conversation_whole_to_its_owner(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim leaves a conversation whose DELETE failed part-way to its owner with
    everything of it, the legacy turns kept beside it included: the new account reads none
    of it (404, nothing served from those turns), and the owner's DELETE run again removes
    them all."""
    async with serve(backend.db) as api:
        etag = await _half_deleted(api, monkeypatch)
        body = {"from_user_id": OWNER, "to_user_id": "user-new-account"}
        claimed = await api.http.post("/v1/claims", json=body, headers=SERVICE)
        assert claimed.is_success, claimed.text
        assert claimed.json()["legacy_turns"] == 0

        new = auth_headers(user="user-new-account")
        for path in ("", "/hitl", "/transcript", "/messages", "/turns/run-1/inbox"):
            read = await api.http.get(f"{CONV}{path}", headers=new)
            assert (read.status_code, error_code(read)) == (404, "not_found"), path
        owner = auth_headers(user=OWNER)
        retried = await api.http.delete(CONV, headers=owner | {"If-Match": etag})
        assert retried.json() == {"conversations": 1, "messages": 12, "legacy_turns": 4}
        gone = await api.http.get(CONV, headers=new)
        assert gone.status_code == 404


async def test_a_write_with_if_match_into_a_half_deleted_conversation_is_503_being_deleted(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn or a rename the owner sends with If-Match (the conversation's ETag, or `*`) into a
    conversation whose DELETE failed part-way answers as without it: 503 "being deleted", to
    be sent again once the delete finished (an outbox keeps it); another user's is 404. A
    service's close of a steering inbox there is 503 alike."""
    async with serve(backend.db) as api:
        etag = await _half_deleted(api, monkeypatch)
        turn = {"turn_id": "t-late", "messages": [{"role": "user", "content": "hi"}]}
        for user, tag in ((OWNER, etag), (OWNER, "*"), (OTHER, etag), (OTHER, "*")):
            headers = auth_headers(user=user) | {"If-Match": tag}
            sent = [
                await api.http.post(f"{CONV}/turns", json=turn, headers=headers),
                await api.http.patch(CONV, json={"name": "Later"}, headers=headers),
            ]
            for response in sent:
                if user == OWNER:
                    assert response.status_code == 503, response.text
                    assert error_code(response) == "storage_unavailable"
                    assert "being deleted" in response.json()["error"]["message"]
                else:
                    assert (response.status_code, error_code(response)) == (404, "not_found")
        close = {"last_seen_seq": 0}
        closed = await api.http.post(f"{CONV}/turns/run-1/inbox/close", json=close, headers=SERVICE)
        assert (closed.status_code, error_code(closed)) == (503, "storage_unavailable")
        assert "being deleted" in closed.json()["error"]["message"]


@pytest.mark.parametrize("if_match", ["*", None], ids=["any", "absent"])
async def test_a_delete_without_a_version_deletes_whatever_is_under_the_id(
    api: Served, if_match: str | None
) -> None:
    await api.http.delete(CONV, headers=SERVICE)
    await api.http.post(f"{CONV}/turns", json=AGAIN, headers=SERVICE)
    headers = SERVICE | ({"If-Match": if_match} if if_match else {})
    deleted = await api.http.delete(CONV, headers=headers)
    assert (deleted.status_code, deleted.json()["messages"]) == (200, 1)


async def test_a_delete_may_name_the_etag_without_its_quotes(api: Served) -> None:
    etag = (await api.http.get(CONV, headers=SERVICE)).headers["etag"]
    deleted = await api.http.delete(CONV, headers=SERVICE | {"If-Match": etag.strip('"')})
    assert (deleted.status_code, deleted.json()["conversations"]) == (200, 1)


@pytest.mark.parametrize(
    "if_match", ['"0123456789abcdef0123456789abcdef"', "W/{etag}", '{etag}, "x"']
)
async def test_a_delete_naming_anything_but_the_etag_as_served_deletes_nothing(
    api: Served, if_match: str
) -> None:
    """Only the ETag as served (its quotes may be left out), or `*`, names the conversation:
    another tag, a weak one (If-Match compares strongly) or a list is 412."""
    etag = (await api.http.get(CONV, headers=SERVICE)).headers["etag"]
    before = await api.digest()
    named = if_match.format(etag=etag)
    response = await api.http.delete(CONV, headers=SERVICE | {"If-Match": named})
    assert (response.status_code, error_code(response)) == (412, "precondition_failed")
    assert await api.digest() == before


@pytest.mark.parametrize("method", ["DELETE", "PATCH"])
async def test_if_match_sent_as_two_header_lines_is_a_list_and_changes_nothing(
    api: Served, method: str
) -> None:
    """HTTP reads repeated header lines as one list: `*` on one line and another tag on the
    next is a list of tags, which If-Match here does not take (412), not the first line."""
    etag = (await api.http.get(CONV, headers=SERVICE)).headers["etag"]
    before = await api.digest()
    for lines in (["*", '"not-this-conversation"'], [etag, etag]):
        headers = [*SERVICE.items(), *(("If-Match", line) for line in lines)]
        body = {"name": "Renamed"} if method == "PATCH" else None
        response = await api.http.request(method, CONV, headers=headers, json=body)
        assert (response.status_code, error_code(response)) == (412, "precondition_failed")
    assert await api.digest() == before


async def test_a_rename_naming_an_earlier_conversations_etag_is_refused(api: Served) -> None:
    etag = (await api.http.get(CONV, headers=SERVICE)).headers["etag"]
    await api.http.delete(CONV, headers=SERVICE)
    await api.http.post(f"{CONV}/turns", json=AGAIN, headers=SERVICE)
    stale = await api.http.patch(CONV, json={"name": "Stale"}, headers=SERVICE | {"If-Match": etag})
    assert (stale.status_code, error_code(stale)) == (412, "precondition_failed")
    current = await api.http.get(CONV, headers=SERVICE)
    assert current.json()["name"] != "Stale"
    renamed = await api.http.patch(
        CONV, json={"name": "Fresh"}, headers=SERVICE | {"If-Match": current.headers["etag"]}
    )
    assert (renamed.status_code, renamed.json()["name"]) == (200, "Fresh")


NOT_SERVED = '"0123456789abcdef0123456789abcdef"'
"""An ETag no conversation was served with."""


async def test_a_rename_naming_another_tag_than_its_legacy_turns_are_served_with_is_412() -> None:
    """A conversation served from its legacy turns: PATCH compares If-Match first, as DELETE
    does (412, nothing renamed), before it refuses to rename what is not migrated yet (409)."""
    async with serve(mongomock_db(), seeded=False) as api:
        await api.db[LEGACY_TURNS].insert_many(example_legacy_turns())
        owner = auth_headers(user=OWNER)
        etag = (await api.http.get(CONV, headers=owner)).headers["etag"]
        before = await api.digest()

        answers = [
            await api.http.patch(
                CONV, json={"name": "Renamed"}, headers=headers | {"If-Match": tag}
            )
            for headers in (SERVICE, owner)
            for tag in (NOT_SERVED, etag)
        ]

        assert [(a.status_code, error_code(a)) for a in answers] == [
            (412, "precondition_failed"), (409, "conflict")
        ] * 2  # fmt: skip
        assert await api.digest() == before


INBOX = f"{CONV}/turns/run-if-match/inbox"
NAMING_ONE_CONVERSATION = {
    "log a turn": ("POST", f"{CONV}/turns", AGAIN),
    "fork": ("POST", f"{CONV}/forks", {"at_seq": 0, "new_conversation_id": "fork-if-match"}),
    "deliver": ("POST", f"{INBOX}/messages", {"message": {"role": "user", "content": "stop"}}),
    "resolve": (
        "POST",
        f"/v1/conversations/{OWNER_HITL_CONVERSATION}/hitl/resolve",
        {"request_id": "req-ada"},
    ),
    "close an inbox": ("POST", f"{INBOX}/close", {"last_seen_seq": -1}),
    "read": ("GET", f"{CONV}/transcript", None),
}


@pytest.mark.parametrize("route", list(NAMING_ONE_CONVERSATION))
async def test_every_route_naming_a_conversation_evaluates_if_match_and_writes_nothing_on_412(
    api: Served, route: str
) -> None:
    """If-Match is evaluated wherever a route names one conversation, as DELETE does: a tag
    that is not the conversation's is 412 `precondition_failed`, nothing written."""
    assert (await api.http.post(INBOX, headers=SERVICE)).status_code == 200
    method, url, body = NAMING_ONE_CONVERSATION[route]
    before = await api.digest()

    response = await api.http.request(
        method, url, json=body, headers=SERVICE | {"If-Match": NOT_SERVED}
    )

    assert (response.status_code, error_code(response)) == (412, "precondition_failed")
    assert await api.digest() == before


async def test_a_turn_or_fork_naming_an_earlier_conversations_etag_is_refused(
    api: Served,
) -> None:
    """A turn meant for the conversation as it was read, sent after it was deleted and
    started again, is 412 and lands nowhere; naming the current ETag, it is logged."""
    etag = (await api.http.get(CONV, headers=SERVICE)).headers["etag"]
    await api.http.delete(CONV, headers=SERVICE)
    await api.http.post(f"{CONV}/turns", json=AGAIN, headers=SERVICE)
    stale = SERVICE | {"If-Match": etag}
    before = await api.digest()

    turn = await api.http.post(f"{CONV}/turns", json={**AGAIN, "turn_id": "t-x"}, headers=stale)
    forked = await api.http.post(
        f"{CONV}/forks", json={"at_seq": 0, "new_conversation_id": "f-x"}, headers=stale
    )

    assert (turn.status_code, error_code(turn)) == (412, "precondition_failed")
    assert (forked.status_code, error_code(forked)) == (412, "precondition_failed")
    assert await api.digest() == before
    current = SERVICE | {"If-Match": (await api.http.get(CONV, headers=SERVICE)).headers["etag"]}
    logged = await api.http.post(f"{CONV}/turns", json={**AGAIN, "turn_id": "t-y"}, headers=current)
    assert logged.status_code == 201, logged.text


MISSING = "/v1/conversations/missing-if-match"


@pytest.mark.parametrize("caller", [None, OWNER], ids=["a service", "a user's token"])
@pytest.mark.parametrize(
    "route", [*NAMING_ONE_CONVERSATION, "open an inbox", "rename", "delete", "log with a key"]
)
async def test_if_match_any_on_a_conversation_that_does_not_exist_is_404_and_creates_nothing(
    api: Served, route: str, caller: str | None
) -> None:
    """`If-Match: *` holds only where there is a conversation (RFC 9110 13.1.1): on an id
    naming none it is 404, as a tag is (to a user's token too, on a service's route), and
    nothing is created (a turn was stored, 201)."""
    method, url, body = {
        **NAMING_ONE_CONVERSATION,
        "open an inbox": ("POST", INBOX, None),
        "rename": ("PATCH", CONV, {"name": "Renamed"}),
        "delete": ("DELETE", CONV, None),
        "log with a key": ("POST", f"{CONV}/turns", {"messages": AGAIN["messages"]}),
    }[route]
    url = url.replace(CONV, MISSING).replace(f"/{OWNER_HITL_CONVERSATION}/", "/missing-if-match/")
    headers = auth_headers(user=caller) | {"If-Match": "*", "Idempotency-Key": "k-1"}
    if route != "log with a key":
        del headers["Idempotency-Key"]
    before = await api.digest()

    response = await api.http.request(method, url, json=body, headers=headers)

    assert (response.status_code, error_code(response)) == (404, "not_found"), response.text
    assert await api.digest() == before


@pytest.mark.parametrize("route", [*NAMING_ONE_CONVERSATION, "open an inbox", "rename"])
async def test_if_match_any_on_a_conversation_that_exists_is_met(api: Served, route: str) -> None:
    method, url, body = {
        **NAMING_ONE_CONVERSATION,
        "open an inbox": ("POST", f"{CONV}/turns/run-any/inbox", None),
        "rename": ("PATCH", CONV, {"name": "Renamed"}),
    }[route]
    assert (await api.http.post(INBOX, headers=SERVICE)).status_code == 200
    response = await api.http.request(method, url, json=body, headers=SERVICE | {"If-Match": "*"})
    assert response.is_success, response.text


@pytest.mark.parametrize(
    ("method", "url", "body"),
    [
        ("GET", "/v1/search?q=hello", None),
        ("POST", "/v1/claims", {"from_user_id": OTHER, "to_user_id": OWNER}),
        ("GET", f"/v1/users/{OWNER}/conversations", None),
    ],
    ids=["search", "claim", "list"],
)
async def test_if_match_on_a_route_naming_no_conversation_is_refused(
    api: Served, method: str, url: str, body: dict[str, str] | None
) -> None:
    """If-Match names a conversation's version: a route naming none cannot evaluate it, so
    it refuses the header (422) rather than act as if it were not sent."""
    before = await api.digest()
    response = await api.http.request(
        method, url, json=body, headers=SERVICE | {"If-Match": NOT_SERVED}
    )
    assert (response.status_code, error_code(response)) == (422, "invalid_input")
    assert "If-Match" in response.json()["error"]["message"]
    assert await api.digest() == before


async def test_another_users_delete_learns_nothing_from_if_match(api: Served) -> None:
    """Another user's token gets the same 404 with the owner's ETag, another tag or none,
    and no ETag; the conversation stays whole."""
    etag = (await api.http.get(CONV, headers=SERVICE)).headers["etag"]
    before = await api.digest()
    other = auth_headers(user=OTHER)
    answers = []
    for named in ({"If-Match": etag}, {"If-Match": '"0"'}, {"If-Match": "*"}, {}):
        response = await api.http.delete(CONV, headers=other | named)
        assert "etag" not in response.headers
        answers.append((response.status_code, response.json()))
    assert answers == [answers[-1]] * 4
    assert answers[-1][0] == 404
    read = await api.http.get(CONV, headers=other)
    assert (read.status_code, "etag" in read.headers) == (404, False)
    assert await api.digest() == before


async def test_the_epoch_behind_the_etag_is_never_served(api: Served) -> None:
    """The ETag is derived from the conversation's epoch, which no answer shows: not the
    ETag, a read, a list, an export, a turn, nor a refused DELETE."""
    stored = await api.store.conversations.get_conversation(OWNER_CONVERSATION)
    assert stored.epoch
    answers = [
        await api.http.get(CONV, headers=SERVICE),
        await api.http.get(f"/v1/users/{OWNER}/conversations", headers=SERVICE),
        await api.http.get(f"/v1/users/{OWNER}/export", headers=SERVICE),
        await api.http.get(f"{CONV}/transcript", headers=SERVICE),
        await api.http.post(f"{CONV}/turns", json=AGAIN, headers=SERVICE),
        await api.http.delete(CONV, headers=SERVICE | {"If-Match": f'"{stored.epoch}"'}),
    ]
    for response in answers:
        assert stored.epoch not in response.text + str(response.headers), response.url


async def test_posting_a_turn_twice_stores_it_once(api: Served) -> None:
    turn = {
        "turn_id": "run-http-1",
        "messages": [
            {"role": "user", "content": "And tomorrow?"},
            {"role": "assistant", "content": "Sunny.", "token_usage": {"input_tokens": 5}},
        ],
    }
    first = await api.http.post(f"{CONV}/turns", json=turn, headers=SERVICE)
    again = await api.http.post(f"{CONV}/turns", json=turn, headers=SERVICE)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["replayed"] is False
    assert again.json()["replayed"] is True
    assert [m["seq"] for m in first.json()["messages"]] == [12, 13]
    assert [m["_id"] for m in again.json()["messages"]] == [
        m["_id"] for m in first.json()["messages"]
    ]
    transcript = await api.store.conversations.transcript(OWNER_CONVERSATION)
    assert len(transcript) == 14
    assert (await api.store.conversations.turn_count(OWNER_CONVERSATION)) == 5


async def test_a_replayed_turn_answers_with_the_stored_messages(backend: Backend) -> None:
    def turn(at: str) -> dict[str, object]:
        return {
            "turn_id": "run-retried",
            "messages": [{"role": "user", "content": "Hi", "created_at": at}],
        }

    async with serve(backend.db, seeded=False) as api:
        url = "/v1/conversations/conv-retried/turns"
        first = await api.http.post(url, json=turn("2026-03-02T09:00:00Z"), headers=SERVICE)
        # The runtime timed out and sent the turn again, stamped anew.
        again = await api.http.post(url, json=turn("2026-03-02T09:00:07Z"), headers=SERVICE)

    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["messages"] == first.json()["messages"]
    assert again.json()["messages"][0]["created_at"].startswith("2026-03-02T09:00:00")


async def test_a_turn_posted_over_http_never_stores_hidden_runtime_context(api: Served) -> None:
    turn = {
        "turn_id": "run-http-context",
        "messages": [
            {"role": "user", "content": "[RUNTIME CONTEXT]plan=pro[/RUNTIME CONTEXT]Rain later?"}
        ],
    }
    response = await api.http.post("/v1/conversations/fresh-http/turns", json=turn, headers=SERVICE)
    assert response.status_code == 201
    assert response.json()["messages"][0]["content"] == "Rain later?"
    stored = await api.store.conversations.transcript("fresh-http")
    assert [m.content for m in stored] == ["Rain later?"]
    conversation = await api.store.conversations.get_conversation("fresh-http")
    assert "plan=pro" not in f"{conversation.name} {conversation.last_message_preview}"


async def test_a_turn_with_a_message_over_the_size_bound_is_stored_truncated(api: Served) -> None:
    huge = "word " * 600_000  # 3 MB of text in one tool result
    turn = {
        "turn_id": "run-http-huge",
        "messages": [
            {"role": "user", "content": "Summarise the log"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c-log", "function": {"name": "read_log", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c-log", "content": huge},
            {"role": "assistant", "content": "It is long."},
        ],
    }
    response = await api.http.post("/v1/conversations/huge-http/turns", json=turn, headers=SERVICE)
    assert response.status_code == 201
    stored = await api.store.conversations.transcript("huge-http")
    assert [m.role for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[2].truncated is not None
    assert stored[2].truncated["content"].length == len(huge)  # type: ignore[union-attr]
    assert stored[2].content is not None
    assert stored[2].content.startswith("word word")


async def test_a_turn_id_reused_for_other_messages_is_a_conflict(api: Served) -> None:
    url = f"{CONV}/turns"
    await api.http.post(
        url, json={"turn_id": "t", "messages": [{"role": "user", "content": "a"}]}, headers=SERVICE
    )
    response = await api.http.post(
        url,
        json={"turn_id": "t", "messages": [{"role": "user", "content": "a"}] * 2},
        headers=SERVICE,
    )
    assert (response.status_code, error_code(response)) == (409, "conflict")


async def test_a_turn_breaking_the_contract_is_refused_naming_the_problem(api: Served) -> None:
    before = await api.digest()
    response = await api.http.post(
        f"{CONV}/turns",
        json={"messages": [{"role": "tool", "content": "orphan"}]},
        headers=SERVICE,
    )
    assert (response.status_code, error_code(response)) == (422, "invalid_input")
    assert "tool_call_id" in response.json()["error"]["message"]
    assert await api.digest() == before


async def test_a_user_token_logs_into_a_new_conversation_it_then_owns(api: Served) -> None:
    response = await api.http.post(
        "/v1/conversations/conv-new/turns",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers=auth_headers(user=OTHER),
    )
    assert response.status_code == 201
    assert (await api.store.conversations.get_conversation("conv-new")).user_id == OTHER


async def test_pending_hitl_is_read_and_resolved_by_request_id(api: Served) -> None:
    url = f"/v1/conversations/{OWNER_HITL_CONVERSATION}/hitl"
    pending = (await api.http.get(url, headers=SERVICE)).json()["pending"]
    assert (pending["request_id"], pending["action"]) == ("req-ada", "confirm_payment")
    wrong = await api.http.post(f"{url}/resolve", json={"request_id": "req-x"}, headers=SERVICE)
    assert (wrong.status_code, error_code(wrong)) == (409, "conflict")
    assert "req-ada" in wrong.json()["error"]["message"]
    right = await api.http.post(f"{url}/resolve", json={"request_id": "req-ada"}, headers=SERVICE)
    assert right.json() == {"request_id": "req-ada", "resolved": True}
    assert (await api.http.get(url, headers=SERVICE)).json() == {"pending": None}


async def test_retrying_a_resolution_that_took_effect_is_not_a_conflict(api: Served) -> None:
    """The first reply was lost: the retry is told what the first call was told."""
    url = f"/v1/conversations/{OWNER_HITL_CONVERSATION}/hitl"
    body = {"request_id": "req-ada"}
    first = await api.http.post(f"{url}/resolve", json=body, headers=SERVICE)
    retried = await api.http.post(f"{url}/resolve", json=body, headers=SERVICE)
    assert (retried.status_code, retried.json()) == (first.status_code, first.json())
    assert (await api.http.get(url, headers=SERVICE)).json() == {"pending": None}


async def test_search_needs_a_scope(api: Served) -> None:
    response = await api.http.get("/v1/search", params={"q": "Lyon"}, headers=SERVICE)
    assert (response.status_code, error_code(response)) == (422, "invalid_input")


@pytest.mark.parametrize("export_format", ["jsonl", "json"])
async def test_export_streams_every_conversation_with_its_messages(
    api: Served, export_format: str
) -> None:
    response = await api.http.get(
        f"/v1/users/{OWNER}/export", params={"format": export_format}, headers=SERVICE
    )
    assert response.status_code == 200
    if export_format == "jsonl":
        assert response.headers["content-type"] == "application/x-ndjson"
        items = [json.loads(line) for line in response.text.splitlines()]
    else:
        document = response.json()
        assert document["user_id"] == OWNER
        items = document["conversations"]
    by_id = {item["conversation"]["_id"]: len(item["messages"]) for item in items}
    assert by_id == {OWNER_CONVERSATION: 12, "demo-recipe-ideas": 2, OWNER_HITL_CONVERSATION: 2}


async def test_erase_removes_only_that_users_data(api: Served) -> None:
    response = await api.http.delete(f"/v1/users/{OWNER}", headers=SERVICE)
    assert response.json() == {"conversations": 3, "messages": 16, "legacy_turns": 4}
    listed = await api.http.get(f"/v1/users/{OWNER}/conversations", headers=SERVICE)
    assert listed.json()["data"] == []
    others = await api.http.get(f"/v1/users/{OTHER}/conversations", headers=SERVICE)
    assert len(others.json()["data"]) == 2


async def test_claim_moves_every_conversation_to_the_new_user(api: Served) -> None:
    response = await api.http.post(
        "/v1/claims", json={"from_user_id": OTHER, "to_user_id": "user-grace-2"}, headers=SERVICE
    )
    assert response.json() == {"conversations": 2, "messages": 6, "legacy_turns": 0}
    moved = await api.http.get("/v1/users/user-grace-2/conversations", headers=SERVICE)
    assert {c["_id"] for c in moved.json()["data"]} == {
        "demo-invoice-check",
        OTHER_HITL_CONVERSATION,
    }


async def test_openapi_document_lists_every_route(api: Served) -> None:
    document = (await api.http.get("/openapi.json", headers=SERVICE)).json()
    assert document["openapi"].startswith("3.1")
    operations = {
        (method.upper(), path) for path, item in document["paths"].items() for method in item
    }
    routes = {
        (method, route.path)  # type: ignore[attr-defined]
        for route in api.http._transport.app.routes  # type: ignore[attr-defined]
        for method in route.methods or ()  # type: ignore[attr-defined]
        if route.path.startswith("/v1") and method != "HEAD"  # type: ignore[attr-defined]
    }
    assert routes <= operations
    assert "LogTurnBody" in document["components"]["schemas"]


# -- error paths -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "url", "status", "code"),
    [
        pytest.param("GET", "/nowhere", 404, "not_found", id="unknown-route"),
        pytest.param("PUT", CONV, 405, "method_not_allowed", id="wrong-method"),
        pytest.param("GET", "/v1/conversations/missing", 404, "not_found", id="missing"),
        pytest.param("GET", "/v1/conversations/bad%20id", 422, "invalid_input", id="bad-id"),
        pytest.param("GET", f"{CONV}/messages?limit=abc", 422, "invalid_input", id="limit-text"),
        pytest.param("GET", f"{CONV}/messages?order=sideways", 422, "invalid_input", id="order"),
        pytest.param("GET", f"{CONV}/messages?after=nope", 422, "invalid_input", id="after"),
        pytest.param("GET", f"{CONV}?unexpected=1", 422, "invalid_input", id="unknown-param"),
        pytest.param(
            "GET", f"/v1/users/{OWNER}/conversations?cursor=xyz", 422, "invalid_input", id="cursor"
        ),
        pytest.param(
            "GET", f"/v1/users/{OWNER}/export?format=xml", 422, "invalid_input", id="format"
        ),
    ],
)
async def test_errors_are_json_with_a_stable_code(
    api: Served, method: str, url: str, status: int, code: str
) -> None:
    response = await api.http.request(method, url, headers=SERVICE)
    assert response.status_code == status
    assert error_code(response) == code


@pytest.mark.parametrize("limit", [0, MAX_PAGE_SIZE + 1, 10**9])
@pytest.mark.parametrize(
    "url", [f"/v1/users/{OWNER}/conversations", f"{CONV}/messages", "/v1/search?q=a&user_id=u"]
)
async def test_page_sizes_over_the_cap_are_refused(api: Served, url: str, limit: int) -> None:
    response = await api.http.get(url, params={"limit": limit}, headers=SERVICE)
    assert (response.status_code, error_code(response)) == (422, "invalid_input")
    assert "limit" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "written", ["+5", " 5", "5 ", "5.0", "1_0", "5e0", "\uff15", "\u0665", "-0", "--1", ""]
)
@pytest.mark.parametrize(
    "url",
    [
        f"/v1/users/{OWNER}/conversations?limit=",
        f"{CONV}/messages?limit=",
        "/v1/search?q=a&user_id=u&limit=",
        f"{CONV}/turns/t-running/inbox?after_seq=",
    ],
)
async def test_query_integers_are_written_in_ascii_digits_only(
    api: Served, url: str, written: str
) -> None:
    """A query integer is ASCII digits, `-` before them for a negative one (`after_seq=-1`):
    a sign, a space, a point, an underscore, an exponent or another script's digits is 422
    naming the parameter, as a value out of its range is, never read as the number."""
    response = await api.http.get(url + quote(written), headers=SERVICE)
    assert (response.status_code, error_code(response)) == (422, "invalid_input"), response.text
    assert url.rsplit("?", 1)[1].rsplit("&", 1)[-1].removesuffix("=") in response.text


@pytest.mark.parametrize(
    ("written", "shown"),
    [("<b>1</b>", "<withheld>"), ("1\u202e2", "<withheld>"), ("9" * 19, repr("9" * 19))],
)
async def test_a_refused_query_integer_is_shown_by_the_shown_value_rule(
    api: Served, written: str, shown: str
) -> None:
    """Repeated only when it is a plain name, as every caller's value an error shows."""
    response = await api.http.get(f"{CONV}/messages?limit=" + quote(written), headers=SERVICE)
    assert response.status_code == 422, response.text
    assert f"not {shown}" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "url",
    [f"{CONV}/messages?limit=05", f"{CONV}/messages?limit=5", f"{CONV}/turns/t/inbox?after_seq=-1"],
)
async def test_query_integers_in_ascii_digits_are_read(api: Served, url: str) -> None:
    assert (await api.http.get(url, headers=SERVICE)).status_code == 200


@pytest.mark.parametrize(
    ("content", "content_type", "status", "code"),
    [
        pytest.param(b"{not json", "application/json", 400, "invalid_json", id="malformed"),
        pytest.param(b"[1, 2]", "application/json", 400, "invalid_json", id="array"),
        pytest.param(b'{"name": NaN}', "application/json", 400, "invalid_json", id="nan"),
        pytest.param(b"", "application/json", 400, "invalid_json", id="empty"),
        pytest.param(
            b'\xef\xbb\xbf{"name": "x"}',
            "application/json",
            400,
            "invalid_json",
            id="utf-8 byte order mark",
        ),
        pytest.param(
            '{"name": "x"}'.encode("utf-16"), "application/json", 400, "invalid_json", id="utf-16"
        ),
        pytest.param(b'{"name": "x"}', "text/plain", 415, "unsupported_media_type", id="text"),
        pytest.param(b'{"name": ""}', "application/json", 422, "invalid_input", id="empty-name"),
        pytest.param(b'{"name": 7}', "application/json", 422, "invalid_input", id="number"),
    ],
)
async def test_bad_bodies_are_refused_and_change_nothing(
    api: Served, content: bytes, content_type: str, status: int, code: str
) -> None:
    before = await api.digest()
    response = await api.http.patch(
        CONV, content=content, headers=SERVICE | {"Content-Type": content_type}
    )
    assert (response.status_code, error_code(response)) == (status, code)
    assert await api.digest() == before


async def test_named_tokens_work_and_every_request_leaves_one_audit_line(
    api: Served, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="agent_store.audit"):
        await api.http.get(CONV, headers={"Authorization": f"Bearer {NAMED_TOKEN}"})
        await api.http.get(CONV, headers=auth_headers(user=OWNER))
        await api.http.get(CONV, headers={"Authorization": "Bearer wrong"})
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "agent_store.audit"]
    assert [(line["status"], line["service"], line["user"]) for line in lines] == [
        (200, "admin-ui", None),
        (200, lines[1]["service"], OWNER),
        (401, None, None),
    ]
    assert lines[1]["service"].startswith("token-sha256:")
    assert all(line["method"] == "GET" and line["path"] == CONV for line in lines)
    assert "service-token-for-tests" not in caplog.text
    assert NAMED_TOKEN not in caplog.text


async def test_an_unreachable_database_makes_ready_answer_503(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unreachable() -> None:
        raise StorageUnavailable("could not reach the database: the database is unreachable")

    monkeypatch.setattr(api.store.conversations, "ping", unreachable)
    response = await api.http.get("/ready", headers=SERVICE)
    assert (response.status_code, error_code(response)) == (503, "storage_unavailable")


async def test_an_unexpected_failure_is_a_json_500_without_details(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(api.store.conversations, "get_conversation", broken)
    transport = httpx.ASGITransport(app=api.http._transport.app, raise_app_exceptions=False)  # type: ignore[attr-defined]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.get(CONV, headers=SERVICE)
    assert (response.status_code, error_code(response)) == (500, "internal_error")
    assert "secret internal detail" not in response.text
