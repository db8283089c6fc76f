"""The HTTP service and the viewer of the conversation store (`python -m app`).

Built on the `agent_store` library; the library never imports this package.
"""
