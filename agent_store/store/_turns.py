"""Plan a turn: validate its messages and work out what it changes. Pure, no I/O.

The logger turns a plan into exactly two writes (reserve `seq` on the
conversation, then insert the messages); everything it needs to know is
computed here first, so a rejected turn writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
from bisect import bisect_right
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any

from bson import Int64
from bson.errors import InvalidDocument
from pydantic import BaseModel, TypeAdapter, ValidationError

from agent_store.core import (
    AgentMessage,
    AnsweredPrompt,
    Conflict,
    Identifier,
    InvalidInput,
    PendingCall,
    PendingHitl,
    PendingHitlField,
    TurnRecord,
    Usage,
    bounded_json,
    dbref_path,
    describe_validation_error,
    json_text,
    listed,
    location_text,
    messages_adapter,
    shown,
    stored_number,
    tool_outcome,
    utc_now,
)
from agent_store.store._indexes import LANGGRAPH_TURN
from agent_store.store._text import (
    DEFAULT_MARKERS,
    RuntimeContextMarkers,
    auto_name,
    message_text,
    search_text,
    shorten,
    without_runtime_context,
)
from agent_store.store._truncation import (
    DEFAULT_MAX_MESSAGE_BYTES,
    TRUNCATION_MARK,
    BoundedMessage,
    FullText,
    bound,
    for_epoch,
    kept_whole,
    size_bound,
    text_for_epoch,
    turn_size_bound,
    unscoped_blob_id,
)
from agent_store.store._values import EARLIEST, check_time, storable

_identifier: TypeAdapter[str] = TypeAdapter(Identifier)

MAX_MESSAGES_PER_TURN = 1000
MAX_TURN_TOOL_CALLS = 10_000
"""The tool calls one turn (or one fork) makes at most: its reservation names each of them,
in one command that must stay within MongoDB's 16 MiB whatever their ids and names."""
MAX_TURN_NAMED_CALLS = 1_000
"""The calls of earlier turns one turn's prompts name at most (`HitlAction.tool_call_ids`),
each prompt's counted: its reservation names each, in one command that must stay within
MongoDB's 16 MiB whatever their ids and request ids. Ten prompts naming the most a prompt may
(`MAX_HELD_CALLS`, as many as a conversation lists pending)."""
PENDING_CALLS_KEPT = 100
"""A conversation lists at most this many pending calls; older ones are dropped from the list.

A runtime that never logs its tools' results would otherwise grow the
conversation document with every turn.
"""


@dataclass(frozen=True)
class TurnRules:
    """How turns are stored; the logger's configuration."""

    markers: RuntimeContextMarkers = DEFAULT_MARKERS
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    preview_chars: int = 200
    name_chars: int = 60
    turns_recorded: int = 1_000
    """Turn records kept on a conversation; past them, a new turn costs one more round trip."""
    abandon_after: timedelta = timedelta(minutes=5)
    """A reserved `seq` block still empty after this is passed by tail readers."""
    future_leeway: timedelta = timedelta(days=1)
    """How far ahead of the store's clock a message's `created_at` may be (clock skew)."""
    claim_grace: timedelta = timedelta(seconds=1)
    """How long a claim waits before it moves, once more, the messages of turns reserved
    under the old owner and inserted since; a turn slower than this from its reservation to
    its insert looks its conversation's owner up afterwards instead. Measured by each side
    on its own clock: no two clocks are compared."""
    open_inboxes: int = 32
    """Steering inboxes a conversation keeps open at once; opening one more is a Conflict,
    unless some were opened longer than `inbox_expiry` ago: those are closed to make room."""
    inbox_expiry: timedelta = timedelta(days=1)
    """How long an inbox left open (its runtime died?) keeps its place against
    `open_inboxes`."""
    inbox_deliveries: int = 256
    """Deliveries one open inbox takes; one more is refused to its sender, unstored. With
    `open_inboxes`, they bound what the inboxes add to the conversation document."""


@dataclass(frozen=True)
class KeepPendingHitl:
    """The turn neither raises nor answers a HITL prompt."""


@dataclass(frozen=True)
class TurnPlan:
    """Everything one turn writes, before `seq` values are known."""

    conversation_id: str
    turn_id: str
    sources: tuple[AgentMessage, ...]
    """Each message as validated (and cleaned), before the store sets its fields; a message
    cut to its size bound is its cut copy, fields set."""
    updates: tuple[dict[str, Any], ...]
    """Per message, the fields the store sets on its source (id, conversation, turn, search
    text); empty for a cut copy, which has them."""
    documents: tuple[dict[str, Any], ...]
    """The documents to insert, each dumped once: all but `seq` and `user_id`."""
    turn_starts: int
    """How many turns this call starts: runs of user/system messages."""
    updated_at: datetime
    preview: str | None
    usage: Usage
    pending_hitl: PendingHitl | KeepPendingHitl | None = field(default_factory=KeepPendingHitl)
    """The prompt left pending after the turn; None clears it."""
    auto_name: str | None = None
    """A name from the first user text, used only while the conversation has none."""
    auto_name_from: str | None = None
    """The id of the message `auto_name` is taken from: a pop of it takes the name back."""
    key: int = 0
    """A 64-bit digest of the turn id: how the conversation's turn records name it."""
    digest: int = 0
    """A 64-bit digest of the messages (timestamps aside): a replay must carry the same."""
    full_texts: tuple[FullText, ...] = ()
    """Whole texts of the fields cut to bound the messages, kept before they are inserted."""
    opened_calls: tuple[PendingCall, ...] = ()
    """Calls the turn leaves without an answer: pending until a later turn answers them."""
    answered_calls: tuple[str, ...] = ()
    """Ids of calls of earlier turns that this turn answers: no longer pending."""
    holds_pending: str | None = None
    """The request id of a prompt the turn raises before any call or request of its own (a
    runtime logging its question apart from the run that paused): it holds back the calls
    earlier turns left pending that no prompt holds (`prompt_before_calls`)."""
    answered_after_prompt: tuple[str, ...] = ()
    """Ids of earlier calls the turn answers after its last prompt, when its first is
    `holds_pending`: that prompt is not pending after the turn if it held one
    (`answered_after_prompt`)."""
    named_holds: tuple[tuple[str, str], ...] = ()
    """`(tool_call_id, request_id)`: calls of earlier turns a prompt of the turn names
    (`HitlAction.tool_call_ids`); the latest pending call of each id is held by that prompt
    from then on (`holding_named`)."""
    asked_again: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """`(tool_call_id, prompt message ids)`: every prompt of the turn naming a call of an
    earlier turn, in order, whether the turn then answers the call or not. Each holds the
    call's approval in its turn, as the same prompts logged a turn each do
    (`_reservation._asked_again`): the last holds it (`ApprovedCall.held_by`), the others are
    remembered before it (`held_before`)."""
    answers_named: tuple[tuple[str, str], ...] = ()
    """`(tool_call_id, message id)`: the call of an earlier turn each of its answers answers,
    as `log_messages`'s `answers_to` names it (the message making it); empty when the turn
    was logged without. A replay tells by it which listed call its stored answer pairs with
    (`_logger._answers_listed`)."""

    derived_before: str | None = None
    """The id derived for the turn (no `turn_id` given) before key order stopped counting,
    when it is another (an object's keys were not in order, `_in_key_order`): a turn
    recorded under it by a store of then is this one, logged under that id."""

    def matches(self, digest: int) -> bool:
        """Whether a turn record's digest is this plan's content (in any digest's form: the
        older two computed only when it is not the current one)."""
        return digest == self.digest or digest in _digests_before(self.documents)

    def matches_but_whole_texts(self, digest: int) -> bool:
        """Whether a digest is this plan's content as a turn recorded it before cut fields
        recorded the hash of their whole text (in either digest's form): the same but for
        what lies past the cuts, which only the whole texts kept can tell. False for a turn
        with nothing cut."""
        if not self.full_texts:
            return False
        before = [without_text_hashes(d) for d in self.documents]
        return digest == content_digest(before) or digest in _digests_before(before)

    @cached_property
    def raised_requests(self) -> tuple[str, ...]:
        """The request ids of the prompts the turn raises: each asks anew, whatever an
        earlier prompt of that id was answered (`_reservation.reopened`)."""
        return raised_requests(self.sources)

    @cached_property
    def denied_calls(self) -> tuple[str, ...]:
        """Ids of calls of earlier turns the turn answers with a denial (a tool message marked
        `tool call denied`: a refused confirmation): refused by the reservation when a person
        approved the prompt holding the call first (`_reservation.released_calls`)."""
        return tuple(
            m.tool_call_id
            for m in self.sources
            if m.role == "tool"
            and m.tool_call_id in self.answered_calls
            and (outcome := tool_outcome(m)) is not None
            and outcome[0] == "denied"
        )

    @cached_property
    def refusals_of_own_prompts(self) -> dict[str, str]:
        """The denials of `denied_calls` that answer a prompt of the turn, by call id, with
        that prompt's request id: each follows, in the turn, a prompt naming its call (a
        second question about it, which the person refused; the last naming it before the
        denial). Nobody could answer that prompt before the turn: no approval came first."""
        if not self.denied_calls:
            return {}
        asking: dict[str, str] = {}
        refusals: dict[str, str] = {}
        for message in self.sources:
            if message.hitl_action is not None:
                request_id = message.hitl_action.request_id
                asking.update(dict.fromkeys(message.hitl_action.tool_call_ids or (), request_id))
            elif (
                message.role == "tool"
                and message.tool_call_id in asking
                and message.tool_call_id in self.denied_calls
                and (outcome := tool_outcome(message)) is not None
                and outcome[0] == "denied"
            ):
                refusals[message.tool_call_id] = asking[message.tool_call_id]
        return refusals

    @property
    def concerns_pending(self) -> bool:
        """Whether the turn's reservation changes what the conversation has pending: calls it
        opens or answers, prompts it raises, names or clears."""
        return bool(
            self.opened_calls
            or self.answered_calls
            or self.raised_requests
            or self.named_holds
            or self.asked_again
            or self.holds_pending
            or not isinstance(self.pending_hitl, KeepPendingHitl)
        )

    @property
    def key_before(self) -> int | None:
        """How the conversation's turn records name the turn under `derived_before`; None
        when there is none."""
        return None if self.derived_before is None else turn_key(self.derived_before)

    @property
    def count(self) -> int:
        """How many messages the turn holds: the size of its `seq` block."""
        return len(self.documents)

    @property
    def first_created_at(self) -> datetime:
        """When the turn's first message was made."""
        return self.sources[0].created_at

    def stored(
        self, first_seq: int, owner: str | None, epoch: str | None = None
    ) -> list[AgentMessage]:
        """The messages as stored in the block starting at `first_seq` by the conversation of
        `epoch`: one copy each."""
        stored = {"user_id": owner, "epoch": epoch}
        return [
            source.replacing({**update, "seq": first_seq + index, **stored})
            for index, (source, update) in enumerate(zip(self.sources, self.updates, strict=True))
        ]

    def for_epoch(self, epoch: str | None) -> TurnPlan:
        """The plan as the conversation of `epoch` stores it: its cut messages name files of
        that conversation only (`_truncation.blob_id`), which its whole texts go to. The
        content digest is the same (`unscoped_blob_id`)."""
        if epoch is None or not self.full_texts:
            return self
        sources = tuple(for_epoch(m, epoch) for m in self.sources)
        documents = tuple(
            {**d, "truncated": s.model_dump(by_alias=True)["truncated"]} if kept_whole(s) else d
            for s, d in zip(sources, self.documents, strict=True)
        )
        full_texts = tuple(text_for_epoch(full, epoch) for full in self.full_texts)
        return replace(self, sources=sources, documents=documents, full_texts=full_texts)

    @cached_property
    def messages(self) -> tuple[AgentMessage, ...]:
        """The messages as stored, without `seq` (not known yet) and the owner."""
        return tuple(
            source.replacing(update) if update else source
            for source, update in zip(self.sources, self.updates, strict=True)
        )


