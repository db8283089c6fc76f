"""LangChain's RunnableWithMessageHistory over a fake chat model, its history in the store,
compared with the history langchain-mongodb ships on the same calls."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from functools import reduce
from typing import Any

import bson
import mongomock
import pytest
from langchain_core.chat_history import BaseChatMessageHistory
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.load import dumpd
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.runnables.history import RunnableWithMessageHistory
from langchain_mongodb import MongoDBChatMessageHistory
from mongomock_motor import AsyncMongoMockClient
from pydantic import BaseModel
from pymongo import MongoClient
from pymongo.errors import AutoReconnect

from agent_store import (
    AgentMessageLogger,
    AnsweredBefore,
    Conflict,
    ConversationStore,
    InvalidInput,
    NotFound,
    RuntimeContextMarkers,
    StorageUnavailable,
    TurnRules,
    Unsupported,
)
from agent_store.core import DENIED_RESULT, FAILED_RESULT, INTERRUPTED_RESULT, MAX_PARAMS_DEPTH
from agent_store.integrations.exports import chat_completions, check_chat_completions
from agent_store.integrations.langchain import ConversationChatHistory, message_from_langchain
from agent_store.store import CONVERSATIONS, MESSAGES
from tests.api_harness import STALE_RESUMES, another_users_legacy_turn, deleted_while_paused
from tests.conftest import COUNTED, Backend, CommandLog, StoreClocks

pytestmark = [
    # RunnableWithMessageHistory is what the issue asks to drop the history into; LangChain
    # now points at LangGraph persistence instead and says so with a warning.
    pytest.mark.filterwarnings("ignore::langchain_core._api.LangChainDeprecationWarning"),
]

CID = "conv-langchain"
CONFIG: Any = {"configurable": {"session_id": CID}}


def fake_model() -> GenericFakeChatModel:
    """Turn 1 asks for two tool calls; turn 2 answers them with usage; turn 3 says goodbye."""
    return GenericFakeChatModel(
        messages=iter(
            [
                AIMessage(
                    content="",
                    tool_calls=[
                        {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_w1"},
                        {"name": "get_weather", "args": {"city": "Lyon"}, "id": "call_w2"},
                    ],
                    usage_metadata={"input_tokens": 20, "output_tokens": 9, "total_tokens": 29},
                ),
                AIMessage(
                    content="Paris 18 °C, Lyon 21 °C.",
                    usage_metadata={"input_tokens": 41, "output_tokens": 7, "total_tokens": 48},
                ),
                AIMessage(content="You're welcome."),
            ]
        )
    )


TURNS: list[list[BaseMessage]] = [
    [SystemMessage("Answer briefly."), HumanMessage("Weather in Paris and Lyon?")],
    [
        ToolMessage('{"temp_c": 18}', tool_call_id="call_w1"),
        ToolMessage("Lyon is not a known city", tool_call_id="call_w2", status="error"),
    ],
    [HumanMessage("Thanks!")],
]


class Recording(BaseChatMessageHistory):
    """Wraps a history and keeps every message written through it, in order."""

    def __init__(self, inner: BaseChatMessageHistory) -> None:
        self.inner = inner
        self.written: list[BaseMessage] = []

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        return self.inner.messages

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        self.written += messages
        self.inner.add_messages(messages)

    async def aget_messages(self) -> list[BaseMessage]:
        return await self.inner.aget_messages()

    async def aadd_messages(self, messages: Sequence[BaseMessage]) -> None:
        self.written += messages
        await self.inner.aadd_messages(messages)

    def clear(self) -> None:
        self.inner.clear()


async def three_turns(history: BaseChatMessageHistory) -> list[BaseMessage]:
    """Runs the three turns through RunnableWithMessageHistory; answers the model's replies."""
    chain = RunnableWithMessageHistory(fake_model(), lambda session_id: history)
    return [await chain.ainvoke(turn, CONFIG) for turn in TURNS]


