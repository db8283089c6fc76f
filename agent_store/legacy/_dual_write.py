"""A logged turn as the legacy writer would have stored it, for rollback. Pure, no I/O."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from bson import Int64

from agent_store.core import MAX_SAFE_INTEGER, AgentMessage, Truncation, Usage, bounded_json
from agent_store.legacy._documents import (
    CUT_FIELD,
    EXACT_FIELD,
    WHOLE_TEXTS_FIELD,
    dumps,
    encodes,
)
from agent_store.store import DERIVED_FIELDS, bound_message, document_size, kept_blob_ids


def legacy_turn_id(conversation_id: str, turn_id: str) -> str:
    """The `_id` of a dual-written legacy turn: a rewrite of the same turn replaces it."""
    digest = hashlib.sha256(f"{conversation_id}\0{turn_id}".encode()).hexdigest()
    return "dual-" + digest[:32]


COPY_RECORD = "dual_write_copy"
"""The `kind` of the record the dual write keeps, in the migration's collection
(`MIGRATION_STATE`), of each turn it copied (`copy_record_id`): the one evidence of a copy
the legacy service cannot take away with the copy, so a copy gone is told from a turn never
copied (logged with the dual write off, or by a service without it). Its `COPY_STATE` says
how far the copy got: `COPY_INTENDED`, written before the copy, then `COPY_WRITTEN` once
the copy is; a record holding none is `COPY_WRITTEN` (written after its copy, as an earlier
release wrote it alone)."""

COPY_STATE = "state"
COPY_INTENDED = "intended"
"""A record written before its copy: the copy may never have been written (its write failed,
the runtime told the turn failed), or written and the record's confirmation lost."""
COPY_WRITTEN = "copied"
"""A record confirmed after its copy was written: a copy gone is one deleted since."""

COPY_PIECES = "pieces"
"""The field of a copy's record listing the legacy turns the copy was written as
(`copy_pieces`): a turn is copied as several (one per exchange; a fork's turn one per turn of
its original), each of which the old service may delete alone, so the gate checks each."""


def copy_record_id(conversation_id: str, turn_id: str, epoch: str | None) -> str:
    """The `_id` of the record that the dual write copied a turn of a conversation in the life
    `epoch` (its document's): a digest, naming no one, and another for a conversation started
    again under the id, whose turns may reuse the ids."""
    named = f"{conversation_id}\0{turn_id}\0{epoch or ''}"
    return f"{COPY_RECORD}|{hashlib.sha256(named.encode()).hexdigest()[:32]}"


def _as_found(text: str | None, *, compact: bool) -> Any:
    """JSON text as a value when BSON holds that value (`encodes`: no integer past int64, no
    key holding NUL) and the converter turns it back into the very same text, else the text
    itself, which the legacy format takes too: a round trip through the legacy format changes
    nothing, and a turn's copy is always written. JSON past the bounds the store walks
    (`bounded_json`: more values than a request may hold, nested deeper than a value may) is
    the text too: it is neither parsed nor walked (nested 3,000 deep, its copy failed the turn
    with a RecursionError; MongoDB keeps 100 levels at most)."""
    if text is None:
        return None
    try:
        loaded = bounded_json(text)
    except ValueError:
        return text
    if isinstance(loaded, str) or not encodes(loaded):
        return text
    return loaded if dumps(loaded, compact=compact)[0] == text else text


