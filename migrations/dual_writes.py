"""Dual-written legacy turns (`dual_write: true`): the new service's copies of its own turns,
kept for a rollback (MIGRATION.md, "Transition flags").

Such a turn is keyed by the id its conversation is stored under (the one it names, or the
derived id the legacy id it names stands for) and the live turn id (`turn_id`), which its
stored messages carry too. A run skips it only while `agent_messages` holds messages of that
turn (`held`): one without any (a second attempt after a rollback that cleared
`agent_messages`) is a legacy turn like any other, converted by `run` and checked by `verify`
and `finish`. A held one is checked as fully as a migrated turn, by one rule: it must convert
to what its stored messages hold and nothing else, that is its stored messages hold its
content in order and nothing more (`_removed`), carry the token usage and latency it converts
to, and its conversion raises
no problem of any kind (a dual write holds nothing the converter cannot read, so a problem is
content a later edit added: an unknown part, a field, a history), but a result answering an
earlier turn's call that its stored messages hold (converted alone, no call answers it) and
the `derived_conversation_id` of a conversation it names by the legacy id a derived id
stands for.
The user it names is the one its stored messages carry (one naming none passes), and the
name the latest of them gives its conversation, when it is the last turn naming one, is its
document's (but a person's rename since). Anything else (the legacy service edited it after
a rollback) is a difference for `verify` and work left for `finish` (`differences`): its
stored messages are the live service's, which the migration never rewrites, so the turn is
restored, or its `dual_write` mark removed so `run` migrates it (never for a turn whose
recorded copy is missing a legacy turn: a person's delete). So is a live turn the dual
write recorded copying (`COPY_RECORD`) whose copy, or any legacy turn of it the record lists
(`COPY_PIECES`), is gone (`deleted`): the legacy service deleted it after a rollback; a
turn with no such record had no copy to lose.
"""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError
from pymongo import UpdateOne
from pymongo.database import Database

from agent_store.core import (
    AgentMessage,
    Conversation,
    InvalidInput,
    Usage,
    to_utc_millis,
    utc_now,
)
from agent_store.legacy import (
    COPY_INTENDED,
    COPY_PIECES,
    COPY_RECORD,
    COPY_STATE,
    COPY_WRITTEN,
    CUT_FIELD,
    DUAL_WRITE_NOT_EXACT,
    MAX_LEGACY_DOCUMENT_BYTES,
    NATIVE_FIELD,
    RECORD_FIELD,
    LegacyConversion,
    LegacyTurn,
    Problem,
    convert,
    copy_pieces,
    copy_record_id,
    legacy_turn_id,
    normalize_part,
    parse_turns,
    piece_starts,
    result_text,
    sort_turns,
    stored_conversation_id,
    turn_copy,
    turn_copy_pieces,
)
from agent_store.store import (
    CONVERSATIONS,
    COPY_OWED,
    DEFAULT_MARKERS,
    MESSAGES,
    MIGRATED_TURN_PREFIX,
    RuntimeContextMarkers,
    TurnRules,
)
from migrations import full_texts
from migrations.errors import Misuse, WorkLeft
from migrations.lease import STATE, STATE_ID, Lease
from migrations.relocate import CONVERSATION_FILTER
from migrations.settings import SERVICE_DEFAULTS
from migrations.transcript import (
    NO_CALL,
    Transcript,
    contains,
    from_legacy_converted,
    from_messages,
)
from migrations.transcript import differences as transcript_differences
from migrations.writes import is_migrated, readable


def _turn(document: Mapping[str, Any]) -> tuple[str, str] | None:
    """(conversation id, turn id) of a dual-written turn, by the id its conversation is
    stored under, as its messages name it (`stored_conversation_id`: a dual write names a
    conversation stored under a derived id by the legacy id it stands for); None for any
    other document."""
    cid, turn_id = document.get("conversation_id"), document.get("turn_id")
    if document.get("dual_write") is not True or not isinstance(cid, str):
        return None
    return (stored_conversation_id(document), turn_id) if isinstance(turn_id, str) else None


def held(db: Database[dict[str, Any]], documents: Sequence[Mapping[str, Any]]) -> set[int]:
    """Which of these documents (by `id()`) are dual-written turns whose messages are stored:
    one read of `agent_messages` for them all, none when there is no such turn. A copy is the
    turn it copies, by its `_id` (`legacy_turn_id` of the conversation and turn it was
    written for): one the old service re-filed under another conversation after a rollback
    is held by its messages where they are (`_filed_elsewhere`), never converted again into
    the conversation it names now; `differences` names it."""
    turns = {key for d in documents if (key := _turn(d)) is not None}
    if not turns:
        return set()
    query = {"$or": [{"conversation_id": c, "turn_id": t} for c, t in sorted(turns)]}
    found = {
        (m.get("conversation_id"), m.get("turn_id"))
        for m in db[MESSAGES].find(query, {"conversation_id": 1, "turn_id": 1})
    }
    kept = {id(d) for d in documents if _turn(d) in found}
    rest = [d for d in documents if _turn(d) is not None and id(d) not in kept]
    return kept | set(_filed_elsewhere(db, rest))


def _written_for(document: Mapping[str, Any], cid: str, seqs: Iterable[int] = ()) -> bool:
    """Whether a dual-written copy's `_id` is the one the dual write gives a document of its
    turn in conversation `cid` (`legacy_turn_id`; a later piece of the turn is named by a
    part, `legacy_turn_documents`: "system", or the `seq` it opens at, `seqs`)."""
    turn_id = str(document.get("turn_id"))
    parts = ["", "system", *(f"seq-{s}{end}" for s in seqs for end in ("", "system"))]
    ids = {legacy_turn_id(cid, f"{turn_id}\0{p}" if p else turn_id) for p in parts}
    return document.get("_id") in ids


def _filed_elsewhere(
    db: Database[dict[str, Any]], documents: Sequence[Mapping[str, Any]]
) -> dict[int, str]:
    """Of these dual-written copies no message under the conversation they name holds, those
    whose turn's messages are stored under the conversation their `_id` was written for (the
    old service re-filed them), by `id()`, with that conversation: one read, by turn id, only
    for copies whose `_id` is not that of a first piece of their turn in the conversation
    they name (a second attempt after messages were cleared reads nothing)."""
    wanted = [d for d in documents if not _written_for(d, _turn(d)[0])]  # type: ignore[index]
    if not wanted:
        return {}
    query = {"turn_id": {"$in": sorted({str(d.get("turn_id")) for d in wanted})}}
    stored: dict[tuple[str, str], list[int]] = {}
    for m in db[MESSAGES].find(query, {"conversation_id": 1, "turn_id": 1, "seq": 1}):
        key = (str(m.get("conversation_id")), str(m.get("turn_id")))
        stored.setdefault(key, []).append(int(m.get("seq") or 0))
    return {
        id(d): cid
        for d in wanted
        for (cid, turn_id), seqs in stored.items()
        if turn_id == d.get("turn_id")
        and cid != _turn(d)[0]  # type: ignore[index]
        and _written_for(d, cid, seqs)
    }


