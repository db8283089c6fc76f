"""The write path's own work per message: counted, never timed.

A turn's messages are validated once, copied once and dumped once; the store
does not BSON-encode a message that is far below its size bound (the driver
encodes it anyway); a reservation brings back only what the logger needs.
"""

from __future__ import annotations

import copy
import json
import sys
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import bson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter
from pymongo import AsyncMongoClient, monitoring

from agent_store import AgentMessageLogger
from agent_store.core import message_adapter, messages_adapter
from agent_store.core._models import _MessageBase, _Model
from agent_store.store import MAX_TURN_NAMED_CALLS
from agent_store.store._text import search_text
from app.examples import example_turns
from scripts.reservation_cost import nodes

CID = "cost-1"


def corpus_turns() -> list[tuple[str, list[dict[str, Any]]]]:
    from scripts.corpus import Corpus

    return Corpus(seed=5).conversation(6).turns


class Spies:
    """Counts what the store does to messages while installed."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        counts = self.counts
        dump, copy_, replacing, validate = (
            BaseModel.model_dump,
            BaseModel.model_copy,
            _Model.replacing,
            TypeAdapter.validate_python,
        )
        encode = bson.encode

        def counting_dump(model: BaseModel, *args: Any, **kwargs: Any) -> Any:
            if isinstance(model, _MessageBase):
                counts["dump"] += 1
            return dump(model, *args, **kwargs)

        def counting_copy(model: BaseModel, *args: Any, **kwargs: Any) -> Any:
            if isinstance(model, _MessageBase):
                counts["copy"] += 1
            return copy_(model, *args, **kwargs)

        def counting_replacing(model: _Model, update: Any) -> Any:
            if isinstance(model, _MessageBase):
                counts["copy"] += 1
            return replacing(model, update)

        def counting_validate(
            adapter: TypeAdapter[Any], value: Any, *args: Any, **kwargs: Any
        ) -> Any:
            if adapter is messages_adapter:
                counts["validate"] += len(value)
            elif adapter is message_adapter:
                counts["validate"] += 1
            return validate(adapter, value, *args, **kwargs)

        def counting_encode(document: Any, *args: Any, **kwargs: Any) -> bytes:
            if sys._getframe(1).f_globals["__name__"].startswith("agent_store"):
                counts["encode"] += 1  # the store's own; mongomock encodes what it stores
            return encode(document, *args, **kwargs)

        monkeypatch.setattr(BaseModel, "model_dump", counting_dump)
        monkeypatch.setattr(BaseModel, "model_copy", counting_copy)
        monkeypatch.setattr(_Model, "replacing", counting_replacing)
        monkeypatch.setattr(TypeAdapter, "validate_python", counting_validate)
        monkeypatch.setattr(bson, "encode", counting_encode)


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> Spies:
    spies = Spies()
    spies.install(monkeypatch)
    return spies


async def test_each_message_of_a_turn_is_validated_copied_and_dumped_once_and_never_encoded(
    spies: Spies,
) -> None:
    from mongomock_motor import AsyncMongoMockClient

    logger = AgentMessageLogger(AsyncMongoMockClient(tz_aware=True)["cost"])
    turns = copy.deepcopy(corpus_turns())
    messages = sum(len(m) for _, m in turns)

    for turn_id, turn in turns:
        await logger.log_messages(CID, turn, user_id="u-1", turn_id=turn_id)

    assert spies.counts == Counter(validate=messages, copy=messages, dump=messages)


async def test_a_turn_without_a_turn_id_dumps_nothing_more_to_derive_one(spies: Spies) -> None:
    from mongomock_motor import AsyncMongoMockClient

    logger = AgentMessageLogger(AsyncMongoMockClient(tz_aware=True)["cost"])
    _, turn = copy.deepcopy(corpus_turns()[0])

    await logger.log_messages(CID, turn, user_id="u-1")

    assert spies.counts["dump"] == len(turn)


class CommandBodies(monitoring.CommandListener):
    def __init__(self) -> None:
        self.commands: list[dict[str, Any]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.commands.append(dict(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.mark.wire
async def test_a_reservation_brings_back_only_the_next_seq_the_owner_and_its_bookkeeping(
    wire_uri: str,
) -> None:
    listener = CommandBodies()
    client: Any = AsyncMongoClient(wire_uri, tz_aware=True, event_listeners=[listener])
    db = client["cost_reservation"]
    try:
        logger = AgentMessageLogger(db)
        for turn_id, messages in example_turns():
            await logger.log_messages(CID, messages, user_id="u-1", turn_id=turn_id)
        reservations = [c for c in listener.commands if "findAndModify" in c]
        assert reservations
        assert {tuple(sorted(c["fields"])) for c in reservations} == {
            (
                "_id",
                "created_at",
                "epoch",
                "message_count",
                "owned_from",
                "pending_blocks",
                "pops",
                "refold_owed",
                "user_id",
            )
        }
    finally:
        await client.drop_database("cost_reservation")
        await client.close()


class _ReadFields(dict[str, Any]):
    """A conversation document that records every field read of it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)


