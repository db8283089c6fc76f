"""AgentMessageLogger: persists turns in two round trips, idempotently however late a retry.

Write path of one turn:
1. Reserve: one `find_one_and_update` (an update pipeline, upserting) on the
   conversation document adds the turn's message count to `message_count`,
   appends the turn's record (a digest of its id, its first `seq`, a digest of
   its content, the time) to `turns` and updates every summary field. Its
   filter excludes a conversation that records the turn already, so a retry
   cannot reserve twice: the upsert then collides with the existing `_id`.
2. Insert: one unordered `insert_many` of the messages with `seq` values from
   the reserved block. Messages an earlier attempt already stored collide on
   their stable `_id`; those duplicate-key errors are the only ones swallowed.

A retry finds its turn's record, refuses other content (`Conflict`), reads
what of its block is stored, inserts what is missing and answers with the
stored messages. The content digest of a turn with a cut field covers its whole text
(the hash its `truncated` entry records); a turn recorded before entries recorded it is
recognised by its whole texts kept in GridFS (`_recognised`). Records are kept for the
last `TurnRules.turns_recorded` turns; past them a new turn costs one more round trip (a
lookup of its first message) before it may reserve.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from functools import partial, wraps
from itertools import takewhile
from typing import Any, Literal, NoReturn, ParamSpec, Protocol, TypeVar, runtime_checkable

from bson import Int64
from pydantic import BaseModel, ConfigDict
from pymongo import ReturnDocument
from pymongo.errors import BulkWriteError, DuplicateKeyError

from agent_store.core import (
    MAX_SAFE_INTEGER,
    AgentMessage,
    AnsweredBefore,
    AnsweredPrompt,
    ApprovedCall,
    CallsPushedOff,
    Conflict,
    Conversation,
    DenialTakenBack,
    ForkCheck,
    ForkOrigin,
    ForkTooLarge,
    InvalidInput,
    MessageError,
    NotFound,
    PendingCall,
    PendingHitl,
    StorageUnavailable,
    StoreError,
    ToolMessage,
    TranscriptMoved,
    TurnRecord,
    VersionMismatch,
    answers_instead,
    approval_held_again,
    awaiting_results,
    calls_answered,
    conversation_version,
    listed,
    messages_adapter,
    shown,
    to_utc_millis,
    tool_outcome,
    utc_now,
)
from agent_store.store._blobs import (
    FullTextStore,
    kept_blob_ids,
    stored_blob_ids,
    whole_text_chars,
)
from agent_store.store._deletions import DeletionRecords, recorded_as, refuse_unless_found_standing
from agent_store.store._driver import (
    Database,
    async_database,
    only_duplicates,
    ownership_read,
    pause,
    storage_errors,
)
from agent_store.store._fork import (
    ForkAnswers,
    answers_before,
    answers_in_fork,
    approvals_in_fork,
    fork_copies,
    fork_end,
    fork_fold,
    fork_pending,
    fork_turn_count,
    fork_turn_id,
    fork_turn_starts,
    fork_turns_of,
    forked_messages,
    last_fitting_fork,
    resolved_in_fork,
)
from agent_store.store._fork_read import ForkRead, limit_said, read_fork
from agent_store.store._indexes import CONVERSATIONS, MESSAGES, IndexSetup
from agent_store.store._legacy_seam import (
    DERIVED_CONVERSATION_PREFIX,
    DERIVED_TURN_PREFIX,
    MIGRATED_TURN_PREFIX,
    LegacySource,
    is_derived_id,
    not_migrated_yet,
)
from agent_store.store._naming import named_again, named_by_stored, taken_from
from agent_store.store._pop import (
    POPS_READ,
    finish_marked,
    last_and_latest,
    last_before,
    popped_since_read,
    preview_source,
)
from agent_store.store._relocated import (
    MOVED,
    Landing,
    Looked,
    Unlanded,
    Unmovable,
    Unwritten,
    hold_asked_again,
    looked_again,
    looked_up,
    lookup,
    refold,
    settle,
    stored_among,
    stored_at,
    take_answered_off,
    unchanged,
)
from agent_store.store._reservation import (
    ANSWERS_READ,
    DELETING,
    FORK_CHECK,
    LEGACY_TURN_DOCUMENT,
    MIGRATING,
    NOT_BEING_DELETED,
    PENDING_BLOCKS,
    PUSHED_OFF,
    REFOLD_OWED,
    RELISTED,
    RESERVED,
    STANDING,
    SUMMARY,
    Actor,
    AsRead,
    BeingDeleted,
    RecordedBlock,
    ShownBefore,
    answer_found,
    answered_since,
    answers_found,
    answers_hold,
    answers_lookup,
    answers_stand,
    approvals_left_unstored,
    approved_among,
    being_deleted,
    being_migrated,
    blocks_held,
    blocks_of,
    calls_awaited,
    conversation_by_id,
    denials_hold,
    give_up_undone,
    given_back,
    given_back_abandoned,
    given_up,
    given_up_for_good,
    held_calls_kept,
    is_standing,
    life_named,
    lists_pending,
    literal,
    move_undone,
    moved_key,
    new_life,
    of_epoch,
    of_turns_kept,
    recorded_block,
    released_calls,
    relisted_among,
    relocation,
    reservation,
    reservation_filter,
    same_as_read,
    same_conversation,
    seen_by_caller,
    stored_by_turns_given_up,
    unfinished_fork,
    unmarked,
    updated_at_left,
    watched_blocks,
    with_none_of,
)
from agent_store.store._tail import preview_of
from agent_store.store._text import clean_name
from agent_store.store._turns import (
    ANSWERED_READ,
    DELIVERY_TURN,
    GAPS_READ,
    MAX_MESSAGES_PER_TURN,
    MAX_TURN_TOOL_CALLS,
    PENDING_CALLS_KEPT,
    Answer,
    Gaps,
    TurnConflict,
    TurnPlan,
    TurnRules,
    answered_in,
    block_ids,
    canonical_documents,
    content_digest,
    copied_from,
    held_off_list,
    is_delivery_turn_id,
    is_fork_turn,
    message_id,
    plan_turn,
    records_text_hashes,
    tool_calls_made,
    turn_key,
    validate_identifier,
    without_text_hashes,
)
from agent_store.store._values import storable

_RESERVE_ATTEMPTS = 4
_MARGIN = 10
"""A writer does not insert into its block once `abandon_after` less a tenth of it has passed
since its reservation (`_insert_by`): the tenth is the margin of its check."""

_Met = Mapping[str, dict[str, Any]]
"""What met a turn's insert under its ids, by id (`AgentMessageLogger._met`)."""


@dataclass(frozen=True)
class Condition:
    """A rule a reservation must meet atomically with it, and what the update adds."""

    filter: dict[str, Any]
    """Added to the reservation's filter."""
    stage: Callable[[datetime], dict[str, Any]]
    """Fields the update sets besides the reservation's, given the time of the update."""
    refusal: StoreError
    """Raised when the conversation exists, the turn is new, and the filter does not match."""
    create: bool = False
    """Whether the reservation may create the conversation."""
    absent: StoreError | None = None
    """Raised instead of `refusal` when the conversation does not exist (and may not be
    created); None: `refusal`."""
    moved: Callable[[datetime, int], dict[str, Any]] | None = None
    """Fields a move of the turn to a new block at the end (`relocation`) sets besides its
    own, given the time of the update and the first `seq` of the block it leaves; the move
    then needs `filter` to match too, else `refusal` is raised. None: the condition holds
    for the first reservation only (a fork's, which creates its conversation)."""
    moved_filter: Callable[[range], dict[str, Any]] | None = None
    """What a move of the block at the `seq`s given needs instead of `filter`, when that holds
    more than a move must meet (a delivery's: its inbox's, not a turn's own conditions, which
    its first reservation met and which a turn's move does not meet again); None: `again`."""
    own: Callable[[range], dict[str, Any]] | None = None
    """What `filter` asks of the turn whose first reservation met it and took the empty block
    at the `seq`s given: a move of that block, or the turn's reservation anew once the block
    is given back. What that reservation set (its step; the block past its `next_seq`) is
    not a conversation that moved on since. None: `filter`."""
    explain: Callable[[Mapping[str, Any]], StoreError] | None = None
    """Builds the refusal from the conversation found instead (None: `refusal`)."""
    own_explain: Callable[[Mapping[str, Any]], StoreError] | None = None
    """Builds the refusal of a reservation anew meeting `own`, from the conversation found
    (None: `explain`)."""
    moved_explain: Callable[[Mapping[str, Any]], StoreError] | None = None
    """Builds a refused move's refusal from the conversation found (None: `refusal`)."""
    retried: Callable[[Mapping[str, Any], Collection[str]], StoreError | None] | None = None
    """For a retry of the turn whose content differs from what its record holds: the refusal
    the conversation found explains (the turn was logged without the answers the condition
    refused, and this attempt sends them again), else None. Given the calls the turn's own
    stored messages answer (`_answered_by`): their answer is the turn's, never another's."""
    new_only: bool = False
    """The reservation only creates the conversation (a fork's): one found that does not
    record the turn is refused by this condition, before any other rule. Its owner is the
    one it was created with: a retry of the turn, a replay, never assigns it (`_replayed_by`)."""
    landing: Landing | None = None
    """What the turn logged at the end in place of its empty block (a retry past
    `abandon_after`) must still hold where it lands, as it would logged there fresh: judged
    in the lookup of that block (`_relocated.Landing`); None: nothing more than the
    move's own rules."""
    parts: tuple[Condition, ...] = ()
    """A joined condition's (`_joined`): the two it holds, the one whose refusal comes first
    first. Each is judged on its own when the reservation is refused (`judged`); empty: a
    condition of its own."""

    def refused(self, conversation: Mapping[str, Any], *, own: bool = False) -> StoreError:
        """The error a conversation that does not meet the condition raises (`own`: met
        `again`, by the turn whose empty block was given back)."""
        explain = self.own_explain if own and self.own_explain is not None else self.explain
        return self.refusal if explain is None else explain(conversation)

    def judged(self) -> tuple[Condition, ...]:
        """The conditions the server judges one by one on a refused reservation, in the order
        their refusals come first (`AgentMessageLogger._refuse_unless_met`): each joined
        one's (`parts`), else this one."""
        return tuple(c for part in self.parts for c in part.judged()) or (self,)

    def met_by_a_move(self, block: range) -> dict[str, Any]:
        """What a move of the turn from its empty `block` to a new one must meet:
        `moved_filter`, else `again`."""
        return self.again(block) if self.moved_filter is None else self.moved_filter(block)

    def again(self, block: range) -> dict[str, Any]:
        """What the turn whose first reservation took the empty `block` meets again (`own`),
        else `filter`."""
        return self.filter if self.own is None else self.own(block)

    def move_refused(self, conversation: Mapping[str, Any]) -> StoreError:
        """The error a move the conversation found does not meet raises."""
        return self.refusal if self.moved_explain is None else self.moved_explain(conversation)


_Writer = tuple[Actor, Condition | None]
"""Who reserved a turn and the condition its reservation met: a move of its block takes them
again (`AgentMessageLogger._past_what_readers_passed`)."""


@dataclass(frozen=True)
class _Reserved:
    """A turn's block, its conversation's owner, and whether an earlier attempt reserved it."""

    first_seq: int
    owner: str | None
    replayed: bool
    created_at: datetime | None = None
    """The conversation's `created_at` as stored: it tells the conversation from another one
    under the id (deleted, then created again) when it has no `epoch` yet."""
    epoch: str | None = None
    """The conversation's `epoch`, which its messages carry, and which tells it from another
    one under the id (`same_conversation`)."""
    conversation: Conversation | None = None
    """The conversation's summary: read only when observers are told of the turn."""
    assigns: bool = False
    """The turn assigned an owner to the conversation, unowned until then: the messages
    logged before its block move to the owner (`_hand_over_earlier`)."""
    moved: dict[str, Any] | None = None
    """The conversation as the turn's move to a new block at the end left it (`MOVED`);
    None when the turn did not move."""
    insert_by: float | None = None
    """The `time.monotonic()` past which the attempt no longer inserts into the block, as tail
    readers may have passed it by then (`_insert_by`); None: measured from the attempt's start
    (`AgentMessageLogger._past_what_readers_passed`)."""
    in_flight_until: float | None = None
    """For a retry that found its turn reserved less than `TurnRules.claim_grace` ago: the
    `time.monotonic()` until which an earlier attempt, faster than the grace, may still insert
    into the block (the grace from the moment the retry found the record, after that
    reservation). None otherwise."""
    owed: bool = False
    """The conversation is owed a fold of its pending state (`REFOLD_OWED`, as the
    reservation returned it): the turn folds it after its insert (`_relocated.settle`)."""
    pops: int | None = None
    """How many pops the conversation had finished when the turn reserved its block
    (`Conversation.pops`): only a pop since can have removed what the turn stores
    (`_popped_again`). None: not read, every pop listed counts."""
    passed: tuple[int, ...] = ()
    """The first `seq`s of the blocks listing pending state that the reservation found passed
    (`PENDING_BLOCKS`, older than `abandon_after`): a turn that stored nothing there leaves
    calls or a prompt no stored message makes, and the pending state is folded again after
    the insert (`AgentMessageLogger._left_unstored`)."""
    watched: tuple[int, ...] = ()
    """The first `seq`s of the blocks the conversation watches (`watched_blocks`: a fold found
    them passed and empty, their turn's insert may still land): one holding a message now
    is folded again after the insert (`AgentMessageLogger._left_unstored`)."""
    ahead: tuple[tuple[int, str], ...] = ()
    """The calls the turn's own reservation took off `pending_calls` that are made in a
    block it found passed (`passed`; `PendingBlock.taken` naming the turn), each as the
    block's first `seq` and the call's id: the turn answers a call whose turn may not be
    stored. Such a block is looked up before the insert (`AgentMessageLogger._waits_for`)."""
    stored_in: frozenset[int] | None = None
    """Those of `passed` and `watched` found holding a message before the insert
    (`AgentMessageLogger._waits_for`), which `_left_unstored` then reads no more; None:
    not looked up."""
    relisted: bool = False
    """A replay's: the conversation as it read it lists otherwise than the turn's stored
    messages leave it (`_listed_otherwise`), as a fold that passed the block of its first
    attempt, stalled past `abandon_after`, left it; that attempt's insert landed, but its
    writer did not fold (its command dropped, its process gone). The replay folds, and takes
    the calls its stored messages answer off, before it is acknowledged
    (`_fold_after_insert`)."""
    unheld: tuple[tuple[str, str], ...] = ()
    """A replay's: the approved calls (id, message making it) the turn's stored prompts asked
    about that are free, given before its block, no answer to them come since
    (`_held_again`): the replay holds them again before it is acknowledged
    (`_relocated.hold_asked_again`), as the landing it repeats does."""
    given_up: bool = False
    """A retry's: a retry before it gave the turn up for good in its block
    (`RecordedBlock.given_up`). The turn found stored whole there after all (an attempt
    stalled past the margin landed since), the give-up is undone
    (`AgentMessageLogger._give_up_undone`)."""


@dataclass(frozen=True)
class _GiveBack:
    """A give-back of a turn's block in doubt (`AgentMessageLogger._give_back` raised): what
    finishes it."""

    plan: TurnPlan
    reserved: _Reserved
    documents: list[dict[str, Any]]
    refused: bool


_IN_DOUBT_KEPT = 1024
"""How many give-backs in doubt a logger remembers for its retries, the oldest forgotten."""


@dataclass(frozen=True)
class _Verdict:
    """What a conversation as read says of a turn (`AgentMessageLogger._verdict`), once every
    refusal it explains was raised: a retry, or a new turn (no block)."""

    block: RecordedBlock | None = None
    """The block an earlier attempt reserved, holding what this one sends: a replay of it.
    None: the turn is new, and the reservation's condition decides."""
    proved_new: bool = False
    """Some records were dropped, none names the turn and its first message is not stored
    (`_block_of_an_old_turn`): new, however old a retry of a turn that stored nothing."""
    abandoned: RecordedBlock | None = None
    """The block a first attempt with other content reserved over `abandon_after` ago and
    stored nothing in: given back (`_give_back_abandoned`), then the turn is new."""
    looked: Looked | None = None
    """For a retry of `block` past `abandon_after`: the lookup of its block a move rests on
    (`_looked_up`), which the move then takes as read."""


class LoggedTurn(BaseModel):
    """What `log_messages` stored."""

    model_config = ConfigDict(frozen=True)

    conversation_id: str
    turn_id: str
    messages: list[AgentMessage]
    """The stored messages, with `_id` and `seq`."""
    replayed: bool
    """True when the turn had been reserved before: this call was a retry."""


class TurnObserver(Protocol):
    """Told of every logged turn, after its messages are stored (e.g. the legacy dual write)."""

    async def turn_logged(self, turn: LoggedTurn, conversation: Conversation) -> None:
        """Record the turn elsewhere; a retried turn must rewrite the same record."""
        ...


@runtime_checkable
class CopyingObserver(TurnObserver, Protocol):
    """A `TurnObserver` that copies every turn elsewhere while `copies_turns` (the legacy dual
    write): the turn owes that copy from the moment it is stored, so its messages are stored
    marked so (`copy_owed`), by the insert that stores them (no round trip more). A copy
    whose every write failed, the runtime never sending the turn again, is then still told
    from a turn that was never to be copied (MIGRATION.md, "What `finish` guarantees")."""

    @property
    def copies_turns(self) -> bool:
        """Whether the turns stored now are copied."""
        ...


COPY_OWED = "copy_owed"
"""The field of a stored message whose turn a `CopyingObserver` owes a copy."""


