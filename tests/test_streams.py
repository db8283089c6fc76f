"""Recorded streams of both protocols become the expected turns, and are stored replay-safe."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from agent_store import (
    AgentMessageLogger,
    Conflict,
    ConversationStore,
    InvalidInput,
    LegacyTurns,
    LoggedTurn,
    NotFound,
    TurnRules,
)
from agent_store.core import MAX_CALL_ID_CHARS, PendingCall, TokenUsage, messages_adapter
from agent_store.integrations.exports import chat_completions, check_chat_completions
from agent_store.integrations.streams import (
    StreamedTurn,
    log_streamed_turn,
    parse_sse_text,
    turn_from_metadata,
    turn_from_sse,
)
from agent_store.legacy import LEGACY_TURNS, SESSION_HITL
from agent_store.store import CONVERSATIONS, MIGRATING, RuntimeContextMarkers
from app.examples import EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID, example_legacy_turns
from tests.api_harness import hitl_turn
from tests.conftest import Backend

STREAMS = Path(__file__).parent / "streams"
RECEIVED_AT = datetime(2026, 3, 2, 9, 0, 10, tzinfo=UTC)
CID = "conv-stream"


def recorded(name: str) -> StreamedTurn:
    """Build the turn of a recorded stream file (`.sse` body or `.jsonl` metadata events)."""
    path = next(STREAMS.glob(f"{name}.*[!n]"))  # the stream, not its .expected.json
    if path.suffix == ".sse":
        return turn_from_sse(parse_sse_text(path.read_text()), received_at=RECEIVED_AT)
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    complete = expected_of(name)["complete"]
    return turn_from_metadata(events, complete=complete, received_at=RECEIVED_AT)


def expected_of(name: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((STREAMS / f"{name}.expected.json").read_text())
    return result


def comparable(messages: Any) -> list[dict[str, Any]]:
    validated = messages_adapter.validate_python(
        [m if isinstance(m, dict) else m.model_dump(by_alias=True) for m in messages]
    )
    return [m.model_dump(mode="json", exclude={"created_at"}) for m in validated]


async def log_recorded(
    logger: AgentMessageLogger, store: ConversationStore, name: str, prompt: str
) -> LoggedTurn:
    return await log_streamed_turn(
        logger=logger,
        store=store,
        conversation_id=CID,
        turn=recorded(name),
        turn_id="turn-1",
        prompt=prompt,
    )


CASES = sorted(p.name.removesuffix(".expected.json") for p in STREAMS.glob("*.expected.json"))


@pytest.mark.parametrize("name", CASES)
def test_recorded_stream_builds_the_expected_turn(name: str) -> None:
    turn, expected = recorded(name), expected_of(name)

    assert comparable(turn.messages) == comparable(expected["messages"])
    assert turn.interrupted is expected["interrupted"]
    assert list(turn.resolved_request_ids) == expected["resolved_request_ids"]


@pytest.mark.parametrize("name", CASES)
def test_every_recorded_turn_replays_without_repair(name: str) -> None:
    turn = recorded(name)
    exported = chat_completions(turn.messages, dangling="drop")
    check_chat_completions(exported)
    # Nothing needed dropping: every call the turn holds is answered in place.
    calls = [c for m in turn.messages for c in m.tool_calls or ()]
    assert sum(len(m.get("tool_calls", ())) for m in exported) == len(calls)


def test_trailing_result_keeps_its_own_time_but_sits_after_its_call() -> None:
    turn = recorded("sse_trailing_result")
    lyon = turn.messages[2]
    assert lyon.tool_call_id == "call_w2"
    assert lyon.created_at == datetime(2026, 3, 2, 9, 0, 5, tzinfo=UTC)
    assert turn.messages[0].created_at == datetime(2026, 3, 2, 9, 0, 1, tzinfo=UTC)
    assert turn.messages[-1].created_at == datetime(2026, 3, 2, 9, 0, 3, tzinfo=UTC)


@pytest.mark.parametrize(
    ("events", "problem"),
    [
        pytest.param(
            [{"type": "tool_result", "tool_call_id": "ghost", "result": 1}],
            "a tool result answers 'ghost', which is no call of this turn",
            id="result-without-call",
        ),
        pytest.param(
            [
                {"type": "tool_call", "tool_call_id": "c", "tool_name": "f"},
                {"type": "tool_call", "tool_call_id": "c", "tool_name": "f"},
            ],
            "tool call id 'c' is used twice",
            id="repeated-call-id",
        ),
        pytest.param([{"type": "telepathy"}], "telepathy", id="unknown-event"),
        pytest.param([{"type": "tool_call", "tool_name": "f"}], "tool_call_id", id="missing-id"),
    ],
)
def test_a_malformed_stream_is_refused_naming_the_problem(
    events: list[dict[str, Any]], problem: str
) -> None:
    with pytest.raises(InvalidInput, match=re.escape(problem)):
        turn_from_sse(events)


def test_sse_body_with_data_that_is_not_json_is_refused() -> None:
    with pytest.raises(InvalidInput, match="event 1 has data that is not JSON"):
        parse_sse_text("event: text_delta\ndata: {oops\n\n")


async def test_denied_confirmation_is_stored_and_leaves_nothing_pending(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)

    logged = await log_recorded(
        logger, store, "metadata_denied_confirmation", "Book me the 09:04 to Lyon."
    )

    assert [m.role for m in logged.messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "assistant",
    ]
    assert await store.pending_hitl(CID) is None
    stored = await store.transcript(CID)
    assert stored[3].hitl_action is not None
    check_chat_completions(chat_completions(stored))


async def test_unresolved_prompt_stays_pending_and_a_later_stream_resolves_it(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await log_recorded(logger, store, "sse_hitl_then_error", "Trains to Lyon?")
    pending = await store.pending_hitl(CID)
    assert pending is not None
    assert pending.request_id == "req-7"

    answer = turn_from_metadata(
        [
            {"type": "confirm_resolved", "request_id": "req-7", "approved": True},
            {"type": "stream_token", "token": "Booked."},
        ],
        complete=True,
    )
    for _ in range(2):  # a retry of the same turn changes nothing
        await log_streamed_turn(
            logger=logger, store=store, conversation_id=CID, turn=answer, turn_id="turn-2"
        )
    assert await store.pending_hitl(CID) is None
    assert len(await store.transcript(CID)) == 6


async def test_cut_off_stream_is_stored_marked_interrupted(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)

    await log_recorded(logger, store, "sse_cut_off", "Book it.")

    stored = await store.transcript(CID)
    assert stored[-1].error is not None
    assert stored[-1].error.message == "stream interrupted"
    assert stored[2].tool_call_id == "call_b1"
    check_chat_completions(chat_completions(stored, dangling="drop"))


@pytest.mark.parametrize(
    "turn",
    [
        pytest.param(
            lambda: turn_from_sse(
                parse_sse_text(
                    'event: tool_call\ndata: {"tool_call_id": "c1", "tool_name": "f", '
                    '"args": {"x": NaN}}\n\n'
                    'event: tool_result\ndata: {"tool_call_id": "c1", "result": "ok"}\n\n'
                    "event: done\ndata: {}\n\n"
                )
            ),
            id="sse-args-object",
        ),
        pytest.param(
            lambda: turn_from_metadata(
                [
                    {"type": "tool_start", "tool_name": "f", "tool_call_id": "c1",
                     "args": {"x": float("nan")}},
                    {"type": "tool_end", "tool_name": "f", "tool_call_id": "c1", "result": "ok"},
                ],
                complete=True,
            ),
            id="metadata-args",
        ),
    ],
)  # fmt: skip
async def test_a_calls_args_object_holding_nan_is_stored_as_the_same_args_as_a_string_are(
    backend: Backend, turn: Any
) -> None:
    """Python's json reads a model's `{"x": NaN}` as a float; as an object or as a string, the
    call's arguments are kept as JSON text, the turn neither refused nor changed."""
    store = ConversationStore(backend.db)
    await log_streamed_turn(
        logger=AgentMessageLogger(backend.db),
        store=store,
        conversation_id=CID,
        turn=turn(),
        turn_id="turn-1",
        prompt="look it up",
    )

    [call] = [m for m in await store.transcript(CID) if m.role == "assistant" and m.tool_calls]
    assert call.tool_calls is not None
    assert call.tool_calls[0].function.arguments == '{"x":NaN}'


