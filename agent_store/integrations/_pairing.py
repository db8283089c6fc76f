"""Which stored tool message answers which call, and how a repeated call id is renamed.

One rule for every replay and every ingest path. Pure, no I/O.

The exports, the Pydantic AI history and the LangChain history all place each
call's answer right after the message that makes the call, wherever the answer
was stored:

- a tool message answers the latest earlier call of its id still without an
  answer, else the latest (`agent_store.core.answers_to_calls`: a provider
  numbering its calls per response repeats an id while an older call awaits
  approval; the exports rename repeats in what they produce);
- a tool message answering no earlier call answers nothing and is left out;
- the first answer of a call is its answer, except a stand-in (a result
  marked `interrupted`, stored because the run ended before the call
  returned): a real result stored later for the same call wins over it.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent_store.core import AgentMessage, AssistantMessage, CallKey, ToolMessage, answers_to_calls

__all__ = ["CallKey", "answers_to_calls", "in_call_order", "unique_call_id"]


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
