"""What a turn survives: a failure at each write point, writers racing, hostile text.

Failures are injected at the one seam between the logger and the driver: a
collection wrapper that makes a single named call fail with the driver's own
network error, either before the server sees it or after the server applied it
(the reply is lost, as on a timeout). The caller sees StorageUnavailable and
retries the same turn, as the runtime does; every message must then be stored
exactly once and the turn counted once.
"""

from __future__ import annotations

import asyncio
import gc
import re
import warnings
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pymongo import AsyncMongoClient, errors
from pymongo.errors import AutoReconnect

from agent_store import (
    AgentMessageLogger,
    AnsweredBefore,
    Conflict,
    ConversationStore,
    InvalidInput,
    LegacyTurns,
    NotFound,
    RetryPolicy,
    SteeringInbox,
    StorageFailure,
    StorageUnavailable,
    StoreError,
    TranscriptMoved,
    TurnRules,
    VersionMismatch,
    with_retries,
)
from agent_store.legacy import LEGACY_TURNS
from agent_store.store import PENDING_CALLS_KEPT, _deletions, _pop, plan_turn, storage_errors
from agent_store.store._logger import Corrected, HeldOff, OtherContent
from app.examples import EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID, example_turns
from tests.conftest import COUNTED, Backend
from tests.test_logger import log_example

CID = "conv-reliability"


class FailOnce:
    """A collection whose `method` fails once with a network error, before or after applying
    (its call after the first `skip` ones)."""

    def __init__(
        self,
        collection: Any,
        method: str,
        *,
        after_applying: bool,
        skip: int = 0,
        hang: bool = False,
    ) -> None:
        self._collection = collection
        self._method = method
        self._after_applying = after_applying
        self._skip = skip
        self._hang = hang
        """Wait for a reply that never comes, rather than fail: a caller's timeout ends it."""
        self.failed = False
        self.hanging = asyncio.Event()
        """Set once the call hangs (with `hang`): the caller may be cut off from then."""

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._collection, name)
        if name != self._method or self.failed:
            return real

        async def fail(*args: Any, **kwargs: Any) -> Any:
            if self._skip:
                self._skip -= 1
                return await real(*args, **kwargs)
            self.failed = True
            if self._after_applying:
                await real(*args, **kwargs)
            if self._hang:
                self.hanging.set()
                await asyncio.Event().wait()
            raise AutoReconnect(f"connection lost during {name} (injected)")

        return fail


WRITE_POINTS = [
    pytest.param("_conversations", "find_one_and_update", False, id="reserve-not-applied"),
    pytest.param("_conversations", "find_one_and_update", True, id="reserve-applied-reply-lost"),
    pytest.param("_messages", "insert_many", False, id="insert-not-applied"),
    pytest.param("_messages", "insert_many", True, id="insert-applied-reply-lost"),
]


@pytest.mark.parametrize(("collection", "method", "after_applying"), WRITE_POINTS)
async def test_a_turn_retried_after_a_failure_at_any_write_point_is_stored_once(
    backend: Backend, collection: str, method: str, after_applying: bool
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    turns = example_turns()
    for turn_id, messages in turns[:1]:
        await logger.log_messages(CID, messages, turn_id=turn_id)
    turn_id, messages = turns[1]
    failing = FailOnce(getattr(logger, collection), method, after_applying=after_applying)
    setattr(logger, collection, failing)

    with pytest.raises(StorageUnavailable, match="the database is unreachable") as raised:
        await logger.log_messages(CID, messages, turn_id=turn_id)
    # The driver's words stay on the cause, for logs, never in the message.
    assert "injected" in str(raised.value.__cause__)
    assert "injected" not in raised.value.message
    retried = await logger.log_messages(CID, messages, turn_id=turn_id)

    assert failing.failed
    store = ConversationStore(backend.db)
    stored = await store.transcript(CID)
    expected = len(turns[0][1]) + len(messages)
    assert [m.seq for m in stored] == list(range(expected))
    assert [m.id for m in stored[-len(messages) :]] == [m.id for m in retried.messages]
    conversation = await store.get_conversation(CID)
    assert (conversation.turn_count, conversation.message_count) == (2, expected)


POP_WRITE_POINTS = [
    pytest.param("_conversations", "update_one", 0, False, id="mark-not-applied"),
    pytest.param("_conversations", "update_one", 0, True, id="mark-applied-reply-lost"),
    pytest.param("_messages", "delete_one", 0, False, id="removal-not-applied"),
    pytest.param("_messages", "delete_one", 0, True, id="removal-applied-reply-lost"),
    pytest.param("_conversations", "update_one", 1, False, id="summary-not-applied"),
    pytest.param("_conversations", "update_one", 1, True, id="summary-applied-reply-lost"),
]
"""A pop's three writes: the mark on the conversation, the removal, the summary update."""


async def log_three_turns(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    for name, tokens in (("A", 1), ("B", 10), ("C", 100)):
        answer = {"role": "assistant", "content": f"{name}!"}
        usage = {"input_tokens": tokens, "output_tokens": tokens}
        await logger.log_messages(
            CID, [{"role": "user", "content": f"{name}?"}, {**answer, "token_usage": usage}]
        )


async def summary_disagreements(store: ConversationStore) -> list[str]:
    """What the conversation's summary says that its stored messages do not."""
    messages, conversation = await store.transcript(CID), await store.get_conversation(CID)
    used = [m.token_usage.input_tokens for m in messages if m.token_usage]
    texts = [m.content for m in messages if isinstance(m.content, str)]
    said = (conversation.message_count, conversation.usage.input_tokens)
    said += (conversation.turn_count, conversation.last_message_preview)
    true = (len(messages), sum(used), sum(m.role == "user" for m in messages), texts[-1])
    return [f"{name} {s!r} != {t!r}" for name, s, t in
            zip(("message_count", "usage", "turn_count", "preview"), said, true, strict=True)
            if s != t]  # fmt: skip


@pytest.mark.parametrize(("collection", "method", "skip", "after_applying"), POP_WRITE_POINTS)
async def test_a_pop_retried_after_a_failure_at_any_write_point_removes_one_message(
    backend: Backend, collection: str, method: str, skip: int, after_applying: bool
) -> None:
    """RELIABILITY.md: retrying StorageUnavailable is safe. A pop retried with `with_retries`
    removes the last message once, answers it, and leaves the summary true."""
    await log_three_turns(backend)
    store = ConversationStore(backend.db)
    failing = FailOnce(getattr(store, collection), method, after_applying=after_applying,
                       skip=skip)  # fmt: skip
    setattr(store, collection, failing)

    policy = RetryPolicy(attempts=3, first_delay=0.01, max_delay=0.02)
    popped = await with_retries(lambda: store.pop_last_message(CID), policy=policy)

    assert failing.failed
    assert popped is not None
    assert popped.content == "C!"
    contents = [m.content for m in await store.transcript(CID)]
    assert contents == ["A?", "A!", "B?", "B!", "C?"]
    assert await summary_disagreements(store) == []
    assert (await store.pop_last_message(CID) or popped).content == "C?"
    assert await summary_disagreements(store) == []


@pytest.mark.parametrize(("collection", "method", "skip", "after_applying"), POP_WRITE_POINTS)
async def test_a_pop_cut_off_by_a_timeout_at_any_write_point_removes_one_message_when_retried(
    backend: Backend, collection: str, method: str, skip: int, after_applying: bool
) -> None:
    """A caller's timeout cancels the pop while a write is on its way: its outcome is as
    unknown as after a network error, and its retry through the same store removes the
    message the first attempt took, no other. Cut off once the write hangs, however slow
    the machine is to reach it (a fixed timeout could cut it before, and the retry would
    then meet the hang)."""
    await log_three_turns(backend)
    store = ConversationStore(backend.db)
    hanging = FailOnce(getattr(store, collection), method, after_applying=after_applying,
                       skip=skip, hang=True)  # fmt: skip
    setattr(store, collection, hanging)

    first = asyncio.create_task(store.pop_last_message(CID))
    await asyncio.wait_for(hanging.hanging.wait(), timeout=60)
    first.cancel()  # what a caller's timeout does, once the write is on its way
    with pytest.raises(asyncio.CancelledError):
        await first
    popped = await store.pop_last_message(CID)

    assert hanging.failed
    assert popped is not None
    assert popped.content == "C!"
    assert [m.content for m in await store.transcript(CID)] == ["A?", "A!", "B?", "B!", "C?"]
    assert await summary_disagreements(store) == []


async def test_a_pop_that_died_after_removing_its_message_is_finished_by_the_next_one(
    backend: Backend,
) -> None:
    """The summary update of a pop lost for good (its process died, or it was not retried):
    the next pop, by anyone, finishes it before removing the message it was asked for."""
    await log_three_turns(backend)
    dying = ConversationStore(backend.db)
    dying._conversations = FailOnce(dying._conversations, "update_one", after_applying=False,
                                    skip=1)  # fmt: skip
    with pytest.raises(StorageUnavailable):
        await dying.pop_last_message(CID)
    store = ConversationStore(backend.db)

    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.content == "C?"
    assert [m.content for m in await store.transcript(CID)] == ["A?", "A!", "B?", "B!"]
    assert await summary_disagreements(store) == []


async def a_pop_that_died(backend: Backend) -> str:
    """Turn A, then turn B whose answer makes call `call-b` (tokens 3 and 5), popped by a pop
    whose summary update is lost for good (its caller gives up, as a dying process does): the
    mark stands, the message is gone. The removed message's id."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    first = [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "A!"}]
    await logger.log_messages(CID, first, turn_id="A")
    call = {"id": "call-b", "function": {"name": "lookup", "arguments": "{}"}}
    usage = {"input_tokens": 3, "output_tokens": 5}
    made = {"role": "assistant", "tool_calls": [call], "token_usage": usage}
    logged = await logger.log_messages(CID, [{"role": "user", "content": "B?"}, made], turn_id="B")
    dying = ConversationStore(backend.db)
    dying._conversations = FailOnce(dying._conversations, "update_one", after_applying=False,
                                    skip=1)  # fmt: skip
    with pytest.raises(StorageUnavailable):
        await dying.pop_last_message(CID)
    assert await backend.db["agent_messages"].count_documents({"_id": logged.messages[1].id}) == 0
    return logged.messages[1].id


async def test_reads_after_a_pop_that_died_serve_the_summary_without_its_message(
    backend: Backend,
) -> None:
    """RELIABILITY.md (pops): no read serves the summary of a message a pop under way has
    removed. The pop's summary update lost for good, a read finishes the pop (as the next pop
    would) and answers as if the message had never been logged: its call not pending, its
    tokens not counted."""
    await a_pop_that_died(backend)
    store = ConversationStore(backend.db)

    pending = await store.pending_calls(CID)
    conversation = await store.get_conversation(CID)

    assert pending == []
    assert (conversation.usage.input_tokens, conversation.usage.output_tokens) == (0, 0)
    assert (conversation.message_count, conversation.turn_count) == (3, 2)
    assert conversation.last_message_preview == "B?"
    assert await store.pending_hitl(CID) is None
    assert [m.content for m in await store.transcript(CID)] == ["A?", "A!", "B?"]


async def test_a_turn_after_a_pop_that_died_finishes_it_and_an_answer_to_its_call_is_refused(
    backend: Backend,
) -> None:
    """RELIABILITY.md (pops): no write decides on a summary a pop under way has not corrected
    yet. A turn finds the pop's mark, finishes the pop, then decides on the summary without
    the removed message: an answer to the call that message made awaits nothing (refused,
    nothing stored), and a turn after it takes the `seq` the pop gave back."""
    removed = await a_pop_that_died(backend)
    logger = AgentMessageLogger(backend.db)
    result = {"role": "tool", "tool_call_id": "call-b", "content": "found"}

    with pytest.raises(InvalidInput, match="does not make call 'call-b'"):
        await logger.check_turn(CID, [result], turn_id="D", answers_to={"call-b": removed})
    with pytest.raises(InvalidInput, match="does not make call 'call-b'"):
        await logger.log_messages(CID, [result], turn_id="D", answers_to={"call-b": removed})
    logged = await logger.log_messages(CID, [{"role": "user", "content": "C?"}], turn_id="C")

    assert [m.seq for m in logged.messages] == [3]
    store = ConversationStore(backend.db)
    assert [m.content for m in await store.transcript(CID)] == ["A?", "A!", "B?", "C?"]
    assert await summary_disagreements(store) == []
    assert await store.pending_calls(CID) == []


async def test_a_tail_reader_after_the_message_of_a_pop_that_died_reads_on_from_its_seq(
    backend: Backend,
) -> None:
    """RELIABILITY.md: a tail reader's `after` naming a message a pop removed reads on from
    there, its pop's summary update lost or not: the pop's mark names the message and its
    `seq` until a write or a read finishes it."""
    removed = await a_pop_that_died(backend)
    conversations = backend.db["agent_conversations"]
    assert (await conversations.find_one({"_id": CID}))["popping"]["message_id"] == removed
    store = ConversationStore(backend.db)

    waiting = await store.messages_page(CID, after=removed)
    await AgentMessageLogger(backend.db).log_messages(
        CID, [{"role": "user", "content": "C?"}], turn_id="C"
    )
    followed = await store.messages_page(CID, after=removed)

    assert waiting.data == []
    assert waiting.pending_seq is None
    assert [m.content for m in followed.data] == ["C?"]


async def test_a_pop_scoped_to_another_user_never_answers_or_consumes_the_owners_pop(
    backend: Backend,
) -> None:
    """DESIGN §3 Ownership: a user acts only on what it owns. One store serves every user
    of a runtime; the owner's pop raises, then another user pops the same conversation id:
    it sees nothing, and the owner's retry still removes exactly one message."""
    logger = AgentMessageLogger(backend.db)
    for i, (asked, answered) in enumerate((("A?", "A!"), ("B?", "B!"), ("C?", "C!"))):
        await logger.log_messages(
            CID,
            [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}],
            user_id="user-ada",
            turn_id=f"t{i}",
        )
    store = ConversationStore(backend.db)
    failing = FailOnce(store._messages, "delete_one", after_applying=False)
    store._messages = failing  # type: ignore[assignment]
    with pytest.raises(StorageUnavailable):
        await store.pop_last_message(CID, user_id="user-ada")

    strangers = await store.pop_last_message(CID, user_id="user-mallory")
    owners_retry = await store.pop_last_message(CID, user_id="user-ada")

    assert strangers is None
    assert owners_retry is not None
    assert owners_retry.content == "C!"
    contents = [m.content for m in await store.transcript(CID)]
    assert contents == ["A?", "A!", "B?", "B!", "C?"]


