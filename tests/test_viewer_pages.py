"""The viewer starts somewhere: recent conversations, searches, paged transcripts, forks."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from bson import ObjectId
from markupsafe import escape
from pymongo.errors import AutoReconnect, OperationFailure

from agent_store.core import AgentMessage, StorageUnavailable, Unsupported
from agent_store.legacy import LEGACY_TURNS, convert
from agent_store.store import CONVERSATIONS, MESSAGES, storage_errors
from app import presentation, viewer
from app.demo import OTHER_USER_ID
from app.viewer import CONVERSATIONS_PER_PAGE, MESSAGES_PER_PAGE, NO_TEXT_INDEX, PAGE_SHOWS
from tests.api_harness import (
    OWNER,
    OWNER_CONVERSATION,
    OWNER_HITL_CONVERSATION,
    SERVICE_TOKEN,
    Served,
    api_settings,
    mongomock_db,
    serve,
)
from tests.conftest import Backend

SAME_ORIGIN = {"Origin": "http://test"}


async def signed_in(api: Served) -> httpx.AsyncClient:
    response = await api.http.post(
        "/viewer/login", data={"token": SERVICE_TOKEN}, headers=SAME_ORIGIN
    )
    assert response.status_code == 303
    return api.http


@pytest.fixture
async def api() -> AsyncIterator[Served]:
    async with serve(mongomock_db(), api_settings(max_message_bytes=4096)) as served:
        await signed_in(served)
        yield served


def rows(html: str) -> list[str]:
    return re.findall(r'<tr data-conversation="([^"]+)"', html)


def legacy_links(html: str) -> set[str]:
    return set(re.findall(r'href="/viewer/conversations/([^"/]+)/legacy"', html))


def seqs(html: str) -> list[int]:
    return [
        int(seq) for seq in re.findall(r'<article class="message[^"]*"[^>]*data-seq="(\d+)"', html)
    ]


async def test_the_landing_page_lists_every_users_recent_conversations(api: Served) -> None:
    page = await api.http.get("/viewer")
    assert page.status_code == 200
    listed = rows(page.text)
    assert OWNER_CONVERSATION in listed
    assert OWNER_HITL_CONVERSATION in listed
    assert f'href="/viewer/users/{OTHER_USER_ID}"' in page.text  # another user's, with its owner
    assert 'id="user_id"' in page.text  # find a user
    assert 'action="/viewer/search"' in page.text  # search messages


async def test_recent_conversations_come_in_pages_most_recent_first(api: Served) -> None:
    for n in range(CONVERSATIONS_PER_PAGE + 5):
        await api.store.logger.log_messages(
            f"conv-many-{n:02d}", [{"role": "user", "content": f"hello {n}"}], user_id="user-many"
        )
    first = await api.http.get("/viewer")
    listed = rows(first.text)
    assert len(listed) == CONVERSATIONS_PER_PAGE
    newest = [f"conv-many-{n:02d}" for n in range(CONVERSATIONS_PER_PAGE + 4, 4, -1)]
    assert listed == newest  # the last logged first
    cursor = re.search(r'href="\?cursor=([^"]+)"', first.text)
    assert cursor, "no link to older conversations"
    second = await api.http.get(f"/viewer?cursor={cursor.group(1)}")
    older = rows(second.text)
    assert older[:5] == [f"conv-many-{n:02d}" for n in range(4, -1, -1)]
    assert not set(older) & set(listed)
    assert 'href="/viewer">' in second.text  # back to the most recent


async def test_the_legacy_link_shows_only_where_legacy_turns_exist(api: Served) -> None:
    for url in ("/viewer", f"/viewer/users/{OWNER}"):
        page = await api.http.get(url)
        assert legacy_links(page.text) == {OWNER_CONVERSATION}, url
    with_legacy = await api.http.get(f"/viewer/conversations/{OWNER_CONVERSATION}")
    assert "compare with legacy turns" in with_legacy.text
    without = await api.http.get(f"/viewer/conversations/{OWNER_HITL_CONVERSATION}")
    assert "compare with legacy turns" not in without.text


async def test_a_long_transcript_is_paged_by_seq(api: Served) -> None:
    total = 2 * MESSAGES_PER_PAGE + 50
    messages = [{"role": "user", "content": f"message {n}"} for n in range(total)]
    await api.store.logger.log_messages("conv-long", messages, user_id=OWNER, turn_id="t-long")
    first = await api.http.get("/viewer/conversations/conv-long")
    assert seqs(first.text) == list(range(MESSAGES_PER_PAGE))
    assert 'rel="prev"' not in first.text
    later = re.search(r'rel="next" href="([^"]+)"', first.text)
    assert later
    assert later.group(1).endswith(f"?from_seq={MESSAGES_PER_PAGE}")
    second = await api.http.get(later.group(1))
    assert seqs(second.text) == list(range(MESSAGES_PER_PAGE, 2 * MESSAGES_PER_PAGE))
    assert re.search(r'rel="prev" href="[^"]+\?from_seq=0"', second.text)
    last = await api.http.get(f"/viewer/conversations/conv-long?from_seq={2 * MESSAGES_PER_PAGE}")
    assert seqs(last.text) == list(range(2 * MESSAGES_PER_PAGE, total))
    assert 'rel="next"' not in last.text
    bad = await api.http.get("/viewer/conversations/conv-long?from_seq=-1")
    assert bad.status_code == 422
    assert "from_seq" in bad.text


async def log_megabytes(api: Served, conversation_id: str, text: str, count: int) -> None:
    """`count` messages of `text` (about 1 MB, within the default `max_message_bytes`), as a
    user's turns of ten messages may log them."""
    for first in range(0, count, 10):
        turn = [{"role": "user", "content": text}] * min(10, count - first)
        await api.store.logger.log_messages(
            conversation_id, turn, user_id=OWNER, turn_id=f"t-{first}"
        )


