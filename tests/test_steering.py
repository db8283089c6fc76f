"""Live conversations: messages steered into a running turn, and forks at any message.

The inbox's guarantee: every delivered message is either returned to the runtime
(by `drain` or `close_inbox`) or refused to its sender — never both, never neither.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from agent_store import (
    AgentMessageLogger,
    Conflict,
    ConversationStore,
    InvalidInput,
    NotFound,
    RetryPolicy,
    SteeringInbox,
    StorageUnavailable,
    StoreError,
    TurnRules,
    with_retries,
)
from agent_store.integrations.streams import turn_from_sse
from agent_store.store import CONVERSATIONS, MESSAGES
from scripts.faulty_proxy import FaultyProxy
from tests.conftest import WIRE_CLIENT_OPTIONS, Backend, count_documents_read

CID = "conv-live"
TURN = "turn-running"


@dataclass
class Outcomes:
    returned: list[str] = field(default_factory=list)
    accepted: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)


async def run_turn(inbox: SteeringInbox, logger: AgentMessageLogger, steps: int, rng: random.Random,
                   outcomes: Outcomes, retry: Callable[[Any], Awaitable[Any]]) -> None:  # fmt: skip
    """A runtime: opens the inbox, drains between steps, closes, then logs its answer."""
    await retry(partial(inbox.open_turn, CID, TURN))
    seen = -1

    def take(messages: list[Any]) -> None:
        nonlocal seen
        for message in messages:
            outcomes.returned.append(message.content)
            seen = max(seen, message.seq)

    for _ in range(steps):
        await asyncio.sleep(rng.random() / 50)
        take(await retry(partial(inbox.drain, CID, TURN, seen)))
    while late := await retry(partial(inbox.close_inbox, CID, TURN, seen)):
        take(late)
    answer = [{"role": "assistant", "content": "done"}]
    await retry(partial(logger.log_messages, CID, answer, turn_id=TURN))


async def send(inbox: SteeringInbox, sender: int, count: int, rng: random.Random,
               outcomes: Outcomes, retry: Callable[[Any], Awaitable[Any]]) -> None:  # fmt: skip
    for n in range(count):
        await asyncio.sleep(rng.random() / 30)
        text = f"steer {sender}/{n}"
        message = {"role": "user", "content": text}
        delivered = await retry(
            partial(inbox.try_deliver, CID, TURN, message, delivery_id=f"d-{sender}-{n}")
        )
        (outcomes.accepted if delivered else outcomes.refused).add(text)


async def check(db: Any, outcomes: Outcomes, sent: int) -> None:
    assert len(outcomes.returned) == len(set(outcomes.returned)), "a message returned twice"
    assert set(outcomes.returned) == outcomes.accepted, "delivered but unseen, or seen but refused"
    assert not outcomes.accepted & outcomes.refused
    assert len(outcomes.accepted | outcomes.refused) == sent
    stored = await db[MESSAGES].find({"conversation_id": CID}).sort("seq", 1).to_list(None)
    assert [m["seq"] for m in stored] == list(range(len(stored)))
    steered = {m["content"] for m in stored if m["content"].startswith("steer")}
    assert steered == outcomes.accepted, "a refused message was stored"
    conversation = await db[CONVERSATIONS].find_one({"_id": CID})
    assert conversation["message_count"] == len(stored)


async def direct(call: Any) -> Any:
    return await call()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_every_steered_message_is_returned_to_the_runtime_or_refused_to_its_sender(
    wire_backend: Backend, seed: int
) -> None:
    logger = AgentMessageLogger(wire_backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    inbox, rng, outcomes = SteeringInbox(logger), random.Random(seed), Outcomes()

    await asyncio.gather(
        run_turn(inbox, logger, 5, rng, outcomes, direct),
        *(send(inbox, s, 4, rng, outcomes, direct) for s in range(5)),
    )

    await check(wire_backend.db, outcomes, sent=20)
    assert outcomes.accepted, "nothing was delivered: the test proves nothing"


@pytest.mark.wire
@pytest.mark.parametrize("seed", [5, 6])
async def test_the_handshake_holds_behind_a_network_that_drops_connections(
    wire_uri: str, seed: int
) -> None:
    upstream = wire_uri.removeprefix("mongodb://").split("/")[0]
    proxy = FaultyProxy(upstream, drop_rate=0.05, seed=seed)
    uri = await proxy.start()
    faulty: AsyncMongoClient[Any] = AsyncMongoClient(
        uri,
        tz_aware=True,
        serverSelectionTimeoutMS=3000,
        connectTimeoutMS=3000,
        **WIRE_CLIENT_OPTIONS,
    )
    healthy: AsyncMongoClient[Any] = AsyncMongoClient(wire_uri, tz_aware=True)
    policy = RetryPolicy(attempts=12, first_delay=0.2, max_delay=1.0)
    rng = random.Random(seed)

    async def retry(call: Any) -> Any:
        return await with_retries(call, policy=policy, rng=rng)

    try:
        logger = AgentMessageLogger(faulty["steering"])
        await AgentMessageLogger(healthy["steering"]).log_messages(
            CID, [{"role": "user", "content": "start"}], turn_id="t0"
        )
        inbox, outcomes = SteeringInbox(logger), Outcomes()
        await asyncio.gather(
            run_turn(inbox, logger, 6, rng, outcomes, retry),
            *(send(inbox, s, 4, rng, outcomes, retry) for s in range(4)),
        )
        await check(healthy["steering"], outcomes, sent=16)
        assert sum(proxy.dropped.values()) > 0
    finally:
        await healthy.drop_database("steering")  # the same name for each seed: cleaned after
        await faulty.close()
        await healthy.close()
        await proxy.close()


async def test_a_delivery_to_a_closed_or_unknown_inbox_stores_nothing(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    inbox = SteeringInbox(logger)
    message = {"role": "user", "content": "too late"}

    assert not await inbox.try_deliver(CID, "never-opened", message)
    await inbox.open_turn(CID, TURN)
    assert await inbox.close_inbox(CID, TURN, last_seen_seq=0) == []
    assert not await inbox.try_deliver(CID, TURN, message)

    assert await backend.db[MESSAGES].count_documents({"content": "too late"}) == 0


async def test_a_delivered_message_retried_is_stored_once_and_still_acknowledged(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, TURN)
    message = {"role": "user", "content": "wait, use metric units"}

    assert await inbox.try_deliver(CID, TURN, message, delivery_id="d1")
    assert await inbox.try_deliver(CID, TURN, message, delivery_id="d1")
    late = await inbox.close_inbox(CID, TURN, last_seen_seq=0)

    assert [m.content for m in late] == ["wait, use metric units"]
    assert await backend.db[MESSAGES].count_documents({"content": message["content"]}) == 1
    assert await inbox.close_inbox(CID, TURN, last_seen_seq=late[-1].seq or 0) == []


async def test_a_delivery_id_retried_with_another_message_is_refused_naming_the_delivery_id(
    backend: Backend,
) -> None:
    """The sender names a delivery by its `delivery_id`, never by a turn id: the refusal says
    that id holds another message and to use a new `delivery_id`."""
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, TURN)
    assert await inbox.try_deliver(CID, TURN, {"role": "user", "content": "stop"}, delivery_id="d1")

    with pytest.raises(Conflict) as refusal:
        await inbox.try_deliver(CID, TURN, {"role": "user", "content": "go on"}, delivery_id="d1")

    message = refusal.value.message
    assert "delivery 'd1' into the inbox of turn 'turn-running' was" in message
    assert "Use a new delivery_id for a new delivery" in message
    assert "delivery-" not in message
    assert "turn_id" not in message
    assert await backend.db[MESSAGES].count_documents({"content": "go on"}) == 0


async def test_a_delivery_undone_by_a_pop_is_not_returned_as_what_took_its_seq(
    backend: Backend,
) -> None:
    """The pop gives the delivery's `seq` back; the runtime's next message takes it. The inbox
    hands back delivered messages only, never that one."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, TURN)
    assert await inbox.try_deliver(CID, TURN, {"role": "user", "content": "no, the 10:04"})
    popped = await store.pop_last_message(CID)
    assert popped is not None
    await logger.log_messages(CID, [{"role": "assistant", "content": "Pay 35 EUR?"}], turn_id="t1")

    assert await inbox.drain(CID, TURN, after_seq=0) == []
    assert await inbox.close_inbox(CID, TURN, last_seen_seq=0) == []


async def test_a_delivery_into_the_seq_of_a_popped_delivery_the_runtime_saw_is_refused(
    backend: Backend,
) -> None:
    """The runtime drained "use metric" (seq 1), the person popped it and sent a correction,
    which would take seq 1 again: at or below what the runtime has seen, no drain or close
    would return it. Refused instead (False, nothing stored: sent as a turn); every message
    delivered reaches the runtime, or is refused to its sender."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, TURN)
    assert await inbox.try_deliver(CID, TURN, {"role": "user", "content": "use metric"})
    [seen] = await inbox.drain(CID, TURN, after_seq=0)
    assert await store.pop_last_message(CID) is not None

    delivered = await inbox.try_deliver(CID, TURN, {"role": "user", "content": "no, imperial!"})
    later = await inbox.drain(CID, TURN, after_seq=seen.seq or 0)

    assert (delivered, [m.content for m in later]) == (False, [])
    assert await backend.db[MESSAGES].count_documents({"content": "no, imperial!"}) == 0
    assert await inbox.close_inbox(CID, TURN, last_seen_seq=seen.seq or 0) == []


class DiesAfterReserving:
    """A sender whose process dies between its two writes: its delivery reserved a `seq` and
    stored nothing."""

    def __init__(self, logger: AgentMessageLogger) -> None:
        real = logger._messages

        class Lost:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            async def insert_many(self, *args: Any, **kwargs: Any) -> Any:
                raise ConnectionError("the sender died after reserving")

        logger._messages = Lost()


def _late_rules(inbox_deliveries: int = 256) -> Any:
    """Rules under which every empty block is abandoned at once (`abandon_after` 0): a
    retried delivery that stored nothing moves to a new block at the end (DESIGN.md §3)."""
    from datetime import timedelta

    return TurnRules(abandon_after=timedelta(0), inbox_deliveries=inbox_deliveries)


async def _a_delivery_that_died(
    backend: Backend,
    steer: dict[str, Any],
    first: list[dict[str, Any]] | None = None,
    rules: TurnRules | None = None,
) -> tuple[AgentMessageLogger, SteeringInbox]:
    """An open turn's inbox and a delivery "d1" of `steer` whose sender reserved its block
    and died before the insert, after a turn "t0" of `first` (a user message by default);
    returns the logger (late rules unless `rules`) and the runtime's inbox."""
    rules = rules or _late_rules()
    logger = AgentMessageLogger(backend.db, rules=rules)
    first = first or [{"role": "user", "content": "start"}]
    await logger.log_messages(CID, first, turn_id="t0")
    runtime = SteeringInbox(logger)
    await runtime.open_turn(CID, TURN)
    dying = AgentMessageLogger(backend.db, rules=rules)
    DiesAfterReserving(dying)
    with pytest.raises(ConnectionError):
        await SteeringInbox(dying).try_deliver(CID, TURN, steer, delivery_id="d1")
    return logger, runtime


