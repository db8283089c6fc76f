"""Errors of the migration tool, each with the exit code the command line returns for it."""

from __future__ import annotations


class MigrationError(Exception):
    """Base: the message says what was wrong and what to do."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Misuse(MigrationError):
    """The command cannot run as asked (no legacy data, bad option, mixed collections)."""

    exit_code = 2


class WorkLeft(MigrationError):
    """The data holds what the command may not settle by itself (a turn logged after the move
    under the `_id` of a moved-aside turn with other content): work left, as `verify` and
    `finish` report it, never misuse."""

    exit_code = 1


class LockHeld(MigrationError):
    """Another run holds the migration lock."""

    exit_code = 3


class Unreachable(MigrationError):
    """The database could not be reached or the URI is wrong."""

    exit_code = 4
