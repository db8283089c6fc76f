"""The published JSON Schemas (schemas/): current, as strict as the types, and true of the data.

`schemas/api/` holds the served form of every API response, `schemas/stored/`
the documents of both collections in canonical Extended JSON. The Node smoke
test (tests/test_node_client.py) validates real documents and payloads with
Ajv; these check the same rules from Python, on every wire backend.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from bson import Int64
from bson.json_util import CANONICAL_JSON_OPTIONS, dumps
from jsonschema import Draft202012Validator, FormatChecker

from agent_store import (
    AgentMessageLogger,
    ConversationStore,
    StorageUnavailable,
    TurnRules,
)
from agent_store.core import DENIED_RESULT, MAX_SAFE_INTEGER, NativeForm, rfc3339_millis
from agent_store.store import SteeringInbox
from app.examples import EXAMPLE_CONVERSATION_ID
from scripts.contract import digits_at_most, walk
from scripts.schema import SCHEMA_DIR, render
from tests.conftest import Backend
from tests.test_reliability import FailOnce
from tests.test_stored_shapes import stored, write_every_kind_of_document


def schema(name: str) -> Draft202012Validator:
    document = json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())
    Draft202012Validator.check_schema(document)
    return Draft202012Validator(document, format_checker=FormatChecker())


def errors(validator: Draft202012Validator, value: Any) -> list[str]:
    return [e.message for e in validator.iter_errors(value)]


MESSAGE = {
    "_id": "msg-1", "conversation_id": "c-1", "role": "system", "content": "Daily summary",
    "tool_calls": None, "tool_call_id": None, "hitl_action": None, "error": None, "upload": None,
    "created_at": "2026-03-02T09:00:00.000Z", "token_usage": None, "latency_ms": None, "seq": 0,
    "user_id": "u-1", "turn_id": "t-1", "search_text": "Daily summary", "truncated": None,
    "native": None,
}  # fmt: skip


def test_published_schemas_are_current_and_none_is_left_over() -> None:
    rendered = render()
    on_disk = {str(p.relative_to(SCHEMA_DIR)) for p in SCHEMA_DIR.glob("**/*.schema.json")}
    assert on_disk == set(rendered), "schemas/ is stale: run `make schema`"
    for name, text in rendered.items():
        assert (SCHEMA_DIR / name).read_text() == text, f"schemas/{name} is stale"


def test_a_served_message_conforms() -> None:
    assert errors(schema("api/agent-message"), MESSAGE) == []


@pytest.mark.parametrize("key", list(MESSAGE))
def test_a_served_message_missing_any_key_is_refused(key: str) -> None:
    message = {k: v for k, v in MESSAGE.items() if k != key}
    assert errors(schema("api/agent-message"), message)


@pytest.mark.parametrize(
    ("role", "field", "value"),
    [
        pytest.param("system", "tool_calls", [], id="system-tool-calls"),
        pytest.param("user", "tool_call_id", "c1", id="user-tool-call-id"),
        pytest.param(
            "tool", "token_usage", {"input_tokens": 1, "output_tokens": 1}, id="tool-usage"
        ),
        pytest.param("assistant", "upload", {}, id="assistant-upload"),
    ],
)
def test_a_field_its_role_forbids_is_refused(role: str, field: str, value: Any) -> None:
    message = MESSAGE | {"role": role, "tool_call_id": "c1" if role == "tool" else None}
    assert errors(schema("api/agent-message"), message) == []
    assert errors(schema("api/agent-message"), message | {field: value})


@pytest.mark.parametrize("key", ["_id", "conversation_id", "seq", "turn_id"])
def test_a_served_message_never_lacks_its_store_fields(key: str) -> None:
    assert errors(schema("api/agent-message"), MESSAGE | {key: None})


@pytest.mark.parametrize(
    "created_at",
    ["2026-03-02T09:00:00Z", "2026-03-02T09:00:00.123000Z", "2026-03-02T10:00:00.000+01:00"],
)
def test_a_time_in_another_format_than_to_iso_string_is_refused(created_at: str) -> None:
    assert errors(schema("api/agent-message"), MESSAGE | {"created_at": created_at})


def test_times_are_written_as_to_iso_string_writes_them() -> None:
    from datetime import UTC, datetime

    assert rfc3339_millis(datetime(2026, 3, 2, 9, tzinfo=UTC)) == "2026-03-02T09:00:00.000Z"
    assert rfc3339_millis(datetime(2026, 3, 2, 9, 0, 0, 123456, UTC)) == "2026-03-02T09:00:00.123Z"


def test_an_integer_past_what_javascript_holds_is_refused() -> None:
    assert errors(schema("api/agent-message"), MESSAGE | {"seq": MAX_SAFE_INTEGER}) == []
    assert errors(schema("api/agent-message"), MESSAGE | {"seq": MAX_SAFE_INTEGER + 1})


def test_every_integer_of_every_schema_is_bounded_to_what_javascript_holds() -> None:
    unbounded = [
        (name, node)
        for name, text in render().items()
        for node in walk(json.loads(text))
        if node.get("type") == "integer"
        and not (node.get("minimum") is not None and node.get("maximum", 2**64) <= MAX_SAFE_INTEGER)
    ]
    assert unbounded == []


@pytest.mark.parametrize("limit", [0, 7, 10, 99, 100, 305, 4096, 10010])
def test_the_int64_pattern_holds_exactly_the_integers_up_to_its_limit(limit: int) -> None:
    pattern = re.compile(digits_at_most(limit))
    assert [n for n in range(limit * 3 + 20) if pattern.match(str(n))] == list(range(limit + 1))
    assert not pattern.match(f"0{limit}")


def test_the_stored_int64_pattern_stops_at_2_to_the_53_minus_1() -> None:
    pattern = re.compile(digits_at_most(MAX_SAFE_INTEGER))
    assert pattern.match(str(MAX_SAFE_INTEGER))
    assert not pattern.match(str(MAX_SAFE_INTEGER + 1))
    assert not pattern.match(str(2**63 - 1))


def canonical(document: dict[str, Any]) -> Any:
    return json.loads(dumps(document, json_options=CANONICAL_JSON_OPTIONS))


async def test_stored_documents_conform_to_the_stored_schemas(wire_backend: Backend) -> None:
    await write_every_kind_of_document(wire_backend)
    for collection, name in (
        ("agent_messages", "message"),
        ("agent_conversations", "conversation"),
    ):
        validator = schema(f"stored/agent-{name}")
        documents = await stored(wire_backend, collection)
        assert documents
        assert {d["_id"]: errors(validator, canonical(d)) for d in documents} == {
            d["_id"]: [] for d in documents
        }


async def test_a_stored_int32_or_a_missing_key_is_refused(wire_backend: Backend) -> None:
    await write_every_kind_of_document(wire_backend)
    validator = schema("stored/agent-conversation")
    document = canonical(
        await wire_backend.db.agent_conversations.find_one({"_id": EXAMPLE_CONVERSATION_ID})
    )
    assert errors(validator, document) == []
    narrow = copy.deepcopy(document) | {"turn_count": {"$numberInt": "4"}}
    assert errors(validator, narrow)
    assert errors(validator, {k: v for k, v in document.items() if k != "forked_from"})
    assert errors(validator, document | {"message_count": canonical({"n": Int64(2**53)})["n"]})


async def test_a_message_stored_before_0_2_0_conforms_to_the_stored_schema(
    wire_backend: Backend,
) -> None:
    """A message stored before 0.2.0 has no `native.json_text` and a text it cut has no
    `sha256` (DESIGN.md), which the store reads as none: the stored schema takes both, and
    the API's, which serves them always, still requires them."""
    logger = AgentMessageLogger(wire_backend.db)
    native = NativeForm.keeping("langchain", {"response_metadata": {"model": "m"}})
    answer = {"role": "assistant", "content": "ok", "native": native}
    await logger.log_messages("c-old", [{"role": "user", "content": "hi"}, answer], turn_id="t-1")
    messages = wire_backend.db.agent_messages
    await messages.update_one({"seq": 1}, {"$unset": {"native.json_text": ""}})
    cut = {"content": {"length": Int64(5000), "blob_id": "blob-old"}}
    await messages.update_one({"seq": 0}, {"$set": {"truncated": cut}})
    validator = schema("stored/agent-message")

    found = sorted(await stored(wire_backend, "agent_messages"), key=lambda d: d["seq"])
    documents = [canonical(d) for d in found]

    assert [errors(validator, d) for d in documents] == [[], []]
    without_format = copy.deepcopy(documents[1])
    del without_format["native"]["format"]
    assert errors(validator, without_format)
    served = [
        m.model_dump(mode="json", by_alias=True)
        for m in await ConversationStore(wire_backend.db).transcript("c-old")
    ]
    api = schema("api/agent-message")
    assert [errors(api, m) for m in served] == [[], []]
    del served[0]["truncated"]["content"]["sha256"]
    del served[1]["native"]["json_text"]
    assert all(errors(api, m) for m in served)


