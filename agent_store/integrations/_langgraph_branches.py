"""A LangGraph branch that leaves its conversation's transcript: which messages it logs again.

LangGraph's time travel (a fork of an older checkpoint with `update_state`, a
replay from one) goes on from messages the transcript has already gone past.
The transcript is one line, and a tool message answers the latest earlier call
of its id that has no answer yet: a call the branch leaves open, which the
abandoned branch answered further on, would keep the abandoned answer in every
replay, and would not be pending while the graph awaits it. So the branch's
messages from its first such call on are logged again, as copies at the
transcript's tail: the copy is the call the new answer goes to. The other way
round, a call the transcript leaves open that the branch does not hold (time
travel past a pause, the call removed) is closed by an `interrupted` stand-in
(`abandoned_calls`): no later turn of the thread can answer it. A branch holds
the calls of its stored messages, and those of an edit it holds inline that
keeps its message's calls as they are (`keeps_calls`: the text redacted, a call
dropped); an edit making a call its message does not make as it is (other
arguments, a new call id) is logged, with the branch's stored messages after it
(`logged_before_stored`), so the call the graph runs is the one its answer
pairs with. Pure: the saver's transcript link does the reading and the logging.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from langchain_core.messages import AIMessage, BaseMessage, ToolCall, ToolMessage

OpenCall = tuple[int, str]
"""A call a branch leaves unanswered: the index of the message that makes it, and its id."""


def open_calls(
    messages: Sequence[BaseMessage], *, start: int = 0, before: Sequence[OpenCall] = ()
) -> tuple[OpenCall, ...]:
    """The calls `messages` leave unanswered, from those `messages[:start]` leave (`before`).

    A tool message answers the latest open call of its id, as in the transcript.
    """
    still = list(before)
    for index in range(start, len(messages)):
        message = messages[index]
        if isinstance(message, AIMessage):
            still.extend((index, str(call["id"])) for call in message.tool_calls if call["id"])
        elif isinstance(message, ToolMessage):
            answered = [at for at, (_, made) in enumerate(still) if made == message.tool_call_id]
            if answered:
                del still[answered[-1]]
    return tuple(still)


def left_behind(messages: Sequence[BaseMessage]) -> frozenset[OpenCall]:
    """The calls the messages went on without: left open, and followed by a message other
    than a tool result (a person asked something else while the graph was paused on it). The
    graph awaits nothing for such a call and no step of it answers it: an answer given to it
    outside the graph further on (a denial over HTTP, a late result) is the call's own, not
    another branch's, and no reason to log the branch again (`logged_again_from`)."""
    went_on = [i for i, m in enumerate(messages) if not isinstance(m, ToolMessage)]
    last = went_on[-1] if went_on else -1
    return frozenset((index, call) for index, call in open_calls(messages) if index < last)


def made_calls(messages: Sequence[BaseMessage]) -> tuple[OpenCall, ...]:
    """Every call the messages make, answered or not."""
    return tuple(
        (index, str(call["id"]))
        for index, message in enumerate(messages)
        if isinstance(message, AIMessage)
        for call in message.tool_calls
        if call["id"]
    )


def keeps_calls(original: BaseMessage, edit: BaseMessage) -> bool:
    """Whether an edit of a stored message makes only calls the original makes as they are
    (same id, name and arguments): its text redacted, a call dropped, or no call at all."""
    kept = _calls(original)
    return all(call in kept for call in _calls(edit))


def seats(
    places: Sequence[object], transcript: Mapping[int, BaseMessage], end: int
) -> list[int | None]:
    """Where the calls of each of the branch's messages stand in the transcript (before `end`):
    a stored message's own `seq`; for an edit held inline (its calls kept, `keeps_calls`), the
    `seq` of the stored message of its id, whose calls it holds; None for any other (to be
    logged, or held with no stored message of its id).

    `places` says where each of the branch's messages lives: a transcript `seq`, a message
    held by the checkpoint, or another object (a message to log).
    """
    by_id: dict[str, int] = {}
    for seq in range(end):
        stored = transcript.get(seq)
        if stored is not None and stored.id is not None:
            by_id[stored.id] = seq
    return [
        place if isinstance(place, int) else _seat(place, by_id, transcript) for place in places
    ]


