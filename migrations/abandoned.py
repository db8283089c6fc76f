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
by search, and holding the `seq` values a new turn under the id takes. And the migration's
messages past the count of a conversation document of another life (someone started the
conversation again under the id before the next run) that no legacy turn filed under the id
goes by now (`_of_earlier_lives`): of those, only the messages go.

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
    NAMING_FIELDS,
    TURN_ONLY_FIELDS,
    LegacyTurn,
    not_identifiers,
    not_utf8_at,
    parse_turns,
    storable_text,
    stored_conversation_id,
    texts_not_identifiers,
    turn_names,
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
from migrations.relocate import CONVERSATION_FILTER, held_back
from migrations.writes import (
    MIGRATED,
    MIGRATIONS_EPOCH,
    NO_TURN_FIELD,
    holds_turn_fields,
    is_migrated,
    stored_count,
    written_by_migration,
)

CHUNK = 1000
"""Conversation documents looked at a time."""
_UNNAMED_BY_TEXT = (
    "object", "array", "binData", "date", "regex", "timestamp", "javascript", "symbol",
    "dbPointer", "minKey", "maxKey", "javascriptWithScope",
)  # fmt: skip
"""BSON types of a legacy conversation id that `id_filter` cannot find by the id's text."""
_READ = {
    "_id": 1, "conversation_id": 1, "legacy_conversation_id": 1, "turns": 1,
    "recent_turns": 1, "epoch": 1, MIGRATED: 1, **dict.fromkeys(CONVERSATION_COUNTERS, 1),
    **dict.fromkeys(TURN_ONLY_FIELDS, 1),
}  # fmt: skip
"""What is read of a conversation document: what tells whether the migration made it."""
_MIGRATIONS = {"$regex": f"^{re.escape(MIGRATED_TURN_PREFIX)}"}
"""A turn id of the migration's (`writes.is_migrated`), as a filter."""


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
    earlier: bool = False
    """A conversation document of another life stands under its id (`_of_earlier_lives`):
    only `migrated` goes, never the document, its other messages or its problems."""

    @property
    def reason(self) -> str:
        if self.earlier:
            return (
                f"holds {len(self.migrated)} messages of legacy turns past its conversation "
                "document's count that no legacy turn names now (a conversation deleted while "
                "a run wrote them, started again under the id since: its next turns would "
                "find their places taken): run the migration again, which removes them, and "
                "only them"
            )
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


def _named(
    db: Database[dict[str, Any]], sources: tuple[str, ...], documents: list[Mapping[str, Any]]
) -> set[str] | None:
    """Which of these conversations some legacy turn in `sources` makes now (None: a turn
    could not be read, so none is taken as abandoned)."""
    turns = _turns_of(db, sources, documents, {"_id": 1, "conversation_id": 1})
    return None if turns is None else {turn.stored_conversation_id for turn in turns}


def _turns_of(
    db: Database[dict[str, Any]],
    sources: tuple[str, ...],
    documents: list[Mapping[str, Any]],
    fields: dict[str, int] | None,
) -> list[LegacyTurn] | None:
    """The legacy turns that may make these conversations now, in each of `sources` (a dry
    run's: every collection whose turns the run's move merges, `relocate.turns_after_the_move`),
    by `_turns_in`. None: a turn could not be read."""
    found: list[LegacyTurn] = []
    for source in sources:
        turns = _turns_in(db, source, documents, fields)
        if turns is None:
            return None
        found += turns
    return found


def _turns_in(
    db: Database[dict[str, Any]],
    source: str,
    documents: list[Mapping[str, Any]],
    fields: dict[str, int] | None,
) -> list[LegacyTurn] | None:
    """The legacy turns that may make these conversations now, read with `fields` (all:
    None) from `source`, where they are (`relocate.turns_at`: in `agent_conversations` before
    the move and after a rollback, where every migrated conversation would look abandoned if
    they were looked for in the collection moved aside, which then does not stand), by the
    rule the read fallback names a conversation's turns by (`turns_known_as`); a turn's
    `stored_conversation_id` says which it makes. None: a turn could not be read."""
    made = turns_made_of(db, [str(d["_id"]) for d in documents], source=source)
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
        return parse_turns(db[source].find(query, fields), made.names)
    except InvalidInput:
        return None


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
    db: Database[dict[str, Any]],
    sources: tuple[str, ...],
    documents: list[Mapping[str, Any]],
    *,
    stored: bool = True,
) -> list[Abandoned]:
    """The abandoned conversations of these documents (not `stored`: ids of conversations of
    no document holding some message of the migration's, `_not_held`), by the legacy turns
    in `sources`."""
    made, bare = _migrated(db, documents) if stored else (documents, set())
    named = _named(db, sources, made) if made else set()
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