async def _a_popped_delivery(backend: Backend) -> SteeringInbox:
    """A turn's open inbox (default rules) into which "d1" was delivered at `seq` 1 and then
    popped before the runtime drained it; returns the runtime's inbox."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, TURN)
    steer = {"role": "user", "content": "in metric"}
    assert await inbox.try_deliver(CID, TURN, steer, delivery_id="d1")
    popped = await store.pop_last_message(CID)
    assert popped is not None
    assert popped.content == "in metric"
    return inbox


async def test_a_delivery_a_pop_removed_retried_is_refused_naming_the_delivery_id(
    backend: Backend,
) -> None:
    """A pop removed the delivery after it was delivered; its sender retries it as sent. The
    refusal speaks of the delivery (its `delivery_id`, the inbox's turn), never of the turn
    id it is stored under, and says what to do: a new `delivery_id` delivers it again."""
    inbox = await _a_popped_delivery(backend)

    steer = {"role": "user", "content": "in metric"}
    with pytest.raises(Conflict) as refusal:
        await inbox.try_deliver(CID, TURN, steer, delivery_id="d1")

    message = refusal.value.message
    assert "delivery 'd1' into the inbox of turn 'turn-running' was delivered" in message
    assert "removed" in message
    assert "new delivery_id" in message
    assert "delivery-" not in message
    assert "turn_id" not in message
    assert await backend.db[MESSAGES].count_documents({"content": "in metric"}) == 0


async def test_a_delivery_whose_insert_was_lost_retried_with_another_message_is_503_meanwhile(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for a turn (CHANGELOG 0.2.0): the first attempt reserved and stored nothing, and may
    still store its message until `abandon_after`; a retry editing the message is
    StorageUnavailable naming the delivery, nothing written, never a Conflict saying it was
    stored. A retry of the message as first sent stores it, and the runtime gets it."""
    from agent_store.store import _inbox

    monkeypatch.setattr(_inbox, "_WAIT_FOR_IN_FLIGHT", 0.1)
    sent = {"role": "user", "content": "use metrc"}
    logger, runtime = await _a_delivery_that_died(backend, sent, rules=TurnRules())
    before = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    inbox = SteeringInbox(logger)

    edited = {"role": "user", "content": "use metric"}
    with pytest.raises(StorageUnavailable) as refusal:
        await inbox.try_deliver(CID, TURN, edited, delivery_id="d1")

    message = refusal.value.message
    assert "delivery 'd1' into the inbox of turn 'turn-running'" in message
    assert "stored with" not in message
    assert "delivery-" not in message
    assert "turn_id" not in message
    assert await backend.db[CONVERSATIONS].find_one({"_id": CID}) == before
    assert await backend.db[MESSAGES].count_documents({"content": {"$regex": "^use metr"}}) == 0
    assert await inbox.try_deliver(CID, TURN, sent, delivery_id="d1")
    assert [m.content for m in await runtime.close_inbox(CID, TURN, last_seen_seq=0)] == [
        "use metrc"
    ]


@pytest.mark.parametrize("closed", [False, True], ids=["inbox open", "inbox closed"])
async def test_a_delivery_whose_insert_was_lost_retried_late_with_another_message_is_delivered(
    backend: Backend, closed: bool
) -> None:
    """Past `abandon_after` the empty block is given back, as a turn's is, and the edited
    message is delivered in its place while the inbox is open: the runtime gets it once, and
    closes over the empty block at once. Into an inbox closed meanwhile it is refused
    (False), nothing stored, as any late delivery."""
    logger, runtime = await _a_delivery_that_died(backend, {"role": "user", "content": "use metrc"})
    if closed:
        assert await runtime.close_inbox(CID, TURN, last_seen_seq=0) == []
    edited = {"role": "user", "content": "use metric"}

    delivered = await SteeringInbox(logger).try_deliver(CID, TURN, edited, delivery_id="d1")

    stored = await backend.db[MESSAGES].find({"conversation_id": CID}).to_list(None)
    assert delivered is not closed
    assert [m["content"] for m in stored] == ["start"] + ["use metric"] * (not closed)
    if not closed:
        drained = await runtime.drain(CID, TURN, after_seq=0)
        assert [m.content for m in drained] == ["use metric"]
        assert await runtime.close_inbox(CID, TURN, last_seen_seq=drained[-1].seq or 0) == []


@pytest.mark.parametrize("closed", [False, True], ids=["inbox open", "inbox closed"])
async def test_a_delivery_given_back_for_another_message_takes_its_preview_and_time_back(
    backend: Backend, closed: bool
) -> None:
    """As a turn's (DESIGN.md): the lost delivery (noon) set the preview and `updated_at`;
    its late retry, with another message holding no text and dated earlier, gives its empty
    block back: the conversation shows what its stored messages say, never the lost
    message, and their latest time; the same when the inbox closed meanwhile refuses it."""
    from datetime import timedelta

    noon = datetime(2026, 1, 1, 12, tzinfo=UTC)
    start = [{"role": "user", "content": "start", "created_at": noon - timedelta(hours=2)}]
    steer = {"role": "user", "content": "never stored", "created_at": noon}
    logger, runtime = await _a_delivery_that_died(backend, steer, first=start)
    if closed:
        assert await runtime.close_inbox(CID, TURN, last_seen_seq=0) == []
    edited = {"role": "user", "content": "", "created_at": noon - timedelta(hours=3)}

    delivered = await SteeringInbox(logger).try_deliver(CID, TURN, edited, delivery_id="d1")

    assert delivered is not closed
    conversation = await ConversationStore(backend.db).get_conversation(CID)
    assert conversation.last_message_preview == "start"
    assert conversation.updated_at == noon - timedelta(hours=2)


async def test_a_delivery_a_pop_undid_is_passed_at_once_by_drain_and_close(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3: a pop removed the delivery before the runtime drained it, giving its `seq`
    back. Nothing is being written there: `drain` passes it without waiting for it, and the
    inbox closes at once, not `abandon_after` later."""
    from agent_store.store import _inbox

    monkeypatch.setattr(_inbox, "_WAIT_FOR_IN_FLIGHT", 60.0)  # a wait would show as a timeout
    inbox = await _a_popped_delivery(backend)

    assert await asyncio.wait_for(inbox.drain(CID, TURN, after_seq=0), timeout=10) == []
    assert await asyncio.wait_for(inbox.close_inbox(CID, TURN, last_seen_seq=0), timeout=10) == []
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert not conversation.get("inbox")


async def test_a_delivery_whose_seq_a_pop_left_as_a_gap_does_not_hold_its_inbox_open(
    backend: Backend,
) -> None:
    """The delivery was popped while a turn had reserved past it (a block its own rules
    passed): its `seq` is a gap a pop left (`popped_seqs`), never written again, and the
    runtime's inbox closes over it at once."""
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, TURN)
    assert await inbox.try_deliver(CID, TURN, {"role": "user", "content": "in metric"})
    dying = AgentMessageLogger(backend.db)
    DiesAfterReserving(dying)
    with pytest.raises(ConnectionError):
        await dying.log_messages(CID, [{"role": "assistant", "content": "lost"}], turn_id="t2")
    popped = await ConversationStore(backend.db, rules=_late_rules()).pop_last_message(CID)
    assert popped is not None
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert (conversation["message_count"], conversation["popped_seqs"]) == (3, [1])

    assert await inbox.close_inbox(CID, TURN, last_seen_seq=0) == []


async def test_a_popped_delivery_whose_seq_a_turn_in_flight_took_since_does_not_hold_its_inbox(
    backend: Backend,
) -> None:
    """The pop gave the delivery's `seq` back and a turn took it and is still writing it: the
    delivery is listed among the popped messages, so the inbox closes without waiting on a
    message that is not the delivery's."""
    inbox = await _a_popped_delivery(backend)
    dying = AgentMessageLogger(backend.db)
    DiesAfterReserving(dying)
    with pytest.raises(ConnectionError):
        await dying.log_messages(CID, [{"role": "assistant", "content": "lost"}], turn_id="t2")
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert conversation["message_count"] == 2

    assert await inbox.close_inbox(CID, TURN, last_seen_seq=0) == []


async def test_a_delivery_reserved_and_not_yet_stored_keeps_its_inbox_from_closing(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No pop removed it: a delivery whose insert has not landed, younger than
    `abandon_after`, is still being written. `drain` stops before it and `close_inbox` asks
    to be called again rather than close over it."""
    from agent_store.store import _inbox

    monkeypatch.setattr(_inbox, "_WAIT_FOR_IN_FLIGHT", 0.1)
    steer = {"role": "user", "content": "stop"}
    _, runtime = await _a_delivery_that_died(backend, steer, rules=TurnRules())

    assert await runtime.drain(CID, TURN, after_seq=0) == []
    with pytest.raises(StorageUnavailable, match="still being written"):
        await runtime.close_inbox(CID, TURN, last_seen_seq=0)


async def test_a_runtime_slower_than_abandon_after_between_its_reads_drains_a_delivery_landed(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN.md §3: a block is passed only if it was older than `abandon_after` when the
    messages were read. d1 reserved `seq` 1, its insert held; d2 is stored at 2. d1 lands
    after the runtime's read of the delivered messages and before its lookup of the pops, the
    runtime's clock then past `abandon_after` (2 s; faked 3 s on): it drains d1, then d2."""
    from datetime import timedelta

    from agent_store.store import _inbox

    rules = TurnRules(abandon_after=timedelta(seconds=2))
    logger = AgentMessageLogger(backend.db, rules=rules)
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    runtime = SteeringInbox(logger)
    await runtime.open_turn(CID, TURN)
    slow = AgentMessageLogger(backend.db, rules=rules)
    insert_many, reserved, go = slow._messages.insert_many, asyncio.Event(), asyncio.Event()

    async def held(*args: Any, **kwargs: Any) -> Any:
        reserved.set()
        await go.wait()
        return await insert_many(*args, **kwargs)

    monkeypatch.setattr(slow._messages, "insert_many", held)
    first = {"role": "user", "content": "d1"}
    d1 = asyncio.create_task(SteeringInbox(slow).try_deliver(CID, TURN, first, delivery_id="d1"))
    await reserved.wait()
    second = {"role": "user", "content": "d2"}
    assert await SteeringInbox(logger).try_deliver(CID, TURN, second, delivery_id="d2")
    looked_up = runtime._pops

    async def slow_lookup(conversation_id: str) -> Any:
        go.set()
        await d1
        later = datetime.now(UTC) + timedelta(seconds=3)
        monkeypatch.setattr(_inbox, "utc_now", lambda: later)
        return await looked_up(conversation_id)

    monkeypatch.setattr(runtime, "_pops", slow_lookup)

    drained = await runtime.drain(CID, TURN, after_seq=0)

    assert [(m.seq, m.content) for m in drained] == [(1, "d1"), (2, "d2")]


async def test_a_delivery_retried_after_abandon_after_reaches_the_runtime(
    backend: Backend,
) -> None:
    """A delivery whose first attempt reserved and died, retried later than `abandon_after`,
    is stored at the end and acknowledged: the runtime drains it, exactly once, and the inbox
    does not close over it."""
    steer = {"role": "user", "content": "stop and do X instead"}
    logger, runtime = await _a_delivery_that_died(backend, steer)
    await logger.log_messages(CID, [{"role": "assistant", "content": "working"}], turn_id="t1")

    accepted = await SteeringInbox(logger).try_deliver(CID, TURN, steer, delivery_id="d1")
    drained = await runtime.drain(CID, TURN, after_seq=0)
    seen = max((m.seq or 0 for m in drained), default=0)
    again = await runtime.drain(CID, TURN, after_seq=seen)
    closed = await runtime.close_inbox(CID, TURN, seen)

    assert accepted is True
    assert [(m.seq, m.content) for m in drained] == [(3, "stop and do X instead")]
    assert again == closed == []
    assert await backend.db[MESSAGES].count_documents({"content": steer["content"]}) == 1


async def test_a_delivery_retried_after_abandon_after_into_a_closed_inbox_is_refused(
    backend: Backend,
) -> None:
    """The runtime passed the dead delivery and closed its inbox: the late retry is refused
    to its sender, storing nothing and taking no new block (one tail readers would wait on)."""
    steer = {"role": "user", "content": "too late"}
    logger, runtime = await _a_delivery_that_died(backend, steer)
    assert await runtime.close_inbox(CID, TURN, last_seen_seq=0) == []

    accepted = await SteeringInbox(logger).try_deliver(CID, TURN, steer, delivery_id="d1")

    assert accepted is False
    assert await backend.db[MESSAGES].count_documents({"content": steer["content"]}) == 0
    conversation = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert conversation["message_count"] == 2


async def test_a_delivery_refused_for_an_inbox_closed_meanwhile_takes_its_summary_back(
    backend: Backend,
) -> None:
    """As a refused turn's: the lost delivery (noon) set the preview, `updated_at` and the
    turn count; its retry with the same message, refused (False) for the inbox the runtime
    closed meanwhile, stores nothing, and the conversation shows what its stored messages
    say: never the text its sender was told was not delivered, nor its time or its turn."""
    from datetime import timedelta

    noon = datetime(2026, 1, 1, 12, tzinfo=UTC)
    start = [{"role": "user", "content": "start", "created_at": noon - timedelta(hours=2)}]
    steer = {"role": "user", "content": "never delivered", "created_at": noon}
    logger, runtime = await _a_delivery_that_died(backend, steer, first=start)
    assert await runtime.close_inbox(CID, TURN, last_seen_seq=0) == []

    accepted = await SteeringInbox(logger).try_deliver(CID, TURN, steer, delivery_id="d1")

    assert accepted is False
    conversation = await ConversationStore(backend.db).get_conversation(CID)
    assert conversation.last_message_preview == "start"
    assert conversation.updated_at == noon - timedelta(hours=2)
    assert conversation.turn_count == 1


async def test_a_delivery_retried_after_abandon_after_into_a_full_inbox_is_refused(
    backend: Backend,
) -> None:
    """The dead delivery's `seq` filled its inbox: its late retry, which would move it to a
    new block, is refused to its sender like a new delivery, storing nothing, and the runtime
    passes the empty block and closes."""
    steer = {"role": "user", "content": "stop"}
    logger, runtime = await _a_delivery_that_died(backend, steer, rules=_late_rules(1))

    accepted = await SteeringInbox(logger).try_deliver(CID, TURN, steer, delivery_id="d1")

    assert accepted is False
    assert await backend.db[MESSAGES].count_documents({"content": "stop"}) == 0
    assert await runtime.close_inbox(CID, TURN, last_seen_seq=0) == []


async def test_a_refused_late_delivery_leaves_pending_what_the_stored_messages_leave(
    backend: Backend,
) -> None:
    """DESIGN.md §3 Pending HITL: an upload clears the prompt before it. The dead delivery's
    reservation cleared the pending prompt; refused once its inbox closed, it is never
    stored, so the prompt no stored message answers is pending again."""
    from agent_store import ConversationStore
    from agent_store.store._turns import pending_after

    upload = {"filename": "id.pdf", "file_type": "application/pdf", "size": 10}
    steer = {"role": "user", "content": "Here.", "upload": upload}
    ask = {"action": "confirm", "params": {}, "request_id": "r1"}
    first = [{"role": "user", "content": "Open it"}, {"role": "assistant", "hitl_action": ask}]
    logger, runtime = await _a_delivery_that_died(backend, steer, first)
    store = ConversationStore(backend.db)
    assert await store.pending_hitl(CID) is None  # the reservation cleared it
    assert await runtime.close_inbox(CID, TURN, last_seen_seq=1) == []

    accepted = await SteeringInbox(logger).try_deliver(CID, TURN, steer, delivery_id="d1")

    assert accepted is False
    _, folded = pending_after(await store.transcript(CID))
    pending = await store.pending_hitl(CID)
    assert folded is not None
    assert pending is not None
    assert (pending.request_id, folded.request_id) == (ask["request_id"],) * 2


async def test_a_stranger_cannot_open_or_deliver_into_anothers_turn(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(
        CID, [{"role": "user", "content": "start"}], turn_id="t0", user_id="user-ada"
    )
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, TURN, user_id="user-ada", owner_only=True)

    with pytest.raises(NotFound):
        await inbox.open_turn(CID, "t-x", user_id="user-mallory", owner_only=True)
    with pytest.raises(NotFound):
        await inbox.try_deliver(
            CID, TURN, {"role": "user", "content": "x"}, user_id="user-mallory", owner_only=True
        )
    assert await inbox.try_deliver(
        CID, TURN, {"role": "user", "content": "mine"}, user_id="user-ada", owner_only=True
    )


async def test_a_conversation_keeps_at_most_its_rules_open_inboxes(backend: Backend) -> None:
    """Each open inbox is an entry on the conversation document: a caller opening inboxes
    without closing them is refused past the rules' `open_inboxes`, nothing written, and
    the document stays far below MongoDB's 16 MiB."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(open_inboxes=2))
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, "run-1")
    await inbox.open_turn(CID, "run-2")
    before = await backend.db[CONVERSATIONS].find_one({"_id": CID})

    with pytest.raises(Conflict, match="2 open steering inboxes"):
        await inbox.open_turn(CID, "run-3")
    assert await backend.db[CONVERSATIONS].find_one({"_id": CID}) == before
    await inbox.open_turn(CID, "run-2")  # an open one opened again: still idempotent
    assert await inbox.close_inbox(CID, "run-1", last_seen_seq=0) == []
    await inbox.open_turn(CID, "run-3")
    assert await inbox.try_deliver(CID, "run-3", {"role": "user", "content": "now"})


async def test_inboxes_left_open_past_their_expiry_give_way_to_a_new_one_at_the_limit(
    backend: Backend,
) -> None:
    """Runtimes that died without closing their inboxes do not block steering for good: at
    the limit, inboxes opened longer than the rules' `inbox_expiry` ago are closed to make
    room (a delivery into one is then refused), fresh ones never."""
    from datetime import timedelta

    logger = AgentMessageLogger(
        backend.db, rules=TurnRules(open_inboxes=2, inbox_expiry=timedelta(0))
    )
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, "run-1")
    await inbox.open_turn(CID, "run-2")

    await inbox.open_turn(CID, "run-3")

    assert await inbox.try_deliver(CID, "run-1", {"role": "user", "content": "late"}) is False
    assert await inbox.try_deliver(CID, "run-3", {"role": "user", "content": "now"}) is True
    stored = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert [e["turn_id"] for e in stored["inbox"].values()] == ["run-3"]


async def test_an_inbox_takes_at_most_its_rules_deliveries_and_refuses_the_next_unstored(
    backend: Backend,
) -> None:
    """Each delivery is listed on its inbox's entry: past the rules' `inbox_deliveries` a new
    one is refused to its sender (False: nothing stored, send it as a turn of its own),
    while a retry of one delivered is still acknowledged, stored once."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(inbox_deliveries=2))
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, TURN)
    first, second = ({"role": "user", "content": f"steer {n}"} for n in (1, 2))
    assert await inbox.try_deliver(CID, TURN, first, delivery_id="d1")
    assert await inbox.try_deliver(CID, TURN, second, delivery_id="d2")

    assert await inbox.try_deliver(CID, TURN, {"role": "user", "content": "one more"}) is False
    assert await inbox.try_deliver(CID, TURN, second, delivery_id="d2") is True

    assert await backend.db[MESSAGES].count_documents({"content": "one more"}) == 0
    assert await backend.db[MESSAGES].count_documents({"content": "steer 2"}) == 1
    late = await inbox.close_inbox(CID, TURN, last_seen_seq=0)
    assert [m.content for m in late] == ["steer 1", "steer 2"]
    assert await inbox.close_inbox(CID, TURN, last_seen_seq=late[-1].seq or 0) == []


BULKY = "x" * 4_000  # a small page budget (monkeypatched) holds a few of these


async def deliver_bulky(backend: Backend, count: int) -> SteeringInbox:
    """An open inbox holding `count` deliveries of about 4,000 characters each."""
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    inbox = SteeringInbox(logger)
    await inbox.open_turn(CID, TURN)
    for n in range(count):
        message = {"role": "user", "content": f"{n} {BULKY}"}
        assert await inbox.try_deliver(CID, TURN, message, delivery_id=f"d{n}")
    return inbox


def numbers(messages: list[Any]) -> list[int]:
    return [int(m.content.split()[0]) for m in messages]


async def test_an_inbox_is_read_in_pages_of_page_bytes_that_say_whether_more_follow(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of the inbox answers what fits in `PAGE_BYTES` (one delivery at least) and
    says whether more follow; the runtime reads on after the last `seq` it got, and gets
    every delivery once, in order. `drain` answers the same first page."""
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 20_000)  # two deliveries
    inbox = await deliver_bulky(backend, 5)
    pages, seen = [], -1
    while True:
        page = await inbox.drain_page(CID, TURN, after_seq=seen)
        pages.append((numbers(page.data), page.has_more))
        if not page.has_more:
            break
        seen = page.data[-1].seq
    assert pages == [([0, 1], True), ([2, 3], True), ([4], False)]
    assert numbers(await inbox.drain(CID, TURN)) == [0, 1]
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 1)
    alone = await inbox.drain_page(CID, TURN)
    assert (numbers(alone.data), alone.has_more) == ([0], True)


async def test_an_inbox_read_reads_no_more_deliveries_than_its_page_can_hold(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However many deliveries an inbox holds, a read of it takes from the database about
    what its page holds (the first batch, then the room left), never every delivery."""
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 20_000)
    monkeypatch.setattr("agent_store.store._reads.PAGE_FIRST_BATCH", 3)
    inbox = await deliver_bulky(backend, 20)
    read = count_documents_read(monkeypatch, inbox._messages)
    page = await inbox.drain_page(CID, TURN)
    closing = await inbox.close_inbox_page(CID, TURN, last_seen_seq=-1)
    assert numbers(page.data) == numbers(closing.data) == [0, 1]
    assert read == [3, 3]


async def test_closing_an_inbox_answers_a_page_of_what_arrived_and_closes_once_all_is_read(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close finding deliveries the runtime has not seen answers a page of them (what fits
    in `PAGE_BYTES`), saying whether more follow, and leaves the inbox open; the runtime
    closes again after the last `seq` it got, and the inbox closes once nothing is left
    unseen, however much was delivered. The list form (`close_inbox`) reads on the same."""
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 20_000)
    inbox = await deliver_bulky(backend, 5)
    pages, seen = [], 0
    while (page := await inbox.close_inbox_page(CID, TURN, last_seen_seq=seen)).data:
        pages.append((numbers(page.data), page.has_more))
        seen = page.data[-1].seq
    assert pages == [([0, 1], True), ([2, 3], True), ([4], False)]
    assert not page.has_more
    assert await inbox.try_deliver(CID, TURN, {"role": "user", "content": "late"}) is False

    await inbox.open_turn(CID, "run-2")
    for n in range(3):
        message = {"role": "user", "content": f"{n} {BULKY}"}
        assert await inbox.try_deliver(CID, "run-2", message, delivery_id=f"e{n}")
    got, seen = [], 0
    while late := await inbox.close_inbox(CID, "run-2", last_seen_seq=seen):
        got.append(numbers(late))
        seen = late[-1].seq
    assert got == [[0, 1], [2]]


# -- forks ---------------------------------------------------------------------------------------


def weather_turn(city: str) -> list[dict[str, Any]]:
    call = f"call-{city}"
    return [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "tool_calls": [{"id": call, "function": {"name": "weather"}}],
         "token_usage": {"input_tokens": 10, "output_tokens": 2}},
        {"role": "tool", "tool_call_id": call, "content": '{"temp_c": 18}'},
        {"role": "assistant", "content": f"18 °C in {city}.",
         "token_usage": {"input_tokens": 20, "output_tokens": 5}},
    ]  # fmt: skip


async def test_a_fork_copies_the_messages_up_to_a_seq_with_its_own_summary(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db)
    for n, city in enumerate(["Paris", "Lyon", "Nice"]):
        await logger.log_messages(CID, weather_turn(city), turn_id=f"t{n}", user_id="user-ada")
    store = ConversationStore(backend.db)
    original = await store.transcript(CID)

    forked = await logger.fork(CID, 5, "conv-fork")  # seq 5 is Lyon's call: moved past its result

    copies = await store.transcript("conv-fork")
    assert [m.id for m in copies] == [m.id for m in forked.messages]
    assert [(m.role, m.content, m.tool_call_id) for m in copies] == [
        (m.role, m.content, m.tool_call_id) for m in original[:7]
    ]
    assert [m.seq for m in copies] == list(range(7))
    assert not {m.id for m in copies} & {m.id for m in original}
    conversation = await store.get_conversation("conv-fork")
    assert conversation.user_id == "user-ada"
    assert conversation.forked_from is not None
    assert (conversation.forked_from.conversation_id, conversation.forked_from.seq) == (CID, 6)
    assert (conversation.turn_count, conversation.message_count) == (2, 7)
    assert conversation.usage.input_tokens == 10 + 20 + 10
    assert conversation.last_message_preview == "Weather in Lyon?"


async def test_writing_to_a_fork_or_its_original_never_changes_the_other(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, weather_turn("Paris"), turn_id="t0")
    await logger.fork(CID, 3, "conv-fork")
    store = ConversationStore(backend.db)

    await logger.log_messages("conv-fork", weather_turn("Rome"), turn_id="t1")
    await logger.log_messages(CID, weather_turn("Oslo"), turn_id="t1")
    await store.rename("conv-fork", "A fork")

    fork, original = await store.transcript("conv-fork"), await store.transcript(CID)
    assert [m.content for m in fork][-1] == "18 °C in Rome."
    assert [m.content for m in original][-1] == "18 °C in Oslo."
    assert (await store.get_conversation(CID)).name != "A fork"


async def test_a_fork_retried_is_stored_once_and_an_existing_id_is_a_conflict(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, weather_turn("Paris"), turn_id="t0")
    first = await logger.fork(CID, 3, "conv-fork")
    again = await logger.fork(CID, 3, "conv-fork")

    assert again.replayed
    assert [m.id for m in again.messages] == [m.id for m in first.messages]
    with pytest.raises(Conflict, match="exists already"):
        await logger.fork(CID, 1, "conv-fork")
    with pytest.raises(Conflict, match="exists already"):
        await logger.fork("conv-fork", 1, CID)


async def test_a_fork_of_more_messages_than_a_turn_holds_is_refused_saying_so() -> None:
    """A fork copies its messages as one turn: past `MAX_MESSAGES_PER_TURN` it is refused
    as a fork (where to fork instead), before any whole text is read, nothing created."""
    from mongomock_motor import AsyncMongoMockClient

    from agent_store.store import MAX_MESSAGES_PER_TURN

    db = AsyncMongoMockClient()["long"]
    logger = AgentMessageLogger(db)
    half = MAX_MESSAGES_PER_TURN // 2
    for n in range(2):
        said = [{"role": "user", "content": f"{n}/{i}"} for i in range(half + 1)]
        await logger.log_messages(CID, said, turn_id=f"t{n}")

    with pytest.raises(InvalidInput) as refused:
        await logger.fork(CID, MAX_MESSAGES_PER_TURN, "fork-long")

    assert str(refused.value) == (
        f"a fork copies at most {MAX_MESSAGES_PER_TURN} messages; at_seq "
        f"{MAX_MESSAGES_PER_TURN} would copy {MAX_MESSAGES_PER_TURN + 1}: fork at seq "
        f"{MAX_MESSAGES_PER_TURN - 1} or before"
    )
    assert await db[CONVERSATIONS].find_one({"_id": "fork-long"}) is None
    forked = await logger.fork(CID, MAX_MESSAGES_PER_TURN - 1, "fork-long")
    assert len(forked.messages) == MAX_MESSAGES_PER_TURN


async def test_a_fork_making_more_calls_than_a_turn_may_is_refused_naming_where_to_fork() -> None:
    """A fork copies its messages as one turn, whose reservation names every call it makes:
    past `MAX_TURN_TOOL_CALLS` it is refused as a fork, naming the last `seq` that fits. The
    fork stops reading at the message that takes it past the limit (seq 13 here), so the
    refusal says it would copy more, not how many."""
    from mongomock_motor import AsyncMongoMockClient

    from agent_store.store import MAX_TURN_TOOL_CALLS

    db = AsyncMongoMockClient()["calls"]
    logger = AgentMessageLogger(db)
    per_message = MAX_TURN_TOOL_CALLS // 10
    for n in range(3):  # seqs 6n (the question) to 6n + 5, each turn half as many calls as one may
        said: list[dict[str, Any]] = [{"role": "user", "content": f"go {n}"}]
        for m in range(5):
            calls = [{"id": f"t{n}-{m}-{c}", "function": {"name": "f"}} for c in range(per_message)]
            said.append({"role": "assistant", "tool_calls": calls})
        await logger.log_messages(CID, said, turn_id=f"t{n}")

    with pytest.raises(InvalidInput) as refused:
        await logger.fork(CID, 17, "fork-calls")

    assert str(refused.value) == (
        f"a fork copies at most {MAX_TURN_TOOL_CALLS:,} tool calls; at_seq 17 would copy "
        "more: fork at seq 12 or before"
    )
    assert await db[CONVERSATIONS].find_one({"_id": "fork-calls"}) is None
    assert len((await logger.fork(CID, 12, "fork-calls")).messages) == 13


async def test_a_fork_holding_more_whole_text_than_it_may_read_at_once_is_refused(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork reads the whole texts of the cut messages it copies at once: past
    `MAX_FORK_WHOLE_TEXT_CHARS` it is refused before reading any, naming where to fork."""
    from agent_store.store import _logger

    monkeypatch.setattr(_logger, "MAX_FORK_WHOLE_TEXT_CHARS", 150_000)
    logger = AgentMessageLogger(backend.db, rules=TurnRules(max_message_bytes=16 * 1024))
    for n in range(3):
        said = [{"role": "user", "content": "x" * 60_000}]
        await logger.log_messages(CID, said, turn_id=f"t{n}")

    with pytest.raises(InvalidInput, match="characters of whole texts") as refused:
        await logger.fork(CID, 2, "fork-big")

    assert str(refused.value).endswith("fork at seq 1 or before")
    assert await backend.db[CONVERSATIONS].find_one({"_id": "fork-big"}) is None
    assert len((await logger.fork(CID, 1, "fork-big")).messages) == 2


async def log_megabyte_messages(logger: AgentMessageLogger, count: int) -> None:
    """`count` user messages of about 1 MB each (within the 1 MiB bound), 12 to a turn."""
    for start in range(0, count, 12):
        said = [
            {"role": "user", "content": f"m{n} " + "x" * 1_000_000}
            for n in range(start, min(count, start + 12))
        ]
        await logger.log_messages(CID, said, turn_id=f"t{start}")


async def test_a_fork_copying_more_than_it_may_hold_as_stored_is_refused_naming_where_to_fork(
    backend: Backend,
) -> None:
    """A fork holds what it copies as stored (and echoes it): past `MAX_FORK_BYTES` (16 MiB)
    it is refused as a fork before anything is written, naming the last `seq` that fits,
    however many messages it copies; on a server that sends a read in one reply too, never a
    storage failure (50 messages of 1 MB are past the 48 MB a reply may carry)."""
    from agent_store.store import MAX_FORK_BYTES

    logger = AgentMessageLogger(backend.db)
    await log_megabyte_messages(logger, 50)

    with pytest.raises(InvalidInput) as refused:
        await logger.fork(CID, 49, "fork-big")

    fitting = MAX_FORK_BYTES // 1_000_100 - 1  # each stored message is a little over 1 MB
    assert str(refused.value) == (
        f"a fork copies at most {MAX_FORK_BYTES:,} bytes of messages as stored; at_seq 49 "
        f"would copy more: fork at seq {fitting} or before"
    )
    assert await backend.db[CONVERSATIONS].find_one({"_id": "fork-big"}) is None
    forked = await logger.fork(CID, fitting, "fork-big")
    assert len(forked.messages) == fitting + 1


async def test_a_fork_reads_the_messages_it_copies_not_the_whole_conversation(
    wire_backend: Backend,
) -> None:
    """A fork early in a long conversation holds about what it copies: the messages after
    where it ends are never read whole (30 MB of them here, traced as the driver decodes)."""
    import tracemalloc

    logger = AgentMessageLogger(wire_backend.db)
    await log_megabyte_messages(logger, 30)

    tracemalloc.start()
    try:
        forked = await logger.fork(CID, 1, "fork-early")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(forked.messages) == 2
    assert peak < 12 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB"


def calls_answered_past(calls: int, result: str = "ok") -> list[dict[str, Any]]:
    """A turn whose assistant message makes `calls` calls, each answered by a result of its own
    (`result`), then a closing answer: a fork at the call moves past every result."""
    ids = [f"call-{k}" for k in range(calls)]
    return [
        {"role": "user", "content": "look them up"},
        {
            "role": "assistant",
            "tool_calls": [{"id": i, "function": {"name": "lookup"}} for i in ids],
        },
        *({"role": "tool", "tool_call_id": i, "content": result} for i in ids),
        {"role": "assistant", "content": "done"},
    ]


async def test_a_fork_refused_for_its_length_names_a_seq_whose_fork_fits() -> None:
    """The seq a refused fork names is one a fork at which, moved past the results of the calls
    made at it, copies no more than a turn holds: never a call whose results lie past the limit
    (the fork there would be refused again, naming it again)."""
    from mongomock_motor import AsyncMongoMockClient

    from agent_store.store import MAX_MESSAGES_PER_TURN

    logger = AgentMessageLogger(AsyncMongoMockClient()["long"])
    said = [{"role": "user", "content": f"m{i}"} for i in range(MAX_MESSAGES_PER_TURN - 2)]
    await logger.log_messages(CID, said, turn_id="t0")
    await logger.log_messages(CID, calls_answered_past(3), turn_id="t1")  # the call at 999

    with pytest.raises(InvalidInput) as refused:
        await logger.fork(CID, MAX_MESSAGES_PER_TURN + 3, "fork-long")

    named = int(str(refused.value).split("fork at seq ")[1].split(" ")[0])
    assert named == MAX_MESSAGES_PER_TURN - 2  # the user's message before the call
    forked = await logger.fork(CID, named, "fork-long")
    assert len(forked.messages) == MAX_MESSAGES_PER_TURN - 1


async def test_a_fork_refused_for_its_whole_texts_names_a_seq_whose_fork_fits(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for the whole texts a fork reads at once: the call whose result holds the
    whole text over the limit is not named (a fork there copies that result), the message
    before it is."""
    from agent_store.store import _logger

    monkeypatch.setattr(_logger, "MAX_FORK_WHOLE_TEXT_CHARS", 50_000)
    logger = AgentMessageLogger(backend.db, rules=TurnRules(max_message_bytes=16 * 1024))
    await logger.log_messages(CID, calls_answered_past(1, "y" * 60_000), turn_id="t0")

    with pytest.raises(InvalidInput, match="characters of whole texts") as refused:
        await logger.fork(CID, 3, "fork-big")

    assert str(refused.value).endswith("fork at seq 0 or before")
    assert [m.content for m in (await logger.fork(CID, 0, "fork-big")).messages] == ["look them up"]


async def test_a_fork_stopped_at_its_limit_never_names_a_call_whose_results_lie_past_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork stops reading at the message that takes it past `MAX_FORK_BYTES`: a call whose
    results lie past that message (known by their outlines, never read whole) is not named,
    for a fork there copies them; the message before the call is."""
    from agent_store.store import _fork_read

    monkeypatch.setattr(_fork_read, "MAX_FORK_BYTES", 50_000)
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, calls_answered_past(3, "y" * 30_000), turn_id="t0")

    with pytest.raises(InvalidInput) as refused:
        await logger.fork(CID, 5, "fork-big")

    assert str(refused.value) == (
        "a fork copies at most 50,000 bytes of messages as stored; at_seq 5 would copy more: "
        "fork at seq 0 or before"
    )
    assert [m.content for m in (await logger.fork(CID, 0, "fork-big")).messages] == ["look them up"]


async def test_a_fork_refused_where_no_fork_fits_says_so(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a fork at the first message is too large already, the refusal names no seq."""
    from agent_store.store import _logger

    monkeypatch.setattr(_logger, "MAX_FORK_WHOLE_TEXT_CHARS", 50_000)
    logger = AgentMessageLogger(backend.db, rules=TurnRules(max_message_bytes=16 * 1024))
    said = [{"role": "user", "content": "x" * 60_000}, {"role": "assistant", "content": "ok"}]
    await logger.log_messages(CID, said, turn_id="t0")

    with pytest.raises(InvalidInput) as refused:
        await logger.fork(CID, 1, "fork-big")

    assert str(refused.value) == (
        "a fork copies at most 50000 characters of whole texts of cut messages; at_seq 1 "
        "would copy more, and so would a fork at any seq of this conversation"
    )
    assert await backend.db[CONVERSATIONS].find_one({"_id": "fork-big"}) is None


async def test_only_the_owner_may_fork_and_the_fork_is_theirs(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, weather_turn("Paris"), turn_id="t0", user_id="user-ada")

    with pytest.raises(NotFound):
        await logger.fork(CID, 3, "conv-stolen", user_id="user-mallory", owner_only=True)
    forked = await logger.fork(CID, 3, "conv-mine", user_id="user-ada", owner_only=True)

    assert {m.user_id for m in forked.messages} == {"user-ada"}
    assert await backend.db[CONVERSATIONS].count_documents({"_id": "conv-stolen"}) == 0


def test_a_stream_marks_where_the_model_was_fed_a_steered_message() -> None:
    turn = turn_from_sse(
        [
            {"type": "text_delta", "delta": "Looking up Paris…"},
            {"type": "delivered", "seq": 5},
            {"type": "text_delta", "delta": "In metric, then: 18 °C."},
            {"type": "done"},
        ]
    )

    assert [m.content for m in turn.messages] == ["Looking up Paris…", "In metric, then: 18 °C."]
    assert turn.delivered_seqs == (5,)


async def test_a_delivery_id_names_a_delivery_within_its_turns_inbox_only(
    backend: Backend,
) -> None:
    """A sender numbering its deliveries per running turn sends "stop" as "d1" into run-1,
    then as "d1" again into run-2: that is another delivery, which run-2 receives (never
    acknowledged unseen because run-1 got one under that id); a retry into run-2 is stored
    once."""
    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    stop = {"role": "user", "content": "stop"}
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], turn_id="p1")
    await inbox.open_turn(CID, "run-1")
    assert await inbox.try_deliver(CID, "run-1", stop, delivery_id="d1") is True
    seen = await inbox.drain(CID, "run-1")
    assert await inbox.close_inbox(CID, "run-1", seen[-1].seq or 0) == []
    await logger.log_messages(CID, [{"role": "user", "content": "go on"}], turn_id="p2")
    await inbox.open_turn(CID, "run-2")

    assert await inbox.try_deliver(CID, "run-2", stop, delivery_id="d1") is True
    assert await inbox.try_deliver(CID, "run-2", stop, delivery_id="d1") is True
    drained = await inbox.drain(CID, "run-2")

    assert [m.content for m in drained] == ["stop"]
    assert await inbox.close_inbox(CID, "run-2", drained[-1].seq or 0) == []
    assert await backend.db[MESSAGES].count_documents({"content": "stop"}) == 2


async def test_a_delivery_stored_under_its_bare_delivery_id_is_recognised_when_retried(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deliveries stored before delivery ids were scoped to their inbox are named by the id
    alone: retried into the same open inbox, each is acknowledged, stored once; once the
    inbox is closed, refused like any delivery (a turn record cannot tell it from a turn
    logged under the same id), and stored nothing more."""
    from agent_store.store import _inbox

    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "start"}], turn_id="t0")
    await inbox.open_turn(CID, TURN)
    message = {"role": "user", "content": "wait"}
    monkeypatch.setattr(_inbox, "delivery_turn_id", lambda turn_id, delivery: delivery)
    assert await inbox.try_deliver(CID, TURN, message, delivery_id="d1")
    monkeypatch.undo()

    assert await inbox.try_deliver(CID, TURN, message, delivery_id="d1")
    late = await inbox.close_inbox(CID, TURN, 0)
    assert [(m.content, m.turn_id) for m in late] == [("wait", "d1")]
    assert await inbox.close_inbox(CID, TURN, late[-1].seq or 0) == []
    assert not await inbox.try_deliver(CID, TURN, message, delivery_id="d1")
    assert await backend.db[MESSAGES].count_documents({"content": "wait"}) == 1


