"""The stored shapes: one message per document, one conversation per document.

Field names are the wire contract read by other services (see DESIGN §2), so
these models are the single source of truth for documents, API payloads and
the exported JSON Schema.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeInt,
    StringConstraints,
    TypeAdapter,
    model_validator,
)

Role = Literal["system", "user", "assistant", "tool"]
"""Who speaks a message, as in the OpenAI chat format."""


def to_utc_millis(value: datetime) -> datetime:
    """Make a datetime aware UTC at millisecond precision, the precision BSON keeps.

    A naive datetime is taken to be UTC already: that is how MongoDB drivers
    return dates when the client is not timezone-aware.
    """
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    elif value.utcoffset():
        value = value.astimezone(UTC)
    if value.microsecond % 1000:
        value = value.replace(microsecond=value.microsecond // 1000 * 1000)
    if value.tzinfo is not UTC:
        value = value.replace(tzinfo=UTC)
    return value


def utc_now() -> datetime:
    return to_utc_millis(datetime.now(UTC))


UtcDatetime = Annotated[datetime, AfterValidator(to_utc_millis)]
"""A timezone-aware UTC datetime, truncated to milliseconds."""

Identifier = Annotated[
    str, StringConstraints(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:@|-]+$")
]
"""Ids of conversations, users, turns and messages: 1-200 characters, no spaces or `$`."""


def _arguments_as_json_string(value: Any) -> Any:
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return value


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, frozen=True, use_attribute_docstrings=True
    )


class FunctionCall(_Model):
    """The function an assistant asks to call."""

    name: Annotated[str, StringConstraints(min_length=1)]
    """The tool's name."""
    arguments: Annotated[
        str,
        BeforeValidator(
            _arguments_as_json_string, json_schema_input_type=str | dict[str, Any] | list[Any]
        ),
    ] = "{}"
    """The arguments as a JSON string; a dict is accepted and serialized.

    As in the OpenAI format, a string the model produced is kept as it is,
    even when it is not valid JSON, so that a turn is never lost over it.
    """


class ToolCall(_Model):
    """One tool call of an assistant message."""

    id: Annotated[str, StringConstraints(min_length=1, max_length=200)]
    """Unique within the conversation; a `tool` message answers it by this id."""
    type: Literal["function"] = "function"
    function: FunctionCall


class HitlAction(_Model):
    """A human-in-the-loop prompt the assistant raised."""

    action: Annotated[str, StringConstraints(min_length=1)]
    params: dict[str, Any] = Field(default_factory=dict)
    request_id: Annotated[str, StringConstraints(min_length=1, max_length=200)]


class MessageError(_Model):
    """An error the runtime reported instead of an answer."""

    message: str


class FileUpload(_Model):
    """A file the user uploaded with a message."""

    filename: str
    file_type: str
    size: NonNegativeInt
    parsed_text: str | None = None


class TokenUsage(_Model):
    """Tokens one model response used."""

    input_tokens: NonNegativeInt = 0
    output_tokens: NonNegativeInt = 0


class _MessageBase(_Model):
    """Every field of the message interface, on every role.

    Each role's model forbids the fields that make no sense for it, so every
    stored document has the same keys and absent values are `null`.
    """

    forbidden_fields: ClassVar[tuple[str, ...]] = ()

    id: Identifier | None = Field(default=None, alias="_id")
    """Stable message id (extension). Assigned by the logger when not given."""
    conversation_id: Identifier | None = None
    """The conversation this message belongs to. Set by the logger."""
    role: Role
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = None
    hitl_action: HitlAction | None = None
    error: MessageError | None = None
    upload: FileUpload | None = None
    created_at: UtcDatetime = Field(default_factory=utc_now)
    token_usage: TokenUsage | None = None
    latency_ms: NonNegativeInt | None = None
    seq: NonNegativeInt | None = None
    """Position in the conversation (extension). Assigned by the logger."""
    user_id: Identifier | None = None
    """The conversation's owner, denormalized (extension). Set by the logger."""
    turn_id: Identifier | None = None
    """The turn that logged this message (extension). Set by the logger."""
    search_text: str | None = None
    """Text extracted at write time for full-text search (extension)."""
    truncated: dict[str, NonNegativeInt] | None = None
    """Fields cut to keep the document bounded, with their original length (extension)."""

    @model_validator(mode="after")
    def _role_fields(self) -> _MessageBase:
        for field in self.forbidden_fields:
            if getattr(self, field) is not None:
                raise ValueError(f"`{field}` is not allowed on a {self.role} message")
        return self


class SystemMessage(_MessageBase):
    """A system prompt or a system-triggered turn."""

    forbidden_fields = ("tool_calls", "tool_call_id", "hitl_action", "token_usage")
    role: Literal["system"] = "system"


