"""What a fork reads of the conversation it copies: the messages up to where it ends, in
batches a reply of any server carries, and never much past what a fork may copy."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import bson

from agent_store.core import (
    AgentMessage,
    AssistantMessage,
    SystemMessage,
    ToolMessage,
    UserMessage,
    message_adapter,
    utc_now,
)
from agent_store.store._fork import fork_end
from agent_store.store._turns import MAX_MESSAGES_PER_TURN, MAX_TURN_TOOL_CALLS

MAX_FORK_BYTES = 16 * 1024 * 1024
"""How many bytes of messages, as stored (BSON), one fork reads at most: those up to where it
ends, which it holds at once with their copies, and whose copies its answer echoes."""
FORK_BATCH_BYTES = 16 * 1024 * 1024
"""About how many bytes of messages one read of a fork asks for: as many messages as this
holds of the largest read so far (at first, of the largest a turn may store), a reply any
server sends (the embedded server sends a read whole, up to 48 MB)."""
_ROLES: dict[str, type[SystemMessage | UserMessage | AssistantMessage | ToolMessage]] = {
    "system": SystemMessage,
    "user": UserMessage,
    "assistant": AssistantMessage,
    "tool": ToolMessage,
}
OUTLINE = {"_id": 0, "seq": 1, "turn_id": 1, "role": 1, "tool_call_id": 1}
"""What a fork reads of a message past those it reads whole: where the fork ends."""


def limit_said(over: str) -> str:
    """The limit named `over` (that `ForkRead.over` names), said."""
    return {
        "messages": f"a fork copies at most {MAX_MESSAGES_PER_TURN} messages",
        "tool calls": f"a fork copies at most {MAX_TURN_TOOL_CALLS:,} tool calls",
        "bytes": f"a fork copies at most {MAX_FORK_BYTES:,} bytes of messages as stored",
    }[over]


@dataclass
class ForkRead:
    """The messages a fork read: whole up to `through`, then the outlines (`OUTLINE`) of later
    ones a fork's end depends on (the message at `at_seq`, results of calls read whole)."""

    messages: list[AgentMessage] = field(default_factory=list)
    turn_starts: Sequence[int] = ()
    """Where the source's copies began a turn of its original, when it is a fork
    (`forked_from.turn_starts`): its turns, as `fork_end` tells them apart."""
    sizes: dict[int, int] = field(default_factory=dict)
    """Each `seq` read whole: its message's size as stored."""
    through: int = -1
    """The last `seq` read whole."""
    over: str | None = None
    """The limit (`limit_said`) the messages read whole went past, the read stopping there (a fork
    ending at or past `through` copies past it too); None when it read all a fork copies."""
    stored: set[int] = field(default_factory=set)
    """Every `seq` stored up to the end of the turn the fork ends in, once `over` is None."""
    made: set[str] = field(default_factory=set)
    calls: int = 0
    total: int = 0
    largest: int = 1
    """The largest message read whole so far; before any, the largest a turn may store."""
    read_at: datetime = field(default_factory=utc_now)
    """The clock read as the read began, before any message was: a `seq` it found no message
    at is passed only if its block was older than `abandon_after` then (`Gaps.passed`)."""

    def take(self, document: Mapping[str, Any]) -> None:
        """Read one more message whole, noting the limit it takes the read past."""
        message = message_adapter.validate_python(document)
        seq = message.seq or 0
        self.sizes[seq] = size = len(bson.encode(document))
        self.total += size
        self.largest = max(self.largest, size) if self.messages else size
        made = [call.id for call in message.tool_calls or ()]
        self.made.update(made)
        self.calls += len(made)
        self.messages.append(message)
        self.stored.add(seq)
        self.through = seq
        if self.total > MAX_FORK_BYTES:
            self.over = "bytes"
        elif len(self.messages) > MAX_MESSAGES_PER_TURN:
            self.over = "messages"
        elif self.calls > MAX_TURN_TOOL_CALLS:
            self.over = "tool calls"

    def bytes_past(self, end: int) -> bool:
        """Whether the messages read whole up to `end` are past `MAX_FORK_BYTES` as stored."""
        return sum(size for seq, size in self.sizes.items() if seq <= end) > MAX_FORK_BYTES


