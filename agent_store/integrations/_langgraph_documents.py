"""The checkpoint collection's documents, and how a messages channel points into a transcript.

Pure, no I/O. A checkpoint's messages channel is stored as segments: runs of
`seq` values of the thread's transcript in `agent_messages` (`SeqRange`),
and runs of messages held in the checkpoint itself (`Inline`: an edited
message, or one the OpenAI format cannot hold). A graph that only appends is
one range, `[0, high-water)`; anything else says so in its metadata.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bson import Int64
from langchain_core.messages import BaseMessage

from agent_store.core import Conversation, InvalidInput, shown_key
from agent_store.store import LANGGRAPH_CHECKPOINTS, ThreadLife

CHECKPOINTS = LANGGRAPH_CHECKPOINTS
"""One document per checkpoint, its pending writes and the extras of the messages it logged
inside, each naming the user and the conversation it was written for (extension collection:
the store deletes, erases and claims its documents with their conversations,
`store.THREAD_COLLECTIONS`)."""
REWRITTEN = "agent_store_messages"
"""The metadata key set to "rewritten" when a checkpoint's messages are not the transcript up
to a high-water `seq`."""

NO_TASK = "00000000-0000-0000-0000-000000000000"
"""The task id LangGraph writes a command's own writes under (its `NULL_TASK_ID`): the answer
`Command(resume=...)` gives a pause, and a `Command(update=...)`."""
INTERRUPT = "__interrupt__"
"""The channel of a task's pause (LangGraph's `INTERRUPT` write)."""

Serialize = Callable[[Any], tuple[str, bytes]]
Deserialize = Callable[[tuple[str, bytes]], Any]


@dataclass(frozen=True)
class SeqRange:
    """The transcript's messages with `start <= seq < stop`."""

    start: int
    stop: int


@dataclass(frozen=True)
class Inline:
    """Messages the checkpoint holds itself: not in the transcript as they are here."""

    messages: tuple[BaseMessage, ...]


Segment = SeqRange | Inline


def place_all(segments: list[Segment], places: Iterable[int | BaseMessage]) -> list[Segment]:
    """`segments` followed by `places` (a transcript `seq`, or a message held inline), merged."""
    out = list(segments)
    for place in places:
        if isinstance(place, int):
            _append_range(out, place, place + 1)
        elif out and isinstance(out[-1], Inline):
            out[-1] = Inline((*out[-1].messages, place))
        else:
            out.append(Inline((place,)))
    return out


def places_of(segments: Sequence[Segment]) -> list[int | BaseMessage]:
    """Each message's place in `segments`, one by one (`place_all`'s inverse)."""
    places: list[int | BaseMessage] = []
    for segment in segments:
        if isinstance(segment, SeqRange):
            places.extend(range(segment.start, segment.stop))
        else:
            places.extend(segment.messages)
    return places


def _append_range(out: list[Segment], start: int, stop: int) -> None:
    last = out[-1] if out else None
    if isinstance(last, SeqRange) and last.stop == start:
        out[-1] = SeqRange(last.start, stop)
    else:
        out.append(SeqRange(start, stop))


def is_rewritten(segments: Sequence[Segment]) -> bool:
    """Whether the value is anything but the transcript up to a high-water `seq` (or empty)."""
    if not segments:
        return False
    first = segments[0]
    return len(segments) > 1 or not isinstance(first, SeqRange) or first.start != 0


def encode_segments(segments: Sequence[Segment], dump: Serialize) -> list[dict[str, Any]]:
    encoded: list[dict[str, Any]] = []
    for segment in segments:
        if isinstance(segment, SeqRange):
            encoded.append({"from": Int64(segment.start), "to": Int64(segment.stop)})
        else:
            kind, data = dump(list(segment.messages))
            encoded.append({"type": kind, "data": data})
    return encoded


def decode_segments(encoded: Sequence[Mapping[str, Any]], load: Deserialize) -> list[Segment]:
    return [
        SeqRange(int(s["from"]), int(s["to"]))
        if "from" in s
        else Inline(tuple(load((s["type"], s["data"]))))
        for s in encoded
    ]


def remap_segments(segments: Sequence[Segment], seq_map: Mapping[int, int]) -> list[Segment]:
    """The same segments in a copy of the transcript whose `seq` values moved by `seq_map`."""
    out: list[Segment] = []
    for segment in segments:
        if isinstance(segment, Inline):
            out = place_all(out, segment.messages)
            continue
        first, last = seq_map[segment.start], seq_map[segment.stop - 1]
        if last - first == segment.stop - 1 - segment.start:
            _append_range(out, first, last + 1)
        else:
            out = place_all(out, (seq_map[s] for s in range(segment.start, segment.stop)))
    return out


def checkpoint_key(thread_id: str, checkpoint_ns: str, checkpoint_id: str) -> str:
    """A checkpoint document's `_id`: its three names, unambiguously."""
    return json.dumps([thread_id, checkpoint_ns, checkpoint_id], ensure_ascii=False)


def life_of(conversation: Conversation) -> ThreadLife:
    """The life of the conversation a thread is now, which its checkpoint documents name
    (`ThreadLife`): its `epoch`, never its `created_at` alone, which the caller starting it
    chose. An id deleted and taken again is another conversation."""
    read = {"epoch": conversation.epoch, "epoch_marks": conversation.epoch_marks}
    return ThreadLife.of(read | {"created_at": conversation.created_at})


