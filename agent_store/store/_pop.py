"""Removing a conversation's last message so that a lost write or a retry never leaves it
half done: the pop rolls forward.

What removing the message changes is read from the messages before it first, before any
write: when those reads come upon a `seq` below the message with no message that a turn is
still writing (`Gaps.passed` does not pass it), the pop raises StorageUnavailable (retry
shortly) and writes nothing.

The last message is the last below the conversation's end (`message_count`): no mark ever
lets a pop remove one past it (a deleted conversation's late insert, a dead given-up turn's
landing past the end pops left). Read before the conversation was, it is passed once the pop,
refused for it (its mark, the caller's check, or a LangGraph thread's), reads the conversation
and finds it there: it reads the last message again below the end.

A pop is three writes on two documents, and none of them can be undone by the next:

1. mark: the conversation records the pop under way (`popping`: the message and what
   removing it changes in the summary), only if no pop is under way and none finished
   since the pop read the conversation (`pops`), so the message it read is still stored
   and only this pop may remove it, and no turn holds a `seq` past it, so it is the last
   (a turn still being written there: the pop raises StorageUnavailable, retry shortly;
   its block is passed once older than `abandon_after`, as tail readers pass it);
2. remove: the message is deleted by its id;
3. finish: the summary is corrected and the mark cleared in one update, matched by the
   mark's message id, so it applies once (`_tail.unlogged`).

Then the whole texts of a cut message are read back, so that the pop answers the message
as it was logged, and go, by the ids its `truncated` map names (four more round trips, for a
cut message only): once the pop is done nothing else holds them. A pop that stops before
leaves them to the conversation's delete or its owner's erasure, which find them by
conversation id; its retry answers the message whole from them.

Any pop that finds a mark finishes that pop first (2 and 3 again: a no-op delete, then
the guarded update), whoever started it. A pop that raised remembers the message it was
removing, per conversation and caller's scope (its user id, or none for a service), and the
task it ran in, in this process; each pop that raised is remembered, so pops running at once
are never taken for each other. Its retry finishes it and answers with that message rather
than removing another, if the conversation records that a pop removed it (the mark the retry
finishes, or `popped_messages`): a conversation deleted and started again under the id does
not, and the retry pops its last message. The retry is the scope's next pop from the same
task, or, from another task, the scope's next pop while that pop is the only one in doubt;
a call that cannot be told among two or more is refused (Conflict), finishing one of them
and removing nothing. A conversation claimed by another user id since is still finished by
the retry (its mark is bookkeeping of the pop the caller started, read by id), which answers
the message if it was removed, and None without removing one if not. A caller of another
scope never gets it, nor finishes it by being taken for the retry.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from agent_store.core import (
    AgentMessage,
    Conflict,
    PopInProgress,
    PoppedMessage,
    StorageUnavailable,
    StoreError,
    message_adapter,
    popped_up_to,
    utc_now,
)
from agent_store.store._blobs import kept_blob_ids
from agent_store.store._driver import storage_errors
from agent_store.store._fork import copies_turn_of, fork_turns_of
from agent_store.store._indexes import LANGGRAPH_TURN, LIFE_READ, checkpoints_referring_to
from agent_store.store._reservation import (
    UNSTANDING_READ,
    conversation_by_id,
    life_still_as_read,
    refuse_unless_standing,
)
from agent_store.store._tail import (
    LeftBefore,
    free_to_mark,
    mark,
    pop_in_progress,
    preview_of,
    quoted_in_preview,
    reads_pending_before,
    starts_a_turn,
    unlogged,
)
from agent_store.store._text import auto_name
from agent_store.store._turns import GAPS_READ, Gaps, is_fork_turn, is_own_turn_id

POPS_READ: dict[str, Any] = {"pops": 1, "popped_messages": 1, "popping": 1}
"""What tells the pops of a conversation since it was read (`popped_since_read`)."""

POP_ATTEMPTS = 5
"""How many times a pop reads the last message again when other pops keep coming first."""
_COUNTS_KEPT = 1024
"""Conversations whose count of finished pops a store remembers (the oldest are forgotten)."""
_IN_DOUBT_KEPT = 64
"""Pops in doubt a store remembers per conversation and scope, not yet retried (the oldest
are forgotten: a retry of one pops anew)."""


CallsBefore = Callable[[AgentMessage], Awaitable[LeftBefore]]
"""What the messages before a message leave, with the answers a person gave: calls and
prompt pending, approvals withdrawn, and the `seq`s below it with no message
(`ConversationStore`'s own read)."""
PREVIEW_WINDOW = 16
"""How many messages before the last one a pop reads at once to find the preview's source
(the window widens fourfold while none of them has text)."""


Scope = tuple[str, str | None]
"""Who pops what: the conversation id, and the user id the caller is scoped to (None for a
service)."""


_CALLER: ContextVar[object | None] = ContextVar("agent_store_pop_caller", default=None)
"""Who pops, as far as this process can tell: one token per chain of awaits (an asyncio task,
and the tasks it starts after), set when a pop of it raises. A retry awaited in the same
task carries it; a retry from a task started before it, or from another request, does not."""


def _caller() -> object:
    """The token of the calling task, set now if none of its pops raised before."""
    caller = _CALLER.get()
    if caller is None:
        caller = object()
        _CALLER.set(caller)
    return caller


@dataclass(frozen=True)
class InDoubt:
    """A pop that raised with its outcome unknown, remembered for its retry."""

    message: AgentMessage
    """The message it was removing."""
    pop_id: str | None
    """Its `PopInProgress.pop_id`: the mark it left, and the `popped_messages` entry it made."""
    caller: object
    """The token of the task it ran in (`_CALLER`)."""
    shared: bool = False
    """A pop was refused because it could not be told among this one and others: only a
    call from this pop's own task is its retry now."""

    @property
    def earlier(self) -> tuple[str | None, str | None]:
        return self.message.id, self.pop_id


@dataclass
class PopMemory:
    """What one store's pops remember between calls, in this process."""

    in_doubt: dict[Scope, list[InDoubt]] = field(default_factory=dict)
    """The pops that raised, by conversation and caller's scope, oldest first: each is
    retried once, by the call `take` matches to it, and answered to no other scope."""
    counts: dict[str, int] = field(default_factory=dict)
    """The count of finished pops last seen, by conversation (0 when never seen)."""

    def remember(self, conversation_id: str, count: int) -> None:
        self.counts.pop(conversation_id, None)
        if len(self.counts) >= _COUNTS_KEPT:
            del self.counts[next(iter(self.counts))]
        self.counts[conversation_id] = count

    def keep(self, scope: Scope, pop: InDoubt) -> None:
        """Remember a pop that raised, for its retry."""
        kept = self.in_doubt.setdefault(scope, [])
        kept.append(pop)
        del kept[:-_IN_DOUBT_KEPT]

    def take(self, scope: Scope) -> tuple[InDoubt | None, bool]:
        """The pop in doubt the calling pop retries (None when the scope has none), and
        whether it is told apart: the one the calling task left (`_CALLER`), else the
        scope's only one unless a refusal shared it. Not told apart (two or more of the
        task's own, or of the scope's when none is its own): it hands the oldest back to
        be finished and refused, and the others it could be taken for are shared."""
        kept = self.in_doubt.pop(scope, [])
        caller = _CALLER.get()
        own = [p for p in kept if caller is not None and p.caller is caller]
        candidates = own or kept
        if not candidates:
            return None, False
        taken = candidates[0]
        told = len(candidates) == 1 and (bool(own) or not taken.shared)
        left = [
            p if told or not any(p is c for c in candidates) else replace(p, shared=True)
            for p in kept
            if p is not taken
        ]
        if left:
            self.in_doubt[scope] = left
        return taken, told


Refusal = Callable[[AgentMessage], StoreError | None]
"""A caller's check of the message a pop would remove: the error to raise, or None."""


@dataclass(frozen=True)
class Pop:
    """One pop of the conversation `scope` names: the last message `query` finds."""

    messages: Any
    conversations: Any
    scope: dict[str, Any]
    query: dict[str, Any]
    calls_before: CallsBefore
    preview_chars: int
    name_chars: int
    """How long an automatic name is (`TurnRules.name_chars`): the name the message gives."""
    memory: PopMemory
    abandon_after: timedelta
    """How long a turn may hold a `seq` past the last message before the pop passes it."""
    forget_texts: Callable[[Sequence[str]], Awaitable[None]]
    """Deletes whole texts by blob id (`FullTextStore.forget_files`)."""
    restore: Callable[[Sequence[AgentMessage]], Awaitable[list[AgentMessage]]]
    """Puts the cut fields of messages back whole (`FullTextStore.restore`): what a pop
    answers, read before `forget_texts` deletes them."""
    checkpoints: Any
    """The LangGraph checkpointer's collection: a message its checkpoints refer to stays."""
    refuse: Refusal | None = None
    """The caller's check of the last message before anything is written: the error it gives
    is raised, nothing removed (`ConversationStore.pop_last_message`'s `refuse`)."""

    async def run(self) -> AgentMessage | None:
        """Remove the last message and answer it; None when there is none."""
        scope: Scope = (str(self.scope["_id"]), self.scope.get("user_id"))
        retried, answer, conversation = await self._retry(scope)
        if retried:
            return answer
        # Else no pop of the caller's was in doubt, or it removed nothing here (or the
        # conversation is another one, started again under the id since): this pop is the
        # one asked for.
        pop: PopInProgress | None = None
        for _ in range(POP_ATTEMPTS):
            read_at = utc_now()  # before the last message is read: what judges the blocks past it
            with storage_errors("read the last message"):
                doc = await self.messages.find_one(
                    _own(self.query, conversation), sort=[("seq", -1)]
                )
            if doc is None:
                await self._nothing_to_pop(read_at)
                return None
            message = message_adapter.validate_python(doc)
            if message.epoch is None and conversation is None:
                # A message stored before epochs tells no life: the conversation's does, read
                # before the message (a conversation started again since has its own epoch,
                # and its own messages carry it).
                visible, conversation, _ = await self._finish_under_way()
                if not visible:
                    return None
                continue
            if conversation is None:
                try:  # what it read may lie past the end: refused for it, or...
                    pop = await self._checked(scope[0], message, None)
                except StoreError:
                    visible, conversation, _ = await self._finish_under_way()
                    if not visible or not _past_its_end(message, conversation):
                        raise
                    continue  # ...its mark would be: the conversation's own last one next
            else:
                pop = await self._checked(scope[0], message, pop)
            count = self._passing(message, conversation, read_at)
            removed = await self._remove(scope, message, pop, count, conversation)
            if removed is not None:
                return removed
            visible, conversation, _ = await self._finish_under_way()
            if not visible:
                return None  # the conversation is gone
        raise StorageUnavailable(  # others were popping or logging: it may pass, so retried
            f"could not pop the last message of conversation {scope[0]!r}: other pops or "
            f"turns came first {POP_ATTEMPTS} times"
        )

    async def _checked(
        self, conversation_id: str, message: AgentMessage, pop: PopInProgress | None
    ) -> PopInProgress:
        """What removing `message` changes (`pop`, when computed for it already: what it read
        still holds), once the caller's check (`refuse`) and the LangGraph thread's
        (`_refuse_a_threads`) let it go; the error either gives is raised, nothing written."""
        if pop is None or pop.message_id != message.id:
            pop = await self._what_removing_changes(message)
        if self.refuse is not None and (refused := self.refuse(message)) is not None:
            raise refused
        await self._refuse_a_threads(conversation_id, message)
        return pop

    async def _nothing_to_pop(self, read_at: datetime) -> None:
        """No message found: refused for no conversation (a delete's mark, a fork not made
        yet), StorageUnavailable while a turn is still writing its first messages (its block
        reserved, nothing inserted yet, at `read_at`, the clock read before the messages
        were: the pop would answer "no message" just before it lands); else there is nothing
        to pop. One read, as the refusal's explanation alone."""
        with storage_errors("read the conversation"):
            doc = await self.conversations.find_one(
                self.scope, {**UNSTANDING_READ, **GAPS_READ, "message_count": 1}
            )
        conversation_id = str(self.scope["_id"])
        refuse_unless_standing(conversation_id, doc, "the pop")
        gaps = Gaps.of(doc)
        first = gaps.unpassed_from(now=read_at, abandon_after=self.abandon_after)
        if first is None:
            return
        count = int((doc or {}).get("message_count") or 0)
        writing = gaps.written(range(first, count), now=read_at, abandon_after=self.abandon_after)
        if writing is not None:
            raise _still_written(conversation_id, writing)

    async def _retry(
        self, scope: Scope
    ) -> tuple[bool, AgentMessage | None, Mapping[str, Any] | None]:
        """Finish the pop in doubt this call retries (`PopMemory.take`), if any. True and its
        message (whole) when it removed it from this conversation; True and None when it removed
        nothing and the conversation is no longer the scope's (claimed, or gone): nothing
        to pop. Else False, and the conversation as read (None when not read, or a pop was
        finished since). Conflict when the call cannot be told among pops in doubt: the
        oldest is finished, and no pop removes a message for it."""
        earlier, told = self.memory.take(scope)
        if earlier is None:
            return False, None, None
        try:
            visible, conversation, removed = await self._finish_under_way(earlier.earlier)
            if not visible:
                removed = await self._finish_own(scope, earlier)
            answer = await self._whole(earlier.message) if removed and told else None
        except BaseException:  # a StoreError, or a caller's timeout cancelling it
            self.memory.keep(scope, earlier if told else replace(earlier, shared=True))
            raise
        if not told:
            raise Conflict(
                f"could not pop the last message of conversation {scope[0]!r}: pops of it "
                "through this store raised with their outcome unknown, and the store cannot "
                "tell which of them this call retries (it comes from none of their tasks): "
                "the pop in doubt is finished and nothing more removed; read the transcript"
            )
        if removed or not visible:
            return True, answer, None
        return False, None, conversation

    async def _finish_own(self, scope: Scope, earlier: InDoubt) -> bool:
        """Whether the pop `earlier` removed its message from the conversation, which is no
        longer the scope's (claimed by another user id since, or gone): read by id alone.
        A mark of one of the scope's pops in doubt is finished (the bookkeeping of a pop
        the caller started while the conversation was its own); any other is left."""
        ours = [earlier.earlier, *(p.earlier for p in self.memory.in_doubt.get(scope, ()))]
        with storage_errors("read the conversation"):
            doc = await self.conversations.find_one(
                conversation_by_id(scope[0]), {"popping": 1, "popped_messages": 1}
            )
        if doc is None:
            return False
        if doc.get("popping"):
            pop = PopInProgress.model_validate(doc["popping"])
            if (pop.message_id, pop.pop_id) in ours:
                await self._finish(scope[0], pop)
                if (pop.message_id, pop.pop_id) == earlier.earlier:
                    return True
        return any(
            _removed_by(PoppedMessage.model_validate(p), *earlier.earlier)
            for p in doc.get("popped_messages") or ()
        )

    async def _refuse_a_threads(self, conversation_id: str, message: AgentMessage) -> None:
        """Conflict, before anything is written, when a LangGraph checkpoint of the
        conversation's life refers to the message (`_referred`): removed, it would leave the
        thread's checkpoints referring to a message no longer stored. A message the
        checkpointer logged (`LANGGRAPH_TURN`) that none refers to yet is waited for as a turn
        still being written (StorageUnavailable: its checkpoint, stored after it, may be on
        its way) until `abandon_after` from when it was logged (a put that never stored it):
        then it pops as any other."""
        assert message.seq is not None
        if await self._referred(conversation_id, message.seq):
            raise Conflict(
                f"could not pop the last message of conversation {conversation_id!r}: "
                f"message seq {message.seq} belongs to a LangGraph thread's checkpoints, which "
                "refer to it (removing it would break the thread); nothing was removed. Go "
                "back with the graph's own means (`graph.update_state`, or resuming from an "
                "earlier checkpoint_id), or delete the thread to start it over"
            )
        logged = is_own_turn_id(message.turn_id, LANGGRAPH_TURN)
        if logged and utc_now() - message.created_at < self.abandon_after:
            raise StorageUnavailable(
                f"message seq {message.seq} of conversation {conversation_id!r} was "
                "logged by the LangGraph checkpointer and no checkpoint refers to it yet (its "
                "checkpoint may still be being written): retry the pop in a moment"
            )

    async def _referred(self, conversation_id: str, seq: int) -> bool:
        """Whether a LangGraph checkpoint of the conversation's life refers to its message
        `seq`: of the conversation as read now, selected by the rule every reader of the
        thread's documents follows (`thread_of`: of one created since checkpoints named
        epochs, only those naming its epoch), never one a graph put after an earlier
        conversation under the id was deleted, whatever it names. One lookup when no
        checkpoint under the id refers to `seq` (no graph, or none past it); else the
        conversation's life is read and its checkpoints looked up (two more). False when the
        conversation is gone (the pop's mark finds nothing)."""
        anywhere = checkpoints_referring_to(conversation_id, seq)
        with storage_errors("read the conversation's LangGraph checkpoints"):
            if await self.checkpoints.find_one(anywhere, {"_id": 1}) is None:
                return False
            found = await self.conversations.find_one(
                conversation_by_id(conversation_id), LIFE_READ
            )
            if found is None:
                return False
            query = checkpoints_referring_to(conversation_id, seq, found)
            return await self.checkpoints.find_one(query, {"_id": 1}) is not None

    def _passing(
        self, message: AgentMessage, conversation: Mapping[str, Any] | None, read_at: datetime
    ) -> int | None:
        """None when the mark may simply require that no turn holds a `seq` past `message`
        (no read of the conversation says otherwise); the `message_count` read when every
        `seq` past it is passed (`Gaps.passed`: a pop's gap, or a block abandoned at
        `read_at`, the clock read before `message` was). StorageUnavailable while a turn is
        still being written past it."""
        assert message.seq is not None
        if conversation is None:
            return None
        count = int(conversation.get("message_count") or 0)
        gaps = Gaps.of(conversation)
        past = gaps.held(range(message.seq + 1, count))
        if not past:
            return None
        writing = gaps.written(past, now=read_at, abandon_after=self.abandon_after)
        if writing is not None:
            raise _still_written(str(message.conversation_id), writing)
        return count

    async def _what_removing_changes(self, message: AgentMessage) -> PopInProgress:
        """The summary change, from the messages before it when it started a turn or was the
        preview's source, or (all of them) when it answered a call or raised a prompt.

        Computed before the mark, so before anything is removed: when these reads come upon
        a `seq` below the message with no message, StorageUnavailable while a turn is still
        writing it (`_gaps_below`)."""
        assert message.seq is not None
        started, preview, quoted = False, None, None
        before: LeftBefore | None = None
        missing: set[int] = set()
        read_at = utc_now()  # before the messages below are read: what judges their holes
        with storage_errors("read the messages before the last one"):
            previous, updated_at = await last_before(
                self.messages, self.conversations, message.conversation_id, message.seq
            )
            # The `seq`s just under the message with no message stored (a turn may still be
            # writing a later time there, or they are gaps no turn will fill).
            under = range(0 if previous is None else int(previous["seq"]) + 1, message.seq)
            if message.role in ("user", "system"):
                if under:
                    missing.add(message.seq - 1)
                adjacent = None if under else previous
                started = starts_a_turn(message, adjacent) or await self._begins_a_copied_turn(
                    message
                )
            if quoted_in_preview(message):
                source, unseen = await preview_source(
                    self.messages, message.conversation_id, message.seq
                )
                missing.update(unseen)
                preview = preview_of(source, self.preview_chars)
                quoted = preview_of(message, self.preview_chars)
            if reads_pending_before(message):
                before = await self.calls_before(message)
                missing.update(before.missing)
        # Kept while a turn is still writing under the message; past gaps no turn holds (a
        # pop's, a moved turn's, an abandoned block) the time of the messages stored below.
        writing_under = await self._gaps_below(message, sorted(missing), under, read_at)
        return pop_in_progress(
            message,
            started_turn=started,
            preview=preview,
            updated_at=None if writing_under else updated_at,
            quoted=quoted,
            before=before,
            named=auto_name(message, self.name_chars) if message.upload is None else None,
            left_none=previous is None and not writing_under,
        )

    async def _begins_a_copied_turn(self, message: AgentMessage) -> bool:
        """Whether `message`, a fork's copy (of the turn holding its copies, `copies_turn_of`,
        not a later turn named like it), began a turn of the fork's original (its `seq` in
        `forked_from.turn_starts`): the fork counted it (`fork_turn_count`), though its copies
        are one turn. One more read, only for a prompt copied after another one."""
        if message.role not in ("user", "system") or not is_fork_turn(message.turn_id):
            return False
        doc = await self.conversations.find_one(
            conversation_by_id(message.conversation_id), {"forked_from": 1}
        )
        copied = message.turn_id == copies_turn_of(doc or {})
        return copied and message.seq in fork_turns_of(doc or {})

    async def _gaps_below(
        self, message: AgentMessage, missing: list[int], under: range, read_at: datetime
    ) -> bool:
        """StorageUnavailable when a turn is still writing one of `missing`, `seq`s below
        `message` where its reads found no message: what removing it changes depends on
        them. Else whether a turn is still writing one of `under`, the `seq`s just under it
        with no message. Passed (`Gaps.passed`): the gaps pops and moved turns left
        (`popped_seqs`) and the blocks older than `abandon_after` at `read_at`, the clock
        read before those reads. One more round trip, only when the reads found such a
        `seq`."""
        if not missing and not under:
            return False
        with storage_errors("read the conversation's turns"):
            doc = await self.conversations.find_one(
                conversation_by_id(message.conversation_id), GAPS_READ
            )
        gaps = Gaps.of(doc)
        writing = gaps.written(missing, now=read_at, abandon_after=self.abandon_after)
        if writing is not None:
            raise _still_written(str(message.conversation_id), writing)
        return gaps.written(under, now=read_at, abandon_after=self.abandon_after) is not None

    async def _remove(
        self,
        scope: Scope,
        message: AgentMessage,
        pop: PopInProgress,
        count: int | None,
        conversation: Mapping[str, Any] | None,
    ) -> AgentMessage | None:
        """Mark, remove, finish, and answer the message whole (`_whole`); None when the mark
        was refused (another pop came first, or a turn holds a `seq` past the message; with
        `count`, `message_count` changed; the conversation is no longer of the message's life,
        its `epoch`: deleted and started again under the id since, by anyone).

        The count of finished pops it marks under is the last one this store saw (0 for a
        conversation it never saw popped): a wrong one is refused, read, and tried again.
        """
        assert message.seq is not None
        conversation_id = scope[0]
        pops = self.memory.counts.get(conversation_id, 0)
        free = free_to_mark(pops, message.seq, message_count=count)
        life = _life_of(pop, conversation)
        try:
            with storage_errors("mark the pop"):
                query = {**self.scope, **free, **life}
                marked = await self.conversations.update_one(query, mark(pop))
            if not marked.matched_count:
                return None
            await self._finish(conversation_id, pop)
            # Its whole texts, read for the answer, then deleted, once it is gone (a crash
            # before leaves them to the conversation's delete or its owner's erasure, which
            # find them by conversation; its retry reads them).
            whole = await self._whole(message)
            await self.forget_texts(list(kept_blob_ids(message).values()))
        except BaseException:
            # Its outcome unknown (a StoreError, or a caller's timeout cancelling it while a
            # write was on its way): the next pop of the conversation by this caller through
            # this store is its retry. Remembered only once it raised, so pops running at
            # once never take each other for a retry.
            self.memory.keep(scope, InDoubt(message, pop.pop_id, _caller()))
            raise
        return whole

    async def _whole(self, message: AgentMessage) -> AgentMessage:
        """The message with its cut fields put back whole, as it was logged (two round trips
        for a cut message, none otherwise; a field whose whole text is gone stays cut)."""
        if not kept_blob_ids(message):
            return message
        return (await self.restore([message]))[0]

    async def _finish(self, conversation_id: str, pop: PopInProgress) -> None:
        """Remove the marked message (a no-op if it is gone) and correct the summary once."""
        await finish_pop(self.messages, self.conversations, conversation_id, pop)
        self.memory.remember(conversation_id, self.memory.counts.get(conversation_id, 0) + 1)

    async def _finish_under_way(
        self, earlier: tuple[str | None, str | None] | None = None
    ) -> tuple[bool, Mapping[str, Any] | None, bool]:
        """Read the conversation (how many pops finished, its next `seq` and its gaps), and
        finish the pop under way if any. False when it is missing (or not the scope's
        user's); with True, the conversation as read, or None when a pop was finished (what
        was read is stale). Last, whether the pop `earlier` (its message id and `pop_id`)
        removed its message from this conversation (the pop it finished, or one its
        `popped_messages` lists: by that pop, or by any pop for an entry that names none)."""
        conversation_id = str(self.scope["_id"])
        read = {"popping": 1, "pops": 1, "message_count": 1, "epoch": 1, "created_at": 1}
        read |= UNSTANDING_READ
        read |= GAPS_READ
        if earlier is not None:
            read["popped_messages"] = 1
        with storage_errors("read the conversation"):
            doc: Mapping[str, Any] | None = await self.conversations.find_one(self.scope, read)
        if doc is None:
            return False, None, False
        refuse_unless_standing(conversation_id, doc, "the pop")
        self.memory.remember(conversation_id, int(doc.get("pops") or 0))
        removed = earlier is not None and any(
            _removed_by(PoppedMessage.model_validate(p), *earlier)
            for p in doc.get("popped_messages") or ()
        )
        if doc.get("popping"):
            pop = PopInProgress.model_validate(doc["popping"])
            await self._finish(conversation_id, pop)
            return True, None, removed or (pop.message_id, pop.pop_id) == earlier
        return True, doc, removed


def _life_of(pop: PopInProgress, conversation: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a pop's mark matches the conversation's life by: the `epoch` of the message it
    read; for a message stored before epochs, the life of the conversation as read before
    it (its `epoch`, else its `created_at` and no epoch yet: `still_as_read`): never one
    deleted and started again since, even given the same `created_at`."""
    if pop.epoch is not None or conversation is None:
        return {} if pop.epoch is None else {"epoch": pop.epoch}
    return life_still_as_read(conversation)


async def finish_pop(
    messages: Any, conversations: Any, conversation_id: str, pop: PopInProgress
) -> None:
    """Roll the pop under way `pop` (the conversation's mark) forward: remove its message (a
    no-op if it is gone) and correct the summary once, clearing the mark (an update matched by
    the mark: a no-op if another write finished it first). What any pop does with a mark it
    finds, and what a turn's reservation and a read of the summary do (`finish_marked`)."""
    with storage_errors("remove the last message"):
        await messages.delete_one(
            {"_id": pop.message_id, "conversation_id": conversation_id, "epoch": pop.epoch}
        )
    with storage_errors("update the conversation"):
        await conversations.update_one(
            conversation_by_id(conversation_id) | {"popping.message_id": pop.message_id},
            unlogged(pop),
        )


async def finish_marked(
    messages: Any, conversations: Any, conversation: Mapping[str, Any] | None
) -> bool:
    """Finish the pop under way that `conversation` (a document read with its `popping`) is
    marked with, if any: True when there was one (what was read is stale, read it again).

    No write decides on a summary a pop under way has not corrected yet, and no read serves
    it: a turn's reservation matches only a conversation with no mark (`reservation_filter`),
    and, refused for one, finishes the pop and reserves again; the reads of the summary
    finish it and read again. Two round trips more, only when a mark is found."""
    marked = (conversation or {}).get("popping")
    if not marked:
        return False
    assert conversation is not None
    pop = PopInProgress.model_validate(marked)
    await finish_pop(messages, conversations, str(conversation["_id"]), pop)
    return True


async def last_before(
    messages: Any, conversations: Any, conversation_id: str | None, seq: int
) -> tuple[dict[str, Any] | None, Any]:
    """The last message stored before `seq` (None if none is), and the conversation's
    `updated_at` without what lies from `seq` on, as logging the messages before alone sets
    it (a turn keeps the latest time logged): the latest of their times, whatever their
    `seq` order, else the conversation's `created_at` (one more read, only when no message
    remains). One read while times follow `seq` order (`last_and_latest`)."""
    below = {"conversation_id": conversation_id, "seq": {"$lt": seq}}
    previous, latest = await last_and_latest(messages, below, seq)
    if latest is not None:
        return previous, latest["created_at"]
    doc = await conversations.find_one(conversation_by_id(conversation_id), {"created_at": 1})
    return None, (doc or {}).get("created_at")


async def last_and_latest(
    messages: Any, below: dict[str, Any], seq: int, projection: dict[str, Any] | None = None
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Of the messages `below` finds (stored before `seq`): the last by `seq`, and the latest
    by time (`created_at`; the later `seq` of equal times), None when none is. The latest is
    read first: while times follow `seq` order it is the one at `seq - 1`, the last, and one
    read gives both; the last is read too (one read more) only when they do not (clocks skew
    between pods, runtimes send their own times) or `seq - 1` holds no message."""
    latest = await messages.find_one(below, projection, sort=[("created_at", -1), ("seq", -1)])
    if latest is None or latest["seq"] == seq - 1:
        return latest, latest
    return await messages.find_one(below, projection, sort=[("seq", -1)]), latest


async def preview_source(
    messages: Any, conversation_id: str | None, seq: int
) -> tuple[AgentMessage | None, list[int]]:
    """The last user or assistant message with text before `seq` (the preview's source once
    what lies from `seq` on is gone, None if there is none), and the `seq`s between them
    with no message: what a pop reads for the message it removes, and a block given back
    for its turn (`AgentMessageLogger._give_back`).

    Reads the `PREVIEW_WINDOW` messages before it, then a window four times wider below
    while none has text: one round trip unless that many messages without text precede
    it."""
    upper, size, missing = seq, PREVIEW_WINDOW, list[int]()
    while upper > 0:
        low = max(0, upper - size)
        window = {"conversation_id": conversation_id, "seq": {"$gte": low, "$lt": upper}}
        docs = await messages.find(window).sort("seq", -1).to_list(None)
        for doc in docs:
            missing += range(int(doc["seq"]) + 1, upper)
            upper = int(doc["seq"])
            found = message_adapter.validate_python(doc)
            if quoted_in_preview(found):
                return found, missing
        missing += range(low, upper)
        upper, size = low, size * 4
    return None, missing


def _own(query: dict[str, Any], conversation: Mapping[str, Any] | None) -> dict[str, Any]:
    """`query` for the last message, once a read of the conversation told its `epoch` and its
    end (`message_count`): its own messages (that epoch, or none) below its end, never one
    lying past its last one, which no mark would ever let the pop remove (`_past_its_end`)."""
    if conversation is None:
        return query
    own = {**query, "seq": {"$lt": _end_of(conversation)}}
    epoch = conversation.get("epoch")
    return own if epoch is None else {**own, "epoch": {"$in": [epoch, None]}}


def _past_its_end(message: AgentMessage, conversation: Mapping[str, Any] | None) -> bool:
    """Whether `message` lies past the last message of `conversation` (read after it; False
    when not read), where no mark lets a pop remove it (`nothing_reserved_past`): a deleted
    conversation's late insert (another `epoch`), or a message at or past `message_count`,
    the landing of a turn given up for good in a block pops passed since, its writer gone
    before it looked (until an insert meets it: `_with_turns_given_up`)."""
    if conversation is None:
        return False
    assert message.seq is not None
    epoch = conversation.get("epoch")
    other_life = epoch is not None and message.epoch not in (None, epoch)
    return other_life or message.seq >= _end_of(conversation)


def _end_of(conversation: Mapping[str, Any]) -> int:
    """The `seq` the conversation's next turn reserves from (`message_count`): every message
    of it lies below."""
    return int(conversation.get("message_count") or 0)


def _removed_by(entry: PoppedMessage, message_id: str | None, pop_id: str | None) -> bool:
    """Whether the pop `pop_id` removed the message `entry` lists (any pop did, for an entry
    kept before pops recorded themselves)."""
    return entry.message_id == message_id and entry.pop_id in (None, pop_id)


def _still_written(conversation_id: str, seq: int) -> StorageUnavailable:
    return StorageUnavailable(
        f"a turn of conversation {conversation_id!r} is still being written at seq "
        f"{seq}: retry the pop in a moment"
    )


def popped_since_read(found: Mapping[str, Any], pops: int, end: int) -> bool:
    """Whether a pop removed a `seq` up to `end` from the conversation `found` (read now with
    `POPS_READ`) since it was read with `pops` pops finished (`Conversation.popped_since`, of a
    document): one under way there (`popping`), or one of the pops finished since, each of
    which listed its message last (`popped_messages`, the newest kept: all of them were,
    when more pops finished than it keeps)."""
    marked = found.get("popping")
    popping = int(marked.get("seq", end + 1)) if isinstance(marked, Mapping) else None
    since = int(found.get("pops") or 0) - pops
    listed = [p for p in found.get("popped_messages") or () if isinstance(p, Mapping)]
    return popped_up_to(end, since, popping, [int(p.get("s", 0)) for p in listed])
