"""Run mongoeco's wire server (in memory) as a process of its own, for measurements.

Prints its URI on the first line of stdout, then serves until stdin closes or the
process is terminated. A separate process keeps the database's CPU out of the
client's `time.process_time()`.
"""

from __future__ import annotations

import asyncio
import sys


async def serve() -> None:
    from mongoeco.engines.memory import MemoryEngine
    from mongoeco.wire.proxy import AsyncMongoEcoProxyServer

    server = AsyncMongoEcoProxyServer(
        engine=MemoryEngine(),
        host="127.0.0.1",
        port=0,
        mongodb_dialect="7.0",
        pymongo_profile="auto-installed",
    )
    address = await server.start()
    print(f"mongodb://{address.host}:{address.port}/?directConnection=true", flush=True)
    try:
        await asyncio.to_thread(sys.stdin.read)  # returns when the parent closes stdin
    finally:
        await server.close()


if __name__ == "__main__":
    asyncio.run(serve())