def test_every_field_the_logger_reads_of_a_reservation_is_in_its_projection() -> None:
    from agent_store.store._logger import _reserved
    from agent_store.store._reservation import RESERVED
    from agent_store.store._turns import plan_turn

    plan = plan_turn(CID, [{"role": "user", "content": "hi"}], turn_id="t-1")
    answered = _ReadFields(
        _id=CID, message_count=3, user_id="u-1", created_at=datetime.now(UTC), epoch="e-1"
    )
    reserved = _reserved(plan, answered, observed=False)
    assert answered.read <= set(RESERVED), answered.read - set(RESERVED)
    assert (reserved.first_seq, reserved.owner, reserved.epoch) == (2, "u-1", "e-1")


_texts = st.text(st.characters(codec="utf-8"), max_size=300)
_messages = st.one_of(
    st.builds(
        lambda content, name: (
            {"role": "user", "content": content, "upload": None}
            if name is None
            else {
                "role": "user",
                "content": content,
                "upload": {
                    "filename": name,
                    "file_type": "text/plain",
                    "size": 3,
                    "parsed_text": content,
                },
            }
        ),
        _texts,
        st.none() | _texts,
    ),
    st.builds(
        lambda args, name, usage: {
            "role": "assistant",
            "tool_calls": [
                {"id": "c" + name[:5], "function": {"name": name or "t", "arguments": args}}
            ],
            "token_usage": {"input_tokens": usage, "output_tokens": usage},
        },
        _texts,
        _texts,
        st.integers(0, 2**53 - 1),
    ),
    st.builds(
        lambda content, params: {
            "role": "assistant",
            "content": content,
            "hitl_action": {"action": "confirm", "params": params, "request_id": "r-1"},
            "error": {"message": content},
        },
        _texts,
        st.dictionaries(_texts.filter(lambda k: "\0" not in k), st.integers() | _texts, max_size=5),
    ),
    st.builds(
        lambda content, kept, removed: {
            "role": "assistant",
            "content": content,
            "native": {"format": "langchain", "set": kept, "unset": removed},
        },
        _texts,
        st.dictionaries(
            _texts.filter(lambda k: "\0" not in k and not k.startswith("$")),
            st.integers(-(2**53), 2**53) | _texts | st.lists(_texts, max_size=3),
            max_size=5,
        ),
        st.lists(_texts, max_size=3),
    ),
)


@settings(max_examples=200, deadline=None)
@given(_messages, st.integers(0, 3))
def test_the_cheap_size_bound_is_never_below_the_encoded_size(
    message: dict[str, Any], truncations: int
) -> None:
    document = message_adapter.validate_python(
        {**message, "_id": "msg-1", "conversation_id": "c-1", "turn_id": "t-1", "search_text": "s"}
    ).model_dump(by_alias=True)
    if truncations:
        document["truncated"] = {
            f"content{n}": {"length": n, "blob_id": None} for n in range(truncations)
        }
    document |= {"seq": 2**53 - 1, "user_id": "u" * 200}
    from agent_store.store._truncation import size_bound

    try:
        exact = len(bson.encode(document))
    except OverflowError:  # an integer BSON cannot hold: the bound says so as well
        with pytest.raises(OverflowError):
            size_bound(document)
        return
    assert size_bound(document) >= exact


def test_the_cheap_size_bound_counts_a_runtimes_native_form() -> None:
    from agent_store.store._truncation import size_bound

    native = {"format": "langchain", "set": {"content": [{"type": "image", "data": "y" * 50_000}]}}
    document = message_adapter.validate_python(
        {"role": "user", "content": "[image]", "native": native}
    ).model_dump(by_alias=True)
    assert size_bound(document) >= len(bson.encode(document)) > 50_000


