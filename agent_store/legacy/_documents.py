"""Legacy turn documents (DESIGN §4) as found, and the coercions every reader of them shares.

Real documents are messy, so `LegacyTurn` accepts almost anything: each
reader decides what a field means through the functions here (the text of a
value, the time of a turn), so the converter and the migration's verify
read the same document the same way.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import bson
from bson import Code, DBRef, Decimal128, ObjectId, Timestamp, json_util
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from agent_store.core import (
    IDENTIFIER_PATTERN,
    MAX_SAFE_INTEGER,
    Conversation,
    InvalidInput,
    describe_validation_error,
    epoch_millis,
    to_utc,
    to_utc_millis,
    utc_now,
)
from agent_store.legacy._text_times import text_time
from agent_store.store import (
    DERIVED_CONVERSATION_PREFIX,
    DERIVED_TURN_PREFIX,
    DERIVED_USER_PREFIX,
    LONE_SURROGATE,
    MAX_NAME_CHARS,
    MIGRATED_TURN_PREFIX,
    TurnRules,
    not_utf8_at,
    shorten,
    shows_nothing,
    validate_identifier,
)

LEGACY_TURNS = "agent_conversations_deprecated"
"""Where the legacy turns live once moved aside (DESIGN §5, step 1)."""
SESSION_HITL = "session_hitl"
"""The legacy collection of pending HITL prompts."""
MIGRATION_STATE = "agent_migrations"
"""The migration's collection: its state document, its runs and its lock."""
MIGRATION_STATE_ID = "state:legacy-turns"
"""The migration's state document. Its `undated_at` is the time a conversation none of whose
turns has a readable time gets: the first run's start, recorded before it converts any."""
CONVERSATION_COUNTERS = ("message_count", "turn_count")
"""The counters the store writes on every conversation document (its stored schema requires
them) and no legacy turn holds (DESIGN §4): in `agent_conversations`, a document holding
neither is a legacy turn, whatever other fields it holds or lacks."""

_KEY = re.compile(r"^[A-Za-z0-9_.:@|-]{1,100}\Z")
"""A document id short enough to appear as it is in the ids derived from it."""
_IDENTIFIER = re.compile(IDENTIFIER_PATTERN.removesuffix("$") + r"(?![\s\S])")
"""What `agent_store.core.Identifier` accepts (not `.` or `..`), ending at the text's end: a
pattern's `$` also matches before a last line break, and so does a server's `\\Z` (PCRE),
while `\\z` is no Python pattern before 3.14; "no character follows" is the end to both, in
Python and in a query (`may_not_be_identifiers`: `"alice\\n"` is no identifier)."""
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
"""Unix time 0: a placeholder in a legacy turn (`taken_time`), and the time a conversation
none of whose turns has a readable time is served with before a run recorded its own
(`LegacyTurns.conversation`): "unknown", the same on every read."""


def id_text(value: Any) -> str | None:
    """How the reader names a legacy id stored as any value: text as it is, an ObjectId or a
    number as `str()` writes it, anything else as its JSON text. BSON JavaScript code is a
    `str` to Python but no text: named as extended JSON names it (`{"$code": …}`, its scope
    too), so it is never the text id it spells; any other `str` subclass is its text."""
    if value is None or type(value) is str:
        return value
    if isinstance(value, Code):
        code = {"$code": str.__str__(value)}
        return as_text(code if value.scope is None else {**code, "$scope": value.scope})
    if isinstance(value, str):
        return str.__str__(value)
    return str(value) if isinstance(value, ObjectId | int | float) else as_text(value)


_BLANK = " \t\n\r\x0b\x0c"
"""What a blank id is made of: no characters but these (the same to Python and a query)."""


def named_id(value: Any) -> str | None:
    """The conversation a `conversation_id` value names, as the reader names it: a number by
    its value (`number_name`: `42`, `42.0`, `Int64(42)` and `Decimal128("42.0")` are "42", as
    the old service's equality query found them all), anything else by `id_text`; None when
    it names none: null, or text that is blank."""
    text = number_name(value) or id_text(value)
    return None if text is None or not text.strip(_BLANK) else text


_WIDEST_NUMBER = 309
"""Digits of the widest whole number a double holds (1.8e308): a wider whole Decimal128 is
no double's value, and is named by its text (`id_text`)."""


def number_name(value: Any) -> str | None:
    """The name of a number of any BSON type by its value, alike for every type holding that
    value (MongoDB's equality matches numbers so): a whole number in decimal digits (`"42"`
    for `42.0` and `Decimal128("4.2E+1")` too, `"0"` for `-0.0`), a fraction as the double of
    that value writes it (`"42.5"` for `Decimal128("42.50")`). None for no number (a bool is
    none), and for one only its own type holds (NaN, an infinity, a Decimal128 fraction no
    double is, `Decimal128("0.1")`, or wider than any double): `id_text` names it."""
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal128):
        return None
    return _value_name(value.to_decimal() if isinstance(value, Decimal128) else Decimal(value))


def _value_name(exact: Decimal) -> str | None:
    """`number_name` of a number of the exact value `exact`."""
    if not exact.is_finite() or exact.adjusted() >= _WIDEST_NUMBER:
        return None
    if exact == exact.to_integral_value():
        return str(int(exact))
    double = float(exact)
    return repr(double) if Decimal(double) == exact else None


def _named_number(text: str) -> Decimal | None:
    """The value of the numbers `number_name` names `text`, if it names any."""
    if len(text) > _WIDEST_NUMBER + 1 or not _NUMBER_NAME.fullmatch(text):
        return None
    try:
        exact = Decimal(text) if _WHOLE.fullmatch(text) else Decimal(float(text))
    except (ValueError, ArithmeticError):
        return None
    return exact if _value_name(exact) == text else None


_WHOLE = re.compile(r"-?[0-9]+")
_NUMBER_NAME = re.compile(r"-?[0-9]+(\.[0-9]+)?(e[+-][0-9]+)?")


def _number_conditions(text: str, by_value: bool) -> list[dict[str, Any]]:
    """The conditions finding the numbers named `text`: `by_value`, every number
    `number_name` names so (`_value_conditions`), else one only its own type holds that
    `id_text` writes so (NaN, an infinity); without, those `id_text` writes so."""
    if by_value and (exact := _named_number(text)) is not None:
        return _value_conditions(exact)
    found = _text_number_conditions(text)
    return [c for c in found if not by_value or named_id(c["$eq"]) == text]


def _value_conditions(exact: Decimal) -> list[dict[str, Any]]:
    """The conditions finding every number of the value `exact`, each by its own BSON type:
    an int, a long, a double and a Decimal128, where the type holds it."""
    conditions: list[dict[str, Any]] = []
    if exact == exact.to_integral_value() and _in_int64(whole := int(exact)):
        conditions += [{"$eq": whole, "$type": kind} for kind in ("int", "long")]
    if Decimal(double := float(exact)) == exact:
        conditions.append({"$eq": double, "$type": "double"})
    with contextlib.suppress(ValueError, ArithmeticError):
        conditions.append({"$eq": Decimal128(exact), "$type": "decimal"})
    return conditions


def scalar_filter(field: str, condition: Mapping[str, Any]) -> dict[str, Any]:
    """The filter of the documents whose `field` itself meets `condition` (query operators:
    `{"$eq": "c-1"}`, `{"$in": [...]}`), never an array holding such a value.

    A query matches an array by its elements, so `{"conversation_id": "c-1"}` also finds the
    turns filed under `["c-1", "other"]`, which the reader names apart (`id_text`: its JSON
    text, a derived id). Every filter naming one conversation by a single value is built by
    this one rule: a read, a delete or a run by `c-1` never reaches another's turns or prompts.
    """
    return {field: {**condition, "$not": {"$type": "array"}}}


