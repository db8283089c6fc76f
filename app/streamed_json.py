"""JSON documents written piece by piece, so a transcript or an export is never held whole.

Each writer yields the bytes of one document (`Transcript`, `ConversationExport`
lines, `UserExport`) in chunks of about `CHUNK_BYTES`, reading messages a batch
at a time from the store's streamed reads.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from agent_store.core import AgentMessage, message_adapter
from agent_store.store import ConversationStore, ExportStream

CHUNK_BYTES = 64 * 1024
Batches = AsyncGenerator[list[AgentMessage], None]
Exports = AsyncGenerator[ExportStream, None]


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


async def opened_exports(store: ConversationStore, user_id: str, *, full: bool) -> Exports:
    """The user's conversations to export (`stream_user_exports`), the first one read now: a
    database that cannot be read fails here, before the answer starts, as a transcript's first
    batch does (the usual error answer, not a 200 cut before its first byte). Closing what
    comes back closes the store's stream."""
    exports = store.stream_user_exports(user_id, full=full)
    try:
        first = await anext(exports, None)
    except BaseException:
        await exports.aclose()
        raise
    return _read_ahead(first, exports)


async def _read_ahead(first: ExportStream | None, rest: Exports) -> Exports:
    try:
        if first is not None:
            yield first
            async for export in rest:
                yield export
    finally:
        await rest.aclose()


async def _conversation_exports(
    exports: Exports, *, between: bytes, after: bytes
) -> AsyncIterator[bytes]:
    """Each conversation of `exports` as a `ConversationExport` object, as
    `stream_user_exports` streams it: its summary holds for the messages that come with it.
    One gone before its turn is left out; one changing while its messages are sent cuts the
    export."""
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


async def export_lines(exports: Exports) -> AsyncIterator[bytes]:
    """JSON Lines: one `ConversationExport` per line, from `opened_exports`."""
    async for chunk in _chunks(_conversation_exports(exports, between=b"", after=b"\n")):
        yield chunk


async def export_document(user_id: str, exports: Exports) -> AsyncIterator[bytes]:
    """The `UserExport` document, from `opened_exports`."""

    async def pieces() -> AsyncIterator[bytes]:
        yield b'{"user_id":' + json.dumps(user_id).encode() + b',"conversations":['
        async for piece in _conversation_exports(exports, between=b",", after=b""):
            yield piece
        yield b"]}"

    async for chunk in _chunks(pieces()):
        yield chunk
