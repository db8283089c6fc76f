"""A runtime's history store appends batches of messages; each append is one logged turn.

Runtime session interfaces (`Session.add_items`, `aadd_messages`) carry no turn
id, and the same messages may rightly be appended twice (a user who says
"thanks" twice). So a batch gets a fresh turn id, except after an append
raised (its outcome unknown): a runtime that runs again saves again what the
failed run saved, from its input on, the appends that succeeded included. Each
of those appends, repeated in order, is a retry: it reuses its turn id, and the
logger stores it at most once. The first append that repeats none of them ends
the retry.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence

from agent_store.core import AgentMessage
from agent_store.store import AgentMessageLogger, LoggedTurn

_NOT_COMPARED = {"created_at"}
RUN_APPENDS_KEPT = 256
"""How many appends of one run a retry recognises (a run saves a batch per step)."""


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
        self._run: list[tuple[str, str]] = []
        """(content digest, turn id) of the appends since the last one of a run's input (a
        batch that starts with a user or system message): what a run again would repeat."""
        self._retried: list[tuple[str, str]] = []
        """After an append raised: the appends a run again repeats, in order, not repeated
        yet."""

    def _turn_id(self, digest: str) -> str:
        for index, (done, turn_id) in enumerate(self._retried):
            if done == digest:
                del self._retried[: index + 1]
                return turn_id
        self._retried = []
        return f"{self._prefix}-{uuid.uuid4().hex}"

    def rewound(self) -> None:
        """The history lost its last messages (a pop): no append made so far is one the next
        append retries; the next append is a new turn. (A pop corrects the failed append's
        turn, whose retry is then a `Conflict`.)"""
        self._run, self._retried = [], []

    async def append(self, messages: Sequence[AgentMessage]) -> LoggedTurn:
        """Log `messages` as one turn (two round trips); after an append raised, the appends
        a run again repeats are recognised by their content and stored once."""
        digest = _digest(messages)
        turn_id = self._turn_id(digest)
        if messages and messages[0].role in ("user", "system"):
            self._run = []
        self._run = [*self._run[-(RUN_APPENDS_KEPT - 1) :], (digest, turn_id)]
        try:
            return await self.logger.log_messages(
                self.conversation_id, messages, user_id=self.user_id, turn_id=turn_id
            )
        except BaseException:
            self._retried = self._run + self._retried
            raise