def logged_again_from(
    places: Sequence[object],
    calls: Sequence[OpenCall],
    transcript: Mapping[int, BaseMessage],
    end: int,
    *,
    left: Collection[OpenCall] = (),
    outside: Collection[int] = (),
) -> int | None:
    """The index of the branch's first message to log again: its first call (of `calls`) that
    a stored message further on in the transcript (before `end`), not one of the branch's own,
    answers or makes again (another branch's answer, or its copy of the call); None if none is.
    For a call the branch went on without (`left`, `left_behind`), only a message the graph
    logged counts: one logged outside it (`outside`: the `seq`s of a person's answer over
    HTTP, a runtime's late result) is the call's own answer.

    `places` says where each of the branch's messages lives (`seats`).
    """
    seated = seats(places, transcript, end)
    own = {seq for seq in seated if seq is not None}
    for index, call_id in sorted(calls):
        seq = seated[index]
        its_own = outside if (index, call_id) in left else ()
        if seq is not None and any(
            _touches(transcript.get(later), call_id)
            for later in range(seq + 1, end)
            if later not in own and later not in its_own
        ):
            return index
    return None


def logged_before_stored(messages: Sequence[BaseMessage], places: Sequence[object]) -> int | None:
    """The index of the branch's first message to be logged (`places`: neither a `seq` nor
    held inline) that makes a call, when a stored message of the branch follows it (an edit
    of a call the branch went on from, say); None if none is. Logged at the transcript's
    tail, the call would follow the stored messages after it: they are logged again after it,
    so its answers pair with it."""
    last_stored = max((i for i, place in enumerate(places) if isinstance(place, int)), default=0)
    for index in range(last_stored):
        made, logged = messages[index], not isinstance(places[index], int | BaseMessage)
        if logged and isinstance(made, AIMessage) and made.tool_calls:
            return index
    return None


def abandoned_calls(
    places: Sequence[object], transcript: Mapping[int, BaseMessage], end: int
) -> list[str]:
    """The ids of the calls the transcript (before `end`) leaves open that the branch does not
    hold (`places`, as in `seats`), one per call: the calls its time travel, or a message it
    removed or edited away, abandoned. A stand-in answering one answers the latest open call
    of its id, so a call is listed only when every open call of its id after it is abandoned
    too.
    """
    seated = seats(places, transcript, end)
    held = {
        (seq, str(call["id"]))
        for seq, place in zip(seated, places, strict=True)
        if seq is not None
        for call in _calls_made(place, transcript.get(seq))
    }
    seqs = [seq for seq in range(end) if seq in transcript]
    abandoned: dict[str, list[bool]] = {}
    for index, call_id in open_calls([transcript[seq] for seq in seqs]):
        abandoned.setdefault(call_id, []).append((seqs[index], call_id) not in held)
    closed: list[str] = []
    for call_id, left in abandoned.items():
        for gone in reversed(left):
            if not gone:
                break
            closed.append(call_id)
    return closed


def already_at_tail(
    messages: Sequence[BaseMessage],
    places: Sequence[object],
    start: int,
    copies: Sequence[object],
    transcript: Mapping[int, BaseMessage],
    end: int,
) -> list[int] | None:
    """The `seq`s of `messages[start:]` logged again (`copies`: the places they get, those
    the checkpoint holds left out) when they are the transcript's last messages, after the
    place they were copied from (`places[start]`): a put retried after its copies were logged
    refers to them. None otherwise."""
    logged = [start + i for i, copy in enumerate(copies) if not isinstance(copy, BaseMessage)]
    seqs = list(range(end - len(logged), end))
    origin = places[start]
    if not seqs or (isinstance(origin, int) and seqs[0] <= origin):
        return None
    if all(transcript.get(seq) == messages[i] for seq, i in zip(seqs, logged, strict=True)):
        return seqs
    return None


def _touches(message: BaseMessage | None, call_id: str) -> bool:
    """Whether a message answers the call `call_id` or makes a call of that id."""
    if isinstance(message, ToolMessage):
        return message.tool_call_id == call_id
    return isinstance(message, AIMessage) and any(c["id"] == call_id for c in message.tool_calls)


def _calls(message: BaseMessage | None) -> list[tuple[object, object, object]]:
    """A message's calls as (id, name, arguments)."""
    if not isinstance(message, AIMessage):
        return []
    return [(call["id"], call["name"], call["args"]) for call in message.tool_calls]


def _seat(
    place: object, by_id: Mapping[str, int], transcript: Mapping[int, BaseMessage]
) -> int | None:
    """The `seq` of the stored message an edit held inline keeps the calls of; None for any
    other message the branch holds or logs."""
    if not isinstance(place, AIMessage) or place.id is None or place.id not in by_id:
        return None
    seq = by_id[place.id]
    return seq if keeps_calls(transcript[seq], place) else None


def _calls_made(place: object, stored: BaseMessage | None) -> list[ToolCall]:
    """The calls a branch's message holds at its seat: a stored message's, or an inline edit's
    (which its stored message makes as they are)."""
    made = place if isinstance(place, AIMessage) else stored
    return made.tool_calls if isinstance(made, AIMessage) else []
