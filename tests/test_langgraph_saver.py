"""The LangGraph checkpointer on a real tool agent: the state LangGraph's own saver would give,
each message stored once in the conversation, histories rewritten, forks, owners, round trips."""

from __future__ import annotations

import asyncio
import contextlib
import operator
import re
import threading
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Annotated, Any, TypedDict

import httpx
import pytest
from bson import DBRef
from langchain_core.messages import AIMessage, HumanMessage, RemoveMessage, ToolMessage
from langgraph.checkpoint.base import copy_checkpoint, empty_checkpoint
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.message import add_messages
from langgraph.types import Command, Send, interrupt
from pydantic_ai.messages import ModelRequest, ToolReturnPart
from pymongo import AsyncMongoClient

from agent_store import (
    AgentMessageLogger,
    Conflict,
    ConversationStore,
    InvalidInput,
    LegacyTurns,
    NotFound,
    StorageFailure,
    StorageUnavailable,
    TurnRules,
)
from agent_store.core import INTERRUPTED_RESULT, PENDING_RESULT
from agent_store.integrations._langgraph_documents import check_metadata_keys, metadata_filter
from agent_store.integrations.exports import chat_completions
from agent_store.integrations.langgraph import CHECKPOINTS, REWRITTEN, AgentStoreSaver
from agent_store.integrations.pydantic_ai import history_from_messages
from agent_store.legacy import LEGACY_TURNS
from agent_store.store import (
    CONVERSATIONS,
    MESSAGES,
    MIGRATING,
    BeingDeleted,
    checkpoints_referring_to,
)
from scripts.langgraph_agent import approval_agent, comparable, question, tool_agent
from tests.api_harness import SERVICE_TOKEN, auth_headers, serve
from tests.conftest import COUNTED, Backend

TURNS = 50


def thread(user_id: str | None = None, thread_id: str | None = None) -> dict[str, Any]:
    configurable: dict[str, Any] = {"thread_id": thread_id or f"thread-{uuid.uuid4().hex[:12]}"}
    if user_id is not None:
        configurable["user_id"] = user_id
    return {"configurable": configurable}


async def run_turns(graph: Any, config: dict[str, Any], turns: range) -> None:
    for turn in turns:
        await graph.ainvoke(question(turn), config)


# Fifty turns write ~900 documents: one wire driver is enough at the wire server's pace.
@pytest.mark.parametrize(
    "backend",
    ["mongomock", pytest.param("wire", marks=pytest.mark.wire)],
    indirect=True,
)
async def test_fifty_turns_end_in_the_state_langgraphs_in_memory_saver_gives(
    backend: Backend,
) -> None:
    config = thread()
    saver = AgentStoreSaver(backend.db)
    await run_turns(tool_agent(saver), config, range(1, TURNS + 1))
    reference = tool_agent(InMemorySaver())
    await run_turns(reference, config, range(1, TURNS + 1))

    ours = (await tool_agent(saver).aget_state(config)).values["messages"]
    theirs = (await reference.aget_state(config)).values["messages"]
    assert comparable(ours) == comparable(theirs)
    assert len(ours) == TURNS + TURNS // 2 * 3 + TURNS // 2

    # A saver that has seen nothing of the thread reads back the very same messages, ids too.
    cold = (await tool_agent(AgentStoreSaver(backend.db)).aget_state(config)).values["messages"]
    assert cold == ours


async def test_the_conversation_holds_every_message_once_with_tool_calls_paired(
    backend: Backend,
) -> None:
    config = thread()
    graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(graph, config, range(1, 11))
    state = (await graph.aget_state(config)).values["messages"]

    thread_id = config["configurable"]["thread_id"]
    transcript = await ConversationStore(backend.db).transcript(thread_id)
    assert [(m.role, m.content) for m in transcript] == [
        (_role(m), m.content or None if isinstance(m, AIMessage) and m.tool_calls else m.content)
        for m in state
    ]
    assert [m.seq for m in transcript] == list(range(len(state)))
    calls_made: set[str] = set()
    for message in transcript:
        if message.role == "tool":
            assert message.tool_call_id in calls_made
        calls_made |= {call.id for call in message.tool_calls or ()}
    conversation = await ConversationStore(backend.db).get_conversation(thread_id)
    assert conversation.turn_count == 10
    assert conversation.usage.output_tokens == 7 * sum(isinstance(m, AIMessage) for m in state)


def _role(message: Any) -> str:
    return {"human": "user", "ai": "assistant", "tool": "tool", "system": "system"}[message.type]


async def test_the_viewer_shows_a_langgraph_thread() -> None:
    from tests.api_harness import mongomock_db

    db = mongomock_db()
    config = thread()
    await run_turns(tool_agent(AgentStoreSaver(db)), config, range(1, 3))
    async with serve(db) as served:
        await served.http.post(
            "/viewer/login", data={"token": SERVICE_TOKEN}, headers={"Origin": "http://test"}
        )
        page = await served.http.get(f"/viewer/conversations/{config['configurable']['thread_id']}")
    assert page.status_code == 200
    for text in (
        "Question 1: how is the weather?",
        "Answer 1: noted",
        "City 2",
        "Answer 2: City 2",
    ):
        assert text in _unescaped(page)


def _unescaped(page: httpx.Response) -> str:
    import html

    return html.unescape(page.text)


# -- histories rewritten ---------------------------------------------------------------------


async def both(config: dict[str, Any], db: Any) -> tuple[Any, Any]:
    """The agent on this store and on LangGraph's in-memory saver, three turns in."""
    ours, theirs = tool_agent(AgentStoreSaver(db)), tool_agent(InMemorySaver())
    for graph in (ours, theirs):
        await run_turns(graph, config, range(1, 4))
    return ours, theirs


async def test_removing_a_message_keeps_it_in_the_conversation_and_marks_the_checkpoint(
    backend: Backend,
) -> None:
    config = thread()
    ours, theirs = await both(config, backend.db)
    for graph in (ours, theirs):
        await graph.aupdate_state(config, {"messages": [RemoveMessage(id="human-1")]})
        await run_turns(graph, config, range(4, 5))

    state = await ours.aget_state(config)
    assert comparable(state.values["messages"]) == comparable(
        (await theirs.aget_state(config)).values["messages"]
    )
    assert "human-1" not in [m.id for m in state.values["messages"]]
    assert state.metadata is not None
    assert state.metadata[REWRITTEN] == "rewritten"
    transcript = await ConversationStore(backend.db).transcript(config["configurable"]["thread_id"])
    assert transcript[0].content == "Question 1: how is the weather?"
    assert len(transcript) == len(state.values["messages"]) + 1
    # Only references: the checkpoint holds no message of its own.
    latest = await _latest_document(backend.db, config)
    assert all("from" in segment for segment in latest["messages"]["segments"])


async def test_an_edited_message_is_held_by_the_checkpoint_and_the_conversation_keeps_the_original(
    backend: Backend,
) -> None:
    config = thread()
    ours, theirs = await both(config, backend.db)
    edit = AIMessage(content="Answer 1, corrected", id="ai-1-answer")
    for graph in (ours, theirs):
        await graph.aupdate_state(config, {"messages": [edit]})
        await run_turns(graph, config, range(4, 5))

    mine = (await ours.aget_state(config)).values["messages"]
    assert comparable(mine) == comparable((await theirs.aget_state(config)).values["messages"])
    assert edit in mine
    cold = (await tool_agent(AgentStoreSaver(backend.db)).aget_state(config)).values["messages"]
    assert cold == mine
    transcript = await ConversationStore(backend.db).transcript(config["configurable"]["thread_id"])
    assert "Answer 1: noted" in [m.content for m in transcript]
    assert "Answer 1, corrected" not in [m.content for m in transcript]
    latest = await _latest_document(backend.db, config)
    assert sum("data" in segment for segment in latest["messages"]["segments"]) == 1


def _retried_tool(checkpointer: Any) -> Any:
    """The model calls a tool; the tool node answers "error: timeout"; a retry node then
    replaces that result under its id (`add_messages` replaces a message by id)."""

    def model(state: MessagesState) -> dict[str, list[Any]]:
        call = {"name": "fetch", "args": {}, "id": "call-1"}
        return {"messages": [AIMessage("", id="ai-1", tool_calls=[call])]}

    def tool(state: MessagesState) -> dict[str, list[Any]]:
        failed = ToolMessage("error: timeout", tool_call_id="call-1", id="tool-1", status="error")
        return {"messages": [failed]}

    def retry(state: MessagesState) -> dict[str, list[Any]]:
        return {"messages": [ToolMessage("ok after retry", tool_call_id="call-1", id="tool-1")]}

    builder = StateGraph(MessagesState)
    for name, node in (("model", model), ("tool", tool), ("retry", retry)):
        builder.add_node(name, node)
    builder.add_edge(START, "model")
    builder.add_edge("model", "tool")
    builder.add_edge("tool", "retry")
    builder.add_edge("retry", END)
    return builder.compile(checkpointer=checkpointer)


def _paired_results(replay: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each tool result of an export, with the id of the call it answers, checked to be made
    by the assistant message just before the run of results it belongs to."""
    paired: list[tuple[str, str]] = []
    made: set[str] = set()
    for message in replay:
        if message["role"] == "tool":
            assert message["tool_call_id"] in made, message
            paired.append((message["tool_call_id"], message["content"]))
        else:
            made = {call["id"] for call in message.get("tool_calls") or ()}
    return paired


async def test_a_tool_result_the_graph_replaces_under_its_id_is_logged_and_answers_its_call(
    backend: Backend,
) -> None:
    """A result edited under its id is a new answer to its call: the call is logged again and the
    new result with it, so the conversation ends as the graph's state, no call is left pending,
    and every export pairs each result with its call."""
    config = thread("user-ada")
    thread_id = config["configurable"]["thread_id"]
    ours, theirs = _retried_tool(AgentStoreSaver(backend.db)), _retried_tool(InMemorySaver())
    for graph in (ours, theirs):
        await graph.ainvoke(_said("fetch it"), config)

    mine = (await ours.aget_state(config)).values["messages"]
    assert mine == (await theirs.aget_state(config)).values["messages"]
    assert [m.content for m in mine] == ["fetch it", "", "ok after retry"]
    cold = _retried_tool(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(config)).values["messages"] == mine
    store = ConversationStore(backend.db)
    assert await store.pending_calls(thread_id, user_id="user-ada") == []
    transcript = await store.transcript(thread_id, user_id="user-ada")
    assert [m.content for m in transcript][-2:] == [None, "ok after retry"]
    replay = chat_completions(transcript)
    assert [said for _, said in _paired_results(replay)] == ["error: timeout", "ok after retry"]


async def test_a_replaced_tool_result_put_again_by_a_new_process_logs_nothing_again(
    backend: Backend,
) -> None:
    """The retry step re-run after a crash between its copies and its checkpoint (a new
    checkpoint id): it refers to the call's copy and the result logged with it."""
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    graph = _retried_tool(AgentStoreSaver(backend.db))
    await graph.ainvoke(_said("fetch it"), config)
    latest = await graph.checkpointer.aget_tuple(config)
    store = ConversationStore(backend.db)
    transcript = await store.transcript(thread_id)

    again = AgentStoreSaver(backend.db)
    assert latest.parent_config is not None
    await again.aget_tuple(latest.parent_config)
    rerun = copy_checkpoint(latest.checkpoint)
    rerun["id"] = str(uuid6())
    saved = await again.aput(latest.parent_config, rerun, latest.metadata, {})
    assert await store.transcript(thread_id) == transcript
    assert await store.pending_calls(thread_id) == []
    reread = await AgentStoreSaver(backend.db).aget_tuple(saved)
    assert reread is not None
    assert reread.checkpoint["channel_values"] == latest.checkpoint["channel_values"]


async def test_an_edit_of_a_tool_result_is_what_the_conversation_replays_with_no_call_pending(
    backend: Backend,
) -> None:
    """`update_state` writing a tool result again under its id, other content: its call is
    logged again with the edited result answering it, and the thread goes on from there."""
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    ours, theirs = await both(config, backend.db)
    for graph in (ours, theirs):
        [result] = [
            m for m in (await graph.aget_state(config)).values["messages"] if m.type == "tool"
        ]
        edit = result.model_copy(update={"content": "City 2: snow (corrected)"})
        await graph.aupdate_state(config, {"messages": [edit]})
        await run_turns(graph, config, range(4, 5))

    mine = (await ours.aget_state(config)).values["messages"]
    assert comparable(mine) == comparable((await theirs.aget_state(config)).values["messages"])
    cold = (await tool_agent(AgentStoreSaver(backend.db)).aget_state(config)).values["messages"]
    assert cold == mine
    store = ConversationStore(backend.db)
    assert await store.pending_calls(thread_id) == []
    replay = chat_completions(await store.transcript(thread_id))
    assert [said for _, said in _paired_results(replay)] == [
        "City 2: 18 degrees, light wind",  # the original, answering the call as it ran first
        "City 2: snow (corrected)",  # the edit, answering the call's copy
        "City 4: 18 degrees, light wind",
    ]
    assert PENDING_RESULT not in [m["content"] for m in replay]


async def test_a_calls_args_holding_nan_are_in_the_conversation_as_langchain_history_keeps_them(
    backend: Backend,
) -> None:
    """The transcript other readers see holds a call's NaN and infinities as JSON text, as
    LangChain's history stores them, not an empty `{}`."""
    config = thread()
    graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(graph, config, range(1, 2))
    call = {"name": "convert", "args": {"rate": float("nan"), "cap": float("inf")}, "id": "c-nan"}
    await graph.aupdate_state(config, {"messages": [AIMessage("", id="ai-nan", tool_calls=[call])]})

    transcript = await ConversationStore(backend.db).transcript(config["configurable"]["thread_id"])
    [stored] = [m for m in transcript if m.role == "assistant" and m.tool_calls]
    assert stored.tool_calls is not None
    assert stored.tool_calls[0].function.arguments == '{"rate":NaN,"cap":Infinity}'


async def test_a_graph_that_only_appends_is_never_marked_rewritten(backend: Backend) -> None:
    config = thread()
    graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(graph, config, range(1, 5))
    async for snapshot in graph.aget_state_history(config):
        assert REWRITTEN not in snapshot.metadata
    latest = await _latest_document(backend.db, config)
    messages = (await graph.aget_state(config)).values["messages"]
    assert latest["messages"]["segments"] == [{"from": 0, "to": len(messages)}]


# -- time travel -----------------------------------------------------------------------------

APPROVED = "City 2: 18 degrees, light wind"


async def test_a_fork_that_decides_a_paused_call_again_is_what_every_replay_reads(
    backend: Backend,
) -> None:
    config = thread()
    ours, theirs = approval_agent(AgentStoreSaver(backend.db)), approval_agent(InMemorySaver())
    for graph in (ours, theirs):
        await graph.ainvoke(question(2), config)  # pauses on call-2
        paused = (await graph.aget_state(config)).config
        await graph.ainvoke(Command(resume="yes"), config)
        for decision in ("no", "later"):  # LangGraph's time travel: fork the pause, resume it
            await graph.ainvoke(Command(resume=decision), await graph.aupdate_state(paused, None))
    mine = (await ours.aget_state(config)).values["messages"]
    assert comparable(mine) == comparable((await theirs.aget_state(config)).values["messages"])
    cold = approval_agent(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(config)).values["messages"] == mine

    transcript = await ConversationStore(backend.db).transcript(config["configurable"]["thread_id"])
    # The abandoned branches stay; each fork logs the call it decides again, then its answer.
    assert [m.content for m in transcript] == [
        "Question 2: how is the weather?",
        *(None, APPROVED, f"Answer 2: {APPROVED}"),
        *(None, "denied: no", "Answer 2: denied: no"),
        *(None, "denied: later", "Answer 2: denied: later"),
    ]
    replay = chat_completions(transcript)
    assert [m.get("content") for m in replay[-3:]] == [None, "denied: later", mine[-1].content]
    # A copy's tokens were spent once: the model's four replies, not the copies, count.
    conversation = await ConversationStore(backend.db).get_conversation(
        transcript[0].conversation_id
    )
    assert conversation.usage.output_tokens == 7 * 4
    history = history_from_messages(transcript)
    last_request = [m for m in history if isinstance(m, ModelRequest)][-1]
    assert [p.content for p in last_request.parts if isinstance(p, ToolReturnPart)] == [
        "denied: later"
    ]


async def test_replaying_from_before_the_models_call_leaves_the_call_pending_again(
    backend: Backend,
) -> None:
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(backend.db))
    store = ConversationStore(backend.db)
    await graph.ainvoke(question(2), config)
    before_call = [s async for s in graph.aget_state_history(config) if s.next == ("agent",)]
    await graph.ainvoke(Command(resume="yes"), config)
    assert await store.pending_calls(thread_id) == []

    replayed = approval_agent(AgentStoreSaver(backend.db))  # a process new to the thread
    await replayed.ainvoke(None, before_call[0].config)  # the model makes call-2 again; paused
    assert [c.tool_call_id for c in await store.pending_calls(thread_id)] == ["call-2"]
    await replayed.ainvoke(Command(resume="no"), config)
    assert await store.pending_calls(thread_id) == []
    transcript = await store.transcript(thread_id)
    replay = chat_completions(transcript)
    assert [m.get("content") for m in replay[-2:]] == ["denied: no", "Answer 2: denied: no"]
    state = (await graph.aget_state(config)).values["messages"]
    # The transcript ends as the state does: the call made again, its denial, the answer.
    assert [m.content for m in transcript[-3:]] == [m.content or None for m in state[-3:]]


async def test_going_on_from_before_a_paused_call_closes_the_call_the_branch_abandoned(
    backend: Backend,
) -> None:
    """Time travel past a pause: the branch holds no call, so the conversation awaits none;
    the abandoned call is answered by an `interrupted` stand-in, and the transcript ends as the
    branch does. Going back to the pause later still decides the call (on a copy of it)."""
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    ours, theirs = approval_agent(AgentStoreSaver(backend.db)), approval_agent(InMemorySaver())
    store = ConversationStore(backend.db)
    for graph in (ours, theirs):
        await graph.ainvoke(question(1), config)
        before = (await graph.aget_state(config)).config
        await graph.ainvoke(question(2), config)  # pauses on call-2
        await graph.ainvoke(question(3), before)  # the person changed their mind
        await graph.ainvoke(question(5), config)
    state = await ours.aget_state(config)
    mine = state.values["messages"]
    assert comparable(mine) == comparable((await theirs.aget_state(config)).values["messages"])
    assert state.next == ()
    assert await store.pending_calls(thread_id) == []
    transcript = await store.transcript(thread_id)
    assert [m.content for m in transcript[-4:]] == [m.content for m in mine[-4:]]
    replay = chat_completions(transcript)
    assert [m["content"] for m in replay if m["role"] == "tool"] == [INTERRUPTED_RESULT]
    assert PENDING_RESULT not in str(replay)
    cold = approval_agent(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(config)).values["messages"] == mine

    paused = [s async for s in ours.aget_state_history(config) if s.next == ("approve",)]
    await ours.ainvoke(Command(resume="yes"), paused[0].config)  # back to the pause after all
    assert await store.pending_calls(thread_id) == []
    replay = chat_completions(await store.transcript(thread_id))
    assert [m["content"] for m in replay[-2:]] == [APPROVED, f"Answer 2: {APPROVED}"]


async def test_a_paused_call_removed_with_remove_message_is_no_longer_pending(
    backend: Backend,
) -> None:
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(backend.db))
    store = ConversationStore(backend.db)
    await graph.ainvoke(question(2), config)  # pauses on call-2
    await graph.aupdate_state(config, {"messages": [RemoveMessage(id="ai-2-call")]}, "approve")
    assert await store.pending_calls(thread_id) == []
    await graph.ainvoke(question(3), config)

    messages = (await graph.aget_state(config)).values["messages"]
    assert [m.id for m in messages] == ["human-2", "human-3", "ai-3-answer"]
    assert await store.pending_calls(thread_id) == []
    transcript = await store.transcript(thread_id)
    assert [m.content for m in transcript[-2:]] == [m.content for m in messages[-2:]]
    conversation = await store.get_conversation(thread_id)
    assert conversation.turn_count == 2
    assert conversation.last_message_preview == "Answer 3: noted"
    cold = approval_agent(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(config)).values["messages"] == messages


# -- a call answered outside the graph ----------------------------------------------------------

_HER_ANSWERS = {
    "her denial": {"content": None, "error": {"message": "tool call denied"}},
    "a late result": {"content": "City 2: sunny (late)"},
}


async def _answer_pending_call(db: Any, user_id: str, thread_id: str, which: int, said: Any) -> str:
    """The person answers a call `pending_calls` serves her (her token's `tool` message, its
    `answers_to` as served), as a runtime's late result or her denial over HTTP is logged."""
    offered = await ConversationStore(db).pending_calls(thread_id, user_id=user_id)
    call = offered[which]
    answer = {"role": "tool", "tool_call_id": call.tool_call_id, **said}
    await AgentMessageLogger(db).log_messages(
        thread_id,
        [answer],
        user_id=user_id,
        owner_only=True,
        turn_id=f"her-answer-{call.tool_call_id}",
        answers_to={call.tool_call_id: call.message_id},
    )
    return call.tool_call_id


def _accepted_history(messages: list[Any]) -> None:
    """What a model provider checks of a history: no two calls of one id, no result without
    its call before it, none answered twice."""
    made = [call["id"] for m in messages if isinstance(m, AIMessage) for call in m.tool_calls]
    assert len(made) == len(set(made))
    answered: list[str] = []
    for index, message in enumerate(messages):
        if isinstance(message, ToolMessage):
            before = messages[:index]
            assert any(
                isinstance(m, AIMessage) and message.tool_call_id in {c["id"] for c in m.tool_calls}
                for m in before
            )
            answered.append(message.tool_call_id)
    assert len(answered) == len(set(answered))


@pytest.mark.parametrize("said", sorted(_HER_ANSWERS))
@pytest.mark.parametrize("paused_again", [False, True], ids=["going on", "paused again"])
async def test_an_answer_to_a_call_the_graph_left_behind_copies_nothing_of_the_conversation(
    backend: Backend, said: str, paused_again: bool
) -> None:
    """Paused on call-2, the person asks another question instead: the graph answers it and
    leaves call-2 behind (it awaits nothing), the store still offers it. Her answer to it
    (a denial over HTTP, or a late result) stays the call's; the graph's next steps, a plain
    question or the resume of a later pause, are appended once: no message stored twice, the
    call not offered again, the graph's history as LangGraph's own saver keeps it."""
    ada = thread("user-ada")
    thread_id = ada["configurable"]["thread_id"]
    ours, theirs = approval_agent(AgentStoreSaver(backend.db)), approval_agent(InMemorySaver())
    store = ConversationStore(backend.db)
    asked = [3, 5, 6] if paused_again else [3, 5]
    for graph in (ours, theirs):
        await graph.ainvoke(question(2), ada)  # pauses on call-2
        for turn in asked:
            await graph.ainvoke(question(turn), ada)
    before = await store.transcript(thread_id, user_id="user-ada")
    offered = await store.pending_calls(thread_id, user_id="user-ada")
    assert [c.tool_call_id for c in offered][:1] == ["call-2"]
    await _answer_pending_call(backend.db, "user-ada", thread_id, 0, _HER_ANSWERS[said])
    for graph in (ours, theirs):
        if paused_again:
            await graph.ainvoke(Command(resume="yes"), ada)  # the pause on call-6
        await graph.ainvoke(question(7), ada)
        await graph.ainvoke(question(9), ada)

    transcript = await store.transcript(thread_id, user_id="user-ada")
    added = 2 * 2 + (2 if paused_again else 0)  # questions 7 and 9; call-6's result, answer
    assert len(transcript) == len(before) + 1 + added
    assert sorted(Counter(m.content for m in transcript if m.role == "user").values()) == [1] * (
        3 + len(asked)
    )
    made = [c.id for m in transcript for c in m.tool_calls or ()]
    assert len(made) == len(set(made))
    assert await store.pending_calls(thread_id, user_id="user-ada") == []
    assert INTERRUPTED_RESULT not in str(chat_completions(transcript))
    mine = (await ours.aget_state(ada)).values["messages"]
    assert comparable(mine) == comparable((await theirs.aget_state(ada)).values["messages"])
    _accepted_history(mine)
    cold = approval_agent(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(ada)).values["messages"] == mine


