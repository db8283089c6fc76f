"""The steering inbox and forks over HTTP: the same handshake, the same ownership rules."""

from __future__ import annotations

from typing import Any

import pytest

from agent_store import ConversationStore
from tests.api_harness import (
    OTHER,
    OWNER,
    OWNER_CONVERSATION,
    api_settings,
    auth_headers,
    mongomock_db,
    serve,
)

INBOX = f"/v1/conversations/{OWNER_CONVERSATION}/turns/t-running/inbox"


def steer(text: str, delivery_id: str) -> dict[str, Any]:
    return {"message": {"role": "user", "content": text}, "delivery_id": delivery_id}


async def test_a_runtime_opens_drains_and_closes_while_a_person_steers() -> None:
    async with serve(mongomock_db()) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        assert (await api.http.post(INBOX, headers=runtime)).status_code == 200

        sent = await api.http.post(f"{INBOX}/messages", json=steer("metric, please", "d1"),
                                   headers=person)  # fmt: skip
        again = await api.http.post(f"{INBOX}/messages", json=steer("metric, please", "d1"),
                                    headers=person)  # fmt: skip
        drained = (await api.http.get(f"{INBOX}?after_seq=-1", headers=runtime)).json()["data"]
        seen = drained[-1]["seq"]
        closing = await api.http.post(f"{INBOX}/close", json={"last_seen_seq": seen},
                                      headers=runtime)  # fmt: skip
        late = await api.http.post(f"{INBOX}/messages", json=steer("too late", "d2"),
                                   headers=person)  # fmt: skip

        assert sent.json() == again.json() == {"delivered": True}
        assert [m["content"] for m in drained] == ["metric, please"]
        assert closing.json() == {"closed": True, "data": [], "has_more": False}
        assert late.json() == {"delivered": False}
        count = await api.db.agent_messages.count_documents({"content": "metric, please"})
        assert count == 1
        assert await api.db.agent_messages.count_documents({"content": "too late"}) == 0


@pytest.mark.parametrize(
    "key", ["k1", "key with spaces, $ and / (not an id)"], ids=["an identifier", "any text"]
)
async def test_a_delivery_retried_with_its_idempotency_key_is_stored_once(key: str) -> None:
    """`Idempotency-Key` names the delivery as `delivery_id` does (as POST …/turns takes it
    as the turn id): a retry under the same key is stored, and drained, once."""
    message = {"message": {"role": "user", "content": "stop, use the cheaper flight"}}
    async with serve(mongomock_db()) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        assert (await api.http.post(INBOX, headers=runtime)).status_code == 200
        keyed = person | {"Idempotency-Key": key}

        answers = [await api.http.post(f"{INBOX}/messages", json=message, headers=keyed)
                   for _ in range(2)]  # fmt: skip
        other = await api.http.post(
            f"{INBOX}/messages", json=message, headers=person | {"Idempotency-Key": "k2"}
        )

        assert [a.json() for a in answers] == [{"delivered": True}] * 2
        assert other.json() == {"delivered": True}
        drained = (await api.http.get(f"{INBOX}?after_seq=-1", headers=runtime)).json()["data"]
        assert len(drained) == 2


async def test_an_idempotency_key_naming_another_delivery_than_its_delivery_id_is_422() -> None:
    async with serve(mongomock_db()) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        assert (await api.http.post(INBOX, headers=runtime)).status_code == 200
        before = await api.digest()

        other = await api.http.post(
            f"{INBOX}/messages", json=steer("x", "d1"), headers=person | {"Idempotency-Key": "d2"}
        )
        empty = await api.http.post(
            f"{INBOX}/messages", json=steer("x", "d1"), headers=person | {"Idempotency-Key": " "}
        )

        assert (other.status_code, empty.status_code) == (422, 422)
        said = other.json()["error"]["message"]
        assert "delivery_id" in said
        assert "Idempotency-Key" in said
        assert await api.digest() == before
        same = await api.http.post(
            f"{INBOX}/messages", json=steer("x", "d1"), headers=person | {"Idempotency-Key": "d1"}
        )
        assert same.json() == {"delivered": True}