async def test_a_delivery_named_like_a_turn_logged_after_its_inbox_closed_is_refused(
    backend: Backend,
) -> None:
    """A sender naming its delivery after the running turn (`delivery_id` = the turn id),
    late: the inbox is closed and the turn logged under that id. Refused, nothing stored;
    never a Conflict with the turn, nor an acknowledgement."""
    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], user_id="u", turn_id="t0")
    await inbox.open_turn(CID, "run-1")
    assert await inbox.close_inbox(CID, "run-1", last_seen_seq=0) == []
    await logger.log_messages(
        CID, [{"role": "assistant", "content": "done"}], user_id="u", turn_id="run-1"
    )

    late = {"role": "user", "content": "stop"}
    assert await inbox.try_deliver(CID, "run-1", late, delivery_id="run-1") is False
    done = {"role": "assistant", "content": "done"}
    assert await inbox.try_deliver(CID, "run-1", done, delivery_id="run-1") is False
    assert await backend.db[MESSAGES].count_documents({"content": "stop"}) == 0
    assert await backend.db[MESSAGES].count_documents({"content": "done"}) == 1


HOTEL = {"role": "user", "content": "also book the hotel", "created_at": "2026-12-03T08:00:00Z"}


async def test_an_ordinary_turn_cannot_take_the_turn_id_a_delivery_derives(
    backend: Backend,
) -> None:
    """Anyone can compute the turn id a delivery is stored under (`delivery_turn_id`). A person
    logging a turn under it first, holding the message the delivery will carry, made the
    delivery a replay of that turn: acknowledged, never in the runtime's inbox. Such a turn
    is refused, nothing written, and the delivery then reaches the runtime."""
    from agent_store.store._inbox import delivery_turn_id

    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], user_id="u", turn_id="t0")
    await inbox.open_turn(CID, "run-1")
    taken = delivery_turn_id("run-1", "d1")

    for owner_only in (True, False):
        with pytest.raises(InvalidInput, match="names a steering delivery"):
            await logger.log_messages(
                CID, [HOTEL], user_id="u", turn_id=taken, owner_only=owner_only
            )
    assert await backend.db[MESSAGES].count_documents({"content": HOTEL["content"]}) == 0

    assert await inbox.try_deliver(CID, "run-1", HOTEL, delivery_id="d1") is True
    drained = await inbox.drain(CID, "run-1")
    assert [(m.content, m.turn_id) for m in drained] == [(HOTEL["content"], taken)]
    assert await inbox.close_inbox(CID, "run-1", drained[-1].seq or 0) == []


