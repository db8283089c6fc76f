"""A LangGraph checkpointer on the store: the thread is the conversation, each message stored once.

`AgentStoreSaver(db)` is a `BaseCheckpointSaver` (async and sync methods).
A checkpoint's messages channel is not serialized into the checkpoint: the
messages it adds are logged into `agent_messages` as one idempotent turn
through `AgentMessageLogger` (ordering, tool pairing, hidden-context
stripping, truncation and the conversation summary all apply), and the
checkpoint refers to the transcript by `seq`. A graph that rewrites history
(`RemoveMessage`, an edited message) gets a checkpoint that lists its
messages whole, by `seq` where the transcript holds them and inline where it
does not, marked `agent_store_messages: "rewritten"` in its metadata; a
branch of time travel that leaves a call open which the transcript answers
further on logs its messages from that call again, so the transcript ends as
the branch does (`_langgraph_branches`); so does a put that finds other
messages logged since its parent (two processes resuming one checkpoint: the
logger's `next_seq` and `step` compare-and-sets, `TranscriptLink.place`). Every
other channel, pending writes, metadata, parent links and namespaces are kept
in the `langgraph_checkpoints` collection with LangGraph's serializer.

The thread's owner is `config["configurable"]["user_id"]` (see `owner_key`):
such a graph reads and writes only that user's threads, as a user token does.
Without it the saver acts as a service. Every config the saver hands back names the
owner it was read or written for (`_handed_back`), so LangGraph's time travel through
one is that owner's write. Each checkpoint document names the
user it was written for (`user_id`: a user graph's user; none for a service's,
which are the thread's owner's) and the conversation (its `epoch`, `ThreadLife`);
a user reads only its own thread's, of the conversation it is now (`_readable`),
and a user's write touches its own documents, one naming no user only once the
owner is checked again (`_store`); the thread's owner is admitted once per thread
in a process, and again on rare paths (`_admission`); every reader, a service's too
(`_served`), a list across threads (`_across_threads`) and every copy read only the thread's
current conversation, and refuse one a migration run is writing. What the saver caches of a
thread is of one conversation (`TranscriptLink.tie`). Needs the `langgraph`
extra; see docs/LANGGRAPH.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Collection, Coroutine, Iterator, Sequence
from itertools import repeat
from typing import Any, TypeVar

from bson import Int64
from bson import encode as bson_encode
from bson.errors import InvalidDocument

try:
    from langchain_core.messages import BaseMessage
    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.base import (
        WRITES_IDX_MAP,
        BaseCheckpointSaver,
        ChannelVersions,
        Checkpoint,
        CheckpointMetadata,
        CheckpointTuple,
        get_checkpoint_id,
        get_checkpoint_metadata,
    )
    from langgraph.checkpoint.serde.base import SerializerProtocol
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "agent_store.integrations.langgraph needs LangGraph: "
        "install agent-conversation-store[langgraph]"
    ) from exc

from pymongo import ASCENDING, DESCENDING, IndexModel
from pymongo.errors import BulkWriteError, DuplicateKeyError

from agent_store.core import Conflict, Conversation, InvalidInput, NotFound, StoreError
from agent_store.integrations._langgraph_documents import (
    CHECKPOINTS,
    REWRITTEN,
    SeqRange,
    before_the_answers,
    check_metadata_keys,
    checkpoint_key,
    decode_segments,
    encode_segments,
    is_rewritten,
    life_of,
    metadata_filter,
    pending_writes,
    readable_by,
    remap_segments,
    write_entries,
)
from agent_store.integrations._langgraph_transcript import Admission, Owner, TranscriptLink
from agent_store.store import (
    THREAD_CONVERSATION,
    THREAD_EPOCH,
    AgentMessageLogger,
    ConversationStore,
    Database,
    ThreadLife,
    async_database,
    being_migrated,
    only_duplicates,
    storage_errors,
    validate_identifier,
)

__all__ = ["CHECKPOINTS", "REWRITTEN", "AgentStoreSaver"]

T = TypeVar("T")

CHECKPOINT_INDEXES: dict[str, list[IndexModel]] = {
    CHECKPOINTS: [
        IndexModel(
            [("thread_id", ASCENDING), ("checkpoint_ns", ASCENDING), ("checkpoint_id", DESCENDING)]
        ),
        IndexModel([("metadata.run_id", ASCENDING)], sparse=True),
        IndexModel([("thread_id", ASCENDING), ("extras.seq", ASCENDING)], sparse=True),
        # Erasing a user and claiming an account select the documents written for one user.
        IndexModel([("user_id", ASCENDING)], sparse=True),
    ],
}
"""The saver's own indexes, beside the store's."""


class AgentStoreSaver(BaseCheckpointSaver[int]):
    """LangGraph checkpoints in MongoDB, the messages channel in the conversation store.

    Takes the same database handles as the store (PyMongo `AsyncDatabase`, Motor).
    The synchronous methods run the asynchronous ones on the event loop the saver
    was created in (or `loop`), from another thread; created outside any loop, the
    saver runs them on the process's one background loop, which every such saver
    and each of their clones share (a client works on one loop only).
    """

    def __init__(
        self,
        db: Database,
        *,
        logger: AgentMessageLogger | None = None,
        store: ConversationStore | None = None,
        owner_key: str = "user_id",
        messages_key: str = "messages",
        cache_threads: int = 256,
        serde: SerializerProtocol | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Keep checkpoints in `db`. `logger` and `store` default to plain ones on `db`;
        `owner_key` names the `configurable` entry holding the user a graph runs for;
        `messages_key` the channel kept in the transcript; `cache_threads` how many
        threads' messages this process keeps in memory."""
        super().__init__(serde=serde)
        self._db = db = async_database(db)
        self._checkpoints = db[CHECKPOINTS]
        self.logger = logger or AgentMessageLogger(db)
        self.store = store or ConversationStore(db)
        self.owner_key = owner_key
        self.messages_key = messages_key
        self._transcripts = TranscriptLink(
            db,
            self.logger,
            self.store,
            dump=self.serde.dumps_typed,
            load=self.serde.loads_typed,
            cache_threads=cache_threads,
        )
        self._ready = False
        self._loop = loop or _running_loop()

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]) -> AgentStoreSaver:
        """A clone whose serializer accepts more types (LangGraph's strict msgpack); it
        shares this saver's per-thread cache."""
        clone = super().with_allowlist(extra_allowlist)
        assert isinstance(clone, AgentStoreSaver)
        if clone is not self:
            clone._transcripts = self._transcripts.with_serde(
                clone.serde.dumps_typed, clone.serde.loads_typed
            )
        return clone

    async def setup(self) -> None:
        """Create the store's indexes and the saver's (idempotent; done on first use too)."""
        if self._ready:
            return
        await self.logger.ensure_indexes()
        with storage_errors("create the checkpoint indexes"):
            for name, models in CHECKPOINT_INDEXES.items():
                await self._db[name].create_indexes(models)
        self._ready = True

    # -- reading -----------------------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint named by `config`, or the thread's latest; None if there is none."""
        thread_id, checkpoint_ns, checkpoint_id = _address(config)
        owner = self._owner(config)
        readable = await self._readable(thread_id, owner)
        if readable is None:
            return None
        query: dict[str, Any] = {
            "thread_id": thread_id,
            "checkpoint_ns": checkpoint_ns,
            "type": {"$exists": True},
        } | readable
        if checkpoint_id is not None:
            query["checkpoint_id"] = checkpoint_id
        with storage_errors("read the checkpoint"):
            docs = await (
                self._checkpoints.find(query).sort("checkpoint_id", -1).limit(1).to_list(None)
            )
        if not docs:
            return None
        return await self._tuple(docs[0], owner, as_head=True, latest=checkpoint_id is None)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Checkpoints matching `config`, a metadata `filter` and `before`, newest first: of one
        thread what its reader reads (`_readable`); across threads, a service's only, of each
        thread what a list of that thread serves (`_across_threads`)."""
        query = {"type": {"$exists": True}} | metadata_filter(filter)
        configurable = (config or {}).get("configurable") or {}
        owner = self._owner(config or {})
        if "thread_id" in configurable:
            query["thread_id"] = _thread_id(configurable["thread_id"])
        elif owner.user_id is not None:
            raise InvalidInput("invalid list: a user's checkpoints are listed one thread at a time")
        if "checkpoint_ns" in configurable:
            query["checkpoint_ns"] = _text(configurable["checkpoint_ns"], "checkpoint_ns")
        if configurable.get("checkpoint_id") is not None:
            query["checkpoint_id"] = _text(configurable["checkpoint_id"], "checkpoint_id")
        if before is not None:
            query["checkpoint_id"] = {"$lt": _text(get_checkpoint_id(before), "before")}
        if "thread_id" not in query:
            docs = await self._across_threads(query, abs(limit) if limit else None)
        else:
            readable = await self._readable(query["thread_id"], owner)
            if readable is None:
                return
            cursor = self._checkpoints.find(query | readable).sort("checkpoint_id", -1)
            if limit is not None:
                cursor = cursor.limit(limit)
            with storage_errors("list checkpoints"):
                docs = await cursor.to_list(None)
        for doc in docs:
            yield await self._tuple(doc, owner, as_head=False)

    async def _across_threads(
        self, query: dict[str, Any], limit: int | None
    ) -> list[dict[str, Any]]:
        """The checkpoints `query` finds across threads, newest first, `limit` at most: of each
        thread only what a list of that thread serves (`_served`), its current life's or naming
        none, counted before the limit. Read in pages, each with the conversations of the
        threads first seen on it (`ConversationStore.stored_conversations`): two round trips a
        page; one page without a limit, or when none of it is stale; else the next page, from
        where the last ended, twice as long."""
        lives: dict[str, ThreadLife | Conflict | None] = {}
        served: list[dict[str, Any]] = []
        paged, page = query, limit
        while True:
            cursor = self._checkpoints.find(paged).sort([("checkpoint_id", -1), ("_id", -1)])
            if page is not None:
                cursor = cursor.limit(page)
            with storage_errors("list checkpoints"):
                docs = await cursor.to_list(None)
            unknown = {doc["thread_id"] for doc in docs} - lives.keys()
            if unknown:
                found = await self.store.stored_conversations(unknown)
                lives |= {t: self._life_or_refusal(t, found.get(t)) for t in unknown}
            for doc in docs:
                if limit is not None and len(served) >= limit:
                    return served
                life = lives[doc["thread_id"]]
                if isinstance(life, Conflict):  # reached: refused as a list of the thread is
                    raise life
                if _of_life(doc, life):
                    served.append(doc)
            if page is None or limit is None or len(docs) < page or len(served) >= limit:
                return served
            last = docs[-1]
            after = [
                {"checkpoint_id": {"$lt": last["checkpoint_id"]}},
                {"checkpoint_id": last["checkpoint_id"], "_id": {"$lt": last["_id"]}},
            ]
            paged, page = {"$and": [query, {"$or": after}]}, page * 2

    async def _tuple(
        self, doc: dict[str, Any], owner: Owner, *, as_head: bool, latest: bool = False
    ) -> CheckpointTuple:
        checkpoint: Checkpoint = self.serde.loads_typed((doc["type"], doc["checkpoint"]))
        stored = doc.get("messages")
        if stored is not None:
            segments = decode_segments(stored["segments"], self.serde.loads_typed)
            checkpoint["channel_values"][stored["channel"]] = await self._transcripts.materialize(
                doc["thread_id"],
                segments,
                checkpoint_id=doc["checkpoint_id"],
                conversation=ThreadLife.named_by(doc),
                owner=owner,
                as_head=as_head,
                latest=latest,
            )
        address = (doc["thread_id"], doc["checkpoint_ns"])
        parent = doc.get("parent_checkpoint_id")
        return CheckpointTuple(
            config=self._handed_back(*address, doc["checkpoint_id"], owner),
            checkpoint=checkpoint,
            metadata=doc["metadata"],
            parent_config=self._handed_back(*address, parent, owner) if parent else None,
            pending_writes=pending_writes(doc.get("writes") or (), self.serde.loads_typed),
        )

    def _handed_back(
        self, thread_id: str, checkpoint_ns: str, checkpoint_id: str, owner: Owner
    ) -> RunnableConfig:
        """The config of a checkpoint the saver hands back (a state's, its parent's, a put's),
        naming the owner it was read or written for: LangGraph goes on from it as it is (time
        travel, `update_state`), and that write is the same owner's, checked as any other."""
        configurable: dict[str, Any] = {
            "thread_id": thread_id,
            "checkpoint_ns": checkpoint_ns,
            "checkpoint_id": checkpoint_id,
        }
        if owner.user_id is not None:
            configurable[self.owner_key] = owner.user_id
        return {"configurable": configurable}

    # -- writing -----------------------------------------------------------------------------

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Store a checkpoint; its messages channel goes to the transcript (new messages only)."""
        thread_id, checkpoint_ns, parent_id = _address(config)
        checkpoint_id = _text(checkpoint["id"], "checkpoint id")
        owner = self._owner(config)
        values = dict(checkpoint["channel_values"])
        messages = values.pop(self.messages_key, None) if checkpoint_ns == "" else None
        if messages is not None and not _is_messages(messages):
            values[self.messages_key], messages = messages, None
        kind, blob = self.serde.dumps_typed({**checkpoint, "channel_values": values})
        stored_metadata = _storable_metadata(get_checkpoint_metadata(config, metadata))
        await self.setup()
        # A thread's first checkpoint, or one that follows none: the owner is checked again,
        # as the thread may have been deleted (its user erased) and its id taken since.
        first = parent_id is None and checkpoint_ns == ""
        owner, life = await self._rooted(config, owner, parent_id)
        admission = await self._admission(thread_id, owner, again=first)
        _require_life(thread_id, life, admission)
        document: dict[str, Any] = {
            "thread_id": thread_id,
            "checkpoint_ns": checkpoint_ns,
            "checkpoint_id": checkpoint_id,
            "parent_checkpoint_id": parent_id,
            "type": kind,
            "checkpoint": blob,
            "messages": None,
            "metadata": stored_metadata,
            **admission.conversation.marks(),
        }
        if messages is not None:
            segments, extras = await self._transcripts.place(
                thread_id, messages, checkpoint_id=checkpoint_id, parent_id=parent_id, owner=owner
            )
            encoded = encode_segments(segments, self.serde.dumps_typed)
            document["messages"] = {"channel": self.messages_key, "segments": encoded}
            if extras:
                document["extras"] = extras
            if is_rewritten(segments):
                stored_metadata[REWRITTEN] = "rewritten"
        key = checkpoint_key(thread_id, checkpoint_ns, checkpoint_id)
        update: dict[str, Any] = {"$set": document}
        if admission.stamp is not None:
            document["user_id"] = admission.stamp
        else:  # a service's names no user; one it finds there keeps its own
            update["$setOnInsert"] = {"user_id": None}
        await self._store(thread_id, key, update, owner, "store the checkpoint")
        return self._handed_back(thread_id, checkpoint_ns, checkpoint_id, owner)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Append a task's writes to its checkpoint's document (one round trip)."""
        thread_id, checkpoint_ns, checkpoint_id = _address(config)
        if checkpoint_id is None:
            raise InvalidInput("invalid writes: the config names no checkpoint_id")
        entries = write_entries(
            writes,
            _text(task_id, "task_id"),
            _text(task_path, "task_path"),
            WRITES_IDX_MAP,
            self.serde.dumps_typed,
        )
        if not entries:
            return
        await self.setup()
        owner, life = await self._rooted(config, self._owner(config), checkpoint_id)
        admission = await self._admission(thread_id, owner)
        _require_life(thread_id, life, admission)
        update = {
            "$push": {"writes": {"$each": entries}},
            "$setOnInsert": {
                "thread_id": thread_id,
                "checkpoint_ns": checkpoint_ns,
                "checkpoint_id": checkpoint_id,
                "user_id": admission.stamp,
                **admission.conversation.marks(),
            },
        }
        key = checkpoint_key(thread_id, checkpoint_ns, checkpoint_id)
        await self._store(thread_id, key, update, owner, "store the pending writes")

    # -- administering -----------------------------------------------------------------------

    async def adelete_thread(self, thread_id: str) -> None:
        """Delete the thread: its checkpoints, then its conversation and messages."""
        thread_id = _thread_id(thread_id)
        with storage_errors("delete the thread's checkpoints"):
            await self._checkpoints.delete_many({"thread_id": thread_id})
        self._transcripts.forget(thread_id)
        with contextlib.suppress(NotFound):
            await self.store.delete(thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their writes) the given runs made; messages stay."""
        ids = [_text(run_id, "run_id") for run_id in run_ids]
        if ids:
            await self._retire({"metadata.run_id": {"$in": ids}}, "delete the runs' checkpoints")

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Keep each namespace's latest checkpoint (`keep_latest`) or none (`delete`).

        The conversation and its messages stay: they are the record of what was said.
        """
        ids = [_thread_id(t) for t in thread_ids]
        if strategy not in ("keep_latest", "delete"):
            raise InvalidInput(
                f"invalid prune strategy {strategy!r}: use 'keep_latest' or 'delete'"
            )
        if not ids:
            return
        query: dict[str, Any] = {"thread_id": {"$in": ids}}
        if strategy == "keep_latest":
            with storage_errors("find the latest checkpoints"):
                heads = await (
                    self._checkpoints.find(
                        query | {"type": {"$exists": True}},
                        {"thread_id": 1, "checkpoint_ns": 1, "checkpoint_id": 1},
                    )
                    .sort("checkpoint_id", -1)
                    .to_list(None)
                )
            latest: dict[tuple[str, str], Any] = {}
            for head in heads:
                latest.setdefault((head["thread_id"], head["checkpoint_ns"]), head["_id"])
            query["_id"] = {"$nin": list(latest.values())}
        await self._retire(query, "prune checkpoints")

    async def _retire(self, query: dict[str, Any], action: str) -> None:
        """Delete checkpoints; one that keeps the extras of messages it logged is emptied
        instead (no longer a checkpoint to any read), as the messages stay."""
        with storage_errors(action):
            await self._checkpoints.delete_many(query | {"extras": {"$exists": False}})
            await self._checkpoints.update_many(
                query | {"extras": {"$exists": True}},
                {"$unset": {field: "" for field in _CHECKPOINT_FIELDS}},
            )

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Fork a thread into a new one: its checkpoints, conversation, messages and extras,
        all copied. A re-run after a crash finishes the copy its fork made: the checkpoints
        that refer only to the messages that fork copied (`_rekeyed`), the one the source
        went on from past them as the source held it there, its pause unanswered
        (`before_the_answers`: a store fork at a paused call). Once all is written,
        the copy's checkpoints name its owner as it is then (`_follow_the_target`: a claim
        of its user landing meanwhile moves the whole copy), and the copy is checked as a
        fork is (`TranscriptLink.hold`): its source deleted, or its
        user erased, meanwhile, or its target deleted, it is taken back, checkpoints and
        all, and NotFound (the source gone) or the refusal is raised. A source gone before
        the transcript's copy read it is NotFound, nothing written: the checkpoints read name
        the conversation they were written for (`TranscriptLink.copy`'s `named`), only those
        of the thread's current life or naming none (`_served`: one lookup)."""
        source, target = _thread_id(source_thread_id), _thread_id(target_thread_id)
        if source == target:
            raise InvalidInput("invalid copy: the source and target threads are the same")
        await self.setup()
        life = await self._served(source)  # none a write racing an earlier delete left
        with storage_errors("read the thread's checkpoints"):
            docs = await self._checkpoints.find({"thread_id": source, **life}).to_list(None)
        if not docs:
            return
        named = {life for life in map(ThreadLife.named_by, docs) if life is not None}
        ids = {doc["checkpoint_id"] for doc in docs}
        copied = await self._transcripts.copy(source, target, named=named, checkpoints=ids)
        moved, conversation = copied.moved, copied.conversation
        rekeyed = (self._rekeyed(doc, target, moved, conversation) for doc in docs)
        copies = before_the_answers([copy for copy in rekeyed if copy is not None], docs)
        ours = await _insert_new(self._checkpoints, copies, "copy the thread's checkpoints")
        try:
            await self._follow_the_target(target, conversation)
            await self._transcripts.hold(copied)
        except StoreError:
            # Those this run inserted: a target kept as it is keeps the checkpoints a graph,
            # an earlier attempt or another copy (the same ids) wrote there.
            with storage_errors("take back the thread's checkpoints"):
                await self._checkpoints.delete_many({"_id": {"$in": ours}})
            raise
        finally:
            self._transcripts.forget(target)

    async def _follow_the_target(self, target: str, conversation: ThreadLife | None) -> None:
        """The copy's checkpoints, once stored, named with the owner its conversation has now
        (read after their insert): a claim that moved the conversation before they were
        stored, with the source's owner as read, found none of them to move, and one after
        moves them itself. A target gone is left to `TranscriptLink.hold`."""
        if conversation is None:
            return
        try:
            found = await self.store.get_conversation(target, fallback=False)
        except NotFound:
            return
        owner = found.user_id
        stale = {"thread_id": target, **conversation.marks(), "user_id": {"$ne": owner}}
        with storage_errors("name the copy's owner on its checkpoints"):
            await self._checkpoints.update_many(stale, {"$set": {"user_id": owner}})

    def _rekeyed(
        self,
        doc: dict[str, Any],
        target: str,
        moved: dict[int, tuple[int, str]],
        conversation: ThreadLife | None,
    ) -> dict[str, Any] | None:
        """A checkpoint document of the fork: its references moved to the fork's messages, the
        fork's conversation named. None for a checkpoint that refers to a message the fork
        does not hold: one newer than the fork a re-run finishes, whose source went on."""
        copy = doc | {
            "_id": checkpoint_key(target, doc["checkpoint_ns"], doc["checkpoint_id"]),
            "thread_id": target,
            **(_NAMING_NONE if conversation is None else conversation.marks()),
        }
        stored = doc.get("messages")
        if stored is not None:
            segments = decode_segments(stored["segments"], self.serde.loads_typed)
            referred = (
                q for s in segments if isinstance(s, SeqRange) for q in range(s.start, s.stop)
            )
            if any(seq not in moved for seq in referred):
                return None
            remapped = remap_segments(segments, {old: new for old, (new, _) in moved.items()})
            copy["messages"] = stored | {
                "segments": encode_segments(remapped, self.serde.dumps_typed)
            }
        if "extras" in doc:
            copy["extras"] = [
                entry | {"_id": moved[entry["seq"]][1], "seq": Int64(moved[entry["seq"]][0])}
                for entry in doc["extras"]
                if entry["seq"] in moved
            ]
            if not copy["extras"] and not any(f in doc for f in _CHECKPOINT_FIELDS):
                return None  # no checkpoint, and the extras of no message the fork holds
        return copy

    # -- owners ------------------------------------------------------------------------------

    def _owner(self, config: RunnableConfig) -> Owner:
        user_id = (config.get("configurable") or {}).get(self.owner_key)
        if user_id is None:
            return Owner()
        return Owner(validate_identifier(user_id, self.owner_key))

    async def _readable(self, thread_id: str, owner: Owner) -> dict[str, Any] | None:
        """What the owner reads of the thread (a filter on its checkpoint documents), None if
        nothing: a service reads every document, a user only its own thread's, of the
        conversation the thread is now (`readable_by`; the lookup ties the saver's cache of the
        thread to that conversation and drops what pops since gave back,
        `TranscriptLink.read_as`). A user's right to write a thread it
        finds is not its own is checked again. Refused while a migration run writes the
        conversation (`_unless_migrating`)."""
        if owner.user_id is None:
            return await self._served(thread_id)
        found = await self._stored(thread_id, owner.user_id)
        if found is None:
            self._transcripts.thread(thread_id).admitted.pop(owner.user_id, None)
            return None
        self._transcripts.read_as(thread_id, found)  # its pops since drop what they gave back
        return readable_by(owner.user_id, life_of(found))

    async def _served(self, thread_id: str) -> dict[str, Any]:
        """What a service reads of the thread: its documents of the conversation the thread is
        now, or naming none (stored before documents named it); none of an earlier life under
        the id (a graph still running then may have written some after its delete). One round
        trip; ties the saver's cache of the thread to that conversation."""
        life = self._service_life(thread_id, await self._stored(thread_id, None))
        return dict(_NAMING_NONE) if life is None else life.query()

    def _service_life(self, thread_id: str, found: Conversation | None) -> ThreadLife | None:
        """The conversation a service reads of the thread (`life_of`), the thread
        being `found` now (None: no conversation; it reads only documents naming none; one a
        migration run writes was refused by whoever read it, `_unless_migrating`). Ties the
        saver's cache of the thread to it."""
        if found is None:
            return None
        life = life_of(found)
        self._transcripts.tie(thread_id, life)
        return life

    def _life_or_refusal(
        self, thread_id: str, found: Conversation | None
    ) -> ThreadLife | Conflict | None:
        """`_service_life`, or its refusal (a migration run writing the thread's conversation)
        for a list across threads to raise only once it reaches one of the thread's checkpoints."""
        try:
            checked = None if found is None else _unless_migrating(thread_id, found)
        except Conflict as refused:
            return refused
        return self._service_life(thread_id, checked)

    async def _stored(self, thread_id: str, user_id: str | None) -> Conversation | None:
        """The conversation the thread is now, as `user_id` (None: a service) sees it; None
        when there is none (deleted, being deleted, a fork not made yet, another user's). One
        round trip. Read with one a migration run is writing among them
        (`ConversationStore.stored_conversation`), so that one is refused
        (`_unless_migrating`) rather than taken for none."""
        try:
            found = await self.store.stored_conversation(thread_id, user_id=user_id)
        except NotFound:
            return None
        return _unless_migrating(thread_id, found)

    async def _rooted(
        self, config: RunnableConfig, owner: Owner, named: str | None
    ) -> tuple[Owner, ThreadLife | None]:
        """Who writes into a subgraph's namespace, and into which conversation. LangGraph builds
        a subgraph state's config (`get_state(subgraphs=True)`) from the thread and namespace
        alone, naming no user: a write naming none there is admitted as the owner of the
        checkpoint it goes on from in its namespace (`named`), else of the root checkpoint it
        names (`checkpoint_map`), and only into that one's conversation (the life it names,
        checked against the thread's: `_require_life`). One it names and is gone (deleted
        with its conversation) is NotFound; a subgraph's first write whose root is not stored
        yet (`durability="async"` or `"exit"`) is the config's. One round trip, on that path
        only; a user's write, or the root namespace's, is the config's as it is."""
        thread_id, checkpoint_ns, _ = _address(config)
        if checkpoint_ns == "" or owner.user_id is not None:
            return owner, None
        root = ((config.get("configurable") or {}).get("checkpoint_map") or {}).get("")
        keys = [checkpoint_key(thread_id, checkpoint_ns, named)] if named is not None else []
        if isinstance(root, str):
            keys.append(checkpoint_key(thread_id, "", root))
        with storage_errors("read the checkpoint a subgraph's write goes on from"):
            found = await self._checkpoints.find(
                {"_id": {"$in": keys}}, {"user_id": 1, **dict.fromkeys(_LIFE_FIELDS, 1)}
            ).to_list(None)
        if not found:
            if named is None:
                return owner, None
            raise NotFound(
                f"checkpoint {named!r} of thread {thread_id!r} was not found: the conversation "
                "it was written in was deleted (its user erased)"
            )
        anchor = min(found, key=lambda doc: keys.index(doc["_id"]))
        user_id = anchor.get("user_id")
        return Owner(user_id) if user_id is not None else owner, ThreadLife.named_by(anchor)

    async def _admission(self, thread_id: str, owner: Owner, *, again: bool = False) -> Admission:
        """The owner's admission to write the thread (`_admit`): checked once per thread, owner
        and conversation in this process, or now when asked to check `again`. A graph still
        running after its thread was deleted writes on into the life it was admitted to: its
        documents name that conversation, which no reader of the id's next life reads
        (`_readable`, `_served`) and no copy copies (`acopy_thread`)."""
        admitted = self._transcripts.thread(thread_id).admitted
        if not again and owner.user_id in admitted:
            return admitted[owner.user_id]
        admitted.pop(owner.user_id, None)
        admission = await self._admit(thread_id, owner)
        self._transcripts.tie(thread_id, admission.conversation).admitted[owner.user_id] = admission
        return admission

    async def _admit(self, thread_id: str, owner: Owner) -> Admission:
        """Make sure the thread's conversation exists and the owner may write it. A user never
        writes another's or a service's thread, and its documents name it; a service writes
        any, and its documents name no user: they are the thread's owner's, whoever that is
        when they are read (a claim leaves them where they are)."""
        if owner.user_id is None:
            found = await self.logger.upsert_conversation(thread_id)
            return Admission(None, life_of(found))
        # A runtime acting for the user: theirs, or created theirs; any other (a service's,
        # another user's in any state or legacy turns) NotFound in the HTTP 404's words.
        found = await self.logger.upsert_conversation(
            thread_id, user_id=owner.user_id, strict_owner=True
        )
        return Admission(owner.user_id, life_of(found))

    async def _store(
        self, thread_id: str, key: str, update: dict[str, Any], owner: Owner, action: str
    ) -> None:
        """Apply `update` to the thread's document `key`, upserted, in one command.

        A service's touches any document. A user's touches only a document written for that
        user; one written for no user (a service's, or stored before documents named their
        owner) only after the thread's owner is checked again (two round trips more, on that
        path only: a graph still running for a user the thread is no longer, after a claim,
        is refused), and then it names the user; one written for another user is left as it
        is (NotFound). Parallel writes of the user's tasks (`Send` branches) into one such
        document all take that path at once: the first names it the user's, and the others
        find it hers.
        """
        user_id = owner.user_id
        with storage_errors(action):
            try:
                mine = {} if user_id is None else {"user_id": user_id}
                await self._checkpoints.update_one({"_id": key} | mine, update, upsert=True)
                return
            except DuplicateKeyError:
                pass  # another user's, or no user's
        admission = await self._admission(thread_id, owner, again=True)
        unowned = {
            "user_id": {"$in": [None, user_id]},  # or named hers meanwhile, by a parallel task
            **admission.conversation.query(),
        }
        # The owner's now: named so, its next write is the common path.
        named = {op: v for op, v in update.items() if op != "$setOnInsert"}
        named["$set"] = update.get("$set", {}) | {"user_id": user_id}
        with storage_errors(action):
            result = await self._checkpoints.update_one({"_id": key} | unowned, named)
        if not result.matched_count:
            raise NotFound(f"checkpoint {key} was not found for user {user_id!r}: another user's")

    # -- synchronous API ---------------------------------------------------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Synchronous `aget_tuple`."""
        return self._run(self.aget_tuple(config))

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Synchronous `alist`."""

        async def collect() -> list[CheckpointTuple]:
            found = self.alist(config, filter=filter, before=before, limit=limit)
            return [item async for item in found]

        return iter(self._run(collect()))

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Synchronous `aput`."""
        return self._run(self.aput(config, checkpoint, metadata, new_versions))

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Synchronous `aput_writes`."""
        self._run(self.aput_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        """Synchronous `adelete_thread`."""
        self._run(self.adelete_thread(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Synchronous `adelete_for_runs`."""
        self._run(self.adelete_for_runs(run_ids))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Synchronous `acopy_thread`."""
        self._run(self.acopy_thread(source_thread_id, target_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Synchronous `aprune`."""
        self._run(self.aprune(thread_ids, strategy=strategy))

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        loop = self._loop or _background_loop()
        if _running_loop() is loop:
            coroutine.close()
            raise asyncio.InvalidStateError(
                "AgentStoreSaver's synchronous methods cannot run on its own event loop: use "
                "the async methods (ainvoke, astream) there, or call from another thread"
            )
        if not loop.is_running():
            coroutine.close()
            raise _not_running()
        future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        while True:  # a loop that stops meanwhile would never answer
            with contextlib.suppress(TimeoutError):
                return future.result(timeout=_LOOP_CHECK_SECONDS)
            if not loop.is_running():
                future.cancel()
                raise _not_running()


_LOOP_CHECK_SECONDS = 1.0
"""How often a synchronous call checks that the loop it waits on still runs."""


def _not_running() -> asyncio.InvalidStateError:
    return asyncio.InvalidStateError(
        "AgentStoreSaver's event loop is not running, so its synchronous methods cannot run "
        "there: create the saver outside any event loop (it then uses the shared background "
        "loop), pass a `loop` that runs in another thread, or use the async methods"
    )


_background: asyncio.AbstractEventLoop | None = None
_background_lock = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    """The process's one background event loop (a daemon thread, started on first use): where
    the synchronous methods of every saver made outside any loop run. A database client
    binds to the first loop that uses it, so every saver on it, and each clone LangGraph
    makes of one (`with_allowlist`), runs on this loop."""
    global _background
    with _background_lock:
        if _background is None:
            loop, running = asyncio.new_event_loop(), threading.Event()
            loop.call_soon(running.set)
            threading.Thread(target=loop.run_forever, name="agent-store-saver", daemon=True).start()
            running.wait()
            _background = loop
        return _background


def _forget_background_loop() -> None:
    """In a forked child, whose copy of the loop has no thread running it: a new one."""
    global _background, _background_lock
    _background, _background_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_background_loop)