@pytest.mark.parametrize(
    ("url", "body"),
    [
        (INBOX, None),
        (f"{INBOX}/close", {"last_seen_seq": -1}),
        (f"/v1/conversations/{OWNER_CONVERSATION}/forks",
         {"at_seq": 0, "new_conversation_id": "f-idem"}),
        ("/v1/claims", {"from_user_id": OTHER, "to_user_id": OWNER}),
    ],
    ids=["open an inbox", "close an inbox", "fork", "claim"],
)  # fmt: skip
async def test_an_idempotency_key_on_a_post_that_does_not_take_one_is_422(
    url: str, body: dict[str, Any] | None
) -> None:
    """A POST that names what it writes otherwise (or is idempotent as it is) refuses the
    header rather than ignore it: a client relying on it would be misled."""
    async with serve(mongomock_db()) as api:
        before = await api.digest()
        response = await api.http.post(
            url, json=body, headers=auth_headers() | {"Idempotency-Key": "k1"}
        )
        assert response.status_code == 422, response.text
        assert "Idempotency-Key" in response.json()["error"]["message"]
        assert await api.digest() == before


async def test_another_users_token_reaches_no_inbox_and_forks_nothing() -> None:
    async with serve(mongomock_db()) as api:
        await api.http.post(INBOX, headers=auth_headers())
        before = await api.digest()
        stranger = auth_headers(user=OTHER)

        answers = [
            await api.http.post(INBOX, headers=stranger),
            await api.http.post(f"{INBOX}/messages", json=steer("x", "d9"), headers=stranger),
            await api.http.get(INBOX, headers=stranger),
            await api.http.post(f"{INBOX}/close", json={"last_seen_seq": 0}, headers=stranger),
            await api.http.post(
                f"/v1/conversations/{OWNER_CONVERSATION}/forks",
                json={"at_seq": 3, "new_conversation_id": "conv-stolen"},
                headers=stranger,
            ),
        ]

        assert [a.status_code for a in answers] == [403, 404, 404, 403, 404]
        assert await api.digest() == before


async def test_a_user_token_neither_opens_nor_closes_an_inbox_the_runtime_steers_by() -> None:
    """The inbox is the running turn's, its runtime's: a person's token opening 32 inboxes
    kept the runtime from opening one for a day, and closing the runtime's made its person's
    next deliveries fail. A user token delivers into an inbox and reads it; opening and
    closing are 403, nothing changed."""
    async with serve(mongomock_db()) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        assert (await api.http.post(INBOX, headers=runtime)).status_code == 200
        before = await api.digest()
        base = f"/v1/conversations/{OWNER_CONVERSATION}/turns"

        opened = await api.http.post(f"{base}/t-junk/inbox", headers=person)
        closed = await api.http.post(f"{INBOX}/close", json={"last_seen_seq": 99}, headers=person)

        assert (opened.status_code, closed.status_code) == (403, 403)
        assert opened.json()["error"]["code"] == "forbidden"
        assert "only a service" in opened.json()["error"]["message"]
        assert await api.digest() == before
        sent = await api.http.post(f"{INBOX}/messages", json=steer("still here", "d1"),
                                   headers=person)  # fmt: skip
        assert sent.json() == {"delivered": True}
        drained = (await api.http.get(f"{INBOX}?after_seq=-1", headers=person)).json()["data"]
        assert [m["content"] for m in drained] == ["still here"]