@pytest.mark.parametrize("markers", [None, RuntimeContextMarkers("<<ctx>>", "<</ctx>>")])
async def test_runtime_context_in_the_prompt_of_a_streamed_turn_is_not_stored(
    backend: Backend, markers: RuntimeContextMarkers | None
) -> None:
    rules = TurnRules(markers=markers) if markers else TurnRules()
    logger, store = AgentMessageLogger(backend.db, rules=rules), ConversationStore(backend.db)
    hidden = f"{rules.markers.start}user_tier=gold{rules.markers.end}"

    await log_streamed_turn(
        logger=logger,
        store=store,
        conversation_id=CID,
        turn=recorded("sse_trailing_result"),
        turn_id="turn-1",
        prompt=f"{hidden}Weather in Paris and Lyon?",
    )

    stored = await store.transcript(CID)
    assert stored[0].content == "Weather in Paris and Lyon?"
    assert (await store.get_conversation(CID)).name == "Weather in Paris and Lyon?"


# -- SSE bodies as the SSE rules read them --------------------------------------------

COMPLETE_BLOCKS = (
    'event: text_delta\ndata: {"delta": "Booking the 09:04"}\n\n'
    'event: tool_call\ndata: {"tool_call_id": "call_b1", "tool_name": "book_train"}\n\n'
)


