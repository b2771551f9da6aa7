"""Each model family beyond Llama on CUDA (fp32, the tiny random HF models of tests/models/): full
logits within 1e-4 of HF's fp32 on the CPU, and greedy tokens through a busy engine (mixed lengths,
chunked prefill, preemption) equal to HF's, once with CUDA graphs and once eager."""

import pytest
import torch

from tests.engine.conftest import assert_no_leaks, make_llm
from tests.helpers import full_logits
from tests.models.moe_helpers import EOS, VOCAB, save_random_model
from tests.models.test_deepseek import hf_deepseek_config
from tests.models.test_gemma import hf_gemma_config
from tests.models.test_gpt_oss import hf_gpt_oss_config
from tests.models.test_phi3 import hf_phi3_config
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# family -> its tiny HF config (the CPU tests' own)
FAMILIES = {
    "gemma3": lambda: hf_gemma_config("gemma3"),
    "gemma2": lambda: hf_gemma_config("gemma2"),
    "phi3": lambda: hf_phi3_config("phi3"),
    "phi4_mini": lambda: hf_phi3_config("phi4_mini"),
    # attention sinks, alternating windows, biased experts with the clamped SwiGLU
    "gpt_oss": hf_gpt_oss_config,
    # multi-head latent attention: decode graphs run the absorbed latent kernel
    "deepseek_v2": lambda: hf_deepseek_config("v2"),
    "deepseek_v3": lambda: hf_deepseek_config("v3"),
}
# Phi-3's prompts all start past original_max_position_embeddings, so HF uses the long LongRoPE
# factors at every step, as an engine with this context length does (tests/models/test_phi3.py).
PROMPT_LENGTHS = {"phi3": (50, 60, 77, 95), "phi4_mini": (50, 60, 77, 95)}
NEW_TOKENS = 16


def _prompts(family: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, EOS, (n,), generator=gen).tolist()
            for n in PROMPT_LENGTHS.get(family, (5, 11, 20, 37, 70))]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_on_cuda_matches_hf_with_graphs_and_eager(family, tmp_path):
    hf = save_random_model(FAMILIES[family](), tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cuda")
    gen = torch.Generator().manual_seed(1)
    lengths = (50, 70, 100) if family in PROMPT_LENGTHS else (5, 30, 100)  # Phi-3: long factors in HF too
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    for seq, logits in zip(seqs, full_logits(loaded.model, seqs)):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        err = ((logits.cpu() - ref).norm() / ref.norm()).item()
        assert err < 1e-4, f"{family}, {len(seq)} tokens: relative error {err}"
    prompts = _prompts(family)
    refs = []
    for prompt in prompts:
        with torch.no_grad():
            refs.append(hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=EOS)[0, len(prompt):].tolist())
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for eager in (False, True):
        llm = make_llm(loaded, max_model_len=128, max_num_batched_tokens=32, num_kv_blocks=9, enforce_eager=eager)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        for prompt, out, ref in zip(prompts, outs, refs):
            assert out.outputs[0].token_ids == ref, f"{family} eager={eager}: {len(prompt)}-token prompt"
        assert llm.engine.scheduler.num_preemptions > 0
        assert_no_leaks(llm)
        del llm
