"""The KV connector and the host-memory tier (kv_offloading_size, tokenmill/kv_connector/).

Mechanics on the tiny dummy Llama: outputs with the tier equal those without it (greedy and seeded,
with GPU eviction and host reload, preemption, a LoRA adapter and cache salts), with loads in the
step that needs them (the default) and asynchronous ones (load_async); a failed asynchronous load is
recomputed, an abort mid-load leaks no block, the counters reach /metrics. The host tier's two
sides are also tried alone. The embedded model's check against HF is tests/engine/test_greedy_vs_hf.py's
"host-tier" configuration.
"""

import dataclasses
import random

import pytest
import torch

from tests.engine.conftest import assert_no_leaks, make_llm
from tokenmill.engine.block_hash import hash_blocks
from tokenmill.engine.engine_snapshot import EngineSnapshot
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.kv_connector.base import BlockTransfer, KVConnectorMetadata, KVConnectorOutput, LoadRequest
from tokenmill.kv_connector.counts import HostTierCounts
from tokenmill.kv_connector.host_tier import HostTierScheduler, HostTierWorker
from tokenmill.lora.request import LoRARequest
from tokenmill.runner.kv_cache import KVCacheSpec, allocate_kv_cache
from tokenmill.sampling_params import SamplingParams

BS = 8
HOST_GIB = 0.01  # about 1,300 tiny-llama blocks: the whole workload fits
# 24 blocks of 8 tokens: four requests of ~9 blocks do not fit at once (preemption), and each round
# of prompts evicts the previous round's prefixes to the host.
ENGINE = dict(num_kv_blocks=24, block_size=BS, max_num_seqs=4, max_num_batched_tokens=128)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
FILL = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # prompts that only take blocks


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, seed=seed, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    from tokenmill.loader import load_model

    return load_model("tiny-llama", load_format="dummy", device="cpu", dtype="float32")


def tiny_adapter(path) -> LoRARequest:
    """A LoRA adapter of tiny-llama's shapes (random non-zero A and B) saved at path."""
    import transformers as tf

    from tests.lora_adapters import make_adapter

    hf = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=32))
    return LoRARequest("tiny-a", 1, make_adapter(hf, path, rank=4))


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return tiny_adapter(tmp_path_factory.mktemp("lora") / "a")


def tier(loaded, **overrides):
    return make_llm(loaded, **{**ENGINE, "enable_lora": True, "max_lora_rank": 4, **overrides})


def offloading(**extra) -> dict:
    """kv_transfer_config of the host tier with kv_connector_extra_config options."""
    return {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"size_gib": HOST_GIB, **extra}}


