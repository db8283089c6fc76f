"""Step 3 of the protocol: compare every (or a sample of) migrated conversation with its
legacy turns, as canonical transcripts."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pymongo.database import Database

from agent_store.core import InvalidInput, message_adapter
from agent_store.legacy import LEGACY_TURNS, convert, parse_turns
from agent_store.store import MESSAGES
from migrations.explode import batches, conversation_ids, read_turns
from migrations.transcript import differences, from_legacy, from_messages


@dataclass
class Verification:
    conversations: int = 0
    matched: int = 0
    unplaced: int = 0
    """Legacy parts left out on purpose: the migration recorded them as problems."""
    differences: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.differences


def sample(ids: Iterator[Any], size: int, seed: int) -> list[Any]:
    """A uniform sample of a stream of unknown length, in memory of `size` (reservoir)."""
    chosen: list[Any] = []
    rng = random.Random(seed)
    for n, item in enumerate(ids):
        if n < size:
            chosen.append(item)
        elif (j := rng.randint(0, n)) < size:
            chosen[j] = item
    return sorted(chosen, key=str)


def verify(
    db: Database[dict[str, Any]],
    *,
    conversation: str | None = None,
    sample_size: int | None = None,
    seed: int = 0,
    batch_size: int = 100,
    on_batch: Callable[[int], None] | None = None,
) -> Verification:
    result = Verification()
    ids: Iterator[Any]
    if conversation is not None:
        ids = iter([conversation])
    elif sample_size is not None:
        ids = iter(sample(conversation_ids(db), sample_size, seed))
    else:
        ids = conversation_ids(db)
    for batch in batches(ids, batch_size):
        legacy = read_turns(db, batch, source=LEGACY_TURNS)
        stored: dict[str, list[Any]] = {str(i): [] for i in batch}
        query = {
            "conversation_id": {"$in": [str(i) for i in batch]},
            "turn_id": {"$regex": "^legacy-"},
        }
        for doc in db[MESSAGES].find(query).sort([("conversation_id", 1), ("seq", 1)]):
            stored[doc["conversation_id"]].append(message_adapter.validate_python(doc))
        for raw_id, documents in legacy.items():
            conversation_id = str(raw_id)
            result.conversations += 1
            if not documents:
                result.differences[conversation_id] = ["no legacy turns under this id"]
                continue
            try:
                conversion = convert(documents)
            except InvalidInput as exc:
                result.differences[conversation_id] = [f"cannot be converted: {exc.message}"]
                continue
            unplaced = conversion.unplaced
            result.unplaced += len(unplaced)
            found = differences(
                from_legacy(parse_turns(documents), unplaced),
                from_messages(stored.get(conversation_id, [])),
            )
            if found:
                result.differences[conversation_id] = found
            else:
                result.matched += 1
        if on_batch is not None:
            on_batch(len(batch))
    return result
