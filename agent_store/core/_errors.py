"""The store's own errors: one base class, one subclass per cause, each with a stable code."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from pydantic import ValidationError


class StoreError(Exception):
    """Base of every error the store raises. `code` is stable; the message says what went wrong."""

    code = "store_error"
    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(StoreError):
    """The caller sent something the contract does not allow; nothing was written."""

    code = "invalid_input"
    status = 422


class ForkTooLarge(InvalidInput):
    """A fork at the `seq` asked would copy past what one fork copies (its messages, tool
    calls, bytes or whole texts); the message names the last `seq` whose fork fits, if any.
    Nothing was written."""


class NotFound(StoreError):
    """The conversation or message named does not exist (or is not the caller's)."""

    code = "not_found"
    status = 404


class Conflict(StoreError):
    """The request contradicts what is stored, e.g. a turn id reused for other messages."""

    code = "conflict"
    status = 409


class VersionMismatch(StoreError):
    """A call naming a conversation's `version` found another conversation under its id (it
    was deleted and started again since the version was read) or another version: nothing
    was changed. Read the conversation again to learn what is there now."""

    code = "precondition_failed"
    status = 412


class TranscriptMoved(Conflict):
    """A turn logged at a `next_seq` or `step` found the conversation moved on since the caller
    saw it (other messages logged, or a later step): nothing was written."""

    def __init__(self, message: str, *, next_seq: int, later_step: str | None = None) -> None:
        super().__init__(message)
        self.next_seq = next_seq
        """The `seq` the conversation's next turn gets now."""
        self.later_step = later_step
        """The later step the conversation logged, when the turn's `step` is behind it."""


class AnsweredBefore(Conflict):
    """A turn answers tool calls a first answer settled (another tab, a replayed event): it
    denies calls whose confirmation a person approved before (the calls await their
    results), or answers calls of earlier turns that another turn answered since, naming
    them as it read them (`answers_to`). A request's first answer is its answer, and so is a
    call's, so nothing was written. Log the turn without those answers."""

    def __init__(self, message: str, *, tool_call_ids: Sequence[str]) -> None:
        super().__init__(message)
        self.tool_call_ids = tuple(tool_call_ids)
        """The calls the turn answers that a first answer settled: released by their approved
        confirmation, or answered by another turn."""


class DenialTakenBack(Conflict):
    """A turn logged without its denials of calls a denial stored first had settled
    (`log_messages`' `denied_first`) found one of those calls pending again: that denial
    was taken back (popped) since it was read, so nothing answers the call now and the
    turn's own denial would be its first answer. Nothing was written: log the turn again
    with its denial, judged as the conversation stands."""

    def __init__(self, message: str, *, tool_call_ids: Sequence[str]) -> None:
        super().__init__(message)
        self.tool_call_ids = tuple(tool_call_ids)
        """The calls pending again whose denials the turn left out."""


class PromptNotPending(Conflict):
    """An answer to a prompt (`resolve_hitl`) that no prompt of its request id takes now: it
    was resolved before (its first answer stands), asked again since the answer was read, or
    holds other calls than those the answer names, or no prompt of the id was asked. Nothing
    was written, and the conversation takes writes: a caller replaying an answer (a stream's
    approval, logged again) may pass over it, unlike the other Conflicts of an answer (a
    conversation not migrated yet, or being migrated), which mean it can record nothing."""


class Unsupported(StoreError):
    """The connected database cannot do this (e.g. full-text search on an in-process fake)."""

    code = "unsupported"
    status = 501


class StorageUnavailable(StoreError):
    """The database could not be reached in time; the call can be retried as it is."""

    code = "storage_unavailable"
    status = 503


class StorageFailure(StoreError):
    """The database refused an operation for a reason the store did not expect."""

    code = "storage_failure"
    status = 500


def location_text(parts: Sequence[str | int]) -> str:
    """Where in a document a problem is, as `a.0.b`, fit to show to whoever sent it.

    Keys that are not plain names (the sender's own text, say) are shown as `<key>`
    (`shown_key`), so an error message never repeats arbitrary input back.
    """
    return ".".join(shown_key(part) for part in parts)


def shown_key(key: str | int) -> str:
    """A key of a caller's document (or an index in it) as an error message may show it: as
    it is when it is a plain name, else `<key>`."""
    return str(key) if _PLAIN_NAME.fullmatch(str(key)) else "<key>"


LISTED = 3
"""How many of a caller's keys or values a refusal about them lists (`listed`); it counts the
rest."""


def listed(values: Sequence[str], show: Callable[[str], str]) -> str:
    """The first `LISTED` of a caller's keys or values as an error message may show them
    (`show`: `shown_key` or `shown`), and how many more there are: a message of bounded
    length, whatever was sent."""
    first = ", ".join(show(value) for value in values[:LISTED])
    more = len(values) - LISTED
    return f"{first} and {more} more" if more > 0 else first


def shown(value: str) -> str:
    """A caller's value as an error message may show it: quoted when it is a plain name
    (an id such as `call_0`), else `<withheld>`, so a message never repeats arbitrary
    input back."""
    return repr(value) if _PLAIN_NAME.fullmatch(value) else "<withheld>"


DOT_SEGMENTS = (".", "..")
"""What a URL path reads as the folder itself and its parent (`%2E%2E` too): no id."""
DOT_SEGMENT_REASON = (
    "a URL path reads `.` and `..` as the folder itself and its parent, so no link or client "
    "could name it"
)


def describe_validation_error(
    error: ValidationError, *, subject: str = "input", within: Sequence[str] = ()
) -> str:
    """One line per problem: where it is (in the field `within` names, when the model that
    failed is one field of the subject) and what is wrong, without pydantic's URLs."""
    problems = []
    for item in error.errors(include_url=False):
        location = location_text([*within, *_without_role_tags(item["loc"])])
        text = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "string_pattern_mismatch":  # the pattern may hold what it refuses
            text = _pattern_refusal(item.get("input"), (item.get("ctx") or {}).get("pattern"))
        elif item["type"] == "union_tag_invalid":  # pydantic's text repeats the tag as sent
            ctx = item.get("ctx") or {}
            text = (
                f"{ctx.get('discriminator')} must be one of {ctx.get('expected_tags')}, "
                f"not {shown(str(ctx.get('tag')))}"
            )
        problems.append(f"{location}: {text}" if location else text)
    return f"invalid {subject}: " + "; ".join(problems)


UNDESCRIBED_PATTERN = "it does not have the form this field takes"
"""What a refusal says of a value failing a `pattern=` no one described (`described_pattern`):
never the pattern itself."""

_PATTERN_WORDS: dict[str, Callable[[str], str]] = {}


def described_pattern(pattern: str, words: str | Callable[[str], str]) -> str:
    """`pattern`, for a `pattern=` constraint, recorded with the words that say what a value
    failing it lacks (or a function of the value giving them): a refusal says those words
    (`describe_validation_error`), never the pattern, which may hold the very characters it
    refuses. Every pattern a type checks is described where the type is defined."""
    _PATTERN_WORDS[pattern] = words if callable(words) else lambda _value: words
    return pattern


def _pattern_refusal(value: object, pattern: object) -> str:
    words = _PATTERN_WORDS.get(pattern) if isinstance(pattern, str) else None
    if words is None or not isinstance(value, str):
        return UNDESCRIBED_PATTERN
    return words(value)


_ROLE_TAGS = {"system", "user", "assistant", "tool"}


def _without_role_tags(loc: Sequence[str | int]) -> list[str | int]:
    """A pydantic location without the role a union of messages puts after a message's
    place (first, or after its index in a list): it only adds noise. A key named like a
    role anywhere else is the sender's own and stays."""
    return [
        part
        for i, part in enumerate(loc)
        if not (part in _ROLE_TAGS and (i == 0 or isinstance(loc[i - 1], int)))
    ]


_PLAIN_NAME = re.compile(r"[\w$.:@|-]{1,64}")
