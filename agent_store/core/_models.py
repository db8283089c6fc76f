"""The stored shapes: one message per document, one conversation per document.

Field names are the wire contract read by other services (see DESIGN §2), so
these models are the single source of truth for documents, API payloads and
the exported JSON Schema.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any, ClassVar, Generic, Literal, Self, TypeVar

from bson import DBRef, Int64
from bson.tz_util import utc as BSON_UTC
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    JsonValue,
    ModelWrapValidatorHandler,
    PlainSerializer,
    SerializationInfo,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, InitErrorDetails, PydanticCustomError

from agent_store.core._errors import (
    DOT_SEGMENT_REASON,
    DOT_SEGMENTS,
    described_pattern,
    listed,
    shown,
    shown_key,
)
from agent_store.core._json_text import MAX_JSON_VALUES, MAX_PARAMS_DEPTH, json_values_past

Role = Literal["system", "user", "assistant", "tool"]
"""Who speaks a message, as in the OpenAI chat format."""


def to_utc(value: datetime) -> datetime:
    """Make a datetime aware UTC, at the precision it has (to order times written with
    microseconds; `to_utc_millis` for a time to store).

    A naive datetime is taken to be UTC already: that is how MongoDB drivers
    return dates when the client is not timezone-aware.
    """
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    elif value.utcoffset():
        try:
            value = value.astimezone(UTC)
        except OverflowError as exc:
            raise ValueError(f"{value.isoformat()} is out of range in UTC") from exc
    if value.tzinfo is not UTC:
        value = value.replace(tzinfo=UTC)
    return value


def to_utc_millis(value: datetime) -> datetime:
    """Make a datetime aware UTC at millisecond precision, the precision BSON keeps (`to_utc`,
    the microseconds below the millisecond cut off)."""
    tzinfo = value.tzinfo
    if tzinfo is BSON_UTC:  # as a timezone-aware driver reads every stored time
        value = value.replace(tzinfo=UTC)
    elif tzinfo is not UTC:
        value = to_utc(value)
    if value.microsecond % 1000:
        value = value.replace(microsecond=value.microsecond // 1000 * 1000)
    return value


_UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MILLISECOND = timedelta(milliseconds=1)


def whole_millis(duration: timedelta) -> int:
    """A duration in whole milliseconds (the microseconds below cut off), in exact integer
    arithmetic: a float's `total_seconds() * 1000` (or `timestamp() * 1000`) lands below the
    whole millisecond for some durations (1.001 s) and loses one when truncated."""
    return duration // _MILLISECOND


def epoch_millis(value: datetime) -> int:
    """A time as whole milliseconds since 1970 (`to_utc`, `whole_millis`)."""
    return whole_millis(to_utc(value) - _UNIX_EPOCH)


def from_epoch_millis(millis: int) -> datetime:
    """The aware UTC time `millis` whole milliseconds from 1970 (`epoch_millis` read back);
    OverflowError when no datetime is that far."""
    return _UNIX_EPOCH + millis * _MILLISECOND


def utc_now() -> datetime:
    """The store's clock: now, aware UTC, at millisecond precision."""
    return to_utc_millis(datetime.now(UTC))


def rfc3339_millis(value: datetime) -> str:
    """How a time is written in JSON: RFC 3339 in UTC with exactly three fractional digits,
    `2026-01-31T09:30:00.000Z`, what JavaScript's `Date.prototype.toISOString()` gives.

    One width for every time, so the strings sort as the times do.
    """
    return to_utc_millis(value).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


RFC3339_MILLIS_PATTERN = described_pattern(
    r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$",
    "a time is written in RFC 3339 in UTC with three fractional digits: 2026-01-31T09:30:00.000Z",
)
"""The one shape of a time in the JSON the store serves (`rfc3339_millis`)."""

UtcDatetime = Annotated[
    datetime,
    AfterValidator(to_utc_millis),
    PlainSerializer(rfc3339_millis, return_type=str, when_used="json"),
    WithJsonSchema(
        {"type": "string", "format": "date-time", "pattern": RFC3339_MILLIS_PATTERN},
        mode="serialization",
    ),
]
"""A timezone-aware UTC datetime, truncated to milliseconds; in JSON, `rfc3339_millis`."""

MAX_SAFE_INTEGER = 2**53 - 1
"""The largest integer the store accepts or keeps: JavaScript readers hold it exactly."""


def _stored_width(value: int, info: SerializationInfo) -> int:
    """Every integer of a document is a BSON int64, whatever its size: one width per field.

    PyMongo writes a Python int as an int32 when it fits, so a field would be
    an int32 in one document and an int64 in the next.
    """
    return value if info.mode_is_json() else Int64(value)


def whole(value: Any) -> Any:
    """A float with no fractional part as the integer it is, any other value as it is: JSON
    Schema's `integer` is any number without a fraction (`120.0` and `1E2` are integers), and
    strict validation would refuse every float. A fraction, a string or a boolean is left to
    the integer's own check, which refuses it; so is a float past the field's bounds."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


Whole = BeforeValidator(whole)
"""Put in an integer's `Annotated`: a JSON number written `120.0` or `1E2` is that integer."""

Count = Annotated[
    int,
    Field(ge=0, le=MAX_SAFE_INTEGER),
    Whole,
    PlainSerializer(_stored_width, return_type=int),
    WithJsonSchema(
        {"type": "integer", "minimum": 0, "maximum": MAX_SAFE_INTEGER}, mode="serialization"
    ),
    WithJsonSchema({"ge": 0, "le": MAX_SAFE_INTEGER, "type": "integer"}, mode="validation"),
]
"""A non-negative integer a JavaScript reader can hold exactly (at most 2**53 - 1), stored as
a BSON int64.

The bounds come before `Whole` so pydantic-core checks them as the integer's own, not as two
Python calls after it (every stored message read holds two to four counts); `Whole` still
runs first. The schema of what is accepted is written out as it was with the bounds after
`Whole` (pydantic's `ge`/`le` keys, what `/openapi.json` has always said)."""

MAX_HELD_CALLS = 100
"""How many calls one HITL prompt may name (`HitlAction.tool_call_ids`): as many as a
conversation lists pending."""

MAX_CALL_ID_CHARS = 200
"""How long a tool call id an answer names (`ConversationStore.resolve_hitl`) may be."""

CallId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_CALL_ID_CHARS)]
"""A tool call id an answer names: 1 to `MAX_CALL_ID_CHARS` characters. An answer names at
most `MAX_HELD_CALLS` of them, as many as a prompt holds."""

MAX_TOOL_CALLS = 1000
"""The most tool calls one assistant message may make: far more than a model asks for at once.
Each is listed on its conversation while it waits, and a message over its byte bound made of
thousands of small calls is costly to cut (30,000 calls held a turn for 42 s)."""

IDENTIFIER_PATTERN = (
    r"^(?:[A-Za-z0-9_:@|-][A-Za-z0-9_.:@|-]{0,199}"
    r"|\.[A-Za-z0-9_:@|-][A-Za-z0-9_.:@|-]{0,198}"
    r"|\.\.[A-Za-z0-9_.:@|-]{1,198})$"
)
"""What an id is: 1-200 characters of `[A-Za-z0-9_.:@|-]`, but not `.` or `..` alone. Written
without look-ahead (pydantic-core's regex has none): an id starts with a character not a dot,
with a dot and then another, or with two dots and then anything."""


def _not_an_id(value: str) -> str:
    """What is wrong with a value failing `IDENTIFIER_PATTERN`, in words."""
    if value in DOT_SEGMENTS:
        return f"{value!r} is no id: {DOT_SEGMENT_REASON}"
    return "an id is 1-200 characters of A-Z, a-z, 0-9 and _ . : @ | -, not `.` or `..` alone"


Identifier = Annotated[
    str,
    StringConstraints(
        min_length=1, max_length=200, pattern=described_pattern(IDENTIFIER_PATTERN, _not_an_id)
    ),
]
"""Ids of conversations, users, turns and messages: 1-200 characters, no spaces or `$`, not
`.` or `..` (`IDENTIFIER_PATTERN`; a refusal says so in words, and for those two why:
`_not_an_id`). No Python validator: every stored message read validates four of them."""


def json_text(value: Any, *, non_finite: bool = False) -> str:
    """`value` as its JSON text, compact and unescaped: how a call's arguments are kept, and a
    native value BSON cannot hold as it is (`NativeForm.json_text`). With `non_finite`, NaN
    and the infinities are spelt as Python's `json` reads them back (`NaN`, `-Infinity`);
    else they are a ValueError. Raises TypeError, ValueError or RecursionError for a value
    that is no JSON."""
    return _JSON_TEXT[non_finite].encode(value)