def chunks(
    db: Database[dict[str, Any]],
    *,
    source: str,
    documents: bool = True,
    also: tuple[str, ...] = (),
) -> Iterator[list[Abandoned]]:
    """The abandoned conversations, by the legacy turns in `source` (`relocate.turns_at`) and
    `also` (a dry run's: the other collection whose turns the run's move merges in), a
    chunk of `CHUNK` conversation documents at a time (unless not `documents`); then the
    migration's messages no conversation document of theirs holds (`_not_held`): those whose
    document is gone, and those past the count of a document of another life
    (`_of_earlier_lives`). None a document no run reads holds back (`relocate.held_back`: a
    legacy turn gaining a counter since is still its conversation's, which no legacy turn may
    seem to make now)."""
    held = held_back(db)
    sources = (source, *also)
    if documents:
        read = db[CONVERSATIONS].find(CONVERSATION_FILTER, _READ).sort("_id", 1)
        for chunk in batches(iter(read), CHUNK):
            yield _abandoned(db, sources, [d for d in chunk if d["_id"] not in held])
    for found in batches(_not_held(db, held), CHUNK):
        gone: list[Mapping[str, Any]] = [{"_id": cid} for cid, d in found if d is None]
        if gone:
            yield _abandoned(db, sources, gone, stored=False)
        standing = [document for _, document in found if document is not None]
        if standing:
            yield _of_earlier_lives(db, sources, standing)


def _not_held(
    db: Database[dict[str, Any]], held: set[str]
) -> Iterator[tuple[str, Mapping[str, Any] | None]]:
    """The conversations holding a message of the migration's that no conversation document
    of theirs holds: with no document (a run wrote their messages after a person deleted
    the conversation, maybe only those of its later insert commands), or with one past whose
    count (`message_count`) the migration's last message stands and that is not the
    migration's (`writes.written_by_migration`): another life of the conversation, started
    under the id since, maybe (`_of_earlier_lives` tells). One pass over the migration's
    messages' conversation ids and last `seq` values (grouped by the server), and one read
    of their documents a chunk at a time."""
    grouped = db[MESSAGES].aggregate(
        [
            {"$match": {"turn_id": _MIGRATIONS}},
            {"$group": {"_id": "$conversation_id", "last": {"$max": "$seq"}}},
        ],
        allowDiskUse=True,
    )
    for chunk in batches(grouped, CHUNK):
        ids = [g["_id"] for g in chunk]
        query = {"$and": [{"_id": {"$in": ids}}, CONVERSATION_FILTER]}
        stored = {d["_id"]: d for d in db[CONVERSATIONS].find(query, _READ)}
        for g in (g for g in chunk if g["_id"] not in held):
            document = stored.get(g["_id"])
            if document is None:
                yield g["_id"], None
            elif _past_count(document, g["last"]) and not written_by_migration(document):
                yield g["_id"], document


def _past_count(document: Mapping[str, Any], seq: Any) -> bool:
    """Whether a message at `seq` stands past what the conversation document counts."""
    count = stored_count(document)
    return count is not None and isinstance(seq, int | float) and seq >= count


def _of_earlier_lives(
    db: Database[dict[str, Any]], sources: tuple[str, ...], documents: list[Mapping[str, Any]]
) -> list[Abandoned]:
    """The migration's messages past the count of these conversation documents that are of
    another life than theirs: the conversation's first message (`seq` 0) is not the
    migration's (a conversation the migration made is `_abandoned`'s), and no legacy turn
    filed under the conversation now goes by the message's turn id (a person deleted the
    conversation while a run wrote it, and someone started it again under the id, before
    the run, killed, could take them back out). A live message carries an epoch and a turn
    id of its own, never the migration's: none is ever taken. One read of their first
    messages, one of the legacy turns, one of those messages."""
    ids = [d["_id"] for d in documents]
    query = {"conversation_id": {"$in": ids}, "seq": 0}
    first = {m["conversation_id"]: m.get("turn_id") for m in db[MESSAGES].find(query)}
    others = [d for d in documents if not is_migrated(first.get(d["_id"]))]
    turns = _turns_of(db, sources, others, None) if others else []
    if turns is None:
        return []
    named = _turn_ids(turns)
    past = [
        {"conversation_id": d["_id"], "seq": {"$gte": stored_count(d)}, "turn_id": _MIGRATIONS}
        for d in others
    ]
    found: dict[str, Abandoned] = {}
    for message in db[MESSAGES].find({"$or": past}) if past else ():
        cid = message["conversation_id"]
        if message.get("epoch") is None and message["turn_id"] not in named.get(cid, set()):
            found.setdefault(cid, Abandoned(cid, earlier=True)).migrated.append(message)
    return list(found.values())


