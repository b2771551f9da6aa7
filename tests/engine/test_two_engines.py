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


def test_batch_invariant_and_default_engines_step_in_turn():
    """A batch-invariant engine and a default one over one loaded model, stepped in turn, each give
    what a lone engine of its mode gives (tokens and logprobs, bit for bit); the modes do differ,
    and the loaded model keeps its default layers (the batch-invariant engine runs a copy of the
    modules that shares every weight)."""
    from tokenmill.layers.invariance import is_batch_invariant_model
    from tokenmill.loader import load_model

    loaded = load_model("tiny-llama", load_format="dummy", device="cpu", dtype="float32")
    prompts = [[5, 17, 300, 42, 7, 99, 12], [800, 3, 3, 64, 501]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    config = dict(num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=64)

    def outputs(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
                for o in outs]

    alone = {mode: outputs(make_llm(loaded, batch_invariant=mode, **config)) for mode in (True, False)}
    assert alone[True] != alone[False]  # the comparison below can tell the modes apart
    invariant = make_llm(loaded, batch_invariant=True, **config)
    default = make_llm(loaded, batch_invariant=False, **config)
    assert default.engine.runner.model is loaded.model and not is_batch_invariant_model(loaded.model)
    copy = invariant.engine.runner.model
    assert is_batch_invariant_model(copy)
    tensors = [t.data_ptr() for t in (*copy.parameters(), *copy.buffers())]
    assert tensors == [t.data_ptr() for t in (*loaded.model.parameters(), *loaded.model.buffers())]
    for _ in range(2):  # in turn: each engine's steps follow the other's
        assert outputs(invariant) == alone[True]
        assert outputs(default) == alone[False]
