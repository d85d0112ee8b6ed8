"""Structured outputs (issue 21, item 1): grammars compiled by xgrammar in the engine core, the token
bitmask applied by the worker before sampling.

- Units: the bitmask's bit layout against xgrammar's own kernel, what the front end refuses, drafts
  checked against a grammar, the rows a step's bitmask has.
- The engine on a tiny random model (float32): greedy constrained tokens equal to a reference that
  masks transformers' logits with an xgrammar matcher token by token, alone and beside unconstrained
  requests, with chunked prefill, forced preemption, n-gram speculation and async scheduling; sampled
  outputs always inside the grammar.
- The server with the `openai` client on the default model: `parse(response_format=Model)` for several
  schemas, greedy and sampled, streamed and not; regex and choice; 400s for what cannot compile.
"""

from __future__ import annotations

import json
import re
from enum import StrEnum
from types import SimpleNamespace
from typing import Annotated

import httpx2 as httpx
import jsonschema
import pytest
import torch
import xgrammar as xgr
from pydantic import BaseModel, Field

from kestrel import LLM, SamplingParams
from kestrel.core.request import Request
from kestrel.core.structured_output import (
    StructuredOutputManager,
    Utf8Continuations,
    check_structured_outputs,
    choice_grammar,
    holds_invalid_utf8,
)
from kestrel.model.loader import load_tokenizer, resolve_model
from kestrel.sample.sampler import apply_token_bitmask, token_bitmask_bias
from kestrel.sampling_params import StructuredOutputsParams as Constraint
from tests.support.parity import save_tiny_llama
from tests.support.server_process import Server, assert_error

VOCAB = 49152
MODEL = "SmolLM2-135M-Instruct"

# Schemas whose every instance is short (bounded strings and arrays), so a random model ends them.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    "verified": {"type": "boolean"}},
    "required": ["name", "age", "pets", "verified"], "additionalProperties": False}
CODE = r"[A-Z]{2}-\d{3}"
CHOICES = ["yes", "no", "maybe later"]
ARITH = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [1-9] | "(" expr ")"'


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=[tokenizer.eos_token_id])
    return xgr.GrammarCompiler(info, max_threads=1)


# ---- units ------------------------------------------------------------------------------------------

def allowed_tokens(bitmask: torch.Tensor, vocab_size: int = VOCAB) -> torch.Tensor:
    return token_bitmask_bias(bitmask, vocab_size) == 0


def random_bitmask(rows: int) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, (rows, (VOCAB + 31) // 32), dtype=torch.int32)


def test_bitmask_layout_matches_xgrammar():
    torch.manual_seed(0)
    bitmask = random_bitmask(3)
    logits = torch.randn(3, VOCAB)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    ours = apply_token_bitmask(logits.clone(), SimpleNamespace(token_bitmask=bitmask,
                                                               token_bitmask_rows=torch.arange(3)))
    assert torch.equal(ours, theirs)


def test_only_the_constrained_rows_are_masked():
    torch.manual_seed(1)
    bitmask = random_bitmask(2)
    logits = torch.randn(3, VOCAB)
    ours = apply_token_bitmask(logits.clone(), SimpleNamespace(token_bitmask=bitmask,
                                                               token_bitmask_rows=torch.tensor([0, 2])))
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, torch.stack([bitmask[0], random_bitmask(1)[0], bitmask[1]]),
                                    indices=[0, 2])
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[1], logits[1])


