"""A runtime's history store appends batches of messages; each append is one logged turn.

Runtime session interfaces (`Session.add_items`, `aadd_messages`) carry no turn
id, and the same messages may rightly be appended twice (a user who says
"thanks" twice). So a batch gets a fresh turn id, except after an append
raised (its outcome unknown): a runtime that runs again saves again what the
failed run saved, from its input on, the appends that succeeded included. Each
of those appends, repeated in order, is a retry: it reuses its turn id, and the
logger stores it at most once. The append at the place of the one that raised
(every append before it repeated, and the same input: its first user or system
messages the same, and its results answering the same calls of earlier appends)
reuses that turn id even with other content (the model words its answer
otherwise, the tool run again answers otherwise): the logger then gives back the
block the lost attempt reserved and stored nothing in, or refuses the append
(Conflict, saying the history holds what that attempt stored) when that attempt
was stored. The first other append that repeats none of them ends the retry: one
answering other calls (another paused call resumed) is no retry of the failed
one. An append the logger refused (InvalidInput, Conflict: nothing written) is
no outcome in doubt: it is not retried.

Runs that share one history object are told apart by the asyncio task that
appends (`adder`): each failed run is remembered with its task, several at once,
and only that task's appends retry it or end its retry. A run again in a task
of its own (`Runner.run_streamed` runs each run in a new task) takes over the
retry of a failed run whose task has ended, with its first append: a task that
appended anything before takes over no other run's retry.

A pop (`popped`) removes a message: what it invalidates is the appends of that
message's turn, whose retry the logger refuses (`Conflict`). Those are
forgotten, wherever remembered, and repeated they are stored anew; nothing else
is: another run's retry still holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace

from agent_store.core import AgentMessage, Conflict, InvalidInput
from agent_store.integrations._answering import log_answering
from agent_store.store import AgentMessageLogger, LoggedTurn, OtherContent

_NOT_COMPARED = {"created_at"}
RUN_APPENDS_KEPT = 256
"""How many appends of one run a retry recognises (a run saves a batch per step)."""
RETRIES_KEPT = 64
"""How many failed runs one history object remembers at once, not retried yet (the oldest
are forgotten: a retry of one appends anew)."""


class Adder:
    """Who appends, as far as this process can tell: one asyncio task, or one thread outside
    an event loop."""

    __slots__ = ("__weakref__", "_owner")

    def __init__(self, owner: asyncio.Task[object] | threading.Thread) -> None:
        self._owner = weakref.ref(owner)

    def owned_by(self, owner: object) -> bool:
        return self._owner() is owner

    @property
    def running(self) -> bool:
        """Whether its task (or thread) may still append: not done, not gone."""
        owner = self._owner()
        if isinstance(owner, threading.Thread):
            return owner.is_alive()
        return owner is not None and not owner.done()


_ADDER: ContextVar[Adder | None] = ContextVar("agent_store_adder", default=None)
"""The `Adder` of the calling task, set at its first append. Unlike a pop's caller, a task
does not pass it to the tasks it starts (two runs gathered by one task are two adders); code
a task runs in a thread (`asyncio.to_thread`, after `adder()`) appends as that task."""


def adder() -> Adder:
    """The calling task's `Adder` (the thread's outside an event loop), made now if new."""
    try:
        task: asyncio.Task[object] | None = asyncio.current_task()
    except RuntimeError:  # no event loop: a thread, maybe running a task's code
        task = None
    held = _ADDER.get()
    if held is not None and (task is None or held.owned_by(task)):
        return held
    made = Adder(task or threading.current_thread())
    _ADDER.set(made)
    return made


@dataclass(frozen=True)
class _Done:
    """An append remembered."""

    digest: str
    """Its content's."""
    turn_id: str | None
    """None once a pop removed a message of its turn: repeated, it is a new turn."""
    opening: str
    """The digest of its first user or system messages (its input), "" for none."""
    answers: frozenset[str] = frozenset()
    """The calls its results answer that it does not make itself (an earlier append's): with
    `opening`, what it answers, which its retry answers again whatever the content."""
    raised: bool = False
    """It raised, its outcome unknown: an append at its place retries it, whatever its
    content."""


