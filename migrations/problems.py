"""The problem report (`agent_migration_problems`): what the converter could not place as it
was, or changed; a summary by kind; and the operator's recorded acceptance of a
conversation's unplaced content.

Each problem is recorded with a digest of all it says (`digest`): the exit gate
compares it with what the converter finds now, and an acceptance covers the
digests accepted, so content edited after the run or after the acceptance is
never dropped as accepted.

Each run replaces the problems of the conversations it converts, so the report
always says what the current code makes of the legacy turns. A problem whose
content is too large to hold keeps it in GridFS, like a cut message.
"""

from __future__ import annotations

import getpass
import hashlib
import socket
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, TextIO

import bson
from pymongo import ReplaceOne
from pymongo.database import Database

from agent_store.core import utc_now
from agent_store.legacy import Problem, dumps
from agent_store.store import FullText, blob_id
from migrations import full_texts
from migrations.bounds import Bounds, bounded
from migrations.lease import STATE

PROBLEMS = "agent_migration_problems"
PROBLEM_BYTES = 1024 * 1024
"""A problem document over this keeps its content in GridFS (`content_blob_id`)."""
ACCEPTANCE = "acceptance"


def digest(problem: Problem) -> str:
    """A digest of everything the problem says (its content exactly, BSON types included)."""
    return hashlib.sha256(bson.encode({"problem": problem.model_dump()})).hexdigest()


def problem_documents(
    problems: Sequence[Problem], *, at: datetime
) -> tuple[list[dict[str, Any]], list[FullText]]:
    """Each problem as a document with a stable id (conversation, kind, position), and the
    whole contents too large to hold in one."""
    ordinal: dict[str, int] = {}
    documents: list[dict[str, Any]] = []
    kept: list[FullText] = []
    for problem in problems:
        n = ordinal.get(problem.conversation_id, 0)
        ordinal[problem.conversation_id] = n + 1
        document = {
            "_id": f"{problem.conversation_id}|{problem.kind}|{n}",
            **problem.model_dump(),
            "digest": digest(problem),
        }
        if len(bson.encode(document)) > PROBLEM_BYTES:
            text = dumps(problem.content)[0]
            full = FullText(
                blob_id(document["_id"], "content"),
                problem.conversation_id,
                document["_id"],
                "content",
                text,
                at,
            )
            kept.append(full)
            document |= {
                "content": None,
                "content_blob_id": full.blob_id,
                "content_length": len(text),
            }
        documents.append(document)
    return documents, kept


def replace(
    db: Database[dict[str, Any]],
    conversation_ids: Iterable[str],
    problems: Sequence[Problem],
    *,
    at: datetime,
    bounds: Bounds,
    earlier: bool = True,
) -> None:
    """Make the problems of these conversations exactly `problems`. `earlier=False` says no
    run recorded problems before (saves a delete per batch on a first run)."""
    documents, kept = problem_documents(problems, at=at)
    full_texts.keep(db, kept, bounds)
    if earlier:
        ids = sorted(set(conversation_ids))
        db[PROBLEMS].delete_many(
            {"conversation_id": {"$in": ids}, "_id": {"$nin": [d["_id"] for d in documents]}}
        )
    _upsert(db, documents, bounds)


def replace_kind(
    db: Database[dict[str, Any]],
    kind: str,
    problems: Sequence[Problem],
    *,
    at: datetime,
    bounds: Bounds,
) -> None:
    """Make the recorded problems of one kind, whatever their conversations, exactly
    `problems` (all of that kind)."""
    documents, kept = problem_documents(problems, at=at)
    full_texts.keep(db, kept, bounds)
    db[PROBLEMS].delete_many({"kind": kind, "_id": {"$nin": [d["_id"] for d in documents]}})
    _upsert(db, documents, bounds)


def _upsert(
    db: Database[dict[str, Any]], documents: Sequence[dict[str, Any]], bounds: Bounds
) -> None:
    operations = [ReplaceOne({"_id": d["_id"]}, d, upsert=True) for d in documents]
    sizes = [len(bson.encode(d)) for d in documents]
    for run in bounded(operations, sizes, bounds):
        db[PROBLEMS].bulk_write(run, ordered=False)


def summary(db: Database[dict[str, Any]]) -> list[tuple[str, bool, int]]:
    """(kind, placed, count) of every recorded problem, most frequent first."""
    rows = db[PROBLEMS].aggregate(
        [{"$group": {"_id": {"kind": "$kind", "placed": "$placed"}, "n": {"$sum": 1}}}]
    )
    found = [(r["_id"]["kind"], bool(r["_id"]["placed"]), int(r["n"])) for r in rows]
    return sorted(found, key=lambda row: (-row[2], row[0], row[1]))


def print_summary(db: Database[dict[str, Any]], out: TextIO) -> None:
    rows = summary(db)
    if not rows:
        print("problems: none recorded", file=out)
        return
    unplaced = sum(n for _, placed, n in rows if not placed)
    print(
        f"problems: {sum(n for *_, n in rows)} recorded in {PROBLEMS}, {unplaced} holding "
        "content no message holds (not placed)",
        file=out,
    )
    width = max(len(kind) for kind, *_ in rows)
    for kind, placed, n in rows:
        print(f"  {kind:<{width}}  {n:>6}  {'placed' if placed else 'not placed'}", file=out)


def unplaced(
    db: Database[dict[str, Any]], conversation_ids: Iterable[str]
) -> dict[str, list[tuple[str, str]]]:
    """(kind, digest) of the unplaced problems recorded for each of these conversations (a
    record without a digest, of an older run, has the digest "": it matches nothing)."""
    found: dict[str, list[tuple[str, str]]] = {}
    query = {"conversation_id": {"$in": sorted(set(conversation_ids))}, "placed": False}
    for doc in db[PROBLEMS].find(query, {"conversation_id": 1, "kind": 1, "digest": 1}):
        found.setdefault(doc["conversation_id"], []).append((doc["kind"], doc.get("digest", "")))
    return found


def accept(db: Database[dict[str, Any]], conversation_id: str, note: str | None) -> None:
    """Record that an operator accepts the conversation's unplaced content, as recorded now,
    as kept elsewhere: its problems' kinds (for people) and digests (what it covers)."""
    recorded = unplaced(db, [conversation_id]).get(conversation_id, [])
    db[STATE].replace_one(
        {"_id": f"accept:{conversation_id}"},
        {
            "kind": ACCEPTANCE,
            "conversation_id": conversation_id,
            "accepted_by": f"{getpass.getuser()}@{socket.gethostname()}",
            "accepted_at": utc_now(),
            "note": note,
            "problems": sorted(kind for kind, _ in recorded),
            "digests": sorted(found for _, found in recorded),
        },
        upsert=True,
    )


def accepted(db: Database[dict[str, Any]]) -> dict[str, list[str]]:
    """The conversations whose unplaced content an operator accepted, with the digests of the
    problems accepted (none for an acceptance recorded before digests were: it covers
    nothing, and the operator accepts again)."""
    return {
        d["conversation_id"]: list(d.get("digests", []))
        for d in db[STATE].find({"kind": ACCEPTANCE})
    }