async def test_an_answer_over_http_to_the_paused_call_is_kept_and_the_resume_copies_the_call(
    backend: Backend,
) -> None:
    """LANGGRAPH.md: the person answers the call the graph is paused on over HTTP, and the
    runtime resumes it anyway: the call is logged again (a copy) for the graph's answer, hers
    stays the first call's, nothing else is copied and nothing stays pending."""
    ada = thread("user-ada")
    thread_id = ada["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(backend.db))
    store = ConversationStore(backend.db)
    await graph.ainvoke(question(1), ada)
    await graph.ainvoke(question(2), ada)  # pauses on call-2
    before = await store.transcript(thread_id, user_id="user-ada")
    await _answer_pending_call(backend.db, "user-ada", thread_id, 0, _HER_ANSWERS["her denial"])
    await graph.ainvoke(Command(resume="yes"), ada)

    transcript = await store.transcript(thread_id, user_id="user-ada")
    assert [m.content for m in transcript[len(before) :]] == [
        None,  # her denial
        None,  # call-2, a copy
        APPROVED,
        f"Answer 2: {APPROVED}",
    ]
    assert await store.pending_calls(thread_id, user_id="user-ada") == []
    _accepted_history((await graph.aget_state(ada)).values["messages"])


_CLOSED_BY_THE_GRAPH = "cancelled: the person moved on"


def _each_call_answered_once(transcript: list[Any]) -> Counter[str]:
    """Every stored call answered by at most one stored result: per call id, as many results
    as calls (each answer goes to the latest earlier call of its id still open). Answers how
    often each call id is made."""
    made = Counter(c.id for m in transcript for c in m.tool_calls or ())
    answered = Counter(m.tool_call_id for m in transcript if m.role == "tool")
    assert all(answered[call_id] <= made[call_id] for call_id in answered)
    return made


@pytest.mark.parametrize(
    ("said", "when"), [("her denial", "before"), ("a late result", "after")], ids=str
)
async def test_the_graph_answering_a_call_the_person_answered_after_it_went_on_copies_the_call(
    backend: Backend, said: str, when: str
) -> None:
    """Paused on call-2, the person asks another question instead; she answers call-2 over
    HTTP (or the runtime a late result) before that question is put or after it. Then the
    graph answers call-2 itself (`update_state` closing the dangling call). The call is
    logged again for the graph's answer, as for a paused call she answered (LANGGRAPH.md):
    each stored call answered once, hers stays the first call's, the graph's pairs with the
    copy; the transcript is the same whenever she answered."""
    ada = thread("user-ada")
    thread_id = ada["configurable"]["thread_id"]
    ours, theirs = approval_agent(AgentStoreSaver(backend.db)), approval_agent(InMemorySaver())
    store = ConversationStore(backend.db)
    closing = {"messages": [ToolMessage(_CLOSED_BY_THE_GRAPH, tool_call_id="call-2", id="c-2")]}
    for graph in (ours, theirs):
        await graph.ainvoke(question(2), ada)  # pauses on call-2
    if when == "before":
        await _answer_pending_call(backend.db, "user-ada", thread_id, 0, _HER_ANSWERS[said])
    for graph in (ours, theirs):
        await graph.ainvoke(question(3), ada)  # she asks something else instead
    if when == "after":
        await _answer_pending_call(backend.db, "user-ada", thread_id, 0, _HER_ANSWERS[said])
    for graph in (ours, theirs):
        await graph.aupdate_state(ada, closing)
        await graph.ainvoke(question(5), ada)

    transcript = await store.transcript(thread_id, user_id="user-ada")
    assert _each_call_answered_once(transcript)["call-2"] == 2
    results = [m.get("content") for m in chat_completions(transcript) if m["role"] == "tool"]
    assert results[-1] == _CLOSED_BY_THE_GRAPH
    assert await store.pending_calls(thread_id, user_id="user-ada") == []
    mine = (await ours.aget_state(ada)).values["messages"]
    assert comparable(mine) == comparable((await theirs.aget_state(ada)).values["messages"])
    assert [m.content for m in transcript[-len(mine) + 1 :]] == [
        m.content or None for m in mine[1:]
    ]
    cold = approval_agent(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(ada)).values["messages"] == mine


@pytest.mark.parametrize("going_on", ["a note", "a question"])
async def test_time_travel_to_a_decided_pause_copies_the_call_the_abandoned_branch_answered(
    backend: Backend, going_on: str
) -> None:
    """LANGGRAPH.md "Time travel": paused on call-2 and resumed "yes", the graph goes back to
    the pause and on with a person's note (`update_state`) or a new question: call-2 is left
    open in the branch, and the abandoned branch's result is no answer of the branch's. The
    call is logged again, pending, whichever way the branch goes on."""
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    ours, theirs = approval_agent(AgentStoreSaver(backend.db)), approval_agent(InMemorySaver())
    store = ConversationStore(backend.db)
    for graph in (ours, theirs):
        await graph.ainvoke(question(2), config)  # pauses on call-2
        await graph.ainvoke(Command(resume="yes"), config)
        paused, *_ = [s.config async for s in graph.aget_state_history(config) if s.interrupts]
        if going_on == "a note":
            note = {"messages": [HumanMessage("note: use Celsius", id="note-1")]}
            await graph.aupdate_state(paused, note)
        else:
            await graph.ainvoke(question(3), paused)

    transcript = await store.transcript(thread_id)
    assert _each_call_answered_once(transcript)["call-2"] == 2
    assert [c.tool_call_id for c in await store.pending_calls(thread_id)] == ["call-2"]
    mine = (await ours.aget_state(config)).values["messages"]
    assert comparable(mine) == comparable((await theirs.aget_state(config)).values["messages"])
    assert [m.content for m in transcript[-len(mine) + 1 :]] == [
        m.content or None for m in mine[1:]
    ]
    cold = approval_agent(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(config)).values["messages"] == mine


async def test_time_travel_in_a_copied_thread_takes_no_stand_in_for_an_answer_from_outside(
    backend: Backend,
) -> None:
    """LANGGRAPH.md "Time travel", on a thread copied with `acopy_thread`: paused on call-2,
    the graph went back to before the model ran with a note, and the saver closed the call it
    left behind with an "interrupted" stand-in. In the copy, back to the pause with another
    note: call-2 is open in the branch, and the stand-in is the saver's, no answer from
    outside the graph; the call is logged again, pending, as on the thread it was copied from."""
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    saver = AgentStoreSaver(backend.db)
    graph, store = approval_agent(saver), ConversationStore(backend.db)
    await graph.ainvoke(question(2), config)  # pauses on call-2
    history = [s async for s in graph.aget_state_history(config)][::-1]
    asked = next(s.config for s in history if len(s.values.get("messages", [])) == 1)
    await graph.aupdate_state(asked, {"messages": [HumanMessage("note 1", id="note-1")]})
    copy_id = f"{thread_id}-copy"
    await saver.acopy_thread(thread_id, copy_id)
    copied = {"configurable": {"thread_id": copy_id}}

    paused, *_ = [s.config async for s in graph.aget_state_history(copied) if s.interrupts]
    await graph.aupdate_state(paused, {"messages": [HumanMessage("note 2", id="note-2")]})

    mine = (await graph.aget_state(copied)).values["messages"]
    assert [getattr(m, "tool_call_id", None) for m in mine] == [None, None, None]
    assert [c.tool_call_id for c in await store.pending_calls(copy_id)] == ["call-2"]
    transcript = await store.transcript(copy_id)
    assert [m.content for m in transcript[-len(mine) + 1 :]] == [
        m.content or None for m in mine[1:]
    ]
    cold = approval_agent(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(copied)).values["messages"] == mine


async def _paused_on_call_2(graph: Any, config: dict[str, Any]) -> AIMessage:
    await graph.ainvoke(question(2), config)  # pauses on call-2
    paused = (await graph.aget_state(config)).values["messages"][-1]
    assert isinstance(paused, AIMessage)
    return paused


async def test_an_edit_of_a_paused_calls_text_leaves_the_call_pending(backend: Backend) -> None:
    """An edit under the same id that keeps the calls as they are (the text redacted) holds
    them: the graph still awaits the call, and so does the conversation; nothing answers it
    before the graph does."""
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(backend.db))
    store = ConversationStore(backend.db)
    paused = await _paused_on_call_2(graph, config)
    redacted = AIMessage("[redacted]", id=paused.id, tool_calls=paused.tool_calls)
    await graph.aupdate_state(config, {"messages": [redacted]})

    assert [c.tool_call_id for c in await store.pending_calls(thread_id)] == ["call-2"]
    assert INTERRUPTED_RESULT not in str(chat_completions(await store.transcript(thread_id)))
    await graph.ainvoke(Command(resume="yes"), config)
    assert await store.pending_calls(thread_id) == []
    replay = chat_completions(await store.transcript(thread_id))
    assert [m["content"] for m in replay if m["role"] == "tool"] == [APPROVED]
    cold = approval_agent(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(config)).values["messages"][1] == redacted


@pytest.mark.parametrize("call_id", ["call-2", "call-2-reviewed"])
async def test_a_paused_call_its_reviewer_edits_is_pending_and_replays_as_it_ran(
    backend: Backend, call_id: str
) -> None:
    """LangGraph's "review the tool call" pattern: the paused call's message written back under
    its id with other arguments (or a new call id). The conversation awaits the edited call,
    and every replay shows the call the graph ran with its result; the call as the model made
    it, which never ran, reads as interrupted."""
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    ours, theirs = approval_agent(AgentStoreSaver(backend.db)), approval_agent(InMemorySaver())
    store = ConversationStore(backend.db)
    call = {"name": "weather", "args": {"city": "Paris"}, "id": call_id}
    for graph in (ours, theirs):
        paused = await _paused_on_call_2(graph, config)
        edit = AIMessage("", id=paused.id, tool_calls=[call])
        await graph.aupdate_state(config, {"messages": [edit]})
        if graph is ours:
            assert [c.tool_call_id for c in await store.pending_calls(thread_id)] == [call_id]
        await graph.ainvoke(Command(resume="yes"), config)
    mine = (await ours.aget_state(config)).values["messages"]
    assert comparable(mine) == comparable((await theirs.aget_state(config)).values["messages"])
    assert mine[-1].content == "Answer 2: Paris: 18 degrees, light wind"
    assert await store.pending_calls(thread_id) == []

    transcript = await store.transcript(thread_id)
    replay = chat_completions(transcript)
    # An export names a call id made again apart (`call-2_2`): each result pairs with its call.
    calls = {c["id"]: c for m in replay for c in m.get("tool_calls") or ()}
    results = [
        (calls[m["tool_call_id"]]["function"]["arguments"], m["content"])
        for m in replay
        if m["role"] == "tool"
    ]
    assert results == [
        ('{"city":"City 2"}', INTERRUPTED_RESULT),
        ('{"city":"Paris"}', "Paris: 18 degrees, light wind"),
    ]
    history = history_from_messages(transcript)
    last_request = [m for m in history if isinstance(m, ModelRequest)][-1]
    assert [(p.tool_call_id, p.content) for p in last_request.parts] == [
        (call_id, "Paris: 18 degrees, light wind")
    ]
    cold = approval_agent(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(config)).values["messages"] == mine


@pytest.mark.parametrize("then", ["resume", "another_edit"])
async def test_a_branch_from_before_a_reviewers_edit_goes_on_as_langgraphs_saver_does(
    backend: Backend, then: str
) -> None:
    """After an edit of the paused call that keeps its id, the checkpoint read before the edit
    is a branch like any other: resumed as the model made the call, or edited otherwise, it
    goes on, each branch's stand-ins a turn of its own."""
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    ours, theirs = approval_agent(AgentStoreSaver(backend.db)), approval_agent(InMemorySaver())
    store = ConversationStore(backend.db)
    for graph in (ours, theirs):
        paused = await _paused_on_call_2(graph, config)
        before = (await graph.aget_state(config)).config
        for city in ("Paris", "Rome")[: 1 if then == "resume" else 2]:
            call = {"name": "weather", "args": {"city": city}, "id": "call-2"}
            edit = AIMessage("", id=paused.id, tool_calls=[call])
            await graph.aupdate_state(before if city == "Rome" else config, {"messages": [edit]})
        await graph.ainvoke(Command(resume="yes"), before if then == "resume" else config)
    mine = (await ours.aget_state(config)).values["messages"]
    assert comparable(mine) == comparable((await theirs.aget_state(config)).values["messages"])
    city = "City 2" if then == "resume" else "Rome"
    assert mine[-1].content.startswith(f"Answer 2: {city}")
    assert await store.pending_calls(thread_id) == []
    cold = approval_agent(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(config)).values["messages"] == mine


async def test_a_call_its_reviewer_drops_is_closed_and_the_call_kept_stays_pending(
    backend: Backend,
) -> None:
    """A reviewer adds a call to the paused message (logged: the graph awaits both), then
    drops it again: the dropped call is answered `interrupted`, the kept one still pending."""
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    ours, theirs = approval_agent(AgentStoreSaver(backend.db)), approval_agent(InMemorySaver())
    store = ConversationStore(backend.db)
    extra = {"name": "weather", "args": {"city": "Oslo"}, "id": "call-extra"}
    for graph in (ours, theirs):
        paused = await _paused_on_call_2(graph, config)
        both_calls = AIMessage("", id=paused.id, tool_calls=[*paused.tool_calls, extra])
        await graph.aupdate_state(config, {"messages": [both_calls]})
        if graph is ours:
            pending = [c.tool_call_id for c in await store.pending_calls(thread_id)]
            assert pending == ["call-2", "call-extra"]
        await graph.aupdate_state(config, {"messages": [paused]})
        if graph is ours:
            assert [c.tool_call_id for c in await store.pending_calls(thread_id)] == ["call-2"]
        await graph.ainvoke(Command(resume="yes"), config)
    mine = (await ours.aget_state(config)).values["messages"]
    assert comparable(mine) == comparable((await theirs.aget_state(config)).values["messages"])
    assert await store.pending_calls(thread_id) == []
    replay = chat_completions(await store.transcript(thread_id))
    # call-2 as first made; then the results of call-2 and call-extra, in call order.
    assert [m["content"] for m in replay if m["role"] == "tool"] == [
        *(INTERRUPTED_RESULT, APPROVED, INTERRUPTED_RESULT)
    ]
    cold = approval_agent(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(config)).values["messages"] == mine


async def test_a_pop_of_a_message_a_paused_graphs_checkpoint_refers_to_is_refused(
    backend: Backend,
) -> None:
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(backend.db))
    store = ConversationStore(backend.db)
    await graph.ainvoke(question(2), config)  # paused on call-2
    before = await store.transcript(thread_id)

    with pytest.raises(Conflict, match=re.escape("belongs to a LangGraph thread")) as refused:
        await store.pop_last_message(thread_id)
    assert "update_state" in str(refused.value)
    assert "delete the thread" in str(refused.value)
    assert await store.transcript(thread_id) == before  # nothing removed
    assert [c.tool_call_id for c in await store.pending_calls(thread_id)] == ["call-2"]

    # The graph goes on as if nothing was asked: resumed, it finishes.
    await graph.ainvoke(Command(resume="yes"), config)
    state = (await approval_agent(AgentStoreSaver(backend.db)).aget_state(config)).values
    assert state["messages"][-1].content == "Answer 2: City 2: 18 degrees, light wind"
    assert await store.pending_calls(thread_id) == []


async def test_a_deleted_threads_late_checkpoint_never_keeps_the_ids_next_owner_from_popping(
    backend: Backend,
) -> None:
    """LANGGRAPH.md: a checkpoint a graph writes after its thread's delete is stored in the
    earlier life and read by no one. Nor does it hold messages of the conversation started
    again under the id: the next owner pops her last message, which that checkpoint's
    messages name by `seq` (was: Conflict "belongs to a LangGraph thread's checkpoints",
    for good, her own deletes leaving that checkpoint in place)."""
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    await approval_agent(AgentStoreSaver(backend.db)).ainvoke(question(2), config)
    late = await backend.db[CHECKPOINTS].find({"thread_id": thread_id}).to_list(None)
    store = ConversationStore(backend.db)
    await store.delete(thread_id)
    await backend.db[CHECKPOINTS].insert_many(late)  # the put, held, lands after the delete
    hers = [{"role": "user", "content": f"mallory {n}"} for n in range(2)]
    await AgentMessageLogger(backend.db).log_messages(thread_id, hers, user_id="user-mallory")
    assert await backend.db[CHECKPOINTS].find_one(checkpoints_referring_to(thread_id, 1))

    popped = await store.pop_last_message(thread_id, user_id="user-mallory")

    assert popped is not None
    assert (popped.seq, popped.content) == (1, "mallory 1")


async def _late_checkpoints(db: Any, config: dict[str, Any], named: str) -> list[dict[str, Any]]:
    """The checkpoints a paused graph's run on the thread wrote, as a put held past the
    thread's delete stores them (`named`): by a release naming the conversation by its creation
    time only, by one naming no conversation, or on a conversation with no epoch (as the
    migration creates one: its graph's checkpoints name none)."""
    thread_id = config["configurable"]["thread_id"]
    if named == "with no epoch":
        await AgentMessageLogger(db).log_messages(thread_id, [{"role": "user", "content": "hi"}])
        await _as_stored_before_epochs(db, thread_id)
    await approval_agent(AgentStoreSaver(db)).ainvoke(question(2), config)
    late = await db[CHECKPOINTS].find({"thread_id": thread_id}).to_list(None)
    dropped = {"earlier release": {"epoch"}, "no one": {"epoch", "conversation_created_ms"}}
    unnamed = dropped.get(named, set())
    return [{k: v for k, v in doc.items() if k not in unnamed} for doc in late]


@pytest.mark.parametrize("named", ["earlier release", "no one", "with no epoch"])
async def test_a_late_checkpoint_naming_no_epoch_never_keeps_the_ids_next_owners_from_popping(
    backend: Backend, named: str
) -> None:
    """LANGGRAPH.md: a conversation created since checkpoints named epochs holds only the
    documents naming its epoch. A checkpoint put after the thread's delete naming no epoch (an
    earlier release still running during an upgrade: the deleted conversation's creation time,
    or nothing; a graph on a conversation with no epoch) is of none of the id's later
    conversations: each next owner pops her message whose `seq` it names (was: `Conflict`
    "belongs to a LangGraph thread's checkpoints", for every later life of the id, her own
    deletes leaving that checkpoint in place)."""
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    late = await _late_checkpoints(backend.db, config, named)
    store = ConversationStore(backend.db)
    await store.delete(thread_id)
    await backend.db[CHECKPOINTS].insert_many(late)  # the put, held, lands after the delete
    last = 0
    while await backend.db[CHECKPOINTS].find_one(checkpoints_referring_to(thread_id, last + 1)):
        last += 1  # the last `seq` the late checkpoint names
    for life in range(2):
        hers = [{"role": "user", "content": f"mallory {life}.{n}"} for n in range(last + 1)]
        await AgentMessageLogger(backend.db).log_messages(thread_id, hers, user_id="user-mallory")
        assert await backend.db[CHECKPOINTS].find_one(checkpoints_referring_to(thread_id, last))

        popped = await store.pop_last_message(thread_id, user_id="user-mallory")

        assert popped is not None
        assert (popped.seq, popped.content) == (last, f"mallory {life}.{last}")
        await store.delete(thread_id, user_id="user-mallory")


@pytest.mark.parametrize("stored", ["before-epochs", "epoch-only-on-the-conversation"])
async def test_a_pop_of_a_message_a_thread_an_earlier_release_stored_refers_to_is_refused(
    backend: Backend, stored: str
) -> None:
    """A conversation created before checkpoints named epochs holds the checkpoints naming its
    creation time (`ThreadLife`): a pop of the message one of them refers to is refused as any
    thread's, whether the conversation has an epoch since or none."""
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    await approval_agent(AgentStoreSaver(backend.db)).ainvoke(question(2), config)
    if stored == "before-epochs":
        await _as_stored_before_epochs(backend.db, thread_id)
    else:
        await backend.db[CONVERSATIONS].update_one(
            {"_id": thread_id}, {"$unset": {"epoch_marks": ""}}
        )
        await backend.db[CHECKPOINTS].update_many(
            {"thread_id": thread_id}, {"$unset": {"epoch": ""}}
        )
    store = ConversationStore(backend.db)
    before = await store.transcript(thread_id)

    with pytest.raises(Conflict, match=re.escape("belongs to a LangGraph thread")):
        await store.pop_last_message(thread_id)
    assert await store.transcript(thread_id) == before


