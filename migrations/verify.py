"""Step 3 of the protocol: compare every (or a sample of) migrated conversation with its
legacy turns, as canonical transcripts.

The new side is read with cut fields put back whole from GridFS, so a whole
text that is missing or altered is a difference; a message a person popped since the run
(its document lists it) is the person's change, read as the run stored it. A conversation logged to
live before its migration (its legacy turns were not merged) matches when its
live messages hold the legacy transcript in order. What a conversation's legacy turns hold
that no message does is left out of the comparison: it must be recorded as a problem, each
record holding what the conversion finds now (`problems.held`), or the conversation differs.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pymongo.database import Database

from agent_store.core import AgentMessage
from agent_store.legacy import DUAL_WRITE_NOT_EXACT
from agent_store.store import (
    CONVERSATIONS,
    MIGRATED_TURN_PREFIX,
    MIGRATING,
    TurnRules,
    of_epoch,
    with_texts,
)
from migrations import dual_writes, full_texts
from migrations import problems as problem_report
from migrations.explode import batches, conversation_ids, convert_batch, undated_time
from migrations.relocate import CONVERSATION_FILTER, held_back, turns_at
from migrations.settings import SERVICE_DEFAULTS
from migrations.transcript import differences, from_legacy_converted, from_messages, not_held
from migrations.writes import (
    ALREADY_LIVE,
    CHANGED_SINCE,
    STOPPED_WHILE_WRITING,
    Converted,
    owner_after,
    popped,
    readable,
)


@dataclass
class Verification:
    conversations: int = 0
    matched: int = 0
    unplaced: int = 0
    """Legacy parts left out on purpose: the migration recorded them as problems."""
    differences: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.differences


_DOCUMENT_READ = {
    "popped_messages": 1,
    "epoch": 1,
    "turns": 1,
    "pops": 1,
    "name": 1,
    "name_source": 1,
    "name_message_id": 1,
    "user_id": 1,
    MIGRATING: 1,
}
"""What `verify` reads of a conversation document: its pops, its owner (`owner_differences`),
whether a run left it marked as being migrated (`STOPPED_WHILE_WRITING`), the message its
automatic name is taken from (`name_reasons`), and what the
checks of its held dual-written turns read (`dual_writes.differences`, `dual_writes.deleted`)."""


def sample(ids: Iterator[Any], size: int, seed: int) -> list[Any]:
    """A uniform sample of a stream of unknown length, in memory of `size` (reservoir)."""
    chosen: list[Any] = []
    rng = random.Random(seed)
    for n, item in enumerate(ids):
        if n < size:
            chosen.append(item)
        elif (j := rng.randint(0, n)) < size:
            chosen[j] = item
    return sorted(chosen, key=str)


def compare(item: Converted, stored: list[AgentMessage], popped: Collection[str] = ()) -> list[str]:
    """How a conversation's stored messages differ from its legacy turns (none: it matches).
    The messages a person popped since the run (`popped`, `writes.popped`) are the person's
    change: they are read as the run stored them, the conversion's."""
    conversion = item.conversion
    texts = {f.blob_id: f.text for f in conversion.full_texts}
    back = [with_texts(m, texts) for m in conversion.messages if str(m.id) in popped]
    if back:
        stored = sorted([*stored, *back], key=lambda m: m.seq or 0)
    migrated = [m for m in stored if (m.turn_id or "").startswith(MIGRATED_TURN_PREFIX)]
    if migrated or not stored:
        legacy = from_legacy_converted(item.turns, conversion, item.markers)
        found = differences(legacy, from_messages(migrated))
        return found + misdated(conversion.messages, migrated)
    # Logged to live where its legacy turns go: they were not merged.
    unheld = not_held(stored, item.turns, conversion, item.markers)
    if not unheld:
        return []
    cid = conversion.conversation_id
    if item.copies:  # the new service's (`migrated_to`): a legacy turn added since
        how = (
            "the new service logged to it during the transition, and its legacy turns convert "
            "to messages its live ones do not hold (a turn the old service logged after a "
            f"rollback?): they are not merged ({CHANGED_SINCE}"
        )
    else:
        how = (
            "logged to live before its migration, and its live messages do not hold its "
            f"legacy turns ({ALREADY_LIVE}"
        )
    return [
        f"{how}: `run` keeps them in that problem; once they are kept elsewhere, "
        f"`finish --accept {cid}`): " + "; ".join(unheld[:5])
    ]


