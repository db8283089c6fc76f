"""Keep every stored message under a size bound by cutting its largest texts, never losing them.

MongoDB refuses documents over 16 MiB; a turn must never be lost to that, so a
message over the configured bound is stored with its largest text fields cut
and a `truncated` map naming each cut field, its original length, the
GridFS file its whole text goes to (`FullText`, written by `_blobs`) and the SHA-256 of
that text, so what a turn is (its content digest) covers its whole texts. Pure, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import bson

from agent_store.core import AgentMessage, InvalidInput, Truncation, message_adapter

DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
TRUNCATION_MARK = "\n…[truncated]"
_MARGIN_BYTES = 64
"""Cut this much more per text than a document is over: room for the mark of a cut."""
NATIVE = "native"
"""A runtime's own form of a message: cut whole (the runtime then reads back the form the
chat fields make) and kept whole in GridFS like any cut text."""
DERIVED_FIELDS = frozenset({"search_text"})
"""Fields computed from the others: cut without keeping a copy."""


@dataclass(frozen=True)
class FullText:
    """A text cut from a stored message, to be kept whole in GridFS under `blob_id`."""

    blob_id: str
    conversation_id: str | None
    message_id: str
    path: str
    """Where the text sits in the message, e.g. `content` or `tool_calls.0.function.arguments`."""
    text: str
    created_at: datetime
    epoch: str | None = None
    """The `epoch` of the conversation storing the message (`text_for_epoch`), recorded in
    the file's metadata: a cleanup of a deleted conversation tells its files by it."""


@dataclass(frozen=True)
class BoundedMessage:
    """A message within its size bound, and the whole texts of the fields that were cut."""

    message: AgentMessage
    full_texts: tuple[FullText, ...] = ()


def blob_id(message_id: str, path: str, epoch: str | None = None) -> str:
    """The GridFS file id of a message's cut field: a retry or a rerun writes the same file.

    With the `epoch` of the conversation storing the message, the id names it too: a
    conversation created again under the id reuses the message ids, never the files, so
    nothing done for a deleted one (a stalled writer's keep, a stalled pop's delete) reaches
    the next one's whole texts. Messages stored without an epoch keep the id without."""
    digest = hashlib.sha256(f"{message_id}\0{path}".encode()).hexdigest()
    unscoped = "blob-" + digest[:32]
    if epoch is None:
        return unscoped
    return f"{unscoped}-{hashlib.sha256(epoch.encode()).hexdigest()[:16]}"


def unscoped_blob_id(blob: str) -> str:
    """A file id without the epoch it names (`blob_id`): what a turn's content digest reads,
    so that the same turn is the same content in whichever conversation stores it."""
    return blob[: -len(_EPOCH_SUFFIX)] if _SCOPED.fullmatch(blob) else blob


_EPOCH_SUFFIX = "-" + "0" * 16
_SCOPED = re.compile(r"blob-[0-9a-f]{32}-[0-9a-f]{16}")


def for_epoch(message: AgentMessage, epoch: str | None) -> AgentMessage:
    """A cut message whose `truncated` entries name the files of the conversation of
    `epoch` (`blob_id`); as it is without an epoch, or with nothing kept whole."""
    if epoch is None or message.id is None or not kept_whole(message):
        return message
    mid = message.id
    truncated = {
        path: entry.model_copy(update={"blob_id": blob_id(mid, path, epoch)})
        if isinstance(entry, Truncation) and entry.blob_id
        else entry
        for path, entry in (message.truncated or {}).items()
    }
    return message.model_copy(update={"truncated": truncated})


def kept_whole(message: AgentMessage) -> bool:
    """Whether a cut field of the message is kept whole in a file."""
    entries = (message.truncated or {}).values()
    return any(isinstance(entry, Truncation) and entry.blob_id for entry in entries)


def text_for_epoch(full: FullText, epoch: str | None) -> FullText:
    """The whole text under the file id naming the conversation's `epoch` (`blob_id`), and
    of that epoch."""
    return replace(full, blob_id=blob_id(full.message_id, full.path, epoch), epoch=epoch)


def document_size(document: dict[str, Any]) -> int:
    """The exact size of the document in BSON."""
    return len(bson.encode(document))


# An element's type byte and its key's NUL, a string's length prefix and NUL, a
# sub-document's length prefix and NUL: at most this many bytes besides key and value.
_ELEMENT_BYTES = 12
# The widest scalar BSON holds (a Decimal128); numbers, dates and ids take less.
_SCALAR_BYTES = 16
_INT64 = range(-(2**63), 2**63)


