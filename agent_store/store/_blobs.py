"""Whole texts of cut messages, kept in GridFS (bucket `agent_message_blobs`).

The documents follow the GridFS format (a `files` document, `chunks` of
255 KiB with `files_id` and `n`), so `gridfs.GridFSBucket` and every
MongoDB tool reads them. They are written with plain inserts rather than
through a bucket: ids are deterministic (from the message id and the field's
path), so a retried turn or a rerun migration writes the same file once, and
all the files of a turn cost two commands (chunks, then the files documents
that make them visible) on every backend the store supports, mongomock included.

A conversation id freed by a delete or an erasure may be taken again, and a turn of the
same id there has the same message ids; so a file id names the conversation's `epoch` too
(`_truncation.blob_id`): nothing done late for a deleted conversation (a stalled writer's
keep, a stalled pop's delete) reaches the files of the next one under the id. A file found
under an id (one from before ids named epochs, or left incomplete by a crash) is compared
with the text to keep and replaced when it holds another (`FullTextStore.keep`), and a
reader serves a whole text only when it has the SHA-256 its message records (`with_texts`):
a message's whole text is always its own. And the files of a
conversation are found by its id in their metadata (`metadata.conversation_id`, indexed),
not only through the messages naming them: a file whose message is gone (popped, deleted
late, or never inserted) goes with its conversation. Their metadata records the epoch too
(`metadata.epoch`): a delete's or an erasure's cleanup reaching the server late, between a
conversation started under the id since keeping its whole texts and inserting its messages,
takes the deleted conversation's files only (`left_behind`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from pymongo.errors import BulkWriteError

from agent_store.core import AgentMessage, Truncation, message_adapter
from agent_store.store._driver import Database, only_duplicates, storage_errors
from agent_store.store._indexes import BLOB_CHUNKS, BLOB_FILES, CONVERSATIONS, MESSAGES
from agent_store.store._reservation import CONVERSATION_DOCUMENT
from agent_store.store._truncation import FullText, put_text

CHUNK_BYTES = 255 * 1024
"""GridFS's default chunk size."""
CHUNKS_PER_REPLY = 60
"""Chunks asked for per reply: 15 MiB, within a server's 16 MiB reply (the embedded server,
asked for no size, answers a read in one reply, which the driver refuses past 48 MB)."""


