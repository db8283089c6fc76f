"""The migration's exit gate: `verify` exits 0 on a correct migration and 1 on a broken one,
`finish` counts unplaced content as work left and never lets a drop delete content that exists
nowhere else; dry runs predict runs; commands stay bounded; the lock waits for a dead run."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import re
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import bson
import gridfs
import mongomock
import pytest
from pymongo import AsyncMongoClient, DeleteOne, MongoClient, monitoring
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.errors import AutoReconnect

from agent_store import AgentMessageLogger, ConversationStore, LegacyTurns, LoggedTurn
from agent_store.core import (
    AgentMessage,
    Conflict,
    Conversation,
    NotFound,
    StorageUnavailable,
    TurnRecord,
    VersionMismatch,
    message_adapter,
)
from agent_store.legacy import (
    LEGACY_TURNS,
    SESSION_HITL,
    TURN_ONLY_FIELDS,
    convert,
    copy_record_id,
    derived_conversation_id,
    derived_user_id,
    dumps,
    exact_form,
    is_pending_prompt,
    legacy_turn_documents,
    legacy_turn_id,
    not_identifiers,
    parse_turns,
    with_session_prompts,
)
from agent_store.store import (
    BLOB_BUCKET,
    CONVERSATIONS,
    MESSAGES,
    MIGRATING,
    TRUNCATION_MARK,
    TurnRules,
)
from app.examples import EXAMPLE_CONVERSATION_ID, example_legacy_turns
from migrations import (
    abandoned,
    connection,
    dual_writes,
    explode,
    full_texts,
    gate,
    lease,
    order,
    orphan_prompts,
    relocate,
    writes,
)
from migrations import cli as cli_module
from migrations.cli import main
from migrations.errors import LockHeld
from migrations.lease import Lease
from migrations.problems import PROBLEMS
from scripts.legacy_corpus import BIG_RESULT_CHARS, NOT_AN_IDENTIFIER, messy_corpus
from tests.conftest import COUNTED, CommandLog
from tests.test_migration_cli import cli, corpus, digest, killed_copy
from tests.turn_shapes import NATIVE_SHAPE, TURN_SHAPES

MARK = re.compile(r"«m\d+»")


def seed_mess(db: Database[dict[str, Any]], *only: str) -> list[dict[str, Any]]:
    """Legacy turns of the messy corpus (only the named conversations, if any are named)."""
    docs = [d for d in messy_corpus() if not only or d["conversation_id"] in only]
    db[CONVERSATIONS].insert_many(docs)
    return docs


def kept_text(db: Database[dict[str, Any]]) -> str:
    """Everything the new collections keep: messages, full texts (read as GridFS) and problems."""
    bucket = gridfs.GridFSBucket(db, bucket_name=BLOB_BUCKET)
    texts = [json.dumps(d, default=str, ensure_ascii=False) for d in db[MESSAGES].find()]
    files = db[f"{BLOB_BUCKET}.files"].find()
    texts += [bucket.open_download_stream(f["_id"]).read().decode() for f in files]
    texts += [json.dumps(d, default=str, ensure_ascii=False) for d in db[PROBLEMS].find()]
    return "\n".join(texts)


def summary(out: str) -> dict[str, int]:
    """The counts of a run's (or a dry run's) summary line, by what they count."""
    line = next(ln for ln in out.splitlines() if " turns -> " in ln)
    body = line.split(": ", 1)[1]
    return {what: int(n) for n, what in re.findall(r"(\d+) ([a-z][a-z ]*[a-z])", body)}


@pytest.mark.wire
def test_the_runbooks_gate_is_safe_on_a_corpus_of_every_mess(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    docs = seed_mess(database) + corpus()
    database[CONVERSATIONS].insert_many(docs[len(messy_corpus()) :])
    marks = set(MARK.findall(json.dumps(docs, default=str, ensure_ascii=False)))
    legacy_count = len(docs)

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0, capsys.readouterr().out
    capsys.readouterr()
    # Content only the legacy turns hold: finish says so, and a drop is refused.
    assert cli(wire_uri, database, "finish") == 1
    out = capsys.readouterr().out
    unplaced = sorted(database[PROBLEMS].distinct("conversation_id", {"placed": False}))
    assert "mess-unplaced" in unplaced
    assert "mess-odd-values" in unplaced
    assert all(cid in out for cid in unplaced)
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert database[LEGACY_TURNS].count_documents({}) == legacy_count

    accept = [arg for cid in unplaced for arg in ("--accept", cid)]
    assert cli(wire_uri, database, "finish", *accept, "--note", "kept in the problems") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0

    assert LEGACY_TURNS not in database.list_collection_names()
    assert marks - set(MARK.findall(kept_text(database))) == set()


@pytest.mark.wire
def test_a_conversation_id_that_is_not_an_identifier_is_migrated_not_dropped(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    seed_mess(database, NOT_AN_IDENTIFIER)
    assert cli(wire_uri, database, "run") == 0
    conversation = database[CONVERSATIONS].find_one({"legacy_conversation_id": NOT_AN_IDENTIFIER})
    assert conversation is not None
    assert conversation["_id"] == derived_conversation_id(NOT_AN_IDENTIFIER)
    assert database[MESSAGES].count_documents({"conversation_id": conversation["_id"]}) == 4
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0


@pytest.mark.wire
def test_finish_counts_conversations_with_unplaced_content_as_work_left(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    seed_mess(database, "mess-unplaced", "mess-hitl")
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()

    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1

    out = capsys.readouterr().out
    assert "mess-unplaced" in out
    assert "mess-hitl" not in out
    assert "unknown_part" in out
    assert database[LEGACY_TURNS].count_documents({}) == 3
    assert cli(wire_uri, database, "finish", "--accept", "mess-unplaced", "--note", "archived") == 0
    accepted = database["agent_migrations"].find_one({"kind": "acceptance"})
    assert accepted is not None
    assert (accepted["conversation_id"], accepted["note"]) == ("mess-unplaced", "archived")
    assert accepted["accepted_by"]
    assert accepted["accepted_at"]


@pytest.mark.wire
def test_finish_counts_a_conversation_whose_messages_are_missing_as_work_left(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    database[CONVERSATIONS].insert_many(corpus(2))
    assert cli(wire_uri, database, "run") == 0
    # As a run killed between a batch's conversation documents and its messages leaves it.
    database[MESSAGES].delete_many({"conversation_id": EXAMPLE_CONVERSATION_ID, "seq": {"$gt": 5}})
    capsys.readouterr()

    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1

    assert EXAMPLE_CONVERSATION_ID in capsys.readouterr().out
    assert database[LEGACY_TURNS].count_documents({}) > 0


@pytest.mark.wire
def test_a_migrated_result_over_the_bound_is_kept_whole_as_gridfs(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    [turn] = seed_mess(database, "mess-big-result")
    assert cli(wire_uri, database, "run") == 0

    tool = database[MESSAGES].find_one({"conversation_id": "mess-big-result", "role": "tool"})
    assert tool is not None
    original = turn["response_parts"][1]["result"]
    assert tool["truncated"]["content"]["length"] == len(original) > BIG_RESULT_CHARS
    assert len(tool["content"]) < 1024 * 1024
    bucket = gridfs.GridFSBucket(database, bucket_name=BLOB_BUCKET)
    blob_id = tool["truncated"]["content"]["blob_id"]
    assert bucket.open_download_stream(blob_id).read().decode() == original
    assert database[PROBLEMS].count_documents({"conversation_id": "mess-big-result"}) == 0


def _swap_first_and_fifth(db: Database[dict[str, Any]]) -> None:
    where = {"conversation_id": EXAMPLE_CONVERSATION_ID}
    db[MESSAGES].update_one({**where, "seq": 0}, {"$set": {"seq": -1}})
    db[MESSAGES].update_one({**where, "seq": 4}, {"$set": {"seq": 0}})
    db[MESSAGES].update_one({**where, "seq": -1}, {"$set": {"seq": 4}})


def _alter_a_full_text(db: Database[dict[str, Any]]) -> None:
    chunk = db[f"{BLOB_BUCKET}.chunks"].find_one({"n": 0})
    assert chunk is not None
    db[f"{BLOB_BUCKET}.chunks"].update_one(
        {"_id": chunk["_id"]}, {"$set": {"data": b"X" + chunk["data"][1:]}}
    )


BROKEN: dict[str, Any] = {
    "dropped": lambda db: db[MESSAGES].delete_one(
        {"conversation_id": EXAMPLE_CONVERSATION_ID, "seq": 4}
    ),
    "reordered": _swap_first_and_fifth,
    "altered": lambda db: db[MESSAGES].update_one(
        {"conversation_id": EXAMPLE_CONVERSATION_ID, "seq": 8}, {"$set": {"content": "edited"}}
    ),
    "altered full text": _alter_a_full_text,
    "full text lost": lambda db: db[f"{BLOB_BUCKET}.files"].delete_many({}),
}


@pytest.mark.wire
@pytest.mark.parametrize("breakage", sorted(BROKEN))
def test_verify_catches_a_broken_migration(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    breakage: str,
) -> None:
    database[CONVERSATIONS].insert_many(corpus(1))
    seed_mess(database, "mess-big-result")
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    capsys.readouterr()

    BROKEN[breakage](database)

    assert cli(wire_uri, database, "verify") == 1
    out = capsys.readouterr().out
    broken = "mess-big-result" if "full text" in breakage else EXAMPLE_CONVERSATION_ID
    assert any(line.startswith(broken + ":") for line in out.splitlines())
    assert "1 differ" in out.splitlines()[-1]


@pytest.mark.wire
def test_a_conversation_without_any_time_converges_across_reruns(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    seed_mess(database, "mess-undated")
    assert cli(wire_uri, database, "run") == 0
    first = digest(database)
    assert cli(wire_uri, database, "run", "--restart") == 0
    assert digest(database) == first


@pytest.mark.wire
def test_status_and_finish_summarize_problems_by_kind(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    seed_mess(database, "mess-unplaced", NOT_AN_IDENTIFIER)
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    for command in ("status", "finish"):
        cli(wire_uri, database, command)
        out = capsys.readouterr().out
        assert re.search(r"unknown_part\s+1\s+not placed", out), out
        assert re.search(r"unplaced_tool_result\s+1\s+not placed", out), out
        assert re.search(r"derived_conversation_id\s+1\s+placed", out), out


@pytest.mark.wire
@pytest.mark.parametrize("moved", [True, False], ids=["after-the-move", "before-the-move"])
def test_a_dry_run_predicts_exactly_what_the_run_does(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    moved: bool,
) -> None:
    """The dry run prints the very summary the run prints: after a partial run, and before
    the move too (reading the turns where they are then), pending prompts included: one a
    conversation takes is no orphan, one of a conversation without turns is; a legacy turn
    whose `_id` is another conversation's id is no stored document of that one."""
    database[CONVERSATIONS].insert_many(corpus(4))
    database[CONVERSATIONS].insert_many(
        [legacy_turn("7", "c-42", 0, "A"), legacy_turn("t-7", "7", 1, "B")]
    )
    seed_mess(database, NOT_AN_IDENTIFIER, "mess-undated")
    database[SESSION_HITL].insert_many(
        [{"conversation_id": cid, "request_id": f"r-{n}", "action": "confirm",
          "status": "pending", "user_id": "u-1"}
         for n, cid in enumerate([EXAMPLE_CONVERSATION_ID, "mess-undated", "no-turns"])]
    )  # fmt: skip
    if moved:
        relocate.relocate(database)
        database[MESSAGES].insert_one(
            {"_id": "live-0", "conversation_id": EXAMPLE_CONVERSATION_ID, "seq": 0,
             "role": "user", "content": "logged live first"}
        )  # fmt: skip
        assert cli(wire_uri, database, "run", "--limit", "2", "--batch-size", "1") == 0
    capsys.readouterr()

    assert cli(wire_uri, database, "run", "--dry-run", "--restart") == 0
    predicted = summary(capsys.readouterr().out)
    assert cli(wire_uri, database, "run", "--restart") == 0
    done = summary(capsys.readouterr().out)

    assert predicted == done
    assert done["already live"] == (1 if moved else 0)
    assert done["messages written"] > 0
    assert database[PROBLEMS].count_documents({"kind": "orphan_pending_hitl"}) == 1


@pytest.mark.wire
def test_a_dry_run_after_the_move_plans_the_moved_turns_and_names_those_logged_since(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Turns the old service logged in `agent_conversations` since the move are left out of
    a dry run's plan, which says how many (a run moves them first): the plan is the run's
    but for those, never one made of the turns logged since alone."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "a"), legacy_turn("t-5", "c-2", 4, "e"),
         legacy_turn("t-6", "c-3", 5, "f")]
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    database[CONVERSATIONS].insert_one(legacy_turn("t-9", "c-2", 8, "i"))
    capsys.readouterr()

    assert cli(wire_uri, database, "run", "--dry-run") == 0
    out = capsys.readouterr().out
    predicted = summary(out)
    assert cli(wire_uri, database, "run") == 0
    done = summary(capsys.readouterr().out)

    assert f"1 turn documents logged in {CONVERSATIONS} since the move are left out" in out
    assert predicted["conversations"] == done["conversations"] == 3
    assert predicted["turns"] == done["turns"] - 1


def summary_words(out: str) -> str:
    """A run's (or a dry run's) summary line, its label left out."""
    return next(ln for ln in out.splitlines() if " turns -> " in ln).split(": ", 1)[1]


def dry_run_then_run(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> tuple[Any, str]:
    """A dry run (which writes nothing: every stored message as it was) then the run, both
    succeeding: what the dry run printed, and the run's output."""
    stored = stored_messages(database)
    capsys.readouterr()
    assert cli(wire_uri, database, "run", "--dry-run") == 0
    planned = capsys.readouterr()
    assert stored_messages(database) == stored
    assert cli(wire_uri, database, "run") == 0
    return planned, capsys.readouterr().out


@pytest.mark.wire
def test_status_after_a_rollback_says_a_run_comes_first_and_counts_conversations(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """After the runbook's rollback the legacy turns are back in `agent_conversations`: the
    last run's checkpoint no longer says the migration is complete, and the turn documents
    there are not counted as conversations."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n // 2}", n, f"T{n}") for n in range(4)]
    )
    assert cli(wire_uri, database, "run") == 0
    roll_back(database, clear_messages=False)
    capsys.readouterr()

    assert cli(wire_uri, database, "status") == 0
    out = capsys.readouterr().out

    assert f"conversations in {CONVERSATIONS}: 0" in out
    assert "progress: complete" not in out
    assert "legacy turns are back in agent_conversations" in out


@pytest.mark.wire
def test_a_dry_run_after_a_rollback_prints_the_summary_the_run_prints(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """After the runbook's rollback (and after a second one) the legacy turns are back in
    `agent_conversations`: the dry run of the next attempt reads them there for every step,
    the removal of conversations no legacy turn makes included. It plans what the run does,
    and names no conversation whose migrated messages its legacy turns still make, least of
    all one a live turn wrote to, as one whose migrated messages to delete."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run") == 0
    for attempt in (1, 2):
        log_live(wire_uri, database, "c-1", f"live-{attempt}", f"«LIVE {attempt}»", dual_write=True)
        roll_back(database, clear_messages=False)
        stored = stored_messages(database)

        planned, done = dry_run_then_run(wire_uri, database, capsys)

        assert summary_words(planned.out) == summary_words(done)
        assert "no legacy turn makes now" not in planned.out
        assert "delete the migrated" not in planned.err
        assert stored_messages(database) == stored


@pytest.mark.wire
@pytest.mark.parametrize("late_turn", [False, True], ids=["empty", "a-turn-dual-written-since"])
def test_a_dry_run_after_a_rollback_reads_the_turns_where_the_runs_move_puts_them(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    late_turn: bool,
) -> None:
    """After a rollback, `agent_conversations_deprecated` stands again (empty, or holding a
    turn a new-service instance not stopped yet dual-wrote): the run copies the turns of
    `agent_conversations` into it, both merged. The dry run plans from where most turns
    are, names no conversation the merged turns make for removal, as the run removes none,
    and names the turns its plan leaves out, which the run counts."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run") == 0
    roll_back(database, clear_messages=False)
    database.create_collection(LEGACY_TURNS)
    if late_turn:
        late = legacy_turn("t-late", "c-0", 9, "late") | {"dual_write": True, "turn_id": "l-9"}
        database[LEGACY_TURNS].insert_one(late)

    planned, done = dry_run_then_run(wire_uri, database, capsys)

    assert "no legacy turn makes now" not in planned.out + done
    assert "delete the migrated" not in planned.err
    if not late_turn:
        assert summary_words(planned.out) == summary_words(done)
    else:
        assert f"1 turn documents in {LEGACY_TURNS} are left out of this plan" in planned.out
        assert summary(planned.out)["conversations"] == summary(done)["conversations"] == 3
        assert summary(planned.out)["turns"] == summary(done)["turns"] - 1


@pytest.mark.wire
def test_a_rollback_by_copying_that_left_the_moved_aside_turns_is_refused_not_merged_back(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A rollback that copied the legacy turns back and left their moved-aside collection
    standing: no run copy is under way, so the next run takes it for no interrupted copy of
    its own. It refuses (exit 1, naming the collection to drop or rename away), moves and
    migrates nothing, and a conversation the old service deleted since never comes back;
    once the leftover is dropped, the run removes it."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run") == 0
    database[CONVERSATIONS].drop()  # the rollback: documents away, the turns copied back
    database[CONVERSATIONS].insert_many(list(database[LEGACY_TURNS].find()))
    database[CONVERSATIONS].delete_many({"conversation_id": "c-1"})  # the old service
    stored = stored_messages(database)
    capsys.readouterr()

    for dry_run in (("--dry-run",), ()):
        assert cli(wire_uri, database, "run", *dry_run) == 1
        said = capsys.readouterr().err
        assert f"drop {LEGACY_TURNS} or rename it away" in said
    assert stored_messages(database) == stored
    assert database[CONVERSATIONS].count_documents({}) == 2
    assert database[LEGACY_TURNS].count_documents({"conversation_id": "c-1"}) == 1

    database[LEGACY_TURNS].drop()
    assert cli(wire_uri, database, "run") == 0
    assert database[MESSAGES].count_documents({"conversation_id": "c-1"}) == 0
    assert database[CONVERSATIONS].find_one({"_id": "c-1"}) is None
    assert cli(wire_uri, database, "verify") == 0


@pytest.mark.wire
def test_verify_and_finish_after_a_rollback_say_the_legacy_turns_are_back_unmoved(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """After the runbook's rollback the legacy turns are in `agent_conversations` again:
    `verify` and `finish` compare nothing (a run moves them aside first), say where they are
    (never "no legacy data") and that a run comes first, and change nothing."""
    database[CONVERSATIONS].insert_many([legacy_turn("t-1", "c-1", 0, "T")])
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-1", "«LIVE»", dual_write=True)
    roll_back(database, clear_messages=False)
    stored = stored_messages(database)
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 2
    said = capsys.readouterr().err
    assert f"the legacy turns are in {CONVERSATIONS}" in said
    assert "a rollback put them back" in said
    assert "no legacy data" not in said
    assert cli(wire_uri, database, "finish") == 1
    assert "a rollback put them back" in capsys.readouterr().out
    assert stored_messages(database) == stored
    assert LEGACY_TURNS not in database.list_collection_names()


class InsertLog(monitoring.CommandListener):
    def __init__(self) -> None:
        self.inserts: list[list[dict[str, Any]]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "insert":
            self.inserts.append(list(event.command["documents"]))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def commands_sent(
    wire_uri: str, db: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, *args: str
) -> int:
    """The commands one migration command sends to the database (`CommandLog`), besides the
    driver's own (`hello`, `ping`, `endSessions`); it exits as a migration that passes."""
    log = CommandLog()

    def counted(*given: Any, **options: Any) -> MongoClient[dict[str, Any]]:
        return MongoClient(*given, event_listeners=[log], **options)

    with monkeypatch.context() as patched:
        patched.setattr(connection, "MongoClient", counted)
        assert cli(wire_uri, db, *args) == 0
    return len(log.names)


MIGRATION_COMMANDS = {"run": (98, 20), "verify": (26, 5), "finish": (45, 0)}
"""The commands `run`, `verify` and `finish` send over conversations of 3 turns (`--progress
none`; `run --batch-size 1 --spread 1` and `verify --batch-size 1`: each conversation a batch):
for one conversation, and for each other. Were: run 129 and 24, verify 40 and 5, finish 51
and 0 (a fence read the state twice beside its renewal; every id kind was asked for, and
every id counted for no progress display); the dual-written copies' records cost run and
verify one command more, finish two (their reads wherever a conversation stands)."""


@pytest.mark.wire
def test_run_verify_and_finish_send_a_fixed_number_of_commands_per_conversation(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a migration command sends grows by the same few commands for each conversation
    of 3 turns, and no more: the run's lease fences each batch by its renewal alone (no read
    of the state beside it), no id kind is asked for that no turn holds, and the ids are
    counted only for a progress display shown."""
    sent: dict[str, list[int]] = {"run": [], "verify": [], "finish": []}
    for conversations in (1, 4):
        db = database.client[f"{database.name}_{conversations}"]
        db[CONVERSATIONS].insert_many(
            [legacy_turn(f"t-{c}-{n}", f"c-{c}", n, f"T{c}.{n}") for c in range(conversations)
             for n in range(3)]
        )  # fmt: skip
        try:
            for command, *options in (
                ("run", "--batch-size", "1", "--spread", "1"),
                ("verify", "--batch-size", "1"),
                ("finish",),
            ):
                sent[command].append(commands_sent(wire_uri, db, monkeypatch, command, *options))
        finally:
            database.client.drop_database(db.name)

    found = {command: (one, (four - one) / 3) for command, (one, four) in sent.items()}
    assert found == MIGRATION_COMMANDS


@pytest.mark.wire
def test_each_insert_holds_at_most_n_documents_and_m_bytes(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    log = InsertLog()
    client: MongoClient[dict[str, Any]] = MongoClient(
        wire_uri, tz_aware=True, event_listeners=[log]
    )
    db = client[database.name]
    db[CONVERSATIONS].insert_many(corpus(6))
    seed_mess(db, "mess-big-result")
    relocate.relocate(db)
    log.inserts.clear()
    options = explode.Options(batch_size=100, max_command_documents=5, max_command_bytes=64_000)
    run = explode.Explosion(db, options, lease=None)
    run.run(run.plan(None))
    client.close()

    sizes = [(len(docs), sum(len(bson.encode(d)) for d in docs)) for docs in log.inserts]
    assert sizes
    assert all(count <= 5 for count, _ in sizes)
    assert all(count == 1 or size <= 64_000 for count, size in sizes)
    messages = sum(len(docs) for docs in log.inserts if "seq" in docs[0])
    assert messages == database[MESSAGES].count_documents({}) > 5


@pytest.mark.wire
def test_a_dead_runs_lock_is_waited_for_then_taken(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    database[CONVERSATIONS].insert_many(corpus(1))
    Lease(database, "run-killed", timedelta(seconds=2)).acquire()  # never renewed: it died

    assert cli(wire_uri, database, "run") == 0

    assert "waiting" in capsys.readouterr().err
    assert database[MESSAGES].count_documents({}) > 0


@pytest.mark.wire
def test_the_cli_finds_the_embedded_database_a_running_service_publishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent_store.embedded import ServerThread

    monkeypatch.delenv("MONGODB_URI", raising=False)
    monkeypatch.setenv("AGENT_STORE_DATA_DIR", str(tmp_path))
    server = ServerThread(tmp_path)  # as `make run` starts it
    uri = server.start()
    try:
        client: MongoClient[dict[str, Any]] = MongoClient(uri, tz_aware=True)
        client["agent_store"][CONVERSATIONS].insert_many(corpus(1))
        assert main(["run", "--progress", "none"]) == 0
        assert client["agent_store"][MESSAGES].count_documents({}) > 0
        client.close()
    finally:
        server.stop()
    assert uri in capsys.readouterr().out


@pytest.mark.wire
def test_the_cli_opens_the_embedded_database_itself_when_no_service_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent_store.embedded import ServerThread

    monkeypatch.delenv("MONGODB_URI", raising=False)
    monkeypatch.setenv("AGENT_STORE_DATA_DIR", str(tmp_path))
    server = ServerThread(tmp_path)
    client: MongoClient[dict[str, Any]] = MongoClient(server.start(), tz_aware=True)
    client["agent_store"][CONVERSATIONS].insert_many(corpus(1))
    client.close()
    server.stop()

    assert main(["status", "--progress", "none"]) == 0

    out = capsys.readouterr().out
    assert "the embedded database" in out
    assert "legacy turns not yet moved aside (in agent_conversations): yes" in out


@pytest.mark.wire
def test_a_rerun_replaces_the_problems_an_earlier_run_recorded(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    seed_mess(database, "mess-hitl", "mess-unplaced")
    assert cli(wire_uri, database, "run") == 0
    recorded = sorted(database[PROBLEMS].distinct("_id"))
    # As an older version of the converter would have reported it.
    database[PROBLEMS].insert_one(
        {"_id": "mess-hitl|response_text_not_in_parts|0", "conversation_id": "mess-hitl",
         "kind": "response_text_not_in_parts", "placed": False}
    )  # fmt: skip

    assert cli(wire_uri, database, "run", "--restart") == 0

    assert sorted(database[PROBLEMS].distinct("_id")) == recorded


@pytest.mark.wire
def test_a_conversation_logged_live_with_its_legacy_content_verifies_and_passes_the_gate(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo store: the example logged live, and its legacy turns beside it."""
    turns = example_legacy_turns()
    database[CONVERSATIONS].insert_many(turns)
    relocate.relocate(database)
    live = convert(turns)
    assert live.conversation is not None
    database[CONVERSATIONS].insert_one(
        live.conversation.model_dump(by_alias=True)
        | {"turns": [{"k": 1, "f": 0, "d": 1, "a": live.conversation.created_at}]}
    )
    database[MESSAGES].insert_many(
        [
            m.model_dump(by_alias=True) | {"_id": f"live-{m.seq}", "turn_id": "turn-1"}
            for m in live.messages
        ]
    )

    assert cli(wire_uri, database, "run", "--dry-run") == 0
    assert cli(wire_uri, database, "run") == 0
    out = capsys.readouterr().out
    assert [summary(part)["already live"] for part in out.split("took")[:2]] == [1, 1]
    problem = database[PROBLEMS].find_one({"kind": "conversation_already_live"})
    assert problem is not None
    assert problem["placed"] is True
    assert cli(wire_uri, database, "verify") == 0
    # Its first user message's runtime context is in no message, live or migrated: only the
    # problem keeping it holds it, which an operator accepts.
    assert cli(wire_uri, database, "finish") == 1
    assert "hidden_runtime_context" in capsys.readouterr().out
    accept = ("--accept", EXAMPLE_CONVERSATION_ID, "--note", "runtime context archived")
    assert cli(wire_uri, database, "finish", *accept) == 0


UPLOAD = {"filename": "contract.pdf", "file_type": "application/pdf", "size": 1234}
PARSED = "clause 7: the buyer pays"
PROMPT = {"action": "approve_payment", "request_id": "r1"}
PARAMS = {"amount": "9999 EUR"}


def _logged(
    wire_uri: str,
    database: Database[dict[str, Any]],
    cid: str,
    messages: list[dict[str, Any]],
    *,
    dual_write: bool = False,
) -> None:
    """`messages` logged as one live turn of user "u1" (the legacy dual write on if asked)."""

    async def log() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        db = client[database.name]
        observers = [LegacyTurns(db, dual_write=True)] if dual_write else []
        try:
            logger = AgentMessageLogger(db, observers=observers)
            await logger.log_messages(cid, messages, user_id="u1", turn_id="turn-1")
        finally:
            await client.close()

    asyncio.run(log())


def _upload_and_prompt(parsed: str | None, params: dict[str, Any]) -> list[dict[str, Any]]:
    upload = UPLOAD if parsed is None else UPLOAD | {"parsed_text": parsed}
    return [
        {"role": "user", "content": "see attached", "upload": upload},
        {"role": "assistant", "content": "Approve?", "hitl_action": PROMPT | {"params": params}},
    ]


@pytest.mark.wire
@pytest.mark.parametrize("left_out", ["parsed_text", "params"])
def test_live_messages_without_an_uploads_parsed_text_or_a_prompts_params_do_not_hold_it(
    wire_uri: str, database: Database[dict[str, Any]], left_out: str
) -> None:
    """A conversation logged to live before its migration is `held` only if its live messages
    hold all of its legacy content: an upload's parsed text and a prompt's params too, not
    only the lines a person reads. Otherwise the legacy content is kept in the problem and
    the drop waits for an operator."""
    legacy = {
        "_id": "lt1", "conversation_id": "cp", "user_id": "u1",
        "created_at": datetime(2021, 1, 1, tzinfo=UTC), "user_message": "see attached",
        "upload_result": UPLOAD | {"parsed_text": PARSED},
        "response_parts": [{"type": "hitl", "action": PROMPT["action"], "params": PARAMS,
                            "request_id": "r1", "prompt": "Approve?"}],
    }  # fmt: skip
    database[CONVERSATIONS].insert_one(legacy)
    said = _upload_and_prompt(
        None if left_out == "parsed_text" else PARSED, {} if left_out == "params" else PARAMS
    )
    _logged(wire_uri, database, "cp", said)

    assert cli(wire_uri, database, "run") == 0
    [problem] = database[PROBLEMS].find({"conversation_id": "cp"})
    assert (problem["kind"], problem["placed"]) == ("conversation_already_live", False)
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1


UNREADABLE_FIRST_PARTS = {
    "tool_calls holding an entry of no call": {"tool_calls": [{"foo": "x"}]},
    "tool_calls as one object of no call": {"tool_calls": {"foo": "x"}},
    "tool_calls holding a number": {"tool_calls": [7]},
    "a first response part of no known type": {"response_parts": [{"foo": "x"}]},
}


@pytest.mark.wire
@pytest.mark.parametrize(
    "unreadable", UNREADABLE_FIRST_PARTS.values(), ids=list(UNREADABLE_FIRST_PARTS)
)
def test_an_upload_beside_an_unreadable_first_part_is_verified_as_any_upload(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    unreadable: dict[str, Any],
) -> None:
    """A problem keeping a part hides that part from `verify`, never the turn's upload: a
    faithful run verifies and is accepted, and an upload lost from its message is a
    difference."""
    database[CONVERSATIONS].insert_one({
        "_id": "t-1", "conversation_id": "c-u", "user_id": "u-1",
        "created_at": datetime(2025, 1, 1, 18, tzinfo=UTC), "user_message": "see my file",
        "upload_result": UPLOAD | {"parsed_text": PARSED},
    } | unreadable)  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish", "--accept", "c-u", "--note", "archived") == 0
    capsys.readouterr()

    database[MESSAGES].update_many({"upload": {"$ne": None}}, {"$set": {"upload": None}})

    assert cli(wire_uri, database, "verify") == 1
    assert "legacy has 'upload: contract.pdf" in capsys.readouterr().out


@pytest.mark.wire
@pytest.mark.parametrize("edited", ["upload_result.parsed_text", "response_parts.0.params"])
def test_a_dual_written_turn_whose_parsed_text_or_params_the_legacy_service_edited_is_work_left(
    wire_uri: str, database: Database[dict[str, Any]], edited: str
) -> None:
    """MIGRATION.md: a dual-written turn the legacy service edited after a rollback is a
    difference, in any content: an upload's parsed text, a prompt's params."""
    _logged(wire_uri, database, "dw", _upload_and_prompt(PARSED, PARAMS), dual_write=True)
    written = database[LEGACY_TURNS].find_one({"dual_write": True})
    assert written is not None
    assert [p["type"] for p in written["response_parts"]] == ["hitl"]
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 0
    database[LEGACY_TURNS].update_one({"_id": written["_id"]}, {"$set": {edited: {"x": "EDITED"}}})

    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1


@pytest.mark.wire
def test_another_users_live_messages_do_not_hold_a_users_legacy_conversation(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """User u2 logs to the id of u1's unmigrated conversation the very lines it holds: its
    live messages hold the text, not u1's conversation. The legacy turns are kept in an
    unplaced problem, and the drop waits for an operator."""
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-1", "shared-id", 0, "Hello") | {"user_id": "u1"}
    )

    async def log() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            said = [
                {"role": "user", "content": "Hello question"},
                {"role": "assistant", "content": "Hello answer"},
            ]
            logger = AgentMessageLogger(client[database.name])
            await logger.log_messages("shared-id", said, user_id="u2", turn_id="live-1")
        finally:
            await client.close()

    asyncio.run(log())

    assert cli(wire_uri, database, "run") == 0
    [problem] = database[PROBLEMS].find({"conversation_id": "shared-id"})
    assert (problem["kind"], problem["placed"]) == ("conversation_already_live", False)
    assert "'u2'" in problem["detail"]
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1


# -- the gate compares content, not ids -------------------------------------------------


def log_live(
    wire_uri: str,
    database: Database[dict[str, Any]],
    cid: str,
    turn_id: str,
    text: str,
    commands: CommandLog | None = None,
    *,
    dual_write: bool = False,
    at: datetime | None = None,
    name: str | None = None,
    user_id: str = "u-1",
) -> LoggedTurn:
    """A live turn (a question and its answer) logged by the new service's logger, with the
    dual write on if asked, its messages dated `at` by their caller if given."""
    dated = {} if at is None else {"created_at": at}

    async def log() -> LoggedTurn:
        listeners = [commands] if commands is not None else []
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
            wire_uri, tz_aware=True, event_listeners=listeners
        )
        if commands is not None:
            commands.clear()
        db = client[database.name]
        observers = [LegacyTurns(db, dual_write=True)] if dual_write else []
        try:
            rules = COUNTED if commands is not None else None
            return await AgentMessageLogger(db, observers=observers, rules=rules).log_messages(
                cid,
                [
                    {"role": "user", "content": f"{text}?", **dated},
                    {"role": "assistant", "content": text, **dated},
                ],
                user_id=user_id,
                turn_id=turn_id,
                name=name,
            )
        finally:
            await client.close()

    return asyncio.run(log())


def legacy_turn(turn_id: Any, cid: Any, hour: int, text: str) -> dict[str, Any]:
    return {
        "_id": turn_id, "conversation_id": cid, "user_id": "u-1",
        "created_at": datetime(2024, 1, 1, hour, tzinfo=UTC),
        "user_message": f"{text} question",
        "response_parts": [{"type": "text", "content": f"{text} answer"}],
    }  # fmt: skip


def stored_messages(database: Database[dict[str, Any]]) -> list[dict[str, Any]]:
    return list(database[MESSAGES].find({}, sort=[("conversation_id", 1), ("seq", 1)]))


@pytest.mark.wire
def test_turns_under_numbers_equal_by_value_are_migrated_as_one_conversation(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The old service's `{conversation_id: 42}` found the turns stored under 42, 42.0,
    `Decimal128("42.0")` and `Int64(42)`: one conversation, "42", in the run, `verify`,
    `finish` and a run of it alone."""
    ids = [42, 42.0, bson.Decimal128("42.0"), bson.Int64(42)]
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", cid, n, f"TURN {n}") for n, cid in enumerate(ids)]
    )

    assert cli(wire_uri, database, "run", "--batch-size", "1") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0

    assert database[CONVERSATIONS].distinct("_id") == ["42"]
    asked = [m["content"] for m in stored_messages(database) if m["role"] == "user"]
    assert asked == [f"TURN {n} question" for n in range(4)]
    assert database[PROBLEMS].count_documents({}) == 0
    assert cli(wire_uri, database, "run", "--conversation", "42") == 0
    assert cli(wire_uri, database, "verify", "--conversation", "42") == 0
    assert database[MESSAGES].count_documents({}) == 8


@pytest.mark.wire
def test_a_request_answered_in_a_later_prompt_record_is_migrated_answered(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Two `session_hitl` records of one request, pending then approved: it is answered,
    never asked again. A pending record after its answer contradicts it: a problem holds the
    drop until an operator accepts it."""
    raised = {"type": "hitl", "action": "pay", "request_id": "req-1", "prompt": "Pay Bob?"}
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-1", "c-h", 10, "PAY") | {"response_parts": [raised]}
    )
    asked = {"conversation_id": "c-h", "user_id": "u-1", "request_id": "req-1",
             "action": "pay", "prompt": "Pay Bob?", "status": "pending",
             "created_at": datetime(2024, 1, 1, 10, tzinfo=UTC)}  # fmt: skip
    answered = {**asked, "status": "approved", "resolved": True,
                "created_at": datetime(2024, 1, 1, 10, 2, tzinfo=UTC)}  # fmt: skip
    database[SESSION_HITL].insert_many([asked, answered])

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    migrated = database[CONVERSATIONS].find_one({"_id": "c-h"})
    assert migrated is not None
    assert migrated.get("pending_hitl") is None
    assert database[PROBLEMS].count_documents({}) == 0

    database[SESSION_HITL].update_one(
        {"status": "pending"}, {"$set": {"created_at": datetime(2024, 1, 1, 10, 5, tzinfo=UTC)}}
    )
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "finish") == 1
    assert "contradictory_prompt_state" in capsys.readouterr().out
    stored = database[CONVERSATIONS].find_one({"_id": "c-h"})
    assert stored is not None
    assert stored.get("pending_hitl") is None
    assert cli(wire_uri, database, "finish", "--accept", "c-h", "--note", "read") == 0


@pytest.mark.wire
def test_a_turn_whose_id_names_the_prompts_collection_is_verified_as_any_turn(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A problem of a `session_hitl` prompt is never taken for a problem of a turn, whatever
    the turn's `_id`: a faithful run verifies and is accepted, and the turn's message lost is
    a difference."""
    database[CONVERSATIONS].insert_many([
        legacy_turn("t-1", "c-s", 9, "FIRST"), legacy_turn(SESSION_HITL, "c-s", 10, "SECOND")
    ])  # fmt: skip
    database[SESSION_HITL].insert_one(  # no request id: kept in a problem, not placed
        {"conversation_id": "c-s", "user_id": "u-1", "status": "pending", "prompt": "ok?",
         "action": "pay"}
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish", "--accept", "c-s", "--note", "read") == 0
    capsys.readouterr()

    database[MESSAGES].delete_one({"conversation_id": "c-s", "content": "SECOND question"})

    assert cli(wire_uri, database, "verify") == 1
    assert "legacy has 'user: SECOND question' only" in capsys.readouterr().out


@pytest.mark.wire
def test_turns_dated_by_text_at_an_offset_are_migrated_in_time_order_and_verify_checks_times(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """10:30 at +02:00 is 08:30 UTC: before a turn of 09:00 UTC, whatever its text says. A
    stored message dated otherwise than its turn reads (as a reading that ignored the offset
    stored it) is a difference `verify` names, never a match."""
    database[CONVERSATIONS].insert_many([
        legacy_turn("t-2", "c-js", 9, "SECOND"),
        legacy_turn("t-3", "c-js", 0, "THIRD")
        | {"created_at": "Mon, 01 Jan 2024 04:30:00 -05:00"},
        legacy_turn("t-1", "c-js", 0, "FIRST")
        | {"created_at": "Mon Jan 01 2024 10:30:00 GMT+0200 (Central European Standard Time)"},
    ])  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0

    asked = [m["content"] for m in stored_messages(database) if m["role"] == "user"]
    assert asked == ["FIRST question", "SECOND question", "THIRD question"]
    first = database[MESSAGES].find_one({"content": "FIRST question"})
    assert first is not None
    assert first["created_at"].replace(tzinfo=UTC) == datetime(2024, 1, 1, 8, 30, tzinfo=UTC)
    assert database[PROBLEMS].count_documents({}) == 0

    misread = datetime(2024, 1, 1, 10, 30, tzinfo=UTC)
    database[MESSAGES].update_many({"turn_id": "legacy-t-1"}, {"$set": {"created_at": misread}})
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 1
    assert "c-js" in capsys.readouterr().out


@pytest.mark.wire
def test_a_conversation_without_a_readable_time_keeps_its_times_when_moved(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """Read through the fallback after a run recorded its first start, a conversation none of
    whose turns has a readable time is served that start, as the run then writes it: its
    times are the same before and after the run moves it. The run writing its document draws
    its epoch, which names it from then on (its version, its `ETag`): a delete naming the
    version read through the fallback, which names every conversation its legacy turns made
    under the id at that time alike, is refused, nothing deleted; one naming the version
    read since deletes it."""
    undated = legacy_turn("t-u", "c-undated", 0, "OLD")
    del undated["created_at"]
    database[CONVERSATIONS].insert_many([undated, legacy_turn("t-a", "c-a", 0, "A")])
    assert cli(wire_uri, database, "run", "--conversation", "c-a") == 0  # moves both aside
    started = database[lease.STATE].find_one({"_id": lease.STATE_ID})["undated_at"]

    async def served() -> tuple[str, set[datetime]]:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            store = ConversationStore(
                client[database.name], legacy=LegacyTurns(client[database.name])
            )
            found = await store.get_conversation("c-undated", user_id="u-1")
            transcript = await store.transcript("c-undated", user_id="u-1")
            return found.version, {found.created_at} | {m.created_at for m in transcript}
        finally:
            await client.close()

    async def delete(version: str) -> int:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            store = ConversationStore(
                client[database.name], legacy=LegacyTurns(client[database.name])
            )
            return (await store.delete("c-undated", user_id="u-1", version=version)).conversations
        finally:
            await client.close()

    before = asyncio.run(served())
    assert database[CONVERSATIONS].find_one({"_id": "c-undated"}) is None  # the fallback's
    assert cli(wire_uri, database, "run") == 0

    after = asyncio.run(served())
    assert after[1] == before[1] == {started}
    with pytest.raises(VersionMismatch):
        asyncio.run(delete(before[0]))
    assert asyncio.run(delete(after[0])) == 1


@pytest.mark.wire
def test_two_turns_whose_ids_read_alike_in_one_conversation_are_both_migrated(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`ObjectId(X)` and the string `"X"` (a re-import) are two turns: both are migrated,
    a rerun changes nothing, and the gate passes with every content kept."""
    oid = bson.ObjectId()
    first = legacy_turn(oid, "c-1", 0, "«FIRST»")
    first["response_parts"].append({"type": "mystery", "content": "«KEPT»"})
    second = legacy_turn(str(oid), "c-1", 1, "«SECOND»")
    second["response_parts"].append({"type": "text", "content": "«SECOND more»"})
    database[CONVERSATIONS].insert_many([first, second])

    assert cli(wire_uri, database, "run") == 0
    migrated = stored_messages(database)
    assert cli(wire_uri, database, "run") == 0
    assert stored_messages(database) == migrated
    assert [m["content"] for m in migrated] == [
        "«FIRST» question", "«FIRST» answer", "«SECOND» question", "«SECOND» answer",
        "«SECOND more»",
    ]  # fmt: skip
    assert [p["kind"] for p in database[PROBLEMS].find()] == ["unknown_part"]
    assert cli(wire_uri, database, "verify") == 0, capsys.readouterr().out
    assert cli(wire_uri, database, "finish", "--accept", "c-1", "--note", "kept") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert {"«FIRST»", "«KEPT»", "«SECOND»", "«SECOND more»"} <= set(
        re.findall("«[^»]*»", kept_text(database))
    )


@pytest.mark.wire
def test_a_turn_whose_id_reads_like_a_migrated_ones_leaves_that_turns_messages_as_they_are(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The ids an earlier run derived stay: only the turn whose id reads like another's gets
    ids of its own."""
    oid = bson.ObjectId()
    database[CONVERSATIONS].insert_one(legacy_turn(oid, "c-1", 0, "FIRST"))
    assert cli(wire_uri, database, "run") == 0
    before = stored_messages(database)
    database[LEGACY_TURNS].insert_one(legacy_turn(str(oid), "c-1", 1, "SECOND"))

    assert cli(wire_uri, database, "run") == 0

    after = stored_messages(database)
    assert after[:2] == before
    assert [m["content"] for m in after[2:]] == ["SECOND question", "SECOND answer"]
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_legacy_turn_changed_or_added_after_the_run_is_work_left(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-a", "c-a", 0, "A"), legacy_turn("t-b", "c-b", 0, "B")]
    )
    assert cli(wire_uri, database, "run") == 0
    database[LEGACY_TURNS].update_one({"_id": "t-a"}, {"$set": {"user_message": "A edited"}})
    database[LEGACY_TURNS].insert_one(legacy_turn("t-b2", "c-b", 1, "B late"))
    capsys.readouterr()

    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1

    out = capsys.readouterr().out
    assert "c-a" in out
    assert "c-b" in out
    assert database[LEGACY_TURNS].count_documents({}) == 3


EDITS_NO_TRANSCRIPT_SHOWS = {
    "an upload's parsed text": (
        {"upload_result": {"filename": "a.pdf", "file_type": "pdf", "size": 10,
                           "parsed_text": "old parsed"}},
        {"upload_result.parsed_text": "new parsed «edit»"},
    ),
    "a prompt's params": (
        {"response_parts": [{"type": "hitl", "action": "pay", "params": {"eur": 10},
                             "request_id": "r-1", "prompt": "Pay?"}]},
        {"response_parts.0.params": {"eur": "«edit»"}},
    ),
    "a cut result's end": (
        {"response_parts": [{"type": "tool_call", "tool_name": "f", "args": {}},
                            {"type": "tool_result", "tool_name": "f",
                             "result": "x" * BIG_RESULT_CHARS + "old end"}]},
        {"response_parts.1.result": "x" * BIG_RESULT_CHARS + "new end «edit»"},
    ),
}  # fmt: skip


@pytest.mark.wire
@pytest.mark.parametrize(("fields", "edit"), EDITS_NO_TRANSCRIPT_SHOWS.values(),
                         ids=list(EDITS_NO_TRANSCRIPT_SHOWS))  # fmt: skip
def test_a_turn_edited_after_the_run_in_any_field_is_work_left_until_a_run_takes_it(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    fields: dict[str, Any],
    edit: dict[str, Any],
) -> None:
    """The gate compares every field of every stored message with what the converter makes
    of its legacy turn now, not only what a transcript shows; a rerun rewrites it."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-a", "c-a", 0, "A") | fields)
    assert cli(wire_uri, database, "run") == 0
    database[LEGACY_TURNS].update_one({"_id": "t-a"}, {"$set": edit})
    capsys.readouterr()

    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "differ from what their legacy turns convert to now" in capsys.readouterr().out
    assert database[LEGACY_TURNS].count_documents({}) == 1

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert "«edit»" in kept_text(database)


def _prompt_recorded_late(db: Database[dict[str, Any]]) -> None:
    """The old service, not quite stopped, records the turn's prompt as pending."""
    db[SESSION_HITL].insert_one(
        {"conversation_id": "c-a", "request_id": "r-1", "action": "pay", "status": "pending",
         "prompt": "Pay «edit»?"}
    )  # fmt: skip


EDITS_ONLY_THE_CONVERSATION_SHOWS = {
    "a name": (
        {"name": "Old name"},
        lambda db: db[LEGACY_TURNS].update_one({"_id": "t-a"}, {"$set": {"name": "New «edit»"}}),
        "«edit»",
    ),
    "the usage of a turn without answer": (
        {"user_message": "", "response_parts": [],
         "upload_result": {"filename": "a.pdf", "file_type": "pdf", "size": 10},
         "token_usage": {"input_tokens": 100, "output_tokens": 5}},
        lambda db: db[LEGACY_TURNS].update_one(
            {"_id": "t-a"}, {"$set": {"token_usage.input_tokens": 7777}}
        ),
        "7777",
    ),
    "a prompt recorded pending": (
        {"response_parts": [{"type": "hitl", "action": "pay", "params": {},
                             "request_id": "r-1", "prompt": "Pay?"}]},
        _prompt_recorded_late,
        "«edit»",
    ),
}  # fmt: skip


@pytest.mark.wire
@pytest.mark.parametrize(("fields", "edit", "shown"), EDITS_ONLY_THE_CONVERSATION_SHOWS.values(),
                         ids=list(EDITS_ONLY_THE_CONVERSATION_SHOWS))  # fmt: skip
def test_legacy_data_edited_after_the_run_that_only_the_conversation_shows_is_work_left(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    fields: dict[str, Any],
    edit: Callable[[Database[dict[str, Any]]], Any],
    shown: str,
) -> None:
    """The gate compares the conversation document (name, usage, pending prompt) with what
    the legacy turns convert to now, by the rule a rerun writes it by."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-a", "c-a", 0, "A") | fields)
    assert cli(wire_uri, database, "run") == 0
    edit(database)
    capsys.readouterr()

    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "conversation document differs" in capsys.readouterr().out
    assert database[LEGACY_TURNS].count_documents({}) == 1

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 0
    stored = database[CONVERSATIONS].find_one({"_id": "c-a"})
    assert shown in json.dumps(stored, default=str, ensure_ascii=False)


@pytest.mark.wire
@pytest.mark.parametrize(
    ("odd", "text"),
    [(7, "7"), (True, "True"), (bson.Decimal128("7.0"), "7"), (bson.Decimal128("0.1"), '"0.1"')],
    ids=["number", "bool", "decimal", "a decimal no double is"],
)
def test_a_conversation_whose_turns_name_it_by_a_value_and_by_its_text_is_one_conversation(
    wire_uri: str, database: Database[dict[str, Any]], odd: Any, text: str
) -> None:
    """7 and "7" (True and "True", …) are one conversation to the reader, so to the migration
    too, even in batches apart: each turn's unplaced part is recorded, none replaces the
    other's."""

    def mystery(turn_id: str, cid: Any, mark: str) -> dict[str, Any]:
        parts = [{"type": "text", "content": "hello"}, {"type": "mystery_widget", "data": mark}]
        return legacy_turn(turn_id, cid, 0, "hi") | {"response_parts": parts}

    database[CONVERSATIONS].insert_many(
        [mystery("t-odd", odd, "«of the value»"), mystery("t-str", text, "«of the text»")]
        + [legacy_turn(f"t-{n}", n, 1, "between") for n in range(8, 12)]  # type: ignore[arg-type]
    )
    assert cli(wire_uri, database, "run", "--batch-size", "1") == 0
    stored_id = parse_turns([mystery("t-odd", odd, "")])[0].stored_conversation_id
    assert cli(wire_uri, database, "finish", "--accept", stored_id, "--note", "read") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0

    kept = kept_text(database)
    assert "«of the value»" in kept
    assert "«of the text»" in kept
    assert len(database[MESSAGES].distinct("turn_id", {"conversation_id": stored_id})) == 2


@pytest.mark.wire
def test_an_acceptance_covers_the_unplaced_content_accepted_not_content_edited_since(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    parts = [{"type": "text", "content": "hello"}, {"type": "mystery_widget", "data": "«old»"}]
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-a", "c-a", 0, "A") | {"response_parts": parts}
    )
    assert cli(wire_uri, database, "run") == 0
    database[LEGACY_TURNS].update_one({"_id": "t-a"}, {"$set": {"response_parts.1.data": "«new»"}})
    capsys.readouterr()

    assert cli(wire_uri, database, "finish", "--accept", "c-a", "--note", "read") == 1
    assert "run the migration again" in capsys.readouterr().out
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert cli(wire_uri, database, "finish", "--accept", "c-a", "--note", "read") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert "«new»" in kept_text(database)


@pytest.mark.wire
def test_a_pending_prompt_of_a_conversation_without_legacy_turns_is_kept_and_must_be_accepted(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """No conversion takes it: the run records it as unplaced, and the gate looks for such
    prompts itself, so one recorded after the run is work left too."""

    def prompt(cid: str, mark: str) -> dict[str, Any]:
        return {"conversation_id": cid, "request_id": f"r-{cid}", "action": "wire",
                "status": "pending", "prompt": f"Wire 9000 € {mark}?"}  # fmt: skip

    database[CONVERSATIONS].insert_one(legacy_turn("t-a", "c-a", 0, "A"))
    database[SESSION_HITL].insert_one(prompt("c-gone", "«orphan»"))
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    database[SESSION_HITL].insert_one(prompt("c-late", "«late»"))
    capsys.readouterr()

    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    out = capsys.readouterr().out
    assert "c-gone" in out
    assert "orphan_pending_hitl" in out
    assert "c-late" in out
    assert "«orphan»" in kept_text(database)
    assert cli(wire_uri, database, "run") == 0
    accept = ["--accept", "c-gone", "--accept", "c-late", "--note", "asked the users"]
    assert cli(wire_uri, database, "finish", *accept) == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert "«late»" in kept_text(database)


PROMPTS_NO_CONVERSION_READS = {
    "blank, as blank turns are": ("   ", {"conversation_id": "   "}),
    "blank, of a session without turns": (" ", {"conversation_id": " ", "session_id": "s-gone"}),
    "zero, its session with turns": ("c-a", {"conversation_id": 0, "session_id": "c-a"}),
    "double zero": ("c-a", {"conversation_id": 0.0, "session_id": "c-a"}),
    "false": ("c-a", {"conversation_id": False, "session_id": "c-a"}),
}


@pytest.mark.wire
@pytest.mark.parametrize(
    ("turns_name", "names"),
    PROMPTS_NO_CONVERSION_READS.values(),
    ids=list(PROMPTS_NO_CONVERSION_READS),
)
def test_a_pending_prompt_no_conversion_reads_is_an_orphan_however_it_names_its_conversation(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    turns_name: str,
    names: dict[str, Any],
) -> None:
    """Orphan or not is decided by the naming the migration reads prompts by
    (`prompt_conversation`): a blank id names no conversation, 0 names "0"."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-a", turns_name, 0, "A"))
    database[SESSION_HITL].insert_one(
        {**names, "request_id": "r-x", "action": "wire", "status": "pending",
         "prompt": "Wire 9000 € «orphan»?"}
    )  # fmt: skip

    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()

    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "orphan_pending_hitl" in capsys.readouterr().out
    assert "«orphan»" in kept_text(database)


class CommandSizes(monitoring.CommandListener):
    def __init__(self) -> None:
        self.sizes: list[tuple[str, int]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.sizes.append((event.command_name, len(bson.encode(event.command))))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def _largest_commands_of_a_run_and_gate(
    wire_uri: str, database: Database[dict[str, Any]]
) -> dict[str, int]:
    """The size of the largest command of each name a run and the gate send."""
    log = CommandSizes()
    client: MongoClient[dict[str, Any]] = MongoClient(
        wire_uri, tz_aware=True, event_listeners=[log]
    )
    db = client[database.name]
    try:
        run = explode.Explosion(db, explode.Options(batch_size=100), lease=None)
        run.after_all = lambda: orphan_prompts.record(run)
        run.run(run.plan(None))
        assert not gate.check(db, undated_at=run.undated_at).open
    finally:
        client.close()
    largest: dict[str, int] = {}
    for name, size in log.sizes:
        largest[name] = max(size, largest.get(name, 0))
    return largest


@pytest.mark.wire
def test_the_commands_and_memory_of_the_orphan_step_are_bounded_however_many_orphans(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run records orphan prompts, and the gate checks them, a chunk of prompts at a time
    (no command holds every orphan: a `$nin` of all their ids reached 16 MiB at ~390k); a
    prompt answered since is no longer recorded."""
    monkeypatch.setattr(orphan_prompts, "CHUNK", 40)

    def orphans(first: int, n: int) -> list[dict[str, Any]]:
        return [{"conversation_id": f"gone-{i:06d}", "request_id": "r", "status": "pending",
                 "prompt": "?"} for i in range(first, first + n)]  # fmt: skip

    database[CONVERSATIONS].insert_one(legacy_turn("t-a", "c-a", 0, "A"))
    database[SESSION_HITL].insert_many(orphans(0, 100))
    relocate.relocate(database)
    with_few = _largest_commands_of_a_run_and_gate(wire_uri, database)
    database[SESSION_HITL].insert_many(orphans(100, 400))
    database[SESSION_HITL].update_one(
        {"conversation_id": "gone-000007"}, {"$set": {"resolved": True}}
    )
    with_many = _largest_commands_of_a_run_and_gate(wire_uri, database)

    grown = {name: (with_few.get(name), size) for name, size in with_many.items()}
    assert all(few is not None and size <= few + 64 for few, size in grown.values()), grown
    recorded = database[PROBLEMS].distinct("conversation_id", {"kind": "orphan_pending_hitl"})
    assert (len(recorded), "gone-000007" in recorded) == (499, False)


@pytest.mark.wire
def test_a_rerun_keeps_the_name_a_person_gave_a_migrated_conversation(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    import asyncio

    from pymongo import AsyncMongoClient

    from agent_store import ConversationStore

    async def rename() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            await ConversationStore(client[database.name]).rename("c-a", "Trip to Lyon")
        finally:
            await client.close()

    database[CONVERSATIONS].insert_one(legacy_turn("t-a", "c-a", 0, "A"))
    assert cli(wire_uri, database, "run") == 0
    asyncio.run(rename())

    assert cli(wire_uri, database, "run") == 0

    found = database[CONVERSATIONS].find_one({"_id": "c-a"})
    assert found is not None
    assert (found["name"], found["name_source"]) == ("Trip to Lyon", "set")
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_rerun_keeps_a_prompt_a_person_resolved_after_the_run_resolved(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    async def resolve() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            await ConversationStore(client[database.name]).resolve_hitl("c-a", "r-1")
        finally:
            await client.close()

    prompt = {"type": "hitl", "action": "pay", "params": {}, "request_id": "r-1", "prompt": "?"}
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-a", "c-a", 0, "A") | {"response_parts": [prompt]}
    )
    _prompt_recorded_late(database)
    assert cli(wire_uri, database, "run") == 0
    asyncio.run(resolve())

    assert cli(wire_uri, database, "run", "--restart") == 0
    assert cli(wire_uri, database, "run", "--restart") == 0

    found = database[CONVERSATIONS].find_one({"_id": "c-a"})
    assert found is not None
    assert found["pending_hitl"] is None
    assert cli(wire_uri, database, "finish") == 0


def _with_upload(turn: dict[str, Any], parsed: str) -> dict[str, Any]:
    upload = {"filename": "a.pdf", "file_type": "pdf", "size": 10, "parsed_text": parsed}
    return turn | {"upload_result": upload}


ONE_THEN_TWO = [
    _with_upload(legacy_turn("t-1", "c-a", 0, "ONE"), "old")
    | {"response_parts": [{"type": "text", "content": "ONE answer"},
                          {"type": "tool_call", "tool_name": "f", "args": {"x": 1}},
                          {"type": "tool_result", "tool_name": "f", "result": "R1"}]},
    legacy_turn("t-2", "c-a", 1, "TWO"),
]  # fmt: skip
EDITS_THAT_MOVE_MESSAGES = {
    "a part added to an earlier turn": (
        ONE_THEN_TWO,
        {"_id": "t-1"},
        {"$push": {"response_parts": {"type": "text", "content": "added «edit»"}}},
    ),
    "a part removed, a hidden field edited": (
        ONE_THEN_TWO,
        {"_id": "t-1"},
        {"$set": {"response_parts": [{"type": "text", "content": "ONE answer"}],
                  "upload_result.parsed_text": "new «edit»"}},
    ),
    "look-alike turns reordered, one edited": (
        [_with_upload(legacy_turn("t-a", "c-a", 0, "hi"), "P-A"),
         _with_upload(legacy_turn("t-b", "c-a", 1, "hi"), "P-B")],
        {"_id": "t-a"},
        {"$set": {"created_at": datetime(2024, 1, 1, 2, tzinfo=UTC),
                  "upload_result.parsed_text": "P-A «edit»"}},
    ),
}  # fmt: skip


@pytest.mark.wire
@pytest.mark.parametrize(("turns", "which", "edit"), EDITS_THAT_MOVE_MESSAGES.values(),
                         ids=list(EDITS_THAT_MOVE_MESSAGES))  # fmt: skip
def test_an_edit_that_moves_migrated_messages_is_taken_by_a_rerun_never_passed_unseen(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    turns: list[dict[str, Any]],
    which: dict[str, Any],
    edit: dict[str, Any],
) -> None:
    """The migration's own messages at other places than the legacy turns put them now are
    moved by the next run (not taken for a conversation logged to live), and the dry run
    says what it will write."""
    database[CONVERSATIONS].insert_many(turns)
    assert cli(wire_uri, database, "run") == 0
    database[LEGACY_TURNS].update_one(which, edit)
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    capsys.readouterr()

    assert cli(wire_uri, database, "run", "--dry-run") == 0
    predicted = summary(capsys.readouterr().out)
    assert cli(wire_uri, database, "run") == 0
    assert summary(capsys.readouterr().out) == predicted

    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert "«edit»" in kept_text(database)
    assert database[PROBLEMS].count_documents({"kind": "conversation_already_live"}) == 0


@pytest.mark.wire
def test_a_rerun_moving_the_migrations_messages_keeps_the_live_turns_and_their_seqs(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A live turn logged after the migration is never moved or removed by a rerun that
    moves the migration's own messages, and the conversation takes turns after it."""
    database[CONVERSATIONS].insert_many(ONE_THEN_TWO)
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-a", "live-1", "LIVE")
    one_part = {"response_parts": [{"type": "text", "content": "ONE answer"}]}
    database[LEGACY_TURNS].update_one({"_id": "t-1"}, {"$set": one_part})

    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-a", "live-2", "AFTER")

    stored = list(database[MESSAGES].find({"conversation_id": "c-a"}).sort("seq", 1))
    assert [(m["seq"], m["content"]) for m in stored if m["turn_id"].startswith("live-")] == [
        (6, "LIVE?"), (7, "LIVE"), (8, "AFTER?"), (9, "AFTER"),
    ]  # fmt: skip
    assert database[CONVERSATIONS].find_one({"_id": "c-a"})["message_count"] == 10
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_reruns_that_move_messages_leave_the_conversation_writable_where_they_end(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """Messages a rerun moves are the migration's, never taken for live turns: the
    conversation document keeps no turn record of them and counts what is stored."""

    def calls(*tools: str) -> dict[str, Any]:
        parts: list[dict[str, Any]] = [{"type": "text", "content": "ONE answer"}]
        for tool in tools:
            parts += [{"type": "tool_call", "tool_name": tool, "args": {}},
                      {"type": "tool_result", "tool_name": tool, "result": tool}]  # fmt: skip
        return {"response_parts": parts}

    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-w", 0, "ONE") | calls("f"), legacy_turn("t-2", "c-w", 1, "TWO")]
    )
    assert cli(wire_uri, database, "run") == 0
    two = {"response_parts": [{"type": "text", "content": "TWO «edit»"}]}
    database[LEGACY_TURNS].update_one({"_id": "t-2"}, {"$set": two})  # a new preview
    database[LEGACY_TURNS].update_one({"_id": "t-1"}, {"$set": calls()})
    assert cli(wire_uri, database, "run") == 0
    assert not database[CONVERSATIONS].find_one({"_id": "c-w"}).get("turns")
    database[LEGACY_TURNS].update_one({"_id": "t-1"}, {"$set": calls("f", "g", "h")})
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 0

    stored = database[MESSAGES].count_documents({"conversation_id": "c-w"})
    log_live(wire_uri, database, "c-w", "live-1", "LIVE")
    assert database[CONVERSATIONS].find_one({"_id": "c-w"})["message_count"] == stored + 2


def unknown_part(payload: str) -> dict[str, Any]:
    """A part of a kind no reader knows: a problem keeps it whole."""
    return {"type": "mystery", "payload": payload}


KEPT_WHOLE = {
    # A cut message's whole text, and a problem's content too large for its document.
    "message": lambda text: [{"type": "tool_call", "tool_name": "f", "args": {}},
                             {"type": "tool_result", "tool_name": "f", "result": text}],
    "problem": lambda text: [{"type": "text", "content": "answer"}, unknown_part(text)],
}  # fmt: skip


def run_accepting(wire_uri: str, database: Database[dict[str, Any]], cid: str) -> None:
    """`run`, then `finish`, accepting the conversation's unplaced content when it has any."""
    assert cli(wire_uri, database, "run") == 0
    if cli(wire_uri, database, "finish") == 1:
        assert cli(wire_uri, database, "finish", "--accept", cid, "--note", "in problems") == 0


def gridfs_texts(db: Database[dict[str, Any]]) -> list[str]:
    """Every file of the bucket as GridFS reads it (raises on one it cannot read)."""
    bucket = gridfs.GridFSBucket(db, bucket_name=BLOB_BUCKET)
    return [
        bucket.open_download_stream(f["_id"]).read().decode()
        for f in db[f"{BLOB_BUCKET}.files"].find()
    ]


@pytest.mark.wire
@pytest.mark.parametrize("kept", KEPT_WHOLE.values(), ids=list(KEPT_WHOLE))
def test_a_run_killed_while_rewriting_a_whole_text_is_finished_by_the_next(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    kept: Callable[[str], list[dict[str, Any]]],
) -> None:
    """Killed between removing a file's `files` document and its chunks: the next run writes
    the file from these chunks only (the old ones would make it unreadable for good)."""
    from migrations import full_texts

    big = "y" * 2_000_000
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-a", "c-a", 0, "A") | {"response_parts": kept(big + "old")}
    )
    assert cli(wire_uri, database, "run") == 0
    database[LEGACY_TURNS].update_one(
        {"_id": "t-a"}, {"$set": {"response_parts": kept(big + "new «edit»")}}
    )

    def killed(db: Any, blob_ids: Any) -> None:
        db[f"{BLOB_BUCKET}.files"].delete_many({"_id": {"$in": list(blob_ids)}})
        raise KeyboardInterrupt  # before the chunks go

    monkeypatch.setattr(full_texts, "forget", killed)
    assert cli(wire_uri, database, "run") == 130
    monkeypatch.undo()

    run_accepting(wire_uri, database, "c-a")
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    [text] = gridfs_texts(database)
    assert "new «edit»" in text


@pytest.mark.wire
@pytest.mark.parametrize("kept", KEPT_WHOLE.values(), ids=list(KEPT_WHOLE))
@pytest.mark.parametrize("edited", [1_500_000, 2_500_000], ids=["shorter", "longer"])
def test_a_text_kept_in_gridfs_and_edited_after_the_run_reads_as_edited_after_the_drop(
    wire_uri: str,
    database: Database[dict[str, Any]],
    kept: Callable[[str], list[dict[str, Any]]],
    edited: int,
) -> None:
    """A rerun rewriting a whole text under the id it had leaves a file GridFS reads, holding
    the new text: its `files` document and its chunks alike, never the old length."""
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-a", "c-a", 0, "A") | {"response_parts": kept("A" * 2_000_000 + "«OLD»")}
    )
    run_accepting(wire_uri, database, "c-a")
    database[LEGACY_TURNS].update_one(
        {"_id": "t-a"}, {"$set": {"response_parts": kept("B" * edited + "«NEW»")}}
    )
    assert cli(wire_uri, database, "finish") == 1

    run_accepting(wire_uri, database, "c-a")
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    [text] = gridfs_texts(database)
    assert "«NEW»" in text
    assert "«OLD»" not in text


@pytest.mark.wire
def test_a_large_problem_taking_the_id_of_another_holds_its_own_content(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """Problem ids count a conversation's problems of a kind: when an edit removes the first,
    the second takes its id, and the file under that id becomes the second's content."""
    first, second = unknown_part("1" * 2_000_000 + "«FIRST»"), unknown_part("«SECOND»" * 200_000)
    answer = {"type": "text", "content": "answer"}
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-a", "c-a", 0, "A") | {"response_parts": [answer, first, second]}
    )
    run_accepting(wire_uri, database, "c-a")
    database[LEGACY_TURNS].update_one(
        {"_id": "t-a"}, {"$set": {"response_parts": [answer, second]}}
    )

    run_accepting(wire_uri, database, "c-a")
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    [problem] = database[PROBLEMS].find()
    bucket = gridfs.GridFSBucket(database, bucket_name=BLOB_BUCKET)
    content = json.loads(bucket.open_download_stream(problem["content_blob_id"]).read())
    assert content == second


def _drop_chunks(db: Database[dict[str, Any]], blob_id: str) -> None:
    db[f"{BLOB_BUCKET}.chunks"].delete_many({"files_id": blob_id})


def _drop_files_document(db: Database[dict[str, Any]], blob_id: str) -> None:
    db[f"{BLOB_BUCKET}.files"].delete_one({"_id": blob_id})


def _other_bytes(db: Database[dict[str, Any]], blob_id: str) -> None:
    db[f"{BLOB_BUCKET}.chunks"].update_one(
        {"files_id": blob_id, "n": 0}, {"$set": {"data": b"Z" * 255 * 1024}}
    )


@pytest.mark.wire
@pytest.mark.parametrize(
    "damage", [_drop_chunks, _drop_files_document, _other_bytes], ids=["chunks", "files", "bytes"]
)
def test_finish_holds_the_drop_back_while_a_problems_content_in_gridfs_is_not_what_it_keeps(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    damage: Callable[[Database[dict[str, Any]], str], None],
) -> None:
    """The gate reads back the content a problem keeps in GridFS: missing, unreadable or
    holding another text, it is work left until a run writes it again."""
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-a", "c-a", 0, "A")
        | {"response_parts": KEPT_WHOLE["problem"]("x" * 2_000_000)}
    )
    run_accepting(wire_uri, database, "c-a")
    [problem] = database[PROBLEMS].find()
    damage(database, problem["content_blob_id"])
    capsys.readouterr()

    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "content a problem keeps in GridFS" in capsys.readouterr().out
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert gridfs_texts(database) == [dumps(KEPT_WHOLE["problem"]("x" * 2_000_000)[1])[0]]


@pytest.mark.wire
def test_finish_without_legacy_data_is_misuse_and_creates_nothing(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 2
    assert cli(wire_uri, database, "finish", "--accept", "anything", "--note", "n") == 2
    assert database.list_collection_names() == []


@pytest.mark.wire
@pytest.mark.parametrize("size", ["0", "-5"])
def test_a_verify_sample_or_batch_of_no_conversations_is_misuse(
    wire_uri: str, database: Database[dict[str, Any]], size: str
) -> None:
    database[CONVERSATIONS].insert_many(corpus(1))
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify", "--sample", size) == 2
    assert cli(wire_uri, database, "verify", "--batch-size", size) == 2


@pytest.mark.wire
def test_a_second_attempt_after_a_rollback_keeps_the_conversation_writable(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The runbook's rollback moves the new conversation documents away and keeps
    `agent_messages`; a later run must not give back `seq` values live turns hold, and a
    live turn retried after it is recognised though its record went with the document."""
    commands = CommandLog()
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-r", 0, "LEGACY"))
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-r", "native-1", "NATIVE")
    database[CONVERSATIONS].delete_one({"_id": "c-r"})  # moved away by the rollback

    assert cli(wire_uri, database, "run") == 0
    retried = log_live(wire_uri, database, "c-r", "native-1", "NATIVE")  # answer lost
    log_live(wire_uri, database, "c-r", "native-2", "AFTER", commands)
    assert commands.names == ["findAndModify", "insert"]  # the records are whole again

    assert retried.replayed
    assert [m.seq for m in retried.messages] == [2, 3]
    seqs = [m["seq"] for m in database[MESSAGES].find({"conversation_id": "c-r"}).sort("seq", 1)]
    assert seqs == [0, 1, 2, 3, 4, 5]
    assert database[CONVERSATIONS].find_one({"_id": "c-r"})["message_count"] == 6
    assert cli(wire_uri, database, "verify") == 0


def _epochs(database: Database[dict[str, Any]], cid: str) -> tuple[Any, list[Any]]:
    """The epoch the conversation document holds (`None`: none, or no document), and the
    epochs its messages carry, in `seq` order."""
    found = database[CONVERSATIONS].find_one({"_id": cid}) or {}
    stored = database[MESSAGES].find({"conversation_id": cid}).sort("seq", 1)
    return found.get("epoch"), [m.get("epoch") for m in stored]


@pytest.mark.wire
def test_a_second_attempt_after_a_rollback_keeps_the_epoch_its_live_messages_carry(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The live turns kept past a rollback carry their conversation's epoch: the document the
    second attempt writes holds it again, so the next turn stores under it and a delete takes
    every message of the conversation, none left behind as a deleted one's."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-r", 0, "LEGACY"))
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-r", "native-1", "NATIVE")
    epoch, _ = _epochs(database, "c-r")
    database[CONVERSATIONS].delete_one({"_id": "c-r"})  # moved away by the rollback

    assert cli(wire_uri, database, "run") == 0
    assert _epochs(database, "c-r") == (epoch, [None, None, epoch, epoch])
    log_live(wire_uri, database, "c-r", "native-2", "AFTER")
    assert _epochs(database, "c-r") == (epoch, [None, None, epoch, epoch, epoch, epoch])
    assert cli(wire_uri, database, "verify") == 0

    _as_a_person(wire_uri, database, lambda s: s.delete("c-r", user_id="u-1"))
    assert list(database[MESSAGES].find({"conversation_id": "c-r"})) == []


@pytest.mark.wire
def test_a_second_attempt_keeps_the_live_turns_epoch_past_a_deleted_conversations_leftover(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A late insert of a conversation deleted earlier under the id lies past the live turns
    kept across the rollback, under its own epoch: the document takes the live turns' epoch
    (the first one past the migrated messages), and a delete takes every live message."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-r", 0, "LEGACY"))
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-r", "native-1", "NATIVE")
    epoch, _ = _epochs(database, "c-r")
    database[CONVERSATIONS].delete_one({"_id": "c-r"})  # moved away by the rollback
    leftover = {"conversation_id": "c-r", "seq": 10, "turn_id": "t-old", "epoch": "0" * 16}
    leftover |= {"_id": "msg-leftover", "role": "user", "content": "a deleted one's"}
    database[MESSAGES].insert_one({**leftover, "created_at": datetime(2026, 1, 1, tzinfo=UTC)})

    assert cli(wire_uri, database, "run") == 0

    assert _epochs(database, "c-r")[0] == epoch
    _as_a_person(wire_uri, database, lambda s: s.delete("c-r", user_id="u-1"))
    assert [d["_id"] for d in database[MESSAGES].find({"conversation_id": "c-r"})] == [
        "msg-leftover"
    ]


@pytest.mark.wire
def test_a_rerun_keeps_the_epoch_of_the_document_it_replaces(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A document created before the run (a person naming the conversation) drew an epoch:
    the run replacing it keeps it, and a rerun after a legacy turn was edited too."""

    async def name() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            logger = AgentMessageLogger(client[database.name])
            await logger.upsert_conversation("c-n", user_id="u-1", name="Trip")
        finally:
            await client.close()

    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-n", 0, "LEGACY"))
    asyncio.run(name())
    epoch, _ = _epochs(database, "c-n")
    assert epoch is not None

    assert cli(wire_uri, database, "run") == 0
    assert _epochs(database, "c-n") == (epoch, [None, None])
    database[LEGACY_TURNS].update_one(
        {"_id": "t-1"}, {"$set": {"created_at": datetime(2024, 1, 2, tzinfo=UTC)}}
    )
    assert cli(wire_uri, database, "run") == 0
    found = database[CONVERSATIONS].find_one({"_id": "c-n"})
    assert found is not None
    kept = (found["epoch"], found["name"], found["created_at"])
    assert kept == (epoch, "Trip", datetime(2024, 1, 2, tzinfo=UTC))
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_conversation_the_migration_creates_draws_an_epoch_its_live_turns_keep(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A conversation the migration alone made draws its epoch as a live turn or a person
    creating one does (`epoch_marks`: documents beside it name that epoch); its own messages
    carry none, and its first live turn stores under that epoch, never another."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-m", 0, "LEGACY"))
    assert cli(wire_uri, database, "run") == 0
    found = database[CONVERSATIONS].find_one({"_id": "c-m"})
    assert found is not None
    assert isinstance(found["epoch"], str)
    assert (found["epoch_marks"], found["migrated"]) == (True, True)
    log_live(wire_uri, database, "c-m", "native-1", "NATIVE")
    epoch = found["epoch"]
    assert _epochs(database, "c-m") == (epoch, [None, None, epoch, epoch])
    assert cli(wire_uri, database, "verify") == 0


def _run_again_once_the_old_service_renamed(
    wire_uri: str, database: Database[dict[str, Any]], conversation_id: str, name: str
) -> dict[str, Any]:
    """The conversation's document after the old service renamed its turn `t-1` (where the
    move put it) and `run` ran again (exit 0)."""
    moved = relocate.turns_at(database)
    database[moved].update_one({"_id": "t-1"}, {"$set": {"name": name}})
    assert cli(wire_uri, database, "run") == 0
    again = database[CONVERSATIONS].find_one({"_id": conversation_id})
    assert again is not None
    return dict(again)


@pytest.mark.wire
def test_a_run_indexes_its_state_by_kind_beside_a_life_record_per_conversation(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The migration's state holds a life record per conversation a run wrote; its reads of
    its run and acceptance records select by `kind` (the latest run by `started_at`), which
    an index the run creates serves, so they never scan the life records."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0

    keys = [info["key"] for info in database[lease.STATE].index_information().values()]
    assert [("kind", 1), ("started_at", 1)] in keys


@pytest.mark.wire
def test_a_rerun_leaves_a_conversation_an_earlier_release_migrated_without_an_epoch(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A document an earlier release migrated holds no epoch: a rerun rewriting it (a legacy
    turn edited since) draws none, so its version (a read's `ETag`) stays as served, and it
    is still the migration's (`written_by_migration`)."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-o", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    earlier = dict.fromkeys(("epoch", "epoch_marks", "migrated"), "")
    database[CONVERSATIONS].update_one({"_id": "c-o"}, {"$unset": earlier})
    found = database[CONVERSATIONS].find_one({"_id": "c-o"})
    assert found is not None
    before = Conversation.model_validate(found).version
    again = _run_again_once_the_old_service_renamed(wire_uri, database, "c-o", "Renamed")

    assert again["name"] == "Renamed"
    assert not {"epoch", "epoch_marks", "migrated"} & set(again)
    assert Conversation.model_validate(again).version == before
    assert writes.written_by_migration(again)
    assert cli(wire_uri, database, "verify") == 0


PROMPT_FIELDS_ONLY_SESSION_HITL_HOLDS = {
    "params as JSON text": ({"params": json.dumps({"amount": "«9000 EUR»"})}, "«9000 EUR»"),
    "a field no reader takes": ({"context": "«asked to pay the landlord»"}, "«asked to pay"),
}


@pytest.mark.wire
@pytest.mark.parametrize(("fields", "marker"), PROMPT_FIELDS_ONLY_SESSION_HITL_HOLDS.values(),
                         ids=list(PROMPT_FIELDS_ONLY_SESSION_HITL_HOLDS))  # fmt: skip
def test_what_only_the_pending_prompt_holds_is_kept_before_the_drop(
    fields: dict[str, Any], marker: str, wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    part = {"type": "hitl", "action": "pay", "params": {}, "request_id": "r-1", "prompt": "Pay?"}
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-a", "c-a", 0, "A") | {"response_parts": [part]}
    )
    database[SESSION_HITL].insert_one(
        {"conversation_id": "c-a", "request_id": "r-1", "action": "pay", "status": "pending",
         **fields}
    )  # fmt: skip

    assert cli(wire_uri, database, "run") == 0
    if cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0:
        conversations = [json.dumps(d, default=str, ensure_ascii=False)
                         for d in database[CONVERSATIONS].find()]  # fmt: skip
        assert marker in kept_text(database) + "".join(conversations)


@pytest.mark.wire
def test_a_prompt_naming_its_conversation_by_an_objectid_is_migrated_with_it(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The read fallback and the migration read the same prompts."""
    from agent_store.legacy import SESSION_HITL

    oid = bson.ObjectId()
    database[CONVERSATIONS].insert_one(legacy_turn("t-o", oid, 0, "PAY"))  # type: ignore[arg-type]
    database[SESSION_HITL].insert_one(
        {"conversation_id": oid, "request_id": "r-1", "action": "pay", "status": "pending"}
    )

    assert cli(wire_uri, database, "run") == 0

    migrated = database["agent_conversations"].find_one({"_id": str(oid)})
    assert migrated is not None
    assert (migrated["pending_hitl"] or {}).get("request_id") == "r-1"


@pytest.mark.wire
def test_a_conversation_id_python_cannot_hash_is_migrated_like_any_other(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-d", bson.Decimal128("5"), 0, "DECIMAL")  # type: ignore[arg-type]
    )

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert database[MESSAGES].count_documents({}) == 2


@pytest.mark.wire
def test_a_prompt_of_a_conversation_stored_under_a_derived_id_is_migrated_with_it(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The prompt names the legacy id, as the turns do; the conversation is stored under the
    id derived from it."""
    from agent_store.legacy import SESSION_HITL

    database[CONVERSATIONS].insert_one(legacy_turn("t-d", NOT_AN_IDENTIFIER, 0, "PAY"))
    database[SESSION_HITL].insert_one(
        {"conversation_id": NOT_AN_IDENTIFIER, "request_id": "r-1", "action": "pay",
         "status": "pending"}
    )  # fmt: skip

    assert cli(wire_uri, database, "run") == 0

    migrated = database[CONVERSATIONS].find_one({"_id": derived_conversation_id(NOT_AN_IDENTIFIER)})
    assert migrated is not None
    assert (migrated["pending_hitl"] or {}).get("request_id") == "r-1"


@pytest.mark.wire
def test_a_migrated_turn_of_no_conversation_whose_id_is_hashed_deleted_does_not_come_back(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """Its conversation is `legacy-turn-h…`: deleting it takes the legacy turn, so a rerun
    (which the gate asks for) does not bring it back."""
    turn = legacy_turn("turn 1", " ", 0, "SECRET") | {"user_id": "alice"}
    database[CONVERSATIONS].insert_many([turn, legacy_turn("t-b", "c-b", 1, "B")])
    assert cli(wire_uri, database, "run") == 0
    own_id = derived_conversation_id(None, turn_key=parse_turns([turn])[0].key)
    assert own_id.startswith("legacy-turn-h")

    async def delete() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            db = client[database.name]
            await ConversationStore(db, legacy=LegacyTurns(db)).delete(own_id, user_id="alice")
        finally:
            await client.close()

    asyncio.run(delete())
    assert cli(wire_uri, database, "run", "--restart") == 0

    assert database[MESSAGES].count_documents({"conversation_id": own_id}) == 0
    assert database[LEGACY_TURNS].count_documents({"_id": "turn 1"}) == 0


@pytest.mark.wire
@pytest.mark.parametrize("blank", ["", "   "], ids=["empty", "spaces"])
def test_turns_naming_a_blank_conversation_are_migrated_each_as_its_own_and_verify(
    blank: str, wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    alice, bob = (
        legacy_turn(f"t-{u}", blank, n, u.upper()) for n, u in enumerate(["alice", "bob"])
    )
    database[CONVERSATIONS].insert_many([{**alice, "user_id": "alice"}, {**bob, "user_id": "bob"}])

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0

    owners = {d["_id"]: d["user_id"] for d in database[CONVERSATIONS].find()}
    own_id = derived_conversation_id(None, turn_key="t-alice")
    assert (owners[own_id], len(owners)) == ("alice", 2)


# -- every legacy turn is migrated, whatever fields it holds or lacks --------------------

BOOKED_AT = datetime(2021, 3, 1, 12, 1, tzinfo=UTC)
CALLS_ONLY = {
    "_id": "t-calls", "conversation_id": "c-a", "user_id": "u-1", "created_at": BOOKED_AT,
    "tool_calls": [{"tool_name": "book_flight", "args": {"flight": "LH400"}}],
}  # fmt: skip
HISTORY_ONLY = {
    "_id": "t-history", "conversation_id": "c-h", "user_id": "u-1", "created_at": BOOKED_AT,
    "message_history_json": json.dumps([
        {"kind": "request", "parts": [{"part_kind": "user-prompt", "content": "book LH401"}]},
        {"kind": "response", "parts": [{"part_kind": "text", "content": "booked LH401"}]},
    ]),
}  # fmt: skip


@pytest.mark.wire
def test_a_turn_holding_only_its_calls_is_migrated_before_the_legacy_data_is_dropped(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md, "What finish guarantees": once `finish --drop-legacy --yes` drops the
    legacy collection, every piece of legacy content is in a message, a GridFS file or an
    accepted problem. A turn is a legacy turn by not being a conversation document, not by
    holding a user message, parts, a response text or an upload: the run, its resume and
    the gate all read it."""
    alone = CALLS_ONLY | {"_id": "t-alone", "conversation_id": "c-alone"}
    database[LEGACY_TURNS].insert_many([legacy_turn("t-a", "c-a", 0, "A"), CALLS_ONLY, alone])

    # A run stopped after one conversation, then resumed from its checkpoint.
    assert cli(wire_uri, database, "run", "--limit", "1", "--batch-size", "1") == 0
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0

    calls = [m for m in database[MESSAGES].find() if "LH400" in json.dumps(m, default=str)]
    assert sorted(m["conversation_id"] for m in calls) == ["c-a", "c-alone"]


@pytest.mark.wire
def test_a_turn_holding_only_its_history_is_work_left_until_an_operator_accepts_it(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """DESIGN §4: the converter never drops content silently. A turn that converts to no
    message keeps its `message_history_json` in an unplaced problem, which `finish` asks an
    operator to accept before the drop."""
    database[LEGACY_TURNS].insert_many([legacy_turn("t-h", "c-h", 0, "H"), HISTORY_ONLY])

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "c-h" in capsys.readouterr().out
    assert cli(wire_uri, database, "finish", "--accept", "c-h", "--note", "archived") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0

    assert "LH401" in kept_text(database)


@pytest.mark.wire
@pytest.mark.parametrize(
    ("where", "document"),
    [
        (LEGACY_TURNS, {"_id": "c-x", "conversation_id": "c-x", "turn_count": 1,
                        "message_count": 2}),
        (CONVERSATIONS, {"_id": "c-y", "conversation_id": "c-y", "turn_count": 1,
                         "message_count": 2, "user_message": "LH402"}),
    ],
    ids=["conversation-among-the-turns", "turn-and-conversation-at-once"],
)  # fmt: skip
def test_finish_refuses_the_drop_while_a_document_is_neither_a_turn_nor_a_conversation(
    where: str,
    document: dict[str, Any],
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A document the migration does not read as a legacy turn, in the legacy collection, or
    one holding a conversation document's counters and a legacy turn's fields: no run
    converts it, so `finish` names it and refuses the drop rather than pass."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-a", "c-a", 0, "A"))
    assert cli(wire_uri, database, "run") == 0
    database[where].insert_one(document)
    capsys.readouterr()

    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1

    assert repr(document["_id"]) in capsys.readouterr().out
    assert database[LEGACY_TURNS].count_documents({}) >= 1


TURNS_HOLDING_A_COUNTER = {
    "message_count": {"message_count": 2},
    "both counters": {"message_count": 3, "turn_count": 1},
}


@pytest.mark.wire
@pytest.mark.parametrize("counters", TURNS_HOLDING_A_COUNTER.values(),
                         ids=list(TURNS_HOLDING_A_COUNTER))  # fmt: skip
@pytest.mark.parametrize("options", [(), ("--limit", "1")], ids=["whole", "limit-1"])
def test_a_legacy_turn_holding_a_counter_is_never_removed_and_is_work_left(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    counters: dict[str, Any],
    options: tuple[str, ...],
) -> None:
    """A legacy turn holding a conversation document's counter is neither a turn nor a
    conversation document: it is not moved, and it is not a document the migration wrote
    (`writes.written_by_migration`), so no run, dry or not, removes it as abandoned; the
    gate names it, and the drop waits."""
    turn = legacy_turn(bson.ObjectId(), "c-mc", 0, "«m5»") | counters
    database[CONVERSATIONS].insert_many([turn, legacy_turn(bson.ObjectId(), "c-ok", 1, "OK")])

    assert cli(wire_uri, database, "run", "--dry-run", *options) == 1
    said = summary(capsys.readouterr().out)
    assert said.get("conversations no legacy turn makes now removed", 0) == 0
    assert cli(wire_uri, database, "run", *options) == 1
    assert database[CONVERSATIONS].find_one({"_id": turn["_id"]}) == turn
    capsys.readouterr()
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert repr(turn["_id"]) in capsys.readouterr().out
    assert database[CONVERSATIONS].find_one({"_id": turn["_id"]}) == turn


COUNTER_CLASHES = {
    "turn_count": {"turn_count": 2},
    "message_count": {"message_count": 4},
    "null turn_count": {"turn_count": None},
}


@pytest.mark.wire
@pytest.mark.parametrize("counters", COUNTER_CLASHES.values(), ids=list(COUNTER_CLASHES))
@pytest.mark.parametrize("of", ["c-1", "c-2"], ids=["its-own", "another-conversations"])
def test_a_legacy_turn_holding_a_counter_under_a_conversations_id_is_never_written_over(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    counters: dict[str, Any],
    of: str,
) -> None:
    """A document holding a legacy turn's fields is never replaced by a conversation document,
    whatever counter it holds too: a legacy turn of `of` stored under the `_id` of conversation
    c-1 and holding a counter is neither a turn nor a conversation document, so the run writes
    nothing of c-1 over it (its messages neither), names it and exits 1, the dry run alike, and
    `verify` and `finish` exit 1 until an operator moves it; then a run migrates every word."""
    clash = legacy_turn("c-1", of, 1, "«m7»") | counters
    database[CONVERSATIONS].insert_many([legacy_turn("t-1", "c-1", 0, "«m6»"), clash])

    assert cli(wire_uri, database, "run", "--dry-run") == 1
    assert cli(wire_uri, database, "run") == 1
    assert "'c-1'" in capsys.readouterr().out
    assert database[CONVERSATIONS].find_one({"_id": "c-1"}) == clash
    assert database[MESSAGES].count_documents({"conversation_id": "c-1"}) == 0
    assert cli(wire_uri, database, "verify") == 1
    assert "'c-1'" in capsys.readouterr().out
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert database[CONVERSATIONS].find_one({"_id": "c-1"}) == clash
    assert database[LEGACY_TURNS].count_documents({}) == 1

    # The operator files the turn under an `_id` of its own, without the counter.
    database[CONVERSATIONS].delete_one({"_id": "c-1"})
    moved = {k: v for k, v in clash.items() if k not in counters} | {"_id": "t-2"}
    database[CONVERSATIONS].insert_one(moved)
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert {"«m6»", "«m7»"} <= set(MARK.findall(kept_text(database)))


@pytest.mark.wire
@pytest.mark.parametrize("counters", COUNTER_CLASHES.values(), ids=list(COUNTER_CLASHES))
def test_a_legacy_turn_holding_a_counter_holds_back_the_conversation_it_names(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    counters: dict[str, Any],
) -> None:
    """A legacy turn holding a counter holds back the conversation it would belong to, as one
    under a conversation's `_id` does: no run migrates c-1 from its other turns alone (no
    document, no message: the service reads it from its legacy turns and refuses its writes),
    `run`, `verify` and `finish` name it and exit 1; once an operator takes the counter off, a run
    migrates c-1 whole, the turn in its place."""
    held = legacy_turn("t-2", "c-1", 1, "«m7»") | counters
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "«m6»"), held, legacy_turn("t-3", "c-1", 2, "«m8»")]
    )

    for command in ("run", "verify", "finish"):
        assert cli(wire_uri, database, command) == 1, command
        said = capsys.readouterr().out
        assert "'t-2'" in said, (command, said)
        assert "hold back conversations 'c-1'" in said, (command, said)
        assert database[CONVERSATIONS].find_one({"_id": "c-1"}) is None
        assert database[MESSAGES].count_documents({"conversation_id": "c-1"}) == 0

    database[CONVERSATIONS].update_one({"_id": "t-2"}, {"$unset": dict.fromkeys(counters, "")})
    assert cli(wire_uri, database, "run") == 0
    stored = database[MESSAGES].find({"conversation_id": "c-1"}, sort=[("seq", 1)])
    assert (
        MARK.findall(" ".join(m["content"] for m in stored))
        == ["«m6»"] * 2 + ["«m7»"] * 2 + ["«m8»"] * 2
    )
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
@pytest.mark.parametrize("counters", COUNTER_CLASHES.values(), ids=list(COUNTER_CLASHES))
def test_a_moved_turn_gaining_a_counter_leaves_its_migrated_conversation_as_it_is(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    counters: dict[str, Any],
) -> None:
    """A legacy turn moved aside that gains a counter since is no turn of its conversation any
    more, yet holds it back: the next run neither removes the conversation it alone made (its
    document and messages) nor moves its messages out of the one it shares; `verify` and
    `finish` exit 1 until an operator takes the counter off, and a run changes nothing then."""
    database[CONVERSATIONS].insert_many(
        [
            legacy_turn("t-1", "c-1", 0, "«m1»"),
            legacy_turn("t-2", "c-1", 1, "«m2»"),
            legacy_turn("t-3", "c-2", 2, "«m3»"),
        ]
    )
    assert cli(wire_uri, database, "run") == 0
    before = stored_messages(database), list(database[CONVERSATIONS].find({}, sort=[("_id", 1)]))
    for turn in ("t-2", "t-3"):
        database[LEGACY_TURNS].update_one({"_id": turn}, {"$set": counters})
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 1
    said = capsys.readouterr().out
    assert "'t-2'" in said
    assert summary(said).get("conversations no legacy turn makes now removed", 0) == 0
    after = stored_messages(database), list(database[CONVERSATIONS].find({}, sort=[("_id", 1)]))
    assert after == before
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1

    for turn in ("t-2", "t-3"):
        database[LEGACY_TURNS].update_one({"_id": turn}, {"$unset": dict.fromkeys(counters, "")})
    assert cli(wire_uri, database, "run") == 0
    assert stored_messages(database) == before[0]
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_conversation_document_given_a_legacy_turns_field_after_the_plan_is_not_written_over(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every replace of a conversation document by a run holds `writes.NO_TURN_FIELD`: one
    edited to hold a legacy turn's field between the plan and the writes stays as it is
    (neither a turn nor a conversation document now, which the run names)."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "A"))
    assert cli(wire_uri, database, "run") == 0
    database[LEGACY_TURNS].update_one({"_id": "t-1"}, {"$set": {"user_message": "edited"}})
    edit = {"$set": {"user_message": "«m9»"}}
    _between_plan_and_writes(
        monkeypatch, lambda: database[CONVERSATIONS].update_one({"_id": "c-1"}, edit)
    )

    assert cli(wire_uri, database, "run") == 1

    stored = database[CONVERSATIONS].find_one({"_id": "c-1"})
    assert stored is not None
    assert stored["user_message"] == "«m9»"
    assert MIGRATING not in stored


@pytest.mark.wire
@pytest.mark.parametrize(
    "counters",
    [{"turn_count": 3}, {"message_count": 2}, {"turn_count": None}, {"message_count": "2"}],
    ids=["turn_count", "message_count", "null-turn_count", "text-message_count"],
)
def test_verify_and_status_name_a_document_neither_a_turn_nor_a_conversation(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    counters: dict[str, Any],
) -> None:
    """A legacy turn holding a counter under an `_id` of its own is never moved nor migrated:
    `run` names it and exits 1, `status` names it (its progress is not the migration's), and
    `verify` names it and exits 1, as `finish` does, so no runbook step passes over it; once
    an operator takes the counter off, a run migrates it and `verify` matches it."""
    turn = legacy_turn("x1", "counted", 0, "«m8»") | counters
    database[CONVERSATIONS].insert_many([legacy_turn("n1", "normal", 0, "OK"), turn])

    assert cli(wire_uri, database, "run") == 1
    assert "'x1'" in capsys.readouterr().out
    for command in ("status", "verify", "finish"):
        code = cli(wire_uri, database, command)
        out = capsys.readouterr().out
        assert "'x1'" in out, (command, out)
        assert code == (0 if command == "status" else 1), (command, out)

    database[CONVERSATIONS].update_one({"_id": "x1"}, {"$unset": dict.fromkeys(counters, "")})
    assert cli(wire_uri, database, "run") == 0
    assert database[MESSAGES].count_documents({"conversation_id": "counted"}) == 2
    assert cli(wire_uri, database, "verify") == 0
    assert "verified 2 conversations" in capsys.readouterr().out
    assert cli(wire_uri, database, "finish") == 0
    assert "«m8»" in kept_text(database)


@pytest.mark.wire
def test_no_document_holding_a_turn_only_field_is_one_the_migration_wrote(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """One definition of a document the migration wrote: a conversation document as a run
    writes it (its messages gone since) is one; the same holding any field only a legacy turn
    holds, or lacking what a run writes (a text `_id` that is its `conversation_id`, a count
    of messages stored as a number, the mark of an epoch the migration drew), is not."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "A"))
    assert cli(wire_uri, database, "run") == 0
    written = database[CONVERSATIONS].find_one({"_id": "c-1"})
    assert written is not None
    assert writes.written_by_migration(written)
    for name in TURN_ONLY_FIELDS:
        assert not writes.written_by_migration(written | {name: "x"}), name
    for lacking in (
        {"_id": bson.ObjectId()},
        {"conversation_id": "c-2"},
        {"message_count": "2"},
        {"message_count": 2.0},
        {"message_count": True},
        {"migrated": False},  # an epoch a person or a live turn drew
    ):
        assert not writes.written_by_migration(written | lacking), lacking


NO_COUNTS = ["n/a", [1], "1.5", "", True, -1]


@pytest.mark.wire
@pytest.mark.parametrize("count", NO_COUNTS, ids=repr)
def test_a_conversation_documents_count_that_is_no_count_stops_no_command(
    wire_uri: str, database: Database[dict[str, Any]], count: Any
) -> None:
    """A conversation document no legacy turn makes whose `message_count` is no count (edited
    by hand): no document the migration wrote (it writes a number), so no run removes it, and
    `run`, `verify` and `finish` agree, without a traceback."""
    at = datetime(2025, 3, 1, 9, tzinfo=UTC)
    edited = {
        "_id": "c-edited", "conversation_id": "c-edited", "user_id": "u-1", "created_at": at,
        "updated_at": at, "message_count": count, "turn_count": 1, "name": "x",
    }  # fmt: skip
    database[CONVERSATIONS].insert_many([legacy_turn("t-1", "c-1", 0, "A"), edited])

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert database[CONVERSATIONS].find_one({"_id": "c-edited"}) == edited


@pytest.mark.wire
@pytest.mark.parametrize("count", ["n/a", "2.0", "two", [2], "1.5", -1], ids=repr)
@pytest.mark.parametrize("live", [False, True], ids=["migrated", "live-since"])
def test_the_migrations_document_whose_count_was_edited_is_named_by_finish(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    count: Any,
    live: bool,
) -> None:
    """MIGRATION.md: the migration's own conversation document edited so (a count written as
    text) is named by `finish` (work left) and written again by the next `run`; every command
    reads the count by one rule (`writes.stored_count`), never with a traceback. One a live
    turn wrote to since is the person's: a run leaves it, and `finish` goes on naming it."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "A"))
    assert cli(wire_uri, database, "run") == 0
    if live:
        log_live(wire_uri, database, "c-1", "live-1", "B")
    was = database[CONVERSATIONS].find_one({"_id": "c-1"})
    assert was is not None
    database[CONVERSATIONS].update_one({"_id": "c-1"}, {"$set": {"message_count": count}})
    capsys.readouterr()

    assert cli(wire_uri, database, "finish") == 1
    assert "c-1" in capsys.readouterr().out
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    if live:
        assert cli(wire_uri, database, "finish") == 1
        assert database[CONVERSATIONS].find_one({"_id": "c-1"})["message_count"] == count
    else:
        assert cli(wire_uri, database, "finish") == 0
        assert database[CONVERSATIONS].find_one({"_id": "c-1"}) == was


# -- hidden runtime context a legacy user message holds ----------------------------------

HIDDEN = "[RUNTIME CONTEXT] «ctx-marker» account tier: gold [/RUNTIME CONTEXT]"


@pytest.mark.wire
@pytest.mark.parametrize(
    "said", [f"{HIDDEN} hello", HIDDEN], ids=["before-the-text", "the-whole-message"]
)
def test_a_drop_never_deletes_the_runtime_context_a_legacy_user_message_holds(
    said: str,
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """DESIGN §3: only what the user saw is stored, so the message holds no runtime context;
    DESIGN §4: the converter never drops content silently. The context is kept in an unplaced
    `hidden_runtime_context` problem, `verify` sees it left out there, and `finish` refuses
    the drop until an operator accepts it."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-ctx", 0, "") | {"user_message": said})

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert "«ctx-marker»" not in json.dumps(list(database[MESSAGES].find()), default=str)
    capsys.readouterr()
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    out = capsys.readouterr().out
    assert "c-ctx" in out
    assert "hidden_runtime_context" in out
    assert database[LEGACY_TURNS].count_documents({}) == 1
    assert cli(wire_uri, database, "finish", "--accept", "c-ctx", "--note", "kept") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0

    assert "«ctx-marker»" in kept_text(database)


@pytest.mark.wire
def test_a_drop_never_deletes_the_runtime_context_a_legacy_uploads_file_name_holds(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An upload's file name is text of the user's message: the message holds what the user
    saw (`report.pdf`), the context is kept in an unplaced `hidden_runtime_context` problem,
    `verify` sees it left out there (0 on a faithful run), and the drop waits for an
    operator, then keeps it."""
    upload = {"filename": f"report{HIDDEN}.pdf", "file_type": "application/pdf", "size": 3}
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-1", "c-ctx", 0, "") | {"upload_result": upload}
    )

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    stored = json.dumps(list(database[MESSAGES].find()), default=str, ensure_ascii=False)
    assert "«ctx-marker»" not in stored
    assert "report.pdf" in stored
    capsys.readouterr()
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "hidden_runtime_context" in capsys.readouterr().out
    assert cli(wire_uri, database, "finish", "--accept", "c-ctx", "--note", "kept") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0

    assert "«ctx-marker»" in kept_text(database)


# -- the order of turns: by time at full precision ----------------------------------------


@pytest.mark.wire
@pytest.mark.parametrize(
    ("later", "earlier"),
    [
        ("2024-01-01T00:00:00.000900+00:00", "2024-01-01T00:00:00.000100+00:00"),
        ("2024-01-01T01:00:00.000900+01:00", "2024-01-01T00:00:00.000100Z"),
    ],
    ids=["iso-text", "iso-text-in-two-zones"],
)
def test_turns_timed_in_iso_text_with_microseconds_migrate_in_time_order(
    later: str,
    earlier: str,
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """MIGRATION.md step 2: turns by time (ties in stored order). Python writers stored
    `created_at` as `isoformat()` text with microseconds: two turns 0.8 ms apart are not a
    tie, whatever millisecond the stored messages are given (BSON dates hold milliseconds),
    and `verify` orders them so too."""
    database[CONVERSATIONS].insert_many(
        [
            legacy_turn("t-b", "c-us", 0, "SECOND") | {"created_at": later},
            legacy_turn("t-a", "c-us", 0, "FIRST") | {"created_at": earlier},
        ]
    )
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0

    stored = database[MESSAGES].find({"conversation_id": "c-us"}).sort("seq", 1)
    assert [(m["content"], m["created_at"]) for m in stored] == [
        ("FIRST question", datetime(2024, 1, 1, tzinfo=UTC)),
        ("FIRST answer", datetime(2024, 1, 1, tzinfo=UTC)),
        ("SECOND question", datetime(2024, 1, 1, tzinfo=UTC)),
        ("SECOND answer", datetime(2024, 1, 1, tzinfo=UTC)),
    ]


# -- a rerun repairs every state an edit of the legacy data leads to, and the gate agrees ----


@pytest.mark.wire
def test_an_owner_corrected_in_the_legacy_turns_moves_the_messages_with_the_document(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The migration's messages carry their conversation document's owner (DESIGN §3): an
    owner corrected in the legacy turns after the run reaches both on the next run."""
    unowned = legacy_turn("t-1", "c-owner", 0, "OWNED") | {"user_id": "alice smith"}
    database[CONVERSATIONS].insert_one(unowned)
    assert cli(wire_uri, database, "run") == 0
    database[LEGACY_TURNS].update_one({"_id": "t-1"}, {"$set": {"user_id": "alice"}})
    assert cli(wire_uri, database, "finish") == 1

    assert cli(wire_uri, database, "run") == 0

    owners = {m["user_id"] for m in database[MESSAGES].find({"conversation_id": "c-owner"})}
    assert owners == {"alice"}
    assert database[CONVERSATIONS].find_one({"_id": "c-owner"})["user_id"] == "alice"
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_finish_passes_no_message_whose_owner_is_not_its_conversation_documents(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A document rewritten to its owner but not its messages (a run killed between the
    two) is work left until a rerun moves the messages too."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-owner", 0, "OWNED"))
    assert cli(wire_uri, database, "run") == 0
    database[MESSAGES].update_many({"conversation_id": "c-owner"}, {"$set": {"user_id": None}})

    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "run") == 0

    owners = {m["user_id"] for m in database[MESSAGES].find({"conversation_id": "c-owner"})}
    assert owners == {"u-1"}
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_rerun_keeps_the_owner_a_claim_gave_a_migrated_conversation(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    async def claim() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            db = client[database.name]
            store = ConversationStore(
                db, legacy=LegacyTurns(db), rules=TurnRules(claim_grace=timedelta(0))
            )
            await store.claim("u-1", "u-2")
        finally:
            await client.close()

    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-a", 0, "A"))
    assert cli(wire_uri, database, "run") == 0
    asyncio.run(claim())

    assert cli(wire_uri, database, "run") == 0

    owners = {m["user_id"] for m in database[MESSAGES].find({"conversation_id": "c-a"})}
    assert owners == {"u-2"}
    assert database[CONVERSATIONS].find_one({"_id": "c-a"})["user_id"] == "u-2"
    assert cli(wire_uri, database, "finish") == 0


def _claimed(wire_uri: str, database: Database[dict[str, Any]], *claims: tuple[str, str]) -> None:
    """Claim each `(from, to)` in turn, the old service's turns moved too (dual write on)."""

    async def claim() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            db = client[database.name]
            store = ConversationStore(
                db,
                legacy=LegacyTurns(db, dual_write=True),
                rules=TurnRules(claim_grace=timedelta(0)),
            )
            for from_user_id, to_user_id in claims:
                await store.claim(from_user_id, to_user_id)
        finally:
            await client.close()

    asyncio.run(claim())


def _served_to(database: Database[dict[str, Any]], conversation_id: str) -> dict[str, list[str]]:
    """The user messages of a conversation by the users they are stored under."""
    found: dict[str, list[str]] = {}
    for m in database[MESSAGES].find({"conversation_id": conversation_id, "role": "user"}):
        found.setdefault(m["user_id"], []).append(m["content"])
    return found


@pytest.mark.wire
@pytest.mark.parametrize(
    ("legacy_user", "pairs"),
    [("u-1", [("u-1", "u-2")]), ("u-1", [("u-1", "u-3"), ("u-3", "u-2")]), ("alice smith", [])],
    ids=["claim", "claim-chain", "derived-user-claim"],
)
def test_a_late_old_service_turn_naming_a_claimed_user_is_the_claimers(
    wire_uri: str, database: Database[dict[str, Any]], legacy_user: str, pairs: list[Any]
) -> None:
    """The old service, which knows of no claim, logs a turn naming the user a claim moved
    the conversation away from (by that user's legacy id: the documented `invalid_user_id`
    claim of a derived user too): `run`, `verify` and `finish` take it as the claimer's
    (the last claim of a chain), and no owner changes."""
    claims = pairs or [(derived_user_id(legacy_user), "u-2")]
    turns = [legacy_turn("t-1", "c-a", 0, "A"), legacy_turn("t-2", "c-b", 0, "B")]
    turns[0]["user_id"] = legacy_user
    database[CONVERSATIONS].insert_many(turns)
    assert cli(wire_uri, database, "run") == 0
    _claimed(wire_uri, database, *claims)
    late = legacy_turn("t-late", "c-a", 5, "LATE") | {"user_id": legacy_user}
    database[CONVERSATIONS].insert_one(late)

    assert cli(wire_uri, database, "run") == 0

    assert _served_to(database, "c-a") == {"u-2": ["A question", "LATE question"]}
    assert database[CONVERSATIONS].find_one({"_id": "c-a"})["user_id"] == "u-2"
    assert database[PROBLEMS].count_documents({"kind": "mixed_user_ids"}) == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
@pytest.mark.parametrize(
    ("claims", "resaved", "ann", "dan"),
    [([("a", "b"), ("d", "a")], "t-ann", "b", "a"), ([("d", "b"), ("a", "d")], "t-dan", "d", "b")],
    ids=["swapped", "dtob"],
)
def test_a_moved_turn_the_old_service_saves_again_in_place_stays_its_claimers_to_the_run(
    wire_uri: str,
    database: Database[dict[str, Any]],
    claims: list[tuple[str, str]],
    resaved: str,
    ann: str,
    dan: str,
) -> None:
    """A mixed conversation no run moved aside yet (Ann's turn `a`, Dan's `d`), claims moving
    one user id both away and to, then the old service saving one moved turn again in place
    from its cache (the user id it knew, no `claimed_from`): its claim record keeps it the
    claimer's, so `run` holds the conversation as `mixed_user_ids`, each turn named as its
    person's, and `finish` exits 1 (was: read as the other person's, the conversation was
    stored as one person's alone, Ann's words served to Dan or Dan's to Ann, exit 0)."""
    turns = [legacy_turn("t-ann", "c-x", 0, "ANN") | {"user_id": "a"}]
    turns.append(legacy_turn("t-dan", "c-x", 1, "DAN") | {"user_id": "d"})
    database[CONVERSATIONS].insert_many([dict(t) for t in turns])
    _claimed(wire_uri, database, *claims)
    cached = next(t for t in turns if t["_id"] == resaved)
    database[CONVERSATIONS].replace_one({"_id": resaved}, cached, upsert=True)

    assert cli(wire_uri, database, "run") == 0

    assert database[CONVERSATIONS].find_one({"_id": "c-x"})["user_id"] == dan
    [mixed] = database[PROBLEMS].find({"kind": "mixed_user_ids"})
    assert mixed["content"] == {ann: ["t-ann"], dan: ["t-dan"]}
    assert cli(wire_uri, database, "finish") == 1


@pytest.mark.wire
def test_a_late_prompt_naming_a_claimed_user_is_the_claimers_pending_prompt(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The old service, which knows of no claim, raises a `session_hitl` prompt naming the user
    a claim moved the conversation away from, with the late turn asking it: `run`, `verify`
    and `finish` take it as the claimer's pending prompt (`owners_prompt` through the turns'
    claims), never a prompt of another user kept in a problem."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-a", 0, "A"))
    assert cli(wire_uri, database, "run") == 0
    _claimed(wire_uri, database, ("u-1", "u-2"))
    asks = {"type": "hitl", "action": "pay", "params": {}, "request_id": "r-late", "prompt": "Pay?"}
    late = legacy_turn("t-late", "c-a", 5, "LATE") | {"response_parts": [asks]}
    database[CONVERSATIONS].insert_one(late)
    database[SESSION_HITL].insert_one(
        {"conversation_id": "c-a", "user_id": "u-1", "request_id": "r-late", "action": "pay",
         "status": "pending", "prompt": "Pay?"}
    )  # fmt: skip

    assert cli(wire_uri, database, "run") == 0

    migrated = database[CONVERSATIONS].find_one({"_id": "c-a"})
    assert (migrated["user_id"], migrated["pending_hitl"]["request_id"]) == ("u-2", "r-late")
    assert database[PROBLEMS].count_documents({}) == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
@pytest.mark.parametrize("by", ["delete", "erasure"])
def test_a_late_turn_naming_a_claimed_user_goes_with_the_claimers_delete(
    wire_uri: str, database: Database[dict[str, Any]], by: str
) -> None:
    """A late turn the old service logs naming the user a claim moved its conversation away
    from, still standing in `agent_conversations`, is the claimer's to her delete and her
    erasure: it goes with them, and the next `run` brings nothing of the conversation back,
    to the old id least of all."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-a", 0, "A"), legacy_turn("t-2", "c-b", 0, "B") | {"user_id": "u-9"}]
    )
    assert cli(wire_uri, database, "run") == 0
    _claimed(wire_uri, database, ("u-1", "u-2"))
    database[CONVERSATIONS].insert_one(legacy_turn("t-late", "c-a", 5, "LATE"))

    async def remove() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            db = client[database.name]
            store = ConversationStore(db, legacy=LegacyTurns(db, dual_write=True))
            if by == "delete":
                await store.delete("c-a", user_id="u-2")
            else:
                await store.erase_user("u-2")
        finally:
            await client.close()

    asyncio.run(remove())
    assert cli(wire_uri, database, "run") == 0

    assert _served_to(database, "c-a") == {}
    assert (
        database[CONVERSATIONS].count_documents({"$or": [{"_id": "c-a"}, {"_id": "t-late"}]}) == 0
    )
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_moved_turn_re_saved_naming_the_user_a_claim_moved_it_from_is_the_moved_turn(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The old service re-saves its cached copy of a moved turn (an upsert by `_id`) naming
    the user a claim moved it away from: the same turn as its moved copy naming the claimer,
    not other content; the run takes it as moved, once, and the conversation stays the
    claimer's."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-a", 0, "A"), legacy_turn("t-2", "c-a", 1, "A2")]
    )
    assert cli(wire_uri, database, "run") == 0
    stale = database[LEGACY_TURNS].find_one({"_id": "t-2"})
    _claimed(wire_uri, database, ("u-1", "u-2"))
    database[CONVERSATIONS].replace_one({"_id": "t-2"}, stale, upsert=True)

    assert cli(wire_uri, database, "run") == 0

    assert _served_to(database, "c-a") == {"u-2": ["A question", "A2 question"]}
    assert database[CONVERSATIONS].find_one({"_id": "c-a"})["user_id"] == "u-2"
    assert database[CONVERSATIONS].count_documents({"_id": "t-2"}) == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_moved_turn_edited_naming_the_user_a_claim_moved_it_from_keeps_the_claimer(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The old service completes a moved turn (an upsert by `_id`, other content) naming the
    user a claim moved it away from: refused as other content, saying that user is the
    claimer; its way out for the edited turn keeps the claim, which the copy alone holds."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-a", 0, "A"))
    assert cli(wire_uri, database, "run") == 0
    stale = database[LEGACY_TURNS].find_one({"_id": "t-1"})
    _claimed(wire_uri, database, ("u-1", "u-2"))
    edited = stale | {"response_parts": [{"type": "text", "content": "A answer, whole"}]}
    database[CONVERSATIONS].replace_one({"_id": "t-1"}, edited, upsert=True)
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 1

    said = capsys.readouterr().err
    assert "a claim moved the copy from the user the turn names to 'u-2'" in said
    assert "give it the copy's user_id and claimed_from, then delete its copy" in said
    copy = database[LEGACY_TURNS].find_one_and_delete({"_id": "t-1"})
    kept = {"user_id": copy["user_id"], "claimed_from": copy["claimed_from"]}
    database[CONVERSATIONS].update_one({"_id": "t-1"}, {"$set": kept})
    assert cli(wire_uri, database, "run") == 0
    assert _served_to(database, "c-a") == {"u-2": ["A question"]}
    answers = database[MESSAGES].find({"conversation_id": "c-a", "role": "assistant"})
    assert [m["content"] for m in answers] == ["A answer, whole"]
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_an_old_service_turn_logged_before_a_claim_moves_with_it(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A turn the old service logged before the claim, not migrated yet, is moved by the
    claim to the new owner with the conversation."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-a", 0, "A"))
    assert cli(wire_uri, database, "run") == 0
    database[CONVERSATIONS].insert_one(legacy_turn("t-late", "c-a", 5, "LATE"))
    _claimed(wire_uri, database, ("u-1", "u-2"))

    assert cli(wire_uri, database, "run") == 0

    assert _served_to(database, "c-a") == {"u-2": ["A question", "LATE question"]}
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_finish_and_run_report_a_listed_conversation_whose_turns_no_read_finds(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A conversation id stored as a legacy UUID (BSON binary subtype 3): the embedded
    server lists it but finds nothing by it. `run` records it, and `verify` and `finish`
    both count it as work left, so no drop takes its turns."""
    legacy_uuid = bson.Binary(bytes(range(16)), 3)
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-plain", 0, "PLAIN"), legacy_turn("t-2", "x", 1, "UUID")]
    )
    database[CONVERSATIONS].update_one({"_id": "t-2"}, {"$set": {"conversation_id": legacy_uuid}})
    assert cli(wire_uri, database, "run") == 0
    if database[MESSAGES].count_documents({"content": "UUID question"}):
        pytest.skip("this server matches a legacy UUID by equality: its turns are migrated")
    assert database[PROBLEMS].count_documents({"kind": "unread_conversation"}) == 1
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1

    assert "no legacy turns under this id" in capsys.readouterr().out
    assert database[LEGACY_TURNS].count_documents({}) == 2


@pytest.mark.wire
@pytest.mark.parametrize(
    "unreadable", [bson.Regex("a.b"), bson.DBRef("x", "a.b")], ids=["regex", "dbref"]
)
def test_the_problem_of_an_unreadable_id_goes_once_the_id_is_stored_as_text(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    unreadable: Any,
) -> None:
    """MIGRATION.md ("The problem report"): each run replaces the problems of the
    conversations it converts, so the report says what the current code makes of the data. A
    conversation id no run converts as stored (a Regex, a DBRef: `unread_conversation`,
    `invalid_conversation`) is recorded under its text (`Regex('a.b', 0)`); once the operator
    stores it as text as advised and runs again, no legacy turn goes by it any more and the
    run's last step drops its problem (was: `finish` exit 0 and `status` still counting it,
    "1 holding content no message holds (not placed)", every word in messages)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", unreadable, 0, "ODD"), legacy_turn("t-2", "plain", 1, "PLAIN")]
    )
    assert cli(wire_uri, database, "run") == 0
    if database[MESSAGES].count_documents({"content": "ODD question"}):
        pytest.skip("this server reads the conversation by this id: its turns are migrated")
    recorded = database[PROBLEMS].find_one({"conversation_id": str(unreadable)})
    assert recorded is not None
    assert cli(wire_uri, database, "finish") == 1

    database[LEGACY_TURNS].update_one({"_id": "t-1"}, {"$set": {"conversation_id": "a.b"}})
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()

    assert cli(wire_uri, database, "finish") == 0
    assert cli(wire_uri, database, "status") == 0
    out = capsys.readouterr().out
    assert database[MESSAGES].count_documents({"content": "ODD question"}) == 1
    assert database[PROBLEMS].count_documents({}) == 0, list(database[PROBLEMS].find())
    assert recorded["kind"] not in out, out
    assert "not placed" not in out, out


@pytest.mark.wire
def test_a_turn_refiled_in_another_conversation_is_moved_out_of_the_first_by_a_rerun(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A rerun moves the migration's own messages, those of any legacy turn (`legacy-…`),
    out of a conversation its legacy turns no longer put them in."""
    database[CONVERSATIONS].insert_many(
        [
            legacy_turn("u-1", "c-a", 0, "A"),
            legacy_turn("u-2", "c-a", 1, "MISFILED"),
            legacy_turn("u-3", "c-b", 0, "B"),
        ]
    )
    assert cli(wire_uri, database, "run") == 0
    database[LEGACY_TURNS].update_one({"_id": "u-2"}, {"$set": {"conversation_id": "c-b"}})
    assert cli(wire_uri, database, "finish") == 1

    assert cli(wire_uri, database, "run") == 0

    held = database[MESSAGES].find({"content": "MISFILED question"})
    assert [m["conversation_id"] for m in held] == ["c-b"]
    assert database[CONVERSATIONS].find_one({"_id": "c-a"})["message_count"] == 2
    assert database[PROBLEMS].count_documents({"kind": "conversation_already_live"}) == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_conversation_whose_turns_were_all_refiled_is_removed_by_a_rerun_never_kept_twice(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A turn naming no conversation is migrated as one of its own; re-filed under its real
    conversation, the conversation it made is work left until a rerun removes it."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "FIRST"), legacy_turn("t-3", "", 2, "REFILED")]
    )
    assert cli(wire_uri, database, "run") == 0
    database[LEGACY_TURNS].update_one({"_id": "t-3"}, {"$set": {"conversation_id": "c-1"}})
    assert cli(wire_uri, database, "finish") == 1

    assert cli(wire_uri, database, "run") == 0

    held = database[MESSAGES].find({"content": "REFILED question"})
    assert [m["conversation_id"] for m in held] == ["c-1"]
    assert database[CONVERSATIONS].find_one({"_id": "legacy-turn-t-3"}) is None
    assert database[PROBLEMS].count_documents({"conversation_id": "legacy-turn-t-3"}) == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_conversation_whose_turns_were_all_refiled_but_live_turns_wrote_to_is_reported(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """No rerun deletes what a live turn wrote: such a conversation stays, with every
    message, and is work left for a person."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "FIRST"), legacy_turn("t-3", "", 2, "REFILED")]
    )
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "legacy-turn-t-3", "live-1", "LIVE")
    database[LEGACY_TURNS].update_one({"_id": "t-3"}, {"$set": {"conversation_id": "c-1"}})

    assert cli(wire_uri, database, "run") == 0

    kept = database[MESSAGES].count_documents({"conversation_id": "legacy-turn-t-3"})
    assert kept == 4
    capsys.readouterr()
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "legacy-turn-t-3" in capsys.readouterr().out
    assert database[LEGACY_TURNS].count_documents({}) == 2


def _contents(db: Database[dict[str, Any]]) -> set[str]:
    return {str(m.get("content")) for m in db[MESSAGES].find()}


@pytest.mark.wire
@pytest.mark.parametrize(
    "odd_id",
    [
        True,
        {"tenant": "t-1", "n": 7},
        bson.Binary(b"\x01\x02conv", 0),
        datetime(2020, 1, 1, tzinfo=UTC),
        [1, 2],
    ],
    ids=["bool", "object", "binary", "datetime", "array"],
)
def test_a_run_never_removes_a_conversation_whose_legacy_turns_are_there_whatever_its_ids_type(
    wire_uri: str, database: Database[dict[str, Any]], odd_id: Any
) -> None:
    """A legacy id no filter of its text finds (an object, binary data, a date) is stored under
    a derived id; the run's last step reads its turns by their type and keeps it."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-plain", 0, "PLAIN"), legacy_turn("t-2", "x", 1, "ODD")]
    )
    database[CONVERSATIONS].update_one({"_id": "t-2"}, {"$set": {"conversation_id": odd_id}})

    assert cli(wire_uri, database, "run") == 0
    assert "ODD question" in _contents(database)
    assert cli(wire_uri, database, "run") == 0

    assert database[LEGACY_TURNS].count_documents({}) == 2
    assert "ODD question" in _contents(database)
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_deleting_a_conversation_leaves_the_conversation_an_array_id_holding_its_id_makes(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A turn under `["c-x", "other"]` is a conversation of its own (a derived id): deleting
    `c-x` takes `c-x`'s turns only, so the rerun and the gate keep the other conversation."""
    array_id = ["c-x", "other"]
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-x", "c-x", 0, "X") | {"user_id": "alice"},
         legacy_turn("t-array", "x", 1, "ARRAY") | {"user_id": "alice"},
         legacy_turn("t-y", "c-y", 2, "Y")]
    )  # fmt: skip
    database[CONVERSATIONS].update_one({"_id": "t-array"}, {"$set": {"conversation_id": array_id}})
    assert cli(wire_uri, database, "run") == 0
    derived = derived_conversation_id(json.dumps(array_id))
    assert database[CONVERSATIONS].count_documents({"_id": derived}) == 1

    async def delete() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            db = client[database.name]
            await ConversationStore(db, legacy=LegacyTurns(db)).delete("c-x", user_id="alice")
        finally:
            await client.close()

    asyncio.run(delete())
    assert cli(wire_uri, database, "run") == 0

    assert sorted(d["_id"] for d in database[LEGACY_TURNS].find()) == ["t-array", "t-y"]
    assert "ARRAY question" in _contents(database)
    assert database[CONVERSATIONS].count_documents({"_id": derived}) == 1
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_an_array_id_is_no_identifier_whatever_it_holds(database: Database[dict[str, Any]]) -> None:
    """A derived id read alone finds the legacy id it stands for among the ids that are no
    identifier (`not_identifiers`): an array of identifiers is one, as an array of anything."""
    database[LEGACY_TURNS].insert_many(
        [{"_id": "t-plain", "conversation_id": "c-x"},
         {"_id": "t-array", "conversation_id": ["c-x", "other"]},
         {"_id": "t-numbers", "conversation_id": [1, 2]}]
    )  # fmt: skip

    found = database[LEGACY_TURNS].find(not_identifiers("conversation_id"))

    assert sorted(d["_id"] for d in found) == ["t-array", "t-numbers"]


@pytest.mark.wire
def test_a_conversation_named_by_a_dot_or_two_dots_is_migrated_under_a_derived_id(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """No id is `.` or `..`: the run finds them among the legacy ids that are no identifier
    (`not_identifiers`) and stores their conversations under derived ids."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-plain", 0, "PLAIN"),
         legacy_turn("t-2", ".", 1, "DOT") | {"user_id": ".."},
         legacy_turn("t-3", "..", 2, "DOTS")]
    )  # fmt: skip
    odd = database[CONVERSATIONS].find(not_identifiers("conversation_id"))
    assert sorted(d["_id"] for d in odd) == ["t-2", "t-3"]

    assert cli(wire_uri, database, "run") == 0

    for dots, text in ((".", "DOT"), ("..", "DOTS")):
        stored = database[CONVERSATIONS].find_one({"_id": derived_conversation_id(dots)})
        assert stored is not None, dots
        assert stored["legacy_conversation_id"] == dots
        assert _contents_of(database, stored["_id"])[0] == f"{text} question"
    assert database[CONVERSATIONS].count_documents({"_id": {"$in": [".", ".."]}}) == 0
    assert database[MESSAGES].count_documents({"user_id": ".."}) == 0
    assert _owners(database, derived_conversation_id(".")) == {derived_user_id("..")}
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 1  # `..` owns it: `invalid_user_id`
    dot = derived_conversation_id(".")
    assert cli(wire_uri, database, "finish", "--accept", dot, "--note", "kept") == 0


@pytest.mark.wire
def test_a_created_at_of_more_digits_than_any_time_is_a_problem_not_a_crashed_run(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    huge = legacy_turn("t-2", "c-huge", 1, "HUGE") | {"created_at": "9" * 5000}
    database[CONVERSATIONS].insert_many([legacy_turn("t-1", "c-plain", 0, "PLAIN"), huge])

    assert cli(wire_uri, database, "run") == 0

    assert "HUGE question" in _contents(database)
    assert database[PROBLEMS].count_documents({"kind": "missing_created_at"}) == 1


@pytest.mark.wire
def test_a_conversation_id_of_more_digits_than_any_integer_is_migrated_under_a_derived_id(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-plain", 0, "PLAIN"), legacy_turn("t-2", "9" * 5000, 1, "LONG")]
    )

    assert cli(wire_uri, database, "run") == 0

    assert "LONG question" in _contents(database)
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_results_own_tool_name_outlives_the_drop_when_it_is_not_its_calls(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """Result `delete_account` answering call `a` of `search`: the message answers `a`, verify
    agrees, and the gate passes only because a problem keeps the name the result gave."""
    turn = legacy_turn("t-1", "c-rname", 0, "RNAME") | {
        "response_parts": [
            {"type": "tool_call", "tool_name": "search", "args": {}, "tool_call_id": "a"},
            {"type": "tool_result", "tool_name": "«delete_account»", "result": "ok",
             "tool_call_id": "a"},
        ]
    }  # fmt: skip
    database[CONVERSATIONS].insert_one(turn)

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert "«delete_account»" in kept_text(database)


@pytest.mark.wire
def test_a_summed_up_calls_other_fields_beside_its_part_hold_finish_back_until_accepted(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    turn = legacy_turn("t-1", "c-sum", 0, "SUM") | {
        "response_parts": [{"type": "tool_call", "tool_name": "search", "args": {"q": 1}}],
        "tool_calls": [{"tool_name": "search", "args": {"q": 1}, "status": "«FAILED»"}],
    }
    database[CONVERSATIONS].insert_one(turn)

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "finish", "--accept", "c-sum", "--note", "kept") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert "«FAILED»" in kept_text(database)


@pytest.mark.wire
def test_a_conversation_id_stored_as_bson_code_is_migrated_under_a_derived_id(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """BSON JavaScript code is a `str` to Python but no text id: like the other odd-typed ids
    it is stored under a derived id, apart from the text id it spells, and found again by
    its type on a rerun."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-code", 0, "PLAIN"), legacy_turn("t-2", "x", 1, "CODE")]
    )
    database[CONVERSATIONS].update_one(
        {"_id": "t-2"}, {"$set": {"conversation_id": bson.Code("c-code")}}
    )

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "run") == 0

    derived = derived_conversation_id('{"$code": "c-code"}')
    assert {m["conversation_id"] for m in database[MESSAGES].find()} == {"c-code", derived}
    assert "CODE question" in _contents(database)
    [problem] = database[PROBLEMS].find({"kind": "derived_conversation_id"})
    assert problem["content"] == '{"$code": "c-code"}'
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
@pytest.mark.parametrize("field", ["_id", "user_id"])
def test_a_turn_id_or_user_id_stored_as_bson_code_does_not_crash_the_migration(
    wire_uri: str, database: Database[dict[str, Any]], field: str
) -> None:
    turn = legacy_turn("t-1", "c-code", 0, "CODE") | {field: bson.Code("x-1")}
    database[CONVERSATIONS].insert_many([turn, legacy_turn("t-2", "c-plain", 1, "PLAIN")])

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert "CODE question" in _contents(database)


# -- what only a turn's message_history_json holds survives the drop ---------------------


def runbook_keeps(
    wire_uri: str, database: Database[dict[str, Any]], turns: list[dict[str, Any]], marker: str
) -> None:
    """The runbook on these turns: run; then, if `finish` lets the drop go, the drop. Whatever
    the gate lets through, `marker` is still in the new collections afterwards."""
    database[CONVERSATIONS].insert_many(turns)
    assert cli(wire_uri, database, "run") == 0
    if cli(wire_uri, database, "finish") == 0:
        assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert marker in kept_text(database), f"{marker!r} dropped with the legacy turns"


@pytest.mark.wire
@pytest.mark.parametrize("size", [300, 2_000_000], ids=["short", "over-a-problem-document"])
def test_a_history_that_is_not_json_is_kept_whole_before_the_drop(
    wire_uri: str, database: Database[dict[str, Any]], size: int
) -> None:
    """An `unreadable_history` problem is placed (the messages come from the parts), so it
    keeps the whole history: one too large for a problem document is kept in GridFS."""
    history = "[ModelRequest(parts=[UserPromptPart(content='hi')])] " + "x" * size + " «TAIL»"
    turn = legacy_turn("t-1", "c-hist", 0, "H") | {"message_history_json": history}
    runbook_keeps(wire_uri, database, [turn], "«TAIL»")


@pytest.mark.wire
def test_a_model_response_only_in_the_history_is_kept_before_the_drop(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    history = json.dumps([
        {"kind": "request", "parts": [{"part_kind": "user-prompt", "content": "H question"}]},
        {"kind": "response", "parts": [{"part_kind": "thinking", "content": "«thinking»"},
                                       {"part_kind": "text", "content": "H answer"}]}])  # fmt: skip
    turn = legacy_turn("t-1", "c-think", 0, "H") | {"message_history_json": history}
    runbook_keeps(wire_uri, database, [turn], "«thinking»")


@pytest.mark.wire
def test_content_kept_in_a_placed_problem_and_edited_after_the_run_holds_the_drop_back(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A placed problem keeps what no message holds: the gate checks it is recorded as the
    legacy turns say it now, as it does for unplaced ones, so an edit made after the run is
    never dropped unseen."""

    def history(last: dict[str, Any]) -> str:
        return json.dumps([
            {"kind": "request", "parts": [{"part_kind": "user-prompt", "content": "H question"}]},
            {"kind": "response", "parts": [last, {"part_kind": "text", "content": "H answer"}]},
        ])  # fmt: skip

    first = {"part_kind": "thinking", "content": "«thinking»"}
    edit = {"part_kind": "thinking", "content": "«edited thinking»"}
    turn = legacy_turn("t-1", "c-think", 0, "H") | {"message_history_json": history(first)}
    database[CONVERSATIONS].insert_one(turn)
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 0
    database[LEGACY_TURNS].update_one(
        {"_id": "t-1"}, {"$set": {"message_history_json": history(edit)}}
    )

    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert "«edited thinking»" in kept_text(database)


EDITS = {
    "content-redacted": ("unknown_part", {"$set": {"content": "[redacted]"}}),
    "content-removed": ("unknown_part", {"$unset": {"content": ""}}),
    "kind": ("unknown_part", {"$set": {"kind": "derived_conversation_id"}}),
    "legacy_id": ("unknown_part", {"$set": {"legacy_id": "another turn"}}),
    "field": ("unknown_part", {"$set": {"field": "upload_result"}}),
    "placed": ("unknown_part", {"$set": {"placed": True}}),
    "placed-name": ("shortened_name", {"$set": {"content": "[redacted]"}}),
}


@pytest.mark.wire
@pytest.mark.parametrize(("kind", "edit"), list(EDITS.values()), ids=list(EDITS))
def test_a_problem_record_edited_after_the_run_holds_the_drop_back_until_a_run_records_it_again(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    kind: str,
    edit: dict[str, Any],
) -> None:
    """The problem records are the archive of what no message holds: `verify` and `finish`
    check each holds what the conversion of its legacy turns finds now (its content, kind,
    turn, field, placed), not only the digest it names, so a record edited or emptied by hand
    is a difference and work left, and the drop waits until a run records it again."""
    parts = [{"type": "mystery", "payload": "«UNPLACED»"}, {"type": "text", "content": "P a"}]
    name = "n" * 300 + "«NAME»"
    turn = legacy_turn("t-1", "c-p", 0, "P") | {"response_parts": parts, "name": name}
    database[CONVERSATIONS].insert_one(turn)
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish", "--accept", "c-p", "--note", "kept") == 0
    assert database[PROBLEMS].update_one({"kind": kind}, edit).modified_count == 1
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 1
    assert "c-p" in capsys.readouterr().out
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "c-p" in capsys.readouterr().out
    assert database[LEGACY_TURNS].count_documents({}) == 1

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    kept = kept_text(database)
    assert "«UNPLACED»" in kept
    assert "«NAME»" in kept


@pytest.mark.wire
@pytest.mark.parametrize(
    ("message", "marker"),
    [
        ({"role": "user", "content": "«OPENAI»"}, "«OPENAI»"),
        ({"kind": "request", "parts": {"part_kind": "user-prompt", "content": "«DICT»"}}, "«DICT»"),
        ({"kind": "request", "parts": [], "instructions": ["«LIST»"]}, "«LIST»"),
        ({"kind": "response", "parts": [], "model_note": "«NOTE»"}, "«NOTE»"),
    ],
    ids=["openai-shaped", "parts-not-a-list", "instructions-not-text", "message-field"],
)
def test_a_history_message_not_in_pydantic_ais_shape_is_kept_before_the_drop(
    wire_uri: str, database: Database[dict[str, Any]], message: dict[str, Any], marker: str
) -> None:
    turn = legacy_turn("t-1", "c-hist", 0, "H") | {"message_history_json": json.dumps([message])}
    runbook_keeps(wire_uri, database, [turn], marker)


def weather_turn(returned: dict[str, str]) -> dict[str, Any]:
    """One turn of two calls of one tool whose results, naming no call, trail in the order
    they came back (Rome's first); its history names each call's id and what it returned."""
    call = [
        {
            "part_kind": "tool-call",
            "tool_name": "weather",
            "args": {"city": city},
            "tool_call_id": f"call_{city.lower()}",
        }
        for city in ("Oslo", "Rome")
    ]
    back = [
        {
            "part_kind": "tool-return",
            "tool_name": "weather",
            "content": returned[city],
            "tool_call_id": f"call_{city.lower()}",
        }
        for city in ("Oslo", "Rome")
    ]
    history = [
        {"kind": "request", "parts": [{"part_kind": "user-prompt", "content": "W question"}]},
        {"kind": "response", "parts": call},
        {"kind": "request", "parts": back},
    ]
    parts = [
        {"type": "tool_call", "tool_name": "weather", "args": {"city": "Oslo"}},
        {"type": "tool_call", "tool_name": "weather", "args": {"city": "Rome"}},
        {"type": "tool_result", "tool_name": "weather", "result": "Rome: 24C"},
        {"type": "tool_result", "tool_name": "weather", "result": "Oslo: -3C"},
    ]
    history_json = json.dumps(history)
    return legacy_turn("t-w", "c-w", 0, "W") | {
        "response_parts": parts,
        "message_history_json": history_json,
    }


def answered(database: Database[dict[str, Any]]) -> list[tuple[str, str]]:
    """(content, the arguments of the call it answers) of each stored tool message."""
    stored = stored_messages(database)
    arguments = {
        c["id"]: c["function"]["arguments"] for m in stored for c in m.get("tool_calls") or ()
    }
    tools = [m for m in stored if m["role"] == "tool"]
    return [(m["content"], arguments[m["tool_call_id"]]) for m in tools]


@pytest.mark.wire
def test_results_the_history_pairs_are_stored_answering_their_own_calls_before_the_drop(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    database[CONVERSATIONS].insert_one(weather_turn({"Oslo": "Oslo: -3C", "Rome": "Rome: 24C"}))
    assert cli(wire_uri, database, "run") == 0
    assert answered(database) == [
        ("Oslo: -3C", '{"city":"Oslo"}'),
        ("Rome: 24C", '{"city":"Rome"}'),
    ]
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0


@pytest.mark.wire
def test_a_pairing_the_history_contradicts_holds_the_drop_until_accepted(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The history says the calls returned other texts than the turn's results: which result
    answered which call is a guess, so the drop waits until an operator accepts it."""
    database[CONVERSATIONS].insert_one(weather_turn({"Oslo": "Oslo: 12C", "Rome": "Rome: 30C"}))
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "history_contradicts_pairing" in capsys.readouterr().out
    found = database[PROBLEMS].find({"kind": "history_contradicts_pairing", "placed": False})
    assert sorted(p["content"]["result"]["result"] for p in found) == ["Oslo: -3C", "Rome: 24C"]
    assert database[LEGACY_TURNS].count_documents({}) == 1
    assert cli(wire_uri, database, "finish", "--accept", "c-w", "--note", "pairing read") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0


# -- ids a provider numbers per response (`call_0` in every one), reused across turns ------


def balance_and_transfer(cid: str, first: str, *, history: bool = False) -> list[dict[str, Any]]:
    """Turn 1 calls `get_balance` as `call_0`, turn 2 `transfer_funds` as `call_0` too; turn
    2's parts hold both results, each naming its own tool, the `first` tool's first; with
    `history`, each turn keeps the Pydantic AI history saying which call returned what."""
    said = {"get_balance": "BALANCE: 120 EUR", "transfer_funds": "TRANSFER OK: 100 EUR to Bob"}
    args: dict[str, dict[str, Any]] = {"get_balance": {}, "transfer_funds": {"to": "Bob"}}
    order = [first, *(t for t in said if t != first)]

    def part(kind: str, tool: str, **more: Any) -> dict[str, Any]:
        return {"type": kind, "tool_name": tool, "tool_call_id": "call_0", **more}

    def call(tool: str) -> dict[str, Any]:
        return {"part_kind": "tool-call", "tool_name": tool, "args": args[tool],
                "tool_call_id": "call_0"}  # fmt: skip

    def back(tool: str) -> dict[str, Any]:
        return {"part_kind": "tool-return", "tool_name": tool, "content": said[tool],
                "tool_call_id": "call_0"}  # fmt: skip

    def asked(text: str) -> dict[str, Any]:
        return {"part_kind": "user-prompt", "content": text}

    first_turn = legacy_turn(f"{cid}-1", cid, 0, "B") | {
        "response_parts": [part("tool_call", "get_balance", args={})]
    }
    second_turn = legacy_turn(f"{cid}-2", cid, 1, "T") | {
        "response_parts": [part("tool_call", "transfer_funds", args=args["transfer_funds"])]
        + [part("tool_result", tool, result=said[tool]) for tool in order]
        + [{"type": "text", "content": "Done."}]
    }
    if history:
        opening = [{"kind": "request", "parts": [asked("B question")]},
                   {"kind": "response", "parts": [call("get_balance")]}]  # fmt: skip
        first_turn["message_history_json"] = json.dumps(opening)
        second_turn["message_history_json"] = json.dumps([*opening,
            {"kind": "request", "parts": [back("get_balance"), asked("T question")]},
            {"kind": "response", "parts": [call("transfer_funds")]},
            {"kind": "request", "parts": [back("transfer_funds")]},
            {"kind": "response", "parts": [{"part_kind": "text", "content": "Done."}]},
        ])  # fmt: skip
    return [first_turn, second_turn]


def results_by_tool(database: Database[dict[str, Any]], cid: str) -> list[tuple[int, str, str]]:
    """(seq, the tool of the call it answers, content) of each stored tool message."""
    stored = list(database[MESSAGES].find({"conversation_id": cid}, sort=[("seq", 1)]))
    tools = {c["id"]: c["function"]["name"] for m in stored for c in m.get("tool_calls") or ()}
    return [
        (m["seq"], tools[m["tool_call_id"]], m["content"]) for m in stored if m["role"] == "tool"
    ]


REUSED_IDS = {
    "c-balance-first": ("get_balance", False),
    "c-transfer-first": ("transfer_funds", False),
    "c-balance-first-history": ("get_balance", True),
}


@pytest.mark.wire
def test_results_under_an_id_reused_across_turns_pass_the_gate_answering_their_own_tools(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """Whatever the order of turn 2's results, each answers the call of the tool it names:
    the balance right after turn 1's call, before the user asked for the transfer."""
    for cid, (first, history) in REUSED_IDS.items():
        database[CONVERSATIONS].insert_many(balance_and_transfer(cid, first, history=history))
    assert cli(wire_uri, database, "run") == 0
    for cid in REUSED_IDS:
        assert results_by_tool(database, cid) == [
            (2, "get_balance", "BALANCE: 120 EUR"),
            (5, "transfer_funds", "TRANSFER OK: 100 EUR to Bob"),
        ], cid
    assert database[PROBLEMS].count_documents({"kind": "mismatched_tool_name"}) == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0


@pytest.mark.wire
def test_verify_catches_results_swapped_between_calls_of_one_reused_id(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Stored messages where the balance answers the transfer and the transfer the balance
    (both calls `call_0` in their turns' parts) differ from the legacy turns: verify exits 1."""
    database[CONVERSATIONS].insert_many(balance_and_transfer("c-swap", "get_balance"))
    assert cli(wire_uri, database, "run") == 0
    where = {"conversation_id": "c-swap"}
    swapped = {2: "TRANSFER OK: 100 EUR to Bob", 5: "BALANCE: 120 EUR"}
    for seq, content in swapped.items():
        database[MESSAGES].update_one({**where, "seq": seq}, {"$set": {"content": content}})
    assert results_by_tool(database, "c-swap") == [
        (2, "get_balance", "TRANSFER OK: 100 EUR to Bob"),
        (5, "transfer_funds", "BALANCE: 120 EUR"),
    ]
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 1
    assert any(line.startswith("c-swap:") for line in capsys.readouterr().out.splitlines())


@pytest.mark.wire
def test_a_result_naming_no_tool_its_reused_id_calls_holds_the_drop_until_accepted(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`call_0` names two unanswered calls, of other tools than the one a result names:
    which it answered is a guess, so the drop waits until an operator accepts it."""
    turns = balance_and_transfer("c-refund", "get_balance")
    turns[1]["response_parts"][1:3] = [
        {"type": "tool_result", "tool_name": "refund", "result": "«REFUNDED»",
         "tool_call_id": "call_0"}
    ]  # fmt: skip
    database[CONVERSATIONS].insert_many(turns)
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "ambiguous_tool_result" in capsys.readouterr().out
    assert database[LEGACY_TURNS].count_documents({}) == 2
    assert cli(wire_uri, database, "finish", "--accept", "c-refund", "--note", "read") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert "«REFUNDED»" in kept_text(database)


# -- dual-written turns: skipped only while the stored messages hold them -----------------


def dual_written(cid: str, turn_id: str, text: str) -> dict[str, Any]:
    """A turn as the new service's dual write stores it (`legacy_turn_document`)."""
    return legacy_turn(legacy_turn_id(cid, turn_id), cid, 0, text) | {
        "dual_write": True,
        "turn_id": turn_id,
    }


@pytest.mark.wire
def test_a_dual_written_turn_no_message_holds_is_migrated_before_the_drop(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """E.g. a second attempt after a rollback that cleared agent_messages: the dual-written
    copy is the only one, so the run converts it like any legacy turn."""
    turns = [dual_written("c-dual", "turn-1", "«DUAL»"), legacy_turn("t-o", "c-other", 0, "O")]
    runbook_keeps(wire_uri, database, turns, "«DUAL» question")
    stored = database[MESSAGES].find({"conversation_id": "c-dual"})
    assert [m["content"] for m in stored] == ["«DUAL» question", "«DUAL» answer"]


@pytest.mark.wire
def test_a_dual_written_turn_its_stored_messages_do_not_hold_is_work_left(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The old service edited a dual-written turn after a rollback: its stored messages no
    longer hold it. `verify` and `finish` say so, and the drop is refused; a dual-written
    turn its messages hold is no difference."""
    for cid in ("c-dual", "c-held"):
        log_live(wire_uri, database, cid, "turn-1", cid.upper())
        stored = [message_adapter.validate_python(m) for m in database[MESSAGES].find(
            {"conversation_id": cid})]  # fmt: skip
        database[LEGACY_TURNS].insert_many(
            legacy_turn_documents(cid, "turn-1", stored, user_id="u-1", name=None)
        )
    database[LEGACY_TURNS].update_one(
        {"conversation_id": "c-dual"},
        {"$push": {"response_parts": {"type": "text", "content": "«EDITED»"}}},
    )
    database[LEGACY_TURNS].insert_one(legacy_turn("t-o", "c-other", 0, "O"))

    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    out = capsys.readouterr().out
    assert "c-dual" in out
    # Copies written by hand record nothing, as an earlier release's: said, no difference.
    said = [line for line in out.splitlines() if "c-held" in line]
    assert all(dual_writes.UNRECORDED.format(count=1) in line for line in said)
    assert database[LEGACY_TURNS].count_documents({}) == 3


DUAL_WRITE_EDITS = {
    "a part of a kind no reader knows": (
        {"$push": {"response_parts": {"type": "«kind»", "payload": "«UNKNOWN»"}}}, "«UNKNOWN»"),
    "a history": ({"$set": {"message_history_json": json.dumps(
        [{"kind": "response", "parts": [{"part_kind": "thinking", "content": "«THINKING»"}]}],
        ensure_ascii=False,
    )}}, "«THINKING»"),
    "token usage": ({"$set": {"token_usage": {"input_tokens": 9191, "output_tokens": 7}}}, "9191"),
    "a field on a part": (
        {"$set": {"response_parts.0.«field»": "«FIELD»"}}, "«FIELD»"),
    "an upload": ({"$set": {"upload_result": {"filename": "a.txt", "file_type": "text/plain",
                                              "size": 3, "parsed_text": "«PARSED»"}}},
                  "«PARSED»"),
}  # fmt: skip


@pytest.mark.wire
@pytest.mark.parametrize(("edit", "marker"), DUAL_WRITE_EDITS.values(), ids=list(DUAL_WRITE_EDITS))
def test_a_held_dual_written_turn_converting_to_anything_else_than_is_stored_is_work_left(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    edit: dict[str, Any],
    marker: str,
) -> None:
    """A dual-written turn the run skips is checked as fully as a migrated one: whatever it
    converts to that its stored messages do not hold (a problem of any kind, placed or not,
    another token usage) holds the drop back, and the runbook never drops it unseen."""
    log_live(wire_uri, database, "c-dual", "turn-1", "LIVE")
    stored = [message_adapter.validate_python(m) for m in database[MESSAGES].find()]
    database[LEGACY_TURNS].insert_many(
        legacy_turn_documents("c-dual", "turn-1", stored, user_id="u-1", name=None)
    )
    database[LEGACY_TURNS].insert_one(legacy_turn("t-o", "c-other", 0, "O"))
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 0
    database[LEGACY_TURNS].update_one({"conversation_id": "c-dual"}, edit)
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "dual-written turn 'turn-1'" in capsys.readouterr().out
    assert marker in json.dumps(
        list(database[LEGACY_TURNS].find()), default=str, ensure_ascii=False
    )


@pytest.mark.wire
def test_a_dual_written_turn_answering_an_earlier_turns_call_is_no_difference(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """Its dual write holds a result no call of its own answers (an unplaced result when the
    turn is converted alone): its stored messages hold that result, so it is no difference."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = {
        "turn-1": [{"role": "user", "content": "ask"},
                   {"role": "assistant", "content": None, "tool_calls": [call]}],
        "turn-2": [{"role": "tool", "tool_call_id": "call_1", "content": "42"},
                   {"role": "assistant", "content": "done"}],
    }  # fmt: skip

    async def log() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        logger = AgentMessageLogger(client[database.name])
        for turn_id, messages in turns.items():
            await logger.log_messages("c-dual", messages, user_id="u-1", turn_id=turn_id)
        await client.close()

    asyncio.run(log())
    for turn_id in turns:
        stored = [message_adapter.validate_python(m) for m in database[MESSAGES].find(
            {"turn_id": turn_id})]  # fmt: skip
        database[LEGACY_TURNS].insert_many(
            legacy_turn_documents("c-dual", turn_id, stored, user_id="u-1", name=None)
        )
    database[LEGACY_TURNS].insert_one(legacy_turn("t-o", "c-other", 0, "O"))

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


def roll_back(database: Database[dict[str, Any]], *, clear_messages: bool) -> None:
    """The runbook's rollback: the new conversation documents moved away, the legacy
    collection renamed back (copied: the embedded server refuses renames)."""
    database[CONVERSATIONS].drop()
    turns = list(database[LEGACY_TURNS].find())
    database[LEGACY_TURNS].drop()
    database[CONVERSATIONS].insert_many(turns)
    if clear_messages:
        database[MESSAGES].drop()


DERIVED_CONVERSATIONS = {
    "a legacy id that is not an identifier, its live turn dual-written": ("conv 42/é", True),
    "a legacy id that is not an identifier, its live turn's copy naming the derived id": (
        "conv 42/é", False),
    "a legacy id stored as a double, its live turn's copy naming the derived id": (1e300, False),
    "a turn naming no conversation, its live turn dual-written": (None, True),
    "a turn naming no conversation, its live turn's copy naming the derived id": (None, False),
}  # fmt: skip


@pytest.mark.wire
@pytest.mark.parametrize(("legacy_id", "dual_write"), DERIVED_CONVERSATIONS.values(),
                         ids=list(DERIVED_CONVERSATIONS))  # fmt: skip
@pytest.mark.parametrize("messages", ["cleared", "kept"])
def test_a_second_attempt_after_a_rollback_migrates_a_derived_conversation_as_one(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    legacy_id: Any,
    dual_write: bool,
    messages: str,
) -> None:
    """A conversation stored under a derived id: its legacy turn, the legacy copy of the live
    turn the new service logged (dual-written, or written before the dual write named a
    conversation as its legacy turns do: by the derived id) and, with `agent_messages`
    cleared, a turn the old service logged after the rollback are one conversation to the
    second attempt: one `seq` space, every turn in its messages, and `finish` passes."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", legacy_id, 0, "«LEGACY»"))
    stored_id = parse_turns([legacy_turn("t-1", legacy_id, 0, "")])[0].stored_conversation_id
    assert cli(wire_uri, database, "run") == 0
    live = log_live(wire_uri, database, stored_id, "native-1", "«LIVE»", dual_write=dual_write)
    if not dual_write:
        database[LEGACY_TURNS].insert_many(
            legacy_turn_documents(stored_id, "native-1", live.messages, user_id="u-1", name=None)
        )
    roll_back(database, clear_messages=messages == "cleared")
    texts = ["«LEGACY» question", "«LEGACY» answer", "«LIVE»?", "«LIVE»"]
    if messages == "cleared":  # (else it is already live: MIGRATION.md, "Rollback")
        # The old service names the conversation as its legacy turns do (`legacy-turn-…`
        # for one naming none: the id the new service served it under).
        after = legacy_turn("t-2", legacy_id or stored_id, 0, "«AFTER»")
        database[CONVERSATIONS].insert_one(after | {"created_at": datetime.now(UTC)})
        texts += ["«AFTER» question", "«AFTER» answer"]

    # A batch a conversation id: each spelling of the derived one is read alone.
    assert cli(wire_uri, database, "run", "--batch-size", "1") == 0
    assert cli(wire_uri, database, "verify", "--batch-size", "1") == 0
    assert cli(wire_uri, database, "finish") == 0, capsys.readouterr().out
    stored = database[MESSAGES].find({"conversation_id": stored_id}).sort("seq", 1)
    assert [m["content"] for m in stored] == texts
    capsys.readouterr()
    assert cli(wire_uri, database, "run") == 0
    assert summary(capsys.readouterr().out)["messages written"] == 0


@pytest.mark.wire
def test_a_second_attempt_reads_a_derived_owners_copy_naming_the_legacy_id_as_exact(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A live turn of the owner derived from a legacy user id is copied naming that legacy
    id (MIGRATION.md, "Dual write"): after an untouched rollback the second attempt finds
    its copy exact (its `invalid_user_id` is the conversation's recorded owner), and verify
    and finish pass."""
    alice = "Alice Smith"
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "A") | {"user_id": alice})
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-1", "«LIVE»", dual_write=True,
             user_id=derived_user_id(alice))  # fmt: skip
    assert database[LEGACY_TURNS].find_one({"dual_write": True})["user_id"] == alice
    roll_back(database, clear_messages=False)

    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 0, capsys.readouterr().out
    assert cli(wire_uri, database, "finish", "--accept", "c-1", "--note", "derived") == 0


def _rolled_back_with_a_live_turn(wire_uri: str, database: Database[dict[str, Any]]) -> None:
    """Two legacy turns of "c-1" (user "u-1") migrated, a live turn logged with the dual write
    on, then the runbook's rollback keeping `agent_messages`: the old service reads the
    conversation again, the live turn's dual-written copy its latest turn."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-0", "c-1", 0, "OLD0"), legacy_turn("t-1", "c-1", 1, "OLD1")]
    )
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-1", "«LIVE»", dual_write=True)
    roll_back(database, clear_messages=False)


@pytest.mark.wire
def test_a_copy_holding_the_automatic_name_leaves_it_automatic_after_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A dual-written copy holds its conversation's name, whoever gave it: one holding the
    very name the legacy turns give (the first user text, as a stopped run's retake left
    it) names nothing of its own, so a run after the rollback keeps the name automatic
    (a pop or a move may retake it) rather than a runtime's."""
    _rolled_back_with_a_live_turn(wire_uri, database)
    database[CONVERSATIONS].update_one({"dual_write": True}, {"$set": {"name": "OLD0 question"}})

    assert cli(wire_uri, database, "run") == 0

    document = database[CONVERSATIONS].find_one({"_id": "c-1"})
    assert document is not None
    assert (document["name"], document["name_source"]) == ("OLD0 question", "auto")
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 0, capsys.readouterr().out


OLD_SERVICE_OWNER_EDITS = {
    "an account claim: every turn, the dual-written copy too": ({}, True),
    "the dual-written copy only": ({"dual_write": True}, True),
}


@pytest.mark.wire
@pytest.mark.parametrize(("edited", "of_the_copy"), OLD_SERVICE_OWNER_EDITS.values(),
                         ids=list(OLD_SERVICE_OWNER_EDITS))  # fmt: skip
def test_a_dual_written_turn_the_old_service_gave_another_owner_is_work_left(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    edited: dict[str, Any],
    of_the_copy: bool,
) -> None:
    """MIGRATION.md: the owner is the last user a conversation's turns name. After a rollback
    the old service moves turns of a conversation holding a live turn to another user: the
    live turn's stored messages still name the first one, which the migration never
    rewrites, so the conversation and its live messages would belong to two users. Work
    left for `finish`, and the drop is refused; a held copy whose owner changed is a
    difference for `verify` too."""
    _rolled_back_with_a_live_turn(wire_uri, database)
    database[CONVERSATIONS].update_many(
        {"conversation_id": "c-1", **edited}, {"$set": {"user_id": "u-2"}}
    )

    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == (1 if of_the_copy else 0)
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    out = capsys.readouterr().out
    assert "c-1" in out
    assert "owner" in out or "user" in out
    assert database[LEGACY_TURNS].count_documents({}) == 3


@pytest.mark.wire
def test_legacy_turns_the_old_service_gave_another_owner_before_a_held_copy_leave_it_the_copys(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The old service moves the legacy turns of a conversation to another user but not the
    dual-written copy of its latest turn: the last user its turns name (the copy counted as
    a turn, as the old service reads it too) is still the first one, who owns it and every
    message of it; `finish` passes and never says the legacy turns moved."""
    _rolled_back_with_a_live_turn(wire_uri, database)
    database[CONVERSATIONS].update_many(
        {"conversation_id": "c-1", "dual_write": {"$ne": True}}, {"$set": {"user_id": "u-2"}}
    )

    assert cli(wire_uri, database, "run") == 0
    assert database[CONVERSATIONS].find_one({"_id": "c-1"})["user_id"] == "u-1"  # type: ignore[index]
    assert {m["user_id"] for m in database[MESSAGES].find({"conversation_id": "c-1"})} == {"u-1"}
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert "moved to another user" not in capsys.readouterr().out


@pytest.mark.wire
def test_a_conversation_the_old_service_renamed_on_a_dual_written_turn_takes_the_name(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The old service names a conversation on its latest turn, here the dual-written copy of
    a live one: the name the legacy turns give it is that one (the last turn that has one),
    and the second attempt gives it the conversation, though a held copy is not converted.
    A document holding another (one the run did not write) is work left for `finish`, which
    refuses the drop until the new service holds the name; a person's rename passes."""
    _rolled_back_with_a_live_turn(wire_uri, database)
    database[CONVERSATIONS].update_one(
        {"conversation_id": "c-1", "dual_write": True}, {"$set": {"name": "«RENAMED»"}}
    )

    assert cli(wire_uri, database, "run") == 0
    assert database[CONVERSATIONS].find_one({"_id": "c-1"})["name"] == "«RENAMED»"  # type: ignore[index]
    assert cli(wire_uri, database, "finish") == 0

    database[CONVERSATIONS].update_one({"_id": "c-1"}, {"$set": {"name": "older"}})
    capsys.readouterr()
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "«RENAMED»" in capsys.readouterr().out
    assert database[LEGACY_TURNS].count_documents({}) == 3
    _as_a_person(wire_uri, database, lambda s: s.rename("c-1", "«RENAMED»", user_id="u-1"))
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_dual_written_turn_the_old_service_deleted_is_work_left_while_its_messages_stay(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """After a rollback the old service deletes a turn the new service had logged (its
    dual-written copy): its messages, which the migration never deletes, would still be
    served after the drop. A deletion is an edit the old service made: work left for
    `verify` and `finish` until its messages go too (or its copy is put back)."""
    _rolled_back_with_a_live_turn(wire_uri, database)
    copy = database[CONVERSATIONS].find_one_and_delete({"dual_write": True})

    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    out = capsys.readouterr().out
    assert "'live-1'" in out
    assert database[LEGACY_TURNS].count_documents({}) == 2

    database[LEGACY_TURNS].insert_one(copy)  # put back: held by its messages again
    assert cli(wire_uri, database, "finish") == 0
    # The end of the rollback window: the dual write unset, a turn logged without a copy.
    log_live(wire_uri, database, "c-1", "live-2", "«AFTER»")
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0


@pytest.mark.wire
def test_a_conversation_live_before_its_migration_is_already_live_not_a_copy_gone(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A writer without the legacy reader logs a turn to an unmigrated conversation, the dual
    write off, before any run: no copy of it was ever made, so none went missing. `verify`
    and `finish` name it `conversation_already_live` (its legacy turns kept in the problem,
    for an operator to accept), never advise deleting the person's live messages, and
    `finish --accept` covers it, as MIGRATION.md says; a legacy turn edited after the
    acceptance is work left again."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "«LEGACY»"))
    log_live(wire_uri, database, "c-1", "live-1", "«LIVE»")

    assert cli(wire_uri, database, "run") == 0
    [problem] = database[PROBLEMS].find({"conversation_id": "c-1"})
    assert (problem["kind"], problem["placed"]) == ("conversation_already_live", False)
    capsys.readouterr()
    for command in ("verify", "finish"):
        assert cli(wire_uri, database, command) == 1
        out = capsys.readouterr().out
        assert "conversation_already_live" in out
        assert "finish --accept c-1" in out
        assert "dual-written copy" not in out
        assert "pop_last_message" not in out

    assert cli(wire_uri, database, "finish", "--accept", "c-1", "--note", "kept") == 0
    assert cli(wire_uri, database, "finish") == 0
    edit = {"$set": {"user_message": "«LEGACY» edited"}}
    database[LEGACY_TURNS].update_one({"_id": "t-1"}, edit)
    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "finish", "--accept", "c-1", "--note", "kept") == 0


@pytest.mark.wire
def test_a_second_move_keeps_the_first_moves_time(database: Database[dict[str, Any]]) -> None:
    """The state keeps when the legacy turns were first moved aside, whatever moves follow (a
    second attempt after a rollback): a turn logged live before it needed no copy."""
    dual_writes.record_move(database, None)
    first = dual_writes.moved_at(database)
    assert first is not None
    assert first.first != dual_writes.UNKNOWN
    time.sleep(0.01)
    dual_writes.record_move(database, None)

    again = dual_writes.moved_at(database)
    assert again is not None
    assert (again.first, again.last > first.last) == (first.first, True)


def _the_old_service_reads(database: Database[dict[str, Any]], cid: str) -> Conversation | None:
    """The conversation as the old service reads it after a rollback: its turns in
    `agent_conversations` and their `session_hitl` prompts, read by the legacy format's one
    reader."""
    turns = list(database[CONVERSATIONS].find({"conversation_id": cid}))
    prompts = list(database[SESSION_HITL].find({"conversation_id": cid}))
    return with_session_prompts(convert(turns), prompts).conversation


@pytest.mark.wire
@pytest.mark.parametrize("messages", ["cleared", "kept"])
def test_a_prompt_resolved_on_the_new_service_stays_resolved_after_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str],
    messages: str,
) -> None:  # fmt: skip
    """A person answers a legacy prompt on the new service, dual write on: the answer is
    written where the old service records the prompt (`session_hitl`), so after a rollback
    the old service does not ask it again, and the second attempt keeps it resolved: not
    pending, the call it held released, and answering it again answers as the first did."""
    call = {"type": "tool_call", "tool_name": "pay", "args": {"eur": 5}, "tool_call_id": "k-1"}
    prompt = {"type": "hitl", "action": "pay", "params": {}, "request_id": "r-1", "prompt": "?"}
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-1", "c-h", 0, "H") | {"response_parts": [call, prompt]}
    )
    database[SESSION_HITL].insert_one(
        {"_id": "p-1", "conversation_id": "c-h", "request_id": "r-1", "action": "pay",
         "status": "pending", "user_id": "u-1"}
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    resolve = lambda s: s.resolve_hitl("c-h", "r-1", user_id="u-1")  # noqa: E731
    _as_a_person(wire_uri, database, resolve, dual_write=True)

    roll_back(database, clear_messages=messages == "cleared")
    old = _the_old_service_reads(database, "c-h")
    assert old is not None
    assert old.pending_hitl is None

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0, capsys.readouterr().out
    found = database[CONVERSATIONS].find_one({"_id": "c-h"})
    assert found is not None
    assert (found["pending_hitl"], found["resolved_hitl"]) == (None, ["r-1"])
    assert [c["request_id"] for c in found["pending_calls"]] == [None]
    _as_a_person(wire_uri, database, resolve, dual_write=True)  # answered as the first time
    capsys.readouterr()
    assert cli(wire_uri, database, "run") == 0
    assert summary(capsys.readouterr().out)["conversation documents written"] == 0


@pytest.mark.wire
def test_an_answer_on_the_new_service_leaves_another_users_prompt_pending_and_kept(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """Another user's pending prompt under the owner's request id is kept in a
    `pending_prompt_not_placed` problem; the owner's answer, dual-written, marks the owner's
    prompt alone resolved, so the other stays pending in `session_hitl` and a rerun keeps
    its problem: `finish` holds until the conversation is accepted."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-o", 0, "O") | {"user_id": "u-b"})
    asked = {"conversation_id": "c-o", "request_id": "req-1", "action": "pay",
             "status": "pending", "created_at": datetime(2024, 1, 1, 1, tzinfo=UTC)}  # fmt: skip
    database[SESSION_HITL].insert_many(
        [asked | {"_id": "p-a", "user_id": "u-a", "params": {"iban": "A-IBAN"}},
         asked | {"_id": "p-b", "user_id": "u-b", "params": {"iban": "B-IBAN"}}]
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    resolve = lambda s: s.resolve_hitl("c-o", "req-1", user_id="u-b")  # noqa: E731
    _as_a_person(wire_uri, database, resolve, dual_write=True)

    theirs = database[SESSION_HITL].find_one({"_id": "p-a"})
    assert theirs is not None
    assert is_pending_prompt(theirs)
    assert "dual_write" not in theirs
    assert cli(wire_uri, database, "run") == 0
    kept = list(database[PROBLEMS].find({"kind": "pending_prompt_not_placed"}))
    assert [p["content"]["params"] for p in kept] == [{"iban": "A-IBAN"}]
    assert cli(wire_uri, database, "finish") == 1


@pytest.mark.wire
def test_a_prompt_naming_a_user_is_never_given_to_a_conversation_no_user_owns(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Turns naming no user, a pending prompt naming u-a (its params an IBAN): the
    conversation is stored unowned without it, the prompt kept in a problem and `finish`
    holding until an operator accepts; the next service turn naming anyone adopts the
    conversation and never reads or answers u-a's prompt."""
    turn = legacy_turn("t-1", "c-n", 0, "N")
    del turn["user_id"]
    database[CONVERSATIONS].insert_one(turn)
    database[SESSION_HITL].insert_one(
        {"_id": "p-a", "conversation_id": "c-n", "user_id": "u-a", "request_id": "req-1",
         "status": "pending", "action": "pay", "params": {"iban": "A-SECRET-IBAN"},
         "created_at": datetime(2024, 1, 1, 1, tzinfo=UTC)}
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    stored = database[CONVERSATIONS].find_one({"_id": "c-n"})
    assert stored is not None
    assert (stored["user_id"], stored["pending_hitl"]) == (None, None)
    kept = database[PROBLEMS].find_one({"kind": "pending_prompt_not_placed"})
    assert kept is not None
    assert kept["content"]["params"] == {"iban": "A-SECRET-IBAN"}
    capsys.readouterr()
    assert cli(wire_uri, database, "finish") == 1
    assert "c-n" in capsys.readouterr().out
    log_live(wire_uri, database, "c-n", "live-1", "LIVE")  # u-1's turn adopts it
    seen: list[Any] = []

    async def read(store: ConversationStore) -> None:
        seen.append(await store.pending_hitl("c-n", user_id="u-1"))
        with pytest.raises(Conflict):
            await store.resolve_hitl("c-n", "req-1", user_id="u-1")

    _as_a_person(wire_uri, database, read)
    assert seen == [None]
    assert cli(wire_uri, database, "finish", "--accept", "c-n", "--note", "kept") == 0


@pytest.mark.wire
def test_a_pop_of_the_migrated_message_a_conversation_is_named_by_takes_the_name_back(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A migrated conversation named by its first question, as a turn names one: popping
    the question takes the name back, and the next turn names the conversation; a rerun
    finds the document as the person left it."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-n", n, f"Q{n}") for n in range(2)]
    )
    assert cli(wire_uri, database, "run") == 0
    named = database[CONVERSATIONS].find_one({"_id": "c-n"})
    assert named is not None
    assert (named["name"], named["name_source"]) == ("Q0 question", "auto")

    async def pop_to_the_first_question(store: ConversationStore) -> None:
        for _ in range(3):
            await store.pop_last_message("c-n", user_id="u-1")

    _as_a_person(wire_uri, database, pop_to_the_first_question)
    kept = database[CONVERSATIONS].find_one({"_id": "c-n"})
    _as_a_person(wire_uri, database, lambda s: s.pop_last_message("c-n", user_id="u-1"))
    unnamed = database[CONVERSATIONS].find_one({"_id": "c-n"})
    log_live(wire_uri, database, "c-n", "live-1", "LIVE")
    renamed = database[CONVERSATIONS].find_one({"_id": "c-n"})

    assert kept is not None
    assert unnamed is not None
    assert renamed is not None
    assert (kept["name"], kept["name_source"]) == ("Q0 question", "auto")
    assert (unnamed["name"], unnamed["name_source"]) == (None, None)
    assert (renamed["name"], renamed["name_source"]) == ("LIVE?", "auto")
    assert cli(wire_uri, database, "run") == 0
    rerun = database[CONVERSATIONS].find_one({"_id": "c-n"})
    assert rerun is not None
    assert (rerun["name"], rerun["name_source"]) == ("LIVE?", "auto")


@pytest.mark.wire
def test_a_document_migrated_before_its_names_message_was_recorded_is_written_again_once(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A document an earlier version's run wrote holds no `name_message_id`: the rerun
    writes that document again, and nothing else."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-n", n, f"Q{n}") for n in range(2)]
    )
    assert cli(wire_uri, database, "run") == 0
    database[CONVERSATIONS].update_one({"_id": "c-n"}, {"$unset": {"name_message_id": ""}})
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 0
    counts = summary(capsys.readouterr().out)
    assert (counts["conversation documents written"], counts["messages written"]) == (1, 0)
    found = database[CONVERSATIONS].find_one({"_id": "c-n"})
    first = database[MESSAGES].find_one({"conversation_id": "c-n", "seq": 0})
    assert found is not None
    assert first is not None
    assert found["name_message_id"] == first["_id"]


@pytest.mark.wire
def test_a_second_attempt_keeps_a_live_turn_logged_where_a_person_popped_a_migrated_message(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A person pops a migrated answer and a live turn takes its place; the rollback moves
    the document recording the pop away, and the old service's legacy turns still hold the
    answer. The second attempt keeps the person's conversation as it was (its document
    written again, so it stays writable) and does not merge the legacy turns: the answer is
    kept in a `conversation_changed_since` problem, and once an operator accepts it the gate
    passes and the drop goes."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-p", n, f"L{n}") for n in range(2)]
    )
    assert cli(wire_uri, database, "run") == 0
    _as_a_person(wire_uri, database, lambda s: s.pop_last_message("c-p", user_id="u-1"))
    log_live(wire_uri, database, "c-p", "live-1", "LIVE", dual_write=True)
    roll_back(database, clear_messages=False)

    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-p", "live-2", "AFTER")  # writable
    texts = ["L0 question", "L0 answer", "L1 question", "LIVE?", "LIVE", "AFTER?", "AFTER"]
    stored = database[MESSAGES].find({"conversation_id": "c-p"}).sort("seq", 1)
    assert [(m["seq"], m["content"]) for m in stored] == list(enumerate(texts))
    [problem] = database[PROBLEMS].find({"conversation_id": "c-p"})
    assert problem["kind"] == "conversation_changed_since"
    assert "L1 answer" in json.dumps(problem["content"])
    capsys.readouterr()
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "conversation_changed_since" in capsys.readouterr().out
    assert cli(wire_uri, database, "finish", "--accept", "c-p", "--note", "in problems") == 0
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert database[MESSAGES].count_documents({"conversation_id": "c-p"}) == len(texts)


@pytest.mark.wire
def test_a_second_attempt_keeps_every_message_of_a_live_turn_poppable(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The second attempt rebuilds the records of the live turns from their messages (theirs
    went with the documents the rollback moved away): a pop marks the record popped and
    keeps it a record, so every message of those turns can be popped, each by a service's
    pop (was: the first pop wrote the fields the rebuilt record lacks as nulls, and the next
    one failed to read the record, a ValidationError, a 500 over HTTP)."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-q", 0, "L0"))
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-q", "live-1", "ONE", dual_write=True)
    log_live(wire_uri, database, "c-q", "live-2", "TWO", dual_write=True)
    roll_back(database, clear_messages=False)
    assert cli(wire_uri, database, "run") == 0

    popped: list[Any] = []

    async def pop(store: ConversationStore) -> None:
        popped.append(await store.pop_last_message("c-q", user_id="u-1"))

    for _ in range(4):
        _as_a_person(wire_uri, database, pop)  # a service's pop each, as over HTTP

    assert [m.content for m in popped] == ["TWO", "TWO?", "ONE", "ONE?"]
    stored = database[MESSAGES].find({"conversation_id": "c-q"}).sort("seq", 1)
    assert [m["content"] for m in stored] == ["L0 question", "L0 answer"]
    found = database[CONVERSATIONS].find_one({"_id": "c-q"})
    assert found is not None
    assert [TurnRecord.model_validate(r).popped for r in found["turns"]] == [True, True]
    flags = [(r["p"], r["g"], r["m"], r["u"]) for r in found["turns"]]
    assert flags == [(True, False, False, False)] * 2


@pytest.mark.wire
def test_finish_says_who_owns_a_conversation_of_several_users_as_stored(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Ada's migrated conversation, a live turn of hers, then a late legacy turn of Bob's the
    run does not merge (`conversation_changed_since`): it stays Ada's, and `finish` says so
    beside its `mixed_user_ids` problem, which names Bob as the owner of what the turns
    convert to only (was: "the last one, 'bob', owns it and every message of it")."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-x", 0, "ADA") | {"user_id": "ada"})
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-x", "live-1", "LIVE", dual_write=True, user_id="ada")
    database[CONVERSATIONS].insert_one(legacy_turn("t-late", "c-x", 2, "BOB") | {"user_id": "bob"})
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()

    assert cli(wire_uri, database, "finish") == 1
    out = capsys.readouterr().out

    stored = database[CONVERSATIONS].find_one({"_id": "c-x"})
    assert stored is not None
    assert stored["user_id"] == "ada"
    assert "as stored, 'ada' owns it" in out
    assert "'bob', owns it" not in out
    assert "the conversation they convert to is the last one's, 'bob'" in out


@pytest.mark.wire
def test_finish_waits_for_no_run_holding_the_lock_and_drops_nothing_while_one_runs(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A rerun in one terminal, `finish --drop-legacy --yes` in another: the gate would pass
    (the first run was complete), but a run that finds the legacy turns gone removes every
    conversation it migrated. `finish` holds the lock too, so the two never overlap."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run") == 0
    held = Lease(database, "run-in-another-terminal", timedelta(minutes=5))
    held.acquire()

    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 3

    assert "another migration run holds the lock" in capsys.readouterr().err
    assert relocate.holds_turns(database, LEGACY_TURNS)
    held.release()
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0


@pytest.mark.wire
def test_finish_and_verify_while_a_run_moves_turns_aside_exit_3_before_reading_anything(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A run holding the lock is moving the legacy turns aside in batches: part of them are
    in each collection. `finish` (with or without the drop) and `verify` say a run goes on
    (exit 3), not that an old-service writer logged turns after the move, and write
    nothing."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(4)]
    )
    held = Lease(database, "run-moving-turns", timedelta(minutes=5))
    held.acquire()
    moved = list(database[CONVERSATIONS].find({"_id": {"$in": ["t-0", "t-1"]}}))
    database[LEGACY_TURNS].insert_many(moved)
    database[CONVERSATIONS].delete_many({"_id": {"$in": ["t-0", "t-1"]}})
    before = digest(database)

    for command in (["finish"], ["finish", "--drop-legacy", "--yes"], ["verify"]):
        assert cli(wire_uri, database, *command) == 3, command
        said = capsys.readouterr()
        assert "another migration run holds the lock" in said.err
        assert "run-moving-turns" in said.err
        assert "old-service writer" not in said.out + said.err
    assert digest(database) == before
    assert lease.current(database)["run_id"] == "run-moving-turns"


@pytest.mark.wire
def test_finish_after_a_run_stopped_while_moving_turns_aside_names_the_stopped_run_too(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A run killed while it moved the legacy turns aside leaves part of them in each
    collection and no lock: `finish` says so, not only that an old-service writer may have
    logged them, and tells the operator to run the migration again."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(4)]
    )
    moved = list(database[CONVERSATIONS].find({"_id": {"$in": ["t-0", "t-1"]}}))
    database[LEGACY_TURNS].insert_many(moved)
    database[CONVERSATIONS].delete_many({"_id": {"$in": ["t-0", "t-1"]}})

    assert cli(wire_uri, database, "finish") == 1

    said = capsys.readouterr().out
    assert "a run stopped before it moved them all" in said
    assert "run the migration again" in said


@pytest.mark.wire
def test_a_run_whose_legacy_turns_vanish_under_it_removes_no_migrated_conversation(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The legacy collection dropped by hand (or by a `finish` that took a stalled run's
    expired lease) while a rerun goes through its batches: the run's last step must not take
    every migrated conversation for one no legacy turn makes any more."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run") == 0
    before = database[MESSAGES].count_documents({})
    batch = explode.Explosion.batch

    def legacy_dropped_after_the_first_batch(run: explode.Explosion, ids: list[Any]) -> None:
        batch(run, ids)
        database[LEGACY_TURNS].drop()

    monkeypatch.setattr(explode.Explosion, "batch", legacy_dropped_after_the_first_batch)

    assert cli(wire_uri, database, "run", "--batch-size", "1") != 0
    assert database[MESSAGES].count_documents({}) == before


def _migrated_and_dropped(wire_uri: str, database: Database[dict[str, Any]], count: int) -> None:
    """`count` one-turn conversations migrated, then `finish --drop-legacy`: the legacy turns
    dropped."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(count)]
    )
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0


@pytest.mark.wire
def test_a_run_after_the_legacy_turns_were_dropped_is_refused_and_removes_nothing(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A service still dual-writing after the drop brings one legacy turn back: a rerun then
    finds every other migrated conversation named by no legacy turn. After `finish` dropped
    the legacy turns, no run goes on."""
    _migrated_and_dropped(wire_uri, database, 3)
    before = database[MESSAGES].count_documents({})
    database[LEGACY_TURNS].insert_one(legacy_turn("t-late", "c-0", 9, "late"))

    assert cli(wire_uri, database, "run") == 2
    assert cli(wire_uri, database, "run", "--dry-run") == 2
    assert database[MESSAGES].count_documents({}) == before


@pytest.mark.wire
def test_a_run_that_lost_its_lock_during_its_last_step_removes_nothing_more(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its lease ran out during the last step (a long one, a paused process): `finish` took
    the lock and dropped the legacy turns. The run checks its lock before each removal."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run") == 0
    before = database[MESSAGES].count_documents({})
    chunks = abandoned.chunks

    def finish_meanwhile(db: Database[dict[str, Any]], **kwargs: Any) -> Any:
        Lease(database, "finish-elsewhere").acquire(force=True)
        database[LEGACY_TURNS].drop()
        return chunks(db, **kwargs)

    monkeypatch.setattr(abandoned, "chunks", finish_meanwhile)

    assert cli(wire_uri, database, "run") == 3
    assert database[MESSAGES].count_documents({}) == before


def _as_a_person(
    wire_uri: str,
    database: Database[dict[str, Any]],
    act: Callable[[ConversationStore], Coroutine[Any, Any, Any]],
    *,
    dual_write: bool = False,
) -> None:
    """What a person does through the store (the service), the read fallback on, and the
    dual write if asked."""

    async def go() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            db = client[database.name]
            legacy = LegacyTurns(db, read_fallback=True, dual_write=dual_write)
            await act(ConversationStore(db, legacy=legacy))
        finally:
            await client.close()

    asyncio.run(go())


def _paused_before(
    monkeypatch: pytest.MonkeyPatch,
    database: Database[dict[str, Any]],
    seam: tuple[Any, str],
    meanwhile: Callable[[], None],
) -> None:
    """The run stops right before its first call of `seam` (a suspended VM, ^Z): its lease
    ends, and `meanwhile` happens."""
    original = getattr(*seam)
    paused: list[bool] = []

    def pause(*args: Any, **kwargs: Any) -> Any:
        if not paused:
            paused.append(True)
            ended = {"$set": {"expires_at": datetime.now(UTC) - timedelta(seconds=1)}}
            database[lease.STATE].update_one({"_id": lease.LOCK_ID}, ended)
            meanwhile()
        return original(*args, **kwargs)

    monkeypatch.setattr(*seam, pause)


def _hitl_turn(turn_id: str, cid: str, hour: int) -> dict[str, Any]:
    prompt = {"type": "hitl", "action": "pay", "params": {}, "request_id": "r-1", "prompt": "?"}
    return legacy_turn(turn_id, cid, hour, "H") | {"response_parts": [prompt]}


@pytest.mark.wire
def test_a_run_paused_after_planning_past_its_lease_brings_back_nothing_deleted_or_dropped(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paused between planning a batch and writing it, its lease ended: another run and
    `finish` went through, a person deleted a conversation, `finish --drop-legacy` dropped
    the legacy turns. Continued, the run writes nothing it planned: it proves its lease
    right before writing a batch."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(3)]
        + [legacy_turn("t-secret", "c-secret", 4, "SECRET") | {"user_id": "u-2"}]
    )

    def meanwhile() -> None:
        assert cli(wire_uri, database, "run") == 0
        assert cli(wire_uri, database, "finish") == 0
        _as_a_person(wire_uri, database, lambda s: s.delete("c-secret", user_id="u-2"))
        assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0

    _paused_before(monkeypatch, database, (writes, "apply"), meanwhile)

    assert cli(wire_uri, database, "run") == 3

    assert database[CONVERSATIONS].find_one({"_id": "c-secret"}) is None
    assert database[MESSAGES].count_documents({"conversation_id": "c-secret"}) == 0
    assert database[PROBLEMS].count_documents({"conversation_id": "c-secret"}) == 0
    state = database[lease.STATE].find_one({"_id": lease.STATE_ID}) or {}
    assert state.get("complete") is True


def _a_name_and_a_prompt(database: Database[dict[str, Any]]) -> None:
    """Legacy c-a (named after its text) and c-b, with a pending prompt r-1."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-a", "c-a", 0, "A"), _hitl_turn("t-b", "c-b", 1)]
    )
    database[SESSION_HITL].insert_one(
        {"conversation_id": "c-b", "request_id": "r-1", "action": "pay", "status": "pending"}
    )


def _a_person_renames_and_resolves(wire_uri: str, database: Database[dict[str, Any]]) -> None:
    _as_a_person(wire_uri, database, lambda s: s.rename("c-a", "Mine", user_id="u-1"))
    _as_a_person(wire_uri, database, lambda s: s.resolve_hitl("c-b", "r-1", user_id="u-1"))


def _the_persons_changes_stand(database: Database[dict[str, Any]]) -> None:
    assert (database[CONVERSATIONS].find_one({"_id": "c-a"}) or {}).get("name") == "Mine"
    assert (database[CONVERSATIONS].find_one({"_id": "c-b"}) or {}).get("pending_hitl") is None


@pytest.mark.wire
def test_a_run_paused_after_planning_past_its_lease_keeps_a_rename_and_a_resolved_prompt(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    _a_name_and_a_prompt(database)

    def meanwhile() -> None:
        assert cli(wire_uri, database, "run") == 0
        _a_person_renames_and_resolves(wire_uri, database)

    _paused_before(monkeypatch, database, (writes, "apply"), meanwhile)

    assert cli(wire_uri, database, "run") == 3

    _the_persons_changes_stand(database)
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_run_paused_between_proving_its_lease_and_writing_overwrites_no_newer_state(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window a renewal right before the writes leaves: its writes are conditional. A
    conversation document is replaced only while it is the one the run read, and the
    checkpoint is written only while the lock names the run."""
    _a_name_and_a_prompt(database)
    assert cli(wire_uri, database, "run") == 0
    # Edited after the run: the next run rewrites both documents.
    database[LEGACY_TURNS].update_many({}, {"$set": {"name": "Edited"}})

    def meanwhile() -> None:
        assert cli(wire_uri, database, "run") == 0
        _a_person_renames_and_resolves(wire_uri, database)

    _paused_before(monkeypatch, database, (full_texts, "keep"), meanwhile)

    assert cli(wire_uri, database, "run") == 3

    _the_persons_changes_stand(database)
    state = database[lease.STATE].find_one({"_id": lease.STATE_ID}) or {}
    assert state.get("complete") is True
    assert cli(wire_uri, database, "finish") == 0


def _run_as_predicted(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    said: list[dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """c-a holding `said` as its history and c-b plain, run one batch each after a dry run:
    the run says what the dry run predicted and goes on to c-b. The summary, and c-a's one
    problem record."""
    database[CONVERSATIONS].insert_many(
        [
            legacy_turn("t-a", "c-a", 0, "A") | {"message_history_json": json.dumps(said)},
            legacy_turn("t-b", "c-b", 1, "B"),
        ]
    )
    assert cli(wire_uri, database, "run", "--dry-run", "--batch-size", "1") == 0
    predicted = summary(capsys.readouterr().out)

    assert cli(wire_uri, database, "run", "--batch-size", "1") == 0

    assert summary(capsys.readouterr().out) == predicted
    assert database[MESSAGES].count_documents({"conversation_id": "c-b"}) == 2
    [kept] = database[PROBLEMS].find({"conversation_id": "c-a"})
    return predicted, kept


@pytest.mark.wire
def test_a_history_text_escaping_a_lone_surrogate_is_kept_and_the_dry_run_says_so(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """JSON text may escape a lone surrogate (`"\\ud800"`), which no BSON text holds: the
    history part is kept in its problem as that JSON text, the run goes on to every batch,
    and the dry run predicted it."""
    said = [
        {"kind": "request", "parts": [{"part_kind": "user-prompt", "content": "A question"}]},
        {"kind": "response", "parts": [{"part_kind": "text", "content": "«lone \ud800»"}]},
    ]
    predicted, kept = _run_as_predicted(wire_uri, database, capsys, said)

    assert predicted["problems"] == 1
    assert json.loads(kept["content"]) == said[1]["parts"][0]
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_finish_and_verify_after_the_drop_say_so_and_never_advise_a_run(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A service still dual-writing after the drop brings a legacy turn back: the gate would
    find every other migrated conversation named by no legacy turn, and advise the run that
    would remove them. After `finish --drop-legacy`, `finish` and `verify` say when the
    legacy turns were dropped, as `run` does (exit 2)."""
    _migrated_and_dropped(wire_uri, database, 3)
    database[LEGACY_TURNS].insert_one(legacy_turn("t-late", "c-0", 9, "late"))
    capsys.readouterr()

    assert cli(wire_uri, database, "finish") == 2
    assert cli(wire_uri, database, "verify") == 2

    said = capsys.readouterr()
    assert said.err.count("dropped the legacy turns at") == 2
    assert "again" not in said.out + said.err.replace("to run again", "")
    assert cli(wire_uri, database, "status") == 0
    assert "dropped the legacy turns at" in capsys.readouterr().out


@pytest.mark.wire
def test_after_the_drop_every_command_says_what_the_legacy_collection_holds_as_it_is(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """After `finish --drop-legacy`, `run`, `verify`, `finish` and `status` say what the
    legacy collection holds as it is: empty when nothing was dual-written since, else how
    many documents, and how many of them a service still dual-writing made; never a guess."""
    _migrated_and_dropped(wire_uri, database, 2)
    capsys.readouterr()

    def said() -> list[str]:
        for command in ("run", "verify", "finish"):
            assert cli(wire_uri, database, command) == 2, command
        assert cli(wire_uri, database, "status") == 0
        out = capsys.readouterr()
        return [out.err, out.out]

    err, status = said()
    assert err.count(f"{LEGACY_TURNS} is empty") == 3
    assert f"{LEGACY_TURNS} is empty" in status
    assert "dual-writing made" not in err + status
    assert "AGENT_STORE_LEGACY_DUAL_WRITE" not in err + status

    copy = legacy_turn("t-copy", "c-0", 9, "COPY") | {"dual_write": True, "turn_id": "turn-9"}
    database[LEGACY_TURNS].insert_one(copy)
    err, status = said()
    held = f"{LEGACY_TURNS} holds 1 document: a copy a service still dual-writing made"
    assert err.count(held) == 3
    assert held in status.replace("\n", " ")
    assert "Unset AGENT_STORE_LEGACY_DUAL_WRITE" in err


@pytest.mark.wire
def test_a_legacy_turn_an_old_writer_logs_after_the_drop_gets_one_instruction_from_every_command(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """An old-service writer never stopped logs a legacy turn into `agent_conversations`
    after `finish --drop-legacy`: its content is in no new collection, and no run can
    migrate it now. `run`, `verify` and `finish` all exit 2 with one message naming what was
    found (the turn logged after the drop, its conversation) and what to do with it, and
    `status` says the same; none advises a run, or says only dual-write copies remain."""
    _migrated_and_dropped(wire_uri, database, 2)
    database[CONVERSATIONS].insert_one(legacy_turn("t-late", "c-0", 9, "LATE"))
    capsys.readouterr()

    said = []
    for command in ("finish", "run", "verify"):
        assert cli(wire_uri, database, command) == 2, command
        out = capsys.readouterr()
        said.append(out.err + out.out)
    assert cli(wire_uri, database, "status") == 0
    status = capsys.readouterr().out

    [message] = {s.strip() for s in said}
    assert "1 legacy turns an old-service writer logged after the drop" in message
    assert "c-0" in message
    assert "dual-writing made" not in message
    assert message.removeprefix("error: ") in status.replace("\n", " ")
    assert "nothing is left to migrate" not in status
    assert database[CONVERSATIONS].find_one({"_id": "t-late"}) is not None


@pytest.mark.wire
def test_the_advice_after_the_drop_names_the_backup_to_restore_and_what_no_run_can_tell(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """After the drop a late legacy turn asks for the dropped turns back. The store keeps no
    record of a delete or an erasure once done, so a run after the restore cannot tell a
    restored turn a delete took from the others: the advice names the one backup that holds
    no such turn, `agent_conversations_deprecated` as it stood right before the drop, never
    the runbook's "Before" backup, and says to leave out the turns of every conversation
    deleted, and every user erased, since it was taken (was: "restore the dropped legacy
    turns from a backup": the "Before" one, restored, brought back a conversation its owner
    deleted and an erased user's, served again, `finish` exit 0)."""
    _migrated_and_dropped(wire_uri, database, 2)
    database[CONVERSATIONS].insert_one(legacy_turn("t-late", "c-0", 9, "LATE"))
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 2
    said = " ".join(capsys.readouterr().err.split())
    assert f"a backup of {LEGACY_TURNS} taken right before the drop" in said
    assert 'never the "Before" backup' in said
    assert "keeps no record of a delete or an erasure" in said
    assert "leave out the turns of every conversation deleted" in said


@pytest.mark.wire
def test_finish_counts_as_migrated_only_the_legacy_conversations_that_are(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A conversation no legacy turn makes any more is work left, but no legacy conversation:
    it is not taken off the migrated ones (never a negative count)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run") == 0
    database[LEGACY_TURNS].delete_one({"_id": "t-0"})
    capsys.readouterr()

    assert cli(wire_uri, database, "finish") == 1

    out = capsys.readouterr().out
    assert "checked 2 legacy conversations: 2 migrated" in out
    assert "c-0: " in out


def _between_plan_and_writes(
    monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[], None]
) -> None:
    """`meanwhile` happens once, after the run planned a batch and before its writes (a slow
    plan, a busy server: no pause, the lease still held)."""
    apply = writes.apply
    done: list[bool] = []

    def racing(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            meanwhile()
        return apply(*args, **kwargs)

    monkeypatch.setattr(writes, "apply", racing)


def _live_turn(wire_uri: str, database: Database[dict[str, Any]], cid: str, n: int) -> Any:
    async def go() -> Any:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            db = client[database.name]
            logger = AgentMessageLogger(db, observers=[LegacyTurns(db, dual_write=True)])
            said = [
                {"role": "user", "content": f"live question {n}"},
                {"role": "assistant", "content": f"live answer {n}"},
            ]
            return await logger.log_messages(cid, said, user_id="u-1", turn_id=f"live-{n}")
        finally:
            await client.close()

    return asyncio.run(go())


@pytest.mark.wire
@pytest.mark.parametrize("how", ["delete", "erase_user"])
def test_a_rerun_writes_no_message_of_a_conversation_deleted_after_it_planned(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A run killed between a batch's conversation documents and its messages; the rerun
    plans the missing messages, then the person deletes the conversation (or is erased)
    before its writes. The conversation's document is gone: none of its messages is written,
    nothing serves it, and `finish` passes on what is left."""
    database[CONVERSATIONS].insert_many(
        [
            legacy_turn("t-1", "c-1", 0, "SECRET"),
            legacy_turn("t-2", "c-2", 1, "Kept") | {"user_id": "u-2"},
        ]
    )
    assert cli(wire_uri, database, "run") == 0
    database[MESSAGES].delete_many({"conversation_id": "c-1"})  # killed before its messages

    def person() -> None:
        if how == "delete":
            _as_a_person(wire_uri, database, lambda s: s.delete("c-1", user_id="u-1"))
        else:
            _as_a_person(wire_uri, database, lambda s: s.erase_user("u-1"))

    _between_plan_and_writes(monkeypatch, person)

    assert cli(wire_uri, database, "run") == 0

    assert database[CONVERSATIONS].find_one({"_id": "c-1"}) is None
    assert database[MESSAGES].count_documents({"conversation_id": "c-1"}) == 0
    assert database[PROBLEMS].count_documents({"conversation_id": "c-1"}) == 0
    assert database[MESSAGES].count_documents({"conversation_id": "c-2"}) == 2
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_live_turn_between_a_runs_plan_and_its_writes_keeps_its_conversation_whole(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live turn starts an unmigrated conversation after the run planned it: the
    conversation is the live one's, none of the legacy messages goes in between its turns,
    it is reported `conversation_already_live`, and the next live turn goes on."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"Legacy {n}") for n in range(3)]
    )
    _between_plan_and_writes(monkeypatch, lambda: _live_turn(wire_uri, database, "c-1", 1))

    assert cli(wire_uri, database, "run") == 0

    stored = database[MESSAGES].find({"conversation_id": "c-1"}).sort("seq", 1)
    assert [m["turn_id"] for m in stored] == ["live-1", "live-1"]
    [live] = database[PROBLEMS].find({"conversation_id": "c-1"})
    assert live["kind"] == "conversation_already_live"
    assert [m.seq for m in _live_turn(wire_uri, database, "c-1", 2).messages] == [2, 3]
    assert cli(wire_uri, database, "finish") == 1


@pytest.mark.wire
def test_finish_counts_migrated_messages_without_their_conversation_as_work_left(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Messages of legacy turns whose conversation document is gone, as are the legacy turns
    (a run that wrote them after a person deleted the conversation): served by no
    conversation, but by search and a new turn's `seq`. `finish` names them, and a run that
    goes through every conversation removes them."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "SECRET"), legacy_turn("t-2", "c-2", 1, "Kept")]
    )
    assert cli(wire_uri, database, "run") == 0
    database[CONVERSATIONS].delete_one({"_id": "c-1"})
    database[LEGACY_TURNS].delete_one({"_id": "t-1"})
    capsys.readouterr()

    assert cli(wire_uri, database, "finish") == 1
    assert "c-1: " in capsys.readouterr().out

    assert cli(wire_uri, database, "run") == 0
    assert database[MESSAGES].count_documents({"conversation_id": "c-1"}) == 0
    assert database[MESSAGES].count_documents({"conversation_id": "c-2"}) == 2
    assert cli(wire_uri, database, "finish") == 0


def _killed_at_the_first_message_insert(
    monkeypatch: pytest.MonkeyPatch, meanwhile: Callable[[], None]
) -> None:
    """`meanwhile` happens, then the run dies, as it is about to insert its first messages:
    after a batch's conversation documents (and whole texts), before any of its messages."""
    insert_many = Collection.insert_many

    def killed(self: Collection[Any], *args: Any, **kwargs: Any) -> Any:
        if self.name == MESSAGES:
            meanwhile()
            raise KeyboardInterrupt
        return insert_many(self, *args, **kwargs)

    monkeypatch.setattr(Collection, "insert_many", killed)


@pytest.mark.wire
def test_a_first_runs_document_of_a_conversation_deleted_before_its_messages_is_removed(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A first run inserts a conversation's document; a person's delete, whose lookup found
    no document yet, takes its legacy turns after the run last looked for them, and the run
    is killed before its messages. The document the migration wrote, with no message and
    named by no legacy turn, is work left for `finish`; the next run removes it and its whole
    texts; the person starting the conversation again starts it afresh."""
    big = [{"type": "text", "content": "x" * 1_200_000 + "«SECRET END»"}]
    database[CONVERSATIONS].insert_many(
        [
            legacy_turn("t-1", "c-1", 0, "SECRET") | {"response_parts": big},
            legacy_turn("t-2", "c-2", 1, "Kept") | {"user_id": "u-2"},
        ]
    )

    def delete_found_no_document() -> None:
        database[LEGACY_TURNS].delete_many({"conversation_id": "c-1"})

    _killed_at_the_first_message_insert(monkeypatch, delete_found_no_document)
    assert cli(wire_uri, database, "run") == 130
    monkeypatch.undo()
    assert database[CONVERSATIONS].find_one({"_id": "c-1"}) is not None  # as the kill left it
    capsys.readouterr()

    assert cli(wire_uri, database, "finish") == 1
    assert "c-1: " in capsys.readouterr().out

    assert cli(wire_uri, database, "run") == 0

    assert database[CONVERSATIONS].find_one({"_id": "c-1"}) is None
    assert "SECRET" not in "\n".join(gridfs_texts(database))
    assert database[MESSAGES].count_documents({"conversation_id": "c-2"}) == 2
    assert cli(wire_uri, database, "finish") == 0
    assert [m.seq for m in _live_turn(wire_uri, database, "c-1", 1).messages] == [0, 1]


@pytest.mark.wire
def test_a_persons_named_empty_conversation_is_left_as_it_is(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A conversation a person created and named, with no message yet and no legacy turn:
    neither work left for `finish` nor removed by a run."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "Legacy"))

    async def create() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            db = client[database.name]
            logger = AgentMessageLogger(db, legacy=LegacyTurns(db, read_fallback=True))
            await logger.upsert_conversation("c-9", user_id="u-1", name="Mine")
        finally:
            await client.close()

    asyncio.run(create())
    before = database[CONVERSATIONS].find_one({"_id": "c-9"})

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 0

    assert database[CONVERSATIONS].find_one({"_id": "c-9"}) == before


@pytest.mark.wire
@pytest.mark.parametrize("drop", [True, False], ids=["dropped", "kept"])
def test_a_copy_paused_past_its_lease_moves_nothing_it_read_before_the_pause(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, drop: bool
) -> None:
    """Paused inside the move aside, a copy batch read: another run moved and migrated every
    turn, a person deleted a conversation, `finish --drop-legacy` perhaps dropped the legacy
    turns. Continued, the run copies nothing it read: it proves its lease before each copy
    batch, as before a batch's writes."""
    database.create_collection(LEGACY_TURNS)  # an interrupted copy: the turns are copied
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(3)]
    )

    def meanwhile() -> None:
        assert cli(wire_uri, database, "run") == 0
        _as_a_person(wire_uri, database, lambda s: s.delete("c-1", user_id="u-1"))
        if drop:
            assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0

    _paused_before(monkeypatch, database, (relocate, "_copy_batch"), meanwhile)

    assert cli(wire_uri, database, "run") == 3

    assert (LEGACY_TURNS in database.list_collection_names()) is not drop
    assert database[LEGACY_TURNS].count_documents({"conversation_id": "c-1"}) == 0
    assert database[CONVERSATIONS].find_one({"_id": "c-1"}) is None
    assert database[MESSAGES].count_documents({"conversation_id": "c-1"}) == 0


def _late_turns_of_a_migrated_conversation(
    wire_uri: str, database: Database[dict[str, Any]]
) -> int:
    """Ada's conversation c-x migrated, then four turns the old service logged under it into
    `agent_conversations` after the move (one naming no user, hers as its owner): how many
    legacy turns are hers."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-x", 0, "Legacy") | {"user_id": "ada"})
    assert cli(wire_uri, database, "run") == 0
    late = [
        legacy_turn(f"late-{n}", "c-x", 1 + n, f"Late {n}") | {"user_id": "ada"} for n in range(4)
    ]
    del late[0]["user_id"]
    database[CONVERSATIONS].insert_many(late)
    return 1 + len(late)


def _meanwhile_at(
    monkeypatch: pytest.MonkeyPatch, step: str, meanwhile: Callable[[], None]
) -> None:
    """`meanwhile` happens once, in the first copy batch of the move aside, at `step`: before
    the batch's writes (after its read), or once the copy read which of its turns the source
    still holds (before it deletes them there)."""
    seam = "_copy_batch" if step == "before-the-insert" else "_still_in_source"
    original = getattr(relocate, seam)
    done: list[bool] = []

    def at_the_step(*args: Any, **kwargs: Any) -> Any:
        if step == "before-the-insert" and not done:
            done.append(True)
            meanwhile()
        result = original(*args, **kwargs)
        if step == "after-the-check" and not done:
            done.append(True)
            meanwhile()
        return result

    monkeypatch.setattr(relocate, seam, at_the_step)


@pytest.mark.wire
@pytest.mark.parametrize("step", ["before-the-insert", "after-the-check"])
@pytest.mark.parametrize("forget", ["delete", "erase"])
def test_a_delete_or_erasure_while_a_run_moves_late_turns_aside_brings_none_back(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    step: str,
    forget: str,
) -> None:
    """Ada deletes her conversation, or is erased, while a run moves the late turns the old
    service logged under it aside, after the run read them: no copy of them is left in the
    legacy collection, the next run brings nothing of the conversation back, and each of her
    turns is counted once in `legacy_turns`."""
    hers = _late_turns_of_a_migrated_conversation(wire_uri, database)
    counted: list[int] = []

    async def forgotten(store: ConversationStore) -> None:
        if forget == "delete":
            counted.append((await store.delete("c-x", user_id="ada")).legacy_turns)
        else:
            counted.append((await store.erase_user("ada")).legacy_turns)

    _meanwhile_at(monkeypatch, step, lambda: _as_a_person(wire_uri, database, forgotten))
    assert cli(wire_uri, database, "run") == 0
    monkeypatch.undo()

    assert counted == [hers]
    assert database[LEGACY_TURNS].count_documents({}) == 0
    assert database[CONVERSATIONS].count_documents({}) == 0
    assert cli(wire_uri, database, "run") == 0
    assert database[CONVERSATIONS].find_one({"_id": "c-x"}) is None
    assert database[MESSAGES].count_documents({}) == 0


@pytest.mark.wire
def test_a_copy_killed_after_its_insert_drops_the_copies_of_turns_deleted_before_it_resumed(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A copy killed once its batch stands in both collections, before it checked which turns
    the source still holds; the owner deletes her conversation meanwhile (its late turns go
    from `agent_conversations`, the copies were not there yet when her delete looked). The
    resumed run takes the copies back: nothing of the conversation comes back."""
    _late_turns_of_a_migrated_conversation(wire_uri, database)
    late = list(database[CONVERSATIONS].find(relocate.TURN_FILTER))
    _as_a_person(wire_uri, database, lambda s: s.delete("c-x", user_id="ada"))
    killed_copy(database, *late)  # read before the delete, inserted after its look

    assert cli(wire_uri, database, "run") == 0
    assert database[LEGACY_TURNS].count_documents({}) == 0
    assert database[CONVERSATIONS].find_one({"_id": "c-x"}) is None
    state = database[lease.STATE].find_one({"_id": lease.STATE_ID}) or {}
    assert not state.get(relocate.IN_FLIGHT)


@pytest.mark.wire
def test_a_history_part_kind_escaping_a_lone_surrogate_is_kept_and_the_run_goes_on(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Every text of a problem is held as BSON holds it, not its content only: a part kind
    escaping a lone surrogate, named in the problem's detail, is written as its escape."""
    said = [{"kind": "response", "parts": [{"part_kind": "\ud800odd", "content": "«keep me»"}]}]
    _, kept = _run_as_predicted(wire_uri, database, capsys, said)

    assert "\\ud800odd" in kept["detail"]
    assert "«keep me»" in json.dumps(kept["content"], ensure_ascii=False)
    assert cli(wire_uri, database, "finish", "--accept", "c-a", "--note", "kept") == 0


@pytest.mark.wire
def test_finish_renews_its_lease_while_its_gate_reads_so_no_run_takes_the_lock(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gate longer than the lease (a large corpus): `finish` renews its lease as it goes,
    as a run does per batch, so a run started meanwhile finds the lock alive and stops,
    and `finish` ends as it would."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run") == 0
    convert_batch = gate.convert_batch
    unread_documents = gate.unread_documents
    taken: list[bool] = []

    def long_batch(*args: Any, **kwargs: Any) -> Any:
        ended = {"$set": {"expires_at": datetime.now(UTC) - timedelta(seconds=1)}}
        database[lease.STATE].update_one({"_id": lease.LOCK_ID}, ended)
        return convert_batch(*args, **kwargs)

    def a_run_starts(db: Database[dict[str, Any]]) -> Any:
        try:
            Lease(database, "run-started-during-the-gate").acquire()
            taken.append(True)
        except LockHeld:
            taken.append(False)
        return unread_documents(db)

    monkeypatch.setattr(gate, "convert_batch", long_batch)
    monkeypatch.setattr(gate, "unread_documents", a_run_starts)

    assert cli(wire_uri, database, "finish") == 0
    assert taken == [False]


@pytest.mark.wire
def test_a_drop_stopped_before_it_dropped_is_finished_by_finish_drop_legacy_again(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`finish --drop-legacy --yes` stopped between recording the drop and making it: no run
    or `verify` goes on (the drop was decided), and `finish --drop-legacy --yes` again
    finishes it, the messages as they were."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run") == 0
    messages = stored_messages(database)

    def stopped(self: Any) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(Collection, "drop", stopped)
        assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 130
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 2
    assert cli(wire_uri, database, "finish") == 2
    assert "finish --drop-legacy --yes" in capsys.readouterr().err
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0

    assert LEGACY_TURNS not in database.list_collection_names()
    assert stored_messages(database) == messages
    assert cli(wire_uri, database, "run") == 2


@pytest.mark.wire
def test_a_run_paused_before_recording_orphan_prompts_records_none_after_the_drop(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paused in its last step, before recording the prompts no conversation takes: another
    run, `finish --drop-legacy`. Continued, the run records no prompt as taken by none (with
    the legacy turns gone, every prompt would look so): it proves its lease before each
    chunk it records."""
    database[CONVERSATIONS].insert_many([_hitl_turn("t-b", "c-b", 1)])
    database[SESSION_HITL].insert_one(
        {"conversation_id": "c-b", "request_id": "r-1", "action": "pay", "status": "pending"}
    )

    def meanwhile() -> None:
        assert cli(wire_uri, database, "run") == 0
        assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0

    _paused_before(monkeypatch, database, (orphan_prompts, "record"), meanwhile)

    assert cli(wire_uri, database, "run") == 3

    assert database[PROBLEMS].count_documents({"kind": "orphan_pending_hitl"}) == 0


# -- stored and planned values are compared as BSON stores them -----------------------------


def hitl_message(amount: Any) -> AgentMessage:
    return message_adapter.validate_python(
        {"_id": "m-1", "conversation_id": "c-h", "seq": 0, "role": "assistant",
         "created_at": datetime(2024, 1, 1, tzinfo=UTC),
         "hitl_action": {"action": "refund", "params": {"amount": amount}, "request_id": "r-1"}}
    )  # fmt: skip


def pending_conversation(amount: Any) -> Conversation:
    at = datetime(2024, 1, 1, tzinfo=UTC)
    pending = {"request_id": "r-1", "action": "refund", "params": {"amount": [amount]},
               "message_id": "m-1", "created_at": at}  # fmt: skip
    return Conversation.model_validate(
        {"_id": "c-h", "conversation_id": "c-h", "created_at": at, "updated_at": at,
         "pending_hitl": pending}
    )  # fmt: skip


@pytest.mark.parametrize(
    ("stored", "planned", "differ"),
    [
        pytest.param(float("nan"), float("nan"), False, id="nan"),
        pytest.param(0.5, 0.5, False, id="equal-doubles"),
        pytest.param(-0.0, 0.0, True, id="negative-zero"),
        pytest.param(120, 120.0, True, id="int-and-double"),
        pytest.param(True, 1, True, id="bool-and-int"),
    ],
)
def test_a_stored_value_differs_from_the_planned_one_exactly_when_bson_tells_them_apart(
    stored: Any, planned: Any, differ: bool
) -> None:
    """Python's `==` finds a NaN unequal to itself (a rerun would rewrite it forever and the
    gate never pass), and `0.0` equal to `-0.0`, `120` to `120.0`, `True` to `1`, which BSON
    stores apart: the comparisons of a rerun and of the gate go by what BSON stores."""
    assert writes.differs(hitl_message(stored), hitl_message(planned)) is differ
    document = pending_conversation(stored).model_dump(by_alias=True)
    assert writes.document_differs(document, pending_conversation(planned)) is differ


@pytest.mark.wire
def test_a_nan_in_legacy_hitl_params_is_migrated_once_and_passes_the_gate(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    params = {"amount": float("nan"), "order": "A-1"}
    database[CONVERSATIONS].insert_one(
        legacy_turn("t-h", "c-h", 0, "H")
        | {"response_parts": [{"type": "hitl", "action": "refund", "params": params,
                               "request_id": "r-1", "prompt": "Refund?"}]}
    )  # fmt: skip
    database[SESSION_HITL].insert_one(
        {"conversation_id": "c-h", "request_id": "r-1", "action": "refund", "params": params,
         "status": "pending", "prompt": "Refund?"}
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()

    assert cli(wire_uri, database, "run", "--restart") == 0

    out = capsys.readouterr().out
    assert "; 0 messages written, 0 conversation documents written" in out
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0


# -- a person's pops of migrated messages, and a delete racing a first run ----------------


def _pop(wire_uri: str, database: Database[dict[str, Any]], cid: str, times: int) -> list[Any]:
    """A person pops the last message of the conversation `times` times (the API's pop)."""
    popped: list[Any] = []

    async def pops(store: ConversationStore) -> None:
        for _ in range(times):
            popped.append((await store.pop_last_message(cid, user_id="u-1")).content)

    _as_a_person(wire_uri, database, pops)
    return popped


def _contents_of(database: Database[dict[str, Any]], cid: str) -> list[Any]:
    stored = database[MESSAGES].find({"conversation_id": cid}, sort=[("seq", 1)])
    return [m.get("content") for m in stored]


@pytest.mark.wire
def test_a_persons_pop_of_migrated_messages_stays_popped_through_reruns_and_the_gate(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """After the migration a person pops the last turn of a migrated conversation: a change
    the person made. `verify` and `finish` pass it (what a person changed since stays
    theirs), and a rerun puts no popped message back nor forgets the pops."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "First"), legacy_turn("t-2", "c-1", 1, "«REGRETTED»")]
    )
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert _pop(wire_uri, database, "c-1", 2) == ["«REGRETTED» answer", "«REGRETTED» question"]
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert cli(wire_uri, database, "run") == 0

    assert _contents_of(database, "c-1") == ["First question", "First answer"]
    document = database[CONVERSATIONS].find_one({"_id": "c-1"}) or {}
    assert (document["pops"], document["message_count"], document["turn_count"]) == (2, 2, 1)
    assert "REGRETTED" not in capsys.readouterr().out
    assert cli(wire_uri, database, "finish") == 0
    assert database[PROBLEMS].count_documents({"conversation_id": "c-1"}) == 0


@pytest.mark.wire
def test_a_turn_logged_after_a_pop_of_a_migrated_answer_is_the_persons_not_already_live(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The common regenerate: pop the migrated answer, log a new turn. The new turn was
    logged after the migration, in the place the person freed: no `conversation_already_live`
    problem, the rerun merges nothing in between, and `finish` passes."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "First"), legacy_turn("t-2", "c-1", 1, "Second")]
    )
    assert cli(wire_uri, database, "run") == 0
    assert _pop(wire_uri, database, "c-1", 1) == ["Second answer"]
    _live_turn(wire_uri, database, "c-1", 1)

    assert cli(wire_uri, database, "run") == 0

    assert _contents_of(database, "c-1") == [
        "First question", "First answer", "Second question", "live question 1", "live answer 1"
    ]  # fmt: skip
    assert database[PROBLEMS].count_documents({"conversation_id": "c-1"}) == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


def _stored_seqs(database: Database[dict[str, Any]], cid: str) -> list[int]:
    stored = database[MESSAGES].find({"conversation_id": cid}, sort=[("seq", 1)])
    return [int(m["seq"]) for m in stored]


def _the_person_goes_on(wire_uri: str, database: Database[dict[str, Any]], cid: str) -> None:
    """The person's next two turns are stored, each right after the last (no `seq` taken)."""
    count = (database[CONVERSATIONS].find_one({"_id": cid}) or {})["message_count"]
    for n in range(2):
        turn = _live_turn(wire_uri, database, cid, n)
        assert [m.seq for m in turn.messages] == [count + 2 * n, count + 2 * n + 1]


def _changed_since_is_accepted(
    wire_uri: str, database: Database[dict[str, Any]], cid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`finish` names the conversation as changed by a person since the migration, with its
    legacy turns changed since, until an operator accepts it; then it passes."""
    [problem] = database[PROBLEMS].find({"conversation_id": cid})
    assert (problem["kind"], problem["placed"]) == ("conversation_changed_since", False)
    capsys.readouterr()
    assert cli(wire_uri, database, "finish") == 1
    out = capsys.readouterr().out
    assert "changed by a person since the migration" in out
    assert "missing" not in out
    assert cli(wire_uri, database, "finish", "--accept", cid, "--note", "kept") == 0


@pytest.mark.wire
def test_a_rerun_writes_no_message_past_the_count_of_a_conversation_a_person_popped_from(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A rolling upgrade: the person pops a migrated answer while the old service files one
    more legacy turn. The conversation is the person's: the rerun writes nothing past its
    document's count (the person's next turn goes there), the legacy turn added since is
    not merged but kept in a problem, and `finish` fails until an operator accepts it."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"Q{n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run") == 0
    assert _pop(wire_uri, database, "c-1", 1) == ["Q2 answer"]
    database[LEGACY_TURNS].insert_one(legacy_turn("t-3", "c-1", 10, "Via the old service"))

    assert cli(wire_uri, database, "run") == 0

    assert _stored_seqs(database, "c-1") == [0, 1, 2, 3, 4]
    _changed_since_is_accepted(wire_uri, database, "c-1", capsys)
    _the_person_goes_on(wire_uri, database, "c-1")


@pytest.mark.wire
def test_a_legacy_edit_after_a_pop_moves_no_message_of_the_persons_conversation(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A legacy turn edited after the person popped a migrated answer converts to more
    messages: the rerun would have to move the migration's messages past the document's
    count. It moves none and writes none: the edit is kept in a problem, for the operator."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"Q{n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run") == 0
    assert _pop(wire_uri, database, "c-1", 1) == ["Q2 answer"]
    before = stored_messages(database)
    database[LEGACY_TURNS].update_one(
        {"_id": "t-0"},
        {"$push": {"response_parts": {"$each": [
            {"type": "tool_call", "tool_name": "search", "tool_call_id": "c1", "args": {}},
            {"type": "tool_result", "tool_name": "search", "tool_call_id": "c1",
             "content": "found"},
        ]}}},
    )  # fmt: skip

    assert cli(wire_uri, database, "run") == 0

    assert stored_messages(database) == before
    _changed_since_is_accepted(wire_uri, database, "c-1", capsys)
    _the_person_goes_on(wire_uri, database, "c-1")


@pytest.mark.wire
def test_pops_older_than_those_the_document_remembers_are_never_put_back_past_its_count(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The document remembers the newest 100 popped messages: those popped before are
    migrated messages the legacy turns still convert to, past the document's count. The
    rerun puts none back; `finish` says the conversation changed since, until accepted."""
    start = datetime(2024, 1, 1, tzinfo=UTC)
    database[CONVERSATIONS].insert_many(
        [
            legacy_turn(f"t-{n:02d}", "c-1", 0, f"Q{n}")
            | {"created_at": start + timedelta(minutes=n)}
            for n in range(52)
        ]
    )
    assert cli(wire_uri, database, "run") == 0
    _pop(wire_uri, database, "c-1", 102)
    assert cli(wire_uri, database, "finish") == 1

    assert cli(wire_uri, database, "run") == 0

    assert _stored_seqs(database, "c-1") == [0, 1]
    _changed_since_is_accepted(wire_uri, database, "c-1", capsys)
    _the_person_goes_on(wire_uri, database, "c-1")


@pytest.mark.wire
def test_a_message_stored_past_its_conversation_documents_count_is_work_left(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A message at a `seq` its document does not cover takes the place of the next turn:
    the gate never passes over it, whoever wrote it."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"Q{n}") for n in range(2)]
    )
    assert cli(wire_uri, database, "run") == 0
    database[CONVERSATIONS].update_one({"_id": "c-1"}, {"$set": {"message_count": 3}})
    capsys.readouterr()

    assert cli(wire_uri, database, "finish") == 1

    out = capsys.readouterr().out
    assert "1 messages stored at seq values its conversation document does not cover" in out


@pytest.mark.wire
def test_the_run_summary_counts_only_what_it_wrote_not_what_the_fence_skipped(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A conversation deleted between a batch's plan and its writes gets nothing: the run's
    summary and its record count the documents it wrote, not those it planned."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "Gone"), legacy_turn("t-2", "c-2", 1, "Kept")]
    )
    _between_plan_and_writes(
        monkeypatch,
        lambda: _as_a_person(wire_uri, database, lambda s: s.delete("c-1", user_id="u-1")),
    )

    assert cli(wire_uri, database, "run") == 0

    assert "2 messages written, 1 conversation documents written" in capsys.readouterr().out
    record = database["agent_migrations"].find_one({"kind": "run"}) or {}
    assert (record["counts"]["messages_written"], record["counts"]["conversations_written"]) == (
        2,
        1,
    )


@pytest.mark.wire
def test_a_live_turn_logged_after_the_migration_is_never_said_logged_before_it(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A live turn logged past the migrated messages, then a legacy turn added to the
    conversation: the legacy turns now convert to messages at the live turn's `seq` values.
    Its legacy turns are not merged, and the problem and `finish` say the live turn came
    after the migration, not before it."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "First"))
    assert cli(wire_uri, database, "run") == 0
    _live_turn(wire_uri, database, "c-1", 1)
    database[LEGACY_TURNS].insert_one(legacy_turn("t-2", "c-1", 1, "Late legacy"))
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 1

    [problem] = database[PROBLEMS].find({"conversation_id": "c-1"})
    assert problem["kind"] == "conversation_changed_since"
    said = problem["detail"] + capsys.readouterr().out
    assert "since the migration" in said
    # `finish` lists every way a conversation changes since its migration, one of them a pop
    # "before a rollback"; none says the live turn was logged before the migration.
    assert "before" not in said.replace("before any", "").replace("before a rollback", "")


def _unmigrated_pair(database: Database[dict[str, Any]]) -> None:
    """c-1 of u-1, holding content only a problem keeps and a whole text, and c-2 of u-2."""
    big = [{"type": "text", "content": "x" * 1_200_000 + "«SECRET END»"}]
    database[CONVERSATIONS].insert_many(
        [
            legacy_turn("t-1", "c-1", 0, "SECRET") | {"response_parts": big},
            legacy_turn("t-1b", "c-1", 1, "SECRET 2")
            | {"response_parts": [unknown_part("«SECRET PART»")]},
            legacy_turn("t-2", "c-2", 2, "Kept") | {"user_id": "u-2"},
        ]
    )


def _nothing_of_c1_is_stored(database: Database[dict[str, Any]]) -> None:
    assert database[CONVERSATIONS].find_one({"_id": "c-1"}) is None
    assert database[MESSAGES].count_documents({"conversation_id": "c-1"}) == 0
    assert database[PROBLEMS].count_documents({"conversation_id": "c-1"}) == 0
    assert "SECRET" not in "\n".join(gridfs_texts(database))


def _deletes_c1(wire_uri: str, database: Database[dict[str, Any]], how: str) -> Callable[[], None]:
    def person() -> None:
        if how == "delete":
            _as_a_person(wire_uri, database, lambda s: s.delete("c-1", user_id="u-1"))
        else:
            _as_a_person(wire_uri, database, lambda s: s.erase_user("u-1"))

    return person


def _nothing_of_c1_and_a_rerun_passes(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing of the deleted c-1 is stored; with the race undone, a run migrates c-2 and
    `finish` passes on what is left."""
    _nothing_of_c1_is_stored(database)
    monkeypatch.undo()
    assert cli(wire_uri, database, "run") == 0
    assert database[MESSAGES].count_documents({"conversation_id": "c-2"}) == 2
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
@pytest.mark.parametrize("how", ["delete", "erase_user"])
def test_a_run_writes_nothing_of_an_unmigrated_conversation_deleted_after_it_planned_it(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A run plans a conversation no document holds yet; the person deletes it (or is erased)
    before the writes, taking its legacy turns. The run writes nothing of it — no document,
    message, whole text or problem — and `finish` passes on what is left."""
    _unmigrated_pair(database)
    _between_plan_and_writes(monkeypatch, _deletes_c1(wire_uri, database, how))

    assert cli(wire_uri, database, "run", "--conversation", "c-1") == 0

    _nothing_of_c1_and_a_rerun_passes(wire_uri, database, monkeypatch)


@pytest.mark.wire
@pytest.mark.parametrize("how", ["delete", "erase_user"])
def test_a_delete_landing_just_before_a_runs_document_insert_takes_the_conversation_whole(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The delete (or erasure) lands after the run checked the legacy turns and before it
    inserts the conversation's document: the document inserted does not bring the
    conversation back, and nothing else of it is written."""
    _unmigrated_pair(database)
    bulk_write = Collection.bulk_write
    person = _deletes_c1(wire_uri, database, how)
    done: list[bool] = []

    def racing(self: Collection[Any], *args: Any, **kwargs: Any) -> Any:
        moving_aside = all(isinstance(op, DeleteOne) for op in args[0])  # the move's delete
        if self.name == CONVERSATIONS and not done and not moving_aside:
            done.append(True)
            person()
        return bulk_write(self, *args, **kwargs)

    monkeypatch.setattr(Collection, "bulk_write", racing)

    assert cli(wire_uri, database, "run", "--conversation", "c-1") == 0

    assert done
    _nothing_of_c1_is_stored(database)


def _claims_u1(wire_uri: str, database: Database[dict[str, Any]]) -> Callable[[], None]:
    """The store's account claim of u-1 by u-2: its conversations, messages and legacy
    turns move to u-2 (no grace wait: nothing else is logging)."""

    async def go() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            db = client[database.name]
            rules = TurnRules(claim_grace=timedelta(0))
            await ConversationStore(db, legacy=LegacyTurns(db), rules=rules).claim("u-1", "u-2")
        finally:
            await client.close()

    return lambda: asyncio.run(go())


def _owners(database: Database[dict[str, Any]], cid: str) -> set[Any]:
    """The owners the conversation's document and its messages name."""
    documents = database[CONVERSATIONS].find({"_id": cid, "message_count": {"$exists": True}})
    stored = database[MESSAGES].find({"conversation_id": cid})
    return {d.get("user_id") for d in documents} | {m.get("user_id") for m in stored}


def _claimed_pair(database: Database[dict[str, Any]]) -> None:
    """c-1 of u-1 (two turns), and c-2 of u-3, which no claim moves."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"SECRET {n}") for n in range(2)]
        + [legacy_turn("t-9", "c-2", 5, "Other") | {"user_id": "u-3"}]
    )


def _claim_leaves_c1_to_the_next_run(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """After a run a claim raced: nothing of c-1 is left to u-1, the run said so and exited
    1, `verify` and `finish` exit 1, and a rerun migrates it under u-2."""
    assert cli(wire_uri, database, "run") == 1
    said = capsys.readouterr().out
    assert "c-1" in said
    assert "run the migration again" in said
    monkeypatch.undo()
    assert "u-1" not in _owners(database, "c-1")
    assert _owners(database, "c-2") == {"u-3"}
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "run") == 0
    assert _owners(database, "c-1") == {"u-2"}
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_claim_between_a_runs_plan_and_its_writes_leaves_nothing_to_the_old_owner(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An account claim (u-1 -> u-2) lands after a run planned a batch and before its writes:
    the legacy turns keep their `_id`s and name u-2 now. The run writes nothing of the
    conversation under u-1 (no document, no message the old owner could read), names it as
    left for the next run and exits 1; the rerun migrates it under u-2."""
    _claimed_pair(database)
    _between_plan_and_writes(monkeypatch, _claims_u1(wire_uri, database))

    _claim_leaves_c1_to_the_next_run(wire_uri, database, monkeypatch, capsys)


@pytest.mark.wire
def test_a_claim_after_a_runs_documents_and_before_its_messages_leaves_no_message_to_the_old_owner(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The claim lands after the run wrote the batch's conversation documents (the claim
    moves them to u-2) and before its messages: no message is written under u-1; the
    conversation is left for the next run, which migrates it under u-2."""
    _claimed_pair(database)
    keep = full_texts.keep
    claim = _claims_u1(wire_uri, database)
    done: list[bool] = []

    def racing(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            claim()
        return keep(*args, **kwargs)

    monkeypatch.setattr(full_texts, "keep", racing)

    _claim_leaves_c1_to_the_next_run(wire_uri, database, monkeypatch, capsys)
    assert done


def _before_message_insert(
    monkeypatch: pytest.MonkeyPatch, command: int, meanwhile: Callable[[], None]
) -> list[int]:
    """`meanwhile` happens once, right before the run's `command`-th insert of c-1's messages
    (counted from 1): after the run last looked at the legacy turns before its messages. The
    sizes of c-1's insert commands are answered."""
    insert_many = Collection.insert_many
    sizes: list[int] = []

    def racing(self: Collection[Any], documents: Any, *args: Any, **kwargs: Any) -> Any:
        documents = list(documents)
        if self.name == MESSAGES and any(d["conversation_id"] == "c-1" for d in documents):
            sizes.append(len(documents))
            if len(sizes) == command:
                meanwhile()
        return insert_many(self, documents, *args, **kwargs)

    monkeypatch.setattr(Collection, "insert_many", racing)
    return sizes


@pytest.mark.wire
@pytest.mark.parametrize("how", ["delete", "erase_user"])
def test_a_delete_between_a_runs_message_inserts_leaves_nothing_of_the_conversation(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A conversation whose messages take several insert commands (more than N, or than M
    bytes) is deleted (or its owner erased) between two of them: the run takes back out what
    it wrote of it (the later commands' messages, its whole texts), says nothing of it, and
    `finish` passes on what is left."""
    _unmigrated_pair(database)
    sizes = _before_message_insert(monkeypatch, 2, _deletes_c1(wire_uri, database, how))

    assert cli(wire_uri, database, "run", "--max-command-documents", "2") == 0

    assert len(sizes) > 1
    _nothing_of_c1_and_a_rerun_passes(wire_uri, database, monkeypatch)


@pytest.mark.wire
@pytest.mark.parametrize("how", ["delete", "erase_user"])
def test_a_delete_of_the_last_legacy_conversation_during_a_run_leaves_nothing_and_no_restore(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    how: str,
) -> None:
    """The only conversation with legacy turns is deleted (or its owner erased) after the run
    last looked at them and before its messages: the legacy collection is empty, by its
    owners' will, not a drop. The run takes back out what it wrote, exits 0, and never tells
    the operator to restore the legacy turns from a backup (which would bring back what the
    owner deleted)."""
    _unmigrated_pair(database)
    database[CONVERSATIONS].delete_many({"conversation_id": "c-2"})
    _before_message_insert(monkeypatch, 1, _deletes_c1(wire_uri, database, how))

    assert cli(wire_uri, database, "run") == 0

    assert "backup" not in capsys.readouterr().out
    _nothing_of_c1_is_stored(database)


@pytest.mark.wire
def test_a_claim_between_a_runs_last_look_and_its_message_inserts_is_named_and_left_to_no_one(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An account claim (u-1 -> u-2) lands after the run last looked at the legacy turns and
    before it inserts the conversation's messages: the run takes back out the messages it
    wrote under u-1, names the conversation as left for the next run and exits 1; the rerun
    migrates it under u-2."""
    _claimed_pair(database)
    _before_message_insert(monkeypatch, 1, _claims_u1(wire_uri, database))

    _claim_leaves_c1_to_the_next_run(wire_uri, database, monkeypatch, capsys)


@pytest.mark.wire
def test_migrated_messages_from_past_seq_0_without_their_conversation_are_removed_by_a_run(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Messages of legacy turns, from a later `seq` on, whose conversation document and
    legacy turns are gone (a person deleted the conversation between two insert commands of
    a run killed before it looked again): `finish` names them as the migration's, and the
    next run removes them, whatever `seq` the first of them holds."""
    _unmigrated_pair(database)
    assert cli(wire_uri, database, "run") == 0
    database[CONVERSATIONS].delete_one({"_id": "c-1"})
    database[LEGACY_TURNS].delete_many({"conversation_id": "c-1"})
    database[MESSAGES].delete_many({"conversation_id": "c-1", "seq": {"$lt": 2}})
    capsys.readouterr()

    assert cli(wire_uri, database, "finish") == 1
    assert "c-1: holds 1 messages of legacy turns" in capsys.readouterr().out

    assert cli(wire_uri, database, "run") == 0
    assert database[MESSAGES].count_documents({"conversation_id": "c-1"}) == 0
    assert cli(wire_uri, database, "finish") == 0


def _reads_then_pops_c1_before_insert(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, n: int
) -> list[Any]:
    """Before the run's `n`th insert of messages, u-1 reads c-1's transcript, then pops its
    last message: what they saw (the transcript's length, then the popped message or the
    `Conflict` refusing the pop), filled in as the run goes."""
    seen: list[Any] = []

    async def pop(store: ConversationStore) -> None:
        seen.append(len(await store.transcript("c-1", user_id="u-1")))
        try:
            seen.append(await store.pop_last_message("c-1", user_id="u-1"))
        except Conflict as refused:
            seen.append(refused)

    person = lambda: _as_a_person(wire_uri, database, pop, dual_write=True)  # noqa: E731
    _before_message_insert(monkeypatch, n, person)
    return seen


@pytest.mark.wire
def test_a_pop_while_a_run_fills_a_long_conversation_is_refused_and_reads_serve_it_whole(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between two insert commands of a conversation's messages its document stands already:
    until its messages are all in, the service takes it for one not migrated yet, reading it
    from its legacy turns (the transcript whole) and refusing its writes (a pop: 409, nothing
    written); the run then stores it whole, and its last message is its legacy answer."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"Legacy {n}") for n in range(3)]
    )
    seen = _reads_then_pops_c1_before_insert(wire_uri, database, monkeypatch, 2)

    assert cli(wire_uri, database, "run", "--max-command-documents", "2") == 0

    assert seen[0] == 6
    assert isinstance(seen[1], Conflict)
    assert database[MESSAGES].count_documents({"conversation_id": "c-1"}) == 6
    monkeypatch.undo()
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_run_stopped_while_filling_a_conversation_leaves_it_unmigrated_until_the_next_run(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed between two insert commands of a conversation's messages leaves its
    document marked as being migrated: the service reads it from its legacy turns and refuses
    its writes (409), `finish` counts it as work left, and the next run finishes it."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"Legacy {n}") for n in range(3)]
    )

    def killed() -> None:
        raise KeyboardInterrupt

    _before_message_insert(monkeypatch, 2, killed)
    assert cli(wire_uri, database, "run", "--max-command-documents", "2") == 130
    monkeypatch.undo()
    seen: list[Any] = []

    async def rename(store: ConversationStore) -> None:
        seen.append(len(await store.transcript("c-1", user_id="u-1")))
        with pytest.raises(Conflict, match="not migrated yet"):
            await store.rename("c-1", "Renamed", user_id="u-1")
        seen.append(True)

    _as_a_person(wire_uri, database, rename)
    assert seen == [6, True]
    assert cli(wire_uri, database, "finish") == 1

    assert cli(wire_uri, database, "run") == 0

    [document] = database[CONVERSATIONS].find({"_id": "c-1"})
    assert "migrating" not in document
    assert database[MESSAGES].count_documents({"conversation_id": "c-1"}) == 6
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_rerun_adding_messages_to_a_migrated_conversation_marks_it_until_they_are_all_in(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old-service writer logs legacy turns to a conversation already migrated: the rerun
    writes its document marked as being migrated before it inserts the new messages (several
    commands), so in between the service reads it whole from its legacy turns and refuses a
    pop (409); the run then stores it whole and removes the mark."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"Legacy {n}") for n in range(2)]
    )
    assert cli(wire_uri, database, "run") == 0
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"Legacy {n}") for n in range(2, 4)]
    )
    seen = _reads_then_pops_c1_before_insert(wire_uri, database, monkeypatch, 2)

    assert cli(wire_uri, database, "run", "--max-command-documents", "2") == 0

    assert seen[0] == 8
    assert isinstance(seen[1], Conflict)
    stored = database[MESSAGES].find({"conversation_id": "c-1"}, sort=[("seq", 1)])
    assert [m["seq"] for m in stored] == list(range(8))
    assert "migrating" not in database[CONVERSATIONS].find_one({"_id": "c-1"}) or {}
    monkeypatch.undo()
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


async def _text_indexed(wire_uri: str, database: Database[dict[str, Any]]) -> None:
    """The service's indexes, the text index searches read among them."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
    try:
        await AgentMessageLogger(client[database.name]).ensure_indexes()
    finally:
        await client.close()


def _rerun_adding_two_turns_to_migrated_c1(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    read: Callable[[ConversationStore], Coroutine[Any, Any, Any]],
) -> None:
    """c-1 (two legacy turns) and c-2 (one) are migrated; an old-service writer logs two more
    legacy turns of c-1, and the rerun adding their messages (marking c-1 until they are all
    in) runs with `read` done by u-1 between its two insert commands of c-1's messages."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"Legacy {n}") for n in range(2)]
        + [legacy_turn("o-0", "c-2", 0, "Legacy other")]
    )
    assert cli(wire_uri, database, "run") == 0

    asyncio.run(_text_indexed(wire_uri, database))
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"Legacy {n}") for n in range(2, 4)]
    )
    _before_message_insert(monkeypatch, 2, lambda: _as_a_person(wire_uri, database, read))
    assert cli(wire_uri, database, "run", "--max-command-documents", "2") == 0
    monkeypatch.undo()
    assert "migrating" not in database[CONVERSATIONS].find_one({"_id": "c-1"}) or {}


@pytest.mark.wire
def test_a_conversation_a_rerun_adds_messages_to_stays_listed_exported_and_found(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a rerun writes the messages an old-service writer added to a migrated
    conversation (marked as being migrated), the conversation stays in its owner's list (its
    document's summary, as `get_conversation` serves it), in the export (its transcript as
    the read fallback serves it, whole) and in search (hits from its stored messages): it is
    served, so it is never silently left out of them."""
    seen: dict[str, Any] = {}

    async def read(store: ConversationStore) -> None:
        seen["listed"] = (await store.list_conversations("u-1")).data
        seen["recent"] = [c.id for c in (await store.recent_conversations()).data]
        seen["exported"] = [e async for e in store.export_user("u-1")]
        seen["served"] = await store.get_conversation("c-1", user_id="u-1")
        seen["transcript"] = await store.transcript("c-1", user_id="u-1")
        found = await store.search("Legacy", user_id="u-1", limit=50)
        seen["found"] = {h.message.conversation_id for h in found}
        try:
            found = await store.search("Legacy", conversation_id="c-1", limit=50)
            seen["found_in_c1"] = {h.message.conversation_id for h in found}
        except NotFound as refused:
            seen["found_in_c1"] = refused

    _rerun_adding_two_turns_to_migrated_c1(wire_uri, database, monkeypatch, read)

    listed = {c.id: c for c in seen["listed"]}
    assert sorted(listed) == ["c-1", "c-2"]
    assert listed["c-1"].model_dump() == seen["served"].model_dump()
    assert sorted(seen["recent"]) == ["c-1", "c-2"]
    exported = {e.conversation.id: e for e in seen["exported"]}
    assert sorted(exported) == ["c-1", "c-2"]
    assert len(seen["transcript"]) == 8
    assert exported["c-1"].messages == seen["transcript"]
    assert seen["found"] == {"c-1", "c-2"}
    assert seen["found_in_c1"] == {"c-1"}


@pytest.mark.wire
@pytest.mark.parametrize("order", ["asc", "desc"])
def test_paging_a_conversation_a_rerun_adds_messages_to_after_a_message_serves_the_next_page(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    order: Literal["asc", "desc"],
) -> None:
    """While a rerun writes the messages an old-service writer added to a migrated
    conversation, a reader paging it `after` a message it read (stored before the rerun)
    gets the next page of what the read fallback serves, as without `after` (was: 404, the
    conversation said to be missing while every other read served it)."""
    seen: list[Any] = []

    async def read(store: ConversationStore) -> None:
        whole = await store.transcript("c-1", user_id="u-1")
        if order == "desc":
            whole = whole[::-1]
        stored = [m for m in whole if m.seq < 4]
        after = stored[1].id if order == "asc" else stored[-3].id
        page = await store.messages_page("c-1", after=after, limit=2, order=order, user_id="u-1")
        at = [m.id for m in whole].index(after)
        seen.append((page, whole[at + 1 : at + 3], len(whole) > at + 3))
        with pytest.raises(NotFound):
            await store.messages_page("c-1", after=after, user_id="u-2")

    _rerun_adding_two_turns_to_migrated_c1(wire_uri, database, monkeypatch, read)

    [(page, expected, more)] = seen
    assert page.data == expected
    assert page.has_more is more


@pytest.mark.wire
def test_a_claim_while_a_rerun_rewrites_messages_takes_back_only_what_the_run_inserted(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Legacy turns of a migrated conversation are edited since, so a rerun rewrites their
    messages (marked as being migrated meanwhile); an account claim lands between two of its
    rewrite commands. The run takes back nothing it only rewrote (those messages were stored
    before it; those it rewrote after the claim go to the new owner), names the conversation
    as left for the next run and exits 1; the new owner reads it whole, and the next run
    rewrites its messages under the new owner."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"Legacy {n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run") == 0
    for turn in ("t-0", "t-2"):
        edit = {"$set": {"user_message": f"{turn} edited"}}
        database[LEGACY_TURNS].update_one({"_id": turn}, edit)
    claim = _claims_u1(wire_uri, database)
    bulk_write = Collection.bulk_write
    commands: list[int] = []

    def racing(self: Collection[Any], requests: Any, *args: Any, **kwargs: Any) -> Any:
        result = bulk_write(self, requests, *args, **kwargs)
        if self.name == MESSAGES:
            commands.append(len(requests))
            if len(commands) == 1:
                claim()
        return result

    monkeypatch.setattr(Collection, "bulk_write", racing)
    capsys.readouterr()

    assert cli(wire_uri, database, "run", "--max-command-documents", "1") == 1

    assert "c-1" in capsys.readouterr().out
    monkeypatch.undo()
    assert database[MESSAGES].count_documents({"conversation_id": "c-1"}) == 6
    assert _owners(database, "c-1") == {"u-2"}
    seen: list[int] = []

    async def read(store: ConversationStore) -> None:
        seen.append(len(await store.transcript("c-1", user_id="u-2")))

    _as_a_person(wire_uri, database, read)
    assert seen == [6]
    assert cli(wire_uri, database, "run") == 0
    assert _owners(database, "c-1") == {"u-2"}
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_conversation_a_stopped_run_left_marked_is_named_as_such_by_status_verify_and_finish(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A run stopped after a conversation's messages are all in but before it removed the
    mark: the service still answers it from its legacy turns and refuses its writes, so
    `verify` exits 1 and `finish` 1, both naming the conversation as one a run was stopped
    while writing (never as a document changed after the run), `status` counts and names
    it, and each says to run again, which finishes it."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"Legacy {n}") for n in range(3)]
    )
    update_many = Collection.update_many

    def stopped(self: Collection[Any], query: Any, update: Any, *args: Any, **kwargs: Any) -> Any:
        if self.name == CONVERSATIONS and "migrating" in update.get("$unset", {}):
            raise KeyboardInterrupt
        return update_many(self, query, update, *args, **kwargs)

    monkeypatch.setattr(Collection, "update_many", stopped)
    assert cli(wire_uri, database, "run") == 130
    monkeypatch.undo()
    capsys.readouterr()

    assert cli(wire_uri, database, "status") == 0
    said = capsys.readouterr().out
    assert "conversations left marked as being migrated (`migrating`): 1: c-1" in said
    assert cli(wire_uri, database, "verify") == 1
    assert "c-1: a run was stopped while writing it" in capsys.readouterr().out
    assert cli(wire_uri, database, "finish") == 1

    said = capsys.readouterr().out
    assert "c-1: a run was stopped while writing it" in said
    assert "changed after the run" not in said
    assert cli(wire_uri, database, "run") == 0
    assert "migrating" not in capsys.readouterr().out.replace("migrations", "")
    assert cli(wire_uri, database, "status") == 0
    assert "left marked" not in capsys.readouterr().out
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_run_killed_after_the_owners_emptied_the_legacy_turns_is_finished_by_the_next_run(
    wire_uri: str, database: Database[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last conversation with legacy turns is deleted by its owner between two insert
    commands of a run, killed before it looks at the legacy turns again: the legacy
    collection stands empty, emptied by its owners. The next run still reaches its last step
    and removes the messages it left of the deleted conversation, and `verify` and `finish`
    pass on what is left (never "no legacy data")."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"SECRET {n}") for n in range(3)]
    )
    _killed_at_third_insert_of_c1(monkeypatch, _deletes_c1(wire_uri, database, "delete"))
    assert cli(wire_uri, database, "run", "--max-command-documents", "2") == 130
    monkeypatch.undo()
    assert database[MESSAGES].count_documents({"conversation_id": "c-1"}) > 0
    assert database[LEGACY_TURNS].count_documents({}) == 0

    assert cli(wire_uri, database, "run") == 0

    _nothing_of_c1_is_stored(database)
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


def _killed_at_third_insert_of_c1(
    monkeypatch: pytest.MonkeyPatch, between: Callable[[], None]
) -> None:
    """The run's inserts of c-1's messages: `between` runs before the second command, and
    the run is stopped (Ctrl-C) at the third, before its look at the legacy turns again."""
    insert_many = Collection.insert_many
    commands: list[int] = []

    def racing(self: Collection[Any], documents: Any, *args: Any, **kwargs: Any) -> Any:
        documents = list(documents)
        if self.name == MESSAGES and any(d["conversation_id"] == "c-1" for d in documents):
            commands.append(len(documents))
            if len(commands) == 2:
                between()
            if len(commands) == 3:
                raise KeyboardInterrupt
        return insert_many(self, documents, *args, **kwargs)

    monkeypatch.setattr(Collection, "insert_many", racing)


@pytest.mark.wire
@pytest.mark.parametrize("dual_write", [True, False], ids=["dual-write", "no-dual-write"])
def test_a_killed_runs_messages_of_a_conversation_deleted_and_started_again_are_removed(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    dual_write: bool,
) -> None:
    """u-1 deletes c-1 between two insert commands of a run's messages of it, and u-2 starts
    a new c-1 (a document of another life: its own epoch, its own owner); the run inserts
    u-1's later messages (no epoch, `legacy-…` turn ids) past the new document's count and is
    killed before its take-back. The next run's last step removes those messages, and only
    those (no legacy turn names them, and no conversation document of theirs holds them):
    u-2's conversation stays whole, its next turns take their places, and `verify` and
    `finish` pass."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"SECRET {n}") for n in range(3)]
    )

    def started_again() -> None:
        _deletes_c1(wire_uri, database, "delete")()

        async def log(_: ConversationStore, logger: AgentMessageLogger) -> LoggedTurn:
            said = [{"role": "user", "content": "new owner"}]
            return await logger.log_messages("c-1", said, user_id="u-2", turn_id="n-0")

        _on_the_service(wire_uri, database, log, dual_write=dual_write)

    _killed_at_third_insert_of_c1(monkeypatch, started_again)
    assert cli(wire_uri, database, "run", "--max-command-documents", "2") == 130
    monkeypatch.undo()
    assert _owners(database, "c-1") == {"u-1", "u-2"}
    capsys.readouterr()
    assert cli(wire_uri, database, "finish") == 1
    said = capsys.readouterr().out
    assert "work left in 1 conversations" in said
    assert "holds 2 messages of legacy turns past its conversation document's count" in said

    assert cli(wire_uri, database, "run") == 0

    assert "1 conversations started again under the id cleared" in capsys.readouterr().out
    assert _owners(database, "c-1") == {"u-2"}
    assert database[CONVERSATIONS].find_one({"_id": "c-1"})["user_id"] == "u-2"
    for n in (1, 2):

        async def log(_: ConversationStore, logger: AgentMessageLogger, n: int = n) -> Any:
            said = [{"role": "user", "content": f"new owner {n}"}]
            return await logger.log_messages("c-1", said, user_id="u-2", turn_id=f"n-{n}")

        _on_the_service(wire_uri, database, log, dual_write=dual_write)
    stored = database[MESSAGES].find({"conversation_id": "c-1"}, sort=[("seq", 1)])
    assert [(m["seq"], m["content"]) for m in stored] == [
        (0, "new owner"), (1, "new owner 1"), (2, "new owner 2"),
    ]  # fmt: skip
    assert "SECRET" not in "\n".join(gridfs_texts(database))
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(
            lambda db: db[CONVERSATIONS].delete_one({"_id": "c-1"}), id="document-deleted"
        ),
        pytest.param(
            lambda db: db[CONVERSATIONS].update_one({"_id": "c-1"}, {"$set": {"user_id": "u-9"}}),
            id="document-owner",
        ),
        pytest.param(
            lambda db: db[MESSAGES].update_one(
                {"conversation_id": "c-1", "seq": 1}, {"$set": {"user_id": "u-9"}}
            ),
            id="message-owner",
        ),
        pytest.param(
            lambda db: db[LEGACY_TURNS].update_many({}, {"$set": {"user_id": "u-9"}}),
            id="legacy-owner",
        ),
    ],
)
def test_verify_fails_a_conversation_whose_document_is_missing_or_names_another_owner(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    tamper: Callable[[Database[dict[str, Any]]], Any],
) -> None:
    """Who may read a conversation is its document's owner and its messages': `verify`
    exits 1, naming the conversation, when the document is missing or it or a message names
    another owner than the legacy turns do now, as `finish` does."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "SECRET"))
    assert cli(wire_uri, database, "run") == 0
    tamper(database)
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 1
    assert "c-1: " in capsys.readouterr().out
    assert cli(wire_uri, database, "finish") == 1


def owned_turn(turn_id: str, cid: Any, hour: int, user: str) -> dict[str, Any]:
    return legacy_turn(turn_id, cid, hour, f"«{user} private»") | {"user_id": user}


@pytest.mark.wire
@pytest.mark.parametrize(
    ("turns", "stored_id"),
    [
        pytest.param(
            [owned_turn("a", 42, 0, "user-A"), owned_turn("b", "42", 1, "user-B")],
            "42",
            id="a-number-and-its-text",
        ),
        pytest.param(
            [owned_turn("c", True, 0, "user-C"), owned_turn("d", "True", 1, "user-D")],
            "True",
            id="a-boolean-and-its-text",
        ),
        pytest.param(
            [owned_turn("t1", None, 0, "user-A"), owned_turn("t2", "legacy-turn-t1", 1, "user-B")],
            "legacy-turn-t1",
            id="a-legacy-id-spelling-a-derived-id",
        ),
        pytest.param(
            [owned_turn("x", "c-shared", 0, "user-C"), owned_turn("y", "c-shared", 1, "user-A")],
            "c-shared",
            id="one-conversation-whose-user-changed",
        ),
    ],
)
def test_a_conversation_whose_legacy_turns_name_several_users_needs_the_operators_acceptance(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    turns: list[dict[str, Any]],
    stored_id: str,
) -> None:
    """The last user owns every message of it, the others' words too: `finish` names the
    conversation and its users, and passes only once an operator accepts that."""
    database[CONVERSATIONS].insert_many(turns)
    users = sorted(t["user_id"] for t in turns)

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "finish") == 1
    left = next(
        ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith(stored_id)
    )
    assert all(repr(user) in left for user in users), left
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1

    assert cli(wire_uri, database, "finish", "--accept", stored_id, "--note", "owners told") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    [problem] = database[PROBLEMS].find({"kind": "mixed_user_ids"})
    assert problem["conversation_id"] == stored_id
    assert sorted(problem["content"]) == users


NOT_A_USER_IDENTIFIER = [
    "alice+work@example.com", "dXNlcjo0Mg==", "Alice Smith", "alice ", "josé", "tenant/alice",
    "a" * 201,
]  # fmt: skip


@pytest.mark.wire
@pytest.mark.parametrize("legacy_user", NOT_A_USER_IDENTIFIER, ids=lambda u: repr(u[:24]))
def test_a_legacy_owner_that_is_no_identifier_keeps_the_conversation_and_holds_the_gate(
    wire_uri: str, database: Database[dict[str, Any]], legacy_user: str
) -> None:
    """A legacy `user_id` the new store cannot name a user by (an e-mail with `+`, base64, a
    space, an accent, a slash, too long) never leaves the conversation unowned: it is stored
    owned by the id derived from that user id, which no other user's turn adopts and no
    other user reads, and `finish` holds the drop until an operator accepts it (or maps the
    id and runs again)."""
    database[CONVERSATIONS].insert_one(owned_turn("t-1", "c-odd-owner", 0, legacy_user))
    owner = derived_user_id(legacy_user)

    assert cli(wire_uri, database, "run") == 0
    assert _owners(database, "c-odd-owner") == {owner}
    [problem] = database[PROBLEMS].find({"kind": "invalid_user_id"})
    assert (problem["placed"], problem["content"]) == (
        False, {"user_id": legacy_user, "stored_as": owner}
    )  # fmt: skip
    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1

    async def mallory(store: ConversationStore, logger: AgentMessageLogger) -> list[str]:
        said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        refused = []
        for attempt in (
            logger.log_messages("c-odd-owner", said, user_id="mallory", turn_id="m-1"),
            logger.log_messages("c-odd-owner", said, user_id="mallory", owner_only=True),
            logger.upsert_conversation("c-odd-owner", user_id="mallory"),
            store.transcript("c-odd-owner", user_id="mallory"),
        ):
            with pytest.raises((Conflict, NotFound)) as caught:
                await attempt
            refused.append(type(caught.value).__name__)
        return refused

    refused = _on_the_service(wire_uri, database, mallory)
    assert refused == ["Conflict", "NotFound", "Conflict", "NotFound"]
    assert "mallory" not in {m["user_id"] for m in database[MESSAGES].find()}
    assert cli(wire_uri, database, "finish", "--accept", "c-odd-owner", "--note", "kept") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0


@pytest.mark.wire
def test_a_legacy_owner_mapped_to_an_identifier_and_run_again_owns_the_conversation(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The operator's other way out of `invalid_user_id`: rewrite the legacy turns' user id
    to the new store's identifier, run again; the owner is that user, nothing is left."""
    database[CONVERSATIONS].insert_one(owned_turn("t-1", "c-mapped", 0, "Alice Smith"))
    assert cli(wire_uri, database, "run") == 0
    database[LEGACY_TURNS].update_one({"_id": "t-1"}, {"$set": {"user_id": "alice"}})

    assert cli(wire_uri, database, "run") == 0
    assert _owners(database, "c-mapped") == {"alice"}
    assert database[PROBLEMS].count_documents({"kind": "invalid_user_id"}) == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


# -- a second attempt after a rollback keeps every live conversation ----------------------


def _on_the_service(
    wire_uri: str,
    database: Database[dict[str, Any]],
    act: Callable[[ConversationStore, AgentMessageLogger], Coroutine[Any, Any, Any]],
    *,
    dual_write: bool = True,
) -> Any:
    """What the new service does, wired as in the transition: read fallback, dual write."""

    async def go() -> Any:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            db = client[database.name]
            legacy = LegacyTurns(db, read_fallback=True, dual_write=dual_write)
            logger = AgentMessageLogger(db, observers=[legacy], legacy=legacy)
            return await act(ConversationStore(db, legacy=legacy), logger)
        finally:
            await client.close()

    return asyncio.run(go())


def _turn(cid: str, turn_id: str, text: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    async def log(_: ConversationStore, logger: AgentMessageLogger) -> LoggedTurn:
        messages = [{"role": "user", "content": f"{text}?"}, {"role": "assistant", "content": text}]
        return await logger.log_messages(cid, messages, user_id="u-1", turn_id=turn_id)

    return log


def _listed_then_written(
    cid: str, turn_id: str, text: str
) -> Callable[..., Coroutine[Any, Any, Any]]:
    """u-1 lists its conversations, reads `cid` and logs a turn into it; the ids listed."""

    async def read_then_write(store: ConversationStore, logger: AgentMessageLogger) -> list[str]:
        listed = await store.list_conversations("u-1")
        await store.get_conversation(cid, user_id="u-1")
        await _turn(cid, turn_id, text)(store, logger)
        return sorted(c.id for c in listed.data)

    return read_then_write


def _second_attempt(wire_uri: str, database: Database[dict[str, Any]]) -> None:
    """The runbook after a rollback: run, verify, finish, then the drop; each exits 0."""
    for command in (["run"], ["verify"], ["finish"], ["finish", "--drop-legacy", "--yes"]):
        assert cli(wire_uri, database, *command) == 0, command


def _texts_of(database: Database[dict[str, Any]], cid: str) -> list[Any]:
    return [m["content"] for m in database[MESSAGES].find({"conversation_id": cid}).sort("seq")]


@pytest.mark.wire
def test_a_conversation_started_during_the_transition_is_whole_after_a_second_attempt(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A conversation the new service started has only dual-written turns, their messages
    stored: the second attempt writes its document again (it was moved away with the
    others), so it is listed, read and written to as before, its earlier turns kept."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-old", 0, "«OLD»"))
    assert cli(wire_uri, database, "run") == 0
    _on_the_service(wire_uri, database, _turn("n-new", "live-1", "«NEW-1»"))
    roll_back(database, clear_messages=False)

    _second_attempt(wire_uri, database)

    document = database[CONVERSATIONS].find_one({"_id": "n-new"})
    assert document is not None
    assert (document["user_id"], document["message_count"], document["turn_count"]) == (
        "u-1",
        2,
        1,
    )

    written = _listed_then_written("n-new", "live-2", "«NEW-2»")
    assert _on_the_service(wire_uri, database, written, dual_write=False) == [
        "c-old",
        "n-new",
    ]
    assert _texts_of(database, "n-new") == ["«NEW-1»?", "«NEW-1»", "«NEW-2»?", "«NEW-2»"]


@pytest.mark.wire
def test_a_fork_made_during_the_transition_is_whole_after_a_rollback_and_a_second_attempt(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The old service reads a fork made during the transition with its copied history; the
    second attempt keeps the fork a conversation of its own, every message in it."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"«C{n}»") for n in range(2)]
    )
    assert cli(wire_uri, database, "run") == 0

    async def fork(_: ConversationStore, logger: AgentMessageLogger) -> LoggedTurn:
        return await logger.fork("c-1", 3, "f-1", user_id="u-1")

    _on_the_service(wire_uri, database, fork)
    _on_the_service(wire_uri, database, _turn("f-1", "live-f", "«F»"))
    history = ["«C0» question", "«C0» answer", "«C1» question", "«C1» answer", "«F»?", "«F»"]
    roll_back(database, clear_messages=False)
    old_service = convert(list(database[CONVERSATIONS].find({"conversation_id": "f-1"})))
    assert [m.content for m in old_service.messages] == history

    _second_attempt(wire_uri, database)
    _on_the_service(wire_uri, database, _turn("f-1", "live-g", "«G»"), dual_write=False)

    assert _texts_of(database, "f-1") == [*history, "«G»?", "«G»"]


ASKED = {"action": "confirm_payment", "params": {"eur": 120}, "request_id": "req-pay"}
PAY_CALL = {"id": "pay-1", "type": "function", "function": {"name": "pay", "arguments": "{}"}}


@pytest.mark.wire
@pytest.mark.parametrize("holds_a_call", [False, True], ids=["a-prompt", "a-prompt-holding-a-call"])
def test_a_prompt_a_live_turn_raised_and_a_person_answered_stays_answered_after_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]], holds_a_call: bool
) -> None:
    """A conversation the new service started raises a prompt a person answers, dual write
    on. The rollback moves away the document that remembered the answer; the second attempt
    keeps the prompt answered (not pending, the call it held released), as before it."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-old", 0, "«OLD»"))
    assert cli(wire_uri, database, "run") == 0
    asked: dict[str, Any] = {"role": "assistant", "content": "Pay?", "hitl_action": ASKED}
    if holds_a_call:
        asked |= {"content": None, "tool_calls": [PAY_CALL]}

    async def ask_then_answer(store: ConversationStore, logger: AgentMessageLogger) -> None:
        pay = [{"role": "user", "content": "Pay the invoice."}, asked]
        await logger.log_messages("n-h", pay, user_id="u-1", turn_id="live-1")
        await store.resolve_hitl("n-h", "req-pay", user_id="u-1")

    _on_the_service(wire_uri, database, ask_then_answer)
    roll_back(database, clear_messages=False)

    _second_attempt(wire_uri, database)

    found = database[CONVERSATIONS].find_one({"_id": "n-h"})
    assert found is not None
    assert (found["pending_hitl"], found["resolved_hitl"]) == (None, ["req-pay"])
    held = [c.request_id for c in Conversation.model_validate(found).pending_calls]
    assert held == [None] * holds_a_call  # as served: the answer released the call


def _awaited(found: dict[str, Any] | None) -> tuple[Any, ...]:
    """What a conversation document says it awaits, how many turns it counts, and when it
    was last written to, as served."""
    assert found is not None
    conversation = Conversation.model_validate(found)
    hitl = conversation.pending_hitl
    calls = [(c.tool_call_id, c.request_id) for c in conversation.pending_calls]
    at = conversation.updated_at
    return (hitl and hitl.request_id), calls, conversation.turn_count, at


def _live_turn_in_migrated(
    wire_uri: str, database: Database[dict[str, Any]], asks: str
) -> tuple[Any, ...]:
    """A migrated conversation gets a live turn (dual write on) making a call, raising a
    prompt, or both with the prompt answered; then the rollback. What its document said."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-old", 0, "«OLD»"))
    assert cli(wire_uri, database, "run") == 0
    asked: dict[str, Any] = {"role": "assistant", "content": "Pay?"}
    if asks != "a-call":
        asked["hitl_action"] = ASKED
    if asks != "a-prompt":
        asked |= {"content": None, "tool_calls": [PAY_CALL]}

    async def log(store: ConversationStore, logger: AgentMessageLogger) -> None:
        pay = [{"role": "user", "content": "Pay the invoice."}, asked]
        await logger.log_messages("c-old", pay, user_id="u-1", turn_id="live-1")
        if asks == "an-answered-prompt-holding-a-call":
            await store.resolve_hitl("c-old", "req-pay", user_id="u-1")

    _on_the_service(wire_uri, database, log)
    before = _awaited(database[CONVERSATIONS].find_one({"_id": "c-old"}))
    roll_back(database, clear_messages=False)
    return before


@pytest.mark.wire
@pytest.mark.parametrize("asks", ["a-prompt", "a-call", "an-answered-prompt-holding-a-call"])
def test_what_a_live_turn_of_a_migrated_conversation_awaits_outlives_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]], asks: str
) -> None:
    """A migrated conversation's live turn raises a prompt or makes a call; after the
    rollback (messages kept) the second attempt's document awaits what it awaited, by the
    ids of its stored messages, counts the turn and was written when the turn was."""
    before = _live_turn_in_migrated(wire_uri, database, asks)
    assert before[2] == 2

    _second_attempt(wire_uri, database)

    assert _awaited(database[CONVERSATIONS].find_one({"_id": "c-old"})) == before


@pytest.mark.wire
def test_an_automatic_name_of_a_conversation_started_live_stays_automatic_after_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A conversation the new service started is named by its first user text; its copies
    hold that name, as a copy holds whatever name its conversation had. The second attempt
    keeps it automatic, taken from the stored message, so popping that message retakes it."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-old", 0, "«OLD»"))
    assert cli(wire_uri, database, "run") == 0
    _on_the_service(wire_uri, database, _turn("n-1", "live-1", "Plan my trip to Rome"))
    before = database[CONVERSATIONS].find_one({"_id": "n-1"})
    assert before is not None
    assert before["name_source"] == "auto"
    roll_back(database, clear_messages=False)

    _second_attempt(wire_uri, database)

    found = database[CONVERSATIONS].find_one({"_id": "n-1"})
    assert found is not None
    named = ("name", "name_source", "name_message_id")
    assert {k: found.get(k) for k in named} == {k: before.get(k) for k in named}

    async def pop_both(store: ConversationStore, _: AgentMessageLogger) -> Conversation:
        for _ in range(2):
            await store.pop_last_message("n-1", user_id="u-1")
        return await store.get_conversation("n-1", user_id="u-1")

    assert _on_the_service(wire_uri, database, pop_both, dual_write=False).name is None


def _started_live(wire_uri: str, database: Database[dict[str, Any]]) -> list[str]:
    """A conversation the new service started, dual write on; its texts."""
    _on_the_service(wire_uri, database, _turn("n-1", "live-1", "«NEW»"))
    return ["«NEW»?", "«NEW»"]


def _forked(wire_uri: str, database: Database[dict[str, Any]]) -> list[str]:
    """A fork the new service made of the migrated "c-old", dual write on; its texts."""

    async def fork(_: ConversationStore, logger: AgentMessageLogger) -> LoggedTurn:
        return await logger.fork("c-old", 1, "n-1", user_id="u-1")

    _on_the_service(wire_uri, database, fork)
    return ["«OLD» question", "«OLD» answer"]


def _old_service_logs_a_turn(database: Database[dict[str, Any]]) -> None:
    database[CONVERSATIONS].insert_one(legacy_turn("o-1", "n-1", 5, "«OLD-SERVICE»"))


def _old_service_resaves_the_copy(database: Database[dict[str, Any]]) -> None:
    """The old service saves the copy again without the marks it does not know."""
    unset = {"dual_write": "", "turn_id": "", "dual_write_exact": "", "dual_write_record": ""}
    database[CONVERSATIONS].update_many({"conversation_id": "n-1"}, {"$unset": unset})


TRANSITION_CONVERSATIONS_CHANGED = {
    "started live, a turn the old service logged into it": (
        _started_live, _old_service_logs_a_turn, "conversation_changed_since", False),
    "started live, its copy saved again without the marks": (
        _started_live, _old_service_resaves_the_copy, "conversation_already_live", True),
    "a fork, a turn the old service logged into it": (
        _forked, _old_service_logs_a_turn, "conversation_changed_since", False),
}  # fmt: skip


@pytest.mark.wire
@pytest.mark.parametrize(("made", "changed", "kind", "placed"),
                         TRANSITION_CONVERSATIONS_CHANGED.values(),
                         ids=list(TRANSITION_CONVERSATIONS_CHANGED))  # fmt: skip
def test_a_conversation_of_the_transition_the_old_service_changed_is_whole_after_a_second_attempt(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    made: Callable[[str, Database[dict[str, Any]]], list[str]],
    changed: Callable[[Database[dict[str, Any]]], None],
    kind: str,
    placed: bool,
) -> None:
    """A conversation the new service started or forked during the transition, which the
    old service changed after the rollback: the second attempt writes its document again as
    the person left it, so it is listed, read and written to as before; a legacy turn the old
    service logged into it is not merged (`conversation_changed_since`, work left until an
    operator accepts it), and one that only says again what its live messages hold is
    placed."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-old", 0, "«OLD»"))
    assert cli(wire_uri, database, "run") == 0
    texts = made(wire_uri, database)
    roll_back(database, clear_messages=False)
    changed(database)

    assert cli(wire_uri, database, "run") == 0

    written = _listed_then_written("n-1", "live-2", "«AFTER»")
    assert _on_the_service(wire_uri, database, written, dual_write=False) == [
        "c-old",
        "n-1",
    ]
    assert _texts_of(database, "n-1") == [*texts, "«AFTER»?", "«AFTER»"]
    [problem] = database[PROBLEMS].find({"conversation_id": "n-1"})
    assert (problem["kind"], problem["placed"]) == (kind, placed)
    capsys.readouterr()
    assert cli(wire_uri, database, "finish") == (0 if placed else 1)
    out = capsys.readouterr().out
    assert "no legacy turn makes it" not in out
    if not placed:
        assert "«OLD-SERVICE» answer" in json.dumps(problem["content"], ensure_ascii=False)
        assert cli(wire_uri, database, "finish", "--accept", "n-1", "--note", "kept") == 0
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert _texts_of(database, "n-1") == [*texts, "«AFTER»?", "«AFTER»"]


@pytest.mark.wire
def test_a_conversation_whose_legacy_turns_the_old_service_deleted_keeps_its_live_turns(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """After a rollback a person deletes a migrated conversation's exchanges on the old
    service; the live turn's dual-written copy stays. The second attempt writes the document
    again from the copy, removes the migration's messages of the deleted exchanges, keeps the
    live turn where it is, and the conversation is written to as before; `verify` checks it,
    and names its document when it is missing (exit 1)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", "c-1", n, f"«L{n}»") for n in range(2)]
    )
    assert cli(wire_uri, database, "run") == 0
    _on_the_service(wire_uri, database, _turn("c-1", "live-1", "«LIVE»"))
    roll_back(database, clear_messages=False)
    database[CONVERSATIONS].delete_many({"conversation_id": "c-1", "dual_write": {"$ne": True}})

    assert cli(wire_uri, database, "run") == 0
    document = database[CONVERSATIONS].find_one({"_id": "c-1"})
    assert document is not None
    database[CONVERSATIONS].delete_one({"_id": "c-1"})
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "verify", "--conversation", "c-1") == 1
    database[CONVERSATIONS].insert_one(document)
    _second_attempt(wire_uri, database)

    assert _texts_of(database, "c-1") == ["«LIVE»?", "«LIVE»"]
    _on_the_service(wire_uri, database, _turn("c-1", "live-2", "«AFTER»"), dual_write=False)
    stored = database[MESSAGES].find({"conversation_id": "c-1"}).sort("seq", 1)
    assert [(m["seq"], m["content"]) for m in stored] == [
        (4, "«LIVE»?"), (5, "«LIVE»"), (6, "«AFTER»?"), (7, "«AFTER»")]  # fmt: skip


@pytest.mark.wire
def test_finish_names_a_conversation_whose_messages_have_no_document(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Messages no conversation document holds (a conversation logged while the dual write
    was off, its document moved away by a rollback): no legacy turn names the conversation,
    yet a drop would leave it unlisted and its next turn would delete them. Work left."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-old", 0, "«OLD»"))
    assert cli(wire_uri, database, "run") == 0
    _on_the_service(wire_uri, database, _turn("n-off", "live-1", "«OFF»"), dual_write=False)
    roll_back(database, clear_messages=False)
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()

    assert cli(wire_uri, database, "finish") == 1
    out = capsys.readouterr().out
    assert "n-off: its messages are stored without a conversation document" in out
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert relocate.holds_turns(database, LEGACY_TURNS)


@pytest.mark.wire
@pytest.mark.parametrize("batch_size", ["1", "100"])
@pytest.mark.parametrize("spelling", ["legacy-and-derived", "number-and-text"])
def test_a_conversation_its_turns_name_two_ways_counts_once_in_the_runs_summary(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    batch_size: str,
    spelling: str,
) -> None:
    """One turn names the legacy id, one the id derived from it (a dual write), or one the
    number 42, one the text "42": one conversation of two turns, whichever batches the two
    spellings fall in, counted once, and what it writes counted once: the dry run prints the
    very summary the run prints."""
    derived = derived_conversation_id(NOT_AN_IDENTIFIER)
    first, second, stored = {
        "legacy-and-derived": (NOT_AN_IDENTIFIER, derived, derived),
        "number-and-text": (42, "42", "42"),
    }[spelling]
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-a", first, 0, "ONE"), legacy_turn("t-b", second, 1, "TWO")]
    )

    assert cli(wire_uri, database, "run", "--dry-run", "--batch-size", batch_size) == 0
    predicted = summary(capsys.readouterr().out)
    assert cli(wire_uri, database, "run", "--batch-size", batch_size) == 0

    counts = summary(capsys.readouterr().out)
    assert predicted == counts
    assert (counts["conversations"], counts["turns"], counts["messages"]) == (1, 2, 4)
    assert (counts["messages written"], counts["conversation documents written"]) == (4, 1)
    assert database[MESSAGES].count_documents({"conversation_id": stored}) == 4


@pytest.mark.wire
def test_verify_and_finish_name_legacy_turns_written_after_the_move(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A legacy turn an old-service writer still running logs into agent_conversations after
    the move is content no run has read yet: `verify` says so and exits 1, as `finish` does,
    until `run` moves and migrates it."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "EARLY"))
    assert cli(wire_uri, database, "run") == 0
    database[CONVERSATIONS].insert_one(legacy_turn("t-2", "c-1", 1, "LATE"))
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 1
    assert f"{CONVERSATIONS} still holds legacy turns" in capsys.readouterr().out
    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_turn_logged_after_the_move_under_a_moved_turns_id_is_work_left_never_overwritten(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """An old-service writer logs a turn after the move under an `_id` the moved-aside turns
    hold with other content: data the run may not resolve alone, no misuse. `run` names it
    and exits 1, work left as `verify` and `finish` say it is; nothing is overwritten or
    deleted, on either side."""
    database[CONVERSATIONS].insert_one(legacy_turn("turn-1", "A", 0, "EARLY"))
    assert cli(wire_uri, database, "run") == 0
    late = legacy_turn("turn-1", "B", 5, "LATE")
    database[CONVERSATIONS].insert_one(late)
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 1
    captured = capsys.readouterr()
    assert "'turn-1' exists in agent_conversations_deprecated with other content" in (
        captured.out + captured.err
    )
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert database[CONVERSATIONS].find_one({"_id": "turn-1"}) == late
    moved = database[LEGACY_TURNS].find_one({"_id": "turn-1"})
    assert moved is not None
    assert moved["conversation_id"] == "A"


@pytest.mark.wire
@pytest.mark.parametrize(
    "late_id", [5.0, bson.Int64(5), bson.Decimal128("5")], ids=["double", "int64", "decimal128"]
)
def test_a_late_turn_under_a_moved_turns_number_id_of_another_type_is_named_and_refused(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    late_id: Any,
) -> None:
    """`5.0`, `Int64(5)` and `Decimal128("5")` are the `_id` 5 to MongoDB: a turn an old-service
    writer logs after the move under one of them, a moved turn being 5, is that moved turn's
    `_id` with other content: `run` names it and exits 1, every time, nothing overwritten or
    deleted (was: a KeyError traceback on every run, naming nothing)."""
    database[CONVERSATIONS].insert_one(legacy_turn(5, "A", 0, "EARLY"))
    assert cli(wire_uri, database, "run") == 0
    late = legacy_turn(late_id, "A", 5, "LATE")
    database[CONVERSATIONS].insert_one(late)
    capsys.readouterr()

    for _ in range(2):
        assert cli(wire_uri, database, "run") == 1
        captured = capsys.readouterr()
        said = captured.out + captured.err
        assert "Traceback" not in said
        assert "5 exists in agent_conversations_deprecated with other content" in said
        assert "give the turn in agent_conversations another _id" in said
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1
    assert database[CONVERSATIONS].find_one({"_id": 5}) == late
    moved = database[LEGACY_TURNS].find_one({"_id": 5})
    assert moved is not None
    assert moved["user_message"] == "EARLY question"


def _served_questions(wire_uri: str, database: Database[dict[str, Any]], cid: str) -> Any:
    """The user's messages the store serves of `cid` (its owner `u-1`), or None: not found."""

    async def served(db: Any) -> Any:
        store = ConversationStore(db)
        try:
            transcript = await store.transcript(cid, user_id="u-1")
        except NotFound:
            return None
        return [m.content for m in transcript if m.role == "user"]

    return _on_its_database(wire_uri, database, served)


@pytest.mark.wire
def test_a_moved_turn_the_old_service_saved_again_unchanged_is_taken_as_moved_not_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """After the move the old service saves a moved turn again as it was (an upsert by `_id`;
    no rollback happened): its conversation's document still stands in `agent_conversations`,
    which a rollback moves away, so the turn is the moved one, its copy the same: `run` takes
    it as moved (exit 0), never calls the collection a rollback's leftover to drop, and every
    conversation stays served whole (was: exit 1 advising to drop or rename the collection
    away; followed, the next run removed `c-2` and `c-1`'s second turn, `finish` exit 0)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "ONE"), legacy_turn("t-2", "c-1", 1, "TWO"),
         legacy_turn("t-3", "c-2", 0, "THREE")]
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    moved = database[LEGACY_TURNS].find_one({"_id": "t-1"})
    database[CONVERSATIONS].replace_one({"_id": "t-1"}, moved, upsert=True)
    stored = stored_messages(database)
    capsys.readouterr()

    for dry_run in (("--dry-run",), ()):
        assert cli(wire_uri, database, "run", *dry_run) == 0
        said = "".join(capsys.readouterr())
        assert "rollback" not in said
        assert "no legacy turn makes now" not in said
    assert database[CONVERSATIONS].find_one({"_id": "t-1"}) is None
    assert database[LEGACY_TURNS].count_documents({}) == 3
    assert stored_messages(database) == stored
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert _served_questions(wire_uri, database, "c-1") == ["ONE question", "TWO question"]
    assert _served_questions(wire_uri, database, "c-2") == ["THREE question"]


def _stopped_after_its_first_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's batches stopped (SIGTERM) once its first one is written."""
    batch = explode.Explosion.batch
    written = iter(range(2))

    def first_then_stopped(run: explode.Explosion, ids: list[Any]) -> None:
        if next(written, 1) == 1:
            raise cli_module.Stopped
        batch(run, ids)

    monkeypatch.setattr(explode.Explosion, "batch", first_then_stopped)


def _save_a_moved_turn_again(database: Database[dict[str, Any]], cid: str) -> str:
    """The old service saves a moved turn of `cid` again as it was (an upsert by `_id`): its
    `_id`."""
    moved = database[LEGACY_TURNS].find_one({"conversation_id": cid})
    assert moved is not None
    database[CONVERSATIONS].replace_one({"_id": moved["_id"]}, moved, upsert=True)
    return str(moved["_id"])


@pytest.mark.wire
@pytest.mark.parametrize("stopped_by", ["--limit 1", "a stop part-way"])
def test_a_moved_turn_saved_again_before_its_conversation_is_migrated_is_refused_losing_nothing(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    stopped_by: str,
) -> None:
    """The run moved every turn aside and migrated `c-1` only (`run --limit 1`, or a run
    stopped after its first batch); the old service then saves a moved turn of `c-2` again as
    it was. `c-2`'s document does not stand, as after a rollback (another conversation's
    document tells nothing: a run still writing during a rollback writes one), so `run`
    refuses (exit 1), never saying a rollback left the collection, and gives the way out of
    each cause; the one for no rollback, followed word for word, loses nothing: every
    conversation served whole, `verify` and `finish` 0 (was: "a collection a rollback left
    standing: drop it or rename it away"; followed, the next run removed `c-1`, `c-3` was in
    no collection the store reads, `verify` and `finish` 0)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in (1, 2, 3)]
    )
    if stopped_by == "--limit 1":
        assert cli(wire_uri, database, "run", "--limit", "1", "--batch-size", "1") == 0
    else:
        _stopped_after_its_first_batch(monkeypatch)
        assert cli(wire_uri, database, "run", "--batch-size", "1") == 128 + 15
        monkeypatch.undo()
    standing = {d["_id"] for d in database[CONVERSATIONS].find({"turn_count": {"$exists": True}})}
    assert standing == {"c-1"}
    saved = _save_a_moved_turn_again(database, "c-2")
    capsys.readouterr()

    for dry_run in (("--dry-run",), ()):
        assert cli(wire_uri, database, "run", *dry_run) == 1
        said = "".join(capsys.readouterr())
        assert "left standing" not in said
        assert f"If no rollback happened, delete from {CONVERSATIONS}" in said
    database[CONVERSATIONS].delete_one({"_id": saved})  # as advised: no rollback happened
    assert cli(wire_uri, database, "run") == 0
    assert database[LEGACY_TURNS].count_documents({}) == 3
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    for n in (1, 2, 3):
        assert _served_questions(wire_uri, database, f"c-{n}") == [f"T{n} question"]


@pytest.mark.wire
def test_a_moved_turn_saved_again_of_a_conversation_held_back_is_refused_losing_nothing(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`c-2` is held back, no document of it written, by a document no run reads naming it
    (a turn holding a `turn_count`); `c-1` migrates. The old service saves `c-2`'s moved turn
    again unchanged: `c-2`'s document does not stand, so `run` refuses it with the way out
    of each cause, never saying a rollback left the collection; the way for no rollback
    followed, and the document holding `c-2` back moved away, `c-2` migrates whole, `verify`
    and `finish` 0 (was: called a rollback's leftover collection to drop, which held `c-2`'s
    only turn)."""
    neither = legacy_turn("t-x", "c-2", 5, "X") | {"turn_count": None}
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "T1"), legacy_turn("t-2", "c-2", 1, "T2"), neither]
    )
    assert cli(wire_uri, database, "run") == 1
    assert database[CONVERSATIONS].find_one({"_id": "c-2"}) is None
    saved = _save_a_moved_turn_again(database, "c-2")
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 1
    said = "".join(capsys.readouterr())
    assert "left standing" not in said
    assert f"If no rollback happened, delete from {CONVERSATIONS}" in said
    database[CONVERSATIONS].delete_one({"_id": saved})  # as advised: no rollback happened
    database[CONVERSATIONS].delete_one({"_id": "t-x"})  # the operator moves it away
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert _served_questions(wire_uri, database, "c-1") == ["T1 question"]
    assert _served_questions(wire_uri, database, "c-2") == ["T2 question"]


@pytest.mark.wire
@pytest.mark.parametrize("attempt", ["first", "second, after a rollback by renaming"])
def test_a_moved_turn_saved_again_before_any_document_is_written_is_refused_naming_either_cause(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    attempt: str,
) -> None:
    """The run's move stands, and no run wrote a conversation document since it made the
    collection moved aside (stopped right after the move; on a second attempt, the first
    attempt's documents were written before the rollback, so they tell nothing): a moved turn
    the old service saved again unchanged cannot be told from a rollback's copy. `run` refuses
    (exit 1) without calling it a rollback, names the turn and the way out of each cause; the
    one for no rollback, followed word for word, loses nothing: `run`, `verify` and `finish`
    0, every conversation served (was: called a rollback's leftover to drop, which took every
    moved turn with it, `finish` 0)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in (1, 2)]
    )
    if attempt != "first":
        assert cli(wire_uri, database, "run") == 0
        roll_back(database, clear_messages=False)
    relocate.relocate(database, allow_rename=False)  # the run's move, stopped right after it
    turn_id = _save_a_moved_turn_again(database, "c-1")
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 1
    said = "".join(capsys.readouterr())
    assert "a rollback that copied the turns back left standing" not in said
    assert repr(turn_id) in said
    assert "saved moved turns again unchanged" in said
    assert f"drop {LEGACY_TURNS} or rename it away" in said  # for a rollback
    assert f"If no rollback happened, delete from {CONVERSATIONS}" in said
    database[CONVERSATIONS].delete_one({"_id": turn_id})  # no rollback happened: as advised
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    for n in (1, 2):
        assert _served_questions(wire_uri, database, f"c-{n}") == [f"T{n} question"]


@pytest.mark.wire
def test_a_rollback_by_copying_after_a_limited_run_is_refused_as_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A rollback by copying, its moved-aside collection left standing, after a run that
    migrated `c-0` only (`--limit 1`): no document the run wrote stands (the rollback moved
    it away), so refused (exit 1), nothing moved, though most of the turns copied back are of
    conversations no document stood for; the refusal says when a run started writing
    documents and gives the way out of a rollback."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"c-{n}", n, f"T{n}") for n in range(3)]
    )
    assert cli(wire_uri, database, "run", "--limit", "1", "--batch-size", "1") == 0
    database[CONVERSATIONS].drop()  # the rollback: documents away, the turns copied back
    database[CONVERSATIONS].insert_many(list(database[LEGACY_TURNS].find()))
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 1
    said = capsys.readouterr().err
    assert "a run started writing conversation documents at" in said
    assert f"if a rollback copied the turns back, drop {LEGACY_TURNS} or rename it away" in said
    assert database[CONVERSATIONS].count_documents({}) == 3


def _first_turn_ids(database: Database[dict[str, Any]], *, bob: bool) -> None:
    """A legacy design whose conversation's id is its first turn's `_id`: `c-1` of two turns
    (`c-1`, `c-1-2`), and, `bob`, `c-2` of one (`c-2`)."""
    turns = [legacy_turn("c-1", "c-1", 0, "ADA-1"), legacy_turn("c-1-2", "c-1", 1, "ADA-2")]
    if bob:
        turns.append(legacy_turn("c-2", "c-2", 2, "BOB-1"))
    database[CONVERSATIONS].insert_many(turns)


@pytest.mark.wire
def test_a_moved_turn_saved_again_where_its_conversations_document_stood_is_refused_saying_so(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The old service saves `c-1`'s first turn, whose `_id` is its conversation's id, again
    unchanged after the run (an upsert by `_id`): in `agent_conversations` that `_id` is
    `c-1`'s document's, which the turn replaces. `c-1`'s document does not stand, as after a
    rollback, so `run --dry-run` and `run` refuse (exit 1) saying the turn stands where its
    conversation's document stood, and that a name given to it comes back as the automatic
    one, never that a rollback left the collection; the way for
    no rollback followed, the run writes `c-1`'s document again, `verify` and `finish` 0,
    both served whole (was: "a rollback ... left standing, drop it"; followed, `c-2` removed
    and `ADA-2` lost, `verify` and `finish` 0)."""
    _first_turn_ids(database, bob=True)
    assert cli(wire_uri, database, "run") == 0
    saved = _save_a_moved_turn_again(database, "c-1")
    assert database[CONVERSATIONS].find_one({"_id": "c-1", "turn_count": {"$exists": True}}) is None
    capsys.readouterr()

    for dry_run in (("--dry-run",), ()):
        assert cli(wire_uri, database, "run", *dry_run) == 1
        said = "".join(capsys.readouterr())
        assert "left standing" not in said
        assert "'c-1' stands where its conversation's document stands" in said
        assert "a name given to the conversation, comes back as the automatic name" in said
    database[CONVERSATIONS].delete_one({"_id": saved})  # as advised: no rollback happened
    assert cli(wire_uri, database, "run") == 0
    assert database[CONVERSATIONS].find_one({"_id": "c-1", "turn_count": 2}) is not None
    assert database[LEGACY_TURNS].count_documents({}) == 3
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert _served_questions(wire_uri, database, "c-1") == ["ADA-1 question", "ADA-2 question"]
    assert _served_questions(wire_uri, database, "c-2") == ["BOB-1 question"]


@pytest.mark.wire
def test_moved_turns_saved_again_in_and_beside_a_documents_place_are_refused_naming_either_cause(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The old service saves both of `c-1`'s moved turns again unchanged, the first over
    `c-1`'s document, the only one the run wrote: no document stands, and the turns are all
    `c-1`'s, as a rollback of this database would leave them. Nothing tells the two apart,
    so `run` refuses (exit 1) without calling it a rollback, says that `c-1` stands where its
    conversation's document stands, and gives the way out of each cause; the one for no
    rollback, followed word for word, loses nothing: the run writes `c-1`'s document again,
    `verify` and `finish` 0 (was: called a rollback's leftover to drop, which took `ADA-2`
    with it, `finish` 0)."""
    _first_turn_ids(database, bob=False)
    assert cli(wire_uri, database, "run") == 0
    saved = {_save_a_moved_turn_again(database, "c-1")}
    moved = database[LEGACY_TURNS].find_one({"_id": "c-1-2"})
    database[CONVERSATIONS].replace_one({"_id": "c-1-2"}, moved, upsert=True)
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 1
    said = "".join(capsys.readouterr())
    assert "a rollback that copied the turns back left standing" not in said
    assert "'c-1', 'c-1-2'" in said or "'c-1-2', 'c-1'" in said
    assert "'c-1' stands where its conversation's document stands" in said
    assert f"drop {LEGACY_TURNS} or rename it away" in said  # for a rollback
    assert f"If no rollback happened, delete from {CONVERSATIONS}" in said
    database[CONVERSATIONS].delete_many({"_id": {"$in": [*saved, "c-1-2"]}})  # as advised
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert _served_questions(wire_uri, database, "c-1") == ["ADA-1 question", "ADA-2 question"]


@pytest.mark.wire
def test_a_moved_turn_edited_where_its_conversations_document_stood_is_refused_saying_so(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The old service completes `c-1`'s first moved turn after the run, an upsert by `_id`
    over `c-1`'s document: other content than its moved copy. `run` refuses (exit 1), names
    the turn and says it stands where its conversation's document stands (the conversation
    has none until the turn is moved); the advice for the moved turn edited, followed, loses
    nothing: `run` moves the edited turn and writes `c-1`'s document again, `verify` and
    `finish` 0, the completed answer served (was: the refusal said nothing of the document
    the turn replaced)."""
    _first_turn_ids(database, bob=True)
    assert cli(wire_uri, database, "run") == 0
    edited = database[LEGACY_TURNS].find_one({"_id": "c-1"})
    assert edited is not None
    edited["response_parts"] = [{"type": "text", "content": "ADA-1 answer, now complete"}]
    database[CONVERSATIONS].replace_one({"_id": "c-1"}, edited, upsert=True)
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 1
    said = "".join(capsys.readouterr())
    assert "with other content" in said
    assert "'c-1' stands where its conversation's document stands" in said
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1
    database[LEGACY_TURNS].delete_one({"_id": "c-1"})  # the moved turn edited: as advised
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    assert _served_questions(wire_uri, database, "c-1") == ["ADA-1 question", "ADA-2 question"]
    assert _served_questions(wire_uri, database, "c-2") == ["BOB-1 question"]
    assert database[MESSAGES].find_one({"content": "ADA-1 answer, now complete"}) is not None


@pytest.mark.wire
def test_a_rollback_by_copying_of_turns_under_their_conversations_ids_is_not_taken_as_moved(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A rollback by copying, its moved-aside collection left standing, of a database whose
    conversations' ids are their first turns' `_id`s: every turn is back, `c-1-2` too, which
    stands where no conversation's document stands. It is not taken for turns the old
    service saved again over their conversations' documents: refused (exit 1), nothing
    moved, the way out of a rollback given."""
    _first_turn_ids(database, bob=True)
    assert cli(wire_uri, database, "run") == 0
    database[CONVERSATIONS].drop()  # the rollback: documents away, the turns copied back
    database[CONVERSATIONS].insert_many(list(database[LEGACY_TURNS].find()))
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 1
    said = capsys.readouterr().err
    assert f"drop {LEGACY_TURNS} or rename it away" in said
    assert database[CONVERSATIONS].count_documents({}) == 3
    assert database[CONVERSATIONS].find_one({"turn_count": {"$exists": True}}) is None


@pytest.mark.wire
@pytest.mark.parametrize(
    "standing", ["created by a service left running", "a run still writing", "an earlier release's"]
)
def test_a_rollback_is_refused_whatever_other_conversations_document_stands(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    standing: str,
) -> None:
    """MIGRATION.md, "Rollback": a collection a rollback by copying left standing holds the
    turns of before it, and the second attempt's `run` refuses it. Another conversation's
    document standing after the rollback tells nothing of `d-1`'s turns: one a new service
    left running created (`d-9`), one a run still writing during the rollback wrote (`d-2`),
    an earlier release's left in place (no epoch). `run`, `verify` and `finish` exit 1 and
    `t-2`, which the old service deleted after the rollback, is never served (was: any
    conversation document standing, or one a run wrote, was taken to show no rollback: the
    leftover merged back, `t-2` served again, `verify` and `finish` 0)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "d-1", 0, "ONE"), legacy_turn("t-2", "d-1", 1, "SECRET"),
         legacy_turn("t-3", "d-2", 2, "OTHER")]
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    written = database[CONVERSATIONS].find_one({"_id": "d-2"})
    database[CONVERSATIONS].drop()  # the rollback: documents away, the turns copied back
    database[CONVERSATIONS].insert_many(list(database[LEGACY_TURNS].find()))
    database[CONVERSATIONS].delete_one({"_id": "t-2"})  # the old service, after the rollback
    if standing == "a run still writing":
        database[CONVERSATIONS].insert_one(written)
    elif standing == "an earlier release's":
        database[CONVERSATIONS].insert_one(
            {"_id": "e-1", "user_id": "u-1", "turn_count": 1, "message_count": 2}
        )
    else:

        async def a_new_conversation(db: Any) -> None:
            new = [{"role": "user", "content": "new"}]
            await AgentMessageLogger(db).log_messages("d-9", new, user_id="u-9")

        _on_its_database(wire_uri, database, a_new_conversation)
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 1
    assert f"if a rollback copied the turns back, drop {LEGACY_TURNS}" in capsys.readouterr().err
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1
    assert "SECRET question" not in (_served_questions(wire_uri, database, "d-1") or [])


def _stopped_before_its_first_document(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run stopped (SIGTERM) once the state records that it writes documents, before its
    first batch writes one (`documents_written_at` set, no document a run wrote standing)."""

    def recorded_then_stopped(run: explode.Explosion, ids: list[Any]) -> None:
        run._record_documents()
        raise cli_module.Stopped

    monkeypatch.setattr(explode.Explosion, "batch", recorded_then_stopped)


@pytest.mark.wire
def test_a_turn_saved_again_after_a_run_stopped_before_its_first_document_is_never_a_rollback(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run stopped after the state recorded that it writes documents, before its first;
    the old service saves `d-2`'s moved turn again unchanged. No document a run wrote
    stands, so `run` refuses (exit 1), but never says a rollback left the collection: it
    says when a run started writing documents and the way out of each cause, and the one
    for no rollback, followed word for word, loses nothing (was: "a run wrote some since the
    move: a collection a rollback left standing, drop it"; followed, `d-1` and `d-3` were
    lost, `verify` and `finish` 0)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn(f"t-{n}", f"d-{n}", n, f"T{n}") for n in range(1, 4)]
    )
    with monkeypatch.context() as stopped:
        _stopped_before_its_first_document(stopped)
        assert cli(wire_uri, database, "run") != 0
    assert database[CONVERSATIONS].count_documents({}) == 0
    saved = _save_a_moved_turn_again(database, "d-2")
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 1
    said = capsys.readouterr().err
    assert "left standing" not in said
    assert "a run started writing conversation documents at" in said
    assert f"If no rollback happened, delete from {CONVERSATIONS}" in said
    database[CONVERSATIONS].delete_one({"_id": saved})  # as advised: no rollback happened
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    for n in range(1, 4):
        assert _served_questions(wire_uri, database, f"d-{n}") == [f"T{n} question"]


@pytest.mark.wire
def test_a_moved_turn_edited_after_the_move_is_refused_with_advice_that_never_duplicates(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The old service completes a turn by an upsert by `_id` just after the run moved it: the
    turn in `agent_conversations` holds other content than its moved copy. `run` refuses
    (exit 1), naming whose each is (conversation, user, time) and the moved turn edited first:
    delete its copy from `agent_conversations_deprecated`; another turn: another `_id`.
    Followed (the same conversation, user and time: the moved turn edited), the next run
    migrates the edited turn in its place: the question served once, with the whole answer,
    `finish` exit 0 (was: the only advice was another `_id`, which served the question twice,
    the stale answer beside the whole one, `finish` exit 0)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "ONE"), legacy_turn("t-3", "c-2", 0, "THREE")]
    )
    assert cli(wire_uri, database, "run") == 0
    completed = {"response_parts": [{"type": "text", "content": "ONE answer, now complete"}]}
    moved = database[LEGACY_TURNS].find_one({"_id": "t-1"})
    database[CONVERSATIONS].replace_one({"_id": "t-1"}, moved | completed, upsert=True)
    capsys.readouterr()

    assert cli(wire_uri, database, "run") == 1
    said = "".join(capsys.readouterr())
    assert "conversation 'c-1', user 'u-1'" in said
    delete_copy = said.find(f"delete its copy from {LEGACY_TURNS}")
    another_id = said.find("another _id")
    assert -1 < delete_copy < another_id
    assert database[LEGACY_TURNS].delete_one({"_id": "t-1"}).deleted_count == 1  # as advised
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0

    async def served(db: Any) -> list[Any]:
        store = ConversationStore(db)
        return [(m.role, m.content) for m in await store.transcript("c-1", user_id="u-1")]

    assert _on_its_database(wire_uri, database, served) == [
        ("user", "ONE question"), ("assistant", "ONE answer, now complete")
    ]  # fmt: skip


def pairing_turns(case: str) -> list[dict[str, Any]]:
    """One conversation the converter and `verify` once paired apart: a `calc` result under
    an empty id before a `search` call under `""` and a `calc` call naming none; or a `g`
    result under `a` in turn 2, `a` the id turn 1's history gives its `f` call; or, turn 1's
    history giving its `f` calls `b` and `a` and returning its `f` result under `a`, a `g`
    result under `b` in turn 2, `b` left unanswered."""
    if case == "empty id":
        return [
            legacy_turn("t-1", "c-1", 0, "ONE")
            | {"response_parts": [
                {"type": "tool_result", "tool_name": "calc", "result": None, "tool_call_id": ""},
                {"type": "tool_call", "tool_name": "search", "args": {"q": 1}, "tool_call_id": ""},
                {"type": "tool_call", "tool_name": "calc", "args": {"q": 2}}]},
        ]  # fmt: skip
    calls = [{"type": "tool_call", "tool_name": "f", "args": {"k": k}} for k in (1, 2)]
    ids = ["a"] if case == "history's id" else ["b", "a"]
    history = [{"part_kind": "tool-call", "tool_name": "f", "args": call["args"],
                "tool_call_id": call_id}
               for call, call_id in zip(calls, ids, strict=False)]  # fmt: skip
    parts: list[dict[str, Any]] = calls[: len(ids)]
    if case == "history's return":
        history.append({"part_kind": "tool-return", "tool_name": "f", "content": "F",
                        "tool_call_id": "a"})  # fmt: skip
        parts.append({"type": "tool_result", "tool_name": "f", "result": "F"})
    return [
        legacy_turn("t-1", "c-1", 0, "ONE")
        | {"response_parts": parts, "message_history_json": json.dumps([{"parts": history}])},
        legacy_turn("t-2", "c-1", 1, "TWO")
        | {"response_parts": [{"type": "tool_result", "tool_name": "g", "result": "G",
                               "tool_call_id": ids[0]}]},
    ]  # fmt: skip


@pytest.mark.wire
@pytest.mark.parametrize("case", ["empty id", "history's id", "history's return"])
def test_verify_pairs_a_tool_result_as_run_stored_it_so_finish_can_pass(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    case: str,
) -> None:
    """`verify` pairs each result with the call `run` stored it answering (one rule, the same
    ids, the same returns its history tells): the conversation shows no difference, and
    `finish` passes once the operator accepted what the conversion left unplaced (the
    guessed pairing of the `g` result), as the runbook says (was: `verify` exited 1 on every
    run and `finish --accept` could not clear it)."""
    database[CONVERSATIONS].insert_many(pairing_turns(case))
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 0, capsys.readouterr().out
    if case != "empty id":
        assert cli(wire_uri, database, "finish") == 1
        assert cli(wire_uri, database, "finish", "--accept", "c-1", "--note", "checked") == 0
    assert cli(wire_uri, database, "finish") == 0, capsys.readouterr().out


NON_JSON_TEXTS: dict[str, Any] = {
    "user_message": bson.Binary.from_uuid(uuid.UUID("12345678-1234-5678-1234-567812345678")),
    "text": datetime(2024, 2, 29, 12, tzinfo=UTC),
    "error": bson.ObjectId("65e1f0000000000000000001"),
    "name": b"\xffname",
    "response_text": bson.Decimal128("1.50"),
}
"""A value JSON cannot encode in each field a message's text is made of."""


def _non_json_turns() -> list[dict[str, Any]]:
    values = NON_JSON_TEXTS
    parts = [
        {"type": "text", "content": values["text"]},
        {"type": "error", "message": values["error"]},
    ]
    typed = legacy_turn("t-1", "c-typed", 0, "typed")
    typed |= {
        "user_message": values["user_message"],
        "name": values["name"],
        "response_parts": parts,
    }
    summed = legacy_turn("t-2", "c-summed", 1, "summed")
    del summed["response_parts"]
    summed["response_text"] = values["response_text"]
    return [typed, summed]


@pytest.mark.wire
def test_a_text_made_of_a_value_json_cannot_encode_is_kept_as_found_through_the_drop(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's message, a text, an error, a name or a response text holding a BSON value
    JSON cannot encode (a UUID, a time, an ObjectId, bytes, a Decimal128) is stored as the
    JSON text spelling it, and a placed `non_json_value` problem keeps the value as found:
    the gate checks each such record field by field, so the drop never takes the only copy."""
    database[CONVERSATIONS].insert_many(_non_json_turns())

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0, capsys.readouterr().out
    records = list(database[PROBLEMS].find({"kind": "non_json_value"}))
    assert all(r["placed"] for r in records)
    kept = {r["field"] if r["field"] != "response_parts" else r["part_index"]: r for r in records}
    assert kept["user_message"]["content"] == NON_JSON_TEXTS["user_message"]
    assert kept[0]["content"] == NON_JSON_TEXTS["text"]
    assert kept[1]["content"] == {"type": "error", "message": NON_JSON_TEXTS["error"]}
    assert kept["name"]["content"] == NON_JSON_TEXTS["name"]
    assert kept["response_text"]["content"] == NON_JSON_TEXTS["response_text"]
    assert len(records) == len(NON_JSON_TEXTS)

    database[PROBLEMS].update_one(
        {"_id": kept["user_message"]["_id"]}, {"$set": {"content": "EjRWeBI0VngSNFZ4EjRWeA=="}}
    )
    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert LEGACY_TURNS not in database.list_collection_names()
    after = database[PROBLEMS].find_one({"kind": "non_json_value", "field": "user_message"})
    assert after is not None
    assert after["content"] == NON_JSON_TEXTS["user_message"]


@pytest.mark.wire
def test_two_tools_called_under_one_id_verify_and_pass_the_gate(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A turn calls `search` and `pay` under one id, each answered: the migration pairs each
    result with its own tool's call, and `verify` and `finish` read it the same way."""
    document = legacy_turn("t-1", "c-1", 0, "book and pay")
    document["response_parts"] = [
        {"type": "tool_call", "tool_name": "search", "args": {"q": "A"}, "tool_call_id": "x"},
        {"type": "tool_call", "tool_name": "pay", "args": {"amount": 5}, "tool_call_id": "x"},
        {"type": "tool_result", "tool_name": "pay", "result": "PAID", "tool_call_id": "x"},
        {"type": "tool_result", "tool_name": "search", "result": "FOUND", "tool_call_id": "x"},
    ]
    database[CONVERSATIONS].insert_one(document)

    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 0, capsys.readouterr().out
    assert cli(wire_uri, database, "finish") == 0, capsys.readouterr().out


@pytest.mark.wire
def test_verify_finds_a_conversation_by_the_derived_id_it_prints(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`verify --conversation` takes the id `verify` and `finish` name a conversation by,
    the one derived from a legacy id that is not an identifier too, as `run` does."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", NOT_AN_IDENTIFIER, 0, "«D»"))
    assert cli(wire_uri, database, "run") == 0
    derived = derived_conversation_id(NOT_AN_IDENTIFIER)
    capsys.readouterr()

    assert cli(wire_uri, database, "verify", "--conversation", derived) == 0
    assert "1 match, 0 differ" in capsys.readouterr().out
    database[MESSAGES].delete_many({"conversation_id": derived})
    assert cli(wire_uri, database, "verify", "--conversation", derived) == 1
    assert f"{derived}: line 0: legacy has 'user: «D» question' only" in capsys.readouterr().out
    assert cli(wire_uri, database, "run", "--conversation", derived) == 0
    assert database[MESSAGES].count_documents({"conversation_id": derived}) == 2


@pytest.mark.wire
@pytest.mark.parametrize("command", ["verify", "run"])
def test_a_conversation_option_naming_no_conversation_is_misuse(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "D"))
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()

    assert cli(wire_uri, database, command, "--conversation", "c-typo") == 2
    err = capsys.readouterr().err
    assert f"no legacy turns for conversation 'c-typo' in {LEGACY_TURNS}" in err
    assert "lists" not in err


@pytest.mark.wire
def test_a_turn_logged_after_the_move_dated_earlier_by_its_caller_needs_no_copy(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The rollback window is over, the dual write unset; a runtime logs a turn of history
    with the times it had: when it was logged is the logger's own clock (its turn record),
    not its messages' times, so it is no copy the old service deleted."""
    _rolled_back_with_a_live_turn(wire_uri, database)
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-2", "«HISTORY»", at=datetime(2023, 5, 1, tzinfo=UTC))

    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0


def _late_legacy_turn(database: Database[dict[str, Any]], cid: str) -> None:
    """An old-service writer never stopped logs a turn into `cid` after the move: the next
    `run` moves it aside (a later move than every live turn before it)."""
    database[CONVERSATIONS].insert_one(legacy_turn("late-1", cid, 9, "«LATE»"))


def _gate_says(
    wire_uri: str, database: Database[dict[str, Any]], capsys: Any, *, exits: int
) -> list[str]:
    """What `verify` and `finish` print, each run once and exiting with `exits`."""
    said = []
    for command in ("verify", "finish"):
        capsys.readouterr()
        assert cli(wire_uri, database, command) == exits
        said.append(capsys.readouterr().out)
    return said


def _no_copy_gone(out: str) -> None:
    assert "is gone from the legacy collection" not in out
    assert "pop_last_message" not in out


def _moved_aside_and_the_gate_passes(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`run` moves the late legacy turn aside; `verify` and `finish --drop-legacy` then pass,
    naming no copy gone."""
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    _no_copy_gone(capsys.readouterr().out)


@pytest.mark.wire
@pytest.mark.parametrize("late_into", ["c-2", "c-1"])
def test_a_turn_logged_after_the_window_is_no_copy_gone_once_a_late_legacy_turn_is_moved(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    late_into: str,
) -> None:
    """The runbook: a live turn dual-written, `finish` 0, the rollback window over and the
    dual write unset, a turn logged without a copy; then an old-service writer never stopped
    logs a turn (into another conversation, or this one) and `run` moves it aside. The turn
    logged after the window was never copied, so no copy of it went missing: the gate never
    advises popping it (was: "the dual-written copy of the live turn 'live-1' is gone",
    and following the advice deleted the person's turn)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-0", "c-1", 0, "OLD"), legacy_turn("t-2", "c-2", 0, "OTHER")]
    )
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-0", "«COPIED»", dual_write=True)
    assert cli(wire_uri, database, "finish") == 0
    log_live(wire_uri, database, "c-1", "live-1", "«AFTER THE WINDOW»")
    _late_legacy_turn(database, late_into)

    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == (0 if late_into == "c-2" else 1)
    assert cli(wire_uri, database, "finish") == (0 if late_into == "c-2" else 1)
    _no_copy_gone(capsys.readouterr().out)
    if late_into == "c-1":  # a late turn beside live ones: `conversation_changed_since`
        assert cli(wire_uri, database, "finish", "--accept", "c-1", "--note", "kept") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert database[MESSAGES].count_documents({"turn_id": "live-1"}) == 2


@pytest.mark.wire
def test_a_turn_of_a_conversation_started_live_in_the_window_logged_after_it_is_no_copy_gone(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A conversation the new service started during the rollback window (its turns
    dual-written, no legacy turn of its own): a turn logged in it after the window, once a
    late legacy turn is moved aside, is no copy gone."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-2", "c-2", 0, "OTHER"))
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "new-1", "w-0", "«COPIED»", dual_write=True)
    assert cli(wire_uri, database, "finish") == 0
    log_live(wire_uri, database, "new-1", "w-1", "«AFTER THE WINDOW»")
    _late_legacy_turn(database, "c-2")

    _moved_aside_and_the_gate_passes(wire_uri, database, capsys)
    assert database[MESSAGES].count_documents({"turn_id": "w-1"}) == 2


@pytest.mark.wire
def test_a_turn_logged_with_the_dual_write_off_throughout_is_no_copy_gone(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The dual write off from the start (its default): a live turn has no copy, and a late
    legacy turn moved aside after it makes none go missing."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-0", "c-1", 0, "OLD"), legacy_turn("t-2", "c-2", 0, "OTHER")]
    )
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-1", "«NEVER COPIED»")
    _late_legacy_turn(database, "c-2")

    _moved_aside_and_the_gate_passes(wire_uri, database, capsys)


@pytest.mark.wire
def test_a_dual_written_copy_gone_is_work_left_whenever_the_legacy_turns_were_moved(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The check the gate keeps: a turn the dual write copied whose copy is gone while its
    messages are stored is work left, whether or not a move came after it (a late legacy
    turn moved aside): the record of its copy says so, not the time of a move."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-0", "c-1", 0, "OLD"), legacy_turn("t-2", "c-2", 0, "OTHER")]
    )
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-0", "«COPIED»", dual_write=True)
    database[LEGACY_TURNS].delete_one({"dual_write": True})

    capsys.readouterr()
    assert cli(wire_uri, database, "finish") == 1
    assert "copy of the live turn 'live-0' is gone" in capsys.readouterr().out
    _late_legacy_turn(database, "c-2")
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 1
    assert "copy of the live turn 'live-0' is gone" in capsys.readouterr().out


@pytest.mark.wire
def test_the_gate_names_the_conversations_whose_dual_written_copies_recorded_nothing(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Copies an earlier release dual-wrote recorded nothing (no `dual_write_copy`), so the
    gate cannot tell the old service deleted one: `verify` and `finish` say so, naming the
    conversation, their exit codes unchanged (was: silent, `finish` saying every legacy
    conversation is migrated while a deleted exchange was still served)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-0", "c-1", 0, "OLD"), legacy_turn("t-2", "c-2", 0, "OTHER")]
    )
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-0", "«GONE»", dual_write=True)
    log_live(wire_uri, database, "c-1", "live-1", "«KEPT»", dual_write=True)
    database[lease.STATE].delete_many({"kind": dual_writes.COPY_RECORD})
    database[MESSAGES].update_many({}, {"$unset": {"copy_owed": ""}})  # nor marked its turns
    database[LEGACY_TURNS].delete_one({"dual_write": True, "turn_id": "live-0"})

    said = "c-1: its dual-written copies recorded nothing"
    for out in _gate_says(wire_uri, database, capsys, exits=0):
        assert said in out
        assert "written before this release recorded copies" in out
        assert "c-2:" not in out


@pytest.mark.wire
def test_a_copy_of_a_conversation_started_live_deleted_after_a_rollback_is_work_left(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A conversation the new service started in the window: after a rollback the old
    service deletes one of its copies, and the second attempt's run writes its document
    with the life its live turns carry, in which the copy was recorded: the copy gone is
    work left, the other turn's is there."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-2", "c-2", 0, "OTHER"))
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "new-1", "w-0", "«KEPT»", dual_write=True)
    log_live(wire_uri, database, "new-1", "w-1", "«DELETED»", dual_write=True)
    roll_back(database, clear_messages=False)
    database[CONVERSATIONS].delete_one({"dual_write": True, "turn_id": "w-1"})

    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "finish") == 1
    out = capsys.readouterr().out
    assert "copy of the live turn 'w-1' is gone" in out
    assert "'w-0' is gone" not in out


@pytest.mark.wire
def test_a_copy_its_dual_write_mark_removed_as_finish_advises_is_no_copy_gone(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`finish` advises, for a copy the old service edited: restore its messages, or remove
    its `dual_write` mark so `run` takes it as a legacy turn. Unmarked, it is still there:
    what is left is what `run` records of it, which the operator can accept."""
    _rolled_back_with_a_live_turn(wire_uri, database)
    edit = {"$set": {"user_message": "«LIVE» edited on the old service"}}
    database[CONVERSATIONS].update_one({"dual_write": True}, edit)
    assert cli(wire_uri, database, "run") == 0
    database[LEGACY_TURNS].update_one({"dual_write": True}, {"$unset": {"dual_write": ""}})

    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "finish", "--accept", "c-1", "--note", "kept") == 0
    assert "is gone" not in capsys.readouterr().out


@pytest.mark.wire
def test_live_messages_left_after_the_migrated_ones_of_a_deleted_conversation_are_work_left(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """After a rollback the old service deletes a conversation holding a live turn; `finish`
    names it, and the operator deletes its migrated messages only: its live ones, from `seq`
    2 on, are left with no document and no legacy turn. Work left, never a drop that leaves
    them served; named as the deletion the copy's record shows, never with the advice to put
    the document back (was: "its messages are stored without a conversation document")."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-0", "c-1", 0, "OLD0"), legacy_turn("k-0", "c-keep", 0, "KEEP")]
    )
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-1", "«SECRET»", dual_write=True)
    roll_back(database, clear_messages=False)
    database[CONVERSATIONS].delete_many({"conversation_id": "c-1"})
    assert cli(wire_uri, database, "run") == 0
    database[MESSAGES].delete_many({"conversation_id": "c-1", "turn_id": {"$regex": "^legacy-"}})

    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    out = capsys.readouterr().out
    assert "c-1: the dual-written copy of the live turn 'live-1' is gone" in out
    assert "Put its conversation document back" not in out
    assert database[LEGACY_TURNS].count_documents({}) == 1


@pytest.mark.wire
def test_a_copy_the_old_service_took_part_of_away_is_work_left(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """After a rollback a person removes the answer of a dual-written turn on the old service
    (a redaction): its stored messages, which the migration never rewrites, would go on
    serving it. A copy holding less than its messages is an edit: work left."""
    _rolled_back_with_a_live_turn(wire_uri, database)
    database[CONVERSATIONS].update_one(
        {"dual_write": True}, {"$set": {"response_parts": []}, "$unset": {"response_text": ""}}
    )

    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert "«LIVE»" in capsys.readouterr().out
    assert database[LEGACY_TURNS].count_documents({}) == 3


def log_live_call_answered_later(wire_uri: str, database: Database[dict[str, Any]]) -> None:
    """Two live turns of "c-1", dual-written: A makes a call, B logs its result (a secret)
    and the answer. B's copy holds a result that no call of B answers."""

    async def log() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        db = client[database.name]
        logger = AgentMessageLogger(db, observers=[LegacyTurns(db, dual_write=True)])
        call = {"id": "call-9", "function": {"name": "book", "arguments": "{}"}}
        try:
            await logger.log_messages(
                "c-1", [{"role": "user", "content": "Book it"},
                        {"role": "assistant", "tool_calls": [call]}],
                user_id="u-1", turn_id="live-A",
            )  # fmt: skip
            await logger.log_messages(
                "c-1", [{"role": "user", "content": "yes"},
                        {"role": "tool", "tool_call_id": "call-9", "content": "«SECRET RESULT»"},
                        {"role": "assistant", "content": "booked"}],
                user_id="u-1", turn_id="live-B",
            )  # fmt: skip
        finally:
            await client.close()

    asyncio.run(log())


@pytest.mark.wire
@pytest.mark.parametrize("edit", ["kept", "redacted", "duplicated"])
def test_a_result_of_an_earlier_calls_taken_out_of_its_copy_or_repeated_is_work_left(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    edit: str,
) -> None:
    """A live turn logs the result of the call an earlier live turn made; after a rollback a
    person takes that result out of the turn's copy on the old service (a redaction), or
    the copy gets it twice. Its stored messages would go on serving what the copy no longer
    holds, or hold once what it holds twice: work left. The copy left whole passes."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD0"))
    assert cli(wire_uri, database, "run") == 0
    log_live_call_answered_later(wire_uri, database)
    roll_back(database, clear_messages=False)
    copy = database[CONVERSATIONS].find_one({"dual_write": True, "turn_id": "live-B"})
    assert copy is not None
    secret = [p for p in copy["response_parts"] if "SECRET" in json.dumps(p)]
    others = [p for p in copy["response_parts"] if "SECRET" not in json.dumps(p)]
    edited = {"kept": None, "redacted": others, "duplicated": [*secret, *secret, *others]}[edit]
    if edited is not None:
        database[CONVERSATIONS].update_one(
            {"_id": copy["_id"]}, {"$set": {"response_parts": edited}}
        )

    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    expected = 0 if edit == "kept" else 1
    assert cli(wire_uri, database, "verify") == expected
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == expected
    assert ("«SECRET RESULT»" in capsys.readouterr().out) is bool(expected)
    assert (database[LEGACY_TURNS].count_documents({}) == 3) is bool(expected)


@pytest.mark.wire
def test_a_runtimes_name_on_a_live_turn_outlives_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A live turn names the conversation (`name=`), and its dual-written copy carries the
    name; after a rollback that edits nothing, the second attempt gives the conversation that
    name again, and the gate passes."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-0", "c-1", 0, "OLD0"), legacy_turn("t-1", "c-1", 1, "OLD1")]
    )
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-1", "«LIVE»", dual_write=True, name="Trip plan")
    roll_back(database, clear_messages=False)

    assert cli(wire_uri, database, "run") == 0
    assert database[CONVERSATIONS].find_one({"_id": "c-1"})["name"] == "Trip plan"  # type: ignore[index]
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


# -- whose content a conversation holds: its owner's, told apart, and nothing dropped ---------


def _pending_for(wire_uri: str, database: Database[dict[str, Any]], cid: str, user: str) -> Any:
    async def read(store: ConversationStore, _: AgentMessageLogger) -> Any:
        return await store.pending_hitl(cid, user_id=user)

    return _on_the_service(wire_uri, database, read, dual_write=False)


@pytest.mark.wire
def test_a_prompt_naming_another_user_than_the_owner_is_never_the_owners_and_needs_acceptance(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """One rule, the users a conversation's turns and prompts name: a pending prompt naming
    another user than the owner makes it a `mixed_user_ids` problem, is never the owner's
    pending prompt (before the run, after it, or accepted), and a problem keeps it whole."""
    at = datetime(2025, 3, 1, 10, tzinfo=UTC)
    database[LEGACY_TURNS].insert_one(
        {"_id": "a1", "conversation_id": "conv-a", "user_id": "alice", "created_at": at,
         "user_message": "book me a table", "response_parts": [{"type": "text", "content": "done"}]}
    )  # fmt: skip
    database[SESSION_HITL].insert_one(
        {"conversation_id": "conv-a", "user_id": "mallory", "request_id": "r9",
         "action": "wire_money", "params": {"to": "mallory-account"},
         "prompt": "«MALLORY» approve transfer?", "status": "pending",
         "created_at": at + timedelta(minutes=1)}
    )  # fmt: skip
    assert _pending_for(wire_uri, database, "conv-a", "alice") is None

    assert cli(wire_uri, database, "run") == 0
    assert _pending_for(wire_uri, database, "conv-a", "alice") is None
    mixed = database[PROBLEMS].find_one({"kind": "mixed_user_ids"})
    assert mixed is not None
    assert (mixed["placed"], mixed["content"]) == (
        False,
        {"alice": ["a1"], "mallory": ["session_hitl|r9"]},
    )
    assert "«MALLORY»" in kept_text(database)
    assert cli(wire_uri, database, "verify") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "finish") == 1
    left = next(ln for ln in capsys.readouterr().out.splitlines() if "conv-a" in ln)
    assert "'mallory'" in left, left
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1

    assert cli(wire_uri, database, "finish", "--accept", "conv-a", "--note", "told") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert _pending_for(wire_uri, database, "conv-a", "alice") is None


def _alone(key: str) -> str:
    """The id of the conversation a turn naming none is made of, going by `key`."""
    if re.fullmatch(r"[A-Za-z0-9_.:@|-]{1,100}", key):
        return f"legacy-turn-{key}"
    return "legacy-turn-h" + hashlib.sha256(key.encode()).hexdigest()[:32]


OID = "65e1a0000000000000000001"
ALIKE = [
    pytest.param(5, None, "5", "", ("alice", "alice"), '"5"', id="a-number-and-its-text"),
    pytest.param(
        bson.ObjectId(OID),
        None,
        OID,
        "  ",
        ("alice", "alice"),
        f'"{OID}"',
        id="an-objectid-and-its-text",
    ),
    pytest.param(
        "7", "", 7, None, ("carol", "dave"), '{"$numberInt": "7"}', id="two-users-text-first"
    ),
]


@pytest.mark.wire
@pytest.mark.parametrize(("first", "named", "later", "also", "users", "typed"), ALIKE)
def test_turns_naming_no_conversation_whose_ids_read_alike_are_each_a_conversation_of_their_own(
    wire_uri: str,
    database: Database[dict[str, Any]],
    first: Any,
    named: Any,
    later: Any,
    also: Any,
    users: tuple[str, str],
    typed: str,
) -> None:
    """Each is a conversation of its own, owned by its own user: the first in time keeps the
    id its `_id`'s text gives (`legacy-turn-5`, as an earlier run derived it), a later one
    goes by its `_id`'s extended JSON (hashed), as two turns of one conversation are told
    apart; the read fallback, a delete and the migration name them alike."""
    at = datetime(2025, 3, 1, 10, tzinfo=UTC)
    database[LEGACY_TURNS].insert_many(
        [
            {"_id": first, "conversation_id": named, "user_id": users[0], "created_at": at,
             "user_message": "«FIRST» question"},
            {"_id": later, "conversation_id": also, "user_id": users[1],
             "created_at": at + timedelta(minutes=1), "user_message": "«LATER» question"},
        ]
    )  # fmt: skip
    ids = (_alone(str(first)), _alone(typed))

    async def read(store: ConversationStore, _: AgentMessageLogger) -> list[list[str]]:
        return [
            [m.content or "" for m in await store.transcript(cid, user_id=user)]
            for cid, user in zip(ids, users, strict=True)
        ]

    assert _on_the_service(wire_uri, database, read) == [["«FIRST» question"], ["«LATER» question"]]
    assert cli(wire_uri, database, "run") == 0
    stored = {d["_id"]: d["user_id"] for d in database[CONVERSATIONS].find()}
    assert stored == dict(zip(ids, users, strict=True))
    for cid, text in zip(ids, ("«FIRST» question", "«LATER» question"), strict=True):
        assert [m["content"] for m in database[MESSAGES].find({"conversation_id": cid})] == [text]
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_delete_of_a_turn_naming_no_conversation_leaves_the_one_whose_id_reads_alike(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """Before the migration, dave deleting his conversation made of turn "5" takes his turn
    only, and carol's, `_id` 5, stays hers under `legacy-turn-5`."""
    at = datetime(2025, 3, 1, 10, tzinfo=UTC)
    database[LEGACY_TURNS].insert_many(
        [
            {"_id": 5, "conversation_id": None, "user_id": "carol", "created_at": at,
             "user_message": "«CAROL»"},
            {"_id": "5", "conversation_id": "", "user_id": "dave",
             "created_at": at + timedelta(minutes=1), "user_message": "«DAVE»"},
        ]
    )  # fmt: skip

    async def delete_daves(store: ConversationStore, _: AgentMessageLogger) -> list[str]:
        await store.delete(_alone('"5"'), user_id="dave")
        return [m.content or "" for m in await store.transcript("legacy-turn-5", user_id="carol")]

    assert _on_the_service(wire_uri, database, delete_daves) == ["«CAROL»"]
    assert [d["_id"] for d in database[LEGACY_TURNS].find()] == [5]


@pytest.mark.wire
def test_a_conversation_whose_turns_hold_only_a_name_keeps_it_until_the_operator_accepts(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Turns converting to no message get no conversation document: the name they give it is
    kept in an unplaced problem, and `finish` holds the drop until an operator accepts it."""
    at = datetime(2025, 3, 1, 10, tzinfo=UTC)
    database[CONVERSATIONS].insert_many(
        [
            {"_id": "t1", "conversation_id": "conv-named", "user_id": "alice", "created_at": at,
             "name": "Tax return 2024 «NAME»"},
            legacy_turn("t2", "conv-other", 0, "hello"),
        ]
    )  # fmt: skip

    assert cli(wire_uri, database, "run") == 0
    [problem] = database[PROBLEMS].find({"conversation_id": "conv-named"})
    assert (problem["kind"], problem["placed"], problem["content"]) == (
        "name_without_messages",
        False,
        "Tax return 2024 «NAME»",
    )
    assert cli(wire_uri, database, "verify") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "finish") == 1
    assert "conv-named" in capsys.readouterr().out
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1

    assert cli(wire_uri, database, "finish", "--accept", "conv-named", "--note", "kept") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert "«NAME»" in kept_text(database)


@pytest.mark.wire
def test_an_earlier_name_of_a_renamed_conversation_outlives_the_drop(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """ "What finish guarantees": every piece of legacy content is in a message, a file or a
    problem record. A conversation named `Alpha` on its first turn and `Beta` on its second
    is stored as `Beta`; `Alpha` stays in a placed `earlier_name` problem, which the gate
    checks as it checks every placed problem and the drop leaves."""
    database[CONVERSATIONS].insert_many(
        [
            legacy_turn("n1", "c-names", 0, "first") | {"name": "Alpha «m1»"},
            legacy_turn("n2", "c-names", 1, "second") | {"name": "Beta «m4»"},
        ]
    )

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0
    database[PROBLEMS].update_one({"kind": "earlier_name"}, {"$set": {"content": "[redacted]"}})
    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0

    conversation = database[CONVERSATIONS].find_one({"_id": "c-names"})
    assert conversation is not None
    assert conversation["name"] == "Beta «m4»"
    assert "Alpha «m1»" in kept_text(database)


@pytest.mark.wire
def test_a_run_after_one_that_merged_turns_naming_no_conversation_keeps_the_firsts_ids(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """An earlier run merged `_id` 5 and `_id` "5" into `legacy-turn-5` (the later going by
    `"5"` in it, as the turn naming that id literally still does): the next run leaves the
    first's messages where they are, under their ids, and moves the later's to its own."""
    at = datetime(2025, 3, 1, 10, tzinfo=UTC)
    database[LEGACY_TURNS].insert_many(
        [
            {"_id": 5, "conversation_id": None, "user_id": "alice", "created_at": at,
             "user_message": "«FIRST»"},
            {"_id": "5", "conversation_id": "legacy-turn-5", "user_id": "alice",
             "created_at": at + timedelta(minutes=1), "user_message": "«LATER»"},
        ]
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0
    merged = {m["content"]: m["_id"] for m in database[MESSAGES].find()}
    assert database[MESSAGES].distinct("conversation_id") == ["legacy-turn-5"]

    database[LEGACY_TURNS].update_one({"_id": "5"}, {"$set": {"conversation_id": ""}})
    assert cli(wire_uri, database, "run") == 0
    found = {m["content"]: (m["conversation_id"], m["_id"]) for m in database[MESSAGES].find()}
    assert found["«FIRST»"] == ("legacy-turn-5", merged["«FIRST»"])
    assert found["«LATER»"][0] == _alone('"5"')
    assert len(found) == 2
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_erasing_the_other_user_of_a_mixed_conversation_under_ids_read_alike_keeps_the_owners(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The remedy for `mixed_user_ids`, erase the other user and `run` again, on a
    conversation filed under `42` (Alice's turn, then one naming no user) and `"42"` (Bob's):
    Bob owns it, so the turn naming no user is his part, whatever id it names. The erasure
    takes Alice's turn alone; the rerun, `verify` and `finish` pass, Bob's part whole."""
    database[CONVERSATIONS].insert_many(
        [
            owned_turn("a", 42, 0, "alice"),
            owned_turn("b", "42", 1, "bob"),
            legacy_turn("c", 42, 2, "«nobody named»") | {"user_id": None},
        ]
    )

    def bobs() -> list[Any]:
        async def read(store: ConversationStore, _: AgentMessageLogger) -> list[Any]:
            said = await store.transcript("42", user_id="bob")
            return [m.content for m in said if m.role == "user"]

        return list(_on_the_service(wire_uri, database, read, dual_write=False))

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 1
    _as_a_person(wire_uri, database, lambda s: s.erase_user("alice"))

    assert sorted(t["_id"] for t in database[LEGACY_TURNS].find()) == ["b", "c"]
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0, capsys.readouterr().out
    assert bobs() == ["«bob private» question", "«nobody named» question"]
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0
    assert bobs() == ["«bob private» question", "«nobody named» question"]


DUAL_WRITTEN_SHAPES = TURN_SHAPES | {"a text beside an error, and a native item": NATIVE_SHAPE}


@pytest.mark.wire
@pytest.mark.parametrize("shape", DUAL_WRITTEN_SHAPES.values(), ids=list(DUAL_WRITTEN_SHAPES))
def test_a_held_dual_written_turn_of_any_shape_is_no_difference(
    wire_uri: str, database: Database[dict[str, Any]], shape: list[dict[str, Any]]
) -> None:
    """MIGRATION.md, transition flags: the copy converts back to its messages, in order, so a
    held copy its messages hold is no work left, whatever shape its messages have."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-o", "c-other", 0, "O"))
    assert cli(wire_uri, database, "run") == 0
    _logged(wire_uri, database, "c-dual", shape, dual_write=True)

    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_dual_written_native_item_after_a_rollback_is_work_left_until_accepted(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """No legacy part holds a runtime's own item: after a rollback clearing agent_messages,
    the copy converts without it, and the gate counts it (kept in a problem) until accepted;
    the text beside an error comes back."""
    shape = NATIVE_SHAPE
    database[CONVERSATIONS].insert_one(legacy_turn("t-o", "c-other", 0, "O"))
    assert cli(wire_uri, database, "run") == 0
    _logged(wire_uri, database, "c-dual", shape, dual_write=True)
    roll_back(database, clear_messages=True)

    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 1
    assert "«PARTIAL»" in json.dumps(stored_messages(database), default=str, ensure_ascii=False)
    assert "«NATIVE»" in kept_text(database)
    accept = ("--accept", "c-dual", "--note", "native item kept in its problem")
    assert cli(wire_uri, database, "finish", *accept) == 0


def _call(call_id: str, name: str = "lookup") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


_APPROVAL = {"action": "approve", "params": {"amount": 5}, "request_id": "r1"}
_FILE = {"filename": "a.txt", "file_type": "text/plain", "size": 1, "parsed_text": "a"}
NOT_EXACT_COPIES: dict[str, list[list[dict[str, Any]]]] = {
    "an approval's result logged in the turn after its call": [
        [{"role": "user", "content": "pay the bill"},
         {"role": "assistant", "content": "Pay 5 EUR?", "tool_calls": [_call("c1", "pay")],
          "hitl_action": _APPROVAL | {"tool_call_ids": ["c1"]}}],
        [{"role": "user", "content": "yes"},
         {"role": "tool", "tool_call_id": "c1", "content": "paid"},
         {"role": "assistant", "content": "done"}]],
    "a slow tool's result logged after the user's next message": [
        [{"role": "user", "content": "q1"},
         {"role": "assistant", "content": None, "tool_calls": [_call("c1", "slow")]}],
        [{"role": "user", "content": "q2"},
         {"role": "tool", "tool_call_id": "c1", "content": "late"},
         {"role": "assistant", "content": "done"}]],
    "results in another order than their calls": [[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1", "a"), _call("c2", "b")]},
        {"role": "tool", "tool_call_id": "c2", "content": "B"},
        {"role": "tool", "tool_call_id": "c1", "content": "A"}]],
    "a text said between two results": [[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1", "a"), _call("c2", "b")]},
        {"role": "tool", "tool_call_id": "c2", "content": "B"},
        {"role": "assistant", "content": "B is in; waiting for A"},
        {"role": "tool", "tool_call_id": "c1", "content": "A"}]],
    "an empty second user message": [[
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": ""}, {"role": "assistant", "content": "b"}]],
    "an empty response": [[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "ok"}]],
    "an empty text beside calls": [[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [_call("c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"}]],
    "an empty user text beside an upload": [[
        {"role": "user", "content": "", "upload": _FILE}, {"role": "assistant", "content": "ok"}]],
}  # fmt: skip
"""Live turns whose dual-written copies convert, alone in a second attempt, to other messages
than the live service stored (the legacy format cannot say them)."""


def _log_turns(
    wire_uri: str,
    database: Database[dict[str, Any]],
    turns: list[list[dict[str, Any]]],
    rules: TurnRules | None = None,
) -> list[dict[str, Any]]:
    """`turns` logged as live turns of "c-dual" (user "u-1", dual write on, the logger's
    `rules`); the messages stored."""

    async def log() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            db = client[database.name]
            legacy = LegacyTurns(db, rules=rules, read_fallback=True, dual_write=True)
            logger = AgentMessageLogger(db, observers=[legacy], legacy=legacy, rules=rules)
            for n, turn in enumerate(turns):
                await logger.log_messages("c-dual", turn, user_id="u-1", turn_id=f"live-{n}")
        finally:
            await client.close()

    asyncio.run(log())
    return list(database[MESSAGES].find({"conversation_id": "c-dual"}).sort("seq"))


def _said(messages: list[dict[str, Any]]) -> list[Any]:
    return [
        (m["role"], m.get("content"), [c["id"] for c in m.get("tool_calls") or []],
         m.get("tool_call_id"), (m.get("hitl_action") or {}).get("request_id"))
        for m in messages
    ]  # fmt: skip


def _not_exact_until_accepted(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> list[dict[str, Any]]:
    """After a rollback that cleared agent_messages: `run` exits 0, `verify` and `finish`
    exit 1 naming the conversation's `dual_write_not_exact` problem until an operator
    accepts it, then pass; its problems."""
    roll_back(database, clear_messages=True)
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1
    out = capsys.readouterr().out
    assert "c-dual" in out, out
    assert "dual_write_not_exact" in out, out
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    accept = ("--accept", "c-dual", "--note", "checked against the live service's backup")
    assert cli(wire_uri, database, "finish", *accept) == 0
    assert cli(wire_uri, database, "verify") == 0
    return list(database[PROBLEMS].find({"kind": "dual_write_not_exact"}))


@pytest.mark.wire
@pytest.mark.parametrize("turns", NOT_EXACT_COPIES.values(), ids=list(NOT_EXACT_COPIES))
def test_a_dual_written_copy_converting_to_other_messages_is_work_left_until_accepted(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    turns: list[list[dict[str, Any]]],
) -> None:
    """MIGRATION.md, Rollback: a copy converted without its live messages (agent_messages
    cleared) must give exactly those, or the gate says it does not: never an exit 0 for a
    conversation whose messages came back otherwise than the live service stored them."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-o", "c-other", 0, "O"))
    assert cli(wire_uri, database, "run") == 0
    live = _said(_log_turns(wire_uri, database, turns))

    problems = _not_exact_until_accepted(wire_uri, database, capsys)

    assert problems
    assert {p["conversation_id"] for p in problems} == {"c-dual"}
    assert not any(p["placed"] for p in problems)
    assert _said(list(database[MESSAGES].find({"conversation_id": "c-dual"}).sort("seq"))) != live


@pytest.mark.wire
@pytest.mark.parametrize("shape", TURN_SHAPES.values(), ids=list(TURN_SHAPES))
def test_a_dual_written_copy_of_any_shape_converts_back_exactly_after_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]], shape: list[dict[str, Any]]
) -> None:
    """Every shape the legacy format can say comes back as its messages (a response's text
    and calls as two responses, the one documented change) and the gate passes unasked."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-o", "c-other", 0, "O"))
    assert cli(wire_uri, database, "run") == 0
    live = _log_turns(wire_uri, database, [shape])
    roll_back(database, clear_messages=True)

    _second_attempt(wire_uri, database)

    back = list(database[MESSAGES].find({"conversation_id": "c-dual"}).sort("seq"))
    assert exact_form(message_adapter.validate_python(m) for m in back) == exact_form(
        message_adapter.validate_python(m) for m in live
    )
    assert database[PROBLEMS].count_documents({"kind": "dual_write_not_exact"}) == 0


@pytest.mark.wire
def test_a_dual_written_copy_holding_texts_cut_to_fit_is_work_left_naming_their_whole_texts(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live turn whose whole texts do not fit one legacy document is copied with its texts
    cut: converted after a rollback it gives the cut texts, so the gate holds the drop back,
    and the problem names the GridFS files keeping them whole, for an operator to restore."""
    from agent_store.legacy import _source

    monkeypatch.setattr(_source, "MAX_LEGACY_DOCUMENT_BYTES", 30_000)
    database[CONVERSATIONS].insert_one(legacy_turn("t-o", "c-other", 0, "O"))
    assert cli(wire_uri, database, "run") == 0
    page = "p" * 40_000 + "«END OF PAGE»"
    turn = [
        {"role": "user", "content": "scrape"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1", "scrape")]},
        {"role": "tool", "tool_call_id": "c1", "content": page},
        {"role": "assistant", "content": "done"},
    ]
    live = _log_turns(wire_uri, database, [turn], TurnRules(max_message_bytes=16_384))
    [blob] = [m["truncated"]["content"]["blob_id"] for m in live if m.get("truncated")]

    [problem] = _not_exact_until_accepted(wire_uri, database, capsys)

    assert problem["content"]["whole_texts"] == [blob]
    assert blob in problem["detail"]
    files = gridfs.GridFS(database, collection=BLOB_BUCKET)
    assert files.get(blob).read().decode() == page


CUT_COPIES: dict[str, TurnRules | None] = {
    "texts cut only to fit the copy": None,
    "texts the store cut, kept whole in GridFS": TurnRules(max_message_bytes=16_384),
}
"""How a live turn's copy comes to hold cut texts: cut further to fit one legacy document
(the store kept them whole in `agent_messages`), or cut by the store to its bound and too
large whole for one legacy document (GridFS keeps them whole)."""


def _log_cut_copy(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    rules: TurnRules | None,
) -> None:
    """A live turn of "c-dual" whose dual-written copy holds cut texts (`CUT_COPIES`), beside
    a migrated conversation, then the runbook's rollback keeping `agent_messages`."""
    from agent_store.legacy import _source

    monkeypatch.setattr(_source, "MAX_LEGACY_DOCUMENT_BYTES", 30_000)
    database[CONVERSATIONS].insert_one(legacy_turn("t-o", "c-other", 0, "O"))
    assert cli(wire_uri, database, "run") == 0
    turn = [
        {"role": "user", "content": "scrape"},
        {"role": "assistant", "content": None, "tool_calls": [_call("c1", "scrape")]},
        {"role": "tool", "tool_call_id": "c1", "content": "p" * 40_000 + "«END OF PAGE»"},
        {"role": "assistant", "content": "done"},
    ]
    _log_turns(wire_uri, database, [turn], rules)
    [copy] = database[LEGACY_TURNS].find({"dual_write": True})
    assert any(str(p.get("result", "")).endswith(TRUNCATION_MARK) for p in copy["response_parts"])
    roll_back(database, clear_messages=False)


def _drop_refused(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> str:
    """`run` passes; `verify`, `finish`, `finish --accept` and the drop exit 1 for the
    dual-written turn of `c-dual` (the accept saying it accepts no such difference): what
    `verify` and `finish` said."""
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1
    said = capsys.readouterr().out
    assert cli(wire_uri, database, "finish", "--accept", "c-dual", "--note", "seen") == 1
    out = capsys.readouterr().out
    assert "is accepted" not in out, out
    assert "accepts no difference of a dual-written turn" in out, out
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    return said


@pytest.mark.wire
@pytest.mark.parametrize("rules", CUT_COPIES.values(), ids=list(CUT_COPIES))
def test_a_held_copy_holding_cut_texts_blocks_the_drop_until_its_mark_is_removed(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    rules: TurnRules | None,
) -> None:
    """The gate errs on blocking a drop and takes nothing on a copy's word: after the
    runbook's rollback keeping `agent_messages`, a copy holding texts cut (to fit one legacy
    document, or by the store) converts to other messages than are stored, so `verify` and
    `finish` exit 1 for it; `finish --accept` does not clear it and says so. The way out is
    the documented one: once checked, its `dual_write` mark removed, `run` migrates it as a
    legacy turn of a live conversation, which an operator accepts."""
    _log_cut_copy(wire_uri, database, monkeypatch, rules)

    said = _drop_refused(wire_uri, database, capsys)
    assert "its copy holds texts cut, which the store keeps whole" in said  # the likely cause
    assert "it was edited in the legacy collection since it was written" in said
    assert database[LEGACY_TURNS].count_documents({"dual_write": True}) == 1

    database[LEGACY_TURNS].update_one({"dual_write": True}, {"$unset": {"dual_write": ""}})
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "finish", "--accept", "c-dual", "--note", "checked") == 0
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 0


EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "its answer reworded": lambda copy: copy["response_parts"][-1].update(content="DONE"),
    "its cut text reworded": lambda copy: copy["response_parts"][1].update(
        result="«REDACTED»" + TRUNCATION_MARK
    ),
    "its cut text cut shorter": lambda copy: copy["response_parts"][1].update(
        result=copy["response_parts"][1]["result"][:100] + TRUNCATION_MARK
    ),
    "its record of cut texts edited": lambda copy: copy.update(dual_write_cut=[]),
}


@pytest.mark.wire
@pytest.mark.parametrize("rules", CUT_COPIES.values(), ids=list(CUT_COPIES))
@pytest.mark.parametrize("edit", EDITS.values(), ids=list(EDITS))
def test_a_held_copy_holding_cut_texts_edited_after_the_rollback_still_blocks_the_drop(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    rules: TurnRules | None,
    edit: Callable[[dict[str, Any]], None],
) -> None:
    """The gate errs on blocking a drop: a cut copy the legacy service edited after the
    rollback is a difference (`verify` and `finish` exit 1, the drop refused), and
    `finish --accept` says it accepts no such difference, and does not."""
    _log_cut_copy(wire_uri, database, monkeypatch, rules)
    [copy] = database[CONVERSATIONS].find({"dual_write": True})
    edit(copy)
    database[CONVERSATIONS].replace_one({"_id": copy["_id"]}, copy)

    said = _drop_refused(wire_uri, database, capsys)
    assert "it was edited in the legacy collection since it was written" in said


def _roll_back_a_live_turn(
    wire_uri: str, database: Database[dict[str, Any]], turn: list[dict[str, Any]]
) -> dict[str, Any]:
    """`turn` logged live in "c-dual" (dual write on) beside a migrated conversation, then
    the runbook's rollback keeping `agent_messages`; its legacy copy."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-o", "c-other", 0, "O"))
    assert cli(wire_uri, database, "run") == 0
    _log_turns(wire_uri, database, [turn])
    roll_back(database, clear_messages=False)
    [copy] = database[CONVERSATIONS].find({"dual_write": True})
    return copy


def _blocks_the_drop(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> str:
    """`run` passes, `verify` and `finish` exit 1 and the drop is refused; what they said."""
    assert cli(wire_uri, database, "run") == 0
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1
    assert cli(wire_uri, database, "finish", "--drop-legacy", "--yes") == 1
    assert database[LEGACY_TURNS].count_documents({"dual_write": True}) == 1
    return capsys.readouterr().out


@pytest.mark.wire
def test_a_stored_native_form_edited_after_the_rollback_is_a_difference_of_its_held_copy(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A held copy keeps its messages' `native` forms (a runtime's own items no legacy part
    holds); a stored message's form changed since, the copy untouched, the copy holds a form
    the store does not: the gate names the difference and the drop waits."""
    _roll_back_a_live_turn(wire_uri, database, NATIVE_SHAPE)
    other = {"format": "openai-agents", "set": {"type": "reasoning", "summary": ["«OTHER»"]}}
    edited = database[MESSAGES].update_one(
        {"conversation_id": "c-dual", "native": {"$ne": None}}, {"$set": {"native": other}}
    )
    assert edited.modified_count == 1

    out = _blocks_the_drop(wire_uri, database, capsys)

    assert "dual-written turn 'live-0'" in out, out
    kept = json.dumps(list(database[LEGACY_TURNS].find()), default=str, ensure_ascii=False)
    assert "«NATIVE»" in kept


def _rehashed(copy: dict[str, Any]) -> None:
    """Every digest of itself a copy might carry, computed again from what it holds now, as
    anyone can: the SHA-256 of its fields as JSON with sorted keys (no key is needed)."""
    for field, mark in list(copy.items()):
        if isinstance(mark, dict) and isinstance(mark.get("sha256"), str):
            skip = {"_id", "conversation_id", "user_id", "name", "created_at", "dual_write"}
            held = {k: v for k, v in copy.items() if k not in skip | {"turn_id", field}}
            text = json.dumps(held, sort_keys=True, separators=(",", ":"), default=str)
            mark["sha256"] = hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.wire
def test_a_held_copy_edited_and_rehashed_after_the_rollback_is_a_difference(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing a copy says of itself vouches for it: a copy the legacy service edited after
    the rollback (a text its stored messages never said), any digest it carries computed
    again, is compared as it converts; the drop is refused and the text stays."""
    turn = [{"role": "user", "content": "pay"}, {"role": "assistant", "content": "done"}]
    copy = _roll_back_a_live_turn(wire_uri, database, turn)
    copy["response_parts"].append({"type": "text", "content": "«LEGACY ONLY» refund R-778"})
    _rehashed(copy)
    database[CONVERSATIONS].replace_one({"_id": copy["_id"]}, copy)

    out = _blocks_the_drop(wire_uri, database, capsys)

    assert "dual-written turn 'live-0'" in out, out
    kept = json.dumps(list(database[LEGACY_TURNS].find()), default=str, ensure_ascii=False)
    assert "«LEGACY ONLY» refund R-778" in kept


@pytest.mark.wire
def test_a_held_copy_whose_date_was_removed_after_the_rollback_is_a_difference(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A held copy is checked as its conversion reads it, problems and all: one whose
    `created_at` was removed since converts with a `missing_created_at` problem, which its
    stored messages do not have, so the drop waits."""
    turn = [{"role": "user", "content": "pay"}, {"role": "assistant", "content": "done"}]
    copy = _roll_back_a_live_turn(wire_uri, database, turn)
    database[CONVERSATIONS].update_one({"_id": copy["_id"]}, {"$unset": {"created_at": ""}})

    out = _blocks_the_drop(wire_uri, database, capsys)

    assert "dual-written turn 'live-0'" in out, out


OUTSIDE = (
    bson.DatetimeMS(-62_198_755_200_000),  # year 0
    bson.DatetimeMS(1_699_999_999_999_999),  # year 55840
    bson.DatetimeMS(2**62),  # a garbage timestamp
)
"""BSON dates no Python `datetime` holds, as a client decoding with `DATETIME_AUTO` reads them."""
INSIDE = (
    datetime(1, 1, 1, tzinfo=UTC),
    datetime(9999, 12, 31, tzinfo=UTC),
    datetime(1000, 1, 1, tzinfo=UTC),
)
"""Dates a `datetime` holds that are no time a store takes either: the faithful run's."""


def _dated_turns(dates: tuple[Any, Any, Any]) -> list[dict[str, Any]]:
    """Legacy turns holding `dates` as their times and inside arguments and results."""
    year_0, year_55840, garbage = dates
    dated = legacy_turn("t-1", "c-dates", 0, "dated")
    dated |= {"created_at": year_0, "timestamp": year_55840, "note": garbage}
    called = legacy_turn("t-2", "c-dates", 1, "called")
    called["created_at"] = garbage
    called["response_parts"] = [
        {"type": "tool_call", "tool_name": "when", "args": {"at": year_55840}, "tool_call_id": "x"},
        {
            "type": "tool_result",
            "tool_name": "when",
            "result": {"was": year_0},
            "tool_call_id": "x",
        },
        {"type": "text", "content": "done"},
    ]
    return [dated, called]


def _without_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """mongomock's bulk writes as PyMongo calls them now: with a `sort` it has no use for
    (PyMongo 4.11 passes one, None here, to each replace and update)."""
    builder = mongomock.collection.BulkOperationBuilder
    for name in ("add_replace", "add_update"):
        method = getattr(builder, name)

        def without(self: Any, *args: Any, method: Any = method, **kwargs: Any) -> Any:
            kwargs.pop("sort", None)
            return method(self, *args, **kwargs)

        monkeypatch.setattr(builder, name, without)


_GATE_COMMANDS = [
    ("run", "--spread", "1"),
    ("verify",),
    ("finish",),
    ("finish", "--drop-legacy", "--yes"),
    ("finish", "--accept", "c-dates"),
    ("finish", "--drop-legacy", "--yes"),
]


def _on_mongomock(
    monkeypatch: pytest.MonkeyPatch,
    turns: list[dict[str, Any]],
    prompts: list[dict[str, Any]] | None = None,
) -> Database[dict[str, Any]]:
    """A mongomock database the commands run on, holding `turns` and the `session_hitl`
    `prompts`, each `MARKER` in them text that is not valid UTF-8 (`hold_not_utf8`)."""
    client: Any = mongomock.MongoClient(tz_aware=True)
    database = client["dates"]

    @contextlib.contextmanager
    def on_mongomock(args: Any) -> Iterator[tuple[Any, str]]:
        yield client, "--uri"

    monkeypatch.setattr(cli_module, "database", on_mongomock)
    _without_sort(monkeypatch)
    database[CONVERSATIONS].insert_many(turns)
    hold_not_utf8(database[CONVERSATIONS])  # none holds the marker but those made to
    if prompts:
        database[SESSION_HITL].insert_many(prompts)
        hold_not_utf8(database[SESSION_HITL])
    result: Database[dict[str, Any]] = database
    return result


def _commands_on_mongomock(
    monkeypatch: pytest.MonkeyPatch,
    turns: list[dict[str, Any]],
    prompts: list[dict[str, Any]] | None = None,
    commands: list[tuple[str, ...]] = _GATE_COMMANDS,
) -> tuple[list[int], Database[dict[str, Any]]]:
    """The exit codes of `commands` (`run`, `verify`, `finish` and `finish --drop-legacy`) on
    `turns` (and `session_hitl` `prompts`), on mongomock (which stores a `DatetimeMS` as
    given; a server holding one is a real MongoDB)."""
    database = _on_mongomock(monkeypatch, turns, prompts)
    return [cli("mongodb://unused", database, *command) for command in commands], database


def test_dates_outside_pythons_range_are_migrated_and_kept_through_the_gate(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A legacy turn holding a date outside Python's range (year 0, year 55840, a garbage
    timestamp) as its time, in its arguments, results or other fields: `run` migrates it
    (such a time is no readable time), each such value is kept as found (a placed problem, or
    an unplaced one `finish` names), and every command exits as on the same turns holding
    dates a `datetime` holds."""
    faithful, _ = _commands_on_mongomock(monkeypatch, _dated_turns(INSIDE))
    capsys.readouterr()
    codes, database = _commands_on_mongomock(monkeypatch, _dated_turns(OUTSIDE))
    out = capsys.readouterr().out

    assert codes == faithful
    assert codes[:2] == [0, 0], out
    kept = json.dumps(list(database[PROBLEMS].find()), default=repr)
    assert all(repr(date) in kept for date in OUTSIDE)
    assert "c-dates: content only the legacy data holds (unread_field" in out
    assert codes[-1] == faithful[-1] == 0


@pytest.mark.wire
def test_a_second_attempt_owns_an_adopted_conversation_as_its_held_copies_name(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md: the owner is the last user a conversation's turns name, the held
    dual-written copies counted as turns. An unowned legacy conversation adopted by a live
    turn (its copy names the user) is owned by that user after a rollback and a second
    attempt: never unowned again, which any user's next turn would adopt."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD") | {"user_id": None})
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-1", "«LIVE»", dual_write=True)
    roll_back(database, clear_messages=False)

    assert cli(wire_uri, database, "run") == 0
    assert database[CONVERSATIONS].find_one({"_id": "c-1"})["user_id"] == "u-1"  # type: ignore[index]
    owners = {m["user_id"] for m in database[MESSAGES].find({"conversation_id": "c-1"})}
    assert owners == {"u-1"}
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0, capsys.readouterr().out


def _the_other_user_erased_after_a_live_turn(
    wire_uri: str, database: Database[dict[str, Any]], named: str
) -> dict[str, Any]:
    """The remedy's steps on "c-1": run (the conversation `named`), a live turn dual-written,
    user u-a erased, run again; the conversation document after it."""
    assert cli(wire_uri, database, "run") == 0
    assert database[CONVERSATIONS].find_one({"_id": "c-1"})["name"] == named  # type: ignore[index]
    log_live(wire_uri, database, "c-1", "live-1", "«LIVE»", dual_write=True)
    _as_a_person(wire_uri, database, lambda s: s.erase_user("u-a"))
    assert cli(wire_uri, database, "run") == 0
    document = database[CONVERSATIONS].find_one({"_id": "c-1"})
    assert document is not None
    return document


@pytest.mark.wire
def test_an_erased_users_words_never_stay_as_the_name_of_a_conversation_written_live_since(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md's `mixed_user_ids` remedy: erase the other user, then `run` again, which
    removes their turns' messages. An automatic name taken from one of those messages is
    retaken as the store does (the first stored user text), even on a document a live turn
    wrote to since; `verify` flags an automatic name whose message is not stored."""
    database[CONVERSATIONS].insert_many(
        [
            legacy_turn("t-0", "c-1", 0, "«SECRET»") | {"user_id": "u-a"},
            legacy_turn("t-1", "c-1", 1, "«OWNER»"),
        ]
    )
    document = _the_other_user_erased_after_a_live_turn(wire_uri, database, "«SECRET» question")

    first = database[MESSAGES].find_one(
        {"conversation_id": "c-1", "role": "user"}, sort=[("seq", 1)]
    )
    assert first is not None
    assert first["content"] == "«OWNER» question"
    assert (document["name"], document["name_source"]) == ("«OWNER» question", "auto")
    assert document["name_message_id"] == first["_id"]
    [copy] = database[LEGACY_TURNS].find({"dual_write": True})
    assert copy["name"] == "«OWNER» question"  # a rollback brings no erased words back
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 0, capsys.readouterr().out

    database[CONVERSATIONS].update_one({"_id": "c-1"}, {"$set": {"name_message_id": "msg-gone"}})
    assert cli(wire_uri, database, "verify") == 1
    assert "msg-gone" in capsys.readouterr().out


ERASED_NAMES = {
    "none left": ([], ("«OWNER» question", "auto")),
    "the owner's": (
        [legacy_turn("t-0", "c-1", 0, "«FIRST»") | {"name": "«OWNER» trip"}],
        ("«OWNER» trip", "runtime"),
    ),
}


@pytest.mark.wire
@pytest.mark.parametrize(("before", "after"), ERASED_NAMES.values(), ids=list(ERASED_NAMES))
def test_an_erased_users_turn_name_never_stays_on_a_conversation_written_live_since(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    before: list[dict[str, Any]],
    after: tuple[str, str],
) -> None:
    """MIGRATION.md's `mixed_user_ids` remedy retakes a name the erased user's turn gave as
    its own `name` (a runtime name) as it retakes an automatic one: on a document a live
    turn wrote to since too, and on its dual-written copy (which holds the conversation's
    name): the name the turns left give (a turn's own name, else the first stored user
    text), and the erased user's words nowhere."""
    database[CONVERSATIONS].insert_many(
        [
            *before,
            legacy_turn("t-1", "c-1", 1, "«A»") | {"user_id": "u-a", "name": "«SECRET» trip"},
            legacy_turn("t-2", "c-1", 2, "«OWNER»"),
        ]
    )
    document = _the_other_user_erased_after_a_live_turn(wire_uri, database, "«SECRET» trip")

    assert (document["name"], document["name_source"]) == after
    [copy] = database[LEGACY_TURNS].find({"dual_write": True})
    assert copy["name"] == after[0]  # a rollback brings no erased words back
    for name in (CONVERSATIONS, LEGACY_TURNS):
        assert "SECRET" not in json.dumps(list(database[name].find()), default=str), name
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 0, capsys.readouterr().out
    assert cli(wire_uri, database, "finish") == 0, capsys.readouterr().out


@pytest.mark.wire
@pytest.mark.parametrize("name", ["a runtime name", "an automatic name"])
def test_a_run_stopped_after_removing_an_erased_users_messages_retakes_the_name_when_resumed(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    """MIGRATION.md: a run can be stopped at any time and resumed. The remedy's run stopped
    after it removed the erased user's messages and before it retook the name they gave:
    the run it resumes with retakes it (the retake is recorded before the removal), on the
    document and its dual-written copy, and the erased user's words are nowhere."""
    named = {"name": "«SECRET» trip"} if name == "a runtime name" else {}
    database[CONVERSATIONS].insert_many(
        [
            legacy_turn("t-0", "c-1", 0, "«SECRET»") | {"user_id": "u-a"} | named,
            legacy_turn("t-1", "c-1", 1, "«OWNER»"),
        ]
    )
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-1", "«LIVE»", dual_write=True)
    _as_a_person(wire_uri, database, lambda s: s.erase_user("u-a"))
    retaken = writes._names_retaken

    def stopped(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(writes, "_names_retaken", stopped)
    assert cli(wire_uri, database, "run") == 130  # Ctrl-C
    monkeypatch.setattr(writes, "_names_retaken", retaken)
    assert cli(wire_uri, database, "run") == 0

    document = database[CONVERSATIONS].find_one({"_id": "c-1"})
    assert document is not None
    assert (document["name"], document["name_source"]) == ("«OWNER» question", "auto")
    [copy] = database[LEGACY_TURNS].find({"dual_write": True})
    assert copy["name"] == "«OWNER» question"
    for stored in (CONVERSATIONS, LEGACY_TURNS, MESSAGES):
        assert "SECRET" not in json.dumps(list(database[stored].find()), default=str), stored
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 0, capsys.readouterr().out
    assert cli(wire_uri, database, "finish") == 0, capsys.readouterr().out


OLD_SERVICE_COPY_EDITS = {
    "re-filed under another conversation": {"conversation_id": "c-2"},
    "dated before the legacy turns": {"created_at": datetime(2023, 12, 31, tzinfo=UTC)},
    # The converter reads every spelling of a time the old service wrote: so does the gate.
    "re-dated as ISO text": {"created_at": "2020-01-01T00:00:00Z"},
    "re-dated in epoch seconds": {"created_at": 1577836800},
    "re-dated in epoch milliseconds": {"created_at": 1577836800000},
    "re-dated in epoch seconds as text": {"created_at": "1577836800"},
}


@pytest.mark.wire
@pytest.mark.parametrize("edit", OLD_SERVICE_COPY_EDITS.values(), ids=list(OLD_SERVICE_COPY_EDITS))
def test_a_dual_written_copy_the_old_service_refiled_or_redated_is_work_left_never_migrated_again(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    edit: dict[str, Any],
) -> None:
    """A dual-written copy is the turn it copies, by its `_id`: one the old service re-filed
    under another conversation or re-dated after a rollback no longer says where its stored
    messages are. It is never converted again (the live turn would be stored twice), and
    `verify` and `finish` name it until it is put back."""
    _rolled_back_with_a_live_turn(wire_uri, database)
    database[CONVERSATIONS].insert_one(legacy_turn("t-2", "c-2", 2, "OTHER"))
    copy = database[CONVERSATIONS].find_one_and_update({"dual_write": True}, {"$set": edit})
    assert copy is not None

    assert cli(wire_uri, database, "run") == 0
    live = [m["conversation_id"] for m in database[MESSAGES].find({"content": "«LIVE»"})]
    assert live == ["c-1"]  # stored once, where the live turn logged it
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 1
    assert cli(wire_uri, database, "finish") == 1
    assert "'live-1'" in capsys.readouterr().out

    database[LEGACY_TURNS].replace_one({"_id": copy["_id"]}, copy)  # put back
    assert cli(wire_uri, database, "run") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_verify_and_finish_compare_by_the_rules_the_service_reads_from_the_environment(
    wire_uri: str,
    database: Database[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A migration made by other rules than the service's (the defaults: hidden context kept
    visible, the long answer whole) is a difference to `verify` and work left to `finish`
    once the service's settings are there, said to come from them; `run` again under them is
    refused as misuse, and `run --new-rules` converges."""
    from tests.test_migration_cli import context_turns, with_service_turn_settings

    database[CONVERSATIONS].insert_many(context_turns())
    assert cli(wire_uri, database, "run") == 0
    with_service_turn_settings(monkeypatch)
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 1
    assert any(line.startswith("leg-ctx: ") for line in capsys.readouterr().out.splitlines())
    assert cli(wire_uri, database, "finish") == 1
    out = capsys.readouterr().out
    assert "leg-ctx" in out
    assert "the turn settings differ" in out

    assert cli(wire_uri, database, "run") == 2
    assert cli(wire_uri, database, "run", "--new-rules") == 0
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish", "--accept", "leg-ctx", "--note", "context") == 0


MIXED_AT = datetime(2024, 5, 1, tzinfo=UTC)
"""When Mallory's first legacy turn of the mixed conversation `_mixed_x` was logged."""


def _mixed_x(database: Database[dict[str, Any]]) -> None:
    """Legacy conversation `x`: Mallory's early turn, then Ada's (the last user: Ada owns it
    once migrated, its `created_at` Mallory's turn's time). Ada's delete leaves Mallory's
    turn, which a later run migrates as her conversation, created at the same time."""
    mallory = legacy_turn("t-m", "x", 0, "MALLORY") | {"user_id": "u-mallory"}
    ada = legacy_turn("t-a", "x", 1, "ADA") | {"user_id": "u-ada"}
    later = MIXED_AT + timedelta(hours=1)
    database[CONVERSATIONS].insert_many(
        [mallory | {"created_at": MIXED_AT}, ada | {"created_at": later}]
    )


def _on_its_database(wire_uri: str, database: Database[dict[str, Any]], work: Any) -> Any:
    """`work(db)` (a coroutine function) on the async database the service opens."""

    async def run() -> Any:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        try:
            return await work(client[database.name])
        finally:
            await client.close()

    return asyncio.run(run())


def _deleted_after_a_late_put_and_migrated_again(
    wire_uri: str, database: Database[dict[str, Any]]
) -> str:
    """`x` migrated (Ada's); a service's graph checkpoints it, its put landing after Ada's
    delete (the late put, LANGGRAPH.md); `run` again migrates Mallory's turn left under the
    id. The version Ada's `x` was read with."""
    from langgraph.checkpoint.base import empty_checkpoint

    from agent_store.integrations.langgraph import CHECKPOINTS, AgentStoreSaver

    _mixed_x(database)
    assert cli(wire_uri, database, "run") == 0  # a mixed_user_ids problem, not placed

    async def ada(db: Any) -> str:
        store = ConversationStore(db, legacy=LegacyTurns(db))
        version = (await store.get_conversation("x", user_id="u-ada")).version
        private = empty_checkpoint()
        private["channel_values"] = {"messages": [], "plan": "ADA PRIVATE: iban FR76"}
        await AgentStoreSaver(db).aput({"configurable": {"thread_id": "x"}}, private, {}, {})
        late = await db[CHECKPOINTS].find({"thread_id": "x"}).to_list(None)
        assert (await store.delete("x", user_id="u-ada", version=version)).conversations == 1
        await db[CHECKPOINTS].insert_many(late)  # the put, held, lands after the delete
        return version

    version: str = _on_its_database(wire_uri, database, ada)
    assert cli(wire_uri, database, "run") == 0
    again = database[CONVERSATIONS].find_one({"_id": "x"})
    assert again is not None
    assert (again["user_id"], again["created_at"]) == ("u-mallory", MIXED_AT)
    return version


@pytest.mark.wire
def test_a_conversation_migrated_again_after_a_delete_reads_none_of_the_deleted_ones_state(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """LANGGRAPH.md: whoever takes an id next never reads what a graph still running wrote
    after the delete. A conversation the migration creates draws an epoch, as a live one
    does, so the one it creates again under the id (Mallory's turns left by Ada's delete,
    created at the same millisecond) is another life: neither Mallory's graph nor a
    service's reads the late checkpoint of Ada's."""
    from agent_store.integrations.langgraph import AgentStoreSaver

    _deleted_after_a_late_put_and_migrated_again(wire_uri, database)

    async def read(db: Any) -> list[str]:
        saver, seen = AgentStoreSaver(db), []
        for reader in ({"user_id": "u-mallory"}, {}):
            config = {"configurable": {"thread_id": "x", **reader}}
            found = await saver.aget_tuple(config)
            seen.append(str(found and found.checkpoint["channel_values"]))
            seen += [str(t.checkpoint["channel_values"]) async for t in saver.alist(config)]
        return seen

    seen = _on_its_database(wire_uri, database, read)
    assert not [s for s in seen if "ADA" in s]


@pytest.mark.wire
def test_a_version_read_before_a_delete_never_names_the_conversation_migrated_again(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """API.md: the version (`ETag`) is another for any conversation started again under the
    id, and a DELETE naming it deletes that conversation only. The conversation the
    migration creates again after a delete, at the same `created_at`, has another version:
    a delete retried with the deleted one's is refused, nothing deleted."""
    version = _deleted_after_a_late_put_and_migrated_again(wire_uri, database)

    async def retried(db: Any) -> str:
        store = ConversationStore(db, legacy=LegacyTurns(db))
        now = (await store.get_conversation("x", user_id="u-mallory")).version
        with pytest.raises(VersionMismatch):
            await store.delete("x", version=version)
        return now

    assert _on_its_database(wire_uri, database, retried) != version
    assert database[CONVERSATIONS].find_one({"_id": "x"}) is not None


@pytest.mark.wire
def test_a_rerun_keeps_the_epoch_the_migration_drew_and_so_the_version(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A conversation the migration creates draws an epoch (with `epoch_marks`: documents
    beside it name that epoch), and a rerun rewriting its document (a legacy turn edited
    since) keeps it: the version a read served still names the conversation."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "A"))
    assert cli(wire_uri, database, "run") == 0
    written = database[CONVERSATIONS].find_one({"_id": "c-1"})
    assert written is not None
    assert isinstance(written.get("epoch"), str)
    assert written.get("epoch_marks") is True
    before = Conversation.model_validate(written).version
    again = _run_again_once_the_old_service_renamed(wire_uri, database, "c-1", "Renamed")
    assert again["name"] == "Renamed"
    assert (again["epoch"], again["epoch_marks"]) == (written["epoch"], True)
    assert Conversation.model_validate(again).version == before
    assert writes.written_by_migration(again)


NOT_UTF8 = "words \udcc3( more"
"""A legacy text stored as bytes that are not valid UTF-8 (`b"\\xc3\\x28"`), as the migration's
client reads it (`surrogateescape`: each such byte a lone surrogate no valid text holds)."""
MARKER = "«NOT UTF-8»"


def _not_utf8(value: Any) -> Any:
    """`value` with each `MARKER` made `NOT_UTF8`, keys too."""
    if isinstance(value, str):
        return value.replace(MARKER, NOT_UTF8)
    if isinstance(value, dict):
        return {_not_utf8(k): _not_utf8(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_not_utf8(v) for v in value]
    return value


def hold_not_utf8(collection: Any) -> None:
    """A fake of a server holding text that is not valid UTF-8 (mongomock encodes what it is
    given, and refuses such text): the documents mongomock stores, rewritten in its store,
    each `MARKER` the text the migration's client reads such bytes as (`NOT_UTF8`)."""
    store = collection._store
    for key in list(store._documents):
        store._documents[key] = _not_utf8(store._documents[key])


def _turns_one_not_utf8(field: str) -> list[dict[str, Any]]:
    """Good turns of two conversations, and of a third one turn holding text that is not valid
    UTF-8 in `field` (a key too: `field` "key")."""
    bad = legacy_turn("t-bad", "c-bad", 2, "bad")
    if field == "key":
        bad["note " + MARKER] = 1
    elif field == "conversation_id":
        bad["conversation_id"] = "c-bad" + MARKER
    elif field == "_id":
        bad["_id"] = "t-bad" + MARKER
    elif field == "response_parts":
        bad["response_parts"].append({"type": "text", "content": MARKER})
    else:
        bad[field] = MARKER
    return [
        legacy_turn("t-1", "c-good-1", 0, "one"),
        legacy_turn("t-2", "c-good-2", 1, "two"),
        legacy_turn("t-bad-0", "c-bad", 1, "before"),
        bad,
    ]


@pytest.mark.parametrize(
    "field", ["user_message", "response_parts", "legacy_note", "key", "user_id"]
)
def test_a_turn_holding_text_that_is_not_valid_utf8_is_a_named_problem_and_the_others_migrate(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    """MIGRATION.md: a legacy turn holding bytes that are not valid UTF-8 never stops a run:
    its conversation is an `invalid_conversation` problem naming the turn and the field, its
    turns stay in the legacy collection as they are, the other conversations migrate, and the
    gate holds (`verify`, `finish`, the drop) until an operator corrects it or accepts it."""
    codes, database = _commands_on_mongomock(monkeypatch, _turns_one_not_utf8(field))
    out = capsys.readouterr().out

    assert codes[0] == 0, out
    migrated = {m["conversation_id"] for m in database[MESSAGES].find()}
    assert migrated == {"c-good-1", "c-good-2"}
    problem = database[PROBLEMS].find_one({"conversation_id": "c-bad"})
    assert problem is not None
    assert problem["kind"] == "invalid_conversation"
    assert "legacy turn 't-bad'" in problem["detail"]
    assert "not valid UTF-8" in problem["detail"]
    assert (field if field != "key" else "<key>") in problem["detail"]
    assert codes[1:4] == [1, 1, 1], out
    assert database[LEGACY_TURNS].count_documents({"conversation_id": "c-bad"}) == 2
    assert "c-bad" in out


@pytest.mark.parametrize("copy", [False, True], ids=["renamed", "copied"])
@pytest.mark.parametrize("field", ["conversation_id", "_id"])
def test_a_turn_whose_id_holds_bytes_that_are_not_valid_utf8_is_a_named_problem(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], field: str, copy: bool
) -> None:
    """MIGRATION.md: a legacy turn whose `conversation_id` or `_id` holds bytes that are not
    valid UTF-8 stops no command (was: a traceback out of `run`, nothing migrated, the turn
    unnamed): `run --dry-run`, `run`, `status` and a second `run` go on, the turn is named (its
    `_id` escaped) with the field, as a problem of its conversation (`invalid_conversation`) or
    as a turn a copy leaves in `agent_conversations`, its turns stay as stored, every other
    conversation migrates, and `verify` and `finish` exit 1."""
    if copy:
        monkeypatch.setattr(
            relocate, "relocate", functools.partial(relocate.relocate, allow_rename=False)
        )
    commands = [("run", "--dry-run", "--spread", "1"), ("run", "--spread", "1"), ("status",),
                ("run", "--spread", "1"), ("verify",), ("finish",)]  # fmt: skip
    codes, database = _commands_on_mongomock(
        monkeypatch, _turns_one_not_utf8(field), commands=commands
    )
    out = capsys.readouterr().out

    assert codes == [0, 0, 0, 0, 1, 1], out
    bad_id = "t-bad" + (NOT_UTF8 if field == "_id" else "")  # named with each escape: repr
    if copy:  # left in agent_conversations and named; the gate refuses while it is there
        assert f"turn {bad_id!r} ({field} holds bytes that are not valid UTF-8)" in out
    else:
        named = f"legacy turn {bad_id!r}: {field} holds bytes that are not valid UTF-8"
        problems = [p["kind"] for p in database[PROBLEMS].find() if named in p["detail"]]
        assert problems == ["invalid_conversation"], out
    migrated = {m["conversation_id"] for m in database[MESSAGES].find()}
    assert migrated == {"c-good-1", "c-good-2"} | ({"c-bad"} if field != "_id" else set())
    stored = database[CONVERSATIONS if copy else LEGACY_TURNS].find()
    assert [t["conversation_id"] for t in stored if t["_id"] == bad_id] == [
        "c-bad" + (NOT_UTF8 if field == "conversation_id" else "")
    ]


def test_an_id_holding_text_that_is_not_valid_utf8_is_no_checkpoint_and_a_key_apart() -> None:
    """An id holding text that is not valid UTF-8 is never a range's checkpoint (no state
    document nor query holds it): the range records it as passed, by its key, beside the last
    id before it, until an id after it is done; and it is a key apart from any other id, the
    text spelling its escape too (`id_key`)."""
    ranges = order.Ranges()
    ranges.mark(0, "string", "c-1")
    ranges.mark(0, "string", NOT_UTF8)
    assert ranges.done == {"0": "c-1"}
    assert ranges.passed == {"0": [explode.id_key(NOT_UTF8)]}
    ranges.mark(0, "string", "c-2")
    assert (ranges.done, ranges.passed) == ({"0": "c-2"}, {})
    escaped = NOT_UTF8.encode("ascii", "backslashreplace").decode()
    keys = {explode.id_key(v) for v in (NOT_UTF8, escaped, [NOT_UTF8], {"a": NOT_UTF8})}
    assert len(keys) == 4


def test_a_limited_run_passes_an_id_holding_text_that_is_not_valid_utf8(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md: a range's checkpoint passes an id holding text that is not valid UTF-8
    (named as a problem, never recorded as it is): `run --limit 1` repeated migrates the ids
    after it, one a run, and the run taking the last one completes the pass (was: every run
    after the first read that id again, exit 0, and the ids after it never migrated)."""
    ids = ["c-a", "c-b" + MARKER, "c-c", "c-d"]
    turns = [legacy_turn(f"t-{n}", cid, n, f"q{n}") for n, cid in enumerate(ids)]
    limited = ("run", "--spread", "1", "--limit", "1", "--batch-size", "1")
    codes, database = _commands_on_mongomock(monkeypatch, turns, commands=[limited] * 4)
    out = capsys.readouterr().out

    assert codes == [0] * 4, out
    assert {m["conversation_id"] for m in database[MESSAGES].find()} == {"c-a", "c-c", "c-d"}
    assert (database[lease.STATE].find_one({"_id": lease.STATE_ID}) or {})["complete"] is True


def test_a_corrected_nested_id_that_was_not_valid_utf8_migrates_on_the_next_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md: a conversation id that is an embedded document holding text that is not
    valid UTF-8 is named (`unread_conversation`: correct it in the database, then run again)
    and passed, so the run completes; once corrected, the next plain `run` migrates it and the
    gate opens (was: the run never completed, the next one resumed past the corrected id and
    migrated nothing, and `verify` and `finish` said "run the migration again" for ever)."""
    turns = [legacy_turn("t-a", "c-a", 0, "one"), legacy_turn("t-c", "c-c", 2, "three")]
    turns.append(legacy_turn("t-b", "c-b", 1, "two") | {"conversation_id": {"k": MARKER}})
    run = ("run", "--spread", "1")
    codes, database = _commands_on_mongomock(monkeypatch, turns, commands=[run, ("verify",)])
    assert codes == [0, 1]
    [problem] = database[PROBLEMS].find()
    assert problem["kind"] == "unread_conversation"
    assert "correct it in the database" in problem["detail"]

    database[LEGACY_TURNS].update_one({"_id": "t-b"}, {"$set": {"conversation_id": "c-b"}})
    codes = [cli("mongodb://unused", database, *c) for c in (run, ("verify",), ("finish",))]
    out = capsys.readouterr().out

    assert codes == [0, 0, 0], out
    assert {m["conversation_id"] for m in database[MESSAGES].find()} == {"c-a", "c-b", "c-c"}


def test_an_id_corrected_during_a_pass_that_passed_it_migrates_on_the_next_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md: an id holding text that is not valid UTF-8 that a stopped pass went past,
    corrected before the pass completes to an id sorting before the last one it recorded, is
    migrated by the next plain `run`: a passed id gone from the legacy turns makes the run start
    over, since its correction may sort anywhere (was: the resume went on past it, and only the
    run after the completed pass reached it)."""
    ids = ["c-a", "c-b" + MARKER, "c-c", "c-d"]
    turns = [legacy_turn(f"t-{n}", cid, n, f"q{n}") for n, cid in enumerate(ids)]
    limited = ("run", "--spread", "1", "--limit", "1", "--batch-size", "1")
    _, database = _commands_on_mongomock(monkeypatch, turns, commands=[limited] * 2)

    database[LEGACY_TURNS].update_one({"_id": "t-1"}, {"$set": {"conversation_id": "c-0"}})
    codes = [cli("mongodb://unused", database, *c) for c in (limited[:3], ("verify",))]
    out = capsys.readouterr().out

    assert codes == [0, 0], out
    migrated = {m["conversation_id"] for m in database[MESSAGES].find()}
    assert migrated == {"c-0", "c-a", "c-c", "c-d"}


@pytest.mark.wire
def test_a_turn_whose_conversation_id_holds_a_dbref_is_a_named_problem_and_the_others_migrate(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md: a legacy turn whose `conversation_id` is a database reference (a DBRef),
    or an embedded document or array holding one, stops no command (was: exit 4 out of `run`,
    `verify`, `finish` and `status` alike on the embedded server, which groups no DBRef,
    nothing migrated, the turn unnamed): each is an `invalid_conversation` problem naming the
    turn and the field, its turn stays as stored, the others migrate, and the gate holds."""
    ref = bson.DBRef("users", 5)
    refs = {"t-ref": ref, "t-in-doc": {"user": ref}, "t-in-list": [ref, "c-1"]}
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "one")]
        + [legacy_turn(tid, cid, 1, tid) for tid, cid in refs.items()]
    )

    codes = [cli(wire_uri, database, c) for c in ("run", "verify", "finish", "status")]
    out = capsys.readouterr().out

    assert codes == [0, 1, 1, 0], out
    assert {m["conversation_id"] for m in database[MESSAGES].find()} == {"c-1"}
    details = sorted(p["detail"] for p in database[PROBLEMS].find())
    assert [d.split(":")[0] for d in details] == [f"legacy turn {t!r}" for t in sorted(refs)]
    assert all("conversation_id holds a database reference" in d for d in details)
    assert database[LEGACY_TURNS].count_documents({"_id": {"$in": list(refs)}}) == 3


HITL_PROMPT = {
    "_id": "p-1", "conversation_id": "c-hitl", "user_id": "u-1", "request_id": "r-1",
    "action": "pay", "prompt": "Pay Bob?", "status": "pending",
    "created_at": datetime(2024, 1, 1, 3, tzinfo=UTC),
}  # fmt: skip
"""The pending `session_hitl` prompt of conversation `c-hitl` (`_turns_and_a_prompt`)."""


def _turns_and_a_prompt(field: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Good turns of two conversations, and of a third, `c-hitl`, one raising request `r-1`,
    whose pending `session_hitl` prompt holds text that is not valid UTF-8 in `field` (its
    `note`, a field no reader takes, too; "not placed": in another pending prompt's `prompt`,
    one no message raised)."""
    raised = {"type": "hitl", "action": "pay", "request_id": "r-1", "prompt": "Pay Bob?"}
    asking = legacy_turn("t-h", "c-hitl", 2, "pay") | {"response_parts": [raised]}
    prompts = [dict(HITL_PROMPT)]
    if field == "not placed":
        prompts.append(HITL_PROMPT | {"_id": "p-2", "request_id": "r-9", "prompt": MARKER})
    else:
        prompts[0][field] = f"{prompts[0].get(field, '')} {MARKER}"
    turns = [legacy_turn("t-1", "c-good-1", 0, "one"), legacy_turn("t-2", "c-good-2", 1, "two")]
    return [*turns, asking], prompts


@pytest.mark.parametrize("field", ["prompt", "action", "request_id", "note"])
def test_a_prompt_holding_text_that_is_not_valid_utf8_is_a_named_problem_and_the_others_migrate(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    """MIGRATION.md: a `session_hitl` prompt holding bytes that are not valid UTF-8 is read as
    a turn holding them is, never stopping a run (was: a traceback out of every run, no
    conversation migrated): its conversation is an `invalid_conversation` problem naming the
    prompt document and the field, nothing of it written, its turns and prompts left as they
    are; the other conversations migrate, and the gate holds until it is corrected."""
    turns, prompts = _turns_and_a_prompt(field)
    codes, database = _commands_on_mongomock(monkeypatch, turns, prompts)
    out = capsys.readouterr().out

    assert codes[0] == 0, out
    migrated = {m["conversation_id"] for m in database[MESSAGES].find()}
    assert migrated == {"c-good-1", "c-good-2"}
    assert database[CONVERSATIONS].find_one({"_id": "c-hitl"}) is None
    problem = database[PROBLEMS].find_one({"conversation_id": "c-hitl"})
    assert problem is not None
    assert problem["kind"] == "invalid_conversation"
    assert "session_hitl prompt 'p-1'" in problem["detail"]
    assert "not valid UTF-8" in problem["detail"]
    assert field in problem["detail"]
    assert codes[1:4] == [1, 1, 1], out
    assert "c-hitl" in out
    assert database[LEGACY_TURNS].count_documents({"conversation_id": "c-hitl"}) == 1
    assert database[SESSION_HITL].count_documents({}) == len(prompts)

    database[SESSION_HITL].delete_many({})
    database[SESSION_HITL].insert_many(
        [{k: v.replace(MARKER, "corrected") if isinstance(v, str) else v for k, v in p.items()}
         for p in prompts]
    )  # fmt: skip
    assert cli("mongodb://unused", database, "run", "--spread", "1") == 0
    assert database[CONVERSATIONS].find_one({"_id": "c-hitl"}) is not None
    assert cli("mongodb://unused", database, "verify") == 0


UNTAKEN_PROMPTS = {
    "resolved": {"_id": "p-3", "request_id": "r-0", "status": "resolved", "note": MARKER},
    "another user's": {"_id": "p-4", "user_id": "u-2", "request_id": "r-m", "status": "done"},
    "another user's pending": {"_id": "p-5", "user_id": "u-2", "request_id": "r-m"},
    "not placed": {"_id": "p-2", "request_id": "r-9"},
}
"""Prompts of `c-hitl` beside its pending one that no conversation document takes: resolved
by the old service, another user's, a pending one no message raised (`HITL_PROMPT` else)."""


@pytest.mark.parametrize("case", list(UNTAKEN_PROMPTS))
def test_a_prompt_no_conversation_takes_holding_text_that_is_not_valid_utf8_blocks_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """MIGRATION.md: only a prompt the conversation document is made of (its pending prompt,
    one the new service resolved) holding bytes that are not valid UTF-8 makes the
    conversation an `invalid_conversation`; one it does not take (resolved by the old
    service, another user's, a pending one only a problem keeps, its text written as
    escapes) leaves it migrating whole, its pending prompt pending, and an acceptance lets
    `finish` pass (was: the conversation unconvertible, `finish` exiting 1 after
    `finish --accept`, until the prompt was edited)."""
    turns, _ = _turns_and_a_prompt("prompt")
    earlier = {"prompt": f"Pay {MARKER}?", "created_at": datetime(2024, 1, 1, 1, tzinfo=UTC)}
    prompts = [HITL_PROMPT, HITL_PROMPT | earlier | UNTAKEN_PROMPTS[case]]
    database = _on_mongomock(monkeypatch, turns, prompts)

    assert cli("mongodb://unused", database, "run", "--spread", "1") == 0
    out = capsys.readouterr().out
    migrated = {m["conversation_id"] for m in database[MESSAGES].find()}
    assert migrated == {"c-good-1", "c-good-2", "c-hitl"}, out
    stored = database[CONVERSATIONS].find_one({"_id": "c-hitl"})
    assert stored is not None
    assert stored["pending_hitl"]["request_id"] == "r-1"
    kinds = {p["kind"] for p in database[PROBLEMS].find({"conversation_id": "c-hitl"})}
    assert "invalid_conversation" not in kinds, out
    if "pending" in case or "placed" in case:  # only a problem keeps it: escaped, as a turn's
        kept = database[PROBLEMS].find_one({"kind": "pending_prompt_not_placed"})
        assert kept is not None
        assert "Pay words \\udcc3( more?" in str(kept["content"])
    assert cli("mongodb://unused", database, "verify") == 0
    cli("mongodb://unused", database, "finish", "--accept", "c-hitl")
    assert cli("mongodb://unused", database, "finish") == 0


def test_the_dry_run_counts_a_prompt_holding_text_that_is_not_valid_utf8_as_a_problem(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md "Runbook": the dry run prints the problems by kind the run will record: a
    conversation whose pending prompt holds text that is not valid UTF-8 among them (was: no
    problem, then the run stopped on it)."""
    database = _on_mongomock(monkeypatch, *_turns_and_a_prompt("prompt"))

    assert cli("mongodb://unused", database, "run", "--dry-run", "--spread", "1") == 0
    out = capsys.readouterr().out

    assert "'invalid_conversation': 1" in out, out
    assert "2 not placed" not in out


@pytest.mark.parametrize("field", ["prompt", "note"])
def test_status_names_a_prompt_holding_text_that_is_not_valid_utf8_before_any_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    """MIGRATION.md "Runbook": before any run, `status` names the conversation whose pending
    `session_hitl` prompt holds text that is not valid UTF-8, with the problem a run records
    for it (`invalid_conversation`, naming the prompt and the field), as the run then records
    it (was: "problems: none recorded", only `run` found it); it writes nothing."""
    database = _on_mongomock(monkeypatch, *_turns_and_a_prompt(field))

    assert cli("mongodb://unused", database, "status") == 0
    out = capsys.readouterr().out

    said = [line for line in out.splitlines() if "c-hitl" in line]
    assert len(said) == 1, out
    assert "invalid_conversation" in said[0]
    assert f"session_hitl prompt 'p-1': {field} holds bytes that are not valid UTF-8" in said[0]
    assert database[PROBLEMS].count_documents({}) == 0
    assert database[LEGACY_TURNS].count_documents({}) == 0

    assert cli("mongodb://unused", database, "run", "--spread", "1") == 0
    problem = database[PROBLEMS].find_one({"conversation_id": "c-hitl"})
    assert problem is not None
    assert problem["detail"].split(";")[0] in said[0]


@pytest.mark.parametrize("case", list(UNTAKEN_PROMPTS))
def test_status_names_no_prompt_holding_such_text_that_its_conversation_does_not_take(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """MIGRATION.md: a prompt holding text that is not valid UTF-8 that its conversation does
    not take (resolved by the old service, another user's, one only a problem keeps) blocks
    nothing: `status` names no problem for it, as a run records none."""
    turns, _ = _turns_and_a_prompt("prompt")
    earlier = {"prompt": f"Pay {MARKER}?", "created_at": datetime(2024, 1, 1, 1, tzinfo=UTC)}
    database = _on_mongomock(
        monkeypatch, turns, [HITL_PROMPT, HITL_PROMPT | earlier | UNTAKEN_PROMPTS[case]]
    )

    assert cli("mongodb://unused", database, "status") == 0
    out = capsys.readouterr().out

    assert "invalid_conversation" not in out, out
    assert "c-hitl" not in out, out


def _encoding_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """mongomock's reads encoding their query as PyMongo's client does before sending it:
    one holding a text no BSON holds (a lone surrogate) fails so, `UnicodeEncodeError`."""
    for name in ("find", "distinct", "count_documents"):
        method = getattr(mongomock.collection.Collection, name)

        def encoding(self: Any, *args: Any, method: Any = method, **kwargs: Any) -> Any:
            for value in [*args, *kwargs.values()]:
                if isinstance(value, dict):
                    bson.encode(value)
            return method(self, *args, **kwargs)

        monkeypatch.setattr(mongomock.collection.Collection, name, encoding)


def test_a_pending_prompt_naming_its_conversation_in_text_that_is_not_valid_utf8_is_an_orphan(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md: a pending prompt whose `conversation_id` holds bytes that are not valid
    UTF-8 names no conversation a run can read (no query can name it): it is an
    `orphan_pending_hitl` problem under `session_hitl|<its _id>`, saying so, every
    conversation migrates, and `finish` holds until it is corrected or accepted (was: a
    traceback out of every `run` and `finish`, naming nothing)."""
    turns, _ = _turns_and_a_prompt("prompt")
    prompt = HITL_PROMPT | {"_id": "p-9", "conversation_id": f"c-{MARKER}"}
    database = _on_mongomock(monkeypatch, turns, [prompt])
    _encoding_queries(monkeypatch)

    assert cli("mongodb://unused", database, "run", "--spread", "1") == 0
    assert cli("mongodb://unused", database, "verify") == 0
    capsys.readouterr()
    assert cli("mongodb://unused", database, "finish") == 1
    out = capsys.readouterr().out

    migrated = {m["conversation_id"] for m in database[MESSAGES].find()}
    assert migrated == {"c-good-1", "c-good-2", "c-hitl"}
    problem = database[PROBLEMS].find_one({"kind": "orphan_pending_hitl"})
    assert problem is not None
    assert problem["conversation_id"] == "session_hitl|p-9"
    assert "conversation_id holds bytes that are not valid UTF-8" in problem["detail"]
    assert "session_hitl|p-9" in out
    assert cli("mongodb://unused", database, "finish", "--accept", "session_hitl|p-9") == 0
    assert cli("mongodb://unused", database, "finish") == 0


def test_a_copy_leaves_a_turn_holding_text_that_is_not_valid_utf8_where_it_is_and_names_it() -> (
    None
):
    """MIGRATION.md: a copy (the server refused the rename, or `agent_conversations` holds
    conversation documents too) cannot write a text that is not valid UTF-8 back as stored:
    it moves every other turn and leaves that one in `agent_conversations` as stored, named by
    its `_id` and field; the gate refuses while it stands there."""
    database: Any = mongomock.MongoClient(tz_aware=True)["copy_not_utf8"]
    database[CONVERSATIONS].insert_many(_turns_one_not_utf8("user_message"))
    hold_not_utf8(database[CONVERSATIONS])

    moved = relocate.relocate(database, allow_rename=False)

    assert moved.moved == 3
    assert "'t-bad' (user_message holds bytes" in moved.detail
    assert "not valid UTF-8" in moved.detail
    left = list(database[CONVERSATIONS].find())
    assert [(t["_id"], t["user_message"]) for t in left] == [("t-bad", NOT_UTF8)]
    assert database[LEGACY_TURNS].count_documents({"_id": "t-bad"}) == 0


class StoredWithAFieldNameTwice:
    """A fake of `agent_conversations` on a server holding a turn whose `user_message` is stored
    twice ("FIRST WORDS", then "SECOND WORDS"; MongoDB keeps what a writer's bytes say): a
    decoded read shows the field once, with its last value (mongomock holds that view), the
    stored bytes hold both (an undecoded read, `RawBSONDocument`), and the exact delete of the
    copy matches nothing, as the server finds the stored document unlike the copy."""

    def __init__(self, real: Any, turn: dict[str, Any]) -> None:
        self._real = real
        twice = bson.encode({**turn, "user_message": "FIRST WORDS", "ZZer_message": "X"})
        self._stored = bson.raw_bson.RawBSONDocument(twice.replace(b"ZZ", b"us"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def with_options(self, codec_options: Any) -> Any:
        assert codec_options.document_class is bson.raw_bson.RawBSONDocument
        stored = self._stored
        return type("Undecoded", (), {"find_one": lambda _, query: stored})()

    def bulk_write(self, requests: Any, ordered: bool = True) -> Any:
        return type("Result", (), {"deleted_count": 0})()

    def delete_one(self, query: Any) -> Any:
        return type("Result", (), {"deleted_count": 0})()


def test_the_move_never_deletes_a_turn_it_cannot_copy_byte_for_byte() -> None:
    """MIGRATION.md: where the exact delete of a copied turn fails and the turn reads as its
    copy, the move deletes it by `_id` only when its stored bytes are the copy's (the embedded
    server's binary subtypes it cannot compare); a turn stored otherwise than any decoded read
    shows it (a field name twice) stays in `agent_conversations` as stored, its copy taken
    back, and is left for an operator (was: deleted, its first value in no collection)."""
    client: Any = mongomock.MongoClient(tz_aware=True)
    turn = legacy_turn("t-dup", "c-dup", 0, "dup") | {"user_message": "SECOND WORDS"}
    client.db[CONVERSATIONS].insert_one(turn)
    client.db[LEGACY_TURNS].insert_one(turn)
    source = StoredWithAFieldNameTwice(client.db[CONVERSATIONS], turn)

    recorded: list[dict[str, Any]] = []
    left = relocate._delete_as_copied([turn], source, client.db[LEGACY_TURNS], recorded.append)

    assert left == ["t-dup"]
    assert client.db[CONVERSATIONS].find_one({"_id": "t-dup"}) == turn
    assert client.db[LEGACY_TURNS].count_documents({}) == 0


def test_a_turn_a_copy_leaves_for_text_that_is_not_valid_utf8_holds_its_conversation_back(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md: the conversation of a turn a copy left in `agent_conversations` (text that
    is not valid UTF-8) is held back, nothing of it written, as on a rename, where its
    conversation is an `invalid_conversation` problem: never migrated without that turn's
    words; the others migrate and the gate holds, the turn named."""
    copying = functools.partial(relocate.relocate, allow_rename=False)
    monkeypatch.setattr(relocate, "relocate", copying)
    codes, database = _commands_on_mongomock(monkeypatch, _turns_one_not_utf8("user_message"))
    out = capsys.readouterr().out

    assert codes[0] == 0, out
    assert "turn 't-bad' (user_message holds bytes that are not valid UTF-8)" in out
    migrated = {m["conversation_id"] for m in database[MESSAGES].find()}
    assert migrated == {"c-good-1", "c-good-2"}
    assert database[CONVERSATIONS].find_one({"_id": "c-bad"}) is None
    assert codes[1:4] == [1, 1, 1], out


def test_verify_finish_and_status_name_a_late_turn_a_copy_leaves_for_text_not_valid_utf8(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md: `finish` names each conversation of work left with the reason. After the
    move the old service logs a turn holding text that is not valid UTF-8, which the copy of
    the next run leaves in `agent_conversations`: `verify`, `finish` and `status` name it by
    `_id` and field, the conversation it holds back, and say to correct its text there, the
    one step that gets it moved, every time (was: only "run the migration again", which
    changes nothing: an advice followed in a loop)."""
    turns = [legacy_turn("t-1", "c-a", 0, "A"), legacy_turn("t-2", "c-b", 1, "B")]
    database = _on_mongomock(monkeypatch, turns)
    assert cli("mongodb://unused", database, "run", "--spread", "1") == 0
    _late_turns_logged(database, [legacy_turn("t-late", "c-a", 2, MARKER)])

    for _ in range(2):
        assert cli("mongodb://unused", database, "run", "--spread", "1") == 0
        for command, code in [("verify", 1), ("finish", 1), ("status", 0)]:
            capsys.readouterr()
            assert cli("mongodb://unused", database, command) == code
            out = capsys.readouterr().out
            assert "turn 't-late' (user_message holds bytes that are not valid UTF-8)" in out, out
            assert "'c-a'" in out, out
            assert "correct it there" in out, out


def test_a_turn_a_copy_leaves_under_another_conversations_id_holds_that_one_back_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md: a turn a copy leaves in `agent_conversations` (text that is not valid
    UTF-8) whose `_id` is another conversation's id ("c-named", another user's) stands where
    that conversation's document goes: no run writes it there, so that conversation is held
    back too, and named so by the run and by `verify`, which never reads the turn as its
    conversation document (was: neither migrated nor named, and `verify` said the document
    "names the owner 'u-1', its legacy turns 'u-2'")."""
    turns = _turns_one_not_utf8("user_message")
    turns[-1]["_id"] = "c-named"
    turns.append(legacy_turn("t-9", "c-named", 3, "named") | {"user_id": "u-2"})
    copying = functools.partial(relocate.relocate, allow_rename=False)
    monkeypatch.setattr(relocate, "relocate", copying)
    codes, database = _commands_on_mongomock(monkeypatch, turns)
    out = capsys.readouterr().out

    assert codes[0] == 0, out
    assert "hold back their conversations 'c-bad' and any conversation whose id is" in out
    assert "one of their _ids ('c-named')" in out
    assert {m["conversation_id"] for m in database[MESSAGES].find()} == {"c-good-1", "c-good-2"}
    assert database[CONVERSATIONS].find_one({"_id": "c-named"})["user_message"] == NOT_UTF8
    assert "names the owner" not in out
    assert re.search(r"c-named: held back", out), out
    assert codes[1:4] == [1, 1, 1], out


def _graph_checkpoint(wire_uri: str, database: Database[dict[str, Any]], cid: str) -> str:
    """A service's graph checkpoints `cid` as its owner "u-1" (no new message: the migrated
    transcript as is). The conversation's version, as read then."""
    from langgraph.checkpoint.base import empty_checkpoint

    from agent_store.integrations.langgraph import AgentStoreSaver

    async def put(db: Any) -> str:
        state = empty_checkpoint()
        state["channel_values"] = {"plan": "STEP 3"}
        config = {"configurable": {"thread_id": cid, "user_id": "u-1"}}
        await AgentStoreSaver(db).aput(config, state, {}, {})
        store = ConversationStore(db, legacy=LegacyTurns(db))
        return (await store.get_conversation(cid, user_id="u-1")).version

    version: str = _on_its_database(wire_uri, database, put)
    return version


def _graph_state(wire_uri: str, database: Database[dict[str, Any]], cid: str) -> Any:
    """What the owner's graph reads of `cid` (None: no state)."""
    from agent_store.integrations.langgraph import AgentStoreSaver

    async def read(db: Any) -> Any:
        config = {"configurable": {"thread_id": cid, "user_id": "u-1"}}
        found = await AgentStoreSaver(db).aget_tuple(config)
        return found and found.checkpoint["channel_values"]

    return _on_its_database(wire_uri, database, read)


def _checkpointed_rolled_back_and_run_again(
    wire_uri: str, database: Database[dict[str, Any]]
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A graph checkpoints "c-1", a rollback (`agent_messages` kept), and the second attempt's
    run (exit 0): the version read at the checkpoint, and the conversation's document before
    the rollback and after the run."""
    version = _graph_checkpoint(wire_uri, database, "c-1")
    written = database[CONVERSATIONS].find_one({"_id": "c-1"})
    assert written is not None
    roll_back(database, clear_messages=False)
    assert cli(wire_uri, database, "run") == 0
    again = database[CONVERSATIONS].find_one({"_id": "c-1"})
    assert again is not None
    return version, dict(written), dict(again)


LIFE = ("epoch", "epoch_marks", "migrated")


@pytest.mark.wire
@pytest.mark.parametrize("live_turn", [False, True], ids=["checkpoint only", "live turn"])
def test_a_conversation_the_migration_created_keeps_its_life_across_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]], live_turn: bool
) -> None:
    """MIGRATION.md "Rollback": the migration never drops or changes an epoch. A conversation
    a run created, whose document a rollback moved away, is the same life after the second
    attempt's run: its epoch, `epoch_marks` and `migrated` mark as they were, so its version
    still names it and its graph's state is still its own, whether or not a live turn was
    logged to it before the rollback."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    if live_turn:
        log_live(wire_uri, database, "c-1", "live-1", "LIVE", dual_write=True)
    version, written, again = _checkpointed_rolled_back_and_run_again(wire_uri, database)

    assert {k: again.get(k) for k in LIFE} == {k: written.get(k) for k in LIFE}
    assert Conversation.model_validate(again).version == version
    assert _graph_state(wire_uri, database, "c-1") == {"plan": "STEP 3"}
    assert cli(wire_uri, database, "verify") == 0


@pytest.mark.wire
def test_a_conversation_whose_migrated_messages_were_all_popped_keeps_its_life_across_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A pop never ends a life: the owner popped every message the run stored and logged her
    turn again live, then a rollback and the second attempt's run. The conversation keeps its
    epoch, its live messages are served and counted, its graph's state is its own (was: taken
    for a deleted conversation, another epoch drawn, her live messages served by no read)."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0

    async def pop_both(db: Any) -> None:
        store = ConversationStore(db, legacy=LegacyTurns(db))
        for _ in range(2):
            await store.pop_last_message("c-1", user_id="u-1")

    _on_its_database(wire_uri, database, pop_both)
    log_live(wire_uri, database, "c-1", "live-1", "AGAIN")
    version, written, again = _checkpointed_rolled_back_and_run_again(wire_uri, database)

    assert again.get("epoch") == written.get("epoch")
    assert Conversation.model_validate(again).version == version
    assert _graph_state(wire_uri, database, "c-1") == {"plan": "STEP 3"}

    async def served(db: Any) -> list[Any]:
        store = ConversationStore(db, legacy=LegacyTurns(db))
        return [m.content for m in await store.transcript("c-1", user_id="u-1")]

    assert _on_its_database(wire_uri, database, served) == ["AGAIN?", "AGAIN"]


@pytest.mark.wire
def test_a_conversation_migrated_again_after_a_delete_takes_nothing_of_a_late_live_insert(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A conversation migrated anew after a delete is another life, even where a stalled
    writer's insert of the deleted one's live turn landed after the delete (its messages
    carry the deleted life's epoch): Mallory's `x` draws an epoch of its own, so its version
    is not Ada's (her retried DELETE is 412, nothing deleted), a service's graph read of it
    serves none of Ada's state, and it counts only its own messages."""
    from langgraph.checkpoint.base import empty_checkpoint

    from agent_store.integrations.langgraph import CHECKPOINTS, AgentStoreSaver

    _mixed_x(database)
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "x", "live-1", "ADA LIVE", user_id="u-ada")

    async def ada(db: Any) -> str:
        store = ConversationStore(db, legacy=LegacyTurns(db))
        version = (await store.get_conversation("x", user_id="u-ada")).version
        state = empty_checkpoint()
        state["channel_values"] = {"plan": "ADA PRIVATE PLAN"}
        config = {"configurable": {"thread_id": "x", "user_id": "u-ada"}}
        await AgentStoreSaver(db).aput(config, state, {}, {})
        late = await db[CHECKPOINTS].find({"thread_id": "x"}).to_list(None)
        live = await db[MESSAGES].find({"conversation_id": "x", "turn_id": "live-1"}).to_list(None)
        assert (await store.delete("x", user_id="u-ada", version=version)).conversations == 1
        await db[MESSAGES].insert_many(live)  # the stalled writer's insert lands after it
        await db[CHECKPOINTS].insert_many(late)  # and so does the graph's put
        return version

    version: str = _on_its_database(wire_uri, database, ada)
    ada_epoch = database[MESSAGES].find_one({"turn_id": "live-1"})
    assert ada_epoch is not None
    assert cli(wire_uri, database, "run") == 0

    again = database[CONVERSATIONS].find_one({"_id": "x"})
    assert again is not None
    assert again["user_id"] == "u-mallory"
    assert again["epoch"] != ada_epoch["epoch"]
    assert (again.get("epoch_marks"), again.get("migrated")) == (True, True)
    assert again["message_count"] == 2

    async def mallory(db: Any) -> tuple[str, Any]:
        store = ConversationStore(db, legacy=LegacyTurns(db))
        now = (await store.get_conversation("x", user_id="u-mallory")).version
        with pytest.raises(VersionMismatch):
            await store.delete("x", version=version)
        found = await AgentStoreSaver(db).aget_tuple({"configurable": {"thread_id": "x"}})
        return now, found and found.checkpoint["channel_values"]

    now, served = _on_its_database(wire_uri, database, mallory)
    assert now != version
    assert served is None
    assert database[CONVERSATIONS].find_one({"_id": "x"}) is not None


def _served(wire_uri: str, database: Database[dict[str, Any]], cid: str) -> list[Any]:
    """What the store serves of `cid`'s transcript to its owner "u-1"."""

    async def read(db: Any) -> list[Any]:
        store = ConversationStore(db, legacy=LegacyTurns(db, read_fallback=True))
        return [m.content for m in await store.transcript(cid, user_id="u-1")]

    return list(_on_its_database(wire_uri, database, read))


@pytest.mark.wire
@pytest.mark.parametrize("earlier", [False, True], ids=["its epoch", "an earlier release's"])
def test_the_gate_holds_while_the_store_serves_a_migrated_message_as_another_lifes(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    earlier: bool,
) -> None:
    """`finish` exit 0 lets the operator drop the legacy turns, so every migrated message must
    be one the store serves as its conversation's: of its document's life (`of_epoch`). One
    carrying another epoch (as a message of another life under the id would) is left out of
    every read: `verify` and `finish` exit 1 and name it (was: exit 0, the answer hidden), and
    `run` writes it again as the migration's, served once more, the document's life as it
    was (its epoch, or none for a document an earlier release migrated: never the one the
    edited message carries)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-1", "c-1", 0, "ONE"), legacy_turn("t-2", "c-1", 1, "TWO")]
    )
    assert cli(wire_uri, database, "run") == 0
    if earlier:
        life = dict.fromkeys(("epoch", "epoch_marks", "migrated"), "")
        database[CONVERSATIONS].update_one({"_id": "c-1"}, {"$unset": life})
    epoch, _ = _epochs(database, "c-1")
    assert cli(wire_uri, database, "finish") == 0
    whole = _served(wire_uri, database, "c-1")
    last = database[MESSAGES].find_one({"conversation_id": "c-1"}, sort=[("seq", -1)])
    assert last is not None
    database[MESSAGES].update_one({"_id": last["_id"]}, {"$set": {"epoch": "0" * 16}})
    assert _served(wire_uri, database, "c-1") == whole[:-1]
    capsys.readouterr()

    assert cli(wire_uri, database, "verify") == 1
    assert str(last["_id"]) in capsys.readouterr().out
    assert cli(wire_uri, database, "finish") == 1
    said = capsys.readouterr().out
    assert str(last["_id"]) in said
    assert "another life" in said

    assert cli(wire_uri, database, "run") == 0
    assert _served(wire_uri, database, "c-1") == whole
    assert _epochs(database, "c-1") == (epoch, [None] * 4)
    assert cli(wire_uri, database, "finish") == 0


def _checkpoint_naming_no_life(
    wire_uri: str, database: Database[dict[str, Any]], thread_id: str, plan: str
) -> None:
    """A graph checkpoint of `thread_id` holding `plan` that names no conversation's life, as
    one written before checkpoints named their conversation."""
    from langgraph.checkpoint.base import empty_checkpoint

    from agent_store.integrations.langgraph import CHECKPOINTS, AgentStoreSaver

    async def put(db: Any) -> None:
        state = empty_checkpoint()
        state["channel_values"] = {"plan": plan}
        config = {"configurable": {"thread_id": thread_id, "user_id": "u-1"}}
        await AgentStoreSaver(db).aput(config, state, {}, {})
        unnamed = {"epoch": "", "conversation_created_ms": ""}
        await db[CHECKPOINTS].update_many({"thread_id": thread_id}, {"$unset": unnamed})

    _on_its_database(wire_uri, database, put)


@pytest.mark.wire
def test_a_conversation_created_live_keeps_its_epoch_marks_across_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A conversation the new service created (its own epoch, `epoch_marks`: documents beside
    it name its epoch), dual-written, then the rollback (`agent_messages` kept) and the
    second attempt's run: its document is written again with its whole life, the epoch its
    live messages carry and its marks, so a graph checkpoint of its thread naming no life
    (written before documents named one) is still none of its state (was: `epoch_marks`
    dropped, and that checkpoint served to its owner)."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "other", 0, "OTHER"))
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "x", "live-1", "LIVE", dual_write=True)
    _checkpoint_naming_no_life(wire_uri, database, "x", "STRAY PLAN OF ANOTHER LIFE")
    assert _graph_state(wire_uri, database, "x") is None
    written = database[CONVERSATIONS].find_one({"_id": "x"})
    assert written is not None
    assert written.get("epoch_marks") is True
    roll_back(database, clear_messages=False)

    assert cli(wire_uri, database, "run") == 0
    again = database[CONVERSATIONS].find_one({"_id": "x"})
    assert again is not None
    assert {k: again.get(k) for k in LIFE} == {k: written.get(k) for k in LIFE}
    assert _graph_state(wire_uri, database, "x") is None
    assert cli(wire_uri, database, "verify") == 0


@pytest.mark.wire
def test_a_conversation_an_earlier_release_migrated_stays_unmarked_across_a_rollback(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A conversation an earlier release migrated (no epoch, no life recorded) whose first
    live turn since drew its epoch stays without `epoch_marks` after a rollback and the
    second attempt's run: its migrated messages carry none, so documents beside it may
    name only its creation time, and its graph's state stays its own."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    earlier = dict.fromkeys(LIFE, "")
    database[CONVERSATIONS].update_one({"_id": "c-1"}, {"$unset": earlier})
    database[lease.STATE].delete_many({"kind": "life"})
    log_live(wire_uri, database, "c-1", "live-1", "LIVE", dual_write=True)
    version, written, again = _checkpointed_rolled_back_and_run_again(wire_uri, database)

    assert isinstance(written.get("epoch"), str)
    life = {k: bool(again.get(k)) for k in LIFE}
    assert life == {"epoch": True, "epoch_marks": False, "migrated": False}
    assert again["epoch"] == written["epoch"]
    assert Conversation.model_validate(again).version == version
    assert _graph_state(wire_uri, database, "c-1") == {"plan": "STEP 3"}


@pytest.mark.wire
def test_an_earlier_release_migration_whose_migrated_messages_were_popped_stays_unmarked(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """A conversation an earlier release migrated (no epoch, no life recorded), which its
    owner's graph checkpointed then (naming its creation time, no epoch), whose migrated
    messages she popped before logging a dual-written live turn (drawing its epoch), is
    still the conversation the old service wrote after a rollback and the second attempt's
    run: the legacy turn the old service wrote says it predates epochs, so its document is
    written again without `epoch_marks` and her graph's state is still her own (was:
    marked, as every message still stored carries the epoch, and her state read by no one)."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    database[CONVERSATIONS].update_one({"_id": "c-1"}, {"$unset": dict.fromkeys(LIFE, "")})
    database[lease.STATE].delete_many({"kind": "life"})
    _graph_checkpoint(wire_uri, database, "c-1")
    assert _pop(wire_uri, database, "c-1", 2) == ["OLD answer", "OLD question"]
    log_live(wire_uri, database, "c-1", "live-1", "LIVE", dual_write=True)
    assert _graph_state(wire_uri, database, "c-1") == {"plan": "STEP 3"}
    written = database[CONVERSATIONS].find_one({"_id": "c-1"})
    assert written is not None
    roll_back(database, clear_messages=False)

    assert cli(wire_uri, database, "run") == 0
    again = database[CONVERSATIONS].find_one({"_id": "c-1"})
    assert again is not None
    assert again.get("epoch") == written["epoch"]
    assert not again.get("epoch_marks")
    assert _graph_state(wire_uri, database, "c-1") == {"plan": "STEP 3"}


@pytest.mark.wire
def test_a_conversation_the_old_service_wrote_to_after_a_rollback_is_written_again_unmarked(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """MIGRATION.md "Rollback": a conversation the new service created (its epoch, marked),
    dual-written, then the rollback, a late turn the old service wrote to it (no dual
    write), and the second attempt's run: documents the old release wrote beside it name no
    epoch, so its document is written again with its epoch but without `epoch_marks`, and a
    graph checkpoint of its thread naming none is served to its owner, not hidden."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-1", "other", 0, "OTHER"))
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "x", "live-1", "LIVE", dual_write=True)
    _checkpoint_naming_no_life(wire_uri, database, "x", "OLD RELEASE PLAN")
    written = database[CONVERSATIONS].find_one({"_id": "x"})
    assert written is not None
    assert written.get("epoch_marks") is True
    roll_back(database, clear_messages=False)
    late = legacy_turn("t-late", "x", 0, "LATE") | {"created_at": datetime.now(UTC)}
    database[CONVERSATIONS].insert_one(late)

    cli(wire_uri, database, "run")
    again = database[CONVERSATIONS].find_one({"_id": "x"})
    assert again is not None
    assert again.get("epoch") == written["epoch"]
    assert not again.get("epoch_marks")
    assert _graph_state(wire_uri, database, "x") == {"plan": "OLD RELEASE PLAN"}


def _late_turns_logged(database: Database[dict[str, Any]], turns: list[dict[str, Any]]) -> None:
    """The old service logs `turns` in `agent_conversations` after the move, each `MARKER` in
    them text that is not valid UTF-8 (`hold_not_utf8`)."""
    database[CONVERSATIONS].insert_many(turns)
    hold_not_utf8(database[CONVERSATIONS])


def test_a_late_turn_not_valid_utf8_under_a_moved_turns_id_is_refused_with_advice(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md: after a finished migration the old service logs a turn under the `_id` of
    a moved turn, holding text that is not valid UTF-8, and a clean late turn. `run` and
    `run --dry-run` refuse it as they refuse one of clean text there (exit 1, "give the turn
    another _id"), encoding nothing, every time (was: a UnicodeEncodeError traceback out of
    every run, naming nothing). Given another `_id`, the turn is left in
    `agent_conversations` as stored, named, its conversation held back, and the clean late
    turn moves and migrates."""
    turns = [legacy_turn("x1", "c", 0, "one"), legacy_turn("x2", "c", 1, "two"),
             legacy_turn("y1", "other", 2, "other")]  # fmt: skip
    database = _on_mongomock(monkeypatch, turns)
    assert cli("mongodb://unused", database, "run", "--spread", "1") == 0
    _late_turns_logged(
        database, [legacy_turn("x2", "c", 3, MARKER), legacy_turn("y2", "other", 4, "late")]
    )
    _encoding_queries(monkeypatch)
    capsys.readouterr()

    for command in [("run",), ("run",), ("run", "--dry-run")]:
        assert cli("mongodb://unused", database, *command, "--spread", "1") == 1
        said = capsys.readouterr().err
        assert "'x2' exists in agent_conversations_deprecated with other content" in said
        assert "give the turn in agent_conversations another _id" in said
    assert database[LEGACY_TURNS].find_one({"_id": "x2"})["user_message"] == "two question"  # type: ignore[index]

    database[CONVERSATIONS].delete_one({"_id": "x2"})  # the operator: another _id
    _late_turns_logged(database, [legacy_turn("x3", "c", 3, MARKER)])
    assert cli("mongodb://unused", database, "run", "--spread", "1") == 0
    out = capsys.readouterr().out

    assert "turn 'x3' (user_message holds bytes that are not valid UTF-8)" in out, out
    assert "hold back their conversations 'c'" in out, out
    assert [t["_id"] for t in database[CONVERSATIONS].find({"user_message": {"$exists": 1}})] == [
        "x3"
    ]
    late = database[MESSAGES].find({"conversation_id": "other", "role": "user"}, sort=[("seq", 1)])
    assert [m["content"] for m in late] == ["other question", "late question"]


def test_a_turn_whose_id_is_not_valid_utf8_left_by_a_copy_is_named_again_by_every_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MIGRATION.md: a copy leaves a turn whose `_id` holds text that is not valid UTF-8 in
    `agent_conversations`, named, its conversation held back; every later `run` (and
    `run --dry-run`) names it again and migrates the others, sending its `_id` in no query
    (was: a UnicodeEncodeError traceback out of every run after the first, the `_id` sent in
    the check for a collection a rollback left standing)."""
    monkeypatch.setattr(
        relocate, "relocate", functools.partial(relocate.relocate, allow_rename=False)
    )
    database = _on_mongomock(monkeypatch, _turns_one_not_utf8("_id"))
    _encoding_queries(monkeypatch)
    bad_id = "t-bad" + NOT_UTF8

    for command in [("run",), ("run",), ("run", "--dry-run"), ("run",)]:
        assert cli("mongodb://unused", database, *command, "--spread", "1") == 0
        out = capsys.readouterr().out
        if command != ("run", "--dry-run"):
            assert f"turn {bad_id!r} (_id holds bytes that are not valid UTF-8)" in out, out
            assert "hold back their conversations 'c-bad'" in out, out
    migrated = {m["conversation_id"] for m in database[MESSAGES].find()}
    assert migrated == {"c-good-1", "c-good-2"}
    assert [t["_id"] for t in database[CONVERSATIONS].find({"user_message": {"$exists": 1}})] == [
        bad_id
    ]


def _copy_confirmation_fails_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The write that follows a turn's copy (`LegacyTurns._record_copy`) fails once, as a
    primary stepping down would: the runtime is told the turn failed (StorageUnavailable)."""
    _dual_write_step_fails_once(monkeypatch, "_record_copy")


def _dual_write_step_fails_once(monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    """The dual write's `step` (a method of `LegacyTurns`) fails once, as a primary stepping
    down would."""
    failed: list[bool] = []
    real = getattr(LegacyTurns, step)

    async def flaky(self: LegacyTurns, *args: Any) -> Any:
        if not failed:
            failed.append(True)
            raise AutoReconnect("primary stepped down")
        return await real(self, *args)  # what the step says (`_intend_copy`'s record)

    monkeypatch.setattr(LegacyTurns, step, flaky)


@pytest.mark.wire
@pytest.mark.parametrize("copy", ["standing", "deleted"])
def test_a_copy_whose_record_was_not_confirmed_is_never_passed_unchecked_nor_blamed_on_a_release(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    copy: str,
) -> None:
    """The write after a turn's copy fails and the runtime never sends the turn again. The
    copy was recorded as intended before it was written: while it stands the gate passes it
    and says nothing of an earlier release; once it is gone (deleted by the old service, or
    never written) `verify` and `finish` fail naming the turn, advising no blind deletion
    (was: an unrecorded copy, "written before this release recorded copies", exit 0, and the
    exchange deleted on the old service served)."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    _copy_confirmation_fails_once(monkeypatch)
    with pytest.raises(StorageUnavailable):
        log_live(wire_uri, database, "c-1", "t1", "«SECRET»", dual_write=True)
    log_live(wire_uri, database, "c-1", "t2", "«NEXT»", dual_write=True)
    if copy == "deleted":
        database[LEGACY_TURNS].delete_one({"dual_write": True, "turn_id": "t1"})

    for out in _gate_says(wire_uri, database, capsys, exits=int(copy == "deleted")):
        assert "written before this release" not in out
        assert "is gone from the legacy collection" not in out  # no advice to pop blindly
        assert ("'t1'" in out) is (copy == "deleted")
        assert "'t2'" not in out


@pytest.mark.wire
@pytest.mark.parametrize("operator", ["stops", "puts the documents back"])
def test_a_conversation_the_old_service_deleted_whole_after_a_rollback_is_named_a_deleted_copy(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    operator: str,
) -> None:
    """After a rollback the old service deletes two conversations whole (a migrated one and
    one started live), their dual-written copies too: no legacy turn lists them, yet the
    records of their copies do. `verify` and `finish` name the copies gone, wherever the
    conversations stand, and never advise putting a document back for them (was: "logged
    while the dual write was off … Put its conversation document back", and once the
    documents were put back `verify` and `finish` exited 0 serving what Ada deleted)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-0", "c-1", 0, "OLD"), legacy_turn("t-2", "c-2", 0, "OTHER")]
    )
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "live-1", "«SECRET c-1»", dual_write=True)
    log_live(wire_uri, database, "n-1", "live-2", "«SECRET n-1»", dual_write=True)
    documents = list(database[CONVERSATIONS].find({"_id": {"$in": ["c-1", "n-1"]}}))
    roll_back(database, clear_messages=False)
    database[CONVERSATIONS].delete_many({"conversation_id": {"$in": ["c-1", "n-1"]}})
    assert cli(wire_uri, database, "run") == 0
    if operator == "puts the documents back":
        database[CONVERSATIONS].insert_many(documents)

    for out in _gate_says(wire_uri, database, capsys, exits=1):
        assert "copy of the live turn 'live-1' is gone" in out
        assert "copy of the live turn 'live-2' is gone" in out
        assert "Put its conversation document back" not in out


@pytest.mark.wire
def test_run_confirms_the_record_a_standing_copy_names_so_its_later_deletion_is_a_copy_gone(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy whose record stayed intended (the write after it failed), or lost (removed by
    hand), names its record: `run` confirms it while the copy stands, so once the old
    service deletes the copy the gate calls it gone, and says nothing of an earlier release
    meanwhile."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    _copy_confirmation_fails_once(monkeypatch)
    with pytest.raises(StorageUnavailable):
        log_live(wire_uri, database, "c-1", "t1", "«SECRET»", dual_write=True)
    log_live(wire_uri, database, "c-1", "t2", "«NEXT»", dual_write=True)
    database[lease.STATE].delete_one({"kind": dual_writes.COPY_RECORD, "state": "copied"})
    assert cli(wire_uri, database, "run") == 0
    states = [d.get("state") for d in database[lease.STATE].find({"kind": "dual_write_copy"})]
    assert states == ["copied", "copied"]
    database[LEGACY_TURNS].delete_many({"dual_write": True})

    capsys.readouterr()
    assert cli(wire_uri, database, "finish") == 1
    out = capsys.readouterr().out
    assert "copy of the live turn 't1' is gone" in out
    assert "copy of the live turn 't2' is gone" in out


def _a_turn_copied_as_two_legacy_turns(
    wire_uri: str, database: Database[dict[str, Any]], shape: str
) -> tuple[str, str]:
    """A legacy turn of "c-1" migrated (seq 0-1), then, with the dual write on, either one
    live turn `t1` of two exchanges, «A» then «B» (seq 2-5, copied as two legacy turns,
    cut before its second user's message), or two live turns «A» and «B» and a fork "f-1"
    of the whole (its one turn copied as three legacy turns, one per turn of the original:
    «A» at seq 2-3, «B» at 4-5); then the runbook's rollback keeping `agent_messages`. The
    conversation and the turn holding the exchanges."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0

    async def log() -> str:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(wire_uri, tz_aware=True)
        db = client[database.name]
        legacy = LegacyTurns(db, dual_write=True)
        logger = AgentMessageLogger(db, observers=[legacy], legacy=legacy)
        exchanges = [
            [{"role": "user", "content": f"«{x}»?"}, {"role": "assistant", "content": f"r{x}"}]
            for x in "AB"
        ]
        try:
            if shape == "two exchanges":
                await logger.log_messages("c-1", [*exchanges[0], *exchanges[1]],
                                          user_id="u-1", turn_id="t1")  # fmt: skip
                return "t1"
            for n, exchange in enumerate(exchanges, start=1):
                await logger.log_messages("c-1", exchange, user_id="u-1", turn_id=f"t{n}")
            return (await logger.fork("c-1", 5, "f-1", user_id="u-1")).turn_id
        finally:
            await client.close()

    turn_id = asyncio.run(log())
    roll_back(database, clear_messages=False)
    return ("c-1" if shape == "two exchanges" else "f-1"), turn_id


def _served_user_texts(wire_uri: str, database: Database[dict[str, Any]], cid: str) -> list[str]:
    texts: list[str] = []

    async def read(store: ConversationStore) -> None:
        texts.extend(m.content or "" for m in await store.transcript(cid) if m.role == "user")

    _as_a_person(wire_uri, database, read)
    return texts


TURNS_COPIED_AS_SEVERAL = ["two exchanges", "a fork"]


@pytest.mark.wire
@pytest.mark.parametrize("shape", TURNS_COPIED_AS_SEVERAL)
@pytest.mark.parametrize("operator", ["stops", "unmarks the copy and accepts"])
def test_a_later_legacy_turn_of_a_copy_the_old_service_deleted_is_a_copy_gone(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    shape: str,
    operator: str,
) -> None:
    """A turn copied as several legacy turns (one per exchange; a fork's turn one per turn of
    its original): after a rollback a person deletes the later exchange, «B», on the old
    service. The record of the copy lists every legacy turn of it, so the gate names that
    one gone with the messages it held (seq 4-5), never advising to remove the copy's
    `dual_write` mark; an operator removing it anyway and accepting what `run` records
    still gets exit 1 (was: only the first legacy turn was checked, the gate advised the
    unmark, and after the accept `finish` exited 0, for a fork `verify` too, serving «B»).
    Those two messages removed, the gate passes: what the person deleted is no longer
    served, and «A» stays."""
    cid, turn_id = _a_turn_copied_as_two_legacy_turns(wire_uri, database, shape)
    database[CONVERSATIONS].delete_one({"conversation_id": cid, "user_message": "«B»?"})
    assert cli(wire_uri, database, "run") == 0
    piece_gone = f"the dual-written copy of the messages at seq 4-5 of the live turn {turn_id!r}"
    if operator == "unmarks the copy and accepts":
        unmark = {"$unset": {"dual_write": ""}}
        database[LEGACY_TURNS].update_many({"conversation_id": cid, "dual_write": True}, unmark)
        assert cli(wire_uri, database, "run") == 0
        cli(wire_uri, database, "finish", "--accept", cid, "--note", "kept elsewhere")

    for out in _gate_says(wire_uri, database, capsys, exits=1):
        assert piece_gone in out
        assert "remove its `dual_write` mark" not in out
    assert "«B»?" in _served_user_texts(wire_uri, database, cid)
    if operator == "stops":
        database[MESSAGES].delete_many({"conversation_id": cid, "seq": {"$in": [4, 5]}})
        assert cli(wire_uri, database, "verify") == 0
        assert cli(wire_uri, database, "finish") == 0
        assert _served_user_texts(wire_uri, database, cid)[-1] == "«A»?"


@pytest.mark.wire
@pytest.mark.parametrize("shape", TURNS_COPIED_AS_SEVERAL)
def test_a_first_legacy_turn_of_a_copy_the_old_service_deleted_names_only_its_messages(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    shape: str,
) -> None:
    """After a rollback a person deletes the first exchange, «A», of a turn copied as
    several legacy turns: the gate names the messages that legacy turn held (seq 2-3)
    gone, never the copy of the whole turn, whose «B» still stands and nobody deleted (was:
    "the dual-written copy of the live turn … is gone …: pop its messages", which takes «B»
    too)."""
    cid, turn_id = _a_turn_copied_as_two_legacy_turns(wire_uri, database, shape)
    database[CONVERSATIONS].delete_one({"conversation_id": cid, "user_message": "«A»?"})
    assert cli(wire_uri, database, "run") == 0

    for out in _gate_says(wire_uri, database, capsys, exits=1):
        assert f"copy of the messages at seq 2-3 of the live turn {turn_id!r} (one of" in out
        assert f"copy of the live turn {turn_id!r} is gone" not in out
        assert "remove its `dual_write` mark" not in out


@pytest.mark.wire
def test_a_copy_unconfirmed_missing_one_of_its_legacy_turns_is_asked_about_never_called_deleted(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A turn of two exchanges whose copy's record stayed intended (the write after the copy
    failed, the runtime told the turn failed), its second legacy turn missing (never written,
    or deleted since): `run` does not confirm a record one of whose legacy turns is missing,
    and the gate asks whether the person deleted that exchange, naming its messages, never
    calling it a deletion to act on (was: the first legacy turn standing passed the copy, or,
    confirmed by `run` on the first one's word, would have been called deleted)."""
    _copy_confirmation_fails_once(monkeypatch)
    with pytest.raises(StorageUnavailable):
        _a_turn_copied_as_two_legacy_turns(wire_uri, database, "two exchanges")
    database[LEGACY_TURNS].delete_one({"dual_write": True, "user_message": "«B»?"})
    assert cli(wire_uri, database, "run") == 0
    states = [d.get("state") for d in database[lease.STATE].find({"kind": "dual_write_copy"})]
    assert states == ["intended"]

    for out in _gate_says(wire_uri, database, capsys, exits=1):
        assert "recorded it would copy the live turn 't1'" in out
        assert "the legacy turn of it holding the messages at seq 4-5" in out
        assert "is gone from the legacy collection" not in out


def _record_of(database: Database[dict[str, Any]], collection: str, turn_id: str) -> str:
    """The `_id` of the record of a live turn's copy, as its legacy turns in `collection`
    name it."""
    copy = database[collection].find_one({"dual_write": True, "turn_id": turn_id})
    assert copy is not None
    return str(copy["dual_write_record"])


@pytest.mark.wire
@pytest.mark.parametrize("shape", TURNS_COPIED_AS_SEVERAL)
def test_a_copy_record_removed_by_hand_is_written_again_listing_every_legacy_turn_of_its_turn(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    shape: str,
) -> None:
    """MIGRATION.md "What `finish` guarantees": no path writes the record of a copy without
    the legacy turns it lists. The record of a turn copied as several legacy turns removed
    by hand, `run` writes it again from the copies standing and the turn's stored messages,
    listing each legacy turn as the dual write did (was: `{state: "copied"}` alone, so the
    gate checked the first legacy turn only). After a second rollback a person deletes the
    later exchange, «B», on the old service: the gate names those messages gone, never
    advising to remove the copy's `dual_write` mark (was: that difference alone, whose advice,
    unmark, `run`, `finish --accept`, ended with the drop at 0 serving «B»)."""
    cid, turn_id = _a_turn_copied_as_two_legacy_turns(wire_uri, database, shape)
    record_id = _record_of(database, CONVERSATIONS, turn_id)
    recorded = database[lease.STATE].find_one({"_id": record_id})
    assert recorded is not None
    assert len(recorded["pieces"]) >= 2
    database[lease.STATE].delete_one({"_id": record_id})
    assert cli(wire_uri, database, "run") == 0
    again = database[lease.STATE].find_one({"_id": record_id})
    assert again is not None
    assert (again.get("state"), again.get("pieces")) == ("copied", recorded["pieces"])

    roll_back(database, clear_messages=False)
    database[CONVERSATIONS].delete_one({"conversation_id": cid, "user_message": "«B»?"})
    assert cli(wire_uri, database, "run") == 0
    for out in _gate_says(wire_uri, database, capsys, exits=1):
        assert f"copy of the messages at seq 4-5 of the live turn {turn_id!r}" in out
        assert "remove its `dual_write` mark" not in out


@pytest.mark.wire
@pytest.mark.parametrize("operator", ["copies it again", "deletes the record first"])
def test_a_copy_unconfirmed_missing_an_exchange_nobody_deleted_is_copied_again_never_lost(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    operator: str,
) -> None:
    """A turn of two exchanges whose copy's record stayed intended and whose second legacy
    turn is missing (the runtime stopped between its writes), before any rollback: the gate
    asks whether the person deleted that exchange and, if not, advises keeping the record
    and `run --copy-again RECORD`, never deleting the record (was: "delete that record",
    which `run` wrote again without its legacy turns, so the gate passed a copy lacking «B»,
    which a rollback then loses). An operator deleting the record anyway gets it written
    again still asking. `run --copy-again` writes the missing legacy turn from the stored
    messages and confirms the record: the gate passes, and when after a rollback the person
    deletes «B» on the old service, the gate names those messages alone gone; removed, «A»
    stays served and «B» is not."""
    _copy_confirmation_fails_once(monkeypatch)
    with pytest.raises(StorageUnavailable):
        _a_turn_copied_as_two_legacy_turns(wire_uri, database, "two exchanges")
    database[LEGACY_TURNS].delete_one({"dual_write": True, "user_message": "«B»?"})
    record_id = _record_of(database, LEGACY_TURNS, "t1")
    for out in _gate_says(wire_uri, database, capsys, exits=1):
        assert "the legacy turn of it holding the messages at seq 4-5" in out
        assert f"run `run --copy-again {record_id}`" in out
        assert "delete that record" not in out
    if operator == "deletes the record first":
        database[lease.STATE].delete_one({"_id": record_id})
        assert cli(wire_uri, database, "run") == 0
        again = database[lease.STATE].find_one({"_id": record_id}) or {}
        assert again.get("state") == "intended"
        assert len(again.get("pieces") or []) == 2
        for out in _gate_says(wire_uri, database, capsys, exits=1):
            assert "the legacy turn of it holding the messages at seq 4-5" in out

    assert cli(wire_uri, database, "run", "--copy-again", record_id) == 0
    copies = database[LEGACY_TURNS].find({"dual_write": True, "turn_id": "t1"})
    assert sorted(c["user_message"] for c in copies) == ["«A»?", "«B»?"]
    assert (database[lease.STATE].find_one({"_id": record_id}) or {}).get("state") == "copied"
    _gate_says(wire_uri, database, capsys, exits=0)
    assert cli(wire_uri, database, "run", "--copy-again", record_id) == 2  # confirmed now

    roll_back(database, clear_messages=False)
    database[CONVERSATIONS].delete_one({"conversation_id": "c-1", "user_message": "«B»?"})
    assert cli(wire_uri, database, "run") == 0
    for out in _gate_says(wire_uri, database, capsys, exits=1):
        assert "copy of the messages at seq 4-5 of the live turn 't1'" in out
        assert "remove its `dual_write` mark" not in out
    database[MESSAGES].delete_many({"conversation_id": "c-1", "seq": {"$in": [4, 5]}})
    _gate_says(wire_uri, database, capsys, exits=0)
    served = _served_user_texts(wire_uri, database, "c-1")
    assert "«A»?" in served
    assert "«B»?" not in served


def _copy_intent_fails_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dual write's first write after the turn is stored (`LegacyTurns._intend_copy`, the
    record of the copy it is about to write) fails once, as a primary stepping down would:
    the turn is stored, neither its copy nor a record of it is written, and the runtime is
    told the turn failed (StorageUnavailable)."""
    _dual_write_step_fails_once(monkeypatch, "_intend_copy")


@pytest.mark.wire
@pytest.mark.parametrize("after", ["no rollback", "the old service deleted it whole"])
def test_a_turn_whose_copy_was_owed_but_never_recorded_is_never_passed_nor_its_document_put_back(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    after: str,
) -> None:
    """MIGRATION.md "What `finish` guarantees": the record of a turn's copy, written before
    the copy, fails, and the runtime never sends the turn again: the turn is stored, with
    neither copy nor record. Its messages say the dual write owed it a copy (`copy_owed`,
    written by the insert that stored them), so the gate never reads it as logged with the
    dual write off: `verify` and `finish` fail naming it and asking the person, before any
    rollback and after the old service deleted the conversation whole, and never advise
    putting its document back (was: exit 0 before the rollback; after it, "logged while the
    dual write was off … Put its conversation document back", which brought back what Ada
    deleted, `finish` and the drop at 0). Its advice followed, the gate passes: the person
    having deleted nothing, `run --copy-again RECORD` writes the copy and its record (was:
    "unset `copy_owed`", after which a rollback lost the turn)."""
    database[CONVERSATIONS].insert_many(
        [legacy_turn("t-0", "c-1", 0, "OLD"), legacy_turn("t-2", "c-2", 0, "OTHER")]
    )
    assert cli(wire_uri, database, "run") == 0
    _copy_intent_fails_once(monkeypatch)
    with pytest.raises(StorageUnavailable):
        log_live(wire_uri, database, "c-1", "t1", "«SECRET»", dual_write=True)
    log_live(wire_uri, database, "c-1", "t2", "«NEXT»", dual_write=True)
    assert database[lease.STATE].count_documents({"kind": dual_writes.COPY_RECORD}) == 1
    if after != "no rollback":
        roll_back(database, clear_messages=False)
        database[CONVERSATIONS].delete_many({"conversation_id": "c-1"})
        assert cli(wire_uri, database, "run") == 0

    for out in _gate_says(wire_uri, database, capsys, exits=1):
        assert "owed a copy of the live turn 't1'" in out, out
        assert "Put its conversation document back" not in out
        assert "written before this release" not in out
        assert "'t2' is gone" in out if after != "no rollback" else "'t2'" not in out

    if after == "no rollback":  # the person deleted nothing: the turn is copied now
        record_id = _owed_record(database)
        assert f"run `run --copy-again {record_id}`" in out
        assert "unset `copy_owed`" not in out
        assert cli(wire_uri, database, "run", "--copy-again", record_id) == 0
        assert database[LEGACY_TURNS].count_documents({"turn_id": "t1"}) == 1
    else:  # the person deleted the conversation: its messages go
        database[MESSAGES].delete_many({"conversation_id": "c-1"})
    for command in ("verify", "finish"):
        assert cli(wire_uri, database, command) == 0
    assert (database[MESSAGES].count_documents({"conversation_id": "c-1"}) > 0) is (
        after == "no rollback"
    )


OWED_FAILURES = {
    "its record's write failed": "_intend_copy",
    "the turn's own write failed after its insert landed": "turn_logged",
}
"""How a dual-written turn ends stored marked `copy_owed` with neither record nor copy: the
dual write's first write (the record before the copy) fails, or the dual write never begins
(the `LegacyTurns` step that fails once)."""


def _follow_owed_advice(wire_uri: str, database: Database[dict[str, Any]], out: str) -> None:
    """Follow, word for word, what the gate advises for a turn owed a copy and never recorded
    when the person deleted nothing."""
    kept = out.split("if not,", 1)[-1]
    if "unset `copy_owed`" in kept:
        database[MESSAGES].update_many({"turn_id": "t1"}, {"$unset": {"copy_owed": ""}})
        return
    named = re.search(r"`run --copy-again ([^`]+)`", kept)
    assert named is not None, kept
    assert cli(wire_uri, database, "run", "--copy-again", named.group(1)) == 0


def _owed_record(database: Database[dict[str, Any]]) -> str:
    """The `_id` the record of `c-1`'s turn `t1` has, or would have."""
    return copy_record_id("c-1", "t1", _epoch(database, "c-1"))


def _epoch(database: Database[dict[str, Any]], cid: str) -> Any:
    return (database[CONVERSATIONS].find_one({"_id": cid}) or {}).get("epoch")


@pytest.mark.wire
def test_copy_again_refuses_a_turn_owed_no_copy(
    wire_uri: str, database: Database[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`run --copy-again` of the record a live turn logged with the dual write off would have
    (its messages not marked `copy_owed`): exit 2, nothing written; the gate still passes."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    log_live(wire_uri, database, "c-1", "t1", "«OFF»")
    assert cli(wire_uri, database, "run", "--copy-again", _owed_record(database)) == 2
    assert "owed it no copy" in capsys.readouterr().err
    assert database[LEGACY_TURNS].count_documents({"turn_id": "t1"}) == 0
    assert database[lease.STATE].count_documents({"kind": dual_writes.COPY_RECORD}) == 0
    _gate_says(wire_uri, database, capsys, exits=0)


@pytest.mark.wire
@pytest.mark.parametrize("step", OWED_FAILURES.values(), ids=list(OWED_FAILURES))
def test_a_turn_owed_a_copy_never_recorded_nobody_deleted_is_copied_never_lost_in_a_rollback(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    step: str,
) -> None:
    """A dual-written turn stored marked `copy_owed` whose record and copy were never written,
    the person having deleted nothing: the gate's advice, followed word for word, writes
    the copy and its record from the turn's stored messages (`run --copy-again RECORD`, the
    record the finding names), after which the gate passes and a rollback serves the turn
    (was: "unset `copy_owed` on the turn's messages", after which `verify` and `finish`
    exited 0 and the old service lacked a turn the new one had served). A second `run`
    changes nothing; the record copied again is refused (exit 2)."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    _dual_write_step_fails_once(monkeypatch, step)
    with pytest.raises((StorageUnavailable, AutoReconnect)):
        log_live(wire_uri, database, "c-1", "t1", "«KEPT»", dual_write=True)
    assert database[MESSAGES].count_documents({"turn_id": "t1", "copy_owed": True}) == 2
    assert database[LEGACY_TURNS].count_documents({"turn_id": "t1"}) == 0
    assert database[lease.STATE].count_documents({"kind": dual_writes.COPY_RECORD}) == 0

    said = _gate_says(wire_uri, database, capsys, exits=1)
    for out in said:
        assert "owed a copy of the live turn 't1'" in out, out
    _follow_owed_advice(wire_uri, database, said[0])
    assert cli(wire_uri, database, "run", "--copy-again", _owed_record(database)) == 2
    if any(cli(wire_uri, database, command) != 0 for command in ("verify", "finish")):
        return  # the gate holds the drop: nothing is lost
    copies = list(database[LEGACY_TURNS].find({"turn_id": "t1"}))
    records = list(database[lease.STATE].find({"kind": dual_writes.COPY_RECORD}))
    assert cli(wire_uri, database, "run") == 0  # a second run changes nothing
    assert list(database[LEGACY_TURNS].find({"turn_id": "t1"})) == copies
    assert list(database[lease.STATE].find({"kind": dual_writes.COPY_RECORD})) == records

    roll_back(database, clear_messages=False)
    legacy = [str(d.get("user_message")) for d in database[CONVERSATIONS].find()]
    assert any("«KEPT»" in text for text in legacy), legacy
    assert cli(wire_uri, database, "run") == 0
    assert "«KEPT»" in str(_served_user_texts(wire_uri, database, "c-1"))
    assert database[MESSAGES].count_documents({"turn_id": "t1"}) == 2


@pytest.mark.wire
@pytest.mark.parametrize("operator", ["follows the advice", "deletes the record anyway"])
def test_a_record_never_confirmed_passes_once_its_advice_for_an_exchange_kept_is_followed(
    wire_uri: str,
    database: Database[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    operator: str,
) -> None:
    """A record intended, never confirmed, its copy missing, and the person deleted nothing:
    the advice keeps the record and copies the turn again (`run --copy-again RECORD`), after
    which the copy stands and the gate passes (was: "delete that record and unset
    `copy_owed`", after which the gate passed while a rollback lost the turn). Deleting the
    record anyway leaves a turn that owed a copy and recorded none, still named."""
    database[CONVERSATIONS].insert_one(legacy_turn("t-0", "c-1", 0, "OLD"))
    assert cli(wire_uri, database, "run") == 0
    _copy_confirmation_fails_once(monkeypatch)
    with pytest.raises(StorageUnavailable):
        log_live(wire_uri, database, "c-1", "t1", "«KEPT»", dual_write=True)
    record_id = _record_of(database, LEGACY_TURNS, "t1")
    database[LEGACY_TURNS].delete_one({"dual_write": True, "turn_id": "t1"})
    capsys.readouterr()
    assert cli(wire_uri, database, "verify") == 1
    out = capsys.readouterr().out
    assert "keep that record (the legacy collection lacks a turn a rollback would lose)" in out
    assert f"run `run --copy-again {record_id}`" in out
    assert "unset `copy_owed`" not in out

    if operator == "deletes the record anyway":
        database[lease.STATE].delete_one({"_id": record_id})
        assert cli(wire_uri, database, "verify") == 1
        assert "owed a copy of the live turn 't1'" in capsys.readouterr().out
        return
    assert cli(wire_uri, database, "run", "--copy-again", record_id) == 0
    assert database[LEGACY_TURNS].count_documents({"dual_write": True, "turn_id": "t1"}) == 1
    for command in ("verify", "finish"):
        assert cli(wire_uri, database, command) == 0