@pytest.mark.parametrize(
    "cut",
    [
        pytest.param('event: text_delta\ndata: {"delta": " TGV n', id="inside-json"),
        pytest.param('event: text_delta\ndata: {"delta": " TGV now"}\n', id="before-blank-line"),
        pytest.param(
            'event: done\ndata: {}\n\nevent: tool_result\ndata: {"tool_ca', id="after-done"
        ),
    ],
)
async def test_an_sse_body_cut_mid_event_is_stored_with_what_arrived_marked_interrupted(
    backend: Backend, cut: str
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)

    turn = turn_from_sse(parse_sse_text(COMPLETE_BLOCKS + cut), received_at=RECEIVED_AT)
    await log_streamed_turn(
        logger=logger, store=store, conversation_id=CID, turn=turn, turn_id="t1", prompt="Book"
    )

    assert turn.interrupted
    stored = await store.transcript(CID)
    assert stored[1].content == "Booking the 09:04"  # the unterminated block is not read
    assert stored[-1].error is not None
    assert stored[-1].error.message == "stream interrupted"


def test_sse_events_replayed_after_a_reconnect_are_read_once() -> None:
    body = (
        'id: 1\nevent: text_delta\ndata: {"delta": "Hello"}\n\n'
        'id: 2\nevent: text_delta\ndata: {"delta": " world"}\n\n'
        ": reconnected with Last-Event-ID: 1; the server sends 2 again\n"
        'id: 2\nevent: text_delta\ndata: {"delta": " world"}\n\n'
        "id: 3\nevent: done\ndata: {}\n\n"
    )
    turn = turn_from_sse(parse_sse_text(body))

    assert [m.content for m in turn.messages] == ["Hello world"]
    assert not turn.interrupted


def test_sse_events_given_as_dicts_are_deduplicated_by_their_id() -> None:
    delta = {"type": "text_delta", "delta": "Hi", "id": "e1"}
    turn = turn_from_sse([delta, delta, {"type": "done"}])
    assert [m.content for m in turn.messages] == ["Hi"]


