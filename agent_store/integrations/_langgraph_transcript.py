"""Where a LangGraph thread's messages live: its conversation's transcript, each message once.

`TranscriptLink.place` turns a checkpoint's messages into segments of the
transcript, logging only the messages the transcript does not hold yet (one
idempotent turn per checkpoint, through `AgentMessageLogger`), and answers the
extras of the messages it logged: what the OpenAI format does not hold, which
the checkpoint document that logged them keeps (`extras`).
`TranscriptLink.materialize` turns segments back into the messages. A small
per-thread cache keeps the messages already read or written, so a graph that
appends pays for its new messages only, however long the conversation; it holds
one conversation's (`TranscriptLink.tie`): an id deleted and taken again is read
afresh. A cached `seq` is tied to the stored message there: when the store says the
transcript ends below what was read (a pop gave `seq`s back), what is held from there on is
dropped and read again (`_Thread.ends_at`).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import json
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bson import Int64
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from pydantic import ValidationError

from agent_store.core import (
    AgentMessage,
    AssistantMessage,
    Conflict,
    Conversation,
    ForkTooLarge,
    InvalidInput,
    NotFound,
    StorageFailure,
    StorageUnavailable,
    StoreError,
    TranscriptMoved,
    VersionMismatch,
    conversation_version,
    is_stand_in,
    stand_in_result,
    utc_now,
)
from agent_store.core import ToolMessage as StoredToolMessage
from agent_store.integrations._langgraph_branches import (
    OpenCall,
    abandoned_calls,
    already_at_tail,
    keeps_calls,
    left_behind,
    logged_again_from,
    logged_before_stored,
    made_calls,
    open_calls,
)
from agent_store.integrations._langgraph_documents import (
    CHECKPOINTS,
    Deserialize,
    Inline,
    Segment,
    SeqRange,
    Serialize,
    decode_segments,
    life_of,
    place_all,
    places_of,
)
from agent_store.integrations._langgraph_messages import extras_of, from_stored, to_stored
from agent_store.store import (
    FORK_TURN,
    LANGGRAPH_TURN,
    MAX_MESSAGES_PER_TURN,
    AgentMessageLogger,
    ConversationStore,
    Database,
    ThreadLife,
    copied_from,
    copy_mark,
    is_own_turn_id,
    storage_errors,
)


@dataclass(frozen=True)
class Owner:
    """Who a graph runs for: a user (writes and reads only its own threads) or a service."""

    user_id: str | None = None


@dataclass(frozen=True)
class Admission:
    """A graph's owner admitted to write a thread (`AgentStoreSaver._admit`)."""

    stamp: str | None
    """The user the graph's checkpoint documents are written for: the graph's user; none for
    a service's, which are the thread's owner's, whoever that is when they are read."""
    conversation: ThreadLife
    """The conversation the thread was then (`life_of`)."""


@dataclass(frozen=True)
class _Head:
    """The messages of the checkpoint last written or read for a thread, and their segments."""

    checkpoint_id: str
    messages: list[BaseMessage]
    segments: list[Segment]
    open_calls: tuple[OpenCall, ...]
    """The calls the messages leave unanswered."""
    end: int
    """The transcript's next `seq` as this checkpoint left it: a put going on from it logs
    there, unless another put logged messages since (the logger's `next_seq` checks it)."""
    settled: bool = True
    """No open call is answered further on in the transcript, unless by a message the
    checkpoint refers around (an answer given outside the graph to a call it went on without,
    which a put answering that call reads: `_settled`): a checkpoint this saver wrote, or the
    thread's latest; one read by its id (time travel) may not be."""


@dataclass
class _Thread:
    """What this process knows of one thread's transcript, all of one conversation."""

    conversation: ThreadLife | None = None
    """The conversation it was read from or written to (`life_of`); None: not known yet
    (nothing read but documents that name none)."""
    by_seq: dict[int, BaseMessage] = field(default_factory=dict)
    seq_by_id: dict[str, int] = field(default_factory=dict)
    stored_ids: dict[int, str] = field(default_factory=dict)
    """The stored message (its `_id`) each cached `seq` holds: a message stored at that `seq`
    since (a pop gave the `seq` back, another writer took it) replaces the cached one."""
    outside: set[int] = field(default_factory=set)
    """The cached `seq`s whose message was logged outside the graph: by no turn of the
    checkpointer's (`LANGGRAPH_TURN`), kept by no checkpoint's extras (a copy of a thread
    keeps those of the graph's messages) and no stand-in (`_the_graphs_own`). A person's
    answer over HTTP, a runtime's late result, a message of another writer: none is a
    branch's answer (`_branch`)."""
    loaded_until: int = 0
    """Every stored message below this `seq` is in `by_seq`."""
    pops: int | None = None
    """The conversation's finished pops (`Conversation.pops`) as a read of it last found them;
    None: not read yet."""
    head: _Head | None = None
    admitted: dict[str | None, Admission] = field(default_factory=dict)
    """By the graph's user (None: a service) whose right to write this thread was checked."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def holds_anything(self) -> bool:
        return bool(self.by_seq or self.head is not None or self.admitted)

    def remember(
        self, seq: int, message: BaseMessage, stored_id: str | None, *, outside: bool = False
    ) -> None:
        gone = self.by_seq.get(seq)
        if gone is not None and gone.id is not None and self.seq_by_id.get(gone.id) == seq:
            del self.seq_by_id[gone.id]
        self.by_seq[seq] = message
        if stored_id is not None:
            self.stored_ids[seq] = stored_id
        if outside:
            self.outside.add(seq)
        else:
            self.outside.discard(seq)
        if message.id is not None:
            self.seq_by_id[message.id] = seq

    def ends_at(self, seq: int) -> None:
        """The store says the transcript ends at `seq` now, below what was read (a pop gave
        `seq` and those after it back): what is held from it on is dropped, read again then."""
        if seq >= self.loaded_until:
            return
        for gone in [s for s in self.by_seq if s >= seq]:
            self.stored_ids.pop(gone, None)
            self.outside.discard(gone)
            message = self.by_seq.pop(gone)
            if message.id is not None and self.seq_by_id.get(message.id) == gone:
                del self.seq_by_id[message.id]
        self.loaded_until = seq
        if self.head is not None and self.head.end > seq:
            self.head = None


@dataclass(frozen=True)
class _Step:
    """What one `place` call places: a checkpoint's messages, going on from its parent."""

    thread_id: str
    checkpoint_id: str
    parent_id: str | None
    owner: Owner
    messages: list[BaseMessage]
    base: _Head | None
    """The parent's messages, when the checkpoint's extend them (the common case)."""
    calls: tuple[OpenCall, ...]
    """The calls the messages leave unanswered."""


@dataclass(frozen=True)
class Copied:
    """What a copy of a transcript answers (`TranscriptLink.copy`)."""

    moved: dict[int, tuple[int, str]] = field(default_factory=dict)
    """Where each source `seq` went, with its new message id."""
    conversation: ThreadLife | None = None
    """The target conversation (`life_of`); None without a source conversation."""
    source: Conversation | None = None
    """The source conversation as the copy read it; None when there was none."""
    target: Conversation | None = None
    """The target conversation the copy wrote (its `version` names that life)."""
    own: bool = False
    """Whether the target is this copy's to take back: created by it, or its earlier
    attempt found untouched (`_untouched_attempt`), or empty, or a fork not made yet."""
    checkpoints: frozenset[str] = frozenset()
    """The `checkpoint_id`s the copy copies (its source thread's, as read): a checkpoint of
    another id in the target is a write of someone else's (`hold`). Empty until the copy's
    transcript is made (`TranscriptLink.copy`)."""


_FORK_ATTEMPTS = 3
"""How often a copy forks its source, read again after a fork found it changed (a pop)."""
_PLACE_ATTEMPTS = 4
"""How often a put is placed again after other puts logged messages meanwhile."""
_STILL_WRITTEN = 0.02
"""Seconds waited per attempt when a turn that moved the transcript is not stored yet."""


class _Replayed(TranscriptMoved):
    """A put whose added messages another put logged (its turn replayed, or its messages
    referred to) and which are no longer the transcript's end: placed again as a branch,
    keeping the extras of a replayed turn for the messages still referred to."""

    def __init__(self, message: str, *, next_seq: int, extras: list[dict[str, Any]]) -> None:
        super().__init__(message, next_seq=next_seq)
        self.extras = extras


@dataclass(frozen=True)
class _New:
    """A message the transcript does not hold yet."""

    message: BaseMessage
    stored: AgentMessage


