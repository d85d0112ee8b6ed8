"""Tools and tool messages for the chat template.

The template gets the request's tools (`tools=` of `apply_chat_template`, as `{"type": "function",
"function": {...}}` dicts) and the conversation with the assistants' `tool_calls` (their arguments as
objects, as the templates of Qwen and Llama expect them: `tool_call.arguments | tojson`) and the tool
messages' `tool_call_id`.

A template that never reads `tools` (SmolLM2-135M-Instruct's, Kestrel's default model) would drop them
silently and the model would never hear of them; for such a template the tools go into the system
message instead, in the format of the server's tool parser (Hermes's by default: a `<tools>` list and
the `<tool_call>` format, the prompt that Qwen 2.5's template writes and SmolLM2's model card uses), and
the assistants' calls and the tool results into the messages' text, in that same format.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from kestrel.entrypoints.openai.tool_parsers.base import ToolParser


def message_extras(message: Any) -> dict[str, Any]:
    """The tool fields of a request's message (a protocol ChatMessage), for the template."""
    extras: dict[str, Any] = {}
    if getattr(message, "tool_calls", None):
        extras["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": arguments_object(c.function.arguments)}}
            for c in message.tool_calls]
    if getattr(message, "tool_call_id", None) is not None:
        extras["tool_call_id"] = message.tool_call_id
    return extras


def arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments  # not JSON (or nested past the parser): the template gets the text


@functools.lru_cache(maxsize=16)
def template_reads_tools(template: str) -> bool:
    try:
        import jinja2
        from jinja2 import meta
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except Exception:  # noqa: BLE001 - a template jinja2 alone cannot parse (HF extensions): look for the word
        return "tools" in template


def for_template(template: str | None, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 tool_format: type[ToolParser]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(conversation, tools) to hand to `apply_chat_template`: as they are for a template that reads
    `tools`; for one that does not, the tools in the system message and the calls and results in the
    messages' text, in `tool_format`'s format."""
    uses_tools = tools or any("tool_calls" in m or m["role"] == "tool" for m in conversation)
    if not uses_tools or not isinstance(template, str) or template_reads_tools(template):
        return conversation, tools
    out = []
    for m in conversation:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if calls:
            text = tool_format.format_calls([c["function"] for c in calls])
            m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
        if m["role"] == "tool":
            m["content"] = tool_format.format_tool_result(m.get("content") or "")
        out.append(m)
    if tools:
        prompt = tool_format.system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0].get("content") else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None
