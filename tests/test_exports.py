"""Exports replay: every Chat Completions history keeps the API's pairing rules."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_store import (
    AgentMessageLogger,
    Conflict,
    ConversationExport,
    ConversationStore,
    InvalidInput,
    StorageUnavailable,
    TurnRules,
)
from agent_store.core import (
    DENIED_RESULT,
    INTERRUPTED_RESULT,
    PENDING_RESULT,
    AgentMessage,
    messages_adapter,
    stand_in_result,
)
from agent_store.integrations.exports import (
    chat_completions,
    chat_completions_problems,
    check_chat_completions,
    responses_items,
    user_jsonl,
)
from agent_store.store import EXPORT_READS
from app.examples import EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID, example_turns
from tests.api_harness import auth_headers, hitl_turn, serve
from tests.conftest import Backend, after_its_first_batch

CALL_IDS = ["c1", "c2", "c3", "c4"]
NOW = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
TOOLS = ["get_weather", "book"]


def example_messages() -> list[AgentMessage]:
    return messages_adapter.validate_python([m for _, turn in example_turns() for m in turn])


def test_example_conversation_exports_to_plain_chat_completions() -> None:
    exported = chat_completions(example_messages())

    check_chat_completions(exported)
    assert {key for m in exported for key in m} <= {"role", "content", "tool_calls", "tool_call_id"}
    # The error-only answer of turn 3 is not there: the model never said it.
    roles = ["user", "assistant", "tool", "tool", "assistant", "user", "assistant", "tool"]
    assert [m["role"] for m in exported] == [*roles, "assistant", "user", "system"]
    assert exported[0]["content"] == "What's the weather in Paris and in Lyon?"


def test_trailing_result_is_moved_right_after_its_call_and_orphans_are_left_out() -> None:
    stored = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "a", "function": {"name": "get_weather", "arguments": "{}"}},
                {"id": "b", "function": {"name": "get_weather", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "18"},
        {"role": "assistant", "content": "Paris 18."},
        {"role": "tool", "tool_call_id": "b", "content": "21"},
        {"role": "tool", "tool_call_id": "nobody", "content": "?"},
    ]
    exported = chat_completions(stored)
    check_chat_completions(exported)
    assert [(m["role"], m.get("tool_call_id")) for m in exported] == [
        ("user", None), ("assistant", None), ("tool", "a"), ("tool", "b"), ("assistant", None),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("dangling", "calls", "results"),
    [("synthesize", ["a", "b"], ["18", PENDING_RESULT]), ("drop", ["a"], ["18"])],
)
def test_dangling_call_is_answered_by_a_marked_stand_in_or_dropped(
    dangling: Any, calls: list[str], results: list[str]
) -> None:
    stored = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "a", "function": {"name": "get_weather"}},
                {"id": "b", "function": {"name": "book"}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "18"},
    ]
    exported = chat_completions(stored, dangling=dangling)
    check_chat_completions(exported)
    assert [c["id"] for c in exported[1]["tool_calls"]] == calls
    assert [m["content"] for m in exported if m["role"] == "tool"] == results
    assert PENDING_RESULT.startswith("No result yet")


def test_assistant_left_with_no_call_and_no_text_is_dropped_whole() -> None:
    stored = [
        {"role": "user", "content": "Book"},
        {"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "book"}}]},
        {"role": "user", "content": "Hello?"},
    ]
    assert chat_completions(stored, dangling="drop") == [
        {"role": "user", "content": "Book"},
        {"role": "user", "content": "Hello?"},
    ]


@pytest.mark.parametrize(
    ("history", "problem"),
    [
        pytest.param(
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        _c := {
                            "id": "a",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                }
            ],
            "at the end: tool calls ['a'] are left unanswered",
            id="unanswered",
        ),
        pytest.param(
            [
                {"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "a", "content": ""},
            ],
            "message 1: tool message for 'a' answers no call of the assistant message right",
            id="tool-without-call",
        ),
        pytest.param(
            [
                {"role": "assistant", "content": None, "tool_calls": [_c]},
                {"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "a", "content": ""},
            ],
            "before message 1: tool calls ['a'] are left unanswered",
            id="answer-after-another-message",
        ),
        pytest.param(
            [
                {"role": "assistant", "content": None, "tool_calls": [_c]},
                {"role": "tool", "tool_call_id": "a", "content": "1"},
                {"role": "tool", "tool_call_id": "a", "content": "2"},
            ],
            "message 2: tool call 'a' is answered twice",
            id="answered-twice",
        ),
        pytest.param(
            [{"role": "user", "content": "hi", "seq": 0}],
            "message 0: keys the API does not take: ['seq']",
            id="extension-left-in",
        ),
    ],
)
def test_checker_names_each_broken_pairing_rule(history: list[Any], problem: str) -> None:
    assert any(problem in found for found in chat_completions_problems(history))
    with pytest.raises(InvalidInput, match=re.escape(problem)):
        check_chat_completions(history)


def test_unknown_dangling_option_is_refused() -> None:
    with pytest.raises(InvalidInput, match="invalid dangling 'keep'"):
        chat_completions([], dangling="keep")  # type: ignore[arg-type]


# -- generated conversations ----------------------------------------------------------

call = st.fixed_dictionaries(
    {
        "id": st.sampled_from(CALL_IDS),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(TOOLS), "arguments": st.sampled_from(["{}", '{"x":1}'])}
        ),
    }
)
message = st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, st.sampled_from(["hi", "more"])),
    st.just({"role": "system", "content": "Be brief."}),
    st.builds(lambda t: {"role": "assistant", "content": t}, st.sampled_from(["ok", ""])),
    st.builds(
        lambda calls, text: {"role": "assistant", "content": text, "tool_calls": calls},
        st.lists(call, min_size=1, max_size=3, unique_by=lambda c: c["id"]),
        st.sampled_from([None, "Checking."]),
    ),
    st.builds(
        lambda i, n: {"role": "tool", "tool_call_id": i, "content": f"result {n}"},
        st.sampled_from(CALL_IDS),
        st.integers(0, 99),
    ),
    st.builds(lambda i: stand_in_result(i, NOW).model_dump(), st.sampled_from(CALL_IDS)),
    st.just({"role": "assistant", "error": {"message": "boom"}}),
    st.just({"role": "assistant", "hitl_action": {"action": "confirm", "request_id": "r1"}}),
)
conversations = st.lists(message, max_size=14)


def real_answers(stored: list[dict[str, Any]]) -> int:
    """How many calls a real stored result answers: the latest earlier call of its id that
    nothing answered yet, else the latest (a stand-in counts as an answer until replaced)."""
    made: dict[str, list[int]] = {}
    answered: dict[tuple[int, str], bool] = {}  # call -> answered by a real result
    for index, m in enumerate(stored):
        for c in m.get("tool_calls") or ():
            made.setdefault(c["id"], []).append(index)
        if m["role"] == "tool" and m["tool_call_id"] in made:
            i = m["tool_call_id"]
            at = next((n for n in reversed(made[i]) if (n, i) not in answered), made[i][-1])
            answered[(at, i)] = answered.get((at, i), False) or m.get("error") is None
    return sum(answered.values())


@settings(max_examples=300, deadline=None)
@given(conversations, st.sampled_from(["synthesize", "drop"]))
def test_every_generated_conversation_exports_to_a_history_that_replays(
    stored: list[dict[str, Any]], dangling: Any
) -> None:
    exported = chat_completions(stored, dangling=dangling)

    assert chat_completions_problems(exported) == []
    tool_contents = [m["content"] for m in exported if m["role"] == "tool"]
    real = [c for c in tool_contents if c not in (PENDING_RESULT, INTERRUPTED_RESULT)]
    assert len(real) == real_answers(stored)  # no real result lost or hidden, none invented
    stored_calls = sum(len(m.get("tool_calls") or ()) for m in stored)
    exported_calls = sum(len(m.get("tool_calls", ())) for m in exported)
    if dangling == "synthesize":
        assert exported_calls == stored_calls
    else:
        assert PENDING_RESULT not in tool_contents
        assert exported_calls == len([c for c in tool_contents if c != PENDING_RESULT])


@settings(max_examples=200, deadline=None)
@given(conversations)
def test_every_function_call_item_is_followed_by_its_one_output(
    stored: list[dict[str, Any]],
) -> None:
    items = responses_items(stored)

    assert {i["type"] for i in items} <= {"message", "function_call", "function_call_output"}
    called: list[str] = []
    for item in items:
        if item["type"] == "function_call":
            called.append(item["call_id"])
        elif item["type"] == "function_call_output":
            assert item["call_id"] in called
    outputs = [i["call_id"] for i in items if i["type"] == "function_call_output"]
    assert sorted(outputs) == sorted(called)
    assert len(set(called)) == len(called)


async def test_user_jsonl_holds_every_conversation_and_message_of_the_user(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for turn_id, turn in example_turns():
        await logger.log_messages(
            EXAMPLE_CONVERSATION_ID, turn, user_id=EXAMPLE_USER_ID, turn_id=turn_id
        )
    await logger.log_messages(
        "conv-2", [{"role": "user", "content": "Hi"}], user_id=EXAMPLE_USER_ID
    )
    await logger.log_messages("conv-x", [{"role": "user", "content": "Not mine"}], user_id="other")

    lines = [json.loads(line) async for line in user_jsonl(store, EXAMPLE_USER_ID)]

    conversations = [line["conversation"]["_id"] for line in lines if "conversation" in line]
    assert sorted(conversations) == sorted([EXAMPLE_CONVERSATION_ID, "conv-2"])
    messages = [line["message"] for line in lines if "message" in line]
    assert len(messages) == 13
    assert all(m["user_id"] == EXAMPLE_USER_ID for m in messages)
    assert messages_adapter.validate_python(messages)  # every stored field, loadable again


def test_an_assistant_message_left_with_no_text_once_its_calls_are_dropped_is_left_out() -> None:
    stored = [
        {"role": "user", "content": "Book"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "x", "function": {"name": "b"}}],
        },
        {"role": "user", "content": "Hello?"},
    ]
    exported = chat_completions(stored, dangling="drop")
    assert exported == [{"role": "user", "content": "Book"}, {"role": "user", "content": "Hello?"}]
    assert responses_items(stored, dangling="drop") == [
        {"type": "message", "role": "user", "content": "Book"},
        {"type": "message", "role": "user", "content": "Hello?"},
    ]


@pytest.mark.parametrize(
    ("change", "left"),
    [("deleted", ["c-1", "c-3"]), ("claimed away", ["c-1"]), ("started again", ["c-1", "c-3"])],
)
async def test_export_user_leaves_out_a_conversation_gone_before_its_turn_and_goes_on(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, change: str, left: list[str]
) -> None:
    """Listed, then deleted, claimed to another account (with the others after it), or
    deleted and started again before the export reads it: it is not in the export, which
    holds the others whole, each of one life."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(0)))
    for cid in ("c-1", "c-2", "c-3"):
        await logger.log_messages(cid, [{"role": "user", "content": cid}], user_id="carol")

    async def meanwhile(read_first: str) -> None:
        assert read_first == "c-1"
        if change == "claimed away":
            await store.claim("carol", "carol-new-account")
            return
        await store.delete("c-2")
        if change == "started again":
            said = [{"role": "user", "content": "NEW"}]
            await logger.log_messages("c-2", said, user_id="carol")

    after_its_first_batch(monkeypatch, store, meanwhile)
    exported = [e async for e in store.export_user("carol", full=True)]

    assert [e.conversation.id for e in exported] == left
    assert [m.content for e in exported for m in e.messages] == left