@settings(max_examples=200, deadline=None)
@given(_messages)
def test_the_bound_of_a_whole_turn_is_never_below_its_encoded_size(message: dict[str, Any]) -> None:
    from agent_store.store._truncation import turn_size_bound
    from agent_store.store._turns import _canonical

    document = message_adapter.validate_python(message).model_dump(by_alias=True)
    canonical = _canonical([document])
    document |= {
        "_id": "msg-" + "0" * 32,
        "conversation_id": "c" * 200,
        "turn_id": "t" * 200,
        "search_text": search_text(message_adapter.validate_python(message)),
        "seq": 2**53 - 1,
        "user_id": "u" * 200,
    }
    try:
        exact = len(bson.encode(document))
    except OverflowError:
        return  # refused by the per-message bound (HITL params are always walked)
    assert turn_size_bound(canonical, [document["search_text"]]) >= exact


async def test_a_turn_recorded_with_the_earlier_digest_is_still_recognised_on_replay() -> None:
    """Records written before the digest became the `repr` form hold sorted JSON's."""
    from mongomock_motor import AsyncMongoMockClient

    from agent_store import Conflict
    from agent_store.store._turns import json_content_digest

    db = AsyncMongoMockClient(tz_aware=True)["cost_digest"]
    logger = AgentMessageLogger(db)
    (turn_id, messages), (_, other) = example_turns()[:2]
    await logger.log_messages(CID, copy.deepcopy(messages), user_id="u-1", turn_id=turn_id)
    stored = await db.agent_messages.find({}, {"_id": 1}).to_list(None)
    documents = await db.agent_messages.find().sort("seq", 1).to_list(None)
    await db.agent_conversations.update_one(
        {"_id": CID}, {"$set": {"turns.0.d": json_content_digest(documents)}}
    )

    again = await logger.log_messages(CID, copy.deepcopy(messages), user_id="u-1", turn_id=turn_id)

    assert again.replayed
    assert await db.agent_messages.count_documents({}) == len(stored)
    with pytest.raises(Conflict, match="other content"):
        await logger.log_messages(CID, copy.deepcopy(other), user_id="u-1", turn_id=turn_id)


@settings(max_examples=300, deadline=None)
@given(st.text(st.sampled_from([" ", "a", "é", "\n", "\t", "\x0b", "\x1c", "\xa0", "\u2003", "b"])))
def test_collapsing_white_space_is_what_split_and_join_give(text: str) -> None:
    from agent_store.store._text import collapse_whitespace

    assert collapse_whitespace(text) == " ".join(text.split())


