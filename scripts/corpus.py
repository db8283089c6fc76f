"""A deterministic synthetic corpus of agent turns, shaped like a tool-using assistant's.

Each turn: a user message (sometimes with an upload), zero to two rounds of
tool calls with their results, and a final assistant answer with token usage;
now and then a HITL prompt or an error. Words follow a Zipf-like law over a
vocabulary of made-up words, so text-index figures see a realistic spread of
terms. The same seed always gives the same turns.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

_SYLLABLES = ("ka", "lo", "mi", "ne", "sa", "tu", "ri", "po", "de", "va")
_SYLLABLES += ("ch", "an", "el", "or", "is", "um", "br", "st", "gr", "pl")
_TOOLS = ["search_docs", "get_weather", "lookup_order", "run_sql", "send_email", "fetch_url"]
_START = datetime(2026, 1, 5, 8, 0, tzinfo=UTC)


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    user_id: str
    turns: list[tuple[str, list[dict[str, Any]]]]
    """(turn_id, messages as a runtime hands them to the logger)."""

    @property
    def message_count(self) -> int:
        return sum(len(messages) for _, messages in self.turns)


class Corpus:
    def __init__(self, seed: int = 7, vocabulary: int = 5000) -> None:
        self._random = random.Random(seed)
        words = set()
        while len(words) < vocabulary:
            words.add("".join(self._random.choices(_SYLLABLES, k=self._random.randint(1, 4))))
        self._words = sorted(words)
        self._random.shuffle(self._words)  # frequency rank independent of spelling
        self._weights = [1 / (rank + 1) for rank in range(len(self._words))]
        self._clock = _START

    def _text(self, low: int, high: int) -> str:
        count = self._random.randint(low, high)
        return (
            " ".join(self._random.choices(self._words, self._weights, k=count)).capitalize() + "."
        )

    def _tick(self, seconds: float) -> datetime:
        self._clock += timedelta(seconds=seconds)
        return self._clock

    def turn(self, number: int) -> list[dict[str, Any]]:
        rand = self._random
        user: dict[str, Any] = {
            "role": "user",
            "content": self._text(5, 60),
            "created_at": self._tick(rand.uniform(20, 600)),
        }
        if rand.random() < 0.05:
            user["upload"] = {
                "filename": f"report-{number}.pdf",
                "file_type": "application/pdf",
                "size": rand.randint(10_000, 900_000),
                "parsed_text": self._text(100, 600),
            }
        messages = [user]
        for round_ in range(rand.choice([0, 1, 1, 1, 2])):
            calls = [
                {
                    "id": f"call_{number}_{round_}_{k}",
                    "function": {
                        "name": rand.choice(_TOOLS),
                        "arguments": {"query": self._text(2, 8), "limit": rand.randint(1, 20)},
                    },
                }
                for k in range(rand.choice([1, 1, 2]))
            ]
            messages.append(
                {
                    "role": "assistant",
                    "tool_calls": calls,
                    "token_usage": {
                        "input_tokens": rand.randint(300, 4000),
                        "output_tokens": rand.randint(10, 80),
                    },
                    "latency_ms": rand.randint(200, 2500),
                    "created_at": self._tick(rand.uniform(0.5, 3)),
                }
            )
            for call in calls:
                result = {"items": [self._text(5, 40) for _ in range(rand.randint(1, 5))]}
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "content": json.dumps(result),
                        "created_at": self._tick(rand.uniform(0.1, 2)),
                    }
                )
        final: dict[str, Any] = {
            "role": "assistant",
            "content": self._text(20, 250),
            "token_usage": {
                "input_tokens": rand.randint(500, 6000),
                "output_tokens": rand.randint(50, 600),
            },
            "latency_ms": rand.randint(300, 8000),
            "created_at": self._tick(rand.uniform(1, 10)),
        }
        roll = rand.random()
        if roll < 0.04:
            final["hitl_action"] = {
                "action": "confirm",
                "params": {"amount": rand.randint(1, 500)},
                "request_id": f"req-{number}",
            }
        elif roll < 0.06:
            final = {
                "role": "assistant",
                "content": None,
                "error": {"message": "Upstream model timed out"},
                "created_at": final["created_at"],
            }
        messages.append(final)
        return messages

    def turn_of_size(self, number: int, size: int) -> list[dict[str, Any]]:
        """A turn of exactly `size` messages: the user, rounds of one call and its result, and
        a final answer (a user message alone when `size` is 1)."""
        rand = self._random
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": self._text(5, 60), "created_at": self._tick(30)}
        ]
        for round_ in range(max(size - 2, 0) // 2):
            call_id = f"call_{number}_{round_}"
            messages.append(
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "function": {"name": rand.choice(_TOOLS), "arguments": {"q": "x"}},
                        }
                    ],
                    "created_at": self._tick(1),
                }
            )
            result = {"items": [self._text(5, 40) for _ in range(2)]}
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": json.dumps(result),
                    "created_at": self._tick(1),
                }
            )
        while len(messages) < size:
            messages.append(
                {
                    "role": "assistant",
                    "content": self._text(20, 150),
                    "token_usage": {"input_tokens": 900, "output_tokens": 120},
                    "created_at": self._tick(2),
                }
            )
        return messages

    def conversation_of_turn_size(self, turns: int, size: int) -> Conversation:
        """A conversation of `turns` turns of `size` messages each."""
        conversation = self.conversation(0)
        prefix = conversation.conversation_id[:8]
        for number in range(turns):
            conversation.turns.append((f"run-{prefix}-{number}", self.turn_of_size(number, size)))
        return conversation

    def conversation(self, turns: int, *, user_id: str | None = None) -> Conversation:
        conversation_id = str(uuid.UUID(int=self._random.getrandbits(128), version=4))
        user_id = user_id or f"user-{self._random.randint(1, 10**9)}"
        return Conversation(
            conversation_id,
            user_id,
            [(f"run-{conversation_id[:8]}-{n}", self.turn(n)) for n in range(turns)],
        )

    def conversation_of_size(self, messages: int, *, user_id: str | None = None) -> Conversation:
        """A conversation of at least `messages` messages (whole turns)."""
        conversation = self.conversation(0, user_id=user_id)
        number = 0
        while conversation.message_count < messages:
            conversation.turns.append((f"run-{number}", self.turn(number)))
            number += 1
        return conversation
