"""The end of a conversation: what removing its last message changes. Pure, no I/O.

A runtime that corrects a turn (the Agents SDK's `pop_item`) removes the last
stored message. The conversation's summary must then say what it would have
said had the message never been logged: the turn it started is no longer
counted, its tokens are no longer summed, the preview no longer quotes it, an
automatic name taken from it is taken back (`name_message_id`), a
HITL prompt it raised is no longer pending, the calls it made are not either
(a call it answered is again), and its `seq` is free again. The calls are
changed as a reservation changes them, on the list as it stands: a turn still
being written below the message keeps what it did. The record of the
message's turn is marked popped: a retry of that turn is refused, since
replaying it would store the removed message again.

`seq` is given back only while no other turn has reserved past it: every `seq`
from it to `message_count` is a gap an earlier pop left (`nothing_reserved_past`,
checked inside the update, atomically), so two turns never share a `seq`, and
those gaps are given back with it. A turn that reserved in between keeps its
block; the removed `seq` is then a gap, remembered on the conversation
(`popped_seqs`, the newest `POPPED_SEQS_KEPT`), that tail readers, forks and
later pops pass at once (`_turns.Gaps`). The preview never quotes a removed
message: it is recomputed when nothing was reserved past the message, or when
it still quotes the message (the turn that reserved past it had no text).

A pop marks its message only while no turn holds a `seq` past it (`free_to_mark`):
it removes the last message, never one a turn still being written, or logged
since the pop read it, has put in the middle.

What removing the message changes is computed once, before it is removed, and
kept on the conversation while the pop is under way (`PopInProgress`, the
mark): whichever pop finishes it sends the same update (`agent_store.store._pop`).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from bson import Int64

from agent_store.core import AgentMessage, ApprovedCall, PendingCall, PendingHitl, PopInProgress
from agent_store.store._fork import ApprovalKey, approvals_in_fork, resolved_in_fork
from agent_store.store._naming import AUTOMATIC, named_again
from agent_store.store._reservation import (
    STANDING,
    absent_stays,
    answers_reaching,
    approvals_held_by,
    approvals_superseded_by,
    approvals_without,
    call_fields,
    held_before_of,
    held_by_of,
    int64,
    less,
    literal,
    nothing_reserved_past,
    records_changed,
    resolved_by_request,
    updated_at_left,
    usage_less,
)
from agent_store.store._text import message_text, shorten
from agent_store.store._turns import (
    ANSWERED_READ,
    PENDING_CALLS_KEPT,
    POPPED_MESSAGES_KEPT,
    POPPED_SEQS_KEPT,
    Folded,
    answered_in,
    taking_answers,
    turn_key,
)

_PROMPT_ROLES = ("user", "system")


def starts_a_turn(message: AgentMessage, previous: dict[str, Any] | None) -> bool:
    """Whether logging `message` counted a turn, as the logger counts them.

    A turn starts at a user or system message that does not follow another one of
    those within the same logged turn (`previous` is the stored message before it).
    """
    if message.role not in _PROMPT_ROLES:
        return False
    if previous is None or previous.get("turn_id") != message.turn_id:
        return True
    return previous.get("role") not in _PROMPT_ROLES


def quoted_in_preview(message: AgentMessage) -> bool:
    """Whether the conversation's preview may quote this message (so must be recomputed)."""
    return message.role in ("user", "assistant") and bool(message_text(message))


def preview_of(message: AgentMessage | None, limit: int) -> str:
    """The preview a conversation shows when `message` is its last one with text."""
    return shorten(message_text(message), limit) if message is not None else ""


def reads_pending_before(message: AgentMessage) -> bool:
    """Whether undoing `message` needs what the messages before it leave pending: a call it
    answered comes back, calls its prompt held back are held as those messages hold them
    (by none, or by an earlier prompt), and a prompt an answer or an upload cleared is
    pending again."""
    return _may_clear_a_prompt(message) or message.hitl_action is not None


def _may_clear_a_prompt(message: AgentMessage) -> bool:
    """An answer (to a call a prompt held back) or an upload: either clears the prompt."""
    return message.role == "tool" or (message.role == "user" and message.upload is not None)


