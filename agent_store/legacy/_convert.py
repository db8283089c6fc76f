"""Legacy turns into stored messages: the converter (DESIGN §4). Pure, no I/O.

Mapping, per turn (turns by time, ties in stored order): system turn ->
`system`; user text and uploads -> `user`; text part -> `assistant` content;
a run of tool_call parts -> one `assistant` with `tool_calls`; tool_result ->
`tool`, placed right after its call's message; hitl -> `assistant` with
`hitl_action` and the prompt as content; error -> `assistant` with `error`.
Token usage and latency go on the turn's last assistant message.

Whatever the converter cannot place as it is becomes a `Problem` carrying the
content, never a silent loss.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, field_validator

from agent_store.core import (
    AgentMessage,
    Conversation,
    FileUpload,
    InvalidInput,
    Usage,
    describe_validation_error,
    message_adapter,
    to_utc_millis,
)
from agent_store.legacy._documents import (
    CUT_FIELD,
    EPOCH,
    EXACT_FIELD,
    MAX_REFERENCE_LENGTH,
    WHOLE_TEXTS_FIELD,
    LegacyTurn,
    TurnName,
    TurnTime,
    as_count,
    claimers,
    dated_turns,
    epoch_number,
    flag,
    is_text,
    named_by,
    named_users,
    not_json,
    owner_of,
    parse_turns,
    reference_text,
    sort_turns,
    storable,
    storable_text,
    turn_names,
)
from agent_store.legacy._dual_write import exact_digest
from agent_store.legacy._history import (
    HIDDEN_RUNTIME_CONTEXT,
    history_findings,
    read_history,
    returned,
)
from agent_store.legacy._pairing import CallPairing, history_call_ids, returns_here, told_calls
from agent_store.legacy._parts import (
    LegacyPart,
    PartKind,
    call_arguments,
    error_text,
    hitl_params,
    normalize_part,
    part_text,
    result_text,
    said,
    summary_call,
    summary_calls,
    summary_text,
    turn_parts,
    turn_uploads,
    user_text,
)
from agent_store.store import (
    MAX_NAME_CHARS,
    FullText,
    TurnPlan,
    TurnRules,
    collapse_whitespace,
    pending_after,
    plan_turn,
    shorten,
    split_runtime_context,
    validate_identifier,
    with_texts,
)

_upload_adapter: TypeAdapter[FileUpload] = TypeAdapter(FileUpload)

MIXED_USER_IDS = "mixed_user_ids"
"""A conversation whose turns name several users: the last owns every message of it, so the
others' words reach that user, and their erasure no longer does (not placed: an operator
accepts it, `finish --accept`). Its content maps each user to the turns naming them."""

INVALID_USER_ID = "invalid_user_id"
"""A conversation whose owner's legacy `user_id` is no identifier: stored owned by the user id
derived from it (`derived_user_id`), never unowned, which the next service turn naming any
user would adopt with its history (not placed: an operator maps the id and runs again, or
accepts it). Its content is the legacy user id and the id it is stored as."""

HISTORY_CONTRADICTS_PAIRING = "history_contradicts_pairing"
"""A result naming no call, paired by the order of its turn's parts with one of several calls
of its tool, whose return `message_history_json` gives saying something else (not placed: an
operator accepts the pairing, `finish --accept`). Its content holds the result, the call it
answers and the history's return."""

AMBIGUOUS_TOOL_RESULT = "ambiguous_tool_result"
"""A result whose id names no call of the tool it names, only unanswered calls of others,
several or an earlier turn's (an id reused across turns, `call_0` in every response): the
message answers the one the order gives (this turn's, else the earlier turn's latest), a guess
(not placed: an operator accepts the pairing, `finish --accept`). Its content holds the
result, the call it answers and the calls it could answer."""

INVALID_TURN = "invalid_turn"
"""A turn the store refuses whole (`plan_turn`): no message holds any of it, its problem
keeps it (`field` None)."""

INVALID_UPLOAD = "invalid_upload"
"""An upload the upload model refuses: no message holds it, its problem keeps it (`field`
`upload_result`, or `response_parts` and the index of its part)."""

DUAL_WRITE_NOT_EXACT = "dual_write_not_exact"
"""A dual-written turn converted without the live messages it was written from (a second
attempt after a rollback that cleared `agent_messages`) that gives other messages than those
(`exact_digest`): a text cut to fit the copy, messages the legacy format put in another order
or left out, one it wrote without its digest (before copies recorded one), or one the legacy
service edited since. Its messages are stored as it converts (not placed: an operator checks
them and accepts, `finish --accept`); its content names the live turn and the GridFS files
keeping its cut texts whole."""

GUESSED_PAIRINGS = frozenset({HISTORY_CONTRADICTS_PAIRING, AMBIGUOUS_TOOL_RESULT})
"""Problems not placed whose result a message holds nonetheless, answering the call guessed:
what they concern is converted, so a transcript of what was placed keeps it."""


class Problem(BaseModel):
    """Something in a legacy conversation the converter could not place as it is."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    conversation_id: str
    legacy_id: str
    """`_id` of the turn document, as a string; for a turn whose `_id` reads like an earlier
    turn's of the conversation, that `_id`'s extended JSON (`TurnName.legacy_id`)."""
    field: str | None = None
    """The turn's field concerned (`response_parts`, `upload_result`, `token_usage`…); None
    when it is the whole turn (or, with `legacy_id` `*`, the whole conversation)."""
    part_index: int | None = None
    """Index in `response_parts`, when the problem is one part."""
    kind: str
    """What went wrong, e.g. `unknown_part` or `unplaced_tool_result`."""
    detail: str
    """What went wrong, for a person."""
    content: Any = None
    """The content concerned, as found; what BSON cannot hold (a text read from JSON holding
    a lone surrogate) as the JSON text spelling it (`storable`). Its texts too hold each lone
    surrogate as its escape (`storable_text`)."""
    placed: bool = False
    """True when the content was still converted, changed as `detail` says (e.g. given a
    generated id); False when this problem is the only place the content is kept."""

    @field_validator("content")
    @classmethod
    def _storable(cls, value: Any) -> Any:
        return storable(value)

    @field_validator("conversation_id", "legacy_id", "field", "kind", "detail")
    @classmethod
    def _storable_text(cls, value: str | None) -> str | None:
        """Every text of a problem as BSON holds it, as its content (`storable_text`)."""
        return None if value is None else storable_text(value)


@dataclass
class LegacyConversion:
    """One conversation converted: its messages by `seq`, its document and its problems."""

    conversation_id: str
    messages: list[AgentMessage]
    conversation: Conversation | None
    """None when no turn produced a message."""
    problems: list[Problem]
    turns: int
    full_texts: list[FullText] = field(default_factory=list)
    """Whole texts of the fields cut to bound the messages, to keep in GridFS."""
    owner: str | None = None
    """Who owns it (`owner_of`): the last user its turns name."""
    claimed: dict[str, str] = field(default_factory=dict)
    """The user ids claims moved its turns away from, each to its claimer (`claimers`): a
    prompt naming one is the claimer's (`with_session_prompts`), as a turn naming one is."""
    users: dict[str, list[str]] = field(default_factory=dict)
    """The turns naming each user, by the name each goes by (`turn_names`): with the users
    its prompts name, whether it is a `mixed_user_ids` problem (`with_session_prompts`)."""
    history_call_ids: dict[tuple[str, int], str] = field(default_factory=dict)
    """The id its turn's `message_history_json` gives each call naming none (an empty id
    names none), by its turn (`legacy_id`) and part index: the id results are paired with
    it by (`CallPairing`), which the migration's transcript pairs by too."""
    history_told_calls: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)
    """The call its turn's `message_history_json` says each result naming no call answers
    (`told_calls`), both by turn (`legacy_id`) and part index: what `CallPairing.answer` is
    told, which the migration's transcript tells it too, since the calls it leaves
    unanswered decide what a later result its id alone pairs answers."""

    @property
    def unplaced(self) -> list[Problem]:
        """Problems holding content that no message holds."""
        return [p for p in self.problems if not p.placed]


# -- real tool-call ids from Pydantic AI's message history -------------------------------


@dataclass(frozen=True)
class _Returned:
    """A tool return a turn's history holds: of which tool and call, what it says
    (`returned`), and the part as found."""

    tool_name: str
    call_id: str
    says: str | None
    raw: Any


@dataclass
class _HistoryIds:
    """The tool calls and returns of a turn's `message_history_json` that name their call's
    id, in order."""

    calls: list[tuple[str, str, str]] = field(default_factory=list)
    """(tool name, what its arguments say, call id) of each call."""
    returns: list[_Returned] = field(default_factory=list)
    segment: list[tuple[str, str, str] | _Returned] = field(default_factory=list)
    """The calls and returns of what follows the previous turn's history: this turn's own."""
    readable: bool = True


_Ids = tuple[tuple[str, str, str] | _Returned, ...]
"""A history message's tool calls, (tool name, what its arguments say, call id), and tool
returns, in order."""


def _message_ids(message: Any) -> _Ids:
    parts = message.get("parts") if isinstance(message, dict) else None
    found: list[tuple[str, str, str] | _Returned] = []
    for raw in parts if isinstance(parts, list) else ():
        part = normalize_part(raw)
        call_id, name = part.tool_call_id, part.tool_name
        if not (isinstance(call_id, str) and call_id and isinstance(name, str)):
            continue
        if part.kind == "tool_call":
            found.append((name, _arguments(part), call_id))
        elif part.kind == "tool_result":
            found.append(_Returned(name, call_id, returned(part), raw))
    return tuple(found)


class _Histories:
    """Each turn's `message_history_json` read once (`read_history`), in turn order: its
    tool calls and returns, and the messages it adds, by position, which are all the history
    check looks at (`history_findings`). A history repeats the conversation so far: a message
    equal to the one at its place in the previous turn's history is neither normalised again
    nor kept, and only that previous history is kept, so reading a conversation costs one pass
    over what its histories add."""

    def __init__(self) -> None:
        self._previous: list[Any] = []
        self._previous_ids: list[_Ids] = []
        self.added: dict[int, list[tuple[int, Any]]] = {}
        """What each turn's history adds (by `id()` of the turn)."""
        self.lengths: dict[int, int] = {}
        """How many messages each turn's history holds, where it holds any and is readable
        (by `id()` of the turn)."""

    def read(self, turn: LegacyTurn) -> _HistoryIds:
        found = _HistoryIds()
        history = read_history(turn.message_history_json)
        self.added[id(turn)] = []
        if history is None:
            found.readable = False
            return found
        if not history:
            return found
        self.lengths[id(turn)] = len(history)
        previous, previous_ids = self._previous, self._previous_ids
        ids: list[_Ids] = []
        start = None
        for position, message in enumerate(history):
            if position < len(previous) and previous[position] == message:
                ids.append(previous_ids[position])
            else:
                self.added[id(turn)].append((position, message))
                ids.append(_message_ids(message))
                start = position if start is None else start
        self._previous, self._previous_ids = history, ids
        found.segment = [i for m in ids[len(ids) if start is None else start :] for i in m]
        for entry in (i for message_ids in ids for i in message_ids):
            if isinstance(entry, _Returned):
                found.returns.append(entry)
            else:
                found.calls.append(entry)
        return found


def _generated_call_id(legacy_key: str, part_index: int, again: int = 0) -> str:
    """The id of a call naming none: a digest of its turn and part, drawn `again` when an
    earlier one was taken (`_Converter._call_id`)."""
    drawn = f"{legacy_key}\0{part_index}" + (f"\0{again}" if again else "")
    return "call_legacy_" + hashlib.sha256(drawn.encode()).hexdigest()[:24]


# -- one turn ----------------------------------------------------------------------------


@dataclass
class _CallGroup:
    """An assistant message of tool calls, and the results placed after it."""

    message: dict[str, Any]
    calls: list[tuple[str, str]] = field(default_factory=list)
    """(id, tool name) in call order."""
    results: dict[str, dict[str, Any]] = field(default_factory=dict)


Item = dict[str, Any] | _CallGroup


@dataclass
class _TurnState:
    """What the handlers of one turn's parts share."""

    turn: LegacyTurn
    at: datetime
    items: list[Item]
    history: _HistoryIds
    call_ids: dict[int, str | None]
    """The real id of each tool call part, by its index: its own, or its history's
    (`history_call_ids`)."""
    groups: list[_CallGroup] = field(default_factory=list)
    open_group: _CallGroup | None = None
    pending_results: list[tuple[int, LegacyPart, str | None]] = field(default_factory=list)


def _arguments(part: LegacyPart) -> str:
    """What a call's arguments say (`said`): 1 and 1.0 alike, `true` not `1`."""
    return said(call_arguments(part)[0])


def _held(summed: LegacyPart, parts: Sequence[LegacyPart]) -> bool:
    """Whether a part holds the summed-up call: the same tool, and the same arguments unless
    the summary names none."""
    return any(
        p.tool_name == summed.tool_name
        and (summed.args is None or _arguments(p) == _arguments(summed))
        for p in parts
    )


class _Converter:
    """Converts the turns of one conversation, collecting problems as it goes."""

    def __init__(self, conversation_id: str, rules: TurnRules, names: dict[int, TurnName]) -> None:
        self.conversation_id = conversation_id
        self.rules = rules
        self.names = names
        """What each turn goes by, by `id(turn)` (`turn_names`)."""
        self.problems: list[Problem] = []
        self.used_call_ids: set[str] = set()
        self.pairing: CallPairing[str] = CallPairing()
        """Which call each result answers (the one rule, `CallPairing`), each call known by
        the id it is stored under."""
        self.groups: dict[str, _CallGroup] = {}
        """Each call's group, by the id it is stored under."""
        self.unanswered_usage = Usage()
        """Token usage of turns without an assistant message: counted on the conversation."""
        self.histories = _Histories()
        self.calls_made: Counter[tuple[str, str]] = Counter()
        """How many calls of each tool with each arguments (`_arguments`) the turns made."""
        self.history_ids: dict[tuple[str, int], str] = {}
        """`LegacyConversion.history_call_ids`."""
        self.history_told: dict[tuple[str, int], tuple[str, int]] = {}
        """`LegacyConversion.history_told_calls`."""
        self.call_places: dict[str, tuple[str, int]] = {}
        """Each call's turn (`legacy_id`) and part index, by the id it is stored under."""

    def problem(
        self,
        turn: LegacyTurn,
        kind: str,
        detail: str,
        *,
        field: str | None,
        part_index: int | None = None,
        content: Any = None,
        unplaced: bool = True,
    ) -> None:
        self.problems.append(
            Problem(
                conversation_id=self.conversation_id,
                legacy_id=self.names[id(turn)].legacy_id,
                field=field,
                part_index=part_index,
                kind=kind,
                detail=detail,
                content=content,
                placed=not unplaced,
            )
        )

    def checked(
        self,
        turn: LegacyTurn,
        adapter: TypeAdapter[Any],
        value: Any,
        *,
        kind: str,
        index: int | None,
    ) -> Any:
        """`value` validated by `adapter`; else None, the value kept in a problem."""
        try:
            return adapter.validate_python(value)
        except ValidationError as exc:
            upload = kind == INVALID_UPLOAD
            self.problem(
                turn,
                kind,
                describe_validation_error(exc, subject="upload" if upload else "message"),
                field="upload_result" if upload and index is None else "response_parts",
                part_index=index,
                content=value,
            )
            return None

    def made_text(
        self,
        turn: LegacyTurn,
        value: Any,
        what: str,
        *,
        field: str,
        part_index: int | None = None,
    ) -> None:
        """`value` (`what` the turn holds in `field`) made the text a message holds: a value
        JSON cannot encode (`not_json`) is stored as the JSON text spelling it, a string for
        each such value (a time as ISO text, bytes as base64), which is no longer the value,
        so a placed problem keeps it as found, its one record once the legacy turns are
        dropped. The one rule for every text a message or a conversation is made of."""
        if not_json(value):
            self.problem(
                turn,
                "non_json_value",
                f"{what} held values JSON cannot encode; stored as strings",
                field=field,
                part_index=part_index,
                content=value,
                unplaced=False,
            )

    def turn_items(self, turn: LegacyTurn, at: datetime) -> list[Item]:
        """One turn's items in order; tool results are attached to their call groups."""
        parts = self._parts(turn)
        history = self.histories.read(turn)
        if not history.readable:
            self.problem(
                turn,
                "unreadable_history",
                "message_history_json is not Pydantic AI messages JSON; ids are generated, "
                "and the history is kept whole here",
                field="message_history_json",
                content=turn.message_history_json,
                unplaced=False,
            )
        calls = [(index, part) for index, part in parts if part.kind == "tool_call"]
        real = history_call_ids(
            [(p.tool_name, _arguments(p), p.tool_call_id) for _, p in calls],
            history.calls,
            self.used_call_ids,
            self.calls_made,
        )
        legacy_id = self.names[id(turn)].legacy_id
        for (index, part), found in zip(calls, real, strict=True):
            if found is not None and not part.tool_call_id:
                self.history_ids[(legacy_id, index)] = found
        self.pairing.start_turn()
        state = _TurnState(
            turn=turn,
            at=at,
            items=self._opening(turn, at),
            history=history,
            call_ids={index: found for (index, _), found in zip(calls, real, strict=True)},
        )
        for index, part in parts:
            if part.kind != "tool_call":
                state.open_group = None
            self._HANDLERS[part.kind](self, state, index, part)
            self._check_spellings(turn, index, part)
        self._place_results(state)
        self._check_response_text(turn, state.items)
        self._check_turn_fields(turn)
        self._check_summary_calls(turn, parts, {cid for g in state.groups for cid, _ in g.calls})
        self._usage(turn, state.items)
        return state.items

    # -- the parts of a turn, one handler per kind -----------------------------------------

    def _on_tool_call(self, state: _TurnState, index: int, part: LegacyPart) -> None:
        real = state.call_ids[index]
        call = self._call(state.turn, index, part, real)
        if call is None:
            return
        if state.open_group is None:
            state.open_group = _CallGroup(
                message={
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [],
                    "created_at": state.at,
                }
            )
            state.items.append(state.open_group)
            state.groups.append(state.open_group)
        state.open_group.message["tool_calls"].append(call)
        state.open_group.calls.append((call["id"], call["function"]["name"]))
        self.groups[call["id"]] = state.open_group
        self.call_places[call["id"]] = (self.names[id(state.turn)].legacy_id, index)
        self.pairing.add_call(call["id"], call["function"]["name"], real)
        self.calls_made[(call["function"]["name"], _arguments(part))] += 1

    def _on_tool_result(self, state: _TurnState, index: int, part: LegacyPart) -> None:
        state.pending_results.append((index, part, part.tool_call_id))

    def _on_text(self, state: _TurnState, index: int, part: LegacyPart) -> None:
        text = part_text(part)
        if text is not None:
            self.made_text(
                state.turn, part.content, "the text", field="response_parts", part_index=index
            )
            self._add(state, index, {"role": "assistant", "content": text})

    def _on_hitl(self, state: _TurnState, index: int, part: LegacyPart) -> None:
        params = hitl_params(part)
        request_id = self._reference(state.turn, index, part.request_id, "request id")
        if request_id is None:
            request_id = f"req-{self.names[id(state.turn)].key}-{index}"
        message = {
            "role": "assistant",
            "content": part_text(part),
            "hitl_action": {"action": part.action, "params": params, "request_id": request_id},
        }
        self.made_text(
            state.turn, part.content, "the prompt", field="response_parts", part_index=index
        )
        self._add(state, index, message)

    def _on_error(self, state: _TurnState, index: int, part: LegacyPart) -> None:
        message = {"role": "assistant", "content": None, "error": {"message": error_text(part)}}
        made_of = part.content if is_text(part.content) else part.raw  # `error_text`
        self.made_text(state.turn, made_of, "the error", field="response_parts", part_index=index)
        self._add(state, index, message)

    def _on_file_upload(self, state: _TurnState, index: int, part: LegacyPart) -> None:
        """Placed with the user's message by `_opening`."""

    def _on_unknown(self, state: _TurnState, index: int, part: LegacyPart) -> None:
        self.problem(
            state.turn,
            "unknown_part",
            f"part type {part.declared!r} has no message equivalent",
            field="response_parts",
            part_index=index,
            content=part.raw,
        )

    _HANDLERS: ClassVar[
        Mapping[PartKind, Callable[[_Converter, _TurnState, int, LegacyPart], None]]
    ] = {
        "tool_call": _on_tool_call,
        "tool_result": _on_tool_result,
        "text": _on_text,
        "hitl": _on_hitl,
        "error": _on_error,
        "file_upload": _on_file_upload,
        "unknown": _on_unknown,
    }

    def _add(self, state: _TurnState, index: int, message: dict[str, Any]) -> None:
        message = {**message, "created_at": state.at}
        if self.checked(state.turn, message_adapter, message, kind="invalid_part", index=index):
            state.items.append(message)

    # -- what surrounds the parts ------------------------------------------------------

    def _parts(self, turn: LegacyTurn) -> list[tuple[int, LegacyPart]]:
        raw = turn.response_parts
        if not isinstance(raw, list) and raw is not None:
            self.problem(
                turn,
                "invalid_part",
                "response_parts is not a list",
                field="response_parts",
                content=raw,
            )
        if summary_calls(turn.tool_calls) is None:
            self.problem(
                turn,
                "invalid_part",
                "tool_calls is neither a list of calls nor one call",
                field="tool_calls",
                content=turn.tool_calls,
            )
        return turn_parts(turn)

    def _check_spellings(self, turn: LegacyTurn, index: int, part: LegacyPart) -> None:
        """A part that spelt a field twice with two values: the one not read is kept here; so
        are the fields no reader of its kind takes."""
        if part.unknown_fields:
            self.problem(
                turn,
                "unread_field",
                f"the part also holds {', '.join(part.unknown_fields)}, which no message holds",
                field=f"response_parts.{index}",
                content={name: part.raw[name] for name in part.unknown_fields},
            )
        if part.unread:
            self.problem(
                turn,
                "unread_spelling",
                f"the part also holds {', '.join(part.unread)} with another value than the "
                "one converted",
                field=f"response_parts.{index}",
                content={name: part.raw[name] for name in part.unread},
            )
        if part.alike:
            self.problem(
                turn,
                "equivalent_spelling",
                f"the part also holds {', '.join(part.alike)} saying what the one converted "
                "says, in other characters",
                field=f"response_parts.{index}",
                content={name: part.raw[name] for name in part.alike},
                unplaced=False,
            )

    def _check_turn_fields(self, turn: LegacyTurn) -> None:
        """A turn's fields no reader takes (`feedback`, say): each kept in a problem."""
        for name, value in turn.unknown_fields().items():
            self.problem(
                turn,
                "unread_field",
                f"the turn also holds {name}, which no message holds",
                field=name,
                content=value,
            )

    def _check_summary_calls(
        self, turn: LegacyTurn, parts: list[tuple[int, LegacyPart]], call_ids: set[str]
    ) -> None:
        """`tool_calls` summed up the calls beside the parts: a problem for each one no part
        holds (the same tool with the same arguments), and for what an entry a part holds
        says besides: as on a turn without parts, where it was converted, its fields no
        reader takes and a spelling not read; and an id no call of the turn (`call_ids`)
        holds."""
        if not isinstance(turn.response_parts, list) or not turn.response_parts:
            return
        calls = [p for _, p in parts if p.kind == "tool_call"]
        for call in summary_calls(turn.tool_calls) or ():
            summed = summary_call(call)
            if not _held(summed, calls):
                self.problem(
                    turn,
                    "tool_call_not_in_parts",
                    "tool_calls holds a call no part holds; the parts were converted",
                    field="tool_calls",
                    content=call,
                )
                continue
            unread = list(summed.unknown_fields)
            if summed.tool_call_id is not None and summed.tool_call_id not in call_ids:
                unread += [n for n in ("tool_call_id", "id") if n in summed.raw]
            if unread:
                self.problem(
                    turn,
                    "unread_field",
                    f"a call tool_calls holds beside the part holding it also holds "
                    f"{', '.join(unread)}, which no message holds",
                    field="tool_calls",
                    content={name: summed.raw[name] for name in unread},
                )
            if summed.unread:
                self.problem(
                    turn,
                    "unread_spelling",
                    f"a call tool_calls holds also holds {', '.join(summed.unread)} with "
                    "another value than the one its part holds",
                    field="tool_calls",
                    content={name: summed.raw[name] for name in summed.unread},
                )

    def _check_response_text(self, turn: LegacyTurn, items: list[Item]) -> None:
        """`response_text` summed up the answer: a problem unless it is what the turn said
        (its texts, HITL prompts and errors) or its texts alone (as the dual write sums a turn
        up) one after another (`_told_by`)."""
        text = summary_text(turn)
        if text is None or not text.strip():
            return
        answers = [m for m in _flatten(items) if m["role"] == "assistant"]
        said = [
            found
            for m in answers
            for found in (m.get("content"), (m.get("error") or {}).get("message"))
            if isinstance(found, str) and found
        ]
        texts = [m["content"] for m in answers if m.get("content") and not m.get("hitl_action")]
        if _told_by(text, said) or _told_by(text, texts):
            self.made_text(turn, turn.response_text, "response_text", field="response_text")
        else:
            self.problem(
                turn,
                "response_text_not_in_parts",
                "response_text holds text no part holds; the parts were converted",
                field="response_text",
                content=turn.response_text,
            )

    def _opening(self, turn: LegacyTurn, at: datetime) -> list[Item]:
        """The turn's system or user message(s): its text and every upload (`turn_uploads`)."""
        text = user_text(turn)
        items: list[Item] = []
        if flag(turn.is_system) is None:
            self.problem(
                turn,
                "unreadable_flag",
                f"is_system is {turn.is_system!r}, read as neither yes nor no: the turn is "
                "converted as the user's",
                field="is_system",
                content=turn.is_system,
            )
        if turn.system:
            items.append({"role": "system", "content": text or None, "created_at": at})
        elif text:
            items.append({"role": "user", "content": text, "created_at": at})
            self._check_runtime_context(turn, text)
        if text:
            self.made_text(turn, turn.user_message, "the user's message", field="user_message")
        for upload_index, upload in turn_uploads(turn):
            valid = self.checked(
                turn, _upload_adapter, upload, kind=INVALID_UPLOAD, index=upload_index
            )
            if valid is None:
                continue
            checked = valid.model_dump()
            where = "upload_result" if upload_index is None else "response_parts"
            for name, value in checked.items():  # every text of it: the store strips each
                if isinstance(value, str):
                    self._check_runtime_context(turn, value, where, upload_index, name)
            first = items[0] if items else None
            if isinstance(first, dict) and first["role"] == "user" and "upload" not in first:
                first["upload"] = checked
            else:
                items.append({"role": "user", "content": None, "upload": checked, "created_at": at})
        return items

    def _check_runtime_context(
        self,
        turn: LegacyTurn,
        text: str,
        field: str = "user_message",
        part_index: int | None = None,
        upload_field: str | None = None,
    ) -> None:
        """Hidden runtime context in the user's text (a text of an upload too, its
        `upload_field`, in `field`, at `part_index`): the message keeps only what the user
        saw (DESIGN §3: the store strips every text of a user message, `plan_turn`), so what
        is stripped, as written, is kept in a problem no message holds
        (`HIDDEN_RUNTIME_CONTEXT`)."""
        hidden = split_runtime_context(text, self.rules.markers)[1]
        if hidden:
            what = field if upload_field is None else f"the {upload_field} of {field}"
            if part_index is not None:
                what += f" {part_index}"
            self.problem(
                turn,
                HIDDEN_RUNTIME_CONTEXT,
                f"{what} holds runtime context the user did not see; the message keeps "
                "only the text they saw",
                field=field,
                part_index=part_index,
                content=hidden,
            )

    def _call(
        self, turn: LegacyTurn, index: int, part: LegacyPart, real: str | None
    ) -> dict[str, Any] | None:
        name = part.tool_name
        if not isinstance(name, str) or not name:
            self.problem(
                turn,
                "invalid_part",
                "a tool call without a tool name",
                field="response_parts",
                part_index=index,
                content=part.raw,
            )
            return None
        return {
            "id": self._call_id(turn, index, real),
            "type": "function",
            "function": {"name": name, "arguments": self._arguments(turn, index, part)},
        }

    def _arguments(self, turn: LegacyTurn, index: int, part: LegacyPart) -> str:
        what = f"arguments of {part.tool_name!r}"
        self.made_text(turn, part.args, what, field="response_parts", part_index=index)
        return call_arguments(part)[0]

    def _reference(self, turn: LegacyTurn, index: int, found: str | None, what: str) -> str | None:
        """A tool call id or request id found, if a message can hold it (`reference_text`);
        else None, so a generated one takes its place, and a placed problem keeps it."""
        if found is None or found == "" or reference_text(found) is not None:
            return found or None
        self.problem(
            turn,
            "replaced_id",
            f"{what} {shorten(found, 40)!r} is longer than {MAX_REFERENCE_LENGTH} characters; "
            "a generated one takes its place",
            field="response_parts",
            part_index=index,
            content=found,
            unplaced=False,
        )
        return None

    def _call_id(self, turn: LegacyTurn, index: int, real: str | None) -> str:
        call_id = self._reference(turn, index, real, "tool call id")
        if call_id is not None and call_id in self.used_call_ids:
            self.problem(
                turn,
                "duplicate_tool_call_id",
                f"tool call id {call_id!r} was already used in this conversation; a new one is "
                "generated",
                field="response_parts",
                part_index=index,
                content=call_id,
                unplaced=False,
            )
            call_id = None
        again = 0
        while call_id is None or call_id in self.used_call_ids:  # never a call's id before
            call_id = _generated_call_id(self.names[id(turn)].key, index, again)
            again += 1
        self.used_call_ids.add(call_id)
        return call_id

    def _place_results(self, state: _TurnState) -> None:
        """The turn's results after the calls they answer (`CallPairing`): a result naming no
        call answers the one its history returns it for (`told_calls`), if any; a result the
        history tells nothing of is paired as without it, and checked against what the
        history says its call returned (`_check_history_return`)."""
        pending = state.pending_results
        state.history.returns = self._returns_here(state)
        told = self._told(state)
        legacy_id = self.names[id(state.turn)].legacy_id
        for (index, _, _), by in zip(pending, told, strict=True):
            if by is not None:
                self.history_told[(legacy_id, index)] = self.call_places[by[0]]
        answered = self.pairing.answer(
            [(part.tool_name, real) for _, part, real in pending],
            [by[0] if by else None for by in told],
        )
        used = {by[1] for by in told if by}
        guessed = dict(self.pairing.guessed)
        for n, ((index, part, real), by, call_id) in enumerate(
            zip(pending, told, answered, strict=True)
        ):
            if call_id is None:
                self._unplaced_result(state, index, part, real)
                continue
            if n in guessed:
                self._ambiguous_result(state, (index, part, call_id), guessed[n])
            self._place_result(state, index, part, call_id, checked=n not in guessed)
            if self.pairing.names_a_call(real):
                continue
            if real and real != call_id:
                self._replaced_result_id(state, index, real, call_id)
            if by is None:
                self._check_history_return(state, (index, part, call_id), used)

    def _replaced_result_id(self, state: _TurnState, index: int, real: str, call_id: str) -> None:
        """A result naming an id of its own that names no call, paired with a call by its tool
        or its history: stored under that call's id, its own kept in a placed `replaced_id`
        problem, never dropped silently (the pairing is as without it)."""
        self.problem(
            state.turn,
            "replaced_id",
            f"a result's tool call id {shorten(real, 40)!r} names no call; it answers call "
            f"{call_id!r} (paired by its tool or its history) and is stored under that id",
            field="response_parts",
            part_index=index,
            content=real,
            unplaced=False,
        )

    def _returns_here(self, state: _TurnState) -> list[_Returned]:
        """The history's returns as this turn's results may be told by, each naming the call
        it answers as the turn stores it (`returns_here`): those of the turn's own part of the
        history, and the earlier ones whose id neither that part's calls nor the turn's name
        again, so an id a provider reuses never lets an earlier turn's return count here."""
        history = state.history
        here = _calls_here(state)
        segment = history.segment
        mine: dict[tuple[str, str], int] = defaultdict(int)
        for _, name, arguments in here:
            mine[(name, arguments)] += 1
        segment_alike: dict[tuple[str, str], int] = defaultdict(int)
        for entry in segment:
            if not isinstance(entry, _Returned):
                segment_alike[(entry[0], entry[1])] += 1
        before = len(history.calls) - sum(segment_alike.values())
        prefix: dict[tuple[str, str], int] = defaultdict(int)
        for name, arguments, _ in history.calls[:before]:
            prefix[(name, arguments)] += 1
        earlier = {
            key: max(self.calls_made[key] - mine[key] - prefix[key], 0) for key in segment_alike
        }
        answered = returns_here(
            here, [e.call_id if isinstance(e, _Returned) else e for e in segment], earlier
        )
        own = [e for e in segment if isinstance(e, _Returned)]
        again = {e[2] for e in segment if not isinstance(e, _Returned)} | {c for c, *_ in here}
        kept = [
            r for r in history.returns[: len(history.returns) - len(own)] if r.call_id not in again
        ]
        told = [replace(r, call_id=c) for r, c in zip(own, answered, strict=True) if c is not None]
        return kept + told

    def _told(self, state: _TurnState) -> list[tuple[str, int] | None]:
        """The call the turn's history says each result naming no call answers, and the index
        of its return saying so (`told_calls`): by what that return says (`returned`), never
        by position alone."""
        pending = state.pending_results
        if not state.history.returns or not pending:
            return [None] * len(pending)
        here = _calls_here(state)
        results = [
            (part.tool_name, returned(part), real if self.pairing.names_a_call(real) else None)
            for _, part, real in pending
        ]
        returns = [(r.tool_name, r.call_id, r.says) for r in state.history.returns]
        return told_calls(results, here, returns, self._open_call)

    def _open_call(self, call_id: str, name: str) -> bool:
        """Whether a call of tool `name` is stored under `call_id`, still unanswered."""
        group = self.groups.get(call_id)
        made = group is not None and (call_id, name) in group.calls
        return made and self.pairing.unanswered(call_id)

    def _check_history_return(
        self, state: _TurnState, placed: tuple[int, LegacyPart, str], used: set[int]
    ) -> None:
        """A result (`placed`: its index, part and the call it answers) paired by the order of
        its turn's parts with one of several calls of its tool, whose return the history gives
        saying something else (told no other result: not in `used`): which call it answered
        is a guess the history contradicts, so a problem not placed keeps the result with the
        history's return, and the drop of the legacy turns waits on an operator."""
        index, part, call_id = placed
        name = part.tool_name
        if sum(n == name for group in state.groups for _, n in group.calls) < 2:
            return
        says = returned(part)
        other = next(
            (
                r
                for n, r in enumerate(state.history.returns)
                if r.call_id == call_id and r.says not in (None, says) and n not in used
            ),
            None,
        )
        if other is None:
            return
        self.problem(
            state.turn,
            HISTORY_CONTRADICTS_PAIRING,
            f"the turn makes several calls of {name!r}; this result, naming none, answers call "
            f"{call_id!r} by the order of the parts, but message_history_json says that call "
            "returned something else: which call it answered is not known. The message "
            "answers that call; this problem keeps the result and the history's return",
            field="message_history_json",
            part_index=index,
            content={"result": part.raw, "answers": call_id, "history_return": other.raw},
        )

    def _ambiguous_result(
        self, state: _TurnState, placed: tuple[int, LegacyPart, str], among: list[str]
    ) -> None:
        """A result (`placed`: its index, part and the call it answers) its id alone pairs,
        naming a tool none of the calls of that id is of, with one of several unanswered calls
        or an earlier turn's (`CallPairing.guessed`): which it answers is a guess, so a problem
        not placed keeps the result with the calls, and the drop waits on an operator."""
        index, part, call_id = placed
        calls = [{"id": cid, "tool_name": self._tool_of(cid)} for cid in among]
        named = ", ".join(f"{c['id']!r} of {c['tool_name']!r}" for c in calls)
        self.problem(
            state.turn,
            AMBIGUOUS_TOOL_RESULT,
            f"a result naming tool {part.tool_name!r} under id {part.tool_call_id!r}, which "
            f"names no call of that tool: its id alone pairs it with one of the unanswered "
            f"calls {named} (several, or an earlier turn's), so which it answered is not "
            f"known. The message answers call {call_id!r}; this problem keeps the result and "
            "the calls it could answer",
            field="response_parts",
            part_index=index,
            content={"result": part.raw, "answers": call_id, "calls": calls},
        )

    def _tool_of(self, call_id: str) -> str:
        """The tool of the call stored under `call_id`."""
        return next(n for cid, n in self.groups[call_id].calls if cid == call_id)

    def _place_result(
        self, state: _TurnState, index: int, part: LegacyPart, call_id: str, *, checked: bool
    ) -> None:
        """A result after the call it answers (`CallPairing`), stored under that call's id; a
        tool name it gives that is not its call's kept in a placed problem, unless `checked`
        is False (an `ambiguous_tool_result` keeps the result already)."""
        name = part.tool_name
        group = self.groups[call_id]
        called = self._tool_of(call_id)
        if checked and name is not None and name != called:
            self.problem(
                state.turn,
                "mismatched_tool_name",
                f"a result naming tool {name!r} answers call {call_id!r} of {called!r}, which "
                "its id names; the message answers that call, and this problem keeps the "
                "result whole",
                field="response_parts",
                part_index=index,
                content=part.raw,
                unplaced=False,
            )
        what = f"the result of {name!r}"
        self.made_text(state.turn, part.result, what, field="response_parts", part_index=index)
        group.results[call_id] = {
            "role": "tool",
            "tool_call_id": call_id,
            "content": result_text(part)[0],
            "created_at": state.at,
        }

    def _unplaced_result(
        self, state: _TurnState, index: int, part: LegacyPart, real: str | None
    ) -> None:
        """A result no call is left for: a repeat when its id names calls, all answered."""
        if self.pairing.names_a_call(real):
            kind = "duplicate_tool_result"
            detail = (
                f"a result of {part.tool_name!r} for call {real!r}, already answered; its "
                "answer is the result naming the call's tool, else the first one"
            )
        else:
            kind = "unplaced_tool_result"
            detail = f"a result of {part.tool_name!r} answers no call of this conversation"
        self.problem(
            state.turn,
            kind,
            detail,
            field="response_parts",
            part_index=index,
            content=part.raw,
        )

    # -- token usage and latency -------------------------------------------------------

    def _count(self, turn: LegacyTurn, field: str, value: Any) -> int | None:
        """A count read leniently; an unreadable one is a problem holding it (`field`)."""
        try:
            return as_count(value)
        except ValueError as exc:
            whole = turn.token_usage if field == "token_usage" else value
            self.problem(turn, "unreadable_number", f"{field}: {exc}", field=field, content=whole)
            return None

    def _token_usage(self, turn: LegacyTurn) -> dict[str, int] | None:
        """The turn's token usage in any common spelling (`USAGE_SPELLINGS`); what it holds
        besides is kept in problems: another spelling saying another count
        (`unread_spelling`), other keys and a total that is not the sum (`unread_field`)."""
        usage = turn.token_usage
        if usage is None or usage == "":
            return None
        if not isinstance(usage, dict):
            self.problem(
                turn,
                "unreadable_number",
                "token_usage is not an object of input_tokens and output_tokens",
                field="token_usage",
                content=usage,
            )
            return None
        unread: dict[str, Any] = {}
        counts = {
            name: self._spelled_count(turn, usage, spellings, unread)
            for name, spellings in USAGE_SPELLINGS.items()
        }
        if unread:
            self.problem(
                turn,
                "unread_spelling",
                f"token_usage also holds {', '.join(unread)} with another count than the one "
                "converted",
                field="token_usage",
                content=unread,
            )
        read = {n for spellings in USAGE_SPELLINGS.values() for n in spellings}
        if _count_or_none(usage.get("total_tokens")) == sum(counts.values()):
            read.add("total_tokens")
        others = {k: v for k, v in usage.items() if k not in read and v not in _SAYS_NOTHING}
        if others:
            self.problem(
                turn,
                "unread_field",
                f"token_usage also holds {', '.join(map(str, others))}, which no message holds",
                field="token_usage",
                content=others,
            )
        return counts

    def _spelled_count(
        self,
        turn: LegacyTurn,
        usage: dict[str, Any],
        spellings: tuple[str, ...],
        unread: dict[str, Any],
    ) -> int:
        """The first readable count of `spellings` (0 if none); a spelling holding another count
        goes into `unread`, an unreadable one into an `unreadable_number` problem."""
        found: int | None = None
        for name in spellings:
            count = self._count(turn, "token_usage", usage.get(name))
            if count is None or count == found:
                continue
            if found is None:
                found = count
            else:
                unread[name] = usage[name]
        return found or 0

    def _usage(self, turn: LegacyTurn, items: list[Item]) -> None:
        """Usage and latency on the turn's last assistant message; without one, latency on its
        last message and usage on the conversation's total."""
        usage = self._token_usage(turn)
        latency = self._count(turn, "latency_ms", turn.latency_ms)
        messages = _flatten(items)
        answer = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
        if answer is not None:
            if usage is not None:
                answer["token_usage"] = usage
            if latency is not None:
                answer["latency_ms"] = latency
            return
        if latency is not None and messages:
            messages[-1]["latency_ms"] = latency
        elif latency is not None:
            self.problem(
                turn,
                "usage_without_response",
                "latency on a turn without any message",
                field="latency_ms",
                content=turn.latency_ms,
            )
        if usage is not None and any(usage.values()):
            self.unanswered_usage = Usage.total(
                (self.unanswered_usage.input_tokens, usage["input_tokens"]),
                (self.unanswered_usage.output_tokens, usage["output_tokens"]),
            )
            self.problem(
                turn,
                "usage_without_response",
                "token usage on a turn without an assistant message; counted on the "
                "conversation's usage only",
                field="token_usage",
                content=turn.token_usage,
                unplaced=False,
            )


USAGE_SPELLINGS = {
    "input_tokens": ("input_tokens", "prompt_tokens", "request_tokens"),
    "output_tokens": ("output_tokens", "completion_tokens", "response_tokens"),
}
"""The names each count of a turn's `token_usage` is read under, in order: the store's,
OpenAI's, Pydantic AI's. A `total_tokens` that is their sum says nothing more."""


_SAYS_NOTHING: tuple[Any, ...] = (None, "", {}, [])
"""Values of a `token_usage` key that hold nothing to keep."""


def _calls_here(state: _TurnState) -> list[tuple[str, str, str]]:
    """The turn's calls as stored, (id, tool name, what its arguments say), in order."""
    return [
        (call["id"], call["function"]["name"], said(call["function"]["arguments"]))
        for group in state.groups
        for call in group.message["tool_calls"]
    ]


def _count_or_none(value: Any) -> int | None:
    try:
        return as_count(value)
    except ValueError:
        return None


def _told_by(summary: str, texts: Sequence[str]) -> bool:
    """Whether a summary is one of the texts, or several of them one after another (what
    lies between them that is no text, a tool round, aside), each whole: a piece of a text
    says something else (`No` is not `Now checking…`). Texts are compared as a history's
    pieces are, exactly but for white space at their ends (`print(a b)` is not
    `print(ab)`); writers joined parts with and without separators, so between two texts any
    white space, or none, is no difference. Each text extends the runs that reach it (the
    places in the summary they end at), so the check is one pass over the texts."""
    pieces = [t.strip() for t in texts if t.strip()]
    whole = summary.strip()
    ends: set[int] = set()
    for piece in pieces:
        ends = {
            _past_white_space(whole, at + len(piece))
            for at in ends | {0}
            if whole.startswith(piece, at)
        }
        if len(whole) in ends:
            return True
    return False


def _past_white_space(text: str, at: int) -> int:
    """The first place from `at` on in `text` that is not white space."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _flatten(items: Iterable[Item]) -> list[dict[str, Any]]:
    """Messages in order: each call group followed by its results, in call order."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, _CallGroup):
            messages.append(item.message)
            messages += [item.results[cid] for cid, _ in item.calls if cid in item.results]
        else:
            messages.append(item)
    return messages


# -- a whole conversation ----------------------------------------------------------------


def convert(
    documents: Iterable[Mapping[str, Any] | LegacyTurn],
    *,
    rules: TurnRules | None = None,
    undated_at: datetime | None = None,
) -> LegacyConversion:
    """Convert one conversation's legacy turns into stored messages and its document.

    A conversation id that is not an identifier (or a turn naming none) is stored
    under a derived one (`derived_conversation_id`), recorded in a problem and on
    the conversation document. `undated_at` is the time given to turns when no
    turn of the conversation has a readable time (default: the Unix epoch, "unknown":
    the same turns convert the same on every call). Raises
    InvalidInput only when the turns belong to more than one conversation; every
    other oddity becomes a `Problem`.
    """
    turns = sort_turns([t if isinstance(t, LegacyTurn) else parse_turns([t])[0] for t in documents])
    ids = {t.stored_conversation_id for t in turns}
    if len(ids) != 1:
        raise InvalidInput(
            f"invalid legacy conversation: the turns name {len(ids)} conversation ids {sorted(ids)}"
        )
    conversation_id = validate_identifier(ids.pop(), "conversation_id")
    converter = _Converter(conversation_id, rules or TurnRules(), turn_names(turns))
    original = _original_id(converter, turns)
    messages, plans = _convert_turns(converter, turns, undated_at or EPOCH)
    whole = {f.blob_id: f.text for plan in plans for f in plan.full_texts}
    _check_history(converter, turns, [with_texts(m, whole) for m in messages])
    owner = _owner(converter, turns)
    messages = [
        m.model_copy(update={"seq": seq, "user_id": owner}) for seq, m in enumerate(messages)
    ]
    conversation = None
    if not plans:
        _check_name_of_nothing(converter, turns)
    else:
        name = _runtime_name(converter, turns)
        conversation = _conversation(conversation_id, name, plans, messages, owner)
        conversation = _as_recorded(
            conversation, converter, original, _legacy_user_id(turns, owner)
        )
    return LegacyConversion(
        conversation_id=conversation_id,
        messages=messages,
        conversation=conversation,
        problems=converter.problems,
        turns=len(turns),
        full_texts=[full for plan in plans for full in plan.full_texts],
        owner=owner,
        claimed=claimers(turns),
        users=_turns_by_user(converter, turns),
        history_call_ids=converter.history_ids,
        history_told_calls=converter.history_told,
    )


def _as_recorded(
    conversation: Conversation, converter: _Converter, original: str | None, legacy_user: str | None
) -> Conversation:
    """The conversation's document with what its legacy turns record beside its messages: the
    legacy ids its ids were derived from (`legacy_conversation_id`, `legacy_user_id`), and
    the usage of the turns no message answers (`unanswered_usage`) in its usage."""
    return conversation.model_copy(
        update={
            "legacy_conversation_id": original,
            "legacy_user_id": legacy_user,
            "usage": Usage.total(
                (conversation.usage.input_tokens, converter.unanswered_usage.input_tokens),
                (conversation.usage.output_tokens, converter.unanswered_usage.output_tokens),
            ),
        }
    )


_WHOLE_HISTORY_KINDS = ("unreadable_history", "turn_only_in_history")
"""Problems keeping a turn's whole history."""


def _check_history(
    converter: _Converter, turns: list[LegacyTurn], messages: list[AgentMessage]
) -> None:
    """Whatever the turns' histories hold that no converted message holds, kept in problems,
    each once, on the first turn holding it (`history_findings`): a system prompt or
    instructions (`system_prompt_only_in_history`: a system message is the conversation's
    system turn; the history only copies what the model was given, so it makes none),
    runtime context the user did not see, any other part (`history_only_content`); a
    response text as often as the history says it beyond what the messages of its turn and
    the earlier ones say."""
    problems = converter.problems
    whole = {p.legacy_id for p in problems if p.kind in _WHOLE_HISTORY_KINDS}
    histories = converter.histories
    found = history_findings(
        [histories.added.get(id(turn), []) for turn in turns],
        messages,
        lengths=[histories.lengths.get(id(turn)) for turn in turns],
        turn_ids=[converter.names[id(turn)].turn_id for turn in turns],
        kept_whole={
            n for n, turn in enumerate(turns) if converter.names[id(turn)].legacy_id in whole
        },
        hidden=[p.content for p in problems if p.kind == HIDDEN_RUNTIME_CONTEXT],
        markers=converter.rules.markers,
    )
    for finding in found:
        converter.problem(
            turns[finding.turn],
            finding.kind,
            finding.detail,
            field="message_history_json",
            content=finding.content,
            unplaced=not finding.placed,
        )


def _check_history_of_nothing(converter: _Converter, turn: LegacyTurn) -> None:
    """A turn that converts to no message keeps its `message_history_json` (blank or empty
    aside) in a problem: no message says what was said in that turn."""
    raw = turn.message_history_json
    try:
        history = json.loads(raw) if isinstance(raw, str | bytes) else raw
    except ValueError:
        history = raw.strip() if isinstance(raw, str | bytes) else raw
    if history:
        converter.problem(
            turn,
            "turn_only_in_history",
            "the turn converts to no message; only its message_history_json holds it",
            field="message_history_json",
            content=raw,
        )


NAME_WITHOUT_MESSAGES = "name_without_messages"
"""A conversation whose turns convert to no message but name it: no conversation document
is written, so the name is kept in this problem (not placed)."""


def _check_name_of_nothing(converter: _Converter, turns: Sequence[LegacyTurn]) -> None:
    """A conversation converting to no message gets no document: the name its turns give it
    (the last turn's whose name shows something, else the last turn's naming one, whole) is
    kept in a problem, never dropped with the turns."""
    named = [t for t in turns if t.shown_name() is not None] or [t for t in turns if t.name]
    if named:
        _other_names(converter, [t for t in turns if t.name], named[-1])
        converter.made_text(named[-1], named[-1].name_as_found, "the name", field="name")
        converter.problem(
            named[-1],
            NAME_WITHOUT_MESSAGES,
            "the conversation's turns convert to no message, so no conversation document "
            f"holds its name {named[-1].name!r}; only the legacy turns hold it",
            field="name",
            content=named[-1].name,
        )


def _original_id(converter: _Converter, turns: Sequence[LegacyTurn]) -> str | None:
    """The legacy id when the conversation is stored under a derived one, else None: as the
    turns naming it otherwise than by the derived id name it (`named_by`), whichever turn
    comes first."""
    turn = named_by(turns)
    if turn is None:
        return None
    named = "names no conversation" if turn.conversation_id is None else "is not an identifier"
    converter.problem(
        turn,
        "derived_conversation_id",
        f"the conversation id {turn.conversation_id!r} {named}; migrated as "
        f"{converter.conversation_id!r}",
        field="conversation_id",
        content=turn.conversation_id,
        unplaced=False,
    )
    return turn.conversation_id


def _dated(
    converter: _Converter, turn: LegacyTurn, found: TurnTime, undated_at: datetime
) -> datetime:
    """The turn's time as its messages store it (cut to the millisecond BSON keeps); a
    problem says where it came from when it is not its own."""
    at = to_utc_millis(found.at or undated_at)
    if found.source == "its created_at":
        return at
    source = found.source or (
        f"no turn of the conversation has a readable time, so {undated_at.isoformat()}"
    )
    detail = f"created_at is missing or unreadable; {source} is used"
    if isinstance(turn.created_at, datetime):
        detail = (
            f"created_at {turn.created_at.isoformat()} is no time the store takes (from 1970 "
            f"to now and a day: a placeholder); {source} is used"
        )
    elif epoch_number(turn.created_at) is not None:
        detail = (
            f"created_at {turn.created_at!r} is a number, not epoch seconds or milliseconds from "
            f"1970 to now; {source} is used"
        )
    converter.problem(
        turn,
        "missing_created_at",
        detail,
        field="created_at",
        content=turn.created_at,
        unplaced=False,
    )
    return at


def _convert_turns(
    converter: _Converter, turns: list[LegacyTurn], undated_at: datetime
) -> tuple[list[AgentMessage], list[TurnPlan]]:
    turn_items: list[tuple[LegacyTurn, list[Item]]] = []
    for turn, found in zip(turns, dated_turns(turns), strict=True):
        at = _dated(converter, turn, found, undated_at)
        turn_items.append((turn, converter.turn_items(turn, at)))
    messages: list[AgentMessage] = []
    plans: list[TurnPlan] = []
    for turn, items in turn_items:
        plan = _planned(converter, turn, _flatten(items))
        _check_exact(converter, turn, plan)
        if plan is not None:
            plans.append(plan)
            messages += plan.messages
    return messages, plans


def _planned(
    converter: _Converter, turn: LegacyTurn, wanted: list[dict[str, Any]]
) -> TurnPlan | None:
    """The turn's messages planned as the store writes them; None when it has none, or the
    store refuses them (kept in a problem)."""
    if not wanted:
        _check_history_of_nothing(converter, turn)
        return None
    try:
        return plan_turn(
            converter.conversation_id,
            wanted,
            turn_id=converter.names[id(turn)].turn_id,
            rules=converter.rules,
        )
    except InvalidInput as exc:
        converter.problem(turn, INVALID_TURN, exc.message, field=None, content=wanted)
        return None


def _check_exact(converter: _Converter, turn: LegacyTurn, plan: TurnPlan | None) -> None:
    """A dual-written turn converts to exactly the messages it was written from, as its
    digest records them (`exact_digest`, every text whole), or a `dual_write_not_exact`
    problem says it does not, naming the live turn and the GridFS files keeping its cut
    texts whole: the gate never passes a copy that gives other messages unseen."""
    extra = turn.model_extra or {}
    if extra.get("dual_write") is not True:
        return
    whole = {} if plan is None else {f.blob_id: f.text for f in plan.full_texts}
    converted = [] if plan is None else [with_texts(m, whole) for m in plan.messages]
    recorded = extra.get(EXACT_FIELD)
    if recorded == exact_digest(converted):
        return
    cut = extra.get(WHOLE_TEXTS_FIELD)
    unkept = extra.get(CUT_FIELD)
    detail = (
        "the dual-written copy of live turn "
        f"{extra.get('turn_id')!r} converts to other messages than the live service stored"
        + (
            " (it records no digest of them: written before copies did, so it cannot tell)"
            if recorded is None
            else ""
        )
        + (
            f"; it holds texts cut to fit one legacy document, kept whole in GridFS "
            f"(bucket agent_message_blobs) as {', '.join(map(str, cut))}"
            if isinstance(cut, list) and cut
            else ""
        )
        + _unkept_detail(unkept)
        + "; its messages are stored as it converts"
    )
    content = {"turn_id": extra.get("turn_id"), "whole_texts": cut if cut else None}
    if unkept:
        content["cut"] = unkept
    converter.problem(turn, DUAL_WRITE_NOT_EXACT, detail, field=None, content=content)


