"""The storage boundary: the database handles the store accepts, and the one place that
re-raises driver errors as the store's own."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pymongo import errors as mongo_errors

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


@contextmanager
def storage_errors(action: str) -> Iterator[None]:
    """Re-raise driver errors met while doing `action` as the store's own errors."""
    try:
        yield
    except StoreError:
        raise
    except (mongo_errors.ServerSelectionTimeoutError, mongo_errors.AutoReconnect) as exc:
        raise StorageUnavailable(
            f"could not {action}: the database is unreachable ({exc})"
        ) from exc
    except (mongo_errors.NetworkTimeout, mongo_errors.ExecutionTimeout) as exc:
        raise StorageUnavailable(f"could not {action}: the database timed out ({exc})") from exc
    except mongo_errors.DocumentTooLarge as exc:
        raise InvalidInput(f"could not {action}: a document is too large ({exc})") from exc
    except mongo_errors.PyMongoError as exc:
        raise StorageFailure(f"could not {action}: {exc}") from exc
    except NotImplementedError as exc:
        raise Unsupported(f"could not {action}: this database does not support it ({exc})") from exc
