"""LangGraph's own checkpointer conformance suite, run through its `validate()` on every backend.

The report is asserted capability by capability, so a failure names the capability and the
suite's own failing tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import (
    BASE_CAPABILITIES,
    EXTENDED_CAPABILITIES,
)

from agent_store.integrations.langgraph import AgentStoreSaver
from tests.conftest import Backend


async def test_the_saver_passes_every_base_and_extended_capability(backend: Backend) -> None:
    @checkpointer_test(name=f"AgentStoreSaver on {backend.name}")
    async def saver() -> AsyncIterator[AgentStoreSaver]:
        yield AgentStoreSaver(backend.db)

    report = await validate(saver)
    outcome = {
        name: (result.detected, result.passed, result.failures)
        for name, result in report.results.items()
    }
    expected = {
        capability.value: (True, True, [])
        for capability in BASE_CAPABILITIES | EXTENDED_CAPABILITIES
    }
    assert outcome == expected
    assert report.conformance_level() == "FULL"
