"""The read section of `make bench`: one long transcript read four ways.

- `transcript`  ConversationStore.transcript (find by seq, validated into models);
- `raw find`    the same find with the same cursor options, documents left as dicts;
- `legacy`      the old path: turn documents by time, exploded and re-ordered;
- `langchain`   MongoDBChatMessageHistory.messages of the same messages.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from typing import Any

from agent_store import AgentMessageLogger, ConversationStore
from agent_store.legacy import LEGACY_TURNS, legacy_turn_document
from agent_store.store._reads import TRANSCRIPT_BATCH
from scripts.bench_contenders import langchain_history, to_langchain
from scripts.bench_measure import Deployment, Meter, Series, connect, paired_ratio, rotated
from scripts.corpus import Conversation, Corpus
from scripts.legacy_turns import read_legacy_transcript


async def load_read_fixture(db: Any, sync_client: Any, conversation: Conversation) -> Any:
    """Store one long conversation three ways: messages, legacy turns, langchain's documents."""
    from langchain_core.messages import message_to_dict

    logger = AgentMessageLogger(db)
    await logger.ensure_indexes()
    legacy_turns, langchain_docs = [], []
    for number, (turn_id, messages) in enumerate(conversation.turns):
        logged = await logger.log_messages(
            conversation.conversation_id, messages, user_id=conversation.user_id, turn_id=turn_id
        )
        documents = [m.model_dump(by_alias=True) for m in logged.messages]
        legacy_turns.append(
            legacy_turn_document(
                conversation.conversation_id,
                turn_id,
                logged.messages,
                user_id=conversation.user_id,
                name="Bench" if number == 0 else None,
            )
        )
        langchain_docs += [
            {"SessionId": conversation.conversation_id, "History": json.dumps(message_to_dict(m))}
            for m in to_langchain(documents)
        ]
    await db[LEGACY_TURNS].create_index([("conversation_id", 1), ("created_at", 1)])
    await db[LEGACY_TURNS].insert_many(legacy_turns)
    history = langchain_history(sync_client, db.name, conversation.conversation_id)
    history.collection.insert_many(langchain_docs)
    return history


def same_transcript(a: list[Any], b: list[Any]) -> bool:
    """Role, text and tool pairing agree (legacy turns keep no per-message usage or time)."""

    def key(m: Any) -> tuple[Any, ...]:
        calls = tuple(c.id for c in m.tool_calls or ())
        return (m.role, m.content, m.tool_call_id, calls, m.hitl_action, m.error, m.upload)

    return [key(m) for m in a] == [key(m) for m in b]


async def _read_all(
    db: Any, history: Any, meter: Meter, conversation: Conversation, repetitions: int
) -> dict[str, Any]:
    store = ConversationStore(db)
    cid = conversation.conversation_id
    results: dict[str, Any] = {}

    async def transcript() -> None:
        results["transcript"] = await store.transcript(cid)

    async def raw_find() -> None:
        results["raw find"] = await (
            db["agent_messages"]
            .find({"conversation_id": cid})
            .sort("seq", 1)
            .batch_size(TRANSCRIPT_BATCH)
            .to_list(None)
        )

    async def legacy() -> None:
        results["legacy"] = await read_legacy_transcript(db, cid)

    async def langchain() -> None:
        results["langchain"] = history.messages

    readers: dict[str, Callable[[], Awaitable[None]]] = {
        "transcript": transcript,
        "raw find": raw_find,
        "legacy": legacy,
        "langchain": langchain,
    }
    names = list(readers)
    series = {n: Series(n, 1, conversation.message_count) for n in names}
    for repetition in range(-1, repetitions):
        for name in rotated(names, repetition):
            results.pop(name, None)  # the last read's result is freed here, not in the timing
            sample = await meter.measure(readers[name])
            if repetition >= 0:
                series[name].samples.append(sample)
    return {
        "messages": conversation.message_count,
        "contenders": [s.summary() for s in series.values()],
        "ratios": {
            "transcript / raw find": {
                m: paired_ratio(series["transcript"], series["raw find"], m)
                for m in ("cpu", "network_wall", "wall")
            },
            "legacy / transcript": {
                m: paired_ratio(series["legacy"], series["transcript"], m) for m in ("cpu", "wall")
            },
        },
        "checks": {
            "messages_read": {n: len(results[n]) for n in names},
            "legacy_matches_new": same_transcript(results["legacy"], results["transcript"]),
        },
    }


async def bench_reads(deployment: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    """On the deployment, through the proxy at the first latency."""
    conversation = Corpus(seed=13).conversation_of_size(args.transcript_messages)
    deployment.proxy.latency_ms = args.latencies[0]
    async with connect(deployment) as clients:
        db = clients.async_client["bench_read"]
        try:
            history = await load_read_fixture(db, clients.sync_client, conversation)
            out = await _read_all(db, history, clients.meter, conversation, args.read_repetitions)
        finally:
            await clients.async_client.drop_database("bench_read")
    return {"latency_ms": args.latencies[0], **out}


async def bench_reads_mongomock(args: argparse.Namespace) -> dict[str, Any]:
    """On mongomock: the database runs in this process, its CPU is in every figure."""
    import mongomock
    from mongomock_motor import AsyncMongoMockClient

    conversation = Corpus(seed=13).conversation_of_size(args.transcript_messages)
    sync_client = mongomock.MongoClient(tz_aware=True)
    db = AsyncMongoMockClient(mock_mongo_client=sync_client)["bench_read"]
    history = await load_read_fixture(db, sync_client, conversation)
    return await _read_all(db, history, Meter(None, None), conversation, args.read_repetitions)