class TranscriptLink:
    """Logs and reads a thread's messages through the store, with a bounded per-thread cache."""

    def __init__(
        self,
        db: Database,
        logger: AgentMessageLogger,
        store: ConversationStore,
        *,
        dump: Serialize,
        load: Deserialize,
        cache_threads: int,
    ) -> None:
        self._checkpoints = db[CHECKPOINTS]
        self._logger = logger
        self._store = store
        self._dumps = dump
        self._loads = load
        self._cache_threads = cache_threads
        self._threads: OrderedDict[str, _Thread] = OrderedDict()

    def with_serde(self, dump: Serialize, load: Deserialize) -> TranscriptLink:
        """The same link (and cache) with another serializer."""
        clone = copy.copy(self)
        clone._dumps, clone._loads = dump, load
        return clone

    def thread(self, thread_id: str) -> _Thread:
        """The cache of one thread (created empty), most recently used last."""
        state = self._threads.pop(thread_id, None) or _Thread()
        self._threads[thread_id] = state
        while len(self._threads) > self._cache_threads:
            self._threads.popitem(last=False)
        return state

    def tie(self, thread_id: str, conversation: ThreadLife | None) -> _Thread:
        """The cache of one thread as the conversation `conversation` (`life_of`, or the life a
        checkpoint names, `ThreadLife.same_as`): what it holds of another conversation under
        the id (deleted, its user erased, and the id taken again), or of one it could not
        name, is dropped. None (documents stored before they named their conversation) keeps
        the cache as it is."""
        state = self.thread(thread_id)
        if conversation is None:
            return state
        if state.conversation is not None and state.conversation.same_as(conversation):
            if conversation.epoch_only:  # the conversation as read: its rule, not a document's
                state.conversation = conversation
            return state
        if state.conversation is not None or state.holds_anything():
            state = self._threads[thread_id] = _Thread()
        state.conversation = conversation
        return state

    def read_as(self, thread_id: str, found: Conversation) -> _Thread:
        """The cache of one thread, tied to the conversation `found` as read now (`tie`): when
        pops finished since the last read (`Conversation.pops`), what it holds from the first
        `seq` they gave back on is dropped (`_Thread.ends_at`), read again when needed."""
        state = self.tie(thread_id, life_of(found))
        if state.pops is None:  # what it holds was read without counting pops (a service's)
            state.ends_at(0)
        elif found.pops != state.pops:
            state.ends_at(_first_popped(found, since=found.pops - state.pops))
        state.pops = found.pops
        return state

    def forget(self, thread_id: str) -> None:
        """Drop what this process knows of a thread (after it was deleted or rewritten)."""
        self._threads.pop(thread_id, None)

    # -- writing -----------------------------------------------------------------------------

    async def place(
        self,
        thread_id: str,
        messages: Sequence[BaseMessage],
        *,
        checkpoint_id: str,
        parent_id: str | None,
        owner: Owner,
    ) -> tuple[list[Segment], list[dict[str, Any]]]:
        """The segments of a checkpoint's messages, logging the ones not stored yet, and the
        extras of the messages logged (for the checkpoint's document).

        When the messages extend the parent checkpoint's (the common case; `_parent`), only
        the new tail is looked at. Otherwise every message is matched by its LangChain id
        against the transcript: a stored, unchanged message is referenced by its `seq`,
        an edited one (same id, other content) is held inline, an unknown one is logged.
        A branch that leaves the transcript with a call open that the transcript answers
        further on logs its messages from that call again (`_langgraph_branches`).

        Going on from the parent is a compare-and-set: the new messages are logged only if
        the transcript still ends where the parent left it (`_Head.end`, the logger's
        `next_seq`, in the reservation's own command). A put that finds other messages logged
        since (two processes resuming one checkpoint at once) is a branch: the transcript is
        read to its end and the put goes through the branch's check again. A put behind a
        later checkpoint that logged (the logger's `step`: checkpoint ids are drawn before
        their puts land) holds its new messages (`_held`); one whose messages another put
        logged (resumes that said the same) claims its step all the same (`_claim`). So the
        transcript ends as the thread's latest checkpoint, whatever order racing puts land in.
        """
        state = self.thread(thread_id)
        messages = messages if isinstance(messages, list) else list(messages)
        async with state.lock:
            head = await self._parent(state, thread_id, parent_id, owner)
            base = head if _extends(head, parent_id, messages) else None
            if base is None:
                calls = open_calls(messages)
            else:
                calls = open_calls(messages, start=len(base.messages), before=base.open_calls)
            moved: int | None = None
            kept: list[dict[str, Any]] = []
            for attempt in range(_PLACE_ATTEMPTS):
                step = _Step(thread_id, checkpoint_id, parent_id, owner, messages, base, calls)
                try:
                    segments, extras, end = await self._place_once(state, step, moved, attempt)
                except TranscriptMoved as exc:
                    self._refuse_lost(step, exc)
                    if exc.later_step is None:
                        state.ends_at(exc.next_seq)
                        moved = exc.next_seq
                        kept = exc.extras if isinstance(exc, _Replayed) else kept
                        continue
                    segments, end = await self._held(state, step)
                    state.head = _Head(checkpoint_id, list(messages), segments, calls, end, False)
                    return segments, []
                state.head = _Head(checkpoint_id, list(messages), segments, calls, end)
                return segments, _with_kept(extras, kept, segments)
        raise StorageUnavailable(
            f"thread {thread_id!r}: other puts kept logging messages while this one was placed; "
            "retry it"
        )

    async def _parent(
        self, state: _Thread, thread_id: str, parent_id: str | None, owner: Owner
    ) -> _Head | None:
        """The messages of a put's parent: the checkpoint this process last read or wrote for
        the thread (`_Thread.head`) when it is the parent, else the parent read (LangGraph read
        the thread's latest after the checkpoint a time travel goes on from, or a sibling's put
        landed), as reading it by its id reads it (not settled), so what the graph appended to
        it is told from what it edited (`_place`): one round trip, on that path only. The head
        when the parent is none, not the thread's, or holds no messages."""
        head = state.head
        if parent_id is None or (head is not None and head.checkpoint_id == parent_id):
            return head
        query: dict[str, Any] = {
            "thread_id": thread_id,
            "checkpoint_ns": "",
            "checkpoint_id": parent_id,
            "type": {"$exists": True},
        }
        if state.conversation is not None:
            query |= state.conversation.query()
        if owner.user_id is not None:
            query["user_id"] = {"$in": [owner.user_id, None]}
        with storage_errors("read the parent checkpoint"):
            doc = await self._checkpoints.find_one(query, {"messages": 1})
        stored = None if doc is None else doc.get("messages")
        if stored is None:
            return head
        segments = decode_segments(stored["segments"], self._loads)
        stop = _refers_until(segments)
        if stop > state.loaded_until:
            await self._load(state, thread_id, owner, start=state.loaded_until, stop=stop)
        messages = _assemble(state, thread_id, segments)
        return _Head(parent_id, messages, segments, open_calls(messages), stop, settled=False)

    def _refuse_lost(self, step: _Step, moved: TranscriptMoved) -> None:
        """StorageFailure when the transcript moved back below a message the step's parent
        refers to (`_lost_below`): removed outside the checkpointer, which no retry undoes.
        What this process holds of the thread is dropped: it is stale."""
        lost = _lost_below(step, moved)
        if lost is not None:
            self.forget(step.thread_id)
            raise _removed_outside(step.thread_id, lost) from moved

    async def _place_once(
        self, state: _Thread, step: _Step, moved: int | None, attempt: int
    ) -> tuple[list[Segment], list[dict[str, Any]], int]:
        """One attempt of `place`: the segments, the extras of the messages logged, and the
        transcript's next `seq` after them. `moved`: an earlier attempt found the transcript
        moved on to that `seq` (the put is a branch: `_places`). TranscriptMoved when it moved
        on again."""
        if moved is not None and state.loaded_until < moved and attempt > 1:
            await asyncio.sleep(_STILL_WRITTEN * attempt)  # a turn reserved, not stored yet
        segments, places, copies, next_seq = await self._places(state, step, moved)
        if moved is not None and attempt == _PLACE_ATTEMPTS - 1:
            next_seq = max(next_seq, moved)  # a turn never stored (a crash) leaves a gap
        closing = [] if _settled(state, step, moved) else _closing(state, segments, places)
        new = [p for p in places if isinstance(p, _New)]
        fork_id = step.checkpoint_id if copies else None  # names the copies' turn
        extras, replayed = await self._log_branch(state, step, (closing, new), fork_id, next_seq)
        seqs = [int(e["seq"]) for e in extras]
        extras = extras[len(closing) :]  # the checkpoint holds no stand-in
        by_seq = iter(seqs[len(closing) :])
        resolved = [next(by_seq) if isinstance(p, _New) else p for p in places]
        end = seqs[-1] + 1 if seqs else next_seq
        placed = place_all(segments, resolved)
        # Messages added that another put logged: the same turn replayed, or referred to.
        theirs = step.base is not None and any(isinstance(p, int) for p in places)
        if (
            replayed or (not new and (theirs or moved is not None))
        ) and attempt + 1 < _PLACE_ATTEMPTS:
            # Where the transcript is to end still: as the put refers (nothing read since its
            # parent), or as the put read it and checked it (a branch's placing).
            until = _refers_until(placed) if moved is None else max(state.loaded_until, moved)
            await self._claim(step, until, extras)
        return placed, extras, end

    async def _log_branch(
        self,
        state: _Thread,
        step: _Step,
        logging: tuple[Sequence[_New], Sequence[_New]],
        fork_id: str | None,
        next_seq: int,
    ) -> tuple[list[dict[str, Any]], bool]:
        """Log a put's stand-ins and new messages (`logging`) at `next_seq`, as `_log` does:
        one turn, or two when a stand-in answers a call the new messages make again (a
        reviewer's edit of a paused call, its call id kept). A turn answers a call only after
        making it, so the stand-ins go first, a turn of their own that claims no step (the
        put's messages do); a retry finds the call answered and logs no stand-in again.

        The stand-ins' turn is named by the put's checkpoint too: a call's stand-in reads the
        same whatever branch logs it, so two branches from one checkpoint (an edit, then time
        travel to the pause before it) would otherwise name one turn, the second answered the
        first's (a replay) and its turn after it placed at a taken `seq`."""
        closing, new = logging
        if not closing or not _remade(closing, new):
            if not closing and not new:
                return [], False
            return await self._log(state, step, [*closing, *new], fork_id, next_seq)
        branch = step.checkpoint_id
        closed, _ = await self._log(state, step, closing, branch, next_seq, claim=False)
        extras, replayed = await self._log(state, step, new, fork_id, int(closed[-1]["seq"]) + 1)
        return closed + extras, replayed

    async def _claim(self, step: _Step, until: int, extras: list[dict[str, Any]]) -> None:
        """Make the step the thread's latest (`last_step`), as logging its messages would have,
        when another put logged them (its turn replayed, or its messages referred to: a sibling
        that said the same): a sibling whose id is earlier is then held (`_held`). Only while
        the transcript ends at `until`: otherwise the put is placed again as a branch
        (`_Replayed`, keeping the `extras` of a replay), whose check logs copies if another
        branch answered its calls since. Behind a later step there is nothing to do."""
        try:
            await self._logger.claim_step(step.thread_id, step=step.checkpoint_id, next_seq=until)
        except TranscriptMoved as exc:
            if exc.later_step is None:
                raise _Replayed(str(exc), next_seq=exc.next_seq, extras=extras) from exc

    async def _held(self, state: _Thread, step: _Step) -> tuple[list[Segment], int]:
        """The segments of a put behind the thread's latest step (a sibling of a checkpoint
        whose id is later: LangGraph reads that one as the thread's latest): its new messages
        are held by its checkpoint, inline, so the transcript ends as the latest. A put going
        on from it reads the transcript first (its head is not settled) and logs them then."""
        segments, places, _, next_seq = await self._places(state, step, None)
        resolved = [p.message if isinstance(p, _New) else p for p in places]
        return place_all(segments, resolved), next_seq

    async def _places(
        self, state: _Thread, step: _Step, moved: int | None
    ) -> tuple[list[Segment], list[int | BaseMessage | _New], bool, int]:
        """The segments kept from the parent (`step.base`, when the messages extend it) and
        the places of the other messages; whether a branch logs messages again (`_branch`);
        the transcript's next `seq` the new messages are to get.

        Going on from a checkpoint this saver wrote, or the thread's latest, nothing is read:
        the parent's open calls are checked for a message the branch made again (a stored
        one, referenced). Otherwise — a branch (no `base`), a parent read by its id (time
        travel), a put that found the transcript `moved` on since its parent, or one answering
        a call the parent refers around an answer to (`_settled`) — the transcript is read to
        its end, and every call the branch makes is checked (one that makes none logs where
        the transcript ends); the calls the transcript leaves open that the branch does not
        hold are closed then (`_closing`, in `_place_once`).
        """
        base, messages = step.base, step.messages
        settled = _settled(state, step, moved)
        start = len(base.messages) if base is not None else 0
        calls = step.calls if settled else made_calls(messages)
        read = not settled
        if read:
            await self._load(state, step.thread_id, step.owner, start=state.loaded_until, stop=None)
        segments = list(base.segments) if base is not None else []
        after = None if base is None else _refers_until(base.segments)
        places = [_place(state, m, after=after) for m in messages[start:]]
        made_again = any(i >= start and isinstance(places[i - start], int) for i, _ in calls)
        if not calls or (settled and not made_again):
            if read or base is None:
                return segments, places, False, state.loaded_until
            return segments, places, False, base.end if moved is None else moved
        if not read:
            await self._load(state, step.thread_id, step.owner, start=state.loaded_until, stop=None)
        return *_branch(state, messages, segments, places, calls), state.loaded_until

    async def _log(
        self,
        state: _Thread,
        step: _Step,
        new: Sequence[_New],
        fork_id: str | None,
        next_seq: int,
        *,
        claim: bool = True,
    ) -> tuple[list[dict[str, Any]], bool]:
        """Log new messages as one turn at `next_seq` (TranscriptMoved when other messages
        took it); answer, per message, what the format lacks, and whether the turn was logged
        before (replayed). `claim`: the turn is the checkpoint's step (`log_messages`'s
        `step`).

        The turn is named by the checkpoint it extends and the new messages' content,
        not by the new checkpoint's id: when LangGraph re-runs a step after a crash
        between this write and the checkpoint's, the same messages are recognised as
        that turn (the logger replays it) instead of being stored again. A branch's
        messages logged again are named by the new checkpoint's id too (`fork_id`): a
        second branch from the same checkpoint logs copies of its own, and the same
        branch's put retried, however far the thread went on since, is answered the
        copies it logged.
        """
        stored_new = [n.stored for n in new]
        user_id = step.owner.user_id
        logged = await self._logger.log_messages(
            step.thread_id,
            stored_new,
            user_id=user_id,
            strict_owner=user_id is not None,
            turn_id=_step_turn_id(step.parent_id, stored_new, fork_id),
            next_seq=next_seq,
            step=step.checkpoint_id if claim else None,
        )
        extras: list[dict[str, Any]] = []
        for item, stored in zip(new, logged.messages, strict=True):
            assert stored.seq is not None
            kind, data = self._dumps(extras_of(item.message, stored))
            extras.append({"_id": stored.id, "seq": Int64(stored.seq), "type": kind, "data": data})
            state.remember(stored.seq, item.message, stored.id)
        seqs = [int(e["seq"]) for e in extras]
        if seqs and state.loaded_until == seqs[0]:
            state.loaded_until = seqs[-1] + 1
        return extras, logged.replayed

    # -- reading -----------------------------------------------------------------------------

    async def materialize(
        self,
        thread_id: str,
        segments: Sequence[Segment],
        *,
        checkpoint_id: str,
        conversation: ThreadLife | None,
        owner: Owner,
        as_head: bool,
        latest: bool = False,
    ) -> list[BaseMessage]:
        """The messages of a checkpoint's segments, read from the transcript when not cached;
        `as_head`, the checkpoint the graph goes on from (`latest`: the thread's newest). The
        cache is the one of the conversation the checkpoint names (`tie`)."""
        state = self.tie(thread_id, conversation)
        async with state.lock:
            head = state.head
            if (
                head is not None
                and head.checkpoint_id == checkpoint_id
                and head.segments == list(segments)
            ):
                return list(head.messages)
            stop = max((s.stop for s in segments if isinstance(s, SeqRange)), default=0)
            if stop > state.loaded_until:
                await self._load(state, thread_id, owner, start=state.loaded_until, stop=stop)
            messages = _assemble(state, thread_id, segments)
            if as_head:
                calls = open_calls(messages)
                head = _Head(checkpoint_id, list(messages), list(segments), calls, stop, latest)
                state.head = head
            return messages

    async def _load(
        self, state: _Thread, thread_id: str, owner: Owner, *, start: int, stop: int | None
    ) -> None:
        """Read the transcript's messages from `start` (to `stop`) into the thread's cache.

        A read of the cache's tail reads the last cached message again in the same query: when
        another message is stored at its `seq` now, or none, a pop gave it back since (and
        another writer may have taken its `seq`, bringing the transcript's end back to where it
        was read), so everything held is dropped and read again (`_tail_moved`)."""
        check = start - 1 if start > 0 and start == state.loaded_until else None
        read_from = start if check is None or check not in state.stored_ids else check
        stored = await self._store.messages_by_seq(
            thread_id, start=read_from, stop=stop, user_id=owner.user_id
        )
        if read_from < start:
            if _tail_moved(state, read_from, stored):
                state.ends_at(0)
                return await self._load(state, thread_id, owner, start=0, stop=stop)
            stored = stored[1:]
        seq_filter: dict[str, int] = {"$gte": start}
        if stop is not None:
            seq_filter["$lt"] = stop
        extras = {
            entry["_id"]: self._loads((entry["type"], entry["data"]))
            for entry in await self._extras_between(thread_id, seq_filter)
        }
        for message in stored:
            assert message.seq is not None
            # Keep the graph's own objects, while the `seq` holds the message they stand for.
            if message.seq not in state.by_seq or state.stored_ids.get(message.seq) != message.id:
                loaded = from_stored(message, extras.get(message.id))
                outside = message.id not in extras and not _the_graphs_own(message)
                state.remember(message.seq, loaded, message.id, outside=outside)
        last = stored[-1].seq if stored else None
        end = stop if stop is not None else (last + 1 if last is not None else start)
        state.loaded_until = max(state.loaded_until, end)

    async def _extras_between(
        self, thread_id: str, seq_filter: Mapping[str, int]
    ) -> list[dict[str, Any]]:
        """The extras the thread's checkpoint documents keep for messages in a `seq` range,
        oldest document first (a later one, from a re-run step, wins)."""
        query = {"thread_id": thread_id, "extras.seq": seq_filter}
        with storage_errors("read the messages' LangChain fields"):
            docs = await (
                self._checkpoints.find(query, {"extras": 1}).sort("checkpoint_id", 1).to_list(None)
            )
        low, high = seq_filter["$gte"], seq_filter.get("$lt")
        return [
            entry
            for doc in docs
            for entry in doc["extras"]
            if entry["seq"] >= low and (high is None or entry["seq"] < high)
        ]

    # -- forking -----------------------------------------------------------------------------

    async def copy(
        self,
        source_id: str,
        target_id: str,
        *,
        named: Collection[ThreadLife] = (),
        checkpoints: Collection[str] = (),
    ) -> Copied:
        """Copy a thread's transcript into a new conversation: a fork.

        `named`: the conversations the thread's checkpoints name (`ThreadLife.named_by`), as
        the copy read them. When they name one and the source is none of them (deleted, or
        its user erased, since they were read; perhaps started again under its id), the
        checkpoints are of a conversation gone: NotFound, nothing written, as `hold` answers
        once the copy is written. Only a thread whose checkpoints name none (stored before
        they named their conversation) and that has no conversation is copied without one.
        `checkpoints`: the `checkpoint_id`s the copy copies (`Copied.checkpoints`).

        A transcript one fork of the store copies is copied by it (`_forked`): its messages
        are copies, and the answers the person gave stay given. A longer one (the fork refused
        `ForkTooLarge`, nothing written) is logged through the logger, as the source holds it
        then, turn by turn of the source (`_logged`); a fork refused, or made, as a pop landed
        since the source was read is made again at what it holds then (`_fork_of_all`), so a
        popped message is never copied, nor half of a turn logged after the pop.

        A target that exists already is refused Conflict before anything is written, unless it
        is this copy's earlier attempt (`_earlier_attempt`), which a re-run after a crash
        finishes: a fork of the source is forked again at its `forked_from.seq` (a replay), so
        the copy is the thread as it was when its fork was made, however far the source went
        on since. A replay refused because a pop removed a message the fork copied takes that
        fork back, when it is as the fork left it (`_untouched_attempt`), and copies afresh: the
        copy never keeps a popped message, and deletes nothing but copies. A conversation of
        the source's owner holding nothing but this copy's turns (a copy logged turn by turn)
        is taken back so too and copied afresh, whatever the source holds since; one with a
        checkpoint of its thread (a crash once they were copied) is logged again (each turn
        stored once). Either is taken back only while nothing was written to it since it was
        checked (`_take_back`). An earlier attempt still a fork not made yet (a crash or a
        timeout inside the store's fork) is made at its `forked_from.seq` (`_unfinished_fork`);
        a target whose delete was cut short (marked, not done) is BeingDeleted, finished by
        whoever deletes the id (the copy cannot tell its own take-back from another's delete).
        An earlier attempt that is not the copy's own to take
        back (`Copied.own`) and holds other than what the copy wrote (`_require_as_copied`) is
        kept as it is: Conflict naming it, before the checkpoints are written. Answers where
        each source `seq` went, with its new message id, and the target conversation
        (`life_of`; None without a source conversation).
        """
        try:
            source = await self._store.get_conversation(source_id, fallback=False)
        except NotFound:
            if named:
                raise _source_went(source_id) from None
            return Copied()
        if named and not any(life_of(source).holds(life.marks()) for life in named):
            raise _source_went(source_id)
        copied = await self._copied(source, target_id)
        copied = dataclasses.replace(copied, checkpoints=frozenset(checkpoints))
        if not copied.own:
            await self._require_as_copied(copied)
        return copied

    async def _copied(self, source: Conversation, target_id: str) -> Copied:
        """`copy` of the source as read: its earlier attempt finished, or taken back and the
        source copied afresh (the store's fork, else turn by turn)."""
        target = await self._earlier_attempt(source, target_id)
        if target is None:
            unfinished = await self._unfinished_fork(source, target_id)
            if unfinished is not None:
                return unfinished
        elif target.forked_from is not None:
            replayed = await self._replayed_fork(source, target)
            if replayed is not None:
                return replayed
            target = None
        elif await self._untouched_attempt(source, target):
            await self._take_back(target)
            target = None
        stored = await self._store.messages_by_seq(source.conversation_id)
        if target is None and stored:
            forked = await self._fork_of_all(source, target_id, stored)
            if forked is not None:
                return forked
        return await self._logged(source, target_id, target)

    async def _unfinished_fork(self, source: Conversation, target_id: str) -> Copied | None:
        """The copy an earlier attempt's fork not made yet holds (`unfinished_fork_end`: it
        crashed, or was cancelled, inside the store's fork), that fork made at its
        `forked_from.seq`; None when there is none, or it is taken back (the store's fork
        refused, a pop since removed what it copies): the copy is made afresh."""
        source_id = source.conversation_id
        at_seq = await self._logger.unfinished_fork_end(source_id, target_id)
        if at_seq is None:
            return None
        up_to = await self._store.messages_by_seq(source_id, stop=at_seq + 1)
        try:
            return await self._forked(source, target_id, at_seq, up_to, own=True)
        except (InvalidInput, Conflict):
            return None
        except NotFound:
            # A fork of an earlier life of the source, taken back by the store's fork (its
            # source went): the copy is made afresh while this life stands.
            try:
                await self._store.require_standing(source_id, source.version)
            except NotFound:
                raise _source_went(source_id) from None
            return None

    async def hold(self, copied: Copied, refused: StoreError | None = None) -> None:
        """After every write of a copy (its checkpoints' too): returns while its source is
        the conversation it read, no delete or erasure of it begun, and its target the life
        it wrote (`ConversationStore.require_standing`, as the store's fork checks its
        source), holding what the copy wrote and nothing else (`_as_copied`: its copies, no
        pop). Otherwise, or when a write was `refused`, a target that is the copy's own
        (`Copied.own`) and holds what it wrote is deleted (messages, document and
        checkpoints: a copy that was never made) and NotFound is raised when the source went,
        else the refusal. A target written to meanwhile (a turn, a pop, a graph's run), or an
        earlier attempt not the copy's own, is kept as it is: Conflict naming it (`_kept`).
        A deletion that begins after this check finds the whole copy."""
        source, target = copied.source, copied.target
        if source is None or target is None:
            return
        target_id = target.conversation_id
        went: NotFound | None = None
        try:
            await self._store.require_standing(source.conversation_id, source.version)
        except NotFound:
            went = _source_went(source.conversation_id)
        try:
            await self._store.require_standing(target_id, target.version)
            now = await self._store.get_conversation(target_id, fallback=False)
        except NotFound as exc:
            refused = refused or exc
            now = None
        self.forget(target_id)
        if now is None:
            raise went or refused or NotFound(f"conversation {target_id!r} was not found")
        as_copied = _as_copied(now, copied) and not (
            copied.checkpoints and await self._holds_checkpoints_but(target_id, copied.checkpoints)
        )
        if went is None and refused is None and as_copied:
            return
        if not copied.own or not as_copied:
            raise _kept(target_id, copied, went)
        try:
            await self._store.delete(target_id, version=target.version, unchanged_since=now)
        except (NotFound, VersionMismatch):
            pass
        except Conflict:
            raise _kept(target_id, copied, went) from None
        raise went or refused or NotFound(f"conversation {target_id!r} was not found")

    async def _require_as_copied(self, copied: Copied) -> None:
        """Conflict, the target kept as it is (`_kept`), unless it holds what the copy wrote
        and nothing else (`_as_copied`): a re-run's earlier attempt, not its own, checked
        before the copy's checkpoints are written."""
        if copied.target is None:
            return
        target_id = copied.target.conversation_id
        try:
            now = await self._store.get_conversation(target_id, fallback=False)
        except NotFound:
            return  # gone: `hold` answers
        if now.version == copied.target.version and not _as_copied(now, copied):
            raise _kept(target_id, copied, None)

    async def _fork_of_all(
        self, source: Conversation, target_id: str, stored: Sequence[AgentMessage]
    ) -> Copied | None:
        """The copy made by the store's fork of all the source holds (`stored`, as read); None
        when that is past what one fork copies (`ForkTooLarge`, nothing written). A fork
        refused once the source's last `seq` is another than read (a pop landed meanwhile:
        the `seq` asked holds no message) is asked again at what the source holds then; any
        other refusal is raised. A fork made once a pop since `source` was read removed a
        `seq` it copies (the store's fork, refused by such a pop inside it, is made again at
        the same `seq`, which may hold a message logged since: half of a turn) is taken back
        and made again at what the source holds then, so the copy is a state the source held;
        StorageUnavailable after `_FORK_ATTEMPTS` such races."""
        source_id = source.conversation_id
        for attempt in range(_FORK_ATTEMPTS):
            last = stored[-1].seq
            assert last is not None
            try:
                copied = await self._forked(source, target_id, last, stored, own=True)
            except ForkTooLarge:
                return None
            except InvalidInput:
                read = await self._store.messages_by_seq(source_id)
                if attempt == _FORK_ATTEMPTS - 1 or not read or read[-1].seq == last:
                    raise
                stored = read
                continue
            now = await self._popped_since(source, last)
            if now is None:
                return copied
            assert copied.target is not None
            await self._take_back(copied.target, copied)
            source, stored = now, await self._store.messages_by_seq(source_id)
            if not stored:
                return None  # all popped: nothing to fork, an empty copy is logged
        raise StorageUnavailable(
            f"thread {source_id!r} kept being popped while it was copied: copy it again"
        )

    async def _popped_since(self, source: Conversation, end: int) -> Conversation | None:
        """The source read now when a pop removed a `seq` up to `end` from it since `source`
        was read (`Conversation.popped_since`); None when none did, or it is gone (`hold`
        takes the copy back)."""
        try:
            now = await self._store.get_conversation(source.conversation_id, fallback=False)
        except NotFound:
            return None
        return now if now.popped_since(source.pops, end) else None

    async def _replayed_fork(self, source: Conversation, target: Conversation) -> Copied | None:
        """The copy an earlier attempt forked (`target`), its fork replayed at its
        `forked_from.seq`; None once that fork is taken back (`_take_back`): its replay was
        refused because a pop removed from the source a message it copied, and it is as the
        fork left it (`_untouched_attempt`). The replay's refusal otherwise. The replayed
        target is the copy's own (`Copied.own`) while it is so untouched."""
        assert target.forked_from is not None
        at_seq = target.forked_from.seq
        up_to = await self._store.messages_by_seq(source.conversation_id, stop=at_seq + 1)
        try:
            replayed = await self._forked(source, target.conversation_id, at_seq, up_to, own=False)
        except Conflict:
            if not await self._untouched_attempt(source, target):
                raise
            await self._take_back(target)
            return None
        return dataclasses.replace(replayed, own=await self._untouched_attempt(source, target))

    async def _untouched_attempt(self, source: Conversation, target: Conversation) -> bool:
        """Whether the target, this copy's earlier attempt (`_earlier_attempt`), is as that
        attempt left it: the source's owner's, no pop in it, nothing but its copies (a fork's:
        no message past the fork's end; one logged turn by turn: this copy's turns, as
        `_earlier_attempt` found them, and at least one, an empty target being finished
        instead) and no checkpoint of its thread. Only such an attempt is taken back, nothing
        but copies of the source lost, and only while nothing was written to it since
        (`_take_back`)."""
        if target.user_id != source.user_id or target.pops or target.popping is not None:
            return False
        if target.forked_from is None and not target.message_count:
            return False
        if target.forked_from is not None:
            end = target.forked_from.seq
            held = await self._store.messages_by_seq(target.conversation_id)
            if any(m.seq is None or m.seq > end for m in held):
                return False
        return not await self._has_checkpoints(target.conversation_id)

    async def _take_back(self, target: Conversation, copied: Copied | None = None) -> None:
        """Delete the target's life a copy wrote, or its earlier attempt did, only while
        nothing was written to it since the copy's own last write (`target`: as an earlier
        attempt was read, found untouched by `_untouched_attempt`; with `copied`, as that copy
        left it, `_as_left`), checked in the command that marks it deleting
        (`ConversationStore.delete(unchanged_since=…)`; nothing else under the id is touched). A
        turn, pop or claim landing since stays, and the copy is a Conflict naming the target,
        kept as it is (`_kept`)."""
        target_id = target.conversation_id
        as_left = target if copied is None else _as_left(copied)
        try:
            await self._store.delete(target_id, unchanged_since=as_left)
        except (NotFound, VersionMismatch):
            pass
        except Conflict as exc:
            if copied is not None:
                raise _kept(target_id, copied, None) from exc
            raise Conflict(
                f"conversation {target_id!r} was written to as this copy took back its earlier "
                "attempt there: it is kept as it is; copy into a new id"
            ) from exc
        finally:
            self.forget(target_id)

    async def _earlier_attempt(self, source: Conversation, target_id: str) -> Conversation | None:
        """The target conversation when it is an earlier attempt of this copy: one whose owner
        is the one the copy writes for (the source's; none for an unowned source) that is a
        fork of the source's life as read (`_forked_from_this_life`), or was created by a copy
        of that life (`copy_of`) and holds only this copy's turns, told by their ids whatever
        the source holds now (`copied_from`), or none yet, and neither a name someone set nor
        a checkpoint of its thread (a copy creates it so, and logs its first turn before its
        checkpoints); None when there is no target (a fork not made yet is looked for then:
        `_unfinished_fork`). Any other conversation under the id is a Conflict, another user's
        "belongs to another user" whoever owns the source: a copy never writes into it."""
        try:
            target = await self._store.get_conversation(target_id, fallback=False)
        except NotFound:
            return None
        if target.user_id is not None and target.user_id != source.user_id:
            raise Conflict(
                f"conversation {target_id!r} belongs to another user: copy into a new id"
            )
        if target.user_id == source.user_id and (
            _forked_from_this_life(target, source)
            or await self._forked_before_epoch(target, source)
        ):
            return target
        if target.user_id == source.user_id and target.forked_from is None:
            held = await self._store.messages_by_seq(target_id)
            # Created by a copy of this life of the source (`copy_of`; none: by a copy of
            # before it was recorded, told by its turns only).
            named = target.copy_of == source.version
            copies = all(copied_from(source.conversation_id, m.turn_id) for m in held)
            if held and copies and (named or target.copy_of is None):
                return target
            if (
                not held
                and named
                and target.name_source != "set"
                and not await self._has_checkpoints_of_its_own(target_id, source.conversation_id)
            ):
                return target
        raise Conflict(
            f"conversation {target_id!r} exists already and is no copy of thread "
            f"{source.conversation_id!r}: copy into a new id"
        )

    async def _forked_before_epoch(self, target: Conversation, source: Conversation) -> bool:
        """Whether the target is a fork of the source's life made before its first turn since
        an earlier release stored it drew its `epoch` (which changed its `version`): the fork
        names the version it had then (`conversation_version` of its `created_at`), and its
        first message is still one stored before epochs, which no conversation started again
        under the id holds. One lookup, only for a fork of such a version."""
        origin = target.forked_from
        if (
            origin is None
            or origin.conversation_id != source.conversation_id
            or source.epoch is None
            or origin.version != conversation_version(source.id, None, source.created_at)
        ):
            return False
        first = await self._store.messages_by_seq(source.conversation_id, limit=1)
        return bool(first) and first[0].epoch is None

    async def _has_checkpoints_of_its_own(self, thread_id: str, source_id: str) -> bool:
        """Whether the thread holds a checkpoint no copy of `source_id` wrote: one whose
        `checkpoint_id` the source thread does not hold (a copy keeps its source's ids). One
        lookup, two when the thread holds checkpoints."""
        with storage_errors("read the thread's checkpoints"):
            held = await self._checkpoints.distinct("checkpoint_id", {"thread_id": thread_id})
            if not held:
                return False
            copied = await self._checkpoints.distinct("checkpoint_id", {"thread_id": source_id})
        return not set(held) <= set(copied)

    async def _holds_checkpoints_but(self, thread_id: str, ids: Collection[str]) -> bool:
        """Whether the thread holds a checkpoint newer than every one of `ids` (the source's,
        which a copy keeps): one a graph's run on the thread wrote (checkpoint ids sort as
        they were made). Older ones the source no longer holds are copies of checkpoints a
        `prune` took from it since. One lookup."""
        with storage_errors("read the thread's checkpoints"):
            held = await self._checkpoints.distinct("checkpoint_id", {"thread_id": thread_id})
        newest = max(ids, default="")
        return any(str(c) > newest for c in held if c not in ids)

    async def _has_checkpoints(self, thread_id: str) -> bool:
        """Whether a checkpoint of the thread is stored (one lookup)."""
        with storage_errors("read the thread's checkpoints"):
            found = await self._checkpoints.find_one({"thread_id": thread_id}, {"_id": 1})
        return found is not None

    async def _logged(
        self, source: Conversation, target_id: str, earlier: Conversation | None
    ) -> Copied:
        """The copy logged turn by turn (`_logged_once`), checked once logged as the store's
        fork checks its copies: a pop that removed a `seq` it copied from the source since
        `source` was read (`Conversation.popped_since`) takes the copy back and it is logged
        again from the source read then, so a popped message is never copied. `earlier`: the
        target an earlier attempt of the copy created (`_logged_once`), first."""
        source_id = source.conversation_id
        for _ in range(_FORK_ATTEMPTS):
            copied = await self._logged_once(source, target_id, earlier)
            now = await self._popped_since(source, max(copied.moved, default=-1))
            if now is None:  # no pop of what it copied; or its source gone: `hold` takes it back
                return copied
            assert copied.target is not None
            await self._take_back(copied.target, copied)
            source, earlier = now, None
        raise StorageUnavailable(
            f"thread {source_id!r} kept being popped while it was copied: copy it again"
        )

    async def _logged_once(
        self, source: Conversation, target_id: str, earlier: Conversation | None
    ) -> Copied:
        """The copy logged through the logger, turn by turn of the source as it is read now,
        with documents of its own (nothing shared to corrupt) and the source's owner, as it is
        while the copy logs (`_created_target`; each turn is logged for the target's owner
        then, whom a claim may move it to); a message cut to its bound is logged from its
        whole text, kept whole for the copy.

        Its target is its `earlier` attempt, or one it creates, create-only: a conversation
        someone started under the id since the copy looked is a Conflict, nothing written
        (`_created_target`), as the store's fork into it is.

        Each turn is logged only into the life of the target this copy created (or its
        earlier attempt did: `log_messages`'s `version`), so a target deleted meanwhile, its
        user's erasure included, is never started again by a later turn: the copy is taken
        back and NotFound (its source gone) or the refusal raised (`hold`)."""
        source_id = source.conversation_id
        read_at = utc_now()  # before the messages are read: what judges the `seq`s they lack
        read = await self._store.messages_by_seq(source_id)
        # A turn still being written among those read: StorageUnavailable, as the store's fork
        # answers, nothing written (a copy holding the turns after it only is no state the
        # source held).
        seqs = [m.seq for m in read if m.seq is not None]
        await self._logger.require_written(source_id, seqs, read_at=read_at)
        own = earlier is None or not (earlier.message_count or earlier.pops)
        target = earlier or await self._created_target(source, target_id)
        copied = Copied({}, life_of(target), source, target, own)
        # Cut messages go from their whole texts (two lookups, only when one was cut), as the
        # store's own fork copies them: the logger cuts them again and keeps the copy's own.
        stored = await self._store.with_full_texts(read)
        for chunk in _turn_chunks(stored):
            try:
                logged = await self._logger.log_messages(
                    target_id,
                    [_as_new(m) for m in chunk],
                    turn_id=_fork_turn_id(source_id, str(chunk[0].id)),
                    version=target.version,
                )
            except (NotFound, VersionMismatch, Conflict) as refused:
                await self.hold(copied, refused)
                raise
            for old, new in zip(chunk, logged.messages, strict=True):
                assert old.seq is not None
                assert new.seq is not None
                assert new.id is not None
                copied.moved[old.seq] = (new.seq, new.id)
        self.forget(target_id)
        return copied

    async def _created_target(self, source: Conversation, target_id: str) -> Conversation:
        """The copy's target conversation, created with the source's owner; Conflict when a
        conversation is under the id (`upsert_conversation(create_only=True)`), BeingDeleted
        when one whose delete has begun is. Once created,
        it follows its source's owner now (`AgentMessageLogger.follow_its_source`), as the
        store's fork does: a claim of the source's user that moved the source after the copy
        read it, and before the target was there to move, leaves the copy the new owner's
        too. A claim landing later moves the target itself, with the turns logged into it."""
        try:
            created = await self._logger.upsert_conversation(
                target_id, user_id=source.user_id, create_only=True, copy_of=source.version
            )
        except Conflict as exc:
            raise Conflict(
                f"conversation {target_id!r} exists already and is no copy of thread "
                f"{source.conversation_id!r}: copy into a new id"
            ) from exc
        return await self._logger.follow_its_source(created, source)

    async def _forked(
        self,
        source: Conversation,
        target_id: str,
        at_seq: int,
        stored: Sequence[AgentMessage],
        *,
        own: bool,
    ) -> Copied:
        """The copy made by the store's fork at `at_seq`, of the source's messages `stored` up
        to it as read before: the copies are copies (kept as stored, whole texts and all), and
        the answers the person gave (resolved prompts, released calls, approvals) are kept as
        the fork keeps them. `own`: the target is the copy's to take back (`Copied.own`).

        Its target is the life the fork wrote, named by the `epoch` its copies carry: a fork
        deleted since it returned (its user erased), perhaps another conversation started under
        the id, is NotFound, nothing written or deleted by the copy (`_fork_went`)."""
        logged = await self._logger.fork(source.conversation_id, at_seq, target_id)
        moved: dict[int, tuple[int, str]] = {}
        for old, new in zip(stored, logged.messages, strict=True):
            assert old.seq is not None
            assert new.seq is not None
            assert new.id is not None
            moved[old.seq] = (new.seq, new.id)
        self.forget(target_id)
        try:
            target = await self._store.get_conversation(target_id, fallback=False)
        except NotFound:
            raise _fork_went(target_id) from None
        if any(m.epoch != target.epoch for m in logged.messages):
            raise _fork_went(target_id)
        return Copied(moved, life_of(target), source, target, own)


