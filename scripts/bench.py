"""Benchmark: this store against a raw driver and langchain-mongodb, on the same backend and turns.

Run `make bench` (or `python -m scripts.bench --help`). For each backend it measures:

writes  — the same turns stored by
          * `logger`     AgentMessageLogger.log_messages (validation, reservation, insert);
          * `raw`        one `insert_many` per turn of the very documents the logger stores;
          * `langchain`  langchain-mongodb's MongoDBChatMessageHistory.add_messages, which is
                         synchronous PyMongo and sends one insert_one per message.
reads   — one long transcript read by
          * `transcript` ConversationStore.transcript (find by seq, validated into models);
          * `raw find`   the same find with the same cursor options, documents left as dicts;
          * `legacy`     the old path: turn documents by time, exploded and re-ordered;
          * `langchain`  MongoDBChatMessageHistory.messages of the same messages.

Figures per contender: wall time (median over repetitions, contenders interleaved and
rotated in every repetition), database round trips (commands seen by a
pymongo CommandListener; wire backends only) and client CPU per message
(`time.process_time()` of this process). On the wire backend the database is a
separate process, so that CPU is the client's alone: our code, the driver and
the event loop. On mongomock the database runs inside this process and its
CPU is included; nothing is subtracted.

On MONGODB_URI it creates and drops databases named `bench_*`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pymongo import AsyncMongoClient, MongoClient, monitoring

from agent_store import AgentMessageLogger, ConversationStore
from agent_store.legacy import legacy_turn_document
from agent_store.store import create_indexes
from scripts.corpus import Conversation, Corpus
from scripts.legacy_turns import LEGACY_COLLECTION, read_legacy_transcript
from scripts.wire_server import start_wire_server

GOAL_ROUND_TRIPS = 2
GOAL_WRITE_RATIO = 1.25
GOAL_READ_RATIO = 1.2
DEFAULT_OUT = Path("bench-results/bench.json")
METHOD = (
    "Method: every contender stores the same turns on the same backend, each repetition in a\n"
    "fresh database with the store's indexes; contenders are interleaved and their order\n"
    "rotates every repetition, after one unrecorded warm-up. Wall time is the median over\n"
    "repetitions; ratios are medians of per-repetition ratios. Round trips are commands\n"
    "seen by a pymongo CommandListener. CPU is time.process_time() of this process per\n"
    "message: on the wire backend the database is another process, so it is the client's\n"
    "alone (our code, the driver, the event loop); on mongomock the database runs in this\n"
    "process and its CPU is included, nothing subtracted. langchain-mongodb is synchronous\n"
    "PyMongo; it runs as it is, blocking the event loop, as it would in an async service."
)


class CommandCounter(monitoring.CommandListener):
    """Counts commands sent to the server: one per round trip."""

    _ignored = frozenset({"hello", "ismaster", "isMaster", "ping", "endSessions", "buildInfo"})

    def __init__(self) -> None:
        self.count = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name not in self._ignored:
            self.count += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@dataclass
class Backend:
    name: str
    async_client: Any
    sync_client: Any
    counter: CommandCounter | None
    """None where there is no wire to count on (mongomock)."""
    database_in_process: bool


@dataclass
class Sample:
    wall: float
    cpu: float
    round_trips: int | None


@dataclass
class Figures:
    contender: str
    unit: str
    """What one `per` is: a turn for writes, a read for reads."""
    units: int
    messages: int
    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        walls = [s.wall for s in self.samples]
        cpus = [s.cpu for s in self.samples]
        trips = [s.round_trips for s in self.samples]
        median_wall = statistics.median(walls)
        return {
            "contender": self.contender,
            "unit": self.unit,
            "units_per_repetition": self.units,
            "messages_per_repetition": self.messages,
            "repetitions": len(walls),
            "wall_ms_per_unit_median": median_wall / self.units * 1e3,
            "wall_ms_per_unit_min": min(walls) / self.units * 1e3,
            "wall_ms_per_unit_max": max(walls) / self.units * 1e3,
            "spread_pct": (max(walls) - min(walls)) / median_wall * 100,
            "cpu_us_per_message_median": statistics.median(cpus) / self.messages * 1e6,
            "round_trips_per_unit": (
                None if trips[0] is None else statistics.median(t or 0 for t in trips) / self.units
            ),
        }


# -- contenders ------------------------------------------------------------------------


def to_langchain(messages: list[dict[str, Any]]) -> list[Any]:
    """The same turn as langchain messages, everything our documents hold carried over."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    converted: list[Any] = []
    for m in messages:
        extra = {k: m[k] for k in ("upload", "hitl_action", "error") if m.get(k)}
        meta = {"created_at": m["created_at"].isoformat(), "latency_ms": m.get("latency_ms")}
        if m["role"] == "user":
            converted.append(HumanMessage(m["content"] or "", additional_kwargs=extra))
        elif m["role"] == "system":
            converted.append(SystemMessage(m["content"] or ""))
        elif m["role"] == "tool":
            converted.append(ToolMessage(m["content"] or "", tool_call_id=m["tool_call_id"]))
        else:
            usage = m.get("token_usage")
            converted.append(
                AIMessage(
                    m["content"] or "",
                    tool_calls=[
                        {
                            "name": c["function"]["name"],
                            "args": json.loads(c["function"]["arguments"]),
                            "id": c["id"],
                        }
                        for c in m.get("tool_calls") or ()
                    ],
                    usage_metadata=usage
                    and {**usage, "total_tokens": usage["input_tokens"] + usage["output_tokens"]},
                    additional_kwargs=extra,
                    response_metadata=meta,
                )
            )
    return converted


