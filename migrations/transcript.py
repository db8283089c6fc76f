"""One canonical transcript per conversation, rendered from legacy turns or from messages.

The two renderings are written apart from the converter's placement logic, so
comparing them checks the conversion itself: no content lost or repeated,
visible text in the same order, every tool result attached to a call of the
same tool. Tool results are compared as a multiset, since the migration moves
each one right after its call; both sides name a result by the tool of the call it
answers: the legacy side pairs results with calls by the converter's own rule
(`CallPairing`, not a copy of it), by the same ids (a call's own, else the one its turn's
history gave it, which the conversion says: `LegacyConversion.history_call_ids`), told
the same returns (the call a turn's history says a result naming none answers:
`LegacyConversion.history_told_calls`; `from_legacy_converted` passes both), and
names a result whose id names a call of the tool it names by that tool, as its parts say,
so a pairing at odds with them shows
even were the rule wrong; the new side by the id each stored result carries. What a
legacy value *says* (a part's kind and fields, the text of a number, a call's arguments) is
read by the same functions the converter uses (`agent_store.legacy`), so the
two can never disagree on that; what the converter reported as not placed is
left out by exactly what it names, a turn's upload, part or whole turn by the kind of its
problem (`Skipped`: a problem of a `session_hitl` prompt hides nothing, whatever turn `_id`
reads as its `legacy_id`) (runtime context stripped from a user's text or an upload's too:
left out of the legacy side only where a problem keeps it, so context lost unrecorded is a
difference).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

from pydantic import ValidationError

from agent_store.core import AgentMessage, FileUpload
from agent_store.legacy import (
    GUESSED_PAIRINGS,
    HIDDEN_RUNTIME_CONTEXT,
    INVALID_TURN,
    INVALID_UPLOAD,
    CallPairing,
    LegacyConversion,
    LegacyPart,
    LegacyTurn,
    Problem,
    call_arguments,
    error_text,
    hitl_params,
    part_text,
    result_text,
    sort_turns,
    turn_names,
    turn_parts,
    turn_uploads,
    user_text,
)
from agent_store.store import DEFAULT_MARKERS, RuntimeContextMarkers, strip_runtime_context

NO_CALL = "<no call>"
"""How a transcript names the tool of a result whose call its messages do not make."""


@dataclass(frozen=True)
class Transcript:
    lines: tuple[str, ...]
    """Everything but tool results, in order."""
    results: tuple[str, ...]
    """Tool results as `tool name -> content`, sorted."""


Place = tuple[str, str | None, int | None]
"""What a problem of a turn names: (turn, field, index in `response_parts`). A turn's
`upload_result` is `(turn, "upload_result", None)`, so no part shares its place, not even one
rebuilt from `tool_calls` at a negative index; its user text `(turn, "user_message", None)`."""


def _part(legacy_id: str, index: int | None) -> Place:
    """The place of a part (an upload's part too), or of the `upload_result` (`index` None,
    as `turn_uploads` gives it)."""
    if index is None:
        return (legacy_id, "upload_result", None)
    return (legacy_id, "response_parts", index)


@dataclass(frozen=True)
class Skipped:
    """What the converter reported as not placed, each by exactly what its problem names. The
    kind of a problem says what it hides, never its `legacy_id` alone: a problem of a
    `session_hitl` prompt (`legacy_id` "session_hitl", no part index) hides nothing of a turn
    whose `_id` reads the same."""

    turns: set[str] = field(default_factory=set)
    """Turns no message holds any of (`INVALID_TURN`)."""
    places: set[Place] = field(default_factory=set)
    """Uploads (`INVALID_UPLOAD`) and parts not placed, by their place."""
    contexts: set[Place] = field(default_factory=set)
    """Texts (the user's, an upload's parsed text) whose runtime context is kept in a
    problem, not in the message, by their place."""
    markers: RuntimeContextMarkers = DEFAULT_MARKERS
    """The markers the converter stripped that context by (the service's)."""

    @classmethod
    def of(
        cls, unplaced: Iterable[Problem], markers: RuntimeContextMarkers = DEFAULT_MARKERS
    ) -> Skipped:
        skipped = cls(markers=markers)
        for problem in unplaced:
            place = (problem.legacy_id, problem.field, problem.part_index)
            if problem.kind == HIDDEN_RUNTIME_CONTEXT:
                skipped.contexts.add(place)
            elif problem.kind in GUESSED_PAIRINGS:
                continue  # a message holds the result, answering the call guessed
            elif problem.kind == INVALID_TURN:
                skipped.turns.add(problem.legacy_id)
            elif problem.kind == INVALID_UPLOAD or (
                problem.field == "response_parts" and problem.part_index is not None
            ):
                skipped.places.add(place)
        return skipped


def _json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False)
    except ValueError:
        return text