def validate_identifier(value: object, what: str) -> str:
    try:
        return _identifier.validate_python(value)
    except ValidationError as exc:
        raise InvalidInput(describe_validation_error(exc, subject=what)) from exc


def _as_mapping(item: object, index: int) -> Mapping[str, Any]:
    if type(item) is dict or isinstance(item, Mapping):  # a dict without an ABC's check
        return item
    if isinstance(item, BaseModel):
        return item.model_dump(by_alias=True)
    raise InvalidInput(
        f"invalid turn: message {index} is a {type(item).__name__}; a message is an object "
        "with a `role`"
    )


def _checked_list(raw: Sequence[AgentMessage | Mapping[str, Any]]) -> None:
    if isinstance(raw, str | bytes | Mapping) or not isinstance(raw, Sequence):
        raise InvalidInput("invalid turn: messages must be a list of messages")
    if not raw:
        raise InvalidInput("invalid turn: a turn needs at least one message")
    if len(raw) > MAX_MESSAGES_PER_TURN:
        raise InvalidInput(
            f"invalid turn: {len(raw)} messages; one turn holds at most {MAX_MESSAGES_PER_TURN}"
        )


def parse_messages(raw: Sequence[AgentMessage | Mapping[str, Any]]) -> list[AgentMessage]:
    """Validate a turn's messages, given as models or as dicts.

    Surrogate pairs split by a JavaScript runtime are joined; a lone surrogate, or
    anything else that is not a message, raises InvalidInput naming where it is.
    """
    _checked_list(raw)
    try:
        items = [
            storable(_as_mapping(item, index), f"message {index}") for index, item in enumerate(raw)
        ]
        return messages_adapter.validate_python(items)
    except ValidationError as exc:
        raise InvalidInput(describe_validation_error(exc, subject="turn")) from exc
    except RecursionError as exc:
        raise InvalidInput("invalid turn: a value nests too deeply") from exc


def _parsed_unwalked(raw: Sequence[AgentMessage | Mapping[str, Any]]) -> list[AgentMessage]:
    """`parse_messages` without its walk of every value, for input that validates as it is.

    Whatever does not (a tuple where JSON is due, a split surrogate pair making a text too
    long) gets the whole parse, walk first, so its refusal is the one the walk gives. A
    caller must still look for surrogates in what validated (`_escapes_surrogates`).
    """
    _checked_list(raw)
    try:
        return messages_adapter.validate_python(
            [_as_mapping(item, index) for index, item in enumerate(raw)]
        )
    except (ValidationError, RecursionError):
        return parse_messages(raw)


def _escapes_surrogates(canonical: str) -> bool:
    """Whether a turn's `_canonical` text may hold a UTF-16 half (to join, or to refuse).

    `repr` writes a half as `\\udXXX`; text that merely spells one out is a false alarm,
    which costs the walk and nothing else.
    """
    return "\\ud" in canonical


def _turn_id_from(conversation_id: str, canonical: str, messages: Sequence[AgentMessage]) -> str:
    times = repr([m.created_at for m in messages])
    text = f"{conversation_id}\0{canonical}\0{times}"
    return "turn-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def _digests_before(documents: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """The digests turn records were written with before `content_digest`: sorted JSON
    (`json_content_digest`), then the models' order with objects' keys in the order given
    (`_canonical_before`). A record may still hold either."""
    return json_content_digest(documents), _digest64(_canonical_before(documents))


def _digest64(text: str) -> int:
    """The first 8 bytes of the text's SHA-256, as a signed 64-bit integer (a BSON long)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big", signed=True)


def turn_key(turn_id: str) -> int:
    """How a conversation's turn records name a turn: a 64-bit digest of its id."""
    return _digest64(turn_id)


DELIVERY_TURN = "delivery-"
"""How the turn id of a steering delivery begins (`_inbox.delivery_turn_id`)."""


class TurnConflict(Conflict):
    """What the conversation holds of a turn (its record, its block, its messages' ids)
    contradicts this attempt of it, named by its turn id: nothing more of it is stored. A
    steering delivery's sender names it by its delivery id, not that turn id: the inbox
    words each such refusal for the delivery (`_inbox.delivery_refusal`)."""


OWN_TURN_DIGITS = 32
"""How many lowercase hex digits of a digest follow the prefix of a turn id the store makes
for itself (`is_own_turn_id`)."""


def is_own_turn_id(turn_id: str | None, prefix: str) -> bool:
    """Whether `turn_id` has the exact shape of a turn id the store makes for itself: `prefix`
    (`DELIVERY_TURN`, `FORK_TURN`, `LANGGRAPH_TURN`) and `OWN_TURN_DIGITS` lowercase hex
    digits of a digest. Only that shape is the store's: a caller's `fork-1` or `lg-run-1` is
    an ordinary turn's id, told apart by no prefix alone."""
    if turn_id is None or not turn_id.startswith(prefix):
        return False
    digest = turn_id.removeprefix(prefix)
    return len(digest) == OWN_TURN_DIGITS and all(c in "0123456789abcdef" for c in digest)


def is_delivery_turn_id(turn_id: str) -> bool:
    """Whether `turn_id` has the form of a steering delivery's turn id: `delivery-` and 32
    lowercase hex digits (`_inbox.delivery_turn_id`). Only a delivery takes such an id, so a
    turn recorded under it is one its inbox listed when it was reserved."""
    return is_own_turn_id(turn_id, DELIVERY_TURN)


RUNTIME_TURNS_KEPT = 100
"""A conversation remembers the newest this many turns a runtime opened an inbox for
(`runtime_turns`): far more than are open at once (`TurnRules.open_inboxes`), and each is
needed only until its runtime logs the turn."""


def inbox_field(turn_id: str) -> str:
    """Where the conversation document keeps the steering inbox of the running turn `turn_id`
    while it is open (`SteeringInbox.open_turn`)."""
    return f"inbox.t{turn_key(turn_id) & 0xFFFFFFFFFFFF:x}"


_DIGEST_EXCLUDES = frozenset(
    {"created_at", "seq", "user_id", "_id", "conversation_id", "turn_id", "search_text", "epoch",
     "copy_owed"}
)  # fmt: skip
"""Fields a replay may differ in (its times), or that follow from the turn id and the rest."""