def _forked_from_this_life(target: Conversation, source: Conversation) -> bool:
    """Whether the target is a fork of the source's life as read: its `forked_from` names the
    source's id and the `version` that life has (`ForkOrigin.version`), which no conversation
    started again under the id shares. Never a time: copies keep their source's, so two lives
    of a thread copied from one thread start alike. A fork made before the store recorded the
    version is told from none: another conversation, kept as it is."""
    origin = target.forked_from
    return (
        origin is not None
        and origin.conversation_id == source.conversation_id
        and origin.version == source.version
    )


def _source_went(source_id: str) -> NotFound:
    """What a copy whose source went (deleted, or its user erased) while it copied answers."""
    return NotFound(
        f"conversation {source_id!r} was deleted, or its user erased, while it was copied: "
        "nothing of the copy is left"
    )


def _fork_went(target_id: str) -> NotFound:
    """What a copy whose fork was deleted (its user erased) once made answers."""
    return NotFound(
        f"conversation {target_id!r} was deleted, or its user erased, while it was copied "
        "into: nothing of the copy is left"
    )


def _as_copied(now: Conversation, copied: Copied) -> bool:
    """Whether the target read `now` holds what the copy wrote and nothing else: its life,
    a message for each `seq` copied, and no pop."""
    assert copied.target is not None
    return (
        now.version == copied.target.version
        and now.message_count == len(copied.moved)
        and not now.pops
        and now.popping is None
    )


