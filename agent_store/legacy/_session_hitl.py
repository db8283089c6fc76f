"""The legacy `session_hitl` prompts, merged into a converted conversation. Pure, no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from agent_store.core import AgentMessage, PendingHitl, to_utc_millis, utc_now
from agent_store.legacy._convert import LegacyConversion, Problem

_RESOLVED = {"resolved", "answered", "done", "completed", "cancelled", "canceled", "expired"}


def _is_pending(document: Mapping[str, Any]) -> bool:
    status = str(document.get("status", "pending")).lower()
    return (
        not document.get("resolved")
        and status not in _RESOLVED
        and isinstance(document.get("request_id"), str)
    )


def _time(document: Mapping[str, Any]) -> datetime | None:
    value = document.get("created_at")
    return to_utc_millis(value) if isinstance(value, datetime) else None


def pending_from_session_hitl(
    documents: Iterable[Mapping[str, Any]], messages: Sequence[AgentMessage]
) -> tuple[PendingHitl | None, list[str]]:
    """The newest unresolved `session_hitl` prompt as `pending_hitl`, and notes on oddities."""
    pending = [d for d in documents if _is_pending(d)]
    if not pending:
        return None, []
    newest = max(pending, key=lambda d: (_time(d) is not None, _time(d) or datetime.min))
    request_id = newest["request_id"]
    raised = next(
        (
            m
            for m in reversed(messages)
            if m.hitl_action is not None and m.hitl_action.request_id == request_id
        ),
        None,
    )
    notes = [] if raised else [f"pending prompt {request_id!r} matches no assistant message"]
    action = raised.hitl_action if raised is not None else None
    params = newest.get("params")
    created_at = _time(newest) or (raised.created_at if raised else utc_now())
    prompt = PendingHitl(
        request_id=request_id,
        action=str(newest.get("action") or (action.action if action else "unknown")),
        params=params if isinstance(params, dict) else (action.params if action else {}),
        prompt=newest.get("prompt") or (raised.content if raised else None),
        message_id=raised.id if raised is not None and raised.id else "",
        created_at=created_at,
    )
    return prompt, notes


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
            kind="pending_hitl_without_message",
            detail=note,
            placed=True,
        )
        for note in notes
    ]
    return conversion
