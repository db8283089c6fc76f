"""What a turn's `message_history_json` holds that no converted message holds. Pure, no I/O.

The history is Pydantic AI's messages as the model saw them: the conversation so far,
repeated on every turn. Every piece of content it carries (a user prompt, a text, a
thinking part, a tool call with its arguments, a tool return, a retry prompt, a part of a
kind no reader knows) is either held by a converted message of the conversation or kept
whole in a problem, once, on the first turn whose history holds it. The converter makes no
message of the history: the turn's own fields are what was logged.

One rule: every key of every history message is either read as a known, checked field or
is metadata (`_MESSAGE_METADATA`, `_BOOKKEEPING`), else it is kept: a message not in Pydantic
AI's shape (`readable`) whole, a part holding a field no check reads whole. A piece is held
only by a message of its kind, its text alike but for white space at its ends: a user
prompt by a user's text, a response text by an assistant's of its own turn or an earlier
one, each message once (a history saying a text more often than those messages is kept
again, so another turn's same words never hold a turn's answer), a tool return by the tool
message answering its call (by the call's id when the history names one, else by the
tool's name), a call by a call of that tool with those arguments; nothing holds thinking.

Later histories repeat earlier ones: a message equal to the one at the same position in
the previous turn's history is skipped (the converter gives each history as the messages it
adds), and a part found before is not looked at again, so the check costs about one pass
over what the histories add, not over all they repeat.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agent_store.core import AgentMessage
from agent_store.legacy._documents import as_text
from agent_store.legacy._parts import (
    LegacyPart,
    call_arguments,
    normalize_part,
    part_kind,
    result_text,
    said,
)
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
    | {"dynamic_ref"}
)
"""What a Pydantic AI part carries besides its content: when, by whom, its ids (a system
prompt's `dynamic_ref` names the function that made it)."""
_MESSAGE_METADATA = frozenset(
    {
        "kind",
        "timestamp",
        "run_id",
        "model_name",
        "usage",
        "provider_name",
        "provider_details",
        "provider_response_id",
        "finish_reason",
    }
)
"""What a Pydantic AI message carries besides its parts and instructions: when, by which
model and provider, at what cost, under which ids. No conversation content."""
_KINDS = ("request", "response", None)
"""A message's `kind`: what its parts are tells a request from a response, so none is read."""
_PROMPT_FIELDS = {
    "user-prompt": frozenset({"content"}),
    "system-prompt": frozenset({"content"}),
    "retry-prompt": frozenset({"content", "tool_name", "tool_call_id"}),
}
"""The fields the check reads of a prompt part (besides its bookkeeping)."""
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


def readable(message: Any) -> bool:
    """Whether a history's message is a Pydantic AI message the check reads whole: a request
    or response (or of no `kind`) whose `parts` is a list, whose `instructions` (if any) is a
    text, and which holds nothing else but metadata (`_MESSAGE_METADATA`) or empty values.
    Any other is kept whole."""
    if not isinstance(message, dict) or message.get("kind") not in _KINDS:
        return False
    if not isinstance(message.get("parts"), list):
        return False
    if not isinstance(message.get("instructions"), str | None):
        return False
    read = _MESSAGE_METADATA | {"parts", "instructions"}
    return all(v in _SAYS_NOTHING for k, v in message.items() if k not in read)


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
    """What a text says, the spelling of JSON and white space at its ends aside (`said`):
    the exactness the converter compares texts with."""
    return said(text).strip()


@dataclass
class _Held:
    """What the converted messages hold, by kind, in the form the history's pieces are
    looked up: a user prompt by a user's text, a response text by an assistant's, a tool
    return by the tool message answering its call."""

    user: set[str] = field(default_factory=set)
    answers: dict[str, list[int]] = field(default_factory=dict)
    """Each assistant's text (and each turn's answer its parts split in several), by the
    turns saying it (their indexes, in order, one for each time)."""
    errors: set[str] = field(default_factory=set)
    calls: set[tuple[str, str]] = field(default_factory=set)
    results_by_id: set[tuple[str, str]] = field(default_factory=set)
    results_by_name: set[tuple[str, str]] = field(default_factory=set)
    system: set[str] = field(default_factory=set)
    hidden: set[str] = field(default_factory=set)
    turn: int = 0
    """The turn whose history is being read."""
    said: _Said = field(default_factory=lambda: _Said())
    kept_answers: Counter[str] = field(default_factory=Counter)
    """How many times a problem keeps each response text of the histories so far."""

    @classmethod
    def of(
        cls, messages: Sequence[AgentMessage], hidden: Iterable[str], turns: Mapping[Any, int]
    ) -> _Held:
        """What the messages hold; `turns` gives the index of each turn by its `turn_id`."""
        held = cls(hidden=set(hidden))
        split: dict[str | None, list[str]] = {}
        names: dict[str, str] = {}
        for m in messages:
            if m.role == "system" and m.content:
                held.system.add(m.content)
            elif m.role == "user":
                upload = m.upload.parsed_text if m.upload is not None else None
                held.user |= {_key(t) for t in (m.content, upload) if t}
            elif m.role == "tool" and m.content is not None:
                call_id = m.tool_call_id or ""
                held.results_by_id.add((call_id, _key(m.content)))
                held.results_by_name.add((names.get(call_id, ""), _key(m.content)))
            elif m.role == "assistant":
                held.add_answer(m, names, turns.get(m.turn_id, 0))
                if m.content and not m.hitl_action:
                    split.setdefault(m.turn_id, []).append(m.content)
        # A history's text part may be a turn's answer its legacy parts split in several.
        for turn_id, texts in split.items():
            if len(texts) > 1:
                held.answers.setdefault(_key("".join(texts)), []).append(turns.get(turn_id, 0))
        for saying in held.answers.values():
            saying.sort()
        return held

    def add_answer(self, m: AgentMessage, names: dict[str, str], turn: int) -> None:
        if m.content:
            self.answers.setdefault(_key(m.content), []).append(turn)
        if m.error is not None and m.error.message:
            self.errors.add(_key(m.error.message))
        for call in m.tool_calls or ():
            names[call.id] = call.function.name
            self.calls.add((call.function.name, said(call.function.arguments)))
        if m.hitl_action is not None:
            self.calls.add((m.hitl_action.action, said(m.hitl_action.params)))

    def result(self, call_id: str | None, name: Any, value: Any) -> bool:
        """Whether the tool message answering the call holds this return: by the call's id
        when the history names one, else by the tool's name."""
        if value in _SAYS_NOTHING:
            return True
        text = _key(as_text(value))
        if call_id:
            return (call_id, text) in self.results_by_id
        return isinstance(name, str) and (name, text) in self.results_by_name

    def answer(self, value: Any) -> bool:
        """Whether the messages hold a response text of the history being read as often as
        that history says it: the messages of its turn and the earlier ones (another turn's
        words are not this one's answer, nor is a later turn's), each once, beside the
        problems keeping it already. One not held is counted as kept."""
        if value in _SAYS_NOTHING:
            return True
        key = _key(as_text(value))
        told = bisect_right(self.answers.get(key, ()), self.turn)
        if self.said.counts[key] <= told + self.kept_answers[key]:
            return True
        self.kept_answers[key] += 1
        return False


@dataclass
class _Said:
    """The response texts of the history being read, by position (`_answer_keys`), and how
    often it says each. A history replaces messages of the previous one at their places,
    adds some after them, or ends sooner: only what it adds is read."""

    at: list[list[str]] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)

    def read(self, added: Sequence[tuple[int, Any]], length: int | None) -> None:
        """The next history, by what it adds and its length (None: it holds nothing, or is
        unreadable, and the previous one stands)."""
        if length is not None:
            for keys in self.at[length:]:
                self.counts.subtract(keys)
            del self.at[length:]
            self.at += [[] for _ in range(length - len(self.at))]
        for position, message in added:
            self.counts.subtract(self.at[position])
            self.at[position] = _answer_keys(message)
            self.counts.update(self.at[position])


