"""What one batch writes, worked out before anything is written, so a dry run reports exactly
what a run does; then the writes themselves, each in bounded commands.

Planning reads what is already there (conversation documents, messages at the
batch's `seq` values, whole-text files) and keeps only what is missing or
different; a conversation document never gives back a `seq` a stored message
holds. A conversation whose first `seq` values hold messages the
migration did not write was logged to live (before it was migrated, or after, where its
legacy turns now convert to more messages than the run stored): its legacy turns are not
merged, and the problem says whether the live messages already hold their content (placed)
or not (content only the legacy turns hold). What a person changed since a run stays
theirs: a document a person popped messages from, or a live turn wrote to, is never
overwritten, and the messages a person popped are never put back (`popped`); where its legacy
turns now convert to a message at a `seq` that document does not cover, or a live turn holds,
nothing of them is merged (`unmerged`: a `conversation_changed_since` problem keeps them).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import bson
from bson import Int64
from pydantic import BaseModel, ValidationError
from pymongo import InsertOne, ReplaceOne, ReturnDocument
from pymongo.database import Database
from pymongo.errors import BulkWriteError

from agent_store.core import (
    RESOLVED_PROMPTS_KEPT,
    AgentMessage,
    AnsweredPrompt,
    ApprovedCall,
    Conversation,
    message_adapter,
    messages_adapter,
)
from agent_store.legacy import (
    CLAIMED_FROM,
    CONVERSATION_COUNTERS,
    TURN_ONLY_FIELDS,
    LegacyConversion,
    LegacyTurn,
    Problem,
    as_count,
    sort_turns,
)
from agent_store.store import (
    CONVERSATIONS,
    DEFAULT_MARKERS,
    MESSAGES,
    MIGRATED_TURN_PREFIX,
    MIGRATING,
    NAMED_WINDOW,
    FullText,
    Named,
    RuntimeContextMarkers,
    TurnRules,
    count_turn_starts,
    first_named,
    kept_blob_ids,
    named_window,
    new_life,
    of_epoch,
    only_duplicates,
    pending_after,
    renamed,
    stored_turn_record,
    turns_of,
)
from migrations import full_texts, lives
from migrations.bounds import Bounds, bounded
from migrations.claims import claims_recorded
from migrations.keys import id_key, identity
from migrations.lease import STATE, STATE_ID
from migrations.relocate import CONVERSATION_FILTER
from migrations.settings import SERVICE_DEFAULTS
from migrations.transcript import not_held


@dataclass
class Converted:
    """One conversation's legacy turns and what the converter made of them."""

    turns: list[LegacyTurn]
    conversion: LegacyConversion
    held: list[LegacyTurn] = field(default_factory=list)
    """For a conversation no other legacy turn makes (`explode.live_only`): its dual-written
    turns, whose messages are stored. They fence its writes as `turns` do (`_turns_since`)."""
    copies: int = 0
    """How many held dual-written copies name it (`explode._as_copies_say`; `held`, for one
    only they make): the new service logged to it during the transition, so it is a
    conversation of the transition, not one logged to live before its migration
    (`migrated_to`)."""
    spellings: int = 1
    """How many values (BSON values of `conversation_id`) its legacy turns name it by: `42` and
    `"42"`, a legacy id and the id derived from it. A conversation named more than one way is
    converted whole by each batch holding one of them (`explode.convert_batch`)."""
    markers: RuntimeContextMarkers = DEFAULT_MARKERS
    """The markers its conversion stripped runtime context by (the service's): its
    transcript leaves that context out by them too (`transcript.from_legacy`)."""


@dataclass
class Planned:
    """The writes of one batch, in the order they are made."""

    full_texts: list[FullText] = field(default_factory=list)
    conversations: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    rewritten: list[dict[str, Any]] = field(default_factory=list)
    """Messages an earlier run stored whose legacy turn converts to something else now (edited
    since, or a newer converter): replaced by what it converts to."""
    moved: dict[str, list[str]] = field(default_factory=dict)
    """Ids of messages an earlier run stored where the legacy turns, edited since, no longer
    put them (another message holds their `seq` now, or none), by conversation: removed
    before the inserts."""
    stale_texts: list[str] = field(default_factory=list)
    """Files of whole texts that differ from what their legacy turn converts to now."""
    live: list[Problem] = field(default_factory=list)
    """Problems of conversations already live: their legacy turns are not merged."""
    read: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    """The document the plan read for each conversation it writes to (None: none was stored):
    a document's write only replaces that one, or creates one where none was (`_write`), and
    the rest is written only while the document is as planned (`apply`)."""
    converted: dict[str, Converted] = field(default_factory=dict)
    """What each conversation it writes to converts to: a live turn since the plan makes it
    `conversation_already_live` (`apply`)."""
    rules: TurnRules = SERVICE_DEFAULTS
    """How the service stores turns (`migrations.settings`): the turn records kept on a
    document, the length of the automatic names retaken."""
    names_given: dict[str, str | None] = field(default_factory=dict)
    """For each conversation some of whose migrated messages' turns no legacy turn makes now
    (erased, deleted): the name its legacy turns give as their own (`name`, `_turns_name`;
    None: none). A runtime name no legacy turn gives on a document a live turn wrote to
    since was given by one of those turns, and is taken back (`_names_retaken`)."""


@dataclass
class Applied:
    """What `apply` wrote, and what it did not."""

    written: int = 0
    """Messages inserted or rewritten."""
    documents: int = 0
    """Conversation documents inserted or replaced (none for a conversation `skipped`)."""
    full_texts: int = 0
    """Whole texts written (none of a conversation `skipped`)."""
    problems: list[Problem] = field(default_factory=list)
    """Problems of races with the live service: a message's `seq` taken (`live_conflict`), a
    conversation a live turn wrote to since the plan (`conversation_already_live`)."""
    gone: set[str] = field(default_factory=set)
    """Conversations whose document was deleted since the plan, or whose legacy turns went or
    changed owner (`reowned`): nothing of theirs written past the change."""
    reowned: set[str] = field(default_factory=set)
    """Conversations some legacy turn of which names another owner than the plan read (an
    account claim since): what the plan holds would leave them to the old owner, so nothing
    more of theirs is written; the next run migrates them under the owner named then."""


def _taken(
    db: Database[dict[str, Any]], wanted: Sequence[LegacyConversion]
) -> dict[str, dict[int, dict[str, Any]]]:
    """conversation id -> seq -> the message stored at the batch's seq values."""
    clauses = [
        {"conversation_id": c.conversation_id, "seq": {"$lt": len(c.messages)}} for c in wanted
    ]
    taken: dict[str, dict[int, dict[str, Any]]] = {c.conversation_id: {} for c in wanted}
    for doc in db[MESSAGES].find({"$or": clauses}):
        taken[doc["conversation_id"]][int(doc["seq"])] = doc
    return taken


def _stored_past(db: Database[dict[str, Any]], conversation_id: str, seq: int) -> list[Any]:
    """The messages stored from `seq` on, in `seq` order."""
    query = {"conversation_id": conversation_id, "seq": {"$gte": seq}}
    return list(db[MESSAGES].find(query).sort("seq", 1))


MIGRATED_TURN_ID = {"$regex": f"^{re.escape(MIGRATED_TURN_PREFIX)}"}
"""The turn ids of the migration's own messages (`is_migrated`), as a query matches them."""


def is_migrated(turn_id: Any) -> bool:
    """Whether a message is the migration's own: its turn id is a legacy turn's (`legacy-…`),
    which no live turn may take (whichever conversation that legacy turn is filed in now)."""
    return isinstance(turn_id, str) and turn_id.startswith(MIGRATED_TURN_PREFIX)


def owner_after(existing: dict[str, Any] | None, wanted: Conversation) -> str | None:
    """The owner the conversation document holds once a run wrote it: the wanted one, or the
    stored one's when the run leaves it (a document the live logger wrote to). The migration's
    messages carry it (DESIGN §3: the denormalized owner)."""
    if written_since(existing):
        return readable(existing).get("user_id")
    return wanted.user_id


