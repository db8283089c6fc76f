"""What the logger's two commands cost the client in PyMongo itself, whoever sends them.

`python -m scripts.driver_floor` sends the reservation (`findAndModify` with an update
pipeline) and the insert of a 4-message turn, prebuilt, to the embedded wire server in
a process of its own, three ways, interleaved turn by turn:

- `async helpers`: `AsyncCollection.find_one_and_update` and `insert_many`, as the
  logger and `make bench`'s `raw two` send them;
- `async command`: the same two commands through `AsyncDatabase.command`, which skips
  the helpers' bulk-write and retryable-write machinery (and with it the driver's one
  automatic retry after a dropped connection);
- `sync helpers`: synchronous PyMongo's `find_one_and_update` and `insert_many`.

It prints, per turn: client CPU (`time.process_time()`; the server's is in its own
process), median and range over the turns, and the asyncio tasks the driver creates
(counted by a task factory: a count, not a timer). Nothing of the store's own code
runs: this is the floor under any code that sends these two commands.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from typing import Any

from bson import Int64
from pymongo import AsyncMongoClient, MongoClient, ReturnDocument

from scripts.wire_server import start_wire_server

_MESSAGES = 4


def _pipeline() -> list[dict[str, Any]]:
    count = {"$add": [{"$ifNull": ["$message_count", 0]}, _MESSAGES]}
    return [{"$set": {"message_count": {"$toLong": count}, "updated_at": datetime.now(UTC)}}]


def _documents(conversation: str, first: int) -> list[dict[str, Any]]:
    now = datetime.now(UTC)
    return [
        {
            "_id": f"{conversation}-{first + i}",
            "conversation_id": conversation,
            "seq": Int64(first + i),
            "role": "user" if i == 0 else "assistant",
            "content": "a sentence of an ordinary length for a chat message " * 4,
            "created_at": now,
            "turn_id": f"{conversation}-turn-{first}",
        }
        for i in range(_MESSAGES)
    ]


class _TaskCount:
    """Counts the tasks created on the running loop while installed."""

    def __init__(self) -> None:
        self.created = 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        def factory(
            loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kwargs: Any
        ) -> asyncio.Task[Any]:
            self.created += 1
            return asyncio.Task(coro, loop=loop, **kwargs)

        loop.set_task_factory(factory)  # type: ignore[arg-type]


def _reservation(conversation: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`find_one_and_update`'s arguments for the reservation, in either API."""
    options = {
        "upsert": True,
        "projection": {"message_count": 1},
        "return_document": ReturnDocument.AFTER,
    }
    return ({"_id": conversation}, _pipeline()), options


def _first_seq(found: dict[str, Any]) -> int:
    return int(found["message_count"]) - _MESSAGES


async def _async_helpers(db: Any, conversation: str) -> None:
    args, options = _reservation(conversation)
    first = _first_seq(await db.conversations.find_one_and_update(*args, **options))
    await db.messages.insert_many(_documents(conversation, first), ordered=False)


async def _async_command(db: Any, conversation: str) -> None:
    reply = await db.command(
        {
            "findAndModify": "conversations",
            "query": {"_id": conversation},
            "update": _pipeline(),
            "upsert": True,
            "fields": {"message_count": 1},
            "new": True,
        }
    )
    first = _first_seq(reply["value"])
    inserted = await db.command(
        {"insert": "messages", "documents": _documents(conversation, first), "ordered": False}
    )
    if inserted.get("writeErrors") or inserted["n"] != _MESSAGES:
        raise RuntimeError(f"insert failed: {inserted}")


def _sync_helpers(db: Any, conversation: str) -> None:
    args, options = _reservation(conversation)
    first = _first_seq(db.conversations.find_one_and_update(*args, **options))
    db.messages.insert_many(_documents(conversation, first), ordered=False)


async def _measure(uri: str, turns: int, warm_up: int) -> dict[str, dict[str, list[float]]]:
    async_client: Any = AsyncMongoClient(uri, tz_aware=True)
    sync_client: Any = MongoClient(uri, tz_aware=True)
    async_db, sync_db = async_client.driver_floor, sync_client.driver_floor
    await async_db.command("ping")
    sync_db.command("ping")
    tasks = _TaskCount()
    tasks.install(asyncio.get_running_loop())

    async def run_sync(db: Any, conversation: str) -> None:
        _sync_helpers(db, conversation)

    ways: dict[str, tuple[Callable[[Any, str], Awaitable[None]], Any]] = {
        "async helpers": (_async_helpers, async_db),
        "async command": (_async_command, async_db),
        "sync helpers": (run_sync, sync_db),
    }
    figures: dict[str, dict[str, list[float]]] = {n: {"cpu": [], "tasks": []} for n in ways}
    names = list(ways)
    try:
        for turn in range(warm_up + turns):
            for name in names[turn % 3 :] + names[: turn % 3]:  # every order in turn
                send, db = ways[name]
                created, started = tasks.created, time.process_time()
                await send(db, f"{name.replace(' ', '-')}-{turn % 20}")
                if turn >= warm_up:
                    figures[name]["cpu"].append(time.process_time() - started)
                    figures[name]["tasks"].append(tasks.created - created)
    finally:
        await async_client.close()
        sync_client.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=600)
    parser.add_argument("--warm-up", type=int, default=30)
    args = parser.parse_args(argv)
    server, uri = start_wire_server()
    try:
        figures = asyncio.run(_measure(uri, args.turns, args.warm_up))
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)
    base = statistics.median(figures["async helpers"]["cpu"])
    print(f"{args.turns} turns of {_MESSAGES} messages, 2 commands each; client CPU per turn:")
    print(f"  {'':<14}{'median µs':>10}{'p10-p90 µs':>16}{'vs helpers':>12}{'tasks':>7}")
    for name, figure in figures.items():
        cpu = sorted(figure["cpu"])
        low, high = cpu[len(cpu) // 10], cpu[len(cpu) * 9 // 10]
        median = statistics.median(cpu)
        print(
            f"  {name:<14}{median * 1e6:>10.0f}{f'{low * 1e6:.0f}-{high * 1e6:.0f}':>16}"
            f"{median / base:>11.2f}x{statistics.median(figure['tasks']):>7.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
