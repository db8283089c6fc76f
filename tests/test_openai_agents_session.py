"""The Agents SDK's own Runner on a scripted model, with its history in the store.

Every comparison is against the SDK's in-memory `SQLiteSession(":memory:")`
given the same calls: what the model is sent, and what the session answers.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
from agents import Agent, Runner, SQLiteSession, Usage, function_tool, set_tracing_disabled
from agents.items import ModelResponse, TResponseInputItem
from agents.memory import Session
from agents.models.interface import Model
from agents.run_state import RunState
from mongomock_motor import AsyncMongoMockClient
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseFunctionWebSearch,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
)
from openai.types.responses.response_function_web_search import ActionSearch
from openai.types.responses.response_reasoning_item import Summary
from pymongo.errors import AutoReconnect

from agent_store import (
    AgentMessageLogger,
    AnsweredBefore,
    Conflict,
    ConversationStore,
    InvalidInput,
    NotFound,
    StorageUnavailable,
    TurnRules,
)
from agent_store.core import (
    PENDING_RESULT,
    AssistantMessage,
    FunctionCall,
    MessageError,
    ToolCall,
    UserMessage,
)
from agent_store.integrations.exports import chat_completions, check_chat_completions
from agent_store.integrations.openai_agents import (
    ConversationSession,
    item_from_message,
    message_from_item,
)
from agent_store.store import CONVERSATIONS, MESSAGES
from tests.api_harness import (
    STALE_RESUMES,
    another_users_legacy_turn,
    deleted_while_paused,
    reserved_insert_lost,
)
from tests.conftest import COUNTED, Backend

CID = "conv-agents"

set_tracing_disabled(True)  # no trace export: the tests never reach the network


@pytest.fixture
def in_memory() -> Iterator[SQLiteSession]:
    """The SDK's own in-memory session, the reference every comparison is made against."""
    session = SQLiteSession("s", ":memory:")
    yield session
    session.close()


def text(content: str, item_id: str) -> ResponseOutputMessage:
    part = ResponseOutputText(type="output_text", text=content, annotations=[])
    return ResponseOutputMessage(
        id=item_id, type="message", role="assistant", status="completed", content=[part]
    )


def call(name: str, arguments: dict[str, Any], call_id: str) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        type="function_call",
        name=name,
        arguments=json.dumps(arguments),
        call_id=call_id,
        id=f"fc_{call_id}",
        status="completed",
    )


def script() -> list[list[Any]]:
    """Three runs: two parallel weather calls (after reasoning and a web search), then a clock
    call, then a plain answer. One list of output items per model call."""
    reasoning = ResponseReasoningItem(
        id="rs_1", type="reasoning", summary=[Summary(type="summary_text", text="Two cities.")]
    )
    search = ResponseFunctionWebSearch(
        id="ws_1",
        type="web_search_call",
        status="completed",
        action=ActionSearch(type="search", query="weather Paris Lyon"),
    )
    return [
        [
            reasoning,
            search,
            call("get_weather", {"city": "Paris"}, "call_w1"),
            call("get_weather", {"city": "Lyon"}, "call_w2"),
        ],
        [text("Paris 18 °C, Lyon 21 °C.", "msg_1")],
        [call("get_time", {"zone": "Europe/Paris"}, "call_t1")],
        [text("It is 09:00.", "msg_2")],
        [text("You're welcome.", "msg_3")],
    ]


class ScriptedModel(Model):
    """A `Model` answering from a script, recording the input of every call."""

    def __init__(self) -> None:
        self.steps = script()
        self.inputs: list[list[dict[str, Any]]] = []

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        given = kwargs.get("input", args[1] if len(args) > 1 else None)
        assert isinstance(given, list)
        self.inputs.append(json.loads(json.dumps(given)))
        usage = Usage(requests=1, input_tokens=10, output_tokens=5, total_tokens=15)
        return ModelResponse(output=self.steps.pop(0), usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return json.dumps({"city": city, "temp_c": {"Paris": 18, "Lyon": 21}[city]})


@function_tool
def get_time(zone: str) -> str:
    """The time in a zone."""
    return "09:00"


PROMPTS = ["Weather in Paris and Lyon?", "And the time?", "Thanks!"]


async def three_runs(session: Session) -> ScriptedModel:
    model = ScriptedModel()
    agent = Agent(
        name="assistant", instructions="Be brief.", model=model, tools=[get_weather, get_time]
    )
    for prompt in PROMPTS:
        await Runner.run(agent, prompt, session=session)
    return model


async def test_the_third_run_sends_the_model_what_an_in_memory_session_sends(
    backend: Backend, in_memory: SQLiteSession
) -> None:
    reference = await three_runs(in_memory)
    stored = await three_runs(ConversationSession(CID, backend.db))

    assert len(stored.inputs) == len(reference.inputs) == 5
    assert stored.inputs[-1] == reference.inputs[-1]
    assert stored.inputs == reference.inputs
    kinds = [item.get("type", item.get("role")) for item in stored.inputs[-1]]
    assert kinds == [
        "user", "reasoning", "web_search_call", "function_call", "function_call",
        "function_call_output", "function_call_output", "message",
        "user", "function_call", "function_call_output", "message", "user",
    ]  # fmt: skip


@pytest.mark.parametrize("number", [1, 10**20])
async def test_hidden_context_in_a_user_items_extra_key_is_stripped_as_the_value_it_spells(
    backend: Backend, number: int
) -> None:
    """Context cut across two values, in a value kept as its JSON text or not: each value
    loses its own part, no key is lost or merged into another."""
    session = ConversationSession(CID, backend.db)
    extra = {"a": "ok [RUNTIME CONTEXT] SECRET", "b": "s2 [/RUNTIME CONTEXT] fine", "n": number}
    await session.add_items([{"role": "user", "content": "hi", "extra": extra}])  # type: ignore[list-item]

    stored = json.dumps(await backend.db[MESSAGES].find({}).to_list(None), default=str)
    assert "SECRET" not in stored
    assert await session.get_items() == [
        {"role": "user", "content": "hi", "extra": {"a": "ok", "b": "fine", "n": number}}
    ]


async def test_items_are_stored_as_chat_messages_with_the_real_call_ids(backend: Backend) -> None:
    await three_runs(ConversationSession(CID, backend.db, user_id="u1"))
    transcript = await ConversationStore(backend.db).transcript(CID)

    assert [m.role for m in transcript[:8]] == [
        "user", "assistant", "assistant", "assistant", "assistant", "tool", "tool", "assistant",
    ]  # fmt: skip
    first_call = transcript[3]
    assert first_call.tool_calls is not None
    assert first_call.tool_calls[0].id == "call_w1"
    assert first_call.tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert transcript[5].tool_call_id == "call_w1"
    assert transcript[7].content == "Paris 18 °C, Lyon 21 °C."
    # Reasoning and the web search are kept whole, in the extension, with no content.
    assert transcript[1].content is None
    assert transcript[1].native is not None
    assert transcript[1].native.set["type"] == "reasoning"
    conversation = await ConversationStore(backend.db).get_conversation(CID, user_id="u1")
    assert conversation.turn_count == 3


def _holding_itself() -> dict[str, Any]:
    looped: dict[str, Any] = {"name": "search"}
    looped["self"] = looped
    return looped


def _nested(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    "tools", [[_holding_itself()], _nested(2000)], ids=["holding-itself", "nested-2000-levels"]
)
async def test_an_item_holding_itself_or_nested_past_any_bound_is_invalid_input(
    backend: Backend, tools: Any
) -> None:
    """Refused as any value nested past 64 levels is, naming the item: never a RecursionError
    (a 500 over HTTP), nothing written."""
    session = ConversationSession(CID, backend.db, user_id="u1")
    item = {"type": "mcp_list_tools", "id": "m", "server_label": "g", "tools": tools}

    with pytest.raises(InvalidInput, match="nest deeper than 64 levels"):
        await session.add_items([{"role": "user", "content": "q"}, item])  # type: ignore[list-item]

    assert await backend.db[MESSAGES].count_documents({}) == 0


async def test_an_item_over_the_bound_is_stored_bounded_and_read_back_whole(
    backend: Backend,
) -> None:
    """A reasoning item with a long encrypted payload: kept in GridFS, given back whole."""
    session = ConversationSession(CID, backend.db, rules=TurnRules(max_message_bytes=16 * 1024))
    reasoning = {
        "id": "rs_1",
        "type": "reasoning",
        "summary": [],
        "encrypted_content": "e" * 100_000,
    }
    question = {"role": "user", "content": "Why?"}

    await session.add_items([question, reasoning])  # type: ignore[list-item]

    assert await session.get_items() == [question, reasoning]
    stored = await backend.db["agent_messages"].find_one({"native": None, "role": "assistant"})
    assert stored is not None
    assert "native" in stored["truncated"]


async def test_a_call_awaiting_approval_whose_arguments_were_cut_is_read_back_whole(
    backend: Backend,
) -> None:
    """The runtime resuming the approved call runs it on the arguments it stored."""
    session = ConversationSession(CID, backend.db, rules=TurnRules(max_message_bytes=16 * 1024))
    arguments = json.dumps({"to": "all@corp", "body": "x" * 100_000})
    call = {"type": "function_call", "call_id": "c-1", "name": "send_mail", "arguments": arguments}

    await session.add_items([{"role": "user", "content": "mail"}, call])  # type: ignore[list-item]

    stored = await backend.db["agent_messages"].find_one({"role": "assistant"})
    assert stored is not None
    assert "tool_calls.0.function.arguments" in stored["truncated"]
    items = await session.get_items()
    assert items[-1]["arguments"] == arguments  # type: ignore[typeddict-item]


BOUNDED = TurnRules(max_message_bytes=16 * 1024)
"""A bound the items below pass: each is cut in its message and kept whole in GridFS."""
FILE_DATA = "data:application/pdf;base64," + "JVBERi0x" * 4_000
CUT_ITEMS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": [
        {"type": "input_text", "text": "Summarise this contract"},
        {"type": "input_file", "filename": "contract.pdf", "file_data": FILE_DATA}]}],
    [{"role": "user", "content": "store it"},
     {"type": "function_call", "call_id": "c1", "name": "save", "id": "fc_1",
      "status": "completed", "arguments": json.dumps({"doc": "x" * 40_000})}],
]  # fmt: skip


