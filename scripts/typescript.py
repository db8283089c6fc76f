"""`python -m scripts.typescript`: write the TypeScript declarations of the documents and API pages.

The declarations are derived from the models' JSON Schemas (serialization
mode), so the TypeScript readers of `agent_messages`, `agent_conversations`
and the API cannot drift from `agent_store/core/_models.py`: a test fails when the
committed file differs from what this module renders.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from agent_store.core import (
    AssistantMessage,
    Conversation,
    ConversationPage,
    MessagePage,
    SystemMessage,
    ToolMessage,
    UserMessage,
)

OUTPUT = Path(__file__).resolve().parent.parent / "clients" / "typescript" / "agent-message.d.ts"

MESSAGE_MODELS: tuple[type[SystemMessage | UserMessage | AssistantMessage | ToolMessage], ...] = (
    SystemMessage,
    UserMessage,
    AssistantMessage,
    ToolMessage,
)
DOCUMENT_MODELS: tuple[type[BaseModel], ...] = (Conversation,)
API_MODELS: tuple[type[BaseModel], ...] = (MessagePage, ConversationPage)
"""Shapes only the API returns: their dates default to ISO strings, not `Date`."""

RENAMED = {"Conversation": "IAgentConversation"}
FLAT_MESSAGE = "IAgentMessage"
MESSAGE_UNION = "AgentMessageByRole"
ROLE_TYPE = "MessageRole"
DATE_PARAM = "TDate"
DATE_LIKE = "DateLike"

HEADER = f"""\
// Declarations of the documents in `agent_messages` and `agent_conversations`
// and of the admin API's JSON, derived from the pydantic models in agent_store/core/_models.py.
// Do not edit: run `make types`; a test fails when this file is stale.
//
// Every key is present in every document and every API object; a missing
// value is `null`, never `undefined`.

/**
 * How a date reaches the reader.
 *
 * MongoDB stores dates as BSON dates, which the Node.js driver returns as
 * `Date`; the admin API's JSON carries them as ISO 8601 strings in UTC
 * (`"2026-01-31T09:30:00.123000Z"`, which `new Date(...)` parses). Every type
 * holding a date takes it as the parameter `{DATE_PARAM}`: it defaults to `Date`
 * for documents read from the collections and to `string` for API pages, so
 * write `IAgentConversation<string>` for a conversation from the API.
 */
