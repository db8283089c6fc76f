"""The embedded default: a local MongoDB-compatible server on a SQLite file.

With `MONGODB_URI` unset, the service starts mongoeco's wire-protocol server
and talks to it with the real driver over TCP, so it runs on a machine with
nothing else installed. It is for development and demos: it is single-process,
slow on large collections, and its full-text ranking differs from MongoDB's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from app.errors import Unsupported


@asynccontextmanager
async def embedded_mongodb(data_dir: Path) -> AsyncIterator[str]:
    """Start the embedded server for as long as the context lasts; yields its URI."""
    try:
        from mongoeco.engines.sqlite import SQLiteEngine
        from mongoeco.wire.proxy import AsyncMongoEcoProxyServer
    except ImportError as exc:
        raise Unsupported(
            "the embedded server needs Python 3.13+ with the `embedded` extra "
            "(pip install 'agent-conversation-store[embedded]'); or set MONGODB_URI"
        ) from exc
    data_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, at start-up
    server = AsyncMongoEcoProxyServer(
        engine=SQLiteEngine(str(data_dir / "agent_store.sqlite3")),
        host="127.0.0.1",
        port=0,
        mongodb_dialect="7.0",
        pymongo_profile="auto-installed",
    )
    address = await server.start()
    try:
        yield f"mongodb://{address.host}:{address.port}/?directConnection=true"
    finally:
        await server.close()
