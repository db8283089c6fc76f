"""Where a fork's copy is cut into legacy turns outlives a rollback: after one, the second
attempt writes the fork's conversation document again without `forked_from` (MIGRATION.md),
so a record written again, a replay of the fork and `run --copy-again` cut the copy as its
record lists it, never as the document alone would say; and a copy of which no legacy turn
stands, nobody having deleted it, is copied again, never left out of a rollback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from pymongo.database import Database
from pymongo.errors import AutoReconnect

from agent_store import AgentMessageLogger, LegacyTurns, LoggedTurn
from agent_store.core import StorageUnavailable
from migrations import lease
from tests.test_migration_gate import (
    CONVERSATIONS,
    LEGACY_TURNS,
    MESSAGES,
    _copy_confirmation_fails_once,
    _gate_says,
    _served_user_texts,
    cli,
    legacy_turn,
    log_live,
    roll_back,
)

FORK_SHAPES = ["an answer", "a tool result"]
"""How the turn of the original after «A» opens: an assistant-only follow-up, or the result
of «A»'s call (neither a user's message, so a fork's cut there is where its original's turn
began, which the fork's document alone no longer says after a second attempt)."""


async def _with_logger(wire_uri: str, database: Database[dict[str, Any]], use: Any) -> Any:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
    db = client[database.name]
    legacy = LegacyTurns(db, dual_write=True)
    try:
        return await use(AgentMessageLogger(db, observers=[legacy], legacy=legacy))
    finally:
        await client.close()


def _fork_of_a_turn_opened_by_no_user(
    wire_uri: str, database: Database[dict[str, Any]], shape: str = "an answer"
) -> str:
    """c-1 migrated, then live turns «A» and «B» (opened by `shape`) dual-written, then c-1
    forked to f-1 past «B»: its copy is three legacy turns (OLD, «A», «B»). The fork's
    copy record's `_id`."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0

    async def log(logger: AgentMessageLogger) -> None:
        if shape == "a tool result":
            call = {
                "id": "call-1",
                "type": "function",
                "function": {"name": "lookup", "arguments": "{}"},
            }
            first = [
                {"role": "user", "content": "«A»?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
            ]
            then = [
                {"role": "tool", "tool_call_id": "call-1", "content": "«B» result"},
                {"role": "assistant", "content": "«B» secret follow-up"},
            ]
        else:
            first = [{"role": "user", "content": "«A»?"}, {"role": "assistant", "content": "rA"}]
            then = [{"role": "assistant", "content": "«B» secret follow-up"}]
        await logger.log_messages("c-1", first, user_id="u-1", turn_id="t1")
        await logger.log_messages("c-1", then, user_id="u-1", turn_id="t2")
        await logger.fork("c-1", 3 + len(then), "f-1", user_id="u-1")

    asyncio.run(_with_logger(wire_uri, database, log))
    copy = database[LEGACY_TURNS].find_one({"dual_write": True, "conversation_id": "f-1"})
    assert copy is not None
    return str(copy["dual_write_record"])


def _pieces(database: Database[dict[str, Any]], record_id: str) -> list[dict[str, Any]]:
    return list((database[lease.STATE].find_one({"_id": record_id}) or {}).get("pieces") or [])


def _fork_again(wire_uri: str, database: Database[dict[str, Any]], at: int) -> LoggedTurn:
    """The runtime's retry of the fork call whose answer it lost (a replay)."""

    async def fork(logger: AgentMessageLogger) -> Any:
        return await logger.fork("c-1", at, "f-1", user_id="u-1")

    return asyncio.run(_with_logger(wire_uri, database, fork))  # type: ignore[no-any-return]


def _holding(database: Database[dict[str, Any]], cid: str, text: str) -> list[Any]:
    """The `_id`s of the legacy turns of `cid` holding `text` (in the collection the legacy
    turns are in now)."""
    found = []
    for collection in (LEGACY_TURNS, CONVERSATIONS):
        for d in database[collection].find({"conversation_id": cid, "dual_write": True}):
            if text in str([d.get("user_message"), d.get("response_parts")]):
                found.append(d["_id"])
    return found