@dataclass(frozen=True)
class LeftBefore:
    """What the messages before a popped message leave, folded with the answers a person gave
    as a fork of them all folds them (`_turns.folded_after`), read when
    `reads_pending_before`."""

    calls: list[PendingCall]
    """The calls pending, each with the prompt holding it."""
    prompt: PendingHitl | None
    """The prompt pending."""
    withdrawn: list[ApprovalKey]
    """The stored approvals none of the answers gives there (`_fork.approvals_withdrawn`)."""
    missing: list[int]
    """The `seq`s below the message with no message a turn may still be writing (the gaps
    `popped_seqs` records none holds left out: `Gaps.held`)."""
    settled: Settled | None = None
    """With the conversation's answers as read, all the messages below read (none missing
    that a turn may still write: the blocks passed hold none): what those messages and
    answers leave, in full."""


@dataclass(frozen=True)
class Settled:
    """What the messages before a popped message and the answers a person gave leave of the
    approvals and resolutions, as a fork of them all keeps them (`_fork.approvals_in_fork`,
    `_fork.resolved_in_fork`), with the answers as read: the pop sets them, with the
    pending calls, only while those answers are unchanged (no answer came since)."""

    answers: list[dict[str, Any]]
    """`answered_prompts` as read."""
    approvals: list[dict[str, Any]]
    """`approved_calls` as read, those the fold keeps."""
    resolved: list[str]
    """`resolved_hitl` as the fold leaves it."""


LEFT_BEFORE_READ: dict[str, Any] = {
    "approved_calls": 1,
    "resolved_hitl": 1,
    **ANSWERED_READ,
}
"""What a pop reads of the conversation besides the messages before the last one, for what
those messages and the answers a person gave leave (`settled`)."""


def settled(conversation: Mapping[str, Any], folded: Folded) -> Settled:
    """What the messages before a popped message, folded with the answers `conversation`
    records (`folded`: `answered_in`), leave of its approvals and resolutions, as a fork of
    them all keeps them (read with `LEFT_BEFORE_READ`)."""
    answered = answered_in(conversation)
    approvals = approvals_in_fork(conversation.get("approved_calls") or (), answered, folded)
    return Settled(
        answers=[dict(a) for a in conversation.get("answered_prompts") or ()],
        approvals=[ApprovedCall.model_validate(a).model_dump() for a in approvals],
        resolved=resolved_in_fork(
            conversation.get("resolved_hitl") or (), answered, answered, folded
        ),
    )


def pop_in_progress(
    message: AgentMessage,
    *,
    started_turn: bool,
    preview: str | None,
    updated_at: datetime | None = None,
    quoted: str | None = None,
    before: LeftBefore | None = None,
    named: str | None = None,
    left_none: bool = False,
) -> PopInProgress:
    """What removing `message`, the conversation's last, changes in its summary.

    `preview` is the new preview, or None to keep the current one; `updated_at` the latest
    time of the messages that remain, or None to keep the current one; `quoted` the preview
    the message itself gives (a preview still quoting it is replaced). `before` is what the
    messages before it leave (`LeftBefore`), read when `reads_pending_before`: the calls
    pending, the prompt pending (kept for an answer, which may have cleared it), and the
    approvals withdrawn. `named` is the automatic name the message itself gives (`auto_name`),
    if any; `left_none` that no message is left before it (`PopInProgress.left_none`).
    """
    assert message.seq is not None
    usage = message.token_usage
    return PopInProgress(
        message_id=message.id,
        seq=message.seq,
        epoch=message.epoch,
        pop_id=secrets.token_hex(8),
        turn_key=turn_key(message.turn_id) if message.turn_id is not None else None,
        role=message.role,
        input_tokens=usage.input_tokens if usage else 0,
        output_tokens=usage.output_tokens if usage else 0,
        started_turn=started_turn,
        preview=preview,
        updated_at=updated_at,
        quoted=quoted,
        made_calls=bool(message.tool_calls),
        answered_call=message.tool_call_id if message.role == "tool" else None,
        hitl_request_id=message.hitl_action.request_id if message.hitl_action else None,
        pending_before=before.calls if before else None,
        prompt_back=before.prompt if before and reads_pending_before(message) else None,
        withdrawn_approvals=before.withdrawn if before else [],
        answers_read=before.settled.answers if before and before.settled else None,
        approvals_left=before.settled.approvals if before and before.settled else None,
        resolved_left=before.settled.resolved if before and before.settled else None,
        named=named,
        left_none=left_none,
    )