def _as_left(copied: Copied) -> Conversation:
    """The target as the copy left it: its life, a message for each `seq` copied, no pop."""
    assert copied.target is not None
    unchanged = {"message_count": len(copied.moved), "pops": 0, "popping": None}
    return copied.target.model_copy(update=unchanged)


def _kept(target_id: str, copied: Copied, went: NotFound | None) -> StoreError:
    """What a copy answers when it keeps its target as it is: the target was written to
    while the copy was made, or is an earlier attempt the copy may not take back (written
    to, or its source went on past it, since)."""
    if went is not None:
        assert copied.source is not None
        return NotFound(
            f"conversation {copied.source.conversation_id!r} was deleted, or its user erased, "
            f"while it was copied: the copy's target {target_id!r} was written to meanwhile, "
            "or holds an earlier attempt, and is kept as it is (delete it)"
        )
    if copied.own:
        return Conflict(
            f"conversation {target_id!r} was written to while this copy was made (a turn, a "
            "pop, a graph's run): it is kept as it is, without the copy's checkpoints; delete "
            "it and copy again, or copy into a new id"
        )
    return Conflict(
        f"conversation {target_id!r} holds an earlier attempt of this copy that was written "
        "to, or whose source went on past it, since: it is kept as it is; delete it and copy "
        "again, or copy into a new id"
    )


