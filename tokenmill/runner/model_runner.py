"""The model runner: execute_model(scheduler_output) runs the forward pass; sample_tokens() samples,
updates request state on the device and returns an AsyncOutput.

Only what every model needs lives here; request state, input buffers, the sampler, KV-cache
allocation and CUDA graphs each have their own module.
"""

from typing import Optional

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.kernels.input_prep import post_update
from tokenmill.kv_connector.base import KVConnectorMetadata, KVConnectorOutput
from tokenmill.kv_connector.factory import make_worker_connector
from tokenmill.layers.forward_context import AttentionMetadata, AttentionSplitter, forward_context
from tokenmill.layers.invariance import with_batch_invariance
from tokenmill.logger import init_logger
from tokenmill.runner.async_output import AsyncOutput
from tokenmill.runner.cuda_graphs import (GraphBank, GraphMode, no_garbage_collection, resolve_graph_plan,
                                          uniform_query_len, weakest_graph_support)
from tokenmill.step_io import GrammarBitmask, SchedulerOutput
from tokenmill.runner.dummy_batch import fill_dummy_batch, split_tokens
from tokenmill.runner.input_buffers import InputBuffers, StepDescriptor
from tokenmill.runner.kv_cache import KVCacheSpec, allocate_kv_cache, cuda_kv_budget_bytes, kv_cache_torch_dtype
from tokenmill.runner.lora_state import make_lora_state
from tokenmill.runner.prompt_logprobs import PromptLogprobsComputer
from tokenmill.runner.request_states import RequestStates
from tokenmill.runner.sample import Sampler
from tokenmill.runner.spec_decode.decoder import ProposerContext, SpeculativeDecoder
from tokenmill.runner.warmup import (warm_up_attention, warm_up_cpu_batch_invariant, warm_up_forward, warm_up_lora,
                                    warm_up_token_bitmask)

