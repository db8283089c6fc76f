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
    gains nothing from the limit's end. The oldest clients are forgotten beyond
    `max_clients`, so memory stays bounded whatever addresses an attacker uses.
    """

    def __init__(
        self, *, max_failures: int = 10, window_seconds: float = 300, max_clients: int = 10_000
    ) -> None:
        self.max_failures = max_failures
        self.window_seconds = window_seconds
        self.max_clients = max_clients
        self.clock: Callable[[], float] = time.monotonic
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

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
        if len(failures) < self.max_failures:
            return 0
        return max(1, math.ceil(failures[0] + self.window_seconds - self.clock()))

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
