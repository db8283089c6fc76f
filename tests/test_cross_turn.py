"""State that spans turns: calls left pending, answers and late results in later turns, ids."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, ToolReturnPart

from agent_store import (
    AgentMessageLogger,
    AnsweredBefore,
    Conflict,
    ConversationStore,
    InvalidInput,
    LoggedTurn,
    NotFound,
    StorageUnavailable,
    StoreError,
    TurnRules,
)
from agent_store.core import (
    DENIED_RESULT,
    PENDING_RESULT,
    RESOLVED_PROMPTS_KEPT,
    AgentMessage,
    MessageError,
    PendingCall,
    answers_to_calls,
    messages_adapter,
)
from agent_store.integrations.exports import (
    as_messages,
    chat_completions,
    check_chat_completions,
    responses_items,
)
from agent_store.integrations.pydantic_ai import history_from_messages
from agent_store.integrations.streams import (
    StreamedTurn,
    log_streamed_turn,
    parse_sse_text,
    turn_from_metadata,
    turn_from_sse,
)
from agent_store.store import CONVERSATIONS, PENDING_CALLS_KEPT, _relocated
from agent_store.store import _logger as _logger_module
from agent_store.store._logger import Corrected, OtherContent, Unreserved
from agent_store.store._reservation import BLOCKS_WATCHED_FOR, DELETING, BeingDeleted
from agent_store.store._turns import answered_in, message_id, pending_after
from tests.api_harness import _insert_lost, auth_headers, digest, reserved_insert_lost, serve
from tests.conftest import COUNTED, Backend, StoreClocks

STREAMS = Path(__file__).parent / "streams"
CID = "conv-cross"

ASKS_TO_BOOK = [
    {"type": "stream_token", "token": "I can book the 09:04 TGV."},
    {"type": "tool_start", "tool_name": "book_train", "tool_call_id": "tc-9",
     "args": {"train": "TGV 6601"}},
    {"type": "confirm_required", "request_id": "confirm-9", "action": "book_train",
     "params": {"train": "TGV 6601", "price_eur": 35}, "prompt": "Pay €35 for the 09:04 TGV?",
     "tool_call_id": "tc-9"},
]  # fmt: skip
APPROVED = {"type": "confirm_resolved", "request_id": "confirm-9", "approved": True}
DENIED = {"type": "confirm_resolved", "request_id": "confirm-9", "approved": False}
BOOKED = {"type": "tool_end", "tool_name": "book_train", "tool_call_id": "tc-9",
          "result": {"booking": "B-42"}}  # fmt: skip


class Runtime:
    """A runtime streaming turns of one conversation in the metadata protocol, as documented."""

    def __init__(self, backend: Backend, cid: str = CID, rules: TurnRules | None = None) -> None:
        self.logger = AgentMessageLogger(backend.db, rules=rules)
        self.store = ConversationStore(backend.db, rules=rules)
        self.cid = cid
        self.turns = 0

    async def stream(self, events: list[dict[str, Any]], prompt: str | None = None) -> LoggedTurn:
        self.turns += 1
        pending = await self.store.pending_calls(self.cid)  # none before the first turn
        turn = turn_from_metadata(events, complete=True, pending=pending)
        return await log_streamed_turn(
            logger=self.logger,
            store=self.store,
            conversation_id=self.cid,
            turn=turn,
            turn_id=f"turn-{self.turns}",
            prompt=prompt,
        )

    async def answers_of(self, call_id: str) -> list[tuple[str | None, str | None]]:
        return [
            (m.content, m.error.message if m.error else None)
            for m in await self.store.transcript(self.cid)
            if m.tool_call_id == call_id
        ]


# -- a confirmation resolved in a later turn ------------------------------------------


async def test_a_call_awaiting_confirmation_is_stored_unanswered_and_pending(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)

    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")

    assert await runtime.answers_of("tc-9") == []  # no stand-in in storage
    pending = await runtime.store.pending_hitl(CID)
    assert pending is not None
    assert pending.request_id == "confirm-9"
    calls = await runtime.store.pending_calls(CID)
    assert [(c.tool_call_id, c.tool_name, c.request_id) for c in calls] == [
        ("tc-9", "book_train", "confirm-9")
    ]
    exported = chat_completions(await runtime.store.transcript(CID))
    check_chat_completions(exported)  # the export answers it, marked, in the replay only
    assert [m["content"] for m in exported if m["role"] == "tool"] == [PENDING_RESULT]


async def test_a_confirmation_approved_in_a_later_streamed_turn_stores_the_result_as_its_answer(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")

    await runtime.stream(
        [APPROVED, BOOKED, {"type": "stream_token", "token": "Booked: B-42."}], prompt="Yes."
    )

    assert await runtime.answers_of("tc-9") == [('{"booking":"B-42"}', None)]
    assert await runtime.store.pending_hitl(CID) is None
    assert await runtime.store.pending_calls(CID) == []
    exported = chat_completions(await runtime.store.transcript(CID))
    check_chat_completions(exported)
    assert [m["content"] for m in exported if m["role"] == "tool"] == ['{"booking":"B-42"}']


async def test_a_confirmation_denied_in_a_later_turn_answers_the_call_as_denied(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")

    await runtime.stream([DENIED, {"type": "stream_token", "token": "Okay, nothing was booked."}])

    assert await runtime.answers_of("tc-9") == [(DENIED_RESULT, "tool call denied")]
    assert await runtime.store.pending_hitl(CID) is None
    assert await runtime.store.pending_calls(CID) == []


async def test_a_turn_holding_only_the_resolution_is_logged_and_the_result_follows_later(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")

    await runtime.stream([APPROVED])
    assert await runtime.store.pending_hitl(CID) is None
    assert [c.tool_call_id for c in await runtime.store.pending_calls(CID)] == ["tc-9"]

    # The booking returns a turn later; the event names the tool only.
    await runtime.stream([{"type": "tool_end", "tool_name": "book_train", "result": "B-42"}])
    assert await runtime.answers_of("tc-9") == [("B-42", None)]
    assert await runtime.store.pending_calls(CID) == []


async def test_a_refusal_arriving_after_the_approval_denies_nothing(backend: Backend) -> None:
    """A second, contradicting answer to a prompt already resolved (another tab, a replayed
    UI event) comes too late: the tool is running; its result is the call's answer. A
    resolved prompt holds back no call: `pending_calls` lists it awaiting its result."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.stream([APPROVED])
    calls = await runtime.store.pending_calls(CID)
    assert [(c.tool_call_id, c.request_id) for c in calls] == [("tc-9", None)]

    await runtime.stream([DENIED])
    await runtime.stream([BOOKED, {"type": "stream_token", "token": "Booked: B-42."}])

    assert await runtime.answers_of("tc-9") == [('{"booking":"B-42"}', None)]
    assert await runtime.store.pending_calls(CID) == []
    exported = chat_completions(await runtime.store.transcript(CID))
    assert [m["content"] for m in exported if m["role"] == "tool"] == ['{"booking":"B-42"}']


@pytest.mark.parametrize(("first", "second"), [(APPROVED, DENIED), (DENIED, APPROVED)])
async def test_a_prompt_answered_twice_in_one_stream_keeps_its_first_answer(
    backend: Backend, first: dict[str, Any], second: dict[str, Any]
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")

    await runtime.stream([first, second])

    denied = [(DENIED_RESULT, "tool call denied")]
    assert await runtime.answers_of("tc-9") == ([] if first is APPROVED else denied)
    awaiting = [c.tool_call_id for c in await runtime.store.pending_calls(CID)]
    assert awaiting == (["tc-9"] if first is APPROVED else [])


TWO_ASKS = [
    {"type": "stream_token", "token": "I can book the train and the hotel."},
    {"type": "tool_start", "tool_name": "book_train", "tool_call_id": "tc-1", "args": {}},
    {"type": "tool_start", "tool_name": "book_hotel", "tool_call_id": "tc-2", "args": {}},
    {"type": "confirm_required", "request_id": "confirm-1", "action": "book_train",
     "params": {}, "prompt": "Pay for the train?", "tool_call_id": "tc-1"},
    {"type": "confirm_required", "request_id": "confirm-2", "action": "book_hotel",
     "params": {}, "prompt": "Pay for the hotel?", "tool_call_id": "tc-2"},
]  # fmt: skip
TRAIN_BOOKED = {"type": "tool_end", "tool_name": "book_train", "tool_call_id": "tc-1",
                "result": {"booking": "B-42"}}  # fmt: skip


async def held_calls(store: ConversationStore) -> list[tuple[str, str | None]]:
    return [(c.tool_call_id, c.request_id) for c in await store.pending_calls(CID)]


async def test_approving_a_prompt_that_is_not_the_pending_one_releases_its_call_for_good(
    backend: Backend,
) -> None:
    """Two prompts in one turn: `pending_hitl` shows the second, but the first holds its own
    call. Its approval is its answer: the call awaits its result, and a refusal of the same
    prompt arriving later (another tab, a replayed event) denies nothing."""
    runtime = Runtime(backend)
    await runtime.stream(TWO_ASKS, prompt="Book the train and the hotel.")

    answer = {"type": "confirm_resolved", "request_id": "confirm-1", "approved": True}

    await runtime.stream([answer])
    assert await held_calls(runtime.store) == [("tc-1", None), ("tc-2", "confirm-2")]
    pending = await runtime.store.pending_hitl(CID)
    assert pending is not None
    assert pending.request_id == "confirm-2"

    await runtime.stream([{**answer, "approved": False}])
    await runtime.stream([TRAIN_BOOKED, {"type": "stream_token", "token": "Booked: B-42."}])

    assert await runtime.answers_of("tc-1") == [('{"booking":"B-42"}', None)]
    assert await held_calls(runtime.store) == [("tc-2", "confirm-2")]


async def test_an_approval_in_a_turn_that_asks_a_new_question_is_recorded(
    backend: Backend,
) -> None:
    """The turn approving a prompt goes on and asks another: the new one is pending, and the
    approved prompt stays answered (its call awaits its result)."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    asks_for_a_taxi = [
        {"type": "tool_start", "tool_name": "book_taxi", "tool_call_id": "tc-10", "args": {}},
        {"type": "confirm_required", "request_id": "confirm-10", "action": "book_taxi",
         "params": {}, "prompt": "A taxi too?", "tool_call_id": "tc-10"},
    ]  # fmt: skip

    await runtime.stream([APPROVED, *asks_for_a_taxi], prompt="Yes.")
    assert await held_calls(runtime.store) == [("tc-9", None), ("tc-10", "confirm-10")]

    await runtime.stream([DENIED])
    await runtime.stream([BOOKED])
    assert await runtime.answers_of("tc-9") == [('{"booking":"B-42"}', None)]


async def test_a_refusal_read_before_another_tab_approved_denies_nothing(
    backend: Backend,
) -> None:
    """Tab B's runtime read the pending calls while the prompt was pending; tab A's approval
    lands before B logs its refusal. The first answer is the approval: B's turn is logged
    without the denial, and the call's real result is its answer."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    read_by_tab_b = await runtime.store.pending_calls(CID)
    await runtime.stream([APPROVED])  # tab A

    refusal = turn_from_metadata(
        [DENIED, {"type": "stream_token", "token": "Okay."}], complete=True, pending=read_by_tab_b
    )
    logged = await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=refusal,
        turn_id="tab-b",
    )  # fmt: skip
    again = await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=refusal,
        turn_id="tab-b",
    )  # fmt: skip

    assert [m.content for m in logged.messages] == ["Okay."]
    assert again.replayed
    assert [m.id for m in again.messages] == [m.id for m in logged.messages]
    await _awaited_and_answered_by_its_result(runtime)


async def test_a_refusal_alone_read_before_another_tab_approved_stores_nothing(
    backend: Backend,
) -> None:
    """Tab B's turn only refuses the prompt tab A approved first (the stream ended after the
    refusal): the turn without its denial holds nothing, so nothing is stored and the turn
    says so (no message, not a replay), the approval stands, and its retry is the same."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    read_by_tab_b = await runtime.store.pending_calls(CID)
    await runtime.stream([APPROVED])  # tab A
    before = await runtime.store.transcript(CID)
    refusal = turn_from_metadata([DENIED], complete=True, pending=read_by_tab_b)

    for _ in range(2):
        logged = await log_streamed_turn(
            logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=refusal,
            turn_id="tab-b",
        )  # fmt: skip
        assert logged == LoggedTurn(
            conversation_id=CID, turn_id="tab-b", messages=[], replayed=False
        )

    assert await runtime.store.transcript(CID) == before
    await _awaited_and_answered_by_its_result(runtime)


async def _awaited_and_answered_by_its_result(runtime: Runtime) -> None:
    """tc-9 awaits its result, held by no prompt, and the booking's result answers it."""
    assert await held_calls(runtime.store) == [("tc-9", None)]
    await runtime.stream([BOOKED])
    assert await runtime.answers_of("tc-9") == [('{"booking":"B-42"}', None)]


async def test_a_denial_of_a_call_whose_prompt_was_approved_is_refused_and_nothing_written(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.stream([APPROVED])
    before = await runtime.store.transcript(CID)
    denial = {"role": "tool", "tool_call_id": "tc-9", "content": DENIED_RESULT,
              "error": {"message": "tool call denied"}}  # fmt: skip

    with pytest.raises(AnsweredBefore, match=r"'tc-9'.*approved") as refused:
        await runtime.logger.log_messages(CID, [denial], turn_id="late-denial")

    assert refused.value.tool_call_ids == ("tc-9",)
    assert await runtime.store.transcript(CID) == before
    assert await held_calls(runtime.store) == [("tc-9", None)]


@pytest.mark.parametrize("stored", [True, False], ids=["its turn stored", "its turn still written"])
async def test_a_denial_naming_an_approved_call_as_pending_calls_served_it_is_answered_before(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, stored: bool
) -> None:
    """A stale tab denies a call the person approved, naming its message as `pending_calls`
    served it: `AnsweredBefore` (a person approved it first), whether the turn making the call
    is stored or its insert is still to land (its writer lost it within `abandon_after`),
    never `InvalidInput` for a message it named as it was told to; `check_turn` alike; nothing
    written."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    call = {"id": "tc-9", "function": {"name": "book_train", "arguments": {"train": "TGV 6601"}}}
    prompt = {"action": "confirm", "request_id": "confirm-9", "tool_call_ids": ["tc-9"]}
    asks = [
        {"role": "user", "content": "Book me the 09:04 to Lyon."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "assistant", "content": "Pay €35?", "hitl_action": prompt},
    ]
    with monkeypatch.context() as lost:
        if not stored:
            lost.setattr(logger._messages, "insert_many", _lost_insert)
        with contextlib.suppress(ConnectionError):
            await logger.log_messages(CID, asks, turn_id="t1")
    await store.resolve_hitl(CID, "confirm-9")
    served = {c.tool_call_id: c.message_id for c in await store.pending_calls(CID)}
    before = await store.transcript(CID)

    for attempt in (logger.check_turn, logger.log_messages):
        with pytest.raises(AnsweredBefore, match=r"'tc-9'.*approved"):
            await attempt(CID, [_DENIAL], turn_id="stale-tab", answers_to=served)

    assert await store.transcript(CID) == before


_DENIAL = {"role": "tool", "tool_call_id": "tc-9", "content": DENIED_RESULT,
           "error": {"message": "tool call denied"}}  # fmt: skip
_BOOKED_RESULT = {"role": "tool", "tool_call_id": "tc-9", "content": '{"booking":"B-42"}'}


@pytest.mark.parametrize("refused", [None, {"tc-9": "confirm-9"}], ids=["bare", "naming"])
async def test_a_denial_of_an_approved_call_is_refused_also_once_its_result_is_logged(
    backend: Backend, refused: dict[str, str] | None
) -> None:
    """The call's result answered it: a later denial of the approved call (naming the prompt
    it refuses or not) is a second answer to it, refused (`AnsweredBefore`), nothing written."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.stream([APPROVED])
    await runtime.stream([BOOKED])
    before = await runtime.store.transcript(CID)

    with pytest.raises(AnsweredBefore, match=r"'tc-9'.*approved") as denied:
        await runtime.logger.log_messages(
            CID, [{"role": "user", "content": "No!"}, _DENIAL], turn_id="late-denial",
            refused_prompts=refused,
        )  # fmt: skip

    assert denied.value.tool_call_ids == ("tc-9",)
    assert await runtime.store.transcript(CID) == before
    assert await runtime.answers_of("tc-9") == [('{"booking":"B-42"}', None)]


@pytest.mark.parametrize("together", [False, True], ids=["result-later", "result-with-approval"])
async def test_a_refusal_read_before_another_tab_approved_denies_nothing_after_the_result(
    backend: Backend, together: bool
) -> None:
    """Tab B read the pending calls while the prompt was pending; tab A's approval and the
    call's result are logged before B logs its refusal: B's turn is logged without the
    denial, and the result stays the call's only answer."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    read_by_tab_b = await runtime.store.pending_calls(CID)
    if together:
        await runtime.stream([APPROVED, BOOKED])
    else:
        await runtime.stream([APPROVED])
        await runtime.stream([BOOKED])

    logged = await _log_as_tab_b(
        runtime, [DENIED, {"type": "stream_token", "token": "Okay."}], read_by_tab_b
    )
    again = await _log_as_tab_b(
        runtime, [DENIED, {"type": "stream_token", "token": "Okay."}], read_by_tab_b
    )

    assert [m.content for m in logged.messages] == ["Okay."]
    assert again.replayed
    assert await runtime.answers_of("tc-9") == [('{"booking":"B-42"}', None)]


_OKAY = {"type": "stream_token", "token": "Okay."}


@pytest.mark.parametrize(
    ("tab_a", "tab_b"),
    [
        pytest.param([DENIED], [DENIED, _OKAY], id="deny-then-deny"),
        pytest.param([DENIED], [APPROVED, BOOKED, _OKAY], id="deny-then-result"),
        pytest.param([APPROVED, BOOKED], [DENIED, _OKAY], id="result-then-deny"),
        pytest.param([BOOKED], [BOOKED, _OKAY], id="result-then-result"),
    ],
)
async def test_a_call_answered_in_one_tab_keeps_that_first_answer_against_another_tabs(
    backend: Backend, tab_a: list[dict[str, Any]], tab_b: list[dict[str, Any]]
) -> None:
    """Two tabs build their turns from the same read of the pending calls; tab A's answer to
    tc-9 (a refusal, or the result) lands first and is the call's answer. Tab B's stale
    refusal denies nothing: its turn is logged without it, and so is every retry. Tab B's
    stale result is refused (`AnsweredBefore`, naming tc-9), nothing written, retries too:
    the tool ran although the call was answered, and the runtime is told so."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    read_by_both = await runtime.store.pending_calls(CID)
    first = await _log_as_tab(runtime, tab_a, read_by_both, "tab-a")
    answer = [(m.content, m.error.message if m.error else None) for m in first.messages]
    before = await runtime.store.transcript(CID)

    if BOOKED in tab_b:  # a result: the tool ran
        for _ in range(2):  # and its retry
            with pytest.raises(AnsweredBefore, match=r"'tc-9'.*answered") as refused:
                await _log_as_tab(runtime, tab_b, read_by_both, "tab-b")
            assert refused.value.tool_call_ids == ("tc-9",)
        assert await runtime.store.transcript(CID) == before
    else:
        logged = await _log_as_tab(runtime, tab_b, read_by_both, "tab-b")
        again = await _log_as_tab(runtime, tab_b, read_by_both, "tab-b")
        assert [m.content for m in logged.messages] == ["Okay."]
        assert again.replayed
        assert [m.id for m in again.messages] == [m.id for m in logged.messages]

    assert await runtime.answers_of("tc-9") == answer
    exported = chat_completions(await runtime.store.transcript(CID))
    check_chat_completions(exported)
    assert [(m["tool_call_id"], m["content"]) for m in exported if m["role"] == "tool"] == [
        ("tc-9", answer[0][0])
    ]


async def _log_as_tab(
    runtime: Runtime, events: list[dict[str, Any]], read: list[PendingCall], turn_id: str
) -> LoggedTurn:
    """A turn of one tab, built from the pending calls it read before (`read`)."""
    turn = turn_from_metadata(events, complete=True, pending=read)
    return await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=turn,
        turn_id=turn_id,
    )  # fmt: skip


@pytest.mark.parametrize("second", [_DENIAL, _BOOKED_RESULT], ids=["denial", "result"])
@pytest.mark.parametrize("first", [_DENIAL, _BOOKED_RESULT], ids=["denied", "answered"])
async def test_a_turn_naming_the_call_it_answers_is_refused_once_another_answered_it(
    backend: Backend, first: dict[str, Any], second: dict[str, Any]
) -> None:
    """A turn logged directly names the call of an earlier turn each of its answers answers
    (`answers_to`: its id and the message that made it, as `pending_calls` served them):
    answered by another turn since, the call keeps that first answer, and the turn is
    refused (`AnsweredBefore`, naming the call), nothing written."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    (call,) = await runtime.store.pending_calls(CID)
    await runtime.logger.log_messages(
        CID, [first], turn_id="first", answers_to={"tc-9": call.message_id}
    )
    before = await runtime.store.transcript(CID)

    with pytest.raises(AnsweredBefore, match=r"'tc-9'.*answered") as refused:
        await runtime.logger.log_messages(
            CID, [{"role": "user", "content": "Again."}, second], turn_id="second",
            answers_to={"tc-9": call.message_id},
        )  # fmt: skip

    assert refused.value.tool_call_ids == ("tc-9",)
    assert await runtime.store.transcript(CID) == before


@pytest.mark.parametrize("answer", [_DENIAL, _BOOKED_RESULT], ids=["denial", "result"])
async def test_a_retry_with_other_content_of_a_turn_that_stored_its_answer_is_other_content(
    backend: Backend, answer: dict[str, Any]
) -> None:
    """A turn answering a call (`answers_to`, as `log_run` names it) is stored, its reply lost;
    the run again words it otherwise under the same turn id: the answer stored is the turn's
    own, so the retry is `OtherContent` ("logged with other content"), not `AnsweredBefore`
    ("another turn answered that call first"), for a denial as for a result; nothing written."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    (call,) = await runtime.store.pending_calls(CID)

    def turn(wording: str) -> list[dict[str, Any]]:
        return [answer, {"role": "assistant", "content": wording}]

    named = {"tc-9": call.message_id}
    await runtime.logger.log_messages(CID, turn("Booked."), turn_id="t2", answers_to=named)
    before = await runtime.store.transcript(CID)

    with pytest.raises(OtherContent, match="logged with other content"):
        await runtime.logger.log_messages(CID, turn("Done."), turn_id="t2", answers_to=named)
    with pytest.raises(OtherContent, match="logged with other content"):
        await runtime.logger.check_turn(CID, turn("Done."), turn_id="t2", answers_to=named)

    assert await runtime.store.transcript(CID) == before
    again = await runtime.logger.log_messages(CID, turn("Booked."), turn_id="t2", answers_to=named)
    assert again.replayed


@pytest.mark.parametrize("answer", [_DENIAL, _BOOKED_RESULT], ids=["denial", "result"])
async def test_a_posted_retry_with_other_content_of_a_turn_that_stored_its_answer_is_a_conflict(
    backend: Backend, answer: dict[str, Any]
) -> None:
    """Over HTTP, a turn posted with `answers_to` stored, then the same turn id with other
    wording: 409 "logged with other content", never "another turn answered that call first"."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    (call,) = await runtime.store.pending_calls(CID)
    async with serve(backend.db, seeded=False) as api:
        url, headers = f"/v1/conversations/{CID}/turns", auth_headers()

        def turn(wording: str) -> dict[str, Any]:
            messages = [answer, {"role": "assistant", "content": wording}]
            return {"turn_id": "t2", "messages": messages,
                    "answers_to": {"tc-9": call.message_id}}  # fmt: skip

        first = await api.http.post(url, json=turn("Booked."), headers=headers)
        retry = await api.http.post(url, json=turn("Done."), headers=headers)

    assert (first.status_code, retry.status_code) == (201, 409)
    message = retry.json()["error"]["message"]
    assert "logged with other content" in message
    assert "another turn" not in message
    assert await runtime.answers_of("tc-9") == [
        (answer["content"], answer.get("error", {}).get("message"))
    ]


async def test_a_streamed_turn_that_stored_its_denial_retried_with_other_wording_is_other_content(
    backend: Backend,
) -> None:
    """`log_streamed_turn` leaves out only the denials the store refused; a turn whose first
    attempt stored its denial, retried with other wording, is `OtherContent`, not told that
    another turn answered the call first (nor logged again without the denial)."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    read = await runtime.store.pending_calls(CID)
    logged = await _log_as_tab(runtime, [DENIED, _token("Okay.")], read, "t2")
    before = await runtime.store.transcript(CID)

    with pytest.raises(OtherContent, match="logged with other content"):
        await _log_as_tab(runtime, [DENIED, _token("Fine, not booked.")], read, "t2")

    assert await runtime.store.transcript(CID) == before
    assert [m.content for m in logged.messages] == [DENIED_RESULT, "Okay."]
    assert (await _log_as_tab(runtime, [DENIED, _token("Okay.")], read, "t2")).replayed


def _token(text: str) -> dict[str, Any]:
    return {"type": "stream_token", "token": text}


@pytest.mark.parametrize(
    ("first", "stale"),
    [("refused", "result"), ("refused", "refusal"), ("approved", "refusal")],
    ids=["refused-then-result", "refused-then-refusal", "approved-then-refusal"],
)
async def test_a_stale_answer_beside_an_approved_result_records_the_approval_only_if_logged(
    backend: Backend, first: str, stale: str
) -> None:
    """Tab B approves confirm-1 and logs tc-1's result, and answers tc-2, which tab A
    answered first. With a stale refusal the turn is logged without it: the approval is
    recorded, and a retry of the turn is that logged turn. With a stale result the turn is
    refused, nothing written, the approval it carries included: confirm-1 still holds tc-1."""
    runtime = Runtime(backend)
    await runtime.stream(TWO_ASKS, prompt="Book the train and the hotel.")
    read_by_both = await runtime.store.pending_calls(CID)
    hotel_answer = {"type": "confirm_resolved", "request_id": "confirm-2",
                    "approved": first == "approved"}  # fmt: skip
    await _log_as_tab(runtime, [hotel_answer], read_by_both, "tab-a")
    first_answer = await runtime.answers_of("tc-2")
    hotel: dict[str, Any] = (
        {"type": "tool_end", "tool_name": "book_hotel", "tool_call_id": "tc-2", "result": "H-7"}
        if stale == "result"
        else {**hotel_answer, "approved": False}
    )
    tab_b = [{"type": "confirm_resolved", "request_id": "confirm-1", "approved": True},
             TRAIN_BOOKED, hotel, _OKAY]  # fmt: skip
    before = await runtime.store.transcript(CID)

    if stale == "result":
        with pytest.raises(AnsweredBefore, match="'tc-2'"):
            await _log_as_tab(runtime, tab_b, read_by_both, "tab-b")
        assert await runtime.store.transcript(CID) == before
        assert await held_calls(runtime.store) == [("tc-1", "confirm-1")]
        return
    logged = await _log_as_tab(runtime, tab_b, read_by_both, "tab-b")
    again = await _log_as_tab(runtime, tab_b, read_by_both, "tab-b")
    assert [(m.tool_call_id, m.content) for m in logged.messages] == [
        ("tc-1", '{"booking":"B-42"}'), (None, "Okay."),
    ]  # fmt: skip
    assert again.replayed
    assert [m.id for m in again.messages] == [m.id for m in logged.messages]
    assert "tc-1" in (await _approvals_recorded(runtime))["approved_calls"]
    assert await runtime.answers_of("tc-2") == first_answer


async def test_a_stale_answer_is_refused_not_taken_for_a_new_call_reusing_the_id(
    backend: Backend,
) -> None:
    """A provider numbering its calls per response makes tc-9 again after the first tc-9 was
    answered. An answer read before that first answer (another tab) is refused: it would
    answer the new call, which nobody asked about. The new call, read afresh, is answered."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    stale = await runtime.store.pending_calls(CID)
    await runtime.stream([DENIED])
    await runtime.stream(
        [{"type": "tool_start", "tool_name": "book_hotel", "tool_call_id": "tc-9", "args": {}},
         {"type": "confirm_required", "request_id": "confirm-10", "action": "book_hotel",
          "params": {}, "prompt": "Book the hotel?", "tool_call_id": "tc-9"}],
        prompt="A hotel, then.",
    )  # fmt: skip

    with pytest.raises(AnsweredBefore, match="'tc-9'"):
        await _log_as_tab(runtime, [APPROVED, BOOKED], stale, "stale-tab")
    assert await held_calls(runtime.store) == [("tc-9", "confirm-10")]

    await runtime.stream([{**BOOKED, "tool_name": "book_hotel", "result": "H-7"}])
    assert await runtime.answers_of("tc-9") == [
        (DENIED_RESULT, "tool call denied"), ("H-7", None),
    ]  # fmt: skip
    assert await held_calls(runtime.store) == []


async def test_a_stale_answer_to_a_call_a_later_call_of_its_id_follows_is_refused(
    backend: Backend,
) -> None:
    """A tab read tc-9 pending; a later turn made a new tc-9, pending too, before the tab
    answered. The store gives an answer to the latest pending call of its id: the tab's
    answer would answer the new call, so it is refused (a Conflict), nothing written, and
    both calls stay pending, each held by its prompt."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    stale = await runtime.store.pending_calls(CID)
    await runtime.stream(
        [{"type": "tool_start", "tool_name": "book_hotel", "tool_call_id": "tc-9", "args": {}},
         {"type": "confirm_required", "request_id": "confirm-10", "action": "book_hotel",
          "params": {}, "prompt": "Book the hotel?", "tool_call_id": "tc-9"}],
        prompt="And a hotel.",
    )  # fmt: skip
    before = await runtime.store.transcript(CID)

    with pytest.raises(Conflict, match="a later call of that id is pending") as refused:
        await _log_as_tab(runtime, [BOOKED], stale, "stale-tab")

    assert not isinstance(refused.value, AnsweredBefore)
    assert await runtime.store.transcript(CID) == before
    assert await held_calls(runtime.store) == [("tc-9", "confirm-9"), ("tc-9", "confirm-10")]


async def _approvals_recorded(runtime: Runtime) -> dict[str, Any]:
    """What the conversation records of confirm-9's answers: the prompt pending, the calls it
    holds, the request ids resolved and the calls approved."""
    pending = await runtime.store.pending_hitl(CID)
    doc = await runtime.store._conversations.find_one({"_id": CID})
    assert doc is not None
    return {
        "pending_hitl": pending.request_id if pending else None,
        "held": await held_calls(runtime.store),
        "resolved_hitl": doc.get("resolved_hitl"),
        "approved_calls": [a["tool_call_id"] for a in doc.get("approved_calls") or ()],
    }


@pytest.mark.parametrize(
    ("events", "prompt"),
    [
        pytest.param([APPROVED, BOOKED], "yes \ud83d", id="lone-surrogate-in-the-prompt"),
        pytest.param(
            [APPROVED, BOOKED, {"type": "stream_token", "token": "Booked \udc00"}], "yes",
            id="lone-surrogate-in-a-token",
        ),
    ],
)  # fmt: skip
async def test_a_streamed_turn_refused_as_invalid_records_none_of_the_approvals_it_carries(
    backend: Backend, events: list[dict[str, Any]], prompt: str
) -> None:
    """A rejected turn writes nothing: the approval of an earlier prompt that a stream carries
    with its call's result is recorded before the turn only once the turn is known to be one
    the logger takes. Refused (InvalidInput), the prompt is still pending, and the person's
    later refusal denies the call."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    before = await _approvals_recorded(runtime)

    with pytest.raises(InvalidInput):
        await runtime.stream(events, prompt=prompt)

    assert await _approvals_recorded(runtime) == before
    assert before["held"] == [("tc-9", "confirm-9")]
    await runtime.stream([DENIED], prompt="No, don't.")
    assert await runtime.answers_of("tc-9") == [(DENIED_RESULT, "tool call denied")]


async def test_a_streamed_turn_under_an_id_logged_with_other_content_records_no_approval(
    backend: Backend,
) -> None:
    """The same for a turn the logger refuses as a Conflict only once it reads the
    conversation: its id was logged with other content (the person said "wait" in it). The
    approval it carries is not recorded, and the person's later refusal denies the call."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.stream([{"type": "stream_token", "token": "Waiting."}], prompt="Wait.")
    before = await _approvals_recorded(runtime)
    runtime.turns -= 1  # the next stream is logged under "turn-2" again

    with pytest.raises(Conflict, match="logged with other content"):
        await runtime.stream([APPROVED, BOOKED], prompt="Yes.")

    assert await _approvals_recorded(runtime) == before
    assert before["pending_hitl"] == "confirm-9"
    await runtime.stream([DENIED], prompt="No, don't.")
    assert await runtime.answers_of("tc-9") == [(DENIED_RESULT, "tool call denied")]


async def _alice_asked_to_book(backend: Backend) -> Runtime:
    """A runtime whose first turn, alice's, asks confirm-9 about booking (call tc-9)."""
    runtime = Runtime(backend)
    ask = turn_from_metadata(ASKS_TO_BOOK, complete=True)
    await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=ask,
        turn_id="t1", prompt="Book me the 09:04 to Lyon.", user_id="alice",
    )  # fmt: skip
    return runtime


@pytest.mark.parametrize("read_as", ["service", "mallory"])
async def test_a_streamed_turn_naming_another_user_approves_nothing_of_the_owners(
    backend: Backend, read_as: str
) -> None:
    """A turn naming another user than the conversation's owner is NotFound, and so is the
    approval it carries with its call's result: the owner's prompt stays pending, its call
    held, nothing approved (the pending calls read by a service, or for that user: none)."""
    runtime = await _alice_asked_to_book(backend)
    before = await _approvals_recorded(runtime)
    read = await runtime.store.pending_calls(
        CID, user_id=None if read_as == "service" else "mallory"
    )

    with pytest.raises((NotFound, InvalidInput)) as refused:
        await _approve_and_book_as(runtime, "mallory", read)

    if read_as == "service":
        assert isinstance(refused.value, NotFound)
        assert str(refused.value) == f"conversation {CID!r} was not found"
    assert await _approvals_recorded(runtime) == before
    assert before["pending_hitl"] == "confirm-9"


async def _approve_and_book_as(runtime: Runtime, user_id: str, read: list[PendingCall]) -> None:
    """A turn naming `user_id`, approving confirm-9 and carrying tc-9's result, built from
    the pending calls `read`."""
    approve = turn_from_metadata([APPROVED, BOOKED], complete=True, pending=read)
    await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=approve,
        turn_id="t2", prompt="yes", user_id=user_id,
    )  # fmt: skip


async def test_a_streamed_approval_naming_the_owner_is_recorded_before_its_result(
    backend: Backend,
) -> None:
    """The owner's turn (named as `user_id`) approving the prompt and carrying the call's
    result records the approval before the result clears the prompt, as a service's does."""
    runtime = await _alice_asked_to_book(backend)
    read = await runtime.store.pending_calls(CID, user_id="alice")

    await _approve_and_book_as(runtime, "alice", read)

    recorded = await _approvals_recorded(runtime)
    assert (recorded["pending_hitl"], recorded["approved_calls"]) == (None, ["tc-9"])
    assert await runtime.answers_of("tc-9") == [('{"booking":"B-42"}', None)]


@pytest.mark.parametrize(("owner", "answered"), [("alice", True), (None, True), ("bob", False)])
async def test_an_answer_for_a_user_or_unowned_is_recorded_where_that_users_turn_may_write(
    backend: Backend, owner: str | None, answered: bool
) -> None:
    """`resolve_hitl(user_id=..., or_unowned=True)` answers the prompt in that user's
    conversation or an unowned one, as a turn a service logs naming that user may write to;
    another user's conversation is not found to it, nothing changed."""
    runtime = Runtime(backend)
    ask = turn_from_metadata(ASKS_TO_BOOK, complete=True)
    await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=ask,
        turn_id="t1", prompt="Book me the 09:04 to Lyon.", user_id=owner,
    )  # fmt: skip

    if answered:
        await runtime.store.resolve_hitl(CID, "confirm-9", user_id="alice", or_unowned=True)
    else:
        with pytest.raises(NotFound):
            await runtime.store.resolve_hitl(CID, "confirm-9", user_id="alice", or_unowned=True)

    held = [("tc-9", None)] if answered else [("tc-9", "confirm-9")]
    assert await held_calls(runtime.store) == held
    assert (await runtime.store.get_conversation(CID)).user_id == owner  # never assigned


_NEW_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "tc-9", "type": "function", "function": {"name": "book_hotel", "arguments": "{}"}},
]}  # fmt: skip


@pytest.mark.parametrize("answered", [False, True], ids=["pending", "answered-in-its-turn"])
async def test_a_denial_of_a_new_call_reusing_an_approved_calls_id_is_stored(
    backend: Backend, answered: bool
) -> None:
    """The approval is of the call it released (its message and id): once a later turn
    makes a new call under the id, a denial answers that call, which nobody approved."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.stream([APPROVED])
    await runtime.stream([BOOKED])
    reuse: list[dict[str, Any]] = [{"role": "user", "content": "And a hotel."}, _NEW_CALL]
    if answered:
        reuse.append({"role": "tool", "tool_call_id": "tc-9", "content": "H-7"})
    await runtime.logger.log_messages(CID, reuse, turn_id="reuse")

    await runtime.logger.log_messages(CID, [_DENIAL], turn_id="denial")

    assert (DENIED_RESULT, "tool call denied") in await runtime.answers_of("tc-9")


async def test_popping_the_call_reusing_an_approved_calls_id_makes_its_denial_refused_again(
    backend: Backend,
) -> None:
    """A pop of the message that made the new call leaves the approved call the latest of
    its id: a denial of the id is refused again, as before that call was made; so in a fork
    cut before that message."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.stream([APPROVED])
    await runtime.stream([BOOKED])
    stored = await runtime.store.transcript(CID)
    await runtime.logger.log_messages(CID, [_NEW_CALL], turn_id="reuse")
    await runtime.logger.fork(CID, len(stored) - 1, "fork-before-reuse")

    await runtime.store.pop_last_message(CID)

    for cid in (CID, "fork-before-reuse"):
        with pytest.raises(AnsweredBefore, match="'tc-9'"):
            await runtime.logger.log_messages(cid, [_DENIAL], turn_id="denial")


async def test_a_denial_of_an_answered_call_nobody_approved_is_stored(backend: Backend) -> None:
    """A call answered without a person's approval is no approved call: a later denial of it
    is stored as given."""
    runtime = Runtime(backend)
    await runtime.logger.log_messages(
        CID, [{"role": "user", "content": "Book it."}, {**_NEW_CALL},
              {"role": "tool", "tool_call_id": "tc-9", "content": "H-7"}], turn_id="t1",
    )  # fmt: skip

    await runtime.logger.log_messages(CID, [_DENIAL], turn_id="denial")

    assert await runtime.answers_of("tc-9") == [("H-7", None), (DENIED_RESULT, "tool call denied")]


def _asks_reusing(call_id: str, tool: str) -> list[dict[str, Any]]:
    return [
        {"type": "tool_start", "tool_name": tool, "tool_call_id": call_id, "args": {}},
        {"type": "confirm_required", "request_id": "confirm-1", "action": tool, "params": {},
         "prompt": f"OK to {tool}?", "tool_call_id": call_id},
    ]  # fmt: skip


@pytest.mark.parametrize("approved", [True, False], ids=["approved", "refused"])
async def test_a_new_prompt_reusing_a_resolved_request_id_is_answered_afresh(
    backend: Backend, approved: bool
) -> None:
    """A runtime numbering its confirmations per turn asks `confirm-1` again: the new prompt
    holds its call until it is answered, whatever the earlier `confirm-1` was answered; the
    earlier one's call, still running, stays released."""
    runtime = Runtime(backend)
    answer = {"type": "confirm_resolved", "request_id": "confirm-1", "approved": True}
    await runtime.stream(_asks_reusing("tc-1", "book_train"), prompt="Book the train.")
    await runtime.stream([answer])
    await runtime.stream(_asks_reusing("tc-20", "wire_money"), prompt="Now pay my rent.")
    assert await held_calls(runtime.store) == [("tc-1", None), ("tc-20", "confirm-1")]

    await runtime.stream(
        [{**answer, "approved": approved}], prompt="Go ahead." if approved else "No."
    )

    assert await runtime.answers_of("tc-1") == []
    if approved:
        assert await held_calls(runtime.store) == [("tc-1", None), ("tc-20", None)]
        assert await runtime.answers_of("tc-20") == []
    else:
        assert await held_calls(runtime.store) == [("tc-1", None)]
        assert await runtime.answers_of("tc-20") == [(DENIED_RESULT, "tool call denied")]
    assert await runtime.store.pending_hitl(CID) is None


def _answer_1(approved: bool) -> dict[str, Any]:
    return {"type": "confirm_resolved", "request_id": "confirm-1", "approved": approved}


PAID_TC_1 = {"type": "tool_end", "tool_name": "pay", "tool_call_id": "tc-1", "result": "paid"}
ANSWER_BEFORE_QUESTION = {
    # tc-1's question approved and paid; a replayed answer to it opens the next stream, which
    # then asks confirm-1 again about tc-20
    "stale-refusal": [[*_asks_reusing("tc-1", "pay"), _answer_1(True), PAID_TC_1],
                      [_answer_1(False), *_asks_reusing("tc-20", "pay")]],
    "stale-approval": [[*_asks_reusing("tc-1", "pay"), _answer_1(True), PAID_TC_1],
                       [_answer_1(True), *_asks_reusing("tc-20", "pay")]],
    # a question holding no call, pending; the next stream says no, then asks about tc-20
    "refused-plain-question": [
        [{"type": "confirm_required", "request_id": "confirm-1", "action": "ask", "params": {},
          "prompt": "Also book a hotel?"}],
        [_answer_1(False), *_asks_reusing("tc-20", "pay")]],
    # one stream: a refusal of nothing asked yet, then the question
    "one-stream": [[_answer_1(False), *_asks_reusing("tc-20", "pay")]],
    # the question asked after the answer holds no call: it waits, pending
    "plain-question-after": [[_answer_1(True), {
        "type": "confirm_required", "request_id": "confirm-1", "action": "ask", "params": {},
        "prompt": "Also book a hotel?"}]],
}  # fmt: skip


@pytest.mark.parametrize("case", ANSWER_BEFORE_QUESTION)
async def test_an_answer_in_a_stream_answers_no_question_the_stream_asks_after_it(
    backend: Backend, case: str
) -> None:
    """STREAMING.md: an answer in a stream answers the question asked before it (a replayed
    one, or a refusal, changes nothing of a question answered before); a question asked
    after it under the same request id (a runtime numbering its confirmations per turn) is
    a new question: it holds its call until it is answered itself, so nothing releases or
    denies tc-20, and `confirm-1` is pending."""
    runtime = Runtime(backend)
    for n, events in enumerate(ANSWER_BEFORE_QUESTION[case]):
        await runtime.stream(events, prompt=f"step {n}")

    held = [] if case == "plain-question-after" else [("tc-20", "confirm-1")]
    assert await held_calls(runtime.store) == held
    assert await runtime.answers_of("tc-20") == []
    pending = await runtime.store.pending_hitl(CID)
    assert pending is not None
    assert pending.request_id == "confirm-1"
    await runtime.stream([_answer_1(False)], prompt="No.")  # the question's own answer
    assert await held_calls(runtime.store) == []
    denied = [] if case == "plain-question-after" else [(DENIED_RESULT, "tool call denied")]
    assert await runtime.answers_of("tc-20") == denied


async def _log_as_tab_b(
    runtime: Runtime, events: list[dict[str, Any]], read: list[PendingCall]
) -> LoggedTurn:
    """A turn of another tab, built from the pending calls it read before (`read`)."""
    turn = turn_from_metadata(events, complete=True, pending=read)
    return await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=turn,
        turn_id="tab-b",
    )  # fmt: skip


async def test_an_approval_holds_while_its_call_is_pending_however_many_prompts_follow_it(
    backend: Backend,
) -> None:
    """The request ids a conversation remembers as resolved are bounded, but an approved
    call still awaiting its result stays released: a refusal of its prompt arriving after a
    hundred later prompts were answered denies nothing, and the real result answers it."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.stream([APPROVED])
    for batch in range(0, RESOLVED_PROMPTS_KEPT, 10):  # ten prompts a turn, answered in the next
        ids = [f"q-{n}" for n in range(batch, batch + 10)]
        questions = [{"type": "confirm_required", "request_id": i, "action": "ok", "params": {},
                      "prompt": f"Question {i}?"} for i in ids]  # fmt: skip
        await runtime.stream(questions, prompt=f"Go on {batch}.")
        await runtime.stream([{"type": "confirm_resolved", "request_id": i, "approved": True}
                              for i in ids])  # fmt: skip

    await runtime.stream([DENIED, {"type": "stream_token", "token": "Okay."}])

    await _awaited_and_answered_by_its_result(runtime)


async def test_a_retry_of_a_turn_logged_without_an_approved_calls_denial_is_that_turn(
    backend: Backend,
) -> None:
    """Tab B refuses two prompts, one of which tab A approved first: the turn is logged
    denying only the other call, and every retry of it (before and after the approved
    call's result) is answered as that logged turn."""
    runtime = Runtime(backend)
    await runtime.stream(TWO_ASKS, prompt="Book the train and the hotel.")
    read_by_tab_b = await runtime.store.pending_calls(CID)
    await runtime.stream(
        [{"type": "confirm_resolved", "request_id": "confirm-1", "approved": True}]
    )
    refusals = [
        {"type": "confirm_resolved", "request_id": "confirm-1", "approved": False},
        {"type": "confirm_resolved", "request_id": "confirm-2", "approved": False},
        {"type": "stream_token", "token": "Fine."},
    ]

    logged = await _log_as_tab_b(runtime, refusals, read_by_tab_b)
    again = await _log_as_tab_b(runtime, refusals, read_by_tab_b)
    await runtime.stream([TRAIN_BOOKED])
    late = await _log_as_tab_b(runtime, refusals, read_by_tab_b)

    assert [(m.tool_call_id, m.content) for m in logged.messages] == [
        ("tc-2", DENIED_RESULT), (None, "Fine."),
    ]  # fmt: skip
    for retry in (again, late):
        assert retry.replayed
        assert [m.id for m in retry.messages] == [m.id for m in logged.messages]
    assert await runtime.answers_of("tc-1") == [('{"booking":"B-42"}', None)]


@pytest.mark.parametrize("next_turn", ["stored", "lost"])
async def test_a_retry_of_a_turn_logged_without_its_denial_is_that_turn_past_the_kept_records(
    backend: Backend, next_turn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, the retry coming once later turns dropped the turn's record (past
    `turns_recorded`), whether the next turn was stored or its insert lost (its block left
    empty): the stored messages are the turn, and the retry sending the refused denial again
    is still answered as that logged turn, never `OtherContent` or "stored in part" ("use a
    new turn_id", which would store the reply twice)."""
    runtime = Runtime(backend, rules=TurnRules(turns_recorded=2))
    await runtime.stream(TWO_ASKS, prompt="Book the train and the hotel.")
    read_by_tab_b = await runtime.store.pending_calls(CID)
    await runtime.stream(
        [{"type": "confirm_resolved", "request_id": "confirm-1", "approved": True}]
    )
    refusals = [
        {"type": "confirm_resolved", "request_id": "confirm-1", "approved": False},
        {"type": "stream_token", "token": "Fine."},
    ]
    logged = await _log_as_tab_b(runtime, refusals, read_by_tab_b)
    if next_turn == "lost":
        with monkeypatch.context() as lost:
            lost.setattr(runtime.logger._messages, "insert_many", _lost_insert)
            with pytest.raises(ConnectionError):  # the writer died after its reservation
                await runtime.stream([{"type": "stream_token", "token": "Lost."}], prompt="?")
    for n in range(3):
        await runtime.stream([{"type": "stream_token", "token": f"Later {n}."}], prompt="And?")

    late = await _log_as_tab_b(runtime, refusals, read_by_tab_b)

    assert late.replayed
    assert [m.id for m in late.messages] == [m.id for m in logged.messages]
    turn = turn_from_metadata(refusals, complete=True, pending=read_by_tab_b)
    named = {"refused_prompts": dict(turn.refused_prompts), "answers_to": dict(turn.answered_calls)}
    with pytest.raises(AnsweredBefore):
        await runtime.logger.check_turn(CID, list(turn.messages), turn_id="tab-b", **named)


async def test_a_call_approved_stays_approved_when_its_request_id_is_asked_again(
    backend: Backend,
) -> None:
    """`confirm-1` approved (its call running), a later turn asks `confirm-1` anew: tab B's
    refusal of the first `confirm-1`, read before the approval, denies nothing."""
    runtime = Runtime(backend)
    answer = {"type": "confirm_resolved", "request_id": "confirm-1", "approved": True}
    await runtime.stream(_asks_reusing("tc-1", "book_train"), prompt="Book the train.")
    read_by_tab_b = await runtime.store.pending_calls(CID)
    await runtime.stream([answer])
    await runtime.stream(_asks_reusing("tc-20", "wire_money"), prompt="Now pay my rent.")

    logged = await _log_as_tab_b(
        runtime, [{**answer, "approved": False}, {"type": "stream_token", "token": "Okay."}],
        read_by_tab_b,
    )  # fmt: skip

    assert [m.content for m in logged.messages] == ["Okay."]
    assert await runtime.answers_of("tc-1") == []
    assert await held_calls(runtime.store) == [("tc-1", None), ("tc-20", "confirm-1")]


async def test_a_stale_answer_does_not_answer_a_newer_prompt_reusing_its_request_id(
    backend: Backend,
) -> None:
    """Tab B answers the first `confirm-1` after a later turn asked `confirm-1` anew about
    another call: the new prompt is not answered by it. It still holds its call, and the
    person's own refusal of it then denies that call."""
    runtime = Runtime(backend)
    answer = {"type": "confirm_resolved", "request_id": "confirm-1", "approved": True}
    await runtime.stream(_asks_reusing("tc-1", "book_train"), prompt="Book the train.")
    read_by_tab_b = await runtime.store.pending_calls(CID)
    await runtime.stream([answer])
    await runtime.stream(_asks_reusing("tc-20", "wire_money"), prompt="Now pay my rent.")

    await _log_as_tab_b(runtime, [{**answer, "approved": False}], read_by_tab_b)

    pending = await runtime.store.pending_hitl(CID)
    assert pending is not None
    assert pending.request_id == "confirm-1"
    assert await held_calls(runtime.store) == [("tc-1", None), ("tc-20", "confirm-1")]
    await runtime.stream([{**answer, "approved": False}], prompt="No!")
    assert await runtime.answers_of("tc-20") == [(DENIED_RESULT, "tool call denied")]
    assert await held_calls(runtime.store) == [("tc-1", None)]


# -- an answer names its calls by their identity: id and the message that made them ----------

APPROVES_CONFIRM_1 = {"type": "confirm_resolved", "request_id": "confirm-1", "approved": True}


async def _tool_answers(store: ConversationStore) -> list[tuple[str | None, str | None]]:
    return [
        (m.tool_call_id, m.error.message if m.error else None)
        for m in await store.transcript(CID)
        if m.role == "tool"
    ]


@pytest.mark.parametrize("result_first", [True, False], ids=["result-came", "no-result-yet"])
async def test_a_stale_approval_does_not_approve_a_newer_call_reusing_its_request_and_call_ids(
    backend: Backend, result_first: bool
) -> None:
    """A runtime numbering its confirmations per turn and a provider numbering its calls per
    response: `confirm-1` about `call_0` (book_train), approved; a later turn asks `confirm-1`
    about a new `call_0` (wire_money). Tab B's approval, built from the calls it read before,
    names the first `call_0` by the message that made it: it does not answer the new prompt,
    and the person's own refusal then denies the payment."""
    runtime = Runtime(backend)
    await runtime.stream(_asks_reusing("call_0", "book_train"), prompt="Book the train.")
    read_by_tab_b = await runtime.store.pending_calls(CID)
    await runtime.stream([APPROVES_CONFIRM_1])
    if result_first:
        await runtime.stream([{**BOOKED, "tool_call_id": "call_0"}])
    await runtime.stream(_asks_reusing("call_0", "wire_money"), prompt="Now pay my rent.")
    held_before = await held_calls(runtime.store)

    await _log_as_tab_b(runtime, [APPROVES_CONFIRM_1], read_by_tab_b)

    assert await held_calls(runtime.store) == held_before
    assert held_before[-1] == ("call_0", "confirm-1")
    pending = await runtime.store.pending_hitl(CID)
    assert pending is not None
    assert pending.request_id == "confirm-1"
    await runtime.stream([{**APPROVES_CONFIRM_1, "approved": False}], prompt="No, don't pay it.")
    assert (await _tool_answers(runtime.store))[-1] == ("call_0", "tool call denied")


async def test_resolving_with_calls_answers_only_a_prompt_holding_a_call_of_that_identity(
    backend: Backend,
) -> None:
    """`resolve_hitl(..., calls=...)` names each call by `tool_call_id` and `message_id`, as
    `pending_calls` serves them: a prompt holding a call of that id made by another message
    is not answered (Conflict), and one holding that very call is."""
    runtime = Runtime(backend)
    await runtime.stream(_asks_reusing("call_0", "book_train"), prompt="Book the train.")
    [held] = await runtime.store.pending_calls(CID)
    elsewhere = {"tool_call_id": "call_0", "message_id": "msg-made-by-another-turn"}

    with pytest.raises(Conflict, match=r"'confirm-1' pending .* holds none of the calls"):
        await runtime.store.resolve_hitl(CID, "confirm-1", calls=[elsewhere])
    assert await held_calls(runtime.store) == [("call_0", "confirm-1")]

    await runtime.store.resolve_hitl(
        CID, "confirm-1", calls=[{"tool_call_id": "call_0", "message_id": held.message_id}]
    )
    assert await held_calls(runtime.store) == [("call_0", None)]
    assert await runtime.store.pending_hitl(CID) is None


async def test_a_retry_of_a_resolution_naming_its_calls_answers_as_the_first_did(
    backend: Backend,
) -> None:
    """A retry whose first reply was lost, sent after a later turn asked `confirm-1` again
    about a new `call_0`: its calls' approval is recorded, so it answers as the first did,
    and the new prompt stays pending holding its call."""
    runtime = Runtime(backend)
    await runtime.stream(_asks_reusing("call_0", "book_train"), prompt="Book the train.")
    read = await runtime.store.pending_calls(CID)
    await runtime.store.resolve_hitl(CID, "confirm-1", calls=read)
    await runtime.stream([{**BOOKED, "tool_call_id": "call_0"}])
    await runtime.stream(_asks_reusing("call_0", "wire_money"), prompt="Now pay my rent.")

    await runtime.store.resolve_hitl(CID, "confirm-1", calls=read)

    assert await held_calls(runtime.store) == [("call_0", "confirm-1")]
    pending = await runtime.store.pending_hitl(CID)
    assert pending is not None
    assert pending.request_id == "confirm-1"


async def test_a_retried_streamed_turn_does_not_answer_a_newer_prompt_reusing_its_ids(
    backend: Backend,
) -> None:
    """A turn that asks `confirm-1` about its own `call_0` and is approved in the same stream,
    retried after a later turn asked `confirm-1` about a new `call_0`: its resolution names
    its call by the message the turn logged, so it leaves the new prompt pending."""
    runtime = Runtime(backend)
    first = turn_from_metadata(
        [*_asks_reusing("call_0", "book_train"), APPROVES_CONFIRM_1], complete=True
    )
    logged = await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=first,
        turn_id="asks-and-approves", prompt="Book the train.",
    )  # fmt: skip
    await runtime.stream([{**BOOKED, "tool_call_id": "call_0"}])
    await runtime.stream(_asks_reusing("call_0", "wire_money"), prompt="Now pay my rent.")

    again = await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=first,
        turn_id="asks-and-approves", prompt="Book the train.",
    )  # fmt: skip

    assert again.replayed
    assert [m.id for m in again.messages] == [m.id for m in logged.messages]
    assert await held_calls(runtime.store) == [("call_0", "confirm-1")]


async def _restarted(runtime: Runtime, turn_id: str) -> list[PendingCall]:
    """The pending calls of the conversation (`confirm-1` holding `call_0`: book_train) as a
    tab read them, before the conversation was deleted and started again under its id by a
    turn `turn_id` asking `confirm-1` about a new `call_0` (wire_money)."""
    first = turn_from_metadata(_asks_reusing("call_0", "book_train"), complete=True)
    await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=first,
        turn_id="t1", prompt="Book the train.",
    )  # fmt: skip
    read = await runtime.store.pending_calls(CID)
    await runtime.store.delete(CID)
    again = turn_from_metadata(_asks_reusing("call_0", "wire_money"), complete=True)
    await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=again,
        turn_id=turn_id, prompt="Pay my rent.",
    )  # fmt: skip
    return read


async def test_a_stale_approval_from_a_deleted_conversation_does_not_approve_its_successors_call(
    backend: Backend,
) -> None:
    """The conversation started again under its id by a turn of another id: its `call_0` is
    made by another message than the one the stale tab read, so the stale approval answers
    nothing and the new prompt stays pending holding its call."""
    runtime = Runtime(backend)
    read = await _restarted(runtime, turn_id="new-run-1")

    await _log_as_tab_b(runtime, [APPROVES_CONFIRM_1], read)

    assert await held_calls(runtime.store) == [("call_0", "confirm-1")]
    await runtime.stream([{**APPROVES_CONFIRM_1, "approved": False}], prompt="No, don't pay it.")
    assert await _tool_answers(runtime.store) == [("call_0", "tool call denied")]


async def test_a_conversation_started_again_by_the_same_turn_ids_repeats_its_call_identities(
    backend: Backend,
) -> None:
    """STREAMING.md (request ids used again), a limit: message ids derive from the
    conversation id, the turn id and the message's place, so a conversation deleted and
    started again by a turn of the same id makes the same identities, and an answer read
    from the deleted one answers the new prompt."""
    runtime = Runtime(backend)
    read = await _restarted(runtime, turn_id="t1")
    assert [(c.tool_call_id, c.message_id) for c in read] == [
        (c.tool_call_id, c.message_id) for c in await runtime.store.pending_calls(CID)
    ]

    await _log_as_tab_b(runtime, [APPROVES_CONFIRM_1], read)

    assert await held_calls(runtime.store) == [("call_0", None)]
    assert await runtime.store.pending_hitl(CID) is None


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        pytest.param({"calls": "call_0"}, "calls must be a list of the calls", id="a-string"),
        pytest.param(
            {"calls": {"tool_call_id": "call_0", "message_id": "m"}},
            "calls must be a list of the calls",
            id="one-mapping-not-in-a-list",
        ),
        pytest.param(
            {"calls": [{"tool_call_id": "call_0"}]},
            "calls[0] must hold a tool_call_id and a message_id (non-empty strings)",
            id="no-message-id",
        ),
        pytest.param(
            {"calls": [{"tool_call_id": "call_0", "message_id": ""}]},
            "calls[0] must hold a tool_call_id and a message_id (non-empty strings)",
            id="empty-message-id",
        ),
        pytest.param(
            {"calls": [{"tool_call_id": "call_0", "message_id": "m", "request_id": "x"}]},
            "calls[0] must hold a tool_call_id and a message_id (non-empty strings) and nothing "
            "else; it holds 'request_id'",
            id="another-key",
        ),
        pytest.param(
            {"calls": [{"tool_call_id": "call_0", "message_id": "m"}], "call_ids": ["call_0"]},
            "pass calls or call_ids, not both",
            id="both",
        ),
    ],
)
async def test_resolving_with_calls_that_are_not_call_identities_is_refused_writing_nothing(
    backend: Backend, arguments: dict[str, Any], message: str
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(_asks_reusing("call_0", "book_train"), prompt="Book the train.")

    with pytest.raises(InvalidInput, match=re.escape(message)):
        await runtime.store.resolve_hitl(CID, "confirm-1", **arguments)

    assert await held_calls(runtime.store) == [("call_0", "confirm-1")]
    assert await runtime.store.pending_hitl(CID) is not None


ASKS_AGAIN = {"type": "confirm_required", "request_id": "confirm-10", "action": "book_train",
              "params": {"note": "price changed"}, "prompt": "The price changed, still pay?",
              "tool_call_id": "tc-9"}  # fmt: skip
REFUSED_BY_TAB_B = [DENIED, {"type": "stream_token", "token": "Okay."}]


async def test_a_refusal_of_an_approved_prompt_denies_nothing_once_a_second_question_holds_its_call(
    backend: Backend,
) -> None:
    """Tab B read `confirm-9` holding tc-9; tab A approved it; a second question (`confirm-10`)
    holds the running call again. Tab B's refusal of `confirm-9` answers the approved prompt:
    it denies nothing, `confirm-10` stays pending holding the call, and the real result
    answers it."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    read_by_tab_b = await runtime.store.pending_calls(CID)
    await runtime.stream([APPROVED], prompt="Yes.")
    await runtime.stream([ASKS_AGAIN])

    logged = await _log_as_tab_b(runtime, REFUSED_BY_TAB_B, read_by_tab_b)

    assert [m.content for m in logged.messages] == ["Okay."]
    assert await held_state(runtime.store) == ([("tc-9", "confirm-10")], "confirm-10")
    await runtime.stream([BOOKED])
    assert await runtime.answers_of("tc-9") == [('{"booking":"B-42"}', None)]


async def test_a_refusal_of_a_second_question_about_an_approved_call_denies_it(
    backend: Backend,
) -> None:
    """STREAMING.md: a second question about an approved call holds it until it is answered
    itself; refused, it denies the call."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.stream([APPROVED], prompt="Yes.")
    await runtime.stream([ASKS_AGAIN])

    await runtime.stream([{**DENIED, "request_id": "confirm-10"}], prompt="No.")

    assert await runtime.answers_of("tc-9") == [(DENIED_RESULT, "tool call denied")]
    assert await held_state(runtime.store) == ([], None)


async def test_a_refusal_of_a_second_question_asked_under_the_same_request_id_denies_the_call(
    backend: Backend,
) -> None:
    """STREAMING.md: a runtime numbering its confirmations per turn asks its second question
    about the approved call under the first one's request id; the person's refusal of that
    question denies the call, never recorded as a second approval."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.stream([APPROVED], prompt="Yes.")
    await runtime.stream([{**ASKS_AGAIN, "request_id": "confirm-9"}])

    await runtime.stream([DENIED], prompt="No, cancel it.")

    assert await runtime.answers_of("tc-9") == [(DENIED_RESULT, "tool call denied")]
    assert await held_state(runtime.store) == ([], None)


async def test_a_retry_of_a_turn_logged_without_its_denial_is_that_turn_after_a_second_question(
    backend: Backend,
) -> None:
    """STREAMING.md (two answers racing): a retry of the turn logged without the approved
    call's denial is answered as that turn, also once a second question holds the call."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    read_by_tab_b = await runtime.store.pending_calls(CID)
    await runtime.stream([APPROVED], prompt="Yes.")
    logged = await _log_as_tab_b(runtime, REFUSED_BY_TAB_B, read_by_tab_b)
    await runtime.stream([ASKS_AGAIN])

    again = await _log_as_tab_b(runtime, REFUSED_BY_TAB_B, read_by_tab_b)

    assert again.replayed
    assert [m.id for m in again.messages] == [m.id for m in logged.messages]
    assert await runtime.answers_of("tc-9") == []
    assert await held_state(runtime.store) == ([("tc-9", "confirm-10")], "confirm-10")


# -- a second question about an approved call, asked and refused in one stream ----------


async def _asked_again_and_refused(
    runtime: Runtime, events: list[dict[str, Any]], turn_id: str
) -> tuple[LoggedTurn, LoggedTurn]:
    """A stream asking a second question about tc-9 and refused by the person, logged, then
    logged again (a retry): both results."""
    turn = turn_from_metadata(events, complete=True, pending=await runtime.store.pending_calls(CID))
    logged = []
    for _ in range(2):
        retried = await log_streamed_turn(
            logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=turn,
            turn_id=turn_id, prompt="No, not at that price.",
        )  # fmt: skip
        logged.append(retried)
    return logged[0], logged[1]


async def _denied_after_its_question(runtime: Runtime, asked_under: str) -> None:
    """tc-9 is answered `tool call denied`, after the second question in `seq` order; nothing
    is pending, and no approval of tc-9 is in force."""
    stored = await runtime.store.transcript(CID)
    [question] = [m for m in stored if m.hitl_action and m.hitl_action.params.get("note")]
    [denial] = [m for m in stored if m.tool_call_id == "tc-9"]
    assert question.hitl_action is not None
    assert question.hitl_action.request_id == asked_under
    assert (denial.content, denial.error) == (
        DENIED_RESULT,
        MessageError(message="tool call denied"),
    )
    assert question.seq is not None
    assert denial.seq is not None
    assert question.seq < denial.seq
    assert await held_state(runtime.store) == ([], None)


@pytest.mark.parametrize("asked_under", ["confirm-10", "confirm-9"], ids=["new-id", "same-id"])
@pytest.mark.parametrize("approved_in", ["earlier-turn", "same-stream"])
async def test_a_second_question_about_an_approved_call_refused_in_its_own_stream_denies_it(
    backend: Backend, asked_under: str, approved_in: str
) -> None:
    """STREAMING.md: the person approved `confirm-9` (in a turn before, or earlier in the same
    stream), the runtime asks again about tc-9 (under a new request id, or `confirm-9` again:
    a runtime numbering its confirmations per turn) and the person refuses that question in
    the same stream: the refusal denies tc-9, placed after the question, and a retry of the
    turn is answered as that turn."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    asks_again = {**ASKS_AGAIN, "request_id": asked_under}
    refused = {**DENIED, "request_id": asked_under}
    if approved_in == "earlier-turn":
        await runtime.stream([APPROVED], prompt="Yes.")
        events = [asks_again, refused]
    else:
        events = [APPROVED, asks_again, refused]

    logged, again = await _asked_again_and_refused(runtime, events, "refusing-turn")

    assert again.replayed
    assert [m.id for m in again.messages] == [m.id for m in logged.messages]
    await _denied_after_its_question(runtime, asked_under)
    assert await runtime.answers_of("tc-9") == [(DENIED_RESULT, "tool call denied")]


@pytest.mark.parametrize("asked_under", ["confirm-10", "confirm-9"], ids=["new-id", "same-id"])
async def test_popping_the_denial_of_a_second_question_leaves_the_question_holding_its_call(
    backend: Backend, asked_under: str
) -> None:
    """The second question holds the approved call (`held_by`) also when its turn then denies
    it: a pop of the denial leaves the question pending, holding tc-9, and no approval in
    force; the person's refusal of it, logged again, denies the call."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.stream([APPROVED], prompt="Yes.")
    refused = {**DENIED, "request_id": asked_under}
    await _asked_again_and_refused(
        runtime, [{**ASKS_AGAIN, "request_id": asked_under}, refused], "refusing-turn"
    )

    popped = await runtime.store.pop_last_message(CID)

    assert popped is not None
    assert popped.tool_call_id == "tc-9"
    assert await held_state(runtime.store) == ([("tc-9", asked_under)], asked_under)
    await runtime.stream([refused], prompt="No.")
    assert await runtime.answers_of("tc-9") == [(DENIED_RESULT, "tool call denied")]
    assert await held_state(runtime.store) == ([], None)


def _pending(*held: tuple[str, str | None]) -> list[PendingCall]:
    """Calls an earlier turn left pending (message `m-1`), each with the prompt holding it."""
    at = datetime(2025, 1, 1, tzinfo=UTC)
    return [
        PendingCall(tool_call_id=c, tool_name="book", message_id="m-1", request_id=r, created_at=at)
        for c, r in held
    ]


def test_a_refused_second_question_about_an_earlier_call_is_answered_right_after_it() -> None:
    """STREAMING.md: the denial a refused second question makes follows that question, and
    the turn names the question as the prompt it answers (`refused_prompts`)."""
    turn = turn_from_metadata(
        [ASKS_AGAIN, {**DENIED, "request_id": "confirm-10"}],
        complete=True, pending=_pending(("tc-9", None)),
    )  # fmt: skip

    assert [(m.role, m.tool_call_id) for m in turn.messages] == [
        ("assistant", None), ("tool", "tc-9"),
    ]  # fmt: skip
    assert turn.refused_prompts == (("tc-9", "confirm-10"),)


def test_a_request_asked_again_in_its_stream_after_its_approval_is_a_new_question() -> None:
    """`confirm-1` held tc-1 and tc-2; approved, then asked again about tc-1 alone and refused,
    in one stream: the refusal denies tc-1, and tc-2, released by the approval, stays
    pending for its result."""
    approval = {"type": "confirm_resolved", "request_id": "confirm-1", "approved": True}
    asks_again = {**ASKS_AGAIN, "request_id": "confirm-1", "tool_call_id": "tc-1"}
    turn = turn_from_metadata(
        [approval, asks_again, {**approval, "approved": False}],
        complete=True, pending=_pending(("tc-1", "confirm-1"), ("tc-2", "confirm-1")),
    )  # fmt: skip

    assert [(m.role, m.tool_call_id) for m in turn.messages] == [
        ("assistant", None), ("tool", "tc-1"),
    ]  # fmt: skip
    assert turn.refused_prompts == (("tc-1", "confirm-1"),)
    assert turn.resolved_calls == (("confirm-1", (("tc-1", "m-1"), ("tc-2", "m-1"))),)


async def test_a_stale_refusal_of_the_first_prompt_is_still_refused_after_such_a_turn_is_read(
    backend: Backend,
) -> None:
    """A refusal of `confirm-9` read before its approval (tab B), logged in a turn of its own
    after a second question about tc-9 was asked: it answers the approved prompt and denies
    nothing (`AnsweredBefore`), the second question still holds tc-9."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    read_by_tab_b = await runtime.store.pending_calls(CID)
    await runtime.stream([APPROVED], prompt="Yes.")
    await runtime.stream([ASKS_AGAIN])
    denial = {"role": "tool", "tool_call_id": "tc-9", "content": DENIED_RESULT,
              "error": {"message": "tool call denied"}}  # fmt: skip

    with pytest.raises(AnsweredBefore):
        await runtime.logger.log_messages(
            CID, [denial], turn_id="tab-b-direct", refused_prompts={"tc-9": "confirm-9"}
        )
    logged = await _log_as_tab_b(runtime, REFUSED_BY_TAB_B, read_by_tab_b)

    assert [m.content for m in logged.messages] == ["Okay."]
    assert await held_state(runtime.store) == ([("tc-9", "confirm-10")], "confirm-10")


def _asks_again_and_refuses(asked_under: str) -> list[dict[str, Any]]:
    """A turn posted as a runtime logs it: the person's answer, the second question about tc-9
    under `asked_under`, and the denial its refusal made."""
    return [
        {"role": "user", "content": "No, not at that price."},
        {"role": "assistant", "content": "The price changed, still pay?", "hitl_action": {
            "action": "wire_money", "params": {}, "request_id": asked_under,
            "tool_call_ids": ["tc-9"]}},
        {"role": "tool", "tool_call_id": "tc-9", "content": DENIED_RESULT,
         "error": {"message": "tool call denied"}},
    ]  # fmt: skip


@pytest.mark.parametrize("asked_under", ["confirm-2", "confirm-1"], ids=["new-id", "same-id"])
@pytest.mark.parametrize("names_prompt", [True, False], ids=["refused_prompts", "unnamed"])
async def test_a_second_question_refused_in_its_own_posted_turn_denies_the_approved_call(
    backend: Backend, asked_under: str, names_prompt: bool
) -> None:
    """API.md: a turn posted asking a second question about an approved call, then denying
    it (the person refused that question), is logged (201, a retry 200) and denies the call,
    naming the question in `refused_prompts` or not."""
    store = ConversationStore(backend.db)
    async with serve(backend.db, seeded=False) as api:
        url, headers = f"/v1/conversations/{CID}", auth_headers()
        answer = {"request_id": "confirm-1", "call_ids": ["tc-9"]}
        assert (await _asked_and_answered_over_http(api, "tc-9", "wire_money", answer)).is_success
        body: dict[str, Any] = {"turn_id": "t2", "messages": _asks_again_and_refuses(asked_under)}
        if names_prompt:
            body["refused_prompts"] = {"tc-9": asked_under}

        first = await api.http.post(f"{url}/turns", json=body, headers=headers)
        retry = await api.http.post(f"{url}/turns", json=body, headers=headers)

    assert (first.status_code, retry.status_code) == (201, 200)
    assert retry.json()["messages"] == first.json()["messages"]
    assert await _tool_answers(store) == [("tc-9", "tool call denied")]
    assert await held_state(store) == ([], None)


@pytest.mark.parametrize(
    ("asked_under", "refused", "denied"),
    [
        ("confirm-10", None, True),
        ("confirm-10", "confirm-10", True),
        ("confirm-9", "confirm-9", True),
        ("confirm-10", "confirm-9", False),
    ],
    ids=["unnamed", "names-the-question", "same-id", "names-the-approved-prompt"],
)
async def test_a_logged_denial_after_its_turns_question_answers_that_question(
    backend: Backend, asked_under: str, refused: str | None, denied: bool
) -> None:
    """`log_messages`: a denial of an approved call following, in its turn, a question that
    turn asks about the call answers that question (a person refused it) and denies the
    call, unless `refused_prompts` says it answers the prompt whose approval came first:
    that is a stale refusal (`AnsweredBefore`), nothing written."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.stream([APPROVED], prompt="Yes.")
    before = await runtime.store.transcript(CID)
    turn = turn_from_metadata(
        [{**ASKS_AGAIN, "request_id": asked_under}], complete=True,
        pending=await runtime.store.pending_calls(CID),
    )  # fmt: skip
    denial = {"role": "tool", "tool_call_id": "tc-9", "content": DENIED_RESULT,
              "error": {"message": "tool call denied"}}  # fmt: skip
    messages = [*turn.messages, denial]
    naming = None if refused is None else {"tc-9": refused}

    if denied:
        await runtime.logger.log_messages(CID, messages, turn_id="t3", refused_prompts=naming)
        await _denied_after_its_question(runtime, asked_under)
    else:
        with pytest.raises(AnsweredBefore, match="'tc-9'"):
            await runtime.logger.log_messages(CID, messages, turn_id="t3", refused_prompts=naming)
        assert await runtime.store.transcript(CID) == before
        assert await held_calls(runtime.store) == [("tc-9", None)]


@pytest.mark.parametrize(
    "answer",
    [
        {"request_id": "\ud800"},
        {"request_id": "confirm-9", "call_ids": ["\ud800"]},
        {"request_id": "confirm-9", "calls": [{"tool_call_id": "tc-9", "message_id": "m\udc00"}]},
    ],
    ids=["request_id", "call_ids", "calls"],
)
async def test_a_lone_surrogate_in_an_answer_is_refused_writing_nothing(
    backend: Backend, answer: dict[str, Any]
) -> None:
    """CHANGELOG: a lone surrogate is refused before any write (InvalidInput, a StoreError),
    on every backend alike."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    guard = {k: v for k, v in answer.items() if k != "request_id"}

    with pytest.raises(InvalidInput, match="surrogate"):
        await runtime.store.resolve_hitl(CID, answer["request_id"], **guard)

    assert await held_state(runtime.store) == ([("tc-9", "confirm-9")], "confirm-9")


async def test_an_answer_naming_calls_the_pending_prompt_does_not_hold_says_so(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")

    with pytest.raises(Conflict, match=r"'confirm-9' pending .* holds none of the calls"):
        await runtime.store.resolve_hitl(CID, "confirm-9", call_ids=["tc-1"])

    assert await held_state(runtime.store) == ([("tc-9", "confirm-9")], "confirm-9")


@pytest.mark.parametrize(
    "named",
    [
        pytest.param({"call_ids": ["tc-1"]}, id="call_ids"),
        pytest.param({"calls": [{"tool_call_id": "tc-1", "message_id": "m-1"}]}, id="calls"),
    ],
)
async def test_an_answer_naming_a_call_a_prompt_asked_once_never_held_names_the_calls_it_holds(
    backend: Backend, named: dict[str, Any]
) -> None:
    """A mistyped call id: the prompt was asked once, so the refusal says which calls it holds,
    not that it was asked again."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")

    with pytest.raises(Conflict) as refusal:
        await runtime.store.resolve_hitl(CID, "confirm-9", **named)

    assert "holds none of the calls the answer names; it holds 'tc-9'" in refusal.value.message
    assert "asked again" not in refusal.value.message
    assert await held_state(runtime.store) == ([("tc-9", "confirm-9")], "confirm-9")


async def test_an_answer_read_before_its_prompt_was_asked_again_is_refused_saying_so(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(_asks_reusing("call_0", "book_train"), prompt="Book the train.")
    read_by_tab_b = await runtime.store.pending_calls(CID)
    await runtime.stream([{**BOOKED, "tool_call_id": "call_0"}])
    await runtime.stream(_asks_reusing("call_1", "wire_money"), prompt="Now pay my rent.")
    held_before = await held_state(runtime.store)

    with pytest.raises(Conflict, match="it was asked again since the answer was read"):
        await runtime.store.resolve_hitl(CID, "confirm-1", calls=read_by_tab_b)

    assert await held_state(runtime.store) == held_before


# -- an answer naming calls does not answer a later question of its id holding none ----------


async def _paid_then_asked_to_delete(
    backend: Backend, answered: bool, result: bool = True
) -> tuple[AgentMessageLogger, list[PendingCall]]:
    """`confirm-1` asks "Pay 35 EUR?" about `c1` (pay); the calls as the person read them;
    their answer (when `answered`); `c1`'s result (when `result`; else still running), then
    `confirm-1` asked again: "Delete your account?", a question holding no call."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [_user("Pay."), _book("c1", "pay"), _asks_about("confirm-1", "c1")], turn_id="t0"
    )
    read = await store.pending_calls(CID)
    if answered:
        await store.resolve_hitl(CID, "confirm-1", calls=read)
    if result:
        await logger.log_messages(CID, [_answer("c1", "paid")], turn_id="t1")
    await logger.log_messages(CID, [_user("Delete my account."), _asks("confirm-1")], turn_id="t2")
    return logger, read


@pytest.mark.parametrize("result", [True, False], ids=["result-came", "still-running"])
@pytest.mark.parametrize("naming", ["calls", "call_ids"])
async def test_a_retried_answer_naming_its_calls_leaves_a_later_question_holding_none_pending(
    backend: Backend, naming: str, result: bool
) -> None:
    """A retry whose first reply was lost, sent after `confirm-1` was asked again about no
    call: the calls it names were released by the first answer, so it answers as the first
    did, writing nothing, and the new question stays pending."""
    _, read = await _paid_then_asked_to_delete(backend, answered=True, result=result)
    store = ConversationStore(backend.db)
    before = await backend.db.agent_conversations.find_one({"_id": CID})
    held_before = await held_state(store)
    assert held_before[1] == "confirm-1"

    named: dict[str, Any] = (
        {"calls": read} if naming == "calls" else {"call_ids": [c.tool_call_id for c in read]}
    )
    await store.resolve_hitl(CID, "confirm-1", **named)

    assert await held_state(store) == held_before
    after = await backend.db.agent_conversations.find_one({"_id": CID})
    assert after["answered_prompts"] == before["answered_prompts"]
    assert len(after["answered_prompts"]) == 1


async def test_a_stale_answer_naming_a_call_answered_otherwise_does_not_answer_a_later_question(
    backend: Backend,
) -> None:
    """The person read "Pay 35 EUR?" about `c1`; `c1` got its result otherwise and
    `confirm-1` was asked again about no call: their answer, never given before, is a
    Conflict saying the question was asked again, nothing written."""
    _, read = await _paid_then_asked_to_delete(backend, answered=False)
    store = ConversationStore(backend.db)
    held_before = await held_state(store)
    assert held_before == ([], "confirm-1")

    for named in ({"calls": read}, {"call_ids": ["c1"]}):
        with pytest.raises(Conflict, match="it was asked again since the answer was read"):
            await store.resolve_hitl(CID, "confirm-1", **named)

    assert await held_state(store) == held_before
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert "answered_prompts" not in doc or not doc["answered_prompts"]


async def test_a_retried_streamed_approval_leaves_a_later_question_holding_none_pending(
    backend: Backend,
) -> None:
    """A turn that only approved `confirm-9` (its call's result came later), retried after a
    later turn asked `confirm-9` again about no call: the retry is that turn, a replay, and
    the new question stays pending."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book the train.")
    approval = turn_from_metadata(
        [APPROVED], complete=True, pending=await runtime.store.pending_calls(CID)
    )
    await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=approval,
        turn_id="approves",
    )  # fmt: skip
    await runtime.stream([BOOKED])
    delete = {"type": "confirm_required", "request_id": "confirm-9", "action": "delete_account",
              "params": {}, "prompt": "Delete your account?"}  # fmt: skip
    await runtime.stream([delete], prompt="Delete my account.")
    held_before = await held_state(runtime.store)
    assert held_before == ([], "confirm-9")

    await log_streamed_turn(
        logger=runtime.logger, store=runtime.store, conversation_id=CID, turn=approval,
        turn_id="approves",
    )  # fmt: skip

    assert await held_state(runtime.store) == held_before


async def test_a_retried_http_answer_naming_its_calls_leaves_a_later_question_holding_none(
    backend: Backend,
) -> None:
    """API.md: over HTTP, a retry of an answer naming its calls (`calls`), sent after the
    request id was asked again about no call, answers 200 as the first did and leaves the
    new question pending."""
    store = ConversationStore(backend.db)
    async with serve(backend.db, seeded=False) as api:
        url, headers = f"/v1/conversations/{CID}", auth_headers()
        body = {"turn_id": "t1", "messages": _asks_over_http("c1", "pay")}
        assert (await api.http.post(f"{url}/turns", json=body, headers=headers)).is_success
        calls = [{"tool_call_id": c.tool_call_id, "message_id": c.message_id}
                 for c in await store.pending_calls(CID)]  # fmt: skip
        answer = {"request_id": "confirm-1", "calls": calls}
        first = await api.http.post(f"{url}/hitl/resolve", json=answer, headers=headers)
        for turn_id, messages in (
            ("t2", [_answer("c1", "paid")]),
            ("t3", [_user("Delete my account."), _asks("confirm-1")]),
        ):
            body = {"turn_id": turn_id, "messages": messages}
            assert (await api.http.post(f"{url}/turns", json=body, headers=headers)).is_success

        retry = await api.http.post(f"{url}/hitl/resolve", json=answer, headers=headers)

    assert (first.status_code, retry.status_code) == (200, 200)
    assert retry.json() == first.json()
    assert await held_state(store) == ([], "confirm-1")


async def test_an_answer_naming_a_call_its_question_asked_about_before_making_it_answers_it(
    backend: Backend,
) -> None:
    """A question asked about `c1` before its turn makes `c1` holds no call: an answer naming
    `c1` answers it, as one naming no call would."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [_user("Pay."), _asks_about("confirm-1", "c1"), _book("c1", "pay")], turn_id="t0"
    )
    read = await store.pending_calls(CID)
    assert (await held_state(store))[1] == "confirm-1"

    await store.resolve_hitl(CID, "confirm-1", calls=read)

    assert (await held_state(store))[1] is None


# -- an answer to a prompt answered before ---------------------------------------------------

_DENIED = {"content": DENIED_RESULT, "error": {"message": "tool call denied"}}


async def _pay_and_mail_asked(
    backend: Backend,
) -> tuple[AgentMessageLogger, dict[str, PendingCall]]:
    """`confirm-1` holds pay (`a`) and mail (`b`), asked in one turn: the calls as read."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [_user("Pay and mail."), _book("a", "pay"), _book("b", "mail"),
              _asks_about("confirm-1", "a", "b")],
        turn_id="t0",
    )  # fmt: skip
    return logger, {c.tool_call_id: c for c in await store.pending_calls(CID)}


@pytest.mark.parametrize("naming", ["calls", "call_ids"])
async def test_an_answer_naming_a_call_a_runtime_denied_is_refused_once_another_call_is_approved(
    backend: Backend, naming: str
) -> None:
    """A runtime's turn denied `b`; tab A then approves `a`, then `b`: the approval of `b`
    names a call no answer to `confirm-1` released, so it is refused as it is before `a`'s
    approval (Conflict), not told the prompt was resolved."""
    logger, read = await _pay_and_mail_asked(backend)
    store = ConversationStore(backend.db)
    denial = {"role": "tool", "tool_call_id": "b", **_DENIED}
    await logger.log_messages(
        CID, [denial], turn_id="t1", answers_to={"b": read["b"].message_id},
        refused_prompts={"b": "confirm-1"},
    )  # fmt: skip

    def named(call: PendingCall) -> dict[str, Any]:
        return {"calls": [call]} if naming == "calls" else {"call_ids": [call.tool_call_id]}

    await store.resolve_hitl(CID, "confirm-1", **named(read["a"]))
    with pytest.raises(Conflict, match="'confirm-1'"):
        await store.resolve_hitl(CID, "confirm-1", **named(read["b"]))
    await store.resolve_hitl(CID, "confirm-1", **named(read["a"]))  # a retry: as the first

    assert await held_state(store) == ([("a", None)], None)


@pytest.mark.parametrize(
    "named",
    [
        pytest.param({"call_ids": ["tc-2"]}, id="another-prompts-call"),
        pytest.param({"call_ids": ["tc-1", "tc-2"]}, id="its-call-and-another-prompts"),
        pytest.param({"call_ids": ["tc-nowhere"]}, id="no-such-call"),
    ],
)
async def test_an_answer_to_a_resolved_prompt_naming_a_call_it_never_released_is_refused(
    backend: Backend, named: dict[str, Any]
) -> None:
    """`confirm-1` was answered (releasing tc-1): an answer to it naming tc-2, which
    `confirm-2` holds, or a call no prompt holds, is no retry of that answer: Conflict, and
    tc-2 stays held by `confirm-2`."""
    runtime = Runtime(backend)
    await runtime.stream(TWO_ASKS, prompt="Book the train and the hotel.")
    await runtime.store.resolve_hitl(CID, "confirm-1", call_ids=["tc-1"])

    with pytest.raises(Conflict, match="'confirm-1'"):
        await runtime.store.resolve_hitl(CID, "confirm-1", **named)

    assert await held_state(runtime.store) == ([("tc-1", None), ("tc-2", "confirm-2")], "confirm-2")


async def test_a_retried_answer_to_a_prompt_holding_no_call_answers_as_the_first_did(
    backend: Backend,
) -> None:
    """A question holding no call is answered whatever calls the answer names: a retry of
    that answer is answered the same (200), releasing nothing."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Hi."), _asks("confirm-1")], turn_id="t0")

    await store.resolve_hitl(CID, "confirm-1", call_ids=["tc-1"])
    await store.resolve_hitl(CID, "confirm-1", call_ids=["tc-1"])

    assert await held_state(store) == ([], None)


async def test_an_answer_naming_a_call_never_made_here_does_not_answer_a_prompt_holding_none(
    backend: Backend,
) -> None:
    """API.md: a call named by its identity (`calls`) that no prompt of the id holds and no
    answer to it released is a Conflict (409), a pending prompt holding no call included:
    an identity no message of the conversation made (forged, or read in a fork) answers
    nothing, nothing written; one of a call made here answers it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    paid = await logger.log_messages(
        CID, [_user("Pay."), _book("c1", "pay"), _answer("c1", "paid")], turn_id="t0"
    )
    await logger.log_messages(CID, [_user("Delete my account."), _asks("confirm-1")], turn_id="t1")
    before = await backend.db.agent_conversations.find_one({"_id": CID})

    for call_id, made_by in (("c-never", "msg-never"), ("c1", "msg-in-a-fork")):
        named = [{"tool_call_id": call_id, "message_id": made_by}]
        with pytest.raises(Conflict, match="holds none of the calls the answer names"):
            await store.resolve_hitl(CID, "confirm-1", calls=named)
    assert await backend.db.agent_conversations.find_one({"_id": CID}) == before

    made = [{"tool_call_id": "c1", "message_id": paid.messages[1].id}]
    await store.resolve_hitl(CID, "confirm-1", calls=made)
    assert await held_state(store) == ([], None)


async def test_an_http_answer_naming_a_call_never_made_to_a_prompt_holding_none_is_409(
    backend: Backend,
) -> None:
    """API.md, `POST …/hitl/resolve`: `calls` naming a call of an identity no message made,
    for the pending prompt holding no call, is a 409, nothing written."""
    async with serve(backend.db, seeded=False) as api:
        url, headers = f"/v1/conversations/{CID}", auth_headers()
        body = {"turn_id": "t1", "messages": [_user("Delete my account."), _asks("confirm-1")]}
        assert (await api.http.post(f"{url}/turns", json=body, headers=headers)).is_success
        before = await api.digest()
        named = [{"tool_call_id": "call_never", "message_id": "msg-never"}]
        answer = {"request_id": "confirm-1", "calls": named}
        refused = await api.http.post(f"{url}/hitl/resolve", json=answer, headers=headers)

        assert refused.status_code == 409, refused.text
        assert await api.digest() == before


@pytest.mark.parametrize(
    "answered_second", [False, True], ids=["second-pending", "second-answered"]
)
async def test_an_answer_naming_a_call_an_older_open_prompt_does_not_hold_names_those_it_holds(
    backend: Backend, answered_second: bool
) -> None:
    """`confirm-1` (asked first) holds tc-1 while `confirm-2` is the pending prompt: an answer
    to `confirm-1` naming another call is refused naming the calls `confirm-1` holds, not
    saying no such prompt is pending."""
    runtime = Runtime(backend)
    await runtime.stream(TWO_ASKS, prompt="Book the train and the hotel.")
    if answered_second:
        await runtime.store.resolve_hitl(CID, "confirm-2", call_ids=["tc-2"])
    before = await held_state(runtime.store)

    for typo in (["tc-l"], ["tc-2"]):
        with pytest.raises(Conflict) as refusal:
            await runtime.store.resolve_hitl(CID, "confirm-1", call_ids=typo)
        assert "'confirm-1'" in refusal.value.message
        assert "holds none of the calls the answer names; it holds 'tc-1'" in (
            refusal.value.message
        )
        assert "no pending prompt" not in refusal.value.message

    assert await held_state(runtime.store) == before


@pytest.mark.parametrize(
    ("refused", "error"),
    [
        ({"tc-9": 9}, re.escape("refused_prompts must map tool call ids")),
        ({"tc-9": "\ud800"}, "surrogate"),
    ],
    ids=["not-a-request-id", "lone-surrogate"],
)
async def test_refused_prompts_that_are_not_ids_to_request_ids_are_refused_writing_nothing(
    backend: Backend, refused: dict[str, Any], error: str
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    denial = {"role": "tool", "tool_call_id": "tc-9", "content": DENIED_RESULT,
              "error": {"message": "tool call denied"}}  # fmt: skip

    with pytest.raises(InvalidInput, match=error):
        await runtime.logger.log_messages(CID, [denial], refused_prompts=refused)

    assert await runtime.answers_of("tc-9") == []
    assert await held_calls(runtime.store) == [("tc-9", "confirm-9")]


async def test_resolving_with_call_ids_that_are_not_a_list_of_ids_is_refused_writing_nothing(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")

    with pytest.raises(InvalidInput, match="call_ids must be a list of tool call ids"):
        await runtime.store.resolve_hitl(CID, "confirm-9", call_ids="tc-9")

    assert await held_calls(runtime.store) == [("tc-9", "confirm-9")]
    assert await runtime.store.pending_hitl(CID) is not None


@pytest.mark.parametrize(
    ("naming", "error"),
    [
        pytest.param(
            {"call_ids": ["tc-9", "x" * 201]},
            "call_ids[1] is 201 characters long: a tool call id has 1 to 200",
            id="an-id-too-long",
        ),
        pytest.param(
            {"call_ids": [f"tc-{i}" for i in range(101)]},
            "call_ids names 101 calls: an answer names at most 100",
            id="too-many-ids",
        ),
        pytest.param(
            {"calls": [{"tool_call_id": "y" * 201, "message_id": "m-1"}]},
            "calls[0].tool_call_id is 201 characters long: a tool call id has 1 to 200",
            id="a-call-id-too-long",
        ),
        pytest.param(
            {"calls": [{"tool_call_id": f"tc-{i}", "message_id": "m-1"} for i in range(101)]},
            "calls names 101 calls: an answer names at most 100",
            id="too-many-calls",
        ),
    ],
)
async def test_resolving_with_call_ids_past_the_http_limits_is_refused_writing_nothing(
    backend: Backend, naming: dict[str, Any], error: str
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    before = await backend.db["agent_conversations"].find_one({"_id": CID})

    with pytest.raises(InvalidInput, match=re.escape(error)):
        await runtime.store.resolve_hitl(CID, "confirm-9", **naming)

    assert await backend.db["agent_conversations"].find_one({"_id": CID}) == before


async def test_an_answer_records_only_the_calls_its_prompt_holds(backend: Backend) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    strangers = [f"stranger-{i}-" + "z" * 150 for i in range(99)]

    await runtime.store.resolve_hitl(CID, "confirm-9", call_ids=["tc-9", *strangers])

    doc = await backend.db["agent_conversations"].find_one({"_id": CID})
    assert [a.get("c") for a in doc["answered_prompts"]] == [[["tc-9", None]]]
    assert await held_calls(runtime.store) == [("tc-9", None)]


async def test_an_answer_naming_no_call_its_prompt_holds_records_none(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    asked = {"action": "confirm", "request_id": "q1", "params": {}}
    await logger.log_messages(
        CID, [{"role": "user", "content": "x"}, {"role": "assistant", "hitl_action": asked}]
    )

    await store.resolve_hitl(CID, "q1", call_ids=[f"{i}-" + "x" * 190 for i in range(100)])

    doc = await backend.db["agent_conversations"].find_one({"_id": CID})
    assert [a.get("c") for a in doc["answered_prompts"]] == [[]]
    assert await store.pending_hitl(CID) is None


async def test_a_result_answering_no_call_of_the_turn_nor_any_pending_one_is_refused(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    ghost = {"type": "tool_end", "tool_name": "book_train", "tool_call_id": "tc-404"}

    said = "a tool result answers 'tc-404', which is no call of this turn and no longer pending"
    with pytest.raises(InvalidInput, match=re.escape(said)):
        await runtime.stream([APPROVED, ghost])
    assert [c.tool_call_id for c in await runtime.store.pending_calls(CID)] == ["tc-9"]


async def test_a_turn_of_many_results_for_calls_no_turn_made_takes_only_the_pending_ones(
    backend: Backend,
) -> None:
    """Results answering calls no turn made are stored and change nothing pending, whatever
    their number; among them, an answer to a pending call takes the latest call of its id (an
    older one of that id stays pending), and an answer to the call the pending prompt holds
    clears the prompt, as the fold of the stored messages says. (The reservation compared
    each answer with the pending calls in an expression of its own.)"""
    from scripts.reservation_bounds import answers_turn

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    asked = {"action": "confirm", "request_id": "confirm-2", "tool_call_ids": ["tc-2"]}
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "go"}, _book("tc-1"), _book("tc-2"), _book("tc-3")],
        turn_id="t-1",
    )
    await logger.log_messages(
        CID, [_book("tc-1"), {"role": "assistant", "hitl_action": asked}], turn_id="t-2"
    )
    assert await pending_state(store) == (["tc-1", "tc-2", "tc-3", "tc-1"], "confirm-2")

    results = answers_turn(120)
    results[40:40] = [{"role": "tool", "tool_call_id": "tc-1", "content": "ok"}]
    results[90:90] = [{"role": "tool", "tool_call_id": "tc-2", "content": "ok"}]
    logged = await logger.log_messages(CID, results, turn_id="t-3")

    assert len(logged.messages) == 123
    assert await pending_state(store) == (["tc-1", "tc-3"], None)
    older = (await store.pending_calls(CID))[0]
    assert older.message_id == message_id(CID, "t-1", 1)  # the older call of its id
    assert await pending_state(store) == _folded(await store.transcript(CID))


async def test_an_answer_posted_over_http_in_a_later_turn_resolves_the_pending_call(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")

    async with serve(backend.db, seeded=False) as api:
        response = await api.http.post(
            f"/v1/conversations/{CID}/turns",
            json={
                "turn_id": "turn-http",
                "messages": [
                    {"role": "tool", "tool_call_id": "tc-9", "content": "B-42"},
                    {"role": "assistant", "content": "Booked."},
                ],
            },
            headers=auth_headers(),
        )

    assert response.status_code == 201
    assert await runtime.answers_of("tc-9") == [("B-42", None)]
    assert await runtime.store.pending_calls(CID) == []
    assert await runtime.store.pending_hitl(CID) is None  # the call it held back is answered


def _asks_over_http(call_id: str, tool: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"Please {tool}."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": tool, "arguments": "{}"}}]},
        {"role": "assistant", "content": f"OK to {tool}?", "hitl_action": {
            "action": tool, "params": {}, "request_id": "confirm-1", "tool_call_ids": [call_id]}},
    ]  # fmt: skip


async def _asked_and_answered_over_http(
    api: Any, call_id: str, tool: str, answer: dict[str, Any]
) -> Any:
    """A first turn posted asking `confirm-1` about `call_id`, then `answer` posted to it: the
    resolution's response."""
    url, headers = f"/v1/conversations/{CID}", auth_headers()
    body = {"turn_id": "t1", "messages": _asks_over_http(call_id, tool)}
    assert (await api.http.post(f"{url}/turns", json=body, headers=headers)).is_success
    return await api.http.post(f"{url}/hitl/resolve", json=answer, headers=headers)


async def test_a_retried_http_resolution_naming_its_calls_leaves_a_newer_prompt_of_its_id(
    backend: Backend,
) -> None:
    """API.md: a retry of a resolution that took effect answers 200 and writes nothing, also
    once a later turn asked its request id anew about another call: naming the calls it
    concerns (`call_ids`), the retry does not answer the new prompt."""
    store = ConversationStore(backend.db)
    async with serve(backend.db, seeded=False) as api:
        url, headers = f"/v1/conversations/{CID}", auth_headers()
        answer = {"request_id": "confirm-1", "call_ids": ["tc-1"]}
        first = await _asked_and_answered_over_http(api, "tc-1", "book_train", answer)
        body = {"turn_id": "t2", "messages": _asks_over_http("tc-20", "wire_money")}
        assert (await api.http.post(f"{url}/turns", json=body, headers=headers)).is_success

        retry = await api.http.post(f"{url}/hitl/resolve", json=answer, headers=headers)
        malformed = await api.http.post(
            f"{url}/hitl/resolve", json={**answer, "call_ids": "tc-20"}, headers=headers
        )

    assert (first.status_code, retry.status_code) == (200, 200)
    assert retry.json() == first.json() == {"request_id": "confirm-1", "resolved": True}
    assert malformed.status_code == 422
    assert await held_state(store) == ([("tc-1", None), ("tc-20", "confirm-1")], "confirm-1")


async def _posted_answer(
    backend: Backend, turn_id: str, call_id: str, content: str, made_by: str
) -> Any:
    """The response to a turn posted with a service token answering `call_id`, naming
    `made_by` as the message that made it (`answers_to`)."""
    async with serve(backend.db, seeded=False) as api:
        return await api.http.post(
            f"/v1/conversations/{CID}/turns",
            json={"turn_id": turn_id, "messages": [_answer(call_id, content)],
                  "answers_to": {call_id: made_by}},
            headers=auth_headers(),
        )  # fmt: skip


async def _confirm_1_asked_twice(backend: Backend) -> tuple[AgentMessageLogger, ConversationStore]:
    """`confirm-1` asks about `a` (delete_files), then again about `b` (send_mail), one turn
    each, neither answered."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [_user("Clean up."), _book("a", "delete_files"), _asks_about("confirm-1", "a")],
        turn_id="t0",
    )  # fmt: skip
    await logger.log_messages(
        CID, [_user("Mail Bob."), _book("b", "send_mail"), _asks_about("confirm-1", "b")],
        turn_id="t1",
    )  # fmt: skip
    return logger, store


async def test_an_answer_naming_its_calls_releases_only_those_of_a_request_id_asked_twice(
    backend: Backend,
) -> None:
    """API.md (`calls` tells them apart): `confirm-1` asked about `a`, then again about `b`,
    neither answered. An answer naming `b` releases `b` only: `a`, which nobody approved,
    stays held by its question, the person refuses it, and answering it later naming `a`
    releases it. The fold of the stored messages with the answers says the same."""
    logger, store = await _confirm_1_asked_twice(backend)
    read = await store.pending_calls(CID)

    await store.resolve_hitl(CID, "confirm-1", calls=[c for c in read if c.tool_call_id == "b"])

    assert await held_state(store) == ([("a", "confirm-1"), ("b", None)], None)
    stored, folded = await _as_stored_and_folded(backend, store)
    assert folded == stored
    await store.resolve_hitl(CID, "confirm-1", calls=[c for c in read if c.tool_call_id == "b"])
    assert await held_state(store) == ([("a", "confirm-1"), ("b", None)], None)  # a retry
    await logger.log_messages(CID, [_user("Don't delete."), _denial("a")], turn_id="t2")
    assert await held_state(store) == ([("b", None)], None)


async def test_an_answer_naming_the_first_questions_call_releases_it_and_not_the_second(
    backend: Backend,
) -> None:
    """The other way round: naming `a` releases `a` only, `b` stays held, and an answer naming
    `b` then releases it; the request id is then resolved, as an answer naming every call."""
    logger, store = await _confirm_1_asked_twice(backend)

    await store.resolve_hitl(CID, "confirm-1", call_ids=["a"])
    assert (await held_state(store))[0] == [("a", None), ("b", "confirm-1")]
    stored, folded = await _as_stored_and_folded(backend, store)
    assert folded == stored
    await store.resolve_hitl(CID, "confirm-1", call_ids=["b"])

    assert await held_state(store) == ([("a", None), ("b", None)], None)
    stored, folded = await _as_stored_and_folded(backend, store)
    assert folded == stored
    with pytest.raises(AnsweredBefore):
        await logger.log_messages(CID, [_user("No."), _denial("b")], turn_id="t2")


@pytest.mark.parametrize("naming", ["call_ids", "calls"])
async def test_an_answer_naming_one_call_leaves_held_a_call_its_request_id_asked_again(
    backend: Backend, naming: str
) -> None:
    """DESIGN.md §2 `approved_calls` (a later prompt naming the call holds it again) and API.md
    (an answer naming calls releases those calls only): `confirm-1` asks about `a` and `b`, the
    answer naming `a` releases it, then `confirm-1` asks again about `a`. The answer naming `b`
    releases `b` only: `a` stays held by the question asked again, unanswered (the id is not
    resolved, so a denial of `a` is stored), and the fold of the stored messages with the
    answers says the same."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    t0 = [_user("Clean up."), _calls("a", "b"), _asks_about("confirm-1", "a", "b")]
    await logger.log_messages(CID, t0, turn_id="t0")
    read = await store.pending_calls(CID)

    async def answer(call_id: str) -> None:
        if naming == "call_ids":
            await store.resolve_hitl(CID, "confirm-1", call_ids=[call_id])
        else:
            named = [c for c in read if c.tool_call_id == call_id]
            await store.resolve_hitl(CID, "confirm-1", calls=named)

    await answer("a")
    await logger.log_messages(CID, [_user("Sure?"), _asks_about("confirm-1", "a")], turn_id="t1")
    assert await held_state(store) == ([("a", "confirm-1"), ("b", "confirm-1")], "confirm-1")

    await answer("b")

    assert (await held_state(store))[0] == [("a", "confirm-1"), ("b", None)]
    stored, folded = await _as_stored_and_folded(backend, store)
    assert folded == stored
    await logger.log_messages(CID, [_user("Don't."), _denial("a")], turn_id="t2")
    assert (await held_state(store))[0] == [("b", None)]


async def test_a_pop_of_a_denial_records_the_approval_of_the_call_its_prompts_answer_released(
    backend: Backend,
) -> None:
    """DESIGN.md §2 `approved_calls` (a call an answer released: its denial refused, whatever
    becomes of its prompt's request id): `confirm-1` asks about `a` and `b`, a turn denies
    `a`, the person resolves `confirm-1` (releasing `b`), and the denial is popped. What
    remains is `confirm-1` asking about both and answered: both are released, and the pop
    records both approvals, so a denial of `a` is refused, also once `confirm-1` asks again
    about `b`, and in a fork of all that remains."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    t0 = [_user("Clean up."), _calls("a", "b"), _asks_about("confirm-1", "a", "b")]
    made_by = (await logger.log_messages(CID, t0, turn_id="t0")).messages[1].id
    await logger.log_messages(CID, [_denial("a")], turn_id="t1", answers_to={"a": made_by})
    await store.resolve_hitl(CID, "confirm-1")
    assert (await store.pop_last_message(CID)).tool_call_id == "a"  # the denial

    async def denial_refused(cid: str = CID) -> bool:
        try:
            await logger.check_turn(cid, [_denial("a")], turn_id="probe", answers_to={"a": made_by})
        except AnsweredBefore:
            return True
        return False

    assert await held_state(store) == ([("a", None), ("b", None)], None)
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert doc is not None
    assert sorted(a["tool_call_id"] for a in doc["approved_calls"]) == ["a", "b"]
    assert await denial_refused()
    last = (await store.transcript(CID))[-1].seq
    assert last is not None
    await logger.fork(CID, last, "conv-fork")
    assert await denial_refused("conv-fork")
    await logger.log_messages(CID, [_user("And b?"), _asks_about("confirm-1", "b")], turn_id="t2")
    assert await held_state(store) == ([("a", None), ("b", "confirm-1")], "confirm-1")
    assert await denial_refused()


async def test_an_http_answer_naming_one_call_of_a_request_id_asked_twice_leaves_the_other_held(
    backend: Backend,
) -> None:
    """API.md: over HTTP, the owner answers the second `confirm-1` naming its call; the first
    question's call stays held, and the turn refusing it is stored (201), not 409."""
    async with serve(backend.db, seeded=False) as api:
        url, headers = f"/v1/conversations/{CID}", auth_headers()
        for turn_id, call_id, tool in (("t1", "a", "delete_files"), ("t2", "b", "send_mail")):
            body = {"turn_id": turn_id, "messages": _asks_over_http(call_id, tool)}
            assert (await api.http.post(f"{url}/turns", json=body, headers=headers)).is_success
        served = (await api.http.get(url, headers=headers)).json()["pending_calls"]
        named = [
            {"tool_call_id": c["tool_call_id"], "message_id": c["message_id"]}
            for c in served
            if c["tool_call_id"] == "b"
        ]
        answer = {"request_id": "confirm-1", "calls": named}
        resolved = await api.http.post(f"{url}/hitl/resolve", json=answer, headers=headers)
        after = (await api.http.get(url, headers=headers)).json()["pending_calls"]
        refusal = {"turn_id": "t3", "messages": [_user("Don't delete."), _denial("a")]}
        refused = await api.http.post(f"{url}/turns", json=refusal, headers=headers)

    assert resolved.status_code == 200
    assert [(c["tool_call_id"], c["request_id"]) for c in after] == [
        ("a", "confirm-1"),
        ("b", None),
    ]
    assert refused.status_code == 201, refused.text


async def test_a_stale_http_denial_naming_its_prompt_is_refused_once_a_second_question_holds_it(
    backend: Backend,
) -> None:
    """STREAMING.md (two answers racing): a turn posted over HTTP denying a call a person
    approved first gets 409 (`AnsweredBefore`), also once a second question holds the call,
    when it names the prompt its denial answers (`refused_prompts`); the real result is then
    the call's answer."""
    store = ConversationStore(backend.db)
    async with serve(backend.db, seeded=False) as api:
        url, headers = f"/v1/conversations/{CID}", auth_headers()
        answer = {"request_id": "confirm-1", "call_ids": ["tc-9"]}
        assert (await _asked_and_answered_over_http(api, "tc-9", "wire_money", answer)).is_success
        asks_again = {"role": "assistant", "content": "Add a note?", "hitl_action": {
            "action": "wire_money", "params": {}, "request_id": "confirm-2",
            "tool_call_ids": ["tc-9"]}}  # fmt: skip
        body = {"turn_id": "t2", "messages": [asks_again]}
        assert (await api.http.post(f"{url}/turns", json=body, headers=headers)).is_success
        denial = {"role": "tool", "tool_call_id": "tc-9", "content": DENIED_RESULT,
                  "error": {"message": "tool call denied"}}  # fmt: skip
        stale = {"turn_id": "tab-b", "messages": [{"role": "user", "content": "No."}, denial],
                 "refused_prompts": {"tc-9": "confirm-1"}}  # fmt: skip

        refused = await api.http.post(f"{url}/turns", json=stale, headers=headers)
        hostile = await api.http.post(
            f"{url}/turns", json={**stale, "refused_prompts": {"tc-9": 1}}, headers=headers
        )

    assert refused.status_code == 409
    assert hostile.status_code == 422
    assert await held_state(store) == ([("tc-9", "confirm-2")], "confirm-2")


async def test_a_posted_answer_to_a_call_another_tab_answered_first_is_refused(
    backend: Backend,
) -> None:
    """Over HTTP a turn names the call each of its answers answers (`answers_to`, as read from
    `pending_calls`): a second answer to a call another turn answered first is a 409, nothing
    written; one that is not a map of ids is a 422."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    (call,) = await runtime.store.pending_calls(CID)
    async with serve(backend.db, seeded=False) as api:
        url, headers = f"/v1/conversations/{CID}/turns", auth_headers()

        def turn(turn_id: str, answer: dict[str, Any]) -> dict[str, Any]:
            return {"turn_id": turn_id, "messages": [answer],
                    "answers_to": {"tc-9": call.message_id}}  # fmt: skip

        first = await api.http.post(url, json=turn("tab-a", _DENIAL), headers=headers)
        second = await api.http.post(url, json=turn("tab-b", _BOOKED_RESULT), headers=headers)
        hostile = await api.http.post(
            url, json={**turn("tab-c", _BOOKED_RESULT), "answers_to": ["tc-9"]}, headers=headers
        )

    assert first.status_code == 201
    assert second.status_code == 409
    assert "'tc-9'" in second.json()["error"]["message"]
    assert hostile.status_code == 422
    assert await runtime.answers_of("tc-9") == [(DENIED_RESULT, "tool call denied")]


async def test_an_answer_naming_a_message_that_makes_no_such_call_here_is_refused_as_invalid(
    backend: Backend,
) -> None:
    """`answers_to` naming, for a pending call, a message that does not make it in this
    conversation (the pending calls read from a fork by mistake) is InvalidInput (422) saying
    so, nothing written: not `AnsweredBefore`, since nobody answered the call, and a runtime
    told to log the turn without the answer would drop the real result."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Book."), _calls("c1")], turn_id="t0")
    await logger.fork(CID, 1, "conv-fork")
    (read_from_the_fork,) = await store.pending_calls("conv-fork")

    with pytest.raises(InvalidInput, match="does not make call 'c1'") as refused:
        await logger.log_messages(
            CID, [_answer("c1", "booked")], answers_to={"c1": read_from_the_fork.message_id}
        )

    assert "answered" not in str(refused.value)
    assert await held_state(store) == ([("c1", None)], None)
    posted = await _posted_answer(backend, "t1", "c1", "booked", read_from_the_fork.message_id)
    assert posted.status_code == 422


async def _a_call_the_bounded_list_dropped(
    logger: AgentMessageLogger, store: ConversationStore
) -> PendingCall:
    """c0 left pending, then a turn leaving `PENDING_CALLS_KEPT` calls pending: c0 is off
    the bounded list, though nobody answered it. Returns c0 as it was listed."""
    await logger.log_messages(CID, [_user("Look it up."), _calls("c0")], turn_id="t0")
    (read,) = await store.pending_calls(CID)
    newer = [f"c{n}" for n in range(1, PENDING_CALLS_KEPT + 1)]
    await logger.log_messages(CID, [_calls(*newer)], turn_id="t1")
    assert "c0" not in [c.tool_call_id for c in await store.pending_calls(CID)]
    return read


async def test_an_answer_to_a_call_the_bounded_pending_list_dropped_is_stored_as_its_answer(
    backend: Backend,
) -> None:
    """DESIGN.md §3: a call off the bounded `pending_calls` list is not answered. Its answer,
    naming it as it was listed (`answers_to`), is stored, the list as it was; a second
    answer naming it is then refused (`AnsweredBefore`): that first answer is there."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    read = await _a_call_the_bounded_list_dropped(logger, store)
    listed = await store.pending_calls(CID)

    logged = await logger.log_messages(
        CID, [_answer("c0", "42")], turn_id="late", answers_to={"c0": read.message_id}
    )

    assert [m.content for m in logged.messages] == ["42"]
    assert await store.pending_calls(CID) == listed
    with pytest.raises(AnsweredBefore, match="'c0'"):
        await logger.log_messages(
            CID, [_answer("c0", "43")], turn_id="later", answers_to={"c0": read.message_id}
        )
    assert [m.content for m in await store.transcript(CID) if m.tool_call_id == "c0"] == ["42"]


async def test_a_posted_answer_to_a_call_the_bounded_pending_list_dropped_is_stored(
    backend: Backend,
) -> None:
    """Over HTTP too: the answer naming a call off the bounded list, which nobody answered,
    is 201, not the 409 of a call another turn answered first."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    read = await _a_call_the_bounded_list_dropped(logger, store)
    posted = await _posted_answer(backend, "late", "c0", "42", read.message_id)

    assert posted.status_code == 201
    assert [m.content for m in await store.transcript(CID) if m.tool_call_id == "c0"] == ["42"]


async def _answer_reserved_only(
    logger: AgentMessageLogger, monkeypatch: pytest.MonkeyPatch, read: PendingCall
) -> None:
    """A turn answering `read` reserves (taking it off `pending_calls`) and stores nothing:
    still being written, or its process died and it is never retried."""

    async def lost(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the turn reserved and has not inserted")

    monkeypatch.setattr(logger._messages, "insert_many", lost)
    with pytest.raises(ConnectionError):
        await logger.log_messages(
            CID, [_answer("c0", "A")], turn_id="dead", answers_to={"c0": read.message_id}
        )
    monkeypatch.undo()


async def test_an_answer_whose_only_earlier_answer_was_abandoned_unstored_is_stored(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn answering c0 reserved and never stored its answer; past `abandon_after` its
    block is passed, and c0 has no answer: a later answer naming c0 (`answers_to`, as
    `log_streamed_turn` always names it) is stored, and every replay gives it."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Look it up."), _calls("c0")], turn_id="t0")
    (read,) = await store.pending_calls(CID)
    await _answer_reserved_only(logger, monkeypatch, read)

    await logger.log_messages(
        CID, [_answer("c0", "B")], turn_id="other", answers_to={"c0": read.message_id}
    )

    assert await store.pending_calls(CID) == []
    exported = chat_completions(await store.transcript(CID))
    assert [m["content"] for m in exported if m.get("tool_call_id") == "c0"] == ["B"]


async def test_an_answer_while_another_answer_to_its_call_is_still_being_written_is_retried(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn answering c0 reserved less than `abandon_after` ago and stored nothing yet: its
    insert may still land, or never. No answer is stored, so a second answer naming c0 is not
    refused for good (`AnsweredBefore` is final: the runtime would drop the only real answer):
    it is told to come again (`StorageUnavailable`, retryable), by `check_turn` too, nothing
    written; once the first answerer's block is abandoned, the same turn is stored."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Look it up."), _calls("c0")], turn_id="t0")
    (read,) = await store.pending_calls(CID)
    await _answer_reserved_only(logger, monkeypatch, read)
    before = await store.transcript(CID)
    turn: dict[str, Any] = {
        "messages": [_answer("c0", "B")],
        "turn_id": "other",
        "answers_to": {"c0": read.message_id},
    }

    with pytest.raises(StorageUnavailable, match=r"'c0'.*still being written.*retry shortly"):
        await logger.check_turn(CID, **turn)
    with pytest.raises(StorageUnavailable, match=r"'c0'.*still being written.*retry shortly"):
        await logger.log_messages(CID, **turn)

    assert await store.transcript(CID) == before
    await _late_logger(backend).log_messages(CID, **turn)
    exported = chat_completions(await store.transcript(CID))
    assert [m["content"] for m in exported if m.get("tool_call_id") == "c0"] == ["B"]


async def test_an_answer_after_another_answer_to_its_call_is_stored_is_refused(
    backend: Backend,
) -> None:
    """Once an answer to c0 is stored, a second answer naming c0 is refused for good
    (`AnsweredBefore`), by `check_turn` too, nothing written."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Look it up."), _calls("c0")], turn_id="t0")
    (read,) = await store.pending_calls(CID)
    await logger.log_messages(
        CID, [_answer("c0", "A")], turn_id="first", answers_to={"c0": read.message_id}
    )
    before = await store.transcript(CID)
    turn: dict[str, Any] = {
        "messages": [_answer("c0", "B")],
        "turn_id": "other",
        "answers_to": {"c0": read.message_id},
    }

    with pytest.raises(AnsweredBefore, match="'c0'"):
        await logger.check_turn(CID, **turn)
    with pytest.raises(AnsweredBefore, match="'c0'"):
        await logger.log_messages(CID, **turn)

    assert await store.transcript(CID) == before


async def _call_turn(
    backend: Backend, logger: AgentMessageLogger, monkeypatch: pytest.MonkeyPatch, stored: bool
) -> PendingCall:
    """t0 makes c0: stored, or reserved with its insert still to land (its writer lost it
    within `abandon_after`); c0 as `pending_calls` serves it either way."""
    with monkeypatch.context() as lost:
        if not stored:
            lost.setattr(logger._messages, "insert_many", _lost_insert)
        with contextlib.suppress(ConnectionError):
            await logger.log_messages(CID, [_user("Look it up."), _calls("c0")], turn_id="t0")
    (read,) = await ConversationStore(backend.db).pending_calls(CID)
    return read


_STALE_ANSWERS = [
    pytest.param({"role": "tool", "tool_call_id": "c0", "content": "B"}, id="a result"),
    pytest.param({**_DENIAL, "tool_call_id": "c0"}, id="a denial"),
]
_CALL_TURN = [True, False]
_CALL_TURN_IDS = ["its call stored", "its call still written"]


@pytest.mark.parametrize("stale", _STALE_ANSWERS)
@pytest.mark.parametrize("stored", _CALL_TURN, ids=_CALL_TURN_IDS)
async def test_a_stale_tabs_answer_to_a_call_answered_first_is_answered_before(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, stored: bool, stale: dict[str, Any]
) -> None:
    """Tab A answered c0 (`answers_to` as `pending_calls` served it); a stale tab answers it
    too, naming the same message: `AnsweredBefore` (a call's first answer is its answer),
    by `check_turn` too, nothing written, whether the turn making c0 is stored or its insert
    is still to land. Never `InvalidInput` for a message named as it was told to."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    read = await _call_turn(backend, logger, monkeypatch, stored)
    served = {"c0": read.message_id}
    await logger.log_messages(CID, [_answer("c0", "A")], turn_id="tab-a", answers_to=served)
    before = await store.transcript(CID)

    for attempt in (logger.check_turn, logger.log_messages):
        with pytest.raises(AnsweredBefore, match="'c0'") as refused:
            await attempt(CID, [stale], turn_id="stale-tab", answers_to=served)
        assert refused.value.tool_call_ids == ("c0",)

    assert await store.transcript(CID) == before


@pytest.mark.parametrize("in_flight", [False, True], ids=["", "another turn in flight"])
@pytest.mark.parametrize("stale", _STALE_ANSWERS)
async def test_a_stale_tabs_answer_once_the_unstored_call_turn_is_passed_is_answered_before(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    clocks: StoreClocks,
    stale: dict[str, Any],
    in_flight: bool,
) -> None:
    """The turn making c0 never stored it (its writer died); tab A answered c0 as
    `pending_calls` served it. Past `abandon_after` readers pass that turn, and a stale tab's
    answer naming the same message is still `AnsweredBefore` (A's answer is stored), never
    `InvalidInput` "does not make call … a fork?", by `check_turn` too, nothing written;
    also while another turn, reserved since, is still being written (its block young)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    read = await _call_turn(backend, logger, monkeypatch, stored=False)
    served = {"c0": read.message_id}
    await logger.log_messages(CID, [_answer("c0", "A")], turn_id="tab-a", answers_to=served)
    before, late = await store.transcript(CID), _late_logger(backend)
    if in_flight:  # t0's block passed (1 s), t9's still being written
        late = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(seconds=1)))
        clocks.wait(1.2)
        with monkeypatch.context() as lost:
            lost.setattr(logger._messages, "insert_many", _lost_insert)
            with contextlib.suppress(ConnectionError):
                await logger.log_messages(CID, [_user("Meanwhile.")], turn_id="t9")

    for attempt in (late.check_turn, late.log_messages):
        with pytest.raises(AnsweredBefore, match="'c0'") as refused:
            await attempt(CID, [stale], turn_id="stale-tab", answers_to=served)
        assert refused.value.tool_call_ids == ("c0",)

    assert await store.transcript(CID) == before


_STAND_IN = "msg-still-being-written"
"""The id `calls_answered` names a call by while its turn is still being written (LIBRARY.md)."""


async def _leftover_of_an_earlier_life(backend: Backend, message_id: str, seq: int) -> None:
    """The message `message_id` stored again under its conversation's id at `seq`, as a late
    insert of the life a delete ended leaves it until the delete's sweep (RELIABILITY.md)."""
    messages = backend.db["agent_messages"]
    stored = await messages.find_one({"_id": message_id})
    await ConversationStore(backend.db).delete(CID)
    await AgentMessageLogger(backend.db).log_messages(
        CID, [_user("A new start."), _say("Hello.")], turn_id="new-life"
    )
    await messages.insert_one({**stored, "seq": seq})


async def test_an_answer_naming_a_call_of_an_earlier_life_of_the_id_is_refused_while_left(
    backend: Backend,
) -> None:
    """A stale tab read c0 before the conversation was deleted and started again; it answers
    c0 naming the message that made it then. That message, left under the id by a late insert
    until the delete's sweep, is no message of this conversation: 422, nothing stored, as
    once it is swept (was: stored, a result for a call the conversation never made)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Look it up."), _calls("c0")], turn_id="t0")
    (read,) = await store.pending_calls(CID)
    await _leftover_of_an_earlier_life(backend, read.message_id, seq=5)
    before = await store.transcript(CID)

    for attempt in (logger.check_turn, logger.log_messages):
        with pytest.raises(InvalidInput, match="does not make call 'c0'"):
            await attempt(
                CID, [_answer("c0", "B")], turn_id="stale", answers_to={"c0": read.message_id}
            )

    assert await store.transcript(CID) == before


async def test_a_bridge_answer_is_judged_by_this_lifes_call_not_an_earlier_lifes_leftover(
    backend: Backend,
) -> None:
    """The call c0 `calls_answered` named by its stand-in (its turn was still being written)
    is placed at the message of this life that stored it, never at a leftover of an earlier
    life of the id making a call of the same id: tab A's answer is there, `AnsweredBefore`,
    nothing stored twice (was: judged from the leftover, a second answer stored)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Look it up."), _calls("c0")], turn_id="old")
    (old,) = await store.pending_calls(CID)
    await _leftover_of_an_earlier_life(backend, old.message_id, seq=40)
    await logger.log_messages(CID, [_user("Look again."), _calls("c0")], turn_id="t0")
    (read,) = await store.pending_calls(CID)
    await logger.log_messages(
        CID, [_answer("c0", "A")], turn_id="tab-a", answers_to={"c0": read.message_id}
    )
    before = await store.transcript(CID)

    with pytest.raises(AnsweredBefore, match="'c0'"):
        await logger.log_messages(
            CID, [_answer("c0", "B")], turn_id="tab-b", answers_to={"c0": _STAND_IN}
        )

    assert await store.transcript(CID) == before


async def test_a_bridges_answer_once_the_unstored_call_turn_is_passed_is_answered_before(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same as a runtime's bridge logs it (`calls_answered`, then `log_messages`, as
    `log_run`, `add_items` and `aadd_messages` do): past `abandon_after`, the call no stored
    message makes whose answer tab A stored is named as `pending_calls` served it, and the
    stale answer is `AnsweredBefore`, never stored as a second answer (was: left out of
    `answers_to` and stored)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    read = await _call_turn(backend, logger, monkeypatch, stored=False)
    await logger.log_messages(
        CID, [_answer("c0", "A")], turn_id="tab-a", answers_to={"c0": read.message_id}
    )
    before, late = await store.transcript(CID), _late_logger(backend)
    stale = messages_adapter.validate_python([_answer("c0", "B")])

    named = await late.calls_answered(CID, stale)

    with pytest.raises(AnsweredBefore, match="'c0'"):
        await late.log_messages(CID, stale, turn_id="tab-b", answers_to=named)
    assert await store.transcript(CID) == before


@pytest.mark.parametrize("passed", [False, True], ids=["", "past abandon_after"])
@pytest.mark.parametrize("stored", _CALL_TURN, ids=_CALL_TURN_IDS)
async def test_a_stale_streamed_denial_of_a_call_answered_first_is_logged_without_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, stored: bool, passed: bool
) -> None:
    """A stale streamed turn denies c0, which tab A answered first, then replies:
    `log_streamed_turn` logs the turn without the denial (it denies nothing), its reply kept,
    whether the turn making c0 is stored or its insert is still to land, also once readers
    pass that turn (its writer died: past `abandon_after`)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    read = await _call_turn(backend, logger, monkeypatch, stored)
    served = {"c0": read.message_id}
    await logger.log_messages(CID, [_answer("c0", "A")], turn_id="tab-a", answers_to=served)
    said = [{**_DENIAL, "tool_call_id": "c0"}, _say("Cancelled. Anything else?")]
    turn = StreamedTurn(
        messages=tuple(messages_adapter.validate_python(said)),
        interrupted=False,
        answered_calls=(("c0", read.message_id),),
    )

    streaming = _late_logger(backend) if passed else logger

    logged = await log_streamed_turn(
        logger=streaming, store=store, conversation_id=CID, turn=turn, turn_id="stale-stream"
    )

    assert [(m.role, m.content) for m in logged.messages] == [
        ("assistant", "Cancelled. Anything else?")
    ]
    answers = [m.content for m in await store.transcript(CID) if m.tool_call_id == "c0"]
    assert answers == ["A"]


@pytest.mark.parametrize(
    "first",
    [{"role": "tool", "tool_call_id": "c0", "content": "A"}, {**_DENIAL, "tool_call_id": "c0"}],
    ids=["a result first", "a denial first"],
)
async def test_a_stale_streamed_turn_only_denying_a_call_answered_first_stores_nothing(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, first: dict[str, Any]
) -> None:
    """A stale streamed turn only denies c0, which tab A answered first (the stream ended
    after the refusal): the turn without its denial holds nothing, so `log_streamed_turn`
    stores nothing and says so (no message, not a replay), tab A's answer c0's only one, and
    its retry is the same (was: InvalidInput "a turn needs at least one message", as for a
    stream that said nothing)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    read = await _call_turn(backend, logger, monkeypatch, stored=True)
    await logger.log_messages(CID, [first], turn_id="tab-a", answers_to={"c0": read.message_id})
    before = await store.transcript(CID)
    turn = StreamedTurn(
        messages=tuple(messages_adapter.validate_python([{**_DENIAL, "tool_call_id": "c0"}])),
        interrupted=False,
        answered_calls=(("c0", read.message_id),),
    )

    for _ in range(2):
        logged = await log_streamed_turn(
            logger=logger, store=store, conversation_id=CID, turn=turn, turn_id="stale-stream"
        )
        assert logged == LoggedTurn(
            conversation_id=CID, turn_id="stale-stream", messages=[], replayed=False
        )

    assert await store.transcript(CID) == before


async def test_a_stale_answer_while_its_call_and_the_first_answer_are_still_written_is_retried(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn making c0 and tab A's answer to it both reserved, neither insert landed yet
    (within `abandon_after`): a stale tab answering c0 as `pending_calls` served it is told
    to come again (`StorageUnavailable`: the first answer is still being written), by
    `check_turn` too, nothing written; never `InvalidInput`."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    read = await _call_turn(backend, logger, monkeypatch, stored=False)
    await _answer_reserved_only(logger, monkeypatch, read)
    turn: dict[str, Any] = {
        "messages": [_answer("c0", "B")],
        "turn_id": "stale-tab",
        "answers_to": {"c0": read.message_id},
    }

    for attempt in (logger.check_turn, logger.log_messages):
        with pytest.raises(StorageUnavailable, match=r"'c0'.*still being written.*retry"):
            await attempt(CID, **turn)

    assert await store.transcript(CID) == []


async def test_a_stale_http_answer_to_a_call_answered_first_is_a_409(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """API.md: tab A answered c0 over POST /turns while the turn making it is still to be
    stored; a stale tab's answer naming the message GET served is a 409 (answered before),
    not a 422."""
    async with serve(backend.db, seeded=False) as api:
        url, headers = f"/v1/conversations/{CID}", auth_headers()
        call = {"turn_id": "t0", "messages": [_user("Look it up."), _calls("c0")]}
        with monkeypatch.context() as lost:
            lost.setattr(api.store.logger._messages, "insert_many", _lost_insert)
            with contextlib.suppress(ConnectionError):
                await api.http.post(f"{url}/turns", json=call, headers=headers)
        [read] = (await api.http.get(url, headers=headers)).json()["pending_calls"]
        served = {"c0": read["message_id"]}
        for turn_id, text in (("tab-a", "A"), ("stale-tab", "B")):
            body = {"turn_id": turn_id, "answers_to": served, "messages": [_answer("c0", text)]}
            answered = await api.http.post(f"{url}/turns", json=body, headers=headers)

    assert answered.status_code == 409, answered.text


async def test_a_retried_http_resolution_naming_calls_by_message_leaves_a_newer_prompt_of_both_ids(
    backend: Backend,
) -> None:
    """API.md: a resolution naming its calls by `tool_call_id` and `message_id` (`calls`, as
    `pending_calls` serves them), retried after a later turn asked the same request id about
    a call of the same id: 200 as the first, and the new prompt stays pending; an answer
    naming a call no prompt of the id holds nor was released by it is a 409."""
    store = ConversationStore(backend.db)
    async with serve(backend.db, seeded=False) as api:
        url, headers = f"/v1/conversations/{CID}", auth_headers()
        body = {"turn_id": "t1", "messages": _asks_over_http("call_0", "book_train")}
        assert (await api.http.post(f"{url}/turns", json=body, headers=headers)).is_success
        [read] = (await api.http.get(url, headers=headers)).json()["pending_calls"]
        answer = {"request_id": "confirm-1", "calls": [
            {"tool_call_id": read["tool_call_id"], "message_id": read["message_id"]}]}  # fmt: skip
        first = await api.http.post(f"{url}/hitl/resolve", json=answer, headers=headers)
        body = {"turn_id": "t2", "messages": _asks_over_http("call_0", "wire_money")}
        assert (await api.http.post(f"{url}/turns", json=body, headers=headers)).is_success

        retry = await api.http.post(f"{url}/hitl/resolve", json=answer, headers=headers)
        elsewhere = {"request_id": "confirm-1", "calls": [
            {"tool_call_id": "call_0", "message_id": "msg-of-no-turn"}]}  # fmt: skip
        unknown = await api.http.post(f"{url}/hitl/resolve", json=elsewhere, headers=headers)

    assert (first.status_code, retry.status_code) == (200, 200)
    assert retry.json() == first.json() == {"request_id": "confirm-1", "resolved": True}
    assert unknown.status_code == 409
    assert await held_state(store) == ([("call_0", None), ("call_0", "confirm-1")], "confirm-1")


# -- a late real result wins over the stand-in ----------------------------------------


async def test_a_late_real_result_is_what_every_replay_uses(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    cut_off = turn_from_sse(parse_sse_text((STREAMS / "sse_cut_off.sse").read_text()))
    await log_streamed_turn(
        logger=logger, store=store, conversation_id=CID, turn=cut_off, turn_id="t1", prompt="Book"
    )
    # The booking finished after the stream dropped; the runtime logs its result later.
    await logger.log_messages(
        CID,
        [
            {"role": "tool", "tool_call_id": "call_b1", "content": '{"booked":"TGV 6601"}'},
            {"role": "assistant", "content": "Booked: TGV 6601."},
        ],
        turn_id="t2",
    )
    stored = await store.transcript(CID)

    exported = chat_completions(stored)
    check_chat_completions(exported)
    assert [m["content"] for m in exported if m["role"] == "tool"] == ['{"booked":"TGV 6601"}']
    outputs = [i["output"] for i in responses_items(stored) if i["type"] == "function_call_output"]
    assert outputs == ['{"booked":"TGV 6601"}']
    returns = [
        p
        for m in history_from_messages(stored)
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    ]
    assert [(r.tool_call_id, r.content, r.outcome) for r in returns] == [
        ("call_b1", {"booked": "TGV 6601"}, "success")
    ]


# -- ids that stay unique -------------------------------------------------------------


async def test_ids_generated_for_calls_without_one_are_unique_within_the_conversation(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    weather = [
        {"type": "tool_start", "tool_name": "get_weather", "args": {"city": "Paris"}},
        {"type": "tool_end", "tool_name": "get_weather", "result": {"temp_c": 18}},
        {"type": "stream_token", "token": "18 °C."},
    ]

    await runtime.stream(weather, prompt="Weather in Paris?")
    await runtime.stream(weather, prompt="And now?")  # the same events, a turn later

    stored = await runtime.store.transcript(CID)
    call_ids = [c.id for m in stored for c in m.tool_calls or ()]
    assert len(call_ids) == 2
    assert len(set(call_ids)) == 2
    assert all(i.startswith("get_weather-") for i in call_ids)
    exported = chat_completions(stored)
    assert [c["id"] for m in exported for c in m.get("tool_calls", ())] == call_ids  # no renaming


async def test_a_conversation_lists_a_bounded_number_of_pending_calls(backend: Backend) -> None:
    calls = [
        {"id": f"c{n}", "function": {"name": "fire_and_forget", "arguments": "{}"}}
        for n in range(PENDING_CALLS_KEPT + 5)
    ]
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)

    await logger.log_messages(CID, [{"role": "assistant", "tool_calls": calls}], turn_id="t1")

    pending = await store.pending_calls(CID)
    assert len(pending) == PENDING_CALLS_KEPT
    assert pending[-1].tool_call_id == f"c{PENDING_CALLS_KEPT + 4}"  # the newest are kept


async def test_an_sse_prompt_naming_its_call_leaves_it_pending_for_a_later_result(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    asks = [
        {"type": "tool_call", "tool_call_id": "call_p1", "tool_name": "pay_invoice"},
        {"type": "hitl", "action": "confirm_payment", "request_id": "req-p1",
         "prompt": "Pay 120 EUR?", "tool_call_id": "call_p1"},
        {"type": "done"},
    ]  # fmt: skip
    await log_streamed_turn(
        logger=logger, store=store, conversation_id=CID, turn=turn_from_sse(asks),
        turn_id="t1", prompt="Pay the invoice.",
    )  # fmt: skip
    assert [c.request_id for c in await store.pending_calls(CID)] == ["req-p1"]

    paid = [
        {"type": "tool_result", "tool_call_id": "call_p1", "result": {"paid": True}},
        {"type": "text_delta", "delta": "Paid."},
        {"type": "done"},
    ]
    turn = turn_from_sse(paid, pending=await store.pending_calls(CID))
    await log_streamed_turn(
        logger=logger, store=store, conversation_id=CID, turn=turn, turn_id="t2", prompt="Yes."
    )

    assert await store.pending_calls(CID) == []
    assert await store.pending_hitl(CID) is None
    exported = chat_completions(await store.transcript(CID))
    check_chat_completions(exported)
    assert [m["content"] for m in exported if m["role"] == "tool"] == ['{"paid":true}']


# -- text BSON can store (the store-level rule lands with the write-path work) --------


async def test_a_surrogate_pair_split_across_two_stream_tokens_is_stored_joined(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    tokens = ["Trains ", "\ud83d", "\ude84 leave at 9."]  # a JavaScript runtime sliced 🚄

    await runtime.stream([{"type": "stream_token", "token": t} for t in tokens], prompt="When?")

    stored = await runtime.store.transcript(CID)
    assert stored[-1].content == "Trains 🚄 leave at 9."


async def test_a_lone_surrogate_in_a_stream_is_refused_and_nothing_is_stored(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)

    with pytest.raises(InvalidInput, match="surrogate"):
        await runtime.stream([{"type": "stream_token", "token": "cut \ud83d"}], prompt="When?")
    assert await backend.db.agent_messages.count_documents({}) == 0


@pytest.mark.wire
async def test_answering_a_pending_call_still_costs_two_round_trips(wire_backend: Backend) -> None:
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=COUNTED)
    call = {"id": "tc-9", "function": {"name": "book_train", "arguments": "{}"}}
    await logger.log_messages(CID, [{"role": "assistant", "tool_calls": [call]}], turn_id="t1")
    wire_backend.commands.clear()

    answer = [{"role": "tool", "tool_call_id": "tc-9", "content": "B-42"}]
    await logger.log_messages(CID, answer, turn_id="t2")

    assert wire_backend.commands.names == ["findAndModify", "insert"]
    assert await ConversationStore(wire_backend.db).pending_calls(CID) == []


# -- state after a rewind or a fork: what the messages left say ----------------------


async def pending_state(store: ConversationStore, cid: str = CID) -> tuple[list[str], str | None]:
    calls = [c.tool_call_id for c in await store.pending_calls(cid)]
    prompt = await store.pending_hitl(cid)
    return calls, prompt.request_id if prompt else None


def _book(call_id: str = "tc-9", name: str = "book_train") -> dict[str, Any]:
    return {"role": "assistant", "tool_calls": [{"id": call_id, "function": {"name": name,
            "arguments": "{}"}}]}  # fmt: skip


def _asks(request_id: str) -> dict[str, Any]:
    hitl = {"action": "confirm", "params": {}, "request_id": request_id}
    return {"role": "assistant", "content": "Sure?", "hitl_action": hitl}


async def _reserved_only(
    logger: AgentMessageLogger,
    monkeypatch: pytest.MonkeyPatch,
    messages: list[dict[str, Any]],
    turn_id: str,
) -> None:
    """Log a turn that reserves its `seq`s and stores nothing (the runtime is still writing
    it, or died after reserving)."""

    async def lost(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the turn reserved and has not inserted")

    monkeypatch.setattr(logger._messages, "insert_many", lost)
    with pytest.raises(ConnectionError):
        await logger.log_messages(CID, messages, turn_id=turn_id)
    monkeypatch.undo()


async def test_popping_a_prompt_then_its_call_leaves_nothing_pending(backend: Backend) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")  # user, call, prompt

    await runtime.store.pop_last_message(CID)  # the prompt
    assert await pending_state(runtime.store) == (["tc-9"], None)
    assert [c.request_id for c in await runtime.store.pending_calls(CID)] == [None]

    await runtime.store.pop_last_message(CID)  # the assistant message making the call
    assert await pending_state(runtime.store) == ([], None)


async def test_popping_an_answer_makes_its_call_and_prompt_pending_again(backend: Backend) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.logger.log_messages(
        CID, [{"role": "tool", "tool_call_id": "tc-9", "content": "B-42"}], turn_id="answer"
    )
    assert await pending_state(runtime.store) == ([], None)

    await runtime.store.pop_last_message(CID)

    assert await pending_state(runtime.store) == (["tc-9"], "confirm-9")
    assert await pending_state(runtime.store) == _folded(await runtime.store.transcript(CID))
    await runtime.stream([BOOKED])  # the documented next step takes the real result
    assert await runtime.answers_of("tc-9") == [('{"booking":"B-42"}', None)]
    assert await pending_state(runtime.store) == ([], None)


def _folded(messages: list[AgentMessage]) -> tuple[list[str], str | None]:
    calls, prompt = pending_after(messages)
    return [c.tool_call_id for c in calls], prompt.request_id if prompt else None


async def test_popping_an_answer_brings_back_no_prompt_resolved_by_request_id(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.store.resolve_hitl(CID, "confirm-9")
    await runtime.logger.log_messages(
        CID, [{"role": "tool", "tool_call_id": "tc-9", "content": "B-42"}], turn_id="answer"
    )

    await runtime.store.pop_last_message(CID)

    assert await pending_state(runtime.store) == (["tc-9"], None)


async def test_a_fork_remembers_the_resolutions_so_its_pops_bring_back_no_resolved_prompt(
    backend: Backend,
) -> None:
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    await runtime.stream([APPROVED])  # resolved by request id: no message records it
    await runtime.stream([BOOKED])
    last = (await runtime.store.transcript(CID))[-1]
    await runtime.logger.fork(CID, int(last.seq or 0), "conv-fork")

    await runtime.store.pop_last_message("conv-fork")

    assert await pending_state(runtime.store, "conv-fork") == (["tc-9"], None)


async def test_popping_an_upload_that_cleared_a_prompt_brings_the_prompt_back(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    hitl = {"action": "confirm", "params": {}, "request_id": "p1"}
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "Book it."}, _book("c1"),
         {"role": "assistant", "content": "Sure?", "hitl_action": hitl}],
        turn_id="t1",
    )  # fmt: skip
    upload = {"filename": "id.pdf", "file_type": "application/pdf", "size": 10}
    await logger.log_messages(
        CID, [{"role": "user", "content": "Here.", "upload": upload}], turn_id="t2"
    )
    assert await pending_state(store) == (["c1"], None)

    await store.pop_last_message(CID)

    assert await pending_state(store) == (["c1"], "p1")
    assert await pending_state(store) == _folded(await store.transcript(CID))


async def test_popping_an_answer_puts_its_call_back_in_its_place_among_the_pending(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for n in (1, 2, 3):
        await logger.log_messages(CID, [_book(f"c{n}", "lookup")], turn_id=f"t{n}")
    answer = {"role": "tool", "tool_call_id": "c2", "content": "found"}
    await logger.log_messages(CID, [answer], turn_id="t4")

    await store.pop_last_message(CID)

    assert await pending_state(store) == (["c1", "c2", "c3"], None)


async def test_popping_an_answer_puts_its_call_back_before_the_calls_of_a_lost_later_block(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calls pending are listed in the order they were made (the newest are kept), as the
    fold of the messages gives them, whatever made one pending again: c1 comes back before
    c2, which a later turn reserved and never stored."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    await logger.log_messages(CID, [{"role": "user", "content": "go"}, _book("c1")], turn_id="t1")
    lost = [{"role": "user", "content": "and"}, _book("c2")]
    await _reserved_only(logger, monkeypatch, lost, "t2")
    answer = {"role": "tool", "tool_call_id": "c1", "content": "found"}
    await logger.log_messages(CID, [answer], turn_id="t3")

    await store.pop_last_message(CID)

    assert await pending_state(store) == (["c1", "c2"], None)
    await logger.log_messages(CID, [{"role": "user", "content": "more"}, _book("c4")], turn_id="t4")
    assert await pending_state(store) == (["c1", "c2", "c4"], None)


async def test_popping_an_answer_puts_its_call_back_in_its_place_among_its_messages_calls(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    calls = [{"id": c, "function": {"name": "lookup", "arguments": "{}"}} for c in ("c1", "c1b")]
    both = {"role": "assistant", "tool_calls": calls}
    await logger.log_messages(CID, [{"role": "user", "content": "go"}, both], turn_id="t1")
    await _reserved_only(logger, monkeypatch, [_book("c2")], "t2")
    answer = {"role": "tool", "tool_call_id": "c1", "content": "found"}
    await logger.log_messages(CID, [answer], turn_id="t3")

    await store.pop_last_message(CID)

    assert await pending_state(store) == (["c1", "c1b", "c2"], None)
    assert [c.seq for c in await store.pending_calls(CID)] == [1, 1, 2]


async def test_popping_a_prompt_leaves_none_pending_and_brings_back_no_resolved_one(
    backend: Backend,
) -> None:
    """A prompt it replaced may have been resolved by request id, which no message records."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)

    def asks(request_id: str) -> list[dict[str, Any]]:
        hitl = {"action": "confirm", "params": {}, "request_id": request_id}
        return [{"role": "assistant", "content": "Sure?", "hitl_action": hitl}]

    await logger.log_messages(CID, [{"role": "user", "content": "go"}, *asks("r1")], turn_id="t1")
    await store.resolve_hitl(CID, "r1")
    await logger.log_messages(CID, asks("r2"), turn_id="t2")

    await store.pop_last_message(CID)

    assert await pending_state(store) == ([], None)


async def _pop_over_a_turn_in_flight(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, in_flight: list[dict[str, Any]]
) -> ConversationStore:
    """`in_flight` reserves its `seq`s and loses its insert; a later turn lands and is popped
    (Agents SDK `pop_item`); then the retry of `in_flight` stores it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _reserved_only(logger, monkeypatch, in_flight, "t-in-flight")
    await logger.log_messages(CID, [_book("c-x", "lookup")], turn_id="t-popped")
    await store.pop_last_message(CID)
    assert (await logger.log_messages(CID, in_flight, turn_id="t-in-flight")).replayed
    return store


async def test_a_pop_keeps_the_answer_of_a_turn_still_being_written_below_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "Book it"}, _book(),
                                    _asks("confirm-9")], turn_id="t1")  # fmt: skip
    answer = [{"role": "tool", "tool_call_id": "tc-9", "content": "B-42"}]

    store = await _pop_over_a_turn_in_flight(backend, monkeypatch, answer)

    assert await pending_state(store) == ([], None)


async def test_a_pop_keeps_the_call_a_turn_still_being_written_below_it_left_pending(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "Book it"}], turn_id="t1")

    store = await _pop_over_a_turn_in_flight(backend, monkeypatch, [_book(), _asks("confirm-9")])

    assert await pending_state(store) == (["tc-9"], "confirm-9")
    assert [c.request_id for c in await store.pending_calls(CID)] == ["confirm-9"]


async def test_two_pops_racing_leave_no_call_of_either_message_pending(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pop A removes c2 and reads the messages before it; pop B removes c1 and updates the
    summary first; then A updates with what it read (c1 still there)."""
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "look up"}], turn_id="t1")
    for n in (1, 2):
        await logger.log_messages(CID, [_book(f"c{n}", "lookup")], turn_id=f"t{n + 1}")
    first, second = ConversationStore(backend.db), ConversationStore(backend.db)
    update_one = first._conversations.update_one

    async def the_other_pop_first(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.undo()
        assert (await second.pop_last_message(CID)) is not None
        return await update_one(*args, **kwargs)

    monkeypatch.setattr(first._conversations, "update_one", the_other_pop_first)
    await first.pop_last_message(CID)

    assert [m.seq for m in await first.transcript(CID)] == [0]
    assert await pending_state(first) == ([], None)


async def test_a_fork_at_a_prompt_approved_after_a_later_turn_stops_there_still_asking(
    backend: Backend,
) -> None:
    """The fork stops at the prompt. The approval (recorded even though the same stream's
    result answered the call) came once the original had logged a later turn: it is not the
    fork's (DESIGN.md §3 Forks), which asks the question still, its call held, as the same
    fork taken before the approval did. The fork of the whole conversation has it."""
    runtime = Runtime(backend)
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")  # seq 0-2
    await runtime.stream([{"type": "stream_token", "token": "Sunny."}], prompt="Weather?")
    prompt = next(m for m in await runtime.store.transcript(CID) if m.hitl_action)
    assert prompt.seq is not None
    await runtime.logger.fork(CID, prompt.seq, "fork-before")
    await runtime.stream([APPROVED, BOOKED, {"type": "stream_token", "token": "Booked."}])

    forked = await runtime.logger.fork(CID, prompt.seq, "fork-at-prompt")

    assert [m.seq for m in forked.messages] == list(range(prompt.seq + 1))
    asking = ([("tc-9", "confirm-9")], "confirm-9")
    assert await held_state(runtime.store, "fork-at-prompt") == asking
    assert await held_state(runtime.store, "fork-before") == asking
    stored = await runtime.store.transcript(CID)
    whole = await runtime.logger.fork(CID, len(stored) - 1, "fork-whole")
    assert len(whole.messages) == len(stored)
    assert await pending_state(runtime.store, "fork-whole") == ([], None)


async def test_a_prompt_answered_within_its_own_turn_is_not_left_pending(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    hitl = {"action": "book", "params": {}, "request_id": "r9"}
    await logger.log_messages(
        CID,
        [
            {"role": "user", "content": "Book it."},
            {"role": "assistant", "tool_calls": [
                {"id": "tc-9", "function": {"name": "book", "arguments": "{}"}}]},
            {"role": "assistant", "content": "Pay €35?", "hitl_action": hitl},
            {"role": "tool", "tool_call_id": "tc-9", "content": DENIED_RESULT},
            {"role": "assistant", "content": "Nothing was booked."},
        ],
        turn_id="t1",
    )  # fmt: skip

    assert await pending_state(store) == ([], None)


async def test_a_fork_keeps_a_prompt_that_a_result_of_an_earlier_turns_call_does_not_answer(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    hitl = {"action": "book", "params": {}, "request_id": "r2"}
    await _weather_left_open(logger)
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "Book the train."},
         {"role": "assistant", "content": "Pay €35?", "hitl_action": hitl},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        turn_id="t2",
    )  # fmt: skip
    assert await pending_state(store) == ([], "r2")

    await logger.fork(CID, 4, "fork-all")

    assert await pending_state(store, "fork-all") == ([], "r2")


async def test_a_fork_of_everything_awaits_what_the_original_awaits(backend: Backend) -> None:
    """A confirmation denied within its turn is resolved by request id, which no message
    records: the whole conversation forked has no prompt pending either."""
    runtime = Runtime(backend)
    await runtime.stream(
        [*ASKS_TO_BOOK, DENIED, {"type": "stream_token", "token": "Nothing was booked."}],
        prompt="Book me the 09:04 to Lyon.",
    )
    assert await pending_state(runtime.store) == ([], None)
    last = len(await runtime.store.transcript(CID)) - 1

    await runtime.logger.fork(CID, last, "fork-everything")

    assert await pending_state(runtime.store, "fork-everything") == ([], None)


async def test_a_fork_of_everything_leaves_what_its_copies_leave_not_a_turn_that_died(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3 Forks: a turn answering c1 reserved and died (never stored); its block
    passed as abandoned. A fork of the whole conversation copies no answer to c1: it leaves
    what its copies leave, c1 held by q1 and q1 pending, as a fork cut one message earlier
    and the same messages logged afresh do, not what the original's reservations counted."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    asked = [_user("Book."), _calls("c1", "c2"), _asks_about("q1", "c1")]
    later = [_user("And c2?"), _answer("c2", "x"), _say("c2 done.")]
    await logger.log_messages(CID, asked, turn_id="t0")
    await _reserved_only(logger, monkeypatch, [_user("Yes."), _answer("c1", "booked")], "dead")
    await logger.log_messages(CID, later, turn_id="t2")
    fresh = await _logged(logger, store, "fresh", [asked, later])
    assert fresh == ([("c1", "q1")], "q1")
    last = (await store.transcript(CID))[-1].seq
    assert last is not None

    await logger.fork(CID, last, "fork-everything")
    await logger.fork(CID, last - 1, "fork-earlier")

    assert await held_state(store, "fork-everything") == fresh
    assert await held_state(store, "fork-earlier") == fresh


async def test_a_fork_copies_a_stand_in_and_the_real_result_and_replays_the_real_one(
    backend: Backend,
) -> None:
    """DESIGN.md §3 Forks: a fork copies every message up to its end, a stand-in and the real
    result that came for its call later both; its replays answer the call with the real
    result, as the original's do."""
    from agent_store.core import stand_in_result

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    call = {"id": "c1", "function": {"name": "search", "arguments": "{}"}}
    stand_in = stand_in_result("c1", datetime(2026, 1, 1, tzinfo=UTC)).model_dump(by_alias=True)
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "Search"}, {"role": "assistant", "tool_calls": [call]},
         stand_in],
        turn_id="t1",
    )  # fmt: skip
    await logger.log_messages(
        CID, [{"role": "tool", "tool_call_id": "c1", "content": "found"}], turn_id="t2"
    )

    forked = await logger.fork(CID, 3, "fork-answered")

    tool_texts = [m.content for m in forked.messages if m.role == "tool"]
    assert tool_texts == [stand_in["content"], "found"]
    replayed = chat_completions(await store.transcript("fork-answered"))
    assert [m.get("content") for m in replayed if m["role"] == "tool"] == ["found"]
    assert replayed == chat_completions(await store.transcript(CID))


async def test_a_fork_of_everything_copies_a_repeated_result_and_counts_the_turns_counted(
    backend: Backend,
) -> None:
    """DESIGN.md §3 Forks: a fork copies the messages up to `at_seq`, `seq` 0…n in the same
    order, and counts the turns the original counted over them. t1 calls c1 and has its
    result; t2 sends c1's result again between two user messages (two turn starts). A fork
    of everything copies the seven messages and counts three turns, as the original does."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("hi"), _calls("c1"), _answer("c1", "r")], turn_id="t1")
    again = [_user("hi"), _answer("c1", "r"), _user("and?"), _say("ok")]
    await logger.log_messages(CID, again, turn_id="t2")
    source = await store.transcript(CID)
    assert source[-1].seq is not None

    await logger.fork(CID, source[-1].seq, "fork-all")

    forked = await store.transcript("fork-all")
    assert [(m.role, m.tool_call_id) for m in forked] == [(m.role, m.tool_call_id) for m in source]
    assert [m.seq for m in forked] == list(range(len(source)))
    assert (await store.get_conversation("fork-all")).turn_count == 3
    assert await store.turn_count(CID) == 3


async def test_a_fork_at_the_last_stored_message_ignores_a_turn_still_being_written(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "hi"}], turn_id="t1")
    call = {"id": "c9", "function": {"name": "pay", "arguments": "{}"}}
    hitl = {"action": "pay", "params": {}, "request_id": "r9"}

    await _reserved_only(
        logger,
        monkeypatch,
        [{"role": "assistant", "tool_calls": [call]},
         {"role": "assistant", "content": "Pay?", "hitl_action": hitl}],
        "t2",
    )  # fmt: skip

    await logger.fork(CID, 0, "fork-before-t2")

    assert await pending_state(store, "fork-before-t2") == ([], None)


async def test_a_fork_waits_for_a_turn_still_being_written_before_its_point(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork now would miss that turn's messages: StorageUnavailable, retried once the turn
    is stored or, abandoned, passed after `abandon_after`."""
    from datetime import timedelta

    from agent_store import TurnRules

    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "hi"}], turn_id="t1")

    await _reserved_only(logger, monkeypatch, [{"role": "user", "content": "slow"}], "t2")
    await logger.log_messages(CID, [{"role": "user", "content": "after"}], turn_id="t3")

    with pytest.raises(StorageUnavailable, match="still being written at seq 1"):
        await logger.fork(CID, 2, "fork-too-early")
    patient = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    forked = await patient.fork(CID, 2, "fork-passing-it")
    assert [m.content for m in forked.messages] == ["hi", "after"]


async def test_a_fork_at_a_seq_whose_turn_is_still_being_written_waits_for_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `seq` the conversation reserved holds no message yet while its turn is still being
    written: a fork at it waits (StorageUnavailable, retryable), as one past it does, nothing
    written (the error names the turn's first `seq`); once the turn is stored the same fork
    copies it."""
    from agent_store.store import CONVERSATIONS, MESSAGES

    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "hi"}], turn_id="t1")
    slow = [{"role": "user", "content": "slow"}, {"role": "assistant", "content": "turn"}]
    await _reserved_only(logger, monkeypatch, slow, "t2")  # seqs 1-2

    for at_seq in (1, 2):
        with pytest.raises(StorageUnavailable, match="still being written at seq 1"):
            await logger.fork(CID, at_seq, f"fork-at-{at_seq}")
        assert await backend.db[CONVERSATIONS].find_one({"_id": f"fork-at-{at_seq}"}) is None
    assert await backend.db[MESSAGES].count_documents({"conversation_id": {"$ne": CID}}) == 0

    await logger.log_messages(CID, slow, turn_id="t2")  # the runtime's retry
    forked = await logger.fork(CID, 2, "fork-at-2")
    assert [m.content for m in forked.messages] == ["hi", "slow", "turn"]


class _ThenCursor:
    """A cursor of messages whose read, once returned, runs `then`."""

    def __init__(self, cursor: Any, then: Callable[[], Awaitable[Any]]) -> None:
        self._cursor, self._then = cursor, then

    def sort(self, *args: Any) -> _ThenCursor:
        self._cursor = self._cursor.sort(*args)
        return self

    def limit(self, length: int) -> _ThenCursor:
        self._cursor = self._cursor.limit(length)
        return self

    def batch_size(self, size: int) -> _ThenCursor:
        self._cursor = self._cursor.batch_size(size)
        return self

    async def to_list(self, length: int | None) -> list[Any]:
        found: list[Any] = await self._cursor.to_list(length)
        await self._then()
        return found


def _after_the_logger_read(
    logger: AgentMessageLogger,
    monkeypatch: pytest.MonkeyPatch,
    reads: int,
    then: Callable[[], Awaitable[Any]],
) -> None:
    """Once the logger's `reads`-th read of messages (a `find`) returned, `then` runs; the
    logger reads as always from then on."""
    find, made = logger._messages.find, [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        made[0] += 1
        if made[0] < reads:
            return find(*args, **kwargs)
        monkeypatch.setattr(logger._messages, "find", find)
        return _ThenCursor(find(*args, **kwargs), then)

    monkeypatch.setattr(logger._messages, "find", counted)


async def test_a_fork_at_a_seq_whose_turn_lands_between_its_reads_waits_for_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn at the fork's at_seq reserved, and lands right after the fork read the
    messages up to it (none there yet): the fork waits, as for a turn still being written
    (StorageUnavailable, nothing written; it was InvalidInput, "a fork copies at most
    16,777,216 bytes", for four small messages), and the same fork then copies it."""
    from agent_store.store import CONVERSATIONS

    logger, forker = AgentMessageLogger(backend.db), AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "hi"}], turn_id="t1")
    slow = [{"role": "user", "content": "slow"}, {"role": "assistant", "content": "turn"}]
    await _reserved_only(logger, monkeypatch, slow, "t2")  # seqs 1-2

    async def lands() -> None:
        await logger.log_messages(CID, slow, turn_id="t2")

    _after_the_logger_read(forker, monkeypatch, 1, lands)
    with pytest.raises(StorageUnavailable, match="still being written at seq 1"):
        await forker.fork(CID, 2, "fork-at-2")
    assert await backend.db[CONVERSATIONS].find_one({"_id": "fork-at-2"}) is None

    forked = await forker.fork(CID, 2, "fork-at-2")
    assert [m.content for m in forked.messages] == ["hi", "slow", "turn"]


async def test_a_fork_whose_end_a_pop_took_between_its_reads_waits_not_refused_for_its_size(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork at a call moves to its result; that result is popped between the fork's read of
    where it ends and its read of the messages up to there: the fork waits (StorageUnavailable,
    nothing written), never refused for a size it is not, and the same fork then copies the
    call, left pending as the original now leaves it."""
    from agent_store.store import CONVERSATIONS

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    forker = AgentMessageLogger(backend.db)
    turn = [{"role": "user", "content": "weather?"}, _book("c1", "weather"), _answer("c1")]
    await logger.log_messages(CID, turn, turn_id="t1")  # seq 0-2

    async def popped() -> None:
        await store.pop_last_message(CID)

    _after_the_logger_read(forker, monkeypatch, 2, popped)
    with pytest.raises(StorageUnavailable, match="retry the fork in a moment"):
        await forker.fork(CID, 1, "fork-at-1")
    assert await backend.db[CONVERSATIONS].find_one({"_id": "fork-at-1"}) is None

    forked = await forker.fork(CID, 1, "fork-at-1")
    assert [m.role for m in forked.messages] == ["user", "assistant"]


async def test_a_fork_at_the_unstored_seq_of_a_turn_cut_short_waits_for_the_rest(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn [question, call, result] whose insert stored its question only: a fork at its
    stored `seq` waits for the rest of its turn, and so does one at a `seq` it has not stored
    yet (it was an InvalidInput, 'no message with seq 3', refused for good)."""

    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "hi"}], turn_id="t0")
    cut = [{"role": "user", "content": "weather?"}, _book("c1", "weather"), _answer("c1")]
    await _log_cut_short(logger, monkeypatch, cut, "t1")  # seq 1 stored, 2-3 not yet

    for at_seq in (1, 2, 3):
        with pytest.raises(StorageUnavailable, match="still being written at seq 2"):
            await logger.fork(CID, at_seq, "conv-fork")

    await logger.log_messages(CID, cut, turn_id="t1")
    forked = await logger.fork(CID, 3, "conv-fork")
    assert [m.role for m in forked.messages] == ["user", "user", "assistant", "tool"]


async def test_a_fork_at_a_seq_no_turn_will_write_is_refused_as_holding_no_message(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block older than `abandon_after` that stored nothing is passed: a fork at one of its
    `seq`s is InvalidInput, as is one at a `seq` not reserved (`message_count` and past),
    while a turn is still being written below it."""
    from datetime import timedelta

    from agent_store import TurnRules

    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "hi"}], turn_id="t1")
    await _reserved_only(logger, monkeypatch, [{"role": "user", "content": "gone"}], "t2")

    patient = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    with pytest.raises(InvalidInput, match="no message with seq 1"):
        await patient.fork(CID, 1, "conv-fork")
    for past_the_end in (2, 7):
        with pytest.raises(InvalidInput, match=f"no message with seq {past_the_end}"):
            await logger.fork(CID, past_the_end, "conv-fork")


async def test_a_fork_after_a_pop_that_raced_a_turn_passes_the_seq_the_pop_removed(
    backend: Backend,
) -> None:
    """RUNTIMES.md (pop_item): a pop that raced a turn of an older writer leaves its `seq` as
    a gap. A `seq` a pop removed is not being written: a fork past it is not refused (nor is
    a tail read)."""
    from tests.test_conversation_tail import an_older_writer, racing_the_summary_update

    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(
        CID, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"}],
        turn_id="a",
    )  # fmt: skip
    store = ConversationStore(backend.db)
    older = an_older_writer(backend)  # its turns reserve past a pop under way

    async def a_turn() -> None:
        await older.log_messages(CID, [{"role": "user", "content": "b"}], turn_id="b")

    racing_the_summary_update(store, a_turn)
    popped = await store.pop_last_message(CID)
    assert popped is not None
    assert popped.content == "A"
    assert [m.seq for m in await store.transcript(CID)] == [0, 2]

    forked = await logger.fork(CID, 2, "conv-fork")
    page = await store.messages_page(CID, limit=10)

    assert [m.content for m in forked.messages] == ["a", "b"]
    assert [m.content for m in page.data] == ["a", "b"]
    assert page.pending_seq is None


async def _weather_left_open(logger: AgentMessageLogger) -> None:
    """Turn t1 leaves call c1 open: its result comes from elsewhere, no prompt holds it."""
    call = {"id": "c1", "function": {"name": "weather", "arguments": "{}"}}
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [call]}],
        turn_id="t1",
    )


async def _weather_then_booking(logger: AgentMessageLogger) -> None:
    """Turn t1 leaves call c1 open; turn t2 raises an unrelated prompt r2."""
    hitl = {"action": "book", "params": {}, "request_id": "r2"}
    await _weather_left_open(logger)
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "Book the train."},
         {"role": "assistant", "content": "Pay €35?", "hitl_action": hitl}],
        turn_id="t2",
    )  # fmt: skip


async def _log_a_call_and_pop_it(logger: AgentMessageLogger, store: ConversationStore) -> None:
    call = {"id": "c5", "function": {"name": "lookup", "arguments": "{}"}}
    await logger.log_messages("fork-1", [{"role": "assistant", "tool_calls": [call]}], turn_id="t3")
    await store.pop_last_message("fork-1")


async def test_a_pop_in_a_fork_folds_the_copies_turn_by_turn_as_the_original_logged_them(
    backend: Backend,
) -> None:
    """The fork's copies are one turn; a pop listing what is pending again must not make r2
    hold back t1's call, so c1's late result leaves r2 pending, as in the original."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _weather_then_booking(logger)
    await logger.fork(CID, 3, "fork-1")
    await _log_a_call_and_pop_it(logger, store)
    assert await pending_state(store, "fork-1") == (["c1"], "r2")

    await logger.log_messages(
        "fork-1", [{"role": "tool", "tool_call_id": "c1", "content": "sunny"}], turn_id="t4"
    )

    assert await pending_state(store, "fork-1") == ([], "r2")


async def test_a_fork_of_a_fork_awaits_what_that_fork_awaited_at_its_point(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _weather_then_booking(logger)
    await logger.fork(CID, 3, "fork-1")
    await logger.log_messages("fork-1", [{"role": "user", "content": "still there?"}], turn_id="t5")

    await logger.fork("fork-1", 3, "fork-2")  # before t5: what fork-1 awaited at seq 3

    assert await pending_state(store, "fork-2") == (["c1"], "r2")
    fork = await store.get_conversation("fork-2")
    assert fork.forked_from is not None
    assert fork.forked_from.turn_starts == [2]


def test_a_forks_turn_starts_are_read_once_not_searched_for_every_message() -> None:
    """Folding a fork of n messages with k turn starts costs n + k, not n times k."""
    from collections.abc import Iterator

    from agent_store.core import message_adapter
    from agent_store.store import pending_after

    class Counted(list[int]):
        reads = searches = 0

        def __iter__(self) -> Iterator[int]:
            Counted.reads += 1
            return super().__iter__()

        def __contains__(self, item: object) -> bool:
            Counted.searches += 1
            return super().__contains__(item)

    messages = [
        message_adapter.validate_python({"role": "user", "content": "hi", "seq": n, "turn_id": "t"})
        for n in range(200)
    ]
    pending_after(messages, Counted(range(0, 200, 2)))

    assert (Counted.reads, Counted.searches) == (1, 0)


async def test_a_turn_logged_over_popped_copies_of_a_fork_is_folded_as_one_turn(
    backend: Backend,
) -> None:
    """A fork's turn starts cut its copies only: once pops removed some, a new turn logged
    over their `seq`s is one turn, as in a conversation that never was a fork."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    first = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    await logger.log_messages("orig", first, turn_id="t1")
    for text in "cde":
        await logger.log_messages("orig", [{"role": "user", "content": text}], turn_id=f"t-{text}")
    await logger.fork("orig", 4, "fork-1")  # its turns began at seq 2, 3 and 4
    for _ in range(3):
        await store.pop_last_message("fork-1")
    call_x = {"id": "cx", "function": {"name": "book", "arguments": "{}"}}
    call_y = {"id": "cy", "function": {"name": "note", "arguments": "{}"}}
    prompt = {"action": "pay", "params": {}, "request_id": "r1"}
    turn = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [call_x]},
        {"role": "assistant", "content": "Pay?", "hitl_action": prompt},
        {"role": "assistant", "tool_calls": [call_y]},
    ]
    for cid in ("fork-1", "never-forked"):
        if cid == "never-forked":
            await logger.log_messages(cid, first, turn_id="t1")
        await logger.log_messages(cid, turn, turn_id="t-new")
        await store.pop_last_message(cid)  # call cy: what is pending is listed again

    held = {cid: [(c.tool_call_id, c.request_id) for c in await store.pending_calls(cid)]
            for cid in ("fork-1", "never-forked")}  # fmt: skip
    assert held == {"fork-1": [("cx", "r1")], "never-forked": [("cx", "r1")]}


async def _a_paused_call_whose_id_a_later_turn_repeats(logger: AgentMessageLogger) -> None:
    """t1 makes `call_0` and awaits approval; t2 (a provider numbering its calls per response)
    makes and answers its own `call_0`; t3 brings the approved call's result."""

    def call(name: str) -> dict[str, Any]:
        return {"id": "call_0", "function": {"name": name, "arguments": "{}"}}

    prompt = {"action": "book", "params": {}, "request_id": "confirm-1"}
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "Book it"},
         {"role": "assistant", "tool_calls": [call("book_train")]},
         {"role": "assistant", "content": "Sure?", "hitl_action": prompt}],
        turn_id="t1",
    )  # fmt: skip
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "Weather meanwhile?"},
         {"role": "assistant", "tool_calls": [call("weather")]},
         {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}],
        turn_id="t2",
    )  # fmt: skip
    await logger.log_messages(
        CID, [{"role": "tool", "tool_call_id": "call_0", "content": "B-42"}], turn_id="t3"
    )


async def test_a_late_answer_goes_to_the_unanswered_call_of_its_id_in_every_replay(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _a_paused_call_whose_id_a_later_turn_repeats(logger)
    assert await pending_state(store) == ([], None)

    exported = chat_completions(await store.transcript(CID))

    check_chat_completions(exported)
    answered = [(m["role"], m.get("content")) for m in exported if m["role"] != "user"]
    assert [content for role, content in answered if role == "tool"] == ["B-42", "sunny"]


async def test_a_fork_copies_the_late_answer_of_a_call_whose_id_a_later_turn_repeats(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _a_paused_call_whose_id_a_later_turn_repeats(logger)
    last = (await store.transcript(CID))[-1].seq
    assert last is not None

    forked = await logger.fork(CID, last, "fork-all")

    assert [m.content for m in forked.messages if m.role == "tool"] == ["sunny", "B-42"]
    assert await pending_state(store, "fork-all") == ([], None)


async def test_a_prompt_logged_in_a_turn_of_its_own_holds_the_calls_left_pending_before_it(
    backend: Backend,
) -> None:
    """A runtime whose run paused on a call logs its question as a turn of its own: the
    prompt holds that call, so the call's answer clears it, and a rewrite folds it alike."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    book = {"id": "tc-9", "function": {"name": "book_train", "arguments": "{}"}}
    note = {"id": "tc-1", "function": {"name": "note", "arguments": "{}"}}
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "Book the 09:04"},
         {"role": "assistant", "tool_calls": [book]}],
        turn_id="run-1",
    )  # fmt: skip
    ask = {"action": "book_train", "params": {}, "request_id": "confirm-9"}
    await logger.log_messages(
        CID, [{"role": "assistant", "content": "Pay €35?", "hitl_action": ask}], turn_id="ask-1"
    )
    held = [(c.tool_call_id, c.request_id) for c in await store.pending_calls(CID)]
    assert held == [("tc-9", "confirm-9")]
    assert await pending_state(store) == await recomputed_state(store)
    # A call made later, in a turn of its own, is not the prompt's.
    await logger.log_messages(CID, [{"role": "assistant", "tool_calls": [note]}], turn_id="n")

    await logger.log_messages(
        CID, [{"role": "tool", "tool_call_id": "tc-9", "content": "booked"}], turn_id="run-2"
    )

    assert await pending_state(store) == (["tc-1"], None)
    assert await pending_state(store) == await recomputed_state(store)


async def recomputed_state(
    store: ConversationStore, cid: str = CID
) -> tuple[list[str], str | None]:
    """What the stored messages leave pending, folded turn by turn as a pop or a fork does."""
    from agent_store.store._turns import pending_after

    calls, prompt = pending_after(await store.transcript(cid))
    return [c.tool_call_id for c in calls], prompt.request_id if prompt else None


async def test_a_fork_cut_before_a_turn_still_being_written_keeps_a_resolved_prompt_resolved(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resolution by request id leaves no message: the conversation remembers it, and a
    fork folding the messages up to its point does not bring the prompt back."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [{"role": "user", "content": "Delete my account"}, _asks("r1")], turn_id="t1"
    )
    await store.resolve_hitl(CID, "r1")  # the person answered through the API

    await _reserved_only(logger, monkeypatch, [{"role": "user", "content": "hello"}], "t2")

    await logger.fork(CID, 1, "fork-during")

    assert await pending_state(store, "fork-during") == ([], None)


def _calls(*ids: str) -> dict[str, Any]:
    return _tool_calls(*((i, "book") for i in ids))


def _tool_calls(*calls: tuple[str, str]) -> dict[str, Any]:
    """An assistant message making `calls` (id, tool name)."""
    return {
        "role": "assistant",
        "tool_calls": [{"id": i, "function": {"name": n, "arguments": "{}"}} for i, n in calls],
    }


async def held_state(
    store: ConversationStore, cid: str = CID
) -> tuple[list[tuple[str, str | None]], str | None]:
    calls = [(c.tool_call_id, c.request_id) for c in await store.pending_calls(cid)]
    prompt = await store.pending_hitl(cid)
    return calls, prompt.request_id if prompt else None


async def test_an_answer_to_a_repeated_call_id_takes_only_the_latest_call_of_that_id(
    backend: Backend,
) -> None:
    """t1's call_0 awaits approval (r1); t2 makes a call_0 of its own and leaves it open; the
    answer is t2's in every replay, so t1's call and its prompt stay pending."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [{"role": "user", "content": "Book it"}, _calls("call_0"), _asks("r1")], turn_id="t1"
    )
    await logger.log_messages(
        CID, [{"role": "user", "content": "Weather?"}, _calls("call_0")], turn_id="t2"
    )

    await logger.log_messages(
        CID, [{"role": "tool", "tool_call_id": "call_0", "content": "sunny"}], turn_id="t3"
    )

    assert await held_state(store) == ([("call_0", "r1")], "r1")
    calls, prompt = await recomputed_state(store)
    assert (calls, prompt) == (["call_0"], "r1")
    await store.pop_last_message(CID)  # the answer: t2's call is pending again, beside t1's
    assert await held_state(store) == ([("call_0", "r1"), ("call_0", None)], "r1")


async def test_popping_an_answer_to_a_repeated_call_id_brings_back_only_the_call_it_took(
    backend: Backend,
) -> None:
    """t1 makes call_0 and call_1, held by r1; t2 (a provider numbering its calls per response)
    makes call_0 again and call_2 and answers its own call_0. Popping that answer lists t2's
    call_0 again where logging t2 without it does: after t1's calls, t1's call_0 unmoved."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    t1 = [{"role": "user", "content": "Book both"}, _calls("call_0", "call_1"), _asks("r1")]
    t2 = [_calls("call_0", "call_2"), {"role": "tool", "tool_call_id": "call_0", "content": "ok"}]
    for cid, turns in (("popped", [t1, t2]), ("never-answered", [t1, t2[:1]])):
        for n, turn in enumerate(turns, start=1):
            await logger.log_messages(cid, turn, turn_id=f"t{n}")

    await store.pop_last_message("popped")  # t2's answer to its own call_0

    expected = [("call_0", "r1"), ("call_1", "r1"), ("call_0", None), ("call_2", None)]
    assert await held_state(store, "popped") == (expected, "r1")
    assert await held_state(store, "never-answered") == (expected, "r1")
    assert await recomputed_state(store, "popped") == ([c for c, _ in expected], "r1")


async def test_after_such_a_pop_a_result_without_call_id_ends_the_oldest_pending_call_of_its_tool(
    backend: Backend,
) -> None:
    """STREAMING.md: a `tool_end` without `tool_call_id` ends the oldest pending call of that
    tool from an earlier turn; the pop must leave `pending_calls` in the order they were made."""

    def calls(*pairs: tuple[str, str]) -> dict[str, Any]:
        made = [{"id": i, "function": {"name": name, "arguments": "{}"}} for i, name in pairs]
        return {"role": "assistant", "tool_calls": made}

    runtime = Runtime(backend)
    t1 = [
        {"role": "user", "content": "Book and search"},
        calls(("call_0", "book"), ("call_1", "search")),
    ]
    await runtime.logger.log_messages(CID, t1, turn_id="t1")
    answer = {"role": "tool", "tool_call_id": "call_0", "content": "ok"}
    await runtime.logger.log_messages(CID, [calls(("call_0", "search")), answer], turn_id="t2")
    await runtime.store.pop_last_message(CID)  # t1's call_0, call_1 and t2's call_0 pend

    await runtime.stream([{"type": "tool_end", "tool_name": "search", "result": "found"}])

    assert await pending_state(runtime.store) == (["call_0", "call_0"], None)
    assert await runtime.answers_of("call_1") == [("found", None)]


async def test_a_prompt_only_turn_answering_a_call_it_holds_clears_as_two_turns_would(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for cid, turns in (
        ("one-turn", [[_asks("r1"), {"role": "tool", "tool_call_id": "c2", "content": "ok"}]]),
        ("two-turns", [[_asks("r1")], [{"role": "tool", "tool_call_id": "c2", "content": "ok"}]]),
    ):
        await logger.log_messages(cid, [{"role": "user", "content": "go"}, _calls("c1", "c2")])
        for n, turn in enumerate(turns):
            await logger.log_messages(cid, turn, turn_id=f"t{n}")

    assert await held_state(store, "one-turn") == await held_state(store, "two-turns")
    assert await held_state(store, "one-turn") == ([("c1", "r1")], None)
    assert await recomputed_state(store, "one-turn") == (["c1"], None)


async def test_a_prompt_asked_again_after_its_turn_answered_what_it_held_is_a_new_question(
    backend: Backend,
) -> None:
    """STREAMING.md: a confirmation asked again in the stream that answered it is a new
    question. q1 (naming none) holds c0 and c1; the turn logs c1's result, which clears it,
    then asks q1 again about c0 and ends: q1 is pending, as when the asking again comes in a
    turn of its own, in the document, after a retry and in the fold a pop or a fork applies."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    answer_then_ask = [_asks("q1"), _answer("c1"), _asks_about("q1", "c0")]
    for cid, turns in (
        ("one-turn", [answer_then_ask]),
        ("two-turns", [answer_then_ask[:2], answer_then_ask[2:]]),
    ):
        await logger.log_messages(cid, [_user("go"), _calls("c0", "c1")], turn_id="t0")
        for n, turn in enumerate(turns, 1):
            await logger.log_messages(cid, turn, turn_id=f"t{n}")
    expected = ([("c0", "q1")], "q1")
    assert await held_state(store, "two-turns") == expected

    assert await held_state(store, "one-turn") == expected
    assert await folded_state(store, "one-turn") == expected
    await logger.log_messages("one-turn", answer_then_ask, turn_id="t1")  # a retry
    assert await held_state(store, "one-turn") == expected


async def test_a_fork_cut_between_two_resolutions_keeps_the_first_resolved(
    backend: Backend,
) -> None:
    """Every prompt resolved by request id stays resolved in a fork folding the messages,
    not only the last one."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for n in (1, 2):
        await logger.log_messages(
            CID, [{"role": "user", "content": f"step {n}"}, _asks(f"r{n}")], turn_id=f"t{n}"
        )
        await store.resolve_hitl(CID, f"r{n}")

    await logger.fork(CID, 2, "fork-between")  # after r1's turn and the next user message

    assert await pending_state(store, "fork-between") == ([], None)


async def test_a_prompt_with_no_call_left_to_hold_is_cleared_once_the_held_calls_are_answered(
    backend: Backend,
) -> None:
    """A run paused on two calls; the runtime asks one question per call, in one turn or in
    two. The first prompt holds both calls, so the second has none left to hold: it waits on
    the held calls, and is cleared once none of them is pending, in every replay."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    train, hotel = _asks("confirm-train"), _asks("confirm-hotel")
    for cid, prompt_turns in (("one-turn", [[train, hotel]]), ("two-turns", [[train], [hotel]])):
        await logger.log_messages(cid, [{"role": "user", "content": "Book"}, _calls("c1", "c2")])
        for n, turn in enumerate(prompt_turns):
            await logger.log_messages(cid, turn, turn_id=f"ask-{n}")
        answers = [{"role": "tool", "tool_call_id": c, "content": "ok"} for c in ("c1", "c2")]
        await logger.log_messages(cid, answers, turn_id="run-2")

        assert await held_state(store, cid) == ([], None)
        assert await recomputed_state(store, cid) == ([], None)


async def test_approving_calls_one_by_one_keeps_the_later_prompt_until_its_calls_are_answered(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "Book"}, _calls("c1", "c2")])
    await logger.log_messages(CID, [_asks("confirm-train")], turn_id="ask-1")
    await logger.log_messages(CID, [_asks("confirm-hotel")], turn_id="ask-2")

    await logger.log_messages(CID, [{"role": "tool", "tool_call_id": "c1", "content": "ok"}])
    assert await held_state(store) == ([("c2", "confirm-train")], "confirm-hotel")
    assert await recomputed_state(store) == (["c2"], "confirm-hotel")

    await logger.log_messages(CID, [{"role": "tool", "tool_call_id": "c2", "content": "ok"}])
    assert await held_state(store) == ([], None)
    assert await recomputed_state(store) == ([], None)


# -- call ids a later turn repeats, prompts naming calls not started yet ----------------


async def test_a_streamed_turn_may_reuse_the_id_of_a_call_still_awaiting_approval(
    backend: Backend,
) -> None:
    """DESIGN §3: a provider numbering its calls per response repeats an id in a later turn
    while an older call of that id awaits approval. Within the turn the new call is the one
    its result answers; the older call stays pending, held by its prompt."""
    runtime = Runtime(backend)
    asks = [
        {"type": "tool_start", "tool_name": "book_train", "tool_call_id": "call_0", "args": {}},
        {"type": "confirm_required", "request_id": "r1", "action": "book_train", "params": {},
         "prompt": "Pay?", "tool_call_id": "call_0"},
    ]  # fmt: skip
    await runtime.stream(asks, prompt="Book")
    weather = [
        {"type": "tool_start", "tool_name": "get_weather", "tool_call_id": "call_0", "args": {}},
        {"type": "tool_end", "tool_name": "get_weather", "tool_call_id": "call_0", "result": "18"},
        {"type": "stream_token", "token": "18 °C."},
    ]

    await runtime.stream(weather, prompt="Weather?")

    assert await held_state(runtime.store) == ([("call_0", "r1")], "r1")
    assert await runtime.answers_of("call_0") == [("18", None)]
    assert await recomputed_state(runtime.store) == (["call_0"], "r1")


async def test_a_confirmation_naming_its_call_before_the_call_starts_still_holds_it(
    backend: Backend,
) -> None:
    """A runtime asking before it starts the tool sends `confirm_required` naming tc-9 before
    `tool_start` tc-9: the prompt is placed after the call's message, so it holds the call,
    and a refusal in a later turn answers it as denied."""
    runtime = Runtime(backend)
    asks_first = [
        {"type": "stream_token", "token": "I need your OK to book."},
        ASKS_TO_BOOK[2],  # confirm_required confirm-9 naming tc-9
        ASKS_TO_BOOK[1],  # tool_start tc-9
    ]
    await runtime.stream(asks_first, prompt="Book")
    assert await held_state(runtime.store) == ([("tc-9", "confirm-9")], "confirm-9")

    await runtime.stream([DENIED])

    assert await held_state(runtime.store) == ([], None)
    assert await runtime.answers_of("tc-9") == [(DENIED_RESULT, "tool call denied")]


def test_a_confirmation_placed_when_its_call_starts_reads_as_one_asked_right_after_it() -> None:
    """Asking before the call starts, or right after, stores the same messages; a prompt
    whose call never starts closes the turn."""
    received_at = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
    text, start, ask = ASKS_TO_BOOK
    after = turn_from_metadata([text, start, ask], complete=True, received_at=received_at)
    before = turn_from_metadata([text, ask, start], complete=True, received_at=received_at)
    assert before.messages == after.messages

    never_started = turn_from_metadata([ask, text], complete=True, received_at=received_at)
    assert [m.hitl_action is not None for m in never_started.messages] == [False, True]


async def test_denying_a_confirmation_whose_call_id_a_later_call_repeats_is_refused(
    backend: Backend,
) -> None:
    """t1's call_0 is held by r1; t2 makes a call_0 of its own, held by nothing. The store
    gives an answer to the latest pending call of its id, so a denial of r1 would answer
    t2's call and leave t1's pending: the builder refuses it, naming why, and nothing is
    written."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [{"role": "user", "content": "Book it"}, _calls("call_0"), _asks("r1")], turn_id="t1"
    )
    await logger.log_messages(
        CID, [{"role": "user", "content": "Weather?"}, _calls("call_0")], turn_id="t2"
    )
    before = await store.transcript(CID)
    denial = {"type": "confirm_resolved", "request_id": "r1", "approved": False}

    refused = "a refusal answers tool call 'call_0' of an earlier turn, but a later call "
    with pytest.raises(InvalidInput, match=re.escape(f"{refused}'call_0' is pending too")):
        turn_from_metadata([denial], complete=True, pending=await store.pending_calls(CID))

    assert await store.transcript(CID) == before
    assert await held_state(store) == ([("call_0", "r1"), ("call_0", None)], "r1")


async def test_once_the_later_call_of_its_id_is_answered_the_refusal_denies_the_held_call(
    backend: Backend,
) -> None:
    """What the refusal above tells the runtime to do: answer t2's call_0 first; t1's call
    is then the latest pending call of its id, and the refusal answers it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [{"role": "user", "content": "Book it"}, _calls("call_0"), _asks("r1")], turn_id="t1"
    )
    await logger.log_messages(
        CID, [{"role": "user", "content": "Weather?"}, _calls("call_0")], turn_id="t2"
    )
    held_by_r1 = (await store.pending_calls(CID))[0]
    weather = {"type": "tool_end", "tool_name": "book", "tool_call_id": "call_0", "result": "18"}
    denial = {"type": "confirm_resolved", "request_id": "r1", "approved": False}
    for turn_id, event in (("t3", weather), ("t4", denial)):
        turn = turn_from_metadata([event], complete=True, pending=await store.pending_calls(CID))
        await log_streamed_turn(
            logger=logger, store=store, conversation_id=CID, turn=turn, turn_id=turn_id
        )

    assert await held_state(store) == ([], None)
    stored = await store.transcript(CID)
    denied = [
        stored[index].id
        for (index, _), answer in answers_to_calls(stored).items()
        if answer.content == DENIED_RESULT
    ]
    assert denied == [held_by_r1.message_id]


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        ({"type": "confirm_resolved", "request_id": "r1", "approved": False}, "refusal"),
        (
            {"type": "tool_end", "tool_name": "book", "tool_call_id": "call_0", "result": 1},
            "result",
        ),
    ],
    ids=["refusal", "result"],
)
def test_answering_an_earlier_call_whose_id_the_turn_calls_again_is_refused(
    answer: dict[str, Any], kind: str
) -> None:
    """The turn's own call_0 would take the answer meant for the earlier call_0 (the logger
    refuses such a turn too): answer the earlier call in a turn of its own."""
    pending = [
        PendingCall(
            tool_call_id="call_0",
            tool_name="book",
            message_id="m-1",
            request_id="r1",
            created_at=datetime(2026, 3, 2, 9, 0, tzinfo=UTC),
        )
    ]
    events = [
        answer,
        {"type": "tool_start", "tool_name": "get_weather", "tool_call_id": "call_0"},
        {"type": "tool_end", "tool_name": "get_weather", "tool_call_id": "call_0", "result": "18"},
    ]

    with pytest.raises(InvalidInput, match=f"a {kind} answers tool call 'call_0' of an earlier"):
        turn_from_metadata(events, complete=True, pending=pending)


# -- a turn moved to a new block at the end: what it leaves pending -----------------------


def _late_logger(backend: Backend) -> AgentMessageLogger:
    """A logger whose retries find every empty block abandoned (`abandon_after` 0): a retry of
    a turn that stored nothing is moved to a new block at the end (DESIGN.md §3)."""
    from datetime import timedelta

    from agent_store import TurnRules

    return AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))


async def test_a_relocated_prompt_after_an_upload_is_still_pending(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3 Pending HITL: an upload clears the prompt before it. A prompt whose turn
    was moved past the upload is the last message, unanswered: pending, as the stored
    messages say."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "Book it."}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, [_asks("r1")], "ask")
    upload = {"filename": "id.pdf", "file_type": "application/pdf", "size": 10}
    await logger.log_messages(
        CID, [{"role": "user", "content": "Here.", "upload": upload}], turn_id="up"
    )
    assert await pending_state(store) == ([], None)

    await logger.log_messages(CID, [_asks("r1")], turn_id="ask")

    assert [m.content for m in await store.transcript(CID)] == ["Book it.", "Here.", "Sure?"]
    assert await pending_state(store) == ([], "r1")
    assert await pending_state(store) == await recomputed_state(store)


async def test_a_relocated_turns_calls_are_pending_once_after_the_calls_logged_before_them(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calls a moved turn leaves open were listed when it first reserved: they are listed
    once, in their new place (a result without a call id ends the oldest of its tool)."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await _reserved_only(logger, monkeypatch, [_book("c1", "lookup")], "t1")
    await logger.log_messages(CID, [_book("c2", "lookup")], turn_id="t2")
    assert await pending_state(store) == (["c1", "c2"], None)

    await logger.log_messages(CID, [_book("c1", "lookup")], turn_id="t1")

    assert await pending_state(store) == (["c2", "c1"], None)
    assert await pending_state(store) == await recomputed_state(store)


async def test_a_relocated_prompt_a_person_resolved_meanwhile_stays_resolved(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt was pending from the turn's first reservation and resolved by request id
    (`resolve_hitl`) while the turn waited: moving the turn does not raise it again."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "Delete it."}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, [_asks("r1")], "ask")
    await store.resolve_hitl(CID, "r1")  # the person answered through the API
    await logger.log_messages(CID, [{"role": "user", "content": "Thanks."}], turn_id="t2")

    await logger.log_messages(CID, [_asks("r1")], turn_id="ask")

    assert [m.content for m in await store.transcript(CID)] == ["Delete it.", "Thanks.", "Sure?"]
    assert await pending_state(store) == ([], None)


def _denial_of(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": DENIED_RESULT,
            "error": {"message": "tool call denied"}}  # fmt: skip


def _asks_for(text: str, call_id: str, request_id: str = "confirm") -> list[dict[str, Any]]:
    """A turn: the user's request, the call, and the question holding it under `request_id`."""
    return [{"role": "user", "content": text}, _calls(call_id), _asks_about(request_id, call_id)]


async def _whole_fork(logger: AgentMessageLogger, store: ConversationStore, fork_id: str) -> None:
    await logger.fork(CID, (await store.transcript(CID))[-1].seq, fork_id)


async def test_a_moved_turn_does_not_carry_an_answer_over_the_same_id_asked_after_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3 (`answered_prompts`): t1 asked `confirm` about c1 and stored nothing; a
    person approved `confirm`; t2 then asked `confirm` again about c2. t1, retried past
    `abandon_after`, moves to the end: the answer's reach stays where the answer came, below
    t2's question, which nobody answered. t2's question stays pending and c2 held, in the
    conversation and in a fork of all of it (where a denial of c2 is stored); t1's question,
    asked again past t2's under the id, is pending too (no reach can cover it and not t2's)."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "Hi"}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, _asks_for("Pay invoice A", "c1"), "t1")
    await store.resolve_hitl(CID, "confirm")  # the person approves invoice A
    await logger.log_messages(CID, _asks_for("Pay invoice B", "c2"), turn_id="t2")
    assert await held_state(store) == ([("c1", None), ("c2", "confirm")], "confirm")

    await logger.log_messages(CID, _asks_for("Pay invoice A", "c1"), turn_id="t1")

    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert [(a["r"], a["s"]) for a in doc["answered_prompts"]] == [("confirm", 4)]
    assert await held_state(store) == ([("c2", "confirm"), ("c1", "confirm")], "confirm")
    assert await held_state(store) == await folded_state(store)
    await _whole_fork(logger, store, "fork-all")
    assert await held_state(store, "fork-all") == await held_state(store)
    await logger.log_messages(
        "fork-all", [{"role": "user", "content": "No."}, _denial_of("c2")], turn_id="deny"
    )
    calls, _ = await held_state(store, "fork-all")  # the denial answers c2: stored
    assert calls == [("c1", "confirm")]
    assert await held_state(store, "fork-all") == await folded_state(store, "fork-all")


async def _t1_waiting_through_two_answers(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> tuple[AgentMessageLogger, ConversationStore]:
    """t1 asked `q0` about c3 and stored nothing; a person answered; t6 asked `q0` about c0
    and a person answered that too."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "u0"}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, _asks_for("u1", "c3", "q0"), "t1")
    await store.resolve_hitl(CID, "q0")
    await logger.log_messages(CID, _asks_for("u6", "c0", "q0"), turn_id="t6")
    await store.resolve_hitl(CID, "q0")
    return logger, store


async def test_a_moved_turn_leaves_a_later_answer_to_its_id_where_it_came(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3 (`answered_prompts`): t1 asked `q0` about c3 and stored nothing; a person
    answered; t6 asked `q0` about c0 and a person answered that too; t2 asked `q0` about c5.
    t1 moved to the end carries neither answer over t2's question: each keeps its reach, so
    c0 stays approved, c5 held and t2's question pending, in a fork of all of it alike."""
    logger, store = await _t1_waiting_through_two_answers(backend, monkeypatch)
    await logger.log_messages(CID, _asks_for("u2", "c5", "q0"), turn_id="t2")

    await logger.log_messages(CID, _asks_for("u1", "c3", "q0"), turn_id="t1")

    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert [(a["r"], a["s"]) for a in doc["answered_prompts"]] == [("q0", 4), ("q0", 7)]
    held = ([("c0", None), ("c5", "q0"), ("c3", "q0")], "q0")
    assert await held_state(store) == held
    await _whole_fork(logger, store, "fork-all")
    assert await held_state(store, "fork-all") == held
    await logger.log_messages(
        "fork-all", [{"role": "user", "content": "No."}, _denial_of("c5")], turn_id="deny"
    )
    calls, _ = await held_state(store, "fork-all")  # the denial answers c5: stored
    assert calls == [("c0", None), ("c3", "q0")]


async def test_a_moved_turn_carries_the_answer_given_after_the_last_question_of_its_id(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3 (`answered_prompts`): t1 asked `q0` about c3 and stored nothing; a person
    answered; t6 asked `q0` about c0 and a person answered that too, the id asked no more.
    t1 moved to the end stays answered by the later answer, whose reach moves past it; the
    earlier one stays below t6's question, asked after it."""
    logger, store = await _t1_waiting_through_two_answers(backend, monkeypatch)

    await logger.log_messages(CID, _asks_for("u1", "c3", "q0"), turn_id="t1")

    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert [(a["r"], a["s"]) for a in doc["answered_prompts"]] == [("q0", 4), ("q0", 10)]
    assert await held_state(store) == ([("c0", None), ("c3", None)], None)
    await _whole_fork(logger, store, "fork-all")
    assert await held_state(store, "fork-all") == await held_state(store)


async def test_a_moved_turn_asks_again_after_an_answer_that_left_its_id_unresolved(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3 (`answered_prompts`): an answer naming some of the calls of the id leaves
    it unresolved, so the move cannot tell a reservation asking the id again since, not
    stored yet, from none: the safe side, the answer keeps its reach and the moved question
    asks again, the call it approved held again, in the conversation and a fork alike."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "u0"}], turn_id="t0")
    both = [{"role": "user", "content": "u1"}, _calls("c1", "c2"), _asks_about("q0", "c1", "c2")]
    await _reserved_only(logger, monkeypatch, both, "t1")
    await store.resolve_hitl(CID, "q0", call_ids=["c1"])
    assert await held_state(store) == ([("c1", None), ("c2", "q0")], None)

    await logger.log_messages(CID, both, turn_id="t1")

    assert await held_state(store) == ([("c1", "q0"), ("c2", "q0")], "q0")
    await _whole_fork(logger, store, "fork-all")
    assert await held_state(store, "fork-all") == await held_state(store)


async def _c1_approved_then_c0s_result_popped(
    logger: AgentMessageLogger, store: ConversationStore, cid: str
) -> tuple[Any, ...]:
    """t1 asks `q0` about c0, t2 asks `q0` again about c1, t3 gives c0's result; the person
    answers `q0` naming c1 only; the pop takes c0's result back. What the conversation then
    holds: the calls with their holders, the prompt, `resolved_hitl`, and whether a denial
    of c0 is taken (`check_turn`)."""
    await logger.log_messages(cid, _asks_for("u0", "c0", "q0"), turn_id="t1")
    await logger.log_messages(cid, _asks_for("u1", "c1", "q0"), turn_id="t2")
    await logger.log_messages(cid, [_user("u2"), _answer("c0")], turn_id="t3")
    await store.resolve_hitl(cid, "q0", call_ids=["c1"])
    assert (await store.pop_last_message(cid)).tool_call_id == "c0"
    resolved = (await store.get_conversation(cid)).resolved_hitl
    try:
        await logger.check_turn(cid, [_user("No."), _denial_of("c0")], turn_id="deny")
        denial = "taken"
    except AnsweredBefore:
        denial = "refused"
    return await held_state(store, cid), resolved, denial


async def test_a_pop_after_a_given_up_block_leaves_the_calls_the_answer_did_not_name_held(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3 (`approved_calls`: a pop keeps those a fork of all that remains keeps;
    `popped_seqs`: a block a turn moved away from is a gap no turn holds). t1's first attempt
    reserved seqs 0-2 and stored nothing; its retry moved it past them. The pop below finds
    no message at 0-2, a gap, not a turn still writing: it folds what remains as if the lost
    attempt never was. c0, which the answer did not name, is held by `q0` again, `q0` is no
    longer resolved, and a denial of c0 is taken: in the conversation and a fork of it all."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    fresh = await _c1_approved_then_c0s_result_popped(logger, store, "fresh")
    assert fresh == (([("c0", "q0"), ("c1", None)], None), [], "taken")
    await _reserved_only(logger, monkeypatch, _asks_for("u0", "c0", "q0"), "t1")

    after_gap = await _c1_approved_then_c0s_result_popped(logger, store, CID)

    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert doc["popped_seqs"] == [0, 1, 2]
    assert after_gap == fresh
    await _whole_fork(logger, store, "fork-all")
    assert await held_state(store, "fork-all") == await held_state(store)
    await logger.log_messages(CID, [_user("No."), _denial_of("c0")], turn_id="deny")
    assert await held_state(store) == ([("c1", None)], None)


async def _approved_while_reserved_then_retried_without_the_question(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> tuple[AgentMessageLogger, ConversationStore]:
    """t1 [user, call c1, question `confirm` about c1] reserved and stored nothing; a person
    approved `confirm` while it was pending from that reservation; t1, retried past
    `abandon_after` with other content (the call, no question: its ids are t1's again), is
    logged at the end, its empty block given back."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "Hi"}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, _asks_for("Pay invoice A", "c1"), "t1")
    await store.resolve_hitl(CID, "confirm")  # the person approves invoice A
    assert await held_state(store) == ([("c1", None)], None)
    retried = [
        {"role": "user", "content": "Pay invoice A"},
        _calls("c1"),
        {"role": "assistant", "content": "Paying invoice A."},
    ]
    await logger.check_turn(CID, retried, turn_id="t1")
    await logger.log_messages(CID, retried, turn_id="t1")
    return logger, store


async def _approved_calls(backend: Backend, cid: str = CID) -> list[str]:
    doc = await backend.db.agent_conversations.find_one({"_id": cid})
    return [a["tool_call_id"] for a in doc.get("approved_calls") or ()]


async def test_an_answer_to_a_question_its_turn_was_retried_without_approves_nothing(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3 (`answered_prompts`: an answer answers the questions stored below its `s`;
    a pop, a fork or a move leaves what the same stored messages and answers leave logged
    afresh): no stored turn asked the person about c1 before the answer (t1's question is
    stored nowhere), so the answer approves nothing. c1 stays pending unapproved, in the
    conversation and in a fork of all of it alike: a denial of it is stored in both."""
    logger, store = await _approved_while_reserved_then_retried_without_the_question(
        backend, monkeypatch
    )

    assert await _approved_calls(backend) == []
    assert await held_state(store) == ([("c1", None)], None)
    await _whole_fork(logger, store, "fork-all")
    assert await held_state(store, "fork-all") == await held_state(store)
    for cid in (CID, "fork-all"):
        await logger.log_messages(
            cid, [{"role": "user", "content": "No."}, _denial_of("c1")], turn_id="deny"
        )
        assert await held_state(store, cid) == ([], None)  # the denial answers c1: stored


async def test_a_later_question_holds_a_call_whose_question_its_turn_was_retried_without(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, then t2 asks `r1`, naming no call: it holds c1, pending and approved by no
    stored question, in the conversation as in a fork of all of it."""
    logger, store = await _approved_while_reserved_then_retried_without_the_question(
        backend, monkeypatch
    )

    await logger.log_messages(CID, [_asks("r1")], turn_id="t2")

    assert await held_state(store) == ([("c1", "r1")], "r1")
    await _whole_fork(logger, store, "fork-all")
    assert await held_state(store, "fork-all") == await held_state(store)


async def test_an_approval_whose_answer_is_no_longer_recorded_outlives_a_give_back(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3 (`approved_calls`: those of calls still pending are all kept, a denial
    refused however many prompts are resolved after it): a person approved c1 under `r1`,
    then c2 under `r1` asked again; a hundred answers later only the second is recorded. A
    give-back refolds the conversation: no recorded answer named c1, so nothing the fold
    can tell withdraws its approval, and its denial is still refused."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [_calls("c1"), _asks_about("r1", "c1")], turn_id="t1")
    await store.resolve_hitl(CID, "r1", call_ids=["c1"])
    await logger.log_messages(CID, [_calls("c2"), _asks_about("r1", "c2")], turn_id="t2")
    await store.resolve_hitl(CID, "r1", call_ids=["c2"])
    for index in range(RESOLVED_PROMPTS_KEPT - 1):
        await logger.log_messages(CID, [_asks(f"x{index}")], turn_id=f"x{index}")
        await store.resolve_hitl(CID, f"x{index}")
    await _reserved_only(
        logger, monkeypatch, [{"role": "assistant", "content": "first try"}], "lost"
    )

    await logger.log_messages(
        CID, [{"role": "assistant", "content": "second try, other content"}], turn_id="lost"
    )

    assert sorted(await _approved_calls(backend)) == ["c1", "c2"]
    assert await held_state(store) == ([("c1", None), ("c2", None)], None)
    with pytest.raises(AnsweredBefore):
        await logger.log_messages(CID, [_denial_of("c1")], turn_id="deny")


async def test_moved_questions_answered_before_their_id_was_asked_again_hold_their_calls(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3 (`answered_prompts`): t5 asks `r2` about c, t8 `r2` about a, both store
    nothing; a person answers `r2`; t10 asks `r2` again. t5 and t8, retried, move past t10:
    the answer keeps its reach, below t10's question, and reaches no stored question, so it
    approves nothing and the moved questions hold their calls again. A later question
    naming none holds them, in the conversation and in a fork of all of it alike."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [_asks_about("r1", "a")], turn_id="t2")
    await logger.log_messages(CID, [_calls("a", "c")], turn_id="t4")
    await _reserved_only(logger, monkeypatch, [_asks_about("r2", "c")], "t5")
    await _reserved_only(logger, monkeypatch, [_asks_about("r2", "a")], "t8")
    await store.resolve_hitl(CID, "r2")
    asked_again = [{"role": "user", "content": "go"}, _calls("c", "a"), _asks("r2")]
    await logger.log_messages(CID, asked_again, turn_id="t10")
    await logger.log_messages(CID, [_asks_about("r2", "c")], turn_id="t5")
    await logger.log_messages(CID, [_asks_about("r2", "a")], turn_id="t8")

    assert await _approved_calls(backend) == []
    assert await held_state(store) == await folded_state(store)
    a_of_t10 = message_id(CID, "t10", 1)
    await logger.log_messages(
        CID, [_answer("a", "done"), _asks("r1")], turn_id="t13", answers_to={"a": a_of_t10}
    )

    assert await held_state(store) == ([("a", "r1"), ("c", "r1"), ("c", "r2")], "r1")
    await _whole_fork(logger, store, "fork-all")
    assert await held_state(store, "fork-all") == await held_state(store)


def _answer(call_id: str, text: str = "ok") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


async def test_a_relocated_answer_is_applied_once_at_its_new_place(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer took t0's call_0 when its turn first reserved; moved past t2, which calls
    call_0 again and asks r2, it is not applied a second time: the summary is what the
    stored messages say in their stored order (the answer now follows t2's call_0, the
    latest of its id, and clears r2; t0's call_0 stays pending, held by r1)."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    go = [{"role": "user", "content": "go"}, _calls("call_0"), _asks("r1")]
    await logger.log_messages(CID, go, turn_id="t0")
    dead = [{"role": "user", "content": "yes"}, _answer("call_0", "R1")]
    await _reserved_only(logger, monkeypatch, dead, "t1")
    again = [{"role": "user", "content": "again"}, _calls("call_0"), _asks("r2")]
    await logger.log_messages(CID, again, turn_id="t2")
    assert await held_state(store) == ([("call_0", "r2")], "r2")

    await logger.log_messages(CID, dead, turn_id="t1")

    assert await held_state(store) == ([("call_0", "r1")], None)
    assert await pending_state(store) == await recomputed_state(store)


async def test_a_relocated_answer_clears_a_second_question_as_an_appended_answer_does(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """t1 answers c1 and dies before inserting (its reservation took c1); t2 asks a second
    question r2 about the paused run. Appended after r2, t1's answer clears it (it holds no
    call, and the answer takes the last held one: `answers_clear`), as the stored messages
    say; the move leaves nothing pending."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    go = [{"role": "user", "content": "go"}, _calls("c1"), _asks("r1")]
    await logger.log_messages(CID, go, turn_id="t0")
    dead = [_answer("c1", "R1"), {"role": "assistant", "content": "booked"}]
    await _reserved_only(logger, monkeypatch, dead, "t1")
    await logger.log_messages(CID, [_asks("r2")], turn_id="t2")

    await logger.log_messages(CID, dead, turn_id="t1")

    assert await pending_state(store) == ([], None)
    assert await pending_state(store) == await recomputed_state(store)


async def test_a_late_retry_of_a_turn_whose_call_a_later_turn_answered_is_refused(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3 Tool pairing: an answer names a call of an earlier message. t1 [call c1,
    prompt r1] reserves and dies; its reservation listed c1, so t2 answers it. Moved to the
    end, t1's call would follow its own answer (asked again, run twice, its result dropped
    as an orphan): the retry is refused with Conflict naming why, and nothing of it is
    written; the turn is given up, its block's `seq`s gaps no turn holds (`popped_seqs`),
    once."""
    from agent_store import Conflict

    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, [_calls("c1"), _asks("r1")], "t1")
    done = [_answer("c1", "R1"), {"role": "assistant", "content": "done"}]
    await logger.log_messages(CID, done, turn_id="t2")
    before = await backend.db.agent_conversations.find_one({"_id": CID})

    for _ in range(2):  # every retry alike
        with pytest.raises(Conflict, match=r"a later turn answered its call 'c1'"):
            await logger.log_messages(CID, [_calls("c1"), _asks("r1")], turn_id="t1")

    assert [m.content for m in await store.transcript(CID)] == ["go", "R1", "done"]
    after = await backend.db.agent_conversations.find_one({"_id": CID})
    assert after["popped_seqs"] == [1, 2]
    assert [bool(r.get("g")) for r in after["turns"]] == [False, True, False]
    assert {**after, "popped_seqs": [], "turns": before["turns"]} == {**before, "popped_seqs": []}
    assert await pending_state(store) == ([], None)


def _book_it(user: str, tokens: int) -> list[dict[str, Any]]:
    """A user's request and the call c1 it makes, with its tokens."""
    usage = {"input_tokens": tokens, "output_tokens": tokens}
    return [{"role": "user", "content": user}, {**_calls("c1"), "token_usage": usage}]


async def test_a_late_retry_with_other_content_whose_call_a_later_turn_answered_is_refused_too(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3: a turn logged at the end in place of the empty block it reserved is not
    moved past an answer to its call, whatever content the retry sends. t1 [user, call c1]
    reserves and dies; t2 answers c1; t1's retry with a regenerated prompt still calling c1
    is refused as its first content is (its call would follow its answer, pending again and
    run twice), nothing of it stored; the turn is given up for good, and what its first
    reservation counted (not the retry's content) is taken back, once."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, _book_it("delete my file", 1000), "t1")
    done = [_answer("c1", "removed"), {"role": "assistant", "content": "done"}]
    await logger.log_messages(CID, done, turn_id="t2")

    for retried in (_book_it("delete my file please", 7), _book_it("delete my file", 1000)):
        with pytest.raises(Conflict, match=r"a later turn answered its call 'c1'"):
            await logger.log_messages(CID, retried, turn_id="t1")
        assert [m.content for m in await store.transcript(CID)] == ["go", "removed", "done"]
        assert await pending_state(store) == await recomputed_state(store) == ([], None)
        conversation = await store.get_conversation(CID)
        assert (conversation.turn_count, conversation.usage.input_tokens) == (1, 0)


@pytest.mark.parametrize("answered", [True, False], ids=["answered-since", "not-answered"])
@pytest.mark.parametrize("content", ["same", "other"])
async def test_checking_a_late_retry_raises_what_logging_it_does(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, content: str, answered: bool
) -> None:
    """LIBRARY.md: `check_turn` raises what `log_messages` refuses the same turn with, decided
    as it decides, writing nothing. A late retry of a turn that stored nothing, whose call a
    later turn answered, with its first content or another: both refuse it (it cannot move
    to the end); without that answer both take it (moved to the end)."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, _book_it("delete my file", 3), "t1")
    later = _answer("c1", "removed") if answered else {"role": "user", "content": "hurry"}
    await logger.log_messages(CID, [later], turn_id="t2")
    retried = _book_it("delete my file" if content == "same" else "delete it", 3)
    before = await digest(backend.db)

    if not answered:
        await logger.check_turn(CID, retried, turn_id="t1")
        assert await digest(backend.db) == before
        logged = await logger.log_messages(CID, retried, turn_id="t1")
        assert [m.seq for m in logged.messages] == [4, 5]
        return
    with pytest.raises(Conflict, match=r"a later turn answered its call 'c1'") as checked:
        await logger.check_turn(CID, retried, turn_id="t1")
    assert await digest(backend.db) == before
    with pytest.raises(Conflict) as refused:
        await logger.log_messages(CID, retried, turn_id="t1")
    assert (type(checked.value), str(checked.value)) == (type(refused.value), str(refused.value))
    assert [m.content for m in await store.transcript(CID)] == ["go", "removed"]
    with pytest.raises(Conflict, match=r"a later turn answered its call 'c1'"):  # given up
        await logger.check_turn(CID, retried, turn_id="t1")


class _PoppedFirst:
    """A cursor of the fold's read of the stored messages (`of_its_life`: every `seq` below
    `message_count`) running `pop` once before it reads: another pod's pop landing between
    the fold's read of the conversation and its read of the messages."""

    def __init__(self, cursor: Any, pop: Callable[[], Awaitable[Any]]) -> None:
        self.cursor, self.pop = cursor, pop

    def sort(self, *args: Any, **kwargs: Any) -> _PoppedFirst:
        self.cursor = self.cursor.sort(*args, **kwargs)
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cursor, name)

    async def to_list(self, length: int | None = None) -> list[Any]:
        await self.pop()
        return list(await self.cursor.to_list(length))


async def test_a_give_back_whose_fold_a_pop_ran_inside_folds_again(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN §3: the fold after a give-back is written only if no turn reserved and no pop
    ran meanwhile, read again up to three times. A late retry with other content gives back
    its first attempt's empty block (its call cL listed pending); another pod's pop of the
    last message runs between the fold's two reads, so the fold finds that `seq` empty and
    took it for a turn still being written: it reads again and writes what the stored
    messages make. cL, which no stored message makes, is not left pending for good."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("hi")], turn_id="t0")
    await logger.log_messages(CID, [_user("Lost question"), _calls("cL")], turn_id="L")
    await backend.db.agent_messages.delete_many({"turn_id": "L"})  # its insert lost
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    ago = datetime.now(UTC) - logger.rules.abandon_after * 2
    aged = [dict(r, a=ago) for r in doc["turns"]]
    await backend.db.agent_conversations.update_one({"_id": CID}, {"$set": {"turns": aged}})
    await logger.log_messages(CID, [_user("Later question"), _say("later")], turn_id="t9")
    find, popped = logger._messages.find, []

    async def pop() -> None:
        if not popped:
            popped.append(await ConversationStore(backend.db).pop_last_message(CID))

    def fold_read(query: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        cursor = find(query, *args, **kwargs)
        below = query.get("seq")
        whole = isinstance(below, dict) and set(below) == {"$lt"} and "epoch" in query
        return _PoppedFirst(cursor, pop) if whole else cursor

    monkeypatch.setattr(logger._messages, "find", fold_read)
    edited = [_user("Edited lost question"), _calls("cL2")]
    stored = await logger.log_messages(CID, edited, turn_id="L")
    monkeypatch.undo()

    assert popped
    assert [m.seq for m in stored.messages] == [4, 5]
    assert [c.tool_call_id for c in await store.pending_calls(CID)] == ["cL2"]


@pytest.mark.parametrize("prompt", [False, True], ids=["calls", "calls-and-prompt"])
async def test_a_refused_late_retry_leaves_pending_only_what_the_stored_messages_make(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, prompt: bool
) -> None:
    """t1 [calls c1 and c2, and a prompt r1 naming c2] reserves and dies; its reservation
    listed c2 and raised r1. t2 answers c1, so the late retry of t1 is refused and t1 is
    never stored: no stored message makes c2 or asks r1, and the summary says so (as the
    fold of the stored messages does), else a runtime answers c2 with an orphan result."""
    from agent_store import Conflict

    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], turn_id="t0")
    t1 = [_calls("c1", "c2")] + ([_asks_about("r1", "c2")] if prompt else [])
    await _reserved_only(logger, monkeypatch, t1, "t1")
    assert await pending_state(store) == (["c1", "c2"], "r1" if prompt else None)
    done = [_answer("c1", "R1"), {"role": "assistant", "content": "done"}]
    await logger.log_messages(CID, done, turn_id="t2")

    with pytest.raises(Conflict, match=r"a later turn answered its call 'c1'"):
        await logger.log_messages(CID, t1, turn_id="t1")

    assert [m.content for m in await store.transcript(CID)] == ["go", "R1", "done"]
    assert await recomputed_state(store) == ([], None)
    assert await pending_state(store) == ([], None)
    with pytest.raises(Conflict):  # every retry alike
        await logger.log_messages(CID, t1, turn_id="t1")
    assert await pending_state(store) == ([], None)


async def test_a_refused_late_retry_takes_back_the_turn_and_tokens_its_reservation_counted(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELIABILITY.md: a turn given up for good takes with it what its reservation listed,
    the turn and the tokens it counted too: t1 [the user's "book", calls c1 and c2 with
    their tokens] reserves and dies, t2 answers c1, and t1's late retry is refused. The
    conversation then counts what its stored messages hold, however many retries follow."""
    from agent_store import Conflict

    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], turn_id="t0")
    usage = {"input_tokens": 1000, "output_tokens": 500}
    t1 = [{"role": "user", "content": "book"}, {**_calls("c1", "c2"), "token_usage": usage}]
    await _reserved_only(logger, monkeypatch, t1, "t1")
    counted = await store.get_conversation(CID)
    assert (counted.turn_count, counted.usage.input_tokens) == (2, 1000)
    done = [_answer("c1", "R1"), {"role": "assistant", "content": "done", "token_usage":
            {"input_tokens": 10, "output_tokens": 5}}]  # fmt: skip
    await logger.log_messages(CID, done, turn_id="t2")

    for _ in range(2):  # every retry alike: taken back once
        with pytest.raises(Conflict, match=r"a later turn answered its call 'c1'"):
            await logger.log_messages(CID, t1, turn_id="t1")
        conversation = await store.get_conversation(CID)
        assert conversation.turn_count == 1
        assert (conversation.usage.input_tokens, conversation.usage.output_tokens) == (10, 5)
    assert await pending_state(store) == ([], None)


async def test_a_late_retry_refused_while_a_turn_below_is_being_written_is_retried_later(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, with t3 reserved and not yet inserted when t1's retry comes: the fold cannot
    read t3's messages, so the retry is told to come again (`StorageUnavailable`, nothing
    written but the mark that the fold is owed, `refold_owed`) rather than refused with what
    t1's reservation listed left pending; once t3 is stored, the retry is refused and the
    summary is the fold of the stored messages, owed no more."""
    from agent_store import Conflict

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, [_calls("c1", "c2")], "t1")
    await _age(backend, "t1")
    await logger.log_messages(CID, [_answer("c1", "R1")], turn_id="t2")
    t3 = [{"role": "user", "content": "next"}]
    await _reserved_only(logger, monkeypatch, t3, "t3")
    before = await backend.db.agent_conversations.find_one({"_id": CID})

    with pytest.raises(StorageUnavailable, match="being written"):
        await logger.log_messages(CID, [_calls("c1", "c2")], turn_id="t1")
    after = await backend.db.agent_conversations.find_one({"_id": CID})
    assert after.pop("refold_owed") is not None
    assert after == before

    await logger.log_messages(CID, t3, turn_id="t3")  # t3's insert lands
    with pytest.raises(Conflict, match=r"a later turn answered its call 'c1'"):
        await logger.log_messages(CID, [_calls("c1", "c2")], turn_id="t1")
    assert await pending_state(store) == await recomputed_state(store) == ([], None)
    owed = await backend.db.agent_conversations.find_one({"_id": CID})
    assert owed.get("refold_owed") is None


@pytest.mark.parametrize("content", ["same", "other"])
async def test_a_late_retry_is_not_moved_past_a_turn_still_writing_the_answer_to_its_call(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, content: str
) -> None:
    """DESIGN.md §3: a turn whose call a message logged meanwhile answers is not moved, nor
    is one an answer reserved meanwhile and still on its way may answer. t1 [user, call c1]
    reserves and dies; t2 [c1's result] reserves on time (its reservation took c1 off the
    pending calls) and has not inserted yet when t1's late retry comes. Moved past t2's
    block, t1's call would follow its answer once t2 lands, pending again and run twice: the
    retry, with its first content or another, is told to come again (`StorageUnavailable`,
    nothing written, `check_turn` alike), and once t2 is stored it is refused as answered."""
    from agent_store import Conflict

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, _book_it("delete my file", 3), "t1")
    await _age(backend, "t1")
    done = [_answer("c1", "removed"), {"role": "assistant", "content": "done"}]
    await _reserved_only(logger, monkeypatch, done, "t2")  # on time, its insert on its way
    retried = _book_it("delete my file" if content == "same" else "delete it", 3)
    before = await backend.db.agent_conversations.find_one({"_id": CID})

    with pytest.raises(StorageUnavailable, match="still being written"):
        await logger.check_turn(CID, retried, turn_id="t1")
    with pytest.raises(StorageUnavailable, match="still being written"):
        await logger.log_messages(CID, retried, turn_id="t1")
    assert await backend.db.agent_conversations.find_one({"_id": CID}) == before
    assert [m.content for m in await store.transcript(CID)] == ["go"]

    await logger.log_messages(CID, done, turn_id="t2")  # t2's insert lands
    with pytest.raises(Conflict, match=r"a later turn answered its call 'c1'"):
        await logger.log_messages(CID, retried, turn_id="t1")
    assert [m.content for m in await store.transcript(CID)] == ["go", "removed", "done"]
    assert await pending_state(store) == await recomputed_state(store) == ([], None)


async def test_a_late_retry_is_not_moved_when_an_answer_to_its_call_lands_after_its_lookup(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3: a turn whose call a message logged meanwhile answers is not moved, even
    when that answer is logged by another pod after the retry's lookup of its empty block
    found none, just before its move: the move holds only while nothing was reserved since
    that lookup, else the retry reads again and is refused as answered, nothing of it stored
    (its call is never stored after its answer, pending again)."""
    from agent_store import Conflict

    logger, store = _late_logger(backend), ConversationStore(backend.db)
    other_pod = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], turn_id="t0")
    lost = _book_it("delete my file", 3)
    await _reserved_only(logger, monkeypatch, lost, "t1")
    await logger.log_messages(CID, [{"role": "user", "content": "hurry"}], turn_id="t2")
    move = logger._conversations.find_one_and_update

    async def answered_first(query: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if "$elemMatch" in str(query.get("turns")):  # the move, after the lookup
            monkeypatch.undo()
            done = [_answer("c1", "removed"), {"role": "assistant", "content": "done"}]
            await other_pod.log_messages(CID, done, turn_id="t3")
        return await move(query, *args, **kwargs)

    monkeypatch.setattr(logger._conversations, "find_one_and_update", answered_first)
    with pytest.raises(Conflict, match=r"a later turn answered its call 'c1'"):
        await logger.log_messages(CID, lost, turn_id="t1")

    assert [m.content for m in await store.transcript(CID)] == ["go", "hurry", "removed", "done"]
    assert await pending_state(store) == await recomputed_state(store) == ([], None)
    assert (await store.get_conversation(CID)).turn_count == 2


async def _named_answer_reserved_only(
    logger: AgentMessageLogger,
    monkeypatch: pytest.MonkeyPatch,
    messages: list[dict[str, Any]],
    answers_to: dict[str, str],
) -> None:
    """Log turn "tA", answering calls `answers_to` names, that reserves and stores nothing."""

    async def lost(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the turn reserved and has not inserted")

    monkeypatch.setattr(logger._messages, "insert_many", lost)
    with pytest.raises(ConnectionError):
        await logger.log_messages(CID, messages, turn_id="tA", answers_to=answers_to)
    monkeypatch.undo()


async def test_a_late_retry_answering_a_call_another_turn_answered_since_is_answered_before(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LIBRARY.md `answers_to`, DESIGN.md Tool pairing: a call's first answer is its answer.
    tA answers c1 (naming it) and stores nothing; past `abandon_after` tB answers c1 (the
    abandoned block holds no answer). Moved to the end, tA would be a second, contradicting
    result of c1: the retry is judged where it lands as a fresh turn is, `AnsweredBefore`
    (`check_turn` alike), nothing of it stored, its turn given up; every retry alike."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    t0 = await logger.log_messages(CID, [{"role": "user", "content": "go"}, _calls("c1")])
    named = {"c1": t0.messages[1].id}
    tA = [_answer("c1", "sunny (A)"), {"role": "assistant", "content": "It is sunny."}]
    await _named_answer_reserved_only(logger, monkeypatch, tA, named)
    tB = [_answer("c1", "rainy (B)"), {"role": "assistant", "content": "It is rainy."}]
    await logger.log_messages(CID, tB, turn_id="tB", answers_to=named)

    with pytest.raises(AnsweredBefore, match=r"'c1'.*answered that call first") as checked:
        await logger.check_turn(CID, tA, turn_id="tA", answers_to=named)
    for _ in range(2):
        with pytest.raises(AnsweredBefore, match=r"'c1'.*answered that call first") as refused:
            await logger.log_messages(CID, tA, turn_id="tA", answers_to=named)
        assert str(refused.value) == str(checked.value)
        assert refused.value.tool_call_ids == ("c1",)

    assert [m.content for m in await store.transcript(CID)][2:] == ["rainy (B)", "It is rainy."]
    assert await pending_state(store) == await recomputed_state(store) == ([], None)
    assert (await store.get_conversation(CID)).turn_count == 1


async def test_a_late_retry_answering_a_call_whose_message_was_popped_is_invalid(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tA answers c1 (naming the message making it) and stores nothing; past `abandon_after`
    a person pops that message. Moved to the end, tA's result would answer a call no stored
    message makes (an orphan): the retry is judged as the same turn sent fresh is,
    `InvalidInput` (`check_turn` alike), nothing of it stored."""
    logger = _late_logger(backend)
    store = ConversationStore(backend.db, rules=logger.rules)
    t0 = await logger.log_messages(CID, [{"role": "user", "content": "go"}, _calls("c1")])
    named = {"c1": t0.messages[1].id}
    tA = [_answer("c1", "sunny"), {"role": "assistant", "content": "Sunny."}]
    await _named_answer_reserved_only(logger, monkeypatch, tA, named)
    popped = await store.pop_last_message(CID)
    assert popped is not None
    assert popped.id == named["c1"]

    with pytest.raises(InvalidInput, match=r"does not make call 'c1'"):
        await logger.check_turn(CID, tA, turn_id="tA", answers_to=named)
    with pytest.raises(InvalidInput, match=r"does not make call 'c1'"):
        await logger.log_messages(CID, tA, turn_id="tA", answers_to=named)

    assert [m.content for m in await store.transcript(CID)] == ["go"]
    assert await pending_state(store) == await recomputed_state(store) == ([], None)


# -- a stalled writer whose insert lands after another answer to its call -------------------


class _StalledInsert:
    """A writer alive but stalled inside its insert: the command is sent on time and reaches
    the server only once `release` is called (a paused process, a slow network). With
    `replies`, its reply reaches the writer only once that is set too (`landed` says the
    insert has landed): writers whose stalls end together all land before any reads."""

    def __init__(
        self,
        logger: AgentMessageLogger,
        monkeypatch: pytest.MonkeyPatch,
        replies: asyncio.Event | None = None,
    ) -> None:
        self.reached, self.gate, self.landed = asyncio.Event(), asyncio.Event(), asyncio.Event()
        insert = logger._messages.insert_many

        async def stalled(*args: Any, **kwargs: Any) -> Any:
            self.reached.set()
            await self.gate.wait()
            try:
                return await insert(*args, **kwargs)
            finally:
                self.landed.set()
                if replies is not None:
                    await replies.wait()

        monkeypatch.setattr(logger._messages, "insert_many", stalled)

    async def start(self, write: Awaitable[LoggedTurn]) -> asyncio.Task[LoggedTurn]:
        """Run `write` until its insert is sent (its reservation made), stalled there."""
        task = asyncio.ensure_future(write)
        await self.reached.wait()
        return task

    def release(self) -> None:
        self.gate.set()


async def _counters(store: ConversationStore) -> tuple[int, int, int, int]:
    conversation = await store.get_conversation(CID)
    usage = conversation.usage
    return (
        conversation.message_count,
        conversation.turn_count,
        usage.input_tokens,
        usage.output_tokens,
    )


async def test_a_stalled_writer_answering_a_call_another_turn_answered_meanwhile_keeps_its_answer(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELIABILITY.md: tA answers c1 (naming it) and its writer stalls inside its insert past
    `abandon_after`; tB answers c1 (the block readers passed holds no answer), is stored and
    acknowledged. tA's insert then lands in its block: what landed stays (a reader, a fork or
    a retry of tA may have been served it), and tA is acknowledged where it reserved, its cut
    answer's whole text kept. c1 holds two answers, tA's below tB's, each counted once; every
    retry of tA replays it, and the pending state is what the stored messages say."""
    from agent_store.store import BLOB_BUCKET

    rules = TurnRules(abandon_after=timedelta(0), max_message_bytes=16 * 1024)
    writer_a, writer_b = (AgentMessageLogger(backend.db, rules=rules) for _ in range(2))
    store = ConversationStore(backend.db, rules=rules)
    t0 = await writer_a.log_messages(CID, [{"role": "user", "content": "pay?"}, _calls("c1")])
    named = {"c1": t0.messages[1].id}
    usage = {"input_tokens": 100, "output_tokens": 50}
    paid = {"role": "assistant", "content": "Paid.", "token_usage": usage}
    tA = [_answer("c1", "PAID (A) " + "receipt " * 4000), paid]  # cut: its whole text kept
    stall = _StalledInsert(writer_a, monkeypatch)
    late = await stall.start(writer_a.log_messages(CID, tA, turn_id="tA", answers_to=named))
    tB = [_answer("c1", "denied (B)"), {"role": "assistant", "content": "Not paid."}]
    assert not (await writer_b.log_messages(CID, tB, turn_id="tB", answers_to=named)).replayed

    stall.release()
    logged_a = await late
    monkeypatch.undo()

    assert [m.seq for m in logged_a.messages] == [2, 3]
    assert await backend.db[f"{BLOB_BUCKET}.files"].count_documents({}) == 1
    stored = await store.transcript(CID)
    assert [(m.seq, m.tool_call_id or m.content) for m in stored][2:] == [
        (2, "c1"),
        (3, "Paid."),
        (4, "c1"),
        (5, "Not paid."),
    ]
    assert await _counters(store) == (6, 1, 100, 50)
    assert await pending_state(store) == await recomputed_state(store) == ([], None)
    exported = [m for m in chat_completions(stored) if m["role"] == "tool"]
    assert [m["content"][:8] for m in exported] == ["PAID (A)"]  # c1 paired with its first
    for _ in range(2):  # its retry: a replay, nothing stored twice
        again = await writer_a.log_messages(CID, tA, turn_id="tA", answers_to=named)
        assert again.replayed
        assert [m.id for m in again.messages] == [m.id for m in logged_a.messages]
    assert await store.transcript(CID) == stored
    assert await _counters(store) == (6, 1, 100, 50)


async def test_a_slow_answer_to_a_call_whose_turn_is_still_being_written_is_kept(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tM makes c2 and its writer stalls inside its insert; tC answers c2 as `pending_calls`
    served it (tM's reservation listed it), its own insert slower than readers wait for. tC
    is stored and acknowledged, never taken back as answering a call no message makes: the
    message making c2 is still being written, and lands."""
    maker, answerer = _late_logger(backend), _late_logger(backend)
    store = ConversationStore(backend.db, rules=maker.rules)
    await maker.log_messages(CID, [{"role": "user", "content": "ship?"}], turn_id="t0")
    stall = _StalledInsert(maker, monkeypatch)
    making = await stall.start(maker.log_messages(CID, [_calls("c2")], turn_id="tM"))
    [pending] = await store.pending_calls(CID)

    shipped = await answerer.log_messages(
        CID,
        [_answer("c2", "SHIPPED"), {"role": "assistant", "content": "Shipped."}],
        turn_id="tC",
        answers_to={"c2": pending.message_id},
    )
    stall.release()
    await making
    monkeypatch.undo()

    assert [m.content for m in shipped.messages] == ["SHIPPED", "Shipped."]
    stored = await store.transcript(CID)
    assert [m.tool_call_id or m.content for m in stored] == ["ship?", None, "c2", "Shipped."]
    assert await pending_state(store) == await recomputed_state(store) == ([], None)


async def test_a_stalled_writer_whose_own_call_another_turn_answered_is_kept(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tA answers c1 and makes c2; its writer stalls inside its insert past `abandon_after`.
    tB answers c1 (accepted: the passed block held no answer); `pending_calls` lists c2 as
    tA's reservation left it, so tC answers c2 and is stored and acknowledged. tA's insert
    then lands and is kept (stored, acknowledged; c1's second answer, as any stalled writer's
    is), so tC's answer keeps its call."""
    writer_a, writer_b = _late_logger(backend), _late_logger(backend)
    store = ConversationStore(backend.db, rules=writer_a.rules)
    t0 = await writer_a.log_messages(CID, [{"role": "user", "content": "pay, ship?"}, _calls("c1")])
    named = {"c1": t0.messages[1].id}
    stall = _StalledInsert(writer_a, monkeypatch)
    tA = [_answer("c1", "PAID"), _calls("c2")]
    late = await stall.start(writer_a.log_messages(CID, tA, turn_id="tA", answers_to=named))
    tB = [_answer("c1", "denied"), {"role": "assistant", "content": "Not paid."}]
    await writer_b.log_messages(CID, tB, turn_id="tB", answers_to=named)
    (c2,) = await store.pending_calls(CID)
    assert c2.tool_call_id == "c2"
    tC = [_answer("c2", "SHIPPED"), {"role": "assistant", "content": "Shipped."}]
    served = AgentMessageLogger(backend.db)  # fast: no look after its insert
    await served.log_messages(CID, tC, turn_id="tC", answers_to={"c2": c2.message_id})

    stall.release()
    logged_a = await late
    monkeypatch.undo()

    assert [m.id for m in logged_a.messages][1] == c2.message_id
    stored = await store.transcript(CID)
    assert c2.message_id in {m.id for m in stored}
    exported = chat_completions(stored)
    assert "SHIPPED" in [m["content"] for m in exported if m["role"] == "tool"]
    assert [(m.seq, m.tool_call_id) for m in stored if m.role == "tool"] == [
        (2, "c1"),
        (4, "c1"),
        (6, "c2"),
    ]
    assert await pending_state(store) == await recomputed_state(store)
    assert await store.pending_calls(CID) == []


async def _age(backend: Backend, turn_id: str) -> None:
    """Set the turn's record back 30 minutes, past the default `abandon_after`."""
    from datetime import timedelta

    from agent_store.store._turns import turn_key

    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    turns = doc["turns"]
    for record in turns:
        if record["k"] == turn_key(turn_id):
            record["a"] -= timedelta(minutes=30)
    await backend.db.agent_conversations.update_one({"_id": CID}, {"$set": {"turns": turns}})


async def test_a_relocated_turn_keeps_what_a_turn_still_being_written_below_it_left_pending(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The move's fold reads the stored messages: a turn that reserved below the new block
    and has not inserted yet (younger than `abandon_after`) is not among them, so the move
    keeps the pending state the reservations set rather than write one without it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, [_calls("c1")], "t1")
    await _age(backend, "t1")
    await _reserved_only(logger, monkeypatch, [_calls("c2")], "t2")  # still being written

    await logger.log_messages(CID, [_calls("c1")], turn_id="t1")

    assert [m.seq for m in await store.transcript(CID)] == [0, 3]
    assert await pending_state(store) == (["c2", "c1"], None)


# -- a prompt naming the calls it holds back --------------------------------------------


def _start(call_id: str) -> dict[str, Any]:
    return {"type": "tool_start", "tool_name": "book", "tool_call_id": call_id,
            "args": {"x": call_id}}  # fmt: skip


def _confirm(request_id: str, call_id: str) -> dict[str, Any]:
    return {"type": "confirm_required", "request_id": request_id, "action": "book",
            "params": {}, "prompt": f"ok {request_id}?", "tool_call_id": call_id}  # fmt: skip


REFUSED_LATER = {
    # two calls in one response, one confirmation each; the pending one (r2, of c2) is refused
    "two-calls-each-confirmed": (
        [[_start("c1"), _start("c2"), _confirm("r1", "c1"), _confirm("r2", "c2")]], "r2", "c2"
    ),
    # a second question, in a later turn, about a call an earlier turn left pending
    "asked-again-in-a-later-turn": (
        [[_start("c1"), _confirm("r1", "c1")],
         [{"type": "stream_token", "token": "Still?"}, _confirm("r2", "c1")]], "r2", "c1"
    ),
    # asked twice before the tool ran; the pending (second) prompt is refused
    "asked-twice-before-start": (
        [[_confirm("r1", "c1"), _confirm("r2", "c1"), _start("c1")]], "r2", "c1"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSED_LATER))
async def test_a_refusal_in_a_later_turn_denies_the_call_its_prompt_named(
    backend: Backend, case: str
) -> None:
    """STREAMING.md: a confirmation refused answers "the call it holds back (of this turn or
    an earlier one)" as denied: the call its `confirm_required` named, whichever prompt
    came first, and whichever turn asked."""
    runtime = Runtime(backend)
    turns, refused, call_id = REFUSED_LATER[case]
    for events in turns:
        await runtime.stream(events, prompt="go")
    pending = await runtime.store.pending_calls(CID)
    assert (call_id, refused) in [(c.tool_call_id, c.request_id) for c in pending]

    await runtime.stream([{"type": "confirm_resolved", "request_id": refused, "approved": False}])

    assert await runtime.answers_of(call_id) == [(DENIED_RESULT, "tool call denied")]
    assert call_id not in [c.tool_call_id for c in await runtime.store.pending_calls(CID)]
    assert await pending_state(runtime.store) == await recomputed_state(runtime.store)


def _asks_about(request_id: str, *call_ids: str) -> dict[str, Any]:
    hitl = {"action": "confirm", "params": {}, "request_id": request_id,
            "tool_call_ids": list(call_ids)}  # fmt: skip
    return {"role": "assistant", "content": "Sure?", "hitl_action": hitl}


async def folded_state(
    store: ConversationStore, cid: str = CID
) -> tuple[list[tuple[str, str | None]], str | None]:
    """`held_state` as a pop or a fork folds it from the stored messages."""
    calls, prompt = pending_after(await store.transcript(cid))
    return [(c.tool_call_id, c.request_id) for c in calls], prompt.request_id if prompt else None


async def test_a_prompt_naming_its_calls_holds_exactly_those_and_a_later_one_holds_them_again(
    backend: Backend,
) -> None:
    """A prompt's `tool_call_ids` name the calls it holds back, of its turn or of earlier
    turns (the latest pending call of each id); a prompt naming none holds its turn's calls
    before it that no prompt holds. The reservation and the fold of the messages agree."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "go"}, _calls("c1", "c2", "c3"),
         _asks_about("r1", "c1"), _asks_about("r2", "c2"), _asks("r3")],
        turn_id="t1",
    )  # fmt: skip
    assert await held_state(store) == ([("c1", "r1"), ("c2", "r2"), ("c3", "r3")], "r3")
    assert await folded_state(store) == await held_state(store)

    await logger.log_messages(CID, [_asks_about("r4", "c1", "gone")], turn_id="t2")

    assert await held_state(store) == ([("c1", "r4"), ("c2", "r2"), ("c3", "r3")], "r4")
    assert await folded_state(store) == await held_state(store)
    await logger.log_messages(
        CID, [{"role": "tool", "tool_call_id": "c1", "content": "ok"}], turn_id="t3"
    )
    assert await held_state(store) == ([("c2", "r2"), ("c3", "r3")], None)
    assert await folded_state(store) == await held_state(store)


async def test_a_prompt_answered_in_its_turn_after_naming_an_earlier_call_is_not_left_pending(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}, _calls("c1", "c2")])

    await logger.log_messages(
        CID,
        [{"role": "user", "content": "sure?"}, _asks_about("r1", "c2"),
         {"role": "tool", "tool_call_id": "c2", "content": "ok"}],
        turn_id="t2",
    )  # fmt: skip

    assert await held_state(store) == ([("c1", None)], None)
    assert await folded_state(store) == await held_state(store)


async def test_a_prompt_may_name_a_hundred_calls_of_earlier_turns(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    ids = [f"call-{n}" for n in range(100)]
    await logger.log_messages(CID, [{"role": "user", "content": "go"}, _calls(*ids)])

    await logger.log_messages(CID, [_asks_about("r1", *ids)], turn_id="t2")

    assert await held_state(store) == ([(i, "r1") for i in ids], "r1")
    assert await folded_state(store) == await held_state(store)


async def test_popping_a_second_question_gives_its_call_back_to_the_first_question(
    backend: Backend,
) -> None:
    """RUNTIMES.md (pop): calls the removed prompt held are held as the messages before it
    hold them, and the prompt they leave pending is pending again. A second question about
    a pending call, popped, leaves the call held by the first question again, pending, so
    it can be resolved, and refusing it denies the call."""
    runtime = Runtime(backend)
    await runtime.stream([_start("c1"), _confirm("r1", "c1")], prompt="go")
    await runtime.stream([_confirm("r2", "c1")], prompt="well?")  # asked again about c1
    assert await held_state(runtime.store) == ([("c1", "r2")], "r2")

    popped = await runtime.store.pop_last_message(CID)  # the second question
    assert popped is not None
    assert popped.hitl_action is not None

    assert await held_state(runtime.store) == ([("c1", "r1")], "r1")
    assert await folded_state(runtime.store) == ([("c1", "r1")], "r1")
    await runtime.stream([{"type": "confirm_resolved", "request_id": "r1", "approved": False}])
    assert await runtime.answers_of("c1") == [(DENIED_RESULT, "tool call denied")]
    assert await runtime.store.pending_calls(CID) == []


SECOND_QUESTION_IDS = pytest.mark.parametrize(
    "asked_under", ["confirm-9", "confirm-10"], ids=["same-request-id", "new-request-id"]
)
DENIAL_OF_TC_9 = {"role": "tool", "tool_call_id": "tc-9", "content": DENIED_RESULT,
                  "error": {"message": "tool call denied"}}  # fmt: skip


async def _approved_then_asked_again(runtime: Runtime, asked_under: str) -> int:
    """tc-9 approved (the tool runs), then a second question about it under `asked_under`;
    the `seq` of the last message before that question."""
    await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    logged = await runtime.stream([APPROVED], prompt="Yes.")
    await runtime.stream([{**ASKS_AGAIN, "request_id": asked_under}])
    last = logged.messages[-1].seq
    assert last is not None
    return last


async def _an_approved_call_stays_released(
    logger: AgentMessageLogger, store: ConversationStore, cid: str
) -> None:
    """The call is listed released, a denial naming the approving prompt is refused with
    nothing written, and the tool's real result answers it."""
    assert [(c.tool_call_id, c.request_id) for c in await store.pending_calls(cid)] == [
        ("tc-9", None)
    ]
    before = await store.transcript(cid)
    with pytest.raises(AnsweredBefore, match=r"'tc-9'.*approved"):
        await logger.log_messages(
            cid, [{"role": "user", "content": "No."}, DENIAL_OF_TC_9], turn_id="late-denial",
            refused_prompts={"tc-9": "confirm-9"},
        )  # fmt: skip
    assert await store.transcript(cid) == before
    await logger.log_messages(
        cid, [{"role": "tool", "tool_call_id": "tc-9", "content": "B-42"}], turn_id="result"
    )
    answers = [(m.content, m.error) for m in await store.transcript(cid) if m.role == "tool"]
    assert answers == [("B-42", None)]
    assert await store.pending_calls(cid) == []


@SECOND_QUESTION_IDS
async def test_popping_a_second_question_about_an_approved_call_leaves_its_approval_in_force(
    backend: Backend, asked_under: str
) -> None:
    """STREAMING.md (what the store cannot tell apart) and RUNTIMES.md (pop): the approval
    stands once the question holding the call again is popped, whatever request id it was
    asked under: the call stays released, a refusal denies nothing, the real result answers
    it."""
    runtime = Runtime(backend)
    await _approved_then_asked_again(runtime, asked_under)

    popped = await runtime.store.pop_last_message(CID)

    assert popped is not None
    assert popped.hitl_action is not None
    await _an_approved_call_stays_released(runtime.logger, runtime.store, CID)


async def test_after_such_a_pop_the_earlier_prompt_of_that_id_stays_answered(
    backend: Backend,
) -> None:
    """STREAMING.md: the earlier prompt of the id stays answered once the question asked
    under its id is popped (a resolution is remembered per asking), as after the approval;
    a late refusal of it denies nothing."""
    runtime = Runtime(backend)
    await _approved_then_asked_again(runtime, "confirm-9")
    await runtime.store.pop_last_message(CID)
    assert await held_state(runtime.store) == ([("tc-9", None)], None)

    await runtime.stream([DENIED], prompt="No, cancel it.")

    assert await runtime.answers_of("tc-9") == []
    assert await held_state(runtime.store) == ([("tc-9", None)], None)
    await runtime.stream([BOOKED])
    assert await runtime.answers_of("tc-9") == [('{"booking":"B-42"}', None)]


@SECOND_QUESTION_IDS
async def test_a_fork_cut_before_a_second_question_about_an_approved_call_keeps_the_approval(
    backend: Backend, asked_under: str
) -> None:
    """STREAMING.md (what the store cannot tell apart): a fork cut before the question that
    held the approved call again remembers the approval in force: the call stays released,
    a refusal denies nothing, the real result answers it."""
    runtime = Runtime(backend)
    cut = await _approved_then_asked_again(runtime, asked_under)

    await runtime.logger.fork(CID, cut, "conv-cross-fork")

    await _an_approved_call_stays_released(runtime.logger, runtime.store, "conv-cross-fork")


async def test_a_fork_that_copies_a_second_question_about_an_approved_call_keeps_it_holding(
    backend: Backend,
) -> None:
    """A fork copying the second question copies what it holds: the call waits for its
    answer, and its refusal denies the call."""
    runtime = Runtime(backend)
    await _approved_then_asked_again(runtime, "confirm-10")
    everything = (await runtime.store.get_conversation(CID)).message_count - 1

    await runtime.logger.fork(CID, everything, "conv-cross-fork")

    assert await held_state(runtime.store, "conv-cross-fork") == (
        [("tc-9", "confirm-10")],
        "confirm-10",
    )
    await runtime.logger.log_messages(
        "conv-cross-fork", [{"role": "user", "content": "No."}, DENIAL_OF_TC_9],
        turn_id="denial", refused_prompts={"tc-9": "confirm-10"},
    )  # fmt: skip
    assert await held_state(runtime.store, "conv-cross-fork") == ([], None)


async def test_an_approval_stored_marked_held_again_before_held_by_stays_held_by_its_question(
    backend: Backend,
) -> None:
    """An approval a second question held again, stored before `held_by` named the question
    (`held_again: true`), is read as held: the call waits for that question, and its refusal
    denies the call."""
    runtime = Runtime(backend)
    await _approved_then_asked_again(runtime, "confirm-10")
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert doc is not None
    (approval,) = doc["approved_calls"]
    assert approval["held_by"] is not None
    stored_before = {k: approval[k] for k in ("tool_call_id", "message_id", "request_id")}
    await backend.db.agent_conversations.update_one(
        {"_id": CID}, {"$set": {"approved_calls": [{**stored_before, "held_again": True}]}}
    )

    assert await held_state(runtime.store) == ([("tc-9", "confirm-10")], "confirm-10")
    await runtime.stream([{**DENIED, "request_id": "confirm-10"}], prompt="No.")
    assert await runtime.answers_of("tc-9") == [(DENIED_RESULT, "tool call denied")]


def _question(request_id: str) -> dict[str, Any]:
    """A prompt naming the call tc-9 it asks about (`tool_call_ids`)."""
    hitl = {"action": "confirm", "params": {}, "request_id": request_id, "tool_call_ids": ["tc-9"]}
    return {"role": "assistant", "content": f"Sure ({request_id})?", "hitl_action": hitl}


async def _approved_then_asked_again_by(
    logger: AgentMessageLogger, store: ConversationStore, cid: str, *request_ids: str
) -> None:
    """tc-9 asked about by q1, which a person approves, then asked about again by each of
    `request_ids`, a turn each (user message, question): seqs 0-2, then two per turn."""
    ask = [{"role": "user", "content": "Book it."}, _book(), _question("q1")]
    await logger.log_messages(cid, ask, turn_id="t0")
    await store.resolve_hitl(cid, "q1")
    for n, request_id in enumerate(request_ids, start=1):
        again = [{"role": "user", "content": "And?"}, _question(request_id)]
        await logger.log_messages(cid, again, turn_id=f"t{n}")


async def _refusal_of(logger: AgentMessageLogger, cid: str, request_id: str) -> bool:
    """Whether a turn denying tc-9 as the refusal of the prompt `request_id` is logged."""
    denial = [{"role": "user", "content": "No."}, DENIAL_OF_TC_9]
    try:
        await logger.log_messages(
            cid, denial, turn_id="denial", refused_prompts={"tc-9": request_id}
        )
    except AnsweredBefore:
        return False
    return True


async def _as_logged_fresh(backend: Backend) -> tuple[Any, ...]:
    """What q1 approved then q2 asking about tc-9 again leave, logged in a conversation of
    their own: q2 pending, holding tc-9, and its refusal denies the call."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _approved_then_asked_again_by(logger, store, "conv-fresh", "q2")
    state = await held_state(store, "conv-fresh")
    assert state == ([("tc-9", "q2")], "q2")
    return state, await _refusal_of(logger, "conv-fresh", "q2")


async def test_a_fork_cut_after_a_second_question_awaits_it_though_a_third_one_followed(
    backend: Backend,
) -> None:
    """DESIGN.md §3 Forks: a fork cut right after the second question about an approved call
    awaits what the original's turns left pending there, as those turns logged fresh do: the
    second question holds the call, and its refusal denies it, although a third question the
    fork leaves out held the call in the original since."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _approved_then_asked_again_by(logger, store, CID, "q2", "q3")

    await logger.fork(CID, 4, "conv-fork")  # right after q2

    forked = await held_state(store, "conv-fork"), await _refusal_of(logger, "conv-fork", "q2")
    assert forked == await _as_logged_fresh(backend) == (([("tc-9", "q2")], "q2"), True)


async def test_popping_a_third_question_leaves_the_second_one_holding_the_approved_call(
    backend: Backend,
) -> None:
    """LIBRARY.md Pending HITL: popping the third question about an approved call (and its
    turn's user message) leaves the conversation as the turns before it logged fresh do:
    the second question holds the call again, and its refusal denies it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _approved_then_asked_again_by(logger, store, CID, "q2", "q3")

    await store.pop_last_message(CID)  # q3
    await store.pop_last_message(CID)  # its turn's user message

    popped = await held_state(store), await _refusal_of(logger, CID, "q2")
    assert popped == await _as_logged_fresh(backend) == (([("tc-9", "q2")], "q2"), True)


CUT_BY = pytest.mark.parametrize("cut", ["pop", "fork"])


async def _cut_after_q2(logger: AgentMessageLogger, store: ConversationStore, cut: str) -> str:
    """The conversation left once what follows q2 (seq 4) is cut: the last message popped,
    or a fork cut right after q2."""
    if cut == "pop":
        await store.pop_last_message(CID)
        return CID
    await logger.fork(CID, 4, "conv-fork")
    return "conv-fork"


async def _holders_of_tc_9(store: ConversationStore, backend: Backend, cid: str) -> Any:
    """The approval of tc-9's holder history (`held_before`, then `held_by`) as request ids."""
    asked = {m.id: m.hitl_action.request_id for m in await store.transcript(cid) if m.hitl_action}
    doc = await backend.db.agent_conversations.find_one({"_id": cid})
    assert doc is not None
    (approval,) = doc["approved_calls"]
    return [asked[m] for m in approval["held_before"]], asked.get(approval["held_by"])


async def test_questions_of_one_turn_about_an_approved_call_leave_the_history_of_a_turn_each(
    backend: Backend,
) -> None:
    """STREAMING.md (Two answers racing): every question of a turn naming an approved call
    holds it in its order, as the same questions logged a turn each do: the approval
    remembers all but the latest (`held_before`), the latest holds it (`held_by`)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _approved_then_asked_again_by(logger, store, "conv-apart", "q2", "q3", "q4")
    await _approved_then_asked_again_by(logger, store, CID)
    asked = [{"role": "user", "content": "And?"}, _question("q2"), _question("q3"), _question("q4")]

    await logger.log_messages(CID, asked, turn_id="t1")

    one_turn = await _holders_of_tc_9(store, backend, CID)
    assert one_turn == await _holders_of_tc_9(store, backend, "conv-apart") == (["q2", "q3"], "q4")


@CUT_BY
async def test_cutting_the_later_of_two_questions_of_one_turn_leaves_the_earlier_holding_the_call(
    backend: Backend, cut: str
) -> None:
    """STREAMING.md (Two answers racing): two questions about an approved call in one turn,
    the later popped or left out of a fork, leave the call held by the earlier one, as it
    logged afresh does: pending, and its refusal denies the call."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _approved_then_asked_again_by(logger, store, CID)
    asked = [{"role": "user", "content": "And?"}, _question("q2"), _question("q3")]
    await logger.log_messages(CID, asked, turn_id="t1")

    left = await _cut_after_q2(logger, store, cut)

    state = await held_state(store, left), await _refusal_of(logger, left, "q2")
    assert state == await _as_logged_fresh(backend) == (([("tc-9", "q2")], "q2"), True)


async def test_popping_the_later_of_two_streamed_questions_lets_a_refusal_of_the_earlier_deny(
    backend: Backend,
) -> None:
    """STREAMING.md (Two answers racing), through `log_streamed_turn`: one stream asking
    twice about an approved call, the later question popped, leaves the earlier one
    holding the call; the person's refusal of it denies the call (the tool never runs)."""
    runtime = Runtime(backend)
    await runtime.stream([_start("c1"), _confirm("r1", "c1")], prompt="go")
    await runtime.stream([{"type": "confirm_resolved", "request_id": "r1", "approved": True}])
    await runtime.stream([_confirm("r3", "c1"), _confirm("r4", "c1")], prompt="well?")

    await runtime.store.pop_last_message(CID)  # r4

    assert await held_state(runtime.store) == ([("c1", "r3")], "r3")
    await runtime.stream([{"type": "confirm_resolved", "request_id": "r3", "approved": False}])
    assert await runtime.answers_of("c1") == [(DENIED_RESULT, "tool call denied")]
    assert await runtime.store.pending_calls(CID) == []


@CUT_BY
async def test_cutting_a_result_logged_in_the_turn_of_a_second_question_leaves_it_holding_the_call(
    backend: Backend, cut: str
) -> None:
    """STREAMING.md (Two answers racing): a second question about an approved call holds it
    though its own turn then logs the call's result; that result popped, or left out of a
    fork, leaves the question holding the call, as it logged afresh does: pending, and its
    refusal denies the call."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _approved_then_asked_again_by(logger, store, CID)
    result = {"role": "tool", "tool_call_id": "tc-9", "content": "B-42"}
    await logger.log_messages(
        CID, [{"role": "user", "content": "And?"}, _question("q2"), result], turn_id="t1"
    )

    left = await _cut_after_q2(logger, store, cut)

    state = await held_state(store, left), await _refusal_of(logger, left, "q2")
    assert state == await _as_logged_fresh(backend) == (([("tc-9", "q2")], "q2"), True)


async def test_a_question_about_an_earlier_call_holds_it_when_its_turn_reuses_the_id(
    backend: Backend,
) -> None:
    """STREAMING.md (call ids a later turn repeats): a result of an id the turn made
    answers the turn's own call, even when a question of the turn named an earlier turn's
    call of that id before it; only an answer to the call a question holds clears it. So
    the question stays pending, holds the earlier call, and refusing it denies that call."""
    runtime = Runtime(backend)
    await runtime.stream([_start("call_0"), _confirm("r1", "call_0")], prompt="Book A.")
    looked_up = {"type": "tool_end", "tool_name": "book", "tool_call_id": "call_0",
                 "result": "looked up"}  # fmt: skip
    await runtime.stream([_confirm("r2", "call_0"), _start("call_0"), looked_up], prompt="And?")

    assert await held_state(runtime.store) == ([("call_0", "r2")], "r2")
    assert await folded_state(runtime.store) == await held_state(runtime.store)

    await runtime.stream([{"type": "confirm_resolved", "request_id": "r2", "approved": False}])
    denials = [a for a in await runtime.answers_of("call_0") if a[1] is not None]
    assert denials == [(DENIED_RESULT, "tool call denied")]  # the earlier call's, once
    assert await held_state(runtime.store) == ([], None)


async def test_a_prompt_naming_an_earlier_call_stays_pending_when_its_turn_answers_its_own_call(
    backend: Backend,
) -> None:
    """Logged by a runtime itself: the turn's answer of an id it made is to its own call,
    made after the prompt; the earlier call the prompt names stays held by it. The
    reservation and the fold of the messages agree."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}, _calls("c1")], turn_id="t1")

    await logger.log_messages(
        CID,
        [{"role": "user", "content": "sure?"}, _asks_about("r1", "c1"), _calls("c1"),
         {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        turn_id="t2",
    )  # fmt: skip

    assert await held_state(store) == ([("c1", "r1")], "r1")
    assert await folded_state(store) == await held_state(store)


async def test_a_fork_at_a_call_whose_result_its_turn_is_still_writing_waits_for_the_pair(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork waits for the whole turn its point is in: a turn [call, result] whose insert
    stored the call only (its retry to come) is not cut between them, nor is the call copied
    alone to stay pending in the fork (a runtime would run it again); nothing is written, and
    once the turn is stored the same fork copies the pair."""

    from agent_store.store import CONVERSATIONS, MESSAGES

    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "weather?"}], turn_id="t0")
    pair = [_book("c1", "weather"), {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    await _log_cut_short(logger, monkeypatch, pair, "t1")

    with pytest.raises(StorageUnavailable, match="still being written at seq 2"):
        await logger.fork(CID, 1, "conv-fork")
    assert await backend.db[CONVERSATIONS].find_one({"_id": "conv-fork"}) is None
    assert await backend.db[MESSAGES].count_documents({"conversation_id": "conv-fork"}) == 0

    await logger.log_messages(CID, pair, turn_id="t1")  # the runtime's retry
    forked = await logger.fork(CID, 1, "conv-fork")
    assert [m.role for m in forked.messages] == ["user", "assistant", "tool"]
    assert await pending_state(ConversationStore(backend.db), "conv-fork") == ([], None)


async def test_a_fork_counts_the_turns_of_the_original_it_copies_and_its_pops_uncount_them(
    backend: Backend,
) -> None:
    """The copies are one turn, but `turn_count` counts the turns the original counted over
    them: a prompt logged as its own turn, then a steered message (a delivery is a turn of
    its own) counts two, though a user message after another is no start within one turn.
    Popping the copies takes them off again, one for each turn start removed."""
    from agent_store import SteeringInbox

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_message(CID, {"role": "user", "content": "Book me a train."}, turn_id="p1")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, "run-1")
    assert await inbox.try_deliver(CID, "run-1", {"role": "user", "content": "To Lyon."})
    seen = max(m.seq or 0 for m in await inbox.close_inbox(CID, "run-1", -1))
    assert await inbox.close_inbox(CID, "run-1", seen) == []
    await logger.log_messages(CID, [{"role": "assistant", "content": "Booked."}], turn_id="run-1")
    assert (await store.get_conversation(CID)).turn_count == 2

    await logger.fork(CID, 2, "conv-fork")

    fork = await store.get_conversation("conv-fork")
    assert fork.forked_from is not None
    assert fork.forked_from.turn_starts == [1, 2]
    assert fork.turn_count == 2
    counts = []
    while await store.pop_last_message("conv-fork") is not None:
        counts.append((await store.get_conversation("conv-fork")).turn_count)
    assert counts == [2, 1, 0]


def _three_then_one_popped_back_to_two() -> list[tuple[list[dict[str, Any]], str]]:
    first = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "assistant", "content": "c"}]  # fmt: skip
    return [(first, "t1"), ([{"role": "user", "content": "d"}], "t2")]


async def _logged_then_popped_twice(backend: Backend) -> AgentMessageLogger:
    """t1 (seqs 0-2) and t2 (seq 3), then two pops: t2 whole and t1's last message, their
    `seq`s given back (`message_count` 2)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for messages, turn_id in _three_then_one_popped_back_to_two():
        await logger.log_messages(CID, messages, turn_id=turn_id)
    assert await store.pop_last_message(CID) is not None
    assert await store.pop_last_message(CID) is not None
    return logger


async def test_a_fork_after_pops_gave_seqs_back_waits_for_no_turn(backend: Backend) -> None:
    logger = await _logged_then_popped_twice(backend)

    forked = await logger.fork(CID, 1, "conv-fork")

    assert [m.content for m in forked.messages] == ["a", "b"]


async def test_a_fork_waits_for_the_turn_that_took_seqs_a_popped_turn_gave_back(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """t3 reserves the `seq`s the pops gave back (2-3) and stores its call only: the popped
    t2's record (first `seq` 3) does not end t3's block."""

    from agent_store.store import CONVERSATIONS

    logger = await _logged_then_popped_twice(backend)
    await _log_cut_short(logger, monkeypatch, [_calls("c1"), _answer("c1")], "t3")

    with pytest.raises(StorageUnavailable, match="still being written at seq 3"):
        await logger.fork(CID, 2, "conv-fork")
    assert await backend.db[CONVERSATIONS].find_one({"_id": "conv-fork"}) is None


async def _log_cut_short(
    logger: AgentMessageLogger,
    monkeypatch: pytest.MonkeyPatch,
    messages: list[dict[str, Any]],
    turn_id: str,
) -> None:
    """Log a turn whose insert stores its first message only, the connection dropped (its
    retry still to come): `StorageUnavailable`."""
    from pymongo.errors import AutoReconnect

    insert_many = logger._messages.insert_many

    async def first_only(documents: list[dict[str, Any]], **kwargs: Any) -> None:
        await insert_many(documents[:1], **kwargs)
        raise AutoReconnect("connection lost inside insert_many")

    monkeypatch.setattr(logger._messages, "insert_many", first_only)
    with pytest.raises(StorageUnavailable):
        await logger.log_messages(CID, messages, turn_id=turn_id)
    monkeypatch.undo()


# -- rewritten history: the pending state of the kept turns, whatever came after --------


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _say(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


async def _cut_at(logger: AgentMessageLogger, store: ConversationStore, cut: str, seq: int) -> str:
    """The conversation left once every message past `seq` is cut: popped one by one, or
    left out of a fork cut at `seq`."""
    if cut == "fork":
        await logger.fork(CID, seq, "conv-fork")
        return "conv-fork"
    while (await store.transcript(CID))[-1].seq != seq:
        await store.pop_last_message(CID)
    return CID


@CUT_BY
async def test_a_prompt_answered_before_its_request_id_was_asked_again_stays_answered_when_cut(
    backend: Backend, cut: str
) -> None:
    """DESIGN.md §3 Pending HITL: a resolution is remembered per asking. A later question
    reusing the request id (a runtime numbering its confirmations per turn) is a new one;
    a pop of it, or a fork cut before it, leaves what the turns before it left, the prompt
    the person answered staying answered."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Book it."), _book("c"), _asks("r1")], turn_id="t0")
    await store.resolve_hitl(CID, "r1")  # approved: c awaits its result
    await logger.log_messages(CID, [_user("Thanks."), _say("Booking.")], turn_id="t1")
    answered = await held_state(store)
    assert answered == ([("c", None)], None)
    await logger.log_messages(CID, [_user("And this?"), _book("d"), _asks("r1")], turn_id="t2")
    assert await held_state(store) == ([("c", None), ("d", "r1")], "r1")

    cid = await _cut_at(logger, store, cut, 4)

    assert await held_state(store, cid) == answered


@CUT_BY
async def test_an_approval_of_a_call_asked_about_again_goes_with_the_question_it_answered(
    backend: Backend, cut: str
) -> None:
    """STREAMING.md: c1 asked about by r1, then again by r2; the person approves r2, then r2
    is popped (or left out of a fork). A pop removes the question and its answer: the
    approval goes with r2 (`approved_calls`), c1 is held by r1 again, r1 pending, and a
    refusal of r1 denies c1 (it is stored), as before the second question was asked."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    asked = await logger.log_messages(CID, _asks_for("Pay invoice A", "c1", "r1"), turn_id="t1")
    before_r2 = await held_state(store)
    assert before_r2 == ([("c1", "r1")], "r1")
    await logger.log_messages(CID, [_asks_about("r2", "c1")], turn_id="t2")
    await store.resolve_hitl(CID, "r2")
    assert await held_state(store) == ([("c1", None)], None)

    cid = await _cut_at(logger, store, cut, asked.messages[-1].seq)

    assert await held_state(store, cid) == before_r2
    denial = [_user("No."), _denial_of("c1")]
    refused = {"c1": "r1"}
    answers_to = await logger.calls_answered(cid, as_messages(denial))
    await logger.check_turn(
        cid, denial, turn_id="deny", refused_prompts=refused, answers_to=answers_to
    )
    await logger.log_messages(
        cid, denial, turn_id="deny", refused_prompts=refused, answers_to=answers_to
    )
    assert await held_state(store, cid) == ([], None)


@CUT_BY
async def test_a_streamed_confirmation_approved_then_numbered_again_stays_approved_when_cut(
    backend: Backend, cut: str
) -> None:
    """STREAMING.md: a runtime numbering its confirmations per turn asks `confirm-1` about
    tc-1, the person approves it while tc-1 runs, then `confirm-1` asks about tc-2; cutting
    that last turn leaves tc-1 approved and no prompt pending, as after the approval."""
    runtime = Runtime(backend)

    def asks(n: int) -> list[dict[str, Any]]:
        call = f"tc-{n}"
        return [
            {"type": "tool_start", "tool_name": "book", "tool_call_id": call, "args": {"n": n}},
            {"type": "confirm_required", "request_id": "confirm-1", "action": "book",
             "params": {"n": n}, "prompt": f"Book #{n}?", "tool_call_id": call},
        ]  # fmt: skip

    await runtime.stream(asks(1), prompt="Book #1")
    approved = {"type": "confirm_resolved", "request_id": "confirm-1", "approved": True}
    logged = await runtime.stream([approved, {"type": "stream_token", "token": "Ok."}], "Yes")
    after_approval = await held_state(runtime.store)
    assert after_approval == ([("tc-1", None)], None)
    await runtime.stream(asks(2), prompt="Book #2")

    cid = await _cut_at(runtime.logger, runtime.store, cut, int(logged.messages[-1].seq or 0))

    assert await held_state(runtime.store, cid) == after_approval


async def test_a_fork_at_a_turn_boundary_awaits_the_same_whenever_it_is_taken(
    backend: Backend,
) -> None:
    """DESIGN.md §3 Forks: a fork cut at `seq` awaits what the original's turns left pending
    there, whatever the original logged after it: taken before or after a later turn, the
    same fork awaits the same, and the same next turn leaves the same in both."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("a"), _book("c"), _asks("r2")], turn_id="t0")
    await store.resolve_hitl(CID, "r2")  # c (seq 1) approved
    await logger.log_messages(CID, [_user("b"), _book("c")], turn_id="t1")  # the id reused
    await logger.log_messages(CID, [_user("c"), _asks_about("r2", "c")], turn_id="t2")
    at_t2 = await held_state(store)
    await logger.fork(CID, 6, "fork-early")
    await logger.log_messages(CID, [_user("d"), _answer("c")], turn_id="t3")
    await logger.fork(CID, 6, "fork-late")

    assert await held_state(store, "fork-late") == await held_state(store, "fork-early") == at_t2
    for cid in ("fork-late", "fork-early"):
        await logger.log_messages(cid, [_user("d"), _answer("c")], turn_id="t3")
    assert await held_state(store, "fork-late") == await held_state(store, "fork-early")
    assert await held_state(store, "fork-late") == await held_state(store)


async def test_a_fork_copies_no_answer_the_person_gave_after_the_original_went_past_its_point(
    backend: Backend,
) -> None:
    """DESIGN.md §3 Forks: a fork copies the answers given within its copied part, each where
    it came, and none the person gave once the original had logged past the fork's point.
    Taken before or after such an answer, the fork at a `seq` awaits the same: the question,
    its call held; the person answers it in the fork as in a fresh conversation."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [_user("Clean up."), _book("a", "delete_files"), _asks_about("q0", "a")], turn_id="t0"
    )
    await logger.log_messages(CID, [_user("Hello?"), _say("Waiting for you.")], turn_id="t1")
    await logger.fork(CID, 2, "fork-early")
    await store.resolve_hitl(CID, "q0")  # came after t1: a fork cut at t0 never saw it
    await logger.fork(CID, 2, "fork-late")

    asked = ([("a", "q0")], "q0")
    assert await held_state(store, "fork-early") == asked
    assert await held_state(store, "fork-late") == asked
    assert await held_state(store) == ([("a", None)], None)
    for cid in ("fork-early", "fork-late"):  # not answered there: a refusal is stored
        await logger.log_messages(cid, [_user("No."), _denial("a")], turn_id="t-no")
        assert await held_state(store, cid) == ([], None)


async def test_a_whole_fork_and_a_fork_cut_before_the_next_message_copy_an_answer_given_then(
    backend: Backend,
) -> None:
    """DESIGN.md §3 Forks: an answer the person gave before the original logged past the
    fork's point belongs to the fork, taken before or after the original went on: the fork of
    the whole conversation, and the same fork taken once a later turn was logged."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [_user("Clean up."), _book("a", "delete_files"), _asks_about("q0", "a")], turn_id="t0"
    )
    await store.resolve_hitl(CID, "q0")
    await logger.fork(CID, 2, "fork-whole")
    await logger.log_messages(CID, [_user("Thanks."), _say("Deleting.")], turn_id="t1")
    await logger.fork(CID, 2, "fork-after")

    answered = ([("a", None)], None)
    assert await held_state(store, "fork-whole") == answered
    assert await held_state(store, "fork-after") == answered
    with pytest.raises(AnsweredBefore):  # approved in the fork too: the tool runs
        await logger.log_messages("fork-after", [_user("No."), _denial("a")], turn_id="t-no")


@pytest.mark.parametrize("seed", range(8))
async def test_a_fork_at_every_seq_awaits_the_same_whenever_taken_once_the_original_went_on(
    backend: Backend, seed: int
) -> None:
    """DESIGN.md §3 Forks: over small random conversations with answers a person gives
    between turns, the fork at each `seq` taken just before the original stores past it and
    the fork at that `seq` taken at the end await the same, and pop the same; the fork of the
    whole conversation awaits what the original awaits."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    last: list[int] = []
    early: dict[int, str] = {}
    for n, step in enumerate(_small_conversation(random.Random(seed))):
        with contextlib.suppress(AnsweredBefore, Conflict, NotFound):  # refused: nothing stored
            if isinstance(step, str):
                await store.resolve_hitl(CID, step)
                continue
            for seq in last:
                await logger.fork(CID, seq, f"early-{seq}-{n}")
            logged = await logger.log_messages(CID, step, turn_id=f"t{n}")
            early |= {seq: f"early-{seq}-{n}" for seq in last}
            last = [int(m.seq or 0) for m in logged.messages]
    await logger.fork(CID, last[-1], "whole")
    assert await held_state(store, "whole") == await held_state(store)
    for seq, taken in early.items():
        await logger.fork(CID, seq, f"late-{seq}")
        assert await held_state(store, f"late-{seq}") == await held_state(store, taken), seq
        for cid in (taken, f"late-{seq}"):
            await store.pop_last_message(cid)
        assert await held_state(store, f"late-{seq}") == await held_state(store, taken), seq


@pytest.mark.parametrize("second", ["a-question", "an-answer"])
async def test_a_pop_below_the_block_a_moved_turn_left_brings_back_the_prompt_as_a_fork_does(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, second: str
) -> None:
    """DESIGN.md §3 Pops: the block a turn moved away from (retried later than
    `abandon_after`) holds no turn; popping the messages below it brings back the prompt
    they replaced or cleared, as a fork cut at the same point does."""
    logger = _late_logger(backend)
    store = ConversationStore(backend.db, rules=logger.rules)  # passes that block as abandoned
    await logger.log_messages(CID, [_user("Book it."), _book("c"), _asks("r0")], turn_id="t0")
    asked = await held_state(store)
    assert asked == ([("c", "r0")], "r0")
    then = [_user("Hm."), _asks("r1")] if second == "a-question" else [_user("Yes."), _answer("c")]
    await logger.log_messages(CID, then, turn_id="t1")
    await _reserved_only(logger, monkeypatch, [_user("x"), _say("y")], "t2")
    await logger.log_messages(CID, [_user("x"), _say("y")], turn_id="t2")  # moved past it
    assert [m.seq for m in await store.transcript(CID)] == [0, 1, 2, 3, 4, 7, 8]

    for _ in range(4):
        await store.pop_last_message(CID)

    await logger.fork(CID, 2, "conv-fork")
    assert await held_state(store) == await held_state(store, "conv-fork") == asked


# -- a prompt waiting on calls a person released: the fold and the reservation agree ---------

Step = list[dict[str, Any]] | str
"""A turn's messages, or the request id of a prompt a person resolves (`resolve_hitl`)."""


async def _logged(
    logger: AgentMessageLogger,
    store: ConversationStore,
    cid: str,
    steps: list[Step],
    start: int = 0,
) -> Any:
    """`steps` applied in order to `cid`, each turn under an id of its own (numbered from
    `start`); what it holds then."""
    for n, step in enumerate(steps, start):
        if isinstance(step, str):
            await store.resolve_hitl(cid, step)
        else:
            await logger.log_messages(cid, step, turn_id=f"t{n}")
    return await held_state(store, cid)


def _first(steps: list[Step], count: int) -> list[Step]:
    """`steps` up to their first `count` messages, the resolutions among them kept."""
    kept: list[Step] = []
    for step in steps:
        if count <= 0:
            break
        kept.append(step if isinstance(step, str) else step[:count])
        count -= 0 if isinstance(step, str) else len(step)
    return kept


RELEASED_THEN_WAITING: list[Step] = [
    [_user("Book it."), _book("c1"), _asks_about("q1", "c1")],
    "q1",  # approved: c1 runs, awaiting its result
    [_user("And?"), _asks("q2"), _say("Waiting.")],  # finds no unheld call: waits on c1
    [_user("Done?"), _answer("c1", "booked"), _say("Booked.")],  # seqs 6, 7, 8
    [_user("Thanks.")],
]


@pytest.mark.parametrize("at", [7, 8], ids=["at-the-result", "after-it"])
async def test_a_fork_after_the_result_of_a_released_call_leaves_the_prompt_waiting_on_it_cleared(
    backend: Backend, at: int
) -> None:
    """DESIGN.md §3 Pending HITL: a prompt finding no call to hold waits on the held calls, a
    call a person's answer released among them (it awaits its result). Its result clears the
    prompt as the turns are logged; a fork folding the same messages with the same answer
    leaves it cleared too."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _logged(logger, store, CID, RELEASED_THEN_WAITING)
    fresh = await _logged(logger, store, "fresh", _first(RELEASED_THEN_WAITING, at + 1))
    assert fresh == ([], None)

    await logger.fork(CID, at, "conv-fork")

    assert await held_state(store, "conv-fork") == fresh


WAITING_THEN_RELEASED: list[Step] = [
    [_user("Book it."), _book("c0"), _asks_about("q0", "c0")],
    [_user("And?"), _asks("r0")],  # finds no unheld call: waits on c0
    "q0",  # approved: c0 runs, awaiting its result
    [_user("Go."), _answer("c0", "booked"), _book("c2"), _asks_about("q2", "c2")],  # 5…8
]


@CUT_BY
async def test_cutting_a_later_question_leaves_the_prompt_waiting_on_a_released_call_cleared(
    backend: Backend, cut: str
) -> None:
    """r0 waits on c0, held by q0; the person approves q0; a turn logs c0's result, makes c2
    and asks q2 about it. Popping q2, or a fork cut before it, leaves what that turn logged
    without q2 leaves: r0 cleared by c0's result, c2 pending."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _logged(logger, store, CID, WAITING_THEN_RELEASED)
    fresh = await _logged(logger, store, "fresh", _first(WAITING_THEN_RELEASED, 8))
    assert fresh == ([("c2", None)], None)

    cid = await _cut_at(logger, store, cut, 7)

    assert await held_state(store, cid) == fresh


@pytest.mark.parametrize("waiting", ["asked-meanwhile", "asked-before"])
async def test_a_late_retry_answering_a_released_call_clears_the_prompt_waiting_on_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, waiting: str
) -> None:
    """c1's prompt is approved; the turn answering c1 reserves and dies; r2, a prompt finding
    no unheld call, was asked before the approval or is asked meanwhile. The answer, retried
    later than `abandon_after`, moves to the end and clears r2, as the same turns logged in
    their stored order do."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    ask = [_user("Book it."), _book("c1"), _asks_about("q1", "c1")]
    asks_r2 = [_user("And?"), _asks("r2"), _say("Waiting.")]
    answer = [_user("Go."), _answer("c1", "booked"), _say("Booked.")]
    before: list[Step] = [ask, "q1"] if waiting == "asked-meanwhile" else [ask, asks_r2, "q1"]
    meanwhile: list[Step] = [asks_r2] if waiting == "asked-meanwhile" else [[_user("Hm.")]]
    fresh = await _logged(logger, store, "fresh", [*before, *meanwhile, answer])
    assert fresh == ([], None)
    await _logged(logger, store, CID, before)
    await _reserved_only(logger, monkeypatch, answer, "answer")
    await _logged(logger, store, CID, meanwhile, start=len(before))

    await logger.log_messages(CID, answer, turn_id="answer")  # moved to the end

    assert await held_state(store) == fresh


ANSWERED_TWICE: list[Step] = [
    [_user("Go."), _calls("c0", "c1")],
    [_asks_about("q0", "c1")],
    "q0",  # approved: c1 released
    [_user("And c9?"), _calls("c9"), _asks("q0")],  # q0 asked again (numbered per turn)
    "q0",  # approved again: c9 released
    [_asks("q1"), _answer("c1"), _asks_about("q1", "c0")],  # seqs 6, 7, 8
]


@CUT_BY
async def test_each_answer_to_a_request_id_asked_twice_is_folded_where_it_came(
    backend: Backend, cut: str
) -> None:
    """DESIGN.md §3 Pending HITL: a request id asked, answered, asked again and answered
    again is answered twice, and a pop or a fork folds both answers where they came
    (`answered_prompts` keeps one entry per answer, not per request id). Cutting the last
    question leaves what the same messages and answers logged afresh leave: c1, released by
    the first answer, answered after q1, so q1 cleared."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _logged(logger, store, CID, ANSWERED_TWICE)
    fresh = await _logged(logger, store, "fresh", _first(ANSWERED_TWICE, 8))
    assert fresh == ([("c0", "q1"), ("c9", None)], None)

    cid = await _cut_at(logger, store, cut, 7)

    assert await held_state(store, cid) == fresh


APPROVED_THEN_ID_REUSED: list[Step] = [
    [_user("Book it."), _calls("call_0"), _asks_about("q0", "call_0")],
    [_user("Weather?"), _calls("call_0", "call_1")],  # a provider numbering calls per response
    "q0",  # approved: the first call_0 released
    [_asks_about("q1", "call_0")],  # names call_0: holds the latest pending call of the id
    [_asks("q0")],  # q0 asked again (numbered per turn): seq 6
]


@CUT_BY
async def test_a_question_naming_a_reused_call_id_leaves_the_approved_older_call_released(
    backend: Backend, cut: str
) -> None:
    """DESIGN.md §3 Pending calls: a prompt naming a call id holds the latest pending call of
    the id, not an older one of that id a person approved, whose approval stays in force.
    Cutting a later question asked under the approving prompt's request id leaves what the
    same turns logged afresh leave: the approved call released, the newer one held by q1."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _logged(logger, store, CID, APPROVED_THEN_ID_REUSED)
    fresh = await _logged(logger, store, "fresh", _first(APPROVED_THEN_ID_REUSED, 6))
    assert fresh == ([("call_0", None), ("call_0", "q1"), ("call_1", None)], "q1")

    cid = await _cut_at(logger, store, cut, 5)

    assert await held_state(store, cid) == fresh


def _small_conversation(rng: random.Random) -> list[Step]:
    """A small random conversation: calls left open and answered in later turns (a result,
    or a denial), prompts naming a call of their turn, an open call of an earlier turn, or
    none (some before any call of their turn, in a turn of their own), and a person
    resolving an asked prompt between turns; a request id asked before is asked again now
    and then (in a later turn, or in the same one: a runtime numbering its confirmations)."""
    steps: list[Step] = []
    open_calls: list[str] = []
    asked: list[str] = []

    def ask(call_ids: list[str] | None) -> dict[str, Any]:
        again = asked and rng.random() < 0.3
        asked.append(rng.choice(asked) if again else f"q{len(asked)}")
        return _asks_about(asked[-1], *call_ids) if call_ids else _asks(asked[-1])

    for t in range(rng.randint(3, 6)):
        turn = [ask(None)] if open_calls and rng.random() < 0.3 else [_user(f"u{t}")]
        for call_id in [c for c in open_calls if rng.random() < 0.35]:
            open_calls.remove(call_id)
            turn.append(_denial(call_id) if rng.random() < 0.2 else _answer(call_id))
        made = [f"c{t}-{n}" for n in range(rng.randint(0, 2))]
        if made:
            turn.append(_calls(*made))
            open_calls += made
        for _ in range(rng.randint(0, 2)):
            named = rng.choice([[], made or open_calls, open_calls])
            turn.append(ask([rng.choice(named)] if named else None))
        steps.append(turn)
        steps += [rng.choice(asked) for _ in range(rng.randint(0, 2)) if asked]
    return steps


def _denial(call_id: str) -> dict[str, Any]:
    error = {"message": "tool call denied"}
    return {"role": "tool", "tool_call_id": call_id, "content": DENIED_RESULT, "error": error}


async def _take_step(
    logger: AgentMessageLogger, store: ConversationStore, n: int, step: Step
) -> None:
    """A small conversation's step `n`: a person's answer by request id, or a turn; one the
    store refuses stores nothing."""
    with contextlib.suppress(AnsweredBefore, Conflict, NotFound):
        if isinstance(step, str):
            await store.resolve_hitl(CID, step)
        else:
            await logger.log_messages(CID, step, turn_id=f"t-{n}")


async def _as_stored_and_folded(backend: Backend, store: ConversationStore) -> list[Any]:
    """The conversation's pending calls (with the prompt holding each, as stored) and prompt,
    as its document holds them, and as the fold of its stored messages with the answers a
    person gave (`answered_prompts`) leaves them."""
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert doc is not None
    stored = (
        [PendingCall.model_validate(c) for c in doc.get("pending_calls") or ()],
        (doc.get("pending_hitl") or {}).get("request_id"),
    )
    calls, prompt = pending_after(await store.transcript(CID), (), answered_in(doc))
    return [
        ([(c.tool_call_id, c.message_id, c.request_id) for c in held], request_id)
        for held, request_id in (stored, (calls, prompt.request_id if prompt else None))
    ]


async def test_a_late_retry_with_other_content_denying_a_call_held_again_is_logged(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §2 `approved_calls`: a later prompt naming an approved call holds it again,
    and a denial of it is then an answer, not refused. t0 makes c0-0 and c0-1 under q0, which
    the person approves; t1 answers c0-0, makes c1-0 and asks q2 about c0-1 again. t2 [deny
    c0-1, answer c1-0] reserves and dies (its reservation took both calls off the list); its
    late retry with other content, denying c0-1 alone, is judged as the conversation stands
    once t2's block is given back, without what its first reservation changed: logged, as
    the same content as a new turn is (`check_turn` alike), and c1-0 stays pending."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    t0 = [{"role": "user", "content": "u0"}, _calls("c0-0", "c0-1"), _asks("q0")]
    await logger.log_messages(CID, t0, turn_id="t0")
    await store.resolve_hitl(CID, "q0")
    t1 = [{"role": "user", "content": "u1"}, _answer("c0-0"), _calls("c1-0"),
          _asks_about("q0", "c1-0"), _asks_about("q2", "c0-1")]  # fmt: skip
    await logger.log_messages(CID, t1, turn_id="t1")
    assert await held_state(store) == ([("c0-1", "q2"), ("c1-0", "q0")], "q2")
    t2 = [{"role": "user", "content": "u2"}, _denial("c0-1"), _answer("c1-0")]
    await _reserved_only(logger, monkeypatch, t2, "t2")
    retried = [{"role": "user", "content": "regenerated"}, _denial("c0-1")]

    await logger.check_turn(CID, retried, turn_id="t2")
    logged = await logger.log_messages(CID, retried, turn_id="t2")

    assert [m.content for m in logged.messages] == ["regenerated", DENIED_RESULT]
    assert (await pending_state(store))[0] == ["c1-0"]
    stored, folded = await _as_stored_and_folded(backend, store)
    assert folded == stored


async def test_checking_a_retry_with_other_content_weighs_the_approvals_its_give_back_restores(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LIBRARY.md: `check_turn` raises what `log_messages` does. t0 makes c0 and c1 under q0;
    the person approves c0 alone; t1 [ask q1 about c0] reserves (holding c0 again) and dies;
    its late retry with other content denies c0. Its block given back, c0's approval is in
    force again, so the denial is refused (`AnsweredBefore`) by both, nothing stored."""
    from agent_store import AnsweredBefore

    logger, store = _late_logger(backend), ConversationStore(backend.db)
    t0 = [{"role": "user", "content": "u0"}, _calls("c0", "c1"), _asks_about("q0", "c0", "c1")]
    await logger.log_messages(CID, t0, turn_id="t0")
    c0 = [c for c in await store.pending_calls(CID) if c.tool_call_id == "c0"]
    await store.resolve_hitl(CID, "q0", calls=c0)
    asks_again = [{"role": "user", "content": "u1"}, _asks_about("q1", "c0")]
    await _reserved_only(logger, monkeypatch, asks_again, "t1")
    denies = [{"role": "user", "content": "u1 again"}, _denial("c0")]

    with pytest.raises(AnsweredBefore):
        await logger.check_turn(CID, denies, turn_id="t1")
    with pytest.raises(AnsweredBefore):
        await logger.log_messages(CID, denies, turn_id="t1")
    assert [m.content for m in await store.transcript(CID)] == ["u0", None, "Sure?"]


@pytest.mark.parametrize("answer_retried", [False, True], ids=["asked-again", "answer-retried"])
async def test_a_block_given_back_leaves_a_prompt_its_reservation_asked_again_resolved(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, answer_retried: bool
) -> None:
    """DESIGN.md §2 `resolved_hitl`, §3: a block given back leaves the summary the fold of the
    stored messages and answers leaves. t0 makes c0 under q0, which the person resolves; t1
    [ask q0 again] reserves (taking q0 out of `resolved_hitl`) and dies; its late retry with
    other content gives the block back, so q0, asked again by no stored message, is
    resolved again: a retry of the person's answer writes nothing, and once t2 asks q0
    anew the pending state stored is the fold's."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    t0 = [{"role": "user", "content": "book it"}, _calls("c0"), _asks_about("q0", "c0")]
    await logger.log_messages(CID, t0, turn_id="t0")
    await store.resolve_hitl(CID, "q0")
    asks_again = [{"role": "user", "content": "and?"}, {"role": "assistant", "content": "hm"}]
    await _reserved_only(logger, monkeypatch, [*asks_again, _asks("q0")], "t1")
    regenerated = [{"role": "user", "content": "and? (regenerated)"}]
    await logger.log_messages(CID, [*regenerated, {"role": "assistant", "content": "ok"}],
                              turn_id="t1")  # fmt: skip

    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert doc["resolved_hitl"] == ["q0"]
    answers = doc["answered_prompts"]
    if answer_retried:
        await store.resolve_hitl(CID, "q0")  # the person's answer, retried: writes nothing
        doc = await backend.db.agent_conversations.find_one({"_id": CID})
        assert doc["answered_prompts"] == answers
    t2 = [{"role": "user", "content": "now the hotel"}, _calls("c2"), _asks("q0")]
    await logger.log_messages(CID, t2, turn_id="t2")
    stored, folded = await _as_stored_and_folded(backend, store)
    assert folded == stored


async def test_a_turn_given_up_leaves_an_id_another_unstored_turn_asked_again_unresolved(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, with another turn's block reserved and not stored when a turn is given up:
    t3 asks q0 again (its reservation took q0 out of `resolved_hitl`) and dies; t1's late
    retry is refused (t2 answered its call) and given up. Its fold does not resolve q0
    again: t3 may still be moved, and q0 off the list tells its move the question is asked
    anew. Moved, t3's question is pending, as the fold of the stored messages says."""
    from agent_store import Conflict

    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "u0"}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, [{"role": "user", "content": "u1"},
                                               _calls("c1")], "t1")  # fmt: skip
    t2 = [{"role": "user", "content": "u2"}, _answer("c1"), _calls("c2"), _asks_about("q0", "c2")]
    await logger.log_messages(CID, t2, turn_id="t2")
    await store.resolve_hitl(CID, "q0")
    t3 = [{"role": "user", "content": "u3"}, _asks("q0")]
    await _reserved_only(logger, monkeypatch, t3, "t3")
    with pytest.raises(Conflict, match="a later turn answered its call 'c1'"):
        await logger.log_messages(CID, [{"role": "user", "content": "u1"}, _calls("c1")],
                                  turn_id="t1")  # fmt: skip

    await logger.log_messages(CID, t3, turn_id="t3")

    stored, folded = await _as_stored_and_folded(backend, store)
    assert folded == stored
    assert stored[1] == "q0"


async def test_a_block_given_back_leaves_an_approval_its_prompt_held_again_in_force(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §2 `approved_calls`: a later prompt naming an approved call holds it again,
    until that prompt is gone (a pop of it puts the approval back in force); a prompt of a
    block given back was never stored. t0 makes c0 and c1 under q0; the person approves c0
    alone; t1 [ask q1 about c0] reserves (holding c0 again) and dies; its late retry with
    other content gives the block back: c0 is served released again, and a denial of it is
    refused (`AnsweredBefore`), as before t1."""
    from agent_store import AnsweredBefore

    logger, store = _late_logger(backend), ConversationStore(backend.db)
    t0 = [{"role": "user", "content": "u0"}, _calls("c0", "c1"), _asks_about("q0", "c0", "c1")]
    await logger.log_messages(CID, t0, turn_id="t0")
    c0 = [c for c in await store.pending_calls(CID) if c.tool_call_id == "c0"]
    await store.resolve_hitl(CID, "q0", calls=c0)
    assert await held_state(store) == ([("c0", None), ("c1", "q0")], None)
    asks_again = [{"role": "user", "content": "u1"}, _asks_about("q1", "c0")]
    await _reserved_only(logger, monkeypatch, asks_again, "t1")
    assert await held_state(store) == ([("c0", "q1"), ("c1", "q0")], "q1")

    await logger.log_messages(CID, [{"role": "user", "content": "u1 again"}], turn_id="t1")

    assert await held_state(store) == ([("c0", None), ("c1", "q0")], None)
    denies = [{"role": "user", "content": "u2"}, _denial("c0")]
    with pytest.raises(AnsweredBefore):
        await logger.check_turn(CID, denies, turn_id="t2")
    with pytest.raises(AnsweredBefore):
        await logger.log_messages(CID, denies, turn_id="t2")


@pytest.mark.parametrize("seed", range(12))
async def test_the_fold_of_the_stored_messages_is_what_their_turns_and_answers_left_stored(
    backend: Backend, seed: int
) -> None:
    """DESIGN.md §3 Pending calls: the reservation, and the fold of the stored messages a pop,
    a fork or a move applies, follow one rule. Over small random conversations with answers
    a person gives between turns, after every turn and every answer, the fold of what is
    stored lists what the reservations left: each call with the prompt holding it, a call an
    answer released included, and the same prompt pending."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for n, step in enumerate(_small_conversation(random.Random(seed))):
        await _take_step(logger, store, n, step)
        stored, folded = await _as_stored_and_folded(backend, store)
        assert folded == stored, f"after step {n}"


@pytest.mark.parametrize("seed", [14, 37, 48, 83, 85, 92, 95, 113])  # each names some only
async def test_the_fold_follows_answers_naming_some_of_the_calls_their_prompts_hold(
    backend: Backend, seed: int
) -> None:
    """DESIGN.md §3 Pending calls: as above, with the person's answers naming some of the
    calls the prompts of their request id hold (`calls`, as `pending_calls` serves them),
    others none: the fold of what is stored lists what the reservations and answers left."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    rng = random.Random(seed)
    for n, step in enumerate(_small_conversation(random.Random(seed))):
        with contextlib.suppress(AnsweredBefore, Conflict, NotFound):  # refused: nothing stored
            if isinstance(step, str):
                held = [c for c in await store.pending_calls(CID) if c.request_id == step]
                named = rng.sample(held, rng.randint(1, len(held))) if held else None
                await store.resolve_hitl(CID, step, calls=named if rng.random() < 0.7 else None)
            else:
                await logger.log_messages(CID, step, turn_id=f"t-{n}")
        stored, folded = await _as_stored_and_folded(backend, store)
        assert folded == stored, f"after step {n}"


# -- a pop leaves what the fold of what remains leaves -----------------------------------

ASKED_AGAIN_UNDER_ITS_ID = [
    [_start("c1"), _confirm("q1", "c1")],
    [{"type": "stream_token", "token": "Hm. "}, _confirm("q2", "c1"), _confirm("q1", "c1")],
]
APPROVES_Q1 = {"type": "confirm_resolved", "request_id": "q1", "approved": True}


async def _asked_again_and_approved(
    runtime: Runtime, answered: str, *, asks_q1_again: bool
) -> None:
    """c1 asked about by q1; the next turn asks q2 about it, then (`asks_q1_again`) q1 again;
    a person approves q1 in that stream, or by request id after it (refused when q1 was not
    asked again: it is not pending and holds nothing, and the refusal leaves the same)."""
    first, second = ASKED_AGAIN_UNDER_ITS_ID
    await runtime.stream(first, prompt="Book it.")
    second = second if asks_q1_again else second[:-1]
    if answered == "in-the-stream":
        await runtime.stream([*second, APPROVES_Q1])
    else:
        await runtime.stream(second)
        with contextlib.suppress(Conflict):
            await runtime.store.resolve_hitl(runtime.cid, "q1")


@pytest.mark.parametrize("answered", ["in-the-stream", "by-request-id"])
async def test_popping_a_question_asked_again_and_approved_leaves_what_the_rest_logged_afresh_does(
    backend: Backend, answered: str
) -> None:
    """DESIGN.md §3 Pending HITL: c1 asked about by q1; the next turn asks q2 about it, then
    q1 again, which a person approves; the runtime pops that last question. What remains
    leaves what the same messages and answer logged afresh leave, and a fork of the whole
    conversation the same: q1's approval released nothing (q2 held c1 when it came), so c1
    waits for q2, and a refusal of q2 denies it."""
    runtime, fresh = Runtime(backend), Runtime(backend, "conv-fresh")
    await _asked_again_and_approved(runtime, answered, asks_q1_again=True)
    await _asked_again_and_approved(fresh, answered, asks_q1_again=False)

    popped = await runtime.store.pop_last_message(CID)

    assert popped is not None
    assert popped.hitl_action is not None
    last = (await runtime.store.transcript(CID))[-1].seq
    assert last is not None
    await runtime.logger.fork(CID, last, "conv-fork")
    for cid in (CID, "conv-fresh", "conv-fork"):
        assert await held_state(runtime.store, cid) == ([("c1", "q2")], "q2"), cid
        refusing = Runtime(backend, cid)
        refusing.turns = 2  # its turn is the third
        await refusing.stream([{"type": "confirm_resolved", "request_id": "q2", "approved": False}])
        assert await refusing.answers_of("c1") == [(DENIED_RESULT, "tool call denied")], cid
        assert await held_state(runtime.store, cid) == ([], None), cid


async def _waits_then_asked_about_c2_c3(
    logger: AgentMessageLogger, store: ConversationStore, cid: str, *, asks: bool
) -> None:
    """r2 answered; asked again about c1, whose result comes; asked again with nothing left to
    hold, so it waits, pending; then c2 and c3 are called and (`asks`) r2 asked about both."""
    await logger.log_messages(cid, [_calls("c1"), _asks("r2")], turn_id="t1")
    await store.resolve_hitl(cid, "r2")
    await logger.log_messages(cid, [_user("go"), _calls("c1"), _asks("r2")], turn_id="t2")
    await logger.log_messages(cid, [_answer("c1"), _asks("r2")], turn_id="t3")
    t4 = [_user("go"), _calls("c2"), _calls("c3"), *([_asks("r2")] if asks else [])]
    await logger.log_messages(cid, t4, turn_id="t4")


async def test_popping_a_question_answered_in_part_leaves_what_the_rest_logged_afresh_does(
    backend: Backend,
) -> None:
    """DESIGN.md §3 Pending calls: r2 waits, holding no call; asked again about c2 and c3, it
    gets an answer naming c2 (c3 stays held); the runtime pops that question. What remains
    leaves what the same messages and answer leave logged afresh (there the answer meets
    the waiting r2, the pending one, asked before c2 was made and holding none: it answers
    it, `resolve_hitl`), and a fork of the popped conversation the same."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for cid, asks in ((CID, True), ("conv-fresh", False)):
        await _waits_then_asked_about_c2_c3(logger, store, cid, asks=asks)
        c2 = [c for c in await store.pending_calls(cid) if c.tool_call_id == "c2"]
        await store.resolve_hitl(cid, "r2", calls=c2)

    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.hitl_action is not None
    assert popped.seq is not None
    await logger.fork(CID, popped.seq - 1, "conv-fork")
    states = {cid: await held_state(store, cid) for cid in (CID, "conv-fresh", "conv-fork")}
    assert states == dict.fromkeys(states, states["conv-fresh"])
    stored, folded = await _as_stored_and_folded(backend, store)
    assert folded == stored


async def _state_by_seq(store: ConversationStore, cid: str, backend: Backend) -> Any:
    """What `cid` awaits as served: each pending call by id, the `seq` of its message and the
    prompt holding it (None once a person's answer released it), and the pending prompt;
    then, as stored for the turns to come, each call's holder and the resolved request ids."""
    seqs = {m.id: m.seq for m in await store.transcript(cid)}
    calls = [
        (c.tool_call_id, seqs.get(c.message_id), c.request_id)
        for c in await store.pending_calls(cid)
    ]
    prompt = await store.pending_hitl(cid)
    doc = await backend.db.agent_conversations.find_one({"_id": cid})
    assert doc is not None
    holders = [
        (c["tool_call_id"], seqs.get(c["message_id"]), c.get("request_id"))
        for c in doc.get("pending_calls") or ()
    ]
    resolved = sorted(doc.get("resolved_hitl") or ())
    return calls, prompt.request_id if prompt else None, holders, resolved


@pytest.mark.parametrize("seed", [11, 15, 16, 17, 25, 30, 35, 62, 68, 91, 94, 145])
async def test_each_pop_leaves_what_a_fork_of_all_that_remains_leaves(
    backend: Backend, seed: int
) -> None:
    """DESIGN.md §3: a pop leaves what the same stored messages and answers leave when logged
    afresh, and a fork of the whole conversation is the same whenever taken. Over small
    random conversations with answers a person gives between turns, after each of the last
    four messages is popped, the conversation awaits what a fork of all that remains awaits
    (the fold of those messages with those answers): the same calls, each held by the same
    prompt or released, and the same prompt pending; stored for the turns to come, the same
    holders and the same request ids resolved."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for n, step in enumerate(_small_conversation(random.Random(seed))):
        await _take_step(logger, store, n, step)
    for n in range(4):
        if len(await store.transcript(CID)) < 2:
            break
        await store.pop_last_message(CID)
        last = (await store.transcript(CID))[-1].seq
        assert last is not None
        await logger.fork(CID, last, f"conv-fork-{n}")
        popped, forked = (
            await _state_by_seq(store, CID, backend),
            await _state_by_seq(store, f"conv-fork-{n}", backend),
        )
        assert popped == forked, f"after pop {n}"


async def _logged_and_folded(
    backend: Backend, store: ConversationStore, logger: AgentMessageLogger, step: int = 0
) -> list[Any]:
    """What the conversation awaits (`_state_by_seq`), then what it awaits once a question
    it did not ask before is asked and popped (a pop: the fold of what remains), then what a
    fork of all of it awaits (fork `step`): the same messages and answers, the same three
    times."""
    before = await _state_by_seq(store, CID, backend)
    await logger.log_messages(CID, [_asks("unrelated")], turn_id=f"unrelated-{step}")
    await store.pop_last_message(CID)
    popped = await _state_by_seq(store, CID, backend)
    last = (await store.transcript(CID))[-1].seq
    assert last is not None
    await logger.fork(CID, last, f"{CID}-fork-{step}")
    return [before, popped, await _state_by_seq(store, f"{CID}-fork-{step}", backend)]


@pytest.mark.parametrize("holding", [True, False], ids=["holding-a-call", "holding-none"])
async def test_a_question_asked_again_at_seq_0_after_a_pop_took_back_its_answered_one_is_new(
    backend: Backend, holding: bool
) -> None:
    """DESIGN.md §3 (`answered_prompts`): a pop giving back `seq`s brings an answer's reach
    down to them, and a prompt stored there later is a new one; the fold gives each answer
    at its reach, before the message at that `seq`, the first one too. r2 (holding a call
    c1, or none) is approved, then both messages are popped, the conversation empty; the
    runtime asks r2 anew from `seq` 0 (about a new c1). The conversation, after a question
    asked and popped, and a fork of it all await what the same turn logged afresh awaits:
    r2 pending, holding the new c1, whose denial is stored."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    asks = [_calls("c1"), _asks_about("r2", "c1")] if holding else [_say("Go?"), _asks("r2")]
    await logger.log_messages(CID, asks, turn_id="t1")
    await store.resolve_hitl(CID, "r2")
    await store.pop_last_message(CID)
    await store.pop_last_message(CID)
    await logger.log_messages(CID, asks, turn_id="t2")
    await logger.log_messages("conv-fresh", asks, turn_id="t2")

    fresh = await _state_by_seq(store, "conv-fresh", backend)
    assert fresh[:2] == (([("c1", 0, "r2")], "r2") if holding else ([], "r2"))
    assert await _logged_and_folded(backend, store, logger) == [fresh] * 3
    for cid in (CID, f"{CID}-fork-0") if holding else ():
        await logger.log_messages(cid, [_denial("c1")], turn_id="no", refused_prompts={"c1": "r2"})
        assert await held_state(store, cid) == ([], None), cid


async def test_a_call_approved_each_time_its_request_id_asked_stays_approved_when_asked_again(
    backend: Backend,
) -> None:
    """DESIGN.md §3 (`approved_calls`): a turn denying an approved call is refused, however
    many prompts are resolved after it, whatever becomes of its prompt's request id; a pop
    or a fork leaves what the same stored messages and answers leave. t1 makes c2; t2 asks
    r1 about it, approved; t3 asks r1 about it again, approved again; t4 asks r1 naming no
    call. Each answer released c2 when it came: it stays approved (served unheld, a denial
    refused) in the conversation, after a question asked and popped, and in a fork of it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Book it."), _calls("c2")], turn_id="t1")
    for turn in ("t2", "t3"):
        await logger.log_messages(CID, [_asks_about("r1", "c2")], turn_id=turn)
        await store.resolve_hitl(CID, "r1")
    await logger.log_messages(CID, [_asks("r1")], turn_id="t4")

    states = await _logged_and_folded(backend, store, logger)

    assert states[0][:2] == ([("c2", 1, None)], "r1")
    assert states == [states[0]] * 3
    for cid in (CID, f"{CID}-fork-0"):
        with pytest.raises(AnsweredBefore, match="'c2'"):
            await logger.log_messages(
                cid, [_denial("c2")], turn_id="no", refused_prompts={"c2": "r1"}
            )


def _with_pops(rng: random.Random, steps: list[Step]) -> list[Step | int]:
    """A small conversation's steps (`_small_conversation`) with pops among them: now and
    then, the last one to three messages taken back (`int`: how many)."""
    popping: list[Step | int] = []
    for step in steps:
        popping.append(step)
        if rng.random() < 0.25:
            popping.append(rng.randint(1, 3))
    return popping


@pytest.mark.parametrize("seed", [63, 81, 85, 150, 223, 227])  # each pops an answer down to seq 0
async def test_what_a_conversation_awaits_is_what_a_fork_of_it_and_a_popped_question_leave(
    backend: Backend, seed: int
) -> None:
    """DESIGN.md §3: a pop, a fork or a move leaves what the same stored messages and answers
    leave when logged afresh. Over small random conversations with answers between turns and
    pops taking messages back (down to none), after every step the conversation awaits what
    it awaits once a question is asked and popped, and what a fork of all of it awaits."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    rng = random.Random(seed)
    for n, step in enumerate(_with_pops(rng, _small_conversation(rng))):
        if isinstance(step, int):
            for _ in range(step):
                with contextlib.suppress(NotFound):
                    await store.pop_last_message(CID)
        else:
            await _take_step(logger, store, n, step)
        if not await _stored_messages(store):
            continue
        states = await _logged_and_folded(backend, store, logger, n)
        assert states == [states[0]] * 3, f"after step {n}: {step}"


async def _stored_messages(store: ConversationStore) -> int:
    with contextlib.suppress(NotFound):
        return len(await store.transcript(CID))
    return 0


# -- a fork answers every reader as its original did at that point ------------------------


def _answered_again_conversation(rng: random.Random) -> list[Step]:
    """A small random conversation whose calls are answered in later turns, by a result or
    by a stand-in a real result replaces later, whose answered calls get a result again in a
    later turn (between two user messages now and then: two turn starts), some calls reusing
    an id made before, assistant replies reporting token usage, prompts, and a person
    answering them between turns."""
    from agent_store.core import stand_in_result

    steps: list[Step] = []
    open_calls: list[str] = []
    answered: list[str] = []
    asked: list[str] = []
    for t in range(rng.randint(3, 6)):
        turn: list[dict[str, Any]] = [_user(f"u{t}")]
        late = [c for c in open_calls if rng.random() < 0.5]
        for call_id in late:
            open_calls.remove(call_id)
            stand_in = stand_in_result(call_id, datetime.now(UTC)).model_dump(by_alias=True)
            turn.append(stand_in if rng.random() < 0.3 else _answer(call_id, f"late {t}"))
        again = [c for c in answered if c not in late and rng.random() < 0.3]
        for call_id in dict.fromkeys(again):
            turn += [_answer(call_id, f"again {t}"), *([_user(f"then {t}")] * rng.randint(0, 1))]
        answered += late
        done = [c for c in answered if c not in open_calls and c not in late and c not in again]
        made = [rng.choice(done) if done and rng.random() < 0.2 else f"c{t}-{n}"
                for n in range(rng.randint(0, 2))]  # fmt: skip
        if made := list(dict.fromkeys(made)):
            turn.append(_calls(*made))
            open_calls += [c for c in made if c not in open_calls]
        if made and rng.random() < 0.3:
            asked.append(f"q{t}")
            turn.append(_asks_about(asked[-1], made[0]))
        usage = {"input_tokens": t + 1, "output_tokens": 2}
        turn.append({**_say(f"a{t}"), "token_usage": usage})
        steps.append(turn)
        steps += [rng.choice(asked) for _ in range(rng.randint(0, 1)) if asked]
    return steps


async def _as_read(store: ConversationStore, cid: str) -> dict[str, Any]:
    """What every reader answers for `cid`, messages named by `seq` (a fork's have ids of
    their own): the transcript, its exports and replays, what it awaits, and its summary."""
    transcript = await store.transcript(cid)
    seqs = {m.id: m.seq for m in transcript}
    conversation = await store.get_conversation(cid)
    prompt = await store.pending_hitl(cid)
    own = {"id", "seq", "conversation_id", "turn_id", "search_text"}
    return {
        "transcript": [m.model_dump(exclude=own) for m in transcript],
        "chat_completions": chat_completions(transcript),
        "responses_items": responses_items(transcript),
        "pydantic_ai": [repr(m) for m in history_from_messages(transcript)],
        "pending_calls": [
            {**c.model_dump(), "message_id": seqs.get(c.message_id)}
            for c in await store.pending_calls(cid)
        ],
        "pending_hitl": prompt and {**prompt.model_dump(), "message_id": seqs[prompt.message_id]},
        "turn_count": (await store.turn_count(cid), conversation.turn_count),
        "summary": conversation.model_dump(
            include={"usage", "last_message_preview", "message_count", "name", "user_id"}
        ),
    }


@pytest.mark.parametrize("seed", [1, 3, 4, 7, 9, 11, 12, 14])  # each answers a call again
async def test_every_reader_answers_for_a_fork_what_it_answered_for_the_original_at_that_point(
    backend: Backend, seed: int
) -> None:
    """DESIGN.md §3 Forks: a fork copies the messages up to `at_seq`, `seq` 0…n in the same
    order, and is the same whenever taken. Over small random conversations with late
    results, stand-ins a real result replaces, results sent again in later turns, call ids
    reused and answers between turns, a fork of all there is, taken at once and again once
    the original went on, answers every reader (transcript, exports and replays, pending
    calls and prompt, turn count, usage, preview) as the original answered then."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    then: dict[int, dict[str, Any]] = {}
    for n, step in enumerate(_answered_again_conversation(random.Random(seed))):
        with contextlib.suppress(InvalidInput):
            await _take_step(logger, store, n, step)
        last = (await store.transcript(CID))[-1].seq
        assert last is not None
        then[last] = await _as_read(store, CID)
        await logger.fork(CID, last, f"{CID}-now-{n}")
        assert await _as_read(store, f"{CID}-now-{n}") == then[last], f"after step {n}"
    stored = await store.transcript(CID)
    assert len([m for m in stored if m.role == "tool"]) > len(answers_to_calls(stored))
    for last, read in then.items():
        await logger.fork(CID, last, f"{CID}-later-{last}")
        assert await _as_read(store, f"{CID}-later-{last}") == read, f"at seq {last}"


async def test_answering_the_newer_of_two_questions_leaves_none_pending_the_older_still_listed(
    backend: Backend,
) -> None:
    """STREAMING.md (Several questions open at once): `pending_hitl` is the latest question
    asked and not answered. Answering the newer of two questions (one per paused call)
    leaves none pending, the older one still holding its call in `pending_calls`, where a
    client finds it, and still answerable; a pop of the newer question brings it back."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    asks = [_user("Book a train and a hotel."), _calls("tc-1", "tc-2"),
            _asks_about("q-train", "tc-1"), _asks_about("q-hotel", "tc-2")]  # fmt: skip
    await logger.log_messages(CID, asks, turn_id="t1")
    await logger.log_messages("conv-popped", asks, turn_id="t1")

    await store.resolve_hitl(CID, "q-hotel")
    await store.pop_last_message("conv-popped")

    assert await held_state(store) == ([("tc-1", "q-train"), ("tc-2", None)], None)
    assert await held_state(store, "conv-popped") == (
        [("tc-1", "q-train"), ("tc-2", None)],
        "q-train",
    )
    await store.resolve_hitl(CID, "q-train")
    assert await held_state(store) == ([("tc-1", None), ("tc-2", None)], None)


async def test_a_turn_whose_prompt_would_hold_calls_off_the_bounded_pending_list_is_refused(
    backend: Backend,
) -> None:
    """DESIGN.md §3: an approval releases the calls its prompt holds, as `pending_calls` lists
    them (the newest `PENDING_CALLS_KEPT`). A turn leaving more calls pending than the list
    keeps, a prompt holding one of those it drops, would have that call held where no
    approval reaches it (a later denial of it stored though the person approved it): the
    turn is refused, naming the prompt and the call, nothing written."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    ids = [f"c{n:03d}" for n in range(PENDING_CALLS_KEPT + 1)]

    for prompt in (_asks("r1"), _asks_about("r1", "c000")):
        with pytest.raises(InvalidInput, match=r"newest 100.*prompt 'r1' holds 'c000'"):
            await logger.log_messages(CID, [_user("Book all."), _calls(*ids), prompt])
        with pytest.raises(NotFound):
            await store.transcript(CID)

    held = [_user("Book all."), _calls(*ids), _asks_about("r1", *ids[1:])]
    await logger.log_messages(CID, held, turn_id="t1")  # the call it drops is held by none
    await store.resolve_hitl(CID, "r1")
    with pytest.raises(AnsweredBefore):
        await logger.log_messages(CID, [_denial("c001")], turn_id="t2")


async def test_an_answer_naming_a_call_its_prompt_does_not_hold_says_what_it_holds(
    backend: Backend,
) -> None:
    """An answer naming a call the prompt never held is refused saying what the prompt holds,
    not that it was asked again since the answer was read (it was asked once)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Go."), _calls("c1", "c2"), _asks_about("r1", "c2")])

    with pytest.raises(Conflict) as refused:
        await store.resolve_hitl(CID, "r1", call_ids=["c1"])

    assert "asked again" not in str(refused.value)
    assert "it holds 'c2'" in str(refused.value)


@pytest.mark.parametrize(
    ("named", "said"),
    [
        ({"answers_to": {"zzz": "MSG"}}, "invalid answers_to.*'zzz'"),
        ({"answers_to": {"c1": "MSG", "c2": "MSG"}}, "invalid answers_to.*'c2'"),
        ({"refused_prompts": {"c2": "r1"}}, "invalid refused_prompts.*'c2'"),
        ({"refused_prompts": {"c1": "r1"}}, "invalid refused_prompts.*'c1'"),
    ],
    ids=["a-call-never-made", "a-call-the-turn-leaves-open", "denying-none", "a-result-no-denial"],
)
async def test_an_answers_to_entry_naming_a_call_the_turn_does_not_answer_is_invalid(
    backend: Backend, named: dict[str, dict[str, str]], said: str
) -> None:
    """API.md: `answers_to` names, for each call of an earlier turn the turn answers, the
    message that made it; `refused_prompts`, for each it denies, the prompt the denial
    answers. An entry naming a call no message of the turn answers (denies) is InvalidInput
    naming it, checked before anything is read, nothing written."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Go."), _calls("c1", "c2"), _asks("r1")], turn_id="t1")
    made_by = (await store.pending_calls(CID))[0].message_id
    given = {k: {c: made_by if m == "MSG" else m for c, m in v.items()} for k, v in named.items()}
    before = await store.transcript(CID)

    with pytest.raises(InvalidInput, match=said):
        await logger.log_messages(CID, [_answer("c1", "done")], turn_id="t2", **given)  # type: ignore[arg-type]

    assert await store.transcript(CID) == before


async def test_a_posted_answers_to_entry_naming_a_call_the_turn_does_not_answer_is_422(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Go."), _calls("c1")], turn_id="t1")
    made_by = (await store.pending_calls(CID))[0].message_id
    async with serve(backend.db, seeded=False) as api:
        posted = await api.http.post(
            f"/v1/conversations/{CID}/turns",
            json={"turn_id": "t2", "messages": [_answer("c1", "done")],
                  "answers_to": {"c1": made_by, "zzz": made_by}},
            headers=auth_headers(),
        )  # fmt: skip

    assert posted.status_code == 422
    assert posted.json()["error"]["code"] == "invalid_input"
    assert "'zzz'" in posted.json()["error"]["message"]
    assert [m.tool_call_id for m in await store.transcript(CID) if m.role == "tool"] == []


async def test_a_late_result_of_a_call_a_cut_off_stream_marked_interrupted_is_refused_saying_so(
    backend: Backend,
) -> None:
    """STREAMING.md: a cut-off stream answers a call without a result by a stand-in marked
    interrupted; a result of it in a later stream answers no pending call and is refused,
    saying the call is no longer pending (answered) and how to log the late result, not
    that no call made it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    look = {"type": "tool_start", "tool_name": "look", "tool_call_id": "tc-2", "args": {}}
    cut = turn_from_metadata([look], complete=False, pending=[])
    await log_streamed_turn(logger=logger, store=store, conversation_id=CID, turn=cut, turn_id="t1")
    late = {"type": "tool_end", "tool_name": "look", "tool_call_id": "tc-2", "result": "late"}

    with pytest.raises(InvalidInput) as refused:
        turn_from_metadata([late], complete=True, pending=await store.pending_calls(CID))

    said = str(refused.value)
    assert "which no call made" not in said
    assert "'tc-2'" in said
    assert "no longer pending" in said
    assert "interrupted" in said
    assert "log_messages" in said


async def test_a_turn_pushing_a_held_call_off_the_bounded_pending_list_is_refused(
    backend: Backend,
) -> None:
    """The same across turns: c0, held by r1 nobody answered, is the oldest of the
    `PENDING_CALLS_KEPT` calls listed; a turn making one more call would push it off the
    list, where r1's approval would not reach it: a Conflict naming them, nothing written
    (`check_turn` raises it too). Once r1 is answered the turn is logged, and the approval
    holds (a denial of c0 is refused)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    others = [f"c{n}" for n in range(1, PENDING_CALLS_KEPT)]
    await logger.log_messages(CID, [_user("Go."), _calls("c0"), _asks_about("r1", "c0")])
    await logger.log_messages(CID, [_calls(*others)], turn_id="t1")
    before = await store.transcript(CID)

    with pytest.raises(Conflict, match=r"pushing off the call 'c0' the prompt 'r1' holds"):
        await logger.check_turn(CID, [_calls("c100")], turn_id="t2")
    with pytest.raises(Conflict, match=r"pushing off the call 'c0' the prompt 'r1' holds"):
        await logger.log_messages(CID, [_calls("c100")], turn_id="t2")
    assert await store.transcript(CID) == before

    await store.resolve_hitl(CID, "r1")
    await logger.log_messages(CID, [_calls("c100")], turn_id="t2")
    assert "c0" not in [c.tool_call_id for c in await store.pending_calls(CID)]
    with pytest.raises(AnsweredBefore):
        await logger.log_messages(CID, [_denial("c0")], turn_id="t3", refused_prompts={"c0": "r1"})


# -- check_turn refuses exactly what log_messages refuses -------------------------------

PAST_TWO = TurnRules(turns_recorded=2)
"""Rules keeping the records of the last two turns only: a retry after three is past them."""
AT = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
ASKS_TO_PAY = [
    {"role": "user", "content": "Pay the invoice.", "created_at": AT},
    {"role": "assistant", "content": "Shall I pay?", "created_at": AT,
     "tool_calls": [{"id": "c0", "function": {"name": "pay", "arguments": {"amount": 10}}}],
     "hitl_action": {"action": "confirm_payment", "params": {}, "request_id": "r0"}},
]  # fmt: skip
PAID = [
    {"role": "tool", "tool_call_id": "c0", "content": '{"paid": true}', "created_at": AT},
    {"role": "assistant", "content": "Paid.", "created_at": AT},
]


async def _later_turns(logger: AgentMessageLogger, cid: str, count: int) -> None:
    for n in range(count):
        later = [{"role": "user", "content": f"later {n}"}, {"role": "assistant", "content": "ok"}]
        await logger.log_messages(cid, later, turn_id=f"later-{n}", user_id="u1")


async def _situation(
    name: str, logger: AgentMessageLogger, store: ConversationStore, backend: Backend
) -> tuple[list[dict[str, Any]], str]:
    """The conversation `name` describes, asking about c0 (r0) first: the messages a turn `T`
    answering c0 sends then, and the user logging it."""
    asked = await logger.log_messages(CID, ASKS_TO_PAY, turn_id="ask", user_id="u1")
    made_by = {"c0": asked.messages[1].id}
    if name != "new turn" and name != "a call another turn answered":
        await logger.log_messages(CID, PAID, turn_id="T", user_id="u1", answers_to=made_by)
    if name == "retry past turns_recorded":
        await _later_turns(logger, CID, PAST_TWO.turns_recorded + 1)
    elif name == "retry after a pop shortened the turn":
        await store.pop_last_message(CID)
    elif name == "a call another turn answered":
        other = [{**PAID[0], "content": '{"paid": "by tab b"}'}]
        await logger.log_messages(CID, other, turn_id="tab-b", user_id="u1", answers_to=made_by)
    elif name == "a conversation being deleted":
        await backend.db.agent_conversations.update_one({"_id": CID}, {"$set": {DELETING: AT}})
    elif name == "a conversation deleted":
        await store.delete(CID)
    if name == "retry with other content":
        return [PAID[0], {**PAID[1], "content": "Paid twice."}], "u1"
    return PAID, "u2" if name == "another user's conversation" else "u1"


async def _outcome(call: Any) -> type[Exception] | None:
    try:
        await call
    except Exception as refused:  # the class is what is compared
        return type(refused)
    return None


@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("new turn", None),
        ("immediate retry", None),
        ("retry past turns_recorded", None),
        ("retry after a pop shortened the turn", Corrected),
        ("retry with other content", OtherContent),
        ("a call another turn answered", AnsweredBefore),
        ("a conversation being deleted", BeingDeleted),
        ("a conversation deleted", Conflict),
        ("another user's conversation", Conflict),
    ],
)
async def test_check_turn_raises_exactly_what_log_messages_raises(
    backend: Backend, name: str, refused: type[Exception] | None
) -> None:
    """LIBRARY.md: `check_turn` raises what `log_messages` refuses the same turn with, as
    the conversation stands, and writes nothing: the same class, or both pass."""
    logger = AgentMessageLogger(backend.db, rules=PAST_TWO)
    store = ConversationStore(backend.db, rules=PAST_TWO)
    messages, user_id = await _situation(name, logger, store, backend)
    raw = await backend.db.agent_conversations.find_one({"_id": CID})
    made_by = {"c0": message_id(CID, "ask", 1)}
    turn: dict[str, Any] = {"turn_id": "T", "user_id": user_id, "answers_to": made_by}

    checked = await _outcome(logger.check_turn(CID, messages, **turn))
    assert await backend.db.agent_conversations.find_one({"_id": CID}) == raw  # read only
    logged = await _outcome(logger.log_messages(CID, messages, **turn))

    assert (checked, logged) == (refused, refused)


async def test_check_turn_refuses_a_denial_of_a_call_a_person_approved_as_log_messages_does(
    backend: Backend,
) -> None:
    """A turn denying c0, which a person approved first (r0): `check_turn` raises what
    `log_messages` refuses it with (the conditions a new turn's reservation must meet,
    checked by the same filter, read only), and neither writes anything."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db)
    await logger.log_messages(CID, ASKS_TO_PAY, turn_id="ask", user_id="u1")
    await store.resolve_hitl(CID, "r0", user_id="u1")
    raw = await backend.db.agent_conversations.find_one({"_id": CID})
    turn: dict[str, Any] = {"turn_id": "T", "user_id": "u1", "refused_prompts": {"c0": "r0"}}
    denial = [{"role": "user", "content": "No."}, _denial("c0")]

    checked = await _outcome(logger.check_turn(CID, denial, **turn))
    assert await backend.db.agent_conversations.find_one({"_id": CID}) == raw  # read only
    logged = await _outcome(logger.log_messages(CID, denial, **turn))

    assert (checked, logged) == (AnsweredBefore, AnsweredBefore)
    assert await backend.db.agent_conversations.find_one({"_id": CID}) == raw


async def test_a_late_retry_of_a_streamed_turn_is_a_replay_however_many_turns_came_in_between(
    backend: Backend,
) -> None:
    """A streamed turn approving r0 and carrying c0's result, stored, its reply lost, retried
    after more than `turns_recorded` later turns: a replay of the stored messages, as a
    `log_messages` retry of it is (was: `AnsweredBefore`, its own first attempt taken for
    another turn answering c0, and a runtime logging it without the answer stored it twice)."""
    logger = AgentMessageLogger(backend.db, rules=PAST_TWO)
    store = ConversationStore(backend.db, rules=PAST_TWO)
    asked = await logger.log_messages(CID, ASKS_TO_PAY, turn_id="ask", user_id="u1")
    made_by = asked.messages[1].id
    turn = StreamedTurn(
        messages=tuple(messages_adapter.validate_python(PAID)),
        interrupted=False,
        resolved_request_ids=("r0",),
        resolved_calls=(("r0", (("c0", made_by),)),),
        answered_calls=(("c0", made_by),),
    )
    streamed = partial(
        log_streamed_turn, logger=logger, store=store, conversation_id=CID, turn=turn,
        turn_id="t-stream", user_id="u1",
    )  # fmt: skip
    first = await streamed()
    await _later_turns(logger, CID, PAST_TWO.turns_recorded + 1)

    late = await streamed()

    assert late.replayed
    assert [m.id for m in late.messages] == [m.id for m in first.messages]
    assert [m.content for m in await store.transcript(CID)].count("Paid.") == 1


async def test_a_fork_of_a_fork_at_a_question_copies_no_answer_a_later_turn_gave(
    backend: Backend,
) -> None:
    """DESIGN.md §3 Forks: a fork's turns are its original's (`forked_from.turn_starts`), not
    the one turn holding its copies. Forking a copy of a conversation at a confirmation
    question ("what if I had said no") stops there, as a fork of the original does: the
    payment's result, logged by the next turn, is not copied and the call is still pending."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [_user("Pay the invoice."), _calls("pay"), _asks_about("r1", "pay")], turn_id="t1"
    )
    await store.resolve_hitl(CID, "r1")
    await logger.log_messages(CID, [_answer("pay", "paid"), _say("Paid.")], turn_id="t2")
    await logger.log_messages(CID, [_user("Thanks."), _say("Welcome.")], turn_id="t3")
    await logger.fork(CID, 6, "copy")

    direct = await logger.fork(CID, 2, "direct")
    again = await logger.fork("copy", 2, "again")

    assert [m.content for m in again.messages] == [m.content for m in direct.messages]
    assert len(again.messages) == 3
    assert await pending_state(store, "again") == await pending_state(store, "direct")


def _paired_conversation(rng: random.Random) -> list[Step]:
    """A small random conversation whose calls are answered in their own turn (right after
    the call, or after a reply) or left open for a later turn's result, some turns with two
    user messages, prompts about a call, and a person answering them between turns."""
    steps: list[Step] = []
    open_calls: list[str] = []
    for t in range(rng.randint(3, 6)):
        turn = [_user(f"u{t}"), *([_user(f"and {t}")] * rng.randint(0, 1))]
        for call_id in [c for c in open_calls if rng.random() < 0.5]:
            open_calls.remove(call_id)
            turn.append(_answer(call_id, f"late {t}"))
        for n in range(rng.randint(0, 2)):
            call_id = f"c{t}-{n}"
            turn.append(_calls(call_id))
            if rng.random() < 0.3:
                turn.append(_asks_about(f"q{t}-{n}", call_id))
                steps.append(turn)
                steps.append(f"q{t}-{n}")
                turn = []
            if rng.random() < 0.5:
                turn += [*([_say(f"working {t}")] * rng.randint(0, 1)), _answer(call_id)]
            else:
                open_calls.append(call_id)
        steps.append([*turn, _say(f"a{t}")])
    return steps


@pytest.mark.parametrize("seed", [0, 1, 4])  # each cuts a call from a later turn's result
async def test_a_fork_of_a_fork_ends_where_a_fork_of_the_original_at_that_point_ends(
    backend: Backend, seed: int
) -> None:
    """DESIGN.md §3 Forks: tool pairs are never cut within a turn, and a fork's turns are its
    original's (`forked_from.turn_starts`): a fork of a fork cuts where a fork of the original
    at the same point cuts, never carrying on to a result a later turn of the original gave a
    call made at or before that point. Over small random conversations, a fork of a copy of
    the whole conversation, and of a copy of that copy, at every `seq` answers every reader as
    the fork of the original at the same message does."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for n, step in enumerate(_paired_conversation(random.Random(seed))):
        await _take_step(logger, store, n, step)
    seqs = [m.seq for m in await store.transcript(CID)]
    await logger.fork(CID, seqs[-1], "copy")
    await logger.fork("copy", len(seqs) - 1, "copy-of-copy")
    for index, seq in enumerate(seqs):
        assert seq is not None
        await logger.fork(CID, seq, f"direct-{index}")
        expected = await _as_read(store, f"direct-{index}")
        for source in ("copy", "copy-of-copy"):
            await logger.fork(source, index, f"{source}-{index}")
            assert await _as_read(store, f"{source}-{index}") == expected, f"{source} at {index}"


async def test_a_pop_in_a_later_turn_named_like_a_forks_copies_uncounts_only_what_it_counted(
    backend: Backend,
) -> None:
    """A fork's turn starts mark where its copies began a turn of the original: a later turn
    logged over popped copies under an id that looks like a fork's (a caller may name a turn
    so) is no copy. Popping the second of its two user messages, which began no turn, leaves
    the turn count as it was (was: one turn less, its `seq` taken for a copy's turn start)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for n in range(3):
        await logger.log_messages("orig", [_user(f"q{n}"), _say(f"a{n}")], turn_id=f"t{n}")
    await logger.fork("orig", 5, "copy")  # its turns began at seq 2 and 4
    for _ in range(3):
        await store.pop_last_message("copy")
    await logger.log_messages("copy", [_user("x"), _user("y")], turn_id="fork-mine")
    assert (await store.get_conversation("copy")).turn_count == 3

    await store.pop_last_message("copy")

    assert (await store.get_conversation("copy")).turn_count == 3
    assert await store.turn_count("copy") == 3


async def _forked_state(
    logger: AgentMessageLogger, store: ConversationStore, backend: Backend, fork_id: str
) -> list[Any]:
    """`held_state` and `approved_calls`, in the conversation and in a fork of all of it."""
    await _whole_fork(logger, store, fork_id)
    return [
        (await held_state(store, cid), sorted(await _approved_calls(backend, cid)))
        for cid in (CID, fork_id)
    ]


async def _denial_stored(logger: AgentMessageLogger, cid: str, call_id: str) -> bool:
    try:
        await logger.log_messages(cid, [{"role": "user", "content": "No!"}, _denial(call_id)],
                                  turn_id="deny")  # fmt: skip
    except AnsweredBefore:
        return False
    return True


async def test_a_block_given_up_is_a_gap_so_a_later_give_back_withdraws_what_a_fork_does(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3: a block a turn does not fill, refused after its reservation, is given
    back, its `seq`s gaps no turn holds. t4 [c3, pay 35 EUR, asked by q1] and t5 [c4]
    reserve and die; the person approves q1; t7 answers c4, so t5's late retry is refused
    (`Unmovable`) and given up. t4's retry with other content (c3 now pays 3500 EUR) gives
    its block back: no stored question below the answer's reach asked about c3, so the
    approval goes, in the conversation as in a fork of all of it, and a denial of c3 is
    stored in both."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    pay = [{"role": "user", "content": "pay the bills"}, _calls("c3"), _asks_about("q1", "c3")]
    await _reserved_only(logger, monkeypatch, pay, "t4")
    rent = [{"role": "user", "content": "and the rent"}, _calls("c4")]
    await _reserved_only(logger, monkeypatch, rent, "t5")
    monkeypatch.undo()
    await store.resolve_hitl(CID, "q1")
    await logger.log_messages(CID, [{"role": "user", "content": "no rent"}, _denial("c4")],
                              turn_id="t7")  # fmt: skip
    with pytest.raises(Conflict, match="a later turn answered its call 'c4'"):  # given up
        await logger.log_messages(CID, rent, turn_id="t5")
    costly = {**_calls("c3"), "content": "3500 EUR"}
    await logger.log_messages(CID, [pay[0], costly, _asks_about("q1", "c3")], turn_id="t4")

    live, forked = await _forked_state(logger, store, backend, "fork-all")
    assert live == forked == (([("c3", "q1")], "q1"), [])
    assert [await _denial_stored(logger, cid, "c3") for cid in (CID, "fork-all")] == [True] * 2


async def test_a_moved_question_keeps_the_calls_an_answer_naming_another_call_left_held(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §2 `answered_prompts` (an answer naming its calls releases those of them the
    prompts of the id held, the others staying held) and §3 (a move leaves what the same
    stored messages and answers leave logged afresh). t1 makes c3 under r1; t2 [deny c3,
    ask r3] and t3 [c1, c3, ask r1] reserve and die; t2's retry with other content gives
    its block back; the person answers r1 naming the call they see, t1's c3; t3's late
    retry moves to the end. Its calls stay held by r1, in the conversation as in a fork
    of all of it, and a denial of its c1 is stored in both."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "u0"}, _calls("c3"), _asks("r1")],
                              turn_id="t1")  # fmt: skip
    denies = [{"role": "user", "content": "u1"}, _denial("c3"), _asks_about("r3", "c3")]
    await _reserved_only(logger, monkeypatch, denies, "t2")
    t3 = [{"role": "user", "content": "u2"}, _calls("c1", "c3"), _asks("r1")]
    await _reserved_only(logger, monkeypatch, t3, "t3")
    monkeypatch.undo()
    await logger.log_messages(CID, [{"role": "user", "content": "u1 (regenerated)"}],
                              turn_id="t2")  # fmt: skip
    seen = await store.pending_calls(CID)
    await store.resolve_hitl(CID, "r1", calls=[c for c in seen if c.tool_call_id == "c3"])

    await logger.log_messages(CID, t3, turn_id="t3")

    live, forked = await _forked_state(logger, store, backend, "fork-all")
    assert live == forked
    assert live[0][0] == [("c3", None), ("c1", "r1"), ("c3", "r1")]
    assert [await _denial_stored(logger, cid, "c1") for cid in (CID, "fork-all")] == [True] * 2


# -- a give-back's fold that cannot be written is owed, and folded by the next turn ---------


class _Busy:
    """A logger's collection, with another writer logging a turn before each of its first
    `left` calls `hit` picks (another process, on a busy conversation)."""

    def __init__(
        self,
        collection: Any,
        writer: Callable[[], Awaitable[None]],
        left: int,
        hit: Callable[[str, tuple[Any, ...]], bool],
    ) -> None:
        self._collection, self._writer, self.left, self._hit = collection, writer, left, hit

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._collection, name)
        if not callable(attribute) or name in ("find", "aggregate", "with_options"):
            return attribute

        async def meanwhile(*args: Any, **kwargs: Any) -> Any:
            if self.left > 0 and self._hit(name, args):
                self.left -= 1
                await self._writer()
            return await attribute(*args, **kwargs)

        return meanwhile


def _other_writer(backend: Backend, cid: str = CID) -> Callable[[], Awaitable[None]]:
    """Another process logging a turn of conversation `cid` each time it is called."""
    other, turns = AgentMessageLogger(backend.db), [0]

    async def write() -> None:
        turns[0] += 1
        said = [{"role": "user", "content": f"y{turns[0]}"}, {"role": "assistant", "content": "y"}]
        await other.log_messages(cid, said, turn_id=f"other-{turns[0]}")

    return write


def _before_the_fold_writes(name: str, args: tuple[Any, ...]) -> bool:
    """The fold's guarded update (`_relocated.refolded`: unchanged `message_count`, `pops`)."""
    return name == "update_one" and "message_count" in args[0] and "pops" in args[0]


@pytest.mark.parametrize(
    ("first", "regenerated", "left"),
    [
        (
            [{"role": "user", "content": "b"}, _calls("c1")],
            [{"role": "user", "content": "b"}, {"role": "assistant", "content": "no call now"}],
            ([], None),
        ),
        (
            [{"role": "user", "content": "b"}, _calls("c1"), _asks_about("q1", "c1")],
            [
                {"role": "user", "content": "b"},
                _calls("c1"),
                {"role": "assistant", "content": "ok"},
            ],
            ([("c1", None)], None),
        ),
        (
            [{"role": "user", "content": "b"}, _asks("q1")],
            [{"role": "user", "content": "b"}, {"role": "assistant", "content": "just text"}],
            ([], None),
        ),
    ],
    ids=["call-dropped", "question-dropped", "prompt-dropped"],
)
@pytest.mark.parametrize("then", ["retry", "turn", "read"])
async def test_a_give_back_fold_missed_under_concurrent_turns_is_folded_by_the_next_turn(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    first: list[dict[str, Any]],
    regenerated: list[dict[str, Any]],
    left: tuple[list[tuple[str, str | None]], str | None],
    then: str,
) -> None:
    """RELIABILITY.md (a give-back takes back what its reservation listed, the pending state
    folded again): t1 reserves and stores nothing; past `abandon_after` its retry regenerates
    the answer without the call, the question or the prompt; another process logs a turn
    between the fold's read and its write, three times running, so the fold cannot be
    written. It is owed (`refold_owed`): the retry's own turn folds it after its insert; its
    process dying before that fold, the next quiet turn folds it, or the next read of the
    pending state. The conversation lists what a fork of all of it lists, never the first
    attempt's call or prompt."""
    logger, store = _late_logger(backend), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "a"}], turn_id="t0")
    await _reserved_only(logger, monkeypatch, first, "t1")
    await AgentMessageLogger(backend.db).log_messages(
        CID, [{"role": "user", "content": "x"}], turn_id="tx"
    )
    busy = _Busy(logger._conversations, _other_writer(backend), 3, _before_the_fold_writes)
    monkeypatch.setattr(logger, "_conversations", busy)
    if then != "retry":  # its process dies between its insert and its fold
        monkeypatch.setattr(logger, "_settle", partial(_died, logger._settle))
    await logger.log_messages(CID, regenerated, turn_id="t1")
    assert busy.left == 0  # three turns came between the fold's read and its write
    monkeypatch.undo()
    owed = await backend.db.agent_conversations.find_one({"_id": CID})
    assert (owed.get("refold_owed") is None) == (then == "retry")

    if then == "read":
        assert await held_state(store) == left
    elif then == "turn":
        await logger.log_messages(CID, [{"role": "user", "content": "later"}], turn_id="later")

    live, forked = await _forked_state(logger, store, backend, "fork-all")
    assert live == forked
    assert live[0] == left
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert doc.get("refold_owed") is None  # folded: owed no more


async def _died(fold: Callable[..., Awaitable[bool]], *args: Any, **kwargs: Any) -> bool:
    return False  # the fold never made


async def test_a_regenerated_answer_is_never_refused_from_a_fold_missed_under_busy_writers(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELIABILITY.md (after a give-back the answer is judged as for a new turn on the
    conversation the give-back leaves): t1 answers c0 naming it and stores nothing; past
    `abandon_after` its retry regenerates the final text while another writer logs a turn
    before each of its first collection calls. No turn answered c0: the retry is stored, or
    asked to be sent again (`StorageUnavailable`, `Unreserved`) and stored then, never
    refused `AnsweredBefore`; c0 is answered once, in the conversation as in a fork of all
    of it."""
    for calls in range(16, 31, 2):
        cid = f"{CID}-{calls}"
        logger, store = _late_logger(backend), ConversationStore(backend.db)
        made = await logger.log_messages(
            cid, [{"role": "user", "content": "a"}, _calls("c0")], turn_id="t0"
        )
        to = {"c0": made.messages[1].id}
        with monkeypatch.context() as lost:
            lost.setattr(logger._messages, "insert_many", _lost_insert)
            with pytest.raises(ConnectionError):
                await logger.log_messages(cid, [_answer("c0", "r0")], turn_id="t1", answers_to=to)
        await AgentMessageLogger(backend.db).log_messages(
            cid, [{"role": "user", "content": "x"}], turn_id="tx"
        )
        regenerated = [_answer("c0", "r0"), {"role": "assistant", "content": "done (again)"}]
        with monkeypatch.context() as busy:
            write = _other_writer(backend, cid)
            for name in ("_messages", "_conversations"):
                busy.setattr(logger, name, _Busy(getattr(logger, name), write, calls, _always))
            with contextlib.suppress(StorageUnavailable):  # `Unreserved` is one: send again
                await logger.log_messages(cid, regenerated, turn_id="t1", answers_to=to)
        await logger.log_messages(cid, regenerated, turn_id="t1", answers_to=to)

        answers = [m for m in await store.transcript(cid) if m.tool_call_id == "c0"]
        assert [m.content for m in answers] == ["r0"], calls
        await logger.fork(cid, (await store.transcript(cid))[-1].seq, f"fork-{calls}")
        assert (
            await held_state(store, cid) == await held_state(store, f"fork-{calls}") == ([], None)
        )


async def _lost_insert(*args: Any, **kwargs: Any) -> None:
    raise ConnectionError("the turn reserved and has not inserted")


def _always(name: str, args: tuple[Any, ...]) -> bool:
    return True


class _FirstReadThen:
    """A collection whose first `find_one` answers, then runs `meanwhile` before returning:
    another writer acting between a reader's read and its next step."""

    def __init__(self, collection: Any, meanwhile: Callable[[], Awaitable[Any]]) -> None:
        self._collection, self._meanwhile, self._done = collection, meanwhile, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)

    async def find_one(self, *args: Any, **kwargs: Any) -> Any:
        found = await self._collection.find_one(*args, **kwargs)
        if not self._done:
            self._done = True
            await self._meanwhile()
        return found


@pytest.mark.parametrize("later", [0, 3], ids=["", "its record dropped since"])
async def test_a_turn_checked_while_its_own_first_attempt_answers_the_call_is_a_replay(
    backend: Backend, later: int
) -> None:
    """LIBRARY.md `check_turn`: a retry is answered as the logged turn. `check_turn` of t1,
    answering c1, reads the conversation before t1's own first attempt is stored; that
    attempt then stores t1, answering c1 (and `later` turns follow it, past the records
    kept). The call is answered by the turn checked itself, not by another turn:
    `check_turn` passes, as for any retry of a logged turn (was: `AnsweredBefore` "another
    turn answered that call first … Log the turn without that answer", whose advice stores
    the reply twice, and still so once t1's record was dropped); the retry replays it."""
    rules = TurnRules(turns_recorded=2)
    logger, store = AgentMessageLogger(backend.db, rules=rules), ConversationStore(backend.db)
    t0 = await logger.log_messages(CID, [{"role": "user", "content": "go"}, _calls("c1")])
    named = {"c1": t0.messages[1].id}
    t1 = [_answer("c1", "sunny"), {"role": "assistant", "content": "Sunny."}]

    async def first() -> None:
        await logger.log_messages(CID, t1, turn_id="t1", answers_to=named)
        for n in range(later):
            await logger.log_messages(CID, [_user(f"later {n}")], turn_id=f"later-{n}")

    checking = AgentMessageLogger(backend.db, rules=rules)
    checking._conversations = _FirstReadThen(checking._conversations, first)

    await checking.check_turn(CID, t1, turn_id="t1", answers_to=named)

    retried = await logger.log_messages(CID, t1, turn_id="t1", answers_to=named)
    assert retried.replayed
    assert [m.content for m in await store.transcript(CID)][2:4] == ["sunny", "Sunny."]


async def _lost_insert(*args: Any, **kwargs: Any) -> None:
    raise ConnectionError("reserved, its insert lost")


@pytest.mark.parametrize("first_answer", ["stored", "still being written"])
async def test_a_bridge_answer_read_while_its_call_was_unstored_is_judged_once_the_call_landed(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, first_answer: str
) -> None:
    """LIBRARY.md `calls_answered`: a call off `pending_calls` whose turn is still being written
    is named as `pending_calls` served it, so a stale tab's answer is refused, never stored
    twice. When that turn lands between `calls_answered` and `log_messages`, the call is judged
    by the message that stored it: `AnsweredBefore`, or `StorageUnavailable` while the first
    answer is still being written (was: a 422 naming the stand-in id, "a fork?")."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    t0 = [{"role": "user", "content": "Look"}, _calls("c0")]
    with monkeypatch.context() as lost:
        lost.setattr(logger._messages, "insert_many", _lost_insert)
        with contextlib.suppress(ConnectionError):
            await logger.log_messages(CID, t0, turn_id="t0")
    (read,) = await store.pending_calls(CID)
    tab_a = partial(logger.log_messages, CID, [_answer("c0", "A")], turn_id="tab-a")
    with monkeypatch.context() as lost:
        if first_answer == "still being written":
            lost.setattr(logger._messages, "insert_many", _lost_insert)
        with contextlib.suppress(ConnectionError):
            await tab_a(answers_to={"c0": read.message_id})
    stale = messages_adapter.validate_python(
        [_answer("c0", "B"), {"role": "assistant", "content": "B."}]
    )
    named = await logger.calls_answered(CID, stale)
    await logger.log_messages(CID, t0, turn_id="t0")  # the call's turn lands meanwhile

    refused = AnsweredBefore if first_answer == "stored" else StorageUnavailable
    with pytest.raises(refused):
        await logger.log_messages(CID, stale, turn_id="tab-b", answers_to=named)
    assert [m.content for m in await store.transcript(CID)][2:] == (
        ["A"] if first_answer == "stored" else []
    )


# -- a bridge's answer naming the tool it is a result of -------------------------------


@pytest.mark.parametrize("call", ["pending", "answered already"])
async def test_an_answer_naming_another_tool_than_the_call_of_its_id_is_refused(
    backend: Backend, call: str
) -> None:
    """RUNTIMES.md: `calls_answered` takes the tool each result is of, as the runtime says
    (`tool_names`): a result of `refund` for the call c0 of `book` here (pending, or off the
    list, answered already: its stored message says its tool) is refused InvalidInput naming
    both tools and the call, before anything is written. Naming the call's own tool, or none,
    names its message as before."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    t0 = await logger.log_messages(CID, [{"role": "user", "content": "book"}, _calls("c0")])
    if call == "answered already":
        await logger.log_messages(CID, [_answer("c0", "booked")], turn_id="t1")
    late = messages_adapter.validate_python([_answer("c0", "refund R-77")])

    with pytest.raises(InvalidInput, match=r"'c0'.*'refund'.*'book'") as refused:
        await logger.calls_answered(CID, late, tool_names={"c0": "refund"})

    assert CID in str(refused.value)
    named = {"c0": t0.messages[1].id}
    assert await logger.calls_answered(CID, late, tool_names={"c0": "book"}) == named
    assert await logger.calls_answered(CID, late, tool_names={"other": "refund"}) == named
    assert await logger.calls_answered(CID, late) == named
    assert len(await store.transcript(CID)) == (2 if call == "pending" else 3)


@pytest.mark.parametrize("tool", ["another tool", "the call's tool", "no tool named"])
async def test_a_runtime_acting_for_a_user_learns_nothing_of_an_unowned_conversations_calls(
    backend: Backend, tool: str
) -> None:
    """RUNTIMES.md: a runtime acting for a user (`strict_owner`) reads and writes her own
    conversations only; a service's unowned one is not hers. A result she sends for its call
    c0 is answered as one for a conversation that does not exist (`calls_answered` names
    nothing, the turn is NotFound, nothing written), whatever tool she names: a result
    naming another tool than the stored call's was InvalidInput naming the call's tool,
    telling her the conversation exists, its call ids and its tools."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "wire"}, _calls("c0")])
    named = {"another tool": {"c0": "refund"}, "the call's tool": {"c0": "book"}}.get(tool)
    late = messages_adapter.validate_python([_answer("c0", "refund R-77")])

    answers = {}
    for conversation_id in (CID, "never-created"):
        answers[conversation_id] = await logger.calls_answered(
            conversation_id, late, user_id="mallory", tool_names=named, strict_owner=True
        )
        with pytest.raises(NotFound) as refused:
            await logger.log_messages(
                conversation_id,
                late,
                user_id="mallory",
                answers_to=answers[conversation_id],
                strict_owner=True,
            )
        assert str(refused.value) == f"conversation {conversation_id!r} was not found"

    assert answers[CID] == answers["never-created"]
    assert len(await store.transcript(CID)) == 2


async def test_a_result_names_the_call_of_its_own_tool_among_calls_of_one_id(
    backend: Backend,
) -> None:
    """Two calls use the id c0 (a provider numbering calls per response): `book_train`'s,
    then `book_hotel`'s, both pending. A result the runtime says is `book_train`'s is named
    by the train's call, not the latest of the id, and never refused as another tool's: the
    store's pairing (an answer takes the latest pending call of its id) then asks for the
    hotel's answer first (Conflict, nothing stored), after which the train's is logged and
    answers the train's call."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    train = await logger.log_messages(
        CID, [{"role": "user", "content": "train?"}, _tool_calls(("c0", "book_train"))]
    )
    await logger.log_messages(
        CID, [{"role": "user", "content": "hotel?"}, _tool_calls(("c0", "book_hotel"))]
    )
    result = messages_adapter.validate_python([_answer("c0", "train booked")])

    named = await logger.calls_answered(CID, result, tool_names={"c0": "book_train"})

    assert named == {"c0": train.messages[1].id}
    with pytest.raises(Conflict, match="answer the later call in a turn of its own first"):
        await logger.log_messages(CID, result, turn_id="train-result", answers_to=named)
    hotel = messages_adapter.validate_python([_answer("c0", "hotel booked")])
    await logger.log_messages(
        CID,
        hotel,
        turn_id="hotel-result",
        answers_to=await logger.calls_answered(CID, hotel, tool_names={"c0": "book_hotel"}),
    )
    named = await logger.calls_answered(CID, result, tool_names={"c0": "book_train"})
    await logger.log_messages(CID, result, turn_id="train-result", answers_to=named)
    assert await store.pending_calls(CID) == []
    exported = [m for m in chat_completions(await store.transcript(CID)) if m["role"] == "tool"]
    assert [m["content"] for m in exported] == ["train booked", "hotel booked"]


async def test_a_retry_of_a_logged_result_is_its_replay_after_the_id_is_used_again(
    backend: Backend,
) -> None:
    """`book_train`'s call c0 is answered by a logged turn; a later turn makes c0 again, for
    `book_hotel`, pending. The answer's retry (its reply was lost), named as the runtime says
    (`book_train`), is named by the train's call and answered as the replay it is, nothing
    stored twice, never refused as another tool's result."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [{"role": "user", "content": "train?"}, _tool_calls(("c0", "book_train"))]
    )
    result = messages_adapter.validate_python([_answer("c0", "train booked")])
    first = await logger.log_messages(
        CID,
        result,
        turn_id="train-result",
        answers_to=await logger.calls_answered(CID, result, tool_names={"c0": "book_train"}),
    )
    await logger.log_messages(
        CID, [{"role": "user", "content": "hotel?"}, _tool_calls(("c0", "book_hotel"))]
    )

    named = await logger.calls_answered(CID, result, tool_names={"c0": "book_train"})
    again = await logger.log_messages(CID, result, turn_id="train-result", answers_to=named)

    assert again.replayed
    assert [m.id for m in again.messages] == [m.id for m in first.messages]
    assert len(await store.transcript(CID)) == 5


# -- a bridge's answer to a call no message of the conversation makes -------------------


async def _logged_by_a_bridge(
    logger: AgentMessageLogger,
    answer: list[dict[str, Any]],
    *,
    turn_id: str,
    user_id: str | None = None,
) -> LoggedTurn:
    """`answer` logged as a runtime's bridge that read no `pending_calls` logs it (`log_run`,
    `add_items`, `aadd_messages`): `calls_answered` names the calls it answers, then
    `log_messages` logs it with them, for a runtime acting for `user_id` (`strict_owner`), or
    for a service without one."""
    messages = messages_adapter.validate_python(answer)
    named = await logger.calls_answered(CID, messages, user_id=user_id)
    return await logger.log_messages(
        CID,
        messages,
        user_id=user_id,
        turn_id=turn_id,
        answers_to=named,
        strict_owner=user_id is not None,
    )


_LATE_RESULT = [_answer("c0", "booked"), _say("Booked.")]
"""A paused run's late turn: the approved call's result, and the reply."""


async def test_a_bridges_late_answer_never_creates_the_conversation_deleted_meanwhile(
    backend: Backend,
) -> None:
    """LIBRARY.md `calls_answered`: a run paused on c0, the person deleted the conversation,
    and the runtime logs c0's result and its reply as its bridges do. A turn answering a call
    of an earlier turn never creates its conversation, as over HTTP with `answers_to`:
    NotFound to a runtime acting for the user (the 404), a Conflict to a service (the 409),
    nothing written (was: the conversation created again, holding only the orphan result
    and the reply)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Book it."), _calls("c0")], turn_id="t0", user_id="u")
    await store.delete(CID, user_id="u")

    with pytest.raises(NotFound, match="not found"):
        await _logged_by_a_bridge(logger, _LATE_RESULT, turn_id="t1", user_id="u")
    with pytest.raises(Conflict, match="does not exist") as refused:
        await _logged_by_a_bridge(logger, _LATE_RESULT, turn_id="t1")

    assert not isinstance(refused.value, AnsweredBefore)
    with pytest.raises(NotFound):
        await store.get_conversation(CID)


@pytest.mark.parametrize("again_by", ["u", "grace"], ids=["by the user", "by another user"])
async def test_a_bridges_late_answer_is_refused_by_the_conversation_started_again_meanwhile(
    backend: Backend, again_by: str
) -> None:
    """The same after the conversation was deleted and a new chat started under its id, by
    the user or by another (a service's runtime serves both): no message of this conversation
    makes c0, so the turn is refused InvalidInput naming the call, as over HTTP an
    `answers_to` naming such a call is (422), by `check_turn` too, nothing written (was: the
    old run's result and reply appended to the new chat, another user's); to a runtime acting
    for the user the other user's chat is NotFound, as before."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Book it."), _calls("c0")], turn_id="t0", user_id="u")
    await store.delete(CID, user_id="u")
    await logger.log_messages(CID, [_user("A new chat.")], turn_id="new", user_id=again_by)
    before = await store.transcript(CID)

    unmade = "no message of this conversation makes call 'c0'"
    with pytest.raises(InvalidInput if again_by == "u" else NotFound):
        await _logged_by_a_bridge(logger, _LATE_RESULT, turn_id="t1", user_id="u")
    with pytest.raises(InvalidInput, match=unmade):
        await _logged_by_a_bridge(logger, _LATE_RESULT, turn_id="t1")
    stale = messages_adapter.validate_python(_LATE_RESULT)
    named = await logger.calls_answered(CID, stale)
    with pytest.raises(InvalidInput, match=unmade):
        await logger.check_turn(CID, stale, turn_id="t1", answers_to=named)

    assert await store.transcript(CID) == before


def _mongomock_db(name: str) -> Any:
    from mongomock_motor import AsyncMongoMockClient

    return AsyncMongoMockClient(tz_aware=True)[name]


async def test_a_bridges_answer_to_a_call_the_turn_in_flight_answers_itself_is_refused() -> None:
    """LIBRARY.md `calls_answered`: t0 makes c0 and answers it itself, its insert still to land
    (lost, its writer retries): c0 never joined `pending_calls`, and a bridge's answer to it is
    refused InvalidInput as answering a call no message of the conversation makes, nothing
    stored; once t0 lands, the same answer is `AnsweredBefore` (was: left out of
    `answers_to` while t0 was in flight, stored as a second answer to c0)."""
    db = _mongomock_db("answered_in_flight")
    logger, store = AgentMessageLogger(db), ConversationStore(db)
    t0 = partial(
        logger.log_messages,
        CID,
        [_user("Look it up."), _calls("c0"), _answer("c0", "A")],
        turn_id="t0",
    )
    await reserved_insert_lost(logger, t0)

    with pytest.raises(InvalidInput, match="no message of this conversation makes call 'c0'"):
        await _logged_by_a_bridge(logger, _LATE_RESULT, turn_id="t1")

    await t0()
    with pytest.raises(AnsweredBefore, match="'c0'"):
        await _logged_by_a_bridge(logger, _LATE_RESULT, turn_id="t1")
    assert [m.content for m in await store.transcript(CID) if m.role == "tool"] == ["A"]


@pytest.mark.parametrize("pushers", ["pending", "one answered", "popped"])
async def test_a_bridges_answer_to_a_call_the_list_may_have_pushed_off_is_left_out(
    pushers: str,
) -> None:
    """The one case `calls_answered` cannot decide: t0 makes c0 and leaves it open, its insert
    still to land, and a later turn's `PENDING_CALLS_KEPT` calls push c0 off `pending_calls`
    (the list full, or some answered since, or the message making them popped since). c0 may
    be t0's, unanswered: the answer is left
    out of `answers_to` (logged without it, its answer landing after t0), as before."""
    db = _mongomock_db("pushed_off_in_flight")
    logger, store = AgentMessageLogger(db), ConversationStore(db)
    t0 = partial(logger.log_messages, CID, [_user("Look it up."), _calls("c0")], turn_id="t0")
    await reserved_insert_lost(logger, t0)
    many = [f"p{n}" for n in range(PENDING_CALLS_KEPT)]
    await logger.log_messages(CID, [_user("And these?"), _calls(*many)], turn_id="t1")
    if pushers == "one answered":
        await logger.log_messages(CID, [_answer("p0")], turn_id="t2", answers_to={})
    elif pushers == "popped":
        await store.pop_last_message(CID)
    assert "c0" not in {c.tool_call_id for c in await store.pending_calls(CID)}
    stale = messages_adapter.validate_python(_LATE_RESULT)

    assert await logger.calls_answered(CID, stale) == {}


_UNMADE_C0 = "no message of this conversation makes call 'c0'"


async def _new_chat_after_a_paused_run(
    logger: AgentMessageLogger, store: ConversationStore
) -> None:
    """Ada's run paused on c0, then her conversation deleted; grace starts a new chat under
    its id (a service's runtime serves both)."""
    await logger.log_messages(CID, [_user("Refund me."), _calls("c0")], turn_id="t0", user_id="u")
    await store.delete(CID, user_id="u")
    await logger.log_messages(CID, [_user("A new chat.")], turn_id="g0", user_id="grace")


async def _refused_as_unmade(logger: AgentMessageLogger, store: ConversationStore) -> None:
    """The paused run's late answer to c0, logged as a service's bridge logs it: refused
    InvalidInput as answering a call no message of the conversation makes, nothing stored."""
    before = await store.transcript(CID)
    with pytest.raises(InvalidInput, match=_UNMADE_C0):
        await _logged_by_a_bridge(logger, _LATE_RESULT, turn_id="late")
    assert await store.transcript(CID) == before


async def test_a_late_answer_is_refused_by_a_full_pending_list_made_before_the_turn_in_flight(
    backend: Backend,
) -> None:
    """RUNTIMES.md "A run resumed after its conversation went": grace's new chat leaves
    `PENDING_CALLS_KEPT` calls awaiting approval, all made before her turn still being
    written (its insert lost, retried); nothing reserved after that turn pushed a call off
    the list, so the old run's late answer to c0 is refused, nothing stored (was: the list
    being full was taken as a call of the turn in flight pushed off, and ada's result and
    reply stored in grace's chat)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _new_chat_after_a_paused_run(logger, store)
    many = [f"b{n}" for n in range(PENDING_CALLS_KEPT)]
    await logger.log_messages(CID, [_calls(*many)], turn_id="g1", user_id="grace")
    hurry = partial(logger.log_messages, CID, [_user("Hurry.")], turn_id="g2", user_id="grace")
    await reserved_insert_lost(logger, hurry)
    assert len(await store.pending_calls(CID)) == PENDING_CALLS_KEPT

    await _refused_as_unmade(logger, store)


async def test_a_late_answer_is_refused_past_a_list_cut_after_a_turn_in_flight_leaving_none(
    backend: Backend,
) -> None:
    """Grace's message still being written makes no call; her agent's next message then
    leaves more calls open than `pending_calls` keeps, pushing its own oldest off. The turn
    in flight left no call open, so it lost none to the cut (its record says so), and the
    old run's late answer to c0 is refused, nothing stored (was: every turn in flight
    reserved before the cut counted as having lost one, and ada's result was stored in
    grace's chat)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _new_chat_after_a_paused_run(logger, store)
    hurry = partial(logger.log_messages, CID, [_user("Hurry.")], turn_id="g1", user_id="grace")
    await reserved_insert_lost(logger, hurry)
    many = [f"b{n}" for n in range(PENDING_CALLS_KEPT + 1)]
    await logger.log_messages(CID, [_calls(*many)], turn_id="g2", user_id="grace")
    assert len(await store.pending_calls(CID)) == PENDING_CALLS_KEPT

    await _refused_as_unmade(logger, store)


async def test_a_late_answer_is_refused_past_many_calls_answered_in_their_own_turns(
    backend: Backend,
) -> None:
    """The same while grace's turn is still being written and her agent then logs turns
    making `PENDING_CALLS_KEPT` calls in all, each answered in its own turn: none joined
    `pending_calls`, none pushed a call off it, so the late answer to c0 is refused
    (was: the calls made past the turn in flight counted as pushing one off, and ada's
    result stored in grace's chat)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _new_chat_after_a_paused_run(logger, store)
    hurry = partial(logger.log_messages, CID, [_user("Hurry.")], turn_id="g1", user_id="grace")
    await reserved_insert_lost(logger, hurry)
    for turn in range(PENDING_CALLS_KEPT // 10):
        ids = [f"r{turn}-{n}" for n in range(10)]
        work = [_calls(*ids), *(_answer(i) for i in ids)]
        await logger.log_messages(CID, work, turn_id=f"w{turn}", user_id="grace")
    assert await store.pending_calls(CID) == []

    await _refused_as_unmade(logger, store)


async def test_a_late_answer_is_refused_past_turns_popped_before_the_turn_in_flight(
    backend: Backend,
) -> None:
    """The same user: a run paused on c0, the person writes on, then undoes both (two pops:
    her message and the call's), and her next message is still being written. The pops'
    records lie past that turn's block (`seq`s are given back and reserved again), but
    they popped nothing after it: the late answer to c0 is refused, nothing stored (was:
    a popped record past the turn in flight taken as calls pushed off, and the answer
    stored as an orphan)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Book it."), _calls("c0")], turn_id="t0", user_id="u")
    await logger.log_messages(CID, [_user("Wait.")], turn_id="t1", user_id="u")
    await store.pop_last_message(CID, user_id="u")
    await store.pop_last_message(CID, user_id="u")
    again = partial(logger.log_messages, CID, [_user("Other.")], turn_id="t2", user_id="u")
    await reserved_insert_lost(logger, again)

    await _refused_as_unmade(logger, store)


async def test_a_late_answer_to_a_call_the_turn_in_flight_left_off_the_list_itself_is_left_out(
    backend: Backend,
) -> None:
    """A turn still being written that leaves more calls open than `pending_calls` keeps:
    its oldest call was never listed, and an answer to it is left out of `answers_to` (its
    answer lands after that turn), as one to a call a later turn pushed off is, also once
    later turns pushed more calls off, or answered some, past it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    many = ["c0", *(f"b{n}" for n in range(PENDING_CALLS_KEPT))]
    t0 = partial(logger.log_messages, CID, [_user("Book all."), _calls(*many)], turn_id="t0")
    await logger.log_messages(CID, [_user("Hello.")], turn_id="before")
    await reserved_insert_lost(logger, t0)
    assert "c0" not in {c.tool_call_id for c in await store.pending_calls(CID)}
    stale = messages_adapter.validate_python(_LATE_RESULT)
    assert await logger.calls_answered(CID, stale) == {}

    await logger.log_messages(CID, [_user("More."), _calls("d0")], turn_id="after")
    assert await logger.calls_answered(CID, stale) == {}
    await logger.log_messages(CID, [_answer("d0")], turn_id="answered", answers_to={})
    assert await logger.calls_answered(CID, stale) == {}


async def test_a_late_answer_to_another_call_is_refused_while_a_call_in_flight_is_pushed_off(
    backend: Backend,
) -> None:
    """Grace's turn still being written leaves a call of its own open (look-1), and her
    agent's next message leaves `PENDING_CALLS_KEPT` calls open, pushing look-1 off
    `pending_calls`. The store may have lost look-1, and only look-1: the old run's late
    answer to c0, a call no message of this life makes and none pushed off, is refused,
    nothing stored (was: left out of `answers_to` as a call the bound may have pushed off,
    and ada's result stored in grace's chat), while an answer to look-1 is left out."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _new_chat_after_a_paused_run(logger, store)
    opens = [_user("Hurry."), _calls("look-1")]
    hurry = partial(logger.log_messages, CID, opens, turn_id="g1", user_id="grace")
    await reserved_insert_lost(logger, hurry)
    many = [f"b{n}" for n in range(PENDING_CALLS_KEPT)]
    await logger.log_messages(CID, [_calls(*many)], turn_id="g2", user_id="grace")
    assert "look-1" not in {c.tool_call_id for c in await store.pending_calls(CID)}

    await _refused_as_unmade(logger, store)
    looked = messages_adapter.validate_python([_answer("look-1")])
    assert await logger.calls_answered(CID, looked, user_id="grace") == {}


@pytest.mark.parametrize("pushed_by", ["later turns", "the turn itself"])
async def test_an_answer_to_a_call_pushed_off_past_the_calls_the_mark_keeps_is_refused_as_unmade(
    backend: Backend, pushed_by: str
) -> None:
    """The conversation keeps the ids of the newest `PENDING_CALLS_KEPT` calls the bound of
    `pending_calls` pushed off (`calls_pushed_off`). A call of a turn still being written
    pushed off before that many more were (by later turns, or by the turn itself leaving
    more than twice that many open) can no longer be told from a call no message makes:
    its late answer is refused as unmade, InvalidInput naming it, nothing stored, never
    stored as an answer to a call of another life."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    if pushed_by == "later turns":
        opens = [_user("Book it."), _calls("c0")]
    else:
        opens = [
            _user("Book all."),
            _calls("c0", *(f"a{n}" for n in range(2 * PENDING_CALLS_KEPT))),
        ]
    t0 = partial(logger.log_messages, CID, opens, turn_id="t0")
    await reserved_insert_lost(logger, t0)
    if pushed_by == "later turns":
        for turn in range(2):
            many = [f"p{turn}-{n}" for n in range(PENDING_CALLS_KEPT)]
            await logger.log_messages(CID, [_calls(*many)], turn_id=f"t{turn + 1}")
    assert "c0" not in {c.tool_call_id for c in await store.pending_calls(CID)}

    await _refused_as_unmade(logger, store)


async def test_a_bridges_logged_answer_retried_once_its_call_left_pending_calls_is_a_replay(
    backend: Backend,
) -> None:
    """A retry of a bridge's turn already logged is its replay, never refused as answering a
    call no longer pending: its answer took c0 off `pending_calls`, and c0 is named by the
    message that made it, however many turns came since (past the kept records too)."""
    logger = AgentMessageLogger(backend.db, rules=PAST_TWO)
    await logger.log_messages(CID, [_user("Book it."), _calls("c0")], turn_id="t0", user_id="u1")
    first = await _logged_by_a_bridge(logger, _LATE_RESULT, turn_id="t1", user_id="u1")
    assert await ConversationStore(backend.db).pending_calls(CID, user_id="u1") == []
    await _later_turns(logger, CID, PAST_TWO.turns_recorded + 1)

    again = await _logged_by_a_bridge(logger, _LATE_RESULT, turn_id="t1", user_id="u1")

    assert again.replayed
    assert [m.id for m in again.messages] == [m.id for m in first.messages]


# -- a turn that died before its insert ---------------------------------------------------

_SHORT = TurnRules(abandon_after=timedelta(seconds=2))
"""Rules under which a block reserved and not stored is passed two seconds on (which tests let
pass on the store's clocks, `clocks.wait`, rather than wait for)."""


async def _asked_and_died(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> PendingCall:
    """A streamed turn asking `confirm-9` about `tc-9` reserves its block (listing both
    pending), and its insert is lost: its process died, it is never retried. Returns the call
    as `pending_calls` serves it then."""

    async def lost(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the turn reserved and has not inserted")

    monkeypatch.setattr(runtime.logger._messages, "insert_many", lost)
    with pytest.raises(ConnectionError):
        await runtime.stream(ASKS_TO_BOOK, prompt="Book me the 09:04 to Lyon.")
    monkeypatch.undo()
    (listed,) = await runtime.store.pending_calls(CID)
    assert await pending_state(runtime.store) == (["tc-9"], "confirm-9")
    return listed


async def _person_denies(runtime: Runtime, listed: PendingCall) -> LoggedTurn:
    """The person's denial of `listed`, naming the message that made it as served."""
    denied = {"role": "tool", "tool_call_id": "tc-9", "content": None,
              "error": {"message": "tool call denied"}}  # fmt: skip
    return await runtime.logger.log_messages(
        CID, [denied], turn_id="her-denial", answers_to={"tc-9": listed.message_id}
    )


async def test_a_dead_turns_call_and_prompt_are_pending_no_more_once_its_block_is_passed(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks
) -> None:
    """RELIABILITY.md, "A writer that died before its insert": once its block is passed
    (`abandon_after`), the next turn folds the pending state from the stored messages, which
    hold neither the call nor the prompt. An answer naming the message that would have made
    the call is told to come again while the block is watched (a day: the turn may still be
    logged; `StorageUnavailable`, 503), then refused as one naming a message that makes no
    call (API.md: 422), nothing stored either way."""
    runtime = Runtime(backend, rules=_SHORT)
    listed = await _asked_and_died(runtime, monkeypatch)
    clocks.wait(_SHORT.abandon_after.total_seconds() + 0.2)

    await runtime.logger.log_messages(CID, [_user("hello?")], turn_id="later")

    assert await pending_state(runtime.store) == ([], None)
    assert await pending_state(runtime.store) == _folded(await runtime.store.transcript(CID))
    before = await runtime.store.transcript(CID)
    with pytest.raises(StorageUnavailable, match=r"'tc-9'.*not stored.*may still be logged"):
        await _person_denies(runtime, listed)
    clocks.wait(BLOCKS_WATCHED_FOR.total_seconds())
    with pytest.raises(InvalidInput, match="tc-9"):
        await _person_denies(runtime, listed)
    assert await runtime.store.transcript(CID) == before


async def test_a_turn_still_in_flight_keeps_its_call_and_prompt_pending_and_answerable(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later turn logged while the turn asking is still within `abandon_after` (its insert
    may still land) leaves its call and prompt pending, and the person's answer to the call,
    naming its message as served, is stored."""
    runtime = Runtime(backend)
    listed = await _asked_and_died(runtime, monkeypatch)

    await runtime.logger.log_messages(CID, [_user("hello?")], turn_id="later")

    assert await pending_state(runtime.store) == (["tc-9"], "confirm-9")
    await _person_denies(runtime, listed)
    assert [m.tool_call_id for m in await runtime.store.transcript(CID)][-1] == "tc-9"


async def test_a_late_retry_of_a_dead_turn_after_its_block_was_passed_makes_it_pending_again(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks
) -> None:
    """The dead turn's call and prompt, pending no more once its block was passed and a later
    turn logged, are pending again when its retry lands: moved to the end, as stored."""
    runtime = Runtime(backend, rules=_SHORT)
    await _asked_and_died(runtime, monkeypatch)
    clocks.wait(_SHORT.abandon_after.total_seconds() + 0.2)
    await runtime.logger.log_messages(CID, [_user("hello?")], turn_id="later")
    assert await pending_state(runtime.store) == ([], None)

    await log_streamed_turn(
        logger=runtime.logger,
        store=runtime.store,
        conversation_id=CID,
        turn=turn_from_metadata(ASKS_TO_BOOK, complete=True, pending=[]),
        turn_id="turn-1",
        prompt="Book me the 09:04 to Lyon.",
    )

    assert await pending_state(runtime.store) == (["tc-9"], "confirm-9")
    assert await pending_state(runtime.store) == _folded(await runtime.store.transcript(CID))


async def test_a_stalled_writer_landing_in_its_passed_block_makes_its_call_pending_again(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks
) -> None:
    """A writer stalled inside its insert past `abandon_after` (past the margin its check
    before the insert keeps) looks dead to the turn that finds its block passed and empty:
    its call is pending no more. Its insert then lands in place, and its call is pending
    again, as the stored messages say."""
    writer = AgentMessageLogger(backend.db, rules=_SHORT)
    store = ConversationStore(backend.db, rules=_SHORT)
    stall = _StalledInsert(writer, monkeypatch)
    late = await stall.start(
        writer.log_messages(CID, [_user("Book it."), _book("c2")], turn_id="tA")
    )
    clocks.wait(_SHORT.abandon_after.total_seconds() + 0.2)
    await AgentMessageLogger(backend.db, rules=_SHORT).log_messages(
        CID, [_user("hello?")], turn_id="tB"
    )
    assert await pending_state(store) == ([], None)

    stall.release()
    await late
    monkeypatch.undo()

    assert await pending_state(store) == (["c2"], None)


async def _call_turn_folded_off(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks, held: bool
) -> tuple[PendingCall, asyncio.Task[LoggedTurn] | None, _StalledInsert | None]:
    """t0 = [user, call c0] reserves its block and its insert is lost before the server (its
    writer alive, retrying later) or `held` in the network (`_call_turn_unstored`); past
    `abandon_after` another turn passes the empty block and folds c0 off `pending_calls`.
    Returns c0 as `pending_calls` served it before, and the held insert's writer with its
    stall."""
    read, late, stall = await _call_turn_unstored(backend, monkeypatch, held)
    clocks.wait(_SHORT.abandon_after.total_seconds() + 0.2)
    await AgentMessageLogger(backend.db, rules=_SHORT).log_messages(
        CID, [_user("Meanwhile."), _say("Yes?")], turn_id="t3"
    )
    assert await ConversationStore(backend.db).pending_calls(CID) == []
    return read, late, stall


async def _call_turn_unstored(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, held: bool
) -> tuple[PendingCall, asyncio.Task[LoggedTurn] | None, _StalledInsert | None]:
    """t0 = [user, call c0] reserves its block and its insert is lost before the server (its
    writer alive, retrying later) or `held` in the network. Returns c0 as `pending_calls`
    serves it, and the held insert's writer with its stall."""
    writer = AgentMessageLogger(backend.db, rules=_SHORT)
    store = ConversationStore(backend.db, rules=_SHORT)
    late: asyncio.Task[LoggedTurn] | None = None
    stall: _StalledInsert | None = None
    if held:
        stall = _StalledInsert(writer, monkeypatch)
        late = await stall.start(writer.log_messages(CID, _FOLDED_CALL_TURN, turn_id="t0"))
    else:
        with monkeypatch.context() as lost:
            lost.setattr(writer._messages, "insert_many", _lost_insert)
            with contextlib.suppress(ConnectionError):
                await writer.log_messages(CID, _FOLDED_CALL_TURN, turn_id="t0")
    (read,) = await store.pending_calls(CID)
    return read, late, stall


_FOLDED_CALL_TURN = [_user("Look it up."), _calls("c0")]


@pytest.mark.parametrize("held", [False, True], ids=["its insert lost", "its insert held"])
async def test_an_answer_to_a_call_folded_off_while_its_turn_may_land_is_sent_again(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks, held: bool
) -> None:
    """The turn making c0 is not stored: its insert lost before the server (its writer alive,
    retrying) or held in the network. Past `abandon_after` another turn folds c0 off
    `pending_calls`. An answer naming c0 as `pending_calls` served it is told to come again
    (`StorageUnavailable`: the call's turn is not stored and may still be logged), by
    `check_turn` too, nothing stored; never `InvalidInput` "a fork?" (a do-not-resend error
    whose cause is false). Once the call's turn lands (its retry moved to the end, its
    message ids kept; or its held insert), the same answer is stored."""
    logger, store = AgentMessageLogger(backend.db, rules=_SHORT), ConversationStore(backend.db)
    read, late, stall = await _call_turn_folded_off(backend, monkeypatch, clocks, held)
    before = await store.transcript(CID)
    answer: dict[str, Any] = {
        "messages": [_answer("c0", "r"), _say("Found it.")],
        "turn_id": "t2",
        "answers_to": {"c0": read.message_id},
    }

    for attempt in (logger.check_turn, logger.log_messages):
        with pytest.raises(StorageUnavailable, match=r"'c0'.*not stored.*may still be logged"):
            await attempt(CID, **answer)
    assert await store.transcript(CID) == before

    if late is not None and stall is not None:
        stall.release()
        await late
        monkeypatch.undo()
    else:
        await logger.log_messages(CID, _FOLDED_CALL_TURN, turn_id="t0")
    await logger.log_messages(CID, **answer)

    assert await store.pending_calls(CID) == []
    stored = await store.transcript(CID)
    assert [m.content for m in stored if m.tool_call_id == "c0"] == ["r"]
    assert read.message_id in {m.id for m in stored}


async def test_an_answer_naming_a_message_never_listed_stays_invalid_while_a_turn_may_land(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks
) -> None:
    """While c0's turn may still land (its block passed empty, watched), an answer naming c0
    by a message this conversation never listed (read from a fork) is still `InvalidInput`
    "does not make call", by `check_turn` too, nothing stored: only a call this conversation
    listed is waited for."""
    logger, store = AgentMessageLogger(backend.db, rules=_SHORT), ConversationStore(backend.db)
    await _call_turn_folded_off(backend, monkeypatch, clocks, held=False)
    before = await store.transcript(CID)
    elsewhere = message_id("a-fork", "t0", 1)

    for attempt in (logger.check_turn, logger.log_messages):
        with pytest.raises(InvalidInput, match="does not make call 'c0'"):
            await attempt(CID, [_answer("c0", "r")], turn_id="t2", answers_to={"c0": elsewhere})

    assert await store.transcript(CID) == before
    assert await pending_state(store) == _folded(await store.transcript(CID))


async def _land_call_turn(
    logger: AgentMessageLogger,
    monkeypatch: pytest.MonkeyPatch,
    late: asyncio.Task[LoggedTurn] | None,
    stall: _StalledInsert | None,
) -> None:
    """t0 (`_call_turn_unstored`) lands: its held insert released, else its writer's retry."""
    if late is not None and stall is not None:
        stall.release()
        await late
        monkeypatch.undo()
    else:
        await logger.log_messages(CID, _FOLDED_CALL_TURN, turn_id="t0")


@pytest.mark.parametrize("held", [False, True], ids=["its insert lost", "its insert held"])
async def test_the_answer_passing_the_block_of_its_calls_unstored_turn_waits_for_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks, held: bool
) -> None:
    """The turn making c0 is not stored (its insert lost, its writer alive; or held in the
    network), and past `abandon_after` the answer to c0, named as `pending_calls` served it,
    is the turn that passes its block: it is not stored ahead of its call, an orphan, but
    told to come again (`StorageUnavailable`), nothing stored, as is a second answer to c0
    (never the 422 "does not make call … a fork?"). Once the call's turn lands, the answer
    is stored, once."""
    logger, store = AgentMessageLogger(backend.db, rules=_SHORT), ConversationStore(backend.db)
    read, late, stall = await _call_turn_unstored(backend, monkeypatch, held)
    before = await store.transcript(CID)
    clocks.wait(_SHORT.abandon_after.total_seconds() + 0.2)
    answer: dict[str, Any] = {
        "messages": [_answer("c0", "r"), _say("Found it.")],
        "turn_id": "t2",
        "answers_to": {"c0": read.message_id},
    }
    denied = {"role": "tool", "tool_call_id": "c0", "content": None,
              "error": {"message": "tool call denied"}}  # fmt: skip

    with pytest.raises(StorageUnavailable, match=r"'c0'.*not stored.*may still be logged"):
        await logger.log_messages(CID, **answer)
    with pytest.raises(StorageUnavailable, match=r"'c0'.*not stored.*may still be logged"):
        await logger.log_messages(CID, [denied], turn_id="t4", answers_to={"c0": read.message_id})
    assert await store.transcript(CID) == before

    await _land_call_turn(logger, monkeypatch, late, stall)
    await logger.log_messages(CID, **answer)

    assert await store.pending_calls(CID) == []
    stored = await store.transcript(CID)
    assert [m.content for m in stored if m.tool_call_id == "c0"] == ["r"]
    assert [m.seq for m in stored if m.id == read.message_id] < [
        m.seq for m in stored if m.tool_call_id == "c0"
    ]


async def test_an_answer_to_a_call_another_answer_in_flight_took_off_waits_for_its_turn(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks
) -> None:
    """The turn making c0 is not stored (its insert lost, its writer alive), and an answer
    to c0 reserved within `abandon_after` took it off `pending_calls`, its own insert still
    in flight. Past `abandon_after` another turn passes c0's empty block: c0 is waited for
    as a call that turn took off would be, so an answer naming it as `pending_calls` served
    it is told to come again (`StorageUnavailable`), nothing stored, never the 422 "does
    not make call … a fork?"; once c0's turn lands, it is stored."""
    logger, store = AgentMessageLogger(backend.db, rules=_SHORT), ConversationStore(backend.db)
    read, _, _ = await _call_turn_unstored(backend, monkeypatch, held=False)
    other = AgentMessageLogger(backend.db, rules=_SHORT)
    first = partial(
        other.log_messages, CID, [_answer("c0", "first")], turn_id="tA",
        answers_to={"c0": read.message_id},
    )  # fmt: skip
    await reserved_insert_lost(other, first)  # tA reserved, its insert still in flight
    clocks.wait(_SHORT.abandon_after.total_seconds() + 0.2)
    await AgentMessageLogger(backend.db, rules=_SHORT).log_messages(
        CID, [_user("Meanwhile."), _say("Yes?")], turn_id="t3"
    )
    before = await store.transcript(CID)
    answer: dict[str, Any] = {
        "messages": [_answer("c0", "second")],
        "turn_id": "t2",
        "answers_to": {"c0": read.message_id},
    }

    with pytest.raises(StorageUnavailable, match=r"'c0'.*not stored.*may still be logged"):
        await logger.log_messages(CID, **answer)
    assert await store.transcript(CID) == before

    await logger.log_messages(CID, _FOLDED_CALL_TURN, turn_id="t0")
    await logger.log_messages(CID, **answer)
    stored = await store.transcript(CID)
    assert [m.content for m in stored if m.tool_call_id == "c0"] == ["second"]


_SAME_ANSWER_AGAIN: dict[str, Any] = {"messages": [_answer("c0", "r")], "turn_id": "tB"}


async def _answer_retried_while_its_call_turn_is_unstored(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks, held: bool
) -> tuple[dict[str, Any], asyncio.Task[LoggedTurn] | None, _StalledInsert | None]:
    """t0 making c0 is not stored (`_call_turn_unstored`); tB answering c0 reserves and
    loses its insert (its writer gets an error, retries under the same turn id) and is sent
    again past `abandon_after` of its own first attempt, t0 still unstored: told to come
    again (`StorageUnavailable`, "may still be logged"), by `check_turn` too, nothing stored
    and nothing given up (tB's retry is still tB).
    Returns tB's arguments, and t0's held insert with its stall."""
    store = ConversationStore(backend.db)
    read, late, stall = await _call_turn_unstored(backend, monkeypatch, held)
    answer = {**_SAME_ANSWER_AGAIN, "answers_to": {"c0": read.message_id}}
    first = AgentMessageLogger(backend.db, rules=_SHORT)
    await reserved_insert_lost(first, partial(first.log_messages, CID, **answer))
    before = await store.transcript(CID)
    clocks.wait(_SHORT.abandon_after.total_seconds() + 0.2)
    retry = AgentMessageLogger(backend.db, rules=_SHORT)
    for attempt in (retry.log_messages, retry.check_turn):
        with pytest.raises(StorageUnavailable, match=r"'c0'.*not stored.*may still be logged"):
            await attempt(CID, **answer)
    assert await store.transcript(CID) == before
    recorded = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert [bool(r.get("g")) for r in recorded["turns"]] == [False, False]  # nothing given up
    return answer, late, stall


@pytest.mark.parametrize("held", [False, True], ids=["its insert lost", "its insert held"])
async def test_a_retry_of_an_answer_whose_calls_turn_is_unstored_waits_for_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks, held: bool
) -> None:
    """RELIABILITY.md ("A writer that died before its insert"): tB answers c0 while c0's turn
    t0 is still being written, and both inserts are lost. tB's retry past `abandon_after`,
    t0 still unstored, gets what tB's first attempt would: `StorageUnavailable`, nothing
    stored (was: the 422 "does not make call … a fork?", which a runtime obeys by dropping
    the answer). Once t0 lands, tB's retry is stored, c0 answered once, nothing pending."""
    logger, store = AgentMessageLogger(backend.db, rules=_SHORT), ConversationStore(backend.db)
    answer, late, stall = await _answer_retried_while_its_call_turn_is_unstored(
        backend, monkeypatch, clocks, held
    )

    await _land_call_turn(logger, monkeypatch, late, stall)
    logged = await logger.log_messages(CID, **answer)
    again = await logger.log_messages(CID, **answer)

    assert again.replayed
    assert [m.id for m in again.messages] == [m.id for m in logged.messages]
    stored = await store.transcript(CID)
    assert [m.content for m in stored if m.tool_call_id == "c0"] == ["r"]
    assert await store.pending_calls(CID) == []
    assert await pending_state(store) == await recomputed_state(store) == ([], None)


async def test_a_posted_retry_of_an_answer_whose_calls_turn_is_unstored_is_a_503_then_stored(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks
) -> None:
    """The same over HTTP (the service's `abandon_after`, five minutes, passed too): tB's
    retry is 503 "may still be logged" (was: 422, "do not resend"), nothing stored; posted
    again once c0's turn landed, stored (200, a retry of a turn an earlier attempt
    reserved), c0 answered once."""
    logger, store = AgentMessageLogger(backend.db, rules=_SHORT), ConversationStore(backend.db)
    answer, late, stall = await _answer_retried_while_its_call_turn_is_unstored(
        backend, monkeypatch, clocks, held=True
    )
    clocks.wait(TurnRules().abandon_after.total_seconds() + 1)
    before = await store.transcript(CID)
    async with serve(backend.db, seeded=False) as api:
        url, headers = f"/v1/conversations/{CID}/turns", auth_headers()
        refused = await api.http.post(url, json=answer, headers=headers)
        assert await store.transcript(CID) == before
        await _land_call_turn(logger, monkeypatch, late, stall)
        stored = await api.http.post(url, json=answer, headers=headers)

    assert (refused.status_code, stored.status_code) == (503, 200)  # 200: the turn's retry
    assert stored.json()["replayed"] is True
    assert "may still be logged" in refused.json()["error"]["message"]
    assert [m.content for m in await store.transcript(CID) if m.tool_call_id == "c0"] == ["r"]
    assert await store.pending_calls(CID) == []


@pytest.mark.parametrize("then", ["popped", "a day passed"])
async def test_a_retry_of_an_answer_whose_calls_turn_never_lands_is_refused_in_the_end(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks, then: str
) -> None:
    """The guard of the wait above: once c0's turn can no longer land where it reserved (it
    landed and pops took it off; or a day passed since its block was reserved, it never
    landing), an answer naming c0, tB's retry as a new turn, is refused as naming a message
    that makes no call (422), as an answer naming a call no message makes is."""
    logger = AgentMessageLogger(backend.db, rules=_SHORT)
    store = ConversationStore(backend.db, rules=_SHORT)
    answer, late, stall = await _answer_retried_while_its_call_turn_is_unstored(
        backend, monkeypatch, clocks, held=then == "popped"
    )
    if then == "popped":
        await _land_call_turn(logger, monkeypatch, late, stall)
        while await store.transcript(CID):
            await store.pop_last_message(CID)
    else:
        clocks.wait(BLOCKS_WATCHED_FOR.total_seconds() + 10)
    before = await store.transcript(CID)

    for turn_id in ("tC", "tB"):
        with pytest.raises(InvalidInput, match="does not make call 'c0'"):
            await logger.log_messages(CID, **{**answer, "turn_id": turn_id})
    assert await store.transcript(CID) == before


async def _answer_c0(backend: Backend, turn_id: str, made_by: str) -> str:
    """What logging an answer to c0 (named as `pending_calls` served it) comes to."""
    logger = AgentMessageLogger(backend.db, rules=_SHORT)
    answer = [_answer("c0", turn_id)]
    try:
        await logger.log_messages(CID, answer, turn_id=turn_id, answers_to={"c0": made_by})
    except StoreError as refused:
        return type(refused).__name__
    return "stored"


async def test_a_call_taken_off_by_an_answer_that_died_is_waited_for_a_day_at_most(
    backend: Backend, clocks: StoreClocks
) -> None:
    """RELIABILITY.md ("A writer that died before its insert"): c0's turn and the answer that
    took c0 off the list both lost their inserts, their writers dead, and every later turn
    is an answer to c0, refused before it reserves, so no turn passes c0's block to watch
    it. An answer naming c0 is told to come again while c0's turn may land, and is refused
    as naming a message that makes no call a day after the block was reserved (was: 503
    for good, a month later too)."""
    store = ConversationStore(backend.db, rules=_SHORT)
    t0 = AgentMessageLogger(backend.db, rules=_SHORT)
    made = [_user("Look it up."), _calls("c0")]
    await reserved_insert_lost(t0, partial(t0.log_messages, CID, made, turn_id="t0"))
    (read,) = await store.pending_calls(CID)
    ta = AgentMessageLogger(backend.db, rules=_SHORT)
    first = partial(
        ta.log_messages, CID, [_answer("c0", "first")], turn_id="tA",
        answers_to={"c0": read.message_id},
    )  # fmt: skip
    await reserved_insert_lost(ta, first)
    clocks.wait(_SHORT.abandon_after.total_seconds() + 0.2)
    assert await _answer_c0(backend, "tB", read.message_id) == "StorageUnavailable"

    clocks.wait(BLOCKS_WATCHED_FOR.total_seconds() + 10)

    assert await _answer_c0(backend, "tC", read.message_id) == "InvalidInput"


@pytest.mark.parametrize(("pops", "then"), [(1, "stored"), (3, "InvalidInput")])
async def test_an_answer_to_a_call_whose_turn_was_popped_is_never_waited_for(
    backend: Backend, clocks: StoreClocks, pops: int, then: str
) -> None:
    """RELIABILITY.md (pops): t0's call c0 answered by tA, which recorded c0 on t0's block
    (`t`). With tA's answer popped, an answer to c0 is stored; with c0's turn popped too, an
    answer naming its message is `InvalidInput` ("does not make call"), now and a month
    later: a popped turn is never logged there again, nothing to wait for (was: 503 "may
    still be logged", for good)."""
    store, logger = ConversationStore(backend.db), AgentMessageLogger(backend.db, rules=_SHORT)
    await logger.log_messages(CID, [_user("Look it up."), _calls("c0")], turn_id="t0")
    (read,) = await store.pending_calls(CID)
    answer = [_answer("c0", "first")]
    await logger.log_messages(CID, answer, turn_id="tA", answers_to={"c0": read.message_id})
    for _ in range(pops):
        await store.pop_last_message(CID)

    assert await _answer_c0(backend, "tB", read.message_id) == then
    if then != "stored":
        clocks.wait(BLOCKS_WATCHED_FOR.total_seconds() * 30)
        assert await _answer_c0(backend, "tC", read.message_id) == then


async def test_a_call_being_answered_is_never_listed_again(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks
) -> None:
    """A stalled writer's call, off `pending_calls` once its block was passed as dead, is not
    put back when its insert lands while an answer to it, sent without `answers_to`, is
    still being written: that answer is not there to fold, so the call stays off the list
    (the documented window), never listed for a second answer. A call's first answer is
    its answer."""
    writer = AgentMessageLogger(backend.db, rules=_SHORT)
    store = ConversationStore(backend.db, rules=_SHORT)
    stall = _StalledInsert(writer, monkeypatch)
    late = await stall.start(
        writer.log_messages(CID, [_user("Book it."), _book("c2")], turn_id="tA")
    )
    clocks.wait(_SHORT.abandon_after.total_seconds() + 0.2)
    other = AgentMessageLogger(backend.db, rules=_SHORT)
    await other.log_messages(CID, [_user("hello?")], turn_id="tB")
    answer = partial(other.log_messages, CID, [_answer("c2", "first")], turn_id="tR")
    await reserved_insert_lost(other, answer)  # tR reserved, still being written

    stall.release()
    await late
    monkeypatch.undo()

    assert "c2" not in [c.tool_call_id for c in await store.pending_calls(CID)]
    await answer()
    answers = [m.content for m in await store.transcript(CID) if m.tool_call_id == "c2"]
    assert answers == ["first"]


async def test_a_stalled_writer_landing_takes_the_calls_it_answered_off_the_list(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks
) -> None:
    """A writer answering a call, stalled inside its insert past `abandon_after`, looks dead
    to the turn that finds its block passed and empty: the call it answered is listed
    again. When its insert lands while another turn is still being written (the fold
    waits), the call its stored answer answers goes off `pending_calls` before it is
    acknowledged: a call's first answer is its answer, and no second one is stored."""
    writer = AgentMessageLogger(backend.db, rules=_SHORT)
    store = ConversationStore(backend.db, rules=_SHORT)
    await writer.log_messages(CID, [_user("Search."), _book("c1", "search")], turn_id="t0")
    (c1,) = await store.pending_calls(CID)
    stall = _StalledInsert(writer, monkeypatch)
    late = await stall.start(
        writer.log_messages(
            CID,
            [_answer("c1", "found"), _book("c2")],
            turn_id="tA",
            answers_to={"c1": c1.message_id},
        )
    )
    clocks.wait(_SHORT.abandon_after.total_seconds() + 0.2)
    other = AgentMessageLogger(backend.db, rules=_SHORT)
    await other.log_messages(CID, [_user("hello?")], turn_id="tB")
    assert await pending_state(store) == (["c1"], None)
    await reserved_insert_lost(other, partial(other.log_messages, CID, [_say("...")], turn_id="tC"))

    stall.release()
    await late
    monkeypatch.undo()

    assert "c1" not in [c.tool_call_id for c in await store.pending_calls(CID)]
    with contextlib.suppress(StoreError):  # refused, never stored
        await other.log_messages(
            CID, [_answer("c1", "again")], turn_id="tR2", answers_to={"c1": c1.message_id}
        )
    answers = [m.content for m in await store.transcript(CID) if m.tool_call_id == "c1"]
    assert answers == ["found"]


class _ReservedADayAgo:
    """The clocks a writer reads as it reserves its block and checks it before its insert
    (`time.monotonic()`, `utc_now()` in the logger), a day behind until `caught_up()`: its
    block is recorded a day old (passed for every turn reserving later) and its insert lands
    a day after its reservation, as a writer stalled that long, with no wait against a
    timeout."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.behind = timedelta(days=1)
        clock, now = _logger_module.time, _logger_module.utc_now
        skewed = self

        class _Clock:
            @staticmethod
            def monotonic() -> float:
                return clock.monotonic() - skewed.behind.total_seconds()

        monkeypatch.setattr(_logger_module, "time", _Clock)
        monkeypatch.setattr(_logger_module, "utc_now", lambda: now() - skewed.behind)

    def caught_up(self) -> None:
        self.behind = timedelta(0)


async def _answer_landing_after_its_block_was_passed(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    answer: dict[str, Any],
    asked: list[dict[str, Any]],
    before_landing: Callable[[AgentMessageLogger], Awaitable[Any]] | None = None,
) -> tuple[AgentMessageLogger, ConversationStore, str]:
    """t0 makes c1 (and c3) and asks r1 about them (`asked`); tA gives `answer` to c1 (named
    by `answers_to`) and makes c2, reserving a day ago, its insert stalled since; tB finds
    tA's block passed and empty and folds the pending state: c1 and r1 pending again.
    tC reserves and loses its insert (still being written: the fold waits on it), then
    `before_landing` runs, then tA's insert lands, later than its `abandon_after`. Every
    logger has the default rules. Returns one, the store, and the id of the message making
    c1."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    logged = await logger.log_messages(CID, [_user("Book it."), *asked], turn_id="t0")
    made_by = logged.messages[1].id
    writer = AgentMessageLogger(backend.db)
    stall, clock = _StalledInsert(writer, monkeypatch), _ReservedADayAgo(monkeypatch)
    late = await stall.start(
        writer.log_messages(CID, [answer, _book("c2")], turn_id="tA", answers_to={"c1": made_by})
    )
    clock.caught_up()  # tA's insert is sent, and stalls
    await logger.log_messages(CID, [_user("hello?")], turn_id="tB")
    assert (await pending_state(store))[1] == "r1"
    assert "c1" in [c.tool_call_id for c in await store.pending_calls(CID)]
    await reserved_insert_lost(
        logger, partial(logger.log_messages, CID, [_say("...")], turn_id="tC")
    )
    if before_landing is not None:
        await before_landing(logger)

    stall.release()
    await late
    monkeypatch.undo()
    return logger, store, made_by


@pytest.mark.parametrize(
    "answer", [_answer("c1", "found"), _denial_of("c1")], ids=["result", "denial"]
)
async def test_a_stalled_writer_landing_clears_the_prompt_its_answers_clear(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, answer: dict[str, Any]
) -> None:
    """A writer answering (or denying) the call a prompt holds, stalled inside its insert past
    `abandon_after`, looks dead to the turn that finds its block passed and empty: the call
    and its prompt are pending again. When its insert lands while another turn is still
    being written (the fold owed), its answer clears the prompt as it did when the turn was
    logged (the same rule), before it is acknowledged: the prompt is not listed, no person
    answers it again (Conflict, nothing approved) and no second answer is stored. The owed
    fold, once the turn being written lands, lists what the stored messages say: the prompt
    is not listed again."""
    logger, store, made_by = await _answer_landing_after_its_block_was_passed(
        backend, monkeypatch, answer, [_calls("c1"), _asks_about("r1", "c1")]
    )

    assert await pending_state(store) == ([], None)
    with pytest.raises(Conflict):
        await store.resolve_hitl(CID, "r1")
    with contextlib.suppress(StoreError):  # refused, never stored
        await logger.log_messages(
            CID, [_answer("c1", "again")], turn_id="tR", answers_to={"c1": made_by}
        )
    answers = [m.content for m in await store.transcript(CID) if m.tool_call_id == "c1"]
    assert answers == [answer["content"]]
    assert await _approved_calls(backend) == []
    await logger.log_messages(CID, [_say("...")], turn_id="tC")  # lands: nothing being written
    await logger.log_messages(CID, [_user("still there?")], turn_id="tD")  # folds what is owed
    assert await pending_state(store) == (["c2"], None)
    assert await pending_state(store) == _folded(await store.transcript(CID))
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert doc.get("refold_owed") is None
    with pytest.raises(Conflict):
        await store.resolve_hitl(CID, "r1")
    assert await _approved_calls(backend) == []


_ASKED_LATER = {
    "none": None,
    "own-call": [_calls("c5"), _asks_about("r5", "c5")],
    "naming-c1": [_asks_about("r5", "c1")],
}
"""What a later turn, logged before the stalled writer lands (stored past its block), asks."""


@pytest.mark.parametrize("asked_later", list(_ASKED_LATER))
async def test_a_stalled_writer_landing_lists_the_prompt_the_stored_messages_leave(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, asked_later: str
) -> None:
    """The landed writer's answer to c1 takes c1 off and clears r1, which held it (and c3,
    which stays pending): as when the turn was logged, and as the fold of the stored
    messages says. A later turn's prompt r5, raised before the writer landed (stored past
    its block), holding its own call or naming c1, is not the answer's to clear: asked
    after it, it stays pending. Only the writer's own call c2 is not listed yet (the owed
    fold lists it)."""
    later = _ASKED_LATER[asked_later]

    async def asks_r5(logger: AgentMessageLogger) -> None:
        await logger.log_messages(CID, later or [], turn_id="tE")

    asked = [_calls("c1", "c3"), _asks_about("r1", "c1", "c3")]
    _, store, _ = await _answer_landing_after_its_block_was_passed(
        backend, monkeypatch, _answer("c1", "found"), asked, asks_r5 if later else None
    )

    held = [(c.tool_call_id, c.request_id) for c in await store.pending_calls(CID)]
    folded_calls, folded_prompt = await folded_state(store)
    assert held == [c for c in folded_calls if c[0] != "c2"]
    assert (await pending_state(store))[1] == folded_prompt == (later and "r5")


async def test_a_prompt_a_person_answered_before_the_stalled_writer_landed_stays_answered(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An HTTP resolution of r1, pending again once the stalled writer's block was passed,
    racing the writer's landing (resolved before it lands): the landing takes c1 off and
    lists no prompt; r1 stays resolved, and answering it again writes nothing new."""

    async def resolves_r1(logger: AgentMessageLogger) -> None:
        await ConversationStore(backend.db).resolve_hitl(CID, "r1")

    _, store, _ = await _answer_landing_after_its_block_was_passed(
        backend,
        monkeypatch,
        _answer("c1", "found"),
        [_calls("c1"), _asks_about("r1", "c1")],
        resolves_r1,
    )

    assert await pending_state(store) == ([], None)
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert doc["resolved_hitl"] == ["r1"]
    await store.resolve_hitl(CID, "r1")  # its first answer is its answer: nothing written
    assert await pending_state(store) == ([], None)


async def _fails_with(error: BaseException, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The logger module's `name` (a storage step of the landing) raises `error` once, as a
    dropped connection (StorageUnavailable: send again) or a writer dying there
    (CancelledError: its process gone, its caller's timeout)."""
    step = getattr(_logger_module, name)
    calls = iter(range(1))

    async def once(*args: Any, **kwargs: Any) -> Any:
        if next(calls, None) is not None:
            raise error
        return await step(*args, **kwargs)

    monkeypatch.setattr(_logger_module, name, once)


_LANDING_CUT = {
    "take-off-dropped": (StorageUnavailable("the database is unreachable"), "take_answered_off"),
    "died-before-take-off": (asyncio.CancelledError(), "take_answered_off"),
    "died-before-fold": (asyncio.CancelledError(), "settle"),
}
"""Where a stalled writer's landing is cut, after its insert: its take-off of the calls it
answered (its command dropped, or the writer dying there), or its fold (dying there)."""


class _CallsCounted:
    """A fake of a collection at the edge: counts the calls made to it (each a command)."""

    def __init__(self, real: Any, calls: list[str]) -> None:
        self._real, self._calls = real, calls

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._real, name)
        if not callable(found) or name.startswith("_") or name == "with_options":
            return found

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._calls.append(name)
            return found(*args, **kwargs)

        return counted


async def _replayed_unchanged(
    backend: Backend, cid: str, turn: list[dict[str, Any]], answers_to: dict[str, str]
) -> list[str]:
    """`turn` sent again as `tA` through a new logger counting its commands: a replay that
    changes nothing of the conversation document; the commands it sent."""
    before = await backend.db[CONVERSATIONS].find_one({"_id": cid})
    replayer, calls = AgentMessageLogger(backend.db), list[str]()
    replayer._messages = _CallsCounted(replayer._messages, calls)
    replayer._conversations = _CallsCounted(replayer._conversations, calls)
    again = await replayer.log_messages(cid, turn, turn_id="tA", answers_to=answers_to)
    assert again.replayed
    assert await backend.db[CONVERSATIONS].find_one({"_id": cid}) == before
    return calls


async def test_a_resend_whose_answered_call_id_a_later_call_reuses_reads_and_writes_nothing(
    backend: Backend,
) -> None:
    """A resend of a stored turn is a replay: it reads what a replay reads and writes
    nothing. A later call reusing the id of the call the turn answered is another call,
    which the turn could not have answered (made after its block), so its listing is no sign
    of the turn's first attempt cut before taking its answers off: the replay reads as much
    as one of a conversation whose later call has another id, the same commands (was: it
    folded the whole conversation, reading every message, and held again approvals its
    prompts asked about)."""

    async def replay_calls(cid: str, later_call: str) -> list[str]:
        logger = AgentMessageLogger(backend.db)
        made = await logger.log_messages(cid, [_user("Go."), _calls("c1")], turn_id="t0")
        turn, answers_to = [_answer("c1", "found")], {"c1": made.messages[1].id}
        await logger.log_messages(cid, turn, turn_id="tA", answers_to=answers_to)
        for n in range(3):
            step = [_user(f"u{n}"), _calls(f"k{n}"), _answer(f"k{n}")]
            await logger.log_messages(cid, step, turn_id=f"t-{n}")
        await logger.log_messages(cid, [_user("again"), _calls(later_call)], turn_id="tE")
        return await _replayed_unchanged(backend, cid, turn, answers_to)

    assert await replay_calls(f"{CID}-reused", "c1") == await replay_calls(CID, "c7")


@pytest.mark.parametrize("cut", list(_LANDING_CUT))
async def test_a_stalled_writer_landing_is_acknowledged_only_with_its_answers_taken_off(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """RELIABILITY.md: the calls a landed stalled writer's stored messages answer, listed again
    by the fold that passed its block, go off `pending_calls` before it is acknowledged;
    every acknowledgement, a replay's too. tA answers c1 and makes c2; its block is passed
    and c1 listed again (tB), tC is still being written (the fold waits), then tA lands and
    its writer is cut before its answers are taken off (`_LANDING_CUT`). Sent again, tA is
    a replay, acknowledged with c1 off the list: a second answer to c1 is refused, never
    stored. Once tC lands, the owed fold lists what the stored messages say."""
    error, step = _LANDING_CUT[cut]
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    made = await logger.log_messages(CID, [_user("Search."), _book("c1", "search")], turn_id="t0")
    made_by = made.messages[1].id
    tA = partial(
        AgentMessageLogger(backend.db).log_messages,
        CID,
        [_answer("c1", "found"), _book("c2")],
        turn_id="tA",
        answers_to={"c1": made_by},
    )
    writer = AgentMessageLogger(backend.db)
    stall, clock = _StalledInsert(writer, monkeypatch), _ReservedADayAgo(monkeypatch)
    late = await stall.start(
        writer.log_messages(
            CID, [_answer("c1", "found"), _book("c2")], turn_id="tA", answers_to={"c1": made_by}
        )
    )
    clock.caught_up()  # tA's insert is sent, and stalls
    await logger.log_messages(CID, [_user("hello?")], turn_id="tB")
    assert "c1" in [c.tool_call_id for c in await store.pending_calls(CID)]
    await reserved_insert_lost(
        logger, partial(logger.log_messages, CID, [_say("...")], turn_id="tC")
    )
    await _fails_with(error, monkeypatch, step)

    stall.release()
    with pytest.raises(type(error)):
        await late
    monkeypatch.undo()
    again = await tA()

    assert again.replayed
    assert "c1" not in [c.tool_call_id for c in await store.pending_calls(CID)]
    with contextlib.suppress(StoreError):  # refused, never stored
        await logger.log_messages(
            CID, [_answer("c1", "again")], turn_id="tR", answers_to={"c1": made_by}
        )
    answers = [m.content for m in await store.transcript(CID) if m.tool_call_id == "c1"]
    assert answers == ["found"]
    await logger.log_messages(CID, [_say("...")], turn_id="tC")  # lands: nothing being written
    await logger.log_messages(CID, [_user("still there?")], turn_id="tD")  # folds what is owed
    assert await pending_state(store) == (["c2"], None)
    assert await pending_state(store) == _folded(await store.transcript(CID))


async def _answered_then_listed_again(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, asked: list[dict[str, Any]], cut: str | None
) -> tuple[AgentMessageLogger, ConversationStore, str]:
    """t0 makes c1 (and asks `asked`); tA answers c1 (naming it) and makes c2, reserving a day
    ago; tB finds its block passed and empty: c1 listed again; tC is still being written.
    With `cut` (`_LANDING_CUT`), tA's writer stalled inside its insert, which then lands,
    and is cut right there, never sent again; without, tA's insert was lost (nothing of it
    stored). Every logger has the default rules. Returns one, the store, and the id of the
    message making c1."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    made = await logger.log_messages(
        CID, [_user("Search."), _book("c1", "search"), *asked], turn_id="t0"
    )
    made_by = made.messages[1].id
    writer = AgentMessageLogger(backend.db)
    tA = [_answer("c1", "found"), _book("c2")]
    clock = _ReservedADayAgo(monkeypatch)
    if cut is None:
        await reserved_insert_lost(
            writer, partial(writer.log_messages, CID, tA, turn_id="tA", answers_to={"c1": made_by})
        )
        clock.caught_up()
    else:
        stall = _StalledInsert(writer, monkeypatch)
        late = await stall.start(
            writer.log_messages(CID, tA, turn_id="tA", answers_to={"c1": made_by})
        )
        clock.caught_up()  # tA's insert is sent, and stalls
    await logger.log_messages(CID, [_user("hello?")], turn_id="tB")
    assert "c1" in [c.tool_call_id for c in await store.pending_calls(CID)]
    await reserved_insert_lost(
        logger, partial(logger.log_messages, CID, [_say("...")], turn_id="tC")
    )
    if cut is not None:
        error, step = _LANDING_CUT[cut]
        await _fails_with(error, monkeypatch, step)
        stall.release()
        with pytest.raises(type(error)):
            await late
    monkeypatch.undo()
    return logger, store, made_by


async def _answers_to_c1(backend: Backend) -> list[Any]:
    store = ConversationStore(backend.db)
    return [m.content for m in await store.transcript(CID) if m.tool_call_id == "c1"]


_SECOND_ANSWER = ["answers_to", "check_turn", "streamed"]
"""How a second client answers c1: a turn naming it (`answers_to`), `check_turn` first, or a
streamed turn carrying its result (`log_streamed_turn`, which checks it first)."""


@pytest.mark.parametrize("route", _SECOND_ANSWER)
@pytest.mark.parametrize("cut", list(_LANDING_CUT))
async def test_a_call_listed_again_whose_answer_landed_takes_no_second_answer(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, cut: str, route: str
) -> None:
    """RELIABILITY.md: c1 is listed again only because the block that answered it (tA's) was
    passed as abandoned; tA's stalled insert then lands and its writer is cut right there
    (`_LANDING_CUT`), never sent again: no fold is owed for it, nothing takes c1 off. A
    second client's answer to c1 (a turn naming it, `check_turn` and a streamed turn alike)
    looks whether an answer landed (the fold marked c1 as listed again): `AnsweredBefore`,
    nothing stored, c1 taken off the list, and the fold tA's writer did not write owed (tC
    is being written): once tC lands it lists tA's own call c2. While a fold is owed (tA's writer
    reached it, a look owed it, or a read of the summary found tA's messages in the block the
    fold passing it watches), the turn is `Unreserved` (send it again), as before, then
    `AnsweredBefore`. tA sent again afterwards is a replay, c1 answered once."""
    logger, store, made_by = await _answered_then_listed_again(backend, monkeypatch, [], cut)
    second = [_answer("c1", "again")]
    # Its writer reached its fold, or this read of the summary found tA's messages in the
    # block the fold watches (`pending_blocks`): the fold is owed while tC is written.
    streamed = turn_from_metadata(
        [{"type": "tool_end", "tool_name": "search", "tool_call_id": "c1", "result": "again"}],
        complete=True,
        pending=await store.pending_calls(CID),
    )

    async def answer_again() -> Any:
        if route == "streamed":
            return await log_streamed_turn(
                logger=logger, store=store, conversation_id=CID, turn=streamed, turn_id="tR"
            )
        return await logger.log_messages(CID, second, turn_id="tR", answers_to={"c1": made_by})

    if route == "check_turn":
        with pytest.raises(AnsweredBefore):
            await logger.check_turn(CID, second, turn_id="tR", answers_to={"c1": made_by})
    with pytest.raises(Unreserved):
        await answer_again()  # send it again

    assert await _answers_to_c1(backend) == ["found"]
    if route != "check_turn":  # the owed fold, once tC lands, takes c1 off
        assert "c1" in [c.tool_call_id for c in await store.pending_calls(CID)]
        await logger.log_messages(CID, [_say("...")], turn_id="tC")
        with pytest.raises(AnsweredBefore):
            await answer_again()
    assert "c1" not in [c.tool_call_id for c in await store.pending_calls(CID)]
    again = await AgentMessageLogger(backend.db).log_messages(
        CID,
        [_answer("c1", "found"), _book("c2")],
        turn_id="tA",
        answers_to={"c1": made_by},
    )
    assert again.replayed
    assert await _answers_to_c1(backend) == ["found"]
    await logger.log_messages(CID, [_say("...")], turn_id="tC")  # lands: nothing being written
    await logger.log_messages(CID, [_user("still there?")], turn_id="tD")
    assert await pending_state(store) == (["c2"], None)
    assert await pending_state(store) == _folded(await store.transcript(CID))


@pytest.mark.parametrize("cut", list(_LANDING_CUT))
async def test_a_prompt_holding_a_call_listed_again_whose_answer_landed_is_answered_no_more(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """The same over a person's answer: r1 holds c1; tA's answer to c1 lands after its block
    was passed (r1 and c1 pending again) and its writer is cut there, never sent again. Her
    answer to r1 looks whether an answer to the calls r1 holds landed: one did, so c1 goes
    off the list with the prompt its answer clears, as the landing's take-off would, and her
    answer is refused as one to a prompt no longer pending (Conflict): nothing approved."""
    _, store, _ = await _answered_then_listed_again(
        backend, monkeypatch, [_asks_about("r1", "c1")], cut
    )
    assert (await pending_state(store))[1] == "r1"

    with pytest.raises(Conflict):
        await store.resolve_hitl(CID, "r1")

    assert await _approved_calls(backend) == []
    assert "c1" not in [c.tool_call_id for c in await store.pending_calls(CID)]
    assert (await pending_state(store))[1] is None
    assert await _answers_to_c1(backend) == ["found"]


async def test_a_call_listed_again_whose_answer_never_landed_takes_the_second_answer(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look finds nothing when tA's insert was really lost: c1, listed again, takes the
    second client's answer (`check_turn` passes it), stored once; tA's late retry is then
    judged where it would land (once tC landed), `AnsweredBefore`, nothing of it stored."""
    logger, store, made_by = await _answered_then_listed_again(backend, monkeypatch, [], None)
    second = [_answer("c1", "again")]

    await logger.check_turn(CID, second, turn_id="tR", answers_to={"c1": made_by})
    logged = await logger.log_messages(CID, second, turn_id="tR", answers_to={"c1": made_by})

    assert not logged.replayed
    assert await _answers_to_c1(backend) == ["again"]
    assert "c1" not in [c.tool_call_id for c in await store.pending_calls(CID)]
    await logger.log_messages(CID, [_say("...")], turn_id="tC")  # lands: nothing being written
    with pytest.raises(AnsweredBefore):
        await AgentMessageLogger(backend.db).log_messages(
            CID, [_answer("c1", "found"), _book("c2")], turn_id="tA", answers_to={"c1": made_by}
        )
    assert await _answers_to_c1(backend) == ["again"]


async def test_a_prompt_holding_a_call_listed_again_whose_answer_never_landed_is_answered(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Her answer to r1, holding c1 listed again while tA's insert was really lost, is
    recorded as with no stall: c1 approved, r1 resolved."""
    _, store, _ = await _answered_then_listed_again(
        backend, monkeypatch, [_asks_about("r1", "c1")], None
    )

    await store.resolve_hitl(CID, "r1")

    assert await _approved_calls(backend) == ["c1"]
    assert (await pending_state(store))[1] is None


async def _own_call_landed(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, cut: str | None
) -> tuple[AgentMessageLogger, ConversationStore]:
    """t0 makes c1; tA answers c1 (naming it) and makes c2 in its own block, reserving a day
    ago, its insert stalled; tB finds tA's block passed and empty (c1 listed again, c2 not
    listed). tA's insert then lands: with no `cut`, its writer alive, finishing its fold;
    else cut right there while tC is being written (`_answered_then_listed_again`), a
    second answer to c1 refused (its look owes or writes the fold) and tC landing. tD
    follows. Returns a logger and the store."""
    if cut is not None:
        logger, store, made_by = await _answered_then_listed_again(backend, monkeypatch, [], cut)
        with contextlib.suppress(Unreserved, AnsweredBefore):
            await logger.log_messages(
                CID, [_answer("c1", "again")], turn_id="tR", answers_to={"c1": made_by}
            )
        await logger.log_messages(CID, [_say("...")], turn_id="tC")  # lands: the fold owed
    else:
        logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
        made = await logger.log_messages(
            CID, [_user("Search."), _book("c1", "search")], turn_id="t0"
        )
        writer = AgentMessageLogger(backend.db)
        stall, clock = _StalledInsert(writer, monkeypatch), _ReservedADayAgo(monkeypatch)
        late = await stall.start(
            writer.log_messages(
                CID,
                [_answer("c1", "found"), _book("c2")],
                turn_id="tA",
                answers_to={"c1": made.messages[1].id},
            )
        )
        clock.caught_up()  # tA's insert is sent, and stalls
        await logger.log_messages(CID, [_user("hello?")], turn_id="tB")
        stall.release()
        await late
        monkeypatch.undo()
    await logger.log_messages(CID, [_user("still there?")], turn_id="tD")
    assert await _answers_to_c1(backend) == ["found"]
    return logger, store


async def _marked_listed_again(backend: Backend) -> list[str]:
    """The tool call ids the conversation marks listed again (`calls_relisted`)."""
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    return [mark["c"] for mark in doc.get("calls_relisted") or ()]


@pytest.mark.parametrize("cut", [None, *_LANDING_CUT])
async def test_a_stalled_writer_landing_past_its_passed_block_marks_none_of_its_own_calls(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, cut: str | None
) -> None:
    """DESIGN.md `calls_relisted`: a fold marks a call it lists again only where a turn
    answering it took it off. tA's own call c2, made in its block, went off the list when tB
    passed that block empty, no answer taking it; once tA's insert landed (its writer alive,
    or cut after it: `_LANDING_CUT`), the folds list c2 unmarked, and the first answer to
    it, naming it, costs the reservation and the insert, as with no stall (was: c2 marked,
    that answer looked first whether another had landed: 9 commands on the wire)."""
    _, store = await _own_call_landed(backend, monkeypatch, cut)
    assert await pending_state(store) == (["c2"], None)
    assert await _marked_listed_again(backend) == []
    answering = AgentMessageLogger(backend.db, rules=COUNTED)
    if backend.commands is not None:
        backend.commands.clear()

    await answering.log_messages(
        CID, [_answer("c2", "booked")], turn_id="tE", answers_to={"c2": message_id(CID, "tA", 1)}
    )

    if backend.commands is not None:
        assert backend.commands.names == ["findAndModify", "insert"]
    assert [m.content for m in await store.transcript(CID) if m.tool_call_id == "c2"] == ["booked"]
    assert await pending_state(store) == ([], None)


async def test_a_persons_answer_after_a_stalled_writers_own_call_was_answered_costs_one_update(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELIABILITY.md (the ordinary path has no command more): after tA's stalled insert
    landed past its passed block, its own call c2 is answered by a turn not naming it (no
    `answers_to`), and a later turn asks r5 about c5. Her answer to r5 is the lookup of the
    prompts of r5 stored and the one guarded update, c5 approved, no mark left to look at
    (was: c2 stayed marked until a fold, so every answer of hers read and updated again:
    `update, find, update`)."""
    logger, store = await _own_call_landed(backend, monkeypatch, None)
    await logger.log_messages(CID, [_answer("c2", "booked")], turn_id="tE")
    await logger.log_messages(CID, [_calls("c5"), _asks_about("r5", "c5")], turn_id="tG")
    if backend.commands is not None:
        backend.commands.clear()

    await store.resolve_hitl(CID, "r5")

    if backend.commands is not None:
        assert backend.commands.names == ["find", "update"]
    assert await _approved_calls(backend) == ["c5"]
    assert await _marked_listed_again(backend) == []


async def _landing_cut_before_its_fold_then_resent(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    cid: str,
    turn: list[dict[str, Any]],
    *,
    owed: bool = False,
) -> LoggedTurn:
    """In `cid`, where the turns before are logged: tA (`turn`) reserves a day ago, its insert
    stalled; tB, another process's turn, finds its block passed and empty and folds the
    pending state without it; with `owed`, tC reserves and loses its insert (the fold waits
    on it) and tE makes c5 and asks r5 about it. tA's insert lands and its writer dies
    before its fold (`_LANDING_CUT`'s "died-before-fold"); tA is sent again, and that
    acknowledgement is returned. With `owed`, tC then lands and tD folds what is owed."""
    logger = AgentMessageLogger(backend.db)
    await _landed_and_cut_before_its_fold(backend, monkeypatch, cid, turn, owed=owed)
    again = await AgentMessageLogger(backend.db).log_messages(cid, turn, turn_id="tA")
    if owed:
        await logger.log_messages(cid, [_say("...")], turn_id="tC")  # lands: nothing being written
        await logger.log_messages(cid, [_user("still there?")], turn_id="tD")  # folds what is owed
    return again


async def _landed_and_cut_before_its_fold(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    cid: str,
    turn: list[dict[str, Any]],
    *,
    owed: bool = False,
    answers_to: dict[str, str] | None = None,
) -> None:
    """In `cid`, where the turns before are logged: tA (`turn`, answering `answers_to`)
    reserves a day ago, its insert stalled; tB, another process's turn, finds its block
    passed and empty and folds the pending state without it; with `owed`, tC reserves and
    loses its insert (the fold waits on it) and tE makes c5 and asks r5 about it. tA's
    insert lands and its writer dies before its fold (`_LANDING_CUT`'s
    "died-before-fold"), never to send it again."""
    logger = AgentMessageLogger(backend.db)
    writer = AgentMessageLogger(backend.db)
    stall, clock = _StalledInsert(writer, monkeypatch), _ReservedADayAgo(monkeypatch)
    late = await stall.start(writer.log_messages(cid, turn, turn_id="tA", answers_to=answers_to))
    clock.caught_up()  # tA's insert is sent, and stalls
    await logger.log_messages(cid, [_user("hello?")], turn_id="tB")
    if owed:
        await reserved_insert_lost(
            logger, partial(logger.log_messages, cid, [_say("...")], turn_id="tC")
        )
        between = [_user("And?"), _calls("c5"), _asks_about("r5", "c5")]
        await logger.log_messages(cid, between, turn_id="tE")
    await _fails_with(asyncio.CancelledError(), monkeypatch, "settle")

    stall.release()
    with pytest.raises(asyncio.CancelledError):
        await late
    monkeypatch.undo()


async def _forked_whole(
    backend: Backend, cid: str
) -> tuple[list[tuple[str, str | None]], str | None]:
    """What a fork of every message of `cid` serves: what its stored messages leave."""
    store = ConversationStore(backend.db)
    last = (await store.transcript(cid))[-1].seq
    await AgentMessageLogger(backend.db).fork(cid, last, f"{cid}-whole")
    return await held_state(store, f"{cid}-whole")


async def test_a_replay_lists_the_pause_its_first_attempt_stored_though_its_writer_died_unfolded(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELIABILITY.md (every acknowledgement, a replay's too, holds what the stored messages
    leave): tA makes c9 and asks r9 about it, answering nothing; its writer stalls inside its
    insert past `abandon_after`, tB folds the passed, empty block (c9 and r9 unlisted), and
    tA's insert lands, its writer dying before its fold. Sent again, tA is a replay that
    lists c9 held by r9 and r9 pending, as a fork of the same messages does, and later turns
    keep them (was: a replay folded only for a call the turn answers, so the question stayed
    unlisted for good)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [_user("Pay."), _calls("c1")], turn_id="t0")
    turn = [_calls("c9"), _asks_about("r9", "c9")]

    again = await _landing_cut_before_its_fold_then_resent(backend, monkeypatch, CID, turn)

    assert again.replayed
    assert await held_state(store) == ([("c1", None), ("c9", "r9")], "r9")
    await logger.log_messages(CID, [_user("still there?")], turn_id="tD")
    assert await held_state(store) == await _forked_whole(backend, CID)


_NEVER_SENT_AGAIN = {
    "question": ([_user("Pay."), _calls("c1")], False),
    "answer-and-question": ([_user("Pay."), _calls("c1")], True),
    "nothing-else-pending": ([_user("Hi."), _say("Hello.")], False),
}
"""What t0 logs, and whether tA answers t0's c1 before it makes c9 and asks r9 about it."""


async def _never_sent_again(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, case: str
) -> AgentMessageLogger:
    """t0 (`_NEVER_SENT_AGAIN`), then tA making c9 and asking r9 about it (answering c1
    first, named, for "answer-and-question"), landed past its passed, folded block, its
    writer dead before its fold and the turn never sent again."""
    logger = AgentMessageLogger(backend.db)
    first, answers = _NEVER_SENT_AGAIN[case]
    made = await logger.log_messages(CID, first, turn_id="t0")
    turn = [_calls("c9"), _asks_about("r9", "c9")]
    answers_to = {"c1": made.messages[1].id} if answers else None
    turn = [_answer("c1", "paid"), *turn] if answers else turn
    await _landed_and_cut_before_its_fold(backend, monkeypatch, CID, turn, answers_to=answers_to)
    return logger


@pytest.mark.parametrize("case", list(_NEVER_SENT_AGAIN))
async def test_a_landing_whose_writer_died_unfolded_is_folded_by_the_next_turn(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """DESIGN.md `pending_blocks` (a block found passed and empty is watched for its late
    insert): tA makes c9 and asks r9 about it (after answering c1, in one case); its writer
    stalls inside its insert past `abandon_after`, tB folds the passed, empty block, and
    tA's insert lands, its writer dying before its fold, the turn never sent again. The
    next turn finds tA's messages in the block watched and folds them: c9 held by r9, r9
    pending and c1 off the list, as a fork of the same messages serves them, through later
    turns (was: r9 never pending and c9 never listed, c1 listed though answered, for good)."""
    logger = await _never_sent_again(backend, monkeypatch, case)
    store = ConversationStore(backend.db)

    await logger.log_messages(CID, [_user("still there?")], turn_id="tD")

    calls, prompt = await held_state(store)
    assert ("c9", "r9") in calls
    assert prompt == "r9"
    assert (calls, prompt) == await _forked_whole(backend, CID)
    await logger.log_messages(CID, [_user("and now?")], turn_id="tE")
    assert await held_state(store) == (calls, prompt)


@pytest.mark.parametrize("case", list(_NEVER_SENT_AGAIN))
async def test_a_landing_whose_writer_died_unfolded_is_served_by_the_next_read(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The same landing, no turn logged after it: the next read of the summary
    (`pending_calls`, `pending_hitl`) finds tA's messages in the block watched and folds
    them before it answers, so the person is asked r9 and c9 is held by it (was: served
    without them until a resend of tA)."""
    await _never_sent_again(backend, monkeypatch, case)
    store = ConversationStore(backend.db)

    calls, prompt = await held_state(store)

    assert ("c9", "r9") in calls
    assert prompt == "r9"
    assert (calls, prompt) == await _forked_whole(backend, CID)


@pytest.mark.parametrize("case", list(_NEVER_SENT_AGAIN))
async def test_an_answer_to_the_question_of_a_landing_whose_writer_died_unfolded_is_taken(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The same landing, no read or turn after it: the person answers r9 from the prompt
    the agent's stream showed her. The answer matching nothing, the conversation it reads
    to tell why is folded first when a block it watches holds a message, and the answer
    recorded then, as on a fork of the same messages (was: `PromptNotPending` "no pending
    prompt 'r9'" until some read of the summary folded the landing in)."""
    await _never_sent_again(backend, monkeypatch, case)
    store = ConversationStore(backend.db)

    await store.resolve_hitl(CID, "r9", call_ids=["c9"])

    calls, prompt = await held_state(store)
    assert ("c9", None) in calls
    assert prompt is None


_FOLD_TRIGGERS = ["read", "answer", "turn"]
"""What writes a fold owed (`refold_owed`): a read of the summary, an answer matching
nothing, the next turn."""
_LIVES = [("ada", "mallory"), ("mallory", "ada")]
"""Whose conversation the owed fold is of, and who starts another under its id meanwhile."""


async def _fold_raced_by_a_new_life(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    trigger: str,
    first: str,
    then: str,
    *,
    before_epochs: bool = False,
) -> ConversationStore:
    """`first`'s conversation asks r1 about c1 and is owed a fold of its pending state;
    `trigger` writes the fold, and between its read and its write `first` deletes the
    conversation and `then` starts one under its id with as many messages. `before_epochs`:
    the first conversation was stored before epochs, and every message of both carries the
    same `created_at` (a caller chooses it)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    at = {"created_at": datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)} if before_epochs else {}
    asked = [_user("Pay the rent.") | at, _calls("c1") | at, _asks_about("r1", "c1") | at]
    await logger.log_messages(CID, asked, turn_id="t0", user_id=first)
    if before_epochs:
        await backend.db.agent_conversations.update_one({"_id": CID}, {"$unset": {"epoch": ""}})
        unset = {"$unset": {"epoch": ""}}
        await backend.db.agent_messages.update_many({"conversation_id": CID}, unset)
    owed = {"$set": {"refold_owed": datetime.now(UTC)}}
    await backend.db.agent_conversations.update_one({"_id": CID}, owed)
    real, raced = _relocated._written, list[int]()

    async def deleted_and_started_again(conversations: Any, fold: Any, names: Any) -> bool:
        if not raced:
            raced.append(count := int(fold.conversation["message_count"]))
            await store.delete(CID, user_id=first)
            mine = [_user(f"mine {i}") | at for i in range(count)]
            await logger.log_messages(CID, mine, turn_id="m0", user_id=then)
        return await real(conversations, fold, names)

    monkeypatch.setattr(_relocated, "_written", deleted_and_started_again)
    with contextlib.suppress(StoreError):
        if trigger == "read":
            await store.get_conversation(CID, user_id=first)
        elif trigger == "answer":
            await store.resolve_hitl(CID, "r-none", user_id=first)
        else:
            await logger.log_messages(CID, [_user("next")], turn_id="t1", user_id=first)
    monkeypatch.undo()
    assert raced
    return store


@pytest.mark.parametrize(("first", "then"), _LIVES)
@pytest.mark.parametrize("trigger", _FOLD_TRIGGERS)
async def test_a_fold_owed_never_lands_on_a_conversation_started_again_under_its_id(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, trigger: str, first: str, then: str
) -> None:
    """RELIABILITY.md (deleted and created again under its id by anyone: none of it shows in
    the new conversation): a fold of the pending state, written by a read, an answer
    matching nothing or the next turn, matches only the life it read its messages under
    (`epoch`). Deleted and started again by another user between the fold's read and its
    write, with as many messages, the new conversation asks nothing and holds no call, in
    either direction (was: it served the earlier user's prompt r1 and held call c1)."""
    store = await _fold_raced_by_a_new_life(backend, monkeypatch, trigger, first, then)

    assert await held_state_of(store, then) == ([], None)
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert doc["user_id"] == then
    assert not doc.get("pending_calls")
    assert doc.get("pending_hitl") is None
    assert not doc.get("resolved_hitl")
    assert not doc.get("pending_blocks")


@pytest.mark.parametrize("trigger", _FOLD_TRIGGERS)
async def test_a_fold_owed_before_epochs_never_lands_on_a_life_started_again_with_its_created_at(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, trigger: str
) -> None:
    """RELIABILITY.md (as above): a conversation read before it had an epoch is told by its
    `created_at` and by having none yet. Mallory's new conversation under the id, its first
    message given Ada's `created_at`, draws an epoch: the fold of Ada's state misses it (was:
    it matched `created_at` alone and served Ada's prompt r1 and call c1 to Mallory)."""
    store = await _fold_raced_by_a_new_life(
        backend, monkeypatch, trigger, "ada", "mallory", before_epochs=True
    )

    assert await held_state_of(store, "mallory") == ([], None)
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert doc["user_id"] == "mallory"
    assert not doc.get("pending_calls")
    assert doc.get("pending_hitl") is None


async def held_state_of(
    store: ConversationStore, user_id: str
) -> tuple[list[tuple[str, str | None]], str | None]:
    calls = [
        (c.tool_call_id, c.request_id) for c in await store.pending_calls(CID, user_id=user_id)
    ]
    prompt = await store.pending_hitl(CID, user_id=user_id)
    return calls, prompt.request_id if prompt else None


async def test_a_replay_holds_again_the_approved_call_its_first_attempt_asked_about_again(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls` (a later prompt naming the call holds it again): c2 is
    approved (r1); tA asks r2 about it again, its writer stalled past `abandon_after`; tB
    folds the passed, empty block (the approval in force again), tC is still being written
    (the fold owed) and tE asks r5 about c5. tA's insert lands and its writer dies before
    its fold. Sent again, tA is a replay holding c2 by r2, and once tC lands and the owed
    fold is written, c2 is still held by r2, as a fork of the same messages holds it (was:
    the replay held nothing, and the approval stayed in force for good)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(
        CID, [_user("Go."), _calls("c2"), _asks_about("r1", "c2")], turn_id="t0"
    )
    await store.resolve_hitl(CID, "r1")
    turn = [_asks_about("r2", "c2")]

    again = await _landing_cut_before_its_fold_then_resent(
        backend, monkeypatch, CID, turn, owed=True
    )

    assert again.replayed
    assert ("c2", "r2") in (await held_state(store))[0]
    assert await held_state(store) == await _forked_whole(backend, CID)


async def test_a_resend_answering_the_later_of_two_listed_calls_of_an_id_reads_and_writes_nothing(
    backend: Backend,
) -> None:
    """A resend of a stored turn is a replay that reads what a replay reads and writes
    nothing when the conversation lists what the turn's stored messages leave. t1 and t2
    each make c1 (both listed, below tA's block); tA answers t2's c1 (named) and asks r0
    again about c0, approved, and she answers it again. t1's c1, still listed, is not the
    call tA's answer pairs with: the replay reads as much as one of a conversation whose
    t2 call has another id, and her approval stands (was: any listed call of an answered
    id below the block made the replay fold the whole conversation and hold the approval
    again by tA's question)."""

    async def replay_calls(cid: str, reused: str) -> list[str]:
        logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
        asked = [_user("Go."), _calls("c0"), _asks_about("r0", "c0")]
        await logger.log_messages(cid, asked, turn_id="t0")
        await store.resolve_hitl(cid, "r0")
        await logger.log_messages(cid, [_user("a"), _calls("c1")], turn_id="t1")
        made = await logger.log_messages(cid, [_user("b"), _calls(reused)], turn_id="t2")
        turn = [_answer(reused, "found"), _asks_about("r0", "c0")]
        answers_to = {reused: made.messages[1].id}
        await logger.log_messages(cid, turn, turn_id="tA", answers_to=answers_to)
        await store.resolve_hitl(cid, "r0")
        return await _replayed_unchanged(backend, cid, turn, answers_to)

    assert await replay_calls(f"{CID}-reused", "c1") == await replay_calls(CID, "c7")


async def _old_turn_then(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    cid: str,
    turn: list[dict[str, Any]],
    later: list[dict[str, Any]],
) -> None:
    """In `cid`, where the turns before are logged: tA (`turn`) logged whole with its block
    reserved a day ago (older than `abandon_after`, so its resend is checked against the
    listing), then tE (`later`), and her answer to the last prompt tE asks, if it asks one."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    clock = _ReservedADayAgo(monkeypatch)
    await logger.log_messages(cid, turn, turn_id="tA")
    clock.caught_up()
    monkeypatch.undo()
    await logger.log_messages(cid, later, turn_id="tE")
    asked = [m["hitl_action"]["request_id"] for m in later if "hitl_action" in m]
    if asked:
        await store.resolve_hitl(cid, asked[-1])


_APPROVED_AFTER = {
    "asked-again": ("c2", []),
    "first-asked": ("c4", [_user("More."), _calls("c4")]),
}
"""The call the old turn's prompt (r2) names, and the turn made before it: c2, approved
before (r1), asked about again; or c4, made and never asked about before."""


@pytest.mark.parametrize("shape", list(_APPROVED_AFTER))
async def test_an_old_replay_holds_no_approval_given_after_its_turn(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """DESIGN.md `approved_calls` (a later prompt naming the call holds it again): a prompt
    holds only an approval given before it. tA asks r2 about a call, its block older than
    `abandon_after`; tE asks r3 about it again and she answers r3. tA's resend is a replay
    that changes nothing of the conversation: her approval, given after tA, stays free
    (was: the replay held it by tA's r2, an earlier question)."""
    call_id, before = _APPROVED_AFTER[shape]
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    asked = [_user("Go."), _calls("c2"), _asks_about("r1", "c2")]
    await logger.log_messages(CID, asked, turn_id="t0")
    await store.resolve_hitl(CID, "r1")
    if before:
        await logger.log_messages(CID, before, turn_id="t1")
    turn = [_user("Sure?"), _asks_about("r2", call_id)]
    await _old_turn_then(
        backend, monkeypatch, CID, turn, [_user("Really?"), _asks_about("r3", call_id)]
    )
    served = await held_state(store)

    await _replayed_unchanged(backend, CID, turn, {})

    assert await held_state(store) == served == await _forked_whole(backend, CID)


async def _approve(store: ConversationStore, cid: str, request_id: str, call_id: str) -> None:
    """Her answer to `request_id` approving its call `call_id` alone (`calls=`)."""
    listed = await store.pending_calls(cid)
    chosen = [c for c in listed if c.request_id == request_id and c.tool_call_id == call_id]
    await store.resolve_hitl(cid, request_id, calls=chosen)


async def _approved_partly_then_asked(
    logger: AgentMessageLogger, store: ConversationStore, cid: str, log_ta: Callable[[], Any]
) -> None:
    """In `cid`: t0 makes c1 and c2 and asks r2 about both; she approves c1 alone; t1 makes
    another c1; tA asks r3 about c1 and c2 (`log_ta`); tB asks r2 about both again and she
    approves c2 alone, to that question."""
    await logger.log_messages(
        cid, [_user("Go."), _calls("c1", "c2"), _asks_about("r2", "c1", "c2")], turn_id="t0"
    )
    await _approve(store, cid, "r2", "c1")
    await logger.log_messages(cid, [_user("More."), _calls("c1")], turn_id="t1")
    await log_ta()
    await logger.log_messages(cid, [_user("Really?"), _asks_about("r2", "c1", "c2")], turn_id="tB")
    await _approve(store, cid, "r2", "c2")


async def _denial_refused(logger: AgentMessageLogger, cid: str, call_id: str, made_by: str) -> None:
    with pytest.raises(AnsweredBefore):
        await logger.log_messages(
            cid, [_denial_of(call_id)], turn_id="tD", answers_to={call_id: made_by}
        )


async def test_an_old_replay_holds_no_approval_given_after_its_turn_among_others_of_its_ids(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls` (a later prompt naming the call holds it again): a replay
    holds again only the approvals its own prompt asked about that were given before its
    block. tA's r3 asks about c1 (t1's, not approved) and c2 (t0's, approved after tA, to
    tB's r2). tA's resend a day later is a replay that changes nothing: c2 stays served
    released and its denial refused (was: t0's approved c1, of an id tA names, made the
    replay hold again every free approval of its ids, her later one of c2 too)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    turn = [_user("Sure?"), _asks_about("r3", "c1", "c2")]

    async def old_turn() -> None:
        clock = _ReservedADayAgo(monkeypatch)
        await logger.log_messages(CID, turn, turn_id="tA")
        clock.caught_up()
        monkeypatch.undo()

    await _approved_partly_then_asked(logger, store, CID, old_turn)
    served = await held_state(store)
    assert ("c2", None) in served[0]

    await _replayed_unchanged(backend, CID, turn, {})

    assert await held_state(store) == served == await _forked_whole(backend, CID)
    made_by = (await store.transcript(CID))[1].id
    await _denial_refused(logger, CID, "c2", made_by)


async def test_an_old_replay_holds_no_approval_of_an_earlier_call_of_the_id_it_asked_about(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls`: a prompt naming an id holds the latest call of it, never an
    older approved one. t0's c1 is asked about (r1); t1 makes another c1; she approves t0's
    c1; tA's r2 asks about c1, t1's; t1's c1 is answered, and tC asks r1 anew about c5. tA's
    resend a day later is a replay that changes nothing: t0's approved c1 stays released and
    its denial refused (was: the replay matched approvals by call id alone and held t0's c1
    by tA's question, which never asked about it)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    first = await logger.log_messages(
        CID, [_user("Pay."), _calls("c1"), _asks_about("r1", "c1")], turn_id="t0"
    )
    second = await logger.log_messages(CID, [_user("More."), _calls("c1")], turn_id="t1")
    await store.resolve_hitl(CID, "r1")
    turn = [_user("Sure?"), _asks_about("r2", "c1")]
    clock = _ReservedADayAgo(monkeypatch)
    await logger.log_messages(CID, turn, turn_id="tA")
    clock.caught_up()
    monkeypatch.undo()
    answered = {"c1": second.messages[1].id}
    await logger.log_messages(CID, [_answer("c1")], turn_id="tB", answers_to=answered)
    asked = [_user("And?"), _calls("c5"), _asks_about("r1", "c5")]
    await logger.log_messages(CID, asked, turn_id="tC")
    served = await held_state(store)

    await _replayed_unchanged(backend, CID, turn, {})

    assert await held_state(store) == served == await _forked_whole(backend, CID)
    await _denial_refused(logger, CID, "c1", first.messages[1].id)


async def test_a_stalled_writer_landing_holds_no_approval_given_after_its_block(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls` and RELIABILITY.md (a landing holds again only what its
    reservation held): tA's r3 asks about c1 and c2, its writer stalled inside its insert
    past `abandon_after`; another logger's turn passes its block; tB asks r2 again and she
    approves c2 to it. When tA's insert lands, c2 stays released as in the same turns
    logged with no stall (the control): served with no request id, its denial refused
    (was: the landing held again every free approval of its ids, hers given after it)."""
    turn, control = [_user("Sure?"), _asks_about("r3", "c1", "c2")], f"{CID}-control"
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _approved_partly_then_asked(
        logger, store, control, partial(logger.log_messages, control, turn, turn_id="tA")
    )
    writer = AgentMessageLogger(backend.db)
    stall, late = _StalledInsert(writer, monkeypatch), list[asyncio.Task[LoggedTurn]]()

    async def stalled() -> None:
        clock = _ReservedADayAgo(monkeypatch)
        late.append(await stall.start(writer.log_messages(CID, turn, turn_id="tA")))
        clock.caught_up()  # tA's insert is sent, and stalls
        await AgentMessageLogger(backend.db).log_messages(CID, [_user("hello?")], turn_id="tP")

    await _approved_partly_then_asked(logger, store, CID, stalled)
    stall.release()
    await late[0]
    monkeypatch.undo()

    served = await held_state(store)
    assert ("c2", None) in served[0]
    assert served == await held_state(store, control) == await _forked_whole(backend, CID)
    made_by = (await store.transcript(CID))[1].id
    await _denial_refused(logger, CID, "c2", made_by)


async def test_a_stalled_writer_landing_holds_no_approval_given_after_its_block_to_an_older_prompt(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls` and RELIABILITY.md (a landing holds again only the approval
    given before its block): t0 makes c1 and asks r1 about it; tA asks r2 about c1 again, its
    writer stalled inside its insert past `abandon_after`; tP passes its block, empty, and
    c1 is held by r1 again. She approves r1 naming c1 (accepted). When tA's insert lands, her
    approval is to stay in force: c1 served released (in the library, over HTTP and in a fork
    of every message), r2 asking still, and a denial of c1 refused, over HTTP too (was: the
    fold met the landed question below her answer's `s`, holding c1, and withdrew her
    approval, a denial stored)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    made = await logger.log_messages(
        CID, [_user("Pay."), _calls("c1"), _asks_about("r1", "c1")], turn_id="t0"
    )
    made_by = made.messages[1].id
    writer = AgentMessageLogger(backend.db)
    stall, clock = _StalledInsert(writer, monkeypatch), _ReservedADayAgo(monkeypatch)
    turn = [_user("Sure?"), _asks_about("r2", "c1")]
    late = await stall.start(writer.log_messages(CID, turn, turn_id="tA"))
    clock.caught_up()  # tA's insert is sent, and stalls
    await AgentMessageLogger(backend.db).log_messages(CID, [_user("hello?")], turn_id="tP")
    assert await held_state(store) == ([("c1", "r1")], "r1")
    await store.resolve_hitl(CID, "r1", call_ids=["c1"])

    stall.release()
    await late
    monkeypatch.undo()

    served = await held_state(store)
    assert served == ([("c1", None)], "r2")
    assert await _approved_calls(backend) == ["c1"]
    assert await _forked_whole(backend, CID) == served
    await store.resolve_hitl(CID, "r1", call_ids=["c1"])  # a replay of her answer
    assert await held_state(store) == served
    async with serve(backend.db, seeded=False) as api:
        url, headers = f"/v1/conversations/{CID}", auth_headers()
        listed = (await api.http.get(url, headers=headers)).json()["pending_calls"]
        denial = {"turn_id": "tD", "messages": [_denial_of("c1")], "answers_to": {"c1": made_by}}
        refused = await api.http.post(f"{url}/turns", json=denial, headers=headers)
    assert [(c["tool_call_id"], c["request_id"]) for c in listed] == served[0]
    assert refused.status_code == 409, refused.text
    await _denial_refused(logger, CID, "c1", made_by)
    await logger.log_messages(CID, [_user("And?")], turn_id="tN")
    assert await held_state(store) == served


async def _approved_before_the_landing(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, call_ids: list[str] | None
) -> str:
    """In CID: t0 makes c1 and asks r1 about it; tA asks r2 about c1 (`_ASKS_R2`), its writer
    stalled inside its insert past `abandon_after`; tP passes its block, empty; she answers
    r1 (naming `call_ids`, or none), then tA lands. The id of the message making c1."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    made = await logger.log_messages(
        CID, [_user("Pay."), _calls("c1"), _asks_about("r1", "c1")], turn_id="t0"
    )
    writer = AgentMessageLogger(backend.db)
    stall, clock = _StalledInsert(writer, monkeypatch), _ReservedADayAgo(monkeypatch)
    late = await stall.start(writer.log_messages(CID, _ASKS_R2, turn_id="tA"))
    clock.caught_up()  # tA's insert is sent, and stalls
    await AgentMessageLogger(backend.db).log_messages(CID, [_user("hello?")], turn_id="tP")
    await store.resolve_hitl(CID, "r1", call_ids=call_ids)
    stall.release()
    await late
    monkeypatch.undo()
    return str(made.messages[1].id)


_ASKS_R2 = [_user("Sure?"), _asks_about("r2", "c1")]
"""tA: r2 asks about c1, t0's, again."""


async def _asked_again_stalled(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, cid: str, *, stalled: bool = True
) -> tuple[str, Callable[[], Awaitable[None]]]:
    """t0 asks r1 about its call c1; tA asks r2 about c1 (`_ASKS_R2`), its insert stalled past
    `abandon_after` (logged, `stalled` false); tP passes its block. The message making c1,
    and what lands tA's stalled insert (nothing more when it was logged)."""
    asked = [_user("Pay."), _calls("c1"), _asks_about("r1", "c1")]
    made = await AgentMessageLogger(backend.db).log_messages(cid, asked, turn_id="t0")
    writer = AgentMessageLogger(backend.db)

    async def landed() -> None:
        if stalled:
            stall.release()
            await late
            monkeypatch.undo()

    if stalled:
        stall, clock = _StalledInsert(writer, monkeypatch), _ReservedADayAgo(monkeypatch)
        late = await stall.start(writer.log_messages(cid, _ASKS_R2, turn_id="tA"))
        clock.caught_up()
    else:
        await writer.log_messages(cid, _ASKS_R2, turn_id="tA")
    await AgentMessageLogger(backend.db).log_messages(cid, [_user("Hm?")], turn_id="tP")
    return str(made.messages[1].id), landed


async def test_a_stalled_writer_landing_holds_no_plain_approval_given_after_its_block(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls` (`landed_after`): as with her answer naming c1, her answer
    to r1 naming no call, given after tA's block and before tA landed, stays in force: c1
    served released, r2 asking, in a fork of every message too, a denial refused, and a
    later turn leaves it so (was: withdrawn as the landing folded, a denial stored)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    made_by = await _approved_before_the_landing(backend, monkeypatch, None)

    served = await held_state(store)
    assert served == ([("c1", None)], "r2")
    assert await _forked_whole(backend, CID) == served
    await _denial_refused(logger, CID, "c1", made_by)
    await logger.log_messages(CID, [_user("And?")], turn_id="tN")
    assert await held_state(store) == served
    assert await _approved_calls(backend) == ["c1"]


async def test_a_landing_marks_the_approval_given_before_it_landed_with_its_question(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls`: the landing marks her approval with its question
    (`landed_after`, the message asking r2); a fork copying that question names its copy,
    and a replay of tA (its resend) changes nothing and keeps the approval in force."""
    store = ConversationStore(backend.db)
    await _approved_before_the_landing(backend, monkeypatch, ["c1"])
    asked = (await store.transcript(CID))[4]
    assert asked.hitl_action is not None
    doc = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert [a.get("landed_after") for a in doc["approved_calls"]] == [asked.id]
    served = await held_state(store)

    await _replayed_unchanged(backend, CID, _ASKS_R2, {})
    assert await _forked_whole(backend, CID) == served == await held_state(store)
    fork = await backend.db[CONVERSATIONS].find_one({"_id": f"{CID}-whole"})
    copied = (await store.transcript(f"{CID}-whole"))[4]
    assert [a.get("landed_after") for a in fork["approved_calls"]] == [copied.id]


async def test_a_fork_cut_before_the_answer_to_an_older_prompt_keeps_no_approval_of_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls` and §3 Forks: a fork cut at tA's question, whose original
    went past it (tP) before her answer came, copies no answer: c1 held by r2 there, no
    approval, a denial of c1 stored; the original keeps hers (`landed_after`)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _approved_before_the_landing(backend, monkeypatch, ["c1"])
    asked = (await store.transcript(CID))[4]
    assert asked.seq is not None

    await logger.fork(CID, asked.seq, "conv-fork")

    assert await held_state(store, "conv-fork") == ([("c1", "r2")], "r2")
    assert await _approved_calls(backend, "conv-fork") == []
    assert await held_state(store) == ([("c1", None)], "r2")


async def test_popping_past_a_landed_question_keeps_the_approval_given_before_it_landed(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls` (a pop keeps what a fork of all that remains keeps): popping
    tP's message keeps her approval to r1, given before tA landed (`landed_after`): c1
    served released, r2 asking, as a fork of what remains; popping tA's question too leaves
    c1 released by her answer, nothing asking, and a denial of c1 refused throughout
    (was: the pop's fold withdrew the approval the landing left)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    made_by = await _approved_before_the_landing(backend, monkeypatch, ["c1"])

    popped = await store.pop_last_message(CID)
    assert popped is not None
    assert popped.turn_id == "tP"
    assert await held_state(store) == ([("c1", None)], "r2") == await _forked_whole(backend, CID)
    assert await _approved_calls(backend) == ["c1"]

    popped = await store.pop_last_message(CID)
    assert popped is not None
    assert popped.hitl_action is not None
    assert await held_state(store) == ([("c1", None)], None)
    assert await _approved_calls(backend) == ["c1"]
    await _denial_refused(logger, CID, "c1", made_by)


async def test_an_approval_given_to_a_later_prompt_of_its_request_id_is_never_marked_by_a_landing(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls` (a pop keeps what a fork of all that remains keeps): t0's r1
    and tA's r2 (stalled, its block passed by tP) ask about c1; tB asks r1 again, and she
    approves r1: tB's question, stored after tA's. tA's landing does not mark that approval
    (`landed_after`: only one whose prompt is stored below the landed question), so popping
    tB's question leaves what the same messages and answer logged with no stall leave: c1
    held by r2, her approval gone (was: marked, it stayed in force, c1 served released and a
    denial refused, only because a writer had stalled)."""

    async def popped_after(cid: str, stalled: bool) -> Any:
        store = ConversationStore(backend.db)
        _, landed = await _asked_again_stalled(backend, monkeypatch, cid, stalled=stalled)
        again = [_user("Again?"), _asks_about("r1", "c1")]
        await AgentMessageLogger(backend.db).log_messages(cid, again, turn_id="tB")
        await store.resolve_hitl(cid, "r1", call_ids=["c1"])
        await landed()
        popped = await store.pop_last_message(cid)
        assert popped is not None
        assert popped.turn_id == "tB"
        return await held_state(store, cid), await _approved_calls(backend, cid)

    logged_afresh = await popped_after(f"{CID}-afresh", stalled=False)
    assert logged_afresh == (([("c1", "r2")], "r2"), [])
    assert await popped_after(CID, stalled=True) == logged_afresh


async def test_an_approval_given_while_a_later_prompt_of_its_request_id_was_in_flight_is_marked(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls` (`landed_after`: one given to a prompt stored below the
    landed question): t0 asks r1 about c1, tA (r2 about c1) stalls past `abandon_after`, tP
    passes its block; tB asks r1 again, its block reserved, its insert still in flight as
    she approves r1: the only r1 prompt stored is t0's, below tA's question. tB lands, then
    tA, which marks her approval; popping tB's question leaves what the same turns leave
    with tB logged just after her answer: c1 released, r2 asking, her approval kept (was:
    the answer's reach counted tB's reserved block, the approval left unmarked and the pop
    withdrew it, c1 held by r2)."""

    async def popped_after(cid: str, in_flight: bool) -> Any:
        store = ConversationStore(backend.db)
        _, landed = await _asked_again_stalled(backend, monkeypatch, cid)
        again, asker = [_user("Again?"), _asks_about("r1", "c1")], AgentMessageLogger(backend.db)
        if in_flight:
            asking = _StalledInsert(asker, monkeypatch)
            landing = await asking.start(asker.log_messages(cid, again, turn_id="tB"))
            await store.resolve_hitl(cid, "r1", call_ids=["c1"])
            asking.release()
            await landing
        else:
            await store.resolve_hitl(cid, "r1", call_ids=["c1"])
            await asker.log_messages(cid, again, turn_id="tB")
        await landed()
        popped = await store.pop_last_message(cid)
        assert popped is not None
        assert popped.turn_id == "tB"
        return await held_state(store, cid), await _approved_calls(backend, cid)

    logged_after = await popped_after(f"{CID}-after", in_flight=False)
    assert logged_after == (([("c1", None)], "r2"), ["c1"])
    assert await popped_after(CID, in_flight=True) == logged_after


async def test_popping_a_later_prompt_of_its_request_id_before_the_stalled_landing_withdraws_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls`: as `..._is_never_marked_by_a_landing`, but tB's question,
    the one she approved, is popped before tA's stalled insert lands: the landing then finds
    no prompt of r1 above its block, and leaves what the same turns logged with no stall
    leave: c1 held by r2, her approval gone."""

    async def popped_before(cid: str, stalled: bool) -> Any:
        store = ConversationStore(backend.db)
        _, landed = await _asked_again_stalled(backend, monkeypatch, cid, stalled=stalled)
        again = [_user("Again?"), _asks_about("r1", "c1")]
        await AgentMessageLogger(backend.db).log_messages(cid, again, turn_id="tB")
        await store.resolve_hitl(cid, "r1", call_ids=["c1"])
        popped = await store.pop_last_message(cid)
        assert popped is not None
        assert popped.turn_id == "tB"
        await landed()
        return await held_state(store, cid), await _approved_calls(backend, cid)

    logged_afresh = await popped_before(f"{CID}-afresh", stalled=False)
    assert logged_afresh == (([("c1", "r2")], "r2"), [])
    assert await popped_before(CID, stalled=True) == logged_afresh


async def test_a_later_prompt_of_the_request_id_about_another_call_leaves_the_landing_marking(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md `approved_calls`: t0's r1 holds c1; tA's r2 asks about c1 and stalls, its
    block passed by tP; tB asks r1 again about its own call c5. Her approval of c1 through
    r1 was given to t0's prompt (tB's never held c1), stored below the landed question: the
    landing marks it, c1 stays served released and a stale denial of it is refused (was:
    any later prompt of the id counted as the one she answered, the approval was withdrawn
    and the denial stored)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    made_by, landed = await _asked_again_stalled(backend, monkeypatch, CID)
    other = [_user("Also?"), _calls("c5"), _asks_about("r1", "c5")]
    await AgentMessageLogger(backend.db).log_messages(CID, other, turn_id="tB")
    await store.resolve_hitl(CID, "r1", call_ids=["c1"])
    await landed()

    assert ("c1", None) in (await held_state(store))[0]
    assert await _approved_calls(backend) == ["c1"]
    await _denial_refused(logger, CID, "c1", made_by)


async def test_an_old_replay_of_a_turn_a_later_turn_asked_after_reads_twice_more(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELIABILITY.md: a replay of a block older than `abandon_after` whose conversation only
    looks otherwise than its stored messages leave it (a later turn asked since) folds and
    writes nothing: two reads more than one with nothing since (was: a third command, the
    fold written over the same state)."""

    async def replay_calls(cid: str, later: list[dict[str, Any]]) -> list[str]:
        logger = AgentMessageLogger(backend.db)
        await logger.log_messages(cid, [_user("Go."), _calls("c1")], turn_id="t0")
        turn = [_user("Buy."), _calls("c9"), _asks_about("r9", "c9")]
        await _old_turn_then(backend, monkeypatch, cid, turn, later)
        return await _replayed_unchanged(backend, cid, turn, {})

    nothing_since = await replay_calls(f"{CID}-quiet", [_user("Hm.")])
    asked_since = [_calls("c5"), _asks_about("r5", "c5")]
    assert await replay_calls(CID, asked_since) == [*nothing_since, "find_one", "find"]


_ASKED_AGAIN = {
    "alone": [_asks_about("r1", "c1")],
    "with-its-own-call": [_asks_about("r1", "c1"), _calls("c9"), _asks_about("r9", "c9")],
}
"""What the stalled writer's turn asks: r1 again about c1, approved before, and maybe more."""


async def _asked_and_approved_then(
    backend: Backend, cid: str, log_ta: Callable[[], Awaitable[Any]]
) -> str:
    """In `cid`: c1 made and asked about (r1) and approved; tA logged (`log_ta`), then a
    user turn (tB). The id of the message making c1."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    made = await logger.log_messages(cid, [_calls("c1"), _asks_about("r1", "c1")], turn_id="t0")
    await store.resolve_hitl(cid, "r1")
    await log_ta()
    await logger.log_messages(cid, [_user("hello?")], turn_id="tB")
    return made.messages[0].id


@pytest.mark.parametrize("asked", list(_ASKED_AGAIN))
async def test_a_stalled_writer_landing_holds_again_the_approved_call_its_prompt_asks_about(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, asked: str
) -> None:
    """DESIGN.md `approved_calls` (a later prompt naming the call holds it again) and
    `answered_prompts` (no answer reaches a question asked after it): c1 is approved (r1);
    tA asks r1 again about c1, its writer stalled inside its insert past `abandon_after`;
    tB finds its block passed and empty, and the approval is in force again. When tA's
    insert lands, its question holds c1 again, as when the same turns are logged with no
    stall (the control conversation): c1 is served held by r1, and a denial of it is
    stored, once (no second answer)."""
    turn, control = _ASKED_AGAIN[asked], f"{CID}-control"
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _asked_and_approved_then(
        backend, control, partial(logger.log_messages, control, turn, turn_id="tA")
    )
    writer = AgentMessageLogger(backend.db)
    stall, late = _StalledInsert(writer, monkeypatch), list[asyncio.Task[LoggedTurn]]()

    async def stalled() -> None:
        clock = _ReservedADayAgo(monkeypatch)
        late.append(await stall.start(writer.log_messages(CID, turn, turn_id="tA")))
        clock.caught_up()  # tA's insert is sent, and stalls

    made_by = await _asked_and_approved_then(backend, CID, stalled)
    assert ("c1", None) in (await held_state(store))[0]  # tB passed tA's block: approved

    stall.release()
    await late[0]
    monkeypatch.undo()

    assert await held_state(store) == await held_state(store, control)
    assert ("c1", "r1") in (await held_state(store))[0]
    await logger.log_messages(CID, [_denial_of("c1")], turn_id="tR", answers_to={"c1": made_by})
    with contextlib.suppress(StoreError):  # refused, never stored
        await logger.log_messages(
            CID, [_answer("c1", "ran")], turn_id="tR2", answers_to={"c1": made_by}
        )
    answers = [m.content for m in await store.transcript(CID) if m.tool_call_id == "c1"]
    assert answers == [DENIED_RESULT]


async def test_a_stalled_denial_landing_after_a_person_approved_the_call_is_the_first_answer_stored(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELIABILITY.md (a stalled write that lands is kept, not judged again) and DESIGN.md
    (`answered_prompts`: an answer reaches what is stored below its `s`): tA denies c1
    (held by r1) and asks r9 about c9, its writer stalled inside its insert past
    `abandon_after`; tB finds its block passed and empty (c1 pending again, held by r1);
    she approves r1; tA's denial then lands below her answer's reach. The stored order
    decides, the same way in the conversation and in a fork of all of it: the denial is
    c1's answer, her approval released nothing there and is withdrawn (`approved_calls`
    empty, r1 stays resolved), and no further answer to c1 is stored."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    made = await logger.log_messages(CID, [_calls("c1"), _asks_about("r1", "c1")], turn_id="t0")
    made_by = made.messages[0].id
    writer = AgentMessageLogger(backend.db)
    stall, clock = _StalledInsert(writer, monkeypatch), _ReservedADayAgo(monkeypatch)
    turn = [_denial_of("c1"), _calls("c9"), _asks_about("r9", "c9")]
    late = await stall.start(
        writer.log_messages(CID, turn, turn_id="tA", answers_to={"c1": made_by})
    )
    clock.caught_up()  # tA's insert is sent, and stalls
    await logger.log_messages(CID, [_user("hello?")], turn_id="tB")
    assert await held_state(store) == ([("c1", "r1")], "r1")
    await store.resolve_hitl(CID, "r1")
    assert await _approved_calls(backend) == ["c1"]

    stall.release()
    await late
    monkeypatch.undo()

    assert await held_state(store) == ([("c9", "r9")], "r9")
    assert await _approved_calls(backend) == []
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert doc["resolved_hitl"] == ["r1"]
    await logger.fork(CID, (await store.transcript(CID))[-1].seq, f"{CID}-fork")
    assert await held_state(store, f"{CID}-fork") == await held_state(store)
    assert await _approved_calls(backend, f"{CID}-fork") == []
    with contextlib.suppress(StoreError):  # refused, never stored
        await logger.log_messages(
            CID, [_answer("c1", "ran")], turn_id="tR", answers_to={"c1": made_by}
        )
    answers = [m.content for m in await store.transcript(CID) if m.tool_call_id == "c1"]
    assert answers == [DENIED_RESULT]


async def _asked_and_approved(logger: AgentMessageLogger, store: ConversationStore) -> str:
    """c1 asked under r1 and approved; the id of the message that made c1."""
    logged = await logger.log_messages(CID, [_calls("c1"), _asks_about("r1", "c1")], turn_id="asks")
    await store.resolve_hitl(CID, "r1")
    return logged.messages[0].id


async def _passed_and_folded(logger: AgentMessageLogger, clocks: StoreClocks | None) -> None:
    """The dead turn's block passed (`abandon_after`), and a later turn's reservation finds it
    so (`pending_blocks`): the pending state is folded from the stored messages. The time
    passes on the store's `clocks`, or, without them, is waited for (a fork judges blocks at
    its own `read_at`, which the clocks do not move)."""
    if clocks is None:
        await asyncio.sleep(_SHORT.abandon_after.total_seconds() + 0.2)
    else:
        clocks.wait(_SHORT.abandon_after.total_seconds() + 0.2)
    await logger.log_messages(CID, [_user("hello?")], turn_id="later")


async def test_a_dead_turn_asking_an_answered_id_again_leaves_the_approval_once_folded(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks
) -> None:
    """RELIABILITY.md, "A writer that died before its insert": the fold takes back what the
    dead turn's reservation did as a whole. Its question under r1, answered already, is never
    stored: r1 is resolved again and c1 approved again (DESIGN.md §2 `resolved_hitl`,
    `approved_calls`), so a denial of c1 is refused, and answering r1 again adds nothing."""
    logger = AgentMessageLogger(backend.db, rules=_SHORT)
    store = ConversationStore(backend.db, rules=_SHORT)
    made_by = await _asked_and_approved(logger, store)
    await _reserved_only(logger, monkeypatch, [_asks_about("r1", "c1")], "dies")
    assert [c.request_id for c in await store.pending_calls(CID)] == ["r1"]

    await _passed_and_folded(logger, clocks)

    assert [(c.tool_call_id, c.request_id) for c in await store.pending_calls(CID)] == [
        ("c1", None)
    ]
    assert await store.pending_hitl(CID) is None
    doc = await backend.db.agent_conversations.find_one({"_id": CID})
    assert doc["resolved_hitl"] == ["r1"]
    with pytest.raises(AnsweredBefore):
        await logger.check_turn(
            CID, [_denial_of("c1")], turn_id="denies", answers_to={"c1": made_by}
        )
    await store.resolve_hitl(CID, "r1")
    assert await _approved_calls(backend) == ["c1"]


async def test_a_dead_turns_late_retry_denying_a_call_approved_after_the_fold_is_refused(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks
) -> None:
    """The dead turn denied c1 and asked about c9; folded, c1 is pending under r1 again and
    the person approves it. The turn's late retry moves to the end, after her approval, and
    is judged there as the same turn logged fresh: refused (`AnsweredBefore`), nothing
    stored, c1 still approved (DESIGN.md §2 `approved_calls`)."""
    logger = AgentMessageLogger(backend.db, rules=_SHORT)
    store = ConversationStore(backend.db, rules=_SHORT)
    logged = await logger.log_messages(CID, [_calls("c1"), _asks_about("r1", "c1")], turn_id="asks")
    turn = [_denial_of("c1"), _calls("c9"), _asks_about("r9", "c9")]
    answers = {"c1": logged.messages[0].id}

    async def lost(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the turn reserved and has not inserted")

    monkeypatch.setattr(logger._messages, "insert_many", lost)
    with pytest.raises(ConnectionError):
        await logger.log_messages(CID, turn, turn_id="dies", answers_to=answers)
    monkeypatch.undo()
    await _passed_and_folded(logger, clocks)
    assert await pending_state(store) == (["c1"], "r1")
    await store.resolve_hitl(CID, "r1")
    before = await store.transcript(CID)

    with pytest.raises(AnsweredBefore):
        await logger.log_messages(CID, turn, turn_id="dies", answers_to=answers)

    assert await store.transcript(CID) == before
    assert await _approved_calls(backend) == ["c1"]
    assert [(c.tool_call_id, c.request_id) for c in await store.pending_calls(CID)] == [
        ("c1", None)
    ]


async def test_a_pop_after_a_dead_turn_withdraws_the_approval_of_the_question_it_removes(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §2 `approved_calls`: a pop keeps the approvals a fork of all that remains
    keeps, also once a turn died before its insert earlier in the conversation (its passed
    block a `seq` gap no message fills). c1 and c2, approved under r3, asked again under r12
    and again under r3, approved again: popping that last question gives them back to r12,
    as in a fork of all that remains."""
    logger = AgentMessageLogger(backend.db, rules=_SHORT)
    store = ConversationStore(backend.db, rules=_SHORT)
    await logger.log_messages(
        CID, [_calls("c1", "c2"), _asks_about("r3", "c1", "c2")], turn_id="t1"
    )
    await store.resolve_hitl(CID, "r3")
    await logger.log_messages(CID, [_asks_about("r12", "c2", "c1")], turn_id="t2")
    await _reserved_only(logger, monkeypatch, [_calls("c14"), _asks_about("r16", "c14")], "dies")
    await _passed_and_folded(logger, None)
    await logger.log_messages(CID, [_asks_about("r3", "c1", "c2")], turn_id="t5")
    await store.resolve_hitl(CID, "r3")

    await store.pop_last_message(CID)

    held = [(c.tool_call_id, c.request_id) for c in await store.pending_calls(CID)]
    assert held == [("c1", "r12"), ("c2", "r12")]
    assert await _approved_calls(backend) == ["c1", "c2"]
    last = (await store.transcript(CID))[-1].seq
    await logger.fork(CID, last, "fork-whole")
    forked = [(c.tool_call_id, c.request_id) for c in await store.pending_calls("fork-whole")]
    assert forked == held


_T5 = [_user("u5"), _answer("c0", "r5"), _calls("c1"), _say("a5")]
"""A turn answering c0 and making c1 (`_refused_call_turn`)."""


async def _refused_call_turn(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks
) -> tuple[dict[str, Any], str]:
    """t1 makes c0; t5 answers c0 and makes c1, its insert lost (c1 listed pending); past
    `abandon_after` a quiet turn passes t5's empty block (c0 listed again) and t11 answers
    c0; t8 answers c1 as `pending_calls` served it: 503 "may still be logged"; t5's retry is
    refused `AnsweredBefore` ("Log the turn without that answer"), not re-logged yet.
    Returns t8's arguments and c1's message id as served."""
    logger = AgentMessageLogger(backend.db, rules=_SHORT)
    store = ConversationStore(backend.db, rules=_SHORT)
    await logger.log_messages(CID, [_user("u1"), _calls("c0"), _say("a1")], turn_id="t1")
    (c0,) = await store.pending_calls(CID)
    with monkeypatch.context() as patched:
        patched.setattr(logger._messages, "insert_many", _insert_lost)
        with contextlib.suppress(ConnectionError):
            await logger.log_messages(CID, _T5, turn_id="t5", answers_to={"c0": c0.message_id})
    (c1,) = await store.pending_calls(CID)
    clocks.wait(_SHORT.abandon_after.total_seconds() + 0.5)
    await logger.log_messages(CID, [_user("u6"), _say("a6")], turn_id="t6")
    (again,) = await store.pending_calls(CID)
    answer = [_user("u11"), _answer("c0", "r11"), _say("a11")]
    await logger.log_messages(CID, answer, turn_id="t11", answers_to={"c0": again.message_id})
    t8 = {
        "messages": [_user("u8"), _answer("c1", "booking B-42"), _say("booked")],
        "turn_id": "t8",
        "answers_to": {"c1": c1.message_id},
    }
    with pytest.raises(StorageUnavailable, match=r"'c1'.*not stored.*may still be logged"):
        await logger.log_messages(CID, **t8)
    with pytest.raises(AnsweredBefore, match="Log the turn without that answer"):
        await logger.log_messages(CID, _T5, turn_id="t5", answers_to={"c0": c0.message_id})
    return t8, c1.message_id


async def test_an_answer_to_a_call_of_a_turn_refused_on_its_late_retry_waits_then_lands(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks
) -> None:
    """RELIABILITY.md ("A writer that died before its insert"): t5, making c1, is refused
    `AnsweredBefore` on its late retry and told to log itself without that answer. Until it
    does, an answer naming c1 as `pending_calls` served it waits (503; was the 422 "does not
    make call … a fork?", which a runtime obeys by dropping c1's result); once t5 is
    re-logged (its messages numbered anew, c1's message under another id), that answer,
    naming c1's earlier id, is stored: c1 answered once, nothing pending."""
    logger = AgentMessageLogger(backend.db, rules=_SHORT)
    store = ConversationStore(backend.db, rules=_SHORT)
    t8, served = await _refused_call_turn(backend, monkeypatch, clocks)
    for attempt in (logger.check_turn, logger.log_messages):
        with pytest.raises(StorageUnavailable, match=r"'c1'.*may still be logged"):
            await attempt(CID, **t8)

    relogged = [m for m in _T5 if m["role"] != "tool"]
    await logger.log_messages(CID, relogged, turn_id="t5")
    (listed,) = await store.pending_calls(CID)
    assert (listed.tool_call_id, listed.message_id == served) == ("c1", False)
    await logger.check_turn(CID, **t8)
    logged = await logger.log_messages(CID, **t8)
    again = await logger.log_messages(CID, **t8)

    assert again.replayed
    assert [m.id for m in again.messages] == [m.id for m in logged.messages]
    stored = await store.transcript(CID)
    assert [m.content for m in stored if m.tool_call_id == "c1"] == ["booking B-42"]
    assert await pending_state(store) == await recomputed_state(store) == ([], None)


@pytest.mark.parametrize("then", ["popped", "a day passed"])
async def test_an_answer_to_a_call_of_a_refused_turn_that_never_lands_is_refused_in_the_end(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, clocks: StoreClocks, then: str
) -> None:
    """The guard of the wait above: once t5 can no longer land where it reserved (pops
    passed its block; or a day passed since, t5 never logged again), an answer naming c1 as
    `pending_calls` served it is refused as naming a message that makes no call (422)."""
    logger = AgentMessageLogger(backend.db, rules=_SHORT)
    store = ConversationStore(backend.db, rules=_SHORT)
    t8, _ = await _refused_call_turn(backend, monkeypatch, clocks)
    if then == "popped":
        while await store.transcript(CID):  # past t5's block
            await store.pop_last_message(CID)
    else:
        clocks.wait(BLOCKS_WATCHED_FOR.total_seconds() + 10)
    before = await store.transcript(CID)

    for turn_id in ("t9", "t8"):
        with pytest.raises(InvalidInput, match="does not make call 'c1'"):
            await logger.log_messages(CID, **{**t8, "turn_id": turn_id})
    assert await store.transcript(CID) == before
