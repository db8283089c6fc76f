"""Prometheus metrics of one service process, and the `/metrics` page that exposes them.

Each application has its own registry, so two apps in one process (tests) never
share counts. Labels are bounded: a route is its template (`/v1/conversations/{conversation_id}`),
never the requested path, and a request that matched no route is `(unmatched)`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.requests import Request

from agent_store.core import Conversation, StoreError
from agent_store.store import LoggedTurn

UNMATCHED_ROUTE = "(unmatched)"
STORAGE_ERROR_CODES = frozenset({"storage_failure", "storage_unavailable", "unsupported"})
"""The store's error codes that say the database failed (rather than the request)."""
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


HTTP_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"}
)
"""The methods counted under their own name (RFC 9110 and PATCH); case matters in HTTP."""


class ServiceMetrics:
    """The counters and the latency histogram of one application."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "agent_store_http_requests",
            "HTTP requests answered, by method, route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "agent_store_http_request_duration_seconds",
            "Time to answer an HTTP request (to its last byte), by method, route and status.",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.turns = Counter(
            "agent_store_turns_logged", "Turns logged (replays included).", registry=self.registry
        )
        self.messages = Counter(
            "agent_store_messages_logged",
            "Messages of the turns logged (a replay counts its stored messages again).",
            registry=self.registry,
        )
        self.replays = Counter(
            "agent_store_turn_replays",
            "Logged turns that were retries of a turn stored before (nothing written twice).",
            registry=self.registry,
        )
        self.truncations = Counter(
            "agent_store_messages_truncated",
            "Logged messages that were cut to the message size limit.",
            registry=self.registry,
        )
        self.conflicts = Counter(
            "agent_store_conflicts",
            "Requests refused because they contradict what is stored (409).",
            registry=self.registry,
        )
        self.storage_errors = Counter(
            "agent_store_storage_errors",
            "Database failures, by kind: storage_unavailable, storage_failure, unsupported.",
            ["kind"],
            registry=self.registry,
        )

    def request_answered(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one answered request and its latency, a method HTTP does not define as
        `other`: a client names any method it likes, and each label value is a series kept
        for good."""
        labels = (method if method in HTTP_METHODS else "other", route, str(status))
        self.requests.labels(*labels).inc()
        self.latency.labels(*labels).observe(seconds)

    def store_error(self, error: StoreError) -> None:
        """Count a store error that reached a client (conflicts and database failures)."""
        if error.code == "conflict":
            self.conflicts.inc()
        elif error.code in STORAGE_ERROR_CODES:
            self.storage_errors.labels(error.code).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class TurnCounter:
    """A turn observer of the logger: counts turns, messages, replays and truncations."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics

    async def turn_logged(self, turn: LoggedTurn, conversation: Conversation) -> None:
        self._metrics.turns.inc()
        self._metrics.messages.inc(len(turn.messages))
        if turn.replayed:
            self._metrics.replays.inc()
        cut = sum(1 for message in turn.messages if message.truncated)
        if cut:
            self._metrics.truncations.inc(cut)


def count_store_error(request: Request, error: StoreError) -> None:
    """Count `error` in the metrics of the application serving `request`, if it has any."""
    metrics = getattr(request.app.state, "metrics", None)
    if isinstance(metrics, ServiceMetrics):
        metrics.store_error(error)