@pytest.mark.parametrize("turn_id", ["lg-1", "lg-run-1", "lg-" + "A" * 32, "lg-" + "0" * 31])
async def test_a_callers_turn_named_like_the_checkpointers_pops_at_once(
    backend: Backend, turn_id: str
) -> None:
    """Only the checkpointer's own turn ids (`lg-` and 32 lowercase hex digits) are waited for
    as a checkpoint's: a caller's turn `lg-1`, no LangGraph involved, pops as any other."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    said = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    await logger.log_messages("conv-lg", said, turn_id=turn_id)

    popped = await store.pop_last_message("conv-lg")
    assert popped is not None
    assert (popped.seq, popped.content) == (1, "a")


async def test_a_pop_of_a_message_the_checkpointer_logged_waits_for_its_checkpoint(
    backend: Backend,
) -> None:
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    await approval_agent(AgentStoreSaver(backend.db)).ainvoke(question(2), config)  # call-2
    # The checkpoint that logged seq 1 not stored yet (its put is between the two writes).
    await backend.db[CHECKPOINTS].delete_many(checkpoints_referring_to(thread_id, 1))
    store = ConversationStore(backend.db)
    before = await store.transcript(thread_id)

    with pytest.raises(StorageUnavailable, match="no checkpoint refers to it yet"):
        await store.pop_last_message(thread_id)
    assert await store.transcript(thread_id) == before

    # Still none past `abandon_after` from when it was logged (a put that never stored it):
    # the message pops as any other.
    late = ConversationStore(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    popped = await late.pop_last_message(thread_id)
    assert popped is not None
    assert popped.seq == 1


async def test_a_pop_of_a_message_another_writer_logged_after_the_checkpoint_still_works(
    backend: Backend,
) -> None:
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(backend.db))
    store = ConversationStore(backend.db)
    await graph.ainvoke(question(1), config)  # answered at once: the graph's last checkpoint
    note = {"role": "user", "content": "a note another writer logged"}
    await AgentMessageLogger(backend.db).log_messages(thread_id, [note])

    popped = await store.pop_last_message(thread_id)
    assert popped is not None
    assert popped.content == "a note another writer logged"
    await graph.ainvoke(question(3), config)  # the thread goes on
    state = (await approval_agent(AgentStoreSaver(backend.db)).aget_state(config)).values
    assert state["messages"][-1].content == "Answer 3: noted"


async def test_a_pop_landing_while_a_turn_is_placed_lets_the_turn_through_at_the_new_end(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer pops its own message right after a graph turn's put read it (the put
    found it logged since its parent): the put is placed where the transcript ends now, and
    the saver, holding on, serves what is stored, also once another process's turn took the
    popped message's `seq`; time travel in that process goes on as it does in a new one."""
    from agent_store.integrations._langgraph_transcript import TranscriptLink

    config = thread("user-ada")
    thread_id = config["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(backend.db))
    store = ConversationStore(backend.db)
    await graph.ainvoke(question(1), config)  # answered at once: seq 0..1
    note = {"role": "user", "content": "a typo, ignore"}
    await AgentMessageLogger(backend.db).log_messages(thread_id, [note], user_id="user-ada")
    loads, popped = TranscriptLink._load, []

    async def then_popped(self: Any, state: Any, *args: Any, **kwargs: Any) -> None:
        await loads(self, state, *args, **kwargs)
        if not popped and kwargs["stop"] is None and 2 in state.by_seq:
            popped.append(await store.pop_last_message(thread_id, user_id="user-ada"))

    monkeypatch.setattr(TranscriptLink, "_load", then_popped)
    await graph.ainvoke(question(3), config)
    monkeypatch.undo()

    assert [m.content for m in popped if m is not None] == ["a typo, ignore"]
    stored = [m.content for m in await store.transcript(thread_id, user_id="user-ada")]
    assert "a typo, ignore" not in stored
    await approval_agent(AgentStoreSaver(backend.db)).ainvoke(question(5), config)
    fresh = approval_agent(AgentStoreSaver(backend.db))
    expected = comparable((await fresh.aget_state(config)).values["messages"])
    assert comparable((await graph.aget_state(config)).values["messages"]) == expected
    history = [state async for state in graph.aget_state_history(config)]
    forked = await graph.aupdate_state(history[-2].config, None)
    await graph.ainvoke(None, forked)
    travelled = comparable((await graph.aget_state(config)).values["messages"])
    assert travelled == comparable((await fresh.aget_state(config)).values["messages"])


@pytest.mark.parametrize("user_id", ["user-ada", None], ids=["user", "service"])
async def test_a_saver_that_read_a_message_popped_since_serves_the_message_stored_there_now(
    backend: Backend, user_id: str | None
) -> None:
    """A process whose time travel read the transcript to its end, another writer's message
    included, then the message popped and its `seq` taken by another process's turn: the
    process serves the state as stored, never the popped message, for a user and a service
    (whose reads check no pops)."""
    config = thread(user_id)
    thread_id = config["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(backend.db))
    store = ConversationStore(backend.db)
    await graph.ainvoke(question(1), config)
    note = {"role": "user", "content": "a typo, ignore"}
    await AgentMessageLogger(backend.db).log_messages(thread_id, [note], user_id=user_id)
    history = [state async for state in graph.aget_state_history(config)]
    await graph.aupdate_state(history[1].config, None)  # reads the transcript to its end
    popped = await store.pop_last_message(thread_id, user_id=user_id)
    assert popped is not None
    assert popped.content == "a typo, ignore"

    await approval_agent(AgentStoreSaver(backend.db)).ainvoke(question(3), config)
    fresh = approval_agent(AgentStoreSaver(backend.db))
    expected = comparable((await fresh.aget_state(config)).values["messages"])
    assert comparable((await graph.aget_state(config)).values["messages"]) == expected
    await graph.ainvoke(question(5), config)
    assert (await graph.aget_state(config)).values == (await fresh.aget_state(config)).values


async def test_a_users_first_read_after_a_services_drops_what_pops_may_have_given_back(
    backend: Backend,
) -> None:
    """One saver serves a service job and the user on her thread: the job's time travel read a
    side note, the note was popped and another process's turn took its `seq`. Her first read
    in this process, which finds pops it cannot count from, serves what is stored there now."""
    user = thread("user-ada")
    thread_id = user["configurable"]["thread_id"]
    service = thread(thread_id=thread_id)
    graph = approval_agent(AgentStoreSaver(backend.db))
    other = approval_agent(AgentStoreSaver(backend.db))  # another process
    await other.ainvoke(question(1), user)
    note = {"role": "user", "content": "a typo, ignore"}
    await AgentMessageLogger(backend.db).log_messages(thread_id, [note], user_id="user-ada")
    history = [state async for state in graph.aget_state_history(service)]
    await graph.aupdate_state(history[1].config, None)  # the job reads the transcript to its end
    popped = await ConversationStore(backend.db).pop_last_message(thread_id, user_id="user-ada")
    assert popped is not None
    await other.ainvoke(question(3), user)
    fresh = approval_agent(AgentStoreSaver(backend.db))
    expected = comparable((await fresh.aget_state(user)).values["messages"])
    assert comparable((await graph.aget_state(user)).values["messages"]) == expected


@pytest.mark.parametrize("warm", [True, False], ids=["same-process", "new-process"])
async def test_a_message_removed_outside_the_checkpointer_makes_a_resume_a_storage_failure(
    backend: Backend, warm: bool
) -> None:
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(backend.db))
    store = ConversationStore(backend.db)
    await graph.ainvoke(question(2), config)  # paused on call-2, seq 1
    # A pop made before pops of a thread's messages were refused: the message is gone and the
    # conversation gives its seq back.
    removed = await backend.db[MESSAGES].delete_one({"conversation_id": thread_id, "seq": 1})
    assert removed.deleted_count == 1
    await backend.db[CONVERSATIONS].update_one({"_id": thread_id}, {"$inc": {"message_count": -1}})

    resumed = graph if warm else approval_agent(AgentStoreSaver(backend.db))
    with pytest.raises(StorageFailure, match=re.escape("message seq 1")) as failed:
        await resumed.ainvoke(Command(resume="yes"), config)
    assert not isinstance(failed.value, StorageUnavailable)
    assert "removed outside the checkpointer" in str(failed.value)
    assert "delete the thread" in str(failed.value)
    with pytest.raises(StorageFailure, match="removed outside the checkpointer"):
        await approval_agent(AgentStoreSaver(backend.db)).aget_state(config)
    assert len(await store.transcript(thread_id)) == 1  # nothing logged meanwhile


async def test_a_fork_put_again_by_a_new_process_refers_to_the_copies_it_logged(
    backend: Backend,
) -> None:
    config = thread()
    graph = approval_agent(AgentStoreSaver(backend.db))
    await graph.ainvoke(question(2), config)
    paused = (await graph.aget_state(config)).config
    await graph.ainvoke(Command(resume="yes"), config)
    fork = await graph.checkpointer.aget_tuple(await graph.aupdate_state(paused, None))
    store = ConversationStore(backend.db)
    transcript = await store.transcript(config["configurable"]["thread_id"])
    assert [m.content for m in transcript][-2:] == [f"Answer 2: {APPROVED}", None]  # the copy

    again = AgentStoreSaver(backend.db)  # the put retried: its reply was lost
    await again.aget_tuple(paused)
    await again.aput(paused, fork.checkpoint, fork.metadata, {})
    assert await store.transcript(config["configurable"]["thread_id"]) == transcript
    assert (await again.aget_tuple(fork.config)).checkpoint == fork.checkpoint


async def test_a_fork_put_retried_after_the_thread_went_on_logs_nothing_again(
    backend: Backend,
) -> None:
    config = thread()
    thread_id = config["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(backend.db))
    await graph.ainvoke(question(2), config)
    paused = (await graph.aget_state(config)).config
    await graph.ainvoke(Command(resume="yes"), config)
    fork = await graph.checkpointer.aget_tuple(await graph.aupdate_state(paused, None))
    await graph.ainvoke(Command(resume="no"), fork.config)  # the thread goes on
    store = ConversationStore(backend.db)
    transcript = await store.transcript(thread_id)
    of_fork = {"thread_id": thread_id, "checkpoint_id": fork.checkpoint["id"]}
    document = await backend.db[CHECKPOINTS].find_one(of_fork)

    late = AgentStoreSaver(backend.db)  # a stuck process retries the fork's put
    await late.aget_tuple(paused)
    await late.aput(paused, fork.checkpoint, fork.metadata, {})
    assert await store.transcript(thread_id) == transcript
    assert await store.pending_calls(thread_id) == []
    assert await backend.db[CHECKPOINTS].find_one(of_fork) == document  # the same copies


# -- two processes at once -------------------------------------------------------------------


class PutOrder:
    """Runs the checkpoint puts of several savers one at a time, in a scripted order of their
    names, once every saver has read the thread's latest checkpoint (they all go on from it).

    With `drawn` (each saver's name once per checkpoint it puts), the checkpoint ids are as if
    drawn in that order: the one drawn last is the thread's latest, whatever order the graphs
    ran in (a saver's n-th checkpoint gets the id of its name's n-th place in `drawn`)."""

    def __init__(self, order: str, savers: dict[str, AgentStoreSaver], drawn: str = "") -> None:
        self.order = list(order)
        self.turn = asyncio.Condition()
        self.read = asyncio.Barrier(len(savers))
        ids = [str(uuid6()) for _ in drawn]
        self.ids = {
            name: [i for n, i in zip(drawn, ids, strict=True) if n == name] for name in savers
        }
        self.renamed: dict[str, str] = {}
        for name, saver in savers.items():
            self._wrap(name, saver)

    def _named(self, config: Any) -> Any:
        configurable = config["configurable"]
        scripted = self.renamed.get(configurable.get("checkpoint_id"))
        return (
            config
            if scripted is None
            else {"configurable": configurable | {"checkpoint_id": scripted}}
        )

    def _wrap(self, name: str, saver: AgentStoreSaver) -> None:
        read, put, writes, first = saver.aget_tuple, saver.aput, saver.aput_writes, [True]

        async def reading(config: Any) -> Any:
            found = await read(config)
            if first.pop() if first else False:
                await self.read.wait()
            return found

        async def putting(config: Any, checkpoint: Any, *args: Any) -> Any:
            if self.ids[name]:
                self.renamed[checkpoint["id"]] = self.ids[name].pop(0)
                checkpoint = checkpoint | {"id": self.renamed[checkpoint["id"]]}
            async with self.turn:
                await self.turn.wait_for(lambda: not self.order or self.order[0] == name)
            try:
                return await put(self._named(config), checkpoint, *args)
            finally:
                async with self.turn:
                    if self.order:
                        self.order.pop(0)
                    self.turn.notify_all()

        async def writing(config: Any, *args: Any) -> None:
            await writes(self._named(config), *args)

        saver.aget_tuple = reading  # type: ignore[method-assign]
        saver.aput = putting  # type: ignore[method-assign]
        saver.aput_writes = writing  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "order",
    [
        pytest.param("yynn", id="one-run-then-the-other"),
        pytest.param("ynyn", id="alternating"),
        pytest.param("nyyn", id="the-second-logs-first"),
        pytest.param("ynny", id="the-first-ends-last"),
    ],
)
async def test_two_processes_resuming_one_pause_at_once_leave_the_transcript_the_state_reads(
    backend: Backend, order: str
) -> None:
    config = thread()
    await approval_agent(AgentStoreSaver(backend.db)).ainvoke(question(2), config)  # call-2
    savers = {"y": AgentStoreSaver(backend.db), "n": AgentStoreSaver(backend.db)}
    PutOrder(order, savers)
    await asyncio.gather(
        approval_agent(savers["y"]).ainvoke(Command(resume="yes"), config),
        approval_agent(savers["n"]).ainvoke(Command(resume="no"), config),
    )

    await _assert_the_transcript_ends_as_the_state(backend, config)


@pytest.mark.parametrize(
    ("order", "drawn"),
    [
        pytest.param("yyzznn", "yynnzz", id="the-latest-yes-replays-the-first-before-the-no"),
        pytest.param("yzyznn", "yynnzz", id="the-yeses-alternate-before-the-no"),
        pytest.param("nnyyzz", "nnyyzz", id="the-latest-yes-says-again-what-the-first-said"),
        pytest.param("yyznzn", "ynzynz", id="the-no-logs-between-the-yeses"),
    ],
)
async def test_three_processes_resuming_one_pause_two_alike_leave_the_transcript_the_state_reads(
    backend: Backend, order: str, drawn: str
) -> None:
    """Two resumes say the same ("yes"): their turns are one turn of the transcript (named by
    the parent and the content), which the latest of the three still ends with."""
    config = thread()
    await approval_agent(AgentStoreSaver(backend.db)).ainvoke(question(2), config)  # call-2
    savers = {name: AgentStoreSaver(backend.db) for name in "ynz"}
    PutOrder(order, savers, drawn)
    await asyncio.gather(
        approval_agent(savers["y"]).ainvoke(Command(resume="yes"), config),
        approval_agent(savers["n"]).ainvoke(Command(resume="no"), config),
        approval_agent(savers["z"]).ainvoke(Command(resume="yes"), config),
    )
    said = await _assert_the_transcript_ends_as_the_state(backend, config)
    assert said[-1].content == "Answer 2: City 2: 18 degrees, light wind"  # z's, drawn last


async def _assert_the_transcript_ends_as_the_state(
    backend: Backend, config: dict[str, Any]
) -> list[Any]:
    thread_id = config["configurable"]["thread_id"]
    state = (await approval_agent(AgentStoreSaver(backend.db)).aget_state(config)).values
    said: list[Any] = state["messages"]
    store = ConversationStore(backend.db)
    transcript = await store.transcript(thread_id)
    # The transcript ends as the graph's state: the call, its one answer, the model's answer.
    assert [m.content for m in transcript[-3:]] == [m.content or None for m in said[-3:]]
    assert await store.pending_calls(thread_id) == []
    replay = chat_completions(transcript)
    assert [m.get("content") for m in replay[-2:]] == [said[-2].content, said[-1].content]
    assert len({m["tool_call_id"] for m in replay if m["role"] == "tool"}) == len(
        [m for m in replay if m["role"] == "tool"]
    )
    history = history_from_messages(transcript)
    last_request = [m for m in history if isinstance(m, ModelRequest)][-1]
    assert [p.content for p in last_request.parts if isinstance(p, ToolReturnPart)] == [
        said[-2].content
    ]
    return said


async def _latest_document(db: Any, config: dict[str, Any]) -> dict[str, Any]:
    docs = (
        await db[CHECKPOINTS]
        .find({"thread_id": config["configurable"]["thread_id"], "checkpoint_ns": ""})
        .sort("checkpoint_id", -1)
        .limit(1)
        .to_list(None)
    )
    return dict(docs[0])


# -- what a turn costs -----------------------------------------------------------------------


async def test_a_turn_writes_the_same_checkpoint_bytes_at_turn_3_and_at_turn_21() -> None:
    from bson import encode

    from tests.api_harness import mongomock_db

    db, config = mongomock_db(), thread()
    graph = tool_agent(AgentStoreSaver(db))
    sizes: dict[int, int] = {}
    seen: set[Any] = set()
    for turn in range(1, 22):
        await run_turns(graph, config, range(turn, turn + 1))
        docs = await db[CHECKPOINTS].find({}).to_list(None)
        sizes[turn] = sum(len(encode(d)) for d in docs if d["_id"] not in seen)
        seen |= {d["_id"] for d in docs}
    # Odd turns have the same shape (question, answer); the conversation grew sevenfold.
    assert sizes[21] <= sizes[3] * 1.05


async def test_a_turn_costs_the_same_round_trips_however_long_the_thread(
    wire_backend: Backend,
) -> None:
    assert wire_backend.commands is not None
    config = thread()
    logger = AgentMessageLogger(wire_backend.db, rules=COUNTED)
    graph = tool_agent(AgentStoreSaver(wire_backend.db, logger=logger))
    counts: dict[int, Counter[str]] = {}
    for turn in range(1, 9):
        wire_backend.commands.clear()
        await run_turns(graph, config, range(turn, turn + 1))
        counts[turn] = Counter(wire_backend.commands.names)
    # Background writes interleave, so commands are compared as counts, not as a sequence.
    assert counts[8] == counts[4]
    assert counts[7] == counts[3]
    # Reading the thread (1), the input checkpoint and its writes (2), then per step that adds
    # messages the logger's reservation and insert and the checkpoint (3), per task's writes (1);
    # a service's read looks the conversation up first (its current life: `_served`).
    read = 1 + 1
    assert counts[7].total() == read + 2 + 3 + 1 + 3  # a question answered at once
    assert counts[8].total() == read + 2 + 3 + (1 + 3) * 3  # agent, tool, agent


async def test_a_users_write_into_a_checkpoint_naming_no_user_costs_two_round_trips_more(
    wire_backend: Backend,
) -> None:
    """The owner is checked again before a user's graph writes into a document that names no
    user (a service's, or one stored before documents named their owner): the refused
    upsert, the conversation, the write; the document then names the user."""
    assert wire_backend.commands is not None
    ada = thread("user-ada")
    saver = AgentStoreSaver(wire_backend.db)
    saved = await saver.aput(ada, empty_checkpoint(), {"source": "input", "step": 0}, {})
    await wire_backend.db[CHECKPOINTS].update_many({}, {"$unset": {"user_id": ""}})
    mine = {"configurable": saved["configurable"] | {"user_id": "user-ada"}}
    wire_backend.commands.clear()
    await saver.aput_writes(mine, [("note", "Ada's")], "task-1")
    assert wire_backend.commands.names == ["update", "findAndModify", "update"]
    wire_backend.commands.clear()
    await saver.aput_writes(mine, [("note", "Ada's again")], "task-2")
    assert wire_backend.commands.names == ["update"]  # the document names her now


# -- each message once -----------------------------------------------------------------------


async def test_a_put_retried_after_a_lost_reply_stores_each_message_once(
    backend: Backend,
) -> None:
    config = thread()
    saver = AgentStoreSaver(backend.db)
    await run_turns(tool_agent(saver), config, range(1, 2))
    latest = await saver.aget_tuple(config)
    assert latest is not None
    checkpoint = copy_checkpoint(latest.checkpoint)
    checkpoint["id"] = str(uuid6())
    checkpoint["channel_values"]["messages"] = [
        *checkpoint["channel_values"]["messages"],
        HumanMessage("And tomorrow?", id="human-2"),
        AIMessage("Rain.", id="ai-2"),
    ]
    logged = saver.logger.log_messages
    replies: list[bool] = []

    async def reply_lost(*args: Any, **kwargs: Any) -> Any:
        turn = await logged(*args, **kwargs)
        replies.append(turn.replayed)
        if len(replies) == 1:
            raise StorageUnavailable("the reply was lost")
        return turn

    saver.logger.log_messages = reply_lost  # type: ignore[method-assign]
    with pytest.raises(StorageUnavailable):
        await saver.aput(latest.config, checkpoint, latest.metadata, {})
    await saver.aput(latest.config, checkpoint, latest.metadata, {})
    assert replies == [False, True]
    transcript = await ConversationStore(backend.db).transcript(config["configurable"]["thread_id"])
    assert [m.content for m in transcript] == [
        "Question 1: how is the weather?",
        "Answer 1: noted",
        "And tomorrow?",
        "Rain.",
    ]
    cold = await AgentStoreSaver(backend.db).aget_tuple(config)
    assert cold is not None
    assert cold.checkpoint["channel_values"]["messages"] == checkpoint["channel_values"]["messages"]


async def test_hidden_runtime_context_stays_out_of_the_conversation_but_in_the_state(
    backend: Backend,
) -> None:
    config = thread()
    graph = tool_agent(AgentStoreSaver(backend.db))
    said = "[RUNTIME CONTEXT]account 4411, tier gold[/RUNTIME CONTEXT] Question 1: how is it?"
    await graph.ainvoke({"messages": [HumanMessage(said, id="human-1")]}, config)
    transcript = await ConversationStore(backend.db).transcript(config["configurable"]["thread_id"])
    assert transcript[0].content == "Question 1: how is it?"
    cold = (await tool_agent(AgentStoreSaver(backend.db)).aget_state(config)).values["messages"]
    assert cold[0].content == said


# -- owners ----------------------------------------------------------------------------------


async def _counts(db: Any) -> tuple[int, ...]:
    return tuple(
        [await db[name].count_documents({}) for name in (CHECKPOINTS, MESSAGES, CONVERSATIONS)]
    )


async def test_a_users_thread_is_that_users_conversation_and_no_one_elses(
    backend: Backend,
) -> None:
    ada = thread("user-ada")
    thread_id = ada["configurable"]["thread_id"]
    grace = thread("user-grace", thread_id)
    graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(graph, ada, range(1, 3))
    store = ConversationStore(backend.db)
    assert (await store.get_conversation(thread_id)).user_id == "user-ada"
    assert {m.user_id for m in await store.transcript(thread_id)} == {"user-ada"}

    before = await _counts(backend.db)
    for saver in (AgentStoreSaver(backend.db), graph.checkpointer):
        other = tool_agent(saver)
        assert (await other.aget_state(grace)).values == {}
        assert [s async for s in other.aget_state_history(grace)] == []
        with pytest.raises(NotFound, match=re.escape(f"conversation {thread_id!r} was not found")):
            await other.ainvoke(question(3), grace)
    assert await _counts(backend.db) == before
    # A service (no user in the config) reads it.
    service = thread(thread_id=thread_id)
    assert len((await graph.aget_state(service)).values["messages"]) == 6


async def test_a_user_never_adopts_a_thread_a_service_started(backend: Backend) -> None:
    service = thread()
    graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(graph, service, range(1, 2))
    ada = thread("user-ada", service["configurable"]["thread_id"])
    assert (await graph.aget_state(ada)).values == {}
    with pytest.raises(NotFound):
        await graph.ainvoke(question(2), ada)
    conversation = await ConversationStore(backend.db).get_conversation(
        service["configurable"]["thread_id"]
    )
    assert conversation.user_id is None


@pytest.mark.parametrize("state", ["live", "deleting", "forking", "migrating", "unowned", "legacy"])
async def test_another_users_thread_in_any_state_is_the_same_not_found_to_a_users_graph(
    backend: Backend, state: str
) -> None:
    """A graph run for Ada on an id Mallory holds, in whatever state, or a service holds, is
    told what Ada's token is told over HTTP: NotFound, the same words, nothing written."""
    legacy = LegacyTurns(backend.db)
    logger = AgentMessageLogger(backend.db, legacy=legacy)
    if state == "legacy":
        await backend.db[LEGACY_TURNS].insert_one(
            {"_id": "lt-1", "conversation_id": "conv-x", "user_id": "user-mallory",
             "user_message": "w", "response_parts": [{"type": "text", "content": "ok"}],
             "created_at": datetime.now(UTC)}
        )  # fmt: skip
    else:
        owner = None if state == "unowned" else "user-mallory"
        await logger.log_messages("conv-x", [{"role": "user", "content": "hers"}], user_id=owner)
        field = {"deleting": "deleting_since", "forking": "fork_check", "migrating": "migrating"}
        if state in field:
            mark = datetime.now(UTC) if state == "deleting" else {"since": datetime.now(UTC)}
            await backend.db[CONVERSATIONS].update_one(
                {"_id": "conv-x"}, {"$set": {field[state]: mark}}
            )
    saver = AgentStoreSaver(
        backend.db, logger=logger, store=ConversationStore(backend.db, legacy=legacy)
    )
    before = await _counts(backend.db)

    with pytest.raises(NotFound) as refused:
        await tool_agent(saver).ainvoke(question(1), thread("user-ada", "conv-x"))

    assert str(refused.value) == "conversation 'conv-x' was not found"
    assert await _counts(backend.db) == before


async def test_erasing_a_user_leaves_none_of_their_langgraph_state_for_the_next_holder_of_the_id(
    backend: Backend,
) -> None:
    """docs/API.md: an erased user's ids "then exist nowhere", checkpoints included; the next
    user to take the id (one HTTP turn) reads nothing of the erased user's graph."""
    thread_id = "conv-erased"
    ada = thread("user-ada", thread_id)
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = {"profile": "ADA LOVELACE, card 4242"}
    saved = await AgentStoreSaver(backend.db).aput(
        ada, checkpoint, {"source": "input", "step": 0}, {}
    )
    await AgentStoreSaver(backend.db).aput_writes(saved, [("profile", "pending")], "task-1")

    async with serve(backend.db, seeded=False) as api:
        erased = await api.http.delete("/v1/users/user-ada", headers=auth_headers(user="user-ada"))
        assert erased.status_code == 200, erased.text
        assert await backend.db[CHECKPOINTS].count_documents({}) == 0
        taken = await api.http.post(
            f"/v1/conversations/{thread_id}/turns",
            json={"turn_id": "t-1", "messages": [{"role": "user", "content": "mine now"}]},
            headers=auth_headers(user="user-mallory"),
        )
        assert taken.status_code == 201, taken.text

    mallory = thread("user-mallory", thread_id)
    assert await AgentStoreSaver(backend.db).aget_tuple(mallory) is None
    assert await AgentStoreSaver(backend.db).aget_tuple(thread(thread_id=thread_id)) is None


async def test_a_graph_of_an_erased_user_cannot_write_into_the_thread_another_user_now_owns(
    backend: Backend,
) -> None:
    """LANGGRAPH.md "Owners": a graph writes only its user's threads, also a long-running one
    that wrote the thread while it was its user's. Every checkpoint document names the user
    it was written for, and no other user reads it; a checkpoint that follows none (a new
    run of the graph) and every write after a read finds the thread is not its own."""
    thread_id = "conv-reused"
    ada = thread("user-ada", thread_id)
    adas_graph = AgentStoreSaver(backend.db)
    saved = await adas_graph.aput(ada, empty_checkpoint(), {"source": "input", "step": 0}, {})
    first = {"configurable": saved["configurable"] | {"user_id": "user-ada"}}
    await ConversationStore(backend.db).erase_user("user-ada")
    mallory = thread("user-mallory", thread_id)
    await tool_agent(AgentStoreSaver(backend.db)).ainvoke(question(1), mallory)
    mallorys = await AgentStoreSaver(backend.db).aget_tuple(mallory)
    assert mallorys is not None

    later = empty_checkpoint()
    later["channel_values"] = {"note": "written by Ada's graph"}
    await adas_graph.aput(first, later, {"source": "loop", "step": 1}, {})
    await adas_graph.aput_writes(first, [("note", "Ada's")], "task-1")
    assert await AgentStoreSaver(backend.db).aget_tuple(mallory) == mallorys
    assert [t.checkpoint["id"] async for t in AgentStoreSaver(backend.db).alist(mallory)] == [
        t.checkpoint["id"]
        async for t in AgentStoreSaver(backend.db).alist(mallory)
        if t.checkpoint["id"] != later["id"]
    ]
    before = await _counts(backend.db)
    with pytest.raises(NotFound, match="was not found"):
        await adas_graph.aput(ada, empty_checkpoint(), {"source": "input", "step": 2}, {})
    with pytest.raises(NotFound, match="was not found"):
        await adas_graph.aput(first, later, {"source": "loop", "step": 1}, {})
    with pytest.raises(NotFound, match="was not found"):
        await adas_graph.aput_writes(first, [("note", "Ada's")], "task-1")
    assert await _counts(backend.db) == before
    assert await AgentStoreSaver(backend.db).aget_tuple(mallory) == mallorys


async def test_every_config_the_saver_hands_back_names_the_user_it_was_read_or_written_for(
    backend: Backend,
) -> None:
    """LangGraph's time travel goes on from the configs the saver hands back (a state's, its
    parent's, the one `update_state` answers): each names the user, so going on from one is
    that user's write, stored in that user's name; a service's name none."""
    ada = thread("user-ada")
    thread_id = ada["configurable"]["thread_id"]
    graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(graph, ada, range(1, 3))
    history = [state async for state in graph.aget_state_history(ada)]
    forked = await graph.aupdate_state(history[2].config, _said("a new branch"))
    states = [await graph.aget_state(ada), *history]
    configs = [forked, *(s.config for s in states), *(s.parent_config for s in states[:-1])]
    assert all(c is not None and c["configurable"].get("user_id") == "user-ada" for c in configs)
    stored = await backend.db[CHECKPOINTS].find_one(
        {"checkpoint_id": forked["configurable"]["checkpoint_id"]}
    )
    assert stored is not None
    assert stored["user_id"] == "user-ada"

    service = thread(thread_id=thread_id)
    served = [
        await graph.aget_state(service),
        *[s async for s in graph.aget_state_history(service)],
    ]
    assert all("user_id" not in s.config["configurable"] for s in served)


async def test_time_travel_of_a_deleted_conversations_graph_never_writes_into_the_ids_next_owner(
    backend: Backend,
) -> None:
    """A process still holding a state of Ada's thread after her conversation was deleted and
    the id taken by Grace: going back to that state (`update_state`, then a run) is Ada's
    write, refused, as is a run from it; Grace's transcript and state are as she left them."""
    thread_id = "conv-time-travel"
    ada = thread("user-ada", thread_id)
    adas_graph = tool_agent(AgentStoreSaver(backend.db))
    await adas_graph.ainvoke(_said("ADA SECRET"), ada)
    kept = [state async for state in adas_graph.aget_state_history(ada)][-2].config
    store = ConversationStore(backend.db)
    await store.delete(thread_id, user_id="user-ada")
    grace = thread("user-grace", thread_id)
    await tool_agent(AgentStoreSaver(backend.db)).ainvoke(_said("grace's own words"), grace)
    graces = (await adas_graph.aget_state(grace)).values
    transcript = await store.transcript(thread_id, user_id="user-grace")

    with pytest.raises(NotFound, match="was not found"):
        await adas_graph.aupdate_state(kept, _said("written by Ada's process"))
    with pytest.raises(NotFound, match="was not found"):
        await adas_graph.ainvoke(_said("a run from Ada's process"), kept)
    assert (await adas_graph.aget_state(grace)).values == graces
    assert await store.transcript(thread_id, user_id="user-grace") == transcript


# -- a running graph's writes after its thread was deleted are read by no one ----------------


class _Plan(TypedDict):
    plan: str


async def test_a_graph_still_running_after_its_thread_was_deleted_never_steers_the_ids_next_graph(
    backend: Backend,
) -> None:
    """Ada's graph is between two steps (a slow tool) when her thread is deleted and a
    service's graph starts on its id in another process: her graph writes on into the life
    it was admitted to, which no reader of the id's next life reads, so the service's graph
    resumes from its own state and its history holds none of hers."""
    thread_id = f"thread-{uuid.uuid4().hex[:12]}"
    store = ConversationStore(backend.db)

    async def slow_tool(state: _Plan) -> dict[str, str]:
        await store.delete(thread_id, user_id="user-ada")
        await asyncio.sleep(0.002)  # the id is taken again, a millisecond later at least
        services = StateGraph(_Plan)
        services.add_node("n", lambda s: {"plan": "service: pay supplier A"})
        services.add_edge(START, "n")
        services.add_edge("n", END)
        graph = services.compile(checkpointer=AgentStoreSaver(backend.db))
        await graph.ainvoke({"plan": "start"}, thread(None, thread_id))
        return {"plan": "ada: pay ada 10k"}

    builder = StateGraph(_Plan)
    builder.add_node("start", lambda s: {"plan": "ada's start"})
    builder.add_node("tool", slow_tool)
    builder.add_node("after", lambda s: {"plan": s["plan"] + " (confirmed)"})
    builder.add_edge(START, "start")
    builder.add_edge("start", "tool")
    builder.add_edge("tool", "after")
    builder.add_edge("after", END)
    adas_graph = builder.compile(checkpointer=AgentStoreSaver(backend.db))
    # each checkpoint stored before the next step runs
    await adas_graph.ainvoke({"plan": "x"}, thread("user-ada", thread_id), durability="sync")

    services_saver = AgentStoreSaver(backend.db)
    resumed = await services_saver.aget_tuple(thread(None, thread_id))
    assert resumed is not None
    assert resumed.checkpoint["channel_values"]["plan"] == "service: pay supplier A"
    history = [t async for t in services_saver.alist(thread(None, thread_id))]
    assert not [t for t in history if "ada" in str(t.checkpoint["channel_values"])]


async def test_a_users_next_checkpoint_after_her_thread_went_to_a_service_is_read_by_no_one(
    backend: Backend,
) -> None:
    """A saver admitted Ada on her thread; it is deleted and a service's graph (another
    process) checkpoints the id: her next checkpoint (no new message) lands in her earlier
    life, and the service reads its own latest checkpoint and none of hers."""
    ada, service = thread("user-ada"), {"configurable": {"checkpoint_ns": ""}}
    thread_id = ada["configurable"]["thread_id"]
    service["configurable"]["thread_id"] = thread_id
    saver = AgentStoreSaver(backend.db)
    first = empty_checkpoint()
    first["channel_values"] = {"messages": [], "plan": "ada's"}
    saved = await saver.aput(ada, first, {"source": "input", "step": -1}, {})
    await ConversationStore(backend.db).delete(thread_id, user_id="user-ada")
    services = empty_checkpoint()
    services["channel_values"] = {"messages": [], "plan": "service's: pay supplier A"}
    await AgentStoreSaver(backend.db).aput(service, services, {"source": "input", "step": -1}, {})

    following = copy_checkpoint(first)
    following["id"] = str(uuid6())
    following["channel_values"] = {"messages": [], "plan": "ada's: pay ada"}
    await saver.aput(saved, following, {"source": "loop", "step": 0}, {})
    latest = await AgentStoreSaver(backend.db).aget_tuple(service)
    assert latest is not None
    assert latest.checkpoint["channel_values"]["plan"] == "service's: pay supplier A"
    history = [t async for t in AgentStoreSaver(backend.db).alist(service)]
    assert [t.checkpoint["channel_values"]["plan"] for t in history] == [
        "service's: pay supplier A"
    ]


async def test_a_copy_of_a_thread_copies_none_of_a_checkpoint_its_earlier_life_left(
    backend: Backend,
) -> None:
    """A write racing the thread's delete (checked just before it, stored just after) lands in
    the earlier life, read by no one; a copy of the thread the id's next graph makes copies
    only its own life's checkpoints, so the copy never serves that state as its own."""
    ada, service = thread("user-ada"), {"configurable": {"checkpoint_ns": ""}}
    thread_id = ada["configurable"]["thread_id"]
    service["configurable"]["thread_id"] = thread_id
    first = empty_checkpoint()
    first["channel_values"] = {"messages": [], "plan": "ada: pay ada 10k"}
    await AgentStoreSaver(backend.db).aput(ada, first, {"source": "input", "step": -1}, {})
    raced = await backend.db[CHECKPOINTS].find({"thread_id": thread_id}).to_list(None)
    await ConversationStore(backend.db).delete(thread_id, user_id="user-ada")
    await asyncio.sleep(0.002)  # the id is taken again, a millisecond later at least
    services = empty_checkpoint()
    services["channel_values"] = {"messages": [], "plan": "service: pay supplier A"}
    saver = AgentStoreSaver(backend.db)
    await saver.aput(service, services, {"source": "input", "step": -1}, {})
    await backend.db[CHECKPOINTS].insert_many(raced)  # Ada's write, landed after the delete

    copy_id = f"{thread_id}-copy"
    await saver.acopy_thread(thread_id, copy_id)
    copied = [t async for t in saver.alist({"configurable": {"thread_id": copy_id}})]
    plans = [t.checkpoint["channel_values"].get("plan") for t in copied]
    assert plans == ["service: pay supplier A"]


async def _late_put_then_taken_at_the_same_millisecond(
    db: Any, writer: str | None, *, earlier_release: bool = False
) -> str:
    """Ada's thread, created by her turn at a fixed time; a checkpoint of it (written by
    `writer`'s graph: a service's, None, or Ada's; by an `earlier_release`, naming only the
    thread's creation time) lands after Ada deleted the thread (the late put); then Mallory's
    turn starts the id again, its first message's `created_at` (hers to choose) the very
    millisecond Ada's thread was created at. The thread's id."""
    thread_id = f"thread-{uuid.uuid4().hex[:12]}"
    at = datetime(2026, 3, 1, 12, 0, 0, 123000, tzinfo=UTC)
    said = [{"role": "user", "content": "ada opens the thread", "created_at": at}]
    await AgentMessageLogger(db).log_messages(thread_id, said, user_id="user-ada")
    private = empty_checkpoint()
    private["channel_values"] = {"messages": [], "plan": "ADA PRIVATE: iban FR76"}
    await AgentStoreSaver(db).aput(thread(writer, thread_id), private, {"step": -1}, {})
    late = await db[CHECKPOINTS].find({"thread_id": thread_id}).to_list(None)
    await ConversationStore(db).delete(thread_id, user_id="user-ada")
    if earlier_release:
        late = [{k: v for k, v in doc.items() if k != "epoch"} for doc in late]
    await db[CHECKPOINTS].insert_many(late)  # the put, held, lands after the delete
    hers = [{"role": "user", "content": f"mallory {i}", "created_at": at} for i in range(3)]
    await AgentMessageLogger(db).log_messages(
        thread_id, hers, user_id="user-mallory", owner_only=True
    )
    return thread_id


@pytest.mark.parametrize(
    ("writer", "earlier_release"),
    [(None, False), ("user-ada", False), (None, True)],
    ids=["service-graph", "adas-graph", "an-earlier-releases-service-graph"],
)
async def test_whoever_takes_a_deleted_thread_id_at_the_same_millisecond_never_reads_its_state(
    backend: Backend, writer: str | None, earlier_release: bool
) -> None:
    """LANGGRAPH.md: an id deleted and taken again is another conversation, and whoever takes
    the id next never reads what a graph still running wrote after the delete. Told by the
    conversation's `epoch`, drawn at random as it is created, not by its `created_at`, which
    the caller starting it chooses: Mallory's graph and a service's graph on her thread read
    none of Ada's state, nor does a copy of it. A checkpoint naming no epoch (an earlier
    release's) is never of a conversation created since."""
    thread_id = await _late_put_then_taken_at_the_same_millisecond(
        backend.db, writer, earlier_release=earlier_release
    )
    saver = AgentStoreSaver(backend.db)
    for reader in ("user-mallory", None):
        found = await saver.aget_tuple(thread(reader, thread_id))
        assert "ADA" not in str(found and found.checkpoint["channel_values"])
        listed = [t async for t in saver.alist(thread(reader, thread_id))]
        assert not [t for t in listed if "ADA" in str(t.checkpoint["channel_values"])]
    across = [t async for t in saver.alist(None)]
    assert not [t for t in across if "ADA" in str(t.checkpoint["channel_values"])]
    await saver.acopy_thread(thread_id, f"{thread_id}-copy")
    copied = [t async for t in saver.alist(thread(None, f"{thread_id}-copy"))]
    assert not [t for t in copied if "ADA" in str(t.checkpoint["channel_values"])]


async def test_mallorys_graph_writes_her_own_state_on_a_thread_id_taken_at_the_same_millisecond(
    backend: Backend,
) -> None:
    """Mallory's graph goes on from her own (empty) state on the id Ada's deleted thread held,
    whatever the late checkpoint of Ada's thread left there; deleting her thread deletes her
    checkpoints."""
    thread_id = await _late_put_then_taken_at_the_same_millisecond(backend.db, None)
    mallory = thread("user-mallory", thread_id)
    saver = AgentStoreSaver(backend.db)
    mine = empty_checkpoint()
    mine["channel_values"] = {"messages": [], "plan": "mallory's"}
    await saver.aput(mallory, mine, {"step": -1}, {})
    found = await AgentStoreSaver(backend.db).aget_tuple(mallory)
    assert found is not None
    assert found.checkpoint["channel_values"]["plan"] == "mallory's"
    await ConversationStore(backend.db).delete(thread_id, user_id="user-mallory")
    left = await backend.db[CHECKPOINTS].find({"thread_id": thread_id}).to_list(None)
    assert [doc["checkpoint_id"] for doc in left] == [
        doc["checkpoint_id"] for doc in left if "mallory" not in str(doc)
    ]


async def _checkpointed(saver: Any, config: dict[str, Any], plan: str, parent: Any = None) -> Any:
    """A checkpoint holding `plan` (no message), put as the first of the thread or after
    `parent` (a config a put handed back)."""
    checkpoint = empty_checkpoint()
    checkpoint["id"] = str(uuid6())
    checkpoint["channel_values"] = {"messages": [], "plan": plan}
    metadata: Any = {"source": "loop", "step": 0}
    return await saver.aput(parent or config, checkpoint, metadata, {})


async def _three_threads_one_recreated_one_deleted(db: Any) -> list[str]:
    """Thread a (two checkpoints); thread b deleted and started again, a graph admitted to its
    earlier life writing after that; thread c deleted, its graph writing after the delete. The
    stale writes are the newest checkpoints of all."""
    a, b, c = (f"thread-{name}-{uuid.uuid4().hex[:8]}" for name in "abc")
    earlier = AgentStoreSaver(db)  # the process whose graphs run on through the deletes
    first_a = await _checkpointed(AgentStoreSaver(db), thread(None, a), "a: first")
    first_b = await _checkpointed(earlier, thread(None, b), "b: earlier life")
    first_c = await _checkpointed(earlier, thread(None, c), "c: deleted")
    store = ConversationStore(db)
    await store.delete(b)
    await store.delete(c)
    await asyncio.sleep(0.002)  # the id is taken again, a millisecond later at least
    await _checkpointed(AgentStoreSaver(db), thread(None, b), "b: current life")
    await _checkpointed(AgentStoreSaver(db), thread(None, a), "a: second", first_a)
    await _checkpointed(earlier, thread(None, b), "b: earlier life, after the delete", first_b)
    await _checkpointed(earlier, thread(None, c), "c: after the delete", first_c)
    return [a, b, c]


def _plans(listed: list[Any]) -> list[str]:
    return [t.checkpoint["channel_values"]["plan"] for t in listed]


async def test_a_list_across_threads_serves_each_thread_what_a_list_of_that_thread_serves(
    backend: Backend,
) -> None:
    """A service's list across all threads serves, of each thread, only the documents of the
    conversation the thread is now (or naming none): never a checkpoint a graph wrote into an
    earlier life of an id deleted and started again, nor into a thread deleted since. It is
    the union of the per-thread lists, newest first, and `limit` counts what it serves."""
    threads = await _three_threads_one_recreated_one_deleted(backend.db)
    saver = AgentStoreSaver(backend.db)
    per_thread = [t for i in threads async for t in saver.alist(thread(None, i))]
    union = sorted(per_thread, key=lambda t: t.config["configurable"]["checkpoint_id"])[::-1]

    for across in (None, {"configurable": {}}):
        listed = [t async for t in AgentStoreSaver(backend.db).alist(across)]
        assert _plans(listed) == _plans(union) == ["a: second", "b: current life", "a: first"]
        assert [t.config for t in listed] == [t.config for t in union]
    for limit in (1, 2):
        newest = [t async for t in AgentStoreSaver(backend.db).alist(None, limit=limit)]
        assert _plans(newest) == _plans(union)[:limit]


async def test_a_list_across_threads_costs_two_round_trips_a_page(
    wire_backend: Backend,
) -> None:
    """The checkpoints, then the conversations of the threads among them (one query): two
    round trips, whatever the number of threads; a page that stale documents left short is
    read on from where it ended, twice as long each time."""
    assert wire_backend.commands is not None
    await _three_threads_one_recreated_one_deleted(wire_backend.db)
    saver = AgentStoreSaver(wire_backend.db)
    wire_backend.commands.clear()
    assert len([t async for t in saver.alist(None)]) == 3
    assert wire_backend.commands.names == ["find", "find"]
    wire_backend.commands.clear()
    assert len([t async for t in saver.alist(None, limit=1)]) == 1
    # the two newest are stale: a page of 1 (c's, stale), then of 2 (b's stale one, then a's
    # newest, served), each with the conversations of the threads first seen on it
    assert wire_backend.commands.names == ["find", "find", "find", "find"]


@pytest.mark.parametrize("user_id", [None, "user-ada"])
async def test_a_thread_the_migration_is_writing_again_is_refused_to_its_reader_not_read_empty(
    backend: Backend, user_id: str | None
) -> None:
    """A thread whose conversation a migration run is writing again (legacy turns added since
    it was migrated: its document marked `migrating` until the run's messages are in) is read
    as no other conversation and not as empty: every read of its checkpoints (the state, its
    history, a list across threads, a copy) is refused as its writes are, in the same words
    (409 over HTTP), to be sent again once the run has migrated it; then it reads as before."""
    legacy = LegacyTurns(backend.db)
    logger = AgentMessageLogger(backend.db, legacy=legacy)

    def saver() -> AgentStoreSaver:
        store = ConversationStore(backend.db, legacy=legacy)
        return AgentStoreSaver(backend.db, logger=logger, store=store)

    config = thread(user_id)
    thread_id = config["configurable"]["thread_id"]
    graph = tool_agent(saver())
    await run_turns(graph, config, range(1, 3))
    before = await saver().aget_tuple(config)
    assert before is not None
    history = [t.config async for t in saver().alist(config)]
    marked = {"$set": {MIGRATING: True}}
    await backend.db[CONVERSATIONS].update_one({"_id": thread_id}, marked)

    refused = "exists as legacy turns not migrated yet"
    for reader in (saver(), graph.checkpointer):
        with pytest.raises(Conflict, match=refused):
            await reader.aget_tuple(config)
        with pytest.raises(Conflict, match=refused):
            [t async for t in reader.alist(config)]
    with pytest.raises(Conflict, match=refused):
        await graph.ainvoke(question(3), config)
    if user_id is None:
        with pytest.raises(Conflict, match=refused):
            [t async for t in saver().alist(None)]
        with pytest.raises(Conflict, match=refused):
            await saver().acopy_thread(thread_id, f"{thread_id}-copy")

    await backend.db[CONVERSATIONS].update_one({"_id": thread_id}, {"$unset": {MIGRATING: 1}})
    after = await saver().aget_tuple(config)
    assert after is not None
    assert after.config == before.config
    assert after.checkpoint["channel_values"] == before.checkpoint["channel_values"]
    assert [t.config async for t in saver().alist(config)] == history


async def test_a_list_across_threads_is_refused_a_migrating_thread_only_as_far_as_it_reaches(
    backend: Backend,
) -> None:
    """A thread whose conversation a migration run is writing refuses a list across threads
    only when the list reaches one of its checkpoints (as a list of that thread is refused):
    one whose `limit` is filled before it is served as it would be without that thread,
    though the page it read on holds the thread's checkpoint."""
    migrating = f"thread-m-{uuid.uuid4().hex[:8]}"
    await _checkpointed(AgentStoreSaver(backend.db), thread(None, migrating), "m: the oldest")
    await _three_threads_one_recreated_one_deleted(backend.db)
    marked = {"$set": {MIGRATING: True}}
    await backend.db[CONVERSATIONS].update_one({"_id": migrating}, marked)

    listed = [t async for t in AgentStoreSaver(backend.db).alist(None, limit=3)]
    assert _plans(listed) == ["a: second", "b: current life", "a: first"]
    for limit in (None, 4):
        with pytest.raises(Conflict, match="exists as legacy turns not migrated yet"):
            [t async for t in AgentStoreSaver(backend.db).alist(None, limit=limit)]


async def test_a_users_checkpoint_and_writes_after_another_user_took_her_thread_are_read_by_no_one(
    backend: Backend,
) -> None:
    """A saver admitted Ada on her thread; it is deleted and Grace starts hers under the id:
    Ada's next checkpoint and her pending writes land in her earlier life: neither Grace's
    graph nor a service's read of the thread serves any of them."""
    ada = thread("user-ada")
    thread_id = ada["configurable"]["thread_id"]
    saver = AgentStoreSaver(backend.db)
    first = empty_checkpoint()
    first["channel_values"] = {"messages": [], "note": "ada-1"}
    saved = await saver.aput(ada, first, {"source": "input", "step": -1}, {})
    await ConversationStore(backend.db).delete(thread_id, user_id="user-ada")
    said = [{"role": "user", "content": "grace's own plan"}]
    await AgentMessageLogger(backend.db).log_messages(
        thread_id, said, turn_id="g1", user_id="user-grace"
    )

    following = copy_checkpoint(first)
    following["id"] = str(uuid6())
    following["channel_values"] = {"messages": [], "note": "ada-2"}
    await saver.aput(saved, following, {"source": "loop", "step": 0}, {})
    await saver.aput_writes(saved, [("note", "ada's")], "task-1")
    assert await saver.aget_tuple(thread(None, thread_id)) is None
    assert await saver.aget_tuple(thread("user-grace", thread_id)) is None


class _Reviewed(TypedDict):
    messages: Annotated[list[Any], add_messages]


def _paused_in_a_subgraph(checkpointer: Any) -> Any:
    """A graph whose one node is a subgraph: the model's call, then a person's decision
    (`interrupt`) inside the subgraph."""

    def model(state: _Reviewed) -> dict[str, list[Any]]:
        call = {"name": "wire", "args": {"to": "grace"}, "id": "call-1"}
        return {"messages": [AIMessage("", id="ai-1", tool_calls=[call])]}

    def decide(state: _Reviewed) -> dict[str, list[Any]]:
        answer = interrupt({"approve": "call-1"})
        return {"messages": [ToolMessage(f"said {answer}", tool_call_id="call-1", id="tool-1")]}

    inner = StateGraph(_Reviewed)
    inner.add_node("model", model)
    inner.add_node("decide", decide)
    inner.add_edge(START, "model")
    inner.add_edge("model", "decide")
    inner.add_edge("decide", END)
    outer = StateGraph(_Reviewed)
    outer.add_node("inner", inner.compile())
    outer.add_edge(START, "inner")
    outer.add_edge("inner", END)
    return outer.compile(checkpointer=checkpointer)


async def test_an_edit_through_a_subgraph_state_is_the_root_checkpoints_owners_write(
    backend: Backend,
) -> None:
    """LangGraph builds a subgraph state's config without the user: an edit through it is the
    write of the user the root checkpoint it names was written for, stored in her name; after
    her conversation was deleted and the id taken by another, it is NotFound, nothing
    written, and the new owner's checkpoints hold none of it."""
    thread_id = f"thread-{uuid.uuid4().hex[:12]}"
    ada = thread("user-ada", thread_id)
    adas_graph = _paused_in_a_subgraph(AgentStoreSaver(backend.db))
    edit = {"messages": [AIMessage("", id="ai-1", tool_calls=[_wire("mallory")])]}
    await adas_graph.ainvoke(_said("pay grace"), ada)
    kept = (await adas_graph.aget_state(ada, subgraphs=True)).tasks[0].state.config
    assert "user_id" not in kept["configurable"]
    edited = await adas_graph.aupdate_state(kept, edit)
    stored = await backend.db[CHECKPOINTS].find_one(
        {"checkpoint_id": edited["configurable"]["checkpoint_id"]}
    )
    assert stored is not None
    assert stored["user_id"] == "user-ada"

    await ConversationStore(backend.db).delete(thread_id, user_id="user-ada")
    grace = thread("user-grace", thread_id)
    await _paused_in_a_subgraph(AgentStoreSaver(backend.db)).ainvoke(_said("grace's"), grace)
    before = await backend.db[CHECKPOINTS].count_documents({"thread_id": thread_id})
    with pytest.raises(NotFound):
        await adas_graph.aupdate_state(kept, edit)
    assert await backend.db[CHECKPOINTS].count_documents({"thread_id": thread_id}) == before
    graces = [c async for c in AgentStoreSaver(backend.db).alist(grace)]
    assert not any("mallory" in str(c.checkpoint) for c in graces)


def _wire(to: str) -> dict[str, Any]:
    return {"name": "wire", "args": {"to": to}, "id": "call-1"}


async def test_deleting_a_conversation_deletes_its_checkpoints(backend: Backend) -> None:
    """The conversation is the thread: deleting it through the store (or the HTTP API) leaves
    no checkpoint for whoever takes the id next, as `delete_thread` does."""
    ada = thread("user-ada")
    thread_id = ada["configurable"]["thread_id"]
    adas_graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(adas_graph, ada, range(1, 3))
    await ConversationStore(backend.db).delete(thread_id, user_id="user-ada")
    assert await _counts(backend.db) == (0, 0, 0)

    grace = thread("user-grace", thread_id)
    await run_turns(tool_agent(AgentStoreSaver(backend.db)), grace, range(1, 2))
    assert len((await adas_graph.aget_state(grace)).values["messages"]) == 2
    with pytest.raises(NotFound):
        await adas_graph.ainvoke(question(3), ada)


async def test_a_claimed_thread_is_the_new_owners_and_the_old_ids_graph_is_refused(
    backend: Backend,
) -> None:
    """A claim moves the checkpoints with the conversations: the new owner's graph goes on
    from the state, and the old id's graph, like any other user's, is refused."""
    old = thread("user-guest")
    thread_id = old["configurable"]["thread_id"]
    guests_graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(guests_graph, old, range(1, 3))
    state = (await guests_graph.aget_state(old)).values
    await ConversationStore(backend.db).claim("user-guest", "user-ada")

    ada = thread("user-ada", thread_id)
    adas_graph = tool_agent(AgentStoreSaver(backend.db))
    assert (await adas_graph.aget_state(ada)).values == state
    before = await _counts(backend.db)
    with pytest.raises(NotFound):
        await guests_graph.ainvoke(question(3), old)
    assert await _counts(backend.db) == before
    await run_turns(adas_graph, ada, range(3, 4))
    assert len((await adas_graph.aget_state(ada)).values["messages"]) == len(state["messages"]) + 2


async def test_checkpoints_stored_without_their_owner_stay_the_owners_thread(
    backend: Backend,
) -> None:
    """Checkpoints written before they named their owner are read, and gone on from, by the
    conversation's owner, and by no one else."""
    ada = thread("user-ada")
    thread_id = ada["configurable"]["thread_id"]
    await run_turns(tool_agent(AgentStoreSaver(backend.db)), ada, range(1, 3))
    state = (await tool_agent(AgentStoreSaver(backend.db)).aget_state(ada)).values
    await backend.db[CHECKPOINTS].delete_many({"checkpoint_id": {"$exists": False}})
    await backend.db[CHECKPOINTS].update_many({}, {"$unset": {"user_id": ""}})

    graph = tool_agent(AgentStoreSaver(backend.db))
    assert (await graph.aget_state(ada)).values == state
    assert (await graph.aget_state(thread("user-grace", thread_id))).values == {}
    await run_turns(graph, ada, range(3, 4))
    cold = tool_agent(AgentStoreSaver(backend.db))
    assert len((await cold.aget_state(ada)).values["messages"]) == len(state["messages"]) + 2


async def test_a_long_lived_saver_never_serves_an_erased_users_messages_to_the_ids_next_owner(
    backend: Backend,
) -> None:
    """A saver is one per process, shared by every user: what it keeps of a thread is the
    conversation's it was read from. Erased (or deleted) and taken by another user, the id is
    a new conversation, and the saver reads it afresh for its new owner, and for a service."""
    thread_id = "conv-shared-cache"
    shared = AgentStoreSaver(backend.db)
    await tool_agent(shared).ainvoke(_said("ADA SECRET: card 4242"), thread("user-ada", thread_id))
    await ConversationStore(backend.db).erase_user("user-ada")

    grace = thread("user-grace", thread_id)
    await tool_agent(AgentStoreSaver(backend.db)).ainvoke(_said("grace's own words"), grace)
    for config in (thread(thread_id=thread_id), grace):  # a service's read, then Grace's
        texts = [
            m.content for m in (await tool_agent(shared).aget_state(config)).values["messages"]
        ]
        assert texts[0] == "grace's own words"
        assert "ADA SECRET: card 4242" not in texts


def _said(text: str) -> dict[str, Any]:
    return {"messages": [HumanMessage(text, id="human-1")]}


async def test_a_services_turn_after_a_claim_is_in_the_new_owners_state(
    backend: Backend,
) -> None:
    """What a service writes is for whoever owns the thread when it is read: a service's turn
    after a claim is in the new owner's state, and erasing the old id deletes none of it."""
    thread_id = "conv-claimed-service"
    await tool_agent(AgentStoreSaver(backend.db)).ainvoke(
        question(1), thread("user-guest", thread_id)
    )
    service = tool_agent(AgentStoreSaver(backend.db))  # a long-lived service worker
    await service.ainvoke(question(3), thread(thread_id=thread_id))
    store = ConversationStore(backend.db)
    await store.claim("user-guest", "user-ada")

    await service.ainvoke(question(5), thread(thread_id=thread_id))
    services = (await service.aget_state(thread(thread_id=thread_id))).values["messages"]
    ada = tool_agent(AgentStoreSaver(backend.db))
    adas = (await ada.aget_state(thread("user-ada", thread_id))).values["messages"]
    assert [m.content for m in adas] == [m.content for m in services]
    assert len(adas) == 6
    await store.erase_user("user-guest")
    again = (await ada.aget_state(thread("user-ada", thread_id))).values["messages"]
    assert again == adas


async def test_erasing_the_old_id_while_its_claim_moves_the_threads_leaves_the_new_owners_state(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim moved the guest's conversation to its new owner; before it moves the messages
    and checkpoints, the guest id is erased: they are the new owner's, so the erasure finishes
    the move (was: the new owner's graph state emptied)."""
    thread_id = "conv-claim-in-flight"
    await tool_agent(AgentStoreSaver(backend.db)).ainvoke(
        question(1), thread("user-guest", thread_id)
    )
    before = await AgentStoreSaver(backend.db).aget_tuple(thread("user-guest", thread_id))
    assert before is not None
    guests = await tool_agent(AgentStoreSaver(backend.db)).aget_state(
        thread("user-guest", thread_id)
    )
    claimer, eraser = ConversationStore(backend.db), ConversationStore(backend.db)
    move = claimer._move_claimed_messages

    async def erased_then_moved(from_user_id: str, to_user_id: str) -> int:
        await eraser.erase_user("user-guest")
        return await move(from_user_id, to_user_id)

    monkeypatch.setattr(claimer, "_move_claimed_messages", erased_then_moved)
    await claimer.claim("user-guest", "user-ada")

    adas = await AgentStoreSaver(backend.db).aget_tuple(thread("user-ada", thread_id))
    assert adas is not None
    assert adas.checkpoint["id"] == before.checkpoint["id"]
    state = await tool_agent(AgentStoreSaver(backend.db)).aget_state(thread("user-ada", thread_id))
    assert [m.content for m in state.values["messages"]] == [
        m.content for m in guests.values["messages"]
    ]
    assert await backend.db[CHECKPOINTS].count_documents({"user_id": "user-guest"}) == 0


async def test_erasing_the_new_id_while_its_claim_moves_the_threads_leaves_no_checkpoint(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim moved the guest's conversation to its new owner; before it moves the messages
    and checkpoints, which name the guest, the new owner is erased: every checkpoint and
    message of the thread's conversation goes, and the next holder of the id reads no state
    (was: the guest's checkpoints and messages left for good, with no conversation)."""
    thread_id = "conv-claim-erased"
    await tool_agent(AgentStoreSaver(backend.db)).ainvoke(
        question(1), thread("user-guest", thread_id)
    )
    stored = await backend.db[MESSAGES].count_documents({"conversation_id": thread_id})
    claimer, eraser = ConversationStore(backend.db), ConversationStore(backend.db)
    move, erased = claimer._move_claimed_messages, []

    async def erased_then_moved(from_user_id: str, to_user_id: str) -> int:
        erased.append(await eraser.erase_user(to_user_id))
        return await move(from_user_id, to_user_id)

    monkeypatch.setattr(claimer, "_move_claimed_messages", erased_then_moved)
    await claimer.claim("user-guest", "user-ada")

    assert stored > 0
    assert (erased[0].conversations, erased[0].messages) == (1, stored)
    assert await backend.db[CHECKPOINTS].count_documents({"thread_id": thread_id}) == 0
    assert await backend.db[MESSAGES].count_documents({"conversation_id": thread_id}) == 0
    eve = await AgentStoreSaver(backend.db).aget_tuple(thread("user-eve", thread_id))
    assert eve is None


async def test_a_services_checkpoint_landing_after_its_user_was_erased_is_not_the_next_owners(
    backend: Backend,
) -> None:
    """A service's checkpoints name no user, so they follow the thread's owner; each names the
    conversation it was written for, so one landing after the thread's user was erased is
    never read by whoever takes the id next."""
    thread_id = "conv-late-service"
    await tool_agent(AgentStoreSaver(backend.db)).ainvoke(
        question(1), thread("user-ada", thread_id)
    )
    service = AgentStoreSaver(backend.db)
    latest = await service.aget_tuple(thread(thread_id=thread_id))
    assert latest is not None
    await service.aput_writes(latest.config, [("note", "seen")], "task-1")
    await ConversationStore(backend.db).erase_user("user-ada")
    late = empty_checkpoint()
    late["channel_values"] = {"note": "ADA SECRET: card 4242"}
    await service.aput(latest.config, late, {"source": "loop", "step": 1}, {})

    await asyncio.sleep(0.002)  # the id is taken again, a millisecond later at least
    grace = thread("user-grace", thread_id)
    graces = tool_agent(AgentStoreSaver(backend.db))
    await graces.ainvoke(question(2), grace)
    ids = [t.checkpoint["id"] async for t in AgentStoreSaver(backend.db).alist(grace)]
    assert ids
    assert late["id"] not in ids
    at_late = {"configurable": grace["configurable"] | {"checkpoint_id": late["id"]}}
    assert await AgentStoreSaver(backend.db).aget_tuple(at_late) is None


async def test_an_old_ids_pending_writes_after_a_claim_never_reach_the_new_owner(
    backend: Backend,
) -> None:
    """A graph still running for the first user never writes into the new owner's state, not
    even into a checkpoint that names no user (stored before documents named their owner, or
    a service's): such a write checks the thread's owner first, and is refused."""
    thread_id = "conv-old-docs"
    guests = AgentStoreSaver(backend.db)
    saved = await guests.aput(
        thread("user-guest", thread_id), empty_checkpoint(), {"source": "input", "step": 0}, {}
    )
    await backend.db[CHECKPOINTS].update_many({}, {"$unset": {"user_id": ""}})
    await ConversationStore(backend.db).claim("user-guest", "user-ada")

    running = {"configurable": saved["configurable"] | {"user_id": "user-guest"}}
    with pytest.raises(NotFound, match="was not found"):
        await guests.aput_writes(running, [("note", "written by the old id's graph")], "task-1")
    adas = await AgentStoreSaver(backend.db).aget_tuple(thread("user-ada", thread_id))
    assert adas is not None
    assert adas.pending_writes == []
    # The owner's own graph writes there (its owner checked once more).
    mine = {"configurable": saved["configurable"] | {"user_id": "user-ada"}}
    await AgentStoreSaver(backend.db).aput_writes(mine, [("note", "Ada's")], "task-1")
    adas = await AgentStoreSaver(backend.db).aget_tuple(thread("user-ada", thread_id))
    assert adas is not None
    assert [w[1:] for w in adas.pending_writes] == [("note", "Ada's")]


async def test_parallel_writes_of_a_user_into_a_services_checkpoint_are_all_stored(
    backend: Backend,
) -> None:
    """Parallel tasks of the owner's graph (`Send` branches) write their pending writes into a
    checkpoint a service wrote at once: each is stored, the first naming the document hers."""
    ada = thread("user-ada")
    saver = AgentStoreSaver(backend.db)  # her graph's, which wrote the thread before
    await saver.aput(ada, empty_checkpoint(), {"source": "input", "step": 0}, {})
    service = thread(thread_id=ada["configurable"]["thread_id"])
    saved = await AgentStoreSaver(backend.db).aput(
        service, empty_checkpoint(), {"source": "loop", "step": 1}, {}
    )
    mine = {"configurable": saved["configurable"] | {"user_id": "user-ada"}}
    tasks = [f"task-{n}" for n in range(3)]
    await asyncio.gather(*(saver.aput_writes(mine, [("note", t)], t) for t in tasks))
    stored = await AgentStoreSaver(backend.db).aget_tuple(mine)
    assert stored is not None
    assert sorted(w[1:] for w in stored.pending_writes) == [("note", t) for t in tasks]
    document = await backend.db[CHECKPOINTS].find_one(
        {"checkpoint_id": saved["configurable"]["checkpoint_id"]}
    )
    assert document is not None
    assert document["user_id"] == "user-ada"


class _Branch(TypedDict):
    call: dict[str, Any]


def _parallel_approvals(
    checkpointer: Any, *, stable_ids: bool = False, waiting: tuple[str, ...] = ("Oslo", "Rome")
) -> Any:
    """Asked for the weather, the model calls the tool for two cities at once; each call waits
    for a person's decision in a branch of its own (`Send`, then `interrupt`), those of the
    cities `waiting` only (the others run at once). `stable_ids`: each result's id is derived
    from its call's (an idempotency choice LangChain allows)."""

    def agent(state: MessagesState) -> dict[str, list[Any]]:
        last = state["messages"][-1]
        if isinstance(last, HumanMessage) and "weather" in str(last.content):
            calls = [
                {"name": "weather", "args": {"city": city}, "id": f"call-{city}"}
                for city in ("Oslo", "Rome")
            ]
            return {"messages": [AIMessage("", id=f"ai-{last.id}", tool_calls=calls)]}
        return {"messages": [AIMessage("done", id=f"ai-after-{len(state['messages'])}")]}

    def route(state: MessagesState) -> Any:
        last = state["messages"][-1]
        if isinstance(last, AIMessage) and last.tool_calls:
            return [Send("approve", {"call": call}) for call in last.tool_calls]
        return END

    def approve(branch: _Branch) -> dict[str, list[Any]]:
        call = branch["call"]
        waits = call["args"]["city"] in waiting
        decision = interrupt({"tool_call_id": call["id"]}) if waits else "ran"
        said = f"{call['args']['city']}: {decision}"
        result_id = f"result-{call['id']}" if stable_ids else None
        return {"messages": [ToolMessage(said, tool_call_id=call["id"], id=result_id)]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("approve", approve)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", route, ["approve", END])
    builder.add_edge("approve", "agent")
    return builder.compile(checkpointer=checkpointer)


@pytest.mark.parametrize("api", ["async", "sync"])
async def test_the_owner_resumes_the_parallel_pauses_of_a_services_turn_as_langgraphs_saver_does(
    backend: Backend, api: str
) -> None:
    """A service's turn (a backend job) pauses on two calls at once in the user's thread; the
    user resumes both (LangGraph's map of interrupt ids): the branches' writes land in the
    service's checkpoint at once, and the run ends as with LangGraph's own saver."""
    ada = thread("user-ada")
    thread_id = ada["configurable"]["thread_id"]
    service = thread(thread_id=thread_id)
    ours, theirs = (
        _parallel_approvals(AgentStoreSaver(backend.db)),
        _parallel_approvals(InMemorySaver()),
    )
    for graph in (ours, theirs):
        await graph.ainvoke(_said("hello"), ada)
        await graph.ainvoke({"messages": [HumanMessage("weather?", id="human-2")]}, service)
        paused = await graph.aget_state(ada)
        assert len(paused.interrupts) == 2
        resume = Command(resume={i.id: "yes" for i in paused.interrupts})
        if api == "sync":
            await asyncio.to_thread(graph.invoke, resume, ada)
        else:
            await graph.ainvoke(resume, ada)
    mine = (await ours.aget_state(ada)).values["messages"]
    assert comparable(mine) == comparable((await theirs.aget_state(ada)).values["messages"])
    assert [m.content for m in mine[-3:]] == ["Oslo: yes", "Rome: yes", "done"]
    store = ConversationStore(backend.db)
    assert await store.pending_calls(thread_id, user_id="user-ada") == []


async def test_a_branch_that_ran_beside_a_paused_one_is_pending_until_the_step_ends(
    backend: Backend,
) -> None:
    """Oslo's branch runs at once, Rome's waits for a person: Oslo's result is one of the
    step's pending writes, in no checkpoint's messages, so both calls are pending while the
    graph is paused (a documented limit: the interrupts name what waits); on resume both
    results are logged in LangGraph's order and nothing stays pending."""
    ada = thread("user-ada")
    thread_id = ada["configurable"]["thread_id"]
    graph = _parallel_approvals(AgentStoreSaver(backend.db), waiting=("Rome",))
    await graph.ainvoke({"messages": [HumanMessage("weather?", id="human-1")]}, ada)
    paused = await graph.aget_state(ada)
    assert [i.value for i in paused.interrupts] == [{"tool_call_id": "call-Rome"}]
    store = ConversationStore(backend.db)
    pending = await store.pending_calls(thread_id, user_id="user-ada")
    assert [p.tool_call_id for p in pending] == ["call-Oslo", "call-Rome"]
    await graph.ainvoke(Command(resume="yes"), ada)
    transcript = await store.transcript(thread_id, user_id="user-ada")
    assert [m.content for m in transcript[-3:]] == ["Oslo: ran", "Rome: yes", "done"]
    assert await store.pending_calls(thread_id, user_id="user-ada") == []


async def test_a_branch_from_before_a_reviewers_edit_stores_its_results_under_their_stable_ids(
    backend: Backend,
) -> None:
    """Results whose ids are derived from their calls: the reviewer edits the paused calls, the
    edited calls run, then the user goes back to the first pause and resumes it. The branch's
    results reuse the ids of the edited calls' results with other content: new messages, logged,
    so the conversation ends as the branch does, with no call left pending."""
    ada = thread("user-ada")
    thread_id = ada["configurable"]["thread_id"]
    ours = _parallel_approvals(AgentStoreSaver(backend.db), stable_ids=True)
    theirs = _parallel_approvals(InMemorySaver(), stable_ids=True)
    for graph in (ours, theirs):
        await graph.ainvoke({"messages": [HumanMessage("weather?", id="human-1")]}, ada)
        paused = await graph.aget_state(ada)
        first = Command(resume={i.id: "went back" for i in paused.interrupts})
        calls = paused.values["messages"][-1].tool_calls
        edited = [call | {"args": {"city": f"{call['args']['city']} (edited)"}} for call in calls]
        await graph.aupdate_state(
            ada, {"messages": [AIMessage("", id="ai-human-1", tool_calls=edited)]}
        )
        await graph.ainvoke(None, ada)
        again = await graph.aget_state(ada)
        await graph.ainvoke(Command(resume={i.id: "yes" for i in again.interrupts}), ada)
        await graph.ainvoke(first, paused.config)
    mine = (await ours.aget_state(ada)).values["messages"]
    assert comparable(mine) == comparable((await theirs.aget_state(ada)).values["messages"])
    store = ConversationStore(backend.db)
    assert await store.pending_calls(thread_id, user_id="user-ada") == []
    replay = chat_completions(await store.transcript(thread_id, user_id="user-ada"))
    results = [m["content"] for m in replay if m["role"] == "tool"]
    assert results[-2:] == ["Oslo: went back", "Rome: went back"]
    assert PENDING_RESULT not in results


async def test_a_users_list_names_its_thread(backend: Backend) -> None:
    saver = AgentStoreSaver(backend.db)
    with pytest.raises(InvalidInput, match="one thread at a time"):
        [t async for t in saver.alist({"configurable": {"user_id": "user-ada"}})]


# -- forks, deletes, prunes ------------------------------------------------------------------


async def test_a_copied_thread_is_a_fork_that_shares_no_document(backend: Backend) -> None:
    source = thread("user-ada")
    graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(graph, source, range(1, 4))
    source_id = source["configurable"]["thread_id"]
    target = thread("user-ada")
    target_id = target["configurable"]["thread_id"]
    saver = AgentStoreSaver(backend.db)
    await saver.acopy_thread(source_id, target_id)
    store = ConversationStore(backend.db)
    before = await store.transcript(source_id)

    copied = (await tool_agent(AgentStoreSaver(backend.db)).aget_state(target)).values
    assert copied == (await graph.aget_state(source)).values
    await run_turns(graph, target, range(4, 6))
    after = await store.transcript(source_id)
    assert after == before
    forked = await store.transcript(target_id)
    assert [m.content for m in forked[: len(before)]] == [m.content for m in before]
    assert len(forked) > len(before)
    assert not {m.id for m in forked} & {m.id for m in after}
    assert (await store.get_conversation(target_id)).user_id == "user-ada"
    kept = await backend.db[CHECKPOINTS].find({"thread_id": target_id}).to_list(None)
    extras = [entry["_id"] for doc in kept for entry in doc.get("extras", ())]
    assert sorted(extras) == sorted(m.id for m in forked)

    await saver.adelete_thread(target_id)
    assert await store.transcript(source_id) == before
    assert len((await graph.aget_state(source)).values["messages"]) == len(before)


async def test_a_copied_thread_keeps_the_whole_text_of_a_cut_message(backend: Backend) -> None:
    """LANGGRAPH.md `copy_thread`: a fork, as the store's own fork is: a message cut to its
    bound is logged again from its whole text, cut and kept whole for the copy, which
    outlives the source."""
    rules = TurnRules(max_message_bytes=16 * 1024)
    logger = AgentMessageLogger(backend.db, rules=rules)
    saver = AgentStoreSaver(backend.db, logger=logger)
    source, target = thread("user-ada"), thread("user-ada")
    pasted = "Clause " + "x" * 40_000
    graph = tool_agent(saver)
    await graph.ainvoke({"messages": [HumanMessage(pasted, id="human-1")]}, source)
    source_id, target_id = (c["configurable"]["thread_id"] for c in (source, target))

    await saver.acopy_thread(source_id, target_id)
    await saver.adelete_thread(source_id)

    store = ConversationStore(backend.db)
    copied = (await store.transcript(target_id))[0]
    assert copied.truncated is not None
    assert "content" in copied.truncated
    assert (await store.with_full_texts([copied]))[0].content == pasted
    state = (await tool_agent(AgentStoreSaver(backend.db)).aget_state(target)).values
    assert state["messages"][0].content == pasted


async def test_a_thread_that_decided_a_call_again_copies_with_the_call_still_open(
    backend: Backend,
) -> None:
    config = thread()
    source_id = config["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(backend.db))
    await graph.ainvoke(question(2), config)
    paused = (await graph.aget_state(config)).config
    await graph.ainvoke(Command(resume="yes"), config)
    await graph.aupdate_state(paused, None)  # time travel: call-2 logged again, open
    target = thread(thread_id=source_id + "-copy")
    await AgentStoreSaver(backend.db).acopy_thread(source_id, target["configurable"]["thread_id"])

    store = ConversationStore(backend.db)
    copied = approval_agent(AgentStoreSaver(backend.db))
    assert (await copied.aget_state(target)).values == (await graph.aget_state(config)).values
    assert [c.tool_call_id for c in await store.pending_calls(source_id + "-copy")] == ["call-2"]
    await copied.ainvoke(Command(resume="no"), target)
    assert await store.pending_calls(source_id + "-copy") == []
    assert [c.tool_call_id for c in await store.pending_calls(source_id)] == ["call-2"]


async def test_a_fork_into_another_users_thread_is_refused_before_anything_is_copied(
    backend: Backend,
) -> None:
    ada, grace = thread("user-ada"), thread("user-grace")
    graph = tool_agent(AgentStoreSaver(backend.db))
    for config in (ada, grace):
        await run_turns(graph, config, range(1, 2))
    before = await _counts(backend.db)
    with pytest.raises(Conflict, match="belongs to another user"):
        await AgentStoreSaver(backend.db).acopy_thread(
            ada["configurable"]["thread_id"], grace["configurable"]["thread_id"]
        )
    assert await _counts(backend.db) == before


@pytest.mark.parametrize("source_owner", [None, "user-ada"])
async def test_a_copy_into_a_fork_of_its_source_given_to_another_user_is_refused(
    backend: Backend, source_owner: str | None
) -> None:
    """LANGGRAPH.md `copy_thread`: a fork of the source is the copy's earlier attempt only
    while its owner is the one the copy writes for, the source's (none for an unowned one).
    A service's fork of its unowned thread, given to a user since, is hers: a `Conflict`
    ("belongs to another user"), nothing written into it, whoever owns the source (was: an
    unowned source's checkpoints copied into her thread)."""
    db, store = backend.db, ConversationStore(backend.db)
    source = thread(None)
    await run_turns(tool_agent(AgentStoreSaver(db)), source, range(1, 3))
    source_id = source["configurable"]["thread_id"]
    target_id = source_id + "-fork"
    last = (await store.messages_by_seq(source_id))[-1].seq
    assert last is not None
    await AgentMessageLogger(db).fork(source_id, last, target_id)
    await AgentMessageLogger(db).upsert_conversation(target_id, user_id="user-grace")
    if source_owner is not None:
        await AgentMessageLogger(db).upsert_conversation(source_id, user_id=source_owner)
    before = await _counts(db), await store.get_conversation(target_id)

    with pytest.raises(Conflict, match="belongs to another user"):
        await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    assert (await _counts(db), await store.get_conversation(target_id)) == before
    assert await db[CHECKPOINTS].count_documents({"thread_id": target_id}) == 0


async def _a_store_fork_of_a_paused_thread(db: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Ada's graph pauses on call-2; she forks the conversation with the store's fork (what
    POST /v1/conversations/{id}/forks and the viewer's "Continue from here" do): the configs
    of her thread and of the fork's."""
    store = ConversationStore(db)
    source = thread("user-ada")
    graph = approval_agent(AgentStoreSaver(db))
    await graph.ainvoke(question(1), source)
    await graph.ainvoke(question(2), source)  # pauses on call-2
    source_id = source["configurable"]["thread_id"]
    fork = thread("user-ada", source_id + "-fork")
    last = (await store.messages_by_seq(source_id))[-1].seq
    assert last is not None
    await AgentMessageLogger(db).fork(
        source_id, last, fork["configurable"]["thread_id"], user_id="user-ada", owner_only=True
    )
    return source, fork


async def test_a_store_fork_of_a_paused_thread_is_a_transcript_the_graph_takes_with_copy_thread(
    backend: Backend,
) -> None:
    """LANGGRAPH.md "The store's fork of a thread": the store's fork copies the messages, no
    checkpoint, so the graph has nothing on the fork's thread yet; `copy_thread` into that
    fork, before the graph runs there, gives it the source's checkpoints up to the fork's
    `seq`: the graph resumes the paused call on the fork, which answers it there only."""
    db, store = backend.db, ConversationStore(backend.db)
    source, fork = await _a_store_fork_of_a_paused_thread(db)
    source_id, fork_id = (c["configurable"]["thread_id"] for c in (source, fork))
    graph = approval_agent(AgentStoreSaver(db))
    assert await db[CHECKPOINTS].count_documents({"thread_id": fork_id}) == 0
    assert (await graph.aget_state(fork)).values.get("messages", []) == []
    assert [c.tool_call_id for c in await store.pending_calls(fork_id)] == ["call-2"]

    await AgentStoreSaver(db).acopy_thread(source_id, fork_id)
    assert (await graph.aget_state(fork)).next == ("approve",)
    await graph.ainvoke(Command(resume="yes"), fork)

    assert await store.pending_calls(fork_id) == []
    assert [m.content for m in await store.transcript(fork_id)][-2:] == [
        APPROVED,
        f"Answer 2: {APPROVED}",
    ]
    assert [c.tool_call_id for c in await store.pending_calls(source_id)] == ["call-2"]


@pytest.mark.parametrize("forked", ["before the source answered", "after the source answered"])
async def test_a_store_fork_of_a_paused_call_is_decided_in_the_fork_whatever_the_source_answered(
    backend: Backend, forked: str
) -> None:
    """LANGGRAPH.md "The store's fork of a thread": `copy_thread` into a store fork made at a
    paused call gives the fork the source's paused checkpoint as the source held it there,
    without the answer the source's resume gave it since (its `__resume__` writes and the
    writes of the task it answered): the fork is paused again, and her decision on the fork
    is the one stored there, whether the source answered before or after the fork was made."""
    db, store = backend.db, ConversationStore(backend.db)
    source, fork = thread("user-ada"), thread("user-ada")
    source_id, fork_id = (c["configurable"]["thread_id"] for c in (source, fork))
    graph = approval_agent(AgentStoreSaver(db))
    await graph.ainvoke(question(1), source)
    await graph.ainvoke(question(2), source)  # pauses on call-2
    call = (await store.messages_by_seq(source_id))[-1].seq
    assert call is not None
    logger = AgentMessageLogger(db)
    if forked == "before the source answered":
        await logger.fork(source_id, call, fork_id, user_id="user-ada", owner_only=True)
    await graph.ainvoke(Command(resume="yes"), source)
    if forked == "after the source answered":
        await logger.fork(source_id, call, fork_id, user_id="user-ada", owner_only=True)

    await AgentStoreSaver(db).acopy_thread(source_id, fork_id)
    state = await graph.aget_state(fork)
    assert state.next == ("approve",)
    assert [i.value["tool_call_id"] for t in state.tasks for i in t.interrupts] == ["call-2"]
    await graph.ainvoke(Command(resume="no"), fork)

    assert [m.content for m in await store.transcript(fork_id)][call + 1 :] == [
        "denied: no",
        "Answer 2: denied: no",
    ]
    assert [m.content for m in await store.transcript(source_id)][call + 1 :] == [
        APPROVED,
        f"Answer 2: {APPROVED}",
    ]


async def test_a_copy_of_a_thread_into_a_new_id_keeps_the_answers_its_pauses_were_given(
    backend: Backend,
) -> None:
    """LANGGRAPH.md `copy_thread`: outside a store fork the copy is the whole thread, as
    LangGraph's savers copy it: each checkpoint with all its pending writes, a paused one's
    answer (`__resume__`) and the writes of the task it answered included."""
    db = backend.db
    source = thread("user-ada")
    source_id = source["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(db))
    await graph.ainvoke(question(2), source)  # pauses on call-2
    await graph.ainvoke(Command(resume="yes"), source)
    copy = thread("user-ada")

    await AgentStoreSaver(db).acopy_thread(source_id, copy["configurable"]["thread_id"])

    async def writes(config: dict[str, Any]) -> list[tuple[str, list[tuple[str, str]]]]:
        saver = AgentStoreSaver(db)
        return [
            (t.checkpoint["id"], [(w[0], w[1]) for w in t.pending_writes or []])
            async for t in saver.alist(config)  # type: ignore[arg-type]
        ]

    copied = await writes(copy)
    assert copied == await writes(source)
    assert any(channel == "__resume__" for _, ws in copied for _, channel in ws)


async def test_a_graph_run_on_a_store_fork_it_was_not_copied_into_closes_the_paused_call(
    backend: Backend,
) -> None:
    """LANGGRAPH.md "The store's fork of a thread": run on the fork's thread without
    `copy_thread`, the graph starts from an empty state (its model sees none of the forked
    messages) and its first turn closes the paused call with an `interrupted` stand-in, as
    any turn past a paused call closes it: nothing is left pending on the fork for good."""
    db, store = backend.db, ConversationStore(backend.db)
    _, fork = await _a_store_fork_of_a_paused_thread(db)
    fork_id = fork["configurable"]["thread_id"]
    graph = approval_agent(AgentStoreSaver(db))

    await graph.ainvoke(question(3), fork)

    assert [m.content for m in (await graph.aget_state(fork)).values["messages"]] == [
        "Question 3: how is the weather?",
        "Answer 3: noted",
    ]
    assert await store.pending_calls(fork_id) == []
    answers = [m.content for m in await store.transcript(fork_id) if m.tool_call_id == "call-2"]
    assert answers == [INTERRUPTED_RESULT]


async def _an_existing_target(db: Any, target: str) -> tuple[str, str]:
    """A graph-run thread and an existing conversation that is no copy of it (`target`):
    the ids of both."""
    source = thread(None if target == "another user's chat, from an unowned thread" else "user-ada")
    graph = tool_agent(AgentStoreSaver(db))
    await run_turns(graph, source, range(1, 3))
    target_id = f"target-{uuid.uuid4().hex[:12]}"
    if target == "another thread of the same user":
        await run_turns(graph, thread("user-ada", target_id), range(7, 8))
    else:
        owner = {"a chat of the same user": "user-ada", "an unowned chat": None}.get(
            target, "user-grace"
        )
        said = [{"role": "user", "content": "my own chat"}]
        await AgentMessageLogger(db).log_messages(target_id, said, user_id=owner, turn_id="t-1")
    return source["configurable"]["thread_id"], target_id


@pytest.mark.parametrize(
    "target",
    [
        "a chat of the same user",
        "an unowned chat",
        "another thread of the same user",
        "another user's chat, from an unowned thread",
    ],
)
async def test_a_copy_into_an_existing_conversation_is_refused_before_anything_is_written(
    backend: Backend, target: str
) -> None:
    """LANGGRAPH.md `copy_thread`: a fork, into a new conversation; one that exists already
    and is no earlier attempt of this copy is a Conflict, as the store's fork into it is."""
    source_id, target_id = await _an_existing_target(backend.db, target)
    store = ConversationStore(backend.db)
    before = await _counts(backend.db), await store.get_conversation(target_id)
    with pytest.raises(Conflict, match="copy into a new id"):
        await AgentStoreSaver(backend.db).acopy_thread(source_id, target_id)
    assert (await _counts(backend.db), await store.get_conversation(target_id)) == before


class _PoppedAfterItsRead(ConversationStore):
    """A store whose first read of a conversation's messages is followed at once by a pop of
    its last one (another process regenerating an answer while the thread is copied)."""

    popped: str | None = None

    async def messages_by_seq(self, conversation_id: str, **kwargs: Any) -> list[Any]:
        read = await super().messages_by_seq(conversation_id, **kwargs)
        if self.popped is None:
            self.popped = (await self.pop_last_message(conversation_id)).content
        return read


async def test_a_copy_racing_a_pop_of_the_source_never_holds_the_popped_message(
    backend: Backend,
) -> None:
    """LANGGRAPH.md `copy_thread`: its copies are copies of stored messages; a pop landing
    while it copies is never brought back."""
    config = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(backend.db)), config, range(1, 3))
    source_id = config["configurable"]["thread_id"]
    side = [{"role": "user", "content": "side note"}, {"role": "assistant", "content": "regret"}]
    await AgentMessageLogger(backend.db).log_messages(
        source_id, side, user_id="user-ada", turn_id="t-side"
    )
    racing = _PoppedAfterItsRead(backend.db)

    await AgentStoreSaver(backend.db, store=racing).acopy_thread(source_id, source_id + "-copy")

    store = ConversationStore(backend.db)
    assert racing.popped == "regret"
    copied = [m.content for m in await store.transcript(source_id + "-copy")]
    assert copied == [m.content for m in await store.transcript(source_id)]


async def _erase(db: Any, source_id: str, target_id: str) -> None:
    await ConversationStore(db).erase_user("user-ada")


async def _delete_the_source(db: Any, source_id: str, target_id: str) -> None:
    await ConversationStore(db).delete(source_id)


async def _delete_the_target(db: Any, source_id: str, target_id: str) -> None:
    await ConversationStore(db).delete(target_id)


@pytest.mark.parametrize(
    "racing",
    [
        pytest.param(_erase, id="its-user-erased"),
        pytest.param(_delete_the_source, id="its-source-deleted"),
        pytest.param(_delete_the_target, id="its-target-deleted"),
    ],
)
async def test_a_copy_longer_than_one_fork_racing_a_deletion_leaves_nothing(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, racing: Any
) -> None:
    """LANGGRAPH.md `copy_thread`: a copy logged turn by turn (the fork refused
    `ForkTooLarge`, forced here) whose source or user is deleted, or its half-made target,
    before it logs its turns answers NotFound and leaves nothing, as the store's fork does."""
    from agent_store.integrations._langgraph_transcript import TranscriptLink

    config = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(backend.db)), config, range(1, 3))
    source_id = config["configurable"]["thread_id"]
    target_id = source_id + "-copy"

    async def too_large(*args: Any) -> None:
        return None  # what it answers when the store refuses the fork `ForkTooLarge`

    monkeypatch.setattr(TranscriptLink, "_fork_of_all", too_large)
    saver = AgentStoreSaver(backend.db)
    logger = saver._transcripts._logger
    logged = logger.log_messages

    async def raced(conversation_id: str, *args: Any, **kwargs: Any) -> Any:
        if conversation_id == target_id:
            monkeypatch.setattr(logger, "log_messages", logged)
            await racing(backend.db, source_id, target_id)
        return await logged(conversation_id, *args, **kwargs)

    monkeypatch.setattr(logger, "log_messages", raced)
    with pytest.raises(NotFound):
        await saver.acopy_thread(source_id, target_id)

    with pytest.raises(NotFound):
        await ConversationStore(backend.db).get_conversation(target_id)
    assert await backend.db[MESSAGES].count_documents({"conversation_id": target_id}) == 0
    assert await backend.db[CHECKPOINTS].count_documents({"thread_id": target_id}) == 0


async def _a_thread_whose_copy_races(
    db: Any, monkeypatch: pytest.MonkeyPatch, race: Callable[[], Awaitable[Any]]
) -> str:
    """A thread of user-ada's two graph turns whose copy runs `race` once it read the
    source's checkpoints, before it inserts them: the thread id."""
    from agent_store.integrations import langgraph

    config = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(db)), config, range(1, 3))
    inserted = langgraph._insert_new

    async def raced(*args: Any) -> Any:
        monkeypatch.setattr(langgraph, "_insert_new", inserted)
        await race()
        return await inserted(*args)

    monkeypatch.setattr(langgraph, "_insert_new", raced)
    return str(config["configurable"]["thread_id"])


async def test_a_copy_racing_an_erasure_of_its_user_copies_no_checkpoint(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANGGRAPH.md `copy_thread`: the user erased once the copy's fork is made, before its
    checkpoints are copied: NotFound, and nothing of the user stands under the target."""
    erase = partial(ConversationStore(backend.db).erase_user, "user-ada")
    source_id = await _a_thread_whose_copy_races(backend.db, monkeypatch, erase)
    with pytest.raises(NotFound):
        await AgentStoreSaver(backend.db).acopy_thread(source_id, source_id + "-copy")

    assert await backend.db[CHECKPOINTS].count_documents({"user_id": "user-ada"}) == 0
    assert await backend.db[MESSAGES].count_documents({"user_id": "user-ada"}) == 0
    with pytest.raises(NotFound):
        await ConversationStore(backend.db).get_conversation(source_id + "-copy")


@pytest.mark.parametrize(
    "racing",
    [
        pytest.param(_erase, id="its-user-erased"),
        pytest.param(_delete_the_source, id="its-source-deleted"),
    ],
)
async def test_a_copy_whose_source_goes_once_it_read_the_checkpoints_leaves_nothing(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, racing: Any
) -> None:
    """LANGGRAPH.md `copy_thread`: the source deleted, or its user erased, once the copy read
    the thread's checkpoints and before it read the thread's conversation: NotFound, and no
    checkpoint (none naming the erased user, none holding her words) stands under the
    target."""
    from agent_store.integrations._langgraph_transcript import TranscriptLink

    config = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(backend.db)), config, range(1, 3))
    source_id = config["configurable"]["thread_id"]
    target_id = source_id + "-copy"
    copies = TranscriptLink.copy

    async def raced(link: Any, *args: Any, **kwargs: Any) -> Any:
        await racing(backend.db, source_id, target_id)
        return await copies(link, *args, **kwargs)

    monkeypatch.setattr(TranscriptLink, "copy", raced)
    with pytest.raises(NotFound):
        await AgentStoreSaver(backend.db).acopy_thread(source_id, target_id)

    assert await backend.db[CHECKPOINTS].count_documents({"thread_id": target_id}) == 0
    assert await backend.db[CHECKPOINTS].count_documents({"user_id": "user-ada"}) == 0
    assert await backend.db[MESSAGES].count_documents({"conversation_id": target_id}) == 0
    with pytest.raises(NotFound):
        await ConversationStore(backend.db).get_conversation(target_id)


def _forced_turn_by_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy logged turn by turn, as one whose fork the store refuses `ForkTooLarge`."""
    from agent_store.integrations._langgraph_transcript import TranscriptLink

    async def too_large(*args: Any) -> None:
        return None  # what it answers when the store refuses the fork `ForkTooLarge`

    monkeypatch.setattr(TranscriptLink, "_fork_of_all", too_large)


@pytest.mark.parametrize("path", ["fork", "turn by turn"])
async def test_a_copy_racing_a_claim_of_its_user_is_the_new_owners_thread(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """LANGGRAPH.md `copy_thread`: a claim landing after the copy read its checkpoints and
    before it stored them leaves the whole copy the new owner's, checkpoints too: their
    graph reads the thread the source is."""
    if path == "turn by turn":
        _forced_turn_by_turn(monkeypatch)
    claim = partial(ConversationStore(backend.db).claim, "user-ada", "user-bob")
    source_id = await _a_thread_whose_copy_races(backend.db, monkeypatch, claim)
    await AgentStoreSaver(backend.db).acopy_thread(source_id, source_id + "-copy")

    assert await backend.db[CHECKPOINTS].count_documents({"user_id": "user-ada"}) == 0
    await _bobs_graph_reads_the_copy_as_the_source(backend.db, source_id)


async def test_following_a_source_refuses_a_conversation_that_is_no_copy_of_it(
    backend: Backend,
) -> None:
    """LIBRARY.md `follow_its_source`: only a copy of `source` follows its owner (a fork of it,
    or its owner's conversation holding nothing but `copy_thread`'s turns of it); any other
    conversation is InvalidInput and stays its owner's, its graph still reading it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    alice, bob = thread("user-ada"), thread("user-bob")
    await tool_agent(AgentStoreSaver(backend.db)).ainvoke(question(2), alice)
    await tool_agent(AgentStoreSaver(backend.db)).ainvoke(question(1), bob)
    await logger.upsert_conversation("empty-chat", user_id="user-ada")
    bobs = await store.get_conversation(bob["configurable"]["thread_id"])
    for conversation_id in (alice["configurable"]["thread_id"], "empty-chat"):
        alices = await store.get_conversation(conversation_id)
        with pytest.raises(InvalidInput, match="no copy of"):
            await logger.follow_its_source(alices, bobs)
        assert (await store.get_conversation(conversation_id)).user_id == "user-ada"
    still = await tool_agent(AgentStoreSaver(backend.db)).aget_state(alice)
    assert still.values["messages"][-1].content.startswith("Answer 2: ")


def _claimed_after(db: Any, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
    """`owner`'s method `name` followed, its first call only, by a claim of user-ada's account
    by user-bob."""
    called = getattr(owner, name)
    claim = partial(ConversationStore(db).claim, "user-ada", "user-bob")

    async def then_claimed(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(owner, name, called)
        found = await called(*args, **kwargs)
        await claim()
        return found

    monkeypatch.setattr(owner, name, then_claimed)


@pytest.mark.parametrize(
    ("path", "after"),
    [
        ("fork", "it read its source"),
        ("fork", "it looked at the target"),
        ("turn by turn", "it read its source"),
        ("turn by turn", "it looked at the target"),
        ("turn by turn", "it created the target"),
        ("turn by turn", "it logged a turn"),
    ],
)
async def test_a_copy_racing_a_claim_at_any_point_is_the_new_owners_thread(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, path: str, after: str
) -> None:
    """LANGGRAPH.md `copy_thread`: a claim of the source's user landing at any point of the
    copy leaves the whole copy the new owner's, its conversation, messages and checkpoints:
    their graph reads the thread the source is, also on a copy logged turn by turn (the
    store's fork refused `ForkTooLarge`, forced here), which follows its source's owner as
    the store's fork does."""
    from agent_store.integrations._langgraph_transcript import TranscriptLink

    config = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(backend.db)), config, range(1, 3))
    source_id = config["configurable"]["thread_id"]
    if path == "turn by turn":
        _forced_turn_by_turn(monkeypatch)
    saver = AgentStoreSaver(backend.db)
    link = saver._transcripts
    owner, name = {
        "it read its source": (link._store, "get_conversation"),
        "it looked at the target": (TranscriptLink, "_earlier_attempt"),
        "it created the target": (TranscriptLink, "_created_target"),
        "it logged a turn": (link._logger, "log_messages"),
    }[after]
    _claimed_after(backend.db, monkeypatch, owner, name)
    await saver.acopy_thread(source_id, source_id + "-copy")

    store = ConversationStore(backend.db)
    assert (await store.get_conversation(source_id + "-copy")).user_id == "user-bob"
    assert await backend.db[MESSAGES].count_documents({"user_id": "user-ada"}) == 0
    assert await backend.db[CHECKPOINTS].count_documents({"user_id": "user-ada"}) == 0
    await _bobs_graph_reads_the_copy_as_the_source(backend.db, source_id)


@pytest.mark.parametrize(
    ("source_owner", "started_by"),
    [(None, "user-bob"), ("user-ada", None)],
    ids=["unowned-thread-into-another-users-chat", "users-thread-into-an-unowned-chat"],
)
async def test_a_copy_longer_than_one_fork_never_writes_into_a_chat_started_meanwhile(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    source_owner: str | None,
    started_by: str | None,
) -> None:
    """LANGGRAPH.md `copy_thread`: a copy logged turn by turn creates its target; a
    conversation someone started under the id after the copy looked is a Conflict, and
    nothing is written into it."""
    from agent_store.integrations._langgraph_transcript import TranscriptLink

    _forced_turn_by_turn(monkeypatch)
    config = thread(source_owner)
    await run_turns(tool_agent(AgentStoreSaver(backend.db)), config, range(1, 3))
    source_id, target_id = config["configurable"]["thread_id"], f"chat-{uuid.uuid4().hex[:12]}"
    looked = TranscriptLink._earlier_attempt

    async def then_started(link: Any, *args: Any) -> Any:
        found = await looked(link, *args)
        said = [{"role": "user", "content": "my own chat"}]
        logger = AgentMessageLogger(backend.db)
        await logger.log_messages(target_id, said, user_id=started_by, turn_id="t-1")
        return found

    monkeypatch.setattr(TranscriptLink, "_earlier_attempt", then_started)
    with pytest.raises(Conflict, match="copy into a new id"):
        await AgentStoreSaver(backend.db).acopy_thread(source_id, target_id)

    store = ConversationStore(backend.db)
    assert (await store.get_conversation(target_id)).user_id == started_by
    assert [m.content for m in await store.transcript(target_id)] == ["my own chat"]
    assert await backend.db[CHECKPOINTS].count_documents({"thread_id": target_id}) == 0


async def _a_thread_ending_in_a_side_turn_popped_after(
    db: Any, saver: AgentStoreSaver, patch: tuple[pytest.MonkeyPatch, Any, str]
) -> tuple[str, list[str]]:
    """A thread of two graph turns and a side turn another writer logged ("side note",
    "regret"), whose last message is popped right after the first call of `patch`'s method
    (its object and name: a read of the source by the copy): the thread id, and what was
    popped."""
    monkeypatch, owner, read = patch
    config = thread("user-ada")
    await run_turns(tool_agent(saver), config, range(1, 3))
    source_id = config["configurable"]["thread_id"]
    side = [{"role": "user", "content": "side note"}, {"role": "assistant", "content": "regret"}]
    await AgentMessageLogger(db).log_messages(source_id, side, user_id="user-ada", turn_id="t-side")
    store, reads, popped = ConversationStore(db), getattr(owner, read), []

    async def then_popped(*args: Any, **kwargs: Any) -> Any:
        found = await reads(*args, **kwargs)
        if not popped:
            popped.append(str((await store.pop_last_message(source_id)).content))
        return found

    monkeypatch.setattr(owner, read, then_popped)
    return source_id, popped


@pytest.mark.parametrize("path", ["fork", "turn by turn"])
async def test_a_copy_racing_a_pop_once_it_read_its_source_never_holds_the_popped_message(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """LANGGRAPH.md `copy_thread`: a pop of the source's last message landing once the copy
    read the source, before it writes, is never brought back: the store's fork is made again
    at what the source holds then, and a copy logged turn by turn (the fork refused
    `ForkTooLarge`, forced here) takes back what it logged and copies the source again."""
    saver = AgentStoreSaver(backend.db)
    if path == "turn by turn":
        _forced_turn_by_turn(monkeypatch)
        owner, read = saver._transcripts._store, "with_full_texts"
    else:
        owner, read = saver._transcripts._logger, "_fork_source"
    source_id, popped = await _a_thread_ending_in_a_side_turn_popped_after(
        backend.db, saver, (monkeypatch, owner, read)
    )
    await saver.acopy_thread(source_id, source_id + "-copy")

    store = ConversationStore(backend.db)
    assert popped == ["regret"]
    copied = [m.content for m in await store.transcript(source_id + "-copy")]
    assert copied == [m.content for m in await store.transcript(source_id)]
    assert copied[-1] == "side note"


async def _crashing_before_the_checkpoints(
    db: Any, source_id: str, target_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy whose process dies once its transcript is copied, before its checkpoints are."""
    from agent_store.integrations import langgraph

    await _a_copy_dying_in(db, source_id, target_id, monkeypatch, (langgraph, "_insert_new"))


async def _a_copy_dying_in(
    db: Any,
    source_id: str,
    target_id: str,
    monkeypatch: pytest.MonkeyPatch,
    where: tuple[Any, str],
) -> None:
    """A copy whose process dies when it calls `where` (an owner and the name of a function
    of it)."""

    async def died(*args: Any) -> None:
        raise ConnectionError("the process died")

    with monkeypatch.context() as patched:
        patched.setattr(*where, died)
        with pytest.raises(ConnectionError):
            await AgentStoreSaver(db).acopy_thread(source_id, target_id)


async def test_a_copy_run_again_after_a_crash_is_the_thread_as_its_fork_copied_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANGGRAPH.md `copy_thread`: re-running it after a crash converges, though the source
    thread went on meanwhile: the copy holds the messages its fork copied, and the source's
    checkpoints that refer to none but those."""
    source = thread("user-ada")
    graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(graph, source, range(1, 3))
    source_id = source["configurable"]["thread_id"]
    target = thread("user-ada", source_id + "-copy")
    then = (await graph.aget_state(source)).values["messages"]
    await _crashing_before_the_checkpoints(backend.db, source_id, source_id + "-copy", monkeypatch)
    await run_turns(graph, source, range(3, 4))

    await AgentStoreSaver(backend.db).acopy_thread(source_id, source_id + "-copy")

    saver = AgentStoreSaver(backend.db)
    copied = [t.checkpoint["id"] async for t in saver.alist(target)]
    every = [t.checkpoint async for t in saver.alist(source)]
    held = [c["id"] for c in every if _messages_of(c) == then[: len(_messages_of(c))]]
    assert copied == held
    assert len(held) < len(every)
    store = ConversationStore(backend.db)
    forked = [m.content for m in await store.transcript(source_id + "-copy")]
    assert forked == [m.content for m in await store.transcript(source_id)][: len(then)]
    # Resumed, the copy goes on as its source went on from there.
    went_on = tool_agent(saver)
    await went_on.ainvoke(None, target)
    ours = (await went_on.aget_state(target)).values["messages"]
    assert comparable(ours) == comparable((await graph.aget_state(source)).values["messages"])


@pytest.mark.parametrize("stored", ["before-epochs", "before-checkpoints-named-epochs"])
async def test_a_thread_an_earlier_release_stored_reads_and_goes_on_as_it_was(
    backend: Backend, stored: str
) -> None:
    """A thread stored before epochs (no `epoch` anywhere), or once its conversation had one
    but its checkpoints named only its creation time: its graph reads its state as it was,
    and goes on from it, its next turn drawing the conversation's epoch when it had none;
    every checkpoint stays in its history, and deleting the thread deletes them all."""
    config = thread("user-ada")
    thread_id = config["configurable"]["thread_id"]
    graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(graph, config, range(1, 3))
    if stored == "before-epochs":
        await _as_stored_before_epochs(backend.db, thread_id)
    else:
        await backend.db[CONVERSATIONS].update_one(
            {"_id": thread_id}, {"$unset": {"epoch_marks": ""}}
        )
        await backend.db[CHECKPOINTS].update_many(
            {"thread_id": thread_id}, {"$unset": {"epoch": ""}}
        )
    then = comparable((await graph.aget_state(config)).values["messages"])
    history = len([t async for t in AgentStoreSaver(backend.db).alist(config)])

    again = tool_agent(AgentStoreSaver(backend.db))
    assert comparable((await again.aget_state(config)).values["messages"]) == then
    await run_turns(again, config, range(3, 4))
    now = comparable((await again.aget_state(config)).values["messages"])
    assert now[: len(then)] == then
    assert len(now) > len(then)
    assert len([t async for t in AgentStoreSaver(backend.db).alist(config)]) > history
    await ConversationStore(backend.db).delete(thread_id, user_id="user-ada")
    assert await backend.db[CHECKPOINTS].count_documents({"thread_id": thread_id}) == 0


async def test_a_saver_that_cached_a_pre_epoch_thread_never_serves_it_to_the_ids_next_owner(
    backend: Backend,
) -> None:
    """A service's saver read a thread an earlier release stored (no epoch: its cache names
    the conversation by its creation time); the thread is deleted and Mallory starts its id
    again at that very millisecond: the saver reads her thread afresh, none of Ada's messages
    in it."""
    ada = thread("user-ada")
    thread_id = ada["configurable"]["thread_id"]
    builder = StateGraph(MessagesState)
    builder.add_node(
        "bot", lambda s: {"messages": [AIMessage(f"reply to {s['messages'][-1].content}")]}
    )
    builder.add_edge(START, "bot")
    await builder.compile(checkpointer=AgentStoreSaver(backend.db)).ainvoke(
        {"messages": [HumanMessage("ADA SECRET")]}, ada
    )
    await _as_stored_before_epochs(backend.db, thread_id)
    services = AgentStoreSaver(backend.db)
    assert "ADA SECRET" in str(await services.aget_tuple(thread(None, thread_id)))
    created = (await backend.db[CONVERSATIONS].find_one({"_id": thread_id}))["created_at"]
    await ConversationStore(backend.db).delete(thread_id, user_id="user-ada")

    mallory = thread("user-mallory", thread_id)
    said = [{"role": "user", "content": "mallory opens it", "created_at": created}]
    await AgentMessageLogger(backend.db).log_messages(
        thread_id, said, user_id="user-mallory", owner_only=True
    )
    await builder.compile(checkpointer=AgentStoreSaver(backend.db)).ainvoke(
        {"messages": [HumanMessage("mallory asks")]}, mallory
    )
    found = await services.aget_tuple(thread(None, thread_id))
    assert found is not None
    assert "ADA" not in str(found.checkpoint["channel_values"])


async def _as_stored_before_epochs(db: Any, thread_id: str) -> None:
    """The thread as an earlier release stored it: no `epoch` on its conversation, its
    messages or its checkpoints (which named its creation time only), and its conversation
    not one created since checkpoints named epochs (`epoch_marks`)."""
    unset = {"$unset": {"epoch": ""}}
    await db[CONVERSATIONS].update_one(
        {"_id": thread_id}, {"$unset": {"epoch": "", "epoch_marks": ""}}
    )
    await db[MESSAGES].update_many({"conversation_id": thread_id}, unset)
    await db[CHECKPOINTS].update_many({"thread_id": thread_id}, unset)


async def test_a_copy_of_a_thread_stored_before_epochs_run_again_after_it_went_on_converges(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread an earlier release stored (no `epoch`): its copy crashed once its fork was
    made, the thread went on (its turn draws its epoch, so its `version` changes) and the copy
    run again finishes its fork, as for any thread."""
    source = thread("user-ada")
    source_id = source["configurable"]["thread_id"]
    graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(graph, source, range(1, 3))
    await _as_stored_before_epochs(backend.db, source_id)
    then = comparable((await graph.aget_state(source)).values["messages"])
    await _crashing_before_the_checkpoints(backend.db, source_id, source_id + "-copy", monkeypatch)
    before = (await ConversationStore(backend.db).get_conversation(source_id)).version
    await run_turns(graph, source, range(3, 4))
    assert (await ConversationStore(backend.db).get_conversation(source_id)).version != before

    await AgentStoreSaver(backend.db).acopy_thread(source_id, source_id + "-copy")

    store = ConversationStore(backend.db)
    forked = [m.content for m in await store.transcript(source_id + "-copy")]
    assert forked == [m.content for m in await store.transcript(source_id)][: len(then)]
    copy = tool_agent(AgentStoreSaver(backend.db))
    target = thread("user-ada", source_id + "-copy")
    assert comparable((await copy.aget_state(target)).values["messages"])[: len(then)] == then


async def test_a_copy_run_again_after_a_crash_and_a_pop_of_what_its_fork_copied_copies_afresh(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANGGRAPH.md `copy_thread`: re-running it after a crash converges also once a pop
    removed from the source a message its fork copied (the fork can no longer be replayed):
    that fork, untouched since, is taken back and the thread copied as it is now, so the
    copy never holds the popped message, and holds all the source's checkpoints."""
    source = thread("user-ada")
    saver = AgentStoreSaver(backend.db)
    await run_turns(tool_agent(saver), source, range(1, 3))
    source_id = source["configurable"]["thread_id"]
    side = [{"role": "user", "content": "side note"}, {"role": "assistant", "content": "regret"}]
    await AgentMessageLogger(backend.db).log_messages(
        source_id, side, user_id="user-ada", turn_id="t-side"
    )
    await _crashing_before_the_checkpoints(backend.db, source_id, source_id + "-copy", monkeypatch)
    store = ConversationStore(backend.db)
    assert (await store.pop_last_message(source_id)).content == "regret"

    await AgentStoreSaver(backend.db).acopy_thread(source_id, source_id + "-copy")

    copied = [m.content for m in await store.transcript(source_id + "-copy")]
    assert copied == [m.content for m in await store.transcript(source_id)]
    assert copied[-1] == "side note"
    target = thread("user-ada", source_id + "-copy")
    ours = [t.checkpoint["id"] async for t in saver.alist(target)]
    assert ours == [t.checkpoint["id"] async for t in saver.alist(source)]


async def test_a_copy_run_again_keeps_a_target_written_to_since_its_fork(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANGGRAPH.md `copy_thread`: a target its crashed copy forked, and written to since,
    is never taken back: once the fork can no longer be replayed, the re-run is Conflict
    and the target keeps all it holds."""
    source = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(backend.db)), source, range(1, 2))
    source_id, target_id = (
        source["configurable"]["thread_id"],
        source["configurable"]["thread_id"] + "-copy",
    )
    logger = AgentMessageLogger(backend.db)
    side = [{"role": "user", "content": "side note"}, {"role": "assistant", "content": "regret"}]
    await logger.log_messages(source_id, side, user_id="user-ada", turn_id="t-side")
    await _crashing_before_the_checkpoints(backend.db, source_id, target_id, monkeypatch)
    note = [{"role": "user", "content": "mine"}]
    await logger.log_messages(target_id, note, user_id="user-ada", turn_id="t-mine")
    store = ConversationStore(backend.db)
    await store.pop_last_message(source_id)
    held = [m.content for m in await store.transcript(target_id)]

    with pytest.raises(Conflict):
        await AgentStoreSaver(backend.db).acopy_thread(source_id, target_id)

    assert [m.content for m in await store.transcript(target_id)] == held


async def _a_thread_ending_in_a_side_turn(db: Any) -> str:
    """A thread of user-ada's graph turns 1-2, then a side turn ("side note", "regret")
    logged into its conversation: its id."""
    source = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(db)), source, range(1, 3))
    source_id: str = source["configurable"]["thread_id"]
    side = [{"role": "user", "content": "side note"}, {"role": "assistant", "content": "regret"}]
    await AgentMessageLogger(db).log_messages(source_id, side, user_id="user-ada", turn_id="t-side")
    return source_id


async def _a_crashed_copy_of_a_thread_ending_in_a_side_turn(
    db: Any, monkeypatch: pytest.MonkeyPatch, popped: int
) -> tuple[str, str]:
    """A thread of one graph turn and a side turn ("side note", "regret"), its copy crashed
    before its checkpoints, then `popped` of its last messages popped: the source and target
    ids."""
    source_id = await _a_thread_ending_in_a_side_turn(db)
    await _crashing_before_the_checkpoints(db, source_id, source_id + "-copy", monkeypatch)
    for _ in range(popped):
        await ConversationStore(db).pop_last_message(source_id)
    return source_id, source_id + "-copy"


@pytest.mark.parametrize("popped", [1, 2], ids=["a message of a turn it logged", "a whole turn"])
async def test_a_copy_longer_than_one_fork_run_again_after_a_crash_and_a_pop_copies_afresh(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, popped: int
) -> None:
    """LANGGRAPH.md `copy_thread`: a copy logged turn by turn (forced here, its turns of two
    messages at most), re-run after a crash once a pop removed from the source messages it
    copied (one of a turn it logged, or all of one), takes back its earlier attempt, untouched
    since, told by its turns whatever the source holds now, and copies the thread afresh."""
    from agent_store.integrations import _langgraph_transcript

    _forced_turn_by_turn(monkeypatch)
    monkeypatch.setattr(_langgraph_transcript, "MAX_MESSAGES_PER_TURN", 2)
    source_id, target_id = await _a_crashed_copy_of_a_thread_ending_in_a_side_turn(
        backend.db, monkeypatch, popped
    )

    await AgentStoreSaver(backend.db).acopy_thread(source_id, target_id)

    store = ConversationStore(backend.db)
    copied = [m.content for m in await store.transcript(target_id)]
    assert copied == [m.content for m in await store.transcript(source_id)]
    assert "regret" not in copied
    saver = AgentStoreSaver(backend.db)
    ours = [t.checkpoint["id"] async for t in saver.alist(thread("user-ada", target_id))]
    assert ours == [t.checkpoint["id"] async for t in saver.alist(thread("user-ada", source_id))]


@pytest.mark.parametrize("path", ["fork", "turn by turn"])
async def test_a_copy_run_again_keeps_a_turn_logged_into_its_target_as_it_took_it_back(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """LANGGRAPH.md `copy_thread`: the re-run takes back its earlier attempt only while
    nothing was written to it since it found it untouched (in the command that marks it
    deleted): a turn logged into the target right after that check stays, acknowledged, and
    the re-run is a Conflict."""
    from agent_store.integrations._langgraph_transcript import TranscriptLink

    if path == "turn by turn":
        _forced_turn_by_turn(monkeypatch)
    source_id, target_id = await _a_crashed_copy_of_a_thread_ending_in_a_side_turn(
        backend.db, monkeypatch, 1
    )
    looked = TranscriptLink._untouched_attempt
    note = [{"role": "user", "content": "mine, logged meanwhile"}]

    async def then_written(link: Any, *args: Any) -> bool:
        found = await looked(link, *args)
        logger = AgentMessageLogger(backend.db)
        await logger.log_messages(target_id, note, user_id="user-ada", turn_id="t-mine")
        return found

    monkeypatch.setattr(TranscriptLink, "_untouched_attempt", then_written)
    with pytest.raises(Conflict):
        await AgentStoreSaver(backend.db).acopy_thread(source_id, target_id)

    held = [m.content for m in await ConversationStore(backend.db).transcript(target_id)]
    assert held[-1] == "mine, logged meanwhile"
    assert await backend.db[CHECKPOINTS].count_documents({"thread_id": target_id}) == 0


async def test_a_copy_racing_a_pop_and_a_new_turn_inside_its_fork_copies_what_the_source_held(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANGGRAPH.md `copy_thread`: a pop of the source's last message and a new turn of three
    landing inside the store's fork (after its writes, before its check) make the fork be
    made again; the copy then forks again at what the source holds, so it is a state the
    source held (the new turn whole), never half of that turn."""
    config = thread("user-ada")
    saver = AgentStoreSaver(backend.db)
    await run_turns(tool_agent(saver), config, range(1, 3))
    source_id = config["configurable"]["thread_id"]
    logger = AgentMessageLogger(backend.db)
    side = [{"role": "user", "content": "side note"}, {"role": "assistant", "content": "regret"}]
    await logger.log_messages(source_id, side, user_id="user-ada", turn_id="t-side")
    forks, raced = saver._transcripts._logger, []
    check = forks._unless_its_source_went

    async def then_popped_and_logged(*args: Any, **kwargs: Any) -> Any:
        if not raced:
            raced.append(await ConversationStore(backend.db).pop_last_message(source_id))
            new = [
                {"role": "assistant", "content": "better"},
                {"role": "user", "content": "and more"},
                {"role": "assistant", "content": "the end"},
            ]
            await logger.log_messages(source_id, new, user_id="user-ada", turn_id="t-new")
        return await check(*args, **kwargs)

    monkeypatch.setattr(forks, "_unless_its_source_went", then_popped_and_logged)
    await saver.acopy_thread(source_id, source_id + "-copy")

    store = ConversationStore(backend.db)
    copied = [m.content for m in await store.transcript(source_id + "-copy")]
    assert copied == [m.content for m in await store.transcript(source_id)]
    assert copied[-3:] == ["better", "and more", "the end"]


def _messages_of(checkpoint: Any) -> list[Any]:
    return list(checkpoint["channel_values"].get("messages", []))


async def _a_thread_with_a_prompt(db: Any, config: dict[str, Any], params: Any) -> str:
    """A graph-run thread and a turn another writer logs into it: a call held back by a
    prompt (`r-pay`), its params `params`."""
    graph = tool_agent(AgentStoreSaver(db))
    await run_turns(graph, config, range(1, 2))
    thread_id: str = config["configurable"]["thread_id"]
    held = [
        {"role": "user", "content": "pay the invoice"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-pay",
                    "type": "function",
                    "function": {"name": "pay", "arguments": "{}"},
                }
            ],
        },
        {
            "role": "assistant",
            "content": "Shall I pay 120 EUR?",
            "hitl_action": {"action": "confirm", "request_id": "r-pay", "params": params},
        },
    ]
    await AgentMessageLogger(db).log_messages(thread_id, held, user_id="user-ada", turn_id="t-pay")
    return thread_id


async def test_a_copied_thread_keeps_the_prompts_the_person_answered(backend: Backend) -> None:
    """LANGGRAPH.md `copy_thread`: a fork, as the store's own fork is: a prompt the person
    answered before the copy is answered in the copy, and the call it released awaits its
    result there, not held again."""
    source_id = await _a_thread_with_a_prompt(backend.db, thread("user-ada"), {"eur": 120})
    store = ConversationStore(backend.db)
    await store.resolve_hitl(source_id, "r-pay", user_id="user-ada")
    target_id = source_id + "-copy"

    await AgentStoreSaver(backend.db).acopy_thread(source_id, target_id)

    assert await store.pending_hitl(target_id) is None
    calls = [(c.tool_call_id, c.request_id) for c in await store.pending_calls(target_id)]
    assert calls == [("call-pay", None)]
    assert calls == [(c.tool_call_id, c.request_id) for c in await store.pending_calls(source_id)]


async def test_a_copied_thread_copies_params_read_back_as_a_database_reference(
    wire_backend: Backend,
) -> None:
    """RUNTIMES.md, DESIGN.md: params stored holding a `$ref` beside an `$id` (before 0.2.0,
    or by another app) read back as the object; `copy_thread` copies them as they are, as
    the store's fork does (stored messages are copies, not new input)."""
    db = wire_backend.db
    source_id = await _a_thread_with_a_prompt(db, thread("user-ada"), {"eur": 120})
    schema = DBRef("#/$defs/city", "https://example.com/city.json", _extra={"$defs": {}})
    await db[MESSAGES].update_one(
        {"conversation_id": source_id, "hitl_action": {"$ne": None}},
        {"$set": {"hitl_action.params.schema": schema}},
    )
    store = ConversationStore(db)

    await AgentStoreSaver(db).acopy_thread(source_id, source_id + "-copy")

    def params(messages: list[Any]) -> list[Any]:
        return [m.hitl_action.params for m in messages if m.hitl_action is not None]

    copied = await store.transcript(source_id + "-copy")
    assert params(copied) == params(await store.transcript(source_id))
    assert params(copied)[0]["schema"]["$ref"] == "#/$defs/city"


async def test_a_thread_longer_than_one_fork_copies_turn_by_turn() -> None:
    """LANGGRAPH.md `copy_thread`: a thread past what one fork of the store copies (its
    `MAX_MESSAGES_PER_TURN`) is still copied, its source turns logged again. (Mongomock only:
    turns of 500 messages outlast the wire server's timeouts.)"""
    from agent_store.store import MAX_MESSAGES_PER_TURN
    from tests.api_harness import mongomock_db

    backend = Backend("mongomock", mongomock_db())
    config = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(backend.db)), config, range(1, 2))
    source_id = config["configurable"]["thread_id"]
    logger = AgentMessageLogger(backend.db)
    said = [{"role": "user", "content": f"note {i}"} for i in range(MAX_MESSAGES_PER_TURN)]
    for turn, half in enumerate((said[::2], said[1::2])):
        await logger.log_messages(source_id, half, user_id="user-ada", turn_id=f"t-{turn}")

    await AgentStoreSaver(backend.db).acopy_thread(source_id, source_id + "-copy")

    store = ConversationStore(backend.db)
    source, copied = await store.transcript(source_id), await store.transcript(source_id + "-copy")
    assert len(source) > MAX_MESSAGES_PER_TURN
    assert [m.content for m in copied] == [m.content for m in source]


async def test_a_copy_longer_than_one_fork_run_again_after_a_crash_converges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LANGGRAPH.md `copy_thread`: a conversation holding only this copy's turns is its
    earlier attempt, which a re-run finishes. (Mongomock only, as above.)"""
    from agent_store.store import MAX_MESSAGES_PER_TURN
    from tests.api_harness import mongomock_db

    db = mongomock_db()
    config = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(db)), config, range(1, 2))
    source_id = config["configurable"]["thread_id"]
    said = [{"role": "user", "content": f"note {i}"} for i in range(MAX_MESSAGES_PER_TURN)]
    await AgentMessageLogger(db).log_messages(source_id, said, user_id="user-ada", turn_id="t-0")
    await _crashing_before_the_checkpoints(db, source_id, source_id + "-copy", monkeypatch)

    await AgentStoreSaver(db).acopy_thread(source_id, source_id + "-copy")

    store = ConversationStore(db)
    source, copied = await store.transcript(source_id), await store.transcript(source_id + "-copy")
    assert [m.content for m in copied] == [m.content for m in source]
    kept = await db[CHECKPOINTS].count_documents({"thread_id": source_id + "-copy"})
    assert kept == await db[CHECKPOINTS].count_documents({"thread_id": source_id})


async def test_deleting_a_thread_deletes_its_conversation_and_everything_kept_for_it(
    backend: Backend,
) -> None:
    config = thread()
    saver = AgentStoreSaver(backend.db)
    await run_turns(tool_agent(saver), config, range(1, 3))
    await saver.adelete_thread(config["configurable"]["thread_id"])
    assert await _counts(backend.db) == (0, 0, 0)
    with pytest.raises(NotFound):
        await ConversationStore(backend.db).get_conversation(config["configurable"]["thread_id"])
    assert await saver.aget_tuple(config) is None


async def test_pruning_keeps_the_conversation_and_the_latest_state(backend: Backend) -> None:
    config = thread()
    graph = tool_agent(AgentStoreSaver(backend.db))
    await run_turns(graph, config, range(1, 4))
    state = (await graph.aget_state(config)).values
    await AgentStoreSaver(backend.db).aprune([config["configurable"]["thread_id"]])
    assert [t async for t in AgentStoreSaver(backend.db).alist(config)] == [
        await AgentStoreSaver(backend.db).aget_tuple(config)
    ]
    cold = tool_agent(AgentStoreSaver(backend.db))
    assert (await cold.aget_state(config)).values == state
    await run_turns(cold, config, range(4, 5))
    transcript = await ConversationStore(backend.db).transcript(config["configurable"]["thread_id"])
    # The even turn 4 adds a question, a tool call, its result and the answer.
    assert len(transcript) == len(state["messages"]) + 4


async def test_deleting_a_runs_checkpoints_keeps_what_later_checkpoints_refer_to(
    backend: Backend,
) -> None:
    config = thread()
    graph = tool_agent(AgentStoreSaver(backend.db))
    for turn in (1, 2):
        run = {"configurable": config["configurable"] | {"run_id": f"run-{turn}"}}
        await run_turns(graph, run, range(turn, turn + 1))
    state = (await graph.aget_state(config)).values
    await AgentStoreSaver(backend.db).adelete_for_runs(["run-1"])
    cold = AgentStoreSaver(backend.db)
    assert {t.metadata["run_id"] async for t in cold.alist(config)} == {"run-2"}
    assert (await tool_agent(cold).aget_state(config)).values == state
    transcript = await ConversationStore(backend.db).transcript(config["configurable"]["thread_id"])
    assert len(transcript) == len(state["messages"])


# -- the synchronous API ---------------------------------------------------------------------


async def test_invoke_runs_the_graph_through_the_synchronous_methods(backend: Backend) -> None:
    config = thread()
    graph = tool_agent(AgentStoreSaver(backend.db))
    await asyncio.to_thread(lambda: [graph.invoke(question(t), config) for t in (1, 2)])
    reference = tool_agent(InMemorySaver())
    await run_turns(reference, config, range(1, 3))
    ours = await asyncio.to_thread(graph.get_state, config)
    assert comparable(ours.values["messages"]) == comparable(
        (await reference.aget_state(config)).values["messages"]
    )
    with pytest.raises(asyncio.InvalidStateError, match="use the async methods"):
        graph.get_state(config)


def test_a_saver_made_outside_any_event_loop_runs_a_synchronous_graph() -> None:
    from tests.api_harness import mongomock_db

    config = thread()
    graph = tool_agent(AgentStoreSaver(mongomock_db()))
    for turn in (1, 2):
        graph.invoke(question(turn), config)
    assert len(graph.get_state(config).values["messages"]) == 6


@contextlib.contextmanager
def made_outside_any_loop(uri: str, driver: str) -> Iterator[Any]:
    """A database on a client a synchronous program holds: made outside any event loop, used
    by its savers' synchronous methods, dropped and closed by them at the end."""
    if driver == "motor":
        from motor.motor_asyncio import AsyncIOMotorClient

        client: Any = AsyncIOMotorClient(uri, tz_aware=True)
    else:
        client = AsyncMongoClient(uri, tz_aware=True)
    name = f"sync_{uuid.uuid4().hex[:10]}"

    async def close() -> None:
        await client.drop_database(name)
        closed = client.close()
        if asyncio.iscoroutine(closed):
            await closed

    try:
        yield client[name]
    finally:
        AgentStoreSaver(client[name])._run(close())


@pytest.mark.parametrize("driver", ["pymongo", "motor"])
def test_two_savers_on_one_database_run_their_graphs_in_a_synchronous_program(
    wire_uri: str, driver: str
) -> None:
    with made_outside_any_loop(wire_uri, driver) as db:
        chat, summarizer = tool_agent(AgentStoreSaver(db)), tool_agent(AgentStoreSaver(db))
        for graph in (chat, summarizer, chat):
            config = thread()
            graph.invoke(question(2), config)
            assert len(graph.get_state(config).values["messages"]) == 4


def test_a_saver_and_its_allowlist_clone_run_their_graphs_in_a_synchronous_program(
    wire_uri: str,
) -> None:
    # LangGraph's strict msgpack gives each compiled graph such a clone of the one saver.
    with made_outside_any_loop(wire_uri, "pymongo") as db:
        saver = AgentStoreSaver(db, serde=JsonPlusSerializer(allowed_msgpack_modules=None))
        clone = saver.with_allowlist([("tests", "Prefs")])
        assert clone is not saver
        for graph in (tool_agent(saver), tool_agent(clone)):
            config = thread()
            graph.invoke(question(2), config)
            assert len(graph.get_state(config).values["messages"]) == 4


def test_a_synchronous_call_on_a_saver_whose_loop_is_not_running_raises_at_once() -> None:
    from tests.api_harness import mongomock_db

    loop = asyncio.new_event_loop()
    graph = tool_agent(AgentStoreSaver(mongomock_db(), loop=loop))
    raised: list[BaseException] = []

    def invoke() -> None:
        try:
            graph.invoke(question(1), thread())
        except BaseException as exc:
            raised.append(exc)

    caller = threading.Thread(target=invoke, daemon=True)
    caller.start()
    caller.join(timeout=10)
    loop.close()
    assert not caller.is_alive(), "the synchronous call waited on a loop that does not run"
    assert len(raised) == 1
    assert isinstance(raised[0], asyncio.InvalidStateError)
    assert "not running" in str(raised[0])


# -- bad input -------------------------------------------------------------------------------


async def test_a_thread_id_that_is_no_conversation_id_is_refused_before_anything_is_written(
    backend: Backend,
) -> None:
    graph = tool_agent(AgentStoreSaver(backend.db))
    with pytest.raises(InvalidInput, match="thread_id"):
        await graph.ainvoke(question(1), {"configurable": {"thread_id": "has spaces"}})
    assert await _counts(backend.db) == (0, 0, 0)


def test_a_saver_on_a_synchronous_pymongo_database_is_refused_before_anything_is_written(
    database: Any,
) -> None:
    from tests.api_harness import mongomock_db

    with pytest.raises(TypeError, match="AsyncMongoClient"):
        AgentStoreSaver(database)
    with pytest.raises(TypeError, match="AsyncMongoClient"):
        AgentStoreSaver(database, logger=AgentMessageLogger(mongomock_db()))
    assert database.list_collection_names() == []


def test_a_saver_on_a_client_is_refused_saying_to_pass_a_database(client: Any) -> None:
    with pytest.raises(TypeError, match=re.escape("pass a database, client[name]")):
        AgentStoreSaver(client)


async def test_metadata_a_document_cannot_hold_is_refused_before_the_messages_are_logged(
    backend: Backend,
) -> None:
    saver = AgentStoreSaver(backend.db)
    config = thread()
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = {"messages": [HumanMessage("hi", id="h1")]}
    with pytest.raises(InvalidInput, match=r"metadata key \$where:"):
        await saver.aput(config, checkpoint, {"$where": "1"}, {})  # type: ignore[typeddict-unknown-key]
    assert await _counts(backend.db) == (0, 0, 0)


async def test_a_list_filter_with_an_operator_is_refused(backend: Backend) -> None:
    saver = AgentStoreSaver(backend.db)
    for bad in ({"$where": "1"}, {"source": {"$ne": "x"}}, {"a.b": 1}):
        with pytest.raises(InvalidInput, match="invalid filter key"):
            [t async for t in saver.alist(thread(), filter=bad)]


async def test_a_step_rerun_after_a_crash_before_its_checkpoint_stores_its_messages_once(
    backend: Backend,
) -> None:
    config = thread()
    saver = AgentStoreSaver(backend.db)
    graph = tool_agent(saver)
    await run_turns(graph, config, range(1, 2))
    checkpoints = saver._checkpoints
    writes: list[str] = []

    class CrashOnTheSecondCheckpoint:
        def __getattr__(self, name: str) -> Any:
            return getattr(checkpoints, name)

        async def update_one(self, query: Any, update: Any, **kwargs: Any) -> Any:
            if "$set" in update:
                writes.append(update["$set"]["checkpoint_id"])
                if len(writes) == 2:  # the step that logs the question: messages stored first
                    raise StorageUnavailable("the process died here")
            return await checkpoints.update_one(query, update, **kwargs)

    saver._checkpoints = CrashOnTheSecondCheckpoint()
    with pytest.raises(StorageUnavailable):
        await graph.ainvoke(question(2), config)
    saver._checkpoints = checkpoints
    resumed = tool_agent(AgentStoreSaver(backend.db))  # a new process picks the thread up
    await resumed.ainvoke(None, config)

    state = (await resumed.aget_state(config)).values["messages"]
    reference = tool_agent(InMemorySaver())
    await run_turns(reference, config, range(1, 3))
    assert comparable(state) == comparable((await reference.aget_state(config)).values["messages"])
    transcript = await ConversationStore(backend.db).transcript(config["configurable"]["thread_id"])
    assert [m.content for m in transcript] == [m.content or None for m in state]


async def test_a_saver_with_a_wider_allowlist_shares_the_threads_and_the_cache(
    backend: Backend,
) -> None:
    config = thread()
    # Strict msgpack: only the types LangGraph deems safe (LangChain messages among them).
    saver = AgentStoreSaver(backend.db, serde=JsonPlusSerializer(allowed_msgpack_modules=None))
    wider = saver.with_allowlist([("tests.test_langgraph_saver", "Anything")])
    assert isinstance(wider, AgentStoreSaver)
    assert wider.serde is not saver.serde
    await run_turns(tool_agent(wider), config, range(1, 3))
    assert (await tool_agent(saver).aget_state(config)).values == (
        await tool_agent(wider).aget_state(config)
    ).values


@pytest.mark.wire
async def test_the_integers_the_checkpointer_computes_are_stored_as_int64(
    wire_backend: Backend,
) -> None:
    """`seq` ranges, write indexes and the `seq` of extras, copied threads included."""
    from bson import Int64

    source = thread("user-ada")
    saver = AgentStoreSaver(wire_backend.db)
    await run_turns(tool_agent(saver), source, range(1, 3))
    await saver.acopy_thread(source["configurable"]["thread_id"], "thread-copied")

    widths: list[tuple[str, type]] = []
    for doc in await wire_backend.db[CHECKPOINTS].find().to_list(None):
        for segment in (doc.get("messages") or {}).get("segments", ()):
            widths += [("from", type(segment["from"])), ("to", type(segment["to"]))]
        widths += [("idx", type(w["idx"])) for w in doc.get("writes", ())]
        widths += [("seq", type(e["seq"])) for e in doc.get("extras", ())]
    assert {name for name, _ in widths} >= {"from", "to", "idx", "seq"}
    assert {kind for _, kind in widths} == {Int64}


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param({"$<script>x</script>": 1}, id="dollar-key"),
        pytest.param({"a": {"<img onerror=x>": {"$where": 1}}}, id="nested-under-markup"),
        pytest.param({"a": [{"\x00\u202e" * 500: 1}]}, id="nul-in-a-list"),
    ],
)
def test_a_refused_checkpoint_metadata_key_is_shown_as_key(metadata: dict[str, Any]) -> None:
    """Keys that are no plain names are never repeated back, as in every other refusal."""
    with pytest.raises(InvalidInput) as refused:
        check_metadata_keys(metadata)
    assert "<key>" in str(refused.value)
    assert not [s for s in ("<script>", "<img", "\x00", "\u202e") if s in str(refused.value)]


@pytest.mark.parametrize("key", ["$<where>", "a.<script>", "<b>.x"])
def test_a_refused_filter_key_is_shown_as_key(key: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        metadata_filter({key: 1})
    assert "<key>" in str(refused.value)
    assert "<script>" not in str(refused.value)
    assert "<b>" not in str(refused.value)


async def test_a_thread_its_user_starts_while_the_erasure_runs_keeps_its_checkpoints(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md: a conversation the user starts while the erasure runs keeps its turns; its
    graph state too, which the erasure's last sweep of checkpoints naming the user leaves
    (was: every checkpoint gone, the graph answering from an empty state while the transcript
    held every turn)."""
    ada, old = thread("user-ada", "conv-new"), thread("user-ada", "conv-old")
    await tool_agent(AgentStoreSaver(backend.db)).ainvoke(question(1), old)
    store = ConversationStore(backend.db)
    strays = store._erase_strays

    async def new_thread_then_strays(user_id: str) -> int:
        await tool_agent(AgentStoreSaver(backend.db)).ainvoke(question(2), ada)
        return await strays(user_id)

    monkeypatch.setattr(store, "_erase_strays", new_thread_then_strays)

    await store.erase_user("user-ada")

    state = (await tool_agent(AgentStoreSaver(backend.db)).aget_state(ada)).values
    transcript = await store.transcript("conv-new", user_id="user-ada")
    assert len(state["messages"]) == len(transcript) > 0
    assert await backend.db[CHECKPOINTS].count_documents({"thread_id": "conv-old"}) == 0


async def _bobs_graph_reads_the_copy_as_the_source(db: Any, source_id: str) -> None:
    """user-bob's graph reads the copy of the source thread with the source's messages."""
    graph = tool_agent(AgentStoreSaver(db))
    source = await graph.aget_state(thread("user-bob", source_id))
    copied = await graph.aget_state(thread("user-bob", source_id + "-copy"))
    said = [m.content for m in source.values["messages"]]
    assert said
    assert [m.content for m in copied.values.get("messages", [])] == said


class _Count(TypedDict):
    count: Annotated[int, operator.add]


def _counter(saver: Any) -> Any:
    """A graph without a messages channel: its thread's conversation holds no message."""
    builder = StateGraph(_Count)
    builder.add_node("inc", lambda state: {"count": 1})
    builder.add_edge(START, "inc")
    builder.add_edge("inc", END)
    return builder.compile(checkpointer=saver)


@pytest.mark.parametrize("made", ["before", "after"])
async def test_a_copy_into_another_thread_of_its_user_holding_no_message_is_a_conflict(
    backend: Backend, made: str
) -> None:
    """LANGGRAPH.md `copy_thread`: a target that exists already is a Conflict before anything
    is written, unless it is this copy's earlier attempt; an empty conversation with
    checkpoints of its own thread (a graph without messages) is none (was: the copy logged
    the source into it and its state was lost)."""
    db = backend.db
    source, target = thread("user-ada"), thread("user-ada")
    target_id = target["configurable"]["thread_id"]
    if made == "before":
        await _counter(AgentStoreSaver(db)).ainvoke({"count": 5}, target)
    await tool_agent(AgentStoreSaver(db)).ainvoke(question(1), source)
    if made == "after":
        await _counter(AgentStoreSaver(db)).ainvoke({"count": 5}, target)
    checkpoints = await db[CHECKPOINTS].count_documents({"thread_id": target_id})
    state = (await _counter(AgentStoreSaver(db)).aget_state(target)).values

    with pytest.raises(Conflict, match="is no copy of thread"):
        await AgentStoreSaver(db).acopy_thread(source["configurable"]["thread_id"], target_id)

    assert (await _counter(AgentStoreSaver(db)).aget_state(target)).values == state
    assert await db[CHECKPOINTS].count_documents({"thread_id": target_id}) == checkpoints
    assert await ConversationStore(db).transcript(target_id) == []


async def test_a_copy_of_a_thread_without_messages_run_again_converges(backend: Backend) -> None:
    """LANGGRAPH.md `copy_thread`: re-running a copy converges. A graph without a messages
    channel leaves its copy's conversation empty: the checkpoints the target holds are the
    source's own, copied, so it is the copy's earlier attempt, not another thread (was: a
    Conflict on every re-run)."""
    db = backend.db
    source, target = thread("user-ada"), thread("user-ada")
    source_id, target_id = (t["configurable"]["thread_id"] for t in (source, target))
    await _counter(AgentStoreSaver(db)).ainvoke({"count": 5}, source)

    for _ in range(2):
        await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    state = await _counter(AgentStoreSaver(db)).aget_state(target)
    assert state.values == {"count": 6}
    ids = await db[CHECKPOINTS].distinct("checkpoint_id", {"thread_id": source_id})
    assert sorted(await db[CHECKPOINTS].distinct("checkpoint_id", {"thread_id": target_id})) == (
        sorted(ids)
    )


async def test_a_copy_into_an_empty_chat_its_user_named_is_a_conflict(backend: Backend) -> None:
    """LANGGRAPH.md `copy_thread`: an empty conversation someone named is no earlier attempt
    of the copy (which never names its target): Conflict, nothing written."""
    source = thread("user-ada")
    await tool_agent(AgentStoreSaver(backend.db)).ainvoke(question(1), source)
    logger = AgentMessageLogger(backend.db)
    await logger.upsert_conversation("my-plans", user_id="user-ada", name="My plans")

    with pytest.raises(Conflict, match="is no copy of thread"):
        await AgentStoreSaver(backend.db).acopy_thread(
            source["configurable"]["thread_id"], "my-plans"
        )

    assert await ConversationStore(backend.db).transcript("my-plans") == []


async def _written_to_while_copied(db: Any, target_id: str, writer: str) -> None:
    """A write into a copy's target while the copy is made: a turn, a pop of its last
    message and a turn in its place, or the user's graph run on the target's thread."""
    logger, store = AgentMessageLogger(db), ConversationStore(db)
    if writer == "a graph run":
        await tool_agent(AgentStoreSaver(db)).ainvoke(question(9), thread("user-ada", target_id))
        return
    if writer == "a pop and a turn":
        await store.pop_last_message(target_id)
    said = [{"role": "assistant", "content": "someone else's answer"}]
    await logger.log_messages(target_id, said, user_id="user-ada", turn_id="t-mine")


@pytest.mark.parametrize("writer", ["a turn", "a pop and a turn", "a graph run"])
@pytest.mark.parametrize("path", ["fork", "turn by turn"])
async def test_a_copy_whose_target_is_written_to_while_it_is_made_is_a_conflict(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, path: str, writer: str
) -> None:
    """LANGGRAPH.md `copy_thread`: the copy is a state the source held; a target written to
    while the copy is made (before its checkpoints are in) is kept as it is, without the
    copy's checkpoints, and the copy is a Conflict (was: success, the graph reading messages
    the source never held)."""
    from agent_store.integrations import _langgraph_transcript
    from agent_store.integrations._langgraph_transcript import TranscriptLink

    if path == "turn by turn":
        _forced_turn_by_turn(monkeypatch)
        monkeypatch.setattr(_langgraph_transcript, "MAX_MESSAGES_PER_TURN", 2)
    db = backend.db
    source = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(db)), source, range(1, 3))
    source_id = source["configurable"]["thread_id"]
    target_id = source_id + "-copy"
    copied = TranscriptLink._logged_once if path == "turn by turn" else TranscriptLink._forked

    async def then_written(link: Any, *args: Any, **kwargs: Any) -> Any:
        made = await copied(link, *args, **kwargs)
        await _written_to_while_copied(db, target_id, writer)
        return made

    monkeypatch.setattr(TranscriptLink, copied.__name__, then_written)

    with pytest.raises(Conflict, match="written to while this copy was made"):
        await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    kept = [m.content for m in await ConversationStore(db).transcript(target_id)]
    assert writer == "a graph run" or "someone else's answer" in kept
    ids = await db[CHECKPOINTS].distinct("checkpoint_id", {"thread_id": source_id})
    left = await db[CHECKPOINTS].distinct("checkpoint_id", {"thread_id": target_id})
    assert not set(ids) & set(left)
    assert bool(left) == (writer == "a graph run")


@pytest.mark.parametrize("window", ["a delete of the copy", "an erasure of its user"])
async def test_a_copy_never_takes_a_conversation_started_under_its_target_after_its_fork(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, window: str
) -> None:
    """LANGGRAPH.md `copy_thread`: a copy acts only on the life of the target its fork
    created. That fork deleted (its user erased) and another user's chat started under the
    id, with as many messages, before the copy goes on: NotFound, her chat kept as she wrote
    it, no checkpoint of the copy in it (was: the copy's checkpoints in her thread, named
    hers; or her chat deleted as the copy's take-back)."""
    db = backend.db
    source = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(db)), source, range(1, 3))
    source_id = source["configurable"]["thread_id"]
    target_id = source_id + "-copy"
    store = ConversationStore(db)
    count = len(await store.messages_by_seq(source_id))
    grace = [{"role": "user", "content": f"grace's own {i}"} for i in range(count)]
    fork = AgentMessageLogger.fork

    async def then_replaced(logger: Any, source_id: str, at_seq: int, new_id: str) -> Any:
        made = await fork(logger, source_id, at_seq, new_id)
        if window == "a delete of the copy":
            await store.delete(new_id)
        else:
            await store.erase_user("user-ada")
        await AgentMessageLogger(db).log_messages(new_id, grace, user_id="user-grace")
        return made

    monkeypatch.setattr(AgentMessageLogger, "fork", then_replaced)
    with pytest.raises(NotFound):
        await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    hers = await store.get_conversation(target_id)
    assert hers.user_id == "user-grace"
    assert [m.content for m in await store.transcript(target_id)] == [m["content"] for m in grace]
    assert await db[CHECKPOINTS].count_documents({"thread_id": target_id}) == 0


@pytest.mark.parametrize("path", ["fork", "turn by turn"])
async def test_a_copy_taken_back_after_a_pop_keeps_a_turn_logged_into_its_target_meanwhile(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """LANGGRAPH.md `copy_thread`: a copy takes back only what is unchanged since its own last
    write. A turn logged into the target once the copies are in, and a pop of the source
    landing too: the turn stays as acknowledged, and the copy is a Conflict naming the target
    (was: the target deleted with the turn, the copy made afresh, a success)."""
    from agent_store.integrations._langgraph_transcript import TranscriptLink

    if path == "turn by turn":
        _forced_turn_by_turn(monkeypatch)
    db = backend.db
    source_id = await _a_thread_ending_in_a_side_turn(db)
    target_id = source_id + "-copy"
    mine = [{"role": "user", "content": "my own note in the copy"}]
    popped_since, written = TranscriptLink._popped_since, []

    async def written_and_popped(link: Any, source: Any, end: int) -> Any:
        if not written:
            written.append(True)
            await AgentMessageLogger(db).log_messages(target_id, mine, user_id="user-ada")
            await ConversationStore(db).pop_last_message(source_id)
        return await popped_since(link, source, end)

    monkeypatch.setattr(TranscriptLink, "_popped_since", written_and_popped)
    with pytest.raises(Conflict, match=re.escape(repr(target_id))):
        await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    kept = [m.content for m in await ConversationStore(db).transcript(target_id)]
    assert kept[-1] == "my own note in the copy"


@pytest.mark.parametrize("longer", [False, True])
async def test_a_copy_into_a_fork_of_an_earlier_life_of_its_source_is_a_conflict(
    backend: Backend, longer: bool
) -> None:
    """LANGGRAPH.md `copy_thread`: an earlier attempt is a fork of this source's life. A fork
    the user made of her thread before she deleted it and ran her graph on its id again is
    another conversation: a Conflict, the fork kept as it is (was: deleted, the only copy of
    the deleted thread, and the new thread copied in its place)."""
    db = backend.db
    source = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(db)), source, range(1, 3))
    source_id = source["configurable"]["thread_id"]
    target_id = source_id + "-fork"
    store = ConversationStore(db)
    last = (await store.messages_by_seq(source_id))[-1].seq
    assert last is not None
    await AgentMessageLogger(db).fork(source_id, last, target_id, user_id="user-ada")
    kept = [m.content for m in await store.transcript(target_id)]
    await AgentStoreSaver(db).adelete_thread(source_id)
    await run_turns(tool_agent(AgentStoreSaver(db)), source, range(7, 10 if longer else 9))

    with pytest.raises(Conflict, match="no copy of thread"):
        await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    assert [m.content for m in await store.transcript(target_id)] == kept


