"""The legacy `session_hitl` prompts, merged into a converted conversation. Pure, no I/O.

A prompt document is read as turns are: `resolved: "false"` is false, a status in any
case or with spaces is the status, a request id stored as a number by its text, a time
as a datetime or an ISO string. The newest pending prompt becomes `pending_hitl`; any
other pending prompt whose content no message holds is kept in a problem.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from bson import ObjectId

from agent_store.core import AgentMessage, PendingHitl, to_utc_millis
from agent_store.legacy._convert import LegacyConversion, Problem
from agent_store.legacy._documents import as_text, as_time, reference_text, truthy

_RESOLVED = {"resolved", "answered", "done", "completed", "cancelled", "canceled", "expired"}


@dataclass(frozen=True)
class PromptNote:
    """What the prompts held that `pending_hitl` does not show as it was, for the report."""

    kind: str
    detail: str
    content: Any = None
    placed: bool = True
    """False when this note is the only place the content is kept."""


def is_pending_prompt(document: Mapping[str, Any]) -> bool:
    """Whether a `session_hitl` document is a prompt still awaiting its answer."""
    status = str(document.get("status", "pending")).strip().lower()
    return not truthy(document.get("resolved")) and status not in _RESOLVED


def _id_time(document: Mapping[str, Any]) -> datetime | None:
    found = document.get("_id")
    return to_utc_millis(found.generation_time) if isinstance(found, ObjectId) else None


def _time(document: Mapping[str, Any]) -> datetime | None:
    """When the prompt was raised, to tell the newest: its `created_at`, else its ObjectId's."""
    return as_time(document.get("created_at")) or _id_time(document)


def _prompt_text(document: Mapping[str, Any]) -> str | None:
    prompt = document.get("prompt")
    return None if prompt is None or prompt == "" else as_text(prompt)


def _raised_by(
    document: Mapping[str, Any], messages: Sequence[AgentMessage]
) -> AgentMessage | None:
    """The last message that raised the prompt (the same request id)."""
    request_id = reference_text(document.get("request_id"))
    return next(
        (
            m
            for m in reversed(messages)
            if m.hitl_action is not None and m.hitl_action.request_id == request_id
        ),
        None,
    )


def _held(document: Mapping[str, Any], messages: Sequence[AgentMessage]) -> bool:
    """Whether a message holds the prompt: it raised it, with the same text if it has one."""
    raised = _raised_by(document, messages)
    prompt = _prompt_text(document)
    return raised is not None and (prompt is None or raised.content == prompt)


def _not_placed(document: Mapping[str, Any], why: str) -> PromptNote:
    return PromptNote(
        "pending_prompt_not_placed",
        f"pending prompt {document.get('request_id')!r} {why}; only session_hitl holds it",
        content=dict(document),
        placed=False,
    )


def _pending(
    newest: Mapping[str, Any], messages: Sequence[AgentMessage]
) -> tuple[PendingHitl, list[PromptNote]]:
    """The newest pending prompt as `pending_hitl`; its time, when it has no `created_at`,
    the message's that raised it, else its ObjectId's, else the last message's: the same on
    every run."""
    request_id = str(reference_text(newest.get("request_id")))
    raised = _raised_by(newest, messages)
    notes = []
    if raised is None:
        detail = f"pending prompt {request_id!r} matches no assistant message"
        notes.append(PromptNote("pending_hitl_without_message", detail))
    action = raised.hitl_action if raised is not None else None
    params = newest.get("params")
    prompt = PendingHitl(
        request_id=request_id,
        action=str(newest.get("action") or (action.action if action else "unknown")),
        params=params if isinstance(params, dict) else (action.params if action else {}),
        prompt=_prompt_text(newest) or (raised.content if raised else None),
        message_id=raised.id if raised is not None and raised.id else "",
        created_at=as_time(newest.get("created_at"))
        or (raised.created_at if raised else None)
        or _id_time(newest)
        or messages[-1].created_at,
    )
    return prompt, notes


def pending_from_session_hitl(
    documents: Iterable[Mapping[str, Any]], messages: Sequence[AgentMessage]
) -> tuple[PendingHitl | None, list[PromptNote]]:
    """The newest unresolved `session_hitl` prompt as `pending_hitl`, and notes on oddities:
    every other pending prompt no message holds, or one without a request id a message can
    hold, is noted with its document (not placed)."""
    pending = [d for d in documents if is_pending_prompt(d)]
    notes = [
        _not_placed(d, "has no request id of 1 to 200 characters")
        for d in pending
        if reference_text(d.get("request_id")) is None
    ]
    readable = [d for d in pending if reference_text(d.get("request_id")) is not None]
    if not readable:
        return None, notes
    if not messages:
        return None, notes + [_not_placed(d, "has no message to go with") for d in readable]
    newest = max(readable, key=lambda d: (_time(d) is not None, _time(d) or datetime.min))
    older = [
        _not_placed(d, "is not the newest pending prompt, and no message raised it")
        for d in readable
        if d is not newest and not _held(d, messages)
    ]
    prompt, newest_notes = _pending(newest, messages)
    return prompt, notes + older + newest_notes


def with_session_prompts(
    conversion: LegacyConversion, documents: Iterable[Mapping[str, Any]]
) -> LegacyConversion:
    """The conversion with its pending prompt from `session_hitl`; oddities become problems."""
    pending, notes = pending_from_session_hitl(documents, conversion.messages)
    if conversion.conversation is not None:
        conversion.conversation = conversion.conversation.model_copy(
            update={"pending_hitl": pending}
        )
    conversion.problems += [
        Problem(
            conversation_id=conversion.conversation_id,
            legacy_id="session_hitl",
            kind=note.kind,
            detail=note.detail,
            content=note.content,
            placed=note.placed,
        )
        for note in notes
    ]
    return conversion