def test_sse_events_sharing_an_id_with_other_content_are_each_read() -> None:
    """`id:` only sets the reconnect cursor: a server may give every event of a message the
    message's id. Ids that name no single event say nothing of replays: every event is read."""
    body = (
        'id: msg_1\nevent: text_delta\ndata: {"delta": "Let me check"}\n\n'
        'id: msg_1\nevent: tool_call\ndata: {"tool_call_id": "c1", "tool_name": "weather"}\n\n'
        'id: msg_1\nevent: tool_result\ndata: {"tool_call_id": "c1", "result": "18C"}\n\n'
        'id: msg_1\nevent: text_delta\ndata: {"delta": "It is 18C."}\n\n'
        "id: msg_1\nevent: done\ndata: {}\n\n"
    )
    turn = turn_from_sse(parse_sse_text(body))

    assert [m.content for m in turn.messages] == ["Let me check", "18C", "It is 18C."]
    assert not turn.interrupted


def test_an_empty_sse_id_line_gives_the_event_no_id() -> None:
    """An empty `id:` resets the reconnect cursor: such events are no replays of each other,
    whatever `id` their data holds (the `id:` line decides)."""
    delta = 'id:\nevent: text_delta\ndata: {"delta": "A", "id": "chunk-1"}\n\n'
    body = delta * 2 + "id:\nevent: done\ndata: {}\n\n"
    turn = turn_from_sse(parse_sse_text(body))

    assert [m.content for m in turn.messages] == ["AA"]
    assert not turn.interrupted


def test_the_sse_event_name_decides_the_type_over_a_type_in_the_data() -> None:
    body = 'event: text_delta\ndata: {"type": "error", "delta": "Hi"}\n\nevent: done\ndata: {}\n\n'
    turn = turn_from_sse(parse_sse_text(body))
    assert [(m.content, m.error) for m in turn.messages] == [("Hi", None)]


def test_a_second_done_event_keeps_the_first_ones_usage() -> None:
    usage = {"input_tokens": 310, "output_tokens": 42}
    turn = turn_from_sse(
        [
            {"type": "text_delta", "delta": "Hi"},
            {"type": "done", "usage": usage},
            {"type": "done", "latency_ms": 900},
        ]
    )
    answer = turn.messages[-1]
    assert answer.token_usage is not None
    assert answer.token_usage.model_dump() == usage
    assert answer.latency_ms == 900


async def test_a_turn_that_only_resolves_a_prompt_naming_another_user_changes_nothing(
    backend: Backend,
) -> None:
    """As a turn naming another user than the owner is a conflict, so is a turn that only
    resolves that owner's prompt (it stores no message, but it clears the prompt)."""
    logger, store, pending_calls = await _asked(backend)
    approve = turn_from_metadata(
        [{"type": "confirm_resolved", "request_id": "confirm-1", "approved": True}],
        complete=True,
        pending=pending_calls,
    )

    with pytest.raises(NotFound, match="conversation 'c-owned' was not found"):
        await log_streamed_turn(
            logger=logger, store=store, conversation_id="c-owned", turn=approve, turn_id="t2",
            user_id="user-mallory",
        )  # fmt: skip

    pending = await store.pending_hitl("c-owned")
    assert pending is not None
    assert pending.request_id == "confirm-1"


_DEEP: dict[str, Any] = {}
_level = _DEEP
for _ in range(70):
    _level["x"] = {}
    _level = _level["x"]

_TOO_MANY_CALLS = [
    {"type": "tool_start", "tool_name": "t", "tool_call_id": f"c{i}"} for i in range(1001)
]