def visible(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """What a chat model is shown of a history: everything but the run-assigned message ids."""
    return [m.model_dump(exclude={"id"}) for m in messages]


async def test_messages_read_back_equal_the_ones_written(backend: Backend) -> None:
    history = Recording(ConversationChatHistory(CID, backend.db))

    replies = await three_turns(history)

    read_back = await history.aget_messages()
    assert read_back == history.written
    assert len(read_back) == 8
    assert [type(m).__name__ for m in read_back[:5]] == [
        "SystemMessage", "HumanMessage", "AIMessage", "ToolMessage", "ToolMessage",
    ]  # fmt: skip
    assert read_back[2] == replies[0]  # ids, tool calls and usage kept
    assert read_back[4].status == "error"  # type: ignore[attr-defined]


async def test_a_message_whose_own_form_is_over_the_bound_is_stored_bounded_and_read_back_whole(
    backend: Backend,
) -> None:
    """An image block in a LangChain message: the store keeps it in GridFS, not the message."""
    bound = TurnRules(max_message_bytes=16 * 1024)
    history = ConversationChatHistory(CID, backend.db, user_id="u-1", rules=bound)
    image = {"type": "image", "base64": "iVBOR" * 20_000, "mime_type": "image/png"}
    question = HumanMessage(content=[{"type": "text", "text": "What is this?"}, image], id="h1")

    await history.aadd_messages([question])

    (stored,) = await backend.db["agent_messages"].find({"conversation_id": CID}).to_list()
    assert len(bson.encode(stored)) <= 16 * 1024
    assert stored["content"] == "What is this?\n[image]"
    assert stored["native"] is None
    assert stored["truncated"]["native"]["blob_id"]
    assert await history.aget_messages() == [question]


async def test_a_call_awaiting_approval_whose_arguments_were_cut_is_read_back_whole(
    backend: Backend,
) -> None:
    """The runtime resuming the approved call runs it on the arguments it stored."""
    bound = TurnRules(max_message_bytes=16 * 1024)
    history = ConversationChatHistory(CID, backend.db, user_id="u-1", rules=bound)
    args = {"to": "all@corp", "body": "x" * 100_000}
    call = AIMessage(content="", tool_calls=[{"id": "c-1", "name": "send_mail", "args": args}])

    await history.aadd_messages([HumanMessage("mail everyone"), call])

    stored = await backend.db["agent_messages"].find_one({"role": "assistant"})
    assert stored is not None
    assert "tool_calls.0.function.arguments" in stored["truncated"]
    back = await history.aget_messages()
    assert isinstance(back[-1], AIMessage)
    assert back[-1].tool_calls[0]["args"] == args


@pytest.mark.parametrize("number", [1, 10**20])
async def test_hidden_context_in_a_human_messages_kwargs_is_never_stored_nor_replayed(
    backend: Backend, number: int
) -> None:
    """Markers holding a line break, which JSON text escapes: a value holding a number BSON
    cannot hold as it is (kept as its JSON text) is stripped as the value it spells."""
    markers = RuntimeContextMarkers(start="<<CONTEXT\n", end="\nCONTEXT>>")
    history = ConversationChatHistory(CID, backend.db, rules=TurnRules(markers=markers))
    note = f"visible {markers.start}SECRET-4242{markers.end} text"
    human = HumanMessage("hi", id="h1", additional_kwargs={"note": note, "n": number})
    await history.aadd_messages([human, AIMessage("x", id="a1")])

    stored = json.dumps(await backend.db[MESSAGES].find({}).to_list(None), default=str)
    assert "SECRET-4242" not in stored
    read_back = await history.aget_messages()
    assert read_back[0].additional_kwargs == {"note": "visible  text", "n": number}


async def test_messages_are_stored_as_chat_messages_ordered_by_seq(backend: Backend) -> None:
    await three_turns(ConversationChatHistory(CID, backend.db, user_id="u1"))
    store = ConversationStore(backend.db)

    transcript = await store.transcript(CID)
    assert [m.role for m in transcript] == [
        "system", "user", "assistant", "tool", "tool", "assistant", "user", "assistant",
    ]  # fmt: skip
    assert [m.seq for m in transcript] == list(range(8))
    calls = transcript[2].tool_calls
    assert calls is not None
    assert [(c.id, c.function.arguments) for c in calls] == [
        ("call_w1", '{"city":"Paris"}'),
        ("call_w2", '{"city":"Lyon"}'),
    ]
    assert transcript[2].content is None
    assert transcript[4].error is not None
    assert transcript[4].error.message == "tool call failed"
    conversation = await store.get_conversation(CID, user_id="u1")
    assert (conversation.turn_count, conversation.usage.input_tokens) == (2, 61)


def langchain_mongodb_history(backend: Backend, database: Any) -> MongoDBChatMessageHistory:
    """langchain-mongodb's own history: on mongomock beside mongomock, else on the wire server."""
    if backend.name == "mongomock":
        client: Any = mongomock.MongoClient()
        return MongoDBChatMessageHistory(None, CID, "peer", client=client, create_index=False)
    return MongoDBChatMessageHistory(
        None, CID, database.name, collection_name="peer", client=database.client
    )


@pytest.fixture
def peer_database(backend: Backend, request: pytest.FixtureRequest) -> Any:
    return None if backend.name == "mongomock" else request.getfixturevalue("database")


async def test_the_visible_history_is_langchain_mongodbs_on_the_same_calls(
    backend: Backend, peer_database: Any
) -> None:
    ours = ConversationChatHistory(CID, backend.db)
    theirs = langchain_mongodb_history(backend, peer_database)

    our_replies = await three_turns(ours)
    their_replies = await three_turns(theirs)

    assert visible(our_replies) == visible(their_replies)
    assert visible(await ours.aget_messages()) == visible(theirs.messages)
    await ours.aclear()
    theirs.clear()
    assert await ours.aget_messages() == theirs.messages == []


def test_three_turns_cost_seven_round_trips_here_and_eight_inserts_there(
    wire_uri: str,
) -> None:
    """The sync path over the wire: our turn is two writes, and a read before them for the
    turn answering the first one's calls (which messages made them); langchain-mongodb's
    turn is one insert per message."""
    ours, theirs = CommandLog(), CommandLog()
    name = f"rt_{uuid.uuid4().hex[:8]}"
    with (
        MongoClient(wire_uri, tz_aware=True, event_listeners=[ours]) as our_client,
        MongoClient(wire_uri, event_listeners=[theirs]) as their_client,
    ):
        history = ConversationChatHistory(CID, our_client[name], rules=COUNTED)
        peer = MongoDBChatMessageHistory(
            None, CID, name, collection_name="peer", client=their_client, create_index=False
        )
        for turn, reply in zip(TURNS, fake_model().messages, strict=True):
            history.add_messages([*turn, reply])
            peer.add_messages([*turn, reply])
        written = ["findAndModify", "insert"]
        assert ours.names == [*written, "find", *written, *written]
        assert theirs.names == ["insert"] * 8
        ours.clear()
        assert visible(history.messages) == visible(peer.messages)
        assert ours.names == ["find", "find"]  # its messages and its document
        our_client.drop_database(name)


def test_the_sync_methods_work_with_the_sync_driver(database: Any) -> None:
    history = ConversationChatHistory(CID, database)
    chain = RunnableWithMessageHistory(fake_model(), lambda session_id: history)

    replies = [chain.invoke(turn, CONFIG) for turn in TURNS]

    assert history.messages[-1] == replies[-1]
    assert len(history.messages) == 8
    history.clear()
    assert history.messages == []


def test_a_history_on_a_client_is_refused_saying_to_pass_a_database(client: Any) -> None:
    with pytest.raises(TypeError, match=re.escape("pass a database, client[name]")):
        ConversationChatHistory(CID, client)


async def test_the_sync_methods_of_an_async_history_say_what_to_use(backend: Backend) -> None:
    history = ConversationChatHistory(CID, backend.db)
    with pytest.raises(Unsupported, match="use aget_messages, aadd_messages and aclear"):
        history.add_messages([HumanMessage("hi")])


async def test_hidden_runtime_context_is_stripped_before_anything_is_stored(
    backend: Backend,
) -> None:
    history = ConversationChatHistory(CID, backend.db)
    hidden = "[RUNTIME CONTEXT]tier=gold[/RUNTIME CONTEXT]"
    await history.aadd_messages(
        [
            HumanMessage(f"{hidden} Hello"),
            HumanMessage(
                [{"type": "text", "text": f"{hidden}Look"}, {"type": "image", "url": "u"}]
            ),
        ]
    )

    read_back = await history.aget_messages()
    assert read_back[0].content == "Hello"
    assert read_back[1].content == [{"type": "text", "text": "Look"}, {"type": "image", "url": "u"}]
    documents = await backend.db.agent_messages.find({}).to_list(None)
    assert "tier=gold" not in json.dumps(documents, default=str)


async def test_other_writers_messages_come_back_as_langchain_messages(backend: Backend) -> None:
    calls = [{"id": "call_1", "function": {"name": "lookup", "arguments": '{"q":"x"}'}}]
    await AgentMessageLogger(backend.db).log_messages(
        CID,
        [
            {"role": "user", "content": "Find x"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "found"},
            {"role": "assistant", "error": {"message": "model overloaded"}},
            {
                "role": "assistant",
                "native": {"format": "openai-agents", "set": {"type": "reasoning"}},
            },
            {"role": "assistant", "content": "Here it is.", "token_usage": {"input_tokens": 3}},
        ],
    )

    read_back = await ConversationChatHistory(CID, backend.db).aget_messages()

    assert read_back == [
        HumanMessage("Find x"),
        AIMessage("", tool_calls=[{"name": "lookup", "args": {"q": "x"}, "id": "call_1"}]),
        ToolMessage("found", tool_call_id="call_1"),
        AIMessage(
            "Here it is.",
            usage_metadata={"input_tokens": 3, "output_tokens": 0, "total_tokens": 3},
        ),
    ]


@pytest.mark.parametrize(
    ("message", "error"),
    [
        pytest.param(
            AIMessage("", tool_calls=[{"name": "f", "args": {}, "id": None}]),
            r"invalid message 0 \(ai\): tool call 0 has no id",
            id="call-without-id",
        ),
        pytest.param(
            ChatMessage("beep", role="robot"),
            "invalid message 0: a ChatMessage; the store takes HumanMessage",
            id="other-kind",
        ),
    ],
)
def test_messages_the_store_cannot_take_are_refused_naming_them(
    message: BaseMessage, error: str
) -> None:
    with pytest.raises(InvalidInput, match=error):
        message_from_langchain(message)


WEI = 10**20
"""100 ETH in wei: plain JSON, wider than the 64 bits a BSON integer holds."""


def as_json(messages: Sequence[BaseMessage]) -> list[str]:
    """Messages as JSON text, where NaN equals NaN."""
    return [json.dumps(m.model_dump(), sort_keys=True, default=str) for m in messages]


def _said(metadata: dict[str, Any]) -> list[BaseMessage]:
    return [HumanMessage("Hi", id="h1"), AIMessage("Hello", id="a1", response_metadata=metadata)]


@pytest.mark.parametrize(
    "turn",
    [
        pytest.param(
            [
                HumanMessage("What is my balance?", id="h1"),
                AIMessage("", id="a1", tool_calls=[{"name": "balance", "args": {}, "id": "c1"}]),
                ToolMessage("100 ETH", tool_call_id="c1", id="t1", artifact={"wei": WEI}),
                AIMessage("You hold 100 ETH.", id="a2"),
            ],
            id="artifact-wider-than-64-bits",
        ),
        pytest.param(_said({"seed": WEI}), id="metadata-wider-than-64-bits"),
        pytest.param(_said({"logprobs": [{"logprob": float("-inf")}]}), id="infinity"),
        pytest.param(_said({"logprob": float("nan")}), id="nan"),
    ],
)
async def test_a_number_bson_cannot_hold_as_it_is_is_kept_as_json_text_and_read_back_equal(
    backend: Backend, turn: list[BaseMessage]
) -> None:
    """Never the whole turn refused, never the number changed (a JSON dump writes NaN as null)."""
    history = ConversationChatHistory(CID, backend.db, user_id="u-1")

    await history.aadd_messages(turn)

    assert as_json(await history.aget_messages()) == as_json(turn)
    docs = await backend.db["agent_messages"].find({"conversation_id": CID}).to_list()
    (native,) = [d["native"] for d in docs if d["native"] and d["native"]["json_text"]]
    assert all(isinstance(native["set"][key], str) for key in native["json_text"])


async def test_a_calls_args_holding_nan_or_an_infinity_are_stored_and_read_back_equal(
    backend: Backend,
) -> None:
    """LangChain's parsers read a model's `{"rate": NaN}` as a float: the turn is kept, the
    arguments as JSON text (never refused: under RunnableWithMessageHistory that is lost)."""
    history = ConversationChatHistory(CID, backend.db, user_id="u-1")
    args = {"rate": float("nan"), "cap": float("inf")}
    turn = [
        HumanMessage("Convert 5 EUR to USD", id="h1"),
        AIMessage("", id="a1", tool_calls=[{"name": "convert", "args": args, "id": "c1"}]),
        ToolMessage("no rate", tool_call_id="c1", id="t1"),
        AIMessage("The rate is unknown.", id="a2"),
    ]

    await history.aadd_messages(turn)

    assert as_json(await history.aget_messages()) == as_json(turn)
    call = await backend.db["agent_messages"].find_one({"tool_calls": {"$ne": None}})
    assert call["tool_calls"][0]["function"]["arguments"] == '{"rate":NaN,"cap":Infinity}'


async def test_a_key_the_store_cannot_take_in_a_field_native_keeps_is_refused_naming_it(
    backend: Backend,
) -> None:
    history = ConversationChatHistory(CID, backend.db, user_id="u-1")

    with pytest.raises(InvalidInput) as refused:
        await history.aadd_messages(_said({"a\x00b": 1}))

    assert str(refused.value) == (
        "invalid message 1 (ai): native.set.response_metadata: keys must not contain NUL characters"
    )
    assert await backend.db["agent_messages"].count_documents({}) == 0


async def _refusal_writing_nothing(backend: Backend, metadata: dict[str, Any]) -> str:
    """The words of the InvalidInput a turn answered with `metadata` is refused with (in
    bounded time: a walk that never ends fails the test), nothing written."""
    history = ConversationChatHistory(CID, backend.db, user_id="u-1")
    with pytest.raises(InvalidInput) as refused:
        await asyncio.wait_for(history.aadd_messages(_said(metadata)), timeout=30)
    assert await backend.db["agent_messages"].count_documents({}) == 0
    return str(refused.value)


@pytest.mark.parametrize(
    ("metadata", "where", "escape"),
    [
        pytest.param({"s": "\ud800"}, "response_metadata.s", "\\ud800", id="alone"),
        pytest.param({"rate": float("nan"), "s": "\ud800"}, "response_metadata.s", "\\ud800",
                     id="beside-nan"),
        pytest.param({"seed": 10**20, "l": ["\udfff"]}, "response_metadata.l.0", "\\udfff",
                     id="beside-a-wide-integer"),
    ],
)  # fmt: skip
async def test_a_lone_surrogate_is_refused_naming_its_field_even_beside_a_wide_number(
    backend: Backend, metadata: dict[str, Any], where: str, escape: str
) -> None:
    """Checked before the value is kept as JSON text: never the store's own `json_text`
    named, never the path inside the value lost."""
    words = await _refusal_writing_nothing(backend, metadata)

    assert words.startswith(f"invalid message 1 (ai): native.set.{where}: ")
    assert f"lone UTF-16 surrogate ({escape})" in words
    assert "json_text" not in words


@pytest.mark.parametrize(
    ("metadata", "where"),
    [
        pytest.param({"\ud800k": 1}, "response_metadata", id="a-key"),
        pytest.param({"a": [{"\udfffk": "v"}]}, "response_metadata.a.0", id="a-nested-key"),
        pytest.param({"a": {"\ud800k": float("nan")}}, "response_metadata.a", id="beside-nan"),
    ],
)  # fmt: skip
async def test_a_key_holding_a_lone_surrogate_is_refused_naming_where_it_is(
    backend: Backend, metadata: dict[str, Any], where: str
) -> None:
    """A key is text as a value is: never the serializer's own words about a codec."""
    words = await _refusal_writing_nothing(backend, metadata)

    assert words.startswith(f"invalid message 1 (ai): {where}: a key holds a lone UTF-16 ")
    assert "codec" not in words


def _holding_itself() -> list[Any]:
    looped: list[Any] = []
    looped.append(looped)
    return looped


@pytest.mark.parametrize(
    ("metadata", "where"),
    [
        pytest.param({"l": _holding_itself()}, "response_metadata", id="a-list-holding-itself"),
        pytest.param({"d": reduce(lambda inner, _: {"k": inner}, range(200), {})},
                     "response_metadata", id="nested-200-levels"),
    ],
)  # fmt: skip
async def test_a_value_nested_too_deep_or_holding_itself_is_refused_not_walked_for_ever(
    backend: Backend, metadata: dict[str, Any], where: str
) -> None:
    words = await _refusal_writing_nothing(backend, metadata)

    assert words.startswith(f"invalid message 1 (ai): {where}: ")
    assert f"nest deeper than {MAX_PARAMS_DEPTH} levels" in words


class _Opaque:
    """A value of no JSON type, which no JSON text keeps."""


def _in_metadata(key: str, value: Any) -> tuple[list[BaseMessage], str]:
    return _said({key: value}), f"response_metadata.{key}"


@pytest.mark.parametrize(
    ("turn", "where", "kind"),
    [
        pytest.param(*_in_metadata("raw", b"\xff\x00"), "value of type bytes", id="no-utf8"),
        pytest.param(*_in_metadata("o", _Opaque()), "value of type _Opaque", id="an-object"),
        pytest.param(*_in_metadata("price", Decimal("19.90")), "value of type Decimal",
                     id="decimal"),
        pytest.param(*_in_metadata("at", datetime(2026, 1, 2, 3, 4, 5)),
                     "value of type datetime", id="datetime"),
        pytest.param(*_in_metadata("tags", {"a"}), "value of type set", id="set"),
        pytest.param(*_in_metadata("b", b"abc"), "value of type bytes", id="bytes"),
        pytest.param(_said({"n": {1: "x"}}), "response_metadata.n", "key of type int",
                     id="int-key"),
        pytest.param(
            [
                HumanMessage("Price?", id="h1"),
                AIMessage("", id="a1", tool_calls=[{"name": "price", "args": {}, "id": "c1"}]),
                ToolMessage("19.90", tool_call_id="c1", id="t1",
                            artifact={"deep": [{"price": Decimal("19.90")}]}),
            ],
            "artifact.deep.0.price", "value of type Decimal", id="in-an-artifact",
        ),
    ],
)  # fmt: skip
async def test_a_value_that_would_not_come_back_as_it_is_is_refused_naming_it(
    backend: Backend, turn: list[BaseMessage], where: str, kind: str
) -> None:
    """As the Agents SDK session refuses it, and as LangChain's own `load(dumpd(...))` cannot
    give it back: never an error of the serializer's, never a value changed on the way back
    (a Decimal as text, a set as a list)."""
    history = ConversationChatHistory(CID, backend.db, user_id="u-1")

    with pytest.raises(InvalidInput) as refused:
        await history.aadd_messages(turn)

    subject = "message 2 (tool)" if where.startswith("artifact") else "message 1 (ai)"
    assert str(refused.value).startswith(f"invalid {subject}: {where}: ")
    assert f"a {kind} would not come back as it is" in str(refused.value)
    assert await backend.db["agent_messages"].count_documents({}) == 0


class _Parsed(BaseModel):
    """A structured output, as ChatOpenAI puts it in `additional_kwargs["parsed"]`."""

    answer: str
    score: float


async def test_a_model_in_a_field_comes_back_as_its_dict_as_messages_to_dict_gives_it(
    backend: Backend,
) -> None:
    """What `message.model_dump()` makes of it, as LangChain's own JSON histories give it
    back: never refused (that would lose the turn of every structured output)."""
    from langchain_core.messages import messages_from_dict, messages_to_dict

    history = ConversationChatHistory(CID, backend.db, user_id="u-1")
    said = AIMessage("x", id="a1", additional_kwargs={"parsed": _Parsed(answer="x", score=0.5)})

    await history.aadd_messages([HumanMessage("Hi", id="h1"), said])

    [_, read] = await history.aget_messages()
    assert read.additional_kwargs == {"parsed": {"answer": "x", "score": 0.5}}
    [langchains] = messages_from_dict(messages_to_dict([said]))
    assert read.additional_kwargs == langchains.additional_kwargs


async def test_a_tuple_comes_back_a_list_as_langchains_own_dumpd_writes_it(
    backend: Backend,
) -> None:
    history = ConversationChatHistory(CID, backend.db, user_id="u-1")

    await history.aadd_messages(_said({"pair": (1, "a")}))

    [_, said] = await history.aget_messages()
    assert said.response_metadata == {"pair": [1, "a"]}
    dumped = dumpd(_said({"pair": (1, "a")})[1])
    assert said.response_metadata == dumped["kwargs"]["response_metadata"]


async def test_an_answer_stored_a_turn_later_comes_back_right_after_its_call(
    backend: Backend,
) -> None:
    """A confirmation answered in a later turn (STREAMING.md): the history a chat model is
    given pairs every call with its result."""
    from langchain_core.messages.utils import convert_to_openai_messages

    from agent_store.integrations.exports import chat_completions_problems

    logger = AgentMessageLogger(backend.db)
    calls = [{"id": "tc-9", "function": {"name": "book_train", "arguments": "{}"}}]
    hitl = {"action": "book_train", "params": {}, "request_id": "confirm-9"}
    await logger.log_messages(
        CID,
        [
            {"role": "user", "content": "Book the 09:04."},
            {"role": "assistant", "content": "I can book it.", "tool_calls": calls},
            {"role": "assistant", "content": "Pay €35?", "hitl_action": hitl},
        ],
        turn_id="t1",
    )
    await logger.log_messages(
        CID,
        [
            {"role": "user", "content": "Yes, book it."},
            {"role": "tool", "tool_call_id": "tc-9", "content": "B-42"},
            {"role": "assistant", "content": "Booked: B-42."},
        ],
        turn_id="t2",
    )

    read_back = await ConversationChatHistory(CID, backend.db).aget_messages()

    assert [type(m).__name__ for m in read_back] == [
        "HumanMessage", "AIMessage", "ToolMessage", "AIMessage", "HumanMessage", "AIMessage",
    ]  # fmt: skip
    assert chat_completions_problems(convert_to_openai_messages(read_back)) == []


async def test_a_real_result_stored_after_a_stand_in_is_the_calls_one_answer(
    backend: Backend,
) -> None:
    from langchain_core.messages.utils import convert_to_openai_messages

    from agent_store.core import stand_in_result
    from agent_store.integrations.exports import chat_completions_problems

    logger = AgentMessageLogger(backend.db)
    calls = [{"id": "tc-1", "function": {"name": "search", "arguments": "{}"}}]
    stand_in = stand_in_result("tc-1", datetime(2025, 1, 1, tzinfo=UTC))
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "Search"}, {"role": "assistant", "tool_calls": calls},
         stand_in.model_dump(by_alias=True)],
        turn_id="t1",
    )  # fmt: skip
    await logger.log_messages(
        CID,
        [{"role": "tool", "tool_call_id": "tc-1", "content": "found it"},
         {"role": "assistant", "content": "Found it."}],
        turn_id="t2",
    )  # fmt: skip

    read_back = await ConversationChatHistory(CID, backend.db).aget_messages()

    assert [m.content for m in read_back if isinstance(m, ToolMessage)] == ["found it"]
    assert chat_completions_problems(convert_to_openai_messages(read_back)) == []


