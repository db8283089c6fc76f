"""Where a fork of a conversation ends, and the messages it copies. Pure, no I/O."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from agent_store.core import AgentMessage, InvalidInput, PendingCall, PendingHitl
from agent_store.store._turns import pending_after

_STORE_FIELDS = {"id", "seq", "user_id", "conversation_id", "turn_id", "search_text"}


def fork_end(messages: Sequence[AgentMessage], at_seq: int) -> int:
    """The last `seq` a fork at `at_seq` copies: `at_seq`, moved past the results its turn
    gave the calls made at or before it, so a call and its result are never cut apart
    within a turn. A call its turn left open stays pending in the fork, as it was then."""
    if not any(m.seq == at_seq for m in messages):
        raise InvalidInput(f"invalid fork: the conversation has no message with seq {at_seq}")
    calls = {
        c.id: m.turn_id for m in messages if (m.seq or 0) <= at_seq for c in m.tool_calls or ()
    }
    answers = [
        m.seq or 0
        for m in messages
        if m.role == "tool" and m.tool_call_id in calls and calls[m.tool_call_id] == m.turn_id
    ]
    return max([at_seq, *answers])


def fork_copies(messages: Sequence[AgentMessage], end: int) -> list[dict[str, Any]]:
    """The messages up to `end` as a new turn would take them: what the store set, left out."""
    return [
        m.model_dump(by_alias=True, exclude=_STORE_FIELDS) for m in messages if (m.seq or 0) <= end
    ]


def fork_turn_id(conversation_id: str, end: int) -> str:
    """The id of the turn that holds a fork's copies: the same fork, retried, is one turn."""
    digest = hashlib.sha256(f"{conversation_id}\0{end}".encode()).hexdigest()
    return "fork-" + digest[:32]


def fork_pending(
    messages: Sequence[AgentMessage],
    end: int,
    fork_ids: Sequence[str],
    now: tuple[Sequence[PendingCall], PendingHitl | None],
) -> tuple[tuple[PendingCall, ...], PendingHitl | None]:
    """What the fork awaits, naming the fork's own messages (`fork_ids`, in order).

    A fork of the whole conversation awaits what it awaits `now` (a prompt resolved by
    request id left no message). A fork cut earlier awaits what the original's messages up
    to `end` left pending, folded turn by turn as they were logged.
    """
    copied = [m for m in messages if (m.seq or 0) <= end]
    renamed = {str(m.id): fork_id for m, fork_id in zip(copied, fork_ids, strict=True)}
    calls, hitl = now if len(copied) == len(messages) else pending_after(copied)
    return (
        tuple(
            c.model_copy(update={"message_id": renamed.get(c.message_id, c.message_id)})
            for c in calls
        ),
        hitl.model_copy(update={"message_id": renamed.get(hitl.message_id, hitl.message_id)})
        if hitl
        else None,
    )


def pending_now(conversation: Mapping[str, Any]) -> tuple[list[PendingCall], PendingHitl | None]:
    """What a stored conversation document awaits: its pending calls and prompt."""
    prompt = conversation.get("pending_hitl")
    return (
        [PendingCall.model_validate(c) for c in conversation.get("pending_calls") or ()],
        PendingHitl.model_validate(prompt) if prompt else None,
    )
