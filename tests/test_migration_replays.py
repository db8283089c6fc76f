"""A turn's replay (the runtime's retry of a turn stored already) and the copy the dual write
made of it: a copy its record confirmed (`copied`) is never written back, so a legacy turn
of it gone stays gone and the gate keeps asking about it; a copy its record still holds
`intended` is completed, its legacy turns missing written, none standing written over."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo.database import Database

from agent_store import LoggedTurn
from agent_store.core import StorageUnavailable
from migrations import lease
from tests.test_migration_gate import (
    CONVERSATIONS,
    LEGACY_TURNS,
    MESSAGES,
    _copy_confirmation_fails_once,
    _gate_says,
    cli,
    legacy_turn,
    log_live,
    roll_back,
)


def _live_turn_copied(wire_uri: str, database: Database[dict[str, Any]]) -> tuple[LoggedTurn, str]:
    """c-1 migrated, then live turn t1 «LIVE» dual-written: the turn and its record's `_id`."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    first = log_live(wire_uri, database, "c-1", "t1", "«LIVE»", dual_write=True)
    copy = database[LEGACY_TURNS].find_one({"turn_id": "t1"}) or {}
    return first, str(copy["dual_write_record"])


def _replay(wire_uri: str, database: Database[dict[str, Any]], first: LoggedTurn) -> None:
    """The runtime's retry of t1 (same turn id, same content) on the new service."""
    at = first.messages[0].created_at
    again = log_live(wire_uri, database, "c-1", "t1", "«LIVE»", dual_write=True, at=at)
    assert again.replayed


def _state(database: Database[dict[str, Any]], record_id: str) -> Any:
    return (database[lease.STATE].find_one({"_id": record_id}) or {}).get("state")


@pytest.mark.wire
def test_a_replay_never_writes_back_a_confirmed_copy_the_person_deleted_after_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """After a rollback the person deletes t1's legacy turn on the old service; the second
    attempt's gate asks about it; then t1's replay arrives: it writes no legacy turn back,
    the record stays `copied`, and the gate still asks (was: the replay wrote the copy
    again, `verify` exited 0 and the deleted exchange was served on both services)."""
    first, record_id = _live_turn_copied(wire_uri, database)
    roll_back(database, clear_messages=False)
    assert database[CONVERSATIONS].delete_one({"turn_id": "t1", "dual_write": True}).deleted_count
    assert cli(wire_uri, database, "run") == 0
    _gate_says(wire_uri, database, capsys, exits=1)
    _replay(wire_uri, database, first)
    assert database[LEGACY_TURNS].count_documents({"turn_id": "t1"}) == 0
    assert _state(database, record_id) == "copied"
    for out in _gate_says(wire_uri, database, capsys, exits=1):
        assert "the dual-written copy of the live turn 't1' is gone" in out, out


@pytest.mark.wire
def test_a_replay_leaves_a_confirmed_copy_standing_as_it_is(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """With no rollback: t1's replay writes nothing over its confirmed copy standing."""
    first, record_id = _live_turn_copied(wire_uri, database)
    database[LEGACY_TURNS].update_one({"turn_id": "t1"}, {"$set": {"mark": "standing"}})
    _replay(wire_uri, database, first)
    assert [d.get("mark") for d in database[LEGACY_TURNS].find({"turn_id": "t1"})] == ["standing"]
    assert _state(database, record_id) == "copied"


@pytest.mark.wire
@pytest.mark.parametrize("copy", ["never written", "standing"])
def test_a_replay_completes_a_copy_its_record_still_holds_intended(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    copy: str,
) -> None:
    """t1's copy recorded `intended` (its confirmation failed, the runtime told the turn
    failed), then its retry: the copy is completed, a legacy turn missing written and one
    standing left as it is (an edit made to it stays for the gate to ask about), the record
    confirmed; the gate passes when nobody edited it."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    _copy_confirmation_fails_once(monkeypatch)
    with pytest.raises(StorageUnavailable):
        log_live(wire_uri, database, "c-1", "t1", "«LIVE»", dual_write=True)
    standing = database[LEGACY_TURNS].find_one({"turn_id": "t1"}) or {}
    record_id = str(standing["dual_write_record"])
    assert _state(database, record_id) == "intended"
    if copy == "never written":
        database[LEGACY_TURNS].delete_one({"turn_id": "t1"})
    else:
        database[LEGACY_TURNS].update_one({"turn_id": "t1"}, {"$set": {"mark": "standing"}})
    first = database[MESSAGES].find_one({"turn_id": "t1"}) or {}
    at = first["created_at"]
    again = log_live(wire_uri, database, "c-1", "t1", "«LIVE»", dual_write=True, at=at)
    assert again.replayed
    written = list(database[LEGACY_TURNS].find({"turn_id": "t1"}))
    assert [d["_id"] for d in written] == [standing["_id"]]
    assert written[0].get("mark") == (None if copy == "never written" else "standing")
    assert _state(database, record_id) == "copied"
    if copy == "never written":
        _gate_says(wire_uri, database, capsys, exits=0)
    else:  # the edit is the gate's to ask about, never written over by the replay
        for out in _gate_says(wire_uri, database, capsys, exits=1):
            assert "it was edited in the legacy collection since it was written" in out, out
