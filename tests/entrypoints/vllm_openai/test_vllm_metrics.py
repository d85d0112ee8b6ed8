# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# kestrel: ported from vLLM's tests/entrypoints/openai/test_metrics.py. Kestrel's metrics are named
#   `kestrel:*` where vLLM's are `vllm:*` (each name below is changed so).
# kestrel: dropped, and why:
#   - the "multimodal" model (HuggingFaceTB/SmolVLM-256M-Instruct) and EXPECTED_METRICS_MM: no
#     multimodal models in Kestrel; with it the local_asset_server fixture (images).
#   - the server parameters "--disable-frontend-multiprocessing" and
#     "--show-hidden-metrics-for-version": vLLM flags; "--enable-chunked-prefill": it would start
#     a second server for the same checks (one server per module on the 2-core CI machine).
#   - test_metrics_exist_run_batch: vLLM's offline batch runner (run_batch) with an embedding model.

import asyncio
from http import HTTPStatus

import httpx2 as requests  # kestrel: httpx2 in place of requests (not installed)
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .vllm_compat import RemoteOpenAIServer, get_tokenizer  # kestrel: Kestrel's server, its tokenizer

# kestrel: a server process per module; async tests run by anyio's plugin (no pytest-asyncio here)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.anyio]

MODELS = {
    "text": "SmolLM2-135M-Instruct",  # kestrel: the default model (vLLM: TinyLlama/TinyLlama-1.1B-Chat-v1.0)
}


@pytest.fixture(scope="module", params=list(MODELS.keys()))
def model_key(request):
    yield request.param


@pytest.fixture(scope="module")
def default_server_args():
    return [
        # use half precision for speed and memory savings in CI environment
        "--dtype",
        "float32",  # kestrel: float32 on CPU (vLLM: bfloat16)
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--max-num-seqs",
        "128",
    ]


@pytest.fixture(
    scope="module",
    params=[
        "",
    ],
)
def server(model_key, default_server_args, request):
    if request.param:
        default_server_args.append(request.param)

    model_name = MODELS[model_key]
    with RemoteOpenAIServer(model_name, default_server_args) as remote_server:
        yield remote_server


@pytest.fixture  # kestrel: pytest_asyncio.fixture
async def client(server):
    async with server.get_async_client() as cl:
        yield cl


_PROMPT = "Hello my name is Robert and I love magic"


def _get_expected_values(num_requests: int, prompt_ids: list[int], max_tokens: int):
    num_prompt_tokens = len(prompt_ids)

    # {metric_family: [(suffix, expected_value)]}
    return {
        "kestrel:time_to_first_token_seconds": [("_count", num_requests)],
        "kestrel:time_per_output_token_seconds": [
            ("_count", num_requests * (max_tokens - 1))
        ],
        "kestrel:e2e_request_latency_seconds": [("_count", num_requests)],
        "kestrel:request_queue_time_seconds": [("_count", num_requests)],
        "kestrel:request_inference_time_seconds": [("_count", num_requests)],
        "kestrel:request_prefill_time_seconds": [("_count", num_requests)],
        "kestrel:request_decode_time_seconds": [("_count", num_requests)],
        "kestrel:request_prompt_tokens": [
            ("_sum", num_requests * num_prompt_tokens),
            ("_count", num_requests),
        ],
        "kestrel:request_generation_tokens": [
            ("_sum", num_requests * max_tokens),
            ("_count", num_requests),
        ],
        "kestrel:request_params_n": [("_count", num_requests)],
        "kestrel:request_params_max_tokens": [
            ("_sum", num_requests * max_tokens),
            ("_count", num_requests),
        ],
        "kestrel:iteration_tokens_total": [
            (
                "_sum",
                num_requests * (num_prompt_tokens + max_tokens),
            ),
            ("_count", num_requests * max_tokens),
        ],
        "kestrel:prompt_tokens": [("_total", num_requests * num_prompt_tokens)],
        "kestrel:generation_tokens": [("_total", num_requests * max_tokens)],
        "kestrel:request_success": [("_total", num_requests)],
    }


