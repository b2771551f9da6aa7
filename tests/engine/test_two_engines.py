"""Two engines with different settings in one process never change each other's step path: the
fused batch-1 choice travels in each step's forward context, and each engine counts its own
kernel compiles."""

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
