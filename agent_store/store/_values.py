"""What a value must be before the store writes it: text BSON can encode, a sane time.

Pure, no I/O. Each check raises InvalidInput naming where the bad value is, so
a turn that breaks a rule is refused before its first write.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from agent_store.core import InvalidInput

EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
"""No stored time is before this."""


def _joined(text: str, where: str) -> str:
    """`text` with UTF-16 surrogate pairs joined into the characters they encode.

    A JavaScript runtime that slices a string between the two halves of a
    character sends each half on its own; once concatenated they form a valid
    pair. A half alone cannot be stored (BSON holds UTF-8) and is refused.
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    except UnicodeDecodeError as exc:
        lone = next(c for c in text if "\ud800" <= c <= "\udfff")
        raise InvalidInput(
            f"invalid {where}: it holds a lone surrogate ({lone.encode('unicode_escape').decode()})"
            "; text must be valid Unicode"
        ) from exc


def storable(value: Any, where: str) -> Any:
    """`value` with every string (keys included) joined as `_joined` does.

    Containers are copied only where a string changed (a split pair joined); ASCII text,
    nearly all of it, is passed by one C-level check. Raises InvalidInput naming the path
    of a string that cannot be stored.
    """
    if isinstance(value, str):
        return value if value.isascii() else _joined(value, where)
    if isinstance(value, Mapping):
        changed: dict[Any, Any] | None = None if type(value) is dict else {}
        for index, (key, item) in enumerate(value.items()):
            new_key = key if type(key) is not str or key.isascii() else _joined(key, f"{where} key")
            new_item = item if type(item) is str and item.isascii() else None
            if new_item is None:
                new_item = storable(item, f"{where}.{key}")
            if changed is None and (new_key is not key or new_item is not item):
                changed = dict(list(value.items())[:index])
            if changed is not None:
                changed[new_key] = new_item
        return value if changed is None else changed
    if isinstance(value, list | tuple):
        items = [storable(item, f"{where}.{index}") for index, item in enumerate(value)]
        if type(value) is list and all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return items
    return value


def check_time(value: datetime, where: str, *, leeway: timedelta, now: datetime) -> None:
    """Refuse a time before 1970 or further ahead of `now` than `leeway` (clock skew)."""
    if value < EARLIEST:
        raise InvalidInput(f"invalid {where}: {value.isoformat()} is before 1970")
    if value > now + leeway:
        raise InvalidInput(
            f"invalid {where}: {value.isoformat()} is more than {leeway} ahead of the store's "
            "clock; send the time the message was made"
        )