@pytest.mark.parametrize("items", CUT_ITEMS, ids=["file", "call"])
async def test_a_popped_item_cut_to_its_bound_is_the_item_added(
    backend: Backend, in_memory: SQLiteSession, items: list[TResponseInputItem]
) -> None:
    """RUNTIMES.md: `pop_item` returns the item added, as `SQLiteSession` does, though its
    message was cut to its bound: the pop reads its whole texts before deleting them, so the
    item put back (an app's undo, the SDK restoring a rewind) is stored whole again."""
    session = ConversationSession(CID, backend.db, rules=BOUNDED)
    await session.add_items(items)
    await in_memory.add_items(items)

    popped = await session.pop_item()

    assert popped == await in_memory.pop_item() == items[-1]
    assert popped is not None
    await session.add_items([popped])
    assert await session.get_items() == items


async def test_items_the_chat_format_cannot_hold_are_never_shown_to_other_readers(
    backend: Backend,
) -> None:
    await three_runs(ConversationSession(CID, backend.db))
    exported = chat_completions(await ConversationStore(backend.db).transcript(CID))

    assert [m["role"] for m in exported[:5]] == ["user", "assistant", "tool", "assistant", "tool"]
    assert "reasoning" not in json.dumps(exported)
    assert "web_search_call" not in json.dumps(exported)


@pytest.mark.parametrize(
    "item",
    [
        pytest.param({"role": "developer", "content": "Be terse."}, id="developer"),
        pytest.param(
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is on this picture?"},
                    {
                        "type": "input_image",
                        "image_url": "https://example.test/a.png",
                        "detail": "auto",
                    },
                ],
            },
            id="user-parts",
        ),
        pytest.param(
            {
                "type": "computer_call",
                "id": "cu_1",
                "call_id": "call_c1",
                "status": "completed",
                "action": {"type": "click", "button": "left", "x": 10, "y": 20},
                "pending_safety_checks": [],
            },
            id="computer-call",
        ),
        pytest.param(
            {
                "type": "computer_call_output",
                "call_id": "call_c1",
                "output": {
                    "type": "computer_screenshot",
                    "image_url": "data:image/png;base64,AAAA",
                },
            },
            id="computer-call-output",
        ),
        pytest.param(
            {
                "type": "function_call_output",
                "call_id": "call_9",
                "output": [{"type": "input_text", "text": "a chart"}],
            },
            id="tool-output-parts",
        ),
        pytest.param(
            {"type": "reasoning", "id": "rs_9", "summary": [], "encrypted_content": "gAAAA"},
            id="encrypted-reasoning",
        ),
        pytest.param(
            {
                "type": "mcp_call",
                "id": "mcp_1",
                "server_label": "chain",
                "name": "balance",
                "arguments": "{}",
                "output": None,
                "wei": [10**20, -(2**64)],
            },
            id="a-number-bson-cannot-hold-kept-as-json-text",
        ),
    ],
)
def test_every_item_comes_back_exactly_as_it_came(item: dict[str, Any]) -> None:
    message = message_from_item(item)
    stored_again = type(message).model_validate(message.model_dump(mode="json", by_alias=True))

    assert item_from_message(stored_again) == [item]


def test_items_without_what_their_kind_needs_are_refused_naming_the_item() -> None:
    with pytest.raises(InvalidInput, match=r"invalid item 2 \(function_call\)"):
        message_from_item({"type": "function_call", "name": "f", "arguments": "{}"}, index=2)
    with pytest.raises(InvalidInput, match=r"invalid item 0: a message with unknown role 'robot'"):
        message_from_item({"role": "robot", "content": "beep"})
    with pytest.raises(InvalidInput, match=r"invalid item 1: it has neither a `type` nor a `role`"):
        message_from_item({"content": "who says this?"}, index=1)


