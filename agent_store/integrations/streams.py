"""Build a turn's messages from the events a runtime streamed while it answered.

Pure, except `log_streamed_turn`, which stores the result.

Both protocols feed one `TurnAssembler`, which keeps the OpenAI pairing rules
whatever order events arrive in:

- text and tool calls accumulate into one assistant message until a tool
  result arrives; text after a result starts the next assistant message;
- every tool result is placed right after the message that made its call,
  in call order, even when it arrives after the run ended;
- a HITL prompt or an error is an assistant message of its own; a prompt
  naming a call (`tool_call_id`) stores it in `hitl_action.tool_call_ids`, and
  holds back that call, of this turn or an earlier one, until another prompt
  names it; one naming a call not started yet is placed right after that
  call's message once it starts;
- a call a HITL prompt holds back (it names the call) and that got no
  result stays pending: no `tool` message, so the conversation's
  `pending_calls` lists it until a later turn answers it — with its result,
  or `tool call denied` when its confirmation is refused, in any later
  turn built with `pending=`; a later turn may repeat its id, and an answer
  the store would pair with another call of that id is refused;
- the denial a refused prompt of this turn makes for a call of an earlier turn
  (a second question about it) follows that prompt, which it answers; a
  request asked again in the stream that answered it is a new question;
- any other call left without a result gets a synthetic one, marked in
  `error` as `tool call interrupted`, so no stored turn breaks a replay;
- a stream cut off before its end keeps what arrived and ends with an
  assistant message `error: {message: "stream interrupted"}`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ValidationError

from agent_store.core import (
    MAX_CALL_ID_CHARS,
    AgentMessage,
    AnsweredBefore,
    AssistantMessage,
    Conflict,
    FunctionCall,
    HitlAction,
    InvalidInput,
    MessageError,
    PendingCall,
    PromptNotPending,
    TokenUsage,
    ToolCall,
    ToolMessage,
    ToolOutcome,
    UserMessage,
    describe_validation_error,
    interruption_notice,
    outcome_error,
    shown,
    stand_in_result,
    tool_outcome,
    utc_now,
)
from agent_store.integrations._answering import nothing_logged, without_denials
from agent_store.integrations._stream_events import (
    ConfirmRequired,
    ConfirmResolved,
    DeliveredEvent,
    DoneEvent,
    ErrorEvent,
    HitlEvent,
    MetadataEvent,
    SseEvent,
    SseEvents,
    StreamToken,
    TextDelta,
    ToolCallEvent,
    ToolEnd,
    ToolError,
    ToolResultEvent,
    ToolStart,
    parse_metadata_events,
    parse_sse_events,
    parse_sse_text,
)

__all__ = [
    "ConfirmRequired",
    "ConfirmResolved",
    "DeliveredEvent",
    "DoneEvent",
    "ErrorEvent",
    "HitlEvent",
    "MetadataEvent",
    "SseEvent",
    "SseEvents",
    "StreamToken",
    "StreamedTurn",
    "TextDelta",
    "ToolCallEvent",
    "ToolEnd",
    "ToolError",
    "ToolResultEvent",
    "ToolStart",
    "TurnAssembler",
    "log_streamed_turn",
    "parse_metadata_events",
    "parse_sse_events",
    "parse_sse_text",
    "turn_from_metadata",
    "turn_from_sse",
]
from agent_store.store import AgentMessageLogger, ConversationStore, LoggedTurn


@dataclass(frozen=True)
class StreamedTurn:
    """What a stream amounts to: the turn's messages and what it resolved."""

    messages: tuple[AgentMessage, ...]
    interrupted: bool
    """The stream was cut off before its end; the last message says so."""
    resolved_request_ids: tuple[str, ...] = ()
    """HITL prompts a person answered during the stream, to clear once the turn is logged;
    not a request whose last answer held no call and that the stream asked again after it:
    once logged, that later question would be the one cleared."""
    resolved_calls: tuple[tuple[str, tuple[tuple[str, str | None], ...]], ...] = ()
    """The calls each prompt answered held when it was answered, as the builder read them (its
    `pending`, this turn's calls): the answer concerns those only. Each is (request id, calls),
    a call named by its tool call id and the message that made it (`PendingCall.message_id`;
    None for a call of this turn, whose message the logging makes)."""
    refused_prompts: tuple[tuple[str, str], ...] = ()
    """The refused prompt each denial of a call of an earlier turn answers (tool call id,
    request id), as the builder read them: the store refuses a denial answering a prompt
    whose answer released the call first (`AgentMessageLogger.log_messages`)."""
    answered_calls: tuple[tuple[str, str], ...] = ()
    """The calls of earlier turns the turn answers (a result or a denial), each by its tool
    call id and the message that made it, as the builder read them (its `pending`): the store
    refuses the turn when another turn answered one of them first
    (`AgentMessageLogger.log_messages(..., answers_to=...)`), a call's first answer being its
    answer."""
    delivered_seqs: tuple[int, ...] = ()
    """Messages a person steered into the running turn (`SteeringInbox`), already stored,
    that the model was fed during the stream: the turn's messages go around them."""