async def _a_call_awaiting_approval(logger: AgentMessageLogger) -> None:
    """Turn t1: the user asks, the assistant calls tc-9, a prompt holds it back."""
    calls = [{"id": "tc-9", "function": {"name": "book_train", "arguments": "{}"}}]
    hitl = {"action": "book_train", "params": {}, "request_id": "confirm-9"}
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "Book the 09:04."},
         {"role": "assistant", "content": None, "tool_calls": calls},
         {"role": "assistant", "content": "Pay €35?", "hitl_action": hitl}],
        turn_id="t1",
    )  # fmt: skip


async def test_a_call_the_conversation_went_on_after_unanswered_gets_a_marked_stand_in(
    backend: Backend,
) -> None:
    """tc-9 awaits approval and the user asks something else meanwhile: the model is called
    again past the call, so it is answered, as the exports answer it, right after its call
    and before the prompt's text (a chat model refuses a call without a result)."""
    from langchain_core.messages.utils import convert_to_openai_messages

    from agent_store.core import PENDING_RESULT
    from agent_store.integrations.exports import chat_completions_problems

    logger = AgentMessageLogger(backend.db)
    await _a_call_awaiting_approval(logger)
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "Meanwhile, what time is it?"},
         {"role": "assistant", "content": "It is 09:00."}],
        turn_id="t2",
    )  # fmt: skip

    read_back = await ConversationChatHistory(CID, backend.db).aget_messages()

    assert [type(m).__name__ for m in read_back] == [
        "HumanMessage", "AIMessage", "ToolMessage", "AIMessage", "HumanMessage", "AIMessage",
    ]  # fmt: skip
    stand_in = read_back[2]
    assert isinstance(stand_in, ToolMessage)
    assert (stand_in.tool_call_id, stand_in.content, stand_in.status) == (
        "tc-9", PENDING_RESULT, "error",
    )  # fmt: skip
    assert chat_completions_problems(convert_to_openai_messages(read_back)) == []


