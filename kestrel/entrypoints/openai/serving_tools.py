"""Tool calling on chat completions, as vLLM serves it: `tools`, `tool_choice`, `parallel_tool_calls`.

    tool_choice   what the model may do               how its output is read
    "none"        answer in text (the template still  as text
                  gets the tools, as vLLM's default)
    "auto"        call tools or answer                by the server's `--tool-call-parser` (needs
                                                      `--enable-auto-tool-choice`, else 400)
    "required"    call one or more tools              constrained to a JSON array of {"name", "parameters"}
    {"type": "function", "function": {"name": F}}     constrained to F's parameters: the output is
                                                      the arguments of one call of F

Without `tool_choice`, a request with tools is "auto" and one without is "none". The finish reason is
"tool_calls" when "auto" or "required" produced calls and the output ended by itself ("length" stays
"length"); a named function's call finishes "stop", as OpenAI's does.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from kestrel.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from kestrel.entrypoints.openai.serving_engine import APIError
from kestrel.entrypoints.openai.tool_parsers import ToolCallDelta, ToolParser, get_tool_parser
from kestrel.entrypoints.openai.tool_parsers.forced import NamedFunctionOutput, RequiredCallsOutput
from kestrel.sampling_params import SamplingParams, StructuredOutputsParams

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolSettings:
    """The server's flags: `--enable-auto-tool-choice`, `--tool-call-parser NAME`."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")

    @property
    def parser(self) -> type[ToolParser] | None:
        return get_tool_parser(self.tool_call_parser) if self.tool_call_parser else None


@dataclass
class ToolPlan:
    """What a request asks of tools, checked."""
    mode: str  # "none", "auto", "required" or "named"
    tools: list[ChatTool]
    parallel: bool
    parser_class: type[ToolParser] | None = None  # for "auto"
    function: str | None = None  # for "named"

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.function)
            return StructuredOutputsParams(json=json.dumps(tool.function.parameters or EMPTY_PARAMETERS))
        if self.mode == "required":
            return StructuredOutputsParams(json=json.dumps(required_schema(self.tools, self.parallel)))
        return None

    def parser(self) -> ToolParser | None:
        """A fresh reader of one choice's output; None: the output is plain content."""
        if self.mode == "auto":
            return self.parser_class()
        if self.mode == "required":
            return RequiredCallsOutput()
        if self.mode == "named":
            return NamedFunctionOutput(self.function)
        return None

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """"tool_calls" for an output that made calls and ended by itself (EOS or a stop string); a
        cut one ("length") says so."""
        if reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def plan_tools(req: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan:
    """Check the request's tools, tool choice and tool messages (400 in OpenAI's shape)."""
    check_tool_messages(req.messages)
    tools = req.tools or []
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    elif choice != "none" and not tools:
        raise APIError("when tool_choice is given, tools must be given too", 400, "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError("two tools have the same name", 400, "tools")
    for t in tools:
        if t.function.parameters is not None and t.function.parameters.get("type", "object") != "object":
            raise APIError(f"the parameters of tool {t.function.name!r} must be a JSON schema of an object", 400,
                           "tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(f"tool_choice names the function {choice.function.name!r}, which is not in tools", 400,
                           "tool_choice")
        return ToolPlan("named", tools, req.parallel_tool_calls, function=choice.function.name)
    if choice == "auto" and not (settings.enable_auto_tool_choice and settings.parser is not None):
        raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                       "(a request with tools and no tool_choice is \"auto\")", 400, "tool_choice")
    return ToolPlan(choice, tools, req.parallel_tool_calls, parser_class=settings.parser)


def check_tool_messages(messages: list[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(f"messages.{i}: a tool message needs the tool_call_id of the call it answers", 400,
                           "messages")
        if m.tool_calls and m.role != "assistant":
            raise APIError(f"messages.{i}: only an assistant message has tool_calls", 400, "messages")


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """`tool_choice: "required"`: an array of calls, each one tool's name and its parameters, as vLLM's.
    Each tool's `$defs` go to the top, where its `#/$defs/...` references point."""
    defs: dict[str, Any] = {}

    def call(tool: ChatTool) -> dict[str, Any]:
        parameters = copy.deepcopy(tool.function.parameters or EMPTY_PARAMETERS)
        for name, schema in parameters.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise APIError(f"two tools define $defs/{name} differently", 400, "tools")
            defs[name] = schema
        return {"properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
                "required": ["name", "parameters"]}

    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": [call(t) for t in tools]}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def constrain(plan: ToolPlan, params: SamplingParams) -> None:
    """For "required" and a named function: the output constrained to the calls' schema."""
    try:
        constraint = plan.constraint()
    except RecursionError:
        raise APIError("a tool's parameters are nested too deeply", 400, "tools") from None
    if constraint is None:
        return
    if params.structured_outputs is not None:
        raise APIError(f"tool_choice {plan.mode!r} constrains the output itself; it cannot be combined with "
                       "response_format or structured_outputs", 400, "tool_choice")
    params.structured_outputs = constraint


# ---- the output -----------------------------------------------------------------------------------

def tool_calls_of(calls) -> list[ToolCall]:
    return [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def tool_message(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall] | None]:
    """(content, tool_calls) of a whole output."""
    parser = plan.parser()
    if parser is None:
        return text, None
    extracted = parser.extract(text)
    calls = extracted.tool_calls if plan.parallel else extracted.tool_calls[:1]
    if not calls:
        return text, None
    return extracted.content, tool_calls_of(calls)


class ToolStream:
    """One choice's streamed output through its plan's parser: text deltas in, (content, call deltas)
    out."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = plan.parser()
        self.called = False

    def step(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        if self.parser is None:
            return text, []
        out = self.parser.stream(text)
        if finished:
            out.add(self.parser.finish())
        deltas = [d for d in out.tool_calls if self.plan.parallel or d.index == 0]
        self.called = self.called or bool(deltas)
        return out.content, [delta_tool_call(d) for d in deltas]


def delta_tool_call(d: ToolCallDelta) -> DeltaToolCall:
    return DeltaToolCall(index=d.index, id=d.id, type="function" if d.id is not None else None,
                         function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
