"""The end of a conversation: what removing its last message changes. Pure, no I/O.

A runtime that corrects a turn (the Agents SDK's `pop_item`) removes the last
stored message. The conversation's summary must then say what it would have
said had the message never been logged: the turn it started is no longer
counted, its tokens are no longer summed, the preview no longer quotes it, a
HITL prompt it raised is no longer pending, and its `seq` is free again.

`seq` is given back only while no other turn has reserved past it
(`message_count` is still the removed `seq` + 1): the update's own condition
checks that atomically, so two turns never share a `seq`. A turn that
reserved in between keeps its block; the removed `seq` is then a gap that tail
readers pass as they pass an abandoned block.
"""

from __future__ import annotations

from typing import Any

from agent_store.core import AgentMessage, PendingCall
from agent_store.store._reservation import int64, literal
from agent_store.store._text import message_text, shorten

_PROMPT_ROLES = ("user", "system")


def starts_a_turn(message: AgentMessage, previous: dict[str, Any] | None) -> bool:
    """Whether logging `message` counted a turn, as the logger counts them.

    A turn starts at a user or system message that does not follow another one of
    those within the same logged turn (`previous` is the stored message before it).
    """
    if message.role not in _PROMPT_ROLES:
        return False
    if previous is None or previous.get("turn_id") != message.turn_id:
        return True
    return previous.get("role") not in _PROMPT_ROLES


def quoted_in_preview(message: AgentMessage) -> bool:
    """Whether the conversation's preview may quote this message (so must be recomputed)."""
    return message.role in ("user", "assistant") and bool(message_text(message))


def text_before(conversation_id: str, seq: int) -> dict[str, Any]:
    """The query of the user or assistant messages with text before `seq` (the preview's source)."""
    return {
        "conversation_id": conversation_id,
        "seq": {"$lt": seq},
        "role": {"$in": ["user", "assistant"]},
        "$or": [
            {"content": {"$nin": [None, ""]}},
            {"error": {"$ne": None}},
            {"upload": {"$ne": None}},
        ],
    }


def preview_of(message: AgentMessage | None, limit: int) -> str:
    """The preview a conversation shows when `message` is its last one with text."""
    return shorten(message_text(message), limit) if message is not None else ""


def _less(field: str, amount: int) -> dict[str, Any]:
    return int64({"$max": [0, {"$subtract": [{"$ifNull": [f"${field}", 0]}, amount]}]})


def touches_pending(message: AgentMessage) -> bool:
    """Whether logging `message` changed what its conversation awaits (calls or a prompt)."""
    return bool(
        message.tool_calls
        or message.role == "tool"
        or message.hitl_action is not None
        or (message.role == "user" and message.upload is not None)
    )


def unlogged(
    message: AgentMessage,
    *,
    started_turn: bool,
    preview: str | None,
    pending_calls: list[PendingCall] | None = None,
) -> list[Any]:
    """The update pipeline that takes a removed last message out of its conversation's summary.

    `preview` is the new preview, or None to keep the current one. `pending_calls` are the
    calls the messages before it leave pending (`pending_after`), or None to keep the
    list; they replace it only while no turn has reserved past the removed message, since
    they were read before this update. A prompt the message raised is no longer pending; a
    prompt resolved before is not brought back (a resolution by request id leaves no message).
    """
    assert message.seq is not None
    usage = message.token_usage
    untouched = {"$eq": ["$message_count", message.seq + 1]}
    stage: dict[str, Any] = {
        "message_count": int64({"$cond": [untouched, message.seq, "$message_count"]}),
        "turn_count": _less("turn_count", int(started_turn)),
        "usage.input_tokens": _less("usage.input_tokens", usage.input_tokens if usage else 0),
        "usage.output_tokens": _less("usage.output_tokens", usage.output_tokens if usage else 0),
        "pending_hitl": {
            "$cond": [
                {"$eq": ["$pending_hitl.message_id", literal(message.id)]},
                literal(None),
                "$pending_hitl",
            ]
        },
    }
    if pending_calls is not None:
        listed = literal([call.model_dump() for call in pending_calls])
        stage["pending_calls"] = {"$cond": [untouched, listed, "$pending_calls"]}
    if preview is not None:  # a turn that reserved past the message has set its own
        stage["last_message_preview"] = {
            "$cond": [untouched, literal(preview), "$last_message_preview"]
        }
    return [{"$set": stage}]