def test_a_session_on_a_synchronous_pymongo_database_is_refused_before_anything_is_written(
    database: Any,
) -> None:
    with pytest.raises(TypeError, match="AsyncMongoClient"):
        ConversationSession(CID, database, user_id="ada")
    assert database.list_collection_names() == []


def test_a_session_on_a_client_is_refused_saying_to_pass_a_database(client: Any) -> None:
    with pytest.raises(TypeError, match=re.escape("pass a database, client[name]")):
        ConversationSession(CID, client, user_id="ada")


async def test_hidden_runtime_context_is_stripped_before_anything_is_stored(
    backend: Backend,
) -> None:
    session = ConversationSession(CID, backend.db)
    hidden = "[RUNTIME CONTEXT]plan=gold[/RUNTIME CONTEXT]"
    await session.add_items(
        [
            {"role": "user", "content": f"{hidden} Hello"},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": f"{hidden}Look"},
                         {"type": "input_image", "image_url": "https://example.test/b.png",
                          "detail": "auto"}]},
        ]
    )  # fmt: skip

    items = await session.get_items()
    assert items[0] == {"role": "user", "content": "Hello"}
    assert items[1]["content"][0] == {"type": "input_text", "text": "Look"}  # type: ignore[index,typeddict-item]
    documents = await backend.db.agent_messages.find({}).to_list(None)
    assert "plan=gold" not in json.dumps(documents, default=str)


# -- pop_item and clear_session, call for call against the SDK's SQLite session ------------

Calls = Callable[[Session], Awaitable[list[Any]]]


async def pop_twice_after_runs(session: Session) -> list[Any]:
    await three_runs(session)
    return [await session.pop_item(), await session.pop_item(), await session.get_items()]


async def pop_everything(session: Session) -> list[Any]:
    await session.add_items([{"role": "user", "content": "hi"}])
    await session.add_items([{"role": "assistant", "content": "hello"}])
    return [await session.pop_item(), await session.pop_item(), await session.pop_item(),
            await session.get_items()]  # fmt: skip


