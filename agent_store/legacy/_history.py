"""What a turn's `message_history_json` holds that no converted message holds. Pure, no I/O.

The history is Pydantic AI's messages as the model saw them: the conversation so far,
repeated on every turn. Every piece of content it carries (a user prompt, a text, a
thinking part, a tool call with its arguments, a tool return, a retry prompt, a part of a
kind no reader knows) is either held by a converted message of the conversation or kept
whole in a problem, once, on the first turn whose history holds it. The converter makes no
message of the history: the turn's own fields are what was logged.

Later histories repeat earlier ones: a message equal to the one at the same position in
the previous turn's history is skipped, and a part found before is not looked at again, so
the check costs about one pass over what the histories add, not over all they repeat.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent_store.core import AgentMessage
from agent_store.legacy._documents import as_text
from agent_store.legacy._parts import call_arguments, normalize_part, result_text, said
from agent_store.store import RuntimeContextMarkers, split_runtime_context

HISTORY_ONLY_CONTENT = "history_only_content"
"""A part of a turn's history no converted message holds, kept whole (placed: the messages
are what the turn logged)."""
SYSTEM_PROMPT_ONLY_IN_HISTORY = "system_prompt_only_in_history"
"""A system prompt or instructions of a history no system message holds (not placed)."""
HIDDEN_RUNTIME_CONTEXT = "hidden_runtime_context"
"""Runtime context the user did not see, here in a history's user prompt (not placed)."""

_BOOKKEEPING = frozenset(
    {"part_kind", "timestamp", "id", "provider_details", "provider_name", "signature"}
)
"""What a Pydantic AI part carries besides its content: when, by whom, its ids."""
_SAYS_NOTHING: tuple[Any, ...] = (None, "", {}, [])


def read_history(raw: Any) -> list[Any] | None:
    """Pydantic AI messages as found in `message_history_json`: the list, [] for none
    (missing or blank), None when it is not such JSON (the history is unreadable)."""
    if raw is None or (isinstance(raw, str | bytes) and not raw.strip()):
        return []
    try:
        history = json.loads(raw) if isinstance(raw, str | bytes) else raw
    except ValueError:
        return None
    return history if isinstance(history, list) else None


@dataclass(frozen=True)
class Finding:
    """A piece of a history the messages do not hold: on which turn, of which kind."""

    turn: int
    """The index of the first turn whose history holds it."""
    kind: str
    detail: str
    content: Any
    placed: bool


def _key(text: str) -> str:
    """What a text says, white space and the spelling of JSON aside (`said`)."""
    return "".join(said(text).split())


@dataclass
class _Held:
    """What the converted messages hold, in the form the history's pieces are looked up."""

    texts: set[str] = field(default_factory=set)
    calls: set[tuple[str, str]] = field(default_factory=set)
    system: set[str] = field(default_factory=set)
    hidden: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, messages: Sequence[AgentMessage], hidden: Iterable[str]) -> _Held:
        held = cls(hidden=set(hidden))
        answers: dict[str | None, list[str]] = {}
        for m in messages:
            if m.role == "system" and m.content:
                held.system.add(m.content)
            for text in (m.content, m.error.message if m.error else None):
                if text:
                    held.texts.add(_key(text))
            if m.upload is not None and m.upload.parsed_text:
                held.texts.add(_key(m.upload.parsed_text))
            for call in m.tool_calls or ():
                held.calls.add((call.function.name, said(call.function.arguments)))
            if m.hitl_action is not None:
                action = m.hitl_action
                held.calls.add((action.action, said(action.params)))
            if m.role == "assistant" and m.content and not m.hitl_action:
                answers.setdefault(m.turn_id, []).append(m.content)
        # A history's text part may be a turn's answer its legacy parts split in several.
        held.texts |= {_key("".join(texts)) for texts in answers.values() if len(texts) > 1}
        return held

    def text(self, value: Any) -> bool:
        return value in _SAYS_NOTHING or _key(as_text(value)) in self.texts