def free_to_mark(pops: int, seq: int, *, message_count: int | None = None) -> dict[str, Any]:
    """The filter part that lets a pop mark its message at `seq`: no pop under way, none
    finished since the pop read `pops` (so the message it read is still stored), and no turn
    holding a `seq` past it (`nothing_reserved_past`), and a conversation that is one (`STANDING`:
    no delete begun, not a fork not made yet).
    With `message_count`, read when every `seq` past the message was found passed
    (`Gaps.passed`), only that it is unchanged."""
    free: dict[str, Any] = {
        "popping": None,
        "pops": {"$in": [None, 0]} if pops == 0 else pops,
        **STANDING,
    }
    if message_count is None:
        free["$expr"] = nothing_reserved_past(seq)
    else:
        free["message_count"] = message_count
    return free


def mark(pop: PopInProgress) -> dict[str, Any]:
    """The update that records `pop` as under way, before its message is removed."""
    document = pop.model_dump()
    if pop.turn_key is not None:
        document["turn_key"] = Int64(pop.turn_key)
    return {"$set": {"popping": document}}


def unlogged(pop: PopInProgress) -> list[Any]:
    """The update pipeline that takes a removed last message out of its conversation's summary,
    applied once: sent with `{"popping.message_id": pop.message_id}`, it clears the mark.

    A prompt the message raised is no longer pending, nor holds the approved calls it named
    (`approved_calls`: their approvals are in force again); a prompt resolved before is not
    brought back (a resolution by request id leaves no message). The calls it made no longer
    supersede the approvals of earlier calls of their ids. The record of the message's turn is
    marked popped, so no retry of that turn is a replay. Its `seq` is given back, with the
    gaps past it, when no turn holds one past it; else it is a gap (`popped_seqs`). The
    message's id is remembered with its `seq` (`popped_messages`): a tail reader's `after`
    naming it, and the retry of the pop, find it there.
    """
    untouched = nothing_reserved_past(pop.seq)
    stage: dict[str, Any] = {
        "message_count": int64({"$cond": [untouched, pop.seq, "$message_count"]}),
        "popped_seqs": _gaps_after(pop.seq, untouched),
        "popped_messages": _popped_messages_with(pop),
        "turn_count": less("turn_count", int(pop.started_turn)),
        **usage_less(pop.input_tokens, pop.output_tokens),
        "pending_hitl": {
            "$cond": [
                {"$eq": ["$pending_hitl.message_id", literal(pop.message_id)]},
                literal(None),
                "$pending_hitl",
            ]
        },
        "popping": literal(None),
        "pops": int64({"$add": [{"$ifNull": ["$pops", 0]}, 1]}),
    }
    if pop.prompt_back is not None:
        stage["pending_hitl"] = _prompt_back(
            pop.prompt_back, pop.message_id, untouched, stage["pending_hitl"]
        )
    if pop.updated_at is not None:  # a turn that reserved past it set its own
        stage["updated_at"] = updated_at_left(pop.updated_at, untouched)
    turns = _marked_popped(pop.turn_key, pop.seq, untouched)
    stage["turns"] = turns if pop.turn_key is not None else absent_stays("turns", turns)
    # The `seq`s given back are free again: a prompt stored there later is a new one.
    stage.update(answers_reaching({"$cond": [untouched, {"$min": ["$$s", pop.seq]}, "$$s"]}))
    settled = _settled(pop, untouched)
    stage.update(_pending_left(pop, settled))
    if pop.hitl_request_id is not None:
        stage.update(_approvals_unheld_by(pop.message_id))
    if pop.preview is not None:  # a turn that reserved past it set its own, if it had text
        still_quoted = {"$eq": ["$last_message_preview", literal(pop.quoted)]}
        stage["last_message_preview"] = {
            "$cond": [
                {"$or": [untouched, still_quoted]},
                literal(pop.preview),
                "$last_message_preview",
            ]
        }
    stages = [*_approvals_left(pop, settled), {"$set": stage}]
    if pop.role == "user" or pop.left_none:  # it may leave the automatic name to none
        stage.update(_unnamed(pop))
    if pop.made_calls:  # its calls no longer reuse the ids of approved calls
        stages.append({"$set": _approvals_unsuperseded_by(pop.message_id)})
    return stages