@dataclass
class _Retry:
    """A run whose append raised: the appends a run again repeats, in order, not repeated
    yet, and who retries them."""

    adder: Adder
    appends: list[_Done]


def _opening(messages: Sequence[AgentMessage]) -> str:
    """The digest of the first messages while they are user or system ones ("" for none)."""
    count = next((i for i, m in enumerate(messages) if m.role not in ("user", "system")), None)
    opening = messages[: len(messages) if count is None else count]
    return _digest(opening) if opening else ""


def _answers(messages: Sequence[AgentMessage]) -> frozenset[str]:
    """The calls the results among `messages` answer that no message before them makes: an
    earlier append's calls (a call made and answered in one append is the model's step, whose
    call ids a run again may draw otherwise)."""
    made: set[str] = set()
    answered: set[str] = set()
    for message in messages:
        if message.role == "tool" and message.tool_call_id and message.tool_call_id not in made:
            answered.add(message.tool_call_id)
        made.update(call.id for call in message.tool_calls or ())
    return frozenset(answered)


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
        """Append to `conversation_id` as a runtime acting for `user_id` (`strict_owner`: that
        user's own conversation or a new id, never an unowned one adopted); turn ids start
        with `prefix`."""
        self.logger = logger
        self.conversation_id = conversation_id
        self.user_id = user_id
        self._prefix = prefix
        self._runs: weakref.WeakKeyDictionary[Adder, list[_Done]] = weakref.WeakKeyDictionary()
        """By adder, its appends since its last one of a run's input (a batch that starts
        with a user or system message): what a run again would repeat. Every adder that
        appended has one, so takes over no other run's retry."""
        self._retries: list[_Retry] = []
        """The runs whose append raised, oldest first, at most one per adder."""

    def _retry_of(self, by: Adder, done: _Done) -> _Retry | None:
        """The failed run `by` retries: its own, else, when this is `by`'s first append, the
        oldest whose task has ended and whose appends hold `done`'s content, or whose next
        append is one that raised with `done`'s input (not none: `_at_place`), which `by`
        takes over (a task that appended anything else first is another run, whose appends
        may repeat a failed run's: a provider numbering its calls per response)."""
        for retry in self._retries:
            if retry.adder is by:
                return retry
        if by in self._runs:
            return None
        for retry in self._retries:
            held = any(d.digest == done.digest for d in retry.appends)
            if not retry.adder.running and (held or (done.opening and _at_place(retry, done))):
                retry.adder = by
                return retry
        return None

    def _turn_id(self, by: Adder, done: _Done) -> tuple[str, bool]:
        """The turn id of the append `done` (its own not drawn yet): the one of the append
        it repeats in `by`'s retry, or of the one that raised at its place; else a new one.
        And whether it retries that one with other content (at its place)."""
        retry = self._retry_of(by, done)
        if retry is not None:
            index = next(
                (i for i, d in enumerate(retry.appends) if d.digest == done.digest),
                0 if _at_place(retry, done) else None,
            )
            if index is not None:
                retried = retry.appends[index]
                del retry.appends[: index + 1]
                if not retry.appends:
                    self._retries.remove(retry)
                otherwise = retried.digest != done.digest and retried.turn_id is not None
                return retried.turn_id or self._new_turn_id(), otherwise
            self._retries.remove(retry)
        return self._new_turn_id(), False

    def _new_turn_id(self) -> str:
        return f"{self._prefix}-{uuid.uuid4().hex}"

    def _failed(self, by: Adder, run: list[_Done], *, refused: bool) -> None:
        """Remember `by`'s run for its retry, before what its earlier retry left to repeat: its
        last append raised (`_Done.raised`), or, `refused`, is left out (nothing written)."""
        run = run[:-1] if refused else [*run[:-1], replace(run[-1], raised=True)]
        if not run:
            return
        for retry in self._retries:
            if retry.adder is by:
                retry.appends[:0] = run
                return
        self._retries.append(_Retry(by, list(run)))
        del self._retries[:-RETRIES_KEPT]

    def popped(self, message: AgentMessage) -> None:
        """A pop removed `message`: the appends of its turn, whose retry the logger refuses
        (`Conflict`: the pop corrected the turn), are forgotten wherever remembered, each run's
        and each failed run's alike. Repeated in a retry, such an append is stored anew as a
        new turn, and the retry goes on; every other append is remembered as it was."""
        if message.turn_id is None:
            return
        for appends in (*self._runs.values(), *(retry.appends for retry in self._retries)):
            appends[:] = [
                replace(done, turn_id=None) if done.turn_id == message.turn_id else done
                for done in appends
            ]

    async def append(
        self, messages: Sequence[AgentMessage], *, tool_names: Mapping[str, str] | None = None
    ) -> LoggedTurn:
        """Log `messages` as one turn (two round trips); after an append raised, the appends
        a run again repeats are recognised by their content and stored once, and the append
        at the place of the one that raised is its retry (`_at_place`). An append answering
        a call of an earlier turn names it (`AgentMessageLogger.calls_answered`, one read
        more, only then): answered first by another append (another tab), it is refused
        `AnsweredBefore`, nothing written, but for a denial meeting a stored denial, dropped
        as settled (`log_answering`; the SDK's and LangChain's messages carry none: a
        rejection is an output to them). A result whose tool the runtime says (`tool_names`,
        call id to tool) answers the latest call of its id of that tool; one whose id only
        another tool's calls use is InvalidInput. The retry at the place of an append that
        was stored, its reply lost, is refused `OtherContent` saying so (`_stored_otherwise`)."""
        by = adder()
        done = _Done(_digest(messages), None, _opening(messages), _answers(messages))
        turn_id, otherwise = self._turn_id(by, done)
        run = [] if messages and messages[0].role in ("user", "system") else self._runs.get(by, [])
        run = self._runs[by] = [*run[-(RUN_APPENDS_KEPT - 1) :], replace(done, turn_id=turn_id)]
        try:
            return await log_answering(
                self.logger,
                self.conversation_id,
                messages,
                turn_id=turn_id,
                user_id=self.user_id,
                tool_names=tool_names,
            )
        except BaseException as exc:
            self._failed(by, run, refused=isinstance(exc, InvalidInput | Conflict))
            if otherwise and isinstance(exc, OtherContent):
                raise _stored_otherwise(turn_id) from exc
            raise


def _at_place(retry: _Retry, done: _Done) -> bool:
    """Whether the append `done` is at the place of one that raised: the retry has repeated
    every append before that one, and `done` has its input: it opens with the same user or
    system messages (none for a model's step or a tool's result), and its results answer the
    same calls of earlier appends (none for a model's step alone). Its content may differ
    (the model worded its answer otherwise, the tool answered otherwise): it retries that
    append, under its turn id. An append answering other calls (another paused call
    resumed by the same task) is none."""
    if not retry.appends or not retry.appends[0].raised:
        return False
    failed = retry.appends[0]
    return failed.opening == done.opening and failed.answers == done.answers


def _stored_otherwise(turn_id: str) -> OtherContent:
    """The refusal of an append at the place of one that raised (`_at_place`) whose attempt
    was stored with other content, its reply lost: the history holds that attempt's."""
    return OtherContent(
        f"this add retries the add that raised before it at its place (turn {turn_id!r}: "
        "the same input, answering the same calls), which was stored with other content, "
        "its reply lost; nothing of this add was written. The history holds what the first "
        "add stored: read it and go on from there (the same add again is a new turn)"
    )
