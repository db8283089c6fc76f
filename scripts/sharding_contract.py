"""The sharding contract: every command the store sends, recorded and held to MongoDB's rules.

`exercise()` runs every public operation of the store (and the migration
tool) against a wire server with a command listener, each under a label;
`violations()` checks the recorded commands against the shard keys in
`agent_store.store.SHARD_KEYS`:
1. a command on `agent_messages` names `conversation_id` (equality or `$in`),
   so mongos sends it to the shards owning those conversations only — unless
   the operation is allow-listed below, with the reason;
2. a single-document write on `agent_conversations` names `_id`;
3. no multi-document update sets a shard-key field;
4. every unique index starts with its collection's shard key.
`python -m scripts.sharding_contract` prints the table docs/SCALING.md holds
(a test fails when the two differ).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pymongo import monitoring

from agent_store.store import CONVERSATIONS, INDEXES, MESSAGES, SHARD_KEYS

SHARDED = (MESSAGES, CONVERSATIONS)
ALLOWED_BROADCASTS: dict[tuple[str, str], str] = {
    ("erase a user", MESSAGES): "erasure deletes every message of one user: rare, administrative",
    ("claim an account", MESSAGES): (
        "a claim asks which conversations hold one user id's messages (then moves those)"
    ),
    ("search a user's messages", MESSAGES): (
        "`user_id` equality on the compound text index: each shard reads one user's postings"
    ),
    ("migration status", MESSAGES): "an estimated count from collection metadata",
    ("migration run", MESSAGES): (
        "its last step looks once for migrated messages left without their conversation "
        "document (the `seq` 0 ones): the operator's one-shot tool"
    ),
    ("migration verify", MESSAGES): (
        "it reads every conversation's live turns once (grouped by the server) for the dual "
        "write's records of their copies, wherever their conversation stands: the operator's "
        "one-shot tool"
    ),
    ("migration finish", MESSAGES): (
        "its gate looks for migrated messages left without their conversation document, and "
        "for live ones (the `seq` 0 ones), and reads every conversation's live turns once for "
        "the dual write's records of their copies: the operator's one-shot tool"
    ),
}
"""Operations that may reach every shard of `agent_messages`, with the reason."""
_INBOX = re.compile(r"^inbox\.t[0-9a-f]+")
_ADMIN = {"createIndexes", "listIndexes", "dropIndexes", "drop", "listCollections", "create"}
_FOLLOW_UPS = {"getMore", "killCursors", "endSessions", "hello", "isMaster", "ismaster", "ping"}


@dataclass(frozen=True)
class Command:
    """One command the store sent, under the operation that sent it."""

    operation: str
    name: str
    collection: str
    filters: tuple[dict[str, Any], ...]
    """What selects documents: a find's filter, each update's or delete's `q`, an insert's
    documents, an aggregation's first `$match`."""
    multi: bool = False
    """A write that may touch more than one document."""
    sets: tuple[str, ...] = ()
    """Fields an update sets."""


def _updated_fields(update: Any) -> tuple[str, ...]:
    if isinstance(update, list):  # a pipeline: each stage's $set keys
        return tuple(k for stage in update for k in stage.get("$set", {}))
    if isinstance(update, dict):
        if not any(k.startswith("$") for k in update):
            return tuple(update)  # a replacement
        return tuple(k for op, fields in update.items() if op != "$setOnInsert" for k in fields)
    return ()


def parse(operation: str, command: dict[str, Any]) -> Command | None:
    """The command as the contract sees it; None for administrative and follow-up commands."""
    name = next(iter(command))
    if name in _FOLLOW_UPS or name in _ADMIN:
        return None
    collection = str(command[name])
    if name == "find" or name in ("count", "distinct"):
        return Command(
            operation, name, collection, (command.get("filter", command.get("query")) or {},)
        )
    if name == "findAndModify":
        update = command.get("update")
        return Command(operation, name, collection, (command.get("query") or {},),
                       sets=_updated_fields(update))  # fmt: skip
    if name == "insert":
        return Command(operation, name, collection, tuple(command.get("documents", ())))
    if name == "update":
        updates = command.get("updates", ())
        return Command(operation, name, collection, tuple(u["q"] for u in updates),
                       multi=any(u.get("multi") for u in updates),
                       sets=tuple(f for u in updates for f in _updated_fields(u["u"])))  # fmt: skip
    if name == "delete":
        deletes = command.get("deletes", ())
        return Command(operation, name, collection, tuple(d["q"] for d in deletes),
                       multi=any(d.get("limit", 0) == 0 for d in deletes))  # fmt: skip
    if name == "aggregate":
        first = (command.get("pipeline") or [{}])[0]
        return Command(operation, name, collection, (first.get("$match", {}),))
    return Command(operation, name, collection, ({},))