def _turn_ids(turns: list[LegacyTurn]) -> dict[str, set[str]]:
    """conversation id -> every turn id its legacy turns go by now: the one each goes by in
    its conversation (`turn_names`, over all of its turns), and the one its `_id` alone
    would give it, so that no message of a turn filed there is ever taken."""
    by_conversation: dict[str, list[LegacyTurn]] = {}
    for turn in turns:
        by_conversation.setdefault(turn.stored_conversation_id, []).append(turn)
    return {
        cid: {name.turn_id for name in turn_names(group).values()}
        | {f"{MIGRATED_TURN_PREFIX}{turn.key}" for turn in group}
        for cid, group in by_conversation.items()
    }


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
    for found in chunks(run.db, source=run.source, documents=turns_left, also=run.also):
        left += [item for item in found if item.live]
        gone = [item for item in found if not item.live]
        if gone and not run.options.dry_run and not _still_safe(run):
            # emptied by their owners since: only what no document of theirs holds goes
            gone = [item for item in gone if not item.stored or item.earlier]
        run.counts.abandoned_removed += sum(1 for item in gone if not item.earlier)
        run.counts.earlier_removed += sum(1 for item in gone if item.earlier)
        if run.options.dry_run or not gone:
            continue
        ids = [item.conversation_id for item in gone]
        messages = [m for item in gone for m in item.migrated]
        run.db[MESSAGES].delete_many(
            {"conversation_id": {"$in": ids}, "_id": {"$in": [m["_id"] for m in messages]}}
        )
        full_texts.forget(run.db, [b for m in messages for b in stored_blob_ids(m)])
        # Of a conversation of another life (`earlier`) only the migration's messages go:
        # its document, its other messages and its problems are the new life's.
        ids = [item.conversation_id for item in gone if not item.earlier]
        bare = [item.conversation_id for item in gone if item.document_only and not item.migrated]
        # A document of no message goes only while still the migration's (one a person
        # created again under its id since draws an epoch of its own, never `migrated`).
        kept = {"$or": [{"_id": {"$nin": bare}}, *MIGRATIONS_EPOCH["$or"]]}
        run.db[CONVERSATIONS].delete_many(
            {"_id": {"$in": ids}, "turns.0": {"$exists": False}, **kept, **NO_TURN_FIELD}
        )
        _forget_texts_of_removed(run.db, bare)
        problem_report.replace(run.db, ids, [], at=run.undated_at, bounds=run.options.bounds)
    run.counts.abandoned_left += len(left)
    return left


FILED_AS_READ = ("unread_conversation", "invalid_conversation")
"""The kinds of problem a run files under the conversation id as its turns hold it
(`explode._unread`, `explode._parsed`: a Regex or a DBRef under its text, `Regex('a.b', 0)`),
which names no conversation a run converts once the id is stored otherwise."""
_NOT_TEXT = {
    "$or": [
        {"conversation_id": {"$not": {"$type": "string"}}},
        {"conversation_id": {"$type": "array"}},
    ]
}
"""The turns whose conversation id is no text (or none), an array too."""


def forget_problems_of_ids_gone(run: Explosion) -> None:
    """A run's last step, once it has gone through every conversation: the problems of a kind
    filed under the id as read (`FILED_AS_READ`) that no legacy turn goes by now, neither as
    it holds its id nor as it is stored, are deleted: an operator stored the id as text, as
    advised, and the run converted the conversation under that id, or its turns were
    deleted. No other run replaces them (each replaces those of the ids it converts), and
    the report says what the current code makes of the data. One read of the records, one
    of the turns under their texts, and one of the turns whose id is no plain text; only
    while such records stand. A dry run deletes nothing."""
    recorded = run.db[problem_report.PROBLEMS].find(
        {"kind": {"$in": list(FILED_AS_READ)}}, {"conversation_id": 1}
    )
    ids = {d.get("conversation_id") for d in recorded}
    named = sorted(i for i in ids if isinstance(i, str) and not_utf8_at(i) is None)
    if run.options.dry_run or not named:
        return
    source = run.db[run.source]
    held = {t.get("conversation_id") for t in source.find({"conversation_id": {"$in": named}})}
    odd = {"$or": [texts_not_identifiers("conversation_id"), _NOT_TEXT]}
    for turn in source.find({"$and": [LEGACY_FILTER, odd]}, NAMING_FIELDS):
        held.add(storable_text(str(turn.get("conversation_id"))))  # as a problem holds it
        try:
            held.add(storable_text(stored_conversation_id(turn)))
        except (InvalidInput, UnicodeEncodeError):
            continue
    gone = [i for i in named if i not in held]
    if gone:
        run.fence()
        run.db[problem_report.PROBLEMS].delete_many(
            {"conversation_id": {"$in": gone}, "kind": {"$in": list(FILED_AS_READ)}}
        )
