"""`python -m app`: serve the API with uvicorn on the configured (or embedded) database."""

from __future__ import annotations

import secrets

import uvicorn

from app.api import create_app
from app.settings import Settings


def main() -> None:
    settings = Settings()
    if not settings.service_tokens:
        token = "dev-" + secrets.token_urlsafe(24)
        settings = settings.model_copy(update={"service_tokens": [token]})
        print(f"No AGENT_STORE_SERVICE_TOKENS set; development token for this run: {token}")
    where = settings.mongodb_uri or f"the embedded server ({settings.data_dir}/)"
    print(f"Serving on http://{settings.host}:{settings.port} with data in {where}")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port)


if __name__ == "__main__":
    main()
