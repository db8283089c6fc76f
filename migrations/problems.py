"""The problem report (`agent_migration_problems`): what the converter could not place as it
was, or changed; a summary by kind; and the operator's recorded acceptance of a
conversation's unplaced content.

Each problem is recorded with a digest of all it says (`digest`): an acceptance covers the
digests accepted, so content edited after the run or after the acceptance is never dropped
as accepted. A record counts as a problem the converter finds now only when it holds what
that problem's record holds, field by field (`held`): never by the digest it names alone,
so a record whose content, kind or turn was edited by hand keeps nothing.

Each run replaces the problems of the conversations it converts, so the report
always says what the current code makes of the legacy turns; problems found a chunk at a
time whatever their conversations (orphan prompts) are recorded as found, marked with the
run, and the records of their kind the run did not find are then deleted. A problem whose
content is too large to hold keeps it in GridFS, like a cut message.
"""

from __future__ import annotations

import getpass
import hashlib
import socket
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
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


def _document(
    problem: Problem, document_id: str, problem_digest: str, *, at: datetime
) -> tuple[dict[str, Any], FullText | None]:
    """The problem as a document, and its whole content when too large to hold in one."""
    document = {"_id": document_id, **problem.model_dump(), "digest": problem_digest}
    if len(bson.encode(document)) <= PROBLEM_BYTES:
        return document, None
    text = dumps(problem.content)[0]
    full = FullText(
        blob_id(document_id, "content"), problem.conversation_id, document_id, "content", text, at
    )
    document |= {
        "content": None,
        "content_blob_id": full.blob_id,
        "content_length": len(text),
        "content_sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
    return document, full


def _as_kept(db: Database[dict[str, Any]], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records, each whose content kept in GridFS is not there as it says (the file
    missing, unreadable or holding another text: a run killed while writing it) with the
    digest "", which matches nothing: what it keeps is not recorded, and a run writes it."""
    found = full_texts.texts(db, (r["content_blob_id"] for r in records if _in_a_file(r)))
    return [r if _file_holds(r, found) else r | {"digest": ""} for r in records]


def _in_a_file(record: dict[str, Any]) -> bool:
    return isinstance(record.get("content_blob_id"), str)


def _file_holds(record: dict[str, Any], found: dict[str, str]) -> bool:
    if not _in_a_file(record):
        return True
    text = found.get(record["content_blob_id"])
    if text is None:
        return False
    if "content_sha256" not in record:  # recorded before the digest was
        return len(text) == record.get("content_length")
    return hashlib.sha256(text.encode()).hexdigest() == str(record["content_sha256"])


_ASIDE = ("run_id",)
"""What a record holds beside the problem's record: the run that found it (`record_found`)."""
_WHENEVER = datetime(1970, 1, 1, tzinfo=UTC)


def held(records: Iterable[dict[str, Any]], problems: Iterable[Problem]) -> Counter[str]:
    """The digests of `problems` recorded as they are found now, once per record: a record
    counts when it names a problem's digest and holds what that problem's record under its
    `_id` holds, every field as BSON stores it (`_holds`; the run that found it aside), its
    content kept in GridFS there as it says (`_as_kept`). So a record whose content was
    redacted or removed, or whose kind, turn, field or placement was edited by hand, counts
    for nothing, whatever digest it names."""
    wanted = {digest(problem): problem for problem in problems}
    found: Counter[str] = Counter()
    for record in records:
        named = str(record.get("digest"))
        if (problem := wanted.get(named)) is None:
            continue
        if _holds(record, _document(problem, str(record["_id"]), named, at=_WHENEVER)[0]):
            found[named] += 1
    return found


def _holds(record: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether the record holds every field of `wanted`, and no other, as BSON stores them:
    each value by its BSON (a time to the millisecond, `120` apart from `120.0`, a NaN as
    the NaN stored), so a record read back equals the one written."""
    keys = [key for key in wanted if key not in _ASIDE]
    if set(keys) != {key for key in record if key not in _ASIDE}:
        return False
    return all(_as_stored(record[key]) == _as_stored(wanted[key]) for key in keys)


def _as_stored(value: Any) -> bytes:
    return bson.encode({"value": value})


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
        document_id = f"{problem.conversation_id}|{problem.kind}|{n}"
        document, full = _document(problem, document_id, digest(problem), at=at)
        documents.append(document)
        kept += [full] if full else []
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


def found_id(problem: Problem, problem_digest: str) -> str:
    """The id `record_found` records a problem under: of what it says (conversation, kind,
    digest), the same on every run whatever else is found with it."""
    return f"{problem.conversation_id}|{problem.kind}|{problem_digest}"


def record_found(
    db: Database[dict[str, Any]],
    problems: Sequence[Problem],
    *,
    run_id: str,
    at: datetime,
    bounds: Bounds,
) -> None:
    """Record problems a run finds a chunk at a time, whatever their conversations: each
    under `found_id`, marked with the run (`run_id`); `drop_not_found_by` then deletes the
    records of their kind this run did not find."""
    documents: list[dict[str, Any]] = []
    kept: list[FullText] = []
    for problem in problems:
        problem_digest = digest(problem)
        document, full = _document(
            problem, found_id(problem, problem_digest), problem_digest, at=at
        )
        documents.append(document | {"run_id": run_id})
        kept += [full] if full else []
    full_texts.keep(db, kept, bounds)
    _upsert(db, documents, bounds)


def drop_not_found_by(db: Database[dict[str, Any]], kind: str, run_id: str) -> None:
    """Make the recorded problems of `kind` exactly those the run `run_id` recorded
    (`record_found`): one command, however many there are."""
    db[PROBLEMS].delete_many({"kind": kind, "run_id": {"$ne": run_id}})


def recorded_found(db: Database[dict[str, Any]], problems: Sequence[Problem]) -> set[str]:
    """The digests of these problems recorded as they are now by `record_found` (`held`)."""
    ids = [found_id(p, digest(p)) for p in problems]
    return set(held(_as_kept(db, list(db[PROBLEMS].find({"_id": {"$in": ids}}))), problems))


def _upsert(
    db: Database[dict[str, Any]], documents: Sequence[dict[str, Any]], bounds: Bounds
) -> None:
    operations = [ReplaceOne({"_id": d["_id"]}, d, upsert=True) for d in documents]
    sizes = [len(bson.encode(d)) for d in documents]
    for run in bounded(operations, sizes, bounds):
        db[PROBLEMS].bulk_write(run, ordered=False)


def summary(db: Database[dict[str, Any]]) -> list[tuple[str, bool, int]]:
    """(kind, placed, count) of every recorded problem, most frequent first; a kind edited by
    hand to another value than text (or removed) is counted under its text (`"None"`)."""
    rows = db[PROBLEMS].aggregate(
        [{"$group": {"_id": {"kind": "$kind", "placed": "$placed"}, "n": {"$sum": 1}}}]
    )
    found = [(str(r["_id"].get("kind")), bool(r["_id"].get("placed")), int(r["n"])) for r in rows]
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


def records(
    db: Database[dict[str, Any]], conversation_ids: Iterable[str], *, placed: bool | None = False
) -> dict[str, list[dict[str, Any]]]:
    """The problem records of these conversations, by conversation: the unplaced ones (with
    `placed`, the placed ones; `None`, all), whole, as `held` compares them (a record whose
    content kept in GridFS is not there as it says has the digest "": it matches nothing)."""
    query: dict[str, Any] = {"conversation_id": {"$in": sorted(set(conversation_ids))}}
    if placed is not None:
        query["placed"] = placed
    found: dict[str, list[dict[str, Any]]] = {}
    for doc in _as_kept(db, list(db[PROBLEMS].find(query))):
        found.setdefault(str(doc["conversation_id"]), []).append(doc)
    return found


def unplaced(
    db: Database[dict[str, Any]], conversation_ids: Iterable[str], *, placed: bool = False
) -> dict[str, list[tuple[str, str]]]:
    """(kind, digest) of the unplaced problems (with `placed`, the placed ones) recorded for
    each of these conversations (a record without a digest, of an older run, or whose content
    kept in GridFS is not there as it says, has the digest "": it matches nothing)."""
    return {
        cid: [(str(r.get("kind")), str(r.get("digest", ""))) for r in found]
        for cid, found in records(db, conversation_ids, placed=placed).items()
    }


def recorded_for(db: Database[dict[str, Any]], conversation_id: str) -> bool:
    """Whether a problem, placed or not, is recorded for the conversation (by the id the
    record names: a prompt without legacy turns names the conversation its prompt does)."""
    return db[PROBLEMS].find_one({"conversation_id": conversation_id}, {"_id": 1}) is not None


def accept(db: Database[dict[str, Any]], conversation_id: str, note: str | None) -> list[str]:
    """Record that an operator accepts the conversation's unplaced content, as recorded now,
    as kept elsewhere: its problems' kinds (for people) and digests (what it covers); the
    kinds accepted (none when it records no unplaced content: nothing is covered)."""
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
    return sorted(kind for kind, _ in recorded)


def accepted(db: Database[dict[str, Any]]) -> dict[str, list[str]]:
    """The conversations whose unplaced content an operator accepted, with the digests of the
    problems accepted (none for an acceptance recorded before digests were: it covers
    nothing, and the operator accepts again)."""
    return {
        d["conversation_id"]: list(d.get("digests", []))
        for d in db[STATE].find({"kind": ACCEPTANCE})
    }