async def test_a_call_its_prompt_followed_is_answered_by_a_stand_in_before_the_prompts_text(
    backend: Backend,
) -> None:
    """The prompt's text is a message after the call: a model given it would be given the
    call without a result before it."""
    logger = AgentMessageLogger(backend.db)
    await _a_call_awaiting_approval(logger)

    read_back = await ConversationChatHistory(CID, backend.db).aget_messages()

    assert [type(m).__name__ for m in read_back] == [
        "HumanMessage", "AIMessage", "ToolMessage", "AIMessage",
    ]  # fmt: skip


class RefusingModel(GenericFakeChatModel):
    """A fake chat model refusing, as the Chat Completions API does (its 400), a history that
    breaks the pairing rules (`chat_completions_problems`)."""

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> Any:
        from langchain_core.messages.utils import convert_to_openai_messages

        from agent_store.integrations.exports import chat_completions_problems

        problems = chat_completions_problems(convert_to_openai_messages(messages))
        if problems:
            raise ValueError(f"400 from the model API: {problems}")
        return super()._generate(messages, *args, **kwargs)


async def _approved_while_the_model_went_on(backend: Backend) -> None:
    """tc-1 awaits approval (turn t1); in turn t2 it is approved, its result still to come,
    and the model meanwhile calls and answers tc-2, with no user message in between."""
    await _a_call_awaiting_approval(AgentMessageLogger(backend.db))
    await ConversationStore(backend.db).resolve_hitl(CID, "confirm-9")
    calls = [{"id": "tc-2", "function": {"name": "get_weather", "arguments": "{}"}}]
    await AgentMessageLogger(backend.db).log_messages(
        CID,
        [{"role": "assistant", "content": None, "tool_calls": calls},
         {"role": "tool", "tool_call_id": "tc-2", "content": "sunny"},
         {"role": "assistant", "content": "Sunny in Lyon."}],
        turn_id="t2",
    )  # fmt: skip


async def test_a_call_later_messages_of_the_model_followed_is_answered_by_a_marked_stand_in(
    backend: Backend,
) -> None:
    """The model was called again past tc-9 (it made tc-2): tc-9 is answered right after its
    call, as `chat_completions` answers it, not left open before tc-2."""
    from langchain_core.messages.utils import convert_to_openai_messages

    from agent_store.core import PENDING_RESULT
    from agent_store.integrations.exports import chat_completions_problems

    await _approved_while_the_model_went_on(backend)

    read_back = await ConversationChatHistory(CID, backend.db).aget_messages()

    assert [(type(m).__name__, getattr(m, "tool_call_id", None)) for m in read_back] == [
        ("HumanMessage", None), ("AIMessage", None), ("ToolMessage", "tc-9"), ("AIMessage", None),
        ("AIMessage", None), ("ToolMessage", "tc-2"), ("AIMessage", None),
    ]  # fmt: skip
    assert (read_back[2].content, read_back[2].status) == (PENDING_RESULT, "error")  # type: ignore[attr-defined]
    assert chat_completions_problems(convert_to_openai_messages(read_back)) == []


