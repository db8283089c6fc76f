"""The lives of the conversations the migration wrote, kept in its state (`STATE`), apart
from the conversation documents a rollback moves away: a second attempt's run writes the
document of such a conversation again with the life it had (its `epoch`, `epoch_marks` and
`migrated` mark), never another, so its version and what documents beside it name (a
graph's checkpoints) stay its own (`writes.rebuilt_life` says when it is that life)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pymongo import UpdateOne
from pymongo.database import Database

from migrations.lease import STATE

LIFE = "life"
"""The `kind` of a record of a conversation's life in the migration's state."""
LIFE_FIELDS = ("epoch", "epoch_marks", "migrated")
"""What a record keeps of the conversation document a run wrote."""


def life(document: Mapping[str, Any]) -> dict[str, Any]:
    """A conversation's life as a document (or a record of it) holds it: its `epoch`, and
    whether it is epoch-marked and the migration's (`LIFE_FIELDS`)."""
    return {
        "epoch": document.get("epoch"),
        "epoch_marks": bool(document.get("epoch_marks")),
        "migrated": bool(document.get("migrated")),
    }


def _record_id(conversation_id: str) -> str:
    return f"{LIFE}|{conversation_id}"


def record(db: Database[dict[str, Any]], documents: Iterable[Mapping[str, Any]]) -> None:
    """Keep the life of each conversation document a run wrote that holds an `epoch` (one
    write for them all, none when none does): the last one written under the id."""
    writes = [
        UpdateOne(
            {"_id": _record_id(d["_id"])},
            {"$set": {"kind": LIFE, "conversation_id": d["_id"], **life(d)}},
            upsert=True,
        )
        for d in documents
        if isinstance(d.get("epoch"), str)
    ]
    if writes:
        db[STATE].bulk_write(writes, ordered=False)


def recorded(db: Database[dict[str, Any]], ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """conversation id -> the life a run last wrote its document with (`record`), for those
    of `ids` it wrote one for (one read)."""
    if not ids:
        return {}
    query = {"_id": {"$in": [_record_id(cid) for cid in ids]}, "kind": LIFE}
    return {
        d["conversation_id"]: {k: d[k] for k in LIFE_FIELDS if k in d}
        for d in db[STATE].find(query)
        if isinstance(d.get("epoch"), str)
    }
