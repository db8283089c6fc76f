"""Estimate index and data sizes per million messages from documents the logger really writes.

Method: a deterministic synthetic corpus (scripts/corpus.py) is logged with
AgentMessageLogger on an in-process database (one per conversation, to stay
fast), and the stored documents are read back. For every index of
`app.collections.INDEXES` — plus the extra indexes a sharded cluster needs —
each document's index entries are sized as MongoDB's KeyString format lays
them out (a type byte per value, strings with a terminator, numbers and dates
in up to 8 bytes, an end byte) plus the RecordId (about 4 bytes below 16 million
records). The text index has one entry per distinct term of `search_text`
(lower-cased, split on non-word characters, no stemming and no stop words:
`default_language: "none"`), each a term and an 8-byte score.

This is an estimate of the key payload before WiredTiger's prefix compression
(which shrinks repeated leading bytes such as a conversation id shared by
every message of a conversation) and without page overhead. Real sizes come
from `db.agent_messages.stats().indexSizes` on a loaded server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import bson

from agent_store import AgentMessageLogger
from scripts.corpus import Corpus

RECORD_ID_BYTES = 4
_TERM = re.compile(r"\w+", re.UNICODE)


def key_bytes(value: Any) -> int:
    """Approximate KeyString size of one indexed value."""
    if value is None:
        return 1
    if isinstance(value, bool):
        return 1
    if isinstance(value, str):
        return 2 + len(value.encode())
    if isinstance(value, int):
        return 1 + max(1, (abs(value).bit_length() + 7) // 8)
    if isinstance(value, float | datetime):
        return 9
    raise TypeError(type(value))


def entry(*values: Any) -> int:
    return sum(key_bytes(v) for v in values) + 1 + RECORD_ID_BYTES


def text_terms(text: str | None) -> set[str]:
    return {t.lower() for t in _TERM.findall(text or "")}


IndexEstimate = Callable[[dict[str, Any]], tuple[int, int]]
"""A document → (entries, bytes) in one index."""

MESSAGE_INDEXES: dict[str, IndexEstimate] = {
    "_id_": lambda d: (1, entry(d["_id"])),
    "conversation_id_1_seq_1 (unique; the shard key)": lambda d: (
        1,
        entry(d["conversation_id"], d["seq"]),
    ),
    "user_id_1": lambda d: (1, entry(d["user_id"])),
    "user_id_1_search_text_text (user first)": lambda d: (
        len(terms := text_terms(d["search_text"])),
        sum(entry(d["user_id"], term, 1.0) for term in terms),
    ),
}
CONVERSATION_INDEXES: dict[str, IndexEstimate] = {
    "_id_": lambda d: (1, entry(d["_id"])),
    "user_id_1_updated_at_-1__id_-1": lambda d: (
        1,
        entry(d["user_id"], d["updated_at"], d["_id"]),
    ),
    "sharded on {_id: hashed}: its index": lambda d: (1, entry(0x7FFF_FFFF_FFFF_FFFF)),
}


async def logged_corpus(conversations: int, turns: int) -> tuple[list[dict[str, Any]], ...]:
    from mongomock_motor import AsyncMongoMockClient

    corpus = Corpus(seed=3)
    messages: list[dict[str, Any]] = []
    conversation_docs: list[dict[str, Any]] = []
    for number in range(conversations):
        db = AsyncMongoMockClient(tz_aware=True)["sizes"]
        logger = AgentMessageLogger(db)
        # A few conversations per user, as people come back.
        conversation = corpus.conversation(turns, user_id=f"user-{number // 3:08d}")
        for turn_id, turn in conversation.turns:
            await logger.log_messages(
                conversation.conversation_id, turn, user_id=conversation.user_id, turn_id=turn_id
            )
        messages += await db.agent_messages.find().to_list(None)
        conversation_docs += await db.agent_conversations.find().to_list(None)
    return messages, conversation_docs


async def conversation_sizes(counts: tuple[int, ...]) -> dict[int, int]:
    """The BSON size of one conversation document after that many short turns."""
    from mongomock_motor import AsyncMongoMockClient

    db = AsyncMongoMockClient(tz_aware=True)["sizes"]
    logger = AgentMessageLogger(db)
    sizes: dict[int, int] = {}
    for turn in range(max(counts)):
        message = {"role": "user", "content": f"question {turn}"}
        await logger.log_messages("conv-long", [message], turn_id=f"t{turn}")
        if turn + 1 in counts:
            document = await db.agent_conversations.find_one({"_id": "conv-long"})
            sizes[turn + 1] = len(bson.encode(document))
    return sizes


def measure(docs: list[dict[str, Any]], indexes: dict[str, IndexEstimate]) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "documents": len(docs),
        "bson_bytes_mean": statistics.mean(len(bson.encode(d)) for d in docs),
        "indexes": {},
    }
    for name, estimate in indexes.items():
        sized = [estimate(d) for d in docs]
        figures["indexes"][name] = {
            "entries_per_document": sum(e for e, _ in sized) / len(docs),
            "bytes_per_document": sum(b for _, b in sized) / len(docs),
        }
    return figures


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f} MiB"


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=150)
    parser.add_argument("--turns", type=int, default=10, help="turns per conversation")
    parser.add_argument("--out", type=Path, default=Path("bench-results/index_sizes.json"))
    args = parser.parse_args(argv)

    messages, conversations = await logged_corpus(args.conversations, args.turns)
    per_conversation = len(messages) / len(conversations)
    result = {
        "corpus": {
            "conversations": len(conversations),
            "messages": len(messages),
            "messages_per_conversation": per_conversation,
            "conversations_per_million_messages": 1e6 / per_conversation,
        },
        "agent_messages": measure(messages, MESSAGE_INDEXES),
        "agent_conversations": measure(conversations, CONVERSATION_INDEXES),
        "method": __doc__,
    }
    print(__doc__.split("\n\n", 1)[1])
    print(
        f"corpus: {len(messages):,} messages in {len(conversations):,} conversations "
        f"({per_conversation:.1f} messages each) logged by AgentMessageLogger\n"
    )
    scale = {"agent_messages": 1e6, "agent_conversations": 1e6 / per_conversation}
    print(f"{'per million messages':<58}{'entries/doc':>12}{'bytes/doc':>11}{'total':>12}")
    for collection, count in scale.items():
        figures = result[collection]
        print(
            f"{collection} ({count:,.0f} documents): data "
            f"{figures['bson_bytes_mean']:,.0f} B/doc = {mib(figures['bson_bytes_mean'] * count)}"
            " of BSON before compression"
        )
        for name, index in figures["indexes"].items():
            print(
                f"  {name:<56}{index['entries_per_document']:>12.1f}"
                f"{index['bytes_per_document']:>11.0f}"
                f"{mib(index['bytes_per_document'] * count):>12}"
            )
    result["conversation_document_by_turns"] = await conversation_sizes((10, 100, 1_000, 1_500))
    print("\nagent_conversations document size by turns logged (turn records kept: 1,000):")
    for turns, size in result["conversation_document_by_turns"].items():
        print(f"  {turns:>6,} turns: {size:>8,} B of BSON")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
