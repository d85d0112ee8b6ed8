"""The server's OpenAPI document (issue 20): every route's request body and responses described with
the protocol's models, so that /docs and a fuzzer (test_openapi_fuzz.py) have something to go on.
The document is generated from an app over a stub engine: no model, no server."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest

from kestrel.engine.tracing import API_SERVER, ENGINE_CORE, RequestTrace
from kestrel.entrypoints.openai import protocol
from kestrel.entrypoints.openai.api_server import build_app
from kestrel.entrypoints.openai.serving_engine import APIError, parse_body

REQUEST_BODIES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
                  "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}
# (method, path) -> (the 200's JSON model or None, the error statuses the route answers)
RESPONSES = {
    ("post", "/v1/completions"): ("CompletionResponse", {400, 401, 404, 413, 429, 500, 503}),
    ("post", "/v1/chat/completions"): ("ChatCompletionResponse", {400, 401, 404, 413, 429, 500, 503}),
    ("get", "/v1/models"): ("ModelList", {401}),
    ("get", "/health"): (None, {503}),
    ("get", "/version"): ("VersionResponse", set()),
    ("post", "/tokenize"): ("TokenizeResponse", {400, 404, 413}),
    ("post", "/detokenize"): ("DetokenizeResponse", {400, 404, 413}),
    ("get", "/v1/requests/{request_id}/trace"): ("RequestTraceResponse", {401, 404}),
    ("get", "/v1/requests"): ("RecentRequestList", {400, 401}),
    ("post", "/start_profile"): (None, {404}),
    ("post", "/stop_profile"): (None, {404}),
    ("post", "/reset_prefix_cache"): (None, set()),
    ("get", "/metrics"): (None, set()),
    ("get", "/load"): ("LoadResponse", set()),
    ("get", "/tokenizer_info"): (None, {404}),
}


def stub_engine() -> SimpleNamespace:
    """What build_app reads of an engine while it builds the app."""
    model = SimpleNamespace(max_model_len=128, vocab_size=1000)
    return SimpleNamespace(model_name="stub", config=SimpleNamespace(model=model), tokenizer=None)


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return build_app(stub_engine()).openapi()


def ref(model: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model}"}


def validator(document: dict[str, Any], model: str) -> jsonschema.Draft202012Validator:
    """A validator of the document's schema for `model` (its references resolved in the document)."""
    return jsonschema.Draft202012Validator({**ref(model), "components": document["components"]})


def operations(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(method, path): op for path, item in document["paths"].items() for method, op in item.items()}


def references(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in references(v)]
    if isinstance(node, list):
        return [r for v in node for r in references(v)]
    return []


def test_every_route_is_documented(document):
    assert set(operations(document)) == set(RESPONSES)


def test_each_post_route_with_a_body_names_its_request_model(document):
    for (_, path), op in operations(document).items():
        body = op.get("requestBody")
        if path in REQUEST_BODIES:
            assert body == {"required": True, "content": {"application/json": {"schema": ref(REQUEST_BODIES[path])}}}
        else:
            assert body is None, path


def test_every_reference_resolves_to_a_component(document):
    components = document["components"]["schemas"]
    refs = references(document)
    assert refs
    for r in refs:
        assert r.startswith("#/components/schemas/") and r.rsplit("/", 1)[1] in components, r


def test_each_route_documents_its_200_and_its_errors_in_openai_shape(document):
    for key, op in operations(document).items():
        model, errors = RESPONSES[key]
        responses = op["responses"]
        assert set(responses) == {"200"} | {str(status) for status in errors}, key
        if model is not None:
            assert responses["200"]["content"]["application/json"]["schema"] == ref(model), key
        for status in errors:
            assert responses[str(status)]["content"] == {"application/json": {"schema": ref("ErrorResponse")}}
            assert responses[str(status)]["description"]
    assert "HTTPValidationError" not in document["components"]["schemas"]  # no 422: validation errors are 400s


