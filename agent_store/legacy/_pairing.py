"""Which call each legacy tool result answers: the one rule the converter places results by
and the migration's transcript names them by (DESIGN §4), so the two never disagree on it.

A call is known by a key of the caller's choosing (the converter: the id it stores the call
under; the transcript: where the part is), with its tool's name and the id its legacy part
names. Results are paired a turn at a time, once all of the turn's calls are known.

A turn's `message_history_json` names the real ids of calls whose parts name none
(`history_call_ids`): by what identifies a call, its tool and its arguments, never by
position alone. What the history says a call returned then tells which call a result naming
no id answers (`told_calls`), always one of the result's own tool; which call it takes
decides which stay open for a later result its id alone pairs, so the transcript is told
both as the converter was (`LegacyConversion.history_call_ids`, `history_told_calls`), and
`CallPairing` pairs the rest alike on both sides. An empty id names no
call, on a call as on a result, as a missing one. A return
names its call by the latest call of that id in the turn's own part of the history
(`returns_here`), so ids a provider numbers per response never reach across responses.
Of the calls an id names, the tool a result names decides before position, across turns as
within one and whatever the order of the results; an id alone reaching past its tool's calls
is a guess (`CallPairing.guessed`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Container, Hashable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class CallPairing(Generic[K]):
    """The calls of one conversation so far, and which of them are answered."""

    def __init__(self) -> None:
        self._by_id: dict[str, list[K]] = defaultdict(list)
        """Each call by the id its legacy part names, in the order they were made."""
        self._tools: dict[K, Any] = {}
        """Each call's tool name, by key."""
        self._answered: set[K] = set()
        self._turn: list[tuple[K, Any]] = []
        """This turn's calls, (key, tool name), in the order they were made."""
        self.guessed: list[tuple[int, list[K]]] = []
        """The results of the last `answer` whose call is a guess, each by its index with the
        unanswered calls its id names, none of the tool it names (`_by_name`)."""

    def start_turn(self) -> None:
        """The calls made from now on are the next turn's."""
        self._turn = []

    def add_call(self, key: K, tool_name: Any, call_id: str | None) -> None:
        """A call of the turn, known by `key`; `call_id` is the id its legacy part names: an
        empty one names none (`names_a_call`), as a missing one."""
        self._turn.append((key, tool_name))
        self._tools[key] = tool_name
        if call_id:
            self._by_id[call_id].append(key)

    def names_a_call(self, call_id: str | None) -> bool:
        """Whether an id names a call of the conversation so far: never a missing or empty
        one, whatever parts named `""` (an empty id names no call, whoever reads it)."""
        return bool(call_id) and call_id in self._by_id

    def unanswered(self, call_id: str) -> bool:
        """Whether an id names a call of the conversation so far that no result answers yet."""
        return any(key not in self._answered for key in self._by_id.get(call_id, ()))

    def answer(
        self, results: Sequence[tuple[Any, str | None]], told: Sequence[K | None] = ()
    ) -> list[K | None]:
        """The call each of this turn's results, (tool name, id), answers; None where no call
        is left for it. Results whose id names a call are paired first, by the tool they name
        before position (`_by_name`; those paired by a guess are in `guessed`): those naming
        the tool of a call their id names, or none (the OpenAI way), in order, then those
        naming another tool, in order, so a result naming its call's tool answers it whatever
        the order of the parts, before one its id alone pairs; then each result
        its turn's history tells the call of (`told`, by key: `told_calls`) takes that call
        while it is unanswered; only then does each result whose id names none take, in
        order, the first unanswered call of its tool in this turn: a result naming no call
        never takes one another names."""
        told = list(told) or [None] * len(results)
        named = {i for i, (_, call_id) in enumerate(results) if self.names_a_call(call_id)}
        of_its_tool = [i for i in sorted(named) if not self._names_another_tool(*results[i])]
        by_id = sorted(named.difference(of_its_tool))
        said = [i for i, key in enumerate(told) if key is not None and i not in named]
        unnamed = [i for i in range(len(results)) if i not in named and i not in said]
        answers: list[K | None] = [None] * len(results)
        self.guessed = []
        for index in [*of_its_tool, *by_id, *said, *unnamed]:
            tool_name, call_id = results[index]
            key = told[index]
            if index in named:
                found, among = self._by_name(call_id, tool_name)
                if among:
                    self.guessed.append((index, among))
            elif key is not None and key not in self._answered:
                found = key
            else:
                found = self._of(tool_name)
            if found is not None:
                self._answered.add(found)
            answers[index] = found
        return answers

    def _names_another_tool(self, tool_name: Any, call_id: str | None) -> bool:
        """Whether a result names a tool no call its id names is of (compared exactly:
        `Get_Balance` is not `get_balance`), so only its id pairs it."""
        calls = self._by_id.get(str(call_id), ())
        return tool_name is not None and all(self._tools[k] != tool_name for k in calls)

    def _by_name(self, call_id: str | None, tool_name: Any) -> tuple[K | None, list[K]]:
        """The call a result whose id names calls answers, and, when that is a guess, the
        unanswered calls it was chosen among (else none). The tool a result names decides
        first, across turns as within one: of the calls its id names, those of its tool when
        any is (all answered: the result repeats an answer, and answers none); then this
        turn's first still unanswered (calls one response made under one id are answered in
        the order they were made), else an earlier turn's latest, as the live store pairs
        them across turns (`answers_to_calls`). A result naming a tool none of those calls
        is of is paired so by its id alone: a guess when the id names several unanswered
        calls, or only an earlier turn's (an id a provider numbers per response says
        nothing of which turn's call it is; only the tool would). A result naming no tool is
        paired by that order alone, as the live store pairs it."""
        calls = self._by_id[str(call_id)]
        of_its_tool = [k for k in calls if tool_name is not None and self._tools[k] == tool_name]
        open_calls = [k for k in of_its_tool or calls if k not in self._answered]
        this_turn = [k for k in open_calls if any(k == key for key, _ in self._turn)]
        chosen = this_turn[:1] or open_calls[-1:]
        by_id_alone = tool_name is not None and not of_its_tool
        guess = by_id_alone and (len(open_calls) > 1 or not this_turn)
        return (chosen[0] if chosen else None), (open_calls if guess else [])

    def _of(self, tool_name: Any) -> K | None:
        """The first unanswered call of the tool in this turn."""
        return next((k for k, n in self._turn if n == tool_name and k not in self._answered), None)


