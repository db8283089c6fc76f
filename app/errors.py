"""The store's own errors, and the one place that translates driver errors into them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import ValidationError
from pymongo import errors as mongo_errors


class StoreError(Exception):
    """Base of every error the store raises. `code` is stable; the message says what went wrong."""

    code = "store_error"
    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(StoreError):
    """The caller sent something the contract does not allow; nothing was written."""

    code = "invalid_input"
    status = 422


class NotFound(StoreError):
    """The conversation or message named does not exist (or is not the caller's)."""

    code = "not_found"
    status = 404


class Conflict(StoreError):
    """The request contradicts what is stored, e.g. a turn id reused for other messages."""

    code = "conflict"
    status = 409


class Unsupported(StoreError):
    """The connected database cannot do this (e.g. full-text search on an in-process fake)."""

    code = "unsupported"
    status = 501


class StorageUnavailable(StoreError):
    """The database could not be reached in time; the call can be retried as it is."""

    code = "storage_unavailable"
    status = 503


class StorageFailure(StoreError):
    """The database refused an operation for a reason the store did not expect."""

    code = "storage_failure"
    status = 500


def describe_validation_error(error: ValidationError, *, subject: str = "input") -> str:
    """One line per problem: where it is and what is wrong, without pydantic's URLs."""
    problems = []
    for item in error.errors(include_url=False):
        # Discriminated unions put the role's tag in the path; it only adds noise.
        location = ".".join(str(part) for part in item["loc"] if part not in _UNION_TAGS)
        text = str(item["msg"]).removeprefix("Value error, ")
        problems.append(f"{location}: {text}" if location else text)
    return f"invalid {subject}: " + "; ".join(problems)


_UNION_TAGS = {"system", "user", "assistant", "tool"}


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
