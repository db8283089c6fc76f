"""Legacy turn documents (DESIGN §4) and their conversion into messages. Pure, no I/O.

A legacy document holds one whole exchange: the user's text, an upload, and
the response as a list of parts. Real documents are messy, so the models here
accept almost anything and the converter decides, part by part, what becomes a
message. Whatever it cannot place becomes a `Problem` carrying the content,
never a silent loss.

Mapping, per turn (turns sorted by `created_at`, ties kept in stored order):
system turn -> `system`; user text and uploads -> `user`; text part ->
`assistant` content; a run of tool_call parts -> one `assistant` with
`tool_calls`; tool_result -> `tool`, placed right after its call's message;
hitl -> `assistant` with `hitl_action` and the prompt as content; error ->
`assistant` with `error`. Token usage and latency go on the turn's last
assistant message.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from bson import ObjectId
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from app.errors import InvalidInput, describe_validation_error
from app.models import (
    AgentMessage,
    Conversation,
    FileUpload,
    PendingHitl,
    Usage,
    message_adapter,
    to_utc_millis,
)
from app.text import collapse_whitespace, shorten
from app.turns import TurnPlan, TurnRules, plan_turn, validate_identifier

LEGACY_TURN_FIELDS = ("user_message", "response_parts", "response_text", "upload_result")
"""A document holding any of these fields is a legacy turn, not a conversation document."""

_IDENTIFIER = re.compile(r"^[A-Za-z0-9_.:@|-]{1,100}$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_upload_adapter: TypeAdapter[FileUpload] = TypeAdapter(FileUpload)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, arbitrary_types_allowed=True)


class LegacyTurn(_Lenient):
    """One legacy turn document, as found: every field may be missing or odd."""

    id: Any = Field(default=None, alias="_id")
    conversation_id: str
    user_id: str | None = None
    name: str | None = None
    created_at: Any = None
    is_system: bool = False
    user_message: Any = None
    upload_result: Any = None
    response_parts: Any = None
    tool_calls: Any = None
    response_text: Any = None
    token_usage: Any = None
    latency_ms: Any = None
    message_history_json: Any = None

    @field_validator("conversation_id", mode="before")
    @classmethod
    def _id_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, ObjectId | int) else value

    @field_validator("user_id", "name", mode="before")
    @classmethod
    def _blank_is_none(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        return str(value)

    @field_validator("is_system", mode="before")
    @classmethod
    def _truthy(cls, value: Any) -> bool:
        return bool(value)

    @property
    def key(self) -> str:
        """The document id as an identifier-safe string (hashed when it is not one)."""
        text = str(self.id)
        if _IDENTIFIER.match(text):
            return text
        return "h" + hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def turn_id(self) -> str:
        return f"legacy-{self.key}"

    def time(self) -> datetime | None:
        """`created_at` as aware UTC, from a datetime or an ISO string; None if unreadable."""
        value = self.created_at
        if isinstance(value, str):
            try:
                value = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                return None
        if isinstance(value, datetime):
            return to_utc_millis(value)
        return None


class Problem(BaseModel):
    """Something in a legacy conversation the converter could not place as it is."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    conversation_id: str
    legacy_id: str
    """`_id` of the turn document, as a string."""
    part_index: int | None = None
    """Index in `response_parts`, when the problem is one part."""
    kind: str
    detail: str
    content: Any = None
    """The content concerned, as found."""
    placed: bool = False
    """True when the content was still converted (e.g. with a generated id); False when
    this problem is the only place the content is kept."""


@dataclass
class LegacyConversion:
    """One conversation converted: its messages by `seq`, its document and its problems."""

    conversation_id: str
    messages: list[AgentMessage]
    conversation: Conversation | None
    """None when no turn produced a message."""
    problems: list[Problem]
    turns: int

    @property
    def unplaced(self) -> list[Problem]:
        """Problems holding content that no message holds."""
        return [p for p in self.problems if not p.placed]


# -- JSON of odd values ------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """A JSON stand-in for a value json cannot encode (dates, ObjectIds, bytes...)."""
    if isinstance(value, datetime):
        return to_utc_millis(value).isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)