def _canonical(documents: Sequence[Mapping[str, Any]]) -> str:
    """The content of a turn's documents as one text: their values in the models' order,
    as `repr` writes them (exact for every value a message holds), times and ids aside, and
    the keys of every JSON object a caller gives (`_in_key_order`) sorted, its whole numbers
    without a fraction: JSON objects are equal whatever their key order, and `10.0` is
    `10`."""
    return _canonical_forms(documents)[0]


def _canonical_forms(documents: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """`_canonical`, and the text turns were digested (and their ids derived) from before key
    order and whole numbers' spelling stopped counting, when it differs (some object's keys
    were not in order, or a whole number was spelt as a float); else None: the same text,
    not written twice."""
    kept = [_as_before(d, _DIGEST_EXCLUDES) for d in documents]
    ordered = [_in_key_order(d) for d in kept]
    if all(o is k for o, k in zip(ordered, kept, strict=True)):
        return repr(kept), None
    return repr(ordered), repr(kept)


def _canonical_before(documents: Sequence[Mapping[str, Any]]) -> str:
    """The text turns were digested from before key order stopped counting: `_canonical`
    with each object's keys in the order given (`_canonical_forms`)."""
    current, before = _canonical_forms(documents)
    return current if before is None else before


def _in_key_order(document: dict[str, Any]) -> dict[str, Any]:
    """A digested document with the keys of the JSON objects a caller gives sorted, at any
    depth: a prompt's `params`, a native form's values (those kept as JSON text too), a
    call's arguments spelt as the store writes an object (`_json_text_in_key_order`). The
    models' own fields keep their order. The document itself when every key is in order."""
    changed = {
        field: ordered
        for field, in_order in _FREE_FORM.items()
        if (value := document.get(field)) and (ordered := in_order(value)) is not value
    }
    return {**document, **changed} if changed else document


def _prompt_in_key_order(prompt: Any) -> Any:
    """A dumped prompt with its `params` in key order; the prompt itself when they are."""
    if (
        not isinstance(prompt, Mapping)
        or (ordered := _normal_json(params := prompt.get("params"))) is params
    ):
        return prompt
    return {**prompt, "params": ordered}


def _native_in_key_order(native: Any) -> Any:
    """A dumped native form with its values in key order, those kept as JSON text too; the
    form itself when they are."""
    if not isinstance(native, Mapping) or not isinstance(values := native.get("set"), dict):
        return native
    ordered = _normal_json(values)
    for key in native.get("json_text") or ():
        text = ordered.get(key)
        if isinstance(text, str) and (kept := _json_text_in_key_order(text)) is not text:
            ordered = {**ordered, key: kept}
    return native if ordered is values else {**native, "set": ordered}


def _calls_in_key_order(calls: list[Any]) -> list[Any]:
    """Tool calls with each one's arguments in key order (`_json_text_in_key_order`); the
    list itself when every one's are."""
    ordered = [_call_in_key_order(call) for call in calls]
    return calls if all(o is c for o, c in zip(ordered, calls, strict=True)) else ordered


def _call_in_key_order(call: Any) -> Any:
    """A dumped tool call with its arguments in key order; the call itself when they are."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(text := function.get("arguments"), str):
        return call
    if (ordered := _json_text_in_key_order(text)) is text:
        return call
    return {**call, "function": {**function, "arguments": ordered}}


_FREE_FORM: dict[str, Callable[[Any], Any]] = {
    "hitl_action": _prompt_in_key_order,
    "native": _native_in_key_order,
    "tool_calls": _calls_in_key_order,
}
"""The message fields holding JSON objects a caller gives, and how each is put in key
order (`_in_key_order`)."""


_WIDE = re.compile(r"\d{19}")
"""Nineteen digits in a row: a whole number that may lie past 64 bits (2**63 has 19), which
has other spellings (`_normal_json`)."""


def _json_text_in_key_order(text: str) -> str:
    """A JSON text as the store writes a value (`json_text`: compact, how arguments given as
    an object are kept) with its objects' keys sorted and its whole numbers without a
    fraction (`_normal_json`): the same value whatever order they came in. Any other text
    (not JSON, or spelt otherwise: the caller's own text) as it is, and the text itself when
    it is so already. JSON past the bounds of what the store walks (`bounded_json`: more
    than `MAX_JSON_VALUES` values, counted before it is parsed, or nested deeper than
    `MAX_PARAMS_DEPTH`) is as it is too: a retry must spell it the same way."""
    if "," not in text and "." not in text and "e+" not in text and not _WIDE.search(text):
        return text  # no two keys, no float, no whole number that may be past 64 bits
    try:
        value = bounded_json(text)
        if json_text(value, non_finite=True) != text:
            return text
    except ValueError:
        return text
    ordered = _normal_json(value)
    return text if ordered is value else json_text(ordered, non_finite=True)


def _normal_json(value: Any) -> Any:
    """A JSON value with every object's keys sorted and every whole number written without
    a fraction (`10.0` is `10`: one JSON number, which a JavaScript client cannot spell
    otherwise), an integer past 64 bits that spells a double as that double's exact value
    (`18446744073709552000`, JavaScript's digits of 2**64, is `18446744073709551616`:
    `stored_number`); the value itself when it is so already."""
    if type(value) is float and value.is_integer():
        return int(value)
    if type(value) is int and not -(2**63) <= value < 2**63:
        spelt = stored_number(value)
        return int(spelt) if isinstance(spelt, float) else value
    if isinstance(value, dict):
        items = [(key, _normal_json(item)) for key, item in value.items()]
        keys = [key for key, _ in items]
        if keys == sorted(keys) and all(item is value[key] for key, item in items):
            return value
        return dict(sorted(items, key=lambda pair: pair[0]))
    if isinstance(value, list):
        listed_ = [_normal_json(item) for item in value]
        return value if all(a is b for a, b in zip(listed_, value, strict=True)) else listed_
    return value


def _as_before(document: Mapping[str, Any], excluded: Collection[str]) -> dict[str, Any]:
    """A document's fields as digested, those `excluded` aside: a prompt naming no calls
    without `tool_call_ids`, so a turn recorded before prompts could name them keeps the
    digest it was recorded with; likewise a `truncated` entry without `sha256` (a field not
    kept, or cut before cut fields recorded the hash of their whole text) without it, and
    its file id without the epoch it names (the same turn is the same content in whichever
    conversation under the id stores it, and as recorded before file ids named epochs)."""
    kept = dict(document)  # its fields in their order, the excluded taken out
    for key in excluded:
        kept.pop(key, None)
    hitl = kept.get("hitl_action")
    if hitl is not None and isinstance(hitl, Mapping) and hitl.get("tool_call_ids") is None:
        kept["hitl_action"] = {k: v for k, v in hitl.items() if k != "tool_call_ids"}
    if kept.get("truncated"):
        kept["truncated"] = {
            path: _unscoped(_without(entry, "sha256", only_none=True))
            for path, entry in kept["truncated"].items()
        }
    return kept


def _unscoped(entry: Any) -> Any:
    """A `truncated` entry with its file id as it is without the conversation's epoch."""
    if isinstance(entry, Mapping) and isinstance(blob := entry.get("blob_id"), str):
        return {**entry, "blob_id": unscoped_blob_id(blob)}
    return entry


def _without(entry: Any, key: str, *, only_none: bool = False) -> Any:
    """A `truncated` entry (a dumped `Truncation`, or a bare length) without `key`; with
    `only_none`, only when it is None."""
    if not isinstance(entry, Mapping) or key not in entry:
        return entry
    if only_none and entry[key] is not None:
        return entry
    return {k: v for k, v in entry.items() if k != key}


def without_text_hashes(document: Mapping[str, Any]) -> dict[str, Any]:
    """A message document as it was stored before cut fields recorded the hash of their
    whole text: no `sha256` in its `truncated` entries."""
    truncated = document.get("truncated")
    if not truncated:
        return dict(document)
    return {
        **document,
        "truncated": {path: _without(entry, "sha256") for path, entry in truncated.items()},
    }


def records_text_hashes(document: Mapping[str, Any]) -> bool:
    """Whether every whole text a message document's `truncated` map names by a file has the
    hash of it recorded (true of every message the store cuts now, and of one not cut)."""
    return all(
        entry.get("sha256") is not None
        for entry in (document.get("truncated") or {}).values()
        if isinstance(entry, Mapping) and entry.get("blob_id") is not None
    )


def content_digest(documents: Sequence[Mapping[str, Any]]) -> int:
    """A 64-bit digest of a turn's documents as the models dump them, timestamps, `seq`, the
    owner and the fields that follow from the turn id aside.

    Documents read back must be dumped from their models first (`canonical_documents`), so
    a replay is checked against what is stored whatever order a server keeps fields in.
    """
    return _digest64(_canonical(documents))


def stored_turn_record(documents: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The record the logger keeps of a turn, as stored on its conversation, rebuilt from the
    turn's stored messages (in `seq` order): what a retry of the turn is checked against. The
    messages do not tell who logged it: the record is not a person's (`TurnRecord.by_person`)."""
    first = documents[0]
    return {
        "k": Int64(turn_key(str(first["turn_id"]))),
        "f": Int64(int(first["seq"])),
        "d": Int64(content_digest(canonical_documents(documents))),
        "a": first["created_at"],
        "p": False,
        "g": False,
        "u": False,
    }


def canonical_documents(documents: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Stored documents as the models dump them: what `content_digest` reads."""
    return [m.model_dump(by_alias=True) for m in messages_adapter.validate_python(documents)]


_JSON_EXCLUDES = frozenset({"created_at", "seq", "user_id", "epoch", "copy_owed"})


def json_content_digest(documents: Sequence[Mapping[str, Any]]) -> int:
    """The digest turn records were written with before `content_digest`: sorted JSON of
    every field but the timestamps, `seq` and the owner (and the `epoch` recorded since).
    A record may still hold it."""
    canonical = json.dumps(
        [_as_before(d, _JSON_EXCLUDES) for d in documents],
        sort_keys=True,
        ensure_ascii=False,
        default=str,
    )
    return _digest64(canonical)


def _refuse_store_fields(messages: Sequence[AgentMessage], *, copied: bool) -> None:
    for index, message in enumerate(messages):
        if message.id is not None:
            raise InvalidInput(
                f"invalid turn: message {index} carries `_id` {message.id!r}; message ids are "
                "the store's (derived from the turn): leave `_id` out"
            )
        if message.truncated is not None and not copied:
            raise InvalidInput(
                f"invalid turn: message {index} carries `truncated`; `truncated` is the store's "
                "to set when it cuts a field"
            )


def _check_times(messages: Sequence[AgentMessage], rules: TurnRules) -> None:
    now = utc_now()
    latest = now + rules.future_leeway
    for index, message in enumerate(messages):
        if EARLIEST <= message.created_at <= latest:
            continue  # nearly every time: no place named for an error not raised
        check_time(
            message.created_at,
            f"turn: message {index} created_at",
            leeway=rules.future_leeway,
            now=now,
        )


def _bounded(message: AgentMessage, index: int, rules: TurnRules) -> BoundedMessage:
    try:
        return bound(message, rules.max_message_bytes)
    except (InvalidDocument, OverflowError, ValueError, RecursionError) as exc:
        raise InvalidInput(f"invalid turn: message {index} cannot be stored: {exc}") from exc


def _fits(document: dict[str, Any], rules: TurnRules) -> bool:
    """Whether a cheap bound of the document's size is within the rules' (no encoding)."""
    try:
        return size_bound(document) <= rules.max_message_bytes
    except OverflowError:
        return False  # `bound` names the integer


@dataclass
class _Prepared:
    sources: list[AgentMessage] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    documents: list[dict[str, Any]] = field(default_factory=list)
    full_texts: list[FullText] = field(default_factory=list)
    cut: bool = False
    """Whether a message was cut to its bound (its document changed)."""


def _prepared(
    conversation_id: str,
    turn_id: str,
    messages: Sequence[AgentMessage],
    documents: list[dict[str, Any]],
    canonical: str,
    rules: TurnRules,
) -> _Prepared:
    """The documents as stored (ids, turn, search text, bounded), and the texts cut to bound
    them. `documents` are the messages' dumps, `canonical` their content as one text; the
    documents are completed in place.

    A bound of the whole turn's size, from lengths alone, clears nearly every turn; past it
    each message gets a cheap bound of its own, and an exact size only near the limit.
    """
    out = _Prepared()
    texts = [search_text(m) for m in messages]
    all_fit = turn_size_bound(canonical, texts) <= rules.max_message_bytes
    for index, (message, document) in enumerate(zip(messages, documents, strict=True)):
        update = {
            "id": message_id(conversation_id, turn_id, index),
            "conversation_id": conversation_id,
            "turn_id": turn_id,
            "search_text": texts[index],
        }
        document["_id"] = update["id"]
        document["conversation_id"] = conversation_id
        document["turn_id"] = turn_id
        document["search_text"] = update["search_text"]
        source = message
        # HITL params, plain JSON of any shape, are always walked: an integer BSON cannot
        # hold is refused here, before any write.
        checked = all_fit and message.hitl_action is None
        if not checked and not _fits(document, rules):  # measured exactly, cut if over
            whole = message.model_copy(update=update)
            bounded = _bounded(whole, index, rules)
            if bounded.message is not whole:
                source, update = bounded.message, {}
                document = bounded.message.model_dump(by_alias=True)
                out.full_texts += bounded.full_texts
                out.cut = True
        out.sources.append(source)
        out.updates.append(update)
        out.documents.append(document)
    return out


def message_id(conversation_id: str, turn_id: str, index: int) -> str:
    """The stable id of the `index`-th message of a turn."""
    digest = hashlib.sha256(f"{conversation_id}\0{turn_id}\0{index}".encode()).hexdigest()
    return "msg-" + digest[:32]


def block_ids(plan: TurnPlan, count: int) -> list[str]:
    """The ids of the `count` messages a reservation of the turn counted (its first
    attempt's, whatever content a retry sends: the ids name the turn and the index)."""
    return [message_id(plan.conversation_id, plan.turn_id, i) for i in range(count)]


def _check_tool_pairing(messages: Sequence[AgentMessage]) -> None:
    calls_seen: set[str] = set()
    calls_later = {c.id for m in messages for c in m.tool_calls or ()}
    answered: set[str] = set()
    for index, message in enumerate(messages):
        for call in message.tool_calls or ():
            if call.id in calls_seen:
                raise InvalidInput(f"invalid turn: tool call id {shown(call.id)} is used twice")
            calls_seen.add(call.id)
        if message.role == "tool":
            call_id = message.tool_call_id
            assert call_id is not None
            if call_id in answered:
                raise InvalidInput(
                    f"invalid turn: message {index} answers tool call {shown(call_id)} "
                    "a second time"
                )
            if call_id in calls_later and call_id not in calls_seen:
                raise InvalidInput(
                    f"invalid turn: message {index} answers tool call {shown(call_id)} "
                    "before the assistant message that makes it"
                )
            answered.add(call_id)


def plan_turn(
    conversation_id: str,
    raw_messages: Sequence[AgentMessage | Mapping[str, Any]],
    *,
    turn_id: str | None = None,
    rules: TurnRules = TurnRules(),
    copied: bool = False,
) -> TurnPlan:
    """Validate a turn and compute what it writes. Raises InvalidInput and nothing else.

    `copied` says the messages are copies of stored ones (a fork): their
    `truncated` maps, which only the store sets, are kept.
    """
    conversation_id = validate_identifier(conversation_id, "conversation_id")
    messages, documents, (canonical, before) = _dumped(_parsed_unwalked(raw_messages), rules)
    if _escapes_surrogates(canonical):  # rare: parse again, halves joined or refused
        messages, documents, (canonical, before) = _dumped(parse_messages(raw_messages), rules)
    _check_whole(conversation_id, messages, rules, copied=copied)
    derived_before = None
    if turn_id is not None:
        turn_id = validate_identifier(turn_id, "turn_id")
    else:
        turn_id = _turn_id_from(conversation_id, canonical, messages)
        if before is not None:
            derived_before = _turn_id_from(conversation_id, before, messages)
    prepared = _prepared(conversation_id, turn_id, messages, documents, canonical, rules)
    sources = prepared.sources
    ids = [str(d["_id"]) for d in prepared.documents]
    opened_calls, answered_calls, named_holds = _pending_calls(sources, ids)
    _, asked = _holders(sources)
    named = _auto_named(sources, ids, rules.name_chars)
    if not copied:  # a fork sets its own pending calls and approvals: no name reaches it
        _check_named(asked)
        _check_held_listed(opened_calls)
    return TurnPlan(
        conversation_id=conversation_id,
        turn_id=turn_id,
        sources=tuple(sources),
        updates=tuple(prepared.updates),
        documents=tuple(prepared.documents),
        turn_starts=count_turn_starts(sources),
        updated_at=max(m.created_at for m in sources),
        preview=_preview(sources, rules.preview_chars),
        usage=_usage(sources),
        pending_hitl=_pending_hitl(sources, ids),
        auto_name=named[0] if named else None,
        auto_name_from=named[1] if named else None,
        key=turn_key(turn_id),
        digest=_digest64(_canonical(prepared.documents) if prepared.cut else canonical),
        full_texts=tuple(prepared.full_texts),
        opened_calls=opened_calls,
        answered_calls=answered_calls,
        holds_pending=prompt_before_calls(sources),
        answered_after_prompt=answered_after_prompt(sources),
        named_holds=named_holds,
        asked_again=tuple((c, tuple(ids[i] for i in asking)) for c, asking in asked.items()),
        derived_before=derived_before,
    )


def _auto_named(
    sources: Sequence[AgentMessage], ids: Sequence[str], limit: int
) -> tuple[str, str] | None:
    """The automatic name the turn gives (its first user text, an upload's aside) and the id
    of the message it is taken from; None when no message gives one."""
    for message, message_id in zip(sources, ids, strict=True):
        if message.upload is None and (name := auto_name(message, limit)):
            return name, message_id
    return None


def _dumped(
    parsed: Sequence[AgentMessage], rules: TurnRules
) -> tuple[list[AgentMessage], list[dict[str, Any]], tuple[str, str | None]]:
    """The messages cleaned, the one dump of each, and their content as one text (and as
    it was before key order stopped counting, when it differs: `_canonical_forms`)."""
    messages = [without_runtime_context(m, rules.markers) for m in parsed]
    documents = [m.model_dump(by_alias=True) for m in messages]
    return messages, documents, _canonical_forms(documents)


def _check_whole(
    conversation_id: str, messages: Sequence[AgentMessage], rules: TurnRules, *, copied: bool
) -> None:
    """Checks of the validated turn as a whole; InvalidInput for the first that fails."""
    _refuse_store_fields(messages, copied=copied)
    _check_times(messages, rules)
    for index, message in enumerate(messages):
        if message.conversation_id not in (None, conversation_id):
            raise InvalidInput(
                f"invalid turn: message {index} belongs to conversation "
                f"{message.conversation_id!r}, not {conversation_id!r}"
            )
    if not copied:  # copies of stored messages were checked turn by turn as they were logged
        if (made := tool_calls_made(messages)) > MAX_TURN_TOOL_CALLS:
            raise InvalidInput(
                f"invalid turn: {made:,} tool calls; one turn makes at most "
                f"{MAX_TURN_TOOL_CALLS:,} (log them over several turns)"
            )
        _check_tool_pairing(messages)
        _refuse_dbrefs_in_params(messages)


def _refuse_dbrefs_in_params(messages: Sequence[AgentMessage]) -> None:
    """InvalidInput for a prompt whose params hold an object BSON gives back as a database
    reference (`read_as_dbref`): read back, it would be no JSON. Params are served as they
    are, so no JSON text can keep it (a runtime's `native` form keeps one so). Copies of
    stored messages are not refused: whatever they hold reads back as it was written."""
    for index, message in enumerate(messages):
        if message.hitl_action is None or (where := dbref_path(message.hitl_action.params)) is None:
            continue
        path = location_text(("hitl_action", "params", *where))
        raise InvalidInput(
            f"invalid turn: message {index} {path} is an object holding a text `$ref` and an "
            "`$id`, which MongoDB reads back as a database reference (a DBRef), not as the "
            "object (a JSON Schema may be one): params cannot hold it; send it as text, or "
            "rename one of its keys"
        )


def _check_named(asked: Mapping[str, Sequence[int]]) -> None:
    """InvalidInput for a turn whose prompts name more calls of earlier turns than
    `MAX_TURN_NAMED_CALLS` (`asked`, as `_holders` finds them: each prompt's names counted)."""
    if (named := sum(len(prompts) for prompts in asked.values())) > MAX_TURN_NAMED_CALLS:
        raise InvalidInput(
            f"invalid turn: {named:,} calls of earlier turns named by its prompts; one turn's "
            f"prompts name at most {MAX_TURN_NAMED_CALLS:,} (log them over several turns)"
        )


def held_off_list(
    plan: TurnPlan, calls: Sequence[PendingCall], released: Collection[tuple[str, str]]
) -> list[PendingCall]:
    """The pending calls `calls` (as stored) a prompt holds that the turn would push off the
    bounded list, no answer having released them (`released`: their keys, or their holders
    resolved): what `_reservation.held_calls_kept` refuses, as the conversation stands."""
    _, left = taking_answers(listed_once(calls, plan.opened_calls), plan.answered_calls)
    every = holding_named(held_by(left, plan.holds_pending), plan.named_holds)
    every += plan.opened_calls[-PENDING_CALLS_KEPT:]
    dropped = every[: max(len(every) - PENDING_CALLS_KEPT, 0)]
    return [
        c
        for c in dropped
        if c.request_id is not None and (c.tool_call_id, c.message_id) not in released
    ]


def listed_once(calls: Sequence[PendingCall], opened: Sequence[PendingCall]) -> list[PendingCall]:
    """The pending calls before a turn, `calls`, without an entry of a call the turn leaves
    open, `opened` (the same id, made by the same message): that call is listed once, where
    the turn lists it now, whatever listed it before (an earlier reservation of the turn, its
    insert lost). The reservation's rule (`_reservation._listed_once`)."""
    again = {(c.tool_call_id, c.message_id) for c in opened[-PENDING_CALLS_KEPT:]}
    return [c for c in calls if (c.tool_call_id, c.message_id) not in again]


def _check_held_listed(opened: Sequence[PendingCall]) -> None:
    """InvalidInput for a turn leaving more calls pending than `pending_calls` keeps (the
    newest `PENDING_CALLS_KEPT`) while a prompt holds one of those the list drops: an
    answer to that prompt releases the calls it lists only, so an approval would not reach
    that call (a later denial of it would be stored as its answer)."""
    dropped = [c for c in opened[:-PENDING_CALLS_KEPT] if c.request_id is not None]
    if not dropped:
        return
    by_prompt: dict[str, list[str]] = {}
    for call in dropped:
        by_prompt.setdefault(str(call.request_id), []).append(call.tool_call_id)
    (first, ids), *others = by_prompt.items()
    holds = f"prompt {shown(first)} holds {listed(ids, shown)}"
    if others:
        holds += f" (and {len(others)} more prompts hold calls)"
    raise InvalidInput(
        f"invalid turn: it leaves {len(opened):,} calls pending, and pending_calls keeps the "
        f"newest {PENDING_CALLS_KEPT} (PENDING_CALLS_KEPT), where an answer to a prompt "
        f"releases the calls it holds; {holds}, older than those. Log the calls over several "
        "turns, or name (tool_call_ids) the calls each prompt holds among the newest"
    )


def tool_calls_made(messages: Sequence[AgentMessage]) -> int:
    """How many tool calls the messages make."""
    return sum(len(m.tool_calls or ()) for m in messages)


def count_turn_starts(messages: Sequence[AgentMessage]) -> int:
    """The turns one logged turn's messages count: each user or system message that does
    not follow another one of those (`turn_count` grows by this much)."""
    starts, previous = 0, None
    for message in messages:
        if message.role in ("user", "system") and previous not in ("user", "system"):
            starts += 1
        previous = message.role
    return starts


def _preview(messages: Sequence[AgentMessage], limit: int) -> str | None:
    for message in reversed(messages):
        if message.role in ("user", "assistant") and (text := message_text(message)):
            return shorten(text, limit)
    return None


def _usage(messages: Sequence[AgentMessage]) -> Usage:
    used = [m.token_usage for m in messages if m.token_usage is not None]
    if not used:
        return _NO_USAGE
    return Usage.total((u.input_tokens for u in used), (u.output_tokens for u in used))


_NO_USAGE = Usage()
"""What a turn reporting no token usage uses (a frozen model: one for every such turn)."""


def _pending_hitl(
    messages: Sequence[AgentMessage], ids: Sequence[str]
) -> PendingHitl | KeepPendingHitl | None:
    """The prompt pending after the turn: the last one it raises, unless a later message of
    the turn answers a call that prompt holds back (as a later turn's answer would; one
    naming calls holds those it names), or an upload clears it; `KeepPendingHitl` when the
    turn does neither. An answer is to the turn's own call of its id when the turn made one
    (before it), else to an earlier turn's: only an answer to the very call the prompt
    holds clears it, not one to a call of the same id the turn made after the prompt."""
    if all(m.hitl_action is None and m.upload is None for m in messages):
        return KeepPendingHitl()  # no prompt raised, none cleared: most turns, not walked
    outcome: PendingHitl | KeepPendingHitl | None = KeepPendingHitl()
    made: set[str] = set()  # calls of the turn so far: an answer of such an id is to it
    unheld: set[str] = set()  # calls of the turn not answered yet, held by no prompt
    held: set[tuple[str, bool]] = set()  # those the outcome holds (or names), with whether
    # each is the turn's own call (else an earlier turn's)
    for message, message_id_ in zip(messages, ids, strict=True):
        if message.role == "user" and message.upload is not None:
            outcome = None
        made |= {call.id for call in message.tool_calls or ()}
        unheld |= {call.id for call in message.tool_calls or ()}
        if message.hitl_action is not None:
            outcome = PendingHitl(
                request_id=message.hitl_action.request_id,
                action=message.hitl_action.action,
                params=message.hitl_action.params,
                prompt=message.content,
                message_id=message_id_,
                created_at=message.created_at,
                truncated=prompt_fields_cut(message),
            )
            named = message.hitl_action.tool_call_ids
            if named is None:
                held, unheld = {(c, True) for c in unheld}, set()
            else:
                held, unheld = {(c, c in made) for c in named}, unheld - set(named)
        if message.role == "tool" and message.tool_call_id:
            answered = (message.tool_call_id, message.tool_call_id in made)
            if answered in held and isinstance(outcome, PendingHitl):
                outcome = None
            unheld.discard(message.tool_call_id)
    return outcome


_PROMPT_FIELDS: tuple[tuple[str, PendingHitlField], ...] = (
    ("hitl_action.params", "params"),
    ("content", "prompt"),
)


def prompt_fields_cut(message: AgentMessage) -> list[PendingHitlField] | None:
    """The fields of the prompt a message raises that its bound cut (`PendingHitl.truncated`)."""
    cut = message.truncated or {}
    return [name for path, name in _PROMPT_FIELDS if path in cut] or None


def seems_cut(prompt: PendingHitl) -> bool:
    """Whether a pending prompt may hold fields its message's bound cut: it lists them, or
    (stored before prompts listed them) its params or question have the shape of a cut."""
    params_cut = set(prompt.params) == {"truncated_json"}
    prompt_cut = prompt.prompt is not None and prompt.prompt.endswith(TRUNCATION_MARK)
    return bool(prompt.truncated) or params_cut or prompt_cut


def whole_prompt(prompt: PendingHitl, message: AgentMessage) -> PendingHitl:
    """The prompt with the fields of its message (read back whole, `with_full_texts`): those
    still cut listed in `truncated`."""
    if message.hitl_action is None or message.hitl_action.request_id != prompt.request_id:
        return prompt
    update = {
        "params": message.hitl_action.params,
        "prompt": message.content,
        "truncated": prompt_fields_cut(message),
    }
    return prompt.model_copy(update=update)


def prompt_before_calls(messages: Sequence[AgentMessage]) -> str | None:
    """The request id of the first prompt a turn raises, if nothing before it in the turn
    makes a call or starts a request (a user or system message) and it names no calls:
    the turn then goes on with the run that paused, asking about its calls."""
    for message in messages:
        if message.tool_calls or message.role in ("user", "system"):
            return None
        if message.hitl_action is not None:
            named = message.hitl_action.tool_call_ids is not None
            return None if named else message.hitl_action.request_id
    return None


def answered_after_prompt(messages: Sequence[AgentMessage]) -> tuple[str, ...]:
    """In a turn whose first prompt comes before any call or request of its own
    (`prompt_before_calls`), the ids of earlier turns' calls it answers after its last
    prompt: one the prompt holds clears it, as the same answer in a later turn would. An
    answer before the last prompt does not: a prompt asked after it, of the same request id
    too, is a new question (STREAMING.md), pending as it would be in a turn of its own."""
    if prompt_before_calls(messages) is None:
        return ()
    made = {call.id for m in messages for call in m.tool_calls or ()}
    start = max(i for i, m in enumerate(messages) if m.hitl_action is not None)
    return tuple(
        m.tool_call_id
        for m in messages[start:]
        if m.role == "tool" and m.tool_call_id and m.tool_call_id not in made
    )


def taking_answers(
    calls: Sequence[PendingCall], answered: Collection[str]
) -> tuple[list[PendingCall], list[PendingCall]]:
    """The pending calls a turn's answers take, and those left: an answer takes the latest
    pending call of its id (`answers_to_calls`: the latest call of its id still without an
    answer; an older one of that id, awaiting approval, stays pending)."""
    latest = {c.tool_call_id: i for i, c in enumerate(calls) if c.tool_call_id in answered}
    taken = set(latest.values())
    return (
        [c for i, c in enumerate(calls) if i in taken],
        [c for i, c in enumerate(calls) if i not in taken],
    )


def answers_clear(
    request_id: str,
    calls: Sequence[PendingCall],
    taken: Sequence[PendingCall],
    left: Sequence[PendingCall],
) -> bool:
    """Whether a turn raising no prompt clears the pending prompt `request_id` by its answers
    (`taken` from the pending `calls`, `left` after them): it answers a call the prompt
    holds back; or, the prompt holding none (raised when every pending call was held
    already, as a second question about a paused run: the store cannot tell which call it
    is about), it answers a held call and leaves none held. Held: listed with a prompt
    (`request_id`), a call a person's answer released included, as the document lists it
    (`Folded`)."""
    if any(c.request_id == request_id for c in taken):
        return True
    holds_none = all(c.request_id != request_id for c in calls)
    answers_held = any(c.request_id is not None for c in taken)
    return holds_none and answers_held and all(c.request_id is None for c in left)


def held_by(calls: Sequence[PendingCall], request_id: str | None) -> list[PendingCall]:
    """The pending calls once a prompt raised before any call of its turn holds those no
    prompt holds (`TurnPlan.holds_pending`); as they were without one."""
    if request_id is None:
        return list(calls)
    return [
        c if c.request_id is not None else c.model_copy(update={"request_id": request_id})
        for c in calls
    ]


def holding_named(
    calls: Sequence[PendingCall], named: Sequence[tuple[str, str]]
) -> list[PendingCall]:
    """The pending calls once the prompts naming calls of earlier turns hold them
    (`TurnPlan.named_holds`): the latest pending call of each id named is held by the
    prompt that named it last; the others are as they were."""
    if not named:
        return list(calls)
    holder = dict(named)
    latest = {c.tool_call_id: i for i, c in enumerate(calls) if c.tool_call_id in holder}
    return [
        c.model_copy(update={"request_id": holder[c.tool_call_id]})
        if latest.get(c.tool_call_id) == i
        else c
        for i, c in enumerate(calls)
    ]


def _holders(
    messages: Sequence[AgentMessage],
) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Which prompt holds back each call of the turn (its request id), and the prompts naming
    each call of an earlier turn (their indices among `messages`, in order: the last holds
    it), by call id, as the messages go: a prompt naming calls holds those it names (its
    turn's, made before it; else an earlier turn's), and another naming one later holds it
    instead; a prompt naming none holds its turn's calls before it that no prompt holds."""
    if all(m.hitl_action is None for m in messages):
        return {}, {}  # no prompt: most turns, not walked
    own: dict[str, str] = {}
    earlier: dict[str, list[int]] = {}
    made: list[str] = []
    for index, message in enumerate(messages):
        made += [call.id for call in message.tool_calls or ()]
        action = message.hitl_action
        if action is None:
            continue
        if action.tool_call_ids is None:
            own.update({call_id: action.request_id for call_id in made if call_id not in own})
            continue
        for call_id in dict.fromkeys(action.tool_call_ids):
            if call_id in made:
                own[call_id] = action.request_id
            else:
                earlier.setdefault(call_id, []).append(index)
    return own, earlier


def _pending_calls(
    messages: Sequence[AgentMessage], ids: Sequence[str]
) -> tuple[tuple[PendingCall, ...], tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The calls a turn leaves open, the ids of calls of earlier turns it answers, and the
    calls of earlier turns its prompts name, with the prompt holding each (`_holders`).

    A call with no `tool` message in its turn is pending; the prompt naming it last holds
    it back, else the first prompt naming none its turn raises from there on. A `tool`
    message answers the call of its id its turn made (before it, `_check_tool_pairing`), else
    a call of an earlier turn: taken, whatever prompt names it. A prompt naming an earlier
    turn's call keeps holding it when the turn then makes and answers a call of that id.
    """
    made = {call.id for m in messages for call in m.tool_calls or ()}
    answers = [m.tool_call_id for m in messages if m.role == "tool" and m.tool_call_id]
    if not made and not answers and all(m.hitl_action is None for m in messages):
        return (), (), ()  # nothing made, answered or named: most turns of a chat
    own, earlier = _holders(messages)
    opened = tuple(
        PendingCall(
            tool_call_id=call.id,
            tool_name=call.function.name,
            message_id=ids[index],
            request_id=own.get(call.id),
            created_at=message.created_at,
            seq=message.seq,
        )
        for index, message in enumerate(messages)
        for call in message.tool_calls or ()
        if call.id not in answers
    )
    answered = tuple(i for i in answers if i not in made)
    named = tuple(
        (c, _request_id(messages[asking[-1]])) for c, asking in earlier.items() if c not in answered
    )
    return opened, answered, named


def _request_id(prompt: AgentMessage) -> str:
    """The request id of a prompt (a message with a `hitl_action`)."""
    assert prompt.hitl_action is not None
    return prompt.hitl_action.request_id


FORK_TURN = "fork-"
"""How the turn holding a fork's copies is named (`fork_turn_id`)."""


def copy_mark(source_id: str) -> str:
    """What the turn ids of a thread's copy logged turn by turn (LangGraph's `copy_thread`)
    begin with, after `fork-`: they name the source."""
    return hashlib.sha256(f"copy of\0{source_id}".encode()).hexdigest()[:8]


def copied_from(source_id: str, turn_id: str | None) -> bool:
    """Whether a turn is a chunk of a copy of the conversation `source_id` logged turn by
    turn: `fork-`, its `copy_mark` and 24 hex digits."""
    prefix = FORK_TURN + copy_mark(source_id)
    return turn_id is not None and len(turn_id) == len(prefix) + 24 and turn_id.startswith(prefix)


def is_fork_turn(turn_id: str | None) -> bool:
    """Whether a turn id has the shape of a fork's copies (`fork_turn_id`, a LangGraph
    thread's fork's chunks): `fork-` and 32 hex digits (`is_own_turn_id`), which the HTTP
    service refuses to callers; a caller's `fork-1` is an ordinary turn."""
    return is_own_turn_id(turn_id, FORK_TURN)


def refuse_own_turn_id(turn_id: str) -> None:
    """InvalidInput for a caller's turn id of the exact shape the store gives a fork's copies
    or a LangGraph checkpointer's turn (`is_own_turn_id`): taken for one, its retry with
    other content would be refused instead of given its empty block back, and its last
    message waited for as a checkpoint's. The HTTP service refuses it (a body's `turn_id`,
    an `Idempotency-Key`); the store's own writers log such ids through the library."""
    for prefix, whose in ((FORK_TURN, "a fork's copies"), (LANGGRAPH_TURN, "a LangGraph step")):
        if is_own_turn_id(turn_id, prefix):
            raise InvalidInput(
                f"turn id {turn_id!r} has the shape of the store's own turn ids for {whose} "
                f"({prefix!r} and {OWN_TURN_DIGITS} lowercase hex digits); a turn takes "
                "another id"
            )


def fork_copies_end(messages: Sequence[AgentMessage]) -> int:
    """Where a fork's copies end among its messages: they come first, one turn of a fork's
    id; a pop may have removed some, and a later turn has an id of its own. Its recorded
    turn starts cut these copies only (those past them are stale)."""
    if not messages or not is_fork_turn(messages[0].turn_id):
        return 0
    first = messages[0].turn_id
    return next((i for i, m in enumerate(messages) if m.turn_id != first), len(messages))


NamedCalls = tuple[tuple[str, str | None], ...]
"""The calls an answer named (`AnsweredPrompt.calls`): each call's id and message, the
message None when named by id alone."""
Answer = tuple[str, int, NamedCalls | None]
"""One answer a person gave (`answered_in`): its request id, its reach
(`AnsweredPrompt.below`) and the calls it named (None: it named none)."""

ANSWERED_READ: dict[str, Any] = {"answered_prompts": 1}
"""What a fold reads of a conversation besides its messages (`answered_in`)."""


def answered_in(conversation: Mapping[str, Any] | None) -> list[Answer]:
    """The answers a person gave, each with its request id, how far it reaches and the calls
    it named (`Conversation.answered_prompts`, read with `ANSWERED_READ`): a prompt of the
    id stored below it was answered by it. A request id asked, answered and asked again has
    an answer for each asking answered."""
    entries = (conversation or {}).get("answered_prompts") or ()
    return [
        (a.request_id, a.below, None if a.calls is None else tuple(a.calls))
        for a in map(AnsweredPrompt.model_validate, entries)
    ]


def pending_after(
    messages: Sequence[AgentMessage],
    turn_starts: Collection[int] = (),
    answered: Iterable[Answer] = (),
    *,
    before: tuple[Sequence[PendingCall], PendingHitl | None] = ((), None),
) -> tuple[list[PendingCall], PendingHitl | None]:
    """The calls and the prompt a conversation's stored messages leave pending, turn by turn
    (runs of one `turn_id`, cut also at the `seq`s of `turn_starts`: a fork's), by the rules
    the reservations apply: what a rewrite of its history (a pop, a fork) lists again.

    A prompt resolved by request id leaves no message: without `answered` it is pending
    here. With it (`answered_in`), each answer is given where it came (each of a request
    id asked and answered more than once among them), between the turns
    stored below its reach and those from there on (an answer past the last message, after
    them all), as `resolve_hitl` gave it: the prompt of its id pending then is answered, and
    the calls prompts of that id held then are released, still listed with the prompt that
    held them (`Folded`); a prompt asked again under the id later is a new one. `before` is
    what was pending before the first of them (the calls and the prompt a conversation's
    earlier messages, not given, left)."""
    calls, hitl = before
    state = folded_after(messages, turn_starts, answered, Folded(list(calls), hitl))
    return state.calls, state.hitl


def folded_after(
    messages: Sequence[AgentMessage],
    turn_starts: Collection[int] = (),
    answered: Iterable[Answer] = (),
    start: Folded | None = None,
) -> Folded:
    """The state the fold of `pending_after` ends in: what is pending, the request ids
    answered, and the calls each answer released (`Folded`). Each answer is given at its
    reach, before the turn whose first message is stored there or past it (before the
    first turn too: an answer a pop brought down to `seq` 0 answered none of the prompts
    stored from there on), those reaching past every message after them all; from `start`,
    what was pending before them (nothing when None)."""
    state = Folded() if start is None else start
    answers = sorted(answered, key=lambda answer: answer[1])  # in the order given, by reach
    for turn in turns_of(messages, turn_starts):
        first = turn[0].seq or 0
        given = [a for a in answers if a[1] <= first]
        answers = answers[len(given) :]
        state = state.answered([(r, calls) for r, _, calls in given]).logged(turn)
    return state.answered([(r, calls) for r, _, calls in answers])


def turns_of(
    messages: Sequence[AgentMessage], turn_starts: Collection[int] = ()
) -> list[Sequence[AgentMessage]]:
    """The turns of stored messages, as their reservations logged them: runs of one turn
    (`turn_keys`: of one `turn_id`, cut also at the `seq`s of `turn_starts` among a fork's
    copies, the original's turns)."""
    keys = turn_keys(messages, turn_starts)
    turns: list[Sequence[AgentMessage]] = []
    start = 0
    for end in range(1, len(messages) + 1):
        if end < len(messages) and keys[end] == keys[start]:
            continue
        turns.append(messages[start:end])
        start = end
    return turns


TurnKey = tuple[str | None, int]
"""The turn a stored message belongs to (`turn_keys`)."""


def turn_keys(messages: Sequence[AgentMessage], turn_starts: Collection[int] = ()) -> list[TurnKey]:
    """The turn each of the stored messages (in `seq` order, some left out or not) belongs
    to, the one notion every rule telling turns apart uses (a fork's end, its turn starts,
    the fold): its `turn_id`, and for a fork's copies (`fork_copies_end`), which all have
    the one id of the turn holding them, the turn of the original each copies: how many of
    `turn_starts` (the fork's `forked_from.turn_starts`) are at or below its `seq`. A fork
    of a fork so tells its copies apart as a fork of the original tells the original's
    turns apart."""
    starts = sorted(set(turn_starts))
    copies = fork_copies_end(messages) if starts else 0
    return [
        (m.turn_id, bisect_right(starts, m.seq or 0) if index < copies else 0)
        for index, m in enumerate(messages)
    ]


@dataclass(frozen=True)
class Folded:
    """What is pending as a fold goes, kept as the conversation document keeps it: the pending
    calls, each with the prompt holding it (`request_id`), the pending prompt, and the request
    ids a person answered (`resolved`, as `resolved_hitl`). A person's answer leaves the
    holder of the calls it releases as it is and records the answer beside them, as
    `_reservation.resolution` does: a call it released is held, for the rules of the turns
    after it (a prompt finding none to hold waits on it, `answers_clear`; a prompt raised
    before any call of its turn does not take it, `held_by`), as in the reservation, which
    reads the same stored holders; it is served unheld (`core.awaiting_results`)."""

    calls: list[PendingCall] = field(default_factory=list)
    hitl: PendingHitl | None = None
    resolved: frozenset[str] = frozenset()
    released: tuple[tuple[str, str, str], ...] = ()
    """The calls the answers released, in order: each call's id and message, with the request
    id of the answer (as `_reservation.resolution` records them in `approved_calls`)."""
    in_force: frozenset[tuple[str, str]] = frozenset()
    """The calls (id and message) an answer released that no prompt named since: their
    approval is in force (`approved_calls` entries not held again, `approval_held_again`).
    An answer releases the calls its prompts hold but these, as the reservation does."""
    holds: frozenset[tuple[str, str, str]] = frozenset()
    """Each pending call (id and message) with the request id of every prompt that held it
    so far in the fold."""
    taken_over: frozenset[tuple[str, str, str]] = frozenset()
    """The calls (id and message) an answer named, with its request id, that a prompt of
    another id held as it came, one of its own id having held them before: by the stored
    order that later prompt took them, and the answer released none of them, unless its
    turn landed after the answer (`ApprovedCall.landed_after`, `_fork.approvals_in_fork`)."""

    def logged(self, turn: Sequence[AgentMessage]) -> Folded:
        """The state after one more turn, by the rules its reservation applies: the calls held
        by a prompt a person answered are released for good before the turn asks under that
        request id anew (`released_for_good`), and the id is no longer answered."""
        raised = raised_requests(turn)
        calls = released_for_good(self.calls, raised, self.resolved)
        in_force = self.in_force - asked_again(self.calls, turn, self.in_force)
        calls, hitl = _fold(calls, self.hitl, turn)
        holds = self.holds | {
            (c.tool_call_id, c.message_id, c.request_id) for c in calls if c.request_id is not None
        }
        resolved = self.resolved - set(raised)
        return replace(
            self, calls=calls, hitl=hitl, resolved=resolved, in_force=in_force, holds=holds
        )

    def answered(self, answers: Sequence[tuple[str, NamedCalls | None]]) -> Folded:
        """The state once a person gave `answers` (`resolve_hitl`), in order: each to the
        prompts of its request id, naming calls or not (`answered_one`)."""
        state = self
        for request_id, calls in answers:
            state = state.answered_one(request_id, calls)
        return state

    def answered_one(self, request_id: str, calls: NamedCalls | None) -> Folded:
        """The state once a person answered the prompts `request_id`, as
        `_reservation.resolution` records it: the calls they hold released, only those
        `calls` names when it names some (`AnsweredPrompt.calls`), but those whose approval
        is in force (`in_force`: a call approved, asked about again and approved again is
        released by each answer); the prompt of the id no longer pending; the id answered
        once none of the calls they hold is left that no answer to the id released and no
        prompt asked about again since (an approval held again releases its call no more,
        `_reservation._held_unreleased`). The calls keep their holder."""
        done = {(c, m) for c, m, r in self.released if r == request_id and (c, m) in self.in_force}
        held = [c for c in self.calls if c.request_id == request_id]
        unreleased = [c for c in held if (c.tool_call_id, c.message_id) not in done]
        named = [c for c in unreleased if names_call(calls, c)]
        fresh = [
            (c.tool_call_id, c.message_id)
            for c in held
            if names_call(calls, c) and (c.tool_call_id, c.message_id) not in self.in_force
        ]
        hitl = None if self.hitl is not None and self.hitl.request_id == request_id else self.hitl
        resolved = self.resolved if len(named) < len(unreleased) else self.resolved | {request_id}
        released = (*self.released, *((c, m, request_id) for c, m in fresh))
        taken = {
            (c.tool_call_id, c.message_id, request_id)
            for c in self.calls
            if c.request_id not in (None, request_id) and names_call(calls, c)
        }
        return replace(
            self,
            hitl=hitl,
            resolved=resolved,
            released=released,
            in_force=self.in_force | set(fresh),
            taken_over=self.taken_over | (taken & self.holds),
        )


def asked_again(
    calls: Sequence[PendingCall],
    turn: Sequence[AgentMessage],
    approved: Collection[tuple[str, str]],
) -> set[tuple[str, str]]:
    """Those of the `approved` calls (id and message) a prompt of `turn` names, a call of an
    earlier turn (`TurnPlan.asked_again`): the latest pending call of its id (`calls`, before
    the turn), or one of an id no call of which is pending. The prompt holds it again until
    it is answered itself (`_reservation._asked_again`)."""
    if not approved:
        return set()
    _, earlier = _holders(turn)
    latest = {c.tool_call_id: c.message_id for c in calls}
    return {(c, m) for c, m in approved if c in earlier and latest.get(c, m) == m}


def names_call(calls: NamedCalls | None, call: PendingCall) -> bool:
    """Whether an answer naming `calls` (None: naming none, so every one) concerns `call`: one
    naming its id alone, or its id and its message."""
    return calls is None or any(
        c == call.tool_call_id and m in (None, call.message_id) for c, m in calls
    )


def raised_requests(messages: Sequence[AgentMessage]) -> tuple[str, ...]:
    """The request ids of the prompts `messages` (a turn) raise, once each, in order: each
    asks anew, whatever an earlier prompt of that id was answered (`TurnPlan.raised_requests`)."""
    return tuple(dict.fromkeys(m.hitl_action.request_id for m in messages if m.hitl_action))


def released_for_good(
    calls: Sequence[PendingCall], raised: Collection[str], resolved: Collection[str]
) -> list[PendingCall]:
    """The pending calls before a turn raising prompts of the request ids `raised`: those held
    by one of them a person answered (`resolved`) held by none from then on, their answer
    given before the id asks anew (`_reservation._released`, as an expression)."""
    again = set(raised) & set(resolved)
    if not again:
        return list(calls)
    return [
        c.model_copy(update={"request_id": None}) if c.request_id in again else c for c in calls
    ]


def _fold(
    calls: list[PendingCall], hitl: PendingHitl | None, turn: Sequence[AgentMessage]
) -> tuple[list[PendingCall], PendingHitl | None]:
    """What is pending after one more turn, by the rules its reservation applies."""
    ids = [str(m.id) for m in turn]
    opened, answered, named = _pending_calls(turn, ids)
    calls = listed_once(calls, opened)
    taken, left = taking_answers(calls, answered)
    holds = prompt_before_calls(turn)
    raised = _pending_hitl(turn, ids)
    if not isinstance(raised, KeepPendingHitl):
        hitl = raised
        after = answered_after_prompt(turn)
        held = any(c.request_id is None and c.tool_call_id in after for c in taken)
        if hitl is not None and hitl.request_id == holds and held:
            hitl = None  # it held a call the turn then answers
    elif hitl is not None and answers_clear(hitl.request_id, calls, taken, left):
        hitl = None  # the turn answers what the prompt awaits
    # The newest are kept, turn by turn, as each reservation keeps them.
    return (holding_named(held_by(left, holds), named) + list(opened))[-PENDING_CALLS_KEPT:], hitl


def block_abandoned(
    records: Sequence[TurnRecord], seq: int, *, now: datetime, abandon_after: timedelta
) -> bool:
    """Whether the turn that reserved `seq` is older than `abandon_after`: its block, if
    still empty, will not be written any more.

    A block older than every kept record is at least as old as the oldest one; a
    conversation without records (migrated, never logged to) has no turn in flight.
    """
    if not records:
        return True
    covering = next((r for r in reversed(records) if r.first_seq <= seq), records[0])
    return now - covering.at >= abandon_after


GAPS_READ: dict[str, Any] = {"turns": 1, "popped_seqs": 1}
"""What a conversation lookup reads for its `Gaps`."""
POPPED_SEQS_KEPT = 100
"""A conversation remembers this many `seq`s pops left as gaps (`popped_seqs`, the newest);
an older one is passed as a block is, once its turn is older than `abandon_after`."""
POPPED_MESSAGES_KEPT = 100
"""A conversation remembers this many messages pops removed, with their `seq`
(`popped_messages`, the newest): a tail reader's `after` naming an older one is refused."""


@dataclass(frozen=True)
class Gaps:
    """Why a `seq` below a conversation's `message_count` may hold no message: a turn
    reserved it and has not inserted (yet, or ever), or a pop removed its message while a
    later turn had reserved past it (`popped_seqs`: no turn holds it any more).

    The one rule tail readers, forks and pops apply to a `seq` with no message."""

    records: Sequence[TurnRecord] = ()
    popped: frozenset[int] = frozenset()

    @classmethod
    def of(cls, conversation: Mapping[str, Any] | None) -> Gaps:
        """The gaps of a conversation document (read with at least `GAPS_READ`)."""
        document = conversation or {}
        return cls(
            records=[TurnRecord.model_validate(r) for r in document.get("turns") or ()],
            popped=frozenset(int(s) for s in document.get("popped_seqs") or ()),
        )

    def passed(self, seq: int, *, now: datetime, abandon_after: timedelta) -> bool:
        """Whether a reader passes `seq`, no message being stored at it: a pop removed it, or
        the turn that reserved it is older than `abandon_after` (`block_abandoned`)."""
        return seq in self.popped or block_abandoned(
            self.records, seq, now=now, abandon_after=abandon_after
        )

    def unpassed_from(self, *, now: datetime, abandon_after: timedelta) -> int | None:
        """The lowest `seq` a reader may not pass yet (`passed`) when no message is stored
        there: the first of the blocks reserved less than `abandon_after` ago (every `seq`
        when the oldest kept record is that young, the older blocks no longer recorded).
        None when every block is older."""
        young = [r.first_seq for r in self.records if now - r.at < abandon_after]
        if not young:
            return None
        return 0 if now - self.records[0].at < abandon_after else min(young)

    def turn_end(self, seq: int, message_count: int) -> int:
        """The last `seq` of the block (the turn) that reserved `seq`: the block ends where
        its record says (`TurnRecord.seqs`), and never past where the next turn's begins,
        the newest at `message_count` (a record kept before records said their extent ends
        there, as does one whose block holds `seq` no more). A turn a pop took from is no
        bound (the `seq`s it gave back may be another turn's now, and what it still holds is
        stored), nor is the order records are listed in: the records kept are not
        contiguous, a record between two kept ones may be dropped."""
        later = [r.first_seq for r in self.records if r.first_seq > seq and not r.popped]
        own = [
            r.first_seq + r.seqs
            for r in self.records
            if r.seqs is not None and not r.popped and r.first_seq <= seq < r.first_seq + r.seqs
        ]
        return min([*later, *own, message_count]) - 1

    def held(self, seqs: Iterable[int]) -> list[int]:
        """Those of `seqs` (none stored at) a turn may still hold: all but the gaps no turn
        holds (`popped`: a pop's, a moved or given-up turn's block), never written again."""
        return [s for s in seqs if s not in self.popped]

    def written(
        self, seqs: Iterable[int], *, now: datetime, abandon_after: timedelta
    ) -> int | None:
        """The first of `seqs` (none stored at) a turn is still writing; None if all are passed."""
        return next(
            (s for s in seqs if not self.passed(s, now=now, abandon_after=abandon_after)), None
        )
