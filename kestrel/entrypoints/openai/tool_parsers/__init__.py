"""Tool-call parsers (`--tool-call-parser NAME`): each reads the tool calls out of one model family's
text, whole or as it streams. One module per format; `TOOL_PARSERS` maps the names to the classes.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Hermes, Qwen 2.5/3, SmolLM2)
    llama3_json  {"name": ..., "parameters": {...}}                         (Llama 3.1/3.2)
"""

from kestrel.entrypoints.openai.tool_parsers.base import (
    TOOL_PARSERS,
    DeltaOut,
    ExtractedToolCalls,
    ToolParser,
)
from kestrel.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from kestrel.entrypoints.openai.tool_parsers.json_calls import ToolCall, ToolCallDelta, calls_from_deltas
from kestrel.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

__all__ = ["TOOL_PARSERS", "DeltaOut", "ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser",
           "ToolCall", "ToolCallDelta", "ToolParser", "calls_from_deltas", "get_tool_parser"]


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}") from None