async def test_a_transcript_page_of_messages_larger_than_a_page_shows_one_cut_and_moves_on() -> (
    None
):
    """A page shows what fits in about `PAGE_SHOWS` characters as it prints them (a control
    as its six-character escape), one message at least: a page of messages of 1 MB of
    controls each is one message, cut to fit with a note saying where it is served whole, and
    a link to the next; it is a few MiB whatever the conversation holds (it was 100 messages,
    572 MiB)."""
    async with serve(mongomock_db(), seeded=False) as api:
        await signed_in(api)
        await log_megabytes(api, "conv-hidden", "\x01" * 1_000_000, MESSAGES_PER_PAGE)
        page = await api.http.get("/viewer/conversations/conv-hidden")
        assert page.status_code == 200
        assert len(page.content) <= PAGE_SHOWS + 64 * 1024
        assert seqs(page.text) == [0]
        whole = re.search(r"Shown cut to fit the page: it prints ([\d,]+) bytes whole", page.text)
        assert whole
        assert int(whole.group(1).replace(",", "")) >= 6_000_000
        assert "<code>GET /v1/conversations/conv-hidden/transcript</code>" in page.text
        later = re.search(r'rel="next" href="([^"]+)"', page.text)
        assert later
        assert later.group(1) == "/viewer/conversations/conv-hidden?from_seq=1"
        second = await api.http.get(later.group(1))
        assert seqs(second.text) == [1]


@pytest.mark.parametrize("character", ["<", "&", "\u00e9", "\U0001f600"])
async def test_a_transcript_page_is_bounded_by_the_bytes_it_prints(character: str) -> None:
    """What a page prints is counted as served: markup escaped (`&lt;`), in UTF-8 (two to
    four bytes a character), so no text makes a page more than about `PAGE_SHOWS` bytes."""
    async with serve(mongomock_db(), seeded=False) as api:
        await signed_in(api)
        await log_megabytes(api, "conv-wide", character * 250_000, 10)
        page = await api.http.get("/viewer/conversations/conv-wide")
        assert page.status_code == 200
        assert len(page.content) <= PAGE_SHOWS + 64 * 1024
        assert 'rel="next"' in page.text