# -- states sequences of writes reach -------------------------------------------------------

SEQ_CID = "conv-answered"


def _calls(*call_ids: str) -> dict[str, Any]:
    calls = [{"id": c, "function": {"name": "book", "arguments": "{}"}} for c in call_ids]
    return {"role": "assistant", "tool_calls": calls}


def _asks(request_id: str, *naming: str) -> dict[str, Any]:
    hitl: dict[str, Any] = {"action": "confirm", "params": {}, "request_id": request_id}
    if naming:
        hitl["tool_call_ids"] = list(naming)
    return {"role": "assistant", "content": "Sure?", "hitl_action": hitl}


def _result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "booked"}


def _denial(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": DENIED_RESULT,
            "error": {"message": "tool call denied"}}  # fmt: skip


ASKED = {"role": "user", "content": "Book it."}


class WriteSequence:
    """Writes to one conversation, every stored document of both collections checked against
    schemas/stored after each: what they break, by step and document."""

    def __init__(self, backend: Backend, logger: AgentMessageLogger | None = None) -> None:
        self.backend = backend
        self.logger = logger or AgentMessageLogger(backend.db)
        self.store = ConversationStore(backend.db)
        self.turns = 0
        self.broken: dict[str, list[str]] = {}

    async def log(self, *messages: dict[str, Any]) -> None:
        self.turns += 1
        turn_id = f"turn-{self.turns}"
        await self.step(turn_id, self.logger.log_messages(SEQ_CID, messages, turn_id=turn_id))

    async def step(self, name: str, write: Awaitable[Any]) -> None:
        await write
        await self.check(name)

    async def check(self, name: str) -> None:
        for collection, kind in (("agent_messages", "message"), ("agent_conversations", "conv")):
            validator = schema(f"stored/agent-{'message' if kind == 'message' else 'conversation'}")
            for document in await stored(self.backend, collection):
                found = [
                    f"{e.json_path}: {e.message}"
                    for e in validator.iter_errors(canonical(document))
                ]
                if found:
                    self.broken[f"{name}: {document['_id']}"] = found