@dataclass
class _Block:
    """One assistant message and the results of its calls."""

    created_at: datetime
    text: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    results: dict[str, ToolMessage] = field(default_factory=dict)
    message: AssistantMessage | None = None
    """A finished message (HITL prompt, error) instead of text and calls."""


_Held = str | int
"""A call a confirmation holds back: one of this turn by its id, one of an earlier turn by its
index among the pending calls the assembler was given."""


class TurnAssembler:
    """Collects a turn's events in arrival order; `finish` gives the messages in replay order.

    `pending` are the calls earlier turns left open (`ConversationStore.pending_calls`):
    a result or a refused confirmation may answer them in this turn. A call of this turn
    may repeat the id of a pending one (a provider numbering its calls per response): a
    result of that id then answers this turn's call, as the store pairs it.
    """

    def __init__(
        self, *, received_at: datetime | None = None, pending: Sequence[PendingCall] = ()
    ) -> None:
        self._now = received_at or utc_now()
        self._blocks: list[_Block] = []
        self._open: _Block | None = None
        self._block_of_call: dict[str, _Block] = {}
        self._earlier = list(pending)
        self._latest_earlier = {call.tool_call_id: i for i, call in enumerate(pending)}
        """The pending call an id names: the latest of that id, as the store pairs answers."""
        self._earlier_answers: dict[int, ToolMessage] = {}
        self._denied: set[_Held] = set()
        self._refused: dict[str, str] = {}
        """The refused prompt each call of an earlier turn denied was held by."""
        self._resolved: dict[str, tuple[tuple[str, str | None], ...]] = {}
        """Each request answered, with the calls it held then: (tool call id, message id, or
        None for a call of this turn)."""
        self._delivered: list[int] = []
        self._held_by: dict[str, list[_Held]] = {}
        """The calls each confirmation request holds back, of this turn or an earlier one."""
        self._released: list[_Held] = []
        """Calls an approval in this stream released, whose request was asked again since about
        other calls: they await their results, held by no prompt."""
        self._asked_again: set[str] = set()
        """Requests answered in this stream, then asked again: the next answer is a new one."""
        self._asking: dict[int, _Block] = {}
        """The last prompt of this turn naming each call of an earlier turn (its block)."""
        self._denied_after: dict[int, _Block] = {}
        """Calls of earlier turns denied by the refusal of a prompt of this turn: each denial
        follows that prompt, which it answers."""
        self._asked_before_start: dict[str, list[AssistantMessage]] = {}
        """Prompts naming a call not started yet: placed right after it once it starts."""
        for index, call in enumerate(pending):
            if call.request_id is not None:
                self._held_by.setdefault(call.request_id, []).append(index)

    def text(self, delta: str, at: datetime | None = None) -> None:
        """A piece of the assistant's text."""
        self._accepting(at).text.append(delta)

    def call(
        self, tool_call_id: str, tool_name: str, args: Any, at: datetime | None = None
    ) -> None:
        """The model called a tool."""
        if tool_call_id in self._block_of_call:
            raise InvalidInput(f"invalid stream: tool call id {shown(tool_call_id)} is used twice")
        block = self._accepting(at)
        block.calls.append(
            ToolCall(id=tool_call_id, function=FunctionCall(name=tool_name, arguments=args))
        )
        self._block_of_call[tool_call_id] = block
        for prompt in self._asked_before_start.pop(tool_call_id, ()):
            self._finished_message(prompt)  # as if asked right after the call started

    def result(
        self,
        tool_call_id: str,
        content: Any,
        at: datetime | None = None,
        *,
        outcome: ToolOutcome | None = None,
    ) -> None:
        """A tool returned (or failed, with `outcome`); placed after the message that called it.

        The result of a call an earlier turn left pending opens the turn.
        """
        block = self._block_of_call.get(tool_call_id)
        earlier = self._latest_earlier.get(tool_call_id)
        if block is None and earlier is None:
            raise _answers_no_open_call(tool_call_id)
        answer = ToolMessage(
            tool_call_id=tool_call_id,
            content=content if isinstance(content, str) else _json(content),
            error=outcome_error(outcome) if outcome else None,
            created_at=at or self._now,
        )
        if block is not None:
            if tool_call_id in block.results:
                raise _two_results(tool_call_id)
            block.results[tool_call_id] = answer
        elif earlier is not None:
            if earlier in self._earlier_answers:
                raise _two_results(tool_call_id)
            self._earlier_answers[earlier] = answer
        if block is not None and block is self._open:
            self._open = None  # what the model says next, it says after seeing the result

    def hitl(self, prompt: HitlEvent | ConfirmRequired) -> None:
        """A HITL prompt; it may name the tool call it holds back, which then stays pending.

        The prompt is stored naming that call (`HitlAction.tool_call_ids`): it holds it,
        of this turn or an earlier one, until a later prompt names it, which then holds
        it instead. A prompt naming a call of this turn not started yet (a runtime asking
        before it runs the tool) is placed right after that call's message when the call
        starts, as if asked then, or at the end of the turn if it never does (it then
        names the latest pending call of that id, if any). One naming a call started
        already, or a pending call of an earlier turn, is placed where it arrives.
        """
        call_id = prompt.tool_call_id
        action = HitlAction(
            action=prompt.action,
            params=prompt.params,
            request_id=prompt.request_id,
            tool_call_ids=None if call_id is None else [call_id],
        )
        message = AssistantMessage(
            content=prompt.prompt, hitl_action=action, created_at=prompt.at or self._now
        )
        if prompt.request_id in self._resolved:  # asked again: a new question
            self._asked_again.add(prompt.request_id)
            self._released += self._held_by.pop(prompt.request_id, [])
        if call_id is None:
            self._finished_message(message)
            return
        held = self._named(call_id)
        for holds in [*self._held_by.values(), self._released]:
            if held in holds:  # a later prompt naming a call holds it instead
                holds.remove(held)
        self._held_by.setdefault(prompt.request_id, []).append(held)
        if held == call_id and call_id not in self._block_of_call:
            self._asked_before_start.setdefault(call_id, []).append(message)
        else:
            self._finished_message(message)
            if isinstance(held, int):
                self._asking[held] = self._blocks[-1]

    def _named(self, call_id: str) -> _Held:
        """The call an id names now: this turn's, once started; else the latest pending call
        of that id; else a call of this turn not started yet."""
        if call_id in self._block_of_call:
            return call_id
        return self._latest_earlier.get(call_id, call_id)

    def resolve(self, request_id: str, *, approved: bool) -> None:
        """A person answered a confirmation request of this turn or an earlier one.

        A refusal answers the calls the request held back as denied, unless
        their result arrived anyway; an approval leaves them awaiting their result.
        The first answer to a request is its answer: a later one in the stream changes
        nothing, as one in a later turn does not (a resolved prompt holds no call back:
        `PendingCall.request_id`), unless the request was asked again since (a new
        question). A refusal of a prompt of this turn naming a call of an earlier turn (a
        second question about it) is answered by a denial placed after that prompt.
        """
        if request_id in self._resolved and request_id not in self._asked_again:
            return
        self._asked_again.discard(request_id)
        held = self._held_by.get(request_id, ())
        calls = tuple(
            (h, None)
            if isinstance(h, str)
            else (self._earlier[h].tool_call_id, self._earlier[h].message_id)
            for h in held
        )
        self._resolved[request_id] = tuple(
            dict.fromkeys(self._resolved.get(request_id, ()) + calls)
        )
        if not approved:
            self._denied.update(held)
            for h in held:
                if not isinstance(h, str):
                    self._refused[self._earlier[h].tool_call_id] = request_id
                    if h in self._asking:
                        self._denied_after[h] = self._asking[h]

    def delivered(self, seq: int) -> None:
        """The model was fed a message steered into the turn (stored already, at `seq`):
        what it says next it says after seeing it, in a new assistant message."""
        self._open = None
        self._delivered.append(seq)

    def error(self, message: str, at: datetime | None = None) -> None:
        """The run failed: an assistant message carrying the error."""
        self._finished_message(
            AssistantMessage(error=MessageError(message=message), created_at=at or self._now)
        )

    def finish(
        self,
        *,
        complete: bool,
        usage: TokenUsage | None = None,
        latency_ms: int | None = None,
    ) -> StreamedTurn:
        """The turn's messages; `complete` is False for a stream cut off before its end.

        A call without a result is answered as denied when its confirmation
        was refused, left open (pending) while a confirmation holds it back,
        and otherwise answered by an `interrupted` stand-in.
        """
        messages: list[AgentMessage] = self._earlier_answered()
        for block in self._blocks:
            if block.message is not None:
                messages.append(block.message)
                messages += self._denials_after(block)
                continue
            messages.append(
                AssistantMessage(
                    content="".join(block.text) if block.text or not block.calls else None,
                    tool_calls=block.calls or None,
                    created_at=block.created_at,
                )
            )
            messages += [a for c in block.calls if (a := self._answer(block, c.id)) is not None]
        messages += [p for asked in self._asked_before_start.values() for p in asked]
        if not complete:
            messages.append(interruption_notice(self._now))
        if usage is not None or latency_ms is not None:
            said = [i for i, m in enumerate(messages) if m.role == "assistant"]
            if not said:
                raise InvalidInput(
                    "invalid stream: usage and latency_ms go on the turn's last assistant "
                    "message, and this turn has no assistant message (it only answers earlier "
                    "calls or prompts): send it without them"
                )
            last = said[-1]
            messages[last] = messages[last].model_copy(
                update={"token_usage": usage, "latency_ms": latency_ms}
            )
        return StreamedTurn(
            messages=tuple(messages),
            interrupted=not complete,
            resolved_request_ids=tuple(r for r in self._resolved if not self._after_answer(r)),
            resolved_calls=tuple((r, calls) for r, calls in self._resolved.items() if calls),
            refused_prompts=tuple(
                (call_id, request_id)
                for call_id, request_id in self._refused.items()
                if self._latest_earlier[call_id] not in self._earlier_answers
            ),  # a call whose result came anyway is not denied
            answered_calls=tuple(
                (call.tool_call_id, call.message_id)
                for index, call in enumerate(self._earlier)
                if index in self._earlier_answers or index in self._denied
            ),
            delivered_seqs=tuple(dict.fromkeys(self._delivered)),
        )

    def _after_answer(self, request_id: str) -> bool:
        """Whether the last answer to `request_id` in the stream held no call and the stream
        asked the request again after it: once the turn is logged, the pending prompt of the
        id is that later question, which holds its calls until it is answered itself, so no
        answer is recorded (one holding calls names them: it answers only a prompt holding
        one, `resolved_calls`)."""
        return request_id in self._asked_again and not self._resolved[request_id]

    def _answer(self, block: _Block, call_id: str) -> ToolMessage | None:
        if call_id in block.results:
            return block.results[call_id]
        if call_id in self._denied:
            return stand_in_result(call_id, block.created_at, "denied")
        if call_id in self._released or any(call_id in h for h in self._held_by.values()):
            return None  # awaits its confirmation, or its result once confirmed: pending
        return stand_in_result(call_id, block.created_at, "interrupted")

    def _earlier_answered(self) -> list[AgentMessage]:
        """Answers to calls of earlier turns, in the order those calls were made.

        The store gives an answer to the latest pending call of its id, or to the turn's
        own call of that id: a refusal of an older call of an id repeated since, which the
        store would pair with the wrong call, is refused.
        """
        answers: list[AgentMessage] = []
        for index, call in enumerate(self._earlier):
            if index in self._earlier_answers:
                self._check_pairing(index, call.tool_call_id, "result")
                answers.append(self._earlier_answers[index])
            elif index in self._denied and index not in self._denied_after:
                answers.append(self._earlier_denial(index))
        return answers

    def _denials_after(self, block: _Block) -> list[AgentMessage]:
        """The denials answering the prompt of `block` (a second question of this turn about
        calls of earlier turns, refused), in the order those calls were made; none for a
        call whose result came anyway."""
        return [
            self._earlier_denial(index)
            for index, after in sorted(self._denied_after.items())
            if after is block and index not in self._earlier_answers
        ]

    def _earlier_denial(self, index: int) -> ToolMessage:
        call_id = self._earlier[index].tool_call_id
        self._check_pairing(index, call_id, "refusal")
        return stand_in_result(call_id, self._now, "denied")

    def _check_pairing(self, index: int, call_id: str, answer: str) -> None:
        """Refuse an answer to the earlier call `index` that the store would pair with another
        call: the latest pending call of its id, or this turn's own call of that id."""
        if self._latest_earlier[call_id] != index:
            clash = f"a later call {shown(call_id)} is pending too"
        elif call_id in self._block_of_call:
            clash = f"this turn calls {shown(call_id)} too"
        else:
            return
        raise InvalidInput(
            f"invalid stream: a {answer} answers tool call {shown(call_id)} of an earlier "
            f"turn, but {clash}, and the store gives an answer to the latest call of its id: "
            f"it would answer that call instead. Answer the later call {shown(call_id)} in "
            "a turn of its own first, then log this one (calls whose ids are unique within "
            "the conversation never meet this)"
        )

    def _accepting(self, at: datetime | None) -> _Block:
        if self._open is None:
            self._open = _Block(created_at=at or self._now)
            self._blocks.append(self._open)
        return self._open

    def _finished_message(self, message: AssistantMessage) -> None:
        self._open = None
        self._blocks.append(_Block(created_at=message.created_at, message=message))