class UserMessage(_MessageBase):
    """What the user typed or uploaded."""

    forbidden_fields = ("tool_calls", "tool_call_id", "hitl_action", "token_usage")
    role: Literal["user"] = "user"

    @model_validator(mode="after")
    def _has_something(self) -> UserMessage:
        if self.content is None and self.upload is None and self.error is None:
            raise ValueError("a user message needs `content` or an `upload`")
        return self


class AssistantMessage(_MessageBase):
    """A model response: text, tool calls, a HITL prompt or an error."""

    forbidden_fields = ("tool_call_id", "upload")
    role: Literal["assistant"] = "assistant"

    @model_validator(mode="after")
    def _calls_are_distinct(self) -> AssistantMessage:
        if self.tool_calls == []:
            raise ValueError("`tool_calls` must be null or hold at least one call")
        ids = [call.id for call in self.tool_calls or ()]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"tool call ids repeat within one message: {repeated}")
        if (
            self.content is None
            and self.tool_calls is None
            and self.hitl_action is None
            and self.error is None
        ):
            raise ValueError(
                "an assistant message needs `content`, `tool_calls`, `hitl_action` or `error`"
            )
        return self


class ToolMessage(_MessageBase):
    """The result of one tool call, answering it by `tool_call_id`."""

    forbidden_fields = ("tool_calls", "hitl_action", "token_usage", "upload")
    role: Literal["tool"] = "tool"

    @model_validator(mode="after")
    def _answers_a_call(self) -> ToolMessage:
        if self.tool_call_id is None:
            raise ValueError("a tool message needs `tool_call_id`, the id of the call it answers")
        return self


AgentMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]
"""Any message, told apart by `role`."""

message_adapter: TypeAdapter[AgentMessage] = TypeAdapter(AgentMessage)
messages_adapter: TypeAdapter[list[AgentMessage]] = TypeAdapter(list[AgentMessage])


class PendingHitl(_Model):
    """The unresolved HITL prompt of a conversation (extension)."""

    request_id: str
    action: str
    params: dict[str, Any] = Field(default_factory=dict)
    prompt: str | None = None
    """The assistant's text that asked the question."""
    message_id: str
    """The assistant message that raised it."""
    created_at: UtcDatetime


class PendingCall(_Model):
    """A tool call left without an answer, awaiting one from a later turn (extension).

    Its turn ended with the call open: it awaits a person's approval or
    confirmation, or a result computed elsewhere. The `tool` message a later
    turn logs for it is its answer, and it is then no longer pending.
    """

    tool_call_id: str
    tool_name: str
    message_id: str
    """The assistant message that made the call."""
    request_id: str | None = None
    """The HITL prompt that holds the call back: the first one its turn raised after it."""
    created_at: UtcDatetime
    """When the call was made."""


class Usage(_Model):
    """Token usage summed over a conversation (extension)."""

    input_tokens: NonNegativeInt = 0
    output_tokens: NonNegativeInt = 0


class TurnRecord(_Model):
    """One logged turn: its id and how many `seq` values it reserved (extension).

    Records are kept in reservation order, so a turn's first `seq` is the
    conversation's `message_count` less the counts of this and every later record.
    """

    turn_id: str
    count: NonNegativeInt


class Conversation(_Model):
    """One conversation document."""

    id: str = Field(alias="_id")
    """Equal to `conversation_id`."""
    conversation_id: str
    user_id: str | None = None
    """The owner; `null` for a conversation nobody owns yet."""
    name: str | None = None
    name_source: Literal["auto", "runtime", "set"] | None = None
    """Who chose `name` (extension): automatic names yield to a runtime's, both to a person's."""
    created_at: UtcDatetime
    updated_at: UtcDatetime
    """The time of the last message."""
    turn_count: NonNegativeInt = 0
    last_message_preview: str = ""
    message_count: NonNegativeInt = 0
    """The next free `seq` (extension)."""
    pending_hitl: PendingHitl | None = None
    pending_calls: list[PendingCall] = Field(default_factory=list)
    """Tool calls awaiting an answer from a later turn, oldest first (extension)."""
    usage: Usage = Field(default_factory=Usage)
    recent_turns: list[TurnRecord] = Field(default_factory=list)
    """The last turns logged, for idempotent retries (extension)."""

    def first_seq_of(self, turn_id: str) -> int | None:
        """The first `seq` a recently logged turn reserved, or None if it is not recent."""
        following = 0
        for record in reversed(self.recent_turns):
            following += record.count
            if record.turn_id == turn_id:
                return self.message_count - following
        return None


T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    """A page of a list, in the OpenAI list shape."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    data: list[T]
    has_more: bool
    first_id: str | None
    last_id: str | None


class MessagePage(Page[AgentMessage]):
    """A page of a conversation's messages."""


class ConversationPage(Page[Conversation]):
    """A page of a user's conversations, newest first."""

    next_cursor: str | None = None
    """Pass as `cursor` to read the next page; null on the last page."""
