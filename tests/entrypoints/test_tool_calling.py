"""Tool calling on chat completions (issue 21, item 2): the parsers (hermes, llama3_json, and the
outputs of `tool_choice: "required"` and of a named function), whole and streamed; the request checks;
the tools and tool messages through the chat template; and, against a real server on the default model
driven by the `openai` client, calls made by the model, a round trip (call, result, answer), streamed
calls put back together, and the 400s.

"required" and a named function rest on the engine's constrained decoding (`structured_outputs`).
"""

from __future__ import annotations

import json
import random

import httpx2 as httpx
import jsonschema
import openai
import pytest

from kestrel.entrypoints.cli import build_parser
from kestrel.entrypoints.openai.protocol import ChatCompletionRequest, DeltaFunctionCall, DeltaMessage, DeltaToolCall
from kestrel.entrypoints.openai.serving_engine import APIError, parse_body
from kestrel.entrypoints.openai.serving_tools import (
    ToolSettings,
    ToolStream,
    constrain,
    plan_tools,
    required_schema,
    tool_message,
)
from kestrel.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    ToolParser,
    calls_from_deltas,
    get_tool_parser,
)
from kestrel.entrypoints.openai.tool_parsers.forced import NamedFunctionOutput, RequiredCallsOutput
from kestrel.entrypoints.openai.tool_parsers.template import for_template
from kestrel.sampling_params import SamplingParams
from tests.support.server_process import Server, assert_error

MODEL = "SmolLM2-135M-Instruct"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Berlin"]},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Berlin"]}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def run_stream(parser: ToolParser, text: str, sizes: list[int]) -> tuple[str, list]:
    """`text` through `parser` in pieces of these sizes (cycled): (the content, the call deltas)."""
    content, deltas, i, k = "", [], 0, 0
    while i < len(text):
        out = parser.stream(text[i:i + sizes[k % len(sizes)]])
        i += sizes[k % len(sizes)]
        k += 1
        content += out.content
        deltas += out.tool_calls
    out = parser.finish()
    return content + out.content, deltas + out.tool_calls


def calls(extracted_or_list) -> list[tuple[str, str]]:
    items = getattr(extracted_or_list, "tool_calls", extracted_or_list)
    return [(c.name, c.arguments) for c in items]


def assert_stream_equals_whole(parser_class, text: str, make=None) -> None:
    """However the text is cut, the stream put back together equals the whole-text parse."""
    make = make or parser_class
    whole = make().extract(text)
    rng = random.Random(text)
    for sizes in [[1], [2], [3, 1, 7], [len(text) or 1]] + [[rng.randint(1, 9) for _ in range(20)] for _ in range(5)]:
        content, deltas = run_stream(make(), text, sizes)
        got = calls_from_deltas(deltas)
        assert calls(got) == calls(whole), (sizes, text)
        assert (content or None if got else content) == whole.content, (sizes, text)


# ---- hermes ---------------------------------------------------------------------------------------

def test_hermes_whole_text():
    p = HermesToolParser()
    out = p.extract('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                    '"unit": "celsius"}}\n</tool_call>')
    assert out.content == "Let me look that up."
    assert calls(out) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    assert out.tool_calls[0].id.startswith("chatcmpl-tool-")
    # No tags: the text as it is.
    assert p.extract("Paris is sunny.\n").content == "Paris is sunny.\n"
    assert p.extract("Paris is sunny.\n").tool_calls == []


def test_hermes_several_calls_in_blocks_and_in_an_array():
    out = HermesToolParser().extract(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"arguments": {"city": "Berlin"}, "name": "get_time"}</tool_call>')
    assert out.content is None
    assert calls(out) == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"city": "Berlin"}')]
    assert len({c.id for c in out.tool_calls}) == 2
    # SmolLM2's model card: the calls as an array in one block.
    out = HermesToolParser().extract('<tool_call>[{"name": "a", "arguments": {"x": [1, 2.5e3, true, null]}}, '
                                     '{"name": "b", "arguments": {}}]</tool_call>')
    assert calls(out) == [("a", '{"x": [1, 2.5e3, true, null]}'), ("b", "{}")]


