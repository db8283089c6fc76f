"""Whether a busy client recovers once a network stops dropping connections: retryable writes on
and off.

`python -m scripts.pool_recovery` starts the embedded wire server in its own process, puts
`scripts.faulty_proxy.FaultyProxy` in front of it, and lets writers send `find_one_and_update`
(a turn's reservation is one) through it as fast as they can, a failed write followed by a
short pause. The proxy drops a share of requests for the first seconds, then none. It prints,
for a client with PyMongo's retryable writes on (the driver's default) and one with them off
(what `agent_store.client_options` gives the product's own client): the writes that succeeded
and failed (with the drivers' errors), and the pool clears, in all and after the drops stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pymongo import AsyncMongoClient, monitoring
from pymongo.errors import PyMongoError

from scripts.faulty_proxy import FaultyProxy
from scripts.wire_server import start_wire_server


class PoolEvents(monitoring.ConnectionPoolListener):
    """Counts a client's pool clears (`cleared`, and `cleared_late` once `late` is set), and
    tells when its pool is ready to check connections out of (`ready`)."""

    def __init__(self) -> None:
        self.cleared = 0
        self.cleared_late = 0
        self.late = False
        self.ready = asyncio.Event()
        self.ready.set()

    def pool_cleared(self, event: monitoring.PoolClearedEvent) -> None:
        self.cleared += 1
        self.cleared_late += self.late
        self.ready.clear()

    def pool_ready(self, event: monitoring.PoolReadyEvent) -> None:
        self.ready.set()

    def pool_created(self, event: monitoring.PoolCreatedEvent) -> None:
        pass

    def pool_closed(self, event: monitoring.PoolClosedEvent) -> None:
        pass

    def connection_created(self, event: monitoring.ConnectionCreatedEvent) -> None:
        pass

    def connection_ready(self, event: monitoring.ConnectionReadyEvent) -> None:
        pass

    def connection_closed(self, event: monitoring.ConnectionClosedEvent) -> None:
        pass

    def connection_check_out_started(
        self, event: monitoring.ConnectionCheckOutStartedEvent
    ) -> None:
        pass

    def connection_check_out_failed(self, event: monitoring.ConnectionCheckOutFailedEvent) -> None:
        pass

    def connection_checked_out(self, event: monitoring.ConnectionCheckedOutEvent) -> None:
        pass

    def connection_checked_in(self, event: monitoring.ConnectionCheckedInEvent) -> None:
        pass


@dataclass
class Outcome:
    retry_writes: bool
    ok: int = 0
    ok_after_drops: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    dropped: int = 0
    pool: PoolEvents = field(default_factory=PoolEvents)


async def run(args: argparse.Namespace, upstream: str, retry_writes: bool) -> Outcome:
    outcome = Outcome(retry_writes)
    pool = outcome.pool
    proxy = FaultyProxy(upstream, drop_rate=args.drop_rate, seed=1)
    uri = await proxy.start()
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        uri, serverSelectionTimeoutMS=10_000, retryWrites=retry_writes, event_listeners=[pool]
    )
    counter = client["pool_recovery"]["counter"]
    await counter.replace_one({"_id": 0}, {"n": 0}, upsert=True)
    end = time.monotonic() + args.seconds

    async def stop_the_drops() -> None:
        await asyncio.sleep(args.drop_seconds)
        proxy.drop_rate = 0.0
        pool.late = True

    async def writer() -> None:
        while time.monotonic() < end:
            try:
                await counter.find_one_and_update({"_id": 0}, {"$inc": {"n": 1}})
                outcome.ok += 1
                outcome.ok_after_drops += pool.late
            except PyMongoError as error:
                outcome.errors[str(error).partition(": ")[2][:40]] += 1
                await asyncio.sleep(0.05)

    stopper = asyncio.ensure_future(stop_the_drops())
    await asyncio.gather(*(writer() for _ in range(args.writers)))
    await stopper
    outcome.dropped = sum(proxy.dropped.values())
    await client.drop_database("pool_recovery")
    await client.close()
    await proxy.close()
    return outcome


async def main(args: argparse.Namespace) -> None:
    server, uri = start_wire_server()
    upstream = uri.removeprefix("mongodb://").split("/")[0]
    try:
        print(
            f"{args.writers} writers for {args.seconds:g} s, {args.drop_rate:.0%} of requests "
            f"dropped for the first {args.drop_seconds:g} s, then none"
        )
        print("retryWrites |    ok | after the drops | failed | clears | after the drops | errors")
        for retry_writes in (True, False):
            out = await run(args, upstream, retry_writes)
            print(
                f"{str(out.retry_writes).lower():>11} | {out.ok:>5} | {out.ok_after_drops:>15} | "
                f"{out.errors.total():>6} | {out.pool.cleared:>6} | {out.pool.cleared_late:>15} | "
                f"{dict(out.errors.most_common(3))} ({out.dropped} connections dropped)"
            )
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--drop-rate", type=float, default=0.03)
    parser.add_argument("--drop-seconds", type=float, default=8.0)
    asyncio.run(main(parser.parse_args()))