def _value(value: Any) -> str:
    """A value as one canonical text: JSON with its keys sorted, what JSON cannot write as
    its `repr`."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)


def _upload(upload: Any, *, context_kept: RuntimeContextMarkers | None = None) -> str:
    """An upload's line: every field, its parsed text too (content a reader may not see), the
    runtime context of each of its texts left out, by the markers `context_kept` names, when
    a problem keeps this upload's (as `_shown`)."""
    try:
        found = FileUpload.model_validate(upload)
    except ValidationError:
        return f"upload: {upload!r}"
    if context_kept is not None:
        texts = {
            k: strip_runtime_context(v, context_kept)
            for k, v in found.__dict__.items()
            if isinstance(v, str)
        }
        found = found.model_copy(update=texts)
    line = f"upload: {found.filename} ({found.file_type}, {found.size} B)"
    if found.parsed_text is None:
        return line
    return f"{line} parsed {_value(found.parsed_text)}"


def _prompt(action: Any, text: str | None, params: Any) -> str:
    """A HITL prompt's line: its action, text and params."""
    return f"hitl {action}: {text or ''} params {_value(params)}"


def _part_line(part: LegacyPart) -> str | None:
    """The transcript line of a part other than a tool result or an upload."""
    if part.kind == "text" and (text := part_text(part)) is not None:
        return f"assistant: {text}"
    if part.kind == "tool_call":
        return f"call {part.tool_name}({_json(call_arguments(part)[0])})"
    if part.kind == "hitl":
        return _prompt(part.action, part_text(part), hitl_params(part))
    if part.kind == "error":
        return f"error: {error_text(part)}"
    return None


def _uploads(turn: LegacyTurn, legacy_id: str, skipped: Skipped) -> list[str]:
    """The lines of the turn's uploads as the converter gathers them, less those it could not
    place, each with its runtime context left out where a problem keeps it."""
    return [
        _upload(upload, context_kept=skipped.markers if place in skipped.contexts else None)
        for index, upload in turn_uploads(turn)
        if (place := _part(legacy_id, index)) not in skipped.places
    ]


PartPlace = tuple[str, int]
"""Where a call or result is: its turn (as its problems name it) and its part index."""


@dataclass
class _Calls:
    """The legacy calls of a conversation so far, each by where it is (`PartPlace`), paired
    with results by the converter's rule, told what the converter was told."""

    pairing: CallPairing[PartPlace] = field(default_factory=CallPairing)
    tools: dict[PartPlace, Any] = field(default_factory=dict)
    called: set[tuple[str, str]] = field(default_factory=set)
    """(id, tool name) of each call its part names an id for, so far."""
    history_ids: Mapping[PartPlace, str] = field(default_factory=dict)
    """The id each call naming none is paired by, its turn's history's, by its place, as the
    converter gave it (`LegacyConversion.history_call_ids`)."""
    history_told: Mapping[PartPlace, PartPlace] = field(default_factory=dict)
    """The call its turn's history says each result naming no call answers, by their places,
    as the converter read it (`LegacyConversion.history_told_calls`)."""

    def turn_results(self, parts: Sequence[tuple[int, LegacyPart]], legacy_id: str) -> list[str]:
        """The turn's results as `tool -> content`, its calls added first: each result named
        by the tool it names itself when its id names a call of that tool (what the parts say
        it answers, whatever call the pairing gives it), else by the tool of the call it
        answers, else (no call left for it) by the tool it names itself."""
        self.pairing.start_turn()
        for index, part in parts:
            if part.kind == "tool_call":
                self.tools[(legacy_id, index)] = part.tool_name
                paired_by = self.history_ids.get((legacy_id, index), part.tool_call_id)
                self.pairing.add_call((legacy_id, index), part.tool_name, paired_by)
                if part.tool_call_id and isinstance(part.tool_name, str):
                    self.called.add((part.tool_call_id, part.tool_name))
        results = [(index, part) for index, part in parts if part.kind == "tool_result"]
        answered = self.pairing.answer(
            [(part.tool_name, part.tool_call_id) for _, part in results],
            [self._told((legacy_id, index)) for index, _ in results],
        )
        return [
            f"{self._named(part, call)} -> {_json(result_text(part)[0])}"
            for (_, part), call in zip(results, answered, strict=True)
        ]

    def _told(self, result: PartPlace) -> PartPlace | None:
        """The call the history says a result answers, one of the calls here (`tools`)."""
        call = self.history_told.get(result)
        return call if call in self.tools else None

    def _named(self, part: LegacyPart, call: PartPlace | None) -> Any:
        """The tool a result is named by (`turn_results`)."""
        name = part.tool_name
        if call is None or (isinstance(name, str) and (part.tool_call_id, name) in self.called):
            return part.tool_name
        return self.tools[call]


def _shown(text: str, legacy_id: str, skipped: Skipped) -> str:
    """A user's text as written, its runtime context left out only where a problem keeps it."""
    kept = (legacy_id, "user_message", None) in skipped.contexts
    return strip_runtime_context(text, skipped.markers) if kept else text


