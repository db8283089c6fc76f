"""The order conversations are migrated in: spread over the id space, resumable exactly.

Processing ids in sorted order would send every batch to one chunk of a
sharded `agent_messages` (the shard key starts with `conversation_id`): a
freshly sharded, empty collection would take the whole corpus on one shard.
Instead the id space is cut into up to `spread` ranges of about equal size
(one `$bucketAuto` pass over the distinct ids, recorded in the migration
state so a resumed run cuts the same way), and each batch takes its ids in
turn from every range. Within a range ids go kind by kind (`_BRACKETS`: no
order across BSON types is assumed, since servers differ), each kind in sorted
order, so the checkpoint is the last id done in each range with its kind, and a
resume continues each range right after it.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from bson import Decimal128, ObjectId
from pymongo.database import Database
from pymongo.errors import OperationFailure

from agent_store.legacy import not_utf8_at, texts_not_identifiers
from migrations.keys import id_key

_END = object()

_BRACKETS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("null", {"$eq": None}),
    ("number", {"$type": "number"}),
    ("string", {"$type": "string"}),
    ("objectId", {"$type": "objectId"}),
    ("bool", {"$type": "bool"}),
    ("date", {"$type": "date"}),
)
"""The kinds of conversation id read one after another, each by its own query: within one
kind every server sorts, and compares with `$gt`, alike; across kinds they do not (the
embedded server sorts 64-bit integers after text), so a checkpoint never compares ids of two
kinds. An array matches these by its elements: it is read with `REST`."""
_ARRAY = {"conversation_id": {"$type": "array"}}
_NOT_ARRAY = {"conversation_id": {"$not": {"$type": "array"}}}
REST = "rest"
"""Every other id (an array, an embedded document, binary data, JavaScript code), read last,
in the server's order (embedded documents and arrays after the others, by their BSON:
`_NESTED`); a resume skips those up to the checkpoint, found by its BSON."""
_NESTED = {"$or": [
    {"conversation_id": {"$type": "object"}}, _ARRAY, {"conversation_id.$ref": {"$exists": True}},
]}  # fmt: skip
"""The ids of `REST` that are an embedded document or an array (a DBRef too, which the
embedded server types apart): such a value may hold one a server cannot group (the embedded
one refuses a DBRef; a real MongoDB groups it), so the client lists them (`_nested_ids`)."""
GROUPED = {"$nor": [_NESTED]}
"""The turns whose conversation id every server groups (`$group`): not `_NESTED`."""
_KINDS = [name for name, _ in _BRACKETS] + [REST]


def kind_of(value: Any) -> str:
    """The kind an id read from the server is read under (a checkpoint recorded before kinds
    were: its Python type says it)."""
    if isinstance(value, list | dict):
        return REST
    for name, python_type in _PYTHON_TYPES:
        if isinstance(value, python_type) and not (name == "number" and isinstance(value, bool)):
            return name
    return REST


_PYTHON_TYPES: tuple[tuple[str, Any], ...] = (
    ("null", type(None)),
    ("bool", bool),
    ("number", (int, float, Decimal128)),
    ("string", str),
    ("objectId", ObjectId),
    ("date", datetime),
)


@dataclass
class Ranges:
    """Where each range of conversation ids starts (the first is open below)."""

    starts: list[Any] = field(default_factory=lambda: [None])
    done: dict[str, Any] = field(default_factory=dict)
    """The last id migrated in each range, by the range's index as a string."""
    kinds: dict[str, str] = field(default_factory=dict)
    """The kind each range's last id was read under (`_BRACKETS`, `REST`)."""
    passed: dict[str, list[bytes]] = field(default_factory=dict)
    """The ids read past each range's last id that it cannot record as they are (holding text
    that is not valid UTF-8, which no state document nor query holds), by their `id_key`: a
    resume reads on from the last id recorded and passes over these, so the range's progress
    goes past them, and an id corrected since (another key) is read as any other."""
    cut_by: str | None = None
    """The run that cut them (`Explosion.plan`), which the runs resuming them go on with; None
    when not known (a state recorded before runs recorded it)."""

    def bounds(self, index: int) -> dict[str, Any]:
        """The filter of the conversation ids of range `index` (text, once the id space is
        cut: `plan_ranges`)."""
        condition: dict[str, Any] = {}
        if self.starts[index] is not None:
            condition["$gte"] = self.starts[index]
        if index + 1 < len(self.starts):
            condition["$lt"] = self.starts[index + 1]
        return {"conversation_id": condition} if condition else {}

    def checkpoint(self, index: int) -> tuple[str, Any] | None:
        """(kind, id) of the last id migrated in range `index`, if any."""
        if str(index) not in self.done:
            return None
        value = self.done[str(index)]
        return self.kinds.get(str(index)) or kind_of(value), value

    def mark(self, index: int, kind: str, value: Any) -> None:
        """Record `value` as the last id done in range `index`. One holding text that is not
        valid UTF-8 (`not_utf8_at`) is recorded as passed (`passed`, by its key): the
        checkpoint stays at the last id before it, and a resume passes over it (its problem
        stays recorded), while the same id corrected is another key, read again."""
        if not_utf8_at(value) is not None:
            passed = self.passed.setdefault(str(index), [])
            if id_key(value) not in passed:
                passed.append(id_key(value))
            return
        self.done[str(index)] = value
        self.kinds[str(index)] = kind
        self.passed.pop(str(index), None)


