"""`python -m migrations <status|run|verify|finish>`: the legacy-turns migration for operators.

Exit codes: 0 success; 1 `verify` found differences or `finish` found work left;
2 misuse (bad options, a turn setting the service refuses, no legacy data); 3 the
lock is held; 4 the database is unreachable, the URI is wrong, or the database
refused a command; 130 and 143
stopped by SIGINT or SIGTERM (the lock released, what was written kept: `run`
again resumes).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TextIO

from bson.errors import InvalidDocument
from pymongo.database import Database
from pymongo.errors import PyMongoError

from agent_store.core import utc_now
from agent_store.legacy import LEGACY_TURNS
from agent_store.store import (
    CONVERSATIONS,
    MESSAGES,
    TurnRules,
    create_indexes_sync,
    database_name_refusal,
)
from migrations import (
    abandoned,
    dual_writes,
    explode,
    gate,
    lease,
    order,
    orphan_prompts,
    relocate,
    writes,
)
from migrations import problems as problem_report
from migrations.bounds import MAX_COMMAND_BYTES, MAX_COMMAND_DOCUMENTS
from migrations.connection import URI_VARIABLES, database, read_as_stored
from migrations.errors import MigrationError, Misuse
from migrations.settings import service_environment
from migrations.verify import verify

LEGACY_INDEX = [("conversation_id", 1)]
MAX_LISTED = 100
"""Conversations with work left that `finish` names one by one."""


class Progress:
    """Progress on stderr: a tqdm bar on a terminal, else one line per batch."""

    def __init__(self, total: int, unit: str, mode: str, stream: TextIO = sys.stderr) -> None:
        self.total, self.unit, self.stream = total, unit, stream
        self.mode = ("bar" if stream.isatty() else "lines") if mode == "auto" else mode
        self.done = 0
        self.turns = 0
        self.started = time.monotonic()
        self.bar: Any = None
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=unit, file=stream)

    def advance(self, count: int, turns: int | None = None) -> None:
        self.done += count
        if turns is not None:
            self.turns = turns
        if self.bar is not None:
            self.bar.update(count)
            if turns is not None:
                self.bar.set_postfix(turns=turns, refresh=False)
        elif self.mode == "lines":
            elapsed = max(time.monotonic() - self.started, 1e-9)
            rate = self.done / elapsed
            eta = (self.total - self.done) / rate if rate else 0.0
            turn_rate = f", {self.turns / elapsed:.1f} turns/s" if turns is not None else ""
            print(
                f"progress: {self.done}/{self.total} {self.unit}, {rate:.1f} {self.unit}/s"
                f"{turn_rate}, ETA {eta:.0f}s",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _shown_total(args: argparse.Namespace, count: Callable[[], int]) -> int:
    """The total a progress display shows, counted (one more read of every conversation id)
    only when one is shown: 0 with `--progress none`."""
    return 0 if args.progress == "none" else count()


# -- commands -----------------------------------------------------------------------------


def cmd_status(db: Database[dict[str, Any]], args: argparse.Namespace) -> int:
    source = relocate.turns_at(db)
    in_place = relocate.holds_turns(db, CONVERSATIONS)
    legacy = db[LEGACY_TURNS].estimated_document_count()
    print(f"legacy turns not yet moved aside (in {CONVERSATIONS}): {'yes' if in_place else 'no'}")
    print(f"documents in {LEGACY_TURNS}: {legacy}")
    conversations = (  # turn documents there are no conversations
        db[CONVERSATIONS].count_documents(relocate.CONVERSATION_FILTER)
        if in_place
        else db[CONVERSATIONS].estimated_document_count()
    )
    print(f"conversations in {CONVERSATIONS}: {conversations}")
    print(f"messages in {MESSAGES}: {db[MESSAGES].estimated_document_count()}")
    print(f"lock: {lease.describe(lease.current(db))}")
    moved = relocate.turns_at(db) == LEGACY_TURNS
    in_place_said = _said_of_turns_in_place(db) if in_place and moved else []
    for said in in_place_said:
        print(f"legacy turns in {CONVERSATIONS}: {said}")
    state = db[lease.STATE].find_one({"_id": lease.STATE_ID})
    if state:
        done = state.get("done") or {}
        late = len(state.get(relocate.LATE) or [])
        where = (
            "complete"
            if state.get("complete")
            else f"{len(done)} of {len(state.get('ranges') or [None])} id ranges under way"
            + (f", {late} conversations of turns moved aside since to migrate" if late else "")
        )
        if state.get("complete") and in_place:
            where = (
                f"the last run completed, but legacy turns are back in {CONVERSATIONS} (a "
                "rollback, or the old service logging since)"
                + ("" if in_place_said else ": run again")
            )
        print(f"progress: {where} (run {state.get('run_id')})")
        if state.get("dropped_at") is None and state.get("dropping_at") is not None:
            print(
                f"legacy turns: a drop begun at {state['dropping_at']} was not finished: "
                "`finish --drop-legacy --yes` finishes it"
            )
        if state.get("dropped_at") is not None:
            print(f"legacy turns: {explode.after_the_drop(db)}")
    last = db[lease.STATE].find_one({"kind": "run"}, sort=[("started_at", -1)])
    if last:
        counts = last.get("counts", {})
        print(
            f"last run: {last['_id']} {last.get('status')}, started {last.get('started_at')}, "
            f"{last.get('seconds')}s, {counts.get('conversations')} conversations, "
            f"{counts.get('turns')} turns, {counts.get('messages_written')} messages written"
        )
    _report_left_marked(db)
    _report_unread(db)
    _report_refused_prompts(db, args.rules, source)
    problem_report.print_summary(db, sys.stdout)
    _report_id_clustering(db, source)
    if not in_place and legacy == 0:
        print("no legacy data found")
    return 0


def _report_left_marked(db: Database[dict[str, Any]]) -> None:
    """The conversations whose document is marked as being migrated, when there are any:
    the service answers them from their legacy turns and refuses their writes until a run
    removes the mark (`verify` and `finish` exit 1 meanwhile)."""
    count, ids = writes.left_marked(db, MAX_LISTED)
    if not count:
        return
    shown = ", ".join(ids) + (" …" if count > len(ids) else "")
    print(
        f"conversations left marked as being migrated (`migrating`): {count}: {shown} (a run "
        "is writing them, or was stopped while writing them: the service answers them from "
        "their legacy turns and refuses their writes; `run` again finishes them)"
    )


def _report_unread(db: Database[dict[str, Any]]) -> bool:
    """Name the documents no run converts (`gate.unread_documents`: neither legacy turns nor
    conversation documents), as `finish` does; whether there are any. `run`, `verify` and
    `finish` exit 1 for them, so no step of the runbook passes over content no run reads."""
    unread = gate.unread_documents(db)
    for item in unread:
        print(f"work left in {item.conversation_id}: {'; '.join(item.reasons)}")
    return bool(unread)


def _report_refused_prompts(db: Database[dict[str, Any]], rules: TurnRules, source: str) -> None:
    """Name each conversation a run makes an `invalid_conversation` problem for a
    `session_hitl` prompt holding bytes that are not valid UTF-8 (`explode.refused_for_prompts`),
    before any run records it. `status` reads no turn's text: a turn holding such bytes is
    found by a run, and counted by kind by `run --dry-run`."""
    for problem in explode.refused_for_prompts(db, rules, source=source):
        print(
            f"a run records {problem.kind} for {problem.conversation_id!r} (not migrated until "
            f"corrected): {problem.detail}"
        )


def _report_id_clustering(db: Database[dict[str, Any]], source: str, sample: int = 1000) -> None:
    """Warn when legacy conversation ids are time-ordered: they cluster on a sharded cluster."""
    ids = (doc["_id"] for doc in db[source].aggregate(
        [{"$match": {"$and": [explode.LEGACY_FILTER, order.GROUPED]}},
         {"$group": {"_id": "$conversation_id"}}, {"$limit": sample}]))  # fmt: skip
    seen, kinds = order.id_clustering(ids)
    if seen and sum(kinds.values()) * 2 > seen:
        found = ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())
        print(
            f"conversation ids: {sum(kinds.values())} of {seen} looked at are time-ordered "
            f"({found}): sharded on {{conversation_id: 1, seq: 1}}, new conversations with such "
            "ids all land in the last chunk; see docs/SCALING.md, 'Migrating into a sharded "
            "cluster'"
        )
    elif seen:
        print(f"conversation ids: {seen} looked at, spread evenly (random ids)")


STATE_INDEX = [("kind", 1), ("started_at", 1)]
"""The index of the migration's state by `kind`: its reads of its run and acceptance records
(the latest run by `started_at`) never scan the life record a run keeps per conversation it
wrote (`migrations.lives`)."""


def _source(
    db: Database[dict[str, Any]], args: argparse.Namespace, held: lease.Lease | None
) -> tuple[str, tuple[str, ...]]:
    """Move the legacy turns aside (a dry run only says it would), fenced by the run's lease
    (`explode.prove_lease`); where to read them from then (`relocate.turns_at`), and where
    else the removal of conversations no legacy turn makes reads them (a dry run's:
    `_planned_at`). `args.conversation` becomes the legacy id it names
    (`explode.conversation_named`). A move while an earlier run's ranges stand unfinished
    records the conversations of the turns it moves, for the run resuming them to migrate
    whatever its checkpoints (`relocate.LATE`); a run starting over (`--restart`) records
    only that the ranges are cut again (`relocate.LATE_OVERFLOW`), so its move writes nothing
    the stopped run's ranges would need.
    A legacy collection moved aside and standing empty was emptied by the turns' owners (a
    killed run may have left messages of a conversation deleted meanwhile): the run goes on
    to its last step, which removes them (`abandoned.remove`); with none anywhere there is no
    legacy data."""
    also: tuple[str, ...] = ()
    if args.dry_run:
        source, also = _planned_at(db)
    else:
        state = db[lease.STATE].find_one({"_id": lease.STATE_ID}) or {}
        moved = relocate.relocate(
            db,
            batch_size=max(args.batch_size, 100),
            fence=lambda: explode.prove_lease(db, held),
            write_state=None if held is None else held.write_state,
            late=explode.ranges_unfinished(state),
            start_over=args.restart,
        )
        if moved.how in ("renamed", "copied"):
            dual_writes.record_move(db, held)
            print(f"moved {moved.moved} turn documents to {LEGACY_TURNS} ({moved.how})")
            if moved.detail:
                print(f"  {moved.detail}")
        source = relocate.turns_at(db)
    if source != LEGACY_TURNS and not relocate.holds_turns(db, source):
        raise Misuse(
            f"no legacy data: neither {CONVERSATIONS} nor {LEGACY_TURNS} holds turn documents"
        )
    if args.conversation is not None:
        args.conversation = explode.conversation_named(db, args.conversation, source=source)
    if not args.dry_run:
        # The only change made to the legacy collection: an index to read it by conversation.
        db[LEGACY_TURNS].create_index(LEGACY_INDEX, name="migration_conversation_id")
        db[lease.STATE].create_index(STATE_INDEX, name="migration_state_kind")
        create_indexes_sync(db)
        dual_writes.confirm_copies(db, source=source, copy_again=args.copy_again)
    return source, also


def _planned_at(db: Database[dict[str, Any]]) -> tuple[str, tuple[str, ...]]:
    """Where a dry run reads the legacy turns: where the run reads them once its move is done
    (`relocate.turns_after_the_move`; the move refused, so is the dry run). It plans from the
    collection holding most of them, says how many turns of the other its plan leaves out
    (the run's counts hold them), and its removal of conversations no legacy turn makes reads
    both, as the run reads them merged: a dry run after a rollback, the collection moved
    aside standing again (empty, or holding a turn dual-written since), names none the
    turns put back make."""
    if relocate.holds_turns(db, CONVERSATIONS):
        relocate.refuse_leftover(db)  # as the run would
        print(f"dry run: would move the turns of {CONVERSATIONS} to {LEGACY_TURNS}")
    source, *others = merged = relocate.turns_after_the_move(db)
    for other in others:
        _left_out(other, merged[other], source)
    return source, tuple(others)


def _explode(
    db: Database[dict[str, Any]], args: argparse.Namespace, held: lease.Lease | None
) -> explode.Explosion:
    source, also = _source(db, args, held)
    options = explode.Options(
        dry_run=args.dry_run,
        limit=args.limit,
        conversation=args.conversation,
        batch_size=args.batch_size,
        restart=args.restart,
        max_command_documents=args.max_command_documents,
        max_command_bytes=args.max_command_bytes,
        spread=args.spread,
        rules=args.rules,
    )
    run = explode.Explosion(db, options, lease=held, source=source)
    run.also = also
    after = run.resume_point()
    if after is not None:
        print(
            f"resuming where the last run stopped in each of {len(after.starts)} ranges of ids "
            "(pass --restart to start over)"
        )
    if run.late:
        print(
            f"  first: {len(run.late)} conversations whose turns were moved aside after the "
            "ranges were cut (an old-service writer logging after the move)"
        )
    ranges = run.plan(after)
    progress = Progress(
        _shown_total(args, lambda: run.total(ranges)), "conversations", args.progress
    )
    run.on_batch = progress.advance
    run.after_all = lambda: _last_step(run)
    try:
        run.run(ranges)
    finally:
        progress.close()
    return run


def _last_step(run: explode.Explosion) -> None:
    """Once a run has gone through every conversation: the pending prompts no conversation
    takes, the conversations the migration made that no legacy turn makes now, and the
    problems filed under an id no legacy turn goes by now."""
    orphan_prompts.record(run)
    for item in abandoned.remove(run):
        print(f"  {item.conversation_id}: {item.reason}", file=sys.stderr)
    abandoned.forget_problems_of_ids_gone(run)


def summary_line(label: str, counts: explode.Counts) -> str:
    """What a run wrote, or what a dry run plans to write: the same line, the same counts (a
    run writes nothing for a conversation deleted or written to between its plan and its
    writes, and counts only what it wrote)."""
    return (
        f"{label}: {counts.conversations} conversations, {counts.turns} turns -> "
        f"{counts.messages} messages; {counts.messages_written} messages written, "
        f"{counts.conversations_written} conversation documents written, "
        f"{counts.full_texts_written} full texts written; {counts.live_skipped} already live; "
        f"{counts.problems} problems, {counts.unplaced} not placed"
        + (f" {counts.problems_by_kind}" if counts.problems else "")
        + _abandoned_words(counts)
    )


def _abandoned_words(counts: explode.Counts) -> str:
    """The conversations no legacy turn makes now, when there are any, and those the
    migration's messages of an earlier life were removed from (`abandoned`)."""
    earlier = (
        f"; {counts.earlier_removed} conversations started again under the id cleared of the "
        "migration's messages of the deleted one"
        if counts.earlier_removed
        else ""
    )
    if not counts.abandoned_removed and not counts.abandoned_left:
        return earlier
    return (
        f"; {counts.abandoned_removed} conversations no legacy turn makes now removed, "
        f"{counts.abandoned_left} left (live turns wrote to them)" + earlier
    )


def cmd_run(db: Database[dict[str, Any]], args: argparse.Namespace) -> int:
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise Misuse("--batch-size and --limit must be at least 1")
    if args.max_command_documents < 1 or args.max_command_bytes < 1:
        raise Misuse("--max-command-documents and --max-command-bytes must be at least 1")
    _refuse_bad_seconds("--lease-seconds", args.lease_seconds, zero=False)
    _refuse_bad_seconds("--wait-seconds", args.wait_seconds, zero=True)
    explode.refuse_after_the_drop(db)
    if args.new_rules:
        if not args.dry_run:
            _refuse_new_rules_for_one(args.conversation)
        args.restart = True  # every conversation again, none left by the earlier rules
    else:
        explode.refuse_other_rules(db, args.rules)  # a dry run's check: it takes no lock
    run_id = time.strftime("run-%Y%m%dT%H%M%SZ-", time.gmtime()) + uuid.uuid4().hex[:6]
    held: lease.Lease | None = None
    if not args.dry_run:
        held = lease.Lease(db, run_id, timedelta(seconds=args.lease_seconds))
        held.acquire(
            force=args.force_unlock,
            wait=timedelta(seconds=args.wait_seconds),
            say=lambda text: print(text, file=sys.stderr, flush=True),
        )
    try:
        if held is not None:
            _holding_the_lock(db, args)
        run = _explode(db, args, held)
    finally:
        if held is not None:
            held.release()
    label = (
        "dry run (what a run would write, as planned from what is stored now)"
        if args.dry_run
        else run.run_id
    )
    print(summary_line(label, run.counts))
    if run.counts.problems and not args.dry_run:
        print(f"problems are in {problem_report.PROBLEMS}; `status` summarizes them by kind")
    elapsed = time.monotonic() - run.started
    print(f"took {elapsed:.1f}s, {run.counts.turns / max(elapsed, 1e-9):.1f} turns/s")
    unread = _report_unread(db)
    return max(_left_for_the_next_run(run.counts.reowned), int(unread))


def _refuse_new_rules_for_one(conversation: str | None) -> None:
    """Misuse for `--new-rules` with `--conversation`: the other conversations would stay
    converted by the earlier settings, yet every later run, `verify` and `finish` would
    compare them with the new ones (the service's own settings refused, a shell without
    them let through). A dry run writes and records nothing: it may show one."""
    if conversation is not None:
        raise Misuse(
            "--new-rules converts every conversation again by the turn settings set now, so "
            "it takes no --conversation: the other conversations would stay converted by "
            "the earlier settings while the runs after it compared them with these; pass "
            "--new-rules alone (it starts over, as --restart does), or add --dry-run to see what "
            "it would write to this one"
        )


def _holding_the_lock(db: Database[dict[str, Any]], args: argparse.Namespace) -> None:
    """What a run checks once it holds the lock (after any wait for it), so that no run can
    record other settings between the check and this run's writes: the settings of the
    runs that migrated conversations, checked again (a run that held the lock meanwhile may
    have migrated some); and that no `finish` dropped the legacy turns meanwhile: from here
    on, only one that took the lock over can (`explode.prove_lease`). No other run is
    alive: records still "running" were killed."""
    explode.refuse_after_the_drop(db)
    if not args.new_rules:
        explode.refuse_other_rules(db, args.rules)
    db[lease.STATE].update_many(
        {"kind": "run", "status": "running"}, {"$set": {"status": "interrupted"}}
    )


def _left_for_the_next_run(reowned: list[str]) -> int:
    """1, naming them, when conversations changed owner while the run wrote them (an
    account claim): none of them is left to the old owner, and none is migrated yet."""
    if not reowned:
        return 0
    shown = ", ".join(reowned[:MAX_LISTED]) + (" …" if len(reowned) > MAX_LISTED else "")
    print(
        f"{len(reowned)} conversations changed owner (an account claim) while the run wrote "
        f"them, so nothing more of theirs was written: run the migration again to migrate "
        f"them under their new owner: {shown}"
    )
    return 1


def _left_out(other: str, count: int, source: str) -> None:
    """A dry run while both collections hold turns the run's move merges: it plans from the
    one holding most (`source`), as a dry run plans from one collection, and says how many
    turns of the `other` its summary leaves out, which a run moves and counts. After the
    move, those are turns the old service logged in `agent_conversations` since."""
    if other == CONVERSATIONS:
        print(
            f"dry run: {count} turn documents logged in {CONVERSATIONS} since the move are left "
            f"out of this plan, which reads {LEGACY_TURNS}: a run moves them first and its "
            "counts hold them"
        )
        return
    print(
        f"dry run: {count} turn documents in {other} are left out of this plan, which reads "
        f"{source}: a run moves the turns of {source} in with them and its counts hold them "
        "(the removal of conversations no legacy turn makes reads both)"
    )


def _require_legacy_data(db: Database[dict[str, Any]]) -> None:
    """Misuse unless the legacy turns were moved aside (`relocate.turns_at`): `verify` and
    `finish` compare what a run migrated from them there. Before the move, and after a
    rollback put them back in `agent_conversations`, a run moves them first."""
    explode.refuse_after_the_drop(db)
    if relocate.turns_at(db) == LEGACY_TURNS:
        return
    if relocate.holds_turns(db, CONVERSATIONS):
        raise Misuse(
            f"the legacy turns are in {CONVERSATIONS}, not moved aside to {LEGACY_TURNS} (no "
            "run moved them yet, or a rollback put them back): run `python -m migrations run` "
            "first, which moves them aside and migrates them"
        )
    raise Misuse(f"no legacy data in {LEGACY_TURNS}: run `python -m migrations run` first")


NOT_MOVED = (
    f"{CONVERSATIONS} still holds legacy turns (a run stopped before it moved them all, a "
    "rollback put them back, or turns an old-service writer still running logged after the "
    "move): no run has read them all; run the migration again"
)
"""What `verify` and `finish` say of legacy turns not moved aside: content neither compares."""


def _said_of_turns_in_place(db: Database[dict[str, Any]]) -> list[str]:
    """What `verify`, `finish` and `status` say of the legacy turns in `agent_conversations`:
    of those a copy left there for text that is not valid UTF-8, what the copy said
    (`relocate.left_named`: each turn, the conversations it holds back, and to correct its
    text there, as running again moves none of them); `NOT_MOVED` for any other turn there,
    which the next run moves. So the advice followed converges."""
    left, said = relocate.left_named(db)
    others = db[CONVERSATIONS].count_documents(relocate.TURN_FILTER, limit=left + 1) > left
    return ([NOT_MOVED] if others else []) + ([said] if said else [])


WHILE_A_RUN = "{command} reads nothing while a run goes on: run it again once that run ends"
"""What `verify` and `finish` say, exit 3, when a run holds the lock: part of the legacy turns
may be moved aside, part of a conversation migrated, and neither is work left."""


def _not_moved(db: Database[dict[str, Any]], command: str) -> bool:
    """Whether `agent_conversations` holds legacy turns no run is moving aside. A run moves
    them in batches, holding the lock: the lock is looked at again after the turns are read
    (LockHeld), so a run begun since the command's first look is not taken for an
    old-service writer."""
    if not relocate.holds_turns(db, CONVERSATIONS):
        return False
    lease.refuse_while_held(db, WHILE_A_RUN.format(command=command))
    return True


MAX_SECONDS = 10**9
"""The longest lease or wait `run` takes, in seconds (about 31 years)."""


def _refuse_bad_seconds(option: str, value: float, *, zero: bool) -> None:
    """Misuse for a lease or a wait that is no duration (`zero`: whether 0 is one): a lease
    of 0 or below would end at once, and any `verify` or `finish` then takes the lock of the
    run holding it."""
    if math.isfinite(value) and (value >= 0 if zero else value > 0) and value < MAX_SECONDS:
        return
    lowest = "0 or more" if zero else "more than 0"
    raise Misuse(f"{option} {value:g}: a number of seconds, {lowest} and less than {MAX_SECONDS}")


def cmd_verify(db: Database[dict[str, Any]], args: argparse.Namespace) -> int:
    lease.refuse_while_held(db, WHILE_A_RUN.format(command="`verify`"))
    _require_legacy_data(db)
    if args.sample is not None and args.sample < 1:
        raise Misuse(f"--sample {args.sample}: a sample holds at least one conversation")
    if args.batch_size < 1:
        raise Misuse("--batch-size must be at least 1")
    source = relocate.turns_at(db)
    total = (
        1
        if args.conversation
        else _shown_total(args, lambda: explode.count_conversations(db, source=source))
    )
    total = min(args.sample, total) if args.sample and total else total
    conversation = (
        None
        if args.conversation is None
        else explode.conversation_named(db, args.conversation, source=source)
    )
    progress = Progress(total, "conversations", args.progress)
    try:
        result = verify(
            db,
            conversation=conversation,
            sample_size=args.sample,
            seed=args.seed,
            batch_size=args.batch_size,
            undated_at=explode.undated_time(db, record=False),
            on_batch=progress.advance,
            rules=args.rules,
        )
    finally:
        progress.close()
    for conversation_id, found in result.differences.items():
        for difference in found:
            print(f"{conversation_id}: {difference}")
    print(
        f"verified {result.conversations} conversations: {result.matched} match, "
        f"{len(result.differences)} differ; {result.unplaced} legacy parts were recorded as "
        f"problems and left out (see {problem_report.PROBLEMS})"
    )
    _report_unrecorded(db)
    unread = _report_unread(db)
    if _not_moved(db, "`verify`"):
        print("\n".join(_said_of_turns_in_place(db)))
        return 1
    other_rules = _other_rules(db, args.rules)
    return 0 if result.ok and not unread and not other_rules else 1


def _report_unrecorded(db: Database[dict[str, Any]]) -> None:
    """Name the conversations whose dual-written copies recorded nothing
    (`dual_writes.unrecorded`: an earlier release's), whose deletion by the old service the
    gate cannot check; said only, the exit code unchanged."""
    found = dual_writes.unrecorded(db, source=relocate.turns_at(db))
    for conversation_id, count in list(found.items())[:MAX_LISTED]:
        print(f"{conversation_id}: {dual_writes.UNRECORDED.format(count=count)}")
    if len(found) > MAX_LISTED:
        print(f"  … and {len(found) - MAX_LISTED} more conversations so")


def _other_rules(db: Database[dict[str, Any]], rules: TurnRules) -> bool:
    """Whether conversations may be stored as converted by other turn settings than `rules`
    (`explode.rules_stored_by`), said naming the settings and the runs: `verify` and `finish`
    then fail, whatever they compared (a conversation's name is not compared: a person may
    have renamed it; a differing setting may change nothing of what was compared)."""
    runs, differing = explode.rules_stored_by(db, rules)
    if not differing:
        return False
    named = ", ".join(runs[:MAX_LISTED]) + (" …" if len(runs) > MAX_LISTED else "")
    print(
        f"the turn settings differ from those conversations were converted by (run {named}): "
        f"{', '.join(differing)}; what is stored is not what the service serves by these "
        "settings, whatever differs above: set them as those runs had them (the service's "
        "environment), or `run --new-rules` to convert every conversation again by these"
    )
    return True


def _report(found: gate.Gate) -> None:
    print(
        f"checked {found.conversations} legacy conversations: {found.migrated} migrated"
        + (f" ({found.empty} hold nothing to migrate)" if found.empty else "")
        + (f", {len(found.accepted)} with unplaced content accepted" if found.accepted else "")
    )
    if found.left:
        print(f"work left in {len(found.left)} conversations:")
        for item in found.left[:MAX_LISTED]:
            print(f"  {item.conversation_id}: {'; '.join(item.reasons)}")
        if len(found.left) > MAX_LISTED:
            print(f"  … and {len(found.left) - MAX_LISTED} more")
    for item in found.unread:
        print(f"work left in {item.conversation_id}: {'; '.join(item.reasons)}")


def cmd_finish(db: Database[dict[str, Any]], args: argparse.Namespace) -> int:
    """The gate, holding the migration lock, and nothing read before while a run holds it
    (exit 3: a run's half-moved turns are no work left): a run going on meanwhile (a rerun
    in another terminal) could change what the gate read, and, the legacy turns dropped
    under it, would take every conversation it migrated for one no legacy turn makes any
    more."""
    if args.drop_legacy and not args.yes:
        raise Misuse("--drop-legacy deletes the rollback copy: add --yes to confirm")
    lease.refuse_while_held(db, WHILE_A_RUN.format(command="`finish`"))
    # A drop begun is finished whatever was logged since: it drops the legacy collection only.
    unfinished = args.drop_legacy and explode.drop_unfinished(db) is not None
    accepting: list[tuple[str, str]] = []
    if not unfinished:
        explode.refuse_after_the_drop(db)  # before the turns not moved: no run can move them
        if _not_moved(db, "`finish`"):
            print("\n".join(_said_of_turns_in_place(db)))
            return 1
        _require_legacy_data(db)
        accepting = [_acceptable(db, conversation_id) for conversation_id in args.accept or ()]
    run_id = time.strftime("finish-%Y%m%dT%H%M%SZ-", time.gmtime()) + uuid.uuid4().hex[:6]
    held = lease.Lease(db, run_id)
    held.acquire()
    try:
        if unfinished:  # its gate passed when the drop began: the drop only is left
            _drop(db, held)
            return 0
        return _finish(db, args, held, accepting)
    finally:
        held.release()


def _acceptable(db: Database[dict[str, Any]], given: str) -> tuple[str, str]:
    """The id `--accept` names, and the id its acceptance is recorded under, the one the gate
    names: `given` when problems are recorded under it, else the id the conversation it names
    is stored under (a legacy id that is no identifier, `conv 42/x`, names the conversation
    migrated under the id derived from it, as `verify --conversation` takes it). Misuse,
    before anything is accepted, when it names no conversation: none whose legacy turns,
    conversation document or problems are there (a mistyped id, which an acceptance would
    cover nothing of), as `verify --conversation` refuses it."""
    if problem_report.recorded_for(db, given):
        return given, given
    source = relocate.turns_at(db)
    stored = explode.stored_id_named(db, given, source=source)
    if stored is None:
        raise Misuse(
            f"{explode.no_legacy_turns(given, source)}, nor a problem recorded "
            "for it: nothing is accepted"
        )
    return given, stored


def _accepted(conversation_id: str, given: str, kinds: Sequence[str], note: str | None) -> str:
    """What `finish --accept` recorded, for a person: the unplaced content it accepts, and
    never more. A difference `verify` names (a dual-written turn the legacy service edited,
    stored messages edited by hand) is no recorded problem: it accepts none of those."""
    named = "" if given == conversation_id else f" (legacy id {given!r})"
    if kinds:
        return (
            f"recorded: the unplaced content of {conversation_id!r}{named} is accepted "
            f"({note}): {', '.join(sorted(set(kinds)))}"
        )
    return (
        f"recorded: {conversation_id!r}{named} records no unplaced content, so nothing of it "
        "is covered; `finish --accept` accepts no difference of a dual-written turn (restore "
        "its messages, or remove its `dual_write` mark so `run` migrates it) nor of a stored "
        "message"
    )


def _finish(
    db: Database[dict[str, Any]],
    args: argparse.Namespace,
    held: lease.Lease,
    accepting: list[tuple[str, str]],
) -> int:
    for given, conversation_id in accepting:
        kinds = problem_report.accept(db, conversation_id, args.note)
        print(_accepted(conversation_id, given, kinds, args.note))
    found = gate.check(
        db,
        undated_at=explode.undated_time(db, record=False),
        renew=held.renew,
        rules=args.rules,
    )
    _report(found)
    _report_unrecorded(db)
    problem_report.print_summary(db, sys.stdout)
    if _other_rules(db, args.rules) or not found.open:
        if args.drop_legacy:
            print(
                f"refusing to drop {LEGACY_TURNS}: what is stored above is not what the "
                "legacy turns migrate to (content not in the new collections, or other turn "
                "settings)"
            )
        return 1
    held.write_state({"$set": {"finished_at": utc_now()}})
    if args.drop_legacy:
        held.renew()  # still this command's: no run started while the gate read
        held.write_state({"$set": {"dropping_at": utc_now()}})
        _drop(db, held)
    else:
        print(
            f"every legacy conversation is migrated; keep {LEGACY_TURNS} for the rollback "
            "window, then `finish --drop-legacy --yes` and unset AGENT_STORE_LEGACY_DUAL_WRITE"
        )
    return 0


def _drop(db: Database[dict[str, Any]], held: lease.Lease) -> None:
    """Drop the legacy turns, then record it (`dropped_at`). The drop was recorded as begun
    (`dropping_at`) first: stopped in between, no run goes on, and `finish --drop-legacy
    --yes` again finishes it."""
    db[LEGACY_TURNS].drop()
    held.write_state({"$set": {"dropped_at": utc_now()}})
    print(f"dropped {LEGACY_TURNS}; rollback to the legacy service is no longer possible")


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--uri",
        help="MongoDB connection string (default: $MONGODB_URI or $AGENT_STORE_MONGODB_URI, "
        "else the embedded database of --data-dir)",
    )
    common.add_argument(
        "--database",
        help="database name (default: $AGENT_STORE_DATABASE or agent_store, as the service "
        "reads it)",
    )
    common.add_argument(
        "--data-dir",
        help="the embedded database's directory, used without a URI (default: "
        "$AGENT_STORE_DATA_DIR or data, as the service reads it)",
    )
    common.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the server (default 5)"
    )
    common.add_argument(
        "--progress",
        choices=["auto", "bar", "lines", "none"],
        default="auto",
        help="progress on stderr: a bar on a terminal, else lines (default auto)",
    )
    top = argparse.ArgumentParser(
        prog="python -m migrations",
        description="Migrate legacy turn documents into agent_messages and agent_conversations.",
    )
    commands = top.add_subparsers(dest="command", required=True)
    commands.add_parser("status", parents=[common], help="what is migrated, the lock, problems")
    _run_parser(commands.add_parser("run", parents=[common], help="move aside, then migrate"))
    check = commands.add_parser("verify", parents=[common], help="compare legacy and new")
    check.add_argument("--sample", type=int, help="verify a random sample of N conversations")
    check.add_argument("--seed", type=int, default=0, help="seed of the sample")
    check.add_argument("--conversation", metavar="ID", help="verify only this conversation")
    check.add_argument("--batch-size", type=int, default=100)
    finish = commands.add_parser("finish", parents=[common], help="the exit gate, then the drop")
    finish.add_argument("--drop-legacy", action="store_true", help="drop the legacy collection")
    finish.add_argument("--yes", action="store_true", help="confirm --drop-legacy")
    finish.add_argument(
        "--accept",
        action="append",
        metavar="ID",
        help="record that this conversation's unplaced content is kept elsewhere (repeatable)",
    )
    finish.add_argument("--note", help="where the accepted content is kept (recorded)")
    return top


