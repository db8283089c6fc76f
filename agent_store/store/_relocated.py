"""A turn moved to a new block at the end (`_reservation.relocation`): whether it may move,
and the pending state it leaves there.

A retry later than `TurnRules.abandon_after` of a turn that stored nothing moves past the
turns logged meanwhile (DESIGN.md §3). Two rules keep the conversation what its stored
messages say:

- Before the move (in the lookup of its empty block, the same round trip, `looked_up`): a
  turn whose call a later message answers cannot move, since its call would follow its
  answer; the retry is refused (`Unmovable`, a `Conflict`), no message written
  (`answered_later`). The same holds for a retry with other content, logged at the end once
  the block is given back: one lookup, one check, for either, made by `_verdict` (so
  `check_turn` raises it too) or by a writer found too slow for its block. The same find
  returns the prompts stored past the block under the turn's request ids (`asked_past`): an
  answer given before one of them does not reach the moved turn (`_reservation._moved_reach`).
- After the move and its insert: what it leaves pending is folded from the stored messages,
  in their stored order, as pops and forks fold them (`_turns.pending_after`), and
  `resolved_hitl` and the approvals are what a fork of all of it keeps
  (`Refold.resolved`, `Refold.withdrawn`: an answer naming calls leaves the moved
  question's other calls held, its id unresolved); written only if no turn reserved, no
  pop ran and no answer came meanwhile (`refolded`). Two round trips more, on this rare
  path.
- A refused move gives the turn up for good: what its first reservation listed pending (its
  calls, its prompt) no stored message makes, so the same fold, without it, is written
  (`settle`, `given_up`): one round trip more, two when the summary differs from the fold.
- A fold that cannot be written (the conversation kept changing, a turn below the end still
  being written) is owed (`REFOLD_OWED`, `_owe`): the next turn reserving folds it after its
  insert, clearing the mark it read in the fold's own guarded update (`refolded`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from bson import Int64

from agent_store.core import (
    AgentMessage,
    PendingCall,
    PendingHitl,
    StorageUnavailable,
    StoreError,
    answers_to_calls,
    calls_answered,
    messages_adapter,
    utc_now,
)
from agent_store.store._driver import storage_errors
from agent_store.store._fork import (
    ApprovalKey,
    approval_key,
    approvals_withdrawn,
    fork_turns_of,
    pending_now,
    resolved_in_fork,
)
from agent_store.store._naming import first_named, renamed
from agent_store.store._reservation import (
    ANSWERS_READ,
    PENDING_BLOCKS,
    REFOLD_OWED,
    RELISTED,
    RESERVED,
    RecordedBlock,
    absent_stays,
    answers_clear,
    answers_found,
    answers_lookup,
    approvals_landed_after,
    approvals_left_unstored,
    approvals_unstored,
    approvals_without,
    asked_again_where_free,
    conversation_by_id,
    life_told,
    literal,
    marks_without,
    of_epoch,
    relisted_among,
    resolved_by_request,
    same_as_read,
    still_as_read,
    watched_given_up,
)
from agent_store.store._turns import (
    ANSWERED_READ,
    GAPS_READ,
    Gaps,
    TurnConflict,
    TurnPlan,
    answered_in,
    folded_after,
    message_id,
)

MOVED: dict[str, Any] = {
    **RESERVED,
    **GAPS_READ,
    **ANSWERED_READ,
    "forked_from": 1,
    "approved_calls": 1,
    "pops": 1,
    "popping": 1,
    "name": 1,
    "name_source": 1,
    "name_message_id": 1,
    "pending_calls": 1,
    RELISTED: 1,
}
"""What the move returns of the conversation: what a reservation returns, and what the fold
after it needs (the gaps below the new block, a fork's turn starts, the approvals, the pops'
guard, its name and where an automatic name was taken from, the calls listed and those
marked listed again: `relisted`)."""
_FOLD_READ: dict[str, Any] = {**MOVED, "pending_calls": 1, "pending_hitl": 1, "resolved_hitl": 1}
"""What the fold reads of a conversation it reads again: `MOVED` and the pending state."""

_FOLD_ATTEMPTS = 3


def _made(plan: TurnPlan) -> list[str]:
    return sorted({call.id for m in plan.messages for call in m.tool_calls or ()})


def _own_ids(plan: TurnPlan, block: RecordedBlock) -> set[str]:
    """The ids of the turn's messages, as many as the retry sends or its block holds (a retry
    with other content may send fewer than its first attempt reserved for)."""
    count = max(plan.count, block.count)
    return {message_id(plan.conversation_id, plan.turn_id, i) for i in range(count)}


def lookup(
    plan: TurnPlan,
    block: RecordedBlock,
    *,
    moving: bool = False,
    unwritten: Unwritten | None = None,
    landing: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The messages stored in the turn's block and, `moving`, the turn's own messages
    wherever they are (by their stable ids: an earlier attempt's insert may have landed in a
    block the turn left), for a turn that makes calls the messages past the block that
    make or answer a call of the same ids, for a turn that raises prompts the prompts
    past the block asked under the same request ids (`asked_past`), with `unwritten`
    every message from its `from_seq` on (which of those blocks are stored), and those
    `landing` names (`Landing.wanted`): one find, as the block's alone."""
    first, past = block.first_seq, block.first_seq + block.count
    query: dict[str, Any] = {"conversation_id": plan.conversation_id}
    in_block = {"seq": {"$gte": first, "$lt": past}}
    if not moving:
        return {**query, **in_block}
    later = {"seq": {"$gte": first}}
    made = _made(plan)
    answering = (
        [{**later, "tool_call_id": {"$in": made}}, {**later, "tool_calls.id": {"$in": made}}]
        if made
        else []
    )
    if plan.raised_requests:
        raised = list(plan.raised_requests)
        answering.append({**later, "hitl_action.request_id": {"$in": raised}})
    if unwritten is not None:
        answering.append({"seq": {"$gte": unwritten.from_seq}})
    own = {"_id": {"$in": sorted(_own_ids(plan, block))}}
    return {**query, "$or": [in_block, own, *answering, *landing]}


