"""LangChain chat history on the store: `ConversationChatHistory` is a `BaseChatMessageHistory`
whose messages are a stored conversation, ordered by `seq`. Needs the `langchain` extra; the rest
of the package does not import this module.

- `HumanMessage`: a `user` message with its text (hidden runtime context stripped first);
- `AIMessage`: an `assistant` message with its text, its `tool_calls` (ids kept, `args` as
  JSON) and its `usage_metadata` as `token_usage`;
- `ToolMessage`: a `tool` message answering its `tool_call_id`; `status="error"` is marked
  as a failed call, and a stored result marked with any error reads back as `status="error"`
  (one with no text as what its error says, `result_text`);
- `SystemMessage`: a `system` message.

What a message holds beyond the chat fields (its `id`, `name`, `additional_kwargs`,
`response_metadata`, content blocks) is kept in the `native` extension, so the messages read
back equal the ones written. Messages other writers stored come back as the messages their
chat fields make; items only another runtime can take (an Agents SDK reasoning item) are
left out; a call's result stored a turn later (a confirmation) comes right after the call,
as a chat model requires, a call the conversation went on after without a result is
answered in the history only by a marked stand-in (`PENDING_RESULT`, `status="error"`), and
a result answering no call is left out.

One `aadd_messages` call is one logged turn (two round trips); `aget_messages` is one round
trip. The async methods need an async database (PyMongo `AsyncDatabase`, Motor); the sync
ones (`messages`, `add_messages`, `clear`) need a synchronous PyMongo `Database`, and with
one the async methods run them in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

try:
    from langchain_core.chat_history import BaseChatMessageHistory
    from langchain_core.messages import (
        AIMessage,
        BaseMessage,
        HumanMessage,
        messages_from_dict,
    )
    from langchain_core.messages import SystemMessage as LangChainSystemMessage
    from langchain_core.messages import ToolMessage as LangChainToolMessage
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "agent_store.integrations.langchain needs LangChain: "
        "install agent-conversation-store[langchain]"
    ) from exc

from pydantic import ValidationError
from pymongo.database import Database as SyncPyMongoDatabase

from agent_store.core import (
    AgentMessage,
    InvalidInput,
    NotFound,
    SystemMessage,
    ToolMessage,
    Unsupported,
    UserMessage,
    describe_validation_error,
    result_text,
    tool_outcome,
)
from agent_store.integrations._appends import Appends, adder
from agent_store.integrations._langchain_messages import chat_message
from agent_store.integrations._native import native_form, runtime_json, with_native
from agent_store.integrations._pairing import in_call_order
from agent_store.integrations._sync_driver import SyncDatabase, run_sync
from agent_store.store import (
    DEFAULT_MARKERS,
    AgentMessageLogger,
    ConversationStore,
    Database,
    RuntimeContextMarkers,
    TurnRules,
    prompt_text,
    strip_runtime_context_blocks,
    validate_identifier,
)

__all__ = ["FORMAT", "ConversationChatHistory", "langchain_from_message", "message_from_langchain"]

FORMAT = "langchain"
"""The `native.format` of messages made from LangChain messages."""


# -- LangChain messages into stored messages ------------------------------------------


def message_from_langchain(
    message: BaseMessage, *, index: int = 0, markers: RuntimeContextMarkers = DEFAULT_MARKERS
) -> AgentMessage:
    """The stored message of a LangChain message. Raises InvalidInput naming the message
    when it is of another kind than the four above or lacks what its kind needs."""
    if isinstance(message, HumanMessage):
        message = message.model_copy(
            update={"content": strip_runtime_context_blocks(message.content, markers)}
        )
    if isinstance(message, AIMessage):
        missing = [n for n, call in enumerate(message.tool_calls) if not call.get("id")]
        if missing:
            raise InvalidInput(
                f"invalid message {index} (ai): tool call {missing[0]} has no id, so no tool "
                "message could answer it"
            )
    subject = f"message {index} ({message.type})"
    native = runtime_json(message.model_dump(), subject=subject)
    try:
        stored = chat_message(message, call_id=lambda _, call: call["id"] or "")
    except ValidationError as exc:
        raise InvalidInput(describe_validation_error(exc, subject=subject)) from exc
    if stored is None:
        raise InvalidInput(
            f"invalid message {index}: a {type(message).__name__}; the store takes "
            "HumanMessage, AIMessage, ToolMessage and SystemMessage"
        )
    rebuilt = _rebuilt(stored)
    assert rebuilt is not None
    base = runtime_json(rebuilt.model_dump(), subject=subject)
    return with_native(stored, FORMAT, native, base, subject=subject)


def _tools_named(messages: Sequence[BaseMessage]) -> dict[str, str]:
    """The tool each `ToolMessage` among `messages` says it is a result of, where it says
    (`name` set; the first of an id): the logger refuses a result of a call of an earlier
    turn naming another tool than the stored call of its id (`calls_answered`)."""
    tools: dict[str, str] = {}
    for message in messages:
        if isinstance(message, LangChainToolMessage) and message.name:
            tools.setdefault(message.tool_call_id, str(message.name))
    return tools


# -- stored messages into LangChain messages ------------------------------------------


def _rebuilt(message: AgentMessage) -> BaseMessage | None:
    """The LangChain message a stored message's chat fields make; None for one no model said."""
    if isinstance(message, UserMessage):
        return HumanMessage(content=prompt_text(message) or "")
    if isinstance(message, SystemMessage):
        return LangChainSystemMessage(content=message.content or "")
    if isinstance(message, ToolMessage):
        return LangChainToolMessage(
            content=result_text(message),
            tool_call_id=message.tool_call_id or "",
            status="success" if tool_outcome(message) is None else "error",
        )
    if message.content is None and message.tool_calls is None:
        return None  # an error note, a HITL action alone, another runtime's item
    usage = message.token_usage
    return AIMessage(
        content=message.content or "",
        tool_calls=[
            {"name": c.function.name, "args": _arguments(c.function.arguments), "id": c.id}
            for c in message.tool_calls or ()
        ],
        usage_metadata={
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens,
        }
        if usage is not None
        else None,
    )