def _run_parser(run: argparse.ArgumentParser) -> None:
    run.add_argument("--dry-run", action="store_true", help="plan every write; write nothing")
    run.add_argument("--limit", type=int, help="migrate at most N conversations")
    run.add_argument("--conversation", metavar="ID", help="migrate only this conversation")
    run.add_argument("--batch-size", type=int, default=100, help="conversations per batch")
    run.add_argument("--restart", action="store_true", help="ignore the saved checkpoint")
    run.add_argument(
        "--new-rules",
        action="store_true",
        help="convert every conversation again by the turn settings set now, though they "
        "differ from those of the run that migrated them (starts over, as --restart)",
    )
    run.add_argument(
        "--spread",
        type=int,
        default=16,
        help="ranges of the id space each batch draws from in turn, so the writes of a batch "
        "spread over a sharded cluster's chunks (default 16; 1: sorted order)",
    )
    run.add_argument(
        "--copy-again",
        action="append",
        default=[],
        metavar="RECORD",
        help="write the legacy turns missing of the copy this record names, from its turn's "
        "stored messages, and confirm it; a record missing of a turn owed a copy is written "
        "first (the gate's advice when the person deleted nothing)",
    )
    run.add_argument(
        "--force-unlock", action="store_true", help="take the lock from a run known to be dead"
    )
    run.add_argument(
        "--lease-seconds", type=float, default=120.0, help="lock lease, renewed every batch"
    )
    run.add_argument(
        "--wait-seconds",
        type=float,
        default=lease.DEFAULT_WAIT.total_seconds(),
        help="wait for a held lock whose lease ends within this (default 150)",
    )
    run.add_argument(
        "--max-command-documents",
        type=int,
        default=MAX_COMMAND_DOCUMENTS,
        help=f"documents per write command (default {MAX_COMMAND_DOCUMENTS})",
    )
    run.add_argument(
        "--max-command-bytes",
        type=int,
        default=MAX_COMMAND_BYTES,
        help=f"bytes per write command (default {MAX_COMMAND_BYTES})",
    )