async def test_a_delivery_its_open_inbox_does_not_list_is_never_acknowledged(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn logged under a delivery's turn id before such turns were refused (the same
    message, so the delivery replays it) is not that delivery: the open inbox does not list
    it. The delivery answers False, nothing more stored, and the runtime closes knowing it
    missed nothing; a delivery it does list still answers True when retried."""
    from agent_store.store import _logger
    from agent_store.store._inbox import delivery_turn_id

    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], user_id="u", turn_id="t0")
    await inbox.open_turn(CID, "run-1")
    monkeypatch.setattr(_logger, "_refuse_delivery_turn_id", lambda turn_id: None, raising=False)
    taken = delivery_turn_id("run-1", "d1")
    await logger.log_messages(CID, [HOTEL], user_id="u", turn_id=taken, owner_only=True)
    monkeypatch.undo()

    assert await inbox.try_deliver(CID, "run-1", HOTEL, delivery_id="d1") is False
    assert await inbox.drain(CID, "run-1") == []
    assert await inbox.try_deliver(CID, "run-1", HOTEL, delivery_id="d2") is True
    assert await inbox.try_deliver(CID, "run-1", HOTEL, delivery_id="d2") is True
    drained = await inbox.drain(CID, "run-1")
    assert [m.turn_id for m in drained] == [delivery_turn_id("run-1", "d2")]
    assert await inbox.close_inbox(CID, "run-1", drained[-1].seq or 0) == []
    assert await backend.db[MESSAGES].count_documents({"content": HOTEL["content"]}) == 2


async def test_while_a_turns_inbox_is_open_only_its_runtime_logs_a_turn_under_its_id(
    backend: Backend,
) -> None:
    """The person steers by the running turn's id, so knows it. Logged under it first by the
    person's token (`owner_only`), a forged answer took the id, and the runtime's own turn was
    a Conflict, its answer lost. While the inbox is open the turn id is its runtime's: the
    person's turn is a Conflict saying so, nothing written; the runtime logs it (a service),
    and retries it, while the inbox is open and after it closed; the person logs turns of
    other ids meanwhile."""
    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], user_id="u", turn_id="t0")
    await inbox.open_turn(CID, "run-1")
    forged = [{"role": "assistant", "content": "FORGED answer"}]

    with pytest.raises(Conflict, match="running"):
        await logger.log_messages(CID, forged, user_id="u", turn_id="run-1", owner_only=True)
    assert await backend.db[MESSAGES].count_documents({"content": "FORGED answer"}) == 0
    aside = [{"role": "user", "content": "an aside"}]
    assert await logger.log_messages(CID, aside, user_id="u", turn_id="t-aside", owner_only=True)

    answer = [{"role": "assistant", "content": "the real answer"}]
    first = await logger.log_messages(CID, answer, user_id="u", turn_id="run-1")
    again = await logger.log_messages(CID, answer, user_id="u", turn_id="run-1")
    assert (first.replayed, again.replayed) == (False, True)
    assert await inbox.close_inbox(CID, "run-1", 99) == []
    after = await logger.log_messages(CID, answer, user_id="u", turn_id="run-1")
    assert after.replayed
    with pytest.raises(Conflict, match="other content"):
        await logger.log_messages(CID, forged, user_id="u", turn_id="run-1", owner_only=True)
    assert await backend.db[MESSAGES].count_documents({"content": "the real answer"}) == 1


async def test_a_turn_a_runtime_opened_an_inbox_for_stays_its_runtimes_once_the_inbox_closed(
    backend: Backend,
) -> None:
    """The runtime closes its inbox, then logs its answer (STREAMING.md's loop): a person's
    token logging under the turn id in between would take it as surely. The turn stays the
    runtime's: the person's turn is a Conflict, nothing written, and the runtime's turn is
    logged, then retried. The conversation remembers the newest `RUNTIME_TURNS_KEPT` such
    turns, so a person's token takes an id only when it was forgotten long since."""
    from agent_store.store._turns import RUNTIME_TURNS_KEPT

    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], user_id="u", turn_id="t0")
    await inbox.open_turn(CID, "run-1")
    await inbox.open_turn(CID, "run-1")  # opened again: remembered once
    assert await inbox.close_inbox(CID, "run-1", 0) == []
    forged = [{"role": "assistant", "content": "FORGED answer"}]

    with pytest.raises(Conflict, match="a runtime's"):
        await logger.log_messages(CID, forged, user_id="u", turn_id="run-1", owner_only=True)
    answer = [{"role": "assistant", "content": "the real answer"}]
    first = await logger.log_messages(CID, answer, user_id="u", turn_id="run-1")
    again = await logger.log_messages(CID, answer, user_id="u", turn_id="run-1")
    assert (first.replayed, again.replayed) == (False, True)
    assert await backend.db[MESSAGES].count_documents({"content": "FORGED answer"}) == 0

    for n in range(RUNTIME_TURNS_KEPT):
        await inbox.open_turn(CID, f"run-x{n}")
        assert await inbox.close_inbox(CID, f"run-x{n}", 0) == []
    doc = await backend.db[CONVERSATIONS].find_one({"_id": CID}, {"runtime_turns": 1})
    assert len(doc["runtime_turns"]) == RUNTIME_TURNS_KEPT
    with pytest.raises(Conflict, match="a runtime's"):
        await logger.log_messages(CID, forged, user_id="u", turn_id="run-x0", owner_only=True)
    await inbox.open_turn(CID, "run-x100")  # run-x0 is forgotten: a person's turn may take it
    assert await logger.log_messages(CID, forged, user_id="u", turn_id="run-x0", owner_only=True)