@pytest.mark.parametrize("skip", [0, 1], ids=["mark-lost", "summary-update-lost"])
async def test_a_pop_after_its_conversation_was_deleted_and_started_again_removes_its_message(
    backend: Backend, skip: int
) -> None:
    """RUNTIMES.md: the retry of a pop that raised answers the message the earlier attempt
    removed from that conversation. An Agents SDK session whose pop_item raised, then
    clear_session() (delete) and a new turn under the same id: the next pop removes the
    new conversation's last message, never answers the deleted one's."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "old question"}, {"role": "assistant", "content": "old"}],
        turn_id="t1",
    )
    store = ConversationStore(backend.db)
    real = store._conversations
    store._conversations = FailOnce(real, "update_one", after_applying=False, skip=skip)  # type: ignore[assignment]
    with pytest.raises(StorageUnavailable):
        await store.pop_last_message(CID)
    store._conversations = real  # type: ignore[assignment]

    await store.delete(CID)
    await logger.log_messages(CID, [{"role": "user", "content": "new question"}], turn_id="t2")
    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.content == "new question"
    assert await store.transcript(CID) == []


@pytest.mark.parametrize(
    "stored", ["with epochs", "before epochs", "before epochs, the same created_at"]
)
async def test_a_pop_whose_conversation_was_deleted_and_started_again_before_its_mark_pops_the_new(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, stored: str
) -> None:
    """RELIABILITY.md (deleted and created again under its id by anyone: none of it shows in
    the new conversation): a pop marks only the life of the message it read (its `epoch`;
    for a conversation stored before epochs, its `created_at`, read before the message).
    Deleted and started again under the id, with as many messages, between the pop's read
    of the last message and its mark, the pop removes the new conversation's last message,
    never answers the deleted one's, and the new conversation's summary stays its own (was:
    the deleted conversation's message answered, the new one's summary corrected for it,
    its own last message kept; before epochs, until this release's second fix; and when the
    new conversation's first message was given the deleted one's `created_at`, a caller's
    choice, until its third: a life read without an epoch is told by having none yet too)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    same = stored.endswith("the same created_at")
    at = {"created_at": datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)} if same else {}
    old = [
        {"role": "user", "content": "old question"} | at,
        {"role": "assistant", "content": "old"} | at,
    ]
    await logger.log_messages(CID, old, turn_id="t1")
    if stored.startswith("before epochs"):
        await backend.db["agent_conversations"].update_one({"_id": CID}, {"$unset": {"epoch": ""}})
        await backend.db["agent_messages"].update_many(
            {"conversation_id": CID}, {"$unset": {"epoch": ""}}
        )
    real, raced = _pop.Pop._gaps_below, list[bool]()

    async def deleted_and_started_again(self: Any, *args: Any) -> bool:
        if not raced:
            raced.append(True)
            await store.delete(CID)
            new = [
                {"role": "user", "content": "new question"} | at,
                {"role": "assistant", "content": "new"} | at,
            ]
            await logger.log_messages(CID, new, turn_id="t2")
        return await real(self, *args)

    monkeypatch.setattr(_pop.Pop, "_gaps_below", deleted_and_started_again)
    popped = await store.pop_last_message(CID)
    monkeypatch.undo()

    assert raced
    assert popped is not None
    assert popped.content == "new"
    assert [m.content for m in await store.transcript(CID)] == ["new question"]
    conversation = await store.get_conversation(CID)
    assert conversation.last_message_preview == "new question"


@pytest.mark.parametrize("by", ["delete", "erasure"])
async def test_a_delete_racing_the_first_turn_since_epochs_of_its_conversation_takes_it_whole(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, by: str
) -> None:
    """DESIGN.md (a delete or an erasure takes the conversation it found: by its `created_at`
    for one stored before epochs): the conversation's own first turn since epochs draws its
    epoch between the delete's read and its mark. It is the life the delete found, so the
    delete takes it, its new turn too, and says so (kept as it was when a stricter filter
    for a life read without an epoch, fit for a fold or a pop that read again, answered
    `conversations: 0` and left every message)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    at = {"created_at": datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)}
    said = [{"role": "user", "content": "my secret"} | at, {"role": "assistant", "content": "ok"}]
    await logger.log_messages(CID, said, turn_id="t1", user_id="ada")
    await backend.db["agent_conversations"].update_one({"_id": CID}, {"$unset": {"epoch": ""}})
    unset = {"$unset": {"epoch": ""}}
    await backend.db["agent_messages"].update_many({"conversation_id": CID}, unset)
    real, raced = _deletions.DeletionRecords.record, list[bool]()

    async def first_turn_since_epochs(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not raced:
            raced.append(True)
            more = [{"role": "user", "content": "second secret"}]
            await logger.log_messages(CID, more, turn_id="t2", user_id="ada")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(_deletions.DeletionRecords, "record", first_turn_since_epochs)
    if by == "delete":
        deleted = await store.delete(CID, user_id="ada")
    else:
        deleted = await store.erase_user("ada")
    monkeypatch.undo()

    assert raced
    assert deleted.conversations == 1
    assert await backend.db["agent_conversations"].count_documents({"_id": CID}) == 0
    assert await backend.db["agent_messages"].count_documents({"conversation_id": CID}) == 0


async def test_the_same_turn_logged_by_two_writers_at_once_is_stored_once(
    backend: Backend,
) -> None:
    """Two pods retrying one turn at the same moment: one reserves, the other replays."""
    await AgentMessageLogger(backend.db).ensure_indexes()
    turn_id, messages = example_turns()[0]
    first, second = AgentMessageLogger(backend.db), AgentMessageLogger(backend.db)

    results = await asyncio.gather(
        first.log_messages(CID, messages, turn_id=turn_id),
        second.log_messages(CID, messages, turn_id=turn_id),
    )

    assert sorted(r.replayed for r in results) == [False, True]
    assert await backend.db.agent_messages.count_documents({}) == len(messages)
    conversation = await ConversationStore(backend.db).get_conversation(CID)
    assert (conversation.turn_count, conversation.message_count) == (1, len(messages))


class HeldInsert:
    """The messages collection, whose first `insert_many` waits until released before it
    reaches the server: a writer stalled between its pre-insert check and its insert."""

    def __init__(self, collection: Any) -> None:
        self._collection = collection
        self.reached = asyncio.Event()
        self.release = asyncio.Event()
        self._done = False

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._collection, name)
        if name != "insert_many" or self._done:
            return real

        async def held(*args: Any, **kwargs: Any) -> Any:
            self._done = True
            self.reached.set()
            await self.release.wait()
            return await real(*args, **kwargs)

        return held


def _answer(version: int, answers: int) -> list[dict[str, Any]]:
    answer = {
        "role": "assistant",
        "content": f"version {version}",
        "token_usage": {"input_tokens": 1, "output_tokens": 1},
    }
    return [{"role": "user", "content": "q"}, *[answer] * answers]


@pytest.mark.parametrize(
    ("sent", "answers"),
    [(1, 1), (1, 2), (2, 1)],
    ids=["as-many", "retry-sends-more", "stalled-sends-more"],
)
async def test_a_stalled_insert_landing_after_a_retry_logged_other_content_deletes_nothing(
    backend: Backend, sent: int, answers: int
) -> None:
    """A first attempt passes its pre-insert check, then its insert stalls past
    `abandon_after`; a retry regenerating the answer gives its empty block back and is logged
    at the end. The stalled insert then meets the retry's messages under the turn's ids: the
    turn was logged with other content meanwhile, so it is refused (`OtherContent`), takes
    back only what it inserted, and the retry's acknowledged messages stay, counted as
    stored."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [{"role": "user", "content": "hello"}], turn_id="t0")
    stalled = AgentMessageLogger(backend.db)
    held = HeldInsert(stalled._messages)
    stalled._messages = held
    first = asyncio.create_task(stalled.log_messages(CID, _answer(0, sent), turn_id="same"))
    await held.reached.wait()
    patient = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))

    retried = await patient.log_messages(CID, _answer(1, answers), turn_id="same")
    held.release.set()

    with pytest.raises(OtherContent, match="logged with other content"):
        await first
    stored = await backend.db.agent_messages.find({"conversation_id": CID}).to_list(None)
    assert sorted((d["seq"], d["content"]) for d in stored) == [
        (0, "hello"),
        *[(m.seq, m.content) for m in retried.messages],
    ]
    conversation = await backend.db.agent_conversations.find_one({"_id": CID})
    assert conversation["turn_count"] == 2
    assert conversation["usage"] == {"input_tokens": answers, "output_tokens": answers}
    seqs = {d["seq"] for d in stored} | set(conversation.get("popped_seqs") or ())
    assert seqs == set(range(conversation["message_count"]))
    again = await patient.log_messages(CID, _answer(1, answers), turn_id="same")
    assert again.replayed
    assert [(m.id, m.seq) for m in again.messages] == [(m.id, m.seq) for m in retried.messages]