def differences(
    db: Database[dict[str, Any]],
    documents: Iterable[Mapping[str, Any]],
    legacy: Mapping[str, Sequence[LegacyTurn]],
    conversations: Mapping[str, Mapping[str, Any]],
    rules: TurnRules = SERVICE_DEFAULTS,
    copies_gone: Collection[tuple[str, str]] = (),
) -> dict[str, list[str]]:
    """For held dual-written turns: by conversation, each turn that converts (by `rules`) to
    anything else than its stored messages hold (`_unheld`), and a name the latest of them
    gives their conversation that its document does not hold (`_unnamed`, read with the
    conversation's `legacy` turns and its document among the batch's `conversations`, by its
    id). A turn among `copies_gone` (`Deleted.turns`: a legacy turn of its recorded copy is
    missing) is never advised to lose its `dual_write` mark (`_unheld_said`)."""
    turns: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for document in documents:
        if (key := _turn(document)) is not None:
            turns.setdefault(key, []).append(document)
    if not turns:
        return {}
    cids = sorted({cid for cid, _ in turns})
    stored = full_texts.stored_messages(db, cids)
    found: dict[str, list[str]] = {}
    held: dict[str, dict[str, list[LegacyTurn]]] = {}
    # Only a copy no stored message of its turn in the conversation it names is written for.
    elsewhere = _filed_elsewhere(
        db,
        [
            d
            for (cid, turn_id), group in turns.items()
            for d in group
            if not _written_for(d, cid, _seqs(stored.get(cid, []), turn_id))
        ],
    )
    for (cid, turn_id), group in sorted(turns.items()):
        if moved := sorted({elsewhere[id(d)] for d in group if id(d) in elsewhere}):
            found.setdefault(cid, []).append(_refiled(turn_id, cid, moved))
            continue
        try:
            conversion = convert(group, rules=rules)
        except InvalidInput as exc:
            found.setdefault(cid, []).append(f"dual-written turn {turn_id!r}: {exc.message}")
            continue
        parsed = held.setdefault(cid, {})[turn_id] = parse_turns(group)
        messages = [m for m in stored.get(cid, []) if m.turn_id == turn_id]
        unheld = _unheld(parsed, conversion, messages, conversations.get(cid), rules.markers)
        if unheld:
            gone = (cid, turn_id) in copies_gone
            found.setdefault(cid, []).append(_unheld_said(turn_id, unheld, group, messages, gone))
    for cid, by_turn in held.items():
        if unnamed := _unnamed(legacy.get(cid, []), by_turn, conversations.get(cid)):
            found.setdefault(cid, []).append(unnamed)
    return found


def _unheld_said(
    turn_id: str,
    unheld: str,
    group: Sequence[Mapping[str, Any]],
    messages: Sequence[AgentMessage],
    gone: bool,
) -> str:
    """A held dual-written turn converting to other content than its stored messages hold,
    for a person, with the remedy: restore its messages or remove its `dual_write` mark, but
    for a turn a legacy turn of whose recorded copy is `gone` (`deleted` names it: a person
    deleted that exchange), whose mark removed would take the deletion for legacy content
    to accept while the new store served the deleted words."""
    said = f"the dual-written turn {turn_id!r} holds content its stored messages do not"
    if gone:
        return (
            f"{said} ({unheld}; a legacy turn of its recorded copy is gone, named apart): "
            "remove the messages named gone or put that legacy turn back, never its "
            "`dual_write` mark (the deleted words would stay served)"
        )
    return (
        f"{said} ({unheld}; {_likely_cause(group, messages)}): restore its messages, or "
        "remove its `dual_write` mark so `run` migrates it as a legacy turn"
    )


def _seqs(messages: Sequence[AgentMessage], turn_id: str) -> list[int]:
    """The `seq`s of a turn's stored messages."""
    return [m.seq or 0 for m in messages if m.turn_id == turn_id]


def _refiled(turn_id: str, cid: str, stored: Sequence[str]) -> str:
    """A dual-written turn filed under another conversation than its stored messages, for a
    person."""
    return (
        f"the dual-written turn {turn_id!r} is filed under {cid!r} while its stored messages "
        f"are in {', '.join(map(repr, stored))} (the legacy service re-filed it after a "
        "rollback?): file it back, or pop its messages through the store and remove its "
        "`dual_write` mark so `run` migrates it where it is filed now"
    )


def copy_naming(
    legacy: Sequence[LegacyTurn], copies: Sequence[LegacyTurn]
) -> tuple[LegacyTurn, str] | None:
    """The held dual-written copy that names its conversation, and the name as a conversation
    holds it (`LegacyTurn.shown_name`): the last turn whose name shows something (legacy or
    copy, `sort_turns`), when that is one of the `copies`; else None (the converter's own rule
    names it from the legacy turns)."""
    named = [t for t in sort_turns([*legacy, *copies]) if t.shown_name() is not None]
    if not named or not any(named[-1] is t for t in copies):
        return None
    return named[-1], named[-1].shown_name() or ""


def _unnamed(
    legacy: Sequence[LegacyTurn],
    held: Mapping[str, Sequence[LegacyTurn]],
    document: Mapping[str, Any] | None,
) -> str:
    """The name a held dual-written turn gives its conversation (the converter's: the last
    turn that has one, legacy or dual-written) that its document does not hold, for a
    person; "" when it holds it, when the last named turn is a legacy one (the run writes
    its name), when there is no document (the gate names that), or when a person renamed
    the conversation since (`name_source` "set": theirs, as a rerun keeps it)."""
    if document is None or (read := readable(document)).get("name_source") == "set":
        return ""
    found = copy_naming(legacy, [t for group in held.values() for t in group])
    if found is None or found[1] == read.get("name"):
        return ""
    turn, wanted = found
    turn_id = next(tid for tid, group in held.items() if any(t is turn for t in group))
    return (
        f"the dual-written turn {turn_id!r} names the conversation {wanted!r}, "
        f"its conversation document {read.get('name')!r} (the legacy service renamed it "
        "after a rollback?): rename it on the new service, or restore the turn's name"
    )


def _likely_cause(group: Sequence[Mapping[str, Any]], messages: Sequence[AgentMessage]) -> str:
    """Why a dual-written copy may not hold what its stored messages do, for a person: texts
    cut in the copy (to fit a legacy document, `CUT_FIELD`, or by the store, `truncated`),
    which the store keeps whole, as well as an edit since (by the old service after a
    rollback, or by hand: the words assume no rollback)."""
    edited = (
        "it was edited in the legacy collection since it was written (by the legacy service "
        "after a rollback, or by hand?)"
    )
    if any(CUT_FIELD in document for document in group) or any(m.truncated for m in messages):
        return (
            "its copy holds texts cut, which the store keeps whole (check that its stored "
            f"messages hold the turn, then remove the copy's mark), or {edited}"
        )
    return edited