class _DerivedBefore(Exception):
    """A turn logged with no `turn_id` is recorded under the id derived for it before key
    order stopped counting (`TurnPlan.derived_before`): logged by a store of then, it is
    logged under that id, its retry a replay. Raised by the verdict before anything is
    written; `_under_id_before` logs the turn again under `turn_id`."""

    def __init__(self, turn_id: str) -> None:
        super().__init__(turn_id)
        self.turn_id = turn_id


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _under_id_before(method: Callable[_P, Awaitable[_R]]) -> Callable[_P, Awaitable[_R]]:
    """`log_messages` or `check_turn`, for a turn recorded under the id derived for it before
    key order stopped counting (`_DerivedBefore`), again under that id: one reservation
    and one read more, for a retry across the upgrade only."""

    @wraps(method)
    async def under(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return await method(*args, **kwargs)
        except _DerivedBefore as recorded:
            kwargs["turn_id"] = recorded.turn_id
            return await method(*args, **kwargs)

    return under


class AgentMessageLogger:
    """Logs agent turns into `agent_messages` and `agent_conversations`.

    Takes a PyMongo `AsyncDatabase` or a Motor database; it never opens a
    connection nor reads the environment itself.
    """

    def __init__(
        self,
        db: Database,
        *,
        rules: TurnRules | None = None,
        observers: Sequence[TurnObserver] = (),
        legacy: LegacySource | None = None,
    ) -> None:
        """Log into `db`. `observers` are told of each stored turn (e.g. the legacy dual write,
        which costs four more round trips per turn while it is on, and marks the turn's
        messages as owing its copy: `CopyingObserver`). With `legacy`, a new
        conversation is first checked against the legacy turns: an id that exists only there
        is refused until it is migrated (two more round trips, on a conversation's first turn
        only)."""
        db = async_database(db)
        self.rules = rules or TurnRules()
        self._messages = db[MESSAGES]
        self._conversations = db[CONVERSATIONS]
        self._indexes = IndexSetup(db)
        self._observers = tuple(observers)
        self._legacy = legacy
        self._full_texts = FullTextStore(db)
        self._deletions = DeletionRecords(db, self._full_texts)
        self._in_doubt: dict[tuple[str, int], _GiveBack] = {}
        """The give-backs of a turn's block whose writes raised (`_give_back`), by
        conversation and turn key: finished by the turn's retry through this logger."""

    def _copies_owed(self) -> bool:
        """Whether an observer copies the turns stored now (`CopyingObserver`): their
        messages are stored marked `copy_owed`."""
        return any(isinstance(o, CopyingObserver) and o.copies_turns for o in self._observers)

    def add_observer(self, observer: TurnObserver) -> None:
        """Tell `observer` too of every turn stored from now on (e.g. a service's metrics)."""
        self._observers += (observer,)

    async def ensure_indexes(self) -> None:
        """Create the store's indexes (idempotent; retried after a failure)."""
        await self._indexes.ensure()

    async def upsert_conversation(
        self,
        conversation_id: str,
        *,
        user_id: str | None = None,
        name: str | None = None,
        create_only: bool = False,
        copy_of: str | None = None,
        strict_owner: bool = False,
        owner_only: bool = False,
    ) -> Conversation:
        """Create a conversation if it is missing; set its name when one is given.

        A name given here is a person's or runtime's choice and always wins over
        an automatic one. A conversation that already belongs to another user is
        left as it is and raises Conflict: ownership moves only by `claim`. Naming a user
        for an unowned conversation that holds messages assigns it, and its messages become
        that user's, as an assigning turn's do (`_hand_over_earlier`: three round trips more,
        and a wait of `claim_grace` while a turn is still being written; naming the owner of
        one it owns already costs one round trip, a new one two). With `create_only` it only
        creates: a conversation already under the id (anyone's, in any state) is a Conflict,
        nothing written (one round trip, and the legacy lookup when wired to legacy turns);
        `copy_of` (create-only) records the version of the conversation it is created to copy
        (`Conversation.copy_of`). `strict_owner` (a runtime acting for the user `user_id`, the
        LangGraph saver's way in) and `owner_only` (a user token: the same here, no turn is
        logged) upsert only the user's own conversation or a new id created as theirs; any
        other (unowned, another user's in any state, another user's legacy turns, an id the
        migration derives) is NotFound, nothing written, as over HTTP, with `create_only` too.
        A service that means to assign an unowned conversation names the user without them.
        """
        conversation_id = validate_identifier(conversation_id, "conversation_id")
        if user_id is not None:
            user_id = validate_identifier(user_id, "user_id")
        now = utc_now()
        changed: dict[str, Any] = {} if user_id is None else {"user_id": user_id}
        if name is not None:
            changed |= {"name": clean_name(name), "name_source": "set"}
        # A new document holds every key it is served with, as the model writes them.
        fresh = Conversation(
            id=conversation_id, conversation_id=conversation_id, created_at=now, updated_at=now
        ).model_dump(by_alias=True, exclude={"id"})
        on_insert = {k: v for k, v in fresh.items() if k not in changed} | new_life()
        update: dict[str, Any] = {"$setOnInsert": on_insert}
        if changed:
            update["$set"] = changed
        actor = Actor.of_call(
            conversation_id, user_id, owner_only=owner_only, strict_owner=strict_owner
        )
        if create_only:
            fields = on_insert | changed | ({} if copy_of is None else {"copy_of": copy_of})
            return await self._created_only(conversation_id, actor, fields)
        if user_id is not None:  # the user's already, the common case: one round trip
            own = Actor(user_id, strict_owner=True)
            owned = await self._upsert(conversation_id, own, update, create=False)
            if owned is not None:
                return Conversation.model_validate(owned)
        doc = await self._created_or_assigned(conversation_id, actor, update)
        if user_id is not None:
            await self._hand_over_all(conversation_id, doc)
        return Conversation.model_validate(doc)

    async def _created_only(
        self, conversation_id: str, actor: Actor, fields: dict[str, Any]
    ) -> Conversation:
        """`upsert_conversation(create_only=True)`: the conversation inserted with `fields`,
        or Conflict when its id is taken (legacy turns not migrated yet included), BeingDeleted
        when by one whose delete has begun (`being_deleted`: a delete that failed part-way
        finishes when it is run again, and the id is free then); an id the migration derives
        is never created. To an actor checked strictly (`Actor.strict`) an id it does not own,
        in any state, is NotFound, as a missing one: only its own is "exists already"."""
        _refuse_derived(conversation_id, actor)
        await self._refuse_unmigrated(conversation_id, actor)
        doc = {"_id": conversation_id, **fields}
        with storage_errors("create the conversation"):
            try:
                await self._conversations.insert_one(doc)
            except DuplicateKeyError as exc:
                taken = await self._conversations.find_one(
                    conversation_by_id(conversation_id), {DELETING: 1, "user_id": 1}
                )
                if taken is None:
                    await self._refuse_held_by_a_legacy_turn(conversation_id, actor)
                if actor.strict and (taken is None or not actor.owns(taken)):
                    raise NotFound(f"conversation {conversation_id!r} was not found") from exc
                if taken is not None and taken.get(DELETING) is not None:
                    raise being_deleted(conversation_id, "its creation") from exc
                raise Conflict(f"conversation {conversation_id!r} exists already") from exc
        return Conversation.model_validate(doc)

    async def _assign(
        self, conversation_id: str, user_id: str, same: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Name `user_id` the owner of the conversation `same` finds, unowned or theirs
        already, and hand them its messages (`_hand_over_all`), as `upsert_conversation`
        naming them does: its summary, or None when `same` finds it no more (deleted) or
        another user owns it now. One round trip, and the hand-over's."""
        update = {"$set": {"user_id": user_id}}
        doc = await self._upsert(
            conversation_id,
            Actor(user_id),
            update,
            create=False,
            same=same,
            fence=NOT_BEING_DELETED,
        )
        if doc is not None:
            await self._hand_over_all(conversation_id, doc)
        return doc

    async def _hand_over_all(self, conversation_id: str, doc: Mapping[str, Any]) -> None:
        """After a user was named the owner of a conversation (`doc`, as that left it) that
        may have been unowned: its messages go to the owner, as an assigning turn's do (turns
        still being written included, `_hand_over_earlier`); none to hand over, nothing done."""
        block = int(doc.get("message_count") or 0)
        if not block:
            return
        reserved = _Reserved(
            block,
            doc.get("user_id"),
            replayed=False,
            created_at=doc.get("created_at"),
            epoch=doc.get("epoch"),
        )
        await self._hand_over_earlier(conversation_id, reserved)

    async def _created_or_assigned(
        self, conversation_id: str, actor: Actor, update: dict[str, Any]
    ) -> dict[str, Any]:
        """`upsert_conversation`'s update of a conversation the actor may write to, created if
        missing. Legacy turns are looked for only when it is not there (as for a turn), and an
        id the migration derives is never created here."""
        derived = is_derived_id(conversation_id)
        create = self._legacy is None and not derived
        doc = await self._upsert(conversation_id, actor, update, create=create)
        if doc is None:
            await self._refuse_unmigrated(conversation_id, actor)
            if derived and not await self._exists(conversation_id):
                _refuse_derived(conversation_id, actor)
            doc = await self._upsert(conversation_id, actor, update, create=True)
        assert doc is not None  # created
        return doc

    async def _exists(self, conversation_id: str) -> bool:
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(
                conversation_by_id(conversation_id), {"_id": 1}
            )
        return found is not None

    async def _upsert(
        self,
        conversation_id: str,
        actor: Actor,
        update: dict[str, Any],
        *,
        create: bool,
        same: Mapping[str, Any] | None = None,
        fence: dict[str, Any] = STANDING,
    ) -> dict[str, Any] | None:
        """Update the conversation the actor may write to (creating it if `create`; only the
        one `same` finds, when given: `same_conversation`); its summary, or None when it is
        not there, or `fence` leaves it out (`STANDING`: marked by a delete, or a fork not made
        yet; `_assign`, for a replayed turn whose own checks came first, passes
        `NOT_BEING_DELETED`), and `create` is false.
        Creating it finds it so: `being_deleted`, `unfinished_fork`."""
        query = {**conversation_by_id(conversation_id), **(same or {}), **actor.owner_filter()}
        with storage_errors("upsert the conversation"):
            try:
                found: dict[str, Any] | None = await self._conversations.find_one_and_update(
                    query | fence,
                    update,
                    upsert=create,
                    projection=SUMMARY,
                    return_document=ReturnDocument.AFTER,
                )
            except DuplicateKeyError as exc:
                if not await refuse_unless_found_standing(
                    self._conversations, query, "the update of the conversation"
                ):
                    await self._refuse_held_by_a_legacy_turn(conversation_id, actor)
                if actor.strict:  # not theirs, in whatever state: as a missing one
                    raise NotFound(f"conversation {conversation_id!r} was not found") from exc
                raise Conflict(
                    f"conversation {conversation_id!r} belongs to another user: name its "
                    "owner (the user id it was claimed by, if it was), or claim it first"
                ) from exc
        return found

    async def log_message(
        self,
        conversation_id: str,
        message: AgentMessage | Mapping[str, Any],
        *,
        user_id: str | None = None,
        turn_id: str | None = None,
    ) -> AgentMessage:
        """Log one message as a turn of its own; returns it as stored."""
        logged = await self.log_messages(
            conversation_id, [message], user_id=user_id, turn_id=turn_id
        )
        return logged.messages[0]

    @_under_id_before
    async def log_messages(
        self,
        conversation_id: str,
        messages: Sequence[AgentMessage | Mapping[str, Any]],
        *,
        user_id: str | None = None,
        turn_id: str | None = None,
        name: str | None = None,
        owner_only: bool = False,
        strict_owner: bool = False,
        next_seq: int | None = None,
        step: str | None = None,
        refused_prompts: Mapping[str, str] | None = None,
        answers_to: Mapping[str, str] | None = None,
        version: str | None = None,
        denied_first: Mapping[str, str] | None = None,
    ) -> LoggedTurn:
        """Log one turn's messages in order, idempotently by `turn_id`.

        `turn_id` defaults to a digest of the messages (content and timestamps), so retrying the
        same messages is safe even without one, as long as they carry their `created_at` (a message
        without one is stamped on each call). A retry of any age stores nothing twice and answers
        with the stored messages; a retry with other content raises Conflict; but a first attempt
        that stored nothing, retried after `turns_recorded` or more later turns, is stored as new
        (DESIGN.md). `name` is a name the runtime generated; it replaces an automatic name or an
        earlier runtime name, never one a person set. `owner_only` (a user token) and `strict_owner`
        (a runtime acting for the user) write only to `user_id`'s own conversations or a new id,
        else NotFound (`Actor.strict`); only a user token's turn is a person's, refused a turn id a
        runtime opened a steering inbox for (`Actor.running_refusal`). A service naming `user_id`
        may write to that user's conversations or to unowned ones (which it then assigns). With
        `next_seq`, a new turn is logged only if its first message gets that `seq` (compare-and-sets
        in the reservation's command), and with `step` (an ordering key, a LangGraph checkpoint id)
        only if it is after every step logged before: otherwise `TranscriptMoved` (`next_seq`,
        `later_step`: where the conversation is), nothing written. `refused_prompts`: the prompt
        each denial of an earlier call answers, as read (`_denials`). `answers_to`: the call of an
        earlier turn each of its answers (a result or a denial) answers, by tool call id, with the
        message that made it, as read from `pending_calls`: the turn is logged only while each is
        still the latest pending call of its id, else `AnsweredBefore` (another turn answered it
        first: a call's first answer is its answer), nothing written (`_answers`); a call merely off
        the list, no answer to it stored nor being written, is answered (`_reserve_answering`).
        InvalidInput, nothing written, for a turn breaking the contract (`_check_answers_named` too)
        or taking a delivery's id (`delivery-` + hex). `version` (`Conversation.version`): logged
        only into the conversation it names, nothing written otherwise (`_life_named`, in the
        reservation's own command: one read more). `denied_first`: `_settled_by_denials`."""
        plan, actor, condition = self._planned(
            conversation_id,
            messages,
            user_id=user_id,
            turn_id=turn_id,
            owner=(owner_only, strict_owner),
            next_seq=next_seq,
            step=step,
            refused=refused_prompts,
            answers_to=answers_to,
        )
        life = await self._life_kept(plan, version, actor, denied_first)
        turn = partial(_turn_conditions, plan, next_seq, step, refused_prompts, answers_to)
        conditions = partial(_in_life, turn, life)
        named = (answers_to, refused_prompts)
        return await self._logged(plan, actor, name, _joined(condition, life), conditions, named)

    async def _logged(
        self,
        plan: TurnPlan,
        actor: Actor,
        name: str | None,
        condition: Condition | None,
        conditions: Callable[[AsRead], Condition | None],
        named: tuple[Mapping[str, str] | None, Mapping[str, str] | None],
    ) -> LoggedTurn:
        """`log_messages`, its arguments checked: the turn reserved (`_reserve_answering`),
        stored, and told."""
        runtime_name = clean_name(name) if name is not None else None
        started = time.monotonic()
        reserved = await self._reserve_answering(
            plan, actor, runtime_name, condition, conditions, named
        )
        stored, reserved = await self._store(plan, reserved, started, (actor, condition))
        return await self._told(plan, reserved, stored)

    async def _life_kept(
        self,
        plan: TurnPlan,
        version: str | None,
        actor: Actor,
        denied_first: Mapping[str, str] | None,
    ) -> Condition | None:
        """What `log_messages`'s reservation meets besides the turn's own conditions, on every
        attempt: the conversation `version` names (`_life_named`; its refusal comes first),
        and the calls of earlier turns whose denials the turn leaves out still answered
        (`_settled_by_denials`, checked before the conversation is read)."""
        settled = _settled_by_denials(plan, _denied_first(denied_first))
        return _joined(settled, await self._life_named(plan.conversation_id, version, actor))

    async def _life_named(
        self, conversation_id: str, version: str | None, actor: Actor
    ) -> Condition | None:
        """The condition of a turn logged only into the conversation `version` names
        (`log_messages`; None without one): its life (`same_conversation`), as read now;
        NotFound when there is none under the id, VersionMismatch when it is another. The one
        `actor` may not write to is refused as the reservation refuses it (`Actor.refusal`:
        to a user, NotFound whatever the version, so a version never tells another user's
        conversation apart from a missing one). One round trip."""
        if version is None:
            return None
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(
                conversation_by_id(conversation_id), {"epoch": 1, "created_at": 1, "user_id": 1}
            )
        if found is not None and (refusal := actor.refusal(conversation_id, found.get("user_id"))):
            raise refusal
        gone = NotFound(f"conversation {conversation_id!r} was not found")
        other = VersionMismatch(
            f"conversation {conversation_id!r} is not the one named: it was deleted and started "
            "again since that version was read; nothing was logged (read it again)"
        )
        if found is None:
            raise gone
        life = life_named(conversation_id, found, version)
        if life is None:
            raise other
        return Condition(life, lambda now: {}, other, absent=gone)

    async def _reserve_answering(
        self,
        plan: TurnPlan,
        actor: Actor,
        name: str | None,
        condition: Condition | None,
        conditions: Callable[[AsRead], Condition | None],
        named: tuple[Mapping[str, str] | None, Mapping[str, str] | None],
    ) -> _Reserved:
        """`_reserve`, for a turn refused `AnsweredBefore` only for a call another answer to is
        really there for (`_unanswered`): a call merely off `pending_calls` (the bounded list
        dropped it, or the turn that took it off was abandoned unstored) is reserved again,
        taken as read (`AsRead`, `conditions` builds the reservation's condition with them),
        while the conversation is as read; moved meanwhile, it is looked up again, at most
        `_ANSWER_LOOKUPS` times. `named` are the turn's `answers_to` and `refused_prompts`."""
        for lookups in range(_ANSWER_LOOKUPS + 1):
            try:
                return await self._reserve(plan, actor, name, condition)
            except AnsweredBefore as refused:
                if lookups == _ANSWER_LOOKUPS:
                    raise
                try:
                    as_read = await self._unanswered(plan, actor, *named, refused)
                except _LoggedMeanwhile:
                    continue  # reserved again: the turn's record is there, a replay
                condition = conditions(as_read)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _unanswered(
        self,
        plan: TurnPlan,
        actor: Actor,
        answers_to: Mapping[str, str] | None,
        refused_prompts: Mapping[str, str] | None,
        refused: AnsweredBefore,
    ) -> AsRead:
        """For a turn refused as answering calls answered before (`refused`), the calls it
        names (`answers_to`) that are off `pending_calls` though no answer to them is there:
        none stored (`answer_found`), and no block reserved after the call less than
        `abandon_after` ago still unstored (its insert may still land: it may answer it).
        Else raises: `refused` (a person approved a call the turn denies), then what
        `_answers_judged` raises, the one rule: an answer already stored is judged before the
        named message is looked for (one still being written may make the call:
        `_Landed`); the turn's own record there (another attempt of it logged it since it was
        judged new: the answer may be its own), `_LoggedMeanwhile`, for the caller to judge it
        again as a retry; `AnsweredBefore` for a call marked listed again whose answer
        landed (`_refuse_landed`). Two reads (the conversation, then the messages), on that
        refusal only. The conversation is read while `actor` may write to it
        (`Actor.owner_filter`): one another owner holds now (deleted and started again since
        the refusal) is never judged, `refused` is raised as when none is there."""
        named = _named_answers(plan, _answers_to(answers_to))
        named = {c: m for c, m in named.items() if c in refused.tool_call_ids}
        if not named:  # denials only: a person approved the calls first
            raise refused
        with storage_errors("read the conversation"):
            conversation = await self._conversations.find_one(
                conversation_by_id(plan.conversation_id) | actor.owner_filter(), _ANSWERED_FIELDS
            )
        if conversation is None:
            raise refused
        if recorded_block(conversation, plan.key) is not None:
            raise _logged_meanwhile(plan)
        await self._refuse_landed(plan, conversation, named)
        named = await self._placed(conversation, named)
        found, landed, written = await self._answers_landing(
            conversation, named, "read the messages answers_to names"
        )
        if renamed := _relogged_ids(plan.conversation_id, named, found):
            named = {**named, **renamed}  # judged by the call as its re-logged turn stores it
            found, landed, written = await self._answers_landing(
                conversation, named, "read the messages answers_to names"
            )
        if _its_own_answers(plan, found):
            raise _logged_meanwhile(plan)
        refused_prompts = _refused_prompts(refused_prompts)
        if released_calls(conversation, _denied(plan, refused_prompts), refused_prompts):
            raise refused  # a person approved a call the turn denies first, however it is named
        gone, _ = answered_since(conversation, named)
        if (refusal := _answers_judged(plan, named, gone, found, landed, written)) is not None:
            raise refusal
        return AsRead(
            calls={c: named[c] for c in gone},
            message_count=int(conversation.get("message_count") or 0),
            pops=int(conversation.get("pops") or 0),
            epoch=conversation.get("epoch"),
            renamed=renamed or None,
        )

    async def _refuse_landed(
        self, plan: TurnPlan, conversation: Mapping[str, Any], named: Mapping[str, str]
    ) -> None:
        """For `_unanswered`: `AnsweredBefore` for the calls `named` that `conversation` marks
        listed again (`RELISTED`: the block that answered them was passed as abandoned) whose
        answer landed since (`_relocated.looked_again`: one `find`; when one did, the fold its
        writer owed, else the take-off). A call whose answer did not land loses its mark and
        is taken as the latest pending call of its id. Nothing read when none is marked."""
        if marked := relisted_among(conversation, named.items()):
            landed = await looked_again(
                self._conversations,
                self._messages,
                conversation,
                marked,
                abandon_after=self.rules.abandon_after,
                name_chars=self.rules.name_chars,
            )
            if landed:
                raise _answered_first(plan, landed)

    async def _placed(
        self, conversation: Mapping[str, Any], named: dict[str, str]
    ) -> dict[str, str]:
        """`named`, each call `calls_answered` named by `_UNSTORED_CALL` (its turn was still
        being written) named instead by the stored message of this life of the conversation
        making it, once one is (the latest): the turn is judged by the call as it landed. One
        lookup, only then."""
        unplaced = [c for c, m in named.items() if m == _UNSTORED_CALL]
        if not unplaced:
            return named
        query = {"conversation_id": conversation["_id"], "tool_calls.id": {"$in": unplaced}}
        with storage_errors("read the messages making the calls"):
            found = (
                await self._messages.find(
                    query, {"tool_calls.id": 1, "seq": 1, "epoch": 1, "turn_id": 1}
                )
                .sort("seq", 1)
                .to_list(None)
            )
        makers = {
            call["id"]: str(d["_id"])
            for d in of_turns_kept(found, conversation)
            for call in d.get("tool_calls") or ()
            if isinstance(call, Mapping) and call.get("id") in unplaced
        }
        return {**named, **makers}

    @_under_id_before
    async def check_turn(
        self,
        conversation_id: str,
        messages: Sequence[AgentMessage | Mapping[str, Any]],
        *,
        user_id: str | None = None,
        turn_id: str | None = None,
        refused_prompts: Mapping[str, str] | None = None,
        answers_to: Mapping[str, str] | None = None,
        next_seq: int | None = None,
        step: str | None = None,
        strict_owner: bool = False,
    ) -> None:
        """Raise what `log_messages` refuses the same turn with before it writes anything, as
        the conversation stands: the InvalidInput of a turn breaking the contract; what the
        conversation says of the turn, decided as `log_messages` decides it (`_verdict`: a
        retry is a replay however many turns came in between, one of a turn a pop corrected
        or sent with other content refused, as is a conversation missing, another user's or
        being deleted, and one past `abandon_after` that cannot move to the end, a later
        message answering its call, looked up as the move looks it up); and, for a new turn,
        the refusal of an answer to a call another turn answered since (`answers_to`,
        `_answers`) and of what else its reservation's condition refuses (`_check_new_turn`:
        a denial of a call a person approved, a call pushing a held one off `pending_calls`,
        `next_seq` and `step`, which a late retry that stored nothing meets as its move does:
        `_check_logged_at`). One read; one more for a new turn with a condition, or a retry
        past `abandon_after` (its empty block); two more to look a turn up past the kept
        records, for a call off `pending_calls` (`_unanswered`), or for a retry with other
        content judged as its give-back leaves the conversation (`_as_given_back`). Writes
        nothing of the turn's; a pop under way it finds (`popping`) is finished first, as the
        turn's reservation finishes it (two round trips and a read more, only then). For a
        caller that records something the turn concerns before logging it
        (`log_streamed_turn` records an approval first): a turn it raises for writes nothing.
        `strict_owner` as for `log_messages`."""
        plan, actor, condition = self._planned(
            conversation_id,
            messages,
            user_id=user_id,
            turn_id=turn_id,
            owner=(False, strict_owner),
            next_seq=next_seq,
            step=step,
            refused=refused_prompts,
            answers_to=answers_to,
        )
        checked = partial(
            self._check_as_found,
            plan,
            actor,
            condition,
            (next_seq, step),
            (answers_to, refused_prompts),
        )
        try:
            await checked()
        except _LoggedMeanwhile:  # the turn itself was logged meanwhile: judged again, a retry
            await checked()

    async def _check_as_found(
        self,
        plan: TurnPlan,
        actor: Actor,
        condition: Condition | None,
        at: tuple[int | None, str | None],
        named: tuple[Mapping[str, str] | None, Mapping[str, str] | None],
    ) -> None:
        """`check_turn`'s decision as the conversation stands when read, `at` the turn's
        `next_seq` and `step`, `named` its `answers_to` and `refused_prompts`."""
        (next_seq, step), refused_prompts = at, named[1]
        query = conversation_by_id(plan.conversation_id)
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(query, _CHECKED_FIELDS)
            if await self._finished_a_pop(actor, found):  # read again once it is finished
                found = await self._conversations.find_one(query, _CHECKED_FIELDS)
        verdict = await self._verdict_told(plan, actor, found, condition)
        if verdict.block is not None:
            if verdict.looked is not None and not _of_the_turn(plan, verdict.looked.stored):
                await self._check_logged_at(plan, next_seq, step, verdict.block)  # a move
            return  # a replay
        if found is not None and verdict.abandoned is not None:  # judged as given back
            await self._check_logged_at(plan, next_seq, step, verdict.abandoned)
            found = await self._as_given_back(plan, found, verdict.abandoned)
            _check_as_given_back(plan, found, _refused_prompts(refused_prompts))
            condition = None
        if found is not None:
            await self._check_new_turn(plan, actor, found, condition, at, named)

    async def _check_new_turn(
        self,
        plan: TurnPlan,
        actor: Actor,
        found: Mapping[str, Any],
        condition: Condition | None,
        at: tuple[int | None, str | None],
        named: tuple[Mapping[str, str] | None, Mapping[str, str] | None],
    ) -> None:
        """`check_turn`'s decision on a new turn in the conversation `found`: its answers to
        calls of earlier turns (`named`: `answers_to`, `refused_prompts`; `_answers_refusal`),
        then its reservation's `condition` (`_check_condition`), `at` its `next_seq` and
        `step`. Each lookup selects the conversation as judged (`_as_judged`)."""
        answers_to, refused_prompts = named
        answers = _named_answers(plan, _answers_to(answers_to))
        if answers:
            refusal = _answers_refusal(plan, answers, found)
            if isinstance(refusal, AnsweredBefore):  # raised if answered, else taken as read
                await self._unanswered(plan, actor, answers_to, refused_prompts, refusal)
            elif refusal is not None:
                raise refusal
        if condition is not None:
            conditions = partial(_turn_conditions, plan, *at, refused_prompts, answers_to)
            judged = _as_judged(plan.conversation_id, found, actor)
            await self._check_condition(plan, actor, judged, condition, conditions, named)

    async def calls_answered(
        self,
        conversation_id: str,
        messages: Sequence[AgentMessage],
        *,
        user_id: str | None = None,
        tool_names: Mapping[str, str] | None = None,
        strict_owner: bool = False,
    ) -> dict[str, str]:
        """The `answers_to` of a turn of `messages`, as the conversation stands: for each call
        of an earlier turn it answers (a `tool` message, result or denial, naming a call no
        message of the turn makes), the message that made it, the latest pending call of its
        id, else the latest message of this life making it. Logged with them (a runtime's
        bridge that read no `pending_calls`), a turn answering a call another turn answered
        first is `AnsweredBefore`, nothing written, while a retry of a logged turn is still
        its replay. A call off the list no stored message makes is named by an id no message
        has (`_made_unstored`): the turn is judged as one naming it as `pending_calls` served
        it while a turn still being written may make it and its answer is stored or may still
        land (`_UNSTORED_CALL`), and refused as one naming a call no message of the
        conversation makes when no such turn may make it (`_UNMADE_CALL`: InvalidInput), as
        is every call it answers in a conversation that does not exist (never created: the
        404 to a user, a Conflict to a service, `_absent`) or is another user's (with
        `strict_owner`, an unowned one too: nothing of its calls is told), nothing written.
        A call no answer takes that a turn still being written may make and leave open
        though `pending_calls` lost it (its bound pushed it off, `_pushed_off_maybe`) is left
        out (the turn is logged without it: its answer lands after that turn); any other
        such call is `_UNMADE_CALL`, a turn in flight or not. `tool_names` (call id to the
        tool's name, where the runtime says which tool a result is of): a result is named by
        the latest call of its id of that tool (listed, else its stored message), never by
        another tool's call of the same id; one whose id only another tool's calls use here is
        InvalidInput naming both tools and the call (`_refuse_other_tools`: a call id used
        again, in another life of the conversation or by another run), nothing written; a call
        not stored yet is paired by its id alone. None read for a
        turn answering no earlier call; the conversation, then, for a call not pending, its
        messages making it (one read more), and for a call no stored message makes, the
        messages answering it (one more)."""
        made = {call.id for message in messages for call in message.tool_calls or ()}
        wanted = {
            m.tool_call_id: ""
            for m in messages
            if m.role == "tool" and m.tool_call_id and m.tool_call_id not in made
        }
        names = _call_id_map(tool_names, "tool_names must map call ids to tool names")
        if not wanted:
            return {}
        scope = conversation_by_id(validate_identifier(conversation_id, "conversation_id"))
        with storage_errors("read the pending calls"):
            found = await self._conversations.find_one(scope, _PENDING_READ)
        owner = found.get("user_id") if found is not None else None
        if found is None or not _reaches(owner, user_id, strict_owner=strict_owner):
            return dict.fromkeys(wanted, _UNMADE_CALL)  # refused as the reservation refuses it
        others = _listed_makers(found, wanted, names)  # another tool's call of an id named
        if missing := sorted(c for c, m in wanted.items() if not m):
            makers, made_with = await self._made_by_stored(found, missing, names)
            wanted.update(makers)
            others = made_with | others
        _refuse_other_tools(conversation_id, names, {c: others[c] for c in others if not wanted[c]})
        if unmade := sorted(c for c, m in wanted.items() if not m):
            wanted.update(await self._made_unstored(found, unmade))
        return {c: m for c, m in wanted.items() if isinstance(m, str) and m}

    async def calls_denied_first(
        self,
        conversation_id: str,
        answers_to: Mapping[str, str],
        *,
        user_id: str | None = None,
        strict_owner: bool = False,
    ) -> set[str]:
        """Those of the calls `answers_to` names (call id to the message making it, as
        `calls_answered` names them) whose answer stored in this life of the conversation is a
        denial (`tool call denied`; a real result stored after an `interrupted` stand-in is
        the answer, as every replay takes it): what a bridge drops as settled when the turn it
        logs denies them too and the logger refused it `AnsweredBefore`. None for a call not
        answered, or answered otherwise (a result, a failure), or a conversation the caller
        may not name (another user's; with `strict_owner`, an unowned one too). Two reads: the
        conversation, then the messages making or answering the calls (`answers_lookup`)."""
        if not answers_to:
            return set()
        scope = conversation_by_id(validate_identifier(conversation_id, "conversation_id"))
        with storage_errors("read the answers to the calls"):
            found = await self._conversations.find_one(scope, {"user_id": 1, "epoch": 1})
            if found is None or not _reaches(
                found.get("user_id"), user_id, strict_owner=strict_owner
            ):
                return set()
            query = answers_lookup(scope["_id"], answers_to, None)
            read = {**ANSWERS_READ, "error": 1}
            docs = await self._messages.find(query, read).sort("seq", 1).to_list(None)
        life = of_epoch(docs, found["epoch"]) if "epoch" in found else docs
        return {
            call_id
            for call_id, made_by in answers_to.items()
            if _standing_outcome(answers_found(life, call_id, made_by)) == "denied"
        }

    async def _made_by_stored(
        self, conversation: Mapping[str, Any], call_ids: Sequence[str], tools: Mapping[str, str]
    ) -> tuple[dict[str, str], dict[str, str]]:
        """For `calls_answered`, the latest stored message of this life of `conversation`
        making each of `call_ids` (off `pending_calls`), never a late insert of an earlier
        life of the id left to the delete's sweep; for a call the runtime says is of a tool
        (`tools`), the latest making a call of that id of that tool. Answers them, and for a
        call none of that tool makes, the tool of the latest call of its id (another's). One
        read."""
        query = {"conversation_id": conversation["_id"], "tool_calls.id": {"$in": call_ids}}
        read = {"tool_calls.id": 1, "tool_calls.function.name": 1, "epoch": 1, "turn_id": 1}
        with storage_errors("read the messages making the calls answered"):
            making = await self._messages.find(query, read).sort("seq", -1).to_list(None)
        makers: dict[str, str] = {}
        others: dict[str, str] = {}
        for doc in of_turns_kept(making, conversation):  # the latest first
            for call in doc.get("tool_calls") or ():
                call_id = call.get("id") if isinstance(call, Mapping) else None
                if not isinstance(call_id, str) or call_id not in call_ids or call_id in makers:
                    continue
                function = call.get("function")
                name = function.get("name") if isinstance(function, Mapping) else None
                if call_id in tools and name != tools[call_id]:
                    others.setdefault(call_id, str(name))
                else:
                    makers[call_id] = str(doc["_id"])
        return makers, {c: t for c, t in others.items() if c not in makers}

    async def _made_unstored(
        self, conversation: Mapping[str, Any], call_ids: Sequence[str]
    ) -> dict[str, str]:
        """For `calls_answered`, those of `call_ids` (off `pending_calls`, made by no stored
        message) named by an id no message has. A turn still being written may make such a
        call (its insert lost or in flight, within `abandon_after`: `_Landed`; or passed, its
        writer dead): one whose answer is stored or may still land is `_UNSTORED_CALL`, so
        the turn is judged as one naming the call as `pending_calls` served it
        (`_unanswered`: `AnsweredBefore`, or `StorageUnavailable` while the answer is still
        being written), never stored as a second answer. One with no answer is another
        turn's only where `pending_calls` may have lost it (`_pushed_off_maybe`): a turn's
        reservation lists the calls it leaves open, so a turn still being written makes a
        call off the list, unanswered, only by answering it itself (an answer now would be a
        second one) or when the list's bound pushed it off, which the update doing so marks
        (`calls_pushed_off`: only a turn reserved before it, its block at or below the call
        it marks, may have lost one, and only one of the calls it names); left out then (the
        turn is logged without it: its answer lands after that turn). Else no message of the
        conversation makes it, whatever is being written: `_UNMADE_CALL`, the turn refused
        as naming a call no message makes (`_misnamed`). One read (the messages)."""
        named = dict.fromkeys(call_ids, _UNSTORED_CALL)
        found, landed, written = await self._answers_landing(
            conversation, named, "read the messages answering the calls"
        )
        states = _answer_states(named, call_ids, landed, written)
        first = landed.written_from
        lost = _pushed_off_maybe(conversation, found, first) if first >= 0 else frozenset()
        told = {
            c: _UNSTORED_CALL if state in _TAKEN else None if c in lost else _UNMADE_CALL
            for c, state in states.items()
        }
        return {c: m for c, m in told.items() if m is not None}

    async def _answers_landing(
        self, conversation: Mapping[str, Any], named: Mapping[str, str], action: str
    ) -> tuple[list[dict[str, Any]], _Landed, Callable[[int], bool]]:
        """The stored messages that tell whether the calls `named` (call id to the message
        making it) have an answer (`answers_lookup`, from the first `seq` readers have not
        passed), as they stand once the blocks still being written land (`_Landed`), and
        whether a block past a `seq` may still be written (`_written_after`). One read."""
        gaps, now = Gaps.of(conversation), utc_now()
        from_seq = gaps.unpassed_from(now=now, abandon_after=self.rules.abandon_after)
        query = answers_lookup(str(conversation["_id"]), named, from_seq)
        with storage_errors(action):
            read = await self._messages.find(query, ANSWERS_READ).sort("seq", 1).to_list(None)
        found = of_turns_kept(read, conversation)
        count = int(conversation.get("message_count") or 0)
        landed = _Landed.of(found, named, gaps, count, from_seq, now, self.rules)
        landed = landed.awaiting(calls_awaited(conversation, now))
        stored = {int(d["seq"]) for d in found}

        def written(made_at: int) -> bool:
            return _written_after(gaps, made_at, stored, count, from_seq, now, self.rules)

        return found, landed, written

    async def _verdict_told(
        self,
        plan: TurnPlan,
        actor: Actor,
        found: Mapping[str, Any] | None,
        condition: Condition | None,
    ) -> _Verdict:
        """`_verdict` for `check_turn`, which gives nothing up: a turn refused where it would
        land at the end raises what `log_messages` tells (`Unlanded.error`)."""
        try:
            return await self._verdict(plan, actor, found, condition)
        except Unlanded as refused:
            _raise_refusal(refused)

    async def _check_logged_at(
        self, plan: TurnPlan, next_seq: int | None, step: str | None, block: RecordedBlock
    ) -> None:
        """`check_turn`'s decision on the compare-and-sets (`next_seq`, `step`) of a retry past
        `abandon_after` whose first reservation took the empty `block`: met as its move or its
        reservation anew meets them (`Condition.again`: that block and its step are the
        turn's own, not the conversation moving on), else the `TranscriptMoved` they raise.
        One read; one more on a refusal."""
        at = _logged_at(plan.conversation_id, next_seq, step)
        if at is None:
            return
        own = at.again(range(block.first_seq, block.first_seq + block.count))
        query = conversation_by_id(plan.conversation_id)
        with storage_errors("read the conversation"):
            if await self._conversations.find_one({**own, **query}, {"_id": 1}) is not None:
                return
            found = await self._conversations.find_one(query, {"message_count": 1, "last_step": 1})
        if found is not None:
            raise at.refused(found, own=True)

    async def _as_given_back(
        self, plan: TurnPlan, found: Mapping[str, Any], block: RecordedBlock
    ) -> Mapping[str, Any]:
        """The conversation `found` (as `check_turn` read it) as the give-back of a retry's
        abandoned block leaves it (`_give_back_abandoned`), without what its first reservation
        changed: the approvals its messages held again or superseded as before them
        (`approvals_left_unstored`), its pending state, resolutions and approvals folded from
        the stored messages (`_relocated.refold`: two reads, on that path only; as found while
        a turn below the end is still being written, as the give-back leaves them then)."""
        fold = await refold(
            self._conversations,
            self._messages,
            plan.conversation_id,
            None,
            abandon_after=self.rules.abandon_after,
            own=range(block.first_seq, block.first_seq + block.count),
        )
        approvals = approvals_left_unstored(
            found.get("approved_calls") or (), block_ids(plan, block.count)
        )
        if fold is None:
            return {**found, "approved_calls": approvals}
        return {**found, **fold.summary(), "approved_calls": fold.approvals_kept(approvals)}

    async def _check_condition(
        self,
        plan: TurnPlan,
        actor: Actor,
        judged: Mapping[str, Any],
        condition: Condition | None,
        conditions: Callable[[AsRead], Condition | None],
        named: tuple[Mapping[str, str] | None, Mapping[str, str] | None],
    ) -> None:
        """`_reserve_answering`'s decision on a new turn's condition, read only: the
        conversation looked up with the condition's filter (the very one the reservation adds
        to its own), and, matching none, read whole for the refusal the condition explains;
        one the answers' lookup (`_unanswered`) takes as read is looked up again with them, as
        `log_messages` reserves again. Both lookups select the conversation `check_turn`
        judged (`judged`, `_as_judged`): one deleted, started again or taken by another owner
        since is nothing to refuse here, as `log_messages` judges it again. One round trip;
        two more on a refusal."""
        for lookups in range(_ANSWER_LOOKUPS + 1):
            if condition is None:
                return
            with storage_errors("read the conversation"):
                met = await self._conversations.find_one({**condition.filter, **judged}, {"_id": 1})
                if met is not None:
                    return
                found = await self._conversations.find_one(judged)
            if found is None:
                return  # gone meanwhile: as `_verdict` found it, nothing to refuse here
            refusal = condition.refused(found)
            if not isinstance(refusal, AnsweredBefore) or lookups == _ANSWER_LOOKUPS:
                raise refusal
            as_read = await self._unanswered(plan, actor, *named, refusal)
            condition = conditions(as_read)

    def _planned(
        self,
        conversation_id: str,
        messages: Sequence[AgentMessage | Mapping[str, Any]],
        *,
        user_id: str | None,
        turn_id: str | None,
        owner: tuple[bool, bool] = (False, False),
        next_seq: int | None = None,
        step: str | None = None,
        refused: Mapping[str, str] | None = None,
        answers_to: Mapping[str, str] | None = None,
    ) -> tuple[TurnPlan, Actor, Condition | None]:
        """`log_messages`'s arguments checked, as nothing is written yet: the turn's plan, who
        logs it (`owner`: its `owner_only` and `strict_owner`) and what its reservation must
        meet."""
        plan = plan_turn(conversation_id, messages, turn_id=turn_id, rules=self.rules)
        if user_id is not None:
            user_id = validate_identifier(user_id, "user_id")
        _refuse_other_owners(messages, turn_id=turn_id, user_id=user_id)
        actor = Actor.of_call(
            plan.conversation_id, user_id, owner_only=owner[0], strict_owner=owner[1]
        )
        refuse_unloggable_turn_id(plan.turn_id)
        _check_answers_named(plan, _answers_to(answers_to), _refused_prompts(refused))
        condition = _turn_conditions(plan, next_seq, step, refused, answers_to)
        named = _named_answers(plan, _answers_to(answers_to))
        return replace(plan, answers_named=tuple(sorted(named.items()))), actor, condition

    async def _told(
        self, plan: TurnPlan, reserved: _Reserved, stored: list[AgentMessage]
    ) -> LoggedTurn:
        """The stored turn, once every observer is told of it: the one way out of every write
        that adds messages (a turn, a fork's copies, a steering delivery), so the dual write
        keeps each of them for a rollback."""
        # Every part is validated already: constructed, not validated again message by message.
        logged = LoggedTurn.model_construct(
            conversation_id=plan.conversation_id,
            turn_id=plan.turn_id,
            messages=stored,
            replayed=reserved.replayed,
        )
        for observer in self._observers:
            assert reserved.conversation is not None  # observers get the summary
            await observer.turn_logged(logged, reserved.conversation)
        return logged

    async def claim_step(self, conversation_id: str, *, step: str, next_seq: int) -> None:
        """Make `step` the conversation's latest step, as a turn logged with it would, for a
        caller whose messages the transcript holds already (another caller logged the same
        turn): only if the transcript still ends at `next_seq` and `step` is after every step
        logged before, else `TranscriptMoved` (`next_seq`, `later_step`), nothing written."""
        conversation_id = validate_identifier(conversation_id, "conversation_id")
        condition = _logged_at(conversation_id, next_seq, step)
        assert condition is not None
        query = conversation_by_id(conversation_id) | condition.filter
        with storage_errors("record the conversation's latest step"):
            result = await self._conversations.update_one(query, {"$set": {"last_step": step}})
            if result.matched_count:
                return
            found = await self._conversations.find_one(
                conversation_by_id(conversation_id), {"message_count": 1, "last_step": 1}
            )
        if found is None:
            raise NotFound(f"conversation {conversation_id!r} was not found")
        raise condition.refused(found)

    async def fork(
        self,
        conversation_id: str,
        at_seq: int,
        new_conversation_id: str,
        *,
        user_id: str | None = None,
        owner_only: bool = False,
        version: str | None = None,
    ) -> LoggedTurn:
        """Start `new_conversation_id` with copies of the messages up to `at_seq`.

        The copies get new ids and `seq` 0…n in the same order; a fork between a
        tool call and its result moves to the end of the pair. The new conversation
        has its own summary fields, the same owner and `forked_from`; the original
        is untouched. A turn up to `at_seq`, or the one it is in (`at_seq` itself, reserved
        and not stored yet, included), still being written makes the fork wait:
        StorageUnavailable, nothing written. The same fork retried is stored once; an existing
        `new_conversation_id` is a Conflict. A source deleted, or its user erased, before
        the fork's check of it passed is NotFound, and what the fork wrote is taken back,
        by the attempt that finds it or by a retry (`_unless_its_source_went`); one whose check
        finds that a pop removed a `seq` it copies since it read its source is taken back too,
        and made as a fresh fork would be now: InvalidInput for an `at_seq` the source no longer
        holds, never a fork holding a popped message (a second such race, StorageUnavailable:
        retry). A fork refused
        while an earlier attempt's fork, never given its copies, holds `new_conversation_id`
        takes that empty fork back and is made as a fresh fork now; one refused by a fork that
        stored its copies is a Conflict naming it (`_settle_refused_fork`). A take-back cut
        short is finished by a retry, whatever stands under the source's id since
        (`_finish_taking_back`). A fork whose owner's account is claimed after it read its
        source is the new owner's once both answered: its check moves it with its source
        (`_with_its_source`), where the claim did not see it. With `version`
        (`Conversation.version`: the source as its caller read it, a page's), a source deleted
        and started again under its id since is VersionMismatch, nothing written.
        """
        conversation_id = validate_identifier(conversation_id, "conversation_id")
        actor = Actor(user_id, owner_only)
        once = partial(self._fork_once, version=version)
        try:
            return await once(conversation_id, at_seq, new_conversation_id, actor)
        except PoppedWhileForked:
            pass  # taken back: made as a fresh fork would be now
        except (InvalidInput, Conflict) as refused:
            await self._settle_refused_fork(
                conversation_id, at_seq, new_conversation_id, actor, refused
            )
        except BeingDeleted as refused:
            await self._finish_taking_back(conversation_id, new_conversation_id, actor, refused)
        return await once(conversation_id, at_seq, new_conversation_id, actor)

    async def _fork_once(
        self,
        conversation_id: str,
        at_seq: int,
        new_conversation_id: str,
        actor: Actor,
        *,
        version: str | None = None,
    ) -> LoggedTurn:
        """One attempt of `fork`, its source's id validated."""
        try:
            source, read = await self._fork_source(conversation_id, actor, at_seq, version)
        except NotFound:
            await self._settle_earlier_attempt(conversation_id, new_conversation_id, actor)
            raise
        messages = read.messages
        self._refuse_a_point_being_written(conversation_id, source, read, at_seq)
        end = fork_end(messages, at_seq, read.turn_starts)
        _refuse_too_large_a_fork(read, at_seq, end)
        self._refuse_unfinished(conversation_id, source, read.stored, end, read.read_at)
        chosen = forked_messages(messages, end)
        # Whole texts put back: the copies are bounded again and keep files of their own, so
        # the fork shares none with the original (deleting one leaves the other whole).
        plan = plan_turn(
            new_conversation_id,
            fork_copies(await self._full_texts.restore(chosen)),
            turn_id=fork_turn_id(conversation_id, end),
            rules=self.rules,
            copied=True,
        )
        origin = ForkOrigin(
            conversation_id=conversation_id,
            seq=end,
            turn_starts=fork_turn_starts(chosen, read.turn_starts),
            version=conversation_version(
                conversation_id, source.get("epoch"), source["created_at"]
            ),
        )
        kept = await self._answers_kept(source, messages, end)
        approved = _approvals_of_copies(kept.approved, chosen, plan)
        plan = _leaving_what_the_copies_left(plan, chosen, origin, kept)
        answered = answers_in_fork(kept.copied, chosen, _fork_ids(chosen, plan))
        condition = _fork_condition(plan, origin, source, kept.resolved, approved, answered)
        owner = replace(actor, user_id=source.get("user_id"))
        started = time.monotonic()
        reserved = await self._reserve(plan, owner, None, condition)
        # Its copies keep 0…n, which `forked_from.turn_starts` names: a fork never moves them.
        try:
            stored, reserved = await self._store(plan, reserved, started, None)
        except _DeletedSince:  # its copies went with its conversation: its check comes first
            await self._fork_checked(conversation_id, plan, reserved, (source, origin))
            raise
        followed = await self._fork_checked(conversation_id, plan, reserved, (source, origin))
        if followed is not None:  # a claim moved its source first: the fork went with it
            stored, reserved = _followed_to(followed, stored, reserved)
        return await self._told(plan, reserved, stored)

    async def _fork_checked(
        self,
        conversation_id: str,
        plan: TurnPlan,
        reserved: _Reserved,
        read: tuple[Mapping[str, Any], ForkOrigin],
    ) -> str | None:
        """`_unless_its_source_went` for the fork `reserved` made from its source as `read`
        (and its origin); a replay checks the fork only if its `fork_check` is still there,
        read back. Also for an attempt whose copies went with its conversation (`_store`
        refused it, `_DeletedSince`): a pop since its read makes the fork again as it would be
        now (`PoppedWhileForked`), else its refusal stands."""
        source, origin = read
        created = None if reserved.replayed else _fork_as_created(reserved, source, origin)
        return await self._unless_its_source_went(conversation_id, plan.conversation_id, created)

    async def _answers_kept(
        self, source: Mapping[str, Any], messages: Sequence[AgentMessage], end: int
    ) -> ForkAnswers:
        """What a fork ending at `end` keeps of the answers a person gave in `source`: those
        given before the original went past `end` (`answers_before`), folded with the
        messages it copies, the request ids they leave resolved and the approvals they gave."""
        answered = answered_in(source)
        copied = answers_before(answered, await self._answers_reach(source, end, answered))
        folded = fork_fold(messages, end, fork_turns_of(source), copied)
        return ForkAnswers(
            copied=copied,
            folded=folded,
            resolved=resolved_in_fork(source.get("resolved_hitl") or (), answered, copied, folded),
            approved=approvals_in_fork(source.get("approved_calls") or (), answered, folded),
        )

    async def _answers_reach(
        self, source: Mapping[str, Any], end: int, answered: Sequence[Answer]
    ) -> int | None:
        """The first `seq` past `end` where `source` stored a message, or a turn is still
        writing one (`Gaps.written`), below the farthest reach of its answers; None when
        none is (one read, none when no answer reaches past `end + 1`)."""
        farthest = max((answer[1] for answer in answered), default=0)
        if farthest <= end + 1:
            return None
        own = _own_messages(str(source["_id"]), source)
        query = {**own, "seq": {"$gt": end, "$lt": farthest}}
        read_at = utc_now()  # before the messages are read: what judges the `seq`s they lack
        with storage_errors("read the conversation"):
            found = (
                await self._messages.find(query, {"_id": 0, "seq": 1})
                .sort("seq", 1)
                .limit(1)
                .to_list(None)
            )
        first = int(found[0]["seq"]) if found else farthest
        writing = Gaps.of(source).written(
            range(end + 1, first), now=read_at, abandon_after=self.rules.abandon_after
        )
        return writing if writing is not None else (first if found else None)

    async def _settle_refused_fork(
        self,
        conversation_id: str,
        at_seq: int,
        new_conversation_id: str,
        actor: Actor,
        refused: StoreError,
    ) -> None:
        """After a fork into `new_conversation_id` was `refused` (its source no longer holds its
        at_seq, holds other messages up to it, or the id is taken): returns, to have the fork
        made as a fresh one, once an earlier attempt's fork there, which stored none of its
        copies (nothing of it was ever served), or whose check, never passed, finds a pop since
        its read that removed a `seq` it copies, is taken back (`_take_back_fork`); raises
        `refused` when no fork of this source the actor may see is there, or none this request
        could retry (one copying up to a `seq` below `at_seq`: another fork, perhaps an
        attempt still inserting, is never taken back for a request it does not answer), and a
        Conflict naming that fork, which stands, when it stored its copies otherwise (never the
        internal turn holding them). One round trip when there is no such fork.

        An attempt of the fork still inserting its copies is let land first: the fork is
        found empty twice, `claim_grace` apart (a wait on this path only). An insert slower
        than that, landing after the take-back, follows its conversation and takes its own
        copies back (`_follow_the_conversation`), as after a delete."""
        fork = await self._fork_into(conversation_id, new_conversation_id, actor)
        if fork is None or at_seq > ForkOrigin.model_validate(fork["forked_from"]).seq:
            raise refused
        if fork.get(FORK_CHECK) is not None:
            if not await self._copies_stored(fork):
                await pause(self.rules.claim_grace.total_seconds())
                if not await self._copies_stored(fork) and await self._take_back_fork(
                    fork["_id"], fork
                ):
                    return
            # Its copies stored and its check never passed (its answer lost): checked now,
            # so the fork the Conflict names is served (or, its source gone, taken back).
            try:
                await self._unless_its_source_went(conversation_id, fork["_id"], fork)
            except PoppedWhileForked:
                return  # a pop since its read: taken back, and made as a fresh fork now
        raise _fork_stands(conversation_id, fork, at_seq, refused)

    async def _fork_into(
        self,
        conversation_id: str,
        new_conversation_id: str,
        actor: Actor | None,
        *,
        unchecked: bool = False,
    ) -> dict[str, Any] | None:
        """The fork of `conversation_id` holding `new_conversation_id` (with `unchecked`, only
        while its check has not passed: it still holds its `fork_check`), if `actor` (any
        caller for None) may see it; else None. One round trip, none for an invalid id."""
        try:
            new_id = validate_identifier(new_conversation_id, "conversation_id")
        except InvalidInput:
            return None
        query = conversation_by_id(new_id) | {"forked_from.conversation_id": conversation_id}
        if unchecked:
            query["fork_check"] = {"$ne": None}
        with storage_errors("read the conversation"):
            fork: dict[str, Any] | None = await self._conversations.find_one(
                query,
                {"user_id": 1, "epoch": 1, "created_at": 1, "fork_check": 1, "forked_from": 1},
            )
        if fork is None or (actor and actor.refusal(new_id, fork.get("user_id")) is not None):
            return None
        return fork

    async def unfinished_fork_end(
        self, conversation_id: str, new_conversation_id: str
    ) -> int | None:
        """The `seq` a fork of `conversation_id` into `new_conversation_id` copies up to (its
        `forked_from.seq`) while it is a fork not made yet (its check never passed: its
        attempt crashed, or was cancelled, inside `fork`, and every read answers it as
        missing); None when there is none. `fork` at that `seq` finishes it, however far the
        source went on since. One round trip."""
        fork = await self._fork_into(conversation_id, new_conversation_id, None, unchecked=True)
        if fork is None:
            return None
        return ForkOrigin.model_validate(fork["forked_from"]).seq

    async def require_written(
        self, conversation_id: str, stored: Collection[int], *, read_at: datetime
    ) -> None:
        """StorageUnavailable (retry shortly), as `fork` answers, when a turn below the last of
        the `seq`s `stored` (those a read of the conversation's messages found), or the turn
        that `seq` is in, is still being written: a copy of what was read would miss its
        messages. Blocks older than `abandon_after` at `read_at` (the clock read before that
        read), and `seq`s a pop removed, are passed (`Gaps.passed`). One round trip; none
        when nothing was read."""
        if not stored:
            return
        with storage_errors("read the conversation"):
            source = await self._conversations.find_one(
                conversation_by_id(conversation_id), {"message_count": 1, **GAPS_READ}
            )
        if source is not None:
            self._refuse_unfinished(conversation_id, source, stored, max(stored), read_at)

    async def _copies_stored(self, fork: Mapping[str, Any]) -> bool:
        """Whether any message of the fork's conversation (its `epoch`) is stored."""
        with storage_errors("read the conversation"):
            stored = await self._messages.count_documents(
                {"conversation_id": fork["_id"], "epoch": fork.get("epoch")}, limit=1
            )
        return bool(stored)

    async def _unless_its_source_went(
        self, conversation_id: str, new_id: str, fork: Mapping[str, Any] | None
    ) -> str | None:
        """After a fork's writes: NotFound, as for a source gone before the fork read it, once
        what the fork wrote is taken back (`_take_back_fork`), when a delete or an erasure of
        its source has begun (its `DeletionRecords` record is there) or its source is no longer
        the conversation it read (gone, perhaps started again under its id: another `epoch`,
        `same_conversation`); PoppedWhileForked, taken back so too, when a pop since the fork
        read its source removed a `seq` it copies (`_popped_under`; `fork` makes it again).
        Two round trips: the record, then the source; a third, when neither is found, clears
        the fork's `fork_check`: from then on the fork stands. The source read names its
        owner: a fork made under an owner whose account was claimed since first follows its
        source to the new owner (`_with_its_source`); the owner it moved to is answered (None:
        not moved).

        `fork` is the fork's conversation as created (`_fork_as_created`); None for a replay,
        which reads it back and checks it only while its `fork_check` is there: an earlier
        attempt whose check failed or was cancelled (its caller's timeout) left it, and a
        replay of a fork that stood takes nothing back, whatever became of its source since.

        A deletion records itself before its first destructive command and removes its record
        after the source's document went, as its last step. So, whenever it lands:
        - before the fork's writes, or between them and this check: the check finds the record,
          or (the deletion finished) no source; the fork takes back what it wrote, and nothing
          the deletion took of the fork (an erasure takes the user's conversations it lists, the
          fork's among them) is left to take;
        - after this check: the check read no record and then the source, so the deletion
          recorded itself after every write of the fork, its move to its source's owner too.
          The fork is a conversation of its own, whole before the deletion began: a delete of
          the source leaves it; an erasure of its owner (the source's) takes it as any of the
          user's conversations, listed, or, created after the erasure listed them, by the user
          its messages and its document name (its whole texts by those messages, there before
          the erasure's cleanup of them).
        A delete of the fork's own conversation while the fork writes is a delete racing a turn:
        it sweeps the copies landing late (`ConversationStore.delete`)."""
        if fork is None:
            fork = await self._fork_into(conversation_id, new_id, None, unchecked=True)
            if fork is None:
                return None  # it stood: an earlier attempt's check passed
        checked, source = await self._with_its_source(conversation_id, new_id, fork)
        if source == "whole":
            with storage_errors("record the fork's check"):
                cleared = await self._conversations.update_one(
                    {**same_as_read(new_id, fork), "fork_check.taking_back": {"$ne": True}},
                    {"$unset": {"fork_check": ""}},
                )
            owner = checked.get("user_id")
            if owner == fork.get("user_id"):
                return None
            if not cleared.matched_count:  # moved to its source's owner: is it there?
                await self._unless_it_went(new_id, checked)
            return owner
        if not await self._take_back_fork(new_id, checked):
            return None
        if source == "popped":
            raise _popped_while_forked(conversation_id, checked)
        raise _source_went_away(conversation_id)

    async def _unless_it_went(self, new_id: str, fork: Mapping[str, Any]) -> None:
        """After a fork's check moved it to its source's owner (an account claimed meanwhile)
        but cleared no `fork_check`: the fork stands when another attempt's check cleared it
        first; else its own conversation went while it was made (the erasure of the claimed
        account, which no longer holds the source, took it) or is being taken back. What it
        wrote goes (`_take_back_fork`) and it is NotFound, never answered as the new owner's
        fork. One lookup, on that path only. (A fork not moved, whose conversation its owner
        deleted meanwhile, is a delete racing a turn: `ConversationStore.delete`.)"""
        with storage_errors("read the fork"):
            now = await self._conversations.find_one(same_as_read(new_id, fork), {FORK_CHECK: 1})
        if now is not None and now.get(FORK_CHECK) is None:
            return  # it stood: another attempt's check passed first
        await self._take_back_fork(new_id, fork)
        raise NotFound(
            f"conversation {new_id!r} was deleted while the fork made it (its owner's account "
            "erased): the fork was not made; fork again"
        )

    async def _with_its_source(
        self, conversation_id: str, new_id: str, fork: Mapping[str, Any]
    ) -> tuple[Mapping[str, Any], SourceNow]:
        """The fork's check of its source (`_unless_its_source_went`): the fork as it is once
        checked, and whether its source is whole (no deletion under way, the conversation it
        read, no pop since the fork read it removed a `seq` the fork copies), went, or was
        popped so (`_popped_under`). A fork whose source is another user's than the fork is
        (its owner's account claimed after the fork read the source, and moved before the fork
        created its conversation, which the claim then did not see) follows it first
        (`_follow_its_source`), and the source is checked again, so a check that found the
        source whole found the fork its owner's: a deletion (an erasure of the new owner)
        beginning after it finds the fork where it finds the source. A claim moving the
        source after that check moves the fork with it, there by then. An unowned fork stays
        unowned, its source assigned since or not, as a retry leaves it."""
        check = ForkCheck.model_validate(fork[FORK_CHECK])
        if check.taking_back:
            return fork, "went"
        for _ in range(_RESERVE_ATTEMPTS):
            source = await self._source_now(conversation_id, check)
            if source is None:
                return fork, "went"
            if await self._popped_under(fork, check, source):
                return fork, "popped"
            owner, holder = fork.get("user_id"), source.get("user_id")
            if owner is None or holder is None or holder == owner:
                return fork, "whole"
            fork = await self._follow_its_source(new_id, fork, holder)
        raise StorageUnavailable(
            f"the fork of {conversation_id!r} into {new_id!r} could not be checked: its "
            "source's owner kept changing (account claims); retry the fork"
        )

    async def _popped_under(
        self, fork: Mapping[str, Any], check: ForkCheck, source: Mapping[str, Any]
    ) -> bool:
        """Whether a pop removed a `seq` the fork copies (up to its `forked_from.seq`) from its
        source, read now (`source`), since the fork read it (`_popped_since`). A pop still
        under way there is finished first (`_pop.finish_marked`: two round trips, on that
        path only), so the fork made again reads the source as the pop leaves it."""
        end = ForkOrigin.model_validate(fork["forked_from"]).seq
        if not _popped_since(source, check, end):
            return False
        await finish_marked(self._messages, self._conversations, source)
        return True

    async def follow_its_source(self, copy: Conversation, source: Conversation) -> Conversation:
        """`copy`, a conversation made as a copy of `source` by other means than `fork` (the
        LangGraph checkpointer's `copy_thread` logs a long thread turn by turn into one it
        creates with its source's owner as read), moved to the owner `source` has now, as a
        fork follows its source (`_with_its_source`): a claim of the source's user that moved
        the source after the copy read it, and before the copy created its conversation,
        did not see the copy. Moved as a fork is (`_follow_its_source`): its document, while it
        is the life `copy` names and no delete marked it, then its messages of that life. Only
        between users: an unowned copy, or a copy of an unowned source, stays as it is. The
        source is read again after each move, so claims chained meanwhile are followed too
        (StorageUnavailable when its owner keeps changing); a source that is no longer the
        conversation `source` names leaves the copy as it is (the caller's check of its source
        refuses it). Answers the copy with the owner it moved to. One round trip (the source's
        owner) when it is the copy's already, none for an unowned copy; two more per move.

        Only a copy of `source` is moved (`_refuse_unless_copy_of`): a fork of it, or a
        conversation of the owner `source` had holding nothing but the turns of its copy
        logged turn by turn (`copied_from`), none yet included; any other is InvalidInput
        before it is moved, so no conversation is handed to another user by a wrong call."""
        owner, read = copy.user_id, {"epoch": copy.epoch, "created_at": copy.created_at}
        if owner is None:
            return copy
        checked = False
        life = same_conversation(
            source.conversation_id, epoch=source.epoch, created_at=source.created_at
        )
        for _ in range(_RESERVE_ATTEMPTS):
            with storage_errors("read the conversation"):
                now = await self._conversations.find_one(life, {"user_id": 1})
            holder = None if now is None else now.get("user_id")
            if holder is None or holder == owner:
                if owner == copy.user_id:
                    return copy
                return copy.model_copy(update={"user_id": owner, "legacy_user_id": None})
            if not checked:
                await self._refuse_unless_copy_of(copy, source)
                checked = True
            await self._follow_its_source(copy.conversation_id, read, holder)
            owner = holder
        raise StorageUnavailable(
            f"the copy of {source.conversation_id!r} into {copy.conversation_id!r} could not "
            "follow its source: its owner kept changing (account claims); copy it again"
        )

    async def _refuse_unless_copy_of(self, copy: Conversation, source: Conversation) -> None:
        """InvalidInput unless `copy` is a copy of `source` (`follow_its_source`): forked from
        it, or `source`'s owner's with only turns of its copy logged turn by turn (or none
        yet). One round trip, none for a fork."""
        source_id, origin = source.conversation_id, copy.forked_from
        if origin is not None and origin.conversation_id == source_id:
            return
        if copy.user_id == source.user_id:
            query = {"conversation_id": copy.conversation_id, "epoch": copy.epoch}
            with storage_errors("read the conversation's turns"):
                turns = await self._messages.distinct("turn_id", query)
            if all(copied_from(source_id, t) for t in turns):
                return
        raise InvalidInput(
            f"conversation {copy.conversation_id!r} is no copy of {source_id!r}: only a copy "
            "follows its source's owner"
        )

    async def _follow_its_source(
        self, new_id: str, fork: Mapping[str, Any], holder: str
    ) -> dict[str, Any]:
        """The fork moved to `holder`, its source's owner now, as a claim moves a conversation
        and a turn follows its conversation's owner (`_follow_the_conversation`): its document
        while it is the one the fork created and no delete marked it, then, moved, the
        messages of its `epoch` naming another owner (the fork's copies: no turn is logged
        into a fork not made yet). Answers the fork as moved. Two round trips, on that path
        only."""
        moved_from = {"user_id": {"$nin": [holder, None]}}
        with storage_errors("move the fork to its source's owner"):
            moved = await self._conversations.update_one(
                {**same_as_read(new_id, fork), **moved_from, **NOT_BEING_DELETED},
                {"$set": {"user_id": holder, "legacy_user_id": None}},
            )
            if moved.matched_count:
                await self._messages.update_many(
                    {"conversation_id": new_id, "epoch": fork.get("epoch"), **moved_from},
                    {"$set": {"user_id": holder}},
                )
        return {**fork, "user_id": holder}

    async def _source_now(self, conversation_id: str, check: ForkCheck) -> dict[str, Any] | None:
        """The conversation a fork copied, as its `check` names it, with its owner now and what
        tells a pop since the fork read it (`_SOURCE_NOW_READ`); None when it went: a delete or
        an erasure of it has begun, or it is gone (perhaps started again under its id: another
        `epoch`). Two round trips, the second only when no deletion is under way."""
        as_read = {"epoch": check.epoch, "created_at": check.created_at}
        with storage_errors("read the conversation"):
            if await self._deletions.under_way(conversation_id, as_read):
                return None
            source: dict[str, Any] | None = await self._conversations.find_one(
                same_as_read(conversation_id, as_read), _SOURCE_NOW_READ
            )
        return source

    async def _finish_taking_back(
        self,
        conversation_id: str,
        new_conversation_id: str,
        actor: Actor,
        refused: BeingDeleted,
    ) -> None:
        """After a fork was `refused` as a write into a conversation being deleted: when that
        is an earlier attempt's fork of this source whose take-back was cut short (it holds
        `fork_check.taking_back`), the take-back is finished (`_take_back_fork`), whatever
        stands under the source's id since. Then NotFound, as the attempt that began it
        answers, when the source the fork copied (its check names its `epoch`) went; else
        returns, to have the fork made as a fresh one (the take-back of an empty fork,
        `_settle_refused_fork`). Raises `refused` when no such fork is there: a delete of
        `new_conversation_id` is under way. One round trip when there is none."""
        fork = await self._fork_into(conversation_id, new_conversation_id, actor, unchecked=True)
        check = None if fork is None else ForkCheck.model_validate(fork[FORK_CHECK])
        if fork is None or check is None or not check.taking_back:
            raise refused
        if not await self._take_back_fork(fork["_id"], fork):
            raise refused  # it stood meanwhile: another attempt's check passed first
        if await self._source_now(conversation_id, check) is None:
            raise _source_went_away(conversation_id)

    async def _settle_earlier_attempt(
        self, conversation_id: str, new_conversation_id: str, actor: Actor
    ) -> None:
        """Before a fork answers NotFound for its source: an earlier attempt of it may have
        written the fork and failed, or been cancelled, before its check passed (the fork
        holds its `fork_check`). It is checked now, and, its source gone, taken back: a retry
        leaves nothing of a source deleted or erased meanwhile. One round trip when there is
        no such fork, or the actor may not see it."""
        fork = await self._fork_into(conversation_id, new_conversation_id, actor, unchecked=True)
        if fork is None:
            return
        # The caller's NotFound is raised instead.
        with contextlib.suppress(NotFound, PoppedWhileForked):
            await self._unless_its_source_went(conversation_id, fork["_id"], fork)

    async def _take_back_fork(self, new_id: str, fork: Mapping[str, Any]) -> bool:
        """What a fork whose source went wrote goes, as a delete of its new conversation would
        take it, once the fork is marked taking back (`ForkCheck.taking_back`: from then no
        check clears its `fork_check`, and a retry finishes the take-back): recorded (
        `DeletionRecords`: a crash part-way is finished by the next delete of the id or erasure
        of the owner), the messages of its `epoch` (a conversation started under the id since
        keeps its own), the whole texts no message left names, then its document while it is
        the one the fork created, then the record. False, nothing taken, when the fork stood
        meanwhile: another attempt's check passed and cleared its `fork_check` first."""
        the_fork = same_as_read(new_id, fork)
        with storage_errors("delete the fork's copies"):
            marked = await self._conversations.update_one(
                {**the_fork, "fork_check": {"$ne": None}},
                {"$set": {"fork_check.taking_back": True}},
            )
            if not marked.matched_count and await self._conversations.find_one(
                the_fork, {"_id": 1}
            ):
                return False
        created = {"_id": new_id, "epoch": fork.get("epoch"), "created_at": fork.get("created_at")}
        await self._deletions.record([created], fork.get("user_id"))
        with storage_errors("delete the fork's copies"):
            await self._messages.delete_many({"conversation_id": new_id, "epoch": created["epoch"]})
        await self._full_texts.forget_conversations({new_id: (created["epoch"],)})
        with storage_errors("delete the fork's copies"):
            await self._conversations.delete_one(the_fork)
        await self._deletions.done(recorded_as(new_id, created))
        return True

    def _refuse_unfinished(
        self,
        conversation_id: str,
        source: Mapping[str, Any],
        stored: Collection[int],
        end: int,
        read_at: datetime,
    ) -> None:
        """StorageUnavailable (retry shortly) when a turn up to `end`, or the turn `end` is in,
        is still being written: a fork now would miss its messages, or cut a call from the
        result its turn gives it. Blocks older than `abandon_after` at `read_at`, and `seq`s a
        pop removed, are passed (`Gaps.passed`). `stored`: the `seq`s stored up to the end of
        that turn, read after `read_at`."""
        gaps = Gaps.of(source)
        through = max(end, gaps.turn_end(end, int(source.get("message_count") or 0)))
        missing = [seq for seq in range(through + 1) if seq not in stored]
        self._refuse_writing(conversation_id, gaps, missing, read_at)

    def _refuse_a_point_being_written(
        self, conversation_id: str, source: Mapping[str, Any], read: ForkRead, at_seq: int
    ) -> None:
        """StorageUnavailable, as `_refuse_unfinished` answers, when `at_seq` holds no message
        because its turn is still being written: reserved (below `message_count`) and not
        passed (`Gaps.passed`: its block younger than `abandon_after`, no pop removed it). A
        `seq` never reserved, or passed, is left to `fork_end`: InvalidInput, for good."""
        if at_seq in read.stored or any(m.seq == at_seq for m in read.messages):
            return
        gaps = Gaps.of(source)
        reserved = 0 <= at_seq < int(source.get("message_count") or 0)
        if not reserved or gaps.passed(
            at_seq, now=read.read_at, abandon_after=self.rules.abandon_after
        ):
            return
        # Read whole up to `at_seq` unless a limit stopped the read: the first `seq` up to it
        # still being written is named, as for a fork at a stored `seq`.
        missing = range(at_seq + 1) if read.over is None else [at_seq]
        unread = [s for s in missing if s not in read.stored]
        self._refuse_writing(conversation_id, gaps, unread, read.read_at)

    def _refuse_writing(
        self, conversation_id: str, gaps: Gaps, missing: Iterable[int], read_at: datetime
    ) -> None:
        """StorageUnavailable naming the first of the `missing` `seq`s (no message stored at)
        a turn is still writing (`Gaps.written`: judged at `read_at`, the clock read before
        the messages were); nothing when all are passed."""
        writing = gaps.written(missing, now=read_at, abandon_after=self.rules.abandon_after)
        if writing is not None:
            raise StorageUnavailable(
                f"a turn of conversation {conversation_id!r} is still being written at seq "
                f"{writing}: retry the fork in a moment"
            )

    async def _fork_source(
        self, conversation_id: str, actor: Actor, at_seq: int, version: str | None
    ) -> tuple[dict[str, Any], ForkRead]:
        """The conversation a fork copies (owner, next `seq`, what it awaits) and what a fork
        at `at_seq` reads of its messages as stored (`read_fork`: those it copies, and never
        much more than it may; none of a turn given up for good, `stored_by_turns_given_up`,
        never the conversation's own to copy). NotFound before any message is read when the
        conversation is missing or hidden from `actor`, so both cost the same;
        VersionMismatch when it is not the one `version` names (started again under the id
        since)."""
        with storage_errors("read the conversation"):
            source = await self._conversations.find_one(
                conversation_by_id(conversation_id),
                {
                    "epoch": 1,
                    "created_at": 1,
                    "user_id": 1,
                    "legacy_user_id": 1,
                    "message_count": 1,
                    "pending_calls": 1,
                    "pending_hitl": 1,
                    "pops": 1,
                    "forked_from": 1,
                    "resolved_hitl": 1,
                    "approved_calls": 1,
                    DELETING: 1,
                    FORK_CHECK: 1,
                    MIGRATING: 1,
                    **ANSWERED_READ,
                    **GAPS_READ,
                },
            )
            # Legacy turns not migrated yet (or still being migrated, `MIGRATING`): refused
            # as any write to them, also beside a conversation the caller sees none of.
            seen = _seen_by(actor, source)
            if seen is None or seen.get(MIGRATING) is not None:
                await self._refuse_unmigrated(conversation_id, actor, "forked")
            # A source being deleted (or whose delete failed part-way), or a fork not made yet
            # (`STANDING`), is no conversation to forks either.
            hidden = source is None or not is_standing(source)
            if hidden or actor.refusal(conversation_id, source.get("user_id")):
                raise NotFound(f"conversation {conversation_id!r} was not found")
            if version is not None and life_named(conversation_id, source, version) is None:
                raise VersionMismatch(
                    f"conversation {conversation_id!r} is not the one named: it was deleted "
                    "and started again since that version was read; nothing was forked (read "
                    "it again to see what is there now)"
                )
            own = _own_messages(conversation_id, source)
            count = int(source.get("message_count") or 0)
            read = await read_fork(
                self._messages,
                own,
                at_seq,
                partial(Gaps.of(source).turn_end, message_count=count),
                self.rules.max_message_bytes,
                fork_turns_of(source),
                stored_by_turns_given_up(source),
            )
        return source, read

    # -- reserving -------------------------------------------------------------------

    async def _reserve(
        self,
        plan: TurnPlan,
        actor: Actor,
        name: str | None,
        condition: Condition | None = None,
    ) -> _Reserved:
        """Reserve the turn's `seq` block, or find the block an earlier attempt reserved.

        A `condition` adds to the reservation's filter and update; its `refusal` is raised only
        when the conversation as it stands does not meet it (`_refuse_unless_met`, once a fold
        owed is written); every race lost, `_RESERVE_ATTEMPTS` times: `Unreserved`.
        """
        _refuse_migrated_turn_id(plan.turn_id)
        await self._finish_in_doubt(plan)
        complete = True
        may_create = condition is None or condition.create
        # Wired to legacy turns, a new conversation is first checked against them; an id
        # the migration derives is never created here.
        create = may_create and self._legacy is None and not is_derived_id(plan.conversation_id)
        own: range | None = None  # the turn's empty block, given back: what it set is its own
        for _ in range(_RESERVE_ATTEMPTS):
            query = reservation_filter(plan, actor, records_complete=complete)
            if condition is not None:
                query |= condition.filter if own is None else condition.again(own)
            doc = await self._try_reserve(
                plan, actor, name, query, upsert=create, condition=condition
            )
            if doc is not None:
                return _reserved(plan, doc, observed=bool(self._observers))
            found = await self._unreserved_on(plan, actor, condition, collided=create)
            if await self._finished_a_pop(actor, found):
                continue  # its summary corrected: the turn decides on it as it now stands
            try:  # a retry past `abandon_after` that cannot move gives its turn up
                verdict = await self._verdict(plan, actor, found, condition, complete=complete)
                replayed = await self._replayed_by(actor, plan, verdict, found, condition)
            except (Unmovable, Unlanded) as refused:
                assert found is not None  # only a conversation records a block
                await self._given_up_for(plan, refused, found)
                _raise_refusal(refused)
            if replayed is not None:
                return replayed
            if found is None:  # may be created: `_verdict` refused it otherwise
                create = True
                continue
            if verdict.proved_new:  # looked up once, then the condition refuses
                complete = False
                continue
            if verdict.abandoned is not None:  # given back, the turn reserves anew
                own = await self._give_back_abandoned(plan, verdict.abandoned, found)
                continue
            if verdict.block is not None:
                continue  # another attempt moved the turn meanwhile: its new block is recorded
            await self._refuse_unless_met(plan, actor, found, condition, own)
            # Otherwise a race was lost (the conversation just created, a mark gone): reserve again.
        raise Unreserved(
            f"could not reserve turn {plan.turn_id!r} after {_RESERVE_ATTEMPTS} attempts"
        )

    async def _settle(
        self,
        conversation_id: str,
        moved: Mapping[str, Any] | None,
        life: Mapping[str, Any],
        *,
        quiet: bool = False,
    ) -> bool:
        """The conversation's pending state folded from its stored messages and written
        (`_relocated.settle`: from `moved`, the conversation as a move left it, else read),
        after a move or for a fold owed (`REFOLD_OWED`), to the life the turn read it in
        (`life`, `same_as_read`) only; False, the fold owed, when it could not be written.
        `quiet`: a replay's, written only where it changes something."""
        return await settle(
            self._conversations,
            self._messages,
            conversation_id,
            moved,
            abandon_after=self.rules.abandon_after,
            name_chars=self.rules.name_chars,
            quiet=quiet,
            life=life,
        )

    async def _refuse_unless_met(
        self,
        plan: TurnPlan,
        actor: Actor,
        found: Mapping[str, Any],
        condition: Condition | None,
        own: range | None,
    ) -> None:
        """For a reservation that matched nothing, of a turn the conversation `found` (read
        back after it, which `_verdict` judged `actor` may write to) holds no block of: the
        refusal of the condition the conversation as it stands does not meet (its `filter`,
        or `again` for the turn whose empty block `own` was given back, as the attempt asked
        it), else nothing, and the turn reserves again: its reservation failed for another
        reason, gone by the read-back (a delete's or a pop's mark met, the delete or pop over
        since; another writer's upsert creating the conversation first). Judged by the server,
        condition by condition of those the reservation joined (`Condition.judged`: a
        `version`'s first, then the turn's), each in a lookup of the conversation that does
        not meet it: the first found is refused, explained by the conversation as that lookup
        read it, never by `found` (another writer's turn may have landed since). Each lookup
        selects `found`'s conversation only (its life, `same_as_read`), while `actor` may
        write to it (`Actor.owner_filter`): one deleted since, another started under the id
        or taken by another owner meanwhile, is never judged here, and the turn reserves
        again, judged then on what stands under the id (`_verdict`: to a user, another's
        conversation is NotFound), so a refusal never explains a conversation `actor` may
        not see. One lookup per condition, on that path only; none once a fold owed was
        written (`_folded_owed`), which the turn is judged again on."""
        if condition is None or await self._folded_owed(plan, found):
            return
        judged = _as_judged(plan.conversation_id, found, actor)
        for part in condition.judged():
            asked = part.filter if own is None else part.again(own)
            with storage_errors("read the conversation"):
                unmet = await self._conversations.find_one(with_none_of(judged, asked))
            if unmet is not None:
                raise part.refused(unmet, own=own is not None)

    async def _folded_owed(self, plan: TurnPlan, found: Mapping[str, Any]) -> bool:
        """Before a reservation refused by its condition raises: whether the conversation
        `found` was owed a fold of its pending state (`REFOLD_OWED`), now written, so the turn
        is judged again on it, not on the state the fold was owed for (the calls and prompt
        of a turn given back). A fold still not written: `Unreserved`, nothing written, the
        turn sent again as it is. False, at no cost, when none is owed."""
        if found.get(REFOLD_OWED) is None:
            return False
        life = same_as_read(plan.conversation_id, found)  # the life judged, read with its epoch
        if not await self._settle(plan.conversation_id, None, life):
            raise Unreserved(
                f"could not reserve turn {plan.turn_id!r}: the pending state of conversation "
                f"{plan.conversation_id!r} is still to be folded again from its stored "
                "messages (turns being written); send the turn again as it is"
            )
        return True

    async def _finished_a_pop(self, actor: Actor, found: Mapping[str, Any] | None) -> bool:
        """Whether the conversation `found` (read whole, or with `popping`), which `actor` may
        write to, was marked by a pop under way, now finished (`_pop.finish_marked`): its
        summary is read again before anything is decided on it. None is finished for a
        conversation `_verdict` refuses anyway (another user's, or no conversation)."""
        if found is None or not is_standing(found):
            return False
        if actor.refusal(str(found["_id"]), found.get("user_id")) is not None:
            return False
        return await finish_marked(self._messages, self._conversations, found)

    async def _verdict(
        self,
        plan: TurnPlan,
        actor: Actor,
        found: Mapping[str, Any] | None,
        condition: Condition | None,
        *,
        complete: bool = True,
    ) -> _Verdict:
        """Whether the turn is new, a retry, or refused, and why, as the conversation `found`
        says: what `_reserve` does once its reservation matched nothing, and `check_turn`
        does before writing, so the two cannot drift. Read only. Raises: the conversation
        missing and not to be created (`_absent`; a legacy or derived id, `_refuse_unmigrated`),
        another user's (`Actor.refusal`), being deleted (before any replay: nothing comes
        back), a retry's refusal (`_retry_of`: popped, other content; past `abandon_after`,
        nothing stored, a later message answering its call: `Unmovable`, whatever content it
        sends, from the lookup of its empty block the move then takes), a fork not made yet
        (`FORK_CHECK`: only the fork's own turn writes to it, `unfinished_fork`), a runtime's
        turn id (`Actor.running_refusal`). The turn's block is its record's, or, with records
        dropped (and `complete`: not proved new already), that of its first message stored,
        looked up as past the kept records (`_block_of_an_old_turn`: on that path only),
        however many turns came in between. A new turn's condition is the caller's to decide."""
        if _seen_by(actor, found) is None:  # none, or one as if none
            await self._refuse_unmigrated(plan.conversation_id, actor, condition=condition)
        if found is None:
            if condition is not None and not condition.create:
                raise _absent(plan.conversation_id, actor, condition)
            _refuse_derived(plan.conversation_id, actor)
            return _Verdict()
        refusal = actor.refusal(plan.conversation_id, found.get("user_id"))
        if refusal is not None:
            raise _held(refusal, condition, another_owners=True)
        if found.get(DELETING) is not None:
            raise being_deleted(plan.conversation_id, _refused_turn(plan))
        if found.get(MIGRATING) is not None:  # the migration is still writing it
            raise being_migrated(plan.conversation_id, _refused_turn(plan))
        block = recorded_block(found, plan.key, sent=plan)
        if block is None and _recorded_before(plan, found):
            raise _DerivedBefore(str(plan.derived_before))
        looked_up = block is None and complete and bool(found.get("turns_dropped"))
        if looked_up:
            block = await self._block_of_an_old_turn(
                plan, partial(_retry_refusal, plan, found, condition)
            )
        if block is not None:
            return await self._retry_of(plan, block, found, condition)
        new_only = condition is not None and condition.new_only
        if found.get(FORK_CHECK) is not None and not new_only:  # only the fork's own turn
            raise unfinished_fork(plan.conversation_id, _refused_turn(plan))
        if (running := actor.running_refusal(plan, found)) is not None:
            raise running
        return _Verdict(proved_new=looked_up)

    async def _try_reserve(
        self,
        plan: TurnPlan,
        actor: Actor,
        name: str | None,
        query: dict[str, Any],
        *,
        upsert: bool,
        condition: Condition | None = None,
    ) -> dict[str, Any] | None:
        """One reservation: the conversation's summary, or None when the filter matched none."""
        now = utc_now()
        pipeline = reservation(plan, actor, name, self.rules, now)
        if condition is not None:
            pipeline[0]["$set"] |= condition.stage(now)
        with storage_errors("reserve the turn"):
            try:
                doc: dict[str, Any] | None = await self._conversations.find_one_and_update(
                    query,
                    pipeline,
                    upsert=upsert,
                    projection=SUMMARY if self._observers else RESERVED,
                    return_document=ReturnDocument.AFTER,
                )
            except DuplicateKeyError:
                return None
        return doc

    async def _unreserved_on(
        self, plan: TurnPlan, actor: Actor, condition: Condition | None, *, collided: bool
    ) -> dict[str, Any] | None:
        """The conversation a reservation matched none of, as it stands now (one lookup); None
        when there is none, after `_refuse_held_by_a_legacy_turn` when the reservation's
        creation of it `collided` with a document under the id (an upsert that matched none
        raised `DuplicateKeyError`)."""
        with storage_errors("read the conversation"):
            found: dict[str, Any] | None = await self._conversations.find_one(
                conversation_by_id(plan.conversation_id)
            )
        if found is None and collided:
            await self._refuse_held_by_a_legacy_turn(
                plan.conversation_id, actor, condition=condition
            )
        return found

    async def _refuse_held_by_a_legacy_turn(
        self, conversation_id: str, actor: Actor, *, condition: Condition | None = None
    ) -> None:
        """Refuse a write whose creation of the conversation collided with a document under
        its id (`DuplicateKeyError`) that is a legacy turn, no conversation
        (`LEGACY_TURN_DOCUMENT`, which `conversation_by_id` never matches): an old-service
        writer logged it into `agent_conversations` under that `_id` (MIGRATION.md,
        `relocate.held_by_left`), and no conversation is created where it stands until a run
        has moved it aside: refused as not migrated yet (`not_migrated_yet`; a fork's
        reservation as for any id that is taken, `_held`), NotFound to a user token the turn
        does not name, nothing written. A turn whose `user_id` holds bytes that are not valid
        UTF-8 names nobody (`ownership_read`), and holds the id all the same (was: its strict
        read a StorageFailure). Nothing when none is there (another writer created the
        conversation meanwhile). One round trip, on that path only."""
        held = {"_id": conversation_id, **LEGACY_TURN_DOCUMENT}
        with storage_errors("read the conversation"):
            read = await ownership_read(self._conversations, held, {"user_id": 1})
        if read.owned or read.unowned:
            owner = read.owned[0].get("user_id") if read.owned else None
            raise _not_migrated(conversation_id, actor, owner, "written", condition)

    async def _replayed_by(
        self,
        actor: Actor,
        plan: TurnPlan,
        verdict: _Verdict,
        conversation: dict[str, Any] | None,
        condition: Condition | None = None,
        *,
        late: bool = False,
    ) -> _Reserved | None:
        """`_replayed` of the verdict's block (with the lookup it made, `_Verdict.looked`),
        with the ownership the turn logged fresh would give the conversation: a service
        naming a user for a conversation still unowned assigns it to that user, its messages
        theirs (`_assign`, as `upsert_conversation` naming them does); never a turn that only
        creates its conversation (`Condition.new_only`, a fork's: whose the fork is was decided
        when it was made, and a replay writes nothing) but the retry of a fork not made yet
        (`FORK_CHECK`), which makes it: its source's owner now (`actor`) owns it, as a fork
        made fresh would be. None when the verdict
        is no retry's (no block); when the turn moved, or the conversation was deleted or
        taken by another user meanwhile: the reservation looks again (and refuses another
        owner's, `Actor.refusal`)."""
        if verdict.block is None or conversation is None:
            return None
        block, looked = verdict.block, verdict.looked
        reserved = await self._replayed(
            plan, block, conversation, condition, late=late, looked=looked
        )
        if reserved is None or reserved.owner is not None:
            return reserved
        made = conversation.get(FORK_CHECK) is None  # else the retry makes the fork now
        if actor.strict or actor.user_id is None or (condition and condition.new_only and made):
            return reserved
        same = _same_as_reserved(plan.conversation_id, reserved)
        doc = await self._assign(plan.conversation_id, actor.user_id, same)
        if doc is None:
            return None
        summary = None if reserved.conversation is None else Conversation.model_validate(doc)
        return replace(reserved, owner=actor.user_id, conversation=summary)

    async def _replayed(
        self,
        plan: TurnPlan,
        block: RecordedBlock,
        conversation: dict[str, Any],
        condition: Condition | None = None,
        *,
        late: bool = False,
        looked: Looked | None = None,
    ) -> _Reserved | None:
        """A retry's block: the one its first attempt reserved, unless tail readers may have
        passed it (reserved `abandon_after` ago, or `late`: the attempt that reserved it found
        itself too slow to insert there, `_past_what_readers_passed`; never a fork's not made
        yet, whose copies keep `seq` 0…n: `_passed`) and none of its messages
        is there: then a new block at the end (`_moved_to_the_end`; a reader following the
        tail never looks back), at the cost of one lookup and one update more (a rare path),
        the update setting the summary the turn's new place gives it (what it leaves pending
        is folded from the stored messages after its insert: `_relocated.settle`, two round
        trips more). A turn
        whose call a later message answers is not moved: Conflict, found by the lookup of
        its empty block (`_relocated`), and given up (`_give_up`). None when another attempt
        moved the turn meanwhile. A turn that stored part of its block completes it in
        place; one an attempt's insert stored in a block it left by a move, found by id in
        the same lookup, is stored there (`_stored_there`): no move again. `block` is the
        one `_verdict` found the retry's content matches; `looked`, its lookup `_verdict`
        made (`_Verdict.looked`), else made here. Raises `Unmovable` (the caller gives the
        turn up, `_given_up_for`)."""
        age = None if block.reserved_at is None else utc_now() - block.reserved_at
        after = self.rules.abandon_after
        passed = bool(after) and (age is None or age >= after)
        asked_about = None
        if passed and _held_again(plan, conversation, block.first_seq, None):
            epoch = conversation.get("epoch")
            asked_about = await _asked_about(self._messages, plan, block.first_seq, epoch)
        reserved = _replay(
            plan, block, conversation, condition, passed=passed, asked_about=asked_about
        )
        checked = time.monotonic()
        grace = self.rules.claim_grace
        if age is not None and age < grace:  # the earlier attempt may still be inserting
            until = checked + grace.total_seconds()
            reserved = replace(reserved, in_flight_until=until)
        if looked is None and not self._passed(block, conversation, late=late):
            by = None if age is None else _insert_by(self.rules, checked, age)
            return replace(reserved, insert_by=by)
        if looked is None:
            looked = await self._looked_up(plan, block, conversation, condition)
        if looked.refusal is not None:
            raise looked.refusal
        stored = _of_the_turn(plan, looked.stored)
        if stored:  # in its block, or where an earlier attempt's insert landed
            return await self._stored_there(plan, block, conversation, reserved, stored)
        asked = looked.asked
        return await self._moved_to_the_end(plan, block, conversation, reserved, condition, asked)

    async def _moved_to_the_end(
        self,
        plan: TurnPlan,
        block: RecordedBlock,
        conversation: Mapping[str, Any],
        reserved: _Reserved,
        condition: Condition | None,
        asked: Mapping[str, int],
    ) -> _Reserved | None:
        """`_replayed`'s move of the turn, none of whose messages is stored, from `block` to a
        new block at the end (`relocation`, guarded by the condition when it says what a move
        sets, `Condition.moved`): the block moved to, inserted into before `_insert_by` from
        the move's command; None when another attempt moved the turn meanwhile. A condition no
        longer met gives the turn up (`_give_up`), its count, preview and `updated_at` taken
        back (`_shown_before`: two or three reads more, on that path only), and raises its
        refusal. The move matches only while `conversation` is as read (`unchanged`: no turn
        reserved, none moved, no pop since), as its lookup judged it (`_looked_up`): else None
        too, and the caller reads again, so an answer to its call logged after that lookup
        refuses it as one logged before does. `asked`: the latest prompt stored past the block
        under each request id the turn raises (`asked_past`)."""
        sent, now = time.monotonic(), utc_now()
        query, pipeline = relocation(
            plan, block, self.rules, now, assigned=reserved.assigns, asked=asked
        )
        query |= unchanged(conversation)  # as its lookup judged it: else read again
        reserved = replace(reserved, insert_by=_insert_by(self.rules, sent))
        guarded = query
        if condition is not None and condition.moved is not None:
            pipeline[0]["$set"] |= condition.moved(now, block.first_seq)
            seqs = range(block.first_seq, block.first_seq + block.count)
            guarded = {**query, **condition.met_by_a_move(seqs)}
        with storage_errors("move the turn to a new block"):
            doc: dict[str, Any] | None = await self._conversations.find_one_and_update(
                guarded,
                pipeline,
                projection=None if self._observers else MOVED,
                return_document=ReturnDocument.AFTER,
            )
            # Not moved while the old record is still there: the condition no longer holds
            # (one more lookup, on that path only).
            refused = doc is None and guarded is not query
            found = await self._conversations.find_one(query, _MOVE_READ) if refused else None
            if found is not None:
                assert condition is not None  # refused: stored nowhere, its summary goes
                shown = await self._shown_before(plan, block.first_seq)
                taken_back = given_up(plan, block, conversation, shown)
                await self._give_up(
                    plan.conversation_id, conversation, taken_back=taken_back, own=block
                )
                raise condition.move_refused(found)
        return None if doc is None else _moved(plan, reserved, doc, observed=bool(self._observers))

    async def _retry_of(
        self,
        plan: TurnPlan,
        block: RecordedBlock,
        conversation: Mapping[str, Any],
        condition: Condition | None,
    ) -> _Verdict:
        """`_verdict` of a retry of the turn recorded at `block`, read only: the block, when
        no pop removed a message of it since (else `Corrected`) and it holds what the retry
        sends (its whole texts checked, `_with_whole_texts_checked`); else `_other_sent`.
        A fork's retry with its content keeps its block at `seq` 0…n however late (`_passed`);
        with other content it is refused here (settled its own way, `_fork_once`)."""
        block = await self._with_whole_texts_checked(plan, block)
        if block.popped:
            raise _corrected(plan)
        if block.count == plan.count and plan.matches(block.digest):
            if not self._passed(block, conversation):
                return _Verdict(block)
            # moved unless stored
            looked = await self._looked_up(plan, block, conversation, condition)
            if looked.refusal is not None:
                raise looked.refusal
            return _Verdict(block, looked=looked)
        if is_fork_turn(plan.turn_id):
            raise _retry_refusal(plan, conversation, condition)
        return await self._other_sent(plan, block, conversation, condition)

    async def _other_sent(
        self,
        plan: TurnPlan,
        block: RecordedBlock,
        conversation: Mapping[str, Any],
        condition: Condition | None = None,
    ) -> _Verdict:
        """A retry sending other content than its turn's record holds (a regenerated answer
        after a lost insert), read only: when a message of the turn is stored, in its block
        or under its ids (one lookup), the block its stored messages hold with this retry's
        content (`_stored_as_sent`: a replay of it), else refused (`_retry_refusal`: the
        answers the stored turn was logged without, sent again, or other content, an answer
        the turn's stored messages hold being its own: `_answered_by`); refused too when its
        record does not say what it counted. Nothing of it stored: while its
        first attempt may still insert (reserved less than `abandon_after` ago)
        StorageUnavailable; past that its block is to be given back (`_Verdict.abandoned`),
        the turn new, unless a message logged meanwhile answers one of its calls
        (`Unmovable`, as a retry of its first content: found by the same lookup,
        `_looked_up`). A new turn's conditions are then judged as the give-back leaves the
        conversation, without what its first reservation changed, not by `refused`."""
        looked = await self._looked_up(plan, block, conversation, condition)
        own = _answered_by(plan, looked.stored)
        refused = _retry_refusal(plan, conversation, condition, own)
        if looked.stored:
            return _Verdict(await self._stored_as_sent(plan, refused))
        if (block.counted is None and not block.given_up) or block.reserved_at is None:
            raise refused
        if not self._passed(block, conversation):
            raise NotStoredYet(
                f"nothing of turn {plan.turn_id!r} is stored yet, but its first attempt "
                "reserved its place with other content and may still store it until "
                f"`abandon_after` ({self.rules.abandon_after}) from then: retry later, and "
                "this content is logged under the turn id"
            )
        if looked.refusal is not None:
            raise looked.refusal
        return _Verdict(abandoned=block)

    async def _give_back_abandoned(
        self, plan: TurnPlan, block: RecordedBlock, conversation: Mapping[str, Any]
    ) -> range:
        """Give back the block a first attempt with other content reserved and stored nothing
        in (`_Verdict.abandoned`): once (`given_back_abandoned`: its turn starts and tokens
        taken back, its `seq`s gaps tail readers pass, its record naming the turn no more, the
        preview and `updated_at` its reservation set taken back, read first as `_give_back`
        reads them: `_shown_before`, two or three lookups, on this path only), with the
        pending state folded again (`_give_up`); the turn then reserves anew. An automatic
        name its first attempt gave (`conversation` as read takes it from one of the block's
        ids) goes in the same update, as `_give_back` takes it (one read more, then only): a
        fold lost after it leaves no name the retry, stored anew under those ids, would
        keep. Returns the block's `seq`s (what the turn's reservation anew meets, `own`)."""
        cid = plan.conversation_id
        epoch, created = conversation.get("epoch"), conversation.get("created_at")
        same = same_conversation(cid, epoch=epoch, created_at=created)
        shown = None
        if not block.given_up:  # else taken back when it was given up
            shown = await self._shown_before(plan, block.first_seq, abandoned=True)
        query, update = given_back_abandoned(plan, block, same, conversation, shown)
        ids = block_ids(plan, block.count)
        seqs = range(block.first_seq, block.first_seq + block.count)
        if conversation.get("name_source") == "auto" and conversation.get("name_message_id") in ids:
            update.append({"$set": await self._named_from_stored(cid, ids, seqs, epoch)})
        with storage_errors("take back what the turn counted"):
            result = await self._conversations.update_one(query, update)
        if result.matched_count and not block.given_up:  # given up: folded then
            await self._give_up(cid, strict=False)
        return seqs

    async def _stored_as_sent(self, plan: TurnPlan, refused: StoreError) -> RecordedBlock:
        """The block the turn's messages are stored in, whole, with the content this retry
        sends, though its record says other content (`refused`): the stored messages are the
        truth (the record may be an attempt's that reserved past the kept records and is
        refused when its insert meets them), looked up as past the kept records
        (`_block_of_an_old_turn`: one or two lookups, on this path only). Else `refused`."""
        if not isinstance(refused, OtherContent):
            raise refused
        try:
            found = await self._block_of_an_old_turn(plan)
        except Conflict:
            raise refused from None
        if found is None:
            raise refused
        return found

    async def _stored_there(
        self,
        plan: TurnPlan,
        block: RecordedBlock,
        conversation: Mapping[str, Any],
        reserved: _Reserved,
        stored: Sequence[Mapping[str, Any]],
    ) -> _Reserved | None:
        """A retry's block once messages of the turn are found stored (`stored`, in its block or
        by their ids elsewhere): its block, or the one its messages are in, if the conversation
        records that block for the turn (one it left by a move: the turn whole there, that
        move is undone, `_undo_move`, one update more). A block the conversation as
        read (`conversation`) does not record may be one another attempt moved the turn to
        since: the records are read again (one lookup, on that path only), and a block they
        record for the turn gives None, the reservation going round once more to answer the
        turn where it is stored. A block no record names, holding the whole turn under the
        conversation's epoch, is one another attempt reserved past the kept records: its block
        is kept, for the insert to meet the turn there (`_another_attempts`) and give this one
        back. Else Conflict: what is there is not the turn's."""
        at = stored_at(plan, stored)
        if at is None or at == block.first_seq:
            return reserved
        ids = {d["_id"] for d in plan.documents}
        own = [d for d in stored if d["_id"] in ids and d.get("epoch") == reserved.epoch]
        if at in blocks_of(conversation, plan.key):
            if len(own) == plan.count:  # whole in a block it left: its move is undone
                await self._undo_move(plan, reserved, at, block.first_seq)
            return replace(reserved, first_seq=at, assigns=_assigned_at(conversation, at))
        with storage_errors("read the conversation"):
            records = await self._conversations.find_one(
                conversation_by_id(plan.conversation_id), {"turns.k": 1, "turns.f": 1}
            )
        if records is not None and at in blocks_of(records, plan.key):
            return None  # moved by another attempt since `conversation` was read
        if len(own) == plan.count:  # whole where another reservation of the turn put it
            return reserved
        raise _stored_apart(plan, block.first_seq, plan.documents[0]["_id"], at)

    async def _refuse_unmigrated(
        self,
        conversation_id: str,
        actor: Actor,
        what: str = "written",
        *,
        condition: Condition | None = None,
    ) -> None:
        """Refuse a write to a conversation missing here (a turn, a delivery, an inbox opened
        or closed, a fork of it: `what` it can be once migrated) whose id exists as legacy
        turns not migrated yet (`not_migrated_yet`), as every write to it is; NotFound to a
        user token not their owner's. A reservation that only creates (`condition`, a
        fork's) is refused as for any id that is taken (`_held`). One round trip when wired to
        legacy turns (a conversation missing here only: a new one, or a refusal), else none."""
        if self._legacy is None:
            return
        holder = await self._legacy.holder(conversation_id, user_id=actor.caller)
        if holder is not None:
            raise _not_migrated(conversation_id, actor, holder.user_id, what, condition)

    async def _block_of_an_old_turn(
        self, plan: TurnPlan, other: Callable[[Collection[str]], StoreError] | None = None
    ) -> RecordedBlock | None:
        """Past the kept records (or a record naming another attempt's block, `_stored_as_sent`):
        the block of a turn whose first message is stored, else None.

        With no record left, the stored messages are the only evidence of what the turn
        was: all of them must be there and be this turn's, and none past them. A block an
        earlier attempt filled only in part is refused rather than completed, since nothing
        tells a turn cut short from a retry sending more messages than it first did; one a
        pop took a message of is refused `Corrected`, as while the record is kept
        (`_corrected_or`). A block holding other content than the retry sends, or part of
        it, is refused by `other`, given the calls the turn's stored messages answer
        (`_retry_refusal`, as while the record is kept: a retry sending again answers its
        first attempt was logged without is `AnsweredBefore`), else `OtherContent` (or, for
        part of it, stored in part).
        """
        first_id = message_id(plan.conversation_id, plan.turn_id, 0)
        past_id = message_id(plan.conversation_id, plan.turn_id, plan.count)
        before = _first_id_before(plan)
        ids = [first_id, past_id, *([before] if before is not None else [])]
        with storage_errors("look up the turn"):
            found = await self._messages.find(
                {"_id": {"$in": ids}, "conversation_id": plan.conversation_id}, {"seq": 1}
            ).to_list(len(ids))
        by_id = {d["_id"]: d for d in found}
        if before in by_id and first_id not in by_id:  # logged under the id derived before
            raise _DerivedBefore(str(plan.derived_before))
        if past_id in by_id:  # the turn stored more messages than the retry sends
            raise _other_content(plan)
        first = by_id.get(first_id)
        if first is None:
            return None
        block = RecordedBlock(int(first["seq"]), plan.count, plan.digest)
        refuse = other or (lambda own: _other_content(plan))
        try:
            found = await self._block_read(plan, block)
            if _logged_with_fewer(plan, found):
                raise refuse(_answered_by(plan, found))
            stored = _of_the_turn(plan, found)
            if len(stored) != block.count:  # unless its answers say why (`other`)
                judged = refuse(_answered_by(plan, stored))
                fewer = isinstance(judged, OtherContent)
                raise _stored_in_part(plan, len(stored)) if fewer else judged
        except TurnConflict as refused:
            raise await self._corrected_or(plan, block, refused) from None
        if not await self._recognised(plan, content_digest(canonical_documents(stored))):
            raise refuse(_answered_by(plan, stored))
        return block

    async def _corrected_or(
        self, plan: TurnPlan, block: RecordedBlock, refused: Conflict
    ) -> Conflict:
        """The refusal of a retry past the kept records whose `block` does not hold the turn
        whole (`refused`: stored in part, or holding another turn's messages): `Corrected`
        when a pop removed one of the turn's messages from that block, as the conversation,
        read after the block's messages (one lookup, on this path only), tells it: listed
        with its `seq` (`popped_messages`) or marked by a pop under way (`popping`). Else
        `refused`, with its advice: nothing tells that a person removed what is not stored."""
        with storage_errors("read the conversation's pops"):
            pops = await self._conversations.find_one(
                conversation_by_id(plan.conversation_id), {"popped_messages": 1, "popping": 1}
            )
        return _corrected(plan) if _popped_from(plan, block, pops) else refused

    async def _with_whole_texts_checked(
        self, plan: TurnPlan, block: RecordedBlock
    ) -> RecordedBlock:
        """The block, with the plan's digest when it was recorded before cut fields recorded
        the hash of their whole text and its whole texts are the plan's (`_recognised`);
        else as it is, for `_replay` to check."""
        if block.popped or plan.matches(block.digest):
            return block
        if await self._recognised(plan, block.digest):
            return replace(block, digest=plan.digest)
        return block

    async def _recognised(self, plan: TurnPlan, digest: int) -> bool:
        """Whether a recorded turn's content `digest` is the plan's.

        A turn whose fields were cut before their `truncated` entries recorded the hash of
        their whole text has a digest of the parts kept only: it is the plan's only when the
        whole texts its files hold are the plan's too (read: two round trips more, on that
        path only). A file missing or incomplete tells nothing: refused, never taken."""
        if plan.matches(digest):
            return True
        if not plan.matches_but_whole_texts(digest):
            return False
        kept = await self._full_texts.texts(full.blob_id for full in plan.full_texts)
        return all(kept.get(full.blob_id) == full.text for full in plan.full_texts)

    # -- storing ---------------------------------------------------------------------

    async def _store(
        self, plan: TurnPlan, reserved: _Reserved, started: float, writer: _Writer | None
    ) -> tuple[list[AgentMessage], _Reserved]:
        """Insert the turn's messages into its block; answer with them as stored, and the
        block they are stored in (`reserved`, or the one another attempt of the turn stored
        them in, a replay: `_given_back`, or the one an attempt too slow to insert before tail
        readers may pass its block moves it to as `writer`, `_past_what_readers_passed`).
        After a move, a reservation that found a fold of the pending state owed
        (`_Reserved.owed`) or a block listing pending state passed and empty, or an insert
        landing past its block's `abandon_after` (`_to_fold`), the pending state is folded
        from the stored messages (`_relocated.settle`: two or three round trips more, on
        those paths only).

        A message an earlier attempt stored collides on its `_id` and is read back, so
        a retry answers with the stored timestamps, not its own.

        An insert the conversation's delete may have swept past without a second sweep is
        followed by a lookup of the conversation (`_follow_the_conversation`): a turn slower
        than `TurnRules.claim_grace` (or `abandon_after`, when shorter: a retry may have
        moved it, and a pop removed messages of it since) from its reservation (`started`,
        `time.monotonic()`) to its insert, and a retry whose insert stored messages in the
        block an earlier attempt reserved (a delete may have found every reserved `seq`
        holding its messages and so swept once only). A retry that found the turn reserved
        less than the grace ago looks only once the grace has passed since it found the
        record (`_Reserved.in_flight_until`, a wait on that path only): the earlier attempt,
        if still in flight and faster than the grace, has landed by then, and a delete that
        found the block full of the retry's messages has its late ones taken back too
        (slower, it looks itself). A first attempt faster than the grace whose block no
        retry filled, or a retry that moved its turn to a new block, is swept by the delete
        itself, which finds the block not stored and sweeps once more `claim_grace` later; a
        retry that inserted nothing found every message there. What such an insert stored
        stays (docs/RELIABILITY.md): it is not judged again against what other turns stored
        meanwhile, as a reader, a fork or a retry of the turn may have been answered with it.
        """
        plan = plan.for_epoch(reserved.epoch)  # its whole texts are this conversation's only
        await self._full_texts.keep(plan.full_texts)  # a turn with a cut message: 2 more commands
        reserved = await self._past_what_readers_passed(plan, reserved, started, writer)
        owner, first, epoch = reserved.owner, reserved.first_seq, reserved.epoch
        owed = {COPY_OWED: True} if self._copies_owed() else {}
        documents = [
            {**document, "seq": Int64(first + i), "user_id": owner, "epoch": epoch, **owed}
            for i, document in enumerate(plan.documents)
        ]
        found, inserted, reserved = await self._insert_into(plan, reserved, documents)
        reserved = await self._give_up_undone(plan, reserved, found, started)
        first = reserved.first_seq
        if reserved.assigns:
            await self._hand_over_earlier(plan.conversation_id, reserved)
        await self._fold_after_insert(plan, reserved, started)
        stored = found if found is not None else plan.stored(first, owner, epoch)
        refilled = inserted and reserved.replayed and reserved.moved is None
        if refilled and reserved.in_flight_until is not None:
            await self._wait_until(reserved.in_flight_until)  # the earlier attempt lands first
        # A turn is moved, its block passed, only once older than `abandon_after`.
        slow = min(self.rules.claim_grace, self.rules.abandon_after).total_seconds()
        if refilled or time.monotonic() - started > slow:
            stored = await self._follow_the_conversation(plan, reserved, stored)
        if reserved.replayed and stored:
            await self._follow_times(plan, reserved, stored, inserted=inserted)
        return stored, reserved

    async def _fold_after_insert(self, plan: TurnPlan, reserved: _Reserved, started: float) -> None:
        """The pending state folded from the stored messages after the turn's insert, when it
        is to be (`_to_fold`, `_settle`). A fold that could not be written (owed: a turn below
        the end still being written) after an insert landing past its block
        (`_landed_past_its_block`) still takes the calls the turn answers off `pending_calls`,
        and the prompt those answers clear off `pending_hitl` (`_relocated.take_answered_off`:
        two or three round trips more, on that path only), where a fold that found its block
        passed and empty listed them again: the turn is acknowledged with its answers
        standing, never with the calls they answer, or the prompt they clear, listed. A
        replay finding the conversation listing otherwise than the turn's stored messages
        leave it (`_Reserved.relisted`: its first attempt's writer cut after its insert,
        before its fold) does the same before its acknowledgement, holding again only the
        approvals it finds free (`_Reserved.unheld`): taking off is idempotent, the update
        matching only while a call is listed, and the fold writes only what differs."""
        if not await self._to_fold(plan, reserved, started):
            return
        landed = self._landed_past_its_block(plan, started)
        same = _same_as_reserved(plan.conversation_id, reserved)
        held, marked = (
            await self._held_on_landing(plan, reserved, same) if landed else (reserved.unheld, ())
        )
        if held or marked:
            await hold_asked_again(self._conversations, same, plan, reserved.pops, held, marked)
        if await self._settle(plan.conversation_id, reserved.moved, same, quiet=reserved.relisted):
            return
        if landed or reserved.relisted:
            first = reserved.first_seq
            await take_answered_off(
                self._conversations,
                self._messages,
                same,
                plan,
                range(first, first + len(plan.documents)),
                epoch=reserved.epoch,
                pops=reserved.pops,
            )

    async def _held_on_landing(
        self, plan: TurnPlan, reserved: _Reserved, same: Mapping[str, Any]
    ) -> tuple[tuple[tuple[str, str], ...], tuple[LandedAfter, ...]]:
        """The approvals a turn landing past its block holds again (`_held_again`, the rule a
        replay of it applies), and those it marks as given before it landed (`_landed_after`),
        from the conversation as it stands: one read more, and one of the calls its prompts
        asked about (`_asked_about`) when an approval of their ids is free or given after its
        block; none for a turn asking about no approved call. Only the landing marks: a
        replay cannot tell an approval given before its first attempt landed from one given
        since."""
        if not plan.asked_again:
            return (), ()
        with storage_errors("read the approvals the turn asks about again"):
            conversation = await self._conversations.find_one(same, _APPROVALS_READ)
        first = reserved.first_seq
        if conversation is None or not (
            _held_again(plan, conversation, first, None)
            or _landed_after(plan, conversation, first, None)
        ):
            return (), ()
        asked_about = await _asked_about(self._messages, plan, first, reserved.epoch)
        marks = _landed_after(plan, conversation, first, asked_about)
        if marks:
            asked = await _asked_above(self._messages, plan, first, reserved.epoch, marks)
            marks = tuple(m for m in marks if not _for_a_later_prompt(m, conversation, asked))
        return _held_again(plan, conversation, first, asked_about), marks

    async def _to_fold(self, plan: TurnPlan, reserved: _Reserved, started: float) -> bool:
        """Whether the pending state is folded from the stored messages after the turn's
        insert: after a move, a fold owed (`_Reserved.owed`), a replay finding the listing
        otherwise than the turn's stored messages leave it (`_Reserved.relisted`), an
        insert landing past its
        block's `abandon_after` (`_landed_past_its_block`), or a block listing pending state
        found passed and empty (`_left_unstored`: one `find`, only when one was found
        passed)."""
        return (
            reserved.moved is not None
            or reserved.owed
            or reserved.relisted
            or self._landed_past_its_block(plan, started)
            or await self._left_unstored(reserved, plan)
        )

    def _landed_past_its_block(self, plan: TurnPlan, started: float) -> bool:
        """Whether the turn lists pending state of its own (`lists_pending`) and its insert
        landed later than `abandon_after` after its reservation (`started`): a writer stalled
        past the margin its check before the insert keeps, whose block a later turn may
        have found passed and empty, the pending state folded without its calls and prompt
        (`_left_unstored`); folded again now that they are stored. Never with an
        `abandon_after` of zero, where no block listing pending state is kept."""
        after = self.rules.abandon_after.total_seconds()
        return bool(after) and lists_pending(plan) and time.monotonic() - started > after

    async def _left_unstored(self, reserved: _Reserved, plan: TurnPlan) -> bool:
        """Whether a block listing pending state that the reservation found passed
        (`_Reserved.passed`) holds no message: its turn died before its insert (or a pop
        took it), so its calls and prompt, listed pending by its reservation, are made by no
        stored message and the pending state is folded again (`_relocated.settle`); or
        whether a block the conversation watches (`_Reserved.watched`: a fold found it so)
        holds one now: its turn's insert landed after that fold, its writer gone before its
        own fold, and what it stores is folded in. One `find` of the blocks' first messages,
        only when the reservation found such a block; none on the common path."""
        passed, watched = set(reserved.passed), set(reserved.watched)
        found = reserved.stored_in
        if found is None:
            found = await stored_among(
                self._messages, plan.conversation_id, reserved.epoch, passed | watched
            )
        return bool(passed - found or watched & found)

    async def _waits_for(
        self, plan: TurnPlan, reserved: _Reserved, documents: list[dict[str, Any]]
    ) -> _Reserved:
        """Before the insert of a turn whose own reservation took off `pending_calls` calls
        made in a block it found passed (`_Reserved.ahead`): the blocks it passed and those
        watched looked up (one `find`, which `_left_unstored` reads after the insert). A call
        whose block holds no message has its turn not stored (its writer may still be
        retrying, a move keeping the message ids, or its insert still in the network): the
        answer is not stored ahead of it, an orphan. The turn's block is given back, and
        with it the call the reservation took off; the fold that follows (`_give_back`)
        watches the block with the call (`PendingBlock.calls`), and the turn is refused
        `StorageUnavailable`, nothing stored, as an answer naming the call is while the
        block is watched; sent again once that turn landed, it is stored."""
        if not reserved.ahead or reserved.replayed or reserved.moved is not None:
            return reserved
        looked = set(reserved.passed) | set(reserved.watched)
        found = await stored_among(self._messages, plan.conversation_id, reserved.epoch, looked)
        unstored = sorted({call for first, call in reserved.ahead if first not in found})
        if not unstored:
            return replace(reserved, stored_in=found)
        await self._give_back(plan, reserved, documents, refused=True)
        raise _call_turn_unstored(plan, unstored)

    async def _past_what_readers_passed(
        self, plan: TurnPlan, reserved: _Reserved, started: float, writer: _Writer | None
    ) -> _Reserved:
        """The block the attempt inserts into: `reserved`, unless it is past the time tail
        readers may pass it (`_Reserved.insert_by`, else `_insert_by` from `started`, taken
        before its reservation command was sent: never later than the time the reservation
        recorded). Then, as a late retry of the turn (`_replayed`, `late`: whatever its age
        on the store's clock), the turn moves to a new block at the end (`relocation`), unless
        its messages are stored already (another attempt); the answer says where they are. A
        rare path: one lookup, and a move's (`_replayed`). A conversation gone meanwhile
        (deleted, or being deleted) or no longer recording the turn keeps `reserved`: its
        messages are swept after their insert (`_follow_the_conversation`), as before. No
        `writer` (a fork's copies, the first block of a conversation its fork call has not
        handed out yet, which keep `seq` 0…n): `reserved`. Each move is guarded by the
        conversation as read; one that other turns changed meanwhile is read again, and after
        `_RESERVE_ATTEMPTS` such races `Unreserved` (503): nothing of the turn was written,
        and it is sent again as it is, as a reservation that lost every race is."""
        by = (
            reserved.insert_by
            if reserved.insert_by is not None
            else _insert_by(self.rules, started)
        )
        if writer is None or by is None or time.monotonic() <= by:
            return reserved
        actor, condition = writer
        for _ in range(_RESERVE_ATTEMPTS):
            same = _same_as_reserved(plan.conversation_id, reserved)
            with storage_errors("read the conversation"):
                found = await self._conversations.find_one(same)
            block = None if found is None else recorded_block(found, plan.key, sent=plan)
            if found is None or block is None or found.get(DELETING) is not None:
                return reserved
            late = block.first_seq == reserved.first_seq  # else another attempt moved it
            try:
                moved = await self._replayed_by(
                    actor, plan, _Verdict(block), found, condition, late=late
                )
            except (Unmovable, Unlanded) as refused:
                await self._given_up_for(plan, refused, found)
                _raise_refusal(refused)
            if moved is None:
                continue  # moved by another attempt meanwhile: its new block is recorded
            if moved.moved is None:
                return moved
            return replace(moved, replayed=reserved.replayed)  # a first attempt is no retry
        raise Unreserved(
            f"could not move turn {plan.turn_id!r} past what readers passed after "
            f"{_RESERVE_ATTEMPTS} attempts: other turns kept changing the conversation "
            "under it; nothing was written, send the turn again as it is"
        )

    async def _insert_into(
        self, plan: TurnPlan, reserved: _Reserved, documents: list[dict[str, Any]]
    ) -> tuple[list[AgentMessage] | None, bool, _Reserved]:
        """`_insert` into the reserved block: what it answers, and the block the turn is stored
        in. A block the turn's own reservation just took (not a retry's, nor a move's) is given
        back when the turn is refused there, or before the insert when the turn answers a call
        whose turn may not be stored (`_waits_for`). The block the attempt writes into, its own
        reservation's or the one a retry found its record naming (not a move's), is given back
        when another attempt that reserved too stored the turn in a block of its own
        (`_another_attempts`; `_given_back`, which makes this attempt a replay of that block).
        The other attempt's block, when it is the higher and what it held was moved into this
        one, is given back by this attempt too (its own attempt may have died part-way, its
        record dropped since): once, whichever attempt gives it back first. A block a move of
        the turn took (this attempt's move, or the block a retry found its record naming),
        the turn found stored whole in the block that move left (an attempt stalled inside its
        insert landed there), has the move undone (`_move_undone`): given back, the turn's
        block the one it left again."""
        reserved = await self._waits_for(plan, reserved, documents)
        owner, epoch, first = reserved.owner, reserved.epoch, reserved.first_seq
        fresh = not reserved.replayed and reserved.moved is None
        gather = reserved.moved is None
        try:
            found, inserted, other = await self._insert(
                plan, documents, owner, epoch, gather=gather, fresh=fresh
            )
        except Conflict:
            if fresh:  # refused after its reservation counted it
                await self._give_back(plan, reserved, documents, refused=True)
            raise
        gathered = other is not None
        elsewhere = found if found is not None and _elsewhere(found, first, plan.count) else None
        if elsewhere is not None and (fresh or gathered):
            reserved = await self._given_back(plan, reserved, documents, elsewhere)
        elif elsewhere is not None:  # perhaps in the block a move of the turn left
            reserved = await self._move_undone(plan, reserved, elsewhere)
        elif other is not None and other > first:  # what the other block held moved here
            shifted = [{**d, "seq": Int64(int(d["seq"]) - first + other)} for d in documents]
            await self._give_back(plan, replace(reserved, first_seq=other), shifted, refused=False)
        return found, inserted, reserved

    async def _move_undone(
        self, plan: TurnPlan, reserved: _Reserved, stored: list[AgentMessage]
    ) -> _Reserved:
        """The block the turn is stored in once this attempt's move of it is undone: an
        attempt stalled inside its insert stored the turn whole (`stored`) in the block the
        move left (`_undo_move`). This attempt is a replay of it, and the fold after a move
        follows (`_relocated.settle`, from the conversation as the undo left it). The turn
        found anywhere else, or the move undone already (by another attempt), leaves the
        conversation and the block as they are, as before."""
        seqs = [m.seq for m in stored]
        at = seqs[0]
        if at is None or seqs != list(range(at, at + plan.count)):
            return reserved
        undone = await self._undo_move(plan, reserved, at, reserved.first_seq)
        if undone is None:
            return reserved
        return replace(reserved, first_seq=at, replayed=True, moved=undone)

    async def _undo_move(
        self, plan: TurnPlan, reserved: _Reserved, left_seq: int, moved_seq: int
    ) -> dict[str, Any] | None:
        """Undo the move of the turn from its block at `left_seq`, where it is found stored
        whole, to the one at `moved_seq`, never written (`move_undone`: that block given back,
        its `seq`s gaps no turn holds; the block left the turn's again, its `seq`s gaps no
        more): the conversation as the update left it, None when it matched nothing (undone
        already). One update, on that path only."""
        same = _same_as_reserved(plan.conversation_id, reserved)
        query, update = move_undone(plan, left_seq, moved_seq, same)
        with storage_errors("give back the block the turn moved to"):
            undone: dict[str, Any] | None = await self._conversations.find_one_and_update(
                query, update, return_document=ReturnDocument.AFTER
            )
        return undone

    async def _give_up_undone(
        self,
        plan: TurnPlan,
        reserved: _Reserved,
        found: list[AgentMessage] | None,
        started: float,
    ) -> _Reserved:
        """The block the turn is stored in once a give-up of it is undone: stored whole in its
        block (`found`, as the insert met it; None: as this attempt inserted it) after a retry
        gave the turn up for good there (`Unmovable`: an attempt stalled between its check
        and the server past the margin landed since). A retry knows it from its record
        (`_Reserved.given_up`); an attempt whose insert was answered past the time its check
        allowed (`_insert_by`) looks: one conditional update (`give_up_undone`), on those
        paths only. Undone, the fold after a move follows (`_relocated.settle`, from the
        conversation as the undo left it); not given up (or undone already), nothing more;
        given up in a block pops passed since, the landing counts for nothing
        (`_passed_since_given_up`: one read more when the undo matched nothing)."""
        by = (
            reserved.insert_by
            if reserved.insert_by is not None
            else _insert_by(self.rules, started)
        )
        late = by is not None and time.monotonic() > by
        first = reserved.first_seq
        seqs = [m.seq for m in found] if found is not None else [first]
        if not (reserved.given_up or late) or seqs != list(range(first, first + len(seqs))):
            return reserved
        same = _same_as_reserved(plan.conversation_id, reserved)
        query, update = give_up_undone(plan, first, same)
        with storage_errors("count the turn stored in the block given up"):
            undone: dict[str, Any] | None = await self._conversations.find_one_and_update(
                query, update, return_document=ReturnDocument.AFTER
            )
        if undone is None:
            await self._passed_since_given_up(plan, reserved, same)
            return reserved
        return replace(reserved, moved=undone)

    async def _passed_since_given_up(
        self, plan: TurnPlan, reserved: _Reserved, same: dict[str, Any]
    ) -> None:
        """Refuse a landing in the block the turn gave up for good when pops passed that block
        since (its record given up and popped, `blocks_held`): its `seq`s went back to the
        conversation, perhaps to a later turn whose reservation took them (and was given up
        there in turn), and the turn there counts for nothing. What this attempt's insert
        stored goes (the turn's ids at the block's `seq`s, under its epoch: another turn's
        messages are never touched), with the whole texts they name, and it is refused,
        never acknowledged: a later turn's landing there then stores its messages
        (`_in_place_of` gives it the block when this writer is gone before it looks). One
        read (the turn not given up so: nothing more), then one delete."""
        first, key = Int64(reserved.first_seq), Int64(plan.key)
        passed_block = {"k": key, "f": first, "g": True, "p": True}
        with storage_errors("look up the block given up"):
            passed = await self._conversations.find_one(
                {**same, "turns": {"$elemMatch": passed_block}}, {"_id": 1}
            )
        if passed is None:
            return
        documents = [
            {**document, "seq": Int64(reserved.first_seq + i)}
            for i, document in enumerate(plan.documents)
        ]
        with storage_errors("take back the turn's messages"):
            await self._messages.delete_many(
                {"conversation_id": plan.conversation_id, "epoch": reserved.epoch,
                 "$or": [{"_id": d["_id"], "seq": d["seq"]} for d in documents]}
            )  # fmt: skip
        await self._full_texts.forget_files([b for d in documents for b in stored_blob_ids(d)])
        raise _passed_since(plan, reserved.first_seq)

    async def _wait_until(self, deadline: float) -> None:
        """Wait until `deadline` (`time.monotonic()`): an earlier attempt of the turn, faster
        than `TurnRules.claim_grace`, has inserted by then if it ever does."""
        await pause(max(0.0, deadline - time.monotonic()))

    async def _insert(
        self,
        plan: TurnPlan,
        documents: list[dict[str, Any]],
        owner: str | None,
        epoch: str | None,
        *,
        gather: bool = False,
        fresh: bool = False,
    ) -> tuple[list[AgentMessage] | None, bool, int | None]:
        """Insert the turn's `documents`: the messages as stored when some were there already
        (None: as inserted), whether this insert stored any message, and, when the turn was
        found stored by another attempt that reserved a block of its own, the first `seq` of
        that attempt's block (`_another_attempts`, looked for with `gather`: a block a
        reservation of the turn took, its own or the one its record names, never one a move
        took). `fresh`: the block the turn's own reservation just took."""
        with storage_errors("insert the messages"):
            try:
                await self._messages.insert_many(documents, ordered=False)
            except BulkWriteError as exc:
                only_duplicates(exc)
                met = await self._met(plan, documents, exc)
                shift = _one_block_away(plan, documents, exc, met) if gather else None
                if shift is not None:
                    stored = await self._another_attempts(plan, documents, exc, met, shift)
                    if stored is not None:
                        other = int(documents[0]["seq"]) + shift
                        return messages_adapter.validate_python(stored), True, other
                # Read again after a fresh reservation's look (another attempt may be moving
                # the turn meanwhile) or `_another_attempts` (it may have moved it).
                if shift is not None or fresh:
                    met = await self._met(plan, documents, exc)
                found = await self._own_duplicates(exc, documents, plan, met)
                # Its own document found: inserted in place of what met it (`_in_place_of`).
                inserted = len(exc.details.get("writeErrors", [])) < len(documents) or any(
                    found.get(d["_id"]) is d for d in documents
                )
                documents = [found.get(d["_id"], d) for d in documents]
                documents = await self._to_the_conversation(
                    plan.conversation_id, documents, owner, epoch
                )
                return messages_adapter.validate_python(documents), inserted, None
        return None, True, None

    async def _met(
        self, plan: TurnPlan, documents: list[dict[str, Any]], error: BulkWriteError
    ) -> _Met:
        """What met the insert under the turn's ids, by id, and the turn's message past its
        end if one is stored (the turn stored more than this attempt sends): one lookup."""
        ids = [documents[e["index"]]["_id"] for e in error.details.get("writeErrors", [])]
        past = message_id(plan.conversation_id, plan.turn_id, plan.count)
        # The conversation id keeps this lookup on one shard of a sharded cluster.
        with storage_errors("look up the turn"):
            return {
                d["_id"]: d
                async for d in self._messages.find(
                    {"conversation_id": plan.conversation_id, "_id": {"$in": [*ids, past]}}
                )
            }

    async def _another_attempts(
        self,
        plan: TurnPlan,
        documents: list[dict[str, Any]],
        error: BulkWriteError,
        found: _Met,
        shift: int,
    ) -> list[dict[str, Any]] | None:
        """The turn as stored, when another attempt that reserved a block of its own stored
        it (past the kept records the two reservations could not see each other, the first's
        record dropped by the time the second reserved): every message of this insert that
        collided is the turn's, `shift` away (`_one_block_away`), in a block the turn did not
        leave by a move (`_left`). The turn is stored in one block: where the
        other attempt stored it when this insert stored nothing; else (the two inserts each
        stored part) in the lower of the two, each attempt moving the messages of the higher
        one there (one delete and one insert more). None otherwise: what met the insert is
        `_own_duplicates`'s to tell. One lookup more, on that path only.

        This attempt's block given back already (another attempt found it empty and stored
        the turn in the other block) is no block to gather into: an insert that stored
        messages there the other block lacks (popped since, or the turn logged with fewer)
        takes them back and is refused, `OtherContent`, touching nothing of the other block."""
        failed = [documents[e["index"]] for e in error.details.get("writeErrors", [])]
        first = int(documents[0]["seq"])
        left, given_back = await self._left(plan, first, first + shift)
        if left:
            return None  # an attempt of a turn moved to a new block: not two reservations
        if given_back and len(failed) < len(documents):
            # The other attempt gathered what this one stored into its block, the same: the
            # turn is stored there. Anything else stored there (popped since, or logged with
            # fewer messages) is not this insert's to complete.
            if (held := await self._held_there(plan, documents, shift)) is not None:
                return held
            met = {d["_id"]: d for d in failed}
            await self._take_back_inserted(plan, documents, met, documents[0].get("epoch"))
        if len(failed) < len(documents) and shift > 0:  # this block is the lower: gathered here
            moving, shift = [found[d["_id"]] for d in failed], 0
        elif len(failed) < len(documents):  # the other block is the lower: this one moves
            moving = [d for d in documents if d not in failed]
        else:
            moving = []
        return await self._gathered(plan, documents, moving, shift)

    async def _held_there(
        self, plan: TurnPlan, documents: list[dict[str, Any]], shift: int
    ) -> list[dict[str, Any]] | None:
        """The turn's messages as stored in the block `shift` away from this insert's
        (`documents`) when that block holds every one of them, each with this insert's
        content (`_same_content`); None otherwise. One lookup."""
        with storage_errors("read the turn's messages"):
            there = await self._messages.find(
                {"conversation_id": plan.conversation_id,
                 "_id": {"$in": [d["_id"] for d in documents]}}
            ).to_list(None)  # fmt: skip
        by_id = {d["_id"]: d for d in there}
        held = [by_id.get(d["_id"]) for d in documents]
        whole = all(
            found is not None
            and int(found["seq"]) == int(d["seq"]) + shift
            and _same_content(found, d)
            for found, d in zip(held, documents, strict=True)
        )
        return [d for d in held if d is not None] if whole else None

    async def _left(self, plan: TurnPlan, first: int, other: int) -> tuple[bool, bool]:
        """Whether the block starting at `other`, or this attempt's at `first`, is one the
        turn left by a move to a new block (recorded under `moved_key`, or its `seq`s gaps no
        turn holds), and whether this attempt's block was given back (below): one lookup of
        the conversation's records. This attempt's block given back
        already (its record marked so: another attempt of the turn found it empty, the turn
        stored in `other`) is not one it left: the turn is where that attempt found it."""
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(
                conversation_by_id(plan.conversation_id),
                {"turns.k": 1, "turns.f": 1, "turns.g": 1, "popped_seqs": 1},
            )
        if found is None:
            return True, False
        left, given_back = _blocks_left(found, plan.key), first in _given_back_at(found, plan.key)
        return other in left or (first in left and not given_back), given_back

    async def _gathered(
        self,
        plan: TurnPlan,
        documents: list[dict[str, Any]],
        moving: list[dict[str, Any]],
        shift: int,
    ) -> list[dict[str, Any]]:
        """The turn's messages in the block `shift` away from this insert's (`documents`), read
        back once `moving`, its messages stored in the other block, are taken from there and
        stored in that one (another attempt moving the same meets them there: the same)."""
        conversation_id = plan.conversation_id
        with storage_errors("store the turn in one block"):
            if moving:
                await self._messages.delete_many(
                    {"conversation_id": conversation_id, "epoch": documents[0].get("epoch"),
                     "$or": [{"_id": d["_id"], "seq": d["seq"]} for d in moving]}
                )  # fmt: skip
                ids = {d["_id"] for d in moving}
                wanted = [{**d, "seq": Int64(int(d["seq"]) + shift)} for d in documents
                          if d["_id"] in ids]  # fmt: skip
                try:
                    await self._messages.insert_many(wanted, ordered=False)
                except BulkWriteError as exc:  # the other attempt moved them first
                    only_duplicates(exc)
            there = await self._messages.find(
                {"conversation_id": conversation_id, "_id": {"$in": [d["_id"] for d in documents]}}
            ).to_list(None)
        by_id = {d["_id"]: d for d in there}
        for d in documents:
            at = by_id.get(d["_id"], {}).get("seq")
            if at is None or int(at) != int(d["seq"]) + shift:
                where = int(d["seq"]) + shift if at is None else int(at)
                raise _stored_apart(plan, int(documents[0]["seq"]) + shift, d["_id"], where)
        return [by_id[d["_id"]] for d in documents]

    async def _given_back(
        self,
        plan: TurnPlan,
        reserved: _Reserved,
        documents: list[dict[str, Any]],
        stored: list[AgentMessage],
    ) -> _Reserved:
        """The block the turn is stored in (`stored`, by another attempt) once the block this
        attempt's reservation took is given back (`_give_back`): this attempt is a replay."""
        await self._give_back(plan, reserved, documents, refused=False)
        first = stored[0].seq
        assert first is not None
        return replace(reserved, first_seq=first, replayed=True, assigns=False)

    async def _give_back(
        self,
        plan: TurnPlan,
        reserved: _Reserved,
        documents: list[dict[str, Any]],
        *,
        refused: bool,
    ) -> None:
        """After the turn's own reservation (a block just taken), the turn not stored in that
        block: refused (`refused`) or stored by another attempt elsewhere; or a retry's block,
        the one its record names, empty while the turn is stored in another block. What
        this insert stored there goes (its ids at the block's `seq`s, under its epoch), and the
        block is given back (`given_back`: its turn and tokens taken back, its `seq`s gaps no
        turn holds) and the preview and `updated_at` its reservation set taken back
        (`_shown_before`), and the automatic name it gave (`_named_without`), with the
        pending state folded again when the turn concerns it (`_give_up`): three round trips
        more (four for a turn with user text; two more with the fold). Raising, it is in doubt:
        the turn's retry through this logger finishes it (`_finish_in_doubt`)."""
        try:
            matched = await self._given_back_once(plan, reserved, documents, refused=refused)
        except StorageUnavailable:  # in doubt: the turn's retry finishes it (`_finish_in_doubt`)
            self._in_doubt.pop((plan.conversation_id, plan.key), None)
            self._in_doubt[plan.conversation_id, plan.key] = _GiveBack(
                plan, reserved, documents, refused
            )
            while len(self._in_doubt) > _IN_DOUBT_KEPT:
                del self._in_doubt[next(iter(self._in_doubt))]
            raise
        if matched and plan.concerns_pending:
            await self._give_up(plan.conversation_id, strict=refused)

    async def _given_back_once(
        self,
        plan: TurnPlan,
        reserved: _Reserved,
        documents: list[dict[str, Any]],
        *,
        refused: bool,
    ) -> bool:
        """`_give_back`'s writes: what the insert stored in the block goes, then the block is
        given back (`given_back`, matching once); whether that update matched."""
        with storage_errors("take back the turn's messages"):
            await self._messages.delete_many(
                {"conversation_id": plan.conversation_id, "epoch": reserved.epoch,
                 "$or": [{"_id": d["_id"], "seq": d["seq"]} for d in documents]}
            )  # fmt: skip
        same = _same_as_reserved(plan.conversation_id, reserved)
        shown = await self._shown_before(plan, reserved.first_seq)
        query, update = given_back(plan, reserved.first_seq, same, shown, refused=refused)
        if plan.auto_name_from is not None:  # the name its reservation may have given goes
            update.append({"$set": await self._named_without(plan, reserved)})
        with storage_errors("take back what the turn counted"):
            result = await self._conversations.update_one(query, update)
        return bool(result.matched_count)

    async def _named_without(self, plan: TurnPlan, reserved: _Reserved) -> dict[str, Any]:
        """The names once the turn's block is given back: an automatic name its reservation
        gave (`TurnPlan.auto_name_from`) goes back to the one the messages stored elsewhere
        give (`named_by_stored`: one read more), else to none (`named_again`)."""
        block = range(reserved.first_seq, reserved.first_seq + plan.count)
        assert plan.auto_name_from is not None
        taken = [plan.auto_name_from]
        return await self._named_from_stored(plan.conversation_id, taken, block, reserved.epoch)

    async def _named_from_stored(
        self, conversation_id: str, taken: list[str], without: range, epoch: str | None
    ) -> dict[str, Any]:
        """The names once the block at the `seq`s `without` is given back: an automatic name
        taken from one of the messages `taken` goes back to the one the messages stored
        elsewhere (of `epoch`) give (`named_by_stored`: one read), else to none."""
        with storage_errors("read the conversation's user messages"):
            named = await named_by_stored(
                self._messages,
                conversation_id,
                self.rules.name_chars,
                epoch=epoch,
                without=without,
            )
        return named_again(taken_from(taken), named)

    async def _finish_in_doubt(self, plan: TurnPlan) -> None:
        """Finish the give-back of a block of this turn an earlier attempt through this logger
        left in doubt (`_give_back` raised, its update perhaps lost): past the kept records no
        record names that block any more, and nothing stored tells it from a turn still
        writing, so only the attempt knows it; its retry gives it back before it reserves (the
        update matches only while the block is still counted: once, however many retries, and
        not once a move or a pop took it). No command unless one is in doubt."""
        doubt = self._in_doubt.pop((plan.conversation_id, plan.key), None)
        if doubt is not None:
            await self._give_back(
                doubt.plan, doubt.reserved, doubt.documents, refused=doubt.refused
            )

    async def _shown_before(
        self, plan: TurnPlan, first_seq: int, *, abandoned: bool = False
    ) -> ShownBefore:
        """What the conversation shows without the turn's block from `first_seq`, read from
        the messages stored before it as a pop reads them without its message
        (`_pop.last_before`, `_pop.preview_source`): one or two lookups, one more for a turn
        with text. `abandoned`: the block an attempt with other content reserved, whose
        preview is not known (`ShownBefore.abandoned`): the preview is read too."""
        cid = plan.conversation_id
        quoted = None if abandoned else plan.preview
        with storage_errors("read the messages before the turn"):
            previous, updated_at = await last_before(
                self._messages, self._conversations, cid, first_seq
            )
            source = None
            if quoted is not None or abandoned:
                source, _ = await preview_source(self._messages, cid, first_seq)
        return ShownBefore(
            preview=preview_of(source, self.rules.preview_chars),
            quoted=quoted,
            updated_at=updated_at,
            after=-1 if previous is None else int(previous["seq"]),
            abandoned=abandoned,
        )

    async def _hand_over_earlier(self, conversation_id: str, reserved: _Reserved) -> None:
        """After the turn that assigned an unowned conversation its owner: the messages logged
        before, unowned, move to the owner, so every message carries it (a count, a lookup
        and one update more, on that turn and its retries only).

        A turn that reserved before the assignment, unowned, and inserts after it is moved
        as a claim moves one (`ConversationStore.claim`): when a block before this turn's is
        not all stored (the count, made before the move), a last sweep `claim_grace` later
        moves what landed since; a turn slower than that moves its own
        (`_follow_the_conversation`). Each move goes to the owner the conversation has then
        (a claim may have moved it meanwhile), and only while it is the conversation the
        turn assigned (`_move_unowned`).
        """
        earlier = {"conversation_id": conversation_id, "seq": {"$lt": reserved.first_seq}}
        with storage_errors("move the conversation's earlier messages to its owner"):
            stored = await self._messages.count_documents(earlier)
            await self._move_unowned(earlier, reserved)
            if stored >= reserved.first_seq:
                return
            await pause(self.rules.claim_grace.total_seconds())
            await self._move_unowned(earlier, reserved)

    async def _move_unowned(self, earlier: dict[str, Any], reserved: _Reserved) -> None:
        """The `earlier` messages without an owner to the conversation's owner now, read first:
        nothing moves once the conversation is not the one the turn reserved on (deleted, or
        created again under its id by anyone: its epoch differs, `same_conversation`), nor
        while it has no owner. A delete landing between the lookup and the move is the window
        left."""
        same = _same_as_reserved(earlier["conversation_id"], reserved)
        found = await self._conversations.find_one(same, {"user_id": 1})
        owner = None if found is None else found.get("user_id")
        if owner is not None:
            await self._messages.update_many(
                {**earlier, "user_id": None}, {"$set": {"user_id": owner}}
            )

    async def _to_the_conversation(
        self,
        conversation_id: str,
        documents: list[dict[str, Any]],
        owner: str | None,
        epoch: str | None,
    ) -> list[dict[str, Any]]:
        """A retry's messages an earlier attempt stored under another owner than the
        conversation's now (its insert landed after a claim's last sweep, its answer lost),
        or with another conversation's `epoch` (a late insert of the same turn into one
        deleted since, where this turn stores the same): moved to the owner and the epoch,
        and answered so (one more update, on that path only)."""
        now = {"user_id": owner, "epoch": epoch}
        strays = [d["_id"] for d in documents if any(d.get(k) != v for k, v in now.items())]
        if not strays:
            return documents
        with storage_errors("move the turn's messages to the conversation's owner"):
            await self._messages.update_many(
                {"conversation_id": conversation_id, "_id": {"$in": strays}}, {"$set": now}
            )
        return [{**d, **now} for d in documents]

    async def _follow_the_conversation(
        self, plan: TurnPlan, reserved: _Reserved, stored: list[AgentMessage]
    ) -> list[AgentMessage]:
        """After a turn slower than `TurnRules.claim_grace` (or `abandon_after`, when shorter)
        from its reservation to its insert, or a retry that stored messages in the block an
        earlier attempt reserved (`_store`): its messages move to the conversation's owner
        when a claim moved the conversation meanwhile (one more lookup; one more update then
        only). A faster first attempt is moved by the claim itself, which waits that long
        before its last sweep. The same lookup reads the messages pops removed: what this
        insert brought back of them goes again (`_popped_again`).

        The conversation is the one the turn reserved on only while its epoch is the same
        (`same_conversation`): deleted meanwhile, or deleted and created again under its id
        (by anyone, at whatever `created_at`), it is gone, and so are the turn's late
        messages, as the delete would have taken them; they never go to whoever holds the
        id now. Nothing of the turn is then stored, and the attempt is refused as one whose
        insert met the new conversation's messages is (`_deleted_since`, a `Conflict`): a
        first attempt or a retry, however much of the turn it inserted, is never answered
        with messages nobody holds.
        """
        conversation_id = plan.conversation_id
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(
                _same_as_reserved(conversation_id, reserved),
                {
                    "user_id": 1,
                    "pops": 1,
                    "popped_messages": 1,
                    "popped_seqs": 1,
                    "turns.k": 1,
                    "turns.f": 1,
                },
            )
        owner = reserved.owner
        if found is not None:
            stored = await self._popped_again(plan, reserved, stored, found)
            if found.get("user_id") == owner:
                return stored
            new_owner = found.get("user_id")
            with storage_errors("move the turn's messages to the conversation's owner"):
                await self._messages.update_many(
                    _written_by(conversation_id, reserved, stored), {"$set": {"user_id": new_owner}}
                )
            return [m.model_copy(update={"user_id": new_owner}) for m in stored]
        with storage_errors("delete the turn's messages with their conversation"):
            await self._messages.delete_many(_written_by(conversation_id, reserved, stored))
        if reserved.epoch is not None:  # files of its epoch: no other conversation's
            await self._full_texts.forget_files(
                [b for m in stored for b in kept_blob_ids(m).values()]
            )
        raise _deleted_since(conversation_id)

    async def _delete_landed(
        self, plan: TurnPlan, reserved: _Reserved, messages: Sequence[AgentMessage], action: str
    ) -> None:
        """Deletes `messages` this attempt stored in the turn's block (their ids, at its `seq`s,
        under its epoch: never another life's nor another block's), then their whole texts.
        One delete, and two more when some were cut (their files)."""
        first, last = reserved.first_seq, reserved.first_seq + plan.count
        with storage_errors(action):
            await self._messages.delete_many(
                {
                    "conversation_id": plan.conversation_id,
                    "_id": {"$in": [m.id for m in messages]},
                    "seq": {"$gte": first, "$lt": last},
                    "epoch": reserved.epoch,
                }
            )
        await self._full_texts.forget_files(
            [b for m in messages for b in kept_blob_ids(m).values()]
        )

    async def _popped_again(
        self,
        plan: TurnPlan,
        reserved: _Reserved,
        stored: list[AgentMessage],
        found: Mapping[str, Any],
    ) -> list[AgentMessage]:
        """The turn as stored, once what this insert stored of the messages pops removed
        (`popped_messages`) is taken back: a first attempt slower than `abandon_after`
        whose retry moved the turn to a new block and stored it there, a pop then removing
        its last messages, lands in the block the turn left, where the popped ids are free
        again (a block no turn holds: recorded as left, `moved_key`, or its `seq`s gaps,
        `popped_seqs`), or in its own block, refilled by a retry and popped since (a message
        popped at the very `seq` this insert stored it at). Only its own copies go (its ids at
        the `seq`s of its block, under its epoch): never the retry's, nor a message of the turn
        no pop removed (an insert of the retry's may still be on its way, and then finds the
        turn stored here), nor a turn reserved anew since the pop (past the kept records, its
        popped messages' ids are its own again, at other `seq`s: it is stored, however slow).
        One delete more, on that path only; Conflict, as a retry of the turn is answered, when
        none of the turn is left."""
        entries = _popped_after(found, reserved.pops)
        first, last = reserved.first_seq, reserved.first_seq + plan.count
        popped = {p.get("i") for p in entries} if first in _blocks_left(found, plan.key) else set()
        popped_here = {(p.get("i"), p.get("s")) for p in entries}
        back = [
            m
            for m in stored
            if m.seq is not None
            and first <= m.seq < last
            and (m.id in popped or (m.id, m.seq) in popped_here)
        ]
        if not back:
            return stored
        await self._delete_landed(plan, reserved, back, "delete the turn's messages a pop removed")
        left = [m for m in stored if m not in back]
        if not left:
            raise _corrected(plan)
        return left

    async def _follow_times(
        self,
        plan: TurnPlan,
        reserved: _Reserved,
        stored: Sequence[AgentMessage],
        *,
        inserted: bool,
    ) -> None:
        """After a retry: the conversation's `updated_at` follows the times stored where they
        are not those its first attempt reserved with (the retry stamped them again, or came
        from a pod whose clock differs). Later: it follows them (one update more, then only).
        Earlier, stored by this retry (`inserted`) in the block its first attempt reserved,
        while that block ends the conversation: the first attempt's time, which no stored
        message has, is taken back (`_take_times_back`). A turn moved to a new block keeps
        what the move set (its retry comes `abandon_after` later, its times rarely earlier).
        Nothing more on any other path."""
        read = reserved.conversation
        if read is None:
            return
        latest = max(m.created_at for m in stored)
        end = reserved.first_seq + plan.count
        if latest > read.updated_at:
            with storage_errors("update the conversation"):
                await self._conversations.update_one(
                    _same_as_reserved(plan.conversation_id, reserved),
                    {"$max": {"updated_at": latest}},
                )
        elif inserted and reserved.moved is None and read.message_count == end:
            await self._take_times_back(
                plan.conversation_id, reserved, end, read.updated_at, latest
            )

    async def _take_times_back(
        self,
        conversation_id: str,
        reserved: _Reserved,
        end: int,
        shown: datetime,
        latest: datetime,
    ) -> None:
        """`updated_at` (`shown`, as the retry read it) later than `latest` (the turn's time as
        stored, its block ending at `end`) is set as a pop of the turn and its append again
        would set it: to the latest of `latest` and the times of the messages below the
        block, whatever their `seq` order (one read, two when times run out of `seq` order
        below it, and one guarded update more, on this path only: `_pop.last_and_latest`).
        It stays while the `seq` just below holds no message (a turn may still be writing a
        later time there, as a pop keeps it), once a turn reserved past this one (its
        reservation weighed the first attempt's time: that turn's, or a later one, stays),
        and once anything else set it since it was read."""
        if latest >= shown:
            return
        first = reserved.first_seq
        if first > 0:
            stored_below = {
                "conversation_id": conversation_id,
                "epoch": {"$in": [reserved.epoch, None]},
                "seq": {"$lt": first},
            }
            with storage_errors("read the messages before the turn"):
                below, latest_below = await last_and_latest(
                    self._messages, stored_below, first, {"_id": 0, "seq": 1, "created_at": 1}
                )
            if below is None or latest_below is None or below["seq"] != first - 1:
                return
            latest = max(latest, to_utc_millis(latest_below["created_at"]))
        if latest >= shown:
            return
        with storage_errors("update the conversation"):
            await self._conversations.update_one(
                {
                    **_same_as_reserved(conversation_id, reserved),
                    "message_count": end,
                    "updated_at": shown,
                },
                [{"$set": {"updated_at": updated_at_left(latest)}}],
            )

    async def _block_read(self, plan: TurnPlan, block: RecordedBlock) -> list[dict[str, Any]]:
        """The messages stored in the turn's block or under its ids, in `seq` order."""
        with storage_errors("read the turn's messages"):
            found: list[dict[str, Any]] = await self._messages.find(lookup(plan, block)).to_list(
                None
            )
        found.sort(key=lambda d: int(d["seq"]))  # a server answers an unsorted find any order
        return found

    async def _looked_up(
        self,
        plan: TurnPlan,
        block: RecordedBlock,
        conversation: Mapping[str, Any],
        condition: Condition | None = None,
    ) -> Looked:
        """The lookup of a retry's empty block (its record's) before the turn is logged at
        the end in its place, read only: moved with the same content, the block given back
        with other content (`_relocated.lookup`, moving, and `looked_up`: one find). It finds
        the messages stored there or under the turn's ids (the turn is then stored there,
        not logged at the end), the prompts past it under the turn's request ids, and the
        later messages that answer a call the retry makes, for which it is refused
        (`Looked.refusal`, raised by `_verdict` or the move: `check_turn` raises it as
        `log_messages` does, which then gives the turn up, `_given_up_for`); and, when a
        call of the turn is off `pending_calls` in `conversation` (as read), the messages of
        the blocks past it still being written (`Unwritten`): one of them unstored, the
        retry is told to come again (StorageUnavailable), nothing given up. With the turn's
        `condition`, what it must still hold where it lands (`Condition.landing`: its
        answers, `answers_to`), judged in the same find, refused as the same turn logged
        fresh there is (`Unlanded`, given up as `Unmovable` is)."""
        rules = self.rules
        unwritten = Unwritten.of(plan, block, conversation, abandon_after=rules.abandon_after)
        landing = None if condition is None else condition.landing
        wanted = () if landing is None else landing.wanted
        query = lookup(plan, block, moving=True, unwritten=unwritten, landing=wanted)
        with storage_errors("read the turn's messages"):
            found = await self._messages.find(query).to_list(None)
        judged = None if landing is None else partial(landing.refused, conversation)
        return looked_up(plan, block, found, unwritten, conversation.get("epoch"), judged)

    def _passed(
        self, block: RecordedBlock, conversation: Mapping[str, Any], *, late: bool = False
    ) -> bool:
        """Whether tail readers may have passed the block of `conversation` (as read):
        reserved `abandon_after` ago, on the store's clock, or `late` (the attempt that
        reserved it found itself too slow to insert there); a retry that finds nothing stored
        there is then logged at the end. Never the block of a fork not made yet (`FORK_CHECK`):
        the first block of a conversation its fork call has not handed out, which no reader
        passed; its copies keep `seq` 0…n, which `forked_from.turn_starts` names, whenever a
        retry of the fork stores them (or finds them stored)."""
        if conversation.get(FORK_CHECK) is not None:
            return False
        at = block.reserved_at
        return late or (at is not None and utc_now() - at >= self.rules.abandon_after)

    async def _given_up_for(
        self, plan: TurnPlan, refused: Unmovable | Unlanded, conversation: Mapping[str, Any]
    ) -> None:
        """After a retry refused as `Unmovable` or `Unlanded` (`conversation`: as it read
        it): the turn is given up for good, and so is what its first reservation counted
        and listed pending (`given_up`, of the block its record names; `_give_up`, as after
        a move: the pending state folded from the stored messages, one or two round trips
        more)."""
        taken_back = given_up(plan, refused.block, conversation)
        own = refused.block
        await self._give_up(plan.conversation_id, conversation, taken_back=taken_back, own=own)

    async def _give_up(
        self,
        conversation_id: str,
        conversation: Mapping[str, Any] | None = None,
        *,
        taken_back: tuple[dict[str, Any], list[dict[str, Any]]] | None = None,
        strict: bool = True,
        own: RecordedBlock | None = None,
    ) -> None:
        """After a retry refused a turn that stored nothing, for good (moved, its call would
        follow its answer; a delivery into an inbox closed since): what its first reservation
        set pending (its calls, its prompt, a prompt its answer or upload cleared) no stored
        message says, so the pending state is folded again from the stored messages, as after
        a move (`_relocated.settle`, from `conversation` as read, else read again: one or two
        round trips more, on these rare paths). While a turn below the end is still being
        written its messages are not there to fold: StorageUnavailable, nothing written but
        the mark that the fold is owed (`REFOLD_OWED`: the next turn folds it), and the retry
        that comes again folds them (the refusal stands). `taken_back`: the update
        that takes back what its reservation counted and makes its block gaps, once
        (`given_up`, of the block its record names: one round trip more), once the fold is
        written; a block the turn's own reservation took is given back by `_give_back`, which
        folds here. `strict`: False when the turn is stored by another attempt: the fold is
        then left undone rather than raised about. `own`: the block given up (`taken_back`),
        whose `seq`s no message fills (the fold counts them as gaps already)."""
        seqs = range(0) if own is None else range(own.first_seq, own.first_seq + own.count)
        settled = await settle(
            self._conversations,
            self._messages,
            conversation_id,
            conversation,
            abandon_after=self.rules.abandon_after,
            name_chars=self.rules.name_chars,
            given_up=True,
            own=seqs,
        )
        if not settled and strict:
            raise StorageUnavailable(
                f"a turn of conversation {conversation_id!r} is still being written: what "
                "this retry leaves pending cannot be told yet; retry shortly"
            )
        if taken_back is not None:
            with storage_errors("take back what the turn counted"):
                await self._conversations.update_one(*taken_back)

    async def _own_duplicates(
        self, error: BulkWriteError, documents: list[dict[str, Any]], plan: TurnPlan, met: _Met
    ) -> dict[str, dict[str, Any]]:
        """The stored messages an earlier attempt of the turn wrote, by id; anything else that
        collided raises (the only write errors swallowed are these duplicate keys).

        A stored message is the turn's only with the same content as the turn's message for
        it (`_same_content`) and at its `seq`, or all of them one block away, in a block the
        conversation records for the turn (one lookup of its records more, on that path
        only): an attempt's insert that landed after another attempt moved the turn (or
        before); the turn is stored there and every attempt answers them. One with other
        content where the turn's record places it stays, this attempt refused
        (`_logged_otherwise`), as is one landing in a block of the turn given back (another
        attempt logged it elsewhere with other content) that stored messages there. Anything
        else (another turn's message at its `seq`, one of an earlier life, popped or in a
        block given back) gives way while the conversation records this turn's block and not
        the other turns (`_in_place_of`), else Conflict (`_in_the_way`), naming nothing of
        what another turn left. `met`: as `_met` read it."""
        only_duplicates(error)
        write_errors = error.details.get("writeErrors", [])
        failed = {documents[e["index"]]["_id"]: documents[e["index"]] for e in write_errors}
        conversation_id = documents[0]["conversation_id"]
        stored = {id_: met[id_] for id_ in failed if id_ in met}
        epoch = documents[0].get("epoch")
        same = len(stored) == len(failed) and all(
            stored[id_].get("epoch") in (None, epoch) and _same_content(stored[id_], wanted)
            for id_, wanted in failed.items()
        )
        shifts = {
            int(stored[id_]["seq"]) - int(w["seq"]) for id_, w in failed.items() if id_ in stored
        }
        in_place = _arrived(list(stored.values()), list(failed.values()), epoch)
        if len(in_place) == len(failed):
            return stored  # stored by an earlier attempt, in this block
        records = await self._turn_records(conversation_id)
        if epoch is not None and (records is None or records.get("epoch") not in (None, epoch)):
            await self._take_back(conversation_id, documents, epoch)
        first = int(documents[0]["seq"])
        if len(failed) < len(documents) and first in _given_back_at(records or {}, plan.key):
            await self._take_back_inserted(plan, documents, failed, epoch)  # logged elsewhere
        moved = same and len(shifts) == 1 and records is not None
        if moved and first + next(iter(shifts)) in blocks_of(records or {}, plan.key):
            return stored  # stored by an earlier attempt, in another block of the turn
        if _logged_otherwise(plan, records, stored, failed, first):
            await self._take_back_inserted(plan, documents, failed, epoch)
        # Not the turn's attempts: what an earlier conversation under the id left in the way.
        wanted = [d for id_, d in failed.items() if id_ not in in_place]
        with storage_errors("read the messages in the turn's block"):
            there = await self._messages.find(
                {"conversation_id": conversation_id, "seq": {"$in": [d["seq"] for d in wanted]}}
            ).to_list(None)
        # Another attempt of the turn may have moved its messages here since `met` was read.
        arrived = _arrived(there, wanted, epoch)
        wanted = [d for d in wanted if d["_id"] not in arrived]
        stored = {**stored, **arrived}
        ids = {d["_id"] for d in wanted}
        strays = {d["_id"]: d for d in [*there, *(d for d in stored.values() if d["_id"] in ids)]}
        if wanted:
            await self._in_place_of(plan, records, first, list(strays.values()), wanted)
        return {**stored, **{d["_id"]: d for d in wanted}}

    async def _turn_records(self, conversation_id: str) -> dict[str, Any] | None:
        """The conversation's turn records (their key, first `seq`, given-back and popped
        marks), its epoch and the messages pops removed, as `_own_duplicates` reads them."""
        with storage_errors("read the conversation"):
            found: dict[str, Any] | None = await self._conversations.find_one(
                conversation_by_id(conversation_id),
                {"turns.k": 1, "turns.f": 1, "turns.g": 1, "turns.p": 1, "turns_dropped": 1,
                 "epoch": 1, "popped_messages": 1},
            )  # fmt: skip
        return found

    async def _take_back_inserted(
        self,
        plan: TurnPlan,
        documents: list[dict[str, Any]],
        failed: Mapping[str, Any],
        epoch: str | None,
    ) -> NoReturn:
        """A late insert of the turn meeting its own ids holding other content of this
        conversation's life (`_logged_otherwise`): another attempt logged the turn with that
        content meanwhile, and what it stored stays. What this insert stored goes (its
        documents that met nothing, by id and `seq`: one round trip more when there are
        any), and it is refused, `OtherContent` (the block a fresh reservation took is then
        given back, `_insert_into`; another's was given back by the attempt that logged the
        turn elsewhere)."""
        inserted = [d for d in documents if d["_id"] not in failed]
        if inserted:
            with storage_errors("take back the turn's messages"):
                await self._messages.delete_many(
                    {"conversation_id": plan.conversation_id, "epoch": epoch,
                     "$or": [{"_id": d["_id"], "seq": d["seq"]} for d in inserted]}
                )  # fmt: skip
        raise OtherContent(
            f"turn {plan.turn_id!r} was logged with other content by another "
            "attempt while this one's insert was on its way (it is kept, this attempt's is "
            "not stored); a retry must send the same messages. Use a new turn_id for a new turn"
        )

    async def _in_place_of(
        self,
        plan: TurnPlan,
        records: Mapping[str, Any] | None,
        first_seq: int,
        strays: list[dict[str, Any]],
        wanted: list[dict[str, Any]],
    ) -> None:
        """Store the turn's `wanted` messages in place of `strays`, messages no turn of this
        conversation stored where they are (two round trips more, three for a turn given up
        for good, four with whole texts to forget, on that path only); a `wanted` message met
        at its `seq` with its content is the turn's, stored by another attempt (one lookup).

        The conversation gives each `seq` to one turn and records every block a turn holds:
        a message of another turn in this turn's block, or one of this turn in a block the
        conversation does not record for it, is a late insert of a turn whose writer had given
        up, applied by the server after the conversation under the id was deleted (and after
        the delete's second sweep), or after its block was passed as abandoned
        (`TurnRules.abandon_after`) and given back by a pop. It goes, with the whole texts
        only it names, and the turn's message takes its place (a turn's given up for good in
        a block pops passed since, with all of it this life holds: `_with_turns_given_up`),
        only while the conversation under the id records this turn's block at `first_seq` and
        holds none of the other turns' (`blocks_held`; a live writer slower than the delete
        reaches one that does not record it: refused, Conflict, as a turn's own late insert).
        `records`: its turn records and epoch, as read. Strays all of another epoch than the
        conversation's, which this turn writes with, are a deleted conversation's whatever
        turns it records: they go, with every other message that conversation left there."""
        conversation_id, found = plan.conversation_id, records
        others = {str(d.get("turn_id")) for d in strays} - {plan.turn_id}
        left_over = _epochs_left_over(found, strays, wanted)
        if left_over:
            strays = await self._left_by(conversation_id, left_over)
        elif strays and _popped(found, strays):
            pass  # brought back by a late insert after a pop removed them: they go again
        elif found is None or (strays and (
            first_seq not in blocks_of(found, plan.key)
            # Records dropped: one of the turn's own blocks is no longer told from a stray.
            or (found.get("turns_dropped") and any(d.get("turn_id") == plan.turn_id
                                                   for d in strays))
            or any(t.startswith(MIGRATED_TURN_PREFIX) or blocks_held(found, turn_key(t))
                   for t in others)
        )):  # fmt: skip
            raise _in_the_way(plan, first_seq, strays, wanted, found)
        strays = await self._with_turns_given_up(conversation_id, found, others, strays)
        kept = {text.blob_id for text in plan.full_texts}
        await self._full_texts.forget_files(
            [b for d in strays for b in stored_blob_ids(d) if b not in kept]
        )
        with storage_errors("insert the messages"):
            if strays:  # none when what met the insert went meanwhile (taken back by its writer)
                await self._messages.delete_many(
                    {"conversation_id": conversation_id, "$or": [
                        {"_id": d["_id"], "seq": d["seq"]} for d in strays
                    ]}
                )  # fmt: skip
            try:
                await self._messages.insert_many(wanted, ordered=False)
            except BulkWriteError as exc:
                await self._stored_meanwhile(conversation_id, wanted, exc)

    async def _stored_meanwhile(
        self, conversation_id: str, wanted: list[dict[str, Any]], error: BulkWriteError
    ) -> None:
        """The turn's `wanted` messages its insert met (`error`, duplicates only) found each
        at its `seq` with its content: stored meanwhile by another attempt of the turn (one
        lookup). Else what it met is another turn's, `_taken`."""
        only_duplicates(error)
        met = [wanted[e["index"]] for e in error.details["writeErrors"]]
        with storage_errors("read the messages in the turn's block"):
            there = await self._messages.find(
                {"conversation_id": conversation_id, "_id": {"$in": [d["_id"] for d in met]}}
            ).to_list(None)
        arrived = _arrived(there, met, met[0].get("epoch"))
        lost = next((d for d in met if d["_id"] not in arrived), None)
        if lost is not None:
            raise _taken(conversation_id, lost["_id"], lost["seq"]) from error

    async def _take_back(
        self, conversation_id: str, documents: list[dict[str, Any]], epoch: str
    ) -> NoReturn:
        """A writer of a conversation deleted since (its `epoch` is not the one under the id,
        or none is there) meeting messages in its way: what it inserted goes, and it is
        refused (`Conflict`, naming nothing of what it met); nothing of the conversation
        under the id is touched."""
        with storage_errors("delete the turn's messages with their conversation"):
            await self._messages.delete_many(
                {
                    "conversation_id": conversation_id,
                    "_id": {"$in": [d["_id"] for d in documents]},
                    "epoch": epoch,
                }
            )
        # Its whole texts are under files naming its epoch: the conversation's under the id
        # now are not (`_truncation.blob_id`).
        await self._full_texts.forget_files([b for d in documents for b in stored_blob_ids(d)])
        raise _deleted_since(conversation_id)

    async def _with_turns_given_up(
        self,
        conversation_id: str,
        found: Mapping[str, Any] | None,
        others: set[str],
        strays: list[dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """`strays`, and every other message the turns of `others` among them stored in this
        life of the conversation (`found`: its turn records and `epoch`) when each such turn
        is given up for good in blocks pops passed since (recorded, none of its blocks
        `blocks_held`): its writer gone before it looked, its insert landed at or past the
        end the pops left, where the turn meeting one of its messages is not the turn meeting
        the others (a block of another length, or a turn not logged yet), and no message of
        a turn given up so is ever served (every retry of it is refused `Corrected`). By turn
        id and `epoch`: never another life's messages under the id, nor a fork's (another
        conversation id). One lookup more, on that path only."""
        epoch = None if found is None else found.get("epoch")
        given_up = sorted(
            turn_id
            for turn_id in others
            if found is not None
            and given_up_for_good(found, turn_id)
            and any(d.get("turn_id") == turn_id and d.get("epoch") == epoch for d in strays)
        )
        if not given_up:
            return strays
        with storage_errors("read the messages of the turns given up"):
            found_there: list[dict[str, Any]] = await self._messages.find(
                {"conversation_id": conversation_id, "epoch": epoch,
                 "turn_id": {"$in": given_up}},
                {"seq": 1, "turn_id": 1, "epoch": 1, "truncated": 1},
            ).to_list(None)  # fmt: skip
        return list({d["_id"]: d for d in [*strays, *found_there]}.values())

    async def _left_by(self, conversation_id: str, epochs: list[str]) -> list[dict[str, Any]]:
        """Every message conversations of these epochs, deleted since, left under the id (one
        round trip more)."""
        with storage_errors("read the messages in the turn's block"):
            found: list[dict[str, Any]] = await self._messages.find(
                {"conversation_id": conversation_id, "epoch": {"$in": epochs}},
                {"seq": 1, "truncated": 1},
            ).to_list(None)
        return found


def _arrived(
    there: list[dict[str, Any]], wanted: list[dict[str, Any]], epoch: str | None
) -> dict[str, dict[str, Any]]:
    """The turn's `wanted` messages that are in its block as read (`there`): each at its
    `seq`, with its content, in this conversation (`epoch`), stored by an earlier attempt of
    the turn, or by another that moved it there after this attempt's insert met it elsewhere.
    By id."""
    by_id = {d["_id"]: d for d in wanted}
    return {
        d["_id"]: d
        for d in there
        if d["_id"] in by_id
        and d.get("seq") == by_id[d["_id"]]["seq"]
        and d.get("epoch") in (None, epoch)
        and _same_content(d, by_id[d["_id"]])
    }


def _logged_otherwise(
    plan: TurnPlan,
    records: Mapping[str, Any] | None,
    stored: Mapping[str, Mapping[str, Any]],
    failed: Mapping[str, Mapping[str, Any]],
    first_seq: int,
) -> bool:
    """Whether a message the insert (its block from `first_seq`) met under one of the turn's
    own ids (`stored`, by id, of `failed`) has other content than the turn's message for it,
    and is of this conversation's life (`records`, read after the insert: its `epoch` is
    the insert's), not listed as popped, at its place in the block the conversation records
    for the turn: another attempt of the turn logged it with that content, which a late
    insert never replaces. What lies elsewhere (a block given back or left by a move, which
    a late insert may still reach) is not such a turn: `_in_place_of` tells it."""
    if records is None:
        return False
    live = {
        int(raw["f"])
        for raw in records.get("turns") or ()
        if isinstance(raw, Mapping) and raw.get("k") == plan.key and "f" in raw
    }
    popped = _popped_at(records)
    return any(
        int(d["seq"]) - int(failed[id_]["seq"]) + first_seq in live
        and d.get("epoch") in (None, failed[id_].get("epoch"))
        and (id_, d.get("seq")) not in popped
        and not _same_content(d, failed[id_])
        for id_, d in stored.items()
    )


def _one_block_away(
    plan: TurnPlan,
    documents: list[dict[str, Any]],
    error: BulkWriteError,
    found: _Met,
) -> int | None:
    """How far from this insert's block (`documents`) the messages it collided with are
    stored, when every one is the turn's, with its content, in this conversation (its
    `epoch`), all one block away, and none is stored past the turn's end (`found`, by
    `_met`); None otherwise (its own block holds them, or what met it is not the turn)."""
    failed = [documents[e["index"]] for e in error.details.get("writeErrors", [])]
    past = message_id(plan.conversation_id, plan.turn_id, plan.count)
    epoch = documents[0].get("epoch")
    same = past not in found and all(
        d["_id"] in found
        and found[d["_id"]].get("epoch") == epoch
        and _same_content(found[d["_id"]], d)
        for d in failed
    )
    shifts = {int(found[d["_id"]]["seq"]) - int(d["seq"]) for d in failed if d["_id"] in found}
    if not same or len(shifts) != 1 or 0 in shifts:
        return None
    return shifts.pop()


def _elsewhere(stored: Sequence[AgentMessage], first_seq: int, count: int) -> bool:
    """Whether none of the turn's `stored` messages is in the block of `count` from
    `first_seq`: another attempt stored the turn in a block of its own."""
    return not any(m.seq is not None and first_seq <= m.seq < first_seq + count for m in stored)


def _popped_after(conversation: Mapping[str, Any], pops: int | None) -> list[Mapping[str, Any]]:
    """The `popped_messages` entries of the pops the conversation finished since it had
    finished `pops` (each pop lists its message last; all listed when None)."""
    entries = [p for p in conversation.get("popped_messages") or () if isinstance(p, Mapping)]
    if pops is None:
        return entries
    since = int(conversation.get("pops") or 0) - pops
    return entries[max(0, len(entries) - since) :] if since > 0 else []


def _blocks_left(conversation: Mapping[str, Any], key: int) -> set[int]:
    """The `seq`s where blocks of the turn recorded under `key` may begin that no turn holds
    any more: the first `seq`s of the blocks it left by a move (their records under
    `moved_key`), and every `seq` the conversation keeps as a gap (`popped_seqs`)."""
    left = {
        int(raw["f"])
        for raw in conversation.get("turns") or ()
        if isinstance(raw, Mapping) and raw.get("k") == moved_key(key) and "f" in raw
    }
    return left | {int(s) for s in conversation.get("popped_seqs") or ()}


def _given_back_at(conversation: Mapping[str, Any], key: int) -> set[int]:
    """The first `seq`s of the blocks of the turn recorded under `key` that were given back
    (`given_back`: recorded under `moved_key`, marked given up)."""
    return {
        int(raw["f"])
        for raw in conversation.get("turns") or ()
        if isinstance(raw, Mapping)
        and raw.get("k") == moved_key(key)
        and raw.get("g") is True
        and "f" in raw
    }


def _popped_at(found: Mapping[str, Any] | None) -> set[tuple[Any, Any]]:
    """The messages the conversation `found` lists as popped (`popped_messages`), as pairs of
    id and `seq`."""
    entries = (found or {}).get("popped_messages") or ()
    return {(p.get("i"), p.get("s")) for p in entries if isinstance(p, Mapping)}


def _popped(found: Mapping[str, Any] | None, strays: list[dict[str, Any]]) -> bool:
    """Whether every stray is a message the conversation lists as popped (`popped_messages`,
    by id and `seq`): an earlier attempt's insert of its turn, landing after a retry was
    stored and a pop removed it, put it back where a later turn now goes."""
    listed = _popped_at(found)
    return all((d["_id"], d.get("seq")) in listed for d in strays)


def _epochs_left_over(
    found: Mapping[str, Any] | None, strays: list[dict[str, Any]], wanted: list[dict[str, Any]]
) -> list[str]:
    """The epochs of `strays` when every one carries an epoch, none the conversation's, and
    the turn writes with the conversation's (a writer of a conversation deleted since meets
    the new one's messages the other way round): what conversations deleted since left in
    the turn's way. Empty otherwise."""
    epoch = None if found is None else found.get("epoch")
    epochs = {d.get("epoch") for d in strays}
    if not strays or epoch is None or {d.get("epoch") for d in wanted} != {epoch}:
        return []
    if None in epochs or epoch in epochs:
        return []
    return sorted(e for e in epochs if isinstance(e, str))


def _insert_by(rules: TurnRules, since: float, age: timedelta = timedelta(0)) -> float | None:
    """The `time.monotonic()` past which an attempt does not insert into a block reserved
    `age` before `since` (a `time.monotonic()`): `abandon_after` less its margin (a tenth,
    `_MARGIN`) after the reservation, tail readers passing it `abandon_after` after the time
    its record holds. None with an `abandon_after` of zero: readers pass any block not yet
    written at once, and no writer inserts before them (a setting for tests)."""
    if not rules.abandon_after:
        return None
    bound = rules.abandon_after - rules.abandon_after / _MARGIN - age
    return since + bound.total_seconds()


def _moved(
    plan: TurnPlan, reserved: _Reserved, doc: dict[str, Any], *, observed: bool
) -> _Reserved:
    """The block a move just took, from the conversation it returned; its summary as the move
    left it (`updated_at` follows the turn already) only when observers are told of the turn."""
    return replace(
        reserved,
        first_seq=int(doc["message_count"]) - plan.count,
        owner=doc.get("user_id"),
        created_at=doc.get("created_at"),
        epoch=doc.get("epoch"),
        conversation=(
            Conversation.model_validate({k: v for k, v in doc.items() if k != "turns"})
            if observed
            else None
        ),
        moved=doc,
    )


def _reserved(plan: TurnPlan, conversation: dict[str, Any], *, observed: bool) -> _Reserved:
    """The block a reservation just took, from the conversation it returned; its summary read
    only when observers are told of the turn."""
    first_seq = int(conversation["message_count"]) - plan.count
    return _Reserved(
        first_seq,
        conversation.get("user_id"),
        replayed=False,
        created_at=conversation.get("created_at"),
        epoch=conversation.get("epoch"),
        conversation=Conversation.model_validate(conversation) if observed else None,
        assigns=_assigned_at(conversation, first_seq),
        owed=conversation.get(REFOLD_OWED) is not None,
        pops=int(conversation.get("pops") or 0),
        passed=tuple(int(b["f"]) for b in _passed_by(conversation, first_seq)),
        watched=tuple(f for f in watched_blocks(conversation, utc_now()) if f < first_seq),
        ahead=tuple(
            (int(b["f"]), str(t["c"]))
            for b in _passed_by(conversation, first_seq)
            for t in b.get("t") or ()
            if isinstance(t, Mapping) and t.get("k") == plan.key
        ),
    )


def _passed_by(conversation: Mapping[str, Any], first_seq: int) -> list[Mapping[str, Any]]:
    """The blocks listing pending state (`PENDING_BLOCKS`) that the reservation of the block
    at `first_seq` found passed (`d`), not watched, below it (`_Reserved.passed`)."""
    return [
        b
        for b in conversation.get(PENDING_BLOCKS) or ()
        if isinstance(b, Mapping) and b.get("d") and b.get("w") is None and int(b["f"]) < first_seq
    ]


def _recorded_before(plan: TurnPlan, conversation: Mapping[str, Any]) -> bool:
    """Whether the conversation's records name the turn by the id derived for it before key
    order stopped counting (`TurnPlan.derived_before`)."""
    return plan.key_before is not None and bool(blocks_of(conversation, plan.key_before))


def _first_id_before(plan: TurnPlan) -> str | None:
    """The id of the turn's first message under the id derived for it before key order
    stopped counting (`TurnPlan.derived_before`); None when there is none."""
    if plan.derived_before is None:
        return None
    return message_id(plan.conversation_id, plan.derived_before, 0)


def _same_content(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether a stored message is the one a turn would store, as a replay is checked: its
    content digest, times, `seq` and owner aside.

    A message cut before `truncated` entries recorded the hash of their whole text is
    compared without the hashes: the turn is reserved by then, so its whole texts are the
    turn's (a replay's were found the same, `_recognised`; a new turn's were just kept)."""
    if not records_text_hashes(stored):
        wanted = without_text_hashes(wanted)
    return content_digest(canonical_documents([stored])) == content_digest(
        canonical_documents([wanted])
    )


def _replay(
    plan: TurnPlan,
    block: RecordedBlock,
    conversation: dict[str, Any],
    condition: Condition | None = None,
    *,
    passed: bool = False,
    asked_about: Mapping[str, str] | None = None,
) -> _Reserved:
    """The block an earlier attempt of the turn reserved, if this attempt sends the same and
    no pop has removed a message of it since. One sending answers the turn was logged
    without (`AnsweredBefore`) is told so again (`Condition.retried`). `passed`: the block
    is older than `abandon_after`, so a fold may have passed it while it was empty
    (`_listed_otherwise`); `asked_about`: the calls its prompts asked about (`_asked_about`,
    read only when an approval of their ids is free: `_held_again`)."""
    held = _held_again(plan, conversation, block.first_seq, asked_about or {}) if passed else ()
    if block.popped:
        raise _corrected(plan)
    if block.count != plan.count or not plan.matches(block.digest):
        raise _retry_refusal(plan, conversation, condition)
    summary = Conversation.model_validate(conversation)
    return _Reserved(
        block.first_seq,
        summary.user_id,
        replayed=True,
        created_at=conversation.get("created_at"),
        epoch=conversation.get("epoch"),
        conversation=summary,
        assigns=_assigned_at(conversation, block.first_seq),
        pops=int(conversation.get("pops") or 0),
        relisted=_listed_otherwise(plan, conversation, block.first_seq, passed=passed, held=held),
        unheld=held,
        given_up=block.given_up,
    )


def _listed_otherwise(
    plan: TurnPlan,
    conversation: Mapping[str, Any],
    first_seq: int,
    *,
    passed: bool,
    held: Collection[tuple[str, str]] = (),
) -> bool:
    """Whether `conversation`, as a replay of the turn stored at `first_seq` read it, lists
    otherwise than the turn's stored messages leave it, as a landing's fold would list it
    (`_fold_after_insert`): a call it answers listed (`_answers_listed`), or, its block
    `passed` (older than `abandon_after`: a fold may have passed it empty), its own open
    call or prompt unlisted (`_own_unlisted`), a call its prompt names held by another
    (`_named_held_otherwise`) or an approval it asks about again free (`held`, as
    `_held_again` found them). Read from the conversation the replay read, nothing more: a
    later turn may have answered or asked since, which only the fold the replay then writes
    tells, changing nothing where they agree."""
    if _answers_listed(plan, conversation, first_seq):
        return True
    return passed and (
        _own_unlisted(plan, conversation, first_seq)
        or _named_held_otherwise(plan, conversation, first_seq)
        or bool(held)
    )


def _answers_listed(plan: TurnPlan, conversation: Mapping[str, Any], first_seq: int) -> bool:
    """Whether `conversation` (as read) lists in `pending_calls` a call the turn answers: the
    very call its answer names (`TurnPlan.answers_named`, the message making it), else one of
    the ids it answers made before its block (`first_seq`). Another call of the id, made
    after the block or before the call the answer names, is not the turn's to answer: its
    listing says nothing of the turn's first attempt (was: it made every replay fold the
    whole conversation, and hold again the approvals the turn's prompts asked about)."""
    answered, named = set(plan.answered_calls), dict(plan.answers_named)
    for call in _listed_calls(conversation):
        call_id = call.get("tool_call_id")
        if call_id in named:
            if call.get("message_id") == named[call_id]:
                return True
        elif call_id in answered:
            seq = call.get("seq")
            if not isinstance(seq, int) or seq < first_seq:
                return True
    return False


def _listed_calls(conversation: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The `pending_calls` entries of `conversation` as read."""
    return [c for c in conversation.get("pending_calls") or () if isinstance(c, Mapping)]


def _own_unlisted(plan: TurnPlan, conversation: Mapping[str, Any], first_seq: int) -> bool:
    """Whether a call the turn leaves open (`TurnPlan.opened_calls`) is off `pending_calls`,
    or the prompt it leaves pending (`TurnPlan.pending_hitl`) is not the pending one and no
    answer to it came since (`_answered_since`)."""
    listed = {(c.get("tool_call_id"), c.get("message_id")) for c in _listed_calls(conversation)}
    if any((c.tool_call_id, c.message_id) not in listed for c in plan.opened_calls):
        return True
    prompt = plan.pending_hitl
    if not isinstance(prompt, PendingHitl):
        return False
    pending = conversation.get("pending_hitl")
    if isinstance(pending, Mapping) and pending.get("message_id") == prompt.message_id:
        return False
    return not _answered_since(plan, conversation, first_seq, prompt.message_id)


def _named_held_otherwise(plan: TurnPlan, conversation: Mapping[str, Any], first_seq: int) -> bool:
    """Whether the latest listed call below the block (`first_seq`) of an id a prompt of the
    turn names (`TurnPlan.named_holds`) is held by another request than that prompt's: its
    prompt holds it from then on (`holding_named`), unless a later one does."""
    for call_id, request_id in plan.named_holds:
        made = [
            c
            for c in _listed_calls(conversation)
            if c.get("tool_call_id") == call_id and int(c.get("seq") or 0) < first_seq
        ]
        if made and made[-1].get("request_id") != request_id:
            return True
    return False


_APPROVALS_READ: dict[str, Any] = {"pending_calls": 1, "approved_calls": 1, **ANSWERED_READ}
"""What `_held_again` reads of a conversation: its calls, its approvals and her answers."""


def _held_again(
    plan: TurnPlan,
    conversation: Mapping[str, Any],
    first_seq: int,
    asked_about: Mapping[str, str] | None,
) -> tuple[tuple[str, str], ...]:
    """The approvals (call id, message making it) a replay or a landing of the turn stored at
    `first_seq` holds again by its stored prompts, as its reservation held them: of the very
    call a prompt of the turn asked about (`asked_about`: by id, the message making it,
    `_asked_about`; None: any call of the id, only to tell whether those are worth reading),
    listed with its approval free (no prompt holds it, `ApprovedCall.held_by`), that approval
    given before the turn's block (`_approved_after`: one a person gave since, to a later
    prompt, is never the turn's to hold), while no answer to the turn's last prompt naming
    it came since (`_answered_since`). The one rule a replay checks (`_Reserved.unheld`) and
    what it or a landing writes (`_relocated.hold_asked_again`): they cannot differ (was: the
    write held every free approval of the ids, an earlier call's and hers given since)."""
    answers, asking = answered_in(conversation), dict(plan.asked_again)
    held: list[tuple[str, str]] = []
    for approval, call_id, made_by in _approvals_asked_about(plan, conversation, asked_about):
        if approval_held_again(approval) or _approved_after(approval, answers, first_seq):
            continue
        if not _answered_since(plan, conversation, first_seq, asking[call_id][-1]):
            held.append((call_id, made_by))
    return tuple(held)


def _approvals_asked_about(
    plan: TurnPlan, conversation: Mapping[str, Any], asked_about: Mapping[str, str] | None
) -> Iterator[tuple[Mapping[str, Any], str, str]]:
    """The `approved_calls` entries of `conversation` (with their call id and the message
    making the call) of the calls the turn's prompts ask about again, listed: the very call
    `asked_about` names by id (`_asked_about`; None: any call of the id)."""
    listed = {(c.get("tool_call_id"), c.get("message_id")) for c in _listed_calls(conversation)}
    asking = dict(plan.asked_again)
    for approval in conversation.get("approved_calls") or ():
        if not isinstance(approval, Mapping):
            continue
        call_id, made_by = approval.get("tool_call_id"), approval.get("message_id")
        if not isinstance(call_id, str) or not isinstance(made_by, str):
            continue
        if call_id not in asking or (call_id, made_by) not in listed:
            continue
        if asked_about is None or asked_about.get(call_id) == made_by:
            yield approval, call_id, made_by


LandedAfter = tuple[str, str, str, str]
"""An approval a landing marks (`_landed_after`): its call id, the message making the call,
its request id, and the message id of the landed prompt naming the call."""


def _landed_after(
    plan: TurnPlan,
    conversation: Mapping[str, Any],
    first_seq: int,
    asked_about: Mapping[str, str] | None,
) -> tuple[LandedAfter, ...]:
    """The approvals a turn landing past its block stored at `first_seq` marks as given
    before it landed (`ApprovedCall.landed_after`, the turn's last prompt naming the call):
    those of the calls its prompts asked about (as `_held_again` picks them) that a person
    gave after its block (`_approved_after`), not marked yet. Its insert had not landed as
    she answered, its question held nothing then; the stored order alone would have it
    take the call from the prompt she answered (`_fork.approvals_in_fork`)."""
    answers, asking = answered_in(conversation), dict(plan.asked_again)
    marked: list[LandedAfter] = []
    for approval, call_id, made_by in _approvals_asked_about(plan, conversation, asked_about):
        request_id = approval.get("request_id")
        if approval.get("landed_after") is not None or not isinstance(request_id, str):
            continue
        if _approved_after(approval, answers, first_seq):
            marked.append((call_id, made_by, request_id, asking[call_id][-1]))
    return tuple(marked)


async def _asked_about(
    messages: Any, plan: TurnPlan, first_seq: int, epoch: str | None
) -> dict[str, str]:
    """The call each id the turn's prompts ask about again (`TurnPlan.asked_again`) named when
    the turn reserved its block at `first_seq`, as its reservation took it
    (`_turns.asked_again`): the message making the latest call of the id stored below the
    block that no message below it answers (`calls_answered`), by id; none for an id no
    such call has. One find of the messages of the conversation's life (`epoch`) below the
    block making or answering a call of those ids."""
    ids = sorted(call_id for call_id, _ in plan.asked_again)
    life = {} if epoch is None else {"epoch": {"$in": [epoch, None]}}
    query: dict[str, Any] = {
        "conversation_id": plan.conversation_id,
        "seq": {"$lt": first_seq},
        "$or": [{"tool_calls.id": {"$in": ids}}, {"tool_call_id": {"$in": ids}}],
        **life,
    }
    with storage_errors("read the calls the turn asked about again"):
        docs = await messages.find(query).sort("seq", 1).to_list(None)
    found = messages_adapter.validate_python(docs)
    answered = set(calls_answered(found).values())
    latest: dict[str, str] = {}
    for at, message in enumerate(found):
        for call in getattr(message, "tool_calls", None) or ():
            if call.id in ids and (at, call.id) not in answered:
                latest[call.id] = str(message.id)
    return latest


async def _asked_above(
    messages: Any,
    plan: TurnPlan,
    first_seq: int,
    epoch: str | None,
    marks: Sequence[LandedAfter],
) -> dict[tuple[str, str], list[int]]:
    """The `seq`s of the prompts of the marks' request ids stored above the landed turn's
    block (at `first_seq`), by request id and call id they name: one find of the
    conversation's life (`epoch`). A prompt naming no call holds only calls of its own turn,
    never a mark's, made before the landed turn: it is left out."""
    ids = sorted({request_id for _, _, request_id, _ in marks})
    query: dict[str, Any] = {
        "conversation_id": plan.conversation_id,
        "seq": {"$gte": first_seq + len(plan.documents)},
        "hitl_action.request_id": {"$in": ids},
        **({} if epoch is None else {"epoch": {"$in": [epoch, None]}}),
    }
    fields = {"seq": 1, "hitl_action.request_id": 1, "hitl_action.tool_call_ids": 1}
    with storage_errors("read the prompts asked after the turn"):
        docs = await messages.find(query, fields).to_list(None)
    asked: dict[tuple[str, str], list[int]] = {}
    for doc in docs:
        action = doc["hitl_action"]
        for call_id in action.get("tool_call_ids") or ():
            asked.setdefault((action["request_id"], call_id), []).append(int(doc["seq"]))
    return asked


def _for_a_later_prompt(
    mark: LandedAfter,
    conversation: Mapping[str, Any],
    asked: Mapping[tuple[str, str], list[int]],
) -> bool:
    """Whether the answer giving the approval `mark` names was for a prompt of its request
    id about its call stored above the landed turn (`_asked_above`): stored when the answer
    came (below the reach of the prompts then stored, `_stored_reaches`), that prompt is
    the one the person answered, after the landed question in the stored order, so the
    landing never marks it (the order already tells a pop or a fork the right thing). One
    whose turn was still being written as she answered (below the answer's reach only, its
    block reserved) is not, nor one of the id about other calls, which never held the
    approved one: she answered one stored below the landed question, and the landing marks
    it."""
    call_id, made_by, request_id, _ = mark
    reaches = _stored_reaches(conversation, request_id, call_id, made_by)
    later = asked.get((request_id, call_id), ())
    return bool(reaches) and any(seq < max(reaches) for seq in later)


def _stored_reaches(
    conversation: Mapping[str, Any], request_id: Any, call_id: Any, made_by: Any
) -> list[int]:
    """How far the prompts of `request_id` stored as each answer to it that released the call
    came reach (`AnsweredPrompt.stored_below`, at most its reach; its reach, `below`, for
    an answer recorded without it)."""
    entries = map(AnsweredPrompt.model_validate, conversation.get("answered_prompts") or ())
    answers = [
        (
            a.request_id,
            a.below if a.stored_below is None else min(a.stored_below, a.below),
            None if a.calls is None else tuple(a.calls),
        )
        for a in entries
    ]
    return _answer_reaches(answers, request_id, call_id, made_by)


def _answer_reaches(
    answers: Sequence[Answer], request_id: Any, call_id: Any, made_by: Any
) -> list[int]:
    """How far each answer to `request_id` that released the call (`answered_in`: one naming
    it, by id alone too, or naming none) reaches."""
    return [
        below
        for r, below, calls in answers
        if r == request_id
        and (calls is None or (call_id, made_by) in calls or (call_id, None) in calls)
    ]


def _approved_after(approval: Mapping[str, Any], answers: Sequence[Answer], first_seq: int) -> bool:
    """Whether the approval (an `approved_calls` entry) was given after the block at
    `first_seq` was reserved: the latest answer to its request id that released its call
    (`answered_in`: one naming it, by id alone too, or naming none) reaches past the block's
    first `seq`. One whose answer is no longer kept, or recorded without its request id,
    counts as given before, as the turn's reservation found it."""
    request_id = approval.get("request_id")
    call_id, made_by = approval.get("tool_call_id"), approval.get("message_id")
    reaches = _answer_reaches(answers, request_id, call_id, made_by)
    return request_id is not None and bool(reaches) and max(reaches) > first_seq


def _answered_since(
    plan: TurnPlan, conversation: Mapping[str, Any], first_seq: int, prompt_id: str
) -> bool:
    """Whether a person answered the turn's prompt asked by its message `prompt_id` (stored
    at `first_seq` plus its index in the turn): an answer to its request id reaching past
    it (`answered_in`)."""
    at = next((i for i, d in enumerate(plan.documents) if d["_id"] == prompt_id), None)
    action = None if at is None else plan.messages[at].hitl_action
    if at is None or action is None:
        return True  # not a prompt of the turn's: nothing of it to list
    answers = answered_in(conversation)
    return any(r == action.request_id and below > first_seq + at for r, below, _ in answers)


def _retry_refusal(
    plan: TurnPlan,
    conversation: Mapping[str, Any],
    condition: Condition | None,
    own: Collection[str] = (),
) -> StoreError:
    """What a retry sending other content than its turn's record holds is refused with: the
    turn was logged without answers its first attempt was refused (`AnsweredBefore`: denials
    of calls a person approved, answers to calls another turn answered first), and this
    attempt sends them again, so it is told so again; else a Conflict. A call the turn's
    own stored messages answer (`own`, `_answered_by`) was answered by its first attempt,
    whatever the conversation shows since: a retry answering it sends other content."""
    approved = [c for c in approved_among(conversation, plan.denied_calls) if c not in own]
    if approved:
        return _answered_before(plan, approved)
    if condition is not None and condition.retried is not None:
        refusal = condition.retried(conversation, own)
        if refusal is not None:
            return refusal
    return _other_content(plan)


def _answered_by(plan: TurnPlan, stored: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """The calls the turn's own messages among `stored` (its block's, `_looked_up`) answer:
    its first attempt stored those answers, so no other turn answered them first."""
    return frozenset(
        str(d["tool_call_id"])
        for d in stored
        if d.get("turn_id") == plan.turn_id and d.get("role") == "tool" and d.get("tool_call_id")
    )


_ANSWER_LOOKUPS = 3
"""How many times a turn refused as answering calls answered before looks up whether an
answer to them is really there, the conversation moving meanwhile (`_reserve_answering`)."""
_ANSWERED_FIELDS = {
    "message_count": 1,
    "pops": 1,
    "epoch": 1,
    "turns": 1,
    "popped_seqs": 1,
    "pending_calls": 1,
    "approved_calls": 1,
    "resolved_hitl": 1,
    "created_at": 1,
    RELISTED: 1,
    PENDING_BLOCKS: 1,
}
"""What `_unanswered` reads of the conversation: where it stands (`AsRead`), its `Gaps`, what
tells which of a turn's answers it settled before (`answered_since`, `released_calls`), the
calls listed again (`RELISTED`, `_relocated.looked_again`), and the calls of turns that may
still be logged (`PENDING_BLOCKS`, `calls_awaited`)."""
_MOVE_READ = {"message_count": 1, "last_step": 1}
"""What a refused move reads of the conversation: what its refusal says
(`Condition.moved_explain`)."""
_CHECKED_FIELDS = {
    "user_id": 1,
    "epoch": 1,
    "created_at": 1,
    DELETING: 1,
    "popping": 1,
    "turns": 1,
    "popped_seqs": 1,
    "turns_dropped": 1,
    "message_count": 1,
    "pending_calls": 1,
    "approved_calls": 1,
    "resolved_hitl": 1,
    PENDING_BLOCKS: 1,
}
"""What `AgentMessageLogger.check_turn` reads of the conversation: what `_verdict` decides by
(its owner, a delete's mark, the turn records and whether some were dropped, the gaps and
pending calls a late retry's lookup weighs, `Unwritten`), a pop under way
(finished before anything is decided), what tells
a turn's answers from those the conversation settled before (`_retry_refusal`,
`_answers_refusal`), and its life (`epoch`, `created_at`), which the lookups explaining a
refusal select (`_as_judged`)."""

_PENDING_READ = {
    "user_id": 1,
    "epoch": 1,
    "pending_calls": 1,
    "message_count": 1,
    "turns": 1,
    "popped_seqs": 1,
    "turns_dropped": 1,
    PUSHED_OFF: 1,
}
"""What `AgentMessageLogger.calls_answered` reads of the conversation: its pending calls, its
`Gaps` (a call whose turn is still being written, `_made_unstored`), and what tells whether
the list's bound pushed such a turn's call off (`_pushed_off_maybe`)."""
_TAKEN = ("answered", "writing")
"""The `_answer_states` of a call another turn's answer takes (stored, or still to land)."""
_UNSTORED_CALL = "msg-still-being-written"
"""The message `calls_answered` names for a call a turn still being written makes (its id
not stored anywhere yet, and off `pending_calls` once another turn answered it): no message
has this id."""
_UNMADE_CALL = "msg-made-by-none"
"""The message `calls_answered` names for a call no message of the conversation makes and no
turn still being written may make and leave open (`_pushed_off_maybe`: popped, answered in a
conversation since deleted, or never logged; or made and answered by a turn in flight, where
an answer now would be a second one), and for every call a turn answers in a conversation
missing or another user's: no message has this id, so the turn is refused as one whose
`answers_to` names such a call (never placed where a turn still being written lands,
`_Landed.of`), nothing written."""


MAX_FORK_WHOLE_TEXT_CHARS = 64 * 1024 * 1024
"""How many characters of whole texts (fields cut to bound their messages, kept in GridFS)
one fork copies: it holds them in memory at once."""


SourceNow = Literal["whole", "went", "popped"]
"""What a fork's check found of its source (`AgentMessageLogger._with_its_source`)."""
_SOURCE_NOW_READ = {"user_id": 1, **POPS_READ}
"""What a fork's check reads of its source: its owner, and what tells a pop since the fork
read it (`_popped_since`)."""


def _source_went_away(conversation_id: str) -> NotFound:
    """What a fork answers once it took back what it wrote of a source that went."""
    return NotFound(
        f"conversation {conversation_id!r} was not found: it was deleted, or is being "
        "deleted, while the fork copied it"
    )


def _refuse_too_large_a_fork(read: ForkRead, at_seq: int, end: int) -> None:
    """A fork copies its messages as one turn, holding them, their whole texts read back, at
    once: at most `MAX_MESSAGES_PER_TURN` messages, `MAX_TURN_TOOL_CALLS` tool calls,
    `MAX_FORK_BYTES` of messages as stored and `MAX_FORK_WHOLE_TEXT_CHARS` of whole texts,
    refused as a fork before any whole text is read or anything written, naming the last
    `seq` whose fork, moved past its calls' results as every fork is, fits
    (`last_fitting_fork`: never a call whose results lie past the limit, whose fork would be
    refused again), or saying that none does."""
    refusal = _too_large(read, forked_messages(read.messages, end), end, at_seq)
    if refusal is None:
        return
    fitting = last_fitting_fork(
        read.messages,
        at_seq,
        lambda chosen, ends: _too_large(read, chosen, ends, at_seq) is None,
        read.turn_starts,
    )
    if fitting is None:
        raise ForkTooLarge(f"{refusal}, and so would a fork at any seq of this conversation")
    raise ForkTooLarge(f"{refusal}: fork at seq {fitting} or before")


def _too_large(read: ForkRead, chosen: Sequence[AgentMessage], end: int, at_seq: int) -> str | None:
    """What a fork ending at `end`, copying `chosen`, copies past its limits, said; None when
    within them. One ending past what `read` read whole copies past the limit it stopped at:
    `read_fork` reads past those only once a limit stopped it, so no race between its reads
    is ever said as a limit."""
    if end > read.through:
        assert read.over is not None  # `read_fork`: read whole up to its end unless stopped
        return f"{limit_said(read.over)}; at_seq {at_seq} would copy more"
    if len(chosen) > MAX_MESSAGES_PER_TURN:
        return (
            f"a fork copies at most {MAX_MESSAGES_PER_TURN} messages; at_seq {at_seq} would "
            f"copy {len(chosen)}"
        )
    if (made := tool_calls_made(chosen)) > MAX_TURN_TOOL_CALLS:
        return (
            f"a fork copies at most {MAX_TURN_TOOL_CALLS:,} tool calls; at_seq {at_seq} would "
            f"copy {made:,}"
        )
    if read.bytes_past(end):
        return f"{limit_said('bytes')}; at_seq {at_seq} would copy more"
    whole = 0
    for message in chosen:
        whole += whole_text_chars(message)
        if whole > MAX_FORK_WHOLE_TEXT_CHARS:
            return (
                f"a fork copies at most {MAX_FORK_WHOLE_TEXT_CHARS} characters of whole texts "
                f"of cut messages; at_seq {at_seq} would copy more"
            )
    return None


def refuse_unloggable_turn_id(turn_id: str) -> None:
    """InvalidInput for a turn id no turn may be logged under: a migrated legacy turn's, a
    steering delivery's. Refused to a turn, and to a steering inbox, whose runtime could never
    log the turn it runs."""
    _refuse_migrated_turn_id(turn_id)
    _refuse_delivery_turn_id(turn_id)


def _refuse_migrated_turn_id(turn_id: str) -> None:
    if turn_id.startswith(MIGRATED_TURN_PREFIX):
        raise InvalidInput(
            f"turn id {turn_id!r}: ids starting with {MIGRATED_TURN_PREFIX!r} name "
            "migrated legacy turns; a live turn takes another id"
        )


def _refuse_delivery_turn_id(turn_id: str) -> None:
    """A turn logged under the turn id a steering delivery derives (`delivery_turn_id`,
    which anyone can compute) would make that delivery a replay of it: acknowledged, and
    never in the runtime's inbox. Only a delivery takes such an id."""
    if is_delivery_turn_id(turn_id):
        raise InvalidInput(
            f"turn id {turn_id!r} names a steering delivery ({DELIVERY_TURN!r} and 32 "
            "lowercase hex digits: the id a delivery into a running turn's inbox is stored "
            "under); a turn takes another id"
        )


def _assigned_at(conversation: Mapping[str, Any], first_seq: int) -> bool:
    """Whether the turn whose block starts at `first_seq` is the one that assigned the
    conversation an owner (`owned_from`, set by the reservation): a replay of it too."""
    return first_seq > 0 and int(conversation.get("owned_from") or 0) == first_seq


def _taken(conversation_id: str, message_id_: str, seq: int) -> Conflict:
    return TurnConflict(
        f"seq {seq} of conversation {conversation_id!r} is already taken by a message of "
        f"another turn, or message {message_id_!r} is stored at another seq"
    )


def _in_the_way(
    plan: TurnPlan,
    first_seq: int,
    strays: Sequence[Mapping[str, Any]],
    wanted: list[dict[str, Any]],
    found: Mapping[str, Any] | None,
) -> Conflict:
    """The refusal of a turn whose `wanted` messages meet `strays` they may not replace: its
    own messages stored out of its block, `Corrected` when the conversation `found` lists a
    message of the turn as popped (as a retry past the kept records is told,
    `_corrected_or`), else `_stored_apart`; else what holds its `seq`s."""
    ids = {d["_id"] for d in wanted}
    own = [d for d in strays if d["_id"] in ids and d.get("seq") is not None]
    if own and ({d["_id"] for d in plan.documents} & {i for i, _ in _popped_at(found)}):
        return _corrected(plan)
    if own:
        return _stored_apart(plan, first_seq, own[0]["_id"], int(own[0]["seq"]))
    return _taken(plan.conversation_id, wanted[0]["_id"], wanted[0]["seq"])


def _passed_since(plan: TurnPlan, first_seq: int) -> Conflict:
    """The refusal of a turn landing in the block it was given up for good in, which pops
    passed since (`AgentMessageLogger._passed_since_given_up`): `Corrected`, as every retry
    of it is (its record marked popped)."""
    return Corrected(
        f"turn {plan.turn_id!r} was given up for good in its block at seq {first_seq} of "
        f"conversation {plan.conversation_id!r} (a send of it refused: it could not move to "
        "the end), and pops passed that block since, giving its seqs back: this send's "
        "insert landed there late and is taken back, the turn is not stored. Log what the "
        "conversation still needs as a new turn"
    )


def _stored_apart(plan: TurnPlan, first_seq: int, message_id_: str, seq: int) -> Conflict:
    """The refusal of a turn whose own message (`message_id_`, one of its ids) is stored at
    `seq` where the store cannot take it for the turn stored whole in one block of it (this
    attempt writes into the block from `first_seq`)."""
    return TurnConflict(
        f"turn {plan.turn_id!r} of conversation {plan.conversation_id!r} has its message "
        f"{message_id_!r} stored at seq {seq}, and is not stored whole with this content in "
        f"one block of it (this attempt's from seq {first_seq}): it is not answered from there"
    )


def _stored_in_part(plan: TurnPlan, stored: int) -> Conflict:
    return TurnConflict(
        f"turn {plan.turn_id!r} has {stored} of the {plan.count} messages this retry sends "
        "stored, and its record is no longer kept: an earlier attempt stored it in part, or "
        "it was logged with fewer messages. It is not completed from a retry; use a new "
        "turn_id for what was not stored"
    )


def _popped_from(plan: TurnPlan, block: RecordedBlock, pops: Mapping[str, Any] | None) -> bool:
    """Whether the conversation's `pops` (`popped_messages`, `popping`) tell that a pop
    removed, or is removing, one of the turn's messages (by its id) at a `seq` of `block`."""
    ids = {d["_id"] for d in plan.documents}
    seqs = range(block.first_seq, block.first_seq + plan.count)
    removed = _popped_at(pops)
    popping = (pops or {}).get("popping")
    if isinstance(popping, Mapping):
        removed.add((popping.get("message_id"), popping.get("seq")))
    return any(id_ in ids and isinstance(seq, int) and seq in seqs for id_, seq in removed)


def _of_the_turn(plan: TurnPlan, found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`found`, the messages stored in the turn's block or under its ids; Conflict when one
    of them is another turn's."""
    if any(d.get("turn_id") != plan.turn_id for d in found):
        raise TurnConflict(f"the seq block of turn {plan.turn_id!r} holds messages of another turn")
    return found


class OtherContent(TurnConflict):
    """A retry of a turn sending other content than it was logged with."""


class Corrected(TurnConflict):
    """A retry of a turn a pop removed a message of since it was logged: it is not logged
    again."""


class _DeletedSince(Conflict):
    """An attempt whose conversation was deleted (or a fork's, taken back) between its
    reservation and its insert, perhaps started again under its id since: what it inserted
    went with it (`_deleted_since`); a retry may have logged the turn in the new one."""


def _deleted_since(conversation_id: str) -> Conflict:
    """The refusal of an attempt whose conversation was deleted (and perhaps started again
    under its id) between its reservation and its insert: what it inserted went with it."""
    return _DeletedSince(
        f"conversation {conversation_id!r} was deleted since this turn reserved its place "
        "(and perhaps started again under its id): nothing this attempt inserted is stored. "
        "Another attempt of the turn may have logged it in the conversation under the id "
        "now: sending the turn again answers with it if so"
    )


def _corrected(plan: TurnPlan) -> Conflict:
    return Corrected(
        f"turn {plan.turn_id!r} was corrected since it was logged (a pop removed one of "
        "its messages): it cannot be logged again. Use a new turn_id for a new turn"
    )


class _LoggedMeanwhile(StorageUnavailable):
    """A turn judged new whose own record another attempt of it wrote meanwhile (the answer
    its condition meets may be its own): judged again, as a retry; left uncaught, a 503 to
    send the turn again as it is."""


class Unreserved(StorageUnavailable):
    """A turn's reservation found the conversation changed under it at each attempt (writers
    racing): nothing was written, and the turn may be sent again as it is (503, as for a
    dropped connection), which a retry policy does."""


class _OwnedElsewhere(Conflict):
    """A fork's reservation found its new id held by a conversation of another user than its
    source's owner now (`_held`): said as the id being taken, and told apart by a retry of
    the fork there (`_what_changed`)."""


class HeldOff(Conflict):
    """A turn making calls would push a call a prompt holds, unreleased, off the bounded
    `pending_calls` (`_held_kept`): nothing was written."""

    def __init__(
        self,
        message: str,
        *,
        conversation_id: str,
        held: tuple[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.conversation_id = conversation_id
        self.held = held
        """The call pushed off and the prompt holding it, by their ids; None when the
        conversation read after the refusal no longer tells them."""


class PoppedWhileForked(StorageUnavailable):
    """A fork whose check found that a pop removed a `seq` it copies from its source since it
    read it: what it wrote was taken back. `AgentMessageLogger.fork` makes it again as a fresh
    fork would be now; raised when that fork meets the same race again (retry)."""


def _popped_while_forked(conversation_id: str, fork: Mapping[str, Any]) -> PoppedWhileForked:
    """What a fork answers once it took back what it wrote of a source a pop changed."""
    at = fork.get("forked_from", {}).get("seq")
    return PoppedWhileForked(
        f"a pop removed a message of conversation {conversation_id!r} up to seq {at} while the "
        "fork copied it: nothing of the fork was kept; retry the fork"
    )


class NotStoredYet(StorageUnavailable):
    """A retry of a turn sending other content than its first attempt reserved its place
    with, nothing of it stored yet, while that attempt may still store it (until the rules'
    `abandon_after` from its reservation): retry later."""


def _logged_with_fewer(plan: TurnPlan, found: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the turn's block (`found`, in `seq` order) runs past the turn's own messages
    into the next turn's: the turn was logged with fewer messages than this retry sends
    (other content, as while its record is kept). Another turn's message anywhere else is
    `_of_the_turn`'s Conflict (`Corrected` when a pop took a message of the turn from the
    block, `_corrected_or`)."""
    own = len(list(takewhile(lambda d: d.get("turn_id") == plan.turn_id, found)))
    return 0 < own < len(found) and all(d.get("turn_id") != plan.turn_id for d in found[own:])


def _other_content(plan: TurnPlan) -> Conflict:
    return OtherContent(
        f"turn {plan.turn_id!r} was logged with other content ({plan.count} messages "
        "now); a retry must send the same messages. Use a new turn_id for a new turn"
    )


def _fork_stands(
    conversation_id: str, fork: Mapping[str, Any], at_seq: int, refused: StoreError
) -> Conflict:
    """The refusal of a fork into the id of a fork of the same source that stored its copies,
    saying what changed, from what refused the retry (`_what_changed`)."""
    at = fork.get("forked_from", {}).get("seq")
    return Conflict(
        f"conversation {fork['_id']!r} exists already, the fork of {conversation_id!r} at seq "
        f"{at} as stored then; {_what_changed(conversation_id, fork, at_seq, refused)}: fork "
        "into a new id"
    )


def _what_changed(
    conversation_id: str, fork: Mapping[str, Any], at_seq: int, refused: StoreError
) -> str:
    """Why a retry of a fork at `at_seq` is not the fork stored, as its refusal tells: a pop
    in the fork took some of its copies (`Corrected`: the turn holding them was corrected),
    the source holds other messages up to the fork's end (`OtherContent`: the same turn with
    other copies) or none at `at_seq` (`InvalidInput`), the fork is another user's than its
    source's owner now (`_OwnedElsewhere`: one was assigned since, never said whose), or the
    retry ends at another `seq` (the turn holding the copies another one: another fork, or
    its source changed so)."""
    at = fork.get("forked_from", {}).get("seq")
    if isinstance(refused, Corrected):
        return (
            f"a pop in {fork['_id']!r} removed some of its copies since, so a retry can no "
            "longer be that fork"
        )
    if isinstance(refused, OtherContent | InvalidInput):
        return (
            f"{conversation_id!r} no longer holds up to seq {at} what it copied (a pop, a "
            "pop and a later turn, or a slow turn's insert landing in a block the fork "
            "passed empty, changed it)"
        )
    if isinstance(refused, TurnConflict):
        return f"{fork['_id']!r} or {conversation_id!r} changed since"
    if isinstance(refused, _OwnedElsewhere):
        return (
            f"{fork['_id']!r} is another user's than {conversation_id!r} is now (one of them "
            "was assigned since the fork was made, and a retry never changes whose a fork is)"
        )
    return (
        f"a fork of {conversation_id!r} at seq {at_seq} ends at another seq: another fork, "
        f"or {conversation_id!r} changed up to it since"
    )


def _absent(conversation_id: str, actor: Actor, condition: Condition | None) -> Exception:
    """What a reservation that may not create its conversation raises when it is missing: to
    a user token the NotFound another user's is (`Actor.refusal` of no owner), so the answer
    never tells them apart; else the condition's own."""
    assert condition is not None
    return actor.refusal(conversation_id, None) or condition.absent or condition.refusal


def _held(
    refusal: StoreError, condition: Condition | None, *, another_owners: bool = False
) -> StoreError:
    """What a reservation raises when its id holds what it may not write to (`refusal`: another
    user's conversation, `another_owners`, or legacy turns not migrated yet). A reservation
    that only creates its conversation (`Condition.new_only`, a fork's) is refused by its
    condition, as for any id that is taken ("exists already"): no claim or migration would
    make it there; another user's, as `_OwnedElsewhere`, which says no more, so a retry of the
    fork there can tell why it is not that fork (`_what_changed`). A NotFound stays: to a user
    token another user's id is as one that is missing."""
    if condition is None or not condition.new_only or isinstance(refusal, NotFound):
        return refusal
    if another_owners:
        return _OwnedElsewhere(condition.refusal.message)
    return condition.refusal


def _not_migrated(
    conversation_id: str, actor: Actor, owner: object, what: str, condition: Condition | None
) -> StoreError:
    """What a write to an id held by legacy turns not migrated yet (`owner`: the user they
    name) raises: NotFound to a user token they do not name, as for a missing id; else refused
    as not migrated yet (`not_migrated_yet`, `_held`: a fork's reservation as for any id that
    is taken). The one refusal of `_refuse_unmigrated` (turns in the legacy collection) and
    `_refuse_held_by_a_legacy_turn` (a turn under the id in `agent_conversations`)."""
    if actor.strict and owner != actor.user_id:
        return NotFound(f"conversation {conversation_id!r} was not found")
    return _held(not_migrated_yet(conversation_id, what), condition)


def _as_judged(conversation_id: str, found: Mapping[str, Any], actor: Actor) -> dict[str, Any]:
    """A filter of the conversation `found` (read with its `epoch` and `created_at`), which a
    turn of `actor` was judged on (`_verdict`): that life of it (`same_as_read`), while
    `actor` may write to it (`Actor.owner_filter`). A lookup explaining a refusal of the turn
    selects it, so a conversation deleted since, started again under the id or taken by
    another owner never explains one: what `actor` may not see is never told."""
    return same_as_read(conversation_id, found) | actor.owner_filter()


def _seen_by(actor: Actor, found: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """Of the conversation document a write found under an id (read whole, or with
    `UNSTANDING_READ`), what `actor` sees, as a read sees it (`seen_by_caller`): to a user
    token (or a runtime acting for a user: `Actor.strict`) another owner's conversation, or
    an unowned one, is none, as when no document is
    there, so a write of hers is refused as one finding none (her legacy turns under the id:
    409 not migrated yet, `_refuse_unmigrated`; else NotFound) and never tells that another
    conversation holds the id. One a delete marked or a fork not made yet is seen by all."""
    hidden = found is not None and actor.strict and not actor.owns(found)
    return seen_by_caller(found, found is not None and not hidden)


def _refused_turn(plan: TurnPlan) -> str:
    """How a refusal names the turn `plan` sends: "the fork" for a fork's copies, whose turn
    id the store made (`is_fork_turn`: the caller never saw it, and may not send it), else
    the turn by its id."""
    return "the fork" if is_fork_turn(plan.turn_id) else f"turn {plan.turn_id!r}"


def _refuse_derived(conversation_id: str, actor: Actor) -> None:
    """Refuse a new conversation under an id the migration derives. To a user token (or a
    runtime acting for a user: `Actor.strict`) it is NotFound, as another user's
    conversation is: the answer tells nothing of what exists."""
    if not is_derived_id(conversation_id):
        return
    if actor.strict:
        raise NotFound(f"conversation {conversation_id!r} was not found")
    raise InvalidInput(
        f"conversation id {conversation_id!r}: ids starting with "
        f"{DERIVED_CONVERSATION_PREFIX!r} or {DERIVED_TURN_PREFIX!r} name migrated legacy "
        "conversations; a new conversation takes another id"
    )


def _own_messages(conversation_id: str, source: Mapping[str, Any]) -> dict[str, Any]:
    """A filter for the messages of the conversation document `source`: its epoch's, or
    none's (stored before epochs), never what a conversation deleted since left under the
    id."""
    return {"conversation_id": conversation_id, "epoch": {"$in": [source.get("epoch"), None]}}


def _fork_condition(
    plan: TurnPlan,
    origin: ForkOrigin,
    source: Mapping[str, Any],
    resolved: list[str],
    approved: list[dict[str, Any]],
    answered: list[dict[str, Any]],
) -> Condition:
    """A fork's reservation creates its conversation (an existing one is a Conflict) with its
    origin, the prompts it keeps resolved by request id and the answers it copies
    (`ForkAnswers`), the approvals it keeps, its source as it read it (`ForkCheck`), kept
    until the fork's check of that source passes, and the legacy id its source's owner (its
    own) was derived from (`legacy_user_id`: its copies name that owner as the source's do)."""
    forked_from = origin.model_dump()
    unchecked = _as_read(source).model_dump()
    return Condition(
        {"created_at": {"$exists": False}},
        lambda now: {
            "forked_from": literal(forked_from),
            "resolved_hitl": literal(resolved),
            "answered_prompts": literal(answered),
            "approved_calls": literal(approved),
            "fork_check": literal(unchecked),
            "legacy_user_id": literal(source.get("legacy_user_id")),
        },
        Conflict(f"conversation {plan.conversation_id!r} exists already; fork into a new id"),
        create=True,
        new_only=True,
    )


def _followed_to(
    owner: str, stored: list[AgentMessage], reserved: _Reserved
) -> tuple[list[AgentMessage], _Reserved]:
    """A fork's copies and conversation as answered once its check moved them to `owner`, its
    source's owner now (`AgentMessageLogger._follow_its_source`)."""
    conversation = reserved.conversation
    if conversation is not None:  # observers (the dual write) name the owner it has
        conversation = conversation.model_copy(update={"user_id": owner, "legacy_user_id": None})
    copies = [m.model_copy(update={"user_id": owner}) for m in stored]
    return copies, replace(reserved, owner=owner, conversation=conversation)


def _fork_as_created(
    reserved: _Reserved, source: Mapping[str, Any], origin: ForkOrigin
) -> dict[str, Any]:
    """The fork's conversation as its reservation created it: its owner, `epoch` and
    `created_at`, its `forked_from` and its `fork_check` (`_fork_condition`), unread."""
    return {
        "user_id": reserved.owner,
        "epoch": reserved.epoch,
        "created_at": reserved.created_at,
        "forked_from": origin.model_dump(),
        "fork_check": _as_read(source).model_dump(),
    }


def _as_read(source: Mapping[str, Any]) -> ForkCheck:
    """The fork's source as the fork read it: what its check looks for."""
    return ForkCheck(
        epoch=source.get("epoch"),
        created_at=source.get("created_at"),
        pops=int(source.get("pops") or 0),
    )


def _popped_since(source: Mapping[str, Any], check: ForkCheck, end: int) -> bool:
    """Whether a pop removed a `seq` up to `end` (what the fork copies) from `source`, read
    with `POPS_READ`, since the fork read it (`check.pops`, `popped_since_read`). None for a
    fork made before its check recorded `pops`."""
    return check.pops is not None and popped_since_read(source, check.pops, end)


def _same_as_reserved(conversation_id: str, reserved: _Reserved) -> dict[str, Any]:
    """A filter for the conversation the turn reserved on, never one started under the id
    since (`same_conversation`)."""
    return same_conversation(conversation_id, epoch=reserved.epoch, created_at=reserved.created_at)


def _written_by(
    conversation_id: str, reserved: _Reserved, stored: Sequence[AgentMessage]
) -> dict[str, Any]:
    """The turn's own messages as it wrote them: its ids, under the owner and the epoch it
    stamped."""
    return {
        "conversation_id": conversation_id,
        "_id": {"$in": [m.id for m in stored]},
        "user_id": reserved.owner,
        "epoch": reserved.epoch,
    }


def _fork_ids(chosen: Sequence[AgentMessage], plan: TurnPlan) -> dict[str, str]:
    """The original's message ids a fork copies (`chosen`) to its copies' (`plan`)."""
    return {str(m.id): str(d["_id"]) for m, d in zip(chosen, plan.documents, strict=True)}


def _approvals_of_copies(
    approvals: Iterable[Mapping[str, Any]], chosen: Sequence[AgentMessage], plan: TurnPlan
) -> list[dict[str, Any]]:
    """The original's `approved_calls` a fork keeps (`approvals_in_fork`) it remembers: those
    of the calls its copies make,
    naming the copies (a call a person approved stays approved in the fork). One later
    prompts hold again (`held_by`, after `held_before`) is held by the copy of the latest of
    them the fork copies; held by none it copies, it is in force. One a later call reusing
    its call's id superseded (`superseded_by`) stays superseded if the fork copies that
    call; one a prompt landed after (`landed_after`) names that prompt's copy."""
    ids = _fork_ids(chosen, plan)

    def copied(a: Mapping[str, Any]) -> dict[str, Any]:
        earlier = a.get("held_before")
        holders = [*(earlier if isinstance(earlier, list) else ()), a.get("held_by")]
        held = [ids[h] for h in holders if isinstance(h, str) and h in ids]
        copy = {
            **a,
            "message_id": ids[str(a.get("message_id"))],
            "held_by": held[-1] if held else None,
            "held_before": held[:-1],
            "superseded_by": ids.get(str(a.get("superseded_by"))),
            "landed_after": ids.get(str(a.get("landed_after"))),
        }
        return ApprovedCall.model_validate(copy).model_dump()  # every key, as the model has

    return [copied(a) for a in approvals if str(a.get("message_id")) in ids]


def _leaving_what_the_copies_left(
    plan: TurnPlan, chosen: Sequence[AgentMessage], origin: ForkOrigin, kept: ForkAnswers
) -> TurnPlan:
    """A fork's plan leaving counted and pending what the copied messages' turns did: the
    copies are one turn, but they count the turns of the original they copy (`origin`'s
    turn starts), and their pending calls and prompt follow the messages as stored (a
    prompt's params stay bounded), by the original's turn starts and the answers the fork
    keeps (`kept`)."""
    ids = _fork_ids(chosen, plan)
    calls, prompt = fork_pending(kept.folded, ids, kept.resolved)
    return replace(
        plan,
        turn_starts=fork_turn_count(chosen, origin.turn_starts),
        opened_calls=calls,
        answered_calls=(),
        pending_hitl=prompt,
        holds_pending=None,
        named_holds=(),
    )


def _logged_at(conversation_id: str, seq: int | None, step: str | None) -> Condition | None:
    """The condition of a turn logged at `next_seq` (the conversation's next `seq` is `seq`; a
    conversation not created yet has none: its next is 0) and of a `step` (after the latest
    step the conversation logged, which it becomes); None without either."""
    if seq is None and step is None:
        return None
    if seq is not None and (
        isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SAFE_INTEGER
    ):
        said = seq if type(seq) is int and abs(seq) < 2**63 else "(withheld)"
        raise InvalidInput(
            f"invalid next_seq {said}: a seq is an integer from 0 to {MAX_SAFE_INTEGER}"
        )
    if step is not None:
        step = validate_identifier(step, "step")
    query: dict[str, Any] = {}
    if seq is not None:
        query["message_count"] = {"$in": [0, None]} if seq == 0 else seq

    def own(block: range) -> dict[str, Any]:
        # The turn's own first reservation took `block` at `next_seq` (the conversation then
        # ends at its end) and logged its step (`$gt`): neither is the conversation moving
        # on; a retry sends the first attempt's arguments.
        at = {} if seq is None else {"message_count": block.stop if seq == block.start else seq}
        return {**at, **({} if step is None else {"last_step": {"$not": {"$gt": step}}})}

    if step is not None:
        query["last_step"] = {"$not": {"$gte": step}}

    def moved(conversation: Mapping[str, Any], *, own_step: bool = False) -> StoreError:
        now, later = int(conversation.get("message_count") or 0), conversation.get("last_step")
        after = later is not None and step is not None and later >= step
        if after and not (own_step and later == step):
            return TranscriptMoved(
                f"conversation {conversation_id!r} logged step {later!r}, after {step!r}",
                next_seq=now,
                later_step=later,
            )
        return TranscriptMoved(
            f"conversation {conversation_id!r} moved on: its next seq is {now}, not {seq}",
            next_seq=now,
        )

    def stage(now: datetime) -> dict[str, Any]:
        return {} if step is None else {"last_step": literal(step)}

    return Condition(
        query,
        stage,
        Conflict(f"conversation {conversation_id!r} moved on"),
        create=True,
        explain=moved,
        moved=lambda now, _first: stage(now),
        own=own,
        own_explain=partial(moved, own_step=True),
        moved_explain=partial(moved, own_step=True),
    )


def _denials(plan: TurnPlan, refused: Mapping[str, str]) -> Condition | None:
    """The condition of a turn denying calls of earlier turns (`TurnPlan.denied_calls`): no
    person approved the prompt holding any of them first (a request's first answer is its
    answer), nor the prompt `refused` names for it (the one the denial answers), else
    `AnsweredBefore`, nothing written. None for a turn denying none, or only calls a
    question of its own asks about before the denial (`refusals_of_own_prompts`, unless
    `refused` names another prompt for it): the denial answers that question.

    Its refusal names every call denied; one naming those the conversation shows approved
    is built from the conversation found (`_joined` takes only that one as decisive)."""
    denied = _denied(plan, refused)
    if not denied:
        return None
    every = _answered_before(plan, list(denied))

    def answered_before(conversation: Mapping[str, Any]) -> StoreError:
        released = released_calls(conversation, denied, refused)
        return _answered_before(plan, released) if released else every

    return Condition(
        denials_hold(denied, refused),
        lambda now: {},
        every,
        create=True,
        explain=answered_before,
        landing=_denials_landing(plan, denied, refused),
    )


def _denials_landing(plan: TurnPlan, denied: Sequence[str], refused: Mapping[str, str]) -> Landing:
    """`_denials` where a turn logged at the end in place of its empty block lands
    (`Landing`), as the same turn logged there fresh is judged: a call it denies that is
    listed pending again (the fold after its block passed put it back, `_relocated.refold`)
    and that a person approved since is `AnsweredBefore`. One still off the list is the
    turn's first reservation's, which nobody could approve meanwhile (a later message
    answering it refuses the move: `Unmovable`, `_answers_landing`)."""

    def refusal(
        conversation: Mapping[str, Any], _found: Sequence[Mapping[str, Any]]
    ) -> StoreError | None:
        calls = conversation.get("pending_calls") or ()
        listed = {c.get("tool_call_id") for c in calls if isinstance(c, Mapping)}
        released = released_calls(conversation, [c for c in denied if c in listed], refused)
        return _answered_before(plan, released) if released else None

    return Landing((), refusal)


def _denied(plan: TurnPlan, refused: Mapping[str, str]) -> tuple[str, ...]:
    """The calls of earlier turns a turn denies that a person's approval may have answered
    first (`_denials`): all it denies but those a question of its own asks about before the
    denial (`refusals_of_own_prompts`), unless `refused` names another prompt for it."""
    own = plan.refusals_of_own_prompts
    return tuple(c for c in plan.denied_calls if c not in own or refused.get(c, own[c]) != own[c])


def _misnamed(
    plan: TurnPlan, named: Mapping[str, str], found: Sequence[Mapping[str, Any]]
) -> InvalidInput | None:
    """InvalidInput when `answers_to` names for a call (`named`) a message that does not make
    that call in the conversation (`found`, `answers_lookup`: read from another conversation,
    a fork): nobody answered that call, which may still be pending; or names it by
    `_UNMADE_CALL` (`calls_answered`: no message of the conversation makes it, answered in a
    conversation since deleted or never logged), said so first; None otherwise."""
    makes = {(c.get("id"), d["_id"]) for d in found for c in d.get("tool_calls") or ()}
    wrong = {c: m for c, m in named.items() if (c, m) not in makes}
    if not wrong:
        return None
    if unmade := [c for c, m in wrong.items() if m == _UNMADE_CALL]:
        return InvalidInput(
            f"invalid turn {plan.turn_id!r} of conversation {plan.conversation_id!r}: it "
            f"answers a call of an earlier turn, but no message of this conversation makes "
            f"call {listed(unmade, shown)} (answered in a conversation since deleted, or never "
            "logged); nothing was stored. Log the turn without that answer"
        )
    said = "; ".join(f"message {shown(m)} does not make call {shown(c)}" for c, m in wrong.items())
    return InvalidInput(
        f"invalid answers_to of turn {plan.turn_id!r}: in conversation "
        f"{plan.conversation_id!r}, {said} (read from another conversation, a fork? or "
        "stored by a turn given up for good, never the conversation's). "
        "Name the message that made each call as this conversation's pending_calls "
        "serves it"
    )


@dataclass(frozen=True)
class _Landed:
    """The messages that tell whether the calls a turn names have an answer (`found`,
    `answers_lookup`, in `seq` order) as they stand once the blocks still being written land:
    a call whose named message is not stored (its turn's insert lost or in flight, or its
    block passed: its writer died, past `abandon_after`) is made before every message, so an
    answer stored after its reservation is judged as taking it, as `pending_calls` served it
    (`seen`), whether another turn's block is still being written or not; `made_at`, each
    message's `seq` there (for one not stored, the last of the first block still being
    written, the latest its turn may end at: what follows it is another turn's; -1 when none
    is); `written_from`, the first `seq` still being written when a message named is not
    stored (-1: none is, or every message named is stored); `awaited`, the calls named
    (call id, message id) whose message is not stored that a block the conversation
    watches records as its turn's (`calls_awaited`: that turn may still be logged)."""

    seen: Sequence[Mapping[str, Any]]
    made_at: Mapping[str, int]
    written_from: int = -1
    awaited: frozenset[tuple[str, str]] = frozenset()

    @classmethod
    def of(
        cls,
        found: Sequence[Mapping[str, Any]],
        named: Mapping[str, str],
        gaps: Gaps,
        count: int,
        unpassed: int | None,
        now: datetime,
        rules: TurnRules,
    ) -> _Landed:
        """`found` (every message from `unpassed` on among them) with the calls of `named`
        whose message it lacks made where they may still land (before every message when no
        block below `count` is still being written: `Gaps.written`)."""
        made_at = {str(d["_id"]): int(d["seq"]) for d in found}
        unstored = _unstored_makers(named, made_at)
        if not unstored:
            return cls(found, made_at)
        seqs = {int(d["seq"]) for d in found}
        missing = range(unpassed, count) if unpassed is not None else range(0)
        unwritten = [s for s in missing if s not in seqs]
        first = gaps.written(unwritten, now=now, abandon_after=rules.abandon_after)
        # made before every message: the block it lands in (or, passed, never) cannot be told
        # apart from another turn's still being written, and an answer stored after its
        # reservation takes its call wherever that is
        end = gaps.turn_end(first, count) if first is not None else -1
        written_from = first if first is not None else -1
        return cls(
            _made_first(found, unstored), {**made_at, **dict.fromkeys(unstored, end)}, written_from
        )

    @classmethod
    def at_the_end(cls, found: Sequence[Mapping[str, Any]], named: Mapping[str, str]) -> _Landed:
        """`found` (`answers_lookup`) as a turn landing past every message judges them
        (`_answers_landing`): the calls of `named` whose message it lacks made before every
        message, as `of` makes them when no block is still being written."""
        made_at = {str(d["_id"]): int(d["seq"]) for d in found}
        unstored = _unstored_makers(named, made_at)
        return cls(_made_first(found, unstored), {**made_at, **dict.fromkeys(unstored, -1)})

    def awaiting(self, recorded: Collection[tuple[str, str]]) -> _Landed:
        """These messages, the calls named whose message is not stored among `recorded`
        (`calls_awaited`) awaited."""
        stored = {str(d["_id"]) for d in self.seen if int(d["seq"]) >= 0}
        named = {(c.get("id"), d["_id"]) for d in self.seen for c in d.get("tool_calls") or ()}
        awaited = {k for k in named & set(recorded) if k[1] not in stored}
        return replace(self, awaited=frozenset(awaited))

    def makes(self, call_id: str, message: str) -> bool:
        """Whether `message` makes `call_id` here, stored or still to land."""
        return any(
            d["_id"] == message and any(c.get("id") == call_id for c in d.get("tool_calls") or ())
            for d in self.seen
        )


def _logged_meanwhile(plan: TurnPlan) -> _LoggedMeanwhile:
    """The turn was logged by another attempt of it while this one was judged."""
    return _LoggedMeanwhile(
        f"turn {plan.turn_id!r} of conversation {plan.conversation_id!r} was logged "
        "by another attempt while this one was judged; send it again as it is"
    )


def _its_own_answers(plan: TurnPlan, found: Sequence[Mapping[str, Any]]) -> bool:
    """Whether an answer the lookup found (`answers_lookup`) to a call the turn answers is the
    turn's own (another attempt of it stored it, its record maybe dropped since)."""
    return any(
        d.get("role") == "tool"
        and d.get("tool_call_id") in plan.answered_calls
        and d.get("turn_id") == plan.turn_id
        for d in found
    )


def _answers_judged(
    plan: TurnPlan,
    named: Mapping[str, str],
    calls: Collection[str],
    found: Sequence[Mapping[str, Any]],
    landed: _Landed,
    written: Callable[[int], bool],
) -> StoreError | None:
    """Why a turn may not take its answers to `calls` (off `pending_calls`; `named` names the
    message that made each), judged on the stored messages `found` as they stand once the
    blocks still being written land (`landed`), the one rule whatever path asks: first
    `AnsweredBefore` for a call a stored answer takes (a call's first answer is its answer),
    judged before the message named is looked for, which may still be being written; then
    `StorageUnavailable` for one a block past its message still being written may answer
    (`written`, from that message's `seq`); then InvalidInput for a message named that does
    not make its call here (read from another conversation, a fork: nobody answered that
    call); then the Conflict of a later call of its id following it (the answer would take
    that one). None: no answer to them is there."""
    states = _answer_states(named, calls, landed, written)
    if answered := [c for c, state in states.items() if state == "answered"]:
        return _answered_first(plan, answered)
    if writing := [c for c, state in states.items() if state == "writing"]:
        return _answer_being_written(plan, writing)
    if awaited := sorted(c for c, m in named.items() if (c, m) in landed.awaited):
        return _call_turn_unstored(plan, awaited)
    if (misnamed := _misnamed(plan, named, found)) is not None:
        return misnamed
    if followed := [c for c, state in states.items() if state == "followed"]:
        return _followed(plan, followed)
    return None


def _relogged_ids(
    conversation_id: str, named: Mapping[str, str], found: Sequence[Mapping[str, Any]]
) -> dict[str, str]:
    """Those of the calls `named` (call id to the message making it) whose message named
    makes it nowhere in `found` (`answers_lookup`) but is an earlier id of a message of the
    same turn making the call (message ids are derived from the turn and the index: a turn
    refused an answer on its late retry and re-logged without it numbers its messages
    anew, and the id may now be another of its messages), each with that stored message
    (the latest, in `seq` order): the answer named the call as `pending_calls` served it
    before that turn was re-logged. The conversation's id is in every id, so an id read
    from another conversation (a fork) matches none."""
    renamed: dict[str, str] = {}
    ids_of: dict[str, frozenset[str]] = {}  # each turn's ids, derived once
    for call_id, named_id in named.items():
        if named_id in (_UNMADE_CALL, _UNSTORED_CALL) or any(
            d["_id"] == named_id and _makes(d, call_id) for d in found
        ):
            continue
        for document in found:
            turn_id = document.get("turn_id")
            if not isinstance(turn_id, str) or not _makes(document, call_id):
                continue
            if turn_id not in ids_of:
                ids_of[turn_id] = _turn_ids(conversation_id, turn_id)
            if named_id in ids_of[turn_id]:
                renamed[call_id] = str(document["_id"])
    return renamed


def _makes(document: Mapping[str, Any], call_id: str) -> bool:
    """Whether the stored message `document` makes the call `call_id`."""
    return any(c.get("id") == call_id for c in document.get("tool_calls") or ())


def _turn_ids(conversation_id: str, turn_id: str) -> frozenset[str]:
    """The ids a message of the turn `turn_id` has at any index."""
    return frozenset(message_id(conversation_id, turn_id, i) for i in range(MAX_MESSAGES_PER_TURN))


def _unstored_makers(named: Mapping[str, str], made_at: Mapping[str, int]) -> dict[str, list[str]]:
    """The messages `named` (call id to the message making it) names that are not among
    those stored (`made_at`), each with the calls it makes; never `_UNMADE_CALL`."""
    unstored: dict[str, list[str]] = {}
    for call_id, message in named.items():
        if message not in made_at and message != _UNMADE_CALL:
            unstored.setdefault(message, []).append(call_id)
    return unstored


def _made_first(
    found: Sequence[Mapping[str, Any]], unstored: Mapping[str, Sequence[str]]
) -> list[Mapping[str, Any]]:
    """`found` with the messages `unstored` names (message id to the calls it makes), not
    stored, made before every message (`seq` -1), in `seq` order."""
    placed = [
        {"_id": m, "seq": -1, "tool_calls": [{"id": c} for c in calls]}
        for m, calls in unstored.items()
    ]
    return sorted([*found, *placed], key=lambda d: int(d["seq"]))


def _answer_states(
    named: Mapping[str, str],
    calls: Collection[str],
    landed: _Landed,
    written: Callable[[int], bool],
) -> dict[str, str | None]:
    """How the messages `landed` leave each of `calls` whose message `named` makes it there
    (`answer_found`): "answered", "followed", "writing" (no answer there, but a block past its
    message is still being written: `written`), or None (it awaits its answer)."""
    states: dict[str, str | None] = {}
    for call_id in sorted(c for c in calls if landed.makes(c, named[c])):
        state = answer_found(landed.seen, call_id, named[call_id])
        if state is None and written(landed.made_at[named[call_id]]):
            state = "writing"
        states[call_id] = state
    return states


def _pushed_off_maybe(
    conversation: Mapping[str, Any], found: Sequence[Mapping[str, Any]], written_from: int
) -> frozenset[str]:
    """The ids of the calls `pending_calls` may have lost that a turn still being written
    made and left open (its reservation listed it; such turns write from `written_from` on;
    `found`, the stored messages from there, `answers_lookup`); none when it can have lost
    none. Only the list's bound (the newest `PENDING_CALLS_KEPT`) pushes such a call off,
    and the update that does marks the newest call it pushed off (`calls_pushed_off`,
    `_reservation.PUSHED_OFF`) and names the calls pushed off (the newest
    `PENDING_CALLS_KEPT` of them in this life, `CallsPushedOff.call_ids`): the turn's call
    may be among those only if the turn reserved before that update (its record's order is
    below the mark's) and its block starts at or below that call's `seq` (every call listed
    after its own was made past its block's start), and only a call the mark names (a call
    pushed off before as many more were, or by an earlier build, is no longer told from one
    no message makes). A full list, calls made and answered
    since, or a turn popped since (its record past the block, its `seq`s reserved again)
    push nothing off. Neither a hold (it names the prompt holding a call) nor any other pop
    takes such a call off the list: a pop reading the messages below it refuses while a
    turn there is still being written, and else edits the list as it stands. A
    conversation whose list no update of this build cut holds no mark: no call is taken as
    pushed off there (a call an earlier build pushed off is then refused as unmade)."""
    if conversation.get(PUSHED_OFF) is None:
        return frozenset()
    mark = CallsPushedOff.model_validate(conversation[PUSHED_OFF])
    count = int(conversation.get("message_count") or 0)
    reach = count - 1 if mark.seq is None else min(count - 1, mark.seq)
    stored = {int(d["seq"]) for d in found}
    gaps = Gaps.of(conversation)
    unwritten = [
        s for s in range(written_from, reach + 1) if s not in stored and s not in gaps.popped
    ]
    records = [r for r in gaps.records if not r.popped and not r.moved]
    dropped = bool(conversation.get("turns_dropped"))
    if any(_reserved_before(records, s, mark.order, dropped=dropped) for s in unwritten):
        return frozenset(mark.call_ids or ())
    return frozenset()


def _reserved_before(records: Sequence[TurnRecord], seq: int, order: int, *, dropped: bool) -> bool:
    """Whether the turn whose block holds `seq` (the latest of `records` reserving it) left
    calls open (`TurnRecord.opens_calls`) and was reserved before the update whose order is
    `order` (`TurnRecord.order` below it): only such a turn may have lost a call to that
    update. A record kept before records said so counts as leaving calls open, and as the
    oldest. With no record holding it, whether records were `dropped` (a turn of those may
    hold it: every one reserved before)."""
    holding = [
        r for r in records if r.first_seq <= seq and (r.seqs is None or seq < r.first_seq + r.seqs)
    ]
    if not holding:
        return dropped
    latest = holding[-1]
    if latest.opens_calls is False:
        return False
    return latest.order is None or latest.order < order


def _written_after(
    gaps: Gaps,
    made_at: int,
    stored: Collection[int],
    count: int,
    unpassed: int | None,
    now: datetime,
    rules: TurnRules,
) -> bool:
    """Whether a block past `made_at` (the `seq` of a message making a call; `stored`, the
    `seq`s of every message of the blocks readers may not pass yet, from `unpassed`:
    `answers_lookup`) is still being written: a `seq` there holds no message (below `count`)
    and is not passed (`Gaps.written`). Its insert may still land, answering the call."""
    if unpassed is None:
        return False
    start = max(made_at + 1, unpassed)
    missing = [s for s in range(start, count) if s not in stored]
    return gaps.written(missing, now=now, abandon_after=rules.abandon_after) is not None


def _answers(
    plan: TurnPlan, answers_to: Mapping[str, str], as_read: AsRead | None = None
) -> Condition | None:
    """The condition of a turn naming the calls of earlier turns its answers answer
    (`answers_to`: tool call id to the message that made the call, as read from
    `pending_calls`; one naming a call the turn does not answer is refused as it is planned,
    `_check_answers_named`): each is still the latest pending call of its id
    (`answers_hold`), the one the answer takes, and not marked listed again (`unmarked`: the
    lookup of `AgentMessageLogger._unanswered` looks first whether an answer landed). A call
    another turn answered since keeps that first answer: `AnsweredBefore`, naming it; one a
    later call of its id now follows would have the answer taken by that call: a Conflict.
    Nothing is written either way. None for a turn naming none of its answers.

    With `as_read`, the calls it lists, off `pending_calls` though no answer to them is there
    (`AgentMessageLogger._unanswered`), are taken while the conversation is as read."""
    named = _named_answers(plan, answers_to)
    if not named:
        return None
    if as_read is not None and as_read.renamed:
        named = {**named, **as_read.renamed}
    every = _answered_first(plan, sorted(named))
    held = {c: m for c, m in named.items() if as_read is None or c not in as_read.calls}
    holds = [answers_hold(held), unmarked(held)] if held else []
    if as_read is not None and as_read.calls:  # none taken as read: no guard needed
        holds.append(as_read.filter())

    def retried(conversation: Mapping[str, Any], own: Collection[str]) -> StoreError | None:
        # Only a turn's denials are left out of it (`log_streamed_turn`): a result answered
        # since was answered by the turn's first attempt itself, and so was a denial its
        # stored messages hold (`own`).
        gone, _ = answered_since(conversation, named)
        denied = [c for c in gone if c in plan.denied_calls and c not in own]
        return _answered_first(plan, denied) if denied else None

    return Condition(
        holds[0] if len(holds) == 1 else {"$and": holds},
        lambda now: {},
        every,
        absent=Conflict(
            f"turn {plan.turn_id!r} answers calls of earlier turns of conversation "
            f"{plan.conversation_id!r}, which holds none: it does not exist (deleted?)"
        ),
        explain=lambda conversation: _answers_refusal(plan, named, conversation) or every,
        retried=retried,
        landing=_answers_landing(plan, named),
    )


def _answers_landing(plan: TurnPlan, named: Mapping[str, str]) -> Landing:
    """`_answers` where a turn logged at the end in place of its empty block lands
    (`Landing`): its first reservation took the calls `named` off `pending_calls`, so they
    are judged on the stored messages, as `AgentMessageLogger._unanswered` judges a fresh
    turn's calls off the list (`answers_lookup`, `answer_found`): InvalidInput for a
    message named that no longer makes its call (popped since), `AnsweredBefore` for a call
    another turn answered since (a call's first answer is its answer), the Conflict of a
    later call of its id following it (the answer would take that one)."""
    wanted = tuple(answers_lookup(plan.conversation_id, named, None)["$or"])

    def refused(
        conversation: Mapping[str, Any], read: Sequence[Mapping[str, Any]]
    ) -> StoreError | None:
        # this life's messages, when the conversation was read with its epoch, as it holds
        # them: none of a turn given up for good
        life = of_epoch(read, conversation["epoch"]) if "epoch" in conversation else list(read)
        given_up = stored_by_turns_given_up(conversation)
        found = [d for d in life if not given_up(d)]
        landed = _Landed.at_the_end(found, named)
        landed = landed.awaiting(calls_awaited(conversation, utc_now()))
        return _answers_judged(plan, named, named, found, landed, lambda made_at: False)

    return Landing(wanted, refused)


def _named_answers(plan: TurnPlan, answers_to: Mapping[str, str]) -> dict[str, str]:
    """Those of `answers_to` (`_answers`) naming calls of earlier turns the turn answers."""
    return {c: m for c, m in answers_to.items() if c in plan.answered_calls}


def _answers_refusal(
    plan: TurnPlan, named: Mapping[str, str], conversation: Mapping[str, Any]
) -> StoreError | None:
    """Why `conversation` does not take the turn's answers to the calls `named` (`_answers`):
    `AnsweredBefore` for calls another turn answered since, a Conflict for calls a later call
    of their id now follows; None when each is the latest pending call of its id."""
    gone, followed = answered_since(conversation, named)
    if gone:
        return _answered_first(plan, gone)
    if followed:
        return _followed(plan, followed)
    return None


def _followed(plan: TurnPlan, followed: Sequence[str]) -> Conflict:
    return Conflict(
        f"turn {plan.turn_id!r} answers {', '.join(map(shown, followed))} of an "
        f"earlier turn in conversation {plan.conversation_id!r}, but a later call of "
        "that id is pending now, and the store gives an answer to the latest pending "
        "call of its id: it would answer that call instead. Read the pending calls "
        "again; answer the later call in a turn of its own first"
    )


def _answer_being_written(plan: TurnPlan, call_ids: Sequence[str]) -> StorageUnavailable:
    """An answer to `call_ids` is only reserved, by a turn less than `abandon_after` old
    whose insert may still land, or never: not answered yet, so nothing final to say."""
    return StorageUnavailable(
        f"turn {plan.turn_id!r} answers {', '.join(map(shown, call_ids))} of an earlier turn "
        f"in conversation {plan.conversation_id!r}, but an answer to that call is still "
        "being written by another turn (its insert may still land): retry shortly. Once it "
        "is stored this turn's answer is refused; once that turn is abandoned it is stored",
    )


def _call_turn_unstored(plan: TurnPlan, call_ids: Sequence[str]) -> StorageUnavailable:
    """The turn making `call_ids` is not stored: its block was passed empty and the calls
    folded off `pending_calls`, but the conversation watches it (`calls_awaited`), its
    writer may still log it. Nothing final to say until it lands or the watch ends."""
    return StorageUnavailable(
        f"turn {plan.turn_id!r} answers {', '.join(map(shown, call_ids))} of an earlier turn "
        f"in conversation {plan.conversation_id!r}, but the turn making that call is not "
        "stored: its block was passed unstored past abandon_after, and it may still be "
        "logged (its writer retrying, or its insert still in the network); nothing was "
        "stored. Send this turn again once pending_calls lists the call again; a day after "
        "its block was passed the store waits no more, and an answer naming it is refused "
        "as naming a message that makes no call",
    )


def _standing_outcome(answers: Sequence[Mapping[str, Any]]) -> str | None:
    """The outcome (`core.tool_outcome`: "denied", "failed", ...; "result" for a plain one) of
    the answer that stands among a call's stored `answers` (in `seq` order): the first, but
    a real result after an `interrupted` stand-in (`core.answers_instead`). None for none."""
    standing: ToolMessage | None = None
    for doc in answers:
        error = doc.get("error")
        said = error.get("message") if isinstance(error, Mapping) else None
        answer = ToolMessage(
            tool_call_id=str(doc.get("tool_call_id")),
            content=None,
            error=MessageError(message=said) if isinstance(said, str) else None,
        )
        if answers_instead(answer, standing):
            standing = answer
    if standing is None:
        return None
    outcome = tool_outcome(standing)
    return "result" if outcome is None else outcome[0]


def _answered_first(plan: TurnPlan, call_ids: Sequence[str]) -> AnsweredBefore:
    return AnsweredBefore(
        f"turn {plan.turn_id!r} answers {', '.join(map(shown, call_ids))} of an earlier turn "
        f"in conversation {plan.conversation_id!r}, but another turn answered that call "
        "first (another tab, read before it): a call's first answer is its answer, and it "
        "is no longer pending. Log the turn without that answer",
        tool_call_ids=call_ids,
    )


def _refuse_other_owners(
    messages: Sequence[AgentMessage | Mapping[str, Any]],
    *,
    turn_id: str | None,
    user_id: str | None,
) -> None:
    """InvalidInput for a message naming another turn than the one the call logs (`turn_id`,
    when it names one) or another user than the one it logs it for (`user_id`, when named):
    fields the store sets, refused rather than replaced without a word, as a message naming
    another conversation is. The values the store sets (a message read back and sent again)
    pass; so does any value of a call naming neither, where the store decides them."""
    expected = {f: v for f, v in (("turn_id", turn_id), ("user_id", user_id)) if v is not None}
    if not expected:
        return
    for index, message in enumerate(messages):
        values = message if isinstance(message, Mapping) else None  # one check per message
        for field, value in expected.items():
            said = values.get(field) if values is not None else getattr(message, field)
            if said is not None and said != value:
                named = shown(said) if isinstance(said, str) else "<withheld>"
                raise InvalidInput(
                    f"invalid turn: message {index} carries `{field}` {named}, not that of "
                    f"{field.removesuffix('_id')} {shown(value)} it is logged for; `{field}` "
                    "is the store's to set: leave it out"
                )


def _turn_conditions(
    plan: TurnPlan,
    next_seq: int | None,
    step: str | None,
    refused: Mapping[str, str] | None,
    answers_to: Mapping[str, str] | None = None,
    as_read: AsRead | None = None,
) -> Condition | None:
    """What `log_messages`'s reservation of a new turn must meet (`_logged_at`, `_answers`,
    with the calls `as_read` lists taken as read, `_denials`): a refusal the denials explain
    (an approval came first) before one the answers do."""
    denials = _denials(plan, _refused_prompts(refused))
    answers = _answers(plan, _answers_to(answers_to), as_read)
    at = _joined(_joined(_logged_at(plan.conversation_id, next_seq, step), answers), denials)
    return _joined(at, _held_kept(plan))


def _settled_by_denials(plan: TurnPlan, denied_first: Mapping[str, str]) -> Condition | None:
    """The condition of a turn logged without its denials of the calls `denied_first` names
    (`log_messages`: call id to the message making it), which a denial stored first settled
    (a bridge's, `calls_denied_first`): none of them is pending again (`answers_stand`: a
    pop took that denial back, and the turn's own denial would be its first answer), else
    `DenialTakenBack`, nothing written: judged in the reservation's own command, as a turn's
    other conditions are. None for a turn naming none (no condition, no read)."""
    if not denied_first:
        return None
    call_ids = sorted(denied_first)
    refusal = DenialTakenBack(
        f"turn {plan.turn_id!r} leaves out its denials of {', '.join(map(shown, call_ids))} "
        f"of an earlier turn in conversation {plan.conversation_id!r} as settled by a denial "
        "stored first, but that denial was taken back since (popped): the call is pending "
        "again. Log the turn with its denial; nothing was stored",
        tool_call_ids=call_ids,
    )
    return Condition(answers_stand(denied_first), lambda now: {}, refusal)


def _check_as_given_back(
    plan: TurnPlan, conversation: Mapping[str, Any], refused: Mapping[str, str]
) -> None:
    """`check_turn`'s decision on the conditions of a retry with other content whose
    abandoned block is given back before it reserves as a new turn: judged on
    `conversation` as the give-back leaves it (`AgentMessageLogger._as_given_back`), which
    no server holds yet, by the rules the reservation's filter applies (`released_calls`
    for `denials_hold`, `held_off_list` for `held_calls_kept`); its answers are judged by
    `_answers_refusal` after this."""
    denied = _denied(plan, refused)
    released = released_calls(conversation, denied, refused) if denied else []
    if released:
        raise _answered_before(plan, released)
    held = _held_kept(plan)
    if held is not None and _held_off(plan, conversation):
        raise held.refused(conversation)


def _held_off(plan: TurnPlan, conversation: Mapping[str, Any]) -> list[PendingCall]:
    """The calls a prompt holds, unreleased, that the turn's calls would push off the bounded
    `pending_calls` of `conversation` (`held_off_list`)."""
    served = awaiting_results(
        conversation.get("pending_calls") or (),
        conversation.get("resolved_hitl") or (),
        conversation.get("approved_calls") or (),
    )
    calls = [PendingCall.model_validate(c) for c in served]
    released = {(c.tool_call_id, c.message_id) for c in calls if c.request_id is None}
    stored = [PendingCall.model_validate(c) for c in conversation.get("pending_calls") or ()]
    return held_off_list(plan, stored, released)


def _held_kept(plan: TurnPlan) -> Condition | None:
    """The condition of a turn making calls: it pushes no call a prompt holds, unreleased,
    off the bounded `pending_calls` (`held_calls_kept`), else a Conflict naming the prompt
    and the call, nothing written. None for a turn making none."""
    if not plan.opened_calls:
        return None
    every = HeldOff(
        f"turn {plan.turn_id!r} would push a call a prompt holds off the pending calls of "
        f"conversation {plan.conversation_id!r} (the newest {PENDING_CALLS_KEPT})",
        conversation_id=plan.conversation_id,
    )

    def pushed_off(conversation: Mapping[str, Any]) -> StoreError:
        off = _held_off(plan, conversation)
        if not off:
            return every
        return HeldOff(
            f"turn {plan.turn_id!r} leaves more calls pending in conversation "
            f"{plan.conversation_id!r} than pending_calls keeps (the newest "
            f"{PENDING_CALLS_KEPT}), pushing off the call {shown(off[0].tool_call_id)} the "
            f"prompt {shown(str(off[0].request_id))} holds, which no answer released: an "
            "answer to the prompt releases the calls the list holds only. Answer it first "
            "(resolve_hitl, or the call's result or denial), then log the turn; nothing was "
            "stored",
            conversation_id=plan.conversation_id,
            held=(off[0].tool_call_id, str(off[0].request_id)),
        )

    return Condition(held_calls_kept(plan), lambda now: {}, every, create=True, explain=pushed_off)


def _check_answers_named(
    plan: TurnPlan, answers_to: Mapping[str, str], refused: Mapping[str, str]
) -> None:
    """InvalidInput, nothing written, for an `answers_to` entry naming a call no message of
    the turn answers as a call of an earlier turn (`TurnPlan.answered_calls`), or a
    `refused_prompts` entry naming one no message of the turn denies (`denied_calls`): the
    turn says it answers a call it does not."""
    for what, named, answered, verb, by in (
        ("answers_to", answers_to, plan.answered_calls, "answers", "a tool message"),
        ("refused_prompts", refused, plan.denied_calls, "denies", "a denial"),
    ):
        if stray := [c for c in named if c not in answered]:
            raise InvalidInput(
                f"invalid {what} of turn {plan.turn_id!r}: it names {listed(stray, shown)}, "
                f"a call of an earlier turn no message of the turn {verb} ({by} naming its "
                f"tool_call_id). Name in {what} only the calls the turn {verb}; nothing was "
                "stored"
            )


def _answers_to(answers_to: Mapping[str, str] | None) -> dict[str, str]:
    """`log_messages`'s `answers_to`, checked: tool call ids to message ids."""
    return _call_id_map(
        answers_to,
        "answers_to must map the tool call ids of the calls of earlier turns the turn "
        "answers to the ids of the messages that made them, as pending_calls serves them",
    )


def _denied_first(denied_first: Mapping[str, str] | None) -> dict[str, str]:
    """`log_messages`'s `denied_first`, checked: tool call ids to message ids."""
    return _call_id_map(
        denied_first,
        "denied_first must map the tool call ids of the calls of earlier turns whose denials "
        "the turn leaves out to the ids of the messages that made them",
    )


def _refused_prompts(refused: Mapping[str, str] | None) -> dict[str, str]:
    """`log_messages`'s `refused_prompts`, checked: tool call ids to request ids."""
    return _call_id_map(
        refused,
        "refused_prompts must map tool call ids to the request ids of the refused prompts "
        "their denials answer",
    )


def _listed_makers(
    conversation: Mapping[str, Any], wanted: dict[str, str], tools: Mapping[str, str]
) -> dict[str, str]:
    """For `calls_answered`: names each call of `wanted` (call id to "", in place) that
    `pending_calls` lists by the message that made it (the latest of its id listed; for a
    call the runtime says is of a tool, `tools`, the latest of its id of that tool). Answers,
    for a call listed only as another tool's, that tool."""
    others: dict[str, str] = {}
    for call in conversation.get("pending_calls") or ():  # in the order made: the latest wins
        if not isinstance(call, Mapping) or (call_id := call.get("tool_call_id")) not in wanted:
            continue
        if call_id in tools and call.get("tool_name") != tools[call_id]:
            others[call_id] = str(call.get("tool_name"))
        else:
            wanted[call_id] = call.get("message_id") or ""
    return {c: t for c, t in others.items() if not wanted[c]}


def _reaches(owner: str | None, user_id: str | None, *, strict_owner: bool) -> bool:
    """Whether a turn for `user_id` (None: a service's) may name the calls of a conversation
    `owner` holds (None: unowned), as its reservation decides: a service reaches every one, a
    user her own, and an unowned one unless `strict_owner` (a runtime acting for her, which
    adopts nothing)."""
    if user_id is None or owner == user_id:
        return True
    return owner is None and not strict_owner


def _refuse_other_tools(
    conversation_id: str, named: Mapping[str, str], stored: Mapping[str, str]
) -> None:
    """InvalidInput for a result whose runtime names (`named`, call id to tool) another tool
    than every call of its id `calls_answered` found in the conversation (`stored`: for a
    call no call of the named tool makes, the tool of the latest of its id): it is the result
    of another call that used the same id (in an earlier life of the conversation, or another
    run's), never this one's answer. Nothing for a call either does not name."""
    for call_id in sorted(named.keys() & stored.keys()):
        if named[call_id] != stored[call_id]:
            raise InvalidInput(
                f"invalid turn of conversation {conversation_id!r}: its result for call "
                f"{call_id!r} is of tool {named[call_id]!r}, but call {call_id!r} of the "
                f"conversation is of tool {stored[call_id]!r}: a result answers a call of its "
                "own tool only (the id was used again by another run, or in an earlier life "
                "of the conversation); nothing was stored"
            )


def _call_id_map(value: Mapping[str, str] | None, what: str) -> dict[str, str]:
    """A map of tool call ids to text a caller passed, checked (`what` says what it must
    be, its name first); empty for None."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise InvalidInput(f"{what} (strings to strings)")
    checked: dict[str, str] = storable(dict(value), what.split(" ", 1)[0])
    return checked


def _answered_before(plan: TurnPlan, released: Sequence[str]) -> AnsweredBefore:
    return AnsweredBefore(
        f"turn {plan.turn_id!r} denies {', '.join(map(shown, released))} in conversation "
        f"{plan.conversation_id!r}, but a person approved the confirmation holding that "
        "call first: the tool runs, and its result answers the call. Log the turn without "
        "the denial",
        tool_call_ids=released,
    )


def _raise_refusal(refused: Unmovable | Unlanded) -> NoReturn:
    """Raise what a turn refused where it would land at the end is told: `Unmovable`, or
    what the same turn logged fresh there is refused for (`Unlanded.error`)."""
    if isinstance(refused, Unlanded):
        raise refused.error from None
    raise refused


def _in_life(
    turn: Callable[..., Condition | None], life: Condition | None, as_read: AsRead
) -> Condition | None:
    """A turn's conditions with the calls `as_read` lists taken as read (`turn`, a partial
    `_turn_conditions`), in the conversation's life its `version` names (`life`), if any."""
    return _joined(turn(as_read=as_read), life)


def _joined(first: Condition | None, second: Condition | None) -> Condition | None:
    """Both conditions, in one reservation: the filters and stages together; a refused
    reservation's refusal, that of the first of the second and the first the server finds the
    conversation does not meet (`parts`, `Condition.judged`); one told from a conversation
    read (`check_turn`), the second's when the conversation explains it (`Condition.explain`),
    else the first's; a retry's, the second's, else the first's (`Condition.retried`)."""
    if first is None or second is None:
        return first or second
    a, b = first, second

    def explain(conversation: Mapping[str, Any], own: bool = False) -> StoreError:
        refused = b.refused(conversation, own=own)
        if refused is not b.refusal:
            return refused  # the conversation shows why (the calls it names approved)
        return a.refused(conversation, own=own)

    def retried(conversation: Mapping[str, Any], own: Collection[str]) -> StoreError | None:
        for condition in (b, a):
            retry = condition.retried
            refusal = None if retry is None else retry(conversation, own)
            if refusal is not None:
                return refusal
        return None

    return Condition(
        {"$and": [a.filter, b.filter]},
        lambda now: {**a.stage(now), **b.stage(now)},
        a.refusal,
        create=a.create and b.create,
        absent=(None if a.create else a.absent) or (None if b.create else b.absent),
        explain=explain,
        own_explain=partial(explain, own=True),
        retried=retried,
        landing=b.landing if a.landing is None else a.landing.joined(b.landing),
        own=None if a.own is None and b.own is None else _owns_joined(a, b),
        parts=(b, a),
        **_moves_joined(a, b),
    )


def _moves_joined(a: Condition, b: Condition) -> dict[str, Any]:
    """What a move of a turn under both conditions meets (`Condition.moved`): what each that
    a move meets asks, together; its refusal, the first's of them (at most one of a turn's
    conditions, `_logged_at`, holds for its moves)."""
    moving = [c for c in (a, b) if c.moved is not None]
    if not moving:
        return {}
    stages = [c.moved for c in moving if c.moved is not None]
    return {
        "moved": lambda now, first: {k: v for f in stages for k, v in f(now, first).items()},
        "moved_filter": lambda block: {"$and": [c.met_by_a_move(block) for c in moving]},
        "moved_explain": moving[0].move_refused,
    }


def _owns_joined(a: Condition, b: Condition) -> Callable[[range], dict[str, Any]]:
    """What the turn whose first reservation took an empty block meets again under both
    conditions (`Condition.own`): each one's, together."""
    return lambda block: {"$and": [a.again(block), b.again(block)]}