def _answers_no_open_call(tool_call_id: str) -> InvalidInput:
    """The refusal of a result answering no call of the turn nor a call still pending from an
    earlier one (the `pending` the builder was given): the call, if an earlier turn made it,
    is no longer pending, answered already."""
    return InvalidInput(
        f"invalid stream: a tool result answers {shown(tool_call_id)}, which is no call of "
        "this turn and no longer pending from an earlier one (pending_calls): such a call was "
        "answered already, by its result, a denial, or, for a stream cut off before its "
        "result, the stand-in marking it interrupted (or was never made). Leave the result "
        "out of the stream; a late result of a call marked interrupted is logged as a tool "
        "message in a turn of its own (log_messages), and wins over the stand-in in every "
        "replay"
    )


def _two_results(tool_call_id: str) -> InvalidInput:
    return InvalidInput(f"invalid stream: tool call {shown(tool_call_id)} has two results")


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def turn_from_sse(
    events: Iterable[Any],
    *,
    received_at: datetime | None = None,
    pending: Sequence[PendingCall] = (),
) -> StreamedTurn:
    """The turn of a runtime SSE stream; it is complete when a `done` event arrived.

    Events are models or dicts with `type` (see `parse_sse_text` for a raw
    body; a body it read as cut off makes the turn interrupted, `done` or
    not). An event whose `id` was read before is a replay and is skipped.
    Usage and latency are the first `done`'s; a later `done` fills in only
    what the first did not say. `pending` are the calls earlier turns left
    open (`ConversationStore.pending_calls`), which this stream may answer.
    """
    cut_off = isinstance(events, SseEvents) and events.cut_off
    parsed = _first_of_each_id(parse_sse_events(list(events)))
    with _made_from("SSE stream"):
        assembler = TurnAssembler(received_at=received_at, pending=pending)
        done: list[DoneEvent] = []
        for event in parsed:
            if isinstance(event, TextDelta):
                assembler.text(event.delta, event.at)
            elif isinstance(event, ToolCallEvent):
                assembler.call(event.tool_call_id, event.tool_name, event.args, event.at)
            elif isinstance(event, ToolResultEvent):
                outcome: ToolOutcome | None = "failed" if event.is_error else None
                assembler.result(event.tool_call_id, event.result, event.at, outcome=outcome)
            elif isinstance(event, HitlEvent):
                assembler.hitl(event)
            elif isinstance(event, ErrorEvent):
                assembler.error(event.message, event.at)
            elif isinstance(event, DeliveredEvent):
                assembler.delivered(event.seq)
            else:
                done.append(event)
        return assembler.finish(
            complete=bool(done) and not cut_off,
            usage=next((d.usage for d in done if d.usage is not None), None),
            latency_ms=next((d.latency_ms for d in done if d.latency_ms is not None), None),
        )


