"""Step 1 of the protocol: move legacy turn documents out of `agent_conversations`.

A rename is one atomic command. Where the server refuses it (some
MongoDB-compatible servers, or a target that already exists) or where
`agent_conversations` already holds new conversation documents, the turns are
copied instead, batch by batch: insert into `agent_conversations_deprecated`,
check every document arrived, read which of the batch's turns the source still holds
and take back the copies of the others (deleted there since the batch was read, by their
owner's delete or an erasure, which look in the deprecated collection after they delete
there: `_still_in_source`), then delete the rest from the source, each only while it is
still what was copied (an edit of the old service since is copied again:
`_delete_as_copied`). A copy
killed part-way resumes where it stopped; nothing is deleted before its copy
is confirmed. Each batch's writes, and the rename, are fenced as a run's batches are
(`fence`): a run paused past its lease moves nothing it read before the pause. A copy is
recorded in the migration's state while it goes on (`COPYING`), so a copy killed part-way
is told apart from a collection a rollback left standing (`refuse_leftover`): before each
batch's writes, the copy adds that batch's `_id`s to those recorded (`IN_FLIGHT`), and
takes them out once the batch's delete returned: the only turns killed copies leave in both
collections, whatever batch sizes a resumed copy takes; those it found still in the source
are recorded as confirmed (`CONFIRMED`) before their delete, so a resumed copy tells a turn
it moved from one deleted since (`_settle_killed_batch`). A move made while an earlier run's
ranges of ids stand unfinished (`late`: the old service logged turns after that run's move)
brings in turns whose ids may sort before a range's checkpoint, where the resuming run would
never reach them: each copy batch records the conversations its turns name (`LATE`) in the
same write, before its insert, for the run to migrate whatever its checkpoints; past what the
one state document holds (`LATE_MAX`, `LATE_MAX_BYTES`), or when the run starts over, only
that the ranges are cut again (`LATE_OVERFLOW`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import bson
from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument
from pymongo import DeleteOne
from pymongo.database import Database
from pymongo.errors import BulkWriteError, OperationFailure

from agent_store.core import InvalidInput, utc_now
from agent_store.legacy import (
    CLAIMED_FROM,
    CONVERSATION_COUNTERS,
    LEGACY_TURNS,
    MIGRATION_STATE,
    MIGRATION_STATE_ID,
    TURN_ONLY_FIELDS,
    not_utf8_at,
    not_utf8_key,
    stored_conversation_id,
    user_named,
)
from agent_store.store import CONVERSATIONS, only_duplicates
from migrations.errors import MigrationError, WorkLeft
from migrations.keys import id_key, matched_key, same_document

_BAD_VALUE = 2
"""The server's code for a hint it does not know."""
COPYING = "copying_at"
"""The field of the migration's state a copy sets before its first batch and removes once
every turn is moved."""
IN_FLIGHT = "copying_batch"
"""The field of the migration's state holding the `_id`s of the batch a copy is writing, set
before its insert: a copy killed part-way leaves these turns, and no other, in both
collections (inserted, not yet deleted)."""
CONFIRMED = "copying_confirmed"
"""The field of the migration's state holding the `_id`s of the batch in flight the copy found
still in `agent_conversations` once their copies stood, set before it deletes them there: a
turn in flight that the source no longer holds was moved when confirmed, else deleted by
someone else after the copy read it (its copy goes, `_settle_killed_batch`)."""
COPIED_AS = "copying_digests"
"""The field of the migration's state holding the digest of each turn of the batch in
flight as the copy read it (`copied_as`), recorded with `IN_FLIGHT`: a resumed copy takes
back only a copy that is the batch's own (`_settle_killed_batch`), never another document
under its `_id` (a moved turn whose `_id` a late turn used again, refused as holding other
content)."""


def copied_as(turn: Mapping[str, Any]) -> str:
    """The digest of a turn as the copy read it and inserted it: its BSON, field order and
    number types included (`COPIED_AS`)."""
    return hashlib.sha256(bson.encode(turn)).hexdigest()