def _unnamed(pop: PopInProgress) -> dict[str, Any]:
    """`name`, `name_source` and `name_message_id` once the message is removed: an
    automatic name taken from it (`name_message_id`, or, for a name stored before the
    conversation recorded its message, the very name the message gives: `named`) is taken
    back, so the next turn names the conversation as it names a new one (`named_again`);
    so is any automatic name once no message is left (`left_none`: none gives it). Any
    other name (another message's, a runtime's, a person's) stays."""
    if pop.left_none:
        return named_again(AUTOMATIC, None)
    recorded = {"$ifNull": ["$name_message_id", None]}
    by_it: dict[str, Any] = {"$eq": [recorded, literal(pop.message_id)]}
    if pop.named is not None:
        by_text = {"$and": [{"$eq": [recorded, None]}, {"$eq": ["$name", literal(pop.named)]}]}
        by_it = {"$or": [by_it, by_text]}
    return named_again({"$and": [AUTOMATIC, by_it]}, None)


def _pending_left(pop: PopInProgress, settled: Any) -> dict[str, Any]:
    """`pending_calls` and `resolved_hitl` once the message is removed: what the messages
    that remain and the answers a person gave leave (`pending_before`, `resolved_left`)
    while `settled`; else the list as it is without the message's own effect
    (`_calls_without`), and the resolutions as they are."""
    fields: dict[str, Any] = {}
    if pop.made_calls or pop.pending_before is not None:
        fields["pending_calls"] = _calls_without(pop, pop.pending_before or [])
    if settled is None:
        return fields
    calls = literal([c.model_dump() for c in pop.pending_before or ()])
    fields["pending_calls"] = {"$cond": [settled, calls, fields["pending_calls"]]}
    kept = absent_stays("resolved_hitl", "$resolved_hitl")
    fields["resolved_hitl"] = {"$cond": [settled, literal(pop.resolved_left), kept]}
    return fields


def _settled(pop: PopInProgress, untouched: Any) -> Any:
    """Whether what the messages that remain and the answers the pop read leave in full
    (`PopInProgress.answers_read`) may replace the conversation's pending calls, approvals and
    resolutions, as an expression: no answer came since the pop read them and no turn
    reserved past the message. None when the pop did not read them so."""
    if pop.answers_read is None:
        return None
    answers = {"$ifNull": ["$answered_prompts", literal([])]}
    return {"$and": [untouched, {"$eq": [answers, literal(pop.answers_read)]}]}


def _approvals_left(pop: PopInProgress, settled: Any) -> list[dict[str, Any]]:
    """The stage setting `approved_calls` once the message is removed, none when nothing
    changes them: those the messages that remain and the answers a person gave keep
    (`approvals_left`) while `settled`; else the list as it is without those they give none
    of (`approvals_without`). The first stage, so it reads the list as the pop read it."""
    if not pop.withdrawn_approvals and pop.approvals_left is None:
        return []
    left = approvals_without(pop.withdrawn_approvals)
    if settled is not None and pop.approvals_left is not None:
        left = {"$cond": [settled, literal(pop.approvals_left), left]}
    return [{"$set": {"approved_calls": absent_stays("approved_calls", left)}}]


def _approvals_unsuperseded_by(message_id: str) -> dict[str, Any]:
    """`approved_calls` once the message `message_id` making calls is removed: the approvals
    it superseded (`superseded_by`, a later call reusing their call's id) are of the latest
    call of their id again."""
    before = {"$ifNull": ["$$a.superseded_by", None]}
    removed = {"$eq": [before, literal(message_id)]}
    return approvals_superseded_by({"$cond": [removed, None, before]})


