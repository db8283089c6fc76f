"""The one reader of a legacy response part: every spelling of a kind and of its fields.

Old writers spelt the same part many ways: `type` or Pydantic AI's
`part_kind`, `Text` or `text_part`, `tool-return` for a result, `name` for
`tool_name`, `arguments` for `args`, `text` for `content`. The converter, the
migration's verify, the viewer and the benchmarks all read parts through
`normalize_part`, so they can never disagree on what a part is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any, Literal

from pydantic import ValidationError

from agent_store.core import HitlAction
from agent_store.legacy._documents import (
    LegacyTurn,
    as_text,
    dumps,
    encodes,
    id_text,
    is_text,
    scopes_as_text,
)

PartKind = Literal["text", "tool_call", "tool_result", "file_upload", "hitl", "error", "unknown"]
"""What a legacy part is, once its spelling is normalized."""

_KINDS: dict[str, PartKind] = {
    "text": "text",
    "text_part": "text",
    "tool_call": "tool_call",
    "tool_result": "tool_result",
    "tool_return": "tool_result",
    "file_upload": "file_upload",
    "upload": "file_upload",
    "hitl": "hitl",
    "error": "error",
}
_MISSING = object()


@dataclass(frozen=True)
class LegacyPart:
    """One response part in canonical names. Values are as found: they may have any type."""

    kind: PartKind
    declared: str | None
    """The type as the document spelt it (`type` or `part_kind`), or None."""
    raw: Any
    """The part as found."""
    content: Any = None
    """A text part's text, a HITL prompt, or an error's message."""
    tool_name: Any = None
    args: Any = None
    """A tool call's arguments (a dict, a JSON string, or missing: None)."""
    result: Any = None
    """A tool result's value."""
    tool_call_id: str | None = None
    """A tool call's or result's id, by its text (`id_text`: a number stored as one too)."""
    upload: dict[str, Any] | None = None
    """A file upload's fields (`filename`, `file_type`, `size`, `parsed_text`)."""
    action: Any = None
    params: Any = None
    request_id: str | None = None
    """A HITL prompt's request id, by its text (`id_text`)."""
    unread: tuple[str, ...] = ()
    """Names of fields the part also spelt with another value than the one read (`text`
    beside `content`, say): content no reader takes, which the converter reports."""
    unknown_fields: tuple[str, ...] = ()
    """Names of fields no reader of its kind takes (`options` on a HITL part, say), which
    the converter reports."""
    alike: tuple[str, ...] = ()
    """Names of fields the part also spelt with text saying what the one read says (`said`)
    in other characters (`{"a":2.0}` beside `{"a": 2}`): no message holds that text, so the
    converter keeps it in a placed problem. Only exactly equal texts are one."""


def part_kind(part: Any) -> PartKind:
    """The kind of a part: its declared type or `part_kind`, any case, `-` or `_`."""
    declared = _declared(part)
    if declared is None:
        return "unknown"
    return _KINDS.get(declared.strip().lower().replace("-", "_"), "unknown")


def _kinds_disagree(part: Mapping[str, Any]) -> bool:
    """Whether a part declares its kind twice, by `type` and by `part_kind`, as two kinds."""
    kinds = [part.get("type"), part.get("part_kind")]
    read = [k.strip().lower().replace("-", "_") for k in kinds if isinstance(k, str)]
    return len(read) == 2 and _KINDS.get(read[0], read[0]) != _KINDS.get(read[1], read[1])


def _declared(part: Any) -> str | None:
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type", part.get("part_kind"))
    return kind if isinstance(kind, str) else None


def _first(part: Mapping[str, Any], *names: str) -> Any:
    """The value of the first of `names` the part holds something under; when every one it
    has is blank (null, empty), the first of those; else None. A writer that kept `content`
    empty beside `text` meant the text."""
    present = [part[name] for name in names if name in part]
    for value in present:
        if not _blank(value):
            return value
    return present[0] if present else None


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str | dict | list) and not value)


