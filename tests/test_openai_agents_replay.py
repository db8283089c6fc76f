"""The Agents SDK session reading conversations other writers stored (the HTTP API, the logger,
streamed turns): every item is one the SDK's item types take, and every call is answered once,
right after it, as a model requires.

The SDK is real (its Runner, its `OpenAIChatCompletionsModel`, its Chat Completions converter);
only the HTTP transport under the OpenAI client is a fake.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.models.chatcmpl_converter import Converter
from langchain_core.messages.utils import convert_to_openai_messages
from openai import AsyncOpenAI
from openai.types.responses import ResponseInputItemParam
from pydantic import TypeAdapter

from agent_store import AgentMessageLogger, ConversationStore
from agent_store.core import DENIED_RESULT, PENDING_RESULT
from agent_store.integrations.exports import chat_completions_problems
from agent_store.integrations.langchain import ConversationChatHistory
from agent_store.integrations.openai_agents import ConversationSession
from agent_store.integrations.streams import log_streamed_turn, turn_from_metadata
from tests.conftest import Backend

CID = "conv-agents-replay"

set_tracing_disabled(True)  # no trace export: the tests never reach the network

RESPONSES_INPUT_ITEM: TypeAdapter[Any] = TypeAdapter(ResponseInputItemParam)


class FakeChatCompletionsTransport(httpx.AsyncBaseTransport):
    """A fake OpenAI endpoint: answers every chat completion "Fine.", recording what it got."""

    def __init__(self) -> None:
        self.sent: list[list[dict[str, Any]]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(json.loads(request.content)["messages"])
        reply = {"role": "assistant", "content": "Fine."}
        return httpx.Response(
            200,
            json={
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": "gpt-4o",
                "choices": [{"index": 0, "finish_reason": "stop", "message": reply}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        )


def chat_agent(transport: FakeChatCompletionsTransport) -> Agent[Any]:
    client = AsyncOpenAI(
        api_key="fake", base_url="http://fake.test/v1", http_client=httpx.AsyncClient(
            transport=transport
        )
    )  # fmt: skip
    model = OpenAIChatCompletionsModel(model="gpt-4o", openai_client=client)
    return Agent(name="assistant", model=model)


def problems_of(items: list[Any]) -> list[str]:
    """What breaks the pairing rules once the SDK turns the items into Chat Completions
    messages, and which items are no valid Responses input item."""
    invalid = []
    for index, item in enumerate(items):
        try:
            RESPONSES_INPUT_ITEM.validate_python(item)
        except ValueError:
            invalid.append(f"item {index} is no Responses input item: {item}")
    converted = [dict(m) for m in Converter.items_to_messages(items)]
    return invalid + chat_completions_problems(converted)


def kinds(items: list[Any]) -> list[str]:
    return [
        f"{item.get('type', 'message')}:{item.get('role', item.get('call_id'))}" for item in items
    ]


# -- another writer's messages are items the SDK takes --------------------------------


async def test_a_run_goes_on_from_a_conversation_another_writer_stored(backend: Backend) -> None:
    await AgentMessageLogger(backend.db).log_messages(
        CID,
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}],
        turn_id="t0",
    )
    transport = FakeChatCompletionsTransport()

    result = await Runner.run(
        chat_agent(transport), "and now?", session=ConversationSession(CID, backend.db)
    )

    assert result.final_output == "Fine."
    assert transport.sent == [
        [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi there"},
            {"role": "user", "content": "and now?"},
        ]
    ]


async def test_every_item_of_another_writers_messages_is_one_the_sdk_takes(
    backend: Backend,
) -> None:
    calls = [
        {"id": "tc-1", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "tc-2", "function": {"name": "weather", "arguments": '{"city": "Lyon"}'}},
    ]
    await AgentMessageLogger(backend.db).log_messages(
        CID,
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Weather in Paris and Lyon?"},
         {"role": "assistant", "content": "Looking.", "tool_calls": calls},
         {"role": "tool", "tool_call_id": "tc-1", "content": "18 °C"},
         {"role": "tool", "tool_call_id": "tc-2", "content": "21 °C"},
         {"role": "assistant", "content": "Paris 18 °C, Lyon 21 °C."},
         {"role": "assistant", "error": {"message": "rate limited"}}],
        turn_id="t1",
    )  # fmt: skip
    session = ConversationSession(CID, backend.db)

    items = await session.get_items()

    assert kinds(items) == [
        "message:system", "message:user", "message:assistant", "function_call:tc-1",
        "function_call:tc-2", "function_call_output:tc-1", "function_call_output:tc-2",
        "message:assistant",
    ]  # fmt: skip
    assert problems_of(items) == []
    assert await session.get_items() == items  # the ids are the stored messages', not random
    transcript = await ConversationStore(backend.db).transcript(CID)
    assert items[2]["id"] == f"msg_{transcript[2].id}"


# -- a confirmation answered a turn later ---------------------------------------------

ASKED = [
    {"type": "stream_token", "token": "I can book it."},
    {"type": "tool_start", "tool_name": "book_train", "tool_call_id": "tc-9", "args": {}},
    {"type": "confirm_required", "request_id": "confirm-9", "action": "book_train",
     "params": {}, "prompt": "Pay €35?", "tool_call_id": "tc-9"},
]  # fmt: skip
APPROVED_AND_BOOKED = [
    {"type": "confirm_resolved", "request_id": "confirm-9", "approved": True},
    {"type": "tool_end", "tool_name": "book_train", "tool_call_id": "tc-9", "result": "B-42"},
    {"type": "stream_token", "token": "Booked: B-42."},
]
SOMETHING_ELSE = [{"type": "stream_token", "token": "It is 09:00."}]


async def stream(backend: Backend, turns: list[tuple[list[dict[str, Any]], str | None]]) -> None:
    """Turns streamed in the metadata protocol and logged as STREAMING.md documents."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for number, (events, prompt) in enumerate(turns, start=1):
        pending = await store.pending_calls(CID)
        turn = turn_from_metadata(events, complete=True, pending=pending)
        await log_streamed_turn(
            logger=logger, store=store, conversation_id=CID, turn=turn,
            turn_id=f"turn-{number}", prompt=prompt,
        )  # fmt: skip