def test_a_turn_is_walked_for_split_surrogates_only_when_it_holds_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Joining UTF-16 halves needs a walk of every value; a turn without one is spared it."""
    from agent_store.store import _turns, plan_turn

    walks = Counter[str]()
    walk = _turns.storable

    def counting_walk(value: Any, where: str) -> Any:
        walks["walk"] += 1
        return walk(value, where)

    monkeypatch.setattr(_turns, "storable", counting_walk)
    _, turn = copy.deepcopy(corpus_turns()[0])
    plan_turn(CID, turn, turn_id="t-1")
    assert walks["walk"] == 0

    plan = plan_turn(CID, [{"role": "user", "content": "smile \ud83d\ude00"}], turn_id="t-2")
    assert walks["walk"] == 1
    assert plan.documents[0]["content"] == "smile 😀"


_halves = st.sampled_from(["\ud83d", "\ude00", "\ud83d\ude00", "\\ud83d", "a", "é", "😀"])
_odd_texts = st.lists(_halves, max_size=4).map("".join)
_odd_values: st.SearchStrategy[Any] = st.recursive(
    st.integers(-5, 5) | _odd_texts,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(_odd_texts, inner, max_size=3)
    ),
    max_leaves=6,
)
_odd_turns = st.lists(
    st.one_of(
        st.builds(lambda text: {"role": "user", "content": text}, _odd_texts),
        st.builds(
            lambda name, args: {
                "role": "assistant",
                "tool_calls": [{"id": "c-1", "function": {"name": name or "f", "arguments": args}}],
            },
            _odd_texts,
            st.dictionaries(_odd_texts, _odd_values, max_size=3),
        ),
        st.builds(
            lambda text, params: {
                "role": "assistant",
                "content": text or "?",
                "hitl_action": {"action": "confirm", "params": params, "request_id": "r-1"},
            },
            _odd_texts,
            st.dictionaries(_odd_texts, _odd_values, max_size=3),
        ),
        st.builds(
            lambda kept: {"role": "assistant", "native": {"format": "langchain", "set": kept}},
            st.dictionaries(_odd_texts.filter(lambda k: not k.startswith("$")), _odd_values),
        ),
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(_odd_turns)
def test_a_turn_plans_as_it_would_with_every_value_walked_first(turn: list[dict[str, Any]]) -> None:
    """Sparing the walk changes nothing: halves are joined, a lone one is refused, tuples
    are lists, and every refusal is the one the walk-first parse gives."""
    from agent_store import InvalidInput
    from agent_store.store import plan_turn
    from agent_store.store._values import storable

    turn = [{**message, "created_at": "2026-01-02T03:04:05Z"} for message in turn]

    def outcome(messages: Any) -> Any:
        try:
            plan = plan_turn(CID, messages, turn_id="t-1")
        except InvalidInput as exc:
            return str(exc)
        return plan.documents, plan.digest

    try:
        walked = [storable(m, f"message {i}") for i, m in enumerate(copy.deepcopy(turn))]
    except InvalidInput as exc:
        expected: Any = str(exc)
    else:
        expected = outcome(walked)
    assert outcome(copy.deepcopy(turn)) == expected


def test_a_retry_validates_only_its_own_turn_record_and_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agent_store.core import TurnRecord
    from agent_store.store._reservation import RecordedBlock, recorded_block

    records = [{"k": n, "f": 3 * n, "d": n, "a": "2026-01-01T00:00:00Z"} for n in range(1000)]
    validated = Counter[str]()
    validate = TurnRecord.model_validate

    def counting(value: Any, *args: Any, **kwargs: Any) -> TurnRecord:
        validated["record"] += 1
        return validate(value, *args, **kwargs)

    monkeypatch.setattr(TurnRecord, "model_validate", counting)
    conversation = {"turns": records, "message_count": 3000}

    block = recorded_block(conversation, 500)
    last = recorded_block(conversation, 999)

    at = datetime(2026, 1, 1, tzinfo=UTC)
    assert block == RecordedBlock(first_seq=1500, count=3, digest=500, reserved_at=at)
    assert last == RecordedBlock(first_seq=2997, count=3, digest=999, reserved_at=at)
    assert recorded_block(conversation, 1000) is None
    assert validated["record"] == 3


def test_a_mapping_subclass_plans_as_the_plain_dict_it_holds() -> None:
    """Digests (and the turn ids derived from them) read values, not the caller's classes."""
    from collections import OrderedDict

    from agent_store.store import plan_turn

    def turn(mapping: Any) -> list[dict[str, Any]]:
        hitl = {"action": "a", "request_id": "r", "params": mapping({"k": mapping({"v": [1]})})}
        native = {"format": "langchain", "set": mapping({"n": mapping({"v": 2})})}
        return [{"role": "assistant", "content": "x", "hitl_action": hitl, "native": native,
                 "created_at": "2026-01-02T03:04:05Z"}]  # fmt: skip

    plain, ordered = plan_turn(CID, turn(dict)), plan_turn(CID, turn(OrderedDict))

    assert (ordered.turn_id, ordered.digest) == (plain.turn_id, plain.digest)
    assert ordered.documents == plain.documents
    assert type(ordered.documents[0]["hitl_action"]["params"]["k"]) is dict


# -- a reservation's size: linear in what the turn answers and names -------------------------


def reservation_command(messages: list[dict[str, Any]]) -> bytes:
    """The filter and update a turn's reservation sends (its denials' condition included), as
    BSON: what the command carries but for a few short fields."""
    from agent_store.store._reservation import (
        Actor,
        denials_hold,
        reservation,
        reservation_filter,
    )
    from agent_store.store._turns import TurnRules, plan_turn

    plan = plan_turn(CID, messages, turn_id="t-1")
    actor = Actor("u-1")
    query = reservation_filter(plan, actor)
    if plan.denied_calls:
        query |= denials_hold(plan.denied_calls)
    update = reservation(plan, actor, None, TurnRules(), datetime.now(UTC))
    return bson.encode({"q": query, "u": update})


def expressions(value: Any) -> int:
    """How many operators an update holds, constants (`$literal`) counted as one."""
    if isinstance(value, dict):
        own = sum(1 for key in value if key.startswith("$"))
        if "$literal" in value:
            return own
        return own + sum(expressions(v) for v in value.values())
    if isinstance(value, list):
        return sum(expressions(v) for v in value)
    return 0


