"""How long a runtime should retry: writers behind a network that drops connections.

`python -m scripts.retry_measure` starts the embedded wire server in its own
process, puts `scripts.faulty_proxy.FaultyProxy` in front of it, and lets
writers log turns through it with `agent_store.with_retries`, once per first
delay. It prints, per policy: turns that needed a retry, the attempts the worst
turn needed, turns given up after every attempt, and the wall time. After each
run the store is checked: every acknowledged turn stored once, no hole in `seq`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any

from pymongo import AsyncMongoClient

from agent_store import AgentMessageLogger, RetryPolicy, StorageUnavailable, with_retries
from agent_store.store import CONVERSATIONS, MESSAGES
from scripts.faulty_proxy import FaultyProxy
from scripts.wire_server import start_wire_server


@dataclass
class Outcome:
    first_delay: float
    attempts: Counter[int]
    given_up: int
    seconds: float
    dropped: int
    consistent: bool


def turn(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}, {"role": "assistant", "content": f"re: {text}"}]


async def run(args: argparse.Namespace, upstream: str, first_delay: float, seed: int) -> Outcome:
    proxy = FaultyProxy(upstream, drop_rate=args.drop_rate, seed=seed)
    uri = await proxy.start()
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        uri, tz_aware=True, serverSelectionTimeoutMS=2000, connectTimeoutMS=2000
    )
    direct: AsyncMongoClient[Any] = AsyncMongoClient(f"mongodb://{upstream}/?directConnection=true")
    db_name = f"retry_{seed}"
    policy = RetryPolicy(attempts=args.attempts, first_delay=first_delay)
    attempts: Counter[int] = Counter()
    given_up: list[partial[Any]] = []

    async def writer(number: int) -> None:
        logger = AgentMessageLogger(client[db_name])
        for index in range(args.turns):
            count = 0

            async def attempt(call: partial[Any]) -> Any:
                nonlocal count
                count += 1
                return await call()

            call = partial(logger.log_messages, f"conv-{number % 3}", turn(f"{number}/{index}"),
                           turn_id=f"w{number}-t{index}")  # fmt: skip
            try:
                await with_retries(partial(attempt, call), policy=policy, rng=random.Random(index))
            except StorageUnavailable:
                given_up.append(call)
            attempts[count] += 1

    started = time.perf_counter()
    await asyncio.gather(*(writer(n) for n in range(args.writers)))
    seconds = time.perf_counter() - started
    # What was given up is logged again once the network is healthy, as an outbox would.
    healthy = AgentMessageLogger(direct[db_name])
    for call in given_up:
        await healthy.log_messages(*call.args, **call.keywords)
    consistent = await check(direct[db_name])
    await direct.drop_database(db_name)
    await client.close()
    await direct.close()
    await proxy.close()
    dropped = sum(proxy.dropped.values())
    return Outcome(first_delay, attempts, len(given_up), seconds, dropped, consistent)


async def check(db: Any) -> bool:
    """Every conversation: `seq` without holes or duplicates up to its `message_count`."""
    for conversation in await db[CONVERSATIONS].find({}).to_list(None):
        seqs = [
            m["seq"]
            async for m in db[MESSAGES].find({"conversation_id": conversation["_id"]}).sort("seq")
        ]
        if seqs != list(range(conversation["message_count"])):
            return False
    return True


async def main(args: argparse.Namespace) -> None:
    server, uri = start_wire_server()
    upstream = uri.removeprefix("mongodb://").split("/")[0]
    try:
        print(
            f"{args.writers} writers x {args.turns} turns, drop rate {args.drop_rate:.0%} of "
            f"requests, {args.attempts} attempts at most"
        )
        print("first delay | retried turns | worst turn | given up | dropped | seconds | store ok")
        for seed, first_delay in enumerate(args.first_delays):
            outcome = await run(args, upstream, first_delay, seed)
            retried = sum(n for count, n in outcome.attempts.items() if count > 1)
            print(
                f"{outcome.first_delay:>10.2f}s | {retried:>13} | {max(outcome.attempts):>10} | "
                f"{outcome.given_up:>8} | {outcome.dropped:>7} | {outcome.seconds:>7.1f} | "
                f"{outcome.consistent}"
            )
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=20)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--drop-rate", type=float, default=0.05)
    parser.add_argument("--attempts", type=int, default=6)
    parser.add_argument("--first-delays", type=float, nargs="+", default=[0.05, 0.2, 0.5, 1.0])
    asyncio.run(main(parser.parse_args()))
