"""Every public operation of the store and the migration tool, once, under a label.

Used by `scripts.sharding_contract` and its test: the command listener records
what each operation sends, so the contract covers all of them.
"""

from __future__ import annotations

import contextlib
import io
import uuid
from functools import partial
from typing import Any

from pymongo import AsyncMongoClient, MongoClient

import migrations.cli
import migrations.connection
from agent_store import AgentMessageLogger, ConversationStore, LegacyTurns, SteeringInbox
from agent_store.legacy import LEGACY_TURNS
from agent_store.store import MESSAGES
from app.examples import example_legacy_turns, example_turns
from scripts.sharding_contract import CommandLog

OWNER = "user-shard"


async def _store_operations(db: Any, log: CommandLog) -> None:
    legacy = LegacyTurns(db, dual_write=True)
    logger = AgentMessageLogger(db, observers=[legacy], legacy=legacy)
    store = ConversationStore(db, legacy=legacy)
    await logger.ensure_indexes()
    cid = "conv-shard"
    turns = example_turns()
    with log.operation("log a turn in a new conversation"):
        await logger.log_messages(cid, turns[0][1], turn_id=turns[0][0], user_id=OWNER)
    with log.operation("log a turn"):
        await logger.log_messages(cid, turns[1][1], turn_id=turns[1][0], user_id=OWNER)
    with log.operation("replay a logged turn"):
        await logger.log_messages(cid, turns[1][1], turn_id=turns[1][0], user_id=OWNER)
    await logger.log_messages("conv-unowned", turns[0][1], turn_id=turns[0][0])
    with log.operation("a turn assigns an unowned conversation"):
        await logger.log_messages("conv-unowned", turns[1][1], turn_id=turns[1][0], user_id=OWNER)
    with log.operation("upsert a conversation"):
        await logger.upsert_conversation("conv-other", user_id=OWNER, name="Other")
    with log.operation("list a user's conversations"):
        await store.list_conversations(OWNER)
    with log.operation("read a conversation"):
        await store.get_conversation(cid)
        await store.turn_count(cid)
        await store.pending_hitl(cid)
    with log.operation("read a transcript"):
        await store.transcript(cid)
    with log.operation("page through messages"):
        first = await store.messages_page(cid, limit=2)
        await store.messages_page(cid, after=first.last_id, limit=2)
    await _late_insert_reads(db, log, store, cid)
    with log.operation("rename a conversation"):
        await store.rename(cid, "Renamed")
    with log.operation("resolve a pending prompt"):
        pending = await store.pending_hitl(cid)
        if pending is not None:
            await store.resolve_hitl(cid, pending.request_id)
    with log.operation("search a user's messages"):
        await store.search("weather", user_id=OWNER)
    with log.operation("search one conversation"):
        await store.search("weather", conversation_id=cid)
    inbox = SteeringInbox(logger)
    with log.operation("steer a running turn"):
        await inbox.open_turn(cid, "t-running")
        await inbox.try_deliver(cid, "t-running", {"role": "user", "content": "also Lyon"})
        await inbox.drain(cid, "t-running")
        seen = await inbox.close_inbox(cid, "t-running", -1)
        await inbox.close_inbox(cid, "t-running", max(m.seq or 0 for m in seen))
    with log.operation("fork a conversation"):
        await logger.fork(cid, 3, "conv-forked")
    await _legacy_operations(db, log, store)
    with log.operation("export a user"):
        _ = [e async for e in store.export_user(OWNER)]
    with log.operation("claim an account"):
        await store.claim(OWNER, "user-claimed")
    with log.operation("delete a conversation"):
        await store.delete("conv-forked")
    with log.operation("erase a user"):
        await store.erase_user("user-claimed")


async def _late_insert_reads(db: Any, log: CommandLog, store: ConversationStore, cid: str) -> None:
    """The last messages read past a late insert of a life a delete ended (read again with
    the conversation's `epoch` in the query); the stray taken away after."""
    [doc] = await db[MESSAGES].find({"conversation_id": cid}).sort("seq", -1).limit(1).to_list()
    stray = {**doc, "_id": "msg-of-an-ended-life", "seq": doc["seq"] + 100, "epoch": "ended"}
    await db[MESSAGES].insert_one(stray)
    with log.operation("read the last messages past another life's late insert"):
        await store.recent_messages(cid, limit=2)
        await store.messages_page(cid, order="desc", limit=2)
    await db[MESSAGES].delete_one({"_id": stray["_id"]})


async def _legacy_operations(db: Any, log: CommandLog, store: ConversationStore) -> None:
    turns = example_legacy_turns()
    for number, turn in enumerate(turns):
        turn |= {"_id": f"legacy-only-{number}", "conversation_id": "conv-legacy-only"}
    await db[LEGACY_TURNS].insert_many(turns)
    with log.operation("read a conversation not migrated yet"):
        await store.transcript("conv-legacy-only")


def _migration(uri: str, name: str, log: CommandLog) -> None:
    """The migration tool's commands, through its own (synchronous) client."""
    sync: MongoClient[dict[str, Any]] = MongoClient(uri)
    sync[name]["agent_conversations"].insert_many(example_legacy_turns())
    sync.close()
    real = migrations.connection.MongoClient
    migrations.connection.MongoClient = partial(real, event_listeners=[log])  # type: ignore[misc]
    try:
        for command in ("run", "verify", "finish", "status"):
            arguments = [command, "--uri", uri, "--database", name, "--progress", "none"]
            with log.operation(f"migration {command}"), contextlib.redirect_stdout(io.StringIO()):
                migrations.cli.main(arguments)
    finally:
        migrations.connection.MongoClient = real  # type: ignore[misc]


async def exercise(uri: str) -> CommandLog:
    """Run every operation against the server at `uri`; the log of what each sent."""
    log = CommandLog()
    client: AsyncMongoClient[Any] = AsyncMongoClient(uri, tz_aware=True, event_listeners=[log])
    name = f"shards_{uuid.uuid4().hex[:8]}"
    try:
        _migration(uri, name, log)
        await _store_operations(client[name], log)
    finally:
        await client.drop_database(name)
        await client.close()
    return log
