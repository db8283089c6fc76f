"""The events of the two streaming protocols a turn can be ingested from (docs/STREAMING.md).

- `SseEvent`: the runtime's server-sent events, `event: <type>` and a JSON `data:` line.
- `MetadataEvent`: the other runtime's streaming metadata, one JSON object per event with `type`.

Each is a union discriminated on `type`; unknown types and missing fields are
refused with an error naming them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, TypeAdapter, ValidationError

from agent_store.core import (
    BoundedName,
    HitlParams,
    InvalidInput,
    TokenUsage,
    UtcDatetime,
    describe_validation_error,
)

CallId = Annotated[str, Field(min_length=1, max_length=200)]


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    at: UtcDatetime | None = None
    """When the runtime emitted the event; the builder's clock when absent."""


# -- the runtime's SSE events ---------------------------------------------------------


class _SseEvent(_Event):
    id: Annotated[str, Field(max_length=200)] | None = None
    """The SSE event id (`id:` line): an event whose id was read before is a replay, read once."""


class TextDelta(_SseEvent):
    """A piece of the assistant's text."""

    type: Literal["text_delta"] = "text_delta"
    delta: str


class ToolCallEvent(_SseEvent):
    """The model called a tool."""

    type: Literal["tool_call"] = "tool_call"
    tool_call_id: CallId
    tool_name: BoundedName
    args: dict[str, Any] | str = Field(default_factory=dict)


class ToolResultEvent(_SseEvent):
    """A tool returned; may arrive after `done`."""

    type: Literal["tool_result"] = "tool_result"
    tool_call_id: CallId
    tool_name: str | None = None
    result: Any = None
    is_error: bool = False
    """The tool failed and `result` is its error."""


class HitlEvent(_SseEvent):
    """The assistant asks a person to act before it goes on."""

    type: Literal["hitl"] = "hitl"
    action: BoundedName
    params: HitlParams = Field(default_factory=dict)
    request_id: CallId
    prompt: str | None = None
    tool_call_id: CallId | None = None
    """The tool call the prompt holds back, if any: it stays pending until answered."""


class ErrorEvent(_SseEvent):
    """The run failed; in both protocols."""

    type: Literal["error"] = "error"
    message: str


class DeliveredEvent(_SseEvent):
    """A message a person steered into the running turn was fed to the model; in both
    protocols. The message is stored already (`SteeringInbox.try_deliver`), under `seq`."""

    type: Literal["delivered"] = "delivered"
    seq: NonNegativeInt


class DoneEvent(_SseEvent):
    """The run ended normally. Tool results may still follow."""

    type: Literal["done"] = "done"
    usage: TokenUsage | None = None
    latency_ms: NonNegativeInt | None = None


SseEvent = Annotated[
    TextDelta
    | ToolCallEvent
    | ToolResultEvent
    | HitlEvent
    | ErrorEvent
    | DeliveredEvent
    | DoneEvent,
    Field(discriminator="type"),
]
"""One event of the runtime's SSE stream."""


# -- the other runtime's streaming metadata -------------------------------------------


class StreamToken(_Event):
    """A piece of the assistant's text."""

    type: Literal["stream_token"] = "stream_token"
    token: str


class ToolStart(_Event):
    """A tool call begins. Without an id, it is matched to its end by tool name, in order."""

    type: Literal["tool_start"] = "tool_start"
    tool_name: BoundedName
    tool_call_id: CallId | None = None
    args: dict[str, Any] | str = Field(default_factory=dict)


class ToolEnd(_Event):
    """A tool call returned."""

    type: Literal["tool_end"] = "tool_end"
    tool_name: str = Field(min_length=1)
    tool_call_id: CallId | None = None
    result: Any = None


class ToolError(_Event):
    """A tool call failed."""

    type: Literal["tool_error"] = "tool_error"
    tool_name: str = Field(min_length=1)
    tool_call_id: CallId | None = None
    error: str


class ConfirmRequired(_Event):
    """The runtime needs a person's confirmation, usually of the tool call named."""

    type: Literal["confirm_required"] = "confirm_required"
    request_id: CallId
    action: BoundedName
    params: HitlParams = Field(default_factory=dict)
    prompt: str | None = None
    tool_call_id: CallId | None = None


