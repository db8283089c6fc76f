"""How a runtime retries a write: only what may succeed when sent again, with backoff.

Every logging call is idempotent (a retry of a turn stores nothing twice), and a
pop retried through the same `ConversationStore` finishes its earlier attempt
rather than removing a second message, so retrying is always safe; what
matters is retrying the right errors for long enough. Only
`StorageUnavailable` is worth another attempt: the database was unreachable or
timed out, and may have applied the write (the retry then replays it).
`InvalidInput`, `NotFound`, `Conflict` and `StorageFailure` give the same
answer every time.

PyMongo pauses a connection pool after a dropped connection, so the calls
right after it fail at once: a first delay of a second rides that out
(docs/RELIABILITY.md has the measurements).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from agent_store.core import StorageUnavailable
from agent_store.store._driver import pause

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter (each wait half to all of its ceiling), retrying
    `StorageUnavailable` only."""

    attempts: int = 8
    """Attempts in all, the first included."""
    first_delay: float = 1.0
    """Seconds before the second attempt, at most."""
    max_delay: float = 8.0
    """No wait is longer than this many seconds."""
    multiplier: float = 2.0

    def delay(self, retry: int, rng: random.Random) -> float:
        """The wait before retry number `retry` (1 for the second attempt)."""
        ceiling = min(self.max_delay, self.first_delay * self.multiplier ** (retry - 1))
        return rng.uniform(ceiling / 2, ceiling)


async def with_retries(
    operation: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy | None = None,
    rng: random.Random | None = None,
) -> T:
    """Await `operation()`, calling it again after `StorageUnavailable` as `policy` says.

    The last `StorageUnavailable` is raised when every attempt failed; any other
    error is raised at once.
    """
    policy = policy or RetryPolicy()
    rng = rng or random.Random()
    for retry in range(policy.attempts):
        if retry:
            await pause(policy.delay(retry, rng))
        try:
            return await operation()
        except StorageUnavailable:
            if retry == policy.attempts - 1:
                raise
    raise AssertionError("unreachable: the loop returns or raises")