async def test_a_fork_over_http_is_created_once_and_belongs_to_the_owner() -> None:
    async with serve(mongomock_db()) as api:
        owner = auth_headers(user=OWNER)
        body = {"at_seq": 3, "new_conversation_id": "conv-fork-http"}
        url = f"/v1/conversations/{OWNER_CONVERSATION}/forks"

        first = await api.http.post(url, json=body, headers=owner)
        again = await api.http.post(url, json=body, headers=owner)
        taken = await api.http.post(url, json={**body, "at_seq": 0}, headers=owner)

        assert (first.status_code, again.status_code, taken.status_code) == (201, 200, 409)
        forked = await api.http.get("/v1/conversations/conv-fork-http", headers=owner)
        assert forked.json()["forked_from"]["conversation_id"] == OWNER_CONVERSATION
        assert forked.json()["user_id"] == OWNER


async def test_a_runtime_opening_inboxes_without_closing_them_is_stopped_at_32() -> None:
    async with serve(mongomock_db()) as api:
        runtime = auth_headers()
        base = f"/v1/conversations/{OWNER_CONVERSATION}/turns"
        opened = [
            (await api.http.post(f"{base}/t-{n}/inbox", headers=runtime)).status_code
            for n in range(33)
        ]
        refused = await api.http.post(f"{base}/t-32/inbox", headers=runtime)
        reopened = await api.http.post(f"{base}/t-0/inbox", headers=runtime)

        assert opened == [200] * 32 + [409]
        assert refused.json()["error"]["code"] == "conflict"
        assert "32 open steering inboxes" in refused.json()["error"]["message"]
        assert reopened.status_code == 200
        stored = await api.db.agent_conversations.find_one({"_id": OWNER_CONVERSATION})
        assert len(stored["inbox"]) == 32


async def test_a_fork_retried_over_http_after_its_source_was_popped_is_a_conflict_naming_it() -> (
    None
):
    """A fork answered (its answer lost to the client, say), then the source's last message,
    the fork's at_seq, popped, and then, corrected, logged again: the retry is a 409 naming the
    fork, which stands as stored; never a 422, nor a turn id the client never sent."""
    async with serve(mongomock_db(), seeded=False) as api:
        owner = auth_headers(user=OWNER)
        base = "/v1/conversations/conv-src"
        for n in range(3):
            said = [{"role": "user", "content": f"question {n}"},
                    {"role": "assistant", "content": f"answer {n}"}]  # fmt: skip
            await api.http.post(f"{base}/turns", json={"messages": said, "turn_id": f"t{n}"},
                                headers=owner)  # fmt: skip
        body = {"at_seq": 5, "new_conversation_id": "conv-fork-http"}
        first = await api.http.post(f"{base}/forks", json=body, headers=owner)
        await ConversationStore(api.db).pop_last_message("conv-src")
        popped = await api.http.post(f"{base}/forks", json=body, headers=owner)
        corrected = {"messages": [{"role": "assistant", "content": "fixed"}], "turn_id": "t2b"}
        await api.http.post(f"{base}/turns", json=corrected, headers=owner)
        changed = await api.http.post(f"{base}/forks", json=body, headers=owner)

        assert (first.status_code, popped.status_code, changed.status_code) == (201, 409, 409)
        for refused in (popped, changed):
            said = refused.json()["error"]["message"]
            assert "'conv-fork-http'" in said
            assert "seq 5" in said
            assert "turn 'fork-" not in said
        forked = await api.http.get("/v1/conversations/conv-fork-http/transcript", headers=owner)
        assert [m["content"] for m in forked.json()["data"]][-1] == "answer 2"