@pytest.mark.asyncio
async def test_metrics_counts(
    server: RemoteOpenAIServer,
    client: openai.AsyncClient,
    model_key: str,
):
    if model_key == "multimodal":
        pytest.skip("Unnecessary test")

    model_name = MODELS[model_key]
    tokenizer = get_tokenizer(model_name)  # kestrel: vLLM: AutoTokenizer.from_pretrained(model_name)
    prompt_ids = tokenizer.encode(_PROMPT)
    num_requests = 10
    max_tokens = 10

    for _ in range(num_requests):
        # sending a request triggers the metrics to be logged.
        await client.completions.create(
            model=model_name,
            prompt=prompt_ids,
            max_tokens=max_tokens,
        )

    response = requests.get(server.url_for("metrics"))
    print(response.text)
    assert response.status_code == HTTPStatus.OK

    # Loop over all expected metric_families
    expected_values = _get_expected_values(num_requests, prompt_ids, max_tokens)
    for metric_family, suffix_values_list in expected_values.items():
        if metric_family not in EXPECTED_METRICS_V1 or (
            not server.show_hidden_metrics
            and metric_family in HIDDEN_DEPRECATED_METRICS
        ):
            continue

        found_metric = False

        # Check to see if the metric_family is found in the prom endpoint.
        for family in text_string_to_metric_families(response.text):
            if family.name == metric_family:
                found_metric = True

                # Check that each suffix is found in the prom endpoint.
                for suffix, expected_value in suffix_values_list:
                    metric_name_w_suffix = f"{metric_family}{suffix}"
                    found_suffix = False

                    for sample in family.samples:
                        if sample.name == metric_name_w_suffix:
                            found_suffix = True

                            # For each suffix, value sure the value matches
                            # what we expect.
                            assert sample.value == expected_value, (
                                f"{metric_name_w_suffix} expected value of "
                                f"{expected_value} did not match found value "
                                f"{sample.value}"
                            )
                            break
                    assert found_suffix, (
                        f"Did not find {metric_name_w_suffix} in prom endpoint"
                    )
                break

        assert found_metric, f"Did not find {metric_family} in prom endpoint"


EXPECTED_METRICS_V1 = [
    "kestrel:num_requests_running",
    "kestrel:num_requests_waiting",
    "kestrel:gpu_cache_usage_perc",
    "kestrel:gpu_prefix_cache_queries",
    "kestrel:gpu_prefix_cache_hits",
    "kestrel:kv_cache_usage_perc",
    "kestrel:prefix_cache_queries",
    "kestrel:prefix_cache_hits",
    "kestrel:num_preemptions_total",
    "kestrel:prompt_tokens_total",
    "kestrel:generation_tokens_total",
    "kestrel:iteration_tokens_total",
    "kestrel:cache_config_info",
    "kestrel:request_success_total",
    "kestrel:request_prompt_tokens_sum",
    "kestrel:request_prompt_tokens_bucket",
    "kestrel:request_prompt_tokens_count",
    "kestrel:request_generation_tokens_sum",
    "kestrel:request_generation_tokens_bucket",
    "kestrel:request_generation_tokens_count",
    "kestrel:request_params_n_sum",
    "kestrel:request_params_n_bucket",
    "kestrel:request_params_n_count",
    "kestrel:request_params_max_tokens_sum",
    "kestrel:request_params_max_tokens_bucket",
    "kestrel:request_params_max_tokens_count",
    "kestrel:time_per_output_token_seconds_sum",
    "kestrel:time_per_output_token_seconds_bucket",
    "kestrel:time_per_output_token_seconds_count",
    "kestrel:time_to_first_token_seconds_sum",
    "kestrel:time_to_first_token_seconds_bucket",
    "kestrel:time_to_first_token_seconds_count",
    "kestrel:inter_token_latency_seconds_sum",
    "kestrel:inter_token_latency_seconds_bucket",
    "kestrel:inter_token_latency_seconds_count",
    "kestrel:e2e_request_latency_seconds_sum",
    "kestrel:e2e_request_latency_seconds_bucket",
    "kestrel:e2e_request_latency_seconds_count",
    "kestrel:request_queue_time_seconds_sum",
    "kestrel:request_queue_time_seconds_bucket",
    "kestrel:request_queue_time_seconds_count",
    "kestrel:request_inference_time_seconds_sum",
    "kestrel:request_inference_time_seconds_bucket",
    "kestrel:request_inference_time_seconds_count",
    "kestrel:request_prefill_time_seconds_sum",
    "kestrel:request_prefill_time_seconds_bucket",
    "kestrel:request_prefill_time_seconds_count",
    "kestrel:request_decode_time_seconds_sum",
    "kestrel:request_decode_time_seconds_bucket",
    "kestrel:request_decode_time_seconds_count",
]

