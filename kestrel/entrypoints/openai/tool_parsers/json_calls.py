"""Reading tool calls out of JSON text as it arrives, a character at a time.

`JsonScanner` is a pushdown automaton over JSON: it checks the syntax of a value as its characters come
in (so a malformed call is noticed at its first bad character, not at its end) and reports where each
value starts and ends. `CallReader` uses it on text that holds calls as JSON, `{"name": ..., "arguments":
{...}}` objects (or an array of them, or several separated by `;`), and turns them into `ToolCallDelta`s
as OpenAI streams them: the call's id and name first, then its arguments in fragments: the model's own
text of the arguments object, spaced as `json.dumps` spaces it (`CompactJson`: no newlines or indents,
one space after each `:` and `,`; strings and numbers as written). Both the streamed and the whole-text
paths of every parser go through it, so a call's arguments are the same text either way, whatever the
deltas were.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"
ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes "parameters"
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_LITERALS = {"t": "true", "f": "false", "n": "null"}


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """A whole call: `arguments` is JSON text (an object)."""
    name: str
    arguments: str
    id: str = field(default_factory=tool_call_id)


@dataclass
class ToolCallDelta:
    """A piece of the `index`th call of a response: the first piece has its id and name (and
    arguments ""), the later ones a fragment of its arguments."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class JsonError(ValueError):
    pass


class CompactJson:
    """Valid JSON text, fed in pieces, re-spaced as `json.dumps` spaces it: whitespace outside strings
    dropped, one space after each `:` and `,`. Strings and numbers stay as written."""

    def __init__(self) -> None:
        self.in_string = self.escape = False

    def __call__(self, text: str) -> str:
        out = []
        for ch in text:
            if self.in_string:
                out.append(ch)
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch not in WHITESPACE:
                out.append(ch)
                if ch == '"':
                    self.in_string = True
                elif ch in ",:":
                    out.append(" ")
        return "".join(out)


