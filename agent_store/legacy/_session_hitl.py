"""The legacy `session_hitl` prompts, merged into a converted conversation. Pure, no I/O.

A prompt document is read as turns are: `resolved: "false"` is false, a status as words
saying answered or waiting (`answered_status`; any other is kept in a problem), a request
id stored as a number by its text, a time as a datetime or an ISO string; its prompt,
action and params as a HITL part's (`read_prompt`). A prompt the conversation document is
made of (its pending prompt, one the new service resolved) holding bytes that are not valid
UTF-8 anywhere makes its conversation unconvertible, as such a turn does (`refuse_not_utf8`);
one it does not take (resolved by the old service, another user's, a pending one only a
problem keeps, its texts written as escapes) is no obstacle. Only the owner's prompts are
the conversation's (`owners_prompt`): one naming another user is a `mixed_user_ids`
problem, never the owner's pending prompt. A request recorded more than once is decided by
its newest record (`_still_pending`). The newest pending prompt becomes `pending_hitl`; any
other pending prompt whose content no message holds is kept in a problem, and so is a field
of a pending prompt no reader takes. A prompt the new service resolved (`resolve_hitl` with the
dual write on marks it resolved and `dual_write: true`, `RESOLVED_BY_DUAL_WRITE`) stays
resolved: its request id is the conversation's `resolved_hitl`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from bson import ObjectId

from agent_store.core import (
    RESOLVED_PROMPTS_KEPT,
    AgentMessage,
    Conversation,
    PendingHitl,
    to_utc_millis,
)
from agent_store.legacy._convert import MIXED_USER_IDS, LegacyConversion, Problem
from agent_store.legacy._documents import (
    as_time,
    claimed_user,
    flag,
    not_json,
    read_code_as_text,
    reference_text,
    refuse_not_utf8,
    taken_time,
)
from agent_store.legacy._parts import (
    LegacyPart,
    hitl_params,
    holdable_params,
    part_text,
    read_prompt,
    said,
)

_ANSWERED = frozenset(
    {"resolved", "answered", "responded", "replied", "done", "complete", "completed"}
    | {"finished", "closed", "approved", "accepted", "confirmed", "granted", "allowed"}
    | {"rejected", "denied", "declined", "refused", "dismissed", "skipped", "cancelled"}
    | {"canceled", "aborted", "expired", "timed_out", "timeout", "time_out", "failed"}
    | {"succeeded"}
)
"""Statuses saying the prompt was answered or is over: never asked again."""
_WAITING = frozenset(
    {"pending", "open", "opened", "waiting", "awaiting", "asked", "new", "created"}
    | {"requested", "sent", "shown", "active", "queued"}
)
"""Statuses saying the prompt awaits its answer; so does one starting `pending_`,
`waiting_` or `awaiting_` (`awaiting_approval`), and none at all (absent, null, blank)."""
_WAITING_PREFIXES = ("pending_", "waiting_", "awaiting_")
_SEPARATORS = re.compile(r"[\s_-]+")
_READ_FIELDS = frozenset(
    {"_id", "conversation_id", "session_id", "user_id", "request_id", "status", "resolved"}
    | {"created_at", "updated_at", "action", "params", "prompt", "content", "dual_write"}
)
"""The fields of a prompt document that are read: whose prompt it is and of which
conversation, its state and times (`session_hitl`'s bookkeeping, the dual write's mark), and
the prompt itself in each spelling a HITL part has."""


def resolved_by_dual_write(now: datetime) -> dict[str, Any]:
    """What the dual write sets on a `session_hitl` prompt the new service resolved
    (`resolve_hitl`): resolved in both spellings the legacy format has, so the old service
    asks it no more after a rollback, and marked `dual_write: true`, so a run keeps its
    request id resolved (`resolved_hitl`)."""
    return {"status": "resolved", "resolved": True, "updated_at": now, "dual_write": True}


def answer_record(
    conversation_id: str, user_id: str | None, request_id: str, now: datetime
) -> dict[str, Any]:
    """The `session_hitl` record the dual write keeps of an answer to a prompt it holds no
    document of (raised by a live turn: the dual write writes turns), but its `_id`: the
    request answered (`resolved_by_dual_write`), of the conversation its legacy turns name
    and the user they name. After a rollback the document that remembered the answer is
    moved away; a second attempt reads this one and keeps the request answered
    (`resolved_hitl`), and the old service, asking only pending prompts, asks it no more."""
    named = {"conversation_id": conversation_id, "user_id": user_id, "request_id": request_id}
    return named | {"created_at": now} | resolved_by_dual_write(now)


@dataclass(frozen=True)
class PromptNote:
    """What the prompts held that `pending_hitl` does not show as it was, for the report."""

    kind: str
    detail: str
    content: Any = None
    placed: bool = True
    """False when this note is the only place the content is kept."""
    field: str | None = None
    """The prompt's field concerned; None for the whole prompt."""


