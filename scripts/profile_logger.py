"""Where the logger's client CPU goes: a split per turn, and a pyinstrument profile.

`python -m scripts.profile_logger [--latency MS] [--turns N] [--size M]` logs turns
through the latency proxy in front of the embedded wire server (the benchmark's
deployment) with the client CPU split three ways: planning (`plan_turn`: validation,
documents, digests; pure), the rest of our code (the reservation's pipeline, the
stored messages, the glue) and the driver (inside PyMongo, `scripts.driver_clock`).
It then logs the same turns on a database that answers at once (no driver, no
network): back to back, and with a pause before each turn (the process sleeps, as
it does while it waits for a database, and other processes run): the same code
costs more after a wait, its caches cold. Last, a pyinstrument call tree of the
back-to-back run.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from agent_store import AgentMessageLogger
from agent_store.store import _logger as logger_module
from scripts.bench_contenders import prepare_workload, write_contender
from scripts.bench_measure import Deployment, connect
from scripts.corpus import Conversation, Corpus


class PlanClock:
    """Thread CPU spent in `plan_turn` while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original: Callable[..., Any] = logger_module.plan_turn

    def __enter__(self) -> PlanClock:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return self._original(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - started

        logger_module.plan_turn = timed  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        logger_module.plan_turn = self._original


def _added(expression: Any) -> int:
    """The amount a reservation adds to `message_count`, however the sum is wrapped."""
    if isinstance(expression, dict):
        if "$add" in expression:
            return int(expression["$add"][1])
        return _added(next(iter(expression.values())))
    raise ValueError(f"no $add in {expression!r}")


class _Answering:
    """A collection that answers the logger's two commands at once."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    async def find_one_and_update(self, query: Any, pipeline: Any, **_: Any) -> dict[str, Any]:
        added = _added(pipeline[0]["$set"]["message_count"])
        count = self.counts[query["_id"]] = self.counts.get(query["_id"], 0) + added
        now = datetime.now(UTC)  # a whole summary, for versions of the logger that read it
        return {
            "_id": query["_id"],
            "conversation_id": query["_id"],
            "message_count": count,
            "user_id": "u-1",
            "created_at": now,
            "updated_at": now,
        }

    async def insert_many(self, documents: Any, **_: Any) -> None:
        return None


class _AnsweringDatabase(dict[str, _Answering]):
    def __missing__(self, name: str) -> _Answering:
        self[name] = _Answering()
        return self[name]


async def on_the_wire(deployment: Deployment, conversation: Conversation) -> dict[str, float]:
    workload = await prepare_workload([conversation])
    turns = len(conversation.turns)
    async with (
        connect(deployment) as clients,
        write_contender(
            "logger", clients.async_client, clients.sync_client, workload, "profile_logger"
        ) as step,
    ):
        await step(0, 0)  # the conversation exists; every timed turn is alike
        clock = clients.meter.clock
        assert clock is not None
        with PlanClock() as plan:
            clock.reset()
            started = time.process_time()
            for t in range(1, turns):
                await step(0, t)
            total = time.process_time() - started
            driver = clock.seconds
    per = 1e6 / (turns - 1)
    return {
        "plan": plan.seconds * per,
        "rest of ours": (total - driver - plan.seconds) * per,
        "driver": driver * per,
        "total": total * per,
    }


async def answered_at_once(
    conversation: Conversation, profile: bool = False, pause: float = 0.0
) -> dict[str, float]:
    """Log the turns on a database that answers at once. With `pause`, the process sleeps
    that long before each turn (as it waits for a database), and only the turns are timed."""
    logger = AgentMessageLogger(_AnsweringDatabase())
    inputs = copy.deepcopy(conversation)
    profiler = None
    if profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0001, async_mode="disabled")
        profiler.start()
    total = 0.0
    with PlanClock() as plan:
        for turn_id, messages in inputs.turns:
            if pause:
                await asyncio.sleep(pause)
            started = time.process_time()
            await logger.log_messages(
                inputs.conversation_id, messages, user_id="u-1", turn_id=turn_id
            )
            total += time.process_time() - started
    if profiler is not None:
        profiler.stop()
        print(profiler.output_text(unicode=True, color=False))
    per = 1e6 / len(inputs.turns)
    return {"plan": plan.seconds * per, "rest of ours": (total - plan.seconds) * per}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=1.0, help="round-trip ms added")
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--size", type=int, default=4, help="messages per turn")
    parser.add_argument("--pause", type=float, default=2.0, help="ms slept before each turn")
    parser.add_argument(
        "--at-once-only", action="store_true", help="skip the wire (any version of the logger)"
    )
    args = parser.parse_args(argv)
    conversation = Corpus(seed=31).conversation_of_turn_size(args.turns, args.size)
    wire: dict[str, float] = {}
    if not args.at_once_only:
        deployment = Deployment("wire")
        deployment.proxy.latency_ms = args.latency
        try:
            wire = asyncio.run(on_the_wire(deployment, conversation))
        finally:
            deployment.close()

    def best(pause: float) -> dict[str, float]:
        runs = [asyncio.run(answered_at_once(conversation, pause=pause)) for _ in range(7)]
        return min(runs, key=lambda r: r["plan"] + r["rest of ours"])

    quiet, paused = best(0.0), best(args.pause / 1e3)
    asyncio.run(answered_at_once(conversation, profile=True))
    print(
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC — {args.turns - 1} turns of {args.size} messages,"
        f" {args.latency:g} ms round trips; client CPU per turn (µs):"
    )
    pause_title = f"at once, {args.pause:g} ms pauses"
    print(f"  {'':<14}{'wire + proxy':>14}{'answered at once':>18}{pause_title:>28}")
    for name in ("plan", "rest of ours", "driver", "total"):
        shown = [f"{r[name]:.0f}" if name in r else "—" for r in (quiet, paused)]
        on_wire = f"{wire[name]:.0f}" if name in wire else "—"
        print(f"  {name:<14}{on_wire:>14}{shown[0]:>18}{shown[1]:>28}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
