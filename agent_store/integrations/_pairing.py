"""Which stored tool message answers which call, and how a repeated call id is renamed.

One rule for every replay and every ingest path. Pure, no I/O.

The exports, the Pydantic AI history, the LangChain history and the Agents SDK
session all place each call's answer right after the message that makes the call
(for the session, the run of assistant messages one model response made),
wherever the answer was stored:

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

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

from agent_store.core import (
    PENDING_RESULT,
    AgentMessage,
    AssistantMessage,
    CallKey,
    SystemMessage,
    ToolMessage,
    UserMessage,
    answers_to_calls,
    outcome_error,
)

__all__ = [
    "CallKey",
    "Joins",
    "answers_to_calls",
    "in_call_order",
    "pending_stand_in",
    "unique_call_id",
]


Joins = Callable[[Sequence[AssistantMessage], AssistantMessage], bool]
"""Whether an assistant message joins the response of the assistant messages right before it
(stored consecutively), so that the answers of all their calls come after the last of them."""


def in_call_order(
    messages: Sequence[AgentMessage], *, joins: Joins | None = None
) -> list[AgentMessage]:
    """The messages as a model is given them: each call answered once, right after the
    response making it.

    A response is the message making the call, or with `joins`, the consecutive assistant
    messages it joins. The answers (by the rules above) of a response's calls follow it
    together, in the order they were stored, so answers stored right after it stay as they
    are; an answer that lost to another (a stand-in a real result replaced), and a tool
    message answering no call, are left out. A call without an answer is answered, as
    `chat_completions` answers it, by a stand-in (`pending_stand_in`, never stored) when a
    message a model is given follows its response (`_given`: the model is called again past
    the call, and a chat model refuses a call without a result before a later message). A
    call of the last response, nothing but its answers after it, is left open: the runtime is
    about to answer it. A response with a stand-in has all its answers, the stored ones too,
    right after its last message making calls, before a text of the response after them
    (`_answered`).
    """
    answers = answers_to_calls(messages)
    stored_at = {id(message): index for index, message in enumerate(messages)}
    given = [i for i, m in enumerate(messages) if _given(m)]
    went_on_until = given[-1] if given else -1
    placed: list[AgentMessage] = []
    response: list[tuple[int, AssistantMessage]] = []
    after_calls = 0  # where in `placed` the response's last message making calls ends
    for index, message in enumerate([*messages, None]):
        if response and not (
            isinstance(message, AssistantMessage)
            and joins is not None
            and joins([m for _, m in response], message)
        ):
            went_on = response[-1][0] < went_on_until
            together, at_calls = _answered(response, answers, stored_at, went_on=went_on)
            at = after_calls if at_calls else len(placed)
            placed[at:at] = together
            response = []
        if message is None:
            break
        if isinstance(message, AssistantMessage):
            response.append((index, message))
            if message.tool_calls:
                after_calls = len(placed) + 1
        elif isinstance(message, ToolMessage):
            continue  # placed with the call it answers, or answering none: left out
        placed.append(message)
    return placed


def _given(message: AgentMessage) -> bool:
    """Whether a model is given the message where it was stored: a user or system message,
    or an assistant message with text or calls (not an error note, a HITL action alone or
    another runtime's item, which no history gives a chat model). A tool message is given
    with its call."""
    if isinstance(message, UserMessage | SystemMessage):
        return True
    return isinstance(message, AssistantMessage) and (
        message.content is not None or bool(message.tool_calls)
    )


def _answered(
    response: Sequence[tuple[int, AssistantMessage]],
    answers: Mapping[CallKey, ToolMessage],
    stored_at: Mapping[int, int],
    *,
    went_on: bool,
) -> tuple[list[AgentMessage], bool]:
    """A response's answers, kept together: those stored in stored order, then the stand-ins
    of its calls without one when the conversation went on after it, in call order; and
    whether they go right after its last message making calls (True: it has a stand-in,
    which goes before a text of the response after the calls, the Agents SDK's converter
    joining such a text to the calls only when no answer comes between them, so none of the
    answers may come after it) rather than after the whole response (as stored)."""
    found: list[AgentMessage] = []
    stand_ins: list[AgentMessage] = []
    for index, message in response:
        for call in message.tool_calls or ():
            answer = answers.get((index, call.id))
            if answer is not None:
                found.append(answer)
            elif went_on:
                stand_ins.append(pending_stand_in(call.id, message.created_at))
    found.sort(key=lambda answer: stored_at[id(answer)])
    return [*found, *stand_ins], bool(stand_ins)


def pending_stand_in(call_id: str, created_at: datetime) -> ToolMessage:
    """The answer a replay gives a call still without a result that the conversation went on
    after: `PENDING_RESULT`, marked failed (a chat model refuses a call without a result)."""
    return ToolMessage(
        tool_call_id=call_id,
        content=PENDING_RESULT,
        error=outcome_error("failed"),
        created_at=created_at,
    )


def unique_call_id(call_id: str, used: set[str]) -> str:
    """`call_id`, or `<call_id>_<n>` with the lowest n from 2 not in `used`; added to `used`."""
    candidate, n = call_id, 1
    while candidate in used:
        n += 1
        candidate = f"{call_id}_{n}"
    used.add(candidate)
    return candidate
