"""`python -m scripts.typescript`: write the TypeScript declarations of the documents and the API.

The declarations are rendered from the wire contract's JSON Schema definitions
(scripts/contract.py), the same ones `schemas/` is written from, so the
TypeScript readers of `agent_messages`, `agent_conversations` and the API
cannot drift from the models: a test fails when the committed file differs
from what this module renders.

Types shared by the documents and the API (messages, the conversation and
their parts) take the type of a time as a parameter without a default:
`Date` for what the Node.js driver returns, `string` for the API's JSON.
Types only the API returns hold `string` times and take no parameter.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from agent_store.core import UserMessage
from scripts.contract import (
    BOOKKEEPING,
    MESSAGE,
    MESSAGE_BOOKKEEPING,
    absent_before,
    absent_note,
    bookkeeping,
    referenced,
    served,
)

OUTPUT = Path(__file__).resolve().parent.parent / "clients" / "typescript" / "agent-message.d.ts"

MESSAGE_VARIANTS = ("SystemMessage", "UserMessage", "AssistantMessage", "ToolMessage")
RENAMED = {"Conversation": "IAgentConversation"}
FLAT_MESSAGE = "IAgentMessage"
MESSAGE_UNION = "AgentMessageByRole"
MESSAGE_DOCUMENT = "AgentMessageDocument"
CONVERSATION_DOCUMENT = "IAgentConversationDocument"
ROLE_TYPE = "MessageRole"
DATE_PARAM = "TDate"
DATE_LIKE = "DateLike"
API_DATE = "string"

HEADER = f"""\
// Declarations of the documents in `agent_messages` and `agent_conversations`
// and of every JSON response of the admin API, derived from the pydantic models
// (agent_store/core/_models.py, app/api_models.py) through the same JSON Schemas
// as schemas/. Do not edit: run `make types`; a test fails when this file is stale.
//
// Every key is present in every document and every API object; a missing
// value is `null`, never `undefined`. The few keys marked optional (`?`) are
// absent from documents stored before the version that added them (the API
// serves them always). Integers are at most 2**53 - 1.

/**
 * How a time reaches the reader.
 *
 * The collections hold BSON dates, which the Node.js driver returns as `Date`;
 * the API's JSON carries RFC 3339 strings in UTC with exactly three fractional
 * digits (`"2026-01-31T09:30:00.000Z"`, what `Date.prototype.toISOString()`
 * gives, so they sort as the times do). A type shared by both takes the type
 * of a time as the parameter `{DATE_PARAM}`, with no default: write
 * `IAgentConversation<Date>` for a document (or `{CONVERSATION_DOCUMENT}`) and
 * `IAgentConversation<string>` for the API's. The API's own responses
 * (`ITranscript`, `IMessagePage`, …) hold strings and take no parameter.
 */
