"""Request and response bodies of the OpenAI-compatible API, with OpenAI's field names.

Unknown fields are ignored (clients send many we do not use). Value checks that belong to sampling
live in `SamplingParams.validate()`; here only the shapes and types are checked, strictly, as the
OpenAPI document (/openapi.json) describes them: `"n": true`, `"max_tokens": "16"` or
`"temperature": false` is a 400, as OpenAI's, not 1, 16 or 0 (`16.0` is 16: JSON has one kind of
number, and JSON Schema calls it an integer). The document also states what the server checks
of the values beyond their types (`restricted`: bounds, non-empty prompts), with messages of its own.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_serializer

MAX_N = 128          # samples per prompt
MAX_LOGPROBS = 20    # top logprobs per token, as vLLM's default max_logprobs


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ---- errors ---------------------------------------------------------------------------------------

class ErrorInfo(OpenAIBase):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBase):
    error: ErrorInfo


# ---- requests -------------------------------------------------------------------------------------

class OpenAIRequest(OpenAIBase):
    model_config = ConfigDict(strict=True)


def integral_float_as_int(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer of a request: a JSON number without a fraction (16 or 16.0), never a bool or a string.
Int = Annotated[int, BeforeValidator(integral_float_as_int)]


def restricted(default: Any, **keywords_by_type: dict[str, Any]) -> Any:
    """A field whose values the OpenAPI document restricts beyond their type: `keywords_by_type` (JSON
    Schema keywords by JSON type, e.g. integer={"minimum": 1}) go into each subschema of that type,
    inside unions and arrays too. In the document only: the server checks these itself, with messages
    of its own (`SamplingParams.validate`, serving_*.py), and test_openapi_fuzz's invalid requests
    check that it does."""
    def add(schema: Any) -> None:
        if isinstance(schema, dict):
            schema.update(keywords_by_type.get(schema.get("type"), {}))
            for child in [*schema.get("anyOf", []), schema.get("items")]:
                add(child)

    return Field(default, json_schema_extra=add)


NON_NEGATIVE = {"minimum": 0}

class StreamOptions(OpenAIRequest):
    include_usage: bool | None = False
    # vLLM's: usage on every chunk (of the choices' tokens so far), not only on a last one.
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(OpenAIRequest):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIRequest):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIRequest):
    """vLLM's `structured_outputs` (extra body): exactly one of a JSON schema, any JSON object, a
    regular expression, a list of choices or an EBNF grammar."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(OpenAIRequest):
    """Sampling parameters shared by completions and chat completions."""
    model: str | None = None
    temperature: float | None = restricted(None, number=NON_NEGATIVE)
    top_p: float | None = restricted(None, number={"exclusiveMinimum": 0, "maximum": 1})
    top_k: Int | None = restricted(None, integer={"minimum": -1})  # 0 or -1: no top-k
    min_p: float | None = restricted(None, number={"minimum": 0, "maximum": 1})
    n: Int = restricted(1, integer={"minimum": 1, "maximum": MAX_N})
    stop: str | list[str] | None = restricted(None, string={"minLength": 1})
    stop_token_ids: list[Int] | None = restricted(None, integer=NON_NEGATIVE)
    seed: Int | None = None
    presence_penalty: float | None = restricted(None, number={"minimum": -2, "maximum": 2})
    frequency_penalty: float | None = restricted(None, number={"minimum": -2, "maximum": 2})
    repetition_penalty: float | None = restricted(None, number={"exclusiveMinimum": 0})
    ignore_eos: bool = False
    min_tokens: Int = restricted(0, integer=NON_NEGATIVE)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Token id (as a string, as OpenAI's) → bias added to its logit, clamped to [-100, 100].
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Int] | None = restricted(None, integer=NON_NEGATIVE, array={"minItems": 1})
    bad_words: list[str] | None = restricted(None, string={"minLength": 1})
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's: top-N logprobs of each prompt token (-1: the whole vocabulary, within --max-logprobs),
    # returned as `prompt_logprobs` (of the choice, or of the chat response).
    prompt_logprobs: Int | None = restricted(None, integer={"minimum": -1})
    # vLLM's: tokens in logprobs as "token_id:123" (also --return-tokens-as-token-ids for every request).
    return_tokens_as_token_ids: bool | None = None


PromptInput = str | list[str] | list[Int] | list[list[Int]]


