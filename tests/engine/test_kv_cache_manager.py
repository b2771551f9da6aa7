"""Block pool, prefix cache and scheduler accounting, without a model."""

from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerLimits
from tokenmill.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), seed=0, max_tokens=max_tokens,
                   stop_ids=frozenset())


def test_allocate_and_free_return_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request("a", list(range(10))), make_request("b", list(range(100, 105)))
    assert kv.allocate(a, 10) and len(a.block_ids) == 3
    assert kv.allocate(b, 5) and len(b.block_ids) == 2
    assert kv.num_free_blocks == 3
    assert not kv.allocate(make_request("c", list(range(20))), 20)  # needs 5
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_prefix_cache_hits_full_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(12)))
    assert kv.allocate(first, 12)
    first_blocks = list(first.block_ids)
    kv.free(first)  # freed, but its 3 full blocks stay cached
    same = make_request("b", list(range(12)))
    hits, n = kv.find_cached_prefix(same)
    assert n == 8 and len(hits) == 2  # the last block is recomputed: one token must remain
    longer = make_request("c", list(range(12)) + [99, 98])
    hits, n = kv.find_cached_prefix(longer)
    assert n == 12 and hits == first_blocks
    other = make_request("d", [7] + list(range(1, 12)))
    assert kv.find_cached_prefix(other) == ([], 0)  # a different first block breaks the chain


def test_shared_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", list(range(9)))
    assert kv.allocate(a, 9)
    b = make_request("b", list(range(9)))
    hits, n = kv.find_cached_prefix(b)
    assert n == 8
    assert kv.allocate(b, 1, hits)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert kv.pool.blocks[a.block_ids[0]].ref_cnt == 2
    kv.free(a)
    assert kv.pool.blocks[b.block_ids[0]].ref_cnt == 1
    kv.free(b)
    assert kv.num_free_blocks == 6


def test_lru_eviction_takes_the_oldest_cached_block():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    old, new = make_request("old", [1, 2, 3]), make_request("new", [5, 6, 7])
    kv.allocate(old, 3)
    kv.free(old)
    kv.allocate(new, 3)
    kv.free(new)
    # Two fresh blocks: the free list hands out the least recently freed first.
    taker = make_request("t", [9, 9, 9, 9])
    kv.allocate(taker, 4)
    assert kv.find_cached_prefix(make_request("x", [1, 2, 3]))[1] == 0  # old prefix evicted
    assert kv.find_cached_prefix(make_request("y", [5, 6, 7]))[1] == 2  # newer one survives


def test_scheduler_chunks_prefill_and_preempts_newest():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64), kv)
    a, b = make_request("a", list(range(10)), max_tokens=6), make_request("b", list(range(50, 56)), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [(e.req_id, e.num_tokens, e.samples) for e in out.batch] == [("a", 8, False)]  # chunk of 8
    out = sched.schedule()
    assert [(e.req_id, e.num_tokens) for e in out.batch] == [("a", 2), ("b", 6)]
    assert all(e.samples for e in out.batch)
    # Feed sampled tokens until the 6 blocks run out and the newest request gets preempted.
    preempted = False
    for _ in range(20):
        for rid in ("a", "b"):
            r = sched.take_sampled_token(rid) if rid in sched.requests and sched.requests[rid].num_pending else None
            if r is not None:
                r.output_token_ids.append(1)
                if len(r.output_token_ids) >= r.max_tokens:
                    sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        preempted |= "b" in out.freed_req_ids and "b" in sched.requests
    assert preempted and sched.num_preemptions >= 1
    assert not sched.has_unfinished and kv.num_free_blocks == 6


def test_prefill_cap_applies_only_when_decodes_run():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                             max_prefill_tokens_with_decodes=5)
    sched = Scheduler(limits, kv)
    a = make_request("a", list(range(20)), max_tokens=8)
    sched.add_request(a)
    out = sched.schedule()  # nothing decodes yet: the whole prompt in one step
    assert [(e.req_id, e.num_tokens) for e in out.batch] == [("a", 20)]
    assert out.kind == "prefill"
    sched.take_sampled_token("a").output_token_ids.append(1)
    b = make_request("b", list(range(100, 112)), max_tokens=4)
    c = make_request("c", list(range(200, 203)), max_tokens=4)
    sched.add_request(b)
    sched.add_request(c)
    out = sched.schedule()  # a decodes: b gets a 5-token chunk, c waits
    assert [(e.req_id, e.num_tokens) for e in out.batch] == [("a", 1), ("b", 5)]
    assert out.num_decodes == 1 and out.kind == "mixed"
    out = sched.schedule()  # async: a's next decode is scheduled ahead; b's next chunk
    assert [(e.req_id, e.num_tokens) for e in out.batch] == [("a", 1), ("b", 5)]
    out = sched.schedule()  # b's last 2 tokens, then 3 of c's
    assert [(e.req_id, e.num_tokens) for e in out.batch] == [("a", 1), ("b", 2), ("c", 3)]
    for rid in ("a", "b", "c"):  # their tokens come back: now every entry decodes
        sched.take_sampled_token(rid).output_token_ids.append(1)
    while sched.requests["a"].num_pending:
        sched.take_sampled_token("a").output_token_ids.append(1)
    out = sched.schedule()
    assert out.kind == "decode" and out.num_decodes == len(out.batch) == 3
    for rid in ("a", "b", "c"):
        sched.finish_request(sched.requests[rid], RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 64


def test_pipeline_depth_keeps_steps_in_flight_disjoint():
    """With two pipeline stages, a step takes at most half the requests and never one whose token
    is still in flight; a prompt's chunks (nothing in flight) may follow one another."""
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                                      pipeline_depth=2), kv)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", list(range(10 * i, 10 * i + 6)), max_tokens=4))
    first = sched.schedule()
    second = sched.schedule()
    ids = [{e.req_id for e in out.batch} for out in (first, second)]
    assert [len(x) for x in ids] == [3, 2] and not ids[0] & ids[1]  # ceil(5 / 2), then the rest
    assert not sched.schedule().batch  # every request's token is in flight
    for e in first.batch:  # the first step's tokens come back: its requests decode again
        sched.take_sampled_token(e.req_id).output_token_ids.append(7)
    third = sched.schedule()
    assert {e.req_id for e in third.batch} == ids[0] and all(e.num_tokens == 1 for e in third.batch)

    long = Scheduler(SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=128,
                                     pipeline_depth=2), KVCacheManager(num_blocks=64, block_size=4))
    long.add_request(make_request("p", list(range(20)), max_tokens=2))
    chunks = [long.schedule().batch for _ in range(3)]
    assert [[(e.req_id, e.num_tokens, e.samples) for e in b] for b in chunks] == [
        [("p", 8, False)], [("p", 8, False)], [("p", 4, True)]]
    assert not long.schedule().batch
