"""Conversations the migration made that no legacy turn makes now: every turn of one was
re-filed under another conversation (a turn naming none given its real id, say) or deleted
after the run. Neither a run nor the gate reaches them through the legacy conversation ids,
so they are looked for here: the conversations whose first message (`seq` 0) is the
migration's (a `legacy-…` turn id, which no live turn may take; the migration writes a
conversation's messages from `seq` 0 on) and that no legacy turn names now, by the rule the
read fallback names a conversation's turns by (`turns_known_as`). Those with no first message
whose document is the migration's (`writes.written_by_migration`: a run killed between a
batch's documents and its messages, the conversation deleted meanwhile), too. And the
conversations holding any of the migration's messages, at any `seq`, whose document is gone
and that no legacy turn names (a person deleted the conversation while a run wrote them,
between two of its insert commands, say, so that only the later messages are left): served
by search, and holding the `seq` values a new turn under the id takes.

A run's last step removes each (its messages, their whole texts, or every whole text kept
under its id when it holds no message, its document and its recorded problems): their
content is where the legacy turns are filed now, in the conversation the run migrated them
into, or nowhere, deleted by a person. One a live turn wrote to (a message of a live turn
id, or turn records on its document) is never removed: it is reported, by `run` and by
`finish`, for a person to decide. A chunk of `CHUNK` conversation documents at a time: one
indexed read of their first messages, one read of the legacy turns, and the messages only of
the conversations found.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pymongo.database import Database

from agent_store.core import InvalidInput
from agent_store.legacy import (
    CONVERSATION_COUNTERS,
    LEGACY_TURNS,
    TURN_ONLY_FIELDS,
    not_identifiers,
    parse_turns,
    turns_known_as,
)
from agent_store.store import (
    CONVERSATIONS,
    DERIVED_CONVERSATION_PREFIX,
    MESSAGES,
    MIGRATED_TURN_PREFIX,
    stored_blob_ids,
)
from migrations import full_texts
from migrations import problems as problem_report
from migrations.errors import MigrationError
from migrations.explode import LEGACY_FILTER, Explosion, batches, dropped_at, turns_made_of
from migrations.writes import holds_turn_fields, is_migrated, written_by_migration

CHUNK = 1000
"""Conversation documents looked at a time."""
_UNNAMED_BY_TEXT = (
    "object", "array", "binData", "date", "regex", "timestamp", "javascript", "symbol",
    "dbPointer", "minKey", "maxKey", "javascriptWithScope",
)  # fmt: skip
"""BSON types of a legacy conversation id that `id_filter` cannot find by the id's text."""
_NO_TURN_FIELD = {name: {"$exists": False} for name in TURN_ONLY_FIELDS}
"""No field only a legacy turn holds (`writes.holds_turn_fields`): a removal takes no such
document, even one edited so since it was read."""


@dataclass
class Abandoned:
    """A conversation the migration made whose legacy turns are all gone from it."""

    conversation_id: str
    migrated: list[dict[str, Any]] = field(default_factory=list)
    """Its messages of legacy turns."""
    live: int = 0
    """How many of its messages live turns wrote (one more when its document holds turn
    records): while any, it is reported, not removed."""
    document_only: bool = False
    """Its document is the migration's and it has no first message
    (`writes.written_by_migration`): with no message either, its document alone is left."""
    stored: bool = True
    """Its conversation document is stored (else its messages are left without one)."""

    @property
    def reason(self) -> str:
        found = (
            f"holds {len(self.migrated)} messages of legacy turns that none of the legacy "
            "turns names now (re-filed under another conversation or deleted after the run)"
        )
        if self.document_only and not self.migrated:
            found = (
                "is a conversation document the migration wrote, without messages (a run "
                "stopped before them), that none of the legacy turns names now"
            )
        if self.live:
            return (
                f"{found}, and what live turns wrote: delete the migrated "
                "ones (turn ids `legacy-…`) or put the legacy turns back, then `run` again"
            )
        return f"{found}: run the migration again, which removes it"


