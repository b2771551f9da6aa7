"""Structured output through the engine on the embedded model: every output of a JSON schema
parses and validates (greedy and sampled), json_object outputs parse, regex and choice outputs
match, the same with n-gram speculative decoding; bad specs are refused by name; grammars compile
once per spec."""

import json
import re

import jsonschema
import pytest

from tests.engine.conftest import assert_no_leaks, make_llm
from tokenmill import StructuredOutputsParams
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
NAME = {"type": "string", "minLength": 1, "maxLength": 12}

# Small enough that outputs finish well within max_tokens.
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -100, "maximum": 100},
        "y": {"type": "integer", "minimum": -100, "maximum": 100}}, "required": ["x", "y"],
        "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city", "country"],
     "additionalProperties": False},
    {"type": "object", "properties": {"primes": {"type": "array", "items": {"type": "integer", "minimum": 2,
                                                                            "maximum": 97},
                                                 "minItems": 2, "maxItems": 4}},
     "required": ["primes"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["answer", "confidence"], "additionalProperties": False},
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900,
                                                              "maximum": 2030}},
     "required": ["title", "year"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": NAME},
        "required": ["id", "name"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}},
     "required": ["temperature", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"name": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["name", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{1,8}$"}}, "required": ["word"],
     "additionalProperties": False},
    {"type": "object", "properties": {"day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                                      "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
     "required": ["day", "hour"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "b": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "sum": {"type": "integer", "minimum": 0, "maximum": 18}},
     "required": ["a", "b", "sum"], "additionalProperties": False},
    {"type": "object", "properties": {"language": {"enum": ["python", "rust", "go", "c"]},
                                      "typed": {"type": "boolean"}},
     "required": ["language", "typed"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "minItems": 1, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 2}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"type": "string", "enum": ["open", "closed"]},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 50},
                                      "note": {"type": ["string", "null"], "maxLength": 10}},
     "required": ["status", "count", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
     "required": ["ratio"], "additionalProperties": False},
    {"type": "object", "properties": {"animal": {"enum": ["cat", "dog"]}, "legs": {"const": 4}},
     "required": ["animal", "legs"], "additionalProperties": False},
]
MAX_TOKENS = 200


def _chat(llm, question: str) -> list[int]:
    tok = llm.engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def _schema_requests(llm):
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        prompt = _chat(llm, f"Answer in JSON following this schema: {json.dumps(schema)}")
        for sampled in (False, True):
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0.9 if sampled else 0.0, seed=i, max_tokens=MAX_TOKENS,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
    return prompts, params


def _check_schema_outputs(llm):
    prompts, params = _schema_requests(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs, params):
        text, schema = out.outputs[0].text, p.structured_outputs.json
        assert out.outputs[0].finish_reason == "stop", (text, schema)
        jsonschema.validate(json.loads(text), schema)
    assert_no_leaks(llm)
    assert not llm.engine.structured.matchers


@pytest.fixture(scope="module")
def llm(smollm):
    return make_llm(smollm, max_num_seqs=48, num_kv_blocks=512)


@pytest.mark.slow  # 44 requests of up to 60 tokens: about 11 s on two idle CPU cores (runs in CI; marked so `-m "not slow"` skips it)
def test_json_schemas_validate(llm):
    assert len(SCHEMAS) > 20
    _check_schema_outputs(llm)
    assert llm.engine.structured.num_compiled <= len(SCHEMAS) + 2  # once per spec (plus earlier tests')


def test_json_object_regex_and_choice(llm):
    cases = [
        (StructuredOutputsParams(json_object=True), "Reply with this JSON object and nothing else: {\"a\": 1}",
         lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"), "Make up a phone number.",
         lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (StructuredOutputsParams(regex=r"(yes|no), because [a-z ]{1,20}\."), "Is water wet?",
         lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t)),
        (StructuredOutputsParams(choice=["Paris", "London", "Berlin"]), "What is the capital of France?",
         lambda t: t in ("Paris", "London", "Berlin")),
        (StructuredOutputsParams(grammar='root ::= "(" [0-9] " + " [0-9] ")"'), "Write a sum.",
         lambda t: re.fullmatch(r"\([0-9] \+ [0-9]\)", t)),
    ]
    prompts, params, checks = [], [], []
    for spec, question, check in cases:
        for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.0)):
            prompts.append(_chat(llm, question))
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=80, structured_outputs=spec))
            checks.append(check)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, check in zip(outs, checks):
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text
    assert_no_leaks(llm)