class CompletionRequest(SamplingFields):
    # Text, texts, token ids or lists of token ids; nothing empty.
    prompt: PromptInput = restricted(..., string={"minLength": 1}, array={"minItems": 1}, integer=NON_NEGATIVE)
    # 16 when absent, as OpenAI's and vLLM's; null: to the end of the context.
    max_tokens: Int | None = restricted(16, integer={"minimum": 1})
    logprobs: Int | None = restricted(None, integer={"minimum": 0, "maximum": MAX_LOGPROBS})
    echo: bool = False
    # Samples generated per prompt, of which the n with the highest cumulative logprob are returned;
    # at least n, and not streamed when more than n.
    best_of: Int | None = restricted(None, integer={"minimum": 1, "maximum": MAX_N})


# The one kind of content part served (serving_engine.message_text).
TEXT_PART = {"required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}


# ---- tools (serving_tools.py) ----
# A function's name, as OpenAI restricts it.
FUNCTION_NAME = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")


class FunctionDefinition(OpenAIRequest):
    name: str = FUNCTION_NAME
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(OpenAIRequest):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIRequest):
    name: str


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"]
    function: FunctionName


class FunctionCallParam(OpenAIRequest):
    name: str
    arguments: str  # JSON text


class ToolCallParam(OpenAIRequest):
    """A call of an earlier assistant message, sent back with the conversation."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(OpenAIRequest):
    # "system", "user", "assistant", "developer", "tool", or any other role the chat template knows
    # (vLLM accepts custom roles and leaves them to the template).
    role: str
    content: str | list[dict[str, Any]] | None = restricted(None, object=TEXT_PART)
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = restricted(None, integer={"minimum": 1})
    max_completion_tokens: Int | None = restricted(None, integer={"minimum": 1})
    logprobs: bool = False
    # -1: the whole vocabulary (vLLM's), within --max-logprobs.
    top_logprobs: Int | None = restricted(None, integer={"minimum": -1})
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    # Default: "none" without tools, "auto" with them.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: the last (assistant) message is left open and the model continues it (with
    # add_generation_prompt false); `echo` puts that message's text before the generated one.
    continue_final_message: bool = False
    echo: bool = False


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # with messages: given to the chat template, as on chat completions
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False  # also the tokens as the tokenizer's strings (`token_strs`)
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[Int] = restricted(..., integer=NON_NEGATIVE)


# ---- responses ------------------------------------------------------------------------------------

class PromptTokensDetails(OpenAIBase):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class UsageInfo(OpenAIBase):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details (vLLM's), else absent.
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(OpenAIBase):
    """vLLM's: one token of a prompt position's `prompt_logprobs` (keyed by token id)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionLogprobs(OpenAIBase):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBase):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(OpenAIBase):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBase):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBase):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(OpenAIBase):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBase):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIBase):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(OpenAIBase):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBase):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    system_fingerprint: str | None = None  # as OpenAI's response has them (always null here)
    service_tier: str | None = None


def without_nones(self, handler) -> dict[str, Any]:
    """As OpenAI streams a call's pieces: only the fields a piece has (a client merging the pieces
    would take a null `type` for a new value)."""
    return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(OpenAIBase):
    name: str | None = None
    arguments: str | None = None
    serialize = model_serializer(mode="wrap")(without_nones)


class DeltaToolCall(OpenAIBase):
    """A piece of a streamed call: the first has its id, type and name (and arguments ""), the next
    ones fragments of its arguments."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
    serialize = model_serializer(mode="wrap")(without_nones)


class DeltaMessage(OpenAIBase):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(OpenAIBase):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIBase):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(OpenAIBase):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBase):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kestrel"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBase):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionResponse(OpenAIBase):
    version: str


class TokenizeResponse(OpenAIBase):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class LoadResponse(OpenAIBase):
    server_load: int  # requests being served (vLLM's /load)


class DetokenizeResponse(OpenAIBase):
    prompt: str


class RequestTraceEvent(OpenAIBase):
    """One event of a request's trace; an event carries attributes of its own beside these (a step's
    batch and time split, the engine core's index)."""
    box: str
    name: str
    t_ms: float


class TraceSummary(OpenAIBase):
    ttft_ms: float | None
    e2e_ms: float | None
    queue_ms: float
    steps: int
    prefill_chunks: int
    preemptions: int
    finished: bool


class EngineRequestTrace(OpenAIBase):
    request_id: str
    events: list[RequestTraceEvent]
    boxes_ms: dict[str, float]
    summary: TraceSummary


class RequestTraceResponse(OpenAIBase):
    id: str
    object: Literal["request.trace"] = "request.trace"
    requests: list[EngineRequestTrace]


class RecentRequest(TraceSummary):
    id: str
    boxes_ms: dict[str, float]


class RecentRequestList(OpenAIBase):
    object: Literal["list"] = "list"
    traces: bool  # False: request traces are off (--request-trace-buffer N), the list is empty
    data: list[RecentRequest]
