"""The embedded default: with no MONGODB_URI, the service runs on a local wire server."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.service import open_store
from app.settings import Settings

pytestmark = pytest.mark.wire


async def test_embedded_server_keeps_data_across_restarts(tmp_path: Path) -> None:
    settings = Settings(mongodb_uri=None, data_dir=tmp_path)
    async with open_store(settings) as store:
        await store.logger.log_messages("persisted", [{"role": "user", "content": "remember me"}])
    assert (tmp_path / "agent_store.sqlite3").exists()

    async with open_store(settings) as store:
        transcript = await store.conversations.transcript("persisted")

    assert [m.content for m in transcript] == ["remember me"]
