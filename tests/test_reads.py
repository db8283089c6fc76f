"""The read paths and admin operations, on every backend."""

from __future__ import annotations

import asyncio
import re
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from pymongo.errors import AutoReconnect, BulkWriteError

import agent_store
from agent_store import (
    AgentMessageLogger,
    Conflict,
    ConversationStore,
    InvalidInput,
    NotFound,
    SteeringInbox,
    StorageUnavailable,
    TurnRules,
    Unsupported,
    VersionMismatch,
)
from agent_store.core import AgentMessage, calls_answered, messages_adapter
from agent_store.store import (
    BLOB_CHUNKS,
    BLOB_FILES,
    CONVERSATIONS,
    DELETIONS,
    LANGGRAPH_CHECKPOINTS,
    MESSAGES,
    TEXT_INDEX,
    ThreadLife,
)
from app.examples import EXAMPLE_CONVERSATION_ID as CID
from app.examples import EXAMPLE_USER_ID as OWNER
from app.examples import example_turns
from tests.api_harness import auth_headers, serve
from tests.conftest import Backend, count_documents_read


@pytest.fixture
async def store(backend: Backend) -> ConversationStore:
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    for turn_id, messages in example_turns():
        await logger.log_messages(CID, messages, user_id=OWNER, turn_id=turn_id)
    return ConversationStore(backend.db)


async def make_conversations(backend: Backend, user_id: str, count: int) -> list[str]:
    logger = AgentMessageLogger(backend.db)
    ids = [f"{user_id}-c{n:02d}" for n in range(count)]
    for n, conversation_id in enumerate(ids):
        await logger.log_messages(
            conversation_id,
            [{"role": "user", "content": f"hello {n}", "created_at": f"2026-01-01T00:{n:02d}:00Z"}],
            user_id=user_id,
        )
    return ids


async def test_conversations_are_listed_newest_first_across_pages(backend: Backend) -> None:
    ids = await make_conversations(backend, "lister", 7)
    await make_conversations(backend, "other", 2)
    store = ConversationStore(backend.db)

    seen, cursor, pages = [], None, 0
    while True:
        page = await store.list_conversations("lister", limit=3, cursor=cursor)
        seen += [c.id for c in page.data]
        pages += 1
        if not page.has_more:
            assert page.next_cursor is None
            break
        cursor = page.next_cursor

    assert seen == list(reversed(ids))
    assert pages == 3


async def test_conversations_with_equal_update_times_are_paged_without_gaps(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db)
    for n in range(5):
        await logger.log_messages(
            f"tie-{n}",
            [{"role": "user", "content": "same time", "created_at": "2026-01-01T00:00:00Z"}],
            user_id="tied",
        )
    store = ConversationStore(backend.db)
    first = await store.list_conversations("tied", limit=2)
    second = await store.list_conversations("tied", limit=2, cursor=first.next_cursor)
    third = await store.list_conversations("tied", limit=2, cursor=second.next_cursor)
    ids = [c.id for page in (first, second, third) for c in page.data]
    assert ids == ["tie-4", "tie-3", "tie-2", "tie-1", "tie-0"]


async def _listed_page_by_page(read: Callable[..., Awaitable[Any]]) -> list[str]:
    """The ids of every conversation `read` lists, two to a page, reading on to the end."""
    seen: list[str] = []
    cursor = None
    while True:
        page = await read(limit=2, cursor=cursor)
        seen += [c.id for c in page.data]
        if not page.has_more:
            return seen
        cursor = page.next_cursor


@pytest.mark.parametrize(
    "when",
    [
        "2026-03-01T14:00:00.123Z",
        # times whose float `timestamp() * 1000` falls just below the whole millisecond
        "2004-02-29T16:00:25.919Z",
        "1987-04-02T13:35:29.943Z",
        "1978-09-10T07:30:21.965Z",
    ],
)
async def test_conversations_updated_in_the_same_millisecond_are_each_listed_once_at_any_time(
    backend: Backend, when: str
) -> None:
    logger = AgentMessageLogger(backend.db)
    ids = [f"same-ms-{n}" for n in range(5)]
    for conversation_id in ids:
        await logger.log_messages(
            conversation_id,
            [{"role": "user", "content": "imported", "created_at": when}],
            user_id="tied",
        )
    store = ConversationStore(backend.db)
    listed = await _listed_page_by_page(partial(store.list_conversations, "tied"))
    recent = await _listed_page_by_page(store.recent_conversations)
    assert listed == recent == list(reversed(ids))


def calling(tool: str, *call_ids: str) -> dict[str, Any]:
    calls = [
        {"id": call_id, "type": "function", "function": {"name": tool, "arguments": "{}"}}
        for call_id in call_ids
    ]
    return {"role": "assistant", "content": None, "tool_calls": calls}


async def test_the_calls_before_a_seq_are_the_latest_messages_making_each_id(
    backend: Backend,
) -> None:
    """`calls_before`: for each call id, the latest message below the seq making it (a call
    id reused every turn, one made long before, past a batch of others), by seq; none for
    an id no message makes, and none of another conversation or outside the user's scope."""
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages("c-calls", [calling("lookup", "call_far")], user_id="u-calls")
    for n in range(30):  # more than a read's first batch of messages making call_0
        await logger.log_messages("c-calls", [calling(f"tool_{n}", "call_0")], user_id="u-calls")
    await logger.log_messages("c-calls", [calling("late", "call_0")], user_id="u-calls")
    await logger.log_messages("c-other", [calling("elsewhere", "call_1")], user_id="u-calls")
    store = ConversationStore(backend.db)

    found = await store.calls_before(
        "c-calls", ["call_0", "call_far", "call_1", "call_none"], before_seq=31
    )
    scoped = await store.calls_before("c-calls", ["call_0"], before_seq=31, user_id="u-else")

    assert [(m.seq, m.tool_calls[0].function.name) for m in found] == [
        (0, "lookup"),
        (30, "tool_29"),
    ]
    assert scoped == []
    assert await store.calls_before("c-calls", [], before_seq=31) == []
    with pytest.raises(InvalidInput, match="before_seq"):
        await store.calls_before("c-calls", ["call_0"], before_seq=-1)


async def test_the_calls_before_a_seq_pair_a_pages_results_as_the_whole_transcript_does(
    backend: Backend,
) -> None:
    """A result answers the latest earlier call of its id without an answer (`calls_answered`):
    `calls_before` gives the messages making and answering each id down to the call a page's
    results take, an id given n times (n results) down to the n-th call still open, so the
    pairing over them and the page is the pairing over the whole transcript."""
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages("c-reused", [calling("book_flight", "call_0")], user_id="u")  # 0
    await logger.log_messages("c-reused", [calling("pay", "call_0")], user_id="u")  # 1
    await logger.log_messages(
        "c-reused",
        [calling("search_hotels", "call_0"), {"role": "tool", "tool_call_id": "call_0",
                                              "content": "3 hotels"}],  # 2, 3
        user_id="u",
    )  # fmt: skip
    store = ConversationStore(backend.db)
    late = [{"role": "tool", "tool_call_id": "call_0", "content": "done"}] * 2
    page = messages_adapter.validate_python(
        [{**m, "seq": 4 + n, "conversation_id": "c-reused"} for n, m in enumerate(late)]
    )

    once = await store.calls_before("c-reused", ["call_0"], before_seq=4)
    twice = await store.calls_before("c-reused", ["call_0", "call_0"], before_seq=4)

    def answered(before: list[AgentMessage], results: int) -> list[str]:
        whole = [*before, *page[:results]]
        pairs = calls_answered(whole)
        return [
            (whole[pairs[n][0]].tool_calls or [])[0].function.name
            for n in range(len(before), len(whole))
        ]

    assert [m.seq for m in once] == [1, 2, 3]
    assert answered(once, 1) == ["pay"]
    assert [m.seq for m in twice] == [0, 1, 2, 3]
    assert answered(twice, 2) == ["pay", "book_flight"]


BULKY = "x" * 4_000  # a small page budget (monkeypatched) holds a few of these


BULKY_PARAMS = {"in a value": {"blob": BULKY}, "in a key": {BULKY: "blob"}}
"""The same bytes, where a page's size estimate must count them either way."""


@pytest.mark.parametrize("bulk", BULKY_PARAMS)
async def test_a_conversation_page_stops_at_its_byte_budget_and_pages_on(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, bulk: str
) -> None:
    """A page holds what fits in `PAGE_BYTES` (at least one conversation), the text of keys
    counted as that of values; `next_cursor` reads on, and every conversation is listed
    once, in order."""
    # two of these conversations (about 5,000 bytes each), not three
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 11_000)
    logger = AgentMessageLogger(backend.db)
    ids = [f"bulky-{n}" for n in range(5)]
    for n, conversation_id in enumerate(ids):
        prompt = {"action": "confirm", "params": BULKY_PARAMS[bulk], "request_id": "r1"}
        await logger.log_messages(
            conversation_id,
            [
                {"role": "user", "content": "pay?", "created_at": f"2026-01-01T00:0{n}:00Z"},
                {"role": "assistant", "content": "ok?", "hitl_action": prompt},
            ],
            user_id="bulky",
        )
    store = ConversationStore(backend.db)
    seen, cursor, sizes = [], None, []
    while True:
        page = await store.list_conversations("bulky", limit=5, cursor=cursor)
        seen += [c.id for c in page.data]
        sizes.append(len(page.data))
        if not page.has_more:
            break
        cursor = page.next_cursor
    assert seen == ids[::-1]
    assert sizes == [2, 2, 1]
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 1)
    alone = await store.list_conversations("bulky", limit=5)
    assert ([c.id for c in alone.data], alone.has_more) == ([ids[-1]], True)


async def test_a_message_page_stops_at_its_byte_budget_in_both_orders(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 20_000)  # a message: ~8,500
    logger = AgentMessageLogger(backend.db)
    turn = [{"role": "user", "content": f"{n} {BULKY}"} for n in range(5)]
    await logger.log_messages("bulky", turn, user_id="bulky", turn_id="t1")
    store = ConversationStore(backend.db)
    for order, seqs in (("asc", [0, 1, 2, 3, 4]), ("desc", [4, 3, 2, 1, 0])):
        seen, after, sizes = [], None, []
        while True:
            page = await store.messages_page("bulky", after=after, limit=5, order=order)
            seen += [m.seq for m in page.data]
            sizes.append(len(page.data))
            if not page.has_more:
                break
            after = page.last_id
        assert (seen, sizes) == (seqs, [2, 2, 1]), order


async def test_a_page_reads_no_more_than_it_can_hold(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the first read (the page and the one after it when both fit), a page reads about
    what its budget has room for by the largest document so far, not `limit` documents."""
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 45_000)  # five messages
    monkeypatch.setattr("agent_store.store._reads.PAGE_FIRST_BATCH", 3)
    logger = AgentMessageLogger(backend.db)
    turn = [{"role": "user", "content": f"{n} {BULKY}"} for n in range(40)]
    await logger.log_messages("bulky", turn, user_id="bulky", turn_id="t1")
    store = ConversationStore(backend.db)
    read = count_documents_read(monkeypatch, store._messages)
    page = await store.messages_page("bulky", limit=40)
    assert [m.seq for m in page.data] == [0, 1, 2, 3, 4]
    assert read == [3, 3]  # three, then the room left for two and one to tell it is full


async def test_a_forged_cursor_is_refused_with_a_clear_error(backend: Backend) -> None:
    with pytest.raises(InvalidInput, match="invalid cursor"):
        await ConversationStore(backend.db).list_conversations("u", cursor="eyIkbmUiOiAxfQ")


async def test_message_pages_walk_the_transcript_in_both_orders(store: ConversationStore) -> None:
    transcript = await store.transcript(CID)
    forward, after = [], None
    while True:
        page = await store.messages_page(CID, after=after, limit=5)
        forward += page.data
        assert page.first_id == page.data[0].id
        assert page.last_id == page.data[-1].id
        if not page.has_more:
            break
        after = page.last_id
    assert [m.id for m in forward] == [m.id for m in transcript]

    backward = await store.messages_page(CID, limit=3, order="desc")
    assert [m.seq for m in backward.data] == [11, 10, 9]
    older = await store.messages_page(CID, after=backward.last_id, limit=3, order="desc")
    assert [m.seq for m in older.data] == [8, 7, 6]


async def store_code_run_by(read: Callable[[], Awaitable[Any]]) -> Counter[str]:
    """The functions of the store's own code `read` runs (each call once, its resumptions
    not counted: how often a coroutine waits on a driver's thread is the scheduler's, not the
    store's; seen by `sys.setprofile`), the models' validators (agent_store/core/_models.py)
    left out."""
    package = Path(agent_store.__file__).parent
    validators = package / "core" / "_models.py"
    ran: Counter[str] = Counter()
    frames: list[Any] = []  # kept alive, so no frame's identity is reused while counting

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and not any(frame is seen for seen in frames):
            where = Path(frame.f_code.co_filename)
            if where.is_relative_to(package) and where != validators:
                frames.append(frame)
                ran[frame.f_code.co_qualname] += 1

    sys.setprofile(profile)
    try:
        await read()
    finally:
        sys.setprofile(None)
    return ran


async def test_a_transcript_runs_the_stores_own_code_per_read_never_per_message(
    backend: Backend,
) -> None:
    """What `transcript` adds to a raw `find` of the messages is their one validation into
    the models (docs/BENCHMARKS.md, "Reads"): the store's own code besides the models'
    validators (the lookup of the conversation, its epoch filter, the scope) runs as many
    times for 40 messages as for 4."""
    logger = AgentMessageLogger(backend.db)
    for conversation_id, turns in (("short", 2), ("long", 20)):
        for n in range(turns):
            said = [{"role": "user", "content": f"q {n}"}, {"role": "assistant", "content": "a"}]
            await logger.log_messages(conversation_id, said, user_id="u", turn_id=f"t-{n}")
    store = ConversationStore(backend.db)
    await store.transcript("short")  # the driver's first use of the collection is not counted

    short = await store_code_run_by(partial(store.transcript, "short"))
    long = await store_code_run_by(partial(store.transcript, "long"))

    assert short  # counted at all
    assert long == short


def started_again_after(
    monkeypatch: pytest.MonkeyPatch, read: str, db: Any, conversation_id: str
) -> None:
    """Once `ConversationStore.<read>` returns, the conversation is deleted and started again
    under its id, by another user, with turns of other ids: between a read's two steps."""
    original = getattr(ConversationStore, read)

    async def then_started_again(self: ConversationStore, *args: Any, **kwargs: Any) -> Any:
        done = await original(self, *args, **kwargs)
        monkeypatch.setattr(ConversationStore, read, original)
        await ConversationStore(db).delete(conversation_id)
        logger = AgentMessageLogger(db)
        for n in range(3):
            said = [{"role": "user", "content": f"new {n}"}, {"role": "assistant", "content": "ok"}]
            await logger.log_messages(conversation_id, said, user_id="bob", turn_id=f"new-{n}")
        return done

    monkeypatch.setattr(ConversationStore, read, then_started_again)


@pytest.mark.parametrize("order", ["asc", "desc"])
async def test_a_page_after_a_message_of_a_conversation_deleted_and_started_again_is_refused(
    store: ConversationStore, backend: Backend, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """A cursor of one conversation pages on in no other started under its id since: its
    message found, then the page read of the new conversation (deleted and started again
    between the two reads), is InvalidInput naming the cursor, never a page of the new one."""
    first = await store.messages_page(CID, limit=2, order=order)  # type: ignore[arg-type]
    started_again_after(monkeypatch, "_seq_of", backend.db, CID)

    with pytest.raises(InvalidInput, match=re.escape(f"message {first.last_id!r} is of a")):
        await store.messages_page(CID, after=first.last_id, limit=2, order=order)  # type: ignore[arg-type]

    fresh = await store.messages_page(CID, limit=2)
    assert [m.content for m in fresh.data] == ["new 0", "ok"]


async def test_over_http_such_a_cursor_is_422_naming_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serve(backend.db) as api:
        url = f"/v1/conversations/{CID}/messages"
        first = (await api.http.get(url, params={"limit": 2}, headers=auth_headers())).json()
        started_again_after(monkeypatch, "_seq_of", api.db, CID)

        page = await api.http.get(
            url, params={"limit": 2, "after": first["last_id"]}, headers=auth_headers()
        )

        assert (page.status_code, page.json()["error"]["code"]) == (422, "invalid_input")
        assert "deleted since" in page.json()["error"]["message"]
        assert "new 0" not in page.text


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"limit": 0}, "invalid limit 0"),
        ({"limit": 10_000}, "invalid limit 10000"),
        ({"order": "sideways"}, "invalid order 'sideways'"),
        ({"after": "msg-not-here"}, "invalid after: message 'msg-not-here' is not in this"),
    ],
)
async def test_bad_page_requests_are_refused(
    store: ConversationStore, kwargs: dict[str, object], error: str
) -> None:
    with pytest.raises(InvalidInput, match=re.escape(error)):
        await store.messages_page(CID, **kwargs)  # type: ignore[arg-type]


async def test_user_scope_hides_other_users_conversations(store: ConversationStore) -> None:
    assert len(await store.transcript(CID, user_id=OWNER)) == 12
    with pytest.raises(NotFound):
        await store.transcript(CID, user_id="mallory")
    with pytest.raises(NotFound):
        await store.get_conversation(CID, user_id="mallory")
    with pytest.raises(NotFound):
        await store.rename(CID, "mine now", user_id="mallory")
    with pytest.raises(NotFound):
        await store.delete(CID, user_id="mallory")
    assert (await store.get_conversation(CID)).name != "mine now"


async def test_missing_conversation_is_not_found(backend: Backend) -> None:
    store = ConversationStore(backend.db)
    with pytest.raises(NotFound, match="conversation 'nope' was not found"):
        await store.transcript("nope")


async def test_turn_count_and_rename(store: ConversationStore) -> None:
    assert await store.turn_count(CID) == 4
    renamed = await store.rename(CID, "  Train   to Lyon ")
    assert renamed.name == "Train to Lyon"
    assert renamed.name_source == "set"


async def test_delete_removes_the_conversation_and_all_its_messages(
    store: ConversationStore, backend: Backend
) -> None:
    deleted = await store.delete(CID)
    assert (deleted.conversations, deleted.messages) == (1, 12)
    assert await backend.db.agent_messages.count_documents({}) == 0
    with pytest.raises(NotFound):
        await store.get_conversation(CID)