class JsonScanner:
    """Checks one JSON object or array (the root) as its characters come in. `feed` consumes up to the
    end of the root and returns how many characters it took; `events` collects, for every value, a
    ("start" | "end", depth, key, start, end) tuple: depth 0 is the root, `key` the member's name in
    an object (None in an array), offsets count from the scanner's first character. A syntax error
    raises JsonError and leaves `error` set."""

    def __init__(self) -> None:
        self.pos = 0
        # Frames of the open containers: [kind ("{" or "["), expecting, key of the value being read].
        self.stack: list[list] = []
        self.token: str | None = None  # "string", "key", "number", "literal" while inside one
        self.token_start = 0
        self.escape = 0  # 0: none; 1: after a backslash; 2..5: hex digits of \\u still to come
        self.literal = ""
        self.value_starts: list[tuple[int, int, str | None]] = []  # (start, depth, key) per open value
        self.text = ""  # the characters of the current key or number
        self.done = False
        self.error = False
        self.events: list[tuple[str, int, str | None, int, int]] = []

    def feed(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self.done:
                return i
            try:
                self._char(ch)
            except JsonError:
                self.error = True
                raise
            self.pos += 1
        return len(text)

    def _fail(self, what: str) -> None:
        raise JsonError(f"{what} at offset {self.pos}")

    def _char(self, ch: str) -> None:
        if self.token in ("string", "key"):
            self._string_char(ch)
            return
        if self.token == "number":
            if ch in "0123456789+-.eE":
                self.text += ch
                return
            if _NUMBER.fullmatch(self.text) is None:
                self._fail(f"bad number {self.text!r}")
            self.token = None
            self._value_end(self.pos)
            if self.done:
                return
        elif self.token == "literal":
            if ch != self.literal[self.pos - self.token_start]:
                self._fail(f"bad literal, expected {self.literal!r}")
            if self.pos - self.token_start + 1 == len(self.literal):
                self.token = None
                self._value_end(self.pos + 1)
            return
        if ch in WHITESPACE:
            return
        if not self.stack:
            if ch not in "{[":
                self._fail("expected an object or an array")
            self._value_start(ch)
            return
        frame = self.stack[-1]
        kind, expecting = frame[0], frame[1]
        if expecting == "key":  # or the end of an empty object
            if ch == '"':
                self.token, self.text, self.escape = "key", "", 0
            elif ch == "}" and frame[2] is None and not frame[3]:
                self._close()
            else:
                self._fail("expected a member name")
        elif expecting == "colon":
            if ch != ":":
                self._fail("expected ':'")
            frame[1] = "value"
        elif expecting == "value":  # or the end of an empty array
            if ch == "]" and kind == "[" and not frame[3]:
                self._close()
            else:
                self._value_start(ch)
        elif expecting == "comma":
            if ch == ",":
                frame[1] = "key" if kind == "{" else "value"
                frame[2] = None
            elif ch == ("}" if kind == "{" else "]"):
                self._close()
            else:
                self._fail(f"expected ',' or {'}' if kind == '{' else ']'!r}")

    def _string_char(self, ch: str) -> None:
        if self.token == "key":
            self.text += ch
        if self.escape == 1:
            if ch == "u":
                self.escape = 5
            elif ch in '"\\/bfnrt':
                self.escape = 0
            else:
                self._fail(f"bad escape \\{ch}")
        elif self.escape > 1:
            if ch not in "0123456789abcdefABCDEF":
                self._fail("bad \\u escape")
            self.escape = 0 if self.escape == 2 else self.escape - 1
        elif ch == "\\":
            self.escape = 1
        elif ch == '"':
            if self.token == "key":
                frame = self.stack[-1]
                frame[1], frame[2] = "colon", json.loads('"' + self.text)
            else:
                self._value_end(self.pos + 1)
            self.token = None
        elif ch < " ":
            self._fail("control character in a string")

    def _value_start(self, ch: str) -> None:
        depth = len(self.stack)
        key = self.stack[-1][2] if self.stack else None
        if self.stack:
            self.stack[-1][3] = True
        self.value_starts.append((self.pos, depth, key))
        self.events.append(("start", depth, key, self.pos, self.pos))
        if ch == "{":
            self.stack.append(["{", "key", None, False])
        elif ch == "[":
            self.stack.append(["[", "value", None, False])
        elif ch == '"':
            self.token, self.escape = "string", 0
        elif ch == "-" or ch.isdigit():
            self.token, self.text = "number", ch
        elif ch in _LITERALS:
            self.token, self.literal, self.token_start = "literal", _LITERALS[ch], self.pos
        else:
            self._fail(f"unexpected {ch!r}")

    def _close(self) -> None:
        self.stack.pop()
        self._value_end(self.pos + 1)

    def _value_end(self, end: int) -> None:
        start, depth, key = self.value_starts.pop()
        self.events.append(("end", depth, key, start, end))
        if self.stack:
            self.stack[-1][1] = "comma"
        else:
            self.done = True


@dataclass
class _Call:
    index: int
    start: int  # where its object starts in the reader's text
    id: str = field(default_factory=tool_call_id)
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_is_string: bool = False
    args_sent: int = 0  # characters of the arguments sent
    args_read: int = 0  # characters of the model's arguments text read into them
    compact: CompactJson = field(default_factory=CompactJson)
    header_sent: bool = False
    ended: bool = False


class CallReader:
    """Tool calls from JSON text fed in pieces: one call object, an array of call objects
    (`array=True`), or several roots separated by `separator` (Llama 3's `;`).

    `feed` returns the `ToolCallDelta`s that the new text completes; `finish` the last ones once the
    text is over. A syntax error, or a call without a string name, raises JsonError (`failed` then
    says where, `headers_sent` whether any call of it went out)."""

    def __init__(self, first_index: int, array: bool = False, separator: str | None = None) -> None:
        self.first_index = first_index
        self.array, self.separator = array, separator
        self.text = ""
        self.calls: list[_Call] = []
        self.scanner: JsonScanner | None = None
        self.root_offset = 0  # where the current root starts in `text`
        self.consumed = 0  # characters of `text` processed
        self.between_roots = False  # after a root: whitespace, then the separator or the end
        self.failed_at: int | None = None

    @property
    def headers_sent(self) -> bool:
        return any(c.header_sent for c in self.calls)

    @property
    def complete(self) -> bool:
        """Everything fed so far makes whole calls (at least one)."""
        return bool(self.calls) and all(c.ended for c in self.calls) and self.scanner is not None \
            and self.scanner.done

    def current_call_start(self) -> int:
        """Where the text of the call being read starts, if its header is not out yet; else where the
        reading failed: what a parser gives back as content when the reading fails."""
        unsent = [c for c in self.calls if not c.header_sent]
        if unsent:
            return unsent[0].start
        return self.failed_at if self.failed_at is not None else len(self.text)

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.text += text
        try:
            while self.consumed < len(self.text):
                if self.scanner is None or self.scanner.done:
                    self._between(self.text[self.consumed])
                    continue
                self.consumed += self.scanner.feed(self.text[self.consumed:])
                self._events(self.scanner)
        except JsonError:
            scanning = self.scanner is not None and not self.scanner.done
            self.failed_at = self.root_offset + self.scanner.pos if scanning else self.consumed
            raise
        return self._deltas()

    def _between(self, ch: str) -> None:
        """A character outside any root: whitespace and a separator are taken; the start of a root
        (where one may start) opens a scanner for it."""
        if ch in WHITESPACE:
            self.consumed += 1
            return
        if self.scanner is not None:  # after a root
            if self.separator is not None and ch == self.separator and not self.between_roots:
                self.between_roots = True
                self.consumed += 1
                return
            if not self.between_roots:
                raise JsonError(f"unexpected {ch!r} after the tool call")
        if ch != "{" and not (ch == "[" and self.array and self.scanner is None):
            raise JsonError("expected a tool call object")
        self.scanner = JsonScanner()
        self.root_offset = self.consumed
        self.between_roots = False

    def _events(self, scanner: JsonScanner) -> None:
        call_depth = 1 if self.text[self.root_offset] == "[" else 0
        for kind, depth, key, start, end in scanner.events:
            start += self.root_offset
            end += self.root_offset
            if depth == call_depth:
                if kind == "start":
                    if self.text[start] != "{":
                        raise JsonError("a tool call must be an object")
                    self.calls.append(_Call(index=self.first_index + len(self.calls), start=start))
                else:
                    call = self.calls[-1]
                    if call.name is None:
                        raise JsonError("a tool call without a name")
                    call.ended = True
            elif depth == call_depth + 1 and self.calls and not self.calls[-1].ended:
                call = self.calls[-1]
                if key == "name" and kind == "end":
                    name = json.loads(self.text[start:end])
                    if not isinstance(name, str) or not name:
                        raise JsonError("a tool call's name must be a non-empty string")
                    call.name = name
                elif key in ARGUMENT_KEYS and call.args_start is None and kind == "start":
                    call.args_start = start
                    call.args_is_string = self.text[start] != "{"
                elif key in ARGUMENT_KEYS and call.args_start == start and kind == "end":
                    call.args_end = end
        scanner.events.clear()

    def _deltas(self) -> list[ToolCallDelta]:
        deltas = []
        for call in self.calls:
            if call.name is not None and not call.header_sent:
                call.header_sent = True
                deltas.append(ToolCallDelta(index=call.index, id=call.id, name=call.name, arguments=""))
            if not call.header_sent:
                continue
            fragment = self._arguments_fragment(call)
            if fragment:
                deltas.append(ToolCallDelta(index=call.index, arguments=fragment))
        return deltas

    def _arguments_fragment(self, call: _Call) -> str:
        if call.args_start is None:
            if call.ended and call.args_sent == 0:  # no arguments given: an empty object
                call.args_sent = 2
                return "{}"
            return ""
        if call.args_is_string:  # not an object (JSON text in a string, null): sent whole once read
            if call.args_end is None or call.args_sent:
                return ""
            text = self._arguments_text(call)
            call.args_sent = len(text)
            return text
        end = call.args_end if call.args_end is not None else self.consumed
        raw = self.text[call.args_start + call.args_read:end]
        call.args_read += len(raw)
        fragment = call.compact(raw)
        call.args_sent += len(fragment)
        return fragment

    def finish(self) -> list[ToolCallDelta]:
        """The text is over: the calls must be whole."""
        if not self.complete:
            self.failed_at = self.consumed
            raise JsonError("the tool call ended before its JSON did")
        return self._deltas()

    def tool_calls(self) -> list[ToolCall]:
        """The calls read (all whole: call after `finish`)."""
        out = []
        for call in self.calls:
            out.append(ToolCall(name=call.name or "", arguments=self._arguments_text(call), id=call.id))
        return out

    def _arguments_text(self, call: _Call) -> str:
        if call.args_start is None:
            return "{}"
        raw = self.text[call.args_start:call.args_end]
        if not call.args_is_string:
            return CompactJson()(raw)
        try:
            value = json.loads(raw)
        except RecursionError:  # an array nested past the parser's depth: the model's text as it is
            return raw
        return "{}" if value is None else value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def calls_from_deltas(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The whole calls that a stream of deltas makes, as a client puts them together."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCall(name=d.name or "", arguments="", id=d.id or "")
        calls[d.index].arguments += d.arguments or ""
    return [calls[i] for i in sorted(calls)]
