"""Which call each legacy tool result answers: the one rule the converter places results by
and the migration's transcript names them by (DESIGN §4), so the two never disagree on it.

A call is known by a key of the caller's choosing (the converter: the id it stores the call
under; the transcript: where the part is), with its tool's name and the id its legacy part
names. Results are paired a turn at a time, once all of the turn's calls are known.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class CallPairing(Generic[K]):
    """The calls of one conversation so far, and which of them are answered."""

    def __init__(self) -> None:
        self._by_id: dict[str, list[K]] = defaultdict(list)
        """Each call by the id its legacy part names, in the order they were made."""
        self._answered: set[K] = set()
        self._turn: list[tuple[K, Any]] = []
        """This turn's calls, (key, tool name), in the order they were made."""

    def start_turn(self) -> None:
        """The calls made from now on are the next turn's."""
        self._turn = []

    def add_call(self, key: K, tool_name: Any, call_id: str | None) -> None:
        self._turn.append((key, tool_name))
        if call_id is not None:
            self._by_id[call_id].append(key)

    def names_a_call(self, call_id: str | None) -> bool:
        """Whether an id names a call of the conversation so far."""
        return call_id is not None and call_id in self._by_id

    def answer(self, results: Sequence[tuple[Any, str | None]]) -> list[K | None]:
        """The call each of this turn's results, (tool name, id), answers; None where no call
        is left for it. Results whose id names a call are paired first, in order; only then
        does each result whose id names none take, in order, the first unanswered call of
        its tool in this turn: a result naming no call never takes one another names."""
        named = {i for i, (_, call_id) in enumerate(results) if self.names_a_call(call_id)}
        unnamed = [i for i in range(len(results)) if i not in named]
        answers: list[K | None] = [None] * len(results)
        for index in [*sorted(named), *unnamed]:
            tool_name, call_id = results[index]
            found = self._by_name(call_id, tool_name) if index in named else self._of(tool_name)
            if found is not None:
                self._answered.add(found)
            answers[index] = found
        return answers

    def _by_name(self, call_id: str | None, tool_name: Any) -> K | None:
        """A result whose id names calls answers this turn's first of them still unanswered,
        of its tool when it names one (calls one response made under one id are answered in
        the order they were made), else an earlier turn's latest, as the live store pairs
        them across turns (`answers_to_calls`)."""
        open_calls = [k for k in self._by_id[str(call_id)] if k not in self._answered]
        this_turn = [k for k in open_calls if any(k == key for key, _ in self._turn)]
        of_its_tool = [k for k in this_turn if (k, tool_name) in self._turn]
        chosen = of_its_tool[:1] or this_turn[:1] or open_calls[-1:]
        return chosen[0] if chosen else None

    def _of(self, tool_name: Any) -> K | None:
        """The first unanswered call of the tool in this turn."""
        return next((k for k, n in self._turn if n == tool_name and k not in self._answered), None)
