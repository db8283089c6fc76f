"""What the collections hold, as another service's driver reads them: every key, one BSON width.

A TypeScript app reads `agent_messages` and `agent_conversations` with the
official Node.js driver (clients/typescript, `tests/test_node_client.py`); it
sees BSON types, not pydantic models. PyMongo decodes a BSON int64 as `Int64`
and an int32 as a plain `int`, so the type of a value read back here is its
width on disk.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pydantic_ai.messages as pai
import pytest
from bson import DBRef, Int64
from langchain_core.messages import AIMessage, HumanMessage

from agent_store import ConversationStore
from agent_store.core import Conversation, InvalidInput
from agent_store.integrations.exports import user_jsonl
from agent_store.integrations.langchain import ConversationChatHistory
from agent_store.integrations.openai_agents import ConversationSession
from agent_store.integrations.pydantic_ai import history_from_messages, log_run
from agent_store.integrations.streams import log_streamed_turn, turn_from_sse
from agent_store.store import AgentMessageLogger, SteeringInbox
from app.examples import EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID, example_turns
from tests.conftest import Backend

pytestmark = pytest.mark.wire

FREE_FORM = ("hitl_action.params", "pending_hitl.params", "native.set")
"""Values callers choose (HITL params, a runtime's own form of a message): any JSON."""


def integers(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every integer in a document, free-form parts aside."""
    if path.startswith(FREE_FORM):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield from integers(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from integers(item, f"{path}.{index}")
    elif isinstance(value, int) and not isinstance(value, bool):
        yield path, value


async def write_every_kind_of_document(backend: Backend) -> None:
    """The example conversation, a fork of it, a conversation created empty, a steered turn."""
    logger = AgentMessageLogger(backend.db)
    for turn_id, messages in example_turns():
        await logger.log_messages(
            EXAMPLE_CONVERSATION_ID, messages, user_id=EXAMPLE_USER_ID, turn_id=turn_id
        )
    await logger.fork(EXAMPLE_CONVERSATION_ID, 4, "forked")
    await logger.upsert_conversation("empty", user_id=EXAMPLE_USER_ID, name="Nothing yet")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(EXAMPLE_CONVERSATION_ID, "turn-steered")
    await inbox.try_deliver(
        EXAMPLE_CONVERSATION_ID, "turn-steered", {"role": "user", "content": "also Lille"}
    )


async def stored(backend: Backend, collection: str) -> list[dict[str, Any]]:
    return [doc async for doc in backend.db[collection].find({})]


async def test_every_integer_of_a_stored_document_is_an_int64(wire_backend: Backend) -> None:
    await write_every_kind_of_document(wire_backend)
    for collection in ("agent_messages", "agent_conversations"):
        found = [
            (doc["_id"], path, type(value).__name__)
            for doc in await stored(wire_backend, collection)
            for path, value in integers(doc)
        ]
        assert found, f"{collection} holds no integer: the test proves nothing"
        assert [f for f in found if f[2] != "Int64"] == [], collection


async def test_a_stored_conversation_holds_every_key_it_is_served_with(
    wire_backend: Backend,
) -> None:
    await write_every_kind_of_document(wire_backend)
    served = {f.alias or name for name, f in Conversation.model_fields.items() if not f.exclude}
    documents = await stored(wire_backend, "agent_conversations")
    assert {d["_id"] for d in documents} == {EXAMPLE_CONVERSATION_ID, "forked", "empty"}
    assert {d["_id"]: sorted(served - d.keys()) for d in documents} == {
        d["_id"]: [] for d in documents
    }


def test_integers_are_written_as_int64_by_the_models_themselves() -> None:
    conversation = Conversation.model_validate(
        {"_id": "c", "conversation_id": "c", "created_at": 0, "updated_at": 0, "turn_count": 3}
    )
    dumped = conversation.model_dump(by_alias=True)
    assert type(dumped["turn_count"]) is Int64
    assert type(dumped["usage"]["input_tokens"]) is Int64
    assert conversation.model_dump(mode="json")["turn_count"] == 3


# -- objects MongoDB reads back as a database reference -------------------------------------

SCHEMA = {
    "$id": "https://example.com/city.json",
    "$ref": "#/$defs/city",
    "$defs": {"city": {"type": "string"}},
}
"""A JSON Schema: an object holding a text `$ref` and an `$id`, which every MongoDB driver
reads back as a database reference (PyMongo: a `bson.DBRef`), not as the object."""


def dbrefs(value: Any, path: str = "") -> Iterator[str]:
    """The dotted path of every database reference in a document, as the driver read it."""
    if isinstance(value, DBRef):
        yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from dbrefs(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from dbrefs(item, f"{path}.{index}")


async def test_a_runtime_value_holding_a_dbref_shape_comes_back_exactly_as_it_was_stored(
    wire_backend: Backend,
) -> None:
    """Kept as its JSON text (`native.json_text`), as a number BSON cannot hold is."""
    db = wire_backend.db
    session = ConversationSession("agents", db, user_id="u1")
    items: list[Any] = [
        {"role": "user", "content": "what tools?"},
        {
            "type": "mcp_list_tools",
            "id": "mcpl_1",
            "server_label": "geo",
            "tools": [{"name": "find_city", "input_schema": SCHEMA}],
        },
    ]
    await session.add_items(items)
    history = ConversationChatHistory("langchain", db, user_id="u1")
    await history.aadd_messages([HumanMessage("hi"), AIMessage("ok", additional_kwargs=SCHEMA)])
    logger, store = AgentMessageLogger(db), ConversationStore(db)
    prompt = pai.SystemPromptPart("Answer with a city.", metadata={"schema": SCHEMA})
    run = [pai.ModelRequest(parts=[prompt, pai.UserPromptPart("Where?")])]
    await log_run(logger, "pydantic-ai", run, turn_id="run-1", user_id="u1")

    assert await session.get_items() == items
    assert [m.additional_kwargs for m in await history.aget_messages()] == [{}, SCHEMA]
    [request] = history_from_messages(await store.recent_messages("pydantic-ai", user_id="u1"))
    assert isinstance(request, pai.ModelRequest)
    assert request.parts[0].metadata == {"schema": SCHEMA}  # type: ignore[union-attr]
    documents = await stored(wire_backend, "agent_messages")
    assert [p for d in documents for p in dbrefs(d)] == []
    assert sorted(k for d in documents if d["native"] for k in d["native"]["json_text"]) == [
        "additional_kwargs",
        "metadata",
        "tools",
    ]


@pytest.mark.parametrize("at", [{"schema": SCHEMA}, SCHEMA], ids=["nested", "params-itself"])
async def test_hitl_params_holding_a_dbref_shape_are_invalid_input_naming_where_it_is(
    wire_backend: Backend, at: dict[str, Any]
) -> None:
    """Params are served as they are, so there is no text to keep them as: refused, unwritten,
    from a runtime's messages and from a streamed turn alike."""
    db = wire_backend.db
    logger, store = AgentMessageLogger(db), ConversationStore(db)
    prompt = {"action": "form", "request_id": "r1", "params": {"form": [at]}}
    messages = [
        {"role": "user", "content": "Book me a city tour"},
        {"role": "assistant", "content": "Which city?", "hitl_action": prompt},
    ]
    where = re.escape("message 1 hitl_action.params.form.0") + ("" if at is SCHEMA else r"\.schema")
    with pytest.raises(InvalidInput, match=where + ".*DBRef"):
        await logger.log_messages("hitl", messages, user_id="u1", turn_id="t1")
    events = [
        {"type": "text_delta", "delta": "Which city?"},
        {"type": "hitl", "action": "form", "request_id": "r2", "params": {"form": [at]}},
        {"type": "done"},
    ]
    with pytest.raises(InvalidInput, match=r"hitl_action\.params\.form\.0.*DBRef"):
        await log_streamed_turn(
            logger=logger,
            store=store,
            conversation_id="stream",
            turn=turn_from_sse(events),
            turn_id="s1",
            prompt="Book me a city tour",
            user_id="u1",
        )
    assert await stored(wire_backend, "agent_messages") == []
    assert await stored(wire_backend, "agent_conversations") == []


def _stored_dbref() -> DBRef:
    """`SCHEMA` as the driver reads it back."""
    return DBRef(SCHEMA["$ref"], SCHEMA["$id"], _extra={"$defs": SCHEMA["$defs"]})


async def test_a_stored_dbref_reads_back_as_the_object_it_was_written_as(
    wire_backend: Backend,
) -> None:
    """Written by another app, or before the store refused or kept such objects: every read
    of the conversation, its owner's list and export gives the plain object back."""
    db = wire_backend.db
    logger, store = AgentMessageLogger(db), ConversationStore(db)
    session = ConversationSession("agents", db, user_id="u1")
    tools = {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "geo", "tools": []}
    await session.add_items([{"role": "user", "content": "what tools?"}, tools])
    prompt = {"action": "form", "request_id": "r1", "params": {"schema": {}}}
    turn = [{"role": "user", "content": "go"}, {"role": "assistant", "hitl_action": prompt}]
    await logger.log_messages("hitl", turn, user_id="u1", turn_id="t1")
    ref = _stored_dbref()
    await db.agent_messages.update_one(
        {"conversation_id": "hitl", "seq": 1}, {"$set": {"hitl_action.params.schema": ref}}
    )
    await db.agent_conversations.update_one(
        {"_id": "hitl"}, {"$set": {"pending_hitl.params.schema": ref}}
    )
    await db.agent_messages.update_one(
        {"conversation_id": "agents", "seq": 1},
        {"$set": {"native.set.tools": [{"name": "find_city", "input_schema": ref}]}},
    )
    found = sorted(p for d in await stored(wire_backend, "agent_messages") for p in dbrefs(d))
    assert found == ["hitl_action.params.schema", "native.set.tools.0.input_schema"]

    read = {"schema": SCHEMA}
    [_, asked] = await store.recent_messages("hitl", user_id="u1")
    assert asked.hitl_action is not None
    assert asked.hitl_action.params == read
    [_, asked] = await store.transcript("hitl", user_id="u1")
    assert asked.hitl_action is not None
    assert asked.hitl_action.params == read
    conversation = await store.get_conversation("hitl", user_id="u1")
    assert conversation.pending_hitl is not None
    assert conversation.pending_hitl.params == read
    listed = (await store.list_conversations(user_id="u1")).data
    assert [c.pending_hitl.params for c in listed if c.pending_hitl] == [read]
    exported = "\n".join([line async for line in user_jsonl(store, "u1")])
    assert json.dumps(SCHEMA["$defs"], separators=(",", ":")) in exported
    got = await session.get_items()
    assert got[1]["tools"] == [{"name": "find_city", "input_schema": SCHEMA}]
    assert await session.pop_item() == got[1]
