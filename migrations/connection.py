"""Which database the migration works on, and the connection to it.

In order: `--uri`; `MONGODB_URI` or `AGENT_STORE_MONGODB_URI` (read as the service reads
them, `migrations.settings`: in any case, an empty one refused); the embedded server a
running service (`make run`) publishes in its data directory (`--data-dir`, else
`AGENT_STORE_DATA_DIR`, default `data/`); else the embedded database of that directory
opened here, for as long as the command runs, its URI published nowhere (when another
process holds that directory, a service starting, the migration waits a few seconds for its
URI, else it is misuse: a migration holding it publishes none). So
`make migrate` after `make run` works on the same data whether the service is still running
or not.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bson.codec_options import DatetimeConversion
from pymongo import MongoClient
from pymongo.database import Database
from pymongo.errors import ConfigurationError, PyMongoError

from agent_store.embedded import (
    DATABASE_FILE,
    URI_FILE,
    DataDirectoryInUse,
    ServerThread,
    published_uri,
)
from agent_store.store import DatabaseSettings, redact_uri
from migrations.errors import Misuse, Unreachable
from migrations.settings import service_environment

MAX_TIMEOUT = 1_000_000
"""Seconds: PyMongo takes a server selection timeout below a billion milliseconds."""


HOLDER_WAIT_SECONDS = 5.0
"""How long a migration waits, when another process holds the data directory, for that
process to publish its embedded server's URI (a service starting) or to let it go."""


def _embedded(data_dir: Path, stack: ExitStack) -> tuple[str, str]:
    deadline = time.monotonic() + HOLDER_WAIT_SECONDS
    while True:
        uri = published_uri(data_dir)
        if uri is not None:
            return uri, f"the embedded server at {uri} (published in {data_dir / URI_FILE})"
        if not (data_dir / DATABASE_FILE).exists():
            raise Misuse(
                "no database given: pass --uri or set MONGODB_URI (or run `make run` first, "
                f"for the embedded database in {data_dir}/)"
            )
        try:
            return _opened_here(data_dir, stack)
        except DataDirectoryInUse as held:
            if time.monotonic() >= deadline:
                raise Misuse(
                    f"the embedded database: {held}; it published no server URI to use "
                    f"within {HOLDER_WAIT_SECONDS:g}s"
                ) from None
        time.sleep(0.2)


def _opened_here(data_dir: Path, stack: ExitStack) -> tuple[str, str]:
    """The embedded database of `data_dir`, opened for this command: its server publishes no
    URI (it ends with the command, under any other process that would use it: a second
    migration finds the directory held), and a failure to close it never takes the place of
    what ended the command (a signal's exit stays the signal's)."""
    uri = stack.enter_context(ServerThread(data_dir, publish=False))
    return uri, f"the embedded database in {data_dir}/ (opened here, at {uri})"


URI_VARIABLES = ("MONGODB_URI", "AGENT_STORE_MONGODB_URI")
"""Where the service reads its connection string, in this order (`app.settings.Settings`)."""


def _given(args: argparse.Namespace, service: DatabaseSettings) -> tuple[str | None, str]:
    """The connection string `--uri` or the service's variables give, and which gave it."""
    if args.uri:
        return args.uri, "--uri"
    return service.mongodb_uri, URI_VARIABLES[0]


@contextmanager
def database(args: argparse.Namespace) -> Iterator[tuple[Any, str]]:
    """The client and a description of where it points, for the duration of a command."""
    if not (math.isfinite(args.timeout) and 0 < args.timeout < MAX_TIMEOUT):
        raise Misuse(
            f"--timeout {args.timeout:g}: the seconds to wait for the server are more than 0 "
            f"and less than {MAX_TIMEOUT}"
        )
    service = service_environment()
    with ExitStack() as stack:
        uri, where = _given(args, service)
        if not uri:
            data_dir = service.data_dir if args.data_dir is None else Path(args.data_dir)
            uri, where = _embedded(data_dir, stack)
        try:  # a legacy date outside Python's range (year 0, 55840) reads as a `DatetimeMS`
            client: MongoClient[dict[str, Any]] = MongoClient(
                uri,
                tz_aware=True,
                datetime_conversion=DatetimeConversion.DATETIME_AUTO,
                serverSelectionTimeoutMS=int(args.timeout * 1000),
            )
        except (ConfigurationError, ValueError, TypeError) as exc:
            # As the service's start refuses them (`app.settings`): a mistyped port,
            # minPoolSize over maxPoolSize are the driver's ValueError.
            raise Unreachable(f"invalid MongoDB URI {redact_uri(uri)!r}: {exc}") from exc
        except OSError as exc:  # the driver reads the TLS files it names (ssl.SSLError too)
            raise Unreachable(
                f"invalid MongoDB URI {redact_uri(uri)!r}: a TLS file it names (tlsCAFile, "
                f"tlsCertificateKeyFile) cannot be read ({exc.strerror or type(exc).__name__})"
            ) from exc
        stack.callback(client.close)
        try:
            client.admin.command("ping")
        except PyMongoError as exc:
            raise Unreachable(
                f"cannot reach MongoDB at {redact_uri(uri)!r} within {args.timeout:g}s: {exc}"
            ) from exc
        yield client, where


def read_as_stored(db: Any) -> Any:
    """`db` reading a text holding bytes that are not valid UTF-8 (MongoDB stores the bytes a
    writer gave unchecked) with each such byte a lone surrogate (`surrogateescape`): a batch
    holding one is read whole (was: `InvalidBSON`, and the command stopped), and no byte is
    replaced or dropped, so no copy or delete takes it for what it is not. No write encodes
    such a text: the conversion names its turn (`agent_store.legacy.not_utf8_at`), and the move
    leaves it where it is (`relocate`). PyMongo's client takes only the strict, lossy handlers;
    a database takes any. A database of no real server (mongomock, which holds Python values
    and decodes nothing) is as it is."""
    if not isinstance(db, Database):
        return db
    return db.with_options(
        codec_options=db.codec_options.with_options(unicode_decode_error_handler="surrogateescape")
    )
