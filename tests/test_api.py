"""The service's first routes: health, and a transcript behind a service token."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from app.api import create_app
from app.examples import EXAMPLE_CONVERSATION_ID, example_turns
from app.service import Store
from app.settings import Settings
from tests.conftest import Backend

TOKEN = "service-token-for-tests-0123456789abcdef"
SECOND_TOKEN = "second-service-token-0123456789abcdef"


@pytest.fixture
async def client(backend: Backend) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(service_tokens=[TOKEN, SECOND_TOKEN])
    store = Store.on(backend.db, settings)
    for turn_id, messages in example_turns():
        await store.logger.log_messages(EXAMPLE_CONVERSATION_ID, messages, turn_id=turn_id)
    app = create_app(settings, store=store)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as http:
        yield http


def transcript_url(conversation_id: str = EXAMPLE_CONVERSATION_ID) -> str:
    return f"/v1/conversations/{conversation_id}/transcript"


async def test_health_needs_no_token(client: httpx.AsyncClient) -> None:
    response = await client.get("/health")
    assert response.json() == {"status": "ok"}


async def test_transcript_returns_every_message_in_order(client: httpx.AsyncClient) -> None:
    response = await client.get(transcript_url(), headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200
    data = response.json()["data"]
    assert [m["seq"] for m in data] == list(range(12))
    assert data[0]["content"] == "What's the weather in Paris and in Lyon?"


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="no-token"),
        pytest.param({"Authorization": "Bearer wrong"}, id="wrong-token"),
        pytest.param({"Authorization": f"Basic {TOKEN}"}, id="wrong-scheme"),
    ],
)
async def test_transcript_without_a_valid_service_token_is_refused(
    client: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    response = await client.get(transcript_url(), headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthorized"


async def test_any_configured_token_is_accepted(client: httpx.AsyncClient) -> None:
    response = await client.get(
        transcript_url(), headers={"Authorization": f"Bearer {SECOND_TOKEN}"}
    )
    assert response.status_code == 200


@pytest.mark.parametrize(
    ("conversation_id", "status", "code"),
    [
        pytest.param("missing", 404, "not_found", id="missing"),
        pytest.param("bad id with spaces", 422, "invalid_input", id="invalid"),
    ],
)
async def test_transcript_errors_are_json_with_a_stable_code(
    client: httpx.AsyncClient, conversation_id: str, status: int, code: str
) -> None:
    response = await client.get(
        transcript_url(conversation_id), headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["message"]


async def test_routes_work_on_every_backend(backend: Backend) -> None:
    from tests.api_harness import OTHER, OWNER, auth_headers, serve

    async with serve(backend.db) as api:
        turn = {"turn_id": "run-7", "messages": [{"role": "user", "content": "Zanzibar trip?"}]}
        url = f"/v1/conversations/{EXAMPLE_CONVERSATION_ID}"
        posted = [
            (await api.http.post(f"{url}/turns", json=turn, headers=auth_headers(user=OWNER)))
            for _ in range(2)
        ]
        assert [p.status_code for p in posted] == [201, 200]
        transcript = await api.http.get(f"{url}/transcript", headers=auth_headers())
        assert [m["seq"] for m in transcript.json()["data"]] == list(range(13))
        listed = await api.http.get(f"/v1/users/{OWNER}/conversations", headers=auth_headers())
        assert listed.json()["data"][0]["_id"] == EXAMPLE_CONVERSATION_ID
        hidden = await api.http.get(url, headers=auth_headers(user=OTHER))
        assert hidden.status_code == 404
        if "text_search" in backend.lacks:
            return
        for user, expected in ((OWNER, 1), (OTHER, 0)):
            found = await api.http.get(
                "/v1/search", params={"q": "Zanzibar"}, headers=auth_headers(user=user)
            )
            assert found.status_code == 200, found.text
            assert len(found.json()["data"]) == expected


async def test_a_retried_turn_landing_after_a_delete_serves_nothing_of_the_conversation(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client retries POST /turns (its first answer lost); the retry's insert is held until
    DELETE of the conversation has answered. The retry is a 409 (nothing of the turn is
    stored: the conversation was deleted since), and afterwards no read of the id serves the
    deleted turn: the conversation and its transcript are 404 to the
    service and to the owner, and a conversation another user starts there holds only its
    own messages."""
    import asyncio
    from typing import Any

    from tests.api_harness import OTHER, OWNER, auth_headers, serve

    url = "/v1/conversations/c-retried"
    said = [{"role": "user", "content": "OWNER's secret"}, {"role": "assistant", "content": "ok"}]
    turn = {"turn_id": "t1", "user_id": OWNER, "messages": said}
    async with serve(backend.db, seeded=False) as api:
        assert (await api.http.post(f"{url}/turns", json=turn, headers=auth_headers())).is_success
        messages = api.store.logger._messages
        insert_many, reached, go = messages.insert_many, asyncio.Event(), asyncio.Event()

        async def held(*args: Any, **kwargs: Any) -> Any:
            reached.set()
            await go.wait()
            return await insert_many(*args, **kwargs)

        monkeypatch.setattr(messages, "insert_many", held)
        retry = asyncio.create_task(
            api.http.post(f"{url}/turns", json=turn, headers=auth_headers())
        )
        await reached.wait()
        deleted = await api.http.delete(url, headers=auth_headers())
        go.set()
        retried = await retry

        assert deleted.status_code == 200
        assert retried.status_code == 409, retried.text
        assert "was deleted since" in retried.json()["error"]["message"]
        for headers in (auth_headers(), auth_headers(user=OWNER)):
            assert (await api.http.get(url, headers=headers)).status_code == 404
            assert (await api.http.get(f"{url}/transcript", headers=headers)).status_code == 404
        other = {"turn_id": "o1", "messages": [{"role": "user", "content": "hello"}]}
        await api.http.post(f"{url}/turns", json=other, headers=auth_headers(user=OTHER))
        transcript = await api.http.get(f"{url}/transcript", headers=auth_headers())
        assert [m["content"] for m in transcript.json()["data"]] == ["hello"]