async def test_resolving_a_hitl_prompt_needs_its_request_id(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for turn_id, messages in example_turns()[:2]:
        await logger.log_messages(CID, messages, turn_id=turn_id)
    with pytest.raises(Conflict, match="the pending one is 'req-booking-1'"):
        await store.resolve_hitl(CID, "req-other")
    await store.resolve_hitl(CID, "req-booking-1")
    assert await store.pending_hitl(CID) is None


async def test_retrying_a_resolution_that_took_effect_answers_as_the_first_did(
    backend: Backend,
) -> None:
    """A client whose first reply was lost retries: the prompt it resolved is no longer
    pending, no other is, the retry succeeds and writes nothing."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for turn_id, messages in example_turns()[:2]:
        await logger.log_messages(CID, messages, turn_id=turn_id)
    await store.resolve_hitl(CID, "req-booking-1")
    before = await backend.db[CONVERSATIONS].find_one({"_id": CID})

    await store.resolve_hitl(CID, "req-booking-1")

    assert await backend.db[CONVERSATIONS].find_one({"_id": CID}) == before
    with pytest.raises(Conflict, match="no pending prompt 'req-never-asked'"):
        await store.resolve_hitl(CID, "req-never-asked")


async def test_retrying_a_resolution_once_another_prompt_is_pending_answers_as_the_first_did(
    backend: Backend,
) -> None:
    """A request's first answer is its answer: resolving it again once the runtime asked
    another question changes nothing (the new prompt stays pending); a request id never
    asked is still a Conflict naming the pending one."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for turn_id, messages in example_turns()[:2]:
        await logger.log_messages(CID, messages, turn_id=turn_id)
    await store.resolve_hitl(CID, "req-booking-1")
    asks_again = {"action": "confirm", "params": {}, "request_id": "req-booking-2"}
    await logger.log_messages(
        CID,
        [{"role": "assistant", "content": "Sure?", "hitl_action": asks_again}],
        turn_id="t-again",
    )

    before = await backend.db[CONVERSATIONS].find_one({"_id": CID})

    await store.resolve_hitl(CID, "req-booking-1")

    assert await backend.db[CONVERSATIONS].find_one({"_id": CID}) == before
    with pytest.raises(Conflict, match="the pending one is 'req-booking-2'"):
        await store.resolve_hitl(CID, "req-never-asked")


async def test_search_finds_messages_within_the_scope_only(
    store: ConversationStore, backend: Backend
) -> None:
    backend.skip_if_lacking("text_search")
    await AgentMessageLogger(backend.db).log_messages(
        "elsewhere", [{"role": "user", "content": "Lyon again"}], user_id="stranger"
    )
    hits = await store.search("Lyon", user_id=OWNER)
    assert hits
    assert {h.message.conversation_id for h in hits} == {CID}
    assert all("lyon" in (h.message.search_text or "").lower() for h in hits)
    in_conversation = await store.search("Lyon", conversation_id="elsewhere")
    assert [h.message.content for h in in_conversation] == ["Lyon again"]


async def test_search_answers_what_fits_in_page_bytes_and_a_cursor_reads_on(
    store: ConversationStore, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search answers its best hits up to `limit`, fewer when they pass `PAGE_BYTES` (one
    at least), with `has_more` and a `next_cursor` reading on: every hit comes once, ranked
    on from where the page ended. `search` answers the same first page."""
    backend.skip_if_lacking("text_search")
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 20_000)  # two messages
    turn = [{"role": "user", "content": f"lyon {n} {BULKY}"} for n in range(5)]
    await AgentMessageLogger(backend.db).log_messages("bulky", turn, user_id="bulky")
    found, sizes, cursor = [], [], None
    while True:
        page = await store.search_page("lyon", user_id="bulky", limit=200, cursor=cursor)
        found += [(hit.rank, hit.message.content.split()[1]) for hit in page.data]
        sizes.append(len(page.data))
        if not page.has_more:
            assert page.next_cursor is None
            break
        cursor = page.next_cursor
    assert sizes == [2, 2, 1]
    assert [rank for rank, _ in found] == [1, 2, 3, 4, 5]
    assert sorted(n for _, n in found) == ["0", "1", "2", "3", "4"]
    assert len(await store.search("lyon", user_id="bulky", limit=200)) == 2
    limited = await store.search_page("lyon", user_id="bulky", limit=1)
    assert (len(limited.data), limited.has_more) == (1, True)
    with pytest.raises(InvalidInput, match="invalid cursor"):
        await store.search_page("lyon", user_id="bulky", cursor="eyIkbmUiOiAxfQ")


async def test_search_ranks_the_best_match_first(
    store: ConversationStore, backend: Backend
) -> None:
    backend.skip_if_lacking("text_ranking")
    await AgentMessageLogger(backend.db).log_messages(
        "ranked",
        [
            {"role": "user", "content": "lyon"},
            {"role": "assistant", "content": "lyon lyon cloudy cloudy"},
        ],
    )
    hits = await store.search("lyon cloudy", conversation_id="ranked")
    assert [h.message.content for h in hits] == ["lyon lyon cloudy cloudy", "lyon"]
    assert [h.rank for h in hits] == [1, 2]


async def test_search_on_a_database_without_text_search_says_so() -> None:
    from mongomock_motor import AsyncMongoMockClient

    db = AsyncMongoMockClient()["no_text"]
    with pytest.raises(Unsupported, match="this database does not support it"):
        await ConversationStore(db).search("x", user_id="u")


async def test_search_must_be_scoped(backend: Backend) -> None:
    with pytest.raises(InvalidInput, match="scope it to a user_id or a conversation_id"):
        await ConversationStore(backend.db).search("Lyon")


async def test_erase_user_removes_only_that_users_data(
    store: ConversationStore, backend: Backend
) -> None:
    await make_conversations(backend, "keeper", 2)
    erased = await store.erase_user(OWNER)
    assert (erased.conversations, erased.messages) == (1, 12)
    assert await backend.db.agent_messages.count_documents({"user_id": OWNER}) == 0
    assert await backend.db.agent_messages.count_documents({"user_id": "keeper"}) == 2


async def test_claim_moves_every_conversation_and_message(
    store: ConversationStore, backend: Backend
) -> None:
    claimed = await store.claim(OWNER, "user-registered")
    assert (claimed.conversations, claimed.messages) == (1, 12)
    assert [c.id for c in (await store.list_conversations("user-registered")).data] == [CID]
    assert await backend.db.agent_messages.count_documents({"user_id": OWNER}) == 0
    # A runtime still naming the old id is told; with the new one its turn is the owner's.
    logger = AgentMessageLogger(backend.db)
    with pytest.raises(Conflict, match="belongs to another user"):
        await logger.log_messages(CID, [{"role": "user", "content": "still me"}], user_id=OWNER)
    logged = await logger.log_messages(
        CID, [{"role": "user", "content": "still me"}], user_id="user-registered"
    )
    assert logged.messages[0].user_id == "user-registered"


async def test_a_claim_moves_the_messages_a_chunk_of_conversations_at_a_time(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent_store.store import _reads

    monkeypatch.setattr(_reads, "CLAIM_CHUNK", 2)
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db, rules=NO_GRACE)
    for cid in ("c-1", "c-2", "c-3"):
        await logger.log_messages(cid, [{"role": "user", "content": cid}], user_id=OWNER)
    claimed = await store.claim(OWNER, "user-registered")
    assert (claimed.conversations, claimed.messages) == (3, 3)
    assert await backend.db.agent_messages.count_documents({"user_id": OWNER}) == 0


async def test_export_user_yields_each_conversation_with_its_transcript(
    store: ConversationStore,
) -> None:
    exported = [e async for e in store.export_user(OWNER)]
    assert [e.conversation.id for e in exported] == [CID]
    assert len(exported[0].messages) == 12


async def test_an_earlier_text_index_is_replaced_by_the_compound_one(backend: Backend) -> None:
    """A collection holds one text index: the user-first one replaces an earlier version's."""
    await backend.db.agent_messages.create_index([("search_text", "text")], default_language="none")

    await AgentMessageLogger(backend.db).ensure_indexes()

    names = set(await backend.db.agent_messages.index_information())
    assert TEXT_INDEX in names
    assert "search_text_text" not in names


def _stall_inserts(
    logger: AgentMessageLogger, monkeypatch: pytest.MonkeyPatch, go: asyncio.Event
) -> asyncio.Event:
    """The logger's inserts wait for `go`; the event returned is set once one is waiting."""
    insert_many, reserved = logger._messages.insert_many, asyncio.Event()

    async def stalled(*args: Any, **kwargs: Any) -> Any:
        reserved.set()  # the insert comes right after the reservation
        await go.wait()
        return await insert_many(*args, **kwargs)

    monkeypatch.setattr(logger._messages, "insert_many", stalled)
    return reserved


async def _turn_in_flight(
    logger: AgentMessageLogger, monkeypatch: pytest.MonkeyPatch, go: asyncio.Event
) -> asyncio.Task[Any]:
    """A turn of OWNER's "c-del" that has reserved its block and inserts once `go` is set."""
    reserved = _stall_inserts(logger, monkeypatch, go)
    turn = asyncio.create_task(
        logger.log_messages("c-del", [{"role": "user", "content": "late"}], user_id=OWNER,
                            turn_id="t2")
    )  # fmt: skip
    await reserved.wait()
    return turn


def _before_the_document_goes(
    store: ConversationStore, monkeypatch: pytest.MonkeyPatch, then: Any
) -> None:
    conversations = store._conversations
    find_one_and_delete = conversations.find_one_and_delete

    async def hooked(*args: Any, **kwargs: Any) -> Any:
        await then()
        return await find_one_and_delete(*args, **kwargs)

    monkeypatch.setattr(conversations, "find_one_and_delete", hooked)


async def test_a_turn_inserting_while_its_conversation_is_deleted_leaves_no_message_behind(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn reserved before the delete; its insert lands between the delete's two steps."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-del", [{"role": "user", "content": "hi"}], user_id=OWNER)
    go = asyncio.Event()
    turn = await _turn_in_flight(logger, monkeypatch, go)

    async def let_it_insert() -> None:
        go.set()
        await turn

    _before_the_document_goes(store, monkeypatch, let_it_insert)

    deleted = await store.delete("c-del", user_id=OWNER)

    assert deleted.messages == 2
    assert await backend.db.agent_messages.count_documents({"conversation_id": "c-del"}) == 0


@pytest.mark.parametrize("turn_id", ["t-new", "t1"], ids=["a new turn", "the deleted's turn"])
@pytest.mark.parametrize("writer", ["another user", "the owner again"])
async def test_a_delete_leaves_a_conversation_created_under_its_id_meanwhile_whole(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, writer: str, turn_id: str
) -> None:
    """Right after the document is deleted the id exists nowhere: a new turn may create it,
    and the delete's last sweep (for turns that reserved before it) leaves that turn alone,
    even when it has the id of a turn the deleted conversation recorded (a runtime numbering
    its turns from 1 again)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-del", [{"role": "user", "content": "old"}], user_id=OWNER,
                              turn_id="t1")  # fmt: skip
    user = "user-grace" if writer == "another user" else OWNER
    new_turn: list[Any] = []

    async def create_after() -> None:
        new_turn.append(
            await logger.log_messages("c-del", [{"role": "user", "content": "new"}],
                                      user_id=user, turn_id=turn_id, owner_only=True)
        )  # fmt: skip

    conversations = store._conversations
    find_one_and_delete = conversations.find_one_and_delete

    async def then_create(*args: Any, **kwargs: Any) -> Any:
        gone = await find_one_and_delete(*args, **kwargs)
        await create_after()
        return gone

    monkeypatch.setattr(conversations, "find_one_and_delete", then_create)

    deleted = await store.delete("c-del", user_id=OWNER)

    assert deleted.messages == 1
    assert new_turn
    stored = await backend.db.agent_messages.find({"conversation_id": "c-del"}).to_list(None)
    assert [(m["content"], m["user_id"]) for m in stored] == [("new", user)]


VICTIM = "user-victim"
SMALL_RULES = TurnRules(max_message_bytes=4096, claim_grace=timedelta(milliseconds=50))
"""A message of 8 KiB is cut and its whole text kept in GridFS; a short last sweep."""
LONG_TEXT = "the victim's own words " * 400


class _ListedThen:
    """A cursor whose `to_list` runs `then` once it has answered."""

    def __init__(self, cursor: Any, then: Callable[[], Awaitable[None]]) -> None:
        self._cursor, self._then = cursor, then

    async def to_list(self, *args: Any) -> Any:
        found = await self._cursor.to_list(*args)
        await self._then()
        return found

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)


def _after_the_first_lookup(
    store: ConversationStore, monkeypatch: pytest.MonkeyPatch, then: Callable[[], Awaitable[None]]
) -> None:
    """`then` runs once, right after the store's first read of the conversations answered."""
    conversations, done = store._conversations, []
    find_one, find = conversations.find_one, conversations.find

    async def once() -> None:
        if not done:
            done.append(True)
            await then()

    async def find_one_then(*args: Any, **kwargs: Any) -> Any:
        found = await find_one(*args, **kwargs)
        await once()
        return found

    def find_then(*args: Any, **kwargs: Any) -> Any:
        return find(*args, **kwargs) if done else _ListedThen(find(*args, **kwargs), once)

    monkeypatch.setattr(conversations, "find_one", find_one_then)
    monkeypatch.setattr(conversations, "find", find_then)


async def _victim_takes_the_freed_id(backend: Backend, conversation_id: str) -> None:
    """VICTIM starts a conversation under the id (another millisecond: another `created_at`),
    with a cut message, and checkpoints of a user graph and of a service beside it."""
    await asyncio.sleep(0.005)
    logger = AgentMessageLogger(backend.db, rules=SMALL_RULES)
    messages = [{"role": "user", "content": LONG_TEXT}, {"role": "assistant", "content": "answer"}]
    await logger.log_messages(conversation_id, messages, user_id=VICTIM, turn_id="v1",
                              owner_only=True)  # fmt: skip
    found = await backend.db[CONVERSATIONS].find_one({"_id": conversation_id})
    beside = {"thread_id": conversation_id, **ThreadLife.of(found).marks()}
    await backend.db[LANGGRAPH_CHECKPOINTS].insert_many(
        [{"_id": f"{conversation_id}/{who}", "user_id": who, **beside} for who in (VICTIM, None)]
    )


async def _the_victims_conversation_is_whole(backend: Backend, conversation_id: str) -> None:
    store = ConversationStore(backend.db)
    conversation = await store.get_conversation(conversation_id, user_id=VICTIM)
    assert conversation.message_count == 2
    stored = await store.with_full_texts(await store.transcript(conversation_id, user_id=VICTIM))
    whole = [(m.content, "content" in (m.truncated or {})) for m in stored]
    assert whole == [(LONG_TEXT, False), ("answer", False)]
    beside = backend.db[LANGGRAPH_CHECKPOINTS].find({"thread_id": conversation_id})
    assert sorted(str(d["user_id"]) for d in await beside.to_list(None)) == ["None", VICTIM]


@pytest.mark.parametrize("deleter", [OWNER, None], ids=["the owner's token", "a service"])
async def test_a_repeated_delete_leaves_whole_the_conversation_another_user_started_since(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, deleter: str | None
) -> None:
    """A client retries a DELETE after a timeout: the first one frees the id and another user
    starts a conversation under it while the retry is past its lookup of the first one. The
    retry touches the conversation it found only: it deletes none of the new one's messages,
    whole texts, checkpoints, nor its document, and answers as for a deleted conversation."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db, rules=SMALL_RULES)
    await logger.log_messages("c-del", [{"role": "user", "content": "old"}], user_id=OWNER,
                              turn_id="t1")  # fmt: skip

    async def deleted_and_taken() -> None:
        await ConversationStore(backend.db).delete("c-del", user_id=deleter)
        await _victim_takes_the_freed_id(backend, "c-del")

    _after_the_first_lookup(store, monkeypatch, deleted_and_taken)

    deleted = await store.delete("c-del", user_id=deleter)

    assert (deleted.conversations, deleted.messages) == (0, 0)
    await _the_victims_conversation_is_whole(backend, "c-del")


# -- a delete naming the conversation it read: `version` --------------------------------


async def test_a_delete_naming_the_version_it_read_deletes_it_and_a_retry_finds_nothing(
    backend: Backend,
) -> None:
    """The version a read serves names the conversation: a delete naming it deletes it, and
    its retry (the first reply lost) finds nothing under the id: NotFound, as without it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-del", [{"role": "user", "content": "old"}], user_id=OWNER)
    version = (await store.get_conversation("c-del", user_id=OWNER)).version

    deleted = await store.delete("c-del", user_id=OWNER, version=version)

    assert (deleted.conversations, deleted.messages) == (1, 1)
    with pytest.raises(NotFound):
        await store.delete("c-del", user_id=OWNER, version=version)


async def test_a_retried_delete_naming_the_version_it_read_leaves_another_users_start_whole(
    backend: Backend,
) -> None:
    """A double click: the first DELETE deleted the conversation and another user started
    the id again before the second DELETE, held up on the network, reached the database.
    Naming the version it read, the second is refused and deletes nothing of the new
    conversation: its messages, whole texts and checkpoints stay."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-del", [{"role": "user", "content": "old"}], user_id=OWNER)
    version = (await store.get_conversation("c-del")).version
    await store.delete("c-del", version=version)
    await _victim_takes_the_freed_id(backend, "c-del")

    with pytest.raises(VersionMismatch, match="'c-del' is not the one named"):
        await store.delete("c-del", version=version)

    await _the_victims_conversation_is_whole(backend, "c-del")


async def test_a_retried_delete_naming_the_version_it_read_leaves_the_owners_new_start_whole(
    backend: Backend,
) -> None:
    """As above, the owner starting the id again with the very turn it started it with (the
    same turn id, messages and `created_at`): the conversations are told apart all the same."""
    at = "2025-06-01T10:00:00.000Z"
    turn = [{"role": "user", "content": "hello", "created_at": at}]
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-del", turn, user_id=OWNER, turn_id="t1")
    version = (await store.get_conversation("c-del", user_id=OWNER)).version
    await store.delete("c-del", user_id=OWNER, version=version)
    await logger.log_messages("c-del", turn, user_id=OWNER, turn_id="t1")

    with pytest.raises(VersionMismatch):
        await store.delete("c-del", user_id=OWNER, version=version)

    assert [m.content for m in await store.transcript("c-del", user_id=OWNER)] == ["hello"]
    started_again = await store.get_conversation("c-del", user_id=OWNER)
    assert started_again.message_count == 1
    assert started_again.version != version


async def test_a_delete_naming_another_version_deletes_nothing(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-del", [{"role": "user", "content": "kept"}], user_id=OWNER)

    for named in ("0" * 32, "", "*", 'W/"x"'):
        with pytest.raises(VersionMismatch):
            await store.delete("c-del", version=named)

    assert [m.content for m in await store.transcript("c-del")] == ["kept"]


async def test_a_delete_naming_the_version_of_another_users_conversation_is_not_found(
    backend: Backend,
) -> None:
    """Scoped to another user, the conversation is missing, whatever version is named: the
    answer tells nothing of it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-del", [{"role": "user", "content": "kept"}], user_id=OWNER)
    version = (await store.get_conversation("c-del")).version

    for named in (version, "0" * 32, None):
        with pytest.raises(NotFound):
            await store.delete("c-del", user_id=VICTIM, version=named)

    assert [m.content for m in await store.transcript("c-del")] == ["kept"]


@pytest.mark.parametrize("since", ["a turn", "a pop", "a claim"])
async def test_a_delete_of_the_conversation_as_read_deletes_nothing_written_to_since(
    backend: Backend, since: str
) -> None:
    """LIBRARY.md: `delete(unchanged_since=…)` deletes the conversation as the caller read
    it only: a turn, a pop or a claim landing since that read is a Conflict, nothing
    deleted; unchanged, it is deleted as `version` deletes it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    said = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]
    await logger.log_messages("c-del", said, user_id=OWNER, turn_id="t-1")
    as_read = await store.get_conversation("c-del")
    if since == "a turn":
        await logger.log_messages("c-del", [{"role": "user", "content": "three"}], user_id=OWNER)
    elif since == "a pop":
        await store.pop_last_message("c-del")
    else:
        await store.claim(OWNER, VICTIM)
    held = [m.content for m in await store.transcript("c-del")]

    with pytest.raises(Conflict, match="written to since it was read"):
        await store.delete("c-del", unchanged_since=as_read)

    assert [m.content for m in await store.transcript("c-del")] == held
    deleted = await store.delete("c-del", unchanged_since=await store.get_conversation("c-del"))
    assert deleted.conversations == 1


@pytest.mark.parametrize("named", ["version", "unchanged_since"])
async def test_a_delete_given_a_version_and_a_read_checks_both(
    backend: Backend, named: str
) -> None:
    """LIBRARY.md: `delete(version=…, unchanged_since=…)` deletes only the conversation both
    name: a `version` or a read of another conversation is `VersionMismatch`, nothing
    deleted."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for conversation_id in ("c-a", "c-b"):
        said = [{"role": "user", "content": conversation_id}]
        await logger.log_messages(conversation_id, said, user_id=OWNER, turn_id="t-1")
    a, b = await store.get_conversation("c-a"), await store.get_conversation("c-b")
    version, as_read = (b.version, a) if named == "version" else (a.version, b)

    with pytest.raises(VersionMismatch):
        await store.delete("c-a", version=version, unchanged_since=as_read)

    assert [m.content for m in await store.transcript("c-a")] == ["c-a"]
    deleted = await store.delete("c-a", version=a.version, unchanged_since=a)
    assert deleted.conversations == 1


async def test_a_version_names_the_conversation_for_its_life_and_never_shows_its_epoch(
    backend: Backend,
) -> None:
    """Turns, a rename and a claim leave the version as it was; it is not the epoch the
    conversation's documents carry, nor does it contain it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-v", [{"role": "user", "content": "one"}])
    version = (await store.get_conversation("c-v")).version
    await logger.log_messages("c-v", [{"role": "user", "content": "two"}], user_id=OWNER)
    await store.rename("c-v", "Named")
    await store.claim(OWNER, VICTIM)

    conversation = await store.get_conversation("c-v", user_id=VICTIM)
    epoch = (await backend.db[CONVERSATIONS].find_one({"_id": "c-v"}))["epoch"]
    assert conversation.version == version
    assert re.fullmatch(r"[0-9a-f]{32}", version)
    assert epoch not in version
    assert epoch not in conversation.model_dump_json()


async def test_a_conversation_stored_before_epochs_is_named_by_its_creation_until_it_draws_one(
    backend: Backend,
) -> None:
    """A conversation stored before epochs (the migration's, or an older release's) has a
    version derived from its `created_at`; the first turn logged since draws its epoch, and
    with it a new version: a delete naming the one read before is refused, as one naming
    a conversation started again is."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    for conversation_id in ("c-old", "c-older"):
        said = [{"role": "user", "content": "one"}]
        await logger.log_messages(conversation_id, said, user_id=OWNER)
    await backend.db[CONVERSATIONS].update_many({}, {"$unset": {"epoch": ""}})
    await backend.db.agent_messages.update_many({}, {"$unset": {"epoch": ""}})
    older = (await store.get_conversation("c-older")).version
    assert (await store.delete("c-older", version=older)).conversations == 1
    before = (await store.get_conversation("c-old")).version
    assert (await store.get_conversation("c-old")).version == before

    await logger.log_messages("c-old", [{"role": "user", "content": "two"}], user_id=OWNER)

    with pytest.raises(VersionMismatch):
        await store.delete("c-old", version=before)
    now = (await store.get_conversation("c-old")).version
    assert now != before
    deleted = await store.delete("c-old", version=now)
    assert (deleted.conversations, deleted.messages) == (1, 2)


async def test_a_rename_naming_a_version_renames_that_conversation_only(backend: Backend) -> None:
    """A rename sent with the version it read renames the conversation it names; once the
    id was deleted and started again, it is refused and the new conversation keeps its name."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-ren", [{"role": "user", "content": "one"}], user_id=OWNER)
    version = (await store.get_conversation("c-ren")).version
    renamed = await store.rename("c-ren", "Trip", user_id=OWNER, version=version)
    assert (renamed.name, renamed.version) == ("Trip", version)
    await store.delete("c-ren")
    await logger.log_messages("c-ren", [{"role": "user", "content": "one"}], user_id=OWNER)

    with pytest.raises(VersionMismatch):
        await store.rename("c-ren", "Stale", version=version)
    with pytest.raises(NotFound):
        await store.rename("c-ren", "Stale", user_id=VICTIM, version=version)

    assert (await store.get_conversation("c-ren")).name != "Stale"


def _restarted_before_the_first_message_delete(
    backend: Backend,
    store: ConversationStore,
    logger: AgentMessageLogger,
    monkeypatch: pytest.MonkeyPatch,
    said: str,
    user_id: str | None = None,
    created_at: str | None = None,
) -> None:
    """`store`'s first delete of messages reaches the server only after OWNER's "c-del" was
    deleted and started again (another millisecond, or the caller's `created_at`) with a turn
    "t1" saying `said`, by `user_id` or, without one, a service."""
    messages, late = store._messages, []
    delete_many = messages.delete_many
    first = {"role": "user", "content": said} | ({"created_at": created_at} if created_at else {})

    async def arriving_late(*args: Any, **kwargs: Any) -> Any:
        if not late:
            late.append(True)
            await ConversationStore(backend.db).delete("c-del", user_id=OWNER)
            await asyncio.sleep(0.005)
            await logger.log_messages("c-del", [first], user_id=user_id, turn_id="t1")
        return await delete_many(*args, **kwargs)

    monkeypatch.setattr(messages, "delete_many", arriving_late)


async def test_a_repeated_delete_leaves_whole_the_conversation_its_owner_started_again_since(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client retries a DELETE after a timeout, and the retry's delete of the messages
    reaches the server only after the first delete finished and the owner (a "new chat"
    button on a fixed id) started the id again with a turn of the same id: the new
    conversation keeps its messages, and the retry answers as for a deleted conversation."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-del", [{"role": "user", "content": "old"}], user_id=OWNER,
                              turn_id="t1")  # fmt: skip
    _restarted_before_the_first_message_delete(backend, store, logger, monkeypatch, "new", OWNER)

    deleted = await store.delete("c-del", user_id=OWNER)

    assert (deleted.conversations, deleted.messages) == (0, 0)
    assert [m.content for m in await store.transcript("c-del", user_id=OWNER)] == ["new"]
    assert (await store.get_conversation("c-del", user_id=OWNER)).message_count == 1


@pytest.mark.parametrize(
    ("deleting", "starting", "said"),
    [
        pytest.param(OWNER, OWNER, "old", id="its-owner-sending-the-same-turn"),
        pytest.param(OWNER, OWNER, "new", id="its-owner-with-a-new-turn"),
        pytest.param(None, "user-grace", "grace's own", id="another-user-after-a-service"),
    ],
)
async def test_a_repeated_delete_leaves_whole_a_conversation_started_since_at_the_same_time(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    deleting: str | None,
    starting: str,
    said: str,
) -> None:
    """DESIGN.md §3: a delete never takes one started under the id since, by anyone. As
    above, but the first messages of both conversations carry the same `created_at` (the
    caller's): the conversations are told apart by their epochs, not by their times, and
    the retry takes nothing of the new one."""
    at = "2025-06-01T10:00:00.000Z"
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-del", [{"role": "user", "content": "old", "created_at": at}],
                              user_id=OWNER, turn_id="t1")  # fmt: skip
    _restarted_before_the_first_message_delete(
        backend, store, logger, monkeypatch, said, starting, created_at=at
    )

    deleted = await store.delete("c-del", user_id=deleting)

    assert (deleted.conversations, deleted.messages) == (0, 0)
    assert [m.content for m in await store.transcript("c-del", user_id=starting)] == [said]
    conversation = await store.get_conversation("c-del", user_id=starting)
    assert (conversation.message_count, conversation.user_id) == (1, starting)


async def test_the_deletes_last_sweep_leaves_whole_what_another_user_started_after_it_looked(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delete waits for OWNER's second turn (reserved, never stored), looks at the id
    (nothing there), and before its last sweep another user starts the id with a turn of
    the same id as one the deleted conversation recorded: that user's messages stay."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    _, turn = await _owners_second_turn_in_flight(
        logger, AgentMessageLogger(backend.db), monkeypatch
    )
    sweep = store._sweep_late_inserts

    async def another_user_first(*args: Any, **kwargs: Any) -> int:
        if kwargs.get("any_owner"):
            said = [{"role": "user", "content": "someone's own"}]
            await logger.log_messages(
                "c-x", said, user_id=SOMEONE_ELSE, owner_only=True, turn_id="t1"
            )
        return await sweep(*args, **kwargs)

    monkeypatch.setattr(store, "_sweep_late_inserts", another_user_first)

    deleted = await store.delete("c-x", user_id=OWNER)
    turn.cancel()

    assert deleted.messages == 1
    seen = [(m.seq, m.content) for m in await store.transcript("c-x", user_id=SOMEONE_ELSE)]
    assert seen == [(0, "someone's own")]


async def test_an_erasures_late_delete_takes_nothing_of_an_unowned_conversation_started_since(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The erasure's delete of a chunk's messages reaches the server only after the user
    deleted one of its conversations and a service started an unowned one under the id with
    a turn of the same id: its messages (naming no owner, as the user's first ones may) stay."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-del", [{"role": "user", "content": "old"}], user_id=OWNER,
                              turn_id="t1")  # fmt: skip
    _restarted_before_the_first_message_delete(backend, store, logger, monkeypatch, "a service's")

    await store.erase_user(OWNER)

    assert [m.content for m in await store.transcript("c-del")] == ["a service's"]


async def test_an_erasure_leaves_whole_the_conversation_another_user_started_under_a_freed_id(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user deletes a conversation while its erasure runs, past its lookup of the user's
    conversations, and another user starts one under the freed id: the erasure deletes
    nothing of it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db, rules=SMALL_RULES)
    await logger.log_messages("c-del", [{"role": "user", "content": "old"}], user_id=OWNER,
                              turn_id="t1")  # fmt: skip
    await logger.log_messages("c-kept", [{"role": "user", "content": "gone"}], user_id=OWNER)

    async def deleted_and_taken() -> None:
        await ConversationStore(backend.db).delete("c-del", user_id=OWNER)
        await _victim_takes_the_freed_id(backend, "c-del")

    _after_the_first_lookup(store, monkeypatch, deleted_and_taken)

    erased = await store.erase_user(OWNER)

    assert (erased.conversations, erased.messages) == (1, 1)
    await _the_victims_conversation_is_whole(backend, "c-del")
    assert await backend.db.agent_messages.count_documents({"user_id": OWNER}) == 0


@pytest.mark.parametrize("lands", ["while the claim runs", "after the claim"])
async def test_a_turn_inserting_as_its_conversation_is_claimed_is_the_new_owners(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, lands: str
) -> None:
    """A guest signs up while its agent is answering: the answer, reserved under the guest,
    follows the conversation to its new owner."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-del", [{"role": "user", "content": "hi"}], user_id=OWNER)
    go = asyncio.Event()
    turn = await _turn_in_flight(logger, monkeypatch, go)
    if lands == "while the claim runs":  # right after the claim moved the messages
        after_the_first_move(store, monkeypatch, lambda: landing(go, turn))

    await store.claim(OWNER, "user-registered")
    go.set()
    logged = await turn

    transcript = await store.transcript("c-del", user_id="user-registered")
    assert [m.content for m in transcript] == ["hi", "late"]
    assert await backend.db.agent_messages.count_documents({"user_id": OWNER}) == 0
    if lands == "after the claim":
        assert {m.user_id for m in logged.messages} == {"user-registered"}


def after_the_first_move(
    holder: Any, monkeypatch: pytest.MonkeyPatch, then: Callable[[], Awaitable[None]]
) -> None:
    """`then()` runs right after `holder`'s first `update_many` of messages (a move)."""
    update_many, done = holder._messages.update_many, asyncio.Event()

    async def followed(*args: Any, **kwargs: Any) -> Any:
        moved = await update_many(*args, **kwargs)
        if not done.is_set():
            done.set()
            await then()
        return moved

    monkeypatch.setattr(holder._messages, "update_many", followed)


async def landing(go: asyncio.Event, turn: asyncio.Task[Any]) -> None:
    """A turn held before its insert inserts now."""
    go.set()
    await turn


NEW_OWNER, SOMEONE_ELSE = "user-registered", "user-mallory"
NO_GRACE = TurnRules(claim_grace=timedelta(0))
"""For a claim: its last sweep comes at once. For a turn: it is slower than the grace."""


async def test_a_conversation_created_as_the_claim_starts_is_the_new_owners_with_its_messages(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guest's first turn on a new id reserves after the claim started and before it moved
    the conversations; its insert lands right after the claim moved the messages."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=NO_GRACE)
    await logger.log_messages("c-old", [{"role": "user", "content": "hi"}], user_id=OWNER)
    go, turn = asyncio.Event(), []
    reserved = _stall_inserts(logger, monkeypatch, go)
    move_conversations = store._conversations.update_many
    move_messages = store._messages.update_many

    async def a_new_conversation_first(*args: Any, **kwargs: Any) -> Any:
        new = logger.log_messages("c-new", [{"role": "user", "content": "new chat"}],
                                  user_id=OWNER, owner_only=True)  # fmt: skip
        turn.append(asyncio.create_task(new))
        await reserved.wait()
        return await move_conversations(*args, **kwargs)

    async def then_its_insert(*args: Any, **kwargs: Any) -> Any:
        moved = await move_messages(*args, **kwargs)
        if not go.is_set():
            go.set()
            await turn[0]
        return moved

    monkeypatch.setattr(store._conversations, "update_many", a_new_conversation_first)
    monkeypatch.setattr(store._messages, "update_many", then_its_insert)

    await store.claim(OWNER, NEW_OWNER)

    assert (await store.get_conversation("c-new")).user_id == NEW_OWNER
    stored = await backend.db.agent_messages.find({"conversation_id": "c-new"}).to_list(None)
    assert [m["user_id"] for m in stored] == [NEW_OWNER]


async def test_a_conversation_the_guest_starts_between_the_claims_two_moves_keeps_its_messages(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim moved the conversations; before it moves the messages, the guest (its tab
    still open) starts a new conversation: it stays the guest's, and so does its message."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=NO_GRACE)
    await logger.log_messages("c-old", [{"role": "user", "content": "hi"}], user_id=OWNER)
    move_conversations = store._conversations.update_many

    async def then_a_new_conversation(*args: Any, **kwargs: Any) -> Any:
        moved = await move_conversations(*args, **kwargs)
        await logger.log_messages("c-new", [{"role": "user", "content": "new chat"}],
                                  user_id=OWNER, owner_only=True)  # fmt: skip
        return moved

    monkeypatch.setattr(store._conversations, "update_many", then_a_new_conversation)
    claimed = await store.claim(OWNER, NEW_OWNER)

    assert (claimed.conversations, claimed.messages) == (1, 1)
    assert (await store.get_conversation("c-new")).user_id == OWNER
    seen = await store.transcript("c-new", user_id=OWNER)
    assert [(m.content, m.user_id) for m in seen] == [("new chat", OWNER)]
    assert [m.content for m in await store.transcript("c-old", user_id=NEW_OWNER)] == ["hi"]


@pytest.mark.parametrize(
    "between",
    ["_conversations", "_messages"],
    ids=["after-the-conversations-move", "as-the-messages-are-handed-over"],
)
async def test_two_claims_chained_at_once_leave_the_messages_with_their_conversations_holder(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, between: str
) -> None:
    """bob's account is claimed by alice while alice's is claimed by carol: the second claim
    runs whole within the first one, taking bob's conversation on to carol. The first claim's
    messages follow the conversation where it is now: carol's (its last sweep hands on those it
    gave alice just as the conversation moved on)."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=NO_GRACE)
    await logger.log_messages("conv-b", [{"role": "user", "content": "bob's question"},
                                         {"role": "assistant", "content": "bob's answer"}],
                              user_id="bob", turn_id="t1")  # fmt: skip
    collection = getattr(store, between)
    move = collection.update_many
    chained: list[Any] = []

    async def the_next_claim_there(*args: Any, **kwargs: Any) -> Any:
        if between == "_messages" and not chained:
            chained.append(None)  # the second claim's own moves go through as they are
            chained[0] = await store.claim("alice", "carol")
        moved = await move(*args, **kwargs)
        if not chained:
            chained.append(None)
            chained[0] = await store.claim("alice", "carol")
        return moved

    monkeypatch.setattr(collection, "update_many", the_next_claim_there)
    first = await store.claim("bob", "alice")

    assert (await store.get_conversation("conv-b")).user_id == "carol"
    seen = await store.transcript("conv-b", user_id="carol")
    assert [(m.content, m.user_id) for m in seen] == [
        ("bob's question", "carol"), ("bob's answer", "carol"),
    ]  # fmt: skip
    assert (first.messages, chained[0].conversations) == (2, 1)


async def test_a_claims_messages_never_follow_a_deleted_life_into_another_users_conversation(
    backend: Backend,
) -> None:
    """bob deleted "cx" and dave started "cx" again; a late message of bob's life naming bob
    stands under the id. A claim of bob's account leaves it where it is: never dave's."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db, rules=NO_GRACE)
    await logger.log_messages("cx", [{"role": "user", "content": "bob's secret"}],
                              user_id="bob", turn_id="o0")  # fmt: skip
    late = await backend.db[MESSAGES].find_one({"conversation_id": "cx"})
    assert late is not None
    await store.delete("cx", user_id="bob")
    await logger.log_messages("cx", [{"role": "user", "content": "dave's"}], user_id="dave")
    await backend.db[MESSAGES].insert_one({**late, "_id": "late-old", "seq": 5})

    claimed = await store.claim("bob", "alice")

    assert claimed.messages == 0
    assert [m.content for m in await store.transcript("cx", user_id="dave")] == ["dave's"]
    assert (await backend.db[MESSAGES].find_one({"_id": "late-old"}) or {})["user_id"] == "bob"


async def _owners_second_turn_in_flight(
    logger: AgentMessageLogger,
    slow: AgentMessageLogger,
    monkeypatch: pytest.MonkeyPatch,
    created_at: str | None = None,
) -> tuple[asyncio.Event, asyncio.Task[Any]]:
    """OWNER's "c-x" with a first turn logged (at the caller's `created_at`, if given) and a
    second one, by `slow`, that has reserved its block and inserts once the event returned is
    set."""
    await logger.ensure_indexes()
    mine = {"role": "user", "content": "mine"} | ({"created_at": created_at} if created_at else {})
    await logger.log_messages("c-x", [mine], user_id=OWNER, turn_id="t1")
    go = asyncio.Event()
    reserved = _stall_inserts(slow, monkeypatch, go)
    turn = asyncio.create_task(
        slow.log_messages("c-x", [{"role": "user", "content": "OWNER's secret"}], user_id=OWNER,
                          turn_id="t2", owner_only=True)
    )  # fmt: skip
    await reserved.wait()
    return go, turn


@pytest.mark.parametrize("first", [True, False], ids=["its first turn", "its second turn"])
@pytest.mark.parametrize("said", ["OWNER's secret", "hello"], ids=["its content", "other"])
async def test_a_slow_writer_of_a_deleted_conversation_takes_nothing_from_a_turn_of_its_id(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, said: str, first: bool
) -> None:
    """OWNER's turn "t2" reserves on "c-x" and stalls; "c-x" is deleted and SOMEONE_ELSE starts
    it with a turn "t2" of its own (the same message ids), saying the same or something else,
    at the same `seq`s or others. The stalled insert then meets that turn's messages: they are
    another conversation's (their epoch), so it is refused, and SOMEONE_ELSE's acknowledged
    turn stays whole."""
    slow, logger = AgentMessageLogger(backend.db, rules=NO_GRACE), AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db)
    if first:
        await logger.ensure_indexes()
        go = asyncio.Event()
        reserved = _stall_inserts(slow, monkeypatch, go)
        turn = asyncio.create_task(
            slow.log_messages("c-x", [{"role": "user", "content": "OWNER's secret"}],
                              user_id=OWNER, turn_id="t2", owner_only=True)
        )  # fmt: skip
        await reserved.wait()
    else:
        go, turn = await _owners_second_turn_in_flight(logger, slow, monkeypatch)
    await store.delete("c-x", user_id=OWNER)
    await logger.log_messages("c-x", [{"role": "user", "content": said}], user_id=SOMEONE_ELSE,
                              owner_only=True, turn_id="t2")  # fmt: skip
    go.set()

    with pytest.raises(Conflict):
        await turn

    seen = [(m.seq, m.content, m.user_id) for m in await store.transcript("c-x")]
    assert seen == [(0, said, SOMEONE_ELSE)]
    assert await backend.db.agent_messages.count_documents({"user_id": OWNER}) == 0


async def test_a_fork_copies_nothing_a_deleted_conversation_left_under_the_id(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A late insert of OWNER's deleted conversation lands past the end of the one SOMEONE_ELSE
    started under the id; SOMEONE_ELSE forks it at that late message's `seq`, which holds
    none of the conversation's (refused, nothing created), then at its own last one: the fork
    holds only SOMEONE_ELSE's messages."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    await logger.ensure_indexes()
    await logger.log_messages("c-x", [{"role": "user", "content": "mine"}], user_id=OWNER,
                              turn_id="t1")  # fmt: skip
    said = [{"role": "user", "content": "OWNER's secret"}]
    held = await _given_up(logger, monkeypatch, said, turn_id="t2")
    await store.delete("c-x", user_id=OWNER)
    await logger.log_messages("c-x", [{"role": "user", "content": "hello"}], user_id=SOMEONE_ELSE,
                              owner_only=True, turn_id="o1")  # fmt: skip
    await logger._messages.insert_many(held, ordered=False)  # at seq 1, past the new end

    with pytest.raises(InvalidInput, match="no message with seq 1"):
        await logger.fork("c-x", 1, "c-fork", user_id=SOMEONE_ELSE, owner_only=True)
    forked = await logger.fork("c-x", 0, "c-fork", user_id=SOMEONE_ELSE, owner_only=True)

    assert [m.content for m in forked.messages] == ["hello"]
    assert [m.content for m in await store.transcript("c-fork")] == ["hello"]


async def _a_slow_turn_landing_in_a_recreated_id(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> tuple[AgentMessageLogger, ConversationStore]:
    """OWNER's turn reserves on "c-x"; "c-x" is deleted and SOMEONE_ELSE creates a conversation
    under the same id; OWNER's turn, slower than `claim_grace`, inserts after."""
    slow, logger = AgentMessageLogger(backend.db, rules=NO_GRACE), AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db)
    go, turn = await _owners_second_turn_in_flight(logger, slow, monkeypatch)
    await store.delete("c-x", user_id=OWNER)
    await logger.log_messages("c-x", [{"role": "user", "content": "hello"}],
                              user_id=SOMEONE_ELSE, owner_only=True, turn_id="o1")  # fmt: skip
    go.set()
    with pytest.raises(Conflict, match="was deleted since"):  # nothing of it is stored
        await turn
    return logger, store


@pytest.mark.parametrize("started_again", [False, True], ids=["deleted", "started again"])
async def test_a_turn_slower_than_its_conversations_delete_is_refused_as_nothing_of_it_is_stored(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, started_again: bool
) -> None:
    """RELIABILITY.md: OWNER's turn "t2" reserves `seq` 1 of "c-x" and its writer stalls
    inside its insert, slower than `claim_grace`; "c-x" is deleted (the delete has returned)
    and perhaps OWNER starts it again (its turn at `seq` 0); then "t2"'s insert lands. Its
    message goes with the conversation it was written to, so nothing of "t2" is stored, and
    its writer is told so: `Conflict` (the conversation was deleted since), as when its
    insert meets the new conversation's messages, never a turn at a `seq` nobody holds."""
    slow, logger = AgentMessageLogger(backend.db, rules=NO_GRACE), AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db)
    go, turn = await _owners_second_turn_in_flight(logger, slow, monkeypatch)
    await store.delete("c-x", user_id=OWNER)
    if started_again:
        await logger.log_messages("c-x", [{"role": "user", "content": "again"}], user_id=OWNER,
                                  turn_id="n1")  # fmt: skip
    go.set()

    with pytest.raises(Conflict, match="was deleted since this turn reserved its place"):
        await turn

    assert await backend.db.agent_messages.count_documents({"content": "OWNER's secret"}) == 0
    if started_again:
        assert [m.content for m in await store.transcript("c-x")] == ["again"]
        assert (await store.get_conversation("c-x")).message_count == 1


async def test_a_slow_turn_does_not_hand_its_messages_to_whoever_recreated_the_id(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No claim took place: the late message goes with the conversation it was written to."""
    _, store = await _a_slow_turn_landing_in_a_recreated_id(backend, monkeypatch)

    seen = [m.content for m in await store.transcript("c-x", user_id=SOMEONE_ELSE)]
    assert seen == ["hello"]
    assert await backend.db.agent_messages.count_documents({"user_id": OWNER}) == 0


async def test_a_slow_turn_hands_nothing_to_whoever_recreated_the_id_at_the_same_time(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, with both conversations' first messages at the same `created_at` (the
    caller's): the slow turn tells the conversation it reserved on by its epoch, so its late
    message goes with it, never to SOMEONE_ELSE's, and it is refused (nothing of it stored)."""
    at = "2025-06-01T10:00:00.000Z"
    slow, logger = AgentMessageLogger(backend.db, rules=NO_GRACE), AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db)
    go, turn = await _owners_second_turn_in_flight(logger, slow, monkeypatch, created_at=at)
    await store.delete("c-x", user_id=OWNER)
    await logger.log_messages("c-x", [{"role": "user", "content": "hello", "created_at": at}],
                              user_id=SOMEONE_ELSE, owner_only=True, turn_id="o1")  # fmt: skip
    go.set()
    with pytest.raises(Conflict, match="was deleted since"):
        await turn

    seen = [m.content for m in await store.transcript("c-x", user_id=SOMEONE_ELSE)]
    assert seen == ["hello"]
    assert await backend.db.agent_messages.count_documents({"content": "OWNER's secret"}) == 0


async def test_after_a_slow_turn_landed_in_a_recreated_id_its_new_owner_can_still_log(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The late message does not keep the `seq` the new conversation's next turn takes."""
    logger, store = await _a_slow_turn_landing_in_a_recreated_id(backend, monkeypatch)

    await logger.log_messages("c-x", [{"role": "user", "content": "second"}],
                              user_id=SOMEONE_ELSE, owner_only=True, turn_id="o2")  # fmt: skip

    seen = [m.content for m in await store.transcript("c-x", user_id=SOMEONE_ELSE)]
    assert seen == ["hello", "second"]


@pytest.mark.parametrize("removal", ["delete", "erase_user", "erase_user, named elsewhere"])
async def test_a_turn_landing_just_after_its_conversations_removal_leaves_nothing_under_the_id(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, removal: str
) -> None:
    """OWNER's turn, faster than `claim_grace`, reserved before the delete (or the erasure of
    OWNER) and inserts after its sweeps: seeing a reserved `seq` not stored, it sweeps once
    more `claim_grace` later. Nothing names OWNER afterwards, the next holder of the id logs
    every turn, and no read of the id serves the removed conversation's message. A message
    naming OWNER in a conversation OWNER does not own (one a claim is still moving) does not
    stand in for the missing one."""
    logger = AgentMessageLogger(backend.db)  # the default grace: the turn is a fast one
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.2)))
    go, turn = await _owners_second_turn_in_flight(
        logger, AgentMessageLogger(backend.db), monkeypatch
    )
    if removal.endswith("named elsewhere"):
        await logger.log_messages("c-other", [{"role": "user", "content": "hi"}],
                                  user_id=SOMEONE_ELSE, turn_id="o-1")  # fmt: skip
        await backend.db.agent_messages.update_one(
            {"conversation_id": "c-other"}, {"$set": {"user_id": OWNER}}
        )
    grace = store._grace

    async def the_turn_lands_first() -> None:
        await landing(go, turn)
        await grace()

    monkeypatch.setattr(store, "_grace", the_turn_lands_first)
    if removal == "delete":
        await store.delete("c-x", user_id=OWNER)
    else:
        await store.erase_user(OWNER)
    if not go.is_set():  # no second sweep: the turn lands once the removal returned
        await landing(go, turn)

    assert await backend.db.agent_messages.count_documents({"user_id": OWNER}) == 0
    await _the_next_holder_logs_every_turn(logger, store)


async def _a_retry_in_flight(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, retry: Callable[[AgentMessageLogger], Any]
) -> tuple[asyncio.Event, asyncio.Task[Any]]:
    """`retry` by a logger of its own, past its replay check (the turn's record read), its insert
    held until the event returned is set."""
    retrying = AgentMessageLogger(backend.db)
    go = asyncio.Event()
    reserved = _stall_inserts(retrying, monkeypatch, go)
    task = asyncio.create_task(retry(retrying))
    await reserved.wait()
    return go, task


async def test_a_retried_turn_landing_after_its_conversations_delete_leaves_nothing_behind(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OWNER's second turn is stored, its answer lost; the runtime retries it (the same turn id
    and messages). The retry has read the turn's record when the delete runs, finds every
    reserved `seq` holding a message (no second sweep), and returns; the retry's insert, every
    message of the turn again, lands after it. The retry, having inserted messages the delete
    may have swept past, looks the conversation up: it is gone, and so are the turn's messages,
    so the retry is refused (`Conflict`: nothing this attempt inserted is stored). Nothing of
    the deleted conversation is served, and the next holder of the id logs every turn."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.ensure_indexes()
    said = [{"role": "user", "content": "OWNER's secret"}, {"role": "assistant", "content": "ok"}]
    await logger.log_messages("c-x", [{"role": "user", "content": "mine"}], user_id=OWNER,
                              turn_id="t1")  # fmt: skip
    await logger.log_messages("c-x", said, user_id=OWNER, turn_id="t2")

    def retry(retrying: AgentMessageLogger) -> Any:
        return retrying.log_messages("c-x", said, user_id=OWNER, turn_id="t2")

    go, retried = await _a_retry_in_flight(backend, monkeypatch, retry)
    deleted = await store.delete("c-x", user_id=OWNER)
    with pytest.raises(Conflict, match="was deleted since"):
        await landing(go, retried)

    assert deleted.messages == 3
    assert await backend.db.agent_messages.count_documents({"conversation_id": "c-x"}) == 0
    with pytest.raises(NotFound):
        await store.transcript("c-x", user_id=OWNER)
    await _the_next_holder_logs_every_turn(logger, store)


async def test_a_retried_fork_landing_after_the_forks_delete_leaves_nothing_behind(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a fork retried (its answer lost) whose copies land after the fork was
    deleted: the retry takes them back and is refused, and the fork's id serves nothing."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.ensure_indexes()
    said = [{"role": "user", "content": "OWNER's secret"}, {"role": "assistant", "content": "ok"}]
    await logger.log_messages("c-x", said, user_id=OWNER, turn_id="t1")
    await logger.fork("c-x", 1, "c-fork", user_id=OWNER)

    def retry(retrying: AgentMessageLogger) -> Any:
        return retrying.fork("c-x", 1, "c-fork", user_id=OWNER)

    go, retried = await _a_retry_in_flight(backend, monkeypatch, retry)
    deleted = await store.delete("c-fork", user_id=OWNER)
    with pytest.raises(Conflict, match="was deleted since"):
        await landing(go, retried)

    assert deleted.messages == 2
    assert await backend.db.agent_messages.count_documents({"conversation_id": "c-fork"}) == 0
    with pytest.raises(NotFound):
        await store.transcript("c-fork")
    assert [m.content for m in await store.transcript("c-x")] == ["OWNER's secret", "ok"]


FORK_AND_ERASURE = [
    "erased before it writes",
    "erasure under way as it writes",
    "erased between its write and its check",
    "erased after its check",
]


async def _owners_conversation_with_a_cut_message(backend: Backend) -> AgentMessageLogger:
    """OWNER's "c-x": a message cut to its bound (its whole text in GridFS), and an answer."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(max_message_bytes=16 * 1024))
    await logger.ensure_indexes()
    said = [{"role": "user", "content": "OWNER's secret " + "x" * 60_000},
            {"role": "assistant", "content": "noted"}]  # fmt: skip
    await logger.log_messages("c-x", said, user_id=OWNER, turn_id="t1")
    return logger


def _fork_held_after_its_read(
    logger: AgentMessageLogger, monkeypatch: pytest.MonkeyPatch
) -> tuple[asyncio.Event, asyncio.Event]:
    """The logger's fork, once it has read its source and the whole texts of what it copies,
    waits for the second event returned; the first is set once it waits."""
    restore, reached, go = logger._full_texts.restore, asyncio.Event(), asyncio.Event()

    async def held(messages: Any) -> Any:
        restored = await restore(messages)
        reached.set()
        await go.wait()
        return restored

    monkeypatch.setattr(logger._full_texts, "restore", held)
    return reached, go


def _around_the_forks_check(
    logger: AgentMessageLogger,
    monkeypatch: pytest.MonkeyPatch,
    before: Callable[[], Awaitable[Any]] | None = None,
    after: Callable[[], Awaitable[Any]] | None = None,
) -> None:
    """`before` runs once the fork has written its copies, right before it checks its source;
    `after` once it has checked it."""
    check = logger._unless_its_source_went

    async def around(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            await before()
        checked = await check(*args, **kwargs)
        if after is not None:
            await after()
        return checked

    monkeypatch.setattr(logger, "_unless_its_source_went", around)


def _erasure_held_before_its_deletes(
    store: ConversationStore, monkeypatch: pytest.MonkeyPatch
) -> tuple[asyncio.Event, asyncio.Event]:
    """The erasure of OWNER, past its conversations' messages and their whole texts, waits
    before deleting the conversations, then every message naming OWNER left."""
    delete_many, reached, go = store._conversations.delete_many, asyncio.Event(), asyncio.Event()

    async def held(query: Any, *args: Any, **kwargs: Any) -> Any:
        if not reached.is_set():
            reached.set()
            await go.wait()
        return await delete_many(query, *args, **kwargs)

    monkeypatch.setattr(store._conversations, "delete_many", held)
    return reached, go


async def _nothing_of_owner_is_left(backend: Backend, store: ConversationStore) -> None:
    db = backend.db
    assert await db.agent_messages.count_documents({"user_id": OWNER}) == 0
    assert await db.agent_messages.count_documents({"conversation_id": "c-fork"}) == 0
    assert await db.agent_conversations.count_documents({"user_id": OWNER}) == 0
    assert await db[BLOB_FILES].count_documents({}) == 0
    assert await db[BLOB_CHUNKS].count_documents({}) == 0
    assert await db[DELETIONS].count_documents({}) == 0
    with pytest.raises(NotFound):
        await store.transcript("c-fork")


@pytest.mark.parametrize("moment", FORK_AND_ERASURE)
async def test_a_fork_racing_the_erasure_of_its_user_leaves_nothing_of_the_user(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    """OWNER forks "c-x" (a cut message among what it copies) while OWNER is erased: the fork
    has read "c-x" and the whole texts, and the erasure runs before the fork writes its copies
    (all of it, or up to its deletes of what names OWNER, before any conversation went), or
    between the fork's writes and its check of its source, or after that check. The fork,
    finding its source gone or being deleted, takes back what it wrote and answers NotFound;
    one that checked before the erasure began is erased with the rest. Nothing of OWNER is
    left: no conversation, message, whole text or record."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))

    async def erase() -> None:
        await store.erase_user(OWNER)

    held, go = _fork_held_after_its_read(logger, monkeypatch)
    if moment == "erased between its write and its check":
        _around_the_forks_check(logger, monkeypatch, before=erase)
    if moment == "erased after its check":
        _around_the_forks_check(logger, monkeypatch, after=erase)
    fork = asyncio.create_task(logger.fork("c-x", 1, "c-fork", user_id=OWNER, owner_only=True))
    await held.wait()
    erasure = None
    if moment == "erased before it writes":
        await erase()
    if moment == "erasure under way as it writes":
        paused, resume = _erasure_held_before_its_deletes(store, monkeypatch)
        erasure = asyncio.create_task(erase())
        await paused.wait()
    go.set()

    if moment == "erased after its check":
        assert (await fork).conversation_id == "c-fork"
    else:
        with pytest.raises(NotFound, match="'c-x'"):
            await fork
    if erasure is not None:
        resume.set()
        await erasure
    await _nothing_of_owner_is_left(backend, store)


@pytest.mark.parametrize(
    "moment", ["deleted before it writes", "deleted between its write and its check"]
)
async def test_a_fork_whose_source_is_deleted_before_it_checks_it_creates_nothing(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    """A delete of the source landing after the fork read it and before the fork checked it is
    the same: NotFound, and the fork's id holds nothing. A fork that checked its source before
    its delete stands, a conversation of its own."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))

    async def delete() -> None:
        await store.delete("c-x", user_id=OWNER)

    held, go = _fork_held_after_its_read(logger, monkeypatch)
    if moment == "deleted between its write and its check":
        _around_the_forks_check(logger, monkeypatch, before=delete)
    fork = asyncio.create_task(logger.fork("c-x", 1, "c-fork", user_id=OWNER))
    await held.wait()
    if moment == "deleted before it writes":
        await delete()
    go.set()

    with pytest.raises(NotFound, match="'c-x'"):
        await fork
    await _nothing_of_owner_is_left(backend, store)


def _popped_once_after_the_forks_read(
    logger: AgentMessageLogger, monkeypatch: pytest.MonkeyPatch, pop: Callable[[], Awaitable[Any]]
) -> None:
    """`pop` runs once, right after the fork's first read of its source (the await between that
    read and its writes)."""
    read = logger._fork_source

    async def then_popped(*args: Any, **kwargs: Any) -> Any:
        found = await read(*args, **kwargs)
        monkeypatch.setattr(logger, "_fork_source", read)
        await pop()
        return found

    monkeypatch.setattr(logger, "_fork_source", then_popped)


def _once(action: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[None]]:
    """`action`, run by the first call only."""
    ran: list[bool] = []

    async def first() -> None:
        if not ran:
            ran.append(True)
            await action()

    return first


POP_AND_FORK = ["popped after its read", "popped between its write and its check"]


@pytest.mark.parametrize("change", ["popped", "popped and corrected"])
@pytest.mark.parametrize("moment", POP_AND_FORK)
async def test_a_fork_racing_a_pop_of_what_it_copies_never_holds_the_popped_message(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, moment: str, change: str
) -> None:
    """The fork of "c-x" at seq 5 has read it when seq 5 is popped (and, corrected, logged
    again), before the fork writes its copies or between its writes and its check of its
    source. The fork takes back what it wrote and answers as a fresh fork would now:
    InvalidInput for the seq "c-x" no longer holds, nothing of "c-fork" left, or the corrected
    answer copied. Never a fork holding a message its source no longer holds."""
    logger = await _owners_three_turns(backend)
    store = ConversationStore(backend.db)
    pop = _once(partial(_changed, logger, store, change))
    if moment == "popped after its read":
        _popped_once_after_the_forks_read(logger, monkeypatch, pop)
    else:
        _around_the_forks_check(logger, monkeypatch, before=pop)

    if change == "popped":
        with pytest.raises(InvalidInput, match="no message with seq 5"):
            await logger.fork("c-x", 5, "c-fork", user_id=OWNER)
        assert await backend.db.agent_conversations.count_documents({"_id": "c-fork"}) == 0
        assert await backend.db.agent_messages.count_documents({"conversation_id": "c-fork"}) == 0
    else:
        forked = await logger.fork("c-x", 5, "c-fork", user_id=OWNER)
        kept = await store.transcript("c-fork", user_id=OWNER)
        assert [m.content for m in forked.messages][-1] == "corrected answer"
        assert [m.content for m in kept] == [m.content for m in await store.transcript("c-x")]
        assert [m.seq for m in kept] == list(range(6))
    assert await backend.db[DELETIONS].count_documents({}) == 0


async def test_a_fork_stands_when_a_pop_after_its_read_removed_nothing_it_copied(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pop landing between the fork's writes and its check that removes a message past what
    the fork copies (seq 5 of "c-x", forked at seq 3) leaves the fork as made."""
    logger = await _owners_three_turns(backend)
    store = ConversationStore(backend.db)
    _around_the_forks_check(
        logger, monkeypatch, before=_once(partial(_changed, logger, store, "popped"))
    )

    forked = await logger.fork("c-x", 3, "c-fork", user_id=OWNER)

    kept = await store.transcript("c-fork", user_id=OWNER)
    assert [m.content for m in kept] == [m.content for m in forked.messages]
    assert [m.content for m in kept][-1] == "answer 1"
    assert (await store.get_conversation("c-fork", user_id=OWNER)).message_count == 4


CLAIM_AND_FORK = [
    "claimed before it writes",
    "claimed between its write and its check",
    "claimed after its check",
]


def _claim_around_the_fork(
    logger: AgentMessageLogger,
    monkeypatch: pytest.MonkeyPatch,
    moment: str,
    claim: Callable[[], Awaitable[Any]],
) -> Callable[[asyncio.Event, asyncio.Event], Awaitable[None]]:
    """`claim` runs once the fork (held after its read, `_fork_held_after_its_read`) is let
    go: before it writes its copies, right before its check of its source, or after it.
    Returns what lets the held fork go."""
    if moment == "claimed between its write and its check":
        _around_the_forks_check(logger, monkeypatch, before=claim)
    if moment == "claimed after its check":
        _around_the_forks_check(logger, monkeypatch, after=claim)

    async def let_go(held: asyncio.Event, go: asyncio.Event) -> None:
        await held.wait()
        if moment == "claimed before it writes":
            await claim()
        go.set()

    return let_go


@pytest.mark.parametrize("moment", CLAIM_AND_FORK)
@pytest.mark.parametrize("forked_by", ["a service", "the owner's token"])
async def test_a_fork_made_while_its_owners_account_is_claimed_is_the_new_owners(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, moment: str, forked_by: str
) -> None:
    """API.md (claims): a claim moves every conversation of the old id, a fork made meanwhile
    too. OWNER's "c-x" is forked while OWNER's account is claimed by NEW_OWNER: the claim runs
    whole once the fork read "c-x" (the fork creating its conversation after the claim moved
    OWNER's), between the fork's writes and its check, or after that check. Whatever the
    moment, once both answered "c-fork" and every copy are NEW_OWNER's, as "c-x" is:
    NEW_OWNER lists and reads it, nothing names OWNER, and the fork retried replays it."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))

    async def claim() -> None:
        await store.claim(OWNER, NEW_OWNER)

    let_go = _claim_around_the_fork(logger, monkeypatch, moment, claim)
    held, go = _fork_held_after_its_read(logger, monkeypatch)
    by_token = forked_by == "the owner's token"
    fork = asyncio.create_task(logger.fork("c-x", 1, "c-fork", user_id=OWNER, owner_only=by_token))
    await let_go(held, go)
    await fork

    assert set(await _owners_of(backend, "c-fork")) == {NEW_OWNER}
    assert await backend.db[MESSAGES].count_documents({"user_id": OWNER}) == 0
    assert (await store.list_conversations(OWNER)).data == []
    listed = [c.id for c in (await store.list_conversations(NEW_OWNER)).data]
    assert sorted(listed) == ["c-fork", "c-x"]
    assert len(await store.transcript("c-fork", user_id=NEW_OWNER)) == 2
    assert (await logger.fork("c-x", 1, "c-fork", user_id=NEW_OWNER)).replayed


async def test_a_fork_whose_owner_was_claimed_first_answers_with_the_new_owner(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork's answer names whose its copies are: OWNER's account claimed by NEW_OWNER once
    the fork read "c-x", the copies it answers are NEW_OWNER's, as stored."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))

    async def claim() -> None:
        await store.claim(OWNER, NEW_OWNER)

    let_go = _claim_around_the_fork(logger, monkeypatch, CLAIM_AND_FORK[0], claim)
    held, go = _fork_held_after_its_read(logger, monkeypatch)
    fork = asyncio.create_task(logger.fork("c-x", 1, "c-fork"))
    await let_go(held, go)

    assert {m.user_id for m in (await fork).messages} == {NEW_OWNER}


async def test_a_fork_of_the_claiming_users_own_conversation_made_meanwhile_stays_theirs(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other way round: NEW_OWNER's "c-own" is forked while NEW_OWNER claims OWNER's
    account (the claim runs whole once the fork read "c-own"). The fork is NEW_OWNER's, as its
    source is, never OWNER's, and OWNER's "c-x" is NEW_OWNER's with its messages."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    said = [{"role": "user", "content": "mine"}, {"role": "assistant", "content": "yours"}]
    await logger.log_messages("c-own", said, user_id=NEW_OWNER, turn_id="t1")
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))

    async def claim() -> None:
        await store.claim(OWNER, NEW_OWNER)

    let_go = _claim_around_the_fork(logger, monkeypatch, CLAIM_AND_FORK[0], claim)
    held, go = _fork_held_after_its_read(logger, monkeypatch)
    fork = asyncio.create_task(logger.fork("c-own", 1, "c-fork", user_id=NEW_OWNER))
    await let_go(held, go)
    await fork

    assert set(await _owners_of(backend, "c-fork")) == {NEW_OWNER}
    assert set(await _owners_of(backend, "c-x")) == {NEW_OWNER}
    assert await backend.db[CONVERSATIONS].count_documents({"user_id": OWNER}) == 0


@pytest.mark.parametrize("moment", ["erased before its check", "erased after its check"])
async def test_a_fork_made_while_its_owner_is_claimed_goes_with_the_new_owners_erasure(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    """API.md (erasure): a fork running meanwhile answers NotFound and leaves nothing, or is
    erased with the rest. OWNER's account is claimed by NEW_OWNER once OWNER's fork of "c-x"
    read it; NEW_OWNER is then erased, before the fork checks its source or once it did. The
    fork, NEW_OWNER's as its source is, answers NotFound and leaves nothing, or is erased with
    the rest: nothing of either id is left, no conversation, message, whole text or record."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))

    async def claim() -> None:
        await store.claim(OWNER, NEW_OWNER)

    async def erase() -> None:
        await store.erase_user(NEW_OWNER)

    let_go = _claim_around_the_fork(logger, monkeypatch, CLAIM_AND_FORK[0], claim)
    before_check = moment == "erased before its check"
    _around_the_forks_check(logger, monkeypatch, before=erase if before_check else None)
    held, go = _fork_held_after_its_read(logger, monkeypatch)
    fork = asyncio.create_task(logger.fork("c-x", 1, "c-fork", user_id=OWNER))
    await let_go(held, go)
    if before_check:
        with pytest.raises(NotFound, match="'c-x'"):
            await fork
    else:
        await fork
        await erase()

    db = backend.db
    for collection in (CONVERSATIONS, MESSAGES, BLOB_FILES, BLOB_CHUNKS, DELETIONS):
        assert await db[collection].count_documents({}) == 0, collection


async def test_a_fork_erased_with_its_old_owners_account_while_it_is_made_is_not_found(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OWNER's account is claimed by NEW_OWNER once OWNER's fork of "c-x" read it, and the
    emptied OWNER account erased before the fork checks its source: the erasure takes the
    fork, OWNER's then. The fork is not made: NotFound naming it, nothing of it left (no
    answer "made, NEW_OWNER's" for a conversation that is not there), and its retry makes
    it afresh, NEW_OWNER's."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))

    async def erase() -> None:
        await store.erase_user(OWNER)

    _around_the_forks_check(logger, monkeypatch, before=erase)
    held, go = _fork_held_after_its_read(logger, monkeypatch)
    fork = asyncio.create_task(logger.fork("c-x", 1, "c-fork", user_id=OWNER))
    await held.wait()
    await store.claim(OWNER, NEW_OWNER)
    go.set()

    with pytest.raises(NotFound, match="'c-fork'"):
        await fork
    assert await backend.db[MESSAGES].count_documents({"conversation_id": "c-fork"}) == 0
    assert await backend.db[CONVERSATIONS].count_documents({"_id": "c-fork"}) == 0
    monkeypatch.undo()
    again = await logger.fork("c-x", 1, "c-fork", user_id=NEW_OWNER)
    assert not again.replayed
    assert set(await _owners_of(backend, "c-fork")) == {NEW_OWNER}


async def test_a_forks_retry_finding_its_source_deleted_leaves_the_fork_it_replays(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork stood (its first attempt checked its source) and took a turn of its own; its
    retry (the answer was lost) reads the source, which is deleted before the retry writes:
    a replay wrote nothing, so it takes nothing back, and answers the fork as stored."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    first = await logger.fork("c-x", 1, "c-fork", user_id=OWNER)
    later = [{"role": "user", "content": "my later work"}]
    await logger.log_messages("c-fork", later, user_id=OWNER, turn_id="t-later")
    held, go = _fork_held_after_its_read(logger, monkeypatch)

    retry = asyncio.create_task(logger.fork("c-x", 1, "c-fork", user_id=OWNER))
    await held.wait()
    await store.delete("c-x", user_id=OWNER)
    go.set()

    assert [m.id for m in (await retry).messages] == [m.id for m in first.messages]
    kept = [m.content for m in await store.transcript("c-fork", user_id=OWNER)]
    assert (len(kept), kept[-1]) == (3, "my later work")


INTERRUPTIONS = ["its check fails", "its caller cancels it during its check"]


def _the_forks_check_interrupted(
    logger: AgentMessageLogger, monkeypatch: pytest.MonkeyPatch, interruption: str
) -> Callable[[], Awaitable[Any]]:
    """The fork's check of its source, on its first round trip, fails (a dropped connection)
    or never comes back (the caller's timeout then cancels the fork). Returns the wait for
    the fork to reach its check; the check is whole again once it is reached."""
    under_way, reached = logger._deletions.under_way, asyncio.Event()

    async def interrupted(*args: Any, **kwargs: Any) -> bool:
        monkeypatch.setattr(logger._deletions, "under_way", under_way)
        reached.set()
        if interruption == "its check fails":
            raise StorageUnavailable("the connection dropped (injected)")
        await asyncio.Event().wait()  # a round trip that never comes back
        raise AssertionError("unreachable")

    monkeypatch.setattr(logger._deletions, "under_way", interrupted)
    return reached.wait


async def _interrupted(fork: asyncio.Task[Any], interruption: str) -> None:
    """The fork's first attempt, as its caller sees it: StorageUnavailable, or cancelled."""
    if interruption == "its check fails":
        with pytest.raises(StorageUnavailable):
            await fork
        return
    fork.cancel()
    with pytest.raises(asyncio.CancelledError):
        await fork


@pytest.mark.parametrize("fate", ["erased", "deleted"])
@pytest.mark.parametrize("interruption", INTERRUPTIONS)
async def test_a_forks_retry_takes_back_what_an_attempt_whose_check_was_interrupted_wrote(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, interruption: str, fate: str
) -> None:
    """OWNER is erased (or "c-x" deleted) after the fork read "c-x" and before it writes; the
    fork's check of its source is then interrupted: a dropped connection, or the caller's
    timeout cancelling the fork. The retry finds the source gone: before answering NotFound it
    finds the fork the first attempt wrote, whose check never passed (stored on the fork), and
    takes it back. Nothing of OWNER is left, whole texts included."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    held, go = _fork_held_after_its_read(logger, monkeypatch)
    checking = _the_forks_check_interrupted(logger, monkeypatch, interruption)
    fork = asyncio.create_task(logger.fork("c-x", 1, "c-fork", user_id=OWNER))
    await held.wait()
    if fate == "erased":
        await store.erase_user(OWNER)
    else:
        await store.delete("c-x", user_id=OWNER)
    go.set()
    await checking()
    await _interrupted(fork, interruption)

    with pytest.raises(NotFound, match="'c-x'"):
        await logger.fork("c-x", 1, "c-fork", user_id=OWNER)
    await _nothing_of_owner_is_left(backend, store)
    assert (await store.list_conversations(OWNER)).data == []


@pytest.mark.parametrize("interruption", INTERRUPTIONS)
async def test_a_forks_retry_replaying_an_attempt_whose_check_was_interrupted_checks_it_again(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, interruption: str
) -> None:
    """The fork's first attempt wrote its copies, its check interrupted, its source whole. The
    retry reads "c-x", which is deleted before the retry, a replay, would answer: the first
    attempt's check never passed, so the retry checks the source itself, finds it gone, takes
    the copies back and answers NotFound."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    checking = _the_forks_check_interrupted(logger, monkeypatch, interruption)
    fork = asyncio.create_task(logger.fork("c-x", 1, "c-fork", user_id=OWNER))
    await checking()
    await _interrupted(fork, interruption)
    held, go = _fork_held_after_its_read(logger, monkeypatch)

    retry = asyncio.create_task(logger.fork("c-x", 1, "c-fork", user_id=OWNER))
    await held.wait()
    await store.delete("c-x", user_id=OWNER)
    go.set()

    with pytest.raises(NotFound, match="'c-x'"):
        await retry
    await _nothing_of_owner_is_left(backend, store)


def _the_take_backs_delete_failing(
    logger: AgentMessageLogger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The logger's next delete of messages (a take-back's, of the fork's copies) is lost on
    its way to the store, once."""
    delete_many = logger._messages.delete_many

    async def failing(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(logger._messages, "delete_many", delete_many)
        raise AutoReconnect("the connection dropped (injected)")

    monkeypatch.setattr(logger._messages, "delete_many", failing)


async def test_a_forks_retry_finishes_a_take_back_cut_short_though_its_source_id_started_again(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source "c-x" is deleted between the fork's writes and its check: the fork takes its
    copies back, and that take-back is cut short (its delete of the copies lost). The runtime
    then starts a new "c-x". The fork's retry finds the fork the first attempt was taking
    back (its record names the "c-x" it copied), finishes the take-back and answers NotFound:
    nothing of the deleted "c-x" is left under "c-fork", and "c-fork" takes turns again (it
    was BeingDeleted on every retry and every turn, for good)."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))

    async def delete() -> None:
        await store.delete("c-x", user_id=OWNER)
        _the_take_backs_delete_failing(logger, monkeypatch)

    _around_the_forks_check(logger, monkeypatch, before=delete)
    with pytest.raises(StorageUnavailable, match="delete the fork's copies"):
        await logger.fork("c-x", 1, "c-fork", user_id=OWNER)
    monkeypatch.undo()
    again = [{"role": "user", "content": "a new"}, {"role": "assistant", "content": "one"}]
    await logger.log_messages("c-x", again, user_id=OWNER, turn_id="t-new")  # holds seq 1 too

    with pytest.raises(NotFound, match="'c-x'"):
        await logger.fork("c-x", 1, "c-fork", user_id=OWNER)

    assert await backend.db.agent_messages.count_documents({"conversation_id": "c-fork"}) == 0
    assert await backend.db.agent_conversations.count_documents({"_id": "c-fork"}) == 0
    assert await backend.db[DELETIONS].count_documents({}) == 0
    assert await backend.db[BLOB_FILES].count_documents({}) == 0
    turn = [{"role": "user", "content": "a conversation of its own"}]
    await logger.log_messages("c-fork", turn, user_id=OWNER, turn_id="t-own")
    kept = [m.content for m in await store.transcript("c-x", user_id=OWNER)]
    assert kept == ["a new", "one"]


async def test_a_forks_retry_finishes_taking_back_an_empty_fork_and_makes_the_fork_fresh(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork's first attempt lost the insert of its copies; "c-x" then changed (its at_seq
    popped, and corrected), so the retry takes the empty fork back, and that take-back is cut
    short. The next retry finishes it and makes the fork as a fresh one of "c-x", which stands
    as the fork's record says it copied it (was: BeingDeleted for good)."""
    logger = await _owners_three_turns(backend)
    store = ConversationStore(backend.db)
    _the_forks_insert_failing(logger, monkeypatch, applied=False)
    with pytest.raises(StorageUnavailable):
        await logger.fork("c-x", 5, "c-fork", user_id=OWNER)
    await _changed(logger, store, "popped and corrected")
    _the_take_backs_delete_failing(logger, monkeypatch)
    with pytest.raises(StorageUnavailable, match="delete the fork's copies"):
        await logger.fork("c-x", 5, "c-fork", user_id=OWNER)

    retried = await logger.fork("c-x", 5, "c-fork", user_id=OWNER)

    kept = await store.transcript("c-fork", user_id=OWNER)
    assert not retried.replayed
    assert [m.seq for m in kept] == list(range(6))
    assert kept[-1].content == "corrected answer"
    assert await backend.db[DELETIONS].count_documents({}) == 0


async def test_a_fork_whose_retry_found_its_source_whole_stands_though_its_first_check_failed(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first attempt's check failed, its source whole; the retry checks the source, finds
    it whole, and answers the fork: the fork stood, as stored on it. A delete of the source
    after, then another retry (NotFound: the source is gone), take nothing of it back."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    checking = _the_forks_check_interrupted(logger, monkeypatch, "its check fails")
    with pytest.raises(StorageUnavailable):
        await logger.fork("c-x", 1, "c-fork", user_id=OWNER)
    await checking()

    retried = await logger.fork("c-x", 1, "c-fork", user_id=OWNER)
    await store.delete("c-x", user_id=OWNER)
    with pytest.raises(NotFound, match="'c-x'"):
        await logger.fork("c-x", 1, "c-fork", user_id=OWNER)

    assert retried.replayed
    kept = await store.with_full_texts(await store.transcript("c-fork", user_id=OWNER))
    assert [m.content for m in kept] == ["OWNER's secret " + "x" * 60_000, "noted"]


async def _owners_three_turns(backend: Backend) -> AgentMessageLogger:
    """OWNER's "c-x": three turns of a question and its answer, seq 0 to 5."""
    logger = AgentMessageLogger(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    await logger.ensure_indexes()
    for n in range(3):
        said = [{"role": "user", "content": f"question {n}"},
                {"role": "assistant", "content": f"answer {n}"}]  # fmt: skip
        await logger.log_messages("c-x", said, user_id=OWNER, turn_id=f"t{n}")
    return logger


def _the_forks_insert_failing(
    logger: AgentMessageLogger, monkeypatch: pytest.MonkeyPatch, *, applied: bool
) -> None:
    """The logger's next insert of messages (the fork's copies) fails once: lost on its way to
    the store, or `applied` there and its reply lost."""
    insert_many = logger._messages.insert_many

    async def failing(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(logger._messages, "insert_many", insert_many)
        if applied:
            await insert_many(*args, **kwargs)
        raise AutoReconnect("the connection dropped (injected)")

    monkeypatch.setattr(logger._messages, "insert_many", failing)


async def _changed(logger: AgentMessageLogger, store: ConversationStore, change: str) -> None:
    """ "c-x"'s last message (seq 5) popped, and, `change` saying so, corrected: logged again."""
    await store.pop_last_message("c-x", user_id=OWNER)
    if change == "popped and corrected":
        corrected = [{"role": "assistant", "content": "corrected answer"}]
        await logger.log_messages("c-x", corrected, user_id=OWNER, turn_id="t-corrected")


SOURCE_CHANGES = ["popped", "popped and corrected"]


@pytest.mark.parametrize("change", SOURCE_CHANGES)
@pytest.mark.parametrize("copies", ["never stored", "stored, the reply lost"])
async def test_a_forks_retry_after_its_source_changed_takes_back_the_fork_an_attempt_left(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, change: str, copies: str
) -> None:
    """The fork's first attempt reserved "c-fork" and lost the insert of its copies, or stored
    them and lost the reply before its check of its source: nothing of it was ever served.
    "c-x"'s last message, the fork's at_seq, is then popped (and, corrected, logged again): the
    same fork can no longer be made. The retry takes back the fork, never made, and answers
    as a fresh fork would now: the corrected answer copied, or InvalidInput for a seq "c-x" no
    longer holds, with nothing of "c-fork" left."""
    logger = await _owners_three_turns(backend)
    store = ConversationStore(backend.db)
    _the_forks_insert_failing(logger, monkeypatch, applied=copies != "never stored")
    with pytest.raises(StorageUnavailable):
        await logger.fork("c-x", 5, "c-fork", user_id=OWNER)
    await _changed(logger, store, change)

    if change == "popped":
        with pytest.raises(InvalidInput, match="no message with seq 5"):
            await logger.fork("c-x", 5, "c-fork", user_id=OWNER)
        assert await backend.db.agent_conversations.count_documents({"_id": "c-fork"}) == 0
        assert await backend.db.agent_messages.count_documents({"conversation_id": "c-fork"}) == 0
        assert [c.id for c in (await store.list_conversations(OWNER)).data] == ["c-x"]
    else:
        retried = await logger.fork("c-x", 5, "c-fork", user_id=OWNER)
        kept = await store.transcript("c-fork", user_id=OWNER)
        assert not retried.replayed
        assert [m.seq for m in kept] == list(range(6))
        assert kept[-1].content == "corrected answer"
    assert await backend.db[DELETIONS].count_documents({}) == 0


UNFINISHED_FORK = "conversation 'c-fork' is a fork not made yet"


async def _absent(store: ConversationStore, conversation_id: str) -> None:
    """`conversation_id` is served by no read: NotFound by id, left out of lists and exports."""
    missing = re.escape(f"conversation {conversation_id!r} was not found")
    for read in (store.get_conversation, store.transcript, store.messages_page):
        with pytest.raises(NotFound, match=missing):
            await read(conversation_id, user_id=OWNER)
    assert conversation_id not in [c.id for c in (await store.list_conversations(OWNER)).data]
    assert conversation_id not in [c.id for c in (await store.recent_conversations()).data]
    assert conversation_id not in [e.conversation.id async for e in store.export_user(OWNER)]


@pytest.mark.parametrize("sender", ["a user's token", "a service naming the user"])
async def test_a_fork_whose_copies_were_never_stored_is_no_conversation_until_retried(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, sender: str
) -> None:
    """The fork's first attempt created "c-fork" and lost the insert of its copies (503): it is
    no conversation yet. No read serves it (not its source's counts and preview over an empty
    transcript); a turn into it is refused, nothing stored, to be sent again once the fork is
    made; the same fork retried makes it whole, and the turn then follows its copies."""
    logger = await _owners_three_turns(backend)
    store = ConversationStore(backend.db)
    _the_forks_insert_failing(logger, monkeypatch, applied=False)
    with pytest.raises(StorageUnavailable):
        await logger.fork("c-x", 3, "c-fork", user_id=OWNER)
    before = await backend.db.agent_conversations.find_one({"_id": "c-fork"})

    await _absent(store, "c-fork")
    turn = [{"role": "user", "content": "continue in the fork"}]
    owner_only = sender == "a user's token"
    with pytest.raises(StorageUnavailable, match=re.escape(UNFINISHED_FORK)):
        await logger.log_messages("c-fork", turn, user_id=OWNER, owner_only=owner_only)
    with pytest.raises(NotFound):
        await logger.fork("c-fork", 0, "c-fork-of-fork", user_id=OWNER)
    assert await backend.db.agent_conversations.find_one({"_id": "c-fork"}) == before
    assert await backend.db.agent_messages.count_documents({"conversation_id": "c-fork"}) == 0

    retried = await logger.fork("c-x", 3, "c-fork", user_id=OWNER)
    logged = await logger.log_messages("c-fork", turn, user_id=OWNER, owner_only=owner_only)

    assert [m.seq for m in retried.messages] == [0, 1, 2, 3]
    assert [m.seq for m in logged.messages] == [4]
    fork = await store.get_conversation("c-fork", user_id=OWNER)
    assert (fork.message_count, fork.last_message_preview) == (5, "continue in the fork")
    assert "c-fork" in [c.id for c in (await store.list_conversations(OWNER)).data]


@pytest.mark.parametrize("copies", ["never stored", "stored, the reply lost"])
async def test_no_write_but_the_forks_own_lands_on_a_fork_not_made_yet(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, copies: str
) -> None:
    """The fork's first attempt created "c-fork" and its insert of the copies failed: until the
    same fork is retried, a pop, a rename, an upsert (a name, a user), an answer to a prompt and
    a steering inbox are refused as a turn into it is (503, to be sent again once the fork is
    made), the document and the copies left as they were; once retried, each goes through."""
    logger = await _owners_three_turns(backend)
    store = ConversationStore(backend.db)
    _the_forks_insert_failing(logger, monkeypatch, applied=copies != "never stored")
    with pytest.raises(StorageUnavailable):
        await logger.fork("c-x", 3, "c-fork", user_id=OWNER)
    before = await backend.db.agent_conversations.find_one({"_id": "c-fork"})
    copied = await backend.db.agent_messages.count_documents({"conversation_id": "c-fork"})
    writes = [
        lambda: store.pop_last_message("c-fork", user_id=OWNER),
        lambda: store.rename("c-fork", "renamed", user_id=OWNER),
        lambda: logger.upsert_conversation("c-fork", name="renamed"),
        lambda: logger.upsert_conversation("c-fork", user_id=OWNER),
        lambda: store.resolve_hitl("c-fork", "req-1", user_id=OWNER),
        lambda: SteeringInbox(logger).open_turn("c-fork", "run-1", user_id=OWNER),
    ]

    for write in writes:
        with pytest.raises(StorageUnavailable, match=re.escape(UNFINISHED_FORK)):
            await write()

    assert await backend.db.agent_conversations.find_one({"_id": "c-fork"}) == before
    after = await backend.db.agent_messages.count_documents({"conversation_id": "c-fork"})
    assert after == copied
    await logger.fork("c-x", 3, "c-fork", user_id=OWNER)
    await store.rename("c-fork", "renamed", user_id=OWNER)
    await SteeringInbox(logger).open_turn("c-fork", "run-1", user_id=OWNER)
    popped = await store.pop_last_message("c-fork", user_id=OWNER)
    assert popped is not None
    assert popped.content == "answer 1"
    assert (await store.get_conversation("c-fork", user_id=OWNER)).name == "renamed"


def _the_forks_reservation_reply_lost(
    logger: AgentMessageLogger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The logger's next reservation (the fork's, creating its conversation) is applied by the
    store and its reply lost once."""
    reserve = logger._conversations.find_one_and_update

    async def lost(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(logger._conversations, "find_one_and_update", reserve)
        await reserve(*args, **kwargs)
        raise AutoReconnect("the connection dropped (injected)")

    monkeypatch.setattr(logger._conversations, "find_one_and_update", lost)


async def _reserved_long_ago(backend: Backend, conversation_id: str) -> None:
    """Every turn record of `conversation_id` set back 30 minutes, past the default
    `abandon_after`: tail readers may have passed a block still empty."""
    doc = await backend.db.agent_conversations.find_one({"_id": conversation_id})
    turns = [{**record, "a": record["a"] - timedelta(minutes=30)} for record in doc["turns"]]
    await backend.db.agent_conversations.update_one(
        {"_id": conversation_id}, {"$set": {"turns": turns}}
    )


@pytest.mark.parametrize(
    "lost", ["its copies' insert", "its reservation's reply", "its copies' insert's reply"]
)
async def test_a_fork_retried_after_abandon_after_keeps_its_copies_at_seq_0_to_n(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, lost: str
) -> None:
    """A fork's copies never move: they are the first block of a conversation its fork call
    has not handed out yet, and keep the seqs `forked_from.turn_starts` names. Its first
    attempt reserved "c-fork" and stored no copy (or stored them and lost the reply); the same
    fork retried past `abandon_after` stores them at seq 0 to 3 (or answers with them there),
    as a retry within it does: nothing popped, two turns counted, and popping the last one
    leaves one."""
    logger = await _owners_three_turns(backend)
    store = ConversationStore(backend.db)
    if lost != "its reservation's reply":
        _the_forks_insert_failing(logger, monkeypatch, applied=lost.endswith("reply"))
    else:
        _the_forks_reservation_reply_lost(logger, monkeypatch)
    with pytest.raises(StorageUnavailable):
        await logger.fork("c-x", 3, "c-fork", user_id=OWNER)
    await _reserved_long_ago(backend, "c-fork")

    retried = await logger.fork("c-x", 3, "c-fork", user_id=OWNER)

    assert [m.seq for m in retried.messages] == [0, 1, 2, 3]
    stored = backend.db.agent_messages.find({"conversation_id": "c-fork"})
    assert sorted([m["seq"] async for m in stored]) == [0, 1, 2, 3]
    doc = await backend.db.agent_conversations.find_one({"_id": "c-fork"})
    assert not doc.get("popped_seqs")
    assert doc["forked_from"]["turn_starts"] == [2]
    fork = await store.get_conversation("c-fork", user_id=OWNER)
    assert (fork.message_count, fork.turn_count) == (4, 2)
    for _ in range(2):
        await store.pop_last_message("c-fork", user_id=OWNER)
    fork = await store.get_conversation("c-fork", user_id=OWNER)
    assert (fork.message_count, fork.turn_count) == (2, 1)
    assert [m.content for m in await store.transcript("c-fork", user_id=OWNER)] == [
        "question 0",
        "answer 0",
    ]


async def test_a_fork_is_absent_while_an_attempt_makes_it_and_stands_once_its_check_passed(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork whose copies landed and whose check of its source has not passed (an attempt
    still making it, or one whose check failed) is not served yet; its retry checks it, and
    from then it is a conversation like any other."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db)
    checking = _the_forks_check_interrupted(logger, monkeypatch, "its check fails")
    fork = asyncio.create_task(logger.fork("c-x", 1, "c-fork", user_id=OWNER))
    await checking()
    await _interrupted(fork, "its check fails")

    with pytest.raises(NotFound):
        await store.get_conversation("c-fork", user_id=OWNER)
    assert [c.id for c in (await store.list_conversations(OWNER)).data] == ["c-x"]
    turn = [{"role": "user", "content": "go on"}]
    with pytest.raises(StorageUnavailable, match=re.escape(UNFINISHED_FORK)):
        await logger.log_messages("c-fork", turn, user_id=OWNER, owner_only=True)

    await logger.fork("c-x", 1, "c-fork", user_id=OWNER)

    assert (await store.get_conversation("c-fork", user_id=OWNER)).message_count == 2
    assert {c.id for c in (await store.list_conversations(OWNER)).data} == {"c-x", "c-fork"}


@pytest.mark.parametrize("change", SOURCE_CHANGES)
async def test_a_forks_retry_after_its_source_changed_is_a_conflict_naming_the_fork_it_stored(
    backend: Backend, change: str
) -> None:
    """The fork's first attempt stored its copies of "c-x" up to seq 5 and answered; seq 5 is
    then popped from "c-x" (and, corrected, logged again). The fork stands as stored; its
    retry, which can no longer be the same fork, is a Conflict naming the fork (its new id and
    at_seq), never the internal turn that holds its copies."""
    logger = await _owners_three_turns(backend)
    store = ConversationStore(backend.db)
    await logger.fork("c-x", 5, "c-fork", user_id=OWNER)
    await _changed(logger, store, change)

    with pytest.raises(Conflict, match=r"'c-fork'.*seq 5") as refused:
        await logger.fork("c-x", 5, "c-fork", user_id=OWNER)

    assert "turn 'fork-" not in str(refused.value)
    kept = await store.transcript("c-fork", user_id=OWNER)
    assert [m.content for m in kept][-1] == "answer 2"
    assert (await store.get_conversation("c-fork", user_id=OWNER)).message_count == 6
    assert len(kept) == 6


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ("a pop in the fork", r"a pop in 'c-fork' removed some of its copies since"),
        ("popped", r"'c-x' no longer holds up to seq 5 what it copied"),
        ("popped and corrected", r"'c-x' no longer holds up to seq 5 what it copied"),
        ("another fork", r"a fork of 'c-x' at seq 3 ends at another seq: another fork"),
    ],
)
async def test_a_forks_refused_retry_says_whether_the_fork_or_its_source_changed(
    backend: Backend, change: str, said: str
) -> None:
    """API.md (forks): a retry that can no longer be the fork stored under its new id is a 409
    naming the fork, its source and `seq`, and what changed: a pop in the fork itself (its
    source untouched, never blamed), its source up to that seq (a pop, or a pop and a later
    turn), or a retry at another seq, another fork of the source."""
    logger = await _owners_three_turns(backend)
    store = ConversationStore(backend.db)
    await logger.fork("c-x", 5, "c-fork", user_id=OWNER)
    source = await store.transcript("c-x", user_id=OWNER)
    if change == "a pop in the fork":
        await store.pop_last_message("c-fork", user_id=OWNER)
    elif change != "another fork":
        await _changed(logger, store, change)

    with pytest.raises(Conflict, match=r"'c-fork'.*'c-x' at seq 5") as refused:
        await logger.fork("c-x", 3 if change == "another fork" else 5, "c-fork", user_id=OWNER)

    assert re.search(said, str(refused.value)), str(refused.value)
    if change in ("a pop in the fork", "another fork"):
        assert "'c-x' no longer holds" not in str(refused.value)
        assert await store.transcript("c-x", user_id=OWNER) == source


async def _an_unowned_fork(backend: Backend) -> tuple[AgentMessageLogger, ConversationStore]:
    """Unowned "c-u" (a service's turn naming no user), forked at seq 1 into "c-fork", unowned
    as its source."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    said = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    await logger.log_messages("c-u", said, turn_id="t1")
    await logger.fork("c-u", 1, "c-fork")
    return logger, ConversationStore(backend.db)


async def _owners_of(backend: Backend, conversation_id: str) -> list[str | None]:
    """The owner a conversation's document names, then each of its messages', in `seq` order."""
    doc = await backend.db[CONVERSATIONS].find_one({"_id": conversation_id})
    messages = backend.db[MESSAGES].find({"conversation_id": conversation_id}).sort("seq", 1)
    return [doc["user_id"], *[m.get("user_id") async for m in messages]]


@pytest.mark.parametrize("retried_by", ["a service naming no user", "the source's owner"])
@pytest.mark.parametrize("since", ["nothing", "a service turn in the fork"])
async def test_a_forks_retry_after_its_source_was_assigned_leaves_the_fork_as_it_was(
    backend: Backend, retried_by: str, since: str
) -> None:
    """DESIGN.md (forks): the same fork retried is one turn, and a replay writes nothing. The
    fork's owner is decided when it is made (its source's then): unowned "c-u" forked into
    "c-fork", then assigned to OWNER by OWNER's turn. The fork retried as first sent, or
    naming OWNER, is the fork as stored: unowned, every message it holds (a service turn
    logged into it since too) unowned, not OWNER's to list, and OWNER's erasure leaves it."""
    logger, store = await _an_unowned_fork(backend)
    if since != "nothing":
        await logger.log_messages("c-fork", [{"role": "user", "content": "own"}], turn_id="tf")
    await logger.log_messages("c-u", [{"role": "user", "content": "mine"}], user_id=OWNER,
                              turn_id="t2")  # fmt: skip
    before = await _owners_of(backend, "c-fork")

    named = OWNER if retried_by == "the source's owner" else None
    retried = await logger.fork("c-u", 1, "c-fork", user_id=named)

    assert retried.replayed
    assert await _owners_of(backend, "c-fork") == before == [None] * len(before)
    assert [c.id for c in (await store.list_conversations(OWNER)).data] == ["c-u"]
    await store.erase_user(OWNER)
    assert len(await store.transcript("c-fork")) == len(before) - 1


async def test_a_forks_retry_that_makes_it_gives_it_its_sources_owner_then(
    backend: Backend,
) -> None:
    """DESIGN.md (forks): the fork's owner is decided when it is made (its source's then). A
    fork of unowned "c-u" whose first attempt stored none of its copies (their insert lost)
    is not made yet; "c-u" is then assigned to OWNER. The retry that makes it (stores the
    copies) makes it OWNER's, as a fresh fork of "c-u" is now: the fork and its copies name
    OWNER, who reads it."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    said = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    await logger.log_messages("c-u", said, turn_id="t1")
    real = logger._messages

    class LostInsert:
        def __getattr__(self, name: str) -> Any:
            if name != "insert_many":
                return getattr(real, name)

            async def lost(*args: Any, **kwargs: Any) -> Any:
                raise AutoReconnect("the connection dropped")

            return lost

    logger._messages = LostInsert()  # type: ignore[assignment]
    with pytest.raises(StorageUnavailable):
        await logger.fork("c-u", 1, "c-fork")
    logger._messages = real
    await logger.log_messages("c-u", [{"role": "user", "content": "mine"}], user_id=OWNER,
                              turn_id="t2")  # fmt: skip

    await logger.fork("c-u", 1, "c-fork")

    assert set(await _owners_of(backend, "c-fork")) == {OWNER}
    store = ConversationStore(backend.db)
    assert (await store.get_conversation("c-fork", user_id=OWNER)).user_id == OWNER


async def test_a_forks_retry_by_another_user_than_its_unowned_forks_source_is_refused(
    backend: Backend,
) -> None:
    """Who may retry a fork is unchanged: "c-u", forked unowned, is OWNER's since; the fork
    retried by SOMEONE_ELSE (named by a service, or their token) finds no source of theirs,
    and OWNER's token no fork of theirs: NotFound, the fork left unowned."""
    logger, _ = await _an_unowned_fork(backend)
    await logger.log_messages("c-u", [{"role": "user", "content": "mine"}], user_id=OWNER,
                              turn_id="t2")  # fmt: skip

    for user_id, owner_only in [(SOMEONE_ELSE, False), (SOMEONE_ELSE, True), (OWNER, True)]:
        with pytest.raises(NotFound):
            await logger.fork("c-u", 1, "c-fork", user_id=user_id, owner_only=owner_only)

    assert set(await _owners_of(backend, "c-fork")) == {None}


async def test_a_forks_retry_refused_as_the_fork_was_assigned_since_says_so(
    backend: Backend,
) -> None:
    """DESIGN.md (forks): the Conflict naming the fork says what changed. Unowned "c-u" forked
    into "c-fork"; SOMEONE_ELSE's turn assigns the fork to them, OWNER's turn "c-u" to OWNER.
    The retry is the same fork, at the same seq, of a source unchanged up to it: refused as
    the fork is another user's than its source's owner now (never saying whose), the fork
    SOMEONE_ELSE's as it was. Named by a service, OWNER is told only the id is taken."""
    logger, _ = await _an_unowned_fork(backend)
    await logger.log_messages("c-fork", [{"role": "user", "content": "theirs"}],
                              user_id=SOMEONE_ELSE, turn_id="tb")  # fmt: skip
    await logger.log_messages("c-u", [{"role": "user", "content": "mine"}], user_id=OWNER,
                              turn_id="t2")  # fmt: skip

    with pytest.raises(Conflict, match=r"'c-fork'.*'c-u' at seq 1") as refused:
        await logger.fork("c-u", 1, "c-fork")
    with pytest.raises(Conflict, match=r"'c-fork' exists already") as named:
        await logger.fork("c-u", 1, "c-fork", user_id=OWNER)

    said = str(refused.value)
    assert re.search(r"'c-fork' is another user's than 'c-u' is now .*assigned since", said)
    assert not re.search(r"another seq|changed up to it", said), said
    assert SOMEONE_ELSE not in said + str(named.value)
    assert set(await _owners_of(backend, "c-fork")) == {SOMEONE_ELSE}


async def _a_fork_slow_to_insert(
    logger: AgentMessageLogger, monkeypatch: pytest.MonkeyPatch
) -> tuple[asyncio.Task[Any], asyncio.Event]:
    """A fork of "c-x" at seq 5 into "c-fork", running, held at the insert of its copies
    until the event returned is set."""
    insert_many, reached, go = logger._messages.insert_many, asyncio.Event(), asyncio.Event()

    async def slow(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(logger._messages, "insert_many", insert_many)
        reached.set()
        await go.wait()
        return await insert_many(*args, **kwargs)

    monkeypatch.setattr(logger._messages, "insert_many", slow)
    first = asyncio.create_task(logger.fork("c-x", 5, "c-fork", user_id=OWNER))
    await reached.wait()
    return first, go


async def test_an_attempt_of_a_fork_landing_after_its_empty_fork_was_taken_back_leaves_nothing(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork's first attempt reserved "c-fork" and is slow to insert its copies; "c-x"'s
    seq 5, its at_seq, is popped and the retry, refused, takes the empty fork back. The first
    attempt's copies landing after that follow their conversation, find it gone and go too,
    and its check, finding the pop since its read, answers as a fresh fork would now: nothing
    of "c-fork" is left."""
    logger = await _owners_three_turns(backend)
    store = ConversationStore(backend.db)
    first, go = await _a_fork_slow_to_insert(logger, monkeypatch)
    await store.pop_last_message("c-x", user_id=OWNER)
    with pytest.raises(InvalidInput, match="no message with seq 5"):
        await logger.fork("c-x", 5, "c-fork", user_id=OWNER)
    go.set()
    with pytest.raises(InvalidInput, match="no message with seq 5"):
        await first

    assert await backend.db.agent_conversations.count_documents({"_id": "c-fork"}) == 0
    assert await backend.db.agent_messages.count_documents({"conversation_id": "c-fork"}) == 0
    assert await backend.db[DELETIONS].count_documents({}) == 0


async def test_a_fork_refused_for_another_seq_leaves_an_attempt_still_inserting_alone(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork into "c-fork" at seq 5 is slow to insert its copies; another request into the
    same id, at a seq "c-x" does not hold, is refused as it is: it retries no fork there, so
    it takes nothing back, and the first attempt's fork is stored and served as answered."""
    logger = await _owners_three_turns(backend)
    logger.rules = replace(logger.rules, claim_grace=timedelta(seconds=0.05))
    store = ConversationStore(backend.db)
    first, go = await _a_fork_slow_to_insert(logger, monkeypatch)
    with pytest.raises(InvalidInput, match="no message with seq 99"):
        await logger.fork("c-x", 99, "c-fork", user_id=OWNER)
    go.set()
    answered = await first

    assert [m.seq for m in answered.messages] == list(range(6))
    assert [m.seq for m in await store.transcript("c-fork")] == list(range(6))


async def test_a_fork_that_checked_its_source_before_its_delete_stands(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork is a conversation of its own: one whose check found its source whole keeps its
    copies when the source is deleted right after."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))

    async def delete() -> None:
        await store.delete("c-x", user_id=OWNER)

    _around_the_forks_check(logger, monkeypatch, after=delete)
    await logger.fork("c-x", 1, "c-fork", user_id=OWNER)

    forked = await store.with_full_texts(await store.transcript("c-fork"))
    assert [m.content for m in forked] == ["OWNER's secret " + "x" * 60_000, "noted"]
    with pytest.raises(NotFound):
        await store.transcript("c-x")


async def test_a_fork_taking_back_its_copies_leaves_whole_whoever_took_its_id_since(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the fork's writes and its check, its new conversation is deleted and SOMEONE_ELSE
    starts one under the id; then the source is deleted. The fork takes back what it wrote (its
    new conversation's epoch) only: SOMEONE_ELSE's conversation stays whole."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    theirs = [{"role": "user", "content": "SOMEONE_ELSE's " + "y" * 60_000}]

    async def taken_then_source_deleted() -> None:
        await store.delete("c-fork", user_id=OWNER)
        await logger.log_messages("c-fork", theirs, user_id=SOMEONE_ELSE, owner_only=True,
                                  turn_id="o1")  # fmt: skip
        await store.delete("c-x", user_id=OWNER)

    _around_the_forks_check(logger, monkeypatch, before=taken_then_source_deleted)
    with pytest.raises(NotFound, match="'c-x'"):
        await logger.fork("c-x", 1, "c-fork", user_id=OWNER)

    seen = await store.with_full_texts(await store.transcript("c-fork", user_id=SOMEONE_ELSE))
    assert [m.content for m in seen] == [theirs[0]["content"]]
    assert await backend.db.agent_messages.count_documents({"user_id": OWNER}) == 0


async def test_a_fork_whose_new_conversation_is_deleted_while_it_writes_leaves_nothing_there(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork has created its new conversation and its insert is held; the owner deletes the
    new conversation; the insert lands. The delete's last sweep takes the copies, as it takes
    any turn's landing late: nothing is left under the fork's id, and the source is whole."""
    logger = await _owners_conversation_with_a_cut_message(backend)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.2)))
    go = asyncio.Event()
    reserved = _stall_inserts(logger, monkeypatch, go)
    fork = asyncio.create_task(logger.fork("c-x", 1, "c-fork", user_id=OWNER))
    await reserved.wait()
    grace = store._grace

    async def the_fork_lands_first() -> None:
        await landing(go, fork)
        await grace()

    monkeypatch.setattr(store, "_grace", the_fork_lands_first)
    await store.delete("c-fork", user_id=OWNER)

    assert await backend.db.agent_messages.count_documents({"conversation_id": "c-fork"}) == 0
    assert await backend.db[BLOB_FILES].count_documents({"metadata.conversation_id": "c-fork"}) == 0
    with pytest.raises(NotFound):
        await store.transcript("c-fork")
    assert len(await store.transcript("c-x")) == 2


WITHIN_THE_GRACE = TurnRules(claim_grace=timedelta(seconds=30))
"""A grace no held attempt outlasts: the first attempt stays a fast one."""


def _written_again(write: str) -> Callable[[AgentMessageLogger], Any]:
    """OWNER's write of each kind, the same on every attempt: a turn, a fork, a delivery."""
    if write == "turn":
        said = [{"role": "user", "content": "the secret"}, {"role": "assistant", "content": "ok"}]
        return lambda lg: lg.log_messages("c-x", said, user_id=OWNER, turn_id="t2")
    if write == "fork":
        return lambda lg: lg.fork("c-x", 0, "c-fork", user_id=OWNER)
    steer = {"role": "user", "content": "OWNER's secret"}
    return lambda lg: SteeringInbox(lg).try_deliver("c-x", "t1", steer, delivery_id="d1",
                                                    user_id=OWNER)  # fmt: skip


@pytest.mark.parametrize("write", ["turn", "fork", "delivery"])
async def test_a_first_attempt_landing_after_a_delete_its_retry_filled_the_block_for_leaves_nothing(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    """OWNER's write (a turn, a fork, a steering delivery) reserves its block and its insert is
    held; a retry of it, sent meanwhile, stores the whole block. The delete finds every reserved
    `seq` holding a message and sweeps once; the first attempt, faster than `claim_grace`, then
    inserts the same messages again. The retry, having found the write reserved less than the
    grace ago, looks the conversation up only once the grace has passed (the delete and the
    landing happen during that wait): it is gone, and the retry takes the messages back and is
    refused (`Conflict`: nothing of the write is stored). The id serves nothing of the deleted
    conversation, and the next holder logs every turn."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages("c-x", [{"role": "user", "content": "mine"}], user_id=OWNER,
                              turn_id="t1")  # fmt: skip
    await SteeringInbox(logger).open_turn("c-x", "t1", user_id=OWNER)
    cid, again = ("c-fork" if write == "fork" else "c-x"), _written_again(write)
    first, retrying = (AgentMessageLogger(backend.db, rules=WITHIN_THE_GRACE) for _ in "12")
    go = asyncio.Event()
    reserved = _stall_inserts(first, monkeypatch, go)
    landed = asyncio.create_task(again(first))
    await reserved.wait()
    deleted = []

    async def the_delete_and_the_landing_first(deadline: float) -> None:
        deleted.append(await store.delete(cid, user_id=OWNER))
        await landing(go, landed)

    monkeypatch.setattr(retrying, "_wait_until", the_delete_and_the_landing_first)
    with pytest.raises(Conflict, match="was deleted since"):
        await again(retrying)
    if not deleted:  # the retry waited for nothing: the delete, then the first attempt, follow
        await the_delete_and_the_landing_first(0.0)

    assert deleted[0].conversations == 1
    assert await backend.db.agent_messages.count_documents({"conversation_id": cid}) == 0
    with pytest.raises(NotFound):
        await store.transcript(cid)
    if write == "fork":
        assert [m.content for m in await store.transcript("c-x")] == ["mine"]
    else:
        await _the_next_holder_logs_every_turn(logger, store)


async def _the_next_holder_logs_every_turn(
    logger: AgentMessageLogger, store: ConversationStore
) -> None:
    """SOMEONE_ELSE takes "c-x" with three turns: each is stored, at the `seq`s from 0 on,
    and the transcript serves them only."""
    for number in range(3):
        said = [{"role": "user", "content": f"hello {number}"}]
        await logger.log_messages(
            "c-x", said, user_id=SOMEONE_ELSE, owner_only=True, turn_id=f"o{number}"
        )
    seen = [(m.seq, m.content) for m in await store.transcript("c-x")]
    assert seen == [(0, "hello 0"), (1, "hello 1"), (2, "hello 2")]


async def _owner_logging_during_the_wait(
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    conversation_id: str,
    text: str,
    *,
    turn_id: str | None = None,
) -> tuple[ConversationStore, asyncio.Task[Any]]:
    """OWNER's second turn on "c-x" in flight (it will never be stored), and a store whose
    removal, waiting for it (`_grace`), lets OWNER log `text` into `conversation_id` first."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.2)))
    _, turn = await _owners_second_turn_in_flight(
        logger, AgentMessageLogger(backend.db), monkeypatch
    )
    grace = store._grace

    async def owner_logs_meanwhile() -> None:
        said = [{"role": "user", "content": text}]
        await logger.log_messages(conversation_id, said, user_id=OWNER, turn_id=turn_id)
        await grace()

    monkeypatch.setattr(store, "_grace", owner_logs_meanwhile)
    return store, turn


async def test_a_conversation_its_owner_starts_again_during_the_deletes_wait_keeps_its_turns(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delete waits for OWNER's second turn (reserved, never stored: its process died);
    meanwhile OWNER starts the id again with a turn of the first one's id: same owner, same
    `seq`, same turn id. The delete's last sweep takes only messages of turns the new
    conversation does not record."""
    store, turn = await _owner_logging_during_the_wait(
        backend, monkeypatch, "c-x", "new start", turn_id="t1"
    )
    await store.delete("c-x", user_id=OWNER)
    turn.cancel()

    seen = [(m.seq, m.content) for m in await store.transcript("c-x", user_id=OWNER)]
    assert seen == [(0, "new start")]
    assert (await store.get_conversation("c-x")).message_count == 1


async def test_a_conversation_its_user_starts_during_the_erasures_wait_keeps_its_messages(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, turn = await _owner_logging_during_the_wait(backend, monkeypatch, "c-new", "back again")
    await store.erase_user(OWNER)
    turn.cancel()

    assert [m.content for m in await store.transcript("c-new", user_id=OWNER)] == ["back again"]
    assert await backend.db.agent_messages.count_documents({"conversation_id": "c-x"}) == 0


def _after_the_documents_went(
    store: ConversationStore, monkeypatch: pytest.MonkeyPatch, then: Callable[[], Awaitable[None]]
) -> None:
    """`then` runs once, right after the store's delete of conversation documents answered."""
    delete_many, done = store._conversations.delete_many, []

    async def delete_then(*args: Any, **kwargs: Any) -> Any:
        deleted = await delete_many(*args, **kwargs)
        if not done:
            done.append(True)
            await then()
        return deleted

    monkeypatch.setattr(store._conversations, "delete_many", delete_then)


def _a_turn(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"q {text}"}, {"role": "assistant", "content": f"a {text}"}]


@pytest.mark.parametrize("conversation_id", ["c-x", "c-new"], ids=["its id", "a new id"])
async def test_a_conversation_its_user_starts_once_the_erasure_deleted_the_documents_keeps_its_turn(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, conversation_id: str
) -> None:
    """The user's runtime logs a turn right after the erasure deleted the user's conversation
    documents, under the id of the one erased or a new one: the conversation it starts keeps
    the acknowledged turn, which no later sweep of the erasure takes (was: its messages deleted,
    its document left counting them and quoting one)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db, rules=NO_GRACE)
    await logger.log_messages("c-x", _a_turn("old"), user_id=OWNER, turn_id="old")
    acknowledged = []

    async def runtime_logs() -> None:
        logged = await logger.log_messages(
            conversation_id, _a_turn("new"), user_id=OWNER, turn_id="new"
        )
        acknowledged.append([m.seq for m in logged.messages])

    _after_the_documents_went(store, monkeypatch, runtime_logs)

    erased = await store.erase_user(OWNER)

    seen = [(m.seq, m.content) for m in await store.transcript(conversation_id, user_id=OWNER)]
    assert (acknowledged, seen) == ([[0, 1]], [(0, "q new"), (1, "a new")])
    assert (await store.get_conversation(conversation_id, user_id=OWNER)).message_count == 2
    assert await backend.db.agent_messages.count_documents({"turn_id": "old"}) == 0
    assert (erased.conversations, erased.messages) == (1, 2)


@pytest.mark.parametrize("lands", ["before its last sweeps", "during its wait"])
async def test_a_late_insert_of_an_erased_conversation_goes_from_the_one_its_user_started_since(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, lands: str
) -> None:
    """OWNER's second turn on "c-x", reserved before the erasure, inserts once the erasure
    deleted the documents and OWNER started "c-x" again: its messages carry the erased
    conversation's `epoch` and go, the new conversation's turn stays (was: both went, or,
    landing during the wait, the late one stayed inside the new conversation)."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    go, turn = await _owners_second_turn_in_flight(
        logger, AgentMessageLogger(backend.db), monkeypatch
    )
    grace = store._grace

    async def started_again_then_landing() -> None:
        said = [{"role": "user", "content": "back again"}]
        await logger.log_messages("c-x", said, user_id=OWNER, turn_id="new")
        go.set()
        await turn

    if lands == "during its wait":

        async def landing_then_grace() -> None:
            await started_again_then_landing()
            await grace()

        monkeypatch.setattr(store, "_grace", landing_then_grace)
    else:
        _after_the_documents_went(store, monkeypatch, started_again_then_landing)

    erased = await store.erase_user(OWNER)

    stored = await backend.db.agent_messages.find({"conversation_id": "c-x"}).to_list(None)
    assert [(d["seq"], d["content"]) for d in stored] == [(0, "back again")]
    assert (await store.get_conversation("c-x", user_id=OWNER)).message_count == 1
    assert (erased.conversations, erased.messages) == (1, 2)


async def test_a_delete_waits_for_no_turn_when_every_reserved_message_is_stored(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages("c-x", [{"role": "user", "content": "a"}, {"role": "assistant",
                              "content": "b"}], user_id=OWNER)  # fmt: skip
    waits: list[None] = []

    async def counted() -> None:
        waits.append(None)

    monkeypatch.setattr(store, "_grace", counted)
    deleted = await store.delete("c-x")
    assert (deleted.messages, waits) == (2, [])


async def test_a_turn_retried_after_its_lost_insert_landed_past_the_claim_is_the_new_owners(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn's insert lands after the claim's last sweep and its answer is lost; the runtime
    retries it (same turn id), quickly: the retry answers with the stored messages, the new
    owner's."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=NO_GRACE)
    await logger.log_messages("c-del", [{"role": "user", "content": "hi"}], user_id=OWNER)
    insert_many, reserved, go = logger._messages.insert_many, asyncio.Event(), asyncio.Event()

    async def answer_lost(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(logger._messages, "insert_many", insert_many)  # the retry's is not
        reserved.set()
        await go.wait()
        await insert_many(*args, **kwargs)
        raise ConnectionError("the insert was applied, its answer lost")

    monkeypatch.setattr(logger._messages, "insert_many", answer_lost)
    turn = asyncio.create_task(
        logger.log_messages("c-del", [{"role": "user", "content": "late"}], user_id=OWNER,
                            turn_id="t2")
    )  # fmt: skip
    await reserved.wait()
    await store.claim(OWNER, NEW_OWNER)
    go.set()
    with pytest.raises(ConnectionError):
        await turn

    retried = await logger.log_messages("c-del", [{"role": "user", "content": "late"}],
                                        user_id=NEW_OWNER, turn_id="t2")  # fmt: skip

    assert retried.replayed
    stored = await backend.db.agent_messages.find({"conversation_id": "c-del"}).to_list(None)
    assert [m["user_id"] for m in stored] == [NEW_OWNER, NEW_OWNER]
    assert {m.user_id for m in retried.messages} == {NEW_OWNER}


# -- a turn assigning an unowned conversation: the messages before it follow ---------------


async def _unowned_then_assigned(logger: AgentMessageLogger) -> None:
    """A service's turn naming no user, then one naming OWNER: the second assigns "c-un"."""
    await logger.log_messages("c-un", [{"role": "user", "content": "before"}], turn_id="t1")
    await logger.log_messages("c-un", [{"role": "user", "content": "after"}], user_id=OWNER,
                              turn_id="t2")  # fmt: skip


async def test_the_turn_that_assigns_an_unowned_conversation_hands_its_owner_the_earlier_messages(
    backend: Backend,
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)

    await _unowned_then_assigned(logger)

    assert [m.content for m in await store.transcript("c-un", user_id=OWNER)] == ["before", "after"]
    page = await store.messages_page("c-un", user_id=OWNER)
    assert [m.content for m in page.data] == ["before", "after"]
    assert await backend.db.agent_messages.count_documents({"user_id": None}) == 0


async def test_a_retry_of_the_assigning_turn_finishes_handing_over_the_earlier_messages(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The assigning turn stored its messages and crashed before moving the earlier ones; its
    retry (same turn id), even after later turns, moves them."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    update_many = logger._messages.update_many

    async def crash(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("the pod died")

    monkeypatch.setattr(logger._messages, "update_many", crash)
    with pytest.raises(ConnectionError):
        await _unowned_then_assigned(logger)
    monkeypatch.setattr(logger._messages, "update_many", update_many)
    await logger.log_messages("c-un", [{"role": "user", "content": "later"}], user_id=OWNER,
                              turn_id="t3")  # fmt: skip

    retried = await logger.log_messages("c-un", [{"role": "user", "content": "after"}],
                                        user_id=OWNER, turn_id="t2")  # fmt: skip

    assert retried.replayed
    seen = [m.content for m in await store.transcript("c-un", user_id=OWNER)]
    assert seen == ["before", "after", "later"]


@pytest.mark.parametrize("lands", ["while the assigning turn runs", "after it, slowly"])
async def test_an_unowned_turn_inserting_as_its_conversation_is_assigned_is_the_owners(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, lands: str
) -> None:
    """A turn naming no user reserved before another turn assigned the conversation, and
    inserts after: its messages follow the conversation to its owner, moved by the assigning
    turn's last sweep (`claim_grace` later), or, slower than that, by their own logger."""
    slow = lands == "after it, slowly"
    unowned = AgentMessageLogger(backend.db, rules=NO_GRACE if slow else None)
    assigning = AgentMessageLogger(backend.db, rules=NO_GRACE)
    store = ConversationStore(backend.db)
    await unowned.log_messages("c-un", [{"role": "user", "content": "first"}], turn_id="t1")
    go = asyncio.Event()
    reserved = _stall_inserts(unowned, monkeypatch, go)
    turn = asyncio.create_task(
        unowned.log_messages("c-un", [{"role": "user", "content": "in flight"}], turn_id="t2")
    )
    await reserved.wait()
    if not slow:  # right after the assigning turn's first move
        after_the_first_move(assigning, monkeypatch, lambda: landing(go, turn))

    await assigning.log_messages("c-un", [{"role": "user", "content": "assigned"}],
                                 user_id=OWNER, turn_id="t3")  # fmt: skip
    go.set()
    await turn

    seen = [m.content for m in await store.transcript("c-un", user_id=OWNER)]
    assert seen == ["first", "in flight", "assigned"]


async def test_erase_user_removes_the_messages_of_their_conversations_naming_no_owner(
    backend: Backend,
) -> None:
    """A message of the user's conversation still naming no owner (logged before a turn
    assigned it) is the user's all the same: erasing the user removes it."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await _unowned_then_assigned(logger)
    await logger.log_messages("c-kept", [{"role": "user", "content": "kept"}], user_id="keeper")
    await backend.db.agent_messages.update_many(
        {"conversation_id": "c-un", "turn_id": "t1"}, {"$set": {"user_id": None}}
    )

    erased = await store.erase_user(OWNER)

    assert (erased.conversations, erased.messages) == (1, 2)
    assert await backend.db.agent_messages.count_documents({"conversation_id": "c-un"}) == 0
    assert await backend.db.agent_messages.count_documents({"user_id": "keeper"}) == 1


# -- the hand-over racing a delete or a claim ------------------------------------------------

HANDED_TO = "user-handed-to"
CLAIMER = "user-claimer"


def stall_inserts(
    logger: AgentMessageLogger, monkeypatch: pytest.MonkeyPatch, go: asyncio.Event
) -> asyncio.Event:
    """The logger's inserts wait for `go`; the event returned is set once one is waiting."""
    insert_many, reserved = logger._messages.insert_many, asyncio.Event()

    async def stalled(*args: Any, **kwargs: Any) -> Any:
        reserved.set()
        await go.wait()
        return await insert_many(*args, **kwargs)

    monkeypatch.setattr(logger._messages, "update_many", logger._messages.update_many)
    monkeypatch.setattr(logger._messages, "insert_many", stalled)
    return reserved


async def owned_messages(backend: Backend, conversation_id: str) -> list[tuple[str, Any]]:
    stored = await (
        backend.db.agent_messages.find({"conversation_id": conversation_id}).sort("seq", 1)
    ).to_list(None)
    return [(m["content"], m["user_id"]) for m in stored]


async def test_a_slow_assigning_turn_does_not_hand_a_recreated_conversation_to_its_user(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An assigning turn (a service naming HANDED_TO) reserves on unowned "c-x", which is deleted
    and started again, unowned, under its id before the turn inserts: the new conversation's
    messages are not handed to HANDED_TO (nor erased with HANDED_TO), and the turn, nothing of
    it stored, is refused."""
    slow, logger = AgentMessageLogger(backend.db, rules=NO_GRACE), AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages("c-x", [{"role": "user", "content": "old"}], turn_id="t1")
    go = asyncio.Event()
    reserved = stall_inserts(slow, monkeypatch, go)
    turn = asyncio.create_task(
        slow.log_messages("c-x", [{"role": "user", "content": "assigning"}], user_id=HANDED_TO,
                          turn_id="t2")
    )  # fmt: skip
    await reserved.wait()
    await store.delete("c-x")
    await logger.log_messages("c-x", [{"role": "user", "content": "new chat"}], turn_id="n1")
    go.set()
    with pytest.raises(Conflict, match="was deleted since"):
        await turn

    assert (await store.get_conversation("c-x")).user_id is None
    assert await owned_messages(backend, "c-x") == [("new chat", None)]
    await store.erase_user(HANDED_TO)
    assert await owned_messages(backend, "c-x") == [("new chat", None)]


async def test_the_assigning_turns_last_sweep_follows_a_claim_made_meanwhile(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HANDED_TO's assigning turn sees an unowned turn still inserting and sweeps `claim_grace`
    later; meanwhile a claim moved the conversation to CLAIMER: the late message goes to the
    conversation's owner then, CLAIMER."""
    unowned = AgentMessageLogger(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=30)))
    assigning = AgentMessageLogger(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.3)))
    store = ConversationStore(backend.db, rules=NO_GRACE)
    await unowned.log_messages("c-un", [{"role": "user", "content": "first"}], turn_id="t1")
    go = asyncio.Event()
    reserved = stall_inserts(unowned, monkeypatch, go)
    turn = asyncio.create_task(
        unowned.log_messages("c-un", [{"role": "user", "content": "in flight"}], turn_id="t2")
    )
    await reserved.wait()

    async def a_claim_then_the_landing() -> None:
        await store.claim(HANDED_TO, CLAIMER)
        await landing(go, turn)  # before the assigning turn's sweep

    after_the_first_move(assigning, monkeypatch, a_claim_then_the_landing)
    await assigning.log_messages("c-un", [{"role": "user", "content": "assigned"}],
                                 user_id=HANDED_TO, turn_id="t3")  # fmt: skip

    assert (await store.get_conversation("c-un")).user_id == CLAIMER
    seen = [m.content for m in await store.transcript("c-un", user_id=CLAIMER)]
    assert seen == ["first", "in flight", "assigned"]


async def _a_turn_applied_after_its_writer_gave_up_and_the_delete(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OWNER's turn "t2" on "c-x" reserves its block; its insert reaches the server only after
    the writer gave up (a client timeout: `StorageUnavailable`, never retried) and after the
    delete of "c-x" returned, its grace and second sweep included."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    await logger.ensure_indexes()
    await logger.log_messages("c-x", [{"role": "user", "content": "mine"}], user_id=OWNER,
                              turn_id="t1")  # fmt: skip
    said = [{"role": "user", "content": "OWNER's secret"}]
    said.append({"role": "assistant", "content": "noted"})
    held = await _given_up(logger, monkeypatch, said, turn_id="t2")
    await store.delete("c-x", user_id=OWNER)
    await logger._messages.insert_many(held, ordered=False)  # the server applies it now


async def _given_up(
    logger: AgentMessageLogger,
    monkeypatch: pytest.MonkeyPatch,
    messages: list[dict[str, Any]],
    *,
    turn_id: str,
) -> list[dict[str, Any]]:
    """OWNER's turn on "c-x" reserves its block, and its writer gives up on the insert (a client
    timeout: `StorageUnavailable`, never retried): the documents it sent, for the server to
    apply later."""
    held: list[list[dict[str, Any]]] = []
    insert_many = logger._messages.insert_many

    async def applied_later(documents: list[dict[str, Any]], **kwargs: Any) -> Any:
        held.append(documents)
        raise StorageUnavailable("the client timed out")

    monkeypatch.setattr(logger._messages, "insert_many", applied_later)
    with pytest.raises(StorageUnavailable):
        await logger.log_messages("c-x", messages, user_id=OWNER, turn_id=turn_id)
    monkeypatch.setattr(logger._messages, "insert_many", insert_many)
    return held[0]


async def test_a_turn_applied_after_its_writer_gave_up_and_its_conversations_delete_blocks_no_turn(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The late messages sit at the `seq`s the next conversation under the id takes: the
    turn that reserves them finds another turn's messages in its own block, which no
    conversation under the id records, and takes their place. Every turn is logged, and
    no read serves OWNER's message."""
    await _a_turn_applied_after_its_writer_gave_up_and_the_delete(backend, monkeypatch)
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)

    await _the_next_holder_logs_every_turn(logger, store)

    assert await backend.db.agent_messages.count_documents({"user_id": OWNER}) == 0


async def test_a_late_insert_of_a_deleted_conversation_gives_way_to_turns_numbered_alike(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime numbers its turns per conversation ("t0", "t1", ...). Turn "t1" of the first
    conversation reserves three `seq`s and its writer gives up; the owner deletes the
    conversation and starts the id again, and only then the server applies the old insert.
    The new conversation's turns "t1" and "t2" meet the old messages (the first under the
    same ids, the next at a `seq` of its own): every turn is logged, and no read serves an
    old message, since they carry the deleted conversation's epoch."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    await logger.ensure_indexes()

    def turn(said: str, answers: int) -> list[dict[str, Any]]:
        replies = [{"role": "assistant", "content": f"{said}: answer {n}"} for n in range(answers)]
        return [{"role": "user", "content": said}, *replies]

    await logger.log_messages("c-x", turn("old t0", 2), user_id=OWNER, turn_id="t0")
    held = await _given_up(logger, monkeypatch, turn("old t1", 2), turn_id="t1")
    await store.delete("c-x", user_id=OWNER)
    await logger.log_messages("c-x", turn("new t0", 1), user_id=OWNER, turn_id="t0")
    await logger._messages.insert_many(held, ordered=False)  # applied now, at seqs 3 to 5

    for number in (1, 2, 3):
        await logger.log_messages("c-x", turn(f"new t{number}", 1), user_id=OWNER,
                                  turn_id=f"t{number}")  # fmt: skip

    seen = [m.content for m in await store.transcript("c-x")]
    assert seen == [text for n in range(4) for text in (f"new t{n}", f"new t{n}: answer 0")]
    assert await backend.db.agent_messages.count_documents({"content": {"$regex": "^old"}}) == 0


async def test_a_message_a_pop_removed_and_a_late_insert_put_back_gives_way_to_the_next_turn(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Turn "t1"'s first insert times out on its writer and reaches the server late; its retry
    is stored, the runtime pops the answer (a rewind), and then the first insert lands, putting
    the answer back at the `seq` the next turn gets: that turn is stored there, every retry of
    it too, and the popped answer is not served again."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages("c-x", [{"role": "user", "content": "t0"}], user_id=OWNER,
                              turn_id="t0")  # fmt: skip
    said = [{"role": "user", "content": "t1 q"}, {"role": "assistant", "content": "t1 a"}]
    held = await _given_up(logger, monkeypatch, said, turn_id="t1")
    await logger.log_messages("c-x", said, user_id=OWNER, turn_id="t1")
    assert (await store.pop_last_message("c-x", user_id=OWNER) or said).content == "t1 a"
    with pytest.raises(BulkWriteError):  # "t1 q" is there; "t1 a" back at seq 2
        await logger._messages.insert_many(held, ordered=False)

    asked = [{"role": "user", "content": "t2 q"}]
    logged = await logger.log_messages("c-x", asked, user_id=OWNER, turn_id="t2")
    again = await logger.log_messages("c-x", asked, user_id=OWNER, turn_id="t2")

    assert [m.seq for m in logged.messages] == [m.seq for m in again.messages] == [2]
    seen = [m.content for m in await store.transcript("c-x", user_id=OWNER)]
    assert seen == ["t0", "t1 q", "t2 q"]
    assert (await store.get_conversation("c-x")).message_count == 3


async def test_a_pop_passes_a_deleted_conversations_late_insert_past_the_last_message(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A late insert of OWNER's deleted conversation lies past the last message of the one
    OWNER started again under the id: a pop removes and answers that conversation's own last
    message (it was refused every time, the late message never removable by a mark)."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    await logger.ensure_indexes()
    await logger.log_messages("c-x", [{"role": "user", "content": "old"}], user_id=OWNER,
                              turn_id="t0")  # fmt: skip
    held = await _given_up(logger, monkeypatch, [{"role": "user", "content": "old secret"}],
                           turn_id="t1")  # fmt: skip
    await store.delete("c-x", user_id=OWNER)
    await logger.log_messages("c-x", [{"role": "user", "content": "new"}], user_id=OWNER,
                              turn_id="n0")  # fmt: skip
    await logger.log_messages("c-x", [{"role": "user", "content": "newer"}], user_id=OWNER,
                              turn_id="n1")  # fmt: skip
    held = [{**d, "seq": 5} for d in held]  # past the new conversation's last message
    await logger._messages.insert_many(held, ordered=False)

    popped = await store.pop_last_message("c-x", user_id=OWNER)

    assert popped is not None
    assert popped.content == "newer"
    assert (await store.get_conversation("c-x")).message_count == 1


async def test_a_first_turn_retried_after_its_late_insert_outlived_its_conversation_is_stored(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversation's first turn times out on its writer, the conversation is deleted, the
    server applies the insert after the delete, and the runtime retries the turn: the retry
    starts the id again and meets its own messages at their very `seq`s, under the deleted
    conversation's epoch. They take their place, and the next delete leaves nothing."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    await logger.ensure_indexes()
    said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    held = await _given_up(logger, monkeypatch, said, turn_id="t0")
    await store.delete("c-x", user_id=OWNER)
    await logger._messages.insert_many(held, ordered=False)  # applied now, at seqs 0 and 1

    retried = await logger.log_messages("c-x", said, user_id=OWNER, turn_id="t0")

    assert [(m.seq, m.content) for m in retried.messages] == [(0, "hi"), (1, "hello")]
    epoch = (await backend.db[CONVERSATIONS].find_one({"_id": "c-x"}))["epoch"]
    assert {m["epoch"] async for m in backend.db.agent_messages.find()} == {epoch}
    await store.delete("c-x", user_id=OWNER)
    assert await backend.db.agent_messages.count_documents({}) == 0


@pytest.mark.parametrize("gone", ["before the lookup", "before the sweep"])
async def test_a_turn_meeting_a_deleted_conversations_messages_that_go_meanwhile_is_stored(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, gone: str
) -> None:
    """The new conversation's first turn meets a deleted conversation's late messages under
    its ids, and they go (their slow writer takes them back) before the turn looks them up,
    or before it sweeps what that conversation left: the turn is stored where it reserved."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    await logger.ensure_indexes()
    held = await _given_up(logger, monkeypatch, [{"role": "user", "content": "old"}],
                           turn_id="t0")  # fmt: skip
    await store.delete("c-x", user_id=OWNER)
    await logger._messages.insert_many(held, ordered=False)
    taken_back = []

    async def take_back() -> None:
        if not taken_back:
            taken_back.append(True)
            await logger._messages.delete_many({"_id": {"$in": [d["_id"] for d in held]}})

    if gone == "before the lookup":  # right after the turn's insert met them
        insert_many = logger._messages.insert_many

        async def then_taken_back(*args: Any, **kwargs: Any) -> Any:
            try:
                return await insert_many(*args, **kwargs)
            finally:
                await take_back()

        monkeypatch.setattr(logger._messages, "insert_many", then_taken_back)
    else:
        left_by = logger._left_by

        async def taken_back_first(*args: Any) -> Any:
            await take_back()
            return await left_by(*args)

        monkeypatch.setattr(logger, "_left_by", taken_back_first)

    logged = await logger.log_messages("c-x", [{"role": "user", "content": "new"}],
                                       user_id=OWNER, turn_id="t0")  # fmt: skip

    assert [(m.seq, m.content) for m in logged.messages] == [(0, "new")]
    assert [m.content for m in await store.transcript("c-x")] == ["new"]


async def test_a_turn_retried_after_its_late_insert_outlived_its_conversation_is_stored_anew(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime retries the turn whose writer gave up, later: its conversation was deleted
    meanwhile, so the retry starts one under the id, and finds the turn's own messages where
    the deleted conversation had put them. They take their place in the new one."""
    await _a_turn_applied_after_its_writer_gave_up_and_the_delete(backend, monkeypatch)
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    said = [
        {"role": "user", "content": "OWNER's secret"},
        {"role": "assistant", "content": "noted"},
    ]

    retried = await logger.log_messages("c-x", said, user_id=OWNER, turn_id="t2")
    await logger.log_messages("c-x", [{"role": "user", "content": "next"}], user_id=OWNER)

    assert [m.seq for m in retried.messages] == [0, 1]
    seen = [(m.seq, m.content) for m in await store.transcript("c-x", user_id=OWNER)]
    assert seen == [(0, "OWNER's secret"), (1, "noted"), (2, "next")]
    assert (await store.get_conversation("c-x")).message_count == 3


async def test_a_turn_of_a_deleted_conversation_still_being_written_takes_nothing_from_the_next(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OWNER's writer is slow, not gone: its turn inserts after the delete and after the next
    holder of the id logged at the same `seq`s. The next conversation does not record the
    slow turn: its acknowledged turns stay, and the slow turn is refused."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    go, turn = await _owners_second_turn_in_flight(
        logger, AgentMessageLogger(backend.db), monkeypatch
    )
    await store.delete("c-x", user_id=OWNER)
    for number in range(2):
        said = [{"role": "user", "content": f"hello {number}"}]
        await logger.log_messages(
            "c-x", said, user_id=SOMEONE_ELSE, owner_only=True, turn_id=f"o{number}"
        )

    with pytest.raises(Conflict):
        await landing(go, turn)

    seen = [(m.seq, m.content) for m in await store.transcript("c-x")]
    assert seen == [(0, "hello 0"), (1, "hello 1")]


async def test_a_turn_id_the_next_conversation_uses_again_takes_the_place_of_the_late_one(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime numbering its turns ("t1", "t2", …) starts the id again: its "t2" derives the
    ids of the late messages of the deleted conversation's "t2", at the same `seq`s, with
    other content. The new conversation records its own "t2" there: they give way."""
    await _a_turn_applied_after_its_writer_gave_up_and_the_delete(backend, monkeypatch)
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)

    for turn_id, text in (("t1", "first"), ("t2", "second")):
        said = [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
        await logger.log_messages("c-x", said, user_id=SOMEONE_ELSE, turn_id=turn_id)

    seen = [(m.seq, m.content) for m in await store.transcript("c-x")]
    assert seen == [(0, "first"), (1, "ok"), (2, "second"), (3, "ok")]
    assert await backend.db.agent_messages.count_documents({"user_id": OWNER}) == 0


async def test_a_delete_during_a_claim_takes_the_messages_the_claim_has_not_moved_yet(
    backend: Backend,
) -> None:
    """A claim moves the conversation first, its messages after: a delete between the two
    finds messages naming the old owner. They are of turns the conversation recorded: the
    delete's last sweep takes them, and nothing of the deleted conversation stays readable."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=TurnRules(claim_grace=timedelta(seconds=0.05)))
    said = [{"role": "user", "content": "mine"}, {"role": "assistant", "content": "noted"}]
    await logger.log_messages("c-x", said, user_id=OWNER)
    await backend.db[CONVERSATIONS].update_one({"_id": "c-x"}, {"$set": {"user_id": NEW_OWNER}})

    deleted = await store.delete("c-x")

    assert deleted.messages == 2
    assert await backend.db.agent_messages.count_documents({"conversation_id": "c-x"}) == 0


async def test_a_deleted_conversations_late_message_is_served_by_no_read_of_the_new_one(
    backend: Backend,
) -> None:
    """A turn reserved before its conversation's delete inserts after it, while another
    user has started the conversation again under the id; until the delete's second sweep
    takes it, its message sits under the id with the deleted conversation's `epoch`. No
    read of the id serves it, a service's neither (RELIABILITY.md)."""
    from agent_store.store import MESSAGES

    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages("c-again", [{"role": "user", "content": "u2 new chat"}],
                              user_id="u-2", turn_id="t-1")  # fmt: skip
    [new] = await backend.db[MESSAGES].find({"conversation_id": "c-again"}).to_list(None)
    late = {**new, "_id": "msg-late", "seq": 1, "user_id": "u-1", "epoch": "deleted-epoch",
            "content": "U1 SECRET", "search_text": "U1 SECRET", "turn_id": "t-old"}  # fmt: skip
    await backend.db[MESSAGES].insert_one(late)

    streamed = [m async for batch in store.stream_transcript("c-again") for m in batch]
    reads = {
        "transcript": await store.transcript("c-again"),
        "stream_transcript": streamed,
        "recent_messages": await store.recent_messages("c-again"),
        "recent_messages(limit)": await store.recent_messages("c-again", limit=5),
        "messages_page": (await store.messages_page("c-again")).data,
        "messages_page(desc)": (await store.messages_page("c-again", order="desc")).data,
        "messages_by_seq": await store.messages_by_seq("c-again"),
        "messages_by_seq(limit)": await store.messages_by_seq("c-again", limit=5),
    }

    assert {name: [m.content for m in read] for name, read in reads.items()} == {
        name: ["u2 new chat"] for name in reads
    }


async def test_a_claim_moves_the_messages_an_assigning_turn_left_unowned_when_it_failed(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HANDED_TO's assigning turn stored its messages and failed before it moved the messages
    logged unowned before it; a claim of HANDED_TO then moves those too: every message of the
    conversation is CLAIMER's, as a conversation with an owner holds only its owner's."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=NO_GRACE)
    await logger.log_messages("c-un", [{"role": "user", "content": "first"}], turn_id="t1")

    async def lost(*_: Any) -> None:
        raise StorageUnavailable("the connection dropped")

    monkeypatch.setattr(logger, "_hand_over_earlier", lost)
    with pytest.raises(StorageUnavailable):
        await logger.log_messages("c-un", [{"role": "user", "content": "assigned"}],
                                  user_id=HANDED_TO, turn_id="t2")  # fmt: skip
    await store.claim(HANDED_TO, CLAIMER)

    seen = [m.content for m in await store.transcript("c-un", user_id=CLAIMER)]
    assert seen == ["first", "assigned"]
    owners = await backend.db["agent_messages"].distinct("user_id", {"conversation_id": "c-un"})
    assert owners == [CLAIMER]


async def test_a_claim_moves_the_messages_left_unowned_by_an_assigning_turn_whose_insert_was_lost(
    backend: Backend,
) -> None:
    """The same when the assigning turn's insert was lost too: no message names HANDED_TO,
    yet the conversation is HANDED_TO's, and the claim makes its earlier messages CLAIMER's."""
    logger = AgentMessageLogger(backend.db)
    store = ConversationStore(backend.db, rules=NO_GRACE)
    await logger.log_messages("c-un", [{"role": "user", "content": "first"}], turn_id="t1")
    dying = AgentMessageLogger(backend.db)
    real = dying._messages

    class Lost:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        async def insert_many(self, *_: Any, **__: Any) -> Any:
            raise StorageUnavailable("the insert was lost")

    dying._messages = Lost()
    with pytest.raises(StorageUnavailable):
        await dying.log_messages("c-un", [{"role": "user", "content": "assigned"}],
                                 user_id=HANDED_TO, turn_id="t2")  # fmt: skip
    await store.claim(HANDED_TO, CLAIMER)

    seen = [m.content for m in await store.transcript("c-un", user_id=CLAIMER)]
    assert seen == ["first"]


async def test_a_claim_hands_over_no_late_message_of_a_deleted_life_of_the_id(
    backend: Backend,
) -> None:
    """An unowned message of a conversation deleted under the id, landing late (after the
    delete's last sweep), is not the new life's: the claim leaves it unowned, unread."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db, rules=NO_GRACE)
    await logger.log_messages("cx", [{"role": "user", "content": "old life"}], turn_id="o0")
    late = await backend.db[MESSAGES].find_one({"conversation_id": "cx"})
    assert late is not None
    await store.delete("cx")
    await backend.db[MESSAGES].insert_one({**late, "_id": "late-old", "seq": 5})
    await logger.log_messages("cx", [{"role": "user", "content": "new life"}], turn_id="n0")
    await logger.log_messages("cx", [{"role": "assistant", "content": "for A"}],
                              turn_id="n1", user_id=HANDED_TO)  # fmt: skip

    claimed = await store.claim(HANDED_TO, CLAIMER)

    read = [m.content for m in await store.messages_by_seq("cx", start=0, user_id=CLAIMER)]
    assert read == ["new life", "for A"]
    assert claimed.messages == 2
    assert (await backend.db[MESSAGES].find_one({"_id": "late-old"}) or {}).get("user_id") is None


LATE_TEXT = [
    {"role": "user", "content": "my card number is zanzibar 4111"},
    {"role": "assistant", "content": "noted zanzibar"},
]
LATE_USER = "user-late"


async def _a_late_insert_after(
    backend: Backend, removal: Callable[[ConversationStore], Awaitable[Any]]
) -> ConversationStore:
    """LATE_USER's conversation "c-late": its second turn reserved before `removal` and its
    insert applied by the server only after the removal returned (after its last sweep), the
    writer gone, never retrying. Set up as the server ends: the turn's messages, as its insert
    wrote them (the removed conversation's epoch, naming LATE_USER), stand under the id."""
    logger = AgentMessageLogger(backend.db)
    await logger.ensure_indexes()
    await logger.log_messages("c-late", [{"role": "user", "content": "alpha"}],
                              user_id=LATE_USER, turn_id="t0")  # fmt: skip
    await logger.log_messages("c-late", LATE_TEXT, user_id=LATE_USER, turn_id="t1")
    landed = await backend.db[MESSAGES].find({"turn_id": "t1"}).to_list(None)
    await backend.db[MESSAGES].delete_many({"turn_id": "t1"})  # reserved, not inserted yet
    store = ConversationStore(backend.db, rules=NO_GRACE)
    await removal(store)
    await backend.db[MESSAGES].insert_many(landed)  # the late insert
    return store


@pytest.mark.parametrize("removal", ["delete", "erase_user"])
async def test_search_serves_no_message_a_late_insert_left_of_a_removed_conversation(
    backend: Backend, removal: str
) -> None:
    """A deleted (or erased) conversation's text is never found again by its owner's search,
    through the library or the API, whatever insert of it reached the server late."""
    backend.skip_if_lacking("text_search")

    async def remove(store: ConversationStore) -> Any:
        if removal == "delete":
            return await store.delete("c-late", user_id=LATE_USER)
        return await store.erase_user(LATE_USER)

    store = await _a_late_insert_after(backend, remove)

    assert await store.search("zanzibar", user_id=LATE_USER) == []
    async with serve(backend.db, seeded=False) as api:
        found = await api.http.get(
            "/v1/search", params={"q": "zanzibar"}, headers=auth_headers(user=LATE_USER)
        )
    assert (found.status_code, found.json()["data"]) == (200, [])


async def test_deleting_again_removes_what_a_late_insert_left_of_a_deleted_conversation(
    backend: Backend,
) -> None:
    """The conversation is gone, its late messages are not: deleting its id again removes them
    (the owner's, of an epoch no conversation under the id has), and a third time finds
    nothing."""
    store = await _a_late_insert_after(
        backend, lambda store: store.delete("c-late", user_id=LATE_USER)
    )

    again = await store.delete("c-late", user_id=LATE_USER)

    assert (again.conversations, again.messages) == (0, 2)
    assert await backend.db[MESSAGES].count_documents({"conversation_id": "c-late"}) == 0
    with pytest.raises(NotFound):
        await store.delete("c-late", user_id=LATE_USER)


async def test_search_by_the_guest_id_serves_no_message_of_a_conversation_claimed_since(
    backend: Backend,
) -> None:
    """A guest's turn reserved before the claim of the guest's account lands after the claim's
    last sweep, naming the guest: the guest id's search does not find it (the conversation is
    the new owner's)."""
    backend.skip_if_lacking("text_search")
    store = await _a_late_insert_after(backend, lambda store: store.claim(LATE_USER, NEW_OWNER))

    assert await store.search("zanzibar", user_id=LATE_USER) == []


async def test_a_repeated_claim_moves_what_a_late_insert_left_under_the_guest_id(
    backend: Backend,
) -> None:
    """The guest's late messages land after the claim's last sweep, its writer gone: they keep
    the guest id, a hole in the new owner's transcript, until the claim is run again, which
    moves them."""
    store = await _a_late_insert_after(backend, lambda store: store.claim(LATE_USER, NEW_OWNER))
    before = await store.transcript("c-late", user_id=NEW_OWNER)

    again = await store.claim(LATE_USER, NEW_OWNER)

    assert [m.seq for m in before] == [0]
    assert again.messages == 2
    after = await store.transcript("c-late", user_id=NEW_OWNER)
    assert [m.content for m in after] == ["alpha", *(m["content"] for m in LATE_TEXT)]


async def test_an_erasure_leaves_whole_the_conversation_its_user_started_again_under_an_erased_id(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the erasure's first read and its mark, OWNER deletes "c-x" and starts it again:
    that conversation is not the erasure's and keeps its document and every message (was: its
    messages deleted, its document left counting them)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db, rules=NO_GRACE)
    await logger.log_messages("c-x", _a_turn("old"), user_id=OWNER, turn_id="old")
    await logger.log_messages("c-y", _a_turn("other"), user_id=OWNER, turn_id="other")
    record = store._deletions.record

    async def started_again_then_record(found: Any, user_id: str | None) -> Any:
        await ConversationStore(backend.db).delete("c-x", user_id=OWNER)
        await logger.log_messages("c-x", _a_turn("new"), user_id=OWNER, turn_id="new")
        return await record(found, user_id)

    monkeypatch.setattr(store._deletions, "record", started_again_then_record)

    erased = await store.erase_user(OWNER)

    seen = [m.content for m in await store.transcript("c-x", user_id=OWNER)]
    assert seen == ["q new", "a new"]
    assert (await store.get_conversation("c-x", user_id=OWNER)).message_count == 2
    assert await backend.db.agent_messages.count_documents({"conversation_id": "c-y"}) == 0
    assert (erased.conversations, erased.messages) == (1, 2)


CLAIMED_MID_DELETE = ["erasure", "user's delete", "user's delete of the version read", "service's"]


@pytest.mark.parametrize("deletion", CLAIMED_MID_DELETE)
async def test_a_claim_landing_before_a_deletions_mark_leaves_the_new_owner_a_usable_conversation(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, deletion: str
) -> None:
    """OWNER's conversation is claimed by "user-bob" between a deletion's first read and its
    mark: the mark takes only the owner the deletion read, so the conversation is not the
    erasure's nor the user's delete's (bob keeps it, readable and writable); a service's delete
    deletes the conversation it found, bob's now (was: bob's conversation marked for good, no
    record left). The user's delete answers as one after the claim does: NotFound, another
    user's conversation (was: `conversations: 0`, read as "deleted" while it stands)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db, rules=NO_GRACE)
    await logger.log_messages("c-x", _a_turn("old"), user_id=OWNER, turn_id="old")
    version = (await store.get_conversation("c-x", user_id=OWNER)).version
    record = store._deletions.record

    async def claimed_then_record(found: Any, user_id: str | None) -> Any:
        if user_id == OWNER:
            await ConversationStore(backend.db, rules=NO_GRACE).claim(OWNER, "user-bob")
        return await record(found, user_id)

    monkeypatch.setattr(store._deletions, "record", claimed_then_record)

    if deletion == "erasure":
        erased = await store.erase_user(OWNER)
        assert (erased.conversations, erased.messages) == (0, 0)
    elif deletion.startswith("user's delete"):
        read = version if deletion.endswith("read") else None
        with pytest.raises(NotFound, match="'c-x'"):
            await store.delete("c-x", user_id=OWNER, version=read)
    else:
        deleted = await store.delete("c-x")
        assert (deleted.conversations, deleted.messages) == (1, 2)
        assert await backend.db.agent_messages.count_documents({}) == 0
        assert await backend.db.agent_conversations.count_documents({}) == 0
        return
    await logger.log_messages("c-x", _a_turn("bob"), user_id="user-bob", turn_id="bob")
    conversation = await store.get_conversation("c-x", user_id="user-bob")
    assert (conversation.user_id, conversation.message_count) == ("user-bob", 4)
    assert await backend.db.agent_deletions.count_documents({}) == 0


@pytest.mark.parametrize("claim", ["still moving", "failed half-way"])
async def test_erasing_the_old_id_of_a_claim_not_done_moving_hands_its_messages_to_the_new_owner(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, claim: str
) -> None:
    """The claim moved OWNER's conversation to NEW_OWNER but not yet its messages (still
    moving, or its connection dropped there) when OWNER, the old id, is erased: the messages in
    NEW_OWNER's conversation are NEW_OWNER's, so the erasure finishes the claim's move instead
    of deleting them (was: NEW_OWNER's conversation counting 2 messages and holding none)."""
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db, rules=NO_GRACE)
    await logger.log_messages("c-x", _a_turn("guest"), user_id=OWNER, turn_id="guest")
    claimer = ConversationStore(backend.db, rules=NO_GRACE)
    move = claimer._move_claimed_messages

    async def erased_then_moved(from_user_id: str, to_user_id: str) -> int:
        if claim == "failed half-way":
            raise StorageUnavailable("the connection dropped (injected)")
        await store.erase_user(OWNER)
        return await move(from_user_id, to_user_id)

    monkeypatch.setattr(claimer, "_move_claimed_messages", erased_then_moved)
    if claim == "failed half-way":
        with pytest.raises(StorageUnavailable):
            await claimer.claim(OWNER, NEW_OWNER)
        await store.erase_user(OWNER)
    else:
        await claimer.claim(OWNER, NEW_OWNER)

    seen = await store.transcript("c-x", user_id=NEW_OWNER)
    assert [(m.content, m.user_id) for m in seen] == [
        ("q guest", NEW_OWNER),
        ("a guest", NEW_OWNER),
    ]
    assert await backend.db[MESSAGES].count_documents({"user_id": OWNER}) == 0


async def _claimed_with_the_new_id_erased_between_the_moves(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, claim: str, erasure: ConversationStore
) -> Any:
    """OWNER's conversation "c-x" is claimed by NEW_OWNER, and NEW_OWNER erased by `erasure`
    once the claim moved the conversation, before it moved its messages and checkpoints
    (still moving, or its connection dropped there): the erasure's answer."""
    claimer = ConversationStore(backend.db, rules=NO_GRACE)
    move, erased = claimer._move_claimed_messages, []

    async def erased_then_moved(from_user_id: str, to_user_id: str) -> int:
        if claim == "failed half-way":
            raise StorageUnavailable("the connection dropped (injected)")
        erased.append(await erasure.erase_user(to_user_id))
        return await move(from_user_id, to_user_id)

    monkeypatch.setattr(claimer, "_move_claimed_messages", erased_then_moved)
    if claim == "failed half-way":
        with pytest.raises(StorageUnavailable):
            await claimer.claim(OWNER, NEW_OWNER)
        return await erasure.erase_user(NEW_OWNER)
    await claimer.claim(OWNER, NEW_OWNER)
    return erased[0]


async def _a_checkpoint_of(backend: Backend, conversation_id: str, user_id: str) -> None:
    """A checkpoint of the conversation under the id, written for `user_id`, naming the
    conversation as the LangGraph saver does (`ThreadLife.marks`)."""
    found = await backend.db[CONVERSATIONS].find_one({"_id": conversation_id})
    await backend.db[LANGGRAPH_CHECKPOINTS].insert_one(
        {"_id": f"{conversation_id}/{user_id}", "thread_id": conversation_id,
         **ThreadLife.of(found).marks(), "user_id": user_id}
    )  # fmt: skip


async def _nothing_is_left_of(backend: Backend, conversation_id: str) -> None:
    """No message or checkpoint under the id, and whoever starts it again finds none."""
    assert await backend.db[MESSAGES].count_documents({"conversation_id": conversation_id}) == 0
    beside = backend.db[LANGGRAPH_CHECKPOINTS]
    assert await beside.count_documents({"thread_id": conversation_id}) == 0
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(conversation_id, _a_turn("new"), user_id=SOMEONE_ELSE, turn_id="n")
    seen = await ConversationStore(backend.db).transcript(conversation_id, user_id=SOMEONE_ELSE)
    assert [m.content for m in seen] == ["q new", "a new"]


@pytest.mark.parametrize("claim", ["still moving", "failed half-way"])
async def test_erasing_the_new_id_of_a_claim_not_done_moving_leaves_nothing_of_its_conversations(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, claim: str
) -> None:
    """The claim moved OWNER's conversation to NEW_OWNER but not yet its messages and
    checkpoints, which name OWNER, when NEW_OWNER is erased: every message and checkpoint of
    the erased conversation's life goes, whatever user it names, and the erasure counts them
    (was: `messages=0`, the messages and checkpoints left for good with no conversation, the
    claim finding no conversation of NEW_OWNER's to move them into)."""
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages("c-x", _a_turn("guest"), user_id=OWNER, turn_id="guest")
    await _a_checkpoint_of(backend, "c-x", OWNER)

    erasure = ConversationStore(backend.db, rules=NO_GRACE)
    erased = await _claimed_with_the_new_id_erased_between_the_moves(
        backend, monkeypatch, claim, erasure
    )

    assert (erased.conversations, erased.messages) == (1, 2)
    await _nothing_is_left_of(backend, "c-x")


async def test_the_erasures_last_sweep_takes_a_late_insert_of_the_old_id_in_a_claimed_conversation(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, a turn of OWNER's reserved before the claim inserting only after the
    erasure deleted the conversation's messages (during its wait): its last sweep,
    `claim_grace` later, takes it too, whatever user it names, and counts it (was: left,
    naming OWNER, with no conversation)."""
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages("c-x", _a_turn("first"), user_id=OWNER, turn_id="first")
    await logger.log_messages("c-x", _a_turn("slow"), user_id=OWNER, turn_id="slow")
    landed = await backend.db[MESSAGES].find({"turn_id": "slow"}).to_list(None)
    await backend.db[MESSAGES].delete_many({"turn_id": "slow"})  # reserved, not inserted yet
    erasure = ConversationStore(backend.db, rules=NO_GRACE)
    grace = erasure._grace

    async def the_late_insert_lands() -> None:
        await backend.db[MESSAGES].insert_many(landed)
        await grace()

    monkeypatch.setattr(erasure, "_grace", the_late_insert_lands)

    erased = await _claimed_with_the_new_id_erased_between_the_moves(
        backend, monkeypatch, "still moving", erasure
    )

    assert (erased.conversations, erased.messages) == (1, 4)
    await _nothing_is_left_of(backend, "c-x")


@pytest.mark.parametrize("deleter", [NEW_OWNER, None], ids=["the new owner's token", "a service"])
async def test_a_delete_between_a_claims_moves_takes_the_turns_its_records_no_longer_keep(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, deleter: str | None
) -> None:
    """The claim moved OWNER's conversation, three turns long, to NEW_OWNER but not yet its
    messages and checkpoints when it is deleted, its records keeping the last turn only
    (`turns_recorded=1`): every message and checkpoint of the conversation's life goes,
    whatever user it names, not only the messages of the turns it recorded (was: the first two
    turns and the checkpoint left under OWNER, with no conversation)."""
    rules = TurnRules(claim_grace=timedelta(0), turns_recorded=1)
    logger = AgentMessageLogger(backend.db, rules=rules)
    for turn in ("one", "two", "three"):
        await logger.log_messages("c-x", _a_turn(turn), user_id=OWNER, turn_id=turn)
    await _a_checkpoint_of(backend, "c-x", OWNER)
    claimer = ConversationStore(backend.db, rules=rules)
    move, deleted = claimer._move_claimed_messages, []

    async def deleted_then_moved(from_user_id: str, to_user_id: str) -> int:
        if not deleted:
            store = ConversationStore(backend.db, rules=rules)
            deleted.append(await store.delete("c-x", user_id=deleter))
        return await move(from_user_id, to_user_id)

    monkeypatch.setattr(claimer, "_move_claimed_messages", deleted_then_moved)
    await claimer.claim(OWNER, NEW_OWNER)

    assert (deleted[0].conversations, deleted[0].messages) == (1, 6)
    await _nothing_is_left_of(backend, "c-x")