async def read_fork(
    collection: Any,
    own: Mapping[str, Any],
    at_seq: int,
    turn_end: Callable[[int], int],
    largest: int,
    turn_starts: Sequence[int] = (),
    left_out: Callable[[Mapping[str, Any]], bool] = lambda message: False,
) -> ForkRead:
    """What a fork at `at_seq` of the messages `own` selects reads: every message up to where
    it ends (`fork_end`) whole, in batches, unless they go past a limit first (the read
    stops there), the outlines of the later ones its end depends on, and, when it read all,
    the `seq`s stored up to `turn_end` of its end. `largest`: the largest message a turn
    may store, which sizes the first read. `turn_starts`: the source's, when it is a fork
    (`ForkRead.turn_starts`). `left_out`: the messages under the id that are not the
    conversation's own (a turn's given up for good, `_reservation.stored_by_turns_given_up`),
    read as no message at their `seq`.

    Read whole up to `at_seq` with no message there, it reads nothing more: a message landing
    at `at_seq` since is a turn the fork raced, never one a later read puts in what it read
    whole (the fork waits for that turn, or holds no message at `at_seq`). A read past those
    read whole so follows only a limit the read stopped at (`ForkRead.over`)."""
    read = ForkRead(turn_starts=turn_starts, largest=max(1, largest))
    mine = _Own(collection, own, left_out)
    await _read_whole(read, mine, -1, at_seq)
    if read.over is None and at_seq not in read.stored:
        return read
    later = await _outlines(read, mine, at_seq)
    if read.over is not None:
        read.messages += later
        return read
    end = fork_end([*read.messages, *later], at_seq, turn_starts)
    await _read_whole(read, mine, at_seq, end)
    if read.over is not None:
        read.messages += await _outlines(read, mine, at_seq)
    else:
        read.stored |= await _seqs(mine, end, turn_end(end))
    return read


@dataclass(frozen=True)
class _Own:
    """The messages a fork reads: those `own` selects in `collection`, less those
    `left_out` tells are not the conversation's own."""

    collection: Any
    own: Mapping[str, Any]
    left_out: Callable[[Mapping[str, Any]], bool]

    async def find(
        self, query: Mapping[str, Any], fields: Mapping[str, Any] | None, *, limit: int = 0
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The messages of `query` (within `own`) in `seq` order, `limit` at most (0: all):
        those kept, and all read."""
        found = self.collection.find({**self.own, **query}, fields).sort("seq", 1)
        found = found.limit(limit) if limit else found.batch_size(MAX_TURN_TOOL_CALLS)
        read: list[dict[str, Any]] = await found.to_list(None)
        return [d for d in read if not self.left_out(d)], read


async def _read_whole(read: ForkRead, mine: _Own, after: int, upto: int) -> None:
    """Read whole the messages past `after` up to `upto`, a batch at a time, until one goes
    past a limit."""
    while read.over is None and after < upto:
        size = max(1, min(MAX_MESSAGES_PER_TURN, FORK_BATCH_BYTES // read.largest))
        query = {"seq": {"$gt": after, "$lte": upto}}
        batch, every = await mine.find(query, None, limit=size)
        for document in batch:
            read.take(document)
            if read.over is not None:
                return
        if len(every) < size:
            return
        after = int(every[-1]["seq"])


async def _outlines(read: ForkRead, mine: _Own, at_seq: int) -> list[AgentMessage]:
    """The outlines of the messages past those read whole a fork's end depends on: the one at
    `at_seq`, and results of the calls read whole."""
    if at_seq <= read.through and not read.made:
        return []
    query = {
        "seq": {"$gt": read.through},
        "$or": [{"seq": at_seq}, {"role": "tool", "tool_call_id": {"$in": sorted(read.made)}}],
    }
    found, _ = await mine.find(query, OUTLINE)
    return [_ROLES[d["role"]].model_construct(**d) for d in found]


async def _seqs(mine: _Own, after: int, upto: int) -> set[int]:
    """The `seq`s stored past `after` up to `upto`."""
    if upto <= after:
        return set()
    query = {"seq": {"$gt": after, "$lte": upto}}
    found, _ = await mine.find(query, {"_id": 0, "seq": 1, "turn_id": 1})
    return {int(document["seq"]) for document in found}