def _the_graphs_own(message: AgentMessage) -> bool:
    """Whether a stored message the checkpoints keep no extras for is still the graph's: one
    a put logged (the checkpointer's own turn id, `LANGGRAPH_TURN`: its messages, their
    copies, the stand-ins it closed calls with), or a stand-in, which only the saver makes (a
    copy of the thread stores it under the fork's turn, and no checkpoint keeps its extras;
    one logged otherwise is taken for the graph's, the safe side: a branch leaving its call
    open logs the call again)."""
    stand_in = isinstance(message, StoredToolMessage) and is_stand_in(message)
    return stand_in or is_own_turn_id(message.turn_id, LANGGRAPH_TURN)


def _first_popped(found: Conversation, *, since: int) -> int:
    """The first `seq` the conversation's last `since` pops gave back (0 when it no longer
    lists them all: read everything again), or the one a pop under way gives back."""
    listed = [p.seq for p in found.popped_messages]
    seqs = listed[-since:] if 0 < since <= len(listed) else [0]
    if found.popping is not None:
        seqs.append(found.popping.seq)
    return min(seqs)


def _tail_moved(state: _Thread, seq: int, stored: Sequence[AgentMessage]) -> bool:
    """Whether the message the cache holds at `seq` (its last) is no longer stored there."""
    first = stored[0] if stored else None
    return first is None or first.seq != seq or first.id != state.stored_ids.get(seq)


