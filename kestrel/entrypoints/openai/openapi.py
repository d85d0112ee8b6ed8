"""The server's OpenAPI document (/openapi.json, /docs): every request body and every response, with
the protocol's models, as vLLM's.

The POST handlers read their bodies themselves (`serving_engine.read_json`: a size limit while
reading, a nesting-depth check), so FastAPI never sees the request models. Each such route names its
body with `openapi_extra=request_body(Model)`, and `add_models` adds those models' schemas to the
document's components, beside the response models FastAPI adds from `responses=` (and the streamed
chunks, which no route names as a model either).

Streamed responses (`"stream": true`) are `text/event-stream`; their schema describes one event, as
Open API before 3.2 has it: a `data` field that is a JSON chunk, an error, or the closing `[DONE]`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kestrel.entrypoints.openai.protocol import ErrorResponse

COMPONENT_REF = "#/components/schemas/{model}"

ERROR_DESCRIPTIONS = {
    400: "Bad input: malformed or too deeply nested JSON, wrong types, invalid values, a prompt (plus "
         "max_tokens) over the model's context length",
    401: "A missing or wrong API key (when the server has one)",
    404: "No such model (or trace, or profiler)",
    413: "The request body is over the server's limit (--max-body-bytes)",
    429: "The server has --max-queued-requests requests waiting; retry later",
    500: "The engine failed while running the request",
    503: "The engine no longer serves (it failed or is shutting down)",
}
# What a route that generates can answer besides 200.
GENERATION_ERRORS = (400, 401, 404, 413, 429, 500, 503)


def component_ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": COMPONENT_REF.format(model=model.__name__)}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra` of a route whose handler reads a JSON body of `model` itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": component_ref(model)}}}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAI-shaped error bodies (`serving_engine.error_response`) for these statuses."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


def json_or_event_stream(model: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    """A 200 that is `model` as JSON, or with `"stream": true`, a stream of `chunk` events."""
    event_data = {"anyOf": [
        {"const": "[DONE]", "description": "the last event"},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [component_ref(chunk), component_ref(ErrorResponse)]},
         "description": f"a {chunk.__name__}, or an error once the response has begun"},
    ]}
    event = {"type": "object", "required": ["data"], "properties": {"data": event_data},
             "description": "one server-sent event (`data: ...`)"}
    return {"model": model, "description": f"A {model.__name__}, or with `\"stream\": true`, server-sent "
                                          f"events of {chunk.__name__}s ending with `data: [DONE]`",
            "content": {"text/event-stream": {"schema": event}}}


def add_models(app: FastAPI, requests: list[type[BaseModel]], chunks: list[type[BaseModel]]) -> None:
    """Have `app.openapi()` hold the request and streamed-chunk models (and the models they use) in its
    components, and no 422 responses: FastAPI documents one for a route with parameters, but every
    validation error here is answered 400 (see `build_app`)."""
    modes = [(m, "validation") for m in requests] + [(m, "serialization") for m in chunks]
    _, definitions = models_json_schema(modes, ref_template=COMPONENT_REF)
    request_schemas: dict[str, Any] = definitions.get("$defs", {})
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        document = generate()  # FastAPI's own, cached on the app: the steps below are idempotent
        add_component_schemas(document, request_schemas)
        drop_validation_error_responses(document)
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def add_component_schemas(document: dict[str, Any], schemas: dict[str, Any]) -> None:
    # Every model is protocol.py's, so a name is one model: one FastAPI already has (a response model
    # that a chunk uses too) keeps FastAPI's schema.
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in schemas.items():
        components.setdefault(name, schema)


def drop_validation_error_responses(document: dict[str, Any]) -> None:
    for path in document.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
