"""The rules every JSON request body meets before a model reads it.

What pydantic cannot refuse on its own, because it happens while parsing or
only fails once stored: nesting deep enough to exhaust the parser's recursion,
more values than a request may make the service validate and store, numbers that
parse to infinity (JSON responses cannot carry them back; an integer past 64 bits,
which BSON's integers cannot hold, is the double it spells, as `1e+19` spells it, and
refused when its digits name no double: kept as the nearest one, digits would be lost),
a key named twice in one object (readers disagree on which value counts), a lone
UTF-16 surrogate escaped (`"\\ud800"`: no text, which the parser would refuse in
words of its own, not naming where it is).
"""

from __future__ import annotations

import codecs
import json
import math
import re
import sys
from typing import Any, TypeVar

from agent_store.core import (
    MAX_JSON_VALUES,
    MAX_PARAMS_DEPTH,
    location_text,
    nests_deeper_than,
    shown_key,
    stored_number,
)
from agent_store.store import storable
from app.http_errors import InvalidJson, InvalidRequest, PayloadTooLarge

MAX_BODY_DEPTH = MAX_PARAMS_DEPTH
"""The deepest nesting of objects and arrays a body may have (as deep as any JSON the store
walks: MongoDB stores 100 at most)."""
MAX_BODY_VALUES = MAX_JSON_VALUES
"""The most JSON values a body may hold (as many as JSON text held in a string: `bounded_json`),
each object, array, string, number, `true`, `false` and `null` counting one: the work a request
causes grows with its values, not its bytes (16 MiB of `{}` is 2.5 million objects), and a turn
of 1,000 messages with their tool calls and results holds a tenth of this or less."""
_DOUBLE_DIGITS = len(str(-int(sys.float_info.max)))
"""The longest JSON integer within the doubles, its sign included."""
T = TypeVar("T", bound=float)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose every key is named once: which of two values is meant differs from
    reader to reader (some take the first, Python and JavaScript the last)."""
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InvalidJson(
                    f"the body names the key {shown_key(key)} twice in one object: "
                    "send each key once"
                )
            seen.add(key)
    return document


def _problem(value: Any) -> str | None:
    """What is wrong with a scalar, if anything."""
    if isinstance(value, float) and not math.isfinite(value):
        return "the number is outside the 64-bit floating-point range the store keeps"
    if type(value) is int and not -(2**63) <= value < 2**63:
        return (
            "the integer is past 64 bits and its digits name no 64-bit floating-point number "
            "(kept as the nearest one it would lose digits): send it as a string"
        )
    return None


def _name_the_number(document: Any) -> None:
    """Raise InvalidRequest naming where the first number the store cannot keep is."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(document, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict | list):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((child, (*path, key)) for key, child in items)
            continue
        problem = _problem(value)
        if problem is not None:
            where = location_text(path)
            raise InvalidRequest(f"invalid body: {where}: {problem}")


class _Numbers:
    """Parses the body's numbers, noting one the store cannot keep (named after parsing)."""

    def __init__(self) -> None:
        self.refused = False

    def integer(self, text: str) -> int | float:
        """An integer as the store keeps it (`stored_number`): past 64 bits, the double it
        spells (as `1e+19` spells it), else itself, refused (`_problem`); past every double
        an infinity, refused."""
        if len(text) > _DOUBLE_DIGITS:  # past every double, and maybe past what int() reads
            return self._noted(float(text))
        return self._noted(stored_number(int(text)))

    def real(self, text: str) -> float:
        return self._noted(float(text))

    def _noted(self, value: T) -> T:
        self.refused = self.refused or _problem(value) is not None
        return value


def _values_bound(raw: bytes) -> int:
    """An upper bound of the values in `raw`: besides the document, each value is an object
    member (one `:`), the first item of an array (one `[`) or follows a `,` (strings may hold
    more of these, never fewer)."""
    return 1 + raw.count(b":") + raw.count(b",") + raw.count(b"[")