def answered_status(value: Any) -> bool | None:
    """Whether a prompt's `status` says it was answered or is over (True: `_ANSWERED`,
    `rejected`, `timed out`…) or that it waits (False: `_WAITING`, `awaiting_approval`, none
    at all), in any case, spaces, underscores and hyphens alike (`Timed-Out` is `timed_out`).
    None for any other value (`snoozed`, a number): the caller keeps it in a problem, never
    guesses."""
    if value is None:
        return False
    if not isinstance(value, str):
        return None
    word = _SEPARATORS.sub("_", value.strip().lower()).strip("_")
    if word in _ANSWERED:
        return True
    if not word or word in _WAITING or word.startswith(_WAITING_PREFIXES):
        return False
    return None


def is_pending_prompt(document: Mapping[str, Any]) -> bool:
    """Whether a `session_hitl` document is a prompt still awaiting its answer: neither its
    `resolved` (`flag`) nor its status (`answered_status`) says it was answered. A value read
    as neither leaves it to the other, pending unless that one says answered, and is noted
    (`_unreadable_state`)."""
    return (
        flag(document.get("resolved")) is not True
        and answered_status(document.get("status")) is not True
    )


def _unreadable_state(document: Mapping[str, Any]) -> list[PromptNote]:
    """A pending prompt's `resolved` read as neither yes nor no, and its status read as
    neither answered nor waiting: each kept in a note (not placed), for an operator to
    accept."""
    request_id = document.get("request_id")
    resolved, status = document.get("resolved"), document.get("status")
    notes = []
    if flag(resolved) is None:
        detail = f"has resolved {resolved!r}, read as neither yes nor no"
        notes.append(("unreadable_flag", "resolved", resolved, detail))
    if answered_status(status) is None:
        detail = f"has status {status!r}, read as neither answered nor waiting"
        notes.append(("unreadable_status", "status", status, detail))
    return [
        PromptNote(
            kind,
            f"pending prompt {request_id!r} {detail}: it is kept pending",
            content=value,
            placed=False,
            field=field,
        )
        for kind, field, value, detail in notes
    ]


def _id_time(document: Mapping[str, Any]) -> datetime | None:
    found = document.get("_id")
    if not isinstance(found, ObjectId):
        return None
    return taken_time(to_utc_millis(found.generation_time))


def _time(document: Mapping[str, Any]) -> datetime | None:
    """When the prompt was raised, to tell the newest: its `created_at`, else its ObjectId's."""
    return as_time(document.get("created_at")) or _id_time(document)


def _answered_at(document: Mapping[str, Any]) -> datetime | None:
    """When an answered record says its request was answered: its `updated_at`, else when it
    was recorded (`_time`)."""
    times = [t for t in (as_time(document.get("updated_at")), _time(document)) if t is not None]
    return max(times, default=None)


def _still_pending(
    documents: Sequence[Mapping[str, Any]],
) -> tuple[list[Mapping[str, Any]], list[PromptNote]]:
    """The pending records (`is_pending_prompt`) whose request no record answers. A request
    recorded more than once (one request id) is decided by its newest record: a pending
    record dated no later than an answer of its request is the ask that answer answered.
    One dated after every answer, or that cannot be dated against one, contradicts it: the
    request is not asked again (an approval given is never asked twice on a guess), and the
    pending record is kept in a note (not placed) for an operator to decide."""
    answers: dict[str, list[datetime | None]] = {}
    for document in documents:
        if not is_pending_prompt(document) and (rid := reference_text(document.get("request_id"))):
            answers.setdefault(rid, []).append(_answered_at(document))
    still: list[Mapping[str, Any]] = []
    notes: list[PromptNote] = []
    for document in filter(is_pending_prompt, documents):
        request_id = reference_text(document.get("request_id"))
        if request_id is None or request_id not in answers:
            still.append(document)
            continue
        asked = _time(document)
        if asked is None or not any(t is not None and asked <= t for t in answers[request_id]):
            notes.append(_contradiction(document, request_id))
    return still, notes


