"""Legacy turn documents (DESIGN §4) for the read-path comparison: write them, read them back.

The turns are written with `agent_store.legacy.legacy_turn_document` (the dual write's
mapping: one document with the user text and a flat list of response parts,
results after their round of calls). `read_legacy_transcript` is the old read path:
fetch a conversation's turns by time, explode each into messages and place each
tool result after its call (found by id, else by tool name).
"""

from __future__ import annotations

import json
from typing import Any

from agent_store.core import AgentMessage, message_adapter
from agent_store.legacy import LEGACY_TURNS, LegacyPart, normalize_part


def explode_turn(turn: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of one legacy turn, each tool result placed right after its call."""
    common = {"conversation_id": turn["conversation_id"], "user_id": turn.get("user_id")}
    at = turn["created_at"]
    first: dict[str, Any] = {
        "role": "system" if turn.get("is_system") else "user",
        "content": turn.get("user_message") or None,
        "created_at": at,
        **common,
    }
    if turn.get("upload_result"):
        first["upload"] = turn["upload_result"]
    messages = [first]
    parts = [normalize_part(p) for p in turn.get("response_parts") or []]
    results = {p.tool_call_id or p.tool_name: p for p in parts if p.kind == "tool_result"}
    calls: list[LegacyPart] = []

    def flush_calls() -> None:
        if not calls:
            return
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": c.tool_call_id, "function": {"name": c.tool_name, "arguments": c.args}}
                    for c in calls
                ],
                "created_at": at,
                **common,
            }
        )
        for call in calls:
            result = results.pop(call.tool_call_id, None) or results.pop(call.tool_name, None)
            if result is not None:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.tool_call_id,
                        "content": json.dumps(result.result),
                        "created_at": at,
                        **common,
                    }
                )
        calls.clear()

    for part in parts:
        if part.kind == "tool_call":
            calls.append(part)
            continue
        flush_calls()
        if part.kind == "text":
            messages.append({"role": "assistant", "content": part.content, "created_at": at})
        elif part.kind == "hitl":
            hitl = {"action": part.action, "params": part.params, "request_id": part.request_id}
            messages.append(
                {
                    "role": "assistant",
                    "content": part.content,
                    "hitl_action": hitl,
                    "created_at": at,
                }
            )
        elif part.kind == "error":
            messages.append(
                {"role": "assistant", "error": {"message": part.content}, "created_at": at}
            )
    flush_calls()
    for message in messages:
        message.update(common)
    return messages


async def read_legacy_transcript(db: Any, conversation_id: str) -> list[AgentMessage]:
    """The old read path: turns by time, exploded and re-ordered into one transcript."""
    turns = await (
        db[LEGACY_TURNS]
        .find({"conversation_id": conversation_id})
        .sort([("created_at", 1), ("_id", 1)])
        .batch_size(10_000)
        .to_list(None)
    )
    return [
        message_adapter.validate_python(message) for turn in turns for message in explode_turn(turn)
    ]
