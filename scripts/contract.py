"""The wire contract as JSON Schema definitions, derived from the models: one source for
`schemas/` (scripts/schema.py) and the TypeScript declarations (scripts/typescript.py).

Two forms of the same documents:

- served: the JSON the admin API answers with, for every response model its
  routes declare (`app.api.ENDPOINTS`) and the error body. Every key is
  required, every object closed, a role's forbidden fields are `null`, the
  store's fields of a message are never null, times are RFC 3339 with three
  fractional digits and integers are bounded to 2**53 - 1 (what the models'
  serialization schemas say; `tightened` adds the closing and the required
  keys to models that do not say it themselves).
- stored: the documents of `agent_messages` and `agent_conversations` in
  canonical Extended JSON (what `EJSON.serialize(doc, {relaxed: false})` of
  the Node.js driver or `bson.json_util` with `CANONICAL_JSON_OPTIONS` print),
  which keeps BSON types: every time a BSON date, every integer a BSON int64
  within 0…2**53 - 1. A conversation also holds the store's bookkeeping
  (`turns`, `turns_dropped`, `inbox`, `resolved_hitl`, `epoch`, ...), and a message its
  `epoch`, never served and absent until used. A key a version added to a stored shape
  (`AbsentBefore` on its field: `native.json_text`, `truncated.*.sha256`) is not required
  there, since documents stored before it lack it (`absent_before`); the API serves it
  always, and the TypeScript declarations mark it optional (`?`).
"""

from __future__ import annotations

import copy
import re
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel, TypeAdapter

from agent_store.core import (
    MAX_SAFE_INTEGER,
    AbsentBefore,
    AgentMessage,
    Conversation,
    UserMessage,
)
from app.api import ENDPOINTS
from app.http_errors import ApiErrorBody

DRAFT = "https://json-schema.org/draft/2020-12/schema"
MESSAGE = "AgentMessage"
"""The key of the message union (any role) among the definitions."""

DOCUMENTS: dict[str, TypeAdapter[Any]] = {
    MESSAGE: TypeAdapter(AgentMessage),
    "Conversation": TypeAdapter(Conversation),
}
"""What the collections hold (and the API serves as they are)."""

BOOKKEEPING = tuple(name for name, field in Conversation.model_fields.items() if field.exclude)
"""The conversation's fields the store keeps for itself: stored, never served."""
MESSAGE_BOOKKEEPING = tuple(
    name for name, field in UserMessage.model_fields.items() if field.exclude
)
"""A message's fields the store keeps for itself (every role has them): stored, never served."""


def _models_in(hint: Any) -> Iterator[type[BaseModel]]:
    """The models a type hint names, however nested in unions, generics and `Annotated`."""
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        yield hint
    for argument in typing.get_args(hint):
        yield from _models_in(argument)


def absent_before() -> dict[str, dict[str, str]]:
    """The keys documents stored before some version lack, by the definition (model) holding
    them: {definition: {key: version}}, from the `AbsentBefore` marks on the fields of the
    models the documents hold, however deep."""
    found: dict[str, dict[str, str]] = {}
    pending = [*_models_in(AgentMessage), Conversation]
    seen: set[type[BaseModel]] = set()
    while pending:
        model = pending.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            marks = [m for m in field.metadata if isinstance(m, AbsentBefore)]
            if marks:
                found.setdefault(model.__name__, {})[field.alias or name] = marks[0].version
            pending += _models_in(field.annotation)
    return found


def absent_note(version: str) -> str:
    """What the description of a key `absent_before` names adds."""
    return (
        f"Absent on documents stored before {version}, read as the default "
        "(the API serves it always)."
    )


def response_models() -> list[type[BaseModel]]:
    """Every model an API route answers with (success or error), in declaration order."""
    models: list[type[BaseModel]] = []
    for endpoint in ENDPOINTS:
        for shape in endpoint.responses.values():
            models += shape.values() if isinstance(shape, Mapping) else [shape]
    return list(dict.fromkeys([*models, ApiErrorBody]))


