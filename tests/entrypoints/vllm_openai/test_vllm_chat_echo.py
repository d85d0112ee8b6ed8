# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# kestrel: ported from vLLM's tests/entrypoints/openai/chat_completion/test_chat_echo.py.
# kestrel: nothing dropped; the echo test decodes greedily. test_prompt_logprobs (prompt_logprobs: -1,
#   the whole vocabulary) checks Kestrel's 400 instead: its engine returns at most 20 logprobs per prompt token
#   (kestrel/sampling_params.py MAX_PROMPT_LOGPROBS), whatever --max-logprobs.

from typing import NamedTuple

import openai  # use the official client for correctness check
import pytest

from .vllm_compat import RemoteOpenAIServer, get_tokenizer  # kestrel: Kestrel's server, its tokenizer

# kestrel: a server process per module; async tests run by anyio's plugin (no pytest-asyncio here)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.anyio]

# # any model with a chat template should work here
MODEL_NAME = "SmolLM2-135M-Instruct"  # kestrel: the default model (vLLM: Qwen/Qwen2-1.5B-Instruct)


def get_vocab_size(model_name):
    return len(get_tokenizer(model_name))  # kestrel: the tokenizer's (vLLM: ModelConfig(model).get_vocab_size())


@pytest.fixture(scope="module")
def server():
    args = [
        # use half precision for speed and memory savings in CI environment
        "--dtype",
        "float32",  # kestrel: float32 on CPU (vLLM: float16)
        "--enforce-eager",
        "--max-model-len",
        "4080",
        "--max-logprobs",  # test prompt_logprobs equal to -1
        "49152",  # kestrel: SmolLM2's vocabulary (vLLM: Qwen2's, 151936)
    ]

    with RemoteOpenAIServer(MODEL_NAME, args) as remote_server:
        yield remote_server


@pytest.fixture  # kestrel: pytest_asyncio.fixture
async def client(server):
    async with server.get_async_client() as async_client:
        yield async_client


class TestCase(NamedTuple):
    model_name: str
    echo: bool


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "test_case",
    [
        TestCase(model_name=MODEL_NAME, echo=True),
        TestCase(model_name=MODEL_NAME, echo=False),
    ],
)
async def test_chat_session_with_echo_and_continue_final_message(
    client: openai.AsyncOpenAI, test_case: TestCase
):
    saying: str = "Here is a common saying about apple. An apple a day, keeps"
    # test echo with continue_final_message parameter
    chat_completion = await client.chat.completions.create(
        model=test_case.model_name,
        messages=[
            {"role": "user", "content": "tell me a common saying"},
            {"role": "assistant", "content": saying},
        ],
        extra_body={
            "echo": test_case.echo,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        # kestrel: greedy. Sampled at temperature 1, whether a 135M model ends the saying before
        # max_model_len (4080 tokens) depends on the draw (vLLM's Qwen2-1.5B ends it either way).
        temperature=0,
    )
    assert chat_completion.id is not None
    assert len(chat_completion.choices) == 1

    choice = chat_completion.choices[0]
    assert choice.finish_reason == "stop"

    message = choice.message
    if test_case.echo:
        assert message.content is not None and saying in message.content
    else:
        assert message.content is not None and saying not in message.content
    assert message.role == "assistant"


@pytest.mark.asyncio
async def test_prompt_logprobs(client: openai.AsyncOpenAI):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Beijing is the capital of which country?"},
    ]

    # kestrel: at most 20 prompt logprobs per token (MAX_PROMPT_LOGPROBS): -1 is a 400 naming the field.
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        await client.chat.completions.create(
            model=MODEL_NAME, messages=messages, extra_body={"prompt_logprobs": -1}
        )
    completion = await client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 20}
    )

    assert completion.prompt_logprobs is not None
    assert len(completion.prompt_logprobs) > 0


@pytest.mark.asyncio
async def test_top_logprobs(client: openai.AsyncOpenAI):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Beijing is the capital of which country?"},
    ]

    completion = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=1,
        # kestrel: True, not "true": request fields are strictly typed (a string is not a boolean), as OpenAI's.
        extra_body={"top_logprobs": -1, "logprobs": True},
    )
    assert completion.choices[0].logprobs is not None
    assert completion.choices[0].logprobs.content is not None
    assert len(completion.choices[0].logprobs.content) > 0
    assert len(
        completion.choices[0].logprobs.content[0].top_logprobs
    ) == get_vocab_size(MODEL_NAME)
