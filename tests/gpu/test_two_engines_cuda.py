"""Two engines with different fused batch-1 settings over one model on CUDA, stepping in turn."""

import pytest
import torch

from tests.engine.conftest import make_llm
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def test_engines_keep_their_own_batch1_path_on_cuda():
    """On CUDA the fused engine's batch-1 steps run the GEMV kernel and the other's do not, with
    both engines built over one model and stepping in turn."""
    from tokenmill.kernels import skinny_gemm
    from tokenmill.loader.load import load_model

    loaded = load_model("smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16", max_positions=512)
    fused = make_llm(loaded, fused_small_batch_linear=True, max_num_seqs=1, enforce_eager=True)
    plain = make_llm(loaded, fused_small_batch_linear=False, max_num_seqs=1, enforce_eager=True)
    calls = {"n": 0}
    original = skinny_gemm.skinny_linear_triton

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    skinny_gemm.skinny_linear_triton = counting
    try:
        for llm, expect_fused in ((fused, True), (plain, False), (fused, True)):
            calls["n"] = 0
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
            assert (calls["n"] > 0) == expect_fused
    finally:
        skinny_gemm.skinny_linear_triton = original
    torch.cuda.synchronize()


def test_batch_invariant_and_default_engines_step_in_turn_on_cuda():
    """A batch-invariant engine and a default one over one CUDA model (graphs captured), stepping in
    turn, each give what a lone engine of its mode gives, bit for bit (the batch-invariant one runs
    its own copy of the modules, layers/invariance.py)."""
    from tokenmill.loader.load import load_model

    loaded = load_model("smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16", max_positions=512)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [40, 41, 42], [900, 17]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    config = dict(max_num_seqs=4, num_kv_blocks=64, cuda_graph_max_batch=4, piecewise_cuda_graph_max_tokens=64)

    def outputs(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
                for o in outs]

    alone = {}
    for mode in (True, False):
        llm = make_llm(loaded, batch_invariant=mode, **config)
        alone[mode] = outputs(llm)
        del llm
    assert alone[True] != alone[False]
    invariant = make_llm(loaded, batch_invariant=True, **config)
    default = make_llm(loaded, batch_invariant=False, **config)
    for _ in range(2):
        assert outputs(invariant) == alone[True]
        assert outputs(default) == alone[False]
    torch.cuda.synchronize()