_CHECKPOINT_FIELDS = (
    "parent_checkpoint_id",
    "type",
    "checkpoint",
    "messages",
    "metadata",
    "writes",
)
"""What makes a document a checkpoint; the rest (its names, `extras`) outlives it."""


async def _insert_new(collection: Any, documents: list[dict[str, Any]], action: str) -> list[Any]:
    """Insert documents; those already there (a retry's, another copy's) are the only errors
    swallowed. The ids of those this call inserted."""
    if not documents:
        return []
    with storage_errors(action):
        try:
            await collection.insert_many(documents, ordered=False)
        except BulkWriteError as exc:
            only_duplicates(exc)
            there = {error.get("index") for error in exc.details.get("writeErrors") or ()}
            return [doc["_id"] for index, doc in enumerate(documents) if index not in there]
    return [doc["_id"] for doc in documents]


_NAMING_NONE: dict[str, Any] = {THREAD_EPOCH: None, THREAD_CONVERSATION: None}
"""The checkpoint documents naming no conversation (stored before documents named it): all a
thread with no conversation serves. Never changed in place."""
_LIFE_FIELDS = tuple(ThreadLife(None, 0).marks())
"""The fields a checkpoint document names its conversation by (`ThreadLife.marks`)."""


def _of_life(doc: dict[str, Any], life: ThreadLife | None) -> bool:
    """Whether a checkpoint document is of the life `life` (None: of no conversation, only a
    document naming none), as `_served` selects."""
    if life is None:
        return ThreadLife.named_by(doc) is None
    return life.holds(doc)