@pytest.mark.parametrize("constraint, fragment", [
    (Constraint(json='{"type": "bogus"}'), "bogus"),
    (Constraint(json="{not json"), "json"),
    (Constraint(regex="[a-"), "regex"),
    (Constraint(grammar="root ::= undefined_rule"), "undefined_rule"),
    (Constraint(choice=[]), "at least one"),
    (Constraint(), "exactly one"),
    (Constraint(regex="a", choice=["a"]), "exactly one"),
])
def test_front_end_refuses_what_cannot_compile(constraint, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        check_structured_outputs(constraint)


def test_choice_grammar_is_exactly_the_choices(compiler, tokenizer):
    compiled = compiler.compile_grammar(choice_grammar(['say "hi"', "naïve", "a|b"]))
    for text, ok in [('say "hi"', True), ("naïve", True), ("a|b", True), ("a", False), ("say hi", False)]:
        matcher = xgr.GrammarMatcher(compiled)
        assert (matcher.accept_string(text) and matcher.is_completed()) == ok, text


def manager_with_grammar(tokenizer, constraint: Constraint, output_token_ids=()) -> tuple[StructuredOutputManager,
                                                                                         Request]:
    manager = StructuredOutputManager(lambda: tokenizer, VOCAB, tokenizer.eos_token_id)
    request = Request("r", [1, 2, 3], SamplingParams(structured_outputs=constraint), tokenizer.eos_token_id)
    request.append_output_token_ids(list(output_token_ids))
    manager.submit(request)
    request.grammar.compiled.result(timeout=60)
    assert manager.is_ready(request)
    return manager, request


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses(tokenizer):
    ids = tokenizer.encode("AB-123", add_special_tokens=False)
    _, request = manager_with_grammar(tokenizer, Constraint(regex=CODE))
    bad = tokenizer.encode("x", add_special_tokens=False)
    assert request.grammar.valid_prefix(ids + bad + ids) == ids
    # The matcher is left where it was: the whole string is still accepted from the start.
    assert request.grammar.valid_prefix(ids) == ids
    assert request.grammar.valid_prefix(bad) == []


def test_bitmask_rows_follow_the_drafts(tokenizer):
    prefix = tokenizer.encode("AB", add_special_tokens=False)
    drafts = tokenizer.encode("-12", add_special_tokens=False)
    # A resumed request: its matcher starts after its output tokens.
    manager, request = manager_with_grammar(tokenizer, Constraint(regex=CODE), prefix)
    raw, first_rows = manager.bitmask([(request, drafts)])
    bitmask = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(-1, manager.bitmask_width)
    assert first_rows == {"r": 0} and bitmask.shape[0] == len(drafts) + 1
    allowed = allowed_tokens(bitmask, VOCAB)
    digit = tokenizer.encode("7", add_special_tokens=False)[0]
    letter = tokenizer.encode("Q", add_special_tokens=False)[0]
    dash = tokenizer.encode("-", add_special_tokens=False)[0]
    assert allowed[0, dash] and not allowed[0, digit] and not allowed[0, letter]   # after "AB"
    assert allowed[1, digit] and not allowed[1, dash]                               # after "AB-"
    assert request.grammar.valid_prefix(drafts) == drafts  # the rows left the matcher as it was


def byte_token(tokenizer, byte: int) -> int:
    """The default model's token for one byte (its byte-level BPE spells byte b as GPT-2's unicode for b)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled = {b: chr(b) for b in printable}
    spelled.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in printable)})
    return tokenizer.get_vocab()[spelled[byte]]


def test_no_surrogate_or_overlong_continuation_follows_a_lead_byte(tokenizer):
    """After ED, xgrammar alone lets A0-BF through (U+D800-DFFF, three U+FFFD to Python, which broke a
    maxLength); the mask allows only 80-9F there. After C3 (no narrower range) nothing changes."""
    quote = tokenizer.encode('"', add_special_tokens=False)
    schema = Constraint(json=json.dumps({"type": "string", "maxLength": 2}))
    for lead, allowed, refused in [(0xED, 0x9F, 0xA0), (0xE0, 0xA0, 0x9F), (0xF0, 0x90, 0x8F), (0xF4, 0x8F, 0x90),
                                   (0xC3, 0xA9, None)]:
        manager, request = manager_with_grammar(tokenizer, schema, quote + [byte_token(tokenizer, lead)])
        raw, _ = manager.bitmask([(request, [])])
        row = allowed_tokens(torch.frombuffer(bytearray(raw), dtype=torch.int32).view(-1, manager.bitmask_width),
                             VOCAB)[0]
        assert row[byte_token(tokenizer, allowed)], hex(lead)
        if refused is not None:
            assert not row[byte_token(tokenizer, refused)], hex(lead)
        if lead == 0xED:   # xgrammar's matcher takes the surrogate's byte: the mask is what refuses it
            assert request.grammar.valid_prefix([byte_token(tokenizer, 0xA0)]) == [byte_token(tokenizer, 0xA0)]
    # A draft ending on a lead narrows the next row the same way.
    manager, request = manager_with_grammar(tokenizer, schema, quote)
    raw, _ = manager.bitmask([(request, [byte_token(tokenizer, 0xED)])])
    rows = allowed_tokens(torch.frombuffer(bytearray(raw), dtype=torch.int32).view(-1, manager.bitmask_width), VOCAB)
    assert rows[0, byte_token(tokenizer, 0xED)] and not rows[1, byte_token(tokenizer, 0xA0)]
    assert rows[1, byte_token(tokenizer, 0x80)]


def test_no_row_allows_a_token_holding_an_invalid_sequence():
    """A token whose bytes hold a surrogate, an overlong form, a byte no UTF-8 has or four continuations
    is never allowed; partial characters at a token's edges are."""
    vocab = [b"a", b"\xa9b", b"b\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"x\xe0\x80y", b"\xc0", b"\xff",
             b"\x80\x80\x80\x80", b"\xf0\x9f\x98\x80", b""]
    invalid = [holds_invalid_utf8(b) for b in vocab]
    assert invalid == [False, False, False, False, True, True, True, True, True, False, False]
    utf8 = Utf8Continuations(vocab, bitmask_width=1)
    row = torch.full((1,), -1, dtype=torch.int32)
    utf8.restrict(row, previous_token=None)
    allowed = allowed_tokens(row.view(1, 1), len(vocab))[0].tolist()
    assert allowed == [not bad for bad in invalid]
    # A vocabulary without such tokens leaves rows as xgrammar fills them.
    assert Utf8Continuations([b"a", b"\xc3", b"\xa9"], bitmask_width=1).valid is None


# ---- the engine against a masked reference ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-so")
    return str(folder), save_tiny_llama(folder)


def reference_constrained_greedy(model, compiler, prompt_ids: list[int], constraint: Constraint, max_tokens: int,
                                 eos: int) -> list[int]:
    """transformers' logits, masked by an xgrammar matcher token by token, argmax: what the engine must give."""
    kind, spec = constraint.kind_and_spec()
    compiled = {"json": lambda: compiler.compile_json_schema(spec, any_whitespace=False),
                "regex": lambda: compiler.compile_regex(spec),
                "choice": lambda: compiler.compile_grammar(choice_grammar(constraint.choice)),
                "grammar": lambda: compiler.compile_grammar(spec)}[kind]()
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            matcher.fill_next_token_bitmask(bitmask)
            logits = logits.masked_fill(~allowed_tokens(bitmask, VOCAB)[0], float("-inf"))
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token == eos:
                break
            assert matcher.accept_token(token)
    return out


PROMPTS = ["The weather today is", "Write a person as JSON:", "Pick one", "Compute 1+2:"]
CONSTRAINTS = [Constraint(regex=CODE), Constraint(json=json.dumps(PERSON)), Constraint(choice=CHOICES),
               Constraint(grammar=ARITH)]
ENGINE_SETUPS = {
    "plain": dict(),
    "chunked prefill, preemption": dict(max_num_batched_tokens=32, num_kv_blocks=10, enable_prefix_caching=False,
                                        max_model_len=128),
    "ngram speculation": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1}),
    "async scheduling": dict(async_scheduling=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("setup", ENGINE_SETUPS)
def test_greedy_constrained_tokens_equal_the_masked_reference(tiny, compiler, tokenizer, setup):
    folder, model = tiny
    llm = LLM(folder, **{"dtype": "float32", "max_model_len": 256, **ENGINE_SETUPS[setup]})
    eos = tokenizer.eos_token_id
    prompt_ids = [tokenizer.encode(p) * 10 for p in PROMPTS]   # repeated: n-gram drafts find matches
    max_tokens = 40
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=c) for c in CONSTRAINTS]
    # An unconstrained request in the same batch keeps its own greedy tokens.
    free = SamplingParams(temperature=0, max_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in [*prompt_ids, prompt_ids[0]]], [*params, free],
                           use_tqdm=False)
    for ids, constraint, out in zip(prompt_ids, CONSTRAINTS, outputs):
        expected = reference_constrained_greedy(model, compiler, ids, constraint, max_tokens, eos)
        assert out.outputs[0].token_ids == expected, constraint
    alone = llm.generate([{"prompt_token_ids": prompt_ids[0]}], free, use_tqdm=False)[0].outputs[0].token_ids
    assert outputs[-1].outputs[0].token_ids == alone
    assert_inside_grammars(outputs[:len(CONSTRAINTS)])
    if "preemption" in setup:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0


