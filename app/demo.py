"""Demo conversations for `make run`: loaded only into an empty store.

The DESIGN example (every role and kind of message), two more conversations,
and legacy turn documents of the example so the viewer's legacy page has
something to compare.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from agent_store.legacy import LEGACY_TURNS
from agent_store.store import CONVERSATIONS
from app.examples import (
    EXAMPLE_CONVERSATION_ID,
    EXAMPLE_USER_ID,
    example_legacy_turns,
    example_turns,
)
from app.service import Store

OTHER_USER_ID = "user-grace"
_DAY = datetime(2026, 3, 1, 14, 0, tzinfo=UTC)


def _at(minutes: int) -> datetime:
    return _DAY + timedelta(minutes=minutes)


def demo_conversations() -> list[tuple[str, str, list[tuple[str, list[dict[str, Any]]]]]]:
    """(conversation_id, user_id, turns) of each demo conversation."""
    return [
        (EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID, example_turns()),
        (
            "demo-recipe-ideas",
            EXAMPLE_USER_ID,
            [
                (
                    "demo-recipe-1",
                    [
                        {
                            "role": "user",
                            "content": "A quick dinner with leeks?",
                            "created_at": _at(0),
                        },
                        {
                            "role": "assistant",
                            "content": "Leek and potato soup: 30 minutes, five ingredients.",
                            "token_usage": {"input_tokens": 42, "output_tokens": 14},
                            "latency_ms": 380,
                            "created_at": _at(1),
                        },
                    ],
                )
            ],
        ),
        (
            "demo-invoice-check",
            OTHER_USER_ID,
            [
                (
                    "demo-invoice-1",
                    [
                        {
                            "role": "user",
                            "content": "Is this invoice correct?",
                            "upload": {
                                "filename": "invoice-0412.pdf",
                                "file_type": "application/pdf",
                                "size": 12034,
                                "parsed_text": "Total due: 1,240.00 EUR",
                            },
                            "created_at": _at(30),
                        },
                        {
                            "role": "assistant",
                            "tool_calls": [
                                {
                                    "id": "call_sum",
                                    "function": {
                                        "name": "sum_lines",
                                        "arguments": {"document": "invoice-0412.pdf"},
                                    },
                                }
                            ],
                            "created_at": _at(31),
                        },
                        {
                            "role": "tool",
                            "tool_call_id": "call_sum",
                            "content": '{"total": 1240.0, "currency": "EUR"}',
                            "created_at": _at(31),
                        },
                        {
                            "role": "assistant",
                            "content": "Yes: the lines add up to the 1,240.00 EUR total.",
                            "token_usage": {"input_tokens": 150, "output_tokens": 17},
                            "latency_ms": 720,
                            "created_at": _at(32),
                        },
                    ],
                )
            ],
        ),
    ]


def legacy_example_turns() -> list[dict[str, Any]]:
    """The example as the old one-document-per-turn model stored it, for the legacy page.

    One part of a kind the old writer never documented is added, to show how the
    viewer presents what the converter cannot place.
    """
    turns = example_legacy_turns()
    turns[1]["response_parts"].append({"type": "sticker", "emoji": "🚄"})
    return turns


async def load_demo(store: Store) -> bool:
    """Log the demo conversations if the store holds none; True when it loaded them."""
    if await store.db[CONVERSATIONS].find_one({}, {"_id": 1}) is not None:
        return False
    for conversation_id, user_id, turns in demo_conversations():
        for turn_id, messages in turns:
            await store.logger.log_messages(
                conversation_id, messages, user_id=user_id, turn_id=turn_id
            )
    legacy = store.db[LEGACY_TURNS]
    if await legacy.find_one({}, {"_id": 1}) is None:
        await legacy.insert_many(legacy_example_turns())
    return True
