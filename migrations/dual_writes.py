"""Dual-written legacy turns (`dual_write: true`): the new service's copies of its own turns,
kept for a rollback (MIGRATION.md, "Transition flags").

Such a turn is keyed by its conversation id and the live turn id (`turn_id`), which its
stored messages carry too. A run skips it only while `agent_messages` holds messages of that
turn (`held`): one without any (a second attempt after a rollback that cleared
`agent_messages`) is a legacy turn like any other, converted by `run` and checked by `verify`
and `finish`. A held one whose stored messages do not hold its content (the legacy service
edited it after a rollback) is a difference for `verify` and work left for `finish`
(`differences`): its stored messages are the live service's, which the migration never
rewrites.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pymongo.database import Database

from agent_store.core import InvalidInput
from agent_store.legacy import convert, parse_turns
from agent_store.store import MESSAGES
from migrations import full_texts
from migrations.transcript import contains, from_legacy, from_messages
from migrations.transcript import differences as transcript_differences


def _turn(document: Mapping[str, Any]) -> tuple[str, str] | None:
    """(conversation id, turn id) of a dual-written turn; None for any other document."""
    cid, turn_id = document.get("conversation_id"), document.get("turn_id")
    if document.get("dual_write") is not True or not isinstance(cid, str):
        return None
    return (cid, turn_id) if isinstance(turn_id, str) else None


def held(db: Database[dict[str, Any]], documents: Sequence[Mapping[str, Any]]) -> set[int]:
    """Which of these documents (by `id()`) are dual-written turns whose messages are stored:
    one read of `agent_messages` for them all, none when there is no such turn."""
    turns = {key for d in documents if (key := _turn(d)) is not None}
    if not turns:
        return set()
    query = {"$or": [{"conversation_id": c, "turn_id": t} for c, t in sorted(turns)]}
    found = {
        (m.get("conversation_id"), m.get("turn_id"))
        for m in db[MESSAGES].find(query, {"conversation_id": 1, "turn_id": 1})
    }
    return {id(d) for d in documents if _turn(d) in found}


def differences(
    db: Database[dict[str, Any]], documents: Iterable[Mapping[str, Any]]
) -> dict[str, list[str]]:
    """For held dual-written turns: by conversation, each turn whose stored messages do not
    hold its content in order (they may hold more: a result of an earlier turn's call)."""
    turns: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for document in documents:
        if (key := _turn(document)) is not None:
            turns.setdefault(key, []).append(document)
    if not turns:
        return {}
    stored = full_texts.stored_messages(db, sorted({cid for cid, _ in turns}))
    found: dict[str, list[str]] = {}
    for (cid, turn_id), group in sorted(turns.items()):
        try:
            legacy = from_legacy(parse_turns(group), convert(group).unplaced)
        except InvalidInput as exc:
            found.setdefault(cid, []).append(f"dual-written turn {turn_id!r}: {exc.message}")
            continue
        messages = from_messages(m for m in stored.get(cid, []) if m.turn_id == turn_id)
        if contains(messages, legacy):
            continue
        shown = "; ".join(transcript_differences(legacy, messages)[:3])
        found.setdefault(cid, []).append(
            f"the dual-written turn {turn_id!r} holds content its stored messages do not "
            f"({shown}; the legacy service edited it after a rollback?): restore its "
            "messages, or remove its `dual_write` mark so `run` migrates it as a legacy turn"
        )
    return found
