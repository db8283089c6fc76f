"""ETag and If-Match: the HTTP face of a conversation's version (`Conversation.version`).

The ETag names the conversation, not a state of it: it stays the same while turns are
logged and renames happen, and another conversation started under the id has another. It
serves If-Match on a DELETE (and a PATCH), never caching: responses carrying it are
`no-store`, and If-None-Match is not read.
"""

from __future__ import annotations

from starlette.datastructures import Headers

from agent_store.core import Conversation


def etag_headers(conversation: Conversation) -> dict[str, str]:
    """The headers of a response serving `conversation`."""
    return {"ETag": f'"{conversation.version}"', "Cache-Control": "no-store"}


def version_named(headers: Headers) -> str | None:
    """The version an `If-Match` header names: None when it is absent or `*` (any
    conversation, where there is one: a route finds it or answers 404), the tag of an ETag
    as served (its quotes may be left out), else the header as sent, which no
    conversation's version is: a weak tag never matches under If-Match's strong comparison,
    and a list of tags is not taken: one written across several header lines too, which
    HTTP reads as one list."""
    lines = headers.getlist("if-match")
    value = ", ".join(lines) if lines else None
    if value is None or value.strip() == "*":
        return None
    value = value.strip()
    quoted = len(value) >= 2 and value[0] == value[-1] == '"'
    return value[1:-1] if quoted and '"' not in value[1:-1] else value
