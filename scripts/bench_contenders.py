"""The writers `make bench` compares, each storing the same turns in its own form.

- `logger`         AgentMessageLogger.log_messages: validation, reservation, insert.
- `raw two`        PyMongo sending the logger's very two commands (the reservation's
                   `find_one_and_update`, prebuilt, then `insert_many` of the stored documents):
                   what the logger's two round trips cost without any of its code.
- `raw insert`     one `insert_many` of the stored documents: no conversation document at all.
- `langchain`      langchain-mongodb's MongoDBChatMessageHistory.add_messages (synchronous
                   PyMongo, one `insert_one` per message).
- `langgraph`      a LangGraph `StateGraph(MessagesState)` compiled with the MongoDBSaver of
                   langgraph-checkpoint-mongodb (synchronous PyMongo): the user message goes in,
                   one node returns the rest of the turn, the checkpointer saves the whole state.
- `librechat`      LibreChat's way: every message upserted on its own (`findOneAndUpdate` by
                   message id, as its saveMessage does), then the conversation upserted
                   (saveConvo); no validation.

Inputs are built before timing (`Workload`); each contender gets its own copy.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from pymongo import ReturnDocument

from agent_store import AgentMessageLogger
from agent_store.core import utc_now
from agent_store.store import create_indexes
from agent_store.store._reservation import RESERVED, Actor, reservation, reservation_filter
from agent_store.store._turns import TurnRules, plan_turn
from scripts.corpus import Conversation


@dataclass(frozen=True)
class Reservation:
    """The logger's first command for one turn, prebuilt."""

    filter: dict[str, Any]
    pipeline: list[dict[str, Any]]


@dataclass
class Workload:
    """The turns every contender stores, in each contender's input form."""

    conversations: list[Conversation]
    stored: dict[str, list[list[dict[str, Any]]]]
    """Per conversation, per turn: the documents the logger stores (the raw drivers' input)."""
    reservations: dict[str, list[Reservation]]
    langchain: dict[str, list[list[Any]]]
    librechat: dict[str, list[list[dict[str, Any]]]]

    @property
    def turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def messages(self) -> int:
        return sum(c.message_count for c in self.conversations)


def to_langchain(messages: list[dict[str, Any]]) -> list[Any]:
    """The same turn as langchain messages, everything our documents hold carried over."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    converted: list[Any] = []
    for m in messages:
        extra = {k: m[k] for k in ("upload", "hitl_action", "error") if m.get(k)}
        meta = {"created_at": m["created_at"].isoformat(), "latency_ms": m.get("latency_ms")}
        if m["role"] == "user":
            converted.append(HumanMessage(m["content"] or "", additional_kwargs=extra))
        elif m["role"] == "system":
            converted.append(SystemMessage(m["content"] or ""))
        elif m["role"] == "tool":
            converted.append(ToolMessage(m["content"] or "", tool_call_id=m["tool_call_id"]))
        else:
            usage = m.get("token_usage")
            converted.append(
                AIMessage(
                    m["content"] or "",
                    tool_calls=[
                        {
                            "name": c["function"]["name"],
                            "args": json.loads(c["function"]["arguments"]),
                            "id": c["id"],
                        }
                        for c in m.get("tool_calls") or ()
                    ],
                    usage_metadata=usage
                    and {**usage, "total_tokens": usage["input_tokens"] + usage["output_tokens"]},
                    additional_kwargs=extra,
                    response_metadata=meta,
                )
            )
    return converted


def to_librechat(messages: list[dict[str, Any]], parent: str | None) -> list[dict[str, Any]]:
    """The same turn as LibreChat message documents (its field names, its parent chain)."""
    converted = []
    for m in messages:
        usage = m.get("token_usage") or {}
        converted.append(
            {
                "messageId": m["_id"],
                "conversationId": m["conversation_id"],
                "parentMessageId": parent or "00000000-0000-0000-0000-000000000000",
                "user": m["user_id"],
                "sender": "User" if m["role"] == "user" else m["role"].capitalize(),
                "isCreatedByUser": m["role"] == "user",
                "text": m["content"] or "",
                "content": [
                    {"type": "tool_call", "tool_call": c} for c in m.get("tool_calls") or ()
                ],
                "tool_call_id": m.get("tool_call_id"),
                "tokenCount": usage.get("output_tokens", 0),
                "error": m.get("error") is not None,
                "unfinished": False,
                "createdAt": m["created_at"],
                "updatedAt": m["created_at"],
            }
        )
        parent = m["_id"]
    return converted


async def prepare_workload(conversations: list[Conversation]) -> Workload:
    """Log the turns once on a scratch in-process database to learn the stored documents."""
    from mongomock_motor import AsyncMongoMockClient

    stored: dict[str, list[list[dict[str, Any]]]] = {}
    reservations: dict[str, list[Reservation]] = {}
    rules = TurnRules()
    for conversation in conversations:
        cid = conversation.conversation_id
        logger = AgentMessageLogger(AsyncMongoMockClient(tz_aware=True)["scratch"])
        stored[cid], reservations[cid] = [], []
        for turn_id, messages in conversation.turns:
            logged = await logger.log_messages(
                cid, copy.deepcopy(messages), user_id=conversation.user_id, turn_id=turn_id
            )
            stored[cid].append([m.model_dump(by_alias=True) for m in logged.messages])
            plan = plan_turn(cid, copy.deepcopy(messages), turn_id=turn_id, rules=rules)
            actor = Actor(conversation.user_id)
            reservations[cid].append(
                Reservation(
                    reservation_filter(plan, actor),
                    reservation(plan, actor, None, rules, utc_now()),
                )
            )
    librechat: dict[str, list[list[dict[str, Any]]]] = {}
    for cid, turns in stored.items():
        parent: str | None = None
        librechat[cid] = []
        for turn in turns:
            librechat[cid].append(to_librechat(turn, parent))
            parent = turn[-1]["_id"]
    return Workload(
        conversations,
        stored,
        reservations,
        {cid: [to_langchain(turn) for turn in turns] for cid, turns in stored.items()},
        librechat,
    )


WriteStep = Callable[[int, int], Awaitable[None]]
"""Store turn `t` of conversation `c`: step(c, t)."""


def langchain_history(sync_client: Any, db_name: str, session_id: str) -> Any:
    from langchain_mongodb import MongoDBChatMessageHistory

    return MongoDBChatMessageHistory(None, session_id, database_name=db_name, client=sync_client)


def langgraph_graph(sync_client: Any, db_name: str) -> tuple[Any, list[list[Any]]]:
    """A one-node `StateGraph(MessagesState)` with the MongoDB checkpointer; the node answers
    with the turn's messages put in the returned list before each invoke."""
    from langgraph.checkpoint.mongodb import MongoDBSaver
    from langgraph.graph import START, MessagesState, StateGraph

    replies: list[list[Any]] = []

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": replies.pop()}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    saver = MongoDBSaver(sync_client, db_name=db_name)
    return builder.compile(checkpointer=saver), replies