def _dumps(value: Any, *, compact: bool = False) -> tuple[str, bool]:
    """JSON text of `value`, and whether some of it had to be turned into strings."""
    separators = (",", ":") if compact else (", ", ": ")
    try:
        return json.dumps(value, ensure_ascii=False, separators=separators, allow_nan=False), True
    except (TypeError, ValueError):
        text = json.dumps(
            _finite(value), ensure_ascii=False, separators=separators, default=_jsonable
        )
        return text, False


def _finite(value: Any) -> Any:
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


# -- real tool-call ids from Pydantic AI's message history -------------------------------


def _history_ids(raw: Any) -> tuple[dict[str, list[str]], dict[str, list[str]], bool]:
    """Tool-call ids by tool name: (calls, returns, readable) from ModelMessages JSON."""
    calls: dict[str, list[str]] = defaultdict(list)
    returns: dict[str, list[str]] = defaultdict(list)
    if raw in (None, ""):
        return calls, returns, True
    try:
        history = json.loads(raw) if isinstance(raw, str | bytes) else raw
    except ValueError:
        return calls, returns, False
    if not isinstance(history, list):
        return calls, returns, False
    for message in history:
        parts = message.get("parts") if isinstance(message, dict) else None
        for part in parts if isinstance(parts, list) else ():
            if not isinstance(part, dict):
                continue
            call_id, name = part.get("tool_call_id"), part.get("tool_name")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str):
                continue
            if part.get("part_kind") == "tool-call":
                calls[name].append(call_id)
            elif part.get("part_kind") == "tool-return":
                returns[name].append(call_id)
    return calls, returns, True


def _aligned(history: list[str], occurrence: int, total: int) -> str | None:
    """The history id of the `occurrence`-th of `total` same-named parts of a turn.

    A history may hold the whole conversation so far or only the turn: the
    turn's parts are its last ones, so the two are aligned at the end.
    """
    offset = len(history) - total if len(history) >= total else 0
    index = offset + occurrence
    return history[index] if 0 <= index < len(history) else None


# -- the conversion ----------------------------------------------------------------------


def _real_id(
    part: dict[str, Any],
    history: dict[str, list[str]],
    seen: dict[str, int],
    totals: dict[str, int],
) -> tuple[Any, str | None]:
    """The part's tool name, and its real call id: its own, or the history's aligned one."""
    name = part.get("tool_name") or part.get("name")
    occurrence = seen[str(name)]
    seen[str(name)] += 1
    real = part.get("tool_call_id") or _aligned(
        history.get(str(name), []), occurrence, totals[str(name)]
    )
    return name, real if isinstance(real, str) else None


def _generated_call_id(legacy_key: str, part_index: int) -> str:
    digest = hashlib.sha256(f"{legacy_key}\0{part_index}".encode()).hexdigest()
    return "call_legacy_" + digest[:24]


def _part_type(part: Any) -> str | None:
    if not isinstance(part, dict):
        return None
    kind = part.get("type", part.get("part_kind"))
    return kind.strip().lower().replace("-", "_") if isinstance(kind, str) else None


_TYPE_ALIASES = {"tool_return": "tool_result", "upload": "file_upload", "text_part": "text"}


@dataclass
class _CallGroup:
    """An assistant message of tool calls, and the results placed after it."""

    message: dict[str, Any]
    calls: list[tuple[str, str]]
    """(id, tool name) in call order."""
    results: dict[str, dict[str, Any]] = field(default_factory=dict)


Item = dict[str, Any] | _CallGroup