def test_hermes_malformed_json_is_left_as_content():
    # (early: found malformed before the call's name is read; the stream agrees with the whole text)
    for text, early in [('x <tool_call>{name: "f"}</tool_call> y', True),
                        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', True),  # no name
                        ("5 < 6 and <tool_ is not a tag", True),
                        ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', False),  # "}" missing
                        ('<tool_call>{"name": "f", "arguments": {"a": 1}} trailing</tool_call>', False),
                        ('<tool_call>{"name": "f", "arguments": {"a": 1', False)]:  # the output ended in it
        out = HermesToolParser().extract(text)
        assert out.tool_calls == [] and out.content == text, text
        if early:
            assert_stream_equals_whole(HermesToolParser, text)
    # A good block beside a bad one: the good one is a call, the bad one content.
    out = HermesToolParser().extract('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>oops</tool_call>')
    assert calls(out) == [("f", "{}")] and out.content == "<tool_call>oops</tool_call>"


def test_hermes_unclosed_block_at_the_end_counts_when_whole():
    out = HermesToolParser().extract('<tool_call>\n{"name": "f", "arguments": {"a": "b"}}\n')
    assert calls(out) == [("f", '{"a": "b"}')] and out.content is None


def test_hermes_streams_the_name_first_then_argument_fragments():
    text = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>')
    content, deltas = run_stream(HermesToolParser(), text, [1])
    assert content == "Checking."
    first = deltas[0]
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "") and first.id
    fragments = [d.arguments for d in deltas[1:]]
    assert all(d.id is None and d.name is None and d.index == 0 for d in deltas[1:])
    assert len(fragments) > 10  # the arguments arrive as they are written
    assert "".join(fragments) == '{"city": "Paris", "unit": "celsius"}'


def test_hermes_holds_back_a_partial_tag_only():
    p = HermesToolParser()
    assert p.stream("Hello <tool").content == "Hello"  # "<tool" may start a tag; " " may precede a call
    assert p.stream("box> there").content == " <toolbox> there"
    assert p.finish().content == ""


@pytest.mark.parametrize("text", [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\u00eds \\"x\\"", "n": -1.5e-3}}'
    '\n</tool_call>\n<tool_call>{"name":"f","arguments":{}}</tool_call>\nDone.',
    '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"arguments": {"y": [{}]}, "name": "b"}]</tool_call>',
    '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>',  # arguments as JSON text in a string
    '<tool_call>{"name": "a"}</tool_call>',  # no arguments: {}
    "plain text, no calls\n\n",
    "",
])
def test_hermes_stream_equals_whole_text(text):
    assert_stream_equals_whole(HermesToolParser, text)


def test_arguments_are_spaced_as_json_dumps_spaces_them():
    # A constrained or pretty-printing model writes newlines and indents; the strings stay as written.
    text = '<tool_call>{"name": "a", "arguments": {\n  "x" :\n [1 ,2.50],\n  "s": "p  ,: q\\" \\n"\n}}</tool_call>'
    out = HermesToolParser().extract(text)
    assert calls(out) == [("a", '{"x": [1, 2.50], "s": "p  ,: q\\" \\n"}')]
    assert json.loads(out.tool_calls[0].arguments) == {"x": [1, 2.5], "s": 'p  ,: q" \n'}
    assert_stream_equals_whole(HermesToolParser, text)
    assert calls(NamedFunctionOutput("f").extract('{\n  "city": "London"\n}')) == [("f", '{"city": "London"}')]


def test_hermes_arguments_forms():
    assert calls(HermesToolParser().extract('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>')) \
        == [("a", '{"x": 1}')]
    assert calls(HermesToolParser().extract('<tool_call>{"name": "a"}</tool_call>')) == [("a", "{}")]


def test_a_call_found_malformed_after_its_name_went_out_stays_sent():
    # Streaming cannot take back what it sent: the call stays, the rest of the block is content.
    p = HermesToolParser()
    first = p.stream('<tool_call>{"name": "f", "arguments": {"a": 1')
    assert [d.name for d in first.tool_calls if d.name] == ["f"]
    rest = p.stream("]}</tool_call> after")
    rest.add(p.finish())
    assert "]" in rest.content and "after" in rest.content