@pytest.mark.parametrize(
    "model_went_on", [pytest.param(True, id="model-went-on"), pytest.param(False, id="prompt-last")]
)
async def test_a_chain_goes_on_past_a_call_whose_result_is_still_to_come(
    backend: Backend, model_went_on: bool
) -> None:
    """The person writes something else while tc-9 is without a result: the model takes the
    history (a chain stores the person's message only once the model answered, so a history
    the model refused would be refused for every message after it)."""
    if model_went_on:
        await _approved_while_the_model_went_on(backend)
    else:
        await _a_call_awaiting_approval(AgentMessageLogger(backend.db))
    history = ConversationChatHistory(CID, backend.db)
    chain = RunnableWithMessageHistory(
        RefusingModel(messages=iter([AIMessage("Nothing else.")])), lambda session_id: history
    )
    stored = len(await history.aget_messages())

    reply = await chain.ainvoke("Thanks. Anything else?", CONFIG)

    assert reply.content == "Nothing else."
    assert len(await history.aget_messages()) == stored + 2


async def test_a_call_nothing_follows_is_left_for_the_runtime_to_answer(backend: Backend) -> None:
    """The model's last message makes a call: the runtime answers it with the chain's next
    input, which the model takes right after the call."""
    history = ConversationChatHistory(CID, backend.db)
    calls = [{"name": "search", "args": {}, "id": "tc-1"}]
    replies = iter([AIMessage("", tool_calls=calls), AIMessage("Found it.")])
    chain = RunnableWithMessageHistory(RefusingModel(messages=replies), lambda session_id: history)
    await chain.ainvoke("Search", CONFIG)

    read_back = await history.aget_messages()
    assert [type(m).__name__ for m in read_back] == ["HumanMessage", "AIMessage"]
    reply = await chain.ainvoke([ToolMessage("found", tool_call_id="tc-1")], CONFIG)
    assert reply.content == "Found it."


async def test_a_late_result_naming_another_tool_than_the_call_of_its_id_is_refused(
    backend: Backend,
) -> None:
    """A service's chain paused on ada's `refund` call_0; ada deleted the conversation, grace
    started it again, and the chain paused on HER `book_table` call_0 (a provider numbering
    its calls per response). The late add of ada's result names its tool (`ToolMessage.name`
    "refund"), not the `book_table` call of that id here: refused InvalidInput naming both
    tools and the call, nothing stored, grace's call still pending (was: stored as the answer
    to grace's call). A result naming the call's own tool, or no tool, is stored as before."""
    store = ConversationStore(backend.db)
    history = ConversationChatHistory(CID, backend.db)
    await history.aadd_messages(
        [HumanMessage("refund my order"), AIMessage("", tool_calls=[_call("refund")])]
    )
    await store.delete(CID)
    await history.aadd_messages(
        [HumanMessage("book a table"), AIMessage("", tool_calls=[_call("book_table")])]
    )
    before = await store.transcript(CID)
    late = ToolMessage("refund R-77, card 4242", tool_call_id="call_0", name="refund")

    with pytest.raises(InvalidInput, match=r"'call_0'.*'refund'.*'book_table'"):
        await history.aadd_messages([late, AIMessage("Refunded.")])

    assert await store.transcript(CID) == before
    assert [c.tool_name for c in await store.pending_calls(CID)] == ["book_table"]
    booked = ToolMessage("table booked", tool_call_id="call_0", name="book_table")
    await history.aadd_messages([booked, AIMessage("Booked.")])
    assert [m.content for m in await store.transcript(CID) if m.role == "tool"] == ["table booked"]


async def test_a_chain_acting_for_a_user_learns_no_tool_of_an_unowned_conversations_call(
    backend: Backend,
) -> None:
    """RUNTIMES.md: a service's chain paused on its `transfer_funds` call_0 (no user's). A
    chain acting for mallory, given that conversation's id, adds a result naming another tool:
    NotFound in the words of a conversation that does not exist, nothing stored (was:
    InvalidInput naming the call and its tool, telling her the conversation exists)."""
    store = ConversationStore(backend.db)
    service = ConversationChatHistory(CID, backend.db)
    await service.aadd_messages(
        [HumanMessage("wire 5000 EUR"), AIMessage("", tool_calls=[_call("transfer_funds")])]
    )
    before = await store.transcript(CID)
    guess = ToolMessage("x", tool_call_id="call_0", name="guess")

    for conversation_id in (CID, "never-created"):
        mallory = ConversationChatHistory(conversation_id, backend.db, user_id="mallory")
        with pytest.raises(NotFound) as refused:
            await mallory.aadd_messages([guess])
        assert str(refused.value) == f"conversation {conversation_id!r} was not found"

    assert await store.transcript(CID) == before


async def test_a_declined_tool_message_for_a_call_she_denied_first_is_refused_as_a_result(
    backend: Backend,
) -> None:
    """RUNTIMES.md "A denial she gave first": the person denies call_0 over HTTP; the chain,
    from a history read before, adds its own refusal of it alone (a `ToolMessage` with
    `status="error"`, stored as a failure: LangChain says no call was denied), which to the
    store is a result: meeting her denial it is refused `AnsweredBefore`, nothing stored, no
    turn of no message; only a denial meeting a denial is dropped as settled."""
    store = ConversationStore(backend.db)
    history = ConversationChatHistory(CID, backend.db, user_id="u-1")
    await history.aadd_messages(
        [HumanMessage("book a table"), AIMessage("", tool_calls=[_call("book_table")])]
    )
    served = {c.tool_call_id: c.message_id for c in await store.pending_calls(CID, user_id="u-1")}
    denial = {"role": "tool", "tool_call_id": "call_0", "error": {"message": "tool call denied"}}
    await history.logger.log_messages(
        CID, [denial], user_id="u-1", owner_only=True, turn_id="her", answers_to=served
    )
    before = await store.transcript(CID, user_id="u-1")
    declined = ToolMessage("Not approved.", tool_call_id="call_0", status="error")

    with pytest.raises(AnsweredBefore, match="'call_0'"):
        await history.aadd_messages([declined])

    assert await store.transcript(CID, user_id="u-1") == before


async def test_a_late_result_naming_no_tool_is_paired_by_its_call_id_as_before(
    backend: Backend,
) -> None:
    """`ToolMessage.name` unset: nothing says which tool the result is of, so it answers the
    pending call of its id, as before."""
    store = ConversationStore(backend.db)
    history = ConversationChatHistory(CID, backend.db)
    await history.aadd_messages(
        [HumanMessage("book a table"), AIMessage("", tool_calls=[_call("book_table")])]
    )
    await history.aadd_messages([ToolMessage("booked", tool_call_id="call_0"), AIMessage("Ok.")])
    assert await store.pending_calls(CID) == []


def _call(tool: str) -> dict[str, Any]:
    return {"name": tool, "args": {}, "id": "call_0"}


@pytest.mark.parametrize(("again_by", "runtime"), STALE_RESUMES)
async def test_a_result_added_after_its_conversation_was_deleted_is_refused_nothing_stored(
    backend: Backend, again_by: str | None, runtime: str | None
) -> None:
    """The chain paused on call_b1; the person deleted the conversation (and maybe started a
    new chat under its id); the runtime adds the approved tool's result and the reply. No
    message of the conversation makes call_b1 now: the add is refused as an `answers_to`
    naming such a call is, nothing stored: the conversation missing is never created
    (NotFound to a history acting for the user), the new chat takes no result for a call it
    never made (InvalidInput naming the call), also another user's chat a service's history
    adds to (was: stored, the conversation created again holding only the result and the
    reply, or both appended to the new chat)."""
    store = ConversationStore(backend.db)
    await AgentMessageLogger(backend.db).upsert_conversation(CID, user_id="u")
    history = ConversationChatHistory(CID, backend.db, user_id=runtime)
    calls = [{"name": "book_train", "args": {}, "id": "call_b1"}]
    await history.aadd_messages([HumanMessage("Book the 09:04."), AIMessage("", tool_calls=calls)])
    stale = await deleted_while_paused(backend.db, CID, again_by, "call_b1")

    with pytest.raises(stale.refused, match=stale.said):
        await history.aadd_messages(
            [ToolMessage("booked 09:04", tool_call_id="call_b1"), AIMessage("Booked.")]
        )

    await stale.left_as_it_was(store, CID)