class ConfirmResolved(_Event):
    """A person answered a confirmation request, of this turn or an earlier one."""

    type: Literal["confirm_resolved"] = "confirm_resolved"
    request_id: CallId
    approved: bool


MetadataEvent = Annotated[
    StreamToken
    | ToolStart
    | ToolEnd
    | ToolError
    | ConfirmRequired
    | ConfirmResolved
    | ErrorEvent
    | DeliveredEvent,
    Field(discriminator="type"),
]
"""One event of the streaming-metadata protocol."""

sse_events_adapter: TypeAdapter[list[SseEvent]] = TypeAdapter(list[SseEvent])
metadata_events_adapter: TypeAdapter[list[MetadataEvent]] = TypeAdapter(list[MetadataEvent])


def parse_sse_events(raw: list[Any]) -> list[SseEvent]:
    """Validate SSE events given as dicts (with `type`) or models."""
    return _validated(sse_events_adapter, raw, "SSE stream")


def parse_metadata_events(raw: list[Any]) -> list[MetadataEvent]:
    """Validate streaming-metadata events given as dicts (with `type`) or models."""
    return _validated(metadata_events_adapter, raw, "metadata stream")


class SseEvents(list[SseEvent]):
    """The events of an SSE body, and whether the body was cut off inside an event."""

    def __init__(self, events: list[SseEvent], *, cut_off: bool = False) -> None:
        super().__init__(events)
        self.cut_off = cut_off
        """The body ended inside an event: that event was not read and the turn is interrupted."""


def parse_sse_text(text: str) -> SseEvents:
    """The events of a recorded SSE body, read as the SSE rules read a stream.

    A block ends at a blank line; a last block with no blank line after it
    was cut off and is not read (`SseEvents.cut_off` says so). A block's
    `event:` name is its type, whatever `type` its data holds; a block
    without one must carry `type` in its data. Its `id:` becomes the event's
    `id`, so that a block sent again after a reconnect is read once. Comments
    (`:`) and `retry:` lines are ignored.
    """
    blocks = text.replace("\r\n", "\n").replace("\r", "\n").split("\n\n")
    unterminated = _fields(blocks.pop())  # what follows the last blank line
    raw = [
        _event_dict(number, fields)
        for number, block in enumerate(blocks, start=1)
        if (fields := _fields(block))
    ]
    return SseEvents(parse_sse_events(raw), cut_off=bool(unterminated))


def _fields(block: str) -> list[tuple[str, str]]:
    """A block's `(field, value)` lines, or none if it holds no `event:` nor `data:`."""
    fields = []
    for line in block.split("\n"):
        if not line or line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        fields.append((field, value[1:] if value.startswith(" ") else value))
    return fields if any(field in ("event", "data") for field, _ in fields) else []


def _event_dict(number: int, fields: list[tuple[str, str]]) -> dict[str, Any]:
    names = [value for field, value in fields if field == "event"]
    ids = [value for field, value in fields if field == "id"]
    data = [value for field, value in fields if field == "data"]
    try:
        payload = json.loads("\n".join(data)) if data else {}
    except ValueError as exc:
        raise InvalidInput(f"invalid SSE stream: event {number} has data that is not JSON") from exc
    if not isinstance(payload, dict):
        raise InvalidInput(f"invalid SSE stream: event {number} has data that is not an object")
    if names:
        payload["type"] = names[-1]  # the event name is the type, whatever the data says
    if ids:  # the `id:` line decides over an `id` in the data; an empty one (it resets
        payload["id"] = ids[-1] or None  # the reconnect cursor) gives the event none
    return payload


def _validated(adapter: TypeAdapter[list[Any]], raw: list[Any], subject: str) -> list[Any]:
    items = [e.model_dump() if isinstance(e, BaseModel) else e for e in raw]
    try:
        return adapter.validate_python(items)
    except ValidationError as exc:
        raise InvalidInput(describe_validation_error(exc, subject=subject)) from exc