def walk(schema: Any) -> Iterator[dict[str, Any]]:
    """Every schema object inside `schema`, itself first."""
    if isinstance(schema, dict):
        yield schema
        for value in schema.values():
            yield from walk(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from walk(item)


def tightened(schema: dict[str, Any]) -> dict[str, Any]:
    """Every object with properties requires all of them and allows no other; a discriminated
    union is an object and its discriminator keeps the property name only (its mapping
    repeats the `const`s, and validators such as Ajv refuse it)."""
    for node in walk(schema):
        if isinstance(node.get("properties"), dict) and node.get("type") == "object":
            node["required"] = list(node["properties"])
            node["additionalProperties"] = False
        if isinstance(node.get("discriminator"), dict):
            node["discriminator"] = {"propertyName": node["discriminator"]["propertyName"]}
            node["type"] = "object"
    return schema


def served() -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(root schema by name, shared definitions) of the documents and every API response."""
    adapters = {**DOCUMENTS, **{m.__name__: TypeAdapter(m) for m in response_models()}}
    roots, definitions = TypeAdapter.json_schemas(
        [(name, "serialization", adapter) for name, adapter in adapters.items()]
    )
    shared = tightened(definitions.get("$defs", {}))
    return {name: tightened(roots[(name, "serialization")]) for name in adapters}, shared


def referenced(schema: Any, definitions: Mapping[str, Any]) -> dict[str, Any]:
    """The definitions `schema` reaches, directly or through each other, sorted by name."""
    wanted: dict[str, Any] = {}
    pending = [schema]
    while pending:
        for node in walk(pending.pop()):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                name = ref.removeprefix("#/$defs/")
                if name not in wanted and name in definitions:
                    wanted[name] = definitions[name]
                    pending.append(definitions[name])
    return dict(sorted(wanted.items()))


def standalone(root: dict[str, Any], definitions: Mapping[str, Any], title: str) -> dict[str, Any]:
    """A schema file: the root (a model's definition itself) with the definitions it needs."""
    if set(root) == {"$ref"}:
        root = definitions[root["$ref"].removeprefix("#/$defs/")]
    document = {"$schema": DRAFT, **copy.deepcopy(root), "title": title}
    needed = referenced(root, definitions)
    if needed:
        document["$defs"] = copy.deepcopy(needed)
    return document


# -- the stored form (canonical Extended JSON) ---------------------------------------------


def digits_at_most(limit: int) -> str:
    """A regular expression of the decimal integers 0…`limit`, without leading zeros."""
    text = str(limit)
    shorter = [r"0"] + ([rf"[1-9]\d{{0,{len(text) - 2}}}"] if len(text) > 1 else [])
    same_length: list[str] = []
    for i, digit in enumerate(text):
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = len(text) - i - 1
            tail = {0: "", 1: r"\d"}.get(rest, rf"\d{{{rest}}}")
            below = str(low) if int(digit) - 1 == low else f"[{low}-{int(digit) - 1}]"
            same_length.append(f"{text[:i]}{below}{tail}")
    same_length.append(text)
    return "^(?:" + "|".join(dict.fromkeys(shorter + same_length)) + ")$"


def _wrapped(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {key: value},
        "required": [key],
        "additionalProperties": False,
    }


STORED_TYPES: dict[str, dict[str, Any]] = {
    "BsonDate": {
        "description": "A BSON date: milliseconds since 1970 in UTC.",
        **_wrapped("$date", _wrapped("$numberLong", {"type": "string", "pattern": r"^\d{1,15}$"})),
    },
    "BsonInt64": {
        "description": "A BSON int64 within 0…2**53 - 1, which JavaScript holds exactly.",
        **_wrapped("$numberLong", {"type": "string", "pattern": digits_at_most(MAX_SAFE_INTEGER)}),
    },
    "BsonSignedInt64": {
        "description": "A BSON int64, any value (a digest).",
        **_wrapped("$numberLong", {"type": "string", "pattern": r"^-?(?:0|[1-9]\d{0,18})$"}),
    },
}


def _as_stored(node: dict[str, Any]) -> dict[str, Any]:
    described = {k: node[k] for k in ("title", "description") if k in node}
    if node.get("type") == "string" and node.get("format") == "date-time":
        return {**described, "$ref": "#/$defs/BsonDate"}
    if node.get("type") == "integer":
        safe = node.get("minimum") == 0 and node.get("maximum") == MAX_SAFE_INTEGER
        return {**described, "$ref": "#/$defs/Bson" + ("Int64" if safe else "SignedInt64")}
    return node


def stored_form(schema: Any) -> Any:
    """`schema` (served form) with every time a BSON date and every integer a BSON int64."""
    if isinstance(schema, list):
        return [stored_form(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = _as_stored(schema)
    if converted is not schema:
        return converted
    return {key: stored_form(value) for key, value in schema.items()}


def bookkeeping(model: type[BaseModel] = Conversation) -> dict[str, dict[str, Any]]:
    """The stored-only fields of a conversation, or of a message (served form), by name."""
    fields = model.model_fields
    names = BOOKKEEPING if model is Conversation else MESSAGE_BOOKKEEPING
    adapters = [
        (name, "serialization", TypeAdapter(fields[name].rebuild_annotation())) for name in names
    ]
    roots, definitions = TypeAdapter.json_schemas(adapters)
    schemas: dict[str, dict[str, Any]] = {}
    for name in names:
        schema = tightened(copy.deepcopy(roots[(name, "serialization")]))
        for node in walk(schema):  # inline the record model, the only definition they use
            ref = node.pop("$ref", None)
            if ref is not None:
                node.update(tightened(copy.deepcopy(definitions["$defs"][ref.split("/")[-1]])))
        description = fields[name].description or ""
        schemas[name] = {"description": description.replace("\n", " "), **schema}
    return schemas


def stored() -> dict[str, dict[str, Any]]:
    """Schema files of the stored documents: message (any role) and conversation."""
    roots, definitions = served()
    files: dict[str, dict[str, Any]] = {}
    for name, title in ((MESSAGE, "agent_messages"), ("Conversation", "agent_conversations")):
        document = stored_form(standalone(roots[name], definitions, f"A document of {title}"))
        document.setdefault("$defs", {}).update(copy.deepcopy(STORED_TYPES))
        files[name] = document
    conversation = files["Conversation"]
    extra = stored_form(bookkeeping())
    conversation["properties"].update(extra)  # optional: absent until the store uses them
    message_extra = stored_form(bookkeeping(UserMessage))
    for variant in files[MESSAGE]["oneOf"]:  # optional: absent on messages stored before
        name = variant["$ref"].split("/")[-1]
        files[MESSAGE]["$defs"][name]["properties"].update(copy.deepcopy(message_extra))
    absent = absent_before()
    placed = [_not_required_where_absent(document, absent) for document in files.values()]
    unplaced = set(absent).difference(*placed)
    if unplaced:
        raise ValueError(f"no stored document holds the definitions {sorted(unplaced)}")
    return files


def _not_required_where_absent(
    document: dict[str, Any], absent: Mapping[str, Mapping[str, str]]
) -> set[str]:
    """The keys documents stored before some version lack (`absent_before`) left out of what
    `document`'s definitions require, each described as such; the definitions changed."""
    definitions = document.get("$defs", {})
    changed = set(absent) & set(definitions)
    for definition in changed:
        keys = absent[definition]
        node = definitions[definition]
        node["required"] = [key for key in node["required"] if key not in keys]
        for key, version in keys.items():
            described = node["properties"][key]
            note = absent_note(version)
            text = described.get("description")
            described["description"] = f"{text}\n\n{note}" if text else note
    return changed


FILE_NAMES = {MESSAGE: "agent-message", "Conversation": "agent-conversation"}


def file_stem(name: str) -> str:
    """The schema file of a definition: `ConversationPage` → `conversation-page`."""
    return FILE_NAMES.get(name) or re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower()
