"""The order conversations are migrated in: spread over the id space, resumable exactly.

Processing ids in sorted order would send every batch to one chunk of a
sharded `agent_messages` (the shard key starts with `conversation_id`): a
freshly sharded, empty collection would take the whole corpus on one shard.
Instead the id space is cut into up to `spread` ranges of about equal size
(one `$bucketAuto` pass over the distinct ids, recorded in the migration
state so a resumed run cuts the same way), and each batch takes its ids in
turn from every range. Within a range ids go in sorted order, so the
checkpoint is the last id done in each range and a resume continues each
range right after it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from bson import Decimal128, ObjectId
from pymongo.database import Database
from pymongo.errors import OperationFailure

_END = object()


@dataclass
class Ranges:
    """Where each range of conversation ids starts (the first is open below)."""

    starts: list[Any] = field(default_factory=lambda: [None])
    done: dict[str, Any] = field(default_factory=dict)
    """The last id migrated in each range, by the range's index as a string."""

    def bounds(self, index: int) -> dict[str, Any]:
        """The filter of the conversation ids of range `index`, past its checkpoint."""
        condition: dict[str, Any] = {}
        if self.starts[index] is not None:
            condition["$gte"] = self.starts[index]
        if index + 1 < len(self.starts):
            condition["$lt"] = self.starts[index + 1]
        clauses = [{"conversation_id": condition}] if condition else []
        if str(index) in self.done:
            clauses.append(after("conversation_id", self.done[str(index)]))
        return {"$and": clauses} if len(clauses) > 1 else next(iter(clauses), {})


_TYPE_FLOORS: tuple[tuple[type | tuple[type, ...], Any], ...] = (
    (type(None), None),
    ((int, float, Decimal128), float("-inf")),
    (str, ""),
    (dict, {}),
    (bytes, b""),
    (ObjectId, ObjectId("0" * 24)),
    (bool, False),
    (datetime, datetime(1, 1, 1, tzinfo=UTC)),
)
"""The BSON types a legacy conversation id may have, in the order MongoDB sorts values of
different types, each with the least value of its type."""


def _type_rank(value: Any) -> int:
    """Where a value's type sorts among `_TYPE_FLOORS` (a bool is no number here)."""
    if isinstance(value, bool):
        return next(i for i, (kind, _) in enumerate(_TYPE_FLOORS) if kind is bool)
    return next(
        (i for i, (kind, _) in enumerate(_TYPE_FLOORS) if isinstance(value, kind)),
        len(_TYPE_FLOORS),
    )


def after(field: str, value: Any) -> dict[str, Any]:
    """The filter of documents whose `field` sorts after `value` as MongoDB sorts across
    BSON types: `$gt` compares only within one type, so a resume past a number would never
    reach the strings and ObjectIds after it. Each later type is reached from its least
    value (`$gte`, which compares within that type too)."""
    later = [{field: {"$gte": floor}} for _, floor in _TYPE_FLOORS[_type_rank(value) + 1 :]]
    return {"$or": [{field: {"$gt": value}}, *later]}


def plan_ranges(
    db: Database[dict[str, Any]], source: str, match: dict[str, Any], spread: int
) -> Ranges:
    """Cut the distinct conversation ids of `source` into up to `spread` ranges.

    One range (plain sorted order) when `spread` is 1, when the server cannot
    `$bucketAuto`, or when the ids are not all strings (ranges of mixed types
    would not compare across types).
    """
    if spread <= 1:
        return Ranges()
    pipeline: list[dict[str, Any]] = [
        {"$match": match},
        {"$group": {"_id": "$conversation_id"}},
        {"$bucketAuto": {"groupBy": "$_id", "buckets": spread}},
    ]
    try:
        buckets = list(db[source].aggregate(pipeline, allowDiskUse=True))
    except OperationFailure:
        return Ranges()
    edges = [b["_id"]["min"] for b in buckets] + [b["_id"]["max"] for b in buckets[-1:]]
    if len(buckets) < 2 or not all(isinstance(edge, str) for edge in edges):
        return Ranges()
    return Ranges([None] + [b["_id"]["min"] for b in buckets[1:]])


def range_ids(
    db: Database[dict[str, Any]], source: str, match: dict[str, Any], bounds: dict[str, Any]
) -> Iterator[Any]:
    """The sorted distinct conversation ids of `source`'s documents matching `match` within
    `bounds` (a filter), streamed from the server. The bounds filter before grouping, so a
    range reads its own documents (through the conversation id index), not the whole
    collection."""
    within = {"$and": [match, bounds]} if bounds else match
    pipeline: list[dict[str, Any]] = [
        {"$match": within},
        {"$group": {"_id": "$conversation_id"}},
        {"$sort": {"_id": 1}},
    ]
    for doc in db[source].aggregate(pipeline, allowDiskUse=True, batchSize=1000):
        yield doc["_id"]


def spread_ids(
    db: Database[dict[str, Any]], source: str, match: dict[str, Any], ranges: Ranges
) -> Iterator[tuple[int, Any]]:
    """(range, id) of every conversation not done yet, taking one id from each range in turn."""
    cursors = {
        index: range_ids(db, source, match, ranges.bounds(index))
        for index in range(len(ranges.starts))
    }
    while cursors:
        for index in list(cursors):
            conversation_id = next(cursors[index], _END)
            if conversation_id is _END:
                del cursors[index]
            else:
                yield index, conversation_id


_TIME_ORDERED = (
    (
        "a UUID of version 1, 6 or 7",
        re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[167][0-9a-f]{3}-", re.I),
    ),
    ("an ObjectId", re.compile(r"^[0-9a-f]{24}\Z", re.I)),
    ("a ULID", re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}\Z")),
    ("a number", re.compile(r"^\d+\Z")),
)


def id_clustering(ids: Iterable[Any]) -> tuple[int, Counter[str]]:
    """How many ids were looked at, and how many of them are time-ordered, by kind.

    Time-ordered ids (UUIDv1/v6/v7, ObjectIds, ULIDs, counters) sort new
    conversations after old ones, so on `agent_messages` sharded by
    `{conversation_id, seq}` every new conversation lands in the last chunk.
    """
    kinds: Counter[str] = Counter()
    seen = 0
    for conversation_id in ids:
        seen += 1
        text = str(conversation_id)
        kind = next((name for name, pattern in _TIME_ORDERED if pattern.match(text)), None)
        if kind is not None or not isinstance(conversation_id, str):
            kinds[kind or f"a {type(conversation_id).__name__}"] += 1
    return seen, kinds