def names_none(field: str) -> dict[str, Any]:
    """The filter of the documents whose `field` names no conversation (`named_id` None)."""
    return {
        "$or": [
            scalar_filter(field, {"$eq": None}),
            scalar_filter(field, {"$regex": f"^[{_BLANK}]*$"}),
        ]
    }


_IDENTIFIER_TYPES = ["string", "int", "long", "objectId", "null"]
"""The BSON types whose values may name a conversation by an identifier (`id_text`), or none."""


def not_identifiers(field: str) -> dict[str, Any]:
    """The filter of the documents whose `field` names an id that is no identifier as text
    (`stored_conversation_id` derives one for it): text that is none, or a value of another
    type than text, an integer or an ObjectId (a double such as 1e300, an object, a date), or
    an array, whatever it holds (a query would match it by its elements)."""
    return {
        "$or": [
            texts_not_identifiers(field),
            {field: {"$exists": True, "$not": {"$type": _IDENTIFIER_TYPES}}},
            {field: {"$type": "array"}},
        ]
    }


def texts_not_identifiers(field: str) -> dict[str, Any]:
    """The filter of the documents whose `field` is text that is no identifier: among them
    every text holding bytes that are not valid UTF-8 (no pattern matches such text, on a
    server as in Python, where it holds lone surrogates)."""
    return {"$and": [{field: {"$type": "string"}}, {"$nor": [{field: _IDENTIFIER}]}]}


def may_not_be_identifiers(field: str) -> dict[str, Any]:
    """The filter of the documents whose `field` holds a value that may be no identifier as
    text (`user_named` derives a user for it): any but a missing or null value and
    identifier text, itself (`scalar_filter`): an array is no identifier whatever it holds
    (`["alice"]`, `[null]`), though a query matches one by its elements. A superset of
    `not_identifiers` (blank text too, which names no user), without a `$type` list: every
    backend selects by it; its reader keeps what `user_named` reads as the user."""
    return {
        "$nor": [
            scalar_filter(field, {"$eq": None}),
            scalar_filter(field, {"$regex": _IDENTIFIER.pattern}),
        ]
    }


MAX_REFERENCE_LENGTH = 200
"""The longest tool call id or HITL request id a message holds."""


def reference_text(value: Any) -> str | None:
    """A tool call id or HITL request id as a message holds it: its text (`id_text`), when that
    is 1 to `MAX_REFERENCE_LENGTH` characters; else None."""
    text = id_text(value)
    return text if text and len(text) <= MAX_REFERENCE_LENGTH else None


_INT64_DIGITS = 20
"""Characters of the longest 64-bit integer's text (a sign and 19 digits): longer digit text
is no integer id, nor any time, and is never given to `int` (which refuses over 4,300)."""


def object_id_named(text: str) -> ObjectId | None:
    """The ObjectId whose text (`str`, 24 lower-case hex digits) `text` is, as a reader
    names an id by `str()`; None for any other text, another spelling of the hex included
    (ids are case-sensitive, and a migration names the conversation by that text)."""
    if ObjectId.is_valid(text) and str(object_id := ObjectId(text)) == text:
        return object_id
    return None


def id_filter(field: str, text: str, *, by_value: bool = True) -> dict[str, Any]:
    """The filter of the documents whose `field` the reader names `text` as it names a
    conversation (`named_id`): the text itself, an ObjectId it writes, a number of any BSON
    type of the value it names (`number_name`: "42" finds 42, 42.0 and `Decimal128("42.0")`,
    as the old service's equality query did), a yes/no, or a value `id_text` names so, each
    of its own BSON type; never an array holding one (`scalar_filter`). `by_value=False`
    names a number by `id_text` instead (as a request id is read: 5 and 5.0 are two)."""
    conditions: list[dict[str, Any]] = [{"$eq": text}]
    if (object_id := object_id_named(text)) is not None:
        conditions.append({"$eq": object_id})
    conditions += _number_conditions(text, by_value)
    if text in ("True", "False"):
        conditions.append({"$eq": text == "True", "$type": "bool"})
    if (decimal := _decimal_named(text, by_value)) is not None:
        conditions.append({"$eq": decimal, "$type": "decimal"})
    clauses = [scalar_filter(field, condition) for condition in conditions]
    return clauses[0] if len(clauses) == 1 else {"$or": clauses}


def _text_number_conditions(text: str) -> list[dict[str, Any]]:
    """The conditions finding the integer or the double `id_text` writes as `text`, each of its
    own BSON type (`str` of the value), as 5 and 5.0 are two ids to it."""
    whole = len(text) <= _INT64_DIGITS and re.fullmatch(r"-?[0-9]+", text)
    if whole and str(int(text)) == text and _in_int64(int(text)):
        return [{"$eq": int(text), "$type": kind} for kind in ("int", "long")]
    if re.fullmatch(r"-?[0-9.e+-]+|-?inf|nan", text):
        with contextlib.suppress(ValueError):
            if str(number := float(text)) == text:
                return [{"$eq": number, "$type": "double"}]
    return []


def named_filter(field: str, value: Any) -> dict[str, Any]:
    """The filter of the documents whose `field` names what `value` names, as the reader
    names ids (`id_text`): every value `id_filter` finds by `value`'s text (`42` finds `"42"`,
    `ObjectId(X)` finds `"X"`), and `value` itself (an object, whose text no query finds), an
    array matched whole, never by an element. The migration and an erasure find a
    conversation's turns by this one rule, whichever of its ids a turn names."""
    if value is None:
        return scalar_filter(field, {"$eq": None})
    exact = {field: value} if isinstance(value, list) else scalar_filter(field, {"$eq": value})
    return {"$or": [id_filter(field, str(named_id(value) or id_text(value))), exact]}


def _decimal_named(text: str, by_value: bool = False) -> Decimal128 | None:
    """The Decimal128 `id_text` writes as `text` (its JSON string), if there is one (with
    `by_value`, one `number_name` does not name by its value)."""
    if not (len(text) > 2 and text[0] == text[-1] == '"'):
        return None
    try:
        decimal = Decimal128(text[1:-1])
    except (ValueError, ArithmeticError, TypeError):
        return None
    named = named_id(decimal) if by_value else id_text(decimal)
    return decimal if named == text else None


def _in_int64(value: int) -> bool:
    return -(2**63) <= value < 2**63


def prompts_filter(conversation_id: str) -> dict[str, Any]:
    """The `session_hitl` documents of a conversation: they name it under one of two keys, the
    session only when they name no conversation (`prompt_conversation`)."""
    return {
        "$or": [
            id_filter("conversation_id", conversation_id),
            {
                "$and": [
                    id_filter("session_id", conversation_id),
                    names_none("conversation_id"),
                ]
            },
        ]
    }


def prompt_conversation(prompt: Mapping[str, Any]) -> str | None:
    """The conversation a `session_hitl` prompt belongs to, as the reader names it
    (`named_id`): the one its `conversation_id` names, else the one its `session_id` names;
    None when neither names one. `prompts_filter(name)` finds exactly the prompts so named."""
    named = named_id(prompt.get("conversation_id"))
    return named if named is not None else named_id(prompt.get("session_id"))


def derived_conversation_id(original: str | None, *, turn_key: str = "") -> str:
    """The stable identifier a conversation is stored under when its legacy id is not one.

    A turn naming no conversation at all becomes a conversation of its own, by its
    document id (`turn_key`).
    """
    if original is None:
        return DERIVED_TURN_PREFIX + turn_key
    digest = hashlib.sha256(original.encode("utf-8", "surrogatepass")).hexdigest()
    return DERIVED_CONVERSATION_PREFIX + digest[:32]


