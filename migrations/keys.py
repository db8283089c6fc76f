"""Document ids as Python keys: a legacy `_id` may be any BSON value but an array (an embedded
document, a Decimal128, which Python cannot hash). Values Python finds equal (`1` and `True`)
may be two ids to the server, and values it finds unequal one (`5` and `Decimal128("5")`).
Every dict keyed and set built by `_id` in the migration goes through `id_key`, by the exact
value a document holds, or `matched_key`, by the value the server matches an `_id` by (its
unique index and `$in`: `5`, `5.0`, `Int64(5)` and `Decimal128("5")` are one `_id`), where
documents of two collections are paired by what the server found for an `$in`."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Context, Decimal
from typing import Any

import bson
from bson import Decimal128

from agent_store.legacy import not_utf8_key

_EXACT = Context(prec=1100)
"""Digits enough to write any double's or Decimal128's value exactly."""


def id_key(value: Any) -> bytes:
    """An `_id` as a key: its BSON, unique in its collection whatever its type; one holding
    text that is not valid UTF-8, which no BSON encodes, by `not_utf8_key`."""
    try:
        return bson.encode({"_id": value})
    except UnicodeEncodeError:
        return not_utf8_key(value)


def identity(document: Mapping[str, Any]) -> bytes:
    """A document's `_id` as a key (`id_key`)."""
    return id_key(document.get("_id"))


def matched_key(value: Any) -> str:
    """An `_id` as the server matches it: a number of any BSON type by its exact value (`5`,
    `5.0`, `Int64(5)`, `Decimal128("5")` and `-0.0` beside `0` alike, a NaN as any NaN), in
    an embedded document too; anything else by its BSON (`id_key`: a bool is no number)."""
    if isinstance(value, int | float | Decimal128) and not isinstance(value, bool):
        exact = value.to_decimal() if isinstance(value, Decimal128) else Decimal(value)
        return (
            "NaN"
            if exact.is_nan()
            else f"n:{Decimal(0) if exact == 0 else exact.normalize(_EXACT)}"
        )
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k!r}:{matched_key(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(matched_key(v) for v in value) + "]"
    return id_key(value).hex()


def same_document(one: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether two documents the server matched by `_id` (`matched_key`) hold the same: the
    same BSON but for the type of the `_id`'s number (`5` and `5.0` are one turn's `_id`).
    Python's `==` finds a NaN unequal to itself, and `0.0` equal to `-0.0` and `120` to
    `120.0`, which BSON tells apart."""
    return matched_key(one.get("_id")) == matched_key(other.get("_id")) and bson.encode(
        {k: v for k, v in one.items() if k != "_id"}
    ) == bson.encode({k: v for k, v in other.items() if k != "_id"})
