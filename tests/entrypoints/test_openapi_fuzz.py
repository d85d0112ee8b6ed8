"""schemathesis over the server's own /openapi.json (issue 20): requests generated from each route's
documented body and parameters, valid ones and (where a route takes a body) invalid ones, against a
real server on a tiny random-weight model. No request may get a 5xx or hang, and every answer must
be one the document describes: its status, its content type and its body (for a stream, each event).

The work per request is bounded twice. The server has a short context (MAX_MODEL_LEN): a request that
asks for more tokens is a 400, and one that leaves max_tokens out makes at most MAX_MODEL_LEN minus its
prompt per sample. And a valid request asks for at most MAX_SAMPLES samples of at most MAX_SAMPLES
prompts (`fewer_samples`): the API allows 128 samples of each of any number of prompts, minutes of
work on two cores that cover nothing more (invalid requests keep any `n`, and get their 400 before any
work). So the module takes about 100 s on two cores: 15 s to start the server, 35 s of fuzzing
completions and 20 s of chat (once the CPU kernels are built; the first server to start builds them,
~90 s more).

Each route is a test of its own, driven by Hypothesis over schemathesis's strategy for it (rather
than schemathesis's pytest loader, whose `from_fixture` does not run under pytest 9.2). Routes with
no input (GET /health, ...) have one possible request, which Hypothesis sends once.
"""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.parity import save_tiny_llama
from tests.support.server_process import Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_MODEL_LEN = 64
EXAMPLES_PER_ROUTE = 200
MAX_SAMPLES = 4
REQUEST_TIMEOUT_S = 30  # a request not answered by then is a hang
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]

BODY_ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
               ("POST", "/detokenize")]
OTHER_ROUTES = [("GET", "/v1/models"), ("GET", "/health"), ("GET", "/version"),
                ("GET", "/v1/requests/{request_id}/trace"), ("GET", "/v1/requests"),
                ("POST", "/start_profile"), ("POST", "/stop_profile"),
                ("POST", "/reset_prefix_cache"), ("GET", "/metrics"), ("GET", "/load"), ("GET", "/tokenizer_info")]
FUZZED = ([(method, path, GenerationMode.POSITIVE) for method, path in BODY_ROUTES + OTHER_ROUTES]
          + [(method, path, GenerationMode.NEGATIVE) for method, path in BODY_ROUTES])


def fewer_samples(case: schemathesis.Case) -> schemathesis.Case:
    """A valid generating request cut down to `n`, `best_of` and a number of prompts of at most
    MAX_SAMPLES."""
    body = case.body
    if isinstance(body, dict):
        n = body.get("n")
        if isinstance(n, int | float) and not isinstance(n, bool) and n > MAX_SAMPLES:
            body["n"] = 1 + int(n) % MAX_SAMPLES
        best_of = body.get("best_of")
        if isinstance(best_of, int | float) and not isinstance(best_of, bool) and best_of > MAX_SAMPLES:
            body["best_of"] = MAX_SAMPLES
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
            body["prompt"] = prompt[:MAX_SAMPLES]
    return case


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(folder)
    server = Server("--model", str(folder), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                    "--kv-cache-memory", "16MiB")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def test_every_route_of_the_schema_is_fuzzed(api_schema):
    documented = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert documented == set(BODY_ROUTES + OTHER_ROUTES)


@pytest.mark.parametrize("method, path, mode", FUZZED, ids=[f"{m} {p} {g.value}" for m, p, g in FUZZED])
def test_no_request_gets_a_server_error_a_hang_or_an_undocumented_answer(api_schema, server, method, path, mode):
    statuses: Counter[int] = Counter()
    cases = api_schema[path][method].as_strategy(mode)

    @settings(max_examples=EXAMPLES_PER_ROUTE, derandomize=True, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases.map(fewer_samples) if mode is GenerationMode.POSITIVE else cases)
    def fuzz(case: schemathesis.Case) -> None:
        response = case.call_and_validate(base_url=server.url, timeout=REQUEST_TIMEOUT_S, checks=CHECKS)
        statuses[response.status_code] += 1

    fuzz()
    if (method, path) in BODY_ROUTES and mode is GenerationMode.POSITIVE:
        # Not only 400s: the fuzzer's requests got through to the engine and the tokenizer.
        assert statuses[200] > 0, statuses
