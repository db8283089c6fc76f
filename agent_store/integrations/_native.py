"""A runtime's own form of a message, kept as its difference from the form the chat fields
rebuild (the `native` extension). Pure, no I/O.

An adapter maps a runtime's item to a message (its chat fields) and rebuilds
the item from a message. Whatever the rebuilt item lacks, holds otherwise or
holds in excess is what `native` keeps, top-level key by key, so the runtime
gets back exactly what it stored while the common case stores nothing extra.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError, to_jsonable_python

from agent_store.core import (
    MAX_PARAMS_DEPTH,
    AgentMessage,
    InvalidInput,
    NativeForm,
    describe_validation_error,
    location_text,
    lone_surrogate,
    shown_key,
)


def kept_form(
    format: str, changed: Mapping[str, Any], removed: Iterable[str] = (), *, subject: str
) -> NativeForm:
    """The native form keeping a runtime's values `changed` and keys `removed`, a value BSON
    cannot hold as it is as its JSON text (`NativeForm.keeping`). Raises InvalidInput naming
    `subject` (the message) and the field for what cannot be kept."""
    try:
        return NativeForm.keeping(format, changed, removed)
    except ValidationError as exc:
        described = describe_validation_error(exc, subject=subject, within=("native",))
        raise InvalidInput(described) from exc


def runtime_json(dumped: Any, *, subject: str, fallback: Callable[[Any], Any] | None = None) -> Any:
    """A runtime's form, dumped in Python mode, as JSON values (as a JSON dump makes it)
    but for NaN and the infinities, kept as they are: a JSON dump makes them null, which
    would change what the runtime gets back (`NativeForm.keeping` keeps them as text).

    Without `fallback`, every value must come back as it is: one that would not (a Decimal,
    a datetime, a set, bytes, a key that is no string, an object of no JSON type) is refused,
    as the Agents SDK session refuses it. A tuple comes back a list, and a str, int or float
    of a subclass (an enum of them) the plain value, as LangChain's own `dumpd` writes them.
    Raises InvalidInput naming `subject` (the message), and the field when it is known."""
    if fallback is None and (changed := _changed(dumped)) is not None:
        where, wrong = changed
        raise InvalidInput(f"invalid {subject}: {where}: {wrong}")
    try:
        return to_jsonable_python(dumped, inf_nan_mode="constants", fallback=fallback)
    except (PydanticSerializationError, ValueError, RecursionError) as exc:
        # UnicodeDecodeError (bytes that are no UTF-8 text) is a ValueError; so is a key
        # holding half of a character alone, named by where it is.
        if (found := lone_surrogate(dumped)) is not None:
            path, refusal = found
            raise InvalidInput(
                f"invalid {subject}: {location_text(path) or '<value>'}: {refusal}"
            ) from exc
        raise InvalidInput(f"invalid {subject}: values must be JSON values only ({exc})") from exc


def _changed(value: Any) -> tuple[str, str] | None:
    """Where in `value` (a dumped form, keyed by field) the first value is that its JSON
    text would not give back as it is, and what is wrong; None if nothing. One walk without
    recursion, in the order the value is written, no deeper than a stored value may nest
    (`MAX_PARAMS_DEPTH` below the field): a value holding itself ends there too."""
    pending: list[tuple[str, Any, int]] = [("", value, 0)]
    while pending:
        where, item, depth = pending.pop()
        if depth > MAX_PARAMS_DEPTH + 1:
            return where.partition(".")[0], f"values nest deeper than {MAX_PARAMS_DEPTH} levels"
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, str):
                    return where or "<key>", _not_back(f"key of type {type(key).__name__}")
            inner = [(f"{where}.{shown_key(key)}".lstrip("."), item[key]) for key in item]
        elif isinstance(item, list | tuple):
            inner = [(f"{where}.{index}".lstrip("."), each) for index, each in enumerate(item)]
        elif item is None or isinstance(item, str | int | float):
            continue
        else:
            return where or "<value>", _not_back(f"value of type {type(item).__name__}")
        pending.extend((at, each, depth + 1) for at, each in reversed(inner))
    return None


def _not_back(kind: str) -> str:
    return f"values must be JSON values only: a {kind} would not come back as it is"


def native_difference(
    format: str, native: Mapping[str, Any], rebuilt: Mapping[str, Any], *, subject: str
) -> NativeForm | None:
    """What `native` holds beyond `rebuilt`, or None when the rebuilt form is the same.
    Raises InvalidInput naming `subject` (the message) for what cannot be kept."""
    changed = {
        key: value for key, value in native.items() if key not in rebuilt or rebuilt[key] != value
    }
    missing = [key for key in rebuilt if key not in native]
    if not changed and not missing:
        return None
    return kept_form(format, changed, missing, subject=subject)


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
    form.update(native.set_values())
    return form


def with_native(
    message: AgentMessage,
    format: str,
    native: Mapping[str, Any],
    rebuilt: Mapping[str, Any],
    *,
    subject: str,
) -> AgentMessage:
    """`message` carrying the difference between the runtime's form and the rebuilt one.
    Raises InvalidInput naming `subject` (the message) for what cannot be kept."""
    difference = native_difference(format, native, rebuilt, subject=subject)
    return message if difference is None else message.model_copy(update={"native": difference})
