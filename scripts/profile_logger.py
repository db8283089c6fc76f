"""Where the logger's client CPU goes: a split per turn, and a pyinstrument profile.

`python -m scripts.profile_logger [--latency MS] [--turns N] [--size M]` logs turns
through the latency proxy in front of the embedded wire server (the benchmark's
deployment) with the client CPU split three ways: planning (`plan_turn`: validation,
documents, digests; pure), the rest of our code (the reservation's pipeline, the
stored messages, the glue) and the driver (inside PyMongo, `scripts.driver_clock`).
It then logs the same turns on a database that answers at once (no driver, no
network) to show what the same code costs without waiting in between, and prints a
pyinstrument call tree of that run.
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


class _Answering:
    """A collection that answers the logger's two commands at once."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    async def find_one_and_update(self, query: Any, pipeline: Any, **_: Any) -> dict[str, Any]:
        added = pipeline[0]["$set"]["message_count"]["$add"][1]
        count = self.counts[query["_id"]] = self.counts.get(query["_id"], 0) + added
        return {"_id": query["_id"], "message_count": count, "user_id": "u-1"}

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


async def answered_at_once(conversation: Conversation, profile: bool) -> dict[str, float]:
    logger = AgentMessageLogger(_AnsweringDatabase())
    inputs = copy.deepcopy(conversation)
    profiler = None
    if profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0001, async_mode="disabled")
        profiler.start()
    with PlanClock() as plan:
        started = time.process_time()
        for turn_id, messages in inputs.turns:
            await logger.log_messages(
                inputs.conversation_id, messages, user_id="u-1", turn_id=turn_id
            )
        total = time.process_time() - started
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
    args = parser.parse_args(argv)
    conversation = Corpus(seed=31).conversation_of_turn_size(args.turns, args.size)
    deployment = Deployment("wire")
    deployment.proxy.latency_ms = args.latency
    try:
        wire = asyncio.run(on_the_wire(deployment, conversation))
    finally:
        deployment.close()
    quiet = min(
        (asyncio.run(answered_at_once(conversation, False)) for _ in range(7)),
        key=lambda r: r["plan"] + r["rest of ours"],
    )
    asyncio.run(answered_at_once(conversation, True))
    print(
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC — {args.turns - 1} turns of {args.size} messages,"
        f" {args.latency:g} ms round trips; client CPU per turn (µs):"
    )
    print(f"  {'':<14}{'wire + proxy':>14}{'answered at once':>18}")
    for name in ("plan", "rest of ours", "driver", "total"):
        at_once = quiet.get(name)
        shown = "—" if at_once is None else f"{at_once:.0f}"
        print(f"  {name:<14}{wire[name]:>14.0f}{shown:>18}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
