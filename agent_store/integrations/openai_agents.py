"""OpenAI Agents SDK sessions on the store: `ConversationSession` is a `Session` whose history
is a stored conversation. Needs the `openai-agents` extra; the rest of the package does not
import this module.

One item is one message, so `get_items(limit)` reads the last `limit` messages
and `pop_item` removes the last one:

- a user, system or developer message item: a `user` or `system` message with
  its text (hidden runtime context stripped first);
- an assistant message item: an `assistant` message with its text;
- a `function_call`: an `assistant` message with one tool call, under the
  item's own `call_id`; a `function_call_output`: a `tool` message answering it;
- any other item (reasoning, web search, file search, computer-use, MCP,
  shell, custom tool calls and their outputs, compaction): an `assistant`
  message with no content, holding the whole item in its `native` extension.
  The readers that build another model's input (exports, the Pydantic AI and
  LangChain histories) skip it; this session gives it back as it came.

Whatever an item holds beyond the chat fields (its `id`, `status`, content
parts) is kept in `native`, so `get_items` gives back exactly the items added.
Messages other writers stored are given back as the items their chat fields
make, an assistant message with the `id` an output message item needs
(`msg_<message id>`). `get_items` gives each call's answers right after the
model response making it, and a stand-in (`PENDING_RESULT`) for a call the
conversation went on after without a result, as the LangChain history does
(`in_call_order`); a call of the last response is left open, and a result answering
no call is left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

try:
    from agents.items import TResponseInputItem
    from agents.memory import SessionSettings
    from agents.memory.session_settings import resolve_session_limit
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "agent_store.integrations.openai_agents needs the OpenAI Agents SDK: "
        "install agent-conversation-store[openai-agents]"
    ) from exc

import contextlib
import hashlib

from pydantic import ValidationError

from agent_store.core import (
    AgentMessage,
    AssistantMessage,
    Conflict,
    FunctionCall,
    InvalidInput,
    NotFound,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
    describe_validation_error,
    result_text,
)
from agent_store.integrations._appends import Appends
from agent_store.integrations._native import kept_form, native_form, with_native
from agent_store.integrations._pairing import in_call_order
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

__all__ = ["FORMAT", "ConversationSession", "item_from_message", "message_from_item"]

FORMAT = "openai-agents"
"""The `native.format` of messages made from Agents SDK items."""

_TEXT_PARTS = ("input_text", "output_text", "text")


# -- items into messages --------------------------------------------------------------


def message_from_item(
    item: Mapping[str, Any], *, index: int = 0, markers: RuntimeContextMarkers = DEFAULT_MARKERS
) -> AgentMessage:
    """The stored message of one Agents SDK input item (a dict, as the SDK hands a session).

    Raises InvalidInput naming the item when it is not an item or lacks what its kind needs.
    """
    if not isinstance(item, Mapping):
        raise InvalidInput(f"invalid item {index}: a {type(item).__name__}, not an item object")
    kind = item.get("type", "message" if "role" in item else None)
    if not isinstance(kind, str) or not kind:
        raise InvalidInput(f"invalid item {index}: it has neither a `type` nor a `role`")
    if kind == "message" and item.get("role") == "user":
        item = _without_hidden_context(item, markers)
    subject = f"item {index} ({kind})"
    try:
        message = _chat_message(kind, item, index)
    except ValidationError as exc:
        raise InvalidInput(describe_validation_error(exc, subject=subject)) from exc
    if message is None:
        return AssistantMessage(native=kept_form(FORMAT, item, subject=subject))
    return with_native(message, FORMAT, item, _rebuilt(message)[0], subject=subject)


def _chat_message(kind: str, item: Mapping[str, Any], index: int) -> AgentMessage | None:
    """The message whose chat fields hold the item, or None for an item they cannot hold."""
    if kind == "message":
        text = _text_of(item.get("content"))
        role = item.get("role")
        if role == "user":
            return UserMessage(content=text)
        if role in ("system", "developer"):
            return SystemMessage(content=text)
        if role == "assistant":
            return AssistantMessage(content=text)
        raise InvalidInput(f"invalid item {index}: a message with unknown role {role!r}")
    if kind == "function_call":
        call = ToolCall(
            id=item.get("call_id"),
            function=FunctionCall(name=item.get("name"), arguments=item.get("arguments", "{}")),
        )
        return AssistantMessage(tool_calls=[call])
    if kind == "function_call_output":
        return ToolMessage(tool_call_id=item.get("call_id"), content=_text_of(item.get("output")))
    return None


def _text_of(content: Any) -> str:
    """The readable text of an item's content: a string, or its parts' texts and `[kind]` notes."""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content if isinstance(content, list) else ():
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in _TEXT_PARTS:
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            texts.append(f"[{kind}]")
    return "\n".join(texts)


def _without_hidden_context(
    item: Mapping[str, Any], markers: RuntimeContextMarkers
) -> dict[str, Any]:
    """A user item with hidden runtime context removed from its text, wherever it is."""
    content = item.get("content")
    if isinstance(content, str | list):
        return {**item, "content": strip_runtime_context_blocks(content, markers)}
    return dict(item)


# -- messages into items --------------------------------------------------------------


def _rebuilt(message: AgentMessage) -> list[dict[str, Any]]:
    """The items a message's chat fields make, before its native form is applied."""
    if isinstance(message, ToolMessage):
        return [
            {
                "type": "function_call_output",
                "call_id": message.tool_call_id,
                "output": result_text(message),
            }
        ]
    if isinstance(message, AssistantMessage):
        items: list[dict[str, Any]] = []
        if message.content is not None:
            part = {"type": "output_text", "text": message.content, "annotations": []}
            items.append(
                {"type": "message", "role": "assistant", "status": "completed", "content": [part]}
            )
        for call in message.tool_calls or ():
            items.append(
                {
                    "type": "function_call",
                    "call_id": call.id,
                    "name": call.function.name,
                    "arguments": call.function.arguments,
                }
            )
        return items or [{}]
    return [{"role": message.role, "content": prompt_text(message) or ""}]