def _arguments(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):  # no JSON, or nested deeper than Python reads
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def langchain_from_message(message: AgentMessage) -> BaseMessage | None:
    """The LangChain message of a stored one: exactly the one it was made from, or for a
    message another writer stored, the one its chat fields make. None for a message no
    model said or can take (an error note, another runtime's reasoning item)."""
    rebuilt = _rebuilt(message)
    if message.native is None or message.native.format != FORMAT:
        return rebuilt
    subject = f"stored message {message.id}"
    base = runtime_json(rebuilt.model_dump(), subject=subject) if rebuilt is not None else {}
    form = native_form(FORMAT, message, base)
    return messages_from_dict([{"type": form["type"], "data": form}])[0]


def _history(messages: Sequence[AgentMessage]) -> list[BaseMessage]:
    """The LangChain history of stored messages: each as `langchain_from_message` gives it,
    each call answered right after its message (`in_call_order`). A call no stored result
    answers that the conversation went on after (any later message a model is given: the
    model is called again past it) is answered there by a stand-in, `PENDING_RESULT` with
    `status="error"`, as the Chat Completions export answers it: a chat model refuses a call
    without a result. A call of the last message is left open: the runtime is about to
    answer it. A result answering no call is left out."""
    converted = (langchain_from_message(message) for message in in_call_order(messages))
    return [message for message in converted if message is not None]


# -- the history ----------------------------------------------------------------------


