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
MONGODB_MAX_DOCUMENT_BYTES = 16 * 1024 * 1024
"""The largest document MongoDB stores (its `maxBsonObjectSize`): it refuses the insert of
a larger one."""
MAX_MESSAGE_BYTES = MONGODB_MAX_DOCUMENT_BYTES - 64 * 1024
"""The largest `max_message_bytes`: a message cut to it is stored with what the store adds
to it past the bound (`seq`, `user_id`, `epoch`, blob ids naming the epoch: under 1 KiB)
well within MongoDB's 16 MiB."""


class TurnSettings(BaseModel):
    """The settings a `TurnRules` is made of, checked as a service's start checks them."""

    # Each field's docstring is its description in docs/CONFIGURATION.md.
    model_config = ConfigDict(use_attribute_docstrings=True, hide_input_in_errors=True)

    max_message_bytes: int = Field(
        default=DEFAULT_MAX_MESSAGE_BYTES, ge=MIN_MESSAGE_BYTES, le=MAX_MESSAGE_BYTES
    )
    """A stored message is cut to this size; the whole text of a cut field is kept in GridFS.
    Under 4096 bytes stops the start: a message's envelope and the truncation mark would
    leave little or no text of any message. Over 16711680 (16 MiB less 64 KiB, room for
    what the store adds to a message) stops it too: MongoDB refuses documents over 16 MiB."""
    runtime_context_start: str = "[RUNTIME CONTEXT]"
    """Where runtime context injected into a user message starts: what the markers enclose
    is removed from the stored message, so it is left out of names, previews and search. One
    empty or of white space alone stops the start (it would cut every user message), as
    does setting one marker to a value of its own without the other: a start marker whose
    end never comes hides the rest of the text (one set alone to its default is accepted)."""
    runtime_context_end: str = "[/RUNTIME CONTEXT]"
    """Where that runtime context ends (empty or white space alone stops the start, as does
    the start marker's text, one holding the other, or one set to a value of its own without
    the other)."""
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

    @model_validator(mode="after")
    def _markers_set_together(self) -> TurnSettings:
        # One custom marker beside the other's default is a slip no runtime makes: its end
        # never comes (the block hides the rest of every user message), or its start never.
        # A marker set alone to its default value leaves the defaults' pair: it is accepted.
        given = {"runtime_context_start", "runtime_context_end"} & self.model_fields_set
        custom = {name for name in given if getattr(self, name) != _default(name)}
        if len(given) == 1 and custom:
            raise ValueError(
                f"runtime_context_start and runtime_context_end: only {custom.pop()} is set; "
                "set AGENT_STORE_RUNTIME_CONTEXT_START and AGENT_STORE_RUNTIME_CONTEXT_END "
                "together (the markers your runtime wraps its context in), or neither"
            )
        return self

    def turn_rules(self) -> TurnRules:
        """The rules turns are stored, named and cut by."""
        return TurnRules(
            markers=RuntimeContextMarkers(self.runtime_context_start, self.runtime_context_end),
            max_message_bytes=self.max_message_bytes,
            name_chars=self.name_chars,
        )


def _default(field: str) -> object:
    """A setting's default value."""
    return TurnSettings.model_fields[field].default