def of_its_life(
    found: Mapping[str, Any] | None, stored: Sequence[AgentMessage]
) -> list[AgentMessage]:
    """The stored messages the store serves as the conversation's: those of the life of its
    document `found`, as the store's reads filter them (`of_epoch`: its `epoch`, and those
    stored before epochs, the migration's own among them); every one where no document
    stands (which is named apart)."""
    if found is None:
        return list(stored)
    epochs = [{"epoch": epoch} for epoch in {m.epoch for m in stored}]
    served = {d["epoch"] for d in of_epoch(epochs, found.get("epoch"))}
    return [m for m in stored if m.epoch in served]


SHOWN_UNSERVED = 5
"""How many of a conversation's migrated messages its reads leave out `unserved` names."""


def unserved(
    item: Converted, found: Mapping[str, Any] | None, stored: Sequence[AgentMessage]
) -> list[str]:
    """The migration's messages stored under the conversation that the store serves as none
    of its own (`of_its_life`): carrying another `epoch` than its document's, every read
    takes them for another life's under the id (as it takes a deleted conversation's late
    insert) and leaves them out, so its transcript lacks them however whole their content
    is. A run writes them again as the migration's, carrying none
    (`writes.served_as_written`)."""
    served = {str(m.id) for m in of_its_life(found, stored)}
    ids = {str(m.id) for m in item.conversion.messages}
    hidden = [m for m in stored if str(m.id) in ids and str(m.id) not in served]
    if not hidden:
        return []
    shown = ", ".join(f"{m.id} (seq {m.seq}, epoch {m.epoch!r})" for m in hidden[:SHOWN_UNSERVED])
    more = ", …" if len(hidden) > SHOWN_UNSERVED else ""
    epoch = (found or {}).get("epoch")
    return [
        f"{len(hidden)} of its migrated messages carry another epoch than its conversation "
        f"document's, {epoch!r}, so the store serves them as another life's, never as this "
        f"conversation's: {shown}{more}; run the migration again, which writes them again as "
        "the migration's (carrying none)"
    ]


def owner_differences(
    item: Converted, found: dict[str, Any] | None, stored: Sequence[AgentMessage]
) -> list[str]:
    """Who may read the conversation: whether its document is stored, and it and the
    migration's messages name the owner its legacy turns do now (`owner_after`: a document a
    live turn or a person wrote to since keeps its owner, which the messages follow). A
    conversation its legacy turns make no document of is not asked."""
    conversation = item.conversion.conversation
    if conversation is None:
        return []
    if found is None:
        return ["no conversation document (deleted since the run?): run the migration again"]
    if found.get(MIGRATING) is not None:  # the service still answers it from legacy turns
        return [STOPPED_WHILE_WRITING]
    owner = owner_after(found, conversation)
    stored_owner = readable(found).get("user_id")
    found_else = []
    if stored_owner != owner:
        found_else.append(
            f"its conversation document names the owner {stored_owner!r}, its legacy turns "
            f"{owner!r} (an account claim or an owner corrected since the run?): run the "
            "migration again"
        )
    ids = {str(m.id) for m in item.conversion.messages}
    others = sum(1 for m in stored if str(m.id) in ids and m.user_id != owner)
    if others:
        found_else.append(
            f"{others} of its messages name another owner than {owner!r}, whom its legacy "
            "turns and its conversation document name: run the migration again"
        )
    return found_else


