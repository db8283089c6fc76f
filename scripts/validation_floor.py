"""What reading a transcript must cost at least: BSON decoding against pydantic validation.

`python -m scripts.validation_floor` takes a 1,000-message conversation of the
benchmark's corpus as stored, and times per message (best of 20, CPU): decoding
its BSON (what the driver does for a raw `find`), validating the documents into
the store's models (what `transcript` adds), and validating them into bare
pydantic models of the same fields without a single Python validator (a floor
for any validation).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Literal

import bson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from agent_store.core import messages_adapter
from agent_store.store import plan_turn
from scripts.corpus import Corpus


class _Bare(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class _Function(_Bare):
    name: str
    arguments: str = "{}"


class _Call(_Bare):
    id: str
    type: Literal["function"] = "function"
    function: _Function


class _Usage(_Bare):
    input_tokens: int = 0
    output_tokens: int = 0


class _Message(_Bare):
    id: str | None = Field(default=None, alias="_id")
    conversation_id: str | None = None
    content: str | None = None
    tool_calls: list[_Call] | None = None
    tool_call_id: str | None = None
    hitl_action: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    upload: dict[str, Any] | None = None
    created_at: datetime
    token_usage: _Usage | None = None
    latency_ms: int | None = None
    seq: int | None = None
    user_id: str | None = None
    turn_id: str | None = None
    search_text: str | None = None
    truncated: dict[str, Any] | None = None
    native: dict[str, Any] | None = None


class _System(_Message):
    role: Literal["system"]


class _User(_Message):
    role: Literal["user"]


class _Assistant(_Message):
    role: Literal["assistant"]


class _Tool(_Message):
    role: Literal["tool"]


_bare: TypeAdapter[list[Any]] = TypeAdapter(
    list[Annotated[_System | _User | _Assistant | _Tool, Field(discriminator="role")]]
)


def stored_documents(messages: int) -> list[dict[str, Any]]:
    conversation = Corpus(seed=13).conversation_of_size(messages)
    documents: list[dict[str, Any]] = []
    for turn_id, turn in conversation.turns:
        plan = plan_turn(conversation.conversation_id, turn, turn_id=turn_id)
        stored = plan.stored(len(documents), conversation.user_id)
        documents += [m.model_dump(by_alias=True) for m in stored]
    return documents


def per_message(run: Callable[[], Any], count: int, repetitions: int = 20) -> float:
    best = float("inf")
    for _ in range(repetitions):
        started = time.process_time()
        run()
        best = min(best, time.process_time() - started)
    return best / count * 1e6


def main() -> int:
    documents = stored_documents(1000)
    encoded = b"".join(bson.encode(d) for d in documents)
    count = len(documents)
    print(f"{count} stored messages; client CPU per message (µs), best of 20:")
    for label, run in (
        ("decode their BSON", lambda: bson.decode_all(encoded)),
        ("validate into the store's models", lambda: messages_adapter.validate_python(documents)),
        ("validate into bare models", lambda: _bare.validate_python(documents)),
    ):
        print(f"  {label:<36}{per_message(run, count):>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
