"""Gemma 2 / 3 on CUDA (Triton attention with per-layer windows and Gemma 2's soft-capping, CUDA
graphs) against HF's fp32 on the CPU: the tiny random models of tests/models/test_gemma.py."""

import pytest
import torch

from tests.engine.conftest import make_llm
from tests.helpers import full_logits
from tests.models.moe_helpers import EOS, VOCAB, save_random_model
from tests.models.test_gemma import KINDS, NEW_TOKENS, _prompts, hf_gemma_config
from tokenmill.loader import load_model
from tokenmill.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind", KINDS)
def test_gemma_cuda_matches_hf(kind, tmp_path):
    hf = save_random_model(hf_gemma_config(kind), tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cuda")
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 30, 100)]
    for seq, logits in zip(seqs, full_logits(loaded.model, seqs)):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        err = ((logits.cpu() - ref).norm() / ref.norm()).item()
        assert err < 1e-4, f"{kind}, {len(seq)} tokens: relative error {err}"
    prompts = _prompts()
    llm = make_llm(loaded, max_model_len=64, max_num_batched_tokens=16, num_kv_blocks=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=EOS)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, f"{kind}: {len(prompt)}-token prompt"
