"""How a tool result that is not a plain success, a retry note, and a tool's content in the
user's voice are told apart in the store.

The OpenAI chat format has no field for "this call failed", "this is the framework asking
the model to try again" or "this user-voice text is a tool's", and the contract adds none.
The message's `error` field carries a short, fixed marker instead; its `content` stays
exactly what the model was shown, so exports and replays send the same text. Pure, no I/O:
the Pydantic AI bridge, the stream builders and the exports share these markers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime
from typing import Literal, get_args

from agent_store.core._models import (
    AgentMessage,
    AssistantMessage,
    MessageError,
    ToolMessage,
    UserMessage,
)

ToolOutcome = Literal["failed", "denied", "interrupted", "retried"]
"""Why a tool result is not a plain success (the outcomes Pydantic AI knows, too)."""

TOOL_OUTCOMES: tuple[ToolOutcome, ...] = get_args(ToolOutcome)
_BY_NAME: dict[str, ToolOutcome] = {outcome: outcome for outcome in TOOL_OUTCOMES}

RETRY_FEEDBACK = "retry feedback"
TOOL_CONTENT = "tool content"
"""The marker of a user message that is content a tool returned for the model to read (a
Pydantic AI `ToolReturn`'s `content`): the model receives it in the user's voice, yet it is
the tool's, never the person's, words."""
STREAM_INTERRUPTED = "stream interrupted"

INTERRUPTED_RESULT = "No result: the run ended before this tool call returned."
DENIED_RESULT = "The user denied this tool call."
PENDING_RESULT = "No result yet: this tool call awaits approval or its result."
"""What an export answers a pending call with, in the replay it produces; never stored."""
FAILED_RESULT = "The tool call failed"
"""How a replay begins the text of a result stored with only an error (`result_text`)."""

_OUTCOME_MARKER = re.compile(r"^tool call (failed|denied|interrupted|retried)(?:: ([A-Za-z_]+))?\Z")
_FEEDBACK_MARKER = re.compile(r"^retry feedback(?:: ([A-Za-z_]+))?\Z")


def outcome_error(outcome: ToolOutcome, cause: str | None = None) -> MessageError:
    """The `error` marker of a tool result with this outcome: `tool call retried: model_retry`."""
    return MessageError(message=f"tool call {outcome}" + (f": {cause}" if cause else ""))


def tool_outcome(message: ToolMessage) -> tuple[ToolOutcome, str | None] | None:
    """The outcome and cause a tool message is marked with, or None for a plain result."""
    if message.error is None:
        return None
    match = _OUTCOME_MARKER.match(message.error.message)
    if match is None:
        return ("failed", None)  # an error written by someone else is still a failure
    return _BY_NAME[match.group(1)], match.group(2)


def answers_instead(candidate: ToolMessage, current: ToolMessage | None) -> bool:
    """Whether `candidate` is a call's answer rather than `current`, the one found before: the
    first answer stands, except a stand-in, which a real result replaces."""
    return current is None or (is_stand_in(current) and not is_stand_in(candidate))


CallKey = tuple[int, str]
"""A call: the index of the assistant message that makes it, and its id."""


def answers_to_calls(messages: Sequence[AgentMessage]) -> dict[CallKey, ToolMessage]:
    """Each call's answer among a conversation's messages; a call without one is left out.

    A tool message answers the call `calls_answered` pairs it with; when a call has more
    than one, `answers_instead` decides which answer stands (a real result replaces a
    stand-in).
    """
    answers: dict[CallKey, ToolMessage] = {}
    for index, call in calls_answered(messages).items():
        message = messages[index]
        assert isinstance(message, ToolMessage)
        if answers_instead(message, answers.get(call)):
            answers[call] = message
    return answers


def calls_answered(messages: Sequence[AgentMessage]) -> dict[int, CallKey]:
    """The call each tool message answers, by the tool message's index among `messages`.

    A tool message answers the latest earlier call of its id that has no answer yet, as
    the reservation takes it out of `pending_calls` (a provider that numbers its calls per
    response repeats an id while an older call awaits approval; one numbering them per
    turn repeats `call_0` every turn); when every earlier call of its id has one, the
    latest. A tool message answering no earlier call answers nothing and is left out.
    """
    calls_of: dict[str, list[int]] = {}
    answered: dict[int, CallKey] = {}
    taken: set[CallKey] = set()
    for index, message in enumerate(messages):
        if isinstance(message, AssistantMessage):
            for call in message.tool_calls or ():
                calls_of.setdefault(call.id, []).append(index)
        elif isinstance(message, ToolMessage) and message.tool_call_id in calls_of:
            call_id = message.tool_call_id
            made = calls_of[call_id]
            at = next((i for i in reversed(made) if (i, call_id) not in taken), made[-1])
            answered[index] = (at, call_id)
            taken.add((at, call_id))
    return answered


def is_stand_in(message: ToolMessage) -> bool:
    """Whether a tool message only stands in for a result that never came (`interrupted`).

    A real result stored for the same call, however late, wins over it in every replay.
    """
    marked = tool_outcome(message)
    return marked is not None and marked[0] == "interrupted"


def feedback_error(cause: str | None = None) -> MessageError:
    """The `error` marker of a user message that is the framework's retry note, not a person."""
    return MessageError(message=RETRY_FEEDBACK + (f": {cause}" if cause else ""))


def feedback_cause(message: UserMessage) -> tuple[bool, str | None]:
    """Whether a user message is a retry note, and its cause."""
    if message.error is None:
        return False, None
    match = _FEEDBACK_MARKER.match(message.error.message)
    return (match is not None), (match.group(1) if match else None)


def tool_content_error() -> MessageError:
    """The `error` marker of a user message that is content a tool returned, not a person's."""
    return MessageError(message=TOOL_CONTENT)


def is_tool_content(message: AgentMessage) -> bool:
    """Whether a message is content a tool returned for the model, in the user's voice."""
    return message.error is not None and message.error.message == TOOL_CONTENT


def voice_marker(message: AgentMessage) -> str | None:
    """The marker a user message's `error` holds that makes a runtime send its text in
    another voice than a person's (the application's retry feedback, a tool's content), or
    None: only a runtime writes one, never a person's words (the service refuses it from a
    user token)."""
    if not isinstance(message, UserMessage) or message.error is None:
        return None
    if feedback_cause(message)[0] or is_tool_content(message):
        return message.error.message
    return None


_STAND_IN_TEXT: dict[ToolOutcome, str] = {
    "interrupted": INTERRUPTED_RESULT,
    "denied": DENIED_RESULT,
}


def result_text(message: ToolMessage) -> str:
    """What a model is given of a tool result: its content; for one stored with no text and
    an `error`, a text saying the call did not succeed and why, never an empty output a model
    would read as a success. A denial or an interruption reads as the library's own stand-in
    (`DENIED_RESULT`, `INTERRUPTED_RESULT`); any other error as `The tool call failed: ` and
    its cause, or the error's message when it is no marker (`upstream timeout`)."""
    if message.content or message.error is None:
        return message.content or ""
    marker = _OUTCOME_MARKER.match(message.error.message)
    if marker is None:
        return f"{FAILED_RESULT}: {message.error.message}"
    outcome, cause = _BY_NAME[marker.group(1)], marker.group(2)
    if outcome in _STAND_IN_TEXT:
        return _STAND_IN_TEXT[outcome]
    return f"{FAILED_RESULT}: {cause}" if cause else f"{FAILED_RESULT}."


def stand_in_result(
    tool_call_id: str, created_at: datetime, outcome: ToolOutcome = "interrupted"
) -> ToolMessage:
    """A result for a call that never got one (`interrupted` or `denied`), marked as such."""
    return ToolMessage(
        tool_call_id=tool_call_id,
        content=_STAND_IN_TEXT[outcome],
        error=outcome_error(outcome),
        created_at=created_at,
    )


def interruption_notice(created_at: datetime) -> AssistantMessage:
    """The message that ends a turn whose stream was cut off."""
    return AssistantMessage(error=MessageError(message=STREAM_INTERRUPTED), created_at=created_at)
