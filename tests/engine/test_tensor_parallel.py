"""Tensor and pipeline parallelism on the CPU (gloo, one process per rank): greedy tokens equal the
single-process engine's and HF transformers' (fp32) with the embedded model at TP = 3 (9 query
heads, 3 KV heads) and PP = 2, and a tiny HF model at TP = 2 and TP x PP = 2 x 2, with chunked
prefill and preemption too (with pipeline stages, one step per stage in flight); layouts that do
not split are refused; a dead worker fails the engine with a clear error. Workers start as a module of
the package: an engine built by a script read from stdin (no main guard) works, and a worker that
fails during start-up fails the engine's construction within seconds with the worker's own error."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.engine.conftest import NEW_TOKENS
from tests.test_hf_dir_models import _save_random_hf_model
from tokenmill.config import ConfigError
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
CPU = dict(dtype="float32", device="cpu", max_num_seqs=16)


def _tp_llm(tp: int, model=None, pp: int = 1, **kw) -> LLM:
    return LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **{**CPU, "num_kv_blocks": 256, **kw})


# Chunked prefill and preemption (its steps are prefills, mixed steps and decodes); the tiny-model tests
# below run the plain regime. TP = 3 in that regime is test_features_together_in_parallel_layouts's
# (against the single-process engine, which equals HF in tests/engine/test_greedy_vs_hf.py).
@pytest.mark.parametrize("layout", ["pp2"])
@pytest.mark.parametrize("regime", ["chunked+preemption"])
def test_embedded_model_equals_hf(layout, regime, chat_prompt_ids, hf_greedy):
    kw = {} if regime == "default" else dict(max_num_batched_tokens=24, num_kv_blocks=14)
    llm = _tp_llm(1, pp=2, **kw)
    try:
        # The first half of HF's greedy tokens: 8 prompts of ~37 + 16 tokens still overflow the 14
        # blocks (preemptions), and every prompt is still split into 24-token chunks.
        n = NEW_TOKENS // 2
        outs = llm.generate(chat_prompt_ids, SamplingParams(temperature=0, max_tokens=n, min_tokens=n),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [ref[:n] for ref in hf_greedy]
        engine = llm.engine
        if regime != "default":
            assert engine.scheduler.num_preemptions > 0
        assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.runner.states.row_of
        model = engine.loaded.model.model  # rank 0 is the last stage: the last 15 of the 30 layers only
        assert (model.start, model.end) == (15, 30) and not list(model.layers[0].parameters())
        assert engine.max_steps_in_flight == 2  # one step per stage
    finally:
        llm.engine.close()


# The TP engine runs in a script piped to `python -` with no main guard, as a user would write it.
_STDIN_SCRIPT = """
import json, sys
from tokenmill import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", device="cpu", max_num_seqs=16, num_kv_blocks=256)
params = [SamplingParams(**p) for p in json.loads(sys.argv[3])]
prompts = json.loads(sys.argv[2])
print(json.dumps([[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in params]))
"""


def test_tp2_tiny_model_from_a_stdin_script_equals_single_process(tmp_path):
    _save_random_hf_model("llama3.1", False, tmp_path)
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(8)]
    params = [dict(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS),  # greedy and seeded sampling
              dict(temperature=0.8, seed=5, max_tokens=20)]
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        tp = subprocess.Popen([sys.executable, "-", str(tmp_path), json.dumps(prompts), json.dumps(params)],
                              stdin=subprocess.PIPE, stdout=o, stderr=e, text=True)
    tp.stdin.write(_STDIN_SCRIPT)
    tp.stdin.close()
    single = LLM(str(tmp_path), **CPU, num_kv_blocks=256)  # meanwhile
    want = [[o.outputs[0].token_ids for o in single.generate(prompts, SamplingParams(**p), use_tqdm=False)]
            for p in params]
    assert tp.wait(300) == 0, err.read_text()[-3000:]
    assert json.loads(out.read_text().strip().splitlines()[-1]) == want


def test_a_worker_failing_at_start_up_fails_the_engine_at_once_with_its_error(tmp_path):
    """A worker whose environment lacks a dependency (safetensors, hidden from the workers alone by a
    sitecustomize that only a worker's environment triggers): the engine's construction fails within
    seconds (not the store's 600 s), and the error carries the worker's own message."""
    from tokenmill.executor.tensor_parallel import ENV_RANK, TPWorkerError

    model = tmp_path / "model"
    _save_random_hf_model("llama3.1", False, model)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        f"import os, sys\nif os.environ.get({ENV_RANK!r}):\n    sys.modules['safetensors'] = None\n")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(hook)] + ([old] if old else []))
    try:
        started = time.monotonic()
        with pytest.raises(TPWorkerError, match=r"(?s)worker rank 1 exited \(code 1\) while starting.*"
                                                r"import of safetensors halted"):
            _tp_llm(2, str(model))
        assert time.monotonic() - started < 60  # a model load on a loaded CI machine, never the 600 s timeout
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


def test_tp2_pp2_tiny_model_equals_single_process(tmp_path):
    _save_random_hf_model("llama3.1", False, tmp_path)  # 2 layers: one a stage
    prompts = [[(5 * i + 11 * j) % 500 + 1 for j in range(4 + 5 * i)] for i in range(8)]
    single = LLM(str(tmp_path), **CPU, num_kv_blocks=256)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    llm = _tp_llm(2, str(tmp_path), pp=2, max_num_batched_tokens=32, num_kv_blocks=16)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == want
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.max_steps_in_flight == 2
    finally:
        llm.engine.close()


def test_layouts_that_do_not_split_are_refused():
    with pytest.raises(ConfigError, match="9 attention heads"):
        _tp_llm(2)  # the embedded model: 9 query heads, 3 KV heads
    with pytest.raises(ConfigError, match="not supported yet"):
        _tp_llm(2, "tiny-llama", load_format="dummy", enable_lora=True)
    with pytest.raises(ConfigError, match="more than the model's 2 layers"):
        _tp_llm(1, "tiny-llama", pp=3, load_format="dummy")


def test_a_dead_worker_fails_the_engine_clearly(tmp_path):
    _save_random_hf_model("llama3.1", False, tmp_path)
    llm = _tp_llm(2, str(tmp_path))
    try:
        worker = llm.engine.executor._procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.proc.wait(10)
        with pytest.raises(RuntimeError, match="worker rank 1 exited"):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("layout", ["tp3+ngram", "pp2"])
def test_features_together_in_parallel_layouts(layout, features_alone):
    """The sampling features of tests/engine/test_features_together.py (grammars, bad words, allowed
    tokens, n = 2 with prompt logprobs, the prefix cache; n-gram speculation at TP = 3, which pipeline
    stages do not take) with chunked prefill and preemption: each request's tokens equal its run
    alone on a single-process engine, and nothing leaks."""
    from tests.engine.conftest import assert_no_leaks
    from tests.engine.test_features_together import NUM_KV_BLOCKS
    from tests.engine.test_structured_output import NGRAM

    requests, _, banned, alone = features_alone
    kw = dict(max_num_batched_tokens=48, num_kv_blocks=NUM_KV_BLOCKS)
    llm = (_tp_llm(3, speculative_config=NGRAM, **kw) if layout == "tp3+ngram" else _tp_llm(1, pp=2, **kw))
    try:
        together = llm.generate([p for p, _ in requests], [q for _, q in requests], use_tqdm=False)
        for want, got in zip(alone, together):
            assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        # The same tokens and ranks; the values within 1e-2. The reference itself moves by up to 4e-4
        # from one process to the next (MKL's kernels depend on memory alignment unless MKL_CBWR is
        # set), and 30 layers of other batches and chunks make that up to 3.2e-3 (at -3.03).
        got_lp, want_lp = together[5].prompt_logprobs, alone[5].prompt_logprobs
        assert len(got_lp) == len(want_lp) and got_lp[0] is None and want_lp[0] is None
        for g, w in zip(got_lp[1:], want_lp[1:]):
            assert {t: lp.rank for t, lp in g.items()} == {t: lp.rank for t, lp in w.items()}
            diffs = {t: abs(g[t].logprob - w[t].logprob) for t in w}
            assert max(diffs.values()) < 1e-2, (diffs, g, w)
        assert banned not in together[3].outputs[0].token_ids
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0
        if layout == "pp2":
            assert engine.max_steps_in_flight == 2
        else:
            assert engine.spec_stats.accepted > 0
            # the shards really are shards: rank 0 holds a third of the q/k/v rows
            qkv = engine.loaded.model.model.layers[0].self_attn.qkv_proj
            assert qkv.weight.shape[0] == (9 + 2 * 3) * 64 // 3
        assert_no_leaks(llm)
    finally:
        llm.engine.close()