def _answer_keys(message: Any) -> list[str]:
    """The response texts of a history's message the check reads (`readable`), as compared."""
    if not readable(message):
        return []
    found = [
        normalize_part(part)
        for part in message["parts"]
        if isinstance(part, dict) and part_kind(part) == "text"
    ]
    return [
        _key(as_text(text.content))
        for text in found
        if text.content not in _SAYS_NOTHING and not _unknown(text)
    ]


def _unknown(found: LegacyPart) -> bool:
    """Whether a part holds something in a field its kind does not read: it is kept whole."""
    return any(found.raw[name] not in _SAYS_NOTHING for name in found.unknown_fields)


def returned(part: LegacyPart) -> str | None:
    """What a tool result, or a history's tool return, says: as the check compares it (`_key`),
    so a result and the return it is are one; None when it says nothing (no content)."""
    return None if part.result in _SAYS_NOTHING else _key(result_text(part)[0])


def _text_in(value: Any, texts: set[str]) -> bool:
    return value in _SAYS_NOTHING or _key(as_text(value)) in texts


def _unread(part: dict[str, Any], read: frozenset[str]) -> bool:
    """Whether a part holds something in a field the check does not read."""
    return any(v not in _SAYS_NOTHING for k, v in part.items() if k not in read | _BOOKKEEPING)


def _user_prompt_held(
    part: dict[str, Any], held: _Held, markers: RuntimeContextMarkers
) -> tuple[bool, str]:
    """Whether the user's messages hold a history's user prompt (an image or any other item
    is not held), and the runtime context hidden in it, which the rule for what the user saw
    keeps apart."""
    content = part.get("content")
    hidden = ""
    whole = not _unread(part, _PROMPT_FIELDS["user-prompt"])
    for item in content if isinstance(content, list) else [content]:
        if not isinstance(item, str):
            whole = whole and item in _SAYS_NOTHING
            continue
        shown, context = split_runtime_context(item, markers)
        hidden += context
        whole = whole and _text_in(shown, held.user)
    return whole, hidden