@pytest.mark.parametrize(
    ("events", "named"),
    [
        pytest.param(
            [{"type": "tool_start", "tool_name": "t" * 300, "tool_call_id": "tc-1"}],
            r"0\.tool_start\.tool_name: .*at most 256",
            id="metadata-tool-name-of-300-characters",
        ),
        pytest.param(
            [{"type": "confirm_required", "request_id": "r1", "action": "a" * 300}],
            r"0\.confirm_required\.action: .*at most 256",
            id="metadata-action-of-300-characters",
        ),
        pytest.param(
            [
                {"type": "stream_token", "token": "Paying."},
                {"type": "confirm_required", "request_id": "r1", "action": "pay", "params": _DEEP},
            ],
            r"1\.confirm_required\.params: .*deeper than 64",
            id="metadata-params-nested-70-deep",
        ),
        pytest.param(
            [
                {"type": "tool_call", "tool_name": "t" * 300, "tool_call_id": "tc-1"},
                {"type": "done"},
            ],
            r"0\.tool_call\.tool_name: .*at most 256",
            id="sse-tool-name-of-300-characters",
        ),
        pytest.param(
            [{"type": "hitl", "request_id": "r1", "action": "a" * 300}, {"type": "done"}],
            r"0\.hitl\.action: .*at most 256",
            id="sse-action-of-300-characters",
        ),
        pytest.param(
            _TOO_MANY_CALLS, r"tool_calls: .*at most 1000", id="metadata-1001-calls-in-a-message"
        ),
    ],
)
def test_a_stream_event_the_turn_cannot_hold_is_invalid_input_naming_it(
    events: list[dict[str, Any]], named: str
) -> None:
    """STREAMING.md: a bad event is refused with an InvalidInput naming the event and field,
    also when the value is one the stored message refuses (a name, an action, params), never
    a raw validation error."""
    build = (
        (lambda: turn_from_sse(events))
        if events[-1]["type"] == "done"
        else (lambda: turn_from_metadata(events, complete=True))
    )

    with pytest.raises(InvalidInput, match=named):
        build()


def test_metadata_events_nested_too_deeply_to_write_are_invalid_input() -> None:
    """Arguments nested past what JSON writing takes are refused as any bad event is, never a
    raw error."""
    args: dict[str, Any] = {}
    for _ in range(300):
        args = {"a": args}
    events = [{"type": "tool_start", "tool_name": "t", "tool_call_id": "tc-1", "args": args}]

    with pytest.raises(InvalidInput, match="nests too deeply"):
        turn_from_metadata(events, complete=True)


_BOOKING = PendingCall(
    tool_call_id="call-1",
    tool_name="book",
    message_id="m-1",
    request_id="req-1",
    created_at=RECEIVED_AT,
)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(
            lambda: turn_from_sse(
                [{"type": "tool_result", "tool_call_id": "call-1", "result": "booked"},
                 {"type": "done", "usage": {"input_tokens": 5, "output_tokens": 0}}],
                pending=[_BOOKING],
            ),
            id="sse-usage-of-a-turn-answering-an-earlier-call",
        ),
        pytest.param(
            lambda: turn_from_sse(
                [{"type": "tool_result", "tool_call_id": "call-1", "result": "booked"},
                 {"type": "done", "latency_ms": 12}],
                pending=[_BOOKING],
            ),
            id="sse-latency-of-a-turn-answering-an-earlier-call",
        ),
        pytest.param(
            lambda: turn_from_metadata(
                [{"type": "tool_end", "tool_name": "book", "tool_call_id": "call-1",
                  "result": "booked"}],
                complete=True,
                pending=[_BOOKING],
                usage=TokenUsage(input_tokens=5, output_tokens=0),
            ),
            id="metadata-usage-of-a-turn-answering-an-earlier-call",
        ),
        pytest.param(
            lambda: turn_from_metadata(
                [{"type": "confirm_resolved", "request_id": "req-1", "approved": False}],
                complete=True,
                pending=[_BOOKING],
                latency_ms=40,
            ),
            id="metadata-latency-of-a-turn-only-refusing-a-prompt",
        ),
    ],
)  # fmt: skip
def test_usage_or_latency_of_a_turn_the_model_said_nothing_in_is_invalid_input_saying_so(
    build: Any,
) -> None:
    """Usage and latency go on the turn's last assistant message (STREAMING.md); a turn with
    none (it only answers earlier calls or prompts) has nowhere to keep them: refused, saying
    so, never a raw error."""
    with pytest.raises(InvalidInput, match="no assistant message"):
        build()