def _names(selector: dict[str, Any], key: str) -> bool:
    """Whether a filter (or document) pins `key` to values: equality or `$in`, directly, in any
    part of an `$and`, or in every branch of an `$or`."""
    if key in selector:
        value = selector[key]
        return not isinstance(value, dict) or set(value) <= {"$eq", "$in"}
    branches = selector.get("$or")
    if branches and all(_names(branch, key) for branch in branches):
        return True
    return any(_names(part, key) for part in selector.get("$and", ()))


def _single_write(command: Command) -> bool:
    if command.name in ("findAndModify", "insert"):
        return True
    return command.name in ("update", "delete") and not command.multi


def violations(commands: list[Command]) -> list[str]:
    """Every broken rule, one line each; empty when the contract holds."""
    found = []
    for command in commands:
        if command.collection not in SHARDED:
            continue
        key = next(iter(SHARD_KEYS[command.collection]))
        where = f"{command.operation}: {command.name} on {command.collection}"
        if command.collection == MESSAGES:
            allowed = (command.operation, MESSAGES) in ALLOWED_BROADCASTS
            if not allowed and not all(_names(f, key) for f in command.filters):
                found.append(f"{where} does not name `{key}`: it would reach every shard")
        elif _single_write(command) and not all(_names(f, "_id") for f in command.filters):
            found.append(f"{where} writes one document without naming `_id`")
        shard_fields = set(SHARD_KEYS[command.collection])
        if command.multi and shard_fields & set(command.sets):
            found.append(f"{where} updates many documents and sets a shard-key field")
    for collection, models in INDEXES.items():
        if collection not in SHARD_KEYS:
            continue  # not sharded: GridFS buckets stay on the primary shard
        prefix = list(SHARD_KEYS[collection])
        for model in models:
            document = model.document
            keys = list(document["key"])
            if document.get("unique") and keys[: len(prefix)] != prefix:
                found.append(f"unique index {keys} on {collection} does not start with {prefix}")
    return found


@dataclass
class CommandLog(monitoring.CommandListener):
    """Records every command sent while an operation label is set."""

    commands: list[Command] = field(default_factory=list)
    label: str | None = None

    @contextlib.contextmanager
    def operation(self, label: str) -> Iterator[None]:
        """Attribute the commands sent inside the block to `label`."""
        self.label = label
        try:
            yield
        finally:
            self.label = None

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        """Keep the command, if an operation is running and it is not administrative."""
        if self.label is not None:
            parsed = parse(self.label, dict(event.command))
            if parsed is not None:
                self.commands.append(parsed)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        """Nothing to record."""

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        """Nothing to record."""


def render_table(commands: list[Command]) -> str:
    """Each distinct (operation, command, collection, filter keys) once, as a markdown table."""
    rows = ["| operation | command | collection | selects by | shards |", "|---|---|---|---|---|"]
    seen = set()
    for command in commands:
        if command.collection not in SHARDED:
            continue
        keys = sorted({_INBOX.sub("inbox.<turn>", k) for f in command.filters for k in f})
        if command.name == "insert":
            keys = [k for k in keys if k in SHARD_KEYS[command.collection] or k == "_id"]
        keys = [k for k in keys if k != "$text"] or ["(nothing)"]
        if any("$text" in f for f in command.filters):
            keys.append("$text")
        key = next(iter(SHARD_KEYS[command.collection]))
        targeted = all(_names(f, key) for f in command.filters)
        shards = "one" if targeted else "all"
        if command.collection == CONVERSATIONS and not targeted and command.name == "find":
            shards = "all (a read of many)"
        row = (command.operation, command.name, command.collection, ", ".join(keys), shards)
        if row not in seen:
            seen.add(row)
            rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows) + "\n"


async def main() -> None:
    from scripts.sharding_exercise import exercise
    from scripts.wire_server import start_wire_server

    server, uri = start_wire_server()
    try:
        log = await exercise(uri)
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)
    sys.stdout.write(render_table(log.commands))
    problems = violations(log.commands)
    for problem in problems:
        print(f"VIOLATION: {problem}", file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main())