async def test_a_turn_id_a_person_logged_a_turn_under_opens_no_runtimes_inbox(
    backend: Backend,
) -> None:
    """A person who guesses the running turn's id logs a turn under it before the runtime opens
    its inbox: the inbox opened on the person's turn, and the runtime's own answer under the id
    was a Conflict, the forged turn staying. Opening an inbox for a turn id that holds a turn a
    user token logged is a Conflict saying so, nothing changed: the runtime runs its turn under
    a new id. A turn a service logged under the id (the runtime's own) opens it, and an open
    retried opens it again."""
    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], user_id="u", turn_id="t0")
    forged = [{"role": "assistant", "content": "FORGED: trip booked"}]
    await logger.log_messages(CID, forged, user_id="u", turn_id="t7", owner_only=True)
    before = await backend.db[CONVERSATIONS].find_one({"_id": CID})

    with pytest.raises(Conflict, match="a person's turn"):
        await inbox.open_turn(CID, "t7")
    assert await backend.db[CONVERSATIONS].find_one({"_id": CID}) == before
    assert await inbox.try_deliver(CID, "t7", {"role": "user", "content": "x"}) is False

    answer = [{"role": "assistant", "content": "Here is your plan."}]
    await logger.log_messages(CID, answer, user_id="u", turn_id="t8-own")
    for turn_id in ("t8", "t8", "t8-own"):  # a new id, retried; one the runtime logged
        await inbox.open_turn(CID, turn_id)
    assert await inbox.close_inbox(CID, "t8", -1) == []
    assert (await logger.log_messages(CID, answer, user_id="u", turn_id="t8")).replayed is False


