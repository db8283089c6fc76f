"""The documents a deployment shows without a token: probes, `/openapi.json`, `/docs`."""

from __future__ import annotations

import re

import pytest

from tests.api_harness import api_settings, mongomock_db, serve


async def test_probes_answer_without_a_token_with_up_or_down_only() -> None:
    async with serve(mongomock_db()) as api:
        health = await api.http.get("/health")
        ready = await api.http.get("/ready")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert (ready.status_code, ready.json()) == (200, {"status": "ready", "database": "reachable"})


async def test_the_api_page_loads_only_this_sites_files() -> None:
    async with serve(mongomock_db(), seeded=False) as api:
        page = await api.http.get("/docs")
        assert page.status_code == 200
        assert "script-src 'self'" in page.headers["content-security-policy"]
        sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert sources
        assert all(source.startswith("/docs/static/") for source in sources), sources
        for source in sources:
            asset = await api.http.get(source)
            assert asset.status_code == 200, source
            assert len(asset.content) > 100
        schema = await api.http.get("/openapi.json")
        assert schema.status_code == 200
        assert schema.json()["openapi"] == "3.1.0"
        assert (await api.http.get("/docs/static/../settings.py")).status_code == 404
        assert (await api.http.get("/docs/static/index.j2")).status_code == 404


@pytest.mark.parametrize(
    ("switches", "openapi", "docs"),
    [
        pytest.param({}, 200, 200, id="both-by-default"),
        pytest.param({"expose_docs": False}, 200, 404, id="no-docs"),
        pytest.param({"expose_docs": False, "expose_openapi": False}, 404, 404, id="neither"),
    ],
)
async def test_each_document_can_be_switched_off(
    switches: dict[str, bool], openapi: int, docs: int
) -> None:
    async with serve(mongomock_db(), api_settings(**switches), seeded=False) as api:
        assert (await api.http.get("/openapi.json")).status_code == openapi
        assert (await api.http.get("/docs")).status_code == docs
