"""What a turn of our code costs when nothing else runs, and after something else did.

`python -m scripts.cold_cost` logs the benchmark's turns on a database that answers at
once (no driver, no network; `profile_logger`'s stand-in) and prints, best of seven:

- the fit of our client CPU per turn over turns of 1, 4 and 16 messages, back to back:
  the cost per turn and per message when the code stays in the CPU's caches;
- `plan_turn` of a 4-message turn back to back, then with something else between two
  turns: a 2 ms busy loop (the process never sleeps), a 0.1 ms sleep and a 2 ms sleep
  (the process waits, as it does for every round trip).

The first says how far the code itself is from a target; the second, how much of what
the benchmark measures on the wire is the machine refilling its caches after each wait.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import time
from collections.abc import Callable

from agent_store import AgentMessageLogger
from agent_store.store import plan_turn
from scripts.corpus import Corpus
from scripts.profile_logger import _AnsweringDatabase


async def _logged_per_turn(size: int, turns: int) -> float:
    conversation = Corpus(seed=31).conversation_of_turn_size(turns, size)
    logger = AgentMessageLogger(_AnsweringDatabase())
    inputs = copy.deepcopy(conversation)
    started = time.process_time()
    for turn_id, messages in inputs.turns:
        await logger.log_messages(inputs.conversation_id, messages, user_id="u-1", turn_id=turn_id)
    return (time.process_time() - started) / len(inputs.turns) * 1e6


def _spin(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def _plan_between(between: Callable[[], None], turns: int) -> float:
    """Median thread CPU of `plan_turn` (µs) with `between` run before each turn."""
    corpus = Corpus(seed=3)
    inputs = [corpus.turn_of_size(number, 4) for number in range(turns)]
    costs = []
    for number, messages in enumerate(inputs):
        between()
        started = time.thread_time_ns()
        plan_turn("c-1", messages, turn_id=f"t-{number}")
        costs.append((time.thread_time_ns() - started) / 1e3)
    return statistics.median(costs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    args = parser.parse_args(argv)
    sizes = (1, 4, 16)
    best = {
        size: min(asyncio.run(_logged_per_turn(size, args.turns)) for _ in range(7))
        for size in sizes
    }
    per_message = (best[16] - best[1]) / 15
    print("our code back to back, µs per turn (log_messages, answered at once, best of 7):")
    for size in sizes:
        print(f"  {size:>2} messages  {best[size]:7.0f}")
    print(f"  fit: {best[1] - per_message:.0f} per turn + {per_message:.1f} per message")
    modes: dict[str, Callable[[], None]] = {
        "back to back": lambda: None,
        "after a 2 ms busy loop": lambda: _spin(0.002),
        "after a 0.1 ms sleep": lambda: time.sleep(0.0001),
        "after a 2 ms sleep": lambda: time.sleep(0.002),
    }
    print("plan_turn of a 4-message turn, µs (median over the turns, best of 3 runs):")
    baseline = 0.0
    for name, between in modes.items():
        cost = min(_plan_between(between, args.turns) for _ in range(3))
        baseline = baseline or cost
        print(f"  {name:<24}{cost:7.0f}  {cost / baseline:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
