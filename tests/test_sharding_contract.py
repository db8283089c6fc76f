"""The sharding contract, enforced: every command every public operation sends is one a sharded
cluster with the recommended keys targets (or an allow-listed broadcast, with its reason)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from pymongo import AsyncMongoClient

from scripts.sharding_contract import CommandLog, render_table, violations
from scripts.sharding_exercise import exercise

pytestmark = pytest.mark.wire
SCALING = Path(__file__).resolve().parents[1] / "docs" / "SCALING.md"
_TABLE = re.compile(r"<!-- shapes:start -->\n(.*?)<!-- shapes:end -->", re.DOTALL)


@pytest.fixture(scope="module")
def recorded(wire_uri: str) -> CommandLog:
    """One recording for the module: the server runs in a thread of its own, so a loop of its
    own serves the exercise."""
    return asyncio.run(exercise(wire_uri))


def test_every_command_of_every_operation_keeps_the_sharding_contract(
    recorded: CommandLog,
) -> None:
    operations = {c.operation for c in recorded.commands}
    assert {
        "log a turn", "replay a logged turn", "read a transcript", "page through messages",
        "search one conversation", "steer a running turn", "fork a conversation",
        "claim an account", "erase a user", "migration run", "migration verify",
    } <= operations  # fmt: skip
    assert violations(recorded.commands) == []


async def test_a_scatter_gather_query_breaks_the_contract(wire_uri: str) -> None:
    log = CommandLog()
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(wire_uri, event_listeners=[log])
    try:
        with log.operation("look up a message by id alone"):
            await client["contract"]["agent_messages"].find_one({"_id": "msg-1"})
        with log.operation("rename by owner"):
            await client["contract"]["agent_conversations"].update_one(
                {"user_id": "u"}, {"$set": {"name": "x"}}
            )
    finally:
        await client.drop_database("contract")
        await client.close()

    assert violations(log.commands) == [
        "look up a message by id alone: find on agent_messages does not name "
        "`conversation_id`: it would reach every shard",
        "rename by owner: update on agent_conversations writes one document without naming `_id`",
    ]


def test_the_scaling_page_shows_the_commands_as_recorded(recorded: CommandLog) -> None:
    found = _TABLE.search(SCALING.read_text())
    assert found is not None, "docs/SCALING.md has no shapes table"
    assert found.group(1) == render_table(recorded.commands), (
        "docs/SCALING.md's command table is stale: run `python -m scripts.sharding_contract`"
    )
