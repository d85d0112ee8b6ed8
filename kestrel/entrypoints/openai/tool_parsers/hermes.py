"""`--tool-call-parser hermes`: calls as JSON between `<tool_call>` and `</tool_call>`, as Hermes 2 Pro,
Qwen 2.5 and Qwen 3 write them (and SmolLM2, whose model card has the calls as a JSON array inside one
pair of tags):

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content. A block whose JSON is malformed (or that is not a call: no name) is
left as content, tags included. A block the output ends inside (no closing tag) counts if its JSON is
whole, as vLLM's parser has it.
"""

from __future__ import annotations

from kestrel.entrypoints.openai.tool_parsers.base import DeltaOut, ToolParser, partial_suffix, register_tool_parser
from kestrel.entrypoints.openai.tool_parsers.json_calls import CallReader, JsonError

START, END = "<tool_call>", "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):

    def __init__(self) -> None:
        super().__init__()
        self.reader: CallReader | None = None  # in a block
        self.raw = False  # the rest of the block goes out as content (its reading failed)
        self.raw_tags = False  # ... with its closing tag (its opening tag went out as content too)

    def run(self, out: DeltaOut, final: bool) -> None:
        while True:
            if self.reader is None:
                i = self.held.find(START)
                if i >= 0:
                    self.content(self.held[:i], out)
                    self.held = self.held[i + len(START):]
                    self.reader = CallReader(self.next_index, array=True)
                    self.raw = self.raw_tags = False
                    continue
                keep = 0 if final else partial_suffix(self.held, START)
                self.content(self.held[:len(self.held) - keep], out)
                self.held = self.held[len(self.held) - keep:]
                return
            i = self.held.find(END)
            if i >= 0 or final:
                body = self.held[:i] if i >= 0 else self.held
                self.held = self.held[i + len(END):] if i >= 0 else ""
                self.block(body, out, closed=True, tag=i >= 0)
                self.reader = None
                continue
            keep = partial_suffix(self.held, END)
            body = self.held[:len(self.held) - keep]
            self.held = self.held[len(self.held) - keep:]
            self.block(body, out, closed=False, tag=False)
            return

    def block(self, body: str, out: DeltaOut, closed: bool, tag: bool) -> None:
        """Text of the current block's body; `closed`: the block ends after it (`tag`: with `</tool_call>`)."""
        reader = self.reader
        if self.raw:
            self.content(body + (END if tag and self.raw_tags else ""), out)
            return
        if closed and not reader.text and not self.is_calls(body):
            # The whole block is here before any of it went out: malformed, it is content as a whole.
            self.content(START + body + (END if tag else ""), out)
            return
        try:
            deltas = reader.feed(body)
            if closed:
                deltas += reader.finish()
        except JsonError:
            if reader.headers_sent:  # what went out stays; the rest of the block is content
                rest = reader.text[reader.current_call_start():]
            else:
                rest, self.raw_tags = START + reader.text, True
            self.raw = True
            self.content(rest + (END if tag and self.raw_tags else ""), out)
            self.next_index += sum(c.header_sent for c in reader.calls)
            return
        self.calls(deltas, out)
        if closed:
            self.next_index += len(reader.calls)
            self.skip_ws = True

    def is_calls(self, body: str) -> bool:
        trial = CallReader(self.next_index, array=True)
        try:
            trial.feed(body)
            trial.finish()
        except JsonError:
            return False
        return True
