"""A LangChain message's chat fields as a stored message: the one conversion the LangChain
history and the LangGraph checkpointer share. Pure, no I/O.

What each keeps beyond the chat fields differs (the history a `native` form, the
checkpointer extras beside its checkpoint); the stored message itself does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.tool import ToolCall as LangChainToolCall

from agent_store.core import (
    AgentMessage,
    AssistantMessage,
    FunctionCall,
    TokenUsage,
    ToolCall,
    UserMessage,
    outcome_error,
)
from agent_store.core import SystemMessage as StoredSystemMessage
from agent_store.core import ToolMessage as StoredToolMessage

CallId = Callable[[int, LangChainToolCall], str]
"""The id a tool call is stored under, from its index and the call."""


def content_text(content: str | list[Any]) -> str:
    """The readable text of LangChain content: a string, or its text blocks and `[type]` notes."""
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if isinstance(block, str):
            texts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            texts.append(str(block.get("text", "")))
        else:
            texts.append(f"[{block.get('type') if isinstance(block, dict) else 'block'}]")
    return "\n".join(texts)


def chat_message(
    message: BaseMessage,
    *,
    call_id: CallId,
    arguments: Callable[[Any], Any] = lambda args: args,
) -> AgentMessage | None:
    """The stored message of a LangChain message's chat fields; None for another class.

    `arguments` turns a tool call's `args` into what `FunctionCall` takes (a dict is
    serialized as JSON).
    """
    text = content_text(message.content)
    if isinstance(message, HumanMessage):
        return UserMessage(content=text)
    if isinstance(message, SystemMessage):
        return StoredSystemMessage(content=text)
    if isinstance(message, ToolMessage):
        failed = outcome_error("failed") if message.status == "error" else None
        return StoredToolMessage(tool_call_id=message.tool_call_id, content=text, error=failed)
    if not isinstance(message, AIMessage):
        return None
    calls = [
        ToolCall(
            id=call_id(index, call),
            function=FunctionCall(name=call["name"], arguments=arguments(call["args"])),
        )
        for index, call in enumerate(message.tool_calls)
    ]
    usage = message.usage_metadata
    return AssistantMessage(
        content=None if calls and not text else text,
        tool_calls=calls or None,
        token_usage=(
            TokenUsage(input_tokens=usage["input_tokens"], output_tokens=usage["output_tokens"])
            if usage
            else None
        ),
    )