@pytest.mark.parametrize(
    ("pops", "refused"),
    [(1, OtherContent), (2, Corrected)],
    ids=["answer-popped", "turn-popped"],
)
async def test_a_stalled_insert_landing_in_a_given_back_block_after_a_pop_deletes_nothing(
    backend: Backend, pops: int, refused: type[Exception]
) -> None:
    """As above, and a person pops the retry's answer (or the whole retried turn) before the
    stalled insert lands: the conversation records the turn in another block, so the late
    insert, meeting the retry's user message with its own content, deletes nothing there and
    fills nothing of the block given back; it takes back what it inserted and is refused
    (`OtherContent`; `Corrected` when it met nothing, the whole turn popped). What the pops
    removed stays removed. The stall outlasts the stalled writer's `claim_grace`, as any
    stall a retry passes does (it outlasts `abandon_after`)."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [{"role": "user", "content": "hello"}], turn_id="t0")
    stalled = AgentMessageLogger(backend.db, rules=TurnRules(claim_grace=timedelta(0)))
    held = HeldInsert(stalled._messages)
    stalled._messages = held
    first = asyncio.create_task(stalled.log_messages(CID, _answer(0, 1), turn_id="same"))
    await held.reached.wait()
    rules = TurnRules(abandon_after=timedelta(0))
    retried = await AgentMessageLogger(backend.db, rules=rules).log_messages(
        CID, _answer(1, 1), turn_id="same"
    )
    store = ConversationStore(backend.db, rules=rules)
    for _ in range(pops):
        await store.pop_last_message(CID)
    held.release.set()

    with pytest.raises(refused):
        await first
    kept = [(m.seq, m.content) for m in retried.messages][: len(retried.messages) - pops]
    stored = await backend.db.agent_messages.find({"conversation_id": CID}).to_list(None)
    assert sorted((d["seq"], d["content"]) for d in stored) == [(0, "hello"), *kept]
    assert [(m.seq, m.content) for m in await store.transcript(CID)] == [(0, "hello"), *kept]
    conversation = await backend.db.agent_conversations.find_one({"_id": CID})
    assert conversation["turn_count"] == (2 if kept else 1)


async def test_a_stalled_move_landing_in_a_given_back_block_after_a_pop_is_refused(
    backend: Backend,
) -> None:
    """A lost turn's late retry moves it to a new block, and its insert there stalls; a
    retry with other content gives that block back and is logged at the end, and a person
    pops its answer. The stalled insert then lands in the given-back block: the turn is
    recorded elsewhere, so it takes back what it inserted and is refused (`OtherContent`),
    not answered with the other retry's question as its turn."""
    zero = TurnRules(abandon_after=timedelta(0), claim_grace=timedelta(0))
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [{"role": "user", "content": "hello"}], turn_id="t0")
    await logger.log_messages(CID, _answer(0, 1), turn_id="same")
    await backend.db.agent_messages.delete_many({"turn_id": "same"})  # its insert lost
    await logger.log_messages(CID, [{"role": "user", "content": "x"}], turn_id="t1")
    stalled = AgentMessageLogger(backend.db, rules=zero)
    held = HeldInsert(stalled._messages)
    stalled._messages = held
    first = asyncio.create_task(stalled.log_messages(CID, _answer(0, 1), turn_id="same"))
    await held.reached.wait()
    retried = await AgentMessageLogger(backend.db, rules=zero).log_messages(
        CID, _answer(1, 1), turn_id="same"
    )
    await ConversationStore(backend.db, rules=zero).pop_last_message(CID)
    held.release.set()

    with pytest.raises(OtherContent, match="logged with other content"):
        await first
    stored = await backend.db.agent_messages.find({"conversation_id": CID}).to_list(None)
    question = retried.messages[0]
    assert sorted((d["seq"], d["content"]) for d in stored) == [
        (0, "hello"),
        (3, "x"),
        (question.seq, "q"),
    ]


async def test_an_earlier_lifes_late_message_in_a_lost_turns_block_gives_way_to_its_retry(
    backend: Backend,
) -> None:
    """A deleted conversation's late insert lands in the block a lost turn of the new life
    reserved under the id: it is a stray of another life, not another turn's message, so the
    turn's retry past `abandon_after` is not refused as the block's "other turn"; it is
    stored, and the earlier life's message is not served."""
    logger = AgentMessageLogger(backend.db, rules=COUNTED)
    await logger.ensure_indexes()
    store = ConversationStore(backend.db, rules=COUNTED)
    asked = [{"role": "user", "content": "draft question"}, {"role": "assistant", "content": "A"}]
    old = [{"role": "user", "content": "old life"}, {"role": "assistant", "content": "B"}]
    await logger.log_messages(CID, old, turn_id="old")
    late = await backend.db.agent_messages.find_one({"conversation_id": CID, "seq": 0})
    await store.delete(CID)
    await logger.log_messages(CID, asked, turn_id="t-lost")
    await backend.db.agent_messages.delete_many({})  # its insert lost
    await backend.db.agent_messages.insert_one(late)  # the deleted life's, landing late
    weather = [{"role": "user", "content": "weather"}, {"role": "assistant", "content": "C"}]
    await logger.log_messages(CID, weather, turn_id="t2")
    long_ago = datetime.now(UTC) - timedelta(minutes=10)
    await backend.db.agent_conversations.update_one({"_id": CID}, {"$set": {"turns.0.a": long_ago}})

    retried = await logger.log_messages(CID, asked, turn_id="t-lost")

    assert [m.content for m in retried.messages] == ["draft question", "A"]
    served = [m.content for m in await store.transcript(CID)]
    assert "old life" not in served
    assert served.count("draft question") == 1


@pytest.mark.wire
async def test_writers_on_separate_connections_share_one_seq_sequence(wire_uri: str) -> None:
    """Three clients (as three pods) log 4 turns each into one conversation, all at once."""
    clients = [AsyncMongoClient(wire_uri, tz_aware=True) for _ in range(3)]
    db_name = "pods_sharing_a_conversation"
    try:
        loggers = [AgentMessageLogger(client[db_name]) for client in clients]
        await loggers[0].ensure_indexes()

        async def pod(number: int, logger: AgentMessageLogger) -> None:
            for turn in range(4):
                await logger.log_messages(
                    CID,
                    [
                        {"role": "user", "content": f"pod {number} asks {turn}"},
                        {"role": "assistant", "content": f"pod {number} answers {turn}"},
                    ],
                    turn_id=f"pod{number}-turn{turn}",
                )

        await asyncio.gather(*(pod(n, logger) for n, logger in enumerate(loggers)))

        store = ConversationStore(clients[0][db_name])
        stored = await store.transcript(CID)
        assert [m.seq for m in stored] == list(range(24))
        for question, answer in zip(stored[::2], stored[1::2], strict=True):
            assert question.turn_id == answer.turn_id
        conversation = await store.get_conversation(CID)
        assert (conversation.turn_count, conversation.message_count) == (12, 24)
    finally:
        await clients[0].drop_database(db_name)
        for client in clients:
            await client.close()


async def test_an_unreachable_database_is_reported_as_retryable_and_nothing_is_lost() -> None:
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        "mongodb://127.0.0.1:9/?directConnection=true", serverSelectionTimeoutMS=200
    )
    try:
        with pytest.raises(StorageUnavailable, match="could not reserve the turn: the database"):
            await AgentMessageLogger(client["down"]).log_messages(
                CID, [{"role": "user", "content": "hello?"}], turn_id="t1"
            )
    finally:
        await client.close()
        collect_refused_sockets()


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(errors.AutoReconnect("connection reset"), id="connection-lost"),
        pytest.param(errors.ServerSelectionTimeoutError("no primary"), id="no-server"),
        pytest.param(errors.NetworkTimeout("timed out"), id="network-timeout"),
        pytest.param(errors.ExecutionTimeout("maxTimeMS"), id="execution-timeout"),
        pytest.param(errors.WaitQueueTimeoutError("pool full"), id="connection-pool-full"),
        pytest.param(errors.WTimeoutError("waiting for replication"), id="write-concern-timeout"),
    ],
)
def test_errors_that_may_pass_on_their_own_are_reported_as_retryable(
    error: errors.PyMongoError,
) -> None:
    """What may pass on its own (a busy pool, a lost connection, a timeout, even one after the
    write was applied) is StorageUnavailable, the one error `with_retries` retries."""
    with (
        pytest.raises(StorageUnavailable, match="could not reserve the turn"),
        storage_errors("reserve the turn"),
    ):
        raise error


def _unresolved_srv_host() -> errors.ConfigurationError:
    """What PyMongo raises when a `mongodb+srv://` host has no SRV record in DNS."""
    from dns.resolver import NXDOMAIN

    try:
        try:
            raise NXDOMAIN()
        except NXDOMAIN as exc:
            raise errors.ConfigurationError(
                "The DNS query name does not exist: _mongodb._tcp.cluster0.typo.example."
            ) from exc
    except errors.ConfigurationError as raised:
        return raised


def test_a_connection_string_whose_host_does_not_resolve_is_reported_as_such() -> None:
    """No database was reached: the error must not say one refused the operation."""
    with (
        pytest.raises(StorageFailure) as caught,
        storage_errors("connect to the database"),
    ):
        raise _unresolved_srv_host()
    assert str(caught.value) == (
        "could not connect to the database: the connection string's host could not be "
        "resolved (a mongodb+srv:// host needs its SRV record in DNS)"
    )
    assert "typo" not in str(caught.value)


def test_a_client_configuration_the_driver_refuses_is_not_blamed_on_the_database() -> None:
    with (
        pytest.raises(StorageFailure, match="the driver refused the connection string or"),
        storage_errors("connect to the database"),
    ):
        raise errors.ConfigurationError("Only one TXT record is supported")


def collect_refused_sockets() -> None:
    """PyMongo's async driver on Python 3.11 leaves a refused connection's socket to the
    garbage collector: collect it here rather than in whichever test runs next."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("$message_count", id="field-path"),
        pytest.param("$$ROOT", id="variable"),
        pytest.param('{"$where": "sleep(1000)"}', id="js-operator"),
    ],
)
async def test_text_that_looks_like_an_operator_is_stored_as_it_was_typed(
    backend: Backend, text: str
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(
        CID,
        [
            {"role": "user", "content": text},
            {
                "role": "assistant",
                "content": text,
                "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": text}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": text},
        ],
        name=text,
        turn_id="t1",
    )
    store = ConversationStore(backend.db)
    conversation = await store.get_conversation(CID)
    assert (conversation.name, conversation.last_message_preview) == (text, text)
    assert conversation.message_count == 3
    stored = await store.transcript(CID)
    assert [m.content for m in stored] == [text, text, text]
    assert stored[1].tool_calls is not None
    assert stored[1].tool_calls[0].function.arguments == text


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=20), st.floats(allow_nan=False)
)
_field_values = st.one_of(
    _scalars,
    st.lists(_scalars, max_size=3),
    st.dictionaries(st.text(max_size=8), _scalars, max_size=3),
)
_message_like = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "narrator", ""])},
    optional={
        key: _field_values
        for key in (
            "content", "tool_calls", "tool_call_id", "hitl_action", "error", "upload",
            "created_at", "token_usage", "latency_ms", "seq", "_id", "$set", "surprise",
        )
    },
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turn=st.lists(_message_like, max_size=5))
def test_any_malformed_turn_is_planned_or_refused_with_invalid_input(
    turn: list[dict[str, Any]],
) -> None:
    """Planning is the gate before any write: it accepts a turn or raises InvalidInput only."""
    refused: InvalidInput | None = None
    try:
        plan = plan_turn(CID, turn, turn_id="t1")
    except InvalidInput as error:
        refused = error
    if refused is not None:
        assert refused.message.startswith("invalid")
    else:
        assert len(plan.messages) == len(turn)
        assert all(m.conversation_id == CID and m.id for m in plan.messages)


# -- pops at once ---------------------------------------------------------------------------


async def _two_turns_of_two(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    for i in range(2):
        await logger.log_messages(
            CID,
            [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"}],
            turn_id=f"t{i}",
        )


async def _stored_contents(backend: Backend) -> list[Any]:
    docs = (
        await backend.db.agent_messages.find({"conversation_id": CID}).sort("seq", 1).to_list(None)
    )
    return [d["content"] for d in docs]


class SlowAfterMark:
    """The first `update_one` (a pop's mark) is applied, then its reply held until released."""

    def __init__(self, collection: Any) -> None:
        self._collection = collection
        self.marked = asyncio.Event()
        self.release = asyncio.Event()
        self._done = False

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._collection, name)
        if name != "update_one" or self._done:
            return real

        async def held(*args: Any, **kwargs: Any) -> Any:
            self._done = True
            result = await real(*args, **kwargs)
            self.marked.set()
            await self.release.wait()
            return result

        return held


async def test_two_pops_at_once_through_one_store_take_two_messages(backend: Backend) -> None:
    """A pop whose mark is applied and whose reply is slow is not taken for an earlier attempt
    that raised by a second pop through the same store: each removes its own message."""
    await _two_turns_of_two(backend)
    store = ConversationStore(backend.db)
    slow = SlowAfterMark(store._conversations)
    store._conversations = slow
    first = asyncio.create_task(store.pop_last_message(CID))
    await slow.marked.wait()
    second = asyncio.create_task(store.pop_last_message(CID))
    await asyncio.sleep(0.05)
    slow.release.set()
    popped = await asyncio.gather(first, second)

    assert sorted(m.content for m in popped if m is not None) == ["a1", "u1"]
    assert await _stored_contents(backend) == ["u0", "a0"]