# ---- llama3_json ----------------------------------------------------------------------------------

def test_llama3_json_whole_text():
    p = Llama3JsonToolParser()
    out = p.extract('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}')
    assert out.content is None and calls(out) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    out = p.extract('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}')
    assert calls(out) == [("a", '{"x": 1}'), ("b", "{}")]
    for text in ['The answer is {"name": "a", "parameters": {}}', '{"a": 1}', '{"name": "a", "parameters": {',
                 '{"name": "a", "parameters": {}} and more', "Hello"]:
        out = p.extract(text)
        assert out.tool_calls == [] and out.content == text, text


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
    ' <|python_tag|>{"name": "a", "parameters": {"x": "y;z"}} ; {"name": "b", "parameters": {"q": [1, 2]}}',
    '{"a": 1}', "<|python", "Sure, here it is", '{"nam": "a", "parameters": {} oops',
])
def test_llama3_json_stream_equals_whole_text(text):
    assert_stream_equals_whole(Llama3JsonToolParser, text)


def test_llama3_json_streams_fragments():
    content, deltas = run_stream(Llama3JsonToolParser(), '{"name": "f", "parameters": {"city": "Paris"}}', [2])
    assert content == "" and deltas[0].name == "f" and deltas[0].arguments == ""
    assert len(deltas) > 5 and "".join(d.arguments for d in deltas[1:]) == '{"city": "Paris"}'


def test_registry():
    assert set(TOOL_PARSERS) >= {"hermes", "llama3_json"}
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("nope")


# ---- "required" and a named function --------------------------------------------------------------

def test_named_function_output_is_the_arguments():
    out = NamedFunctionOutput("get_weather").extract(' {"city": "Paris", "unit": "celsius"}')
    assert calls(out) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')] and out.content is None
    content, deltas = run_stream(NamedFunctionOutput("get_weather"), '{"city": "Paris", "unit": "celsius"}', [3])
    assert deltas[0].name == "get_weather" and deltas[0].id and deltas[0].arguments == ""
    assert calls(calls_from_deltas(deltas)) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]


def test_required_output_is_an_array_of_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, ' \
           '{"name": "get_time", "parameters": {"city": "Berlin"}}]'
    out = RequiredCallsOutput().extract(text)
    assert calls(out) == [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"city": "Berlin"}')]
    assert_stream_equals_whole(RequiredCallsOutput, text)
    assert RequiredCallsOutput().extract("not calls").content == "not calls"  # unconstrained output: content


def test_required_schema_is_vllms_array_of_name_and_parameters():
    schema = required_schema([tool_of(WEATHER), tool_of(TIME)], parallel=True)
    good = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
            {"name": "get_time", "parameters": {"city": "London"}}]
    jsonschema.validate(good, schema)
    for bad in [[], [{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}],
                [{"name": "nope", "parameters": {}}], [{"name": "get_time"}]]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema([tool_of(WEATHER), tool_of(TIME)], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    # A tool's $defs move to the top, where its references point.
    with_defs = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}
    schema = required_schema([tool_of(with_defs)], parallel=True)
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], schema)


