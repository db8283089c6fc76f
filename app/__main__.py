"""`python -m app`: serve the API with uvicorn on the configured (or embedded) database.

On the embedded database an empty store gets demo conversations, so a first run
shows a working product; set AGENT_STORE_DEMO_DATA=false to start empty. The
embedded server starts before the API, so the banner prints its URI beside the
API's: any MongoDB client (the Node.js driver of a TypeScript app, `mongosh`)
reads the same data.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from contextlib import AsyncExitStack

import uvicorn

from agent_store.embedded import URI_FILE, embedded_mongodb
from app.api import create_app
from app.examples import EXAMPLE_USER_ID
from app.settings import Settings


def _banner(settings: Settings, embedded_uri: str | None) -> list[str]:
    base = f"http://{settings.host}:{settings.port}"
    where = f"the embedded server ({settings.data_dir}/)" if embedded_uri else "MONGODB_URI"
    lines = [
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


async def serve(settings: Settings) -> None:
    """Start the embedded server when no URI is set, print where everything is, serve."""
    async with AsyncExitStack() as stack:
        embedded_uri = None
        if settings.mongodb_uri is None:
            embedded_uri = await stack.enter_async_context(embedded_mongodb(settings.data_dir))
            settings = settings.model_copy(update={"mongodb_uri": embedded_uri})
        print("\n".join(_banner(settings, embedded_uri)), flush=True)
        config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port)
        await uvicorn.Server(config).serve()


def main() -> None:
    # Audit lines (logger `agent_store.audit`) go to stderr beside uvicorn's access log.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = Settings()
    if settings.mongodb_uri is None and "AGENT_STORE_DEMO_DATA" not in os.environ:
        settings = settings.model_copy(update={"demo_data": True})
    if not settings.service_tokens and not settings.named_service_tokens:
        token = "dev-" + secrets.token_urlsafe(24)
        settings = settings.model_copy(update={"service_tokens": [token]})
        print(f"No AGENT_STORE_SERVICE_TOKENS set; development token for this run: {token}")
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
