"""Step 2 of the protocol: explode legacy turns into messages, conversation by conversation.

Streaming: one aggregation cursor yields the legacy conversation ids in order
(the server groups them, spilling to disk if it must); each batch of ids is
read with one `find` on the `conversation_id` index. Memory holds one batch of
conversations at a time: bounded by `--batch-size` times the largest
conversation, not by the corpus.

Per batch, the writes are planned first from what is stored (`writes.plan`),
so a dry run reports exactly what a run does; then made, each in bounded
commands (`bounds`), all idempotent:
1. conversation documents, each only as the plan read it (`writes._write`: a
   conversation the live logger has already written to, or a person changed
   since, is never overwritten);
2. for the conversations whose document is then as planned (`writes.apply`: not
   deleted, nor started by a live turn, since the plan), whole texts of cut messages,
   as GridFS files with deterministic ids;
3. and their messages with their deterministic ids by unordered `insert_many`;
   duplicate-key errors of identical documents are the only errors accepted;
4. the batch's problems, replacing those an earlier run recorded for it;
5. the run record (counts, checkpoint), only while the lock names the run.
The lease is renewed right before 1 and 4 (`fence`): a run paused past its lease
(its lock taken over) writes nothing it planned.

Conversation documents go before their messages, so a turn the live logger
logs meanwhile reserves `seq` values after the migrated ones. A kill between
any two writes is repaired by the next run, which recomputes the same documents.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from pymongo import ReturnDocument
from pymongo.database import Database

from agent_store.core import InvalidInput, to_utc_millis, utc_now
from agent_store.legacy import (
    LEGACY_TURNS,
    NAMING_FIELDS,
    SESSION_HITL,
    LegacyConversion,
    LegacyTurn,
    Problem,
    Unnamed,
    as_resolved,
    convert,
    group_conversations,
    legacy_name,
    named_filter,
    named_id,
    names_none,
    not_identifiers,
    not_utf8_at,
    owner_of,
    parse_turns,
    prompt_conversation,
    prompts_filter,
    scalar_filter,
    stored_conversation_id,
    tell_apart,
    texts_not_identifiers,
    turns_known_as,
    with_session_prompts,
)
from agent_store.store import (
    CONVERSATIONS,
    DERIVED_CONVERSATION_PREFIX,
    DERIVED_TURN_PREFIX,
    MESSAGES,
    TurnRules,
    is_derived_id,
)
from migrations import dual_writes, writes
from migrations import problems as problem_report
from migrations.bounds import MAX_COMMAND_BYTES, MAX_COMMAND_DOCUMENTS, Bounds
from migrations.claims import claims_recorded
from migrations.errors import Misuse
from migrations.keys import id_key, identity
from migrations.lease import STATE, STATE_ID, Lease
from migrations.order import Ranges, passed_still_there, plan_ranges, range_ids, spread_ids
from migrations.relocate import (
    LATE,
    LATE_OVERFLOW,
    TURN_FILTER,
    held_back,
    late_fits,
    turns_at,
    wrote_documents,
)
from migrations.settings import SERVICE_DEFAULTS, as_recorded, settings_differing
from migrations.writes import ALREADY_LIVE, Converted

LEGACY_FILTER: dict[str, Any] = TURN_FILTER
"""Legacy turns, those the new logger wrote for rollback too: each read is narrowed to what
`agent_messages` does not hold (`dual_writes.held`)."""
NOT_DUAL_WRITTEN: dict[str, Any] = {**TURN_FILTER, "dual_write": {"$ne": True}}
"""Legacy turns but the dual-written ones."""
_IDS_A_READ = 10_000
"""Conversation ids one read of their other spellings names (`other_spellings`): a batch
reading the turns naming none may lead to as many derived ids as there are such turns."""


def dropped_at(db: Database[dict[str, Any]]) -> Any:
    """When `finish --drop-legacy` dropped the legacy turns, or began to (`dropping_at`: its
    gate had passed; None: never): no run goes on after that, whatever a service still
    dual-writing brings back."""
    state = _drop_marks(db)
    return state.get("dropped_at") or state.get("dropping_at")


def drop_unfinished(db: Database[dict[str, Any]]) -> Any:
    """When `finish --drop-legacy` began a drop it did not record as made (stopped between
    the two: `finish --drop-legacy --yes` again makes it); None when there is no such drop."""
    return _begun_only(_drop_marks(db))


def _drop_marks(db: Database[dict[str, Any]]) -> dict[str, Any]:
    """The state's marks of a drop (`dropped_at`, `dropping_at`): one read."""
    return db[STATE].find_one({"_id": STATE_ID}, {"dropped_at": 1, "dropping_at": 1}) or {}


def _begun_only(marks: dict[str, Any]) -> Any:
    return marks.get("dropping_at") if marks.get("dropped_at") is None else None


def refuse_after_the_drop(db: Database[dict[str, Any]]) -> None:
    """Raise Misuse once `finish --drop-legacy` dropped the legacy turns, or began to
    (`dropped_at`): `run`, `verify` and `finish` alike, saying what `after_the_drop` says."""
    said = after_the_drop(db)
    if said is not None:
        raise Misuse(said)


LATE_SHOWN = 5
"""How many conversations of turns logged after the drop `after_the_drop` names."""


