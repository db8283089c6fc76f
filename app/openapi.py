"""`/openapi.json`, built from the route declarations and the pydantic models' JSON Schemas.

Nothing here is written by hand per route: parameters come from the query
models, bodies and responses from the models the handlers validate and return,
so the document cannot drift from what the service does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from agent_store.core import Identifier
from app.http_errors import ERROR_CODES, ApiErrorBody

if TYPE_CHECKING:
    from collections.abc import Sequence

    from app.routing import Endpoint

REF_TEMPLATE = "#/components/schemas/{model}"
_COMMON_ERRORS = ("internal_error", "storage_failure", "storage_unavailable")
_PATH_PARAM = re.compile(r"{(\w+)}")
ETAG = {
    "description": (
        "The conversation's version, a quoted opaque tag: the same for the life of the "
        "conversation, another for one started again under its id. Send it as If-Match."
    ),
    "schema": {"type": "string"},
}
IF_MATCH = {
    "name": "If-Match",
    "in": "header",
    "required": False,
    "description": (
        "The ETag a read served (its quotes may be left out): only the conversation it names "
        "is read or changed, else 412 and nothing changes. `*` or absent: whatever is under "
        "the id. Routes naming no conversation refuse it (422)."
    ),
    "schema": {"type": "string"},
}

IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": (
        "Names what the route writes when the body does not (a turn's `turn_id`, a "
        "delivery's `delivery_id`), as it is when an identifier, else `idempotency-` and its "
        "SHA-256: a retry under the same key is stored once. Naming another than the body's "
        "id, empty, or sent twice, 422; other POST routes refuse it (422)."
    ),
    "schema": {"type": "string"},
}


def _operation_id(method: str, path: str) -> str:
    words = re.sub(r"[{}]", "", path).strip("/").replace("/", "_").replace(".", "_")
    return f"{method.lower()}_{words}"


def _error_codes(endpoint: Endpoint) -> list[str]:
    codes: list[str] = []
    if endpoint.authenticated:
        codes.append("unauthorized")
    if _PATH_PARAM.search(endpoint.path) or endpoint.query.model_fields or endpoint.authenticated:
        codes.append("invalid_input")  # unknown query parameters are refused too
    if endpoint.body.model_fields:
        codes += ["invalid_json", "payload_too_large", "unsupported_media_type"]
    if endpoint.if_match:
        codes.append("precondition_failed")
    return codes + list(endpoint.errors) + list(_COMMON_ERRORS)


Refs = Mapping[tuple[Any, JsonSchemaMode], dict[str, Any]]


def _parameters(endpoint: Endpoint, schemas: dict[str, Any]) -> list[dict[str, Any]]:
    """Path parameters (identifiers) and the query model's fields; its `$defs` go to `schemas`."""
    identifier = TypeAdapter(Identifier).json_schema()
    parameters: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": identifier}
        for name in _PATH_PARAM.findall(endpoint.path)
    ]
    query_schema = endpoint.query.model_json_schema(ref_template=REF_TEMPLATE)
    schemas.update(query_schema.pop("$defs", {}))
    required = set(query_schema.get("required", []))
    for name, prop in query_schema.get("properties", {}).items():
        parameter = {"name": name, "in": "query", "required": name in required}
        if "description" in prop:
            parameter["description"] = prop["description"]
        parameters.append(parameter | {"schema": prop})
    if endpoint.if_match:
        parameters.append(IF_MATCH)
    if endpoint.idempotency_key:
        parameters.append(IDEMPOTENCY_KEY)
    return parameters


def _responses(endpoint: Endpoint, refs: Refs) -> dict[str, Any]:
    """Success shapes by status and media type, then every error code the route may give."""
    responses: dict[str, Any] = {}
    for status, shape in sorted(endpoint.responses.items()):
        by_media: dict[str, type[BaseModel]] = (
            dict(shape) if isinstance(shape, dict) else {"application/json": shape}  # type: ignore[dict-item]
        )
        responses[str(status)] = {
            "description": "OK" if status == 200 else "Created",
            "content": {
                media: {"schema": refs[(model, "serialization")]}
                for media, model in by_media.items()
            },
        }
        if endpoint.serves_etag:
            responses[str(status)]["headers"] = {"ETag": ETAG}
    error_schema = refs[(ApiErrorBody, "serialization")]
    for code in dict.fromkeys(_error_codes(endpoint)):
        status, meaning = ERROR_CODES[code]
        entry = responses.setdefault(
            str(status),
            {"description": "", "content": {"application/json": {"schema": error_schema}}},
        )
        entry["description"] = "; ".join(
            filter(None, [entry["description"], f"`{code}`: {meaning}"])
        )
    return responses


def _operation(endpoint: Endpoint, refs: Refs, schemas: dict[str, Any]) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": _operation_id(endpoint.method, endpoint.path),
        "summary": endpoint.summary,
        "tags": [endpoint.tag],
        "parameters": _parameters(endpoint, schemas),
        "responses": _responses(endpoint, refs),
    }
    if endpoint.body.model_fields:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[(endpoint.body, "validation")]}},
        }
    if not endpoint.authenticated:
        operation["security"] = []
    return operation


def build_openapi(endpoints: Sequence[Endpoint]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `endpoints`."""
    wanted: list[tuple[type[BaseModel], JsonSchemaMode]] = [(ApiErrorBody, "serialization")]
    for endpoint in endpoints:
        if endpoint.body.model_fields:
            wanted.append((endpoint.body, "validation"))
        for shape in endpoint.responses.values():
            models = shape.values() if isinstance(shape, dict) else [shape]
            wanted += [(model, "serialization") for model in models]  # type: ignore[misc]
    refs, definitions = models_json_schema(list(dict.fromkeys(wanted)), ref_template=REF_TEMPLATE)
    schemas: dict[str, Any] = dict(definitions.get("$defs", {}))
    paths: dict[str, dict[str, Any]] = {}
    for endpoint in endpoints:
        operation = _operation(endpoint, refs, schemas)
        paths.setdefault(endpoint.path, {})[endpoint.method.lower()] = operation

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Agent conversation store",
            "version": "1",
            "description": (
                "Admin API of the conversation store. Every /v1 route needs a service bearer "
                "token (Authorize); a request that also carries X-User-JWT sees only that user's "
                "data. The probes /health and /ready answer without a token."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "serviceToken": {"type": "http", "scheme": "bearer"},
                "userToken": {"type": "apiKey", "in": "header", "name": "X-User-JWT"},
            },
        },
        "security": [{"serviceToken": []}, {"serviceToken": [], "userToken": []}],
    }
