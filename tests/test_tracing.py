"""OpenTelemetry spans, captured in memory: one per HTTP request, one per MongoDB command."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from pymongo import AsyncMongoClient

from app.api import create_app
from app.service import Store
from app.settings import ConfigurationError
from app.tracing import MISSING_EXTRA, Tracing
from tests.api_harness import OWNER_CONVERSATION, api_settings, auth_headers, mongomock_db, seed

SERVICE = auth_headers()


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    captured = InMemorySpanExporter()
    yield captured
    captured.shutdown()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    traced = TracerProvider()
    traced.add_span_processor(SimpleSpanProcessor(exporter))
    return traced


def server_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]


async def test_one_request_is_one_server_span_named_by_its_route_without_the_query(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    settings = api_settings()
    store = Store.on(mongomock_db(), settings)
    await seed(store)
    app = create_app(settings, store=store, tracer_provider=provider)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        url = f"/v1/conversations/{OWNER_CONVERSATION}/messages?limit=3"
        assert (await http.get(url, headers=SERVICE)).status_code == 200
    (span,) = server_spans(exporter)
    assert span.name == "GET /v1/conversations/{conversation_id}/messages"
    assert span.attributes is not None
    assert span.attributes["http.route"] == "/v1/conversations/{conversation_id}/messages"
    assert span.attributes["http.status_code"] == 200
    assert not any("limit=3" in str(v) for v in span.attributes.values()), span.attributes


@pytest.fixture
async def traced_wire_store(
    wire_uri: str, provider: TracerProvider
) -> AsyncIterator[tuple[Store, str]]:
    listener = Tracing(provider).command_listener()
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
        wire_uri, tz_aware=True, event_listeners=[listener]
    )
    name = f"traced_{uuid.uuid4().hex[:10]}"
    yield Store.on(client[name], api_settings()), name
    await client.drop_database(name)
    await client.close()


@pytest.mark.wire
async def test_one_turn_is_a_server_span_with_a_child_span_per_mongodb_command(
    traced_wire_store: tuple[Store, str],
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
) -> None:
    store, database = traced_wire_store
    await store.logger.ensure_indexes()
    exporter.clear()
    app = create_app(api_settings(), store=store, tracer_provider=provider)
    transport = httpx.ASGITransport(app=app)
    turn = {"turn_id": "t-traced", "messages": [{"role": "user", "content": "secret words"}]}
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.post(
            "/v1/conversations/conv-traced/turns", json=turn, headers=SERVICE
        )
    assert response.status_code == 201, response.text
    (request,) = server_spans(exporter)
    assert request.name == "POST /v1/conversations/{conversation_id}/turns"
    commands = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT]
    assert commands, exporter.get_finished_spans()
    for command in commands:
        assert command.parent is not None
        assert command.parent.span_id == request.context.span_id  # children of the request
        assert command.context.trace_id == request.context.trace_id
        assert command.attributes is not None
        assert command.attributes["db.system"] == "mongodb"
        assert command.attributes["db.name"] == database
        assert not any("secret words" in str(v) for v in command.attributes.values())
        # The statement is the command's name only: no document, no filter value.
        assert command.attributes["db.statement"] == command.name.rpartition(".")[2]
    written = {(c.name.rpartition(".")[2], c.attributes["db.mongodb.collection"]) for c in commands}  # type: ignore[index]
    assert ("insert", "agent_messages") in written, written
    assert ("findAndModify", "agent_conversations") in written, written


def test_tracing_on_without_the_extra_is_refused_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "opentelemetry.instrumentation.asgi", None)
    with pytest.raises(ConfigurationError, match=r"\[otel\]"):
        Tracing.configure(api_settings(tracing=True), None)
    assert "AGENT_STORE_TRACING" in MISSING_EXTRA