def _contradiction(document: Mapping[str, Any], request_id: str) -> PromptNote:
    return PromptNote(
        "contradictory_prompt_state",
        f"request {request_id!r} is recorded answered, and pending in a record not dated "
        "before its answer: it is kept answered (not asked again), the pending record only "
        "here; restore the answer or the ask, or accept",
        content=dict(document),
        placed=False,
    )


def _prompt_text(document: Mapping[str, Any]) -> str | None:
    return part_text(read_prompt(document))


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
    """Whether a message holds the prompt: it raised it, with the same text, action and
    params as far as the prompt has them."""
    raised = _raised_by(document, messages)
    if raised is None or raised.hitl_action is None:
        return False
    prompt = read_prompt(document)
    text = part_text(prompt)
    return (
        (text is None or raised.content == text)
        and (prompt.action is None or str(prompt.action) == raised.hitl_action.action)
        and (prompt.params is None or said(hitl_params(prompt)) == said(raised.hitl_action.params))
    )


def _unread(document: Mapping[str, Any]) -> list[PromptNote]:
    """A placed prompt's fields no reader takes, and the spelling of its prompt not read:
    each kept in a note (not placed)."""
    request_id = document.get("request_id")
    unknown = [name for name in document if name not in _READ_FIELDS]
    notes = [
        PromptNote(
            "unread_field",
            f"pending prompt {request_id!r} also holds {name}, which no message holds",
            content=document[name],
            placed=False,
            field=str(name),
        )
        for name in unknown
    ]
    notes += [
        PromptNote(
            "unread_spelling",
            f"pending prompt {request_id!r} also holds {name} with another value than the "
            "one converted",
            content=document[name],
            placed=False,
            field=name,
        )
        for name in read_prompt(document).unread
    ]
    return notes


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
    every run. Raises InvalidInput when it holds bytes that are not valid UTF-8 anywhere
    (`refuse_not_utf8`): it is the conversation's own, read whole as a turn is."""
    refuse_not_utf8(newest, _named(newest))
    request_id = str(reference_text(newest.get("request_id")))
    raised = _raised_by(newest, messages)
    notes = []
    if raised is None:
        detail = f"pending prompt {request_id!r} matches no assistant message"
        notes.append(PromptNote("pending_hitl_without_message", detail))
    action = raised.hitl_action if raised is not None else None
    found = read_prompt(newest)
    params, params_notes = _params(found, action.params if action else {}, request_id)
    notes += params_notes + _text_notes(newest, found, request_id)
    prompt = PendingHitl(
        request_id=request_id,
        action=str(found.action or (action.action if action else "unknown")),
        params=params,
        prompt=_prompt_text(newest) or (raised.content if raised else None),
        message_id=raised.id if raised is not None and raised.id else "",
        created_at=as_time(newest.get("created_at"))
        or (raised.created_at if raised else None)
        or _id_time(newest)
        or messages[-1].created_at,
    )
    return prompt, notes


def _named(document: Mapping[str, Any]) -> str:
    """How a refusal names a prompt (`refuse_not_utf8`)."""
    return f"session_hitl prompt {document.get('_id')!r}"


def _refuse_resolved_taken(documents: Sequence[Mapping[str, Any]]) -> None:
    """InvalidInput when a prompt the new service resolved whose request id the conversation
    keeps (`resolved_on_the_new_service`) holds bytes that are not valid UTF-8 anywhere
    (`refuse_not_utf8`), as the pending prompt (`_pending`)."""
    kept = set(resolved_on_the_new_service(documents))
    for document in documents:
        if document.get("dual_write") is True and (
            not is_pending_prompt(document) and reference_text(document.get("request_id")) in kept
        ):
            refuse_not_utf8(document, _named(document))


def _params(
    found: LegacyPart, raised: dict[str, Any], request_id: str
) -> tuple[dict[str, Any], list[PromptNote]]:
    """The pending prompt's params: its own as a HITL part's (`hitl_params`), else those of
    the message that raised it (`raised`). Its own holding what no message can hold (a value
    JSON cannot encode), which make a turn's HITL part an invalid part, are not taken: a
    note (not placed) keeps them as found, and the message's are pending."""
    if found.params is None:
        return raised, []
    params = hitl_params(found)
    if holdable_params(params):
        return params, []
    detail = (
        f"pending prompt {request_id!r} holds params no message can hold (values JSON cannot "
        "encode); the params of the message that raised it are pending instead"
    )
    return raised, [PromptNote("unread_field", detail, found.params, False, "params")]