def same_bson(a: Any, b: Any) -> bool:
    """Whether two values are what BSON stores alike, the one rule every comparison of what is
    stored with what a run plans goes by: a NaN is the same as a NaN (Python's `==` finds it
    unequal to itself: a rerun would rewrite it every time and the gate never pass), while
    `0.0` and `-0.0`, `120` and `120.0`, `True` and `1`, which `==` finds equal, are not (as
    the move aside compares a copy, `relocate`). Models by every field, the store's
    bookkeeping too; documents by their keys, in any order; a list as an array."""
    if isinstance(a, BaseModel) or isinstance(b, BaseModel):
        return type(a) is type(b) and same_bson(dict(a), dict(b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_bson(a[key], b[key]) for key in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(map(same_bson, a, b))
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    integers = all(isinstance(v, int) and not isinstance(v, bool) for v in (a, b))
    return (integers or type(a) is type(b)) and bool(a == b)


def readable(document: Mapping[str, Any] | None) -> dict[str, Any]:
    """A stored conversation document as the store's model takes it: each field, or entry of
    a list, it no longer takes (edited by hand: an answered prompt without its `seq`, a count
    written as text) left out, read as absent. Every read of a conversation document's fields
    in the migration goes through it, so none raises; the document itself still differs from
    what a run writes (`document_differs`), which writes it again. {} for none."""
    found = dict(document or {})
    for _ in range(len(found) + 1):
        try:
            Conversation.model_validate(found)
        except ValidationError as error:
            if not _leave_out(found, error):
                break
        else:
            break
    return found


def _leave_out(found: dict[str, Any], error: ValidationError) -> bool:
    """Leave out of `found` what `error` says the model does not take: the entries of a list
    it names by index, else the whole field. False when it names nothing `found` holds."""
    entries: dict[str, set[int]] = {}
    whole: set[str] = set()
    for problem in error.errors():
        loc = problem["loc"]
        key = loc[0] if loc else None
        if not isinstance(key, str) or key not in found:
            continue
        if len(loc) > 1 and isinstance(loc[1], int) and isinstance(found[key], list):
            entries.setdefault(key, set()).add(loc[1])
        else:
            whole.add(key)
    for key, indexes in entries.items():
        if key not in whole:
            found[key] = [v for i, v in enumerate(found[key]) if i not in indexes]
    for key in whole:
        del found[key]
    return bool(entries or whole)


def stored_count(document: Mapping[str, Any] | None) -> int | None:
    """How many messages a conversation document counts (`message_count`, the next free
    `seq`), read by one rule wherever the migration reads it (the abandoned conversations,
    the rerun, the gate): the legacy converter's rule for a count (`as_count`: a number of
    any BSON type, or its text in ASCII decimal digits, spaces around it aside), and whole;
    absent or null, 0. None for a value that is no count of messages (`"n/a"`, `[1]`,
    `"1.5"`, a bool, a negative number, blank text): edited by hand, which the caller names
    rather than guess (no traceback)."""
    value = (document or {}).get("message_count")
    if value is None:
        return 0
    try:
        count = as_count(value)
    except ValueError:
        return None
    number = value.strip() if isinstance(value, str) else value
    if count is None or float(number) != count:
        return None
    return count


def counters_as_numbers(document: Mapping[str, Any]) -> bool:
    """Whether a conversation document's counters (`CONVERSATION_COUNTERS`) are stored as
    numbers, as a run and the store write them: the model reads `"2"` as 2, but the store's
    next turn adds to them in the database (`$inc`), which refuses text, a bool or a list."""
    return all(
        isinstance(value, int | float) and not isinstance(value, bool)
        for name in CONVERSATION_COUNTERS
        if (value := document.get(name)) is not None
    )


def holds_turn_fields(document: Mapping[str, Any]) -> bool:
    """Whether a document holds a field only a legacy turn holds (`TURN_ONLY_FIELDS`): no
    conversation document the migration wrote does. One in `agent_conversations` holding a
    conversation document's counters too is neither (`relocate.NEITHER_FILTER`): never moved
    or converted, never removed, never written over (`NO_TURN_FIELD`), and named by the
    gate. The counters cannot tell whether it is a turn or a conversation document, so
    neither is guessed: either guess could lose words of the other."""
    return any(name in document for name in TURN_ONLY_FIELDS)


NO_TURN_FIELD: dict[str, Any] = {name: {"$exists": False} for name in TURN_ONLY_FIELDS}
"""No field only a legacy turn holds (`holds_turn_fields`), as a filter: every replace or
delete of a conversation document by the migration holds it, so none takes such a document,
even one edited so since it was read."""


def written_by_migration(document: Mapping[str, Any]) -> bool:
    """Whether a conversation document is one the migration wrote, whatever became of its
    messages: the one definition wherever a document is removed or taken as the migration's
    (`abandoned`). It holds what a run writes on every document (`wanted_document`: a text
    `_id` that is its `conversation_id`, both counters, a number of messages above 0, stored
    as a number: `stored_count`) and no field only a legacy turn holds (`holds_turn_fields`);
    no turn was logged to it (no turn records, of either release), and its `epoch` is the
    migration's (`MIGRATIONS_EPOCH`): none (an earlier release's run drew none), or one a run
    drew, marked `migrated`, which no document a person (`upsert_conversation`, counting
    none), a fork or a live turn creates holds."""
    cid = document.get("_id")
    return (
        isinstance(cid, str)
        and document.get("conversation_id") == cid
        and all(name in document for name in CONVERSATION_COUNTERS)
        and isinstance(document["message_count"], int)
        and (stored_count(document) or 0) > 0
        and not holds_turn_fields(document)
        and not document.get("turns")
        and not document.get("recent_turns")
        and (document.get("epoch") is None or document.get(MIGRATED) is True)
    )


MIGRATED = "migrated"
"""The field a conversation document a run created holds (`Conversation.migrated`): its
`epoch` was drawn by the migration."""
MIGRATIONS_EPOCH: dict[str, Any] = {"$or": [{"epoch": None}, {MIGRATED: True}]}
"""A conversation document whose `epoch` is the migration's (`written_by_migration`), as a
filter: none, or one a run drew."""


def written_since(existing: Mapping[str, Any] | None) -> bool:
    """Whether a stored conversation document is no longer the migration's alone: the live
    logger recorded a turn in it (`turns`), or a person popped messages from it (`pops`).
    A rerun never overwrites such a document: what they changed stays theirs."""
    return existing is not None and bool(existing.get("turns") or existing.get("pops"))


def popped(existing: Mapping[str, Any] | None) -> set[str]:
    """The ids of the messages a person popped from the conversation, as its document lists
    them (`popped_messages`, the newest `POPPED_MESSAGES_KEPT`): a change made since the run,
    which a rerun never undoes (it puts none of them back) and `verify` and `finish` read as
    the person's (never missing). An entry naming its message is read however else it was
    edited (`readable` would leave it out, and a run would put the message back); a list
    edited into something else lists none."""
    found = (existing or {}).get("popped_messages")
    entries = found if isinstance(found, list) else []
    return {str(p["i"]) for p in entries if isinstance(p, Mapping) and "i" in p}


def differs(stored: AgentMessage, wanted: AgentMessage) -> bool:
    """Whether a stored message holds other content, in any field, than the conversion's
    (its owner aside: it follows the conversation document's, `owner_after`, which a claim
    may have moved), as BSON stores it (`same_bson`). The rerun and the exit gate both ask."""
    return not same_bson(
        stored.model_dump(exclude={"user_id"}), wanted.model_dump(exclude={"user_id"})
    )


def _stale_texts(db: Database[dict[str, Any]], wanted: Sequence[FullText]) -> set[str]:
    """The files stored for these whole texts that hold another text, or none readable (a
    run killed while rewriting one)."""
    present = full_texts.present(db, (f.blob_id for f in wanted))
    stored = full_texts.texts(db, present)
    return {f.blob_id for f in wanted if f.blob_id in present and stored.get(f.blob_id) != f.text}


def _next_free_seq(db: Database[dict[str, Any]], ids: list[str]) -> dict[str, int]:
    """The `seq` after the last message stored for each conversation (one aggregation)."""
    found = db[MESSAGES].aggregate(
        [
            {"$match": {"conversation_id": {"$in": ids}}},
            {"$group": {"_id": "$conversation_id", "last": {"$max": "$seq"}}},
        ]
    )
    return {d["_id"]: int(d["last"]) + 1 for d in found if d.get("last") is not None}


def carried_epochs(db: Database[dict[str, Any]], ids: list[str]) -> dict[str, str]:
    """conversation id -> the `epoch` its stored live messages carry: that of the live message
    with the lowest `seq` carrying one, the first past the migrated ones, not a late insert
    of a conversation deleted earlier under the id lying past the live turns (one
    aggregation on the `conversation_id, seq` index; conversations whose live messages
    carry none are left out). The migration's own messages carry none, so one carrying an
    epoch (edited so) tells no life: the store serves it as none of the conversation's, the
    gate names it and a run writes it again (`served_as_written`)."""
    live = {"epoch": {"$type": "string"}, "turn_id": {"$not": MIGRATED_TURN_ID}}
    found = db[MESSAGES].aggregate(
        [
            {"$match": {"conversation_id": {"$in": ids}, **live}},
            {"$sort": {"conversation_id": 1, "seq": 1}},
            {"$group": {"_id": "$conversation_id", "epoch": {"$first": "$epoch"}}},
        ]
    )
    return {d["_id"]: d["epoch"] for d in found}


def live_detail(taken: int, extent: int, after: bool) -> str:
    """How a conversation was found logged to live: `taken` of the first `extent` `seq`
    values its legacy turns convert to hold messages the migration did not write; `after`
    when the conversation holds the migration's messages too (the live turn came after the
    migration: the legacy turns convert to more messages now than the run stored)."""
    held = (
        f"{taken} of the first {extent} seq values already hold messages the migration "
        "did not write"
    )
    if after:
        return (
            f"{held}: a live turn logged after the migration holds places its legacy turns "
            "convert to now (a legacy turn added or edited since the run?)"
        )
    return f"{held} (the conversation was logged to before it was migrated)"


ALREADY_LIVE = "conversation_already_live"
"""The problem of a conversation logged to live where its legacy turns go (`already_live`)."""


def _live_problem(db: Database[dict[str, Any]], item: Converted, detail: str) -> Problem:
    """A conversation logged to live where its legacy turns would go: they are not merged;
    `detail` says how it was found."""
    conversion = item.conversion
    cid = conversion.conversation_id
    live = full_texts.stored_messages(db, [cid])[cid]
    unheld = not_held(live, item.turns, conversion, item.markers)
    held = not unheld
    detail += "; its legacy turns were not merged"
    detail += "; the live messages hold their content" if held else f"; {unheld[0]}"
    return already_live(conversion, detail, held=held)


def already_live(conversion: LegacyConversion, detail: str, *, held: bool) -> Problem:
    """The `conversation_already_live` problem of a conversation logged to live where its
    legacy turns go, found as `detail` says: placed when the live messages hold the legacy
    content (`held`), else keeping every message its legacy turns convert to, for an operator
    to keep elsewhere and accept. A run records it; the gate rebuilds it from the legacy
    turns as they are now, to tell whether the record and an acceptance still cover them."""
    return Problem(
        conversation_id=conversion.conversation_id,
        legacy_id="*",
        kind=ALREADY_LIVE,
        detail=detail,
        content=None
        if held
        else [m.model_dump(mode="json", by_alias=True) for m in conversion.messages],
        placed=held,
    )


STOPPED_WHILE_WRITING = (
    "a run was stopped while writing it (its document is marked as being migrated, "
    "its messages perhaps not all in): run the migration again"
)
"""What `verify` and `finish` say of a conversation whose document is left `MIGRATING`."""


def left_marked(db: Database[dict[str, Any]], listed: int) -> tuple[int, list[str]]:
    """How many conversation documents are marked `MIGRATING` (a run writing them, or one
    stopped before it removed the mark: the service answers them from their legacy turns
    and refuses their writes), and the ids of the first `listed`: one pass over the
    documents' ids."""
    count, ids = 0, list[str]()
    for found in db[CONVERSATIONS].find({MIGRATING: {"$exists": True}}, {"_id": 1}):
        count += 1
        if len(ids) < listed:
            ids.append(str(found["_id"]))
    return count, ids


def document_differs(existing: dict[str, Any] | None, wanted: Conversation) -> bool:
    """Whether the stored conversation document differs from the wanted one (and is the
    migration's: one the live logger or a person's pop has written to is never overwritten,
    `written_since`), as BSON stores it (`same_bson`); one that no longer validates (edited by
    hand past what the store takes) differs, and is written again; one holding a legacy
    turn's fields (`holds_turn_fields`) is not the conversation's document: it differs, and
    no run writes over it (`_plan_one`). The rerun and the exit gate both ask."""
    if existing is None or existing.get(MIGRATING) is not None:
        return True  # none, or one a run wrote and did not finish (its messages not all in)
    if holds_turn_fields(existing):
        return True
    if written_since(existing):
        return False
    if not counters_as_numbers(existing):
        return True
    try:
        stored = Conversation.model_validate(existing)
    except ValidationError:
        return True
    if stored.legacy_user_id is None:  # written before it was recorded: none is kept
        wanted = wanted.model_copy(update={"legacy_user_id": None})
    return not same_bson(stored, wanted)


def wanted_document(
    conversion: LegacyConversion,
    existing: dict[str, Any] | None,
    live: Sequence[AgentMessage],
    earlier: Mapping[str, Any] | None,
) -> Conversation:
    """The conversation document the legacy turns make now, as a run writes it: its life
    (`life_of`: `earlier` the life it is written again with, `rebuilt_life`), the live
    messages stored past the legacy ones of that life only (`live`, in `seq` order; those of
    another epoch are a deleted conversation's late inserts, which the store's next turn
    meeting them takes away: never counted, folded or recorded as this one's); it never
    gives back a `seq` one of them holds, and holds what those live turns left
    (`_with_live_turns`), and keeps what people changed since (`existing`)."""
    assert conversion.conversation is not None
    life = life_of(existing, earlier, unmarked=any(m.epoch is None for m in live))
    live = [m for m in live if m.epoch in (None, life["epoch"])]
    stored_to = max(((m.seq or 0) + 1 for m in live), default=0)
    document = conversion.conversation.model_copy(
        update={
            "message_count": max(conversion.conversation.message_count, stored_to),
            **life,
        }
    )
    document = _kept_by_people(document, existing)
    if live and conversion.messages:
        document = _with_live_turns(document, live)
    return document


def life_of(
    existing: Mapping[str, Any] | None, earlier: Mapping[str, Any] | None, *, unmarked: bool
) -> dict[str, Any]:
    """The `epoch` (with `epoch_marks` and `migrated`) of the conversation document a run
    writes: the one `existing` holds, as it holds them (a rerun never draws another: the
    version a read served, and what documents beside it name, stay the conversation's);
    else the life it is written again with (`earlier`, `rebuilt_life`: the one a run wrote
    its document with before a rollback moved it away, or the one its live turns logged
    meanwhile carry; an epoch never changes once messages carry it, a delete takes only its
    own); else, for a document the run creates where no live message of an earlier release
    is stored (`unmarked`: they carry none), a new one as a live turn draws it (`new_life`),
    so a conversation the migration creates again under an id after a delete is another
    life (another version, none of the checkpoints or late inserts of the one deleted),
    whatever time its first legacy turn gives it. A document an earlier release migrated,
    which holds none, keeps none (its version and the documents naming its creation time
    stay its own); the migration's own messages carry none."""
    found = readable(existing)
    if isinstance(found.get("epoch"), str):
        return lives.life(found)
    if earlier is not None:
        return lives.life(earlier)
    if existing is not None or unmarked:
        return {"epoch": None}
    return new_life() | {"migrated": True}


def rebuilt_life(
    found: Mapping[str, Any] | None,
    carried: str | None,
    recorded: Mapping[str, Any] | None,
    stored: Sequence[Mapping[str, Any]],
    *,
    held: bool,
    old_service: bool,
) -> Mapping[str, Any] | None:
    """The life a run writes the conversation's document again with, other than the one the
    document holds: for a standing document that holds none (an earlier release's), the
    epoch its live messages carry (`carried`, `carried_epochs`), unmarked (the document
    stood before epochs, so documents beside it may name only its creation time). For one
    no document stands for, the life a rollback moved away, and only while it was not
    deleted: a delete takes every message of the conversation's life, the migration's own
    too (they carry no epoch), and leaves at most late inserts of its live turns, none held
    by a dual-written copy (the delete takes those too). So while some message of it a
    delete would have taken is stored (among `stored`, its messages: the migration's; for
    one only dual-written copies make, `held`, its live turns'), it is the life a run last
    wrote its document with (`recorded`, `lives.recorded`), when its live messages carry
    that one or none, else the whole life they carry, its epoch and its marks
    (`carried_life`, `old_service`: whether the old service wrote a legacy turn of it,
    `written_by_old_service`); once deleted, none: the conversation the run creates again under the
    id draws its own (`life_of`), and the deleted one's late inserts are no messages of it.
    A message at its first `seq` counts too: a migrated conversation's first messages are the
    migration's, so a late insert lands past them; only a person's pops give that `seq`
    back, and a pop never ends a life (her turn logged again there after she popped every
    migrated message)."""
    if found is not None:
        return None if carried is None else {"epoch": carried}
    taken = (is_migrated(d.get("turn_id")) or d.get("seq") == 0 for d in stored)
    if not held and not any(taken):
        return None
    if recorded is not None and carried in (None, recorded.get("epoch")):
        return recorded
    return None if carried is None else carried_life(carried, stored, old_service=old_service)


def carried_life(
    epoch: str, stored: Sequence[Mapping[str, Any]], *, old_service: bool
) -> dict[str, Any]:
    """The whole life whose `epoch` the live messages of a conversation no document stands
    for carry (`stored`: every message stored under its id): epoch-marked (`epoch_marks`:
    documents beside it name that epoch, so only those are its own) when its document was
    created with it, by a release naming epochs (a conversation the new service created
    during the transition): none of them carries no epoch and the old service wrote none of
    its legacy turns (`old_service`: only the new service's dual-written copies are filed
    under its id). Else not, as the store leaves one whose document stood before epochs
    (its messages stored then, the migration's of an earlier release among them, carry
    none, unless its owner popped them all: the legacy turns they were made of still say
    so), whose first turn since drew the epoch and whose documents beside it may name only
    its creation time; and one the old service wrote to after a rollback, whose documents
    written then name no epoch either: unmarked, they stay its own (marked, they would be
    hidden), at the cost of serving as its own a document of no life naming none."""
    marks = not old_service and all(d.get("epoch") is not None for d in stored)
    return {"epoch": epoch, "epoch_marks": marks}


def written_by_old_service(item: Converted) -> bool:
    """Whether the old service wrote some legacy turn of the conversation: one of those its
    conversion read is no dual-written copy (`dual_write: true`) the new service made."""
    return any(turn.dual_write_field is not True for turn in item.turns)


def _with_live_turns(document: Conversation, live: Sequence[AgentMessage]) -> Conversation:
    """The document of a conversation its legacy turns make, with what the live turns stored
    past them (logged during the transition, their document moved away by a rollback) left,
    as their reservations folded it onto the migrated document: what it awaits, by the ids
    of their messages (from what the legacy turns left pending; the prompts a person
    answered, as `_as_stored_messages_leave_it` gives them), how many turns it counts, and
    when it was last written to."""
    calls, hitl = pending_after(
        live,
        answered=_answers(document, live),
        before=(document.pending_calls, document.pending_hitl),
    )
    started = sum(count_turn_starts(turn) for turn in turns_of(live))
    return document.model_copy(
        update={
            "pending_calls": calls,
            "pending_hitl": hitl,
            "turn_count": document.turn_count + started,
            "updated_at": max(document.updated_at, *(m.created_at for m in live)),
        }
    )


def _answers(
    document: Conversation, messages: Sequence[AgentMessage]
) -> list[tuple[str, int, Any]]:
    """The answers a person gave to the conversation's prompts, as the fold of its stored
    `messages` takes them (`pending_after`): those the document kept, at their reach, and the
    requests its dual writes kept answered (`resolved_hitl`), reaching past every message
    (the rollback moved away the document that said how far each reached)."""
    answers = [
        (a.request_id, a.below, None if a.calls is None else tuple(a.calls))
        for a in document.answered_prompts
    ]
    past = max((m.seq or 0) + 1 for m in messages)
    given = {request_id for request_id, _, _ in answers}
    return answers + [(r, past, None) for r in document.resolved_hitl if r not in given]


def _live_records(live: Sequence[dict[str, Any]], kept: int) -> dict[str, Any]:
    """The turn records of the live turns stored past the legacy ones (in `seq` order),
    rebuilt from their messages: theirs went with the conversation document a rollback moved
    away, and a runtime retrying one of those turns must get its stored messages back, at
    the cost of any turn (the store's bookkeeping, never served: written by hand), the last
    `kept` of them (`TurnRules.turns_recorded`)."""
    recorded = (d for d in live if d.get("turn_id") is not None)  # a record is by turn id
    turns = itertools.groupby(recorded, key=lambda d: d.get("turn_id"))
    records = [stored_turn_record(list(run)) for _, run in turns]
    return {"turns": records[-kept:], "turns_dropped": Int64(max(0, len(records) - kept))}


def _as_stored_messages_leave_it(
    document: Conversation, live: Sequence[dict[str, Any]], name_chars: int
) -> Conversation:
    """The document of a conversation only live turns wrote (`explode.live_only`), with what
    its stored messages say where its dual writes cannot: what it awaits, by the ids of those
    messages, but the prompts a person answered (the answers the document kept, and the
    requests its dual writes kept answered, `resolved_hitl`, reaching past every message:
    the rollback moved away the document that said how far each reached), when it was
    last written to, and whether its name is automatic: its copies hold whatever name the
    conversation had, so one holding the name its stored messages give (`first_named`) is
    taken from them, as the store took it, and a pop of that message retakes it."""
    messages = messages_adapter.validate_python(live)
    named = first_named(messages, name_chars)
    automatic: dict[str, Any] = {}
    if named is not None and document.name_source == "runtime" and named.name == document.name:
        automatic = {"name_source": "auto", "name_message_id": named.message_id}
    calls, hitl = pending_after(messages, answered=_answers(document, messages))
    updated = max(document.updated_at, *(m.created_at for m in messages))
    return document.model_copy(
        update={"pending_calls": calls, "pending_hitl": hitl, "updated_at": updated} | automatic
    )


def _kept_by_people(document: Conversation, found: dict[str, Any] | None) -> Conversation:
    """What a person changed since the last run, a rerun keeps: their name, and a prompt they
    resolved stays resolved (that the document remembers, or, after a rollback moved the
    document away, that the dual write marked in `session_hitl`: `document.resolved_hitl`)."""
    if found is None:
        return document
    found = readable(found)
    # The prompts the new service resolved (`session_hitl`, marked by its dual write) and
    # those the document remembers: the same ones, but for a document written before.
    ids = [*(found.get("resolved_hitl") or []), *document.resolved_hitl]
    resolved = list(dict.fromkeys(ids))[-RESOLVED_PROMPTS_KEPT:]
    kept: dict[str, Any] = {"resolved_hitl": resolved}
    if found.get("approved_calls"):
        kept["approved_calls"] = found["approved_calls"]
    if found.get("answered_prompts"):
        answered = found["answered_prompts"]
        kept["answered_prompts"] = [AnsweredPrompt.model_validate(a) for a in answered]
    if found.get("name_source") == "set":
        kept |= {"name": found.get("name"), "name_source": "set"}
    pending = document.pending_hitl
    if pending is not None and pending.request_id in resolved:
        kept["pending_hitl"] = None
    return document.model_copy(update=kept)


def _plan_messages(
    db: Database[dict[str, Any]],
    planned: Planned,
    conversion: LegacyConversion,
    stored: dict[int, dict[str, Any]],
    documents: tuple[dict[str, Any] | None, Conversation],
    gone: set[str],
) -> None:
    """The conversion's messages and files to write: those missing (`stored`, by `seq`), and
    those stored with other content, another owner than the document's (`owner_after`), a
    stale file, or an epoch the store's reads of it leave out (`served_as_written`), rewritten
    (`documents`: the stored conversation document and the one the run writes); none of
    those a person popped (`gone`), nor their files."""
    owner, epoch = owner_after(*documents), documents[1].epoch
    kept = [f for f in conversion.full_texts if f.message_id not in gone]
    planned.full_texts += kept
    stale = _stale_texts(db, kept)
    planned.stale_texts += sorted(stale)
    for m in conversion.messages:
        if str(m.id) in gone:
            continue
        found = stored.get(m.seq or 0)
        dumped = m.model_dump(by_alias=True) | {"user_id": owner}
        if found is None:
            planned.messages.append(dumped)
        elif (
            (read := full_texts.stored_message(found)[0]) is None
            or differs(read, m)
            or found.get("user_id") != owner
            or not served_as_written(found, epoch)
            or stale & set(kept_blob_ids(m).values())
        ):
            planned.rewritten.append(dumped)


def served_as_written(stored: Mapping[str, Any], epoch: str | None) -> bool:
    """Whether the store serves a stored message of the migration's as the conversation's
    whose document holds `epoch`, as its reads filter messages (`of_epoch`): the migration's
    carry none; one carrying another (edited so) is left out of every read as another
    life's, and a run writes it again as the migration writes it."""
    return bool(of_epoch([stored], epoch))


def plan(
    db: Database[dict[str, Any]], batch: Sequence[Converted], rules: TurnRules = SERVICE_DEFAULTS
) -> Planned:
    """Read what is stored and work out the batch's writes, by the `rules` it was converted
    by."""
    planned = Planned(rules=rules)
    wanted = [item for item in batch if item.conversion.conversation is not None]
    if not wanted:
        return planned
    ids = [item.conversion.conversation_id for item in wanted]
    # Conversation documents only: before the move (a dry run) `agent_conversations` holds
    # the legacy turns too, and a turn whose `_id` is another conversation's id is no
    # document of that one (one holding a counter as well is neither, and read: it holds
    # the conversation back).
    query = {"_id": {"$in": ids}, **CONVERSATION_FILTER}
    existing = {d["_id"]: d for d in db[CONVERSATIONS].find(query)}
    taken = _taken(db, [item.conversion for item in wanted])
    next_free = _next_free_seq(db, ids)
    carried = carried_epochs(db, ids)
    recorded = lives.recorded(db, [cid for cid in ids if cid not in existing])
    for item in wanted:
        cid = item.conversion.conversation_id
        _plan_one(
            db,
            planned,
            item,
            existing.get(cid),
            taken[cid],
            next_free.get(cid, 0),
            (carried.get(cid), recorded.get(cid)),
        )
    kept = full_texts.present(db, (f.blob_id for f in planned.full_texts))
    stale_texts = set(planned.stale_texts)
    planned.full_texts = [
        f for f in planned.full_texts if f.blob_id not in kept or f.blob_id in stale_texts
    ]
    return planned


def _life_again(
    item: Converted,
    found: dict[str, Any] | None,
    lived: tuple[str | None, Mapping[str, Any] | None],
    messages: Sequence[Mapping[str, Any]],
) -> Mapping[str, Any] | None:
    """The life a run writes the conversation's document again with (`rebuilt_life`), by
    the messages stored under its id and the legacy turns its conversion read: its held
    dual-written copies, and whether the old service wrote one (`written_by_old_service`)."""
    return rebuilt_life(
        found,
        *lived,
        messages,
        held=bool(item.held),
        old_service=written_by_old_service(item),
    )


def _plan_one(
    db: Database[dict[str, Any]],
    planned: Planned,
    item: Converted,
    found: dict[str, Any] | None,
    stored: dict[int, dict[str, Any]],
    next_free: int,
    lived: tuple[str | None, Mapping[str, Any] | None],
) -> None:
    """One conversation's writes: `found` its stored document, `stored` the messages at its
    `seq` values, `next_free` the `seq` after its last stored message, `lived` the epoch its
    stored messages carry (`carried_epochs`) and the life a run last wrote its document with
    (`lives.recorded`), of which `rebuilt_life` takes the one it is written again with.
    Nothing of a conversation whose `_id` holds a document with a legacy turn's fields
    (`holds_turn_fields`): a run never writes over it, nor messages without their document;
    the gate names it (`gate.unread_documents`)."""
    if found is not None and holds_turn_fields(found):
        return
    conversion = item.conversion
    extent = len(conversion.messages)
    gone = popped(found)
    # A `seq` whose message a person popped is the person's: a turn logged there since is
    # theirs, never a live turn in the migration's way.
    at = {m.seq: m for m in conversion.messages if str(m.id) not in gone}
    cid = conversion.conversation_id
    foreign = [
        stored[seq or 0]
        for seq, m in at.items()
        if stored.get(seq or 0, {"_id": m.id})["_id"] != m.id
    ]
    past = _stored_past(db, cid, extent) if next_free > extent else []
    every = {int(d["seq"]): (str(d["_id"]), d.get("turn_id")) for d in [*stored.values(), *past]}
    earlier = _life_again(item, found, lived, [*stored.values(), *past])
    refused = _not_merged(db, item, found, every, foreign)
    if refused is not None:
        planned.live.append(refused)
        if found is None:  # live messages, no document: a rollback moved it away
            _plan_moved_away(planned, item, [*stored.values(), *past], earlier)
        return
    # Its own messages at other places than the legacy turns put them now (a turn edited
    # since gained or lost a message) are moved; live turns stored past the legacy ones
    # (logged before a rollback moved the live document away) keep their `seq` values,
    # and the next turn goes after them.
    for seq in [seq for seq in stored if seq not in at]:
        del stored[seq]  # a popped message's place: what holds it now is left as it is
    live = [d for d in past if not is_migrated(d.get("turn_id"))]
    _plan_moved(planned, item, foreign + past, found)
    for d in foreign:
        del stored[d["seq"]]
    live_messages = messages_adapter.validate_python(live)
    document = wanted_document(conversion, found, live_messages, earlier)
    live = of_epoch(live, document.epoch)
    if item.held and live:
        document = _as_stored_messages_leave_it(document, live, planned.rules.name_chars)
    planned.read[cid] = found
    planned.converted[cid] = item
    before = len(planned.messages) + len(planned.rewritten)
    _plan_messages(db, planned, conversion, stored, (found, document), gone)
    fills = cid in planned.moved or len(planned.messages) + len(planned.rewritten) > before
    _plan_document(planned, found, document, live, fills=fills)


def _plan_moved(
    planned: Planned,
    item: Converted,
    stored: Sequence[dict[str, Any]],
    found: Mapping[str, Any] | None,
) -> None:
    """The migration's messages among `stored` that the legacy turns no longer put there are
    moved: by the legacy turns' own conversion, or, for a conversation no legacy turn but its
    held copies makes, one whose document a rollback moved away (`found` None: legacy turns
    the old service deleted since); a standing one's are `abandoned`'s (of an earlier life of
    the conversation). When some are of a turn gone (erased, deleted), the name the turns
    left give is noted (`Planned.names_given`)."""
    ours = [d for d in stored if is_migrated(d.get("turn_id"))]
    if not ours or (item.held and found is not None):
        return
    cid = item.conversion.conversation_id
    planned.moved[cid] = [d["_id"] for d in ours]
    kept = {m.turn_id for m in item.conversion.messages}
    if any(d.get("turn_id") not in kept for d in ours):
        planned.names_given[cid] = _turns_name(item.turns)


def _turns_name(turns: Sequence[LegacyTurn]) -> str | None:
    """The name legacy turns give as their own: the last one's whose name shows something,
    as a conversation holds it (`LegacyTurn.shown_name`, the converter's rule)."""
    named = [name for t in sort_turns(turns) if (name := t.shown_name()) is not None]
    return named[-1] if named else None


def _plan_document(
    planned: Planned,
    found: dict[str, Any] | None,
    document: Conversation,
    live: Sequence[dict[str, Any]],
    *,
    fills: bool,
) -> None:
    """The conversation document a run writes, if any: one that differs from the stored one
    (`found`, `document_differs`; with the turn records of the `live` messages kept past the
    legacy ones), and one whose messages the run is about to write (`fills`:
    inserted, moved or rewritten), written marked `MIGRATING` until they are all in and
    looked at again (`apply`): meanwhile the service reads it from its legacy turns, whole,
    and refuses its writes, never serving a part. A document a live turn or a person's pop
    wrote to since (`written_since`) is never rewritten, so never marked."""
    marked = found is None or found.get(MIGRATING) is not None
    marked |= fills and not written_since(found)
    if not marked and not document_differs(found, document):
        return
    dumped = _dumped(document, live, planned.rules)
    if marked:
        dumped[MIGRATING] = True  # until its messages are in (`apply`)
    planned.conversations.append(dumped)


def _dumped(
    document: Conversation, live: Sequence[dict[str, Any]], rules: TurnRules
) -> dict[str, Any]:
    """A conversation document as a run writes it, with the turn records of the `live`
    messages kept past the legacy ones (`_live_records`)."""
    dumped = document.model_dump(by_alias=True)
    # The store's bookkeeping, never served (so no dump holds it): written by hand.
    if document.resolved_hitl:
        dumped["resolved_hitl"] = document.resolved_hitl
    if document.epoch is not None:
        dumped["epoch"] = document.epoch
    if document.epoch_marks:
        dumped["epoch_marks"] = True
    if document.migrated:
        dumped["migrated"] = True
    if document.name_message_id is not None:
        dumped["name_message_id"] = document.name_message_id
    if document.approved_calls:  # as read back from the document it replaces, every key
        dumped["approved_calls"] = [
            ApprovedCall.model_validate(call).model_dump() for call in document.approved_calls
        ]
    if document.answered_prompts:  # likewise
        dumped["answered_prompts"] = [
            a.model_dump(by_alias=True) for a in document.answered_prompts
        ]
    if live:
        dumped |= _live_records(live, rules.turns_recorded)
    return dumped


def _plan_moved_away(
    planned: Planned,
    item: Converted,
    stored: Sequence[dict[str, Any]],
    earlier: Mapping[str, Any] | None,
) -> None:
    """A conversation logged to live where its legacy turns go (a popped message's place, a
    legacy turn added since, or one the old service logged into a conversation the new
    service started), whose document a rollback moved away: its document is written again as
    the person left it (its live turns' records, their `seq` values kept, the next turn after
    them: listed and writable), and nothing else; its legacy turns are not merged (its
    `conversation_changed_since` or `conversation_already_live` problem keeps them), as when
    the document had stayed."""
    live = sorted(
        (d for d in stored if not is_migrated(d.get("turn_id"))), key=lambda d: int(d["seq"])
    )
    document = wanted_document(
        item.conversion, None, messages_adapter.validate_python(live), earlier
    )
    cid = item.conversion.conversation_id
    planned.conversations.append(_dumped(document, of_epoch(live, document.epoch), planned.rules))
    planned.read[cid] = None
    planned.converted[cid] = item


def _not_merged(
    db: Database[dict[str, Any]],
    item: Converted,
    found: dict[str, Any] | None,
    every: Mapping[int, tuple[str, Any]],
    foreign: Sequence[dict[str, Any]],
) -> Problem | None:
    """The problem of a conversation whose legacy turns are not merged, or None: one a person
    changed since the migration whose legacy turns changed since (`unmerged`; also when a
    rollback moved its document away: a live turn holds places of its legacy turns in a
    conversation of the transition), or one a live turn holds places of (`foreign`: messages
    the migration did not write where its legacy turns go) that is no conversation of the
    transition (`migrated_to`: the migration never wrote to it, and no held dual-written copy
    names it)."""
    conversion = item.conversion
    gone = popped(found)
    ours = migrated_to(conversion, every, gone, copies=item.copies)
    if unmerged(found, conversion, every, gone) and ours:
        return changed_problem(conversion)
    # The migration's own messages are those of legacy turns, these or any filed here
    # before (their turn ids are the migration's: no live writer may name a turn so).
    live = not all(is_migrated(d.get("turn_id")) for d in foreign)
    if live and found is None and ours:
        return changed_problem(conversion)  # its document moved away: `_plan_moved_away`
    if live or unmerged(found, conversion, every, gone):
        after = any(is_migrated(turn) for _, turn in every.values())
        extent = len(conversion.messages)
        return _live_problem(db, item, live_detail(len(foreign), extent, after))
    return None


def unmerged(
    found: Mapping[str, Any] | None,
    conversion: LegacyConversion,
    stored: Mapping[int, tuple[str, Any]],
    gone: set[str],
) -> bool:
    """Whether the legacy turns of a conversation a person changed since the migration
    (`written_since`: a live turn, a pop) convert now to a message at a `seq` its document
    does not cover (at or past its `message_count`, which a run never rewrites there), or
    where a message the migration did not write is stored: a legacy turn added or edited
    since, or a message popped before the newest ones the document remembers. The
    conversation is the person's, and its legacy turns are not merged (moving the
    migration's own messages within the count is no change of theirs). `stored`: `seq` ->
    (id, turn id) of every message stored; `gone`: the messages the person popped
    (`popped`). The rerun and the exit gate both ask."""
    if found is None or not written_since(found):
        return False
    count = stored_count(found) or 0  # no count: where the next turn goes is unknown
    for m in conversion.messages:
        seq, held = m.seq or 0, stored.get(m.seq or 0)
        if str(m.id) in gone:
            continue
        if seq >= count or (held is not None and held[0] != m.id and not is_migrated(held[1])):
            return True
    return False


def migrated_to(
    conversion: LegacyConversion,
    stored: Mapping[int, tuple[str, Any]],
    gone: set[str],
    *,
    copies: int = 0,
) -> bool:
    """Whether the conversation is one of the transition: a run wrote to it (it holds the
    migration's messages, or a person popped some of them), or the new service logged to it
    with the dual write on (`copies`: held dual-written copies name it, as for one it
    started or a fork it made). Else a conversation logged to live is
    `conversation_already_live`."""
    ids = {str(m.id) for m in conversion.messages}
    return bool(copies or gone & ids) or any(is_migrated(turn) for _, turn in stored.values())


CHANGED_SINCE = "conversation_changed_since"
"""The problem of a conversation a person changed since the migration whose legacy turns
changed since (`unmerged`)."""


def changed_problem(conversion: LegacyConversion) -> Problem:
    """What keeps the legacy turns of a conversation a person changed since the migration,
    not merged (`unmerged`): every message they convert to, for an operator to keep and
    accept. The same whatever the person does next, so an acceptance holds."""
    return Problem(
        conversation_id=conversion.conversation_id,
        legacy_id="*",
        kind=CHANGED_SINCE,
        detail=(
            "changed by a person since the migration (a live turn or a pop); its legacy turns "
            "convert to messages at seq values the conversation document does not cover, or "
            "a live turn holds (a legacy turn added or edited since, or a message popped "
            "earlier than the newest ones the document remembers), so they were not merged; "
            "the content here is every message they convert to now"
        ),
        content=[m.model_dump(mode="json", by_alias=True) for m in conversion.messages],
        placed=False,
    )


def apply(
    db: Database[dict[str, Any]],
    planned: Planned,
    bounds: Bounds,
    *,
    fence: Callable[[], None] = lambda: None,
    source: str,
) -> Applied:
    """Make the planned writes: conversation documents, then, for each conversation whose
    document is as planned (`_write_conversations`), whole texts, messages and rewritten
    messages.

    `fence` is called first: it raises when the run may no longer write (its lock taken over
    while it was paused since the plan). A conversation document is written only as the
    plan read it (`_write`), and only while the legacy turns the plan read are still in
    `source`; a conversation whose document is not as planned then (deleted, or written by
    a live turn, since the plan) or whose legacy turns are gone (a delete, an erasure) gets
    nothing else: its messages would stand without a document, or between a live turn's,
    or bring back what a person deleted. The legacy turns are looked for again before the
    messages: a conversation whose turns went or changed owner since the plan (a delete, an
    erasure, an account claim) gets none (`_turns_since`), and is left for the next run; and
    once more after them, for a change landing between that look and the inserts (which for
    a long conversation are several commands): what the run wrote of such a conversation is
    taken back out (`_take_back`)."""
    fence()
    applied = Applied()
    skipped = _write_conversations(db, planned, bounds, source, applied)
    for cid, found in skipped.items():
        if _live_since(found, planned.read.get(cid)):
            applied.problems.append(_live_problem(db, planned.converted[cid], LIVE_SINCE))
    applied.documents = sum(1 for d in planned.conversations if d["_id"] not in skipped)
    texts = [f for f in planned.full_texts if f.conversation_id not in skipped]
    full_texts.keep(db, texts, bounds)
    applied.full_texts = len(texts)
    writing = {cid: item for cid, item in planned.converted.items() if cid not in skipped}
    skipped |= _changed_since(_turns_since(db, source, writing), applied)
    applied.gone = {cid for cid, found in skipped.items() if found is None}
    retaking = _retakes_recorded(db, planned, [c for c in planned.moved if c not in skipped])
    if moved := [i for cid, ids in planned.moved.items() if cid not in skipped for i in ids]:
        db[MESSAGES].delete_many({"_id": {"$in": moved}})
    messages = [d for d in planned.messages if d["conversation_id"] not in skipped]
    sizes = [len(bson.encode(d)) for d in messages]
    for run in bounded(messages, sizes, bounds):
        try:
            db[MESSAGES].insert_many(run, ordered=False)
            applied.written += len(run)
        except BulkWriteError as exc:
            applied.written += len(run) - len(exc.details.get("writeErrors", []))
            applied.problems += _accept_identical(db, exc, run)
    rewritten = [d for d in planned.rewritten if d["conversation_id"] not in skipped]
    rewrites = [
        ReplaceOne({"_id": d["_id"], "conversation_id": d["conversation_id"]}, d) for d in rewritten
    ]
    for batch in bounded(rewrites, [len(bson.encode(d)) for d in rewritten], bounds):
        db[MESSAGES].bulk_write(batch, ordered=False)
    applied.written += len(rewritten)
    _names_retaken(db, planned, retaking, source)
    written = {cid: item for cid, item in writing.items() if cid not in skipped}
    _after_messages(db, planned, _turns_since(db, source, written), texts, applied)
    return applied


RETAKING = "names_retaking"
"""The migration's state (`STATE`) lists here each conversation whose name a run is to retake
(`_names_retaken`), with the name its legacy turns left give (`Planned.names_given`):
recorded before the run removes the conversation's messages and taken off once its name
and copies are retaken, so a run stopped in between leaves the retake to the next one."""


def _retakes_recorded(
    db: Database[dict[str, Any]], planned: Planned, ids: Sequence[str]
) -> list[str]:
    """Record the retakes of the conversations `ids` (whose messages the run is about to
    remove) before the removal (`RETAKING`), and read back those an earlier run recorded
    and did not finish (it stopped after its removal): every conversation whose name the
    run retakes, each with its noted name (`Planned.names_given`) again."""
    entries = [{"id": c, "lost": c in planned.names_given, "given": planned.names_given.get(c)}
               for c in ids]  # fmt: skip
    if entries:
        each = {"$each": entries}
        db[STATE].update_one({"_id": STATE_ID}, {"$push": {RETAKING: each}}, upsert=True)
    state = db[STATE].find_one({"_id": STATE_ID}, {RETAKING: 1}) or {}
    for entry in state.get(RETAKING) or []:
        if entry.get("lost") and entry["id"] not in planned.names_given:
            planned.names_given[entry["id"]] = entry.get("given")
    return list(dict.fromkeys([*ids, *(e["id"] for e in state.get(RETAKING) or [])]))


def _names_retaken(
    db: Database[dict[str, Any]], planned: Planned, ids: Sequence[str], source: str
) -> None:
    """Retake, as the store does (`renamed`), the automatic name of each conversation whose
    messages the run removed (`Planned.moved`: a turn edited or erased since): a name whose
    message is no longer the first stored user text goes back to the one the stored
    messages give, else to none, in one update guarded by the message it was read with;
    even on a document a live turn wrote to since, which a run otherwise never rewrites (an
    erased user's words would stay its name). A runtime name a turn gone gave (`_given_by`)
    on such a document is retaken alike. The dual-written copies in `source` holding
    another name take the document's (a rollback would bring the old one back). Each
    retake is taken off the state's list (`RETAKING`) once done. Reads and writes for such
    conversations only."""
    fields = {"name": 1, "name_source": 1, "name_message_id": 1, "epoch": 1}
    for cid in ids:
        found = db[CONVERSATIONS].find_one(
            {"_id": cid}, fields | {"legacy_conversation_id": 1, "turns": 1, "pops": 1}
        )
        if found is not None and not holds_turn_fields(found):
            _name_retaken(db, planned, cid, found, source)
        db[STATE].update_one({"_id": STATE_ID}, {"$pull": {RETAKING: {"id": cid}}})


def _name_retaken(
    db: Database[dict[str, Any]],
    planned: Planned,
    cid: str,
    found: Mapping[str, Any],
    source: str,
) -> None:
    """One conversation's retake (`_names_retaken`), `found` its document as read."""
    fields = {"name": 1, "name_source": 1, "name_message_id": 1, "epoch": 1}
    query: dict[str, Any] = {"_id": cid}
    update: Any = renamed(found, _stored_name(db, cid, found.get("epoch"), planned.rules))
    if update:
        update = [{"$set": update}]
    elif (given := _given_by(db, planned, cid, found)) is not None:
        query |= {"name": found.get("name"), "name_source": "runtime"}
        update = given
    after = found
    if update:
        changed = db[CONVERSATIONS].find_one_and_update(
            query, update, fields, return_document=ReturnDocument.AFTER
        )
        after = found if changed is None else changed
    named = [cid, *([found["legacy_conversation_id"]] * ("legacy_conversation_id" in found))]
    copies = {"conversation_id": {"$in": named}, "dual_write": True}
    db[source].update_many(
        copies | {"name": {"$ne": after.get("name")}}, {"$set": {"name": after.get("name")}}
    )


def _given_by(
    db: Database[dict[str, Any]], planned: Planned, cid: str, found: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The update taking back a runtime name (a turn's own `name`) that a turn gone gave: on
    a document a live turn wrote to since (the run rewrote any other as its legacy turns
    give it), one whose legacy turns lost some (`Planned.names_given`) and whose name none
    of those left gives. It goes to the name they give, else to the automatic name the
    stored messages give (`_stored_name`), else to none. None: nothing to take back. A
    copy holds the conversation's name, so a name a live turn gave cannot be told from one
    it carried: such a name goes too (the runtime's next turn names the conversation again);
    a person's (`name_source` "set") never does."""
    if cid not in planned.names_given or not written_since(found):
        return None
    given = planned.names_given[cid]
    if found.get("name_source") != "runtime" or found.get("name") == given:
        return None
    if given is not None:
        return {"$set": {"name": given, "name_source": "runtime"}}
    named = _stored_name(db, cid, found.get("epoch"), planned.rules)
    if named is None:
        return {"$set": {"name": None, "name_source": None}, "$unset": {"name_message_id": ""}}
    auto = {"name": named.name, "name_source": "auto", "name_message_id": named.message_id}
    return {"$set": auto}


def _stored_name(
    db: Database[dict[str, Any]], cid: str, epoch: Any, rules: TurnRules
) -> Named | None:
    """The automatic name the conversation's stored user messages (of its `epoch`, or none)
    give (`first_named`), as the store reads it by `rules`."""
    after = -1
    while True:
        window = named_window(cid, epoch if isinstance(epoch, str) else None, after)
        docs = list(db[MESSAGES].find(window).sort("seq", 1).limit(NAMED_WINDOW))
        stored = [m for d in docs if (m := full_texts.stored_message(d)[0]) is not None]
        named = first_named(stored, rules.name_chars)
        if named is not None or len(docs) < NAMED_WINDOW:
            return named
        after = int(docs[-1]["seq"])


def _after_messages(
    db: Database[dict[str, Any]],
    planned: Planned,
    since: _Since,
    texts: Sequence[FullText],
    applied: Applied,
) -> None:
    """Once a batch's messages are in, with its legacy turns looked up again (`since`): what
    it wrote of a conversation whose turns went or changed owner meanwhile is taken back out
    (`_take_back`), and every other conversation it wrote to is migrated, its `MIGRATING`
    mark removed (served and written by the service from now on; one a run left marked, by
    a crash, is finished so by the next)."""
    _take_back(db, planned, since, texts, applied)
    done = sorted(cid for cid in since.looked_at if cid not in since.changed)
    if done:
        query = {"_id": {"$in": done}, MIGRATING: {"$exists": True}}
        db[CONVERSATIONS].update_many(query, {"$unset": {MIGRATING: ""}})


def _take_back(
    db: Database[dict[str, Any]],
    planned: Planned,
    since: _Since,
    texts: Sequence[FullText],
    applied: Applied,
) -> None:
    """Take back out what the run wrote of the conversations whose legacy turns went or
    changed owner while it wrote their messages (`since`, looked up after them): the
    messages it inserted, by the ids the plan gave them (none of a live turn's, none it only
    rewrote: those were stored and served before the run, and a delete or an erasure takes
    them as any other); of one whose turns went (a delete, an erasure), its whole texts and
    its document too, where still as this run inserted it; one whose turns changed owner (a
    claim) keeps its document, which the claim moved to the new owner, still marked
    `MIGRATING` (read from its legacy turns, whole), and is named as left for the next run
    (`Applied.reowned`), which rewrites its messages under the new owner (meanwhile those
    it rewrote go to that owner: `_hand_over_rewritten`). Nothing of theirs is left behind a
    delete, an erasure or a claim, and no problem of theirs is kept (`Applied.gone`)."""
    changed = _changed_since(since, applied)
    if not changed:
        return
    applied.gone |= set(changed)
    _hand_over_rewritten(db, planned, since.reowned)
    ids = [d["_id"] for d in planned.messages if d["conversation_id"] in changed]
    db[MESSAGES].delete_many({"conversation_id": {"$in": sorted(changed)}, "_id": {"$in": ids}})
    applied.written = max(0, applied.written - len(ids))  # none of theirs is left written
    full_texts.forget(db, [f.blob_id for f in texts if f.conversation_id in since.gone])
    wrote = [d for d in planned.conversations if d["_id"] in since.gone]
    if not wrote:
        return
    # Most often the person's delete took the document already: only one still standing
    # and as this run inserted it goes (one a person or a live turn changed since stays).
    query = {"_id": {"$in": [d["_id"] for d in wrote]}}
    standing = {d["_id"] for d in db[CONVERSATIONS].find(query, {"_id": 1})}
    for document in (d for d in wrote if d["_id"] in standing):
        if planned.read.get(document["_id"]) is None:
            unchanged = {k: {"$exists": False} for k in PEOPLES_FIELDS if k not in document}
            taken = db[CONVERSATIONS].delete_one(
                {**_as_stored(db, document), **unchanged, **NO_TURN_FIELD}
            )
            standing -= {document["_id"]} if taken.deleted_count else set()
    applied.documents -= len(wrote) - len(standing)


def _hand_over_rewritten(db: Database[dict[str, Any]], planned: Planned, reowned: set[str]) -> None:
    """The messages the run rewrote of the conversations whose legacy turns changed owner
    meanwhile (a claim, which moves the documents first and the legacy turns last) go to the
    owner their document names now: a rewrite landing after the claim moved the messages
    leaves none in the old owner's name."""
    rewritten = [d for d in planned.rewritten if d["conversation_id"] in reowned]
    if not rewritten:
        return
    query = {"_id": {"$in": sorted({d["conversation_id"] for d in rewritten})}}
    for found in db[CONVERSATIONS].find(query, {"user_id": 1}):
        ids = [d["_id"] for d in rewritten if d["conversation_id"] == found["_id"]]
        held = {"conversation_id": found["_id"], "_id": {"$in": ids}}
        db[MESSAGES].update_many(held, {"$set": {"user_id": found.get("user_id")}})


LIVE_SINCE = "a live turn wrote to the conversation between the run's plan and its writes"

_TURNS_A_READ = 10_000
"""Legacy turn ids one read of `_turns_since` names."""


@dataclass
class _Since:
    """What became of a batch's legacy turns since the plan read them."""

    gone: set[str] = field(default_factory=set)
    """Conversations some legacy turn of which is no longer in the source (a person deleted
    the conversation, an erasure took the turns)."""
    reowned: set[str] = field(default_factory=set)
    """Conversations some legacy turn of which names another owner now (an account claim
    moved it, keeping its `_id`)."""
    looked_at: set[str] = field(default_factory=set)
    """Every conversation whose legacy turns were looked up."""

    @property
    def changed(self) -> set[str]:
        return self.gone | self.reowned


def _turns_since(
    db: Database[dict[str, Any]], source: str, items: Mapping[str, Converted]
) -> _Since:
    """The conversations of `items` some legacy turn of which, as the plan read them, is no
    longer in `source`, or names another owner than the plan read (`LegacyTurn.user_id`, as
    the converter reads it): one read of their `_id`s and owners (per `_TURNS_A_READ`)."""
    wanted = [turn.id for item in items.values() for turn in item.turns + item.held]
    owners: dict[bytes, str | None] = {}
    for start in range(0, len(wanted), _TURNS_A_READ):
        query = {"_id": {"$in": wanted[start : start + _TURNS_A_READ]}}
        read = list(db[source].find(query, {"_id": 1, "user_id": 1, CLAIMED_FROM: 1}))
        for found in claims_recorded(db, read):
            owner = LegacyTurn.model_validate({"user_id": found.get("user_id")}).user_id
            owners[identity(found)] = owner
    since = _Since(looked_at=set(items))
    for cid, item in items.items():
        now = [owners.get(id_key(turn.id), _GONE) for turn in item.turns + item.held]
        if _GONE in now:
            since.gone.add(cid)
        elif any(o != t.user_id for o, t in zip(now, item.turns + item.held, strict=True)):
            since.reowned.add(cid)
    return since


_GONE = object()
"""A legacy turn `_turns_since` no longer finds."""


def _changed_since(since: _Since, applied: Applied) -> dict[str, None]:
    """The conversations whose turns went or changed owner since the plan (`_turns_since`),
    as conversations nothing more is written of; those whose turns changed owner are noted
    as left for the next run (`Applied.reowned`)."""
    applied.reowned |= since.reowned
    return dict.fromkeys(since.changed)


def _write_conversations(
    db: Database[dict[str, Any]], planned: Planned, bounds: Bounds, source: str, applied: Applied
) -> dict[str, dict[str, Any] | None]:
    """Write the conversation documents, fenced by the legacy turns the plan read: none for a
    conversation whose turns are gone or changed owner since (`_turns_since`); then, for those
    this run inserted, the turns are looked for again, and the document of one whose turns
    went or changed owner meanwhile is taken back out (as inserted: a live turn's or a
    person's since stays, and so does one a claim moved to the new owner). The conversations
    not as planned (`_not_as_planned`), those whose turns changed with None: nothing else of
    them is written, and no problem of theirs is kept. The life of each document written is
    kept apart from it (`lives.record`), for a second attempt after a rollback."""
    vanished = _changed_since(_turns_since(db, source, planned.converted), applied)
    documents = [d for d in planned.conversations if d["_id"] not in vanished]
    written = _write_documents(db, documents, planned.read, bounds)
    inserted = {
        d["_id"]: d
        for d in documents
        if planned.read.get(d["_id"]) is None and d["_id"] not in written.duplicates
    }
    since = _turns_since(db, source, {cid: planned.converted[cid] for cid in inserted})
    late = _changed_since(since, applied)
    for cid in sorted(late):
        document = inserted[cid]
        unchanged = {k: {"$exists": False} for k in PEOPLES_FIELDS if k not in document}
        db[CONVERSATIONS].delete_one({**_as_stored(db, document), **unchanged, **NO_TURN_FIELD})
    skipped = _not_as_planned(db, planned, written) | vanished | late
    lives.record(db, (d for d in documents if d["_id"] not in skipped))
    return skipped


def _live_since(found: dict[str, Any] | None, read: dict[str, Any] | None) -> bool:
    """Whether a live turn wrote to the document since the plan read it: it records turns
    now, and did not then."""
    return found is not None and bool(found.get("turns")) and not (read or {}).get("turns")


@dataclass
class _Written:
    """What the conversation documents' writes did not do."""

    duplicates: set[str] = field(default_factory=set)
    """Conversations whose insert found a document (written since the plan)."""
    unmatched: bool = False
    """Some replace matched no document (changed or deleted since the plan)."""


def _write_documents(
    db: Database[dict[str, Any]],
    documents: Sequence[dict[str, Any]],
    read: Mapping[str, dict[str, Any] | None],
    bounds: Bounds,
) -> _Written:
    """Write the conversation documents, each only as the plan read it (`read`, `_write`)."""
    written = _Written()
    found = [read.get(d["_id"]) for d in documents]
    upserts = list(zip(documents, found, strict=True))
    sizes = [len(bson.encode(d)) + len(bson.encode(read or {})) for d, read in upserts]
    for chunk in bounded(upserts, sizes, bounds):
        replaces = sum(1 for _, read in chunk if read is not None)
        try:
            result = db[CONVERSATIONS].bulk_write([_write(*w) for w in chunk], ordered=False)
            matched = result.matched_count
        except BulkWriteError as exc:
            only_duplicates(exc)  # one written meanwhile (the logger's, another run's) stays
            written.duplicates |= {chunk[e["index"]][0]["_id"] for e in exc.details["writeErrors"]}
            matched = int(exc.details.get("nMatched", 0))
        written.unmatched |= matched < replaces
    return written


def _not_as_planned(
    db: Database[dict[str, Any]], planned: Planned, written: _Written
) -> dict[str, dict[str, Any] | None]:
    """The conversations the plan writes to whose document is not as planned once the
    documents are written, with the document found (None: deleted since the plan). As planned
    is: inserted by this run, replaced by it, or, where it writes none, still as the plan read
    it (a rerun finishing a killed run's messages). A replace's own result is known only when
    every replace of the batch matched; else the document is read back and compared."""
    wrote = {d["_id"]: d for d in planned.conversations}
    touched: set[str] = (
        {d["conversation_id"] for d in planned.messages + planned.rewritten}
        | {f.conversation_id for f in planned.full_texts if f.conversation_id is not None}
        | set(planned.moved)
        | set(wrote)
    )
    expected: dict[str, dict[str, Any] | None] = {}
    for cid in touched:
        if cid not in wrote:
            expected[cid] = planned.read.get(cid)
        elif cid in written.duplicates:
            expected[cid] = None  # another's document: never as planned
        elif planned.read.get(cid) is not None and written.unmatched:
            expected[cid] = _as_stored(db, wrote[cid])
    if not expected:
        return {}
    stored = {d["_id"]: d for d in db[CONVERSATIONS].find({"_id": {"$in": sorted(expected)}})}
    return {
        cid: stored.get(cid)
        for cid, wanted in expected.items()
        if wanted is None or not same_bson(stored.get(cid), wanted)
    }


def _as_stored(db: Database[dict[str, Any]], document: dict[str, Any]) -> dict[str, Any]:
    """A document as a read gives it back (its BSON types, dates to the millisecond)."""
    return bson.decode(bson.encode(document), codec_options=db.codec_options)


PEOPLES_FIELDS = (
    "name_source",
    "resolved_hitl",
    "answered_prompts",
    "approved_calls",
    "turns",
    "pops",
)
"""Fields a person or the live logger adds to a conversation document the migration wrote
(a rename, a resolved prompt and how far the answer reaches, the calls its answer released,
turn records, the count of pops)."""


def _write(
    document: dict[str, Any], read: dict[str, Any] | None
) -> InsertOne[dict[str, Any]] | ReplaceOne[dict[str, Any]]:
    """A conversation document's write, conditional on what the plan read: where none was
    stored, an insert (one written since stays: a duplicate); else a replace of the document
    still as it was read, every field equal and none added (a rename, a resolved prompt, a
    live turn since, or the same conversation written by a newer run, stays; one deleted
    since stays deleted)."""
    if read is None:
        return InsertOne(document)
    added = (set(document) | set(PEOPLES_FIELDS)) - set(read)
    unchanged = {k: {"$exists": False} for k in sorted(added)}
    return ReplaceOne({**read, **unchanged, **NO_TURN_FIELD}, document)


def _accept_identical(
    db: Database[dict[str, Any]], error: BulkWriteError, documents: list[dict[str, Any]]
) -> list[Problem]:
    """Duplicates of identical documents are a resumed run; other collisions a live race."""
    only_duplicates(error)
    errors = error.details.get("writeErrors", [])
    failed = [documents[e["index"]] for e in errors]
    # The conversation ids keep this lookup on the shards that hold them.
    query = {
        "conversation_id": {"$in": sorted({f["conversation_id"] for f in failed})},
        "_id": {"$in": [f["_id"] for f in failed]},
    }
    stored = {d["_id"]: d for d in db[MESSAGES].find(query)}
    problems: list[Problem] = []
    for wanted in failed:
        found = stored.get(wanted["_id"])
        read, invalid = full_texts.stored_message(found) if found is not None else (None, None)
        if read is not None and same_bson(read, message_adapter.validate_python(wanted)):
            continue
        detail = f"seq {wanted['seq']} was taken by another message during the run"
        problems.append(
            Problem(
                conversation_id=wanted["conversation_id"],
                legacy_id=str(wanted.get("turn_id")),
                kind="live_conflict",
                detail=invalid or detail,
                content=wanted,
            )
        )
    return problems