def passed_still_there(
    db: Database[dict[str, Any]], source: str, match: dict[str, Any], ranges: Ranges
) -> bool:
    """Whether every id the ranges passed (`Ranges.passed`) is still an id of `source`'s
    turns matching `match`: one gone was corrected since, to an id that may sort anywhere,
    before a checkpoint too. Found among the ids that may hold such text (text that is no
    identifier, and those of `REST`), by their keys."""
    wanted = {key for keys in ranges.passed.values() for key in keys}
    others = {"$nor": [{"conversation_id": c} for _, c in _BRACKETS]}
    holding = {"$or": [texts_not_identifiers("conversation_id"), others, _ARRAY]}
    if wanted:
        for turn in db[source].find({"$and": [match, holding]}, {"conversation_id": 1}):
            wanted.discard(id_key(turn.get("conversation_id")))
            if not wanted:
                break
    return not wanted


def plan_ranges(
    db: Database[dict[str, Any]], source: str, match: dict[str, Any], spread: int
) -> Ranges:
    """Cut the distinct conversation ids of `source` into up to `spread` ranges.

    One range (plain sorted order) when `spread` is 1, when the server cannot
    `$bucketAuto`, or when any id is not text (ranges of mixed types would not compare
    across types; asked by type, not by the server's order of types).
    """
    if spread <= 1 or not _all_text(db, source, [match]):
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
    sendable = all(isinstance(edge, str) and not_utf8_at(edge) is None for edge in edges)
    if len(buckets) < 2 or not sendable:
        return Ranges()
    return Ranges([None] + [b["_id"]["min"] for b in buckets[1:]])


_NOT_TEXT = {"$or": [{"conversation_id": {"$not": {"$type": "string"}}}, _ARRAY]}
"""The turns whose conversation id is no text (or an array, which `$type` matches by its
elements), or that name none."""


def _all_text(db: Database[dict[str, Any]], source: str, within: list[dict[str, Any]]) -> bool:
    """Whether every conversation id of `source`'s turns matching `within` is text: one read,
    of one document at most."""
    clauses = [c for c in within if c]
    return db[source].find_one({"$and": [*clauses, _NOT_TEXT]}, {"_id": 1}) is None


def range_ids(
    db: Database[dict[str, Any]],
    source: str,
    match: dict[str, Any],
    ranges: Ranges | None = None,
    index: int = 0,
) -> Iterator[tuple[str, Any]]:
    """(kind, id) of the distinct conversation ids of `source`'s documents matching `match`
    in range `index` of `ranges`, past its checkpoint but for those it passed
    (`Ranges.passed`), streamed from the server: kind after kind (`_BRACKETS`, then `REST`),
    each sorted by the server. The range's bounds filter before grouping, so a range reads
    its own documents (through the conversation id index)."""
    ranges = ranges or Ranges()
    passed = set(ranges.passed.get(str(index)) or ())
    found = _ids_past_checkpoint(db, source, match, ranges, index)
    yield from (pair for pair in found if not passed or id_key(pair[1]) not in passed)


