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