def derived_user_id(original: str) -> str:
    """The user a conversation is stored owned by when its legacy owner's id is no
    identifier (`alice+work@example.com`, `Alice Smith`): stable across runs, and no other
    user's, so the store's ownership rules keep it from every other user as they keep any
    owner's; `claim` moves it to the user an operator maps it to."""
    digest = hashlib.sha256(original.encode("utf-8", "surrogatepass")).hexdigest()
    return DERIVED_USER_PREFIX + digest[:32]


EXACT_FIELD = "dual_write_exact"
"""The field of a dual-written turn holding the digest of the messages it was written from
(`exact_digest`): converted without them, it must give exactly those."""
WHOLE_TEXTS_FIELD = "dual_write_whole_texts"
"""The field of a dual-written turn holding its texts cut (too large whole for one legacy
document): the GridFS files (bucket `agent_message_blobs`) keeping them whole."""
CUT_FIELD = "dual_write_cut"
"""The field of a dual-written turn listing the texts it holds cut further to fit one
legacy document that no GridFS file keeps whole (their whole texts are in `agent_messages`
alone): each by its message's `seq`, its path (`content`, `native`, …), its whole length and
the SHA-256 of its whole text, as a stored message's `truncated` entry records a cut."""
RECORD_FIELD = "dual_write_record"
"""The field of a dual-written turn naming the record of its copy (`copy_record_id`, in the
migration's collection): a copy this release wrote is told from an earlier release's by it."""
_DUAL_WRITE_FIELDS = frozenset(
    {"dual_write", "turn_id", EXACT_FIELD, WHOLE_TEXTS_FIELD, CUT_FIELD, RECORD_FIELD}
)
"""What the dual write adds to a legacy turn: its mark, the turn id it logged, the digest of
its messages, where its cut texts are kept whole, those no file keeps, and its record."""
_FALSE_WORDS = frozenset({"", "false", "f", "no", "n", "off", "none", "null"})
_TRUE_WORDS = frozenset({"true", "t", "yes", "y", "on"})


