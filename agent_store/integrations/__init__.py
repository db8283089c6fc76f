"""Runtimes in and out: Pydantic AI runs and histories, streamed turns, replay-safe exports.

Built on the store, beside `agent_store.legacy`; neither imports the other.
Import the modules themselves: `agent_store.integrations.pydantic_ai` needs
the `pydantic-ai` extra.
"""
