"""`python -m migrations` end to end on the wire backend, misuse, and kills at any moment."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import bson
import mongomock
import pytest
from bson import DatetimeMS, Decimal128, Int64, ObjectId
from pymongo import MongoClient, monitoring
from pymongo.database import Database

from agent_store import embedded
from agent_store.core import Conversation
from agent_store.legacy import LEGACY_TURNS, MIGRATION_STATE, SESSION_HITL
from agent_store.store import CONVERSATIONS, MESSAGES
from app.examples import EXAMPLE_CONVERSATION_ID, example_legacy_turns
from migrations import connection, explode, lease, problems, relocate, writes
from migrations.cli import Stopped, _report_id_clustering, main, parser
from migrations.connection import database
from migrations.errors import MigrationError
from migrations.lease import Lease
from migrations.problems import PROBLEMS
from scripts.legacy_corpus import legacy_corpus
from tests.conftest import ReplyBatches

ROOT = Path(__file__).resolve().parents[1]
DIGESTED = (CONVERSATIONS, MESSAGES, PROBLEMS, LEGACY_TURNS)


def corpus(conversations: int = 4) -> list[dict[str, Any]]:
    return example_legacy_turns() + list(legacy_corpus(conversations, turns=3, text_chars=20))


def seed(db: Database[dict[str, Any]], conversations: int = 4) -> None:
    db[CONVERSATIONS].insert_many(corpus(conversations))
    db[SESSION_HITL].insert_one(
        {"conversation_id": EXAMPLE_CONVERSATION_ID, "request_id": "req-booking-1",
         "action": "confirm_booking", "status": "pending"}
    )  # fmt: skip


def digest(db: Database[dict[str, Any]]) -> dict[str, str]:
    """A digest of each collection the migration writes or moves, independent of order, and
    of the epoch a run drew for each conversation document it created (random: two runs over
    the same legacy turns draw two; that one is drawn is in the digest)."""
    found = {}
    for name in DIGESTED:
        read = (d | ({"epoch": "drawn"} if d.get("migrated") else {}) for d in db[name].find())
        docs = sorted(json.dumps(d, sort_keys=True, default=str) for d in read)
        found[name] = hashlib.sha256("\n".join(docs).encode()).hexdigest()[:16] + f"/{len(docs)}"
    return found


def cli(wire_uri: str, db: Database[dict[str, Any]], *args: str) -> int:
    return main(
        [args[0], "--uri", wire_uri, "--database", db.name, "--progress", "none", *args[1:]]
    )


@pytest.mark.wire
def test_run_rerun_and_verify_converge_on_the_wire_backend(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    seed(database)
    legacy_count = database[CONVERSATIONS].count_documents({})

    assert cli(wire_uri, database, "run") == 0
    first = digest(database)
    assert cli(wire_uri, database, "run") == 0
    out = capsys.readouterr().out

    assert digest(database) == first
    summary = [line for line in out.splitlines() if " turns -> " in line][-1]
    assert "; 0 messages written, 0 conversation documents written, 0 full texts" in summary
    assert database[LEGACY_TURNS].count_documents({}) == legacy_count
    assert database[CONVERSATIONS].count_documents({"user_message": {"$exists": True}}) == 0
    conversation = database[CONVERSATIONS].find_one({"_id": EXAMPLE_CONVERSATION_ID})
    assert conversation is not None
    assert conversation["message_count"] == 12
    assert conversation["pending_hitl"]["request_id"] == "req-booking-1"
    assert database[MESSAGES].count_documents({"conversation_id": EXAMPLE_CONVERSATION_ID}) == 12

    assert cli(wire_uri, database, "verify") == 0
    out = capsys.readouterr().out
    assert "verified 5 conversations: 5 match, 0 differ" in out
    # One generated turn holds a part of an unknown type: only the legacy turns hold it.
    assert cli(wire_uri, database, "finish") == 1
    assert "unknown_part" in capsys.readouterr().out
    assert cli(wire_uri, database, "status") == 0
    status = capsys.readouterr().out
    assert "lock: free" in status
    assert "progress: complete" in status
    assert "completed" in next(line for line in status.splitlines() if line.startswith("last run"))


@pytest.mark.wire
def test_verify_reports_each_difference_with_its_conversation_id(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    seed(database)
    assert cli(wire_uri, database, "run") == 0
    database[MESSAGES].update_one(
        {"conversation_id": EXAMPLE_CONVERSATION_ID, "seq": 4}, {"$set": {"content": "edited"}}
    )
    database[MESSAGES].delete_one({"conversation_id": EXAMPLE_CONVERSATION_ID, "seq": 2})
    capsys.readouterr()

    assert cli(wire_uri, database, "verify", "--sample", "3", "--seed", "1") in (0, 1)
    assert cli(wire_uri, database, "verify", "--conversation", EXAMPLE_CONVERSATION_ID) == 1
    lines = capsys.readouterr().out.splitlines()
    reported = [line for line in lines if line.startswith(EXAMPLE_CONVERSATION_ID)]
    assert any("edited" in line for line in reported)
    assert any("tool result missing from new" in line and "18" in line for line in reported)
    assert lines[-1].startswith("verified 1 conversations: 0 match, 1 differ")


@pytest.mark.wire
@pytest.mark.parametrize("command", ["verify", "finish"])
def test_a_stored_message_that_no_longer_validates_is_a_difference_naming_its_conversation(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    """A message edited by hand past what the store takes (`seq: -1`) is reported with its
    conversation, exit 1, as any difference: never a traceback."""
    seed(database)
    assert cli(wire_uri, database, "run") == 0
    database[MESSAGES].update_one(
        {"conversation_id": EXAMPLE_CONVERSATION_ID, "seq": 2}, {"$set": {"seq": -1}}
    )
    capsys.readouterr()

    assert cli(wire_uri, database, command) == 1
    reported = [
        line
        for line in capsys.readouterr().out.splitlines()
        if EXAMPLE_CONVERSATION_ID in line and "no longer validates" in line
    ]
    assert reported
    assert "seq" in reported[0]


@pytest.mark.wire
def test_a_run_over_a_stored_message_that_no_longer_validates_records_it_never_a_traceback(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    seed(database)
    assert cli(wire_uri, database, "run") == 0
    database[MESSAGES].update_one(
        {"conversation_id": EXAMPLE_CONVERSATION_ID, "seq": 2}, {"$set": {"seq": -1}}
    )

    assert cli(wire_uri, database, "run") == 0
    [problem] = database[PROBLEMS].find({"kind": "live_conflict"})
    assert problem["conversation_id"] == EXAMPLE_CONVERSATION_ID
    assert "no longer validates" in problem["detail"]


@pytest.mark.wire
@pytest.mark.parametrize(
    "edit",
    [
        {"message_count": -1},
        {"user_id": {"x": 1}},
        {"message_count": "many"},
        {"answered_prompts": [{"request_id": "req-1"}]},
        {"approved_calls": [{"x": 1}]},
        {"approved_calls": "all"},
        {"resolved_hitl": [{"x": 1}]},
        {"popped_messages": -1},
        {"epoch": -1},
    ],
    ids=[
        "a-negative-count",
        "an-object-owner",
        "a-count-of-text",
        "an-answer-without-its-seq",
        "an-approval-of-no-call",
        "approvals-of-text",
        "a-resolved-prompt-of-no-id",
        "pops-of-a-number",
        "an-epoch-of-a-number",
    ],
)
def test_a_conversation_document_that_no_longer_validates_is_work_left_a_run_redoes(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    edit: dict[str, Any],
) -> None:
    """The migration's conversation document edited by hand past what the store takes is
    no longer what its legacy turns convert to: `finish` names it (exit 1, never a
    traceback), and the next run writes it again."""
    seed(database)
    assert cli(wire_uri, database, "run") == 0
    database[CONVERSATIONS].update_one({"_id": EXAMPLE_CONVERSATION_ID}, {"$set": edit})
    capsys.readouterr()

    assert cli(wire_uri, database, "finish") == 1
    named = [
        line for line in capsys.readouterr().out.splitlines() if EXAMPLE_CONVERSATION_ID in line
    ]
    assert any("conversation document differs" in line for line in named)
    assert cli(wire_uri, database, "run") == 0
    Conversation.model_validate(database[CONVERSATIONS].find_one({"_id": EXAMPLE_CONVERSATION_ID}))
    cli(wire_uri, database, "finish")  # exit 1 all the same: the seed's problems wait
    assert "conversation document differs" not in capsys.readouterr().out


def test_problem_records_edited_by_hand_are_summed_up_by_their_kind_as_text() -> None:
    """A problem whose `kind` an operator edited to a number (or removed) is still counted,
    under its text, beside the others: never a traceback from sorting them."""
    database: Database[dict[str, Any]] = mongomock.MongoClient()["edited"]
    database[PROBLEMS].insert_many(
        [{"kind": "unknown_part", "placed": False}, {"kind": 5, "placed": True}, {"placed": True}]
    )
    assert problems.summary(database) == [
        ("5", True, 1), ("None", True, 1), ("unknown_part", False, 1)
    ]  # fmt: skip


@pytest.mark.wire
def test_dry_run_writes_nothing(wire_uri: str, database: Database[dict[str, Any]]) -> None:
    seed(database)
    before = digest(database)
    assert cli(wire_uri, database, "run", "--dry-run") == 0
    assert digest(database) == before
    assert "agent_migrations" not in database.list_collection_names()


@pytest.mark.wire
def test_limit_and_conversation_migrate_part_and_a_later_run_resumes(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    seed(database)
    assert cli(wire_uri, database, "run", "--conversation", EXAMPLE_CONVERSATION_ID) == 0
    assert database[CONVERSATIONS].distinct("_id") == [EXAMPLE_CONVERSATION_ID]
    assert cli(wire_uri, database, "run", "--limit", "2", "--batch-size", "1") == 0
    assert database[CONVERSATIONS].count_documents({}) in (2, 3)
    assert cli(wire_uri, database, "finish") == 1
    capsys.readouterr()
    assert cli(wire_uri, database, "run") == 0
    assert "resuming where the last run stopped" in capsys.readouterr().out
    assert database[CONVERSATIONS].count_documents({}) == 5


@pytest.mark.wire
def test_no_legacy_data_is_a_clear_error(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(wire_uri, database, "run") == 2
    assert "no legacy data" in capsys.readouterr().err
    assert cli(wire_uri, database, "verify") == 2
    seed(database)
    assert cli(wire_uri, database, "run", "--conversation", "no-such-conversation") == 2
    assert "no legacy turns for conversation 'no-such-conversation'" in capsys.readouterr().err


@pytest.mark.wire
@pytest.mark.parametrize("legacy_id", [42, "42"], ids=["number", "text"])
def test_run_conversation_migrates_a_conversation_whose_legacy_id_is_a_number(
    legacy_id: Any,
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The reader names a number id by its text (`7` and `"7"` are one conversation,
    `explode.read_turns`): `run`, `verify` and `finish` take `--conversation 42` and
    `--accept 42` for the turns stored under the number 42 as for those under "42"."""
    turn = {"_id": "t-1", "conversation_id": legacy_id, "user_id": "u-1",
            "created_at": datetime(2024, 1, 1, tzinfo=UTC), "user_message": "numeric id",
            "response_parts": [{"type": "text", "content": "answer"},
                               {"type": "mystery_widget", "data": "kept"}]}  # fmt: skip
    database[CONVERSATIONS].insert_one(turn)

    assert cli(wire_uri, database, "run", "--conversation", "42") == 0, capsys.readouterr().err
    assert database[MESSAGES].count_documents({"conversation_id": "42"}) == 2
    assert cli(wire_uri, database, "verify", "--conversation", "42") == 0
    assert "verified 1 conversations: 1 match" in capsys.readouterr().out
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert cli(wire_uri, database, "finish", "--accept", "42", "--note", "kept") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0