def after_the_drop(db: Database[dict[str, Any]]) -> str | None:
    """What every command says once `finish --drop-legacy` dropped the legacy turns, or began
    to (None: it did not): `run`, `verify` and `finish` refuse with it (exit 2), and `status`
    prints it. No run goes on: the gate would take every migrated conversation for one no
    legacy turn makes. It says what the legacy collection holds as it is (empty, or how many
    documents, and how many a service still dual-writing made: `_held_after_the_drop`);
    legacy turns in `CONVERSATIONS` an old-service writer logged after the drop hold content
    no new collection does, and it names them. The restore it advises names the one backup
    holding no turn a delete or an erasure took before the drop (the deprecated collection
    as it stood right before it), and says to leave out those of any taken since: the store
    keeps no record of a delete or an erasure once done, so no run can tell them."""
    marks = _drop_marks(db)
    begun = _begun_only(marks)
    if begun is not None:
        return (
            f"`finish --drop-legacy` began dropping the legacy turns at {begun}, its gate "
            "passed, and was stopped before it recorded the drop: run `finish --drop-legacy "
            "--yes` again to finish it. Nothing is migrated or checked meanwhile"
        )
    dropped = marks.get("dropped_at") or marks.get("dropping_at")
    if dropped is None:
        return None
    restore = (
        f"restore the dropped legacy turns into {LEGACY_TURNS} from a backup of "
        f'{LEGACY_TURNS} taken right before the drop, never the "Before" backup, and leave '
        "out the turns of every conversation deleted, and of every user erased, since that "
        "backup was taken (the store keeps no record of a delete or an erasure once done: a "
        "run would migrate such turns anew and serve them to their owners), and unset "
        f"`dropped_at` and `dropping_at` in the {STATE_ID!r} document of {STATE}"
    )
    late = db[CONVERSATIONS].count_documents(TURN_FILTER)
    if not late:
        held, copies = _held_after_the_drop(db)
        stop = ". Unset AGENT_STORE_LEGACY_DUAL_WRITE" if copies else ""
        return (
            f"`finish --drop-legacy` dropped the legacy turns at {dropped}, every legacy "
            f"conversation migrated; {held}. There is nothing to migrate or check, and a run "
            "(or the gate) would take every migrated conversation for one no legacy turn "
            f"makes{stop}; to run again, {restore}"
        )
    named = db[CONVERSATIONS].distinct("conversation_id", TURN_FILTER)
    shown = ", ".join(map(repr, named[:LATE_SHOWN])) + (" …" if len(named) > LATE_SHOWN else "")
    return (
        f"`finish --drop-legacy` dropped the legacy turns at {dropped}, and {CONVERSATIONS} "
        f"holds {late} legacy turns an old-service writer logged after the drop "
        f"(conversations {shown}): their content is in no new collection, and no run can "
        "migrate them now (a run, or the gate, would take every migrated conversation for one "
        "no legacy turn makes). Stop the old-service writers; then, to migrate them, "
        f"{restore}, and run the migration again (it moves them aside and migrates them with "
        f"the rest); until then they stay in {CONVERSATIONS}, as they are"
    )


def _held_after_the_drop(db: Database[dict[str, Any]]) -> tuple[str, int]:
    """What the legacy collection holds after the drop, as it is, and how many of its documents
    are copies a service still dual-writing made (`dual_write: true`)."""
    held = db[LEGACY_TURNS].count_documents({})
    if not held:
        return f"{LEGACY_TURNS} is empty", 0
    copies = db[LEGACY_TURNS].count_documents({"dual_write": True})
    made = f"copies a service still dual-writing made of turns in {MESSAGES}"
    if held == copies:
        what = f"a copy a service still dual-writing made of a turn in {MESSAGES}"
        return f"{LEGACY_TURNS} holds {held} " + (
            f"document: {what}" if held == 1 else f"documents: {made}"
        ), copies
    documents = "1 document" if held == 1 else f"{held} documents"
    return (
        f"{LEGACY_TURNS} holds {documents} put there after the drop, {copies} of them "
        f"{made} (marked `dual_write`)"
    ), copies


def prove_lease(db: Database[dict[str, Any]], lease: Lease | None) -> None:
    """Right before writing: renew the lease, which fails once another run or `finish` took
    the lock (this run paused past its lease). What a run read before a pause is never
    written after one; the writes that follow have a whole lease, far longer than a batch's
    writes take. The renewal alone also fences the drop: `finish` records a drop begun or
    made only holding the lock (`Lease.write_state`), so a drop since this run took the lock
    took it over, and the run checked for an earlier one once it held it (`refuse_after_the_drop`
    in `cli._holding_the_lock`): no read of the state per batch."""
    if lease is not None:
        lease.renew()


T = TypeVar("T")


@dataclass
class Options:
    dry_run: bool = False
    limit: int | None = None
    conversation: str | None = None
    batch_size: int = 100
    restart: bool = False
    max_command_documents: int = MAX_COMMAND_DOCUMENTS
    max_command_bytes: int = MAX_COMMAND_BYTES
    spread: int = 16
    """Ranges of the id space each batch takes its ids from in turn (1: sorted order)."""
    rules: TurnRules = SERVICE_DEFAULTS
    """How the service stores turns (`migrations.settings`): the run converts by them."""

    @property
    def bounds(self) -> Bounds:
        return Bounds(self.max_command_documents, self.max_command_bytes)

    def recorded(self) -> dict[str, Any]:
        """The options as the run's record keeps them, the rules by the settings they are
        made of: which markers, bound and name length the run converted by."""
        made_of = as_recorded(self.rules)
        return {k: v for k, v in self.__dict__.items() if k != "rules"} | {"rules": made_of}