async def test_a_result_added_after_a_delete_while_the_new_chats_first_turn_is_in_flight() -> None:
    """The chain paused on call_b1; the person deleted the conversation and started a new chat
    under its id, whose first insert is still to land (lost, the client retries). The
    history's later result and reply are refused InvalidInput naming the call, as without
    that turn in flight, nothing stored: the new chat holds its own message only (was: the
    call left out of the turn's `answers_to`, the old run's result and reply stored in the
    new chat)."""
    db = AsyncMongoMockClient(tz_aware=True)["deleted_in_flight"]
    await AgentMessageLogger(db).upsert_conversation(CID, user_id="u")
    history = ConversationChatHistory(CID, db, user_id="u")
    calls = [{"name": "book_train", "args": {}, "id": "call_b1"}]
    await history.aadd_messages([HumanMessage("Book the 09:04."), AIMessage("", tool_calls=calls)])
    stale = await deleted_while_paused(db, CID, "u", "call_b1", first_insert_lost=True)

    with pytest.raises(InvalidInput, match=stale.said):
        await history.aadd_messages(
            [ToolMessage("booked 09:04", tool_call_id="call_b1"), AIMessage("Booked.")]
        )

    await stale.left_as_it_was(ConversationStore(db), CID)


async def test_a_result_answering_no_call_is_left_out(backend: Backend) -> None:
    """The runtime popped its paused call, then logged the approved tool's result: no call is
    left for it to answer, and a chat model refuses a tool message answering none."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    calls = [{"id": "call_b1", "function": {"name": "book_train", "arguments": "{}"}}]
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "Book the 09:04."},
         {"role": "assistant", "content": None, "tool_calls": calls}],
        turn_id="t1",
    )  # fmt: skip
    await store.pop_last_message(CID)
    await logger.log_messages(
        CID,
        [{"role": "tool", "tool_call_id": "call_b1", "content": "booked 09:04"},
         {"role": "assistant", "content": "Booked."}],
        turn_id="t2",
    )  # fmt: skip

    read_back = await ConversationChatHistory(CID, backend.db).aget_messages()

    assert [(type(m).__name__, m.content) for m in read_back] == [
        ("HumanMessage", "Book the 09:04."), ("AIMessage", "Booked."),
    ]  # fmt: skip


async def test_a_provider_numbering_calls_per_response_logs_a_result_and_the_next_call_apart(
    backend: Backend,
) -> None:
    """`call_0` in every response: a result placed before a call of its id in one add is
    refused, nothing written; added apart, the result answers the earlier call, and the
    replay renames the later `call_0` so each result follows its own call."""
    history = ConversationChatHistory(CID, backend.db, user_id="u")

    def booking(tool: str) -> AIMessage:
        return AIMessage("", tool_calls=[{"id": "call_0", "name": tool, "args": {}}])

    await history.aadd_messages([HumanMessage("Train, then hotel."), booking("book_train")])
    with pytest.raises(InvalidInput, match="before the assistant message that makes it"):
        await history.aadd_messages(
            [ToolMessage("booked train", tool_call_id="call_0"), booking("book_hotel")]
        )
    await history.aadd_messages([ToolMessage("booked train", tool_call_id="call_0")])
    await history.aadd_messages([booking("book_hotel")])
    await history.aadd_messages([ToolMessage("booked hotel", tool_call_id="call_0")])

    replay = chat_completions(await ConversationStore(backend.db).transcript(CID, user_id="u"))
    assert [(m["role"], m.get("tool_call_id"), m.get("content")) for m in replay] == [
        ("user", None, "Train, then hotel."),
        ("assistant", None, None),
        ("tool", "call_0", "booked train"),
        ("assistant", None, None),
        ("tool", "call_0_2", "booked hotel"),
    ]
    check_chat_completions(replay)


# -- retries of adds, by chains sharing one history ----------------------------------


def losing_the_replies(history: ConversationChatHistory, *lost: int) -> None:
    """Every turn is stored; the replies to the adds numbered in `lost` (from 1) are lost."""
    real = history.logger.log_messages
    logged = [0]

    async def log_messages(*args: Any, **kwargs: Any) -> Any:
        stored = await real(*args, **kwargs)
        logged[0] += 1
        if logged[0] in lost:
            raise StorageUnavailable("the reply was lost")
        return stored

    history.logger.log_messages = log_messages  # type: ignore[method-assign]


A_TURN: list[BaseMessage] = [HumanMessage("A: book a table"), AIMessage("A: booked.")]
B_TURN: list[BaseMessage] = [HumanMessage("B: what time is it"), AIMessage("B: noon.")]


async def a_fails_b_adds_a_repeats(history: ConversationChatHistory) -> None:
    """Chain A's add is stored and its reply lost; chain B adds its turn; chain A repeats its
    add. Each chain in its own task."""
    losing_the_replies(history, 1)
    a_failed, b_added = asyncio.Event(), asyncio.Event()

    async def chain_a() -> None:
        with pytest.raises(StorageUnavailable):
            await history.aadd_messages(A_TURN)
        a_failed.set()
        await b_added.wait()
        await history.aadd_messages(A_TURN)

    async def chain_b() -> None:
        await a_failed.wait()
        await history.aadd_messages(B_TURN)
        b_added.set()

    await asyncio.gather(chain_a(), chain_b())


async def test_a_repeated_add_is_its_own_retry_after_another_task_added(
    backend: Backend,
) -> None:
    history = ConversationChatHistory(CID, backend.db)

    await a_fails_b_adds_a_repeats(history)

    assert visible(await history.aget_messages()) == visible(A_TURN + B_TURN)


async def test_a_repeated_add_through_the_sync_driver_is_its_own_retry_after_another_task_added(
    database: Any,
) -> None:
    """`aadd_messages` over a synchronous database adds in a thread: the retry is still told by
    the task that called it."""
    history = ConversationChatHistory(CID, database)

    await a_fails_b_adds_a_repeats(history)

    assert visible(history.messages) == visible(A_TURN + B_TURN)


GRACE = TurnRules(claim_grace=timedelta(seconds=0.2))
"""A short `claim_grace`: a retry at once waits it out, as with the default second."""


def losing_the_insert(history: ConversationChatHistory) -> Callable[[], None]:
    """The next inserts of messages fail as a reset connection does (after the turn reserved
    its `seq`s: its outcome unknown); the returned call brings the network back."""
    messages = history.logger._messages

    def lost(*args: Any, **kwargs: Any) -> Any:
        raise AutoReconnect("connection reset while inserting")

    messages.insert_many = lost

    def back() -> None:
        del messages.insert_many

    return back


def test_an_add_whose_insert_failed_repeated_at_once_through_the_sync_driver_is_stored_once(
    database: Any,
) -> None:
    """The repeat comes within `claim_grace` of the failed attempt's reservation: it waits for
    that attempt to land if it ever does, blocking as every call of the synchronous driver
    does, then stores the turn once."""
    history = ConversationChatHistory(CID, database, user_id="u1", rules=GRACE)
    history.add_messages([HumanMessage("hello"), AIMessage("hi")])
    network_back = losing_the_insert(history)
    with pytest.raises(StorageUnavailable):
        history.add_messages(A_TURN)
    network_back()

    history.add_messages(A_TURN)

    assert [m.content for m in history.messages] == ["hello", "hi", *(m.content for m in A_TURN)]
    assert database.agent_messages.count_documents({"conversation_id": CID}) == 4


async def test_aadd_messages_repeated_at_once_through_the_sync_driver_is_stored_once(
    database: Any,
) -> None:
    history = ConversationChatHistory(CID, database, rules=GRACE)
    network_back = losing_the_insert(history)
    with pytest.raises(StorageUnavailable):
        await history.aadd_messages(A_TURN)
    network_back()

    await history.aadd_messages(A_TURN)

    assert visible(await history.aget_messages()) == visible(A_TURN)


@pytest.mark.parametrize("method", ["clear", "aclear"])
async def test_clear_after_a_failed_add_through_the_sync_driver_deletes_the_conversation(
    database: Any, method: str
) -> None:
    """A `seq` reserved and not stored: the delete sweeps again `claim_grace` later (a turn may
    still be inserting), blocking as the synchronous driver does, and returns."""
    history = ConversationChatHistory(CID, database, user_id="u1", rules=GRACE)
    history.add_messages([HumanMessage("x")])
    network_back = losing_the_insert(history)
    with pytest.raises(StorageUnavailable):
        history.add_messages([HumanMessage("y")])
    network_back()

    if method == "clear":
        history.clear()
    else:
        await history.aclear()

    assert database.agent_conversations.count_documents({"_id": CID}) == 0
    assert database.agent_messages.count_documents({"conversation_id": CID}) == 0
    assert history.messages == []


async def test_two_chains_whose_adds_both_failed_each_retry_their_own_once(
    backend: Backend,
) -> None:
    """Both chains' adds are stored and their replies lost, A's then B's; each repeats its add
    in its own task: the second failure did not replace the first one's retry."""
    history = ConversationChatHistory(CID, backend.db)
    losing_the_replies(history, 1, 2)
    a_failed, b_failed, a_retried = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def chain_a() -> None:
        with pytest.raises(StorageUnavailable):
            await history.aadd_messages(A_TURN)
        a_failed.set()
        await b_failed.wait()
        await history.aadd_messages(A_TURN)
        a_retried.set()

    async def chain_b() -> None:
        await a_failed.wait()
        with pytest.raises(StorageUnavailable):
            await history.aadd_messages(B_TURN)
        b_failed.set()
        await a_retried.wait()
        await history.aadd_messages(B_TURN)

    await asyncio.gather(chain_a(), chain_b())

    assert visible(await history.aget_messages()) == visible(A_TURN + B_TURN)