@pytest.mark.parametrize("length", [1, 190, 195, 256])
def test_a_call_without_an_id_gets_one_within_the_bound_whatever_its_tools_name(
    length: int,
) -> None:
    """A tool name may have 256 characters; the id given to its call without one
    (`<tool_name>-<digest>-<n>`) keeps to the 200 a call id may have, and never repeats."""
    name = "t" * length
    events = [
        {"type": "tool_start", "tool_name": name, "args": {}},
        {"type": "tool_start", "tool_name": name, "args": {}},
        {"type": "tool_end", "tool_name": name, "result": "one"},
        {"type": "tool_end", "tool_name": name, "result": "two"},
    ]

    turn = turn_from_metadata(events, complete=True, received_at=RECEIVED_AT)

    (calls,) = [m.tool_calls for m in turn.messages if m.role == "assistant"]
    assert calls is not None
    ids = [call.id for call in calls]
    assert len(set(ids)) == 2
    assert all(len(i) <= MAX_CALL_ID_CHARS and i.startswith(name[:150]) for i in ids)
    results = [m.tool_call_id for m in turn.messages if m.role == "tool"]
    assert results == ids


def _approval_of(request_id: str, pending: Any = ()) -> StreamedTurn:
    """A turn whose stream only approves the prompt `request_id`: no message of its own."""
    return turn_from_metadata(
        [{"type": "confirm_resolved", "request_id": request_id, "approved": True}],
        complete=True,
        pending=pending,
    )


async def test_a_turn_only_approving_a_prompt_of_legacy_turns_not_migrated_is_refused(
    backend: Backend,
) -> None:
    """A streamed turn that only answers the prompt of its user's conversation that exists
    only as legacy turns records nothing, as the same answer over HTTP does: it is refused
    with the store's own Conflict (not migrated yet), never reported as logged."""
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    await backend.db[SESSION_HITL].insert_one(
        {"conversation_id": EXAMPLE_CONVERSATION_ID, "request_id": "req-booking-1",
         "action": "confirm_booking", "status": "pending", "user_id": EXAMPLE_USER_ID}
    )  # fmt: skip
    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(backend.db, legacy=legacy)
    store = ConversationStore(backend.db, legacy=legacy)

    with pytest.raises(Conflict, match="exists as legacy turns not migrated yet"):
        await log_streamed_turn(
            logger=logger, store=store, conversation_id=EXAMPLE_CONVERSATION_ID,
            turn=_approval_of("req-booking-1"), turn_id="t-approve", user_id=EXAMPLE_USER_ID,
        )  # fmt: skip

    prompt = await backend.db[SESSION_HITL].find_one({"request_id": "req-booking-1"})
    assert prompt is not None
    assert prompt["status"] == "pending"
    assert await backend.db[CONVERSATIONS].count_documents({}) == 0


async def _legacy_prompt_of(backend: Backend, conversation_id: str, user_id: str) -> None:
    """A legacy turn of `user_id` under `conversation_id`, its prompt `req-legacy` pending."""
    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": f"late-{conversation_id}", "conversation_id": conversation_id, "user_id": user_id,
         "user_message": "mine", "response_parts": [{"type": "text", "content": "ok"}]}
    )  # fmt: skip
    await backend.db[SESSION_HITL].insert_one(
        {"conversation_id": conversation_id, "request_id": "req-legacy", "action": "pay",
         "status": "pending", "user_id": user_id}
    )  # fmt: skip


async def _answers_to_an_approval(
    logger: AgentMessageLogger, store: ConversationStore, conversation_id: str, user_id: str
) -> tuple[tuple[str, str], tuple[str, str]]:
    """What a runtime acting for `user_id` is answered for a turn that only approves the prompt
    `req-legacy` of `conversation_id`, and what the same answer by the user's token is
    (`resolve_hitl` in the user's conversations only): each error's type and words, the id
    written `<id>`."""
    answers = []
    for answer in (
        log_streamed_turn(
            logger=logger, store=store, conversation_id=conversation_id,
            turn=_approval_of("req-legacy"), turn_id="t-approve", user_id=user_id,
        ),
        store.resolve_hitl(conversation_id, "req-legacy", user_id=user_id),
    ):  # fmt: skip
        with pytest.raises((Conflict, NotFound)) as refused:
            await answer
        answers.append((refused.type.__name__, str(refused.value).replace(conversation_id, "<id>")))
    return answers[0], answers[1]