@pytest.mark.wire
async def test_pops_losing_to_other_pops_are_retried_and_each_removes_one(
    wire_backend: Backend,
) -> None:
    """Six stores pop at once: a pop that other pops kept coming before raises
    StorageUnavailable (it may pass), so `with_retries` retries it; seven messages go."""
    logger = AgentMessageLogger(wire_backend.db)
    await logger.ensure_indexes()
    for i in range(6):
        await logger.log_messages(
            CID, [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"}],
            turn_id=f"t{i}",
        )  # fmt: skip
    stores = [ConversationStore(wire_backend.db) for _ in range(6)]
    await stores[0].pop_last_message(CID)
    quick = RetryPolicy(first_delay=0.01, max_delay=0.05)
    popped = await asyncio.gather(
        *(with_retries(lambda s=s: s.pop_last_message(CID), policy=quick) for s in stores)
    )

    assert all(m is not None for m in popped)
    assert len(await _stored_contents(wire_backend)) == 12 - 7


class FailingCalls:
    """A collection whose calls of a method, by their number (from 0), fail with a network
    error before they are sent."""

    def __init__(self, collection: Any, fail: dict[str, set[int]]) -> None:
        self._collection, self._fail, self._calls = collection, fail, Counter[str]()

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._collection, name)
        if name not in self._fail:
            return real

        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            number = self._calls[name]
            self._calls[name] += 1
            if number in self._fail[name]:
                raise AutoReconnect("connection lost (injected)")
            return await real(*args, **kwargs)

        return wrapped


async def test_a_pop_whose_mark_never_arrived_pops_again_after_another_pop_took_its_message(
    backend: Backend,
) -> None:
    """A pop's mark is lost before the server sees it (its outcome unknown to it); another
    process pops the same last message; the first pop's retry removes the next one and
    answers it: two pops, two messages, each answered once."""
    await _two_turns_of_two(backend)
    store = ConversationStore(backend.db)
    real = store._conversations
    store._conversations = FailingCalls(real, {"update_one": {0}})
    with pytest.raises(StorageUnavailable):
        await store.pop_last_message(CID)
    store._conversations = real
    other = await ConversationStore(backend.db).pop_last_message(CID)

    retried = await store.pop_last_message(CID)

    assert (other and other.content, retried and retried.content) == ("a1", "u1")
    assert await _stored_contents(backend) == ["u0", "a0"]