@pytest.mark.parametrize(
    "turn_id", ["legacy-conv-1-0", f"delivery-{'0' * 32}", f"delivery-{'ab' * 16}"]
)
async def test_an_inbox_opens_under_no_turn_id_a_turn_cannot_be_logged_under(
    backend: Backend, turn_id: str
) -> None:
    """Migrated legacy turns' ids (`legacy-…`) and deliveries' (`delivery-` and 32 lowercase
    hex digits) are refused to a turn (422): an inbox opened under one ran a turn its runtime
    could never log. Refused alike, nothing changed."""
    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], user_id="u", turn_id="t0")
    before = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    with pytest.raises(InvalidInput, match="takes another id"):
        await inbox.open_turn(CID, turn_id)
    assert await backend.db[CONVERSATIONS].find_one({"_id": CID}) == before
    with pytest.raises(InvalidInput, match="takes another id"):
        await logger.log_messages(CID, [{"role": "user", "content": "x"}], turn_id=turn_id)


async def test_a_delivery_like_turn_id_in_uppercase_hex_is_an_ordinary_turn_id(
    backend: Backend,
) -> None:
    """A delivery's turn id is `delivery-` and 32 lowercase hex digits, and turn ids are
    compared as written: the same form in uppercase is no delivery's id, so it is no delivery's
    to take. It is logged as any turn, and the delivery whose id it spells reaches the
    runtime."""
    from agent_store.store._inbox import delivery_turn_id

    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], user_id="u", turn_id="t0")
    await inbox.open_turn(CID, "run-1")
    taken = delivery_turn_id("run-1", "d1")
    upper = "delivery-" + taken.removeprefix("delivery-").upper()
    await logger.log_messages(CID, [HOTEL], user_id="u", turn_id=upper, owner_only=True)
    assert await inbox.try_deliver(CID, "run-1", HOTEL, delivery_id="d1") is True
    assert [m.turn_id for m in await inbox.drain(CID, "run-1")] == [taken]


