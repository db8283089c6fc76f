"""Pure text rules: what of a message is stored, shown, named and searched."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ValidationError

from agent_store.core import (
    AgentMessage,
    InvalidInput,
    NativeForm,
    describe_validation_error,
    shown_key,
    voice_marker,
)
from agent_store.store._values import storable

ELLIPSIS = "…"


@dataclass(frozen=True)
class RuntimeContextMarkers:
    """The markers around hidden context a runtime prepends to the model input.

    ValueError for a marker of white space alone (or empty): it would match between the
    user's words, and each user message would be stored cut at its first space (a start
    marker hides the rest) or kept from its last (an end marker hides what is before it).
    White space around a marker's text (`"<<CONTEXT\n"`) is part of it. ValueError too for
    markers equal to each other, or one holding the other: the text could not tell a start from
    an end."""

    start: str = "[RUNTIME CONTEXT]"
    end: str = "[/RUNTIME CONTEXT]"

    def __post_init__(self) -> None:
        refuse_blank_marker(self.start)
        refuse_blank_marker(self.end)
        if self.start in self.end or self.end in self.start:
            raise ValueError(
                "the runtime context start and end markers must differ, neither holding the "
                "other: the text could not tell them apart, and a block would hide the user's "
                "words around it"
            )


def refuse_blank_marker(marker: str) -> None:
    """ValueError for a runtime context marker of white space alone (or empty)."""
    if not marker.strip():
        raise ValueError(
            "a runtime context marker must hold more than white space: one of white space "
            "alone would match between the user's words and hide them"
        )


DEFAULT_MARKERS = RuntimeContextMarkers()


def _visible_spans(text: str, markers: RuntimeContextMarkers) -> list[tuple[int, int]]:
    """The `(start, end)` ranges of `text` outside every hidden block, in order.

    Blocks nest: a block ends at the end marker that matches its start
    marker, however many blocks open inside it. Where the markers do not
    balance, more is hidden, never less: a block never closed hides the rest
    of the text, and an end marker whose start is not in the text (cut off,
    or in a part the runtime sent before) hides everything before it.
    """
    tokens = re.compile(f"({re.escape(markers.end)})|{re.escape(markers.start)}")
    spans: list[tuple[int, int]] = []
    depth, visible_from = 0, 0
    for token in tokens.finditer(text):
        is_end = token.group(1) is not None
        if not is_end:
            if depth == 0:
                spans.append((visible_from, token.start()))
            depth += 1
        elif depth == 0:  # a block whose start is missing: all before it may be hidden
            spans.clear()
            visible_from = token.end()
        else:
            depth -= 1
            if depth == 0:
                visible_from = token.end()
    if depth == 0:
        spans.append((visible_from, len(text)))
    return [(start, end) for start, end in spans if end > start]


def _has_marker(text: str, markers: RuntimeContextMarkers) -> bool:
    return markers.start in text or markers.end in text


def strip_runtime_context(text: str, markers: RuntimeContextMarkers = DEFAULT_MARKERS) -> str:
    """Remove every hidden runtime-context block; only what the user saw remains.

    Blocks may nest; each ends at its matching end marker. Malformed markers
    hide more rather than less (see `strip_runtime_context_pieces`): leaking
    hidden context is worse than storing less of a malformed message.
    """
    return split_runtime_context(text, markers)[0]


def split_runtime_context(
    text: str, markers: RuntimeContextMarkers = DEFAULT_MARKERS
) -> tuple[str, str]:
    """What the user saw (`strip_runtime_context`) and what is hidden from them: every piece
    `strip_runtime_context` removes, markers included, as written, one after another ("" when
    the text holds no marker). The legacy converter keeps the hidden part in a problem."""
    if not _has_marker(text, markers):
        return text, ""
    spans = _visible_spans(text, markers)
    shown = "".join(text[start:end] for start, end in spans).strip()
    bounds = [0, *(at for span in spans for at in span), len(text)]
    hidden = "".join(text[bounds[i] : bounds[i + 1]] for i in range(0, len(bounds), 2))
    return shown, hidden


def strip_runtime_context_pieces(
    pieces: Sequence[str], markers: RuntimeContextMarkers = DEFAULT_MARKERS
) -> list[str]:
    """Strip pieces of one prompt (a runtime's list of text items) as if they were one text.

    A block, or a marker itself, may be cut across pieces; each piece keeps
    only its own visible text, whitespace-trimmed once anything was hidden.
    Pieces without a marker anywhere come back unchanged. Rules for
    unbalanced markers: a block never closed hides the rest; an end marker
    with no start before it hides everything before it.
    """
    joined = "".join(pieces)
    if not _has_marker(joined, markers):
        return list(pieces)
    spans = _visible_spans(joined, markers)
    shown: list[str] = []
    offset = 0
    for piece in pieces:
        low, high = offset, offset + len(piece)
        kept = (joined[max(a, low) : min(b, high)] for a, b in spans if a < high and b > low)
        shown.append("".join(kept).strip())
        offset = high
    return shown


# The white space `str.split` removes or merges, in ASCII text, besides a single space.
_ASCII_RUNS = ("  ", "\n", "\t", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f")


def _text_blocks(blocks: Sequence[Any]) -> list[int]:
    """Where the texts of a list of blocks are: a string block, or a block's `text`."""
    return [
        i
        for i, b in enumerate(blocks)
        if isinstance(b, str) or (isinstance(b, Mapping) and isinstance(b.get("text"), str))
    ]


def strip_runtime_context_blocks(
    content: str | Sequence[Any], markers: RuntimeContextMarkers = DEFAULT_MARKERS
) -> str | list[Any]:
    """A runtime's message content with hidden runtime context removed: a string, or a list
    of blocks whose texts (a string block, or a block's `text`) are stripped as one prompt
    (`strip_runtime_context_pieces`: a block may open in one part and close in another).
    Other blocks (an image, a file) stay as they are."""
    if isinstance(content, str):
        return strip_runtime_context(content, markers)
    blocks = list(content)
    where = _text_blocks(blocks)
    texts = [b if isinstance(b, str) else b["text"] for b in (blocks[i] for i in where)]
    for i, shown in zip(where, strip_runtime_context_pieces(texts, markers), strict=True):
        blocks[i] = shown if isinstance(blocks[i], str) else {**blocks[i], "text": shown}
    return blocks


_NO_TEXT = frozenset({bool, int, float, datetime})
"""Types of values that hold no text: `_holds_marker` answers for them at once."""


def _holds_marker(value: Any, markers: RuntimeContextMarkers) -> bool:
    """Whether a marker is anywhere in a value: in a string, in a list's texts read as one
    prompt (a marker may be cut across them) or its items, a mapping's keys and values, or
    a model's fields. A few C-level scans of each string: what holds none is left alone."""
    if value is None or type(value) in _NO_TEXT:  # most fields: no isinstance (an ABC's)
        return False
    if isinstance(value, str):
        return _has_marker(value, markers)
    if isinstance(value, NativeForm) and value.json_text:
        return _holds_marker(_spelt(value), markers)
    if isinstance(value, BaseModel):  # most fields are None or hold no text: not walked
        return any(
            _holds_marker(item, markers)
            for item in value.__dict__.values()
            if item is not None and type(item) not in _NO_TEXT
        )
    if isinstance(value, Mapping):
        return any(
            (isinstance(key, str) and _has_marker(key, markers)) or _holds_marker(item, markers)
            for key, item in value.items()
        )
    if isinstance(value, list):
        texts = "".join(
            b if isinstance(b, str) else b["text"]
            for b in map(value.__getitem__, _text_blocks(value))
        )
        return _has_marker(texts, markers) or any(
            _holds_marker(item, markers) for item in value if not isinstance(item, str)
        )
    return False


def _stripped_value(value: Any, markers: RuntimeContextMarkers) -> Any:
    """A value with hidden runtime context removed from every string in it, the value itself
    when it holds no marker: a model's fields each (as a mapping of them, for the message's
    model to validate again: a text that was only context is empty now), a list's texts as
    one prompt (`strip_runtime_context_blocks`), then each item's own, a mapping's keys and
    values (`_stripped_mapping`)."""
    if not _holds_marker(value, markers):
        return value
    if isinstance(value, str):
        return strip_runtime_context(value, markers)
    if isinstance(value, list):
        blocks = strip_runtime_context_blocks(value, markers)
        return [b if isinstance(b, str) else _stripped_value(b, markers) for b in blocks]
    if isinstance(value, NativeForm) and value.json_text:
        stripped = _stripped_mapping(_spelt(value), markers)
        kept, texts = NativeForm.kept_values(stripped["set"])
        return {**stripped, "set": kept, "json_text": texts}
    items = value.__dict__ if isinstance(value, BaseModel) else value
    return _stripped_mapping(items, markers)


def _spelt(form: NativeForm) -> dict[str, Any]:
    """A native form's fields with each value kept as JSON text as the value it spells: its
    hidden context is stripped from that value (a marker JSON text spells otherwise, or
    context cut across its keys, would else be kept or join keys), then kept as text again."""
    return {**form.__dict__, "set": form.set_values()}


def _stripped_mapping(items: Mapping[Any, Any], markers: RuntimeContextMarkers) -> dict[Any, Any]:
    """A mapping with hidden runtime context removed from its keys and values. InvalidInput
    when two keys are one once stripped: keeping either would drop the other's value unsaid
    (the key is shown as stripped, never with the context it held)."""
    stripped: dict[Any, Any] = {}
    for key, item in items.items():
        shown = strip_runtime_context(key, markers) if isinstance(key, str) else key
        if shown in stripped:
            raise InvalidInput(
                f"invalid message: its runtime context removed, a mapping in it names the key "
                f"{shown_key(shown)} twice: send each key once, context aside"
            )
        stripped[shown] = _stripped_value(item, markers)
    return stripped


def holds_a_persons_words(message: AgentMessage) -> bool:
    """Whether a message is a person's words, the only text runtime context is stripped
    from: a user message, but one marked as a tool's content or the application's retry
    feedback (`voice_marker`), which is stored whole, as the model was sent it."""
    return message.role == "user" and voice_marker(message) is None


def without_runtime_context(
    message: AgentMessage, markers: RuntimeContextMarkers = DEFAULT_MARKERS
) -> AgentMessage:
    """A user message with hidden runtime context removed from every text it stores: each
    string of it and of its parts (its content, its upload's and error's texts, its `native`
    form), whatever fields they have. A message holding no marker is the message itself;
    any other role's comes back as it is, and so does a user message that is no person's
    words (`holds_a_persons_words`). InvalidInput when a text is refused once its context
    is removed (a `native` format that was nothing else)."""
    if not holds_a_persons_words(message) or not _holds_marker(message, markers):
        return message
    try:
        return type(message).model_validate(_stripped_value(message, markers))
    except ValidationError as exc:
        raise InvalidInput(
            describe_validation_error(exc, subject="message, its runtime context removed")
        ) from exc


def collapse_whitespace(text: str) -> str:
    """Runs of white space as one space, none at either end.

    ASCII text that holds none of them comes back as it is after a few C-level scans.
    """
    if text.isascii() and not (text[:1].isspace() or text[-1:].isspace()):
        for run in _ASCII_RUNS:
            if run in text:
                break
        else:
            return text
    return " ".join(text.split())


HIDDEN_CHARACTERS = "".join(
    chr(c)
    for first, last in (
        *((0x00, 0x08), (0x0E, 0x1B), (0x7F, 0x84), (0x86, 0x9F)),  # controls, not white space
        *((0x202A, 0x202E), (0x2066, 0x2069)),  # text-direction embeddings and isolates
        *((0x200E, 0x200F), (0x061C, 0x061C)),  # text-direction marks
        (0x206A, 0x206F),  # deprecated: symmetric swapping, Arabic form and digit shapes
    )
    for c in range(first, last + 1)
)
"""Characters that make a line of text show other than it reads: C0 and C1 controls (white
space aside, which names and previews collapse), the bidirectional embeddings, overrides,
isolates and marks, and the deprecated format characters that change how Arabic letters and
digits show. Names hold none; automatic names and previews leave them out."""
_HIDDEN = re.compile(f"[{re.escape(HIDDEN_CHARACTERS)}]")

INVISIBLE_RANGES = (
    *((0x00AD, 0x00AD), (0x0600, 0x0605), (0x061C, 0x061C), (0x06DD, 0x06DD)),  # format (Cf)
    *((0x070F, 0x070F), (0x0890, 0x0891), (0x08E2, 0x08E2), (0x180E, 0x180E)),
    *((0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0xFEFF, 0xFEFF)),
    *((0xFFF9, 0xFFFB), (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0x13430, 0x1343F)),
    (0xFFF0, 0xFFF8),  # reserved, default-ignorable: shown as nothing
    *((0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF)),  # E0000-E0FFF: tags, selectors
    *((0x115F, 0x1160), (0x3164, 0x3164), (0xFFA0, 0xFFA0)),  # Hangul fillers
    *((0x034F, 0x034F), (0x17B4, 0x17B5), (0x180B, 0x180D), (0x180F, 0x180F)),  # ignorable marks
    *((0xFE00, 0xFE0F), (0x2800, 0x2800)),  # variation selectors; the Braille blank
)
"""Characters that show nothing of their own: the format characters (Unicode category Cf),
the rest of Unicode's default-ignorable code points (Hangul fillers, variation selectors, the
combining grapheme joiner) and the Braille blank, as inclusive ranges of code points. A
visible text may hold them (a joiner in Persian or an emoji, a selector after an emoji); a
text of only these and white space shows nothing, so names nothing (`shows_nothing`)."""
INVISIBLE_CLASS = "".join(
    chr(first) if first == last else f"{chr(first)}-{chr(last)}" for first, last in INVISIBLE_RANGES
)
"""`INVISIBLE_RANGES` spelled as the inside of a regular expression's `[...]`."""
_VISIBLE = re.compile(f"[^{INVISIBLE_CLASS}\\s]")


def shows_nothing(text: str) -> bool:
    """Whether the text holds nothing but white space and invisible characters
    (`INVISIBLE_RANGES`): a name of it would read as no name."""
    return _VISIBLE.search(text) is None


def shown_plainly(text: str) -> str:
    """The text without the characters that would make it show other than it reads."""
    if text.isascii() and text.isprintable():  # the ASCII ones are all unprintable
        return text
    return _HIDDEN.sub("", text) if _HIDDEN.search(text) else text


def _cleaned(text: str) -> str:
    return collapse_whitespace(shown_plainly(text))


_SPARE = 64
"""How far past `limit` `shorten` cleans a long text's start first: enough for the white space
and hidden characters most starts hold, so the rest is never scanned."""


def shorten(text: str, limit: int) -> str:
    """Collapse whitespace, leave hidden characters out (`shown_plainly`) and cut at a word
    boundary to at most `limit` characters: a name or preview made from a message.

    A long text is shortened from a start of it when that start, cleaned, is longer than
    `limit`: the cleaned start of a text is the start of the cleaned text, so the cut is the
    same, without cleaning what lies past it."""
    start = _cleaned(text[: limit + _SPARE]) if len(text) > limit + _SPARE else ""
    text = start if len(start) > limit else _cleaned(text)
    if len(text) <= limit:
        return text
    cut = text[: max(limit - len(ELLIPSIS), 1)]
    if " " in cut and not text[len(cut)].isspace():
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip() + ELLIPSIS


def prompt_text(message: AgentMessage) -> str | None:
    """What a model is given of a system or user message: its content, or a note naming the
    file it uploaded when it has no text (None, or "" as a text that was only hidden runtime
    context is stored); None when it has neither."""
    if not message.content and message.upload is not None:
        return f"[uploaded {message.upload.filename} ({message.upload.file_type})]"
    return message.content


def message_text(message: AgentMessage) -> str:
    """The readable text of a message: its content, or what stands for it."""
    if message.content:
        return message.content
    if message.error is not None:
        return message.error.message
    if message.upload is not None:
        return message.upload.filename
    return ""


def search_text(message: AgentMessage, limit: int = 32_768) -> str | None:
    """What full-text search indexes for a message: text, file, tool and error words."""
    if (
        message.upload is None
        and message.error is None
        and message.tool_calls is None
        and message.hitl_action is None
    ):
        return collapse_whitespace(message.content or "")[:limit] or None
    parts = [message.content or ""]
    if message.upload is not None:
        parts += [message.upload.filename, message.upload.parsed_text or ""]
    if message.error is not None:
        parts.append(message.error.message)
    for call in message.tool_calls or ():
        parts.append(call.function.name)
    if message.hitl_action is not None:
        parts.append(message.hitl_action.action)
    text = collapse_whitespace(" ".join(p for p in parts if p))
    return text[:limit] or None


def auto_name(message: AgentMessage, limit: int) -> str | None:
    """A conversation name from its first real user text, or None if the message has none."""
    if message.role != "user" or not message.content:
        return None
    name = shorten(message.content, limit)
    return None if shows_nothing(name) else name


MAX_NAME_CHARS = 200


def clean_name(name: object) -> str:
    """A conversation name a person or runtime gave: whitespace collapsed, 1-200 characters.

    Raises InvalidInput for a name that is not text, is empty once collapsed, is too long,
    cannot be stored (a lone surrogate), or holds a control or text-direction character
    (a name shows as it reads: `shown_plainly`). The controls `str.isspace` holds for (tab,
    newline, U+001C-U+001F, U+0085) are white space here, collapsed to one space like the
    rest (`HIDDEN_CHARACTERS` leaves them out).
    """
    if not isinstance(name, str):
        raise InvalidInput(f"invalid name: it must be a string, not {type(name).__name__}")
    if hidden := _HIDDEN.search(name):
        raise InvalidInput(
            f"invalid name: it holds U+{ord(hidden.group()):04X} at character {hidden.start()}, "
            "a control or text-direction character; a name is plain text"
        )
    cleaned = collapse_whitespace(storable(name, "name"))
    if shows_nothing(cleaned) or len(cleaned) > MAX_NAME_CHARS:
        raise InvalidInput(
            f"invalid name: it must have 1 to {MAX_NAME_CHARS} characters besides white space, "
            "and show something besides invisible characters (U+200B, U+3164, …)"
        )
    return cleaned


# A quoted phrase (negated by a `-` before its quote), or a word up to the next space.
_SEARCH_TERM = re.compile(r'(-?)"([^"]*)"?|(\S+)')


def search_words(query: str) -> tuple[bool, bool]:
    """Whether a `$text` query has a word to look for, and whether it has words excluded
    with `-`: a word (a term or a quoted phrase) holds a letter or a digit.

    MongoDB (and compatible servers) refuse or match nothing for a query of only
    negated terms or punctuation.
    """
    found = excluded = False
    for match in _SEARCH_TERM.finditer(query):
        negated, phrase, word = match.groups()
        term = phrase if phrase is not None else word
        if any(character.isalnum() for character in term):
            if bool(negated) if phrase is not None else word.startswith("-"):
                excluded = True
            else:
                found = True
    return found, excluded