def test_the_constraints_compile_with_xgrammar_and_admit_what_the_parsers_read():
    xgrammar = pytest.importorskip("xgrammar", reason="needs the package xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    def grammar(fields: dict):
        params = SamplingParams()
        constrain(plan_tools(request(tools=TOOLS, **fields), ToolSettings()), params)
        return xgrammar.Grammar.from_json_schema(params.structured_outputs.json)

    required = grammar({"tool_choice": "required"})
    good = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, ' \
           '{"name": "get_time", "parameters": {"city": "Berlin"}}]'
    assert accepts(required, good)
    assert calls(RequiredCallsOutput().extract(good))[1] == ("get_time", '{"city": "Berlin"}')
    for bad in ["[]", '[{"name": "get_time", "parameters": {"city": "Rome"}}]', '{"name": "get_time"}']:
        assert not accepts(required, bad)
    assert not accepts(grammar({"tool_choice": "required", "parallel_tool_calls": False}), good)
    named = grammar({"tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert accepts(named, '{"city": "London"}') and not accepts(named, '{"city": "London", "unit": "celsius"}')


def tool_of(tool: dict):
    return request(tools=[tool]).tools[0]


# ---- the request ----------------------------------------------------------------------------------

AUTO = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


def request(**fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("fields, settings, fragment", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, AUTO, "not in tools"),
    ({"tool_choice": "required"}, AUTO, "tools must be given"),
    ({"tools": TOOLS, "tool_choice": "auto"}, ToolSettings(), "--enable-auto-tool-choice"),
    ({"tools": TOOLS}, ToolSettings(), "--enable-auto-tool-choice"),  # with tools, the default is "auto"
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, AUTO, "same name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
      "tool_choice": "required"}, AUTO, "object"),
    ({"messages": [{"role": "tool", "content": "42"}]}, AUTO, "tool_call_id"),
])
def test_bad_tool_requests_are_400(fields, settings, fragment):
    with pytest.raises(APIError) as e:
        plan_tools(request(**fields), settings)
    assert e.value.status == 400 and fragment in e.value.message


