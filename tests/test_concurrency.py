"""Many writers on one conversation, with concurrent and late retries and dropped connections.

An independent checker reads the stored documents back and holds them to the
invariants: `seq` without holes or duplicates, each turn stored once and whole,
the conversation's counters equal to what is stored, each writer's turns in
the order it logged them.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from agent_store import (
    AgentMessageLogger,
    LoggedTurn,
    RetryPolicy,
    StorageUnavailable,
    TurnRules,
    with_retries,
)
from agent_store.store import CONVERSATIONS, MESSAGES, client_options, shorten
from agent_store.store._turns import POPPED_SEQS_KEPT
from scripts.faulty_proxy import FaultyProxy
from scripts.pool_recovery import PoolEvents
from tests.conftest import WIRE_CLIENT_OPTIONS, Backend

CID = "conv-crowd"


def messages_of(turn_id: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"question of {turn_id}"},
        {
            "role": "assistant",
            "content": f"answer to {turn_id}",
            "token_usage": {"input_tokens": 3, "output_tokens": 5},
        },
    ]


@dataclass
class Ledger:
    """What the writers were told: acknowledged turns, in each writer's order."""

    acknowledged: dict[str, LoggedTurn] = field(default_factory=dict)
    order: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    replays: int = 0

    def note(self, writer: str, logged: LoggedTurn) -> None:
        earlier = self.acknowledged.get(logged.turn_id)
        if earlier is not None:
            assert [(m.id, m.seq) for m in logged.messages] == [
                (m.id, m.seq) for m in earlier.messages
            ], f"turn {logged.turn_id} acknowledged twice with different messages"
        else:
            self.acknowledged[logged.turn_id] = logged
            self.order[writer].append(logged.turn_id)
        self.replays += logged.replayed


async def check(db: Any, ledger: Ledger) -> None:
    """The invariants, from the stored documents alone."""
    stored = await db[MESSAGES].find({"conversation_id": CID}).sort("seq", 1).to_list(None)
    conversation = await db[CONVERSATIONS].find_one({"_id": CID})
    assert conversation is not None
    assert [m["seq"] for m in stored] == list(range(len(stored))), "holes or duplicated seq"
    assert len({m["_id"] for m in stored}) == len(stored)
    by_turn: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for message in stored:
        by_turn[message["turn_id"]].append(message)
    for turn_id, messages in by_turn.items():
        seqs = [m["seq"] for m in messages]
        assert len(messages) == 2, f"turn {turn_id} has {len(messages)} messages"
        assert seqs[1] == seqs[0] + 1, f"turn {turn_id} split: {seqs}"
        assert messages[0]["content"] == f"question of {turn_id}"
    for turn_id, logged in ledger.acknowledged.items():
        assert [m["_id"] for m in by_turn[turn_id]] == [m.id for m in logged.messages]
    for writer, turns in ledger.order.items():
        firsts = [by_turn[t][0]["seq"] for t in turns]
        assert firsts == sorted(firsts), f"{writer}'s turns out of order"
    assert conversation["message_count"] == len(stored)
    assert conversation["turn_count"] == len(by_turn)
    assert conversation["usage"] == {
        "input_tokens": 3 * len(by_turn),
        "output_tokens": 5 * len(by_turn),
    }
    assert conversation["last_message_preview"] == shorten(stored[-1]["content"], 200)


class CrashBeforeInsert(Exception):
    pass


def crashing(logger: AgentMessageLogger, turn_id: str) -> None:
    """The logger's process dies between the two writes of `turn_id` (once)."""
    real = logger._store

    async def store(plan: Any, *rest: Any) -> Any:
        if plan.turn_id == turn_id:
            raise CrashBeforeInsert
        return await real(plan, *rest)

    logger._store = store  # type: ignore[method-assign]


