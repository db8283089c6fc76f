"""Whole texts of cut messages in GridFS, through the synchronous driver (see
`agent_store.store._blobs` for the format): written before the messages that name
them, read back by `verify` and checked by `finish`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import bson
from pymongo.database import Database
from pymongo.errors import BulkWriteError

from agent_store.core import AgentMessage
from agent_store.store import (
    BLOB_CHUNKS,
    BLOB_FILES,
    DUPLICATE_KEY,
    FullText,
    blob_documents,
    kept_blob_ids,
    text_of,
    with_texts,
)
from migrations.bounds import Bounds, bounded


def present(db: Database[dict[str, Any]], blob_ids: Iterable[str]) -> set[str]:
    """Which of the files exist (their `files` document, written after their chunks)."""
    wanted = sorted(set(blob_ids))
    if not wanted:
        return set()
    return {d["_id"] for d in db[BLOB_FILES].find({"_id": {"$in": wanted}}, {"_id": 1})}


def _insert(
    db: Database[dict[str, Any]], name: str, docs: list[dict[str, Any]], bounds: Bounds
) -> None:
    for run in bounded(docs, [len(bson.encode(d)) for d in docs], bounds):
        try:
            db[name].insert_many(run, ordered=False)
        except BulkWriteError as exc:
            # Same ids, same bytes: a file a killed run had started.
            if any(e.get("code") != DUPLICATE_KEY for e in exc.details.get("writeErrors", [])):
                raise


def keep(db: Database[dict[str, Any]], full_texts: Sequence[FullText], bounds: Bounds) -> None:
    """Write the files: all their chunks, then the `files` documents that make them visible."""
    built = [blob_documents(full) for full in full_texts]
    _insert(db, BLOB_CHUNKS, [c for _, chunks in built for c in chunks], bounds)
    _insert(db, BLOB_FILES, [files for files, _ in built], bounds)


def texts(db: Database[dict[str, Any]], blob_ids: Iterable[str]) -> dict[str, str]:
    """The whole texts found, by blob id; a missing or incomplete file is left out."""
    wanted = sorted(set(blob_ids))
    if not wanted:
        return {}
    files = list(db[BLOB_FILES].find({"_id": {"$in": wanted}}))
    chunks: dict[str, list[Mapping[str, Any]]] = {}
    for chunk in db[BLOB_CHUNKS].find({"files_id": {"$in": wanted}}):
        chunks.setdefault(chunk["files_id"], []).append(chunk)
    found = {f["_id"]: text_of(f, chunks.get(f["_id"], [])) for f in files}
    return {blob: text for blob, text in found.items() if text is not None}


def restore(db: Database[dict[str, Any]], messages: Sequence[AgentMessage]) -> list[AgentMessage]:
    """The messages with each cut field put back whole from its file, where it is found."""
    found = texts(db, (b for m in messages for b in kept_blob_ids(m).values()))
    return [with_texts(m, found) for m in messages]