_JSON_TEXT = {
    non_finite: json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=non_finite)
    for non_finite in (False, True)
}
"""`json_text`'s encoders, by `non_finite`: what `json.dumps` builds anew on every call given
options (the encoder keeps no state between calls)."""


def joined_text(text: str) -> str:
    """`text` with UTF-16 surrogate pairs joined into the characters they encode: the text BSON
    (UTF-8) holds. A JavaScript runtime that slices a string between the two halves of a
    character sends each half on its own; once concatenated they form a valid pair. Raises
    ValueError naming a half alone, which is no text and cannot be stored."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    except UnicodeDecodeError as exc:
        lone = next(c for c in text if "\ud800" <= c <= "\udfff")
        escape = lone.encode("unicode_escape").decode()
        raise ValueError(
            f"it holds a lone UTF-16 surrogate ({escape}), half of a character and no text: "
            "text must be valid Unicode"
        ) from exc


def _arguments_as_json_string(value: Any) -> Any:
    # NaN and the infinities as Python's `json` writes and reads them: a parser's dict of a
    # model's `{"rate": NaN}` is kept as the string holding it would be.
    if isinstance(value, dict | list):
        try:
            return json_text(value, non_finite=True)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"arguments must hold JSON values only: {exc}") from exc
    return value


_INT64_RANGE = range(-(2**63), 2**63)


def stored_number(value: int) -> int | float:
    """An integer as the store keeps it: itself within 64 bits (BSON's integers); past them,
    the double it spells, as its exact value or as the shortest digits that name it (what
    JavaScript writes for a double), so `10000000000000000000` and `1e+19` are one number
    however a JSON writer spells it. Other digits past 64 bits (`10000000000000000001`), and
    a number past every double, are themselves: refused where they are, since kept as the
    nearest double they would lose digits unsaid."""
    if value in _INT64_RANGE:
        return value
    try:
        nearest = float(value)
    except OverflowError:
        return value
    if int(nearest) == value or int(Decimal(repr(nearest))) == value:
        return nearest
    return value


def _wide_ints_as_doubles(value: Any) -> Any:
    """A JSON value with every integer past 64 bits as `stored_number` keeps it; the value
    itself when it holds none."""
    if type(value) is int:
        return stored_number(value)
    if isinstance(value, dict):
        items = {key: _wide_ints_as_doubles(item) for key, item in value.items()}
        return value if all(items[key] is item for key, item in value.items()) else items
    if isinstance(value, list):
        listed_ = [_wide_ints_as_doubles(item) for item in value]
        return value if all(a is b for a, b in zip(listed_, value, strict=True)) else listed_
    return value


class _UnheldValue(ValueError):
    """A JSON value holds what BSON would not give back as it is (`_unheld`, `read_as_dbref`),
    and nothing else that cannot be kept: `value` is the JSON value (a database reference read
    back as the object it was written as, `without_dbrefs`), `text` its JSON text
    (`json_text`), once `_native_value` spelt it."""

    value: Any = None
    text = ""


_UNHELD_VALUE = (
    "values must not hold an integer outside 64 bits, NaN or an infinity as it is, nor an "
    "object holding a text `$ref` and an `$id` (MongoDB reads it back as a database "
    "reference, a DBRef): a runtime's form keeps such a value as its JSON text (`json_text`)"
)


def _unheld(value: Any) -> bool:
    """Whether `value` is a number BSON cannot hold as it is: an integer outside 64 bits, or
    NaN or an infinity (a BSON double holds them, but JSON has no spelling of them)."""
    if type(value) is int:
        return value not in _INT64_RANGE
    return type(value) is float and not math.isfinite(value)


def read_as_dbref(value: Any) -> bool:
    """Whether BSON gives `value` back as a database reference (`bson.DBRef`), not as the
    object it is: an object holding a text `$ref` and an `$id` (and no `$db` but a text or
    null), as PyMongo's decoder reads every sub-document (`bson._get_object`). A JSON Schema
    may be one (`{"$id": "https://…", "$ref": "#/$defs/city"}`)."""
    return (
        isinstance(value, dict)
        and isinstance(value.get("$ref"), str)
        and "$id" in value
        and isinstance(value.get("$db"), str | None)
    )


def dbref_path(value: Any) -> tuple[str | int, ...] | None:
    """Where in a JSON value the first object BSON gives back as a database reference is
    (`read_as_dbref`), `()` for the value itself; None if nowhere. One walk, no recursion."""
    pending: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, dict):
            if read_as_dbref(item):
                return where
            pending += [((*where, key), item[key]) for key in reversed(item)]
        elif isinstance(item, list):
            pending += [((*where, i), item[i]) for i in reversed(range(len(item)))]
    return None


_STORED_DEPTH = 100
"""How deeply a stored document nests at most (MongoDB's bound)."""


def without_dbrefs(value: Any, depth: int = 0) -> Any:
    """`value` with each database reference the driver read back (`bson.DBRef`: an object
    stored by another app, or before the store kept or refused such objects) as the plain
    object it was written as (`DBRef.as_doc`: its `$ref`, `$id` and `$db` first, then its
    other keys in stored order; a `$db` stored null is lost, the driver drops it); `value`
    itself when it holds none. Stored values nest at most 100 levels (MongoDB's bound): a
    value deeper than that (one holding itself) was never read from the database and is left
    as it is, for its own refusal."""
    if depth > _STORED_DEPTH:
        return value
    if isinstance(value, DBRef):
        return without_dbrefs(dict(value.as_doc()), depth)
    if isinstance(value, dict):
        read = {key: without_dbrefs(item, depth + 1) for key, item in value.items()}
        return value if all(read[key] is item for key, item in value.items()) else read
    if isinstance(value, list):
        items = [without_dbrefs(item, depth + 1) for item in value]
        return value if all(map(operator.is_, items, value)) else items
    return value


def _check_tree(value: Any, *, unheld_sought: bool = False) -> bool:
    """One walk (level by level, without recursion) of a JSON value: ValueError if it nests
    deeper than `MAX_PARAMS_DEPTH` or has a key holding NUL; if sought, whether it holds what
    BSON would not give back as it is: a number it cannot hold as it is (`_unheld`), or an
    object it reads back as a database reference (`read_as_dbref`). Each value is visited
    once; such a value does not end the walk, so what cannot be kept at all is found wherever
    it is."""
    unheld = unheld_sought and _unheld(value)
    level: list[Any] = [value] if isinstance(value, dict | list) else []
    depth = 1
    while level:
        if depth > MAX_PARAMS_DEPTH:
            raise ValueError(f"values nest deeper than {MAX_PARAMS_DEPTH} levels")
        inner: list[Any] = []
        for item in level:
            children = item
            if isinstance(item, dict):
                if item and any(isinstance(key, str) and "\x00" in key for key in item):
                    raise ValueError("keys must not contain NUL characters")
                children = item.values()
                unheld = unheld or (unheld_sought and read_as_dbref(item))
            unheld = unheld or (unheld_sought and any(map(_unheld, children)))
            inner += [child for child in children if isinstance(child, dict | list)]
        level, depth = inner, depth + 1
    return unheld


_json_value: TypeAdapter[JsonValue] = TypeAdapter(JsonValue)


def _plain_json(value: Any, *, unheld_refused: bool = False) -> Any:
    """`value` as plain dicts and lists of JSON values: one walk for what pydantic does not
    check (`_check_tree`), then one validation, which copies it. A database reference the
    driver read back is the object it was written as (`without_dbrefs`, sought only when the
    validation refuses). If refused, what BSON would not give back as it is is an
    `_UnheldValue`, once nothing else is wrong with the value."""
    unheld = _check_tree(value, unheld_sought=unheld_refused)
    try:
        plain = _json_value.validate_python(value, strict=True)
    except ValidationError as exc:
        if (read := without_dbrefs(value)) is not value:
            return _plain_json(read, unheld_refused=unheld_refused)
        raise ValueError(f"values must be JSON values only ({exc.errors()[0]['msg']})") from exc
    if unheld:
        unheld_value = _UnheldValue(_UNHELD_VALUE)
        unheld_value.value = value
        raise unheld_value
    return plain  # plain dicts and lists, whatever mappings the caller passed


@dataclass(frozen=True)
class AbsentBefore:
    """A field's mark (`Annotated[..., AbsentBefore("0.2.0")]`): documents stored before
    `version` lack its key, which the store reads as the field's default. The stored contract
    (scripts/contract.py: schemas/stored, the TypeScript declarations) does not require the
    key; the API serves it always."""

    version: str


_set = object.__setattr__
"""How `_Model.replacing` sets a frozen copy's slots (looked up once)."""


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        frozen=True,
        use_attribute_docstrings=True,
        # Every key is in every stored document and served object, defaults included.
        json_schema_serialization_defaults_required=True,
    )

    def replacing(self, update: Mapping[str, Any]) -> Self:
        """A copy with the fields of `update` replaced by values already valid for them:
        `model_copy(update=...)` without its generic copying, for the copy the store
        makes of every message it writes. The models hold no extra or private values."""
        copy = object.__new__(self.__class__)
        _set(copy, "__dict__", {**self.__dict__, **update})
        _set(copy, "__pydantic_fields_set__", self.__pydantic_fields_set__.union(update))
        _set(copy, "__pydantic_extra__", None)
        _set(copy, "__pydantic_private__", None)
        return copy


MAX_NAME_CHARS = 256
"""The longest tool name and prompt action: copied onto the conversation document (its pending
calls, its pending prompt) and never cut, they are bounded instead."""

BoundedName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS)]
"""A tool's name or a prompt's action: 1 to `MAX_NAME_CHARS` characters."""

