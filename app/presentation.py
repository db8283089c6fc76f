"""How stored messages and legacy turn documents read on the viewer's pages. Pure, no I/O.

Legacy documents are whatever old code wrote, so every field is optional here
and anything unknown is shown raw rather than dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from datetime import datetime
from typing import Any, TypeVar

from agent_store.core import AgentMessage, PendingHitl, calls_answered
from agent_store.legacy import flag, normalize_part, not_utf8_at, part_text, storable_text
from agent_store.store import (
    DERIVED_FIELDS,
    HIDDEN_CHARACTERS,
    PAGE_BYTES,
    SearchHit,
    message_text,
    shorten,
)

SNIPPET_CHARS = 300
PRETTY_DEPTH = 32
"""JSON nested deeper than this is shown as stored rather than indented."""
PRETTY_GROWTH = 4
PRETTY_SLACK = 4_096
"""JSON indented is at most `PRETTY_GROWTH` times its length and `PRETTY_SLACK` characters
more (a small text may grow more, a large one not): longer, it is shown as stored, so a
page costs a few times what it shows, never its size times its depth."""
PAGE_SHOWS = PAGE_BYTES
"""About how many bytes of HTML a viewer page prints at most of the texts it shows, counted
as printed (`shown_bytes`: a hidden character as its six-character escape, `<` as `&lt;`,
JSON as indented, in UTF-8), as an API page holds about `PAGE_BYTES` (`within_page`)."""
WHOLE_TEXT_CHARS = 256
"""A text up to this long (a role, an id, a name, a label) is never cut to fit a page."""
ROLE_LABELS = {
    "system": "System trigger",
    "user": "User",
    "assistant": "Assistant",
    "tool": "Tool result",
}


_HIDDEN_FOUND = re.compile("[" + "".join(map(re.escape, sorted(HIDDEN_CHARACTERS))) + "]")
"""A hidden character, sought at C speed: `str.translate` takes a Python step per character
of a text that is not ASCII (1.3 s for 4 MB), a search a few milliseconds."""

_HIDDEN_ESCAPES = str.maketrans({c: f"\\u{ord(c):04x}" for c in HIDDEN_CHARACTERS})
"""Each hidden character's JSON escape: `hidden_shown` writes them all in one pass at C speed
(a Python call per character took 2.3 s for a text of a million controls)."""


def hidden_shown(text: str) -> str:
    """The text as a page prints it: each character that would make a line show other than
    it reads (`HIDDEN_CHARACTERS`: a control, a text-direction override, embedding, isolate or
    mark) written as its JSON escape, `\\u202e` for U+202E, the rest as it is. The one rule
    for every text the viewer prints (its templates' `finalize`): in JSON text the escape
    stands for the same string, elsewhere it shows what is there instead of obeying it."""
    if text.isascii() and text.isprintable():  # the ASCII ones are all unprintable
        return text
    if _HIDDEN_FOUND.search(text) is None:  # a text holding none is not translated
        return text
    return text.translate(_HIDDEN_ESCAPES)


_PRINTED = str.maketrans(
    {c: f"\\u{ord(c):04x}" for c in HIDDEN_CHARACTERS}
    | {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&#34;", "'": "&#39;"}
)
"""What a page prints for each character `hidden_shown` and HTML escaping change."""


def shown_bytes(text: str) -> int:
    """How many bytes a page prints of `text`: as `hidden_shown` writes it, escaped for HTML,
    in UTF-8; counted at C speed (a text holding no hidden character by its escapes' counts,
    not translated)."""
    if _HIDDEN_FOUND.search(text) is None:
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        quoted = text.count("&") + text.count('"') + text.count("'")  # &amp; &#34; &#39;
        return size + 4 * quoted + 3 * (text.count("<") + text.count(">"))  # &lt; &gt;
    printed = text.translate(_PRINTED)
    return len(printed) if printed.isascii() else len(printed.encode("utf-8", "surrogatepass"))


_JSON_TOKENS = re.compile(r'"(?:[^"\\]+|\\.)*"|[{}\[\],:]|[^ \t\n\r{}\[\],:"]+')
"""The tokens of JSON text: a string literal, a bracket, a comma or colon, another value."""


_INDENTS = ["\n" + "  " * depth for depth in range(PRETTY_DEPTH + 1)]
"""A new line and the indent of each level `_reindented` writes, made once."""


def _reindented(text: str, most: int) -> tuple[str | None, int]:
    """Valid JSON `text` indented by two spaces per level, every token as written: only the
    white space between tokens changes (a repeated key, `1E5`, an escape stay); None once
    the indented text would pass `most` characters, or its objects and arrays nest deeper
    than `PRETTY_DEPTH` (indenting grows with the square of the depth), built no further.
    With it, how many characters indenting built: the work it took."""
    out: list[str] = []
    depth, last, size = 0, "", 0
    for token in _JSON_TOKENS.findall(text):
        opened = last in ("{", "[")
        if token in ("}", "]"):
            depth -= 1
            piece = token if opened else _INDENTS[depth] + token
        elif token == ",":
            piece = "," + _INDENTS[depth]
        else:
            piece = ": " if token == ":" else token
            if opened:
                piece = _INDENTS[depth] + piece
            if token in ("{", "["):
                depth += 1
                if depth > PRETTY_DEPTH:
                    return None, size
        if size + len(piece) > most:
            return None, size
        out.append(piece)
        last = token
        size += len(piece)
    return "".join(out), size


def pretty_json(value: Any, room: int | None = None) -> str:
    """JSON (given parsed or as text) indented for reading; other text as it is.

    Stored text is shown as stored: JSON text is indented token by token, changing nothing
    but its white space (its strings, numbers and keys as written, a repeated key kept);
    text that is no JSON, nests too deeply to parse or indent, or would grow past
    `PRETTY_GROWTH` times its length indented, is shown as it was stored. A parsed value is
    written as JSON text first, then shown by the same rule. A page prints either through
    `hidden_shown`, so a direction override or a control in a string, escaped by the client
    or not, is shown as its JSON escape.

    `room`: how many characters the page has left to print (`PageRoom`). Text longer is shown
    as stored, neither parsed nor indented (the page cuts it to fit, or ends before it), and
    indenting stops once it would pass it: the work follows what a page prints, never what
    was stored (a 14 MB result was indented whole for a page of 4 MiB: 14 s).
    """
    return _pretty(value, room)[0]


def _pretty(value: Any, room: int | None) -> tuple[str, int]:
    """`pretty_json`, and how many characters showing it took of `room`: what it prints, or
    when indenting it was tried and given up, what indenting built, if more (a text nested
    too deep, given up early, takes what it prints)."""
    try:
        text = (
            value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        )
    except (TypeError, ValueError, RecursionError):
        return str(value), len(str(value))
    if room is not None and len(text) > room:
        return text, len(text)
    if isinstance(value, str):
        try:
            json.loads(text)
        except (ValueError, RecursionError):
            return text, len(text)
    # Each value takes a line of two spaces per level: a wide value deep down would take
    # `PRETTY_DEPTH` times its size, so indenting stops at a few times the text's.
    most = PRETTY_GROWTH * len(text) + PRETTY_SLACK
    most = most if room is None else min(most, room)
    indented, built = _reindented(text, most)
    return (text, max(built, len(text))) if indented is None else (indented, built)


class PageRoom:
    """What a page has left to print of the JSON it shows (`pretty_json`): each text takes
    what it prints, or what indenting it built before it was given up, if more, so a page
    indents (or tries to) at most what it can print, whatever it reads."""

    def __init__(self, left: int = PAGE_SHOWS) -> None:
        self.left = left

    def pretty(self, value: Any) -> str:
        """`value` as `pretty_json` shows it within the room left, which it takes."""
        shown, taken = _pretty(value, max(0, self.left))
        self.left -= taken
        return shown


def human_size(size: int) -> str:
    amount = float(size)
    for unit in ("bytes", "KiB", "MiB"):
        if amount < 1024 or unit == "MiB":
            return f"{size} bytes" if unit == "bytes" else f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{size} bytes"


def when(value: Any) -> str:
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S UTC")
    return "" if value is None else str(value)


def usage_text(usage: Mapping[str, Any] | None, latency_ms: Any) -> str:
    parts = []
    if usage:
        parts.append(
            f"{usage.get('input_tokens', 0)} tokens in · {usage.get('output_tokens', 0)} out"
        )
    if latency_ms is not None:
        parts.append(f"{latency_ms} ms")
    return " · ".join(parts)


@dataclass(frozen=True)
class ToolCallView:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class UploadView:
    filename: str
    file_type: str
    size: str
    parsed_text: str | None


@dataclass(frozen=True)
class HitlView:
    action: str
    params: str
    request_id: str
    pending: bool


@dataclass(frozen=True)
class MessageView:
    """One message as a person reads it."""

    seq: int | None
    role: str
    label: str
    created_at: str
    turn_id: str | None
    content: str | None
    tool_calls: list[ToolCallView] = field(default_factory=list)
    answers: str | None = None
    """For a tool result: the call it answers, as `name (id)`."""
    hitl: HitlView | None = None
    error: str | None = None
    upload: UploadView | None = None
    usage: str = ""
    truncated: list[str] = field(default_factory=list)
    kept_whole: bool = False
    """Some cut field's whole text is kept: the transcript can show it (`?full=true`)."""
    printed_whole: int | None = None
    """How many bytes it prints whole, when a page shows it cut to fit (`cut_to_fit`)."""


def _cut_fields(message: AgentMessage) -> list[str]:
    """The fields a reader sees that were cut, with their lengths (derived ones are not seen)."""
    return [
        f"{path} (was {v if isinstance(v, int) else v.length} characters"
        + (", kept whole)" if not isinstance(v, int) and v.blob_id else ")")
        for path, v in (message.truncated or {}).items()
        if path not in DERIVED_FIELDS
    ]


def calls_made_before(messages: Sequence[AgentMessage]) -> list[str]:
    """The call ids of the tool results among `messages` that answer no call among them, once
    per such result: on a page of a transcript, those that take a call made before the page
    (`message_views(before=)` pairs them with the messages before it that
    `ConversationStore.calls_before` reads). A result takes the latest earlier call of its
    id still without an answer (`calls_answered`), so one whose every earlier call on the
    page is answered takes one before the page too, if one is still open there."""
    answered = calls_answered(messages)
    taken: set[tuple[int, str]] = set()
    ids = []
    for index, m in enumerate(messages):
        if m.tool_call_id is None:
            continue
        call = answered.get(index)
        if call is None or call in taken:
            ids.append(m.tool_call_id)
        if call is not None:
            taken.add(call)
    return ids


def _answers(
    messages: Sequence[AgentMessage], before: Sequence[AgentMessage] = ()
) -> dict[int, str]:
    """What each tool result answers, by its index, as `name (id)`: the call the store pairs
    it with (`calls_answered`: the latest earlier call of its id without an answer, so a
    provider reusing `call_0` every turn names each turn's own), among `before` (earlier
    messages making and answering calls) and `messages`; `unknown tool` for one answering
    none of them."""
    whole = [*before, *messages]
    answered = calls_answered(whole)
    answers = {}
    for index, m in enumerate(messages, start=len(before)):
        if m.tool_call_id is None:
            continue
        name = "unknown tool"
        if (call := answered.get(index)) is not None:
            at, call_id = call
            made = whole[at].tool_calls or ()
            name = next((c.function.name for c in made if c.id == call_id), name)
        answers[index - len(before)] = f"{name} ({m.tool_call_id})"
    return answers


def _hitl_view(
    message: AgentMessage, pending: PendingHitl | None, room: PageRoom
) -> HitlView | None:
    """A message's prompt, pending only if it is the one the conversation holds pending (by
    its message: a later prompt may ask the same request id again)."""
    prompt = message.hitl_action
    if prompt is None:
        return None
    is_pending = pending is not None and message.id is not None and pending.message_id == message.id
    return HitlView(prompt.action, room.pretty(prompt.params), prompt.request_id, is_pending)


def message_views(
    messages: Sequence[AgentMessage],
    *,
    pending: PendingHitl | None = None,
    before: Sequence[AgentMessage] = (),
    room: int = PAGE_SHOWS,
) -> Iterator[MessageView]:
    """The messages as a person reads them, one at a time (a page takes those it shows,
    `within_page`); `pending` the conversation's `pending_hitl`; `before` the messages before
    them making and answering the calls their results may answer (a page of a transcript
    names calls made on an earlier page: `calls_made_before`,
    `ConversationStore.calls_before`); `room` what the page prints at most (`within_page`),
    which bounds the JSON they indent (`PageRoom`)."""
    answers = _answers(messages, before)
    left = PageRoom(room)
    for index, m in enumerate(messages):
        yield _message_view(m, answers.get(index), pending, left)


def _message_view(
    m: AgentMessage, answers: str | None, pending: PendingHitl | None, room: PageRoom
) -> MessageView:
    content = m.content
    if m.role == "tool" and content is not None:
        content = room.pretty(content)
    return MessageView(
        seq=m.seq,
        role=m.role,
        label=ROLE_LABELS[m.role],
        created_at=when(m.created_at),
        turn_id=m.turn_id,
        content=content,
        tool_calls=[
            ToolCallView(c.id, c.function.name, room.pretty(c.function.arguments))
            for c in m.tool_calls or ()
        ],
        answers=answers,
        hitl=_hitl_view(m, pending, room),
        error=m.error.message if m.error else None,
        upload=(
            UploadView(
                m.upload.filename,
                m.upload.file_type,
                human_size(m.upload.size),
                m.upload.parsed_text,
            )
            if m.upload
            else None
        ),
        usage=usage_text(m.token_usage.model_dump() if m.token_usage else None, m.latency_ms),
        truncated=_cut_fields(m),
        kept_whole=any(not isinstance(v, int) and v.blob_id for v in (m.truncated or {}).values()),
    )


@dataclass(frozen=True)
class TranscriptPages:
    """Where one page of a long transcript sits: it starts at `from_seq`."""

    from_seq: int
    first_seq: int | None
    last_seq: int | None
    previous_from: int | None
    """Where the page before starts (None on the first page)."""
    next_from: int | None
    """Where the page after starts (None on the last page)."""

    @classmethod
    def of(
        cls,
        messages: Sequence[AgentMessage],
        shown: int,
        more: bool,
        from_seq: int,
        per_page: int,
    ) -> TranscriptPages:
        """The pages around the first `shown` of `messages`, those read from `from_seq` on
        (`more`: and more follow them): a page shows up to `per_page`, fewer when they fill
        it (`within_page`), and the next starts at the first not shown."""
        on_page = messages[:shown]
        next_from = None
        if shown < len(messages):
            next_from = messages[shown].seq
        elif more and on_page and on_page[-1].seq is not None:
            next_from = on_page[-1].seq + 1
        return cls(
            from_seq=from_seq,
            first_seq=on_page[0].seq if on_page else None,
            last_seq=on_page[-1].seq if on_page else None,
            previous_from=max(0, from_seq - per_page) if from_seq > 0 else None,
            next_from=next_from,
        )

    @property
    def paged(self) -> bool:
        return self.previous_from is not None or self.next_from is not None


@dataclass(frozen=True)
class SearchHitView:
    """One message found by full-text search, with where it sits."""

    conversation_id: str
    seq: int | None
    label: str
    created_at: str
    snippet: str


def search_hit_view(hit: SearchHit) -> SearchHitView:
    message = hit.message
    return SearchHitView(
        conversation_id=message.conversation_id or "",
        seq=message.seq,
        label=ROLE_LABELS[message.role],
        created_at=when(message.created_at),
        snippet=shorten(message_text(message), SNIPPET_CHARS),
    )


@dataclass(frozen=True)
class LegacyPartView:
    kind: str
    title: str
    body: str


@dataclass(frozen=True)
class LegacyTurnView:
    """One legacy turn document, readable."""

    id: str
    created_at: str
    is_system: bool
    user_message: str
    name: str | None
    upload: UploadView | None
    parts: list[LegacyPartView]
    usage: str
    other_fields: list[str]
    """Top-level keys the viewer does not render (shown so nothing is hidden)."""
    printed_whole: int | None = None
    """How many bytes it prints whole, when a page shows it cut to fit (`cut_to_fit`)."""
    not_utf8: str | None = None
    """Where a text of it holds bytes that are not valid UTF-8 (`not_utf8_at`), each shown
    as its escape (`escaped_as_stored`); None when none does."""


_KNOWN_TURN_KEYS = {
    "_id",
    "conversation_id",
    "user_id",
    "name",
    "created_at",
    "is_system",
    "user_message",
    "upload_result",
    "response_parts",
    "tool_calls",
    "response_text",
    "token_usage",
    "latency_ms",
    "message_history_json",
}


def _upload(value: Any) -> UploadView | None:
    if not isinstance(value, Mapping):
        return None
    size = value.get("size")
    return UploadView(
        str(value.get("filename", "?")),
        str(value.get("file_type", "?")),
        human_size(size) if isinstance(size, int) else str(size),
        value.get("parsed_text"),
    )


def legacy_part_view(raw: Any, room: PageRoom | None = None) -> LegacyPartView:
    """One legacy response part, read through the converter's own part reader; its JSON
    indented within `room` (`PageRoom`: a page's, else one of `PAGE_SHOWS`)."""
    room = room or PageRoom()
    part = normalize_part(raw)
    call_id = f" ({part.tool_call_id})" if part.tool_call_id else ""
    if part.kind == "text":
        return LegacyPartView(part.kind, "Text", str(part.content or ""))
    if part.kind == "tool_call":
        title = f"Tool call: {part.tool_name or '?'}{call_id}"
        return LegacyPartView(part.kind, title, room.pretty(part.args or {}))
    if part.kind == "tool_result":
        title = f"Tool result: {part.tool_name or '?'}{call_id}"
        return LegacyPartView(part.kind, title, room.pretty(part.result))
    if part.kind == "file_upload":
        upload = _upload(part.upload)
        assert upload is not None
        return LegacyPartView(
            part.kind, f"File: {upload.filename}", f"{upload.file_type}, {upload.size}"
        )
    if part.kind == "hitl":
        title = f"HITL prompt: {part.action or '?'} [{part.request_id or '?'}]"
        body = (part_text(part) or "") + "\n" + room.pretty(part.params or {})
        return LegacyPartView(part.kind, title, body.strip())
    if part.kind == "error":
        return LegacyPartView(part.kind, "Error", str(part.content or ""))
    if not isinstance(raw, Mapping):
        return LegacyPartView("unknown", "Unreadable part", room.pretty(raw))
    fields = {k: v for k, v in raw.items() if k not in ("type", "part_kind")}
    return LegacyPartView("unknown", f"Unknown part type {part.declared!r}", room.pretty(fields))


def escaped_as_stored(value: Any) -> Any:
    """A legacy document read as stored (`read_as_stored`) as a page prints it: each byte of
    its texts (keys too) that is not valid UTF-8, read as a lone surrogate, written as its
    escape (`storable_text`: `\\udcc3`), which no page could print as it is."""
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, Mapping):
        return {escaped_as_stored(k): escaped_as_stored(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [escaped_as_stored(item) for item in value]
    return value


def legacy_turn_view(doc: Mapping[str, Any], room: PageRoom | None = None) -> LegacyTurnView:
    """One legacy turn document, readable; its JSON indented within `room` (`PageRoom`). One
    holding text that is not valid UTF-8 (read as stored) is shown escaped, where it does
    named (`not_utf8`), whatever field holds it: what an operator corrects."""
    room = room or PageRoom()
    not_utf8 = not_utf8_at(doc)
    doc = escaped_as_stored(doc) if not_utf8 is not None else doc
    parts = doc.get("response_parts")
    return LegacyTurnView(
        id=str(doc.get("_id", "")),
        created_at=when(doc.get("created_at")),
        is_system=flag(doc.get("is_system")) is True,
        user_message=str(doc.get("user_message") or ""),
        name=doc.get("name"),
        upload=_upload(doc.get("upload_result")),
        parts=[legacy_part_view(p, room) for p in parts] if isinstance(parts, list) else [],
        usage=usage_text(
            doc.get("token_usage") if isinstance(doc.get("token_usage"), Mapping) else None,
            doc.get("latency_ms"),
        ),
        other_fields=sorted(str(k) for k in doc if k not in _KNOWN_TURN_KEYS),
        not_utf8=not_utf8,
    )


def legacy_turn_views(
    docs: Iterable[Mapping[str, Any]], room: int = PAGE_SHOWS
) -> Iterator[LegacyTurnView]:
    """Legacy turn documents as a page reads them, one at a time (`within_page`), the JSON
    they indent bounded by `room`, what the page prints at most (`PageRoom`)."""
    left = PageRoom(room)
    for doc in docs:
        yield legacy_turn_view(doc, left)


_View = TypeVar("_View")


def within_page(views: Iterable[_View], room: int = PAGE_SHOWS) -> tuple[list[_View], bool]:
    """The views a page shows, taken one at a time: each while what they print together stays
    within `room` bytes (`view_bytes`), and whether the page ended before one that would pass
    it (more follow: the page's next link starts there). The first is shown whatever its
    size, cut to fit when it alone passes `room` (`cut_to_fit`), so a page always shows one
    and always moves on. What a page costs follows what it shows, never what is stored: no
    view is built past the first that does not fit."""
    shown: list[_View] = []
    left = room
    for view in views:
        size = view_bytes(view)
        if size > left:
            if shown:
                return shown, True
            view = cut_to_fit(view, room, size)
        shown.append(view)
        left -= size
    return shown, False


def whole_within(messages: Sequence[AgentMessage], room: int = PAGE_SHOWS) -> list[AgentMessage]:
    """The first of `messages` whose whole texts, the fields the store cut put back from
    GridFS, stay within `room` characters together (the first whatever its size): what a
    page showing whole texts reads back, bounded as what it shows is (`within_page`)."""
    taken: list[AgentMessage] = []
    left = room
    for message in messages:
        kept = (message.truncated or {}).values()
        size = sum(cut.length for cut in kept if not isinstance(cut, int) and cut.blob_id)
        if taken and size > left:
            break
        taken.append(message)
        left -= size
    return taken


def view_bytes(view: Any) -> int:
    """How many bytes a page prints of the texts of a view (its fields, the views and lists
    in them), each as `shown_bytes` counts it."""
    return sum(shown_bytes(text) for text in _texts(view))


def _texts(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)
    elif is_dataclass(value) and not isinstance(value, type):
        for each in fields(value):
            yield from _texts(getattr(value, each.name))


def cut_to_fit(view: _View, room: int, whole: int) -> _View:
    """A view too large for a page (`whole` bytes printed), its long texts (past
    `WHOLE_TEXT_CHARS`) cut in the order it prints them so that all it prints fits `room`,
    and its `printed_whole` saying so: its short ones (a role, an id, a name) stay whole."""
    short = sum(shown_bytes(t) for t in _texts(view) if len(t) <= WHOLE_TEXT_CHARS)
    fitted: Any = _fitted(view, [max(0, room - short)])
    cut: _View = replace(fitted, printed_whole=whole)
    return cut


def _fitted(value: Any, room: list[int]) -> Any:
    """`value` with each long text cut to what `room[0]` has left, which it takes."""
    if isinstance(value, str):
        if len(value) <= WHOLE_TEXT_CHARS:
            return value
        kept = _cut_text(value, room[0])
        room[0] -= shown_bytes(kept)
        return kept
    if isinstance(value, list):
        return [_fitted(item, room) for item in value]
    if is_dataclass(value) and not isinstance(value, type):
        changes = {each.name: _fitted(getattr(value, each.name), room) for each in fields(value)}
        return replace(value, **changes)
    return value


def _cut_text(text: str, room: int) -> str:
    """The longest start of `text` that prints at most `room` bytes (`shown_bytes`), found by
    halving (each try at C speed), an ellipsis after it when that is not all of it."""
    if shown_bytes(text) <= room:
        return text
    room = max(0, room - len("…".encode()))
    fits, over = 0, min(len(text), room + 1)  # text[:fits] fits, text[:over] does not
    while over - fits > 1:
        middle = (fits + over) // 2
        if shown_bytes(text[:middle]) <= room:
            fits = middle
        else:
            over = middle
    return text[:fits] + "…"