def _gaps_after(seq: int, untouched: Any) -> dict[str, Any]:
    """`popped_seqs` once the message at `seq` is removed: the gaps past it given back with
    it when `untouched`; else `seq` added (the newest `POPPED_SEQS_KEPT` kept)."""
    gaps = {"$ifNull": ["$popped_seqs", literal([])]}
    below = {"$filter": {"input": gaps, "as": "gap", "cond": {"$lt": ["$$gap", seq]}}}
    added = {"$slice": [{"$concatArrays": [gaps, literal([Int64(seq)])]}, -POPPED_SEQS_KEPT]}
    return {"$cond": [untouched, below, added]}


def _popped_messages_with(pop: PopInProgress) -> dict[str, Any]:
    """`popped_messages` with the removed message and its `seq` (`PoppedMessage`), the newest
    `POPPED_MESSAGES_KEPT` kept."""
    kept = {"$ifNull": ["$popped_messages", literal([])]}
    removed = literal([{"s": Int64(pop.seq), "i": pop.message_id, "p": pop.pop_id}])
    return {"$slice": [{"$concatArrays": [kept, removed]}, -POPPED_MESSAGES_KEPT]}


def _prompt_back(
    prompt: PendingHitl, message_id: str, untouched: Any, otherwise: Any
) -> dict[str, Any]:
    """`pending_hitl` once an answer or a prompt (`message_id`) is removed: the prompt the
    messages before it leave pending comes back when none is pending (the answer cleared it)
    or the pending one is the removed prompt (it replaced this one), no turn reserved past
    the message, and it was not resolved by request id (`resolved_hitl`); else `otherwise`."""
    resolved = resolved_by_request(prompt.request_id)
    gone = {
        "$or": [
            {"$eq": [{"$ifNull": ["$pending_hitl", None]}, None]},
            {"$eq": ["$pending_hitl.message_id", literal(message_id)]},
        ]
    }
    comes_back = {"$and": [untouched, gone, {"$eq": [resolved, False]}]}
    return {"$cond": [comes_back, literal(prompt.model_dump()), otherwise]}


def _approvals_unheld_by(message_id: str) -> dict[str, Any]:
    """`approved_calls` once the prompt `message_id` is removed: the approvals it held again
    (`held_by`, a later question about an approved call) are held by the latest prompt that
    held them before it (`held_before`), or, with none, in force again."""
    held_by = held_by_of("a")
    removed = {"$eq": [held_by, literal(message_id)]}
    before = held_before_of("a")
    previous = {"$ifNull": [{"$arrayElemAt": [before, -1]}, None]}
    now_held_by = {"$cond": [removed, previous, held_by]}
    # Message ids, each once in the list: the new holder leaves it by its id.
    others = {"$and": [{"$ne": ["$$m", literal(message_id)]}, {"$ne": ["$$m", now_held_by]}]}
    left = {"$filter": {"input": before, "as": "m", "cond": others}}
    return approvals_held_by(now_held_by, left)


def _marked_popped(key: int | None, seq: int, untouched: Any) -> dict[str, Any]:
    """The turn records, the one under `key` marked popped (`TurnRecord.popped`), and, when
    the `seq`s past `seq` are given back (`untouched`), those of blocks there (a block a
    moved turn left): no bound of a turn any more (`Gaps.turn_end`)."""
    past = {"$and": [untouched, {"$gt": ["$$record.f", seq]}]}
    own = [{"$eq": ["$$record.k", literal(Int64(key))]}] if key is not None else []
    return records_changed({"$or": [*own, past]}, {"p": literal(True)})


