"""Deletions in progress, recorded apart from the conversations, so that one failing
part-way (its connection dropped after the conversation document went) is finished by the
next delete of the conversation or erasure of its user, which would otherwise find nothing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from agent_store.store._blobs import FullTextStore
from agent_store.store._driver import Database, storage_errors
from agent_store.store._indexes import CONVERSATIONS, DELETIONS, MESSAGES
from agent_store.store._reservation import (
    DELETING,
    UNSTANDING_READ,
    life_told,
    refuse_unless_standing,
    same_as_read,
)


async def refuse_unless_found_standing(
    conversations: Any, query: Mapping[str, Any], what: str
) -> Mapping[str, Any] | None:
    """The refusal of `what` when the conversation `query` finds is no conversation: marked by
    a delete or an erasure (`being_deleted`), or a fork not made yet (`unfinished_fork`). For a
    write `STANDING` fences that matched nothing, or found nothing to do; what it found
    (None: nothing). One round trip, on that path only."""
    with storage_errors("read the conversation"):
        doc: Mapping[str, Any] | None = await conversations.find_one(query, UNSTANDING_READ)
    refuse_unless_standing(str(query["_id"]), doc, what)
    return doc


def recorded_as(conversation_id: str, found: Mapping[str, Any]) -> dict[str, Any]:
    """The records of the deletion of the conversation `found` (as a delete read it): told by
    its `epoch`, or its `created_at` when it had none (`same_conversation`)."""
    told = life_told(epoch=found.get("epoch"), created_at=found.get("created_at"))
    return {"conversation_id": conversation_id, **told}


class DeletionRecords:
    """`agent_deletions`: one record per conversation a delete or an erasure is deleting,
    `{conversation_id, epoch, created_at, user_id, started}`, written before its first
    destructive command and removed as its last step."""

    def __init__(self, db: Database, full_texts: FullTextStore) -> None:
        self._records = db[DELETIONS]
        self._messages = db[MESSAGES]
        self._conversations = db[CONVERSATIONS]
        self._full_texts = full_texts

    async def record(
        self,
        found: Iterable[Mapping[str, Any]],
        user_id: str | None,
        *,
        where: Mapping[str, Any] | None = None,
    ) -> list[Mapping[str, Any]]:
        """Record the deletion of each conversation `found` (`_id`, `epoch`, `created_at`),
        owned by `user_id`, then mark each (`DELETING`) while it is the one found and still
        `user_id`'s (no user's for None), and matches `where` (a state the caller read, as
        `ConversationStore.delete(unchanged_since=…)` asks): turns, their retries and pops are
        refused from then on (`being_deleted`), and forks answer `NotFound`. Answer those
        marked: one claimed (or assigned, or written to) since it was read is not this
        deletion's, left unmarked and its record removed. Two round trips (none for no
        conversation), two more when a mark missed."""
        found = list(found)
        if not found:
            return []
        started = datetime.now(UTC)
        records = [
            {
                "conversation_id": d["_id"],
                "epoch": d.get("epoch"),
                "created_at": d.get("created_at"),
                "user_id": user_id,
                "started": started,
            }
            for d in found
        ]
        as_found = {
            "$or": [same_as_read(d["_id"], d) for d in found],
            "user_id": user_id,
            **(where or {}),
        }
        with storage_errors("record the deletion"):
            await self._records.insert_many(records)
            # Fenced on its own document: no turn, retry or pop interleaves with the
            # deletion, nor writes to what a deletion failing part-way leaves.
            marked = await self._conversations.update_many(as_found, {"$set": {DELETING: started}})
            if marked.matched_count == len(found):
                return found
            held = await self._conversations.find(
                {**as_found, DELETING: {"$ne": None}}, {"epoch": 1, "created_at": 1}
            ).to_list(None)
        ours = [d for d in found if any(_is_of(recorded_as(d["_id"], d), h) for h in held)]
        missed = [d for d in found if d not in ours]
        if missed:
            await self.done(
                {
                    "$or": [recorded_as(d["_id"], d) for d in missed],
                    "user_id": user_id,
                    "started": started,
                }
            )
        return ours

    async def under_way(self, conversation_id: str, found: Mapping[str, Any]) -> bool:
        """Whether a delete or an erasure of the conversation `found` (as read: its `epoch`, or
        its `created_at`) has begun and not finished (or failed part-way): its record is there.
        One round trip."""
        with storage_errors("read the deletions in progress"):
            record = await self._records.find_one(recorded_as(conversation_id, found), {"_id": 1})
        return record is not None

    async def done(self, query: dict[str, Any]) -> None:
        """Remove the records `query` selects: their deletions are finished."""
        with storage_errors("record the deletion"):
            await self._records.delete_many(query)

    async def finish(self, query: dict[str, Any], grace: Callable[[], Awaitable[None]]) -> int:
        """Finish the deletions `query` selects whose conversation is gone (a deletion that
        failed part-way; a conversation still there is left to the delete that finds it):
        after `grace` (a turn that reserved before the deletion may still be inserting), its
        messages go, told by the recorded epoch only (none of a conversation started under
        the id since), with their whole texts, then the records. How many messages."""
        with storage_errors("finish the deletion"):
            records = await self._records.find(query).to_list(None)
            if not records:
                return 0
            alive = await self._conversations.find(
                {"$or": [same_as_read(r["conversation_id"], r) for r in records]},
                {"epoch": 1, "created_at": 1},
            ).to_list(None)
        gone = [r for r in records if not any(_is_of(r, a) for a in alive)]
        if not gone:
            return 0
        await grace()
        with storage_errors("finish the deletion"):
            of_their_epochs = [
                {"conversation_id": r["conversation_id"], "epoch": r.get("epoch")} for r in gone
            ]
            swept = await self._messages.delete_many(
                {
                    "conversation_id": {"$in": list({r["conversation_id"] for r in gone})},
                    "$or": of_their_epochs,
                }
            )
        epochs: dict[str, list[str | None]] = {}
        for r in gone:
            epochs.setdefault(r["conversation_id"], []).append(r.get("epoch"))
        await self._full_texts.forget_conversations(epochs)
        await self.done({"_id": {"$in": [r["_id"] for r in gone]}})
        return int(swept.deleted_count)


def _is_of(record: Mapping[str, Any], conversation: Mapping[str, Any]) -> bool:
    """Whether `conversation` (a document read now) is the one `record` names."""
    told = {"_id": record["conversation_id"]} | life_told(
        epoch=record.get("epoch"), created_at=record.get("created_at")
    )
    return all(conversation.get(field) == value for field, value in told.items())
