"""Where a fork of a conversation ends, and the messages it copies. Pure, no I/O."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from agent_store.core import (
    RESOLVED_PROMPTS_KEPT,
    AgentMessage,
    AnsweredPrompt,
    InvalidInput,
    PendingCall,
    PendingHitl,
)
from agent_store.store._turns import (
    FORK_TURN,
    Answer,
    Folded,
    count_turn_starts,
    folded_after,
    turn_keys,
)

_STORE_FIELDS = {"id", "seq", "user_id", "conversation_id", "turn_id", "search_text"}


def fork_end(
    messages: Sequence[AgentMessage], at_seq: int, turn_starts: Collection[int] = ()
) -> int:
    """The last `seq` a fork at `at_seq` copies: `at_seq`, moved past the results its turn
    gave the calls made at or before it, so a call and its result are never cut apart
    within a turn. A call its turn left open stays pending in the fork, as it was then.
    Turns are told apart as the fold tells them (`turn_keys`, with `turn_starts`: the
    source's own when it is a fork), so a fork of a fork ends where a fork of its original
    at the same point ends, never at a result a later turn of the original gave."""
    if not any(m.seq == at_seq for m in messages):
        raise InvalidInput(f"invalid fork: the conversation has no message with seq {at_seq}")
    keys = turn_keys(messages, turn_starts)
    calls = {
        c.id: key
        for m, key in zip(messages, keys, strict=True)
        if (m.seq or 0) <= at_seq
        for c in m.tool_calls or ()
    }
    answers = [
        m.seq or 0
        for m, key in zip(messages, keys, strict=True)
        if m.role == "tool" and m.tool_call_id in calls and calls[m.tool_call_id] == key
    ]
    return max([at_seq, *answers])


def forked_messages(messages: Sequence[AgentMessage], end: int) -> list[AgentMessage]:
    """The messages a fork at `end` copies: every one up to `end`, as stored and in order.
    None is left out: a call with several results (a stand-in and the real one, a result
    sent again in a later turn) keeps them all, and every reader picks the answer among them
    as it does in the original (`answers_to_calls`), so the fork reads as its original did."""
    return [m for m in messages if (m.seq or 0) <= end]


def last_fitting_fork(
    messages: Sequence[AgentMessage],
    below: int,
    fits: Callable[[list[AgentMessage], int], bool],
    turn_starts: Collection[int] = (),
) -> int | None:
    """The last `seq` before `below` at which a fork, moved past the results its turn gave the
    calls made at or before it (`fork_end`), copies messages that `fits` (with its end); None
    when a fork at the first message does not fit already. A fork at a later `seq` copies what
    one at an earlier `seq` copies, and more: the `seq`s whose forks fit come first, and a
    binary search weighs about log2 n forks. The `seq` answered is one whose fork was weighed
    and fits. `turn_starts`: the source's own when it is a fork, as `fork_end` takes them."""
    seqs = sorted({m.seq for m in messages if m.seq is not None and m.seq < below})

    def fork_fits(seq: int) -> bool:
        end = fork_end(messages, seq, turn_starts)
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
    `chosen`), after the first: where the turn changes (`turn_keys`, with `turn_starts`:
    the original's own when it is a fork)."""
    keys = turn_keys(chosen, turn_starts)
    return [index for index in range(1, len(chosen)) if keys[index] != keys[index - 1]]


def fork_turn_count(chosen: Sequence[AgentMessage], turn_starts: Sequence[int]) -> int:
    """The turns a fork's copies count, as the original counted them: each run of copies of
    one turn of the original (cut at `turn_starts`, from `fork_turn_starts`) counts its
    starts as that turn counted its messages (`count_turn_starts`)."""
    cuts = [0, *turn_starts, len(chosen)]
    return sum(count_turn_starts(chosen[a:b]) for a, b in pairwise(cuts))


@dataclass(frozen=True)
class ForkAnswers:
    """What a fork keeps of the answers a person gave in its original: those given before the
    original went past the fork's end (`copied`, `answers_before`), the fold of the copied
    messages with them (`folded`, `fork_fold`), the request ids it keeps resolved
    (`resolved`, `resolved_in_fork`) and the original's approvals it keeps (`approved`,
    `approvals_in_fork`)."""

    copied: list[Answer]
    folded: Folded
    resolved: list[str]
    approved: list[Mapping[str, Any]]


def fork_fold(
    messages: Sequence[AgentMessage],
    end: int,
    turn_starts: Collection[int] = (),
    answered: Iterable[Answer] = (),
) -> Folded:
    """The fold of the original's messages up to `end`, turn by turn as they were logged
    (`turn_starts`: the original's own, when it is a fork), with the answers the fork copies
    (`answers_before`), each given where it came (`folded_after`). A fork of the whole
    conversation too: what the copies leave, never what a turn that reserved and stored
    nothing (abandoned, passed) left in the original's summary."""
    upto = [m for m in messages if (m.seq or 0) <= end]
    return folded_after(upto, turn_starts, answered)


def fork_pending(
    folded: Folded, fork_ids: Mapping[str, str], resolved: Collection[str] = ()
) -> tuple[tuple[PendingCall, ...], PendingHitl | None]:
    """What the fork awaits (`fork_fold`), naming the fork's own messages (`fork_ids`: the
    original's message ids to the fork's), but for prompts the fork remembers resolved by
    request id (`resolved`, `resolved_in_fork`) which no answer it copies records."""
    calls, hitl = folded.calls, folded.hitl
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


def answers_before(answered: Iterable[Answer], reach: int | None) -> list[Answer]:
    """The original's answers (`answered_in`) a fork copies: those given before the original
    stored a message past the fork's end, or reserved one a turn is still writing (`reach`,
    the first such `seq`; None when there is none). An answer reaching `seq`s up to `reach`
    came before that message, within the part the fork copies or right after it; a later
    one came once the original had gone past the fork's point, which never sees it: the
    fork is the same whenever it is taken."""
    return [answer for answer in answered if reach is None or answer[1] <= reach]


def resolved_in_fork(
    resolved: Sequence[str],
    answered: Iterable[Answer],
    copied: Sequence[Answer],
    folded: Folded,
) -> list[str]:
    """The `resolved_hitl` of a fork: the original's request ids resolved (`resolved`) with
    no answer recorded (`answered`, every one the original keeps: resolved before answers
    were recorded, where they came unknown), then those the answers the fork copies
    (`copied`) leave answered (`fork_fold`), in the order of their last answer; the newest
    `RESOLVED_PROMPTS_KEPT`."""
    recorded = {answer[0] for answer in answered}
    unplaced = [r for r in resolved if r not in recorded]
    in_order = [answer[0] for answer in sorted(copied, key=lambda answer: answer[1])]
    last = list(dict.fromkeys(reversed(in_order)))[::-1]
    return [*unplaced, *(r for r in last if r in folded.resolved)][-RESOLVED_PROMPTS_KEPT:]


def approvals_in_fork(
    approved: Iterable[Any], answered: Iterable[Answer], folded: Folded
) -> list[Mapping[str, Any]]:
    """The original's `approved_calls` a fork may keep, as stored: those the answers it
    copies gave (`Folded.released`: of a call and request id, the first as many as those
    answers released), and those no recorded answer could have given (`_given_by_one_of`;
    `answered`, every one the original keeps), or recorded without one, where they came
    unknown. An approval an answer gave once the original had gone past the fork's point is
    not the fork's. One a prompt landed after (`landed_after`: its turn stalled past its
    block, stored below the answer's reach) stays while an answer the fork copies took its
    call over from that prompt (`Folded.taken_over`): the stored order puts the prompt
    between the one the answer was for and the answer, but it held nothing when the answer
    came. Then those the answers released in the fold that no stored one records
    (`_released_unrecorded`)."""
    left: Counter[tuple[Any, Any, Any]] = Counter(folded.released)
    kept: list[Mapping[str, Any]] = []
    for approval in approved:
        if not isinstance(approval, Mapping):
            continue
        request_id = approval.get("request_id")
        key = (approval.get("tool_call_id"), approval.get("message_id"), request_id)
        if not _given_by_one_of(key, answered):
            kept.append(approval)
        elif left[key] > 0:
            left[key] -= 1
            kept.append(approval)
        elif approval.get("landed_after") is not None and key in folded.taken_over:
            kept.append(approval)
    return kept + _released_unrecorded(kept, folded)


def _released_unrecorded(
    kept: Sequence[Mapping[str, Any]], folded: Folded
) -> list[Mapping[str, Any]]:
    """The approvals the answers gave in the fold (`folded`) that none of the `kept` ones
    records: of a call still pending, the latest of its id, that no prompt asked about
    again since (`Folded.in_force`). The fold serves such a call released (`request_id:
    null`), so its approval is recorded with it, and a denial of it stays refused whatever
    becomes of its prompt's request id: a pop of a denial made before the answer came (the
    answer, given where it came in what remains, released that call too). An approval
    dropped from the list's newest kept, its call answered, is not brought back."""
    recorded = {(a.get("tool_call_id"), a.get("message_id")) for a in kept}
    latest = {c.tool_call_id: c.message_id for c in folded.calls}
    added: dict[tuple[str, str], str] = {}
    for call_id, message_id, request_id in folded.released:
        key = (call_id, message_id)
        if key in recorded or key not in folded.in_force or latest.get(call_id) != message_id:
            continue
        added[key] = request_id  # the latest answer releasing it
    return [{"tool_call_id": c, "message_id": m, "request_id": r} for (c, m), r in added.items()]


def _given_by_one_of(key: tuple[Any, Any, Any], answered: Iterable[Answer]) -> bool:
    """Whether one of the recorded `answered` could have given the approval `key` (call id,
    message, request id): one of its request id naming no call, or naming that call. Only
    the newest answers are kept (`RESOLVED_PROMPTS_KEPT`): an approval no recorded answer
    could have given came from one no longer recorded, and nothing the fold can tell
    withdraws it."""
    call_id, message_id, request_id = key
    if request_id is None:
        return False
    for answer_id, _below, named in answered:
        if answer_id != request_id:
            continue
        if named is None or any(
            call == call_id and message in (None, message_id) for call, message in named
        ):
            return True
    return False


ApprovalKey = tuple[str, str, str]
"""An `approved_calls` entry's call id, the message making the call, and the request id of
the answer that released it."""


def approvals_withdrawn(
    approved: Iterable[Any], answered: Iterable[Answer], folded: Folded
) -> list[ApprovalKey]:
    """The keys of the stored `approved_calls` that the fold of the messages left, with the
    answers a person gave (`folded`, all of `answered`), gives none of: what a pop withdraws,
    so the conversation keeps the approvals a fork of all that remains keeps
    (`approvals_in_fork`, the one rule). An approval answering a prompt that no longer held
    the call when the answer came (a later question had taken it) released nothing."""
    approved = list(approved)
    kept = {approval_key(a) for a in approvals_in_fork(approved, answered, folded)}
    return sorted(
        {key for key in map(approval_key, approved) if key is not None and key not in kept}
    )


def approval_key(approval: Any) -> ApprovalKey | None:
    """The key of a stored `approved_calls` entry (None for one without a request id, or not
    an entry: no answer recorded it, so no fold withdraws it)."""
    if not isinstance(approval, Mapping):
        return None
    call_id, message_id = approval.get("tool_call_id"), approval.get("message_id")
    request_id = approval.get("request_id")
    if isinstance(call_id, str) and isinstance(message_id, str) and isinstance(request_id, str):
        return call_id, message_id, request_id
    return None


def answers_in_fork(
    answered: Iterable[Answer], chosen: Sequence[AgentMessage], fork_ids: Mapping[str, str]
) -> list[dict[str, Any]]:
    """`answered_prompts` of a fork copying `chosen` (`seq` 0…n in their order), from the
    answers it copies (`answers_before`): each reaches the copies of the messages it reached,
    and names the copies of the calls it named (`fork_ids`: the original's message ids to the
    fork's)."""
    seqs = [m.seq or 0 for m in chosen]
    return [
        AnsweredPrompt(
            request_id=r,
            below=sum(1 for s in seqs if s < below),
            calls=None
            if calls is None
            else [(c, None if m is None else fork_ids.get(m, m)) for c, m in calls],
        ).model_dump(by_alias=True)
        for r, below, calls in answered
    ]


def copies_turn_of(conversation: Mapping[str, Any]) -> str | None:
    """The id of the turn holding a fork's copies (`fork_turn_id` of its `forked_from`), None
    unless a fork: a later turn a caller named so too is not its copies."""
    origin = conversation.get("forked_from") or {}
    if not isinstance(origin.get("conversation_id"), str) or origin.get("seq") is None:
        return None
    return fork_turn_id(origin["conversation_id"], int(origin["seq"]))


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
