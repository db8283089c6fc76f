"""Run the embedded wire server (in memory) as a process of its own, for measurements.

Prints its URI on the first line of stdout, then serves until stdin closes or the
process is terminated. A separate process keeps the database's CPU out of the
client's `time.process_time()` and out of its interpreter lock.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

from agent_store.embedded import embedded_mongodb


def start_wire_server() -> tuple[subprocess.Popen[str], str]:
    """Start this module in a child process; returns it and the server's URI."""
    server = subprocess.Popen(
        [sys.executable, "-m", "scripts.wire_server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    return server, server.stdout.readline().strip()


async def serve() -> None:
    async with embedded_mongodb(None) as uri:
        print(uri, flush=True)
        await asyncio.to_thread(sys.stdin.read)  # returns when the parent closes stdin


if __name__ == "__main__":
    asyncio.run(serve())
