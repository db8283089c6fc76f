"""Demo conversations for `make run`: loaded only into an empty store.

The DESIGN example (every role and kind of message), two more conversations,
and legacy turn documents of the example so the viewer's legacy page has
something to compare.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from app.collections import CONVERSATIONS, LEGACY_TURNS
from app.examples import EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID, example_turns
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
    """The example's first two turns as the old one-document-per-turn model stored them."""
    start = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
    return [
        {
            "conversation_id": EXAMPLE_CONVERSATION_ID,
            "user_id": EXAMPLE_USER_ID,
            "name": "What's the weather in Paris and in Lyon?",
            "created_at": start,
            "user_message": "What's the weather in Paris and in Lyon?",
            "response_parts": [
                {"type": "tool_call", "tool_name": "get_weather", "args": {"city": "Paris"}},
                {"type": "tool_call", "tool_name": "get_weather", "args": '{"city": "Lyon"}'},
                {
                    "type": "tool_result",
                    "tool_name": "get_weather",
                    "result": {"temp_c": 18, "sky": "clear"},
                },
                {
                    "type": "tool_result",
                    "tool_name": "get_weather",
                    "result": {"temp_c": 21, "sky": "cloudy"},
                },
                {"type": "text", "content": "Paris: 18 °C and clear. Lyon: 21 °C and cloudy."},
            ],
            "response_text": "Paris: 18 °C and clear. Lyon: 21 °C and cloudy.",
            "token_usage": {"input_tokens": 310, "output_tokens": 49},
            "latency_ms": 1050,
        },
        {
            "conversation_id": EXAMPLE_CONVERSATION_ID,
            "user_id": EXAMPLE_USER_ID,
            "created_at": start + timedelta(seconds=60),
            "user_message": "Book me a train to Lyon tomorrow morning.",
            "response_parts": [
                {
                    "type": "tool_call",
                    "tool_name": "search_trains",
                    "args": {"to": "Lyon", "date": "2026-03-03"},
                    "tool_call_id": "call_t1",
                },
                {
                    "type": "tool_result",
                    "tool_name": "search_trains",
                    "tool_call_id": "call_t1",
                    "result": [{"train": "TGV 6601", "departs": "09:04", "price_eur": 35}],
                },
                {
                    "type": "hitl",
                    "action": "confirm_booking",
                    "request_id": "req-booking-1",
                    "params": {"train": "TGV 6601", "price_eur": 35},
                    "prompt": "The 09:04 TGV costs €35. Shall I book it? Upload an ID first.",
                },
                {"type": "sticker", "emoji": "🚄"},
            ],
            "latency_ms": 530,
        },
    ]


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