async def _logger(db: Any, sync_client: Any, inputs: Workload) -> WriteStep:
    logger = AgentMessageLogger(db)
    await logger.ensure_indexes()

    async def step(c: int, t: int) -> None:
        conversation = inputs.conversations[c]
        turn_id, messages = conversation.turns[t]
        await logger.log_messages(
            conversation.conversation_id, messages, user_id=conversation.user_id, turn_id=turn_id
        )

    return step


async def _raw_two(db: Any, sync_client: Any, inputs: Workload) -> WriteStep:
    await create_indexes(db)
    conversations, messages = db["agent_conversations"], db["agent_messages"]

    async def step(c: int, t: int) -> None:
        cid = inputs.conversations[c].conversation_id
        reserve = inputs.reservations[cid][t]
        await conversations.find_one_and_update(
            reserve.filter,
            reserve.pipeline,
            upsert=True,
            projection=RESERVED,
            return_document=ReturnDocument.AFTER,
        )
        await messages.insert_many(inputs.stored[cid][t], ordered=False)

    return step


async def _raw_insert(db: Any, sync_client: Any, inputs: Workload) -> WriteStep:
    await create_indexes(db)
    collection = db["agent_messages"]

    async def step(c: int, t: int) -> None:
        cid = inputs.conversations[c].conversation_id
        await collection.insert_many(inputs.stored[cid][t], ordered=False)

    return step


async def _langchain(db: Any, sync_client: Any, inputs: Workload) -> WriteStep:
    histories = {
        c.conversation_id: langchain_history(sync_client, db.name, c.conversation_id)
        for c in inputs.conversations
    }

    async def step(c: int, t: int) -> None:
        cid = inputs.conversations[c].conversation_id
        histories[cid].add_messages(inputs.langchain[cid][t])

    return step


async def _langgraph(db: Any, sync_client: Any, inputs: Workload) -> WriteStep:
    graph, replies = langgraph_graph(sync_client, db.name)

    async def step(c: int, t: int) -> None:
        cid = inputs.conversations[c].conversation_id
        first, *rest = inputs.langchain[cid][t]
        replies.append(rest)
        graph.invoke({"messages": [first]}, {"configurable": {"thread_id": cid}})

    return step


async def _librechat(db: Any, sync_client: Any, inputs: Workload) -> WriteStep:
    messages, conversations = db["messages"], db["conversations"]
    await messages.create_index([("messageId", 1), ("user", 1)], unique=True)
    await conversations.create_index([("conversationId", 1), ("user", 1)], unique=True)

    async def step(c: int, t: int) -> None:
        conversation = inputs.conversations[c]
        cid, user = conversation.conversation_id, conversation.user_id
        turn = inputs.librechat[cid][t]
        for message in turn:
            await messages.find_one_and_update(
                {"messageId": message["messageId"], "user": user},
                {"$set": message},
                upsert=True,
                return_document=ReturnDocument.AFTER,
            )
        await conversations.find_one_and_update(
            {"conversationId": cid, "user": user},
            {
                "$set": {"title": "New Chat", "endpoint": "agents", "updatedAt": utc_now()},
                "$setOnInsert": {"createdAt": turn[0]["createdAt"]},
            },
            upsert=True,
            return_document=ReturnDocument.AFTER,
        )

    return step


_SETUPS: dict[str, Callable[[Any, Any, Workload], Awaitable[WriteStep]]] = {
    "logger": _logger,
    "raw two": _raw_two,
    "raw insert": _raw_insert,
    "langchain": _langchain,
    "langgraph": _langgraph,
    "librechat": _librechat,
}


@asynccontextmanager
async def write_contender(
    name: str, async_client: Any, sync_client: Any, workload: Workload, db_name: str
) -> AsyncIterator[WriteStep]:
    """Set up one contender on a fresh database (untimed); yield its per-turn step."""
    inputs = copy.deepcopy(workload)  # no contender sees objects another one touched
    try:
        yield await _SETUPS[name](async_client[db_name], sync_client, inputs)
    finally:
        await async_client.drop_database(db_name)


WRITERS = tuple(_SETUPS)