def history_call_ids(
    calls: Sequence[tuple[Any, str, str | None]],
    history: Iterable[tuple[str, str, str]],
    taken: Container[str],
    made_before: Mapping[tuple[str, str], int],
) -> list[str | None]:
    """The real id of each of a turn's calls, given as (tool name, what its arguments say,
    the id its part names): the part's own id; else the id of a call the history makes of
    that tool with those arguments (`history`, in order), neither an earlier turn's nor one
    a call took already (`taken`: the conversation's ids so far) or names as its own; else
    None. A history holds the conversation so far, so of its calls alike (one tool, the same
    arguments) the first are the earlier turns' (`made_before`: how many such calls they
    made), whichever ids those got. Only among calls alike does position choose: they take
    the history's other alike calls in order, its last ones when it holds more (one from a
    conversation longer than its turns), its first ones when it holds fewer (saved before the
    turn's last calls were made)."""
    own = {call_id for _, _, call_id in calls if call_id}
    alike: dict[tuple[Any, str], list[str]] = defaultdict(list)
    for name, arguments, made in history:
        alike[(name, arguments)].append(made)
    wanting: dict[tuple[Any, str], list[int]] = defaultdict(list)
    for index, (name, arguments, own_id) in enumerate(calls):
        if not own_id and isinstance(name, str):
            wanting[(name, arguments)].append(index)
    found: list[str | None] = [call_id or None for _, _, call_id in calls]
    for key, indexes in wanting.items():
        ids = list(dict.fromkeys(alike.get(key, ())))[made_before.get(key, 0) :]
        ids = [made for made in ids if made not in taken and made not in own]
        for index, made in zip(indexes, ids[max(len(ids) - len(indexes), 0) :], strict=False):
            found[index] = made
    return found


Returned = tuple[str, str, str | None]
"""A tool return a turn's history gives: (tool name, call id, what it says), None when it
says nothing."""


