"""Two engines with different settings in one process never change each other's step path: the
fused batch-1 choice travels in each step's forward context, and each engine counts its own
kernel compiles."""

import pytest
import torch

from tests.engine.conftest import make_llm
from tokenmill.layers.forward_context import current_forward_context
from tokenmill.sampling_params import SamplingParams


def _record_fusion(model) -> list[bool]:
    """What every forward pass of the model sees as its step's small_batch_fusion setting."""
    seen: list[bool] = []

    def hook(module, args):
        seen.append(current_forward_context().small_batch_fusion)

    model.model.layers[0].register_forward_pre_hook(hook)
    return seen


def test_engines_keep_their_own_settings(smollm, chat_prompt_ids):
    fused = make_llm(smollm, fused_small_batch_linear=True, max_num_seqs=1)
    plain = make_llm(smollm, fused_small_batch_linear=False, max_num_seqs=1)
    assert fused.engine.compile_watch is not plain.engine.compile_watch
    seen = _record_fusion(smollm.model)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    try:
        for prompt in chat_prompt_ids[:2]:  # alternate: each engine's step follows the other's
            seen.clear()
            a = fused.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            assert seen and all(seen)
            seen.clear()
            b = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            assert seen and not any(seen)
            assert a == b  # on the CPU the choice changes nothing else
    finally:
        smollm.model.model.layers[0]._forward_pre_hooks.clear()


@pytest.mark.gpu
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