def _unescaped(raw: bytes) -> bytes:
    """`raw` without the escapes `\\\\` and `\\"` (read left to right, as JSON reads them):
    each `"` left opens or closes a string."""
    return raw.replace(b"\\\\", b"").replace(b'\\"', b"")


def _values_in(unescaped: bytes) -> int:
    """The values in a JSON text without escapes (`_unescaped`), counted in its bytes: each
    container holds one more value than the `,` directly in it unless it is empty, so the
    values are 1 + `,` + `{` + `[` - `{}` - `[]` once each string is emptied and white space
    dropped (keys are no values)."""
    outside = b'""'.join(unescaped.split(b'"')[::2]).translate(None, b" \t\n\r")
    brackets = outside.count(b"{") + outside.count(b"[")
    return 1 + outside.count(b",") + brackets - outside.count(b"{}") - outside.count(b"[]")


def _holds_too_many_values(raw: bytes) -> bool:
    """Whether `raw` holds more than `MAX_BODY_VALUES` values, known before it is parsed and
    at C speed (the parser calls Python for each number: 8 million held the event loop for
    5-12 s): by `_values_bound` when that is within the limit, else by its strings alone (a
    value is at most two, a key and a text) or by the exact count."""
    if _values_bound(raw) <= MAX_BODY_VALUES:
        return False
    unescaped = _unescaped(raw)
    if unescaped.count(b'"') > 4 * MAX_BODY_VALUES:
        return True  # and splitting at so many strings would cost a Python object each
    return _values_in(unescaped) > MAX_BODY_VALUES


_LONE_HALF = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)
"""An escape of a UTF-16 half that no escape of the other half pairs with (an escaped
backslash before it is a false alarm, which costs one walk)."""


def _name_the_lone_surrogate(document: dict[str, Any]) -> None:
    """InvalidInput naming the first string (a key too) holding a lone UTF-16 surrogate, as
    the store words it (`storable`): a turn's message as the store names it (`message 0`),
    any other value by its field."""
    for key, value in document.items():
        storable(key, "body key")
        if key == "messages" and isinstance(value, list):
            for index, message in enumerate(value):
                storable(message, f"message {index}")
        else:
            storable(value, shown_key(key))


def decode_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object within the rules above; InvalidJson, InvalidRequest or
    PayloadTooLarge if not.

    The number of values is counted in the bytes, before the body is parsed (no count at all
    when its `,` `:` `[` are within the limit); numbers are checked as they are parsed; the
    nesting only of a body with more brackets than the limit, by one walk: a small body within
    the rules is not walked at all, a large one before pydantic validates it or anything is
    written.
    """
    numbers = _Numbers()
    if raw.startswith(codecs.BOM_UTF8):
        raise InvalidJson("the body starts with a byte order mark: send UTF-8 JSON without one")
    if _holds_too_many_values(raw):  # before the body is decoded: nothing copied for it
        raise PayloadTooLarge(
            f"the body holds more than {MAX_BODY_VALUES} JSON values (each object, array, "
            "string, number, true, false and null counts one)"
        )
    try:
        text = raw.decode()  # UTF-8 only (RFC 8259), as the body models read it
    except UnicodeDecodeError as exc:
        raise InvalidJson(f"the body is not UTF-8 text: {exc}") from exc
    try:
        document = json.loads(
            text,
            object_pairs_hook=_unique_keys,
            parse_constant=_refuse_constant,
            parse_int=numbers.integer,
            parse_float=numbers.real,
        )
    except RecursionError as exc:
        raise InvalidJson(f"the body nests deeper than {MAX_BODY_DEPTH} levels") from exc
    except ValueError as exc:
        raise InvalidJson(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise InvalidJson("the body must be a JSON object")
    brackets = raw.count(b"[") + raw.count(b"{")  # an upper bound of the nesting
    if brackets > MAX_BODY_DEPTH and nests_deeper_than(document, MAX_BODY_DEPTH):
        raise InvalidJson(f"the body nests deeper than {MAX_BODY_DEPTH} levels")
    if numbers.refused:
        _name_the_number(document)
    if _LONE_HALF.search(raw):
        _name_the_lone_surrogate(document)
    return document
