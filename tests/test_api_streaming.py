"""The transcript and the export are streamed: the same documents, in memory flat in their size."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from agent_store.core import AgentMessage
from agent_store.store import ConversationStore
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
from tests.conftest import Backend

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


async def test_a_streamed_transcript_of_300_short_messages_costs_two_round_trips(
    wire_backend: Backend,
) -> None:
    await add_big_conversation(wire_backend.db, "conv-300", messages=300, chars=200)
    store = ConversationStore(wire_backend.db)
    assert wire_backend.commands is not None
    wire_backend.commands.clear()
    batches = [len(b) async for b in store.stream_transcript("conv-300")]
    assert batches == [32, 268]
    assert wire_backend.commands.names == ["find", "find"]


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


async def test_a_conversation_not_migrated_yet_is_streamed_from_its_legacy_turns() -> None:
    async with serve(mongomock_db()) as api:
        await api.db["agent_conversations_deprecated"].insert_one(
            {"conversation_id": "conv-old", "user_id": OWNER, "user_message": "Hello from 2024"}
        )
        response = await api.http.get("/v1/conversations/conv-old/transcript", headers=SERVICE)
        assert response.status_code == 200
        assert [m["content"] for m in response.json()["data"]] == ["Hello from 2024"]


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