@dataclass
class Counts:
    conversations: int = 0
    turns: int = 0
    messages: int = 0
    """Messages the legacy turns convert to."""
    messages_written: int = 0
    """Messages written by this run (the rest were already there)."""
    conversations_written: int = 0
    full_texts_written: int = 0
    live_skipped: int = 0
    """Conversations whose first `seq` values already hold other messages."""
    problems: int = 0
    unplaced: int = 0
    """Problems holding content no message holds."""
    problems_by_kind: dict[str, int] = field(default_factory=dict)
    abandoned_removed: int = 0
    """Conversations the migration made that no legacy turn makes now, removed (`abandoned`)."""
    abandoned_left: int = 0
    """Such conversations live turns wrote to: reported, not removed."""
    earlier_removed: int = 0
    """Conversations of another life the migration's messages of an earlier one (a deleted
    conversation's) were removed from, the conversation kept (`abandoned.Abandoned.earlier`)."""
    reowned: list[str] = field(default_factory=list)
    """Conversations whose legacy turns changed owner (an account claim) between a batch's
    plan and its writes: nothing more of theirs was written, and they are left for the next
    run (`writes.Applied.reowned`); the run exits 1 naming them."""

    def as_document(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def add(self, written: writes.Applied, found: list[Problem]) -> None:
        """What a batch wrote (a dry run: what it planned to), and the problems found."""
        self.messages_written += written.written
        self.conversations_written += written.documents
        self.full_texts_written += written.full_texts
        self.reowned += sorted(written.reowned - set(self.reowned))
        self.add_problems(found)

    def add_problems(self, found: list[Problem]) -> None:
        self.problems += len(found)
        self.unplaced += sum(1 for p in found if not p.placed)
        for problem in found:
            self.problems_by_kind[problem.kind] = self.problems_by_kind.get(problem.kind, 0) + 1


def undated_time(db: Database[dict[str, Any]], *, record: bool) -> datetime:
    """The time of conversations without any readable time: the first run's start, recorded
    in the migration state so every rerun gives them the same (a dry run only reads it)."""
    now = utc_now()
    if not record:
        state = db[STATE].find_one({"_id": STATE_ID}, {"undated_at": 1}) or {}
        found = state.get("undated_at")
        return to_utc_millis(found) if isinstance(found, datetime) else now
    recorded = db[STATE].find_one_and_update(
        {"_id": STATE_ID},
        [{"$set": {"undated_at": {"$ifNull": ["$undated_at", {"$literal": now}]}}}],
        upsert=True,
        return_document=ReturnDocument.AFTER,
    )
    return to_utc_millis(recorded["undated_at"]) if recorded else now


def conversation_ids(db: Database[dict[str, Any]], *, source: str) -> Iterator[Any]:
    """Every legacy conversation id of the turns in `source`, sorted, streamed from the
    server."""
    return (conversation_id for _, conversation_id in range_ids(db, source, LEGACY_FILTER))


def count_conversations(db: Database[dict[str, Any]], *, source: str) -> int:
    """How many conversation ids `conversation_ids` lists (each value a server cannot group,
    such as a DBRef, counted too: `order.range_ids`)."""
    return sum(1 for _ in conversation_ids(db, source=source))


def batches(ids: Iterator[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for conversation_id in ids:
        batch.append(conversation_id)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def read_turns(
    db: Database[dict[str, Any]], ids: list[Any], *, source: str
) -> list[tuple[Any, list[dict[str, Any]]]]:
    """The turns of some conversations, each list in stored order, by the id the reader
    names them (`id_text`): 7 and "7" are one conversation to it, so the turns under either
    are read whichever of them a batch holds (converted twice, the same way both times), as
    are True and "True", or a Decimal128 and its JSON text. An id holding text that is not
    valid UTF-8, which no query names, by `_not_utf8_turns`."""
    grouped: dict[Any, tuple[Any, list[dict[str, Any]]]] = {_key(i): (i, []) for i in ids}
    sendable = [i for i in ids if not_utf8_at(i) is None]
    found: Iterable[dict[str, Any]] = db[source].find(turns_filter(sendable)) if sendable else []
    for doc in claims_recorded(db, [*found, *_not_utf8_turns(db, ids, source)]):
        raw = doc.get("conversation_id")
        grouped.setdefault(_key(raw), (raw, []))[1].append(doc)
    return list(grouped.values())


def _not_utf8_turns(
    db: Database[dict[str, Any]], ids: list[Any], source: str
) -> Iterator[dict[str, Any]]:
    """The turns under those of `ids` holding text that is not valid UTF-8 (`not_utf8_at`),
    which no query can name (PyMongo encodes no such text): found among the turns whose
    `conversation_id` is text that is no identifier (`texts_not_identifiers`), by the id each
    holds as read. One scan of those, only for a batch holding such an id."""
    wanted = {id_key(i) for i in ids if not_utf8_at(i) is not None}
    if not wanted:
        return
    texts = texts_not_identifiers("conversation_id")
    for doc in db[source].find({"$and": [texts, LEGACY_FILTER]}):
        if id_key(doc.get("conversation_id")) in wanted:
            yield doc


def turns_filter(ids: list[Any]) -> dict[str, Any]:
    """The filter of the legacy turns of these conversations, each under every value the
    reader names as it (`named`): a run, `verify`, `finish` and the CLI's `--conversation`
    find a conversation by this one filter, so `42` given as text finds turns stored under
    the number 42."""
    return {"$and": [{"$or": [named(i) for i in ids]}, LEGACY_FILTER]}


def conversation_named(db: Database[dict[str, Any]], given: str, *, source: str) -> Any:
    """The legacy id `--conversation` names, for `run` and `verify` alike: `given` when turns
    are stored under it as the reader names ids (`turns_filter`), else the legacy id of the
    conversation the migration stored under `given` (an id derived from a legacy one, as
    `verify` and `finish` print it). Misuse when it names no conversation's turns."""
    legacy, document = _named(db, given, source=source)
    if legacy is not None:
        return legacy
    if document and document.get("legacy_conversation_id") is None:
        raise Misuse(
            f"{given!r} is a conversation the migration made of a turn naming no conversation; "
            "no --conversation names it: `verify` without one checks it"
        )
    raise Misuse(no_legacy_turns(given, source))


def stored_id_named(db: Database[dict[str, Any]], given: str, *, source: str) -> str | None:
    """The id the conversation `given` names is stored under, as the gate and the problems
    name it: `given` when a conversation document is stored under it, whatever made it (a
    turn naming no conversation, a live turn), else the id the run stores its legacy turns
    under (`stored_conversation_id`: one derived from a legacy id that is no identifier,
    `conv 42/x`). None when it names no conversation (`conversation_named`)."""
    legacy, document = _named(db, given, source=source)
    if document:
        return given
    turn = None if legacy is None else db[source].find_one(turns_filter([legacy]), NAMING_FIELDS)
    return None if turn is None else stored_conversation_id(turn)


def no_legacy_turns(given: str, source: str) -> str:
    """What a command says of an id naming no conversation's turns (`conversation_named`)."""
    return (
        f"no legacy turns for conversation {given!r} in {source}, nor a migrated conversation "
        "of that id whose legacy turns are there"
    )


def _named(db: Database[dict[str, Any]], given: str, *, source: str) -> tuple[Any, dict[str, Any]]:
    """The legacy id `given` names (None: none), and the conversation document stored under
    `given` (`legacy_conversation_id` alone; empty: none)."""
    if db[source].find_one(turns_filter([given]), {"_id": 1}) is not None:
        return given, {}
    document = db[CONVERSATIONS].find_one({"_id": given}, {"legacy_conversation_id": 1}) or {}
    legacy = document.get("legacy_conversation_id")
    if legacy is not None and db[source].find_one(turns_filter([legacy]), {"_id": 1}):
        return legacy, document
    return None, document


def _key(value: Any) -> Any:
    """How the reader names the id (`named_id`): None when it names no conversation."""
    return named_id(value)


def named(value: Any) -> dict[str, Any]:
    """The filter of the turns under every value the reader names as `value`."""
    return named_filter("conversation_id", value)


def read_session_hitl(
    db: Database[dict[str, Any]],
    legacy_ids: Mapping[str, str | None],
    *,
    among: Mapping[str, Any] | None = None,
) -> dict[str, list[Any]]:
    """The `session_hitl` prompts of these conversations, by the id each is stored under.

    `legacy_ids` gives each stored id the legacy id its turns name: the prompts name that
    one (a conversation stored under a derived id too), read with the filter and the naming
    the read fallback uses (`prompts_filter`, `prompt_conversation`). None names no
    conversation: none of its prompts can be told apart. `among` narrows the prompts read
    (the orphan finder asks which of its prompts a conversion reads).
    """
    found: dict[str, list[Any]] = {stored: [] for stored in legacy_ids}
    stored_as = {legacy: stored for stored, legacy in legacy_ids.items() if legacy is not None}
    if not stored_as:
        return found
    query: dict[str, Any] = {"$or": [prompts_filter(i) for i in stored_as]}
    for doc in db[SESSION_HITL].find({"$and": [query, among]} if among else query):
        key = prompt_conversation(doc)
        if key in stored_as:
            found[stored_as[key]].append(doc)
    return found


def _parsed(
    raw_id: Any, documents: list[dict[str, Any]], source: str, alike: Unnamed
) -> list[LegacyTurn] | Problem:
    try:
        return parse_turns(documents, alike.names)
    except InvalidInput as exc:
        return Problem(
            conversation_id=str(raw_id),
            legacy_id=str(documents[0].get("_id")),
            kind="invalid_conversation",
            detail=exc.message + f"; its {len(documents)} turns stay in {source}",
            content=documents,
        )


def _unread(raw_id: Any, source: str) -> Problem:
    """An id listed as a conversation whose turns a read by it does not find: work left,
    never skipped (a drop would take turns no run converted)."""
    why = (
        "an id holding bytes that are not valid UTF-8, which no query can name; correct it "
        "in the database"
        if not_utf8_at(raw_id) is not None
        else "a value this server does not match by equality, such as a legacy UUID, BSON "
        "binary subtype 3; store the id as text"
    )
    return Problem(
        conversation_id=str(raw_id),
        legacy_id="*",
        kind="unread_conversation",
        detail=(
            f"no legacy turns under this id: {source} lists {raw_id!r} as a conversation but "
            f"a read by it finds none ({why}), then run again"
        ),
        content={"conversation_id": raw_id},
    )


def convert_batch(
    db: Database[dict[str, Any]],
    ids: list[Any],
    rules: TurnRules,
    *,
    source: str,
    undated_at: datetime | None = None,
    held: list[dict[str, Any]] | None = None,
) -> tuple[list[Converted], list[Problem], dict[str, int]]:
    """Read and convert a batch: conversions, problems of unconvertible ones, and the turns
    read by the conversation they are stored under (an unconvertible one: its id as read).

    Turns are grouped by the id they are stored under: a legacy id that is not an
    identifier gets a derived one, and each turn naming no conversation is one. A stored
    conversation is converted whole, whichever way its turns name it (`other_spellings`):
    one conversation, one `seq` space. An id whose turns the read does not find is a problem
    (`_unread`), as one that cannot be converted. A dual-written turn whose messages are
    stored is not converted (`dual_writes.held`); those of the batch's ids are added to
    `held`, for `verify` and `finish` to compare.
    """
    read = read_turns(db, ids, source=source)
    failed = [_unread(raw_id, source) for raw_id, found in read if not found]
    stored = dual_writes.held(db, [d for _, found in read for d in found])
    if held is not None:
        held += [d for _, found in read for d in found if id(d) in stored]
    alike = unnamed_turns(db, [d for _, found in read for d in found], source=source)
    # Held copies too: one no turn under any spelling of its id makes is `live_only`'s.
    joined = other_spellings(db, read, lambda _: True, source=source, alike=alike)
    if not alike.ids:
        alike = unnamed_turns(db, [d for _, found in joined for d in found], source=source)
    stored |= dual_writes.held(db, [d for _, found in joined for d in found])
    groups: dict[str, list[LegacyTurn]] = {}
    turns: dict[str, int] = {}
    for raw_id, found in read + joined:
        documents = [d for d in found if id(d) not in stored]
        parsed = _parsed(raw_id, documents, source, alike) if documents else []
        if isinstance(parsed, Problem):
            failed.append(parsed)
            turns[parsed.conversation_id] = turns.get(parsed.conversation_id, 0) + len(documents)
            continue
        for cid, group in group_conversations(parsed).items():
            groups.setdefault(cid, []).extend(group)
    spellings = _spellings(read + joined, alike)
    turns |= {cid: len(group) for cid, group in groups.items()}
    converted = [
        _converted(group, rules, undated_at, spellings.get(cid, 1)) for cid, group in groups.items()
    ]
    held_documents = [d for _, found in read + joined for d in found if id(d) in stored]
    _as_copies_say(converted, held_documents)
    hitl = read_session_hitl(
        db, {c.conversion.conversation_id: legacy_name(c.turns) for c in converted}
    )
    converted, unreadable = _with_prompts(converted, hitl, source)
    failed += unreadable
    converted += _answered_live(db, live_only(held_documents, set(groups), rules, undated_at))
    return converted, failed, turns


def refused_for_prompts(
    db: Database[dict[str, Any]], rules: TurnRules, *, source: str
) -> list[Problem]:
    """The problems a run records for the conversations `session_hitl` prompts holding bytes
    that are not valid UTF-8 name (`status`'s, before any run): each such conversation whose
    prompts it takes cannot be converted (`_with_prompts`: an `invalid_conversation` naming
    the prompt and where), told as a run tells it, by converting those conversations from
    `source` (`convert_batch`, which writes nothing), a conversation held back left out
    (`relocate.held_back`: a run records nothing of it). A prompt naming its conversation in
    such text names none a run reads: `orphan_prompts` records it, a pending one. One read
    of the prompts collection; the conversion and the look for documents holding
    conversations back only when a prompt holds such bytes."""
    named = {
        conversation
        for prompt in db[SESSION_HITL].find({})
        if not_utf8_at(prompt) is not None
        and (conversation := prompt_conversation(prompt)) is not None
        and not_utf8_at(conversation) is None
    }
    if not named:
        return []
    _, failed, _ = convert_batch(db, sorted(named), rules, source=source)
    held = held_back(db)
    return [p for p in failed if p.kind == "invalid_conversation" and p.conversation_id not in held]


def _with_prompts(
    converted: list[Converted], hitl: Mapping[str, list[Any]], source: str
) -> tuple[list[Converted], list[Problem]]:
    """Each conversion with its `session_hitl` prompts (`with_session_prompts`), and a problem
    for each whose prompts it cannot take (one holding text that is not valid UTF-8), as for
    turns no model holds (`_parsed`): nothing of that conversation is written, its turns and
    prompts stay as stored, the problem keeps the prompts, and the other conversations go on."""
    kept: list[Converted] = []
    failed: list[Problem] = []
    for item in converted:
        prompts = hitl.get(item.conversion.conversation_id, [])
        try:
            with_session_prompts(item.conversion, prompts)
        except InvalidInput as exc:
            failed.append(
                Problem(
                    conversation_id=item.conversion.conversation_id,
                    legacy_id=SESSION_HITL,
                    kind="invalid_conversation",
                    detail=exc.message + f"; its {len(item.turns)} turns stay in {source}, "
                    f"its {len(prompts)} prompts in {SESSION_HITL}",
                    content=prompts,
                )
            )
            continue
        kept.append(item)
    return kept, failed


def _converted(
    group: list[LegacyTurn], rules: TurnRules, undated_at: datetime | None, spellings: int
) -> Converted:
    """One conversation's turns (named `spellings` ways) converted by `rules`."""
    # The legacy spelling first, then the dual writes naming the derived id: the same
    # order whichever of the two a batch reads first (ties in time keep it).
    group.sort(key=lambda t: t.conversation_id == t.stored_conversation_id)
    conversion = convert(group, rules=rules, undated_at=undated_at)
    return Converted(group, conversion, spellings=spellings, markers=rules.markers)


def _answered_live(db: Database[dict[str, Any]], live: list[Converted]) -> list[Converted]:
    """Each conversation only held dual writes make (`live_only`), with the requests the new
    service answered (`as_resolved`: the records its dual write kept of them in
    `session_hitl`, `answer_record`), which the document a rollback moved away remembered.
    Its pending prompts stay orphans (`live_only`): only the answered ones are read here, one
    read for the batch."""
    if not live:
        return live
    named = {c.conversion.conversation_id: legacy_name(c.held) for c in live}
    hitl = read_session_hitl(db, named, among={"dual_write": True})
    for item in live:
        conversation = item.conversion.conversation
        if conversation is not None:
            found = hitl.get(item.conversion.conversation_id, [])
            item.conversion.conversation = as_resolved(conversation, conversation.user_id, found)
    return live


def _spellings(read: list[tuple[Any, list[dict[str, Any]]]], alike: Unnamed) -> dict[str, int]:
    """How many values of `conversation_id` (by BSON value: `42` is not `"42"`) the turns read
    name each of their conversations by (`Converted.spellings`)."""
    values: dict[str, set[bytes]] = {}
    for _, found in read:
        for document in found:
            cid = stored_conversation_id(document, alike.names)
            values.setdefault(cid, set()).add(id_key(document.get("conversation_id")))
    return {cid: len(found) for cid, found in values.items()}


def _as_copies_say(converted: list[Converted], held: list[dict[str, Any]]) -> None:
    """Give each conversion what its held dual-written copies, turns of it like any other,
    make of it though the conversion reads the legacy turns only: its owner, the last user
    its turns name, copies included (`owner_of`: a live turn that adopted an unowned
    conversation names its user, which a second attempt after a rollback would otherwise
    give back to nobody), and its name, when the last turn naming one is a copy (a runtime's
    `name=` on a live turn: `dual_writes.copy_naming`, the rule `differences` checks the
    document by)."""
    copies: dict[str, list[LegacyTurn]] = {}
    for document in held:
        try:
            [turn] = parse_turns([document])
        except InvalidInput:
            continue  # a copy no model holds names nothing; `dual_writes.differences` says why
        copies.setdefault(turn.stored_conversation_id, []).append(turn)
    for item in converted:
        conversion = item.conversion
        own = copies.get(conversion.conversation_id)
        item.copies = len(own or [])
        if conversion.conversation is None or not own:
            continue
        update: dict[str, Any] = {}
        if (owner := owner_of([*item.turns, *own])) != conversion.owner:
            conversion.owner = owner
            conversion.messages = [
                m.model_copy(update={"user_id": owner}) for m in conversion.messages
            ]
            update["user_id"] = owner
        found = dual_writes.copy_naming(item.turns, own)
        if found is not None and found[1] != conversion.conversation.name:
            update |= {"name": found[1], "name_source": "runtime"}
        conversion.conversation = conversion.conversation.model_copy(update=update)


def live_only(
    documents: list[dict[str, Any]],
    converted: set[str],
    rules: TurnRules,
    undated_at: datetime | None,
) -> list[Converted]:
    """The conversations of these held dual writes (`dual_writes.held`) no other legacy turn
    makes (not in `converted`: the batch read every turn naming them, under every spelling,
    `other_spellings`): one the new service started, or forked, during the transition, or
    one whose other legacy turns the old service deleted after a rollback. Each is a
    conversation document to write again (a rollback moved it away) and no message (theirs
    are stored; once its document is gone, the migration's, of legacy turns deleted since,
    are removed: `writes.plan`): its
    summary is what its dual writes convert to (`writes` counts and folds its stored
    messages), and its dual writes fence its writes as legacy turns do (`Converted.held`). It
    reads no `session_hitl` prompt: one naming it is an orphan (`orphan_prompts`, which reads
    no dual write either)."""
    try:
        turns = parse_turns(documents)
    except InvalidInput:  # a dual write edited past reading: `dual_writes.differences` says so
        return []
    groups = {c: g for c, g in group_conversations(turns).items() if c not in converted}
    found: list[Converted] = []
    for cid, group in groups.items():
        conversion = convert(group, rules=rules, undated_at=undated_at)
        if conversion.conversation is None:
            continue
        summary = conversion.conversation.model_copy(update={"message_count": 0})
        conversion = LegacyConversion(cid, [], summary, [], 0)
        found.append(
            Converted([], conversion, held=group, copies=len(group), markers=rules.markers)
        )
    return found


def other_spellings(
    db: Database[dict[str, Any]],
    read: list[tuple[Any, list[dict[str, Any]]]],
    wanted: Callable[[dict[str, Any]], bool],
    *,
    source: str,
    alike: Unnamed | None = None,
) -> list[tuple[Any, list[dict[str, Any]]]]:
    """The turns filed under the conversations of the `read` turns (`read_turns`) that name
    them another way, grouped as `read_turns` groups them.

    A conversation stored under a derived id is named by the legacy id it stands for (or,
    for a `legacy-turn-` id, by none, on the turn it was made of) and by the derived id
    itself, which a dual write made before it named a conversation as its legacy turns do.
    For a read turn of the first kind the turns naming the derived id are read; for a
    derived id read alone, whose turns need converting (`wanted`), the turns it stands for:
    found by one pass over the legacy ids that are no identifier (`not_identifiers`), or
    over the `_id`s of the turns naming none for a hashed `legacy-turn-h…` id. One more read
    (one per `_IDS_A_READ` derived ids), only for a batch holding a derived conversation.
    """
    documents = [d for _, found in read for d in found]
    names: dict[str, set[str | None]] = {}
    converted: set[str] = set()
    for document in documents:
        cid = stored_conversation_id(document, alike.names if alike else None)
        names.setdefault(cid, set()).add(named_id(document.get("conversation_id")))
        if wanted(document):
            converted.add(cid)
    renamed = sorted(cid for cid, named in names.items() if named != {cid})
    alone = sorted(cid for cid in converted if names[cid] == {cid} and is_derived_id(cid))
    reads = [
        [scalar_filter("conversation_id", {"$in": ids})]
        for ids in batches(iter(renamed), _IDS_A_READ)
    ]
    if stood_for := _stood_for(db, alone, source):
        reads.append(stood_for)
    seen = {identity(d) for d in documents}
    grouped: dict[Any, tuple[Any, list[dict[str, Any]]]] = {}
    for clauses in reads:
        for doc in db[source].find({"$and": [{"$or": clauses}, LEGACY_FILTER]}):
            if identity(doc) not in seen:
                raw = doc.get("conversation_id")
                grouped.setdefault(_key(raw), (raw, []))[1].append(doc)
    return list(grouped.values())


def _stood_for(
    db: Database[dict[str, Any]], derived: list[str], source: str
) -> list[dict[str, Any]]:
    """The filters of the legacy turns these derived ids stand for (`other_spellings`)."""
    clauses: list[dict[str, Any]] = []
    conversations = {cid for cid in derived if cid.startswith(DERIVED_CONVERSATION_PREFIX)}
    if conversations:
        match = {"$and": [not_identifiers("conversation_id"), LEGACY_FILTER]}
        for _, value in range_ids(db, source, match):
            if stored_conversation_id({"conversation_id": value}) in conversations:
                clauses.append(named(value))
    made = turns_made_of(db, derived, source=source)
    for cid in derived:
        if cid.startswith(DERIVED_TURN_PREFIX):
            clauses.append(turns_known_as(cid, None, made.ids.get(cid, [])))
    return clauses


def turns_made_of(
    db: Database[dict[str, Any]], conversation_ids: Iterable[str], *, source: str
) -> Unnamed:
    """The turns naming no conversation told apart (`tell_apart`), when a `legacy-turn-` id
    is among `conversation_ids`: by it (`Unnamed.ids`), the `_id`s of the turns it stands
    for. One scan of their `_id`s and times, only when there is such an id."""
    needed = any(cid.startswith(DERIVED_TURN_PREFIX) for cid in conversation_ids)
    return _told_apart(db, source) if needed else Unnamed({}, {})


def unnamed_turns(
    db: Database[dict[str, Any]], documents: Iterable[Mapping[str, Any]], *, source: str
) -> Unnamed:
    """The turns naming no conversation told apart (`tell_apart`), when one of `documents`
    names none: what each goes by. One scan of their `_id`s and times, only then."""
    needed = any(named_id(d.get("conversation_id")) is None for d in documents)
    return _told_apart(db, source) if needed else Unnamed({}, {})


def _told_apart(db: Database[dict[str, Any]], source: str) -> Unnamed:
    return tell_apart(db[source].find(names_none("conversation_id"), NAMING_FIELDS))


def ranges_unfinished(state: Mapping[str, Any]) -> bool:
    """Whether the migration's state holds ranges of ids a run stopped in, for the next run
    to resume."""
    return not state.get("complete", True) and "ranges" in state


RANGES_CUT_BY = "ranges_cut_by"
"""The field naming the run that cut the ranges of ids (`Ranges.cut_by`), in the migration's
state (beside them) and in the record of every run going through them: the runs resuming
them go on with the pass that run began, whatever runs went through conversations between."""

MIGRATING = {"kind": "run", "counts.conversations": {"$gt": 0}}
"""The records of runs that went through conversations: a run records its count of them
before it writes the first (`Explosion.batch`), so a run killed at any point is among them."""


def _recorded_rules(record: Mapping[str, Any]) -> Mapping[str, Any]:
    """The settings a run's record says it converted by. A record written before runs
    recorded their rules was made by the defaults, which every run used then."""
    return (record.get("options") or {}).get("rules") or as_recorded(SERVICE_DEFAULTS)


def rules_changed(db: Database[dict[str, Any]], rules: TurnRules) -> tuple[str, list[str]]:
    """The last run that went through conversations (a stopped one a resume goes on with
    among them), and the settings `rules` differ in from those it converted them by
    (`settings_differing`: none, or no such run, is an empty list)."""
    last = list(db[STATE].find(MIGRATING, {"options.rules": 1}).sort("started_at", -1).limit(1))
    if not last:
        return "", []
    return str(last[0]["_id"]), settings_differing(rules, _recorded_rules(last[0]))


def rules_stored_by(db: Database[dict[str, Any]], rules: TurnRules) -> tuple[list[str], list[str]]:
    """The runs whose settings the stored conversations may be converted by that differ from
    `rules`, and the settings they differ in (names, in `settings_differing`'s order). Those
    runs are the last that went through every conversation (a pass `completed`, not one
    `--conversation`) and every run that went through conversations since the pass began
    (`_pass_began`): the runs of the pass, each of which converted a part of them by its own
    settings (a resume passes over what the runs before it converted), any run between them
    (a `--new-rules` run killed before its first checkpoint, whose ranges no run resumed),
    and those since (a `--new-rules` pass not gone through yet leaves the earlier ones)."""
    passes = {"kind": "run", "status": "completed", "options.conversation": None}
    shown = {"started_at": 1, RANGES_CUT_BY: 1, "checkpoint_at_start": 1}
    last = list(db[STATE].find(passes, shown).sort("started_at", -1).limit(1))
    began = _pass_began(db, last[0]) if last else None
    since: dict[str, Any] = MIGRATING
    if began is not None:
        since = {"$or": [{"_id": last[0]["_id"]}, {**MIGRATING, "started_at": {"$gte": began}}]}
    differing = [
        (str(record["_id"]), _recorded_rules(record))
        for record in db[STATE].find(since, {"options.rules": 1}).sort("started_at", 1)
        if settings_differing(rules, _recorded_rules(record))
    ]
    return [run for run, _ in differing], settings_differing(rules, *(r for _, r in differing))


def _pass_began(db: Database[dict[str, Any]], completed: Mapping[str, Any]) -> Any:
    """When the pass a `completed` run's record ends began: when the run that cut the ranges
    it went through started (`RANGES_CUT_BY`; recorded before runs named it, the run itself
    when it resumed no checkpoint). None when not known (a resume recorded before runs named
    the cut, or the cutting run's record gone): every run that went through conversations
    may have converted some."""
    cut_by = completed.get(RANGES_CUT_BY)
    if cut_by is None and not completed.get("checkpoint_at_start"):
        cut_by = completed["_id"]
    if cut_by == completed["_id"]:
        return completed.get("started_at")
    cutting = db[STATE].find_one({"_id": cut_by, "kind": "run"}, {"started_at": 1})
    return None if cutting is None else cutting.get("started_at")


def refuse_other_rules(db: Database[dict[str, Any]], rules: TurnRules) -> None:
    """Misuse, before a run writes anything, when its rules differ from those of the last run
    that migrated conversations: it would rewrite what that run stored, live conversations
    included (context it hid made visible, the problem keeping it removed)."""
    run_id, differing = rules_changed(db, rules)
    if differing:
        raise Misuse(
            f"the turn settings differ from those run {run_id} migrated the conversations by "
            f"(`options.rules` of its record in {STATE}): {', '.join(differing)}; a run by "
            "these would rewrite what it stored, live conversations included: set them as that "
            "run had them (the service's environment) and run again, or pass --new-rules to "
            "convert every conversation again by the settings set now"
        )


class Explosion:
    """One run of the migration."""

    def __init__(
        self,
        db: Database[dict[str, Any]],
        options: Options,
        *,
        lease: Lease | None,
        source: str | None = None,
    ) -> None:
        self.db = db
        self.options = options
        self.lease = lease
        self.rules = options.rules
        self.source = turns_at(db) if source is None else source
        """Where this run reads the legacy turns (`relocate.turns_at`, unless told)."""
        self.also: tuple[str, ...] = ()
        """Where a dry run's removal of conversations no legacy turn makes also reads them:
        the other collection whose turns the run's move merges in
        (`relocate.turns_after_the_move`)."""
        self.on_batch: Callable[[int, int], None] | None = None
        """Told (conversations, turns so far) after each batch: the CLI's progress bar."""
        self.after_all: Callable[[], None] | None = None
        """Called once a run has gone through every conversation (not one `--conversation`)."""
        self.counts = Counts()
        self.declared = False
        """Whether the run's record counts conversations yet (`_declare`)."""
        self.wrote_documents = False
        """Whether the state records this run's documents yet (`_record_documents`)."""
        self.counted_twice: set[str] = set()
        """The conversations counted that two batches can both convert: those named more than
        one way (`Converted.spellings`: `42` and `"42"`, a legacy id and its derived id), and
        derived ids. Held for the run, so each is counted once; few conversations are."""
        kind = "dry-run-" if options.dry_run else "run-"
        self.run_id = lease.run_id if lease else kind + uuid.uuid4().hex[:8]
        self.started = time.monotonic()
        self.undated_at = undated_time(db, record=not options.dry_run)
        self.earlier_problems = db[problem_report.PROBLEMS].find_one({}, {"_id": 1}) is not None
        self.held_back = held_back(db)
        """The conversations documents no run reads hold back (`relocate.held_back`): read,
        counted, and left as they are, nothing of them planned, written or recorded."""
        self.late: dict[bytes, Any] = {}
        """The conversations a resumed run migrates first, whatever its checkpoints, by
        `id_key`: those a move made since its ranges were cut brought turns of
        (`relocate.LATE`), each taken off once migrated."""

    # -- the run record ------------------------------------------------------------------

    def _record(self, status: str, **extra: Any) -> None:
        if self.options.dry_run:
            return
        self.db[STATE].update_one(
            {"_id": self.run_id},
            {
                "$set": {
                    "kind": "run",
                    "status": status,
                    "updated_at": utc_now(),
                    "seconds": round(time.monotonic() - self.started, 3),
                    "counts": self.counts.as_document(),
                    **extra,
                },
                "$setOnInsert": {"started_at": utc_now(), "options": self.options.recorded()},
            },
            upsert=True,
        )

    def _declare(self) -> None:
        """Before the run writes its first conversation: its record counts the conversations
        read (`MIGRATING`), beside the settings it converts them by (`options.rules`). Killed
        at any point after, the record says which settings what it wrote was converted by,
        and a run by others is refused (`refuse_other_rules`)."""
        if not self.declared and self.counts.conversations:
            self._record("running")
            self.declared = True

    def _record_documents(self) -> None:
        """Before the run writes its first conversation document: the state records that a run
        wrote one since the move (`relocate.DOCUMENTS_WRITTEN`), so a rollback, which moves it
        away, is told from moved turns the old service saved again (`refuse_leftover`)."""
        if self.wrote_documents:
            return
        if self.lease is None:
            self.db[STATE].update_one({"_id": STATE_ID}, wrote_documents(), upsert=True)
        else:
            self.lease.write_state(wrote_documents())  # only while the lock names this run
        self.wrote_documents = True

    def resume_point(self) -> Ranges | None:
        """Where an unfinished earlier run stopped: its ranges and the last id done in each,
        and the conversations moves made since brought turns of (`late`), which may sort
        before a checkpoint. None when a move since brought in too many to list, or every
        turn at once (`relocate.LATE_OVERFLOW`), or the state lists more than it may
        (`relocate.late_fits`: written by an earlier version, it could not be written again at
        a checkpoint), or an id a range passed as it could not record it is gone (corrected
        since: `order.passed_still_there`): the run cuts new ranges, reaching every id."""
        if self.options.restart or self.options.conversation is not None:
            return None
        state = self.db[STATE].find_one({"_id": STATE_ID}) or {}
        owed = list(state.get(LATE) or [])
        if not ranges_unfinished(state) or state.get(LATE_OVERFLOW) or not late_fits(owed):
            return None
        done, kinds = dict(state.get("done") or {}), dict(state.get("kinds") or {})
        passed = {index: list(keys) for index, keys in (state.get("passed") or {}).items()}
        ranges = Ranges(
            list(state["ranges"]), done, kinds, passed=passed, cut_by=state.get(RANGES_CUT_BY)
        )
        if not passed_still_there(self.db, self.source, LEGACY_FILTER, ranges):
            return None
        self.late = {id_key(cid): cid for cid in owed}
        return ranges

    def plan(self, after: Ranges | None) -> Ranges:
        """The ranges this run goes through: the resumed run's, or a new cut of the id space
        (cut by this run: `Ranges.cut_by`)."""
        if after is not None:
            return after
        ranges = plan_ranges(self.db, self.source, LEGACY_FILTER, self.options.spread)
        ranges.cut_by = self.run_id
        return ranges

    def _checkpoint(self, ranges: Ranges, *, complete: bool) -> None:
        if self.options.dry_run or self.options.conversation is not None:
            return
        checkpoint = {
            "ranges": ranges.starts,
            "done": ranges.done,
            "kinds": ranges.kinds,
            "passed": ranges.passed,
            "complete": complete,
            RANGES_CUT_BY: ranges.cut_by,
        }
        # The conversations owed whatever the checkpoints (`late`): a new cut owes none.
        owed = {LATE: list(self.late.values())} if self.late else {}
        update: dict[str, Any] = {
            "$set": {**checkpoint, **owed, "run_id": self.run_id},
            "$unset": {LATE_OVERFLOW: ""} | ({} if self.late else {LATE: ""}),
        }
        if self.lease is None:
            self.db[STATE].update_one({"_id": STATE_ID}, update, upsert=True)
        else:
            self.lease.write_state(update)  # only while the lock names this run

    def fence(self) -> None:
        """Right before a write: the run still holds its lock and nothing was dropped
        (`prove_lease`); a dry run writes nothing."""
        if not self.options.dry_run:
            prove_lease(self.db, self.lease)

    # -- the loop ------------------------------------------------------------------------

    def total(self, ranges: Ranges) -> int:
        """How many conversations this run has to go through."""
        if self.options.conversation is not None:
            return 1
        total = sum(1 for _ in self._every_id(ranges))
        if self.options.limit is not None:
            total = min(total, self.options.limit)
        return total

    def ids(self, ranges: Ranges) -> Iterator[tuple[int, str, Any]]:
        """(range, kind, conversation id) of every conversation this run goes through, in
        order (`order.range_ids`)."""
        if self.options.conversation is not None:
            return iter([(-1, "", self.options.conversation)])
        ids = self._every_id(ranges)
        if self.options.limit is None:
            return ids
        limit = self.options.limit
        return (pair for n, pair in enumerate(ids) if n < limit)

    def _every_id(self, ranges: Ranges) -> Iterator[tuple[int, str, Any]]:
        """The conversations owed whatever the checkpoints (`late`, range -1), then those
        past them (`order.spread_ids`)."""
        yield from ((-1, "", cid) for cid in list(self.late.values()))
        yield from spread_ids(self.db, self.source, LEGACY_FILTER, ranges)

    def run(self, ranges: Ranges) -> Counts:
        """Migrate every conversation not done yet, batch by batch, checkpointing each."""
        self._record(
            "running", checkpoint_at_start=dict(ranges.done), **{RANGES_CUT_BY: ranges.cut_by}
        )
        try:
            first: set[bytes] = set()  # owed ones migrated, which their range passes over
            for pairs in batches(self.ids(ranges), self.options.batch_size):
                todo = [cid for n, _, cid in pairs if n < 0 or id_key(cid) not in first]
                if todo:
                    self.batch(todo)
                for index, kind, conversation_id in pairs:
                    if index >= 0:
                        ranges.mark(index, kind, conversation_id)
                    elif self.late.pop(id_key(conversation_id), None) is not None:
                        first.add(id_key(conversation_id))
                self._checkpoint(ranges, complete=False)
                self._record("running", checkpoint=dict(ranges.done))
                if self.on_batch is not None:
                    self.on_batch(len(pairs), self.counts.turns)
            exhausted = self.options.conversation is not None or (
                not self.late
                and next(spread_ids(self.db, self.source, LEGACY_FILTER, ranges), None) is None
            )
            if exhausted and self.options.conversation is None and self.after_all is not None:
                self.fence()  # the last step removes: only while the lock is held
                self.after_all()
        except BaseException as exc:
            self._record("failed", error=f"{type(exc).__name__}: {exc}", finished_at=utc_now())
            raise
        self._checkpoint(ranges, complete=exhausted)
        self._record("completed" if exhausted else "stopped", finished_at=utc_now())
        return self.counts

    def batch(self, ids: list[Any]) -> None:
        converted, failed, turns = convert_batch(
            self.db, ids, self.rules, source=self.source, undated_at=self.undated_at
        )
        before = self._count_read(converted, failed, turns)
        converted = [c for c in converted if c.conversion.conversation_id not in self.held_back]
        failed = [p for p in failed if p.conversation_id not in self.held_back]
        found = list(failed)
        for item in converted:
            found += item.conversion.problems
        # A dry run writes nothing: a conversation an earlier batch planned already is written
        # by that batch in the run, and counted there (the run's second batch finds it done).
        planning = [
            c
            for c in converted
            if not self.options.dry_run or c.conversion.conversation_id not in before
        ]
        planned = writes.plan(self.db, planning, self.rules)
        found += planned.live
        # A dry run predicts what the plan writes; a run counts what it wrote.
        applied = writes.Applied(
            written=len(planned.messages) + len(planned.rewritten),
            documents=len(planned.conversations),
            full_texts=len(planned.full_texts),
        )
        if not self.options.dry_run:
            self._declare()
            if planned.conversations:
                self._record_documents()
            applied = writes.apply(
                self.db, planned, self.options.bounds, fence=self.fence, source=self.source
            )
            # Problems keep content: never a deleted conversation's.
            found = [p for p in found if p.conversation_id not in applied.gone]
            found += applied.problems
            self.fence()
            batch_ids = [c.conversion.conversation_id for c in converted]
            problem_report.replace(
                self.db,
                batch_ids + [p.conversation_id for p in failed],
                found,
                at=self.undated_at,
                bounds=self.options.bounds,
                earlier=self.earlier_problems,
            )
        counted = [p for p in found if p.conversation_id not in before]
        self.counts.live_skipped += sum(1 for p in counted if p.kind == ALREADY_LIVE)
        self.counts.add(applied, counted)

    def _count_read(
        self, converted: list[Converted], failed: list[Problem], turns: dict[str, int]
    ) -> set[str]:
        """Counts the batch's conversations, turns and messages, each conversation once a
        run: one whose two spellings fall in two batches is converted by both. Returns the
        ids counted by an earlier batch."""
        read = {c.conversion.conversation_id for c in converted}
        read |= {p.conversation_id for p in failed} | set(turns)
        before = read & self.counted_twice
        fresh = read - before
        twice = {c.conversion.conversation_id for c in converted if c.spellings > 1}
        self.counted_twice |= {cid for cid in fresh if cid in twice or is_derived_id(cid)}
        self.counts.conversations += len(fresh)
        self.counts.turns += sum(turns.get(cid, 0) for cid in fresh)
        self.counts.messages += sum(
            len(c.conversion.messages) for c in converted if c.conversion.conversation_id in fresh
        )
        return before
