"""The exit gate (`finish`): is every legacy conversation's content in the new collections?

For each legacy conversation the converter runs again (it is pure and fast) and
the gate checks, against what is stored: its conversation document (by the rule
a rerun writes it by: what people changed since stays theirs), every one of its
messages by id, its transcript as `verify` compares it (content, order, whole
texts of cut messages: ids alone would let two legacy turns whose ids read alike
share one stored copy, or a turn changed after the run pass), the whole text of
every cut message, and that whatever it holds that no message can hold (an
unplaced problem) is recorded in `agent_migration_problems` and accepted by an
operator (`finish --accept`). A conversation logged to live where its legacy turns
would go passes only if the live messages hold its legacy content. What a person changed
since the run stays theirs: a rename, a resolved prompt, and messages they popped (read as
the run stored them, never missing). A document that is
neither a legacy turn nor a conversation document is read by no run: the gate
names it. Anything else is work left, and the legacy collection must not be
dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pymongo.database import Database

from agent_store.core import AgentMessage
from agent_store.legacy import (
    CONVERSATION_COUNTERS,
    MIXED_USER_IDS,
    LegacyConversion,
    Problem,
)
from agent_store.store import CONVERSATIONS, MESSAGES, MIGRATING, TurnRules, with_texts
from migrations import abandoned, dual_writes, full_texts, orphan_prompts
from migrations import problems as problem_report
from migrations.explode import batches, conversation_ids, convert_batch
from migrations.relocate import UNREAD, held_back, turns_at
from migrations.settings import SERVICE_DEFAULTS
from migrations.verify import compare, name_reasons, of_its_life, unserved
from migrations.writes import (
    ALREADY_LIVE,
    CHANGED_SINCE,
    STOPPED_WHILE_WRITING,
    Converted,
    already_live,
    carried_epochs,
    changed_problem,
    counters_as_numbers,
    differs,
    document_differs,
    is_migrated,
    migrated_to,
    owner_after,
    popped,
    readable,
    rebuilt_life,
    stored_count,
    unmerged,
    wanted_document,
    written_by_old_service,
)


@dataclass
class WorkLeft:
    conversation_id: str
    reasons: list[str]


@dataclass
class Gate:
    """What `finish` found."""

    conversations: int = 0
    """Legacy conversations checked."""
    migrated: int = 0
    """Of those, the ones with no work left (empty and accepted ones included): counted, never
    worked out from the work left, which names conversations no legacy turn makes too."""
    empty: int = 0
    """Conversations whose turns hold nothing to migrate."""
    accepted: list[str] = field(default_factory=list)
    """Conversations whose unplaced content an operator accepted."""
    left: list[WorkLeft] = field(default_factory=list)
    unread: list[WorkLeft] = field(default_factory=list)
    """Documents no run reads (neither legacy turns nor conversation documents), by
    collection."""

    @property
    def open(self) -> bool:
        """True when every legacy conversation is migrated (or accepted) and every legacy
        document is read: a drop is safe."""
        return not self.left and not self.unread


@dataclass
class _Stored:
    """What is stored for one batch of conversations."""

    conversations: dict[str, dict[str, Any]]
    """The conversation documents, by id."""
    epochs: dict[str, str]
    """The epoch each conversation's stored messages carry (`carried_epochs`), by id."""
    messages: set[str]
    texts: set[str]
    recorded: dict[str, list[dict[str, Any]]]
    """The unplaced problems recorded, by conversation (`problem_report.records`)."""
    kept: dict[str, list[dict[str, Any]]]
    """The placed problems recorded (what they keep), by conversation."""
    live: dict[str, bool]
    """Conversations recorded as already live, and whether the live messages hold them."""


def _stored(
    db: Database[dict[str, Any]],
    batch: Sequence[Converted],
    messages: Mapping[str, Sequence[AgentMessage]],
) -> _Stored:
    """What is stored for the batch; `messages` are its stored messages, already read."""
    conversions = [item.conversion for item in batch]
    ids = [c.conversation_id for c in conversions]
    live = {
        d["conversation_id"]: bool(d.get("placed"))
        for d in db[problem_report.PROBLEMS].find(
            {"conversation_id": {"$in": ids}, "kind": ALREADY_LIVE}
        )
    }
    return _Stored(
        conversations={d["_id"]: d for d in db[CONVERSATIONS].find({"_id": {"$in": ids}})},
        epochs=carried_epochs(db, ids),
        messages={str(m.id) for stored in messages.values() for m in stored},
        texts=full_texts.present(db, (f.blob_id for c in conversions for f in c.full_texts)),
        recorded=problem_report.records(db, ids),
        kept=problem_report.records(db, ids, placed=True),
        live=live,
    )