def assert_inside_grammars(outputs) -> None:
    """Every finished (not cut by max_tokens) output matches its constraint: CODE, PERSON, CHOICES, ARITH."""
    checks = [lambda t: re.fullmatch(CODE, t),
              lambda t: jsonschema.validate(json.loads(t), PERSON) is None,
              lambda t: t in CHOICES,
              lambda t: re.fullmatch(r"[0-9+()]+", t)]
    for check, out in zip(checks, outputs):
        for sample in out.outputs:
            if sample.finish_reason == "stop":
                assert check(sample.text), sample.text


@pytest.mark.slow
def test_sampled_outputs_stay_inside_the_grammar(tiny):
    folder, _ = tiny
    llm = LLM(folder, dtype="float32", max_model_len=256, num_kv_blocks=20, block_size=16)
    params = [SamplingParams(temperature=1.5, top_p=0.95, n=4, seed=i, max_tokens=60, structured_outputs=c)
              for i, c in enumerate(CONSTRAINTS)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finished = sum(s.finish_reason == "stop" for o in outputs for s in o.outputs)
    assert finished >= 8, [[s.text for s in o.outputs] for o in outputs]
    assert_inside_grammars(outputs)
    # The choice request can only end on one of the choices.
    assert all(s.text in CHOICES for s in outputs[2].outputs)


# ---- the server with the openai client ------------------------------------------------------------------

class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^\d{5}$")


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    favourite_color: Color
    address: Address
    # Every string bounded: at temperature 0.8 the 135M model can ramble in an unbounded one past max_tokens.
    nicknames: list[Annotated[str, Field(max_length=20)]] = Field(max_length=3)


class Score(BaseModel):
    subject: str = Field(max_length=20)
    score: float = Field(ge=0, le=10)
    passed: bool


class Scores(BaseModel):
    scores: list[Score] = Field(min_length=1, max_length=3)


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", "2048")
    s.wait_ready()
    yield s
    print(s.output()[-4000:])
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai", reason="needs the package openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120)


