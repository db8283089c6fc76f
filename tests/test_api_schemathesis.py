"""Property-based requests generated from `/openapi.json`, served in-process: never a 5xx.

Every default check of schemathesis runs too (status codes, content types and
bodies as documented), so the document and the service are held to each other,
except `positive_data_acceptance`: the store refuses with 422 values that the
schema cannot describe (a cursor that was never issued, an `after` id from
another conversation, a tool result answering no call, a claim from a user to
the same user), which that check counts as failures.

Beside the bodies the schema describes, the body strategy sends hostile ones:
every integer swapped for one beyond 64 bits, and bodies nested far past the
limit (up to 200,000 levels, as raw bytes). `/v1/search` runs on the wire
server (the in-process backend has no full-text search), with queries made
only of negated terms mixed in.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import positive_data_acceptance

from app.api import create_app
from app.json_body import MAX_BODY_DEPTH
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

HUGE_INTEGERS = st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30])


def _with_integers(value: Any, integer: int) -> Any:
    """`value` with every integer in it (not booleans) replaced by `integer`."""
    if isinstance(value, dict):
        return {key: _with_integers(item, integer) for key, item in value.items()}
    if isinstance(value, list):
        return [_with_integers(item, integer) for item in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return integer
    return value


def _nested(body: dict[str, Any], depth: int) -> bytes:
    """`body` with one more field nested `depth` levels, as bytes (no JSON encoder nests so)."""
    text = json.dumps(body)
    field = '"nested": ' + "[" * depth + "]" * depth
    return (text[:-1] + (", " if body else "") + field + "}").encode()


def hostile_bodies(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy[Any]:
    """The generated body, or the same with integers beyond 64 bits, or nested far too deep."""
    if not isinstance(body, dict):
        return st.just(body)
    return st.one_of(
        st.just(body),
        HUGE_INTEGERS.map(lambda integer: _with_integers(body, integer)),
        st.integers(MAX_BODY_DEPTH, 200_000).map(lambda depth: _nested(body, depth)),
    )


schema.hook("flatmap_body")(hostile_bodies)


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


def negated_searches(context: schemathesis.HookContext, query: Any) -> st.SearchStrategy[Any]:
    """The generated query, or the same with every term of `q` excluded with `-`."""
    if not isinstance(query, dict) or not isinstance(query.get("q"), str):
        return st.just(query)
    words = query["q"].split() or ["a"]
    negated = query | {"q": " ".join("-" + word for word in words)[:500]}
    return st.sampled_from([query, negated, query | {"q": "-a -b"}])


WIRE_OPERATIONS = [
    pytest.param("/v1/search", "GET", id="search"),
    pytest.param("/v1/conversations/{conversation_id}/turns", "POST", id="log-turn"),
    pytest.param("/v1/conversations/{conversation_id}", "PATCH", id="rename"),
]


@pytest.mark.wire
@pytest.mark.parametrize(("path", "method"), WIRE_OPERATIONS)
def test_generated_requests_on_the_wire_server_never_get_a_server_error(
    wire_uri: str, path: str, method: str
) -> None:
    """Where MongoDB's own limits bite: `$text` parsing, 64-bit integers, BSON nesting."""
    app_settings = api_settings(
        mongodb_uri=wire_uri, database=f"generated_{uuid.uuid4().hex[:10]}", demo_data=True
    )
    app = create_app(app_settings)  # its start-up opens the store on the wire server
    loaded = schemathesis.openapi.from_asgi("/openapi.json", app, headers=auth_headers())
    loaded.auth()(ServiceAndUserTokens)
    loaded.hook("flatmap_query")(negated_searches)
    loaded.hook("flatmap_body")(hostile_bodies)

    @given(case=loaded[path][method].as_strategy())
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    def call(case: schemathesis.Case) -> None:
        response = case.call_and_validate(excluded_checks=[positive_data_acceptance])
        assert response.status_code < 500

    call()
