"""Pending `session_hitl` prompts no conversion reads: of conversations without any legacy turn.

A conversion reads a conversation's prompts with its turns (`read_session_hitl`), by the
conversation each prompt names (`prompt_conversation`); a prompt naming none (a blank id,
no session), one naming it in text that is not valid UTF-8 (no query names that), or one
without legacy turns would be dropped with the legacy data unseen. Which
prompts a conversion reads is decided by that same read. A run records each other as an
unplaced problem, `orphan_pending_hitl`, holding the prompt document, for an operator to
accept; the exit gate looks for them itself, so a prompt the old service records after the
run is work left too. What is pending is what the converter takes as pending
(`is_pending_prompt`). One read of `session_hitl`; per chunk of a thousand prompts, a
`distinct` on the legacy turns, a read of the prompts a conversion takes and the chunk's
records: commands and memory are bounded by the chunk, however many orphans there are.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pymongo.database import Database

from agent_store.legacy import (
    SESSION_HITL,
    Problem,
    id_filter,
    is_pending_prompt,
    named_id,
    not_utf8_at,
    prompt_conversation,
)
from migrations import problems as problem_report
from migrations.explode import NOT_DUAL_WRITTEN, Explosion, batches, read_session_hitl
from migrations.keys import identity

ORPHAN_PENDING_HITL = "orphan_pending_hitl"
CHUNK = 1000
"""Prompts read, and their orphans recorded or checked, at a time."""


def _named(prompt: Mapping[str, Any]) -> str | None:
    """The conversation a prompt names (`prompt_conversation`), but for one naming it in text
    that is not valid UTF-8 (`not_utf8_at`): no query can name that one (no client encodes
    it), so no conversion reads the prompt, and no record can name it either."""
    named = prompt_conversation(prompt)
    return named if named is None or not_utf8_at(named) is None else None


def _problem(prompt: Mapping[str, Any]) -> Problem:
    named = _named(prompt)
    detail = (
        "a pending session_hitl prompt of a conversation without any legacy turn: no "
        "conversation takes it"
    )
    if named is None and prompt_conversation(prompt) is not None:
        named_by_id = named_id(prompt.get("conversation_id")) is not None
        field = "conversation_id" if named_by_id else "session_id"
        detail = (
            f"a pending session_hitl prompt whose {field} holds bytes that are not valid UTF-8 "
            "(kept as stored): it names no conversation a run reads, so no conversation takes "
            "it; correct the text in the database, then run again"
        )
    return Problem(
        conversation_id=named if named is not None else f"session_hitl|{prompt.get('_id')}",
        legacy_id=str(prompt.get("_id")),
        kind=ORPHAN_PENDING_HITL,
        detail=detail,
        content=dict(prompt),
    )


def _with_turns(db: Database[dict[str, Any]], names: set[str], source: str) -> set[str]:
    """The conversations of `names` a run converts: those some legacy turn in `source` names
    (where the run reads its turns: `agent_conversations` for a dry run before the move)."""
    if not names:
        return set()
    clauses = [id_filter("conversation_id", name) for name in sorted(names)]
    query = {"$and": [{"$or": clauses}, NOT_DUAL_WRITTEN]}
    found = (named_id(value) for value in db[source].distinct("conversation_id", query))
    return {name for name in found if name in names}


def _alone(
    db: Database[dict[str, Any]], pending: list[Mapping[str, Any]], source: str
) -> Iterator[Problem]:
    """The prompts of `pending` no conversion reads, decided by the conversions' own read of
    prompts (`read_session_hitl`): a prompt naming no conversation, or one without legacy
    turns in `source`, or one that read does not find."""
    names = {name for p in pending if (name := _named(p)) is not None}
    converted = _with_turns(db, names, source)
    among = {"_id": {"$in": [p["_id"] for p in pending]}}
    read = read_session_hitl(db, {name: name for name in converted}, among=among)
    held = {identity(doc) for docs in read.values() for doc in docs}
    for prompt in pending:
        if identity(prompt) not in held:
            yield _problem(prompt)


def chunks(db: Database[dict[str, Any]], source: str) -> Iterator[list[Problem]]:
    """A problem for every pending prompt no conversion of the turns in `source` reads, a
    chunk of `CHUNK` prompts at a time, in the order of the prompts' ids: memory holds one
    chunk."""
    prompts = db[SESSION_HITL].find().sort("_id", 1)
    for chunk in batches(iter(prompts), CHUNK):
        yield list(_alone(db, [p for p in chunk if is_pending_prompt(p)], source))


def record(run: Explosion) -> None:
    """A run's last step, once it has gone through every conversation: count the prompts no
    conversation takes and (unless a dry run) make the recorded `orphan_pending_hitl`
    problems exactly these: each chunk's recorded as the scan goes, marked with the run, then
    those of earlier runs the scan did not find again deleted. The turns are read where the
    run reads them (`run.source`): a dry run before the move reads them in
    `agent_conversations`, so it counts the orphans the run records."""
    for found in chunks(run.db, run.source):
        run.counts.add_problems(found)
        if not run.options.dry_run:
            run.fence()  # a run paused past its lease records no chunk read before
            problem_report.record_found(
                run.db, found, run_id=run.run_id, at=run.undated_at, bounds=run.options.bounds
            )
    if not run.options.dry_run:
        run.fence()
        problem_report.drop_not_found_by(run.db, ORPHAN_PENDING_HITL, run.run_id)
