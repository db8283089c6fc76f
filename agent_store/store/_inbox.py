"""A steering inbox into a running turn: a person's message reaches the runtime mid-turn, or is
refused to the sender — never stored and unseen.

The handshake lives on the conversation document, in the same update that
allocates `seq`, so it needs no transaction:
- `open_turn` adds an inbox entry `inbox.<key>` for the running turn, and remembers the
  turn as a runtime's (`runtime_turns`): a user token starts no turn under its id. It opens
  none under an id a user token logged a turn under first (`TurnRecord.by_person`): that
  turn id is the person's, and the runtime runs its turn under another;
- `try_deliver` reserves the message's `seq` only while that entry exists, and
  appends the `seq` to it in the same atomic update (a delivery is a turn of
  its own, so a retried delivery is stored once);
- `close_inbox` removes the entry only if no delivery arrived after what the
  runtime last saw (a version counter, compared in the filter); otherwise it
  returns the new messages (a page of them, as `drain` does: what fits in
  `PAGE_BYTES`, read in bounded batches) and the inbox stays open.
A delivery retried after its inbox closed, whose message was never stored, is
refused: it cannot come back unseen. One retried while it is open is acknowledged only if
the entry lists it: a turn found under its turn id otherwise is not it. One that stored
nothing and is retried later than the rules' `abandon_after` moves to a new block at the
end (DESIGN.md §3) only while its inbox is open, its entry's `seq` following it in that
same update (a new version, so a close racing it reads again); its inbox closed, it is
refused. One retried with another message is a turn retried with other content (503 while
its first attempt may still store its own; past that its empty block given back and the new
message delivered in its place). A delivery being a turn, its reservation meets every
condition a turn of its message meets besides its inbox's (`_as_a_turn`), and its message
passes a turn's check of the turn and user it names (`_refuse_other_owners`: the turn id it
is stored under, as served, or none). Whatever the
logger refuses a delivery's turn with names that turn's id, which the sender never sees:
`delivery_refusal` words it for the delivery.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from bson import Int64
from pydantic import BaseModel
from pymongo import ReturnDocument

from agent_store.core import (
    AgentMessage,
    AnsweredBefore,
    Conflict,
    NotFound,
    PoppedMessage,
    StorageUnavailable,
    StoreError,
    messages_adapter,
    shown,
    utc_now,
)
from agent_store.store._driver import pause, storage_errors
from agent_store.store._logger import (
    AgentMessageLogger,
    Condition,
    Corrected,
    HeldOff,
    NotStoredYet,
    OtherContent,
    Unreserved,
    _refuse_other_owners,
    _turn_conditions,
    refuse_unloggable_turn_id,
)
from agent_store.store._reads import _bounded_page, _by_seq
from agent_store.store._reservation import (
    STANDING,
    UNSTANDING_READ,
    Actor,
    BeingDeleted,
    being_deleted,
    conversation_by_id,
    int64,
    is_standing,
    literal,
    refuse_unless_fallback_serves,
    refuse_unless_standing,
    seen_by_caller,
    with_none_of,
)
from agent_store.store._turns import (
    DELIVERY_TURN,
    PENDING_CALLS_KEPT,
    RUNTIME_TURNS_KEPT,
    TurnConflict,
    TurnPlan,
    inbox_field,
    plan_turn,
    turn_key,
    validate_identifier,
)

_WAIT_STEP = 0.05
_WAIT_FOR_IN_FLIGHT = 2.0


class _InboxClosed(StoreError):
    """The turn's inbox is closed (or was never opened): the delivery is refused."""

    code = "inbox_closed"
    status = 409


class InboxPage(BaseModel):
    """A page of the messages delivered into a running turn's inbox, by `seq`."""

    data: list[AgentMessage]
    has_more: bool
    """More deliveries follow this page (it ended before the one that would take it past
    `PAGE_BYTES`): read on after the last `seq` in `data`."""


def delivery_turn_id(turn_id: str, delivery: str) -> str:
    """The turn id a delivery is stored under: its delivery id (or the message's digest)
    scoped to the turn whose inbox it is delivered into."""
    digest = hashlib.sha256(f"{turn_id}\0{delivery}".encode()).hexdigest()
    return DELIVERY_TURN + digest[:32]


