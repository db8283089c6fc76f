"""The bounds of JSON the store walks, wherever it finds it: a request's values, a prompt's
params, and JSON held in strings (a call's arguments, a native value kept as its JSON text),
counted before it is parsed or walked: what one text costs follows these bounds, never its
bytes."""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_VALUES = 200_000
"""The most JSON values the store walks in one text, each object, array, string, number,
`true`, `false` and `null` counting one: the work grows with the values, not the bytes
(14 MB of `[[],[],…]` is 4.6 million arrays). A request's body holds at most as many."""

MAX_PARAMS_DEPTH = 64
"""How deeply HITL params, a native value and any JSON the store walks may nest: far below
MongoDB's limit of 100 levels per document, and Python's recursion."""

_WHITE_SPACE = str.maketrans("", "", " \t\n\r")


def json_values_past(text: str, most: int = MAX_JSON_VALUES) -> bool:
    """Whether JSON `text` holds more than `most` values, known before it is parsed and at C
    speed: not when its `:`, `,` and `[` (besides the text, each value is an object member,
    the first item of an array or follows a `,`) are within `most`; else counted exactly
    with each string emptied and white space dropped (1 + `,` + `{` + `[` - `{}` - `[]`), or
    known from its strings alone (a value is at most two, a key and a text). Text that is no
    JSON gets a count that means nothing: its parse fails anyway."""
    if 1 + text.count(":") + text.count(",") + text.count("[") <= most:
        return False
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    if unescaped.count('"') > 4 * most:
        return True  # and splitting at so many strings would cost a Python object each
    outside = '""'.join(unescaped.split('"')[::2]).translate(_WHITE_SPACE)
    brackets = outside.count("{") + outside.count("[")
    return 1 + outside.count(",") + brackets - outside.count("{}") - outside.count("[]") > most


def nests_deeper_than(value: Any, limit: int) -> bool:
    """Whether objects and arrays in `value` nest more than `limit` levels (without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if not isinstance(child, str))
    return False


def bounded_json(text: str) -> Any:
    """The value JSON `text` spells, when it holds at most `MAX_JSON_VALUES` values nested at
    most `MAX_PARAMS_DEPTH` levels: what the store may walk, recursively too. ValueError
    saying why not (no JSON, or past a bound), before it is parsed when it holds too many."""
    if json_values_past(text):
        raise ValueError(
            f"holds more than {MAX_JSON_VALUES} JSON values (each object, array, string, "
            "number, true, false and null counts one)"
        )
    try:
        value = json.loads(text)
    except RecursionError as exc:  # nested deeper than the parser reaches
        raise ValueError(f"values nest deeper than {MAX_PARAMS_DEPTH} levels") from exc
    if nests_deeper_than(value, MAX_PARAMS_DEPTH):
        raise ValueError(f"values nest deeper than {MAX_PARAMS_DEPTH} levels")
    return value