def test_generating_routes_document_their_event_streams(document):
    for path, chunk in (("/v1/completions", "CompletionChunk"), ("/v1/chat/completions", "ChatCompletionChunk")):
        event = document["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        done, data = event["properties"]["data"]["anyOf"]
        assert done["const"] == "[DONE]"
        assert data["contentMediaType"] == "application/json"
        assert data["contentSchema"] == {"anyOf": [ref(chunk), ref("ErrorResponse")]}


def test_metrics_are_documented_as_text(document):
    assert list(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


@pytest.mark.parametrize("model, body, valid", [
    ("CompletionRequest", {"prompt": "Hello", "max_tokens": 8, "temperature": 0}, True),
    ("CompletionRequest", {"prompt": [[1, 2], [3]], "stream": True, "stream_options": {"include_usage": True}}, True),
    ("CompletionRequest", {"max_tokens": 8}, False),                       # no prompt
    ("CompletionRequest", {"prompt": "Hello", "max_tokens": "8"}, False),  # a string for an integer
    ("CompletionRequest", {"prompt": "Hello", "temperature": False}, False),
    ("CompletionRequest", {"prompt": "Hello", "n": True}, False),
    ("CompletionRequest", {"prompt": [1.0, 2], "max_tokens": 8.0}, True),  # JSON Schema's integers
    ("CompletionRequest", {"prompt": [1.5]}, False),
    ("CompletionRequest", {"prompt": "Hello", "echo": 1}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}, True),
    ("ChatCompletionRequest", {"messages": []}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "robot", "content": "Hi"}]}, True),  # custom roles, as vLLM
    ("ChatCompletionRequest", {"messages": [{"role": 5, "content": "Hi"}]}, False),
    ("TokenizeRequest", {"prompt": "Hello"}, True),
    ("DetokenizeRequest", {"tokens": [1, 2, 3]}, True),
    ("DetokenizeRequest", {"tokens": ["a"]}, False),
])
def test_a_request_schema_accepts_the_types_the_server_accepts(document, model, body, valid):
    assert validator(document, model).is_valid(body) == valid
    try:
        parse_body(getattr(protocol, model), body)
        accepted = True
    except APIError as e:
        assert e.status == 400
        accepted = False
    assert accepted == valid


@pytest.mark.parametrize("changes, valid", [
    ({"n": 128, "logprobs": 20, "top_p": 1, "top_k": -1, "temperature": 0, "presence_penalty": -2}, True),
    ({"prompt": [[0, 1]], "stop": ["\n"], "stop_token_ids": [0], "min_tokens": 0, "max_tokens": 1}, True),
    ({"n": 0}, False), ({"n": 129}, False), ({"logprobs": 21}, False), ({"top_p": 0}, False),
    ({"top_k": -2}, False), ({"temperature": -0.5}, False), ({"frequency_penalty": 2.5}, False),
    ({"repetition_penalty": 0}, False), ({"max_tokens": 0}, False), ({"min_tokens": -1}, False),
    ({"stop": ""}, False), ({"stop": ["a", ""]}, False), ({"stop_token_ids": [-1]}, False),
    ({"prompt": ""}, False), ({"prompt": []}, False), ({"prompt": [[]]}, False), ({"prompt": [-1]}, False),
])
def test_the_completion_schema_states_the_bounds_the_server_checks(document, changes, valid):
    assert validator(document, "CompletionRequest").is_valid({"prompt": "Hello", **changes}) == valid


def test_a_real_trace_matches_the_documented_trace_response(document):
    # The fuzzer sees only 404s here (its request ids are made up): check a trace as the server
    # returns it (api_server.request_trace) against the document.
    trace = RequestTrace("cmpl-1-0")
    trace.add(API_SERVER, "received", 10.0)
    trace.add(ENGINE_CORE, "queued", 10.001, engine=0)
    trace.add(ENGINE_CORE, "scheduled", 10.002, engine=0, cached_tokens=0)
    trace.add(ENGINE_CORE, "step", 10.01, engine=0, tokens=5, prepare_ms=1.0, forward_ms=5.0, sample_ms=0.5)
    trace.add(API_SERVER, "first_token", 10.011)
    trace.add(ENGINE_CORE, "finished", 10.02, engine=0)
    trace.add(API_SERVER, "last_byte", 10.021)
    body = {"id": "cmpl-1", "object": "request.trace", "requests": [trace.to_dict()]}
    validator(document, "RequestTraceResponse").validate(body)
    unfinished = RequestTrace("cmpl-2")
    unfinished.add(API_SERVER, "received", 1.0)
    validator(document, "RequestTraceResponse").validate({"id": "cmpl-2", "object": "request.trace",
                                                          "requests": [unfinished.to_dict()]})