async def test_a_fork_over_http_at_a_seq_whose_turn_is_still_being_written_is_a_503(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A turn reserved `seq`s 2-3 and has not inserted yet: a fork at either asks to be retried
    (503, nothing written), never a 422; once the turn is stored the same fork is a 201."""
    async with serve(mongomock_db(), seeded=False) as api:
        owner = auth_headers(user=OWNER)
        base = "/v1/conversations/conv-src"
        said = [{"role": "user", "content": "question"}, {"role": "assistant", "content": "a"}]
        await api.http.post(f"{base}/turns", json={"messages": said, "turn_id": "t0"},
                            headers=owner)  # fmt: skip
        logger = api.store.logger

        async def not_yet(*args: Any, **kwargs: Any) -> None:
            raise ConnectionError("the turn reserved and has not inserted")

        monkeypatch.setattr(logger._messages, "insert_many", not_yet)
        with pytest.raises(ConnectionError):
            await logger.log_messages("conv-src", said, user_id=OWNER, turn_id="t1")
        monkeypatch.undo()
        before = await api.digest()

        waits = [
            await api.http.post(f"{base}/forks", headers=owner,
                                json={"at_seq": at_seq, "new_conversation_id": "conv-fork"})
            for at_seq in (2, 3)
        ]  # fmt: skip
        assert [(r.status_code, r.json()["error"]["code"]) for r in waits] == [
            (503, "storage_unavailable")
        ] * 2
        assert "still being written at seq 2" in waits[1].json()["error"]["message"]
        assert await api.digest() == before

        await logger.log_messages("conv-src", said, user_id=OWNER, turn_id="t1")
        body = {"at_seq": 3, "new_conversation_id": "conv-fork"}
        assert (await api.http.post(f"{base}/forks", json=body, headers=owner)).status_code == 201


async def test_the_inbox_read_and_close_answer_pages_of_page_bytes_saying_more_follow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`GET …/inbox` and `POST …/inbox/close` serve what fits in `PAGE_BYTES` (one delivery
    at least) with `has_more`: the runtime reads, and closes, on after the last `seq` it got,
    and every delivery reaches it once, however much a person delivered."""
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 20_000)  # two deliveries
    async with serve(mongomock_db()) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        assert (await api.http.post(INBOX, headers=runtime)).status_code == 200
        for n in range(5):
            sent = await api.http.post(f"{INBOX}/messages", json=steer(f"{n} {'x' * 4_000}",
                                       f"d{n}"), headers=person)  # fmt: skip
            assert sent.json() == {"delivered": True}

        read, seen, served = [], -1, []
        while True:
            page = await api.http.get(f"{INBOX}?after_seq={seen}", headers=person)
            served.append(len(page.content))
            body = page.json()
            read.append(([int(m["content"].split()[0]) for m in body["data"]], body["has_more"]))
            if not body["has_more"]:
                break
            seen = body["data"][-1]["seq"]
        closed, seen = [], -1
        while True:
            page = await api.http.post(f"{INBOX}/close", json={"last_seen_seq": seen},
                                       headers=runtime)  # fmt: skip
            served.append(len(page.content))
            body = page.json()
            closed.append(([int(m["content"].split()[0]) for m in body["data"]],
                           body["has_more"], body["closed"]))  # fmt: skip
            if body["closed"]:
                break
            seen = body["data"][-1]["seq"]

        assert read == [([0, 1], True), ([2, 3], True), ([4], False)]
        assert closed == [([0, 1], True, False), ([2, 3], True, False), ([4], False, False),
                          ([], False, True)]  # fmt: skip
        assert max(served) < 20_000


async def test_a_delivery_is_capped_as_a_turn_is_not_as_other_bodies() -> None:
    """A steering delivery carries a message as a turn does (a pasted document, a tool's
    result): its body takes the turn cap (`max_turn_bytes`), while other bodies, a
    resolution's, are refused past `max_request_bytes`."""
    settings = api_settings(max_request_bytes=10_000, max_turn_bytes=100_000)
    async with serve(mongomock_db(), settings) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        assert (await api.http.post(INBOX, headers=runtime)).status_code == 200
        sent = await api.http.post(f"{INBOX}/messages", json=steer("x" * 50_000, "d1"),
                                   headers=person)  # fmt: skip
        too_big = await api.http.post(f"{INBOX}/messages", json=steer("x" * 150_000, "d2"),
                                      headers=person)  # fmt: skip
        resolve = {"request_id": "r" * 100, "call_ids": ["c" * 100] * 100}
        other = await api.http.post(f"/v1/conversations/{OWNER_CONVERSATION}/hitl/resolve",
                                    json=resolve, headers=person)  # fmt: skip

        assert sent.json() == {"delivered": True}
        assert (too_big.status_code, other.status_code) == (413, 413)