async def test_a_copy_into_a_fork_of_an_earlier_life_of_a_copied_thread_is_a_conflict(
    backend: Backend,
) -> None:
    """LANGGRAPH.md `copy_thread`: a fork is of this life of the source only by the source's
    `version` the fork recorded (`forked_from.version`), never by a time: copies keep their
    source's times, so two lives of a thread copied from one thread start alike. A fork of
    such a thread, deleted and copied again under its id, is a `Conflict`, the fork kept as
    it is (was: taken for the copy's attempt, deleted, and the new life copied in its place)."""
    db, store, saver = backend.db, ConversationStore(backend.db), AgentStoreSaver(backend.db)
    origin = await _a_thread_ending_in_a_side_turn(db)
    source_id, target_id = origin + "-copied", origin + "-fork"
    await saver.acopy_thread(origin, source_id)
    last = (await store.messages_by_seq(source_id))[-1].seq
    assert last is not None
    await AgentMessageLogger(db).fork(source_id, last, target_id, user_id="user-ada")
    kept = [m.content for m in await store.transcript(target_id)]
    await saver.adelete_thread(source_id)
    await store.pop_last_message(origin)
    other = [{"role": "assistant", "content": "another answer"}]
    await AgentMessageLogger(db).log_messages(origin, other, user_id="user-ada", turn_id="t-2")
    await saver.acopy_thread(origin, source_id)

    with pytest.raises(Conflict, match="no copy of thread"):
        await saver.acopy_thread(source_id, target_id)

    assert [m.content for m in await store.transcript(target_id)] == kept
    assert kept[-1] == "regret"
    assert await db[CHECKPOINTS].count_documents({"thread_id": target_id}) == 0