logger = init_logger(__name__)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, max_model_len: int,
                 device: torch.device, dtype: torch.dtype, draft_model: Optional[torch.nn.Module] = None,
                 lora_registry=None):
        """lora_registry: the engine's LoRARegistry (lora/registry.py) when LoRA is enabled."""
        # this engine's numerics live on the model's layers (a copy sharing the weights where they differ)
        model = with_batch_invariance(model, config.batch_invariant)
        self.model = model
        self.config = config
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        arch = model.config
        self.vocab_size = arch.vocab_size
        self.attn_spec = model.attention_spec()
        attn = self.attn_spec
        self.kv_spec = KVCacheSpec(attn.num_layers, attn.num_kv_heads, attn.head_dim, config.block_size,
                                   kv_cache_torch_dtype(config.kv_cache_dtype, dtype), attn.cache_planes)
        # A step holds at most max_num_seqs requests of at most max_model_len tokens each.
        self.max_num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * max_model_len)
        self.sampler = Sampler(config.max_num_seqs, self.vocab_size, device)
        spec = config.speculative_config
        # Speculative decoding (runner/spec_decode/decoder.py), only when configured; draft_model is
        # the draft of method draft_model, loaded by the engine like the target.
        drafting = ProposerContext(model, draft_model, max_model_len, config.block_size,
                                   config.fused_small_batch_linear)
        self.spec = SpeculativeDecoder(spec, self.sampler, config.max_num_seqs, device, drafting) if spec else None
        if spec:  # grammar masks for every row of a verify step
            self.sampler.grammar.rows_per_request = 1 + spec.num_speculative_tokens
        self.prompt_logprobs = PromptLogprobsComputer(config.max_num_seqs, device)
        # Multi-LoRA (lora/slots.py): adapter slots on the device, each row's slot in its state.
        self.lora = make_lora_state(model, config, lora_registry, self.max_num_tokens, dtype, device)
        owners = (self.sampler, self.prompt_logprobs) + ((self.spec,) if self.spec else ())
        self.states = RequestStates(config.max_num_seqs, max_model_len, config.block_size, device,
                                    owners + ((self.lora,) if self.lora else ()),
                                    spare_columns=1 + spec.num_speculative_tokens if spec else 0)
        self.sampler.bind_last_sampled(self.states.last_sampled)  # the bad-words stage's token history
        max_blocks = -(-max_model_len // config.block_size)
        self.buffers = InputBuffers(self.max_num_tokens, config.max_num_seqs, max_blocks, device)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.kv_caches: list = []  # per layer (k_cache, v_cache)
        # A KV connector's worker side (kv_connector/: the host tier, ...), only when configured.
        self.kv_connector = make_worker_connector(config, self.kv_spec.bytes_per_block, device)
        # Every CUDA graph (runner/cuda_graphs.py), planned from the weakest attention backend in use.
        self.graphs = GraphBank(resolve_graph_plan(
            weakest_graph_support(model, draft_model), enabled=device.type == "cuda" and not config.enforce_eager,
            max_num_seqs=config.max_num_seqs, cuda_graph_max_batch=config.cuda_graph_max_batch,
            max_num_tokens=self.max_num_tokens, piecewise_max_tokens=config.piecewise_cuda_graph_max_tokens,
            verify_query_len=1 + spec.num_speculative_tokens if spec else None, lora=self.lora is not None))
        # Pipeline parallelism (executor/pipeline.py): this stage's link to its neighbours, which also
        # gives every stage the last stage's sampled tokens.
        self.pipeline = None
        # Data parallelism with expert parallelism: the step's agreed token count, which the engine
        # sets before each forward pass (engine/dp_lockstep.py; None otherwise).
        self.dp_tokens: Optional[int] = None
        self._step: Optional[StepDescriptor] = None
        self._plan = None  # the step's VerifyPlan with speculative decoding
        self._logits: Optional[torch.Tensor] = None
        self._req_ids: list[str] = []
        self._prompt_lp = None  # the step's prompt logprobs (runner/prompt_logprobs.py), if any asked

    # ---- set-up ---------------------------------------------------------------------------
    def initialize_kv_cache(self, agree=None) -> int:
        """Size and allocate the KV cache; returns the number of blocks. agree(n): the count every
        tensor-parallel rank can hold (the smallest), when there are several."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = self._blocks_from_cuda_memory()
        else:
            wanted = cfg.max_num_seqs * self.max_model_len * self.kv_bytes_per_block() // cfg.block_size
            budget = cfg.kv_cache_memory_gb * 2**30 if cfg.kv_cache_memory_gb else min(wanted, 2**30)
            num_blocks = int(budget // self.kv_bytes_per_block())
        if agree is not None:
            num_blocks = agree(num_blocks)
        if num_blocks < 1:
            raise RuntimeError("no memory is left for the KV cache; lower max_num_batched_tokens or the model size")
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        if self.spec is not None:  # a draft model's cache has the same blocks
            self.spec.bind_kv_cache(num_blocks, self.kv_caches)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, cfg.block_size,
                    num_blocks * self.kv_bytes_per_block() / 2**30)
        return num_blocks

    def kv_bytes_per_block(self) -> int:
        """KV-cache bytes one block takes: the target's, plus a draft model's own cache if any."""
        return self.kv_spec.bytes_per_block + (self.spec.kv_bytes_per_block() if self.spec is not None else 0)

    def capture_cuda_graphs(self) -> None:
        """Capture the graph bank's plan, then a draft's decode graphs (CUDA only, after the KV cache
        exists; nothing with enforce_eager)."""
        if not self.graphs.plan.sizes:
            return
        with no_garbage_collection():
            self.graphs.capture(self)
            if self.spec is not None and self.graphs.plan.draft_max_batch:
                self.spec.capture_cuda_graphs(self.graphs.plan.draft_max_batch)

    def warm_up(self) -> None:
        """Compile the kernels of common step shapes and every attention variant before the first
        request (CUDA only): a compile under load stalls every running request."""
        if self.device.type != "cuda":
            if self.config.batch_invariant:
                warm_up_cpu_batch_invariant(self)
            return
        warm_up_forward(self)
        warm_up_token_bitmask(self)
        variants = warm_up_attention(self)
        lora_variants = warm_up_lora(self)
        torch.cuda.synchronize(self.device)
        logger.info("warm-up: forward passes, %d attention variants%s compiled", variants,
                    f" and {lora_variants} LoRA kernel launches" if lora_variants else "")

    def _blocks_from_cuda_memory(self) -> int:
        # A profiling run at the largest step shape measures the activation peak.
        self.kv_caches = allocate_kv_cache(self.kv_spec, 1, self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        num_reqs = min(self.config.max_num_seqs, self.max_num_tokens)
        self.dummy_run(self.max_num_tokens, num_reqs, sample=True)
        if self.spec is not None:  # a draft model replays the step's tokens
            self.spec.profile_run(self.buffers, self.max_num_tokens, num_reqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        budget = cuda_kv_budget_bytes(self.config.gpu_memory_utilization, peak, self.device)
        return int(budget // self.kv_bytes_per_block())

    def shutdown(self) -> None:
        """Drop the model, KV cache, CUDA graphs and buffers (the runner cannot step afterwards)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing in flight reads what is dropped
        if self.__dict__.get("kv_connector") is not None:
            self.kv_connector.shutdown()
        device = self.device
        vars(self).clear()
        self.device = device

    def speculates(self, params) -> bool:
        """Whether a request with these sampling parameters verifies drafts in its decodes."""
        return self.spec is not None and self.spec.eligible(params)

    def release(self, req_ids: list[str]) -> None:
        """Free the rows of finished or preempted requests."""
        for req_id in req_ids:
            self.states.remove(req_id)

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> None:
        states = self.states
        self.release(out.freed_req_ids)
        for new in out.new_requests:
            states.add(new)
        if out.kv_connector_metadata is not None:  # before the forward pass: its saves and loads
            self.kv_connector.start_load_kv(out.kv_connector_metadata)
        batch = out.batch
        rows = np.fromiter((states.row_of[e.req_id] for e in batch), dtype=np.int64, count=len(batch))
        for e, row in zip(batch, rows):
            if e.new_block_ids:
                states.append_blocks(int(row), e.new_block_ids)
        states.apply_staged()
        q_lens = np.fromiter((e.num_tokens for e in batch), dtype=np.int64, count=len(batch))
        start = np.fromiter((e.start_pos for e in batch), dtype=np.int64, count=len(batch))
        samples = np.fromiter((e.samples for e in batch), dtype=bool, count=len(batch))
        num_tokens = int(q_lens.sum())
        self._req_ids = [e.req_id for e in batch]
        lp_plan = self.prompt_logprobs.plan(self._req_ids, rows, q_lens, start)  # reads every token's hidden
        lora = self.lora.has_adapters(rows) if self.lora is not None else False
        # Full graphs need every entry's logits row in token order; prompt logprobs read every token.
        q = uniform_query_len(q_lens, lambda: all(e.speculative for e in batch)) if lp_plan is None else None
        key = self.graphs.dispatch(len(batch), num_tokens, q, lora)
        padded, padded_tokens = key.padded(len(batch), num_tokens)
        step = StepDescriptor(len(batch), num_tokens, padded, padded_tokens,
                              int(q_lens.max()), int((start + q_lens).max()), rows, samples, q_lens, start)
        self.buffers.upload(rows, q_lens, start, samples, padded)
        self.buffers.prepare(step, states)
        lora_ctx = self.lora.step_context(rows, q_lens, step.padded_tokens) if lora else None
        self._plan = self.spec.prepare(self.buffers, states, batch, rows, q_lens) if self.spec else None
        if key.mode is GraphMode.FULL:  # every token's logits, in the order of the step's logits rows
            self._logits = self.graphs.run(key, None)[:num_tokens]
        else:
            if key.mode is GraphMode.PIECEWISE:
                hidden = self.graphs.run(key, self.buffers.attention_metadata(step))
            else:
                t = step.padded_tokens
                hidden = self.run_model(self.buffers.attention_metadata(step), self.buffers.input_ids[:t],
                                        self.buffers.positions[:t], lora=lora_ctx)
            if self.pipeline is None or self.pipeline.is_last:  # (earlier stages: no logits)
                rows_out = self._plan.logit_index if self._plan else self.buffers.logits_indices[: len(batch)]
                self._logits = self.model.compute_logits(hidden[rows_out])
                if lp_plan is not None:
                    self._prompt_lp = self.prompt_logprobs.compute(hidden, lp_plan, self.model.compute_logits)
        if self.kv_connector is not None:
            self.kv_connector.wait_for_save()
        self._step = step

    def kv_connector_no_forward(self, meta: KVConnectorMetadata) -> None:
        """A step that runs no tokens: its KV transfers still start."""
        self.kv_connector.no_forward(meta)

    def kv_connector_flush_saves(self) -> None:
        """The KV connector's saves issued so far, finished (before the engine hands outputs on)."""
        self.kv_connector.flush_saves()

    def kv_connector_wait_for_loads(self, timeout: float) -> None:
        """Until the KV connector's oldest load may be done, at most timeout seconds (nothing else to run)."""
        self.kv_connector.wait_for_loads(timeout)

    def kv_connector_finished(self) -> KVConnectorOutput:
        """The KV connector's transfers done (or failed) since the last call; never waits."""
        return self.kv_connector.get_finished()

    def forget_step(self) -> None:
        """Drop the launched step unsampled (a pipeline stage before the last: its tokens come from
        the last stage, executor/pipeline.py)."""
        self._step = self._logits = self._plan = self._prompt_lp = None

    def run_model(self, meta: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
                  splitter: Optional[AttentionSplitter] = None, lora=None) -> torch.Tensor:
        """The model's forward pass in this runner's forward context: its KV caches, its engine's
        layer choices and the step's LoRA context, if it has adapters (eager steps, dummy runs and
        every graph capture go through here)."""
        with forward_context(meta, self.kv_caches, splitter, self.config.fused_small_batch_linear, lora,
                             self.pipeline, self.dp_tokens):
            return self.model(input_ids, positions)

    @torch.inference_mode()
    def sample_tokens(self, grammar_bitmask: Optional[GrammarBitmask] = None) -> AsyncOutput:
        """Sample the step that execute_model() launched; grammar_bitmask: the structured-output masks
        of its grammar entries, which the engine fills while the forward pass runs."""
        step, logits = self._step, self._logits
        if step is None:
            raise RuntimeError("sample_tokens() needs an execute_model() first")
        if grammar_bitmask is not None:
            masks = grammar_bitmask
            rows = np.fromiter((self.states.row_of[r] for r in masks.req_ids), np.int64, len(masks.req_ids))
            self.sampler.grammar.set_masks(rows, masks.mask, masks.offsets)
        b = step.num_reqs
        idx = self.buffers.idx_mapping[:b]
        prompt_lp, self._prompt_lp = self._prompt_lp, None
        if self.spec is not None:
            out = self.spec.sample_and_update(logits, self._plan, self.buffers, idx, step.rows, self.states)
            self._step = self._logits = self._plan = None
            return AsyncOutput(self._req_ids, out.sampled, step.sample_mask, out.logprobs, self.copy_stream,
                               out.num_emitted, out.num_drafts, out.next_num_drafts, prompt_lp, out.draft_ids)
        out = self.sampler(logits, step.rows, idx, self.buffers.seq_lens[:b])
        if self.pipeline is not None:  # the last stage's tokens, on every stage
            self.pipeline.share_sampled(out.sampled)
        post_update(idx, out.sampled, self.buffers.sample_mask[:b], b, self.states.last_sampled, out.output_counts)
        self._step = self._logits = None
        return AsyncOutput(self._req_ids, out.sampled, step.sample_mask, out.logprobs, self.copy_stream,
                           prompt_logprobs=prompt_lp)

    # ---- dummy runs (profiling, warm-up): never touch request state ------------------------
    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, num_reqs: int = 1, sample: bool = False,
                  piecewise: bool = False, lora=None) -> torch.Tensor:
        """A forward pass over `num_tokens` tokens split across `num_reqs` fake requests, which
        attend only to cache block 0 and write no K/V; eager, or with piecewise=True through the
        piecewise graphs where they cover the step (as a real step would run); `lora`: a LoRA
        context to run the adapters' path with (eager only)."""
        # Within the buffers: at most max_num_seqs requests, none longer than max_model_len.
        num_reqs = max(1, min(num_reqs, num_tokens, self.config.max_num_seqs),
                       -(-num_tokens // self.max_model_len))
        buf = self.buffers
        key = self.graphs.dispatch(num_reqs, num_tokens, None, False) if piecewise and lora is None else None
        pieces = key is not None and key.mode is GraphMode.PIECEWISE
        meta = fill_dummy_batch(buf, split_tokens(num_tokens, num_reqs), key.size if pieces else 0)
        if pieces:
            hidden = self.graphs.run(key, meta)
        else:
            hidden = self.run_model(meta, buf.input_ids[:num_tokens], buf.positions[:num_tokens], lora=lora)
        logits = self.model.compute_logits(hidden[buf.logits_indices[:num_reqs]])
        if sample:  # the sampler's worst case: every stage on, over the whole vocabulary
            torch.topk(logits, 20, dim=-1)
            logits.sort(dim=-1)
        return hidden