def _changed(item: Converted, stored: Sequence[AgentMessage]) -> int:
    """How many stored messages hold other content, in any field, than the converter makes
    of their legacy turns now (whole texts put back on both sides; the owner aside, which a
    claim may have moved)."""
    texts = {f.blob_id: f.text for f in item.conversion.full_texts}
    by_id = {str(m.id): m for m in stored}
    return sum(
        1
        for m in item.conversion.messages
        if (found := by_id.get(str(m.id))) is not None and differs(found, with_texts(m, texts))
    )


def _document_reasons(
    item: Converted,
    found: dict[str, Any] | None,
    messages: Sequence[AgentMessage],
    carried: str | None,
) -> list[str]:
    """Whether the conversation document is stored as a run writes it now (by the rerun's
    rule: what people changed since is theirs)."""
    conversion = item.conversion
    if conversion.conversation is None:
        return []
    if found is None:
        return ["no conversation document"]
    if found.get(MIGRATING) is not None:
        return [STOPPED_WHILE_WRITING]
    live = sorted(
        (
            m
            for m in messages
            if (m.seq or 0) >= len(conversion.messages) and not is_migrated(m.turn_id)
        ),
        key=lambda m: m.seq or 0,
    )
    wanted = wanted_document(
        conversion,
        found,
        live,
        rebuilt_life(
            found, carried, None, (), held=False, old_service=written_by_old_service(item)
        ),
    )
    if document_differs(found, wanted):
        return [
            "its conversation document differs from what its legacy turns convert to now "
            "(a name, a usage or a session_hitl prompt changed after the run?): "
            "run the migration again"
        ]
    epoch = readable(found).get("epoch")
    return _owner_reasons(conversion, owner_after(found, wanted), messages, epoch)


def _owner_reasons(
    conversion: LegacyConversion,
    owner: str | None,
    messages: Sequence[AgentMessage],
    epoch: str | None,
) -> list[str]:
    """Whether every stored message of the conversation names the owner its document holds:
    the migration's (a run rewrites those), and the live turns' of its `epoch` (a run never
    does; one naming no owner was logged before a turn assigned the conversation, and its
    move to the owner did not happen yet)."""
    ids = {str(m.id) for m in conversion.messages}
    owned_else = sum(1 for m in messages if str(m.id) in ids and m.user_id != owner)
    live_else = sum(
        1
        for m in messages
        if str(m.id) not in ids
        and not is_migrated(m.turn_id)
        and m.user_id not in (None, owner)
        and m.epoch in (None, epoch)
    )
    reasons = []
    if owned_else:
        reasons.append(
            f"{owned_else} stored messages name another owner than the conversation document "
            "(an owner corrected in the legacy turns after the run?): run the migration again"
        )
    if live_else:
        reasons.append(
            f"{live_else} messages of live turns name another owner than the conversation "
            f"document, {owner!r}, the last user its turns name (its dual-written copies "
            "included): a run never rewrites a live turn; move them with the new service's "
            "`claim`, or give the legacy turns the owner their live messages name"
        )
    return reasons


def _reasons(
    item: Converted,
    stored: _Stored,
    accepted: dict[str, list[str]],
    messages: list[AgentMessage],
) -> list[str]:
    conversion = item.conversion
    cid = conversion.conversation_id
    found = stored.conversations.get(cid)
    gone = popped(found)
    every = {m.seq or 0: (str(m.id), m.turn_id) for m in messages}
    unplaced = list(conversion.unplaced)
    if cid in stored.live:
        served = of_its_life(found, messages)
        reasons = _live_reasons(item, stored, accepted.get(cid, []), served, gone)
        if found is None and conversion.conversation is not None:
            reasons.append(NO_DOCUMENT)  # a rollback moved it away since the run
    elif unmerged(found, conversion, every, gone):
        reasons, changed = _unmerged_reasons(item, stored, accepted, every, gone)
        unplaced += changed
    else:
        reasons = _migrated_reasons(item, stored, messages, gone)
    return (
        reasons
        + unserved(item, found, messages)
        + _past_count(found, messages)
        + name_reasons(found, messages)
        + _problem_reasons(
            cid, unplaced, stored.recorded.get(cid, []), accepted.get(cid, []), found
        )
        + _kept_reasons(conversion.problems, stored.kept.get(cid, []))
    )


