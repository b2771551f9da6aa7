"""Token-budget continuous batching with chunked prefill, prefix caching and preemption.

Each step: running decodes first, then unfinished prefills, then waiting requests in arrival
order, until the token budget (max_num_batched_tokens) or max_num_seqs is used up; a waiting
request whose whole prompt is shorter than every unfinished prefill's rest, and fits the step, goes
before those prefills (a short arrival is not held behind a long prompt's chunks). A prompt that
does not fit the remaining budget is prefilled in chunks over several steps, mixed with the
decodes. `max_prefill_tokens_per_step` caps the prompt tokens of every step, with or without
decodes, so a request that arrives during a long prefill is scheduled at the next step (on by
default on the CPU). With `max_prefill_tokens_with_decodes` set, a step that runs decodes takes at most that many
prompt tokens, so one long prompt cannot stall every running request's next token for long (off by
default: on serve-8b a cap of 512 raised the inter-token latency's p90 and p99, docs/PERFORMANCE.md).
With a step budget (engine/step_budget.py, EngineConfig.step_time_target_ms), a step that runs
decodes takes at most the prompt tokens its step-time model predicts fit under the target beside
them (the lower of the two caps when both are set). When KV blocks run out, the most recently
admitted request is preempted: its blocks are freed and it goes back to the front of the queue, to
be recomputed from prompt + generated tokens. With LoRA, at most max_loras distinct adapters run at
once (the runner's device slots); a waiting request whose adapter has no slot is passed over (it
keeps its place) for those behind it.

The scheduler may run one step ahead of the results (async scheduling): a request whose step is
in flight counts its coming token as `num_pending`, so its next decode can be scheduled before the
token is known on the CPU; the runner feeds that token from the device.

With a draft that writes K/V (a draft model, the layer-truncated draft), a speculating request also
holds `num_lookahead_tokens` slots beyond each step's tokens (`_lookahead`): the k draft steps that
follow a step write positions up to k - 1 past it. The runner never writes past the slots held.

With a KV connector (kv_connector/, e.g. the host tier), a waiting request whose prefix continues
past its GPU hit where the connector has it takes blocks for that prefix. A synchronous load (the
host tier's default) is copied in before this step's forward pass, so the request runs from the end
of that prefix at once. An asynchronous one waits in the LOADING state (not in the queue, not in the
step) while the worker side copies it in; a later step's report puts it back at the front of the
queue with that prefix computed. A failed load puts it back to recompute; a request that ends while
a load writes its blocks keeps them until the load is reported.
A connector that produces KV for another engine (wants_prefills: prefill/decode disaggregation) hears
of every request whose prompt a step computes to its end.
"""

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional

from tokenmill.engine.kv_cache_manager import KVCacheManager, fits_problem
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.step_budget import StepBudget
from tokenmill.errors import InvalidRequestError
from tokenmill.kv_connector.base import KVConnectorOutput, KVConnectorScheduler
from tokenmill.step_io import NewRequestData, ScheduledRequest, SchedulerOutput


@dataclass
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_prefill_tokens_with_decodes: Optional[int] = None
    num_speculative_tokens: int = 0  # drafts a speculating request's decode verifies (0: no speculation)
    # KV slots a speculating request holds beyond its scheduled tokens, for a draft that writes K/V
    # ahead (a draft model or the layer-truncated draft: k; n-gram lookup: 0)
    num_lookahead_tokens: int = 0
    max_loras: int = 0  # distinct LoRA adapters among the running requests (the runner's slots); 0: no LoRA
    # Steps in flight at once with pipeline stages (pipeline_parallel_size): a request whose token
    # is on its way is not scheduled again until it is back, and a step takes at most a 1/depth
    # share of the requests, so that the steps in flight hold different requests (executor/pipeline.py).
    pipeline_depth: int = 1
    # Prompt tokens a step may take in all, with or without decodes (None: the token budget); with
    # prefill_context_scale, a prompt token at context c counts 1 + c / prefill_context_scale (its
    # attention over c earlier tokens: prefill_context_tokens()).
    max_prefill_tokens_per_step: Optional[int] = None
    prefill_context_scale: Optional[float] = None


