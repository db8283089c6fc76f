"""The transcript and the export are streamed: the same documents, in memory flat in their size."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from agent_store import AgentMessageLogger, Conflict, StorageUnavailable, TurnRules
from agent_store.core import AgentMessage
from agent_store.store import CONVERSATIONS, MESSAGES, ConversationStore
from app.api import create_app
from app.api_models import Transcript
from app.service import Store
from scripts.bench_transcript_memory import add_big_conversation, measure_get
from scripts.wire_server import start_wire_server
from tests.api_harness import (
    OTHER,
    OWNER,
    OWNER_CONVERSATION,
    SERVICE_TOKEN,
    api_settings,
    auth_headers,
    mongomock_db,
    serve,
)
from tests.conftest import Backend, after_its_first_batch

SERVICE = auth_headers()
MiB = 1024 * 1024
BIG = "big_conversations"


def transcript_document(conversation_id: str, messages: list[AgentMessage]) -> Any:
    """The transcript as the unstreamed route built it, from the whole list."""
    return Transcript(conversation_id=conversation_id, data=messages).model_dump(
        mode="json", by_alias=True
    )


async def test_a_streamed_transcript_comes_in_seq_order_batch_by_batch(backend: Backend) -> None:
    async with serve(backend.db) as api:
        store = api.store.conversations
        whole = await store.transcript(OWNER_CONVERSATION)
        batches = [b async for b in store.stream_transcript(OWNER_CONVERSATION, batch_size=5)]
        assert [len(b) for b in batches] == [5, 5, 2]
        assert [m for b in batches for m in b] == whole


async def test_a_streamed_transcript_of_300_short_messages_costs_three_round_trips(
    wire_backend: Backend,
) -> None:
    """Its two batches, the first read with the conversation document (sent at once: one
    wait), and the lookup after the last one finding the conversation still the one whose
    messages were served."""
    await add_big_conversation(wire_backend.db, "conv-300", messages=300, chars=200)
    store = ConversationStore(wire_backend.db)
    assert wire_backend.commands is not None
    wire_backend.commands.clear()
    batches = [len(b) async for b in store.stream_transcript("conv-300")]
    assert batches == [32, 268]
    assert wire_backend.commands.names == ["find", "find", "find", "find"]


async def test_the_transcript_route_sends_the_same_document_as_before(backend: Backend) -> None:
    async with serve(backend.db) as api:
        response = await api.http.get(f"/v1/conversations/{OWNER_CONVERSATION}/transcript")
        assert response.status_code == 401
        response = await api.http.get(
            f"/v1/conversations/{OWNER_CONVERSATION}/transcript", headers=SERVICE
        )
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        whole = await api.store.conversations.transcript(OWNER_CONVERSATION)
        assert response.json() == transcript_document(OWNER_CONVERSATION, whole)


@pytest.mark.parametrize("export_format", ["jsonl", "json"])
async def test_the_export_route_sends_the_same_documents_as_before(
    backend: Backend, export_format: str
) -> None:
    async with serve(backend.db) as api:
        response = await api.http.get(
            f"/v1/users/{OWNER}/export", params={"format": export_format}, headers=SERVICE
        )
        assert response.status_code == 200
        expected = [
            item.model_dump(mode="json", by_alias=True)
            async for item in api.store.conversations.export_user(OWNER)
        ]
        if export_format == "jsonl":
            assert [json.loads(line) for line in response.text.splitlines()] == expected
        else:
            assert response.json() == {"user_id": OWNER, "conversations": expected}


async def test_a_transcript_of_many_batches_is_one_valid_document() -> None:
    async with serve(mongomock_db()) as api:
        await add_big_conversation(api.db, "conv-long", messages=345, chars=50, user_id=OWNER)
        response = await api.http.get("/v1/conversations/conv-long/transcript", headers=SERVICE)
        data = response.json()["data"]
        assert [m["seq"] for m in data] == list(range(345))
        whole = await api.store.conversations.transcript("conv-long")
        assert response.json() == transcript_document("conv-long", whole)


@pytest.mark.parametrize(
    ("url", "headers", "status"),
    [
        pytest.param("/v1/conversations/missing/transcript", SERVICE, 404, id="missing"),
        pytest.param(
            f"/v1/conversations/{OWNER_CONVERSATION}/transcript",
            auth_headers(user=OTHER),
            404,
            id="another-users",
        ),
    ],
)
async def test_a_transcript_that_cannot_be_read_is_an_error_before_any_byte(
    url: str, headers: dict[str, str], status: int
) -> None:
    async with serve(mongomock_db()) as api:
        response = await api.http.get(url, headers=headers)
        assert response.status_code == status
        assert set(response.json()) == {"error"}


@pytest.mark.parametrize(
    "query",
    [{"format": "jsonl"}, {"format": "json"}, {}],
    ids=["jsonl", "json", "default-format"],
)
async def test_an_export_the_database_cannot_start_is_a_503_before_any_byte(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, query: dict[str, str]
) -> None:
    """The database is unreachable as the export lists the user's conversations: the usual
    storage error, as the transcript gives, never a 200 cut before its first byte (which a
    lenient client reads as a user with no conversations)."""
    async with serve(backend.db) as api:

        async def unreachable(user_id: str) -> Any:
            raise StorageUnavailable("could not list conversations: the database is unreachable")
            yield  # an async generator, as the store's is

        store = api.store.conversations
        monkeypatch.setattr(store, "stream_user_conversations", unreachable)
        response = await api.http.get(f"/v1/users/{OWNER}/export", params=query, headers=SERVICE)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "storage_unavailable"
        assert "unreachable" in response.json()["error"]["message"]


async def test_a_conversation_not_migrated_yet_is_streamed_from_its_legacy_turns() -> None:
    async with serve(mongomock_db()) as api:
        await api.db["agent_conversations_deprecated"].insert_one(
            {"conversation_id": "conv-old", "user_id": OWNER, "user_message": "Hello from 2024"}
        )
        response = await api.http.get("/v1/conversations/conv-old/transcript", headers=SERVICE)
        assert response.status_code == 200
        assert [m["content"] for m in response.json()["data"]] == ["Hello from 2024"]


# -- one life of the conversation ----------------------------------------------------------

LIFE = "c-life"


def said(who: str, count: int) -> list[dict[str, Any]]:
    """`count` messages, a person's and an assistant's in turn, each naming `who`."""
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": f"{who} {i}"} for i in range(count)]


def quick(db: Any) -> tuple[AgentMessageLogger, ConversationStore]:
    return AgentMessageLogger(db), ConversationStore(db, rules=TurnRules(claim_grace=timedelta(0)))


async def read_on(batches: Any, served: list[AgentMessage]) -> None:
    """Read the rest of a stream into `served`, batch by batch."""
    async for batch in batches:
        served += batch


async def test_a_stream_serves_one_life_and_fails_when_another_conversation_takes_the_id(
    backend: Backend,
) -> None:
    """Alice's conversation is deleted and Bob starts one under its id after the first batch
    (32 messages) was read: no batch serves Bob's messages, and the stream fails rather than
    end as if Alice's 32 were her whole transcript."""
    logger, store = quick(backend.db)
    await logger.log_messages(LIFE, said("ALICE", 40), user_id="alice", turn_id="t-1")
    batches = store.stream_transcript(LIFE)
    served = await anext(batches)
    await store.delete(LIFE)
    await logger.log_messages(LIFE, said("BOB", 40), user_id="bob", turn_id="t-1")

    with pytest.raises(Conflict, match="not its whole transcript"):
        await read_on(batches, served)
    assert [m.content for m in served] == [f"ALICE {i}" for i in range(32)]