def _owned_as_stored(mixed: Sequence[str], found: Mapping[str, Any] | None) -> list[str]:
    """Who owns a conversation whose turns name several users (`mixed`: its `mixed_user_ids`
    details, naming the owner of what they convert to) as its stored document says: another
    than they name when its legacy turns are not merged (`conversation_changed_since`)."""
    if found is None or not mixed:
        return []
    owner = found.get("user_id")
    return [f"as stored, {'no user' if owner is None else repr(owner)} owns it"]


def _live_reasons(
    item: Converted,
    stored: _Stored,
    accepted: Sequence[str],
    messages: list[AgentMessage],
    gone: set[str],
) -> list[str]:
    """A conversation recorded as logged to live where its legacy turns go: it passes when its
    live messages hold its legacy content, or, when they do not, once its
    `conversation_already_live` problem keeps its legacy turns as they convert now (rebuilt
    with the detail it records, `writes.already_live`, compared by `problems.held`) and an
    operator accepted it, as MIGRATION.md lists it (not placed: work left until accepted)."""
    cid = item.conversion.conversation_id
    if stored.live[cid]:
        return _differences(item, messages, gone)
    records = [r for r in stored.recorded.get(cid, []) if r.get("kind") == ALREADY_LIVE]
    now = [already_live(item.conversion, str(r.get("detail")), held=False) for r in records]
    kept = problem_report.held(records, now)
    if not kept:
        return [
            f"logged to live where its legacy turns go, and its {ALREADY_LIVE} problem does not "
            "keep them as they convert now (a legacy turn edited since, or its record edited "
            "by hand): run the migration again"
        ]
    if kept & Counter(accepted):
        return []
    return [
        f"logged to live where its legacy turns go ({ALREADY_LIVE}: a writer without the "
        "legacy reader logged to it before its migration, or a live turn holds places its "
        "legacy turns convert to now), and its live messages do not hold them: they are not "
        f"merged, and its problem keeps them (see {problem_report.PROBLEMS}); once they are "
        f"kept elsewhere, `finish --accept {cid}`"
    ]


def _unmerged_reasons(
    item: Converted,
    stored: _Stored,
    accepted: dict[str, list[str]],
    every: Mapping[int, tuple[str, Any]],
    gone: set[str],
) -> tuple[list[str], list[Problem]]:
    """A conversation a person changed since the migration whose legacy turns a run does not
    merge (`unmerged`): work left until its problem is recorded as it is now and accepted
    (the problem, for the digests `_problem_reasons` compares), or, where the migration never
    wrote to it, until a run records it as logged to live."""
    conversion = item.conversion
    cid = conversion.conversation_id
    if not migrated_to(conversion, every, gone, copies=item.copies):
        return [
            "a live turn holds places its legacy turns convert to, or they convert to places "
            "past its conversation document's count: run the migration again to record it "
            "(conversation_already_live)"
        ], []
    problem = changed_problem(conversion)
    found = problem_report.digest(problem)
    if found in accepted.get(cid, []):
        return [], [problem]
    return [
        "changed by a person since the migration (a live turn or a pop), and its legacy turns "
        "convert to messages where the conversation holds no place for them (legacy turns "
        "added or edited since, messages popped earlier than the newest 100 its document "
        "remembers, or popped before a rollback moved its document away): they are not "
        f"merged (its {CHANGED_SINCE} problem keeps them)"
    ], [problem]


