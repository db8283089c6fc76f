"""Keep every stored message under a size bound by cutting its largest texts.

MongoDB refuses documents over 16 MiB; a turn must never be lost to that, so a
message over the configured bound is stored with its largest text fields cut
and a `truncated` map naming each cut field and its original length.
"""

from __future__ import annotations

import json
from typing import Any

import bson

from agent_store.core import AgentMessage, InvalidInput, message_adapter

DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024
TRUNCATION_MARK = "\n…[truncated]"
# Room left for the marks and field names a cut adds.
_SLACK_BYTES = 4096


def document_size(document: dict[str, Any]) -> int:
    return len(bson.encode(document))


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
    """(path, text) of every free-text field a message can carry, largest first."""
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
    return sorted(found, key=lambda item: len(item[1].encode()), reverse=True)


def _cut(text: str, max_bytes: int) -> str:
    budget = max(max_bytes - len(TRUNCATION_MARK.encode()), 0)
    return text.encode()[:budget].decode(errors="ignore") + TRUNCATION_MARK


def _put(doc: dict[str, Any], path: str, text: str) -> None:
    parts = path.split(".")
    if parts[0] == "hitl_action":
        doc["hitl_action"]["params"] = {"truncated_json": text}
        return
    target: Any = doc
    for part in parts[:-1]:
        target = target[int(part)] if part.isdigit() else target[part]
    if parts[-1] == "arguments":
        # Keep arguments a JSON string even when cut.
        text = json.dumps({"truncated_arguments": text}, ensure_ascii=False)
    target[parts[-1]] = text


def bound_message(
    message: AgentMessage, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> AgentMessage:
    """Return the message unchanged if it fits in `max_bytes` of BSON, else a cut copy."""
    doc = message.model_dump(by_alias=True)
    try:
        size = document_size(doc)
    except OverflowError as exc:
        raise InvalidInput(
            f"invalid turn: {_wide_int_path(doc)} is an integer outside BSON's 64-bit range"
        ) from exc
    if size <= max_bytes:
        return message
    truncated: dict[str, int] = dict(message.truncated or {})
    for path, text in _text_fields(doc):
        if size <= max_bytes:
            break
        encoded_length = len(text.encode())
        keep = max(encoded_length - (size - max_bytes) - _SLACK_BYTES, 0)
        _put(doc, path, _cut(text, keep))
        truncated[path] = len(text)
        size = document_size(doc)
    doc["truncated"] = truncated
    return message_adapter.validate_python(doc)