def answer(text: str, tokens: int) -> AIMessage:
    return AIMessage(
        text,
        usage_metadata={
            "input_tokens": tokens,
            "output_tokens": tokens,
            "total_tokens": 2 * tokens,
        },
    )


ASKED = HumanMessage("What is 2+2?")
PASSED = TurnRules(abandon_after=timedelta(0))
"""`abandon_after` over at once: what the default five minutes give once they have passed."""


async def counted(history: ConversationChatHistory) -> tuple[int, int, int]:
    """The conversation's turns and input and output tokens."""
    conversation = await history.store.get_conversation(CID)
    usage = conversation.usage
    return conversation.turn_count, usage.input_tokens, usage.output_tokens


async def test_a_chain_run_again_with_a_regenerated_answer_after_a_lost_insert_counts_it_once(
    backend: Backend,
) -> None:
    """RUNTIMES.md (Retries): the add's insert is lost, the chain runs again in a task of its
    own and the model words its answer otherwise. The add at the failed one's place (the
    same question) reuses its turn id, so the store gives the empty block back: the lost
    answer's turn and tokens are not counted."""
    history = ConversationChatHistory(CID, backend.db, rules=PASSED)
    network_back = losing_the_insert(history)
    with pytest.raises(StorageUnavailable):
        await asyncio.create_task(history.aadd_messages([ASKED, answer("4", 100)]))
    network_back()

    await asyncio.create_task(history.aadd_messages([ASKED, answer("It is 4.", 120)]))

    assert [m.content for m in await history.aget_messages()] == [ASKED.content, "It is 4."]
    assert await counted(history) == (1, 120, 120)


async def test_a_regenerated_answer_while_the_lost_insert_may_still_land_waits_for_it(
    backend: Backend, clocks: StoreClocks
) -> None:
    """Within `abandon_after` of the failed add the first attempt may still be writing: the
    regenerated add is `StorageUnavailable`, nothing written; repeated once that has
    passed, it is stored and counted once."""
    rules = TurnRules(claim_grace=timedelta(seconds=0.05), abandon_after=timedelta(seconds=1))
    history = ConversationChatHistory(CID, backend.db, rules=rules)
    network_back = losing_the_insert(history)
    with pytest.raises(StorageUnavailable):
        await history.aadd_messages([ASKED, answer("4", 100)])
    network_back()
    regenerated = [ASKED, answer("It is 4.", 120)]

    with pytest.raises(StorageUnavailable, match="nothing of turn"):
        await history.aadd_messages(regenerated)
    assert await history.aget_messages() == []
    clocks.wait(1.1)
    await history.aadd_messages(regenerated)

    assert [m.content for m in await history.aget_messages()] == [ASKED.content, "It is 4."]
    assert await counted(history) == (1, 120, 120)


async def test_a_regenerated_answer_after_a_lost_reply_is_refused_and_then_stored_anew(
    backend: Backend,
) -> None:
    """The first attempt was stored whole, its reply lost: the regenerated add at its place
    is refused as a retry with other content (`Conflict`, nothing written), the history
    holding the first answer, counted once; a refusal is no outcome in doubt, so the same
    add again is a new turn, as any add after a call that did not raise."""
    history = ConversationChatHistory(CID, backend.db, rules=PASSED)
    losing_the_replies(history, 1)
    with pytest.raises(StorageUnavailable):
        await history.aadd_messages([ASKED, answer("4", 100)])
    regenerated = [ASKED, answer("It is 4.", 120)]

    with pytest.raises(Conflict, match="other content"):
        await history.aadd_messages(regenerated)
    assert [m.content for m in await history.aget_messages()] == [ASKED.content, "4"]
    assert await counted(history) == (1, 100, 100)
    await history.aadd_messages(regenerated)

    assert [m.content for m in await history.aget_messages()] == [
        ASKED.content, "4", ASKED.content, "It is 4.",
    ]  # fmt: skip
    assert await counted(history) == (2, 220, 220)


async def test_another_question_after_a_lost_insert_is_no_retry_of_it(backend: Backend) -> None:
    """An add whose first messages are not the failed add's (another question) is stored at
    once, in its own turn: only the add at the failed one's place is taken for its retry."""
    history = ConversationChatHistory(CID, backend.db)
    network_back = losing_the_insert(history)
    with pytest.raises(StorageUnavailable):
        await asyncio.create_task(history.aadd_messages([ASKED, answer("4", 100)]))
    network_back()

    await asyncio.create_task(history.aadd_messages([HumanMessage("Hello"), answer("Hi!", 7)]))
    await history.aadd_messages([HumanMessage("And 3+3?"), answer("6", 9)])

    contents = [m.content for m in await history.aget_messages()]
    assert contents == ["Hello", "Hi!", "And 3+3?", "6"]


def paused_on(call_id: str, asked: str) -> list[BaseMessage]:
    """A question whose answer calls a tool (`call_id`) that awaits a person's approval."""
    return [
        HumanMessage(asked),
        AIMessage("", tool_calls=[{"name": "book_train", "args": {}, "id": call_id}]),
    ]


def resumed(call_id: str, result: str, reply: str, tokens: int = 10) -> list[BaseMessage]:
    """A paused call's result, once approved, and the model's answer to it: one add."""
    return [ToolMessage(result, tool_call_id=call_id, name="book_train"), answer(reply, tokens)]