@contextlib.contextmanager
def _made_from(subject: str) -> Iterator[None]:
    """The builders' boundary: a message the stream's events make that no stored message can
    be (an assistant message calling more tools than a message takes) is InvalidInput saying
    what, as a bad event is (`parse_sse_events`, `parse_metadata_events`), never a raw
    validation error."""
    try:
        yield
    except ValidationError as exc:
        made = f"{subject}: a message its events make"
        raise InvalidInput(describe_validation_error(exc, subject=made)) from exc


def _first_of_each_id(events: list[SseEvent]) -> list[SseEvent]:
    """The events less those a server sent again after a reconnect: an event whose id was
    read before, equal to the event read under it. A stream that gives one id to events of
    other content (a message's id on each of its events: `id:` only sets the reconnect
    cursor) has ids that name no single event: every event of it is read."""
    first: dict[str, SseEvent] = {}
    for event in events:
        if event.id and first.setdefault(event.id, event) != event:
            return events
    return [e for e in events if not e.id or first[e.id] is e]


def turn_from_metadata(
    events: Iterable[Any],
    *,
    complete: bool,
    received_at: datetime | None = None,
    usage: TokenUsage | None = None,
    latency_ms: int | None = None,
    pending: Sequence[PendingCall] = (),
) -> StreamedTurn:
    """The turn of a streaming-metadata stream.

    The protocol has no end event, so the caller says whether the stream
    closed normally (`complete`). `pending` are the calls earlier turns left
    open (`ConversationStore.pending_calls`), which this stream may answer or
    deny. A `tool_start` without `tool_call_id` is given
    `<tool_name>-<digest>-<n>` (the name cut to keep it within `MAX_CALL_ID_CHARS`),
    the digest taken from the stream and
    `received_at`, so generated ids never repeat within a conversation; a
    `tool_end` or `tool_error` without one ends the oldest open call of that
    tool in this turn, else the oldest pending call of that tool.
    """
    received_at = received_at or utc_now()
    parsed = parse_metadata_events(list(events))
    calls = _OpenCalls(pending, stamp=_stream_digest(received_at, parsed))
    with _made_from("metadata stream"):
        assembler = TurnAssembler(received_at=received_at, pending=pending)
        for event in parsed:
            if isinstance(event, StreamToken):
                assembler.text(event.token, event.at)
            elif isinstance(event, ToolStart):
                call_id = calls.started(event.tool_name, event.tool_call_id)
                assembler.call(call_id, event.tool_name, event.args, event.at)
            elif isinstance(event, ToolEnd | ToolError):
                call_id = calls.ended(event.tool_name, event.tool_call_id)
                if isinstance(event, ToolEnd):
                    assembler.result(call_id, event.result, event.at)
                else:
                    assembler.result(call_id, event.error, event.at, outcome="failed")
            elif isinstance(event, ConfirmRequired):
                assembler.hitl(event)
            elif isinstance(event, ConfirmResolved):
                assembler.resolve(event.request_id, approved=event.approved)
            elif isinstance(event, DeliveredEvent):
                assembler.delivered(event.seq)
            else:
                assembler.error(event.message, event.at)
        return assembler.finish(complete=complete, usage=usage, latency_ms=latency_ms)


