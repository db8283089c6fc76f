"""Step 2 of the protocol: explode legacy turns into messages, conversation by conversation.

Streaming: one aggregation cursor yields the legacy conversation ids in order
(the server groups them, spilling to disk if it must); each batch of ids is
read with one `find` on the `conversation_id` index. Memory holds one batch of
conversations at a time: bounded by `--batch-size` times the largest
conversation, not by the corpus.

Per batch, writes are few and idempotent:
1. conversation documents by upsert (`ReplaceOne`, only over documents the
   migration wrote itself: a conversation the live logger has already written
   to is never overwritten);
2. messages with their deterministic ids by one unordered `insert_many`;
   duplicate-key errors of identical documents (a rerun, or a resumed kill)
   are the only errors accepted;
3. problems by upsert, with ids from the conversation and their position;
4. the run record (counts, checkpoint) and the lock's lease.

Conversation documents go first, so a turn the live logger logs meanwhile
reserves `seq` values after the migrated ones. A kill between any two writes
is repaired by the next run, which recomputes the same documents.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pymongo import ReplaceOne
from pymongo.database import Database
from pymongo.errors import BulkWriteError

from agent_store.core import InvalidInput, message_adapter, utc_now
from agent_store.legacy import (
    LEGACY_TURNS,
    SESSION_HITL,
    LegacyConversion,
    Problem,
    convert,
    with_session_prompts,
)
from agent_store.store import CONVERSATIONS, DUPLICATE_KEY, MESSAGES, TurnRules
from migrations.lease import STATE, Lease
from migrations.relocate import TURN_FILTER

PROBLEMS = "agent_migration_problems"
STATE_ID = "state:legacy-turns"
LEGACY_FILTER: dict[str, Any] = {**TURN_FILTER, "dual_write": {"$ne": True}}
"""Legacy turns, but not those the new logger wrote for rollback: their messages are stored."""


@dataclass
class Options:
    dry_run: bool = False
    limit: int | None = None
    conversation: str | None = None
    batch_size: int = 100
    restart: bool = False


@dataclass
class Counts:
    conversations: int = 0
    turns: int = 0
    messages: int = 0
    """Messages the legacy turns convert to."""
    inserted: int = 0
    """Messages written by this run (the rest were already there)."""
    conversations_written: int = 0
    live_skipped: int = 0
    """Conversations whose first `seq` values already hold other messages."""
    problems: int = 0
    problems_by_kind: dict[str, int] = field(default_factory=dict)

    def as_document(self) -> dict[str, Any]:
        return dict(self.__dict__)


def conversation_ids(
    db: Database[dict[str, Any]], *, after: Any = None, source: str = LEGACY_TURNS
) -> Iterator[Any]:
    """Every legacy conversation id, sorted, streamed from the server."""
    pipeline: list[dict[str, Any]] = [
        {"$match": LEGACY_FILTER},
        {"$group": {"_id": "$conversation_id"}},
        {"$sort": {"_id": 1}},
    ]
    if after is not None:
        pipeline.append({"$match": {"_id": {"$gt": after}}})
    for doc in db[source].aggregate(pipeline, allowDiskUse=True, batchSize=1000):
        yield doc["_id"]


def count_conversations(db: Database[dict[str, Any]], *, source: str = LEGACY_TURNS) -> int:
    pipeline: list[dict[str, Any]] = [
        {"$match": LEGACY_FILTER},
        {"$group": {"_id": "$conversation_id"}},
        {"$count": "n"},
    ]
    found = list(db[source].aggregate(pipeline, allowDiskUse=True))
    return int(found[0]["n"]) if found else 0


def batches(ids: Iterator[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for conversation_id in ids:
        batch.append(conversation_id)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def read_turns(
    db: Database[dict[str, Any]], ids: list[Any], *, source: str = LEGACY_TURNS
) -> dict[Any, list[dict[str, Any]]]:
    """The turns of some conversations, each list in stored order."""
    grouped: dict[Any, list[dict[str, Any]]] = {i: [] for i in ids}
    for doc in db[source].find({"conversation_id": {"$in": ids}, **LEGACY_FILTER}):
        grouped.setdefault(doc["conversation_id"], []).append(doc)
    return grouped


def read_session_hitl(db: Database[dict[str, Any]], ids: list[str]) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {i: [] for i in ids}
    query = {"$or": [{"conversation_id": {"$in": ids}}, {"session_id": {"$in": ids}}]}
    for doc in db[SESSION_HITL].find(query):
        key = doc.get("conversation_id") or doc.get("session_id")
        if key in found:
            found[key].append(doc)
    return found


def convert_batch(
    db: Database[dict[str, Any]], ids: list[Any], rules: TurnRules, *, source: str = LEGACY_TURNS
) -> tuple[list[LegacyConversion], list[Problem], int]:
    """Read and convert a batch: conversions, problems of unconvertible ones, turns read."""
    grouped = read_turns(db, ids, source=source)
    conversions: list[LegacyConversion] = []
    failed: list[Problem] = []
    turns = 0
    for conversation_id, documents in grouped.items():
        turns += len(documents)
        if not documents:
            continue
        try:
            conversions.append(convert(documents, rules=rules))
        except InvalidInput as exc:
            failed.append(
                Problem(
                    conversation_id=str(conversation_id),
                    legacy_id=str(documents[0].get("_id")),
                    kind="invalid_conversation",
                    detail=exc.message + f"; its {len(documents)} turns stay in {source}",
                )
            )
    hitl = read_session_hitl(db, [c.conversation_id for c in conversions])
    for conversion in conversions:
        with_session_prompts(conversion, hitl.get(conversion.conversation_id, []))
    return conversions, failed, turns


class Explosion:
    """One run of the migration."""

    def __init__(
        self,
        db: Database[dict[str, Any]],
        options: Options,
        *,
        lease: Lease | None,
        rules: TurnRules | None = None,
        source: str = LEGACY_TURNS,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        self.db = db
        self.options = options
        self.lease = lease
        self.rules = rules or TurnRules()
        self.source = source
        self.on_batch = on_batch
        self.counts = Counts()
        self.run_id = lease.run_id if lease else "dry-run-" + uuid.uuid4().hex[:8]
        self.started = time.monotonic()

    # -- the run record ------------------------------------------------------------------

    def _record(self, status: str, **extra: Any) -> None:
        if self.options.dry_run:
            return
        self.db[STATE].update_one(
            {"_id": self.run_id},
            {
                "$set": {
                    "kind": "run",
                    "status": status,
                    "updated_at": utc_now(),
                    "seconds": round(time.monotonic() - self.started, 3),
                    "counts": self.counts.as_document(),
                    **extra,
                },
                "$setOnInsert": {"started_at": utc_now(), "options": self.options.__dict__},
            },
            upsert=True,
        )

    def resume_point(self) -> Any:
        if self.options.restart or self.options.conversation is not None:
            return None
        state = self.db[STATE].find_one({"_id": STATE_ID}) or {}
        return None if state.get("complete", True) else state.get("checkpoint")

    def _checkpoint(self, last: Any, *, complete: bool) -> None:
        if self.options.dry_run or self.options.conversation is not None:
            return
        self.db[STATE].update_one(
            {"_id": STATE_ID},
            {"$set": {"checkpoint": last, "complete": complete, "run_id": self.run_id}},
            upsert=True,
        )

    # -- the loop ------------------------------------------------------------------------

    def total(self, after: Any) -> int:
        if self.options.conversation is not None:
            return 1
        total = count_conversations(self.db, source=self.source)
        if after is not None:
            done = self.db[self.source].aggregate(
                [
                    {"$match": {"conversation_id": {"$lte": after}, **LEGACY_FILTER}},
                    {"$group": {"_id": "$conversation_id"}},
                    {"$count": "n"},
                ]
            )
            total -= next((int(d["n"]) for d in done), 0)
        if self.options.limit is not None:
            total = min(total, self.options.limit)
        return total

    def ids(self, after: Any) -> Iterator[Any]:
        if self.options.conversation is not None:
            return iter([self.options.conversation])
        ids = conversation_ids(self.db, after=after, source=self.source)
        if self.options.limit is None:
            return ids
        limit = self.options.limit
        return (i for n, i in enumerate(ids) if n < limit)

    def run(self, after: Any) -> Counts:
        self._record("running", checkpoint_at_start=after)
        exhausted = True
        last = after
        try:
            for batch in batches(self.ids(after), self.options.batch_size):
                self.batch(batch)
                last = batch[-1]
                self._checkpoint(last, complete=False)
                self._record("running", checkpoint=last)
                if self.lease is not None and not self.options.dry_run:
                    self.lease.renew()
                if self.on_batch is not None:
                    self.on_batch(len(batch), self.counts.turns)
            if self.options.limit is not None and self.options.conversation is None:
                exhausted = (
                    next(conversation_ids(self.db, after=last, source=self.source), None) is None
                )
        except BaseException as exc:
            self._record("failed", error=f"{type(exc).__name__}: {exc}", finished_at=utc_now())
            raise
        self._checkpoint(None if exhausted else last, complete=exhausted)
        self._record("completed" if exhausted else "stopped", finished_at=utc_now())
        return self.counts

    def batch(self, ids: list[Any]) -> None:
        conversions, failed, turns = convert_batch(self.db, ids, self.rules, source=self.source)
        self.counts.conversations += len(ids)
        self.counts.turns += turns
        problems = list(failed)
        for conversion in conversions:
            self.counts.messages += len(conversion.messages)
            problems += conversion.problems
        if not self.options.dry_run:
            problems += self._write(conversions)
        self.counts.problems += len(problems)
        for problem in problems:
            kinds = self.counts.problems_by_kind
            kinds[problem.kind] = kinds.get(problem.kind, 0) + 1
        if problems and not self.options.dry_run:
            self._store_problems(problems)

    # -- writes --------------------------------------------------------------------------

    def _write(self, conversions: list[LegacyConversion]) -> list[Problem]:
        wanted = [c for c in conversions if c.conversation is not None]
        if not wanted:
            return []
        ids = [c.conversation_id for c in wanted]
        existing = {
            d["_id"]: d
            for d in self.db[CONVERSATIONS].find({"_id": {"$in": ids}}, {"turns": {"$slice": 1}})
        }
        taken: dict[tuple[str, int], str] = {}
        for doc in self.db[MESSAGES].find(
            {"$or": [{"conversation_id": c.conversation_id, "seq": {"$lt": len(c.messages)}}
                     for c in wanted]},
            {"conversation_id": 1, "seq": 1},
        ):  # fmt: skip
            taken[(doc["conversation_id"], doc["seq"])] = doc["_id"]
        problems: list[Problem] = []
        ready: list[LegacyConversion] = []
        for conversion in wanted:
            foreign = [
                m.seq
                for m in conversion.messages
                if taken.get((conversion.conversation_id, m.seq or 0), m.id) != m.id
            ]
            if foreign:
                self.counts.live_skipped += 1
                problems.append(_live_problem(conversion, foreign))
            else:
                ready.append(conversion)
        upserts = [
            ReplaceOne(
                {"_id": c.conversation_id, "turns.0": {"$exists": False}},  # not live
                c.conversation.model_dump(by_alias=True),
                upsert=True,
            )
            for c in ready
            if c.conversation is not None
            and not (existing.get(c.conversation_id) or {}).get("turns")
        ]
        if upserts:
            try:
                result = self.db[CONVERSATIONS].bulk_write(upserts, ordered=False)
                self.counts.conversations_written += result.upserted_count + result.modified_count
            except BulkWriteError as exc:
                # Only a conversation that went live meanwhile: the logger's document stays.
                if any(e.get("code") != DUPLICATE_KEY for e in exc.details["writeErrors"]):
                    raise
        documents = [
            m.model_dump(by_alias=True)
            for c in ready
            for m in c.messages
            if (c.conversation_id, m.seq) not in taken
        ]
        if documents:
            try:
                self.db[MESSAGES].insert_many(documents, ordered=False)
                self.counts.inserted += len(documents)
            except BulkWriteError as exc:
                problems += self._accept_identical(exc, documents)
        return problems

    def _accept_identical(
        self, error: BulkWriteError, documents: list[dict[str, Any]]
    ) -> list[Problem]:
        """Duplicates of identical documents are a resumed run; other collisions a live race."""
        errors = error.details.get("writeErrors", [])
        if any(e.get("code") != DUPLICATE_KEY for e in errors):
            raise error
        self.counts.inserted += len(documents) - len(errors)
        failed = [documents[e["index"]] for e in errors]
        stored = {
            d["_id"]: d
            for d in self.db[MESSAGES].find({"_id": {"$in": [f["_id"] for f in failed]}})
        }
        problems: list[Problem] = []
        for wanted in failed:
            found = stored.get(wanted["_id"])
            same = found is not None and message_adapter.validate_python(
                found
            ) == message_adapter.validate_python(wanted)
            if not same:
                problems.append(
                    Problem(
                        conversation_id=wanted["conversation_id"],
                        legacy_id=str(wanted.get("turn_id")),
                        kind="live_conflict",
                        detail=f"seq {wanted['seq']} was taken by another message during the run",
                        content=wanted,
                    )
                )
        return problems

    def _store_problems(self, problems: list[Problem]) -> None:
        ordinal: dict[str, int] = {}
        operations = []
        for problem in problems:
            n = ordinal.get(problem.conversation_id, 0)
            ordinal[problem.conversation_id] = n + 1
            operations.append(
                ReplaceOne(
                    {"_id": f"{problem.conversation_id}|{problem.kind}|{n}"},
                    problem.model_dump(),
                    upsert=True,
                )
            )
        self.db[PROBLEMS].bulk_write(operations, ordered=False)


def _live_problem(conversion: LegacyConversion, foreign: list[int | None]) -> Problem:
    return Problem(
        conversation_id=conversion.conversation_id,
        legacy_id="*",
        kind="conversation_already_live",
        detail=(
            f"{len(foreign)} of the first {len(conversion.messages)} seq values already hold "
            "messages the migration did not write (the conversation was logged to before it was "
            "migrated); its legacy turns were not merged"
        ),
    )