@pytest.mark.parametrize("owner", ["user-ada", "user-grace"])
async def test_a_copy_crashed_inside_its_fork_runs_again_once_its_source_started_again(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, owner: str
) -> None:
    """LANGGRAPH.md `copy_thread`: a fork not made yet of an earlier life of the source is no
    attempt of this copy: once the thread was deleted and run again under its id, the re-run
    copies the thread as it stands, at the first call (was: NotFound, "deleted while the fork
    copied it", though the source stands)."""
    db = backend.db
    source_id = str(thread()["configurable"]["thread_id"])
    target_id = source_id + "-copy"
    await run_turns(tool_agent(AgentStoreSaver(db)), thread("user-ada", source_id), range(1, 3))

    async def died(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("the process died")

    with monkeypatch.context() as patched:
        patched.setattr(AgentMessageLogger, "_unless_its_source_went", died)
        with pytest.raises(ConnectionError):
            await AgentStoreSaver(db).acopy_thread(source_id, target_id)
    await AgentStoreSaver(db).adelete_thread(source_id)
    await run_turns(tool_agent(AgentStoreSaver(db)), thread(owner, source_id), range(7, 9))

    await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    store = ConversationStore(db)
    assert (await store.get_conversation(target_id)).user_id == owner
    copied = [m.content for m in await store.transcript(target_id)]
    assert copied == [m.content for m in await store.transcript(source_id)]


async def test_a_copy_logged_turn_by_turn_waits_for_a_source_turn_still_being_written(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANGGRAPH.md `copy_thread`: a copy logged turn by turn refuses a source turn still
    being written as the store's fork does: StorageUnavailable, nothing written; once it
    landed, the copy holds it (was: a success holding the turn logged after it, without it)."""
    _forced_turn_by_turn(monkeypatch)
    db = backend.db
    source = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(db)), source, range(1, 3))
    source_id = source["configurable"]["thread_id"]
    target_id = source_id + "-copy"
    reached, release, stored = asyncio.Event(), asyncio.Event(), AgentMessageLogger._store

    async def slow(logger: Any, plan: Any, *args: Any) -> Any:
        if plan.turn_id == "t-slow":
            reached.set()
            await release.wait()
        return await stored(logger, plan, *args)

    monkeypatch.setattr(AgentMessageLogger, "_store", slow)
    logger = AgentMessageLogger(db)
    earlier = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "e"}]
    slow_turn = asyncio.create_task(
        logger.log_messages(source_id, earlier, user_id="user-ada", turn_id="t-slow")
    )
    await reached.wait()
    later = [{"role": "user", "content": "later"}, {"role": "assistant", "content": "l"}]
    await logger.log_messages(source_id, later, user_id="user-ada", turn_id="t-fast")

    with pytest.raises(StorageUnavailable, match="still being written"):
        await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    store = ConversationStore(db)
    with pytest.raises(NotFound):
        await store.get_conversation(target_id, fallback=False)
    release.set()
    await slow_turn
    await AgentStoreSaver(db).acopy_thread(source_id, target_id)
    copied = [m.content for m in await store.transcript(target_id)]
    assert copied == [m.content for m in await store.transcript(source_id)]


async def test_a_copy_into_an_empty_target_another_threads_copy_created_is_a_conflict(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANGGRAPH.md `copy_thread`: an empty target is a copy's earlier attempt only when it
    names this source's life. One a copy of another thread of the user created (it died, or
    is still logging) is a Conflict, nothing written into it (was: taken for the second
    copy's own, its thread's turns logged into the first copy); the first copy's re-run
    finishes it."""
    from agent_store.integrations._langgraph_transcript import TranscriptLink

    _forced_turn_by_turn(monkeypatch)
    db = backend.db
    first, second = thread("user-ada"), thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(db)), first, range(1, 3))
    await run_turns(tool_agent(AgentStoreSaver(db)), second, range(5, 7))
    first_id, second_id = first["configurable"]["thread_id"], second["configurable"]["thread_id"]
    target_id = first_id + "-copy"
    created = TranscriptLink._created_target

    async def created_then_died(link: Any, *args: Any) -> Any:
        await created(link, *args)
        raise ConnectionError("the process died")

    with monkeypatch.context() as patched:
        patched.setattr(TranscriptLink, "_created_target", created_then_died)
        with pytest.raises(ConnectionError):
            await AgentStoreSaver(db).acopy_thread(first_id, target_id)

    with pytest.raises(Conflict, match="no copy of thread"):
        await AgentStoreSaver(db).acopy_thread(second_id, target_id)
    store = ConversationStore(db)
    assert await store.transcript(target_id) == []

    await AgentStoreSaver(db).acopy_thread(first_id, target_id)
    copied = [m.content for m in await store.transcript(target_id)]
    assert copied == [m.content for m in await store.transcript(first_id)]


