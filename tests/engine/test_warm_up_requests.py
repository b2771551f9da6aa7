"""The step-path warm-up (run on CUDA at start-up) leaves the engine as if nothing had run; here on
the CPU, where the engine itself does not call it."""

from tests.engine.conftest import assert_no_leaks, make_llm
from tokenmill.runner.sample import gumbel as gumbel_module, sampler as sampler_module
from tokenmill.sampling_params import SamplingParams


def test_warm_up_leaves_no_trace(smollm):
    llm = make_llm(smollm)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)[0]
    llm = make_llm(smollm)
    engine = llm.engine
    engine._warm_up_step_path()
    assert_no_leaks(llm)
    assert engine.generation_tokens == 0 and engine.steps_completed == 0 and engine.last_step_kind is None
    assert engine.stats().prompt_tokens == 0 and engine.kv.prefix_queries == 0
    out = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)[0]
    assert out.request_id == first.request_id and out.outputs[0].token_ids == first.outputs[0].token_ids


def test_warm_up_fits_a_tiny_context(smollm):
    """Prompts are cut to the context length; whatever still does not fit is left out."""
    llm = make_llm(smollm, max_model_len=6)
    llm.engine._warm_up_step_path()
    assert_no_leaks(llm)
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def test_warm_up_meets_every_sampler_variant(smollm, monkeypatch):
    """The Gumbel kernel compiles one variant per (logits dtype, all rows greedy): the model's raw
    logits, or the float32 copy that penalties and filters write into. The warm-up must run all
    four, or the first request of a missing kind compiles on the step path. (On the CPU the model
    is float32 too, so a copy is told from the raw logits by its storage.)"""
    seen, raw = set(), {}
    real_call, real_sample = sampler_module.Sampler.__call__, gumbel_module.gumbel_sample

    def call(self, logits, *args, **kwargs):
        raw["ptr"] = logits.data_ptr()
        return real_call(self, logits, *args, **kwargs)

    def sample(logits, temperature, seeds, positions, greedy_only=False):
        seen.add(("raw" if logits.data_ptr() == raw["ptr"] else "copy", bool(greedy_only)))
        return real_sample(logits, temperature, seeds, positions, greedy_only)

    monkeypatch.setattr(sampler_module.Sampler, "__call__", call)
    monkeypatch.setattr(gumbel_module, "gumbel_sample", sample)
    llm = make_llm(smollm)
    llm.engine._warm_up_step_path()
    assert seen == {("raw", True), ("raw", False), ("copy", True), ("copy", False)}
    assert_no_leaks(llm)