def _refers_until(segments: Sequence[Segment]) -> int:
    """The `seq` after the last message the segments refer to (0: none)."""
    return max((s.stop for s in segments if isinstance(s, SeqRange)), default=0)


def _with_kept(
    extras: list[dict[str, Any]], kept: list[dict[str, Any]], segments: Sequence[Segment]
) -> list[dict[str, Any]]:
    """The extras of the messages a put logged, and those kept from its replayed turn
    (`_Replayed`) that its segments still refer to."""
    logged = {int(e["seq"]) for e in extras}
    referred = {seq for s in segments if isinstance(s, SeqRange) for seq in range(s.start, s.stop)}
    return extras + [e for e in kept if int(e["seq"]) in referred - logged]


def _extends(head: _Head | None, parent_id: str | None, messages: list[BaseMessage]) -> bool:
    """Whether a checkpoint's messages extend its parent's, the thread's head (the common case)."""
    return (
        head is not None
        and head.checkpoint_id == parent_id
        and messages[: len(head.messages)] == head.messages
    )


def _place(state: _Thread, message: BaseMessage, *, after: int | None) -> int | BaseMessage | _New:
    """Where one message of a checkpoint lives: a `seq`, inline, or to be logged.

    A stored message, unchanged, is its `seq`. Changed (same id, other content), it is an
    edit, held inline, unless the graph appended it to its parent's messages (which end at
    `after`): then it is a new message that reuses the id of one the thread left behind (a
    branch's model saying other things). An edit making a call the stored message does not
    make as it is (other arguments, a new call id: a reviewer's edit of a paused call) is
    logged, as a copy, so the call the graph runs is in the transcript for its answer to
    pair with (`keeps_calls`). Appended, it is the stored one only when that is
    stored from `after` on (a step re-run, a sibling that said the same): one stored before
    is a message said again, after it, by a branch that went back (logged).
    """
    seq = state.seq_by_id.get(message.id) if message.id is not None else None
    if seq is not None and state.by_seq[seq] == message and (after is None or seq >= after):
        return seq
    if seq is not None and after is None:
        return message if keeps_calls(state.by_seq[seq], message) else _copy(message)
    if message.id is None and after is None:
        return message  # no id to match it by: keep it inline rather than log it twice
    return _to_log(message)