async def test_a_copy_of_a_thread_without_messages_whose_target_a_graph_runs_on_is_a_conflict(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANGGRAPH.md `copy_thread`: a target written to while the copy is made is kept as it
    is, the copy a Conflict; for a graph without a messages channel too, whose run writes
    checkpoints only (was: a success, the source's state mixed into the target's history)."""
    from agent_store.integrations._langgraph_transcript import TranscriptLink

    db = backend.db
    source = thread("user-ada")
    for _ in range(3):
        await _counter(AgentStoreSaver(db)).ainvoke({"count": 10}, source)
    source_id = source["configurable"]["thread_id"]
    target_id = source_id + "-copy"
    target, logged = thread("user-ada", target_id), TranscriptLink._logged

    async def then_run_on_the_target(link: Any, *args: Any) -> Any:
        made = await logged(link, *args)
        await _counter(AgentStoreSaver(db)).ainvoke({"count": 1000}, target)
        return made

    monkeypatch.setattr(TranscriptLink, "_logged", then_run_on_the_target)
    with pytest.raises(Conflict, match="written to while this copy was made"):
        await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    state = await _counter(AgentStoreSaver(db)).aget_state(target)
    assert state.values == {"count": 1001}
    ids = await db[CHECKPOINTS].distinct("checkpoint_id", {"thread_id": source_id})
    left = await db[CHECKPOINTS].distinct("checkpoint_id", {"thread_id": target_id})
    assert left
    assert not set(ids) & set(left)


async def _a_finished_copy_popped_in_its_target(db: Any) -> tuple[str, str]:
    """A thread of two graph turns and a side turn, copied, then the copy's side answer
    popped in the target (no checkpoint refers to it): the source and target ids."""
    source = thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(db)), source, range(1, 3))
    source_id = source["configurable"]["thread_id"]
    side = [{"role": "user", "content": "side note"}, {"role": "assistant", "content": "regret"}]
    await AgentMessageLogger(db).log_messages(source_id, side, user_id="user-ada", turn_id="t-side")
    await AgentStoreSaver(db).acopy_thread(source_id, source_id + "-copy")
    await ConversationStore(db).pop_last_message(source_id + "-copy")
    return source_id, source_id + "-copy"


async def _a_copy_crashed_once_its_checkpoints_were_in(
    db: Any, monkeypatch: pytest.MonkeyPatch, popped: int
) -> tuple[str, str]:
    """A thread of two graph turns and a side turn, its copy crashed once its checkpoints
    were copied, then `popped` of the source's last messages popped: the source and target
    ids."""
    source_id = await _a_thread_ending_in_a_side_turn(db)
    where = (AgentStoreSaver, "_follow_the_target")
    await _a_copy_dying_in(db, source_id, source_id + "-copy", monkeypatch, where)
    for _ in range(popped):
        await ConversationStore(db).pop_last_message(source_id)
    return source_id, source_id + "-copy"


@pytest.mark.parametrize(
    "since",
    [
        "a pop in the finished copy",
        "a crash, then a pop of a message",
        "a crash, then a pop of a turn",
    ],
)
async def test_a_copy_run_again_into_its_attempt_written_to_since_keeps_it_and_is_a_conflict(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, since: str
) -> None:
    """LANGGRAPH.md `copy_thread`: a re-run deletes nothing but its own untouched attempt; one
    into an attempt written to since, or whose source went on past it, keeps the target as it
    is and is a Conflict naming it, not an internal turn (was: the target deleted, checkpoints
    and all, or kept holding messages the source no longer holds)."""
    from agent_store.integrations import _langgraph_transcript

    _forced_turn_by_turn(monkeypatch)
    monkeypatch.setattr(_langgraph_transcript, "MAX_MESSAGES_PER_TURN", 2)
    db = backend.db
    if since == "a pop in the finished copy":
        source_id, target_id = await _a_finished_copy_popped_in_its_target(db)
    else:
        popped = 1 if since.endswith("message") else 2
        source_id, target_id = await _a_copy_crashed_once_its_checkpoints_were_in(
            db, monkeypatch, popped
        )
    store = ConversationStore(db)
    held = [m.content for m in await store.transcript(target_id)]
    checkpoints = await db[CHECKPOINTS].count_documents({"thread_id": target_id})

    with pytest.raises(Conflict, match=re.escape(repr(target_id))) as refused:
        await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    assert "fork-" not in str(refused.value)
    assert [m.content for m in await store.transcript(target_id)] == held
    assert await db[CHECKPOINTS].count_documents({"thread_id": target_id}) == checkpoints


@pytest.mark.parametrize("where", ["_unless_its_source_went", "_store"])
async def test_a_copy_crashed_inside_its_fork_runs_again_after_its_source_went_on(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """LANGGRAPH.md `copy_thread`: re-running it after a crash inside the store's fork (a fork
    not made yet) converges once the source thread went on too: the fork is made again at its
    `forked_from.seq` (was: every re-run a Conflict, the target hidden)."""
    db = backend.db
    source = thread("user-ada")
    graph = tool_agent(AgentStoreSaver(db))
    await run_turns(graph, source, range(1, 3))
    source_id = source["configurable"]["thread_id"]
    store = ConversationStore(db)
    said = [m.content for m in await store.transcript(source_id)]

    async def died(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("the process died")

    with monkeypatch.context() as patched:
        patched.setattr(AgentMessageLogger, where, died)
        with pytest.raises(ConnectionError):
            await AgentStoreSaver(db).acopy_thread(source_id, source_id + "-copy")
    await graph.ainvoke(question(3), source)

    await AgentStoreSaver(db).acopy_thread(source_id, source_id + "-copy")

    assert [m.content for m in await store.transcript(source_id + "-copy")] == said
    copied = await graph.aget_state(thread("user-ada", source_id + "-copy"))
    assert len(copied.values["messages"]) >= len(said)


@pytest.mark.parametrize("path", ["fork", "turn by turn"])
async def test_a_copy_whose_take_back_was_cut_short_is_being_deleted_until_the_id_is_deleted(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """LANGGRAPH.md `copy_thread`: a re-run that died part-way through taking back its earlier
    attempt (its delete marked, not done) leaves the id being deleted: the next re-run is
    BeingDeleted, and never finishes a delete itself, which may be another user's (a copy did
    so, and deleted the conversation she started under the id since). Once the id is
    deleted, the copy is made afresh."""
    from agent_store.integrations import _langgraph_transcript

    if path == "turn by turn":
        _forced_turn_by_turn(monkeypatch)
        monkeypatch.setattr(_langgraph_transcript, "MAX_MESSAGES_PER_TURN", 2)
    db = backend.db
    source_id, target_id = await _a_crashed_copy_of_a_thread_ending_in_a_side_turn(
        db, monkeypatch, 1
    )

    where = (ConversationStore, "_delete_marked")
    await _a_copy_dying_in(db, source_id, target_id, monkeypatch, where)
    with pytest.raises(BeingDeleted):
        await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    await ConversationStore(db).delete(target_id)
    await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    store = ConversationStore(db)
    copied = [m.content for m in await store.transcript(target_id)]
    assert copied == [m.content for m in await store.transcript(source_id)]


async def test_a_copy_failing_after_another_copy_into_its_target_succeeded_keeps_its_checkpoints(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANGGRAPH.md `copy_thread`: a copy that fails takes back only the checkpoints it
    inserted. Copies write the same checkpoint ids: copy A, held before its checkpoints, while
    copy B takes A's attempt back and succeeds; A then fails, and B's thread keeps its
    checkpoints (was: A deleted them by id, B's graph saw an empty thread)."""
    from agent_store.integrations import _langgraph_transcript, langgraph

    _forced_turn_by_turn(monkeypatch)
    monkeypatch.setattr(_langgraph_transcript, "MAX_MESSAGES_PER_TURN", 2)
    db = backend.db
    config = thread("user-ada")
    graph = tool_agent(AgentStoreSaver(db))
    await run_turns(graph, config, range(1, 3))
    source_id = config["configurable"]["thread_id"]
    target = thread("user-ada", source_id + "-copy")
    target_id = target["configurable"]["thread_id"]
    inserted, a_held, b_done = langgraph._insert_new, asyncio.Event(), asyncio.Event()

    async def held_once(*args: Any) -> Any:
        if not a_held.is_set():
            a_held.set()
            await b_done.wait()
        return await inserted(*args)

    monkeypatch.setattr(langgraph, "_insert_new", held_once)
    a = asyncio.create_task(AgentStoreSaver(db).acopy_thread(source_id, target_id))
    await a_held.wait()
    await AgentStoreSaver(db).acopy_thread(source_id, target_id)
    made = await db[CHECKPOINTS].count_documents({"thread_id": target_id})
    state = (await graph.aget_state(target)).values
    b_done.set()
    await asyncio.wait([a])

    assert made == await db[CHECKPOINTS].count_documents({"thread_id": target_id}) > 0
    assert (await graph.aget_state(target)).values == state