def prefill_context_scale(hidden_size: int, intermediate_size: float, q_size: int, kv_size: int,
                          attention_slowdown: float = 1.0) -> float:
    """The context length at which a prompt token's attention over earlier tokens (4 x context x
    q_size FLOPs a layer) costs as much as its linear layers (2 x their weights), with attention
    running `attention_slowdown` times slower per FLOP than the matmuls."""
    linear = hidden_size * (2 * q_size + 2 * kv_size) + 3 * hidden_size * intermediate_size
    return linear / (2.0 * q_size * attention_slowdown)


def _prefilling(request: Request) -> bool:
    """Its prompt (or, after a preemption, what it recomputes) is not done yet."""
    return request.num_computed_tokens < request.num_prefill_tokens


@dataclass
class _Step:
    """What one schedule() call has taken so far, and the room left for prompt tokens."""

    budget: int  # tokens left (max_num_batched_tokens)
    # Prompt-token cost left under max_prefill_tokens_per_step (None: no such cap); a prompt token
    # at context c costs 1 + c / context_scale with a context_scale, else 1.
    cost_left: Optional[float]
    context_scale: Optional[float]
    share: Optional[int]  # entries the step may take (pipeline stages), None: no limit
    prefill_budget: int = 0  # prompt tokens left, lowered once decodes are in (_cap_prefill)
    num_decodes: int = 0
    decode_tokens: int = 0
    batch: list = field(default_factory=list)
    new_requests: list = field(default_factory=list)
    scheduled: set = field(default_factory=set)
    preempted: set = field(default_factory=set)  # preempted in this step: not re-admitted in it

    def __post_init__(self) -> None:
        self.prefill_budget = self.budget

    def token_cost(self, start: int) -> float:
        return 1.0 if self.context_scale is None else 1.0 + start / self.context_scale

    def prompt_room(self, start: int) -> int:
        """Prompt tokens a chunk that starts at position `start` may take (at least one while any
        cost is left, so a prompt deep into its context still progresses)."""
        room = min(self.budget, self.prefill_budget)
        if self.cost_left is not None:
            room = min(room, max(int(self.cost_left / self.token_cost(start)), 1 if self.cost_left > 0 else 0))
        return room

    def take_prompt(self, num_tokens: int, start: int) -> None:
        self.budget -= num_tokens
        self.prefill_budget -= num_tokens
        if self.cost_left is not None:
            self.cost_left = max(0.0, self.cost_left - num_tokens * self.token_cost(start))


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager, step_budget: Optional[StepBudget] = None,
                 connector: Optional[KVConnectorScheduler] = None):
        self.limits = limits
        self.kv = kv
        self.connector = connector  # a KV connector's scheduler side (kv_connector/), if configured
        self.loading: dict[str, Request] = {}  # requests whose prefix a connector is loading
        self._held: dict[str, Request] = {}  # ended requests whose blocks a transfer still uses
        if connector is not None:
            kv.pool.evicted = []  # the connector sees the cached blocks the pool hands out again
        self.step_budget = step_budget  # caps the prompt tokens of a step with decodes (step-time target)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._running_loras: Counter = Counter()  # LoRARequest -> running requests with that adapter
        self.requests: dict[str, Request] = {}
        self._freed_ids: list[str] = []  # rows the runner must release at the next step
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # prompt (and recomputed) tokens scheduled so far

    # ---- admission ------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse, with a reason, a request that could never run."""
        problem = fits_problem(num_prompt_tokens, max_tokens, self.limits.max_model_len, self.kv.num_blocks,
                               self.kv.block_size)
        if problem:
            raise InvalidRequestError(problem)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Stop a request (done, or aborted), release its blocks and its runner row."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self._remove_running(request)
            self._freed_ids.append(request.request_id)
        elif request.status == RequestStatus.LOADING:
            del self.loading[request.request_id]
        else:
            self.waiting.remove(request)
        request.status = status
        del self.requests[request.request_id]
        if self.connector is not None and self.connector.request_finished(request, request.block_ids):
            self._held[request.request_id] = request  # freed when the connector reports the transfer done
            return
        self.kv.free(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._held)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.loading)

    # ---- KV connector ---------------------------------------------------------------------
    def update_from_kv_connector(self, output: KVConnectorOutput) -> None:
        """The worker side's report: admit loaded requests first, requeue failed ones to recompute,
        free the blocks of ended requests no transfer uses any more."""
        update = self.connector.update_connector_output(output)
        for req_id in reversed(update.loaded):  # (appendleft: keep their order)
            request = self.loading.pop(req_id)
            self._loaded(request)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        for req_id in reversed(update.failed):
            request = self.loading.pop(req_id)
            self.kv.free(request)
            request.num_computed_tokens = request.num_external_tokens = 0
            request.skip_kv_connector = True
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        for req_id in update.released:
            self.kv.free(self._held.pop(req_id))

    def _start_load(self, request: Request, cached_blocks: list[int], num_cached: int) -> Optional[bool]:
        """Ask the connector for more of the request's prefix than the GPU cache has: None if it has
        none; False if its blocks don't fit; True if it loads asynchronously (the request LOADING);
        else the request stays first in line with the loaded prefix computed (this step loads it)."""
        self._flush_evictions()  # a block evicted earlier in this step is on the host for this lookup
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_cached)
        if not num_external:
            return None
        if not self.kv.allocate_for_load(request, cached_blocks, num_cached + num_external):
            self.connector.request_finished(request, [])  # forget the match
            return False
        self.connector.update_state_after_alloc(request, request.block_ids, num_external, num_cached)
        if request.num_preemptions == 0:
            self.kv.record_prefix_lookup(request, num_cached)
        request.num_computed_tokens = num_cached
        request.num_external_tokens = num_external
        if not load_async:  # the worker fills the blocks before this step's forward pass
            self._loaded(request)
            return None
        self.waiting.popleft()
        request.status = RequestStatus.LOADING
        self.loading[request.request_id] = request
        return True

    def _loaded(self, request: Request) -> None:
        """The connector's part of the request's prefix is in its blocks (or will be, before any step
        reads them): computed, and shareable."""
        request.num_computed_tokens += request.num_external_tokens
        if request.num_preemptions == 0:
            request.num_host_cached_tokens = request.num_external_tokens
        request.num_external_tokens = 0
        self.kv.cache_loaded(request, request.num_computed_tokens)

    def _note_prefills(self, batch: list[ScheduledRequest]) -> None:
        """Tell the connector of each request whose prompt this step computes to its end (a producer
        saves those blocks after the forward pass)."""
        for e in batch:
            request = self.requests[e.req_id]
            if e.start_pos < request.num_prefill_tokens <= e.start_pos + e.num_tokens:
                self.connector.on_prefill_scheduled(request, request.block_ids, request.num_prefill_tokens)

    def _flush_evictions(self) -> None:
        """Hand the connector the cached blocks allocation took since the last call (their saves go
        into this step's metadata, ahead of its loads and its forward pass)."""
        evicted = self.kv.pool.take_evicted()
        if evicted:
            self.connector.on_blocks_evicted(evicted)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        limits = self.limits
        step = _Step(limits.max_num_batched_tokens, limits.max_prefill_tokens_per_step, limits.prefill_context_scale,
                     -(-len(self.requests) // limits.pipeline_depth) if limits.pipeline_depth > 1 else None)
        # Decodes first, then prefills in progress (stable, so oldest first within each).
        running = sorted(self.running, key=_prefilling)
        split = next((i for i, r in enumerate(running) if _prefilling(r)), len(running))
        for request in running[:split]:
            self._schedule_running(step, request, prefilling=False)
        if step.num_decodes:
            step.prefill_budget = self._cap_prefill(step.prefill_budget, step.num_decodes, step.decode_tokens)
        in_progress = running[split:]
        if in_progress and self.waiting:
            # A short arrival goes before prompts in progress (each longer than it), so it is not
            # held behind a long prompt's chunks. Under a per-step cap its step stays short too:
            # the prompts in progress take a block's worth in it.
            shortest = min(r.num_prefill_tokens - r.num_computed_tokens for r in in_progress)
            reserve = self.kv.block_size
            if self._admit_waiting(step, shorter_than=shortest, reserve=reserve) and step.cost_left is not None:
                step.cost_left = min(step.cost_left, reserve)
        for request in in_progress:
            self._schedule_running(step, request, prefilling=True)
        self._admit_waiting(step)
        batch = step.batch
        if self._running_loras:
            # Entries of one adapter side by side: the LoRA kernels then run each adapter's tokens as
            # one tile (runner/lora_state.py); the order of a step's entries means nothing else.
            batch.sort(key=lambda e: self._lora_order(self.requests[e.req_id].lora_request))

        meta = None
        if self.connector is not None:
            if self.connector.wants_prefills:
                self._note_prefills(batch)
            self._flush_evictions()
            meta = self.connector.build_connector_meta()
            meta = None if meta.empty else meta
        return SchedulerOutput(batch=batch, new_requests=step.new_requests, freed_req_ids=self.take_freed_ids(),
                               num_decodes=step.num_decodes, kv_connector_metadata=meta)

    def _schedule_running(self, step: "_Step", request: Request, prefilling: bool) -> None:
        """Schedule a running request's next tokens (a decode, or its prompt's next chunk), preempting
        the most recently admitted requests not yet in the step while KV blocks run out."""
        if step.budget == 0 or request.request_id in step.preempted:
            return
        if step.share is not None and (request.num_pending or len(step.batch) >= step.share):
            return  # its token is in flight / this step has its share (pipeline stages)
        start = request.num_computed_tokens
        num_new, speculative = self._running_tokens(request, prefilling, step.budget, step.prompt_room(start))
        if num_new == 0:
            return
        blocks_before = len(request.block_ids)
        ahead = self._lookahead(request, request.num_computed_tokens + num_new)
        while not self.kv.allocate(request, num_new, num_lookahead_tokens=ahead):
            victim = self._pick_victim(step.scheduled | {request.request_id}) or request
            self._preempt(victim)
            step.preempted.add(victim.request_id)
            if victim is request:
                return
        step.batch.append(self._entry(request, num_new, request.block_ids[blocks_before:], speculative))
        step.scheduled.add(request.request_id)
        if prefilling:
            step.take_prompt(num_new, start)
        else:
            step.budget -= num_new
            step.num_decodes += 1
            step.decode_tokens += num_new

    def _admit_waiting(self, step: "_Step", shorter_than: Optional[int] = None, reserve: int = 0) -> int:
        """Admit waiting requests in order while the step has room; returns how many. With
        shorter_than: only while the first one's whole prompt is shorter than that and fits the step
        with `reserve` prompt tokens to spare (it then completes its prompt in this step)."""
        admitted = 0
        skipped: list[Request] = []  # waiting requests whose adapter has no slot now (kept in order)
        while (self.waiting and step.prompt_room(0) > 0 and len(self.running) < self.limits.max_num_seqs
               and (step.share is None or len(step.batch) < step.share)):
            request = self.waiting[0]
            if request.num_pending or request.request_id in step.preempted:
                break  # wait for its in-flight token / don't re-admit what was just preempted
            if shorter_than is not None and not (request.num_tokens < shorter_than
                                                 and request.num_tokens + reserve <= step.prompt_room(0)):
                break
            if not self._lora_slot_free(request):
                skipped.append(self.waiting.popleft())
                continue
            loaded = request.num_computed_tokens  # a connector loaded its prefix (its blocks held)
            if loaded:
                cached_blocks, num_cached = [], loaded
            else:
                # Prompt logprobs need the logits of every prompt position: no cached prefix (the
                # request's blocks still enter the cache).
                cached_blocks, num_cached = (self.kv.find_cached_prefix(request)
                                             if request.params.prompt_logprobs is None else ([], 0))
                if self.connector is not None and request.params.prompt_logprobs is None \
                        and not request.skip_kv_connector:
                    started = self._start_load(request, cached_blocks, num_cached)
                    if started:
                        continue
                    if started is False:
                        break
                    loaded = request.num_computed_tokens  # (a synchronous load: this step's)
                    if loaded:
                        cached_blocks, num_cached = [], loaded
            num_new = min(request.num_tokens - num_cached, step.prompt_room(num_cached))
            if num_new <= 0 or not self.kv.allocate(request, num_new, cached_blocks,
                                                    self._lookahead(request, num_cached + num_new)):
                if loaded:  # give its blocks back (cached, a GPU hit next time) rather than hold them waiting
                    self.kv.free(request)
                    request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if request.num_preemptions == 0:
                if not loaded and not request.skip_kv_connector:  # (a failed load's lookup is counted)
                    self.kv.record_prefix_lookup(request, num_cached)
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            request.num_prefill_tokens = request.num_tokens
            self._add_running(request)
            step.new_requests.append(self._new_request_data(request))
            step.batch.append(self._entry(request, num_new, []))
            step.scheduled.add(request.request_id)  # never a victim of a later entry's allocation
            step.take_prompt(num_new, num_cached)
            admitted += 1
        self.waiting.extendleft(reversed(skipped))
        return admitted

    def _lora_slot_free(self, request: Request) -> bool:
        """Whether the request's adapter (if any) can run now: it already runs, or fewer than
        max_loras distinct adapters do."""
        lora = request.lora_request
        if lora is None or lora in self._running_loras:
            return True
        return len(self._running_loras) < self.limits.max_loras

    @staticmethod
    def _lora_order(lora) -> int:
        return 0 if lora is None else lora.lora_int_id

    def _add_running(self, request: Request) -> None:
        self.running.append(request)
        if request.lora_request is not None:
            self._running_loras[request.lora_request] += 1

    def _remove_running(self, request: Request) -> None:
        self.running.remove(request)
        lora = request.lora_request
        if lora is not None:
            self._running_loras[lora] -= 1
            if not self._running_loras[lora]:
                del self._running_loras[lora]

    def _cap_prefill(self, prefill_budget: int, num_decodes: int, decode_tokens: int) -> int:
        """The prompt tokens a step with decodes may take: within max_prefill_tokens_with_decodes
        and what the step budget fits beside the decodes (counted with one more request: the prefill)."""
        cap = self.limits.max_prefill_tokens_with_decodes
        if self.step_budget is not None:
            fit = self.step_budget.prefill_cap(decode_tokens, num_decodes + 1)
            cap = fit if cap is None else min(cap, fit)
        return prefill_budget if cap is None else min(prefill_budget, cap)

    def take_freed_ids(self) -> list[str]:
        """Requests whose runner rows can be released (finished or preempted since the last call)."""
        freed, self._freed_ids = self._freed_ids, []
        return freed

    def _tokens_to_schedule(self, request: Request, budget: int) -> int:
        if len(request.output_token_ids) + request.num_pending >= request.max_tokens:
            return 0  # its last token is already on the way
        return min(request.num_tokens_scheduled_ahead - request.num_computed_tokens, budget)

    def _running_tokens(self, request: Request, prefilling: bool, budget: int, prompt_room: int
                        ) -> tuple[int, bool]:
        """Tokens to schedule for a running request, and whether they verify drafts."""
        # A speculating request whose lookups found nothing, with no verify step in flight, knows its
        # position on the host and decodes exactly as without speculation (no device-side fix-up,
        # one logits row); its step still drafts, so the next may verify.
        if request.speculates and not prefilling and (request.expects_drafts or request.num_uncertain):
            return self._speculative_tokens(request, budget), True
        return self._tokens_to_schedule(request, prompt_room if prefilling else budget), False

    def _speculative_tokens(self, request: Request, budget: int) -> int:
        """A speculating decode: its last token and up to k drafts, within the budget, the context
        length and what max_tokens leaves (counting what in-flight steps may still emit); just its
        last token when its latest proposal (one step stale) found no drafts. The step verifies
        what the device proposed, cut to the slots scheduled here."""
        left = request.max_tokens - len(request.output_token_ids) - request.num_pending
        room = self.limits.max_model_len - request.num_computed_tokens
        wanted = 1 + self.limits.num_speculative_tokens if request.expects_drafts else 1
        return max(0, min(wanted, budget, left, room))

    def _lookahead(self, request: Request, end: int) -> int:
        """Slots to hold beyond the first `end` for a speculating request whose draft writes K/V
        ahead: its k draft steps after a step that ends at `end` write positions up to end + k - 1.
        Never past the context length or the request's own longest length (prompt + max_tokens,
        what check_fits admitted), where drafts would be of no use."""
        ahead = self.limits.num_lookahead_tokens
        if not ahead or not request.speculates:
            return 0
        longest = min(self.limits.max_model_len, request.num_prompt_tokens + request.max_tokens)
        return max(0, min(end + ahead, longest) - end)

    def _entry(self, request: Request, num_new: int, new_block_ids: list[int],
               speculative: bool = False) -> ScheduledRequest:
        start = request.num_computed_tokens
        self.num_prefill_tokens += max(0, min(start + num_new, request.num_prefill_tokens) - start)
        request.num_computed_tokens += num_new
        if speculative:  # counts are upper bounds until the step's emitted tokens come back
            request.num_pending += num_new
            request.num_uncertain += num_new > 1
            return ScheduledRequest(request.request_id, num_new, start, new_block_ids, True, True)
        samples = request.num_computed_tokens == request.num_tokens_scheduled_ahead
        if samples:
            request.num_pending += 1
        return ScheduledRequest(request.request_id, num_new, start, new_block_ids, samples)

    def _new_request_data(self, request: Request) -> NewRequestData:
        p = request.params
        stop_ids = sorted(request.stop_ids) if p.min_tokens > 0 else []
        return NewRequestData(request.request_id, request.all_token_ids, request.num_prompt_tokens, p,
                              request.seed, list(request.block_ids), stop_ids, request.lora_request)

    def _pick_victim(self, protected: set[str]) -> Optional[Request]:
        """The most recently admitted running request that is not yet in this step's batch."""
        for request in reversed(self.running):
            if request.request_id not in protected:
                return request
        return None

    def _preempt(self, request: Request) -> None:
        self._remove_running(request)
        self._freed_ids.append(request.request_id)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- results --------------------------------------------------------------------------
    def take_sampled_token(self, request_id: str, scheduled: int = 1, emitted: int = 1) -> Optional[Request]:
        """Account for a step's tokens arriving for request_id: `scheduled` were counted as pending
        (1, or 1 + k for a speculating decode), `emitted` came (1 + the drafts accepted); the
        slots of rejected drafts are free to be overwritten. Returns the request, if still live."""
        request = self.requests.get(request_id)
        if request is None:
            return None  # finished or aborted while its step was in flight
        request.num_pending -= scheduled
        request.num_uncertain -= scheduled > 1
        if request.status == RequestStatus.RUNNING and request.num_computed_tokens:
            request.num_computed_tokens -= scheduled - emitted
        return request