async def test_a_result_stored_a_turn_later_comes_right_after_its_call(backend: Backend) -> None:
    await stream(backend, [(ASKED, "Book the 09:04."), (APPROVED_AND_BOOKED, "Yes.")])

    items = await ConversationSession(CID, backend.db).get_items()

    assert kinds(items) == [
        "message:user", "message:assistant", "function_call:tc-9", "function_call_output:tc-9",
        "message:assistant", "message:user", "message:assistant",
    ]  # fmt: skip
    assert items[3]["output"] == "B-42"
    assert problems_of(items) == []


async def test_a_call_the_conversation_went_on_after_is_answered_by_a_marked_stand_in(
    backend: Backend,
) -> None:
    """tc-9 awaits approval and the user asks something else: the model is called again past
    the call, so it is answered, as the LangChain history and the exports answer it."""
    await stream(backend, [(ASKED, "Book the 09:04."), (SOMETHING_ELSE, "What time is it?")])

    items = await ConversationSession(CID, backend.db).get_items()
    history = await ConversationChatHistory(CID, backend.db).aget_messages()

    assert kinds(items) == [
        "message:user", "message:assistant", "function_call:tc-9", "function_call_output:tc-9",
        "message:assistant", "message:user", "message:assistant",
    ]  # fmt: skip
    assert items[3]["output"] == PENDING_RESULT
    assert problems_of(items) == []
    assert chat_completions_problems(convert_to_openai_messages(history)) == []