@pytest.mark.parametrize("change", ["deleted", "claimed away", "deleted part-way"])
async def test_a_stream_whose_conversation_ends_mid_way_fails_rather_than_end_short(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """Read for its owner: deleted, claimed to another account, or deleted part-way (the
    delete failed after taking the messages, its document still there) after the first
    batch: the stream fails, never ends with 32 of 40 messages."""
    logger, store = quick(backend.db)
    await logger.log_messages(LIFE, said("ALICE", 40), user_id="alice", turn_id="t-1")
    batches = store.stream_transcript(LIFE, user_id="alice")
    served = await anext(batches)
    if change == "deleted":
        await store.delete(LIFE)
    elif change == "claimed away":
        await store.claim("alice", "alice-new-account")
    else:

        async def dropped(*args: Any) -> Any:
            raise StorageUnavailable("the connection dropped")

        monkeypatch.setattr(store, "_delete_document", dropped)
        with pytest.raises(StorageUnavailable):
            await store.delete(LIFE)

    with pytest.raises(Conflict, match="not its whole transcript"):
        await read_on(batches, served)
    assert len(served) == 32


async def test_a_stream_read_by_a_service_is_whole_when_its_conversation_changes_owner(
    backend: Backend,
) -> None:
    """A claim keeps the conversation (its life goes on under another owner): a service's
    stream, which names no user, serves it whole."""
    logger, store = quick(backend.db)
    await logger.log_messages(LIFE, said("ALICE", 40), user_id="alice", turn_id="t-1")
    batches = store.stream_transcript(LIFE)
    served = await anext(batches)
    await store.claim("alice", "alice-new-account")

    served += [m async for batch in batches for m in batch]
    assert [m.content for m in served] == [f"ALICE {i}" for i in range(40)]


async def regenerated(
    logger: AgentMessageLogger, store: ConversationStore, pops: int, turns: int
) -> None:
    """The runtime regenerates: the last `pops` messages popped, `turns` turns logged after."""
    for _ in range(pops):
        await store.pop_last_message(LIFE)
    for n in range(turns):
        await logger.log_messages(LIFE, said(f"NEW{n}", 2), user_id="alice", turn_id=f"n-{n}")


@pytest.mark.parametrize("turns", [2, 0], ids=["logged again", "popped only"])
async def test_a_stream_fails_when_a_pop_removed_a_message_it_served_before_its_end(
    backend: Backend, turns: int
) -> None:
    """After the first batch (32 of 40 messages), the last 10 are popped, and turns logged at
    their `seq`s or not: the stream fails, never serves popped messages with the turns logged
    after them, a transcript that never was (nor, one pop check for both, without them)."""
    logger, store = quick(backend.db)
    await logger.log_messages(LIFE, said("ALICE", 40), user_id="alice", turn_id="t-1")
    batches = store.stream_transcript(LIFE)
    served = await anext(batches)
    await regenerated(logger, store, 10, turns)

    with pytest.raises(Conflict, match="popped while its transcript was read"):
        await read_on(batches, served)
    assert len(served) == 32


@pytest.mark.parametrize("turns", [0, 2], ids=["popped only", "regenerated"])
async def test_a_stream_is_whole_when_a_pop_removed_only_messages_it_had_not_served(
    backend: Backend, turns: int
) -> None:
    """A pop past what the first batch served, perhaps the answer regenerated in its place
    (`turns` logged after): the stream serves the conversation as it stands after it, a
    transcript that was, though it serves those `seq`s again (was, regenerated: cut)."""
    logger, store = quick(backend.db)
    await logger.log_messages(LIFE, said("ALICE", 40), user_id="alice", turn_id="t-1")
    batches = store.stream_transcript(LIFE)
    served = await anext(batches)
    await regenerated(logger, store, 4, turns)

    await read_on(batches, served)
    assert served == await store.transcript(LIFE)
    assert len(served) == 36 + 2 * turns


async def stored_before_epochs(db: Any, conversation_id: str, messages: int) -> None:
    """A conversation as stored before conversations had an `epoch`: its messages name none."""
    await add_big_conversation(db, conversation_id, messages=messages, chars=10, user_id="alice")
    await db[CONVERSATIONS].update_one({"_id": conversation_id}, {"$unset": {"epoch": ""}})
    await db[MESSAGES].update_many({"conversation_id": conversation_id}, {"$unset": {"epoch": ""}})


@pytest.mark.parametrize("started_again", [False, True])
async def test_a_stream_of_a_conversation_stored_before_epochs_is_told_by_its_creation(
    backend: Backend, started_again: bool
) -> None:
    """Its first batch names no epoch: the stream pins the conversation by a lookup (its
    `created_at`), serves it whole, and fails when another is started under the id."""
    logger, store = quick(backend.db)
    await stored_before_epochs(backend.db, LIFE, 40)
    batches = store.stream_transcript(LIFE)
    served = await anext(batches)
    if started_again:
        await store.delete(LIFE)
        await logger.log_messages(LIFE, said("BOB", 40), user_id="bob", turn_id="t-1")
        with pytest.raises(Conflict, match="not its whole transcript"):
            await read_on(batches, served)
    else:
        await read_on(batches, served)
    assert [m.seq for m in served] == list(range(32 if started_again else 40))
    assert all(m.user_id == "alice" for m in served)


def after_first_batch(
    monkeypatch: pytest.MonkeyPatch, store: ConversationStore, change: Callable[[], Awaitable[Any]]
) -> None:
    """Run `change` once, as the first batch a streamed read (`full`) has read comes whole."""
    whole = store.with_full_texts
    pending = [change]

    async def hooked(messages: list[AgentMessage]) -> list[AgentMessage]:
        if pending:
            await pending.pop()()
        return await whole(messages)

    monkeypatch.setattr(store, "with_full_texts", hooked)


def cut_by(error: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether the answer was cut by a `kind` raised while it was sent (the server closes the
    connection: the client never reads the end of the response)."""
    while error is not None:
        if isinstance(error, kind):
            return True
        error = error.__cause__ or error.__context__
    return False


async def test_the_transcript_route_cuts_its_answer_rather_than_send_two_lives(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serve(backend.db, seeded=False) as api:
        store, logger = api.store.conversations, api.store.logger
        await logger.log_messages(LIFE, said("ALICE", 40), user_id="alice", turn_id="t-1")

        async def started_again() -> None:
            await store.delete(LIFE)
            await logger.log_messages(LIFE, said("BOB", 40), user_id="bob", turn_id="t-1")

        after_first_batch(monkeypatch, store, started_again)
        with pytest.raises(Exception) as cut:  # noqa: PT011 - what the server raises to cut it
            await api.http.get(f"/v1/conversations/{LIFE}/transcript?full=true", headers=SERVICE)
        assert cut_by(cut.value, Conflict)


async def test_the_transcript_route_cuts_its_answer_when_a_pop_removed_a_message_it_sent(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime regenerates (10 messages popped, two turns logged) after the first batch
    was sent: the answer is cut, never a 200 mixing popped messages with the turns after."""
    async with serve(backend.db, seeded=False) as api:
        store, logger = api.store.conversations, api.store.logger
        await logger.log_messages(LIFE, said("ALICE", 40), user_id="alice", turn_id="t-1")

        after_first_batch(monkeypatch, store, lambda: regenerated(logger, store, 10, 2))
        with pytest.raises(Exception) as cut:  # noqa: PT011 - what the server raises to cut it
            await api.http.get(f"/v1/conversations/{LIFE}/transcript?full=true", headers=SERVICE)
        assert cut_by(cut.value, Conflict)


@pytest.mark.parametrize("export_format", ["jsonl", "json"])
async def test_the_export_route_cuts_its_answer_rather_than_send_two_lives_of_a_conversation(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, export_format: str
) -> None:
    """The user deletes a conversation and starts it again under its id while the export
    sends its messages: what was sent cannot be taken back, so the export fails."""
    async with serve(backend.db, seeded=False) as api:
        store, logger = api.store.conversations, api.store.logger
        await logger.log_messages(LIFE, said("OLD", 40), user_id="carol", turn_id="t-1")

        async def started_again(conversation_id: str) -> None:
            await store.delete(conversation_id)
            await logger.log_messages(LIFE, said("NEW", 40), user_id="carol", turn_id="t-1")

        after_its_first_batch(monkeypatch, store, started_again)
        await _the_export_is_cut(api, export_format)


@pytest.mark.parametrize("export_format", ["jsonl", "json"])
async def test_the_export_route_cuts_its_answer_when_a_pop_removes_a_message_it_sent_the_count_of(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, export_format: str
) -> None:
    """The runtime pops the last message of a conversation of 40 once the export paired its
    summary (counting 40) with its first batch: the summary, sent, cannot be taken back, nor
    does it hold for the 39 messages left, so the export fails rather than end as if it did."""
    async with serve(backend.db, seeded=False) as api:
        store, logger = api.store.conversations, api.store.logger
        await logger.log_messages(LIFE, said("ALICE", 40), user_id="carol", turn_id="t-1")

        async def popped(conversation_id: str) -> None:
            await store.pop_last_message(conversation_id)

        after_its_first_batch(monkeypatch, store, popped)
        await _the_export_is_cut(api, export_format)
        assert len(await store.transcript(LIFE)) == 39


def exported_ids(response: Any, export_format: str) -> list[str]:
    if export_format == "jsonl":
        return [json.loads(line)["conversation"]["_id"] for line in response.text.splitlines()]
    return [c["conversation"]["_id"] for c in response.json()["conversations"]]


@pytest.mark.parametrize("export_format", ["jsonl", "json"])
@pytest.mark.parametrize(
    ("change", "left"),
    [("deleted", ["c-1", "c-3"]), ("claimed away", ["c-1"]), ("started again", ["c-1", "c-3"])],
)
async def test_the_export_leaves_out_a_conversation_gone_before_its_turn_and_goes_on(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, export_format: str, change: str,
    left: list[str],
) -> None:  # fmt: skip
    """Listed, then deleted, claimed to another account (with the others after it), or
    deleted and started again before the export reads it: it is not in the export, which
    holds the others whole."""
    async with serve(backend.db, seeded=False) as api:
        store, logger = api.store.conversations, api.store.logger
        for cid in ("c-1", "c-2", "c-3"):
            await logger.log_messages(cid, said(cid, 2), user_id="carol", turn_id="t-1")

        async def meanwhile(read_first: str) -> None:
            if change == "claimed away":
                await store.claim("carol", "carol-new-account")
                return
            await store.delete("c-2")
            if change == "started again":
                await logger.log_messages("c-2", said("NEW", 2), user_id="carol", turn_id="t-1")

        after_its_first_batch(monkeypatch, store, meanwhile)
        response = await api.http.get(
            "/v1/users/carol/export", params={"format": export_format, "full": "true"},
            headers=auth_headers(user="carol"),
        )  # fmt: skip
        assert response.status_code == 200
        assert exported_ids(response, export_format) == left
        assert "NEW" not in response.text


# -- memory ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_database() -> Iterator[str]:
    """A wire server in a child process (its memory is not this process's), holding
    conversations of 2 MB and 20 MB in 50 KB messages; yields its URI."""
    server, uri = start_wire_server()

    async def seed() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
        for name, messages in (("conv-2mb", 40), ("conv-20mb", 400)):
            await add_big_conversation(
                client[BIG], name, messages=messages, chars=50_000, user_id=OWNER
            )
        await client.close()

    try:
        asyncio.run(seed())
        yield uri
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)
        if server.stdout is not None:
            server.stdout.close()


@pytest.mark.wire
@pytest.mark.parametrize(
    ("path", "query"),
    [
        pytest.param("/v1/conversations/{}/transcript", b"", id="transcript"),
        pytest.param(f"/v1/users/{OWNER}/export", b"format=jsonl", id="export-jsonl"),
        pytest.param(f"/v1/users/{OWNER}/export", b"format=json", id="export-json"),
    ],
)
async def test_a_20_mb_read_needs_no_more_memory_than_a_2_mb_one(
    big_database: str, path: str, query: bytes
) -> None:
    settings = api_settings()
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(big_database, tz_aware=True)
    app = create_app(settings, store=Store.on(client[BIG], settings))

    def get(url: str, query: bytes = query) -> Any:
        return measure_get(app, url, query=query, token=SERVICE_TOKEN)

    try:
        await get("/ready", b"")  # the connection pool is the same for every size
        if "{}" in path:
            small, big = await get(path.format("conv-2mb")), await get(path.format("conv-20mb"))
        else:  # the export holds both conversations: compare it with the small transcript
            small, big = await get("/v1/conversations/conv-2mb/transcript", b""), await get(path)
    finally:
        await client.close()
    assert (small.status, big.status) == (200, 200)
    assert big.body_bytes > 20_000_000
    # Flat: a batch or two of about 1 MB (the first one 32 messages) whatever the size.
    assert big.peak_bytes < 8 * MiB, f"peak {big.peak_bytes / MiB:.1f} MiB"
    assert big.peak_bytes < small.peak_bytes + 2 * MiB, (small.peak_bytes, big.peak_bytes)


async def _the_export_is_cut(api: Any, export_format: str) -> None:
    """carol's export fails part way, cut by a `Conflict` (what was sent stands)."""
    with pytest.raises(Exception) as cut:  # noqa: PT011 - what the server raises to cut it
        await api.http.get(
            "/v1/users/carol/export",
            params={"format": export_format, "full": "true"},
            headers=SERVICE,
        )
    assert cut_by(cut.value, Conflict)