def asked_past(plan: TurnPlan, block: RecordedBlock, found: Sequence[Any]) -> dict[str, int]:
    """The `seq` of the latest prompt stored past the turn's block under each request id the
    turn raises, from what `lookup` found: a move carries no answer to the id given before
    it over that prompt, asked after the answer (`_reservation.relocation`)."""
    past, own = block.first_seq + block.count, _own_ids(plan, block)
    raised, latest = set(plan.raised_requests), dict[str, int]()
    for d in found:
        request_id = (d.get("hitl_action") or {}).get("request_id")
        if request_id in raised and d["seq"] >= past and d["_id"] not in own:
            latest[request_id] = max(int(d["seq"]), latest.get(request_id, -1))
    return latest


def answered_later(plan: TurnPlan, later: Sequence[AgentMessage]) -> list[str]:
    """The ids of the turn's calls that `later` messages (stored past its block, in `seq`
    order) answer, the turn in its block before them (`answers_to_calls`)."""
    turn = plan.messages
    answers = answers_to_calls([*turn, *later])
    taken = {id(message) for message in later}
    return sorted(
        {call_id for (at, call_id), a in answers.items() if at < len(turn) and id(a) in taken}
    )


@dataclass(frozen=True)
class Unwritten:
    """The blocks reserved past a turn's empty block that tail readers may not pass yet (a
    turn still writing there, younger than `abandon_after`), when one of them may answer a
    call of the turn: one the turn leaves open is off `pending_calls`, where its first
    reservation listed it (by the id of the message making it), so a later reservation may
    have taken it off, answering it (`of`). Until those blocks are stored, the turn is not
    logged past them (`looked_up`): `StorageUnavailable`, retry shortly."""

    gaps: Gaps
    from_seq: int
    """The first `seq` past the block that a turn may still be writing."""
    message_count: int
    now: datetime
    abandon_after: timedelta

    @classmethod
    def of(
        cls,
        plan: TurnPlan,
        block: RecordedBlock,
        conversation: Mapping[str, Any],
        *,
        abandon_after: timedelta,
    ) -> Unwritten | None:
        """The blocks past `block` still being written as `conversation` (read with
        `GAPS_READ`, `message_count` and `pending_calls`) records them, when a call of the turn
        is off its pending calls; None when none may answer one (no call off the list, or
        every block past it older than `abandon_after`)."""
        listed = {
            (c.get("tool_call_id"), c.get("message_id"))
            for c in conversation.get("pending_calls") or ()
            if isinstance(c, Mapping)
        }
        opened = {(c.tool_call_id, c.message_id) for c in plan.opened_calls}
        if opened <= listed:
            return None
        now, gaps = utc_now(), Gaps.of(conversation)
        unpassed = gaps.unpassed_from(now=now, abandon_after=abandon_after)
        start = max(block.first_seq + block.count, unpassed or 0)
        count = int(conversation.get("message_count") or 0)
        if unpassed is None or start >= count:
            return None
        return cls(gaps, start, count, now, abandon_after)

    def written(self, found: Sequence[Mapping[str, Any]]) -> int | None:
        """The first `seq` from `from_seq` that no message of `found` (`lookup`) is stored at
        and a turn is still writing (`Gaps.written`); None when all are stored or passed."""
        stored = {int(d["seq"]) for d in found}
        missing = (s for s in range(self.from_seq, self.message_count) if s not in stored)
        return self.gaps.written(missing, now=self.now, abandon_after=self.abandon_after)


class Unmovable(TurnConflict):
    """A retry of a turn that stored nothing in the block it reserved, to be logged at the
    end in its place (moved, or, with other content, the block given back), whose call a
    message logged meanwhile answers: refused, as its call would follow its answer. The
    turn is then given up for good (`block`: the empty block its record names)."""

    def __init__(self, message: str, block: RecordedBlock) -> None:
        super().__init__(message)
        self.block = block


@dataclass(frozen=True)
class Landing:
    """What a turn logged at the end in place of its empty block (moved, or given back and
    reserved anew) must still hold where it lands, as the same turn logged there fresh
    must (a condition's, `_logger.Condition.landing`): judged in the lookup of the block
    (`looked_up`) on the conversation as read and the messages found, the move then matching
    only while the conversation is as read (`unchanged`), so nothing reserved since the
    lookup escapes it. Conditions join theirs (`joined`)."""

    wanted: tuple[dict[str, Any], ...]
    """The messages the judgment needs, as filters the lookup adds (`lookup`)."""
    refused: Callable[[Mapping[str, Any], Sequence[Mapping[str, Any]]], StoreError | None]
    """The refusal a fresh turn would get there, from the conversation as read and the
    messages found (in `seq` order, none of the turn's own); None: it holds."""

    def joined(self, other: Landing | None) -> Landing:
        """Both judgments, the first refusal first."""
        if other is None:
            return self
        first = self

        def refused(
            conversation: Mapping[str, Any], found: Sequence[Mapping[str, Any]]
        ) -> StoreError | None:
            return first.refused(conversation, found) or other.refused(conversation, found)

        return Landing((*self.wanted, *other.wanted), refused)


class Unlanded(Exception):
    """A turn to be logged at the end in place of its empty block, refused where it would
    land as the same turn logged there fresh is (`Landing`): `error` is what the caller is
    told; the turn is given up for good (`block`: the empty block its record names), as an
    `Unmovable` one is."""

    def __init__(self, error: StoreError, block: RecordedBlock) -> None:
        super().__init__(str(error))
        self.error = error
        self.block = block


def unchanged(conversation: Mapping[str, Any]) -> dict[str, Any]:
    """A filter matching the conversation while it is as read: the life it was read in (its
    `epoch`, else its `created_at`: `life_told`), no other started under the id since, and
    no turn reserved (or moved) and no pop ran since (`message_count`, `pops`); what the
    lookup of a turn's block judged on it still holds when the move matches."""
    pops = int(conversation.get("pops") or 0)
    life = life_told(epoch=conversation.get("epoch"), created_at=conversation.get("created_at"))
    return {
        **life,
        "message_count": Int64(int(conversation.get("message_count") or 0)),
        "pops": pops if pops else {"$in": [None, 0]},
    }


