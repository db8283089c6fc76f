"""The storage boundary: the database handles the store accepts, and the one place that
re-raises driver errors as the store's own."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pymongo import errors as mongo_errors
from pymongo.errors import BulkWriteError

from agent_store.core import (
    InvalidInput,
    StorageFailure,
    StorageUnavailable,
    StoreError,
    Unsupported,
)

Database = Any
"""A PyMongo `AsyncDatabase`, a Motor `AsyncIOMotorDatabase` or a mongomock-motor database.

They share the awaitable collection API the store uses, but no common type.
"""

DUPLICATE_KEY = 11000
"""The server's code for a duplicate-key error: the only write error the store swallows."""
INDEX_NOT_FOUND = 27
"""The server's code for a query that needs an index the collection lacks (`$text`)."""


_SECRET_OPTION = re.compile(r"(?i)password|secret|token|authmechanismproperties")


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


@contextmanager
def storage_errors(action: str) -> Iterator[None]:
    """Re-raise driver errors met while doing `action` as the store's own errors.

    The message says what failed in the store's words only; the driver's error, whose
    text may quote documents, commands or hosts, stays attached as `__cause__` for logs.
    """
    try:
        yield
    except StoreError:
        raise
    except (mongo_errors.NetworkTimeout, mongo_errors.ExecutionTimeout) as exc:
        raise StorageUnavailable(f"could not {action}: the database timed out") from exc
    except mongo_errors.WaitQueueTimeoutError as exc:
        raise StorageUnavailable(
            f"could not {action}: no connection to the database was free in time"
        ) from exc
    except mongo_errors.WTimeoutError as exc:
        # The write may be applied: sent again, an idempotent write replays it.
        raise StorageUnavailable(
            f"could not {action}: the database timed out waiting for replication"
        ) from exc
    except mongo_errors.ConnectionFailure as exc:  # AutoReconnect, server selection, ...
        raise StorageUnavailable(f"could not {action}: the database is unreachable") from exc
    except mongo_errors.DocumentTooLarge as exc:
        raise InvalidInput(f"could not {action}: a document is too large") from exc
    except mongo_errors.OperationFailure as exc:
        if exc.code == INDEX_NOT_FOUND:
            raise Unsupported(
                f"could not {action}: the database lacks the index it needs "
                "(a full-text search needs the store's text index)"
            ) from exc
        raise StorageFailure(f"could not {action}: the database refused the operation") from exc
    except mongo_errors.PyMongoError as exc:
        raise StorageFailure(f"could not {action}: the database refused the operation") from exc
    except NotImplementedError as exc:
        raise Unsupported(f"could not {action}: this database does not support it") from exc


def only_duplicates(error: BulkWriteError) -> None:
    """Re-raise a bulk write error unless each of its write errors is a duplicate key: where
    equal ids mean equal documents (a retry's, a resumed run's), those are already there."""
    if any(e.get("code") != DUPLICATE_KEY for e in error.details.get("writeErrors", [])):
        raise error