def _stream_digest(received_at: datetime, events: Sequence[BaseModel]) -> str:
    """Eight hex digits of a stream and the time it was received. InvalidInput for events
    nested too deeply to be written as JSON (which no stored message holds either)."""
    try:
        dumped = json.dumps([e.model_dump(mode="json") for e in events], sort_keys=True)
    except (ValueError, RecursionError) as exc:
        raise InvalidInput(f"metadata stream: an event nests too deeply ({exc})") from exc
    return hashlib.sha256(f"{received_at.isoformat()}\0{dumped}".encode()).hexdigest()[:8]


class _OpenCalls:
    """Which call a metadata tool event means, and the ids of calls that came without one."""

    def __init__(self, pending: Sequence[PendingCall], *, stamp: str) -> None:
        self._stamp = stamp
        self._started = 0
        self._this_turn: dict[str, list[str]] = {}
        self._earlier: dict[str, list[str]] = {}
        for call in pending:
            self._earlier.setdefault(call.tool_name, []).append(call.tool_call_id)

    def started(self, tool_name: str, tool_call_id: str | None) -> str:
        self._started += 1
        suffix = f"-{self._stamp}-{self._started}"
        call_id = tool_call_id or tool_name[: MAX_CALL_ID_CHARS - len(suffix)] + suffix
        self._this_turn.setdefault(tool_name, []).append(call_id)
        return call_id

    def ended(self, tool_name: str, tool_call_id: str | None) -> str:
        for waiting in (self._this_turn.get(tool_name, []), self._earlier.get(tool_name, [])):
            if tool_call_id is None and waiting:
                return waiting.pop(0)
            if tool_call_id in waiting:
                waiting.remove(tool_call_id)
                return tool_call_id
        if tool_call_id is None:
            raise InvalidInput(
                f"invalid stream: {shown(tool_name)} ended but no call of it is open"
            )
        return tool_call_id


