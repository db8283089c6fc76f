"""What a turn's reservation costs at the limits a turn may reach, on the embedded wire server.

`python -m scripts.reservation_bounds` logs, each on a fresh embedded server (in memory, as
the tests run it) through PyMongo, after a first turn of one message:

- the largest turn allowed (`largest_turn`): 1,000 messages making 10,000 calls, its prompts
  naming the most calls of earlier turns a turn's prompts may (`MAX_TURN_NAMED_CALLS`), the
  rest denying calls no turn made, every id and request id 200 characters;
- turns of 300, 600 and 999 results answering calls no turn made (`answers_turn`);

and prints for each the size of its reservation (the `findAndModify` command, as sent), how
long the server took to answer it, and how long its insert and the whole turn took.

The messages collection has no index unless `--indexes` creates the store's: the embedded
server checks every message it inserts against every message of the collection for the
unique `(conversation_id, seq)` index, which makes a turn of 1,000 messages an insert of a
minute on it (a MongoDB server uses the index); with `--indexes` the insert of a large turn
may pass the driver's timeout, which the script reports.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

import bson
from pymongo import AsyncMongoClient, monitoring

from agent_store import AgentMessageLogger, StorageUnavailable
from agent_store.core import MAX_HELD_CALLS
from agent_store.store import MAX_TURN_NAMED_CALLS, MAX_TURN_TOOL_CALLS

LONGEST = 200
"""The longest id (call, request, turn, message) a turn may carry."""


def long_id(prefix: str, number: int) -> str:
    """An id of the longest length, told apart by `prefix` and `number`."""
    return f"{prefix}{number}-".ljust(LONGEST, "y")


def answers_turn(results: int, prefix: str = "ghost") -> list[dict[str, Any]]:
    """A question and `results` tool results answering calls no turn made."""
    answers = [
        {"role": "tool", "tool_call_id": long_id(prefix, i), "content": "ok"}
        for i in range(results)
    ]
    return [{"role": "user", "content": "results"}, *answers]


def naming_prompts(names: int, prefix: str = "earlier") -> list[dict[str, Any]]:
    """Prompts naming `names` calls of earlier turns in all, `MAX_HELD_CALLS` a prompt (the
    most one may), their request ids of the longest length."""
    prompts = []
    for first in range(0, names, MAX_HELD_CALLS):
        held = [long_id(prefix, i) for i in range(first, min(first + MAX_HELD_CALLS, names))]
        action = {"action": "confirm", "request_id": long_id("r", first), "tool_call_ids": held}
        prompts.append({"role": "assistant", "hitl_action": action})
    return prompts


def largest_turn() -> list[dict[str, Any]]:
    """The largest turn allowed: 1,000 messages, 10,000 calls made (ids of 200 characters,
    names of 256), prompts naming `MAX_TURN_NAMED_CALLS` calls of earlier turns, and the rest
    denials of calls no turn made (a denial's reservation weighs the most of any answer)."""
    each = MAX_TURN_TOOL_CALLS // 10

    def call(m: int, c: int) -> dict[str, Any]:
        return {"id": long_id(f"made{m}-", c), "function": {"name": "n" * 256, "arguments": "{}"}}

    making = [
        {"role": "assistant", "tool_calls": [call(m, c) for c in range(each)]} for m in range(10)
    ]
    prompts = naming_prompts(MAX_TURN_NAMED_CALLS)
    denials = [
        {
            "role": "tool",
            "tool_call_id": long_id("denied", i),
            "content": None,
            "error": {"message": "tool call denied"},
        }
        for i in range(1000 - 1 - len(making) - len(prompts))
    ]
    return [{"role": "user", "content": "everything"}, *making, *prompts, *denials]


class _Commands(monitoring.CommandListener):
    """The size and the server's time of each command sent, by name."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.seen: list[tuple[str, int, float]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.sizes[event.request_id] = len(bson.encode(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        size = self.sizes.pop(event.request_id, 0)
        self.seen.append((event.command_name, size, event.duration_micros / 1e6))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self.succeeded(event)  # type: ignore[arg-type]


async def _measure(label: str, messages: list[dict[str, Any]], *, indexes: bool) -> None:
    from agent_store.embedded import ServerThread

    server = ServerThread()
    listener = _Commands()
    client: Any = AsyncMongoClient(server.start(), tz_aware=True, event_listeners=[listener])
    try:
        logger = AgentMessageLogger(client[f"bounds_{uuid.uuid4().hex[:8]}"])
        if indexes:
            await logger.ensure_indexes()
        await logger.log_messages("c-1", [{"role": "user", "content": "hi"}], turn_id="t-0")
        listener.seen.clear()
        started = time.monotonic()
        outcome = "stored"
        try:
            await logger.log_messages("c-1", messages, turn_id="t-1")
        except StorageUnavailable as exc:
            outcome = f"not answered: {exc}"
        whole = time.monotonic() - started
        reserved = [(s, t) for name, s, t in listener.seen if name == "findAndModify"]
        inserted = sum(t for name, _, t in listener.seen if name == "insert")
        size, took = max(reserved)
        print(
            f"{label}: reservation {size / 2**20:.2f} MiB answered in {took:.2f} s; "
            f"insert {inserted:.1f} s; turn {whole:.1f} s ({outcome})"
        )
    finally:
        await client.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=int, nargs="*", default=[300, 600, 999])
    parser.add_argument("--no-largest", action="store_true", help="leave the largest turn out")
    parser.add_argument("--indexes", action="store_true", help="create the store's indexes")
    args = parser.parse_args(argv)
    if not args.no_largest:
        asyncio.run(_measure("largest turn allowed", largest_turn(), indexes=args.indexes))
    for results in args.results:
        asyncio.run(_measure(f"{results} results", answers_turn(results), indexes=args.indexes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
