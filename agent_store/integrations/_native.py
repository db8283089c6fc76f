"""A runtime's own form of a message, kept as its difference from the form the chat fields
rebuild (the `native` extension). Pure, no I/O.

An adapter maps a runtime's item to a message (its chat fields) and rebuilds
the item from a message. Whatever the rebuilt item lacks, holds otherwise or
holds in excess is what `native` keeps, top-level key by key, so the runtime
gets back exactly what it stored while the common case stores nothing extra.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from agent_store.core import AgentMessage, InvalidInput, NativeForm, describe_validation_error


def native_difference(
    format: str, native: Mapping[str, Any], rebuilt: Mapping[str, Any]
) -> NativeForm | None:
    """What `native` holds beyond `rebuilt`, or None when the rebuilt form is the same."""
    changed = {
        key: value for key, value in native.items() if key not in rebuilt or rebuilt[key] != value
    }
    missing = [key for key in rebuilt if key not in native]
    if not changed and not missing:
        return None
    try:
        return NativeForm(format=format, set=changed, unset=missing)
    except ValidationError as exc:
        raise InvalidInput(describe_validation_error(exc, subject=f"{format} item")) from exc


def native_form(format: str, message: AgentMessage, rebuilt: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime's form of `message`: `rebuilt` with the message's own difference applied.

    A difference another runtime recorded (another `format`) is not applied.
    """
    form = dict(rebuilt)
    native = message.native
    if native is None or native.format != format:
        return form
    for key in native.unset:
        form.pop(key, None)
    form.update(native.set)
    return form


def with_native(
    message: AgentMessage, format: str, native: Mapping[str, Any], rebuilt: Mapping[str, Any]
) -> AgentMessage:
    """`message` carrying the difference between the runtime's form and the rebuilt one."""
    difference = native_difference(format, native, rebuilt)
    return message if difference is None else message.model_copy(update={"native": difference})
