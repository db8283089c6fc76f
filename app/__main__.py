"""`python -m app`: serve the API with uvicorn on the configured (or embedded) database.

On the embedded database an empty store gets demo conversations, so a first run
shows a working product; set AGENT_STORE_DEMO_DATA=false to start empty.
Weak or incomplete configuration stops it before it serves (exit status 2).
The same application is what `uvicorn --factory app.api:create_app` serves.
"""

from __future__ import annotations

import sys

import uvicorn

from agent_store.store import redact_uri
from app.api import create_app
from app.examples import EXAMPLE_USER_ID
from app.logs import configure_logging
from app.settings import ConfigurationError, Settings, settings_from_environment, uvicorn_options

CONFIGURATION_REFUSED = 2


def start_banner(settings: Settings, *, dev_token: str | None) -> list[str]:
    """What `python -m app` prints when it starts: URLs, never a password."""
    lines = []
    if dev_token is not None:
        lines.append(
            f"No AGENT_STORE_SERVICE_TOKENS set; development token for this run: {dev_token}"
        )
    where = (
        redact_uri(settings.mongodb_uri)
        if settings.mongodb_uri
        else f"the embedded server ({settings.data_dir}/)"
    )
    base = f"http://{settings.host}:{settings.port}"
    lines += [
        f"Serving on {base} with data in {where}",
        f"  API:     {base}/v1/users/{EXAMPLE_USER_ID}/conversations  (Authorization: Bearer …)",
    ]
    if settings.expose_openapi:
        lines.append(f"  Schema:  {base}/openapi.json")
    if settings.expose_docs:
        lines.append(f"  Docs:    {base}/docs")
    if settings.metrics != "off":
        lines.append(f"  Metrics: {base}/metrics")
    lines.append(f"  Viewer:  {base}/viewer  (sign in with the token)")
    if settings.demo_data:
        lines.append("  Demo conversations are loaded if the store is empty.")
    return lines


def main() -> None:
    try:
        settings, dev_token = settings_from_environment()
        target = "app.api:create_app" if settings.workers > 1 else create_app(settings)
    except ConfigurationError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        sys.exit(CONFIGURATION_REFUSED)
    configure_logging(settings.log_level)
    print("\n".join(start_banner(settings, dev_token=dev_token)), flush=True)
    uvicorn.run(target, **uvicorn_options(settings))


if __name__ == "__main__":
    main()