def _unheld(
    turns: Sequence[LegacyTurn],
    conversion: LegacyConversion,
    messages: Sequence[AgentMessage],
    recorded: Mapping[str, Any] | None = None,
    markers: RuntimeContextMarkers = DEFAULT_MARKERS,
) -> str:
    """What a dual-written turn converts to that its stored messages do not hold, for a
    person; "" when they hold it all: its content (`_content_unheld`, whatever the copy
    records of itself: a copy holding texts cut, to fit or by the store, converts to those
    cut texts and is a difference, the gate erring on blocking the drop), its owner, its
    dates, its token usage and latency."""
    if differs := (
        _content_unheld(turns, conversion, messages, recorded, markers)
        or _owner(conversion, messages)
        or _dated(turns, messages)
    ):
        return differs
    for what, wanted, found in (
        ("token usage", _usage(conversion.messages), _usage(messages)),
        ("latency", _latency(conversion.messages), _latency(messages)),
    ):
        if wanted != found:
            return f"its {what} is {wanted}, its stored messages' {found}"
    return ""


def _content_unheld(
    turns: Sequence[LegacyTurn],
    conversion: LegacyConversion,
    messages: Sequence[AgentMessage],
    recorded: Mapping[str, Any] | None,
    markers: RuntimeContextMarkers,
) -> str:
    """The content a dual-written turn converts to that its stored messages do not hold, for
    a person; "" when they hold it all: its problems (any kind, placed or not, but the
    derived id of a conversation it names by its legacy id, and the derived owner of one it
    names by the legacy user id that derives the conversation's `recorded` owner), its
    transcript both ways (they may hold more only of results of an earlier turn's calls:
    `_removed`) and its `native` forms."""
    natives = [p for p in conversion.problems if _native(p)]
    problems = [
        p
        for p in conversion.problems
        if p.kind not in ("derived_conversation_id", DUAL_WRITE_NOT_EXACT)  # held: compared
        and not _derived_owner(p, recorded)
        and not _earlier_answer(p, messages)
        and not _native(p)
    ]
    if problems:
        kinds = ", ".join(sorted({p.kind for p in problems}))
        return f"it converts with problems: {kinds}"
    legacy = from_legacy_converted(turns, conversion, markers)
    transcript = from_messages(messages)
    if not contains(transcript, legacy):
        return "; ".join(transcript_differences(legacy, transcript)[:3])
    if removed := _removed(legacy, transcript) or _earlier_answers_gone(conversion, messages):
        return removed
    return _natives_differ(natives, messages)


def _removed(legacy: Transcript, stored: Transcript) -> str:
    """What the turn's stored messages hold that its copy no longer does, for a person; ""
    when nothing: the old service removed part of the copy after a rollback (a redaction, an
    exchange deleted) while the messages would go on being served. A result of an earlier
    turn's call is the one thing the stored messages hold more of (the copy converted alone
    names no call it answers)."""
    own = tuple(r for r in stored.results if not r.startswith(f"{NO_CALL} -> "))
    if stored.lines == legacy.lines and Counter(own) <= Counter(legacy.results):
        return ""
    missing = [line for line in stored.lines if line not in legacy.lines]
    missing += list((Counter(own) - Counter(legacy.results)).elements())
    shown = "; ".join(repr(line[:80]) for line in missing[:3]) or "their order"
    return f"its stored messages hold what the copy no longer does: {shown}"


def _earlier_answers_gone(conversion: LegacyConversion, messages: Sequence[AgentMessage]) -> str:
    """`_removed` for the results of an earlier turn's calls, which the copy converted alone
    holds as unplaced results: those its stored messages hold that the copy no longer does
    (a redacted result would go on being served), or hold fewer times than the copy, for a
    person; "" when both hold the same."""
    calls = {call.id for m in messages for call in m.tool_calls or ()}
    stored = Counter(
        (m.tool_call_id, m.content)
        for m in messages
        if m.role == "tool" and m.tool_call_id not in calls
    )
    kept = Counter(_answer(p) for p in conversion.problems if p.kind == "unplaced_tool_result")
    for said, more in (
        ("its stored messages hold results the copy no longer does", stored - kept),
        ("the copy holds results more times than its stored messages", kept - stored),
    ):
        if more:
            shown = "; ".join(repr((content or "")[:80]) for _, content in more.elements())
            return f"{said}: {shown}"
    return ""


def _derived_owner(problem: Problem, recorded: Mapping[str, Any] | None) -> bool:
    """Whether a problem is the owner derived from the legacy user id a copy names, which
    the conversation document records as its owner: the dual write names a derived owner by
    that legacy id (`legacy_user_id`), so the copy holds what its stored messages do."""
    content = problem.content if isinstance(problem.content, Mapping) else {}
    return (
        problem.kind == "invalid_user_id"
        and recorded is not None
        and content.get("stored_as") == recorded.get("user_id")
    )


def _owner(conversion: LegacyConversion, messages: Sequence[AgentMessage]) -> str:
    """Whether the user the turn names (the owner it converts to) is the one its stored
    messages carry, for a person; "" when it is, or when it names none (the converter takes
    the last user a conversation's turns name, and the copy of a turn logged before one
    assigned the conversation names none while its messages moved to the owner)."""
    owner = next((m.user_id for m in conversion.messages), None)
    found = sorted({m.user_id for m in messages if m.user_id is not None})
    if owner is None or found == [owner]:
        return ""
    return f"it names user {owner!r}, its stored messages {found or 'none'}"


def _dated(turns: Sequence[LegacyTurn], messages: Sequence[AgentMessage]) -> str:
    """Whether each document of the turn is dated as the stored message it opens with (the
    dual write dates it so), for a person; "" when it is: a copy re-dated after a rollback
    would put the turn elsewhere in its conversation than its stored messages are. A date is
    read as the converter reads it (`LegacyTurn.time`: a datetime, ISO text, epoch seconds or
    milliseconds, as a number or text); one it cannot read is the conversion's own problem."""
    stored = {to_utc_millis(m.created_at) for m in messages}
    for turn in turns:
        at = turn.time()
        if at is not None and to_utc_millis(at) not in stored:
            return f"it is dated {to_utc_millis(at).isoformat()}, none of its stored messages so"
    return ""


def _earlier_answer(problem: Problem, messages: Sequence[AgentMessage]) -> bool:
    """Whether a problem is a result answering an earlier turn's call (no call of the turn
    converted alone answers it) that a stored tool message of the turn holds: the dual write
    keeps such a result in the turn that logged it."""
    if problem.kind != "unplaced_tool_result":
        return False
    answer = _answer(problem)
    return any((m.tool_call_id, m.content) == answer for m in messages if m.role == "tool")