def _ids_past_checkpoint(
    db: Database[dict[str, Any]], source: str, match: dict[str, Any], ranges: Ranges, index: int
) -> Iterator[tuple[str, Any]]:
    within = [match, ranges.bounds(index)]
    cut = len(ranges.starts) > 1
    kinds = ["string"] if cut else _KINDS
    checkpoint = ranges.checkpoint(index)
    if checkpoint is not None and checkpoint[0] in kinds:
        kinds = kinds[kinds.index(checkpoint[0]) :]
    # Cut ranges hold text only (`plan_ranges`); an uncut one asks for the other kinds only
    # when a turn's id is no text (one read): most corpora name conversations by text alone.
    if not cut and "string" in kinds and _all_text(db, source, within):
        kinds = ["string"]
    for kind in kinds:
        past = checkpoint[1] if checkpoint is not None and checkpoint[0] == kind else _END
        if kind == REST:
            yield from ((REST, i) for i in _rest_ids(db, source, within, past))
        else:
            yield from ((kind, i) for i in _kind_ids(db, source, within, kind, past))


def _sorted_ids(
    db: Database[dict[str, Any]], source: str, clauses: list[dict[str, Any]]
) -> Iterator[Any]:
    pipeline: list[dict[str, Any]] = [
        {"$match": {"$and": [c for c in clauses if c]}},
        {"$group": {"_id": "$conversation_id"}},
        {"$sort": {"_id": 1}},
    ]
    for doc in db[source].aggregate(pipeline, allowDiskUse=True, batchSize=1000):
        yield doc["_id"]


def _kind_ids(
    db: Database[dict[str, Any]], source: str, within: list[dict[str, Any]], kind: str, past: Any
) -> Iterator[Any]:
    """The ids of one kind, past `past` (`_END`: all); an array the query matched by its
    elements is left to `REST`."""
    condition = dict(next(c for name, c in _BRACKETS if name == kind))
    if kind == "null" and past is not _END:
        return
    if past is not _END:
        # NaN sorts first among numbers, and `$gt` NaN matches nothing.
        nan = isinstance(past, float) and math.isnan(past)
        condition |= {"$ne": past} if nan else {"$gt": past}
    for found in _sorted_ids(db, source, [*within, {"conversation_id": condition}, _NOT_ARRAY]):
        if kind != "null" or found is None:
            yield found


def _rest_ids(
    db: Database[dict[str, Any]], source: str, within: list[dict[str, Any]], past: Any
) -> Iterator[Any]:
    """The ids of no kind of `_BRACKETS` (and arrays), in order (those the server groups in
    its order, then the others by their BSON: `_nested_ids`), past `past`: those up to it are
    skipped when it is still there (found by its BSON), else none is. Such ids are few: one
    more read of them finds the checkpoint."""
    others = {"$nor": [{"conversation_id": c} for _, c in _BRACKETS]}
    clauses = [*within, {"$or": [others, _ARRAY]}]
    skip = past is not _END and any(
        id_key(i) == id_key(past) for i in _every_rest_id(db, source, clauses)
    )
    for found in _every_rest_id(db, source, clauses):
        if skip:
            skip = id_key(found) != id_key(past)
            continue
        yield found


def _every_rest_id(
    db: Database[dict[str, Any]], source: str, clauses: list[dict[str, Any]]
) -> Iterator[Any]:
    """The ids of `REST` matching `clauses`, in order: those the server groups, then the
    embedded documents and arrays (`_NESTED`) the client lists."""
    yield from _sorted_ids(db, source, [*clauses, GROUPED])
    yield from _nested_ids(db, source, [*clauses, _NESTED])


def _nested_ids(
    db: Database[dict[str, Any]], source: str, clauses: list[dict[str, Any]]
) -> Iterator[Any]:
    """The distinct ids of the turns matching `clauses` (`_NESTED`), by their BSON
    (`id_key`): listed by the client, never grouped by the server, which may refuse to group
    such a value: one such turn never stops the listing of every other. Such ids are few."""
    found: dict[bytes, Any] = {}
    for turn in db[source].find({"$and": clauses}, {"conversation_id": 1}):
        found.setdefault(id_key(turn.get("conversation_id")), turn.get("conversation_id"))
    yield from (found[key] for key in sorted(found))


def spread_ids(
    db: Database[dict[str, Any]], source: str, match: dict[str, Any], ranges: Ranges
) -> Iterator[tuple[int, str, Any]]:
    """(range, kind, id) of every conversation not done yet, taking one id from each range in
    turn."""
    cursors = {
        index: range_ids(db, source, match, ranges, index) for index in range(len(ranges.starts))
    }
    while cursors:
        for index in list(cursors):
            found: tuple[str, Any] | None = next(cursors[index], None)
            if found is None:
                del cursors[index]
            else:
                yield index, *found


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