@dataclass(frozen=True)
class Looked:
    """What the lookup of a turn's block before it is logged at the end found (`lookup`,
    moving; `looked_up`)."""

    stored: list[dict[str, Any]]
    """The messages stored in the block and the turn's own wherever they are, in `seq`
    order: when any, the turn is stored there, not logged at the end."""
    asked: dict[str, int]
    """`asked_past`."""
    refusal: Unmovable | Unlanded | StorageUnavailable | None
    """None stored and a later message answering one of the retry's calls: the refusal of
    logging it at the end, raised by whichever retry would (same content or other); or,
    none stored, what the same turn logged fresh where it lands is refused for
    (`Landing`, `Unlanded`; a StorageUnavailable it is refused for as is: its call's turn
    may still land); or, none stored answering one, a block past it still being written
    that may (`Unwritten`): StorageUnavailable, retry shortly, nothing given up."""


def looked_up(
    plan: TurnPlan,
    block: RecordedBlock,
    found: Sequence[Any],
    unwritten: Unwritten | None = None,
    epoch: str | None = None,
    landing: Callable[[Sequence[Mapping[str, Any]]], StoreError | None] | None = None,
) -> Looked:
    """What `lookup` (moving, with `unwritten`) found of the turn's block, read in any
    order. The one check of a turn logged at the end in place of its empty block, whatever
    content the retry sends: refused (`Looked.refusal`) when nothing is stored and a later
    message answers one of the retry's calls, or the same turn logged fresh where it lands
    is refused (`landing`: `Landing.refused`, bound to the conversation as read), or a
    block past it that may answer one is still being written (`Unwritten.written`).
    Messages of another life of the conversation than `epoch` (the conversation's, as
    read), late inserts of one deleted since, are strays: no turn's, they are left out
    (never "another turn's" in the block)."""
    lives = (None, epoch)
    found = [d for d in found if epoch is None or d.get("epoch") in lives]
    found = sorted(found, key=lambda d: int(d["seq"]))  # a server answers any order
    first, past = block.first_seq, block.first_seq + block.count
    ids = _own_ids(plan, block)
    stored = [d for d in found if first <= d["seq"] < past or d["_id"] in ids]
    refusal: Unmovable | Unlanded | StorageUnavailable | None = None
    if not stored:
        refusal = _refusal(plan, block, [d for d in found if d["_id"] not in ids], landing)
    unwritten = None if refusal is not None or stored else unwritten
    if unwritten is not None and (at := unwritten.written(found)) is not None:
        refusal = StorageUnavailable(
            f"a later turn of conversation {plan.conversation_id!r} is still being "
            f"written at seq {at} and may answer a call of turn {plan.turn_id!r}, which "
            f"reserved seq {block.first_seq} and stored nothing: retry shortly (the turn "
            "is not logged past that answer)"
        )
    return Looked(stored, asked_past(plan, block, found), refusal)


def _refusal(
    plan: TurnPlan,
    block: RecordedBlock,
    others: Sequence[Mapping[str, Any]],
    landing: Callable[[Sequence[Mapping[str, Any]]], StoreError | None] | None,
) -> Unmovable | Unlanded | StorageUnavailable | None:
    """`looked_up`'s refusal of a turn none of whose messages is stored, from the other
    messages found (`others`, in `seq` order): `Unmovable` when a later one answers a call
    the turn makes, else `Unlanded` when the same turn logged fresh where it lands is
    refused (`landing`) for good, else None. Refused there for now (StorageUnavailable: a
    call it answers is awaited, its turn may still land), that, nothing given up."""
    past = block.first_seq + block.count
    later = [d for d in others if d["seq"] >= past]
    answered = answered_later(plan, messages_adapter.validate_python(later))
    if answered:
        names = ", ".join(repr(call_id) for call_id in answered)
        return Unmovable(
            f"turn {plan.turn_id!r} reserved seq {block.first_seq} and stored nothing; since "
            f"then a later turn answered its call {names}, so it cannot move to the end (its "
            "call would follow its answer): this send stored nothing, and the turn is not "
            "stored unless an earlier send of it, still in the network past abandon_after, "
            "lands in that block yet (check_turn of the turn then passes, as a replay; else "
            "it raises this again): if none does, log what the conversation still needs as "
            "a new turn",
            block,
        )
    error = None if landing is None else landing(others)
    if isinstance(error, StorageUnavailable):  # the call's turn may still land: come again
        return error
    return None if error is None else Unlanded(error, block)


@dataclass(frozen=True)
class Refold:
    """What a conversation's stored messages and the answers a person gave leave, folded as
    pops and forks fold them (`_turns.folded_after`), from the conversation as read."""

    conversation: Mapping[str, Any]
    """The conversation as read (`_FOLD_READ`, or every field)."""
    calls: list[PendingCall]
    prompt: PendingHitl | None
    resolved: list[str] | None
    """`resolved_hitl` as the fold leaves it (`_fork.resolved_in_fork`, as a pop sets it): a
    prompt a person answered that no stored message asks again stays resolved. While a
    block other than `own` is reserved and not stored (passed: a dead turn's, whose retry
    may still move it), the ids as read stay, and those the fold resolves are added: what
    the dead turn's reservation asked again under an answered id is resolved again, none
    resolved is taken off. None: not folded (`folded`)."""
    stored: Sequence[AgentMessage] = ()
    """The stored messages folded, in `seq` order."""
    folded: bool = True
    """False when a turn below the end is still being written (`refold`, `partial`): its
    messages are not there to fold, so `calls`, `prompt` and `resolved` are no fold's; the
    stored messages still give the name (`settle`)."""
    withdrawn: Sequence[ApprovalKey] = ()
    """The approvals as read (`approved_calls`) that the fold gives none of, with the answers
    a person gave (`_fork.approvals_withdrawn`): an answer approves only calls that questions
    stored below its reach held, so the conversation keeps the approvals a fork of all of it
    keeps (`_fork.approvals_in_fork`, the one rule pops follow too). None withdrawn while
    a block other than `own` is reserved and not stored: its retry may still store, where an
    answer reaches it, the question that answer was for."""
    unstored: frozenset[str] = frozenset()
    """The messages the approvals as read name as holding their call again or superseding it
    (`held_by`, `held_before`, `superseded_by`) that are not stored: a dead turn's, its
    block passed. They hold nothing, as a pop of each leaves them
    (`_reservation.approvals_unstored`): the fold takes back what that turn's reservation
    did to the approvals as a whole."""
    unlanded: frozenset[int] = frozenset()
    """The first `seq`s of the blocks listing pending state (`PENDING_BLOCKS`) the fold found
    passed and holding no message, no pop or give-back having made them gaps: their turn's
    insert may still land (a writer stalled inside it), so the fold's write keeps them
    watched (`watched_after`) and a later turn or read folds again once one landed."""
    relogging: frozenset[int] = frozenset()
    """The first `seq`s of the blocks watched whose turn was given up for good on a late
    retry (`_reservation.watched_given_up`): the fold's write keeps them watched as they
    stand, their calls awaited while that turn may still log itself again."""

    def summary(self) -> dict[str, Any]:
        """The conversation as read with its pending state, resolutions and approvals the
        fold's."""
        prompt = None if self.prompt is None else self.prompt.model_dump()
        summary = {
            **self.conversation,
            "pending_calls": [c.model_dump() for c in self.calls],
            "pending_hitl": prompt,
        }
        if self.resolved is not None:
            summary["resolved_hitl"] = self.resolved
        if self.withdrawn or self.unstored:
            summary["approved_calls"] = self.approvals_kept(
                self.conversation.get("approved_calls") or ()
            )
        return summary

    def approvals_kept(self, approved: Iterable[Any]) -> list[Any]:
        """`approved` (`approved_calls` entries) without those the fold withdraws, naming no
        message not stored (`unstored`)."""
        withdrawn = set(self.withdrawn)
        kept = [a for a in approved if approval_key(a) not in withdrawn]
        return list(approvals_left_unstored(kept, self.unstored)) if self.unstored else kept


