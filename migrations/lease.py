"""The migration lock: a lease document, so two runs never overlap and a killed run's
lock expires by itself.

A run renews its lease before writing each batch. A run killed with SIGKILL cannot
release it. The next run waits for that lease to expire when it expires within
`--wait-seconds` (default: a little more than the 2-minute lease), then takes
the lock; if the holder renews it meanwhile, the holder is alive and the run
stops (exit 3). A lease further away than that stops the run at once.
`--force-unlock` takes the lock over without waiting, once the operator knows
the other run is gone.

A lease alone cannot stop a run paused past it (a suspended VM, ^Z) from writing what it
had worked out before the pause. So a run proves its lease (`renew`) right before the writes
of each batch, and its writes to the migration's state go through `write_state`, which
writes only while the lock names the run: each holder records itself in the state document
(`holder`) when it takes the lock, so a newer holder's record fences every older one.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pymongo.database import Database
from pymongo.errors import DuplicateKeyError

from agent_store.core import utc_now
from agent_store.legacy import MIGRATION_STATE, MIGRATION_STATE_ID
from migrations.errors import LockHeld

STATE = MIGRATION_STATE
LOCK_ID = "lock:legacy-turns"
STATE_ID = MIGRATION_STATE_ID
"""The migration's state document: the checkpoint, its times (`undated_at`, `moved_at` and
`first_moved_at`: the legacy turns' last and first move aside, `copying_at`: a copy of them
under way, `finished_at`, `dropping_at` and `dropped_at`: a drop begun, then made), and the
lock holder that may write it (`holder`)."""
DEFAULT_LEASE = timedelta(minutes=2)
DEFAULT_WAIT = DEFAULT_LEASE + timedelta(seconds=30)


def describe(lock: dict[str, Any] | None) -> str:
    if lock is None:
        return "free"
    expires = lock.get("expires_at")
    state = "expired" if _expired(lock) else "held"
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

    def acquire(
        self,
        *,
        force: bool = False,
        wait: timedelta = timedelta(0),
        say: Callable[[str], None] = lambda _: None,
    ) -> None:
        """Take the lock. A lease that expires within `wait` is waited for (`say` tells the
        operator); raise LockHeld naming who holds it and until when otherwise, or when
        its holder renewed it meanwhile."""
        if force:
            self.db[STATE].delete_one({"_id": LOCK_ID})
        deadline = utc_now() + wait
        seen: Any = None
        while True:
            try:
                self._take()
                self.db[STATE].update_one(
                    {"_id": STATE_ID}, {"$set": {"holder": self.owner}}, upsert=True
                )
                return
            except LockHeld as exc:
                lock = current(self.db) or {}
                expires = lock.get("expires_at")
                if seen is not None and expires != seen:
                    raise LockHeld(
                        "the run holding the lock renewed its lease while this one waited: it is "
                        "alive. " + describe(lock)
                    ) from exc
                if not isinstance(expires, datetime) or expires > deadline:
                    raise
                if seen is None:
                    say(
                        f"the lock is held ({describe(lock)}); waiting for its lease to end at "
                        f"{expires}: a live run renews it, a killed one cannot"
                    )
                seen = expires
                time.sleep(min(max((expires - utc_now()).total_seconds(), 0) + 0.05, 5.0))

    def _take(self) -> None:
        collection = self.db[STATE]
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
            raise LockHeld(_held(collection.find_one({"_id": LOCK_ID}))) from exc

    def renew(self) -> None:
        result = self.db[STATE].update_one(
            {"_id": LOCK_ID, "owner": self.owner},
            {"$set": {"expires_at": utc_now() + self.duration}},
        )
        if result.matched_count == 0:
            raise LockHeld(
                "the migration lock was taken over by another run (--force-unlock or an "
                "expired lease); stopping so the two runs do not overlap"
            )

    def write_state(self, update: dict[str, Any]) -> None:
        """Update the migration's state document only while the lock names this holder (no
        other run or `finish` took it since) and the legacy turns were not dropped; raise
        LockHeld otherwise, writing nothing."""
        result = self.db[STATE].update_one(
            {"_id": STATE_ID, "holder": self.owner, "dropped_at": {"$exists": False}}, update
        )
        if result.matched_count == 0:
            raise LockHeld(
                "the migration lock was taken over by another run or `finish` (--force-unlock "
                "or an expired lease), or the legacy turns were dropped; stopping without "
                "writing the migration's state"
            )

    def release(self) -> None:
        self.db[STATE].delete_one({"_id": LOCK_ID, "owner": self.owner})


def current(db: Database[dict[str, Any]]) -> dict[str, Any] | None:
    return db[STATE].find_one({"_id": LOCK_ID})


def _held(lock: dict[str, Any] | None) -> str:
    return (
        f"another migration run holds the lock: {describe(lock)}. Wait for it to finish; if "
        "that process is gone, wait for the lease to expire or take it over with "
        "`run --force-unlock`"
    )


def refuse_while_held(db: Database[dict[str, Any]], doing: str) -> None:
    """LockHeld, reading only, while a run or `finish` holds the lock (its lease not ended):
    what a command reads then is what that run is still writing or moving aside. `doing`
    says what the refused command does not do meanwhile."""
    lock = current(db)
    if lock is None or _expired(lock):  # a killed holder's: the next run or `finish` takes it
        return
    raise LockHeld(f"{_held(lock)}; {doing}")


def _expired(lock: dict[str, Any]) -> bool:
    """Whether the lock's lease has ended (its holder killed): another run may take it."""
    expires = lock.get("expires_at")
    return isinstance(expires, datetime) and expires < utc_now()
