"""How many wrong tokens one client may try at the viewer's sign-in before it must wait.

Counted per client address, in this process's memory: behind several
processes each keeps its own count (list the proxy in
`AGENT_STORE_TRUSTED_PROXIES`, so the address is the browser's, not the proxy's).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable


class SignInLimiter:
    """After `max_failures` wrong tokens within `window_seconds`, a client waits.

    Every attempt is refused while it waits, the right token included, so guessing
    gains nothing from the limit's end. An attempt is held (`reserve`) before its
    form is read and counts as a failure until it is `release`d, so tokens that
    arrive late, all at once, are checked no more often than tokens sent one by
    one. The oldest clients are forgotten beyond `max_clients`, so memory stays
    bounded whatever addresses an attacker uses.
    """

    def __init__(
        self, *, max_failures: int = 10, window_seconds: float = 300, max_clients: int = 10_000
    ) -> None:
        self.max_failures = max_failures
        self.window_seconds = window_seconds
        self.max_clients = max_clients
        self.clock: Callable[[], float] = time.monotonic
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._in_flight: dict[str, int] = {}
        """Attempts reserved and not released yet: at most one per open request."""

    def __len__(self) -> int:
        return len(self._failures)

    def _recent(self, client: str) -> deque[float]:
        failures = self._failures.get(client, deque())
        horizon = self.clock() - self.window_seconds
        while failures and failures[0] <= horizon:
            failures.popleft()
        return failures

    def retry_after(self, client: str) -> int:
        """Seconds `client` must wait before its next attempt; 0 when it may try now."""
        failures = self._recent(client)
        if len(failures) + self._in_flight.get(client, 0) < self.max_failures:
            return 0
        if len(failures) < self.max_failures:
            return 1  # attempts in flight hold the rest, and settle within a request
        return max(1, math.ceil(failures[0] + self.window_seconds - self.clock()))

    def reserve(self, client: str) -> int:
        """Hold an attempt of `client` until `release`: 0 when held, else seconds to wait.

        A held attempt counts against the limit as a failure would; record its
        outcome with `failed` or `succeeded` before releasing it.
        """
        wait = self.retry_after(client)
        if not wait:
            self._in_flight[client] = self._in_flight.get(client, 0) + 1
        return wait

    def release(self, client: str) -> None:
        """End an attempt `reserve` held, whether its token was checked or not."""
        held = self._in_flight.pop(client, 0)
        if held > 1:
            self._in_flight[client] = held - 1

    def failed(self, client: str) -> None:
        """Count a wrong token from `client`."""
        failures = self._recent(client)
        failures.append(self.clock())
        self._failures[client] = failures
        self._failures.move_to_end(client)
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)

    def succeeded(self, client: str) -> None:
        """A right token: `client` starts afresh."""
        self._failures.pop(client, None)