_SPELLINGS: dict[PartKind, tuple[tuple[str, ...], ...]] = {
    "text": (("content", "text"),),
    "tool_call": (("tool_name", "name"), ("args", "arguments")),
    "tool_result": (("tool_name", "name"), ("result", "content")),
    "hitl": (("prompt", "content"),),
    "error": (("message", "error", "content"),),
}
"""The names a kind's fields were spelt by, the one read first."""
_OTHER_FIELDS: dict[PartKind, tuple[str, ...]] = {
    "text": (),
    "tool_call": ("tool_call_id",),
    "tool_result": ("tool_call_id",),
    "hitl": ("action", "params", "request_id"),
    "error": (),
}
_BOOKKEEPING = ("timestamp", "id", "provider_details", "provider_name")
"""Fields Pydantic AI writes on its text, call and return parts that say nothing the
transcript shows (when and by which provider it was made; the message has its own time).
On other kinds they are read as any unknown field is: kept in a problem."""
_WRITTEN_BY_PYDANTIC_AI = ("text", "tool_call", "tool_result")
_READ: dict[PartKind, frozenset[str]] = {
    kind: frozenset(
        {
            "type",
            "part_kind",
            *(_BOOKKEEPING if kind in _WRITTEN_BY_PYDANTIC_AI else ()),
            *others,
            *(n for s in _SPELLINGS[kind] for n in s),
        }
    )
    for kind, others in _OTHER_FIELDS.items()
}
"""Every field the converter reads of a kind, in each of its spellings. An upload's fields
are checked by the upload model; an unknown part is kept whole."""


def said(value: Any) -> str:
    """What a value says, to tell two spellings of it apart: a string is its text, unless it
    holds a JSON object or array, read strictly (a key twice, or `Infinity`, keeps it text);
    numbers by their exact decimal value (`1.0` is `1`, `0.10000000000000001` is not
    `0.1`), `true` never `1`."""
    text = value if isinstance(value, str) else _json_text(value)
    if text is None:
        return repr(value)
    if text.lstrip()[:1] not in ("{", "["):
        return text if isinstance(value, str) else _exact(text)
    return _exact(text)


def _json_text(value: Any) -> str | None:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return None


def _exact(text: str) -> str:
    """JSON text in one form: keys sorted, every number as its exact decimal value."""
    try:
        parsed = json.loads(
            text,
            parse_float=Decimal,
            parse_int=Decimal,
            parse_constant=_refused,
            object_pairs_hook=_distinct_keys,
        )
        return json.dumps(parsed, sort_keys=True, ensure_ascii=False, default=_number)
    except (ValueError, RecursionError):
        return text