async def _a_turn_by_turn_copy(
    db: Any, source_id: str, target_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy logged turn by turn: its conversation created now, its copies keeping their
    source's times, so its first message is older than the conversation."""
    with monkeypatch.context() as patched:
        _forced_turn_by_turn(patched)
        await AgentStoreSaver(db).acopy_thread(source_id, target_id)


@pytest.mark.parametrize("attempt", ["a crashed copy run again", "the user's own store fork"])
async def test_a_copy_of_a_thread_older_than_its_conversation_into_its_own_fork_converges(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, attempt: str
) -> None:
    """LANGGRAPH.md `copy_thread`: a store fork of the source's life is the copy's to finish
    (its earlier attempt, or a fork the user made), also when the source's first message is
    older than its conversation (a thread itself copied turn by turn, a client's times):
    told by the first message the fork copied, never by comparing two clocks (was: Conflict
    "is no copy of thread", the fork an orphan without checkpoints)."""
    db, chat = backend.db, thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(db)), chat, range(1, 3))
    source_id = chat["configurable"]["thread_id"] + "-long"
    await _a_turn_by_turn_copy(db, chat["configurable"]["thread_id"], source_id, monkeypatch)
    target_id, store = source_id + "-copy", ConversationStore(db)
    if attempt == "a crashed copy run again":
        await _crashing_before_the_checkpoints(db, source_id, target_id, monkeypatch)
    else:
        last = (await store.messages_by_seq(source_id))[-1].seq
        await AgentMessageLogger(db).fork(source_id, last, target_id, user_id="user-ada")

    await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    copied = [m.content for m in await store.transcript(target_id)]
    assert copied == [m.content for m in await store.transcript(source_id)]
    assert await db[CHECKPOINTS].count_documents({"thread_id": target_id}) > 0


async def test_a_copy_run_again_after_its_source_was_pruned_converges(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LANGGRAPH.md `copy_thread`: a copy that died once its checkpoints were in, run again
    after a routine `prune` of the source: the target's checkpoints the source no longer
    holds are copies of its older ones, no graph's run on the target, so the re-run
    converges (was: Conflict "written to, or whose source went on")."""
    db, chat = backend.db, thread("user-ada")
    await run_turns(tool_agent(AgentStoreSaver(db)), chat, range(1, 3))
    source_id = chat["configurable"]["thread_id"]
    target_id = source_id + "-copy"
    await _a_copy_dying_in(
        db, source_id, target_id, monkeypatch, (AgentStoreSaver, "_follow_the_target")
    )
    await AgentStoreSaver(db).aprune([source_id])

    await AgentStoreSaver(db).acopy_thread(source_id, target_id)

    store = ConversationStore(db)
    copied = [m.content for m in await store.transcript(target_id)]
    assert copied == [m.content for m in await store.transcript(source_id)]