def workload(adapter):
    """Rounds of (prompt, params, adapter): shared 56-token prefixes with different tails, each
    prefix coming back in later rounds (by then evicted from the GPU), some under a LoRA adapter or
    a cache salt (those never hit the others' blocks)."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 1000) for _ in range(56)] for _ in range(5)]
    rounds = []
    for r in range(3):
        batch = []
        for i, prefix in enumerate(prefixes):
            tail = [rng.randrange(3, 1000) for _ in range(3 + r)]
            params = GREEDY if (i + r) % 2 else seeded(10 * i + r)
            if i == 3:
                params = dataclasses.replace(params, cache_salt="tenant-b")
            batch.append((prefix + tail, params, adapter if i == 4 else None))
        rounds.append(batch)
    return rounds


def run(llm, rounds):
    out = []
    for batch in rounds:
        results = llm.generate([p for p, _, _ in batch], [q for _, q, _ in batch], use_tqdm=False,
                               lora_request=[a for _, _, a in batch])
        out.append([(r.outputs[0].token_ids, r.metrics.num_cached_prompt_tokens,
                     r.metrics.num_host_cached_prompt_tokens) for r in results])
    return out


@pytest.fixture(scope="module")
def plain_run(tiny, adapter):
    llm = tier(tiny)
    out = run(llm, workload(adapter))
    assert llm.engine.scheduler.num_preemptions > 0  # the regime really happened
    assert_no_leaks(llm)
    return out


@pytest.mark.parametrize("load_async", [False, True], ids=["in-step-loads", "async-loads"])
def test_outputs_equal_those_without_the_host_tier(tiny, adapter, plain_run, load_async):
    llm = tier(tiny, kv_transfer_config=offloading(load_async=load_async))
    got = run(llm, workload(adapter))
    assert [[t for t, _, _ in b] for b in got] == [[t for t, _, _ in b] for b in plain_run]
    host = llm.engine.snapshot().kv_offload
    assert host.hit_tokens > 0 and host.blocks_saved > 0 and host.blocks_loaded > 0 and host.failed_loads == 0
    assert host.bytes_loaded == host.blocks_loaded * llm.engine.runner.kv_spec.bytes_per_block
    assert host.load_seconds > 0
    assert llm.engine.scheduler.num_preemptions > 0
    # Later rounds load their prefixes back from the host (the GPU cache could not keep them); the
    # per-tier split adds up, and the totals count what came from each tier.
    later = [x for b in got[1:] for x in b]
    assert sum(h for _, _, h in later) > 0
    assert all(0 <= h <= c for _, c, h in later)
    assert host.hit_tokens >= sum(h for b in got for _, _, h in b)
    assert sum(c for b in got for _, c, _ in b) > sum(c for b in plain_run for _, c, _ in b)
    assert_no_leaks(llm)


def test_salts_and_adapters_stay_apart_on_the_host(tiny, adapter):
    llm = tier(tiny, kv_offloading_size=HOST_GIB)
    prompt = list(range(100, 160))
    salted = dataclasses.replace(GREEDY, cache_salt="a")
    other_salt = dataclasses.replace(GREEDY, cache_salt="b")
    fillers = iter(range(7, 1000, 4))

    def evict():  # new prompts that take every GPU block
        first = next(fillers)
        llm.generate([[first + i] * 60 for i in range(4)], FILL, use_tqdm=False)

    def host_hit(params, lora=None) -> int:
        evict()
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].metrics.num_host_cached_prompt_tokens

    llm.generate([prompt], salted, use_tqdm=False)
    assert host_hit(other_salt) == 0  # another salt's key chain: no host hit
    assert host_hit(GREEDY) == 0  # nor without a salt
    assert host_hit(GREEDY, adapter) == 0  # nor under an adapter
    assert host_hit(salted) == 56  # its own salt: the 7 full blocks before the last token
    assert host_hit(GREEDY, adapter) == 56
    assert_no_leaks(llm)


def test_a_failed_load_recomputes_the_prefix(tiny, adapter, plain_run):
    llm = tier(tiny, kv_transfer_config=offloading(load_async=True, fail_loads=2))
    got = run(llm, workload(adapter))
    assert [[t for t, _, _ in b] for b in got] == [[t for t, _, _ in b] for b in plain_run]
    host = llm.engine.snapshot().kv_offload
    assert host.failed_loads == 2 and host.blocks_loaded > 0  # later loads went through
    assert_no_leaks(llm)


def test_an_abort_mid_load_frees_every_block(tiny):
    llm = tier(tiny, kv_transfer_config=offloading(load_async=True), async_scheduling=False)
    engine = llm.engine
    prompt = list(range(200, 260))
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.generate([[9 + i] * 60 for i in range(4)], FILL, use_tqdm=False)  # evicts it to the host
    engine.add_request(None, GREEDY, request_id="x", prompt_ids=prompt)
    engine.step()  # a step with no tokens: the load starts
    request = engine.scheduler.loading["x"]
    assert request.status == RequestStatus.LOADING and request.block_ids
    engine.abort_request("x")
    assert "x" in engine.scheduler._held and engine.kv.num_free_blocks < engine.kv.num_blocks  # held for the load
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)
    # Loaded, not aborted: the same tokens as computed.
    llm.generate([[5 + i] * 60 for i in range(4)], FILL, use_tqdm=False)
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first and again.metrics.num_host_cached_prompt_tokens == 56
    assert engine.reset_prefix_cache() and not engine.kv_connector.index
    assert_no_leaks(llm)


def test_counters_reach_metrics_and_only_the_metrics_reader(tiny):
    """The host tier's counters cross to /metrics (aggregates, hidden where prefix-cache figures are)
    and over the engine-process wire."""
    from tokenmill.serve.async_engine import AsyncLLMEngine
    from tokenmill.serve.openai.metrics import KV_OFFLOAD_SERIES, PREFIX_CACHE_SERIES, ServerMetrics

    llm = tier(tiny, kv_offloading_size=HOST_GIB)
    prompt = list(range(300, 360))
    llm.generate([prompt], GREEDY, use_tqdm=False)
    llm.generate([[11 + i] * 60 for i in range(4)], FILL, use_tqdm=False)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].metrics.num_host_cached_prompt_tokens == 56
    snapshot = llm.engine.snapshot()
    hits = snapshot.kv_offload.hit_tokens
    assert hits >= 56  # (a filler preempted and resumed may have hit too)
    assert EngineSnapshot.from_wire(snapshot.to_wire()) == snapshot
    metrics = ServerMetrics("tiny")
    metrics.attach(AsyncLLMEngine(llm.engine))
    shown = metrics.render().decode()
    assert f'tokenmill:kv_offload_hit_tokens_total{{model_name="tiny"}} {float(hits)}' in shown
    assert "tokenmill:kv_offload_bytes_saved_total" in shown and "tokenmill:kv_offload_num_blocks" in shown
    assert KV_OFFLOAD_SERIES <= PREFIX_CACHE_SERIES
    assert "kv_offload" not in metrics.render(prefix_cache=False).decode()


def test_no_connector_costs_nothing(tiny):
    llm = make_llm(tiny, **ENGINE)
    engine = llm.engine
    assert engine.kv_connector is None and engine.runner.kv_connector is None
    assert engine.kv.pool.evicted is None  # evictions are not even recorded
    assert engine.snapshot().kv_offload is None


# ---- the host tier's two sides alone ---------------------------------------------------------------
def _request(req_id: str, num_blocks: int, salt=None) -> Request:
    r = Request(req_id, list(range(num_blocks * BS + 1)), SamplingParams(cache_salt=salt), 0, 1, frozenset())
    r.block_hashes = hash_blocks(None, r.prompt_token_ids[: num_blocks * BS], BS, salt=salt)
    return r


def test_host_index_is_lru_and_never_reuses_a_slot_being_read():
    s = HostTierScheduler(num_slots=2, block_size=BS, load_async=True)
    r = _request("r", 2)
    a, b = r.block_hashes
    s.on_blocks_evicted([(5, a), (6, b)])
    assert s.build_connector_meta().saves == BlockTransfer([5, 6], [0, 1])
    assert s.get_num_new_matched_tokens(r, BS) == (8, True)  # past a GPU hit of one block
    assert s.get_num_new_matched_tokens(r, 0) == (16, True)
    s.update_state_after_alloc(r, [10, 11], 16, 0)
    c = _request("c", 1, salt="s").block_hashes[0]
    s.on_blocks_evicted([(7, c)])  # both slots are read by r's load: c is not kept
    meta = s.build_connector_meta()
    assert meta.saves.block_ids == [] and meta.loads == [LoadRequest("r", BlockTransfer([10, 11], [0, 1]))]
    assert s.has_pending and not s.reset()
    assert s.update_connector_output(KVConnectorOutput(finished_loads=["r"])).loaded == ["r"]
    s.on_blocks_evicted([(7, c)])  # now a's slot (least recently used) takes c
    assert s.build_connector_meta().saves == BlockTransfer([7], [0])
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.get_num_new_matched_tokens(r, BS) == (8, True)
    # A load that fails forgets what it read; one whose request ended releases its blocks.
    s.update_state_after_alloc(r, [0, 12], 8, BS)
    assert s.request_finished(r, [0, 12])
    update = s.update_connector_output(KVConnectorOutput(failed_loads=["r"]))
    assert update.released == ["r"] and not update.failed
    assert s.get_num_new_matched_tokens(r, BS) == (0, False) and s.counts.failed_loads == 1
    assert not s.has_pending and s.reset() and not s.index


def test_an_in_step_load_pins_its_slots_until_the_step_is_built():
    """A synchronous load's slots cannot take a save of the same step (saves run first); the next
    step's saves come after it on the worker's stream, so it is nothing to wait for then."""
    s = HostTierScheduler(num_slots=2, block_size=BS)
    r = _request("r", 2)
    s.on_blocks_evicted([(5, r.block_hashes[0]), (6, r.block_hashes[1])])
    s.build_connector_meta()
    assert s.get_num_new_matched_tokens(r, 0) == (16, False)
    s.update_state_after_alloc(r, [10, 11], 16, 0)
    c = _request("c", 1, salt="s").block_hashes[0]
    s.on_blocks_evicted([(7, c)])  # both slots are read by r's load: c is not kept
    meta = s.build_connector_meta()
    assert meta.saves.block_ids == [] and meta.loads == [LoadRequest("r", BlockTransfer([10, 11], [0, 1]), sync=True)]
    assert not s.has_pending and not s.book.pins and not s.request_finished(r, [10, 11])
    s.on_blocks_evicted([(7, c)])
    assert s.build_connector_meta().saves == BlockTransfer([7], [0])


# planes 1: multi-head latent attention's cache (one latent row per token, k and v the same view)
@pytest.mark.parametrize("dtype,planes", [(torch.float32, 2), (torch.float8_e4m3fn, 2), (torch.float32, 1)],
                         ids=["fp32", "fp8", "latent"])
def test_host_worker_copies_blocks_out_and_back(dtype, planes):
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_size=BS, dtype=dtype, planes=planes)
    caches = allocate_kv_cache(spec, 6, torch.device("cpu"))
    for i, (k, v) in enumerate(caches):
        k.copy_(torch.randn(k.shape).to(dtype))
        v.copy_(torch.randn(v.shape).to(dtype))
    caches_bytes = [(k.view(torch.uint8), v.view(torch.uint8)) for k, v in caches]
    before = [(k.clone(), v.clone()) for k, v in caches_bytes]
    w = HostTierWorker(num_slots=4, device=torch.device("cpu"))
    w.register_kv_caches(caches)
    w.start_load_kv(KVConnectorMetadata(saves=BlockTransfer([1, 4, 2], [3, 0, 1])))
    for k, v in caches:
        k.zero_()
        v.zero_()
    w.start_load_kv(KVConnectorMetadata(loads=[LoadRequest("x", BlockTransfer([5, 0], [0, 3]))]))
    out = w.get_finished()  # reported on the next call, as on CUDA
    assert out.finished_loads == ["x"] and out.counts.blocks_saved == 3 and out.counts.blocks_loaded == 2
    assert out.counts.bytes_loaded == 2 * spec.bytes_per_block
    for (k, v), (k0, v0) in zip(caches_bytes, before):
        assert torch.equal(k[5], k0[4]) and torch.equal(v[5], v0[4])
        assert torch.equal(k[0], k0[1]) and torch.equal(v[0], v0[1])
        assert not k[1].any()
    assert w.get_finished().empty
    # An in-step load is counted, never reported (its request runs); fault injection skips it.
    w.fail_loads = 1
    w.start_load_kv(KVConnectorMetadata(loads=[LoadRequest("y", BlockTransfer([3], [1])),
                                               LoadRequest("z", BlockTransfer([2], [0]), sync=True)]))
    out = w.get_finished()
    assert out.failed_loads == ["y"] and out.finished_loads == [] and out.counts.blocks_loaded == 1
    for (k, v), (k0, v0) in zip(caches_bytes, before):
        assert torch.equal(k[2], k0[4]) and torch.equal(v[2], v0[4])


def test_counts_add_up():
    counts = HostTierCounts(num_slots=4)
    from tokenmill.kv_connector.counts import KVTransferCounts

    counts.add(KVTransferCounts(bytes_saved=10, blocks_saved=1, load_seconds=0.5))
    assert (counts.bytes_saved, counts.blocks_saved, counts.load_seconds, counts.num_slots) == (10, 1, 0.5, 4)


def test_scheduler_loads_then_admits_or_gives_the_loaded_blocks_back():
    """Scheduler, KV-cache manager and host index together (no model; the worker's report is built
    by hand): a request found on the host waits LOADING outside the step, comes back with its prefix
    computed, and, with no block left for the rest, gives the loaded blocks back (still cached)."""
    from tokenmill.engine.kv_cache_manager import KVCacheManager
    from tokenmill.engine.scheduler import Scheduler, SchedulerLimits

    kv = KVCacheManager(num_blocks=6, block_size=BS)
    host = HostTierScheduler(num_slots=8, block_size=BS, load_async=True)
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv,
                      connector=host)
    r = Request("r", list(range(3, 3 + 3 * BS + 1)), SamplingParams(), 0, 4, frozenset())
    s = Request("s", list(range(500, 500 + 3 * BS - 1)), SamplingParams(), 0, 4, frozenset())
    keys = hash_blocks(None, r.prompt_token_ids[: 3 * BS], BS)
    host.on_blocks_evicted([(i, k) for i, k in enumerate(keys)])  # r's prefix is on the host only
    host.build_connector_meta()
    sched.add_request(r)
    sched.add_request(s)
    out = sched.schedule()
    assert [e.req_id for e in out.batch] == ["s"]  # r waits outside the step
    assert r.status == RequestStatus.LOADING and len(r.block_ids) == 3 and sched.num_waiting == 1
    assert out.kv_connector_metadata.loads == [LoadRequest("r", BlockTransfer(r.block_ids, [0, 1, 2]))]
    assert kv.num_free_blocks == 0 and kv.pool.lookup(keys[0]) is None  # not shared before it is loaded
    sched.update_from_kv_connector(KVConnectorOutput(finished_loads=["r"]))
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 3 * BS and sched.waiting[0] is r
    assert kv.pool.lookup(keys[0]) == r.block_ids[0]
    out = sched.schedule()  # s decodes; r needs one more block and none is free
    assert [e.req_id for e in out.batch] == ["s"]
    assert r.block_ids == [] and r.num_computed_tokens == 0 and kv.pool.lookup(keys[2]) is not None
    sched.finish_request(s, RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()  # a GPU hit now: only the last token is computed
    assert [(e.req_id, e.start_pos, e.num_tokens) for e in out.batch] == [("r", 3 * BS, 1)]
    assert r.num_cached_tokens == 3 * BS and r.num_host_cached_tokens == 3 * BS


@pytest.mark.parametrize("options,message", [
    (dict(tensor_parallel_size=2), "with tensor or pipeline parallelism is not supported yet"),
    (dict(speculative_config={"method": "draft_model", "model": "tiny-llama", "load_format": "dummy"}),
     "with a draft model is not supported yet"),
    (dict(kv_transfer_config={"kv_connector": "NoSuchConnector"}), "unknown kv_connector 'NoSuchConnector'"),
    (dict(kv_transfer_config={"kv_connector": "OffloadingConnector"}), 'needs kv_connector_extra_config'),
    (dict(kv_transfer_config=offloading(load_async="yes")), "load_async must be true or false, not 'yes'"),
    (dict(kv_transfer_config=offloading(fail_loads=1)), "fail_loads .* needs load_async"),
])
def test_what_a_connector_cannot_run_with_is_refused(options, message):
    from tokenmill.config import ConfigError, EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    options = {"kv_offloading_size": HOST_GIB, **options} if "kv_transfer_config" not in options else options
    with pytest.raises(ConfigError, match=message):
        LLMEngine("tiny-llama", EngineConfig(num_kv_blocks=16, **options), load_format="dummy", dtype="float32",
                  device="cpu")


def test_scheduler_runs_an_in_step_load_at_once():
    """The default host tier: a request found on the host runs in the step that loads its prefix,
    from the end of that prefix, its blocks shareable at once (any reader runs after the load)."""
    from tokenmill.engine.kv_cache_manager import KVCacheManager
    from tokenmill.engine.scheduler import Scheduler, SchedulerLimits

    kv = KVCacheManager(num_blocks=6, block_size=BS)
    host = HostTierScheduler(num_slots=8, block_size=BS)
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv,
                      connector=host)
    r = Request("r", list(range(3, 3 + 3 * BS + 1)), SamplingParams(), 0, 4, frozenset())
    keys = hash_blocks(None, r.prompt_token_ids[: 3 * BS], BS)
    host.on_blocks_evicted([(i, k) for i, k in enumerate(keys)])  # r's prefix is on the host only
    host.build_connector_meta()
    sched.add_request(r)
    out = sched.schedule()
    assert [(e.req_id, e.start_pos, e.num_tokens) for e in out.batch] == [("r", 3 * BS, 1)]
    assert out.kv_connector_metadata.loads == [LoadRequest("r", BlockTransfer(r.block_ids[:3], [0, 1, 2]), sync=True)]
    assert r.status == RequestStatus.RUNNING and not sched.loading and not host.has_pending
    assert r.num_cached_tokens == 3 * BS and r.num_host_cached_tokens == 3 * BS
    assert kv.pool.lookup(keys[2]) == r.block_ids[2]