@pytest.mark.parametrize("full", [False, True])
async def test_export_user_holds_each_conversations_messages_as_its_summary_counts_them(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, full: bool
) -> None:
    """API.md: each conversation is the one listed, with its messages. A turn logged after the
    export listed it, before its messages are read, is not in it: the body holds what the
    summary counts (`message_count` is the next `seq`), never more."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for cid in ("c-1", "c-2"):
        await logger.log_messages(cid, [{"role": "user", "content": cid}], user_id="carol")
    listed_then_read = store.stream_transcript

    def meanwhile(conversation_id: str, **kwargs: Any) -> Any:
        async def late_turn_first() -> Any:
            said = [{"role": "user", "content": "late"}, {"role": "assistant", "content": "!"}]
            await logger.log_messages(conversation_id, said, user_id="carol")
            async for batch in listed_then_read(conversation_id, **kwargs):
                yield batch

        return late_turn_first()

    monkeypatch.setattr(store, "stream_transcript", meanwhile)
    exported = [e async for e in store.export_user("carol", full=full)]

    assert sorted(e.conversation.id for e in exported) == ["c-1", "c-2"]
    for export in exported:
        assert [m.content for m in export.messages] == [export.conversation.id]
        assert export.conversation.message_count == len(export.messages) == 1
    assert len(await store.transcript("c-1")) == 3  # the late turns are stored


def before_each_read(
    monkeypatch: pytest.MonkeyPatch,
    store: ConversationStore,
    change: Callable[[str], Awaitable[Any]],
    *,
    reads: int = 1,
) -> None:
    """Run `change(conversation_id)` as each of the first `reads` streamed reads of a
    conversation begins: after the export listed it, before its messages are read."""
    read, begun = store.stream_transcript, Counter[str]()

    def changed_first(conversation_id: str, **kwargs: Any) -> Any:
        async def batches() -> Any:
            begun[conversation_id] += 1
            if begun[conversation_id] <= reads:
                await change(conversation_id)
            async for batch in read(conversation_id, **kwargs):
                yield batch

        return batches()

    monkeypatch.setattr(store, "stream_transcript", changed_first)


def turn_of(name: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"q {name}"}, {"role": "assistant", "content": f"a {name}"}]


POPS_AFTER_LISTING = ["pop", "pop a whole turn", "pop the prompt", "pop and log again"]


async def popped_after_listing(
    monkeypatch: pytest.MonkeyPatch, logger: AgentMessageLogger, store: ConversationStore, pop: str
) -> None:
    """carol's `c-1`, three turns (the last a prompt, to `pop the prompt`), popped as `pop`
    says once the export listed it, before its messages are read."""
    last = hitl_turn("confirm-1") if pop == "pop the prompt" else turn_of("t-2")
    for turn_id, said in (("t-0", turn_of("t-0")), ("t-1", turn_of("t-1")), ("t-2", last)):
        await logger.log_messages("c-1", said, user_id="carol", turn_id=turn_id)

    async def popped(conversation_id: str) -> None:
        for _ in range(2 if pop == "pop a whole turn" else 1):
            await store.pop_last_message(conversation_id)
        if pop == "pop and log again":
            await logger.log_messages("c-1", turn_of("t-3"), user_id="carol", turn_id="t-3")

    before_each_read(monkeypatch, store, popped)


async def as_it_stands(store: ConversationStore, conversation_id: str) -> dict[str, Any]:
    """The conversation and its messages as they are read now, as an export serves them."""
    conversation = await store.get_conversation(conversation_id)
    messages = await store.transcript(conversation_id)
    export = ConversationExport(conversation=conversation, messages=messages)
    return export.model_dump(mode="json", by_alias=True)


def holds_for_its_messages(export: dict[str, Any]) -> bool:
    """Whether an exported summary counts the messages it comes with, and its prompt pending
    is one of them."""
    summary, messages = export["conversation"], export["messages"]
    prompt = (summary.get("pending_hitl") or {}).get("message_id")
    return (
        summary["message_count"] == len(messages)
        and summary["turn_count"] == len({m["turn_id"] for m in messages})
        and prompt in {None, *(m["_id"] for m in messages)}
    )


@pytest.mark.parametrize("pop", POPS_AFTER_LISTING)
async def test_export_user_pairs_a_conversation_popped_after_listing_with_its_summary_since(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, pop: str
) -> None:
    """API.md: the summary holds for the messages it comes with. A pop after the export
    listed the conversation, before its messages are read (a regenerated answer, maybe
    logged again at once): the conversation comes as it is after the pop, with its messages
    then, never with a summary counting a popped message or naming a popped prompt."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await popped_after_listing(monkeypatch, logger, store, pop)

    exported = [e.model_dump(mode="json", by_alias=True) async for e in store.export_user("carol")]

    assert exported == [await as_it_stands(store, "c-1")]
    assert holds_for_its_messages(exported[0])
    if pop == "pop the prompt":
        assert exported[0]["conversation"]["pending_hitl"] is None