@pytest.mark.parametrize("fields", [
    {"tools": [{"type": "function"}]},
    {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
    {"tools": [{"type": "function", "function": {"name": "has space"}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": "not an object"}}]},
    {"tools": {"type": "function"}},
    {"tool_choice": "sometimes"},
    {"tool_choice": {"type": "function", "function": {}}},
    {"parallel_tool_calls": "yes"},
    {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]},
])
def test_bad_tool_shapes_are_400(fields):
    with pytest.raises(APIError) as e:
        request(**fields)
    assert e.value.status == 400


def test_tool_choice_modes_and_their_constraints():
    assert plan_tools(request(), ToolSettings()).mode == "none"
    assert plan_tools(request(tools=TOOLS, tool_choice="none"), ToolSettings()).parser() is None
    assert plan_tools(request(tools=TOOLS), AUTO).mode == "auto"
    named = plan_tools(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
                       ToolSettings())
    params = SamplingParams()
    constrain(named, params)
    assert json.loads(params.structured_outputs.json) == TIME["function"]["parameters"]
    required = plan_tools(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), ToolSettings())
    params = SamplingParams()
    constrain(required, params)
    assert json.loads(params.structured_outputs.json) == required_schema(required.tools, parallel=False)
    assert required.finish_reason("stop", True) == "tool_calls" and named.finish_reason("stop", True) == "stop"
    assert required.finish_reason("length", False) == required.finish_reason("length", True) == "length"


def test_parallel_tool_calls_false_keeps_the_first_call():
    plan = plan_tools(request(tools=TOOLS, parallel_tool_calls=False), AUTO)
    text = ('<tool_call>{"name": "get_time", "arguments": {"city": "Paris"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"city": "Berlin"}}</tool_call>')
    content, tool_calls = tool_message(plan, text)
    assert [c.function.arguments for c in tool_calls] == ['{"city": "Paris"}']
    stream = ToolStream(plan)
    _, deltas = stream.step(text, True)
    assert {d.index for d in deltas} == {0}


def test_streamed_call_pieces_carry_only_their_fields():
    delta = DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a'))])
    assert json.loads(delta.model_dump_json())["tool_calls"] == [{"index": 0, "function": {"arguments": '{"a'}}]


def test_server_flags():
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolSettings(enable_auto_tool_choice=True)


# ---- the chat template ----------------------------------------------------------------------------

QWEN_LIKE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
             "{% for m in messages %}{{ m.role }}: {{ m.content }}"
             "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
             "\n{% endfor %}")
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def conversation_with_a_call() -> list[dict]:
    return [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]


def test_a_template_that_takes_tools_gets_them_as_they_are():
    conversation, tools = for_template(QWEN_LIKE, conversation_with_a_call(), TOOLS, HermesToolParser)
    assert conversation == conversation_with_a_call() and tools == TOOLS


def test_a_template_without_tools_gets_them_in_the_system_message():
    conversation, tools = for_template(PLAIN, conversation_with_a_call(), TOOLS, HermesToolParser)
    assert tools is None
    assert conversation[0]["role"] == "system" and '"name": "get_weather"' in conversation[0]["content"]
    assert "<tool_call>" in conversation[0]["content"]
    assert conversation[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
                                         "</tool_call>"
    assert conversation[3] == {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}
    # An existing system message gets the tools after its own text; Llama's format for llama3_json.
    with_system = [{"role": "system", "content": "Be brief."}, *conversation_with_a_call()]
    conversation, _ = for_template(PLAIN, with_system, TOOLS, Llama3JsonToolParser)
    assert conversation[0]["content"].startswith("Be brief.\n\n") and '"parameters"' in conversation[0]["content"]
    assert conversation[2]["content"] == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    # No tools anywhere: untouched.
    plain = [{"role": "user", "content": "hi"}]
    assert for_template(PLAIN, plain, None, HermesToolParser) == (plain, None)


def test_chat_prompt_ids_hands_tools_and_calls_to_the_template():
    from kestrel.entrypoints.openai.serving_engine import OpenAIServing

    class Tokenizer:
        chat_template = QWEN_LIKE

        def apply_chat_template(self, conversation, tools=None, **kw):
            import jinja2
            return jinja2.Environment().from_string(QWEN_LIKE).render(messages=conversation, tools=tools)

        def encode(self, text, add_special_tokens):
            self.text = text
            return [0]

    serving = OpenAIServing.__new__(OpenAIServing)
    serving.tokenizer = Tokenizer()
    req = request(messages=[{"role": "user", "content": "weather?"},
                            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                                "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], tools=TOOLS)
    serving.chat_prompt_ids(req.messages, tools=plan_tools(req, AUTO).template_tools())
    assert serving.tokenizer.text == ('TOOLS:get_weather;get_time;\nuser: weather?\n'
                                      'assistant: [get_weather {"city": "Paris"}]\ntool: sunny\n')


# ---- end to end: a real server on the default model ------------------------------------------------

SERVER_FLAGS = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--dtype", "float32",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


@pytest.fixture(scope="module")
def server():
    s = Server(*SERVER_FLAGS)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.output()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def weather_call(call_id: str, city: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]}


# Two earlier turns in which the assistant called the tool: after them, the 135M model calls it again
# in the same format on its own ("auto", no constraint).
FEW_SHOT = [{"role": "user", "content": "What is the weather in Paris?"}, weather_call("call_1", "Paris"),
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 25 C"},
            {"role": "assistant", "content": "It is sunny and 25 C in Paris."},
            {"role": "user", "content": "What is the weather in Berlin?"}, weather_call("call_2", "Berlin"),
            {"role": "tool", "tool_call_id": "call_2", "content": "rainy, 12 C"},
            {"role": "assistant", "content": "It is rainy and 12 C in Berlin."},
            {"role": "user", "content": "What is the weather in London?"}]
QUESTION = [{"role": "user", "content": "What is the weather in London? Use the tools."}]


def prompt_text(server, messages: list[dict], tools: list[dict] | None = None) -> tuple[int, str]:
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **({"tools": tools} if tools else {})})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    return len(tokens), httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]


def reassemble(chunks) -> tuple[str, list[tuple[str, str]], str | None, list]:
    """(content, [(name, arguments)], the last finish reason, the tool-call deltas) of a stream."""
    content, pieces, finish = "", [], None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            pieces += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    by_index: dict[int, list] = {}
    for p in pieces:
        by_index.setdefault(p.index, []).append(p)
    assembled = [(ps[0].function.name, "".join(p.function.arguments or "" for p in ps))
                 for _, ps in sorted(by_index.items())]
    return content, assembled, finish, pieces