def item_from_message(message: AgentMessage) -> list[dict[str, Any]]:
    """The Agents SDK items of a stored message, in order: exactly the item it was made from,
    or for a message another writer stored, the items its chat fields make, an assistant
    message item carrying `msg_<the message's id>` as its `id` (an output message needs one).

    An assistant message carrying only an error or a HITL action, which no model said, has none.
    """
    rebuilt = _rebuilt(message)
    if message.native is not None and message.native.format == FORMAT:
        return [native_form(FORMAT, message, rebuilt[0])]
    return [_with_id(item, message) if item.get("type") == "message" else item
            for item in rebuilt if item]  # fmt: skip


def _with_id(item: dict[str, Any], message: AgentMessage) -> dict[str, Any]:
    """An output message item of another writer's message, with an id derived from it."""
    key = message.id
    if key is None:  # a message not stored: its digest, so the id is the same every time
        dumped = message.model_dump_json(exclude={"created_at"}).encode()
        key = hashlib.sha256(dumped).hexdigest()[:24]
    return {"id": f"msg_{key}", **item}


def _one_response(response: Sequence[AssistantMessage], message: AssistantMessage) -> bool:
    """Whether `message` belongs to the model response the messages before it made, as the
    SDK stores one: one message per item (reasoning, calls, at most one text). A HITL prompt,
    the runtime's question, is never part of one."""
    said = sum(m.content is not None for m in (*response, message))
    return message.hitl_action is None and said <= 1


def items_from_messages(messages: Sequence[AgentMessage]) -> list[dict[str, Any]]:
    """The Agents SDK items of stored messages, as a model is given them: in order, each
    call's answer right after the response making it (`in_call_order`)."""
    ordered = in_call_order(messages, joins=_one_response)
    return [item for message in ordered for item in item_from_message(message)]


# -- the session ----------------------------------------------------------------------