def _refused(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _distinct_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("a key is given twice")
    return found


def _number(value: Any) -> Any:
    if isinstance(value, Decimal):
        return {"#number": format(value.normalize(), "f")}
    raise TypeError(type(value).__name__)


def _unread(kind: PartKind, part: Mapping[str, Any]) -> tuple[str, ...]:
    """The spellings saying something else than the one `_first` reads (looked at only in a
    part spelling a field twice)."""
    return _other_spellings(kind, part)[0]


def _alike(kind: PartKind, part: Mapping[str, Any]) -> tuple[str, ...]:
    """The spellings saying what the one `_first` reads says, as text written otherwise."""
    return _other_spellings(kind, part)[1]


def _other_spellings(
    kind: PartKind, part: Mapping[str, Any]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The spellings beside the one `_first` reads: those saying something else (`said`),
    and texts saying the same beside a text read, in other characters."""
    unread: list[str] = []
    alike: list[str] = []
    for names in _SPELLINGS.get(kind, ()):
        spelt = [n for n in names if n in part and not _blank(part[n])]
        if len(spelt) < 2:
            continue
        value = _first(part, *names)
        read = said(value)
        for name in spelt:
            if said(part[name]) != read:
                unread.append(name)
            elif isinstance(value, str) and isinstance(part[name], str) and part[name] != value:
                alike.append(name)
    return tuple(unread), tuple(alike)


def normalize_part(part: Any) -> LegacyPart:
    """A legacy part in canonical names; a part that is not a mapping is `unknown`."""
    if not isinstance(part, Mapping):
        return LegacyPart("unknown", None, part)
    found = _read_part(part)
    if _kinds_disagree(part):  # read by `type`: the other kind is kept in a problem
        found = replace(found, unread=(*found.unread, "part_kind"))
    if found.kind not in _READ:
        return found
    unknown = tuple(str(name) for name in part if name not in _READ[found.kind])
    return replace(found, unknown_fields=unknown, alike=_alike(found.kind, part))


def _read_part(part: Mapping[str, Any]) -> LegacyPart:
    kind = part_kind(part)
    declared = _declared(part)
    tool_name = _first(part, "tool_name", "name") or None
    unread = _unread(kind, part)
    if kind == "text":
        return LegacyPart(
            kind, declared, part, content=_first(part, "content", "text"), unread=unread
        )
    if kind == "tool_call":
        return LegacyPart(
            kind,
            declared,
            part,
            tool_name=tool_name,
            args=_first(part, "args", "arguments"),
            tool_call_id=id_text(_first(part, "tool_call_id", "id")),
            unread=unread,
        )
    if kind == "tool_result":
        return LegacyPart(
            kind,
            declared,
            part,
            tool_name=tool_name,
            result=_first(part, "result", "content"),
            tool_call_id=id_text(_first(part, "tool_call_id", "id")),
            unread=unread,
        )
    if kind == "file_upload":
        body = {k: v for k, v in part.items() if k not in ("type", "part_kind")}
        return LegacyPart(kind, declared, part, upload=body)
    if kind == "hitl":
        return replace(read_prompt(part), declared=declared)
    if kind == "error":
        content = _first(part, "message", "error", "content")
        return LegacyPart(kind, declared, part, content=content, unread=unread)
    return LegacyPart("unknown", declared, part)


def read_prompt(document: Mapping[str, Any]) -> LegacyPart:
    """A HITL prompt as a HITL part or a `session_hitl` document holds it: the prompt
    (`prompt`, else `content`), action, params and request id, and the spelling not read."""
    return LegacyPart(
        "hitl",
        None,
        document,
        content=_first(document, "prompt", "content"),
        action=document.get("action"),
        params=document.get("params"),
        request_id=id_text(document.get("request_id")),
        unread=_unread("hitl", document),
        alike=_alike("hitl", document),
    )


# -- what a part says, for every reader ------------------------------------------------


def turn_parts(turn: LegacyTurn) -> list[tuple[int, LegacyPart]]:
    """A turn's parts with their index in `response_parts`.

    A turn without a list of parts has them rebuilt from the summary fields the
    old writer also kept (`tool_calls`, then `response_text`), at negative indexes.
    """
    raw = turn.response_parts
    if isinstance(raw, list) and raw:
        return [(index, normalize_part(part)) for index, part in enumerate(raw)]
    calls = [summary_call(call) for call in summary_calls(turn.tool_calls) or ()]
    rebuilt = [(-1 - n, part) for n, part in enumerate(calls)]
    if (answer := summary_text(turn)) is not None:
        text_part = normalize_part({"type": "text", "content": answer})
        rebuilt.append((-1 - len(rebuilt), text_part))
    return rebuilt


def summary_text(turn: LegacyTurn) -> str | None:
    """The answer `response_text` sums up, read as a text part's text is (`as_text`): a
    string as it is, anything else as its JSON text (`987654321` as `"987654321"`); None
    when it is blank (null, `""`, `[]`, `{}`)."""
    return None if _blank(turn.response_text) else as_text(turn.response_text)


def summary_calls(value: Any) -> list[Any] | None:
    """The calls a `tool_calls` summary holds, as found: a list's entries but the blank ones
    (null, empty), one object alone as a list of it, nothing for a blank summary; None for
    anything else (a string, a number): no call can be read from it."""
    if _blank(value):
        return []
    if isinstance(value, list):
        return [call for call in value if not _blank(call)]
    return [value] if isinstance(value, Mapping) else None


def summary_call(call: Any) -> LegacyPart:
    """A `tool_calls` summary entry as a tool call part: an object in any spelling a call
    part has, or in the OpenAI shape (`{id, type: "function", function: {name,
    arguments}}`); a string is the name of the tool called (its arguments not kept, as an
    object naming no `args`); anything else is an `unknown` part."""
    if isinstance(call, str):
        return normalize_part({"type": "tool_call", "tool_name": call})
    if not isinstance(call, Mapping):
        return normalize_part(call)
    function = call.get("function")
    flat = {k: v for k, v in call.items() if not (k == "type" and v == "function")}
    if isinstance(function, Mapping):
        flat = {**{k: v for k, v in flat.items() if k != "function"}, **function}
    return normalize_part({"type": "tool_call", **flat})


def turn_uploads(turn: LegacyTurn) -> list[tuple[int | None, Any]]:
    """A turn's uploads as found, each with its index in `response_parts` (None for
    `upload_result`). Every `file_upload` part is an upload of its own, identical ones too,
    but the first part repeating `upload_result`: the old writer recorded that upload twice."""
    uploads: list[tuple[int | None, Any]] = []
    if turn.upload_result not in (None, {}):
        uploads.append((None, turn.upload_result))
    repeated = not uploads
    raw = turn.response_parts if isinstance(turn.response_parts, list) else []
    for index, part in enumerate(map(normalize_part, raw)):
        if part.kind != "file_upload":
            continue
        if not repeated and part.upload == turn.upload_result:
            repeated = True
            continue
        uploads.append((index, part.upload))
    return uploads


def user_text(turn: LegacyTurn) -> str | None:
    """The turn's user (or system) text as a message holds it; None when it has none."""
    return None if turn.user_message is None else as_text(turn.user_message)


def part_text(part: LegacyPart) -> str | None:
    """A text part's text, or a HITL part's prompt, as a message holds it: a string as it is,
    anything else as its JSON text (`as_text`); None for an empty one."""
    if part.content is None or part.content == "":
        return None
    return as_text(part.content)


def hitl_params(part: LegacyPart) -> dict[str, Any]:
    """A HITL prompt's params as a message holds them: an object as it is, none as `{}`,
    JSON text of an object as that object when it reads exactly (`json_object`), anything
    else (other text, a list, a number) under `value`."""
    if part.params is None:
        return {}
    if isinstance(part.params, dict):
        kept: dict[str, Any] = scopes_as_text(part.params)  # code keeps its scope
        return kept
    found = json_object(part.params) if isinstance(part.params, str) else None
    return found if found is not None and holdable_params(found) else {"value": part.params}


def holdable_params(params: dict[str, Any]) -> bool:
    """Whether a message can hold these params: the store's rule for them (plain JSON, not
    too deep, no NUL in a key) and text BSON encodes (no lone surrogate)."""
    try:
        HitlAction(action="a", params=params, request_id="r")
    except ValidationError:
        return False
    return encodes(params)


def json_object(text: str) -> dict[str, Any] | None:
    """The object JSON text spells, when it reads with nothing changed: no key twice, no
    `NaN`, every number as exact as the text (`said`) and within BSON's 64-bit integers;
    else None."""
    try:
        parsed = json.loads(text, parse_constant=_refused, object_pairs_hook=_distinct_keys)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict) or _wide_int(parsed) or said(parsed) != said(text):
        return None
    return parsed


def _wide_int(value: Any) -> bool:
    if isinstance(value, dict):
        return any(map(_wide_int, value.values()))
    if isinstance(value, list):
        return any(map(_wide_int, value))
    return type(value) is int and not -(2**63) <= value < 2**63


def call_arguments(part: LegacyPart) -> tuple[str, bool]:
    """A tool call's arguments as a JSON string, and whether they were plain JSON values."""
    if part.args is None:
        return "{}", True
    if is_text(part.args):
        return part.args, True
    return dumps(part.args, compact=True)


def result_text(part: LegacyPart) -> tuple[str, bool]:
    """A tool result's value as the text a tool message holds, and whether it was plain JSON."""
    return (part.result, True) if is_text(part.result) else dumps(part.result)


def error_text(part: LegacyPart) -> str:
    """An error part's message: its text, else the whole part as JSON."""
    return part.content if is_text(part.content) else dumps(part.raw)[0]