@pytest.mark.wire
@pytest.mark.parametrize("shape", FORK_SHAPES)
def test_a_fork_copy_record_written_again_after_a_rollback_lists_the_legacy_turns_written(
    wire_uri: str, database: Database[dict[str, Any]], shape: str
) -> None:
    """A fork's record removed by hand after a rollback and a second attempt is written
    again by `run` listing the legacy turns the dual write wrote, cut where the turns of
    its original began (was: cut at user messages alone, the second attempt's document
    having no `forked_from`, so «B»'s legacy turn was listed in none)."""
    record_id = _fork_of_a_turn_opened_by_no_user(wire_uri, database, shape)
    written = _pieces(database, record_id)
    assert len(written) == 3
    roll_back(database, clear_messages=False)
    assert cli(wire_uri, database, "run") == 0
    database[lease.STATE].delete_one({"_id": record_id})
    assert cli(wire_uri, database, "run") == 0
    assert _pieces(database, record_id) == written
    assert (database[lease.STATE].find_one({"_id": record_id}) or {}).get("state") == "copied"


@pytest.mark.wire
def test_an_exchange_of_a_fork_deleted_after_its_record_was_written_again_is_never_served(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Then a second rollback, and the person deletes the fork's «B» on the old service: the
    gate names those messages gone, never advising removing the copy's `dual_write` mark
    (was: it did; unmark, `run`, `finish --accept` ended with `finish` 0 while «B» was
    served)."""
    record_id = _fork_of_a_turn_opened_by_no_user(wire_uri, database)
    roll_back(database, clear_messages=False)
    assert cli(wire_uri, database, "run") == 0
    database[lease.STATE].delete_one({"_id": record_id})
    assert cli(wire_uri, database, "run") == 0
    roll_back(database, clear_messages=False)
    [follow_up] = _holding(database, "f-1", "«B»")
    database[CONVERSATIONS].delete_one({"_id": follow_up})
    assert cli(wire_uri, database, "run") == 0
    for out in _gate_says(wire_uri, database, capsys, exits=1):
        assert "copy of the messages at seq 4 of the live turn" in out, out
        assert "remove its `dual_write` mark" not in out


@pytest.mark.wire
@pytest.mark.parametrize("shape", FORK_SHAPES)
def test_a_fork_retried_after_a_rollback_keeps_its_copy_and_its_record(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    shape: str,
) -> None:
    """The runtime retries the fork after a rollback and a second attempt (a replay): the
    copy is written again as its record lists it, the record keeps its legacy turns, and the
    gate passes (was: the replay cut it at user messages alone, so «A»'s legacy turn held «B»
    too beside «B»'s own, the old service read «B» twice, the record lost «B»'s legacy turn
    and the gate blamed a legacy edit)."""
    record_id = _fork_of_a_turn_opened_by_no_user(wire_uri, database, shape)
    written = _pieces(database, record_id)
    roll_back(database, clear_messages=False)
    assert cli(wire_uri, database, "run") == 0
    assert _fork_again(wire_uri, database, 4 if shape == "an answer" else 5).replayed
    assert _pieces(database, record_id) == written
    assert len(_holding(database, "f-1", "«B»")) == 1
    _gate_says(wire_uri, database, capsys, exits=0)


def _record_fails_for_the_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    """The confirmation of the third copy (the fork's, after t1's and t2's) fails."""
    real = LegacyTurns._record_copy
    calls: list[int] = []

    async def flaky(self: LegacyTurns, *args: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise AutoReconnect("primary stepped down")
        await real(self, *args)

    monkeypatch.setattr(LegacyTurns, "_record_copy", flaky)


@pytest.mark.wire
def test_copy_again_of_a_fork_after_a_rollback_writes_the_legacy_turn_its_record_lists(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fork's record left intended, «B»'s legacy turn never written, then a rollback and a
    second attempt: `run --copy-again RECORD`, as the gate advises, writes «B»'s legacy turn
    as the record lists it and confirms the record (was: it cut the copy at user messages
    alone, found the first legacy turn standing, wrote nothing and exited 0, the record
    intended for ever)."""
    _record_fails_for_the_fork(monkeypatch)
    with pytest.raises(StorageUnavailable):
        _fork_of_a_turn_opened_by_no_user(wire_uri, database)
    monkeypatch.undo()
    record_id = str(
        (database[LEGACY_TURNS].find_one({"conversation_id": "f-1"}) or {})["dual_write_record"]
    )
    pieces = _pieces(database, record_id)
    assert database[LEGACY_TURNS].delete_one({"_id": pieces[2]["_id"]}).deleted_count == 1
    roll_back(database, clear_messages=False)
    assert cli(wire_uri, database, "run") == 0
    for out in _gate_says(wire_uri, database, capsys, exits=1):
        assert f"run `run --copy-again {record_id}`" in out
    assert cli(wire_uri, database, "run", "--copy-again", record_id) == 0
    record = database[lease.STATE].find_one({"_id": record_id}) or {}
    assert record.get("state") == "copied"
    assert record.get("pieces") == pieces
    assert _holding(database, "f-1", "«B»") == [pieces[2]["_id"]]
    _gate_says(wire_uri, database, capsys, exits=0)


@pytest.mark.wire
def test_a_copy_none_of_which_was_written_is_copied_again_never_left_out_of_a_rollback(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live turn's record left intended and no legacy turn of its copy standing (its
    write failed), the person having deleted nothing: the gate asks, and advises keeping
    the record and `run --copy-again RECORD`, which writes the copy from the stored messages
    and confirms the record; a rollback then serves the turn (was: "delete that record and
    unset `copy_owed`", after which the gate passed and a rollback lost the turn, and
    `run --copy-again` refused the record)."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    _copy_confirmation_fails_once(monkeypatch)
    with pytest.raises(StorageUnavailable):
        log_live(wire_uri, database, "c-1", "t1", "«LIVE»", dual_write=True)
    record_id = str((database[LEGACY_TURNS].find_one({"turn_id": "t1"}) or {})["dual_write_record"])
    written = _pieces(database, record_id)
    database[LEGACY_TURNS].delete_one({"turn_id": "t1"})  # its write never landed
    for out in _gate_says(wire_uri, database, capsys, exits=1):
        assert f"run `run --copy-again {record_id}`" in out, out
        assert "delete that record" not in out
    assert cli(wire_uri, database, "run", "--copy-again", record_id) == 0
    record = database[lease.STATE].find_one({"_id": record_id}) or {}
    assert (record.get("state"), record.get("pieces")) == ("copied", written)
    _gate_says(wire_uri, database, capsys, exits=0)
    roll_back(database, clear_messages=False)
    assert any("«LIVE»" in str(d.get("user_message")) for d in database[CONVERSATIONS].find())
    assert cli(wire_uri, database, "run") == 0
    assert "«LIVE»" in str(_served_user_texts(wire_uri, database, "c-1"))
    assert database[MESSAGES].count_documents({"turn_id": "t1"}) == 2


@pytest.mark.wire
def test_copy_again_exits_1_when_a_legacy_turn_its_record_lists_is_still_missing(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A record listing a legacy turn the turn's stored messages cannot be cut as (no `seq`s,
    an `_id` no cut gives: a record edited by hand): `run --copy-again` writes nothing over
    it, exits 1 naming the record, and leaves it intended; the gate still asks."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    _copy_confirmation_fails_once(monkeypatch)
    with pytest.raises(StorageUnavailable):
        log_live(wire_uri, database, "c-1", "t1", "«LIVE»", dual_write=True)
    record_id = str((database[LEGACY_TURNS].find_one({"turn_id": "t1"}) or {})["dual_write_record"])
    database[LEGACY_TURNS].delete_one({"turn_id": "t1"})
    unknown = {"pieces": [{"_id": "dual-no-cut-gives-this"}]}
    database[lease.STATE].update_one({"_id": record_id}, {"$set": unknown})
    capsys.readouterr()
    assert cli(wire_uri, database, "run", "--copy-again", record_id) == 1
    said = capsys.readouterr()
    assert f"{record_id!r}: 1 legacy turn(s) its record lists" in said.out + said.err
    assert (database[lease.STATE].find_one({"_id": record_id}) or {}).get("state") == "intended"
    _gate_says(wire_uri, database, capsys, exits=1)