async def test_a_fork_over_http_answers_no_more_than_a_fork_may_copy() -> None:
    """A user token's fork of 20 messages of 1 MB (each within the 1 MiB bound) is a 422
    naming where to fork, nothing written; the fork there answers its copies, about
    `MAX_FORK_BYTES` (16 MiB), and its retry the same."""
    from agent_store.store import MAX_FORK_BYTES

    async with serve(mongomock_db()) as api:
        owner = auth_headers(user=OWNER)
        url = "/v1/conversations/conv-big/forks"
        for start in (0, 10):
            said = [{"role": "user", "content": f"m{n} " + "x" * 1_000_000} for n in range(10)]
            turn = {"messages": said, "turn_id": f"t{start}"}
            logged = await api.http.post(
                "/v1/conversations/conv-big/turns", json=turn, headers=owner
            )
            assert logged.status_code == 201, logged.text[:200]

        refused = await api.http.post(
            url, json={"at_seq": 19, "new_conversation_id": "conv-big-fork"}, headers=owner
        )
        assert refused.status_code == 422
        assert refused.json()["error"]["message"].endswith("fork at seq 15 or before")
        assert await api.db.agent_conversations.find_one({"_id": "conv-big-fork"}) is None

        body = {"at_seq": 15, "new_conversation_id": "conv-big-fork"}
        forked = await api.http.post(url, json=body, headers=owner)
        again = await api.http.post(url, json=body, headers=owner)
        assert (forked.status_code, again.status_code) == (201, 200)
        assert len(forked.json()["messages"]) == 16
        assert len(forked.content) < MAX_FORK_BYTES + 64 * 1024
        assert [m["_id"] for m in again.json()["messages"]] == [
            m["_id"] for m in forked.json()["messages"]
        ]


@pytest.mark.parametrize(
    ("named", "whose"),
    [
        ({"turn_id": "fork-" + "0" * 32}, "a fork's copies"),
        ({"turn_id": "lg-" + "ab" * 16}, "a LangGraph step"),
        ({"Idempotency-Key": "fork-" + "9f" * 16}, "a fork's copies"),
    ],
)
async def test_a_turn_id_of_the_shape_of_the_stores_own_is_refused_with_422(
    named: dict[str, str], whose: str
) -> None:
    """API.md: the store names a fork's copies `fork-` and 32 hex digits and a LangGraph
    step's turn `lg-` and 32: a caller's turn under such an id would be taken for one (no
    give-back of its empty block, its last message waited for as a checkpoint's). It is 422,
    nothing written; any other spelling (`fork-9f2c`, `lg-run-1`) is an ordinary turn id."""
    async with serve(mongomock_db()) as api:
        turns = f"/v1/conversations/{OWNER_CONVERSATION}/turns"
        said = {"role": "user", "content": "hello", "created_at": "2026-12-03T08:00:00Z"}
        body: dict[str, Any] = {"messages": [said]}
        headers = auth_headers()
        if "turn_id" in named:
            body["turn_id"] = named["turn_id"]
        else:
            headers = {**headers, **named}
        before = await api.digest()

        refused = await api.http.post(turns, json=body, headers=headers)
        assert refused.status_code == 422, refused.text
        assert whose in refused.json()["error"]["message"]
        assert await api.digest() == before
        for ordinary in ("fork-9f2c", "lg-run-1"):
            logged = await api.http.post(
                turns, json={"messages": [said], "turn_id": ordinary}, headers=auth_headers()
            )
            assert logged.status_code == 201, logged.text
            assert logged.json()["turn_id"] == ordinary


