"""The storage boundary: the database handles the store accepts, how the store waits on them
(`pause`), and the one place that re-raises driver errors as the store's own."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import TracebackType
from typing import Any, NamedTuple

from bson.errors import InvalidBSON
from dns.exception import DNSException
from pymongo import AsyncMongoClient, MongoClient
from pymongo import errors as mongo_errors
from pymongo.database import Database as SyncPyMongoDatabase
from pymongo.errors import BulkWriteError

from agent_store.core import (
    InvalidInput,
    StorageFailure,
    StorageUnavailable,
    StoreError,
    Unsupported,
    shown_key,
)

Database = Any
"""A PyMongo `AsyncDatabase`, a Motor `AsyncIOMotorDatabase` or a mongomock-motor database.

They share the awaitable collection API the store uses, but no common type.
"""


def _client_kind(db: Any) -> str | None:
    """The name of the client `db` is, if it is one: PyMongo's `MongoClient` or
    `AsyncMongoClient`, or Motor's client (looked up only once Motor is imported)."""
    kinds: list[type[Any]] = [MongoClient, AsyncMongoClient]
    if (motor := sys.modules.get("motor.motor_asyncio")) is not None:
        kinds.append(motor.AsyncIOMotorClient)
    return next((kind.__name__ for kind in kinds if isinstance(db, kind)), None)


def async_database(db: Database) -> Database:
    """`db`, checked to be a handle whose calls the store can await: a client
    (`AsyncMongoClient(uri)`, not `AsyncMongoClient(uri)["db"]`) or a synchronous PyMongo
    `Database` (`MongoClient(...)["db"]`) is refused with a TypeError, before anything is
    written through it. Every holder of a database checks it here as it is made."""
    if (client := _client_kind(db)) is not None:
        raise TypeError(
            f"the store needs a database, not a client: got {client}(...); pass a database, "
            "client[name], as in AsyncMongoClient(uri)[name]"
        )
    if isinstance(db, SyncPyMongoDatabase):
        raise TypeError(
            "the store needs an async database handle (PyMongo's AsyncMongoClient, or Motor): "
            "got a synchronous pymongo Database; open it as AsyncMongoClient(uri)[name]"
        )
    return db


_BLOCKING: ContextVar[bool] = ContextVar("agent_store_blocking_waits", default=False)
"""Whether the store's code runs with no event loop, stepped by the synchronous driver."""


async def pause(seconds: float) -> None:
    """Wait `seconds`: every wait of the store (a retry within `TurnRules.claim_grace`, a
    delete's last sweep). Asleep in the event loop; under `blocking_waits` (the synchronous
    driver, with no event loop to sleep in) blocking the thread, as each of its calls does."""
    if _BLOCKING.get():
        time.sleep(seconds)  # noqa: ASYNC251 - no event loop runs this coroutine
    else:
        await asyncio.sleep(seconds)


@contextmanager
def blocking_waits() -> Iterator[None]:
    """Within it, the store's waits (`pause`) block the thread: for a coroutine of the store
    stepped with no event loop over a synchronous `Database`, whose every call blocks."""
    token = _BLOCKING.set(True)
    try:
        yield
    finally:
        _BLOCKING.reset(token)


DUPLICATE_KEY = 11000
"""The server's code for a duplicate-key error: the only write error the store swallows."""
INDEX_NOT_FOUND = 27
"""The server's code for a query that needs an index the collection lacks (`$text`)."""


_DATABASE_NAME_REFUSED = frozenset('/\\. "$\x00')
"""Characters MongoDB refuses in a database name (on every platform it runs on)."""
_DATABASE_NAME_MAX_BYTES = 63


def database_name_refusal(name: str) -> str | None:
    """Why MongoDB refuses `name` as a database name (the service's start and the migration
    refuse it before connecting); None when it takes it."""
    if not name or _DATABASE_NAME_REFUSED.intersection(name):
        return 'MongoDB refuses an empty database name or one with any of /\\. "$'
    if len(name.encode()) > _DATABASE_NAME_MAX_BYTES:
        return f"MongoDB refuses a database name over {_DATABASE_NAME_MAX_BYTES} bytes"
    return None


