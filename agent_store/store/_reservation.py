"""The reservation of a turn on its conversation document, and the reading of its record.

Pure, no I/O: the update pipeline the logger sends, the filter that makes it
refuse a turn already recorded, and where a recorded turn's `seq` block is.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

from bson import Int64

from agent_store.core import (
    HOLDING_PROMPTS_KEPT,
    MAX_CALL_ID_CHARS,
    MAX_HELD_CALLS,
    MAX_SAFE_INTEGER,
    RESOLVED_PROMPTS_KEPT,
    ApprovedCall,
    Conflict,
    InvalidInput,
    NotFound,
    PendingCall,
    PendingHitl,
    StorageUnavailable,
    StoreError,
    TurnRecord,
    approval_held_again,
    conversation_version,
    shown,
    to_utc,
)
from agent_store.store._turns import (
    PENDING_CALLS_KEPT,
    POPPED_SEQS_KEPT,
    KeepPendingHitl,
    TurnPlan,
    TurnRules,
    block_ids,
    inbox_field,
    turn_key,
    validate_identifier,
)
from agent_store.store._values import storable

SUMMARY: dict[str, Any] = {"turns": 0}
"""The conversation without its turn records: what a reservation returns when observers
are told of the turn, and what reads serve."""
RESERVED: dict[str, Any] = {
    "_id": 1,
    "message_count": 1,
    "user_id": 1,
    "created_at": 1,
    "owned_from": 1,
    "epoch": 1,
    "refold_owed": 1,
    "pops": 1,
    "pending_blocks": 1,
}
"""What a reservation returns otherwise: all the logger needs (the block's end, the owner,
the epoch (else the creation time) that tells this conversation from one created again
under its id (`same_conversation`), the `seq` from which a turn assigned it an owner, the
epoch its messages carry, whether a fold of its pending state is owed, `REFOLD_OWED`, how
many pops it had finished: those since are the only ones that can have removed what the
turn stores, and the blocks listing pending state that it found passed, `PENDING_BLOCKS`)."""
PENDING_BLOCKS = "pending_blocks"
"""The field listing the blocks of the turns whose reservation listed pending state (calls
it leaves open, a prompt it raises) until a later turn's reservation finds them passed
(`_pending_blocks`): `{f: first seq, l: seqs, a: reserved at, d: passed}`."""
PENDING_BLOCKS_KEPT = 32
"""How many blocks still young `PENDING_BLOCKS` keeps (the newest): an older one, dropped
before it was passed, is never looked at (its turn's pending state stays as reserved)."""
BLOCKS_WATCHED_FOR = timedelta(days=1)
"""How long a block a fold found passed and empty (`w`: when) stays watched for its late
insert (`watched_blocks`): a writer stalled inside its insert that long is taken for dead."""
_NEVER = datetime(1970, 1, 1, tzinfo=UTC)
"""Older than every time a block is found passed and empty: `w` of a block never watched."""
_UNLISTED = {"$eq": [{"$ifNull": [f"${PENDING_BLOCKS}", None]}, None]}
"""Whether the conversation lists no `PENDING_BLOCKS` (absent), as an expression."""
REFOLD_OWED = "refold_owed"
"""The field a fold of the pending state that could not be written marks a conversation
with (the time it gave up: `_relocated.settle`, after a move or a give-back, the
conversation changing under it or a turn below the end still being written): the next turn
reserving sees it in what its reservation returns and folds again after its insert, and a
reservation refused by its condition folds before it judges again. Cleared by the fold's
own guarded update, only while it is the mark that fold read."""


RELISTED = "calls_relisted"
"""The field marking the pending calls a fold of the pending state listed again though the
conversation, as that fold read it, did not list them (`_relocated.refolded`): `{c: tool
call id, m: the message making it}`, each one a block passed as abandoned had answered (its
turn's reservation took the call off), whose insert may still have landed since (a writer
stalled past `abandon_after`, then cut: nothing of it takes the call off again). An answer
to a marked call (a turn naming it, `answers_to`; a person's answer to the prompt holding
it) looks first whether one landed (`_relocated.looked_again`: a `find`, on that path
only). Absent until a fold lists a call again; a mark goes with its look, or with a fold
no longer listing its call."""
NONE_RELISTED: dict[str, Any] = {f"{RELISTED}.0": {"$exists": False}}
"""The filter part of a person's answer to a prompt matching only while no call is marked
listed again (`RELISTED`); one that matches nothing then looks at the prompt's calls."""


def unmarked(calls: Mapping[str, str]) -> dict[str, Any]:
    """A filter matching a conversation where none of the calls `calls` names (tool call id
    to the message making it) is marked listed again (`RELISTED`)."""
    marked = [{RELISTED: {"$elemMatch": {"c": c, "m": m}}} for c, m in sorted(calls.items())]
    # Under `$and`, as `answers_stand`: the conversation's own `$nor` is kept.
    return {"$and": [{"$nor": marked}]}


def relisted_among(
    conversation: Mapping[str, Any], calls: Iterable[tuple[str, str]]
) -> list[tuple[str, str]]:
    """Those of `calls` (tool call id, the message making it) that `conversation` marks
    listed again (`RELISTED`)."""
    marks = {
        (mark.get("c"), mark.get("m"))
        for mark in conversation.get(RELISTED) or ()
        if isinstance(mark, Mapping)
    }
    return sorted({call for call in calls if call in marks})


def relisted_held(conversation: Mapping[str, Any], request_id: str) -> list[tuple[str, str]]:
    """The calls the prompts of `request_id` hold in `conversation` (`pending_calls`) that
    it marks listed again (`RELISTED`)."""
    held = [
        (str(call.get("tool_call_id")), str(call.get("message_id")))
        for call in conversation.get("pending_calls") or ()
        if isinstance(call, Mapping) and call.get("request_id") == request_id
    ]
    return relisted_among(conversation, held)


def marks_without(calls: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """`RELISTED` without the marks of `calls` (tool call id, the message making it), as an
    expression; absent while it is absent (empty once no mark is left)."""
    each = [{"$and": [{"$eq": ["$$mark.c", c]}, {"$eq": ["$$mark.m", m]}]} for c, m in calls]
    # `$eq` to a boolean rather than `$not`, which some servers lack.
    cond = {"$eq": [{"$or": each}, False]}
    left = {"$filter": {"input": _kept(RELISTED, []), "as": "mark", "cond": cond}}
    return absent_stays(RELISTED, left)


DELETING = "deleting_since"
"""The field a delete or an erasure marks a conversation with (the time it began) before its
first destructive command: from then no turn, retry or pop writes to it."""
NOT_BEING_DELETED: dict[str, Any] = {DELETING: {"$exists": False}}
"""The filter part of every write a conversation takes but a delete's own: a turn's
reservation, move or give-back, a pop, a rename, an upsert, an answer to a prompt, a steering
inbox opened. A write it stops is refused (`being_deleted`) once the mark is read."""


CONVERSATION_DOCUMENT: dict[str, Any] = {
    "$nor": [{"message_count": {"$exists": False}, "turn_count": {"$exists": False}}]
}
"""The filter part of every lookup, update and delete of one conversation by its id
(`conversation_by_id`), of a read or write of a user's conversation documents by their owner
(an erasure, a claim), and of every read of many conversations (`_listed`: a list, an export,
a search): a document of `agent_conversations` with neither counter the store writes
on every one is a legacy turn an old-service writer logged there after the migration's move
(or before it), the legacy source's to reach, never a conversation (MIGRATION.md step 1
tells them apart so)."""
LEGACY_TURN_DOCUMENT: dict[str, Any] = {
    field: {"$exists": False} for field in ("message_count", "turn_count")
}
"""The complement of `CONVERSATION_DOCUMENT`: a legacy turn an old-service writer logged into
`agent_conversations`, which `conversation_by_id` never matches. Looked for only where a
conversation's creation collided with a document under its id (`DuplicateKeyError`)."""


def conversation_by_id(conversation_id: Any) -> dict[str, Any]:
    """The filter of the conversation document under `conversation_id`: every lookup, update
    and delete of one conversation by its id starts from it. A legacy turn logged into
    `agent_conversations` whose `_id` is that id (text the turn happens to carry, or the id
    of a conversation it holds back: MIGRATION.md, `relocate.held_by_left`) is never taken
    for the conversation (`CONVERSATION_DOCUMENT`): its reads fall back to the legacy
    turns, or find none, and its writes never change the turn. A filter adding a `$nor` of
    its own keeps this one's (`with_none_of`)."""
    return {"_id": conversation_id, **CONVERSATION_DOCUMENT}


def with_none_of(query: Mapping[str, Any], *filters: Mapping[str, Any]) -> dict[str, Any]:
    """`query` matching none of `filters` too, its own `$nor` (`conversation_by_id`'s) kept."""
    return {**query, "$nor": [*query.get("$nor", ()), *filters]}


FORK_CHECK = "fork_check"
"""The field a fork creates its conversation with (`ForkCheck`), removed once its copies are
stored and its check of its source passed: until then the conversation is a fork not made
yet."""
MIGRATING = "migrating"
"""The field `python -m migrations run` writes a conversation document with before its
messages, removed once they are all in (a long conversation's take several commands): until
then the conversation is not migrated yet, read from its legacy turns, and every write to it
is refused as to one not migrated yet (`being_migrated`)."""
LISTED: dict[str, Any] = {**NOT_BEING_DELETED, FORK_CHECK: {"$exists": False}}
"""The filter part of a read of many conversations (a list, an export, a search): every
conversation a read serves, one the migration is still writing (`MIGRATING`) among them (read
from its legacy turns, listed by its document's summary), never one a delete or an erasure
marked (`DELETING`) nor a fork not made yet (`FORK_CHECK`)."""
STANDING: dict[str, Any] = {**LISTED, MIGRATING: {"$exists": False}}
"""The filter part of every read of one conversation: a conversation a delete or an erasure
marked (`DELETING`), a fork not made yet (`FORK_CHECK`), or one the migration is still
writing (`MIGRATING`: read from its legacy turns instead), is no conversation here, answered
as a missing one (NotFound; lists, exports and searches leave out the first two, `LISTED`).
Fields absent from every other document: the indexes a read uses still choose what it reads,
this leaves out the few it finds marked."""


NO_POP_UNDER_WAY: dict[str, Any] = {"popping": {"$not": {"$type": "object"}}}
"""The filter part of a turn's reservation: no pop is under way (its mark, `popping`, is
missing, or null once a pop cleared it). Not an equality, which an upsert would copy into the
conversation it creates."""


def is_standing(conversation: Mapping[str, Any]) -> bool:
    """Whether a conversation document read (with `UNSTANDING_READ`) is one `STANDING`
    matches: neither marked by a delete, nor a fork not made yet, nor being migrated."""
    return is_listed(conversation) and conversation.get(MIGRATING) is None


def is_listed(conversation: Mapping[str, Any]) -> bool:
    """Whether a conversation document read (with `UNSTANDING_READ`) is one `LISTED`
    matches: neither marked by a delete nor a fork not made yet (one being migrated may be)."""
    return all(conversation.get(mark) is None for mark in (DELETING, FORK_CHECK))


def refuse_unless_fallback_serves(
    conversation_id: str, conversation: Mapping[str, Any] | None
) -> None:
    """NotFound unless the read fallback may serve the id from its legacy turns: the
    conversation document under it the caller sees (read with `UNSTANDING_READ`:
    `seen_by_caller`, which sees one that is no conversation whoever's it is) is none, or one
    the migration is still writing (`MIGRATING`). One a delete or an erasure
    marked (`DELETING`: it removes the legacy turns after marking, and one that failed between
    leaves them), or a fork not made yet (`FORK_CHECK`), is no conversation, and its legacy
    turns none to serve: a missing one, until the delete run again finishes it. The rule of
    every read that falls back (`ConversationStore._legacy`, a message read's, an inbox's)."""
    if conversation is not None and not is_listed(conversation):
        raise NotFound(f"conversation {conversation_id!r} was not found")


def seen_by_caller(conversation: Mapping[str, Any] | None, owned: bool) -> Mapping[str, Any] | None:
    """Of the conversation document read under an id whoever's it is (by `_id` alone, with
    its `user_id` and `UNSTANDING_READ`), what a caller sees: it when it is in the caller's
    scope (`owned`), or when it is no conversation (`is_listed`: a delete marked it, a fork
    not made yet), which no read serves to anyone, from its legacy turns neither
    (`refuse_unless_fallback_serves`: NotFound, as for another user's, so nothing is told of
    it); else none, as when no document is there."""
    if conversation is None or owned or not is_listed(conversation):
        return conversation
    return None


def unfinished_fork(conversation_id: str, what: str) -> StorageUnavailable:
    """The refusal of `what` (a turn) in a fork not made yet (`FORK_CHECK`): an attempt of the
    fork is making it, or failed before it was made, and the same fork retried makes it."""
    return StorageUnavailable(
        f"conversation {conversation_id!r} is a fork not made yet: {what} may be sent again "
        "once the fork is made (a fork that failed is made when it is retried)"
    )


def being_migrated(conversation_id: str, what: str) -> Conflict:
    """The refusal of `what` (a turn, a pop, a rename) in a conversation the migration is
    still writing (`MIGRATING`): as to one not migrated yet, sent again once it is."""
    return Conflict(
        f"conversation {conversation_id!r} exists as legacy turns not migrated yet; {what} "
        "may be sent again once `python -m migrations run` has migrated it"
    )


UNSTANDING_READ: dict[str, Any] = {DELETING: 1, FORK_CHECK: 1, MIGRATING: 1}
"""The projection a write's explanation of its refusal reads (`refuse_unless_standing`)."""


def refuse_unless_standing(
    conversation_id: str, conversation: Mapping[str, Any] | None, what: str
) -> None:
    """Refuse `what`, a write other than a turn's own, into a conversation that is no
    conversation (`STANDING` did not match it): `being_deleted`, `unfinished_fork` (only
    the fork's own attempts write to a fork not made yet), or `being_migrated`. Nothing for
    one that is standing, or none at all (`conversation` None)."""
    if conversation is None:
        return
    if conversation.get(DELETING) is not None:
        raise being_deleted(conversation_id, what)
    if conversation.get(FORK_CHECK) is not None:
        raise unfinished_fork(conversation_id, what)
    if conversation.get(MIGRATING) is not None:
        raise being_migrated(conversation_id, what)


class BeingDeleted(StorageUnavailable):
    """A write into a conversation whose delete or erasure has begun (`being_deleted`)."""

    def __init__(self, message: str, *, conversation_id: str) -> None:
        super().__init__(message)
        self.conversation_id = conversation_id


def being_deleted(conversation_id: str, what: str) -> BeingDeleted:
    """The refusal of `what` (a turn, a pop) in a conversation whose delete or erasure has
    begun (`DELETING`): once it finished, the caller may send it again (it starts a new
    conversation); one that failed part-way finishes when it is run again."""
    return BeingDeleted(
        f"conversation {conversation_id!r} is being deleted: {what} may be sent again once "
        "the delete finished (a delete or erasure that failed part-way finishes when it is "
        "run again)",
        conversation_id=conversation_id,
    )


def new_epoch() -> str:
    """A conversation's `epoch`: 64 random bits, drawn as its document is created."""
    return secrets.token_hex(8)


def new_life() -> dict[str, Any]:
    """What a conversation's document is created with to tell it from every other one under
    its id: a `new_epoch`, and `epoch_marks` (documents beside it name that epoch)."""
    return {"epoch": new_epoch(), "epoch_marks": True}


def same_conversation(
    conversation_id: str, *, epoch: str | None, created_at: datetime | None
) -> dict[str, Any]:
    """A filter for the conversation under `conversation_id` that was read with this `epoch`
    and `created_at`, never one started under the id since, by anyone: told by its epoch,
    drawn at random as its document is created (a caller supplies its first message's
    `created_at`, so two conversations may share one). A conversation read before it had an
    epoch (created before epochs: the first turn since draws it one) is told by its
    `created_at`."""
    return conversation_by_id(conversation_id) | life_told(epoch=epoch, created_at=created_at)


def life_told(*, epoch: str | None, created_at: datetime | None) -> dict[str, Any]:
    """What `same_conversation` tells a conversation's life by, apart from its id: its
    `epoch`, else its `created_at` (as a deletion's record names it too)."""
    if epoch is not None:
        return {"epoch": epoch}
    return {"created_at": created_at}


def same_as_read(conversation_id: str, read: Mapping[str, Any]) -> dict[str, Any]:
    """`same_conversation` for the conversation `read` (a document, or a record of one, with
    its `epoch` and `created_at`) holds."""
    return same_conversation(
        conversation_id, epoch=read.get("epoch"), created_at=read.get("created_at")
    )


def still_as_read(conversation_id: str, read: Mapping[str, Any]) -> dict[str, Any]:
    """`same_as_read` for a write that reads again when it misses (a fold, a pop's mark):
    a life read without an epoch is told by having none yet too. A conversation started
    under the id since draws one, so it never matches, even given the same `created_at`
    (a caller's choice); the first turn drawing this life's own epoch makes it miss too,
    and the caller reads again. Never for a write whose miss means "gone" (a delete, an
    erasure, a fork's check of its source: they take the life by `created_at` alone)."""
    return conversation_by_id(conversation_id) | life_still_as_read(read)


def life_still_as_read(read: Mapping[str, Any]) -> dict[str, Any]:
    """What `still_as_read` tells the life `read` holds by, apart from its id."""
    epoch = read.get("epoch")
    none_yet = {} if epoch is not None else {"epoch": None}
    return life_told(epoch=epoch, created_at=read.get("created_at")) | none_yet


def life_named(
    conversation_id: str, found: Mapping[str, Any], version: str
) -> dict[str, Any] | None:
    """`same_as_read` for the conversation `found` (as read now: its `epoch`, `created_at`)
    when it is the one `version` (`Conversation.version`) names; None when it is another. A
    version read before the conversation drew its epoch (one stored before epochs) names it
    by its `created_at`, as `same_conversation` tells it then."""
    created = found["created_at"]
    if conversation_version(conversation_id, found.get("epoch"), created) == version:
        return same_as_read(conversation_id, found)
    if conversation_version(conversation_id, None, created) == version:
        return same_conversation(conversation_id, epoch=None, created_at=created)
    return None


@dataclass(frozen=True)
class Actor:
    """Who logs a turn, and so which conversations it may write to."""

    user_id: str | None
    """The owner named by the call: a user token's subject, or the user a service names."""
    as_user: bool = False
    """A user token: a person. Its turns are a person's (`running_refusal`, the
    `runtime_turns` filter, `TurnRecord.by_person`), and its ownership is checked strictly
    (`strict`)."""
    strict_owner: bool = False
    """A runtime acting for the user `user_id` (an integration given a `user_id`): its
    ownership is checked as a user token's is (`strict`), its turns stay a runtime's."""

    @classmethod
    def of_call(
        cls, conversation_id: str, user_id: str | None, *, owner_only: bool, strict_owner: bool
    ) -> Actor:
        """Who a call's arguments name. Strict ownership (`owner_only`, `strict_owner`) with no
        `user_id` owns nothing: NotFound, as for another user's conversation (never the
        unowned ones, which `owner_filter` would match by a missing `user_id`)."""
        actor = cls(user_id, as_user=owner_only, strict_owner=strict_owner)
        if actor.strict and user_id is None:
            raise NotFound(f"conversation {conversation_id!r} was not found")
        return actor

    @property
    def strict(self) -> bool:
        """Whether only `user_id`'s own conversations (or a new id) are written: never an
        unowned one adopted, any other NotFound, as to a user token. A user token, or a
        runtime acting for a user (`strict_owner`)."""
        return self.as_user or self.strict_owner

    @property
    def caller(self) -> str | None:
        """The user whose ownership is checked strictly (`strict`); None for a service,
        whichever user it names."""
        return self.user_id if self.strict else None

    def owner_filter(self) -> dict[str, Any]:
        """The part of a reservation's filter that keeps the conversation's owner."""
        if self.strict:
            return {"user_id": self.user_id}
        if self.user_id is not None:
            return {"user_id": {"$in": [None, self.user_id]}}
        return {}

    def owns(self, conversation: Mapping[str, Any]) -> bool:
        """Whether `conversation` (read with its `user_id`) is one `owner_filter` keeps."""
        if self.strict:
            return conversation.get("user_id") == self.user_id
        return self.user_id is None or conversation.get("user_id") in (None, self.user_id)

    def running_refusal(self, plan: TurnPlan, conversation: Mapping[str, Any]) -> StoreError | None:
        """Why a user token may not start `plan` in `conversation`: a runtime opened a
        steering inbox for its turn id (`runtime_turns`, or the inbox itself, open since
        before inboxes were remembered), so the turn is the runtime's to log, the inbox open
        or closed since (`reservation_filter` keeps it out); None if it may."""
        if not self.as_user:
            return None
        field = inbox_field(plan.turn_id).split(".")[1]
        remembered = conversation.get("runtime_turns") or ()
        if plan.key not in remembered and field not in (conversation.get("inbox") or {}):
            return None
        return Conflict(
            f"turn {plan.turn_id!r} is a runtime's in conversation {plan.conversation_id!r}: "
            "it opened a steering inbox for the turn it runs under that id, and only the "
            "runtime (a service token) logs a turn under it. Nothing was written: deliver "
            "the message into the running turn's inbox, or log a turn of another id"
        )

    def refusal(self, conversation_id: str, owner: str | None) -> StoreError | None:
        """Why this actor may not write to a conversation `owner` holds; None if it may."""
        if self.strict and owner != self.user_id:
            return NotFound(f"conversation {conversation_id!r} was not found")
        if not self.strict and self.user_id is not None and owner not in (None, self.user_id):
            return Conflict(
                f"conversation {conversation_id!r} belongs to another user than "
                f"{self.user_id!r}: log the turn as the conversation's owner (the user id "
                f"{self.user_id!r} was claimed by, if it was), or claim it first"
            )
        return None


@dataclass(frozen=True)
class RecordedBlock:
    """Where a recorded turn's messages go, and what it was logged with."""

    first_seq: int
    count: int
    digest: int
    reserved_at: datetime | None = None
    """When the turn reserved the block (its record's time); None when no record is left."""
    popped: bool = False
    """A pop removed one of its messages: no retry of the turn is a replay."""
    by_person: bool = False
    """A user token logged the turn (`TurnRecord.by_person`): its record says so wherever it
    moves."""
    counted: tuple[int, int, int] | None = None
    """What its reservation counted (`TurnRecord.counted`); None when its record does not say."""
    given_up: bool = False
    """A retry gave the turn up for good (`TurnRecord.given_up`): what its reservation
    counted was taken back and its `seq`s are gaps already."""


def recorded_block(
    document: Mapping[str, Any], key: int, *, sent: TurnPlan | None = None
) -> RecordedBlock | None:
    """The block of the turn recorded under `key`, from a conversation's records; else None.

    Its extent is the record's own (`TurnRecord.seqs`), whatever records the window dropped.
    A record kept before records said so runs to the next record (`_block_end`); `sent`, the
    turn as this attempt sends it, holds as many `seq`s as it sends when the record's digest
    is its content, where a record between them was dropped. Only that record and the next
    are validated, not the thousand.
    """
    records = document.get("turns") or ()
    for index, raw in enumerate(records):
        if isinstance(raw, Mapping) and raw.get("k") == key:
            record = TurnRecord.model_validate(raw)
            count = _block_end(document, records, index, record, sent) - record.first_seq
            return RecordedBlock(
                record.first_seq,
                count,
                record.digest,
                record.at,
                popped=record.popped,
                by_person=record.by_person,
                counted=_unpacked(record.counted),
                given_up=record.given_up,
            )
    return None


def _block_end(
    document: Mapping[str, Any],
    records: Sequence[Any],
    index: int,
    record: TurnRecord,
    sent: TurnPlan | None,
) -> int:
    """Where the block of `record` (at `index` of `records`) ends: at its own extent
    (`TurnRecord.seqs`), never past the next record's first `seq` (nor, for the newest
    record, `message_count`), which a pop that gave `seq`s back may have lowered. A record kept
    before records said so runs to that next one, unless a record between them was dropped
    (the next kept is not the next appended, by `TurnRecord.order`): then the turn as `sent`
    ends it when it is the record's content (as many messages as it sends)."""
    if index + 1 == len(records):
        following, bound = None, int(document["message_count"])
    else:
        following = TurnRecord.model_validate(records[index + 1])
        bound = following.first_seq
    if record.seqs is not None:
        return min(record.first_seq + record.seqs, bound)
    dropped_between = (
        following is not None
        and record.order is not None
        and following.order is not None
        and following.order != record.order + 1
    )
    if dropped_between and sent is not None and sent.matches(record.digest):
        return min(record.first_seq + sent.count, bound)
    return bound


_STARTS_BITS, _TOKEN_BITS = 8, 22
"""How `TurnRecord.counted` packs into one integer: turn starts, then each token count."""


def _packed(counted: tuple[int, int, int] | None) -> Int64 | list[Int64] | None:
    """`TurnRecord.counted` as stored: one integer (11 bytes a record, not 38) when each part
    fits, else the three."""
    if counted is None:
        return None
    starts, tokens_in, tokens_out = counted
    if starts < 1 << _STARTS_BITS and max(tokens_in, tokens_out) < 1 << _TOKEN_BITS:
        return Int64(
            starts | tokens_in << _STARTS_BITS | tokens_out << (_STARTS_BITS + _TOKEN_BITS)
        )
    return [Int64(n) for n in counted]


def _unpacked(counted: int | tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    """`TurnRecord.counted` as `_packed` stored it, as its three counts."""
    if not isinstance(counted, int):
        return counted
    tokens = (1 << _TOKEN_BITS) - 1
    return (
        counted & ((1 << _STARTS_BITS) - 1),
        counted >> _STARTS_BITS & tokens,
        counted >> (_STARTS_BITS + _TOKEN_BITS) & tokens,
    )


def blocks_of(document: Mapping[str, Any], key: int) -> set[int]:
    """The first `seq`s of the blocks the turn recorded under `key` reserved, from a
    conversation's records: its block, and those it left by moving (`moved_key`)."""
    keys = {key, moved_key(key)}
    return {
        int(raw["f"])
        for raw in document.get("turns") or ()
        if isinstance(raw, Mapping) and raw.get("k") in keys and "f" in raw
    }


def blocks_held(document: Mapping[str, Any], key: int) -> set[int]:
    """`blocks_of`, less the blocks given up (or given back) that a pop passed since
    (`TurnRecord.given_up` and `popped`: a pop marks the records of the blocks past the
    `seq`s it gives back): those `seq`s went back to the conversation, and a later turn's
    reservation may hold them. Nothing the turn stores there counts (`give_up_undone`)."""
    keys = {key, moved_key(key)}
    return {
        int(raw["f"])
        for raw in document.get("turns") or ()
        if isinstance(raw, Mapping)
        and raw.get("k") in keys
        and "f" in raw
        and not (raw.get("g") is True and raw.get("p") is True)
    }


def given_up_for_good(document: Mapping[str, Any], turn_id: object) -> bool:
    """Whether the conversation's records (`document`) hold the turn `turn_id` only in blocks
    given up for good that pops passed since (recorded, none `blocks_held`): every retry of
    it is refused `Corrected`, so a message it stored in this life (its insert landed at or
    past the end the pops left, its writer dead before it looked) is never the
    conversation's own, to answer or to copy (`of_turns_kept`), and the insert meeting one
    takes them all away (`AgentMessageLogger._with_turns_given_up`)."""
    if not isinstance(turn_id, str):
        return False
    key = turn_key(turn_id)
    return _given_up_itself(document, key) and not blocks_held(document, key)


def _given_up_itself(document: Mapping[str, Any], key: int) -> bool:
    """Whether the records hold the turn's own record (under its key, where a give-up marks
    it) given up and popped past: a block it left by moving (`moved_key`) given up alone
    tells nothing, as the record window (`turns_recorded`) may have dropped the turn's own
    record, its messages standing where the move was undone."""
    return any(
        isinstance(raw, Mapping)
        and raw.get("k") == key
        and raw.get("g") is True
        and raw.get("p") is True
        for raw in document.get("turns") or ()
    )


def stored_by_turns_given_up(document: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], bool]:
    """Whether a message read under the conversation `document` (its records read: `turns`)
    was stored by a turn given up for good (`given_up_for_good`), each turn id looked up
    once; never, at no cost, while no record is both given up and popped."""
    if not any(
        isinstance(raw, Mapping) and raw.get("g") is True and raw.get("p") is True
        for raw in document.get("turns") or ()
    ):
        return lambda message: False
    judged: dict[object, bool] = {}

    def stored_by_one(message: Mapping[str, Any]) -> bool:
        turn_id = message.get("turn_id")
        if turn_id not in judged:
            judged[turn_id] = given_up_for_good(document, turn_id)
        return judged[turn_id]

    return stored_by_one


def of_turns_kept(docs: Sequence[Mapping[str, Any]], document: Mapping[str, Any]) -> list[Any]:
    """Of the messages `docs` read under the conversation `document` (its `epoch` and records
    read), those it holds as its own: of its life (`of_epoch`), none of a turn given up for
    good (`stored_by_turns_given_up`)."""
    given_up = stored_by_turns_given_up(document)
    return [d for d in of_epoch(docs, document.get("epoch")) if not given_up(d)]


def reservation_filter(
    plan: TurnPlan, actor: Actor, *, records_complete: bool = True
) -> dict[str, Any]:
    """Match the conversation unless it records this turn already (under its id, or, for a
    derived id, under the one derived before key order stopped counting:
    `TurnPlan.derived_before`), or is another's, or, to a user token, a runtime opened a
    steering inbox for the turn (`Actor.running_refusal`), or it is no conversation
    (`STANDING`: a delete begun or a fork not made yet, whose own first reservation creates
    it and whose retry finds its turn recorded), or a pop is under way (`popping`: a summary
    the pop has not corrected yet, which the logger finishes, `_pop.finish_marked`, before it
    reserves again).

    With `records_complete`, also unless some of its oldest records were dropped:
    only then does the absence of a record prove the turn is new.
    """
    keys = {"$ne": plan.key} if plan.key_before is None else {"$nin": [plan.key, plan.key_before]}
    query: dict[str, Any] = {
        **conversation_by_id(plan.conversation_id),
        "turns.k": keys,
        **actor.owner_filter(),
        **STANDING,
        **NO_POP_UNDER_WAY,
    }
    if actor.as_user:  # a runtime's turn id is the runtime's (`Actor.running_refusal`)
        query["runtime_turns"] = {"$ne": plan.key}
        query[inbox_field(plan.turn_id)] = {"$exists": False}
    if records_complete:
        query["turns_dropped"] = {"$in": [None, 0]}
    return query


def literal(value: Any) -> dict[str, Any]:
    """A constant inside an update pipeline: strings starting with `$` stay strings."""
    return {"$literal": value}


def int64(expression: Any) -> dict[str, Any]:
    """An integer the pipeline computes, stored as a BSON int64 as the models write every
    integer (one width per field); some servers narrow a sum that fits to an int32."""
    return {"$toLong": expression}


def _sum(field: str, amount: int) -> dict[str, Any]:
    return {"$add": [{"$ifNull": [f"${field}", 0]}, amount]}


def _plus(field: str, amount: int) -> dict[str, Any]:
    return int64(_sum(field, amount))


def _kept(field: str, default: Any) -> dict[str, Any]:
    return {"$ifNull": [f"${field}", literal(default)]}


def absent_stays(field: str, value: Any) -> dict[str, Any]:
    """`value` as the new `field`, as an expression, but absent while the field is absent.
    `$$REMOVE` as a branch of its own: some servers (mongoeco) store null for it elsewhere."""
    unset = {"$eq": [{"$ifNull": [f"${field}", None]}, None]}
    return {"$cond": [unset, "$$REMOVE", value]}


def resolved_by_request(request_id: str) -> dict[str, Any]:
    """Whether a person resolved the prompt `request_id` by request id (`resolved_hitl`), as
    an expression of the conversation being updated."""
    return {"$in": [literal(request_id), _kept("resolved_hitl", [])]}


CallKey = tuple[str, str | None]
"""A call an answer concerns, as its client read it: its `tool_call_id`, and the message that
made it (`message_id`; None when only the id was named, `call_ids=`)."""

_CALLS_SHAPE = "a tool_call_id and a message_id (non-empty strings)"


def concerned_calls(
    call_ids: Sequence[str] | None, calls: Sequence[Any] | None
) -> list[CallKey] | None:
    """The calls an answer concerns (`ConversationStore.resolve_hitl`), from `call_ids` (ids
    only) or `calls` (`PendingCall`s or mappings holding a `tool_call_id` and a `message_id`,
    as `pending_calls` serves them); None when it names none. InvalidInput for anything
    else, naming what is wrong."""
    if call_ids is not None and calls is not None:
        raise InvalidInput(
            "pass calls or call_ids, not both: calls names each call by its tool_call_id and "
            "message_id, call_ids by its id only"
        )
    if call_ids is not None:
        if isinstance(call_ids, str | bytes) or not all(isinstance(c, str) for c in call_ids):
            raise InvalidInput("call_ids must be a list of tool call ids (strings)")
        return _within_limits([(c, None) for c in storable(list(call_ids), "call_ids")], "call_ids")
    if calls is None:
        return None
    if isinstance(calls, str | bytes | Mapping) or not isinstance(calls, Sequence):
        raise InvalidInput(
            "calls must be a list of the calls the answer concerns: PendingCall objects or "
            f"mappings holding {_CALLS_SHAPE}"
        )
    if len(calls) > MAX_HELD_CALLS:
        raise InvalidInput(_too_many("calls", len(calls)))
    keys = [_call_identity(index, call) for index, call in enumerate(calls)]
    return _within_limits([(c, m) for c, m in storable(keys, "calls")], "calls")


def _too_many(what: str, count: int) -> str:
    return f"{what} names {count} calls: an answer names at most {MAX_HELD_CALLS} (MAX_HELD_CALLS)"


def _within_limits(keys: list[CallKey], what: str) -> list[CallKey]:
    """The calls an answer names, within the limits the HTTP body has too (`CallId`,
    `MAX_HELD_CALLS`): InvalidInput naming the first call past them."""
    if len(keys) > MAX_HELD_CALLS:
        raise InvalidInput(_too_many(what, len(keys)))
    for index, (call_id, message_id) in enumerate(keys):
        where = f"{what}[{index}]" + (".tool_call_id" if message_id is not None else "")
        if not 0 < len(call_id) <= MAX_CALL_ID_CHARS:
            raise InvalidInput(
                f"{where} is {len(call_id)} characters long: a tool call id has 1 to "
                f"{MAX_CALL_ID_CHARS} (MAX_CALL_ID_CHARS)"
            )
        if message_id is not None:
            validate_identifier(message_id, f"{what}[{index}].message_id")
    return keys


def _call_identity(index: int, call: Any) -> CallKey:
    """One of `calls` (`concerned_calls`) as its key."""
    if isinstance(call, PendingCall):
        return (call.tool_call_id, call.message_id)
    if isinstance(call, Mapping):
        others = sorted(str(k) for k in call if k not in ("tool_call_id", "message_id"))
        call_id, message_id = call.get("tool_call_id"), call.get("message_id")
        if isinstance(call_id, str) and isinstance(message_id, str) and call_id and message_id:
            if not others:
                return (call_id, message_id)
            raise InvalidInput(
                f"calls[{index}] must hold {_CALLS_SHAPE} and nothing else; it holds "
                + ", ".join(shown(k) for k in others)
            )
    raise InvalidInput(f"calls[{index}] must hold {_CALLS_SHAPE}, as pending_calls serves them")


def resolution(
    request_id: str,
    concerns: Sequence[CallKey] | None = None,
    *,
    asked: str | None = None,
    stored_below: int | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The filter and update that record a person's answer to the prompt `request_id`
    (`ConversationStore.resolve_hitl`): they match while the prompt is pending or holds back a
    pending call and was not resolved already (the first answer is the answer), clear the
    prompt if it is the pending one, remember the request id (`resolved_hitl`, the newest
    `RESOLVED_PROMPTS_KEPT`), and release the calls it holds (`approved_calls`).

    With `concerns` (the calls the answer concerns, as its client read them) they match only
    while a prompt of that id holds one of them (that very call, when its message is named)
    not released yet; with `asked` too, only while the pending prompt is the one its message
    `asked` raised and no prompt of the id holds a call no answer to the id released (one
    released waits on its result, held by none). Only `resolve_hitl` knows when an answer
    may take a prompt holding none of the calls it names: when that prompt was not asked
    again since they were made (an answer read before a later prompt asked under the id
    does not answer that one). They then release those of the calls only (`_named`): a
    call a prompt of the id holds that the answer does not name stays held (one an earlier
    answer released that a later prompt asked about again too), and the request id is
    remembered once none is left unreleased (`_held_unreleased`), and `stored_below` is
    recorded with the answer (`AnsweredPrompt.stored_below`)."""
    pending: dict[str, Any] = {"pending_hitl.request_id": request_id}
    held: dict[str, Any] = {"resolved_hitl": {"$ne": request_id}}
    named: dict[str, Any] | None = None
    query: dict[str, Any]
    if concerns is None:
        query = {"$or": [pending, {"pending_calls.request_id": request_id, **held}]}
    elif asked is None:
        named = _named(concerns)
        held.update(_holding(request_id, concerns))
        # A call an answer to the id released is no match, held again or not: a retry of
        # that answer, read before the id was asked again, answers as the first one did.
        ever = _held_unreleased(request_id, named, in_force_only=False)
        held["$expr"] = {"$gt": [{"$size": ever}, 0]}
        query = held
    else:
        named = _named(concerns)
        pending["pending_hitl.message_id"] = asked
        unheld = {"$eq": [{"$size": _held_unreleased(request_id, literal(True))}, 0]}
        query = {**pending, "$expr": unheld}
    resolved = _kept("resolved_hitl", [])
    remembered: dict[str, Any] = {
        "$slice": [{"$concatArrays": [resolved, literal([request_id])]}, -RESOLVED_PROMPTS_KEPT]
    }
    if named is not None:  # remembered once the answer leaves none of its calls held
        unnamed = {"$eq": [named, False]}
        left = {"$size": _held_unreleased(request_id, unnamed)}
        remembered = {"$cond": [{"$eq": [left, 0]}, remembered, resolved]}
    is_pending = {"$eq": [{"$ifNull": ["$pending_hitl.request_id", None]}, literal(request_id)]}
    stage = {
        "pending_hitl": {"$cond": [is_pending, None, _kept("pending_hitl", None)]},
        "resolved_hitl": {"$cond": [resolved_by_request(request_id), resolved, remembered]},
        "approved_calls": _approved_with(request_id, named),
        "answered_prompts": _answered_now(request_id, concerns, stored_below),
    }
    return query, [{"$set": stage}]


def _named(concerns: Sequence[CallKey]) -> dict[str, Any]:
    """Whether the pending call in `$$call` is one of the calls `concerns` names, as an
    expression: one of an id named alone, or that very call (id and message)."""
    ids = sorted({call_id for call_id, message_id in concerns if message_id is None})
    exact = sorted({(c, m) for c, m in concerns if m is not None})
    named: list[Any] = []
    if ids:
        named.append({"$in": ["$$call.tool_call_id", literal(ids)]})
    if exact:
        keys = [{"tool_call_id": c, "message_id": m} for c, m in exact]
        named.append({"$in": [_call_key("call"), literal(keys)]})
    return {"$or": named or [False]}


def _held_unreleased(
    request_id: str, cond: dict[str, Any], *, in_force_only: bool = True
) -> dict[str, Any]:
    """The pending calls a prompt `request_id` holds that meet `cond` (on `$$call`) and no
    answer to that id released (`approved_calls`), as an expression. An approval a later
    prompt holds again (`held_by`) releases its call no more: the call is held, unreleased,
    as `core.awaiting_results` serves it; with `in_force_only=False`, a call an answer to the
    id ever released counts as released, held again or not."""
    held_again = False if in_force_only else None
    by_it = _approval_keys(held_again=held_again, request_id=literal(request_id))
    unreleased = {"$eq": [{"$in": [_call_key("call"), by_it]}, False]}
    holder = {"$eq": [{"$ifNull": ["$$call.request_id", None]}, literal(request_id)]}
    calls = {"$ifNull": ["$pending_calls", literal([])]}
    return {"$filter": {"input": calls, "as": "call", "cond": {"$and": [holder, cond, unreleased]}}}


def _answered_now(
    request_id: str, concerns: Sequence[CallKey] | None, stored_below: int | None
) -> dict[str, Any]:
    """`answered_prompts` with one more answer, to the prompts `request_id`, reaching every
    `seq` reserved so far (`message_count`): the prompts of the id asked up to now, a turn
    still being written among them (its reservation made its prompt the pending one), are
    answered. An earlier answer to the id stays: it answered the prompts of the id asked
    before it, and a pop or a fork folds each answer where it came. The calls it names
    (`concerns`) that a prompt of the id holds are recorded with it (`AnsweredPrompt.calls`):
    the others it releases none of, and are not kept; so is how far the prompts of the id
    stored as it came reach (`stored_below`, at most its reach; null: not read). The newest
    `RESOLVED_PROMPTS_KEPT` answers kept."""
    reach = int64({"$ifNull": ["$message_count", 0]})
    entry: dict[str, Any] = {
        "r": literal(request_id),
        "s": reach,
        # Every key of `AnsweredPrompt`, as the model dumps it: null, it named no call.
        "c": literal(None) if concerns is None else _held_of(request_id, concerns),
        "p": literal(None) if stored_below is None else {"$min": [int64(stored_below), reach]},
    }
    # A one-element array built by `$map`: some servers (mongomock) keep an array literal's
    # elements unevaluated.
    now = {"$map": {"input": literal([0]), "as": "x", "in": entry}}
    answered = _kept("answered_prompts", [])
    return {"$slice": [{"$concatArrays": [answered, now]}, -RESOLVED_PROMPTS_KEPT]}


def _held_of(request_id: str, concerns: Sequence[CallKey]) -> dict[str, Any]:
    """The calls of `concerns` a prompt `request_id` holds (a pending call of the id named
    alone, or that very call), as an expression: `[[id, message id or null], ...]`."""
    holding = {
        "$filter": {
            "input": _kept("pending_calls", []),
            "as": "p",
            "cond": {"$eq": [{"$ifNull": ["$$p.request_id", None]}, literal(request_id)]},
        }
    }
    # A call's key: its id alone, or its id and then its message's (an id: no space in it).
    ids = {"$map": {"input": holding, "as": "p", "in": "$$p.tool_call_id"}}
    pairs = {
        "$map": {
            "input": holding,
            "as": "p",
            "in": {"$concat": ["$$p.tool_call_id", " ", "$$p.message_id"]},
        }
    }
    named = [
        {"key": c if m is None else f"{c} {m}", "exact": m is not None, "call": [c, m]}
        for c, m in dict.fromkeys((c, m) for c, m in concerns)
    ]
    held = {"$in": ["$$k.key", {"$cond": ["$$k.exact", pairs, ids]}]}
    kept = {"$filter": {"input": literal(named), "as": "k", "cond": held}}
    return {"$map": {"input": kept, "as": "k", "in": "$$k.call"}}


def answers_reaching(below: Any, request_ids: Sequence[str] | None = None) -> dict[str, Any]:
    """`answered_prompts` with each answer's reach (`AnsweredPrompt.below`) set to the
    expression `below` (evaluated with the answer's own in `$$s`), for those of `request_ids`
    only when given, and the reach of the prompts stored as it came
    (`AnsweredPrompt.stored_below`) brought down to it. Left unset on a conversation that
    has none."""
    reach: Any = below
    if request_ids is not None:
        named = {"$in": ["$$a.r", literal(list(request_ids))]}
        reach = {"$cond": [named, below, "$$s"]}
    now = int64({"$let": {"vars": {"s": "$$a.s"}, "in": reach}})
    stored = {"$ifNull": ["$$a.p", None]}
    entry = {
        "r": "$$a.r",
        "s": now,
        "c": {"$ifNull": ["$$a.c", None]},
        "p": {"$cond": [{"$eq": [stored, None]}, None, {"$min": [stored, now]}]},
    }
    answered = {"$map": {"input": _kept("answered_prompts", []), "as": "a", "in": entry}}
    return {"answered_prompts": absent_stays("answered_prompts", answered)}


def _holding(request_id: str, concerns: Sequence[CallKey]) -> dict[str, Any]:
    """A filter matching a conversation where a prompt `request_id` holds one of the calls
    `concerns` names: a pending call of one of the ids named alone, or the very call (id and
    message) named with its message."""
    ids = sorted({call_id for call_id, message_id in concerns if message_id is None})
    exact = sorted({(c, m) for c, m in concerns if m is not None})
    if not exact:
        return {
            "pending_calls": {
                "$elemMatch": {"request_id": request_id, "tool_call_id": {"$in": ids}}
            }
        }
    matches = [
        {
            "pending_calls": {
                "$elemMatch": {"request_id": request_id, "tool_call_id": c, "message_id": m}
            }
        }
        for c, m in exact
    ]
    if ids:
        matches.append(_holding(request_id, [(c, None) for c in ids]))
    return {"$or": matches}


def answered_before(
    conversation: Mapping[str, Any], request_id: str, concerns: Sequence[CallKey] | None
) -> bool:
    """Whether an answer to the prompt `request_id` naming the calls `concerns` is a retry of
    one that took effect (`resolve_hitl` then answers as the first did): naming no call, the
    id was resolved (`resolved_hitl`); naming calls, an answer to the id released each of them
    (`approved_calls`: that very call when its message is named), whatever became of the
    request id since (asked again: no longer in `resolved_hitl`), or the id was resolved and
    its answers released no call (its prompt held none: any answer to it was its answer). A
    call no answer to the id released (denied, held by another prompt, never made) is no
    retry: refused as before the id was resolved."""
    resolved = request_id in (conversation.get("resolved_hitl") or ())
    if concerns is None:
        return resolved
    released = [
        (a.get("tool_call_id"), a.get("message_id"))
        for a in conversation.get("approved_calls") or ()
        if isinstance(a, Mapping) and a.get("request_id") == request_id
    ]
    if not released:
        return resolved
    ids = {call_id for call_id, _ in released}
    return bool(concerns) and all(
        (key in released) if key[1] is not None else (key[0] in ids) for key in concerns
    )


def _call_key(variable: str) -> dict[str, Any]:
    """A call's identity (its id and the message that made it), of the pending call or the
    `approved_calls` entry (`ApprovedCall`) in `variable`."""
    return {"tool_call_id": f"$${variable}.tool_call_id", "message_id": f"$${variable}.message_id"}


def _approval_keys(held_again: bool | None = None, request_id: Any = None) -> dict[str, Any]:
    """The keys (`_call_key`) of the `approved_calls` entries, as an expression: those in force
    with `held_again=False` (no later prompt holds their call), those a later prompt holds with
    True, all with None; with `request_id`, only the approvals that prompt's answer gave."""
    conds: list[dict[str, Any]] = []
    if held_again is not None:
        conds.append({"$eq": [held_by_a_prompt("ap"), held_again]})
    if request_id is not None:
        conds.append({"$eq": [{"$ifNull": ["$$ap.request_id", None]}, request_id]})
    approved = _kept("approved_calls", [])
    if conds:
        approved = {"$filter": {"input": approved, "as": "ap", "cond": {"$and": conds}}}
    return {"$map": {"input": approved, "as": "ap", "in": _call_key("ap")}}


def held_by_a_prompt(variable: str) -> dict[str, Any]:
    """Whether a later prompt holds the call of the `approved_calls` entry in `variable`
    (`core.held_again`, as an expression): one it names (`held_by`), or, in an entry
    stored before it was named, the `held_again` flag."""
    named = {"$ne": [held_by_of(variable), None]}
    flagged = {"$eq": [{"$ifNull": [f"$${variable}.held_again", False]}, True]}
    return {"$or": [named, flagged]}


def held_by_of(variable: str) -> dict[str, Any]:
    """The `held_by` of the `approved_calls` entry in `variable`, null when it has none."""
    return {"$ifNull": [f"$${variable}.held_by", None]}


def held_before_of(variable: str) -> dict[str, Any]:
    """The `held_before` of the `approved_calls` entry in `variable`, [] when it has none."""
    return {"$ifNull": [f"$${variable}.held_before", literal([])]}


def approvals_held_by(
    held_by: Any, held_before: Any = None, *, bound: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """`approved_calls` with the `held_by` of each entry (`$$a`) set to the expression
    `held_by`, and its `held_before` to the expression `held_before` (kept when None), its
    other fields kept (their defaults for fields an entry stored before them lacks). Left
    unset on a conversation that has none. The expressions may use the variables `bound`
    names: each is written once, whatever the number of entries and the uses."""
    held = held_before_of("a") if held_before is None else held_before
    return _approvals_changed({"held_by": held_by, "held_before": held}, bound)


def approvals_superseded_by(
    superseded_by: Any, *, bound: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """`approved_calls` with the `superseded_by` of each entry (`$$a`) set to the expression
    `superseded_by`, its other fields kept, as `approvals_held_by` keeps them (and binds
    `bound`)."""
    return _approvals_changed({"superseded_by": superseded_by}, bound)


@cache
def _approval_fields() -> dict[str, Any]:
    """Each field of an `approved_calls` entry (`$$a`) as kept: its default for an entry stored
    before the field was, the call's key as it is. Built once; never changed in place."""
    fields: dict[str, Any] = {
        name: {"$ifNull": [f"$$a.{name}", literal(field.default)]}
        for name, field in ApprovedCall.model_fields.items()
        if not field.is_required()
    }
    return fields | _call_key("a")


def _new_approval(variable: str, request_id: str) -> dict[str, Any]:
    """The `approved_calls` entry releasing the pending call in `variable`, as an expression:
    every key of `ApprovedCall`, as the model dumps it (the stored schema requires them all),
    its fields past the call's key and `request_id` at their defaults."""
    defaults = {
        name: literal(field.default)
        for name, field in ApprovedCall.model_fields.items()
        if not field.is_required() and name != "request_id"
    }
    return {**_call_key(variable), "request_id": literal(request_id), **defaults}


def _approvals_changed(
    changes: Mapping[str, Any], bound: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """`approved_calls` with the fields `changes` names of each entry (`$$a`) set to their
    expressions, its other fields kept (their defaults for fields an entry stored before
    them lacks), the variables `bound` names bound around them. Left unset on a conversation
    that has none."""
    fields = {**_approval_fields(), **changes}
    approved: dict[str, Any] = {
        "$map": {"input": _kept("approved_calls", []), "as": "a", "in": fields}
    }
    if bound:
        approved = {"$let": {"vars": dict(bound), "in": approved}}
    return {"approved_calls": absent_stays("approved_calls", approved)}


def approvals_unstored(
    conversation: Mapping[str, Any] | None, message_ids: Collection[str]
) -> list[dict[str, Any]]:
    """The stage setting `approved_calls` once the messages `message_ids`, which a
    reservation counted and no insert stored, are given back (a block given back, a turn
    given up), as a pop of each sets them (`_tail`): an approval a prompt among them held
    again is held by the latest earlier prompt that held it (`held_before`, those among
    them left out), or, with none, in force again; one a call among them superseded is of
    the latest call of its id again. None (no stage) when no approval of `conversation` (as
    read: only this turn's reservation names its messages) names any of them; always one
    without `conversation`."""
    ids = set(message_ids)
    named = conversation is None or any(
        isinstance(a, Mapping)
        and (
            a.get("held_by") in ids
            or a.get("superseded_by") in ids
            or bool(ids.intersection(a.get("held_before") or ()))
        )
        for a in conversation.get("approved_calls") or ()
    )
    if not named:
        return []
    unstored = literal(sorted(ids))
    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
    stored = {"$eq": [{"$in": ["$$m", unstored]}, False]}
    before = {"$filter": {"input": held_before_of("a"), "as": "m", "cond": stored}}
    held_by = held_by_of("a")
    previous = {"$ifNull": [{"$arrayElemAt": ["$$before", -1]}, None]}
    now_held_by = {"$cond": [{"$in": [held_by, unstored]}, previous, held_by]}
    superseded = {"$ifNull": ["$$a.superseded_by", None]}
    changes = {
        "held_by": {"$let": {"vars": {"before": before}, "in": now_held_by}},
        "held_before": {
            "$let": {
                "vars": {"before": before},
                "in": {
                    "$filter": {
                        "input": "$$before",
                        "as": "m",
                        "cond": {"$ne": ["$$m", now_held_by]},
                    }
                },
            }
        },
        "superseded_by": {"$cond": [{"$in": [superseded, unstored]}, None, superseded]},
    }
    return [{"$set": _approvals_changed(changes)}]


def approvals_left_unstored(
    approved: Iterable[Any], message_ids: Collection[str]
) -> list[Mapping[str, Any]]:
    """`approved_calls` as `approvals_unstored` leaves them, computed from the list as read
    (`check_turn` weighs a give-back it does not write)."""
    ids, left = set(message_ids), list[Mapping[str, Any]]()
    for approval in approved:
        if not isinstance(approval, Mapping):
            continue
        before = [m for m in approval.get("held_before") or () if m not in ids]
        held_by = approval.get("held_by")
        if held_by in ids:
            held_by = before[-1] if before else None
        superseded = approval.get("superseded_by")
        left.append(
            {
                **approval,
                "held_by": held_by,
                "held_before": [m for m in before if m != held_by],
                "superseded_by": None if superseded in ids else superseded,
            }
        )
    return left


def approvals_without(withdrawn: Iterable[tuple[str, str, str]]) -> dict[str, Any]:
    """`approved_calls` without the approvals `withdrawn` names (call id, message id, request
    id), as an expression: those the stored messages, with the answers a person gave, give
    none of (`_fork.approvals_withdrawn`, read by a pop or the fold after a move or a
    give-back). Others, an answer given since they were read among them, are kept as they
    are."""
    key = {
        "tool_call_id": "$$a.tool_call_id",
        "message_id": "$$a.message_id",
        "request_id": {"$ifNull": ["$$a.request_id", None]},
    }
    keys = literal([{"tool_call_id": c, "message_id": m, "request_id": r} for c, m, r in withdrawn])
    return {
        "$filter": {
            "input": {"$ifNull": ["$approved_calls", literal([])]},
            "as": "a",
            # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
            "cond": {"$eq": [{"$in": [key, keys]}, False]},
        }
    }


def _approved_with(request_id: str, named: dict[str, Any] | None = None) -> dict[str, Any]:
    """`approved_calls` with the pending calls the prompt `request_id` holds (those `named`
    names, when given: an expression on `$$call`, `_named`), as an expression:
    those of calls still pending are all kept (`pending_calls` is bounded), the others the
    newest `RESOLVED_PROMPTS_KEPT` (a retry of a turn whose denial of one was refused is
    recognised by them: `approved_among`)."""
    calls = {"$ifNull": ["$pending_calls", literal([])]}
    approved = _kept("approved_calls", [])
    holder = {"$ifNull": ["$$call.request_id", None]}
    holds: dict[str, Any] = {"$eq": [holder, literal(request_id)]}
    cond = holds if named is None else {"$and": [holds, named]}
    held = {"$filter": {"input": calls, "as": "call", "cond": cond}}
    entries = {"$map": {"input": held, "as": "call", "in": _new_approval("call", request_id)}}
    in_force = _approval_keys(held_again=False)
    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
    fresh = {
        "$filter": {
            "input": entries,
            "as": "a",
            "cond": {"$eq": [{"$in": [_call_key("a"), in_force]}, False]},
        }
    }
    every = {"$concatArrays": [approved, fresh]}
    pending = {"$map": {"input": calls, "as": "call", "in": _call_key("call")}}

    def still_pending(wanted: bool) -> dict[str, Any]:
        cond = {"$eq": [{"$in": [_call_key("a"), pending]}, wanted]}
        return {"$filter": {"input": every, "as": "a", "cond": cond}}

    others = {"$slice": [still_pending(False), -RESOLVED_PROMPTS_KEPT]}
    return {"$concatArrays": [still_pending(True), others]}


def denials_hold(
    call_ids: Sequence[str], refused: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A filter matching a conversation where a person approved none of the calls `call_ids`
    (the latest pending call of each id): not released by an answer in force
    (`approved_calls`) nor held by a prompt a person resolved (`resolved_hitl`), and, for a
    denial answering the prompt `refused` names for its call (as the denying client read
    it), not released by that prompt's answer, even if a later prompt holds the call again,
    unless that later prompt asks under the same request id (a runtime numbering its
    confirmations per turn): the denial then answers the question pending now.
    With no call of an id pending, the denial answers the latest call of that id, answered
    since: a person approved it when an approval of a call of that id no later call reuses
    the id of stands (`latest_approved`), its result logged or not.
    A turn denying them may be logged (`released_calls` names those it may not)."""
    calls = {"$ifNull": ["$pending_calls", literal([])]}
    refused = refused or {}
    latest_approved = _latest_approved_ids()

    def released(call_id: str) -> dict[str, Any]:
        same = {"$eq": ["$$call.tool_call_id", literal(call_id)]}
        of_id = {"$filter": {"input": calls, "as": "call", "cond": same}}
        holder = {"$ifNull": ["$$last.request_id", None]}
        answered: list[dict[str, Any]] = [
            {"$in": [holder, _kept("resolved_hitl", [])]},
            {"$in": [_call_key("last"), _approval_keys(held_again=False)]},
        ]
        if call_id in refused:  # unless that prompt's id now asks about the call again
            by_refused = _approval_keys(request_id=literal(refused[call_id]))
            not_asked_again = {"$ne": [holder, literal(refused[call_id])]}
            answered.append({"$and": [{"$in": [_call_key("last"), by_refused]}, not_asked_again]})
        in_ = {"$or": answered}
        pending = {"$let": {"vars": {"last": {"$arrayElemAt": [of_id, -1]}}, "in": in_}}
        # Apart from the `$let`: some servers (mongomock) make it missing when `last` is.
        none_pending = {"$eq": [{"$size": of_id}, 0]}
        answered_since = {"$and": [none_pending, {"$in": [literal(call_id), latest_approved]}]}
        return {"$or": [pending, answered_since]}

    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
    return {"$expr": {"$eq": [{"$or": [released(c) for c in call_ids]}, False]}}


def answers_hold(answers: Mapping[str, str]) -> dict[str, Any]:
    """A filter matching a conversation where each call `answers` names (a tool call id, and
    the message that made it, as the answering client read `pending_calls`) is still the
    latest pending call of its id: the call the turn's answer of that id takes (`_taken`).
    A call another turn answered since (another tab: a call's first answer is its answer),
    or one a later call of its id was made after, fails it (`answered_since`)."""
    calls = {"$ifNull": ["$pending_calls", literal([])]}

    def latest(call_id: str, message_id: str) -> dict[str, Any]:
        same = {"$eq": ["$$call.tool_call_id", literal(call_id)]}
        of_id = {"$filter": {"input": calls, "as": "call", "cond": same}}
        made_by = {"$map": {"input": of_id, "as": "call", "in": "$$call.message_id"}}
        # An empty list has no last element: missing, never equal to the message named.
        return {"$eq": [{"$arrayElemAt": [made_by, -1]}, literal(message_id)]}

    return {"$expr": {"$and": [latest(c, m) for c, m in sorted(answers.items())]}}


def answers_stand(calls: Mapping[str, str]) -> dict[str, Any]:
    """A filter matching a conversation where none of the calls `calls` names (a tool call
    id, and the message that made it) is pending: each is still answered, as it was when
    its stored answer was read (a pop taking that answer back lists it again)."""
    listed = [
        {"pending_calls": {"$elemMatch": {"tool_call_id": c, "message_id": m}}}
        for c, m in sorted(calls.items())
    ]
    # Under `$and`: a condition's filter joins the conversation's (`conversation_by_id`),
    # whose `$nor` it would otherwise replace.
    return {"$and": [{"$nor": listed}]}


def answered_since(
    conversation: Mapping[str, Any], answers: Mapping[str, str]
) -> tuple[list[str], list[str]]:
    """Those of the calls `answers` names (`answers_hold`) that `conversation` no longer
    serves as the latest pending call of their id: first those no longer pending at all
    (answered by another turn since, or gone), then those a later call of the id follows."""
    pending = [c for c in conversation.get("pending_calls") or () if isinstance(c, Mapping)]
    latest = {c.get("tool_call_id"): c.get("message_id") for c in pending}
    keys = {(c.get("tool_call_id"), c.get("message_id")) for c in pending}
    stale = [(c, m) for c, m in answers.items() if latest.get(c) != m]
    gone = [c for c, m in stale if (c, m) not in keys]
    return gone, [c for c, m in stale if (c, m) in keys]


ANSWERS_READ: dict[str, Any] = {
    "seq": 1,
    "role": 1,
    "tool_call_id": 1,
    "tool_calls.id": 1,
    "epoch": 1,
    "turn_id": 1,
}
"""What the lookup of the answers to calls off `pending_calls` reads of each message
(`answers_lookup`)."""


def of_epoch(docs: Sequence[Mapping[str, Any]], epoch: Any) -> list[Any]:
    """The messages of the life whose `epoch` is given, and those stored before epochs: never
    what a late insert of a life a delete ended left under the id until the delete's sweep."""
    return [doc for doc in docs if doc.get("epoch") in (None, epoch)]


def answers_lookup(
    conversation_id: str, answers: Mapping[str, str], from_seq: int | None
) -> dict[str, Any]:
    """A filter for the messages that tell whether the calls `answers` names (`answers_hold`),
    off `pending_calls`, have an answer: the messages named, those making or answering a
    call of their ids, and, with `from_seq`, every message from that `seq` on (those of
    blocks still being written, `Gaps.unpassed_from`)."""
    ids = sorted(answers)
    wanted: list[dict[str, Any]] = [
        {"_id": {"$in": sorted(set(answers.values()))}},
        {"tool_calls.id": {"$in": ids}},
        {"role": "tool", "tool_call_id": {"$in": ids}},
    ]
    if from_seq is not None:
        wanted.append({"seq": {"$gte": from_seq}})
    return {"conversation_id": conversation_id, "$or": wanted}


def answer_found(found: Sequence[Mapping[str, Any]], call_id: str, made_by: str) -> str | None:
    """How the stored messages `found` (`answers_lookup`, in `seq` order) leave the call
    `call_id` the message `made_by` makes, by the pairing every replay applies
    (`core.calls_answered`: an answer takes the latest earlier call of its id without one):
    "answered" when a stored answer takes it, "followed" when a later call of its id has
    none (an answer now would take that call), None when it awaits its answer."""
    paired = _paired(found, call_id, made_by)
    if paired is None:
        return None
    start, calls, answers = paired
    if start in answers:
        return "answered"
    return "followed" if any(c not in answers for c in calls if c != start) else None


def answers_found(
    found: Sequence[Mapping[str, Any]], call_id: str, made_by: str
) -> list[Mapping[str, Any]]:
    """The stored answers among `found` (`answers_lookup`, in `seq` order) that the pairing
    of `answer_found` gives the call `call_id` the message `made_by` makes, in `seq` order."""
    paired = _paired(found, call_id, made_by)
    if paired is None:
        return []
    start, _, answers = paired
    return [found[index] for index in answers.get(start, ())]


def _paired(
    found: Sequence[Mapping[str, Any]], call_id: str, made_by: str
) -> tuple[int, list[int], dict[int, list[int]]] | None:
    """From the message `made_by` on (`start`, its index in `found`; None when it is not
    there), the messages making a call of `call_id` (their indexes), and the answers each
    takes (an answer takes the latest earlier call of its id without one)."""
    start = next((i for i, d in enumerate(found) if d.get("_id") == made_by), None)
    if start is None:
        return None
    calls: list[int] = []
    answers: dict[int, list[int]] = {}
    for index in range(start, len(found)):
        message = found[index]
        made = {c.get("id") for c in message.get("tool_calls") or () if isinstance(c, Mapping)}
        if call_id in made:
            calls.append(index)
        elif message.get("role") == "tool" and message.get("tool_call_id") == call_id and calls:
            taken = next((c for c in reversed(calls) if c not in answers), calls[-1])
            answers.setdefault(taken, []).append(index)
    return start, calls, answers


@dataclass(frozen=True)
class AsRead:
    """The calls of earlier turns a turn answers that are off `pending_calls` though no answer
    to them is there (the bounded list dropped them, or the turn that took them was
    abandoned unstored): tool call id to the message that made it. The turn takes them only
    while the conversation is as it was read when that was found: no turn reserved, none
    moved and no pop since (`filter`)."""

    calls: Mapping[str, str]
    message_count: int
    pops: int
    epoch: str | None
    renamed: Mapping[str, str] | None = None
    """The calls the turn names by an earlier id of the message making them, a stored
    message of the same turn making each now (its turn re-logged without an answer it was
    refused, its messages numbered anew: `_logger._relogged_ids`): call id to that stored
    message, which the turn's conditions name instead."""

    def filter(self) -> dict[str, Any]:
        """Matches the conversation while it is as read."""
        query: dict[str, Any] = {
            "message_count": self.message_count,
            "pops": {"$in": [None, 0]} if self.pops == 0 else self.pops,
        }
        if self.epoch is not None:
            query["epoch"] = self.epoch
        return query


def _latest_approved_ids() -> dict[str, Any]:
    """The call ids of the `approved_calls` entries no later call reuses the id of
    (`ApprovedCall.superseded_by`), as an expression: the approved call is the latest of its
    id."""
    latest = {"$eq": [{"$ifNull": ["$$ap.superseded_by", None]}, None]}
    approved = {"$filter": {"input": _kept("approved_calls", []), "as": "ap", "cond": latest}}
    return {"$map": {"input": approved, "as": "ap", "in": "$$ap.tool_call_id"}}


def released_calls(
    conversation: Mapping[str, Any],
    call_ids: Sequence[str],
    refused: Mapping[str, str] | None = None,
) -> list[str]:
    """Those of `call_ids` whose latest pending call in `conversation` a person approved
    (`denials_hold`), or, with none of that id pending, whose latest call a person approved:
    the first answer was an approval, so a denial of the call comes too late (the tool runs;
    its result answers it)."""
    resolved = conversation.get("resolved_hitl") or ()
    refused = refused or {}
    latest = {
        call.get("tool_call_id"): call
        for call in conversation.get("pending_calls") or ()
        if isinstance(call, Mapping)
    }
    latest_approved = {
        a.get("tool_call_id")
        for a in conversation.get("approved_calls") or ()
        if isinstance(a, Mapping) and a.get("superseded_by") is None
    }

    def released(call_id: str) -> bool:
        call = latest.get(call_id)
        if call is None:
            return call_id in latest_approved
        key = (call.get("tool_call_id"), call.get("message_id"))
        prompt = refused.get(call_id, _NO_PROMPT)
        by_refused = _approvals(conversation, request_id=prompt)
        return (
            call.get("request_id") in resolved
            or key in _approvals(conversation, held_again=False)
            or (key in by_refused and call.get("request_id") != prompt)
        )

    return [c for c in call_ids if released(c)]


def approved_among(conversation: Mapping[str, Any], call_ids: Sequence[str]) -> list[str]:
    """Those of `call_ids` a person's answer released (`approved_calls`), pending or answered
    since, held again by a later prompt or not: a turn denying one was refused
    (`AnsweredBefore`) and logged without the denial, so a retry sending it again is told so
    again."""
    approved = {call_id for call_id, _ in _approvals(conversation)}
    return [c for c in call_ids if c in approved] or released_calls(conversation, call_ids)


_NO_PROMPT = object()
"""No prompt named: `_approvals` then matches no approval."""


def _approvals(
    conversation: Mapping[str, Any], *, held_again: bool | None = None, request_id: Any = None
) -> set[tuple[Any, Any]]:
    """The keys of `conversation`'s `approved_calls`, as `_approval_keys` selects them."""
    return {
        (a.get("tool_call_id"), a.get("message_id"))
        for a in conversation.get("approved_calls") or ()
        if isinstance(a, Mapping)
        and (held_again is None or approval_held_again(a) == held_again)
        and (request_id is None or a.get("request_id") == request_id)
    }


def _capped(field: str, amount: int) -> dict[str, Any]:
    """A running sum that stops at 2**53 - 1, so one huge value cannot jam later turns."""
    return int64({"$min": [_sum(field, amount), MAX_SAFE_INTEGER]})


def _records(
    plan: TurnPlan,
    digest: int,
    rules: TurnRules,
    now: datetime,
    turns: Any = None,
    *,
    person: bool,
    counted: tuple[int, int, int] | None,
    named: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`turns` (the records as they stand, by default) with the record of the block of
    `plan`'s turn reserved now appended (`person`: a user token logs the turn; `counted`:
    what its reservation counted; whether it leaves calls open), the oldest dropped past the
    window (`_window`) and counted."""
    turns = _TURNS if turns is None else turns
    record = {
        "k": literal(Int64(plan.key)),
        "f": int64({"$ifNull": ["$message_count", 0]}),
        "d": literal(Int64(digest)),
        "a": literal(now),
        "p": literal(False),
        "g": literal(False),
        "u": literal(person),
        "m": literal(False),
        # One more than every record appended before (kept or dropped): the records' order.
        "o": int64({"$add": [_kept("turns_dropped", 0), {"$size": _TURNS}]}),
        "c": literal(_packed(counted)),
        # Its block's extent: what the next record kept says no more, once one is dropped.
        "l": literal(Int64(plan.count)),
        # Whether it leaves calls open: only such a turn may lose one to the list's bound.
        "h": literal(bool(plan.opened_calls)),
        # A runtime name set: what it replaced (`_named_record`); null for a turn setting none.
        "n": literal(None) if named is None else named,
    }
    # A one-element array built by `$map`: some MongoDB-compatible servers (mongomock) keep an
    # array literal's elements unevaluated.
    appended = {"$concatArrays": [turns, {"$map": {"input": [0], "in": record}}]}
    kept = {"turns": {"$let": {"vars": {"all": appended}, "in": _window(rules.turns_recorded)}}}
    if rules.abandon_after:  # of zero (tests), every block would be passed at once
        kept[PENDING_BLOCKS] = _pending_blocks(plan, rules, now)
    return kept


def lists_pending(plan: TurnPlan) -> bool:
    """Whether the turn's reservation lists pending state of its own: calls it leaves open, a
    prompt it raises (`PENDING_BLOCKS` keeps its block)."""
    return bool(plan.opened_calls) or isinstance(plan.pending_hitl, PendingHitl)


def _pending_blocks(plan: TurnPlan, rules: TurnRules, now: datetime) -> dict[str, Any]:
    """`PENDING_BLOCKS` as a reservation (or a move) of `plan`'s turn at `now` leaves it, as
    an expression: the blocks it found passed (`d`) last time go; those reserved
    `abandon_after` ago or more are passed now (`d` true: this reservation takes them, and
    its logger looks whether their turns stored anything, `AgentMessageLogger._left_unstored`);
    the others stay, with the turn's own block when its reservation lists pending state
    (calls it leaves open, a prompt it raises), the newest `PENDING_BLOCKS_KEPT` of them,
    each with the calls answering turns took off the list (`t`; for a turn answering calls,
    with those `pending_calls` lists made there as well, which the next stage keeps only
    where the turn took them off: `_taken_kept`). The blocks a fold found passed and empty
    stay watched (`w`, `watched_blocks`) for `BLOCKS_WATCHED_FOR`, the newest
    `PENDING_BLOCKS_KEPT` of them.
    Not kept with an `abandon_after` of zero (a setting for tests): every block not yet
    written would be passed at once, a turn still being written folded away."""
    passed_by = literal(now - rules.abandon_after)
    since = literal(now - BLOCKS_WATCHED_FOR)
    unwatched = {"$eq": [{"$ifNull": ["$$b.w", None]}, None]}
    unseen = {"$and": [{"$ne": [{"$ifNull": ["$$b.d", False]}, True]}, unwatched]}
    entry = {
        "f": "$$b.f",
        "l": "$$b.l",
        "a": "$$b.a",
        "d": {"$lte": ["$$b.a", passed_by]},
        "w": literal(None),
        "c": literal(None),
        "t": _taken_listed(plan),
    }
    unseen_ones = {"$filter": {"input": "$$held", "as": "b", "cond": unseen}}
    listed = {"$map": {"input": unseen_ones, "as": "b", "in": entry}}
    still = {"$gt": [{"$ifNull": ["$$b.w", literal(_NEVER)]}, since]}
    watched = {"$filter": {"input": "$$held", "as": "b", "cond": still}}

    def marked(passed: bool) -> dict[str, Any]:
        return {"$filter": {"input": "$$listed", "as": "b", "cond": {"$eq": ["$$b.d", passed]}}}

    young = marked(False)
    if lists_pending(plan):
        own = {
            "f": int64({"$ifNull": ["$message_count", 0]}),
            "l": literal(Int64(plan.count)),
            "a": literal(now),
            "d": literal(False),
            "w": literal(None),
            "c": literal(None),
            "t": literal(None),
        }
        young = {"$concatArrays": [young, {"$map": {"input": [0], "in": own}}]}
    blocks = {
        "$concatArrays": [
            {"$slice": [watched, -PENDING_BLOCKS_KEPT]},
            marked(True),
            {"$slice": [young, -PENDING_BLOCKS_KEPT]},
        ]
    }
    # Each part bound once (`$$held`, `$$listed`, `$$blocks`), evaluated once, written once.
    none = {"$and": [_UNLISTED, {"$eq": [{"$size": "$$blocks"}, 0]}]}
    kept = {"$cond": [none, "$$REMOVE", "$$blocks"]}  # absent while no turn listed pending state
    built = {"$let": {"vars": {"blocks": blocks}, "in": kept}}
    parts = {"$let": {"vars": {"listed": listed}, "in": built}}
    return {"$let": {"vars": {"held": _kept(PENDING_BLOCKS, [])}, "in": parts}}


def _taken_listed(plan: TurnPlan) -> Any:
    """`t` of the entry `$$b` of `PENDING_BLOCKS` (neither passed nor watched) as the first
    stage of the reservation of `plan`'s turn writes it (`_pending_blocks`), as an
    expression: as it is for a turn answering no call; for one answering calls, with the
    calls `pending_calls` lists before it made there (their `seq` in the block) appended,
    each with the turn's key. The stage after keeps of those only the calls the turn took
    off the list (`_taken_kept`): the first stage reads the list before the turn, the
    second the list after it, and the ids the turn answers are named in neither."""
    if not plan.answered_calls:
        return {"$ifNull": ["$$b.t", None]}
    seq = {"$ifNull": ["$$call.seq", -1]}
    here = {"$and": [{"$gte": [seq, "$$b.f"]}, {"$lt": [seq, {"$add": ["$$b.f", "$$b.l"]}]}]}
    made_here = {"$filter": {"input": _PENDING_CALLS, "as": "call", "cond": here}}
    entry = {"c": "$$call.tool_call_id", "m": "$$call.message_id", "k": literal(Int64(plan.key))}
    listed = {"$map": {"input": made_here, "as": "call", "in": entry}}
    return {"$concatArrays": [{"$ifNull": ["$$b.t", literal([])]}, listed]}


_TURNS = _kept("turns", [])
"""The turn records as they stand."""


@cache
def _window(turns_recorded: int) -> dict[str, Any]:
    """The records kept of `$$all` (every record, the newest last), as an expression: the
    newest `turns_recorded` records, and before them the turns' own records (not
    `TurnRecord.moved`) up to `turns_recorded` of those in all, in their order
    (`TurnRecord.order`; a record kept before records said so counts as the oldest). A
    record marking a block a turn left (by a move, or given back) is so kept as long as when
    every record counted, and never pushes a turn's record out: a turn moved many times
    leaves the others' records in place. At most twice `turns_recorded` records (and those
    kept before records said so); built once per `turns_recorded`, never changed in place.
    What it drops is counted by the stage after (`RECORDS_DROPPED`)."""
    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
    own = {"$eq": [{"$ifNull": ["$$record.m", False]}, False]}
    owns = {"$filter": {"input": "$$all", "as": "record", "cond": own}}

    def oldest_of(records: Any) -> dict[str, Any]:
        first = {"$arrayElemAt": [{"$slice": [records, -turns_recorded]}, 0]}
        return {"$let": {"vars": {"first": first}, "in": {"$ifNull": ["$$first.o", -1]}}}

    order = {"$ifNull": ["$$record.o", -1]}
    newest = {"$gte": [order, "$$newest"]}
    newest_own = {"$and": [own, {"$gte": [order, "$$newest_own"]}]}
    cuts = {"newest": oldest_of("$$all"), "newest_own": oldest_of(owns)}
    kept_ones = {
        "$filter": {"input": "$$all", "as": "record", "cond": {"$or": [newest, newest_own]}}
    }
    return {"$let": {"vars": cuts, "in": kept_ones}}


_LAST_RECORD = {"$let": {"vars": {"last": {"$arrayElemAt": ["$turns", -1]}}, "in": "$$last.o"}}
RECORDS_DROPPED = {
    "$set": {
        "turns_dropped": int64({"$subtract": [{"$add": [_LAST_RECORD, 1]}, {"$size": "$turns"}]})
    }
}
"""The stage after one that appended a record (`_records`): `turns_dropped`, every record
ever appended (the last one's `TurnRecord.order` and one) less those kept. Its own stage,
so the window is evaluated once. Never changed in place."""


_NOTHING_PENDING = {
    "$and": [
        {"$eq": [{"$size": {"$ifNull": ["$pending_calls", []]}}, 0]},
        {"$eq": [{"$ifNull": ["$pending_hitl", None]}, None]},
    ]
}
_WATCHED_OR_TAKEN = {
    "$filter": {
        "input": "$$blocks",
        "as": "b",
        "cond": {
            "$or": [
                {"$ne": [{"$ifNull": ["$$b.w", None]}, None]},
                {"$gt": [{"$size": {"$ifNull": ["$$b.t", literal([])]}}, 0]},
            ]
        },
    }
}
_BLOCKS_KEPT = {"$cond": [_NOTHING_PENDING, _WATCHED_OR_TAKEN, "$$blocks"]}
"""The parts of `blocks_moot_dropped` that no turn changes, on the blocks bound to
`$$blocks`: built once, never changed in place."""


def blocks_moot_dropped(plan: TurnPlan) -> dict[str, Any]:
    """The stage after one that set `PENDING_BLOCKS` (`_records`), before `calls_cut`: none
    is kept while nothing is pending (no call, no prompt), as a turn that died before its
    insert then leaves nothing to fold away, and the next reservation looks at nothing
    (absent while no turn listed pending state), but the blocks watched (`w`): an insert
    landing there lists what it stores; and those recording calls an answer took off
    (`t`): that answer, still in flight or the turn passing the block, may be all that
    lists them no more. For a turn answering calls, each block's `t` is cut to the calls
    the turn took off as well (`_taken_kept`)."""
    blocks: Any = f"${PENDING_BLOCKS}"
    if plan.answered_calls:
        blocks = _taken_kept(plan)
    kept = {"$let": {"vars": {"blocks": blocks}, "in": _BLOCKS_KEPT}}
    return {"$set": {PENDING_BLOCKS: {"$cond": [_UNLISTED, "$$REMOVE", kept]}}}


def _taken_kept(plan: TurnPlan) -> dict[str, Any]:
    """`PENDING_BLOCKS` as the first stage of the reservation (or the move) of a turn
    answering calls left them (`_taken_listed`), each block's `t` keeping of the calls it
    appended (the turn's key, `k`) only those `pending_calls` lists no more after the turn
    (before it is cut to its newest: `calls_cut`), the calls the turn's answers took off
    (`PendingBlock.taken`); null when it keeps none. Told by key, so the ids answered are
    named nowhere more (`_answering`). The fold that finds such a block passed and empty
    waits for its `t` calls (`_relocated._unlanded_calls`), as an answer naming one does
    (`calls_awaited`), and the turn passing the block waits for its call's turn
    (`_logger._Reserved.ahead`)."""
    after = {"$map": {"input": _PENDING_CALLS, "as": "call", "in": _call_key("call")}}
    named = {"tool_call_id": "$$t.c", "message_id": "$$t.m"}
    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
    gone = {"$eq": [{"$in": [named, "$$after"]}, False]}
    kept = {"$or": [{"$ne": ["$$t.k", literal(Int64(plan.key))]}, gone]}
    taken = {"$filter": {"input": {"$ifNull": ["$$b.t", literal([])]}, "as": "t", "cond": kept}}
    none = {"$eq": [{"$size": "$$taken"}, 0]}
    block: dict[str, Any] = {key: {"$ifNull": [f"$$b.{key}", None]} for key in "dwc"}
    block |= {"f": "$$b.f", "l": "$$b.l", "a": "$$b.a"}
    block["t"] = {"$let": {"vars": {"taken": taken}, "in": {"$cond": [none, None, "$$taken"]}}}
    blocks = {"$map": {"input": f"${PENDING_BLOCKS}", "as": "b", "in": block}}
    return {"$let": {"vars": {"after": after}, "in": blocks}}


def watched_blocks(conversation: Mapping[str, Any], now: datetime) -> tuple[int, ...]:
    """The first `seq`s of the blocks `conversation` watches at `now` (`PENDING_BLOCKS`
    entries with `w`, the time a fold found them passed and empty, within
    `BLOCKS_WATCHED_FOR`): its turn's insert may still land there, after the fold that
    listed the pending state without it. A turn reserving, and a read of the summary, look
    whether one did (one `find`, only while one is watched) and fold again when one did."""
    since = now - BLOCKS_WATCHED_FOR
    return tuple(
        int(block["f"])
        for block in conversation.get(PENDING_BLOCKS) or ()
        if isinstance(block, Mapping)
        and isinstance(block.get("w"), datetime)
        and to_utc(block["w"]) > since
    )


def watched_given_up(
    conversation: Mapping[str, Any], own: Collection[int], now: datetime
) -> frozenset[int]:
    """The first `seq`s of the blocks `conversation` watches at `now` (`watched_blocks`) whose
    turn was given up for good on a late retry and may log itself again (the block given up
    now, its `seq`s among `own`, or one its record marks given up, `g`, and no pop passed):
    refused where it would land at the end (`AnsweredBefore`, "log the turn without that
    answer"), its writer may send it again without that answer, or an earlier send of it
    still land, making the calls the block records (`c`). A fold keeps such a block watched
    (`_relocated.watched_after`) until the watch ends or a pop passes it, so an answer
    naming one of those calls waits for it (`calls_awaited`), never refused as naming a
    message that makes no call while that turn may still make it."""
    given_up = _blocks_marked(
        conversation, lambda raw: raw.get("g") is True and raw.get("p") is not True
    )
    watched = set(watched_blocks(conversation, now))
    return frozenset(
        int(block["f"])
        for block in conversation.get(PENDING_BLOCKS) or ()
        if isinstance(block, Mapping)
        and block.get("f") in watched
        and isinstance(block.get("a"), datetime)
        and (int(block["f"]) in own or (int(block["f"]), to_utc(block["a"])) in given_up)
    )


def calls_awaited(conversation: Mapping[str, Any], now: datetime) -> frozenset[tuple[str, str]]:
    """The calls (call id, message id) that the blocks `conversation` watches at `now`
    (`watched_blocks`) record as taken off `pending_calls` by the fold that found them
    passed and empty (`PendingBlock.calls`): their turn is not stored and may still be
    logged (a writer retrying, moved to the end with its message ids; or an insert still
    in the network), so an answer naming one waits for it (`StorageUnavailable`) until the
    watch ends, never refused as naming a message that makes no call. So are the calls an
    answering turn's reservation took off the list that a block not watched records
    (`PendingBlock.taken`, `t`), while their turn may still land (`_taken_awaited`): that
    answer may be all that lists them no more, and no turn has passed the block yet, or
    one passed it since and looks it up; the caller counts only a call whose message is
    not stored."""
    watched = set(watched_blocks(conversation, now))
    popped = _blocks_popped(conversation)
    return frozenset(
        (str(call["c"]), str(call["m"]))
        for block in conversation.get(PENDING_BLOCKS) or ()
        if isinstance(block, Mapping)
        for call in _awaited_in(
            block,
            block.get("f") in watched and not _popped_past(block, popped),
            _taken_awaited(block, now, popped),
        )
        if isinstance(call, Mapping) and "c" in call and "m" in call
    )


def _awaited_in(block: Mapping[str, Any], watched: bool, taken: list[Any]) -> list[Any]:
    """The calls a block listing pending state records as awaited (`calls_awaited`): those
    the fold watching it took off (`c`) while `watched`; those an answer took off (`taken`)
    unless it was watched once, its watch now over."""
    if watched:
        return [*(block.get("c") or ()), *taken]
    return [] if block.get("w") is not None else taken


def _blocks_popped(conversation: Mapping[str, Any]) -> set[tuple[int, datetime]]:
    """The blocks (first `seq`, time reserved) whose turn records a pop passed (`popped`)."""
    return _blocks_marked(conversation, lambda raw: raw.get("p") is True)


def _blocks_marked(
    conversation: Mapping[str, Any], marked: Callable[[Mapping[str, Any]], bool]
) -> set[tuple[int, datetime]]:
    """The blocks (first `seq`, time reserved) whose turn records are `marked`."""
    return {
        (int(raw["f"]), to_utc(raw["a"]))
        for raw in conversation.get("turns") or ()
        if isinstance(raw, Mapping) and isinstance(raw.get("a"), datetime) and marked(raw)
    }


def _popped_past(block: Mapping[str, Any], popped: set[tuple[int, datetime]]) -> bool:
    """Whether a pop passed `block` (its turn's record, reserved with it, `popped`)."""
    at = block.get("a")
    return isinstance(at, datetime) and (block.get("f"), to_utc(at)) in popped


def _taken_awaited(
    block: Mapping[str, Any], now: datetime, popped: set[tuple[int, datetime]]
) -> list[Any]:
    """The calls an answer took off the list that `block` records (`t`) while their turn may
    still land: within `BLOCKS_WATCHED_FOR` of the block's reservation (no turn passing it,
    as when every later turn is an answer refused before it reserves, the wait still ends)
    and until a pop passed it (its turn's record, reserved with it, `popped`: the turn was
    popped, or its block given back, and is never logged there again). None after: an
    answer naming one is refused as naming a message that makes no call."""
    at = block.get("a")
    if not isinstance(at, datetime) or to_utc(at) <= now - BLOCKS_WATCHED_FOR:
        return []
    if _popped_past(block, popped):
        return []
    return list(block.get("t") or ())


_NAME_MESSAGE_KEPT = absent_stays("name_message_id", "$name_message_id")
"""`name_message_id` as it is (absent while it is absent)."""


def _runtime_replaceable() -> dict[str, Any]:
    """Whether a runtime's name replaces the conversation's (an expression): none is set, or
    an automatic or runtime name is."""
    return {
        "$or": [
            {"$eq": [_kept("name", None), None]},
            {"$eq": ["$name_source", "auto"]},
            {"$eq": ["$name_source", "runtime"]},
        ]
    }


def _named_record(runtime_name: str) -> dict[str, Any]:
    """The record's `TurnRecord.named` (an expression): the runtime name the reservation sets
    and the name it replaces; None when it replaces none (a person's name stays)."""
    before = {
        "t": literal(runtime_name),
        "b": _kept("name", None),
        "s": _kept("name_source", None),
        "m": _kept("name_message_id", None),
    }
    return {"$cond": [_runtime_replaceable(), before, None]}


def name_restored(own: dict[str, Any]) -> dict[str, Any]:
    """The name, `name_source` and `name_message_id` once the turn whose record `own` (an
    expression on `$$record`) matches is stored nowhere: the name its reservation replaced
    (`TurnRecord.named`) while the name is still the runtime name it set, else as they are."""
    record = {"$arrayElemAt": [{"$filter": {"input": _TURNS, "as": "record", "cond": own}}, 0]}

    def named(key: str) -> dict[str, Any]:
        return {"$let": {"vars": {"r": record}, "in": {"$ifNull": [f"$$r.n.{key}", None]}}}

    set_by_it = named("t")
    guard = {
        "$and": [
            {"$ne": [set_by_it, None]},
            {"$eq": [_kept("name_source", None), "runtime"]},
            {"$eq": [_kept("name", None), set_by_it]},
        ]
    }
    return {
        "name": {"$cond": [guard, named("b"), _kept("name", None)]},
        "name_source": {"$cond": [guard, named("s"), _kept("name_source", None)]},
        "name_message_id": {"$cond": [guard, named("m"), _NAME_MESSAGE_KEPT]},
    }


def _names(plan: TurnPlan, runtime_name: str | None) -> dict[str, Any]:
    """Automatic names yield to a runtime's, and both to a person's (`name_source`). An
    automatic name records the message it is taken from (`name_message_id`), which a pop
    of that message reads (under a runtime's or a person's name it is left as it is, read
    by no pop: `name_source` is no longer "auto")."""
    name_is_unset = _NAME_IS_UNSET
    if runtime_name is not None:
        replaceable = _runtime_replaceable()
        return {
            "name": {"$cond": [replaceable, literal(runtime_name), "$name"]},
            "name_source": {"$cond": [replaceable, "runtime", "$name_source"]},
        }
    if plan.auto_name is not None:
        return {
            "name": {"$cond": [name_is_unset, literal(plan.auto_name), "$name"]},
            "name_source": {"$cond": [name_is_unset, "auto", "$name_source"]},
            "name_message_id": {
                "$cond": [name_is_unset, literal(plan.auto_name_from), _NAME_MESSAGE_KEPT]
            },
        }
    return _NAMES_KEPT


_EPOCH_MARKS = {
    "$cond": [
        {"$eq": [{"$ifNull": ["$created_at", None]}, None]},
        True,
        {"$ifNull": ["$epoch_marks", False]},
    ]
}
"""`Conversation.epoch_marks`: true on a conversation the turn creates, kept on one it finds
(false on one created before documents beside it named its epoch)."""

_NAME_IS_UNSET = {"$eq": [_kept("name", None), None]}
_NAMES_KEPT = {"name": _kept("name", None), "name_source": _kept("name_source", None)}
"""The parts of `_names` that no turn changes: built once, never changed in place (a
reservation's stage takes the items of `_NAMES_KEPT`, not the dict)."""


def reservation(
    plan: TurnPlan, actor: Actor, runtime_name: str | None, rules: TurnRules, now: datetime
) -> list[dict[str, Any]]:
    """The update pipeline that records one turn on its conversation document."""
    stage: dict[str, Any] = {
        "conversation_id": literal(plan.conversation_id),
        "user_id": _kept("user_id", actor.user_id),
        "created_at": _kept("created_at", plan.first_created_at),
        "epoch": _kept("epoch", new_epoch()),
        "epoch_marks": _EPOCH_MARKS,
        "updated_at": {"$max": ["$updated_at", literal(plan.updated_at)]},
        "turn_count": _plus("turn_count", plan.turn_starts),
        "message_count": _plus("message_count", plan.count),
        "usage.input_tokens": _capped("usage.input_tokens", plan.usage.input_tokens),
        "usage.output_tokens": _capped("usage.output_tokens", plan.usage.output_tokens),
        **_KEPT_OR_NULL,
        **_appended(plan, _released(plan)),
        **_records(
            plan,
            plan.digest,
            rules,
            now,
            person=actor.as_user,
            counted=counted(plan),
            named=None if runtime_name is None else _named_record(runtime_name),
        ),
        **_names(plan, runtime_name),
        **_assignment(actor),
        **_reopened(plan),
        **_asked_again(plan),
    }
    return [{"$set": stage}, {"$set": _after_reservation(plan)}]


def _after_reservation(plan: TurnPlan) -> dict[str, Any]:
    """The fields a reservation sets from what its first stage left, in one stage: each reads
    only fields that stage set, none a field another of them sets (a `$set` evaluates every
    field on the document it receives), so one stage sets what `calls_cut`,
    `RECORDS_DROPPED`, `blocks_moot_dropped` and `_superseded` would set one after the
    other (cutting `pending_calls` to its newest calls leaves it empty only where it was,
    what `blocks_moot_dropped` reads of it, and the calls the turn took off are those
    listed whole no more). Each stage costs a server a pass over the
    document: a reservation is the command every turn sends."""
    fields: dict[str, Any] = {**RECORDS_DROPPED["$set"], **blocks_moot_dropped(plan)["$set"]}
    for cut in calls_cut(plan):
        fields |= cut["$set"]
    if (superseded := _superseded(plan)) is not None:
        fields |= superseded
    return fields


_KEPT_OR_NULL: dict[str, Any] = {
    field: _kept(field, None)
    for field in ("forked_from", "legacy_conversation_id", "legacy_user_id")
}
"""Fields every reservation keeps as they are, null when unset: a document holds every key it
is served with. Built once, never changed in place."""


def _superseded(plan: TurnPlan) -> dict[str, Any] | None:
    """`approved_calls`, as the turn's own stage left them, with each approval of an earlier
    call whose id a call of the turn reuses superseded by the message making that call
    (`ApprovedCall.superseded_by`, the first such message kept): a denial of the id answers
    the new call, not the approved one. None for a turn making no call."""
    made = {
        str(call["id"]): str(document["_id"])
        for document in plan.documents
        for call in document.get("tool_calls") or ()
        if isinstance(call, Mapping) and isinstance(call.get("id"), str)
    }
    if not made:
        return None
    own = literal(sorted({str(d["_id"]) for d in plan.documents}))
    by_maker: dict[str, list[str]] = {}
    for call_id in sorted(made):
        by_maker.setdefault(made[call_id], []).append(call_id)
    makers = literal([{"m": maker, "c": ids} for maker, ids in by_maker.items()])
    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
    earlier = {"$eq": [{"$in": ["$$a.message_id", own]}, False]}
    reused = {"$and": [_NAMING_SOME, earlier, _NOT_SUPERSEDED]}
    # The approval's makers bound once (`$$naming`): counted, then the first taken.
    chosen = {"$cond": [reused, _FIRST_MAKER, _SUPERSEDED_BEFORE]}
    superseded_by = {"$let": {"vars": {"naming": _NAMING}, "in": chosen}}
    return approvals_superseded_by(superseded_by, bound={"makers": makers})


_NAMING = {
    "$filter": {"input": "$$makers", "as": "p", "cond": {"$in": ["$$a.tool_call_id", "$$p.c"]}}
}
"""The turn's makers (`$$makers`) of a call of the approval's (`$$a`) id (`_superseded`), bound
to `$$naming` for the parts below."""
_NAMING_SOME = {"$gt": [{"$size": "$$naming"}, 0]}
_FIRST_MAKER = {"$arrayElemAt": [{"$map": {"input": "$$naming", "as": "p", "in": "$$p.m"}}, 0]}
_SUPERSEDED_BEFORE = {"$ifNull": ["$$a.superseded_by", None]}
_NOT_SUPERSEDED = {"$eq": [_SUPERSEDED_BEFORE, None]}
"""The parts of `_superseded`'s expression that no turn changes: built once, never changed in
place."""


def _asked_again(plan: TurnPlan) -> dict[str, Any]:
    """`approved_calls` with the approvals of the calls the turn's prompts name held by them
    (`asked_again`: every prompt naming the call, in order, whether the turn then answers it
    or not) as the same prompts logged a turn each hold them: a question about an approved
    call holds it until it is answered itself, or is popped, or left out of a fork. The
    latest holds it (`held_by`); the prompt that held it before the turn, then the turn's
    earlier ones, are remembered (`held_before`, oldest first): a pop of the latest, or a
    fork cut before it, leaves the call held by the one before it. The approval stays
    recorded, so a refusal of the prompt that gave it, arriving later, still denies nothing.

    One flat expression whatever the number of names, the prompts looked up by call id in
    one constant (`$$asking`, written once); the turn's own prompts never remembered twice
    (the same turn applied again changes nothing)."""
    if not plan.asked_again:
        return {}
    held_by, held_before, bound = _asked_again_parts(plan)
    return approvals_held_by(held_by, held_before, bound=bound)


def asked_again_where_free(plan: TurnPlan, held: Collection[tuple[str, str]]) -> dict[str, Any]:
    """`_asked_again` (what the turn's reservation did to the approvals of the calls its
    prompts ask about again) for the entries of `held` (id, message making the call: those
    found free and given before the turn's block, `_logger._held_again`) no prompt holds
    whose call is pending: where a
    turn stalled past its block lands (`_relocated.hold_asked_again`), after a fold that
    found the block passed and empty took its holds back (`approvals_unstored`: its prompts
    were not stored then). An entry another prompt holds since, or whose call is answered
    since (off `pending_calls`), is left as it is: no call is held again past its answer.
    Applied twice, it changes nothing more."""
    if not plan.asked_again or not held:
        return {}
    held_by, held_before, bound = _asked_again_parts(plan)
    pending = {"$map": {"input": _kept("pending_calls", []), "as": "c", "in": _call_key("c")}}
    keys = literal([{"tool_call_id": c, "message_id": m} for c, m in sorted(held)])
    free = {
        "$and": [
            {"$eq": [held_by_a_prompt("a"), False]},
            {"$in": [_call_key("a"), pending]},
            {"$in": [_call_key("a"), keys]},
        ]
    }
    held_before = {"$cond": [free, held_before, held_before_of("a")]}
    return approvals_held_by({"$cond": [free, held_by, held_by_of("a")]}, held_before, bound=bound)


def approvals_landed_after(marked: Collection[tuple[str, str, str, str]]) -> dict[str, Any]:
    """`approved_calls` with the entries `marked` names (call id, message making it, request
    id) not marked yet given `landed_after` (the landed prompt's message id, the fourth),
    their other fields kept, as an expression; {} for none. Applied twice, it changes
    nothing more."""
    if not marked:
        return {}
    landed: Any = {"$ifNull": ["$$a.landed_after", None]}
    for call_id, message_id, request_id, prompt_id in sorted(marked):
        entry = {
            "$and": [
                {"$eq": ["$$a.tool_call_id", literal(call_id)]},
                {"$eq": ["$$a.message_id", literal(message_id)]},
                {"$eq": [{"$ifNull": ["$$a.request_id", None]}, literal(request_id)]},
                {"$eq": [{"$ifNull": ["$$a.landed_after", None]}, None]},
            ]
        }
        landed = {"$cond": [entry, literal(prompt_id), landed]}
    return _approvals_changed({"landed_after": landed})


def _asked_again_parts(
    plan: TurnPlan, answered: Callable[[Any], Any] | None = None
) -> tuple[Any, Any, dict[str, Any]]:
    """`_asked_again`'s `held_by` and `held_before` of each `approved_calls` entry (`$$a`), as
    expressions, and the variable they use (`$$asking`). `answered`: an expression on the
    request id of the last prompt naming the call (`$$asking`'s `r`, written for a move only)
    saying its answer reaches it, the approval then left as it is (`_moved_reach`)."""
    request_ids = {
        str(d["_id"]): m.hitl_action.request_id
        for m, d in zip(plan.messages, plan.documents, strict=True)
        if m.hitl_action is not None and answered is not None
    }
    asking = literal(
        [
            {"c": c, "m": list(prompts), "b": list(prompts[:-1])}
            | ({"r": request_ids[prompts[-1]]} if answered is not None else {})
            for c, prompts in plan.asked_again
        ]
    )
    bound: dict[str, Any] = {"asking": asking}
    naming = {
        "$filter": {
            "input": "$$asking",
            "as": "p",
            "cond": {"$eq": ["$$p.c", "$$a.tool_call_id"]},
        }
    }

    def of_the_turn(field: str) -> dict[str, Any]:
        found = {"$map": {"input": naming, "as": "p", "in": f"$$p.{field}"}}
        return {"$ifNull": [{"$arrayElemAt": [found, 0]}, literal([])]}

    asked, latest = of_the_turn("m"), {"$arrayElemAt": [of_the_turn("m"), -1]}
    named = {"$cond": [{"$gt": [{"$size": naming}, 0]}, _latest_of_its_id("a"), False]}
    if answered is not None:
        asked_under = {"$arrayElemAt": [{"$map": {"input": naming, "as": "p", "in": "$$p.r"}}, 0]}
        not_answered = {
            "$eq": [{"$let": {"vars": {"r": asked_under}, "in": answered("$$r")}}, False]
        }
        named = {"$and": [named, not_answered]}
    before = held_by_of("a")

    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
    def not_asked(value: Any) -> dict[str, Any]:
        return {"$eq": [{"$in": [value, asked]}, False]}

    earlier = {"$filter": {"input": held_before_of("a"), "as": "m", "cond": not_asked("$$m")}}
    # A one-element array built by `$map`: some servers (mongomock) keep an array literal's
    # elements unevaluated.
    handed_over = {"$and": [{"$ne": [before, None]}, not_asked(before)]}
    previous = {"$cond": [handed_over, {"$map": {"input": [0], "in": before}}, literal([])]}
    remembered = {"$concatArrays": [earlier, previous, of_the_turn("b")]}
    kept = {"$slice": [remembered, -HOLDING_PROMPTS_KEPT]}
    held_by = {"$cond": [named, latest, before]}
    return held_by, {"$cond": [named, kept, held_before_of("a")]}, bound


def _latest_of_its_id(variable: str) -> dict[str, Any]:
    """Whether the call of the `approved_calls` entry in `variable` is the latest pending call
    of its id, or none of its id is pending: the one a prompt naming the id holds
    (`_turns.holding_named`). An older call of the id a person approved is not: a prompt
    naming the id holds the newer one, and the approval stays in force."""
    same_id = {"$eq": ["$$call.tool_call_id", f"$${variable}.tool_call_id"]}
    calls = {"$ifNull": ["$pending_calls", literal([])]}
    of_id = {"$filter": {"input": calls, "as": "call", "cond": same_id}}
    last = {"$arrayElemAt": [of_id, -1]}
    latest = {"$let": {"vars": {"last": last}, "in": {"$ifNull": ["$$last.message_id", None]}}}
    return {"$or": [{"$eq": [latest, None]}, {"$eq": [latest, f"$${variable}.message_id"]}]}


def call_fields() -> dict[str, Any]:
    """Every key of the `PendingCall` in `$$call`, as an expression of each, for a `$map`
    to change some: `seq` null on a call listed before the list recorded it, as the model
    dumps it (a key a document lacks would go)."""
    fields: dict[str, Any] = {name: f"$$call.{name}" for name in PendingCall.model_fields}
    fields["seq"] = {"$ifNull": ["$$call.seq", None]}
    return fields


def _released(plan: TurnPlan) -> dict[str, Any] | None:
    """The pending calls before a turn that raises prompts, as an expression: those held by a
    prompt of one of their request ids that a person resolved (`resolved_hitl`) stored with
    `request_id: null`, released for good before the turn asks under that id anew
    (`_reopened`); None (those stored) when it raises none. The fold applies the same rule
    (`_turns.released_for_good`)."""
    if not plan.raised_requests:
        return None
    calls = {"$ifNull": ["$pending_calls", literal([])]}
    holder = {"$ifNull": ["$$call.request_id", None]}
    released = {
        "$and": [
            {"$in": [holder, literal(list(plan.raised_requests))]},
            {"$in": [holder, _kept("resolved_hitl", [])]},
        ]
    }
    fields = call_fields()
    fields["request_id"] = {"$cond": [released, None, holder]}
    return {"$map": {"input": calls, "as": "call", "in": fields}}


def _reopened(plan: TurnPlan) -> dict[str, Any]:
    """`resolved_hitl` without the request ids of the prompts the turn raises: a runtime that
    numbers its confirmations per turn asks under an id answered before, and the new prompt
    holds its calls until it is answered itself."""
    if not plan.raised_requests:
        return {}
    asked = literal(list(plan.raised_requests))
    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
    kept = {"$eq": [{"$in": ["$$r", asked]}, False]}
    reopened = {"$filter": {"input": _kept("resolved_hitl", []), "as": "r", "cond": kept}}
    return {"resolved_hitl": absent_stays("resolved_hitl", reopened)}


def _appended(plan: TurnPlan, calls: Any = None) -> dict[str, Any]:
    """The summary a turn appended at the end sets, whatever came before it: `updated_at`,
    the preview, and what it leaves pending (from `calls`, the pending calls as they stand
    by default). Set by its reservation, and again when it moves to a new block at the end
    (`relocation`), where it then is."""
    return {
        "updated_at": {"$max": ["$updated_at", literal(plan.updated_at)]},
        "last_message_preview": (
            literal(plan.preview) if plan.preview is not None else _kept("last_message_preview", "")
        ),
        **_pending_state(plan, calls),
    }


def _assignment(actor: Actor) -> dict[str, Any]:
    """`owned_from`: the `seq` from which the conversation has an owner, set by the turn that
    assigns an owner to an unowned conversation holding messages (a service naming a user):
    the turn's first `seq`. Its messages before it, logged unowned, then move to the owner
    (`AgentMessageLogger._hand_over_earlier`). Left as it is (absent on most conversations)
    by every other turn; only a service naming a user can assign one."""
    if actor.strict or actor.user_id is None:
        return {}
    return {"owned_from": _ASSIGNED_FROM}


_ASSIGNED_FROM = {
    "$cond": [
        {
            "$and": [
                {"$eq": [{"$ifNull": ["$user_id", None]}, None]},
                {"$gt": [{"$ifNull": ["$message_count", 0]}, 0]},
            ]
        },
        int64("$message_count"),
        absent_stays("owned_from", "$owned_from"),
    ]
}
"""`owned_from` as a turn of a service naming a user sets it (`_assignment`): one expression
for every such turn, built once and never changed in place."""


_PENDING_CALLS = {"$ifNull": ["$pending_calls", literal([])]}
_PENDING_HITL = {"$ifNull": ["$pending_hitl", None]}
"""The pending calls and prompt as they stand (`_pending_state`): built once, never changed in
place."""


def _pending_state(plan: TurnPlan, calls: Any = None) -> dict[str, Any]:
    """`pending_calls` and `pending_hitl` after the turn, in the reservation's `$set` stage,
    by the rules of `_turns.pending_after` (its `_fold`), as expressions; `calls` are the
    pending calls before it (those stored, by default).

    Each answer takes the latest pending call of its id and the calls the turn leaves open
    join the list (the newest `PENDING_CALLS_KEPT` are kept), each listed once: an entry of
    the same call before (`_listed_once`) leaves. A prompt stays pending unless
    the turn raises a new one, clears it (an upload), or answers what it awaits: a call it
    held back, or, holding none, the last held call pending (`_turns.answers_clear`).
    The ids answered are one constant per field (`$$answered`), whatever their number.
    """
    if calls is None:
        calls = _PENDING_CALLS
    hitl: Any = _PENDING_HITL
    if not isinstance(plan.pending_hitl, KeepPendingHitl):
        hitl = literal(plan.pending_hitl and plan.pending_hitl.model_dump())
    if not (plan.answered_calls or plan.opened_calls or plan.named_holds) and (
        plan.holds_pending is None
    ):
        return {"pending_calls": calls, "pending_hitl": hitl}
    calls, bound = _listed_once(plan, calls)

    def answered(wanted: bool) -> dict[str, Any]:
        # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
        cond = {"$eq": [_taken(calls, plan.answered_calls), wanted]}
        return {"$filter": {"input": calls, "as": "call", "cond": cond}}

    if isinstance(plan.pending_hitl, KeepPendingHitl) and plan.answered_calls:
        clears = _answering(plan, answers_clear(calls, answered(True), answered(False)))
        hitl = {"$cond": [bound(clears), None, hitl]}
    elif _clears_its_prompt(plan):
        was_held = {
            "$and": [
                {"$in": ["$$call.tool_call_id", literal(sorted(set(plan.answered_after_prompt)))]},
                {"$eq": [{"$ifNull": ["$$call.request_id", None]}, None]},
            ]
        }
        held = {"$filter": {"input": answered(True), "as": "call", "cond": was_held}}
        hitl = {"$cond": [bound(_answering(plan, {"$gt": [{"$size": held}, 0]})), None, hitl]}
    left = _holding_named(_held_by(answered(False), plan.holds_pending), plan.named_holds)
    every = {"$concatArrays": [left, _opened(plan)]}  # cut by the next stage (`calls_cut`)
    state = {"pending_calls": bound(_answering(plan, every)), "pending_hitl": hitl}
    if len(plan.opened_calls) > PENDING_CALLS_KEPT:
        state[PUSHED_OFF] = _pushed_off_by(plan)
    return state


def _listed_once(plan: TurnPlan, calls: Any) -> tuple[Any, Callable[[Any], Any]]:
    """The pending calls before the turn, `calls` (an expression), as the expressions of its
    pending state read them (`$$listed`), and what binds them around such an expression:
    without an entry of a call the turn leaves open (`_opened`: the same id, made by the same
    message), so that call is listed once, where the turn lists it now, whatever listed it
    before (an earlier reservation of the turn, its insert lost, or the block it moves from).
    `calls` as they are, and nothing bound, for a turn leaving no call open
    (`_turns.listed_once`, the fold's rule)."""
    if not plan.opened_calls:
        return calls, lambda expression: expression
    opened = plan.opened_calls[-PENDING_CALLS_KEPT:]  # those `_opened` lists
    keys = literal([{"tool_call_id": c.tool_call_id, "message_id": c.message_id} for c in opened])
    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
    others = {"$eq": [{"$in": [_call_key("call"), keys]}, False]}
    listed = {"$filter": {"input": calls, "as": "call", "cond": others}}
    return "$$listed", lambda expression: {"$let": {"vars": {"listed": listed}, "in": expression}}


def calls_cut(plan: TurnPlan) -> list[dict[str, Any]]:
    """The stage that follows the one setting a turn's pending state (`_pending_state`, in
    its reservation or its move): the calls pending after it, listed whole there (oldest
    first), cut to the newest `PENDING_CALLS_KEPT`, and `calls_pushed_off` marking the newest
    cut (`pushed_off_mark`), unless the turn itself leaves more calls open than that (its
    own older ones pushed off, marked by that stage, `_pushed_off_by`, the ids of those
    pushed off named here: `_own_cut_named`). None for a turn
    leaving no call open: the list does not grow. A stage of its own, so the command names
    the calls a turn answers no more often than the list needs."""
    if not plan.opened_calls:
        return []
    cut: dict[str, Any] = {"pending_calls": {"$slice": ["$pending_calls", -PENDING_CALLS_KEPT]}}
    if len(plan.opened_calls) <= PENDING_CALLS_KEPT:
        cut[PUSHED_OFF] = pushed_off_mark("$pending_calls")
    else:
        cut[PUSHED_OFF] = _own_cut_named(plan)
    return [{"$set": cut}]


def _pushed_off_by(plan: TurnPlan) -> dict[str, Any]:
    """`calls_pushed_off` for a turn leaving more calls open than `PENDING_CALLS_KEPT`: it
    pushes its own older ones off (never listed), and the mark names the newest of those,
    made by this turn (its record's order, `TurnRecord.order`, is below the mark's). The ids
    it named are kept here, those pushed off appended by the next stage (`_own_cut_named`)."""
    opened = plan.opened_calls
    places = {str(document["_id"]): i for i, document in enumerate(plan.documents)}
    newest_unlisted = places.get(opened[-PENDING_CALLS_KEPT - 1].message_id, 0)
    made_at = {"$add": [{"$ifNull": ["$message_count", 0]}, newest_unlisted]}
    order = int64({"$add": [_APPENDED_BEFORE, 1]})
    return {"o": order, "s": int64(made_at), "i": {"$ifNull": [f"${PUSHED_OFF}.i", literal([])]}}


def _own_cut_named(plan: TurnPlan) -> dict[str, Any]:
    """`calls_pushed_off` set by `_pushed_off_by`, in the stage cutting `pending_calls` (still
    whole there, `calls_cut`), with the ids of the calls the turn pushed off appended
    (`_ids_kept`): every call listed before its own (the list's oldest, past the newest
    `PENDING_CALLS_KEPT`), then its own it never listed, from its plan (the newest
    `PENDING_CALLS_KEPT` of those at most: the command names no more of them)."""
    unlisted = plan.opened_calls[-2 * PENDING_CALLS_KEPT : -PENDING_CALLS_KEPT]
    own = literal([call.tool_call_id for call in unlisted])
    mark = {"o": f"${PUSHED_OFF}.o", "s": f"${PUSHED_OFF}.s"}
    return {**mark, "i": _ids_kept({"$concatArrays": [_cut_ids("$pending_calls"), own]})}


def _cut_ids(every: Any) -> dict[str, Any]:
    """The ids of the pending calls `every` (an expression, oldest first) that cutting them
    to the newest `PENDING_CALLS_KEPT` takes off, oldest first: those no call kept has (an id
    listed again is named by the list: its answer never asks what the bound pushed off).
    Told by id, not by place: some servers (mongomock) take no computed count for `$slice`."""
    newest = {"$slice": [every, -PENDING_CALLS_KEPT]}
    kept = {"$map": {"input": newest, "as": "call", "in": "$$call.tool_call_id"}}
    ids = {"$map": {"input": every, "as": "call", "in": "$$call.tool_call_id"}}
    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
    off = {"$eq": [{"$in": ["$$id", "$$kept"]}, False]}
    cut = {"$filter": {"input": ids, "as": "id", "cond": off}}
    return {"$let": {"vars": {"kept": kept}, "in": cut}}


def _ids_kept(cut: Any) -> dict[str, Any]:
    """The ids `calls_pushed_off` keeps once the calls whose ids are `cut` (an expression,
    oldest first) are pushed off: appended to those it named (none on a mark set before marks
    named them), the newest `PENDING_CALLS_KEPT` kept."""
    named = {"$ifNull": [f"${PUSHED_OFF}.i", literal([])]}
    return {"$slice": [{"$concatArrays": [named, cut]}, -PENDING_CALLS_KEPT]}


PUSHED_OFF = "calls_pushed_off"
"""The conversation's mark of the newest call the bound of `pending_calls` pushed off in
this life (the store's bookkeeping, never served; absent while none was): `o`, how many turn
records were appended before the update that pushed it off (every turn reserved before it
has a lower `TurnRecord.order`), `s`, the `seq` of the message that made it (null for a
call listed before the list recorded it: `PendingCall.seq`), and `i`, the ids of the newest
`PENDING_CALLS_KEPT` calls pushed off in this life, oldest first (`CallsPushedOff`): only an
answer to one of those may be to a call a turn still being written lost. A call a turn still being
written left open is off the list by the bound only if that turn reserved before the mark
and its block starts at or below `s` (`_logger._pushed_off_maybe`): every call listed after
its own was made later, at a `seq` past its block's first while it is still being written
(no pop reads below it then), and the mark only moves to calls listed later."""

_APPENDED_BEFORE = int64(
    {"$add": [{"$ifNull": ["$turns_dropped", 0]}, {"$size": {"$ifNull": ["$turns", []]}}]}
)
"""How many turn records the conversation appended before the update it is evaluated in
(the order the next record appended gets, `TurnRecord.order`); built once, never changed in
place."""


def pushed_off_mark(every: Any) -> dict[str, Any]:
    """`calls_pushed_off` once the pending calls `every` (an expression, oldest first) are cut
    to the newest `PENDING_CALLS_KEPT`, as an expression evaluated after the turn's record
    was appended (`calls_cut`): the mark of the newest call cut off when some are
    (`PUSHED_OFF`; its order the record's, the last; the ids of those cut off appended to
    those it named, `_ids_kept`), else the mark as it is (absent while absent)."""
    cut = {"$subtract": [{"$size": "$$every"}, PENDING_CALLS_KEPT]}
    newest = {"$arrayElemAt": ["$$every", {"$subtract": ["$$cut", 1]}]}
    seq = {"$let": {"vars": {"call": newest}, "in": {"$ifNull": ["$$call.seq", None]}}}
    order = {"$let": {"vars": {"record": {"$arrayElemAt": ["$turns", -1]}}, "in": "$$record.o"}}
    mark = {"o": int64(order), "s": seq, "i": _ids_kept(_cut_ids("$$every"))}
    kept = absent_stays(PUSHED_OFF, f"${PUSHED_OFF}")
    marked = {"$let": {"vars": {"cut": cut}, "in": {"$cond": [{"$gt": ["$$cut", 0]}, mark, kept]}}}
    return {"$let": {"vars": {"every": every}, "in": marked}}


def _opened(plan: TurnPlan) -> dict[str, Any]:
    """The calls the turn leaves open, as an expression, each with the `seq` of the message
    making it (`PendingCall.seq`): the turn's first `seq` (`message_count` before it, at the
    end where the turn reserves or moves) plus that message's place in the turn. They join
    the list after the calls before them, as they were made. Only the newest
    `PENDING_CALLS_KEPT` are listed: the command names no more of them."""
    places = {str(document["_id"]): i for i, document in enumerate(plan.documents)}
    listed = literal(
        [
            {"call": call.model_dump(), "i": places.get(call.message_id)}
            for call in plan.opened_calls[-PENDING_CALLS_KEPT:]
        ]
    )
    fields: dict[str, Any] = {name: f"$$c.call.{name}" for name in PendingCall.model_fields}
    fields["seq"] = int64({"$add": [{"$ifNull": ["$message_count", 0]}, "$$c.i"]})
    # Built by `$map`: some servers (mongomock) keep an array literal's elements unevaluated.
    return {"$map": {"input": listed, "as": "c", "in": fields}}


def held_calls_kept(plan: TurnPlan) -> dict[str, Any]:
    """A filter matching a conversation where the turn's calls push no call a prompt holds,
    no answer having released it (`resolved_hitl`, `approved_calls`), off `pending_calls`
    (the newest `PENDING_CALLS_KEPT`, `_pending_state`): an answer to a prompt releases the
    calls the list holds, so one it dropped would stay held where no approval reaches it."""
    calls, bound = _listed_once(plan, {"$ifNull": ["$pending_calls", literal([])]})
    same = {"$eq": [_taken(calls, plan.answered_calls), False]}
    left = {"$filter": {"input": calls, "as": "call", "cond": same}}
    left = _holding_named(_held_by(left, plan.holds_pending), plan.named_holds)
    opened = literal([call.model_dump() for call in plan.opened_calls[-PENDING_CALLS_KEPT:]])
    every = {"$concatArrays": [left, opened]}
    # What the list keeps, by key (a call's message and id tell it from every other): a
    # constant count, which every server takes in `$slice`.
    kept = {"$slice": ["$$every", -PENDING_CALLS_KEPT]}
    kept_keys = {"$map": {"input": kept, "as": "k", "in": _call_key("k")}}
    holder = {"$ifNull": ["$$call.request_id", None]}
    held = {
        "$and": [
            {"$eq": [{"$in": [_call_key("call"), kept_keys]}, False]},
            {"$ne": [holder, None]},
            {"$eq": [{"$in": [holder, _kept("resolved_hitl", [])]}, False]},
            {"$eq": [{"$in": [_call_key("call"), _approval_keys(held_again=False)]}, False]},
        ]
    }
    unreleased = {"$filter": {"input": "$$every", "as": "call", "cond": held}}
    count = {"$let": {"vars": {"every": every}, "in": {"$size": unreleased}}}
    return {"$expr": bound(_answering(plan, {"$eq": [count, 0]}))}


def _answering(plan: TurnPlan, expression: dict[str, Any]) -> dict[str, Any]:
    """`expression`, which may look a call up among those the turn answers (`_taken`), with
    their ids bound to `$$answered`: once, sorted, each id once."""
    if not plan.answered_calls:
        return expression
    answered = literal(sorted(set(plan.answered_calls)))
    return {"$let": {"vars": {"answered": answered}, "in": expression}}


def answers_clear(calls: Any, taken: Any, left: Any) -> dict[str, Any]:
    """Whether the turn's answers (`taken` from `calls`, `left` after) clear the pending
    prompt (`_turns.answers_clear`, as an expression): in its reservation, and where a turn
    stalled past its block lands (`_relocated.answered_calls_off`)."""
    pending = {"$ifNull": ["$pending_hitl.request_id", None]}

    def holders(of: Any) -> dict[str, Any]:
        return {"$map": {"input": of, "as": "call", "in": {"$ifNull": ["$$call.request_id", None]}}}

    def held(of: Any) -> dict[str, Any]:
        return {"$filter": {"input": holders(of), "as": "r", "cond": {"$ne": ["$$r", None]}}}

    holds_none = {"$eq": [{"$in": [pending, holders(calls)]}, False]}
    last_held = {
        "$and": [
            holds_none,
            {"$gt": [{"$size": held(taken)}, 0]},
            {"$eq": [{"$size": held(left)}, 0]},
        ]
    }
    return {"$or": [{"$in": [pending, holders(taken)]}, last_held]}


def _clears_its_prompt(plan: TurnPlan) -> bool:
    """Whether the turn's prompt may be cleared by an answer the turn gives after it, to an
    earlier call the prompt holds (`_turns.answered_after_prompt`)."""
    prompt = plan.pending_hitl
    return (
        isinstance(prompt, PendingHitl)
        and prompt.request_id == plan.holds_pending
        and bool(plan.answered_after_prompt)
    )


def _taken(calls: Any, answered: Sequence[str]) -> Any:
    """Whether `$$call` is one the turn's answers take: for each id answered (`$$answered`,
    bound by `_answering`), the latest pending call of that id (`_turns.taking_answers`).
    One expression whatever the number of answers: it looks the call's id up among them and
    compares the call with the latest of its id, never each answer with each call."""
    if not answered:
        return False
    same_id = {"$eq": ["$$other.tool_call_id", "$$call.tool_call_id"]}
    of_id = {"$filter": {"input": calls, "as": "other", "cond": same_id}}
    latest = {"$let": {"vars": {"last": {"$arrayElemAt": [of_id, -1]}}, "in": "$$last.message_id"}}
    return {
        "$and": [
            {"$in": ["$$call.tool_call_id", "$$answered"]},
            {"$eq": ["$$call.message_id", latest]},
        ]
    }


def _held_by(calls: Any, request_id: str | None) -> Any:
    """`calls` once a prompt raised before any call of its turn holds those no prompt holds
    (`_turns.held_by`, as an expression); `calls` as they are without one."""
    if request_id is None:
        return calls
    fields = call_fields()
    fields["request_id"] = {"$ifNull": ["$$call.request_id", literal(request_id)]}
    return {"$map": {"input": calls, "as": "call", "in": fields}}


def _holding_named(calls: Any, named: Sequence[tuple[str, str]]) -> Any:
    """`calls` once the prompts naming calls of earlier turns hold them (`_turns.holding_named`,
    as an expression): the latest of each id named is held by the prompt that named it.

    One flat expression whatever the number of names (a nested one per name would pass
    BSON's nesting limit), the names one constant (`$$holders`): each request id once, with
    the ids it holds."""
    if not named:
        return calls
    by_holder: dict[str, list[str]] = {}
    for call_id, by in dict(named).items():
        by_holder.setdefault(by, []).append(call_id)
    holders = literal([{"r": by, "c": ids} for by, ids in by_holder.items()])
    naming = {
        "$filter": {
            "input": "$$holders",
            "as": "p",
            "cond": {"$in": ["$$call.tool_call_id", "$$p.c"]},
        }
    }
    same_id = {"$eq": ["$$other.tool_call_id", "$$call.tool_call_id"]}
    of_id = {"$filter": {"input": "$$held", "as": "other", "cond": same_id}}
    latest = {"$let": {"vars": {"last": {"$arrayElemAt": [of_id, -1]}}, "in": "$$last.message_id"}}
    holder = {"$arrayElemAt": [{"$map": {"input": naming, "as": "p", "in": "$$p.r"}}, 0]}
    named_here = {"$and": [{"$gt": [{"$size": naming}, 0]}, {"$eq": ["$$call.message_id", latest]}]}
    fields = call_fields()
    fields["request_id"] = {"$cond": [named_here, holder, {"$ifNull": ["$$call.request_id", None]}]}
    mapped = {"$map": {"input": "$$held", "as": "call", "in": fields}}
    return {"$let": {"vars": {"held": calls, "holders": holders}, "in": mapped}}


_RECORD_DEFAULTS: dict[str, Any] = {
    f.alias or name: None if f.is_required() else f.default
    for name, f in TurnRecord.model_fields.items()
}
"""Each field of a turn record, by its stored key, with what a record lacking it says (its
model default; None for the fields every record holds)."""


def _record_field(key: str) -> Any:
    """A field of `$$record` as a record rewritten holds it: as it is, or, when the record
    lacks it or holds null (one the migration rebuilt from its messages, one kept before
    records said so, one an earlier release rewrote), its default (`TurnRecord`)."""
    default = _RECORD_DEFAULTS[key]
    return {"$ifNull": [f"$$record.{key}", literal(default)]}


def records_changed(matching: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """The conversation's turn records, as an expression: those `matching` (an expression on
    `$$record`) with the fields `changes` names set to its expressions, the rest as they are,
    the record written whole (`_record_field`): a field it lacks is never written as null
    where a record must say a value, so any record rewritten validates as it did."""
    kept = {key: _record_field(key) for key in _RECORD_DEFAULTS if key not in changes}
    changed = {"$cond": [matching, {**kept, **changes}, "$$record"]}
    return {"$map": {"input": _kept("turns", []), "as": "record", "in": changed}}


def moved_key(key: int) -> int:
    """What a turn record's key becomes once its turn moved to a new block (`relocation`):
    no turn's key, so the record only marks the passed block."""
    return ~key


def relocation(
    plan: TurnPlan,
    block: RecordedBlock,
    rules: TurnRules,
    now: datetime,
    *,
    assigned: bool,
    asked: Mapping[str, int] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The filter and update that move a recorded turn, none of whose messages is stored,
    from a block tail readers have passed (`block_abandoned`) to a new one at the end.

    The old record stays under `moved_key`, so readers keep passing its block, and its `seq`s
    are gaps no turn holds (`popped_seqs`, `_left_behind`); the turn is recorded again at the
    new block, with the digest and extent it was recorded with. Its messages and tokens were
    counted when it first reserved: `message_count` grows, the turns and tokens counted stay
    (and `owned_from` follows the turn that `assigned` the conversation its owner). The turn is
    now the last one, so the summary follows it as it follows a turn appended there
    (`_appended`: `updated_at`, the preview, what it leaves pending), computed on the
    conversation as it stands now: the calls the turn left open when it first reserved are
    listed once, in their new place, and a prompt it raises that a person resolved meanwhile
    (`resolved_hitl`) is not raised again: the answer reaches its new place unless the id was
    asked after it (`_moved_reach`; `asked`: `asked_past`). That pending state is a first
    estimate: after the insert the logger folds it from the stored messages
    (`_relocated.settle`), kept only when that cannot be done. The filter matches only while the
    old record is there and no delete has begun (`NOT_BEING_DELETED`): a second attempt moving
    the turn at the same time matches nothing, and finds the new block by the turn's record; a
    retry finding the conversation marked is refused (`being_deleted`)."""
    key, first = literal(Int64(plan.key)), literal(Int64(block.first_seq))
    query = {
        **conversation_by_id(plan.conversation_id),
        "turns": {"$elemMatch": {"k": Int64(plan.key), "f": Int64(block.first_seq)}},
        **NOT_BEING_DELETED,
    }
    old = {"$and": [{"$eq": ["$$record.k", key]}, {"$eq": ["$$record.f", first]}]}
    turns = records_changed(old, {"k": literal(Int64(moved_key(plan.key))), "m": literal(True)})
    stage = {
        "message_count": _plus("message_count", plan.count),
        "popped_seqs": _left_behind(block.first_seq, plan.count),
        **_appended(plan),
        **_records(
            plan,
            block.digest,
            rules,
            now,
            turns,
            person=block.by_person,
            counted=block.counted,
        ),
    }
    if plan.raised_requests:  # an answer that came while it waited answered its prompts
        stage.update(_moved_reach(plan, block.first_seq, asked or {}))
    if isinstance(plan.pending_hitl, PendingHitl):
        resolved = resolved_by_request(plan.pending_hitl.request_id)
        kept = {"$ifNull": ["$pending_hitl", None]}
        stage["pending_hitl"] = {"$cond": [resolved, kept, stage["pending_hitl"]]}
    if assigned:
        stage["owned_from"] = int64({"$ifNull": ["$message_count", 0]})
    return query, [{"$set": stage}, blocks_moot_dropped(plan), *calls_cut(plan), RECORDS_DROPPED]


def move_undone(
    plan: TurnPlan, left_seq: int, moved_seq: int, same: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The filter and update that undo the move of the turn from its block at `left_seq` to
    the one at `moved_seq` (`relocation`) once the turn is found stored in the block it left
    (an attempt stalled inside its insert landed there): the turn is where its messages are.
    The block the move took, never written, is given back (its `seq`s gaps no turn holds, its
    record naming the turn no more: `moved_key`, marked given up, as `given_back` leaves it),
    and the block left is the turn's again (its record under the turn's key, its `seq`s gaps
    no more: a stored message's `seq` is never one). What the turn counted stays: its first
    reservation counted it, a move counts nothing. Matches only the conversation the turn
    reserved on (`same`), once: while it records that move, and no delete has begun."""
    key, moved = Int64(plan.key), Int64(moved_key(plan.key))
    left, taken = Int64(left_seq), Int64(moved_seq)
    query = {
        **same,
        **NOT_BEING_DELETED,
        "$and": [
            {"turns": {"$elemMatch": {"k": key, "f": taken}}},
            {"turns": {"$elemMatch": {"k": moved, "f": left, "g": {"$ne": True}}}},
        ],
    }

    def record(k: Int64, f: Int64) -> dict[str, Any]:
        return {"$and": [{"$eq": ["$$record.k", literal(k)]}, {"$eq": ["$$record.f", literal(f)]}]}

    outside = {"$or": [{"$lt": ["$$gap", left]}, {"$gte": ["$$gap", left_seq + plan.count]}]}
    gaps = {"$filter": {"input": _kept("popped_seqs", []), "as": "gap", "cond": outside}}
    given = {"k": literal(moved), "g": literal(True), "m": literal(True)}
    own = {"k": literal(key), "m": literal(False)}
    return query, [
        {"$set": {"popped_seqs": _left_behind(moved_seq, plan.count, gaps)}},
        {"$set": {"turns": records_changed(record(key, taken), given)}},
        {"$set": {"turns": records_changed(record(moved, left), own)}},
    ]


def give_up_undone(
    plan: TurnPlan,
    first_seq: int,
    same: dict[str, Any],
    taken: tuple[int, int, int] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The filter and update that undo the give-up of the turn's block at `first_seq`
    (`given_up`) once the turn is found stored whole there (an attempt stalled between its
    check and its insert past the margin landed after a retry gave the turn up for good,
    `Unmovable`): the turn is where its messages are. What the give-up took back (`taken`,
    as it took it: what the record says, else what the turn counts) is counted again, the
    block's `seq`s are gaps no more (a stored message's `seq` is never one), and its record
    is the turn's given up no more. Matches only the conversation the turn reserved on
    (`same`), once: while the record says given up, and no delete has begun; and only
    while the block is still what the give-up left, its `seq`s gaps below the end: pops
    since that passed the gaps (giving them back, `popped_seqs`, and marking the record
    popped, `TurnRecord.popped`) leave the block the turn's no more (`blocks_held`), so a
    turn landing there is past what they left, never counted again, even once a later
    turn's reservation took the `seq`s and was given up there in turn."""
    key, first = Int64(plan.key), Int64(first_seq)
    block = [Int64(seq) for seq in range(first_seq, first_seq + plan.count)]
    query = {
        **same,
        **NOT_BEING_DELETED,
        "turns": {"$elemMatch": {"k": key, "f": first, "g": True, "p": {"$ne": True}}},
        "popped_seqs": {"$all": block},
        "message_count": {"$gte": Int64(first_seq + plan.count)},
    }
    own = {"$and": [{"$eq": ["$$record.k", literal(key)]}, {"$eq": ["$$record.f", literal(first)]}]}
    outside = {"$or": [{"$lt": ["$$gap", first]}, {"$gte": ["$$gap", first_seq + plan.count]}]}
    starts, input_tokens, output_tokens = taken or counted(plan)
    stage = {
        "turn_count": _plus("turn_count", starts),
        "usage.input_tokens": _capped("usage.input_tokens", input_tokens),
        "usage.output_tokens": _capped("usage.output_tokens", output_tokens),
        "popped_seqs": {
            "$filter": {"input": _kept("popped_seqs", []), "as": "gap", "cond": outside}
        },
        "turns": records_changed(own, {"g": literal(False)}),
    }
    return query, [{"$set": stage}]


def _moved_reach(plan: TurnPlan, first: int, asked: Mapping[str, int]) -> dict[str, Any]:
    """`answered_prompts`, `resolved_hitl` and `approved_calls` as a move of the turn from its
    block at `first` to the end sets them. An answer to one of the turn's request ids that
    came while it waited answered its prompt and reaches its new block (`_carried`), but
    only over prompts of the id asked before the answer; naming calls, it released only
    those, and the id is resolved no more while the prompt holds another
    (`_moved_resolutions`). Else it keeps its reach, and the moved prompt asks again: the
    calls of the turn it holds, released by the answer meanwhile, are held by it again
    (`ApprovedCall.held_by`), as the fold of the stored messages holds them."""
    moved_end = int64({"$add": [{"$ifNull": ["$message_count", 0]}, plan.count]})
    waited = _carried("$$a.r", "$$s", first, asked)
    reach = answers_reaching({"$cond": [waited, moved_end, "$$s"]}, plan.raised_requests)
    reach |= _moved_resolutions(plan, first, asked)

    def answered(request_id: Any) -> dict[str, Any]:
        reaching = _carried(request_id, "$$x.s", first, asked, answer="$$x.r")
        answers = {"$filter": {"input": _kept("answered_prompts", []), "as": "x", "cond": reaching}}
        return {"$gt": [{"$size": answers}, 0]}

    holders = _own_holders(plan)
    held_by: Any = held_by_of("a")
    held_before: Any = held_before_of("a")
    bound: dict[str, Any] = {}
    if plan.asked_again:
        held_by, held_before, bound = _asked_again_parts(plan, answered)
    if holders:
        held_by, bound = _own_held_by(held_by, answered), {**bound, "holders": literal(holders)}
    if not bound:
        return reach
    return reach | approvals_held_by(held_by, held_before, bound=bound)


def _moved_resolutions(plan: TurnPlan, first: int, asked: Mapping[str, int]) -> dict[str, Any]:
    """`resolved_hitl` as a move of the turn from its block at `first` to the end sets it: an
    id stays resolved only while every call of the turn its prompts hold (`_own_holders`) is
    released by an answer reaching the new block (`_carried`) that named it, or named none
    (`_turns.names_call`): an answer naming other calls left it held, and the id is
    answered once none of its prompts' calls is left unreleased (`_turns.Folded.answered_one`).
    The fold after the insert (`_relocated.settle`) sets the same; this holds until it does."""
    holders = _own_holders(plan)
    if not holders:
        return {}

    def names(entry: str) -> dict[str, Any]:
        call, message = {"$arrayElemAt": [entry, 0]}, {"$arrayElemAt": [entry, 1]}
        by_message = {"$or": [{"$eq": [message, None]}, {"$eq": [message, "$$h.m"]}]}
        return {"$and": [{"$eq": [call, "$$h.c"]}, by_message]}

    named = {"$filter": {"input": {"$ifNull": ["$$x.c", []]}, "as": "n", "cond": names("$$n")}}
    releases = {
        "$and": [
            _carried("$$h.r", "$$x.s", first, asked, answer="$$x.r"),
            {
                "$or": [
                    {"$eq": [{"$ifNull": ["$$x.c", None]}, None]},
                    {"$gt": [{"$size": named}, 0]},
                ]
            },
        ]
    }
    releasing = {"$filter": {"input": _kept("answered_prompts", []), "as": "x", "cond": releases}}
    held = {"$filter": {"input": literal(holders), "as": "h", "cond": {"$eq": [releasing, []]}}}
    still = {"$map": {"input": held, "as": "h", "in": "$$h.r"}}
    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
    kept = {"$eq": [{"$in": ["$$r", still]}, False]}
    left = {"$filter": {"input": _kept("resolved_hitl", []), "as": "r", "cond": kept}}
    return {"resolved_hitl": absent_stays("resolved_hitl", left)}


def _own_held_by(otherwise: Any, answered: Callable[[Any], Any]) -> dict[str, Any]:
    """The `held_by` of an `approved_calls` entry (`$$a`) releasing a call of the moved turn:
    the prompt holding it in the turn (`$$holders`, `_own_holders`) when no answer reaches
    its new place (`answered`), else as it is; `otherwise` for an entry of another call."""
    mine = {
        "$filter": {
            "input": "$$holders",
            "as": "h",
            "cond": {
                "$and": [
                    {"$eq": ["$$h.c", "$$a.tool_call_id"]},
                    {"$eq": ["$$h.m", "$$a.message_id"]},
                ]
            },
        }
    }
    holder = {"$arrayElemAt": [mine, 0]}
    again = {"$cond": [answered("$$h.r"), held_by_of("a"), "$$h.p"]}
    return {
        "$cond": [
            {"$gt": [{"$size": mine}, 0]},
            {"$let": {"vars": {"h": holder}, "in": again}},
            otherwise,
        ]
    }


def _carried(
    request_id: Any, reach: Any, first: int, asked: Mapping[str, int], *, answer: Any = None
) -> dict[str, Any]:
    """Whether an answer to the prompt `request_id` (expressions) of reach `reach` (its `s`)
    answers the moved turn's prompt of that id at its new block: it came while the turn
    waited (past `first`), after every prompt of the id stored past the turn's block
    (`asked`, the latest, by request id), and no turn raised the id since the last answer to
    it (still in `resolved_hitl`, which a turn raising it leaves). `answer`: the answer's
    request id, when not `request_id` itself."""
    latest: Any = literal(Int64(first))
    for raised, seq in asked.items():
        later = literal(Int64(max(first, seq)))
        latest = {"$cond": [{"$eq": [request_id, literal(raised)]}, later, latest]}
    conds = [{"$gt": [reach, latest]}, {"$in": [request_id, _kept("resolved_hitl", [])]}]
    if answer is not None:
        conds.append({"$eq": [answer, request_id]})
    return {"$and": conds}


def _own_holders(plan: TurnPlan) -> list[dict[str, str]]:
    """The turn's own calls its prompts hold (`_turns._holders`): `{c: call id, m: the
    message making it, r: the request id holding it, p: the holding prompt's message}`, of
    those its reservation listed pending only (the newest `PENDING_CALLS_KEPT`): no answer
    approved another, and the move's command names no more of them."""
    made: dict[str, str] = {}
    held: dict[str, tuple[str, str]] = {}
    for message, document in zip(plan.messages, plan.documents, strict=True):
        made |= {call.id: str(document["_id"]) for call in message.tool_calls or ()}
        action = message.hitl_action
        if action is None:
            continue
        prompt = (action.request_id, str(document["_id"]))
        if action.tool_call_ids is None:
            held |= {c: prompt for c in made if c not in held}
        else:
            held |= {c: prompt for c in dict.fromkeys(action.tool_call_ids) if c in made}
    listed = {(c.tool_call_id, c.message_id) for c in plan.opened_calls[-PENDING_CALLS_KEPT:]}
    return [
        {"c": c, "m": made[c], "r": r, "p": p}
        for c, (r, p) in held.items()
        if (c, made[c]) in listed
    ]


def given_up(
    plan: TurnPlan,
    block: RecordedBlock,
    conversation: Mapping[str, Any],
    shown: ShownBefore | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The filter and update that take back what a turn's reservation counted (its turn
    starts, its tokens: what its record says, `RecordedBlock.counted`, else what the retry,
    of the same content, counts) once a retry gave it up for good, none of its messages
    stored (`AgentMessageLogger._give_up`); a retry with other content counts otherwise.
    Its record is marked (`TurnRecord.given_up`) in the same update, which matches only
    while it is not: a retry given up again takes nothing back twice. Its block's `seq`s
    become gaps no turn holds (`popped_seqs`, `_left_behind`), as a block given back does:
    every count of gaps (readers, forks, pops, the fold after a later give-back or move)
    then passes them rather than waiting for the turn. The approvals its prompts held again
    or its calls superseded, in `conversation` as read, are as before it
    (`approvals_unstored`). With `shown`, the preview and `updated_at` its reservation set
    are taken back as a block given back takes them back (`_shown_again`). Matches only the
    life `conversation` was read in (`same_as_read`): one started under the id since, even
    with a turn of the same id at the same `seq`, is none of the retry's."""
    starts, input_tokens, output_tokens = block.counted or counted(plan)
    approvals = approvals_unstored(conversation, block_ids(plan, block.count))
    key, first = Int64(plan.key), Int64(block.first_seq)
    query = {
        **same_as_read(plan.conversation_id, conversation),
        "turns": {"$elemMatch": {"k": key, "f": first, "g": {"$ne": True}}},
    }
    own = {"$and": [{"$eq": ["$$record.k", literal(key)]}, {"$eq": ["$$record.f", literal(first)]}]}
    stage = {
        "turn_count": less("turn_count", starts),
        **usage_less(input_tokens, output_tokens),
        "popped_seqs": _left_behind(block.first_seq, block.count),
        "turns": records_changed(own, {"g": literal(True)}),
        **name_restored(own),
    }
    if shown is not None:
        stage.update(_shown_again(shown, block.first_seq, block.count))
    return query, [{"$set": stage}, *approvals]


@dataclass(frozen=True)
class ShownBefore:
    """What a conversation shows without a block given back, from the messages stored before
    it, as a pop computes it for the message it removes (`_pop.preview_source`,
    `_pop.last_before`)."""

    preview: str
    """The preview the last user or assistant message with text before the block gives."""
    quoted: str | None
    """The preview the block's turn set (`TurnPlan.preview`), None when it set none."""
    updated_at: datetime | None
    """The latest time of the messages stored before the block, whatever their `seq` order
    (the conversation's creation when none is), None when unknown."""
    after: int
    """The `seq` of the last message stored before the block, -1 when none is."""
    abandoned: bool = False
    """The block is one an attempt with other content reserved and abandoned
    (`given_back_abandoned`): what it quoted is not known (`quoted` None), so the preview is
    taken back while no turn holds a `seq` past the block."""


def given_back(
    plan: TurnPlan,
    first_seq: int,
    same: dict[str, Any],
    shown: ShownBefore | None = None,
    *,
    refused: bool = False,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The filter and update that give back the block a reservation of the turn took at
    `first_seq` once the turn is not stored there: refused after that reservation, or stored
    in another block by another attempt that reserved too (past the kept records,
    `TurnRules.turns_recorded`), found by that reservation's own attempt or by a retry its
    record sends to the empty block. What the reservation
    counted, its turn starts and tokens, is taken back; its `seq`s become gaps no turn holds
    (`popped_seqs`, `_left_behind`: followers pass them at once), and its record, if still
    kept, names the turn no more (`moved_key`, marked given up), so a retry looks the turn up
    where it is stored, or reserves anew. Matches only the conversation the turn reserved on
    (`same`, its `same_conversation` filter), once (not while the `seq`s are gaps
    already), and not when the block is one the turn left by a move or a pop took from (no
    longer counted as this turn's reservation). With `shown`, the summary its reservation
    set is taken back too when nothing is reserved past the block (`_shown_again`).
    `refused`: the turn is stored nowhere, so the approvals its prompts held again or its
    calls superseded are as before it (`approvals_unstored`); stored elsewhere, under the
    same ids, they stand. Either way the fold that follows (`AgentMessageLogger._give_up`,
    `_relocated.settle`) withdraws the approvals no stored question below an answer's reach
    gives (`_fork.approvals_in_fork`, as a fork of all of it keeps them)."""
    changes_approvals = refused and bool(plan.asked_again or plan.opened_calls)
    ids = [str(d["_id"]) for d in plan.documents] if changes_approvals else []
    approvals = approvals_unstored(None, ids) if ids else []
    query, pipeline = _given_back(plan.key, first_seq, plan.count, counted(plan), same)
    pipeline.extend(approvals)
    if shown is not None:
        pipeline[0]["$set"].update(_shown_again(shown, first_seq, plan.count))
    return query, pipeline


def _shown_again(shown: ShownBefore, first_seq: int, count: int) -> dict[str, Any]:
    """The preview and `updated_at` without the `count` `seq`s from `first_seq`, as a pop
    sets them without its message (`_tail.unlogged`): the preview the messages before them
    give, while no turn holds a `seq` past them (`nothing_reserved_past`) or the preview
    still quotes the block's turn (a turn past it set none); `updated_at` the latest time
    of the messages before them, while no turn holds a `seq` past them nor one between the
    last of those messages and the block (a turn still writing there set a later time)."""
    untouched = nothing_reserved_past(first_seq + count - 1)
    fields: dict[str, Any] = {}
    if shown.quoted is not None or shown.abandoned:
        taken_back = untouched
        if shown.quoted is not None:
            still_quoted = {"$eq": ["$last_message_preview", literal(shown.quoted)]}
            taken_back = {"$or": [untouched, still_quoted]}
        fields["last_message_preview"] = {
            "$cond": [taken_back, literal(shown.preview), "$last_message_preview"]
        }
    if shown.updated_at is not None:
        between = _only_gaps_between(shown.after, first_seq)
        fields["updated_at"] = updated_at_left(shown.updated_at, {"$and": [untouched, between]})
    return fields


def updated_at_left(latest: datetime, unless_changed: Any = True) -> dict[str, Any]:
    """`updated_at` once `latest` is the latest time of the messages a conversation keeps, as
    logging them alone sets it (an expression): no earlier than its `created_at`, the time an
    empty conversation has (one created before its messages' times keeps it); the current
    one while `unless_changed` (an expression) is false: a turn reserved since set its own."""
    time = {"$max": ["$created_at", literal(latest)]}
    return time if unless_changed is True else {"$cond": [unless_changed, time, "$updated_at"]}


def nothing_reserved_past(seq: int) -> dict[str, Any]:
    """Whether no turn holds a `seq` past `seq` (a pipeline expression): every `seq` from it
    to `message_count` is a gap no turn holds (`popped_seqs`: a pop left it, or a turn moved
    away from its block), none a turn reserved."""
    above = {
        "$filter": {
            "input": {"$ifNull": ["$popped_seqs", literal([])]},
            "as": "gap",
            "cond": {"$gt": ["$$gap", seq]},
        }
    }
    reserved = {"$subtract": [{"$ifNull": ["$message_count", 0]}, seq + 1]}
    return {"$eq": [reserved, {"$size": above}]}


def _only_gaps_between(low: int, high: int) -> dict[str, Any]:
    """Whether every `seq` strictly between `low` and `high` is a gap no turn holds
    (`popped_seqs`), as an expression."""
    inside = {"$and": [{"$gt": ["$$gap", low]}, {"$lt": ["$$gap", high]}]}
    gaps = {"$filter": {"input": _kept("popped_seqs", []), "as": "gap", "cond": inside}}
    return {"$eq": [{"$size": gaps}, high - low - 1]}


def given_back_abandoned(
    plan: TurnPlan,
    block: RecordedBlock,
    same: dict[str, Any],
    conversation: Mapping[str, Any],
    shown: ShownBefore | None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`given_back` for the empty block an earlier attempt of the turn reserved with other
    content, abandoned: what its record says it counted (`RecordedBlock.counted`, which must
    be known) is taken back, its `block.count` `seq`s become gaps, the approvals its
    messages changed, in `conversation` as read, are as before them
    (`approvals_unstored`), and the summary its reservation set is taken back as `given_back`
    takes it back (`_shown_again`, `shown` abandoned). A block a retry gave up already
    (`RecordedBlock.given_up`) only has its record renamed (`_given_back_after_given_up`)."""
    if block.given_up:
        return _given_back_after_given_up(plan.key, block.first_seq, same)
    assert block.counted is not None
    assert shown is not None
    query, pipeline = _given_back(plan.key, block.first_seq, block.count, block.counted, same)
    pipeline.extend(approvals_unstored(conversation, block_ids(plan, block.count)))
    pipeline[0]["$set"].update(_shown_again(shown, block.first_seq, block.count))
    return query, pipeline


def _given_back_after_given_up(
    turn_key: int, first_seq: int, same: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`given_back_abandoned` of a block a retry gave up already (`given_up`: what it counted
    taken back, its `seq`s gaps, its summary and pending state as before it): what is left
    is its record naming the turn no more (`moved_key`), as a block given back does, once."""
    key, first = Int64(turn_key), Int64(first_seq)
    query = {
        **same,
        **NOT_BEING_DELETED,
        "turns": {"$elemMatch": {"k": key, "f": first, "g": True}},
    }
    own = {"$and": [{"$eq": ["$$record.k", literal(key)]}, {"$eq": ["$$record.f", literal(first)]}]}
    moved = Int64(moved_key(turn_key))
    marked = {"k": literal(moved), "m": literal(True)}
    return query, [{"$set": {"turns": records_changed(own, marked)}}]


def counted(plan: TurnPlan) -> tuple[int, int, int]:
    """What a reservation of the turn counts: its turn starts, input and output tokens."""
    return plan.turn_starts, plan.usage.input_tokens, plan.usage.output_tokens


def _given_back(
    turn_key: int,
    first_seq: int,
    count: int,
    taken: tuple[int, int, int],
    same: dict[str, Any],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    key, moved, first = Int64(turn_key), Int64(moved_key(turn_key)), Int64(first_seq)
    query = with_none_of(
        {**same, **NOT_BEING_DELETED, "popped_seqs": {"$ne": first}},
        {"turns": {"$elemMatch": {"k": moved, "f": first}}},
        {"turns": {"$elemMatch": {"k": key, "f": first, "p": True}}},
    )
    own = {"$and": [{"$eq": ["$$record.k", literal(key)]}, {"$eq": ["$$record.f", literal(first)]}]}
    starts, input_tokens, output_tokens = taken
    stage = {
        "turn_count": less("turn_count", starts),
        **usage_less(input_tokens, output_tokens),
        "popped_seqs": _left_behind(first_seq, count),
        "turns": records_changed(
            own, {"k": literal(moved), "g": literal(True), "m": literal(True)}
        ),
        **name_restored(own),
    }
    return query, [{"$set": stage}]


def less(field: str, amount: int) -> dict[str, Any]:
    """A count taken back by `amount`, never below 0 (a pop's, a turn given up's)."""
    return int64({"$max": [0, {"$subtract": [{"$ifNull": [f"${field}", 0]}, amount]}]})


def usage_less(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """The `usage` sums taken back by the tokens of a turn or a message (a pop's, a turn
    given up's or given back's), each as `less` takes a count back, except a sum saturated
    at 2**53 - 1 (`_capped`): it stays there. What was added past the cap is not known, and
    taking the whole amount off would leave the sum below what the stored messages hold."""
    return {
        f"usage.{name}": {
            "$cond": [
                {"$gte": [f"$usage.{name}", MAX_SAFE_INTEGER]},
                f"$usage.{name}",
                less(f"usage.{name}", amount),
            ]
        }
        for name, amount in (("input_tokens", input_tokens), ("output_tokens", output_tokens))
    }


def _left_behind(first: int, count: int, gaps: Any = None) -> dict[str, Any]:
    """`popped_seqs` (or `gaps`, an expression) with the `count` `seq`s of the block from
    `first` a moved turn left: no turn holds them any more, as none holds a `seq` a pop left
    behind a later turn's block (the newest `POPPED_SEQS_KEPT` kept). A pop below them then
    gives them back with its own (`_tail.nothing_reserved_past`), and readers pass them at
    once."""
    gaps = _kept("popped_seqs", []) if gaps is None else gaps
    block = literal([Int64(seq) for seq in range(first, first + count)])
    # Each once: a turn given up may move later (its answer popped), leaving them again.
    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
    new = {"$eq": [{"$in": ["$$seq", gaps]}, False]}
    left = {"$filter": {"input": block, "as": "seq", "cond": new}}
    return {"$slice": [{"$concatArrays": [gaps, left]}, -POPPED_SEQS_KEPT]}
