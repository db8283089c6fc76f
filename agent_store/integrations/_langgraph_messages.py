"""LangChain messages into the store's messages and back, exactly. Pure, no I/O.

A LangChain message holds more than the OpenAI chat format: its own `id`,
`response_metadata`, `additional_kwargs`, token details, content blocks. The
store keeps what the format holds (`to_stored`); `extras_of` keeps, beside
it, only the fields the stored message does not give back, so that
`from_stored(stored, extras)` rebuilds a message equal to the original. A
message the format cannot hold at all (another class, a custom role) is not
mapped (`to_stored` answers None) and stays with the checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from agent_store.core import (
    AgentMessage,
    AssistantMessage,
    UserMessage,
    tool_outcome,
)
from agent_store.core import SystemMessage as StoredSystemMessage
from agent_store.core import ToolMessage as StoredToolMessage
from agent_store.integrations._langchain_messages import chat_message

WHOLE = "whole"
"""The extras key holding a whole message, when its fields alone would not rebuild it."""

MAPPED_CLASSES: tuple[type[BaseMessage], ...] = (
    HumanMessage,
    AIMessage,
    ToolMessage,
    SystemMessage,
)
"""The LangChain message classes the store holds; any other class stays with the checkpoint."""


def to_stored(message: BaseMessage) -> AgentMessage | None:
    """The store's message for a LangChain message, or None when the format cannot hold it."""
    if type(message) not in MAPPED_CLASSES:
        return None
    return chat_message(
        message,
        call_id=lambda index, call: call.get("id") or f"call-{message.id}-{index}",
        arguments=_arguments,
    )


def _arguments(args: Any) -> str:
    """A call's arguments as the store keeps them from any LangChain message (NaN and the
    infinities spelt as Python's `json` reads them back, `FunctionCall.arguments`)."""
    try:
        return json.dumps(args, ensure_ascii=False, separators=(",", ":"), allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        return "{}"  # no JSON at all: the real arguments are kept in the extras


def from_stored(stored: AgentMessage, extras: Mapping[str, Any] | None = None) -> BaseMessage:
    """The LangChain message of a stored message; `extras` restore what the format lacks.

    A stored message without extras (logged by another runtime) gets the store's
    message id as its LangChain id.
    """
    extras = dict(extras) if extras is not None else {"id": stored.id}
    whole = extras.get(WHOLE)
    if isinstance(whole, BaseMessage):
        return whole
    text = stored.content or ""
    if isinstance(stored, UserMessage):
        return HumanMessage(**({"content": text} | extras))
    if isinstance(stored, StoredSystemMessage):
        return SystemMessage(**({"content": text} | extras))
    if isinstance(stored, StoredToolMessage):
        failed = tool_outcome(stored) is not None
        status = "error" if failed else "success"
        fields = {"content": text, "tool_call_id": stored.tool_call_id, "status": status}
        return ToolMessage(**(fields | extras))
    assert isinstance(stored, AssistantMessage)
    answer: dict[str, Any] = {
        "content": text,
        "tool_calls": [
            {"name": c.function.name, "args": _parsed(c.function.arguments), "id": c.id}
            for c in stored.tool_calls or ()
        ],
    }
    if stored.token_usage is not None:
        used = stored.token_usage
        answer["usage_metadata"] = {
            "input_tokens": used.input_tokens,
            "output_tokens": used.output_tokens,
            "total_tokens": used.input_tokens + used.output_tokens,
        }
    return AIMessage(**(answer | extras))


def _parsed(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):  # no JSON, or nested deeper than Python reads
        return {}
    return value if isinstance(value, dict) else {}


def extras_of(original: BaseMessage, stored: AgentMessage) -> dict[str, Any]:
    """What to keep beside `stored` so that `from_stored(stored, extras) == original`.

    Only the fields the stored message does not give back: always the LangChain
    id, then whatever differs (metadata, content blocks, text the store cut or
    stripped of hidden context). Checked by rebuilding; when that fails the
    whole message is kept.
    """
    plain = from_stored(stored, {"id": None})
    extras: dict[str, Any] = {
        name: getattr(original, name)
        for name in type(original).model_fields
        if getattr(original, name) != getattr(plain, name)
    }
    extras["id"] = original.id
    if from_stored(stored, extras) != original:
        return {WHOLE: original}
    return extras
