"""Speculative decoding with a draft model and with the layer-truncated self-draft on CUDA: greedy
output equals greedy output without speculation (fp32) with the draft steps replaying their CUDA
graphs or running eagerly, batched or alone; the k draft steps replayed as a graph give the drafts
and the K/V writes of the same steps run eagerly; the step path never syncs.

Written on a machine without a GPU: not run there.
"""

import random

import pytest
import torch

from tests.gpu.test_no_sync import GREEDY as NO_SYNC_GREEDY
from tests.gpu.test_no_sync import _check_no_sync
from tests.gpu.test_runner_cuda import to_cuda
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.loader.load import load_model
from tokenmill.runner.cuda_graphs import no_garbage_collection
from tokenmill.runner.kv_cache import KVCacheSpec, allocate_kv_cache
from tokenmill.runner.request_states import RequestStates
from tokenmill.step_io import NewRequestData
from tokenmill.runner.spec_decode.draft_model import DraftModelProposer
from tokenmill.runner.spec_decode.layer_truncated import LayerTruncatedProposer
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

# The model is passed loaded (draft_loaded), so "model" only names it.
DRAFT_SELF = {"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 4}
DRAFT_OTHER = {"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 3}
TRUNCATED = {"method": "layer_truncated", "num_draft_layers": 8, "num_speculative_tokens": 3}


def prompts(vocab: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(5, 120))] for _ in range(n)]


@pytest.fixture(scope="module")
def smollm_fp32():
    """smollm2-135m shapes with the loader's dummy weights, fp32 on CUDA, and its plain greedy tokens."""
    cpu = load_model("smollm2-135m", load_format="dummy", device="cpu", dtype="float32", max_positions=2048)
    gpu = to_cuda(cpu, torch.float32)
    ps = prompts(cpu.arch.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    llm = LLM.from_engine(LLMEngine(config=config_of(None), loaded=gpu))
    ref = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    return gpu, ps, params, ref


@pytest.fixture(scope="module")
def other_draft():
    """A draft with the target's vocabulary but weights of its own (a second dummy initialisation)."""
    cpu = load_model("smollm2-135m", load_format="dummy", device="cpu", dtype="float32", max_positions=2048, seed=5)
    return to_cuda(cpu, torch.float32)


def config_of(spec, **overrides) -> EngineConfig:
    return EngineConfig(**{"num_kv_blocks": 512, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
                           "max_model_len": 2048, "speculative_config": spec, **overrides})


def _count_replays(loop) -> dict:
    seen = {"replays": 0}

    class Counted:
        def __init__(self, graph):
            self.graph = graph

        def replay(self):
            seen["replays"] += 1
            self.graph.replay()

    loop.graphs = {size: Counted(g) for size, g in loop.graphs.items()}
    return seen


@pytest.mark.parametrize("overrides", [{}, {"enforce_eager": True}, {"max_num_seqs": 1}, {"async_scheduling": False},
                                       {"max_num_batched_tokens": 64}, {"num_kv_blocks": 40}],
                         ids=["graphs+async", "eager", "batch-1", "sync", "chunked-prefill", "preemption"])
@pytest.mark.parametrize("method", ["draft-self", "draft-other", "layer-truncated"])
def test_greedy_with_draft_matches_plain(smollm_fp32, other_draft, method, overrides):
    gpu, ps, params, ref = smollm_fp32
    spec, draft = {"draft-self": (DRAFT_SELF, gpu), "draft-other": (DRAFT_OTHER, other_draft),
                   "layer-truncated": (TRUNCATED, None)}[method]
    engine = LLMEngine(config=config_of(spec, **overrides), loaded=gpu, draft_loaded=draft)
    loop = engine.runner.spec.proposer.loop
    seen = _count_replays(loop) if loop.graphs else None
    llm = LLM.from_engine(engine)
    if overrides.get("max_num_seqs") == 1:
        out = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in ps]
    else:
        out = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert out == ref
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    stats = engine.spec_stats
    assert stats.drafts > 0
    if method == "draft-self":  # the target drafting for itself (fp32; a near tie may flip one argmax)
        assert stats.acceptance_rate > 0.95, stats.summary()
    if overrides.get("enforce_eager"):
        assert not loop.graphs
    else:
        assert loop.graphs and seen["replays"] > 0, "no draft step replayed a graph"
    if overrides.get("num_kv_blocks"):
        assert engine.scheduler.num_preemptions > 0