class _Converter:
    def __init__(self, conversation_id: str, rules: TurnRules) -> None:
        self.conversation_id = conversation_id
        self.rules = rules
        self.problems: list[Problem] = []
        self.used_call_ids: set[str] = set()
        self.calls_by_id: dict[str, _CallGroup] = {}

    def problem(
        self,
        turn: LegacyTurn,
        kind: str,
        detail: str,
        *,
        part_index: int | None = None,
        content: Any = None,
        unplaced: bool = True,
    ) -> None:
        self.problems.append(
            Problem(
                conversation_id=self.conversation_id,
                legacy_id=str(turn.id),
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
        part_index: int | None,
    ) -> Any:
        """`value` validated by `adapter`; else None, the value kept in a problem."""
        try:
            return adapter.validate_python(value)
        except ValidationError as exc:
            subject = "upload" if kind == "invalid_upload" else "message"
            self.problem(
                turn,
                kind,
                describe_validation_error(exc, subject=subject),
                part_index=part_index,
                content=value,
            )
            return None

    # One turn -> items in order; tool results are attached to their call groups.
    def turn_items(self, turn: LegacyTurn, at: datetime) -> list[Item]:
        items: list[Item] = []
        items += self._opening(turn, at)
        parts = self._parts(turn)
        history_calls, history_returns, readable = _history_ids(turn.message_history_json)
        if not readable:
            self.problem(
                turn,
                "unreadable_history",
                "message_history_json is not Pydantic AI messages JSON; ids are generated",
                content=str(turn.message_history_json)[:200],
                unplaced=False,
            )
        call_totals = _name_totals(parts, "tool_call")
        result_totals = _name_totals(parts, "tool_result")
        seen_calls: dict[str, int] = defaultdict(int)
        seen_results: dict[str, int] = defaultdict(int)
        turn_groups: list[_CallGroup] = []
        current: _CallGroup | None = None
        pending_results: list[tuple[int, dict[str, Any], str | None]] = []

        for index, part in parts:
            kind = _TYPE_ALIASES.get(_part_type(part) or "", _part_type(part))
            if kind != "tool_call":
                current = None
            if kind == "tool_call":
                assert isinstance(part, dict)
                name, real = _real_id(part, history_calls, seen_calls, call_totals)
                call = self._call(turn, index, part, name, real)
                if call is None:
                    continue
                if current is None:
                    current = _CallGroup(
                        message={
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [],
                            "created_at": at,
                        },
                        calls=[],
                    )
                    items.append(current)
                    turn_groups.append(current)
                current.message["tool_calls"].append(call)
                current.calls.append((call["id"], call["function"]["name"]))
                self.calls_by_id[call["id"]] = current
            elif kind == "tool_result":
                assert isinstance(part, dict)
                _, real = _real_id(part, history_returns, seen_results, result_totals)
                pending_results.append((index, part, real))
            elif kind == "text":
                assert isinstance(part, dict)
                text = part.get("content", part.get("text"))
                if text is None or text == "":
                    continue
                if not isinstance(text, str):
                    text = _dumps(text)[0]
                self._add(turn, items, index, {"role": "assistant", "content": text}, at)
            elif kind == "hitl":
                assert isinstance(part, dict)
                self._add(turn, items, index, self._hitl(turn, index, part), at)
            elif kind == "error":
                assert isinstance(part, dict)
                text = part.get("message", part.get("error", part.get("content")))
                if not isinstance(text, str):
                    text = _dumps(part)[0]
                self._add(
                    turn,
                    items,
                    index,
                    {"role": "assistant", "content": None, "error": {"message": text}},
                    at,
                )
            elif kind == "file_upload":
                pass  # placed with the user's message by _opening
            else:
                self.problem(
                    turn,
                    "unknown_part",
                    f"part type {_part_type(part)!r} has no message equivalent",
                    part_index=index,
                    content=part,
                )
        for index, part, real in pending_results:
            self._place_result(turn, index, part, real, turn_groups, at)
        self._usage(turn, items)
        return items

    def _parts(self, turn: LegacyTurn) -> list[tuple[int, Any]]:
        raw = turn.response_parts
        if isinstance(raw, list) and raw:
            parts = list(enumerate(raw))
            self._check_response_text(turn, raw)
            return parts
        if raw not in (None, []):
            self.problem(
                turn,
                "invalid_part",
                "response_parts is not a list",
                content=raw,
            )
        # No parts: rebuild them from the summary fields the old writer also kept.
        rebuilt: list[tuple[int, Any]] = []
        for n, call in enumerate(turn.tool_calls if isinstance(turn.tool_calls, list) else ()):
            if isinstance(call, dict):
                rebuilt.append((-1 - n, {"type": "tool_call", **call}))
        if isinstance(turn.response_text, str) and turn.response_text:
            rebuilt.append((-1 - len(rebuilt), {"type": "text", "content": turn.response_text}))
        return rebuilt

    def _check_response_text(self, turn: LegacyTurn, parts: list[Any]) -> None:
        text = turn.response_text
        if not isinstance(text, str) or not text.strip():
            return
        texts = [
            str(p.get("content") or p.get("prompt") or "")
            for p in parts
            if _part_type(p) in ("text", "hitl")
        ]
        wanted = collapse_whitespace(text)
        if wanted not in (
            collapse_whitespace("".join(texts)),
            collapse_whitespace(" ".join(texts)),
        ):
            self.problem(
                turn,
                "response_text_not_in_parts",
                "response_text differs from the text parts; the parts were converted",
                content=text,
            )

    def _opening(self, turn: LegacyTurn, at: datetime) -> list[Item]:
        """The turn's system or user message(s): its text and every upload."""
        text = turn.user_message
        if text is not None and not isinstance(text, str):
            text = _dumps(text)[0]
        uploads: list[tuple[int | None, Any]] = []
        if turn.upload_result not in (None, {}):
            uploads.append((None, turn.upload_result))
        raw_parts = turn.response_parts if isinstance(turn.response_parts, list) else []
        for index, part in enumerate(raw_parts):
            if _TYPE_ALIASES.get(_part_type(part) or "", _part_type(part)) == "file_upload":
                body = {k: v for k, v in part.items() if k not in ("type", "part_kind")}
                if any(body == u for _, u in uploads):
                    continue  # the same file recorded twice: once as upload_result
                uploads.append((index, body))
        items: list[Item] = []
        if turn.is_system:
            items.append({"role": "system", "content": text or None, "created_at": at})
        elif text:
            items.append({"role": "user", "content": text, "created_at": at})
        for upload_index, upload in uploads:
            valid = self.checked(
                turn, _upload_adapter, upload, kind="invalid_upload", part_index=upload_index
            )
            if valid is None:
                continue
            checked = valid.model_dump()
            first = items[0] if items else None
            if isinstance(first, dict) and first["role"] == "user" and "upload" not in first:
                first["upload"] = checked
            else:
                items.append({"role": "user", "content": None, "upload": checked, "created_at": at})
        return items

    def _call(
        self, turn: LegacyTurn, index: int, part: dict[str, Any], name: Any, real: Any
    ) -> dict[str, Any] | None:
        if not isinstance(name, str) or not name:
            self.problem(turn, "invalid_part", "a tool call without a tool name", part_index=index,
                         content=part)  # fmt: skip
            return None
        args = part.get("args", part.get("arguments"))
        if args is None:
            arguments = "{}"
        elif isinstance(args, str):
            arguments = args
        else:
            arguments, plain = _dumps(args, compact=True)
            if not plain:
                self.problem(
                    turn,
                    "non_json_value",
                    f"arguments of {name!r} held values JSON cannot encode; stored as strings",
                    part_index=index,
                    content=args,
                    unplaced=False,
                )
        call_id = real if isinstance(real, str) and 0 < len(real) <= 200 else None
        if call_id is not None and call_id in self.used_call_ids:
            self.problem(
                turn,
                "duplicate_tool_call_id",
                f"tool call id {call_id!r} was already used in this conversation; a new one is "
                "generated",
                part_index=index,
                unplaced=False,
            )
            call_id = None
        if call_id is None:
            call_id = _generated_call_id(turn.key, index)
        self.used_call_ids.add(call_id)
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    def _place_result(
        self,
        turn: LegacyTurn,
        index: int,
        part: dict[str, Any],
        real: str | None,
        turn_groups: list[_CallGroup],
        at: datetime,
    ) -> None:
        name = part.get("tool_name") or part.get("name")
        group: _CallGroup | None = None
        call_id: str | None = None
        if real is not None:
            # A real id answers its call in this turn, or an earlier turn's unanswered call.
            for candidate in turn_groups:
                if any(cid == real for cid, _ in candidate.calls) and real not in candidate.results:
                    group, call_id = candidate, real
                    break
            earlier = self.calls_by_id.get(real)
            if group is None and earlier is not None and real not in earlier.results:
                group, call_id = earlier, real
        if group is None:
            # Otherwise: the first unanswered call of the same tool in this turn.
            for candidate in turn_groups:
                for cid, call_name in candidate.calls:
                    if call_name == name and cid not in candidate.results:
                        group, call_id = candidate, cid
                        break
                if group is not None:
                    break
        if group is None or call_id is None:
            self.problem(
                turn,
                "unplaced_tool_result",
                f"a result of {name!r} answers no call of this conversation",
                part_index=index,
                content=part,
            )
            return
        result = part["result"] if "result" in part else part.get("content")
        if isinstance(result, str):
            content = result
        else:
            content, plain = _dumps(result)
            if not plain:
                self.problem(
                    turn,
                    "non_json_value",
                    f"the result of {name!r} held values JSON cannot encode; stored as strings",
                    part_index=index,
                    content=result,
                    unplaced=False,
                )
        message = {
            "role": "tool",
            "tool_call_id": call_id,
            "content": content,
            "created_at": at,
        }
        group.results[call_id] = message

    def _hitl(self, turn: LegacyTurn, index: int, part: dict[str, Any]) -> dict[str, Any]:
        params = part.get("params")
        if params is None:
            params = {}
        elif not isinstance(params, dict):
            params = {"value": params}
        request_id = part.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            request_id = f"req-{turn.key}-{index}"
        prompt = part.get("prompt", part.get("content"))
        return {
            "role": "assistant",
            "content": prompt if isinstance(prompt, str) and prompt else None,
            "hitl_action": {
                "action": part.get("action"),
                "params": params,
                "request_id": request_id,
            },
        }

    def _add(
        self,
        turn: LegacyTurn,
        items: list[Item],
        index: int,
        message: dict[str, Any],
        at: datetime,
    ) -> None:
        message = {**message, "created_at": at}
        if self.checked(turn, message_adapter, message, kind="invalid_part", part_index=index):
            items.append(message)

    def _usage(self, turn: LegacyTurn, items: list[Item]) -> None:
        usage = turn.token_usage if isinstance(turn.token_usage, dict) else None
        latency = turn.latency_ms
        if usage is None and latency is None:
            return
        last = next(
            (
                it.message if isinstance(it, _CallGroup) else it
                for it in reversed(items)
                if isinstance(it, _CallGroup) or it["role"] == "assistant"
            ),
            None,
        )
        if last is None:
            self.problem(
                turn,
                "usage_without_response",
                "token usage or latency on a turn without an assistant message",
                content={"token_usage": turn.token_usage, "latency_ms": latency},
            )
            return
        if usage is not None:
            last["token_usage"] = {
                "input_tokens": _count(usage.get("input_tokens", usage.get("request_tokens"))),
                "output_tokens": _count(usage.get("output_tokens", usage.get("response_tokens"))),
            }
        if isinstance(latency, int | float) and latency >= 0:
            last["latency_ms"] = int(latency)


def _count(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and value >= 0 else 0


def _name_totals(parts: Sequence[tuple[int, Any]], kind: str) -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for _, part in parts:
        if _TYPE_ALIASES.get(_part_type(part) or "", _part_type(part)) == kind:
            totals[str(part.get("tool_name") or part.get("name"))] += 1
    return totals


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


def sort_turns(turns: Iterable[LegacyTurn]) -> list[LegacyTurn]:
    """By `created_at`; ties and unreadable times keep the stored order."""
    ordered = list(turns)
    times: list[datetime] = []
    previous = _EPOCH
    for turn in ordered:
        at = turn.time()
        if at is None and isinstance(turn.id, ObjectId):
            at = to_utc_millis(turn.id.generation_time)
        previous = at or previous
        times.append(previous)
    keyed = sorted(range(len(ordered)), key=lambda i: times[i])
    return [ordered[i] for i in keyed]


def parse_turns(documents: Iterable[Mapping[str, Any]]) -> list[LegacyTurn]:
    """Legacy documents as models. Raises InvalidInput when one lacks `conversation_id`."""
    turns = []
    for document in documents:
        try:
            turns.append(LegacyTurn.model_validate(dict(document)))
        except ValidationError as exc:
            raise InvalidInput(
                describe_validation_error(exc, subject=f"legacy turn {document.get('_id')!r}")
            ) from exc
    return turns


def convert(
    documents: Iterable[Mapping[str, Any] | LegacyTurn], *, rules: TurnRules | None = None
) -> LegacyConversion:
    """Convert one conversation's legacy turns into stored messages and its document.

    Raises InvalidInput only when the turns name no (or more than one, or an
    invalid) conversation id; every other oddity becomes a `Problem`.
    """
    rules = rules or TurnRules()
    raw = list(documents)
    turns = sort_turns([t if isinstance(t, LegacyTurn) else parse_turns([t])[0] for t in raw])
    ids = {t.conversation_id for t in turns}
    if len(ids) != 1:
        raise InvalidInput(
            f"invalid legacy conversation: the turns name {len(ids)} conversation ids {sorted(ids)}"
        )
    conversation_id = validate_identifier(ids.pop(), "conversation_id")
    converter = _Converter(conversation_id, rules)

    turn_items: list[tuple[LegacyTurn, datetime, list[Item]]] = []
    previous = _EPOCH
    for turn in turns:
        at = turn.time() or (
            to_utc_millis(turn.id.generation_time) if isinstance(turn.id, ObjectId) else previous
        )
        if turn.time() is None:
            converter.problem(
                turn,
                "missing_created_at",
                "created_at is missing or unreadable; the previous turn's time is used",
                content=turn.created_at,
                unplaced=False,
            )
        previous = at
        turn_items.append((turn, at, converter.turn_items(turn, at)))

    messages: list[AgentMessage] = []
    plans: list[TurnPlan] = []
    for turn, _, items in turn_items:
        wanted = _flatten(items)
        if not wanted:
            continue
        try:
            plan = plan_turn(conversation_id, wanted, turn_id=turn.turn_id, rules=rules)
        except InvalidInput as exc:
            converter.problem(turn, "invalid_turn", exc.message, content=wanted)
            continue
        plans.append(plan)
        messages += plan.messages

    user_ids = [t.user_id for t in turns if t.user_id]
    owner = user_ids[-1] if user_ids else None
    if len(set(user_ids)) > 1:
        converter.problem(
            turns[-1],
            "mixed_user_ids",
            f"turns name several users {sorted(set(user_ids))}; the last one, {owner!r}, owns it",
            unplaced=False,
        )
    if owner is not None and not _IDENTIFIER.match(owner):
        converter.problem(
            turns[-1], "invalid_user_id", f"user id {owner!r} is not an identifier; left unowned",
            unplaced=False,
        )  # fmt: skip
        owner = None
    messages = [
        m.model_copy(update={"seq": seq, "user_id": owner}) for seq, m in enumerate(messages)
    ]
    conversation = _conversation(conversation_id, turns, plans, messages, owner) if plans else None
    return LegacyConversion(
        conversation_id=conversation_id,
        messages=messages,
        conversation=conversation,
        problems=converter.problems,
        turns=len(turns),
    )


def convert_conversation(
    turns: Iterable[Mapping[str, Any] | LegacyTurn], *, rules: TurnRules | None = None
) -> tuple[list[AgentMessage], list[Problem]]:
    """The messages of one legacy conversation, by `seq`, and what could not be placed."""
    conversion = convert(turns, rules=rules)
    return conversion.messages, conversion.problems


def _conversation(
    conversation_id: str,
    turns: Sequence[LegacyTurn],
    plans: Sequence[TurnPlan],
    messages: Sequence[AgentMessage],
    owner: str | None,
) -> Conversation:
    names = [t.name for t in turns if t.name]
    name, source = (shorten(names[-1], 200), "runtime") if names else (None, None)
    if name is None:
        name = next((p.auto_name for p in plans if p.auto_name), None)
        source = "auto" if name else None
    previews = [p.preview for p in plans if p.preview is not None]
    return Conversation.model_validate(
        {
            "_id": conversation_id,
            "conversation_id": conversation_id,
            "user_id": owner,
            "name": name,
            "name_source": source,
            "created_at": messages[0].created_at,
            "updated_at": max(m.created_at for m in messages),
            "turn_count": sum(p.turn_starts for p in plans),
            "last_message_preview": previews[-1] if previews else "",
            "message_count": len(messages),
            "pending_hitl": None,
            "usage": Usage(
                input_tokens=sum(p.usage.input_tokens for p in plans),
                output_tokens=sum(p.usage.output_tokens for p in plans),
            ),
            "recent_turns": [],
        }
    )


_RESOLVED = {"resolved", "answered", "done", "completed", "cancelled", "canceled", "expired"}


def pending_from_session_hitl(
    documents: Iterable[Mapping[str, Any]], messages: Sequence[AgentMessage]
) -> tuple[PendingHitl | None, list[str]]:
    """The newest unresolved `session_hitl` prompt as `pending_hitl`, and notes on oddities."""
    notes: list[str] = []
    pending = [
        d
        for d in documents
        if not d.get("resolved")
        and str(d.get("status", "pending")).lower() not in _RESOLVED
        and isinstance(d.get("request_id"), str)
    ]
    if not pending:
        return None, notes

    def when(document: Mapping[str, Any]) -> datetime:
        value = document.get("created_at")
        return to_utc_millis(value) if isinstance(value, datetime) else _EPOCH

    newest = max(pending, key=when)
    raised = next(
        (
            m
            for m in reversed(messages)
            if m.hitl_action is not None and m.hitl_action.request_id == newest["request_id"]
        ),
        None,
    )
    if raised is None:
        notes.append(f"pending prompt {newest['request_id']!r} matches no assistant message")
    params = newest.get("params")
    return (
        PendingHitl(
            request_id=newest["request_id"],
            action=str(newest.get("action") or (raised and raised.hitl_action and
                                                raised.hitl_action.action) or "unknown"),
            params=params
            if isinstance(params, dict)
            else (raised.hitl_action.params if raised and raised.hitl_action else {}),
            prompt=newest.get("prompt") or (raised.content if raised else None),
            message_id=raised.id if raised is not None and raised.id else "",
            created_at=when(newest) if when(newest) != _EPOCH else (
                raised.created_at if raised else _EPOCH
            ),
        ),
        notes,
    )  # fmt: skip


# -- dual write: a logged turn as the legacy writer would have stored it -----------------


def legacy_turn_id(conversation_id: str, turn_id: str) -> str:
    """The `_id` of a dual-written legacy turn: a rewrite of the same turn replaces it."""
    digest = hashlib.sha256(f"{conversation_id}\0{turn_id}".encode()).hexdigest()
    return "dual-" + digest[:32]


def _loaded(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _as_found(text: str | None, *, compact: bool) -> Any:
    """JSON text as a value when the converter turns that value back into the very same
    text, else the text itself: a round trip through the legacy format changes nothing."""
    loaded = _loaded(text)
    if text is None or isinstance(loaded, str) or _dumps(loaded, compact=compact)[0] != text:
        return text
    return loaded


def legacy_turn_document(
    conversation_id: str,
    turn_id: str,
    messages: Sequence[AgentMessage],
    *,
    user_id: str | None,
    name: str | None,
) -> dict[str, Any]:
    """One logged turn as a legacy turn document (DESIGN §4), for rollback to the old reader.

    Marked `dual_write: true`: the migration skips these, their messages are already stored.
    """
    user_texts: list[str] = []
    uploads: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    is_system = False
    for message in messages:
        if message.role in ("user", "system"):
            is_system = is_system or message.role == "system"
            if message.content:
                user_texts.append(message.content)
            if message.upload is not None:
                uploads.append(message.upload.model_dump())
        elif message.role == "tool":
            parts.append(
                {
                    "type": "tool_result",
                    "tool_name": names.get(message.tool_call_id or "", ""),
                    "result": _as_found(message.content, compact=False),
                    "tool_call_id": message.tool_call_id,
                }
            )
        else:
            for call in message.tool_calls or ():
                names[call.id] = call.function.name
                parts.append(
                    {
                        "type": "tool_call",
                        "tool_name": call.function.name,
                        "args": _as_found(call.function.arguments, compact=True),
                        "tool_call_id": call.id,
                    }
                )
            if message.hitl_action is not None:
                parts.append(
                    {"type": "hitl", **message.hitl_action.model_dump(), "prompt": message.content}
                )
            elif message.error is not None:
                parts.append({"type": "error", "message": message.error.message})
            elif message.content:
                parts.append({"type": "text", "content": message.content})
    usage = [m.token_usage for m in messages if m.token_usage is not None]
    latency = [m.latency_ms for m in messages if m.latency_ms is not None]
    parts += [{"type": "file_upload", **u} for u in uploads[1:]]
    document: dict[str, Any] = {
        "_id": legacy_turn_id(conversation_id, turn_id),
        "conversation_id": conversation_id,
        "user_id": user_id,
        "name": name,
        "created_at": messages[0].created_at,
        "is_system": is_system,
        "user_message": "\n\n".join(user_texts),
        "response_parts": parts,
        "tool_calls": [
            {"tool_name": p["tool_name"], "args": p["args"]}
            for p in parts
            if p["type"] == "tool_call"
        ],
        "response_text": "".join(p["content"] for p in parts if p["type"] == "text"),
        "dual_write": True,
        "turn_id": turn_id,
    }
    if uploads:
        document["upload_result"] = uploads[0]
    if usage:
        document["token_usage"] = {
            "input_tokens": sum(u.input_tokens for u in usage),
            "output_tokens": sum(u.output_tokens for u in usage),
        }
    if latency:
        document["latency_ms"] = sum(latency)
    return document
