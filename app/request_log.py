"""One measurement per HTTP request: a JSON audit line in the log and the request metrics.

The line holds the path without its query string (search text, or a token pasted
into a URL, stays out of logs), the route template, the status, who called (the
client's address, as a trusted proxy forwards it, and the service and user
tokens' names) and how long it took. It replaces uvicorn's access log. Probes and scrapes
(`PROBE_PATHS`) are counted in the metrics but not logged: polled every few
seconds, they would drown the log.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.auth import audit_record
from app.metrics import UNMATCHED_ROUTE, ServiceMetrics

audit_log = logging.getLogger("agent_store.audit")

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Polled by orchestrators and Prometheus: measured, never logged."""


def route_template(scope: Scope) -> str:
    """The path template of the route `scope` reached (`/v1/users/{user_id}`), bounded labels."""
    router = scope.get("app")
    for route in getattr(router, "routes", ()):
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            path: str = route.path
            return path
    return UNMATCHED_ROUTE


class RequestLogMiddleware:
    """Writes the audit line of each HTTP request and feeds the application's metrics."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = audit_record(scope)
        status = 500
        started = time.perf_counter()

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            seconds = time.perf_counter() - started
            route = route_template(scope)
            metrics: ServiceMetrics | None = getattr(scope["app"].state, "metrics", None)
            if metrics is not None:
                metrics.request_answered(scope["method"], route, status, seconds)
            if scope["path"] not in PROBE_PATHS:
                line: dict[str, Any] = {
                    "method": scope["method"],
                    "path": scope["path"],
                    "route": route,
                    "status": status,
                    "client": scope["client"][0] if scope.get("client") else None,
                    "service": record.service,
                    "user": record.user,
                    "ms": round(seconds * 1000, 1),
                }
                audit_log.info(json.dumps(line, separators=(",", ":")), extra={"fields": line})
