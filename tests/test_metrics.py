"""`/metrics`: scraped after real requests and read with Prometheus' own text parser."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_store.core import StorageUnavailable
from tests.api_harness import (
    OWNER,
    OWNER_CONVERSATION,
    Served,
    api_settings,
    auth_headers,
    mongomock_db,
    serve,
)
from tests.conftest import after_its_first_batch

SERVICE = auth_headers()
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(api: Served, headers: dict[str, str] | None = None) -> Samples:
    response = await api.http.get("/metrics", headers=headers or {})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
async def api() -> AsyncIterator[Served]:
    async with serve(mongomock_db(), api_settings(max_message_bytes=4096)) as served:
        yield served


def turn(turn_id: str, text: str) -> dict[str, object]:
    return {"turn_id": turn_id, "messages": [{"role": "user", "content": text}]}


async def test_metrics_count_requests_by_route_and_status_with_their_latency(api: Served) -> None:
    for _ in range(3):
        await api.http.get(f"/v1/conversations/{OWNER_CONVERSATION}", headers=SERVICE)
    await api.http.get("/v1/conversations/nobody-has-this", headers=SERVICE)
    await api.http.get(f"/v1/users/{OWNER}/conversations?limit=2", headers=SERVICE)
    await api.http.get("/no/such/route")
    samples = await scrape(api)
    route = "/v1/conversations/{conversation_id}"
    ok = {"method": "GET", "route": route, "status": "200"}
    assert value(samples, "agent_store_http_requests_total", **ok) == 3
    missing = ok | {"status": "404"}
    assert value(samples, "agent_store_http_requests_total", **missing) == 1
    listed = {"method": "GET", "route": "/v1/users/{user_id}/conversations", "status": "200"}
    assert value(samples, "agent_store_http_requests_total", **listed) == 1
    unmatched = {"method": "GET", "route": "(unmatched)", "status": "404"}
    assert value(samples, "agent_store_http_requests_total", **unmatched) == 1
    assert value(samples, "agent_store_http_request_duration_seconds_count", **ok) == 3
    assert value(samples, "agent_store_http_request_duration_seconds_sum", **ok) > 0
    every_bucket = value(
        samples, "agent_store_http_request_duration_seconds_bucket", **ok, le="+Inf"
    )
    assert every_bucket == 3
    # Labels are route templates: no conversation id or query string becomes a label value.
    labels = {v for (_, pairs) in samples for _, v in pairs}
    assert not any(
        OWNER_CONVERSATION in v or "nobody-has-this" in v or "limit" in v for v in labels
    )


async def test_a_made_up_method_is_counted_as_other_so_no_request_adds_series(
    api: Served,
) -> None:
    """Anyone may send any method name, without a token: were it a label value, each new
    one would add series to every scrape and to the process's memory for good."""
    for number in range(20):
        await api.http.request(f"M{number}", "/health")
    await api.http.get("/health")

    samples = await scrape(api)

    methods = {dict(pairs).get("method") for (_, pairs) in samples} - {None}
    assert methods == {"GET", "other"}
    made_up = {"method": "other", "route": "/health", "status": "405"}
    assert value(samples, "agent_store_http_requests_total", **made_up) == 20


async def test_metrics_count_turns_messages_replays_conflicts_and_truncations(api: Served) -> None:
    url = "/v1/conversations/conv-metrics/turns"
    big = "x" * 20_000  # over max_message_bytes: stored cut
    assert (await api.http.post(url, json=turn("t-1", "hello"), headers=SERVICE)).status_code == 201
    assert (await api.http.post(url, json=turn("t-2", big), headers=SERVICE)).status_code == 201
    replay = await api.http.post(url, json=turn("t-1", "hello"), headers=SERVICE)
    assert replay.status_code == 200
    other = await api.http.post(url, json=turn("t-1", "something else"), headers=SERVICE)
    assert other.status_code == 409
    samples = await scrape(api)
    assert value(samples, "agent_store_turns_logged_total") == 3
    assert value(samples, "agent_store_messages_logged_total") == 3
    assert value(samples, "agent_store_turn_replays_total") == 1
    assert value(samples, "agent_store_conflicts_total") == 1
    assert value(samples, "agent_store_messages_truncated_total") == 1


async def test_metrics_count_storage_errors_by_kind(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unreachable() -> None:
        raise StorageUnavailable("could not reach the database: the database is unreachable")

    monkeypatch.setattr(api.store.conversations, "ping", unreachable)
    assert (await api.http.get("/ready")).status_code == 503
    assert (await api.http.get("/ready")).status_code == 503
    samples = await scrape(api)
    kind = "storage_unavailable"
    assert value(samples, "agent_store_storage_errors_total", kind=kind) == 2
    assert value(samples, "agent_store_storage_errors_total", kind="storage_failure") == 0
    probe = {"method": "GET", "route": "/ready", "status": "503"}
    assert value(samples, "agent_store_http_requests_total", **probe) == 2


async def test_a_storage_error_after_a_streamed_answer_started_is_counted_and_logged_as_one(
    api: Served, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The database goes away while an export is being sent: its status is out and the answer
    is cut, but the failure is the storage error it is, in the metrics and in the log."""

    async def gone(conversation_id: str) -> None:
        raise StorageUnavailable("could not read the transcript: the database is unreachable")

    after_its_first_batch(monkeypatch, api.store.conversations, gone)
    with (
        caplog.at_level(logging.INFO, logger="agent_store.api"),
        pytest.raises(Exception) as cut,  # noqa: PT011 - what the server raises to cut it
    ):
        await api.http.get(f"/v1/users/{OWNER}/export", headers=SERVICE)
    assert isinstance(cut.value.__cause__, StorageUnavailable)
    samples = await scrape(api)
    assert value(samples, "agent_store_storage_errors_total", kind="storage_unavailable") == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "agent_store.api"]
    route = f"GET /v1/users/{OWNER}/export"
    assert logged == [f"storage_unavailable on {route} after its answer started: it is cut"]


@pytest.mark.parametrize(
    ("exposure", "without_token", "with_token"),
    [("public", 200, 200), ("token", 401, 200), ("off", 404, 404)],
)
async def test_metrics_exposure_is_its_own_setting(
    exposure: str, without_token: int, with_token: int
) -> None:
    async with serve(mongomock_db(), api_settings(metrics=exposure), seeded=False) as api:
        assert (await api.http.get("/metrics")).status_code == without_token
        assert (await api.http.get("/metrics", headers=SERVICE)).status_code == with_token