def told_calls(
    results: Sequence[tuple[Any, str | None, str | None]],
    calls: Sequence[tuple[str, str, str]],
    returns: Sequence[Returned],
    earlier: Callable[[str, str], bool],
) -> list[tuple[str, int] | None]:
    """The id of the call the turn's history says each result answers, and the index of the
    return that says so (`returns`), for the results whose
    id names no call: given as (tool name, what it says, the id it names when that names a
    call), with the turn's calls, (id, tool name, what its arguments say) in order, and the
    history's returns. A return of the result's tool saying what it says tells its call's
    tool and arguments: of the calls alike (that tool, those arguments) no result names, the
    one the order of the parts gives the result (`positions`), else the return's own call,
    else the first still free; each return and each call is told once. When the turn makes
    no call of the result's tool, the return's own call of an earlier turn, if `earlier(id,
    tool)` (still unanswered). None where the history tells nothing: such a result is paired
    as without a history (`CallPairing.answer`)."""
    made = {cid: (name, arguments) for cid, name, arguments in calls}
    taken = {named for *_, named in results if named is not None}
    by_what: dict[tuple[str, str], list[int]] = defaultdict(list)
    for n, (name, _, says) in enumerate(returns):
        if says is not None:
            by_what[(name, says)].append(n)
    used: set[int] = set()
    told: list[tuple[str, int] | None] = []
    for (name, says, named), own in zip(results, positions(results, calls), strict=True):
        found = None
        if named is None and isinstance(name, str) and says is not None:
            for n in [n for n in by_what.get((name, says), ()) if n not in used]:
                call_id = _told(returns[n][1], name, own, made, taken, earlier)
                if call_id is not None:
                    found = (call_id, n)
                    used.add(n)
                    taken.add(call_id)
                    break
        told.append(found)
    return told


def _told(
    call_id: str,
    name: str,
    own: str | None,
    made: dict[str, tuple[str, str]],
    taken: set[str],
    earlier: Callable[[str, str], bool],
) -> str | None:
    """The call a result of tool `name` answers, its history's return naming `call_id`."""
    if call_id in made:
        if made[call_id][0] != name:
            return None
        alike = [cid for cid, what in made.items() if what == made[call_id] and cid not in taken]
        preferred = [cid for cid in (own, call_id) if cid in alike]
        return next(iter(preferred or alike), None)
    if name in {n for n, _ in made.values()} or call_id in taken:
        return None
    return call_id if earlier(call_id, name) else None


def positions(
    results: Sequence[tuple[Any, str | None, str | None]], calls: Sequence[tuple[str, str, str]]
) -> list[str | None]:
    """The call of its turn the order of the parts gives each result naming no call, as
    `CallPairing.answer` pairs them without a history: the k-th such result of a tool, the
    k-th call of that tool in the turn no result names."""
    named = {named for *_, named in results if named is not None}
    queues: dict[str, list[str]] = defaultdict(list)
    for cid, name, _ in calls:
        if cid not in named:
            queues[name].append(cid)
    seen: dict[str, int] = defaultdict(int)
    found: list[str | None] = []
    for name, _, call_id in results:
        if call_id is not None or not isinstance(name, str):
            found.append(None)
            continue
        queue, k = queues.get(name, []), seen[name]
        seen[name] += 1
        found.append(queue[k] if k < len(queue) else None)
    return found


def returns_here(
    calls: Sequence[tuple[str, str, str]],
    segment: Sequence[tuple[str, str, str] | str],
    earlier: Mapping[tuple[str, str], int],
) -> list[str | None]:
    """The call of the turn each return of the turn's own part of its history answers: the
    turn's calls given as (id, tool name, what its arguments say) in order, and that part
    (`segment`: what follows the previous turn's history) as its calls, (tool name, what its
    arguments say, id), and its returns, the id each names, in order. The segment's calls go
    to the turn's calls alike (one tool, the same arguments) as `history_call_ids` gives
    ids: after the first ones earlier turns made (`earlier`: how many the segment holds),
    its last ones when it holds more, its first when fewer. A return answers the latest call
    before it of the id it names, so an id a provider numbers per response (`call_0` in
    each) never reaches across responses or turns: that call's turn call, whatever id it is
    stored under; None when that call is none of the turn's; the id it names when no call of
    the segment made it (an earlier turn's)."""
    made = [entry for entry in segment if not isinstance(entry, str)]
    alike: dict[tuple[str, str], list[int]] = defaultdict(list)
    for n, (name, arguments, _) in enumerate(made):
        alike[(name, arguments)].append(n)
    turn_of: dict[int, str] = {}
    mine: dict[tuple[str, str], list[str]] = defaultdict(list)
    for call_id, name, arguments in calls:
        mine[(name, arguments)].append(call_id)
    for key, ours in mine.items():
        theirs = alike.get(key, [])[earlier.get(key, 0) :]
        theirs = theirs[max(len(theirs) - len(ours), 0) :]
        turn_of.update(zip(theirs, ours, strict=False))
    latest: dict[str, str | None] = {}
    found: list[str | None] = []
    n = 0
    for entry in segment:
        if isinstance(entry, str):
            found.append(latest.get(entry, entry))
        else:
            latest[entry[2]] = turn_of.get(n)
            n += 1
    return found