def _copies_recorded(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The state's update recording the copies about to be written of `turns` (`COPIED_AS`),
    before they are: a copy killed after it is still the copy's own."""
    return {"$addToSet": {COPIED_AS: {"$each": [copied_as(turn) for turn in turns]}}}


DOCUMENTS_WRITTEN = "documents_written_at"
"""The field of the migration's state a run sets before it writes its first conversation
document since the move made the legacy collection (`wrote_documents`), and that move removes
(`relocate`: a rename, or a copy into no collection): a rollback moves every conversation
document away, so while it is set and none stands in `agent_conversations`, one was moved
away (`refuse_leftover`)."""


def wrote_documents() -> dict[str, Any]:
    """The state's update a run writes before it writes conversation documents
    (`DOCUMENTS_WRITTEN`): the first time since the move, only."""
    return {"$min": {DOCUMENTS_WRITTEN: utc_now()}}


_COPY_RECORDS = (COPYING, IN_FLIGHT, CONFIRMED, COPIED_AS)
"""The migration state's fields recording a copy under way."""
EDIT_ROUNDS = 5
"""How many times the copy copies again and deletes again a turn the old service edited
since its copy (the delete takes a turn only while it is what was copied, `_as_copied`):
one edited again before each of those deletes stays in `agent_conversations` as it stands,
its copy taken back, for the next run to move (`_delete_edited`)."""
_OVERLAP_CHUNK = 1000
LATE = "late_conversations"
"""The field of the migration's state listing the conversation ids (as the turns hold them)
of the turns a move brought in while an earlier run's ranges stood unfinished: a resumed run
migrates them first, whatever its checkpoints, and a run's checkpoint keeps those it has not
migrated yet; a run cutting new ranges reaches every id, and its first checkpoint clears the
list."""
LATE_OVERFLOW = "late_conversations_overflow"
"""The field of the migration's state set, in place of `LATE`, when such a move brought in
more conversations than `LATE_MAX`, ids of more bytes than `LATE_MAX_BYTES`, or every turn at
once (a rename), or when the run moving them starts over (`--restart`): the next run cuts new
ranges (starts over: a rerun is idempotent) instead of resuming."""
LATE_MAX = 10_000
"""The most conversations `LATE` lists."""
LATE_MAX_BYTES = 4 * 1024 * 1024
"""The most bytes the ids `LATE` lists take encoded (`late_bytes`): legacy ids are free text
of any length, and the state is one document of at most 16 MB, written whole again, the
list with it, at every checkpoint of the run resuming the ranges."""

CONVERSATION_FILTER: dict[str, Any] = {
    "$or": [{f: {"$exists": True}} for f in CONVERSATION_COUNTERS]
}
"""Conversation documents: the store writes its counters on every one."""
TURN_FILTER: dict[str, Any] = {f: {"$exists": False} for f in CONVERSATION_COUNTERS}
"""Legacy turns: every document that is not a conversation document, whatever fields it
holds or lacks (a turn of tool calls only, of a history only). The move, the run, its
checkpoint and the gate all select turns by this one filter."""
NEITHER_FILTER: dict[str, Any] = {
    "$and": [CONVERSATION_FILTER, {"$or": [{f: {"$exists": True}} for f in TURN_ONLY_FIELDS]}]
}
"""Documents of `agent_conversations` holding a conversation document's counters and a field
only a legacy turn holds: neither, so nothing moves or converts them."""
DOCUMENT_FILTER: dict[str, Any] = {
    **CONVERSATION_FILTER,
    **{f: {"$exists": False} for f in TURN_ONLY_FIELDS},
}
"""Conversation documents proper: the store's counters and no field only a legacy turn holds
(`NEITHER_FILTER` is the rest of `CONVERSATION_FILTER`; a rollback copies such a document back
from the legacy collection, where it stood among the turns)."""
UNREAD: tuple[tuple[str, dict[str, Any]], ...] = (
    (LEGACY_TURNS, CONVERSATION_FILTER),
    (CONVERSATIONS, NEITHER_FILTER),
)
"""Where documents no run reads stand, by collection: in the legacy collection, any that is
not a legacy turn (it holds a conversation document's counters); in `agent_conversations`,
any that is neither a turn nor a conversation document (`NEITHER_FILTER`)."""


def held_back(db: Database[dict[str, Any]]) -> set[str]:
    """The conversations no run writes, removes or changes while a document no run reads
    (`UNREAD`) is there: the one whose `_id` it holds, and the one it would belong to as a
    turn (its `conversation_id`, named as a run stores its turns, `stored_conversation_id`).
    Migrated without it, a conversation would be served without its words and opened to
    live turns, or lose its migrated messages; so it waits, whole, until an operator moves
    or corrects the document, and the next run migrates it with the turn in its place. One
    read of each collection a run (few such documents stand: each is named as work left).
    So too a turn a copy left in `agent_conversations` holding text that is not valid UTF-8
    (`left_not_utf8`): its conversation, and the one whose id its `_id` is, whose document
    no run writes over it (`held_by_left`)."""
    held: set[str] = set()
    for name, query in UNREAD:
        for document in db[name].find(query, {"_id": 1, "conversation_id": 1}):
            if name == CONVERSATIONS and isinstance(document["_id"], str):
                held.add(document["_id"])
            held |= _filed_under(document)
    for document in left_not_utf8(db):
        held |= held_by_left(document)
    return held


def held_by_left(document: Mapping[str, Any]) -> set[str]:
    """The conversations a turn left in `agent_conversations` holds back (`held_back`): the
    one it is filed under (`_filed_under`), and, its `_id` a text, the one of that id, whose
    conversation document would stand where the turn stands (a run reads a document there as
    neither, writes nothing over it, `writes.NO_TURN_FIELD`)."""
    return _filed_under(document) | _standing_under(document)


def _standing_under(document: Mapping[str, Any]) -> set[str]:
    """The conversation id a document of `agent_conversations` stands under: its `_id`, when
    a text (a conversation's id is one)."""
    standing = document.get("_id")
    return {standing} if isinstance(standing, str) else set()


def _filed_under(document: Mapping[str, Any]) -> set[str]:
    """The conversation a turn is stored under (`stored_conversation_id`), or none for an id
    no turn can be filed under (one holding text that is not valid UTF-8 among them)."""
    try:
        return {stored_conversation_id(document)}
    except (InvalidInput, UnicodeEncodeError):
        return set()


def left_not_utf8(db: Database[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The turns a copy left in `agent_conversations` holding text that is not valid UTF-8
    (`_copy_all`), read only once the legacy collection stands: then the turns there are
    those left or logged since, few (before any move, every turn is there, and the
    conversion makes such a turn's conversation an `invalid_conversation` problem)."""
    if not db.list_collection_names(filter={"name": LEGACY_TURNS}):
        return
    for document in db[CONVERSATIONS].find(TURN_FILTER):
        if not_utf8_at(document) is not None:
            yield document


def left_named(db: Database[dict[str, Any]]) -> tuple[int, str]:
    """How many turns a copy left in `agent_conversations` for text that is not valid UTF-8
    (`left_not_utf8`), and what the copy said of them (`_not_copied`, `_holding_back`): each
    by `_id` and where, the conversations they hold back, and the one step that moves them,
    their text corrected there (a run alone leaves them again), for `verify`, `finish` and
    `status` to say as the run did."""
    kept = _Left()
    for document in left_not_utf8(db):
        kept.not_utf8(document, not_utf8_at(document) or "a field")
    said = "; ".join(filter(None, [_not_copied(kept.named), _holding_back(kept)]))
    return len(kept.named), said and f"the copy {said}"


def late_bytes(ids: list[Any]) -> int:
    """The bytes `ids` take encoded as the state lists them (`LATE`)."""
    return len(bson.encode({LATE: ids}))


def late_fits(ids: list[Any]) -> bool:
    """Whether the state may list `ids` (`LATE`): no more of them than `LATE_MAX`, taking no
    more bytes than `LATE_MAX_BYTES`."""
    return len(ids) <= LATE_MAX and late_bytes(ids) <= LATE_MAX_BYTES


@dataclass
class _Late:
    """The conversations a move under unfinished ranges has recorded (`LATE`)."""

    recorded: set[bytes] = field(default_factory=set)
    listed: int = 0
    """How many the state lists: before this move, then with those it added."""
    size: int = 0
    """How many bytes they take (`late_bytes`; each batch's counted apart, a few bytes over)."""
    overflow: bool = False
    """Whether the state is to record only that the ranges are cut again (`LATE_OVERFLOW`):
    from the start when the run moving the turns starts over (`--restart`)."""
    said: bool = False
    """Whether the overflow was written."""

    def update(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        """The state's update recording the conversations of `batch`'s turns, written with
        the batch's turns in flight (before its insert); once they no longer fit the state
        (`LATE_MAX`, `LATE_MAX_BYTES`), or the run starts over, that the ranges are cut
        again, once."""
        named = {id_key(d.get("conversation_id")): d.get("conversation_id") for d in batch}
        fresh = [cid for key, cid in named.items() if key not in self.recorded]
        size = self.size + late_bytes(fresh)
        self.overflow |= self.listed + len(fresh) > LATE_MAX or size > LATE_MAX_BYTES
        if not self.overflow:
            self.recorded |= named.keys()
            self.listed, self.size = self.listed + len(fresh), size
            return {"$addToSet": {LATE: {"$each": fresh}}} if fresh else {}
        said, self.said = self.said, True
        return {} if said else {"$set": {LATE_OVERFLOW: True}, "$unset": {LATE: ""}}


def _late(db: Database[dict[str, Any]], *, start_over: bool) -> _Late:
    state = db[MIGRATION_STATE].find_one({"_id": MIGRATION_STATE_ID}, {LATE: 1}) or {}
    listed = list(state.get(LATE) or [])
    return _Late(listed=len(listed), size=late_bytes(listed), overflow=start_over)


def _merged(update: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """Two updates of distinct fields as one."""
    return {op: {**update.get(op, {}), **more.get(op, {})} for op in {*update, *more}}


@dataclass
class Relocation:
    how: str
    """'renamed', 'copied', 'already moved' or 'nothing to move'."""
    moved: int = 0
    detail: str = ""


def holds_turns(db: Database[dict[str, Any]], name: str) -> bool:
    return db[name].find_one(TURN_FILTER, {"_id": 1}) is not None


def turns_at(db: Database[dict[str, Any]]) -> str:
    """Where the legacy turns are now, the one answer every reader of them in the migration
    takes (a run, a dry run, `verify`, `finish` and the removal of conversations no legacy
    turn makes): the collection they were moved aside to, once it stands (after the move, even
    emptied by their owners; turns an old-service writer logged in `agent_conversations` since
    are the next run's to move), else `agent_conversations` (before the move, and after a
    rollback renamed them back: read anywhere else, every migrated conversation would look
    like one no legacy turn makes)."""
    moved = db.list_collection_names(filter={"name": LEGACY_TURNS})
    return LEGACY_TURNS if moved else CONVERSATIONS


def _write_state(db: Database[dict[str, Any]]) -> Callable[[dict[str, Any]], None]:
    """The migration's state written as is: a move made outside a run (its tests)."""

    def write(update: dict[str, Any]) -> None:
        db[MIGRATION_STATE].update_one({"_id": MIGRATION_STATE_ID}, update, upsert=True)

    return write


def _copying(db: Database[dict[str, Any]]) -> bool:
    """Whether a run's copy is recorded as under way (`COPYING`): killed, if no run holds
    the lock."""
    state = db[MIGRATION_STATE].find_one({"_id": MIGRATION_STATE_ID}, {COPYING: 1}) or {}
    return COPYING in state


def _recorded(db: Database[dict[str, Any]], record: str) -> set[str]:
    """The turns (by `matched_key` of their `_id`) a copy recorded as under way holds in
    `record` (`IN_FLIGHT`, `CONFIRMED`): none when no copy is."""
    fields = {COPYING: 1, record: 1}
    state = db[MIGRATION_STATE].find_one({"_id": MIGRATION_STATE_ID}, fields) or {}
    if COPYING not in state:
        return set()
    return {matched_key(i) for i in state.get(record) or []}


def refuse_leftover(db: Database[dict[str, Any]]) -> None:
    """WorkLeft (exit 1) when `agent_conversations` holds a turn whose `_id` the deprecated
    collection holds too, the same (`_same_content`), but for the batch a copy recorded as
    under way was writing when it stopped (`IN_FLIGHT`, the only turns a killed copy leaves in
    both), and whose own conversation's document does not stand in `agent_conversations`
    (`_without_their_documents`): a rollback moves every document away before it copies the
    turns back (MIGRATION.md, "Rollback"), and its collection left standing holds the turns of
    before it, conversations the old service deleted since among them, which merged back
    would be migrated again. Moved turns the old service saved again unchanged (an upsert by
    `_id`) of a conversation not migrated yet (`run --limit`, a run stopped part-way, one held
    back) or whose document the turn replaced (its `_id` the conversation's id) look the
    same, so the refusal says what it saw and the way out of each
    (`_saved_again_or_rolled_back`). Its conversation's document standing, such a turn is the
    moved one, saved again since the move: the copy takes it as moved
    (`_accept_identical_copies`). Turns the
    old service logged after a move (new `_id`s) and a collection standing empty or holding
    dual-written turns only are no leftover: a run copies the turns into it; a turn logged
    after the move under a moved turn's `_id` with other content is refused as such
    (`_other_content`), nothing moved, whatever type of number either `_id` is (`5.0` is the
    turn `5` to the server's `$in`: both are paired by `matched_key`). A turn holding text
    that is not valid UTF-8 is taken as the rest of the move takes it (`_copyable`): never
    encoded, its content compared by `_same_content`; one whose `_id` holds such text is sent
    in no query, so paired with no moved turn: the copy leaves it in place and names it
    (`_copy_all`). One read of the state, then the turns' `_id`s a thousand at a time, up to
    the first found in both, and for a thousand holding the same turns, one read of their
    conversations' documents."""
    if not holds_turns(db, LEGACY_TURNS):
        return
    resumed = _recorded(db, IN_FLIGHT)
    found_ids = (d["_id"] for d in db[CONVERSATIONS].find(TURN_FILTER, {"_id": 1}))
    ids = (i for i in found_ids if not_utf8_at(i) is None)
    while chunk := [i for _, i in zip(range(_OVERLAP_CHUNK), ids, strict=False)]:
        found = db[LEGACY_TURNS].find({"_id": {"$in": chunk}})
        copies = [c for c in found if matched_key(c["_id"]) not in resumed]
        if not copies:
            continue
        turns = {matched_key(t["_id"]): t for t in db[CONVERSATIONS].find({"_id": {"$in": chunk}})}
        paired = [(c, turns.get(matched_key(c["_id"]), {})) for c in copies]
        same = [turn for copy, turn in paired if _same_content(copy, turn)]
        _refuse_unexplained(db, same)
        for copy, turn in paired:  # turns logged after the move under a moved turn's `_id`
            if not _same_content(copy, turn):
                raise _other_content(copy, turn)


def _refuse_unexplained(db: Database[dict[str, Any]], same: list[dict[str, Any]]) -> None:
    """WorkLeft for the turns of one chunk the deprecated collection holds the same (`same`)
    whose own conversation's document does not stand (`_without_their_documents`), naming
    both causes (`_saved_again_or_rolled_back`) and those standing where their conversation's
    document stood (`_in_its_place`: an upsert by `_id` of the turn replaced it)."""
    unexplained = _without_their_documents(db, same)
    if unexplained:
        in_place = [turn for turn in unexplained if _in_its_place(turn)]
        raise _saved_again_or_rolled_back(db, unexplained, in_place)


def _in_its_place(turn: Mapping[str, Any]) -> bool:
    """Whether a turn of `agent_conversations` stands where its own conversation's document
    stands: its `_id` is the id it is filed under (`held_by_left`)."""
    return bool(_standing_under(turn) & _filed_under(turn))


def _without_their_documents(
    db: Database[dict[str, Any]], same: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The turns among `same` whose own conversation's document does not stand in
    `agent_conversations` (`DOCUMENT_FILTER`), or that are filed under no conversation a
    document can stand for. A rollback moves every document away before it copies the turns
    back, so a turn whose conversation's document stands was saved again by the old service
    since the move, not put back by a rollback; another conversation's document tells nothing
    of it (a run still writing during a rollback, an earlier release's document left in
    place, one a service left running created since). One read, only for turns found."""
    if not same:
        return []
    named = set().union(*(_filed_under(turn) for turn in same))
    query = {"_id": {"$in": sorted(named)}, **DOCUMENT_FILTER}
    standing = {d["_id"] for d in db[CONVERSATIONS].find(query, {"_id": 1})} if named else set()
    return [turn for turn in same if not _filed_under(turn) & standing]


_NAMED_AT_MOST = 5
"""How many turns a refusal names by `_id`."""


def _saved_again_or_rolled_back(
    db: Database[dict[str, Any]], same: list[dict[str, Any]], in_place: list[dict[str, Any]]
) -> WorkLeft:
    """The refusal of turns of `agent_conversations` the deprecated collection holds the same
    (`same`) whose conversation's document does not stand (`refuse_leftover`): moved turns the
    old service saved again unchanged (a run stopped before it wrote their conversations, a
    `--limit` run, a conversation held back, one deleted since), or a rollback that copied
    the turns back and left the collection standing. The data cannot tell them apart, and only
    the operator knows whether they rolled back, so it says what it saw (when a run last
    started writing documents, `DOCUMENTS_WRITTEN`; turns standing where their conversation's
    document stood, `in_place`) and the way out of each, the one for moved turns saved again
    first: delete them where they were saved again (each has its moved copy, so nothing is
    lost, the run writes again a document one replaced; a drop of the collection would take
    every moved turn with it)."""
    named = ", ".join(repr(turn["_id"]) for turn in same[:_NAMED_AT_MOST])
    more = f" and {len(same) - _NAMED_AT_MOST} more" if len(same) > _NAMED_AT_MOST else ""
    state = db[MIGRATION_STATE].find_one({"_id": MIGRATION_STATE_ID}, {DOCUMENTS_WRITTEN: 1})
    written = (state or {}).get(DOCUMENTS_WRITTEN)
    seen = (
        f"a run started writing conversation documents at {written} since the move"
        if written
        else "no run wrote one since the move"
    )
    if in_place:
        seen += (
            f"; {_first_few_in_place(in_place)} where its conversation's document stands "
            "(an upsert by _id of its turn replaces that document: a run writes it again from "
            "its messages, and what only the document held, a name given to the conversation, "
            "comes back as the automatic name)"
        )
    return WorkLeft(
        f"{LEGACY_TURNS} holds turn documents {CONVERSATIONS} holds too, the same ({named}"
        f"{more}), and no copy of a run is under way; their conversations' documents do not "
        f"stand in {CONVERSATIONS} ({seen}), so nothing here tells whether the old service "
        "saved moved turns again unchanged (an upsert by _id) or a rollback copied the turns "
        "back (it moves the conversation documents away). Moving nothing. If no rollback "
        f"happened, delete from {CONVERSATIONS} each turn document {LEGACY_TURNS} holds the "
        f"same under its _id (its moved copy keeps it); if a rollback copied the turns back, "
        f"drop {LEGACY_TURNS} or rename it away (once {CONVERSATIONS} holds every turn to "
        "keep); then `run` again"
    )


def _first_few_in_place(turns: list[dict[str, Any]]) -> str:
    """What a refusal says of turns standing where their conversation's document stands
    (`_in_its_place`): the first few by `_id`, and how many more."""
    named = ", ".join(repr(turn["_id"]) for turn in turns[:_NAMED_AT_MOST])
    more = f" and {len(turns) - _NAMED_AT_MOST} more" if len(turns) > _NAMED_AT_MOST else ""
    return f"{named}{more} {'stands' if len(turns) == 1 else 'each stand'}"


def _same_content(copy: Mapping[str, Any], turn: Mapping[str, Any]) -> bool:
    """Whether a moved turn's copy and a turn of `agent_conversations` under its `_id` hold the
    same (`same_document`), the copy as it stood before the claims that moved it since
    (`_before_its_claims`); when either holds text that is not valid UTF-8 (`not_utf8_at`),
    which no BSON encodes, by each one's content as extended JSON (`not_utf8_key`, each such
    byte an escape): the same only when both hold the same such bytes."""
    copy = _before_its_claims(copy, turn)
    if not_utf8_at(copy) is None and not_utf8_at(turn) is None:
        return same_document(copy, turn)
    content = [not_utf8_key({k: v for k, v in d.items() if k != "_id"}) for d in (copy, turn)]
    return matched_key(copy.get("_id")) == matched_key(turn.get("_id")) and len(set(content)) == 1


def _before_its_claims(copy: Mapping[str, Any], turn: Mapping[str, Any]) -> Mapping[str, Any]:
    """A moved turn's copy as it stood before the claims that moved it (`CLAIMED_FROM`), when
    the turn under its `_id` in `agent_conversations` names a user one of them moved it away
    from: the old service, which knows of no claim, saving its own copy of the turn again (an
    upsert by `_id`) saves the same turn, naming the same user as the claimer the copy names
    (`claimers`), not other content. Else the copy as it is."""
    moved = copy.get(CLAIMED_FROM)
    named = user_named(turn.get("user_id"))
    if not isinstance(moved, list) or named is None or named not in map(user_named, moved):
        return copy
    before = {k: v for k, v in copy.items() if k != CLAIMED_FROM} | {"user_id": turn["user_id"]}
    return before | ({CLAIMED_FROM: turn[CLAIMED_FROM]} if CLAIMED_FROM in turn else {})


def turns_after_the_move(db: Database[dict[str, Any]]) -> dict[str, int]:
    """Where a run reads the legacy turns once its move is done, as a dry run, which moves
    nothing, reads them: by collection, the turns each holds that the move merges (the first
    holding most, the one a dry run plans from), none counted where one collection holds
    them all. `agent_conversations` holding none: where they are (`turns_at`); the
    collection moved aside holding none (absent, or standing empty): `agent_conversations`,
    whose turns the move puts there; both holding some (turns the old service logged after
    the move, or a collection standing again after a rollback, holding a turn a new-service
    instance dual-wrote): both, as the move copies one's into the other's. Counted only
    then, one read of each."""
    if not holds_turns(db, CONVERSATIONS):
        return {turns_at(db): 0}
    if not holds_turns(db, LEGACY_TURNS):
        return {CONVERSATIONS: 0}
    held = {name: db[name].count_documents(TURN_FILTER) for name in (LEGACY_TURNS, CONVERSATIONS)}
    return dict(sorted(held.items(), key=lambda item: -item[1]))


def relocate(
    db: Database[dict[str, Any]],
    *,
    batch_size: int = 500,
    progress: Callable[[int], None] | None = None,
    allow_rename: bool = True,
    fence: Callable[[], None] = lambda: None,
    write_state: Callable[[dict[str, Any]], None] | None = None,
    late: bool = False,
    start_over: bool = False,
) -> Relocation:
    """Move every turn document from `agent_conversations` to the deprecated collection:
    `fence` is called right before the rename and before each copy batch's writes: it renews
    the run's lease and raises once another run or `finish` took the lock, or the legacy
    turns were dropped (a run paused past its lease copies no batch it read before).
    `write_state` updates the migration's state (the run's, fenced by its lease): a copy is
    recorded there (`COPYING`) before its first batch and cleared once every turn moved; a
    move that makes the deprecated collection (a rename, or a copy into none) removes the
    record of documents a run wrote since the last (`DOCUMENTS_WRITTEN`); with the deprecated
    collection a rollback left standing, nothing moves
    (`refuse_leftover`). `late`: an earlier run's ranges stand unfinished; the conversations
    of the turns moved are recorded for the run resuming them (`LATE`), or, past what the
    state holds or when this run cuts new ranges anyway (`start_over`: `--restart`), that the
    next run cuts them again (`LATE_OVERFLOW`)."""
    source, target = db[CONVERSATIONS], db[LEGACY_TURNS]
    state = _write_state(db) if write_state is None else write_state
    _settle_killed_batch(db, fence, state)
    if not holds_turns(db, CONVERSATIONS):
        if holds_turns(db, LEGACY_TURNS):
            return Relocation("already moved")
        return Relocation("nothing to move")
    refuse_leftover(db)
    mixed = source.find_one(CONVERSATION_FILTER, {"_id": 1}) is not None
    target_exists = LEGACY_TURNS in db.list_collection_names()
    reason = ""
    if allow_rename and not mixed and not target_exists:
        try:
            return _renamed(source, fence, state, late=late)
        except OperationFailure as exc:
            reason = f"the server refused the rename ({exc}); copying instead"
    elif mixed:
        reason = f"{CONVERSATIONS} also holds conversation documents; copying only the turns"
    elif target_exists:
        reason = (
            f"{LEGACY_TURNS} already exists (an interrupted copy); resuming the copy"
            if _copying(db)
            else f"{LEGACY_TURNS} already exists; copying into it"
        )
    made = {} if target_exists else {"$unset": {DOCUMENTS_WRITTEN: ""}}
    state(_merged({"$set": {COPYING: utc_now()}}, made))
    recorded = _late(db, start_over=start_over) if late else None
    kept = _Left()
    copy = functools.partial(
        _copy_batch, source=source, target=target, progress=progress, fence=fence, state=state,
        late=recorded, own=_KilledCopy.recorded(db), kept=kept,
    )  # fmt: skip
    moved = _copy_all(source, batch_size, copy, kept)
    state({"$unset": dict.fromkeys(_COPY_RECORDS, "")})
    said = [reason, _not_copied(kept.named), _holding_back(kept)]
    return Relocation("copied", moved, "; ".join(filter(None, said)))


@dataclass
class _Left:
    """The turns a copy left in `agent_conversations`, as it names them: each by `_id` and
    why, and the conversations those left for text that is not valid UTF-8 hold back
    (`held_by_left`): those they are filed under, and any whose id is their `_id`."""

    named: list[str] = field(default_factory=list)
    filed: set[str] = field(default_factory=set)
    standing: set[str] = field(default_factory=set)

    def not_utf8(self, document: Mapping[str, Any], where: str) -> None:
        """`document` left where it is: at `where` it holds bytes that are not valid UTF-8."""
        self.named.append(f"{document.get('_id')!r} ({where} holds bytes that are not valid UTF-8)")
        self.filed |= _filed_under(document)
        self.standing |= _standing_under(document)

    def of_batch(self, source: Any, unmoved: list[Any], edited_again: list[Any]) -> None:
        """Name the turns of a batch the copy did not move (`unmoved`: deleted since, edited
        since to text that is not valid UTF-8, or among `edited_again`, those its delete left,
        `_delete_as_copied`) that the source holds: by where they hold such text, else, for
        those edited again, as such. One read, only when some were not moved."""
        if not unmoved:
            return
        found = source.find({"_id": {"$in": unmoved}, **TURN_FILTER})
        standing = {matched_key(d["_id"]): d for d in found}
        again = {matched_key(i) for i in edited_again}
        for turn_id in unmoved:
            document = standing.get(matched_key(turn_id))
            if document is not None and (where := not_utf8_at(document)) is not None:
                self.not_utf8(document, where)
            elif matched_key(turn_id) in again:
                self.named.append(
                    f"{turn_id!r} (edited again during the copy, or stored as no read shows it)"
                )


def _not_copied(kept: list[str]) -> str:
    """What the copy says of the turns it left in `agent_conversations` (`_copy_all`,
    `_copy_batch`): the first few by `_id` and why, and how many."""
    if not kept:
        return ""
    more = f" and {len(kept) - 3} more" if len(kept) > 3 else ""
    return (
        f"left in {CONVERSATIONS} as stored, no copy kept: turn {', '.join(kept[:3])}{more}; "
        f"correct it there, then `run` again (the gate refuses while {CONVERSATIONS} holds a "
        "turn)"
    )


def _holding_back(kept: _Left) -> str:
    """What the copy says of the conversations the turns it left for their bytes hold back
    (`held_by_left`): those they are filed under and any standing under their `_id`s, the
    first few of each, and how many."""
    if not kept.filed and not kept.standing:
        return ""
    return (
        f"they hold back their conversations {_first_few(kept.filed)} and any conversation "
        f"whose id is one of their _ids ({_first_few(kept.standing)}): no run migrates, "
        "changes or removes any of them until then"
    )


def _first_few(ids: set[str]) -> str:
    """The first three of `ids` in order, and how many more."""
    shown = sorted(ids)
    more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
    return (", ".join(map(repr, shown[:3])) or "none") + more


def _renamed(
    source: Any, fence: Callable[[], None], state: Callable[[dict[str, Any]], None], *, late: bool
) -> Relocation:
    """Every turn moved at once, by renaming `agent_conversations`: the record of a copy
    under way goes first (no copy stands once every turn moved: a later copy must not act on
    it), so does that of documents written since the move (`DOCUMENTS_WRITTEN`: this move
    makes the legacy collection), and, `late`, the ranges are cut again (`LATE_OVERFLOW`).
    OperationFailure when the server refuses the rename."""
    count = source.count_documents({})
    fence()
    cleared: dict[str, Any] = {"$unset": dict.fromkeys((*_COPY_RECORDS, DOCUMENTS_WRITTEN), "")}
    if late:
        cleared["$set"] = {LATE_OVERFLOW: True}
    state(cleared)
    source.rename(LEGACY_TURNS)
    return Relocation("renamed", count)


def _copy_all(
    source: Any, batch_size: int, copy: Callable[[list[dict[str, Any]]], int], kept: _Left
) -> int:
    """Copy the turns batch by batch (`copy`: `_copy_batch`); how many moved. One scan in
    stored order: copied in that order, turns at the same time keep their order (a turn's time
    ties are broken by it), and the scan never reads a document twice. A turn holding text
    that is not valid UTF-8 (`not_utf8_at`: no write can give its bytes back) is left where
    it is, as stored, and named in `kept` (its `_id`, where): the others move."""
    moved = 0
    batch: list[dict[str, Any]] = []
    for document in _in_stored_order(source, batch_size):
        if (where := not_utf8_at(document)) is not None:
            kept.not_utf8(document, where)
            continue
        batch.append(document)
        if len(batch) == batch_size:
            moved += copy(batch)
            batch = []
    if batch:
        moved += copy(batch)
    return moved


def _in_stored_order(source: Any, batch_size: int) -> Iterator[dict[str, Any]]:
    """The turns in the collection's stored order: a collection scan (`$natural`), or, where
    the server knows no such hint, the unsorted scan that gives that order."""
    scan = source.find(TURN_FILTER, batch_size=batch_size).hint([("$natural", 1)])
    try:
        first = next(scan, None)
    except OperationFailure as exc:
        if exc.code != _BAD_VALUE:
            raise
        scan, first = source.find(TURN_FILTER, batch_size=batch_size), None
    if first is not None:
        yield first
    yield from scan


def _copy_batch(
    batch: list[dict[str, Any]],
    source: Any,
    target: Any,
    progress: Callable[[int], None] | None,
    fence: Callable[[], None],
    state: Callable[[dict[str, Any]], None],
    late: _Late | None = None,
    own: _KilledCopy | None = None,
    kept: _Left | None = None,
) -> int:
    """Insert the batch into the target, take back the copies of the turns deleted from the
    source since the batch was read, check the copy of every other arrived (`_arrived`),
    then delete those from the source while each is still what was copied
    (`_delete_as_copied`); how many moved. A document a killed copy inserted already is
    accepted (`_accept_identical_copies`; `own`: what it recorded as under way).
    `fence` first: the batch read may be stale (`relocate`); then the batch is added to the
    turns in flight (`IN_FLIGHT`), with the conversations its turns name when the move is
    `late`. Once its copies stand, the turns still in the source are read again
    (`_still_in_source`): one deleted there since the read (by its owner's delete or an
    erasure, which take late turns there before they look in the target) loses its copy;
    the others are recorded as confirmed (`CONFIRMED`) before their delete, and taken out
    of both records once it returned (three more writes a batch): a copy killed part-way
    leaves in both collections only turns still recorded, and a resumed copy tells a turn
    it moved from one deleted since (`_settle_killed_batch`). The turns left in the source
    are named in `kept`."""
    fence()
    if own is not None:
        own.refuse_others(batch, target)
    ids = [doc["_id"] for doc in batch]
    digests = [copied_as(doc) for doc in batch]
    in_flight = {"$addToSet": {IN_FLIGHT: {"$each": ids}, COPIED_AS: {"$each": digests}}}
    state(in_flight if late is None else _merged(in_flight, late.update(batch)))
    try:
        target.insert_many(batch, ordered=False)
    except BulkWriteError as exc:
        _accept_identical_copies(exc, batch, target, own or _KilledCopy())
    copies = _arrived(_still_in_source(batch, source, target, state), source, target)
    still = [copy["_id"] for copy in copies]
    state({"$addToSet": {CONFIRMED: {"$each": still}}})
    left = _delete_as_copied(copies, source, target, state)
    if kept is not None:
        moved = {matched_key(i) for i in still} - {matched_key(i) for i in left}
        kept.of_batch(source, [i for i in ids if matched_key(i) not in moved], left)
    recopied = [copied_as(copy) for copy in copies]  # the copies the check made again
    state({"$pullAll": {IN_FLIGHT: ids, CONFIRMED: still, COPIED_AS: digests + recopied}})
    if progress is not None:
        progress(len(still) - len(left))
    return len(still) - len(left)


def _still_in_source(
    batch: list[dict[str, Any]],
    source: Any,
    target: Any,
    state: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """The batch's turns the source still holds, as read once their copies stand; the copies
    of the others (deleted since the batch was read) deleted from the target, and the copy
    of a turn the old service edited since the read made the turn as read now, its digest
    recorded first (`COPIED_AS`: a copy killed after this is still the batch's own, taken
    back if the turn goes meanwhile). An edit after this read keeps the turn from its
    delete (`_delete_as_copied`). One read of the batch's turns, and writes only for those
    deleted or edited."""
    ids = [doc["_id"] for doc in batch]
    now, _ = _standing(ids, source, target)
    edited = [
        current
        for doc in batch
        if (current := now.get(matched_key(doc["_id"]))) is not None
        and not same_document(current, doc)
    ]
    if edited:
        state(_copies_recorded(edited))
    for current in edited:
        target.replace_one({"_id": current["_id"]}, current)
    return [now[key] for key in (matched_key(i) for i in ids) if key in now]


def _standing(
    ids: list[Any], source: Any, target: Any
) -> tuple[dict[str, dict[str, Any]], list[Any]]:
    """The turns of `ids` the source holds now (by `matched_key`), as they stand, and the
    `_id`s of those the old service edited since to text that is not valid UTF-8, which stay
    there as stored (`_copyable`); the copies of the others taken back from the target: those
    deleted there since the copy read them, and those. One read, and one delete only when
    some went."""
    found, left = _copyable(source.find({"_id": {"$in": ids}, **TURN_FILTER}))
    now = {matched_key(d["_id"]): d for d in found}
    if gone := [i for i in ids if matched_key(i) not in now]:
        target.delete_many({"_id": {"$in": gone}})
    return now, left


def _arrived(still: list[dict[str, Any]], source: Any, target: Any) -> list[dict[str, Any]]:
    """Of the turns the source still held (`still`, as their copies hold them), those whose
    copies stand in the target: a copy missing is one a delete or an erasure took with its
    turn since the source was read (the source no longer holds it either: left out), else
    the copy check fails, nothing deleted. One read of the copies, and of the source only
    when one is missing."""
    ids = [doc["_id"] for doc in still]
    found = target.find({"_id": {"$in": ids}}, {"_id": 1})
    standing = {matched_key(d["_id"]) for d in found}
    missing = [i for i in ids if matched_key(i) not in standing]
    if not missing:
        return still
    held = source.find({"_id": {"$in": missing}, **TURN_FILTER}, {"_id": 1})
    if lost := [d["_id"] for d in held]:
        raise MigrationError(
            f"copy check failed: {len(lost)} of {len(still)} turn documents did not arrive "
            f"in {LEGACY_TURNS}; nothing was deleted from {CONVERSATIONS}"
        )
    gone = {matched_key(i) for i in missing}
    return [doc for doc in still if matched_key(doc["_id"]) not in gone]


def _as_copied(copy: dict[str, Any]) -> dict[str, Any]:
    """The filter of the turn `copy` was copied from while it is still exactly that copy:
    the same fields in the same order, the same values (a number by its value, as the server
    compares them), nothing more; `$literal`, so a legacy field holding `$`-keys is read as
    data, not as an operator."""
    return {"_id": copy["_id"], **TURN_FILTER, "$expr": {"$eq": ["$$ROOT", {"$literal": copy}]}}


def _delete_as_copied(
    copies: list[dict[str, Any]], source: Any, target: Any, state: Callable[[dict[str, Any]], None]
) -> list[Any]:
    """Delete each turn of `copies` from the source while it is still what its copy holds
    (`_as_copied`; one round trip for the batch), and the `_id`s of those left there: a
    turn the old service edited since its copy (still in the source once the delete
    returned) is copied again and deleted again (`_delete_edited`). A turn the source no
    longer holds was deleted by this delete or, since the copy's check, by its owner's
    delete or an erasure, which take its copy after it, or by the old service, whose delete
    there leaves the copy (the count says how many went, not which: MIGRATION.md)."""
    if not copies:
        return []
    deletes = [DeleteOne(_as_copied(copy)) for copy in copies]
    if source.bulk_write(deletes, ordered=False).deleted_count == len(copies):
        return []
    ids = [copy["_id"] for copy in copies]
    edited, left = _copyable(source.find({"_id": {"$in": ids}, **TURN_FILTER}))
    if left:
        target.delete_many({"_id": {"$in": left}})
    return left + _delete_edited(edited, source, target, state)


def _copyable(turns: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Of `turns`, as the copy reads them again from the source, those a write gives back as
    stored, and the `_id`s of the others: turns the old service edited since the copy read
    them, to text that is not valid UTF-8 (`not_utf8_at`), which stay in the source as
    stored, as one the scan read so does (`_copy_all`), their copies taken back by the
    caller; no copy, digest or delete of the copy's encodes them."""
    copyable: list[dict[str, Any]] = []
    left: list[Any] = []
    for turn in turns:
        if not_utf8_at(turn) is None:
            copyable.append(turn)
        else:
            left.append(turn["_id"])
    return copyable, left


def _delete_edited(
    edited: list[dict[str, Any]], source: Any, target: Any, state: Callable[[dict[str, Any]], None]
) -> list[Any]:
    """The turns the old service edited since their copy (`edited`, as they stand now): each
    copy made the turn as it stands, then the turn deleted while it is still that (one
    delete each, so a turn not deleted is known), up to `EDIT_ROUNDS` times (`_read_again`
    between). Those edited again before each of those deletes stay in the source, as they
    stand, and their copies are taken back: no turn is in both collections, none lost, and
    the next run moves them (the gate refuses while `agent_conversations` holds a turn); so
    do those edited to text that is not valid UTF-8 (`_read_again`). Their `_id`s. Each
    round's copies are recorded (`COPIED_AS`) before they are written: a
    copy killed after this read takes the turn as it stands for the one it read
    (`_KilledCopy`); the records go with the copy's (`relocate`)."""
    not_utf8: list[Any] = []
    for _ in range(EDIT_ROUNDS):
        again = []
        state(_copies_recorded(edited))
        for current in edited:
            target.replace_one({"_id": current["_id"]}, current)
            if source.delete_one(_as_copied(current)).deleted_count == 0:
                again.append(current)
        if not again:
            return not_utf8
        edited, left = _read_again(again, source, target)
        not_utf8 += left
    left = [d["_id"] for d in edited]
    if left:
        target.delete_many({"_id": {"$in": left}})
    return not_utf8 + left


def _read_again(
    tried: list[dict[str, Any]], source: Any, target: Any
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The turns of `tried` (as copied) the delete did not take, as they stand now, those
    edited since, and the `_id`s of those edited since to text that is not valid UTF-8
    (`_standing`: left in the source, their copies taken back): one the source no longer
    holds (deleted by someone else meanwhile) loses its copy; one it holds unchanged is
    content the server cannot compare (the embedded server matches no binary value of
    subtype 3, 5 or 128, not even to itself): it is deleted by `_id` and its copy made what
    that delete returned (an edit landing between this read and that delete is lost only if
    the run is killed right after it), but only when its stored bytes are the copy's
    (`_stored_as`): one stored otherwise than any decoded read shows it (a field name twice)
    is never deleted, as one edited again."""
    now, not_utf8 = _standing([copy["_id"] for copy in tried], source, target)
    edited = []
    for copy in tried:
        current = now.get(matched_key(copy["_id"]))
        if current is not None and not same_document(current, copy):
            edited.append(current)
        elif current is not None and not _stored_as(copy, source):
            edited.append(current)  # tried again, then left in the source, its copy taken back
        elif current is not None:
            deleted = source.find_one_and_delete({"_id": copy["_id"], **TURN_FILTER})
            if deleted is not None and not same_document(deleted, copy):
                target.replace_one({"_id": copy["_id"]}, deleted)
    return edited, not_utf8


_UNDECODED = CodecOptions(document_class=RawBSONDocument)


def _stored_as(copy: dict[str, Any], source: Any) -> bool:
    """Whether the source stores the turn of `copy` as the copy's BSON, byte for byte: read
    undecoded, so a document holding what a decoded read cannot show (a field name twice,
    its first value hidden) is not. A collection holding Python values, not bytes
    (mongomock), stores what it shows: true."""
    try:
        undecoded = source.with_options(codec_options=_UNDECODED)
    except NotImplementedError:
        return True
    stored = undecoded.find_one({"_id": copy["_id"], **TURN_FILTER})
    return stored is not None and stored.raw == bson.encode(copy)


def _settle_killed_batch(
    db: Database[dict[str, Any]], fence: Callable[[], None], state: Callable[[dict[str, Any]], None]
) -> None:
    """Before a copy resumes: the turns a killed copy was writing (`IN_FLIGHT`) that the
    source no longer holds. Those it confirmed (`CONFIRMED`) it deleted there itself: moved,
    their copies stay. The others were deleted there by someone else (their owner's delete,
    an erasure) after the copy read them: their copies go, as a running copy's do
    (`_still_in_source`), each only while it is one the copy recorded (`COPIED_AS`: as read,
    or as its check made it again for an edit; never another document under its `_id`).
    So too the copy of a turn the source holds edited since to text that is not valid UTF-8,
    which stays there as stored (`_copyable`; refused, `_refuse_confirmed_not_utf8`, once the
    copy had confirmed it). All are taken out of the records. One read of the state, and,
    while a copy is recorded with turns in flight, one of the source."""
    fields = {COPYING: 1, IN_FLIGHT: 1, CONFIRMED: 1, COPIED_AS: 1}
    found = db[MIGRATION_STATE].find_one({"_id": MIGRATION_STATE_ID}, fields) or {}
    in_flight = list(found.get(IN_FLIGHT) or []) if COPYING in found else []
    if not in_flight:
        return
    held = list(db[CONVERSATIONS].find({"_id": {"$in": in_flight}, **TURN_FILTER}))
    confirmed = {matched_key(i) for i in found.get(CONFIRMED) or []}
    _refuse_confirmed_not_utf8(db, held, frozenset(confirmed))
    still = {matched_key(d["_id"]) for d in _copyable(held)[0]}
    settled = [i for i in in_flight if matched_key(i) not in still]
    if not settled:
        return
    deleted = [i for i in settled if matched_key(i) not in confirmed]
    fence()
    if deleted:
        recorded = set(found.get(COPIED_AS) or [])
        copies = db[LEGACY_TURNS].find({"_id": {"$in": deleted}})
        own = [copy["_id"] for copy in copies if copied_as(copy) in recorded]
        if own:
            db[LEGACY_TURNS].delete_many({"_id": {"$in": own}})
    state({"$pullAll": {IN_FLIGHT: settled, CONFIRMED: settled}})


def _refuse_confirmed_not_utf8(
    db: Database[dict[str, Any]], held: list[dict[str, Any]], confirmed: frozenset[str]
) -> None:
    """The refusal (`_replaced`) of a turn a killed copy confirmed moving that the source
    holds, holding text that is not valid UTF-8, while a copy stands under its `_id`: the
    moved turn edited after the copy confirmed it, or another turn logged under its `_id`
    since, as for a turn edited so without such text (`_KilledCopy.refuse_others`); the
    operator tells them apart. One read, of those turns' copies, only then."""
    left = {matched_key(d["_id"]): d for d in held if not_utf8_at(d) is not None}
    mine = [turn["_id"] for key, turn in left.items() if key in confirmed]
    for copy in db[LEGACY_TURNS].find({"_id": {"$in": mine}}) if mine else []:
        raise _replaced(copy, left[matched_key(copy["_id"])], _KilledCopy(confirmed=confirmed))


@dataclass(frozen=True)
class _KilledCopy:
    """What a killed copy recorded as under way (none when no copy is), as a resumed copy
    reads it once the killed batch is settled (`_settle_killed_batch`): the turns in flight
    the source still holds (`IN_FLIGHT`), those it had confirmed (`CONFIRMED`), and the
    digests of the copies it wrote (`COPIED_AS`)."""

    in_flight: frozenset[str] = frozenset()
    confirmed: frozenset[str] = frozenset()
    digests: frozenset[str] = frozenset()

    @classmethod
    def recorded(cls, db: Database[dict[str, Any]]) -> _KilledCopy:
        fields = {COPYING: 1, IN_FLIGHT: 1, CONFIRMED: 1, COPIED_AS: 1}
        state = db[MIGRATION_STATE].find_one({"_id": MIGRATION_STATE_ID}, fields) or {}
        if COPYING not in state:
            return cls()
        return cls(
            frozenset(matched_key(i) for i in state.get(IN_FLIGHT) or []),
            frozenset(matched_key(i) for i in state.get(CONFIRMED) or []),
            frozenset(state.get(COPIED_AS) or []),
        )

    def wrote(self, copy: dict[str, Any], turn: dict[str, Any]) -> bool:
        """Whether `copy`, standing under the `_id` of `turn` (as the source holds it now), is
        a copy the killed copy wrote of that very turn, edited since: a turn still in flight
        whose copy is one the copy recorded (`COPIED_AS`), and, once the copy had confirmed it
        (its delete may have run), the turn too as the copy read it. A turn logged under a
        moved turn's `_id` while the copy was down, or edited when the copy could not see it,
        is neither: the two cannot be told apart, and the copy is refused."""
        key = matched_key(copy["_id"])
        if key not in self.in_flight or copied_as(copy) not in self.digests:
            return False
        return key not in self.confirmed or copied_as(turn) in self.digests

    def refuse_others(self, batch: list[dict[str, Any]], target: Any) -> None:
        """Before a batch holding turns the killed copy had in flight is recorded: the
        refusal (`_replaced`) of a document under one of their `_id`s that is neither the turn
        nor a copy the killed copy wrote of it (`wrote`). Judged before this run records the
        batch, whose records (its `_id`s in flight, its digests) would make the next run take
        that document for the copy's own. One read, of those turns' copies, only then."""
        resumed = {
            matched_key(d["_id"]): d for d in batch if matched_key(d["_id"]) in self.in_flight
        }
        if not resumed:
            return
        for found in target.find({"_id": {"$in": [d["_id"] for d in resumed.values()]}}):
            turn = resumed.get(matched_key(found["_id"]), {})
            if not _same_content(found, turn) and not self.wrote(found, turn):
                raise _replaced(found, turn, self)


def _accept_identical_copies(
    error: BulkWriteError, batch: list[dict[str, Any]], target: Any, own: _KilledCopy
) -> None:
    """A resumed copy meets documents it copied before; anything else is an error. The same
    document is the same BSON (`_same_content`: a copy a claim moved since as it stood
    before, to the old service's save of it again), its `_id` the same to the server
    (`matched_key`: a turn logged under `5.0` after `5` was moved meets that turn). A copy
    the killed copy wrote (`own`) holding other content is the turn before the old
    service's edit since: it is made the turn as read now."""
    only_duplicates(error)
    failed = error.details.get("writeErrors", [])
    wanted = {matched_key(batch[e["index"]]["_id"]): batch[e["index"]] for e in failed}
    ids = [document["_id"] for document in wanted.values()]
    for found in target.find({"_id": {"$in": ids}}):
        turn = wanted.get(matched_key(found["_id"]), {})
        if _same_content(found, turn):
            continue
        if not own.wrote(found, turn):
            raise _replaced(found, turn, own) from error
        target.replace_one({"_id": found["_id"]}, turn)


def _other_content(copy: Mapping[str, Any], turn: Mapping[str, Any]) -> WorkLeft:
    """A turn of `agent_conversations` (`turn`) under the `_id` of a moved-aside turn (`copy`)
    holding other content: neither is overwritten nor deleted. The old service edited the
    moved turn after the move (an upsert by `_id` completing it), or logged another turn
    under its `_id`: the refusal says whose each is (conversation, user, time) and the way
    out of each, the edited turn first, since another `_id` given to it would migrate the
    turn twice, its stale copy beside it. One whose `_id` is its conversation's id stands where
    that conversation's document stands (`_in_its_place`: an upsert by `_id` replaced it):
    the refusal says so, and that the run writes the document again once the turn moves."""
    in_place = (
        f"; {turn['_id']!r} stands where its conversation's document stands (an upsert by _id "
        "of its turn replaces that document; `run` writes it again once the turn is moved)"
        if _in_its_place(turn)
        else ""
    )
    claimed = _before_its_claims(copy, turn) is not copy
    return WorkLeft(
        f"turn document {copy['_id']!r} exists in {LEGACY_TURNS} with other content "
        f"({_whose(copy)}) than the turn under that _id in {CONVERSATIONS} ({_whose(turn)})"
        f"{in_place}{_claimed_note(copy) if claimed else ''}; refusing to overwrite or "
        f"delete either: if the turn in {CONVERSATIONS} is the moved turn edited since (the "
        f"same conversation, user and time), {_edited_way(claimed)} (another _id would "
        "migrate the turn twice); only if it is another turn, give the turn in "
        f"{CONVERSATIONS} another _id; then `run` again"
    )


def _claimed_note(copy: Mapping[str, Any]) -> str:
    """What the refusal of a turn of other content says when a claim moved its copy away
    from the user the turn names (`_before_its_claims`): the same user."""
    return (
        f"; a claim moved the copy from the user the turn names to {copy.get('user_id')!r} "
        f"({CLAIMED_FROM} {copy.get(CLAIMED_FROM)!r}): the same user"
    )


def _edited_way(claimed: bool) -> str:
    """The way out of a moved turn edited since: delete its copy; one a claim moved, after
    giving the turn the copy's owner and record of its claims, which the copy alone holds."""
    delete = f"delete its copy from {LEGACY_TURNS}"
    if not claimed:
        return delete
    return f"give it the copy's user_id and {CLAIMED_FROM}, then {delete}"


def _replaced(copy: Mapping[str, Any], turn: Mapping[str, Any], own: _KilledCopy) -> WorkLeft:
    """The refusal of a copy meeting, under the `_id` of a turn it reads (`turn`, as the source
    holds it now), a document in the target it may not overwrite (`copy`): `_other_content`,
    or, for a turn a killed copy had confirmed (its delete may have moved it), what neither
    the copy nor the operator can tell apart without looking: the turn edited after the copy
    confirmed it, or another turn the old service logged under the moved turn's `_id`. It
    says whose each is (conversation, user, time), so the operator can."""
    turn_id = copy["_id"]
    if matched_key(turn_id) not in own.confirmed:
        return _other_content(copy, turn)
    return WorkLeft(
        f"turn document {turn_id!r} in {CONVERSATIONS} ({_whose(turn)}) is not the one a killed "
        f"copy confirmed moving, which {LEGACY_TURNS} holds as that copy read it "
        f"({_whose(copy)}): the old service edited it since, or logged another turn under its "
        "_id after the copy moved it. Refusing to overwrite or delete either: if the turn in "
        f"{CONVERSATIONS} is another turn (another conversation or user tells it), give it "
        f"another _id; only if it is the moved turn edited, delete its copy from {LEGACY_TURNS}; "
        "then `run` again"
    )


def _whose(turn: Mapping[str, Any]) -> str:
    """A turn document's conversation, user and time, as a refusal names them."""
    named = (turn.get(key) for key in ("conversation_id", "user_id", "created_at"))
    conversation, user, at = (repr(value) for value in named)
    return f"conversation {conversation}, user {user}, at {at}"
