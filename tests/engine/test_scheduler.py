"""The scheduler's per-step prompt cap (max_prefill_tokens_per_step) and the order of prefills: a
request that arrives during a long prompt's prefill is scheduled at the very next step."""

from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import Scheduler, SchedulerLimits
from tokenmill.sampling_params import SamplingParams

CAP = 32


def make_request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), seed=0, max_tokens=max_tokens,
                   stop_ids=frozenset())


def test_a_short_arrival_runs_at_the_next_step_beside_a_long_prefill():
    kv = KVCacheManager(num_blocks=256, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
                                      max_prefill_tokens_per_step=CAP), kv)
    sched.add_request(make_request("long", list(range(200)), max_tokens=2))
    # Nothing decodes, yet the long prompt goes in chunks of the cap, not the 512-token budget.
    assert [(e.req_id, e.num_tokens) for e in sched.schedule().batch] == [("long", CAP)]
    assert [(e.req_id, e.num_tokens) for e in sched.schedule().batch] == [("long", CAP)]
    sched.add_request(make_request("short", list(range(300, 306)), max_tokens=50))
    sched.add_request(make_request("later", list(range(400, 500))))  # longer than long's rest: keeps its turn
    out = sched.schedule()  # the step right after the arrival: short's whole prompt, long a block's worth
    assert [(e.req_id, e.num_tokens, e.samples) for e in out.batch] == [("short", 6, True), ("long", 4, False)]
    while sched.requests["long"].num_computed_tokens < 200:
        sched.take_sampled_token("short").output_token_ids.append(1)
        entries = {e.req_id: e.num_tokens for e in sched.schedule().batch}
        assert entries.get("short") == 1  # decodes every step meanwhile
        assert entries["long"] + entries.get("later", 0) <= CAP  # never past the cap
        assert "later" not in entries or sched.requests["long"].num_computed_tokens == 200  # arrival order


def test_later_chunks_of_a_long_prompt_count_their_attention():
    """With a context scale, a chunk's tokens at context c count 1 + c / scale each against the cap."""
    kv = KVCacheManager(num_blocks=256, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
                                      max_prefill_tokens_per_step=CAP, prefill_context_scale=32.0), kv)
    sched.add_request(make_request("long", list(range(200))))
    chunks = []
    while sched.requests["long"].num_computed_tokens < 200:
        start = sched.requests["long"].num_computed_tokens
        (entry,) = sched.schedule().batch
        chunks.append(entry.num_tokens)
        assert entry.num_tokens == 1 or entry.num_tokens * (1 + start / 32) <= CAP
    assert chunks[:4] == [32, 16, 12, 11] and min(chunks) >= 1


def test_short_arrivals_never_stall_a_prefill_in_progress():
    """Short prompts arriving every step go first, yet the prompt in progress keeps a KV block's
    worth of every step."""
    kv = KVCacheManager(num_blocks=256, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerLimits(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024,
                                      max_prefill_tokens_per_step=16), kv)
    sched.add_request(make_request("long", list(range(100))))
    sched.schedule()
    for step in range(5):
        before = sched.requests["long"].num_computed_tokens
        for i in range(3):
            sched.add_request(make_request(f"s{step}.{i}", list(range(1000 + 10 * i, 1005 + 10 * i)), max_tokens=1))
        sched.schedule()
        assert sched.requests["long"].num_computed_tokens - before >= kv.block_size