def _part_held(part: Any, held: _Held, markers: RuntimeContextMarkers) -> tuple[bool, str]:
    """Whether the messages hold every piece of a history's part, and the runtime context
    hidden in it (a user prompt's), which the rule for what the user saw keeps apart."""
    if not isinstance(part, dict):
        return part in _SAYS_NOTHING, ""
    kind = part.get("part_kind")
    if kind == "user-prompt":
        content = part.get("content")
        hidden = ""
        for item in content if isinstance(content, list) else [content]:
            if not isinstance(item, str):
                if item not in _SAYS_NOTHING:
                    return False, hidden
                continue
            shown, context = split_runtime_context(item, markers)
            hidden += context
            if not held.text(shown):
                return False, hidden
        return True, hidden
    if kind == "retry-prompt":
        return held.text(part.get("content")), ""
    found = normalize_part(part)
    if any(part[name] not in _SAYS_NOTHING for name in found.unknown_fields):
        return False, ""
    if found.kind == "text":
        return held.text(found.content), ""
    if found.kind == "tool_call":
        name = found.tool_name
        arguments = said(call_arguments(found)[0])
        return isinstance(name, str) and (name, arguments) in held.calls, ""
    if found.kind == "tool_result":
        return found.result in _SAYS_NOTHING or held.text(result_text(found)[0]), ""
    # A thinking part, a file, a built-in tool's call or return, any kind no reader knows.
    return all(v in _SAYS_NOTHING for k, v in part.items() if k not in _BOOKKEEPING), ""


def _prompts(message: dict[str, Any]) -> list[str]:
    """The system prompts and instructions of a history's message, in order."""
    parts = message.get("parts")
    found = [
        as_text(p.get("content"))
        for p in (parts if isinstance(parts, list) else ())
        if isinstance(p, dict) and p.get("part_kind") == "system-prompt"
    ]
    if isinstance(message.get("instructions"), str):
        found.append(message["instructions"])
    return [text for text in found if text]


def history_findings(
    histories: Sequence[list[Any] | None],
    messages: Sequence[AgentMessage],
    *,
    kept_whole: set[int],
    hidden: Iterable[str],
    markers: RuntimeContextMarkers,
) -> list[Finding]:
    """What the histories of a conversation's turns (in turn order) hold that its messages
    do not, each once. `kept_whole` are the turns whose whole history a problem keeps
    already (unreadable, or the turn converts to no message): what they hold is kept;
    `hidden` the runtime contexts problems keep."""
    if not any(histories):
        return []
    held = _Held.of(messages, hidden)
    findings: list[Finding] = []
    seen: set[str] = set()
    previous: list[Any] = []
    for index, history in enumerate(histories):
        if not history:
            continue
        for position, message in enumerate(history):
            if position < len(previous) and previous[position] == message:
                continue
            if isinstance(message, dict):
                findings += _message_findings(
                    index, position, message, held, seen, index in kept_whole, markers
                )
            elif message not in _SAYS_NOTHING:
                findings += _part_finding(
                    index, position, None, message, seen, kept=index in kept_whole
                )
        previous = history
    return findings


def _message_findings(
    index: int,
    position: int,
    message: dict[str, Any],
    held: _Held,
    seen: set[str],
    kept: bool,
    markers: RuntimeContextMarkers,
) -> list[Finding]:
    findings: list[Finding] = []
    for prompt in _prompts(message):
        if prompt in held.system:
            continue
        held.system.add(prompt)
        if not kept:
            findings.append(
                Finding(
                    index,
                    SYSTEM_PROMPT_ONLY_IN_HISTORY,
                    "message_history_json holds a system prompt no system message holds",
                    prompt,
                    placed=False,
                )
            )
    parts = message.get("parts")
    for number, part in enumerate(parts if isinstance(parts, list) else ()):
        if isinstance(part, dict) and part.get("part_kind") == "system-prompt":
            continue
        whole, hidden = _part_held(part, held, markers)
        if hidden and hidden not in held.hidden:
            held.hidden.add(hidden)
            if not kept:
                findings.append(
                    Finding(
                        index,
                        HIDDEN_RUNTIME_CONTEXT,
                        "message_history_json holds runtime context the user did not see in "
                        f"message {position}, part {number}; no problem keeps it",
                        hidden,
                        placed=False,
                    )
                )
        if not whole:
            findings += _part_finding(index, position, number, part, seen, kept=kept)
    return findings


def _part_finding(
    index: int, position: int, number: int | None, part: Any, seen: set[str], *, kept: bool
) -> list[Finding]:
    """A part no message holds, kept once; only remembered when a problem keeps it already
    (`kept`)."""
    key = json.dumps(part, sort_keys=True, default=repr)
    if key in seen:
        return []
    seen.add(key)
    if kept:
        return []
    where = f"message {position}" + (f", part {number}" if number is not None else "")
    kind = part.get("part_kind") if isinstance(part, dict) else None
    return [
        Finding(
            index,
            HISTORY_ONLY_CONTENT,
            f"message_history_json holds {kind or 'content'} ({where}) no message holds; "
            "kept here whole",
            part,
            placed=True,
        )
    ]