CASES = [(Person, "Describe a made-up person living in Paris."),
         (Scores, "Give two exam results for a student.")]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("model, question", CASES)
def test_parse_returns_the_pydantic_object(client, model, question, temperature):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": question}], response_format=model,
        temperature=temperature, seed=7, max_tokens=200)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model)


@pytest.mark.slow
@pytest.mark.parametrize("model, question", CASES)
def test_streamed_parse_returns_the_pydantic_object(client, model, question):
    with client.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": question}], response_format=model,
            temperature=0, max_tokens=200) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, model)


def starts_a_json_object(prefix: str) -> bool:
    """Whether `prefix` (a JSON text cut anywhere, as max_tokens cuts it) is the start of an object:
    closing its open string and brackets, after one of a few fillers for a cut key, value or literal,
    parses as a dict."""
    stack, in_string, escaped = [], False, False
    for ch in prefix:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and (not stack or stack.pop() != ch):
            return False
    text = prefix[:-1] if escaped else prefix
    if in_string:  # a cut \uXXXX escape goes, then the string closes
        text = re.sub(r"\\u[0-9a-fA-F]{0,3}$", "", text) + '"'
    closing = "".join(reversed(stack))
    for filler in ("", "null", ": null", "0", "e", "ue", "rue", "se", "lse", "alse", "ll", "ull", "l"):
        for body in (text, text.rstrip().rstrip(",")):
            try:
                if isinstance(json.loads(body + filler + closing), dict):
                    return True
            except json.JSONDecodeError:
                pass
    return False


def test_a_cut_json_object_is_recognised_as_one():
    doc = json.dumps({"name": "Ava \"A\" \\x \u00e9", "age": 25, "ok": True, "no": False, "none": None,
                      "skills": [1, "Py", {"a": [2.5, -3e4]}], "x": {}}, ensure_ascii=True)
    assert all(starts_a_json_object(doc[:i]) for i in range(1, len(doc) + 1))
    for text in ('{"a" 1', "[1]", "abc", '{"a": 1}}', '"x"'):
        assert not starts_a_json_object(text), text


@pytest.mark.slow
def test_json_object_regex_and_choice(client):
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A JSON object with your name."}], max_tokens=100,
        temperature=0, response_format={"type": "json_object"}).choices[0]
    # Greedy, this small model may repeat a list item until max_tokens cuts the object (which prompt
    # does depends on the kernels' summation order): cut, the text must still begin an object.
    if choice.finish_reason == "length":
        assert starts_a_json_object(choice.message.content), choice.message.content
    else:
        assert isinstance(json.loads(choice.message.content), dict)
    for seed in range(3):
        text = client.completions.create(
            model=MODEL, prompt="Flight code:", max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"regex": CODE}}).choices[0].text
        assert re.fullmatch(CODE, text), text
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=10, temperature=1.0,
            seed=seed, extra_body={"structured_outputs": {"choice": CHOICES}}).choices[0].message.content
        assert answer in CHOICES


@pytest.mark.slow
def test_what_cannot_compile_is_a_400(server):
    url = f"{server.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    assert_error(httpx.post(url, json={"messages": messages, "response_format": bad_schema}), 400,
                 "BadRequestError", "bogus")
    assert_error(httpx.post(url, json={"messages": messages, "structured_outputs": {"regex": "[a-"}}), 400,
                 "BadRequestError", "regex")
    assert_error(httpx.post(url, json={"messages": messages, "structured_outputs": {"regex": "a", "choice": ["a"]}}),
                 400, "BadRequestError", "exactly one")
    assert_error(httpx.post(url, json={"messages": messages, "response_format": {"type": "json_object"},
                                       "structured_outputs": {"regex": "a"}}), 400, "BadRequestError", "not both")
    assert_error(httpx.post(url, json={"messages": messages, "response_format": {"type": "json_schema"}}), 400,
                 "BadRequestError", "schema")
    # The server still answers.
    assert httpx.post(url, json={"messages": messages, "max_tokens": 2}, timeout=60).status_code == 200
