"""One canonical transcript per conversation, rendered from legacy turns or from messages.

The two renderings are written independently of the converter, so comparing
them checks the conversion itself: no content lost or repeated, visible text
in the same order, every tool result attached to a call of the same tool.
Tool results are compared as a multiset, since the migration moves each one
right after its call.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from typing import Any

from agent_store.core import AgentMessage
from agent_store.legacy import (
    LegacyPart,
    LegacyTurn,
    Problem,
    as_text,
    dumps,
    normalize_part,
    sort_turns,
)
from agent_store.store import strip_runtime_context


@dataclass(frozen=True)
class Transcript:
    lines: tuple[str, ...]
    """Everything but tool results, in order."""
    results: tuple[str, ...]
    """Tool results as `tool name -> content`, sorted."""


def _json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False)
    except ValueError:
        return text


def _upload(upload: Any) -> str:
    return f"upload: {upload.get('filename')} ({upload.get('file_type')}, {upload.get('size')} B)"


def _part_line(part: LegacyPart) -> str | None:
    """The transcript line of a part other than a tool result or an upload."""
    if part.kind == "text" and part.content:
        return f"assistant: {as_text(part.content)}"
    if part.kind == "tool_call":
        args = part.args
        rendered = _json(args) if isinstance(args, str) else _json(dumps(args or {})[0])
        return f"call {part.tool_name}({rendered})"
    if part.kind == "hitl":
        prompt = part.content if isinstance(part.content, str) else ""
        return f"hitl {part.action}: {prompt}"
    if part.kind == "error":
        said = part.content if isinstance(part.content, str) else dumps(part.raw)[0]
        return f"error: {said}"
    return None


def _turn_parts(turn: LegacyTurn) -> list[LegacyPart]:
    """The turn's parts, or those rebuilt from its summary fields when it has none."""
    if isinstance(turn.response_parts, list) and turn.response_parts:
        return [normalize_part(p) for p in turn.response_parts]
    calls = turn.tool_calls if isinstance(turn.tool_calls, list) else []
    rebuilt = [normalize_part({"type": "tool_call", **c}) for c in calls if isinstance(c, dict)]
    if isinstance(turn.response_text, str) and turn.response_text:
        rebuilt.append(normalize_part({"type": "text", "content": turn.response_text}))
    return rebuilt


def from_legacy(turns: Iterable[LegacyTurn], unplaced: Sequence[Problem] = ()) -> Transcript:
    """Render legacy turns; parts the converter reported as unplaced are left out."""
    skipped = {(p.legacy_id, p.part_index) for p in unplaced}
    lines: list[str] = []
    results: list[str] = []
    for turn in sort_turns(turns):
        legacy_id = str(turn.id)
        text = turn.user_message if isinstance(turn.user_message, str) else None
        if turn.is_system:
            lines.append(f"system: {text or ''}")
        elif text and (clean := strip_runtime_context(text)):
            lines.append(f"user: {clean}")
        parts = _turn_parts(turn)
        uploads = []
        if turn.upload_result and (legacy_id, None) not in skipped:
            uploads.append(turn.upload_result)
        for index, part in enumerate(parts):
            skip = (legacy_id, index) in skipped or part.upload in uploads
            if part.kind == "file_upload" and not skip:
                uploads.append(part.upload)
        lines += [_upload(u) for u in uploads]
        for index, part in enumerate(parts):
            if (legacy_id, index) in skipped:
                continue
            if part.kind == "tool_result":
                results.append(f"{part.tool_name} -> {_json(as_text(part.result))}")
            elif (line := _part_line(part)) is not None:
                lines.append(line)
    return Transcript(tuple(lines), tuple(sorted(results)))


def from_messages(messages: Iterable[AgentMessage]) -> Transcript:
    lines: list[str] = []
    results: list[str] = []
    names: dict[str, str] = {}
    for message in messages:
        if message.role == "system":
            lines.append(f"system: {message.content or ''}")
        elif message.role == "user":
            if message.content:
                lines.append(f"user: {message.content}")
            if message.upload is not None:
                lines.append(_upload(message.upload.model_dump()))
        elif message.role == "tool":
            name = names.get(message.tool_call_id or "", "<no call>")
            results.append(f"{name} -> {_json(message.content or '')}")
        elif message.hitl_action is not None:
            lines.append(f"hitl {message.hitl_action.action}: {message.content or ''}")
        elif message.error is not None:
            lines.append(f"error: {message.error.message}")
        elif message.tool_calls:
            for call in message.tool_calls:
                names[call.id] = call.function.name
                lines.append(f"call {call.function.name}({_json(call.function.arguments)})")
        elif message.content:
            lines.append(f"assistant: {message.content}")
    return Transcript(tuple(lines), tuple(sorted(results)))


def differences(legacy: Transcript, new: Transcript) -> list[str]:
    """Each difference as one line; empty when the transcripts match."""
    found: list[str] = []
    matcher = SequenceMatcher(a=legacy.lines, b=new.lines, autojunk=False)
    for tag, a1, a2, b1, b2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        for line in legacy.lines[a1:a2]:
            found.append(f"line {a1}: legacy has {line!r}" + (" only" if tag == "delete" else ""))
        for line in new.lines[b1:b2]:
            found.append(f"line {b1}: new has {line!r}" + (" only" if tag == "insert" else ""))
    missing = Counter(legacy.results) - Counter(new.results)
    extra = Counter(new.results) - Counter(legacy.results)
    found += [f"tool result missing from new: {r!r} (x{n})" for r, n in sorted(missing.items())]
    found += [f"tool result only in new: {r!r} (x{n})" for r, n in sorted(extra.items())]
    return found