@pytest.mark.slow
def test_tools_reach_the_template(server, client):
    n_plain, _ = prompt_text(server, QUESTION)
    n_tools, text = prompt_text(server, QUESTION, TOOLS)
    assert n_tools > n_plain + 50
    assert "get_weather" in text and "Get the current weather in a city" in text and "<tool_call>" in text
    # The chat endpoint's prompt is the same: its usage counts the same tokens.
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                       max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == n_tools and r.choices[0].message.tool_calls is None
    # The assistants' calls and the tool results go back through the template.
    _, text = prompt_text(server, FEW_SHOT, TOOLS)
    assert '{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}' in text
    assert "rainy, 12 C" in text


@pytest.mark.slow
def test_auto_the_model_calls_a_tool_and_the_stream_matches(client):
    r = client.chat.completions.create(model=MODEL, messages=FEW_SHOT, tools=TOOLS, temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    call = choice.message.tool_calls[0]
    assert json.loads(call.function.arguments)["city"] == "London" and call.type == "function" and call.id
    assert not choice.message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=FEW_SHOT, tools=TOOLS, temperature=0,
                                                 max_tokens=60, stream=True))
    content, assembled, finish, pieces = reassemble(chunks)
    assert assembled == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert finish == "tool_calls" and not content
    assert pieces[0].id and pieces[0].type == "function" and pieces[0].function.arguments == ""
    assert len(pieces) > 3 and all(p.id is None and p.function.name is None for p in pieces[1:])
    # The round trip: the call and its result go back, the model answers in text.
    messages = [*FEW_SHOT, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "foggy, 9 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=30)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None


@pytest.mark.slow
def test_named_tool_stream_matches_non_stream(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                       temperature=0, max_tokens=40)
    message = r.choices[0].message
    assert [c.function.name for c in message.tool_calls] == ["get_weather"] and not message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                                 temperature=0, max_tokens=40, stream=True))
    content, assembled, finish, _ = reassemble(chunks)
    assert assembled == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert finish == r.choices[0].finish_reason


def round_trip(client, tool_choice, **kw) -> None:
    """Call (constrained: valid JSON for the schema), tool result, answer."""
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                       temperature=0, max_tokens=150, **kw)
    choice = r.choices[0]
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in
                                                                                  choice.message.tool_calls]}]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "sunny, 18 C"} for c in choice.message.tool_calls]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=30)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    return r


@pytest.mark.slow
def test_round_trip_with_required(client):
    r = round_trip(client, "required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


@pytest.mark.slow
def test_round_trip_with_a_named_tool(client):
    r = round_trip(client, {"type": "function", "function": {"name": "get_time"}})
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
    assert r.choices[0].finish_reason == "stop"  # as OpenAI's: a forced function's call finishes "stop"


@pytest.mark.slow
def test_required_stream_matches_non_stream(client):
    kw = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=150)
    r = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content, assembled, finish, _ = reassemble(chunks)
    assert assembled == [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert finish == r.choices[0].finish_reason == "tool_calls" and not content
    for name, arguments in assembled:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.slow
def test_bad_tool_requests_are_400_through_the_server(server, client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    url = f"{server.url}/v1/chat/completions"
    for body, fragment in [({"tool_choice": "required"}, "tools must be given"),
                           ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
                           ({"tools": [{"type": "function"}]}, "tools"),
                           ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id")]:
        assert_error(httpx.post(url, json={"messages": QUESTION, **body}), 400, "BadRequestError", fragment)


def test_each_choice_has_its_own_parser():
    # One parser per choice: two choices' texts interleaved do not mix.
    plan = plan_tools(request(tools=TOOLS), AUTO)
    a, b = ToolStream(plan), ToolStream(plan)
    out_a = [a.step('<tool_call>{"name": "get_time", ', False), a.step('"arguments": {"city": "Paris"}}</tool_call>',
                                                                        True)]
    out_b = [b.step("Just text", False), b.step(".", True)]
    assert "".join(t for t, _ in out_b) == "Just text." and not any(d for _, d in out_b)
    pieces = [d for _, ds in out_a for d in ds]
    assert pieces[0].function.name == "get_time" and a.called and not b.called
    assert "".join(p.function.arguments for p in pieces) == '{"city": "Paris"}'
