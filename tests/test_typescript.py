"""The TypeScript declarations: current, deterministic, and faithful to the models.

That they compile under `tsc --strict` with the example is checked by
`make types-check`, which `make test` runs before pytest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from agent_store.core import (
    AssistantMessage,
    Conversation,
    ConversationPage,
    FileUpload,
    HitlAction,
    MessagePage,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from agent_store.store import LoggedTurn
from app.api_models import Transcript, UserExport
from app.http_errors import ApiErrorBody
from scripts.contract import bookkeeping, response_models, served
from scripts.typescript import (
    OUTPUT,
    DeclarationRenderer,
    UnsupportedSchema,
    interface_name,
    render,
)

ROOT = Path(__file__).resolve().parent.parent


def interface_block(text: str, name: str) -> str:
    match = re.search(rf"^export interface {name}\b[^{{]*\{{\n(.*?)^\}}", text, re.M | re.S)
    assert match, f"interface {name} is missing"
    return match.group(0)


def declared_properties(block: str) -> dict[str, str]:
    return dict(re.findall(r"^  (\w+\??): (.+);$", block, re.M))


def test_typescript_declarations_are_current() -> None:
    assert OUTPUT.exists(), "clients/typescript/agent-message.d.ts is missing: run `make types`"
    assert OUTPUT.read_text() == render(), "agent-message.d.ts is stale: run `make types`"


def test_rendering_does_not_depend_on_the_process() -> None:
    env = os.environ | {"PYTHONHASHSEED": "12345"}
    other = subprocess.run(
        [sys.executable, "-c", "import sys; from scripts.typescript import render; "
         "sys.stdout.write(render())"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert other.stdout == render()


@pytest.mark.parametrize(
    ("interface", "model"),
    [
        pytest.param("IAgentMessage", UserMessage, id="message"),
        pytest.param("IAgentConversation", Conversation, id="conversation"),
        pytest.param("IToolCall", ToolCall, id="tool-call"),
        pytest.param("IHitlAction", HitlAction, id="hitl-action"),
        pytest.param("IFileUpload", FileUpload, id="file-upload"),
        pytest.param("IMessagePage", MessagePage, id="message-page"),
        pytest.param("IConversationPage", ConversationPage, id="conversation-page"),
        pytest.param("ITranscript", Transcript, id="transcript"),
        pytest.param("ILoggedTurn", LoggedTurn, id="logged-turn"),
        pytest.param("IUserExport", UserExport, id="user-export"),
        pytest.param("IApiErrorBody", ApiErrorBody, id="error"),
    ],
)
def test_each_interface_declares_exactly_the_keys_a_dump_holds(
    interface: str, model: type[BaseModel]
) -> None:
    block = interface_block(render(), interface)
    keys = [field.alias or name for name, field in model.model_fields.items() if not field.exclude]
    assert list(declared_properties(block)) == keys


def test_every_api_response_has_an_interface() -> None:
    text = render()
    for model in response_models():
        assert re.search(rf"^export interface {interface_name(model.__name__)}\b", text, re.M)


@pytest.mark.parametrize("model", [SystemMessage, UserMessage, AssistantMessage, ToolMessage])
def test_a_role_narrows_the_flat_message_to_its_role_and_nulls_what_it_forbids(
    model: type[SystemMessage],
) -> None:
    text = render()
    block = interface_block(text, "I" + model.__name__)
    assert "extends IAgentMessage<TDate> {" in block.splitlines()[0]
    declared = declared_properties(block)
    role = model.model_fields["role"].default
    assert model.forbidden_fields
    assert declared == {"role": f'"{role}"'} | {field: "null" for field in model.forbidden_fields}
    flat = declared_properties(interface_block(text, "IAgentMessage"))
    assert all(flat[field] != "null" for field in model.forbidden_fields)


def test_a_stored_or_served_message_has_its_ids_seq_and_turn() -> None:
    flat = declared_properties(interface_block(render(), "IAgentMessage"))
    assert {k: flat[k] for k in ("_id", "conversation_id", "seq", "turn_id")} == {
        "_id": "string", "conversation_id": "string", "seq": "number", "turn_id": "string",
    }  # fmt: skip
    assert flat["user_id"] == "string | null"  # a conversation may have no owner


def test_shared_types_take_the_time_type_without_a_default_and_api_types_hold_strings() -> None:
    text = render()
    assert "export interface IAgentMessage<TDate extends DateLike> {" in text
    assert "export interface IAgentConversation<TDate extends DateLike> {" in text
    assert "= Date>" not in text
    assert "= string>" not in text
    assert "export interface IToolCall {" in text  # holds no date, takes no parameter
    conversation = declared_properties(interface_block(text, "IAgentConversation"))
    assert conversation["created_at"] == conversation["updated_at"] == "TDate"
    assert conversation["pending_hitl"] == "IPendingHitl<TDate> | null"
    assert declared_properties(interface_block(text, "IMessagePage"))["data"] == (
        "AgentMessageByRole<string>[]"
    )
    assert declared_properties(interface_block(text, "IConversationPage"))["data"] == (
        "IAgentConversation<string>[]"
    )
    assert (
        "export type AgentMessageDocument = AgentMessageByRole<Date> & "
        "{ epoch?: string | null; copy_owed?: boolean };"
    ) in text


def test_the_conversation_document_declares_the_bookkeeping_as_optional() -> None:
    block = interface_block(render(), "IAgentConversationDocument")
    assert "extends IAgentConversation<Date> {" in block.splitlines()[0]
    assert declared_properties(block) == {
        "turns?": "unknown[]", "turns_dropped?": "number", "inbox?": "Record<string, unknown>",
        "runtime_turns?": "unknown[]", "deleting_since?": "Date | null",
        "fork_check?": "Record<string, unknown> | null", "migrating?": "boolean | null",
        "popping?": "Record<string, unknown> | null", "pops?": "number",
        "popped_seqs?": "unknown[]", "popped_messages?": "unknown[]",
        "resolved_hitl?": "unknown[]", "answered_prompts?": "unknown[]",
        "approved_calls?": "unknown[]", "owned_from?": "number",
        "last_step?": "string | null", "refold_owed?": "Date | null",
        "pending_blocks?": "unknown[]", "calls_relisted?": "unknown[]",
        "epoch?": "string | null", "epoch_marks?": "boolean", "migrated?": "boolean",
        "name_message_id?": "string | null",
        "copy_of?": "string | null", "calls_pushed_off?": "Record<string, unknown> | null",
    }  # fmt: skip


def test_a_bookkeeping_time_is_declared_as_the_date_the_driver_returns() -> None:
    """A bookkeeping field holding a time is a BSON date on disk (schemas/stored: `BsonDate`),
    which the Node.js driver returns as a `Date`: its declaration says so, not `string`."""
    conversation = declared_properties(interface_block(render(), "IAgentConversationDocument"))
    message = re.search(r"AgentMessageDocument = .*& \{ (.*) \};", render())
    assert message
    declared = conversation | dict(re.findall(r"(\w+\??): ([^;]+)", message.group(1)))
    dated = [
        name
        for name, schema in {**bookkeeping(), **bookkeeping(UserMessage)}.items()
        if any(option.get("format") == "date-time" for option in schema.get("anyOf", [schema]))
    ]
    assert "deleting_since" in dated
    assert {name: declared[f"{name}?"].split(" | ") for name in dated} == {
        name: ["Date", "null"] for name in dated
    }


def test_field_docstrings_become_jsdoc_comments() -> None:
    block = interface_block(render(), "IConversationPage")
    assert (
        "  /** Pass as `cursor` to read the next page; null on the last page. */\n"
        "  next_cursor: string | null;"
    ) in block


@pytest.mark.parametrize(
    "schema",
    [
        pytest.param({"type": "object", "properties": {"a": {"type": "string"}}}, id="inline"),
        pytest.param({"not": {"type": "string"}}, id="not"),
        pytest.param({"type": "array"}, id="array-without-items"),
    ],
)
def test_a_schema_without_a_typescript_form_is_refused(schema: dict[str, object]) -> None:
    with pytest.raises(UnsupportedSchema, match=re.escape("no TypeScript type for the JSON")):
        DeclarationRenderer({}).type_of(schema)


def test_roles_that_disagree_on_a_shared_field_are_refused() -> None:
    roots, definitions = served()
    definitions["UserMessage"]["properties"]["content"] = {"type": "integer"}
    with pytest.raises(UnsupportedSchema, match=re.escape("the roles disagree on the type of")):
        DeclarationRenderer(definitions, roots).flat_message()