@dataclass
class _Turn:
    """What one legacy document gathers from a run of a turn's messages opened by at most
    one user or system message (`_pieces`): its opening, then each response as parts, in
    order."""

    user_texts: list[str] = field(default_factory=list)
    uploads: list[dict[str, Any]] = field(default_factory=list)
    parts: list[dict[str, Any]] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)
    natives: list[dict[str, Any]] = field(default_factory=list)
    """The `native` forms of the messages, which no legacy part holds (`NATIVE_FIELD`)."""
    is_system: bool = False

    def add(self, message: AgentMessage) -> None:
        if message.native is not None:
            self.natives.append(message.native.model_dump(mode="json"))
        if message.role in ("user", "system"):
            self.is_system = self.is_system or message.role == "system"
            if message.content:
                self.user_texts.append(message.content)
            if message.upload is not None:
                self.uploads.append(message.upload.model_dump())
        elif message.role == "tool":
            self.parts.append(
                {
                    "type": "tool_result",
                    "tool_name": self.names.get(message.tool_call_id or "", ""),
                    # no content reads back as no text: a null result would read as "null"
                    "result": _as_found(message.content or "", compact=False),
                    "tool_call_id": message.tool_call_id,
                }
            )
        else:
            self._add_response(message)

    def _add_response(self, message: AgentMessage) -> None:
        """A response's parts in the order the converter reads them back: its text, its calls,
        then the prompt asking about them and its error (each one a message of its own)."""
        if message.content and message.hitl_action is None:
            self.parts.append({"type": "text", "content": message.content})
        for call in message.tool_calls or ():
            self.names[call.id] = call.function.name
            self.parts.append(
                {
                    "type": "tool_call",
                    "tool_name": call.function.name,
                    "args": _as_found(call.function.arguments, compact=True),
                    "tool_call_id": call.id,
                }
            )
        if message.hitl_action is not None:
            hitl = message.hitl_action.model_dump(exclude={"tool_call_ids"})  # not a legacy key
            self.parts.append({"type": "hitl", **hitl, "prompt": message.content})
        if message.error is not None:
            self.parts.append({"type": "error", "message": message.error.message})


def exact_form(messages: Iterable[AgentMessage]) -> list[list[Any]]:
    """What messages say, in order, as a dual-written turn must convert back to it: each
    message's pieces (a user's or system text with its upload, a tool result with the call it
    answers, a response's text, each call, its prompt, its error), every text whole as given
    (`""` is not None), a field cut to its bound by its length and digest. A response's
    pieces are not told apart from the same pieces said in one response after another: the
    legacy format holds a text and calls as two responses (MIGRATION.md), the one change
    its conversion makes. A response holding nothing is a piece of its own; one holding a
    runtime's own item alone none (the copy keeps it in `native`, the converter reports it)."""
    form: list[list[Any]] = []
    for message in messages:
        if message.role in ("user", "system"):
            upload = None if message.upload is None else message.upload.model_dump(mode="json")
            form.append([message.role, message.content, upload])
        elif message.role == "tool":
            # no content is written as an empty result (`_Turn.add`), which reads back empty
            form.append(["tool", message.tool_call_id, message.content or ""])
        else:
            form += _response_form(message)
        cut = {
            path: [entry.length, entry.sha256] if isinstance(entry, Truncation) else entry
            for path, entry in (message.truncated or {}).items()
            if path != "search_text"  # derived from the other fields, never kept
        }
        if cut:
            form.append(["cut", cut])
    return form


def _response_form(message: AgentMessage) -> list[list[Any]]:
    form: list[list[Any]] = []
    if message.content is not None and message.hitl_action is None:
        form.append(["text", message.content])
    for call in message.tool_calls or ():
        form.append(["call", call.id, call.function.name, call.function.arguments])
    if message.hitl_action is not None:
        # the calls a prompt holds are not a legacy key: the converter pairs them again
        prompt = message.hitl_action.model_dump(mode="json", exclude={"tool_call_ids"})
        form.append(["prompt", prompt, message.content])
    if message.error is not None:
        form.append(["error", message.error.message])
    if not form and message.native is None:
        form.append(["empty response"])
    return form