async def log_streamed_turn(
    *,
    logger: AgentMessageLogger,
    store: ConversationStore,
    conversation_id: str,
    turn: StreamedTurn,
    turn_id: str,
    prompt: str | AgentMessage | Mapping[str, Any] | None = None,
    user_id: str | None = None,
) -> LoggedTurn:
    """Log a streamed turn (after the user's `prompt`, if given), then record what it resolved.

    Idempotent by `turn_id` like any turn. Hidden runtime context is stripped
    from the prompt by the logger's rules. Each prompt the stream answered is
    resolved (`ConversationStore.resolve_hitl`), pending or not, while it holds a
    pending call (an approval of an earlier turn's prompt whose call's result the stream
    carries before the turn is logged: the result clears the prompt); one resolved before
    keeps its first answer. A rejected turn writes nothing, its answers included: that
    approval is recorded only once the turn passed the logger's checks
    (`AgentMessageLogger.check_turn`) and its `user_id` may write to the conversation. With
    `user_id` the turn is logged by a runtime acting for that user (`strict_owner`): into
    their own conversation, or a new id created as theirs; any other (a service's unowned
    one, another user's, another user's legacy turns) is NotFound, as to the user's token,
    nothing written, its answers included, and every answer is recorded in that user's
    conversation only. The turn stays a runtime's: it logs a turn whose steering inbox it
    opened. A turn that only resolved prompts (an approval whose result comes later) stores
    no message: the answer it gave is the prompt's resolution; naming another user than the
    conversation's owner, it is NotFound, as any turn is. A refusal whose prompt a
    person approved first (another tab: the turn was built from pending calls read
    before) denies nothing: the store refuses the denial (`AnsweredBefore`), and the turn
    is logged without it; a retry of the turn is answered as that logged turn. So does a
    refusal of a call another turn answered first (the store checks the calls the turn
    answers are still pending: `StreamedTurn.answered_calls`), while a result for such a
    call is refused (`AnsweredBefore`), nothing written: a call's first answer is its
    answer, and the runtime learns its tool ran although the call had one. A turn holding
    nothing but such refusals stores no message (`_answering.nothing_logged`).
    """
    messages = _turn_messages(prompt, turn)
    answered = await _approvals_answered(
        logger, store, conversation_id, messages, turn, turn_id, user_id
    )
    try:
        logged = await _logged(logger, conversation_id, messages, turn, turn_id, user_id)
    except AnsweredBefore as refused:
        without = without_denials(messages, refused.tool_call_ids)
        if len(without) == len(messages):
            raise
        try:  # the turn as logged when the approval came first (by this call or a retry)
            logged = await _logged(
                logger, conversation_id, without, turn, turn_id, user_id, settled=True
            )
        except Conflict:
            raise refused from None
    await _resolve_the_rest(store, conversation_id, turn, logged, answered, user_id)
    return logged