async def test_a_stand_in_comes_before_a_text_the_response_making_its_call_went_on_with(
    backend: Backend,
) -> None:
    """The call tc-2 awaits approval, the model said something after making it, and the user
    moved on: its stand-in goes right after the call, before that text, which the SDK's
    converter makes an assistant message of its own that no tool message may follow."""

    def call(call_id: str, name: str) -> dict[str, Any]:
        return {"role": "assistant", "tool_calls": [{"id": call_id, "function": {"name": name}}]}

    ask = {"action": "book_train", "params": {}, "request_id": "confirm-1",
           "tool_call_ids": ["tc-1"]}  # fmt: skip
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [
        {"role": "user", "content": "Book the train, then the hotel."}, call("tc-1", "train"),
        {"role": "assistant", "content": "Pay 35 EUR for the train?", "hitl_action": ask},
    ], turn_id="t1")  # fmt: skip
    await ConversationStore(backend.db).resolve_hitl(CID, "confirm-1")
    await logger.log_messages(CID, [
        {"role": "tool", "tool_call_id": "tc-1", "content": "booked B-42"}, call("tc-2", "hotel"),
        {"role": "assistant", "content": "Train booked; the hotel needs your approval."},
    ], turn_id="t2")  # fmt: skip
    said = [{"role": "user", "content": "Skip the hotel. What time is it?"}]
    await logger.log_messages(CID, said, turn_id="t3")

    items = await ConversationSession(CID, backend.db).get_items()

    assert kinds(items)[4:7] == [
        "function_call:tc-2", "function_call_output:tc-2", "message:assistant",
    ]  # fmt: skip
    assert items[5]["output"] == PENDING_RESULT
    assert problems_of(items) == []


async def test_a_result_and_a_stand_in_come_together_right_after_the_calls_before_the_text(
    backend: Backend,
) -> None:
    """A response makes a and b, then says something; a prompt holds both; the person approves
    a only and a's result comes a turn later. RUNTIMES.md: each answer goes right after its
    call, before the prompt and the text the response went on with: a's result and b's
    stand-in both come right after the calls (the SDK's converter joins the text to the
    calls only when no answer comes between them: a's result after it would follow an
    assistant message without calls, which the API refuses)."""

    def call(call_id: str) -> dict[str, Any]:
        return {"role": "assistant", "tool_calls": [{"id": call_id, "function": {"name": "book"}}]}

    ask = {"action": "book", "params": {}, "request_id": "r1", "tool_call_ids": ["a", "b"]}
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [
        {"role": "user", "content": "Book both."}, call("a"), call("b"),
        {"role": "assistant", "content": "I need your approval."},
        {"role": "assistant", "content": "Book both?", "hitl_action": ask},
    ], turn_id="t1")  # fmt: skip
    pending = await store.pending_calls(CID)
    await store.resolve_hitl(CID, "r1", calls=[c for c in pending if c.tool_call_id == "a"])
    await logger.log_messages(
        CID, [{"role": "tool", "tool_call_id": "a", "content": "booked a"}], turn_id="t2"
    )

    items = await ConversationSession(CID, backend.db).get_items()
    history = await ConversationChatHistory(CID, backend.db).aget_messages()

    assert kinds(items)[1:6] == [
        "function_call:a", "function_call:b", "function_call_output:a", "function_call_output:b",
        "message:assistant",
    ]  # fmt: skip
    assert [items[3]["output"], items[4]["output"]] == ["booked a", PENDING_RESULT]
    assert problems_of(items) == []
    assert chat_completions_problems(convert_to_openai_messages(history)) == []


async def test_a_call_its_prompt_followed_is_answered_by_a_stand_in_before_the_prompts_text(
    backend: Backend,
) -> None:
    """The prompt's text is an item after the call: a model given it would be given the call
    without a result before it (the SDK drops such a call from what it sends)."""
    await stream(backend, [(ASKED, "Book the 09:04.")])

    items = await ConversationSession(CID, backend.db).get_items()
    history = await ConversationChatHistory(CID, backend.db).aget_messages()

    assert kinds(items) == [
        "message:user", "message:assistant", "function_call:tc-9", "function_call_output:tc-9",
        "message:assistant",
    ]  # fmt: skip
    assert items[3]["output"] == PENDING_RESULT
    assert [type(m).__name__ for m in history] == [
        "HumanMessage", "AIMessage", "ToolMessage", "AIMessage",
    ]  # fmt: skip