async def test_a_person_cannot_take_a_deliverys_turn_id_to_have_it_acknowledged_unseen() -> None:
    """The turn id a delivery is stored under is computable (`delivery-` and a digest of the
    running turn's id and the delivery id). A person's turn logged under it first made the
    delivery answer `delivered: true` while the runtime drained nothing and closed. Such a
    turn is 422, nothing written; the delivery then reaches the runtime."""
    from agent_store.store._inbox import delivery_turn_id

    async with serve(mongomock_db()) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        assert (await api.http.post(INBOX, headers=runtime)).status_code == 200
        hotel = {"role": "user", "content": "book the hotel", "created_at": "2026-12-03T08:00:00Z"}
        turns = f"/v1/conversations/{OWNER_CONVERSATION}/turns"
        before = await api.digest()

        taken = await api.http.post(
            turns,
            json={"turn_id": delivery_turn_id("t-running", "d1"), "messages": [hotel]},
            headers=person,
        )
        assert taken.status_code == 422, taken.text
        assert "steering delivery" in taken.json()["error"]["message"]
        assert await api.digest() == before

        delivery = {"message": hotel, "delivery_id": "d1"}
        sent = await api.http.post(f"{INBOX}/messages", json=delivery, headers=person)
        drained = (await api.http.get(f"{INBOX}?after_seq=-1", headers=runtime)).json()["data"]
        assert sent.json() == {"delivered": True}
        assert [m["content"] for m in drained] == ["book the hotel"]


async def test_a_person_cannot_log_a_turn_under_the_id_of_the_turn_running_for_them() -> None:
    """The person steers by the running turn's id (`…/turns/{turn_id}/inbox/messages`). Their
    token logging a forged answer under it took the id: the runtime's own turn was 409 and
    its answer lost. A turn a runtime opened an inbox for is the runtime's: a user token's
    turn under its id is 409 saying so, nothing written, while the inbox is open and once it
    closed (before the runtime logs its answer); the runtime's service token logs it."""
    async with serve(mongomock_db()) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        assert (await api.http.post(INBOX, headers=runtime)).status_code == 200
        turns = f"/v1/conversations/{OWNER_CONVERSATION}/turns"
        forged = {"turn_id": "t-running", "messages": [{"role": "assistant", "content": "FORGED"}]}
        before = await api.digest()

        taken = await api.http.post(turns, json=forged, headers=person)
        assert taken.status_code == 409, taken.text
        assert "a runtime's" in taken.json()["error"]["message"]
        assert await api.digest() == before
        closing = await api.http.post(f"{INBOX}/close", json={"last_seen_seq": 99},
                                      headers=runtime)  # fmt: skip
        assert closing.json()["closed"] is True
        assert (await api.http.post(turns, json=forged, headers=person)).status_code == 409

        answer = {"role": "assistant", "content": "the real answer"}
        body = {"turn_id": "t-running", "user_id": OWNER, "messages": [answer]}
        logged = await api.http.post(turns, json=body, headers=runtime)
        retried = await api.http.post(turns, json=body, headers=runtime)
        assert (logged.status_code, retried.status_code) == (201, 200)
        assert await api.db.agent_messages.count_documents({"content": "FORGED"}) == 0


async def test_a_runtime_opens_no_inbox_under_a_turn_id_a_person_took_first() -> None:
    """A person who guesses the runtime's turn id logs a forged answer under it before the
    inbox opens: the open quietly succeeded and the runtime's answer was then 409, the forged
    turn staying. The open is 409 saying the id holds a person's turn, nothing changed; the
    runtime opens its inbox under a new id, and logs its answer there."""
    async with serve(mongomock_db()) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        turns = f"/v1/conversations/{OWNER_CONVERSATION}/turns"
        forged = {"turn_id": "t7", "messages": [{"role": "assistant", "content": "FORGED"}]}
        assert (await api.http.post(turns, json=forged, headers=person)).status_code == 201
        before = await api.digest()

        taken = await api.http.post(f"{turns}/t7/inbox", headers=runtime)
        assert taken.status_code == 409, taken.text
        assert "a person's turn" in taken.json()["error"]["message"]
        assert await api.digest() == before

        assert (await api.http.post(f"{turns}/t7-2/inbox", headers=runtime)).status_code == 200
        closing = await api.http.post(f"{turns}/t7-2/inbox/close", json={"last_seen_seq": -1},
                                      headers=runtime)  # fmt: skip
        assert closing.json()["closed"] is True
        answer = {"role": "assistant", "content": "the real answer"}
        body = {"turn_id": "t7-2", "user_id": OWNER, "messages": [answer]}
        assert (await api.http.post(turns, json=body, headers=runtime)).status_code == 201


