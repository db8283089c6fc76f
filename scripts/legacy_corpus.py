"""A synthetic corpus of legacy turn documents, with the mess real data has, for tests and
benchmarks. Deterministic for a given seed."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from bson import ObjectId

START = datetime(2025, 1, 1, tzinfo=UTC)


def legacy_corpus(
    conversations: int, *, turns: int = 4, seed: int = 7, text_chars: int = 200
) -> Iterator[dict[str, Any]]:
    """`conversations` conversations of about `turns` turns each, in stored (insertion) order."""
    rng = random.Random(seed)
    counter = 0
    for c in range(conversations):
        conversation_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        user_id = f"user-{c % 97}"
        at = START + timedelta(minutes=c)
        for t in range(max(1, turns + rng.randint(-1, 1))):
            counter += 1
            parts: list[dict[str, Any]] = []
            tool = rng.choice(["search", "weather", "lookup"])
            style = rng.random()
            if style < 0.4:
                parts += [
                    {"type": "tool_call", "tool_name": tool, "args": {"q": f"c{c}t{t}"}},
                    {"type": "tool_call", "tool_name": tool, "args": f'{{"q": "again {t}"}}'},
                    {"type": "text", "content": "checking " + "x" * (text_chars // 4)},
                    {"type": "tool_result", "tool_name": tool, "result": {"n": t, "ok": True}},
                    {"type": "tool_result", "tool_name": tool, "result": f"second {t}"},
                ]
            elif style < 0.5:
                parts.append({"type": "tool_result", "tool_name": "orphan", "result": [t]})
            elif style < 0.55:
                parts.append({"type": "thinking", "content": "hidden"})
            elif style < 0.6:
                parts.append(
                    {"type": "hitl", "action": "confirm", "params": {"t": t},
                     "request_id": f"req-{c}-{t}", "prompt": "Confirm?"}
                )  # fmt: skip
            elif style < 0.65:
                parts.append({"type": "error", "message": f"failure {t}"})
            parts.append({"type": "text", "content": f"answer {t} " + "y" * text_chars})
            doc: dict[str, Any] = {
                "_id": ObjectId(f"{counter:024x}"),
                "conversation_id": conversation_id,
                "user_id": user_id,
                "created_at": at + timedelta(seconds=30 * t if rng.random() > 0.1 else 0),
                "user_message": f"question {t} " + "q" * (text_chars // 2),
                "response_parts": parts,
                "response_text": "",
                "token_usage": {"input_tokens": 100 + t, "output_tokens": 20 + t},
                "latency_ms": 500,
            }
            if t == 1 and rng.random() < 0.5:
                doc["name"] = f"Conversation {c}"
            if rng.random() < 0.05:
                doc["upload_result"] = {"filename": f"f{t}.txt", "file_type": "text/plain",
                                        "size": 10 + t}  # fmt: skip
            yield doc


# -- every kind of mess the migration's exit gate must survive ----------------------------

MESSY_START = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)
NOT_AN_IDENTIFIER = "conv 42/α"  # noqa: RUF001 - a real id seen in legacy data
"""A legacy conversation id with a space, a slash and a non-ASCII letter."""
BIG_RESULT_CHARS = 5_300_000
"""A tool result several times over the 1 MiB message bound."""


def mark(n: int) -> str:
    """A unique marker that a test can look for wherever the content went."""
    return f"«m{n}»"


def messy_corpus() -> list[dict[str, Any]]:
    """One conversation per kind of mess the exit gate must survive, each content piece marked.

    Every string of content holds a `mark(n)`, so a test can prove that each one
    is in a message, a kept full text or a problem record once the legacy
    collection is gone.
    """
    at = MESSY_START
    m = iter(range(1, 10_000))

    def t(minutes: int) -> datetime:
        return at + timedelta(minutes=minutes)

    docs: list[dict[str, Any]] = [
        # 1. A conversation id that is not an identifier.
        {"_id": ObjectId(f"{0xA1:024x}"), "conversation_id": NOT_AN_IDENTIFIER, "user_id": "user-m",
         "created_at": t(0), "user_message": f"hello {mark(next(m))}",
         "response_parts": [{"type": "text", "content": f"hi {mark(next(m))}"}]},
        {"_id": ObjectId(f"{0xA2:024x}"), "conversation_id": NOT_AN_IDENTIFIER, "user_id": "user-m",
         "created_at": t(1), "user_message": f"again {mark(next(m))}",
         "response_parts": [{"type": "text", "content": f"yes {mark(next(m))}"}]},
        # 2. A tool result far over the message bound; its marker is at its very end.
        {"_id": ObjectId(f"{0xB1:024x}"), "conversation_id": "mess-big-result",
         "user_id": "user-m", "created_at": t(2), "user_message": f"fetch {mark(next(m))}",
         "response_parts": [
             {"type": "tool_call", "tool_name": "fetch", "args": {"url": "https://x"}},
             {"type": "tool_result", "tool_name": "fetch",
              "result": "r" * BIG_RESULT_CHARS + mark(next(m))},
             {"type": "text", "content": f"fetched {mark(next(m))}"}]},
        # 3. Integer user text, and a whole-turn problem (parts not a list) beside an upload.
        {"_id": ObjectId(f"{0xC1:024x}"), "conversation_id": "mess-odd-values",
         "user_id": "user-m", "created_at": t(3), "user_message": 42,
         "response_parts": [{"type": "text", "content": f"forty-two {mark(next(m))}"}]},
        {"_id": ObjectId(f"{0xC2:024x}"), "conversation_id": "mess-odd-values",
         "user_id": "user-m", "created_at": t(4), "user_message": f"see file {mark(next(m))}",
         "upload_result": {"filename": f"a{mark(next(m))}.txt", "file_type": "text/plain",
                           "size": 3},
         "response_parts": f"not a list {mark(next(m))}",
         "response_text": f"read it {mark(next(m))}"},
        # 4. Numbers as strings; 5. a first turn without a time, under a string _id.
        {"_id": "turn-first", "conversation_id": "mess-numbers-dates", "user_id": "user-m",
         "user_message": f"undated {mark(next(m))}",
         "response_parts": [{"type": "text", "content": f"ok {mark(next(m))}"}],
         "token_usage": {"input_tokens": "1200", "output_tokens": "35"}, "latency_ms": "850"},
        {"_id": "turn-second", "conversation_id": "mess-numbers-dates", "user_id": "user-m",
         "created_at": t(5), "user_message": f"dated {mark(next(m))}",
         "response_parts": [{"type": "text", "content": f"fine {mark(next(m))}"}],
         "token_usage": {"input_tokens": 10.0, "output_tokens": " 7 "}, "latency_ms": 12.6},
        # 6. HITL turns whose response_text is the prompt; an upload-only turn with a latency.
        {"_id": ObjectId(f"{0xD1:024x}"), "conversation_id": "mess-hitl", "user_id": "user-m",
         "created_at": t(6), "user_message": f"book it {mark(next(m))}",
         "response_parts": [
             {"type": "text", "content": f"Let me check. {mark(next(m))}"},
             {"type": "hitl", "action": "confirm", "params": {"train": "8:04"},
              "request_id": "req-mess-1", "prompt": f"Shall I book the 8:04? {mark(next(m))}"}],
         "response_text": None},
        {"_id": ObjectId(f"{0xD2:024x}"), "conversation_id": "mess-hitl", "user_id": "user-m",
         "created_at": t(7), "user_message": "",
         "upload_result": {"filename": f"ok{mark(next(m))}.pdf", "file_type": "application/pdf",
                           "size": 10},
         "response_parts": [], "latency_ms": 300},
        # Content nothing can hold as it is: an unknown part, a result answering no call,
        # and numbers that cannot be read.
        {"_id": ObjectId(f"{0xE1:024x}"), "conversation_id": "mess-unplaced",
         "user_id": "user-m", "created_at": t(8), "user_message": f"look {mark(next(m))}",
         "response_parts": [
             {"type": "sticker", "emoji": f"🚄 {mark(next(m))}"},
             {"type": "tool_result", "tool_name": "ghost", "result": f"boo {mark(next(m))}"},
             {"type": "text", "content": f"seen {mark(next(m))}"}],
         "token_usage": {"input_tokens": f"n/a {mark(next(m))}"}},
        # 7. A conversation without any readable time.
        {"_id": "undated-1", "conversation_id": "mess-undated", "user_id": "user-m",
         "created_at": "yesterday", "user_message": f"when? {mark(next(m))}",
         "response_parts": [{"type": "text", "content": f"no idea {mark(next(m))}"}]},
    ]  # fmt: skip
    hitl = next(d for d in docs if d["conversation_id"] == "mess-hitl")
    hitl["response_text"] = hitl["response_parts"][1]["prompt"]
    return docs