async def test_export_user_refuses_a_conversation_popped_at_each_of_its_reads(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Popped again before each read, it never holds still long enough to pair a summary
    with its messages: `Conflict` after `EXPORT_READS` reads, rather than a summary that
    does not hold for them."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for turn_id in ("t-0", "t-1", "t-2"):
        await logger.log_messages("c-1", turn_of(turn_id), user_id="carol", turn_id=turn_id)

    async def popped(conversation_id: str) -> None:
        await store.pop_last_message(conversation_id)

    before_each_read(monkeypatch, store, popped, reads=EXPORT_READS)

    with pytest.raises(Conflict, match="popped while it was exported"):
        [e async for e in store.export_user("carol")]
    assert len(await store.transcript("c-1")) == 6 - EXPORT_READS


async def writing_after_two_turns(
    monkeypatch: pytest.MonkeyPatch, backend: Backend, turn_id: str, *, stored: int = 2
) -> tuple[asyncio.Event, asyncio.Task[Any]]:
    """carol's `c-1` with two turns stored (or `stored`) and one more, `turn_id` (a prompt for
    "prompt"), by another writer, its block reserved and its insert waiting for the event
    returned (a writer between its two steps): the summary counts it already."""
    logger, writer = AgentMessageLogger(backend.db), AgentMessageLogger(backend.db)
    for n in range(stored):
        said = turn_of(f"t-{n}")
        await logger.log_messages("c-1", said, user_id="carol", turn_id=f"t-{n}")
    insert_many, reserved, go = writer._messages.insert_many, asyncio.Event(), asyncio.Event()

    async def stalled(*args: Any, **kwargs: Any) -> Any:
        reserved.set()
        await go.wait()
        return await insert_many(*args, **kwargs)

    monkeypatch.setattr(writer._messages, "insert_many", stalled)
    said = hitl_turn("confirm-mid") if turn_id == "prompt" else turn_of(turn_id)
    turn = asyncio.create_task(writer.log_messages("c-1", said, user_id="carol", turn_id=turn_id))
    await reserved.wait()
    return go, turn


@pytest.mark.parametrize("turn_id", ["t-2", "prompt"])
async def test_export_user_pairs_a_turn_still_being_written_once_it_is_stored(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, turn_id: str
) -> None:
    """API.md: the summary holds for the messages it comes with. A turn's reservation counts
    it (messages, turn, usage, preview, its prompt pending) before its insert: an export
    meeting the hole it still writes reads the conversation again, and pairs it once stored."""
    go, turn = await writing_after_two_turns(monkeypatch, backend, turn_id)
    store = ConversationStore(backend.db)

    reads = Counter[str]()

    async def stored_by_the_second_read(conversation_id: str) -> None:
        reads[conversation_id] += 1
        if reads[conversation_id] == 2:
            go.set()
            await turn

    before_each_read(monkeypatch, store, stored_by_the_second_read, reads=EXPORT_READS)

    exported = [e.model_dump(mode="json", by_alias=True) async for e in store.export_user("carol")]

    assert exported == [await as_it_stands(store, "c-1")]
    assert holds_for_its_messages(exported[0])
    assert exported[0]["conversation"]["message_count"] == 6
    assert reads["c-1"] == 2


async def test_export_user_slower_than_abandon_after_between_its_reads_pairs_the_turn_landed(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3: a block is passed only if it was older than `abandon_after` when the
    messages were read. The turn lands after the export read its first batch and before its
    lookup of the conversation, the export's clock then past `abandon_after` (2 s; faked 3 s
    on): it reads the conversation again and pairs the summary with the turn's messages."""
    go, turn = await writing_after_two_turns(monkeypatch, backend, "t-2")
    store = ConversationStore(backend.db, rules=TurnRules(abandon_after=timedelta(seconds=2)))
    looked_up = store._as_it_stands

    async def slow_lookup(*args: Any) -> Any:
        go.set()
        await turn
        later = datetime.now(UTC) + timedelta(seconds=3)
        monkeypatch.setattr("agent_store.store._reads.utc_now", lambda: later)
        return await looked_up(*args)

    monkeypatch.setattr(store, "_as_it_stands", slow_lookup)

    exported = [e.model_dump(mode="json", by_alias=True) async for e in store.export_user("carol")]

    assert len(exported[0]["messages"]) == 6
    assert holds_for_its_messages(exported[0])


@pytest.mark.parametrize("stored", [2, 20], ids=["in its first batch", "past its first batch"])
async def test_export_user_refuses_a_conversation_whose_turn_is_written_through_its_reads(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, stored: int
) -> None:
    """A turn still being written at each of the `EXPORT_READS` reads (its writer slow, or
    dead, younger than `abandon_after`): StorageUnavailable (retry later) before anything of
    the conversation is sent, never its summary with messages that lack the turn."""
    go, turn = await writing_after_two_turns(monkeypatch, backend, "t-x", stored=stored)
    store = ConversationStore(backend.db)
    exports = store.stream_user_exports("carol")

    with pytest.raises(StorageUnavailable, match="still being written"):
        await anext(exports)

    go.set()
    await turn
    exported = [e.model_dump(mode="json", by_alias=True) async for e in store.export_user("carol")]
    assert exported == [await as_it_stands(store, "c-1")]


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("stored", [0, 2, 15], ids=["a new conversation", "two turns", "15 turns"])
async def test_export_user_reads_again_a_turn_stored_between_its_last_batch_and_its_lookup(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, stored: int, full: bool
) -> None:
    """API.md: never its summary with messages that lack the turn. A turn the summary counts,
    not stored yet when the export's first batch (its last: the conversation fits in one)
    was read, and stored by the export's lookup of the conversation, is read again: the
    conversation comes with the turn's messages, as its summary counts them."""
    go, turn = await writing_after_two_turns(monkeypatch, backend, "t-x", stored=stored)
    store = ConversationStore(backend.db)
    looked_up = store._as_it_stands

    async def landed_before_the_lookup(*args: Any) -> Any:
        if not go.is_set():
            go.set()
            await turn
        return await looked_up(*args)

    monkeypatch.setattr(store, "_as_it_stands", landed_before_the_lookup)

    exported = [
        e.model_dump(mode="json", by_alias=True)
        async for e in store.export_user("carol", full=full)
    ]

    assert exported == [await as_it_stands(store, "c-1")]
    assert holds_for_its_messages(exported[0])
    assert exported[0]["conversation"]["message_count"] == 2 * stored + 2


async def test_export_user_passes_a_block_older_than_abandon_after(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block its turn reserved longer than `abandon_after` ago is passed, as message pages
    pass it: the export goes on, what is stored of the conversation comes with it."""
    _, turn = await writing_after_two_turns(monkeypatch, backend, "t-2")
    store = ConversationStore(backend.db, rules=TurnRules(abandon_after=timedelta(0)))

    exported = [e async for e in store.export_user("carol")]

    assert [m.content for m in exported[0].messages] == ["q t-0", "a t-0", "q t-1", "a t-1"]
    turn.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await turn


# -- the same rules through `GET /v1/users/{id}/export` --------------------------------------


async def exported_lines(api: Any, export_format: str) -> list[dict[str, Any]]:
    """carol's export through the route, as its `ConversationExport` objects."""
    response = await api.http.get(
        "/v1/users/carol/export", params={"format": export_format}, headers=auth_headers()
    )
    assert response.status_code == 200
    if export_format == "jsonl":
        return [json.loads(line) for line in response.text.splitlines()]
    document: dict[str, Any] = response.json()
    return list(document["conversations"])


@pytest.mark.parametrize("export_format", ["jsonl", "json"])
@pytest.mark.parametrize("late", ["turn", "prompt"])
async def test_the_export_route_holds_each_conversations_messages_as_its_summary_counts_them(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, export_format: str, late: str
) -> None:
    """The route's twin of `test_export_user_holds_each_conversations_messages_as_its_summary_
    counts_them`: a turn (or a prompt) logged after the export listed the conversation,
    before its messages are read, is not in it, nor in its summary."""
    async with serve(backend.db, seeded=False) as api:
        logger, store = api.store.logger, api.store.conversations
        for cid in ("c-1", "c-2"):
            await logger.log_messages(cid, [{"role": "user", "content": cid}], user_id="carol")

        async def late_turn(conversation_id: str) -> None:
            said = hitl_turn(f"confirm-{conversation_id}") if late == "prompt" else turn_of("late")
            await logger.log_messages(conversation_id, said, user_id="carol")

        before_each_read(monkeypatch, store, late_turn)
        exported = await exported_lines(api, export_format)

        assert sorted(e["conversation"]["_id"] for e in exported) == ["c-1", "c-2"]
        for export in exported:
            assert [m["content"] for m in export["messages"]] == [export["conversation"]["_id"]]
            assert export["conversation"]["message_count"] == 1
            assert export["conversation"]["pending_hitl"] is None
        assert len(await store.transcript("c-1")) == 3  # the late turns are stored


@pytest.mark.parametrize("export_format", ["jsonl", "json"])
async def test_the_export_route_answers_503_for_a_turn_written_through_its_reads(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, export_format: str
) -> None:
    """The route's twin of `test_export_user_refuses_a_conversation_whose_turn_is_written_
    through_its_reads`: a 503 to retry, before any byte of the export, never a summary
    counting a turn its messages lack."""
    async with serve(backend.db, seeded=False) as api:
        go, turn = await writing_after_two_turns(monkeypatch, backend, "t-2")

        response = await api.http.get(
            "/v1/users/carol/export", params={"format": export_format}, headers=auth_headers()
        )

        assert response.status_code == 503
        assert "still being written" in response.text
        go.set()
        await turn
        exported = await exported_lines(api, export_format)
        assert holds_for_its_messages(exported[0])
        assert exported[0]["conversation"]["message_count"] == 6


@pytest.mark.parametrize("export_format", ["jsonl", "json"])
@pytest.mark.parametrize("pop", POPS_AFTER_LISTING)
async def test_the_export_route_pairs_a_conversation_popped_after_listing_with_its_summary_since(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, export_format: str, pop: str
) -> None:
    """The route's twin of `test_export_user_pairs_a_conversation_popped_after_listing_…`."""
    async with serve(backend.db, seeded=False) as api:
        store = api.store.conversations
        await popped_after_listing(monkeypatch, api.store.logger, store, pop)

        exported = await exported_lines(api, export_format)

        assert exported == [await as_it_stands(store, "c-1")]
        assert holds_for_its_messages(exported[0])


_BOOK_AND_QUOTE = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "book", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "quote", "arguments": "{}"}},
    ],
}