def _delivered_unscoped(conversation: Mapping[str, Any], field: str, plan: TurnPlan) -> bool:
    """Whether `plan`, a delivery named by its id alone (as stored before ids were scoped to
    their inbox), was recorded in this conversation and is in the open inbox `field` names.

    A closed inbox lists nothing, and a turn record cannot tell such a delivery from a turn
    logged under the same id (a sender naming its deliveries by turn ids): into a closed
    inbox, a delivery is planned scoped, and refused."""
    firsts = {int(r["f"]) for r in conversation.get("turns") or () if int(r["k"]) == plan.key}
    if not firsts:
        return False
    entry = conversation.get("inbox", {}).get(field.split(".")[1])
    if entry is None:
        return False
    delivered = plan.documents[0]["_id"]
    return any(d.get("m", delivered) == delivered and d["s"] in firsts for d in entry["seqs"])


def _person_took(conversation: Mapping[str, Any], turn_id: str) -> bool:
    """Whether `conversation` (its `turns`' keys and authors) records a turn a user token logged
    under `turn_id` (`TurnRecord.by_person`): no runtime's inbox opens under that id."""
    key = turn_key(turn_id)
    return any(
        isinstance(r, Mapping) and r.get("k") == key and r.get("u") is True
        for r in conversation.get("turns") or ()
    )


def _runtime_turn(turn_id: str) -> dict[str, Any]:
    """The conversation's `runtime_turns` with `turn_id` the newest: the turn is its
    runtime's, so a user token starts no turn under its id (`Actor.running_refusal`)."""
    key = Int64(turn_key(turn_id))
    others = {
        "$filter": {
            "input": {"$ifNull": ["$runtime_turns", []]},
            "as": "k",
            "cond": {"$ne": ["$$k", literal(key)]},
        }
    }
    return {"$slice": [{"$concatArrays": [others, literal([key])]}, -RUNTIME_TURNS_KEPT]}


def delivery_refusal(
    error: StoreError, named: str, abandon_after: timedelta, stored_as: str
) -> StoreError:
    """What the logger refused a delivery's turn with (`error`), worded for its sender, who
    names the delivery by its delivery id (`named`: it and the inbox's turn), with what to do.
    Every refusal naming the turn id the delivery is stored under (`stored_as`), which the
    sender never sees, is worded so, with the same class (so the same status): those whose
    advice differs for a delivery with advice of their own (the turn as the conversation holds
    it, `_turn_refusal`; a first attempt that may still store it, `NotStoredYet`; a
    conversation being deleted, `BeingDeleted`; a reservation that lost every race,
    `Unreserved`), any other (a fork not made yet, the message's check) with the turn it names
    (`turn '…'`, as every refusal of the logger names one) named as the sender names the
    delivery (`_renamed`). A refusal naming no turn (the conversation missing or another
    user's, the database unreachable): `error` itself."""
    if isinstance(error, NotStoredYet):
        return NotStoredYet(
            f"nothing of {named} is stored yet, but its first attempt took its place with "
            f"another message and may still store it until `abandon_after` ({abandon_after}) "
            "from then; nothing was written. Retry later: this message is then delivered in "
            "its place while the inbox is open"
        )
    if isinstance(error, BeingDeleted):
        return being_deleted(error.conversation_id, named)
    if isinstance(error, Unreserved):
        return Unreserved(
            f"{named} could not take its place: the conversation kept changing under it. "
            "Nothing was stored; deliver it again under the same delivery_id"
        )
    if isinstance(error, (TurnConflict, AnsweredBefore, HeldOff)):
        return _turn_refusal(error, named)
    return _renamed(error, f"turn {stored_as!r}", named)


def _renamed(error: StoreError, internal: str, named: str) -> StoreError:
    """`error` with the turn it names (`internal`) named as `named` instead, of the same class
    and with the same attributes; `error` itself when it names no such turn."""
    if internal not in error.message:
        return error
    text = error.message.replace(internal, named)
    worded = type(error).__new__(type(error), text)
    worded.__dict__.update(error.__dict__)
    worded.args, worded.message = (text,), text
    return worded