def test_a_reservation_names_each_call_its_turn_answers_at_most_twice_whatever_their_number() -> (
    None
):
    """The answers of a turn are compared with the pending calls in one expression, whatever
    their number: each answered id is written at most twice (with the pending calls, with the
    prompt), and the operators do not grow with the answers. (Each id was written in an
    expression of its own, five times over: 999 results of long ids took a 3 MiB command.)"""
    from scripts.reservation_bounds import answers_turn, long_id

    for results in (10, 999):
        command = reservation_command(answers_turn(results))
        named = {command.count(long_id("ghost", i).encode()) for i in range(results)}
        assert named == {2}, (results, named)
    few, many = (bson.decode(reservation_command(answers_turn(n))) for n in (10, 999))
    assert expressions(few) == expressions(many)


def test_a_reservation_names_each_call_its_turns_prompts_name_at_most_twice() -> None:
    """Each call of an earlier turn a prompt names is written at most twice (the prompt
    holding it, the prompts asking about it again), each request id a few times (with the
    calls it holds, among the prompts the turn raises), never once per name: the most a
    turn's prompts may name takes well under 1 MiB. (Each was written eight times: 6,500
    names of long ids took a 15.7 MiB command, 7,000 were refused as too large.)"""
    from scripts.reservation_bounds import long_id, naming_prompts

    names = MAX_TURN_NAMED_CALLS
    command = reservation_command([{"role": "user", "content": "go"}, *naming_prompts(names)])
    assert max(command.count(long_id("earlier", i).encode()) for i in range(names)) <= 2
    assert command.count(long_id("r", 0).encode()) <= 3
    assert len(command) < 2**20


def test_the_reservation_of_the_largest_turn_allowed_stays_far_below_16_mib() -> None:
    """1,000 messages making 10,000 calls, prompts naming the most calls of earlier turns a
    turn may, the rest denying calls, every id as long as it may be: under 8 MiB, half what
    MongoDB takes (`python -m scripts.reservation_bounds` measures the command as sent)."""
    from scripts.reservation_bounds import largest_turn

    assert len(reservation_command(largest_turn())) < 8 * 2**20


def reservation_pipeline(messages: list[dict[str, Any]], runtime_name: str | None) -> list[Any]:
    """The update pipeline of a turn's reservation on a conversation that lists pending blocks."""
    from agent_store.store._reservation import Actor, reservation
    from agent_store.store._turns import TurnRules, plan_turn

    plan = plan_turn(CID, messages, turn_id="t-1")
    return reservation(plan, Actor("u-1"), runtime_name, TurnRules(), datetime.now(UTC))


RESERVED_TURNS: dict[str, list[dict[str, Any]]] = {
    "plain": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    "answered in the turn": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [{"id": "c-1", "function": {"name": "f"}}]},
        {"role": "tool", "tool_call_id": "c-1", "content": "ok"},
    ],
    "answering earlier calls": [
        {"role": "tool", "tool_call_id": "c-0", "content": "ok"},
        {"role": "tool", "tool_call_id": "c-2", "content": "ok"},
    ],
    "leaving a call open": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [{"id": "c-3", "function": {"name": "f"}}]},
    ],
}


def parts(value: Any) -> list[str]:
    """Every object and array of `value` holding ten operands or more, as canonical JSON."""
    found: list[str] = []
    if isinstance(value, dict | list):
        inner = list(value.values()) if isinstance(value, dict) else value
        if nodes(value) >= 10:
            found.append(json.dumps(value, sort_keys=True, default=str))
        for item in inner:
            found += parts(item)
    return found


@pytest.mark.parametrize("runtime_name", [None, "bot"])
@pytest.mark.parametrize("shape", sorted(RESERVED_TURNS))
def test_a_reservation_is_two_stages_and_builds_its_pending_blocks_once(
    shape: str, runtime_name: str | None
) -> None:
    """A turn's reservation is two `$set` stages whatever the turn (its own fields, then those
    computed from them: each stage costs the server a pass over the document), and the
    pending blocks it keeps are built once (`$let`), never written twice in the expression
    (the list was built once to count it and again to keep it, and the blocks listed filtered
    twice: 245 of a reservation's 689 nodes)."""
    pipeline = reservation_pipeline(RESERVED_TURNS[shape], runtime_name)
    assert [list(stage) for stage in pipeline] == [["$set"], ["$set"]]
    blocks = pipeline[0]["$set"]["pending_blocks"]
    assert [n for n in Counter(parts(blocks)).values() if n > 1] == []
    assert nodes(blocks) < 150
