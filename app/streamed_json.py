"""JSON documents written piece by piece, so a transcript or an export is never held whole.

Each writer yields the bytes of one document (`Transcript`, `ConversationExport`
lines, `UserExport`) in chunks of about `CHUNK_BYTES`, reading messages a batch
at a time from the store's streamed reads.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from agent_store.core import AgentMessage, message_adapter
from agent_store.store import ConversationStore

CHUNK_BYTES = 64 * 1024
Batches = AsyncGenerator[list[AgentMessage], None]


async def _chunks(pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Join small pieces into chunks of about `CHUNK_BYTES`: fewer, larger writes."""
    buffer = bytearray()
    async for piece in pieces:
        buffer += piece
        if len(buffer) >= CHUNK_BYTES:
            yield bytes(buffer)
            buffer.clear()
    if buffer:
        yield bytes(buffer)


async def _array(first: Sequence[AgentMessage], rest: Batches) -> AsyncIterator[bytes]:
    """A JSON array of every message of `first`, then of each batch of `rest`."""
    yield b"["
    separator = b""
    batch = first
    while True:
        for message in batch:
            yield separator + message_adapter.dump_json(message, by_alias=True)
            separator = b","
        next_batch = await anext(rest, None)
        if next_batch is None:
            break
        batch = next_batch
    yield b"]"


async def transcript_document(
    conversation_id: str, first: Sequence[AgentMessage], rest: Batches
) -> AsyncIterator[bytes]:
    """The `Transcript` document: `first` is the batch already read (and checked)."""

    async def pieces() -> AsyncIterator[bytes]:
        yield b'{"conversation_id":' + json.dumps(conversation_id).encode() + b',"data":'
        async for piece in _array(first, rest):
            yield piece
        yield b"}"

    try:
        async for chunk in _chunks(pieces()):
            yield chunk
    finally:
        await rest.aclose()


async def _conversation_exports(
    store: ConversationStore, user_id: str, *, between: bytes, after: bytes, full: bool
) -> AsyncGenerator[bytes, None]:
    """Each of the user's conversations as a `ConversationExport` object, as
    `stream_user_exports` streams it: its summary holds for the messages that come with it.
    One gone before its turn is left out; one changing while its messages are sent cuts the
    export."""
    exports = store.stream_user_exports(user_id, full=full)
    try:
        before = b""
        async for export in exports:
            summary = export.conversation.model_dump_json(by_alias=True).encode()
            yield before + b'{"conversation":' + summary + b',"messages":'
            async for piece in _array(export.first, export.rest):
                yield piece
            yield b"}" + after
            before = between
    finally:
        await exports.aclose()


async def _primed(pieces: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    """`pieces` with its first piece read: an export's first conversation paired with its
    summary (or refused: a 503 while a turn of it is still being written, a 409 while pops
    change it) before the response begins, so that a refusal then is the request's answer,
    not a body cut after a 200. One refused later cuts the body."""
    first = await anext(pieces, None)

    async def then() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield first
            async for piece in pieces:
                yield piece
        finally:
            await pieces.aclose()

    return then()


async def export_lines(
    store: ConversationStore, user_id: str, *, full: bool = False
) -> AsyncIterator[bytes]:
    """JSON Lines: one `ConversationExport` per line, the first read before this returns."""
    exports = _conversation_exports(store, user_id, between=b"", after=b"\n", full=full)
    return _chunks(await _primed(exports))


async def export_document(
    store: ConversationStore, user_id: str, *, full: bool = False
) -> AsyncIterator[bytes]:
    """The `UserExport` document, its first conversation read before this returns."""
    exports = await _primed(
        _conversation_exports(store, user_id, between=b",", after=b"", full=full)
    )

    async def pieces() -> AsyncIterator[bytes]:
        yield b'{"user_id":' + json.dumps(user_id).encode() + b',"conversations":['
        async for piece in exports:
            yield piece
        yield b"]}"

    return _chunks(pieces())
