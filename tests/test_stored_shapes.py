"""What the collections hold, as another service's driver reads them: every key, one BSON width.

A TypeScript app reads `agent_messages` and `agent_conversations` with the
official Node.js driver (clients/typescript, `tests/test_node_client.py`); it
sees BSON types, not pydantic models. PyMongo decodes a BSON int64 as `Int64`
and an int32 as a plain `int`, so the type of a value read back here is its
width on disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from bson import Int64

from agent_store.core import Conversation
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