async def test_a_pops_late_delete_takes_nothing_of_a_conversation_started_again_under_the_id(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pop marks the last message, and its delete of it reaches the server only after the
    conversation was deleted and started again with turns of the same ids (the same message
    ids): the new conversation keeps its messages."""
    await _two_turns_of_two(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(milliseconds=50)))
    messages = store._messages
    delete_one = messages.delete_one

    async def arriving_late(*args: Any, **kwargs: Any) -> Any:
        await ConversationStore(backend.db).delete(CID)
        await _two_turns_of_two(backend)
        return await delete_one(*args, **kwargs)

    monkeypatch.setattr(messages, "delete_one", arriving_late)
    await store.pop_last_message(CID)

    assert await _stored_contents(backend) == ["u0", "a0", "u1", "a1"]


async def test_a_pop_whose_retry_fails_too_is_still_retried_as_one(backend: Backend) -> None:
    """The first attempt marks and removes, then its summary update fails; the second fails
    on its first read; the third answers the message the first removed, removing no other."""
    await _two_turns_of_two(backend)
    store = ConversationStore(backend.db)
    real = store._conversations
    store._conversations = FailingCalls(real, {"update_one": {1}, "find_one": {0}})
    for _ in range(2):
        with pytest.raises(StorageUnavailable):
            await store.pop_last_message(CID)
    store._conversations = real

    popped = await store.pop_last_message(CID)

    assert popped is not None
    assert popped.content == "a1"
    assert await _stored_contents(backend) == ["u0", "a0", "u1"]


@pytest.mark.parametrize("later", [0, 5], ids=["record-kept", "record-dropped"])
@pytest.mark.parametrize("dead_above", [False, True], ids=["plain", "dead-turn-above"])
async def test_a_retry_of_a_turn_whose_answer_a_person_popped_is_corrected_however_late(
    backend: Backend, later: int, dead_above: bool
) -> None:
    """`pop_last_message`: a retry of a turn a pop took a message of is refused `Corrected`,
    writing nothing, however many turns came since: while its record is kept (marked popped)
    and once it is dropped (`turns_recorded` 4 here), the conversation listing the popped
    answer's id at its `seq` in the turn's block. So too when a turn reserved above it whose
    insert never came (passed by the pop, so the answer's `seq` stays a gap): the refusal
    never says the turn was stored in part, which would have the runtime log the removed
    answer again under a new turn id. `check_turn` says the same."""
    rules = TurnRules(turns_recorded=4, abandon_after=timedelta(0))
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, [{"role": "user", "content": "hello"}], turn_id="t0")
    await logger.log_messages(CID, _answer(0, 1), turn_id="T")
    if dead_above:
        await logger.log_messages(CID, _answer(9, 1), turn_id="dead")
        await backend.db.agent_messages.delete_many({"turn_id": "dead"})  # never inserted
    popped = await ConversationStore(backend.db, rules=rules).pop_last_message(CID)
    assert popped is not None
    assert popped.turn_id == "T"
    for n in range(later):
        await logger.log_messages(CID, [{"role": "user", "content": f"later {n}"}],
                                  turn_id=f"later-{n}")  # fmt: skip
    stored = await _stored_contents(backend)
    conversation = await backend.db.agent_conversations.find_one({"_id": CID})
    corrected = (
        "turn 'T' was corrected since it was logged (a pop removed one of its messages): it "
        "cannot be logged again"
    )

    for call in (logger.check_turn, logger.log_messages):
        with pytest.raises(Corrected, match=re.escape(corrected)):
            await call(CID, _answer(0, 1), turn_id="T")

    assert await _stored_contents(backend) == stored
    assert await backend.db.agent_conversations.find_one({"_id": CID}) == conversation


def _fail_once_after_the_documents_go(
    store: ConversationStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's first command on the messages after it deleted conversation documents fails
    once with a network error (the connection dropped mid-delete)."""
    gone, failed = asyncio.Event(), asyncio.Event()
    for name in ("find_one_and_delete", "delete_many"):
        real = getattr(store._conversations, name)

        async def deleting(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            result = await _real(*args, **kwargs)
            gone.set()
            return result

        monkeypatch.setattr(store._conversations, name, deleting)
    for name in ("find", "delete_many"):
        real = getattr(store._messages, name)

        def failing(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if gone.is_set() and not failed.is_set():
                failed.set()
                raise AutoReconnect("connection dropped")
            return _real(*args, **kwargs)

        monkeypatch.setattr(store._messages, name, failing)


async def _turn_held_in_flight(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, go: asyncio.Event
) -> asyncio.Task[Any]:
    """OWNER's turn "t2" of "c-x" (after "t1"): reserved, its insert held until `go` is set."""
    rules = TurnRules(claim_grace=timedelta(seconds=1))
    logger, slow = AgentMessageLogger(backend.db, rules=rules), AgentMessageLogger(backend.db)
    await logger.log_messages("c-x", [{"role": "user", "content": "old"}], user_id="alice",
                              turn_id="t1")  # fmt: skip
    insert_many, reserved = slow._messages.insert_many, asyncio.Event()

    async def held(*args: Any, **kwargs: Any) -> Any:
        reserved.set()
        await go.wait()
        return await insert_many(*args, **kwargs)

    monkeypatch.setattr(slow._messages, "insert_many", held)
    turn = asyncio.create_task(
        slow.log_messages("c-x", [{"role": "user", "content": "late"}], user_id="alice",
                          turn_id="t2")
    )  # fmt: skip
    await reserved.wait()
    return turn


@pytest.mark.parametrize("erasing", [False, True], ids=["delete", "erase_user"])
async def test_a_delete_failing_after_the_document_went_is_finished_by_its_retry(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, erasing: bool
) -> None:
    """A delete (or erasure) loses its connection right after the conversation document went,
    while a turn that reserved before it still inserts; the caller retries, as it is told to.
    The retry finds no conversation and finishes the delete all the same: the turn's message,
    landing during its wait, goes, and the id serves nothing of it (nor to the next holder)."""
    go = asyncio.Event()
    turn = await _turn_held_in_flight(backend, monkeypatch, go)
    store = ConversationStore(backend.db)
    _fail_once_after_the_documents_go(store, monkeypatch)

    async def the_turn_lands() -> None:
        go.set()
        await turn

    monkeypatch.setattr(store, "_grace", the_turn_lands)

    def attempt() -> Any:
        return store.erase_user("alice") if erasing else store.delete("c-x", user_id="alice")

    with pytest.raises(StorageUnavailable):
        await attempt()
    retried = await attempt()
    await the_turn_lands()

    assert (retried.conversations, retried.messages) == (0, 1)
    assert await backend.db.agent_messages.count_documents({"conversation_id": "c-x"}) == 0
    await AgentMessageLogger(backend.db).log_messages(
        "c-x", [{"role": "user", "content": "bob's"}], user_id="bob"
    )
    assert [m.content for m in await store.transcript("c-x")] == ["bob's"]
    assert await backend.db.agent_deletions.count_documents({}) == 0


@pytest.mark.parametrize("erasing", [False, True], ids=["delete", "erase_user"])
async def test_a_finished_delete_leaves_no_record_of_itself(
    backend: Backend, erasing: bool
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-x", [{"role": "user", "content": "a"}], user_id="alice")
    deleted = await (store.erase_user("alice") if erasing else store.delete("c-x"))
    assert (deleted.conversations, deleted.messages) == (1, 1)
    assert await backend.db.agent_deletions.count_documents({}) == 0


@pytest.mark.parametrize("lost", ["removal", "summary-update"])
async def test_a_pop_in_doubt_retried_after_a_claim_finishes_its_own_pop_and_answers_it(
    backend: Backend, lost: str
) -> None:
    """RUNTIMES.md: `with_retries(lambda: store.pop_last_message(cid))` removes one message.
    The owner's pop raises with its mark applied (its removal, or its summary update, lost),
    then the account is claimed by another user id: the retry still finishes that pop (the
    conversation's bookkeeping, not a read by the old owner) and answers the message it
    removed. The new owner's next turn lands right after the messages left, and its pop
    removes that turn's last message only."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    for i, name in enumerate("ABC"):
        await logger.log_messages(
            CID,
            [{"role": "user", "content": f"{name}?"}, {"role": "assistant", "content": f"{name}!"}],
            user_id="user-guest",
            turn_id=f"t{i}",
        )
    store = ConversationStore(backend.db)
    real = store._messages if lost == "removal" else store._conversations
    failing = (FailOnce(real, "delete_one", after_applying=False) if lost == "removal"
               else FailOnce(real, "update_one", after_applying=False, skip=1))  # fmt: skip
    setattr(store, "_messages" if lost == "removal" else "_conversations", failing)
    with pytest.raises(StorageUnavailable):
        await store.pop_last_message(CID, user_id="user-guest")
    await ConversationStore(backend.db).claim("user-guest", "user-ada")

    retried = await store.pop_last_message(CID, user_id="user-guest")

    assert failing.failed
    assert retried is not None
    assert retried.content == "C!"
    assert await _stored_contents(backend) == ["A?", "A!", "B?", "B!", "C?"]
    conversation = await backend.db.agent_conversations.find_one({"_id": CID})
    assert conversation is not None
    assert not conversation.get("popping")
    assert await summary_disagreements(store) == []
    turn = [{"role": "user", "content": "D?"}, {"role": "assistant", "content": "D!"}]
    logged = await logger.log_messages(CID, turn, user_id="user-ada", turn_id="t3")
    assert [m.seq for m in logged.messages] == [5, 6]
    popped = await ConversationStore(backend.db).pop_last_message(CID, user_id="user-ada")
    assert popped is not None
    assert popped.content == "D!"
    assert await _stored_contents(backend) == ["A?", "A!", "B?", "B!", "C?", "D?"]
    assert await summary_disagreements(store) == []


async def test_a_retry_after_a_claim_of_a_pop_that_removed_nothing_removes_nothing(
    backend: Backend,
) -> None:
    """The owner's pop raised before its mark reached the server, then the account was
    claimed: its retry is no pop of the new owner's conversation. It removes nothing and
    answers None, as a pop of a conversation that is not the caller's does."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(
        CID,
        [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "A!"}],
        user_id="user-guest",
        turn_id="t0",
    )
    store = ConversationStore(backend.db)
    real = store._conversations
    store._conversations = FailingCalls(real, {"update_one": {0}})
    with pytest.raises(StorageUnavailable):
        await store.pop_last_message(CID, user_id="user-guest")
    store._conversations = real
    await ConversationStore(backend.db).claim("user-guest", "user-ada")

    assert await store.pop_last_message(CID, user_id="user-guest") is None
    assert await _stored_contents(backend) == ["A?", "A!"]
    assert await summary_disagreements(store) == []


async def test_a_lost_turn_retried_after_a_claim_is_refused_then_stored_as_the_new_owners(
    backend: Backend,
) -> None:
    """A service logs "user-guest"'s turn: reserved, its insert lost; the account is claimed
    by "user-ada"; a retry naming "user-guest" is refused (the store cannot tell it from
    another user's write), saying to log the turn as the conversation's owner; that retry
    stores it in its block, counted once, and a follower of the tail reads on past it."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    said = [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "A!"}]
    await logger.log_messages(CID, said, user_id="user-guest", turn_id="t0")
    failing = FailOnce(logger._messages, "insert_many", after_applying=False)
    logger._messages = failing  # type: ignore[assignment]
    turn = [
        {"role": "user", "content": "B?"},
        {"role": "assistant", "content": "B!", "token_usage": {"input_tokens": 1000}},
    ]
    with pytest.raises(StorageUnavailable):
        await logger.log_messages(CID, turn, user_id="user-guest", turn_id="t1")
    store = ConversationStore(backend.db)
    await store.claim("user-guest", "user-ada")

    with pytest.raises(Conflict, match="log the turn as the conversation's owner"):
        await logger.log_messages(CID, turn, user_id="user-guest", turn_id="t1")
    retried = await logger.log_messages(CID, turn, user_id="user-ada", turn_id="t1")

    assert failing.failed
    assert retried.replayed
    assert [(m.seq, m.user_id) for m in retried.messages] == [(2, "user-ada"), (3, "user-ada")]
    assert await _stored_contents(backend) == ["A?", "A!", "B?", "B!"]
    assert await summary_disagreements(store) == []
    conversation = await store.get_conversation(CID)
    assert (conversation.turn_count, conversation.usage.input_tokens) == (2, 1000)
    new = [{"role": "user", "content": "C?"}]
    after = await logger.log_messages(CID, new, user_id="user-ada", turn_id="t2")
    page = await store.messages_page(CID, after=retried.messages[-1].id, limit=10)
    assert (page.pending_seq, [m.id for m in page.data]) == (None, [after.messages[0].id])


async def test_a_service_naming_a_user_who_never_owned_the_conversation_cannot_complete_its_turn(
    backend: Backend,
) -> None:
    """bob's turn t1 is reserved, its insert lost; a service call naming mallory, who never
    held the conversation, sends t1 with the very same content: a Conflict, nothing stored,
    as any turn naming another user than the owner."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages(CID, [{"role": "user", "content": "A?"}], user_id="bob", turn_id="t0")
    failing = FailOnce(logger._messages, "insert_many", after_applying=False)
    logger._messages = failing  # type: ignore[assignment]
    turn = [{"role": "user", "content": "B?"}, {"role": "assistant", "content": "B!"}]
    with pytest.raises(StorageUnavailable):
        await logger.log_messages(CID, turn, user_id="bob", turn_id="t1")

    with pytest.raises(Conflict):
        await logger.check_turn(CID, turn, user_id="mallory", turn_id="t1")
    with pytest.raises(Conflict):
        await logger.log_messages(CID, turn, user_id="mallory", turn_id="t1")

    assert await _stored_contents(backend) == ["A?"]


class TwoPopsInDoubt:
    """Wraps a store's collections so that the pop run by the task named "first" has its
    removal applied and its reply held until `release`, then lost, and the pop run by the
    task named "second" has its summary update applied and its reply lost (its first
    summary update, which finishes the first pop's mark, goes through)."""

    def __init__(self, store: ConversationStore) -> None:
        self.release = asyncio.Event()
        self.removed = asyncio.Event()
        self.failed: set[str] = set()
        self._finishes = 0
        store._messages = self._wrap(store._messages, self._removal)  # type: ignore[assignment]
        store._conversations = self._wrap(store._conversations, self._summary)  # type: ignore[assignment]

    def _wrap(self, collection: Any, hook: Any) -> Any:
        outer = self

        class Wrapped:
            def __getattr__(self, name: str) -> Any:
                real = getattr(collection, name)
                task = asyncio.current_task()
                who = task.get_name() if task else ""
                if who in outer.failed:
                    return real
                return hook(name, who, real) or real

        return Wrapped()

    def _removal(self, name: str, who: str, real: Any) -> Any:
        if name != "delete_one" or who != "first":
            return None

        async def held(*args: Any, **kwargs: Any) -> Any:
            self.failed.add(who)
            await real(*args, **kwargs)
            self.removed.set()
            await self.release.wait()
            raise AutoReconnect("connection lost during delete_one (injected)")

        return held

    def _summary(self, name: str, who: str, real: Any) -> Any:
        if name != "update_one" or who != "second":
            return None

        async def lost(*args: Any, **kwargs: Any) -> Any:
            if "popping.message_id" not in args[0]:
                return await real(*args, **kwargs)
            self._finishes += 1
            if self._finishes == 1:  # the first pop's mark, finished by this one
                return await real(*args, **kwargs)
            self.failed.add(who)
            await real(*args, **kwargs)
            raise AutoReconnect("connection lost during update_one (injected)")

        return lost


async def _two_pops_in_doubt(backend: Backend) -> tuple[ConversationStore, TwoPopsInDoubt]:
    """Three turns of two messages; two pops through one store, both raising: the first
    removed `C!` (its reply lost), the second `C?` (its summary update's reply lost)."""
    await log_three_turns(backend)
    store = ConversationStore(backend.db)
    faults = TwoPopsInDoubt(store)

    async def first() -> None:
        with pytest.raises(StorageUnavailable):
            await store.pop_last_message(CID)

    first_pop = asyncio.create_task(first(), name="first")
    await faults.removed.wait()
    with pytest.raises(StorageUnavailable):
        await asyncio.create_task(store.pop_last_message(CID), name="second")
    faults.release.set()
    await first_pop
    assert faults.failed == {"first", "second"}
    return store, faults


async def test_two_pops_in_doubt_through_one_store_are_each_retried_by_their_own_caller(
    backend: Backend,
) -> None:
    """RUNTIMES.md: pops running at once through one store are not taken for each other.
    Two callers pop at once through one store, both raise, and each retries once: two
    messages go, each caller answered with the message its own pop removed."""
    await log_three_turns(backend)
    store = ConversationStore(backend.db)
    faults = TwoPopsInDoubt(store)
    answers: dict[str, Any] = {}
    first_raised, second_retried = asyncio.Event(), asyncio.Event()

    async def caller(name: str) -> None:
        with pytest.raises(StorageUnavailable):
            await store.pop_last_message(CID)
        # Both in doubt at once: the second retries first, then the first.
        await (second_retried if name == "first" else first_raised).wait()
        popped = await store.pop_last_message(CID)
        answers[name] = popped and popped.content
        second_retried.set()

    first = asyncio.create_task(caller("first"), name="first")
    await faults.removed.wait()
    second = asyncio.create_task(caller("second"), name="second")
    await asyncio.sleep(0.05)
    faults.release.set()
    await asyncio.sleep(0.05)
    first_raised.set()
    await asyncio.gather(first, second)

    assert faults.failed == {"first", "second"}
    assert answers == {"first": "C!", "second": "C?"}
    assert await _stored_contents(backend) == ["A?", "A!", "B?", "B!"]
    assert await summary_disagreements(store) == []


async def test_a_retry_that_cannot_be_told_among_pops_in_doubt_is_refused_removing_nothing(
    backend: Backend,
) -> None:
    """Two pops through one store raised, each removing a message, and a pop comes from
    neither caller (another task, as a retry handed on would): the store cannot tell which
    pop it retries, so it finishes their bookkeeping and refuses, `Conflict`, removing no
    third message; as many calls are refused as pops were in doubt, then pops pop again."""
    store, _ = await _two_pops_in_doubt(backend)

    for _ in range(2):
        with pytest.raises(Conflict, match="cannot tell which"):
            await store.pop_last_message(CID)

    assert await _stored_contents(backend) == ["A?", "A!", "B?", "B!"]
    assert await summary_disagreements(store) == []
    popped = await store.pop_last_message(CID)
    assert popped is not None
    assert popped.content == "B!"


async def _half_deleted(backend: Backend) -> tuple[AgentMessageLogger, ConversationStore]:
    """Two turns logged into `CID`, then a delete of it whose last command (the conversation
    document's delete) is lost before it applied: its messages went, its document stays."""
    await _two_turns_of_two(backend)
    store = ConversationStore(backend.db)
    real = store._conversations
    store._conversations = FailOnce(real, "find_one_and_delete", after_applying=False)
    with pytest.raises(StorageUnavailable):
        await store.delete(CID)
    store._conversations = real
    assert await _stored_contents(backend) == []
    return AgentMessageLogger(backend.db), store


BEING_DELETED = f"conversation {CID!r} is being deleted"


@pytest.mark.parametrize(
    "turn",
    [
        pytest.param([{"role": "user", "content": "u1"}], id="no-condition"),
        pytest.param(
            [
                {"role": "user", "content": "u1"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
            ],
            id="making-a-call",
        ),
    ],
)
async def test_a_turn_whose_reservation_lost_every_race_is_sent_again_as_it_is(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, turn: list[dict[str, Any]]
) -> None:
    """Its reservation found the conversation changed under it at each attempt (writers
    racing it): nothing is written, and the refusal is one to retry as it is (503,
    `StorageUnavailable`, as a dropped connection is), which `with_retries` retries, not a
    failure to report; sent again, it is stored once. So too for a turn whose reservation
    carries a condition the conversation meets (a turn making a call, `HeldOff` only for a
    call a prompt holds): never refused for what the conversation does not hold."""
    logger = AgentMessageLogger(backend.db)
    said = [{"role": "user", "content": "u0"}]
    await logger.log_messages(CID, said, turn_id="t0")
    try_reserve, attempts = logger._try_reserve, 0

    async def racing(*args: Any, **kwargs: Any) -> Any:
        nonlocal attempts
        attempts += 1
        return None if attempts <= 4 else await try_reserve(*args, **kwargs)

    monkeypatch.setattr(logger, "_try_reserve", racing)
    with pytest.raises(StorageUnavailable, match="could not reserve turn 't1'"):
        await logger.log_messages(CID, turn, turn_id="t1")
    assert await _stored_contents(backend) == ["u0"]

    logged = await with_retries(lambda: logger.log_messages(CID, turn, turn_id="t1"))

    assert [m.seq for m in logged.messages] == list(range(1, 1 + len(turn)))
    assert (await _stored_contents(backend))[:2] == ["u0", "u1"]
    assert len(await _stored_contents(backend)) == 1 + len(turn)


async def test_a_turn_into_a_conversation_whose_delete_failed_part_way_is_refused(
    backend: Backend,
) -> None:
    """A new turn, and a retry of a deleted one, are refused (to be sent again once the delete
    finished) and store nothing: no turn is added to a half-deleted conversation, no deleted
    message comes back."""
    logger, _ = await _half_deleted(backend)
    before = await backend.db.agent_conversations.find_one({"_id": CID})

    for turn_id, content in [("t-new", "new"), ("t0", "u0"), ("t1", "u1")]:
        with pytest.raises(StorageUnavailable, match=re.escape(BEING_DELETED)):
            await logger.log_messages(CID, [{"role": "user", "content": content}], turn_id=turn_id)

    assert await _stored_contents(backend) == []
    after = await backend.db.agent_conversations.find_one({"_id": CID})
    assert after == before


async def test_a_pop_and_a_fork_of_a_conversation_whose_delete_failed_part_way_are_refused(
    backend: Backend,
) -> None:
    """A pop is refused as a turn is; a fork answers NotFound (docs/RELIABILITY.md), not a
    turn "still being written" at the `seq`s the delete emptied."""
    logger, store = await _half_deleted(backend)

    with pytest.raises(StorageUnavailable, match=re.escape(BEING_DELETED)):
        await store.pop_last_message(CID)
    with pytest.raises(NotFound, match=re.escape(f"conversation {CID!r} was not found")):
        await logger.fork(CID, 1, "c-fork")

    assert await backend.db.agent_conversations.find_one({"_id": "c-fork"}) is None


async def test_a_fork_into_an_id_whose_delete_failed_part_way_names_the_fork(
    backend: Backend,
) -> None:
    """A fork retried into its conversation, whose delete failed part-way, is refused as a
    turn is (being deleted, sent again once the delete finished), naming the fork: never the
    turn id the store made for it, which the caller never saw (and may not send)."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    said = [{"role": "user", "content": "u0"}, {"role": "assistant", "content": "a0"}]
    await logger.log_messages("c-source", said, user_id="alice", turn_id="t0")
    await logger.fork("c-source", 1, CID, user_id="alice")
    store = ConversationStore(backend.db)
    real = store._conversations
    store._conversations = FailOnce(real, "find_one_and_delete", after_applying=False)
    with pytest.raises(StorageUnavailable):
        await store.delete(CID, user_id="alice")
    store._conversations = real

    with pytest.raises(StorageUnavailable, match=re.escape(BEING_DELETED)) as refused:
        await logger.fork("c-source", 1, CID, user_id="alice")

    assert "the fork may be sent again" in str(refused.value)
    assert "fork-" not in str(refused.value)


async def test_no_write_lands_on_a_conversation_whose_delete_failed_part_way(
    backend: Backend,
) -> None:
    """A rename, an upsert (naming a user or a name), an answer to a prompt and a steering
    inbox are refused as a turn is, the conversation document left as the delete marked it:
    nothing is written to what a failed delete leaves, nor handed to a user."""
    logger, store = await _half_deleted(backend)
    before = await backend.db.agent_conversations.find_one({"_id": CID})
    writes = [
        lambda: store.rename(CID, "renamed"),
        lambda: logger.upsert_conversation(CID, name="renamed"),
        lambda: logger.upsert_conversation(CID, user_id="alice"),
        lambda: store.resolve_hitl(CID, "req-1"),
        lambda: SteeringInbox(logger).open_turn(CID, "run-1"),
    ]

    for write in writes:
        with pytest.raises(StorageUnavailable, match=re.escape(BEING_DELETED)):
            await write()

    assert await backend.db.agent_conversations.find_one({"_id": CID}) == before


async def assert_absent_to_every_read(
    backend: Backend, store: ConversationStore, conversation_id: str, user_id: str | None = None
) -> None:
    """Every read of conversations answers `conversation_id` as a missing one: NotFound for
    one named, left out of every list, page, export and search."""
    missing = re.escape(f"conversation {conversation_id!r} was not found")
    reads = [
        lambda: store.get_conversation(conversation_id, user_id=user_id),
        lambda: store.turn_count(conversation_id, user_id=user_id),
        lambda: store.transcript(conversation_id, user_id=user_id),
        lambda: store.messages_page(conversation_id, user_id=user_id),
        lambda: store.pending_hitl(conversation_id, user_id=user_id),
        lambda: store.search("u0", conversation_id=conversation_id),
        lambda: _streamed(store.stream_transcript(conversation_id, user_id=user_id)),
    ]
    for read in reads:
        with pytest.raises(NotFound, match=missing):
            await read()
    with pytest.raises(NotFound, match=missing):
        await store.messages_page(conversation_id, user_id=user_id, order="desc")
    # As for a conversation that does not exist: none of its messages.
    assert await store.pending_calls(conversation_id, user_id=user_id) == []
    assert await store.recent_messages(conversation_id, user_id=user_id) == []
    assert await store.recent_messages(conversation_id, limit=1, user_id=user_id) == []
    assert await store.messages_by_seq(conversation_id, user_id=user_id) == []
    assert await store.calls_before(conversation_id, ["c0"], before_seq=9, user_id=user_id) == []
    listed = (await store.recent_conversations()).data
    assert conversation_id not in [c.id for c in listed]
    if user_id is not None:
        assert conversation_id not in [c.id for c in (await store.list_conversations(user_id)).data]
        exported = [e.conversation.id async for e in store.export_user(user_id)]
        assert conversation_id not in exported
        if "text_search" not in backend.lacks:
            hits = await store.search("u0 u1 a0 a1", user_id=user_id)
            assert conversation_id not in [h.message.conversation_id for h in hits]


async def _streamed(batches: Any) -> list[Any]:
    return [m async for batch in batches for m in batch]


async def test_a_conversation_whose_delete_failed_part_way_is_absent_to_every_read(
    backend: Backend,
) -> None:
    """Its messages went, its document stays marked (`deleting_since`) until the delete is run
    again: no read serves it, its counts and preview of messages that no longer exist
    included; the delete run again still finishes it."""
    _, store = await _half_deleted(backend)

    await assert_absent_to_every_read(backend, store, CID)

    assert (await store.delete(CID)).conversations == 1


async def _dual_written_example(
    backend: Backend, rules: TurnRules | None = None
) -> tuple[LegacyTurns, AgentMessageLogger, ConversationStore]:
    """The example conversation logged with the transition's dual write on (its legacy turns
    kept beside it), the logger, and a store reading both."""
    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(backend.db, observers=[legacy], legacy=legacy)
    await logger.ensure_indexes()
    await log_example(logger)
    return legacy, logger, ConversationStore(backend.db, legacy=legacy, rules=rules)


async def _delete_failing_at_its_legacy_turns(
    store: ConversationStore,
    legacy: LegacyTurns,
    monkeypatch: pytest.MonkeyPatch,
    version: str | None = None,
) -> None:
    """The example conversation's delete, failing (StorageUnavailable) as it removes the
    legacy turns kept beside it: marked, its legacy turns still there."""

    async def lost(conversation_id: str, *, owner: str | None) -> int:
        raise StorageUnavailable("the connection dropped")

    monkeypatch.setattr(legacy, "delete", lost)
    with pytest.raises(StorageUnavailable):
        await store.delete(EXAMPLE_CONVERSATION_ID, version=version)
    monkeypatch.undo()


async def test_a_conversation_whose_delete_failed_part_way_is_not_served_from_its_legacy_turns(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete marks the conversation, then removes the legacy turns kept beside it (the
    transition's dual write): one that failed between leaves them there. The conversation is
    no conversation all the same: the read fallback, which serves a conversation with no
    document, or one being migrated, never serves one a delete marked; every read of it is
    NotFound, to its owner and a service, as without legacy turns (no summary, prompt, page or
    empty inbox rebuilt from them). The delete run again naming the version read before the
    first attempt finishes it."""
    cid = EXAMPLE_CONVERSATION_ID
    legacy, logger, store = await _dual_written_example(backend)
    version = (await store.get_conversation(cid, user_id=EXAMPLE_USER_ID)).version
    fallback = await legacy.conversation(cid)
    assert fallback is not None
    await _delete_failing_at_its_legacy_turns(store, legacy, monkeypatch, version)
    assert await backend.db[LEGACY_TURNS].count_documents({"conversation_id": cid}) == 4

    for user_id in (EXAMPLE_USER_ID, None):
        await assert_absent_to_every_read(backend, store, cid, user_id)
        with pytest.raises(NotFound):
            await store.messages_page(cid, after=fallback.messages[1].id, user_id=user_id)
        with pytest.raises(NotFound):
            await SteeringInbox(logger).drain(cid, "run-1", user_id=user_id)

    deleted = await store.delete(cid, version=version)
    assert (deleted.conversations, deleted.legacy_turns) == (1, 4)
    assert await backend.db[LEGACY_TURNS].count_documents({"conversation_id": cid}) == 0


async def test_the_legacy_turns_of_a_conversation_a_delete_marked_are_not_read_for_comparison(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The legacy turns an operator compares a conversation with (`LegacyTurns.turns`, the
    viewer's legacy page) are found as the read fallback finds them, and refused as it
    refuses them: those a delete that failed part-way left beside the conversation it marked
    are NotFound, as every other read of it, until the delete run again removes them."""
    cid = EXAMPLE_CONVERSATION_ID
    legacy, _, store = await _dual_written_example(backend)
    assert len(await legacy.turns(cid, limit=10)) == 4
    await _delete_failing_at_its_legacy_turns(store, legacy, monkeypatch)
    assert await backend.db[LEGACY_TURNS].count_documents({"conversation_id": cid}) == 4

    with pytest.raises(NotFound, match=re.escape(f"conversation {cid!r} was not found")):
        await legacy.turns(cid, limit=10)

    assert (await store.delete(cid)).legacy_turns == 4


async def test_a_claim_leaves_a_half_deleted_conversations_legacy_turns_with_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim leaves behind everything of a conversation it leaves to its owner (one a delete
    that failed part-way marked): its document, its messages, and its legacy turns and
    prompts kept beside it. No read serves it to the new account, nor to the old one or a
    service, from those turns; the owner's delete run again removes them all."""
    cid = EXAMPLE_CONVERSATION_ID
    legacy, _, store = await _dual_written_example(backend, TurnRules(claim_grace=timedelta(0)))
    version = (await store.get_conversation(cid, user_id=EXAMPLE_USER_ID)).version
    await _delete_failing_at_its_legacy_turns(store, legacy, monkeypatch, version)

    claimed = await store.claim(EXAMPLE_USER_ID, "user-bob")

    assert (claimed.conversations, claimed.legacy_turns) == (0, 0)
    turns = backend.db[LEGACY_TURNS].find({"conversation_id": cid})
    assert {t["user_id"] async for t in turns} == {EXAMPLE_USER_ID}
    for user_id in ("user-bob", EXAMPLE_USER_ID, None):
        await assert_absent_to_every_read(backend, store, cid, user_id)
    deleted = await store.delete(cid, user_id=EXAMPLE_USER_ID, version=version)
    assert (deleted.conversations, deleted.legacy_turns) == (1, 4)
    assert await backend.db[LEGACY_TURNS].count_documents({"conversation_id": cid}) == 0


async def test_the_read_fallback_serves_no_user_an_id_another_users_delete_marked(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Legacy turns under an id whose conversation document a delete marked (that failed
    part-way), naming another user than the document's owner (as a claim of old moved
    them): the fallback serves them to no one, that user included; NotFound, as for an id
    with nothing under it."""
    cid = EXAMPLE_CONVERSATION_ID
    legacy, logger, store = await _dual_written_example(backend)
    await _delete_failing_at_its_legacy_turns(store, legacy, monkeypatch)
    await backend.db[LEGACY_TURNS].update_many(
        {"conversation_id": cid}, {"$set": {"user_id": "user-bob"}}
    )

    await assert_absent_to_every_read(backend, store, cid, "user-bob")
    with pytest.raises(NotFound):
        await SteeringInbox(logger).drain(cid, "run-1", user_id="user-bob")


@pytest.mark.parametrize("failed", ["delete", "erasure"])
async def test_a_conversation_whose_delete_failed_before_its_messages_went_serves_none(
    backend: Backend, failed: str
) -> None:
    """The delete (or the erasure of its user) marks the conversation, then its first removal
    of messages is lost: every message is still stored. None is served, to its owner or a
    service, by any read of messages (transcripts, pages either way, streams, the last
    messages, by `seq`, an inbox's deliveries): the conversation is no conversation until the
    delete, run again, finishes it."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    said = [{"role": "user", "content": "my address is 1 Main St"},
            {"role": "assistant", "content": "noted"}]  # fmt: skip
    await logger.log_messages(CID, said, user_id="alice", turn_id="t0")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, "run-1", user_id="alice")
    store = ConversationStore(backend.db)
    real = store._messages
    store._messages = FailOnce(real, "delete_many", after_applying=False)  # type: ignore[assignment]
    with pytest.raises(StorageUnavailable):
        await (store.delete(CID) if failed == "delete" else store.erase_user("alice"))
    store._messages = real
    assert await backend.db.agent_messages.count_documents({"conversation_id": CID}) == 2

    for user_id in ("alice", None):
        await assert_absent_to_every_read(backend, store, CID, user_id)
        with pytest.raises(NotFound):
            await inbox.drain(CID, "run-1", user_id=user_id)

    await (store.delete(CID) if failed == "delete" else store.erase_user("alice"))
    assert await backend.db.agent_messages.count_documents({"conversation_id": CID}) == 0


async def test_the_conversations_of_a_user_whose_erasure_failed_part_way_are_absent(
    backend: Backend,
) -> None:
    """An erasure whose delete of the conversation documents is lost after it took their
    messages: the user's own lists, export and reads serve none of them (their previews
    quote what was erased); the erasure run again finishes."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    for cid in (CID, "c-second"):
        said = [{"role": "user", "content": "u0"}, {"role": "assistant", "content": "a0"}]
        await logger.log_messages(cid, said, user_id="alice", turn_id="t0")
    store = ConversationStore(backend.db)
    real = store._conversations
    store._conversations = FailOnce(real, "delete_many", after_applying=False)
    with pytest.raises(StorageUnavailable):
        await store.erase_user("alice")
    store._conversations = real
    assert await backend.db.agent_conversations.count_documents({"user_id": "alice"}) == 2

    for cid in (CID, "c-second"):
        await assert_absent_to_every_read(backend, store, cid, "alice")

    assert (await store.erase_user("alice")).conversations == 2


async def test_a_claim_leaves_a_conversation_whose_delete_failed_part_way_to_its_owner(
    backend: Backend,
) -> None:
    """A claim moves the user's conversations but one being deleted: it stays the owner's,
    whose delete run again finishes it (moved, it would be another user's to finish, and
    refuse their turns until then)."""
    logger = AgentMessageLogger(backend.db)
    for cid in (CID, "c-kept"):
        await logger.log_messages(cid, [{"role": "user", "content": "u0"}], user_id="alice")
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(0)))
    real = store._conversations
    store._conversations = FailOnce(real, "find_one_and_delete", after_applying=False)
    with pytest.raises(StorageUnavailable):
        await store.delete(CID, user_id="alice")
    store._conversations = real

    claimed = await store.claim("alice", "bob")

    assert claimed.conversations == 1
    assert (await store.get_conversation("c-kept")).user_id == "bob"
    deleted = await store.delete(CID, user_id="alice")
    assert deleted.conversations == 1
    assert await backend.db.agent_conversations.find_one({"_id": CID}) is None


class MarkedBefore:
    """The conversations collection, which marks the conversation as a delete does
    (`deleting_since`) just before its call of `method` after the first `skip` ones: a delete
    beginning between a retry's read of the conversation and its next write."""

    def __init__(self, collection: Any, method: str, skip: int) -> None:
        self._collection = collection
        self._method = method
        self._skip = skip
        self.marked: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._collection, name)
        if name != self._method:
            return real

        async def marking_first(*args: Any, **kwargs: Any) -> Any:
            if self._skip == 0 and self.marked is None:
                await self._collection.update_one(
                    {"_id": CID}, {"$set": {"deleting_since": datetime.now(UTC)}}
                )
                self.marked = await self._collection.find_one({"_id": CID})
            self._skip -= 1
            return await real(*args, **kwargs)

        return marking_first


@pytest.mark.parametrize(
    ("content", "method", "skip"),
    [
        pytest.param("same", "find_one_and_update", 1, id="moved"),
        pytest.param("other", "update_one", 0, id="given-back"),
    ],
)
async def test_a_retry_moving_its_turn_as_a_delete_begins_is_refused(
    backend: Backend, content: str, method: str, skip: int
) -> None:
    """A turn reserved whose insert failed, retried past `abandon_after` (its block moves to
    the end, or, with other content, is given back) just as a delete marks the conversation:
    refused as any turn then, no message stored, the document as the mark left it."""
    await _two_turns_of_two(backend)
    logger = AgentMessageLogger(backend.db)
    logger._messages = FailOnce(logger._messages, "insert_many", after_applying=False)
    sent = [{"role": "user", "content": "u2"}]
    with pytest.raises(StorageUnavailable):
        await logger.log_messages(CID, sent, turn_id="t2")
    await logger.log_messages(CID, [{"role": "user", "content": "u3"}], turn_id="t3")
    patient = AgentMessageLogger(backend.db, rules=TurnRules(abandon_after=timedelta(0)))
    marking = MarkedBefore(patient._conversations, method, skip)
    patient._conversations = marking
    retried = sent if content == "same" else [{"role": "user", "content": "u2, again"}]

    with pytest.raises(StorageUnavailable, match=re.escape(BEING_DELETED)):
        await patient.log_messages(CID, retried, turn_id="t2")

    assert marking.marked is not None
    assert await _stored_contents(backend) == ["u0", "a0", "u1", "a1", "u3"]
    assert await backend.db.agent_conversations.find_one({"_id": CID}) == marking.marked


class RacedOnce:
    """The conversations collection, whose first `find_one_and_update` (a turn's reservation)
    loses a race: `before` runs just before it reaches the server, `after` once it failed
    there and before the turn reads the conversation back. With `collides`, the reservation
    raises what a server answers an upsert whose insert another writer's beat
    (DuplicateKeyError) instead of reaching it."""

    def __init__(
        self,
        collection: Any,
        before: Callable[[], Awaitable[Any]],
        after: Callable[[], Awaitable[Any]],
        *,
        collides: bool = False,
        read_back: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self._collection = collection
        self._before, self._after, self._collides = before, after, collides
        self._read_back = read_back
        """Runs once the turn read the conversation back (the first `find_one` after the
        race), before it decides anything on what it read."""
        self.raced = False

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._collection, name)
        if name == "find_one" and self.raced and self._read_back is not None:
            then, self._read_back = self._read_back, None

            async def read_back(*args: Any, **kwargs: Any) -> Any:
                found = await real(*args, **kwargs)
                await then()
                return found

            return read_back
        if name != "find_one_and_update" or self.raced:
            return real

        async def losing(*args: Any, **kwargs: Any) -> Any:
            self.raced = True
            await self._before()
            try:
                if self._collides:
                    raise errors.DuplicateKeyError("E11000 duplicate key error (injected)")
                found = await real(*args, **kwargs)
                assert found is None  # the race made it match nothing
                return found
            finally:
                await self._after()

        return losing


def _asking(tag: str) -> list[dict[str, Any]]:
    """A turn whose answer makes a call (`call-<tag>`); no prompt anywhere."""
    call = {"id": f"call-{tag}", "function": {"name": "lookup", "arguments": "{}"}}
    return [
        {"role": "user", "content": f"{tag}?"},
        {"role": "assistant", "content": f"{tag}!", "tool_calls": [call]},
    ]


async def _deleted_and_started_again(backend: Backend) -> RacedOnce:
    """A delete marks the conversation as the turn's reservation reaches it; the delete ends
    and another writer starts the conversation again before the turn reads it back."""
    conversations = backend.db["agent_conversations"]

    async def marked() -> None:
        marking = {"$set": {"deleting_since": datetime.now(UTC)}}
        await conversations.update_one({"_id": CID}, marking)

    async def started_again() -> None:
        await ConversationStore(backend.db).delete(CID)
        await AgentMessageLogger(backend.db).log_messages(
            CID, [{"role": "user", "content": "Y?"}], turn_id="Y"
        )

    return RacedOnce(conversations, marked, started_again)


async def _popped(backend: Backend) -> RacedOnce:
    """A pop marks the conversation (`popping`) as the turn's reservation reaches it and
    finishes before the turn reads it back."""
    dying = ConversationStore(backend.db)
    dying._conversations = FailOnce(dying._conversations, "update_one", after_applying=False,
                                    skip=1)  # fmt: skip

    async def marked() -> None:
        with pytest.raises(StorageUnavailable):
            await dying.pop_last_message(CID)

    async def finished() -> None:
        await ConversationStore(backend.db).get_conversation(CID)  # a read finishes a pop

    return RacedOnce(backend.db["agent_conversations"], marked, finished)


async def _created_meanwhile(backend: Backend) -> RacedOnce:
    """Another writer's turn making a call creates the conversation as the turn's reservation
    would: the turn's upsert collides with it."""
    await backend.db["agent_conversations"].delete_one({"_id": CID})
    await backend.db["agent_messages"].delete_many({"conversation_id": CID})

    async def created() -> None:
        await AgentMessageLogger(backend.db).log_messages(CID, _asking("Y"), turn_id="Y")

    async def nothing() -> None:
        return None

    return RacedOnce(backend.db["agent_conversations"], created, nothing, collides=True)


@pytest.mark.parametrize(
    ("race", "stored"),
    [
        pytest.param(_deleted_and_started_again, ["Y?", "X?", "X!"], id="deleted-started-again"),
        pytest.param(_popped, ["A?", "X?", "X!"], id="popped"),
        pytest.param(_created_meanwhile, ["Y?", "Y!", "X?", "X!"], id="created-meanwhile"),
    ],
)
async def test_a_turn_making_a_call_whose_reservation_lost_a_race_is_stored_once_after_it(
    backend: Backend,
    race: Callable[[Backend], Awaitable[RacedOnce]],
    stored: list[str],
) -> None:
    """A reservation is refused by its condition (for a turn making calls: no call a prompt
    holds pushed off, `HeldOff`) only when the conversation as it stands does not meet it: one
    that failed for a reason gone by its read-back (a delete's or a pop's mark, another
    writer's upsert) reserves again, as a turn without a condition does. No prompt anywhere
    here: the turn is stored once, after the race, its call pending."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    first = [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "A!"}]
    await logger.log_messages(CID, first, turn_id="A")
    raced = await race(backend)
    logger._conversations = raced

    logged = await logger.log_messages(CID, _asking("X"), turn_id="X")

    assert raced.raced
    assert not logged.replayed
    assert [m.content for m in logged.messages] == ["X?", "X!"]
    assert [m.seq for m in logged.messages] == [len(stored) - 2, len(stored) - 1]
    assert await _stored_contents(backend) == stored
    again = await AgentMessageLogger(backend.db).log_messages(CID, _asking("X"), turn_id="X")
    assert again.replayed
    assert await _stored_contents(backend) == stored
    store = ConversationStore(backend.db)
    assert "call-X" in [c.tool_call_id for c in await store.pending_calls(CID)]
    assert await summary_disagreements(store) == []


def _answering(tag: str) -> list[dict[str, Any]]:
    """A turn answering `call-<tag>` (made by turn `<tag>`, `_asking`)."""
    return [{"role": "tool", "tool_call_id": f"call-{tag}", "content": f"{tag} done"}]


@pytest.mark.parametrize(
    ("turn", "conditions"),
    [
        pytest.param([{"role": "user", "content": "X?"}], {}, id="version-only"),
        pytest.param(_asking("X"), {}, id="making-a-call"),
        pytest.param(_asking("X"), {"next_seq": 2}, id="at-next-seq"),
        pytest.param(_answering("A"), {"answers_to": True}, id="answering-a-call"),
        pytest.param(
            _answering("A") + _asking("X")[1:], {"answers_to": True}, id="answering-and-asking"
        ),
    ],
)
async def test_a_turn_naming_a_version_started_again_before_it_reserves_is_a_version_mismatch(
    backend: Backend, turn: list[dict[str, Any]], conditions: dict[str, Any]
) -> None:
    """A turn logged with `version` into a conversation deleted and started again between the
    version's check and the turn's reservation is refused `VersionMismatch` (412), nothing
    written, whatever other condition it carries: never that condition's refusal, which the
    new conversation, holding the same turn (so the same call, pending), meets."""
    logger = AgentMessageLogger(backend.db)
    made = (await logger.log_messages(CID, _asking("A"), turn_id="A")).messages[1].id
    version = (await ConversationStore(backend.db).get_conversation(CID)).version

    async def started_again() -> None:
        await ConversationStore(backend.db).delete(CID)
        await AgentMessageLogger(backend.db).log_messages(CID, _asking("A"), turn_id="A")

    async def nothing() -> None:
        return None

    raced = RacedOnce(backend.db["agent_conversations"], started_again, nothing)
    logger._conversations = raced
    if conditions.pop("answers_to", False):
        conditions["answers_to"] = {"call-A": made}

    with pytest.raises(VersionMismatch, match="deleted and started again"):
        await logger.log_messages(CID, turn, turn_id="X", version=version, **conditions)

    assert raced.raced
    assert await _stored_contents(backend) == ["A?", "A!"]
    store = ConversationStore(backend.db)
    assert [c.tool_call_id for c in await store.pending_calls(CID)] == ["call-A"]


@pytest.mark.parametrize(
    "turn",
    [
        pytest.param([{"role": "user", "content": "X?"}], id="at-next-seq"),
        pytest.param(_asking("X"), id="at-next-seq-making-a-call"),
    ],
)
async def test_a_turn_refused_after_a_lost_race_is_told_where_the_conversation_is_now(
    backend: Backend, turn: list[dict[str, Any]]
) -> None:
    """A turn at `next_seq` whose reservation met a delete's mark (set just before it, cleared
    just after), and another writer's turn logged once it read the conversation back: the
    refusal (`TranscriptMoved`) names the conversation as the store judged it, its next seq
    4, not the one read back before that writer's turn."""
    logger = AgentMessageLogger(backend.db)
    first = [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "A!"}]
    await logger.log_messages(CID, first, turn_id="A")
    conversations = backend.db["agent_conversations"]

    async def marked() -> None:
        marking = {"$set": {"deleting_since": datetime.now(UTC)}}
        await conversations.update_one({"_id": CID}, marking)

    async def unmarked() -> None:
        await conversations.update_one({"_id": CID}, {"$unset": {"deleting_since": ""}})

    async def another_turn() -> None:
        other = [{"role": "user", "content": "B?"}, {"role": "assistant", "content": "B!"}]
        await AgentMessageLogger(backend.db).log_messages(CID, other, turn_id="B")

    raced = RacedOnce(conversations, marked, unmarked, read_back=another_turn)
    logger._conversations = raced

    with pytest.raises(TranscriptMoved, match="its next seq is 4, not 2") as refused:
        await logger.log_messages(CID, turn, turn_id="X", next_seq=2)

    assert raced.raced
    assert refused.value.next_seq == 4
    assert await _stored_contents(backend) == ["A?", "A!", "B?", "B!"]


MALLORY, ADA = "user-mallory", "user-ada"

_Refused = tuple[list[dict[str, Any]], dict[str, Any]]
"""A turn a conversation refuses, and the arguments it is logged with."""


async def _logged_by(db: Any, user: str | None, turn: list[dict[str, Any]], turn_id: str) -> Any:
    """`turn` logged into `CID` by `user`'s token (None: a service's, unowned)."""
    logger = AgentMessageLogger(db)
    return await logger.log_messages(
        CID, turn, user_id=user, owner_only=user is not None, turn_id=turn_id
    )


async def _held_off(db: Any, user: str | None, tag: str) -> _Refused:
    """`user` starts the conversation with as many calls as `pending_calls` keeps, the first
    held by a prompt (`<tag>-prompt`): a turn making one more call is `HeldOff`."""
    calls = [
        {"id": f"{tag}-call-{i}", "function": {"name": "lookup", "arguments": "{}"}}
        for i in range(PENDING_CALLS_KEPT)
    ]
    prompt = {
        "action": "confirm",
        "request_id": f"{tag}-prompt",
        "tool_call_ids": [f"{tag}-call-0"],
    }
    turn = [
        {"role": "user", "content": f"{tag}?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "assistant", "content": None, "hitl_action": prompt},
    ]
    await _logged_by(db, user, turn, f"{tag}-asks")
    return _asking("X"), {}


async def _moved_on(db: Any, user: str | None, tag: str) -> _Refused:
    """`user` starts the conversation with two messages: a turn at `next_seq` 1 is
    `TranscriptMoved`."""
    await _logged_by(db, user, _asking(tag), f"{tag}-asks")
    return [{"role": "user", "content": "X?"}], {"next_seq": 1}


async def _answered(db: Any, user: str | None, tag: str) -> _Refused:
    """`user` starts the conversation with a call (`call-A`) and its answer: a turn answering
    it again (`answers_to`) is `AnsweredBefore`."""
    made = (await _logged_by(db, user, _asking("A"), f"{tag}-asks")).messages[1].id
    await _logged_by(db, user, _answering("A"), f"{tag}-answers")
    return _answering("A"), {"answers_to": {"call-A": made}}


async def _approved(db: Any, user: str | None, tag: str) -> _Refused:
    """`user` starts the conversation with a call a prompt (`prompt-P`) holds, and a person
    answers the prompt: a turn denying the call is `AnsweredBefore`."""
    call = {"id": "call-P", "function": {"name": "lookup", "arguments": "{}"}}
    prompt = {"action": "confirm", "request_id": "prompt-P", "tool_call_ids": ["call-P"]}
    asking = [
        {"role": "user", "content": f"{tag}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "assistant", "content": None, "hitl_action": prompt},
    ]
    await _logged_by(db, user, asking, f"{tag}-asks")
    await ConversationStore(db).resolve_hitl(CID, "prompt-P", user_id=user)
    denial = {"role": "tool", "tool_call_id": "call-P", "content": "denied",
              "error": {"message": "tool call denied"}}  # fmt: skip
    return [denial], {"refused_prompts": {"call-P": "prompt-P"}}


async def _nothing() -> None:
    return None


def _swapped(
    db: Any, started_by: Callable[..., Awaitable[_Refused]], user: str | None
) -> RacedOnce:
    """The conversations collection, where a turn's reservation fails (its conversation does
    not meet its condition) and, once the turn read the conversation back, Mallory deletes the
    conversation (from another tab) and `user` starts one under its id as `started_by` does,
    then says one more thing in it."""

    async def deleted_and_started() -> None:
        await ConversationStore(db).delete(CID)
        await started_by(db, user, user or "service")
        await _logged_by(db, user, [{"role": "user", "content": "ada's words"}], "more")

    return RacedOnce(db["agent_conversations"], _nothing, _nothing, read_back=deleted_and_started)


@pytest.mark.parametrize(
    ("refused_for", "refusal"),
    [
        pytest.param(_held_off, HeldOff, id="held-off"),
        pytest.param(_moved_on, TranscriptMoved, id="at-next-seq"),
        pytest.param(_answered, AnsweredBefore, id="answers-to"),
        pytest.param(_approved, AnsweredBefore, id="denial"),
    ],
)
async def test_a_turn_refused_as_another_users_conversation_starts_under_its_id_is_not_found(
    backend: Backend,
    refused_for: Callable[..., Awaitable[_Refused]],
    refusal: type[Exception],
) -> None:
    """Mallory's turn (a user token's) is refused by a condition her conversation does not
    meet. Between the read-back of her conversation and the refusal, the conversation is
    deleted and Ada starts one under the id that does not meet it either. To Mallory Ada's
    conversation is as a missing one: NotFound, naming nothing of Ada's (never the refusal
    Ada's conversation explains: her prompt and its call, her next seq, her answers), nothing
    written."""
    turn, arguments = await refused_for(backend.db, MALLORY, "mallory")
    own = AgentMessageLogger(backend.db)
    with pytest.raises(refusal):  # as her conversation stands, its own refusal
        await own.log_messages(
            CID, turn, user_id=MALLORY, owner_only=True, turn_id="X", **arguments
        )
    logger = AgentMessageLogger(backend.db)
    logger._conversations = raced = _swapped(backend.db, refused_for, ADA)

    with pytest.raises(NotFound) as refused:
        await logger.log_messages(
            CID, turn, user_id=MALLORY, owner_only=True, turn_id="X", **arguments
        )

    assert raced.raced
    assert "ada" not in repr(vars(refused.value)).lower()
    store = ConversationStore(backend.db)
    assert (await store.get_conversation(CID)).user_id == ADA
    assert await backend.db["agent_messages"].count_documents({"user_id": MALLORY}) == 0


@pytest.mark.parametrize(
    ("started_by", "version"),
    [
        pytest.param(ADA, True, id="ada-with-version"),
        pytest.param(None, False, id="service-unowned"),
        pytest.param(None, True, id="service-unowned-with-version"),
    ],
)
async def test_a_turn_refused_as_a_conversation_not_hers_starts_under_its_id_is_not_found(
    backend: Backend, started_by: str | None, version: bool
) -> None:
    """The same race, Mallory's turn making a call her own prompt's call would be pushed off
    for: the conversation started under the id meanwhile is Ada's, or one a service starts
    unowned (a user token never adopts one), and her turn names the `version` she read, or
    none. NotFound, whatever the version (never `VersionMismatch`, which tells that another
    conversation holds the id), naming nothing of the new conversation's."""
    turn, _ = await _held_off(backend.db, MALLORY, "mallory")
    store = ConversationStore(backend.db)
    read = (await store.get_conversation(CID, user_id=MALLORY)).version if version else None
    logger = AgentMessageLogger(backend.db)
    logger._conversations = raced = _swapped(backend.db, _held_off, started_by)

    with pytest.raises(NotFound) as refused:
        await logger.log_messages(
            CID, turn, user_id=MALLORY, owner_only=True, turn_id="X", version=read
        )

    assert raced.raced
    said = repr(vars(refused.value)).lower()
    assert "ada" not in said
    assert "service" not in said
    assert (await store.get_conversation(CID)).user_id == started_by


async def test_a_services_turn_whose_version_is_started_again_after_its_read_back_is_a_mismatch(
    backend: Backend,
) -> None:
    """A service's turn naming the `version` it read, refused by its conversation (a call its
    prompt holds would be pushed off), whose conversation is deleted and started again by Ada
    between the read-back and the refusal: the documented `VersionMismatch` ("deleted and
    started again"), never the refusal Ada's conversation explains (her prompt, her call)."""
    turn, _ = await _held_off(backend.db, None, "service")
    store = ConversationStore(backend.db)
    read = (await store.get_conversation(CID)).version
    logger = AgentMessageLogger(backend.db)
    logger._conversations = raced = _swapped(backend.db, _held_off, ADA)

    with pytest.raises(VersionMismatch, match="deleted and started again") as refused:
        await logger.log_messages(CID, turn, turn_id="X", version=read)

    assert raced.raced
    assert "ada" not in repr(vars(refused.value)).lower()


class SwappedAfterRead:
    """The conversations collection, whose first `find_one` (a check's read of the
    conversation) runs `then` once it answered, before the reader decides on it."""

    def __init__(self, collection: Any, then: Callable[[], Awaitable[Any]]) -> None:
        self._collection, self._then = collection, then
        self.swapped = False

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._collection, name)
        if name != "find_one" or self.swapped:
            return real

        async def read(*args: Any, **kwargs: Any) -> Any:
            found = await real(*args, **kwargs)
            self.swapped = True
            await self._then()
            return found

        return read


@pytest.mark.parametrize(
    "refused_for",
    [
        pytest.param(_held_off, id="held-off"),
        pytest.param(_moved_on, id="at-next-seq"),
        pytest.param(_answered, id="answers-to"),
        pytest.param(_approved, id="denial"),
    ],
)
async def test_a_check_never_refuses_with_a_conversation_started_under_its_id_after_its_read(
    backend: Backend, refused_for: Callable[..., Awaitable[_Refused]]
) -> None:
    """`check_turn` of a runtime acting for Mallory (`strict_owner`), whose conversation
    refuses the turn: the conversation deleted and started again by Ada after the check read
    it, the check refuses it with nothing but what Mallory's conversation as read explains
    (or NotFound), never with what Ada's does (her prompt and its call, her next seq, her
    answers); logging the turn then is NotFound."""
    turn, arguments = await refused_for(backend.db, MALLORY, "mallory")
    mallorys = {"user_id": MALLORY, "strict_owner": True, "turn_id": "X", **arguments}
    with pytest.raises(StoreError) as own:  # as her conversation stands
        await AgentMessageLogger(backend.db).check_turn(CID, turn, **mallorys)
    logger = AgentMessageLogger(backend.db)

    async def deleted_and_started() -> None:
        await ConversationStore(backend.db).delete(CID)
        await refused_for(backend.db, ADA, "ada")
        await _logged_by(backend.db, ADA, [{"role": "user", "content": "ada's words"}], "more")

    logger._conversations = raced = SwappedAfterRead(logger._conversations, deleted_and_started)
    told: StoreError | None = None

    try:
        await logger.check_turn(CID, turn, **mallorys)
    except StoreError as refused:
        told = refused

    assert told is None or isinstance(told, NotFound) or repr(told) == repr(own.value), told
    assert raced.swapped
    with pytest.raises(NotFound):
        await AgentMessageLogger(backend.db).log_messages(CID, turn, **mallorys)


async def test_an_answer_refused_as_its_conversation_is_started_again_never_judges_the_new_one(
    backend: Backend,
) -> None:
    """Mallory's turn answering a call her conversation shows answered before is
    `AnsweredBefore`; the conversation deleted and started again by Ada between that refusal
    and the lookup of the answers it names: never judged on Ada's conversation (was: 422
    saying Ada's conversation holds no such call), nothing of Ada's named."""
    turn, arguments = await _answered(backend.db, MALLORY, "mallory")
    logger = AgentMessageLogger(backend.db)
    looked_up = logger._unanswered

    async def started_again_first(*args: Any, **kwargs: Any) -> Any:
        await ConversationStore(backend.db).delete(CID)
        await _answered(backend.db, ADA, "ada")
        return await looked_up(*args, **kwargs)

    logger._unanswered = started_again_first  # type: ignore[method-assign]

    with pytest.raises((AnsweredBefore, NotFound)) as refused:
        await logger.log_messages(
            CID, turn, user_id=MALLORY, owner_only=True, turn_id="X", **arguments
        )

    assert "ada" not in repr(vars(refused.value)).lower()
    assert await backend.db["agent_messages"].count_documents({"user_id": MALLORY}) == 0


async def test_a_delete_run_again_finishes_and_a_turn_after_it_starts_a_new_conversation(
    backend: Backend,
) -> None:
    logger, store = await _half_deleted(backend)

    deleted = await store.delete(CID)
    logged = await logger.log_messages(CID, [{"role": "user", "content": "new"}], turn_id="t0")

    assert deleted.conversations == 1
    assert not logged.replayed
    assert [m.seq for m in logged.messages] == [0]
    conversation = await store.get_conversation(CID)
    assert (conversation.turn_count, conversation.message_count) == (1, 1)
    assert await backend.db.agent_deletions.count_documents({}) == 0
