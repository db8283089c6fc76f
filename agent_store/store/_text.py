"""Pure text rules: what of a message is stored, shown, named and searched."""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent_store.core import AgentMessage, InvalidInput

ELLIPSIS = "…"


@dataclass(frozen=True)
class RuntimeContextMarkers:
    """The markers around hidden context a runtime prepends to the model input."""

    start: str = "[RUNTIME CONTEXT]"
    end: str = "[/RUNTIME CONTEXT]"

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("runtime context markers must not be empty")


DEFAULT_MARKERS = RuntimeContextMarkers()


def strip_runtime_context(text: str, markers: RuntimeContextMarkers = DEFAULT_MARKERS) -> str:
    """Remove every hidden runtime-context block; only what the user saw remains.

    A block that is opened but never closed hides everything after its start:
    leaking hidden context is worse than storing less of a malformed message.
    """
    if markers.start not in text:
        return text
    pattern = re.compile(
        re.escape(markers.start) + r".*?(?:" + re.escape(markers.end) + r"|\Z)", re.DOTALL
    )
    return pattern.sub("", text).strip()


def collapse_whitespace(text: str) -> str:
    return " ".join(text.split())


def shorten(text: str, limit: int) -> str:
    """Collapse whitespace and cut at a word boundary to at most `limit` characters."""
    text = collapse_whitespace(text)
    if len(text) <= limit:
        return text
    cut = text[: max(limit - len(ELLIPSIS), 1)]
    if " " in cut and not text[len(cut)].isspace():
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip() + ELLIPSIS


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
    return name or None


MAX_NAME_CHARS = 200


def clean_name(name: str) -> str:
    """A conversation name a person or runtime gave: whitespace collapsed, 1-200 characters.

    Raises InvalidInput for a name that is empty once collapsed, or too long.
    """
    cleaned = collapse_whitespace(name)
    if not cleaned or len(cleaned) > MAX_NAME_CHARS:
        raise InvalidInput(
            f"invalid name: it must have 1 to {MAX_NAME_CHARS} characters besides white space"
        )
    return cleaned


# A quoted phrase (negated by a `-` before its quote), or a word up to the next space.
_SEARCH_TERM = re.compile(r'(-?)"([^"]*)"?|(\S+)')


def has_positive_term(query: str) -> bool:
    """Whether a `$text` query has a word to look for, not only words excluded with `-`.

    MongoDB (and compatible servers) refuse or match nothing for a query of only
    negated terms or punctuation; a positive term holds a letter or a digit.
    """
    for match in _SEARCH_TERM.finditer(query):
        negated, phrase, word = match.groups()
        term = phrase if phrase is not None else word
        excluded = bool(negated) if phrase is not None else word.startswith("-")
        if not excluded and any(character.isalnum() for character in term):
            return True
    return False