async def test_an_approval_on_a_users_legacy_turns_is_answered_as_to_her_token_beside_another(
    backend: Backend,
) -> None:
    """A turn that only approves a prompt of its user's legacy turns not migrated yet is
    refused as her token's answer is (Conflict, not migrated yet), also when another user's
    conversation stands under the same id: to her that conversation is as if absent, so the
    answer neither differs nor tells it is there; nothing is written."""
    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(backend.db, legacy=legacy)
    store = ConversationStore(backend.db, legacy=legacy)
    await logger.log_messages("conv-beside", hitl_turn("req-bob"), user_id="user-bob")
    for conversation_id in ("conv-alone", "conv-beside"):
        await _legacy_prompt_of(backend, conversation_id, "user-alice")
    bobs = await store.get_conversation("conv-beside", user_id="user-bob")

    alone = await _answers_to_an_approval(logger, store, "conv-alone", "user-alice")
    beside = await _answers_to_an_approval(logger, store, "conv-beside", "user-alice")

    runtime, token = alone
    assert runtime == token
    assert runtime[0] == "Conflict"
    assert "exists as legacy turns not migrated yet" in runtime[1]
    assert beside == alone
    assert await store.get_conversation("conv-beside", user_id="user-bob") == bobs
    assert await backend.db[SESSION_HITL].count_documents({"status": "pending"}) == 2


async def test_an_approval_on_another_users_conversation_is_answered_as_on_no_conversation(
    backend: Backend,
) -> None:
    """For a runtime acting for a user, an id holding only another user's conversation is
    answered as an id holding nothing is, as her token is answered: NotFound, the same words."""
    store = ConversationStore(backend.db)
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages("conv-theirs", hitl_turn("req-legacy"), user_id="user-bob")

    theirs = await _answers_to_an_approval(logger, store, "conv-theirs", "user-alice")
    absent = await _answers_to_an_approval(logger, store, "conv-absent", "user-alice")

    assert theirs == absent
    assert theirs[0] == ("NotFound", "conversation '<id>' was not found")
    pending = await store.pending_hitl("conv-theirs", user_id="user-bob")
    assert pending is not None
    assert pending.request_id == "req-legacy"