def _require_life(thread_id: str, life: ThreadLife | None, admission: Admission) -> None:
    """NotFound when a subgraph's write goes on from a checkpoint of another conversation than
    the one the thread is now (`AgentStoreSaver._rooted`): deleted, the id taken since."""
    if life is not None and not admission.conversation.holds(life.marks()):
        raise NotFound(
            f"thread {thread_id!r}: the checkpoint this write goes on from is of a conversation "
            "deleted since (its user erased): the thread is another conversation now"
        )


def _unless_migrating(thread_id: str, found: Conversation) -> Conversation:
    """The thread's conversation as read, refused (Conflict, as its writes are: 409 over HTTP)
    while a migration run writes it (legacy turns added since it was migrated, marked
    `migrating` until the run's messages are in): its checkpoints refer to a transcript the run
    is rewriting, which no read serves until then, so a read of them now would serve an
    empty or a half-written history (was: the thread read empty)."""
    if found.migrating:
        raise being_migrated(thread_id, "a read of its checkpoints")
    return found


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _address(config: RunnableConfig) -> tuple[str, str, str | None]:
    """The thread, namespace and checkpoint id a config names (identifiers checked)."""
    configurable = config.get("configurable") or {}
    if "thread_id" not in configurable:
        raise InvalidInput("invalid config: `configurable` needs a thread_id")
    checkpoint_id = get_checkpoint_id(config)
    return (
        _thread_id(configurable["thread_id"]),
        _text(configurable.get("checkpoint_ns", ""), "checkpoint_ns"),
        _text(checkpoint_id, "checkpoint_id") if checkpoint_id is not None else None,
    )


def _thread_id(value: Any) -> str:
    """A thread id is a conversation id: 1-200 letters, digits and `_.:@|-`."""
    return validate_identifier(value, "thread_id")


def _text(value: Any, what: str) -> str:
    """A name that goes into a query: a plain string, never an operator document."""
    if not isinstance(value, str):
        raise InvalidInput(f"invalid {what}: expected a string, got {type(value).__name__}")
    return value


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(map(isinstance, value, repeat(BaseMessage)))


def _storable_metadata(metadata: CheckpointMetadata) -> dict[str, Any]:
    """The metadata as a plain document, so `list` can filter on it; refused if it cannot be."""
    stored = dict(metadata)
    check_metadata_keys(stored)
    try:
        bson_encode(stored)
    except (InvalidDocument, OverflowError) as exc:
        raise InvalidInput(f"invalid checkpoint metadata: it cannot be stored ({exc})") from exc
    return stored