def _named(db: Database[dict[str, Any]], documents: list[Mapping[str, Any]]) -> set[str] | None:
    """Which of these conversations some legacy turn makes now (None: a turn could not be
    read, so none is taken as abandoned)."""
    made = turns_made_of(db, [str(d["_id"]) for d in documents])
    clauses = []
    for d in documents:
        cid = str(d["_id"])
        original = d.get("legacy_conversation_id")
        if not (cid.startswith(DERIVED_CONVERSATION_PREFIX) and isinstance(original, str)):
            original = None
        clauses.append(turns_known_as(cid, original, made.ids.get(cid, [])))
    if any(str(d["_id"]).startswith(DERIVED_CONVERSATION_PREFIX) for d in documents):
        # A derived id may stand for a value no filter of its text finds (an object, binary
        # data, a date, an array): every turn naming such a value is read, and named by the
        # rule the run names it by (`stored_conversation_id`).
        clauses.append({"conversation_id": {"$type": list(_UNNAMED_BY_TEXT)}})
    if any(_derived_unknown(d) for d in documents):
        # A conversation of messages only (its document deleted) says not which legacy id
        # its derived id stands for: every turn naming an id that is no identifier is read.
        clauses.append(not_identifiers("conversation_id"))
    query = {"$and": [{"$or": clauses}, LEGACY_FILTER]}
    try:
        found = db[LEGACY_TURNS].find(query, {"_id": 1, "conversation_id": 1})
        turns = parse_turns(found, made.names)
    except InvalidInput:
        return None
    return {turn.stored_conversation_id for turn in turns}


def _derived_unknown(document: Mapping[str, Any]) -> bool:
    """Whether a derived conversation id's legacy id is unknown: no document says it."""
    cid = str(document["_id"])
    return cid.startswith(DERIVED_CONVERSATION_PREFIX) and "legacy_conversation_id" not in document


def _migrated(
    db: Database[dict[str, Any]], documents: list[Mapping[str, Any]]
) -> tuple[list[Mapping[str, Any]], set[str]]:
    """The conversations of these the migration made: their first message is its own, or
    they have none and their document is the migration's (the second set, by id)."""
    query = {"conversation_id": {"$in": [d["_id"] for d in documents]}, "seq": 0}
    first = {
        m["conversation_id"]: m
        for m in db[MESSAGES].find(query, {"conversation_id": 1, "turn_id": 1})
    }
    made = {cid for cid, m in first.items() if is_migrated(m.get("turn_id"))}
    bare = {d["_id"] for d in documents if d["_id"] not in first and written_by_migration(d)}
    # A document holding a field only a legacy turn holds is no conversation the migration
    # made, whatever messages its id names: never removed, and the gate names it.
    return [d for d in documents if d["_id"] in made | bare and not holds_turn_fields(d)], bare


def _abandoned(
    db: Database[dict[str, Any]], documents: list[Mapping[str, Any]], *, stored: bool = True
) -> list[Abandoned]:
    """The abandoned conversations of these documents (not `stored`: ids of conversations of
    no document holding some message of the migration's, `_without_document`)."""
    made, bare = _migrated(db, documents) if stored else (documents, set())
    named = _named(db, made) if made else set()
    if named is None:
        return []
    unnamed = [d for d in made if str(d["_id"]) not in named]
    if not unnamed:
        return []
    ids = [d["_id"] for d in unnamed]
    found = {
        d["_id"]: Abandoned(
            d["_id"],
            live=1 if d.get("turns") else 0,
            document_only=d["_id"] in bare,
            stored=stored,
        )
        for d in unnamed
    }
    for message in db[MESSAGES].find({"conversation_id": {"$in": ids}}):
        item = found[message["conversation_id"]]
        if is_migrated(message.get("turn_id")):
            item.migrated.append(message)
        else:
            item.live += 1
    return [item for item in found.values() if item.migrated or item.document_only]


def chunks(db: Database[dict[str, Any]], *, documents: bool = True) -> Iterator[list[Abandoned]]:
    """The abandoned conversations, a chunk of `CHUNK` conversation documents at a time
    (unless not `documents`); then those of the migration's messages whose conversation
    document is gone (`_without_document`)."""
    fields = {
        "_id": 1, "conversation_id": 1, "legacy_conversation_id": 1, "turns": 1,
        "recent_turns": 1, "epoch": 1, **dict.fromkeys(CONVERSATION_COUNTERS, 1),
        **dict.fromkeys(TURN_ONLY_FIELDS, 1),
    }  # fmt: skip
    if documents:
        for chunk in batches(iter(db[CONVERSATIONS].find({}, fields).sort("_id", 1)), CHUNK):
            yield _abandoned(db, chunk)
    for ids in batches(_without_document(db), CHUNK):
        yield _abandoned(db, [{"_id": cid} for cid in ids], stored=False)


