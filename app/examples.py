"""The example conversation: every role and every kind of message, in 12 messages and 4 turns.

Used by the tests as the golden case and by `make run` as demo data.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

EXAMPLE_CONVERSATION_ID = "3f2b8c1e-5d4a-4f7b-9c2e-1a6d8e0b7c54"
EXAMPLE_USER_ID = "user-ada"
_START = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)


def _at(seconds: int) -> datetime:
    return _START + timedelta(seconds=seconds)


def example_turns() -> list[tuple[str, list[dict[str, Any]]]]:
    """(turn_id, messages) of the example conversation, as a runtime logs them."""
    return [
        (
            "turn-1",
            [
                {
                    "role": "user",
                    "content": "[RUNTIME CONTEXT]timezone=Europe/Paris; plan=pro[/RUNTIME CONTEXT]"
                    "What's the weather in Paris and in Lyon?",
                    "created_at": _at(0),
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_w1",
                            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                        },
                        {
                            "id": "call_w2",
                            "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
                        },
                    ],
                    "token_usage": {"input_tokens": 120, "output_tokens": 31},
                    "latency_ms": 640,
                    "created_at": _at(1),
                },
                {
                    "role": "tool",
                    "tool_call_id": "call_w1",
                    "content": '{"temp_c": 18, "sky": "clear"}',
                    "created_at": _at(2),
                },
                {
                    "role": "tool",
                    "tool_call_id": "call_w2",
                    "content": '{"temp_c": 21, "sky": "cloudy"}',
                    "created_at": _at(2),
                },
                {
                    "role": "assistant",
                    "content": "Paris: 18 °C and clear. Lyon: 21 °C and cloudy.",
                    "token_usage": {"input_tokens": 190, "output_tokens": 18},
                    "latency_ms": 410,
                    "created_at": _at(3),
                },
            ],
        ),
        (
            "turn-2",
            [
                {
                    "role": "user",
                    "content": "Book me a train to Lyon tomorrow morning.",
                    "created_at": _at(60),
                },
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "call_t1",
                            "function": {
                                "name": "search_trains",
                                "arguments": {"to": "Lyon", "date": "2026-03-03"},
                            },
                        }
                    ],
                    "token_usage": {"input_tokens": 240, "output_tokens": 25},
                    "created_at": _at(61),
                },
                {
                    "role": "tool",
                    "tool_call_id": "call_t1",
                    "content": '[{"train": "TGV 6601", "departs": "09:04", "price_eur": 35}]',
                    "created_at": _at(62),
                },
                {
                    "role": "assistant",
                    "content": "The 09:04 TGV costs €35. Shall I book it? Upload an ID first.",
                    "hitl_action": {
                        "action": "confirm_booking",
                        "params": {"train": "TGV 6601", "price_eur": 35},
                        "request_id": "req-booking-1",
                    },
                    "token_usage": {"input_tokens": 300, "output_tokens": 22},
                    "latency_ms": 530,
                    "created_at": _at(63),
                },
            ],
        ),
        (
            "turn-3",
            [
                {
                    "role": "user",
                    "content": "Here is my ID card.",
                    "upload": {
                        "filename": "id-card.pdf",
                        "file_type": "application/pdf",
                        "size": 48213,
                        "parsed_text": "ADA LOVELACE 1815-12-10",
                    },
                    "created_at": _at(120),
                },
                {
                    "role": "assistant",
                    "content": None,
                    "error": {"message": "Booking service unavailable (HTTP 503)"},
                    "created_at": _at(121),
                },
            ],
        ),
        (
            "turn-4",
            [
                {
                    "role": "system",
                    "content": "Scheduled follow-up: retry the pending booking.",
                    "created_at": _at(3600),
                }
            ],
        ),
    ]


EXAMPLE_LEGACY_IDS = [
    "65e2e9f0a1b2c3d4e5f60001",
    "65e2e9f0a1b2c3d4e5f60002",
    "65e2e9f0a1b2c3d4e5f60003",
    "65e2e9f0a1b2c3d4e5f60004",
]


def example_legacy_turns() -> list[dict[str, Any]]:
    """The example conversation as the old writer stored it: one document per turn (DESIGN §4).

    Token usage and latency were kept per turn, so each turn holds the sum of its responses.
    """
    from bson import ObjectId

    common = {"conversation_id": EXAMPLE_CONVERSATION_ID, "user_id": EXAMPLE_USER_ID}
    return [
        {
            "_id": ObjectId(EXAMPLE_LEGACY_IDS[0]),
            **common,
            "name": None,
            "created_at": _at(0),
            "user_message": "[RUNTIME CONTEXT]timezone=Europe/Paris; plan=pro[/RUNTIME CONTEXT]"
            "What's the weather in Paris and in Lyon?",
            "response_parts": [
                {
                    "type": "tool_call",
                    "tool_name": "get_weather",
                    "args": {"city": "Paris"},
                    "tool_call_id": "call_w1",
                },
                {
                    "type": "tool_call",
                    "tool_name": "get_weather",
                    "args": '{"city": "Lyon"}',
                    "tool_call_id": "call_w2",
                },
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
            "tool_calls": [
                {"tool_name": "get_weather", "args": {"city": "Paris"}},
                {"tool_name": "get_weather", "args": '{"city": "Lyon"}'},
            ],
            "response_text": "Paris: 18 °C and clear. Lyon: 21 °C and cloudy.",
            "token_usage": {"input_tokens": 310, "output_tokens": 49},
            "latency_ms": 1050,
        },
        {
            "_id": ObjectId(EXAMPLE_LEGACY_IDS[1]),
            **common,
            "created_at": _at(60),
            "user_message": "Book me a train to Lyon tomorrow morning.",
            "response_parts": [
                {
                    "type": "tool_call",
                    "tool_name": "search_trains",
                    "args": {"to": "Lyon", "date": "2026-03-03"},
                },
                {
                    "type": "tool_result",
                    "tool_name": "search_trains",
                    "result": [{"train": "TGV 6601", "departs": "09:04", "price_eur": 35}],
                },
                {
                    "type": "hitl",
                    "action": "confirm_booking",
                    "params": {"train": "TGV 6601", "price_eur": 35},
                    "request_id": "req-booking-1",
                    "prompt": "The 09:04 TGV costs €35. Shall I book it? Upload an ID first.",
                },
            ],
            "message_history_json": (
                '[{"kind": "response", "parts": [{"part_kind": "tool-call", '
                '"tool_name": "search_trains", "args": {"to": "Lyon", "date": "2026-03-03"}, '
                '"tool_call_id": "call_t1"}]}, {"kind": "request", "parts": [{"part_kind": '
                '"tool-return", "tool_name": "search_trains", "content": [], '
                '"tool_call_id": "call_t1"}]}]'
            ),
            "token_usage": {"input_tokens": 540, "output_tokens": 47},
            "latency_ms": 530,
        },
        {
            "_id": ObjectId(EXAMPLE_LEGACY_IDS[2]),
            **common,
            "name": "Trip to Lyon",
            "created_at": _at(120),
            "user_message": "Here is my ID card.",
            "upload_result": {
                "filename": "id-card.pdf",
                "file_type": "application/pdf",
                "size": 48213,
                "parsed_text": "ADA LOVELACE 1815-12-10",
            },
            "response_parts": [
                {"type": "error", "message": "Booking service unavailable (HTTP 503)"}
            ],
            "response_text": "",
        },
        {
            "_id": ObjectId(EXAMPLE_LEGACY_IDS[3]),
            **common,
            "created_at": _at(3600),
            "is_system": True,
            "user_message": "Scheduled follow-up: retry the pending booking.",
            "response_parts": [],
        },
    ]