async def _resolve_the_rest(
    store: ConversationStore,
    conversation_id: str,
    turn: StreamedTurn,
    logged: LoggedTurn,
    answered: Collection[str],
    user_id: str | None,
) -> None:
    """Resolve each prompt the turn answered that `answered` (resolved before it was
    logged) does not hold, naming the calls it holds where the logged turn made them."""
    held = dict(turn.resolved_calls)
    made = {
        c.id: m.id for m in logged.messages if m.role == "assistant" for c in m.tool_calls or ()
    }
    for request_id in turn.resolved_request_ids:
        if request_id in answered:  # resolved above: again, it would change nothing
            continue
        calls = held.get(request_id)
        concerned = None if calls is None else [(c, m or made.get(c)) for c, m in calls]
        # Resolved before, holding nothing any more, or asked again about other calls: that
        # prompt's first answer stands. Any other refusal (the conversation not migrated yet,
        # being migrated) means nothing is recorded, and reaches the caller.
        with contextlib.suppress(PromptNotPending):
            await store.resolve_hitl(
                conversation_id, request_id, **_naming(concerned), **_answering_for(user_id)
            )


def _turn_messages(
    prompt: str | AgentMessage | Mapping[str, Any] | None, turn: StreamedTurn
) -> list[AgentMessage | Mapping[str, Any]]:
    """The messages `log_streamed_turn` logs: the user's prompt, if given, then the turn's."""
    messages: list[AgentMessage | Mapping[str, Any]] = []
    if isinstance(prompt, str):
        messages.append(UserMessage(content=prompt))
    elif prompt is not None:
        messages.append(prompt)
    return [*messages, *turn.messages]


async def _approvals_answered(
    logger: AgentMessageLogger,
    store: ConversationStore,
    conversation_id: str,
    messages: list[AgentMessage | Mapping[str, Any]],
    turn: StreamedTurn,
    turn_id: str,
    user_id: str | None,
) -> set[str]:
    """Resolve, before the turn is logged, each prompt of an earlier turn the stream approved
    whose call the turn then answers with its result: the answer takes the call out of
    `pending_calls` and clears the prompt, so resolved after it the approval would not be
    recorded (`approved_calls`), and a stale refusal of the prompt (another tab) would deny
    a call whose tool ran. Returns the request ids it resolved.

    A rejected turn writes nothing, so these answers are recorded only for a turn the logger
    takes: what it refuses before writing (`AgentMessageLogger.check_turn`, another owner's
    conversation included) is refused first, and each answer is given for the turn's user
    only (`_answering_for`)."""
    early = _approved_with_results(turn)
    if not early:
        return set()
    await _checked(logger, conversation_id, messages, turn, turn_id, user_id)
    resolved: set[str] = set()
    for request_id, known in early:
        with contextlib.suppress(PromptNotPending):  # resolved before: its first answer stands
            await store.resolve_hitl(
                conversation_id, request_id, **_naming(known), **_answering_for(user_id)
            )
            resolved.add(request_id)
    return resolved