def _to_log(message: BaseMessage) -> BaseMessage | _New:
    """A message to log, or itself, held inline, when the format cannot hold it."""
    try:
        stored = to_stored(message)
    except ValidationError:
        return message  # say, an over-long tool call id
    return _New(message, stored) if stored is not None else message


def _copy(message: BaseMessage) -> BaseMessage | _New:
    """A stored message to log again. Its token usage stays with the original, counted once
    in the conversation's usage (the extras give the copy's LangChain message back whole)."""
    place = _to_log(message)
    if isinstance(place, _New) and isinstance(place.stored, AssistantMessage):
        return _New(message, place.stored.model_copy(update={"token_usage": None}))
    return place


def _settled(state: _Thread, step: _Step, moved: int | None) -> bool:
    """Whether a put goes on from its parent without reading the transcript: the parent is
    settled (`_Head.settled`), nothing was logged since (`moved`), and no call the parent
    leaves open that the put's messages answer is answered already by a stored message the
    parent refers around (`_answered_around`). Such a put is a branch (`_branch`): the call
    answered twice is logged again for the graph's answer, as for a paused call answered
    over HTTP."""
    base = step.base
    if base is None or not base.settled or moved is not None:
        return False
    answered = [call for call in base.open_calls if call not in step.calls]
    return not _answered_around(state, base, answered)


def _answered_around(state: _Thread, base: _Head, calls: Sequence[OpenCall]) -> bool:
    """Whether a stored message after one of `calls` (calls of the parent's messages), before
    the parent's end, that its segments do not refer to answers that call: an answer given
    outside the graph to a call it went on without (her denial over HTTP, a late result:
    `left_behind`), which the parent's messages leave out as LangGraph's state does. A `seq`
    not cached counts as answering (the put reads the transcript). Costs nothing for a call
    its parent refers to every message after (a resume)."""
    places = places_of(base.segments)
    referred = {place for place in places if isinstance(place, int)}
    for index, call_id in calls:
        made = places[index] if index < len(places) else None
        if not isinstance(made, int):  # an edit held inline: its calls are its stored message's
            edited = base.messages[index].id
            made = None if edited is None else state.seq_by_id.get(edited)
        if made is None:
            continue  # stored nowhere: nothing in the transcript answers it
        for seq in range(made + 1, base.end):
            if seq in referred:
                continue
            around = state.by_seq.get(seq) if seq < state.loaded_until else None
            if around is None or (
                isinstance(around, ToolMessage) and around.tool_call_id == call_id
            ):
                return True
    return False