def test_mixed_batch_with_plain_requests(llm):
    """Requests without a grammar in the same batch are unchanged (greedy tokens equal a run alone)."""
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = _chat(llm, "Write a short poem.")
    ref = llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].token_ids
    spec = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"choice": ["alpha", "beta"]})
    outs = llm.generate([prompt, _chat(llm, "Pick one."), prompt], [plain, spec, plain], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref and outs[2].outputs[0].token_ids == ref
    assert outs[1].outputs[0].text in ("alpha", "beta")
    assert_no_leaks(llm)


@pytest.mark.parametrize("spec, words", [
    ({"json": '{"type": "object", "properties": {"a": {"type": "intger"}}}'}, "json"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({}, "exactly one"),
    ({"choice": []}, "choice"),
    ({"jsn": {}}, "jsn"),
    # References out of the schema would be dropped silently (nothing constrained there): refused.
    ({"json": {"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}}, "example.com"),
    ({"json": {"type": "object", "properties": {"a": {"items": {"$ref": "file:///etc/passwd"}}}}}, "file:"),
])
def test_invalid_specs_are_refused(llm, spec, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        llm.engine.add_request([1, 2, 3], SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()
    # The compiler's message only: no "[17:13:00] /project/cpp/regex_converter.cc:94:" of its log lines.
    assert not re.search(r"\[\d+:\d+:\d+\]|\.cc:\d+", str(info.value)), str(info.value)


def test_min_tokens_with_a_grammar_is_refused():
    with pytest.raises(InvalidRequestError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=3, structured_outputs={"regex": "a+"})


def test_compile_cache_is_keyed_by_the_canonical_spec(llm):
    s = llm.engine.structured
    before = s.num_compiled
    a = s.compile(StructuredOutputsParams(json={"type": "object", "properties": {"q": {"type": "integer"}}}))
    b = s.compile(StructuredOutputsParams(json='{"properties": {"q": {"type": "integer"}}, "type": "object"}'))
    assert a is b and s.num_compiled == before + 1


def test_speculative_decoding_keeps_grammars(smollm):
    """Grammar requests speculate too (a mask for each draft position) and still validate, greedy
    and sampled, beside a plain request in the same batches."""
    spec_llm = make_llm(smollm, max_num_seqs=48, num_kv_blocks=512, speculative_config=NGRAM)
    assert spec_llm.engine.runner.speculates(SamplingParams(structured_outputs={"json_object": True}))
    prompts, params = _schema_requests(spec_llm)
    prompts, params = prompts[:12], params[:12]
    copy = _chat(spec_llm, "Copy exactly: the cat sat on the mat. the cat sat on the mat.")
    prompts.append(copy)
    params.append(SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    prompts.append(_chat(spec_llm, "Pick one."))
    params.append(SamplingParams(temperature=0.8, seed=3, max_tokens=20, structured_outputs={"regex": "(ab|cd){2}"}))
    outs = spec_llm.generate(prompts, params, use_tqdm=False)
    for out, p in zip(outs[:12], params[:12]):
        jsonschema.validate(json.loads(out.outputs[0].text), p.structured_outputs.json)
    assert re.fullmatch("(ab|cd){2}", outs[-1].outputs[0].text)
    assert spec_llm.engine.spec_stats.drafts > 0
    assert_no_leaks(spec_llm)
    assert not spec_llm.engine.structured.matchers


COPY = "the cat sat on the mat. " * 3


def _copy_requests(llm, regex: str, max_tokens: int = 40):
    prompt = _chat(llm, f"Repeat this text exactly, nothing else: {COPY}")
    return [prompt], [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs={"regex": regex})]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_grammar_drafts_accepted_and_greedy_unchanged(smollm, async_scheduling):
    """A grammar that allows what the n-gram lookup drafts: drafts are verified and accepted (every
    request of the step has a grammar), and greedy output is token for token the output without
    speculation."""
    plain = make_llm(smollm, async_scheduling=async_scheduling)
    spec = make_llm(smollm, async_scheduling=async_scheduling, speculative_config=NGRAM)
    regex = r"(the cat sat on the mat\. ){3}"
    prompts, params = _copy_requests(plain, regex)
    want = plain.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    got = spec.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(regex, want.text)
    assert got.token_ids == want.token_ids
    stats = spec.engine.spec_stats
    assert stats.accepted > 0, "the grammar request verified no accepted draft"
    assert_no_leaks(spec)


def test_grammar_refuses_drafts_it_forbids(smollm):
    """The n-gram lookup keeps drafting the text it saw (`mat`) where the grammar demands another
    word: those drafts are rejected, never emitted, and greedy output equals plain decoding's."""
    plain = make_llm(smollm)
    spec = make_llm(smollm, speculative_config=NGRAM)
    regex = r"(the cat sat on the (rug|dog)\. ){3}"
    prompts, params = _copy_requests(plain, regex)
    want = plain.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    got = spec.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(regex, got.text), got.text
    assert got.token_ids == want.token_ids
    stats = spec.engine.spec_stats
    assert stats.drafts > stats.accepted > 0  # some drafts stood, the forbidden ones did not
    assert_no_leaks(spec)


def test_grammar_masks_follow_each_draft_position(smollm):
    """The masks the engine sends for a verify step: row j is the grammar's state after the first j
    drafts, and rows after a refused draft are all ones; the walk leaves the matcher as it was."""
    import numpy as np

    from tokenmill.step_io import ScheduledRequest, SchedulerOutput

    llm = make_llm(smollm)
    manager, tok = llm.engine.structured, smollm.tokenizer
    manager.add("r", StructuredOutputsParams(regex="abc"))
    a, b, c, z = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "z"))

    class Drafting:  # what bitmask() reads of a request: the drafts its device row holds
        drafts = [a, z, c]

    sched = SchedulerOutput([ScheduledRequest("r", 4, 10, [], True, True)])
    masks = manager.bitmask(sched, {"r": Drafting()})
    assert masks.req_ids == ["r"] * 4 and list(masks.offsets) == [0, 1, 2, 3]

    def allowed(row: int, token: int) -> bool:
        return bool((int(masks.mask[row, token // 32]) >> (token % 32)) & 1)

    assert allowed(0, a) and not allowed(0, b)  # nothing accepted yet: `a` only
    assert allowed(1, b) and not allowed(1, z)  # after `a`: the next draft `z` is refused here
    assert (masks.mask[2:] == -1).all()  # rows after the refused draft: all ones (never used)
    assert manager.accept("r", a) and manager.accept("r", b)  # rolled back: the matcher starts over
    manager.remove("r")
    del np