def flag(value: Any) -> bool | None:
    """A yes/no as its writers kept it: a bool, absent or null (no), a number of any BSON
    type that is 0 or 1, or text saying one of those or a word ("false", "no", "off", blank;
    "true", "yes", "on"), spaces around and case aside. None when it reads as neither (2,
    NaN, "disabled", a list, an object): the caller keeps it in a problem, never guesses."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _FALSE_WORDS or text in _TRUE_WORDS:
            return text in _TRUE_WORDS
        value = epoch_number(text)  # decimal digits, a fraction as a float
    if isinstance(value, Decimal128):
        value = value.to_decimal()
        value = None if value.is_nan() else float(value)
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    return None


def as_time(value: Any) -> datetime | None:
    """A time as aware UTC, from a datetime, a BSON timestamp (its seconds), an ISO string, or
    a whole number of epoch seconds or milliseconds (`epoch_time`), written as a number or as
    text (`epoch_number`);
    None if unreadable or no time the store takes (`taken_time`: 0001-01-01, 1969, 2099).
    Text is read with the spaces around it left out, as an ISO time
    first (`"20210301"` is a date; a final `z` as `Z`), else as a number, and as a number
    too when the ISO reading is no time a store accepts (`"1704101400000"`, milliseconds, is
    also ISO's basic form of 1704-10-14), else as an RFC 2822 date (HTTP's and e-mail's,
    `"Mon, 01 Mar 2021 10:00:00 GMT"`) or JavaScript's `Date.toString()`, at the offset it
    names (`text_time`: text it cannot read whole, AM or PM or a zone it does not know, is
    no time, never a time with part of it ignored). At the precision it was written with (an ISO
    string's or a datetime's microseconds kept), so turns less than a millisecond apart keep
    their order; a time stored is cut to the millisecond (`to_utc_millis`)."""
    if isinstance(value, str):
        text = value.strip()
        if (iso := taken_time(_iso_time(text))) is not None:
            return iso
        number = epoch_number(text)
        return (epoch_time(number) if number is not None else None) or _dated_text(text)
    if (number := epoch_number(value)) is not None:
        return epoch_time(number)
    if isinstance(value, Timestamp):  # a server's own clock: whole seconds and a counter
        return taken_time(to_utc(value.as_datetime()))
    return taken_time(to_utc(value)) if isinstance(value, datetime) else None


def taken_time(at: datetime | None) -> datetime | None:
    """`at` when it is a time the store takes (after the instant 1970-01-01T00:00:00 up to now
    and its future leeway), else None: Go's and .NET's zero time (0001-01-01), Unix time 0
    itself (`new Date(0)`, an all-zero ObjectId), a date before 1970 or one decades ahead is
    a placeholder, read as no time, as `0` is (`epoch_time`). Every time a legacy
    document carries (`as_time`, an ObjectId's) is read through it."""
    return at if at is not None and EPOCH < at <= _latest() else None


def _iso_time(text: str) -> datetime | None:
    """An ISO 8601 time, a final `Z` or `z` (RFC 3339 allows both) as UTC; None if not one."""
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    with contextlib.suppress(ValueError):
        return to_utc(datetime.fromisoformat(text))
    return None


_CLOCK_FRACTION = re.compile(r"(?:.{7}|.{8}|.{10}).[0-9]{2}:?[0-9]{2}:?[0-9]{2}[.,]([0-9]+)")
"""An ISO time's fraction of a second (its date in any form `datetime.fromisoformat` reads,
a separator, then its clock), never an offset's."""
_NO_REST = Decimal(0)


def _past_micros(value: Any) -> Decimal:
    """What a time written as ISO text says past the microsecond `as_time` keeps, as a
    fraction of a microsecond (`"…00.000000900Z"`: 0.9, Go's RFC3339Nano); 0 for any other
    value, and for text `as_time` reads otherwise. Turns are ordered by both (`sort_turns`),
    at the precision they were written with."""
    if not isinstance(value, str):
        return _NO_REST
    found = _CLOCK_FRACTION.match(text := value.strip())
    if found is None or len(digits := found[1]) <= 6:
        return _NO_REST
    if (at := _iso_time(text)) is None or as_time(text) != at:
        return _NO_REST
    return Decimal(f"0.{digits[6:]}")


def _dated_text(text: str) -> datetime | None:
    """An RFC 2822 date or JavaScript's `Date.toString()`, read whole at the offset it names
    (`text_time`), when it is a time a store accepts (since 1970, up to its future leeway);
    None if not one."""
    at = text_time(text)
    return taken_time(to_utc(at)) if at is not None else None


def _latest() -> datetime:
    """The latest time a store accepts now: its future leeway ahead."""
    return utc_now() + TurnRules().future_leeway


_NUMBER_TEXT = re.compile(r"[0-9]+(\.[0-9]+)?")


def epoch_number(value: Any) -> int | float | None:
    """The number a time written as a number holds: a number (an int, Int64, float or
    Decimal128; a bool is not one), or text that is one in decimal digits, spaces around it aside
    (`" 1614592800 "`, `"1614592800000.0"`); else None."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    if isinstance(value, Decimal128):
        exact = value.to_decimal()
        if not exact.is_finite():
            return None
        return int(exact) if exact == exact.to_integral_value() else float(exact)
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(text := value.strip()):
        # A float for a fraction, and for more digits than any time holds (Python's `int`
        # refuses text of over 4,300 digits): too large a number for a time, and no crash.
        return float(text) if "." in text or len(text) > _INT64_DIGITS else int(text)
    return None


_MILLIS_FROM = 10**11
"""Whole numbers from this on are milliseconds (1973-03-03 on), below it seconds (up to the
year 5138): one reading per value, whatever day the migration runs."""


def epoch_time(number: float) -> datetime | None:
    """A whole positive number since 1970 as the time a store accepts (up to now and the
    store's future leeway): seconds below `_MILLIS_FROM`, milliseconds from it; None when
    it is not such a time or not whole (`int(time.time())` and `Date.now()` are read; 0,
    a common placeholder for "unknown", and 1.5 are no time)."""
    if isinstance(number, float) and not number.is_integer():
        return None
    whole = int(number)
    latest = _latest()
    if whole <= 0 or whole > epoch_millis(latest):
        return None
    at = EPOCH + (
        timedelta(milliseconds=whole) if whole >= _MILLIS_FROM else timedelta(seconds=whole)
    )
    return at if at <= latest else None


class LegacyTurn(BaseModel):
    """One legacy turn document, as found: every field may be missing or odd."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, arbitrary_types_allowed=True)

    id: Any = Field(default=None, alias="_id")
    conversation_id: str | None = None
    """The id as found (as text, `named_id`); None when the turn names none (null or blank)."""
    user_id: str | None = None
    name: str | None = None
    created_at: Any = None
    is_system: Any = None
    """As found: `system` reads it."""
    user_message: Any = None
    upload_result: Any = None
    response_parts: Any = None
    tool_calls: Any = None
    response_text: Any = None
    token_usage: Any = None
    latency_ms: Any = None
    message_history_json: Any = None
    claimed_from: Any = None
    """The user ids claims moved the turn away from (`CLAIMED_FROM`), as the store names
    them; None for a turn no claim moved (`claimers`)."""
    _alone_as: str | None = PrivateAttr(default=None)
    """What it goes by as a conversation of its own (it names none) when that is not its
    `_id`'s text: its `_id` reads like an earlier such turn's (`tell_apart`)."""

    @field_validator("conversation_id", mode="before")
    @classmethod
    def _id_as_text(cls, value: Any) -> Any:
        return named_id(value)

    _name_as_found: Any = PrivateAttr(default=None)

    @field_validator("user_id", "name", mode="before")
    @classmethod
    def _blank_is_none(cls, value: Any, info: ValidationInfo) -> Any:
        """A blank one is none. A user id is read by its `str()`; a name as every text a
        message is made of (`as_text`): a value that is not text as its JSON text."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        return str(value) if info.field_name == "user_id" else as_text(value)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_name_as_found(cls, data: Any, handler: ModelWrapValidatorHandler[LegacyTurn]) -> Any:
        turn = handler(data)
        if isinstance(data, Mapping):
            turn._name_as_found = data.get("name")
        return turn

    @property
    def name_as_found(self) -> Any:
        """`name` as the document holds it (`name` is its text): a value JSON cannot encode
        is not what its text says (`not_json`)."""
        return self._name_as_found

    @property
    def system(self) -> bool:
        """Whether the turn is a system turn: `is_system` read as yes (`flag`); a value read
        as neither is no, and the converter keeps it in a problem."""
        return flag(self.is_system) is True

    def shown_name(self) -> str | None:
        """Its name as a conversation holds it (`shorten`: white space collapsed, control and
        text-direction characters left out, cut at a word to `MAX_NAME_CHARS`); None when it
        has none, or one that shows nothing (`shows_nothing`: blank, invisible or control
        characters alone), which names nothing: the last turn whose name shows something
        names the conversation."""
        if self.name is None:
            return None
        name = shorten(self.name, MAX_NAME_CHARS)
        return None if shows_nothing(name) else name

    @property
    def dual_write_field(self) -> Any:
        """Its `dual_write` field as found (`true` on a turn the dual write copied)."""
        return (self.model_extra or {}).get("dual_write")

    def unknown_fields(self) -> dict[str, Any]:
        """The fields no reader takes: those the format does not name, the dual write's own
        (`_DUAL_WRITE_FIELDS`) aside on a dual-written turn (`dual_write: true`) alone, whose
        check reads them (`_check_exact`). On any other turn a `turn_id` or `dual_write_exact`
        is the old service's own field, which nothing reads."""
        extra = self.model_extra or {}
        read = _DUAL_WRITE_FIELDS if extra.get("dual_write") is True else frozenset()
        return {k: v for k, v in extra.items() if k not in read}

    @property
    def key(self) -> str:
        """The document id as a short identifier-safe string (`key_of` its text): what a
        conversation made of a turn naming none is named by (its `_id`'s extended JSON when
        it reads like an earlier such turn's: `tell_apart`). In its own conversation a turn
        goes by `turn_names`."""
        return key_of(self._alone_as or str(self.id))

    @property
    def stored_conversation_id(self) -> str:
        """The conversation id its messages are stored under: the legacy one when it is an
        identifier, else one derived from it (see `derived_conversation_id`)."""
        found = self.conversation_id
        if found is not None and _IDENTIFIER.match(found):
            return found
        return derived_conversation_id(found, turn_key=self.key)

    def time(self) -> datetime | None:
        """`created_at` as aware UTC (`as_time`); None if unreadable."""
        return as_time(self.created_at)

    def id_time(self) -> datetime | None:
        """When the document was created, from its ObjectId (`taken_time`); None for other ids."""
        if not isinstance(self.id, ObjectId):
            return None
        return taken_time(to_utc_millis(self.id.generation_time))


def key_of(text: str) -> str:
    """A turn's name as a short identifier-safe string, as the ids derived from the turn
    spell it: the text itself when it is one, else `h` and its hash."""
    if _KEY.match(text):
        return text
    return "h" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass(frozen=True)
class TurnName:
    """What one turn goes by in its conversation (`turn_names`)."""

    legacy_id: str
    """The text of its `_id`, as its problems name it; for a turn whose `_id` reads like an
    earlier turn's, that `_id`'s extended JSON (`{"$oid": "…"}`, `"…"`)."""

    @property
    def key(self) -> str:
        """The name as the ids derived from the turn spell it (`key_of`): its generated call
        and request ids, and through its turn id its message ids."""
        return key_of(self.legacy_id)

    @property
    def turn_id(self) -> str:
        """The turn id its messages are stored under."""
        return f"{MIGRATED_TURN_PREFIX}{self.key}"


def turn_names(turns: Iterable[LegacyTurn]) -> dict[int, TurnName]:
    """The name each of one conversation's turns goes by, by `id(turn)`: the text of its
    `_id`, unless an earlier turn in conversation order (`sort_turns`) goes by that text: two
    `_id`s reading alike (`ObjectId(X)` and the string `"X"` of a re-import, `42` and
    `"42"`) are two turns, so the later one goes by its `_id`'s extended JSON, which no
    other value's is (and, should a turn go by that text already, a number after it). Its
    messages then get ids of their own, and every other turn keeps the ids it has alone:
    those an earlier run derived."""
    names: dict[int, TurnName] = {}
    taken: set[str] = set()
    for turn in sort_turns(turns):
        name = str(turn.id)
        if name in taken:
            typed = json_util.dumps(turn.id, json_options=json_util.CANONICAL_JSON_OPTIONS)
            name = next(n for n in _numbered(typed) if n not in taken)
        taken.add(name)
        names[id(turn)] = TurnName(name)
    return names


def _numbered(text: str) -> Iterator[str]:
    yield text
    yield from (f"{text} #{n}" for n in itertools.count(2))


def _stored_names(model: type[BaseModel]) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


TURN_ONLY_FIELDS = tuple(sorted(_stored_names(LegacyTurn) - _stored_names(Conversation)))
"""The fields of the legacy turn format no conversation document holds (`user_message`,
`response_parts`, `message_history_json`, …): a document holding one of them and the
`CONVERSATION_COUNTERS` is neither a legacy turn nor a conversation document."""


def parse_turns(
    documents: Iterable[Mapping[str, Any]], alike: Mapping[bytes, str] | None = None
) -> list[LegacyTurn]:
    """Legacy documents as models, each turn naming no conversation going by the name `alike`
    gives it (`Unnamed.names`; none given: its `_id`'s text). Raises InvalidInput only for a
    document no model holds."""
    documents = list(documents)
    for document in documents:
        named = f"legacy turn {document.get('_id')!r}"
        refuse_not_utf8(document, named)
        if (ref := reference_in(document.get("conversation_id"))) is not None:
            raise InvalidInput(
                f"{named}: conversation_id holds a database reference (a DBRef to "
                f"{ref.collection!r}), which names no conversation and which not every server "
                "groups (kept as stored): store the conversation's id in its place, then run again"
            )
    return _as_turns(documents, alike)


def reference_in(value: Any) -> DBRef | None:
    """The first database reference (a DBRef: `{"$ref": …, "$id": …}`) `value` is or holds,
    in an embedded document or an array at any depth; None when it holds none."""
    if isinstance(value, DBRef):
        return value
    items = value.values() if isinstance(value, Mapping) else value
    if isinstance(value, Mapping | list | tuple):
        return next((r for item in items if (r := reference_in(item)) is not None), None)
    return None


def _as_turns(
    documents: Iterable[Mapping[str, Any]], alike: Mapping[bytes, str] | None = None
) -> list[LegacyTurn]:
    """`parse_turns` without refusing text that is not valid UTF-8: what names a turn's
    conversation (`stored_conversation_id`, `tell_apart`) reads its ids whatever bytes they
    hold (an id holding such text is no identifier: a derived id names it, the conversion
    names the turn as a problem)."""
    turns = []
    for document in documents:
        try:
            turn = LegacyTurn.model_validate(read_code_as_text(document))
        except ValidationError as exc:
            raise InvalidInput(
                describe_validation_error(exc, subject=f"legacy turn {document.get('_id')!r}")
            ) from exc
        if alike and turn.conversation_id is None:
            turn._alone_as = alike.get(id_key(turn.id))
        turns.append(turn)
    return turns


def id_key(value: Any) -> bytes:
    """An `_id` as a key, by its BSON value (an ObjectId is no text, 5 is not "5"); one
    holding text that is not valid UTF-8 by `not_utf8_key`."""
    try:
        return bson.encode({"id": value})
    except UnicodeEncodeError:
        return not_utf8_key(value)


def not_utf8_key(value: Any) -> bytes:
    """A value holding text that is not valid UTF-8 (read with `surrogateescape`: each such
    byte a lone surrogate, which no BSON encodes) as a key: its canonical extended JSON, each
    such byte an escape, behind four zero bytes, which begin no BSON document (its length)."""
    exact = json_util.dumps(value, json_options=json_util.CANONICAL_JSON_OPTIONS)
    return b"\0\0\0\0" + exact.encode()


NAMING_FIELDS = {"_id": 1, "conversation_id": 1, "created_at": 1}
"""What tells the turns naming no conversation apart (`tell_apart`): their ids and times."""


@dataclass(frozen=True)
class Unnamed:
    """The turns naming no conversation, each a conversation of its own, told apart
    (`tell_apart`)."""

    names: dict[bytes, str]
    """What each goes by, by `id_key` of its `_id`, when that is not its `_id`'s text."""
    ids: dict[str, list[Any]]
    """The `_id`s each conversation made of them stands for, by its `legacy-turn-` id."""


def tell_apart(documents: Iterable[Mapping[str, Any]]) -> Unnamed:
    """Every turn naming no conversation (`documents`: all of them, `NAMING_FIELDS` enough),
    each a conversation of its own, `legacy-turn-<key>` (`LegacyTurn.key`). Turns whose `_id`s
    read alike (5 and "5", `ObjectId(X)` and "X") are told apart as `turn_names` tells one
    conversation's: the first in time (ties by `_id`) goes by its `_id`'s text, so keeps the
    id an earlier run derived, a later one by its `_id`'s extended JSON (numbered, should a
    turn go by that already), which `key_of` hashes. The converter, the read fallback, the
    deletes and the migration name them by this one function, over one scan of them all."""
    turns: dict[bytes, LegacyTurn] = {}
    for turn in _as_turns({k: d.get(k) for k in NAMING_FIELDS} for d in documents):
        if turn.conversation_id is None:
            turns.setdefault(id_key(turn.id), turn)
    taken = {key_of(str(t.id)) for t in turns.values()}  # names as derived ids spell them
    alike: dict[str, list[LegacyTurn]] = {}
    for key in sorted(turns):
        alike.setdefault(str(turns[key].id), []).append(turns[key])
    names: dict[bytes, str] = {}
    for text in sorted(t for t, group in alike.items() if len(group) > 1):
        for later in sort_turns(alike[text])[1:]:
            typed = json_util.dumps(later.id, json_options=json_util.CANONICAL_JSON_OPTIONS)
            names[id_key(later.id)] = next(n for n in _numbered(typed) if key_of(n) not in taken)
            taken.add(key_of(names[id_key(later.id)]))
    ids: dict[str, list[Any]] = {}
    for key, turn in turns.items():
        turn._alone_as = names.get(key)
        ids.setdefault(turn.stored_conversation_id, []).append(turn.id)
    return Unnamed(names, ids)


def group_conversations(turns: Iterable[LegacyTurn]) -> dict[str, list[LegacyTurn]]:
    """Turns by the conversation id they are stored under, each group in stored order.

    One stored conversation whichever way its turns name it: a conversation stored under a
    derived id holds the turns naming the legacy id it stands for (or, for a
    `legacy-turn-` id, the turn naming none it was made of) and the turns naming the
    derived id itself, which a dual write made before it named a conversation as its legacy
    turns do (`named_by`)."""
    grouped: dict[str, list[LegacyTurn]] = {}
    for turn in turns:
        grouped.setdefault(turn.stored_conversation_id, []).append(turn)
    return grouped


def stored_conversation_id(
    document: Mapping[str, Any], alike: Mapping[bytes, str] | None = None
) -> str:
    """The conversation id a legacy turn document's messages are stored under
    (`LegacyTurn.stored_conversation_id`), read from its `_id` and `conversation_id` only, and,
    for one naming none, the name `alike` gives it (`Unnamed.names`)."""
    found = {"_id": document.get("_id"), "conversation_id": document.get("conversation_id")}
    [turn] = _as_turns([found], alike)
    return turn.stored_conversation_id


def named_by(turns: Iterable[LegacyTurn]) -> LegacyTurn | None:
    """The first of one stored conversation's turns that names it otherwise than by the id
    it is stored under: by the legacy id a derived id stands for, or by none. None when
    every turn names the stored id (an identifier, or a derived id only dual writes named)."""
    return next((t for t in turns if t.conversation_id != t.stored_conversation_id), None)


def legacy_name(turns: Iterable[LegacyTurn]) -> str | None:
    """The id one stored conversation's legacy turns name it by, as the legacy service
    reads it: the legacy id a derived id stands for (None: its turn names none), else the
    id it is stored under."""
    turns = list(turns)
    found = named_by(turns)
    return found.conversation_id if found is not None else turns[0].stored_conversation_id


@dataclass(frozen=True)
class TurnTime:
    """The time a turn's messages get, and where it came from."""

    at: datetime | None
    """None only when no turn of the conversation has a readable time. At the precision it
    was written with (`as_time`): turns are ordered by it; their messages store it cut to the
    millisecond."""
    source: str
    """Where the time came from, for a person: `its created_at`, `its ObjectId's time`, …"""
    past_micros: Decimal = _NO_REST
    """What the time as written says past `at`'s microseconds (`_past_micros`): turns are
    ordered by both."""


def _own_time(turn: LegacyTurn) -> TurnTime | None:
    if (at := turn.time()) is not None:
        return TurnTime(at, "its created_at", _past_micros(turn.created_at))
    if (at := turn.id_time()) is not None:
        return TurnTime(at, "its ObjectId's time")
    return None


def dated_turns(turns: Iterable[LegacyTurn]) -> list[TurnTime]:
    """Each turn's time: its own, else its ObjectId's, else the next readable turn's, else the
    previous readable turn's; with no readable turn at all, none."""
    ordered = list(turns)
    own = [_own_time(turn) for turn in ordered]
    if all(own):
        return [found for found in own if found is not None]
    times: list[TurnTime | None] = list(own)
    for step, indexes in (
        ("next", reversed(range(len(ordered)))),
        ("previous", range(len(ordered))),
    ):
        donor: TurnTime | None = None
        for index in indexes:
            if (found := own[index]) is not None:
                turn = str(ordered[index].id)
                source = f"the {step} readable turn's time (turn {turn!r})"
                donor = TurnTime(found.at, source, found.past_micros)
            elif times[index] is None:
                times[index] = donor
    return [found or TurnTime(None, "") for found in times]


def turn_times(turns: Iterable[LegacyTurn]) -> list[datetime | None]:
    """Each turn's time (see `dated_turns`); None only when no turn has a readable time."""
    return [found.at for found in dated_turns(turns)]


def sort_turns(turns: Iterable[LegacyTurn]) -> list[LegacyTurn]:
    """By time (see `dated_turns`), at the precision it was written with (two turns 0.8 ms
    apart are no tie, nor two ISO texts 800 ns apart: `_past_micros`); ties and turns without
    any time keep the stored order."""
    ordered = list(turns)
    times = dated_turns(ordered)
    floor = datetime.min.replace(tzinfo=UTC)
    keyed = sorted(range(len(ordered)), key=lambda i: (times[i].at or floor, times[i].past_micros))
    return [ordered[i] for i in keyed]


CLAIMED_FROM = "claimed_from"
"""The field a claim (`ConversationStore.claim`) adds the user id it moves a legacy turn away
from to, as the store names it (`user_named`), with every earlier claim's kept: what tells
the conversation's turns the old service logs or re-saves since, naming that id because it
knows of no claim, as the claimer's (`claimers`)."""


CLAIM_RECORD = "claimed_turn"
"""The `kind` of the record a claim keeps of each legacy turn it moves, in the migration's
collection (`MIGRATION_STATE`), where the old service never writes: the user id it wrote
(`user_id`) and every user id claims moved the turn away from (`CLAIMED_FROM`), by
`claim_record_id`. Written before the turn is moved, so the old service re-saving the moved
turn from its cache (an upsert by `_id`, naming the user id it knew, without
`claimed_from`) loses no claim: the turn read is as the record says (`as_claims_recorded`)."""


def claim_record_id(turn_id: Any) -> str:
    """The `_id` of the claim record of the legacy turn `turn_id` (`CLAIM_RECORD`): a digest
    of the `_id` by value (`5` and `Int64(5)`, one `_id` to MongoDB, are one), naming no one."""
    named = (
        f"n:{number}" if (number := number_name(turn_id)) is not None else f"t:{id_text(turn_id)}"
    )
    return f"{CLAIM_RECORD}|{hashlib.sha256(named.encode()).hexdigest()[:32]}"


def claim_records_owed(documents: Iterable[Mapping[str, Any]]) -> list[str]:
    """The `_id`s of the claim records (`claim_record_id`) to read with these legacy turn
    documents, those of one read: none when none of them carries a claim (`CLAIMED_FROM`),
    so a read of turns no claim moved costs no round trip more; else one for each."""
    documents = list(documents)
    if not any(isinstance(d.get(CLAIMED_FROM), list) for d in documents):
        return []
    return sorted({claim_record_id(d.get("_id")) for d in documents})


def as_claims_recorded(
    documents: Iterable[dict[str, Any]], records: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Each legacy turn document as its claim record says (`CLAIM_RECORD`): the user id the
    last claim of it wrote and the user ids it moved away from, over what the document holds,
    when the document names one of them (the old service re-saving the moved turn from its
    cache wrote the user id it knew, without `claimed_from`); as stored when it names
    another user (an owner an operator corrected since) or no record is of it. The one
    reading of a turn's claims the read fallback, the delete, the erasure, the claim and the
    migration share, before any reader takes its user (`claimers`, `claimed_user`)."""
    by_id = {r["_id"]: r for r in records if r.get("kind") == CLAIM_RECORD}
    recorded = []
    for document in documents:
        record = by_id.get(claim_record_id(document.get("_id")))
        moved = record.get(CLAIMED_FROM) if record is not None else None
        if record is None or not isinstance(moved, list):
            recorded.append(document)
            continue
        named = user_named(document.get("user_id"))
        if named is None or named not in {user_named(record.get("user_id")), *moved}:
            recorded.append(document)
            continue
        recorded.append({**document, "user_id": record.get("user_id"), CLAIMED_FROM: list(moved)})
    return recorded


def claim_record_update(to_user_id: str, moved_from: Iterable[str], at: datetime) -> dict[str, Any]:
    """The upsert of the claim record of a turn a claim moves to `to_user_id` (`CLAIM_RECORD`,
    by `claim_record_id`): the user it writes, and the user ids it moved the turn away from
    added to those recorded (`moved_from`: the turn's, then the claim's), in order."""
    return {
        "$set": {"kind": CLAIM_RECORD, "user_id": to_user_id, "at": at},
        "$addToSet": {CLAIMED_FROM: {"$each": list(dict.fromkeys(moved_from))}},
    }


def claimers(turns: Iterable[LegacyTurn]) -> dict[str, str]:
    """Who claimed each user id a claim moved some of one conversation's turns away from
    (`claimed_from`): the user the last such turn in time names now. A chain (`a` to `b`,
    then `b` to `c`) left `[a, b]` on turns naming `c`: both are `c`'s."""
    found: dict[str, str] = {}
    for turn in sort_turns(turns):
        moved = turn.claimed_from if isinstance(turn.claimed_from, list) else []
        if (claimer := user_named(turn.user_id)) is not None:
            found |= {named: claimer for value in moved if (named := user_named(value))}
    return {named: claimer for named, claimer in found.items() if named != claimer}


def turn_users(turns: list[LegacyTurn]) -> list[str | None]:
    """The user each of one conversation's turns names (`user_named`), one a claim moved
    some of its turns away from as their claimer (`claimers`): the old service, which knows
    of no claim, logs or re-saves turns naming the user id it knows. The one reading of a
    legacy turn's user that its conversation's ownership (`owner_of`, `users_part`) and the
    migration's conversion take."""
    claimed = claimers(turns)
    return [claimed_user(turn.user_id, claimed, turn.claimed_from) for turn in turns]


def claimed_user(
    value: Any, claimed: Mapping[str, str] | None, claimed_from: Any = None
) -> str | None:
    """The user a legacy turn's or prompt's `user_id` value names (`user_named`) as its
    conversation's turns read it: a user id a claim moved the conversation away from names
    its claimer (`claimed`, the conversation's `claimers`; none, as stored). A turn a claim
    moved (its own `claimed_from`, a list: the old service never writes it) names the user
    that claim wrote, as stored: the claims of the conversation's other turns are for the
    turns the old service logs or re-saves naming the id it knows (was: read through them,
    so in a mixed conversation a turn a claim moved to a user id another claim moved away
    from was served that claimer). The one reading of a user id through the claims, for
    turns (`turn_users`) and prompts (`owners_prompt`, `part_of`) alike."""
    user = user_named(value)
    if user is None or isinstance(claimed_from, list):
        return user
    return (claimed or {}).get(user, user)


def named_users(turns: Iterable[LegacyTurn]) -> list[str]:
    """The user ids one conversation's turns name, in time order (turns without one left
    out): as stored, but a user a claim moved them away from named as its claimer
    (`turn_users`)."""
    ordered = sort_turns(turns)
    users = turn_users(ordered)
    return [
        t.user_id if users[i] == user_named(t.user_id) else str(users[i])
        for i, t in enumerate(ordered)
        if t.user_id
    ]


def owner_of(turns: Iterable[LegacyTurn]) -> str | None:
    """Who owns a legacy conversation: the last user its turns name (`user_named`), as the
    migration stores it; None when no turn names one."""
    users = named_users(turns)
    return user_named(users[-1]) if users else None


def user_named(value: Any) -> str | None:
    """The user a legacy `user_id` value names, as a turn reads it (its text): None only for
    none (missing, null, blank text); else its text when that is an identifier, and when it
    is not (`alice+work@example.com`, `4.2e+20`) the user the migration stores it as
    (`derived_user_id`), another user than every other, whom no token of another user is."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        return validate_identifier(str(value), "user_id")
    except InvalidInput:
        return derived_user_id(str(value))


_INTEGER_TEXT = re.compile(r"-?(0|[1-9][0-9]{0,18})")


def user_values(user_id: str) -> list[Any]:
    """The stored `user_id` values a legacy turn or prompt may name `user_id` by, as
    `user_named` reads them (any value's `str()`): the text, as text and as JavaScript code,
    and the integer, double, yes/no, Decimal128 or ObjectId whose text it is. A query by
    them finds more (a number matches the double of its value, whose text is another): keep
    of what it finds what `user_named` reads as the user."""
    values: list[Any] = [user_id, Code(user_id)]
    if _INTEGER_TEXT.fullmatch(user_id) and _in_int64(int(user_id)):
        values.append(int(user_id))
    if user_id in ("True", "False"):
        values.append(user_id == "True")
    for number_type in (float, Decimal128):
        with contextlib.suppress(ValueError, ArithmeticError, TypeError):
            if str(number := number_type(user_id)) == user_id:
                values.append(number)
    if (object_id := object_id_named(user_id)) is not None:
        values.append(object_id)
    return values


@dataclass(frozen=True)
class LiveConversation:
    """The conversation document stored under the id a conversation's legacy turns are read
    by (in any state: standing, marked by a delete, being migrated). What its dual write
    copied there (`dual_write: true`: its turns, its answers' `session_hitl` records) is its
    own rollback copy, not a legacy turn: its owner's whole, or no user's when it has none,
    whatever the legacy turns under the id name (`live_copy`). Looked up wherever legacy
    turns stand under the id, dual write on or off: what names no user beside it is its
    owner's either way (`owns_legacy`)."""

    user_id: str | None


def live_copy(dual_write: Any, live: LiveConversation | None) -> bool:
    """Whether a document under an id whose `dual_write` field holds `dual_write` is the live
    conversation's own copy: the dual write marked it, and a conversation document stands
    under the id (`live`). Once none does (deleted, or moved away by a rollback), the copies
    are legacy turns like any other, and the old service and a second attempt read them so."""
    return live is not None and dual_write is True


def reached_by(
    turns: list[LegacyTurn], user_id: str | None, live: LiveConversation | None
) -> list[int]:
    """The indexes of the turns under an id that are legacy turns to `user_id`: every one to
    the live conversation's owner (`live`, None when no conversation document stands there);
    to a service (`user_id` None) every one but the live conversation's copies (`live_copy`);
    and to any other user only the turns naming her (`user_named`), never a copy, nor a turn
    naming no user or another user: beside a live conversation those are not hers whoever
    its turns name last (`owns_legacy`), so a late legacy turn naming her gives her that
    turn alone, to read, delete or erase."""
    if live is None or user_id == live.user_id:
        return list(range(len(turns)))
    users = turn_users(turns)
    return [
        i
        for i, turn in enumerate(turns)
        if not live_copy(turn.dual_write_field, live) and (user_id is None or users[i] == user_id)
    ]


def owns_legacy(
    turns: list[LegacyTurn], user_id: str | None, live: LiveConversation | None
) -> bool:
    """Whether `user_id` owns the legacy conversation under an id, and with it the turns and
    prompts naming no user: while a conversation document stands there (`live`) its owner
    (no user for an unowned one), whatever the legacy turns name and whether or not its dual
    write copied anything there; else the last user its turns name (`owner_of`). The one
    ownership rule of the read fallback, the delete and the erasure."""
    if live is not None:
        return user_id == live.user_id
    return owner_of(turns) == user_id


def users_part(
    turns: list[LegacyTurn], user_id: str | None, live: LiveConversation | None = None
) -> list[int]:
    """The indexes of the turns that are `user_id`'s part of one legacy conversation: those
    naming the user (`user_named`), and, when the user owns the conversation (`owns_legacy`),
    those naming no user (a missing, null or blank `user_id`). Another user's turns are
    never part of it, whatever id they are filed under or named by, an identifier or not:
    ids that read alike (`42` and `"42"`) make one conversation of two users' turns, which
    the owner reads, deletes and erases without the other's words. The copies of the live
    conversation under the id (`live`) are its owner's part whole, whatever the turns name,
    and never another user's (`reached_by`), nor are the turns naming no user beside it."""
    reached = reached_by(turns, user_id, live)
    owns = owns_legacy(turns, user_id, live)
    users = turn_users(turns)
    part = [i for i in reached if users[i] == user_id or (owns and users[i] is None)]
    if live is None or user_id != live.user_id:
        return part
    return sorted({*part, *(i for i, t in enumerate(turns) if live_copy(t.dual_write_field, live))})


def prompt_part_of(
    prompt: Mapping[str, Any],
    user_id: str | None,
    live: LiveConversation | None,
    *,
    owns: bool,
    claimed: Mapping[str, str] | None = None,
) -> bool:
    """Whether a `session_hitl` prompt under an id is `user_id`'s part of its conversation, as
    `users_part` tells a turn: the live conversation's own record (`live_copy`: the dual write
    marked it) its owner's alone; any other by `part_of`, read through the claims of its
    conversation's turns (`claimed`)."""
    if live_copy(prompt.get("dual_write"), live):
        assert live is not None
        return user_id == live.user_id
    return part_of(prompt.get("user_id"), user_id, owns=owns, claimed=claimed)


def part_of(
    value: Any, user_id: str | None, *, owns: bool, claimed: Mapping[str, str] | None = None
) -> bool:
    """Whether a legacy turn or prompt whose `user_id` is `value` is `user_id`'s part of its
    conversation, `owns` when the user owns it (`owner_of`): it names the user, or no user
    (`user_named`: missing, null, or blank as `str.strip()` tells it, any Unicode white
    space) and the user owns it; a user id a claim moved the conversation away from names
    its claimer (`claimed_user`). A filter cannot tell blank so, nor a value's text: the
    delete and the erasure read the documents and keep those this says are the user's."""
    named = claimed_user(value, claimed)
    return named == user_id or (owns and named is None)


# -- text of odd values ------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """A JSON stand-in for a value json cannot encode (dates, ObjectIds, bytes...)."""
    if isinstance(value, datetime):
        return to_utc_millis(value).isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def is_text(value: Any) -> bool:
    """Whether a legacy value is text, kept as it is: a `str`, BSON code without a scope (its
    code is all it holds) too; code with a scope is a `str` to Python, its code alone, so it
    is no text (`dumps` writes it whole)."""
    return isinstance(value, str) and not (isinstance(value, Code) and value.scope is not None)


def without_code(value: Any) -> Any:
    """`value` with each BSON JavaScript code in it made text, before any field is read: code
    without a scope as its code, all it holds; code with a scope as the text of its extended
    JSON (`id_text`), so no reader keeps the code, a `str` to Python, and drops the scope. The
    value itself (not a copy) when it holds no code."""
    if isinstance(value, Code):
        return str.__str__(value) if value.scope is None else id_text(value)
    if isinstance(value, dict):
        read = {key: without_code(item) for key, item in value.items()}
        return read if any(read[k] is not value[k] for k in value) else value
    if isinstance(value, list):
        items = [without_code(item) for item in value]
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    return value


_NAMED_AS_FOUND = ("_id", "conversation_id", "user_id")
"""A legacy document's fields its code is not made text in (`without_code`): ids are named
by `id_text` and `user_named`, which tell code from the text it spells."""


def read_code_as_text(document: Mapping[str, Any]) -> dict[str, Any]:
    """A legacy document (a turn, a `session_hitl` prompt) with the code in its fields made
    text (`without_code`), its ids as found."""
    return {
        key: value if key in _NAMED_AS_FOUND else without_code(value)
        for key, value in document.items()
    }


def scopes_as_text(value: Any) -> Any:
    """`value` with each BSON code holding a scope as the text of its extended JSON (as an id
    stored so is named, `id_text`), its scope kept: where a value is kept as JSON (a prompt's
    params), not made text whole."""
    if isinstance(value, Code) and value.scope is not None:
        return id_text(value)
    if isinstance(value, dict):
        return {key: scopes_as_text(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [scopes_as_text(item) for item in value]
    return value


def _scoped_code(value: Any) -> tuple[Any, bool]:
    """`value` with each BSON code holding a scope as its extended JSON (`{"$code": …,
    "$scope": …}`, as an id stored so is named), and whether one was found. JSON writes any
    `str` as its text: such code would lose its scope."""
    if isinstance(value, Code) and value.scope is not None:
        return {"$code": str.__str__(value), "$scope": _scoped_code(value.scope)[0]}, True
    if isinstance(value, dict):
        pairs = [(key, _scoped_code(item)) for key, item in value.items()]
        if any(found for _, (_, found) in pairs):
            return {key: item for key, (item, _) in pairs}, True
    elif isinstance(value, list | tuple):
        items = [_scoped_code(item) for item in value]
        if any(found for _, found in items):
            return [item for item, _ in items], True
    return value, False


def dumps(value: Any, *, compact: bool = False) -> tuple[str, bool]:
    """JSON text of `value`, and whether it is plain JSON (False: some values became strings,
    or BSON code with a scope its extended JSON: `_scoped_code`). The one way a legacy value
    that is not text becomes text."""
    separators = (",", ":") if compact else (", ", ": ")
    value, scoped = _scoped_code(value)
    try:
        text = json.dumps(value, ensure_ascii=False, separators=separators, allow_nan=False)
        return text, not scoped
    except (TypeError, ValueError):
        text = json.dumps(
            _finite(value), ensure_ascii=False, separators=separators, default=_jsonable
        )
        return text, False


def refuse_not_utf8(document: Mapping[str, Any], named: str) -> None:
    """InvalidInput when a legacy document (a turn, a `session_hitl` prompt), `named` so in
    the message, holds bytes that are not valid UTF-8 anywhere (`not_utf8_at`, the message
    naming where): no message or conversation document can hold them, and no lossy reading
    is taken for them, so its conversation is converted by no reader until they are
    corrected. The message quotes none of them (`!r` writes each as its escape)."""
    if (where := not_utf8_at(document)) is not None:
        raise InvalidInput(
            f"{named}: {where} holds bytes that are not valid UTF-8 (kept as stored; no "
            "message can hold them): correct the text in the database, then run again"
        )


def encodes(value: Any) -> bool:
    """Whether BSON holds `value` as it is: no text holding a lone surrogate (only a JSON
    escape, `\\ud800`, spells one), no key holding NUL, no integer wider than 64 bits. Values
    read from legacy JSON text may be any of these."""
    try:
        bson.encode({"value": value})
    except (bson.InvalidDocument, UnicodeEncodeError, OverflowError):
        return False
    return True


def storable(value: Any) -> Any:
    """`value` as BSON holds it: itself when it can (`encodes`), else the JSON text spelling
    it, each lone surrogate written as its escape, as the legacy JSON text spelt it. The one
    way what JSON text says and BSON cannot hold is kept: a call's arguments, a result and a
    prompt's params stay their JSON text, and a problem keeps such content so."""
    if encodes(value):
        return value
    return storable_text(dumps(value)[0])


def storable_text(text: str) -> str:
    """A text as BSON holds it: each lone surrogate written as its escape (`\\ud800`), as
    JSON text spells it. What `storable` makes of a value BSON cannot hold, and every text of
    a problem (a detail naming a part kind read from JSON, say)."""
    return LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def not_json(value: Any) -> bool:
    """Whether `as_text` makes of `value` a text that no longer is it: a value that is not
    text holding one JSON cannot encode (bytes, a UUID, a time, an ObjectId, a Decimal128),
    which `dumps` writes as a string (`'"2024-02-29T12:00:00+00:00"'` is a time and the text
    alike). Text, and a plain JSON value (read as its JSON text), say what they are."""
    return value is not None and not is_text(value) and not dumps(value)[1]


def as_text(value: Any) -> str:
    """A legacy value as the text a message holds: text as it is (`is_text`), anything else
    as JSON (`dumps`)."""
    return value if is_text(value) else dumps(value)[0]


_COUNT_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
"""A count written as text: ASCII decimal digits, a sign, a decimal point and an exponent
allowed (`"1200"`, `" 850.6 "`, `"12.4e2"`). Not Python's `float` spellings besides: digits
grouped by `_` (`"1_000"`), digits of another script (`"١٢"`), `"inf"`, `"nan"`."""


def as_count(value: Any) -> int | None:
    """A count (tokens, milliseconds) from a number or its text (`_COUNT_TEXT`, spaces around
    it aside), rounded to the nearest whole number (a half to the even one).

    None for a missing value (None or a blank string). Raises ValueError for
    anything else: other text, a negative number (`-0.4` too: the sign is read before the
    rounding), a non-finite number, a bool, one above 2**53 - 1, the largest a message keeps
    (`Count`: a 64-bit "not measured" placeholder is no count).
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    number: float | int
    if isinstance(value, str) and _COUNT_TEXT.fullmatch(text := value.strip()):
        number = float(text)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = value
    else:
        raise ValueError(f"{value!r} is not a count: a number, or its text in ASCII decimal digits")
    if isinstance(number, float) and not math.isfinite(number):
        raise ValueError(f"{value!r} is not a count")
    rounded = round(number)
    if number < 0 or rounded > MAX_SAFE_INTEGER:
        raise ValueError(f"{value!r} is not a count from 0 to {MAX_SAFE_INTEGER}")
    return rounded