def langchain_history(backend: Backend, db_name: str, session_id: str) -> Any:
    from langchain_mongodb import MongoDBChatMessageHistory

    return MongoDBChatMessageHistory(
        None, session_id, database_name=db_name, client=backend.sync_client
    )


@dataclass
class Workload:
    """The turns every contender stores, in each contender's input form."""

    conversations: list[Conversation]
    stored: dict[str, list[list[dict[str, Any]]]]
    """Per conversation, per turn: the documents the logger stored (the raw driver's input)."""
    langchain: dict[str, list[list[Any]]]

    @property
    def turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def messages(self) -> int:
        return sum(c.message_count for c in self.conversations)


async def prepare_workload(conversations: list[Conversation]) -> Workload:
    """Log the turns once on a scratch in-process database to learn the stored documents."""
    from mongomock_motor import AsyncMongoMockClient

    stored: dict[str, list[list[dict[str, Any]]]] = {}
    for conversation in conversations:
        logger = AgentMessageLogger(AsyncMongoMockClient(tz_aware=True)["scratch"])
        stored[conversation.conversation_id] = [
            [
                m.model_dump(by_alias=True)
                for m in (
                    await logger.log_messages(
                        conversation.conversation_id,
                        copy.deepcopy(messages),
                        user_id=conversation.user_id,
                        turn_id=turn_id,
                    )
                ).messages
            ]
            for turn_id, messages in conversation.turns
        ]
    return Workload(
        conversations,
        stored,
        {cid: [to_langchain(turn) for turn in turns] for cid, turns in stored.items()},
    )


WriteStep = Callable[[int, int], Awaitable[None]]
"""Store turn `t` of conversation `c`: step(c, t)."""


