"""Where a fork of a conversation ends, and the messages it copies. Pure, no I/O."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Any

from agent_store.core import (
    AgentMessage,
    AnsweredPrompt,
    InvalidInput,
    PendingCall,
    PendingHitl,
    answers_to_calls,
)
from agent_store.store._turns import (
    FORK_TURN,
    count_turn_starts,
    fork_copies_end,
    pending_after,
)

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


def forked_messages(messages: Sequence[AgentMessage], end: int) -> list[AgentMessage]:
    """The messages a fork at `end` copies: those up to `end`, each call answered once (one
    turn answers a call once) by its answer in every replay (`answers_to_calls`: the first
    real result, else the first stand-in); a result answering no call is copied as stored."""
    copied = [m for m in messages if (m.seq or 0) <= end]
    answers = {id(m) for m in answers_to_calls(copied).values()}
    made: set[str] = set()
    kept: list[AgentMessage] = []
    for message in copied:
        made |= {call.id for call in message.tool_calls or ()}
        if message.role != "tool" or id(message) in answers or message.tool_call_id not in made:
            kept.append(message)
    return kept


def last_fitting_fork(
    messages: Sequence[AgentMessage],
    below: int,
    fits: Callable[[list[AgentMessage], int], bool],
) -> int | None:
    """The last `seq` before `below` at which a fork, moved past the results its turn gave the
    calls made at or before it (`fork_end`), copies messages that `fits` (with its end); None
    when a fork at the first message does not fit already. A fork at a later `seq` copies what
    one at an earlier `seq` copies, and more: the `seq`s whose forks fit come first, and a
    binary search weighs about log2 n forks. The `seq` answered is one whose fork was weighed
    and fits."""
    seqs = sorted({m.seq for m in messages if m.seq is not None and m.seq < below})

    def fork_fits(seq: int) -> bool:
        end = fork_end(messages, seq)
        return fits(forked_messages(messages, end), end)

    if not seqs or not fork_fits(seqs[0]):
        return None
    fitting, past = 0, len(seqs)  # seqs[fitting] fits; none from seqs[past] on is known to
    while past - fitting > 1:
        middle = (fitting + past) // 2
        if fork_fits(seqs[middle]):
            fitting = middle
        else:
            past = middle
    return seqs[fitting]


def fork_copies(messages: Sequence[AgentMessage]) -> list[dict[str, Any]]:
    """The messages as a new turn takes them: what the store set, left out."""
    return [m.model_dump(by_alias=True, exclude=_STORE_FIELDS) for m in messages]


def fork_turn_id(conversation_id: str, end: int) -> str:
    """The id of the turn that holds a fork's copies: the same fork, retried, is one turn."""
    digest = hashlib.sha256(f"{conversation_id}\0{end}".encode()).hexdigest()
    return FORK_TURN + digest[:32]


def fork_turn_starts(chosen: Sequence[AgentMessage], turn_starts: Collection[int]) -> list[int]:
    """Where the original's turns begin among a fork's copies (`seq` 0…n in the order of
    `chosen`), after the first: where `turn_id` changes, or where the original, a fork
    itself, had a turn begin (`turn_starts`)."""
    starts = set(turn_starts)
    copies = fork_copies_end(chosen)
    return [
        index
        for index in range(1, len(chosen))
        if chosen[index].turn_id != chosen[index - 1].turn_id
        or (index < copies and chosen[index].seq in starts)
    ]


def fork_turn_count(chosen: Sequence[AgentMessage], turn_starts: Sequence[int]) -> int:
    """The turns a fork's copies count, as the original counted them: each run of copies of
    one turn of the original (cut at `turn_starts`, from `fork_turn_starts`) counts its
    starts as that turn counted its messages (`count_turn_starts`)."""
    cuts = [0, *turn_starts, len(chosen)]
    return sum(count_turn_starts(chosen[a:b]) for a, b in pairwise(cuts))


def fork_pending(
    messages: Sequence[AgentMessage],
    end: int,
    fork_ids: Mapping[str, str],
    turn_starts: Collection[int] = (),
    resolved: Collection[str] = (),
    answered: Iterable[tuple[str, int]] = (),
) -> tuple[tuple[PendingCall, ...], PendingHitl | None]:
    """What the fork awaits, naming the fork's own messages (`fork_ids`: the original's
    message ids to the fork's).

    What the original's messages up to `end` left pending, folded turn by turn as they were
    logged (`turn_starts`: the original's own, when it is a fork), but for prompts the
    original resolved by request id (`resolved`), which no message records, and those its
    answers reached (`answered`: asked before the answer came, under an id asked again
    since). A fork of the whole conversation too: what the copies leave, never what a turn
    that reserved and stored nothing (abandoned, passed) left in the original's summary.
    """
    upto = [m for m in messages if (m.seq or 0) <= end]
    calls, hitl = pending_after(upto, turn_starts, answered)
    if hitl is not None and hitl.request_id in resolved:
        hitl = None
    return (
        tuple(
            c.model_copy(update={"message_id": fork_ids.get(c.message_id, c.message_id)})
            for c in calls
        ),
        hitl.model_copy(update={"message_id": fork_ids.get(hitl.message_id, hitl.message_id)})
        if hitl
        else None,
    )


def answers_in_fork(
    answered: Iterable[tuple[str, int]], chosen: Sequence[AgentMessage]
) -> list[dict[str, Any]]:
    """`answered_prompts` of a fork copying `chosen` (`seq` 0…n in their order), from the
    original's (`answered_in`): each answer reaches the copies of the messages it reached."""
    seqs = [m.seq or 0 for m in chosen]
    return [
        AnsweredPrompt(request_id=r, below=sum(1 for s in seqs if s < below)).model_dump(
            by_alias=True
        )
        for r, below in answered
    ]


def fork_turns_of(conversation: Mapping[str, Any]) -> list[int]:
    """The `seq`s where a fork's copies began a turn of its original (none unless a fork)."""
    return list((conversation.get("forked_from") or {}).get("turn_starts") or ())


def pending_now(conversation: Mapping[str, Any]) -> tuple[list[PendingCall], PendingHitl | None]:
    """What a stored conversation document awaits: its pending calls and prompt."""
    prompt = conversation.get("pending_hitl")
    return (
        [PendingCall.model_validate(c) for c in conversation.get("pending_calls") or ()],
        PendingHitl.model_validate(prompt) if prompt else None,
    )