def _native(problem: Problem) -> bool:
    """Whether a problem is the copy's `native` forms (`NATIVE_FIELD`), which no legacy part
    holds: no difference while its stored messages hold them (`_natives_differ`)."""
    return problem.kind == "unread_field" and problem.field == NATIVE_FIELD


def _natives_differ(natives: Sequence[Problem], messages: Sequence[AgentMessage]) -> str:
    """Whether the copy's `native` forms (its `_native` problems) are not those its stored
    messages hold, for a person; "" when they are the same."""
    kept = Counter(
        json.dumps(form, sort_keys=True)
        for p in natives
        for form in (p.content if isinstance(p.content, list) else [p.content])
    )
    stored = Counter(
        json.dumps(m.native.model_dump(mode="json"), sort_keys=True)
        for m in messages
        if m.native is not None
    )
    if kept == stored:
        return ""
    return "its `native` forms are not those its stored messages hold"


def _answer(problem: Problem) -> tuple[str | None, str | None]:
    """The call id and result text of an unplaced result, as a stored tool message holds them."""
    part = normalize_part(problem.content)
    return part.tool_call_id, result_text(part)[0]


def _usage(messages: Sequence[AgentMessage]) -> tuple[int, int]:
    usage = [m.token_usage for m in messages if m.token_usage is not None]
    total = Usage.total((u.input_tokens for u in usage), (u.output_tokens for u in usage))
    return total.input_tokens, total.output_tokens


def _latency(messages: Sequence[AgentMessage]) -> int:
    return sum(m.latency_ms or 0 for m in messages)


@dataclass(frozen=True)
class Moves:
    """When the legacy turns were moved aside (`record_move`), as the state records them for
    an operator: the gate reads no time of a move to tell whether a live turn had a copy
    (`deleted` reads the dual write's record of each copy)."""

    first: datetime
    """The first move. `UNKNOWN` for a state recorded before the first move was."""
    last: datetime
    """The last move: an attempt's start (the first, or a second one after a rollback put
    them back)."""


UNKNOWN = datetime(1970, 1, 1, tzinfo=UTC)
"""The first move of a state that did not record it (`Moves.first`)."""


def record_move(db: Database[dict[str, Any]], held: Lease | None) -> None:
    """Record when the legacy turns were moved aside: the last move (`moved_at`), and the
    first (`first_moved_at`, kept)."""
    now = utc_now()
    state = db[STATE].find_one({"_id": STATE_ID}, {"moved_at": 1, "first_moved_at": 1}) or {}
    # Moved before the first move was recorded: unknown (`$min` keeps a first one recorded).
    first = UNKNOWN if "moved_at" in state and "first_moved_at" not in state else now
    update = {"$set": {"moved_at": now}, "$min": {"first_moved_at": first}}
    if held is None:
        db[STATE].update_one({"_id": STATE_ID}, update, upsert=True)
    else:
        held.write_state(update)  # only while the lock names this run


def moved_at(db: Database[dict[str, Any]]) -> Moves | None:
    """When the legacy turns were first and last moved aside (`record_move`); None before
    any run recorded a move."""
    state = db[STATE].find_one({"_id": STATE_ID}, {"moved_at": 1, "first_moved_at": 1}) or {}
    last, first = state.get("moved_at"), state.get("first_moved_at")
    if not isinstance(last, datetime):
        return None
    first = to_utc_millis(first) if isinstance(first, datetime) else UNKNOWN
    return Moves(first, to_utc_millis(last))


COPY_GONE = (
    "the dual-written copy of the live turn {turn_id!r} is gone from the legacy collection "
    "while its messages are stored (the legacy service deleted the turn after a rollback?): "
    "pop its messages through the store (`ConversationStore.pop_last_message`, which "
    "corrects the conversation's counts; a delete by hand leaves them counted), or put its "
    "copy back"
)
"""What the gate says of a live turn whose recorded copy is gone (`deleted`): every legacy
turn of it."""

COPY_GONE_WHOLE = (
    "the dual-written copy of the live turn {turn_id!r} is gone from the legacy collection "
    "while its messages are stored without a conversation document (the legacy service "
    "deleted the conversation after a rollback?): delete the conversation's messages of "
    "that turn, not put its document back, or put its copy back"
)
"""What the gate says of it when no conversation document stands under the id."""

COPY_UNCONFIRMED = (
    "the dual write recorded it would copy the live turn {turn_id!r} (record {record!r}) "
    "but not that it did, and no legacy turn of its copy is in the legacy collection: either "
    "its copy's write failed (the runtime was told the turn failed, yet its messages are "
    "stored and served) or the legacy service deleted it after a rollback. Ask whether the "
    "person deleted that exchange: if so pop its messages through the store; if not, keep "
    "that record (the legacy collection lacks a turn a rollback would lose) and run "
    "`run --copy-again {record}`, which writes the copy from the turn's stored messages and "
    "confirms the record"
)
"""What the gate says of a live turn whose record was never confirmed and whose copy is
missing: which it is nothing stored tells, so neither passes nor advises a deletion, nor
deleting the record (was: "delete that record and unset `copy_owed`", after which the gate
passed a turn served on the new service that a rollback lost)."""

PIECE_GONE = (
    "the dual-written copy of the messages at {seqs} of the live turn {turn_id!r} (one of "
    "the {count} legacy turns it was copied as) is gone from the legacy collection while "
    "they are stored (the legacy service deleted that exchange after a rollback?): remove "
    "those messages alone, no other of the turn (`ConversationStore.pop_last_message` while "
    "they are the conversation's last, which corrects its counts; a delete by hand leaves "
    "them counted), or put that legacy turn back"
)
"""What the gate says of a live turn copied as several legacy turns (`COPY_PIECES`) some,
not all, of which are gone: the messages each gone one held, never the whole turn."""

PIECE_GONE_WHOLE = (
    "the dual-written copy of the messages at {seqs} of the live turn {turn_id!r} (one of "
    "the {count} legacy turns it was copied as) is gone from the legacy collection while "
    "they are stored without a conversation document: delete the conversation's messages "
    "at {seqs} of that turn alone, not put its document back, or put that legacy turn back"
)
"""What the gate says of it when no conversation document stands under the id."""

PIECE_UNCONFIRMED = (
    "the dual write recorded it would copy the live turn {turn_id!r} (record {record!r}) "
    "but not that it did, and the legacy turn of it holding the messages at {seqs} (one of "
    "{count}) is not in the legacy collection: either its write failed (the runtime was told "
    "the turn failed, yet its messages are stored and served) or the legacy service deleted "
    "it after a rollback. Ask whether the person deleted that exchange: if so remove those "
    "messages alone; if not, keep that record (the legacy collection lacks an exchange a "
    "rollback would lose) and, the messages of any exchange the person did delete removed "
    "first, run `run --copy-again {record}`, which writes the legacy turns missing of the "
    "copy from the turn's stored messages and confirms the record"
)
"""What the gate says of a legacy turn missing of a copy whose record was never confirmed,
some other legacy turn of it standing: never advising to delete the record, which `run`
writes again from the copies standing, nor a deletion."""

