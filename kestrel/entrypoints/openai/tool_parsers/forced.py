"""The outputs of `tool_choice: "required"` and of a named function, which constrained decoding shapes
(serving_tools.py builds the schemas), not the model's own format; as vLLM reads them:

- named: the whole output is the arguments object of that one function;
- required: the output is a JSON array of `{"name": ..., "parameters": {...}}`, one per call.

An output that is not of that shape (the constraint was not applied) is content.
"""

from __future__ import annotations

from kestrel.entrypoints.openai.tool_parsers.base import DeltaOut, ExtractedToolCalls, ToolParser
from kestrel.entrypoints.openai.tool_parsers.json_calls import (
    WHITESPACE,
    CallReader,
    CompactJson,
    JsonError,
    ToolCallDelta,
    calls_from_deltas,
    tool_call_id,
)


class NamedFunctionOutput(ToolParser):
    """The output is the arguments of `function`, sent as they come (re-spaced as json.dumps spaces
    them, as the other parsers' arguments are)."""

    def __init__(self, function: str = "") -> None:
        super().__init__()
        self.function = function
        self.started = False
        self.compact = CompactJson()

    def extract(self, text: str) -> ExtractedToolCalls:
        parser = type(self)(self.function)
        parser.held = text
        out = parser.finish()
        return ExtractedToolCalls(content=out.content or None, tool_calls=calls_from_deltas(out.tool_calls))

    def run(self, out: DeltaOut, final: bool) -> None:
        if not self.started:
            self.held = self.held.lstrip(WHITESPACE)
            if not self.held and not final:
                return
            self.started = True
            self.calls([ToolCallDelta(index=0, id=tool_call_id(), name=self.function, arguments="")], out)
        fragment = self.compact(self.held)
        if fragment:
            self.calls([ToolCallDelta(index=0, arguments=fragment)], out)
        self.held = ""


class RequiredCallsOutput(ToolParser):
    """The output is a JSON array of {"name", "parameters"} calls."""

    def __init__(self) -> None:
        super().__init__()
        self.reader = CallReader(0, array=True)
        self.failed = False

    def run(self, out: DeltaOut, final: bool) -> None:
        if self.failed:
            out.content += self.held
            self.held = ""
            return
        if final and not self.reader.text and not _is_calls(self.held):
            self.failed = True
            self.run(out, final)
            return
        body, self.held = self.held, ""
        try:
            deltas = self.reader.feed(body)
            if final:
                deltas += self.reader.finish()
        except JsonError:
            self.failed = True
            reader = self.reader
            out.content += reader.text[reader.current_call_start():] if reader.headers_sent else reader.text
            return
        self.calls(deltas, out)


def _is_calls(text: str) -> bool:
    trial = CallReader(0, array=True)
    try:
        trial.feed(text)
        trial.finish()
    except JsonError:
        return False
    return True