@pytest.mark.parametrize(
    "kind",
    ["NotStoredYet", "Corrected", "OtherContent", "AnsweredBefore", "TurnConflict", "HeldOff",
     "BeingDeleted", "Unreserved", "UnfinishedFork", "AnyOther"],
)  # fmt: skip
def test_every_refusal_of_a_deliverys_turn_is_worded_for_the_delivery_with_its_status(
    kind: str,
) -> None:
    """Whatever the logger refuses a delivery's turn with names the turn id the delivery is
    stored under; the sender reads the delivery id, the running turn and what to do, with the
    same class (so the same status)."""
    from datetime import timedelta

    from agent_store.core import AnsweredBefore
    from agent_store.store import _inbox, _logger, _turns

    stored_as = "delivery-0123456789abcdef0123456789abcdef"
    internal = f"turn {stored_as!r}: use a new turn_id"
    classes: dict[str, type[StoreError]] = {
        "NotStoredYet": _logger.NotStoredYet,
        "Corrected": _logger.Corrected,
        "OtherContent": _logger.OtherContent,
        "TurnConflict": _turns.TurnConflict,
    }
    from agent_store.store._reservation import BeingDeleted, unfinished_fork

    made: dict[str, StoreError] = {
        "AnsweredBefore": AnsweredBefore(internal, tool_call_ids=["call_1"]),
        "HeldOff": _logger.HeldOff(internal, conversation_id=CID, held=("c0", "r1")),
        "BeingDeleted": BeingDeleted(internal, conversation_id=CID),
        "Unreserved": _logger.Unreserved(internal),
        "UnfinishedFork": unfinished_fork(CID, f"turn {stored_as!r}"),
        "AnyOther": StorageUnavailable(
            f"could not move turn {stored_as!r} past what readers passed"
        ),
    }
    error = made[kind] if kind in made else classes[kind](internal)
    named = "delivery 'd1' into the inbox of turn 'turn-running'"

    worded = _inbox.delivery_refusal(error, named, timedelta(minutes=5), stored_as)

    assert type(worded) is type(error)
    assert (worded.status, worded.code) == (error.status, error.code)
    assert named in worded.message
    assert "delivery-" not in worded.message
    assert "turn_id" not in worded.message
    worded_as_named = ("NotStoredYet", "BeingDeleted", "UnfinishedFork", "AnyOther")
    assert "delivery_id" in worded.message or kind in worded_as_named


@pytest.mark.parametrize(
    "error",
    [NotFound(f"conversation {CID!r} was not found"),
     Conflict(f"conversation {CID!r} belongs to another user than 'u'; use claim to move it"),
     StorageUnavailable("could not reserve the turn: the database is unreachable")],
    ids=["not-found", "another-owner", "unreachable"],
)  # fmt: skip
def test_a_refusal_of_a_delivery_naming_no_turn_reaches_its_sender_as_it_is(
    error: StoreError,
) -> None:
    """A refusal naming the conversation only (missing, another user's) or the database is
    what the sender reads: `delivery_refusal` words only those naming the turn."""
    from datetime import timedelta

    from agent_store.store import _inbox

    named = "delivery 'd1' into the inbox of turn 'turn-running'"
    stored_as = "delivery-0123456789abcdef0123456789abcdef"
    assert _inbox.delivery_refusal(error, named, timedelta(minutes=5), stored_as) is error


# -- a delivery is a turn: every rule a turn meets, its refusals worded for its sender -----


def _calls(*ids: str) -> dict[str, Any]:
    tool_calls = [{"id": i, "function": {"name": "pay", "arguments": "{}"}} for i in ids]
    return {"role": "assistant", "tool_calls": tool_calls}


def _asks_about(request_id: str, *call_ids: str) -> dict[str, Any]:
    hitl = {"action": "confirm", "params": {}, "request_id": request_id,
            "tool_call_ids": list(call_ids)}  # fmt: skip
    return {"role": "assistant", "content": "Sure?", "hitl_action": hitl}


DENIAL = {"role": "tool", "tool_call_id": "pay1", "content": "tool call denied",
          "error": {"message": "tool call denied"}}  # fmt: skip
INTO_RUN_1 = "delivery 'd1' into the inbox of turn 'run-1'"


async def test_a_delivery_denying_a_call_a_person_approved_first_is_refused_as_a_turn_is(
    backend: Backend,
) -> None:
    """A person approved the confirmation holding `pay1`; a turn denying it is refused
    (`AnsweredBefore`: the tool runs, its result answers the call), and so is a delivery
    carrying that denial: nothing stored, the refusal naming the delivery and its inbox."""
    from agent_store.core import AnsweredBefore

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    inbox = SteeringInbox(logger)
    first = [{"role": "user", "content": "pay"}, _calls("pay1"), _asks_about("r1", "pay1")]
    await logger.log_messages(CID, first, turn_id="t0")
    await store.resolve_hitl(CID, "r1")
    await inbox.open_turn(CID, "run-1")
    before = await store.transcript(CID)

    with pytest.raises(AnsweredBefore) as refused:
        await inbox.try_deliver(CID, "run-1", DENIAL, delivery_id="d1")

    said = refused.value.message
    assert f"{INTO_RUN_1} denies a tool call whose confirmation a person approved first" in said
    assert "delivery-" not in said
    assert list(refused.value.tool_call_ids) == ["pay1"]
    assert await store.transcript(CID) == before
    assert await inbox.close_inbox(CID, "run-1", last_seen_seq=len(before) - 1) == []


