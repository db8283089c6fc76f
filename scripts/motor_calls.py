"""The PyMongo methods a Motor client calls while part of the suite runs: a pytest plugin.

Motor runs PyMongo's synchronous API in threads, so recording which of those methods run
while the `wire-motor` tests run tells which driver calls they make through a Motor handle.
`make test` runs Motor on `MOTOR_SURFACE` only (tests/conftest.py); this checks that the
modules it leaves to `make test-motor` make no call the surface does not:

    export PYTEST_ADDOPTS="-n 0 -m motor -p scripts.motor_calls"
    MOTOR_MATRIX=surface MOTOR_CALLS=/tmp/surface.txt .venv/bin/pytest
    MOTOR_MATRIX=rest MOTOR_CALLS=/tmp/rest.txt .venv/bin/pytest
    comm -13 /tmp/surface.txt /tmp/rest.txt     # calls only the rest makes: none expected

(`-n 0`: one process writes the file when it exits.)
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

from gridfs.synchronous import grid_file
from pymongo.synchronous import client_session, collection, command_cursor, cursor, database

RECORDED = (
    collection.Collection,
    database.Database,
    cursor.Cursor,
    command_cursor.CommandCursor,
    client_session.ClientSession,
    grid_file.GridFSBucket,
    grid_file.GridIn,
    grid_file.GridOut,
)
_called: set[str] = set()
_lock = threading.Lock()


def _recording(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        with _lock:
            _called.add(name)
        return method(*args, **kwargs)

    return recorded


def _record_calls_of(cls: type) -> None:
    for name, method in list(vars(cls).items()):
        dunder = name.startswith("__") and name not in ("__iter__", "__next__")
        if inspect.isfunction(method) and not dunder:
            setattr(cls, name, _recording(f"{cls.__name__}.{name}", method))


def _write_calls() -> None:
    with open(os.environ.get("MOTOR_CALLS", "motor-calls.txt"), "w") as out:
        out.write("".join(f"{name}\n" for name in sorted(_called)))


for _cls in RECORDED:
    _record_calls_of(_cls)
atexit.register(_write_calls)