def _migrated_reasons(
    item: Converted, stored: _Stored, messages: list[AgentMessage], gone: set[str]
) -> list[str]:
    """A conversation the migration wrote: its document, messages and whole texts."""
    conversion = item.conversion
    cid = conversion.conversation_id
    found = stored.conversations.get(cid)
    reasons = _differences(item, of_its_life(found, messages), gone)
    reasons += _document_reasons(item, found, messages, stored.epochs.get(cid))
    missing = sum(
        1 for m in conversion.messages if m.id not in stored.messages and str(m.id) not in gone
    )
    if missing:
        reasons.append(f"{missing} of {len(conversion.messages)} messages missing")
    changed = _changed(item, messages)
    if changed:
        reasons.append(
            f"{changed} stored messages differ from what their legacy turns convert to now "
            "(a turn edited after the run?): run the migration again"
        )
    lost = sum(
        1
        for f in conversion.full_texts
        if f.blob_id not in stored.texts and f.message_id not in gone
    )
    if lost:
        reasons.append(f"{lost} whole texts of cut messages missing")
    return reasons


def _differences(item: Converted, messages: list[AgentMessage], gone: set[str]) -> list[str]:
    """Its transcript against its legacy transcript, as `verify` compares them."""
    differences = compare(item, messages, gone)
    if not differences:
        return []
    shown = "; ".join(differences[:3]) + ("; …" if len(differences) > 3 else "")
    return [f"its messages differ from its legacy turns ({shown}): `verify` lists all"]


def _past_count(found: Mapping[str, Any] | None, messages: Sequence[AgentMessage]) -> list[str]:
    """Messages at a `seq` the conversation document does not cover (at or past its
    `message_count`): the next turn would find its place taken. A message of another `epoch`
    (a late insert of a conversation deleted under the id) is not: a turn takes it over."""
    if found is None:
        return []
    read = readable(found)
    count = stored_count(found)
    if count is None or not counters_as_numbers(found):
        counters = {name: found.get(name) for name in CONVERSATION_COUNTERS}
        return [
            f"its conversation document's counters, {counters!r}, are not stored as counts "
            "(edited by hand?), which the next turn cannot add to: `run` writes the "
            "migration's own document again; on one a live turn wrote to, set them as numbers"
        ]
    past = [m for m in messages if (m.seq or 0) >= count and m.epoch in (None, read.get("epoch"))]
    if not past:
        return []
    return [
        f"{len(past)} messages stored at seq values its conversation document does not cover "
        f"(from seq {past[0].seq}; message_count {count}): the next turn would find its place "
        "taken"
    ]


def _kept_reasons(problems: Sequence[Problem], recorded: Sequence[dict[str, Any]]) -> list[str]:
    """Whether what the placed problems keep (a whole name, a history's part no message holds)
    is recorded as the legacy turns say it now: each record holding it (`held`), as unplaced
    ones are."""
    placed = [p for p in problems if p.placed]
    found = Counter(problem_report.digest(p) for p in placed)
    if found - problem_report.held(recorded, placed):
        return [
            "content the migration keeps in placed problems is not recorded as it is now "
            "(new, edited after the run, a problem record edited by hand, or the content a "
            "problem keeps in GridFS missing or damaged): run the migration again"
        ]
    return []


def _problem_reasons(
    cid: str,
    unplaced: Sequence[Problem],
    recorded: Sequence[dict[str, Any]],
    accepted: Sequence[str],
    document: Mapping[str, Any] | None = None,
) -> list[str]:
    """Whether the content only the legacy data holds is recorded as it is now (each record
    holding what its problem holds, `held`), and accepted (by digest), so content edited after
    the run or after the acceptance, or a record edited by hand, is work left; with it, who
    owns a conversation whose turns name several users, as converted and as stored (its
    `document`: `_owned_as_stored`)."""
    found = Counter(problem_report.digest(p) for p in unplaced)
    reasons = _unplaced_reasons(
        cid,
        {p.kind for p in unplaced},
        unrecorded=bool(found - problem_report.held(recorded, unplaced)),
        unaccepted=bool(found - Counter(accepted)),
    )
    owners = [p.detail for p in unplaced if p.kind == MIXED_USER_IDS]
    owners += _owned_as_stored(owners, document)
    return reasons + (owners if reasons else [])


def _unplaced_reasons(
    cid: str, kinds: set[str], *, unrecorded: bool, unaccepted: bool
) -> list[str]:
    if unrecorded:
        return [
            "content only the legacy data holds is not recorded as it is now (new, edited "
            "after the run, a problem record edited by hand, or the content a problem keeps "
            "in GridFS missing or damaged): run the migration again"
        ]
    if unaccepted:
        return [
            f"content only the legacy data holds ({', '.join(sorted(kinds))}; see "
            f"{problem_report.PROBLEMS}): once it is kept elsewhere, `finish --accept {cid}`"
        ]
    return []


