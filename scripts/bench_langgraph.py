"""Benchmark: the LangGraph checkpointer on this store beside langgraph-checkpoint-mongodb.

Run `make bench-langgraph` (or `python -m scripts.bench_langgraph --help`). Both savers keep
the same tool agent (scripts/langgraph_agent.py: `StateGraph(MessagesState)`, a `ToolNode`,
a scripted model) for `--turns` turns on one thread, on the same backend: the embedded wire
server, in memory, in a process of its own. Per turn it records

* saver CPU: the CPU time spent in the saver's own calls (`aget_tuple`, `aput`,
  `aput_writes`) and the driver work they do; ours are coroutines, timed step by step while
  they run (`time.thread_time()`), the peer's are synchronous PyMongo run in executor
  threads, timed per call in their thread;
* client CPU: `time.process_time()` of this process for the whole turn (the graph, the
  scripted model, the saver, the driver); the database is another process;
* bytes written: the BSON size of every write command sent (insert, update,
  findAndModify, delete), from a pymongo CommandListener;
* round trips: the commands sent.

The contenders' turns are interleaved, turn by turn, so the machine's other load falls on
both alike. It prints each figure as the mean of the ten turns ending at `--early` and at
the last turn (each window holds five tool turns and five direct answers), their ratio, and
LangGraph's conformance suite result for both savers on the same server. The JSON output
(`--out`) also holds every turn's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bson import encode
from pymongo import AsyncMongoClient, MongoClient, monitoring

from agent_store.integrations.langgraph import AgentStoreSaver
from scripts.langgraph_agent import question, tool_agent
from scripts.wire_server import start_wire_server

WRITES = frozenset({"insert", "update", "findAndModify", "delete"})
IGNORED = frozenset({"hello", "ismaster", "isMaster", "ping", "endSessions", "buildInfo"})
WINDOW = 10
DEFAULT_OUT = Path("bench-results/bench_langgraph.json")


class Wire(monitoring.CommandListener):
    """Counts the commands a client sends and the bytes of its write commands."""

    def __init__(self) -> None:
        self.commands = 0
        self.written = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in IGNORED:
            return
        self.commands += 1
        if event.command_name in WRITES:
            self.written += len(encode(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@dataclass
class SaverClock:
    """CPU seconds spent inside a saver's calls."""

    seconds: float = 0.0

    def step_timed(self, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """`method`, adding the CPU of each step of its coroutine (not of other tasks)."""

        async def timed(*args: Any, **kwargs: Any) -> Any:
            return await _StepTimed(method(*args, **kwargs).__await__(), self)

        return timed

    def call_timed(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start

        return timed


@dataclass
class _StepTimed:
    inner: Generator[Any, Any, Any]
    clock: SaverClock

    def __await__(self) -> Generator[Any, Any, Any]:
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            start = time.thread_time()
            try:
                yielded = self.inner.throw(thrown) if thrown else self.inner.send(sent)
            except StopIteration as stop:
                self.clock.seconds += time.thread_time() - start
                return stop.value
            self.clock.seconds += time.thread_time() - start
            try:
                sent, thrown = (yield yielded), None
            except BaseException as exc:  # handed to the inner coroutine, as await would
                sent, thrown = None, exc


@dataclass
class Turn:
    saver_cpu_ms: float
    client_cpu_ms: float
    bytes_written: int
    round_trips: int


@dataclass
class Run:
    contender: str
    turns: list[Turn] = field(default_factory=list)

    def window(self, last: int) -> dict[str, float]:
        picked = self.turns[last - WINDOW : last]
        return {
            "saver_cpu_ms": statistics.fmean(t.saver_cpu_ms for t in picked),
            "client_cpu_ms": statistics.fmean(t.client_cpu_ms for t in picked),
            "bytes_written": statistics.fmean(t.bytes_written for t in picked),
            "round_trips": statistics.fmean(t.round_trips for t in picked),
        }


# -- contenders ------------------------------------------------------------------------------


def ours(uri: str, wire: Wire, clock: SaverClock) -> tuple[Any, Callable[[], Awaitable[None]]]:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        uri, tz_aware=True, event_listeners=[wire]
    )
    saver = AgentStoreSaver(client[f"bench_{uuid.uuid4().hex[:8]}"])
    for name in ("aget_tuple", "aput", "aput_writes"):
        setattr(saver, name, clock.step_timed(getattr(saver, name)))
    return saver, client.close


def peer(uri: str, wire: Wire, clock: SaverClock) -> tuple[Any, Callable[[], Awaitable[None]]]:
    from langgraph.checkpoint.mongodb import MongoDBSaver

    client: MongoClient[dict[str, Any]] = MongoClient(uri, event_listeners=[wire])
    saver = MongoDBSaver(client, db_name=f"bench_{uuid.uuid4().hex[:8]}")
    for name in ("get_tuple", "put", "put_writes"):
        setattr(saver, name, clock.call_timed(getattr(saver, name)))

    async def close() -> None:
        client.close()

    return saver, close


CONTENDERS = {"agent_store": ours, "langgraph-checkpoint-mongodb": peer}


@dataclass
class Contender:
    """One saver under measurement, its graph and its thread."""

    result: Run
    graph: Any
    wire: Wire
    clock: SaverClock
    close: Callable[[], Awaitable[None]]
    config: dict[str, Any] = field(
        default_factory=lambda: {"configurable": {"thread_id": f"bench-{uuid.uuid4().hex[:8]}"}}
    )

    async def turn(self, turn: int) -> None:
        commands, written, saver_cpu = self.wire.commands, self.wire.written, self.clock.seconds
        start = time.process_time()
        await self.graph.ainvoke(question(turn), self.config)
        self.result.turns.append(
            Turn(
                saver_cpu_ms=(self.clock.seconds - saver_cpu) * 1e3,
                client_cpu_ms=(time.process_time() - start) * 1e3,
                bytes_written=self.wire.written - written,
                round_trips=self.wire.commands - commands,
            )
        )


async def run(names: list[str], uri: str, turns: int) -> list[Run]:
    """Every contender's turns, interleaved turn by turn (the order rotating), so that the
    machine's other load falls on all of them alike."""
    contenders = []
    for name in names:
        wire, clock = Wire(), SaverClock()
        saver, close = CONTENDERS[name](uri, wire, clock)
        contenders.append(Contender(Run(name), tool_agent(saver), wire, clock, close))
    try:
        for turn in range(1, turns + 1):
            shift = turn % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                await contender.turn(turn)
    finally:
        for contender in contenders:
            await contender.close()
    return [c.result for c in contenders]


# -- conformance -----------------------------------------------------------------------------


async def conformance(uri: str) -> dict[str, dict[str, Any]]:
    from langgraph.checkpoint.conformance import checkpointer_test, validate
    from langgraph.checkpoint.mongodb import MongoDBSaver

    @checkpointer_test(name="agent_store")
    async def agent_store_saver() -> AsyncIterator[Any]:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
        yield AgentStoreSaver(client[f"conformance_{uuid.uuid4().hex[:8]}"])
        await client.close()

    @checkpointer_test(name="langgraph-checkpoint-mongodb")
    async def peer_saver() -> AsyncIterator[Any]:
        client: MongoClient[dict[str, Any]] = MongoClient(uri)
        yield MongoDBSaver(client, db_name=f"conformance_{uuid.uuid4().hex[:8]}")
        client.close()

    results = {}
    for registered in (agent_store_saver, peer_saver):
        report = await validate(registered)
        results[registered.name] = {
            capability: "passed" if r.passed else ("failed" if r.detected else "not implemented")
            for capability, r in sorted(report.results.items())
        }
    return results


# -- report ----------------------------------------------------------------------------------


def report(runs: list[Run], early: int, conformed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"window_turns": WINDOW, "early_turn": early, "contenders": {}}
    print(f"Means over the {WINDOW} turns ending at turn {early} and at the last turn:")
    header = f"{'':30} {'figure':16} {'turn ' + str(early):>12} {'last turn':>12} {'ratio':>7}"
    print(header)
    for result in runs:
        first, last = result.window(early), result.window(len(result.turns))
        summary["contenders"][result.contender] = {
            "early": first,
            "last": last,
            "turns": len(result.turns),
            "per_turn": [vars(turn) for turn in result.turns],
        }
        for figure in first:
            ratio = last[figure] / first[figure] if first[figure] else float("nan")
            print(
                f"{result.contender:30} {figure:16} {first[figure]:12.2f} {last[figure]:12.2f} "
                f"{ratio:7.2f}"
            )
    print("\nLangGraph conformance (langgraph-checkpoint-conformance validate()), same server:")
    for name, capabilities in conformed.items():
        print(f"  {name}: " + ", ".join(f"{c} {r}" for c, r in capabilities.items()))
    summary["conformance"] = conformed
    return summary


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--early", type=int, default=14, help="last turn of the early window")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=CONTENDERS)
    parser.add_argument("--no-conformance", action="store_true")
    args = parser.parse_args()
    server, uri = start_wire_server()
    try:
        runs = await run(list(args.contenders), uri, args.turns)
        conformed = {} if args.no_conformance else await conformance(uri)
        summary = report(runs, args.early, conformed)
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