def _unkept_detail(unkept: Any) -> str:
    """The texts a dual-written turn lists as cut to fit it that no file keeps whole
    (`CUT_FIELD`), for a person; "" for none."""
    if not isinstance(unkept, list) or not unkept:
        return ""
    shown = ", ".join(
        f"{e.get('path')} of seq {e.get('seq')} ({e.get('length')} characters)"
        if isinstance(e, dict)
        else repr(e)
        for e in unkept
    )
    return (
        f"; it holds texts cut to fit one legacy document that no file keeps whole: {shown} "
        "(whole only in the live messages, `agent_messages`, when kept)"
    )


def _legacy_user_id(turns: list[LegacyTurn], owner: str | None) -> str | None:
    """The legacy user id the owner is derived from (`derived_user_id`), as the turns name
    it, when the owner is a derived user; else None (`Conversation.legacy_user_id`)."""
    users = named_users(turns)
    return users[-1] if owner is not None and users and owner != users[-1] else None


def _owner(converter: _Converter, turns: list[LegacyTurn]) -> str | None:
    """The conversation's owner (`owner_of`), with a problem where the turns disagree on it."""
    user_ids = named_users(turns)
    owner = owner_of(turns)
    if len(set(user_ids)) > 1:
        converter.problem(
            turns[-1],
            MIXED_USER_IDS,
            f"turns name several users {sorted(set(user_ids))}; the conversation they "
            f"convert to is the last one's, {user_ids[-1]!r}, every message of it, the "
            "others' words too",
            field="user_id",
            content=_turns_by_user(converter, turns),
        )
    if owner is not None and owner != user_ids[-1]:  # no identifier: the derived user
        converter.problem(
            turns[-1],
            INVALID_USER_ID,
            f"user id {user_ids[-1]!r} is not an identifier; the conversation is stored owned "
            f"by {owner!r}, derived from it, which no other user's turn adopts: map the legacy "
            "user id to an identifier and run again, or accept it (`claim` moves it later)",
            field="user_id",
            content={"user_id": user_ids[-1], "stored_as": owner},
        )
    return owner


def _turns_by_user(converter: _Converter, turns: Sequence[LegacyTurn]) -> dict[str, list[str]]:
    """The turns naming each user, by the name each turn goes by in the conversation."""
    found: dict[str, list[str]] = {}
    for turn in sort_turns(turns):
        if turn.user_id:
            found.setdefault(turn.user_id, []).append(converter.names[id(turn)].legacy_id)
    return found


EARLIER_NAME = "earlier_name"
"""A name a conversation went by before a later turn renamed it (placed: the conversation
holds its last name). Its content is that name, whole, as the first turn giving it held it:
a conversation stores one name, and the drop would take every other."""


def _runtime_name(converter: _Converter, turns: Sequence[LegacyTurn]) -> str | None:
    """The name of the last turn whose name shows something (`LegacyTurn.shown_name`): one
    longer than a conversation holds (`MAX_NAME_CHARS`) is cut, one holding control or
    text-direction characters is stored without them (`shorten`), and a placed problem keeps
    it whole. A later name that shows nothing (invisible characters, control characters
    alone) names nothing, as a blank one, and the earlier name stays the conversation's.
    Every other name the turns give is kept whole too (`_other_names`)."""
    named = [t for t in turns if t.name]
    showing = [t for t in named if t.shown_name() is not None]
    _other_names(converter, named, showing[-1] if showing else None)
    if not showing:
        return None
    turn = showing[-1]
    converter.made_text(turn, turn.name_as_found, "the name", field="name")
    whole, name = turn.name or "", turn.shown_name()
    if len(found := collapse_whitespace(whole)) > MAX_NAME_CHARS:
        converter.problem(
            turn,
            "shortened_name",
            f"the name has {len(found)} characters, more than a conversation holds "
            f"({MAX_NAME_CHARS}); it is cut to {name!r}",
            field="name",
            content=whole,
            unplaced=False,
        )
    elif name != found or _spaced_otherwise(whole):
        converter.problem(
            turn,
            "plain_name",
            "the name holds control or text-direction characters, or white space other than "
            f"spaces (a tab, a line break); it is stored as {name!r}",
            field="name",
            content=whole,
            unplaced=False,
        )
    return name


def _spaced_otherwise(whole: str) -> bool:
    """Whether a name holds white space other than spaces (a tab, a line break): a stored
    name holds a space for it, so the name as found is kept whole (`plain_name`)."""
    return _OTHER_SPACE.search(whole) is not None


_OTHER_SPACE = re.compile(r"[^\S ]")


def _name_key(whole: str) -> str:
    """What tells one name from another: names differing in spaces alone are one (a stored
    name collapses them, `collapse_whitespace`); one holding other white space is itself."""
    return whole if _spaced_otherwise(whole) else collapse_whitespace(whole)


def _other_names(
    converter: _Converter, named: Sequence[LegacyTurn], kept: LegacyTurn | None
) -> None:
    """Each name the turns give (`named`, in conversation order) other than the one `kept`
    (the conversation's, which its caller keeps), once, on the first turn giving it, kept
    whole in a placed problem: one that shows nothing names nothing (`plain_name`), any other
    is an earlier name (`earlier_name`). Names differing in spaces alone are one, as a stored
    name collapses them (`_name_key`)."""
    seen = {_name_key(kept.name or "")} if kept is not None else set()
    for turn in named:
        whole = turn.name or ""
        if (key := _name_key(whole)) in seen:
            continue
        seen.add(key)
        converter.made_text(turn, turn.name_as_found, "the name", field="name")
        if turn.shown_name() is None:
            detail = (
                "the name holds control or text-direction characters alone, or shows nothing; "
                "it names nothing, and the last name showing something is kept"
            )
            converter.problem(
                turn, "plain_name", detail, field="name", content=whole, unplaced=False
            )
            continue
        converter.problem(
            turn,
            EARLIER_NAME,
            f"the conversation was named {whole!r} before a later turn renamed it; it holds "
            "its last name",
            field="name",
            content=whole,
            unplaced=False,
        )


def _conversation(
    conversation_id: str,
    name: str | None,
    plans: Sequence[TurnPlan],
    messages: Sequence[AgentMessage],
    owner: str | None,
) -> Conversation:
    source = "runtime" if name else None
    named_by = None
    if name is None:  # as turns name it: by the first user text, its message recorded
        named = next(((p.auto_name, p.auto_name_from) for p in plans if p.auto_name), None)
        name, named_by = named or (None, None)
        source = "auto" if name else None
    previews = [p.preview for p in plans if p.preview is not None]
    return Conversation.model_validate(
        {
            "_id": conversation_id,
            "conversation_id": conversation_id,
            "user_id": owner,
            "name": name,
            "name_source": source,
            "name_message_id": named_by,
            "created_at": messages[0].created_at,
            "updated_at": max(m.created_at for m in messages),
            "turn_count": sum(p.turn_starts for p in plans),
            "last_message_preview": previews[-1] if previews else "",
            "message_count": len(messages),
            "pending_hitl": None,
            "pending_calls": pending_after(messages)[0],
            "usage": Usage.total(
                (p.usage.input_tokens for p in plans), (p.usage.output_tokens for p in plans)
            ),
        }
    )