COPY_OWED_UNRECORDED = (
    "the dual write owed a copy of the live turn {turn_id!r} (its messages are marked "
    "`copy_owed`) but recorded nothing of it and no copy is in the legacy collection: its "
    "first write, the record before the copy, failed, or the turn's own write failed after "
    "its messages were stored and the dual write never began (either way the runtime was "
    "told the turn failed, yet its messages are stored and served), so the legacy service "
    "never held that turn, "
    "and what a person did there after a rollback (deleted the conversation whole?) is not "
    "read from it. Ask the person: if the conversation or the exchange was deleted, pop its "
    "messages through the store (or delete the conversation), never put its document back; "
    "if not, keep `copy_owed` on the turn's messages (the legacy collection lacks a turn a "
    "rollback would lose) and run `run --copy-again {record}`, which writes the copy and "
    "its record from the turn's stored messages"
)
"""What the gate says of a live turn stored while the dual write was on (`COPY_OWED`) whose
copy was never recorded nor written: never read as logged with the dual write off, nor
advised to lose its mark when the person deleted nothing (was: "unset `copy_owed` on the
turn's messages", after which the gate passed a turn served on the new service that a
rollback lost); the record it names is the one the dual write would have written
(`copy_record_id`), which `run --copy-again` writes as `run` writes a record removed by
hand (`confirm_copies`)."""

COPY_RECORDS_READ = 1000
"""The most copy records one read asks for (`copied`), and live turns one chunk of
`deleted` reads."""


@dataclass
class Deleted:
    """What `deleted` finds."""

    said: dict[str, list[str]] = field(default_factory=dict)
    """What to tell a person, by conversation."""
    turns: set[tuple[str, str]] = field(default_factory=set)
    """The live turns (conversation id, turn id) said of: `differences` never advises
    removing the `dual_write` mark of their copies (`_unheld_said`)."""

    def add(self, cid: str, turn_id: str, said: list[str]) -> None:
        if said:
            self.said.setdefault(cid, []).extend(said)
            self.turns.add((cid, turn_id))


def deleted(
    db: Database[dict[str, Any]],
    *,
    source: str,
    conversations: Sequence[str] | None = None,
) -> Deleted:
    """The live turns stored (of these `conversations`, or of every conversation holding
    any, wherever it stands: one whose legacy turns the old service all deleted, one whose
    document a rollback moved away) that the dual write recorded copying (`copied`) whose
    copy, or a legacy turn of it, is not in `source` (where the legacy turns are,
    `relocate.turns_at`), while a message it held is stored, by the `_id` its record lists
    for each legacy turn of the copy (`COPY_PIECES`; a record listing none, written by an
    earlier release, the `_id` every dual write gives its first, `legacy_turn_id`; marked or
    not: a copy whose mark the operator removed is there), for a person, by conversation.
    A record confirmed (`COPY_WRITTEN`) whose copy is gone: the old service deleted it
    after a rollback (a person deleted the exchange, or the whole conversation), while the
    new store still serves it (`COPY_GONE`; one legacy turn of several gone, the messages
    it held alone, `PIECE_GONE`). A record only intended (`COPY_INTENDED`: the write after
    the copy failed) whose copy is missing may be either (`COPY_UNCONFIRMED`,
    `PIECE_UNCONFIRMED`); one whose copy stands passes. A turn with no record whose
    messages say the dual write owed it a copy (`COPY_OWED`, stored with them), no copy
    standing, is one whose every dual write failed (`COPY_OWED_UNRECORDED`: ask the person).
    Any other turn with no record is never one
    (logged with the dual write off: after the rollback window, before the first move, or
    by a writer without it; or copied by an earlier release, `unrecorded`), nor one of
    another `epoch` than its conversation's (a late insert of a conversation deleted under
    the id). Reads the live turns grouped with their `seq`s (one aggregation), then per
    `COPY_RECORDS_READ` of them their documents, records and copies (three reads)."""
    found = Deleted()
    turns = _stored_live_turns(db, conversations)
    while chunk := list(itertools.islice(turns, COPY_RECORDS_READ)):
        _gone(db, chunk, found, source=source)
    return found


_LiveTurn = tuple[str, str, str | None, list[int], bool]
"""(conversation id, turn id, epoch, the `seq`s of its stored messages, whether a message of
it is marked `COPY_OWED`)."""


def _stored_live_turns(
    db: Database[dict[str, Any]], conversations: Sequence[str] | None
) -> Iterator[_LiveTurn]:
    """Each live turn (not the migration's) whose messages are stored, with their `seq`s
    and whether a message of it is marked `COPY_OWED`, grouped by the server."""
    match: dict[str, Any] = {"turn_id": {"$type": "string", "$not": _MIGRATED}}
    if conversations is not None:
        match["conversation_id"] = {"$in": list(conversations)}
    grouped = db[MESSAGES].aggregate(
        [
            {"$match": match},
            {
                "$group": {
                    "_id": {"c": "$conversation_id", "t": "$turn_id", "e": "$epoch"},
                    "seqs": {"$push": "$seq"},
                    "owed": {"$max": f"${COPY_OWED}"},
                }
            },
            {"$sort": {"_id.c": 1, "_id.t": 1}},
        ],
        allowDiskUse=True,
    )
    for group in grouped:
        key = group["_id"]
        if isinstance(key.get("c"), str) and not is_migrated(key.get("t")):
            seqs = [s for s in group.get("seqs") or [] if isinstance(s, int)]
            yield key["c"], key["t"], key.get("e"), seqs, group.get("owed") is True


_MIGRATED = {"$regex": f"^{re.escape(MIGRATED_TURN_PREFIX)}"}


def _gone(
    db: Database[dict[str, Any]], turns: Sequence[_LiveTurn], found: Deleted, *, source: str
) -> None:
    """`deleted` for one chunk of live turns, added to `found`: each of the epoch of its
    conversation's document (of the epoch its messages carry when none stands under the
    id)."""
    documents, records = _records_of(db, turns)
    query = {"_id": {"$in": sorted(records)}, "kind": COPY_RECORD}
    read = sorted(
        db[STATE].find(query, {COPY_STATE: 1, COPY_PIECES: 1}),
        key=lambda d: records[d["_id"]][:2],
    )
    pieces = {d["_id"]: _recorded_pieces(d, *records[d["_id"]][:2]) for d in read}
    recorded = {records[d["_id"]][:2] for d in read}
    owed = _owed_unrecorded(turns, {r[:2] for r in records.values()} - recorded)
    owed_ids = {legacy_turn_id(cid, turn_id): (cid, turn_id) for cid, turn_id in owed}
    record_ids = {records[r][:2]: r for r in records}
    ids = sorted({piece[0] for listed in pieces.values() for piece in listed} | set(owed_ids))
    there = {d["_id"] for d in db[source].find({"_id": {"$in": ids}}, {"_id": 1})}
    for record in read:
        cid, turn_id, seqs = records[record["_id"]]
        missing = [piece for piece in pieces[record["_id"]] if piece[0] not in there]
        if missing:
            listed = len(pieces[record["_id"]])
            found.add(cid, turn_id, _said(record, turn_id, missing, listed, seqs, cid in documents))
    for legacy_id, (cid, turn_id) in sorted(owed_ids.items(), key=lambda item: item[1]):
        if legacy_id not in there:
            said = COPY_OWED_UNRECORDED.format(turn_id=turn_id, record=record_ids[cid, turn_id])
            found.add(cid, turn_id, [said])