async def refold(
    conversations: Any,
    messages: Any,
    conversation_id: str,
    conversation: Mapping[str, Any] | None,
    *,
    abandon_after: timedelta,
    own: range = range(0),
    partial: bool = False,
    life: Mapping[str, Any] | None = None,
) -> Refold | None:
    """The fold of the conversation's stored messages (`Refold`), from `conversation` as
    read, else read here (one round trip more: the conversation `life` names, a filter of
    one life under the id, `same_as_read`; None: whichever is under the id), and its
    messages below `message_count`, of its own life (`of_its_life`; one more). None when
    the conversation (of that life) is gone, or a turn
    below the end is still being written (its messages are not there to fold), unless
    `partial`: then the stored messages, not folded (`Refold.folded`). `own`: the `seq`s of
    the block given back or up, not stored (while another block is unstored, a dead turn's,
    the resolutions are only added to and no approval withdrawn: `Refold.resolved`)."""
    if conversation is None:
        with storage_errors("read the conversation"):
            where = conversation_by_id(conversation_id) if life is None else life
            conversation = await conversations.find_one(where, _FOLD_READ)
        if conversation is None:
            return None
    count = int(conversation["message_count"])
    read_at = utc_now()  # before the messages are read: what judges the `seq`s they lack
    with storage_errors("read the messages"):
        docs = await messages.find(of_its_life(conversation, count)).sort("seq", 1).to_list(None)
    stored = messages_adapter.validate_python(docs)
    seqs = {m.seq for m in stored}
    missing = [s for s in range(count) if s not in seqs]
    gaps = Gaps.of(conversation)
    if gaps.written(missing, now=read_at, abandon_after=abandon_after) is not None:
        return Refold(conversation, [], None, None, stored, folded=False) if partial else None
    answered = answered_in(conversation)
    folded = folded_after(stored, fork_turns_of(conversation), answered)
    kept = conversation.get("resolved_hitl") or ()
    alone = all(s in gaps.popped or s in own for s in missing)
    resolved = resolved_in_fork(kept, answered, answered, folded)
    if not alone:  # a dead turn's retry may still move it: take back, never take off
        resolved = [*kept, *(r for r in resolved if r not in kept)]
    approved = conversation.get("approved_calls") or ()
    withdrawn = approvals_withdrawn(approved, answered, folded) if alone else []
    unstored = _named_unstored(approved, {m.id for m in stored})
    return Refold(
        conversation,
        folded.calls,
        folded.hitl,
        resolved,
        stored,
        withdrawn=withdrawn,
        unstored=unstored,
        unlanded=_passed_empty(conversation, set(missing) - gaps.popped - set(own)),
        relogging=watched_given_up(conversation, own, read_at),
    )


def _passed_empty(conversation: Mapping[str, Any], unstored: Collection[int]) -> frozenset[int]:
    """The first `seq`s of `conversation`'s blocks listing pending state (`PENDING_BLOCKS`)
    that are among `unstored` (`seq`s below the end with no message, none a gap no turn
    holds): passed and empty as the fold read them (`Refold.unlanded`)."""
    return frozenset(
        int(block["f"])
        for block in conversation.get(PENDING_BLOCKS) or ()
        if isinstance(block, Mapping) and int(block["f"]) in unstored
    )


def watched_after(fold: Refold) -> dict[str, Any]:
    """`PENDING_BLOCKS` as the fold's write leaves it, as an expression: the blocks it found
    passed and empty (`Refold.unlanded`) watched (`w`: since when, the time now unless
    watched already), those watched that it found holding messages dropped (it folded
    them), the others as they stand; absent while absent."""
    found = {"$in": ["$$b.f", literal(sorted(fold.unlanded))]}
    unwatched = {"$eq": [{"$ifNull": ["$$b.w", None]}, None]}
    relogging = {"$in": ["$$b.f", literal(sorted(fold.relogging))]}
    kept = {
        "$filter": {
            "input": f"${PENDING_BLOCKS}",
            "as": "b",
            "cond": {"$or": [found, unwatched, relogging]},
        }
    }
    since = {"$ifNull": ["$$b.w", literal(utc_now())]}
    calls: Any = literal(None)
    for first, taken_off in _unlanded_calls(fold).items():  # each block's own
        calls = {"$cond": [{"$eq": ["$$b.f", first]}, literal(taken_off), calls]}
    entry = {
        "f": "$$b.f",
        "l": "$$b.l",
        "a": "$$b.a",
        "d": literal(False),
        "w": since,
        "c": {"$ifNull": ["$$b.c", calls]},
    }
    watched = {"$map": {"input": kept, "as": "b", "in": {"$cond": [found, entry, "$$b"]}}}
    return absent_stays(PENDING_BLOCKS, watched)