_SECRET_OPTION = re.compile(r"(?i)password|secret|token|authmechanismproperties")


def client_options(uri: str | None) -> dict[str, Any]:
    """The options a client the product builds for `uri` takes beside its own: PyMongo's
    retryable writes off (`retryWrites=False`), unless `uri` names `retryWrites` itself (the
    operator's word wins).

    Every write of the store is safe to send again after a lost reply, and the runtime sends it
    again (`with_retries`), after a pause. PyMongo's own retry is sent at once: after a dropped
    connection its pool is paused until the next heartbeat, and the retry's checkout of the
    paused pool clears it again, as long as writes keep coming (docs/RELIABILITY.md).
    """
    query = (uri or "").partition("?")[2]
    names = {option.partition("=")[0].strip().lower() for option in re.split("[&;]", query)}
    return {} if "retrywrites" in names else {"retryWrites": False}


def redact_uri(uri: str) -> str:
    """`uri` fit to print: its password and the values of secret-bearing options are `***`."""
    scheme, separator, rest = uri.partition("://")
    if not separator:
        return "***"
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    userinfo, at, hosts = authority.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        authority = f"{user}{':***' if colon else ''}@{hosts}"
    path, question, options = tail.partition("?")
    if question:
        kept = []
        for option in options.split("&"):
            name, equals, _ = option.partition("=")
            kept.append(f"{name}=***" if equals and _SECRET_OPTION.search(name) else option)
        tail = f"{path}?{'&'.join(kept)}"
    return f"{scheme}://{authority}{tail}"


class storage_errors:
    """Re-raise driver errors met while doing `action` as the store's own errors.

    The message says what failed in the store's words only; the driver's error, whose
    text may quote documents, commands or hosts, stays attached as `__cause__` for logs.
    A class rather than a generator: every command of every turn passes through one.
    """

    __slots__ = ("action",)

    def __init__(self, action: str) -> None:
        self.action = action

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: TracebackType | None
    ) -> None:
        if error is None or isinstance(error, StoreError):
            return
        translated = store_error(self.action, error)
        if translated is not None:
            raise translated from error


def store_error(action: str, exc: BaseException) -> StoreError | None:
    """The store's error for a driver's `exc` met while doing `action`; None for any other."""
    if isinstance(exc, mongo_errors.NetworkTimeout | mongo_errors.ExecutionTimeout):
        return StorageUnavailable(f"could not {action}: the database timed out")
    if isinstance(exc, mongo_errors.WaitQueueTimeoutError):
        return StorageUnavailable(
            f"could not {action}: no connection to the database was free in time"
        )
    if isinstance(exc, mongo_errors.WTimeoutError):
        # The write may be applied: sent again, an idempotent write replays it.
        return StorageUnavailable(
            f"could not {action}: the database timed out waiting for replication"
        )
    if isinstance(exc, mongo_errors.ConnectionFailure):  # AutoReconnect, server selection, ...
        return StorageUnavailable(f"could not {action}: the database is unreachable")
    if isinstance(exc, mongo_errors.DocumentTooLarge):
        return InvalidInput(f"could not {action}: a document is too large")
    if isinstance(exc, mongo_errors.OperationFailure) and exc.code == INDEX_NOT_FOUND:
        return Unsupported(
            f"could not {action}: the database lacks the index it needs "
            "(a full-text search needs the store's text index)"
        )
    if isinstance(exc, mongo_errors.ConfigurationError):  # no database was reached
        if _caused_by_dns(exc):
            return StorageFailure(
                f"could not {action}: the connection string's host could not be resolved "
                "(a mongodb+srv:// host needs its SRV record in DNS)"
            )
        return StorageFailure(
            f"could not {action}: the driver refused the connection string or a client option"
        )
    if isinstance(exc, mongo_errors.InvalidOperation) and "after close" in str(exc):
        return StorageFailure(f"could not {action}: the database client was closed")
    if isinstance(exc, mongo_errors.PyMongoError):
        return StorageFailure(f"could not {action}: the database refused the operation")
    if isinstance(exc, NotImplementedError):
        return Unsupported(f"could not {action}: this database does not support it")
    if isinstance(exc, InvalidBSON):  # a reply the driver cannot decode, bytes of it quoted
        return StorageFailure(
            f"could not {action}: a stored document holds what the driver cannot decode "
            "(such as text that is not valid UTF-8, which MongoDB stores unchecked): an "
            "operator corrects it in the database"
        )
    return None


