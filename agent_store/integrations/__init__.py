"""Runtimes in and out: Pydantic AI runs and histories, Agents SDK sessions, LangChain chat
history, streamed turns, replay-safe exports.

Built on the store, beside `agent_store.legacy`; neither imports the other.
Import the modules themselves; each needs its runtime's extra:
`agent_store.integrations.pydantic_ai` (`pydantic-ai`),
`agent_store.integrations.openai_agents` (`openai-agents`),
`agent_store.integrations.langchain` (`langchain`).
"""
