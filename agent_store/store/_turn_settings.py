"""The settings of how turns are stored, one definition for every edge that reads them.

The service (`app.settings.Settings`) and the migration (`python -m migrations`) read them
from the same environment variables (`AGENT_STORE_…`); the library itself reads none. One
definition keeps the two from drifting: the migration converts legacy turns, and `verify`
and `finish` compare them, by the very rules the service logs and serves them with.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agent_store.store._text import MAX_NAME_CHARS, RuntimeContextMarkers, refuse_blank_marker
from agent_store.store._truncation import DEFAULT_MAX_MESSAGE_BYTES
from agent_store.store._turns import TurnRules

MIN_MESSAGE_BYTES = 4096
"""The smallest `max_message_bytes`: below it a message's envelope and the truncation mark
leave little or none of its text."""


class TurnSettings(BaseModel):
    """The settings a `TurnRules` is made of, checked as a service's start checks them."""

    # Each field's docstring is its description in docs/CONFIGURATION.md.
    model_config = ConfigDict(use_attribute_docstrings=True, hide_input_in_errors=True)

    max_message_bytes: int = Field(default=DEFAULT_MAX_MESSAGE_BYTES, ge=MIN_MESSAGE_BYTES)
    """A stored message is cut to this size; the whole text of a cut field is kept in GridFS.
    Under 4096 bytes stops the start: a message's envelope and the truncation mark would
    leave little or no text of any message."""
    runtime_context_start: str = "[RUNTIME CONTEXT]"
    """Where runtime context injected into a user message starts: what the markers enclose
    is removed from the stored message, so it is left out of names, previews and search. One
    empty or of white space alone stops the start (it would cut every user message)."""
    runtime_context_end: str = "[/RUNTIME CONTEXT]"
    """Where that runtime context ends (empty or white space alone stops the start, as does
    the start marker's text, or one holding the other)."""
    name_chars: int = Field(default=60, ge=2, le=MAX_NAME_CHARS)
    """The longest automatic conversation name, ellipsis included (a name holds at most 200)."""

    @field_validator("runtime_context_start", "runtime_context_end")
    @classmethod
    def _usable_marker(cls, marker: str) -> str:
        # The library's rule (RuntimeContextMarkers), for this marker alone: the refusal names it.
        refuse_blank_marker(marker)
        return marker

    @model_validator(mode="after")
    def _markers_told_apart(self) -> TurnSettings:
        try:
            RuntimeContextMarkers(self.runtime_context_start, self.runtime_context_end)
        except ValueError as refused:
            raise ValueError(f"runtime_context_start and runtime_context_end: {refused}") from None
        return self

    def turn_rules(self) -> TurnRules:
        """The rules turns are stored, named and cut by."""
        return TurnRules(
            markers=RuntimeContextMarkers(self.runtime_context_start, self.runtime_context_end),
            max_message_bytes=self.max_message_bytes,
            name_chars=self.name_chars,
        )