async def test_the_whole_texts_a_full_page_reads_are_bounded_by_what_it_can_show(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Messages stored cut (`max_message_bytes` 16 KiB) whose whole texts are 1 MB each: a
    page shows all twenty cut, and `?full=true` reads back from GridFS the whole texts of only
    as many as about `PAGE_SHOWS` characters hold (the first whatever its size), never every
    message the page listed (it read 20 MB to show 4 MiB)."""
    async with serve(mongomock_db(), api_settings(max_message_bytes=16_384), seeded=False) as api:
        await signed_in(api)
        await log_megabytes(api, "conv-kept", "w" * 1_000_000, 20)
        read: list[int] = []
        restore = api.store.conversations.with_full_texts

        async def counted(messages: list[AgentMessage]) -> list[AgentMessage]:
            restored = await restore(messages)
            read.extend(len(m.content or "") for m in restored)
            return restored

        monkeypatch.setattr(api.store.conversations, "with_full_texts", counted)
        assert seqs((await api.http.get("/viewer/conversations/conv-kept")).text) == [*range(20)]
        full = await api.http.get("/viewer/conversations/conv-kept?full=true")

        assert full.status_code == 200
        assert seqs(full.text) == [0, 1, 2, 3]
        assert sum(read) <= PAGE_SHOWS + 1_000_000


async def test_show_the_full_text_opens_a_page_holding_the_message_it_is_under() -> None:
    """A message's "show the full text" link opens the full page at that message (its page
    may show fewer messages, their whole texts larger), never at the first of the page it is
    on, which may end before it."""
    async with serve(mongomock_db(), api_settings(max_message_bytes=16_384), seeded=False) as api:
        await signed_in(api)
        await log_megabytes(api, "conv-kept", "w" * 2_000_000, 10)
        page = await api.http.get("/viewer/conversations/conv-kept")
        links = re.findall(r'href="([^"]+)">show the full text', page.text)
        assert len(links) == 10

        full = await api.http.get(links[7].replace("&amp;", "&"))

        assert seqs(full.text)[0] == 7
        assert "w" * 2_000_000 in full.text


async def test_a_transcript_page_ends_where_its_messages_fill_it_and_the_next_starts_there() -> (
    None
):
    """Messages of 1 MB of plain text: four fill a page (about 4 MiB), the next page starts at
    the fifth, and no message is cut or left out between the pages."""
    async with serve(mongomock_db(), seeded=False) as api:
        await signed_in(api)
        await log_megabytes(api, "conv-large", "a" * 1_000_000, 10)
        first = await api.http.get("/viewer/conversations/conv-large")
        assert seqs(first.text) == [0, 1, 2, 3]
        assert "Shown cut" not in first.text
        later = re.search(r'rel="next" href="([^"]+)"', first.text)
        assert later
        second = await api.http.get(later.group(1))
        assert seqs(second.text) == [4, 5, 6, 7]
        assert len(second.content) <= PAGE_SHOWS + 64 * 1024


async def test_a_short_transcript_has_no_pages(api: Served) -> None:
    page = await api.http.get(f"/viewer/conversations/{OWNER_CONVERSATION}")
    assert len(seqs(page.text)) == 12
    assert 'aria-label="Pages"' not in page.text


async def test_a_truncated_field_offers_its_full_text_where_the_store_kept_it(api: Served) -> None:
    whole = "word " * 3000  # over max_message_bytes (4096): stored cut, kept whole aside
    await api.store.logger.log_messages(
        "conv-cut", [{"role": "user", "content": whole}], user_id=OWNER, turn_id="t-cut"
    )
    cut = await api.http.get("/viewer/conversations/conv-cut")
    assert "Truncated: content" in cut.text
    link = re.search(r'href="([^"]+full=true[^"]*)">show the full text', cut.text)
    assert link, cut.text
    full = await api.http.get(link.group(1).replace("&amp;", "&"))
    assert whole.strip() in full.text
    assert "show the full text" not in full.text


def fork_form(html: str, seq: int) -> dict[str, str]:
    """The fields of the "Continue from here" form of the message at `seq`, as rendered."""
    forms = re.findall(r'<form class="fork".*?</form>', html, re.DOTALL)
    for form in forms:
        fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form))
        if fields.get("at_seq") == str(seq):
            return fields
    raise AssertionError(f"no fork form at seq {seq}")


async def test_continue_from_here_forks_the_conversation_at_that_message(api: Served) -> None:
    page = await api.http.get(f"/viewer/conversations/{OWNER_CONVERSATION}")
    assert page.text.count("Continue from here") == 12
    forked = await api.http.post(
        f"/viewer/conversations/{OWNER_CONVERSATION}/forks",
        data=fork_form(page.text, 3),
        headers=SAME_ORIGIN,
    )
    assert forked.status_code == 303
    new_id = forked.headers["location"].removeprefix("/viewer/conversations/")
    assert new_id != OWNER_CONVERSATION
    copy = await api.store.conversations.get_conversation(new_id)
    assert copy.user_id == OWNER  # the fork keeps the owner
    assert copy.forked_from is not None
    assert (copy.forked_from.conversation_id, copy.message_count) == (OWNER_CONVERSATION, 4)
    shown = await api.http.get(forked.headers["location"])
    assert "Continued from" in shown.text
    assert seqs(shown.text) == [0, 1, 2, 3]


async def test_continue_from_here_forks_no_conversation_started_again_under_the_id_since(
    api: Served,
) -> None:
    """A form rendered from one conversation, sent once it was deleted and another started
    under its id (another user's): refused as the page's conversation is no longer there
    (412, read the page again); nothing forked from the new one."""
    page = await api.http.get(f"/viewer/conversations/{OWNER_CONVERSATION}")
    form = fork_form(page.text, 3)
    await api.store.conversations.delete(OWNER_CONVERSATION)
    for n in range(3):
        said = [{"role": "user", "content": f"L2 {n}"}, {"role": "assistant", "content": "ok"}]
        await api.store.logger.log_messages(OWNER_CONVERSATION, said, user_id=OTHER_USER_ID)

    refused = await api.http.post(
        f"/viewer/conversations/{OWNER_CONVERSATION}/forks", data=form, headers=SAME_ORIGIN
    )

    assert refused.status_code == 412, refused.text
    assert "started again" in refused.text
    forks = {"forked_from.conversation_id": OWNER_CONVERSATION}
    assert await api.db[CONVERSATIONS].count_documents(forks) == 0


async def test_a_resubmitted_continue_from_here_retries_the_same_fork(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rendering of a transcript draws the id its forms fork into: a form sent again after
    its fork failed (the insert of its copies lost) retries that fork, which is then made whole,
    rather than making another; until then the half-made fork is shown nowhere."""
    page = await api.http.get(f"/viewer/conversations/{OWNER_CONVERSATION}")
    form = fork_form(page.text, 3)
    again = await api.http.get(f"/viewer/conversations/{OWNER_CONVERSATION}")
    assert fork_form(again.text, 3)["new_conversation_id"] != form["new_conversation_id"]
    assert fork_form(page.text, 5)["new_conversation_id"] != form["new_conversation_id"]
    messages = api.store.logger._messages
    insert_many = messages.insert_many

    async def lost(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(messages, "insert_many", insert_many)
        raise AutoReconnect("connection reset (injected)")

    monkeypatch.setattr(messages, "insert_many", lost)
    url = f"/viewer/conversations/{OWNER_CONVERSATION}/forks"
    failed = await api.http.post(url, data=form, headers=SAME_ORIGIN)
    assert failed.status_code == 503
    listed = await api.http.get(f"/viewer/users/{OWNER}")
    assert form["new_conversation_id"] not in rows(listed.text)

    retried = await api.http.post(url, data=form, headers=SAME_ORIGIN)

    assert retried.status_code == 303
    assert retried.headers["location"] == f"/viewer/conversations/{form['new_conversation_id']}"
    shown = await api.http.get(retried.headers["location"])
    assert seqs(shown.text) == [0, 1, 2, 3]
    listed = await api.http.get(f"/viewer/users/{OWNER}")
    assert form["new_conversation_id"] in rows(listed.text)
    forks = {"forked_from.conversation_id": OWNER_CONVERSATION}
    assert await api.db[CONVERSATIONS].count_documents(forks) == 1


@pytest.mark.parametrize(
    ("headers", "form"),
    [
        pytest.param({"Origin": "https://evil.example"}, {"at_seq": "3"}, id="another-site"),
        pytest.param(SAME_ORIGIN, {"at_seq": "3"}, id="no-new-conversation-id"),
        pytest.param(SAME_ORIGIN, {"at_seq": "3", "new_conversation_id": "a b"}, id="bad-new-id"),
        pytest.param(SAME_ORIGIN, {"at_seq": "three"}, id="not-a-seq"),
        # `"²".isdigit()` holds, and int() refuses it; int() reads "٣" as 3
        pytest.param(SAME_ORIGIN, {"at_seq": "\u00b2"}, id="superscript-two"),
        pytest.param(SAME_ORIGIN, {"at_seq": "\u0663"}, id="arabic-indic-three"),
    ],
)
async def test_a_fork_from_elsewhere_or_without_a_seq_writes_nothing(
    api: Served, headers: dict[str, str], form: dict[str, str]
) -> None:
    before = await api.digest()
    response = await api.http.post(
        f"/viewer/conversations/{OWNER_CONVERSATION}/forks", data=form, headers=headers
    )
    assert response.status_code in (403, 422)
    assert await api.digest() == before


@pytest.mark.parametrize(
    "written", ["\u00b2", "\u00b3", "\u0661\u0662", "\uff11", "1e3", "+1", " 1", "1" * 19]
)
async def test_a_transcript_page_starts_at_a_seq_written_in_ascii_digits(
    api: Served, written: str
) -> None:
    """`from_seq` is 0-9 only, as every number the service reads from text: a superscript,
    another script's digits or an exponent is refused with 422 naming it, never a 500."""
    page = await api.http.get(
        f"/viewer/conversations/{OWNER_CONVERSATION}", params={"from_seq": written}
    )
    assert page.status_code == 422, page.text[:300]
    assert "from_seq" in page.text


async def test_a_fork_needs_a_session(api: Served) -> None:
    api.http.cookies.clear()
    response = await api.http.post(
        f"/viewer/conversations/{OWNER_CONVERSATION}/forks",
        data={"at_seq": "3"},
        headers=SAME_ORIGIN,
    )
    assert (response.status_code, response.headers["location"]) == (303, "/viewer/login")


async def search_page(api: Served, **query: str) -> httpx.Response:
    return await api.http.get("/viewer/search", params=query)


async def test_full_text_search_lists_the_matching_messages(backend: Backend) -> None:
    backend.skip_if_lacking("text_search")
    async with serve(backend.db) as api:
        await signed_in(api)
        response = await search_page(api, q="Paris", user_id=OWNER)
    assert response.status_code == 200, response.text
    hits = re.findall(
        r'<li class="hit" data-conversation="([^"]+)" data-seq="(\d+)"', response.text
    )
    assert hits
    assert {conversation for conversation, _ in hits} == {OWNER_CONVERSATION}
    assert "Paris" in response.text
    assert f"?from_seq={hits[0][1]}#seq-{hits[0][1]}" in response.text


async def test_a_database_without_a_text_index_gets_a_clear_note(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_text_index(**_: object) -> Unsupported:
        try:
            with storage_errors("search messages"):
                raise OperationFailure("text index required for $text query", code=27)
        except Unsupported as exc:
            return exc
        raise AssertionError("storage_errors did not translate IndexNotFound")

    async def search(*args: object, **kwargs: object) -> None:
        raise no_text_index()

    monkeypatch.setattr(api.store.conversations, "search", search)
    response = await search_page(api, q="Paris", user_id=OWNER)
    assert response.status_code == 501
    assert str(escape(NO_TEXT_INDEX)) in response.text


@pytest.mark.parametrize(
    ("query", "status", "says"),
    [
        pytest.param({"q": "Paris"}, 200, "Type words to find", id="no-user"),
        pytest.param({"q": "-paris", "user_id": OWNER}, 422, "at least one word", id="excluded"),
        pytest.param({"q": "x", "user_id": "not a user"}, 422, "user_id", id="bad-user"),
    ],
)
async def test_a_search_that_cannot_run_says_what_is_missing(
    api: Served, query: dict[str, Any], status: int, says: str
) -> None:
    response = await search_page(api, **query)
    assert response.status_code == status, response.text
    assert says in response.text


# -- conversations not migrated yet, and those migrated under another id ----------------------

T0 = datetime(2024, 1, 1, tzinfo=UTC)


def legacy_turns(
    conversation_id: Any, count: int, user_id: str = "user-old"
) -> list[dict[str, Any]]:
    """`count` legacy turns of one question and one answer each: `2 * count` messages."""
    return [
        {
            "_id": f"lt-{n:03d}",
            "conversation_id": conversation_id,
            "user_id": user_id,
            "created_at": T0 + timedelta(minutes=n),
            "user_message": f"legacy question {n}",
            "response_parts": [{"part_kind": "text", "content": f"legacy answer {n}"}],
        }
        for n in range(count)
    ]


async def test_a_conversation_not_migrated_yet_is_paged_as_a_stored_one(api: Served) -> None:
    """Its converted legacy turns are cut by `seq` the same way, on every page."""
    await api.db[LEGACY_TURNS].insert_many(legacy_turns("conv-old-long", 60))
    first = await api.http.get("/viewer/conversations/conv-old-long")
    assert seqs(first.text) == list(range(MESSAGES_PER_PAGE))
    later = re.search(r'rel="next" href="([^"]+)"', first.text)
    assert later
    second = await api.http.get(later.group(1))
    assert second.status_code == 200
    assert seqs(second.text) == list(range(MESSAGES_PER_PAGE, 120))
    assert "legacy answer 59" in second.text
    assert 'rel="next"' not in second.text
    past = await api.http.get("/viewer/conversations/conv-old-long?from_seq=500")
    assert seqs(past.text) == []


async def test_a_conversation_not_migrated_yet_offers_no_fork(api: Served) -> None:
    """The store forks stored conversations only: a legacy-only one is read, not continued,
    until the migration stores it; its page says so instead of offering a fork that fails."""
    await api.db[LEGACY_TURNS].insert_many(legacy_turns("conv-old", 3))
    page = await api.http.get("/viewer/conversations/conv-old")
    assert page.status_code == 200
    assert seqs(page.text) == list(range(6))
    assert "Continue from here" not in page.text
    assert 'action="/viewer/conversations/conv-old/forks"' not in page.text
    assert "Not migrated yet" in page.text


@pytest.mark.parametrize(
    "legacy_id",
    [
        pytest.param("conv 42/\u03b1", id="no-identifier"),  # legacy-conversation-<hash>
        pytest.param(None, id="naming-none"),  # legacy-turn-<_id>
        pytest.param(ObjectId("65a1b2c3d4e5f60718293a4b"), id="object-id"),
        pytest.param(424242, id="number"),
    ],
)
async def test_the_legacy_comparison_finds_the_turns_of_a_conversation_however_it_was_named(
    api: Served, legacy_id: Any
) -> None:
    """The viewer finds a conversation's legacy turns as the store does (`_turns_of`): by
    the legacy id a derived id stands for, the `_id` a `legacy-turn-` id names, or a legacy
    id written as an ObjectId or a number, not by the stored id as text alone."""
    count = 1 if legacy_id is None else 2  # each turn naming none is a conversation of its own
    turns = legacy_turns(legacy_id, count, user_id="user-odd")
    conversion = convert(turns)
    assert conversion.conversation is not None
    await api.db[CONVERSATIONS].insert_one(conversion.conversation.model_dump(by_alias=True))
    await api.db[MESSAGES].insert_many([m.model_dump(by_alias=True) for m in conversion.messages])
    await api.db[LEGACY_TURNS].insert_many(turns)
    stored = conversion.conversation_id
    listed = await api.http.get("/viewer/users/user-odd")
    assert rows(listed.text) == [stored]
    assert legacy_links(listed.text) == {quote(stored)}
    transcript = await api.http.get(f"/viewer/conversations/{quote(stored)}")
    assert "compare with legacy turns" in transcript.text
    legacy = await api.http.get(f"/viewer/conversations/{quote(stored)}/legacy")
    assert legacy.status_code == 200
    assert legacy.text.count("data-legacy-turn=") == count
    assert f"legacy question {count - 1}" in legacy.text


async def test_a_conversation_a_migration_run_is_writing_is_shown_as_being_migrated(
    api: Served,
) -> None:
    """A migrated conversation a rerun is writing again, or one a stopped run left marked
    (`migrating`), is read from its legacy turns until a run finishes it: its page says it is
    being migrated, not that it never was, and the comparison shows the messages stored so
    far beside the legacy turns, with the way to its transcript."""
    turns = legacy_turns("conv-rerun", 3, user_id="user-rerun")
    conversion = convert(turns[:2])  # migrated with 2 turns; the old service added a third
    assert conversion.conversation is not None
    marked = conversion.conversation.model_dump(by_alias=True) | {"migrating": True}
    await api.db[CONVERSATIONS].insert_one(marked)
    await api.db[MESSAGES].insert_many([m.model_dump(by_alias=True) for m in conversion.messages])
    await api.db[LEGACY_TURNS].insert_many(turns)
    page = await api.http.get("/viewer/conversations/conv-rerun")
    assert page.status_code == 200
    assert seqs(page.text) == list(range(6))  # read from its legacy turns
    assert "Not migrated yet" not in page.text
    assert "Being migrated" in page.text
    assert "Continue from here" not in page.text
    legacy = await api.http.get("/viewer/conversations/conv-rerun/legacy")
    assert legacy.status_code == 200
    assert "Not migrated yet" not in legacy.text
    assert "Being migrated" in legacy.text
    assert "<h2>Messages (4)</h2>" in legacy.text
    assert legacy.text.count("data-legacy-turn=") == 3
    assert 'href="/viewer/conversations/conv-rerun"' in legacy.text


def answers(html: str) -> list[tuple[int, str]]:
    """Each tool result's seq and the call it is shown answering, in page order."""
    found = re.findall(
        r'data-seq="(\d+)"[^>]*>\s*<header>\s*<span class="who">Tool result</span>\s*'
        r'<span class="answers">answers ([^<]+)</span>',
        html,
    )
    return [(int(seq), call) for seq, call in found]


def calling(call_id: str, *tools: str) -> dict[str, Any]:
    """An assistant message calling each of `tools`, as `call_id`, `call_id`-1…"""
    calls = [
        {"id": call_id if n == 0 else f"{call_id}-{n}", "type": "function",
         "function": {"name": tool, "arguments": "{}"}}
        for n, tool in enumerate(tools)
    ]  # fmt: skip
    return {"role": "assistant", "content": None, "tool_calls": calls}


def result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": f"result of {call_id}"}


async def test_a_result_whose_call_is_on_an_earlier_page_names_that_call(api: Served) -> None:
    """A page names the call each result answers as the store pairs them, wherever the call
    is: a result at the top of a page answers the latest earlier call of its id, made on the
    page before (`call_0` reused: the latest one, not the first)."""
    filler = [{"role": "user", "content": f"message {n}"} for n in range(MESSAGES_PER_PAGE - 4)]
    turns = [
        [*filler, calling("call_0", "read_balance"), result("call_0")],  # the call at seq 96
        [calling("call_0", "wire_money", "notify"), {"role": "assistant", "content": "wait"}],
        [result("call_0"), result("call_0-1")],  # seq 100, 101: answering seq 98's calls
        [calling("call_0", "log"), result("call_0")],
    ]
    for turn in turns:
        await api.store.logger.log_messages("conv-paged-calls", turn, user_id=OWNER)
    url = "/viewer/conversations/conv-paged-calls"

    second = await api.http.get(f"{url}?from_seq={MESSAGES_PER_PAGE}")
    first = await api.http.get(url)

    assert answers(second.text) == [
        (100, "wire_money (call_0)"),
        (101, "notify (call_0-1)"),
        (103, "log (call_0)"),
    ]
    assert answers(first.text) == [(97, "read_balance (call_0)")]
    assert answers((await api.http.get(f"{url}?from_seq=99")).text)[:2] == [
        (100, "wire_money (call_0)"),
        (101, "notify (call_0-1)"),
    ]


async def test_a_result_on_a_later_page_names_the_open_call_of_a_reused_id(api: Served) -> None:
    """A result answers the latest earlier call of its id still without an answer: on a later
    page too, past a reuse of the id answered in between (`book_flight`'s `call_0` held for
    approval, `search_hotels`' answered at once), and past a call of the id on the page whose
    answer comes first."""
    held = [{"role": "user", "content": "book"}, calling("call_0", "book_flight")]  # 0, 1
    hotels = [calling("call_0", "search_hotels"), result("call_0")]
    filler = [{"role": "user", "content": f"message {n}"} for n in range(MESSAGES_PER_PAGE - 4)]
    turns = {
        "conv-late": [held, [*hotels, *filler[:-2]], [result("call_0")]],  # 2-3, 4-97, 98
        "conv-page": [held, filler, hotels, [result("call_0")]],  # 2-97, 98-99, 100
    }
    for conversation_id, logged in turns.items():
        for turn in logged:
            await api.store.logger.log_messages(conversation_id, turn, user_id=OWNER)
    paged = {
        conversation_id: (
            await api.http.get(f"/viewer/conversations/{conversation_id}?from_seq=97")
        ).text
        for conversation_id in turns
    }

    assert answers(paged["conv-late"]) == [(98, "book_flight (call_0)")]
    assert answers(paged["conv-page"]) == [
        (99, "search_hotels (call_0)"),
        (100, "book_flight (call_0)"),
    ]


async def test_a_result_whose_call_is_on_an_earlier_page_of_a_legacy_conversation_names_it(
    api: Served,
) -> None:
    """A conversation not migrated yet is paged from its converted turns: a result at the top
    of a page names the call made on the page before as well."""
    questions = legacy_turns("conv-old-calls", (MESSAGES_PER_PAGE - 2) // 2)  # seq 0-97
    tools = {"_id": "lt-tools", "conversation_id": "conv-old-calls", "user_id": "user-old",
             "created_at": T0 + timedelta(days=1), "user_message": "wire it",  # seq 98
             "response_parts": [
                 {"part_kind": "tool-call", "tool_name": "wire_money", "tool_call_id": "call_0",
                  "args": "{}"},  # seq 99
                 {"part_kind": "tool-return", "tool_name": "wire_money",
                  "tool_call_id": "call_0", "content": "wired"}]}  # fmt: skip
    await api.db[LEGACY_TURNS].insert_many([*questions, tools])

    second = await api.http.get(
        f"/viewer/conversations/conv-old-calls?from_seq={MESSAGES_PER_PAGE}"
    )

    assert second.status_code == 200
    assert answers(second.text) == [(MESSAGES_PER_PAGE, "wire_money (call_0)")]


async def test_the_legacy_comparison_says_so_when_it_shows_only_the_first_turns(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It reads one turn past the most it shows: an operator checking a migration by eye is
    told that more turns are stored than the page shows."""
    monkeypatch.setattr(viewer, "MAX_LEGACY_TURNS", 3)
    many_turns = legacy_turns("conv-old-many", 5)
    three_turns = [t | {"_id": f"three-{t['_id']}"} for t in legacy_turns("conv-old-three", 3)]
    await api.db[LEGACY_TURNS].insert_many(many_turns + three_turns)

    many = await api.http.get("/viewer/conversations/conv-old-many/legacy")
    three = await api.http.get("/viewer/conversations/conv-old-three/legacy")

    assert many.text.count("data-legacy-turn=") == 3
    assert (
        "Only the first 3 legacy turns are shown: this conversation has more stored." in many.text
    )
    assert three.text.count("data-legacy-turn=") == 3
    assert "Only the first" not in three.text


async def test_the_legacy_comparison_shows_in_each_column_what_fits_and_pages_on() -> None:
    """Dual write on, each turn of two messages of 1 MB of controls is a legacy turn too. Each
    column of the legacy page shows what fits in about half of `PAGE_SHOWS` as it prints,
    one at least, cut to fit with a note: a few MiB in all (five such turns were 114 MiB),
    with links to the later turns and messages, which reach every one of them."""
    hidden = "\x01" * 1_000_000
    async with serve(mongomock_db(), api_settings(legacy_dual_write=True), seeded=False) as api:
        await signed_in(api)
        for n in range(5):
            turn = [{"role": "user", "content": hidden}, {"role": "assistant", "content": hidden}]
            await api.store.logger.log_messages("conv-dual", turn, user_id=OWNER, turn_id=f"t-{n}")
        assert await api.db[LEGACY_TURNS].count_documents({}) == 5
        pages = {
            "Later legacy turns": await legacy_pages(api, "conv-dual", "Later legacy turns"),
            "Later messages": await legacy_pages(api, "conv-dual", "Later messages"),
        }
    for walk in pages.values():
        for page in walk:
            assert len(page.encode()) <= PAGE_SHOWS + 64 * 1024
            assert page.count('class="note cut"') == 2  # a turn and a message, each cut
    turns = [
        re.findall(r'data-legacy-turn="([^"]+)"', page) for page in pages["Later legacy turns"]
    ]
    assert [len(shown) for shown in turns] == [1] * 5
    assert len({turn for shown in turns for turn in shown}) == 5
    assert [seqs(page) for page in pages["Later messages"]] == [[n] for n in range(10)]


async def legacy_pages(api: Served, conversation_id: str, following: str) -> list[str]:
    """The legacy pages of a conversation, from its first on, by the links `following`."""
    url = f"/viewer/conversations/{conversation_id}/legacy"
    pages = []
    while url:
        page = await api.http.get(url)
        assert page.status_code == 200
        pages.append(page.text)
        later = re.search(f'href="([^"]+)">{following} →</a>', page.text)
        url = later.group(1).replace("&amp;", "&") if later else ""
        assert len(pages) < 20
    return pages


async def test_the_legacy_comparison_of_a_conversation_whose_delete_failed_part_way_is_404(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DELETE marks the conversation, then removes the legacy turns kept beside it: one that
    failed between leaves them. The legacy page shows none of them (404), as the transcript
    and every API read answer, until the DELETE run again removes them."""
    url = f"/viewer/conversations/{OWNER_CONVERSATION}"
    assert (await api.http.get(f"{url}/legacy")).status_code == 200

    async def lost(conversation_id: str, *, owner: str | None) -> int:
        raise StorageUnavailable("the connection dropped")

    monkeypatch.setattr(api.store.legacy, "delete", lost)
    with pytest.raises(StorageUnavailable):
        await api.store.conversations.delete(OWNER_CONVERSATION)
    monkeypatch.undo()
    assert await api.db[LEGACY_TURNS].count_documents({}) > 0

    for path in (url, f"{url}/legacy"):
        page = await api.http.get(path)
        assert page.status_code == 404, path
        assert "was not found" in page.text
        assert "data-legacy-turn=" not in page.text


ROOM = 64 * 1024
"""What the pages below may print (`PAGE_SHOWS` lowered so that their texts stay small)."""
WIDE_JSON = "[" + ",".join(["[]"] * 100_000) + "]"
"""300 KB of JSON text, 100,000 values: several times what such a page can print."""


def indented_characters(
    monkeypatch: pytest.MonkeyPatch, built: list[int] | None = None
) -> list[int]:
    """The lengths of the texts the viewer's pages indent (`_reindented`), as they indent
    them; `built`: how many characters indenting each built (all of it, or as many as it
    could before it was given up)."""
    indented: list[int] = []
    reindented = presentation._reindented

    def counted(text: str, most: int) -> tuple[str | None, int]:
        indented.append(len(text))
        shown, size = reindented(text, most)
        if built is not None:
            built.append(size)
        return shown, size

    monkeypatch.setattr(presentation, "_reindented", counted)
    monkeypatch.setattr(viewer, "PAGE_SHOWS", ROOM)
    return indented


def one_call(arguments: str, result: str) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": result},
    ]


@pytest.mark.parametrize(
    ("arguments", "result", "query"),
    [
        pytest.param("{}", WIDE_JSON, "?full=true&from_seq=2", id="full-result"),
        pytest.param(WIDE_JSON, "{}", "?full=true&from_seq=1", id="full-arguments"),
        pytest.param("{}", WIDE_JSON, "/legacy", id="legacy-result"),
        pytest.param(WIDE_JSON, "{}", "/legacy", id="legacy-arguments"),
    ],
)
async def test_a_page_indents_no_more_json_than_it_can_print(
    monkeypatch: pytest.MonkeyPatch, arguments: str, result: str, query: str
) -> None:
    """A page's work on a text follows what it prints, never what was stored: JSON longer
    than what the page has left to print is shown as stored, unindented (and cut to fit),
    never indented whole first (a 14 MB result held the event loop 14-20 s for a 4 MiB page,
    every other request waiting); JSON the page can print is indented as before. On every
    page: the full texts of a transcript, the legacy comparison (both its columns)."""
    settings = api_settings(max_message_bytes=16_384, legacy_dual_write=True)
    async with serve(mongomock_db(), settings, seeded=False) as api:
        await signed_in(api)
        await api.store.logger.log_messages(
            "conv-wide-json", one_call(arguments, result), user_id=OWNER, turn_id="t0"
        )
        indented = indented_characters(monkeypatch)
        page = await api.http.get(f"/viewer/conversations/conv-wide-json{query}")

        assert page.status_code == 200
        assert len(page.content) <= ROOM + 64 * 1024
        assert sum(indented) <= ROOM
        assert "[\n  []," not in page.text
        assert "[[],[]," in page.text  # shown as stored, as much as fits


async def test_a_page_indents_the_json_it_can_print_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """JSON within what a page prints is indented, on the transcript and the legacy
    comparison alike."""
    settings = api_settings(legacy_dual_write=True)
    async with serve(mongomock_db(), settings, seeded=False) as api:
        await signed_in(api)
        turn = one_call('{"city": "Paris"}', '{"temperature": [21, 23]}')
        await api.store.logger.log_messages("conv-json", turn, user_id=OWNER, turn_id="t0")
        indented = indented_characters(monkeypatch)
        for query in ("", "?full=true", "/legacy"):
            page = await api.http.get(f"/viewer/conversations/conv-json{query}")
            assert page.status_code == 200
            shown = escape('{\n  "temperature": [\n    21,\n    23\n  ]\n}')
            assert shown in page.text, query
            assert escape('{\n  "city": "Paris"\n}') in page.text, query
        assert indented


async def test_a_page_tries_to_indent_no_more_than_it_can_print(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """JSON that would grow past `PRETTY_GROWTH` times its size indented is shown as stored
    once indenting it has built that much: the page counts what it tried against what it
    prints, so results each within the page, each given up, cost what the page prints once,
    not once each (four 1 MB results nested 5 levels: 4.6 s of indenting for one page)."""
    wide = "[" * 5 + ",".join(["[]"] * 4_000) + "]" * 5  # 12 KB, 60 KB indented
    turn = [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{n}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            for n in range(4)
        ]},
        *({"role": "tool", "tool_call_id": f"c{n}", "content": wide} for n in range(4)),
    ]  # fmt: skip
    async with serve(mongomock_db(), seeded=False) as api:
        await signed_in(api)
        await api.store.logger.log_messages("conv-wide", turn, user_id=OWNER, turn_id="t0")
        built: list[int] = []
        indented_characters(monkeypatch, built)
        page = await api.http.get("/viewer/conversations/conv-wide")

        assert page.status_code == 200
        assert page.text.count(str(escape(wide))) == 4  # each shown as stored
        assert sum(built) <= ROOM


async def test_json_nested_too_deep_to_indent_leaves_the_page_room_for_the_json_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A result nested past `PRETTY_DEPTH` is given up early and shown as stored: it takes
    of the page what it prints, not what indenting might have built, so the small results
    after it are indented as on any page."""
    deep = "[" * 40 + "1" + "]" * 40
    results = [deep, deep, *(f'{{"n": {n}}}' for n in range(4))]
    turn = [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{n}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            for n in range(len(results))
        ]},
        *({"role": "tool", "tool_call_id": f"c{n}", "content": r} for n, r in enumerate(results)),
    ]  # fmt: skip
    async with serve(mongomock_db(), seeded=False) as api:
        await signed_in(api)
        await api.store.logger.log_messages("conv-deep", turn, user_id=OWNER, turn_id="t0")
        monkeypatch.setattr(viewer, "PAGE_SHOWS", 2 * (4 * len(deep) + presentation.PRETTY_SLACK))
        page = await api.http.get("/viewer/conversations/conv-deep")

        assert page.status_code == 200
        assert page.text.count(str(escape(deep))) == 2  # shown as stored
        for n in range(4):
            assert escape(f'{{\n  "n": {n}\n}}') in page.text


@pytest.mark.parametrize("field", ["user_message", "user_id", "_id"])
async def test_the_legacy_comparison_shows_a_turn_holding_undecodable_text_escaped(
    field: str,
) -> None:
    """SECURITY.md: a legacy turn whose text, `user_id` or `_id` holds bytes the driver cannot
    decode is shown on the legacy page as stored, each such byte its escape (`\\udcc3`), with
    a note naming the field, and the conversation's list and transcript link to it (was: 500
    for each page, the strict client refusing the whole reply; the page is the operator's
    way to see what to correct)."""
    from tests.test_legacy_problems import UndecodableText, _alice_then_undecodable_turn

    async with serve(mongomock_db(), seeded=False) as api:
        await signed_in(api)
        await api.store.logger.log_messages(
            "c-x", [{"role": "user", "content": "migrated words"}], user_id="alice"
        )
        await _alice_then_undecodable_turn(api.db)
        api.store.legacy._turns = UndecodableText(api.store.legacy._turns, "t-bad", (field,))
        await api.db[LEGACY_TURNS].delete_one({"_id": "t-1"})  # the undecodable turn alone
        listed = await api.http.get("/viewer/users/alice")
        transcript = await api.http.get("/viewer/conversations/c-x")
        legacy = await api.http.get("/viewer/conversations/c-x/legacy")

    assert (listed.status_code, transcript.status_code) == (200, 200)
    assert legacy_links(listed.text) == {"c-x"}
    assert "compare with legacy turns" in transcript.text
    assert legacy.status_code == 200, legacy.text
    assert legacy.text.count("data-legacy-turn=") == 1
    assert f"<code>{field}</code> holds bytes that are not valid UTF-8" in legacy.text
    if field != "user_id":  # the page shows no turn's owner
        assert "\\udcc3(" in legacy.text
