"""`python -m app`: serve the API with uvicorn on the configured (or embedded) database.

On the embedded database an empty store gets demo conversations, so a first run
shows a working product; set AGENT_STORE_DEMO_DATA=false to start empty.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets

import uvicorn

from app.api import create_app
from app.examples import EXAMPLE_USER_ID
from app.settings import Settings


def event_loop() -> str:
    """uvloop when it is installed (`pip install '.[uvloop]'`), else asyncio's own loop."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


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
    where = settings.mongodb_uri or f"the embedded server ({settings.data_dir}/)"
    base = f"http://{settings.host}:{settings.port}"
    print(f"Serving on {base} with data in {where}")
    print(f"  API:    {base}/v1/users/{EXAMPLE_USER_ID}/conversations  (Authorization: Bearer …)")
    print(f"  Schema: {base}/openapi.json")
    print(f"  Viewer: {base}/viewer  (sign in with the token)")
    if settings.demo_data:
        print("  Demo conversations are loaded if the store is empty.")
    print(f"  Event loop: {event_loop()}")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, loop=event_loop())


if __name__ == "__main__":
    main()