async def test_a_delivery_pushing_a_held_call_off_the_pending_list_is_refused_as_a_turn_is(
    backend: Backend,
) -> None:
    """`c0`, held by the prompt `r1` nobody answered, is the oldest of the calls
    `pending_calls` keeps; a delivery making one more call would push it off, where r1's
    approval would not reach it: refused as such a turn is, nothing stored, naming the
    delivery, the prompt and the call. Once r1 is answered, it is delivered."""
    from agent_store.store import PENDING_CALLS_KEPT

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    inbox = SteeringInbox(logger)
    others = [f"c{n}" for n in range(1, PENDING_CALLS_KEPT)]
    go = {"role": "user", "content": "go"}
    await logger.log_messages(CID, [go, _calls("c0"), _asks_about("r1", "c0")], turn_id="t0")
    await logger.log_messages(CID, [_calls(*others)], turn_id="t1")
    await inbox.open_turn(CID, "run-1")
    before = await store.transcript(CID)

    with pytest.raises(Conflict) as refused:
        await inbox.try_deliver(CID, "run-1", _calls("c100"), delivery_id="d1")

    said = refused.value.message
    assert f"{INTO_RUN_1} would push the call 'c0' the prompt 'r1' holds" in said
    assert "delivery_id" in said
    assert "delivery-" not in said
    assert await store.transcript(CID) == before
    assert ("c0", "r1") in [(c.tool_call_id, c.request_id) for c in await store.pending_calls(CID)]

    await store.resolve_hitl(CID, "r1")
    assert await inbox.try_deliver(CID, "run-1", _calls("c100"), delivery_id="d1") is True


async def test_a_delivery_into_a_conversation_being_deleted_is_refused_naming_the_delivery(
    backend: Backend,
) -> None:
    """A delete of the conversation has begun (or failed part-way): a delivery is refused as
    a turn is (StorageUnavailable, nothing stored), naming the delivery and its inbox, never
    the turn id it is stored under, which no sender may send."""
    from agent_store.store._reservation import DELETING

    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "hello"}], turn_id="t0")
    await inbox.open_turn(CID, "run-1")
    marked = {"$set": {DELETING: datetime.now(UTC)}}
    await backend.db[CONVERSATIONS].update_one({"_id": CID}, marked)

    with pytest.raises(StorageUnavailable) as refused:
        await inbox.try_deliver(CID, "run-1", {"role": "user", "content": "steer"},
                                delivery_id="d1")  # fmt: skip

    said = refused.value.message
    assert f"{INTO_RUN_1} may be sent again once the delete finished" in said
    assert f"conversation {CID!r} is being deleted" in said
    assert "delivery-" not in said
    assert await backend.db[MESSAGES].count_documents({"content": "steer"}) == 0


async def test_a_delivery_into_a_fork_not_made_yet_is_refused_naming_the_delivery(
    backend: Backend,
) -> None:
    """Until a fork is made (its `fork_check` still there), a delivery into it is refused as a
    turn is (StorageUnavailable, nothing stored), naming the delivery and its inbox, never the
    turn id it is stored under."""
    from agent_store.store._reservation import FORK_CHECK

    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "hello"}], turn_id="t0")
    await inbox.open_turn(CID, "run-1")
    unmade = {"$set": {FORK_CHECK: {"epoch": "0123456789abcdef", "created_at": None}}}
    await backend.db[CONVERSATIONS].update_one({"_id": CID}, unmade)

    with pytest.raises(StorageUnavailable) as refused:
        await inbox.try_deliver(CID, "run-1", {"role": "user", "content": "steer"},
                                delivery_id="d1")  # fmt: skip

    said = refused.value.message
    assert f"{INTO_RUN_1} may be sent again once the fork is made" in said
    assert "delivery-" not in said
    assert await backend.db[MESSAGES].count_documents({"content": "steer"}) == 0


@pytest.mark.parametrize(
    ("mark", "said"),
    [("deleting", "is being deleted"), ("fork_check", "is a fork not made yet")],
)
async def test_closing_an_inbox_of_a_conversation_being_deleted_or_unmade_is_retried_later(
    backend: Backend, mark: str, said: str
) -> None:
    """A close is a write into the conversation: one a delete marked (it failed part-way) or
    a fork not made yet refuses it as it refuses a delivery (StorageUnavailable: close again
    later), not as a conversation that is not there, and leaves the inbox as it was. Another
    user asking is told nothing of it (NotFound)."""
    from agent_store.store._reservation import DELETING, FORK_CHECK

    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "hello"}],
                              turn_id="t0", user_id="user-owner")  # fmt: skip
    await inbox.open_turn(CID, "run-1")
    value = {DELETING: datetime.now(UTC), FORK_CHECK: {"epoch": "0" * 16, "created_at": None}}
    field = {"deleting": DELETING, "fork_check": FORK_CHECK}[mark]
    await backend.db[CONVERSATIONS].update_one({"_id": CID}, {"$set": {field: value[field]}})

    with pytest.raises(StorageUnavailable) as refused:
        await inbox.close_inbox(CID, "run-1", last_seen_seq=0)
    assert f"conversation {CID!r} {said}" in refused.value.message
    with pytest.raises(NotFound):
        await inbox.close_inbox(CID, "run-1", last_seen_seq=0, user_id="user-other")
    stored = await backend.db[CONVERSATIONS].find_one({"_id": CID})
    assert stored is not None
    assert stored.get("inbox"), "the inbox stays open"


@pytest.mark.parametrize(
    ("field", "value"), [("user_id", "user-ada"), ("turn_id", "zzz"), ("turn_id", "run-1")]
)
async def test_a_delivery_whose_message_names_another_user_or_turn_is_refused_as_a_turns_is(
    backend: Backend, field: str, value: str
) -> None:
    """A delivery is a turn: its message passes the check a turn's does
    (`_refuse_other_owners`). A `user_id` other than the user it is delivered for, or a
    `turn_id` other than the one the delivery is stored under (the running turn's included:
    the message is not stored under it), is InvalidInput naming the delivery, never its
    internal turn id, nothing stored (was: accepted and replaced without a word). The values
    the store sets pass: a delivered message read back and delivered again is its retry."""
    logger = AgentMessageLogger(backend.db)
    inbox = SteeringInbox(logger)
    await logger.log_messages(CID, [{"role": "user", "content": "go"}], user_id="user-grace",
                              turn_id="t0")  # fmt: skip
    await inbox.open_turn(CID, "run-1")
    said = {"role": "user", "content": "steer", field: value}

    with pytest.raises(InvalidInput, match=f"message 0 carries `{field}` {value!r}") as refused:
        await inbox.try_deliver(CID, "run-1", said, delivery_id="d1", user_id="user-grace",
                                owner_only=True)  # fmt: skip

    assert "delivery-" not in refused.value.message
    if field == "turn_id":
        assert INTO_RUN_1 in refused.value.message
    assert await backend.db[MESSAGES].count_documents({"content": "steer"}) == 0
    fresh = {"role": "user", "content": "steer"}
    assert await inbox.try_deliver(CID, "run-1", fresh, delivery_id="d1", user_id="user-grace",
                                   owner_only=True)  # fmt: skip
    read_back = (await inbox.drain(CID, "run-1"))[0].model_dump(exclude={"id", "seq"})
    assert await inbox.try_deliver(CID, "run-1", read_back, delivery_id="d1",
                                   user_id="user-grace", owner_only=True)  # fmt: skip
    assert await backend.db[MESSAGES].count_documents({"content": "steer"}) == 1


async def test_steering_a_conversation_only_legacy_turns_hold_is_refused_as_every_write_to_it(
    backend: Backend,
) -> None:
    """Legacy turns not migrated yet are read-only: opening an inbox, delivering into one and
    closing one are refused as a turn is (Conflict, "not migrated yet"), for a service and the
    owner; another user is told NotFound, as a missing conversation. Reading the inbox is a
    read, served as the conversation is: no inbox is open in it. Nothing written."""
    from agent_store.legacy import LEGACY_TURNS, LegacyTurns

    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": "lt-1", "conversation_id": CID, "user_id": "user-grace",
         "user_message": "q", "response_parts": [{"type": "text", "content": "a"}]}
    )  # fmt: skip
    inbox = SteeringInbox(AgentMessageLogger(backend.db, legacy=LegacyTurns(backend.db)))
    steer = {"role": "user", "content": "steer"}
    grace = {"user_id": "user-grace", "owner_only": True}

    for write in (
        partial(inbox.open_turn, CID, "run-1"),
        partial(inbox.try_deliver, CID, "run-1", steer, delivery_id="d1"),
        partial(inbox.try_deliver, CID, "run-1", steer, delivery_id="d1", **grace),
        partial(inbox.close_inbox, CID, "run-1", -1),
    ):
        with pytest.raises(Conflict, match="exists as legacy turns not migrated yet"):
            await write()
    with pytest.raises(NotFound):
        await inbox.try_deliver(CID, "run-1", steer, user_id="user-ada", owner_only=True)
    with pytest.raises(NotFound):
        await inbox.drain(CID, "run-1", user_id="user-ada")
    assert await inbox.drain(CID, "run-1") == []
    assert await inbox.drain(CID, "run-1", user_id="user-grace") == []
    assert await backend.db[CONVERSATIONS].count_documents({}) == 0
    assert await backend.db[MESSAGES].count_documents({}) == 0