@contextlib.asynccontextmanager
async def write_contender(
    name: str, backend: Backend, workload: Workload, db_name: str
) -> AsyncIterator[WriteStep]:
    """Set up one contender on a fresh database (untimed); yield its per-turn step."""
    db = backend.async_client[db_name]
    await create_indexes(db)
    inputs = copy.deepcopy(workload)  # no contender sees objects another one touched
    try:
        if name == "logger":
            logger = AgentMessageLogger(db)
            await logger.ensure_indexes()

            async def step(c: int, t: int) -> None:
                conversation = inputs.conversations[c]
                turn_id, messages = conversation.turns[t]
                await logger.log_messages(
                    conversation.conversation_id,
                    messages,
                    user_id=conversation.user_id,
                    turn_id=turn_id,
                )

        elif name == "raw":
            collection = db["agent_messages"]

            async def step(c: int, t: int) -> None:
                documents = inputs.stored[inputs.conversations[c].conversation_id][t]
                await collection.insert_many(documents, ordered=False)

        elif name == "langchain":
            histories = {
                c.conversation_id: langchain_history(backend, db_name, c.conversation_id)
                for c in inputs.conversations
            }

            async def step(c: int, t: int) -> None:
                cid = inputs.conversations[c].conversation_id
                histories[cid].add_messages(inputs.langchain[cid][t])

        else:
            raise ValueError(name)
        yield step
    finally:
        await backend.async_client.drop_database(db_name)


async def measure(backend: Backend, run: Callable[[], Awaitable[None]]) -> Sample:
    if backend.counter:
        backend.counter.count = 0
    cpu, wall = time.process_time(), time.perf_counter()
    await run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return Sample(wall, cpu, backend.counter.count if backend.counter else None)


async def bench_writes(
    backend: Backend, workload: Workload, repetitions: int, tag: str
) -> list[Figures]:
    names = ["logger", "raw", "langchain"]
    figures = {n: Figures(n, "turn", workload.turns, workload.messages) for n in names}
    for repetition in range(-1, repetitions):  # -1: warm-up, not recorded
        order = names[repetition % len(names) :] + names[: repetition % len(names)]
        for name in order:
            db_name = f"bench_{tag}_{name}_{repetition + 1}"
            async with write_contender(name, backend, workload, db_name) as step:

                async def run(step: WriteStep = step) -> None:
                    for c, conversation in enumerate(workload.conversations):
                        for t in range(len(conversation.turns)):
                            await step(c, t)

                sample = await measure(backend, run)
            if repetition >= 0:
                figures[name].samples.append(sample)
    return list(figures.values())


async def load_read_fixture(backend: Backend, conversation: Conversation, db_name: str) -> Any:
    """Store one long conversation three ways: messages, legacy turns, langchain's documents."""
    from langchain_core.messages import message_to_dict

    db = backend.async_client[db_name]
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
    await db[LEGACY_COLLECTION].create_index([("conversation_id", 1), ("created_at", 1)])
    await db[LEGACY_COLLECTION].insert_many(legacy_turns)
    history = langchain_history(backend, db_name, conversation.conversation_id)
    history.collection.insert_many(langchain_docs)
    return db, history


def same_transcript(a: list[Any], b: list[Any]) -> bool:
    """Role, text and tool pairing agree (legacy turns keep no per-message usage or time)."""

    def key(m: Any) -> tuple[Any, ...]:
        calls = tuple(c.id for c in m.tool_calls or ())
        return (m.role, m.content, m.tool_call_id, calls, m.hitl_action, m.error, m.upload)

    return [key(m) for m in a] == [key(m) for m in b]