APPROVED_WHILE_THE_MODEL_WENT_ON = [
    {"type": "confirm_resolved", "request_id": "confirm-9", "approved": True},
    {"type": "tool_start", "tool_name": "get_weather", "tool_call_id": "tc-2", "args": {}},
    {"type": "tool_end", "tool_name": "get_weather", "tool_call_id": "tc-2", "result": "sunny"},
    {"type": "stream_token", "token": "Sunny in Lyon."},
]
"""tc-9 is approved, its result still to come, and the model meanwhile calls and answers tc-2
(no user message in between)."""


async def test_a_call_later_items_of_the_model_followed_is_answered_by_a_marked_stand_in(
    backend: Backend,
) -> None:
    """The model was called again past tc-9: the SDK is given tc-9 with a stand-in right
    after it, not tc-9 without a result (which it drops from what it sends)."""
    await stream(backend, [(ASKED, "Book the 09:04."), (APPROVED_WHILE_THE_MODEL_WENT_ON, None)])
    transport = FakeChatCompletionsTransport()

    await Runner.run(
        chat_agent(transport), "and now?", session=ConversationSession(CID, backend.db)
    )

    sent = transport.sent[0]
    # The SDK's converter joins the prompt's text and tc-2 in one assistant message.
    assert [(m["role"], m.get("tool_call_id")) for m in sent] == [
        ("user", None), ("assistant", None), ("tool", "tc-9"), ("assistant", None),
        ("tool", "tc-2"), ("assistant", None), ("user", None),
    ]  # fmt: skip
    assert sent[2]["content"] == PENDING_RESULT
    assert chat_completions_problems(sent) == []


# -- the session's own items keep their order -----------------------------------------


def function_call(call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}


def output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": call_id}


def said(text: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "id": f"msg_{len(text)}", "role": "assistant",
            "status": "completed", "content": [part]}  # fmt: skip


@pytest.mark.parametrize(
    "step",
    [
        pytest.param([function_call("a"), function_call("b"), output("b"), output("a")],
                     id="outputs-in-another-order"),
        pytest.param([function_call("a"), said("Calling."), output("a")],
                     id="text-after-the-call"),
        pytest.param([said("Calling."), function_call("a"), function_call("b"), output("a"),
                      output("b")], id="text-then-parallel-calls"),
    ],
)  # fmt: skip
async def test_items_the_session_added_come_back_in_the_order_added(
    backend: Backend, step: list[dict[str, Any]]
) -> None:
    session = ConversationSession(CID, backend.db)
    added = [{"role": "user", "content": "Go."}, *step, said("Done.")]

    await session.add_items(added)  # type: ignore[arg-type]

    assert await session.get_items() == added


async def test_a_result_another_writer_stored_as_only_an_error_is_an_output_saying_it_failed(
    backend: Backend,
) -> None:
    """As in the exports (`result_text`): never an empty output a model reads as a success."""
    calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": "{}"}}
             for i, n in (("a", "book"), ("b", "quote"))]  # fmt: skip
    said = [
        {"role": "user", "content": "Book it"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": None,
         "error": {"message": "tool call denied"}},
        {"role": "tool", "tool_call_id": "b", "content": None,
         "error": {"message": "upstream timeout"}},
    ]  # fmt: skip
    await AgentMessageLogger(backend.db).log_messages(CID, said, user_id="u", turn_id="t1")

    items = await ConversationSession(CID, backend.db).get_items()

    outputs = [(i["call_id"], i["output"]) for i in items if "output" in i]
    assert outputs == [("a", DENIED_RESULT), ("b", "The tool call failed: upstream timeout")]
    assert problems_of(items) == []