export type {DATE_LIKE} = Date | string;
"""


class UnsupportedSchema(ValueError):
    """A JSON Schema construct the declarations have no TypeScript form for."""


def model_definitions() -> dict[str, dict[str, Any]]:
    models = (*MESSAGE_MODELS, *DOCUMENT_MODELS, *API_MODELS)
    _, schema = models_json_schema(
        [(model, "serialization") for model in models], ref_template="#/$defs/{model}"
    )
    definitions: dict[str, dict[str, Any]] = schema["$defs"]
    return definitions


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


class DeclarationRenderer:
    """Turns the models' JSON Schema definitions into TypeScript declarations."""

    def __init__(self, definitions: dict[str, dict[str, Any]]) -> None:
        self.definitions = definitions
        self.message_variants = [model.__name__ for model in MESSAGE_MODELS]
        self.api_shapes = {model.__name__ for model in API_MODELS}
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

    def _reference(self, name: str, dated: bool) -> str:
        return f"{name}<{DATE_PARAM}>" if dated else name

    def _parameters(self, definition: str) -> str:
        if not self.holds_dates(definition):
            return ""
        default = "string" if definition in self.api_shapes else "Date"
        return f"<{DATE_PARAM} extends {DATE_LIKE} = {default}>"

    # -- types -----------------------------------------------------------------------

    def type_of(self, schema: Mapping[str, Any]) -> str:
        """The TypeScript type of one JSON Schema; unknown constructs raise."""
        if "$ref" in schema:
            definition = _ref_name(schema["$ref"])
            return self._reference(interface_name(definition), self.holds_dates(definition))
        for key in ("oneOf", "anyOf"):
            if key in schema:
                return self._union(schema[key])
        if "const" in schema:
            return json.dumps(schema["const"], ensure_ascii=False)
        if "enum" in schema:
            return " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
        kind = schema.get("type")
        if kind == "string":
            return DATE_PARAM if schema.get("format") == "date-time" else "string"
        if kind in ("integer", "number"):
            return "number"
        if kind == "boolean":
            return "boolean"
        if kind == "null":
            return "null"
        if kind == "array" and isinstance(schema.get("items"), Mapping):
            item = self.type_of(schema["items"])
            return f"({item})[]" if " | " in item else f"{item}[]"
        if kind == "object" and "properties" not in schema:
            values = schema.get("additionalProperties", True)
            value = self.type_of(values) if isinstance(values, Mapping) else "unknown"
            return f"Record<string, {value}>"
        if not schema:
            return "unknown"
        raise UnsupportedSchema(f"no TypeScript type for the JSON Schema {dict(schema)!r}")

    def _union(self, members: list[Mapping[str, Any]]) -> str:
        refs = [_ref_name(m["$ref"]) for m in members if "$ref" in m]
        if len(refs) == len(members) and sorted(refs) == sorted(self.message_variants):
            return self._reference(MESSAGE_UNION, dated=True)
        types: list[str] = []
        for member in members:
            if (rendered := self.type_of(member)) not in types:
                types.append(rendered)
        return " | ".join(types)

    # -- declarations ----------------------------------------------------------------

    def interface(
        self, definition: str, *, overrides: Mapping[str, tuple[str, str]] | None = None
    ) -> list[str]:
        """One interface; `overrides` maps a property to (its type, a note for its doc)."""
        schema = self.definitions[definition]
        if "properties" not in schema:
            raise UnsupportedSchema(f"{definition} is not an object with properties")
        return self._declare(
            f"{interface_name(definition)}{self._parameters(definition)}",
            schema.get("description"),
            schema["properties"],
            overrides or {},
        )

    def _declare(
        self,
        head: str,
        description: str | None,
        properties: Mapping[str, Mapping[str, Any]],
        overrides: Mapping[str, tuple[str, str]],
    ) -> list[str]:
        lines = [*_jsdoc(description), f"export interface {head} {{"]
        for prop, prop_schema in properties.items():
            prop_type, note = overrides.get(prop, (self.type_of(prop_schema), ""))
            doc = "\n\n".join(p for p in (prop_schema.get("description"), note) if p)
            lines += _jsdoc(doc, indent="  ")
            lines.append(f"  {prop}: {prop_type};")
        lines.append("}")
        return lines

    def message_variant(self, model: type[BaseModel]) -> list[str]:
        """A role's interface: the flat one, with `role` fixed and its forbidden fields `null`."""
        definition = model.__name__
        schema = self.definitions[definition]
        role = schema["properties"]["role"]["const"]
        aliases = {name: field.alias or name for name, field in model.model_fields.items()}
        forbidden = {aliases[field] for field in getattr(model, "forbidden_fields", ())}
        narrowed = {
            prop: prop_schema
            for prop, prop_schema in schema["properties"].items()
            if prop == "role" or prop in forbidden
        }
        overrides = {
            prop: ("null", f"Always `null` when `role` is `{role}`.") for prop in forbidden
        }
        return self._declare(
            f"{interface_name(definition)}{self._parameters(definition)} "
            f"extends {self._reference(FLAT_MESSAGE, self.holds_dates(definition))}",
            schema.get("description"),
            narrowed,
            overrides,
        )

    def flat_message(self) -> list[str]:
        """Every message field on one interface, `role` open to every role."""
        variants = [self.definitions[v] for v in self.message_variants]
        first = variants[0]["properties"]
        for name, variant in zip(self.message_variants[1:], variants[1:], strict=True):
            props = variant["properties"]
            same = list(props) == list(first) and all(
                self.type_of(props[p]) == self.type_of(first[p]) for p in first if p != "role"
            )
            if not same:
                raise UnsupportedSchema(
                    f"{name} differs from {self.message_variants[0]} in more than `role`: "
                    "the flat message interface cannot hold both"
                )
        doc = (
            "Any message, as one flat interface: every role has every field.\n\n"
            f"Narrow to the role's own interface with `{MESSAGE_UNION}`."
        )
        return self._declare(
            f"{FLAT_MESSAGE}{self._parameters(self.message_variants[0])}",
            doc,
            first,
            {"role": (ROLE_TYPE, "")},
        )

    def role_type(self) -> list[str]:
        roles = [self.definitions[v]["properties"]["role"]["const"] for v in self.message_variants]
        return [
            *_jsdoc("Who speaks a message, as in the OpenAI chat format."),
            f"export type {ROLE_TYPE} = " + " | ".join(json.dumps(r) for r in roles) + ";",
        ]

    def message_union(self) -> list[str]:
        members = [
            self._reference(interface_name(v), self.holds_dates(v)) for v in self.message_variants
        ]
        return [
            *_jsdoc("Any message, told apart by `role`: `switch (message.role)` narrows it."),
            f"export type {MESSAGE_UNION}<{DATE_PARAM} extends {DATE_LIKE} = Date> =",
            *(f"  | {member}" for member in members[:-1]),
            f"  | {members[-1]};",
        ]

    def declarations(self) -> Iterator[list[str]]:
        yield self.role_type()
        yield self.flat_message()
        yield self.message_union()
        for model in MESSAGE_MODELS:
            yield self.message_variant(model)
        leading = [m.__name__ for m in (*DOCUMENT_MODELS, *API_MODELS)]
        for definition in leading:
            yield self.interface(definition)
        placed = {*self.message_variants, *leading}
        rest = sorted((d for d in self.definitions if d not in placed), key=interface_name)
        for definition in rest:
            yield self.interface(definition)


def render() -> str:
    """The declaration file as the models define it now."""
    renderer = DeclarationRenderer(model_definitions())
    blocks = ["\n".join(block) for block in renderer.declarations()]
    return HEADER + "\n" + "\n\n".join(blocks) + "\n"


def main() -> int:
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(OUTPUT.parent.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