def name_reasons(found: Mapping[str, Any] | None, messages: Sequence[AgentMessage]) -> list[str]:
    """An automatic name (`name_source` "auto") whose message (`name_message_id`) is not
    stored: words of a message removed since (an erased user's, a turn moved out) that the
    store would not take its name from, for a person; none otherwise."""
    by = (found or {}).get("name_message_id")
    if (found or {}).get("name_source") != "auto" or by is None:
        return []
    if any(str(m.id) == str(by) for m in messages):
        return []
    return [
        f"its automatic name is taken from the message {by!r}, which is not stored (removed "
        "since: an erased user's, a turn moved out): run the migration again, which retakes "
        "it, or rename the conversation on the new service"
    ]


def misdated(wanted: Collection[AgentMessage], stored: Collection[AgentMessage]) -> list[str]:
    """The stored messages dated otherwise than their legacy turns convert to now: a time
    misread (an offset or AM/PM ignored) is a difference, even where the order it gave
    happens to hold."""
    times = {str(m.id): m.created_at for m in wanted}
    return [
        f"message {m.id} (seq {m.seq}) is dated {m.created_at.isoformat()}, its legacy turn "
        f"{times[str(m.id)].isoformat()}"
        for m in stored
        if str(m.id) in times and m.created_at != times[str(m.id)]
    ]


def unrecorded(item: Converted, records: Sequence[dict[str, Any]]) -> list[str]:
    """Whether every problem the conversation's legacy turns convert to now is recorded as it
    is found: the content the comparison leaves out is kept there, and nowhere else."""
    problems = item.conversion.problems
    found = Counter(problem_report.digest(p) for p in problems)
    missing = found - problem_report.held(records, problems)
    if not missing:
        return []
    kinds = sorted({p.kind for p in problems if problem_report.digest(p) in missing})
    return [
        f"{missing.total()} problems its legacy turns convert to ({', '.join(kinds)}) are not "
        f"recorded in {problem_report.PROBLEMS} as they are now (new, edited after the run, a "
        "problem record edited by hand, or the content a problem keeps in GridFS missing or "
        "damaged): run the migration again"
    ]


def not_exact(item: Converted, accepted: Collection[str]) -> list[str]:
    """The dual-written turns converted without their live messages into other messages
    than those (`dual_write_not_exact`), unless an operator accepted them (by digest): the
    messages stored are the conversion's, so only their problem tells."""
    problems = [
        p
        for p in item.conversion.problems
        if p.kind == DUAL_WRITE_NOT_EXACT and problem_report.digest(p) not in accepted
    ]
    return [
        f"{p.detail} ({DUAL_WRITE_NOT_EXACT}, legacy turn {p.legacy_id!r}): check them against "
        f"the live service's, restore what differs, then `finish --accept "
        f"{p.conversation_id}`"
        for p in problems
    ]


def verify(
    db: Database[dict[str, Any]],
    *,
    conversation: str | None = None,
    sample_size: int | None = None,
    seed: int = 0,
    batch_size: int = 100,
    undated_at: datetime | None = None,
    on_batch: Callable[[int], None] | None = None,
    rules: TurnRules = SERVICE_DEFAULTS,
) -> Verification:
    """Compare the conversations (one, a sample, or all) with their legacy turns, converted
    as a run converts them (`undated_at`: the time of conversations without any readable
    time, `explode.undated_time`, so their problems read as recorded), read where they are
    (`relocate.turns_at`), by `rules` (the service's: `migrations.settings`)."""
    result = Verification()
    source = turns_at(db)
    ids: Iterator[Any]
    chosen: list[Any] | None = None
    if conversation is not None:
        chosen = [conversation]
    elif sample_size is not None:
        chosen = list(sample(conversation_ids(db, source=source), sample_size, seed))
    ids = iter(chosen) if chosen is not None else conversation_ids(db, source=source)
    if undated_at is None:  # the run's time for undated conversations
        undated_at = undated_time(db, record=False)
    read = (problem_report.accepted(db), held_back(db))
    # Copies gone of every conversation holding live turns (of those chosen, if any): one
    # the old service deleted whole is listed by no legacy turn, only by its records.
    named = None if chosen is None else [c for c in chosen if isinstance(c, str)]
    gone = dual_writes.deleted(db, source=source, conversations=named)
    for batch in batches(ids, batch_size):
        _verify_batch(db, result, batch, undated_at, read, gone, source=source, rules=rules)
        if on_batch is not None:
            on_batch(len(batch))
    for conversation_id, found in gone.said.items():  # listed by no legacy turn, or not compared
        result.conversations += int(conversation_id not in result.differences)
        result.differences.setdefault(conversation_id, []).extend(found)
    return result