@pytest.mark.parametrize("lost", ["reply", "insert"])
async def test_an_add_answering_another_call_after_a_failed_add_is_no_retry_of_it(
    backend: Backend, lost: str
) -> None:
    """RUNTIMES.md (Retries): one worker task, one history, resumes two paused calls in
    turn. X's add fails (stored and its reply lost, or its insert lost); Y's add answers
    another call: not X's retry, so it is stored and Y is answered."""
    await ConversationChatHistory(CID, backend.db).aadd_messages(paused_on("call_x", "09:04?"))
    await ConversationChatHistory(CID, backend.db).aadd_messages(paused_on("call_y", "17:30?"))
    worker = ConversationChatHistory(CID, backend.db)
    network_back = losing_the_insert(worker) if lost == "insert" else lambda: None
    if lost == "reply":
        losing_the_replies(worker, 1)
    with pytest.raises(StorageUnavailable):
        await worker.aadd_messages(resumed("call_x", "booked 09:04", "Booked the 09:04."))
    network_back()

    await worker.aadd_messages(resumed("call_y", "booked 17:30", "Booked the 17:30."))

    history = await worker.aget_messages()
    results = {m.tool_call_id: m.content for m in history if isinstance(m, ToolMessage)}
    assert results["call_y"] == "booked 17:30"
    assert history[-1].content == "Booked the 17:30."
    pending = [c.tool_call_id for c in await worker.store.pending_calls(CID)]
    assert "call_y" not in pending


async def test_an_add_answering_the_same_call_otherwise_after_a_lost_insert_is_its_retry(
    backend: Backend,
) -> None:
    """RUNTIMES.md (Retries): a worker's add resuming X loses its insert; it resumes X again,
    its tool answering otherwise: the same call answered, at the failed add's place, so its
    retry, and the empty block it reserved is given back (the call answered once, counted
    once)."""
    await ConversationChatHistory(CID, backend.db).aadd_messages(paused_on("call_x", "09:04?"))
    history = ConversationChatHistory(CID, backend.db, rules=PASSED)
    network_back = losing_the_insert(history)
    with pytest.raises(StorageUnavailable):
        await history.aadd_messages(resumed("call_x", "seat 1", "Seat 1 is yours.", 100))
    network_back()

    await history.aadd_messages(resumed("call_x", "seat 2", "Seat 2 is yours.", 120))

    contents = [m.content for m in await history.aget_messages()]
    assert contents == ["09:04?", "", "seat 2", "Seat 2 is yours."]
    assert await counted(history) == (1, 120, 120)
    assert await history.store.pending_calls(CID) == []


def numbered_step() -> list[BaseMessage]:
    """A step as a provider numbering its calls per response words it: another chain's step
    may be the very same messages."""
    return [
        AIMessage("", tool_calls=[{"name": "get_time", "args": {}, "id": "call_0"}]),
        ToolMessage("09:00", tool_call_id="call_0"),
    ]


async def test_a_chain_that_added_anything_else_first_is_not_taken_for_a_failed_chains_retry(
    backend: Backend,
) -> None:
    """Chain A's step is stored and its reply lost, and its task ends; chain B, in a task of
    its own, adds another question, then a step of the same messages as A's: a step of its
    own, stored, not a retry of A's (only a task's first add takes over a failed chain)."""
    history = ConversationChatHistory(CID, backend.db)
    losing_the_replies(history, 2)
    answer: list[BaseMessage] = [AIMessage("09:00 there too.")]
    paris: list[BaseMessage] = [HumanMessage("Time in Paris?")]
    berlin: list[BaseMessage] = [HumanMessage("In Berlin?")]

    async def chain(*adds: list[BaseMessage]) -> None:
        for messages in adds:
            await history.aadd_messages(messages)

    with pytest.raises(StorageUnavailable):
        await asyncio.create_task(chain(paris, numbered_step()))
    await asyncio.create_task(chain(berlin, numbered_step(), answer))

    assert visible(await history.aget_messages()) == visible(
        [*paris, *numbered_step(), *berlin, *numbered_step(), *answer]
    )


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        pytest.param("tool call denied", DENIED_RESULT, id="denied"),
        pytest.param("tool call interrupted", INTERRUPTED_RESULT, id="interrupted"),
        pytest.param("tool call failed: quota", f"{FAILED_RESULT}: quota", id="failed"),
        pytest.param("upstream timeout", f"{FAILED_RESULT}: upstream timeout", id="unmarked"),
    ],
)
async def test_a_result_stored_with_only_an_error_replays_as_what_the_error_says(
    backend: Backend, error: str, expected: str
) -> None:
    """Another writer stored a call's result as an error with no text: the model is told the
    call did not succeed (as the exports tell it), never given an empty success."""
    calls = [{"id": "tc-1", "function": {"name": "delete_files", "arguments": "{}"}}]
    await AgentMessageLogger(backend.db).log_messages(
        CID,
        [{"role": "user", "content": "Clean up."},
         {"role": "assistant", "content": None, "tool_calls": calls},
         {"role": "tool", "tool_call_id": "tc-1", "content": None, "error": {"message": error}},
         {"role": "assistant", "content": "I could not."}],
        turn_id="t1",
    )  # fmt: skip

    read_back = await ConversationChatHistory(CID, backend.db).aget_messages()

    result = read_back[2]
    assert isinstance(result, ToolMessage)
    assert (result.content, result.status) == (expected, "error")


async def test_a_users_history_never_adopts_a_conversation_a_service_logged(
    backend: Backend,
) -> None:
    """A service's (unowned) conversation is to a user's history what it is to her token: it
    reads empty, a write is NotFound and nothing is written, and a clear takes nothing. A
    service that means her to have it assigns it (`upsert_conversation`)."""
    logger = AgentMessageLogger(backend.db)
    secret = {"role": "system", "content": "internal: api key sk-SERVICE"}
    await logger.log_messages(CID, [secret], turn_id="svc-0")
    history = ConversationChatHistory(CID, backend.db, user_id="user-ada")

    assert await history.aget_messages() == []
    with pytest.raises(NotFound, match=re.escape(f"conversation {CID!r} was not found")):
        await history.aadd_messages([HumanMessage("hi")])
    await history.aclear()
    assert (await history.store.get_conversation(CID)).user_id is None
    assert [m.content for m in await history.store.transcript(CID)] == [secret["content"]]

    await logger.upsert_conversation(CID, user_id="user-ada")  # the service assigns it
    await history.aadd_messages([HumanMessage("hi")])
    assert [m.content for m in await history.aget_messages()] == [secret["content"], "hi"]


async def test_a_history_given_the_legacy_turns_never_takes_another_users_unmigrated_id(
    backend: Backend,
) -> None:
    """During a migration the history takes the logger and store the service wires to the
    legacy turns (MIGRATION.md, Transition flags): another user's conversation not migrated
    yet is NotFound to a user's history, as to her token, and nothing is written."""
    wired = await another_users_legacy_turn(backend.db, CID)
    history = ConversationChatHistory(CID, backend.db, user_id="user-ada", **wired)

    with pytest.raises(NotFound, match=re.escape(f"conversation {CID!r} was not found")):
        await history.aadd_messages([HumanMessage("ada squats")])
    assert await history.aget_messages() == []
    assert await backend.db[CONVERSATIONS].count_documents({}) == 0


def test_a_history_on_a_synchronous_database_refuses_a_logger_it_cannot_drive() -> None:
    logger = AgentMessageLogger(AsyncMongoMockClient()["async"])
    with MongoClient("mongodb://127.0.0.1:9", connect=False) as client:
        refused = "pass `logger` and `store` with an async database"
        with pytest.raises(InvalidInput, match=refused):
            ConversationChatHistory(CID, client["sync"], logger=logger)


@pytest.mark.parametrize("depth", [3_000, 20_000])
async def test_arguments_nested_past_what_python_parses_are_read_back_as_their_text(
    backend: Backend, depth: int
) -> None:
    """Arguments are stored as any writer sent them: JSON text nested deeper than Python's
    parser reads (20,000 levels; 3,000 on Python 3.11; the history raised RecursionError) is
    given back as text, as text that is no JSON is; shallower, as the value it spells."""
    text = "[" * depth + "1,2" + "]" * depth
    calls = [{"id": "call_1", "function": {"name": "lookup", "arguments": text}}]
    turn = [{"role": "assistant", "content": None, "tool_calls": calls}]
    await AgentMessageLogger(backend.db).log_messages(CID, turn)

    (read_back,) = await ConversationChatHistory(CID, backend.db).aget_messages()

    assert isinstance(read_back, AIMessage)
    (call,) = read_back.tool_calls
    try:
        json.loads(text)
    except RecursionError:  # past what this Python's parser reads: the text
        assert call["args"] == {"arguments": text}
    else:
        assert isinstance(call["args"]["arguments"], list)
