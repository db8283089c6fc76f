"""Pending `session_hitl` prompts of conversations without any legacy turn.

No conversion takes such a prompt (a conversation's prompts are read with its
turns), so it would be dropped with the legacy data unseen. A run records each
as an unplaced problem, `orphan_pending_hitl`, holding the prompt document, for
an operator to accept; the exit gate looks for them itself, so a prompt the old
service records after the run is work left too. What is pending is what the
converter takes as pending (`is_pending_prompt`). One read of
`session_hitl`, and one `distinct` on the legacy turns per thousand pending prompts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pymongo.database import Database

from agent_store.legacy import (
    LEGACY_TURNS,
    SESSION_HITL,
    Problem,
    id_text,
    is_pending_prompt,
)
from migrations import problems as problem_report
from migrations.explode import LEGACY_FILTER, Explosion, batches, named

ORPHAN_PENDING_HITL = "orphan_pending_hitl"
_CHUNK = 1000


def _named_by(prompt: Mapping[str, Any]) -> Any:
    """The conversation a prompt names, as the migration reads prompts (`read_session_hitl`)."""
    return prompt.get("conversation_id") or prompt.get("session_id")


def _problem(prompt: Mapping[str, Any]) -> Problem:
    named_id = _named_by(prompt)
    unnamed = f"session_hitl|{prompt.get('_id')}"
    return Problem(
        conversation_id=str(id_text(named_id)) if named_id is not None else unnamed,
        legacy_id=str(prompt.get("_id")),
        kind=ORPHAN_PENDING_HITL,
        detail=(
            "a pending session_hitl prompt of a conversation without any legacy turn: no "
            "conversation takes it"
        ),
        content=dict(prompt),
    )


def _alone(db: Database[dict[str, Any]], pending: list[Mapping[str, Any]]) -> Iterator[Problem]:
    """The prompts of `pending` whose conversation no legacy turn names."""
    named_ids = [_named_by(p) for p in pending if _named_by(p) is not None]
    found: Iterable[Any] = []
    if named_ids:
        query = {"$and": [{"$or": [named(i) for i in named_ids]}, LEGACY_FILTER]}
        found = db[LEGACY_TURNS].distinct("conversation_id", query)
    held = {id_text(value) for value in found if value is not None}
    for prompt in pending:
        named_id = _named_by(prompt)
        if named_id is None or id_text(named_id) not in held:
            yield _problem(prompt)


def find(db: Database[dict[str, Any]]) -> list[Problem]:
    """A problem for every pending prompt of a conversation without legacy turns, in the
    order of the prompts' ids."""
    found: list[Problem] = []
    prompts = db[SESSION_HITL].find().sort("_id", 1)
    for chunk in batches(iter(prompts), _CHUNK):
        pending = [p for p in chunk if is_pending_prompt(p)]
        found += _alone(db, pending)
    return found


def record(run: Explosion) -> None:
    """A run's last step, once it has gone through every conversation: count the prompts no
    conversation takes and (unless a dry run) make the recorded `orphan_pending_hitl`
    problems exactly these."""
    found = find(run.db)
    run.counts.add_problems(found)
    if not run.options.dry_run:
        problem_report.replace_kind(
            run.db, ORPHAN_PENDING_HITL, found, at=run.undated_at, bounds=run.options.bounds
        )
