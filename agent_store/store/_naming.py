"""The automatic name as the stored messages give it.

An automatic name (`name_source` "auto") is the name the message `name_message_id` names
gives while that message is stored as the conversation's first user message with real text
(`auto_name`): a turn's reservation names a conversation still unnamed, before its messages
are stored. A pop of that message takes the name back (`_tail.unlogged`); so does whatever
else leaves it not so: the turn's block given back (refused after its reservation, or
abandoned by a first attempt with other content), the turn moved to the end behind another
user text (`_relocated.settle`), pops leaving no message at all. The name then goes back to
the one the stored messages give (`first_named`), else to none, so the next turn names the
conversation as it names a new one. A name a runtime or a person gave is never touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from bson import Int64

from agent_store.core import AgentMessage, message_adapter
from agent_store.store._reservation import absent_stays, literal
from agent_store.store._text import auto_name

NAMED_WINDOW = 20
"""How many user messages one read of the name's source takes at a time (`named_window`)."""

AUTOMATIC: dict[str, Any] = {"$eq": ["$name_source", "auto"]}
"""Whether the conversation's name is an automatic one (an expression)."""


class Named(NamedTuple):
    """The automatic name a stored message gives, and that message's id and `seq`."""

    name: str
    message_id: str
    seq: int | None


def first_named(stored: Iterable[AgentMessage], limit: int) -> Named | None:
    """The automatic name the first user message with real text among `stored` (in `seq`
    order) gives, with that message; None when none gives one."""
    for message in stored:
        if message.id and message.upload is None and (name := auto_name(message, limit)):
            return Named(name, message.id, message.seq)
    return None


def taken_from(message_ids: Sequence[str]) -> dict[str, Any]:
    """Whether the conversation's name is an automatic one taken from one of `message_ids`
    (an expression)."""
    by = {"$ifNull": ["$name_message_id", None]}
    return {"$and": [AUTOMATIC, {"$in": [by, literal(list(message_ids))]}]}


def popped(named: Named) -> dict[str, Any]:
    """Whether a pop removed the message `named` was read from, or is removing it (an
    expression): the conversation lists it at its `seq` in `popped_messages` (its id alone
    may be stored again at another `seq`, by its turn reserved anew) or marks it `popping`."""
    listed = {"$ifNull": ["$popped_messages", literal([])]}
    message = literal(named.message_id)
    seq = -1 if named.seq is None else named.seq
    at = {"$and": [{"$eq": ["$$p.i", message]}, {"$eq": ["$$p.s", seq]}]}
    removed = {"$size": {"$filter": {"input": listed, "as": "p", "cond": at}}}
    under_way = {"$ifNull": ["$popping.message_id", None]}
    return {"$or": [{"$gt": [removed, 0]}, {"$eq": [under_way, message]}]}


def named_again(taken: Any, named: Named | None) -> dict[str, Any]:
    """`name`, `name_source` and `name_message_id` where `taken` (an expression) says the
    automatic name goes: the name `named` gives (the stored messages', `first_named`) while
    its message still stands, else none (a pop between the read of `named` and this update
    removed it or is removing it: `popped`; the next turn names the conversation); as they
    are otherwise."""
    name: Any
    source: Any
    by: Any
    if named is None:
        name, source, by = literal(None), literal(None), "$$REMOVE"
    else:
        gone = popped(named)
        name = {"$cond": [gone, literal(None), literal(named.name)]}
        source = {"$cond": [gone, literal(None), "auto"]}
        by = {"$cond": [gone, "$$REMOVE", literal(named.message_id)]}
    kept_by = absent_stays("name_message_id", "$name_message_id")
    return {
        "name": {"$cond": [taken, name, "$name"]},
        "name_source": {"$cond": [taken, source, "$name_source"]},
        "name_message_id": {"$cond": [taken, by, kept_by]},
    }


UNNAMED: dict[str, Any] = {
    "$and": [
        {"$eq": [{"$ifNull": ["$name", None]}, None]},
        {"$eq": [{"$ifNull": ["$name_source", None]}, None]},
    ]
}
"""Whether the conversation has no name and none a person or a runtime gave (an
expression): the next turn would name it."""


def renamed(conversation: Mapping[str, Any], named: Named | None) -> dict[str, Any]:
    """The fields `named_again` sets on `conversation` (as read) when its automatic name is
    taken from a message that is not the first stored user message with real text (`named`:
    the one that is, `first_named`), or is not the name that message gives (its turn stored
    anew under the same ids with other text), guarded by the message it was read with; or, when it
    has no name (`UNNAMED`: read so, and still so), the name `named` gives, as a new turn
    names it; none otherwise (a runtime's or a person's name, one stored before
    `name_message_id` was)."""
    by = conversation.get("name_message_id")
    unnamed = conversation.get("name") is None and conversation.get("name_source") is None
    if unnamed and named is not None:
        return named_again(UNNAMED, named)
    if conversation.get("name_source") != "auto" or by is None:
        return {}
    if named is not None and named.message_id == by and conversation.get("name") == named.name:
        return {}
    return named_again(taken_from([str(by)]), named)


async def named_by_stored(
    messages: Any, conversation_id: str, limit: int, *, epoch: str | None, without: range
) -> Named | None:
    """`first_named` of the conversation's stored user messages (of its `epoch`, or none),
    but those at the `seq`s `without` (a block given back): one read while one of the first
    `NAMED_WINDOW` user messages has real text."""
    after = -1
    while True:
        window = named_window(conversation_id, epoch, after, without)
        docs = await messages.find(window).sort("seq", 1).limit(NAMED_WINDOW).to_list(None)
        named = first_named((message_adapter.validate_python(d) for d in docs), limit)
        if named is not None or len(docs) < NAMED_WINDOW:
            return named
        after = int(docs[-1]["seq"])


def named_window(
    conversation_id: str, epoch: str | None, after: int, without: range = range(0)
) -> dict[str, Any]:
    """The filter of the conversation's stored user messages (of its `epoch`, or none) past
    `seq` `after`, but those at the `seq`s `without`: read in `seq` order, `NAMED_WINDOW` at a
    time, they hold the first one naming it (`first_named`)."""
    query: dict[str, Any] = {"conversation_id": conversation_id, "role": "user"}
    if epoch is not None:
        query["epoch"] = {"$in": [epoch, None]}
    query["seq"] = {"$gt": after, "$nin": [Int64(seq) for seq in without]}
    return query