def _text_notes(
    document: Mapping[str, Any], found: LegacyPart, request_id: str
) -> list[PromptNote]:
    """A placed `non_json_value` note keeping the prompt's text as found when it is made of
    a value JSON cannot encode (`not_json`), as for a turn's prompt: the text pending is the
    JSON text spelling it, no longer the value."""
    if not not_json(found.content):
        return []
    field = "prompt" if document.get("prompt") is found.content else "content"
    detail = f"pending prompt {request_id!r} held values JSON cannot encode; stored as strings"
    return [PromptNote("non_json_value", detail, found.content, True, field)]


def pending_from_session_hitl(
    documents: Iterable[Mapping[str, Any]], messages: Sequence[AgentMessage]
) -> tuple[PendingHitl | None, list[PromptNote]]:
    """The newest unresolved `session_hitl` prompt as `pending_hitl`, and notes on oddities:
    every other pending prompt no message holds, or one without a request id a message can
    hold, is noted with its document (not placed). Raises InvalidInput when the newest holds
    bytes that are not valid UTF-8 (`_pending`)."""
    return _pending_from([read_code_as_text(d) for d in documents], messages)


def _pending_from(
    documents: Sequence[Mapping[str, Any]], messages: Sequence[AgentMessage]
) -> tuple[PendingHitl | None, list[PromptNote]]:
    """`pending_from_session_hitl` of documents whose code is made text already."""
    pending, notes = _still_pending(documents)
    notes += [n for d in pending for n in _unreadable_state(d)]
    notes += [
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
    unread = [n for d in readable if d is newest or _held(d, messages) for n in _unread(d)]
    return prompt, notes + older + newest_notes + unread


def resolved_on_the_new_service(documents: Iterable[Mapping[str, Any]]) -> list[str]:
    """The request ids of the prompts the new service resolved (`resolved_by_dual_write`),
    oldest first, the newest `RESOLVED_PROMPTS_KEPT`: a rerun or a second attempt after a
    rollback keeps them resolved, as the conversation document it replaces remembered them.
    A prompt resolved by the old service is read as it always was (not pending)."""
    resolved = [
        d
        for d in documents
        if d.get("dual_write") is True
        and not is_pending_prompt(d)
        and reference_text(d.get("request_id")) is not None
    ]
    resolved.sort(key=lambda d: (_time(d) is not None, _time(d) or datetime.min))
    ids = [str(reference_text(d.get("request_id"))) for d in resolved]
    return list(dict.fromkeys(ids))[-RESOLVED_PROMPTS_KEPT:]


def as_resolved(
    conversation: Conversation,
    owner: str | None,
    documents: Iterable[Mapping[str, Any]],
    claimed: Mapping[str, str] | None = None,
) -> Conversation:
    """The conversation with the request ids of its owner's prompts the new service resolved
    (`resolved_on_the_new_service`, `owners_prompt`, through its turns' claims `claimed`) in
    `resolved_hitl`: the calls they held await their results."""
    owned = [d for d in documents if owners_prompt(owner, d, claimed)]
    if not (resolved := resolved_on_the_new_service(owned)):
        return conversation
    # Validated again: the calls the resolved prompts held await their results.
    dumped = conversation.model_dump(by_alias=True)
    return Conversation.model_validate(dumped | {"resolved_hitl": resolved})


def owners_prompt(
    owner: str | None, document: Mapping[str, Any], claimed: Mapping[str, str] | None = None
) -> bool:
    """Whether a prompt is part of the owner's conversation, as its owner's token reads it
    (`users_part` for turns): it names the owner (`user_named`) or no user (a missing, null
    or blank `user_id`); one naming a user id a claim moved the conversation away from
    names its claimer (`claimed`, the claims its turns record: `claimed_user`), as a turn
    the old service logs after the claim does. A conversation no user owns (its turns name
    none: the next service turn naming anyone adopts it) takes only the prompts naming no
    user: a prompt naming a user is never the pending prompt of a conversation that user
    does not own. The read fallback, each conversion and an answer's dual write take a
    conversation's prompts by this one rule."""
    return claimed_user(document.get("user_id"), claimed) in (None, owner)


def _prompt_name(document: Mapping[str, Any]) -> str:
    """How the mixed users problem names a prompt: `session_hitl|` and its request id (its
    `_id` when it has none)."""
    request_id = reference_text(document.get("request_id"))
    return f"session_hitl|{request_id if request_id is not None else document.get('_id')}"


def _mixed_users(
    conversion: LegacyConversion, others: Sequence[Mapping[str, Any]]
) -> list[Problem]:
    """The conversation's `mixed_user_ids` problem by the one rule, the users its turns and
    its prompts name: the converter's (turns only) while no prompt names another user than
    the owner; else one naming every user with their turns and prompts."""
    if not others:
        return []
    users = {user: list(names) for user, names in conversion.users.items()}
    for document in others:
        users.setdefault(str(document.get("user_id")), []).append(_prompt_name(document))
    turns = next((p for p in conversion.problems if p.kind == MIXED_USER_IDS), None)
    conversion.problems = [p for p in conversion.problems if p is not turns]
    return [
        Problem(
            conversation_id=conversion.conversation_id,
            legacy_id=turns.legacy_id if turns is not None else "session_hitl",
            field="user_id",
            kind=MIXED_USER_IDS,
            detail=_mixed_detail(conversion.owner, users),
            content=users,
        )
    ]


def _mixed_detail(owner: str | None, users: Mapping[str, Any]) -> str:
    """What the mixed users problem tells of a conversation: who owns what its turns convert
    to (what is stored may be another's: `gate` says), and that a prompt naming another user
    is never its pending prompt."""
    kept = "(a pending one is kept in a pending_prompt_not_placed problem)"
    if owner is None:
        return (
            f"its turns name no user, so no user owns it (the next service turn naming "
            f"anyone adopts it), and session_hitl prompts name users {sorted(users)}; a "
            f"prompt naming a user is never its pending prompt {kept}"
        )
    return (
        f"turns and session_hitl prompts name several users {sorted(users)}; the "
        f"conversation its turns convert to is {owner!r}'s, every message of it, the other "
        f"users' turns too; a prompt naming another user is never its pending prompt {kept}"
    )


def with_session_prompts(
    conversion: LegacyConversion, documents: Iterable[Mapping[str, Any]]
) -> LegacyConversion:
    """The conversion with its pending prompt from `session_hitl`, and the prompts the new
    service resolved (`resolved_hitl`: the calls they held await their results); oddities
    become problems. Only the owner's prompts are its own (`owners_prompt`): a prompt naming
    another user makes it a `mixed_user_ids` problem, and a pending one is kept in a problem
    of its own, never given to the owner. Raises InvalidInput, changing nothing, when a prompt
    the conversation document is made of (the pending prompt, `_pending`; one the new service
    resolved, `_refuse_resolved_taken`) holds bytes that are not valid UTF-8 anywhere
    (`refuse_not_utf8`, as a turn holding them does): no conversation document can hold its
    text. A prompt it does not take holding them is no obstacle: a problem keeping it writes
    each such byte as its escape (`Problem`), as the turns' `invalid_conversation` does."""
    found = [read_code_as_text(d) for d in documents]
    documents = [d for d in found if owners_prompt(conversion.owner, d, conversion.claimed)]
    others = [d for d in found if not owners_prompt(conversion.owner, d, conversion.claimed)]
    _refuse_resolved_taken(documents)
    pending, notes = _pending_from(documents, conversion.messages)
    owned = "no user owns" if conversion.owner is None else f"{conversion.owner!r} owns"
    notes += [
        _not_placed(
            d,
            f"names user {d.get('user_id')!r}, not the conversation's owner ({owned} it), "
            "so it is not its pending prompt",
        )
        for d in others
        if is_pending_prompt(d)
    ]
    conversation = conversion.conversation
    if conversation is not None:
        conversation = conversation.model_copy(update={"pending_hitl": pending})
        conversion.conversation = as_resolved(
            conversation, conversion.owner, documents, conversion.claimed
        )
    conversion.problems += _mixed_users(conversion, others)
    conversion.problems += [
        Problem(
            conversation_id=conversion.conversation_id,
            legacy_id="session_hitl",
            field=note.field,
            kind=note.kind,
            detail=note.detail,
            content=note.content,
            placed=note.placed,
        )
        for note in notes
    ]
    return conversion
