"""A runtime's history store appends batches of messages; each append is one logged turn.

Runtime session interfaces (`Session.add_items`, `aadd_messages`) carry no turn
id, and the same messages may rightly be appended twice (a user who says
"thanks" twice). So a batch gets a fresh turn id, except when it repeats an
append whose outcome is unknown (it raised): that is a retry, it reuses the
failed append's turn id, and the logger stores it at most once.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence

from agent_store.core import AgentMessage
from agent_store.store import AgentMessageLogger, LoggedTurn

_NOT_COMPARED = {"created_at"}


def _digest(messages: Sequence[AgentMessage]) -> str:
    canonical = json.dumps(
        [m.model_dump(mode="json", by_alias=True, exclude=_NOT_COMPARED) for m in messages],
        sort_keys=True,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


class Appends:
    """Logs appended batches as turns of one conversation, retry-safe within a process."""

    def __init__(
        self,
        logger: AgentMessageLogger,
        conversation_id: str,
        *,
        user_id: str | None,
        prefix: str,
    ) -> None:
        """Append to `conversation_id` as `user_id`; turn ids start with `prefix`."""
        self.logger = logger
        self.conversation_id = conversation_id
        self.user_id = user_id
        self._prefix = prefix
        self._unsettled: tuple[str, str] | None = None
        """The content digest and turn id of an append that raised."""

    def _turn_id(self, digest: str) -> str:
        if self._unsettled is not None and self._unsettled[0] == digest:
            return self._unsettled[1]
        return f"{self._prefix}-{uuid.uuid4().hex}"

    def rewound(self) -> None:
        """The history lost its last messages (a pop): an append that raised is no longer the
        one the next append retries; the next append is a new turn. (A pop corrects the
        failed append's turn, whose retry is then a `Conflict`.)"""
        self._unsettled = None

    async def append(self, messages: Sequence[AgentMessage]) -> LoggedTurn:
        """Log `messages` as one turn (two round trips); a retry of a failed append is
        recognised by its content and stored once."""
        digest = _digest(messages)
        turn_id = self._turn_id(digest)
        self._unsettled = (digest, turn_id)
        logged = await self.logger.log_messages(
            self.conversation_id, messages, user_id=self.user_id, turn_id=turn_id
        )
        self._unsettled = None
        return logged