COMMANDS = {"status": cmd_status, "run": cmd_run, "verify": cmd_verify, "finish": cmd_finish}


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised where the process is so the lock is released on the way out."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        # Read before any database is looked for: a setting the service refuses is misuse.
        service = service_environment()
        args.rules = service.turn_rules()
        if args.database is None:
            args.database = service.database
        elif (why := database_name_refusal(args.database)) is not None:
            raise Misuse(f"invalid configuration: database: {why}")
        with database(args) as (client, where):
            if where != "--uri" and where not in URI_VARIABLES:
                print(f"database {args.database!r} on {where}")
            return COMMANDS[args.command](read_as_stored(client[args.database]), args)
    except KeyboardInterrupt as exc:
        stopped_by = signal.SIGTERM if isinstance(exc, Stopped) else signal.SIGINT
        print(
            f"stopped by {stopped_by.name}: the lock is released and what was written stays; "
            "`run` again resumes where this one stopped",
            file=sys.stderr,
        )
        return 128 + stopped_by
    except MigrationError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except PyMongoError as exc:
        print(f"error: the database failed: {exc}", file=sys.stderr)
        return 4
    except InvalidDocument as exc:  # the driver's refusal, `DocumentTooLarge` among them
        print(f"error: the database refused a document: {exc}", file=sys.stderr)
        return 4
    finally:
        signal.signal(signal.SIGTERM, previous)
