"""State that spans turns: calls left pending, answers and late results in later turns, ids."""

from __future__ import annotations

from pathlib import Path

from pydantic_ai.messages import ModelRequest, ToolReturnPart

from agent_store import AgentMessageLogger, ConversationStore
from agent_store.integrations.exports import (
    chat_completions,
    check_chat_completions,
    responses_items,
)
from agent_store.integrations.pydantic_ai import history_from_messages
from agent_store.integrations.streams import log_streamed_turn, parse_sse_text, turn_from_sse
from tests.conftest import Backend

STREAMS = Path(__file__).parent / "streams"
CID = "conv-cross"


# -- a late real result wins over the stand-in ----------------------------------------


async def test_a_late_real_result_is_what_every_replay_uses(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    cut_off = turn_from_sse(parse_sse_text((STREAMS / "sse_cut_off.sse").read_text()))
    await log_streamed_turn(
        logger=logger, store=store, conversation_id=CID, turn=cut_off, turn_id="t1", prompt="Book"
    )
    # The booking finished after the stream dropped; the runtime logs its result later.
    await logger.log_messages(
        CID,
        [
            {"role": "tool", "tool_call_id": "call_b1", "content": '{"booked":"TGV 6601"}'},
            {"role": "assistant", "content": "Booked: TGV 6601."},
        ],
        turn_id="t2",
    )
    stored = await store.transcript(CID)

    exported = chat_completions(stored)
    check_chat_completions(exported)
    assert [m["content"] for m in exported if m["role"] == "tool"] == ['{"booked":"TGV 6601"}']
    outputs = [i["output"] for i in responses_items(stored) if i["type"] == "function_call_output"]
    assert outputs == ['{"booked":"TGV 6601"}']
    returns = [
        p
        for m in history_from_messages(stored)
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    ]
    assert [(r.tool_call_id, r.content, r.outcome) for r in returns] == [
        ("call_b1", {"booked": "TGV 6601"}, "success")
    ]