async def _checked(
    logger: AgentMessageLogger,
    conversation_id: str,
    messages: list[AgentMessage | Mapping[str, Any]],
    turn: StreamedTurn,
    turn_id: str,
    user_id: str | None,
) -> None:
    """Raise what the logger refuses the turn with before it writes anything
    (`AgentMessageLogger.check_turn`), as `log_streamed_turn` logs it: a turn whose refusals
    of calls another turn answered first are refused (`AnsweredBefore`) is logged without
    them, so it is that turn that is checked."""

    async def check(checked: Sequence[AgentMessage | Mapping[str, Any]]) -> None:
        await logger.check_turn(
            conversation_id,
            checked,
            user_id=user_id,
            turn_id=turn_id,
            refused_prompts=_calls_named(turn.refused_prompts, checked),
            answers_to=_calls_named(turn.answered_calls, checked),
            strict_owner=user_id is not None,
        )

    try:
        await check(messages)
    except AnsweredBefore as refused:
        without = without_denials(messages, refused.tool_call_ids)
        if len(messages) - len(without) < len(set(refused.tool_call_ids)):
            raise  # an answer other than a denial (a result): the turn is refused
        await check(without)


def _approved_with_results(
    turn: StreamedTurn,
) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """The approvals of earlier turns' prompts whose calls the turn answers with their results
    (`_approvals_answered`): each request id, with the earlier calls it held then."""
    refused = {request_id for _, request_id in turn.refused_prompts}
    results = {
        m.tool_call_id
        for m in turn.messages
        if isinstance(m, ToolMessage) and m.tool_call_id and tool_outcome(m) is None
    }
    early = []
    for request_id, calls in turn.resolved_calls:
        known: list[tuple[str, str | None]] = [(c, m) for c, m in calls if m is not None]
        if request_id not in refused and any(c in results for c, _ in known):
            early.append((request_id, known))
    return early


def _answering_for(user_id: str | None) -> dict[str, Any]:
    """The arguments of `ConversationStore.resolve_hitl` answering for the user a turn names:
    in that user's own conversation only, where the turn may write (`strict_owner`)."""
    return {"user_id": user_id}


def _naming(calls: Sequence[tuple[str, str | None]] | None) -> dict[str, Any]:
    """The arguments of `ConversationStore.resolve_hitl` naming the calls an answer concerns:
    by their ids and the messages that made them, or by their ids alone when a message is
    not known (none when the answer concerns no call the builder read)."""
    if calls is None:
        return {}
    if all(message_id is not None for _, message_id in calls):
        return {"calls": [{"tool_call_id": c, "message_id": m} for c, m in calls]}
    return {"call_ids": [call_id for call_id, _ in calls]}


async def _logged(
    logger: AgentMessageLogger,
    conversation_id: str,
    messages: list[AgentMessage | Mapping[str, Any]],
    turn: StreamedTurn,
    turn_id: str,
    user_id: str | None,
    *,
    settled: bool = False,
) -> LoggedTurn:
    """The turn's messages logged; a turn of resolutions only stores none, nor does one
    `settled` (logged without its stale denials: `without_denials`) that holds nothing else."""
    if messages or not (turn.resolved_request_ids or settled):
        return await logger.log_messages(
            conversation_id,
            messages,
            user_id=user_id,
            turn_id=turn_id,
            refused_prompts=_calls_named(turn.refused_prompts, messages),
            answers_to=_calls_named(turn.answered_calls, messages),
            strict_owner=user_id is not None,
        )
    return nothing_logged(conversation_id, turn_id)


def _calls_named(
    named: Sequence[tuple[str, str]], messages: Sequence[AgentMessage | Mapping[str, Any]]
) -> dict[str, str]:
    """The entries of `named` (`StreamedTurn.refused_prompts`, `answered_calls`) for the calls
    of earlier turns the turn's `messages` answer, as `log_messages` takes them: logged
    without its stale denials (`without_denials`), a turn names the calls it answers then."""
    answered = {m.tool_call_id for m in messages if isinstance(m, ToolMessage)}
    return {call_id: value for call_id, value in named if call_id in answered}