def exact_digest(messages: Iterable[AgentMessage]) -> str:
    """The SHA-256 of what the messages say (`exact_form`), in hex."""
    text = json.dumps(exact_form(messages), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


NATIVE_FIELD = "native"
"""The field of a dual-written turn keeping its messages' `native` forms (a runtime's own
item, a reasoning item say), which no legacy part holds: the converter reports it as content
no message holds (`unread_field`), so a copy converted after a rollback never drops it
unseen, and the migration's gate counts it."""


def legacy_turn_document(
    conversation_id: str,
    turn_id: str,
    messages: Sequence[AgentMessage],
    *,
    user_id: str | None,
    name: str | None,
    part: str = "",
    legacy_id: str | None = None,
) -> dict[str, Any]:
    """Messages of a logged turn as a legacy turn document (DESIGN §4), for rollback to the
    old reader: converted back, it is those messages in order when at most its first is a
    user's or system message (`legacy_turn_documents` cuts a turn so); a later one's text
    joins the first's.

    Marked `dual_write: true`: the migration skips these while their messages are stored.
    It records the digest of the messages it was written from (`exact_digest`, under
    `dual_write_exact`) and the GridFS files keeping whole the texts it holds cut
    (`dual_write_whole_texts`): converted without them, it must give exactly those messages,
    or the converter says it does not (`dual_write_not_exact`). The old reader reads neither.
    `part` names a second document of the same turn (its `_id` no turn id can give).
    `legacy_id` is the legacy id a conversation stored under a derived id stands for
    (`Conversation.legacy_conversation_id`): the document names the conversation by it, as
    its legacy turns do and the old reader reads it; its `_id` is still the stored id's.
    """
    turn = _Turn()
    for message in messages:
        turn.add(message)
    # The first upload is `upload_result`; a reader skips the first part repeating it (the
    # old writer recorded it twice), so it is written twice when a later upload repeats it.
    uploads = turn.uploads
    written = uploads if uploads and uploads[0] in uploads[1:] else uploads[1:]
    parts = turn.parts + [{"type": "file_upload", **u} for u in written]
    document: dict[str, Any] = {
        "_id": _piece_id(conversation_id, turn_id, part),
        "conversation_id": legacy_id if legacy_id is not None else conversation_id,
        "user_id": user_id,
        "name": name,
        "created_at": messages[0].created_at,
        "is_system": turn.is_system,
        "user_message": "\n\n".join(turn.user_texts),
        "response_parts": parts,
        "tool_calls": [
            {"tool_name": p["tool_name"], "args": p["args"]}
            for p in parts
            if p["type"] == "tool_call"
        ],
        "response_text": "".join(p["content"] for p in parts if p["type"] == "text"),
        "dual_write": True,
        "turn_id": turn_id,
    }
    if turn.uploads:
        document["upload_result"] = turn.uploads[0]
    if turn.natives:
        document[NATIVE_FIELD] = turn.natives
    return document | _recorded(messages)


def _fitted(
    messages: Sequence[AgentMessage],
    document: dict[str, Any],
    write: Callable[[Sequence[AgentMessage]], dict[str, Any]],
    max_bytes: int | None,
) -> dict[str, Any]:
    """The legacy document of `messages` (`document`, `write` makes it) within `max_bytes` of
    BSON: when over, made of the messages cut further (`bound_message`, marked as the store
    marks its cuts: arguments stay JSON) to half the bound each time until it fits, their
    `native` forms put back after, in order, each whole while the document still fits
    (`_with_natives`). It still records what the messages say whole (`_recorded`), so the copy
    converts to other messages (`dual_write_not_exact`) and is written: a stored turn is never
    refused for it. It names only the GridFS files the store wrote (`_cut_further`) and lists
    each text it cut that no file keeps whole (`CUT_FIELD`)."""
    if max_bytes is None or document_size(document) <= max_bytes:
        return document
    recorded = _recorded(messages)
    bare = [m.model_copy(update={"native": None}) for m in messages]
    each = max_bytes // (2 * len(messages))  # a call's arguments are held twice
    while True:
        cut = [_cut_further(m, bound_message(b, each)) for m, b in zip(messages, bare, strict=True)]
        document = _cut_copy(messages, cut, write, recorded)
        if document_size(document) <= max_bytes or each == 0:
            break
        each //= 2
    return _with_natives(messages, cut, write, recorded, max_bytes) or document


def _cut_further(message: AgentMessage, cut: AgentMessage) -> AgentMessage:
    """The message `cut` further (`bound_message`), its `truncated` entries telling the truth
    of the copy: a field the store had cut keeps the store's entry (its whole text's length,
    digest and GridFS file); a field cut only now names no file, none being written for it."""
    before = message.truncated or {}
    entries: dict[str, Truncation | int] = {
        path: before[path] if path in before else _unkept(entry)
        for path, entry in (cut.truncated or {}).items()
    }
    return cut.model_copy(update={"truncated": entries or None})


def _unkept(entry: Truncation | int) -> Truncation | int:
    """A cut's entry naming no GridFS file."""
    return entry.model_copy(update={"blob_id": None}) if isinstance(entry, Truncation) else entry


def _cut_copy(
    messages: Sequence[AgentMessage],
    cut: Sequence[AgentMessage],
    write: Callable[[Sequence[AgentMessage]], dict[str, Any]],
    recorded: Mapping[str, Any],
) -> dict[str, Any]:
    """The legacy document of `messages` made of them `cut` further: what it records of the
    messages is theirs (`_recorded`), and each text cut that no file keeps whole is listed."""
    document = write(cut)
    document.pop(WHOLE_TEXTS_FIELD, None)
    document |= recorded
    if unkept := _unkept_texts(messages, cut):
        document[CUT_FIELD] = unkept
    return document


def _unkept_texts(
    messages: Sequence[AgentMessage], cut: Sequence[AgentMessage]
) -> list[dict[str, Any]]:
    """Each text of the messages that their `cut` copies hold cut and no GridFS file keeps
    whole (`CUT_FIELD`): its message's `seq`, its path, its whole length and SHA-256."""
    unkept: list[dict[str, Any]] = []
    for message, copy in zip(messages, cut, strict=True):
        before = message.truncated or {}
        for path, entry in (copy.truncated or {}).items():
            if path not in before and path not in DERIVED_FIELDS and isinstance(entry, Truncation):
                unkept.append(_cut_entry(message.seq, path, entry.length, entry.sha256))
        if message.native is not None and copy.native is None:
            dumped = message.model_dump(by_alias=True)["native"]
            text = json.dumps(dumped, ensure_ascii=False, default=str)  # as the store digests it
            digest = hashlib.sha256(text.encode()).hexdigest()
            unkept.append(_cut_entry(message.seq, "native", len(text), digest))
    return unkept


def _cut_entry(seq: int | None, path: str, length: int, sha256: str | None) -> dict[str, Any]:
    return {"seq": seq, "path": path, "length": length, "sha256": sha256}


def _with_natives(
    messages: Sequence[AgentMessage],
    cut: Sequence[AgentMessage],
    write: Callable[[Sequence[AgentMessage]], dict[str, Any]],
    recorded: Mapping[str, Any],
    max_bytes: int,
) -> dict[str, Any] | None:
    """The document of the messages `cut` with their `native` forms put back: all of them
    when they fit (one more document made), else each in order, whole, while the document
    still fits; None when none fits."""
    natives = [i for i, m in enumerate(messages) if m.native is not None]
    if not natives:
        return None

    def with_native(kept: Sequence[AgentMessage], index: int) -> list[AgentMessage]:
        native = messages[index].native
        return [
            m.model_copy(update={"native": native}) if i == index else m for i, m in enumerate(kept)
        ]

    every: list[AgentMessage] = list(cut)
    for index in natives:
        every = with_native(every, index)
    document = _cut_copy(messages, every, write, recorded)
    if document_size(document) <= max_bytes:
        return document
    kept, found = list(cut), None
    for index in natives:
        trial = with_native(kept, index)
        candidate = _cut_copy(messages, trial, write, recorded)
        if document_size(candidate) <= max_bytes:
            kept, found = trial, candidate
    return found


def _recorded(messages: Sequence[AgentMessage]) -> dict[str, Any]:
    """What a legacy turn records of its messages beside its parts: the digest of what they
    say (`exact_digest`), the GridFS files keeping whole the texts it holds cut, and their
    token usage and latency summed."""
    recorded: dict[str, Any] = {EXACT_FIELD: exact_digest(messages)}
    if whole := [b for m in messages for b in kept_blob_ids(m).values()]:
        recorded[WHOLE_TEXTS_FIELD] = whole
    usage = [m.token_usage for m in messages if m.token_usage is not None]
    if usage:
        total = Usage.total((u.input_tokens for u in usage), (u.output_tokens for u in usage))
        recorded["token_usage"] = total.model_dump()  # saturated sums, int64 as stored
    latency = [m.latency_ms for m in messages if m.latency_ms is not None]
    if latency:
        recorded["latency_ms"] = Int64(min(sum(latency), MAX_SAFE_INTEGER))
    return recorded


def legacy_turn_documents(
    conversation_id: str,
    turn_id: str,
    messages: Sequence[AgentMessage],
    *,
    user_id: str | None,
    name: str | None,
    legacy_id: str | None = None,
    starts: Collection[int] = (),
    listed: Sequence[Mapping[str, Any]] | None = None,
    max_bytes: int | None = None,
) -> list[dict[str, Any]]:
    """A logged turn as legacy turn documents: one (`legacy_turn_document`) per run of its
    messages, cut at the `seq`s of `starts` (a fork's copies: where the turns of its original
    began, `ForkOrigin.turn_starts`, so the old reader reads the fork's history turn by turn,
    as the original's), each named apart by its first `seq`; and a run cut again before each
    user or system message but its first (`_pieces`): one legacy turn opens with one user's
    message, or is a system turn holding its system text alone, so each converts back to
    its messages in order. A copy whose record lists its legacy turns (`listed`, the
    record's `COPY_PIECES`) is cut as they say (`_listed_cut`): as it was first written,
    whatever the conversation's document says now. With `max_bytes`, each document fits in
    that much BSON (`_fitted`)."""
    documents: list[dict[str, Any]] = []
    for piece, piece_id in _cut(conversation_id, turn_id, messages, starts, listed):

        def write(messages: Sequence[AgentMessage], piece_id: str = piece_id) -> dict[str, Any]:
            return legacy_turn_document(
                conversation_id,
                turn_id,
                messages,
                user_id=user_id,
                name=name,
                legacy_id=legacy_id,
            ) | {"_id": piece_id}

        documents.append(_fitted(piece, write(piece), write, max_bytes))
    return documents


def copy_pieces(
    conversation_id: str,
    turn_id: str,
    messages: Sequence[AgentMessage],
    *,
    starts: Collection[int] = (),
) -> list[dict[str, Any]]:
    """The legacy turns a logged turn is copied as (`legacy_turn_documents`, cut alike), as
    the record of its copy lists them (`COPY_PIECES`): each one's `_id` and the first and
    last `seq` of the messages it holds. No name, no content."""
    return [
        {"_id": piece_id, "seqs": [piece[0].seq, piece[-1].seq]}
        for piece, piece_id in _cut(conversation_id, turn_id, messages, starts, None)
    ]


def piece_starts(
    conversation_id: str, turn_id: str, seqs: Iterable[int], ids: Collection[Any]
) -> set[int]:
    """The `seq`s (among `seqs`) that legacy turns of a turn's copy with these `_id`s are
    named by (`_pieces`: a piece opening at a `seq`, or a run's system piece): where the copy
    standing was cut, whatever cut it."""
    return {
        seq
        for seq in seqs
        if any(
            _piece_id(conversation_id, turn_id, f"seq-{seq}{end}") in ids for end in ("", "system")
        )
    }


def cut_as_listed(messages: Sequence[AgentMessage], listed: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a copy's record lists its legacy turns so that `legacy_turn_documents` cuts
    these messages as it says (`_listed_cut`): each bounded by its `seq`s, every message
    held by one."""
    return _listed_cut(messages, listed) is not None


def _cut(
    conversation_id: str,
    turn_id: str,
    messages: Sequence[AgentMessage],
    starts: Collection[int],
    listed: Sequence[Mapping[str, Any]] | None,
) -> list[tuple[Sequence[AgentMessage], str]]:
    """A logged turn's messages as the pieces each legacy turn of its copy holds, each with
    that legacy turn's `_id`: as its record lists them (`listed`, `_listed_cut`) when it
    says, else cut at `starts` and at each user or system message (`_turn_pieces`)."""
    if listed is not None and (by_record := _listed_cut(messages, listed)) is not None:
        return by_record
    return [
        (piece, _piece_id(conversation_id, turn_id, suffix))
        for piece, suffix in _turn_pieces(messages, starts)
    ]


def _listed_cut(
    messages: Sequence[AgentMessage], listed: Sequence[Mapping[str, Any]]
) -> list[tuple[Sequence[AgentMessage], str]] | None:
    """The messages each legacy turn a copy's record lists holds (`COPY_PIECES`: its `_id`,
    the first and last `seq` it holds), with its `_id`; one holding no message still stored
    (popped) left out. None when the record does not say: a legacy turn listed without its
    `seq`s (an earlier release's record), or a message held by none or by two."""
    cut: list[tuple[Sequence[AgentMessage], str]] = []
    for piece in listed:
        if not isinstance(piece, Mapping):
            return None
        piece_id, seqs = piece.get("_id"), piece.get("seqs")
        bounded = isinstance(seqs, list) and len(seqs) == 2 and all(type(s) is int for s in seqs)
        if not isinstance(piece_id, str) or not bounded:
            return None
        first, last = seqs  # type: ignore[misc]
        if held := [m for m in messages if m.seq is not None and first <= m.seq <= last]:
            cut.append((held, piece_id))
    if sorted(id(m) for held, _ in cut for m in held) != sorted(id(m) for m in messages):
        return None
    return cut


def _piece_id(conversation_id: str, turn_id: str, part: str) -> str:
    """The `_id` of the legacy turn holding the piece of a turn named `part` ("" the first)."""
    return legacy_turn_id(conversation_id, f"{turn_id}\0{part}" if part else turn_id)


def _turn_pieces(
    messages: Sequence[AgentMessage], starts: Collection[int]
) -> list[tuple[Sequence[AgentMessage], str]]:
    """A logged turn's messages as the pieces each legacy turn of its copy holds, each with
    the part naming it: cut at the `seq`s of `starts`, each run named by its first `seq`,
    then each run cut again (`_pieces`)."""
    cuts = [i for i, m in enumerate(messages) if i and m.seq in starts]
    pieces: list[tuple[Sequence[AgentMessage], str]] = []
    for first, end in pairwise([0, *cuts, len(messages)]):
        run = messages[first:end]
        pieces += _pieces(run, f"seq-{run[0].seq}" if first else "")
    return pieces


def _pieces(run: Sequence[AgentMessage], part: str) -> list[tuple[Sequence[AgentMessage], str]]:
    """A run of a turn's messages as the legacy turns holding it, each with the part naming
    it: cut before each user or system message but the first, and after each system message
    (a system turn holds its text alone). The first piece opened by a system message is
    named `part` + "system" and the first other one `part` when the run holds a user's
    message beside a system one (as they were named before a run was cut further); any
    other piece is named by its first `seq`."""
    bounds = [
        i
        for i, m in enumerate(run)
        if i and (m.role in ("user", "system") or run[i - 1].role == "system")
    ]
    pieces = [run[a:b] for a, b in pairwise([0, *bounds, len(run)])]
    split = any(m.role == "system" for m in run) and any(m.role == "user" for m in run)
    named: list[tuple[Sequence[AgentMessage], str]] = []
    system_named = user_named = False
    for index, piece in enumerate(pieces):
        opens_system = piece[0].role == "system"
        if split and opens_system and not system_named:
            system_named, suffix = True, part + "system"
        elif (not split and index == 0) or (split and not opens_system and not user_named):
            user_named, suffix = True, part
        else:
            suffix = f"seq-{piece[0].seq}"
        named.append((piece, suffix))
    return named