def _unlanded_calls(fold: Refold) -> dict[int, list[dict[str, str]]]:
    """For each block the fold found passed and empty (`Refold.unlanded`), the calls made
    there that the fold does not list (`PendingBlock.calls`, `c`: its turn may still be
    logged, and an answer to one waits for it while the block is watched): those
    `pending_calls` listed as read (their `seq` in the block), and those an answering
    turn's reservation took off the list before (`PendingBlock.taken`, `t`: that answer
    still in flight, or given back as it passed the block). A call listed with no `seq`
    (before the list recorded it) is not told apart: left out."""
    folded = {(c.tool_call_id, c.message_id) for c in fold.calls}
    blocks = [
        (int(b["f"]), int(b["f"]) + int(b["l"]), b.get("t") or ())
        for b in fold.conversation.get(PENDING_BLOCKS) or ()
        if isinstance(b, Mapping) and int(b["f"]) in fold.unlanded
    ]
    made: dict[int, list[tuple[Any, Any]]] = {first: [] for first, _, _ in blocks}
    for call in fold.conversation.get("pending_calls") or ():
        if isinstance(call, Mapping) and isinstance(seq := call.get("seq"), int):
            for first, end, _ in blocks:
                if first <= seq < end:
                    made[first].append((call.get("tool_call_id"), call.get("message_id")))
    for first, _, taken_off in blocks:
        made[first] += [(t.get("c"), t.get("m")) for t in taken_off if isinstance(t, Mapping)]
    unlanded: dict[int, list[dict[str, str]]] = {}
    for first, calls in made.items():
        for call_id, made_by in dict.fromkeys(calls):
            named = isinstance(call_id, str) and isinstance(made_by, str)
            if named and (call_id, made_by) not in folded:
                unlanded.setdefault(first, []).append({"c": call_id, "m": made_by})
    return unlanded


async def stored_among(
    messages: Any, conversation_id: str, epoch: str | None, seqs: Collection[int]
) -> frozenset[int]:
    """Those of `seqs` that hold a message of the conversation's life (its `epoch`, or none):
    one `find`, none for no `seqs`."""
    if not seqs:
        return frozenset()
    query: dict[str, Any] = {
        "conversation_id": conversation_id,
        "seq": {"$in": [Int64(s) for s in sorted(seqs)]},
    }
    if epoch is not None:
        query["epoch"] = {"$in": [epoch, None]}
    with storage_errors("read the messages of the blocks passed"):
        found = await messages.find(query, {"_id": 0, "seq": 1}).to_list(None)
    return frozenset(int(d["seq"]) for d in found)


def _watch_kept(fold: Refold) -> bool:
    """Whether the fold leaves `PENDING_BLOCKS` as read (`watched_after`): it watches the
    blocks it found passed and empty already, and no other."""
    watched = {
        int(block["f"])
        for block in fold.conversation.get(PENDING_BLOCKS) or ()
        if isinstance(block, Mapping) and block.get("w") is not None
    }
    return watched == set(fold.unlanded) | set(fold.relogging)


def _named_unstored(approved: Iterable[Any], stored: Collection[str | None]) -> frozenset[str]:
    """The messages `approved` (`approved_calls` entries) name as holding or superseding
    their call that are not among `stored` (`Refold.unstored`)."""
    named: set[Any] = set()
    for approval in approved:
        if isinstance(approval, Mapping):
            named.update((approval.get("held_by"), approval.get("superseded_by")))
            named.update(approval.get("held_before") or ())
    return frozenset(m for m in named if isinstance(m, str) and m not in stored)


def of_its_life(conversation: Mapping[str, Any], count: int) -> dict[str, Any]:
    """The filter for the messages below `count` of `conversation`'s own life: of its
    `epoch`, or of none (stored before epochs were), never a stray an earlier life under the
    id left (a deleted conversation's late insert), which neither folds nor names."""
    query: dict[str, Any] = {"conversation_id": conversation["_id"], "seq": {"$lt": count}}
    if (epoch := conversation.get("epoch")) is not None:
        query["epoch"] = {"$in": [epoch, None]}
    return query


