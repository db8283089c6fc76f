"""Client CPU spent inside PyMongo, told apart from the CPU of the code that calls it.

`DriverClock` wraps PyMongo's public entry points (the collection methods and
the cursor iteration of both the async and the sync API) for as long as it is
installed, and adds up the CPU time of the calling thread (`time.thread_time()`) spent inside the
outermost of them:
building and encoding the command, the network exchange, decoding the reply,
the event loop's work while the call awaits. Whatever else the process spends
is the caller's own: "ours" for this store, the library for a peer.

Thread CPU, not process CPU: a peer that calls the driver from several threads at
once (LangGraph saves its checkpoints from a background thread) is not counted
twice. It assumes one measured operation at a time per thread (the benchmarks
run contenders one after another), so a call that awaits is not interleaved
with another caller's on the event loop.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pymongo.asynchronous import collection as async_collection
from pymongo.asynchronous import command_cursor as async_command_cursor
from pymongo.asynchronous import cursor as async_cursor
from pymongo.synchronous import collection as sync_collection
from pymongo.synchronous import command_cursor as sync_command_cursor
from pymongo.synchronous import cursor as sync_cursor

_COLLECTION_METHODS = (
    "find",
    "insert_one",
    "insert_many",
    "update_one",
    "update_many",
    "replace_one",
    "delete_one",
    "delete_many",
    "bulk_write",
    "find_one",
    "find_one_and_update",
    "find_one_and_replace",
    "find_one_and_delete",
    "count_documents",
    "aggregate",
    "distinct",
)
_CURSOR_METHODS = ("to_list", "next", "__next__", "__anext__")
_TARGETS: tuple[tuple[type, tuple[str, ...]], ...] = (
    (async_collection.AsyncCollection, _COLLECTION_METHODS),
    (sync_collection.Collection, _COLLECTION_METHODS),
    (async_cursor.AsyncCursor, _CURSOR_METHODS),
    (async_command_cursor.AsyncCommandCursor, _CURSOR_METHODS),
    (sync_cursor.Cursor, _CURSOR_METHODS),
    (sync_command_cursor.CommandCursor, _CURSOR_METHODS),
)


class DriverClock:
    """Adds up the thread CPU spent inside PyMongo while installed (`with clock.installed():`)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = threading.local()

    def reset(self) -> None:
        self.seconds = 0.0

    def _enter(self) -> float | None:
        depth = getattr(self._depth, "value", 0)
        self._depth.value = depth + 1
        return time.thread_time() if depth == 0 else None

    def _leave(self, started: float | None) -> None:
        self._depth.value -= 1
        if started is not None:
            self.seconds += time.thread_time() - started

    def _wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                started = self._enter()
                try:
                    return await function(*args, **kwargs)
                finally:
                    self._leave(started)

            return timed_async

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = self._enter()
            try:
                return function(*args, **kwargs)
            finally:
                self._leave(started)

        return timed

    @contextmanager
    def installed(self) -> Iterator[DriverClock]:
        """Wrap PyMongo's entry points; put the originals back on exit."""
        originals: list[tuple[tuple[type, str], str, Any]] = []
        try:
            for target, names in _TARGETS:
                for name in names:
                    # Where the method is defined: a base class of several cursors, say.
                    owner = next((c for c in target.__mro__ if name in c.__dict__), None)
                    if owner is None or any(o == (owner, name) for o, n, _ in originals):
                        continue
                    originals.append(((owner, name), name, owner.__dict__[name]))
                    setattr(owner, name, self._wrap(owner.__dict__[name]))
            yield self
        finally:
            for (owner, _), name, original in reversed(originals):
                setattr(owner, name, original)
