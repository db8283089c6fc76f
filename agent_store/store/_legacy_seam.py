"""What the read paths ask of legacy turn documents, without knowing their format.

`agent_store.legacy.LegacyTurns` implements `LegacySource` (and the logger's
`TurnObserver`, for the dual write); the store takes it as a constructor
argument, so the core paths never import the legacy reader, and a deployment
without legacy data passes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from agent_store.core import AgentMessage, Conflict, Conversation, InvalidInput

DERIVED_CONVERSATION_PREFIX = "legacy-conversation-"
"""How the migration names a conversation whose legacy id is not an identifier (a digest
of it follows)."""
DERIVED_TURN_PREFIX = "legacy-turn-"
"""How the migration names a conversation of one legacy turn that names none (its document
id, or a digest of it, follows)."""


MIGRATED_TURN_PREFIX = "legacy-"
"""How the migration names the turn of each legacy turn document it converts: no live turn
takes such an id, so the migration tells its own messages from a live turn's."""
DERIVED_USER_PREFIX = "legacy-user-"
"""How the migration names the owner of a conversation whose legacy `user_id` is no
identifier (a digest of it follows): `agent_store.legacy.derived_user_id`."""


def is_derived_id(conversation_id: str) -> bool:
    """Whether the id is one the migration derives: no other writer creates a conversation
    under it, since a digest cannot be traced back to the legacy turns it will name."""
    return conversation_id.startswith((DERIVED_CONVERSATION_PREFIX, DERIVED_TURN_PREFIX))


def refuse_derived_user(user_id: str, what: str = "user_id") -> str:
    """`user_id`, when it is no user the migration derives (`DERIVED_USER_PREFIX`); else
    InvalidInput. Such a user is named by a digest of a legacy id anyone may know (an
    email): no person is that user, so a person's identity (a user token's `sub`) naming
    one is refused, or knowing the legacy id would read its conversations. A service still
    names the user, to act for it until `claim` maps it to its real id."""
    if user_id.startswith(DERIVED_USER_PREFIX):
        raise InvalidInput(
            f"{what} {user_id!r}: ids starting with {DERIVED_USER_PREFIX!r} name users the "
            "migration derived from legacy user ids; no person is such a user"
        )
    return user_id


def not_migrated_yet(conversation_id: str, what: str = "written") -> Conflict:
    """The refusal of every change to a conversation that exists only as legacy turns (a
    turn, a rename, an answer to its prompt): they are read-only until the migration has
    run, which would undo, or lose, a change made to them here."""
    return Conflict(
        f"conversation {conversation_id!r} exists as legacy turns not migrated yet; it can "
        f"be {what} once `python -m migrations run` has migrated it"
    )


@dataclass(frozen=True)
class FallbackConversation:
    """A conversation not migrated yet, read from its legacy turns."""

    conversation: Conversation
    messages: list[AgentMessage]


@dataclass(frozen=True)
class LegacyHolder:
    """A conversation id that exists as legacy turns, and the user those name (the owner)."""

    user_id: str | None


class LegacySource(Protocol):
    """Legacy turns as the write path, the read paths and the admin operations see them."""

    read_fallback: bool
    """Serve conversations not migrated yet from their legacy turns."""

    async def conversation(
        self, conversation_id: str, *, user_id: str | None = None
    ) -> FallbackConversation | None:
        """The conversation converted from its legacy turns; None if it has none, or if
        `user_id` is given and does not own it (told before anything is converted)."""
        ...

    async def holder(
        self, conversation_id: str, *, user_id: str | None = None
    ) -> LegacyHolder | None:
        """Whether the id exists as legacy turns to `user_id` (None: a service), and their
        owner; None if it does not. A live conversation's dual-written copies under the id
        are legacy turns to its owner only."""
        ...

    async def delete(self, conversation_id: str, *, owner: str | None) -> int:
        """Delete `owner`'s part of the conversation's legacy turns and prompts: the legacy
        conversation whole when `owner` owns it, else only what names `owner`, and the late
        legacy turns under the id not moved aside yet that are `owner`'s part of it; how
        many turns went."""
        ...

    async def delete_dual_writes(
        self,
        conversation_id: str,
        *,
        owner: str | None,
        legacy_id: str | None = None,
        legacy_user_id: str | None = None,
    ) -> int:
        """Delete the turns dual-written under the conversation for `owner` (the delete's
        last step: a dual write that landed while it ran); how many went. `legacy_id` is its
        document's `legacy_conversation_id`: the id the dual write names a conversation
        stored under a derived id by; `legacy_user_id` its document's, the id it names a
        derived owner by."""
        ...

    async def prompt_resolved(self, conversation_id: str, request_id: str) -> None:
        """A person answered the prompt `request_id` (`resolve_hitl`): with the dual write on,
        record it where the legacy format keeps the prompt, so a rollback does not ask it
        again and a second attempt keeps it resolved."""
        ...

    async def erase_user(self, user_id: str) -> int:
        """Delete every legacy conversation the user owns, and every legacy turn and prompt
        naming the user; how many turns went."""
        ...

    async def claim(self, from_user_id: str, to_user_id: str, *, kept: Sequence[str] = ()) -> int:
        """Move the user's legacy turns and prompts to another user id but those of the
        conversations `kept` (a claim leaves them, whole, to the user: a delete marked them);
        how many turns moved."""
        ...