async def test_many_writers_with_concurrent_and_late_retries_store_each_turn_once(
    backend: Backend,
) -> None:
    await AgentMessageLogger(backend.db).ensure_indexes()
    ledger = Ledger()
    rng = random.Random(7)

    async def writer(number: int) -> None:
        logger = AgentMessageLogger(backend.db)
        name = f"w{number}"
        if number == 0:
            crashing(logger, "w0-t0")
        for turn in range(3):
            turn_id = f"{name}-t{turn}"
            await asyncio.sleep(rng.random() / 100)
            try:
                attempt = logger.log_messages(CID, messages_of(turn_id), turn_id=turn_id)
                if rng.random() < 0.3:  # a retry sent while the first attempt is in flight
                    first, second = await asyncio.gather(
                        attempt, logger.log_messages(CID, messages_of(turn_id), turn_id=turn_id)
                    )
                    ledger.note(name, first)
                    ledger.note(name, second)
                else:
                    ledger.note(name, await attempt)
            except CrashBeforeInsert:
                pass  # retried long after, below

    await asyncio.gather(*(writer(n) for n in range(20)))
    late = AgentMessageLogger(backend.db)
    for n in range(66):  # more than 64 later turns, then the late retries
        ledger.note(
            "late", await late.log_messages(CID, messages_of(f"late-{n}"), turn_id=f"late-{n}")
        )
    for turn_id in ("w0-t0", "w1-t0", "w5-t1", "w19-t2"):
        retried = await late.log_messages(CID, messages_of(turn_id), turn_id=turn_id)
        ledger.note("late retries", retried)
        assert retried.replayed

    await check(backend.db, ledger)
    assert len(ledger.acknowledged) == 20 * 3 + 66


@pytest.mark.wire
async def test_writers_behind_a_network_that_drops_connections_lose_nothing_and_double_nothing(
    wire_uri: str,
) -> None:
    upstream = wire_uri.removeprefix("mongodb://").split("/")[0]
    proxy = FaultyProxy(upstream, drop_rate=0.08, seed=11)
    uri = await proxy.start()
    db_name = "faulty_network"
    clients = [
        AsyncMongoClient(
            uri,
            tz_aware=True,
            serverSelectionTimeoutMS=3000,
            connectTimeoutMS=3000,
            **WIRE_CLIENT_OPTIONS,
        )
        for _ in range(4)
    ]
    direct: AsyncMongoClient[Any] = AsyncMongoClient(wire_uri, tz_aware=True)
    ledger = Ledger()
    policy = RetryPolicy(attempts=10, first_delay=0.2, max_delay=2.0)
    given_up: list[str] = []
    try:
        await AgentMessageLogger(direct[db_name]).ensure_indexes()

        async def writer(number: int) -> None:
            logger = AgentMessageLogger(clients[number % len(clients)][db_name])
            for turn in range(5):
                turn_id = f"w{number}-t{turn}"
                try:
                    logged = await with_retries(
                        partial(logger.log_messages, CID, messages_of(turn_id), turn_id=turn_id),
                        policy=policy,
                        rng=random.Random(number * 100 + turn),
                    )
                except StorageUnavailable:
                    given_up.append(turn_id)
                    continue
                ledger.note(f"w{number}", logged)

        await asyncio.gather(*(writer(n) for n in range(8)))
        # Every turn given up on is retried once the network is healthy: it must converge.
        healthy = AgentMessageLogger(direct[db_name])
        for turn_id in given_up:
            retried = await healthy.log_messages(CID, messages_of(turn_id), turn_id=turn_id)
            ledger.note("after the outage", retried)

        await check(direct[db_name], ledger)
        assert len(ledger.acknowledged) == 8 * 5
        # Each kind of drop happened, or the test proves nothing.
        assert set(proxy.dropped) == {"before", "during", "after"}, proxy.dropped
    finally:
        await direct.drop_database(db_name)
        for client in [*clients, direct]:
            await client.close()
        await proxy.close()