def _value_bound(value: Any) -> int:
    if type(value) is str:
        return 4 * len(value)  # at most 4 bytes of UTF-8 per character
    if isinstance(value, dict):
        return sum(4 * len(k) + _ELEMENT_BYTES + _value_bound(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        # An array's keys are the decimal indexes: at most 20 digits.
        return sum(20 + _ELEMENT_BYTES + _value_bound(v) for v in value)
    if type(value) is int and value not in _INT64:
        raise OverflowError("an integer is outside BSON's 64-bit range")
    if isinstance(value, bytes | str):
        return 4 * len(value)
    return _SCALAR_BYTES


# Every top-level element of a message document: its type byte, a key of at most 16 bytes
# and its NUL, a string's length prefix and NUL, or a number, a date or null.
_FIELD_BYTES = 32
# Room for the fields set when the document is stored (`seq`, an owner id of 200 characters).
_STORED_FIELDS_BYTES = 1024
_TEXTS = ("_id", "conversation_id", "role", "content", "tool_call_id", "turn_id", "search_text")
_NESTED_EXACTLY = ("hitl_action", "truncated", "native")


# BSON spends at most this many bytes per character of a value's `repr`: 4 bytes of UTF-8
# per character of text, and for each element (at least 3 characters of `repr`: a key and
# its quotes, or a list item and its separator) its type, key and framing.
_REPR_FACTOR = 16
# Per message, what a turn's canonical text leaves out: `_id`, conversation, turn and owner
# ids (200 characters at most), `created_at` and `seq`, and the framing of `search_text`.
_LEFT_OUT_BYTES = 4096


def turn_size_bound(canonical: str, search_texts: Sequence[str | None]) -> int:
    """An upper bound of the BSON size of a turn's message documents together, from the
    `repr` of their content (`canonical`, without ids, times and search texts) and the
    lengths of their search texts. Reads only lengths: no message is walked or encoded."""
    searched = sum(len(text) for text in search_texts if text is not None)
    return _REPR_FACTOR * len(canonical) + 4 * searched + _LEFT_OUT_BYTES * len(search_texts)


def _calls_bound(calls: list[dict[str, Any]]) -> int:
    return sum(
        4 * _FIELD_BYTES
        + 4 * (len(c["id"]) + len(c["type"]) + len(c["function"]["name"]))
        + 4 * len(c["function"]["arguments"])
        for c in calls
    )


def size_bound(document: dict[str, Any]) -> int:
    """An upper bound of a message document's BSON size, from the lengths of its texts.

    Cheap where encoding is not: it reads a few lengths and never copies a text. HITL
    params and `truncated` maps, rare and small, are walked whole. Raises OverflowError,
    as encoding would, for an integer BSON cannot hold.
    """
    total = _STORED_FIELDS_BYTES + _FIELD_BYTES * len(document)
    for key in _TEXTS:
        if (text := document.get(key)) is not None:
            total += 4 * len(text)  # at most 4 bytes of UTF-8 per character
    if user_id := document.get("user_id"):
        total += 4 * len(user_id)
    if calls := document.get("tool_calls"):
        total += _calls_bound(calls)
    if error := document.get("error"):
        total += _FIELD_BYTES + 4 * len(error["message"])
    if upload := document.get("upload"):
        texts = (upload["filename"], upload["file_type"], upload.get("parsed_text") or "")
        total += 4 * _FIELD_BYTES + 4 * sum(map(len, texts))
    if document.get("token_usage"):
        total += 2 * _FIELD_BYTES
    for key in _NESTED_EXACTLY:
        if value := document.get(key):
            total += _value_bound(value)
    return total


def _wide_int_path(value: Any, path: str = "") -> str:
    """Where in a document an integer too wide for BSON is (its dotted path)."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(item, int) and not -(2**63) <= item < 2**63:
            return where
        if isinstance(item, dict | list) and (found := _wide_int_path(item, where)):
            return found
    return ""


def _text_fields(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(path, text) of every free-text field a message can carry."""
    found: list[tuple[str, str]] = []
    for path in ("content", "search_text", "upload.parsed_text", "error.message"):
        head, _, tail = path.partition(".")
        value = doc.get(head)
        if tail and isinstance(value, dict):
            value = value.get(tail)
        if isinstance(value, str):
            found.append((path, value))
    for index, call in enumerate(doc.get("tool_calls") or ()):
        found.append((f"tool_calls.{index}.function.arguments", call["function"]["arguments"]))
    if doc.get("hitl_action"):
        params = json.dumps(doc["hitl_action"]["params"], ensure_ascii=False, default=str)
        found.append(("hitl_action.params", params))
    if doc.get("native"):
        found.append((NATIVE, json.dumps(doc["native"], ensure_ascii=False, default=str)))
    return found


def _cut(data: bytes, keep: int) -> str:
    """The first `keep` bytes of a text (never half a character) and the mark of a cut."""
    return data[:keep].decode(errors="ignore") + TRUNCATION_MARK


def put_text(doc: dict[str, Any], path: str, text: str, *, cut: bool) -> None:
    """Set the text at `path` of a message document: a cut text, or a whole one put back."""
    parts = path.split(".")
    if path == NATIVE:  # a runtime's own form is kept whole or not at all: never a prefix
        doc[NATIVE] = None if cut else json.loads(text)
        return
    if parts[0] == "hitl_action":
        doc["hitl_action"]["params"] = {"truncated_json": text} if cut else json.loads(text)
        return
    target: Any = doc
    for part in parts[:-1]:
        target = target[int(part)] if part.isdigit() else target[part]
    if parts[-1] == "arguments" and cut:
        # Keep arguments a JSON string even when cut.
        text = json.dumps({"truncated_arguments": text}, ensure_ascii=False)
    target[parts[-1]] = text


def bound(message: AgentMessage, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> BoundedMessage:
    """The message as it is if it fits in `max_bytes` of BSON, else a cut copy and the whole
    texts it lost (every cut field but `search_text`, which is derived).

    Texts are cut to one common length, the longest that fits: every text longer than it
    keeps its first that many bytes. So a message just over the bound keeps nearly all of
    its text, and the searchable part of a cut message is the part a reader sees.

    A cheap bound of the size decides first; the message is encoded only when that bound
    is over `max_bytes`.
    """
    doc = message.model_dump(by_alias=True)
    try:
        if size_bound(doc) <= max_bytes:
            return BoundedMessage(message)
        size = document_size(doc)
    except OverflowError as exc:
        raise InvalidInput(
            f"invalid turn: {_wide_int_path(doc)} is an integer outside BSON's 64-bit range "
            "whose digits no double holds (kept as the nearest one it would lose digits): "
            "send it as a string"
        ) from exc
    if size <= max_bytes:
        return BoundedMessage(message)
    texts = dict(_text_fields(doc))
    encoded = {path: text.encode() for path, text in texts.items()}
    weights = _weights(doc, encoded)
    truncated: dict[str, Truncation | int] = dict(message.truncated or {})
    cut: set[str] = set()
    hashes: dict[str, str] = {}
    reduction, length = 0, None
    while size > max_bytes and length != 0:
        # Usually once; again when escaping or the `truncated` map took more room.
        reduction += size - max_bytes + _MARGIN_BYTES * len(encoded)
        length = common_length(list(weights.values()), reduction)
        for path, data in encoded.items():
            if weights[path] > length:
                put_text(doc, path, _cut(data, length), cut=True)
                cut.add(path)
                kept = None if path in DERIVED_FIELDS or message.id is None else message.id
                if kept and path not in hashes:  # once, however many passes cut it
                    hashes[path] = hashlib.sha256(data).hexdigest()
                # The hash makes the turn's content digest cover the whole text: a replay
                # differing past the cut is another turn.
                truncated[path] = Truncation(
                    length=len(texts[path]),
                    blob_id=kept and blob_id(kept, path),
                    sha256=hashes.get(path),
                )
        doc["truncated"] = {
            path: entry.model_dump() if isinstance(entry, Truncation) else entry
            for path, entry in truncated.items()
        }
        size = document_size(doc)
    return _kept_whole(message, doc, {path: texts[path] for path in cut})


def _weights(doc: Mapping[str, Any], encoded: Mapping[str, bytes]) -> dict[str, int]:
    """What each cut text's field takes in the document, in bytes, as the cut is sized: its
    text's, but for HITL params and a native form, kept as values, whose BSON takes more
    than twice their JSON text (many small values: `[{}, {}, …]`), their BSON's. Sized by
    their text, such a field's cut saves far more than counted, and every other text (the
    person's question) was cut to nothing. Other fields are sized as before, so a message
    cut before is cut alike (a retry's digest)."""
    weights = {path: len(data) for path, data in encoded.items()}
    params = (doc.get("hitl_action") or {}).get("params")
    for path, value in (("hitl_action.params", params), (NATIVE, doc.get(NATIVE))):
        if path in weights and isinstance(value, dict | list):
            size = document_size({"v": value})
            weights[path] = size if size > 2 * weights[path] else weights[path]
    return weights


def _kept_whole(message: AgentMessage, doc: dict[str, Any], cut: dict[str, str]) -> BoundedMessage:
    """The cut message and the whole texts of its cut fields but derived ones."""
    at, conversation_id, message_id = message.created_at, message.conversation_id, message.id
    full_texts = tuple(
        FullText(blob_id(message_id, path), conversation_id, message_id, path, text, at)
        for path, text in cut.items()
        if path not in DERIVED_FIELDS and message_id is not None
    )
    return BoundedMessage(message_adapter.validate_python(doc), full_texts)


def common_length(lengths: list[int], reduction: int) -> int:
    """The longest length L such that cutting every length over L to L removes `reduction`."""
    ordered = sorted(lengths, reverse=True)
    total = 0
    for count, longest in enumerate(ordered, start=1):
        total += longest
        length = (total - reduction) // count
        following = ordered[count] if count < len(ordered) else 0
        if length >= following:
            return max(length, 0)
    return 0


def bound_message(
    message: AgentMessage, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> AgentMessage:
    """The message within `max_bytes` (see `bound`), without the whole texts of what was cut."""
    return bound(message, max_bytes).message
