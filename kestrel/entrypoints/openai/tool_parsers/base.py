"""What every tool-call parser is: the model's text in (whole, or delta by delta as it streams), content
and tool calls out.

A parser instance reads one output (one choice of one request): `stream(delta)` for each new piece of
text, then `finish()` once the output is over; each returns a `DeltaOut` (content text, tool-call
deltas). `extract(text)` reads a whole output at once and is the same machine fed the whole text, so
that a streamed response put back together equals the whole one: the same content and the same calls,
whatever the deltas were. The one difference: a streamed call that turns out malformed after its name
went out stays sent (its rest comes as content), where the whole-text parse leaves it as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kestrel.entrypoints.openai.tool_parsers.json_calls import WHITESPACE, ToolCall, ToolCallDelta, calls_from_deltas


@dataclass
class DeltaOut:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: DeltaOut) -> None:
        self.content += other.content
        self.tool_calls += other.tool_calls


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str):
    def register(cls: type[ToolParser]) -> type[ToolParser]:
        cls.name = name
        TOOL_PARSERS[name] = cls
        return cls
    return register


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back until the next
    delta says whether they are)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    name: ClassVar[str] = ""

    def __init__(self) -> None:
        self.held = ""  # text received and not yet decided
        self.next_index = 0  # the index of the next call
        self.called = False  # a call went out
        self.pending_ws = ""  # trailing whitespace of the content, sent only if content follows
        self.skip_ws = False  # after a call: leading whitespace of the content is dropped

    def stream(self, delta: str) -> DeltaOut:
        self.held += delta
        out = DeltaOut()
        self.run(out, final=False)
        return out

    def finish(self) -> DeltaOut:
        out = DeltaOut()
        self.run(out, final=True)
        if not self.called:
            out.content += self.pending_ws
        self.pending_ws = ""
        return out

    def extract(self, text: str) -> ExtractedToolCalls:
        """A whole output, read by a fresh parser."""
        parser = type(self)()
        parser.held = text
        out = parser.finish()
        calls = calls_from_deltas(out.tool_calls)
        return ExtractedToolCalls(content=out.content if out.content or not calls else None, tool_calls=calls)

    def run(self, out: DeltaOut, final: bool) -> None:
        """Take what it can of `self.held` into `out`; `final`: no more text comes."""
        raise NotImplementedError

    # -- the format, for a chat template that does not take tools (template.py) --------------------
    # Hermes's, as Qwen 2.5's template writes it: the format most small models were tuned on.

    @classmethod
    def system_prompt(cls, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listed}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    @classmethod
    def format_calls(cls, calls: list[dict[str, Any]]) -> str:
        """An assistant's calls ({"name", "arguments"} dicts) as the model writes them."""
        return "\n".join("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]},
                                                       ensure_ascii=False) + "\n</tool_call>" for c in calls)

    @classmethod
    def format_tool_result(cls, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    # -- helpers for the parsers ------------------------------------------------------------------

    def content(self, text: str, out: DeltaOut) -> None:
        """Send `text` as content, holding its trailing whitespace back (dropped if a call follows)."""
        if self.skip_ws:
            text = text.lstrip(WHITESPACE)
            if not text:
                return
            self.skip_ws = False
        if not text:
            return
        text = self.pending_ws + text
        kept = text.rstrip(WHITESPACE)
        self.pending_ws = text[len(kept):]
        out.content += kept

    def calls(self, deltas: list[ToolCallDelta], out: DeltaOut) -> None:
        if deltas:
            if not self.called or any(d.name is not None for d in deltas):
                self.pending_ws = ""
            self.called = True
            out.tool_calls += deltas