def _turn_refusal(error: TurnConflict | AnsweredBefore | HeldOff, named: str) -> StoreError:
    """`delivery_refusal` of what the conversation holds refusing the delivery's turn: a
    retry of it, popped since or sent with another message; a denial of a call a person
    approved first; a call a prompt holds pushed off `pending_calls`; else what holds its
    place."""
    if isinstance(error, Corrected):
        return Corrected(
            f"{named} was delivered, and removed since by a pop (the conversation was "
            "corrected); nothing was stored again. Send the message under a new delivery_id "
            "if it should be delivered again"
        )
    if isinstance(error, OtherContent):
        return OtherContent(
            f"{named} was first sent with another message; a retry must send the same "
            "message. Use a new delivery_id for a new delivery"
        )
    if isinstance(error, AnsweredBefore):
        return AnsweredBefore(
            f"{named} denies a tool call whose confirmation a person approved first: the tool "
            "runs, and its result answers the call. Nothing was stored; deliver the message "
            "without the denial, under a new delivery_id",
            tool_call_ids=error.tool_call_ids,
        )
    if isinstance(error, HeldOff):
        held = (
            "a call a prompt"
            if error.held is None
            else "the call {} the prompt {}".format(*map(shown, error.held))
        )
        return HeldOff(
            f"{named} would push {held} holds off the pending calls of conversation "
            f"{error.conversation_id!r} (the newest {PENDING_CALLS_KEPT}), which no answer "
            "released: an answer to the prompt releases the calls the list holds only. "
            "Nothing was stored; answer the prompt first (resolve_hitl, or the call's result "
            "or denial), then deliver the message again under the same delivery_id",
            conversation_id=error.conversation_id,
            held=error.held,
        )
    return TurnConflict(
        f"{named} is not stored: what the conversation holds where it goes is not this "
        "delivery as sent (an earlier attempt stored it in part or elsewhere, other messages "
        "hold its place, or a later message answers its call). Send the message under a new "
        "delivery_id if it should be delivered"
    )


def _as_a_turn(
    plan: TurnPlan, inbox: Condition, takes: Callable[[Mapping[str, Any]], bool]
) -> Condition:
    """A delivery's condition: its inbox's (`inbox`) and every one a turn of its message
    meets (`_turn_conditions`, as `log_messages` builds them for a turn naming no
    `next_seq`, `step`, `answers_to` or `refused_prompts`, none of which a delivery takes:
    no denial of a call a person approved first, no call a prompt holds pushed off
    `pending_calls`), in its reservation's one command. Refused as the inbox refuses when the
    conversation found shows it closed, full or past the delivery (`takes`: False), else as
    such a turn is refused. A move to a new block meets the inbox's condition only, as a
    turn's move meets none of the turn's."""
    turn = _turn_conditions(plan, None, None, None)
    if turn is None:
        return inbox

    def explain(found: Mapping[str, Any]) -> StoreError:
        return turn.refused(found) if takes(found) else inbox.refusal

    return Condition(
        {"$and": [inbox.filter, turn.filter]},
        lambda now: {**inbox.stage(now), **turn.stage(now)},
        inbox.refusal,
        moved=inbox.moved,
        moved_filter=lambda _block: inbox.filter,
        explain=explain,
    )


def _inbox_takes(found: Mapping[str, Any], field: str, limit: int) -> bool:
    """Whether the conversation `found` meets a delivery's inbox condition: the inbox `field`
    open, holding fewer than `limit` deliveries, each before the conversation's next `seq`."""
    entry = (found.get("inbox") or {}).get(field.split(".")[1])
    if not isinstance(entry, Mapping):
        return False
    seqs = entry.get("seqs") or ()
    count = int(found.get("message_count") or 0)
    return len(seqs) < limit and all(int(d["s"]) < count for d in seqs)


POPS_READ: dict[str, Any] = {"message_count": 1, "popped_seqs": 1, "popped_messages": 1}
"""What `drain` and `close_inbox` read of a conversation to tell a delivery a pop removed."""


def _undone_by_pop(conversation: Mapping[str, Any], delivery: Mapping[str, Any]) -> bool:
    """Whether a pop removed `delivery` (an inbox entry's `{"s": seq, "m": message id}`),
    no message of its own being stored at its `seq`: the rule `drain` and `close_inbox`
    share, read from `conversation` (`POPS_READ`).

    A delivery in flight holds its `seq` below `message_count`, and a pop removes only a
    stored message, never one past a turn still being written: so a `seq` at or past
    `message_count` was given back by a pop, one among `popped_seqs` is a gap a pop left,
    and a delivery listed with its `seq` among `popped_messages` was removed even if a turn
    has taken the `seq` since. Any of these is passed at once; anything else is a delivery
    still being written, until its sender has given it up (`abandon_after`).
    """
    seq, message_id = int(delivery["s"]), delivery.get("m")
    if seq >= int(conversation.get("message_count") or 0):
        return True
    if seq in {int(s) for s in conversation.get("popped_seqs") or ()}:
        return True
    popped = [PoppedMessage.model_validate(p) for p in conversation.get("popped_messages") or ()]
    return any(p.seq == seq and message_id in (None, p.message_id) for p in popped)


