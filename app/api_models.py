"""The shapes the HTTP API accepts and returns; `/openapi.json` is built from these models.

Query and body models forbid unknown fields and type every field, so no client
value reaches a database filter other than as a plain, validated scalar.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from agent_store.core import (
    MAX_HELD_CALLS,
    AgentMessage,
    CallId,
    Identifier,
    InvalidInput,
    PendingHitl,
    Whole,
    described_pattern,
    shown,
)
from agent_store.store import (
    HIDDEN_CHARACTERS,
    INVISIBLE_CLASS,
    MAX_MESSAGES_PER_TURN,
    MAX_NAME_CHARS,
    MAX_PAGE_SIZE,
    MAX_SEARCH_QUERY_CHARS,
    ConversationExport,
    SearchHit,
    clean_name,
)

PageSize = Annotated[int, Field(ge=1, le=MAX_PAGE_SIZE)]
# A name holds something besides white space (as `str.split` reads it, which the store uses to
# collapse names) and invisible characters (`INVISIBLE_CLASS`: a name of only those shows
# nothing), and no control or text-direction character (`HIDDEN_CHARACTERS`), spelled out so
# JSON Schema reads it alike.
_WHITE_SPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace())
_PLAIN = f"[^{HIDDEN_CHARACTERS}]*"


def _not_a_name(value: str) -> str:
    """What is wrong with a name the pattern refuses, in the words the store's one rule for
    names (`clean_name`) uses."""
    try:
        clean_name(value)
    except InvalidInput as refusal:
        return refusal.message.removeprefix("invalid name: ")
    return "a name is plain text that shows something besides white space"


Name = Annotated[
    str,
    StringConstraints(
        min_length=1,
        max_length=MAX_NAME_CHARS,
        pattern=described_pattern(
            f"^{_PLAIN}[^{_WHITE_SPACE}{HIDDEN_CHARACTERS}{INVISIBLE_CLASS}]{_PLAIN}$", _not_a_name
        ),
    ),
]

CallIdMap = Annotated[dict[CallId, CallId], Field(max_length=MAX_HELD_CALLS)]
"""Tool call ids to an id the client read with each (a request id, a message id): as many as
a conversation lists pending."""


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


_QUERY_INTEGER = re.compile(r"[0-9]{1,18}|-[1-9][0-9]{0,17}")
"""How a query writes an integer: ASCII digits (`0`-`9`), at most 18 (below 2**63), `-` before
them for a negative one. `int()` reads far more (`+5`, ` 5`, `1_0`, another script's digits),
and pydantic `5.0` too."""


class _Query(_Input):
    """A route's query parameters: every integer among them is written in ASCII digits
    (`_QUERY_INTEGER`), else 422 naming it, as a value out of its range is."""

    @model_validator(mode="before")
    @classmethod
    def _integers_in_digits(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, field in cls.model_fields.items():
            value = data.get(name)
            written = not isinstance(value, str) or _QUERY_INTEGER.fullmatch(value) is not None
            if field.annotation is int and not written:
                raise ValueError(
                    f"{name}: an integer is written in ASCII digits 0-9 (at most 18, '-' "
                    f"before them for a negative one), not {shown(str(value))}"
                )
        return data


class NoQuery(_Query):
    """The route takes no query parameters."""


class NoBody(_Input):
    """The route takes no body."""


class ConversationListQuery(_Query):
    limit: PageSize = 20
    cursor: Annotated[str, StringConstraints(min_length=1, max_length=500)] | None = None
    """The `next_cursor` of the previous page."""


class MessagePageQuery(_Query):
    after: Identifier | None = None
    """A message id: the page starts after it (in `order`)."""
    limit: PageSize = 20
    order: Literal["asc", "desc"] = "asc"


class SearchQuery(_Query):
    q: Annotated[str, StringConstraints(min_length=1, max_length=MAX_SEARCH_QUERY_CHARS)]
    """Words to find (full-text)."""
    user_id: Identifier | None = None
    """Search this user's conversations (a user token implies its own)."""
    conversation_id: Identifier | None = None
    """Search one conversation."""
    limit: PageSize = 20
    cursor: Annotated[str, StringConstraints(min_length=1, max_length=500)] | None = None
    """The `next_cursor` of the previous page of this search."""


class TranscriptQuery(_Query):
    full: bool = False
    """Put back whole every field that was cut to bound its message (kept in GridFS)."""


class ExportQuery(_Query):
    format: Literal["jsonl", "json"] = "jsonl"
    """`jsonl`: one conversation with its messages per line; `json`: one document."""
    full: bool = False
    """Put back whole every field that was cut to bound its message (kept in GridFS)."""


class RenameBody(_Input):
    name: Name


class CallIdentity(_Input):
    """A call an answer concerns, by its identity as `pending_calls` serves it."""

    tool_call_id: CallId
    """The call's id, as `pending_calls` serves it."""
    message_id: Identifier
    """The assistant message that made the call, as `pending_calls` serves it."""


class ResolveHitlBody(_Input):
    request_id: Annotated[str, StringConstraints(min_length=1, max_length=200)]
    """The `request_id` of the pending prompt being answered."""
    call_ids: Annotated[list[CallId], Field(min_length=1, max_length=MAX_HELD_CALLS)] | None = None
    """The calls the answer concerns, by id, as the client read them (`pending_calls`): the
    prompt is resolved only while it holds one of them not released yet, or, holding none,
    is the pending one not asked again since one of them was made, so a retry does not
    answer a later prompt asked under the same request id; and only those calls are
    released, one another prompt of the id holds staying held. At least one: to answer
    whatever the prompt holds, leave it out."""
    calls: Annotated[list[CallIdentity], Field(min_length=1, max_length=MAX_HELD_CALLS)] | None = (
        None
    )
    """The calls the answer concerns, each by its id and the message that made it, as the
    client read them (`pending_calls`): as `call_ids`, and a later call of the same id (a
    provider numbering its calls per response) is told apart. Send one or the other, naming
    at least one call."""

    @model_validator(mode="after")
    def _one_way_of_naming_calls(self) -> ResolveHitlBody:
        if self.call_ids is not None and self.calls is not None:
            raise ValueError(
                "send calls or call_ids, not both: calls names each call by its tool_call_id "
                "and message_id, call_ids by its id only"
            )
        return self


class LogTurnBody(_Input):
    messages: Annotated[list[AgentMessage], Field(min_length=1, max_length=MAX_MESSAGES_PER_TURN)]
    turn_id: Identifier | None = None
    """The runtime's id of the turn: a retried POST with it stores nothing twice."""
    user_id: Identifier | None = None
    """The owner of a new conversation (a user token implies its own)."""
    name: Name | None = None
    """A name the runtime chose; never replaces one a person set."""
    refused_prompts: CallIdMap | None = None
    """For each call the turn denies, the request id of the prompt the denial answers, as the
    client read it: a denial of a call that prompt's answer approved first is refused (409),
    also once a second question holds the call again."""
    answers_to: CallIdMap | None = None
    """For each call of an earlier turn the turn answers (a result or a denial), the message
    that made it (`message_id`), as the client read `pending_calls`: the turn is refused (409)
    when another turn answered that call first, as a call's first answer is its answer, and
    (422) when the message named does not make that call in this conversation."""


class DeliverBody(_Input):
    message: AgentMessage
    """The message a person sends into the running turn: with a user token, of role `user`
    only (422 otherwise); a service token delivers any role."""
    delivery_id: Identifier | None = None
    """The sender's id of this delivery: a retried POST with it stores the message once."""


class InboxQuery(_Query):
    after_seq: Annotated[int, Field(ge=-1, le=2**53 - 1)] = -1
    """Return the messages delivered after this `seq` (-1: all)."""


class CloseInboxBody(_Input):
    last_seen_seq: Annotated[int, Whole, Field(ge=-1, le=2**53 - 1)]
    """The last `seq` the runtime has seen: the inbox closes only if nothing came after it."""


class ForkBody(_Input):
    at_seq: Annotated[int, Whole, Field(ge=0, le=2**53 - 1)]
    """Copy the messages up to this `seq` (moved past a tool call's results)."""
    new_conversation_id: Identifier
    """The id of the new conversation; random (UUIDv4) ids spread a sharded cluster's writes."""


class ClaimBody(_Input):
    from_user_id: Identifier
    to_user_id: Identifier


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    status: Literal["ready"] = "ready"
    database: Literal["reachable"] = "reachable"


class Transcript(BaseModel):
    conversation_id: str
    data: list[AgentMessage]


class PendingHitlState(BaseModel):
    pending: PendingHitl | None


class HitlResolved(BaseModel):
    request_id: str
    resolved: Literal[True] = True


class SearchResults(BaseModel):
    data: list[SearchHit]
    """The best hits first, `limit` at most: fewer when the next would take the page past
    about 4 MiB (`PAGE_BYTES`), one at least."""
    has_more: bool
    """More hits follow this page: pass `next_cursor` as `cursor` to read them."""
    next_cursor: str | None
    """Pass as `cursor` (with the same search) to read the next page; null on the last."""


class InboxOpened(BaseModel):
    conversation_id: str
    turn_id: str
    open: Literal[True] = True


class Delivery(BaseModel):
    delivered: bool
    """True: the message is stored and the runtime will get it. False: the turn's inbox is
    closed, or holds as many deliveries as it takes (256), nothing was stored; start a new
    turn with the message."""


class Delivered(BaseModel):
    data: list[AgentMessage]
    """The messages delivered into the turn after `after_seq`, by `seq`: those that fit in
    about 4 MiB (`PAGE_BYTES`), one at least."""
    has_more: bool
    """More deliveries follow: read on with `after_seq` the last `seq` in `data`."""


class InboxClosing(BaseModel):
    closed: bool
    """True: nothing arrived after `last_seen_seq` and the inbox is closed."""
    data: list[AgentMessage]
    """What arrived after `last_seen_seq` (the inbox stays open): the runtime handles it. A
    page: those that fit in about 4 MiB (`PAGE_BYTES`), one at least."""
    has_more: bool
    """More deliveries follow `data`: the runtime closes again with `last_seen_seq` the last
    `seq` in `data`, and gets the next page (or the inbox closes)."""


class UserExport(BaseModel):
    """Everything stored for one user (the `json` export format)."""

    user_id: str
    conversations: list[ConversationExport]