def read_as_stored(collection: Any) -> Any:
    """`collection` reading a text that holds bytes that are not valid UTF-8 (MongoDB stores
    what a writer gave unchecked) with each such byte a lone surrogate (`surrogateescape`),
    where the strict client refuses the whole reply (`InvalidBSON`): for the reads that tell
    whose a document is (`ownership_read`), which set such a document apart by what they
    read and serve, write or send back no text so read, and for an operator's reads of the
    documents as stored, which show each such byte escaped (`not_utf8_at`). A collection of
    no real server (mongomock: it holds Python values and decodes nothing) is as it is."""
    try:
        options = collection.codec_options.with_options(
            unicode_decode_error_handler="surrogateescape"
        )
    except NotImplementedError:  # mongomock's codec options take the strict handler only
        return collection
    return collection.with_options(codec_options=options)


LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate alone: what `read_as_stored` reads each byte that is not valid UTF-8
as, which no valid UTF-8 spells."""


def not_utf8_at(value: Any, where: str = "") -> str | None:
    """Where in a stored document a text (a key too) holds bytes that are not valid UTF-8, as
    a client decoding with `surrogateescape` reads them (`read_as_stored`, the migration's):
    each such byte a lone surrogate (`LONE_SURROGATE`), so a document read from BSON holds
    one only so (`a.0.b`, a key that is no plain name shown as `<key>`); None when none does."""
    if isinstance(value, str):
        return where or "a text" if LONE_SURROGATE.search(value) else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            at = f"{where}.{shown_key(str(key))}" if where else shown_key(str(key))
            found = at if LONE_SURROGATE.search(str(key)) else not_utf8_at(item, at)
            if found is not None:
                return found
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            if (found := not_utf8_at(item, f"{where}.{index}")) is not None:
                return found
    return None


class OwnershipRead(NamedTuple):
    """Documents read by their ownership fields (`ownership_read`)."""

    owned: list[dict[str, Any]]
    """Those whose fields read hold text only: whose they are can be told."""
    unowned: list[str]
    """The others, each named by its `_id` and the field (`'t-1': user_id holds …`)."""


async def ownership_read(
    collection: Any, query: dict[str, Any], fields: dict[str, Any]
) -> OwnershipRead:
    """The documents of `collection` `query` selects, their ownership `fields` read as
    stored (`read_as_stored`): the one read every rule telling whose a legacy turn or prompt
    is starts from, in the legacy collections and in `agent_conversations` alike. One whose
    fields read hold bytes that are not valid UTF-8 (`not_utf8_at`: its `user_id`, its
    conversation's id, its `_id`) belongs to nobody who can ask for it: set apart, never
    anyone's part or owner, never read whole, its `_id` sent in no query (was: the strict
    client refused the whole reply, `InvalidBSON`, so every read, write and delete of the id
    was a StorageFailure, whoever asked)."""
    found = await read_as_stored(collection).find(query, fields).to_list(None)
    owned, unowned = [], []
    for document in found:
        if (where := not_utf8_at(document)) is None:
            owned.append(document)
        else:
            named = f"{document.get('_id')!r}: {where} holds bytes that are not valid UTF-8"
            unowned.append(named)
    return OwnershipRead(owned, unowned)


def _caused_by_dns(exc: BaseException) -> bool:
    """Whether a failed DNS lookup is among the causes of `exc` (PyMongo resolves a
    `mongodb+srv://` host with dnspython, one of its own dependencies)."""
    cause = exc.__cause__
    while cause is not None:
        if isinstance(cause, DNSException):
            return True
        cause = cause.__cause__
    return False


def only_duplicates(error: BulkWriteError) -> None:
    """Re-raise a bulk write error unless each of its write errors is a duplicate key: where
    equal ids mean equal documents (a retry's, a resumed run's), those are already there."""
    if any(e.get("code") != DUPLICATE_KEY for e in error.details.get("writeErrors", [])):
        raise error