def _records_of(
    db: Database[dict[str, Any]], turns: Sequence[_LiveTurn]
) -> tuple[dict[str, dict[str, Any]], dict[str, tuple[str, str, list[int]]]]:
    """The documents standing under the ids of these live turns' conversations (one read),
    and the `_id` of the record of each turn's copy (`copy_record_id`, in the `epoch` of its
    conversation's document, of the epoch its messages carry when none stands under the
    id), with its conversation id, turn id and the `seq`s of its messages."""
    cids = sorted({cid for cid, *_ in turns})
    query = {"_id": {"$in": cids}, **CONVERSATION_FILTER}
    documents = {d["_id"]: d for d in db[CONVERSATIONS].find(query, {"epoch": 1})}
    records: dict[str, tuple[str, str, list[int]]] = {}
    for cid, turn_id, epoch, seqs, _ in turns:
        life = documents[cid].get("epoch") if cid in documents else epoch
        if epoch in (None, life):
            record_id = copy_record_id(cid, turn_id, life)
            records.setdefault(record_id, (cid, turn_id, []))[2].extend(seqs)
    return documents, records


_Piece = tuple[str, int | None, int | None]
"""A legacy turn a copy's record lists: its `_id`, the first and last `seq` it holds (None:
the whole turn)."""


def _recorded_pieces(record: Mapping[str, Any], cid: str, turn_id: str) -> list[_Piece]:
    """The legacy turns a copy's record lists (`COPY_PIECES`), or, for one listing none (an
    earlier release's, or one `confirm_copies` wrote again), the first alone, by the `_id`
    every dual write gives it, for the whole turn."""
    pieces: list[_Piece] = []
    for piece in _listed(record):
        seqs = piece.get("seqs")
        bounded = isinstance(seqs, list) and len(seqs) == 2 and all(type(s) is int for s in seqs)
        first, last = (seqs[0], seqs[1]) if bounded else (None, None)  # type: ignore[index]
        pieces.append((piece["_id"], first, last))
    return pieces or [(legacy_turn_id(cid, turn_id), None, None)]


