"""Removing a conversation's last message so that a lost write or a retry never leaves it
half done: the pop rolls forward.

A pop is three writes on two documents, and none of them can be undone by the next:

1. mark: the conversation records the pop under way (`popping`: the message and what
   removing it changes in the summary), only if no pop is under way and none finished
   since the pop read the conversation (`pops`), so the message it read is still stored
   and only this pop may remove it;
2. remove: the message is deleted by its id;
3. finish: the summary is corrected and the mark cleared in one update, matched by the
   mark's message id, so it applies once (`_tail.unlogged`).

Any pop that finds a mark finishes that pop first (2 and 3 again: a no-op delete, then
the guarded update), whoever started it. A pop that raised remembers the message it was
removing, per conversation, in this process: its retry finishes it and answers with that
message rather than removing another.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agent_store.core import (
    AgentMessage,
    PendingCall,
    PendingHitl,
    PopInProgress,
    StorageUnavailable,
    StoreError,
    message_adapter,
)
from agent_store.store._driver import storage_errors
from agent_store.store._tail import (
    free_to_mark,
    mark,
    pop_in_progress,
    preview_of,
    quoted_in_preview,
    reads_pending_before,
    starts_a_turn,
    text_before,
    unlogged,
)

POP_ATTEMPTS = 5
"""How many times a pop reads the last message again when other pops keep coming first."""
_COUNTS_KEPT = 1024
"""Conversations whose count of finished pops a store remembers (the oldest are forgotten)."""


CallsBefore = Callable[[AgentMessage], Awaitable[tuple[list[PendingCall], PendingHitl | None]]]
"""What the messages before a message leave pending, calls and prompt (`ConversationStore`'s
own read)."""


@dataclass
class PopMemory:
    """What one store's pops remember between calls, in this process."""

    in_doubt: dict[str, AgentMessage] = field(default_factory=dict)
    """The message a pop that raised was removing, by conversation: its retry answers it."""
    counts: dict[str, int] = field(default_factory=dict)
    """The count of finished pops last seen, by conversation (0 when never seen)."""

    def remember(self, conversation_id: str, count: int) -> None:
        self.counts.pop(conversation_id, None)
        if len(self.counts) >= _COUNTS_KEPT:
            del self.counts[next(iter(self.counts))]
        self.counts[conversation_id] = count


@dataclass(frozen=True)
class Pop:
    """One pop of the conversation `scope` names: the last message `query` finds."""

    messages: Any
    conversations: Any
    scope: dict[str, Any]
    query: dict[str, Any]
    calls_before: CallsBefore
    preview_chars: int
    memory: PopMemory

    async def run(self) -> AgentMessage | None:
        """Remove the last message and answer it; None when there is none."""
        conversation_id = str(self.scope["_id"])
        earlier = self.memory.in_doubt.pop(conversation_id, None)
        if earlier is not None:
            try:
                found = await self._finish_under_way() and await self._stored(earlier)
            except StoreError:
                self.memory.in_doubt[conversation_id] = earlier  # still in doubt
                raise
            if not found:
                return earlier  # the earlier attempt removed it: its retry answers it
        pop: PopInProgress | None = None
        for _ in range(POP_ATTEMPTS):
            with storage_errors("read the last message"):
                doc = await self.messages.find_one(self.query, sort=[("seq", -1)])
            if doc is None:
                return None
            message = message_adapter.validate_python(doc)
            if pop is None or pop.message_id != message.id:  # else what it read still holds
                pop = await self._what_removing_changes(message)
            if await self._remove(conversation_id, message, pop):
                return message
            if not await self._finish_under_way():
                return None  # the conversation is gone
        raise StorageUnavailable(  # others were popping: it may pass, so it is retried
            f"could not pop the last message of conversation {conversation_id!r}: other pops "
            f"came first {POP_ATTEMPTS} times"
        )

    async def _what_removing_changes(self, message: AgentMessage) -> PopInProgress:
        """The summary change, from the messages before it when it started a turn or was the
        preview's source, or (all of them) when it answered a call or raised a prompt."""
        assert message.seq is not None
        started, preview = False, None
        calls: list[PendingCall] | None = None
        prompt: PendingHitl | None = None
        with storage_errors("read the messages before the last one"):
            if message.role in ("user", "system"):
                previous = await self.messages.find_one(
                    {"conversation_id": message.conversation_id, "seq": message.seq - 1}
                )
                started = starts_a_turn(message, previous)
            if quoted_in_preview(message):
                assert message.conversation_id is not None
                source = await self.messages.find_one(
                    text_before(message.conversation_id, message.seq), sort=[("seq", -1)]
                )
                source_message = message_adapter.validate_python(source) if source else None
                preview = preview_of(source_message, self.preview_chars)
            if reads_pending_before(message):
                calls, prompt = await self.calls_before(message)
        return pop_in_progress(
            message, started_turn=started, preview=preview, pending_before=calls, prompt=prompt
        )

    async def _remove(
        self, conversation_id: str, message: AgentMessage, pop: PopInProgress
    ) -> bool:
        """Mark, remove, finish; False when the mark was refused (another pop came first).

        The count of finished pops it marks under is the last one this store saw (0 for a
        conversation it never saw popped): a wrong one is refused, read, and tried again.
        """
        free = free_to_mark(self.memory.counts.get(conversation_id, 0))
        try:
            with storage_errors("mark the pop"):
                marked = await self.conversations.update_one({**self.scope, **free}, mark(pop))
            if not marked.matched_count:
                return False
            await self._finish(conversation_id, pop)
        except StoreError:
            # Its outcome unknown: the next pop of the conversation through this store is its
            # retry. Remembered only once it raised, so pops running at once never take
            # each other for a retry.
            self.memory.in_doubt[conversation_id] = message
            raise
        return True

    async def _finish(self, conversation_id: str, pop: PopInProgress) -> None:
        """Remove the marked message (a no-op if it is gone) and correct the summary once."""
        with storage_errors("remove the last message"):
            await self.messages.delete_one(
                {"_id": pop.message_id, "conversation_id": conversation_id}
            )
        with storage_errors("update the conversation"):
            await self.conversations.update_one(
                {"_id": conversation_id, "popping.message_id": pop.message_id}, unlogged(pop)
            )
        self.memory.remember(conversation_id, self.memory.counts.get(conversation_id, 0) + 1)

    async def _finish_under_way(self) -> bool:
        """Read how many pops finished, and finish the one under way if any; False when the
        conversation is missing (or not the scope's user's)."""
        conversation_id = str(self.scope["_id"])
        with storage_errors("read the conversation"):
            doc = await self.conversations.find_one(self.scope, {"popping": 1, "pops": 1})
        if doc is None:
            return False
        self.memory.remember(conversation_id, int(doc.get("pops") or 0))
        if doc.get("popping"):
            await self._finish(conversation_id, PopInProgress.model_validate(doc["popping"]))
        return True

    async def _stored(self, message: AgentMessage) -> bool:
        with storage_errors("look up the last message"):
            found = await self.messages.find_one(
                {"_id": message.id, "conversation_id": message.conversation_id}, {"_id": 1}
            )
        return found is not None