async def test_a_tool_result_stored_as_only_an_error_is_replayed_as_a_failure_with_its_reason(
    backend: Backend,
) -> None:
    """A result with no text and an error did not succeed: the replay says so, never an empty
    output the model reads as success. The denial marker reads as the library's own denial."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    said = [
        {"role": "user", "content": "Book it"},
        _BOOK_AND_QUOTE,
        {"role": "tool", "tool_call_id": "a", "content": None,
         "error": {"message": "tool call denied"}},
        {"role": "tool", "tool_call_id": "b", "content": None,
         "error": {"message": "upstream timeout"}},
    ]  # fmt: skip
    await logger.log_messages("c", said, user_id="u", turn_id="t1")
    stored = await store.transcript("c")

    results = [(m["tool_call_id"], m["content"]) for m in chat_completions(stored)[2:]]
    assert results == [("a", DENIED_RESULT), ("b", "The tool call failed: upstream timeout")]
    outputs = [(i["call_id"], i["output"]) for i in responses_items(stored)[-2:]]
    assert outputs == results


async def test_a_user_message_with_an_upload_and_only_hidden_context_replays_as_the_file_note(
    backend: Backend,
) -> None:
    """Stored with no text once its runtime context was removed, an upload still tells the
    model which file it sent, in both formats."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    upload = {"filename": "invoice.pdf", "file_type": "application/pdf", "size": 10}
    said = [{"role": "user", "content": "[RUNTIME CONTEXT] tz=UTC [/RUNTIME CONTEXT]",
             "upload": upload}]  # fmt: skip
    await logger.log_messages("c", said, user_id="u", turn_id="t1")
    stored = await store.transcript("c")

    note = "[uploaded invoice.pdf (application/pdf)]"
    assert [m.content for m in stored] == [""]
    assert chat_completions(stored) == [{"role": "user", "content": note}]
    assert responses_items(stored) == [{"type": "message", "role": "user", "content": note}]
    assert chat_completions(said) == [{"role": "user", "content": note}]  # not from the store


