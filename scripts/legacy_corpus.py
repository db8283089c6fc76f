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
