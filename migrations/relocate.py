"""Step 1 of the protocol: move legacy turn documents out of `agent_conversations`.

A rename is one atomic command. Where the server refuses it (some
MongoDB-compatible servers, or a target that already exists) or where
`agent_conversations` already holds new conversation documents, the turns are
copied instead, batch by batch: insert into `agent_conversations_deprecated`,
check every document arrived, then delete the batch from the source. A copy
killed part-way resumes where it stopped; nothing is deleted before its copy
is confirmed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pymongo.database import Database
from pymongo.errors import BulkWriteError, OperationFailure

from agent_store.legacy import LEGACY_TURN_FIELDS, LEGACY_TURNS
from agent_store.store import CONVERSATIONS, only_duplicates
from migrations.errors import MigrationError

TURN_FILTER: dict[str, Any] = {"$or": [{f: {"$exists": True}} for f in LEGACY_TURN_FIELDS]}
"""Legacy turns; conversation documents have neither field."""


@dataclass
class Relocation:
    how: str
    """'renamed', 'copied', 'already moved' or 'nothing to move'."""
    moved: int = 0
    detail: str = ""


def holds_turns(db: Database[dict[str, Any]], name: str) -> bool:
    return db[name].find_one(TURN_FILTER, {"_id": 1}) is not None


def relocate(
    db: Database[dict[str, Any]],
    *,
    batch_size: int = 500,
    progress: Callable[[int], None] | None = None,
    allow_rename: bool = True,
) -> Relocation:
    """Move every turn document from `agent_conversations` to the deprecated collection."""
    source, target = db[CONVERSATIONS], db[LEGACY_TURNS]
    if not holds_turns(db, CONVERSATIONS):
        if holds_turns(db, LEGACY_TURNS):
            return Relocation("already moved")
        return Relocation("nothing to move")
    mixed = source.find_one({"$nor": [TURN_FILTER]}, {"_id": 1}) is not None
    target_exists = LEGACY_TURNS in db.list_collection_names()
    reason = ""
    if allow_rename and not mixed and not target_exists:
        count = source.count_documents({})
        try:
            source.rename(LEGACY_TURNS)
            return Relocation("renamed", count)
        except OperationFailure as exc:
            reason = f"the server refused the rename ({exc}); copying instead"
    elif mixed:
        reason = f"{CONVERSATIONS} also holds conversation documents; copying only the turns"
    elif target_exists:
        reason = f"{LEGACY_TURNS} already exists (an interrupted copy); resuming the copy"
    moved = 0
    last: Any = None
    while True:
        # After the last `_id` moved: a scan that restarted from the first document would read
        # every conversation document mixed in again for each batch. `$gt` compares within one
        # BSON type, so an empty page is read again from the start once, for ids of other types.
        after = {} if last is None else {"_id": {"$gt": last}}
        batch = list(source.find({**after, **TURN_FILTER}).sort("_id", 1).limit(batch_size))
        if not batch and last is not None:
            last = None
            continue
        if not batch:
            break
        last = batch[-1]["_id"]
        ids = [doc["_id"] for doc in batch]
        try:
            target.insert_many(batch, ordered=False)
        except BulkWriteError as exc:
            _accept_identical_copies(exc, batch, target)
        copied = target.count_documents({"_id": {"$in": ids}})
        if copied != len(ids):
            raise MigrationError(
                f"copy check failed: {copied} of {len(ids)} turn documents arrived in "
                f"{LEGACY_TURNS}; nothing was deleted from {CONVERSATIONS}"
            )
        source.delete_many({"_id": {"$in": ids}, **TURN_FILTER})
        moved += len(ids)
        if progress is not None:
            progress(len(ids))
    return Relocation("copied", moved, reason)


def _accept_identical_copies(
    error: BulkWriteError, batch: list[dict[str, Any]], target: Any
) -> None:
    """A resumed copy meets documents it copied before; anything else is an error."""
    only_duplicates(error)
    failed = error.details.get("writeErrors", [])
    wanted = {batch[e["index"]]["_id"]: batch[e["index"]] for e in failed}
    for found in target.find({"_id": {"$in": list(wanted)}}):
        if found != wanted[found["_id"]]:
            raise MigrationError(
                f"turn document {found['_id']!r} exists in {LEGACY_TURNS} with other content; "
                "refusing to overwrite or delete it"
            ) from error