def refolded(fold: Refold) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The filter and update that set a conversation's pending state to the fold's (from the
    conversation as it was read): matching only the life it was read in (its `epoch`, else
    its `created_at` and no epoch yet: `still_as_read`), never one deleted and started
    again under the id since, by anyone, and only while no turn reserved (`message_count`)
    and no pop ran or is under way since. The approvals the fold withdraws
    (`Refold.withdrawn`) go while no answer came since (`answered_prompts` as read). When
    the fold tells `resolved_hitl` (`Refold.resolved`), it is set too, and the prompt is
    pending unless among them, the whole update matching only while no answer came since;
    else a prompt resolved by request id, even meanwhile, stays resolved. A fold owed as read
    (`REFOLD_OWED`) is cleared (null), unless marked again since. The calls it lists again
    are marked so (`relisted`), and the blocks it found passed and empty are watched
    (`watched_after`, when `PENDING_BLOCKS` was read)."""
    conversation = fold.conversation
    pops = int(conversation.get("pops") or 0)
    query: dict[str, Any] = {
        **still_as_read(conversation["_id"], conversation),
        "message_count": Int64(int(conversation["message_count"])),
        "pops": pops if pops else {"$in": [None, 0]},
        "popping": None,
    }
    hitl: Any = literal(None)
    if fold.prompt is not None:
        resolved = resolved_by_request(fold.prompt.request_id)
        if fold.resolved is not None:
            resolved = literal(fold.prompt.request_id in fold.resolved)
        hitl = {"$cond": [resolved, literal(None), literal(fold.prompt.model_dump())]}
    calls = literal([c.model_dump() for c in fold.calls])
    stage: dict[str, Any] = {"pending_calls": calls, "pending_hitl": hitl}
    marks = relisted(fold)
    stage[RELISTED] = literal(marks) if marks else absent_stays(RELISTED, literal([]))
    answers = list(conversation.get("answered_prompts") or ())
    given = {"$ifNull": ["$answered_prompts", literal([])]}
    unanswered_since = {"$eq": [given, literal(answers)]}
    if fold.withdrawn:  # while no answer came since they were read
        left = {"$cond": [unanswered_since, approvals_without(fold.withdrawn), "$approved_calls"]}
        stage["approved_calls"] = absent_stays("approved_calls", left)
    if fold.resolved is not None:
        query["$expr"] = unanswered_since
        stage["resolved_hitl"] = absent_stays("resolved_hitl", literal(fold.resolved))
        if fold.resolved:
            stage["resolved_hitl"] = literal(fold.resolved)
    if (owed := conversation.get(REFOLD_OWED)) is not None:  # the mark read, and no later one
        read = {"$eq": [f"${REFOLD_OWED}", literal(owed)]}
        stage[REFOLD_OWED] = {"$cond": [read, literal(None), f"${REFOLD_OWED}"]}
    if PENDING_BLOCKS in conversation:  # read: the blocks watched are the fold's
        stage[PENDING_BLOCKS] = watched_after(fold)
    unstored = approvals_unstored(None, fold.unstored) if fold.unstored else []
    return query, [{"$set": stage}, *unstored]


def relisted(fold: Refold) -> list[dict[str, str]]:
    """The marks of the calls listed again (`_reservation.RELISTED`) the fold leaves: of the
    calls it lists, those marked as read, and those the conversation as read (with its
    `pending_calls`) did not list that a block the fold finds unstored follows
    (`_answerable_unstored`): a turn answering them took them off, and its block, found
    passed and empty, answers none. Its insert may still land (a writer stalled past
    `abandon_after`), so an answer to one looks first whether one did (`looked_again`).
    A call no unstored block follows went off the list with no answer taking it (made in
    a block a fold passed empty, whose stalled insert landed since): listed, unmarked."""
    conversation = fold.conversation
    listed = {
        (call.get("tool_call_id"), call.get("message_id"))
        for call in conversation.get("pending_calls") or ()
        if isinstance(call, Mapping)
    }
    calls = [(c.tool_call_id, c.message_id) for c in fold.calls]
    marked = set(relisted_among(conversation, calls))
    read = "pending_calls" in conversation
    answerable = _answerable_unstored(fold) if read else set()
    again = [
        (c, m) for c, m in calls if (c, m) in marked or ((c, m) not in listed and m in answerable)
    ]
    return [{"c": c, "m": m} for c, m in dict.fromkeys(again) if m is not None]


def _answerable_unstored(fold: Refold) -> set[str]:
    """The ids of the messages making the fold's calls that a `seq` the fold finds no stored
    message at follows, below the conversation's end as read: only a turn reserved there,
    its insert not stored (its block passed empty, given up or still being written), can
    have taken such a call off answering it. With such a `seq`, a making message the fold
    did not read counts as followed by one."""
    stored = {m.id: m.seq for m in fold.stored if m.seq is not None}
    count = int(fold.conversation.get("message_count") or 0)
    last = max(set(range(count)).difference(stored.values()), default=None)
    if last is None:
        return set()
    return {c.message_id for c in fold.calls if stored.get(c.message_id, -1) < last}


async def settle(
    conversations: Any,
    messages: Any,
    conversation_id: str,
    moved: Mapping[str, Any] | None,
    *,
    abandon_after: timedelta,
    name_chars: int,
    given_up: bool = False,
    own: range = range(0),
    quiet: bool = False,
    life: Mapping[str, Any] | None = None,
) -> bool:
    """After a moved turn's insert: its conversation's pending state (and the approvals a fork
    of all of it keeps: `Refold.withdrawn`) folded from the stored messages and written
    (`refold`, `refolded`), from `moved` (the conversation as the move left it) first, read
    again when another turn or a pop changed it meanwhile, its write missing or its fold
    finding a `seq` with no message (a few times). False, the fold owed (`_owe`), when a turn
    below the end is still being written or the conversation kept changing.
    An automatic name taken from a message that is not the first stored user text (the
    moved turn's, now behind another one; a turn's given up, never stored), or that the
    message under its id no longer gives, goes back to the one the stored messages give
    (`_naming.renamed`, `name_chars` long), in the same update; a conversation with no name
    (pops leaving no message took it back) is named so. The name does not wait for a turn
    still being written: it is written alone then, as the stored messages give it, under
    the same guard (`refold`, `partial`).

    `resolved_hitl` is the fold's too (`Refold.resolved`; while another block is unstored,
    only added to), after a move as after a give-up: an answer that named calls, carried to
    the moved question, released only those, and its id stays unresolved while the question
    holds others. `given_up`: after a refused move or a block given back instead, `moved` being
    the conversation as the retry read it (every field), else None: the turn is never
    stored, so the fold leaves out what its first reservation changed (a prompt it asked
    again under an answered id is resolved again; `own`, the `seq`s of the block given
    up, not stored); written only when the summary says otherwise. `quiet`: a replay's fold
    (`_logger._Reserved.relisted`), written only where it changes what was read
    (`_writes_nothing`): what a later turn answered or asked since only looks otherwise.

    Every read and write of the fold is of one life of the conversation (`still_as_read`):
    `life`'s (a filter of the one the caller read), else `moved`'s, else the one its first
    read finds under the id; a conversation deleted meanwhile, even started again under the
    id, by anyone, is gone to it (False, nothing written to the new one)."""
    where = conversation_by_id(conversation_id) if life is None else life
    read = functools.partial(refold, conversations, messages, conversation_id, partial=True)
    for _ in range(_FOLD_ATTEMPTS):
        fold = await read(moved, abandon_after=abandon_after, own=own, life=where)
        if fold is None:
            return False
        where = still_as_read(conversation_id, fold.conversation)
        names = renamed(fold.conversation, first_named(fold.stored, name_chars))
        if not fold.folded and not names and await _changed(conversations, fold):
            moved = None  # a pop (or a turn) ran between its two reads: read again
            continue
        unchanged = (given_up and _already(fold)) or (quiet and _writes_nothing(fold))
        if not names and (not fold.folded or unchanged):
            return fold.folded or await _owe(conversations, where)
        if await _written(conversations, fold, names):
            return fold.folded or await _owe(conversations, where)
        moved = None
    return await _owe(conversations, where)


async def _written(conversations: Any, fold: Refold, names: Mapping[str, Any]) -> bool:
    """Whether the fold (`refolded`; not folded, the name alone, under the same guard) and
    the `names` were written: its guard matched."""
    query, update = refolded(fold)
    update = update if fold.folded else [{"$set": {}}]
    update[0]["$set"].update(names)
    with storage_errors("set what the moved turn leaves pending"):
        result = await conversations.update_one(query, update)
    return bool(result.matched_count)


async def _owe(conversations: Any, life: Mapping[str, Any]) -> bool:
    """Mark the conversation of the life the fold read (`life`, `same_as_read`) as owed a
    fold of its pending state (`REFOLD_OWED`, the time now), which `settle` could not write:
    the next turn folds it (one round trip, on the rare path of a fold given up). False: not
    folded."""
    with storage_errors("mark the conversation's pending state to be folded again"):
        await conversations.update_one(life, {"$set": {REFOLD_OWED: utc_now()}})
    return False


async def _changed(conversations: Any, fold: Refold) -> bool:
    """Whether a turn reserved or a pop ran since the fold read the conversation (one round
    trip, on the rare path of a fold that found a `seq` below the end with no message): the
    `seq` it took for one still being written may be a message that pop removed meanwhile."""
    query, _ = refolded(fold)
    with storage_errors("read the conversation"):
        return await conversations.find_one(query, {"_id": 1}) is None


def _already(fold: Refold) -> bool:
    """Whether the conversation's summary lists the fold's calls pending and its prompt
    already (or no prompt, when a person resolved it by request id), and the fold's
    resolutions, and watches the blocks it found passed and empty (`_watch_kept`); never
    while a fold is owed (`REFOLD_OWED`): the fold is written, clearing the mark."""
    conversation, prompt = fold.conversation, fold.prompt
    now_calls, now_prompt = pending_now(conversation)
    resolved = conversation.get("resolved_hitl") or ()
    if prompt is not None and prompt.request_id in resolved:
        prompt = None
    same = fold.resolved is None or set(resolved) == set(fold.resolved)
    owed = conversation.get(REFOLD_OWED) is not None  # written, to clear the mark
    kept = now_calls == list(fold.calls) and now_prompt == prompt and _watch_kept(fold)
    return same and kept and not fold.withdrawn and not fold.unstored and not owed


def _writes_nothing(fold: Refold) -> bool:
    """Whether writing the fold (`refolded`) leaves the conversation as it was read: its
    pending state and resolutions stand already (`_already`), and so do its marks of the
    calls listed again (`relisted`)."""
    marks = [m for m in fold.conversation.get(RELISTED) or () if isinstance(m, Mapping)]
    return _already(fold) and marks == relisted(fold)


def stored_at(plan: TurnPlan, stored: Sequence[Mapping[str, Any]]) -> int | None:
    """The first `seq` of the block the turn's own messages among `stored` are in (each at
    its index in the turn past it), None when none of them is there; Conflict when they
    are not one block."""
    index = {d["_id"]: i for i, d in enumerate(plan.documents)}
    firsts = {int(d["seq"]) - index[d["_id"]] for d in stored if d["_id"] in index}
    if len(firsts) > 1:
        raise TurnConflict(f"the messages of turn {plan.turn_id!r} are stored in several blocks")
    return firsts.pop() if firsts else None


async def take_answered_off(
    conversations: Any,
    messages: Any,
    same: Mapping[str, Any],
    plan: TurnPlan,
    block: range,
    *,
    epoch: str | None,
    pops: int | None,
) -> None:
    """After the insert of a turn landing past its block whose fold could not be written
    (`settle`, owed: a turn below the end still being written): the calls its messages,
    stored at the `seq`s of `block`, answer go off `pending_calls`, where a fold finding its
    block passed and empty listed them again (DESIGN.md: a call's first answer is its
    answer), and the prompt those answers clear (`answered_calls_off`) goes too. Nothing is
    put back: taking off is always safe, the answer being stored. Each call is the one the
    stored messages pair with the answer (`calls_answered`: one find of the messages of the
    conversation's life, `epoch`, making or answering a call of its ids); the prompts asked
    between the first of those calls and the block are read by a second find; the update
    matches the conversation the turn reserved on (`same`) while no pop ran since its
    reservation (`pops`) nor runs."""
    answered = sorted(set(plan.answered_calls))
    if not answered or pops is None:
        return
    life = {} if epoch is None else {"epoch": {"$in": [epoch, None]}}
    query: dict[str, Any] = {
        "conversation_id": plan.conversation_id,
        "seq": {"$lt": block.stop},
        "$or": [{"tool_calls.id": {"$in": answered}}, {"tool_call_id": {"$in": answered}}],
        **life,
    }
    with storage_errors("read the calls the turn answers"):
        docs = await messages.find(query).sort("seq", 1).to_list(None)
    found = messages_adapter.validate_python(docs)
    pairs = [
        (at, call_id) for i, (at, call_id) in calls_answered(found).items() if found[i].seq in block
    ]
    if not pairs:
        return
    asked = {
        "conversation_id": plan.conversation_id,
        "seq": {"$gte": min(int(docs[at]["seq"]) for at, _ in pairs), "$lt": block.start},
        "hitl_action": {"$type": "object"},
        **life,
    }
    with storage_errors("read the prompts the turn answers"):
        prompts = await messages.find(asked, {"_id": 1}).to_list(None)
    taken = sorted((call_id, str(docs[at]["_id"])) for at, call_id in pairs)  # call, its maker
    off = answered_calls_off(same, taken, pops, sorted(str(d["_id"]) for d in prompts))
    with storage_errors("take the calls the turn answers off the pending calls"):
        await conversations.update_one(*off)


async def hold_asked_again(
    conversations: Any,
    same: Mapping[str, Any],
    plan: TurnPlan,
    pops: int | None,
    held: Collection[tuple[str, str]],
    landed_after: Collection[tuple[str, str, str, str]] = (),
) -> None:
    """After the insert of a turn landing past its block (`_logger._landed_past_its_block`),
    or its replay finding such an approval free (`_logger._Reserved.unheld`): the approved
    calls its stored prompts ask about again, `held` (id, message making it: those
    `_logger._held_again` found, given before its block), are held by them, as its
    reservation held them (`_reservation.asked_again_where_free`, the same expression),
    where a fold that found its block passed and empty put the approvals in force again
    (DESIGN.md `approved_calls`: a later prompt naming the call holds it again; no answer
    reaches a question asked after it). Nothing is released: an entry another prompt
    holds, or whose call is off `pending_calls`, stays as it is. In the same update, the
    approvals a person gave after its block, before it landed (`landed_after`: call id,
    message making it, request id, the landed prompt: `_logger._landed_after`), are marked
    so (`approvals_landed_after`): a fold keeps them (`_fork.approvals_in_fork`). One
    guarded update, matching the conversation the turn reserved on (`same`) while no pop
    ran since its reservation (`pops`) nor runs; none for a turn asking about no approved
    call."""
    stages = [
        s for s in (asked_again_where_free(plan, held), approvals_landed_after(landed_after)) if s
    ]
    if not stages or pops is None:
        return
    query = {**same, "pops": pops if pops else {"$in": [None, 0]}, "popping": None}
    with storage_errors("hold again the approved calls the turn asks about"):
        await conversations.update_one(query, [{"$set": stage} for stage in stages])


def answered_calls_off(
    same: Mapping[str, Any],
    taken: Sequence[tuple[str, str]],
    pops: int,
    asked_before: Sequence[str] = (),
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The filter and update taking the calls `taken` (`(tool_call_id, message_id)`) off
    `pending_calls` of the conversation `same` names, while its pops are `pops` and none is
    under way; matching only while one of them is listed. The pending prompt goes when
    those answers clear it as they did when their turn reserved (`answers_clear`, the
    reservation's rule), if it is one of `asked_before` (the ids of the messages asking
    the prompts stored before the answers): a prompt asked after them, in stored order, is
    not theirs to clear. Their marks as listed again go too (`RELISTED`)."""
    query: dict[str, Any] = {
        **same,
        "pops": pops if pops else {"$in": [None, 0]},
        "popping": None,
        "pending_calls.tool_call_id": {"$in": sorted({call_id for call_id, _ in taken})},
    }
    each = [
        {"$and": [{"$eq": ["$$call.tool_call_id", c]}, {"$eq": ["$$call.message_id", m]}]}
        for c, m in taken
    ]
    calls = {"$ifNull": ["$pending_calls", literal([])]}

    def answered(wanted: bool) -> dict[str, Any]:
        # `$eq` to a boolean rather than `$not`, which some servers lack.
        cond = {"$eq": [{"$or": each}, wanted]}
        return {"$filter": {"input": calls, "as": "call", "cond": cond}}

    stage: dict[str, Any] = {"pending_calls": answered(False), RELISTED: marks_without(taken)}
    if asked_before:
        asked = {"$in": [{"$ifNull": ["$pending_hitl.message_id", None]}, literal(asked_before)]}
        clears = {"$and": [asked, answers_clear(calls, answered(True), answered(False))]}
        stage["pending_hitl"] = {"$cond": [clears, None, "$pending_hitl"]}
    return query, [{"$set": stage}]


async def looked_again(
    conversations: Any,
    messages: Any,
    conversation: Mapping[str, Any],
    marked: Sequence[tuple[str, str]],
    *,
    abandon_after: timedelta,
    name_chars: int,
) -> list[str]:
    """Before an answer to the calls `marked` (tool call id, the message making it) takes
    them: whether an answer to each landed, where `conversation` (as read: its `epoch`,
    `pops`, `pending_calls`) marks it listed again (`RELISTED`: the block that answered it
    was passed as abandoned, and its insert may have landed since, its writer cut before
    taking the call off). One `find` of the messages making or answering them
    (`answers_lookup`, `answers_found`). When one landed, what the landing owed is done as
    its writer would have done it (`_logger._fold_after_insert`): the pending state folded
    from the stored messages (`settle`: the call off, the landed turn's own calls and
    prompt listed), else, a turn below the end still being written (the fold then owed,
    `_owe`), the calls answered taken off `pending_calls` with the prompt their answers
    clear (`answered_calls_off`, the prompts asked between read by one `find` more), in
    that life only. The others' marks go, their answer now the first. The ids answered."""
    if not marked:
        return []
    conversation_id, epoch = str(conversation["_id"]), conversation.get("epoch")
    query = answers_lookup(conversation_id, dict(marked), None)
    with storage_errors("read the answers to the calls listed again"):
        docs = await messages.find(query, ANSWERS_READ).sort("seq", 1).to_list(None)
    found = of_epoch(docs, epoch) if epoch is not None else docs
    answered = {(c, m): answers_found(found, c, m) for c, m in marked}
    taken = sorted(call for call, answers in answered.items() if answers)
    same = same_as_read(conversation_id, conversation)
    pops = int(conversation.get("pops") or 0)
    folded = bool(taken) and await settle(
        conversations,
        messages,
        conversation_id,
        None,
        abandon_after=abandon_after,
        name_chars=name_chars,
        life=same,
    )
    if taken and not folded:
        made_at = {str(d["_id"]): int(d["seq"]) for d in found}
        asked = {
            "conversation_id": conversation_id,
            "seq": {
                "$gte": min(made_at.get(m, 0) for _, m in taken),
                "$lt": max(int(answered[call][0]["seq"]) for call in taken),
            },
            "hitl_action": {"$type": "object"},
        } | ({} if epoch is None else {"epoch": {"$in": [epoch, None]}})
        with storage_errors("read the prompts the answers landed clear"):
            prompts = await messages.find(asked, {"_id": 1}).to_list(None)
        off = answered_calls_off(same, taken, pops, sorted(str(d["_id"]) for d in prompts))
        with storage_errors("take the calls answered off the pending calls"):
            await conversations.update_one(*off)
    if unanswered := [call for call in marked if call not in taken]:
        with storage_errors("mark the calls listed again as looked at"):
            await conversations.update_one(same, [{"$set": {RELISTED: marks_without(unanswered)}}])
    return sorted({c for c, _ in taken})
