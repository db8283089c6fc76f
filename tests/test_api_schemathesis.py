"""Property-based requests generated from `/openapi.json`, served in-process: never a 5xx.

Every default check of schemathesis runs too (status codes, content types and
bodies as documented), so the document and the service are held to each other,
except `positive_data_acceptance`: the store refuses with 422 values that the
schema cannot describe (a cursor that was never issued, an `after` id from
another conversation, a tool result answering no call, a claim from a user to
the same user), which that check counts as failures.
`/v1/search` is left out: the in-process backend has no full-text search (the
route is tested on the wire backends in test_api.py and test_api_authorization.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from app.api import create_app
from app.service import Store
from tests.api_harness import (
    OWNER,
    SERVICE_TOKEN,
    api_settings,
    auth_headers,
    mongomock_db,
    seed,
    user_token,
)

EXAMPLES_PER_OPERATION = 25

# schemathesis drives ASGI apps through Starlette's TestClient, which now asks for `httpx2`.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Using `httpx` with `starlette.testclient` is deprecated"
)


def _served_schema() -> Any:
    app_settings = api_settings()
    store = Store.on(mongomock_db(), app_settings)
    asyncio.run(seed(store))  # mongomock-motor is bound to no event loop
    app = create_app(app_settings, store=store)
    loaded = schemathesis.openapi.from_asgi("/openapi.json", app, headers=auth_headers())
    return loaded.exclude(path="/v1/search")


schema = _served_schema()


@schema.auth()
class ServiceAndUserTokens:
    """The service token on every request; a generated user token becomes the owner's real one."""

    def get(self, case: schemathesis.Case, context: schemathesis.AuthContext) -> str:
        return SERVICE_TOKEN

    def set(self, case: schemathesis.Case, data: str, context: schemathesis.AuthContext) -> None:
        headers = dict(case.headers or {})
        headers["Authorization"] = f"Bearer {data}"
        if "X-User-JWT" in headers:
            headers["X-User-JWT"] = user_token(OWNER)
        case.headers = headers


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_generated_requests_never_get_a_server_error(case: schemathesis.Case) -> None:
    response = case.call_and_validate(excluded_checks=[positive_data_acceptance])
    assert response.status_code < 500