HitlParams = Annotated[
    dict[str, Any], AfterValidator(_plain_json), AfterValidator(_wide_ints_as_doubles)
]
"""A prompt's params: plain JSON values, nested at most `MAX_PARAMS_DEPTH` levels, an integer
past 64 bits kept as the double nearest it (`stored_number`)."""


class FunctionCall(_Model):
    """The function an assistant asks to call."""

    name: BoundedName
    """The tool's name."""
    arguments: Annotated[
        str,
        BeforeValidator(
            _arguments_as_json_string, json_schema_input_type=str | dict[str, Any] | list[Any]
        ),
    ] = "{}"
    """The arguments as a JSON string; a dict is accepted and serialized (NaN and the
    infinities spelt `NaN`, `Infinity`, `-Infinity`, as Python's `json` reads them back).

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

    action: BoundedName
    params: HitlParams = Field(default_factory=dict)
    """Plain JSON values, nested at most `MAX_PARAMS_DEPTH` levels. A turn's prompt holding
    an object with a text `$ref` beside an `$id` (MongoDB reads it back as a database
    reference, a DBRef) is refused; one stored so before is read back as that object."""
    request_id: Annotated[str, StringConstraints(min_length=1, max_length=200)]
    tool_call_ids: (
        Annotated[
            list[Annotated[str, StringConstraints(min_length=1, max_length=200)]],
            Field(max_length=MAX_HELD_CALLS),
        ]
        | None
    ) = None
    """The calls this prompt holds back, by their ids: of its turn, made before it, or else
    the latest pending call of each id of an earlier turn; a later prompt naming one holds
    it instead. None: the calls before it in its turn that no prompt holds, as before."""


class MessageError(_Model):
    """An error the runtime reported instead of an answer."""

    message: str


class FileUpload(_Model):
    """A file the user uploaded with a message."""

    filename: Annotated[str, StringConstraints(max_length=1024)]
    file_type: Annotated[str, StringConstraints(max_length=255)]
    """A media type (RFC 6838 bounds its two names at 127 characters each)."""
    size: Count
    parsed_text: str | None = None


class TokenUsage(_Model):
    """Tokens one model response used."""

    input_tokens: Count = 0
    output_tokens: Count = 0


_SHA256_HEX = described_pattern("^[0-9a-f]{64}$", "a SHA-256 digest is 64 lowercase hex digits")


class Truncation(_Model):
    """Where a text cut to bound its message is kept whole (extension)."""

    length: Count
    """The text's original length, in characters."""
    blob_id: str | None = None
    """The GridFS file (bucket `agent_message_blobs`) holding the whole text; None when it
    was not kept (`search_text`, which is derived from the other fields)."""
    sha256: Annotated[
        Annotated[str, StringConstraints(pattern=_SHA256_HEX)] | None, AbsentBefore("0.2.0")
    ] = None
    """The SHA-256 of the whole text as the file holds it (UTF-8), in hex: the message's
    content digest covers the whole text, not only the part kept. None when the text was
    not kept, or was cut before the store recorded it."""


def _native_keys(value: dict[str, Any]) -> dict[str, Any]:
    refused = [key for key in value if key.startswith("$")]
    if refused:
        raise ValueError(f"native keys must not start with `$`: {listed(refused, shown_key)}")
    return value


def lone_surrogate(value: Any) -> tuple[tuple[str | int, ...], str] | None:
    """Where in a JSON value the first text holding a UTF-16 surrogate alone is (`joined_text`:
    a pair split in two is no such text), keys too, and what is wrong; None if nowhere. One
    walk without recursion; a text is encoded only when it is not ASCII. It goes no deeper
    than a value may nest (deeper is refused for that), so a value holding itself ends."""
    pending: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while pending:
        where, item = pending.pop()
        if len(where) > MAX_PARAMS_DEPTH + 2:
            continue
        if isinstance(item, str):
            refusal = _text_refusal(item)
            if refusal is not None:
                return where, refusal
        elif isinstance(item, dict):
            for key in item:
                refusal = _text_refusal(key) if isinstance(key, str) else None
                if refusal is not None:
                    return where, f"a key {refusal.removeprefix('it ')}"
            pending += [((*where, key), item[key]) for key in reversed(item)]
        elif isinstance(item, list):
            pending += [((*where, i), item[i]) for i in reversed(range(len(item)))]
    return None


def _text_refusal(text: str) -> str | None:
    if text.isascii():
        return None
    try:
        joined_text(text)
    except ValueError as exc:
        return str(exc)
    return None


def _refuse_lone_surrogate(value: Any) -> None:
    """ValidationError naming the path, within the value, of a text that is no text."""
    if (found := lone_surrogate(value)) is not None:
        where, refusal = found
        error = PydanticCustomError("lone_surrogate", "{refusal}", {"refusal": refusal})
        details = InitErrorDetails(type=error, loc=where, input=value)
        raise ValidationError.from_exception_data("NativeValue", [details])


def _native_value(value: Any) -> Any:
    # What BSON would not give back as it is is refused here, before any write (HITL params
    # are walked for the same reason when a turn is planned); `NativeForm.keeping` keeps it,
    # as the JSON text spelt here: an integer with more digits than Python spells is refused.
    # A text holding a half of a character alone is refused first, by its path in the value,
    # whether or not the value would be kept as JSON text (which could only name the key).
    try:
        plain = _plain_json(value, unheld_refused=True)
    except _UnheldValue as unheld:
        _refuse_lone_surrogate(unheld.value)
        try:
            unheld.text = json_text(unheld.value, non_finite=True)
        except ValueError as exc:
            raise ValueError(
                f"values must not hold an integer too long for JSON text ({exc})"
            ) from exc
        raise
    _refuse_lone_surrogate(plain)
    return plain


_NO_JSON = object()


def _json_text_refusal(value: Any) -> str | None:
    """What is wrong with `value` as the JSON text of a native value (`NativeForm.json_text`),
    None if nothing: it is what `NativeForm.keeping` writes, JSON text spelling a value that
    passes the checks of a value of `set` but for what BSON would not give back as it is,
    holding at most `MAX_JSON_VALUES` values as a body may (counted before it is parsed)."""
    if isinstance(value, str) and json_values_past(value):
        return f"holds more than {MAX_JSON_VALUES} JSON values, more than the store walks"
    try:
        spelt = json.loads(value) if isinstance(value, str) else _NO_JSON
    except (ValueError, RecursionError):
        spelt = _NO_JSON
    if spelt is _NO_JSON:
        return "is no JSON text"
    try:
        _plain_json(spelt, unheld_refused=True)
    except _UnheldValue:
        # Its strings, keys too, as a value's (`lone_surrogate`): an escape of a half alone
        # spells no text.
        found = lone_surrogate(spelt)
        return None if found is None else f"spells one that cannot be kept: {found[1]}"
    except ValueError as exc:
        return f"spells one that cannot be kept: {exc}"
    return (
        "holds no number BSON cannot hold as it is, nor an object it reads back as a "
        "database reference: keep the value itself"
    )


NativeValue = Annotated[Any, AfterValidator(_native_value)]
"""A value of `NativeForm.set`: plain JSON, nested at most `MAX_PARAMS_DEPTH` levels, holding
no number BSON cannot hold as it is. One value at a time, so a refusal names its key."""