class ConversationSession:
    """An Agents SDK `Session` keeping its history as a stored conversation.

    Pass it as `Runner.run(agent, input, session=...)`. `session_id` is the
    conversation id. With `user_id`, the session is a runtime acting for that user
    (`strict_owner`): only their conversation is read, written, popped or cleared; a new id
    is created as theirs, and any other (a service's unowned one, another user's, another
    user's legacy turns when the store is given them) reads empty and a write is NotFound,
    as to the user's token, nothing written. Its turns stay a runtime's.
    Each `add_items` call is one logged turn: two round trips, and a repeat
    of a call that raised is stored once. `get_items` is one round trip.
    """

    session_settings: SessionSettings | None

    def __init__(
        self,
        session_id: str,
        db: Database,
        *,
        user_id: str | None = None,
        rules: TurnRules | None = None,
        session_settings: SessionSettings | None = None,
        logger: AgentMessageLogger | None = None,
        store: ConversationStore | None = None,
    ) -> None:
        """A session on conversation `session_id` of `db` (a PyMongo `AsyncDatabase` or Motor).
        `logger` and `store` default to plain ones on `db` with `rules`; pass your own to
        wire the legacy turns during a migration (MIGRATION.md, Transition flags), as the
        service does."""
        self.session_id = validate_identifier(session_id, "session_id")
        self.user_id = validate_identifier(user_id, "user_id") if user_id is not None else None
        self.session_settings = session_settings
        self.logger = logger or AgentMessageLogger(db, rules=rules)
        self.store = store or ConversationStore(db, rules=rules)
        self._appends = Appends(self.logger, self.session_id, user_id=self.user_id, prefix="agents")

    async def get_items(self, limit: int | None = None) -> list[TResponseInputItem]:
        """The last `limit` items (all with None, or the settings' limit), oldest first."""
        limit = resolve_session_limit(limit, self.session_settings)
        if limit is not None and limit <= 0:
            return []
        messages = await self._window(limit)
        # Every cut text back whole (a call awaiting approval runs on its whole arguments):
        # two lookups when a message was cut, none otherwise.
        messages = await self.store.with_full_texts(messages)
        items = items_from_messages(messages)
        return cast(list[TResponseInputItem], items[-limit:] if limit else items)

    async def _window(self, limit: int | None) -> list[AgentMessage]:
        """The last `limit` messages (all with None), reaching back, twice as far each time,
        until they hold the call every result among them answers, or the first message: the
        items are placed as the whole history places them (a result after its call), so the
        last `limit` are those of the whole history."""
        size = limit
        while True:
            found = await self.store.recent_messages(
                self.session_id, limit=size, user_id=self.user_id
            )
            if size is None or len(found) < size or not _results_before(found):
                return found
            size *= 2

    async def add_items(self, items: list[TResponseInputItem]) -> None:
        """Store the items as one turn (idempotent when a failed call is repeated)."""
        if not items:
            return
        markers = self.logger.rules.markers
        messages = [
            message_from_item(cast(Mapping[str, Any], item), index=index, markers=markers)
            for index, item in enumerate(items)
        ]
        await self._appends.append(messages)

    async def pop_item(self) -> TResponseInputItem | None:
        """Remove the last stored message and return its item; None when there is none.

        A message that makes no item (another writer's error note) is removed on the way.
        Another writer's message that makes several items (a response's text and its calls)
        is not removed (Conflict): the pop would remove items it does not return; the
        store's `pop_last_message` removes it whole. A call repeating one that raised
        StorageUnavailable is its retry: it finishes the earlier pop and returns that item,
        removing no other message (`pop_last_message`). Items added again after a pop
        removed them are a new turn, even those of an add that raised before it; a pop
        leaves any other add that raised to its retry. A message a LangGraph checkpoint of
        the conversation refers to is not removed (Conflict).
        """
        while True:
            message = await self.store.pop_last_message(
                self.session_id, user_id=self.user_id, refuse=_of_several_items
            )
            if message is None:
                return None
            self._appends.popped(message)
            items = item_from_message(message)
            if items:
                return cast(TResponseInputItem, items[-1])

    async def clear_session(self) -> None:
        """Delete the conversation: its messages and its document."""
        with contextlib.suppress(NotFound):
            await self.store.delete(self.session_id, user_id=self.user_id)


def _of_several_items(message: AgentMessage) -> Conflict | None:
    """Conflict for a message that makes more than one item (another writer's response: its
    text and its calls), which `pop_item`, returning one item, may not remove; else None."""
    made = item_from_message(message)
    if len(made) <= 1:
        return None
    kinds = ", ".join(str(item.get("type") or item.get("role")) for item in made)
    return Conflict(
        f"could not pop the last item of session {message.conversation_id!r}: its last "
        f"message (seq {message.seq}), stored by another runtime, makes {len(made)} items "
        f"({kinds}), and removing it would remove them all, though pop_item returns one: "
        "it was not removed (only messages making no item after it were). Remove the whole "
        "message with "
        "`session.store.pop_last_message(session_id)`, or go back with that runtime's means"
    )


def _results_before(messages: list[AgentMessage]) -> bool:
    """Whether some result among the messages answers a call they do not make before it (a
    call of the same id made later is another call: a provider numbering calls per response
    reuses ids)."""
    made: set[str] = set()
    for message in messages:
        if message.role == "tool" and message.tool_call_id not in made:
            return True
        made.update(call.id for call in message.tool_calls or ())
    return False


if TYPE_CHECKING:
    from agents.memory import Session

    _conforms: type[Session] = ConversationSession