async def test_a_delivery_a_pop_removed_retried_is_409_naming_the_delivery_id() -> None:
    """The runtime popped the delivery; the person's client retries it: 409 naming the
    `delivery_id` and the inbox's turn, saying to send it under a new `delivery_id`, never the
    turn id the delivery is stored under."""
    async with serve(mongomock_db()) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        assert (await api.http.post(INBOX, headers=runtime)).status_code == 200
        body = steer("use metric", "d1")
        sent = await api.http.post(f"{INBOX}/messages", json=body, headers=person)
        assert sent.json() == {"delivered": True}
        popped = await api.store.conversations.pop_last_message(OWNER_CONVERSATION)
        assert popped is not None

        retried = await api.http.post(f"{INBOX}/messages", json=body, headers=person)

        said = retried.json()["error"]["message"]
        assert retried.status_code == 409
        assert "delivery 'd1' into the inbox of turn 't-running'" in said
        assert "new delivery_id" in said
        assert "delivery-" not in said
        assert "turn_id" not in said


async def test_a_delivery_whose_insert_was_lost_retried_with_another_message_is_503() -> None:
    """The first attempt's reservation applied and its insert failed; the person edits the
    message and retries under the same `delivery_id`: 503 naming the delivery (its first
    attempt may still store what it sent), nothing stored, never a 409 saying it is stored.
    The message as first sent is then delivered."""
    from tests.test_reliability import FailOnce

    async with serve(mongomock_db()) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        assert (await api.http.post(INBOX, headers=runtime)).status_code == 200
        real = api.store.logger._messages
        api.store.logger._messages = FailOnce(real, "insert_many", after_applying=False)
        lost = await api.http.post(f"{INBOX}/messages", json=steer("use metrc", "d1"),
                                   headers=person)  # fmt: skip
        api.store.logger._messages = real
        assert lost.status_code == 503

        edited = await api.http.post(f"{INBOX}/messages", json=steer("use metric", "d1"),
                                     headers=person)  # fmt: skip
        again = await api.http.post(f"{INBOX}/messages", json=steer("use metrc", "d1"),
                                    headers=person)  # fmt: skip

        said = edited.json()["error"]["message"]
        assert edited.status_code == 503
        assert "delivery 'd1' into the inbox of turn 't-running'" in said
        assert "stored with" not in said
        assert "delivery-" not in said
        assert again.json() == {"delivered": True}
        drained = (await api.http.get(f"{INBOX}?after_seq=-1", headers=runtime)).json()["data"]
        assert [m["content"] for m in drained] == ["use metrc"]


def _pay(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "pay", "arguments": "{}"}}