async def test_past_the_kept_records_a_turn_sent_twice_at_once_is_stored_and_counted_once(
    wire_backend: Backend,
) -> None:
    """RELIABILITY.md: the same turn logged twice at the same moment is stored once, counted
    once, and both senders are answered with it. With 4 turn records kept and 30 writers,
    more than 4 turns often reserve between the two sends' reservations: the second no longer
    sees the first's record and reserves a block of its own, which it gives back once it
    meets the turn stored (a gap no turn holds, passed at once)."""
    db = wire_backend.db
    rules = TurnRules(turns_recorded=4)
    await AgentMessageLogger(db).ensure_indexes()
    ledger = Ledger()

    async def writer(number: int) -> None:
        logger = AgentMessageLogger(db, rules=rules)
        for turn in range(3):
            turn_id = f"w{number}-t{turn}"
            sent = (logger.log_messages(CID, messages_of(turn_id), turn_id=turn_id) for _ in "ab")
            for logged in await asyncio.gather(*sent):
                ledger.note(f"w{number}", logged)

    await asyncio.gather(*(writer(n) for n in range(30)))

    stored = await db[MESSAGES].find({"conversation_id": CID}).sort("seq", 1).to_list(None)
    conversation = await db[CONVERSATIONS].find_one({"_id": CID})
    assert len(stored) == 2 * len(ledger.acknowledged) == 180
    seqs, gaps = [m["seq"] for m in stored], list(conversation.get("popped_seqs") or ())
    assert not set(seqs) & set(gaps)
    holes = set(range(conversation["message_count"])) - {*seqs, *gaps}
    # The newest POPPED_SEQS_KEPT gaps are remembered; an older one is passed as an abandoned
    # block is, `abandon_after` after its turn reserved.
    assert not holes or len(gaps) == POPPED_SEQS_KEPT, sorted(holes)
    assert conversation["turn_count"] == 90
    assert conversation["usage"] == {"input_tokens": 3 * 90, "output_tokens": 5 * 90}
    for turn_id, logged in ledger.acknowledged.items():
        assert [(m.id, m.seq) for m in logged.messages] == [
            (m["_id"], m["seq"]) for m in stored if m["turn_id"] == turn_id
        ]


@pytest.mark.wire
async def test_a_busy_client_built_the_products_way_recovers_from_one_dropped_connection(
    wire_uri: str,
) -> None:
    """RELIABILITY.md: one connection dropped under 20 concurrent writers, and no drop after it.
    Each writer's failed write waits for the pool to be ready again, then is sent again. The
    product's client clears its pool for the drop and then recovers (was, with PyMongo's
    retryable writes on: a retried write's checkout of the paused pool cleared it again, as
    long as the load lasted: hundreds of clears, hundreds of failed writes)."""
    upstream = wire_uri.removeprefix("mongodb://").split("/")[0]
    proxy = FaultyProxy(upstream)
    uri = await proxy.start()
    pool = PoolEvents()
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        uri, serverSelectionTimeoutMS=10_000, event_listeners=[pool], **client_options(uri)
    )
    counter = client["pool_recovery"]["counter"]
    failed: list[str] = []

    async def write_until_done() -> None:
        while True:
            try:
                await counter.find_one_and_update({"_id": 0}, {"$inc": {"n": 1}}, upsert=True)
                return
            except PyMongoError as error:
                failed.append(str(error)[:60])
                await asyncio.wait_for(pool.ready.wait(), timeout=60)

    async def writer(number: int) -> None:
        for write in range(25):
            if number == 0 and write == 5:
                proxy.drop_next("findAndModify")
            await write_until_done()

    try:
        await counter.insert_one({"_id": 0, "n": 0})
        await asyncio.gather(*(writer(n) for n in range(20)))
        assert sum(proxy.dropped.values()) == 1, proxy.dropped
        assert pool.cleared <= 2, (pool.cleared, len(failed))
        assert len(failed) <= 40, Counter(failed)
    finally:
        await client.drop_database("pool_recovery")
        await client.close()
        await proxy.close()