def blob_documents(full: FullText) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The GridFS `files` document and `chunks` of one whole text (UTF-8)."""
    data = full.text.encode()
    chunks = [
        {"_id": f"{full.blob_id}:{n}", "files_id": full.blob_id, "n": n, "data": data[start:end]}
        for n, (start, end) in enumerate(
            (start, start + CHUNK_BYTES) for start in range(0, max(len(data), 1), CHUNK_BYTES)
        )
    ]
    files = {
        "_id": full.blob_id,
        "length": len(data),
        "chunkSize": CHUNK_BYTES,
        # The message's time, not the write's: a rerun writes the very same document.
        "uploadDate": full.created_at,
        "filename": f"{full.message_id}/{full.path}",
        "metadata": {
            "conversation_id": full.conversation_id,
            "message_id": full.message_id,
            "path": full.path,
            "content_type": "text/plain; charset=utf-8",
            **({"epoch": full.epoch} if full.epoch is not None else {}),
        },
    }
    return files, chunks


def left_behind(
    files: Iterable[Mapping[str, Any]],
    holders: Mapping[str, str | None],
    deleted: Mapping[str, Collection[str | None]],
) -> list[str]:
    """The ids of the `files` (as found by their `metadata.conversation_id`) that a cleanup of
    deleted conversations takes: those recording no epoch (written before files recorded it,
    or for a conversation with none), or a deleted conversation's (`deleted`: its epochs by
    its id), or one no conversation under the id holds (`holders`: the epoch of the one under
    each id, read after the files were found: a deleted one's left late).

    Never those of a conversation started under the id since, whose document (drawing its
    epoch) is there before its files are: a cleanup reaching the server however late, between
    that conversation's whole texts and its messages, leaves them."""
    taken = []
    for found in files:
        meta = found.get("metadata") or {}
        cid, epoch = str(meta.get("conversation_id")), meta.get("epoch")
        if epoch is None or epoch in deleted.get(cid, ()) or holders.get(cid) != epoch:
            taken.append(str(found["_id"]))
    return taken


def text_of(files: Mapping[str, Any], chunks: Iterable[Mapping[str, Any]]) -> str | None:
    """The whole text of a file from its chunks; None when chunks are missing or short."""
    ordered = sorted(chunks, key=lambda c: int(c["n"]))
    data = b"".join(bytes(c["data"]) for c in ordered)
    complete = [int(c["n"]) for c in ordered] == list(range(len(ordered)))
    if not complete or len(data) != files.get("length"):
        return None
    return data.decode()


def kept_blob_ids(message: AgentMessage) -> dict[str, str]:
    """The blob id of each cut field of a message that was kept whole, by path."""
    return {
        path: entry.blob_id
        for path, entry in (message.truncated or {}).items()
        if isinstance(entry, Truncation) and entry.blob_id
    }


def whole_text_chars(message: AgentMessage) -> int:
    """How many characters the whole texts of a message's cut fields kept whole hold: what
    putting them back (`FullTextStore.restore`) reads into memory for it."""
    entries = (message.truncated or {}).values()
    return sum(e.length for e in entries if isinstance(e, Truncation) and e.blob_id)


def parts_by_whole_text(messages: Sequence[AgentMessage], chars: int) -> list[list[AgentMessage]]:
    """The messages, in order, in parts whose whole texts (`whole_text_chars`) hold at most
    `chars` characters together, or one message alone; one empty part for no messages."""
    parts: list[list[AgentMessage]] = [[]]
    held = 0
    for message in messages:
        size = whole_text_chars(message)
        if parts[-1] and held + size > chars:
            parts.append([])
            held = 0
        parts[-1].append(message)
        held += size
    return parts


def stored_blob_ids(document: Mapping[str, Any]) -> list[str]:
    """The blob ids a stored message document's `truncated` map names."""
    entries = document.get("truncated") or {}
    return [
        entry["blob_id"]
        for entry in entries.values()
        if isinstance(entry, Mapping) and isinstance(entry.get("blob_id"), str)
    ]


def with_texts(message: AgentMessage, texts: Mapping[str, str]) -> AgentMessage:
    """The message with each cut field whose whole text is in `texts` (by blob id) put back.

    Restored fields leave `truncated`; fields not found there stay cut and listed, and so
    do fields whose file holds another text than the one their entry records the SHA-256
    of: a message is served cut rather than with a text that is not its own.
    """
    kept = {
        path: texts[b]
        for path, b in kept_blob_ids(message).items()
        if b in texts and _is_its_text(message, path, texts[b])
    }
    if not kept:
        return message
    doc = message.model_dump(by_alias=True)
    for path, text in kept.items():
        put_text(doc, path, text, cut=False)
    left = {p: e for p, e in (message.truncated or {}).items() if p not in kept}
    doc["truncated"] = left or None
    return message_adapter.validate_python(doc)


def _is_its_text(message: AgentMessage, path: str, text: str) -> bool:
    """Whether `text` is the whole text of the message's cut field at `path`: the one whose
    SHA-256 its `truncated` entry records (a message cut before entries recorded it: any)."""
    entry = (message.truncated or {}).get(path)
    recorded = entry.sha256 if isinstance(entry, Truncation) else None
    return recorded is None or hashlib.sha256(text.encode()).hexdigest() == recorded


def texts_of(
    files: Iterable[Mapping[str, Any]], chunks: Iterable[Mapping[str, Any]]
) -> dict[str, str]:
    """The whole texts that `files` documents and their `chunks` make, by blob id; a file
    with a chunk missing is left out."""
    by_file: dict[str, list[Mapping[str, Any]]] = {}
    for chunk in chunks:
        by_file.setdefault(chunk["files_id"], []).append(chunk)
    found = {f["_id"]: text_of(f, by_file.get(f["_id"], [])) for f in files}
    return {blob: text for blob, text in found.items() if text is not None}


class FullTextStore:
    """Writes, reads and deletes the whole texts of cut messages on an async database."""

    def __init__(self, db: Database) -> None:
        self._files = db[BLOB_FILES]
        self._chunks = db[BLOB_CHUNKS]
        self._messages = db[MESSAGES]
        self._conversations = db[CONVERSATIONS]

    async def keep(self, full_texts: Sequence[FullText]) -> None:
        """Write the texts: chunks first, then the files documents that make them visible.

        An id already taken (a retry's, or a file its message outlived) is read back and
        compared: a file holding another text, or one with chunks missing, is replaced (two
        more round trips to compare, two to delete and two to write, on that path only)."""
        if not full_texts:
            return
        if not await self._insert([blob_documents(full) for full in full_texts]):
            return
        stored = await self.texts(full.blob_id for full in full_texts)
        other = [full for full in full_texts if stored.get(full.blob_id) != full.text]
        if other:
            await self.forget_files([full.blob_id for full in other])
            await self._insert([blob_documents(full) for full in other])

    async def _insert(self, built: Sequence[tuple[dict[str, Any], list[dict[str, Any]]]]) -> bool:
        """Insert chunks, then files documents; True when an id was taken already."""
        taken = False
        with storage_errors("keep the whole texts of cut messages"):
            for collection, documents in (
                (self._chunks, [c for _, chunks in built for c in chunks]),
                (self._files, [files for files, _ in built]),
            ):
                try:
                    await collection.insert_many(documents, ordered=False)
                except BulkWriteError as exc:
                    only_duplicates(exc)
                    taken = True
        return taken

    async def texts(self, blob_ids: Iterable[str]) -> dict[str, str]:
        """The whole texts found, by blob id (a missing or incomplete file is left out)."""
        wanted = sorted(set(blob_ids))
        if not wanted:
            return {}
        with storage_errors("read the whole texts of cut messages"):
            files = await self._files.find({"_id": {"$in": wanted}}).to_list(None)
            chunks = await self._chunks.find(
                {"files_id": {"$in": wanted}}, batch_size=CHUNKS_PER_REPLY
            ).to_list(None)
        return texts_of(files, chunks)

    async def restore(self, messages: Sequence[AgentMessage]) -> list[AgentMessage]:
        """The messages with every cut field that was kept whole put back."""
        texts = await self.texts(b for m in messages for b in kept_blob_ids(m).values())
        return [with_texts(m, texts) for m in messages]

    async def forget(self, messages_filter: Mapping[str, Any]) -> None:
        """Delete the whole texts of the messages `messages_filter` selects (before them)."""
        with storage_errors("delete the whole texts of cut messages"):
            cut = await self._messages.find(
                {**messages_filter, "truncated": {"$ne": None}}, {"truncated": 1}
            ).to_list(None)
        await self.forget_files(sorted({b for doc in cut for b in stored_blob_ids(doc)}))

    async def forget_conversations(self, deleted: Mapping[str, Collection[str | None]]) -> None:
        """Delete the whole texts of deleted conversations that no message of theirs names,
        found by their metadata (`deleted`: each conversation's epochs, as its delete found
        them, by its id). Run once the messages being deleted are gone, it takes theirs and
        those no message names any more (popped, or deleted after their turn wrote them, or
        whose insert failed), and those a conversation deleted before under the id left; it
        leaves those of a conversation started under the id since, even when it reaches the
        server between their keep and the insert of their messages (`left_behind`), and those
        its messages name (under the same file id too). One round trip; four more when any."""
        ids = list(deleted)
        with storage_errors("delete the whole texts of cut messages"):
            found = await self._files.find(
                {"metadata.conversation_id": {"$in": ids}},
                {"metadata.conversation_id": 1, "metadata.epoch": 1},
            ).to_list(None)
            if not found:
                return
            holding = await self._conversations.find(
                {"_id": {"$in": ids}, **CONVERSATION_DOCUMENT}, {"epoch": 1}
            ).to_list(None)
            named = await self._messages.find(
                {"conversation_id": {"$in": ids}, "truncated": {"$ne": None}}, {"truncated": 1}
            ).to_list(None)
        kept = {b for doc in named for b in stored_blob_ids(doc)}
        holders = {str(d["_id"]): d.get("epoch") for d in holding}
        await self.forget_files(sorted(set(left_behind(found, holders, deleted)) - kept))

    async def forget_files(self, blob_ids: Sequence[str]) -> None:
        """Delete these files: chunks first, so that the files documents (by which a
        conversation's files are found) go last, and a crash between leaves them findable."""
        if not blob_ids:
            return
        with storage_errors("delete the whole texts of cut messages"):
            await self._chunks.delete_many({"files_id": {"$in": list(blob_ids)}})
            await self._files.delete_many({"_id": {"$in": list(blob_ids)}})