class NativeForm(_Model):
    """A runtime's own form of a message, kept as its difference from the form the message's
    chat fields rebuild (extension), so that runtime gets back exactly what it stored.

    The runtime's form is the rebuilt one with `set` applied and the keys in `unset`
    removed. An item the chat format has no place for (an Agents SDK reasoning item, a
    web search or computer-use call) is an assistant message with no content whose `set`
    holds the whole item; only the runtime named by `format` is given it back.
    """

    format: Annotated[str, StringConstraints(min_length=1, max_length=100)]
    """Whose form: `openai-agents` (an Agents SDK item), `langchain` (a LangChain message) or
    `pydantic-ai` (a response's several texts as content parts, its parts' order with the
    parts the chat fields cannot hold; a system prompt's fields beyond its text; whether a
    tool result's or retry feedback's content was a `str` or a value, a tool's kind)."""
    set: Annotated[dict[str, NativeValue], AfterValidator(_native_keys)] = Field(
        default_factory=dict
    )
    """Top-level keys whose values the rebuilt form lacks or holds otherwise; plain JSON."""
    unset: list[str] = Field(default_factory=list)
    """Keys of the rebuilt form that the runtime's form does not have."""
    json_text: Annotated[list[str], AbsentBefore("0.2.0")] = Field(default_factory=list)
    """Keys of `set` whose value is kept as its JSON text, as a call's arguments are: a value
    holding, at any depth, what BSON would not give back as it is: a number it cannot hold
    as it is (an integer outside 64 bits, NaN or an infinity, spelt `NaN`, `Infinity`,
    `-Infinity`), or an object it reads back as a database reference (a text `$ref` beside
    an `$id`, as a JSON Schema may hold). The runtime is given the value
    the text spells (`set_values`), the one it stored."""

    @model_validator(mode="wrap")
    @classmethod
    def _stored_dbrefs_as_json_text(
        cls, data: Any, handler: ModelWrapValidatorHandler[Self]
    ) -> Self:
        """A value stored holding such an object as it is (by another app, or before the store
        kept them as text), which the driver read back as a database reference, is read as
        the JSON text of the object it was written as: as the store keeps one now. Sought
        only when the form as read is refused."""
        try:
            return handler(data)
        except ValidationError:
            read = _stored_dbrefs_kept(data)
            if read is None:
                raise
            return handler(read)

    @model_validator(mode="after")
    def _json_text_is_json_text(self) -> Self:
        if len(set(self.json_text)) != len(self.json_text):
            raise ValueError("json_text must not name a key twice")
        for key in self.json_text:
            if refusal := _json_text_refusal(self.set.get(key)):
                raise ValueError(f"json_text names {shown_key(key)}, whose value {refusal}")
        return self

    @classmethod
    def keeping(
        cls, format: str, changed: Mapping[str, Any], removed: Iterable[str] = ()
    ) -> NativeForm:
        """The form of a runtime's values `changed` and keys `removed`: each value holding a
        number BSON cannot hold as it is kept as its JSON text (`json_text`), so the runtime
        gets it back as it was. Raises ValidationError for what cannot be kept."""
        kept, texts = cls.kept_values(changed)
        return cls(format=format, set=kept, unset=list(removed), json_text=texts)

    @staticmethod
    def kept_values(changed: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """The values of `set` that keep `changed`, and the keys of `json_text`: each value
        holding a number BSON cannot hold as it is (and nothing else that cannot be kept) as
        its JSON text; any other value as it is, for validation to keep or refuse."""
        kept, texts = dict(changed), []
        for key, value in changed.items():
            try:
                _native_value(value)
            except _UnheldValue as unheld:
                kept[key] = unheld.text
                texts.append(key)
            except ValueError:
                pass  # refused by validation, as it is, naming what cannot be kept
        return kept, texts

    def set_values(self) -> dict[str, Any]:
        """`set` as the runtime gave it: each key of `json_text` as the value its text spells."""
        return {**self.set, **{key: json.loads(self.set[key]) for key in self.json_text}}


def _stored_dbrefs_kept(data: Any) -> dict[str, Any] | None:
    """A stored native form (`data`) with each value of `set` that holds a database reference
    the driver read back kept as the JSON text of the plain value (`without_dbrefs`), as
    `NativeForm.keeping` keeps one; None when no value holds one (or one is no JSON)."""
    values = data.get("set") if isinstance(data, Mapping) else None
    if not isinstance(values, Mapping):
        return None
    kept, texts = dict(values), list(data.get("json_text") or ())
    for key, value in values.items():
        if (read := without_dbrefs(value)) is value:
            continue
        try:
            kept[key] = json_text(read)
        except (TypeError, ValueError, RecursionError):
            return None  # no JSON: refused as it was read
        texts.append(key)
    return None if kept == values else {**data, "set": kept, "json_text": texts}


def _only_null(schema: JsonSchemaValue, role: str) -> JsonSchemaValue:
    described: dict[str, Any] = {k: schema[k] for k in ("title", "description") if k in schema}
    return {**described, "type": "null", "description": f"Always `null` when `role` is `{role}`."}


def _never_null(schema: JsonSchemaValue) -> JsonSchemaValue:
    kept = [s for s in schema["anyOf"] if s != {"type": "null"}]
    (value,) = kept
    described: dict[str, Any] = {k: schema[k] for k in ("title", "description") if k in schema}
    return {**value, **described}


class _MessageBase(_Model):
    """Every field of the message interface, on every role.

    Each role's model forbids the fields that make no sense for it, so every
    stored document has the same keys and absent values are `null`.
    """

    forbidden_fields: ClassVar[tuple[str, ...]] = ()

    id: Identifier | None = Field(default=None, alias="_id")
    """Stable message id (extension), derived by the store from the turn: never a caller's."""
    conversation_id: Identifier | None = None
    """The conversation this message belongs to. Set by the logger."""
    role: Role
    content: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    """At most 1,000 (`MAX_TOOL_CALLS`)."""
    tool_call_id: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = None
    hitl_action: HitlAction | None = None
    error: MessageError | None = None
    upload: FileUpload | None = None
    created_at: UtcDatetime = Field(default_factory=utc_now)
    token_usage: TokenUsage | None = None
    latency_ms: Count | None = None
    seq: Count | None = None
    """Position in the conversation (extension). Assigned by the logger."""
    user_id: Identifier | None = None
    """The conversation's owner, denormalized (extension). Set by the logger."""
    turn_id: Identifier | None = None
    """The turn that logged this message (extension). Set by the logger."""
    search_text: str | None = None
    """Text extracted at write time for full-text search (extension)."""
    truncated: dict[str, Truncation | Count] | None = None
    """Fields cut to keep the document bounded, by path, with where each is kept whole
    (extension). A bare number is the older shape: the original length, not kept whole."""
    native: NativeForm | None = None
    """The runtime's own form of the message where the chat fields cannot rebuild it
    (extension; see `NativeForm`)."""
    epoch: str | None = Field(default=None, exclude=True)
    """The `epoch` of the conversation that stored it (the store's bookkeeping, never served;
    absent on messages stored before it was recorded): tells its messages from those of a
    conversation created again under the id."""
    copy_owed: bool = Field(default=False, exclude=True)
    """Stored by a logger whose observers copy every turn elsewhere (the legacy dual write
    on: `CopyingObserver`), in the insert that stores the message (the store's bookkeeping,
    never served; absent otherwise): its turn owes that copy, so a turn whose copy and
    record of it were never written is told from one logged with the dual write off."""

    assigned_by_store: ClassVar[tuple[str, ...]] = ("id", "conversation_id", "seq", "turn_id")
    """Set on every stored and served message; null only in what a caller sends."""

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The role's forbidden fields are `null`; served, the store's fields are never null."""
        schema = handler(core_schema)
        properties = handler.resolve_ref_schema(schema)["properties"]
        key = {name: field.alias or name for name, field in cls.model_fields.items()}
        role = cls.model_fields["role"].default
        for name in cls.forbidden_fields:
            properties[key[name]] = _only_null(properties[key[name]], role)
        if handler.mode == "serialization":
            for name in cls.assigned_by_store:
                properties[key[name]] = _never_null(properties[key[name]])
        return schema

    @model_validator(mode="after")
    def _role_fields(self) -> _MessageBase:
        # One validator per message, its role's own rules after the forbidden fields: a
        # Python call per validator is much of what validating a stored message costs.
        values = self.__dict__
        for field in self.forbidden_fields:
            if values[field] is not None:
                raise ValueError(f"`{field}` is not allowed on a {self.role} message")
        self._check_role()
        return self

    def _check_role(self) -> None:
        """What a message of the role needs besides leaving its forbidden fields null."""


class SystemMessage(_MessageBase):
    """A system prompt or a system-triggered turn."""

    forbidden_fields = ("tool_calls", "tool_call_id", "hitl_action", "token_usage")
    role: Literal["system"] = "system"


class UserMessage(_MessageBase):
    """What the user typed or uploaded."""

    forbidden_fields = ("tool_calls", "tool_call_id", "hitl_action", "token_usage")
    role: Literal["user"] = "user"

    def _check_role(self) -> None:
        if self.content is None and self.upload is None and self.error is None:
            raise ValueError("a user message needs `content` or an `upload`")


_SHOWN_IDS = 10
"""How many repeated tool call ids an error names: the first, in order."""


class AssistantMessage(_MessageBase):
    """A model response: text, tool calls, a HITL prompt or an error."""

    forbidden_fields = ("tool_call_id", "upload")
    role: Literal["assistant"] = "assistant"

    def _check_role(self) -> None:
        if self.tool_calls is not None:
            self._calls_are_distinct(self.tool_calls)
        if (
            self.content is None
            and self.tool_calls is None
            and self.hitl_action is None
            and self.error is None
            and self.native is None
            and "native" not in (self.truncated or {})  # kept whole aside: still the message
        ):
            raise ValueError(
                "an assistant message needs `content`, `tool_calls`, `hitl_action`, `error` "
                "or `native`"
            )

    @staticmethod
    def _calls_are_distinct(calls: list[ToolCall]) -> None:
        if not calls:
            raise ValueError("`tool_calls` must be null or hold at least one call")
        if len({call.id for call in calls}) == len(calls):
            return  # a set, not a Counter: this runs for every message read that makes calls
        repeated = sorted(i for i, n in Counter(call.id for call in calls).items() if n > 1)
        shown_ids = ", ".join(shown(i) for i in repeated[:_SHOWN_IDS])
        if len(repeated) > _SHOWN_IDS:
            shown_ids += f" and {len(repeated) - _SHOWN_IDS} more"
        raise ValueError(f"tool call ids repeat within one message: {shown_ids}")


class ToolMessage(_MessageBase):
    """The result of one tool call, answering it by `tool_call_id`."""

    forbidden_fields = ("tool_calls", "hitl_action", "token_usage", "upload")
    role: Literal["tool"] = "tool"

    def _check_role(self) -> None:
        if self.tool_call_id is None:
            raise ValueError("a tool message needs `tool_call_id`, the id of the call it answers")


AgentMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]
"""Any message, told apart by `role`."""

message_adapter: TypeAdapter[AgentMessage] = TypeAdapter(AgentMessage)
messages_adapter: TypeAdapter[list[AgentMessage]] = TypeAdapter(list[AgentMessage])


PendingHitlField = Literal["params", "prompt"]
"""A field of a pending prompt that its message's bound can cut."""


class PendingHitl(_Model):
    """The unresolved HITL prompt of a conversation (extension)."""

    request_id: str
    action: str
    params: Annotated[dict[str, Any], BeforeValidator(without_dbrefs)] = Field(default_factory=dict)
    prompt: str | None = None
    """The assistant's text that asked the question."""
    message_id: str
    """The assistant message that raised it."""
    created_at: UtcDatetime
    truncated: list[PendingHitlField] | None = None
    """The fields served cut, as their message was cut to bound it (its `truncated` map): the
    conversation's copy keeps them cut; `ConversationStore.pending_hitl` reads them back whole
    (and lists here only a field whose whole text is not found)."""


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
    """The HITL prompt that holds the call back: the first one its turn raised after it (or a
    later one naming it). Once a person resolved that prompt by request id (`resolve_hitl`:
    its id is then among the conversation's `resolved_hitl`), the call awaits its result and
    the store serves null here."""
    created_at: UtcDatetime
    """When the call was made."""
    seq: Count | None = None
    """The `seq` of the message that made the call, which orders the list as the calls were
    made (the store's bookkeeping: null on a call listed before it was recorded)."""


HOLDING_PROMPTS_KEPT = 20
"""How many earlier prompts holding an approved call again an approval remembers
(`ApprovedCall.held_before`)."""


class ApprovedCall(_Model):
    """A call a person's answer released (`ConversationStore.resolve_hitl` of the prompt
    holding it): it awaits its result, and a denial of it is refused, whatever becomes of
    its prompt's request id (the store's bookkeeping, never served)."""

    tool_call_id: str
    message_id: str
    """The assistant message that made the call."""
    request_id: str | None = None
    """The prompt whose answer released the call (None in approvals recorded without it): a
    refusal of that prompt arriving later denies nothing, even once another prompt holds
    the call."""
    held_by: str | None = None
    """The latest prompt (its message id) that named the call: it holds the call until it is
    answered itself. A pop removing that prompt, or a fork cut before it, hands the call to
    the latest of `held_before` the conversation (or fork) keeps, or, with none, puts the
    approval back in force."""
    held_before: list[str] = []
    """The earlier prompts (their message ids, oldest first, the newest
    `HOLDING_PROMPTS_KEPT`) that named the call after this approval and before `held_by`
    did: each asked about it again, unanswered, so once the later ones are popped or left
    out of a fork the latest of them holds the call again."""
    held_again: bool = False
    """Read from approvals stored before `held_by`: a later prompt, not told which, named the
    call and holds it until it is answered itself."""
    superseded_by: str | None = None
    """The assistant message (its id) of the first later call reusing the call's id, once a
    turn makes one: a denial of the id no longer pending answers the latest call of the id,
    which this approval did not release. A pop removing that message, or a fork cut before
    it, leaves the approved call the latest of its id again."""
    landed_after: str | None = None
    """A prompt (its message id) naming the call whose turn's insert landed only after this
    approval was given, though stored below the answer's reach (a writer stalled past
    `abandon_after`, its block passed empty meanwhile): it did not hold the call when the
    answer came, so the approval stays where the stored order puts that prompt between the
    one the answer was for and the answer."""


def approval_held_again(approval: Mapping[str, Any]) -> bool:
    """Whether a later prompt holds the call of a stored `approved_calls` entry
    (`ApprovedCall`): its approval is not in force until that prompt is answered."""
    return approval.get("held_by") is not None or bool(approval.get("held_again"))


def awaiting_results(
    calls: Iterable[Any], resolved: Collection[str], approved: Iterable[Any] = ()
) -> list[Any]:
    """Stored `pending_calls` as served: a call a person's answer released (`approved`: the
    conversation's `approved_calls`), or whose prompt a person resolved by request id
    (`resolved`: its `resolved_hitl`), is held back no more, so a later answer to that prompt
    (a second tab, a replayed event) denies nothing."""
    released = {
        (a.get("tool_call_id"), a.get("message_id"))
        for a in approved
        if isinstance(a, Mapping) and not approval_held_again(a)
    }

    def unheld(call: Mapping[str, Any]) -> bool:
        key = (call.get("tool_call_id"), call.get("message_id"))
        return call.get("request_id") in resolved or key in released

    return [
        {**call, "request_id": None} if isinstance(call, Mapping) and unheld(call) else call
        for call in calls
    ]


class Usage(_Model):
    """Token usage summed over a conversation (extension); each sum stops at 2**53 - 1."""

    input_tokens: Count = 0
    output_tokens: Count = 0

    @classmethod
    def total(cls, inputs: Iterable[int], outputs: Iterable[int]) -> Usage:
        """The counts added up, each sum stopping at 2**53 - 1 as the stored sums do."""
        return cls(
            input_tokens=min(sum(inputs), MAX_SAFE_INTEGER),
            output_tokens=min(sum(outputs), MAX_SAFE_INTEGER),
        )


_FLAGS = ("p", "g", "m", "u")
"""The stored keys of a turn record's flags (`TurnRecord`): False when lacking or null."""


class TurnRecord(_Model):
    """One logged turn, kept on its conversation so a retry of any age is recognised
    (extension; the store's bookkeeping, never served). Short keys keep it small.

    A record holding null for a flag (`p`, `g`, `m`, `u`) says False, as one lacking it does:
    an earlier release rewrote the records the migration rebuilt (which hold none of the
    fields records said since) with null in each field they lacked."""

    @model_validator(mode="before")
    @classmethod
    def _null_flags_unset(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or not any(data.get(k, False) is None for k in _FLAGS):
            return data
        return {k: v for k, v in data.items() if not (k in _FLAGS and v is None)}

    key: int = Field(alias="k")
    """A 64-bit digest of the turn id."""
    first_seq: Count = Field(alias="f")
    """The first `seq` the turn reserved: its block is the `seqs` from it."""
    digest: int = Field(alias="d")
    """A 64-bit digest of the turn's messages (timestamps aside): a replay must match it."""
    at: UtcDatetime = Field(alias="a")
    """When the turn was reserved."""
    popped: bool = Field(default=False, alias="p")
    """A pop removed one of its messages: a retry of the turn is refused, never replayed."""
    given_up: bool = Field(default=False, alias="g")
    """A retry gave the turn up for good, none of its messages stored: what its reservation
    counted (its turns, its tokens) was taken back then, once."""
    order: int | None = Field(default=None, alias="o")
    """How many records the conversation appended before this one (those dropped since
    included): the records' order, by which the kept ones are chosen (`TurnRules.
    turns_recorded`). None on a record kept before records said so."""
    moved: bool = Field(default=False, alias="m")
    """The record names the turn no more (its key `moved_key`): it only marks a block the turn
    left by moving to a new one, or gave back. Such records are kept apart from the turns'
    own: they never push a turn's record out of the `TurnRules.turns_recorded` kept (False
    on a record kept before records said so, which counts as a turn's)."""
    seqs: Count | None = Field(default=None, alias="l")
    """How many `seq`s the turn reserved from `first_seq`: its block, known exactly whatever
    records the window dropped (`TurnRules.turns_recorded` keeps the records non-contiguous:
    a record a move left between two turns' records may be dropped while they are kept).
    None on a record kept before records said so: its block runs to the next record's
    `first_seq` (`_reservation.recorded_block`)."""
    by_person: bool = Field(default=False, alias="u")
    """A user token logged the turn (a person's, `owner_only`): no runtime opens a steering
    inbox under its id (`SteeringInbox.open_turn`). False for a service's turn, and for one
    recorded before records said so."""
    counted: Count | tuple[Count, Count, Count] | None = Field(default=None, alias="c")
    """What the turn's reservation counted: its turn starts, input and output tokens (given
    back with its block when a retry of other content finds the block empty and abandoned),
    packed into one integer when each fits (starts below 2**8 in the low bits, then each
    count below 2**22: at most 2**52), else the three. None on a record kept before records
    said so."""
    opens_calls: bool | None = Field(default=None, alias="h")
    """Whether the turn leaves calls open (pending until a later turn answers them): only
    such a turn, still being written, may have lost a call to the bound of `pending_calls`
    (`CallsPushedOff`). None on a record kept before records said so."""
    named: dict[str, str | None] | None = Field(default=None, alias="n")
    """The runtime name its reservation set (`t`) and the name it replaced (`b`, its
    `name_source` `s` and `name_message_id` `m`), restored when the turn is stored nowhere
    while the name is still the one it set. None for a turn that set no runtime name."""


class PendingBlock(_Model):
    """The block of a turn whose reservation listed pending state (calls it leaves open, a
    prompt it raises), kept on its conversation until a later turn's reservation finds it
    passed (extension; the store's bookkeeping, never served)."""

    first_seq: Count = Field(alias="f")
    """The block's first `seq`."""
    seqs: Count = Field(alias="l")
    """How many `seq`s the block holds."""
    at: UtcDatetime = Field(alias="a")
    """When the turn reserved it."""
    passed: bool = Field(default=False, alias="d")
    """The last reservation found it older than `TurnRules.abandon_after`: that turn looks
    whether it holds a message, and the next reservation drops it."""
    watched: UtcDatetime | None = Field(default=None, alias="w")
    """When a fold found it passed and holding no message: its turn's insert may still land
    (a writer stalled inside it), so every later turn and read of the summary looks whether
    one did and folds it in, for a day at most; null while never found so."""
    calls: list[CallUnlanded] | None = Field(default=None, alias="c")
    """The calls its turn's reservation listed pending that the fold watching it took off
    `pending_calls` (`watched`; their messages not stored): while it is watched, an answer
    naming one as `pending_calls` served it is told to come again, its turn may still be
    logged, never refused as naming a message that makes no call. Null while not watched,
    and on a block watched before blocks said so."""
    taken: list[CallTaken] | None = Field(default=None, alias="t")
    """The calls its turn's reservation listed pending that an answering turn's reservation
    took off `pending_calls` since (`pending_calls` made there, `seq` in the block): while
    the block is not found stored, that answer may be all that lists them no more, so the
    fold that finds it passed and empty waits for them too (`calls`), and the answering
    turn that passes it waits for its turn to land. Null while none was."""


class CallTaken(_Model):
    """A call made in a block listing pending state that an answering turn's reservation took
    off `pending_calls` (`PendingBlock.taken`; extension, the store's bookkeeping, never
    served)."""

    tool_call_id: str = Field(alias="c")
    """The call's id."""
    message_id: str = Field(alias="m")
    """The message that makes it, as `pending_calls` listed it."""
    turn_key: int = Field(alias="k")
    """The key of the turn whose reservation took it off (`TurnRecord.key`)."""


class CallUnlanded(_Model):
    """A call a turn's reservation listed pending whose message is not stored: its block was
    passed empty and the fold took it off `pending_calls` (`PendingBlock.calls`; extension,
    the store's bookkeeping, never served)."""

    tool_call_id: str = Field(alias="c")
    """The call's id."""
    message_id: str = Field(alias="m")
    """The message that makes it, as `pending_calls` served it."""


class CallRelisted(_Model):
    """A pending call a fold of the pending state listed again, off the list as it read the
    conversation: the block of the turn that answered it was passed as abandoned, and that
    turn's insert may still have landed (extension; the store's bookkeeping, never served).
    An answer to it looks first whether one did."""

    tool_call_id: str = Field(alias="c")
    """The call's id."""
    message_id: str = Field(alias="m")
    """The message that made it."""


class CallsPushedOff(_Model):
    """The newest call the bound of a conversation's `pending_calls` (the newest
    `PENDING_CALLS_KEPT`) pushed off in this life, and the ids of the newest it pushed off
    (extension; the store's bookkeeping, never served): set by the update that pushed it off
    (a turn's reservation, or its move to a new block), so an answer to a call off the list
    that a turn still being written may have made and left open is told from one to a call
    no message makes."""

    order: Count = Field(alias="o")
    """How many turn records the conversation appended before that update: every turn
    reserved before it has a lower `TurnRecord.order`."""
    seq: Count | None = Field(default=None, alias="s")
    """The `seq` of the message that made the call (None for a call listed before the list
    recorded it, `PendingCall.seq`: every `seq` then)."""
    call_ids: list[str] | None = Field(default=None, alias="i")
    """The ids of the calls the bound pushed off in this life, oldest first, the newest
    `PENDING_CALLS_KEPT` of them (appended by each update pushing calls off; a turn leaving
    more calls open than the list keeps names its own it never listed, from its plan): only
    an answer to one of these may answer a call a turn still being written lost to the
    bound. A call pushed off before that many more were is no longer named, and an answer
    to it is refused as one to a call no message makes. None on a mark set before marks
    named them: no call is taken as pushed off there."""


class PoppedMessage(_Model):
    """A message a pop removed, kept on its conversation (extension; the store's bookkeeping,
    never served) so that a tail reader whose `after` names it reads on from its `seq`, and
    the retry of a pop in doubt knows this conversation removed it."""

    seq: Count = Field(alias="s")
    message_id: str = Field(alias="i")
    pop_id: str | None = Field(default=None, alias="p")
    """The pop that removed it (`PopInProgress.pop_id`); None on entries kept before it was
    recorded."""


class PopInProgress(_Model):
    """A pop of a conversation's last message under way (extension; the store's bookkeeping,
    never served): the message it removes and what removing it changes in the summary, so
    that any later pop can finish it after a crash or a lost reply."""

    message_id: str
    seq: Count
    epoch: str | None = None
    """The message's `epoch`: its late delete takes nothing of a conversation started again
    under the id (the same message ids)."""
    pop_id: str | None = None
    """A random token of this pop, kept with the message in `popped_messages`: the retry of a
    pop in doubt answers the message only if this pop removed it, not another one."""
    turn_key: int | None = None
    """The key of the message's turn record (`TurnRecord.key`), marked popped."""
    role: Role
    input_tokens: Count = 0
    output_tokens: Count = 0
    started_turn: bool = False
    """The message started a turn: `turn_count` loses one."""
    preview: str | None = None
    """The preview without the message; None keeps the current one."""
    updated_at: UtcDatetime | None = None
    """The latest time of the messages that remain, whatever their `seq` order (the
    conversation's `created_at` when none does): `updated_at` without the message, never
    before `created_at`. None keeps the current one."""
    quoted: str | None = None
    """The preview the message itself gives: a preview still quoting it is replaced, even
    after a turn reserved past it (a turn without text sets none of its own)."""
    made_calls: bool = False
    answered_call: str | None = None
    """The call a `tool` message answered."""
    hitl_request_id: str | None = None
    """The prompt the message raised."""
    pending_before: list[PendingCall] | None = None
    """The calls the messages before it leave pending, when removing it needs them."""
    prompt_back: PendingHitl | None = None
    """For an answer or an upload: the prompt the messages before it leave pending, pending
    again if the message cleared it (none is pending, no turn reserved past the message, and
    it was not resolved by request id)."""
    withdrawn_approvals: list[tuple[str, str, str]] = []
    """The `approved_calls` (call id, message id, request id) that the messages before it,
    with the answers a person gave, give none of: removed with it, as a fork of all that
    remains leaves them out (read when `pending_before` is)."""
    answers_read: list[dict[str, Any]] | None = None
    """The `answered_prompts` the pop read with the messages before it, when it read them all
    (none missing): while they are unchanged and no turn reserved past the message, what
    those messages and answers leave replaces the conversation's pending calls, approvals
    and resolutions (`pending_before`, `approvals_left`, `resolved_left`), as a fork of all
    that remains leaves them."""
    approvals_left: list[dict[str, Any]] | None = None
    """The `approved_calls` as read that those messages and answers keep, as stored."""
    resolved_left: list[str] | None = None
    """The `resolved_hitl` those messages and answers leave."""
    named: str | None = None
    """The automatic name the message itself gives (a user message's text): a name taken
    from it before the conversation recorded its message (`Conversation.name_message_id`
    absent) is taken back when it is this one."""
    left_none: bool = False
    """No message is left before it, none being written there either: an automatic name is
    taken back with it, whatever message it was taken from (one never stored among them)."""


class ForkOrigin(_Model):
    """Where a forked conversation came from (extension)."""

    conversation_id: str
    seq: Count
    """The last `seq` of the original the fork copied."""
    turn_starts: list[Count] = Field(default_factory=list)
    """The fork's `seq`s where a turn of the original began, after the first: its copies are
    one turn, and what they leave pending is folded turn by turn as the original logged them
    (by a pop or a fork of the fork too)."""
    version: str | None = None
    """The original's `version` as the fork read it (`Conversation.version`, its `ETag`; null
    on a fork made before it was recorded): it names the life of the original the fork
    copied, which no conversation started again under its id shares (copies keep their
    original's times, so two lives copied from one conversation start alike)."""


class ForkCheck(_Model):
    """The source a fork copied, as the fork read it (extension; the store's bookkeeping, never
    served): kept on the fork's conversation from its creation until the fork's check of that
    source passed, so that a retry of the fork, finding it, checks the source again and takes
    the fork back when the source went (`AgentMessageLogger.fork`)."""

    epoch: str | None = None
    """The source's `epoch` as read (None: stored before epochs)."""
    created_at: UtcDatetime | None = None
    """The source's `created_at` as read: it tells the source when it had no `epoch`."""
    pops: Count | None = None
    """How many pops the source had finished as read (`Conversation.pops`): its check tells
    the pops since by it (None: a fork made before it was recorded, checked for none)."""
    taking_back: bool = False
    """A take-back of the fork has begun: the fork no longer stands, whatever a check finds."""


RESOLVED_PROMPTS_KEPT = 100
"""How many resolutions by request id a conversation remembers (`resolved_hitl`)."""


VERSION_LABEL = b"agent-store conversation version 1"
"""What a conversation's version hashes besides its id and epoch: the version names the
conversation and no other value of the store."""


def conversation_version(conversation_id: str, epoch: str | None, created_at: datetime) -> str:
    """The version of the conversation under `conversation_id` (`Conversation.version`): 32
    hex digits of a SHA-256 of its `epoch`, drawn at random as it was created, or, for one
    stored before epochs, of its `created_at`. The same for the life of the conversation
    (an epoch-less one's until its first turn since draws its epoch); another for one
    started again under the id. The epoch cannot be read back from it."""
    named = f"epoch:{epoch}" if epoch is not None else f"created_at:{rfc3339_millis(created_at)}"
    digest = hashlib.sha256(VERSION_LABEL)
    for part in (conversation_id, named):
        digest.update(b"\x00" + part.encode())
    return digest.hexdigest()[:32]


class AnsweredPrompt(_Model):
    """How far one answer a person gave to the prompts of a request id reaches (extension;
    the store's bookkeeping, never served): every prompt of that id stored below `below` was
    asked before the answer, and answered by it; one stored from there on (the id asked
    again) was not. A pop, a fork or a move folding the messages again keeps the first
    answered, and an id asked and answered again has an entry for each answer
    (`Conversation.answered_prompts`)."""

    request_id: str = Field(alias="r")
    below: Count = Field(alias="s")
    """The conversation's next free `seq` when the answer came, brought down to a `seq` a
    pop gives back (a prompt stored there later is a new one)."""
    calls: list[tuple[str, str | None]] | None = Field(default=None, alias="c")
    """The calls the answer named (`resolve_hitl`'s `calls` or `call_ids`), each its id and
    the message that made it (null: named by id alone): it released those of them the
    prompts of the id held, and answered the id once none of the calls they held is left
    unreleased. None (absent): it named none, and answered every prompt of the id."""
    stored_below: Count | None = Field(default=None, alias="p")
    """One past the `seq` of the newest prompt of the id stored when the answer came (0:
    none), at most `below`, brought down with it: a prompt of the id stored from there on,
    below `below`, was still being written (its turn's block reserved) and is not the one
    the person read and answered, which a stalled turn landing below it tells
    (`landed_after`). None (absent): recorded before the store read it, `below` tells."""


class Conversation(_Model):
    """One conversation document."""

    id: str = Field(alias="_id")
    """Equal to `conversation_id`."""
    conversation_id: str
    user_id: str | None = None
    """The owner; `null` for a conversation only services write to."""
    name: str | None = None
    name_source: Literal["auto", "runtime", "set"] | None = None
    """Who chose `name` (extension): automatic names yield to a runtime's, both to a person's."""
    name_message_id: str | None = Field(default=None, exclude=True)
    """The message an automatic name (`name_source` "auto") was taken from (the store's
    bookkeeping, never served; absent when no turn named the conversation so, or it was
    named before the store recorded it): a pop of that message takes the name back."""
    created_at: UtcDatetime
    updated_at: UtcDatetime
    """The latest time of its messages, whatever their `seq` order (the last message's when
    they are logged in time order), or `created_at` when later (a conversation holding none,
    or created before its messages' times)."""
    turn_count: Count = 0
    last_message_preview: str = ""
    message_count: Count = 0
    """The next free `seq` (extension)."""
    pending_hitl: PendingHitl | None = None
    pending_calls: list[PendingCall] = Field(default_factory=list)
    """Tool calls awaiting an answer from a later turn, oldest first (extension)."""
    usage: Usage = Field(default_factory=Usage)
    forked_from: ForkOrigin | None = None
    """The conversation and `seq` this one was forked from (extension); null if it was not."""
    copy_of: str | None = Field(default=None, exclude=True)
    """The `version` of the conversation a LangGraph thread's copy logged turn by turn created
    this one to copy (`copy_thread`; the store's bookkeeping, never served): it tells the
    copy's earlier attempt from another copy's, or one of an earlier life of its source."""
    fork_check: ForkCheck | None = Field(default=None, exclude=True)
    """Set as a fork creates this conversation, cleared once the fork's check found its source
    whole (`ForkCheck`; the store's bookkeeping, never served): a fork still holding it has
    not stood yet."""
    turns: list[TurnRecord] = Field(default_factory=list, exclude=True)
    """Every logged turn in reservation order, up to `TurnRules.turns_recorded` (extension;
    the store's bookkeeping, never served)."""
    turns_dropped: Count = Field(default=0, exclude=True)
    """How many of the oldest turn records were dropped to keep the document bounded."""
    calls_pushed_off: CallsPushedOff | None = Field(default=None, exclude=True)
    """The newest call the bound of `pending_calls` pushed off (the store's bookkeeping,
    never served; absent while none was, or the list was cut by a build before it)."""
    owned_from: Count = Field(default=0, exclude=True)
    """The first `seq` of the turn that assigned an owner to this conversation, unowned until
    then (the store's bookkeeping, never served; absent, 0, when no turn did): its messages
    before that `seq` were logged unowned and move to the owner with that turn (a retry of it
    moves them again)."""
    inbox: dict[str, Any] = Field(default_factory=dict, exclude=True)
    """Open steering inboxes of running turns, by turn (the store's bookkeeping, never served)."""
    runtime_turns: list[int] = Field(default_factory=list, exclude=True)
    """The turns runtimes opened a steering inbox for, by turn key (`TurnRecord.key`), the
    newest 100 (the store's bookkeeping, never served): a user token starts no turn under
    their ids, the inbox open or closed since, so the runtime logs its own turn."""
    deleting_since: UtcDatetime | None = Field(default=None, exclude=True)
    """When a delete or an erasure of this conversation began (the store's bookkeeping, never
    served; absent but while one is under way, or failed part-way until it is run again): no
    turn, retry or pop writes to it, and forks find it gone."""
    migrating: bool | None = Field(default=None, exclude=True)
    """Set as `python -m migrations run` writes this conversation's document, cleared once
    its messages are all in (the store's bookkeeping, never served; absent on every other
    document): until then the conversation is read from its legacy turns, and a turn, a pop,
    a rename or a fork of it is refused as of one not migrated yet (409)."""
    popping: PopInProgress | None = Field(default=None, exclude=True)
    """The pop under way, if any (the store's bookkeeping, never served): the next pop
    finishes it first."""
    pops: Count = Field(default=0, exclude=True)
    """How many pops were finished: a pop marks its message only if none finished since it
    read the conversation (the store's bookkeeping, never served)."""
    popped_seqs: list[Count] = Field(default_factory=list, exclude=True)
    """The `seq`s pops removed while a later turn had reserved past them, and those of the
    blocks turns moved away from, the newest `POPPED_SEQS_KEPT` (the store's bookkeeping,
    never served): gaps no turn holds, passed at once by tail readers, forks and pops, and
    given back with the `seq` below them."""
    popped_messages: list[PoppedMessage] = Field(default_factory=list, exclude=True)
    """The messages pops removed, the newest `POPPED_MESSAGES_KEPT` (the store's bookkeeping,
    never served): a tail reader's `after` naming one reads on from its `seq`, and the retry
    of a pop in doubt answers its message only if this conversation lists it."""
    resolved_hitl: list[str] = Field(default_factory=list, exclude=True)
    """The request ids of the prompts `resolve_hitl` resolved, the newest
    `RESOLVED_PROMPTS_KEPT` (the store's bookkeeping, never served): a resolution leaves no
    message, so a rerun of the migration and a fork folding the messages read them here."""
    answered_prompts: list[AnsweredPrompt] = Field(default_factory=list, exclude=True)
    """The prompts `resolve_hitl` resolved, by asking (`AnsweredPrompt`, one per answer, the
    newest `RESOLVED_PROMPTS_KEPT`; the store's bookkeeping, never served): a prompt
    asked again under the request id leaves `resolved_hitl`, but a pop of it, or a fork cut
    before it, brings back no prompt of that id asked before the answer."""
    approved_calls: list[ApprovedCall] = Field(default_factory=list, exclude=True)
    """The calls a person's answer released, those still pending and the newest
    `RESOLVED_PROMPTS_KEPT` others (the store's bookkeeping, never served): they await their
    results, and a turn denying one is refused (`AnsweredBefore`), whatever becomes of the
    request id of the prompt that held it (dropped from `resolved_hitl`, asked again)."""
    epoch: str | None = Field(default=None, exclude=True)
    """A random token drawn when the document is created, and by the first turn logged after
    an upgrade on one created before (the store's bookkeeping, never served): every message
    the conversation stores carries it, so a delete takes this conversation's messages and
    none of one created again under its id since, whoever created it."""
    epoch_marks: bool = Field(default=False, exclude=True)
    """Created by a release whose integrations name the conversation's `epoch` on every document
    they keep beside it (a LangGraph thread's checkpoints; the store's bookkeeping, never
    served): only those naming its epoch are its own, never one naming only a creation time,
    which the caller starting a conversation chooses. False on one created before, whose
    documents named its creation time (`agent_store.store.ThreadLife`)."""
    migrated: bool = Field(default=False, exclude=True)
    """Created by `python -m migrations run`, which drew its `epoch` as a live turn draws one
    (the store's bookkeeping, never served): while no turn is logged to it the document is
    the migration's to rewrite or remove (`migrations.writes.written_by_migration`), as one an
    earlier release migrated, which holds no epoch, is. False on every document the store
    creates."""
    pending_blocks: list[PendingBlock] = Field(default_factory=list, exclude=True)
    """The blocks of the turns whose reservation listed pending state (calls left open, a
    prompt raised), until a later turn's reservation finds them passed (`PendingBlock`; the
    store's bookkeeping, never served; emptied while nothing is pending): that turn looks
    whether they hold a message, and one holding none (its writer died before its insert)
    has the pending state folded again from the stored messages."""
    calls_relisted: list[CallRelisted] = Field(default_factory=list, exclude=True)
    """The pending calls a fold listed again though they were off the list (`CallRelisted`;
    the store's bookkeeping, never served; absent until a fold does): an answer to one, a
    turn's or a person's, first looks whether the answer of the turn whose block was passed
    as abandoned landed since, and is refused when one did."""
    refold_owed: UtcDatetime | None = Field(default=None, exclude=True)
    """When a fold of the pending state from the stored messages, after a move or a
    give-back, could not be written (the conversation kept changing under it, or a turn below
    the end was still being written); null or absent when none is owed (the store's
    bookkeeping, never served). The next turn folds it after its insert, and a turn refused
    by its condition meanwhile is judged again once it is folded."""
    last_step: str | None = Field(default=None, exclude=True)
    """The greatest `step` a turn was logged with (`log_messages`; a LangGraph thread's
    checkpoint ids), the store's bookkeeping, never served: a new turn of an earlier step is
    refused, so the transcript ends as the runtime's latest step."""

    @model_validator(mode="before")
    @classmethod
    def _resolved_prompts_hold_nothing(cls, data: Any) -> Any:
        if not isinstance(data, Mapping) or not data.get("pending_calls"):
            return data
        resolved, approved = data.get("resolved_hitl") or (), data.get("approved_calls") or ()
        if resolved or approved:
            calls = awaiting_results(data["pending_calls"], resolved, approved)
            return {**data, "pending_calls": calls}
        return data

    legacy_conversation_id: str | None = None
    """The id its legacy turns named, when that was not an identifier and the migration gave
    the conversation a derived one (extension)."""

    legacy_user_id: str | None = None
    """The legacy user id its owner was named by, when that was not an identifier and the
    migration stored the conversation owned by the user derived from it (`legacy-user-`):
    the dual write names that user by it, as the legacy turns do (extension). A claim
    moving the conversation to another user clears it."""

    @property
    def version(self) -> str:
        """What names this conversation and no other ever started under its id
        (`conversation_version`): pass it to `ConversationStore.delete(version=...)` to
        delete this conversation only; the API serves it as the `ETag` header."""
        return conversation_version(self.id, self.epoch, self.created_at)

    def popped_since(self, pops: int, end: int) -> bool:
        """Whether a pop removed a `seq` up to `end` from this conversation, read now, since
        it was read with `pops` pops finished (`popped_up_to`)."""
        popping = None if self.popping is None else self.popping.seq
        listed = [p.seq for p in self.popped_messages]
        return popped_up_to(end, self.pops - pops, popping, listed)


def popped_up_to(end: int, since: int, popping: int | None, listed: Sequence[int]) -> bool:
    """Whether a pop removed a `seq` up to `end` from a conversation since a read of it: one
    under way there (its `seq`, `popping`), or one of the `since` pops finished since, each
    of which listed its message's `seq` last (`listed`, its `popped_messages`, the newest
    kept: all of them were, when more pops finished than it keeps)."""
    if popping is not None and popping <= end:
        return True
    if since <= 0:
        return False
    return since > len(listed) or any(seq <= end for seq in listed[-since:])


T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    """A page of a list, in the OpenAI list shape."""

    model_config = ConfigDict(
        use_attribute_docstrings=True, json_schema_serialization_defaults_required=True
    )

    data: list[T]
    has_more: bool
    first_id: str | None
    last_id: str | None


class MessagePage(Page[AgentMessage]):
    """A page of a conversation's messages."""

    pending_seq: Count | None = None
    """The `seq` of a message reserved by a turn still being written: an ascending page stops
    before it, so a reader following the conversation asks again with the same `after`."""


class ConversationPage(Page[Conversation]):
    """A page of a user's conversations, newest first."""

    next_cursor: str | None = None
    """Pass as `cursor` to read the next page; null on the last page."""