def _tiny_proposer(kind: str):
    cpu = load_model("tiny-llama", load_format="dummy", device="cpu", dtype="float32", max_positions=256)
    gpu = to_cuda(cpu, torch.float32)
    cuda = torch.device("cuda")
    bs, blocks, k = 16, 64, 4
    if kind == "draft_model":
        proposer = DraftModelProposer(gpu.model, gpu.arch.vocab_size, k, 16, 256, bs, cuda)
        proposer.bind_kv_cache(blocks, None)
        caches = proposer.kv_caches
    else:
        spec = gpu.model.attention_spec()
        caches = allocate_kv_cache(KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, bs, spec.dtype),
                                   blocks, cuda)
        proposer = LayerTruncatedProposer(gpu.model, 1, k, 16, 256, bs, cuda)
        proposer.bind_kv_cache(blocks, caches)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k_cache, v_cache in caches:
        k_cache.normal_(generator=gen)
        v_cache.normal_(generator=gen)
    states = RequestStates(16, 256, bs, cuda)
    rng = random.Random(1)
    for i in range(5):
        n = rng.randint(3, 60)
        states.add(NewRequestData(f"r{i}", [rng.randrange(1000) for _ in range(n)], n, SamplingParams(), 0,
                                  [3 * i, 3 * i + 1, 3 * i + 2, 3 * i + 20]))
    states.apply_staged()
    return proposer, caches, states


@pytest.mark.parametrize("kind", ["draft_model", "layer_truncated"])
def test_graph_replay_equals_eager_draft_steps(kind):
    """The k draft steps of a padded batch as a CUDA graph: the same drafts and the same K/V writes
    as the same steps of the same padded batch run eagerly (the same kernels over the same buffers
    and metadata); the padding entry writes nothing."""
    proposer, caches, states = _tiny_proposer(kind)
    loop = proposer.loop
    with no_garbage_collection():  # as the runner captures: a collection must not free a graph mid-capture
        loop.capture([1, 2, 4, 8])
    idx = torch.tensor([states.row_of[f"r{i}"] for i in (3, 0, 4)], dtype=torch.int64, device="cuda")
    limit = torch.full((3,), 64, dtype=torch.int64, device="cuda")
    mask = torch.tensor([True, False, True], device="cuda")
    args = (states.token_table.gpu, states.num_prefill_gpu, states.block_table.gpu, limit, mask)
    before = [(k.clone(), v.clone()) for k, v in caches]
    graphed = loop.run(idx, 3, *args).draft_ids.clone()  # padded to 4, replayed
    after_graph = [(k.clone(), v.clone()) for k, v in caches]
    for (k, v), (k0, v0) in zip(caches, before):
        k.copy_(k0)
        v.copy_(v0)
    loop._load(idx, 3, 4, *args)  # the graph's padded size: the same shapes, so the same kernels
    loop._steps(4)
    torch.cuda.synchronize()
    assert torch.equal(loop._drafts[:3], graphed)
    for (k, v), (kg, vg) in zip(caches, after_graph):
        assert torch.equal(k, kg) and torch.equal(v, vg)
    changed = sum(int((k != k0).any(-1).any(-1).sum()) for (k, _), (k0, _) in zip(caches, before))
    assert changed > 0  # the drafting entries wrote their K/V


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("spec", [{"method": "draft_model", "model": "smollm2-135m", "load_format": "dummy",
                                   "num_speculative_tokens": 3}, TRUNCATED], ids=["draft-model", "layer-truncated"])
@pytest.mark.parametrize("num_requests", [8, 1], ids=["batch-8", "batch-1"])
def test_draft_step_path_never_syncs(enforce_eager, spec, num_requests):
    """The draft's replay of the step, its k draft steps (graphs or eager) and the verify steps."""
    _check_no_sync(EngineConfig(num_kv_blocks=256, max_num_seqs=16, enforce_eager=enforce_eager,
                                speculative_config=spec), NO_SYNC_GREEDY, num_requests, min_steps=10)


def test_kv_cache_sized_for_target_and_draft():
    """From device memory: the draft's cache takes its share of every block."""
    import gc

    def blocks(spec):
        gc.collect()
        torch.cuda.empty_cache()
        engine = LLMEngine("smollm2-135m", EngineConfig(gpu_memory_utilization=0.3, max_model_len=2048,
                                                        speculative_config=spec),
                           load_format="dummy", device="cuda")
        n = engine.kv.num_blocks
        del engine
        return n

    plain = blocks(None)
    with_draft = blocks({"method": "draft_model", "model": "smollm2-135m", "load_format": "dummy"})
    assert 0.4 * plain < with_draft < 0.55 * plain  # the draft (the same shapes) doubles each block
