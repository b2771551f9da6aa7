"""Structured output on CUDA with the embedded model's real weights: JSON-schema outputs validate with
and without n-gram speculation, greedy grammar output is token for token the same with speculation
(fp32), grammar drafts are accepted, and grammar requests compile no kernel after warm-up.

Needs xgrammar and the embedded model's GGUF file (see test_warmup_real_weights.py).
"""

import json
import re

import pytest

from tests.gpu.test_warmup_real_weights import _gguf_path
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
xgr = pytest.importorskip("xgrammar")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
COPY_REGEX = r"(the cat sat on the mat\. ){3}"


def _check_person(text: str) -> None:
    """SCHEMA by hand (the GPU machine has no jsonschema)."""
    value = json.loads(text)
    assert set(value) == {"name", "age"}, text
    assert isinstance(value["name"], str) and len(value["name"]) <= 12, text
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120, text


def _engine(spec: bool, dtype: str = "float32") -> LLM:
    config = EngineConfig(max_num_seqs=64, max_model_len=2048, num_kv_blocks=2048,
                          speculative_config=NGRAM if spec else None)
    return LLM.from_engine(LLMEngine(_gguf_path(), config, dtype=dtype, device="cuda"))


def _requests(llm: LLM):
    def chat(text):
        return llm.render_chat([{"role": "user", "content": text}])

    prompts, params = [], []
    for i in range(16):
        prompts.append(chat(f"Describe person number {i} as JSON with a name and an age."))
        params.append(SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=48,
                                     structured_outputs={"json": SCHEMA}))
    prompts.append(chat("Repeat this text exactly, nothing else: " + "the cat sat on the mat. " * 3))
    params.append(SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": COPY_REGEX}))
    return prompts, params


def test_grammars_with_and_without_speculation():
    plain, spec = _engine(False), _engine(True)
    prompts, params = _requests(plain)
    outs = {name: llm.generate(prompts, params, use_tqdm=False) for name, llm in (("plain", plain), ("spec", spec))}
    for name, results in outs.items():
        for out in results[:16]:
            _check_person(out.outputs[0].text)
        assert re.fullmatch(COPY_REGEX, results[16].outputs[0].text), (name, results[16].outputs[0].text)
    for i in range(1, 16, 2):  # greedy (fp32): speculation changes no token
        assert outs["spec"][i].outputs[0].token_ids == outs["plain"][i].outputs[0].token_ids
    assert outs["spec"][16].outputs[0].token_ids == outs["plain"][16].outputs[0].token_ids
    assert spec.engine.spec_stats.accepted > 0
    for llm in (plain, spec):
        assert llm.engine.compile_watch.stats().compiles_after_warm == 0
        assert not llm.engine.structured.matchers