def _branch(
    state: _Thread,
    messages: list[BaseMessage],
    segments: list[Segment],
    places: list[int | BaseMessage | _New],
    calls: Sequence[OpenCall],
) -> tuple[list[Segment], list[int | BaseMessage | _New], bool]:
    """The segments and places of a branch whose open calls the transcript (read to its end)
    answers further on, or which logs a call before its stored messages (an edited call, at
    the transcript's tail: `logged_before_stored`): from the first, its stored messages
    become copies to log, unless the transcript's tail already holds them (a step re-run
    after a crash). For a call the branch went on without (`left_behind`: a question asked
    instead of deciding it) only another branch's answer counts, one the graph logged (the
    abandoned branch's result, time travel): an answer given outside the graph (`_Thread.
    outside`: over HTTP, a late result) is the call's own. Answers whether anything is
    copied."""
    whole: list[int | BaseMessage | _New] = [*places_of(segments), *places]
    end = state.loaded_until
    left = left_behind(messages)
    starts = (
        logged_again_from(whole, calls, state.by_seq, end, left=left, outside=state.outside),
        logged_before_stored(messages, whole),
    )
    start = min((s for s in starts if s is not None), default=None)
    if start is None:
        return segments, places, False
    copies = _copies(state, messages, whole, start)
    held = already_at_tail(messages, whole, start, copies, state.by_seq, end)
    if held is not None:
        seqs = iter(held)
        kept = [p if isinstance(p, BaseMessage) else next(seqs) for p in copies]
        return [], [*whole[:start], *kept], False
    return [], [*whole[:start], *copies], True


def _copies(
    state: _Thread,
    messages: Sequence[BaseMessage],
    whole: Sequence[int | BaseMessage | _New],
    start: int,
) -> list[BaseMessage | _New]:
    """The places of a branch's messages from `start` on, logged again: each stored message
    as a copy, each one its checkpoint holds as `_unheld` says, given the calls logged before
    it in the same turn (a result it holds answering one of them is logged after it)."""
    logged_calls = {
        call.id for p in whole[:start] if isinstance(p, _New) for call in p.stored.tool_calls or ()
    }
    copies: list[BaseMessage | _New] = []
    for index in range(start, len(whole)):
        place = whole[index]
        copied = (
            _copy(messages[index])
            if isinstance(place, int)
            else _unheld(state, place, logged_calls)
        )
        if isinstance(copied, _New):
            logged_calls.update(call.id for call in copied.stored.tool_calls or ())
        copies.append(copied)
    return copies


def _closing(
    state: _Thread, segments: Sequence[Segment], places: Sequence[int | BaseMessage | _New]
) -> list[_New]:
    """The `interrupted` stand-ins a branch logs first (the transcript read to its end): one
    for each call the transcript leaves open that the branch does not hold (`abandoned_calls`:
    time travel past a pause, a `RemoveMessage` of the call). No later turn of the thread can
    answer such a call, so it is not pending: the conversation awaits what the branch
    awaits. Going back to the pause later decides the call on a copy of it (`_branch`)."""
    whole = [*places_of(segments), *places]
    now = utc_now()
    closed = abandoned_calls(whole, state.by_seq, state.loaded_until)
    return [_stand_in(stand_in_result(call_id, now)) for call_id in closed]


def _remade(closing: Sequence[_New], new: Sequence[_New]) -> bool:
    """Whether a stand-in answers a call of an id one of the new messages makes."""
    made = {call.id for n in new for call in n.stored.tool_calls or ()}
    return any(n.stored.tool_call_id in made for n in closing)


def _stand_in(stored: AgentMessage) -> _New:
    return _New(from_stored(stored), stored)


def _unheld(
    state: _Thread, place: BaseMessage | _New, logged_calls: Collection[str]
) -> BaseMessage | _New:
    """A message of a branch logged again that its checkpoint holds: logged too when the
    transcript has no message of its id (a put behind a later step held it back, `_held`),
    when it is an edit that makes calls (they go before the copies answering them), or when
    it answers a call logged before it in the same turn (`logged_calls`: an edit of a stored
    result, say a graph replacing its own tool result under its id, answers the copy of its
    call; held, it would leave the copy pending and be nowhere in the conversation); any
    other edit of a stored message, or one without an id to match it by, stays held."""
    if isinstance(place, ToolMessage) and place.tool_call_id in logged_calls:
        return _to_log(place)
    if isinstance(place, _New) or place.id is None:
        return place
    if place.id not in state.seq_by_id:
        return _to_log(place)
    return _copy(place) if isinstance(place, AIMessage) and place.tool_calls else place


def _assemble(state: _Thread, thread_id: str, segments: Sequence[Segment]) -> list[BaseMessage]:
    messages: list[BaseMessage] = []
    for segment in segments:
        if isinstance(segment, Inline):
            messages.extend(segment.messages)
            continue
        try:
            messages.extend(state.by_seq[s] for s in range(segment.start, segment.stop))
        except KeyError as exc:
            raise _removed_outside(thread_id, exc.args[0]) from exc
    return messages


def _lost_below(step: _Step, moved: TranscriptMoved) -> int | None:
    """The first `seq` the step's parent refers to that the transcript no longer holds: the
    conversation's next `seq` went back below it (a pop gave it back), which no put undoes."""
    if step.base is None or moved.later_step is not None:
        return None
    held = [s for s in step.base.segments if isinstance(s, SeqRange) and s.stop > moved.next_seq]
    return max(held[0].start, moved.next_seq) if held else None


def _removed_outside(thread_id: str, seq: int) -> StorageFailure:
    """A checkpoint refers to a message of the transcript that is gone: retrying cannot help."""
    return StorageFailure(
        f"thread {thread_id!r}: a checkpoint refers to message seq {seq} of its conversation, "
        "which is no longer stored: it was removed outside the checkpointer (a pop made "
        "before pops of a thread's messages were refused, or a direct write), or the "
        "conversation deleted; retrying cannot bring it back: delete the thread to start it "
        "over"
    )


def _step_turn_id(
    parent_id: str | None, messages: Sequence[AgentMessage], fork_id: str | None
) -> str:
    """The turn of the messages a checkpoint adds to its parent's: named by both (and by the
    new checkpoint's id, `fork_id`, when a branch logs messages again)."""
    content = [m.model_dump(mode="json", exclude={"created_at"}) for m in messages]
    named_by: list[Any] = [parent_id, content]
    if fork_id is not None:
        named_by.append(fork_id)
    named = json.dumps(named_by, sort_keys=True, ensure_ascii=False)
    return LANGGRAPH_TURN + hashlib.sha256(named.encode()).hexdigest()[:32]


def _fork_turn_id(source_id: str, first_message_id: str) -> str:
    """The turn id of a copied chunk of a forked thread: the same copy, retried, is one turn.
    It has the shape of a fork's copies (`fork-` and 32 hex digits), whose first digits name
    the source (`copy_mark`), so an earlier attempt of the copy is told by its turns
    (`copied_from`) whatever the source holds since (a pop of a chunk's first message)."""
    named = f"{source_id}\0{first_message_id}"
    return FORK_TURN + copy_mark(source_id) + hashlib.sha256(named.encode()).hexdigest()[:24]


_STORE_FIELDS = {"_id", "conversation_id", "seq", "user_id", "turn_id", "search_text", "truncated"}


def _as_new(message: AgentMessage) -> Mapping[str, Any]:
    """A stored message as a caller sends it again: without the fields the store sets."""
    return {k: v for k, v in message.model_dump(by_alias=True).items() if k not in _STORE_FIELDS}


def _turn_chunks(messages: Sequence[AgentMessage]) -> list[list[AgentMessage]]:
    """The messages in chunks that one turn can log: whole source turns where they fit.

    A source turn that makes or answers a call the chunk already made or answered (a
    call decided again, by time travel) starts a chunk of its own: one turn makes and
    answers each call once.
    """
    turns: list[list[AgentMessage]] = []
    for message in messages:
        if turns and turns[-1][-1].turn_id == message.turn_id:
            turns[-1].append(message)
        else:
            turns.append([message])
    chunks: list[list[AgentMessage]] = [[]] if turns else []
    for turn in turns:
        if len(chunks[-1]) + len(turn) > MAX_MESSAGES_PER_TURN or _decides_again(chunks[-1], turn):
            chunks.append([])
        for message in turn:
            if len(chunks[-1]) == MAX_MESSAGES_PER_TURN:
                chunks.append([])
            chunks[-1].append(message)
    return chunks


def _decides_again(chunk: Sequence[AgentMessage], turn: Sequence[AgentMessage]) -> bool:
    """Whether a turn makes a call the chunk made or answered, or answers one it answered."""
    made, answered = _calls_of(chunk)
    makes, answers = _calls_of(turn)
    return bool(makes & (made | answered) or answers & answered)


def _calls_of(messages: Sequence[AgentMessage]) -> tuple[set[str], set[str]]:
    """The ids of the tool calls the messages make, and of those they answer."""
    made = {call.id for m in messages for call in m.tool_calls or ()}
    answered = {m.tool_call_id for m in messages if m.tool_call_id is not None}
    return made, answered