def _listed(record: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The legacy turns a copy's record lists (`COPY_PIECES`) that name an `_id`."""
    listed = record.get(COPY_PIECES)
    if not isinstance(listed, list):
        return []
    return [p for p in listed if isinstance(p, Mapping) and isinstance(p.get("_id"), str)]


def _said(
    record: Mapping[str, Any],
    turn_id: str,
    missing: Sequence[_Piece],
    listed: int,
    seqs: Sequence[int],
    standing: bool,
) -> list[str]:
    """What the gate says of the `missing` legacy turns of a copy whose `record` lists
    `listed` (its turn's messages stored at `seqs`, its conversation's document `standing`
    or not): the whole turn when every one is missing; else each missing one holding a
    message still stored (one whose messages were all popped is no longer served), by the
    `seq`s of those messages, never the rest of the turn."""
    intended = record.get(COPY_STATE) == COPY_INTENDED
    if len(missing) == listed:
        if intended:
            return [COPY_UNCONFIRMED.format(turn_id=turn_id, record=record["_id"])]
        return [(COPY_GONE if standing else COPY_GONE_WHOLE).format(turn_id=turn_id)]
    said: list[str] = []
    for _, first, last in missing:
        held = sorted(s for s in seqs if first is None or last is None or first <= s <= last)
        if not held:
            continue
        named = f"seq {held[0]}" if held[0] == held[-1] else f"seq {held[0]}-{held[-1]}"
        template = PIECE_GONE if standing else PIECE_GONE_WHOLE
        template = PIECE_UNCONFIRMED if intended else template
        said.append(
            template.format(turn_id=turn_id, record=record["_id"], seqs=named, count=listed)
        )
    return said


def _owed_unrecorded(
    turns: Sequence[_LiveTurn], unrecorded: set[tuple[str, str]]
) -> list[tuple[str, str]]:
    """Of the live turns of their conversation's epoch that no copy record names
    (`unrecorded`: conversation id, turn id), those whose messages say the dual write owed
    them a copy (`COPY_OWED`, stored by the insert that stored them): the record written
    before the copy failed, so nothing but the mark tells them from turns logged with the
    dual write off."""
    return [
        (cid, turn_id)
        for cid, turn_id, _, _, owed in turns
        if owed and (cid, turn_id) in unrecorded
    ]


def confirm_copies(
    db: Database[dict[str, Any]], *, source: str, copy_again: Collection[str] = ()
) -> int:
    """Confirm the record of each dual-written copy standing in `source` that names one
    (`RECORD_FIELD`) still only intended (`COPY_INTENDED`: the write after the copy failed)
    or missing (removed by hand), so that once the old service deletes it the gate calls it
    gone (`COPY_GONE`) rather than unconfirmed or unrecorded; how many. A record listing
    legacy turns of the copy (`COPY_PIECES`) is confirmed only when every one stands (one
    missing may be one whose write failed: the gate asks, `PIECE_UNCONFIRMED`). A record
    missing is written again listing the legacy turns its turn's stored messages were copied
    as (`_written_as`: cut where a legacy turn of it standing opens too), never without
    them, and stays intended while one of them is missing. The records named in
    `copy_again` (only intended, or missing while their turn's messages are marked
    `COPY_OWED`: `COPY_OWED_UNRECORDED`, written first as one removed by hand is; the person
    deleted no exchange of the turn) first get the legacy turns they list that are missing
    written from the turn's stored messages, cut as the record lists them (`_copy_again`), a
    copy none of which stands too (its turn found by its stored messages, `_turns_recorded`:
    one aggregation). `run` does it: one read of
    the copies naming a record, one of those records, one write when any is left; for a
    record missing or copied again, one read of its turn's stored messages and one of its
    conversation's document."""
    standing, turns = _standing_copies(db, source)
    if not standing and not copy_again:
        return 0
    query = {"_id": {"$in": sorted({*standing, *copy_again})}, "kind": COPY_RECORD}
    records = {d["_id"]: d for d in db[STATE].find(query, {COPY_STATE: 1, COPY_PIECES: 1})}
    _refuse_copying_again(copy_again, records)
    unrecorded = {r for r in copy_again if r not in records}
    turns |= _turns_recorded(db, [r for r in copy_again if r not in turns], unrecorded)
    wanted = {
        r: turns[r]
        for r in {*standing, *copy_again}
        if r in turns and (r not in records or r in copy_again)
    }
    expected = _expected_pieces(db, wanted, records, standing, copy_again, source=source)
    for record_id, (_, written) in expected.items():
        standing.setdefault(record_id, set()).update(written)
    updates = {
        record_id: update
        for record_id in sorted(standing)
        if (
            update := _confirmation(
                records.get(record_id), standing[record_id], expected.get(record_id)
            )
        )
    }
    if updates:
        db[STATE].bulk_write(
            [
                UpdateOne(
                    {"_id": r}, {"$set": u, "$setOnInsert": {"kind": COPY_RECORD}}, upsert=True
                )
                for r, u in updates.items()
            ],
            ordered=False,
        )
    return sum(1 for u in updates.values() if u[COPY_STATE] == COPY_WRITTEN)


def _standing_copies(
    db: Database[dict[str, Any]], source: str
) -> tuple[dict[str, set[Any]], dict[str, tuple[str, str]]]:
    """The `_id`s of the dual-written copies standing in `source` by the record each names
    (`RECORD_FIELD`), and the turn (conversation id, turn id) of each such record: one
    read."""
    standing: dict[str, set[Any]] = {}
    turns: dict[str, tuple[str, str]] = {}
    for copy in db[source].find(_NAMING_A_RECORD, _COPY_FIELDS):
        standing.setdefault(copy[RECORD_FIELD], set()).add(copy["_id"])
        if (key := _turn(copy)) is not None:
            turns[copy[RECORD_FIELD]] = key
    return standing, turns


_COPY_FIELDS = {RECORD_FIELD: 1, "conversation_id": 1, "turn_id": 1, "dual_write": 1}

_Expected = tuple[list[dict[str, Any]], set[Any]]
"""The legacy turns a turn's stored messages are copied as (`COPY_PIECES`), and the `_id`s of
those `_copy_again` wrote."""


def _confirmation(
    record: Mapping[str, Any] | None, standing: Collection[Any], expected: _Expected | None
) -> dict[str, Any] | None:
    """What `confirm_copies` sets on a copy's record, the legacy turns of the copy `standing`
    (by `_id`): a record missing is written again listing the legacy turns its turn is
    copied as (`expected`; those standing when its messages are not stored), confirmed when
    every one stands, else intended; one only intended is confirmed once every legacy turn
    it lists stands; None for any other."""
    if record is None:
        pieces = expected[0] if expected and expected[0] else [{"_id": i} for i in sorted(standing)]
        whole = all(piece["_id"] in standing for piece in pieces)
        return {COPY_STATE: COPY_WRITTEN if whole else COPY_INTENDED, COPY_PIECES: pieces}
    if record.get(COPY_STATE) != COPY_INTENDED:
        return None
    if not all(piece["_id"] in standing for piece in _listed(record)):
        return None
    return {COPY_STATE: COPY_WRITTEN}


def _refuse_copying_again(copy_again: Collection[str], records: Mapping[str, Any]) -> None:
    """Misuse when a record named to copy again is not one of a copy only intended
    (`PIECE_UNCONFIRMED`'s, `COPY_UNCONFIRMED`'s) nor missing (`COPY_OWED_UNRECORDED`'s,
    which `_turns_recorded` checks the turn of): no other is the gate's question."""
    for record_id in copy_again:
        if record_id in records and records[record_id].get(COPY_STATE) != COPY_INTENDED:
            raise Misuse(
                f"{record_id!r} is no record of a copy only intended (the gate names such a "
                "record when its copy, or a legacy turn of it, is missing)"
            )


def _turns_recorded(
    db: Database[dict[str, Any]], wanted: Collection[str], unrecorded: Collection[str]
) -> dict[str, tuple[str, str]]:
    """The live turn (conversation id, turn id) whose copy each record in `wanted` (by
    `_id`) is the record of, found by its stored messages (`_stored_live_turns`, records
    by `_records_of`): a record names no turn, and no legacy turn of such a copy stands to
    name it. Misuse for one whose turn's messages are no longer stored (nothing is left to
    copy), and for one of the records `unrecorded` (missing) whose turn's messages are not
    marked `COPY_OWED` (logged with the dual write off: no copy was owed). Reads nothing
    when none is wanted."""
    found: dict[str, tuple[str, str]] = {}
    if not wanted:
        return found
    owed: set[tuple[str, str]] = set()
    turns = _stored_live_turns(db, None)
    while len(found) < len(wanted) and (chunk := list(itertools.islice(turns, COPY_RECORDS_READ))):
        _, records = _records_of(db, chunk)
        found |= {r: records[r][:2] for r in wanted if r in records}
        owed |= {(cid, turn_id) for cid, turn_id, *_, marked in chunk if marked}
    for record_id in wanted:
        if record_id not in found:
            raise Misuse(
                f"{record_id!r} cannot be copied again: no message of its turn is stored "
                "(nothing is left to copy)"
            )
        if record_id in unrecorded and found[record_id] not in owed:
            raise Misuse(
                f"{record_id!r} is no record of a copy and its turn's messages are not marked "
                "`copy_owed`: the dual write owed it no copy"
            )
    return found


def _expected_pieces(
    db: Database[dict[str, Any]],
    wanted: Mapping[str, tuple[str, str]],
    records: Mapping[str, Mapping[str, Any]],
    standing: Mapping[str, Collection[Any]],
    copy_again: Collection[str],
    *,
    source: str,
) -> dict[str, _Expected]:
    """For each record (by id) of a turn `wanted` (conversation id, turn id): the legacy
    turns it lists, or, missing, those its stored messages were copied as (`_written_as`;
    none when no message is stored); for one named to `copy_again` (an intended one, or a
    missing one whose turn was owed a copy, `COPY_OWED_UNRECORDED`: the same mechanism),
    those of them `_copy_again` wrote. One read of the turns' stored messages and one of
    their conversations' documents; none when none is wanted."""
    if not wanted:
        return {}
    cids = sorted({cid for cid, _ in wanted.values()})
    stored = full_texts.stored_messages(db, cids)
    query = {"_id": {"$in": cids}, **CONVERSATION_FILTER}
    documents = {d["_id"]: _conversation(d) for d in db[CONVERSATIONS].find(query)}
    found: dict[str, _Expected] = {}
    for record_id, (cid, turn_id) in sorted(wanted.items()):
        messages = [m for m in stored.get(cid, []) if m.turn_id == turn_id]
        conversation = documents.get(cid)
        ids = standing.get(record_id, set())
        listed = (
            _listed(records[record_id])
            if record_id in records
            else _written_as(cid, turn_id, messages, conversation, ids)
        )
        if record_id not in copy_again:
            found[record_id] = ([dict(piece) for piece in listed], set())
            continue
        if conversation is None or not messages:
            raise Misuse(
                f"{record_id!r} cannot be copied again: its turn's messages or its "
                "conversation's document are no longer stored (nothing is left to copy)"
            )
        written = _copy_again(db, conversation, turn_id, messages, record_id, listed, ids, source)
        found[record_id] = ([dict(piece) for piece in listed], written)
    return found


def _written_as(
    cid: str,
    turn_id: str,
    messages: Sequence[AgentMessage],
    conversation: Conversation | None,
    standing: Collection[Any],
) -> list[dict[str, Any]]:
    """The legacy turns a turn whose copy's record is missing was copied as: as the dual
    write cuts it, and cut too where a legacy turn of it `standing` (by `_id`) opens that
    this cut opens none at (`piece_starts`: a fork's copy, cut where the turns of its
    original began, which the fork's document no longer says once a second attempt wrote
    it again; was: cut at user messages alone, so a record written again listed an exchange
    in none of its legacy turns, and the gate advised removing the `dual_write` mark of a
    copy whose exchange the person deleted). None when no message is stored."""
    if not messages:
        return []

    def cut(starts: Collection[int]) -> list[dict[str, Any]]:
        if conversation is None:
            return copy_pieces(cid, turn_id, messages, starts=starts)
        return turn_copy_pieces(conversation, turn_id, messages, starts=starts)

    pieces = cut(())
    opened = {piece["seqs"][0] for piece in pieces}
    seqs = [m.seq for m in messages if m.seq is not None]
    more = piece_starts(cid, turn_id, seqs, standing) - opened
    return cut(more) if more else pieces


def _conversation(document: Mapping[str, Any]) -> Conversation | None:
    """A stored conversation document as the store's model (`readable`); None when even so
    it is none."""
    try:
        return Conversation.model_validate(readable(document))
    except ValidationError:
        return None


def _copy_again(
    db: Database[dict[str, Any]],
    conversation: Conversation,
    turn_id: str,
    messages: Sequence[AgentMessage],
    record_id: str,
    listed: Sequence[Mapping[str, Any]],
    standing: Collection[Any],
    source: str,
) -> set[Any]:
    """Write into `source` the legacy turns of a turn's copy its record lists (`listed`)
    that are missing, from its stored messages, cut as the record lists them (`turn_copy`,
    each fitting one legacy document, naming its record), never replacing one standing
    (by `_id`, among `standing`, read again): the `_id`s written. WorkLeft when a legacy turn
    it lists holding a message still stored is missing even so (the record does not say how
    its copy was cut: an earlier release's)."""
    documents = turn_copy(
        conversation, turn_id, messages, MAX_LEGACY_DOCUMENT_BYTES, listed=listed or None
    )
    owed = {piece["_id"] for piece in listed} or {d["_id"] for d in documents}
    ids = sorted(owed)
    there = {d["_id"] for d in db[source].find({"_id": {"$in": ids}}, {"_id": 1})}
    missing = [
        d | {RECORD_FIELD: record_id}
        for d in documents
        if d["_id"] in owed and d["_id"] not in there | set(standing)
    ]
    if missing:
        db[source].insert_many(missing, ordered=False)
    written = {d["_id"] for d in missing}
    held = {d["_id"] for d in documents} if not listed else _holding(listed, messages)
    if left := sorted(held - there - written - set(standing)):
        raise WorkLeft(
            f"{record_id!r}: {len(left)} legacy turn(s) its record lists are still missing "
            "after copying again (the record does not say which messages they held); the "
            "record stays intended"
        )
    return written


def _holding(listed: Sequence[Mapping[str, Any]], messages: Sequence[AgentMessage]) -> set[Any]:
    """The `_id`s of the legacy turns a copy's record lists that hold a message still stored
    (by the first and last `seq` each lists; one listing none holds the whole turn)."""
    seqs = [m.seq for m in messages if m.seq is not None]
    held: set[Any] = set()
    for piece in listed:
        bounds = piece.get("seqs")
        bounded = isinstance(bounds, list) and len(bounds) == 2
        if not bounded or any(bounds[0] <= s <= bounds[1] for s in seqs):  # type: ignore[index]
            held.add(piece["_id"])
    return held


_NAMING_A_RECORD = {"dual_write": True, RECORD_FIELD: {"$type": "string"}}


UNRECORDED = (
    "its dual-written copies recorded nothing ({count} of them), so their deletion by the "
    "old service cannot be checked: written before this release recorded copies (upgrade "
    "before turning the dual write on; the gate checks the copies written since)"
)
"""What `verify` and `finish` say of a conversation holding copies with no record (`unrecorded`)."""


def unrecorded(db: Database[dict[str, Any]], *, source: str) -> dict[str, int]:
    """The conversations (by the id they are stored under) holding dual-written copies in
    `source` (`dual_write: true`) whose writing the dual write did not record (`copied`, in
    the `epoch` of the conversation document standing under the id), with how many: an
    earlier release recorded none, so `deleted` cannot tell the old service deleted one of
    its copies. Said, never work left. Reads every copy's ids (one query on `dual_write`),
    the conversations' epochs (one), the records (one per `COPY_RECORDS_READ`)."""
    fields = {"conversation_id": 1, "turn_id": 1, "dual_write": 1}
    copies = {key for d in db[source].find({"dual_write": True}, fields) if (key := _turn(d))}
    if not copies:
        return {}
    cids = sorted({cid for cid, _ in copies})
    query = {"_id": {"$in": cids}, **CONVERSATION_FILTER}
    conversations = {d["_id"]: d for d in db[CONVERSATIONS].find(query, {"epoch": 1})}
    standing = sorted((cid, t) for cid, t in copies if cid in conversations)
    left = Counter(cid for cid, _ in set(standing) - set(copied(db, standing, conversations)))
    return dict(sorted(left.items()))


def copied(
    db: Database[dict[str, Any]],
    turns: Sequence[tuple[str, str]],
    conversations: Mapping[str, Mapping[str, Any]],
) -> list[tuple[str, str]]:
    """Of these live turns (conversation id, turn id), those the dual write recorded copying
    (`COPY_RECORD`, by `copy_record_id` in their conversation document's `epoch`, among
    `conversations`): one read per `COPY_RECORDS_READ` turns, none when there are none."""
    found: list[tuple[str, str]] = []
    for start in range(0, len(turns), COPY_RECORDS_READ):
        chunk = turns[start : start + COPY_RECORDS_READ]
        ids = {
            copy_record_id(cid, turn_id, conversations.get(cid, {}).get("epoch")): (cid, turn_id)
            for cid, turn_id in chunk
        }
        query = {"_id": {"$in": sorted(ids)}, "kind": COPY_RECORD}
        found += [ids[d["_id"]] for d in db[STATE].find(query, {"_id": 1})]
    return found