class SteeringInbox:
    """Messages delivered into a running turn, on the logger's database and rules."""

    def __init__(self, logger: AgentMessageLogger) -> None:
        """Deliver and drain through `logger` (its rules decide when a delivery is abandoned)."""
        self._logger = logger
        self._conversations = logger._conversations
        self._messages = logger._messages

    async def open_turn(
        self,
        conversation_id: str,
        turn_id: str,
        *,
        user_id: str | None = None,
        owner_only: bool = False,
        strict_owner: bool = False,
    ) -> None:
        """Mark `turn_id` running with an open inbox (idempotent). The conversation must exist
        and be the caller's (the same ownership rules as logging: `owner_only` and
        `strict_owner`, a runtime acting for the user `user_id`, open only that user's own),
        hold no turn a user token logged under `turn_id` (a person who guessed the id took it
        first: `_person_took`; a turn a runtime acting for a user logged is no person's), and
        have fewer inboxes open than the rules' `open_inboxes` (else Conflict, nothing
        written). An id no turn may be logged under (`refuse_unloggable_turn_id`) is
        InvalidInput: its runtime could never log the turn it runs."""
        conversation_id = validate_identifier(conversation_id, "conversation_id")
        turn_id = validate_identifier(turn_id, "turn_id")
        refuse_unloggable_turn_id(turn_id)
        actor = Actor.of_call(
            conversation_id, user_id, owner_only=owner_only, strict_owner=strict_owner
        )
        field = inbox_field(turn_id)
        opened = {"turn_id": turn_id, "v": Int64(0), "seqs": [], "opened_at": utc_now()}
        remembered = _runtime_turn(turn_id)
        limit = self._logger.rules.open_inboxes
        room = {"$lt": [{"$size": {"$objectToArray": {"$ifNull": ["$inbox", {}]}}}, limit]}
        query = with_none_of(
            {
                **conversation_by_id(conversation_id),
                **actor.owner_filter(),
                "$or": [{field: {"$exists": True}}, {"$expr": room}],
                **STANDING,
            },
            {"turns": {"$elemMatch": {"k": Int64(turn_key(turn_id)), "u": True}}},
        )
        for _ in range(3):  # another inbox may close between a refusal and its explanation
            with storage_errors("open the turn's inbox"):
                doc = await self._conversations.find_one_and_update(
                    query,
                    [
                        {
                            "$set": {
                                field: {"$ifNull": [f"${field}", literal(opened)]},
                                "runtime_turns": remembered,
                            }
                        }
                    ],
                    projection={"_id": 1},
                )
            if doc is not None:
                return
            await self._explain_unopened(conversation_id, actor, turn_id)
        raise StorageUnavailable(f"inboxes of {conversation_id!r} keep changing; open again")

    async def try_deliver(
        self,
        conversation_id: str,
        turn_id: str,
        message: AgentMessage | Mapping[str, Any],
        *,
        delivery_id: str | None = None,
        user_id: str | None = None,
        owner_only: bool = False,
        strict_owner: bool = False,
    ) -> bool:
        """Store `message` in the conversation (next `seq`) if `turn_id`'s inbox is open: True.
        False when it is closed, or holds the rules' `inbox_deliveries` already: nothing was
        stored, start a new turn with the message.

        `delivery_id` names the delivery within this turn's inbox, so a retried delivery is
        stored once and answers True again; the same id delivered into another turn's inbox
        is another delivery. Without it the delivery is named by a digest of the message,
        its `created_at` included: a message sent without `created_at` gets a new time on
        each call, so its retry is stored again unless the message carries its own
        `created_at` (give a `delivery_id` to retry safely). `owner_only` (a user token)
        and `strict_owner` (a runtime acting for the user) deliver only into `user_id`'s own
        conversation, as `log_messages` logs.
        """
        field = inbox_field(validate_identifier(turn_id, "turn_id"))
        actor = Actor.of_call(
            conversation_id, user_id, owner_only=owner_only, strict_owner=strict_owner
        )
        plan = await self._delivery_plan(conversation_id, turn_id, message, delivery_id, field)

        try:
            # A delivery is a turn: its message passes a turn's check of what it names.
            _refuse_other_owners([message], turn_id=plan.turn_id, user_id=user_id)
            return await self._stored_delivery(plan, actor, field)
        except StoreError as exc:
            named = f"delivery {shown(delivery_id)}" if delivery_id else "this delivery"
            named += f" into the inbox of turn {turn_id!r}"
            refusal = delivery_refusal(exc, named, self._logger.rules.abandon_after, plan.turn_id)
            if refusal is exc:
                raise
            raise refusal from exc

    async def _stored_delivery(self, plan: TurnPlan, actor: Actor, field: str) -> bool:
        """The delivery `plan` stored (or found stored) into the inbox `field`: True; False
        when the inbox is closed or full, or its turn id holds what the inbox does not list. A
        sender too slow to insert before tail readers may pass its `seq` moves the delivery to
        the end first, as a late retry does, the inbox open still (`_store`)."""
        condition = self._delivery_condition(plan, field)
        started = time.monotonic()
        try:
            reserved = await self._logger._reserve(plan, actor, None, condition)
        except _InboxClosed:
            return False
        if reserved.replayed and not await self._still_deliverable(plan, reserved, field):
            await self._logger._give_up(plan.conversation_id)
            return False
        try:  # a move (a slow sender) checks the inbox again
            stored, reserved = await self._logger._store(
                plan, reserved, started, (actor, condition)
            )
        except _InboxClosed:
            return False
        await self._logger._told(plan, reserved, stored)
        return True

    def _delivery_condition(self, plan: TurnPlan, field: str) -> Condition:
        """What a delivery's reservation must meet: the inbox `field` open, not full, and the
        `seq` it takes past every `seq` delivered into it (after a pop gave one back, a runtime
        that read up to it would never be handed this one: refused instead); what it records
        there (its `seq`, time and message id, following it to a new block when moved). And,
        a delivery being a turn, every condition a turn of its message meets (`_as_a_turn`)."""
        delivered_id = plan.documents[0]["_id"]

        def stage(now: datetime, left: int | None = None) -> dict[str, Any]:
            entry = {"s": "$message_count", "a": literal(now), "m": literal(delivered_id)}
            added = {"$map": {"input": [0], "in": entry}}
            seqs: Any = f"${field}.seqs"
            if left is not None:  # moved to a new block: its entry follows it there
                others = {"$ne": ["$$d.s", literal(Int64(left))]}
                seqs = {"$filter": {"input": seqs, "as": "d", "cond": others}}
            return {
                f"{field}.seqs": {"$concatArrays": [seqs, added]},
                f"{field}.v": int64({"$add": [f"${field}.v", 1]}),
            }

        limit = self._logger.rules.inbox_deliveries  # the inbox open, and not full
        after_the_delivered = {"$lt": [{"$max": f"${field}.seqs.s"}, "$message_count"]}
        inbox = Condition(
            {
                field: {"$exists": True},
                f"{field}.seqs.{limit - 1}": {"$exists": False},
                "$expr": after_the_delivered,
            },
            stage,
            _InboxClosed("inbox closed"),
            moved=stage,
        )
        return _as_a_turn(plan, inbox, lambda found: _inbox_takes(found, field, limit))

    async def _delivery_plan(
        self,
        conversation_id: str,
        turn_id: str,
        message: AgentMessage | Mapping[str, Any],
        delivery_id: str | None,
        field: str,
    ) -> TurnPlan:
        """The delivery as a turn of its own, named by its delivery id within this turn's
        inbox (`delivery_turn_id`). A delivery stored before ids were scoped to their inbox
        (named by the delivery id alone) keeps that name when retried into the open inbox
        that holds it; into a closed inbox it is refused like any other."""
        rules = self._logger.rules
        unscoped = plan_turn(conversation_id, [message], turn_id=delivery_id, rules=rules)
        with storage_errors("read the turn's inbox"):
            doc = await self._conversations.find_one(
                conversation_by_id(unscoped.conversation_id),
                {field: 1, "turns.k": 1, "turns.f": 1},
            )
        if doc is not None and _delivered_unscoped(doc, field, unscoped):
            return unscoped
        scoped = delivery_turn_id(turn_id, unscoped.turn_id)
        return plan_turn(conversation_id, [message], turn_id=scoped, rules=rules)

    async def _still_deliverable(self, plan: TurnPlan, reserved: Any, field: str) -> bool:
        """Whether a replayed delivery is this delivery, to store (if need be) and answer True.

        While its inbox is open, only if the inbox lists it (its `seq` and message id, as its
        reservation recorded them there): a turn logged under its turn id otherwise (before
        ordinary turns were refused such ids) is not it, and acknowledging it would answer
        True for what the runtime never gets. Once the inbox is closed, only if its message is
        stored: the inbox handed it to the runtime before closing; else it is refused."""
        delivered = plan.documents[0]["_id"]
        with storage_errors("read the turn's inbox"):
            doc = await self._conversations.find_one(
                conversation_by_id(plan.conversation_id), {field: 1}
            )
        entry = None if doc is None else doc.get("inbox", {}).get(field.split(".")[1])
        if entry is not None:
            return any(
                int(d["s"]) == reserved.first_seq and d.get("m", delivered) == delivered
                for d in entry.get("seqs", ())
            )
        with storage_errors("read the delivered message"):
            stored = await self._messages.find_one(
                {"conversation_id": plan.conversation_id, "seq": reserved.first_seq},
                {"_id": 1},
            )
        return stored is not None and stored["_id"] == delivered

    async def drain(
        self, conversation_id: str, turn_id: str, after_seq: int = -1, *, user_id: str | None = None
    ) -> list[AgentMessage]:
        """The messages delivered into `turn_id`'s inbox after `after_seq`, by `seq`: a page of
        them (`drain_page`), so drain again after the last `seq` returned to read on. With
        `user_id`, only in a conversation that user owns (else NotFound)."""
        page = await self.drain_page(conversation_id, turn_id, after_seq, user_id=user_id)
        return page.data

    async def drain_page(
        self, conversation_id: str, turn_id: str, after_seq: int = -1, *, user_id: str | None = None
    ) -> InboxPage:
        """A page of the messages delivered into `turn_id`'s inbox after `after_seq`, by `seq`:
        those that fit in `PAGE_BYTES` (one at least), `has_more` saying whether more
        follow it (read on after its last `seq`). With `user_id`, only in a conversation
        that user owns (else NotFound)."""
        entry = await self._read_entry(conversation_id, turn_id, user_id, writes=False)
        if entry is None:
            return InboxPage(data=[], has_more=False)
        messages, _, has_more = await self._delivered(conversation_id, entry, after_seq)
        return InboxPage(data=messages, has_more=has_more)

    async def close_inbox(
        self, conversation_id: str, turn_id: str, last_seen_seq: int, *, user_id: str | None = None
    ) -> list[AgentMessage]:
        """Close the inbox if nothing arrived after `last_seen_seq`, and return [];
        else return (a page of) what arrived, in `seq` order, and leave it open: close again
        after the last `seq` returned (`close_inbox_page`)."""
        page = await self.close_inbox_page(conversation_id, turn_id, last_seen_seq, user_id=user_id)
        return page.data

    async def close_inbox_page(
        self, conversation_id: str, turn_id: str, last_seen_seq: int, *, user_id: str | None = None
    ) -> InboxPage:
        """Close the inbox if nothing arrived after `last_seen_seq` (an empty page); else
        answer a page of what arrived, in `seq` order (what fits in `PAGE_BYTES`, one at
        least, `has_more` saying more follow) and leave it open. With `user_id`, only in a
        conversation that user owns (else NotFound).

        A delivery still being written is waited for briefly; if it is still not
        stored, `StorageUnavailable` asks the caller to close again. One given up
        by its sender for longer than the rules' `abandon_after` is passed, and one a
        pop removed is passed at once (`_undone_by_pop`).
        """
        field = inbox_field(turn_id)
        for _ in range(4):
            entry = await self._read_entry(conversation_id, turn_id, user_id, writes=True)
            if entry is None:
                return InboxPage(data=[], has_more=False)
            messages, in_flight, more = await self._delivered(conversation_id, entry, last_seen_seq)
            if messages:
                return InboxPage(data=messages, has_more=more)
            if in_flight:
                raise StorageUnavailable(
                    f"a message delivered into turn {turn_id!r} is still being written; "
                    "close the inbox again"
                )
            with storage_errors("close the turn's inbox"):
                closed = await self._conversations.find_one_and_update(
                    conversation_by_id(conversation_id) | {f"{field}.v": entry["v"]},
                    {"$unset": {field: ""}},
                    projection={"_id": 1},
                    return_document=ReturnDocument.BEFORE,
                )
            if closed is not None:
                return InboxPage(data=[], has_more=False)
        raise StorageUnavailable(f"deliveries into turn {turn_id!r} keep arriving; close again")

    async def _read_entry(
        self, conversation_id: str, turn_id: str, user_id: str | None, *, writes: bool
    ) -> dict[str, Any] | None:
        """The inbox entry of `turn_id` (None: not open) in the conversation `user_id` (any,
        for None) sees, for a read of the inbox or, `writes`, its close. Its conversation
        missing, or being migrated: `_unstanding`; one a delete marked or a fork not made yet
        is NotFound to a read, never served from legacy turns (`refuse_unless_fallback_serves`),
        and refuses its owner's close as it refuses a delivery (`refuse_unless_standing`:
        StorageUnavailable, close again later)."""
        conversation_id = validate_identifier(conversation_id, "conversation_id")
        field = inbox_field(validate_identifier(turn_id, "turn_id"))
        actor = Actor(user_id, strict_owner=user_id is not None)
        with storage_errors("read the turn's inbox"):
            found = await self._conversations.find_one(
                conversation_by_id(conversation_id), {field: 1, "user_id": 1, **UNSTANDING_READ}
            )
        owned = found is not None and actor.owns(found)
        doc = seen_by_caller(found, owned)
        if doc is None or not is_standing(doc):
            if writes and owned:
                what = f"the close of the inbox of turn {turn_id!r}"
                refuse_unless_standing(conversation_id, doc, what)
            refuse_unless_fallback_serves(conversation_id, doc)
            await self._unstanding(conversation_id, actor, writes=writes)
            return None
        entry: dict[str, Any] | None = doc.get("inbox", {}).get(field.split(".")[1])
        return entry

    async def _unstanding(self, conversation_id: str, actor: Actor, *, writes: bool) -> None:
        """What the inbox of a conversation `actor` finds no conversation under answers: when
        the id exists only as legacy turns (their owner's or a service's), a write (`writes`: a
        close) is refused as every write to them is (409 `not_migrated_yet`), and a read
        finds no inbox open, as the conversation is served from them (returns); NotFound
        otherwise, and to a user token not their owner's. One more round trip, only here."""
        if writes:
            await self._logger._refuse_unmigrated(conversation_id, actor)
        elif (legacy := self._logger._legacy) is not None and legacy.read_fallback:
            holder = await legacy.holder(conversation_id, user_id=actor.caller)
            if holder is not None and actor.refusal(conversation_id, holder.user_id) is None:
                return
        raise NotFound(f"conversation {conversation_id!r} was not found")

    async def _delivered(
        self, conversation_id: str, entry: dict[str, Any], after_seq: int
    ) -> tuple[list[AgentMessage], bool, bool]:
        """A page of the stored deliveries after `after_seq` (`_delivered_page`), waiting
        briefly for one still being written when none is stored before it: the page, whether
        it ends at a delivery still being written, and whether more follow it."""
        # A `seq` listed twice was given back by a pop and taken again: the later one holds it.
        wanted = {d["s"]: d for d in entry.get("seqs", ()) if d["s"] > after_seq}
        waited = 0.0
        while True:
            ready, in_flight, more = await self._delivered_page(conversation_id, wanted)
            if ready or not in_flight or waited >= _WAIT_FOR_IN_FLIGHT:
                return messages_adapter.validate_python(ready), in_flight, more
            await pause(_WAIT_STEP)
            waited += _WAIT_STEP

    async def _delivered_page(
        self, conversation_id: str, wanted: dict[int, Mapping[str, Any]]
    ) -> tuple[list[dict[str, Any]], bool, bool]:
        """The stored deliveries among `wanted` (by `seq`) that fit in `PAGE_BYTES` (one at
        least, read in bounded batches: `_bounded_page`), up to the first one still being
        written; whether there is such a one; and whether more follow the page.

        Deliveries commit out of `seq` order, so returning one past a delivery in flight
        would let the runtime's `after_seq` pass it for good. A delivery with no message of
        its own at its `seq` is passed when a pop removed it (`_undone_by_pop`) or its
        sender gave it up longer than `abandon_after` before the messages were read (the
        clock read before that read: a reader slow since passes no delivery that landed
        meanwhile); else it is being written.
        """
        pops: Mapping[str, Any] | None = None
        while wanted:
            query = {"conversation_id": conversation_id, "seq": {"$in": sorted(wanted)}}
            read_at = utc_now()
            with storage_errors("read the delivered messages"):
                docs, more = await _bounded_page(
                    self._messages, query, None, *_by_seq("asc"), len(wanted)
                )
            read_to = docs[-1]["seq"] if more else None
            found = {d["seq"]: d for d in docs}
            ready = []
            for seq, delivery in sorted(wanted.items()):
                if read_to is not None and seq > read_to:
                    break
                if (doc := found.get(seq)) is not None:
                    if delivery.get("m", doc["_id"]) == doc["_id"]:
                        ready.append(doc)
                    continue  # else another message holds it
                pops = await self._pops(conversation_id) if pops is None else pops
                if _undone_by_pop(pops, delivery):
                    continue  # nothing ever will hold it
                if read_at - delivery["a"] < self._logger.rules.abandon_after:
                    return ready, True, False
            if ready or read_to is None:
                return ready, False, read_to is not None
            # A page of other messages only (turns took those `seq`s back): read on past it.
            wanted = {seq: d for seq, d in wanted.items() if seq > read_to}
        return [], False, False

    async def _pops(self, conversation_id: str) -> Mapping[str, Any]:
        """What the conversation records of its pops (`POPS_READ`), read after the messages,
        so that a delivery popped since that read is found popped; {} once it is gone."""
        with storage_errors("read the conversation's pops"):
            doc = await self._conversations.find_one(conversation_by_id(conversation_id), POPS_READ)
        return doc or {}

    async def _explain_unopened(self, conversation_id: str, actor: Actor, turn_id: str) -> None:
        """Why an inbox was not opened: the conversation is missing (or exists only as legacy
        turns: `_unstanding`) or another's, a delete of it has begun or it is a fork not made
        yet (`refuse_unless_standing`), a person took the turn id (`_person_took`), or it has as
        many inboxes open as the rules allow (unless one closed meanwhile: opened now)."""
        read = {"user_id": 1, "inbox": 1, "turns.k": 1, "turns.u": 1, **UNSTANDING_READ}
        with storage_errors("read the conversation"):
            doc = await self._conversations.find_one(conversation_by_id(conversation_id), read)
        if doc is None:
            await self._unstanding(conversation_id, actor, writes=True)
        assert doc is not None  # else `_unstanding` raised
        refusal = actor.refusal(conversation_id, doc.get("user_id"))
        if refusal is not None:
            raise refusal
        refuse_unless_standing(conversation_id, doc, f"the inbox of turn {turn_id!r}")
        if _person_took(doc, turn_id):
            raise Conflict(
                f"turn id {turn_id!r} of conversation {conversation_id!r} already holds a "
                "person's turn (a user token logged it before the inbox opened): the id is "
                "theirs. Nothing was changed: open the inbox under a new turn id, one a person "
                "cannot guess (a uuid4), and run the turn under it"
            )
        field = inbox_field(turn_id)
        inboxes: dict[str, Any] = doc.get("inbox") or {}
        limit = self._logger.rules.open_inboxes
        if field.split(".")[1] in inboxes or len(inboxes) < limit:
            return  # one closed, or this one opened, meanwhile
        if not await self._closed_expired(conversation_id, inboxes):
            raise Conflict(
                f"conversation {conversation_id!r} has {limit} open steering inboxes, the most "
                "it keeps: close one (close_inbox) before opening another"
            )

    async def _closed_expired(self, conversation_id: str, inboxes: Mapping[str, Any]) -> bool:
        """Close the inboxes opened longer than the rules' `inbox_expiry` ago, each only if it
        is still the one read (`inboxes`): whether there were any."""
        cutoff = utc_now() - self._logger.rules.inbox_expiry
        expired = {
            key: opened
            for key, entry in inboxes.items()
            if isinstance(entry, Mapping)
            and isinstance(opened := entry.get("opened_at"), datetime)
            and (opened if opened.tzinfo else opened.replace(tzinfo=UTC)) <= cutoff
        }
        if not expired:
            return False
        unchanged = {f"inbox.{key}.opened_at": opened for key, opened in expired.items()}
        with storage_errors("close the expired inboxes"):
            await self._conversations.update_one(
                conversation_by_id(conversation_id) | unchanged,
                {"$unset": {f"inbox.{key}": "" for key in expired}},
            )
        return True
