"""What a turn's reservation costs the embedded wire server to evaluate, against a plain update.

`python -m scripts.reservation_cost` logs turns of four messages (a question, a call, its
result, an answer) through PyMongo on a fresh embedded server (in memory, as the tests run
it), captures the reservation (`findAndModify` with one update pipeline) of the first turn
(which creates the conversation) and of the 65th (on a document holding 64 turn records),
then replays each `--repeat` times on a copy of the document it met, alternated with a plain
`find_one_and_update` (one `$set`) on the same copy as the control. It prints the pipeline's
BSON size, its stages and its nodes (every key and array element), and the CPU of the whole
process (`time.process_time`, which counts the server's thread) per command, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from typing import Any

import bson
from pymongo import AsyncMongoClient, MongoClient, monitoring

from agent_store import AgentMessageLogger

TURNS_BEFORE = 64
"""The turn records the document holds when the second reservation is captured."""


def nodes(value: Any) -> int:
    """Every key and array element of `value`, nested ones included."""
    if isinstance(value, dict):
        return sum(1 + nodes(item) for item in value.values())
    if isinstance(value, list):
        return sum(1 + nodes(item) for item in value)
    return 0


def turn(number: int) -> list[dict[str, Any]]:
    """A turn of four messages: a question, a call, its result and an answer."""
    call = {"id": f"call-{number}", "function": {"name": "search", "arguments": "{}"}}
    return [
        {"role": "user", "content": f"question {number}"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call-{number}", "content": "found"},
        {"role": "assistant", "content": f"answer {number}"},
    ]


class _Reservations(monitoring.CommandListener):
    """The `findAndModify` commands sent, as sent."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "findAndModify":
            self.sent.append(dict(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


async def _captured(uri: str, database: str) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """The first turn's reservation (on no document) and the 65th's with the document it met."""
    listener = _Reservations()
    client: Any = AsyncMongoClient(uri, tz_aware=True, event_listeners=[listener])
    try:
        db = client[database]
        logger = AgentMessageLogger(db)
        await logger.log_messages("c-1", turn(0), turn_id="t-0")
        first = listener.sent[-1]
        for number in range(1, TURNS_BEFORE):
            await logger.log_messages("c-1", turn(number), turn_id=f"t-{number}")
        met = await db[first["findAndModify"]].find_one({"_id": "c-1"})
        await logger.log_messages("c-1", turn(TURNS_BEFORE), turn_id=f"t-{TURNS_BEFORE}")
        return [(first, None), (listener.sent[-1], met)]
    finally:
        await client.close()


def _replay(
    db: Any, command: dict[str, Any], met: dict[str, Any] | None, repeat: int
) -> tuple[list[float], list[float]]:
    """CPU per reservation and per control, alternated, each on the document `met` again."""
    conversations = db[command["findAndModify"]]
    sent = {k: v for k, v in command.items() if k not in ("lsid", "$db", "$clusterTime")}
    ours: list[float] = []
    control: list[float] = []
    for _ in range(repeat):
        for timed in (ours, control):
            conversations.delete_many({})
            if met is not None:
                conversations.insert_one(met)
            started = time.process_time()
            if timed is ours:
                db.command(sent)
            else:
                conversations.find_one_and_update({"_id": "c-1"}, {"$set": {"x": 1}}, upsert=True)
            timed.append(time.process_time() - started)
    return ours, control


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=40)
    args = parser.parse_args(argv)
    from agent_store.embedded import ServerThread

    with ServerThread() as uri:
        database = f"cost_{uuid.uuid4().hex[:8]}"
        captured = asyncio.run(_captured(uri, database))
        client: Any = MongoClient(uri, tz_aware=True)
        try:
            for label, (command, met) in zip(("fresh", "64 records"), captured, strict=True):
                pipeline = command["update"]
                size = len(bson.encode({"u": pipeline}))
                ours, control = _replay(client[database], command, met, args.repeat)
                mine, plain = statistics.median(ours), statistics.median(control)
                print(
                    f"{label}: pipeline {size:,} B, {len(pipeline)} stages, {nodes(pipeline)} "
                    f"nodes; reservation {mine * 1e3:.2f} ms CPU, plain update "
                    f"{plain * 1e3:.2f} ms, ratio {mine / plain:.1f}x"
                )
        finally:
            client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