class ConversationChatHistory(BaseChatMessageHistory):
    """A LangChain `BaseChatMessageHistory` keeping its messages as a stored conversation.

    Use it as `RunnableWithMessageHistory`'s history. With `user_id`, the history is a
    runtime acting for that user (`strict_owner`): only their conversation is read, written
    or cleared; a new id is created as theirs, and any other (a service's unowned one,
    another user's, another user's legacy turns when the store is given them) reads empty
    and a write is NotFound, as to the user's token, nothing written.
    """

    def __init__(
        self,
        conversation_id: str,
        db: Database | SyncPyMongoDatabase[Any],
        *,
        user_id: str | None = None,
        rules: TurnRules | None = None,
        logger: AgentMessageLogger | None = None,
        store: ConversationStore | None = None,
    ) -> None:
        """A history of conversation `conversation_id` in `db`: an async database (PyMongo
        `AsyncDatabase`, Motor) for the async methods, or a synchronous PyMongo `Database`.
        `logger` and `store` default to plain ones on `db` with `rules`; pass your own (on
        an async `db`) to wire the legacy turns during a migration (MIGRATION.md, Transition
        flags), as the service does."""
        self.conversation_id = validate_identifier(conversation_id, "conversation_id")
        self.user_id = validate_identifier(user_id, "user_id") if user_id is not None else None
        self._sync = isinstance(db, SyncPyMongoDatabase)
        if self._sync and (logger is not None or store is not None):
            raise InvalidInput(
                "a history on a synchronous pymongo Database builds its own logger and store: "
                "pass `logger` and `store` with an async database (PyMongo AsyncDatabase, "
                "Motor), which they are built on"
            )
        handle = SyncDatabase(db) if self._sync else db
        self.logger = logger or AgentMessageLogger(handle, rules=rules)
        self.store = store or ConversationStore(handle, rules=rules)
        self._appends = Appends(
            self.logger, self.conversation_id, user_id=self.user_id, prefix="langchain"
        )

    # -- async -----------------------------------------------------------------------

    async def aget_messages(self) -> list[BaseMessage]:
        """The conversation's messages in `seq` order (one round trip)."""
        if self._sync:
            return await asyncio.to_thread(lambda: self.messages)
        return await self._read()

    async def aadd_messages(self, messages: Sequence[BaseMessage]) -> None:
        """Store the messages as one turn (idempotent when a failed call is repeated)."""
        if self._sync:
            adder()  # the thread appends as this task: a retry is told by the task
            await asyncio.to_thread(self.add_messages, messages)
            return
        await self._append(messages)

    async def aclear(self) -> None:
        """Delete the conversation: its messages and its document."""
        if self._sync:
            await asyncio.to_thread(self.clear)
            return
        await self._clear()

    # -- sync ------------------------------------------------------------------------

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        """The conversation's messages in `seq` order (needs a synchronous database)."""
        self._check_sync("messages")
        return run_sync(self._read())

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        """Store the messages as one turn (needs a synchronous database)."""
        self._check_sync("add_messages")
        run_sync(self._append(messages))

    def clear(self) -> None:
        """Delete the conversation (needs a synchronous database)."""
        self._check_sync("clear")
        run_sync(self._clear())

    def _check_sync(self, method: str) -> None:
        if not self._sync:
            raise Unsupported(
                f"{method} needs a synchronous pymongo Database; this history holds an async "
                "one: use aget_messages, aadd_messages and aclear"
            )

    # -- shared ----------------------------------------------------------------------

    async def _read(self) -> list[BaseMessage]:
        stored = await self.store.recent_messages(self.conversation_id, user_id=self.user_id)
        # Every cut text back whole (a call awaiting approval runs on its whole arguments):
        # two lookups when a message was cut, none otherwise.
        stored = await self.store.with_full_texts(stored)
        return _history(stored)

    async def _append(self, messages: Sequence[BaseMessage]) -> None:
        if not messages:
            return
        markers = self.logger.rules.markers
        await self._appends.append(
            [message_from_langchain(m, index=i, markers=markers) for i, m in enumerate(messages)],
            tool_names=_tools_named(messages),
        )

    async def _clear(self) -> None:
        try:
            await self.store.delete(self.conversation_id, user_id=self.user_id)
        except NotFound:
            return