def check(
    db: Database[dict[str, Any]],
    *,
    batch_size: int = 200,
    undated_at: datetime | None = None,
    renew: Callable[[], None] = lambda: None,
    rules: TurnRules = SERVICE_DEFAULTS,
) -> Gate:
    """Check every legacy conversation against what is stored, converted by `rules` (the
    service's: `migrations.settings`). `renew` is called after each batch and chunk read
    (`finish` renews its lease so: a gate may take longer than one). The legacy turns are
    read where they are (`relocate.turns_at`)."""
    gate = Gate()
    accepted = problem_report.accepted(db)
    source = turns_at(db)
    gone = dual_writes.deleted(db, source=source)
    renew()
    for ids in batches(conversation_ids(db, source=source), batch_size):
        _check_batch(db, gate, ids, accepted, undated_at, gone, source=source, rules=rules)
        renew()
    _check_orphan_prompts(db, gate, accepted, renew, source=source)
    listed = {left.conversation_id: left for left in gate.left}
    for cid, reasons in gone.said.items():  # no legacy turn lists it: its records say
        if cid in listed:
            listed[cid].reasons += reasons
        else:
            gate.conversations += 1
            gate.left.append(listed.setdefault(cid, WorkLeft(cid, reasons)))
    for found in abandoned.chunks(db, source=source):
        for item in found:  # one a legacy turn names is listed already: one entry each
            if item.conversation_id in listed:
                listed[item.conversation_id].reasons.append(item.reason)
            else:
                gate.left.append(listed.setdefault(item.conversation_id, _left(item)))
        renew()
    named = {left.conversation_id for left in gate.left}
    for ids in batches(live_without_document(db), abandoned.CHUNK):
        gate.conversations += len(ids)
        gate.left += [WorkLeft(cid, [WITHOUT_DOCUMENT]) for cid in ids if cid not in named]
        renew()
    gate.unread = unread_documents(db)
    return gate


def _left(item: abandoned.Abandoned) -> WorkLeft:
    return WorkLeft(item.conversation_id, [item.reason])


NO_DOCUMENT = (
    "no conversation document (its live messages stored, the document moved away by a "
    "rollback?): unlisted, and refused writes as legacy turns not migrated yet; run the "
    "migration again, which writes it as the person left it"
)
"""What the gate says of a conversation a legacy turn makes whose document is gone."""

WITHOUT_DOCUMENT = (
    "its messages are stored without a conversation document, and no legacy turn makes it, "
    "so no run writes one (logged while the dual write was off, its document moved away by a "
    "rollback?): unlisted, and its next turn would take their places. Put its conversation "
    "document back (from where the rollback moved it), or delete its messages"
)


def live_without_document(db: Database[dict[str, Any]]) -> Iterator[str]:
    """The conversations holding messages and no conversation document: one pass over the
    messages' conversation ids (grouped by the server, on their index), then one read of
    their documents a chunk at a time. Whatever their first message (those whose first is
    the migration's are `abandoned`'s, named there first): a conversation whose migrated
    messages were deleted by hand holds live ones from a later `seq` on."""
    grouped = db[MESSAGES].aggregate(
        [{"$sort": {"conversation_id": 1}}, {"$group": {"_id": "$conversation_id"}}],
        allowDiskUse=True,
    )
    live = (g["_id"] for g in grouped)
    for ids in batches(live, abandoned.CHUNK):
        stored = {d["_id"] for d in db[CONVERSATIONS].find({"_id": {"$in": ids}}, {"_id": 1})}
        yield from (cid for cid in ids if cid not in stored)