async def test_a_delivery_denying_a_call_a_person_approved_is_409_as_such_a_turn_is() -> None:
    """A person approved paying; the runtime's delivery of a denial of that call is refused
    as a turn carrying it is (409), naming the delivery and the inbox, nothing stored."""
    async with serve(mongomock_db()) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        conv = "/v1/conversations/conv-pay"
        asks = {"action": "confirm", "params": {}, "request_id": "r1", "tool_call_ids": ["pay1"]}
        first = [{"role": "user", "content": "pay"},
                 {"role": "assistant", "content": None, "tool_calls": [_pay("pay1")]},
                 {"role": "assistant", "content": "pay?", "hitl_action": asks}]  # fmt: skip
        body = {"turn_id": "t1", "messages": first}
        assert (await api.http.post(f"{conv}/turns", json=body, headers=person)).status_code == 201
        resolved = await api.http.post(f"{conv}/hitl/resolve", json={"request_id": "r1"},
                                       headers=person)  # fmt: skip
        assert resolved.status_code == 200, resolved.text
        assert (
            await api.http.post(f"{conv}/turns/run-1/inbox", headers=runtime)
        ).status_code == 200
        before = await api.digest()
        denial = {"role": "tool", "tool_call_id": "pay1", "content": "tool call denied",
                  "error": {"message": "tool call denied"}}  # fmt: skip

        sent = await api.http.post(f"{conv}/turns/run-1/inbox/messages",
                                   json={"delivery_id": "d1", "message": denial},
                                   headers=runtime)  # fmt: skip

        said = sent.json()["error"]["message"]
        assert sent.status_code == 409, sent.text
        assert "delivery 'd1' into the inbox of turn 'run-1' denies" in said
        assert "delivery-" not in said
        assert await api.digest() == before


async def test_a_delivery_into_a_conversation_being_deleted_is_503_naming_the_delivery() -> None:
    """The delete failed part-way: a delivery is 503 as a turn is, naming the delivery and
    the inbox it was sent into, never the turn id it is stored under (no sender may send
    that one)."""
    from agent_store.core import StorageUnavailable

    async with serve(mongomock_db()) as api:
        runtime, person = auth_headers(), auth_headers(user=OWNER)
        assert (await api.http.post(INBOX, headers=runtime)).status_code == 200
        conversations = api.store.conversations

        async def dropped(*args: Any, **kwargs: Any) -> Any:
            raise StorageUnavailable("simulated: connection dropped")

        real, conversations._delete_document = conversations._delete_document, dropped
        gone = await api.http.delete(f"/v1/conversations/{OWNER_CONVERSATION}", headers=person)
        conversations._delete_document = real
        assert gone.status_code == 503

        sent = await api.http.post(f"{INBOX}/messages", json=steer("steer", "d1"), headers=person)

        said = sent.json()["error"]["message"]
        assert sent.status_code == 503, sent.text
        assert "delivery 'd1' into the inbox of turn 't-running' may be sent again" in said
        assert "delivery-" not in said
        assert await api.db.agent_messages.count_documents({"content": "steer"}) == 0


async def test_a_fork_of_a_conversation_not_migrated_yet_is_409_as_a_write_to_it_is() -> None:
    """The owner reads her legacy-only conversation; a fork of it is 409 saying it can be
    forked once migrated (to her and to a service), as a turn into it is, not 404; another
    user's token finds nothing."""
    from agent_store.legacy import LEGACY_TURNS

    async with serve(mongomock_db()) as api:
        await api.db[LEGACY_TURNS].insert_one(
            {"_id": "lt-1", "conversation_id": "conv-old", "user_id": OWNER,
             "user_message": "hello", "created_at": "2025-01-01T00:00:00Z",
             "response_parts": [{"type": "text", "content": "ok"}]}
        )  # fmt: skip
        forks = "/v1/conversations/conv-old/forks"
        body = {"at_seq": 0, "new_conversation_id": "conv-old-fork"}
        person = auth_headers(user=OWNER)
        assert (await api.http.get("/v1/conversations/conv-old", headers=person)).status_code == 200

        for headers in (person, auth_headers()):
            forked = await api.http.post(forks, json=body, headers=headers)
            assert forked.status_code == 409, forked.text
            assert "can be forked once" in forked.json()["error"]["message"]
        stranger = await api.http.post(forks, json=body, headers=auth_headers(user=OTHER))
        assert stranger.status_code == 404
        assert await api.db.agent_conversations.find_one({"_id": "conv-old-fork"}) is None