def readable_by(user_id: str, life: ThreadLife) -> dict[str, Any]:
    """The checkpoint documents of a thread that its owner `user_id` reads, the thread being the
    conversation of `life`: those written for the user or for none (a service's, a thread's
    before it was assigned, or stored before documents named their owner), of this
    conversation (`ThreadLife.query`). A user reads no other: not another user's, not an
    earlier conversation's under the id."""
    return {"user_id": {"$in": [user_id, None]}, **life.query()}


# -- pending writes ---------------------------------------------------------------------------


def write_entries(
    writes: Sequence[tuple[str, Any]],
    task_id: str,
    task_path: str,
    index_of: Mapping[str, int],
    dump: Serialize,
) -> list[dict[str, Any]]:
    """A task's writes as stored: special channels (errors, interrupts) at their fixed index."""
    entries = []
    for index, (channel, value) in enumerate(writes):
        kind, data = dump(value)
        entries.append(
            {
                "task_id": task_id,
                "task_path": task_path,
                "idx": Int64(index_of.get(channel, index)),
                "channel": channel,
                "type": kind,
                "value": data,
            }
        )
    return entries


def before_the_answers(
    copies: Sequence[dict[str, Any]], sources: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """A copy's checkpoint documents as the source held them where the copy ends (a store
    fork at a paused call, a copy its fork stopped short): a checkpoint the source went on
    from past the copy (a checkpoint of the source whose parent it is, not copied) keeps
    only the writes made before it was answered (`unanswered`). The others as they are."""
    copied = {(copy["checkpoint_ns"], copy["checkpoint_id"]) for copy in copies}
    went_on = {
        (doc["checkpoint_ns"], doc.get("parent_checkpoint_id"))
        for doc in sources
        if "type" in doc and (doc["checkpoint_ns"], doc["checkpoint_id"]) not in copied
    }
    return [
        unanswered(copy) if (copy["checkpoint_ns"], copy["checkpoint_id"]) in went_on else copy
        for copy in copies
    ]


def unanswered(doc: dict[str, Any]) -> dict[str, Any]:
    """A paused checkpoint's document as it was before its pause was answered: of each task
    that paused there (an `__interrupt__` write) only its interrupts, and none of the
    command's own writes (`NO_TASK`: the `__resume__` that answered, an update with it).
    The writes of tasks that had finished before the pause stay; a checkpoint where no
    task paused is as it is."""
    writes = doc.get("writes") or []
    paused = {entry["task_id"] for entry in writes if entry["channel"] == INTERRUPT}
    if not paused:
        return doc
    kept = [
        entry
        for entry in writes
        if entry["channel"] == INTERRUPT or entry["task_id"] not in paused | {NO_TASK}
    ]
    return doc | {"writes": kept}


def pending_writes(
    entries: Sequence[Mapping[str, Any]], load: Deserialize
) -> list[tuple[str, str, Any]]:
    """The writes of a checkpoint as LangGraph reads them, in `writes_sort_key` order.

    Writes are appended, never rewritten in place: for one (task, index) the
    first regular write wins and the last special write (an error, an
    interrupt) wins, as LangGraph's own savers keep them.
    """
    chosen: dict[tuple[str, int], Mapping[str, Any]] = {}
    for entry in entries:
        key = (entry["task_id"], int(entry["idx"]))
        if key[1] < 0 or key not in chosen:
            chosen[key] = entry
    ordered = sorted(chosen.values(), key=lambda e: (e["task_path"], e["task_id"], e["idx"]))
    return [(e["task_id"], e["channel"], load((e["type"], e["value"]))) for e in ordered]


# -- filters ----------------------------------------------------------------------------------

_PLAIN_KEY = re.compile(r"^[^$.\x00][^.\x00]*\Z")


def metadata_filter(filter: Mapping[str, Any] | None) -> dict[str, Any]:
    """A `list` filter on metadata as a query; operator keys are refused, never run."""
    query: dict[str, Any] = {}
    for key, value in (filter or {}).items():
        _refuse_operators(key, value, "filter")
        query[f"metadata.{key}"] = value
    return query


def check_metadata_keys(value: Any, path: str = "metadata") -> None:
    """Refuse metadata a document cannot hold as it is: keys that are not strings, start
    with `$` or contain NUL."""
    if isinstance(value, Mapping):
        for key, inner in value.items():
            if not isinstance(key, str) or key.startswith("$") or "\x00" in key:
                raise InvalidInput(
                    f"invalid checkpoint {path} key {shown_key(str(key))}: keys are strings "
                    "without a "
                    "leading `$` or NUL"
                )
            check_metadata_keys(inner, f"{path}.{shown_key(key)}")
    elif isinstance(value, list | tuple):
        for item in value:
            check_metadata_keys(item, path)


def _refuse_operators(key: Any, value: Any, where: str) -> None:
    if not isinstance(key, str) or not _PLAIN_KEY.match(key):
        raise InvalidInput(
            f"invalid {where} key {shown_key(str(key))}: keys are plain names (no leading "
            "`$`, no `.`)"
        )
    if isinstance(value, Mapping):
        for inner_key, inner in value.items():
            _refuse_operators(inner_key, inner, where)
    elif isinstance(value, list | tuple):
        for item in value:
            if isinstance(item, Mapping):
                for inner_key, inner in item.items():
                    _refuse_operators(inner_key, inner, where)
