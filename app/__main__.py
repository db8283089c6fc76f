"""`python -m app`: serve the API with uvicorn on the configured (or embedded) database.

On the embedded database an empty store gets demo conversations, so a first run
shows a working product; set AGENT_STORE_DEMO_DATA=false to start empty. The
embedded server starts before the API, so the banner prints its URI beside the
API's: any MongoDB client (the Node.js driver of a TypeScript app, `mongosh`)
reads the same data. Weak or incomplete configuration stops it before it serves
(exit status 2). The same application is what `uvicorn --factory
app.api:create_app` serves.
"""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import sys
from contextlib import AsyncExitStack

import uvicorn

from agent_store.embedded import URI_FILE, DataDirectoryInUse, embedded_mongodb
from agent_store.store import redact_uri
from app.api import create_app
from app.examples import EXAMPLE_USER_ID
from app.logs import configure_logging
from app.settings import ConfigurationError, Settings, settings_from_environment, uvicorn_options

CONFIGURATION_REFUSED = 2


def start_banner(
    settings: Settings, *, dev_token: str | None, embedded_uri: str | None = None
) -> list[str]:
    """What `python -m app` prints when it starts: URLs, never a password."""
    lines = []
    if dev_token is not None:
        lines.append(
            f"No AGENT_STORE_SERVICE_TOKENS set; development token for this run: {dev_token}"
        )
    where = (
        f"the embedded server ({settings.data_dir}/)"
        if embedded_uri is not None or not settings.mongodb_uri
        else redact_uri(settings.mongodb_uri)
    )
    # An IPv6 address is bracketed in a URL (RFC 3986), as uvicorn's own line does it.
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    base = f"http://{host}:{settings.port}"
    lines += [
        f"Serving on {base} with data in {where}",
        f"  API:     {base}/v1/users/{EXAMPLE_USER_ID}/conversations  (Authorization: Bearer …)",
    ]
    if embedded_uri is not None:
        lines.append(
            f"  MongoDB: {embedded_uri}  (database `{settings.database}`; "
            f"also in {settings.data_dir / URI_FILE})"
        )
    if settings.expose_openapi:
        lines.append(f"  Schema:  {base}/openapi.json")
    if settings.expose_docs:
        lines.append(f"  Docs:    {base}/docs")
    if settings.metrics != "off":
        lines.append(f"  Metrics: {base}/metrics")
    lines.append(f"  Viewer:  {base}/viewer  (sign in with the token)")
    lines.append(f"  Event loop: {event_loop()}")
    if settings.demo_data:
        lines.append("  Demo conversations are loaded if the store is empty.")
    return lines


class _Terminated(BaseException):
    """SIGTERM, raised where the service is: the embedded server closes (its published URI
    withdrawn) before the process ends by the signal."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


async def serve(settings: Settings, *, dev_token: str | None) -> None:
    """One process: start the embedded server when no URI is set, print where, serve.

    uvicorn shuts down on SIGTERM, then raises it again with the handler it found: this
    one, so the embedded server is closed on the way out (`main` ends by the signal)."""
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        await _serve(settings, dev_token=dev_token)
    finally:
        signal.signal(signal.SIGTERM, previous)


async def _serve(settings: Settings, *, dev_token: str | None) -> None:
    async with AsyncExitStack() as stack:
        embedded_uri = None
        if settings.mongodb_uri is None:
            embedded_uri = await stack.enter_async_context(embedded_mongodb(settings.data_dir))
            settings = settings.model_copy(update={"mongodb_uri": embedded_uri})
        app = create_app(settings)
        banner = start_banner(settings, dev_token=dev_token, embedded_uri=embedded_uri)
        print("\n".join(banner), flush=True)
        options = uvicorn_options(settings) | {"workers": 1, "factory": False}
        await uvicorn.Server(uvicorn.Config(app, **options)).serve()


def event_loop() -> str:
    """uvloop when it is installed (`pip install '.[uvloop]'`), else asyncio's own loop."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def main() -> None:
    try:
        settings, dev_token = settings_from_environment()
        configure_logging(settings.log_level)
        if settings.workers > 1:  # a real database only (settings refuse the embedded one)
            print("\n".join(start_banner(settings, dev_token=dev_token)), flush=True)
            uvicorn.run("app.api:create_app", **uvicorn_options(settings), loop=event_loop())
        elif event_loop() == "uvloop":
            import uvloop

            uvloop.run(serve(settings, dev_token=dev_token))
        else:
            asyncio.run(serve(settings, dev_token=dev_token))
    except ConfigurationError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        sys.exit(CONFIGURATION_REFUSED)
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    except DataDirectoryInUse as exc:  # another process runs the embedded server on it
        print(f"invalid configuration: data_dir: {exc}", file=sys.stderr)
        sys.exit(CONFIGURATION_REFUSED)


if __name__ == "__main__":
    main()