def _calls_without(pop: PopInProgress, before: list[PendingCall]) -> dict[str, Any]:
    """`pending_calls` without the removed message's own effect, as the reservation's was.

    Applied to the list as it is, not replacing it with one computed from what was read: a
    turn still being written below the message, or another pop, changed it meanwhile (and
    is kept). The calls the message made leave the list; the call an answer took (the
    latest of its id that `before` lists, `taking_answers`) comes back, in its place among
    them, other calls of its id staying where they are; calls its prompt held back are held
    as `before` holds them (`_unheld`): by none, or by the earlier prompt that held them.
    """
    calls: Any = {"$ifNull": ["$pending_calls", literal([])]}
    answered = [pop.answered_call] if pop.answered_call else []
    back, _ = taking_answers(before, answered)
    kept: dict[str, Any] = {
        "$filter": {
            "input": calls,
            "as": "call",
            "cond": {
                "$and": [
                    {"$ne": ["$$call.message_id", literal(pop.message_id)]},
                    # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
                    {"$eq": [{"$in": [_CALL_KEY, _keys(back)]}, False]},
                ]
            },
        }
    }
    if pop.hitl_request_id is not None:
        kept = _unheld(kept, pop.hitl_request_id, before)
    if not back:
        return kept
    is_later = _made_after(back[0], before)

    def placed(after: bool) -> dict[str, Any]:
        return {"$filter": {"input": kept, "as": "call", "cond": {"$eq": [is_later, after]}}}

    restored = literal([c.model_dump() for c in back])
    both = {"$concatArrays": [placed(False), restored, placed(True)]}
    return {"$slice": [both, -PENDING_CALLS_KEPT]}


def _made_after(call: PendingCall, before: list[PendingCall]) -> dict[str, Any]:
    """Whether the pending call in `$$call` was made after `call`, which comes back to the
    list: by the `seq`s of the messages that made them (`PendingCall.seq`), else (a call of
    the same message, or one listed before the list recorded them) when `before` lists it
    after `call`. The calls of
    a block reserved and not stored (`before` cannot list them) then keep their place too,
    the list staying in the order the calls were made."""
    later = {"$in": [_CALL_KEY, _keys(before[before.index(call) + 1 :])]}
    if call.seq is None:
        return later
    seq = {"$ifNull": ["$$call.seq", None]}
    unordered = {"$or": [{"$eq": [seq, None]}, {"$eq": [seq, literal(call.seq)]}]}
    return {"$cond": [unordered, later, {"$gt": [seq, literal(call.seq)]}]}


_CALL_KEY = {"$concat": ["$$call.message_id", " ", "$$call.tool_call_id"]}
"""What tells one pending call from another in a pipeline: its message and its id (a later
turn may use a call id again); a message id holds no space."""


def _key_list(calls: list[PendingCall]) -> list[str]:
    """The `_CALL_KEY` of each of `calls`."""
    return [f"{c.message_id} {c.tool_call_id}" for c in calls]


def _keys(calls: list[PendingCall]) -> dict[str, Any]:
    """The `_CALL_KEY`s of `calls`, as a pipeline constant."""
    return literal(_key_list(calls))


def _unheld(calls: Any, request_id: str, before: list[PendingCall]) -> dict[str, Any]:
    """`calls`, those held back by the removed prompt `request_id` held as `before` (the fold
    of the messages before it) holds them: by none, or by the prompt that held them before
    (a second question about a call gives it back to the first). A call `before` does not
    list (a turn still being written below the message made it) is kept as it is.

    One flat expression whatever the number of calls: `before` as a constant list of keys
    and holders, looked up by the call's key."""
    keys = _key_list(before)
    holders = literal([{"k": key, "r": c.request_id} for key, c in zip(keys, before, strict=True)])
    found = {"$filter": {"input": holders, "as": "h", "cond": {"$eq": ["$$h.k", _CALL_KEY]}}}
    listed = {"$gt": [{"$size": found}, 0]}
    held = {"$and": [{"$eq": ["$$call.request_id", literal(request_id)]}, listed]}
    holder = {"$arrayElemAt": [{"$map": {"input": found, "as": "h", "in": "$$h.r"}}, 0]}
    fields = call_fields()
    fields["request_id"] = {"$cond": [held, holder, {"$ifNull": ["$$call.request_id", None]}]}
    return {"$map": {"input": calls, "as": "call", "in": fields}}