def _turn_lines(
    turn: LegacyTurn, legacy_id: str, skipped: Skipped, calls: _Calls
) -> tuple[list[str], list[str]]:
    """The turn's lines and results, the turn named as its problems name it (`legacy_id`);
    `calls` gains the turn's calls."""
    lines: list[str] = []
    text = user_text(turn)
    if turn.system:
        lines.append(f"system: {text or ''}")
    elif text and (shown := _shown(text, legacy_id, skipped)):
        lines.append(f"user: {shown}")
    lines += _uploads(turn, legacy_id, skipped)
    parts = [(i, p) for i, p in turn_parts(turn) if _part(legacy_id, i) not in skipped.places]
    lines += [line for _, part in parts if (line := _part_line(part)) is not None]
    return lines, calls.turn_results(parts, legacy_id)


def from_legacy(
    turns: Iterable[LegacyTurn],
    unplaced: Sequence[Problem] = (),
    markers: RuntimeContextMarkers = DEFAULT_MARKERS,
    history_ids: Mapping[PartPlace, str] | None = None,
    history_told: Mapping[PartPlace, PartPlace] | None = None,
) -> Transcript:
    """Render legacy turns; what the converter reported as not placed is left out (runtime
    context by the `markers` it stripped it by), each turn named as the converter names it
    (`turn_names`: two turns whose ids read alike apart), each call naming no id paired by
    the id its turn's history gave it (`history_ids`, the conversion's `history_call_ids`:
    without them, by the ids the parts name), each result naming none paired with the call
    its turn's history returns it for (`history_told`, the conversion's
    `history_told_calls`: without them, as without a history). `from_legacy_converted`
    gives both as the conversion read them."""
    skipped = Skipped.of(unplaced, markers)
    lines: list[str] = []
    results: list[str] = []
    calls = _Calls(history_ids=history_ids or {}, history_told=history_told or {})
    ordered = sort_turns(turns)
    legacy_ids = {key: name.legacy_id for key, name in turn_names(ordered).items()}
    for turn in ordered:
        if (legacy_id := legacy_ids[id(turn)]) in skipped.turns:
            continue
        turn_lines, turn_results = _turn_lines(turn, legacy_id, skipped, calls)
        lines += turn_lines
        results += turn_results
    return Transcript(tuple(lines), tuple(sorted(results)))


def from_legacy_converted(
    turns: Iterable[LegacyTurn],
    conversion: LegacyConversion,
    markers: RuntimeContextMarkers = DEFAULT_MARKERS,
) -> Transcript:
    """Render legacy turns as `verify` compares them with their conversion: what it did not
    place left out, and results paired with calls by `CallPairing` told what the conversion
    was told, the ids and returns the turns' histories give (`from_legacy`)."""
    return from_legacy(
        turns,
        conversion.unplaced,
        markers,
        conversion.history_call_ids,
        conversion.history_told_calls,
    )


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
            name = names.get(message.tool_call_id or "", NO_CALL)
            results.append(f"{name} -> {_json(message.content or '')}")
        else:
            lines += _response_lines(message, names)
    return Transcript(tuple(lines), tuple(sorted(results)))


def _response_lines(message: AgentMessage, names: dict[str, str]) -> list[str]:
    """An assistant message's lines, each thing it says in the order a legacy turn holds it
    (the dual write's): its text, its calls, the prompt asking about them, its error;
    `names` gains its calls' tools."""
    lines: list[str] = []
    prompt = message.hitl_action
    if message.content and prompt is None:
        lines.append(f"assistant: {message.content}")
    for call in message.tool_calls or ():
        names[call.id] = call.function.name
        lines.append(f"call {call.function.name}({_json(call.function.arguments)})")
    if prompt is not None:
        lines.append(_prompt(prompt.action, message.content, prompt.params))
    if message.error is not None:
        lines.append(f"error: {message.error.message}")
    return lines


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


def contains(new: Transcript, legacy: Transcript) -> bool:
    """Whether `new` holds all of `legacy`: its lines in the same order (others may come
    between or after) and its tool results."""
    remaining = iter(new.lines)
    in_order = all(any(line == other for other in remaining) for line in legacy.lines)
    return in_order and not Counter(legacy.results) - Counter(new.results)


def not_held(
    live: Sequence[AgentMessage],
    turns: Iterable[LegacyTurn],
    conversion: LegacyConversion,
    markers: RuntimeContextMarkers = DEFAULT_MARKERS,
) -> list[str]:
    """Why a conversation logged to live before its migration does not hold its legacy turns
    (none: it does): its live messages are another user's, or lack legacy content (its
    runtime context left out by the `markers` of its conversion)."""
    owner = conversion.conversation.user_id if conversion.conversation is not None else None
    others = sorted({repr(m.user_id) for m in live if m.user_id != owner})
    if others:
        return [f"its live messages are user {', '.join(others)}'s, its legacy turns {owner!r}'s"]
    legacy = from_legacy_converted(turns, conversion, markers)
    new = from_messages(live)
    return [] if contains(new, legacy) else differences(legacy, new)
