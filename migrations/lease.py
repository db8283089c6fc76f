"""The migration lock: a lease document, so two runs never overlap and a killed run's
lock expires by itself.

A run renews its lease after every batch. A run killed with SIGKILL cannot
release it; the next run waits for the lease to expire (default 2 minutes) or
takes it over with `--force-unlock` once the operator knows the other run is gone.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pymongo.database import Database
from pymongo.errors import DuplicateKeyError

from agent_store.core import utc_now
from migrations.errors import LockHeld, MigrationError

STATE = "agent_migrations"
LOCK_ID = "lock:legacy-turns"
DEFAULT_LEASE = timedelta(minutes=2)


def describe(lock: dict[str, Any] | None) -> str:
    if lock is None:
        return "free"
    expires = lock.get("expires_at")
    state = "expired" if isinstance(expires, datetime) and expires < utc_now() else "held"
    return (
        f"{state} by {lock.get('host')} pid {lock.get('pid')} (run {lock.get('run_id')}) "
        f"since {lock.get('acquired_at')}, lease until {expires}"
    )


@dataclass
class Lease:
    db: Database[dict[str, Any]]
    run_id: str
    duration: timedelta = DEFAULT_LEASE
    owner: str = field(default_factory=lambda: uuid.uuid4().hex)

    def acquire(self, *, force: bool = False) -> None:
        """Take the lock, or raise LockHeld naming who holds it and until when."""
        collection = self.db[STATE]
        if force:
            collection.delete_one({"_id": LOCK_ID})
        at = utc_now()
        try:
            collection.find_one_and_update(
                {"_id": LOCK_ID, "$or": [{"expires_at": {"$lt": at}}, {"owner": self.owner}]},
                {
                    "$set": {
                        "owner": self.owner,
                        "run_id": self.run_id,
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "acquired_at": at,
                        "expires_at": at + self.duration,
                    }
                },
                upsert=True,
            )
        except DuplicateKeyError as exc:
            raise LockHeld(
                "another migration run holds the lock: "
                + describe(collection.find_one({"_id": LOCK_ID}))
                + ". Wait for it to finish; if that process is gone, wait for the lease to "
                "expire or pass --force-unlock"
            ) from exc

    def renew(self) -> None:
        result = self.db[STATE].update_one(
            {"_id": LOCK_ID, "owner": self.owner},
            {"$set": {"expires_at": utc_now() + self.duration}},
        )
        if result.matched_count == 0:
            raise MigrationError(
                "the migration lock was taken over by another run (--force-unlock or an "
                "expired lease); stopping so the two runs do not overlap"
            )

    def release(self) -> None:
        self.db[STATE].delete_one({"_id": LOCK_ID, "owner": self.owner})


def current(db: Database[dict[str, Any]]) -> dict[str, Any] | None:
    return db[STATE].find_one({"_id": LOCK_ID})
