"""Peak memory of the transcript and export routes for conversations of 2 and 20 MB.

The database is a mongoeco wire server in a child process (or MONGODB_URI), so
only the service's own allocations are measured: the app is called in-process
through ASGI with a client that drops each body chunk as it arrives, under
tracemalloc. For comparison, "whole" is what the route did before streaming:
read the whole transcript, build the `Transcript` model and render one JSON body.

mongoeco scans its collection on every insert: seeding 22 MB of 10 KB messages
takes about half a minute.

    python -m scripts.bench_transcript_memory [--message-bytes 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pymongo import AsyncMongoClient
from starlette.responses import JSONResponse

from agent_store.store import CONVERSATIONS, MESSAGES
from app.api import create_app
from app.api_models import Transcript
from app.service import Store
from app.settings import Settings
from scripts.wire_server import start_wire_server

MiB = 1024 * 1024
TOKEN = "bench-token-0123456789abcdefghijklmnop"
USER = "user-bench"


async def add_big_conversation(
    db: Any, conversation_id: str, *, messages: int, chars: int, user_id: str = USER
) -> None:
    """A conversation of `messages` user messages of about `chars` characters, written directly
    as the logger writes them (its messages carry its `epoch`)."""
    now, epoch = datetime.now(UTC), uuid.uuid4().hex[:16]
    await db[MESSAGES].insert_many(
        [
            {
                "_id": f"{conversation_id}-{seq}",
                "conversation_id": conversation_id,
                "seq": seq,
                "role": "user",
                "content": f"{seq:06d} " + "x" * chars,
                "user_id": user_id,
                "created_at": now,
                "epoch": epoch,
            }
            for seq in range(messages)
        ]
    )
    await db[CONVERSATIONS].insert_one(
        {
            "_id": conversation_id,
            "conversation_id": conversation_id,
            "user_id": user_id,
            "name": None,
            "created_at": now,
            "updated_at": now,
            "turn_count": messages,
            "message_count": messages,
            "last_message_preview": "",
            "epoch": epoch,
        }
    )


@dataclass
class Measured:
    """One response: its status, how many body bytes it sent, the traced peak while answering."""

    status: int
    body_bytes: int
    peak_bytes: int


async def peak_of(work: Callable[[], Awaitable[None]]) -> int:
    """The peak of traced allocations while `work` runs, above what was allocated before."""
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        await work()
        return tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()


async def measure_get(app: Any, path: str, *, query: bytes = b"", token: str) -> Measured:
    """GET `path` from the ASGI `app`, dropping each body chunk as it comes: the client holds
    nothing, so the traced peak is what the server needed to answer."""
    requested = False
    status, sent = 0, 0

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, sent
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            sent += len(message.get("body", b""))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [(b"authorization", f"Bearer {token}".encode()), (b"host", b"bench")],
        "client": ("127.0.0.1", 40000),
        "server": ("bench", 80),
    }
    peak = await peak_of(lambda: app(scope, receive, send))
    return Measured(status, sent, peak)


async def whole_transcript_peak(store: Store, conversation_id: str) -> int:
    """The traced peak of answering the transcript whole, as the route did before streaming."""

    async def answer() -> None:
        messages = await store.conversations.transcript(conversation_id)
        document = Transcript(conversation_id=conversation_id, data=messages)
        JSONResponse(document.model_dump(mode="json", by_alias=True))

    return await peak_of(answer)


async def run(uri: str, message_bytes: int) -> None:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
    name = f"bench_memory_{uuid.uuid4().hex[:8]}"
    db = client[name]
    try:
        sizes = {"2 MB": 2_000_000, "20 MB": 20_000_000}
        for label, size in sizes.items():
            await add_big_conversation(
                db, label.replace(" ", ""), messages=size // message_bytes, chars=message_bytes
            )
        settings = Settings(service_tokens=[TOKEN])
        store = Store.on(db, settings)
        app = create_app(settings, store=store)
        print(f"messages of {message_bytes} bytes; traced peak while answering:")
        for label in sizes:
            conversation_id = label.replace(" ", "")
            streamed = await measure_get(
                app, f"/v1/conversations/{conversation_id}/transcript", token=TOKEN
            )
            whole = await whole_transcript_peak(store, conversation_id)
            print(
                f"  transcript {label}: {streamed.body_bytes / 1e6:.1f} MB sent, streamed "
                f"{streamed.peak_bytes / MiB:.1f} MiB, whole {whole / MiB:.1f} MiB "
                f"({whole / streamed.body_bytes:.1f}x the body)"
            )
        for export_format in ("jsonl", "json"):
            exported = await measure_get(
                app,
                f"/v1/users/{USER}/export",
                query=f"format={export_format}".encode(),
                token=TOKEN,
            )
            print(
                f"  export {export_format} of both: {exported.body_bytes / 1e6:.1f} MB sent, "
                f"streamed {exported.peak_bytes / MiB:.1f} MiB"
            )
    finally:
        await client.drop_database(name)
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--message-bytes", type=int, default=10_000)
    args = parser.parse_args()
    uri = os.environ.get("MONGODB_URI")
    if uri:
        asyncio.run(run(uri, args.message_bytes))
        return
    server, uri = start_wire_server()
    try:
        asyncio.run(run(uri, args.message_bytes))
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)
        if server.stdout is not None:
            server.stdout.close()


if __name__ == "__main__":
    main()