async def pop_then_add(session: Session) -> list[Any]:
    await session.add_items(
        [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    )
    popped = await session.pop_item()
    await session.add_items([{"role": "user", "content": "three"}])
    return [popped, await session.get_items(), await session.get_items(limit=1)]


async def clear_then_add(session: Session) -> list[Any]:
    await three_runs(session)
    await session.clear_session()
    emptied = await session.get_items()
    await session.clear_session()
    await session.add_items([{"role": "user", "content": "again"}])
    return [emptied, await session.get_items(), await session.pop_item(), await session.pop_item()]


async def limits(session: Session) -> list[Any]:
    await three_runs(session)
    return [await session.get_items(limit=n) for n in (1, 3, 100)] + [
        await session.get_items(limit=0)
    ]


async def limits_across_a_paused_call(session: Session) -> list[Any]:
    """Two calls made at once, one answered, the run paused for the other's approval, then
    resumed: items added as the SDK's Runner adds them."""
    for items in (
        [{"role": "user", "content": "Weather, and book the 09:04"}],
        [{"type": "function_call", "call_id": "w1", "name": "weather", "arguments": "{}"},
         {"type": "function_call", "call_id": "b1", "name": "book", "arguments": "{}"}],
        [{"type": "function_call_output", "call_id": "w1", "output": "18C"}],
        [{"type": "function_call_output", "call_id": "b1", "output": "booked"}],
        [{"role": "assistant", "content": "Booked."}],
    ):  # fmt: skip
        await session.add_items(items)  # type: ignore[arg-type]
    return [await session.get_items(limit=n) for n in range(1, 8)]


async def limits_past_a_call_id_used_again(session: Session) -> list[Any]:
    """Two calls answered, then a next step whose provider numbers its calls from 0 again:
    the new `call_0` is another call than the answered one."""
    for items in (
        [{"role": "user", "content": "Book the train and the hotel"}],
        [{"type": "function_call", "call_id": "call_0", "name": "book", "arguments": "{}"},
         {"type": "function_call", "call_id": "call_1", "name": "book", "arguments": "{}"}],
        [{"type": "function_call_output", "call_id": "call_0", "output": "train booked"}],
        [{"type": "function_call_output", "call_id": "call_1", "output": "hotel booked"}],
        [{"type": "function_call", "call_id": "call_0", "name": "pay", "arguments": "{}"}],
    ):  # fmt: skip
        await session.add_items(items)  # type: ignore[arg-type]
    return [await session.get_items(limit=n) for n in range(1, 7)]


@pytest.mark.parametrize(
    "calls",
    [
        pop_twice_after_runs,
        pop_everything,
        pop_then_add,
        clear_then_add,
        limits,
        limits_across_a_paused_call,
        limits_past_a_call_id_used_again,
    ],
)
async def test_the_session_answers_as_the_sdks_sqlite_session(
    backend: Backend, in_memory: SQLiteSession, calls: Calls
) -> None:
    expected = await calls(in_memory)
    answered = await calls(ConversationSession(CID, backend.db))

    assert answered == expected


async def test_popping_keeps_the_conversations_counters_true(backend: Backend) -> None:
    session = ConversationSession(CID, backend.db)
    await three_runs(session)
    store = ConversationStore(backend.db)
    before = await store.get_conversation(CID)

    await session.pop_item()  # "You're welcome."
    await session.pop_item()  # "Thanks!", which started the third turn
    after = await store.get_conversation(CID)

    assert after.message_count == before.message_count - 2
    assert after.turn_count == before.turn_count - 1 == 2
    assert after.last_message_preview == "It is 09:00."
    await session.add_items([{"role": "user", "content": "Thanks again!"}])
    assert [m.seq for m in await store.recent_messages(CID, limit=2)] == [
        after.message_count - 1, after.message_count,
    ]  # fmt: skip


# -- retries, owners, round trips ------------------------------------------------------


class LosesOneAcknowledgement(AgentMessageLogger):
    """Stores the first turn, then fails as if the reply had been lost on the network."""

    lost = False

    async def log_messages(self, *args: Any, **kwargs: Any) -> Any:
        logged = await super().log_messages(*args, **kwargs)
        if not self.lost:
            self.lost = True
            raise StorageUnavailable("the reply was lost")
        return logged


async def test_repeating_an_add_that_failed_stores_it_once(backend: Backend) -> None:
    session = ConversationSession(CID, backend.db)
    session.logger = LosesOneAcknowledgement(backend.db)
    session._appends.logger = session.logger
    items: list[TResponseInputItem] = [{"role": "user", "content": "hi"}]

    with pytest.raises(StorageUnavailable):
        await session.add_items(items)
    await session.add_items(items)
    assert await session.get_items() == items

    await session.add_items(items)  # the same words again, after a success: a new turn
    assert await session.get_items() == items + items


class LosesTheSecondAcknowledgement(AgentMessageLogger):
    """Stores every turn; the reply of the second is lost on the network."""

    logged = 0

    async def log_messages(self, *args: Any, **kwargs: Any) -> Any:
        stored = await super().log_messages(*args, **kwargs)
        self.logged += 1
        if self.logged == 2:
            raise StorageUnavailable("the reply was lost")
        return stored


def losing_the_second_acknowledgement(session: ConversationSession, db: Any) -> None:
    session.logger = LosesTheSecondAcknowledgement(db)
    session._appends.logger = session.logger


async def test_a_run_retried_after_a_later_add_failed_stores_each_of_its_items_once(
    backend: Backend,
) -> None:
    """A run saves its input, then the model's items; the second save's reply is lost, and the
    runtime runs again on the same session: the SDK saves the same items again, the first
    one included, which had succeeded."""
    session = ConversationSession(CID, backend.db)
    losing_the_second_acknowledgement(session, backend.db)
    asked: list[TResponseInputItem] = [{"role": "user", "content": "Book the 09:04."}]
    calls: list[TResponseInputItem] = [
        {"type": "function_call", "call_id": "call_b1", "name": "book_train", "arguments": "{}"}
    ]
    await session.add_items(asked)
    with pytest.raises(StorageUnavailable):
        await session.add_items(calls)

    await session.add_items(asked)  # the run again
    await session.add_items(calls)

    assert await session.get_items() == asked + calls
    await session.add_items(asked)  # the same words in a later run, nothing failing: new
    pending = {"type": "function_call_output", "call_id": "call_b1", "output": PENDING_RESULT}
    assert await session.get_items() == asked + calls + [pending] + asked  # a replay's stand-in


class LosesTheReplies(AgentMessageLogger):
    """Stores every turn; the replies to the adds numbered in `lost` (from 1) are lost."""

    def __init__(self, db: Any, *lost: int) -> None:
        super().__init__(db)
        self.lost, self.logged = set(lost), 0

    async def log_messages(self, *args: Any, **kwargs: Any) -> Any:
        stored = await super().log_messages(*args, **kwargs)
        self.logged += 1
        if self.logged in self.lost:
            raise StorageUnavailable("the reply was lost")
        return stored


def sharing(db: Any, *lost: int) -> ConversationSession:
    """One session two runs share, whose adds numbered in `lost` lose their replies."""
    session = ConversationSession(CID, db)
    session.logger = session._appends.logger = LosesTheReplies(db, *lost)
    return session


A_ASKED: list[TResponseInputItem] = [{"role": "user", "content": "A: book a table"}]
B_ASKED: list[TResponseInputItem] = [{"role": "user", "content": "B: what time is it"}]
EARLIER: list[TResponseInputItem] = [{"role": "user", "content": "Hello, both."}]


async def test_a_repeated_add_is_its_own_retry_after_another_task_added(
    backend: Backend,
) -> None:
    """Two runs share one session, each in its own task: run A's add is stored and its reply
    lost, run B adds its input, then run A repeats its add: that is A's retry, stored once;
    B's add neither ended nor took A's retry."""
    session = sharing(backend.db, 1)
    a_failed, b_added = asyncio.Event(), asyncio.Event()

    async def run_a() -> None:
        with pytest.raises(StorageUnavailable):
            await session.add_items(A_ASKED)
        a_failed.set()
        await b_added.wait()
        await session.add_items(A_ASKED)

    async def run_b() -> None:
        await a_failed.wait()
        await session.add_items(B_ASKED)
        b_added.set()

    await asyncio.gather(run_a(), run_b())

    assert await session.get_items() == A_ASKED + B_ASKED


async def test_two_runs_whose_adds_both_failed_each_retry_their_own_once(
    backend: Backend,
) -> None:
    """Both runs' adds are stored and their replies lost, A's then B's; each run repeats its
    add in its own task: the second failure did not replace the first one's retry. (The task
    that started both had added before: its tasks are not taken for it, nor for each other.)"""
    session = sharing(backend.db, 2, 3)
    await session.add_items(EARLIER)
    a_failed, b_failed, a_retried = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def run_a() -> None:
        with pytest.raises(StorageUnavailable):
            await session.add_items(A_ASKED)
        a_failed.set()
        await b_failed.wait()
        await session.add_items(A_ASKED)
        a_retried.set()

    async def run_b() -> None:
        await a_failed.wait()
        with pytest.raises(StorageUnavailable):
            await session.add_items(B_ASKED)
        b_failed.set()
        await a_retried.wait()
        await session.add_items(B_ASKED)

    await asyncio.gather(run_a(), run_b())

    assert await session.get_items() == EARLIER + A_ASKED + B_ASKED


async def test_a_run_again_in_a_task_of_its_own_is_the_retry_of_the_run_that_failed(
    backend: Backend,
) -> None:
    """`Runner.run_streamed` runs each run in a new task: the run again repeats, from another
    task, the adds of the one that failed, and is its retry while no add of that task failed;
    the first add that repeats none of them ends the retry."""
    session = sharing(backend.db, 2)
    calls: list[TResponseInputItem] = [
        {"type": "function_call", "call_id": "call_t1", "name": "get_time", "arguments": "{}"}
    ]

    async def run() -> None:
        await session.add_items(A_ASKED)
        await session.add_items(calls)

    with pytest.raises(StorageUnavailable):
        await asyncio.create_task(run())
    await asyncio.create_task(run())
    await asyncio.create_task(session.add_items(A_ASKED))  # the same words later: a new turn

    pending = {"type": "function_call_output", "call_id": "call_t1", "output": PENDING_RESULT}
    assert await session.get_items() == A_ASKED + calls + [pending] + A_ASKED


NUMBERED_STEP: list[TResponseInputItem] = [
    {"type": "function_call", "call_id": "call_0", "name": "get_time", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_0", "output": "09:00"},
]
"""A step as a provider numbering its calls per response words it: another run's step may be
the very same items."""


async def test_a_run_again_whose_step_is_worded_otherwise_retries_the_step_whose_insert_was_lost(
    backend: Backend,
) -> None:
    """RUNTIMES.md (Retries): a run's step loses its insert; the run again, in a task of its
    own, repeats its input (a replay) and the model words its step otherwise: that step is
    at the lost one's place and is logged under its turn id, so the store gives the empty
    block back (its `seq` a gap no turn holds)."""
    session = ConversationSession(CID, backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    turn_ids: list[str] = []
    real = session.logger.log_messages

    async def log_messages(*args: Any, **kwargs: Any) -> Any:
        turn_ids.append(kwargs["turn_id"])
        return await real(*args, **kwargs)

    session.logger.log_messages = log_messages  # type: ignore[method-assign]
    worded: list[TResponseInputItem] = [{"role": "assistant", "content": "Booked for 8."}]
    otherwise: list[TResponseInputItem] = [{"role": "assistant", "content": "Done: 8 pm."}]

    async def run(step: list[TResponseInputItem]) -> None:
        await session.add_items(A_ASKED)
        await session.add_items(step)

    messages = session.logger._messages
    messages.insert_many = _lost_once(messages.insert_many, after=1)
    with pytest.raises(StorageUnavailable):
        await asyncio.create_task(run(worded))
    await asyncio.create_task(run(otherwise))

    assert turn_ids[2:] == turn_ids[:2]
    assert await session.get_items() == A_ASKED + otherwise
    assert (await session.store.get_conversation(CID)).turn_count == 1


def _lost_once(insert: Any, *, after: int) -> Any:
    """`insert`, losing the call after the first `after` ones as a reset connection does."""
    calls = [0]

    async def inserting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == after + 1:
            raise AutoReconnect("connection reset while inserting")
        return await insert(*args, **kwargs)

    return inserting


async def test_a_run_that_added_anything_else_first_is_not_taken_for_a_failed_runs_retry(
    backend: Backend,
) -> None:
    """Run 1's step is stored and its reply lost, and its task ends; run 2, in a task of its
    own, adds another input, then a step of the same items as run 1's: a step of its own,
    stored, not a retry of run 1's (only a task's first add takes over a failed run)."""
    session = sharing(backend.db, 2)
    answer: list[TResponseInputItem] = [{"role": "assistant", "content": "09:00 there too."}]

    async def run(asked: list[TResponseInputItem], *steps: list[TResponseInputItem]) -> None:
        for items in (asked, *steps):
            await session.add_items(items)

    with pytest.raises(StorageUnavailable):
        await asyncio.create_task(run(A_ASKED, NUMBERED_STEP))
    await asyncio.create_task(run(B_ASKED, NUMBERED_STEP, answer))

    assert await session.get_items() == A_ASKED + NUMBERED_STEP + B_ASKED + NUMBERED_STEP + answer


@function_tool(needs_approval=True)
def book_train(train: str) -> str:
    """Book a train."""
    return f"booked {train}"


async def test_a_resumed_run_retried_after_a_lost_reply_answers_its_call_once(
    backend: Backend,
) -> None:
    """The run pauses for approval; in another process the approval resumes it, and the reply
    of its second save is lost; the runtime resumes it again from the saved state."""
    model = ScriptedModel()
    model.steps = [
        [call("book_train", {"train": "09:04"}, "call_b1")],
        [text("Booked.", "msg_1")],
        [text("Booked.", "msg_1")],
    ]
    agent = Agent(name="assistant", model=model, tools=[book_train])
    paused = await Runner.run(
        agent, "Book the 09:04.", session=ConversationSession(CID, backend.db)
    )
    saved = paused.to_state().to_string()
    session = ConversationSession(CID, backend.db)  # the process that resumes it
    losing_the_second_acknowledgement(session, backend.db)

    for attempt in range(2):
        state = await RunState.from_string(agent, saved)
        state.approve(state.get_interruptions()[0])
        try:
            await Runner.run(agent, state, session=session)
            break
        except StorageUnavailable:
            assert attempt == 0

    items = await session.get_items()
    assert [i.get("type", i.get("role")) for i in items] == [
        "user",
        "function_call",
        "function_call_output",
        "message",
    ]
    check_chat_completions(chat_completions(await ConversationStore(backend.db).transcript(CID)))


def failing_the_first_add(session: ConversationSession, db: Any, lost: str) -> None:
    """The session's first add fails: stored and its reply lost (`lost` "reply"), or its insert
    lost after the turn reserved its place ("insert")."""
    if lost == "reply":
        session.logger = session._appends.logger = LosesTheReplies(db, 1)
    else:
        messages = session.logger._messages
        messages.insert_many = _lost_once(messages.insert_many, after=0)


async def approved_pauses(agent: Agent[Any], db: Any, *prompts: str) -> list[RunState[Any]]:
    """One run per prompt on the conversation, each paused on its call, the call approved."""
    states = []
    for prompt in prompts:
        paused = await Runner.run(agent, prompt, session=ConversationSession(CID, db))
        state = paused.to_state()
        state.approve(state.get_interruptions()[0])
        states.append(state)
    return states


@pytest.mark.parametrize("lost", ["reply", "insert"])
async def test_a_worker_resuming_another_call_after_a_failed_resume_stores_that_calls_output(
    backend: Backend, lost: str
) -> None:
    """RUNTIMES.md (Retries): one approval worker (one task, one session object) resumes two
    paused runs in turn. Run X's add of its tool's output fails; the worker goes on to run
    Y, whose add answers another call: no retry of X's add (the calls a tool's output
    answers are part of what it is), so Y's output is stored and its call answered."""
    model = ScriptedModel()
    model.steps = [
        [call("book_train", {"train": "09:04"}, "call_x")],
        [call("book_train", {"train": "17:30"}, "call_y")],
        [text("Booked the 17:30.", "msg_y")],
    ]
    agent = Agent(name="assistant", model=model, tools=[book_train])
    x, y = await approved_pauses(agent, backend.db, "Book the 09:04.", "Book the 17:30.")
    worker = ConversationSession(CID, backend.db)
    failing_the_first_add(worker, backend.db, lost)

    with pytest.raises(StorageUnavailable):
        await Runner.run(agent, x, session=worker)
    resumed = await Runner.run(agent, y, session=worker)

    assert resumed.final_output == "Booked the 17:30."
    outputs = [i for i in await worker.get_items() if i.get("type") == "function_call_output"]
    x_output = "booked 09:04" if lost == "reply" else PENDING_RESULT
    assert [(o["call_id"], o["output"]) for o in outputs] == [
        ("call_x", x_output), ("call_y", "booked 17:30"),
    ]  # fmt: skip
    pending = [c.tool_call_id for c in await worker.store.pending_calls(CID)]
    assert "call_y" not in pending


async def test_a_resume_whose_tool_answers_otherwise_after_a_lost_reply_is_told_the_first_is_kept(
    backend: Backend,
) -> None:
    """RUNTIMES.md (Retries): the resumed run's add of its tool's output is stored and its
    reply lost; resumed again from the saved state, the tool answers the same call otherwise.
    That add is the failed one's retry (the same call answered): refused, saying the add
    that raised was stored and the history holds its answer, nothing written."""
    seats: list[str] = []

    @function_tool(needs_approval=True)
    def book_seat(train: str) -> str:
        """Book a seat on a train."""
        seats.append(train)
        return f"seat {len(seats)} on {train}"

    model = ScriptedModel()
    model.steps = [[call("book_seat", {"train": "09:04"}, "call_s")]]
    agent = Agent(name="assistant", model=model, tools=[book_seat])
    (paused,) = await approved_pauses(agent, backend.db, "A seat on the 09:04.")
    saved = paused.to_string()
    worker = ConversationSession(CID, backend.db)
    failing_the_first_add(worker, backend.db, "reply")
    with pytest.raises(StorageUnavailable):
        await Runner.run(agent, paused, session=worker)

    again = await RunState.from_string(agent, saved)
    with pytest.raises(Conflict, match=r"raised before .* was stored .* history holds") as refused:
        await Runner.run(agent, again, session=worker)

    assert "new turn_id" not in str(refused.value)
    outputs = [i for i in await worker.get_items() if i.get("type") == "function_call_output"]
    assert [o["output"] for o in outputs] == ["seat 1 on 09:04"]


async def test_a_call_the_person_rejects_in_the_sdk_is_stored_as_the_sdks_output_text(
    backend: Backend,
) -> None:
    """`RunState.reject` answers the call with the SDK's rejection text, an ordinary
    `function_call_output`: the session cannot tell it from a tool's output, so it is stored
    as one (no denial marker) and replayed as that text; the call is answered, not pending."""
    model = ScriptedModel()
    model.steps = [[call("book_train", {"train": "09:04"}, "call_r1")], [text("Not booked.", "m1")]]
    agent = Agent(name="assistant", model=model, tools=[book_train])
    paused = await Runner.run(
        agent, "Book the 09:04.", session=ConversationSession(CID, backend.db)
    )
    state = paused.to_state()
    state.reject(state.get_interruptions()[0])
    await Runner.run(agent, state, session=ConversationSession(CID, backend.db))

    store = ConversationStore(backend.db)
    stored = await store.transcript(CID)
    result = next(m for m in stored if m.role == "tool")
    assert (result.tool_call_id, result.content, result.error) == (
        "call_r1",
        "Tool execution was not approved.",
        None,
    )
    assert await store.pending_calls(CID) == []
    replayed = chat_completions(stored)
    assert {
        "role": "tool",
        "tool_call_id": "call_r1",
        "content": "Tool execution was not approved.",
    } in replayed


class DyingModel(ScriptedModel):
    """A `ScriptedModel` whose process dies (its next model call raises) while `dying`."""

    dying = False

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        if self.dying:
            raise ConnectionError("the process died after its tool output was stored")
        return await super().get_response(*args, **kwargs)


async def test_a_run_resumed_again_after_its_output_was_stored_is_refused_and_a_new_run_goes_on(
    backend: Backend,
) -> None:
    """The approval resumes the paused run in one process, which stores the tool's output and
    dies before its next model call; another process resumes the same saved state: the tool's
    output again answers an answered call (`AnsweredBefore`, nothing stored twice). A new run
    on the session, with no new input, goes on from the stored output."""
    model = DyingModel()
    model.steps = [[call("book_train", {"train": "09:04"}, "call_b1")], [text("Booked.", "m1")]]
    agent = Agent(name="assistant", model=model, tools=[book_train])
    paused = await Runner.run(
        agent, "Book the 09:04.", session=ConversationSession(CID, backend.db, user_id="u")
    )
    saved = paused.to_state().to_string()

    def a_process() -> ConversationSession:
        return ConversationSession(CID, backend.db, user_id="u")

    for process, refused in ((1, ConnectionError), (2, AnsweredBefore)):
        state = await RunState.from_string(agent, saved)
        state.approve(state.get_interruptions()[0])
        model.dying = process == 1
        with pytest.raises(refused):
            await Runner.run(agent, state, session=a_process())

    again = await Runner.run(agent, [], session=a_process())
    assert again.final_output == "Booked."
    stored = await ConversationStore(backend.db).transcript(CID, user_id="u")
    assert [(m.role, m.tool_call_id) for m in stored] == [
        ("user", None),
        ("assistant", None),
        ("tool", "call_b1"),
        ("assistant", None),
    ]
    check_chat_completions(chat_completions(stored))


async def test_a_paused_call_answered_in_two_sessions_keeps_its_first_answer(
    backend: Backend,
) -> None:
    """Two sessions (two tabs) each add an output for one paused call: the first added is its
    answer, the other is refused (`AnsweredBefore`), nothing of it stored; repeating the first
    add stores nothing twice, and an add answering a call of its own is stored as before."""
    tab_a, tab_b = (ConversationSession(CID, backend.db, user_id="u") for _ in range(2))
    booking = {"type": "function_call", "name": "book_train", "arguments": "{}"}
    await tab_a.add_items(
        [{"role": "user", "content": "Book the 09:04."}, {**booking, "call_id": "call_b1"}]
    )
    denial = {"type": "function_call_output", "call_id": "call_b1", "output": "Not approved."}
    booked = {"type": "function_call_output", "call_id": "call_b1", "output": "Booked."}

    await tab_b.add_items([denial])
    with pytest.raises(AnsweredBefore, match="call_b1"):
        await tab_a.add_items([booked])
    stored = await ConversationStore(backend.db).transcript(CID, user_id="u")
    assert [m.content for m in stored if m.tool_call_id == "call_b1"] == ["Not approved."]
    await tab_a.add_items([{**booking, "call_id": "call_b2"}, {**booked, "call_id": "call_b2"}])
    assert len(await tab_a.get_items()) == 5


async def test_the_sdks_rejection_of_a_call_she_denied_first_is_refused_as_an_output(
    backend: Backend,
) -> None:
    """RUNTIMES.md "A denial she gave first": the person denies call_b1 over HTTP; the SDK's
    `RunState.reject` of it, from a state read before, reaches the session as an ordinary
    output ("A call the person rejects"), which to the store is a result: meeting her denial it
    stays refused (`AnsweredBefore`), nothing of the add stored; only a denial meeting a
    denial is dropped as settled (Pydantic AI's `ToolDenied`, a streamed refusal)."""
    session, store = (
        ConversationSession(CID, backend.db, user_id="u"),
        ConversationStore(backend.db),
    )
    booking = {"type": "function_call", "name": "book_train", "arguments": "{}"}
    await session.add_items(
        [{"role": "user", "content": "Book it."}, {**booking, "call_id": "call_b1"}]
    )
    served = {c.tool_call_id: c.message_id for c in await store.pending_calls(CID, user_id="u")}
    denial = {"role": "tool", "tool_call_id": "call_b1", "error": {"message": "tool call denied"}}
    await session.logger.log_messages(
        CID, [denial], user_id="u", owner_only=True, turn_id="her", answers_to=served
    )
    rejected = "Tool execution was not approved."
    before = await store.transcript(CID, user_id="u")

    with pytest.raises(AnsweredBefore, match="call_b1"):
        await session.add_items(
            [{"type": "function_call_output", "call_id": "call_b1", "output": rejected}]
        )

    assert await store.transcript(CID, user_id="u") == before


async def test_a_call_answered_in_two_sessions_while_its_turn_is_still_written_keeps_one_answer(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn making call_b1 reserved and its insert has not landed (its writer lost it,
    within `abandon_after`); two sessions (two tabs) each add an output for it: the first
    added is its answer, the other is refused (`AnsweredBefore`), nothing of it stored, as
    when the turn is stored; the items answer the call once when the turn lands."""
    logger = AgentMessageLogger(backend.db)
    asked = [
        {"role": "user", "content": "Book the 09:04."},
        {"role": "assistant", "tool_calls": [{"id": "call_b1", "function": {"name": "book"}}]},
    ]

    async def lost(*args: object, **kwargs: object) -> None:
        raise ConnectionError("the turn's insert has not landed")

    with monkeypatch.context() as writer:
        writer.setattr(logger._messages, "insert_many", lost)
        with pytest.raises(ConnectionError):
            await logger.log_messages(CID, asked, turn_id="t1", user_id="u")
    tab_a, tab_b = (ConversationSession(CID, backend.db, user_id="u") for _ in range(2))
    booked = {"type": "function_call_output", "call_id": "call_b1", "output": "Booked."}
    denial = {"type": "function_call_output", "call_id": "call_b1", "output": "Not approved."}

    await tab_a.add_items([booked])
    with pytest.raises(AnsweredBefore, match="call_b1"):
        await tab_b.add_items([denial])
    await logger.log_messages(CID, asked, turn_id="t1", user_id="u")

    stored = await ConversationStore(backend.db).transcript(CID, user_id="u")
    assert [m.content for m in stored if m.tool_call_id == "call_b1"] == ["Booked."]
    outputs = [i.get("output") for i in await tab_b.get_items()]
    assert [o for o in outputs if o is not None] == ["Booked."]


@pytest.mark.parametrize(("again_by", "runtime"), STALE_RESUMES)
async def test_an_output_added_after_its_conversation_was_deleted_is_refused_nothing_stored(
    backend: Backend, again_by: str | None, runtime: str | None
) -> None:
    """The run paused on call_b1; the person deleted the conversation (and maybe started a
    new chat under its id); the runtime resumes, approved, and its session adds the tool's
    output. No message of the conversation makes call_b1 now: the add is refused as an
    `answers_to` naming such a call is, nothing stored: the conversation missing is never
    created (NotFound to a session acting for the user), the new chat takes no output for a
    call it never made (InvalidInput naming the call), also another user's chat a service's
    session adds to (was: stored, the conversation created again holding only the output,
    or the output appended to the new chat)."""
    store = ConversationStore(backend.db)
    await AgentMessageLogger(backend.db).upsert_conversation(CID, user_id="u")
    session = ConversationSession(CID, backend.db, user_id=runtime)
    booking = {"type": "function_call", "name": "book_train", "arguments": "{}"}
    await session.add_items(
        [{"role": "user", "content": "Book the 09:04."}, {**booking, "call_id": "call_b1"}]
    )
    stale = await deleted_while_paused(backend.db, CID, again_by, "call_b1")
    booked = {"type": "function_call_output", "call_id": "call_b1", "output": "Booked."}

    with pytest.raises(stale.refused, match=stale.said):
        await session.add_items([booked])

    await stale.left_as_it_was(store, CID)


async def test_an_output_whose_call_was_popped_is_refused_while_the_next_turn_is_in_flight() -> (
    None
):
    """The runtime popped its paused call_b1, and the person's next message is still being
    written (its insert lost, the client retries): the session's later output of call_b1 is
    refused InvalidInput naming the call, as once that message lands, nothing stored (was:
    left out of the turn's `answers_to` while any turn was in flight, stored as an orphan
    output before the person's message)."""
    db = AsyncMongoMockClient(tz_aware=True)["popped_in_flight"]
    await AgentMessageLogger(db).upsert_conversation(CID, user_id="u")
    session = ConversationSession(CID, db, user_id="u")
    booking = {"type": "function_call", "name": "book_train", "arguments": "{}"}
    await session.add_items(
        [{"role": "user", "content": "Book the 09:04."}, {**booking, "call_id": "call_b1"}]
    )
    await session.pop_item()
    person = AgentMessageLogger(db)
    hello = partial(
        person.log_messages,
        CID,
        [{"role": "user", "content": "Hello?"}],
        user_id="u",
        turn_id="p-1",
    )
    await reserved_insert_lost(person, hello)
    booked = {"type": "function_call_output", "call_id": "call_b1", "output": "Booked."}

    with pytest.raises(InvalidInput, match="no message of this conversation makes call 'call_b1'"):
        await session.add_items([booked])

    await hello()
    said = [m.content for m in await ConversationStore(db).transcript(CID, user_id="u")]
    assert said == ["Book the 09:04.", "Hello?"]


async def test_a_result_whose_call_was_popped_is_refused_and_left_out_of_the_items(
    backend: Backend,
) -> None:
    """The run pauses for approval, the runtime pops the paused call, and the approved run
    resumes: the SDK saves the tool's result, which answers no call left. The add is refused
    (`InvalidInput` naming the call, nothing stored: no message of the conversation makes
    it, RUNTIMES.md; it was stored as an orphan), and the next run's model is not given it
    (the Responses API refuses an output answering no call)."""
    model = ScriptedModel()
    model.steps = [
        [call("book_train", {"train": "09:04"}, "call_b1")],
        [text("Booked.", "msg_1")],
        [text("Anything else?", "msg_2")],
    ]
    agent = Agent(name="assistant", model=model, tools=[book_train])
    session = ConversationSession(CID, backend.db)
    paused = await Runner.run(agent, "Book the 09:04.", session=session)
    await session.pop_item()
    state = paused.to_state()
    state.approve(state.get_interruptions()[0])
    with pytest.raises(InvalidInput, match="no message of this conversation makes call 'call_b1'"):
        await Runner.run(agent, state, session=session)
    assert not any(m.tool_call_id for m in await session.store.transcript(CID))

    await Runner.run(agent, "Thanks.", session=session)

    assert [i.get("type", i.get("role")) for i in model.inputs[-1]] == ["user", "user"]


async def test_a_pop_of_another_writers_message_of_several_items_removes_nothing(
    backend: Backend,
) -> None:
    """`pop_item` removes one item, as `SQLiteSession` does. Another runtime's message may
    make several (a text and two calls): removing it would remove items the pop does not
    return, so the pop is refused, nothing removed; the store's own pop removes it whole."""
    response = AssistantMessage(
        content="I will book two seats.",
        tool_calls=[
            ToolCall(id=f"c{n}", function=FunctionCall(name="book", arguments=f'{{"n":{n}}}'))
            for n in (1, 2)
        ],
    )
    await AgentMessageLogger(backend.db).log_messages(
        CID, [UserMessage(content="book it"), response], turn_id="other-runtime"
    )
    session = ConversationSession(CID, backend.db)
    items = await session.get_items()
    assert len(items) == 4

    with pytest.raises(Conflict, match=re.escape("makes 3 items")):
        await session.pop_item()

    assert await session.get_items() == items
    popped = await session.store.pop_last_message(CID)
    assert popped is not None
    assert popped.content == response.content


async def test_a_refused_pop_says_the_messages_making_no_item_after_it_went(
    backend: Backend,
) -> None:
    """A message making no item (another writer's error note) is removed on the way; the pop
    then meets a message of several items and is refused: the refusal says that message was
    not removed, not that nothing was (the note went)."""
    response = AssistantMessage(
        content="Booking.",
        tool_calls=[ToolCall(id="c1", function=FunctionCall(name="book", arguments="{}"))],
    )
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [UserMessage(content="book it"), response], turn_id="t1")
    note = AssistantMessage(error=MessageError(message="the provider failed"))
    await logger.log_messages(CID, [note], turn_id="t2")
    session = ConversationSession(CID, backend.db)

    with pytest.raises(Conflict) as refused:
        await session.pop_item()

    assert "nothing was removed" not in str(refused.value)
    assert "it was not removed" in str(refused.value)
    stored = await session.store.transcript(CID)
    assert [m.content for m in stored] == ["book it", "Booking."]


async def test_a_session_of_one_user_neither_reads_nor_writes_anothers(backend: Backend) -> None:
    await ConversationSession(CID, backend.db, user_id="alice").add_items(
        [{"role": "user", "content": "mine"}]
    )
    intruder = ConversationSession(CID, backend.db, user_id="mallory")

    assert await intruder.get_items() == []
    with pytest.raises(NotFound, match=re.escape(f"conversation {CID!r} was not found")):
        await intruder.add_items([{"role": "user", "content": "yours now"}])
    assert await intruder.pop_item() is None


async def test_a_users_session_never_adopts_a_conversation_a_service_logged(
    backend: Backend,
) -> None:
    """A service's (unowned) conversation is to a user's session what it is to her token: it
    reads empty, a write is NotFound and nothing is written, and a pop or a clear takes
    nothing. A service that means her to have it assigns it (`upsert_conversation`)."""
    logger = AgentMessageLogger(backend.db)
    secret = {"role": "system", "content": "internal: api key sk-SERVICE"}
    await logger.log_messages(CID, [secret], turn_id="svc-0")
    session = ConversationSession(CID, backend.db, user_id="user-ada")

    assert await session.get_items() == []
    with pytest.raises(NotFound, match=re.escape(f"conversation {CID!r} was not found")):
        await session.add_items([{"role": "user", "content": "hi"}])
    assert await session.pop_item() is None
    await session.clear_session()
    stored = await session.store.get_conversation(CID)
    assert stored.user_id is None
    assert [m.content for m in await session.store.transcript(CID)] == [secret["content"]]

    await logger.upsert_conversation(CID, user_id="user-ada")  # the service assigns it
    await session.add_items([{"role": "user", "content": "hi"}])
    assert len(await session.get_items()) == 2


async def test_a_session_given_the_legacy_turns_never_takes_another_users_unmigrated_id(
    backend: Backend,
) -> None:
    """During a migration the session takes the logger and store the service wires to the
    legacy turns (MIGRATION.md, Transition flags): another user's conversation not migrated
    yet is NotFound to a user's session, as to her token, and nothing is written."""
    wired = await another_users_legacy_turn(backend.db, CID)
    session = ConversationSession(CID, backend.db, user_id="user-ada", **wired)

    with pytest.raises(NotFound, match=re.escape(f"conversation {CID!r} was not found")):
        await session.add_items([{"role": "user", "content": "ada squats"}])
    assert await session.get_items() == []
    assert await backend.db[CONVERSATIONS].count_documents({}) == 0


async def test_adding_costs_two_round_trips_reading_one_and_clearing_ten(
    wire_backend: Backend,
) -> None:
    assert wire_backend.commands is not None
    session = ConversationSession(CID, wire_backend.db, rules=COUNTED)
    model = ScriptedModel()
    agent = Agent(name="assistant", model=model, tools=[get_weather, get_time])
    await Runner.run(agent, PROMPTS[0], session=session)

    wire_backend.commands.clear()
    await session.add_items(
        [{"role": "user", "content": "one more"}, {"role": "user", "content": "and another"}]
    )
    assert wire_backend.commands.names == ["findAndModify", "insert"]

    for limit in (None, 3):
        wire_backend.commands.clear()
        await session.get_items(limit)  # its messages, and its document read with them
        assert wire_backend.commands.names == ["find", "find"]

    wire_backend.commands.clear()
    await session.clear_session()
    # The conversation, the record of the deletion in progress (a repeated clear finishes one
    # that failed part-way), the mark on its document (no turn writes to it from then), its
    # LangGraph checkpoints (none here), a lookup that finds it still
    # the conversation the first found (a delete racing another never takes a conversation
    # started under the id since), its messages, its cut texts' files (none here), its
    # document, a look for messages a turn in flight may have inserted meanwhile, and the
    # record's removal.
    assert wire_backend.commands.names == [
        "find",
        "insert",
        "update",
        "delete",
        "find",
        "delete",
        "find",
        "findAndModify",
        "find",
        "delete",
    ]


async def test_items_added_again_after_a_failed_add_was_popped_are_stored(
    backend: Backend,
) -> None:
    """The SDK rewinds a turn it is about to retry by popping what it added: an add that
    raised (its reply lost, its items stored), then popped, is added again as a new turn."""
    session = ConversationSession(CID, backend.db)
    await session.add_items([{"role": "user", "content": "hello"}])
    real = session.logger.log_messages
    lost = {"done": False}

    async def reply_lost(*args: Any, **kwargs: Any) -> Any:
        logged = await real(*args, **kwargs)
        if not lost["done"]:
            lost["done"] = True
            raise StorageUnavailable("the reply was lost")
        return logged

    session.logger.log_messages = reply_lost  # type: ignore[method-assign]
    item: TResponseInputItem = {"role": "user", "content": "book it"}
    with pytest.raises(StorageUnavailable):
        await session.add_items([item])
    popped = await session.pop_item()
    await session.add_items([item])

    assert popped is not None
    assert popped.get("content") == "book it"
    assert [i.get("content") for i in await session.get_items()] == ["hello", "book it"]


async def test_a_pop_from_another_task_leaves_a_failed_runs_retry_to_it(backend: Backend) -> None:
    """Run A's step is stored and its reply lost; run B, in another task, adds its input and
    pops it; run A runs again: its adds are its retry, each stored once."""
    session = sharing(backend.db, 2)
    a_failed, b_popped = asyncio.Event(), asyncio.Event()

    async def run_a() -> None:
        await session.add_items(A_ASKED)
        with pytest.raises(StorageUnavailable):
            await session.add_items(NUMBERED_STEP)
        a_failed.set()
        await b_popped.wait()
        await session.add_items(A_ASKED)
        await session.add_items(NUMBERED_STEP)

    async def run_b() -> None:
        await a_failed.wait()
        await session.add_items(B_ASKED)
        assert await session.pop_item() == B_ASKED[0]
        b_popped.set()

    await asyncio.gather(run_a(), run_b())

    assert await session.get_items() == A_ASKED + NUMBERED_STEP


async def test_a_failed_add_whose_items_a_pop_removed_is_stored_again_by_its_retry(
    backend: Backend,
) -> None:
    """Run A's step is stored and its reply lost; another task pops the step's items; run A
    runs again: its input is its retry, stored once, and its step, popped, is stored anew (a
    retry of the popped turn would be a Conflict)."""
    session = sharing(backend.db, 2)
    a_failed, popped = asyncio.Event(), asyncio.Event()

    async def run_a() -> None:
        await session.add_items(A_ASKED)
        with pytest.raises(StorageUnavailable):
            await session.add_items(NUMBERED_STEP)
        a_failed.set()
        await popped.wait()
        await session.add_items(A_ASKED)
        await session.add_items(NUMBERED_STEP)

    async def pop_the_step() -> None:
        await a_failed.wait()
        assert [await session.pop_item() for _ in NUMBERED_STEP] == NUMBERED_STEP[::-1]
        popped.set()

    await asyncio.gather(run_a(), pop_the_step())

    assert await session.get_items() == A_ASKED + NUMBERED_STEP
