"""Which stored tool message answers which call, and how a repeated call id is renamed.

One rule for every replay and every ingest path. Pure, no I/O.

The exports, the Pydantic AI history and the LangChain history all place each
call's answer right after the message that makes the call, wherever the answer
was stored:

- a tool message answers the latest earlier call of its id (ids are unique
  within a conversation; the exports rename the odd repeat of older data);
- a tool message answering no earlier call answers nothing and is left out;
- the first answer of a call is its answer, except a stand-in (a result
  marked `interrupted`, stored because the run ended before the call
  returned): a real result stored later for the same call wins over it.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent_store.core import AgentMessage, AssistantMessage, ToolMessage, answers_instead

CallKey = tuple[int, str]
"""A call: the index of the assistant message that makes it, and its id."""


def answers_to_calls(messages: Sequence[AgentMessage]) -> dict[CallKey, ToolMessage]:
    """Each call's answer by the rules above; a call without one is not in the result."""
    latest_call: dict[str, int] = {}
    answers: dict[CallKey, ToolMessage] = {}
    for index, message in enumerate(messages):
        if isinstance(message, AssistantMessage):
            for call in message.tool_calls or ():
                latest_call[call.id] = index
        elif isinstance(message, ToolMessage):
            assert message.tool_call_id is not None
            made_at = latest_call.get(message.tool_call_id)
            if made_at is None:
                continue
            key = (made_at, message.tool_call_id)
            current = answers.get(key)
            if answers_instead(message, current):
                answers[key] = message
    return answers


def in_call_order(messages: Sequence[AgentMessage]) -> list[AgentMessage]:
    """The messages with each call's answer (by the rules above) moved right after the
    message making it; an answer that lost to another (a stand-in a real result replaced)
    is left out, and a tool message answering no call stays where it was stored."""
    answers = answers_to_calls(messages)
    winners = {id(answer) for answer in answers.values()}
    made: set[str] = set()
    placed: list[AgentMessage] = []
    for index, message in enumerate(messages):
        if isinstance(message, ToolMessage) and (
            id(message) in winners or message.tool_call_id in made
        ):
            continue  # placed with its call, or lost to the answer placed there
        placed.append(message)
        if isinstance(message, AssistantMessage):
            made |= {call.id for call in message.tool_calls or ()}
            placed += [
                answers[(index, call.id)]
                for call in message.tool_calls or ()
                if (index, call.id) in answers
            ]
    return placed


def unique_call_id(call_id: str, used: set[str]) -> str:
    """`call_id`, or `<call_id>_<n>` with the lowest n from 2 not in `used`; added to `used`."""
    candidate, n = call_id, 1
    while candidate in used:
        n += 1
        candidate = f"{call_id}_{n}"
    used.add(candidate)
    return candidate