async def _answered_naming_no_call(s: WriteSequence, monkeypatch: pytest.MonkeyPatch) -> None:
    """Answered without naming calls; the call's result; forks of it; pops after the answer."""
    await s.log(ASKED, _calls("c1"), _asks("r1"))
    await s.step("answered", s.store.resolve_hitl(SEQ_CID, "r1"))
    await s.log(_result("c1"))
    await s.step("fork", s.logger.fork(SEQ_CID, 3, "fork-answered"))
    await s.step("fork before the prompt", s.logger.fork(SEQ_CID, 1, "fork-cut"))
    await s.step("result popped", s.store.pop_last_message(SEQ_CID))
    await s.step("prompt popped", s.store.pop_last_message(SEQ_CID))


async def _partly_approved_and_denied(s: WriteSequence, monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer naming one of two calls its prompt holds; the other denied; forks; pops."""
    await s.log(ASKED, _calls("c1", "c2"), _asks("r1"))
    await s.step("partial", s.store.resolve_hitl(SEQ_CID, "r1", call_ids=["c1"]))
    await s.log(_denial("c2"))
    await s.step("fork", s.logger.fork(SEQ_CID, 3, "fork-partial"))
    await s.log(_result("c1"))
    await s.step("result popped", s.store.pop_last_message(SEQ_CID))
    await s.step("denial popped", s.store.pop_last_message(SEQ_CID))


async def _asked_again(s: WriteSequence, monkeypatch: pytest.MonkeyPatch) -> None:
    """An approved call asked about again, that question popped, asked again and refused."""
    await s.log(ASKED, _calls("c1"), _asks("r1"))
    await s.step("answered", s.store.resolve_hitl(SEQ_CID, "r1", call_ids=["c1"]))
    await s.log(_asks("r2", "c1"))
    await s.step("fork", s.logger.fork(SEQ_CID, 3, "fork-asked-again"))
    await s.step("question popped", s.store.pop_last_message(SEQ_CID))
    await s.log(_asks("r3", "c1"))
    await s.log(_denial("c1"))
    await s.log(_calls("c1"))


async def _relocated(s: WriteSequence, monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn retried after a person answered its prompt moves past the turn logged meanwhile."""
    s.logger = AgentMessageLogger(s.backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    await s.log(ASKED)

    async def lost(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the turn reserved and has not inserted")

    monkeypatch.setattr(s.logger._messages, "insert_many", lost)
    with pytest.raises(ConnectionError):
        await s.logger.log_messages(SEQ_CID, [_calls("c1"), _asks("r1")], turn_id="moved")
    monkeypatch.undo()
    await s.check("reserved only")
    await s.step("answered", s.store.resolve_hitl(SEQ_CID, "r1"))
    await s.log({"role": "user", "content": "Thanks."})
    moved = s.logger.log_messages(SEQ_CID, [_calls("c1"), _asks("r1")], turn_id="moved")
    await s.step("moved", moved)
    transcript = [m.content for m in await s.store.transcript(SEQ_CID)]
    assert transcript == ["Book it.", "Thanks.", None, "Sure?"]


async def _half_popped(s: WriteSequence, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pop of an answered prompt whose removal was lost: its mark stays until the next pop."""
    await s.log(ASKED, _calls("c1"), _asks("r1"))
    await s.step("answered", s.store.resolve_hitl(SEQ_CID, "r1"))
    await s.log(_result("c1"))
    failing = FailOnce(s.store._messages, "delete_one", after_applying=False)
    monkeypatch.setattr(s.store, "_messages", failing)
    with pytest.raises(StorageUnavailable):
        await s.store.pop_last_message(SEQ_CID)
    monkeypatch.undo()
    assert (await s.backend.db.agent_conversations.find_one({"_id": SEQ_CID}))["popping"]
    await s.check("pop under way")
    await s.step("pop finished", s.store.pop_last_message(SEQ_CID))


async def _owned_steered_and_claimed(s: WriteSequence, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unowned conversation a turn assigns, a runtime's step, a steered turn, a claim."""
    await s.log(ASKED)
    owned = s.logger.log_messages(SEQ_CID, [ASKED], user_id="user-a", turn_id="owned", step="1")
    await s.step("owned", owned)
    inbox = SteeringInbox(s.logger)
    await s.step("opened", inbox.open_turn(SEQ_CID, "steered"))
    steer = {"role": "user", "content": "also Lille"}
    await s.step("delivered", inbox.try_deliver(SEQ_CID, "steered", steer))
    await s.step("closed", inbox.close_inbox(SEQ_CID, "steered", -1))
    await s.step("claimed", s.store.claim("user-a", "user-b"))


@pytest.mark.parametrize(
    "sequence",
    [
        _answered_naming_no_call,
        _partly_approved_and_denied,
        _asked_again,
        _relocated,
        _half_popped,
        _owned_steered_and_claimed,
    ],
    ids=lambda f: f.__name__.strip("_").replace("_", "-"),
)
async def test_every_state_a_sequence_of_writes_reaches_conforms_to_the_stored_schemas(
    wire_backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    sequence: Callable[[WriteSequence, pytest.MonkeyPatch], Awaitable[None]],
) -> None:
    """Answers to prompts (naming calls or not, in part), denials, pops, forks, moved turns,
    a pop under way: the bookkeeping they write holds every key its model has, as the
    schemas say and TypeScript readers validate (docs/TYPESCRIPT.md)."""
    states = WriteSequence(wire_backend)

    await sequence(states, monkeypatch)

    assert states.broken == {}, "\n".join(f"{k}: {v}" for k, v in states.broken.items())