async def _asked(
    backend: Backend,
) -> tuple[AgentMessageLogger, ConversationStore, list[PendingCall]]:
    """`c-owned`, user-alice's, asking `confirm-1` about its call `tc-1`, with its pending calls
    as a client reads them."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    ask = [
        {"type": "tool_start", "tool_name": "pay", "tool_call_id": "tc-1", "args": {"eur": 9}},
        {"type": "confirm_required", "request_id": "confirm-1", "action": "pay",
         "params": {"eur": 9}, "prompt": "Pay 9 EUR?", "tool_call_id": "tc-1"},
    ]  # fmt: skip
    await log_streamed_turn(
        logger=logger, store=store, conversation_id="c-owned", user_id="user-alice",
        turn=turn_from_metadata(ask, complete=True), turn_id="t1", prompt="Pay the invoice.",
    )  # fmt: skip
    return logger, store, await store.pending_calls("c-owned")


async def _asked_then_migrating(
    backend: Backend,
) -> tuple[AgentMessageLogger, ConversationStore, list[PendingCall]]:
    """`_asked`, then marked as the migration marks a conversation it is still writing
    (`MIGRATING`)."""
    asked = await _asked(backend)
    await backend.db[CONVERSATIONS].update_one({"_id": "c-owned"}, {"$set": {MIGRATING: True}})
    return asked


async def test_a_turn_only_approving_a_prompt_while_its_conversation_is_migrated_is_refused(
    backend: Backend,
) -> None:
    """A turn that only answers a prompt of a conversation the migration is still writing
    records nothing: refused with the store's Conflict (sent again once migrated), not
    reported as logged; the prompt stays pending."""
    logger, store, pending = await _asked_then_migrating(backend)

    with pytest.raises(Conflict, match="may be sent again once `python -m migrations run`"):
        await log_streamed_turn(
            logger=logger, store=store, conversation_id="c-owned",
            turn=_approval_of("confirm-1", pending), turn_id="t2", user_id="user-alice",
        )  # fmt: skip

    await backend.db[CONVERSATIONS].update_one({"_id": "c-owned"}, {"$unset": {MIGRATING: 1}})
    asked = await store.pending_hitl("c-owned")
    assert asked is not None
    assert asked.request_id == "confirm-1"


async def test_a_turn_approving_a_call_then_giving_its_result_while_migrated_is_refused(
    backend: Backend,
) -> None:
    """A turn that approves a call and logs its result (the approval recorded before the
    turn) into a conversation being migrated records nothing: the store's refusal reaches
    the caller, the prompt stays pending and no message is stored."""
    logger, store, pending = await _asked_then_migrating(backend)
    answer = turn_from_metadata(
        [{"type": "confirm_resolved", "request_id": "confirm-1", "approved": True},
         {"type": "tool_end", "tool_name": "pay", "tool_call_id": "tc-1", "result": "paid"}],
        complete=True,
        pending=pending,
    )  # fmt: skip

    with pytest.raises(Conflict, match="not migrated yet"):
        await log_streamed_turn(
            logger=logger, store=store, conversation_id="c-owned", turn=answer, turn_id="t2",
            user_id="user-alice",
        )  # fmt: skip

    await backend.db[CONVERSATIONS].update_one({"_id": "c-owned"}, {"$unset": {MIGRATING: 1}})
    asked = await store.pending_hitl("c-owned")
    assert asked is not None
    assert asked.request_id == "confirm-1"
    assert len(await store.transcript("c-owned")) == 3


async def test_a_streamed_approval_replayed_after_its_prompt_was_answered_still_logs(
    backend: Backend,
) -> None:
    """What a stream answers that was answered before (a replay, another tab first) keeps
    its first answer: the turn is logged, no refusal."""
    logger, store, pending = await _asked_then_migrating(backend)
    await backend.db[CONVERSATIONS].update_one({"_id": "c-owned"}, {"$unset": {MIGRATING: 1}})
    approval = _approval_of("confirm-1", pending)
    await store.resolve_hitl("c-owned", "confirm-1", user_id="user-alice")

    logged = await log_streamed_turn(
        logger=logger, store=store, conversation_id="c-owned", turn=approval, turn_id="t2",
        user_id="user-alice",
    )  # fmt: skip

    assert logged.messages == []
    assert await store.pending_hitl("c-owned") is None


async def test_a_streamed_turn_for_a_user_never_answers_a_prompt_of_a_services_conversation(
    backend: Backend,
) -> None:
    """`log_streamed_turn(..., user_id=)` writes as the user's token does: a service's
    (unowned) conversation is NotFound, its prompt left pending and nothing written, even for
    a turn that only resolves prompts."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, hitl_turn("req-svc"), turn_id="svc-0")
    approval = turn_from_metadata(
        [{"type": "confirm_resolved", "request_id": "req-svc", "approved": True}], complete=True
    )
    answer = turn_from_metadata([{"type": "stream_token", "token": "ok"}], complete=True)

    for turn, prompt in ((approval, None), (answer, "hi")):
        with pytest.raises(NotFound, match=re.escape(f"conversation {CID!r} was not found")):
            await log_streamed_turn(
                logger=logger, store=store, conversation_id=CID, turn=turn, turn_id="t-ada",
                prompt=prompt, user_id="user-ada",
            )  # fmt: skip

    assert (await store.get_conversation(CID)).user_id is None
    assert (await store.pending_hitl(CID)) is not None
    assert len(await store.transcript(CID)) == 2
