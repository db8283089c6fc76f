"""Whole texts in GridFS, through the synchronous driver (see `agent_store.store._blobs` for
the format): those of cut messages and of problems too large for their document, written
before the documents that name them, read back by `verify` and checked by `finish`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import bson
from pydantic import ValidationError
from pymongo.database import Database
from pymongo.errors import BulkWriteError

from agent_store.core import AgentMessage, describe_validation_error, message_adapter
from agent_store.store import (
    BLOB_CHUNKS,
    BLOB_FILES,
    CHUNKS_PER_REPLY,
    CONVERSATIONS,
    MESSAGES,
    FullText,
    blob_documents,
    kept_blob_ids,
    left_behind,
    only_duplicates,
    texts_of,
    with_texts,
)
from migrations.bounds import Bounds, bounded
from migrations.errors import MigrationError


def present(db: Database[dict[str, Any]], blob_ids: Iterable[str]) -> set[str]:
    """Which of the files exist (their `files` document, written after their chunks)."""
    wanted = sorted(set(blob_ids))
    if not wanted:
        return set()
    return {d["_id"] for d in db[BLOB_FILES].find({"_id": {"$in": wanted}}, {"_id": 1})}


def _insert(
    db: Database[dict[str, Any]], name: str, docs: list[dict[str, Any]], bounds: Bounds
) -> bool:
    """Insert the documents; True when an id was taken already."""
    taken = False
    for run in bounded(docs, [len(bson.encode(d)) for d in docs], bounds):
        try:
            db[name].insert_many(run, ordered=False)
        except BulkWriteError as exc:
            only_duplicates(exc)
            taken = True
    return taken


def keep(db: Database[dict[str, Any]], full_texts: Sequence[FullText], bounds: Bounds) -> None:
    """Make each file hold its text, whatever its id held before (a message's or a problem's
    rewritten after an edit, or an id a problem of other content took).

    A file that holds the text already is left as it is. Any other under its id (another text,
    or a file a killed run left unreadable) is forgotten first: its `files` document, then
    its chunks, so no reader finds a `files` document over chunks of another text, and a run
    killed between the steps leaves the file missing, which the next run writes and `finish`
    reports until then. Then the chunks, then the `files` documents that make them visible."""
    wanted = {full.blob_id: full for full in full_texts}
    found = texts(db, wanted)
    write = [full for blob, full in wanted.items() if found.get(blob) != full.text]
    if not write:
        return
    forget(db, [full.blob_id for full in write])
    built = [blob_documents(full) for full in write]
    taken = _insert(db, BLOB_CHUNKS, [c for _, chunks in built for c in chunks], bounds)
    taken = _insert(db, BLOB_FILES, [files for files, _ in built], bounds) or taken
    if taken and texts(db, wanted) != {blob: full.text for blob, full in wanted.items()}:
        raise MigrationError(
            "another process wrote the whole texts of cut messages or problems while this run "
            "wrote them; stop it, then run again"
        )


def forget(db: Database[dict[str, Any]], blob_ids: Sequence[str]) -> None:
    """Delete files: their `files` documents first (so none is seen half gone), then chunks
    (any a killed run left too)."""
    if blob_ids:
        db[BLOB_FILES].delete_many({"_id": {"$in": list(blob_ids)}})
        db[BLOB_CHUNKS].delete_many({"files_id": {"$in": list(blob_ids)}})


def forget_conversations(db: Database[dict[str, Any]], conversation_ids: Sequence[str]) -> None:
    """Delete the files kept under these conversations (`metadata.conversation_id`, indexed):
    those of a conversation removed with no message left to name them (the migration's
    record no epoch), never those of one a person started under the id since, even between
    its whole texts and its messages (`left_behind`: one lookup of the conversations more)."""
    if conversation_ids:
        ids = list(conversation_ids)
        query = {"metadata.conversation_id": {"$in": ids}}
        found = list(
            db[BLOB_FILES].find(query, {"metadata.conversation_id": 1, "metadata.epoch": 1})
        )
        if found:
            holding = db[CONVERSATIONS].find({"_id": {"$in": ids}}, {"epoch": 1})
            holders = {str(d["_id"]): d.get("epoch") for d in holding}
            forget(db, left_behind(found, holders, {}))


def texts(db: Database[dict[str, Any]], blob_ids: Iterable[str]) -> dict[str, str]:
    """The whole texts found, by blob id; a missing or incomplete file is left out."""
    wanted = sorted(set(blob_ids))
    if not wanted:
        return {}
    files = db[BLOB_FILES].find({"_id": {"$in": wanted}})
    chunks = db[BLOB_CHUNKS].find({"files_id": {"$in": wanted}}, batch_size=CHUNKS_PER_REPLY)
    return texts_of(files, chunks)


def restore(db: Database[dict[str, Any]], messages: Sequence[AgentMessage]) -> list[AgentMessage]:
    """The messages with each cut field put back whole from its file, where it is found."""
    found = texts(db, (b for m in messages for b in kept_blob_ids(m).values()))
    return [with_texts(m, found) for m in messages]


class StoredMessages(dict[str, list[AgentMessage]]):
    """The stored messages of some conversations by `seq`, by conversation id; `invalid`
    names, by conversation id, each stored message that no longer validates (edited by hand:
    a `seq` of -1, a role it cannot have), which is left out: `verify` and `finish` report it
    as a difference of its conversation."""

    def __init__(self, ids: Iterable[str]) -> None:
        super().__init__({i: [] for i in ids})
        self.invalid: dict[str, list[str]] = {}

    def read(self, document: dict[str, Any]) -> AgentMessage | None:
        """The stored document as a message; None, noted in `invalid`, when it is none."""
        message, why = stored_message(document)
        if why is not None:
            self.invalid.setdefault(str(document.get("conversation_id")), []).append(why)
        return message


def stored_message(document: dict[str, Any]) -> tuple[AgentMessage | None, str | None]:
    """A stored message document as a message, or None and why it no longer validates (a
    hand edit): the one boundary where what is stored is read back as a message."""
    try:
        return message_adapter.validate_python(document), None
    except ValidationError as exc:
        detail = describe_validation_error(exc, subject="message")
        return None, (
            f"the stored message {document.get('_id')!r} (seq {document.get('seq')!r}) no "
            f"longer validates ({detail}): correct or delete it"
        )


def stored_messages(db: Database[dict[str, Any]], ids: list[str]) -> StoredMessages:
    """Every stored message of these conversations by `seq`, cut fields put back whole: one
    read of the messages and one restore for them all. One that no longer validates is left
    out and named in `StoredMessages.invalid`, never raised: the read of what is stored is
    where a hand edit shows."""
    query = {"conversation_id": {"$in": ids}}
    docs = db[MESSAGES].find(query).sort([("conversation_id", 1), ("seq", 1)])
    stored = StoredMessages(ids)
    read = [m for m in map(stored.read, docs) if m is not None]
    for message in restore(db, read):
        stored[str(message.conversation_id)].append(message)
    return stored
