"""What a value must be before the store writes it: text BSON can encode, a sane time.

Pure, no I/O. Each check raises InvalidInput naming where the bad value is, so
a turn that breaks a rule is refused before its first write.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from agent_store.core import InvalidInput, joined_text, shown_key

EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
"""No stored time is before this."""


def _joined(text: str, where: str) -> str:
    """`text` with UTF-16 surrogate pairs joined (`joined_text`); a half alone is refused."""
    try:
        return joined_text(text)
    except ValueError as exc:
        raise InvalidInput(f"invalid {where}: {exc}") from exc


def _plain(value: Any) -> bool:
    """Whether every string in `value` (keys included) is valid Unicode already and every
    container a plain dict or list: nothing to join, copy or refuse."""
    kind = type(value)
    if kind is str:
        return value.isascii() or _encodable(value)
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or not (key.isascii() or _encodable(key)):
                return False
            if not (type(item) is str and item.isascii()) and not _plain(item):
                return False
        return True
    if kind is list:
        return all(_plain(item) for item in value)
    return not isinstance(value, Mapping | tuple)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def storable(value: Any, where: str) -> Any:
    """`value` with every string (keys included) joined as `_joined` does; containers copied.

    A value whose strings are all valid already comes back as it is, after one walk
    that names no path. Raises InvalidInput naming the path of a string that cannot be
    stored (a key that is no plain name shown as `<key>`: an error never repeats input).
    """
    if _plain(value):
        return value
    if isinstance(value, str):
        return _joined(value, where)
    if isinstance(value, Mapping):
        return {
            storable(key, f"{where} key"): storable(item, f"{where}.{shown_key(str(key))}")
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [storable(item, f"{where}.{index}") for index, item in enumerate(value)]
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