async def test_a_turn_slower_than_its_conversations_delete_is_a_409(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first POST /turns reserves its place and its insert is held, slower than the
    logger's `claim_grace`, until DELETE of the conversation has answered and the owner has
    started it again: nothing this attempt inserted is stored, and the client is told so (409
    `conflict`, the conversation deleted since), never a 201 for `seq`s nobody holds."""
    import asyncio
    from dataclasses import replace
    from datetime import timedelta
    from typing import Any

    from tests.api_harness import OWNER, auth_headers, serve

    url = "/v1/conversations/c-slow"
    first = {"turn_id": "t1", "messages": [{"role": "user", "content": "first"}]}
    slow = {"turn_id": "t2", "messages": [{"role": "user", "content": "OWNER's secret"}]}
    again = {"turn_id": "n1", "messages": [{"role": "user", "content": "again"}]}
    owner = auth_headers(user=OWNER)
    async with serve(backend.db, seeded=False) as api:
        assert (await api.http.post(f"{url}/turns", json=first, headers=owner)).is_success
        logger = api.store.logger
        logger.rules = replace(logger.rules, claim_grace=timedelta(0))
        insert_many, reached, go = logger._messages.insert_many, asyncio.Event(), asyncio.Event()

        async def held(*args: Any, **kwargs: Any) -> Any:
            reached.set()
            await go.wait()
            return await insert_many(*args, **kwargs)

        monkeypatch.setattr(logger._messages, "insert_many", held)
        posted = asyncio.create_task(api.http.post(f"{url}/turns", json=slow, headers=owner))
        await reached.wait()
        assert (await api.http.delete(url, headers=owner)).status_code == 200
        monkeypatch.setattr(logger._messages, "insert_many", insert_many)
        assert (await api.http.post(f"{url}/turns", json=again, headers=owner)).status_code == 201
        go.set()
        answered = await posted

        assert answered.status_code == 409, answered.text
        assert answered.json()["error"]["code"] == "conflict"
        assert "was deleted since" in answered.json()["error"]["message"]
        transcript = await api.http.get(f"{url}/transcript", headers=owner)
        assert [m["content"] for m in transcript.json()["data"]] == ["again"]


IDEMPOTENCY_KEYS = ["4f1c2a9e-0d6b-4c1e-9a57-3f8e2b7d6c10", "key with spaces, $ and / (not an id)"]


@pytest.mark.parametrize("key", IDEMPOTENCY_KEYS, ids=["an identifier", "any text"])
async def test_a_turn_retried_with_its_idempotency_key_is_stored_once(key: str) -> None:
    """A client retrying POST /turns with the standard `Idempotency-Key` header, no `turn_id`
    and no times, is answered the stored turn: the key names the turn (as it is when an
    identifier, else by its digest). Without it each retry was a new turn."""
    from tests.api_harness import OWNER, auth_headers, mongomock_db, serve

    url = "/v1/conversations/c-idem/turns"
    turn = {
        "messages": [{"role": "user", "content": "book it"}, {"role": "assistant", "content": "ok"}]
    }
    headers = {**auth_headers(user=OWNER), "Idempotency-Key": key}
    async with serve(mongomock_db(), seeded=False) as api:
        answers = [await api.http.post(url, json=turn, headers=headers) for _ in range(3)]
        other = await api.http.post(url, json=turn, headers={**headers, "Idempotency-Key": "k2"})

        assert [a.status_code for a in answers] == [201, 200, 200]
        assert {a.json()["turn_id"] for a in answers} == {answers[0].json()["turn_id"]}
        assert other.status_code == 201
        assert await api.db.agent_messages.count_documents({"conversation_id": "c-idem"}) == 4


WHEN = "2026-01-01T00:00:00Z"
PARAMS = '{"amount": 10, "currency": "EUR", "to": {"iban": "FR76", "name": "A"}}'
PARAMS_REORDERED = '{"to": {"name": "A", "iban": "FR76"}, "currency": "EUR", "amount": 10}'
PARAMS_WHOLE_FLOAT = '{"amount": 10.0, "currency": "EUR", "to": {"iban": "FR76", "name": "A"}}'


@pytest.mark.parametrize("retried", [PARAMS_REORDERED, PARAMS_WHOLE_FLOAT], ids=["keys", "10.0"])
@pytest.mark.parametrize("key", ["req-1", None], ids=["Idempotency-Key", "no key"])
async def test_a_turn_retried_with_its_json_objects_keys_in_another_order_is_stored_once(
    key: str | None, retried: str
) -> None:
    """A client serialising a hash map sends an object's keys in another order on a retry,
    or a whole number as `10.0`: the same JSON, so the same turn, under its
    `Idempotency-Key` or recognised by its content and times without one (200, stored
    once), never a 409 nor a second copy."""
    from tests.api_harness import OWNER, auth_headers, mongomock_db, serve

    def body(params: str) -> str:
        prompt = f'{{"request_id": "q1", "action": "confirm", "params": {params}}}'
        message = f'{{"role": "assistant", "content": "Pay?", "created_at": "{WHEN}", '
        return f'{{"messages": [{message}"hitl_action": {prompt}}}]}}'

    url = "/v1/conversations/c-keys/turns"
    headers = {**auth_headers(user=OWNER), "Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    async with serve(mongomock_db(), seeded=False) as api:
        first = await api.http.post(url, content=body(PARAMS), headers=headers)
        again = await api.http.post(url, content=body(retried), headers=headers)

        assert (first.status_code, again.status_code) == (201, 200)
        assert again.json()["turn_id"] == first.json()["turn_id"]
        assert await api.db.agent_messages.count_documents({"conversation_id": "c-keys"}) == 1


async def test_an_idempotency_key_empty_sent_twice_or_naming_another_turn_is_422() -> None:
    from tests.api_harness import OWNER, auth_headers, mongomock_db, serve

    url = "/v1/conversations/c-idem/turns"
    turn = {"turn_id": "t-1", "messages": [{"role": "user", "content": "book it"}]}
    person = auth_headers(user=OWNER)
    async with serve(mongomock_db(), seeded=False) as api:
        other = await api.http.post(url, json=turn, headers={**person, "Idempotency-Key": "t-2"})
        twice = await api.http.post(
            url,
            json=turn,
            headers=[*person.items(), ("Idempotency-Key", "t-1"), ("Idempotency-Key", "t-1")],
        )
        empty = await api.http.post(url, json=turn, headers={**person, "Idempotency-Key": " "})
        same = await api.http.post(url, json=turn, headers={**person, "Idempotency-Key": "t-1"})

        assert (other.status_code, twice.status_code, empty.status_code) == (422, 422, 422)
        assert same.status_code == 201
        assert "empty" in empty.json()["error"]["message"]
        assert "Idempotency-Key" in other.json()["error"]["message"]
        assert "twice" in twice.json()["error"]["message"]
        assert await api.db.agent_messages.count_documents({}) == 1


async def test_a_turn_into_a_conversation_whose_delete_failed_part_way_is_a_503(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DELETE fails at its last command (the conversation document, lost before it applied):
    503, the messages gone, the document left. A turn posted then, new or a retry of the
    deleted one, is a 503 saying the conversation is being deleted, nothing stored; once
    DELETE is run again, the turn starts a new conversation (201)."""
    from typing import Any

    from pymongo.errors import AutoReconnect

    from tests.api_harness import OWNER, auth_headers, serve

    url = "/v1/conversations/c-half"
    turn = {"turn_id": "t1", "user_id": OWNER, "messages": [{"role": "user", "content": "hi"}]}
    async with serve(backend.db, seeded=False) as api:
        assert (await api.http.post(f"{url}/turns", json=turn, headers=auth_headers())).is_success
        conversations = api.store.conversations._conversations

        async def lost(*args: Any, **kwargs: Any) -> Any:
            raise AutoReconnect("connection lost (injected)")

        monkeypatch.setattr(conversations, "find_one_and_delete", lost)
        assert (await api.http.delete(url, headers=auth_headers())).status_code == 503
        monkeypatch.undo()
        before = await api.digest()

        refused = [
            await api.http.post(f"{url}/turns", json=turn | {"turn_id": t}, headers=auth_headers())
            for t in ("t1", "t2")
        ]

        assert [(r.status_code, r.json()["error"]["code"]) for r in refused] == [
            (503, "storage_unavailable")
        ] * 2
        assert "conversation 'c-half' is being deleted" in refused[1].json()["error"]["message"]
        assert "may be sent again once the delete finished" in refused[1].json()["error"]["message"]
        assert await api.digest() == before
        assert (await api.http.delete(url, headers=auth_headers())).status_code == 200
        again = await api.http.post(f"{url}/turns", json=turn, headers=auth_headers())
        assert again.status_code == 201, again.text


@pytest.mark.parametrize("unmade", ["delete failed part-way", "fork lost its copies"])
async def test_a_conversation_that_is_no_conversation_is_a_404_to_every_reader(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, unmade: str
) -> None:
    """A conversation whose DELETE failed part-way (its messages gone, its document marked),
    or a fork whose insert of its copies failed (503): GET, its transcript and its messages
    are 404, the owner's list and export leave it out (no count or preview of messages it
    does not hold); a person's turn into the fork is a 503 until the fork is retried."""
    from typing import Any

    from pymongo.errors import AutoReconnect

    from tests.api_harness import OWNER, auth_headers, serve

    said = [{"role": "user", "content": "secret plan"}, {"role": "assistant", "content": "noted"}]
    turn = {"turn_id": "t1", "user_id": OWNER, "messages": said}
    async with serve(backend.db, seeded=False) as api:
        source = "/v1/conversations/c-src/turns"
        assert (await api.http.post(source, json=turn, headers=auth_headers())).is_success

        async def lost(*args: Any, **kwargs: Any) -> Any:
            raise AutoReconnect("connection lost (injected)")

        if unmade == "delete failed part-way":
            gone = "c-src"
            conversations = api.store.conversations._conversations
            monkeypatch.setattr(conversations, "find_one_and_delete", lost)
            failed = await api.http.delete(f"/v1/conversations/{gone}", headers=auth_headers())
        else:
            gone = "c-fork"
            monkeypatch.setattr(api.store.logger._messages, "insert_many", lost)
            fork = {"at_seq": 1, "new_conversation_id": gone}
            failed = await api.http.post(
                "/v1/conversations/c-src/forks", json=fork, headers=auth_headers()
            )
        assert failed.status_code == 503
        monkeypatch.undo()
        person = auth_headers(user=OWNER)
        url = f"/v1/conversations/{gone}"

        for read in (url, f"{url}/transcript", f"{url}/messages"):
            assert (await api.http.get(read, headers=person)).status_code == 404, read
        listed = await api.http.get(f"/v1/users/{OWNER}/conversations", headers=person)
        assert gone not in [c["conversation_id"] for c in listed.json()["data"]]
        exported = await api.http.get(f"/v1/users/{OWNER}/export?format=jsonl", headers=person)
        assert f'"conversation_id":"{gone}"' not in exported.text
        if unmade == "fork lost its copies":
            more = {"turn_id": "t9", "messages": [{"role": "user", "content": "go on"}]}
            refused = await api.http.post(f"{url}/turns", json=more, headers=person)
            assert refused.status_code == 503, refused.text
            assert "is a fork not made yet" in refused.json()["error"]["message"]