class _Verdict(NamedTuple):
    """Whether the messages hold a history's part (`_part_held`)."""

    whole: bool
    hidden: str = ""
    """The runtime context hidden in it (a user prompt's)."""
    counted: bool = False
    """A response text the messages hold fewer times than the histories say it
    (`_Held.answer`): kept again, though a problem keeps the same part already."""


def _part_held(part: Any, held: _Held, markers: RuntimeContextMarkers) -> _Verdict:
    """Whether a message of the right kind holds every piece of a history's part (its fields
    no check reads empty), and the runtime context hidden in it (a user prompt's)."""
    if not isinstance(part, dict):
        return _Verdict(part in _SAYS_NOTHING)
    kind = part.get("part_kind")
    if kind == "user-prompt":
        return _Verdict(*_user_prompt_held(part, held, markers))
    if kind == "retry-prompt":
        content = part.get("content")
        return _Verdict(
            not _unread(part, _PROMPT_FIELDS["retry-prompt"])
            and (
                _text_in(content, held.errors)
                or _text_in(content, held.user)
                or held.result(part.get("tool_call_id"), part.get("tool_name"), content)
            )
        )
    found = normalize_part(part)
    if _unknown(found):
        return _Verdict(False)
    if found.kind == "text":
        return _Verdict(whole := held.answer(found.content), counted=not whole)
    if found.kind == "tool_call":
        arguments = said(call_arguments(found)[0])
        return _Verdict((found.tool_name, arguments) in held.calls)
    if found.kind == "tool_result":
        text = found.result if found.result in _SAYS_NOTHING else result_text(found)[0]
        return _Verdict(held.result(found.tool_call_id, found.tool_name, text))
    # A thinking part, a file, a built-in tool's call or return, any kind no reader knows.
    return _Verdict(not _unread(part, frozenset()))


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
    histories: Sequence[Sequence[tuple[int, Any]]],
    messages: Sequence[AgentMessage],
    *,
    lengths: Sequence[int | None],
    turn_ids: Sequence[Any],
    kept_whole: set[int],
    hidden: Iterable[str],
    markers: RuntimeContextMarkers,
) -> list[Finding]:
    """What the histories of a conversation's turns (in turn order) hold that its messages
    do not, each once; a response text as many times as the histories say it beyond what
    the messages of its turn and the earlier ones say (`_Held.answer`). Each history is
    given by the messages it adds to the previous turn's, by position (the others are equal
    to the one at their place there, looked at already), and its length (`lengths`, None
    where it holds nothing or is unreadable); `turn_ids` names each turn's messages.
    `kept_whole` are the turns whose whole history a problem keeps already (unreadable, or
    the turn converts to no message): what they hold is kept; `hidden` the runtime contexts
    problems keep."""
    if not any(histories):
        return []
    held = _Held.of(messages, hidden, {turn_id: n for n, turn_id in enumerate(turn_ids)})
    findings: list[Finding] = []
    seen: set[str] = set()
    for index, added in enumerate(histories):
        held.turn = index
        held.said.read(added, lengths[index])
        kept = index in kept_whole
        for position, message in added:
            if readable(message):
                findings += _message_findings(index, position, message, held, seen, kept, markers)
            elif message not in _SAYS_NOTHING:
                findings += _part_finding(index, position, None, message, seen, kept=kept)
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
    for number, part in enumerate(message["parts"]):
        if isinstance(part, dict) and part.get("part_kind") == "system-prompt":
            if _unread(part, _PROMPT_FIELDS["system-prompt"]):
                findings += _part_finding(index, position, number, part, seen, kept=kept)
            continue
        whole, hidden, counted = _part_held(part, held, markers)
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
            once = None if counted else seen
            findings += _part_finding(index, position, number, part, once, kept=kept)
    return findings


def _part_finding(
    index: int,
    position: int,
    number: int | None,
    part: Any,
    seen: set[str] | None,
    *,
    kept: bool,
) -> list[Finding]:
    """A part no message holds, kept once (`seen`: the parts kept so far; None for a
    response text kept as often as it is said, `_Held.answer`); only remembered when a
    problem keeps it already (`kept`)."""
    if seen is not None:
        key = json.dumps(part, sort_keys=True, default=repr)
        if key in seen:
            return []
        seen.add(key)
    if kept:
        return []
    where = f"message {position}" + (f", part {number}" if number is not None else "")
    kind = part.get("part_kind") if isinstance(part, dict) else None
    if number is None and isinstance(part, dict):
        kind = "a message not in Pydantic AI's shape"
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