def _check_batch(
    db: Database[dict[str, Any]],
    gate: Gate,
    ids: list[Any],
    accepted: dict[str, list[str]],
    undated_at: datetime | None,
    gone: dual_writes.Deleted,
    *,
    source: str,
    rules: TurnRules,
) -> None:
    """Check one batch of legacy conversations (`source`: where they are now), taking from
    `gone` what it says of them (`dual_writes.deleted`)."""
    held: list[dict[str, Any]] = []
    converted, failed, _ = convert_batch(
        db, ids, rules, source=source, undated_at=undated_at, held=held
    )
    gate.conversations += len(failed)
    gate.left += [WorkLeft(p.conversation_id, [f"cannot be converted: {p.detail}"]) for p in failed]
    legacy = {c.conversion.conversation_id: c.turns for c in converted}
    messages = full_texts.stored_messages(db, [c.conversion.conversation_id for c in converted])
    stored = _stored(db, converted, messages)
    dual = dual_writes.differences(db, held, legacy, stored.conversations, rules, gone.turns)
    for cid in list(gone.said):
        if cid in messages:
            dual.setdefault(cid, []).extend(gone.said.pop(cid))
    for item in converted:
        gate.conversations += 1
        cid = item.conversion.conversation_id
        reasons = messages.invalid.get(cid, []) + _reasons(item, stored, accepted, messages[cid])
        reasons += dual.pop(cid, [])
        if reasons:
            gate.left.append(WorkLeft(cid, reasons))
            continue
        gate.migrated += 1
        if item.conversion.conversation is None:
            gate.empty += 1
        elif cid in accepted and item.conversion.unplaced:
            gate.accepted.append(cid)
    gate.conversations += len(dual)
    gate.left += [WorkLeft(cid, reasons) for cid, reasons in dual.items()]


SHOWN = 5
"""How many ids of the documents no run reads `finish` names, per collection."""


def unread_documents(db: Database[dict[str, Any]]) -> list[WorkLeft]:
    """Documents no run converts, which a drop must not take unseen: in the legacy collection,
    any that is not a legacy turn (it holds a conversation document's counters); in
    `agent_conversations`, any holding those counters and a field only a legacy turn holds
    (neither a turn, which the move would take, nor a conversation document: no run writes a
    conversation over it, `writes.NO_TURN_FIELD`, so one under a conversation's id holds
    that conversation back), and the conversations they hold back (`relocate.held_back`)."""
    left: list[WorkLeft] = []
    for name, query in UNREAD:
        ids = [d["_id"] for d in db[name].find(query, {"_id": 1}).limit(SHOWN)]
        if not ids:
            continue
        count = db[name].count_documents(query)
        shown = ", ".join(map(repr, ids)) + (", …" if count > len(ids) else "")
        left.append(
            WorkLeft(
                name,
                [
                    f"{count} documents are neither legacy turns nor conversation documents "
                    f"({shown}): no run converts them, nor writes over them; move or correct "
                    "them, then `run` again"
                ],
            )
        )
    held = sorted(held_back(db)) if left else []
    if held:
        shown = ", ".join(map(repr, held[:SHOWN])) + (", …" if len(held) > SHOWN else "")
        left[-1].reasons.append(
            f"they hold back conversations {shown}: no run migrates, changes or removes any of "
            "them until then"
        )
    return left


def _check_orphan_prompts(
    db: Database[dict[str, Any]],
    gate: Gate,
    accepted: dict[str, list[str]],
    renew: Callable[[], None],
    *,
    source: str,
) -> None:
    """The pending prompts no conversion of the legacy turns in `source` reads, a chunk at a
    time: each conversation of them passes once each of its prompts is recorded as it is now,
    and accepted."""
    unrecorded: dict[str, bool] = {}
    unaccepted: dict[str, bool] = {}
    accepted_of: dict[str, set[str]] = {}
    for found in orphan_prompts.chunks(db, source):
        recorded = problem_report.recorded_found(db, found)
        for problem in found:
            cid = problem.conversation_id
            found_digest = problem_report.digest(problem)
            if cid not in accepted_of:
                accepted_of[cid] = set(accepted.get(cid, ()))
            unrecorded[cid] = unrecorded.get(cid, False) or found_digest not in recorded
            unaccepted[cid] = unaccepted.get(cid, False) or found_digest not in accepted_of[cid]
        renew()
    kinds = {orphan_prompts.ORPHAN_PENDING_HITL}
    for cid in unrecorded:
        gate.conversations += 1
        reasons = _unplaced_reasons(
            cid, kinds, unrecorded=unrecorded[cid], unaccepted=unaccepted[cid]
        )
        if reasons:
            gate.left.append(WorkLeft(cid, reasons))
        else:
            gate.migrated += 1
            gate.accepted.append(cid)