HIDDEN_DEPRECATED_METRICS: list[str] = [
    "kestrel:gpu_cache_usage_perc",
    "kestrel:gpu_prefix_cache_queries",
    "kestrel:gpu_prefix_cache_hits",
    "kestrel:time_per_output_token_seconds_sum",
    "kestrel:time_per_output_token_seconds_bucket",
    "kestrel:time_per_output_token_seconds_count",
]


@pytest.mark.asyncio
async def test_metrics_exist(
    server: RemoteOpenAIServer,
    client: openai.AsyncClient,
    model_key: str,
):
    model_name = MODELS[model_key]

    # sending a request triggers the metrics to be logged.
    await client.completions.create(
        model=model_name,
        prompt="Hello, my name is",
        max_tokens=5,
        temperature=0.0,
    )

    response = requests.get(server.url_for("metrics"))
    assert response.status_code == HTTPStatus.OK

    expected_metrics = EXPECTED_METRICS_V1

    for metric in expected_metrics:
        if metric in HIDDEN_DEPRECATED_METRICS and not server.show_hidden_metrics:
            continue
        assert metric in response.text


@pytest.mark.asyncio
async def test_abort_metrics_reset(
    server: RemoteOpenAIServer,
    client: openai.AsyncClient,
    model_key: str,
):
    model_name = MODELS[model_key]
    tokenizer = get_tokenizer(model_name)  # kestrel: vLLM: AutoTokenizer.from_pretrained(model_name)
    prompt_ids = tokenizer.encode(_PROMPT)

    running_requests, waiting_requests, kv_cache_usage = _get_running_metrics_from_api(
        server,
    )

    # Expect no running requests or kvcache usage
    assert running_requests == 0
    assert waiting_requests == 0
    assert kv_cache_usage == 0.0

    # Start some long-running requests that we can abort
    tasks = []
    for _ in range(3):
        task = asyncio.create_task(
            client.completions.create(
                model=model_name,
                prompt=prompt_ids,
                max_tokens=100,  # Long generation to give time to abort
                temperature=0.0,
            )
        )
        tasks.append(task)

    # Wait a bit for requests to start processing
    await asyncio.sleep(0.5)

    # Check that we have running requests
    running_requests, waiting_requests, kv_cache_usage = _get_running_metrics_from_api(
        server,
    )

    # Expect running requests and kvcache usage
    assert running_requests > 0
    assert kv_cache_usage > 0

    # Cancel all tasks to abort the requests
    for task in tasks:
        task.cancel()

    # Wait for cancellations to be processed
    await asyncio.sleep(1.0)

    # Check that metrics have reset to zero
    response = requests.get(server.url_for("metrics"))
    assert response.status_code == HTTPStatus.OK

    # Verify running and waiting requests counts and KV cache usage are zero
    running_requests_after, waiting_requests_after, kv_cache_usage_after = (
        _get_running_metrics_from_api(server)
    )

    assert running_requests_after == 0, (
        f"Expected 0 running requests after abort, got {running_requests_after}"
    )
    assert waiting_requests_after == 0, (
        f"Expected 0 waiting requests after abort, got {waiting_requests_after}"
    )
    assert kv_cache_usage_after == 0, (
        f"Expected 0% KV cache usage after abort, got {kv_cache_usage_after}"
    )


def _get_running_metrics_from_api(server: RemoteOpenAIServer):
    """Return (running_count, waiting_count, kv_cache_usage)"""

    response = requests.get(server.url_for("metrics"))
    assert response.status_code == HTTPStatus.OK

    # Verify running and waiting requests counts and KV cache usage are zero
    running_requests, waiting_requests, kv_cache_usage = None, None, None

    kv_cache_usage_metric = "kestrel:kv_cache_usage_perc"

    for family in text_string_to_metric_families(response.text):
        if family.name == "kestrel:num_requests_running":
            for sample in family.samples:
                if sample.name == "kestrel:num_requests_running":
                    running_requests = sample.value
                    break
        elif family.name == "kestrel:num_requests_waiting":
            for sample in family.samples:
                if sample.name == "kestrel:num_requests_waiting":
                    waiting_requests = sample.value
                    break
        elif family.name == kv_cache_usage_metric:
            for sample in family.samples:
                if sample.name == kv_cache_usage_metric:
                    kv_cache_usage = sample.value
                    break

    assert running_requests is not None
    assert waiting_requests is not None
    assert kv_cache_usage is not None

    return running_requests, waiting_requests, kv_cache_usage