@pytest.mark.wire
def test_an_acceptance_naming_no_conversation_is_misuse_and_records_nothing(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`finish --accept` with a mistyped id is refused as `verify --conversation` refuses it
    (exit 2, the same words), and no acceptance is recorded, for it or for an id beside it;
    an id naming a conversation, or only problems (a prompt without legacy turns), is taken."""
    database[CONVERSATIONS].insert_one(
        {"_id": "t1", "conversation_id": "conv-real", "user_id": "u",
         "created_at": datetime(2025, 5, 1, tzinfo=UTC), "user_message": "q",
         "response_parts": [{"type": "sticker", "x": 1}]}
    )  # fmt: skip
    database[SESSION_HITL].insert_one(
        {"conversation_id": "c-gone", "request_id": "r-1", "status": "pending", "prompt": "Pay?"}
    )
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()

    assert cli(wire_uri, database, "verify", "--conversation", "conv-reel") == 2
    said = capsys.readouterr().err
    assert "no legacy turns for conversation 'conv-reel'" in said
    accept = ("--accept", "conv-real", "--accept", "conv-reel", "--note", "kept in S3")
    assert cli(wire_uri, database, "finish", *accept) == 2
    refused = capsys.readouterr()
    assert "no legacy turns for conversation 'conv-reel'" in refused.err
    assert "recorded" not in refused.out
    assert list(database["agent_migrations"].find({"kind": "acceptance"})) == []

    accept = ("--accept", "conv-real", "--accept", "c-gone", "--note", "kept in S3")
    assert cli(wire_uri, database, "finish", *accept) == 0
    assert sorted(
        database["agent_migrations"].distinct("conversation_id", {"kind": "acceptance"})
    ) == [
        "c-gone",
        "conv-real",
    ]


@pytest.mark.wire
def test_an_acceptance_naming_a_legacy_id_is_recorded_under_the_id_it_migrates_to(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A legacy conversation id that is no identifier is migrated under a derived id: an
    operator naming it by its legacy id in `finish --accept` (as `verify --conversation`
    takes it) accepts the conversation the gate names, and is told which id was recorded."""
    legacy_id = "conv 42/\u03b1"
    database[CONVERSATIONS].insert_one(
        {"_id": "t0", "conversation_id": legacy_id, "user_id": "u",
         "created_at": datetime(2025, 1, 1, tzinfo=UTC), "user_message": "q",
         "response_parts": [{"type": "sticker", "x": 1}, {"type": "text", "content": "a"}]}
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    [stored] = database[CONVERSATIONS].distinct("_id")
    assert stored.startswith("legacy-conversation-")
    capsys.readouterr()

    assert cli(wire_uri, database, "finish", "--accept", legacy_id, "--note", "in problems") == 0
    said = capsys.readouterr().out
    assert f"recorded: the unplaced content of {stored!r} (legacy id {legacy_id!r})" in said
    assert "work left" not in said
    assert database["agent_migrations"].distinct("conversation_id", {"kind": "acceptance"}) == [
        stored
    ]


@pytest.mark.wire
def test_a_held_lock_stops_a_second_run_until_forced_or_expired(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    seed(database)
    Lease(database, "run-elsewhere", timedelta(minutes=5)).acquire()

    assert cli(wire_uri, database, "run") == 3
    err = capsys.readouterr().err
    assert "another migration run holds the lock" in err
    assert "run-elsewhere" in err
    assert "--force-unlock" in err
    assert database[MESSAGES].count_documents({}) == 0

    assert cli(wire_uri, database, "run", "--force-unlock", "--limit", "1") == 0
    Lease(database, "run-killed", timedelta(milliseconds=1)).acquire()
    time.sleep(0.01)
    assert cli(wire_uri, database, "run") == 0  # the killed run's lease has expired


@pytest.mark.wire
def test_every_read_of_the_migration_on_the_embedded_server_holds_a_bounded_reply(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Legacy turns whose batch holds more than one reply may (16 MiB, `REPLY_BATCH_BYTES`,
    lowered here; past 48 MB the driver refused the reply, exit 4 for ever): the move, the
    run, `verify` and `finish` read them a bounded reply at a time, and pass."""
    monkeypatch.setattr(embedded, "REPLY_BATCH_BYTES", 100_000)
    replies = ReplyBatches()
    listened = functools.partial(MongoClient, event_listeners=[replies])
    monkeypatch.setattr(connection, "MongoClient", listened)
    for c in range(8):
        text = f"{c} " + "é" * 20_000
        database[CONVERSATIONS].insert_one(
            {"_id": ObjectId(f"{c + 1:024x}"), "conversation_id": f"big-{c}", "user_id": "u1",
             "created_at": datetime(2024, 1, 1, c, tzinfo=UTC), "user_message": f"q {c}",
             "response_parts": [{"type": "text", "content": text}], "response_text": text}
        )  # fmt: skip

    assert [cli(wire_uri, database, command) for command in ("run", "verify", "finish")] == [0] * 3
    assert "verified 8 conversations: 8 match" in capsys.readouterr().out
    assert replies.batches
    assert replies.past(100_000) == []


def test_an_unreachable_server_or_a_bad_uri_exits_4(capsys: pytest.CaptureFixture[str]) -> None:
    closed = "mongodb://127.0.0.1:9/?directConnection=true"
    assert main(["status", "--uri", closed, "--timeout", "0.2"]) == 4
    assert "cannot reach MongoDB" in capsys.readouterr().err
    assert main(["status", "--uri", "postgres://nope"]) == 4
    assert "invalid MongoDB URI" in capsys.readouterr().err


@pytest.mark.wire
@pytest.mark.parametrize(
    "options",
    [
        pytest.param(("status", "--timeout", "-1"), id="negative-timeout"),
        pytest.param(("verify", "--timeout", "0"), id="zero-timeout"),
        pytest.param(("finish", "--timeout", "nan"), id="nan-timeout"),
        pytest.param(("run", "--timeout", "inf"), id="endless-timeout"),
        pytest.param(("run", "--lease-seconds", "0"), id="zero-lease"),
        pytest.param(("run", "--lease-seconds", "-1"), id="negative-lease"),
        pytest.param(("run", "--wait-seconds", "-1"), id="negative-wait"),
    ],
)
def test_a_timeout_lease_or_wait_out_of_range_is_misuse_and_nothing_runs(
    options: tuple[str, ...],
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exit 2, never a traceback (exit 1 reads as "differences found") nor a lease that ends
    at once (any `finish` or `verify` would take the lock of the run holding it)."""
    seed(database)

    assert cli(wire_uri, database, *options) == 2
    assert f"{options[1]} {options[2]}: " in capsys.readouterr().err
    assert database[lease.STATE].find_one({"_id": lease.LOCK_ID}) is None
    assert database[MESSAGES].count_documents({}) == 0


def test_no_uri_and_no_embedded_database_is_misuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MONGODB_URI", raising=False)
    monkeypatch.setenv("AGENT_STORE_DATA_DIR", str(tmp_path))
    assert main(["status"]) == 2
    assert "pass --uri or set MONGODB_URI (or run `make run` first" in capsys.readouterr().err


@contextmanager
def _data_dir_held(data_dir: Path, holder: str = "4242") -> Iterator[None]:
    """`data_dir` held as an embedded server holds it (a service starting, another run)."""
    import fcntl

    (data_dir / embedded.DATABASE_FILE).touch()
    with (data_dir / embedded.LOCK_FILE).open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write(holder)
        lock.flush()
        yield


@pytest.mark.wire
def test_a_data_dir_another_process_holds_without_a_published_uri_is_misuse_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a traceback with exit 1 ("verify found differences"): exit 2, naming the holder
    and what to do, whoever it is (a service, a migration, a second `make run`)."""
    monkeypatch.delenv("MONGODB_URI", raising=False)
    monkeypatch.setenv("AGENT_STORE_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(connection, "HOLDER_WAIT_SECONDS", 0.5)
    with _data_dir_held(tmp_path):
        assert main(["status"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("error: "), said
    assert said.count("\n") == 1, said
    assert "process 4242" in said
    assert "a migration" in said
    assert "AGENT_STORE_DATA_DIR" in said


@pytest.mark.wire
def test_a_migration_waits_for_a_starting_service_to_publish_its_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The service holds the data directory before it publishes its server's URI."""
    monkeypatch.delenv("MONGODB_URI", raising=False)
    monkeypatch.setenv("AGENT_STORE_DATA_DIR", str(tmp_path))
    server = embedded.ServerThread()
    uri = server.start()
    publish = threading.Timer(
        0.5,
        lambda: embedded._publish(tmp_path, uri),  # as the service does
    )
    try:
        with _data_dir_held(tmp_path):
            publish.start()
            assert main(["status", "--timeout", "5"]) == 0
    finally:
        publish.join()
        server.stop()
    assert f"the embedded server at {uri}" in capsys.readouterr().out


@pytest.mark.wire
def test_a_second_migration_on_a_data_dir_a_migration_opened_is_misuse_never_its_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A migration that opened the embedded database itself publishes no URI: its server
    ends with it, so a second migration meanwhile would lose it part-way (exit 4, "cannot
    reach"). The second waits for a URI as for a service starting, then exits 2 in one line
    naming the holder; once the first ended, it opens the directory itself."""
    monkeypatch.delenv("MONGODB_URI", raising=False)
    monkeypatch.setenv("AGENT_STORE_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(connection, "HOLDER_WAIT_SECONDS", 0.5)
    (tmp_path / embedded.DATABASE_FILE).touch()
    with database(parser().parse_args(["status"])) as (_, where):  # the first migration
        assert "opened here" in where
        assert main(["status"]) == 2
        said = capsys.readouterr().err
        assert embedded.published_uri(tmp_path) is None
    assert said.startswith("error: the embedded database: "), said
    assert said.count("\n") == 1, said
    assert f"held by process {os.getpid()}" in said
    assert "the migration's --data-dir" in said  # not the service's setting alone
    assert main(["status"]) == 0
    assert "opened here" in capsys.readouterr().out


@pytest.mark.wire
def test_a_conversation_logged_before_its_migration_is_reported_not_merged(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    seed(database)
    relocate.relocate(database)
    database[MESSAGES].insert_one(
        {"_id": "live-0", "conversation_id": EXAMPLE_CONVERSATION_ID, "seq": 0, "role": "user",
         "content": "logged live first"}
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    assert "1 already live" in capsys.readouterr().out
    problem = database[PROBLEMS].find_one({"kind": "conversation_already_live"})
    assert problem is not None
    assert problem["conversation_id"] == EXAMPLE_CONVERSATION_ID
    assert database[MESSAGES].count_documents({"conversation_id": EXAMPLE_CONVERSATION_ID}) == 1


# -- moving the legacy collection aside ----------------------------------------------------


def test_move_aside_renames_where_the_server_allows_it() -> None:
    db: Any = mongomock.MongoClient()["legacy"]
    db[CONVERSATIONS].insert_many(corpus())
    moved = relocate.relocate(db)
    assert (moved.how, moved.moved) == ("renamed", len(corpus()))
    assert db[LEGACY_TURNS].count_documents({}) == len(corpus())
    assert relocate.relocate(db).how == "already moved"


@pytest.mark.wire
def test_move_aside_copies_when_the_server_refuses_the_rename(
    database: Database[dict[str, Any]],
) -> None:
    seed(database)
    moved = relocate.relocate(database, batch_size=7)
    assert moved.how == "copied"
    assert "refused the rename" in moved.detail
    assert database[LEGACY_TURNS].count_documents({}) == len(corpus())
    assert database[CONVERSATIONS].count_documents({}) == 0


def latency_turn(n: int, latency: Any) -> dict[str, Any]:
    return {"_id": f"t-{n}", "conversation_id": "c-1", "user_id": "u-1",
            "created_at": datetime(2024, 1, 1, n, tzinfo=UTC), "user_message": f"q{n}",
            "response_parts": [{"type": "text", "content": f"a{n}"}],
            "latency_ms": latency}  # fmt: skip


def killed_copy(db: Any, *copied: dict[str, Any]) -> None:
    """What a copy killed part-way leaves: the turns of its last batch inserted, not yet
    deleted from `agent_conversations`, and its copy recorded as under way with that batch."""
    db[LEGACY_TURNS].insert_many([dict(turn) for turn in copied])
    batch = [turn["_id"] for turn in copied]
    digests = [relocate.copied_as(turn) for turn in copied]
    under_way = {
        relocate.COPYING: datetime.now(UTC),
        relocate.IN_FLIGHT: batch,
        relocate.COPIED_AS: digests,
    }
    db[lease.STATE].update_one({"_id": lease.STATE_ID}, {"$set": under_way}, upsert=True)


class Killed(Exception):
    """A run killed where the fence is called."""


@pytest.mark.wire
def test_a_killed_copy_rolled_back_by_copying_with_its_collection_left_standing_is_refused(
    database: Database[dict[str, Any]],
) -> None:
    """A copy killed between batches keeps its record; a rollback then copies the turns back
    and leaves the collection standing. Only the batch a copy was writing when killed can be
    in both collections: turns of its earlier batches there too are no interrupted copy's, so
    the next run refuses (exit 1), moving nothing, and a conversation the old service deleted
    since never comes back."""
    database[CONVERSATIONS].insert_many([latency_turn(n, 7) for n in range(12)])
    fenced = iter(range(2))

    def kill_at_the_second_batch() -> None:
        if next(fenced) == 1:
            raise Killed

    with pytest.raises(Killed):
        relocate.relocate(
            database, batch_size=5, allow_rename=False, fence=kill_at_the_second_batch
        )
    database[CONVERSATIONS].insert_many(list(database[LEGACY_TURNS].find()))  # the rollback
    database[CONVERSATIONS].delete_many({"_id": "t-0"})  # the old service deletes a turn

    with pytest.raises(MigrationError, match=f"drop {LEGACY_TURNS} or rename it away"):
        relocate.relocate(database, batch_size=5)
    assert database[CONVERSATIONS].count_documents({}) == 11
    assert database[LEGACY_TURNS].count_documents({}) == 5


def test_a_rollback_copying_back_a_turn_holding_a_counter_is_still_told_a_rollback() -> None:
    """A rollback by copying puts back, with the turns, a document of the legacy collection
    that holds a conversation document's counter and a turn's field (neither: no run reads
    it). It is no conversation document standing, so it does not hide the rollback: the
    turns' conversations' documents do not stand, and the move is refused with the way out
    of a rollback, nothing moved."""
    db: Any = mongomock.MongoClient()["legacy"]
    db[CONVERSATIONS].insert_many([latency_turn(n, 7) for n in range(3)])
    assert relocate.relocate(db, allow_rename=False).how == "copied"
    db[lease.STATE].update_one({"_id": lease.STATE_ID}, relocate.wrote_documents(), upsert=True)
    neither = latency_turn(9, 7) | {"turn_count": None}
    db[LEGACY_TURNS].insert_one(neither)
    db[CONVERSATIONS].insert_many(list(db[LEGACY_TURNS].find()))  # the rollback

    way_out = f"if a rollback copied the turns back, drop {LEGACY_TURNS}"
    with pytest.raises(MigrationError, match=way_out):
        relocate.relocate(db, allow_rename=False)
    assert db[CONVERSATIONS].count_documents({}) == 4


def test_a_rename_leaves_no_record_of_a_killed_copy_for_a_later_copy_to_act_on() -> None:
    """A copy killed part-way, rolled back, then moved by a rename: the rename moves every
    turn, so nothing of the killed copy's record stands after it (was: the record stayed,
    and a later copy, moving one turn the old service logged since, took the turns it named
    for turns deleted since it was killed and deleted them from the moved-aside turns)."""
    db: Any = mongomock.MongoClient()["legacy"]
    turns = [latency_turn(n, 7) for n in range(3)]
    killed_copy(db, *turns)
    db[CONVERSATIONS].insert_many(turns)  # the rollback puts the turns back
    db[LEGACY_TURNS].drop()

    assert relocate.relocate(db).how == "renamed"
    db[CONVERSATIONS].insert_one(latency_turn(3, 7))  # the old service logs one more
    assert relocate.relocate(db, allow_rename=False).how == "copied"

    assert sorted(t["_id"] for t in db[LEGACY_TURNS].find()) == ["t-0", "t-1", "t-2", "t-3"]


@pytest.mark.wire
def test_a_killed_copy_leaves_alone_a_moved_turn_under_the_id_of_a_turn_it_could_not_copy(
    database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old service logged a turn under the `_id` of a moved one, with other content; the
    copy moving it aside was refused (exit 1, "exists … with other content") or killed with
    that turn in flight. The operator gives the late turn another `_id`, as told: the next
    run leaves the moved turn, which is no copy of the one in flight (was: taken for a copy
    of a turn deleted since, and deleted, its words in no collection)."""
    database[CONVERSATIONS].insert_one(latency_turn(0, 7))
    assert relocate.relocate(database, allow_rename=False).how == "copied"
    late = latency_turn(0, 9)  # t-0 again, other content, logged once the run checked
    database[CONVERSATIONS].insert_one(latency_turn(1, 7))
    checked = relocate.refuse_leftover

    def logged_once_checked(db: Any) -> None:
        checked(db)
        database[CONVERSATIONS].insert_one(late)

    monkeypatch.setattr(relocate, "refuse_leftover", logged_once_checked)
    with pytest.raises(MigrationError, match="other content"):
        relocate.relocate(database, allow_rename=False)
    monkeypatch.setattr(relocate, "refuse_leftover", checked)
    database[CONVERSATIONS].delete_one({"_id": "t-0"})
    database[CONVERSATIONS].insert_one(late | {"_id": "t-0-late"})

    relocate.relocate(database, allow_rename=False)

    moved = {t["_id"]: t["latency_ms"] for t in database[LEGACY_TURNS].find()}
    assert moved == {"t-0": 7, "t-1": 7, "t-0-late": 9}


def test_a_copy_killed_after_copying_an_edit_takes_back_the_copy_of_a_turn_deleted_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old service edits a turn once the copy's insert stands; the copy's check makes the
    copy the edited turn, and the run is killed right after it. The old service then deletes
    the turn: the resumed run takes that copy back, as one of the batch's own (was: kept,
    its digest not recorded, and migrated: the deleted turn came back, `verify` and `finish`
    at 0; with the advice for a turn edited again while down, stored twice)."""
    db: Any = mongomock.MongoClient()["legacy"]
    db[CONVERSATIONS].insert_many([latency_turn(n, 7) for n in range(3)])
    checked = relocate._still_in_source

    def edited_then_killed(batch: Any, source: Any, target: Any, *args: Any) -> Any:
        source.update_one({"_id": "t-1"}, {"$set": {"user_message": "edited"}})
        checked(batch, source, target, *args)
        raise KilledRun

    monkeypatch.setattr(relocate, "_still_in_source", edited_then_killed)
    with pytest.raises(KilledRun):
        relocate.relocate(db, allow_rename=False)
    monkeypatch.setattr(relocate, "_still_in_source", checked)
    db[CONVERSATIONS].delete_one({"_id": "t-1"})  # the old service deletes it meanwhile

    relocate.relocate(db, allow_rename=False)

    assert sorted(t["_id"] for t in db[LEGACY_TURNS].find()) == ["t-0", "t-2"]


def _copy_killed_before_its_check(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A database of three turns whose copy was killed once its first batch's insert stood,
    before its check (`_still_in_source`)."""
    db: Any = mongomock.MongoClient()["legacy"]
    db[CONVERSATIONS].insert_many([latency_turn(n, 7) for n in range(3)])

    def killed_before_the_check(*args: Any) -> Any:
        raise KilledRun

    monkeypatch.setattr(relocate, "_still_in_source", killed_before_the_check)
    with pytest.raises(KilledRun):
        relocate.relocate(db, allow_rename=False)
    monkeypatch.undo()
    return db


def test_a_copy_killed_before_its_check_resumes_with_a_turn_the_old_service_edited_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy is killed once its insert stands, before it checked the source again; while
    it is down the old service edits a turn of that batch. The copy under its `_id` is the
    batch's own (in flight, its digest recorded): the resumed copy makes it the turn as
    edited and moves every turn once (was: refused as another document holding other
    content, exit 1, with advice to give the turn another `_id`, which does not fit)."""
    db = _copy_killed_before_its_check(monkeypatch)
    db[CONVERSATIONS].update_one({"_id": "t-1"}, {"$set": {"latency_ms": 9}})  # while down

    assert relocate.relocate(db, allow_rename=False).how == "copied"

    moved = {t["_id"]: t["latency_ms"] for t in db[LEGACY_TURNS].find()}
    assert moved == {"t-0": 7, "t-1": 9, "t-2": 7}
    assert not relocate.holds_turns(db, CONVERSATIONS)


EDITED_NOT_UTF8 = "edited \udcc3( words"
"""An edit's text stored as bytes that are not valid UTF-8 (`b"\\xc3\\x28"`), as the migration's
client reads it (`surrogateescape`)."""


def edit_to_text_not_utf8(collection: Any, turn_id: str) -> None:
    """The old service edits a turn so its `user_message` holds bytes that are not valid UTF-8:
    written into mongomock's store, which, as PyMongo, refuses to encode such text."""
    documents = collection._store._documents
    documents[turn_id] = {**documents[turn_id], "user_message": EDITED_NOT_UTF8}


def _moved_once_corrected(db: Any, turn_id: str) -> dict[str, Any]:
    """After a copy left `turn_id` in `agent_conversations` for its bytes: the operator corrects
    its text there and runs again. The moved turns' `user_message`s by `_id`."""
    db[CONVERSATIONS].update_one({"_id": turn_id}, {"$set": {"user_message": "corrected"}})
    assert relocate.relocate(db, allow_rename=False).how == "copied"
    assert not relocate.holds_turns(db, CONVERSATIONS)
    return {t["_id"]: t["user_message"] for t in db[LEGACY_TURNS].find()}


def test_a_killed_copy_takes_back_its_copy_of_a_turn_edited_since_to_text_not_valid_utf8(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MIGRATION.md: a copy is killed once its insert stands, before its check; while it is
    down the old service edits a turn of that batch to text that is not valid UTF-8. The
    resumed copy leaves that turn in `agent_conversations` as stored, named, and takes back
    the killed copy's copy of it (the batch's own: in flight, its digest recorded), so no
    stale copy is served or migrated; once the text is corrected the next run moves it once
    (was: the pre-edit copy kept, the copy's records cleared, the next run refused it as
    "other content", and the advice given stored the turn twice)."""
    db = _copy_killed_before_its_check(monkeypatch)
    edit_to_text_not_utf8(db[CONVERSATIONS], "t-1")  # while the copy is down

    moved = relocate.relocate(db, allow_rename=False)

    assert "'t-1' (user_message holds bytes that are not valid UTF-8)" in moved.detail
    assert sorted(t["_id"] for t in db[LEGACY_TURNS].find()) == ["t-0", "t-2"]
    assert [t["user_message"] for t in db[CONVERSATIONS].find()] == [EDITED_NOT_UTF8]
    assert _moved_once_corrected(db, "t-1") == {"t-0": "q0", "t-1": "corrected", "t-2": "q2"}


@pytest.mark.parametrize("seam", ["_still_in_source", "_delete_as_copied", "_read_again"])
def test_a_turn_edited_during_the_copy_to_text_not_valid_utf8_is_left_in_place_and_named(
    monkeypatch: pytest.MonkeyPatch, seam: str
) -> None:
    """MIGRATION.md: the old service edits a turn during the copy, once the batch's insert
    stands, and the edit holds text that is not valid UTF-8: wherever the copy reads the turn
    again (its check, its delete as copied, its read of a turn edited again before the
    delete of its copy made again), it leaves the turn in `agent_conversations` as stored,
    named, its copy taken back, as it leaves one its scan read so, and moves the others
    (was: a UnicodeEncodeError traceback encoding the re-read turn, and the next run kept
    the pre-edit copy)."""
    db: Any = mongomock.MongoClient()["legacy"]
    db[CONVERSATIONS].insert_many([latency_turn(n, 7) for n in range(3)])
    step = getattr(relocate, seam)
    if seam == "_read_again":  # edited before the batch's delete (four deletes on mongomock,
        # whose bulk write deletes one by one), then before the delete of its copy made again
        edit_before_each_delete(monkeypatch, mongomock.collection.Collection, db, "t-1", 5)

    def edited_then(*args: Any) -> Any:
        edit_to_text_not_utf8(db[CONVERSATIONS], "t-1")
        return step(*args)

    monkeypatch.setattr(relocate, seam, edited_then)
    moved = relocate.relocate(db, allow_rename=False)
    monkeypatch.undo()

    assert "'t-1' (user_message holds bytes that are not valid UTF-8)" in moved.detail
    assert sorted(t["_id"] for t in db[LEGACY_TURNS].find()) == ["t-0", "t-2"]
    assert [t["user_message"] for t in db[CONVERSATIONS].find()] == [EDITED_NOT_UTF8]
    assert _moved_once_corrected(db, "t-1") == {"t-0": "q0", "t-1": "corrected", "t-2": "q2"}


def test_a_killed_copy_refuses_a_turn_it_confirmed_that_holds_text_not_valid_utf8_since(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MIGRATION.md: a copy killed once it confirmed its batch (its delete may have run); while
    it is down the old service edits a turn of the batch to text that is not valid UTF-8. The
    resumed copy cannot tell that edit from another turn logged under the moved turn's `_id`,
    as for an edit of other text: it refuses, exit 1, nothing overwritten nor deleted, so no
    stale copy is migrated unsaid (was: the turn left in `agent_conversations`, the pre-edit
    copy kept, the copy's records cleared). Told that it is the moved turn edited, the
    operator deletes the copy and corrects the text: the next run moves it once."""
    db = _copy_killed_after(monkeypatch, "confirmed")
    edit_to_text_not_utf8(db[CONVERSATIONS], "t-1")  # while the copy is down

    with pytest.raises(MigrationError, match="is not the one a killed copy confirmed moving"):
        relocate.relocate(db, allow_rename=False)
    assert db[LEGACY_TURNS].find_one({"_id": "t-1"})["user_message"] == "q1"
    db[LEGACY_TURNS].delete_one({"_id": "t-1"})  # the operator: the moved turn, edited

    relocate.relocate(db, allow_rename=False)
    assert sorted(t["_id"] for t in db[LEGACY_TURNS].find()) == ["t-0", "t-2"]
    assert _moved_once_corrected(db, "t-1") == {"t-0": "q0", "t-1": "corrected", "t-2": "q2"}


@pytest.mark.parametrize(
    ("standing", "refusal"),
    [(EDITED_NOT_UTF8, f"{LEGACY_TURNS} holds turn documents {CONVERSATIONS} holds too, the same"),
     ("other \udcc3( words", "with other content")],
    ids=["the same bytes", "other bytes"],
)  # fmt: skip
def test_a_turn_not_valid_utf8_in_both_collections_is_compared_unencoded(
    standing: str, refusal: str
) -> None:
    """MIGRATION.md: `agent_conversations` holds a turn under the `_id` of a moved turn, both
    holding text that is not valid UTF-8 (a rename moved such a turn, a rollback copied it
    back, or the old service logged another under its `_id`): the check for a leftover
    collection compares them without encoding either and refuses as for clean text, the same
    turn as one a rollback copied back or the old service saved again (no conversation document
    stands to tell which), another as other content (was: a UnicodeEncodeError traceback out
    of the check)."""
    db: Any = mongomock.MongoClient()["legacy"]
    db[LEGACY_TURNS].insert_many([latency_turn(n, 7) for n in range(2)])
    db[CONVERSATIONS].insert_one(latency_turn(1, 7))
    edit_to_text_not_utf8(db[LEGACY_TURNS], "t-1")
    edit_to_text_not_utf8(db[CONVERSATIONS], "t-1")
    documents = db[CONVERSATIONS]._store._documents
    documents["t-1"] = {**documents["t-1"], "user_message": standing}

    with pytest.raises(MigrationError, match=refusal):
        relocate.refuse_leftover(db)


class KilledRun(BaseException):
    """A run killed at a step of a copy batch: nothing of the run catches it, as nothing
    catches a SIGKILL."""


COPY_STEPS = ("recorded", "inserted", "confirmed", "deleted", "released")


class _StepsOf:
    """A collection, or the state's writer, that kills the run right after the step named:
    the state's first write in a batch records it, its second confirms the turns the source
    still holds, its third releases it."""

    def __init__(self, wrapped: Any, kill_after: str) -> None:
        self.wrapped, self.kill_after = wrapped, kill_after
        self.state_steps = iter(("recorded", "confirmed", "released"))

    def __call__(self, update: dict[str, Any]) -> None:
        self.wrapped(update)
        self._done(next(self.state_steps))

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.wrapped, name)
        steps = {"insert_many": "inserted", "delete_many": "deleted", "bulk_write": "deleted"}
        if name not in steps:
            return method

        def step(*args: Any, **kwargs: Any) -> Any:
            try:  # an insert meeting turns a killed copy inserted raises, and is done too
                return method(*args, **kwargs)
            finally:
                self._done(steps[name])

        return step

    def _done(self, step: str) -> None:
        if step == self.kill_after:
            raise KilledRun(step)


def _copy_killed_after(monkeypatch: pytest.MonkeyPatch, step: str) -> Any:
    """A database of three turns whose copy was killed right after its first batch reached
    `step` (`kill_the_first_copy_batch_after`)."""
    db: Any = mongomock.MongoClient()["legacy"]
    db[CONVERSATIONS].insert_many([latency_turn(n, 7) for n in range(3)])
    kill_the_first_copy_batch_after(monkeypatch, step)
    with pytest.raises(KilledRun):
        relocate.relocate(db, allow_rename=False)
    monkeypatch.undo()
    return db


def kill_the_first_copy_batch_after(monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    """The next run is killed right after the first copy batch to reach `step` does
    (`COPY_STEPS`)."""
    copy_batch = relocate._copy_batch

    def killed(
        batch: Any, source: Any, target: Any, progress: Any, fence: Any, state: Any, **more: Any
    ) -> int:
        source, target = _StepsOf(source, step), _StepsOf(target, step)
        return copy_batch(batch, source, target, progress, fence, _StepsOf(state, step), **more)

    monkeypatch.setattr(relocate, "_copy_batch", killed)


@pytest.mark.wire
@pytest.mark.parametrize("second_kill", COPY_STEPS)
def test_a_killed_copy_resumed_with_a_smaller_batch_and_killed_again_resumes(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    second_kill: str,
) -> None:
    """A copy killed with a batch of 200 in both collections, resumed with the default batch
    (100) and killed again at any step, still resumes: the turns of every batch left unfinished stay
    recorded until deleted from `agent_conversations`, so none is taken for a leftover of a
    rollback. Every turn ends moved aside, once (one conversation converted)."""
    start = datetime(2024, 1, 1, tzinfo=UTC)
    turns = [latency_turn(0, 7) | {"_id": f"t-{n}", "conversation_id": f"c-{n}",
             "created_at": start + timedelta(minutes=n)} for n in range(300)]  # fmt: skip
    database[CONVERSATIONS].insert_many(turns)
    kill_the_first_copy_batch_after(monkeypatch, "inserted")
    with pytest.raises(KilledRun):
        cli(wire_uri, database, "run", "--batch-size", "200")
    kill_the_first_copy_batch_after(monkeypatch, second_kill)
    with pytest.raises(KilledRun):
        cli(wire_uri, database, "run", "--force-unlock")
    monkeypatch.undo()

    assert cli(wire_uri, database, "run", "--force-unlock", "--limit", "1") == 0
    assert database[LEGACY_TURNS].count_documents({}) == 300
    assert database[CONVERSATIONS].count_documents(relocate.TURN_FILTER) == 0


@pytest.mark.wire
@pytest.mark.parametrize("latency", [float("nan"), -0.0, 120], ids=["nan", "negative-zero", "int"])
def test_a_killed_copy_resumes_over_the_turns_it_copied_byte_for_byte(
    database: Database[dict[str, Any]], latency: Any
) -> None:
    """A copy killed after inserting a batch and before deleting it resumes: a turn found
    copied is the same when its BSON is, NaN included (which equals nothing in Python)."""
    turns = [latency_turn(n, latency if n == 0 else 7) for n in range(3)]
    database[CONVERSATIONS].insert_many(turns)
    killed_copy(database, *turns)

    assert relocate.relocate(database).how == "copied"
    assert database[LEGACY_TURNS].count_documents({}) == 3
    assert database[CONVERSATIONS].count_documents({}) == 0


@pytest.mark.wire
@pytest.mark.parametrize(
    "turn_id",
    [{"shard": 1, "n": 7}, Decimal128("7")],
    ids=["embedded-document", "decimal128"],
)
def test_a_killed_copy_resumes_over_turns_whose_ids_python_cannot_hash(
    database: Database[dict[str, Any]], turn_id: Any
) -> None:
    """A turn's `_id` may be any BSON value but an array: an embedded document, a Decimal128.
    A resumed copy keys the turns it finds copied by their BSON, never by the Python value."""
    turn = latency_turn(0, 7) | {"_id": turn_id}
    database[CONVERSATIONS].insert_one(turn)
    killed_copy(database, turn)

    assert relocate.relocate(database).how == "copied"
    assert database[LEGACY_TURNS].count_documents({}) == 1
    assert database[CONVERSATIONS].count_documents({}) == 0


@pytest.mark.wire
@pytest.mark.parametrize(
    ("latency", "copied"),
    [(0.0, -0.0), (120, 120.0), (120, Int64(120))],
    ids=["negative-zero", "int-and-float", "int32-and-int64"],
)
def test_a_killed_copy_never_takes_a_copy_its_bson_tells_apart_as_its_turn(
    database: Database[dict[str, Any]], latency: Any, copied: Any
) -> None:
    """Python equality is not identity: `0.0 == -0.0` and `120 == 120.0`, which BSON tells
    apart. A document under the `_id` of a turn in flight that is neither that turn nor the
    copy the killed copy recorded (its digest that of the turn) is refused, nothing
    deleted."""
    database[CONVERSATIONS].insert_one(latency_turn(0, latency))
    killed_copy(database, latency_turn(0, copied))
    recorded = {relocate.COPIED_AS: [relocate.copied_as(latency_turn(0, latency))]}
    database[lease.STATE].update_one({"_id": lease.STATE_ID}, {"$set": recorded})

    with pytest.raises(MigrationError, match="exists in agent_conversations_deprecated with other"):
        relocate.relocate(database)
    assert database[CONVERSATIONS].count_documents({}) == 1


def conversation_document(conversation_id: str) -> dict[str, Any]:
    """A conversation document as the store writes it."""
    at = datetime(2024, 1, 1, tzinfo=UTC)
    found = Conversation(
        id=conversation_id, conversation_id=conversation_id, created_at=at, updated_at=at
    )
    return found.model_dump(by_alias=True)


def test_move_aside_copies_only_turns_when_conversations_are_mixed_in() -> None:
    """A copy killed part-way resumes, copying the turns only, and records no copy under
    way once every turn moved."""
    db: Any = mongomock.MongoClient()["legacy"]
    db[CONVERSATIONS].insert_many([*corpus(), conversation_document("new-conv")])
    killed_copy(db, corpus()[0])
    moved = relocate.relocate(db, batch_size=5)
    assert moved.how == "copied"
    assert db[CONVERSATIONS].distinct("_id") == ["new-conv"]
    assert db[LEGACY_TURNS].count_documents({}) == len(corpus())
    assert relocate.COPYING not in db[lease.STATE].find_one({"_id": lease.STATE_ID})


def test_a_turn_the_old_service_edits_while_its_batch_is_copied_is_moved_as_edited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old service edits a turn after the copy read its batch, before the copy's insert:
    the copy reads the batch's turns again once their copies stand and moves the edit, not
    the turn as first read."""
    db: Any = mongomock.MongoClient()["legacy"]
    db[CONVERSATIONS].insert_many(corpus())
    edited = corpus()[0]["_id"]
    copy_batch = relocate._copy_batch

    def edited_meanwhile(batch: Any, *args: Any, **kwargs: Any) -> int:
        db[CONVERSATIONS].update_one({"_id": edited}, {"$set": {"user_message": "EDITED"}})
        return copy_batch(batch, *args, **kwargs)

    monkeypatch.setattr(relocate, "_copy_batch", edited_meanwhile)
    relocate.relocate(db, allow_rename=False)

    assert db[LEGACY_TURNS].find_one({"_id": edited})["user_message"] == "EDITED"
    assert db[LEGACY_TURNS].count_documents({}) == len(corpus())


def edit_before_each_delete(
    monkeypatch: pytest.MonkeyPatch, collection_class: Any, db: Any, turn_id: Any, times: int
) -> list[str]:
    """The old service edits `turn_id` in `agent_conversations` right before each of the
    first `times` deletes there (after the copy's last read of its batch): the edits made,
    in order."""
    edits: list[str] = []

    def editing(name: str) -> Any:
        original = getattr(collection_class, name)

        def delete(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.name == CONVERSATIONS and len(edits) < times:
                edits.append(f"EDITED {len(edits) + 1}")
                edit = {"$set": {"user_message": edits[-1]}}
                db[CONVERSATIONS].update_one({"_id": turn_id}, edit)
            return original(self, *args, **kwargs)

        return delete

    for name in ("delete_many", "delete_one", "bulk_write"):
        monkeypatch.setattr(collection_class, name, editing(name))
    return edits


def test_a_turn_the_old_service_edits_between_the_copys_check_and_its_delete_is_moved_as_edited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old service edits a turn after the copy read its batch again, right before the
    batch's delete: the delete takes a turn only while it is what was copied, so the edited
    turn is copied again as edited, then moved; no edit is lost."""
    db: Any = mongomock.MongoClient()["legacy"]
    db[CONVERSATIONS].insert_many(corpus())
    edited = corpus()[0]["_id"]
    edits = edit_before_each_delete(monkeypatch, mongomock.collection.Collection, db, edited, 1)

    assert relocate.relocate(db, allow_rename=False).moved == len(corpus())

    assert edits == ["EDITED 1"]
    assert db[LEGACY_TURNS].find_one({"_id": edited})["user_message"] == "EDITED 1"
    assert db[LEGACY_TURNS].count_documents({}) == len(corpus())
    assert not relocate.holds_turns(db, CONVERSATIONS)


def test_a_turn_the_old_service_edits_before_every_delete_stays_in_place_edited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old service edits a turn again before each of the copy's deletes: after a few
    rounds the turn stays in `agent_conversations` as last edited, its copy taken back, the
    rest of its batch moved and no record of it in flight: the gate refuses while it stands
    there (work left), and the next run, the old service still, moves it as edited."""
    db: Any = mongomock.MongoClient()["legacy"]
    db[CONVERSATIONS].insert_many(corpus())
    edited = corpus()[0]["_id"]
    edits = edit_before_each_delete(monkeypatch, mongomock.collection.Collection, db, edited, 100)

    assert relocate.relocate(db, allow_rename=False).moved == len(corpus()) - 1

    assert db[CONVERSATIONS].find_one({"_id": edited})["user_message"] == edits[-1]
    assert db[CONVERSATIONS].count_documents({}) == 1
    assert db[LEGACY_TURNS].find_one({"_id": edited}) is None
    assert db[LEGACY_TURNS].count_documents({}) == len(corpus()) - 1
    state = db[MIGRATION_STATE].find_one({}) or {}
    assert not state.get(relocate.IN_FLIGHT)
    assert not state.get(relocate.CONFIRMED)
    monkeypatch.undo()

    assert relocate.relocate(db, allow_rename=False).moved == 1
    assert db[LEGACY_TURNS].find_one({"_id": edited})["user_message"] == edits[-1]
    assert not relocate.holds_turns(db, CONVERSATIONS)


@pytest.mark.parametrize("logged_in", ["another conversation", "the same conversation"])
def test_a_turn_logged_under_the_id_of_one_a_killed_copy_moved_never_overwrites_it(
    monkeypatch: pytest.MonkeyPatch, logged_in: str
) -> None:
    """A copy killed right after its batch's delete moved `t-1`; while it is down the old
    service logs another turn under that `_id`. The resumed copy cannot tell it from an edit
    of `t-1` the delete missed: it refuses, exit 1, and the moved turn stays as moved (was:
    taken for the killed copy's own, confirmed, and overwritten: its words in no collection,
    `run`, `verify` and `finish` at 0)."""
    db = _copy_killed_after(monkeypatch, "deleted")
    conversation = (
        "c-other" if logged_in == "another conversation" else latency_turn(1, 7)["conversation_id"]
    )
    db[CONVERSATIONS].insert_one(latency_turn(1, 9) | {"conversation_id": conversation})

    for _ in range(2):  # refused, and again: the refused run's own records take no part
        with pytest.raises(MigrationError, match="'t-1'") as refused:
            relocate.relocate(db, allow_rename=False)
        said = str(refused.value)  # whose each is, so the operator can tell them apart
        assert f"({'conversation ' + repr(conversation)}, user 'u-1'" in said
        assert "holds as that copy read it (conversation 'c-1', user 'u-1'" in said

    moved = db[LEGACY_TURNS].find_one({"_id": "t-1"})
    assert (moved["conversation_id"], moved["latency_ms"]) == ("c-1", 7)
    assert db[CONVERSATIONS].find_one({"_id": "t-1"})["latency_ms"] == 9


def test_a_copy_killed_after_an_edit_foiled_its_delete_refuses_until_the_operator_says_which(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy killed after the old service's edit, made once the copy confirmed the turn, kept
    the turn from its delete: the resumed copy cannot tell that edit from another turn logged
    under the moved turn's `_id` (a killed copy's delete may have moved it), so it refuses,
    exit 1, nothing overwritten nor deleted. Told that the turn is the moved one edited, the
    operator deletes its stale copy, as the refusal says: the next run moves the turn as
    edited, and every other turn once (was: taken as the copy's own whatever it was, which
    overwrote a moved turn under a reused `_id`)."""
    db: Any = mongomock.MongoClient()["legacy"]
    db[CONVERSATIONS].insert_many(corpus())
    edited = corpus()[0]["_id"]
    edit_before_each_delete(monkeypatch, mongomock.collection.Collection, db, edited, 1)
    original = mongomock.collection.Collection.find
    finds = []

    def killed_at_the_check_after_the_edit(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.name == CONVERSATIONS and args and "_id" in args[0]:
            finds.append(1)
            if len(finds) == 2:  # the batch's read after its delete
                raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(mongomock.collection.Collection, "find", killed_at_the_check_after_the_edit)
    with pytest.raises(KeyboardInterrupt):
        relocate.relocate(db, allow_rename=False)
    monkeypatch.undo()

    with pytest.raises(MigrationError, match="is not the one a killed copy confirmed moving"):
        relocate.relocate(db, allow_rename=False)
    assert db[LEGACY_TURNS].find_one({"_id": edited})["user_message"] == corpus()[0]["user_message"]
    assert db[CONVERSATIONS].find_one({"_id": edited})["user_message"] == "EDITED 1"
    db[LEGACY_TURNS].delete_one({"_id": edited})  # the operator: the moved turn, edited

    relocate.relocate(db, allow_rename=False)

    assert db[LEGACY_TURNS].find_one({"_id": edited})["user_message"] == "EDITED 1"
    assert db[LEGACY_TURNS].count_documents({}) == len(corpus())
    assert not relocate.holds_turns(db, CONVERSATIONS)


@pytest.mark.parametrize(
    "kill_after", ["replace_one", "delete_many"], ids=["recopied", "taken-back"]
)
def test_a_copy_killed_while_it_copies_an_edited_turn_again_resumes_losing_and_reviving_none(
    monkeypatch: pytest.MonkeyPatch, kill_after: str
) -> None:
    """The old service edits a turn before each of the copy's deletes; the copy is killed
    right after it made the turn's copy the turn as edited, or right after it took that
    copy back: the resumed copy (the old service stopped) moves the turn as last edited and
    every other turn once."""
    db: Any = mongomock.MongoClient()["legacy"]
    db[CONVERSATIONS].insert_many(corpus())
    edited = corpus()[0]["_id"]
    edits = edit_before_each_delete(monkeypatch, mongomock.collection.Collection, db, edited, 100)
    original = getattr(mongomock.collection.Collection, kill_after)

    def killed_after(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if self.name == LEGACY_TURNS:
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(mongomock.collection.Collection, kill_after, killed_after)
    with pytest.raises(KeyboardInterrupt):
        relocate.relocate(db, allow_rename=False)
    monkeypatch.undo()

    relocate.relocate(db, allow_rename=False)

    assert db[LEGACY_TURNS].find_one({"_id": edited})["user_message"] == edits[-1]
    assert db[LEGACY_TURNS].count_documents({}) == len(corpus())
    assert not relocate.holds_turns(db, CONVERSATIONS)


@pytest.mark.wire
def test_on_the_wire_server_an_edit_before_the_copys_delete_is_moved(
    wire_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delete's condition (the turn is still what was copied) holds on the wire server:
    the turn edited before the delete is moved as edited, the others as copied."""
    client: MongoClient[dict[str, Any]] = MongoClient(wire_uri)
    db = client[f"edit_{uuid.uuid4().hex[:8]}"]
    try:
        turns = corpus(1)
        db[CONVERSATIONS].insert_many(turns)
        edited = turns[1]["_id"]
        collection_class = type(db[CONVERSATIONS])
        edit_before_each_delete(monkeypatch, collection_class, db, edited, 1)

        relocate.relocate(db, allow_rename=False)

        assert (db[LEGACY_TURNS].find_one({"_id": edited}) or {})["user_message"] == "EDITED 1"
        assert db[LEGACY_TURNS].count_documents({}) == len(turns)
        assert not relocate.holds_turns(db, CONVERSATIONS)
    finally:
        client.drop_database(db.name)
        client.close()


def test_move_aside_moves_every_legacy_turn_whatever_fields_it_holds_or_lacks() -> None:
    """A document of `agent_conversations` is a conversation document when it holds the
    counters the store writes on every one (`message_count`, `turn_count`); every other
    document is a legacy turn and moves, a turn of calls only, of a history only, or bare."""
    db: Any = mongomock.MongoClient()["legacy"]
    odd = [
        {"_id": "t-calls", "conversation_id": "c-odd",
         "tool_calls": [{"tool_name": "book_flight", "args": {"flight": "LH400"}}]},
        {"_id": "t-history", "conversation_id": "c-odd", "message_history_json": "[]"},
        {"_id": "t-bare", "conversation_id": "c-odd"},
    ]  # fmt: skip
    db[CONVERSATIONS].insert_many([conversation_document("new-conv"), *odd, *corpus()])

    assert relocate.relocate(db, batch_size=2).how == "copied"

    assert db[CONVERSATIONS].distinct("_id") == ["new-conv"]
    assert db[LEGACY_TURNS].count_documents({}) == len(corpus()) + len(odd)


@pytest.mark.wire
def test_the_copy_scans_the_collection_once_whatever_is_mixed_in(wire_uri: str) -> None:
    """With conversation documents mixed in, a scan from the start per batch is quadratic.
    Beside the one scan, each batch reads its own turns again by their `_id`s (which the
    source still holds once their copies stand), never more."""
    log = Finds()
    client: MongoClient[dict[str, Any]] = MongoClient(wire_uri, event_listeners=[log])
    db = client[f"copy_{uuid.uuid4().hex[:8]}"]
    try:
        db[CONVERSATIONS].insert_many([conversation_document(f"a-conv-{n}") for n in range(5)])
        db[CONVERSATIONS].insert_many(corpus())
        log.filters.clear()
        relocate.relocate(db, batch_size=5, allow_rename=False)
        scans = [f for f in log.filters if "_id" not in f]
        by_ids = [f for f in log.filters if "_id" in f]
        assert scans == [relocate.TURN_FILTER]
        assert len(by_ids) == -(-len(corpus()) // 5)
        assert all(len(f["_id"]["$in"]) <= 5 for f in by_ids)
        assert db[LEGACY_TURNS].count_documents({}) == len(corpus())
    finally:
        client.drop_database(db.name)
        client.close()


@pytest.mark.wire
def test_turns_at_the_same_time_keep_their_stored_order_when_copied_aside(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """Two app servers logged two turns in the same millisecond; the first stored has the
    larger ObjectId. A copy in `_id` order would swap them (and their last user, the owner)."""
    small, large = sorted([ObjectId(), ObjectId()])
    at = datetime(2024, 3, 1, 12, 0, tzinfo=UTC)
    database[CONVERSATIONS].insert_many(
        [{"_id": large, "conversation_id": "conv-tie", "user_id": "alice", "created_at": at,
          "user_message": "FIRST", "response_text": "one"},
         {"_id": small, "conversation_id": "conv-tie", "user_id": "bob", "created_at": at,
          "user_message": "SECOND", "response_text": "two"}]
    )  # fmt: skip

    assert cli(wire_uri, database, "run") == 0

    said = database[MESSAGES].find({"conversation_id": "conv-tie", "role": "user"}).sort("seq")
    assert [m["content"] for m in said] == ["FIRST", "SECOND"]
    assert database[CONVERSATIONS].find_one({"_id": "conv-tie"})["user_id"] == "bob"


class Finds(monitoring.CommandListener):
    """The filters of the `find` commands the server ran on the conversations reading more
    than one document (the copy's scans)."""

    def __init__(self) -> None:
        self.filters: list[dict[str, Any]] = []
        self._started: dict[int, dict[str, Any]] = {}

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        command = event.command
        scan = event.command_name == "find" and "limit" not in command
        if scan and command["find"] == CONVERSATIONS:
            self._started[event.request_id] = dict(command.get("filter", {}))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.request_id in self._started:
            self.filters.append(self._started.pop(event.request_id))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self._started.pop(event.request_id, None)


# -- kills at any moment -------------------------------------------------------------------


def run_process(
    wire_uri: str,
    db_name: str,
    *args: str,
    kill_after_lines: int | None = None,
    kill_after_seconds: float | None = None,
    kill_with: signal.Signals = signal.SIGKILL,
) -> int:
    command = [sys.executable, "-m", "migrations", "run", "--database", db_name]
    command += ["--batch-size", "1", "--progress", "lines", *args]
    env = {**os.environ, "MONGODB_URI": wire_uri}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    assert process.stderr is not None
    if kill_after_seconds is not None:
        time.sleep(kill_after_seconds)
        process.send_signal(signal.SIGKILL)
    elif kill_after_lines is not None:
        seen = 0
        for line in process.stderr:
            seen += line.startswith("progress:")
            if seen >= kill_after_lines:
                process.send_signal(kill_with)
                break
    process.communicate(timeout=120)
    return process.returncode


@pytest.mark.wire
def test_killing_the_migration_at_any_point_then_resuming_gives_the_uninterrupted_result(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    client = database.client
    reference = client[database.name + "_ref"]
    try:
        seed(reference, conversations=24)
        assert run_process(wire_uri, reference.name) == 0
        expected = digest(reference)
    finally:
        client.drop_database(reference.name)

    seed(database, conversations=24)
    # While moving the legacy turns aside (or starting), then after each resumed run's first batch.
    assert run_process(wire_uri, database.name, kill_after_seconds=0.8) == -signal.SIGKILL
    states = [digest(database)]
    for kill_after in (1, 1, 1):
        killed = run_process(wire_uri, database.name, "--force-unlock", kill_after_lines=kill_after)
        assert killed == -signal.SIGKILL
        states.append(digest(database))
    # How far each killed run got depends on the machine's speed; at least one stopped part-way.
    assert any(state != expected for state in states)

    assert run_process(wire_uri, database.name, "--force-unlock") == 0

    assert digest(database) == expected
    statuses = [r["status"] for r in database["agent_migrations"].find({"kind": "run"})]
    assert sorted(set(statuses)) == ["completed", "interrupted"]


@pytest.mark.wire
def test_each_batch_draws_its_conversations_from_across_the_id_space(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """Sorted order would send a batch's writes to one chunk of a sharded agent_messages."""
    database[CONVERSATIONS].insert_many(list(legacy_corpus(32, turns=1, text_chars=5)))
    relocate.relocate(database)
    everything = sorted(database[LEGACY_TURNS].distinct("conversation_id"))
    seen: list[list[str]] = []
    run = explode.Explosion(database, explode.Options(batch_size=4, spread=4, limit=12), lease=None)
    real_batch = run.batch
    run.batch = lambda ids: (seen.append(list(ids)), real_batch(ids))[1]  # type: ignore[method-assign]

    run.run(run.plan(None))
    resumed = explode.Explosion(database, explode.Options(batch_size=4, spread=4), lease=None)
    resumed.batch = lambda ids: (seen.append(list(ids)), real_batch(ids))[1]  # type: ignore[method-assign]
    ranges = resumed.resume_point()
    assert ranges is not None
    resumed.run(resumed.plan(ranges))

    done = [cid for batch in seen for cid in batch]
    assert sorted(done) == everything  # each conversation once, after a stop and a resume
    quarter = len(everything) // 4
    for batch in seen[:3]:
        positions = sorted(everything.index(cid) for cid in batch)
        assert len({p // quarter for p in positions}) == 4, positions  # one id from each quarter


@pytest.mark.parametrize(
    ("ids", "warned"),
    [
        pytest.param([f"{n:024x}" for n in range(40)], True, id="object-ids"),
        pytest.param(
            [f"0190{n:04x}-aaaa-7bbb-8ccc-000000000000" for n in range(40)], True, id="uuid-v7"
        ),
        pytest.param([str(uuid.uuid4()) for _ in range(40)], False, id="uuid-v4"),
    ],
)
def test_status_reports_legacy_ids_that_would_cluster_on_a_sharded_cluster(
    ids: list[str], warned: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    db: Any = mongomock.MongoClient()["legacy"]
    db[LEGACY_TURNS].insert_many(
        [{"conversation_id": cid, "user_message": "hi", "response_parts": []} for cid in ids]
    )
    _report_id_clustering(db, LEGACY_TURNS)
    out = capsys.readouterr().out
    assert ("time-ordered" in out) is warned
    assert ("spread evenly" in out) is not warned


@pytest.mark.wire
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_run_stopped_by_a_signal_releases_the_lock_and_the_next_resumes(
    wire_uri: str, database: Database[dict[str, Any]], stop: signal.Signals
) -> None:
    # Enough conversations left after the second line that the run is still going when the
    # signal comes, however busy the machine keeps this test from reading that line.
    seed(database, conversations=30)

    assert run_process(wire_uri, database.name, kill_after_lines=2, kill_with=stop) == 128 + stop

    assert database[lease.STATE].find_one({"_id": lease.LOCK_ID}) is None
    assert run_process(wire_uri, database.name, "--wait-seconds", "0") == 0
    assert cli(wire_uri, database, "verify") == 0


def embedded_data_dir_seeded(data_dir: Path, conversations: int) -> None:
    """`data_dir` holding an embedded database of legacy turns, no server running on it."""
    server = embedded.ServerThread(data_dir)
    client: MongoClient[dict[str, Any]] = MongoClient(server.start(), tz_aware=True)
    seed(client["agent_store"], conversations)
    client.close()
    server.stop()


@pytest.mark.wire
def test_a_sigterm_on_the_embedded_database_a_run_opened_exits_143_whatever_its_close_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stopped by SIGTERM part-way, the run closes the embedded server it opened: mongoeco's
    close may fail (an `ExceptionGroup` of its cleanup, the run's connection cut mid-command),
    which never takes the place of the signal's exit (143, one line, never a traceback with
    exit 1, "differences found"). The lock is released and the next run converges."""
    from mongoeco.wire.proxy import AsyncMongoEcoProxyServer

    monkeypatch.delenv("MONGODB_URI", raising=False)
    monkeypatch.setenv("AGENT_STORE_DATA_DIR", str(tmp_path))
    embedded_data_dir_seeded(tmp_path, conversations=6)
    real_batch, real_close = explode.Explosion.batch, AsyncMongoEcoProxyServer.close

    def batch(run: explode.Explosion, ids: list[Any]) -> None:
        real_batch(run, ids)
        if run.counts.conversations >= 2:
            raise Stopped  # SIGTERM, raised where the run is

    async def close(server: AsyncMongoEcoProxyServer) -> None:
        await real_close(server)
        raise ExceptionGroup("proxy cleanup failed", [ConnectionResetError(104, "reset")])

    def loop_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.endswith("(run_forever)")}

    before = loop_threads()
    with (
        mock.patch.object(explode.Explosion, "batch", batch),
        mock.patch.object(AsyncMongoEcoProxyServer, "close", close),
    ):
        assert main(["run", "--batch-size", "1", "--progress", "none"]) == 128 + signal.SIGTERM
    said = capsys.readouterr().err
    assert said.startswith("stopped by SIGTERM: the lock is released"), said
    assert said.count("\n") == 1, said
    assert loop_threads() <= before  # the server's thread ended all the same

    assert main(["run", "--progress", "none", "--wait-seconds", "0"]) == 0
    assert main(["verify", "--progress", "none"]) == 0


def resumes_after_each_id(db: Database[dict[str, Any]], ids: list[Any]) -> None:
    """Every id read once, and a resume after any of them reads exactly those after it."""
    from migrations.order import Ranges, range_ids

    db["turns"].insert_many([{"conversation_id": i} for i in ids] + [{}])
    every = list(range_ids(db, "turns", {}))
    assert sorted(map(bson_key, (i for _, i in every))) == sorted(map(bson_key, [*ids, None]))
    for n, (kind, found) in enumerate(every):
        resumed = Ranges(done={"0": found}, kinds={"0": kind})
        assert list(range_ids(db, "turns", {}, resumed, 0)) == every[n + 1 :], (kind, found)


def bson_key(value: Any) -> bytes:
    from migrations.keys import id_key

    return id_key(value)


def ids_of_every_kind() -> list[Any]:
    from bson import Binary, Code

    return [
        1, 2, Int64(2**40), Int64(-(2**40)), 2.5, -3.5, "a", "b", "s", ObjectId(), ObjectId(),
        True, False, datetime(2024, 1, 1, tzinfo=UTC), datetime(2020, 1, 1, tzinfo=UTC),
        ["x", 1], [3, 1], [2], {"a": 1}, {"b": 0}, Binary(b"x", 5), Code("c"),
    ]  # fmt: skip


def test_a_resume_past_a_checkpoint_reads_every_id_after_it_whatever_its_bson_type() -> None:
    """No order across BSON types is assumed: a resume after a number reaches the strings,
    ObjectIds, booleans, dates, arrays and documents, and one after a text id the numbers."""
    resumes_after_each_id(mongomock.MongoClient(tz_aware=True)["resume"], ids_of_every_kind())


@pytest.mark.wire
def test_a_resume_past_a_checkpoint_reads_every_id_after_it_on_the_embedded_server(
    database: Database[dict[str, Any]],
) -> None:
    """The embedded server sorts 64-bit integers after text, across types."""
    resumes_after_each_id(database, [*ids_of_every_kind(), Decimal128("4.5")])


def typed_turn(conversation_id: Any, n: int) -> dict[str, Any]:
    return {
        "_id": f"typed-{n}",
        "conversation_id": conversation_id,
        "user_id": f"user-{n}",
        "created_at": datetime(2021, 3, 1, 10, n, tzinfo=UTC),
        "user_message": f"question {n}",
        "response_parts": [{"type": "text", "content": f"answer {n}"}],
    }


@pytest.mark.wire
def test_a_run_resumed_slice_by_slice_reaches_ids_the_server_sorts_after_text(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The embedded server sorts 64-bit integers after text: a resume past a text id must still
    reach them, and no run says the migration is complete while one is left."""
    ids = [7, Int64(2**40), "s"]
    database[CONVERSATIONS].insert_many([typed_turn(cid, n) for n, cid in enumerate(ids)])

    for _ in ids:
        assert cli(wire_uri, database, "run", "--limit", "1") == 0
        state = database[lease.STATE].find_one({"_id": lease.STATE_ID}) or {}
        migrated = database[CONVERSATIONS].count_documents({})
        assert state.get("complete") is (migrated == len(ids)), (migrated, state)

    assert sorted(database[CONVERSATIONS].distinct("_id")) == ["1099511627776", "7", "s"]
    assert cli(wire_uri, database, "finish") == 0


def numbered_turn(conversation_id: str, n: int) -> dict[str, Any]:
    return {
        "conversation_id": conversation_id,
        "user_id": "u1",
        "created_at": datetime(2024, 1, 1, tzinfo=UTC) + timedelta(minutes=n),
        "user_message": f"question {n}",
        "response_text": f"answer {n}",
    }


def stopped_run_then_late_turns(wire_uri: str, db: Database[dict[str, Any]], spread: str) -> None:
    """A run stopped half-way (`--limit`), then an old-service writer logging a turn to a
    conversation it migrated (`c-00`) and a new conversation (`c-00a`), both below every
    checkpoint."""
    db[CONVERSATIONS].insert_many([numbered_turn(f"c-{n:02d}", n) for n in range(12)])
    assert cli(wire_uri, db, "run", "--limit", "6", "--batch-size", "2", "--spread", spread) == 0
    assert db[CONVERSATIONS].find_one({"_id": "c-00"}) is not None
    db[CONVERSATIONS].insert_many([numbered_turn("c-00", 20), numbered_turn("c-00a", 21)])


@pytest.mark.wire
@pytest.mark.parametrize("spread", ["16", "1"])
def test_a_resumed_run_migrates_the_turns_its_move_brought_in_below_a_checkpoint(
    wire_uri: str, database: Database[dict[str, Any]], spread: str
) -> None:
    """Turns an old-service writer logged after a stopped run's move sort anywhere: the run
    resuming it moves them aside and migrates their conversations, whatever the checkpoints,
    before it says the migration is complete."""
    stopped_run_then_late_turns(wire_uri, database, spread)

    assert cli(wire_uri, database, "run") == 0

    assert database[CONVERSATIONS].find_one({"_id": "c-00a"}) is not None
    assert database[MESSAGES].count_documents({"conversation_id": "c-00"}) == 4
    state = database[lease.STATE].find_one({"_id": lease.STATE_ID}) or {}
    assert state.get("complete") is True
    assert cli(wire_uri, database, "verify") == 0


@pytest.mark.wire
def test_the_conversations_a_resumed_move_brought_in_stay_owed_until_a_run_migrates_them(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A run stopped after such a move, before it migrated all they name, leaves them to the
    next run (the move records them first), and says the migration is not complete."""
    stopped_run_then_late_turns(wire_uri, database, "16")

    assert cli(wire_uri, database, "run", "--limit", "1", "--batch-size", "1") == 0
    state = database[lease.STATE].find_one({"_id": lease.STATE_ID}) or {}
    assert state.get("complete") is False
    assert cli(wire_uri, database, "run") == 0

    assert database[CONVERSATIONS].find_one({"_id": "c-00a"}) is not None
    assert database[MESSAGES].count_documents({"conversation_id": "c-00"}) == 4
    assert cli(wire_uri, database, "verify") == 0


def stopped_state(db: Database[dict[str, Any]]) -> None:
    """The state of a run stopped in one range after `c-05`."""
    stopped = {"ranges": [None], "done": {"0": "c-05"}, "kinds": {"0": "string"}}
    db[lease.STATE].insert_one({"_id": lease.STATE_ID, **stopped, "complete": False})


def test_a_move_bringing_in_more_conversations_than_listed_makes_the_next_run_start_over(
    database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Conversations a move brings in under unfinished ranges past what the state lists
    (`relocate.LATE_MAX`): the next run cuts new ranges, reaching every id, and its
    checkpoint clears the record."""
    monkeypatch.setattr(relocate, "LATE_MAX", 2)
    stopped_state(database)
    database[LEGACY_TURNS].insert_many([numbered_turn(f"c-{n:02d}", n) for n in range(6)])
    database[CONVERSATIONS].insert_many([numbered_turn(f"c-0{n}a", 10 + n) for n in range(3)])

    assert relocate.relocate(database, batch_size=1, late=True).how == "copied"
    state = database[lease.STATE].find_one({"_id": lease.STATE_ID}) or {}
    assert state.get(relocate.LATE_OVERFLOW) is True
    assert relocate.LATE not in state

    run = explode.Explosion(database, explode.Options(), lease=None)
    assert run.resume_point() is None
    run.run(run.plan(None))
    assert {"c-00a", "c-01a", "c-02a"} <= set(database[CONVERSATIONS].distinct("_id"))
    state = database[lease.STATE].find_one({"_id": lease.STATE_ID}) or {}
    assert state["complete"] is True
    assert relocate.LATE_OVERFLOW not in state


def test_a_rename_under_unfinished_ranges_makes_the_next_run_start_over() -> None:
    """A rename moves every turn at once: none is listed, the ranges are cut again."""
    db: Any = mongomock.MongoClient()["legacy"]
    stopped_state(db)
    db[CONVERSATIONS].insert_many([numbered_turn(f"c-0{n}a", n) for n in range(3)])

    assert relocate.relocate(db, late=True).how == "renamed"
    state = db[lease.STATE].find_one({"_id": lease.STATE_ID}) or {}
    assert state.get(relocate.LATE_OVERFLOW) is True
    assert explode.Explosion(db, explode.Options(), lease=None).resume_point() is None


LONG_ID = "x" * 100_000
"""A legacy conversation id of 100 KB: free text, stored under a derived id."""


@pytest.mark.parametrize("batch_size", [100, 5])
def test_a_move_bringing_in_more_bytes_of_ids_than_listed_makes_the_next_run_start_over(
    batch_size: int,
) -> None:
    """Conversation ids are free text of any length: the conversations a move brings in under
    unfinished ranges are listed only while their ids fit a byte budget well under the 16 MB
    of the one state document (`relocate.LATE_MAX_BYTES`), in one copy batch (100) as across
    many (5); past it, the next run cuts new ranges, as past `relocate.LATE_MAX`."""
    db: Any = mongomock.MongoClient()["legacy"]
    stopped_state(db)
    db[LEGACY_TURNS].insert_many([numbered_turn(f"c-{n:02d}", n) for n in range(6)])
    db[CONVERSATIONS].insert_many([numbered_turn(f"{n:04d}{LONG_ID}", n) for n in range(70)])

    assert relocate.relocate(db, batch_size=batch_size, late=True).how == "copied"
    state = db[lease.STATE].find_one({"_id": lease.STATE_ID}) or {}
    assert state.get(relocate.LATE_OVERFLOW) is True
    assert relocate.LATE not in state
    assert explode.Explosion(db, explode.Options(), lease=None).resume_point() is None


def test_a_listed_record_past_the_byte_budget_makes_the_next_run_start_over() -> None:
    """A state listing more bytes of ids than the budget (an earlier version wrote it, on a
    server that let the document grow): the run cuts new ranges, owing none of them, so its
    checkpoints clear the record instead of writing it again."""
    db: Any = mongomock.MongoClient()["legacy"]
    stopped_state(db)
    owed = [f"{n:04d}{LONG_ID}" for n in range(70)]
    db[lease.STATE].update_one({"_id": lease.STATE_ID}, {"$set": {relocate.LATE: owed}})

    run = explode.Explosion(db, explode.Options(), lease=None)
    assert run.resume_point() is None
    assert run.late == {}


@pytest.mark.wire
def test_a_restarted_run_records_no_late_conversations_for_ranges_it_cuts_again(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run --restart` starts over: its move, under a stopped run's ranges, lists none of the
    conversations it brings in, only that the ranges are cut again, so a restart stopped
    before its first checkpoint leaves the next run starting over too."""
    stopped_state(database)
    database[LEGACY_TURNS].insert_many([numbered_turn(f"c-{n:02d}", n) for n in range(6)])
    database[CONVERSATIONS].insert_many([numbered_turn(f"c-0{n}a", 10 + n) for n in range(3)])

    def stopped(self: explode.Explosion, ranges: explode.Ranges) -> explode.Counts:
        raise KeyboardInterrupt

    monkeypatch.setattr(explode.Explosion, "run", stopped)
    assert cli(wire_uri, database, "run", "--restart") == 130
    state = database[lease.STATE].find_one({"_id": lease.STATE_ID}) or {}
    assert state.get(relocate.LATE_OVERFLOW) is True
    assert relocate.LATE not in state
    monkeypatch.undo()
    assert cli(wire_uri, database, "run") == 0
    assert database[CONVERSATIONS].count_documents({"_id": {"$regex": "^c-0"}}) == 9
    assert cli(wire_uri, database, "verify") == 0


@pytest.mark.wire
def test_a_write_the_driver_refuses_as_too_large_is_exit_4_with_a_message(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A document or command over the 16 MB a server takes is a database refusal: exit 4 and
    one line saying so, never a traceback (exit 1 is work left)."""
    database[CONVERSATIONS].insert_one(numbered_turn("c-00", 0))

    def too_large(*args: Any, **kwargs: Any) -> Any:
        database[lease.STATE].update_one({"_id": "big"}, {"$set": {"x": "x" * (17 << 20)}})

    monkeypatch.setattr(relocate, "relocate", too_large)
    assert cli(wire_uri, database, "run") == 4
    err = capsys.readouterr().err
    assert "error: the database refused" in err
    assert "too large" in err
    assert "Traceback" not in err


OUT_OF_RANGE = bson.encode({"t": DatetimeMS(2**62)})
"""A BSON date no Python `datetime` holds (year 146,140,482 and on)."""


@pytest.mark.wire
def test_the_migrations_client_decodes_a_date_outside_pythons_range(wire_uri: str) -> None:
    """The migration's client reads a legacy date Python's `datetime` cannot hold (year 0,
    year 55840, a garbage timestamp) as a `DatetimeMS`, never stopping a run on its batch."""
    args = parser().parse_args(["status", "--uri", wire_uri])
    with database(args) as (client, _):
        decoded = bson.decode(OUT_OF_RANGE, codec_options=client.codec_options)
    assert decoded["t"] == DatetimeMS(2**62)


NOT_UTF8 = bson.encode({"t": "words ZZ more"}).replace(b"ZZ", b"\xc3\x28")
"""A BSON string holding bytes that are not valid UTF-8, as MongoDB stores what a writer gave."""


@pytest.mark.wire
def test_the_migrations_client_reads_text_that_is_not_valid_utf8_keeping_every_byte(
    wire_uri: str,
) -> None:
    """The migration's client reads a legacy text holding bytes that are not valid UTF-8 with
    each such byte a lone surrogate (`surrogateescape`), never stopping a run on its batch
    (was: `InvalidBSON`, whole batches refused), and never replacing a byte: the text read
    gives back the bytes stored."""
    args = parser().parse_args(["status", "--uri", wire_uri])
    with database(args) as (client, _):
        db = connection.read_as_stored(client["any"])
        decoded = bson.decode(NOT_UTF8, codec_options=db.codec_options)
    assert decoded["t"] == "words \udcc3( more"
    assert decoded["t"].encode("utf-8", "surrogateescape") == b"words \xc3\x28 more"


SERVICE_TURN_SETTINGS = {
    "AGENT_STORE_RUNTIME_CONTEXT_START": "<ctx>",
    "AGENT_STORE_RUNTIME_CONTEXT_END": "</ctx>",
    "AGENT_STORE_MAX_MESSAGE_BYTES": "4096",
    "AGENT_STORE_NAME_CHARS": "12",
}
"""A service's own rules for turns: markers, a smaller bound, shorter names."""


def context_turns(conversation_id: str = "leg-ctx") -> list[dict[str, Any]]:
    """Legacy turns holding runtime context in the service's markers, and a long answer."""
    at = datetime(2026, 3, 1, 10, tzinfo=UTC)
    asked = "<ctx>account=ACME-SECRET-42; tier=gold</ctx>Where is my order?"
    return [
        {"_id": ObjectId(), "conversation_id": conversation_id, "user_id": "u1", "name": None,
         "created_at": at, "user_message": asked, "response_text": "It ships tomorrow.",
         "response_parts": [{"type": "text", "content": "It ships tomorrow."}]},
        {"_id": ObjectId(), "conversation_id": conversation_id, "user_id": "u1", "name": None,
         "created_at": at + timedelta(minutes=1), "user_message": "Summarise this",
         "response_text": "S" * 9000, "response_parts": [{"type": "text", "content": "S" * 9000}]},
    ]  # fmt: skip


def with_service_turn_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SERVICE_TURN_SETTINGS.items():
        monkeypatch.setenv(name, value)


@pytest.mark.wire
def test_the_migration_stores_turns_by_the_rules_the_service_reads_from_the_environment(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The service's markers strip hidden context (kept in a problem), its bound cuts the
    long answer, its name length names the conversation: what the read fallback served
    before the migration is what is stored after it, and `verify` agrees."""
    from agent_store.legacy import convert
    from app.settings import Settings

    with_service_turn_settings(monkeypatch)
    turns = context_turns()
    database[CONVERSATIONS].insert_many(turns)
    served = convert(turns, rules=Settings().turn_rules())

    assert cli(wire_uri, database, "run") == 0
    stored = list(database[MESSAGES].find({"conversation_id": "leg-ctx"}).sort("seq", 1))
    assert [m["content"] for m in stored] == [m.content for m in served.messages]
    assert stored[0]["content"] == "Where is my order?"
    assert "ACME" not in json.dumps(stored, default=str)
    assert stored[3]["truncated"]
    assert len(bson.encode(stored[3])) <= 4096
    document = database[CONVERSATIONS].find_one({"_id": "leg-ctx"})
    assert document is not None
    assert served.conversation is not None
    assert document["name"] == served.conversation.name == "Where is my…"
    kinds = [p["kind"] for p in database[PROBLEMS].find({"conversation_id": "leg-ctx"})]
    assert kinds == ["hidden_runtime_context"]
    record = database[lease.STATE].find_one({"kind": "run"})
    assert record is not None
    assert record["options"]["rules"]["runtime_context_start"] == "<ctx>"
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 0
    assert "1 match, 0 differ" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("variable", "value", "setting"),
    [
        pytest.param(
            "AGENT_STORE_RUNTIME_CONTEXT_START", "\u00a0\t", "runtime_context_start", id="blank"
        ),
        pytest.param(
            "AGENT_STORE_RUNTIME_CONTEXT_END",
            "[RUNTIME",
            "runtime_context_start and runtime_context_end",
            id="one-holding-the-other",
        ),
        pytest.param(
            "AGENT_STORE_RUNTIME_CONTEXT_START",
            "<ctx>",
            "runtime_context_start and runtime_context_end",
            id="one-marker-alone",
        ),
        pytest.param("AGENT_STORE_MAX_MESSAGE_BYTES", "-5", "max_message_bytes", id="no-bound"),
        pytest.param(
            "AGENT_STORE_MAX_MESSAGE_BYTES", "67108864", "max_message_bytes", id="over-16-mib"
        ),
        pytest.param("mongodb_uri", "db.example:27017", "MONGODB_URI", id="lower-case-uri"),
        pytest.param("AGENT_STORE_MAX_MESSAGE_BYTES", "1MiB", "max_message_bytes", id="no-int"),
        pytest.param("AGENT_STORE_NAME_CHARS", "1", "name_chars", id="name-too-short"),
    ],
)
@pytest.mark.parametrize("command", ["status", "run", "verify", "finish"])
def test_a_turn_setting_the_service_refuses_stops_every_command_as_misuse(
    command: str,
    variable: str,
    value: str,
    setting: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exit 2 naming the setting, as the service's start refuses it, before any database is
    looked for (never a run by other rules than the service's)."""
    monkeypatch.setenv(variable, value)
    closed = "mongodb://127.0.0.1:9/?directConnection=true"

    assert main([command, "--uri", closed, "--timeout", "0.2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: invalid configuration: {setting}: ")
    assert value not in err.removeprefix("error: invalid configuration: ")


@pytest.mark.parametrize("also", [None, "mongodb://127.0.0.1:9/"])
@pytest.mark.parametrize("command", ["status", "run"])
def test_an_empty_mongodb_uri_stops_the_migration_as_it_stops_the_service(
    command: str,
    also: str | None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`MONGODB_URI=${MONGODB_URI}` with it unset: the service refuses to start, so the
    migration never takes it as unset and works on the embedded database of `data/`, nor on
    `AGENT_STORE_MONGODB_URI` (exit 2, as a turn setting the service refuses)."""
    monkeypatch.setenv("MONGODB_URI", "")
    if also is not None:
        monkeypatch.setenv("AGENT_STORE_MONGODB_URI", also)
    monkeypatch.setenv("AGENT_STORE_DATA_DIR", str(tmp_path))
    (tmp_path / embedded.DATABASE_FILE).write_bytes(b"")

    assert main([command, "--timeout", "0.2"]) == 2
    assert capsys.readouterr().err.startswith("error: invalid configuration: MONGODB_URI: ")


@pytest.mark.parametrize("name", ["agent.store", "agent store", "x" * 64, ""])
@pytest.mark.parametrize("given", ["option", "variable", "lower-case variable"])
def test_a_database_name_mongodb_refuses_stops_every_command_as_misuse(
    name: str, given: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the service's start refuses it (exit 2, the same words), before any database is
    looked for: never exit 4, which reads as "the database is unreachable"."""
    closed = "mongodb://127.0.0.1:9/?directConnection=true"
    if given != "option":
        monkeypatch.setenv(
            "AGENT_STORE_DATABASE" if given == "variable" else "agent_store_database", name
        )
    options = ["--database", name] if given == "option" else []

    assert main(["status", "--uri", closed, "--timeout", "0.2", *options]) == 2
    assert capsys.readouterr().err.startswith("error: invalid configuration: database: ")


def test_a_tls_file_the_uri_names_that_cannot_be_read_is_a_bad_uri_exit_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing file, or one that is no PEM: exit 4 with one line, never a traceback (exit 1
    reads as "verify found differences")."""
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate\n")
    for path in ("/nonexistent/ca.pem", str(not_pem)):
        uri = f"mongodb://127.0.0.1:9/?tls=true&tlsCAFile={path}"
        assert main(["status", "--uri", uri, "--timeout", "0.2"]) == 4
        err = capsys.readouterr().err
        assert err.startswith("error: invalid MongoDB URI ")
        assert "a TLS file it names (tlsCAFile, tlsCertificateKeyFile) cannot be read" in err
        assert len(err.splitlines()) == 1


@pytest.mark.wire
def test_a_run_by_other_turn_settings_than_the_runs_that_migrated_is_refused_writing_nothing(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run (a resume too) by other settings than the run that migrated conversations would
    rewrite them, hidden context made visible: exit 2, naming the settings that differ (never
    their values), nothing written; the same settings run on, and `--new-rules` converts
    every conversation again by the new ones."""
    with_service_turn_settings(monkeypatch)
    for n in range(3):
        database[CONVERSATIONS].insert_many(context_turns(f"leg-{n}"))
    assert cli(wire_uri, database, "run", "--limit", "1", "--batch-size", "1") == 0
    monkeypatch.setenv("AGENT_STORE_RUNTIME_CONTEXT_START", "[ctx]")
    monkeypatch.setenv("AGENT_STORE_NAME_CHARS", "30")
    before = digest(database)
    capsys.readouterr()

    for extra in ((), ("--restart",), ("--dry-run",), ("--conversation", "leg-0")):
        assert cli(wire_uri, database, "run", *extra) == 2
        err = capsys.readouterr().err
        assert "AGENT_STORE_RUNTIME_CONTEXT_START, AGENT_STORE_NAME_CHARS" in err
        assert "[ctx]" not in err
        assert "<ctx>" not in err  # names, never values
        assert "--new-rules" in err
    assert digest(database) == before

    with_service_turn_settings(monkeypatch)  # as the earlier run had them: the resume goes on
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    monkeypatch.delenv("AGENT_STORE_RUNTIME_CONTEXT_START")
    monkeypatch.delenv("AGENT_STORE_RUNTIME_CONTEXT_END")
    assert cli(wire_uri, database, "run", "--new-rules") == 0
    firsts = {m["content"] for m in database[MESSAGES].find({"seq": 0})}
    assert firsts == {"<ctx>account=ACME-SECRET-42; tier=gold</ctx>Where is my order?"}
    assert cli(wire_uri, database, "run") == 0  # the rules recorded are the new ones now


class KilledNine(BaseException):
    """A run dying as by SIGKILL: nothing of it catches it, and nothing more of it is written."""


@contextmanager
def killed_nine_after(step: str) -> Iterator[None]:
    """The run inside dies as by SIGKILL right after its first batch's `step` ("apply": its
    writes; "checkpoint": its checkpoint, before its record): its record stays as it was, never
    "failed" with its counts as on SIGTERM. The lock is released, as its lease ending would."""
    dead: list[str] = []
    real_record, real_apply = explode.Explosion._record, writes.apply
    real_checkpoint = explode.Explosion._checkpoint

    def record(run: explode.Explosion, status: str, **extra: Any) -> None:
        if not dead:
            real_record(run, status, **extra)

    def apply(*args: Any, **kwargs: Any) -> writes.Applied:
        applied = real_apply(*args, **kwargs)
        dead.append("wrote")
        if step == "apply":
            raise KilledNine(step)
        return applied

    def checkpoint(run: explode.Explosion, *args: Any, **kwargs: Any) -> None:
        real_checkpoint(run, *args, **kwargs)
        if step == "checkpoint" and dead:  # the checkpoint after the batch's writes
            raise KilledNine(step)

    with (
        mock.patch.object(explode.Explosion, "_record", record),
        mock.patch.object(writes, "apply", apply),
        mock.patch.object(explode.Explosion, "_checkpoint", checkpoint),
        pytest.raises(KilledNine),
    ):
        yield


def leaked(db: Database[dict[str, Any]]) -> bool:
    """Whether hidden context of `context_turns` is stored where a reader sees it."""
    return "ACME" in json.dumps(list(db[MESSAGES].find()), default=str)


@pytest.mark.wire
@pytest.mark.parametrize("step", ["apply", "checkpoint"])
def test_a_run_killed_in_its_first_batch_has_recorded_the_settings_it_wrote_by(
    step: str,
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The settings are recorded before a run writes its first conversation: killed -9 in
    its first batch, its resume by other settings is refused (exit 2, nothing written) as
    after any later batch, and the resume by its own settings converges."""
    with_service_turn_settings(monkeypatch)
    for n in range(4):
        database[CONVERSATIONS].insert_many(context_turns(f"leg-{n}"))
    with killed_nine_after(step):
        cli(wire_uri, database, "run", "--batch-size", "2")
    assert database[MESSAGES].count_documents({}) > 0  # the first batch is written
    monkeypatch.delenv("AGENT_STORE_RUNTIME_CONTEXT_START")
    monkeypatch.delenv("AGENT_STORE_RUNTIME_CONTEXT_END")
    before = digest(database)
    capsys.readouterr()

    for extra in ((), ("--dry-run",)):
        assert cli(wire_uri, database, "run", *extra) == 2
        assert "AGENT_STORE_RUNTIME_CONTEXT_START" in capsys.readouterr().err
    assert digest(database) == before

    with_service_turn_settings(monkeypatch)
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert not leaked(database)


@pytest.mark.wire
def test_a_run_checks_the_settings_holding_the_lock_after_waiting_for_it(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run started by other settings while the run by the service's holds the lock, before
    that one recorded anything, waits for the lock; holding it, it finds what that run
    stored and is refused (exit 2), never converting it again by its own settings."""
    for n in range(4):
        database[CONVERSATIONS].insert_many(context_turns(f"leg-{n}"))
    acquire = lease.Lease.acquire
    waited: list[str] = []

    def waiting(held: lease.Lease, **kwargs: Any) -> None:
        if not waited:  # the run by the service's settings, going on meanwhile
            waited.append(held.run_id)
            with_service_turn_settings(monkeypatch)
            assert cli(wire_uri, database, "run") == 0
        acquire(held, **kwargs)

    monkeypatch.setattr(lease.Lease, "acquire", waiting)
    assert cli(wire_uri, database, "run") == 2  # started by the defaults
    assert waited
    assert not leaked(database)
    assert cli(wire_uri, database, "verify") == 0  # by the service's settings


@pytest.mark.wire
def test_new_rules_for_one_conversation_is_refused_writing_nothing(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--new-rules` converts every conversation again: with `--conversation` the others would
    stay converted by the earlier settings yet be compared with the new ones (the service's
    then refused, a shell without them let through). Exit 2 saying so, nothing written; a
    dry run, which records nothing, may show what it would write."""
    with_service_turn_settings(monkeypatch)
    for n in range(3):
        database[CONVERSATIONS].insert_many(context_turns(f"leg-{n}"))
    assert cli(wire_uri, database, "run") == 0
    monkeypatch.delenv("AGENT_STORE_RUNTIME_CONTEXT_START")
    monkeypatch.delenv("AGENT_STORE_RUNTIME_CONTEXT_END")
    before = digest(database)
    capsys.readouterr()

    assert cli(wire_uri, database, "run", "--new-rules", "--conversation", "leg-0") == 2
    err = capsys.readouterr().err
    assert "--new-rules" in err
    assert "--conversation" in err
    assert digest(database) == before
    shown = ("run", "--new-rules", "--conversation", "leg-0", "--dry-run")
    assert cli(wire_uri, database, *shown) == 0  # a dry run shows what it would write
    assert digest(database) == before
    assert cli(wire_uri, database, "run") == 2  # the migration's settings are still M's

    with_service_turn_settings(monkeypatch)
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0


@pytest.mark.wire
def test_verify_and_finish_fail_on_conversations_converted_by_other_settings_alike_in_content(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Another name length gives the same messages, and a name is not compared (a person
    may rename a conversation): the conversations were still converted by other settings
    than the service's now, so `verify` and `finish` exit 1 naming them, until `run
    --new-rules` converts them by these."""
    with_service_turn_settings(monkeypatch)
    database[CONVERSATIONS].insert_many(context_turns())
    assert cli(wire_uri, database, "run") == 0
    monkeypatch.setenv("AGENT_STORE_NAME_CHARS", "30")
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish", "--accept", "leg-ctx", "--note", "context") == 1
    note = [line for line in capsys.readouterr().out.splitlines() if "settings differ" in line]
    assert len(note) == 2
    assert all(": AGENT_STORE_NAME_CHARS;" in line for line in note)

    assert cli(wire_uri, database, "run", "--new-rules") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish", "--accept", "leg-ctx", "--note", "context") == 0


@pytest.mark.wire
def test_verify_and_finish_fail_while_new_rules_has_not_converted_every_conversation(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--new-rules` killed part-way leaves conversations converted by the earlier settings,
    alike in content: `verify` and `finish` exit 1 naming the settings until a run by the new
    ones has gone through every conversation."""
    with_service_turn_settings(monkeypatch)
    for n in range(3):
        database[CONVERSATIONS].insert_many(context_turns(f"leg-{n}"))
    assert cli(wire_uri, database, "run") == 0
    monkeypatch.setenv("AGENT_STORE_NAME_CHARS", "30")
    with killed_nine_after("checkpoint"):
        cli(wire_uri, database, "run", "--new-rules", "--batch-size", "1")
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish", "--accept", "leg-0", "--note", "context") == 1
    assert "AGENT_STORE_NAME_CHARS" in capsys.readouterr().out

    assert cli(wire_uri, database, "run") == 0  # resumes the new settings' pass
    assert cli(wire_uri, database, "verify") == 0


@pytest.mark.wire
def test_verify_and_finish_name_the_turn_settings_that_differ_from_the_migrating_run(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Differences that come from settings other than the run's are said to, by name."""
    with_service_turn_settings(monkeypatch)
    database[CONVERSATIONS].insert_many(context_turns())
    assert cli(wire_uri, database, "run") == 0
    monkeypatch.setenv("AGENT_STORE_RUNTIME_CONTEXT_END", "[/ctx]")
    capsys.readouterr()
    for command in ("verify", "finish"):
        assert cli(wire_uri, database, command) == 1
        said = capsys.readouterr().out.splitlines()
        note = [line for line in said if "the turn settings differ" in line]
        assert len(note) == 1
        assert ": AGENT_STORE_RUNTIME_CONTEXT_END;" in note[0]
        assert "ctx" not in note[0]


@pytest.mark.parametrize(
    "uri",
    [
        pytest.param("mongodb://db.example.com:27017x/", id="mistyped-port"),
        pytest.param("mongodb://127.0.0.1:9/?maxPoolSize=1&minPoolSize=5", id="pool-sizes"),
    ],
)
def test_a_uri_whose_client_the_driver_refuses_to_build_is_exit_4_in_one_line(
    uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the service's start refuses it: never a traceback with exit 1 ("differences")."""
    assert main(["status", "--uri", uri, "--timeout", "0.2"]) == 4
    err = capsys.readouterr().err
    assert err.startswith("error: invalid MongoDB URI ")
    assert len(err.splitlines()) == 1


@pytest.mark.wire
@pytest.mark.parametrize(
    ("uri_variable", "database_variable"),
    [
        ("AGENT_STORE_MONGODB_URI", "AGENT_STORE_DATABASE"),
        ("mongodb_uri", "agent_store_database"),
        ("Agent_Store_MongoDB_URI", "Agent_Store_Database"),
    ],
)
def test_the_migration_reads_the_services_database_variables_as_the_service_does(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    uri_variable: str,
    database_variable: str,
) -> None:
    """The service reads `MONGODB_URI` or `AGENT_STORE_MONGODB_URI`, and the database, in
    any case of their names: so does the migration, never the embedded database of a
    `data/` beside it."""
    monkeypatch.delenv("MONGODB_URI", raising=False)
    monkeypatch.setenv(uri_variable, wire_uri)
    monkeypatch.setenv(database_variable, database.name)
    monkeypatch.setenv("AGENT_STORE_DATA_DIR", str(tmp_path))
    database[CONVERSATIONS].insert_many(context_turns())
    assert main(["run", "--progress", "none"]) == 0
    assert database[MESSAGES].count_documents({"conversation_id": "leg-ctx"}) == 4
    assert "embedded" not in capsys.readouterr().out


@pytest.mark.wire
def test_verify_and_finish_fail_when_a_resume_goes_on_with_ranges_an_earlier_setting_began(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run stopped part-way by the service's settings, a `--new-rules` run by another name
    length killed in its first batch (before its first checkpoint), then a plain run by the
    new length, which resumes the stopped run's ranges and passes over what that run
    converted: those conversations stand converted by the earlier name length, so `verify`
    and `finish` exit 1 naming it (and the stopped run), until `--new-rules` goes through
    every conversation."""
    with_service_turn_settings(monkeypatch)
    for n in range(4):
        database[CONVERSATIONS].insert_many(context_turns(f"leg-{n}"))
    assert cli(wire_uri, database, "run", "--limit", "2", "--batch-size", "1") == 0
    stopped = database[lease.STATE].find_one({"kind": "run", "status": "stopped"})
    assert stopped is not None
    monkeypatch.setenv("AGENT_STORE_NAME_CHARS", "30")
    with killed_nine_after("apply"):
        cli(wire_uri, database, "run", "--new-rules", "--batch-size", "1")
    assert cli(wire_uri, database, "run") == 0  # resumes the stopped run's ranges
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish", "--accept", "leg-0", "--note", "context") == 1
    note = [line for line in capsys.readouterr().out.splitlines() if "settings differ" in line]
    assert len(note) == 2
    assert all(": AGENT_STORE_NAME_CHARS;" in line for line in note)
    assert all(stopped["_id"] in line for line in note)

    assert cli(wire_uri, database, "run", "--new-rules") == 0
    assert cli(wire_uri, database, "verify") == 0