export type {DATE_LIKE} = Date | string;
"""


class UnsupportedSchema(ValueError):
    """A JSON Schema construct the declarations have no TypeScript form for."""


def _ref_name(ref: str) -> str:
    return ref.removeprefix("#/$defs/")


def interface_name(definition: str) -> str:
    return RENAMED.get(definition, "I" + definition)


def _jsdoc(text: str | None, indent: str = "") -> list[str]:
    if not text:
        return []
    lines = text.replace("*/", "*\\/").strip().splitlines()
    if len(lines) == 1:
        return [f"{indent}/** {lines[0]} */"]
    body = [f"{indent} *" + (f" {line}" if line.strip() else "") for line in lines]
    return [f"{indent}/**", *body, f"{indent} */"]


def _only_null(schema: Mapping[str, Any]) -> bool:
    return schema.get("type") == "null"


_BOOKKEEPING_TYPES = {
    "array": "unknown[]",
    "integer": "number",
    "boolean": "boolean",
    "object": "Record<string, unknown>",
    "string": "string",
    "null": "null",
}


def _bookkeeping_type(schema: dict[str, Any]) -> str:
    """The TypeScript type of a bookkeeping field (its schema is simple: a JSON type, or a
    choice of them), in a document as the Node.js driver returns it: a time is a BSON date
    there (schemas/stored: `BsonDate`), so a `Date`."""
    if "anyOf" in schema:
        return " | ".join(_bookkeeping_type(option) for option in schema["anyOf"])
    if schema.get("type") == "string" and schema.get("format") == "date-time":
        return "Date"
    return _BOOKKEEPING_TYPES[schema["type"]]


class DeclarationRenderer:
    """Turns the contract's JSON Schema definitions into TypeScript declarations."""

    def __init__(
        self, definitions: dict[str, dict[str, Any]], roots: Mapping[str, Any] | None = None
    ) -> None:
        self.definitions = definitions
        self.roots = dict(roots or {})
        shared: set[str] = set()
        for document in (MESSAGE, "Conversation"):
            if document in self.roots:
                shared |= set(referenced(self.roots[document], definitions))
        self.shared = shared
        """Definitions the documents hold: generic over the type of a time."""
        self.absent = absent_before()
        """The keys documents stored before some version lack, by definition: optional."""
        self._dated: dict[str, bool] = {}

    # -- which definitions hold dates ------------------------------------------------

    def holds_dates(self, definition: str) -> bool:
        if definition not in self._dated:
            self._dated[definition] = False  # the models hold no cycles; this only ends a loop
            self._dated[definition] = any(
                self._schema_holds_dates(s)
                for s in self.definitions[definition].get("properties", {}).values()
            )
        return self._dated[definition]

    def _schema_holds_dates(self, schema: Mapping[str, Any]) -> bool:
        if schema.get("format") == "date-time":
            return True
        if "$ref" in schema:
            return self.holds_dates(_ref_name(schema["$ref"]))
        nested: list[Any] = [*schema.get("anyOf", ()), *schema.get("oneOf", ())]
        for key in ("items", "additionalProperties"):
            if isinstance(schema.get(key), Mapping):
                nested.append(schema[key])
        return any(self._schema_holds_dates(s) for s in nested)

    def generic(self, definition: str) -> bool:
        """Whether the interface takes the type of a time as a parameter."""
        return definition in self.shared and self.holds_dates(definition)

    def _reference(self, definition: str, dates: str) -> str:
        name = interface_name(definition)
        return f"{name}<{dates}>" if self.generic(definition) else name

    def _parameters(self, definition: str) -> str:
        return f"<{DATE_PARAM} extends {DATE_LIKE}>" if self.generic(definition) else ""

    # -- types -----------------------------------------------------------------------

    def type_of(self, schema: Mapping[str, Any], dates: str = DATE_PARAM) -> str:
        """The TypeScript type of one JSON Schema, times typed `dates`; unknown constructs
        raise."""
        if "$ref" in schema:
            return self._reference(_ref_name(schema["$ref"]), dates)
        for key in ("oneOf", "anyOf"):
            if key in schema:
                return self._union(schema[key], dates)
        if "const" in schema:
            return json.dumps(schema["const"], ensure_ascii=False)
        if "enum" in schema:
            return " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
        kind = schema.get("type")
        if kind == "string":
            return dates if schema.get("format") == "date-time" else "string"
        if kind in ("integer", "number"):
            return "number"
        if kind == "boolean":
            return "boolean"
        if kind == "null":
            return "null"
        if kind == "array" and isinstance(schema.get("items"), Mapping):
            item = self.type_of(schema["items"], dates)
            return f"({item})[]" if " | " in item else f"{item}[]"
        if kind == "object" and "properties" not in schema:
            values = schema.get("additionalProperties", True)
            value = self.type_of(values, dates) if isinstance(values, Mapping) else "unknown"
            return f"Record<string, {value}>"
        if not schema:
            return "unknown"
        raise UnsupportedSchema(f"no TypeScript type for the JSON Schema {dict(schema)!r}")

    def _union(self, members: list[Mapping[str, Any]], dates: str) -> str:
        refs = [_ref_name(m["$ref"]) for m in members if "$ref" in m]
        if len(refs) == len(members) and sorted(refs) == sorted(MESSAGE_VARIANTS):
            return f"{MESSAGE_UNION}<{dates}>"
        types: list[str] = []
        for member in members:
            if (rendered := self.type_of(member, dates)) not in types:
                types.append(rendered)
        return " | ".join(types)

    # -- declarations ----------------------------------------------------------------

    def interface(self, definition: str) -> list[str]:
        """One interface: times typed by its parameter, or strings for an API-only shape."""
        schema = self.definitions[definition]
        if "properties" not in schema:
            raise UnsupportedSchema(f"{definition} is not an object with properties")
        dates = DATE_PARAM if self.generic(definition) else API_DATE
        absent = self.absent.get(definition, {})
        properties: dict[str, tuple[str, str | None]] = {}
        for prop, prop_schema in schema["properties"].items():
            doc = prop_schema.get("description")
            if prop in absent:
                note = absent_note(absent[prop])
                prop, doc = f"{prop}?", f"{doc}\n\n{note}" if doc else note
            properties[prop] = (self.type_of(prop_schema, dates), doc)
        return self._declare(
            f"{interface_name(definition)}{self._parameters(definition)}",
            schema.get("description"),
            properties,
        )

    @staticmethod
    def _declare(
        head: str, description: str | None, properties: Mapping[str, tuple[str, str | None]]
    ) -> list[str]:
        lines = [*_jsdoc(description), f"export interface {head} {{"]
        for prop, (prop_type, doc) in properties.items():
            lines += _jsdoc(doc, indent="  ")
            lines.append(f"  {prop}: {prop_type};")
        lines.append("}")
        return lines

    def _variants(self) -> list[Mapping[str, Any]]:
        return [self.definitions[v]["properties"] for v in MESSAGE_VARIANTS]

    def flat_message(self) -> list[str]:
        """Every message field on one interface, `role` open to every role; a field one role
        forbids has the type the roles that allow it give it."""
        variants = self._variants()
        for name, props in zip(MESSAGE_VARIANTS[1:], variants[1:], strict=True):
            if list(props) != list(variants[0]):
                raise UnsupportedSchema(
                    f"{name} has other fields than {MESSAGE_VARIANTS[0]}: "
                    "the flat message interface cannot hold both"
                )
        properties: dict[str, tuple[str, str | None]] = {}
        for prop in variants[0]:
            allowed = [v[prop] for v in variants if not _only_null(v[prop])]
            types = {self.type_of(s) for s in allowed}
            if prop != "role" and len(types) != 1:
                raise UnsupportedSchema(
                    f"the roles disagree on the type of `{prop}`: {sorted(types)}"
                )
            properties[prop] = (
                ROLE_TYPE if prop == "role" else types.pop(),
                allowed[0].get("description"),
            )
        doc = (
            "Any stored or served message, as one flat interface: every role has every field.\n\n"
            f"Narrow to the role's own interface with `{MESSAGE_UNION}`."
        )
        return self._declare(f"{FLAT_MESSAGE}<{DATE_PARAM} extends {DATE_LIKE}>", doc, properties)

    def message_variant(self, definition: str) -> list[str]:
        """A role's interface: the flat one, with `role` fixed and its forbidden fields `null`."""
        schema = self.definitions[definition]
        narrowed = {
            prop: (self.type_of(s), s.get("description"))
            for prop, s in schema["properties"].items()
            if prop == "role" or _only_null(s)
        }
        return self._declare(
            f"{interface_name(definition)}<{DATE_PARAM} extends {DATE_LIKE}> "
            f"extends {FLAT_MESSAGE}<{DATE_PARAM}>",
            schema.get("description"),
            narrowed,
        )

    def role_type(self) -> list[str]:
        roles = [self.definitions[v]["properties"]["role"]["const"] for v in MESSAGE_VARIANTS]
        return [
            *_jsdoc("Who speaks a message, as in the OpenAI chat format."),
            f"export type {ROLE_TYPE} = " + " | ".join(json.dumps(r) for r in roles) + ";",
        ]

    def message_union(self) -> list[str]:
        members = [f"{interface_name(v)}<{DATE_PARAM}>" for v in MESSAGE_VARIANTS]
        return [
            *_jsdoc("Any message, told apart by `role`: `switch (message.role)` narrows it."),
            f"export type {MESSAGE_UNION}<{DATE_PARAM} extends {DATE_LIKE}> =",
            *(f"  | {member}" for member in members[:-1]),
            f"  | {members[-1]};",
        ]

    def documents(self) -> list[str]:
        """The collections' documents as the Node.js driver returns them."""
        extra = bookkeeping()
        optional = {
            f"{name}?": (
                _bookkeeping_type(extra[name]),
                f"{extra[name]['description']}\n\nThe store's own: absent until it is used "
                "(a conversation created empty or by the migration has none); read none of it.",
            )
            for name in BOOKKEEPING
        }
        message_extra = bookkeeping(UserMessage)
        kept = "; ".join(
            f"{name}?: {_bookkeeping_type(message_extra[name])}" for name in MESSAGE_BOOKKEEPING
        )
        return [
            *_jsdoc(
                "A document of `agent_messages`, as the Node.js driver returns it, with the "
                "store's\nbookkeeping (absent on messages stored before it; read none of it)."
            ),
            f"export type {MESSAGE_DOCUMENT} = {MESSAGE_UNION}<Date> & {{ {kept} }};",
            "",
            *self._declare(
                f"{CONVERSATION_DOCUMENT} extends {interface_name('Conversation')}<Date>",
                "A document of `agent_conversations`, as the Node.js driver returns it: what the "
                "API serves\nand the store's bookkeeping, which the API never serves.",
                optional,
            ),
        ]

    def declarations(self) -> Iterator[list[str]]:
        yield self.role_type()
        yield self.flat_message()
        yield self.message_union()
        for definition in MESSAGE_VARIANTS:
            yield self.message_variant(definition)
        yield self.interface("Conversation")
        yield self.documents()
        placed = {*MESSAGE_VARIANTS, "Conversation"}
        api = [name for name in self.roots if name not in (MESSAGE, "Conversation")]
        for definition in api:
            yield self.interface(definition)
        placed |= set(api)
        rest = sorted((d for d in self.definitions if d not in placed), key=interface_name)
        for definition in rest:
            yield self.interface(definition)


def render() -> str:
    """The declaration file as the models define it now."""
    roots, definitions = served()
    renderer = DeclarationRenderer(definitions, roots)
    blocks = ["\n".join(block) for block in renderer.declarations()]
    return HEADER + "\n" + "\n\n".join(blocks) + "\n"


def main() -> int:
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(OUTPUT.parent.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
