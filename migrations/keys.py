"""Document ids as Python keys: a legacy `_id` may be any BSON value but an array (an embedded
document, a Decimal128, which Python cannot hash), and values Python finds equal (`5` and
`5.0`, `1` and `True`) are two ids to the server. Every dict keyed and set built by `_id` in
the migration goes through `id_key`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import bson


def id_key(value: Any) -> bytes:
    """An `_id` as a key: its BSON, unique in its collection whatever its type."""
    return bson.encode({"_id": value})


def identity(document: Mapping[str, Any]) -> bytes:
    """A document's `_id` as a key (`id_key`)."""
    return id_key(document.get("_id"))
