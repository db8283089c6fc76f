"""`python -m app`: serve the API with uvicorn on the configured (or embedded) database.

On the embedded database an empty store gets demo conversations, so a first run
shows a working product; set AGENT_STORE_DEMO_DATA=false to start empty. The
embedded server starts before the API, so the banner prints its URI beside the
API's: any MongoDB client (the Node.js driver of a TypeScript app, `mongosh`)
reads the same data. Weak or incomplete configuration stops it before it serves
(exit status 2).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from contextlib import AsyncExitStack

import uvicorn
from pydantic import ValidationError

from agent_store.core import describe_validation_error
from agent_store.embedded import URI_FILE, embedded_mongodb
from agent_store.store import redact_uri
from app.api import create_app
from app.examples import EXAMPLE_USER_ID
from app.settings import ConfigurationError, Settings, serving_settings

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
    base = f"http://{settings.host}:{settings.port}"
    lines += [
        f"Serving on {base} with data in {where}",
        f"  API:     {base}/v1/users/{EXAMPLE_USER_ID}/conversations  (Authorization: Bearer …)",
    ]
    if embedded_uri is not None:
        lines.append(
            f"  MongoDB: {embedded_uri}  (database `{settings.database}`; "
            f"also in {settings.data_dir / URI_FILE})"
        )
    lines += [
        f"  Schema:  {base}/openapi.json",
        f"  Viewer:  {base}/viewer  (sign in with the token)",
    ]
    if settings.demo_data:
        lines.append("  Demo conversations are loaded if the store is empty.")
    return lines


async def serve(settings: Settings, *, dev_token: str | None) -> None:
    """Start the embedded server when no URI is set, print where everything is, serve."""
    async with AsyncExitStack() as stack:
        embedded_uri = None
        if settings.mongodb_uri is None:
            embedded_uri = await stack.enter_async_context(embedded_mongodb(settings.data_dir))
            settings = settings.model_copy(update={"mongodb_uri": embedded_uri})
        banner = start_banner(settings, dev_token=dev_token, embedded_uri=embedded_uri)
        print("\n".join(banner), flush=True)
        config = uvicorn.Config(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            access_log=False,
            server_header=False,
        )
        await uvicorn.Server(config).serve()


def main() -> None:
    # One JSON audit line per request (logger `agent_store.audit`) replaces uvicorn's access
    # log, which would keep query strings (search text, a token pasted into a URL).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        settings, dev_token = serving_settings(
            Settings(), demo_explicit="AGENT_STORE_DEMO_DATA" in os.environ
        )
    except ValidationError as exc:
        print(describe_validation_error(exc, subject="configuration"), file=sys.stderr)
        sys.exit(CONFIGURATION_REFUSED)
    except ConfigurationError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        sys.exit(CONFIGURATION_REFUSED)
    asyncio.run(serve(settings, dev_token=dev_token))


if __name__ == "__main__":
    main()
