"""OpenTelemetry tracing of HTTP requests and MongoDB commands (the `otel` extra).

Off unless `AGENT_STORE_TRACING=true` (or a test hands a tracer provider over).
HTTP spans are named by method and route template (`POST /v1/conversations/{conversation_id}/turns`)
and carry no query string; MongoDB spans (one per command, children of the request's span)
carry the command and collection names, never the command's documents.
Spans are exported over OTLP where the standard `OTEL_EXPORTER_OTLP_*` variables say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.middleware import Middleware
from starlette.types import Scope

from app.request_log import route_template
from app.settings import ConfigurationError, Settings

if TYPE_CHECKING:
    from opentelemetry.trace import Span, TracerProvider
    from pymongo.monitoring import CommandListener

MISSING_EXTRA = (
    "AGENT_STORE_TRACING is on but OpenTelemetry is not installed: "
    "pip install 'agent-conversation-store[otel]' (or set AGENT_STORE_TRACING=false)"
)


def _span_details(scope: Scope) -> tuple[str, dict[str, Any]]:
    route = route_template(scope)
    return f"{scope.get('method', 'HTTP')} {route}", {"http.route": route}


def _without_query(span: Span, scope: dict[str, Any]) -> None:
    """Search text or a token pasted into a URL stays out of traces, as out of logs."""
    if not span.is_recording():
        return
    path = scope.get("path", "")
    span.set_attribute("http.target", path)
    scheme, (host, port) = scope.get("scheme", "http"), scope.get("server") or ("", 0)
    span.set_attribute("http.url", f"{scheme}://{host}:{port}{path}")


@dataclass(frozen=True)
class Tracing:
    """Where spans go, and the hooks that make them: an ASGI middleware, a command listener."""

    provider: TracerProvider

    @classmethod
    def configure(cls, settings: Settings, provider: TracerProvider | None) -> Tracing | None:
        """Tracing as `settings` ask (None when off); `provider` overrides the OTLP exporter."""
        if provider is None and not settings.tracing:
            return None
        try:
            import opentelemetry.instrumentation.asgi
            import opentelemetry.instrumentation.pymongo  # noqa: F401
        except ImportError:
            raise ConfigurationError(MISSING_EXTRA) from None
        return cls(provider or _otlp_provider())

    def middleware(self) -> Middleware:
        """The ASGI middleware that opens one server span per HTTP request."""
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

        return Middleware(
            OpenTelemetryMiddleware,
            tracer_provider=self.provider,
            default_span_details=_span_details,
            server_request_hook=_without_query,
            exclude_spans=["receive", "send"],
        )

    def command_listener(self) -> CommandListener:
        """A PyMongo listener that opens one client span per MongoDB command."""
        from opentelemetry.instrumentation.pymongo import CommandTracer

        tracer = self.provider.get_tracer("agent_store.mongodb")
        listener: CommandListener = CommandTracer(tracer)
        return listener


def _otlp_provider() -> TracerProvider:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigurationError(MISSING_EXTRA) from None
    resource = Resource.create()  # reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "agent-conversation-store"}))
    provider = SdkTracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider
