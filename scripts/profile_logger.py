"""Where the logger's client time goes: a CPU breakdown per turn and a pyinstrument profile.

`python -m scripts.profile_logger [--backend wire|mongomock|uri]` logs the bench's
turns once more with the logger's three steps timed separately with
`time.process_time()`: planning (validation and document building, pure),
the reservation (`find_one_and_update`) and the insert (`insert_many`). Then it
logs them again under pyinstrument and prints the call tree. On the wire backend
the database is a separate process, so these are client figures only.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from agent_store import AgentMessageLogger
from agent_store.store import _logger as logger_module
from scripts.bench import open_backend, prepare_workload
from scripts.corpus import Corpus


class StepClock:
    """Accumulates process time spent inside named functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def sync(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.process_time() - started

        return timed

    def coroutine(
        self, name: str, function: Callable[..., Awaitable[Any]]
    ) -> Callable[..., Awaitable[Any]]:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return await function(*args, **kwargs)
            finally:
                self.seconds[name] += time.process_time() - started

        return timed


async def log_all(logger: AgentMessageLogger, workload: Any) -> None:
    for conversation in workload.conversations:
        for turn_id, messages in conversation.turns:
            await logger.log_messages(
                conversation.conversation_id,
                messages,
                user_id=conversation.user_id,
                turn_id=turn_id,
            )


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="wire")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args(argv)
    from pyinstrument import Profiler

    corpus = Corpus(seed=11)
    workload = await prepare_workload(
        [corpus.conversation(args.turns) for _ in range(args.conversations)]
    )
    turns, messages = workload.turns, workload.messages
    async with open_backend(args.backend) as backend:
        clock = StepClock()
        db = backend.async_client["profile_steps"]
        logger = AgentMessageLogger(db)
        await logger.ensure_indexes()
        original_plan = logger_module.plan_turn
        logger_module.plan_turn = clock.sync("plan (pure)", original_plan)  # type: ignore[assignment]
        logger._reserve = clock.coroutine("reserve (find_one_and_update)", logger._reserve)  # type: ignore[method-assign]
        logger._insert = clock.coroutine("insert (insert_many)", logger._insert)  # type: ignore[method-assign]
        try:
            started = time.process_time()
            await log_all(logger, workload)
            total = time.process_time() - started
        finally:
            logger_module.plan_turn = original_plan
        await backend.async_client.drop_database("profile_steps")

        print(f"{turns} turns, {messages} messages on {args.backend}; client CPU per turn:")
        for name, seconds in clock.seconds.items():
            print(f"  {name:<32}{seconds / turns * 1e3:>8.2f} ms  ({seconds / total:.0%})")
        print(f"  {'whole log_messages':<32}{total / turns * 1e3:>8.2f} ms")

        db = backend.async_client["profile_tree"]
        logger = AgentMessageLogger(db)
        await logger.ensure_indexes()
        profiler = Profiler(interval=0.0005, async_mode="disabled")
        profiler.start()
        await log_all(logger, workload)
        profiler.stop()
        await backend.async_client.drop_database("profile_tree")
    print(profiler.output_text(unicode=True, color=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
