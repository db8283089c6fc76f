"""The store's async code driven by the synchronous PyMongo driver, with no event loop.

The store awaits its collection calls. Wrapped here, a synchronous `Database`
answers each call at once with an awaitable whose value is already there, so
a coroutine of the store runs to its end on its first step: `run_sync` takes
that step and returns the result; a wait of the store (`pause`) blocks the
thread meanwhile, as each call does. Only for callers that hold a synchronous
driver and call synchronous methods (LangChain's `messages`, `add_messages`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine, Generator
from typing import Any, TypeVar

from agent_store.store import blocking_waits

T = TypeVar("T")


class _Ready:
    """An awaitable whose value is already there: awaiting it never suspends."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def __await__(self) -> Generator[Any, None, Any]:
        return self._value
        yield  # a generator that finishes on its first step


class _Cursor:
    """A synchronous cursor with the chained, awaitable API of the async drivers."""

    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor

    def sort(self, *args: Any, **kwargs: Any) -> _Cursor:
        self._cursor = self._cursor.sort(*args, **kwargs)
        return self

    def limit(self, count: int) -> _Cursor:
        self._cursor = self._cursor.limit(count)
        return self

    def batch_size(self, size: int) -> _Cursor:
        self._cursor = self._cursor.batch_size(size)
        return self

    def to_list(self, length: int | None = None) -> _Ready:
        documents = list(self._cursor)
        return _Ready(documents if length is None else documents[:length])

    async def _documents(self) -> AsyncIterator[Any]:
        for document in self._cursor:
            yield document

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._documents()


class _Collection:
    """A synchronous collection whose calls return awaitables."""

    def __init__(self, collection: Any) -> None:
        self._collection = collection

    def find(self, *args: Any, **kwargs: Any) -> _Cursor:
        return _Cursor(self._collection.find(*args, **kwargs))

    def __getattr__(self, name: str) -> Callable[..., _Ready]:
        method = getattr(self._collection, name)

        def call(*args: Any, **kwargs: Any) -> _Ready:
            return _Ready(method(*args, **kwargs))

        return call


class SyncDatabase:
    """A synchronous PyMongo `Database` with the awaitable collection API the store uses."""

    def __init__(self, db: Any) -> None:
        self._db = db

    def __getitem__(self, name: str) -> _Collection:
        return _Collection(self._db[name])


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine of the store over a `SyncDatabase` to its end, without an event loop:
    its waits block (`blocking_waits`). One that awaits anything else is closed, refused."""
    try:
        with blocking_waits():
            coroutine.send(None)
    except StopIteration as finished:
        return finished.value  # type: ignore[no-any-return]
    coroutine.close()
    raise RuntimeError("a store call waited on something the synchronous driver cannot give")