def _without_document(db: Database[dict[str, Any]]) -> Iterator[str]:
    """The conversations holding a message of the migration's, at any `seq`, and no document
    (a run wrote their messages after a person deleted the conversation, maybe only those of
    its later insert commands): one pass over the migration's messages' conversation ids
    (grouped by the server), and one read of their documents a chunk at a time."""
    grouped = db[MESSAGES].aggregate(
        [
            {"$match": {"turn_id": {"$regex": f"^{re.escape(MIGRATED_TURN_PREFIX)}"}}},
            {"$group": {"_id": "$conversation_id"}},
        ],
        allowDiskUse=True,
    )
    made = (g["_id"] for g in grouped)
    for ids in batches(made, CHUNK):
        stored = {d["_id"] for d in db[CONVERSATIONS].find({"_id": {"$in": ids}}, {"_id": 1})}
        yield from (cid for cid in ids if cid not in stored)


def _still_safe(run: Explosion) -> bool:
    """Before each removal: the run still holds the lock (a `finish` that took it over may
    have dropped the legacy turns), and they were not dropped (by `finish`, or the collection
    gone): then every conversation the migration made would look abandoned. Answers whether
    any legacy turn is there: a collection standing empty was emptied by its owners (each
    deleted their conversations, or was erased), and only the conversations of no document
    are removed then (what a run wrote while a person deleted one); never is the operator
    told to bring back, from a backup, what the owners deleted."""
    run.fence()
    standing = run.db.list_collection_names(filter={"name": run.source})
    if not standing or dropped_at(run.db):
        raise MigrationError(
            f"{run.source} holds no legacy turn any more (dropped while this run went on?): "
            "every conversation the migration made would look abandoned; removing none. "
            "Restore the legacy turns (from a backup) before running again"
        )
    return run.db[run.source].find_one(LEGACY_FILTER, {"_id": 1}) is not None


def _forget_texts_of_removed(db: Database[dict[str, Any]], bare: list[str]) -> None:
    """The whole texts kept under conversations removed with no message to name them (the
    run wrote them before it was stopped): those whose document is gone now, not one a
    person created again under the id since."""
    if bare:
        still = {d["_id"] for d in db[CONVERSATIONS].find({"_id": {"$in": bare}}, {"_id": 1})}
        full_texts.forget_conversations(db, [cid for cid in bare if cid not in still])


def remove(run: Explosion) -> list[Abandoned]:
    """A run's last step, once it has gone through every conversation: remove each abandoned
    conversation holding only the migration's messages (unless a dry run); answer those left
    because live turns wrote to them."""
    turns_left = _still_safe(run)
    left: list[Abandoned] = []
    for found in chunks(run.db, documents=turns_left):
        left += [item for item in found if item.live]
        gone = [item for item in found if not item.live]
        if gone and not run.options.dry_run and not _still_safe(run):
            gone = [item for item in gone if not item.stored]  # emptied by their owners since
        run.counts.abandoned_removed += len(gone)
        if run.options.dry_run or not gone:
            continue
        ids = [item.conversation_id for item in gone]
        messages = [m for item in gone for m in item.migrated]
        run.db[MESSAGES].delete_many(
            {"conversation_id": {"$in": ids}, "_id": {"$in": [m["_id"] for m in messages]}}
        )
        full_texts.forget(run.db, [b for m in messages for b in stored_blob_ids(m)])
        bare = [item.conversation_id for item in gone if item.document_only and not item.migrated]
        # A document of no message goes only while still the migration's (one a person
        # created again under its id since draws an epoch).
        kept = {"$or": [{"_id": {"$nin": bare}}, {"epoch": None}]}
        run.db[CONVERSATIONS].delete_many(
            {"_id": {"$in": ids}, "turns.0": {"$exists": False}, **kept, **_NO_TURN_FIELD}
        )
        _forget_texts_of_removed(run.db, bare)
        problem_report.replace(run.db, ids, [], at=run.undated_at, bounds=run.options.bounds)
    run.counts.abandoned_left += len(left)
    return left