@pytest.mark.parametrize(
    ("content", "error", "replayed"),
    [
        (None, "tool call denied: user_rejected", DENIED_RESULT),
        (None, "tool call interrupted", INTERRUPTED_RESULT),
        (None, "tool call failed", "The tool call failed."),
        (None, "tool call failed: ValueError", "The tool call failed: ValueError"),
        (None, "tool call retried: model_retry", "The tool call failed: model_retry"),
        ("", "upstream timeout", "The tool call failed: upstream timeout"),
        ("no seats left", "tool call failed", "no seats left"),  # the text the model was shown
        ("", None, ""),  # an empty success stays one
    ],
)
def test_a_tool_result_replays_its_text_or_what_its_error_says(
    content: str | None, error: str | None, replayed: str
) -> None:
    answer: dict[str, Any] = {"role": "tool", "tool_call_id": "a", "content": content}
    answer |= {"error": {"message": error}} if error else {}
    stored = [{"role": "user", "content": "Book it"}, _BOOK_AND_QUOTE, answer]

    exported = chat_completions(stored, dangling="drop")
    check_chat_completions(exported)
    assert exported[2] == {"role": "tool", "tool_call_id": "a", "content": replayed}
    assert responses_items(stored, dangling="drop")[-1]["output"] == replayed


@pytest.mark.parametrize("change", ["pop", "delete"])
async def test_a_full_export_never_serves_a_text_cut_whose_whole_text_went_after_its_lookup(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """With `full`, cut fields come whole: a conversation popped (or deleted) between the
    export's lookup and its read of the whole texts is read again as it stands then, never
    served with the popped message's text still cut."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(max_message_bytes=4096))
    for n in range(2):
        turn = [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": "z" * 9000}]
        await logger.log_messages("c-1", turn, user_id="carol", turn_id=f"t{n}")
    store, other = ConversationStore(backend.db), ConversationStore(backend.db)
    looked_up, changed = store._as_it_stands, []

    async def then_changed(*args: Any) -> Any:
        found = await looked_up(*args)
        if not changed and change == "pop":
            changed.append(await other.pop_last_message("c-1", user_id="carol"))
        elif not changed:
            changed.append(await other.delete("c-1", user_id="carol"))
        return found

    monkeypatch.setattr(store, "_as_it_stands", then_changed)
    exports = [e async for e in store.export_user("carol", full=True)]

    assert changed
    served = [m.content for e in exports for m in e.messages]
    assert served == (["q0", "z" * 9000, "q1"] if change == "pop" else [])