async def bench_reads(
    backend: Backend, conversation: Conversation, repetitions: int, tag: str
) -> tuple[list[Figures], dict[str, Any]]:
    db_name = f"bench_{tag}_read"
    db, history = await load_read_fixture(backend, conversation, db_name)
    store = ConversationStore(db)
    cid = conversation.conversation_id
    count = conversation.message_count
    results: dict[str, Any] = {}

    async def transcript() -> None:
        results["transcript"] = await store.transcript(cid)

    async def raw_find() -> None:
        results["raw find"] = await (
            db["agent_messages"]
            .find({"conversation_id": cid})
            .sort("seq", 1)
            .limit(10_000)
            .batch_size(10_000)
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
    figures = {n: Figures(n, "read", 1, count) for n in names}
    try:
        for repetition in range(-1, repetitions):
            order = names[repetition % len(names) :] + names[: repetition % len(names)]
            for name in order:
                sample = await measure(backend, readers[name])
                if repetition >= 0:
                    figures[name].samples.append(sample)
        checks = {
            "messages_read": {n: len(results[n]) for n in names},
            "legacy_matches_new": same_transcript(results["legacy"], results["transcript"]),
        }
    finally:
        await backend.async_client.drop_database(db_name)
    return list(figures.values()), checks


# -- backends --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def open_backend(name: str) -> AsyncIterator[Backend]:
    if name == "mongomock":
        import mongomock
        from mongomock_motor import AsyncMongoMockClient

        sync_client = mongomock.MongoClient(tz_aware=True)
        yield Backend(
            name, AsyncMongoMockClient(mock_mongo_client=sync_client), sync_client, None, True
        )
        return
    server = None
    if name == "wire":
        server, uri = start_wire_server()
    else:
        uri = os.environ["MONGODB_URI"]
    counter = CommandCounter()
    async_client: Any = AsyncMongoClient(uri, tz_aware=True, event_listeners=[counter])
    sync_client: Any = MongoClient(uri, tz_aware=True, event_listeners=[counter])
    try:
        yield Backend(name, async_client, sync_client, counter, False)
    finally:
        await async_client.close()
        sync_client.close()
        if server is not None:
            assert server.stdin is not None
            server.stdin.close()
            server.wait(30)


@dataclass(frozen=True)
class Sizes:
    conversations: int
    turns_per_conversation: int
    repetitions: int
    read_repetitions: int
    transcript_messages: int


def default_sizes(backend: str, args: argparse.Namespace) -> Sizes:
    # mongoeco scans a collection on every insert: its sizes stay small.
    small = backend == "wire"
    return Sizes(
        conversations=args.conversations or (2 if small else 8),
        turns_per_conversation=args.turns or (3 if small else 5),
        repetitions=args.repetitions or (7 if small else 9),
        read_repetitions=args.read_repetitions or 15,
        transcript_messages=args.transcript_messages,
    )


async def run_backend(name: str, sizes: Sizes) -> dict[str, Any]:
    corpus = Corpus(seed=11)
    conversations = [
        corpus.conversation(sizes.turns_per_conversation) for _ in range(sizes.conversations)
    ]
    workload = await prepare_workload(conversations)
    long_conversation = corpus.conversation_of_size(sizes.transcript_messages)
    load_before = os.getloadavg()
    started = time.perf_counter()
    async with open_backend(name) as backend:
        writes = await bench_writes(backend, workload, sizes.repetitions, name)
        reads, checks = await bench_reads(backend, long_conversation, sizes.read_repetitions, name)
        in_process = backend.database_in_process
    return {
        "backend": name,
        "database_in_process": in_process,
        "sizes": asdict(sizes),
        "seconds": round(time.perf_counter() - started, 1),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "writes": [f.summary() for f in writes],
        "write_ratio_logger_vs_raw": paired_ratio(writes, "logger", "raw"),
        "reads": [f.summary() for f in reads],
        "read_ratio_transcript_vs_raw_find": paired_ratio(reads, "transcript", "raw find"),
        "read_ratio_legacy_vs_transcript": paired_ratio(reads, "legacy", "transcript"),
        "read_checks": checks,
    }


def paired_ratio(figures: list[Figures], numerator: str, denominator: str) -> dict[str, float]:
    """Per repetition (both measured back to back), numerator / denominator."""
    by_name = {f.contender: f for f in figures}
    ratios = [
        a.wall / b.wall
        for a, b in zip(by_name[numerator].samples, by_name[denominator].samples, strict=True)
    ]
    return {
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }


# -- report ----------------------------------------------------------------------------


def goals(result: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    writes = {w["contender"]: w for w in result["writes"]}
    trips = writes["logger"]["round_trips_per_unit"]
    write_ratio = result["write_ratio_logger_vs_raw"]["median"]
    read_ratio = result["read_ratio_transcript_vs_raw_find"]["median"]
    return [
        (
            f"round trips per turn ≤ {GOAL_ROUND_TRIPS}",
            "not countable in-process" if trips is None else f"{trips:g}",
            None if trips is None else trips <= GOAL_ROUND_TRIPS,
        ),
        (
            f"logger wall ≤ {GOAL_WRITE_RATIO}x raw insert_many",
            f"{write_ratio:.3f}x",
            write_ratio <= GOAL_WRITE_RATIO,
        ),
        (
            f"transcript ≤ {GOAL_READ_RATIO}x raw find",
            f"{read_ratio:.3f}x",
            read_ratio <= GOAL_READ_RATIO,
        ),
    ]


def print_report(result: dict[str, Any]) -> None:
    sizes = result["sizes"]
    print(
        f"\n== {result['backend']} — {sizes['conversations']} conversations x "
        f"{sizes['turns_per_conversation']} turns, {sizes['repetitions']} write and "
        f"{sizes['read_repetitions']} read repetitions (+1 warm-up), {result['seconds']} s; "
        "load average "
        f"{result['load_average_before'][0]:.2f} → {result['load_average_after'][0]:.2f}"
    )
    if result["database_in_process"]:
        print("   (database in this process: CPU figures include mongomock's own work)")
    header = (
        f"   {'contender':<12}{'ms/unit':>10}{'min-max':>16}{'spread':>8}{'trips':>7}"
        f"{'CPU us/msg':>12}"
    )
    for title, rows in (
        ("writes (unit: one turn)", result["writes"]),
        ("reads (unit: one transcript)", result["reads"]),
    ):
        print(f"  {title}, {rows[0]['messages_per_repetition']} messages per repetition")
        print(header)
        for row in rows:
            trips = row["round_trips_per_unit"]
            print(
                f"   {row['contender']:<12}{row['wall_ms_per_unit_median']:>10.2f}"
                f"{row['wall_ms_per_unit_min']:>8.2f}-{row['wall_ms_per_unit_max']:<7.2f}"
                f"{row['spread_pct']:>7.0f}%{'—' if trips is None else f'{trips:.2f}':>7}"
                f"{row['cpu_us_per_message_median']:>12.0f}"
            )
    for label, key in (
        ("logger / raw (writes)", "write_ratio_logger_vs_raw"),
        ("transcript / raw find", "read_ratio_transcript_vs_raw_find"),
        ("legacy / transcript", "read_ratio_legacy_vs_transcript"),
    ):
        r = result[key]
        print(
            f"  {label:<24} {r['median']:.2f}x (per-repetition range {r['min']:.2f}-{r['max']:.2f})"
        )
    checks = result["read_checks"]
    print(
        f"  messages read: {checks['messages_read']}; legacy path gives the same transcript: "
        f"{checks['legacy_matches_new']}"
    )
    for goal, value, met in goals(result):
        verdict = "n/a" if met is None else ("met" if met else "MISSED")
        print(f"  goal {goal:<42} {value:>10}  {verdict}")


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_backends = ["mongomock", "wire"] + (["uri"] if os.environ.get("MONGODB_URI") else [])
    parser.add_argument(
        "--backends",
        default=",".join(default_backends),
        help="comma-separated: mongomock, wire, uri (default: %(default)s)",
    )
    parser.add_argument("--conversations", type=int, help="conversations written per repetition")
    parser.add_argument("--turns", type=int, help="turns per conversation")
    parser.add_argument("--repetitions", type=int, help="measured repetitions (after a warm-up)")
    parser.add_argument("--read-repetitions", type=int, help="measured transcript reads each")
    parser.add_argument("--transcript-messages", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    print(METHOD)
    results = []
    for name in args.backends.split(","):
        result = await run_backend(name, default_sizes(name, args))
        print_report(result)
        results.append(result)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "method": __doc__,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
