"""A runtime's turn answering calls of earlier turns, logged by a bridge.

A call's first answer is its answer: the logger refuses a turn answering a call another turn
answered first (`AnsweredBefore`, nothing written). A runtime resuming from a read older than
the person's answer (another tab, the viewer) may agree with her: it denies a call she denied.
Its denial then answers nothing her denial did not settle, so it is dropped and the turn is
logged without it (`log_answering`), as `log_streamed_turn` drops a stream's refusal of a call
answered first (`without_denials`): the results of the tools that ran are stored. Any other
answer meeting a first answer (a result meeting a denial, a denial meeting a result, a result
meeting a result) stays refused: the two disagree, or the tool ran twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from agent_store.core import (
    AgentMessage,
    AnsweredBefore,
    AssistantMessage,
    DenialTakenBack,
    ToolMessage,
    tool_outcome,
)
from agent_store.store import AgentMessageLogger, LoggedTurn, validate_identifier

_JUDGED_AGAIN = 3
"""How many times a turn whose settled denial was taken back before it was logged without
it (`DenialTakenBack`) is judged again before its refusal is raised."""

AnyMessage = AgentMessage | Mapping[str, Any]
"""A message as `AgentMessageLogger.log_messages` takes it: a model, or its fields."""


async def log_answering(
    logger: AgentMessageLogger,
    conversation_id: str,
    messages: Sequence[AgentMessage],
    *,
    turn_id: str,
    user_id: str | None,
    name: str | None = None,
    tool_names: Mapping[str, str] | None = None,
) -> LoggedTurn:
    """Log a bridge's turn as a runtime acting for `user_id` (`strict_owner` when named),
    naming the calls of earlier turns it answers (`AgentMessageLogger.calls_answered`).

    Refused `AnsweredBefore`, the turn's denials of calls whose stored answer is a denial
    (`AgentMessageLogger.calls_denied_first`, read only then) are dropped as settled, and
    the turn is logged without them when those were all the calls refused; otherwise the
    refusal is raised, nothing written. A turn that held nothing but such denials stores no
    message. The turn returned holds no message for a dropped call: the only sign its denial
    was settled before. Its retry, refused the same way, is the replay of that turn. The turn
    without them is logged only while each dropped call is still answered (`denied_first`,
    in its reservation's command): a denial taken back (popped) since it was read leaves the
    call pending, and the turn is judged again from the start, its denial then the call's
    first answer; at most `_JUDGED_AGAIN` times, then the refusal is raised."""
    strict_owner = user_id is not None
    answers_to = await logger.calls_answered(
        conversation_id, messages, user_id=user_id, tool_names=tool_names, strict_owner=strict_owner
    )

    async def logged(
        kept: Sequence[AnyMessage], named: Mapping[str, str], settled: Mapping[str, str]
    ) -> LoggedTurn:
        return await logger.log_messages(
            conversation_id,
            kept,
            user_id=user_id,
            turn_id=turn_id,
            name=name,
            answers_to=dict(named),
            strict_owner=strict_owner,
            denied_first=dict(settled),
        )

    for rounds in range(_JUDGED_AGAIN + 1):
        try:
            return await logged(messages, answers_to, {})
        except AnsweredBefore as refused:
            refused_calls = {c: answers_to[c] for c in refused.tool_call_ids if c in answers_to}
            settled = await logger.calls_denied_first(
                conversation_id, refused_calls, user_id=user_id, strict_owner=strict_owner
            )
            kept = without_denials(messages, settled)
            if rounds == _JUDGED_AGAIN or not _each_dropped(refused, messages, kept):
                raise
        if not kept:
            return nothing_logged(conversation_id, turn_id)
        named = {c: m for c, m in answers_to.items() if c not in settled}
        with contextlib.suppress(DenialTakenBack):  # judged again: the call is pending
            return await logged(kept, named, {c: answers_to[c] for c in settled})
    raise AssertionError("unreachable")  # pragma: no cover


def without_denials(messages: Sequence[AnyMessage], call_ids: Collection[str]) -> list[AnyMessage]:
    """`messages` without their denials (`tool call denied`: a refused confirmation's
    stand-in, a run's `ToolDenied`) of the calls `call_ids` of earlier turns."""
    made = {c.id for m in messages if isinstance(m, AssistantMessage) for c in m.tool_calls or ()}

    def dropped(message: AnyMessage) -> bool:
        if not isinstance(message, ToolMessage) or message.tool_call_id in made:
            return False
        outcome = tool_outcome(message)
        denied = outcome is not None and outcome[0] == "denied"
        return denied and message.tool_call_id in call_ids

    return [m for m in messages if not dropped(m)]


def _each_dropped(
    refused: AnsweredBefore, messages: Sequence[AnyMessage], kept: Sequence[AnyMessage]
) -> bool:
    """Whether `without_denials` dropped from `messages`, leaving `kept`, the denial of each
    call `refused` names: the turn is refused for nothing else."""
    left = {id(m) for m in kept}
    return set(refused.tool_call_ids) <= {
        m.tool_call_id
        for m in messages
        if isinstance(m, ToolMessage) and id(m) not in left and m.tool_call_id
    }


def nothing_logged(conversation_id: str, turn_id: str) -> LoggedTurn:
    """The turn of a bridge or a stream that holds no message to store: every message was a
    denial answering nothing a first answer did not settle (dropped: `without_denials`), or
    a stream only resolved prompts. Nothing stored, so nothing records the turn either: its
    retry is judged on the conversation as it is then, the same no-op while that first
    answer stands."""
    return LoggedTurn(
        conversation_id=validate_identifier(conversation_id, "conversation_id"),
        turn_id=validate_identifier(turn_id, "turn_id"),
        messages=[],
        replayed=False,
    )
