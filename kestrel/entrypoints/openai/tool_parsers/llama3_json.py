"""`--tool-call-parser llama3_json`: Llama 3.1/3.2's JSON calls, an output that is one call object (or
several separated by `;`), optionally after `<|python_tag|>`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

(`"arguments"` is read as well as `"parameters"`.) An output that does not start with `{` (after
whitespace and the tag) is content; so is one whose JSON is malformed or has anything after the calls.
"""

from __future__ import annotations

import json
from typing import Any

from kestrel.entrypoints.openai.tool_parsers.base import DeltaOut, ToolParser, register_tool_parser
from kestrel.entrypoints.openai.tool_parsers.json_calls import WHITESPACE, CallReader, JsonError

PYTHON_TAG = "<|python_tag|>"


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):

    def __init__(self) -> None:
        super().__init__()
        self.mode = "start"  # "start": undecided; "calls"; "content"
        self.prefix = ""  # the whitespace and tag before the first call
        self.reader = CallReader(0, separator=";")

    def run(self, out: DeltaOut, final: bool) -> None:
        if self.mode == "start":
            lead = self.held.lstrip(WHITESPACE)
            if lead.startswith(PYTHON_TAG):
                lead = lead[len(PYTHON_TAG):].lstrip(WHITESPACE)
            elif PYTHON_TAG.startswith(lead) and lead and not final:
                return  # perhaps the tag
            if not lead and not final:
                return
            if not lead.startswith("{") or (final and not self.is_calls(lead)):
                self.mode = "content"
            else:
                self.mode = "calls"
                self.prefix = self.held[:len(self.held) - len(lead)]
                self.held = lead
        if self.mode == "content":
            out.content += self.held
            self.held = ""
            return
        body, self.held = self.held, ""
        try:
            deltas = self.reader.feed(body)
            if final:
                deltas += self.reader.finish()
        except JsonError:
            reader = self.reader
            rest = reader.text[reader.current_call_start():] if reader.headers_sent else self.prefix + reader.text
            self.mode = "content"
            out.content += rest
            return
        self.calls(deltas, out)

    @classmethod
    def system_prompt(cls, tools: list[dict[str, Any]]) -> str:
        # As Llama 3.1's template puts the tools in the user message for JSON-based calls.
        listed = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
                "\"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n" + listed)

    @classmethod
    def format_calls(cls, calls: list[dict[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                         for c in calls)

    @classmethod
    def format_tool_result(cls, content: str) -> str:
        return content

    def is_calls(self, text: str) -> bool:
        trial = CallReader(0, separator=";")
        try:
            trial.feed(text)
            trial.finish()
        except JsonError:
            return False
        return True