HELD_BACK = (
    f"held back: a document no run reads, or a turn a copy left in {CONVERSATIONS} (text that "
    "is not valid UTF-8), is filed under it or stands under its id; no run migrates it until "
    "an operator moves or corrects that document, then `run` again"
)
"""What `verify` says of a conversation held back (`relocate.held_back`)."""


def _set_aside_held_back(
    result: Verification, converted: list[Converted], held_back_now: set[str]
) -> list[Converted]:
    """Of the conversations converted, those not held back (`relocate.held_back`); each held
    back is a difference saying so (`HELD_BACK`), compared with nothing: a run wrote nothing
    of it, and what stands under its id may be no conversation document."""
    kept = []
    for item in converted:
        if item.conversion.conversation_id in held_back_now:
            result.conversations += 1
            result.differences[item.conversion.conversation_id] = [HELD_BACK]
        else:
            kept.append(item)
    return kept


def _verify_batch(
    db: Database[dict[str, Any]],
    result: Verification,
    batch: list[Any],
    undated_at: datetime | None,
    read: tuple[dict[str, list[str]], set[str]],
    copies_gone: dual_writes.Deleted,
    *,
    source: str,
    rules: TurnRules,
) -> None:
    """Compare one batch of conversations, adding what it finds to `result` (`read`: the
    acceptances recorded, and the conversations held back, `relocate.held_back`;
    `copies_gone`: what `dual_writes.deleted` says, of which it takes the batch's; `source`:
    where they are). Only a conversation document is read as one (`CONVERSATION_FILTER`): a
    legacy turn standing under a conversation's id is not."""
    accepted, held_back_now = read
    held: list[dict[str, Any]] = []
    converted, failed, _ = convert_batch(
        db, batch, rules, source=source, undated_at=undated_at, held=held
    )
    converted = _set_aside_held_back(result, converted, held_back_now)
    for problem in failed:
        result.conversations += 1
        result.differences[problem.conversation_id] = [f"cannot be converted: {problem.detail}"]
    legacy = {c.conversion.conversation_id: c.turns for c in converted}
    checked = [c.conversion.conversation_id for c in converted]
    stored = full_texts.stored_messages(db, checked)
    query = {"_id": {"$in": checked}, **CONVERSATION_FILTER}
    documents = {d["_id"]: d for d in db[CONVERSATIONS].find(query, _DOCUMENT_READ)}
    recorded = problem_report.records(db, checked, placed=None)
    dual = dual_writes.differences(db, held, legacy, documents, rules, copies_gone.turns)
    for cid in checked:
        if cid in copies_gone.said:
            dual.setdefault(cid, []).extend(copies_gone.said.pop(cid))
    for item in converted:
        conversation_id = item.conversion.conversation_id
        result.conversations += 1
        result.unplaced += len(item.conversion.unplaced)
        document = documents.get(conversation_id)
        gone = popped(document)
        served = of_its_life(document, stored[conversation_id])
        found = stored.invalid.get(conversation_id, []) + compare(item, served, gone)
        found += unserved(item, document, stored[conversation_id])
        found += owner_differences(item, documents.get(conversation_id), stored[conversation_id])
        found += unrecorded(item, recorded.get(conversation_id, []))
        found += name_reasons(documents.get(conversation_id), stored[conversation_id])
        found += not_exact(item, accepted.get(conversation_id, []))
        found += dual.pop(conversation_id, [])
        if found:
            result.differences[conversation_id] = found
        else:
            result.matched += 1
    for conversation_id, found in dual.items():
        result.conversations += 1
        result.differences[conversation_id] = found
