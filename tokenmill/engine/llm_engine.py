"""LLMEngine: requests in, outputs out, one step at a time.

With async scheduling the engine keeps one step in flight: it schedules and launches step N+1,
then waits for step N's sampled tokens (the only point where the CPU waits for the device) and
processes them while the device runs N+1. With pipeline stages it keeps one step per stage in
flight (executor/pipeline.py).
"""

import ctypes
import itertools
import random
import sys
import time
import weakref
from collections import deque
import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from tokenmill.config import ConfigError, DataParallelRank, EngineConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerLimits, prefill_context_scale
from tokenmill.engine.spec_stats import SpecDecodeStats
from tokenmill.engine.step_budget import StepBudget
from tokenmill.engine.request_validator import RequestValidator
from tokenmill.distributed import ParallelState, tensor_parallel
from tokenmill.engine.dp_lockstep import DPLockstep
from tokenmill.engine.grammar import StructuredOutputManager
from tokenmill.engine.engine_snapshot import EngineSnapshot
from tokenmill.errors import InvalidRequestError, LoRAError
from tokenmill.loader import LoadedModel, load_model
from tokenmill.loader.load import read_arch
from tokenmill.logger import init_logger
from tokenmill.lora.adapter import model_shapes
from tokenmill.lora.registry import LoRARegistry
from tokenmill.lora.request import LoRARequest
from tokenmill.models.config import architecture_spec
from tokenmill.engine.compile_watch import CompileWatch, install_hooks
from tokenmill.kv_connector.factory import check_connector_options, make_scheduler_connector
from tokenmill.kv_connector.counts import HostTierCounts, SharedStorageCounts
from tokenmill.runner.async_output import AsyncOutput
from tokenmill.step_io import ModelRunnerOutput, SchedulerOutput
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams

logger = init_logger(__name__)

PromptType = Union[str, list[int]]
_SEED_MASK = (1 << 63) - 1
# On the CPU attention (a gather of the context, then SDPA) runs at about half the matmuls' FLOP rate.
CPU_ATTENTION_SLOWDOWN = 2.0
LOAD_WAIT_S = 0.002  # the longest a step with only KV-connector loads pending blocks on them


def check_model_options(config: EngineConfig, arch) -> None:
    """Refuse, naming them, the engine options this model cannot run with yet (ConfigError)."""
    if config.enable_lora and not architecture_spec(arch.architecture).lora:
        raise ConfigError(f"enable_lora: LoRA adapters on {arch.architecture} are not supported yet (Phi-3's "
                          "adapters target the fused qkv_proj / gate_up_proj; Gemma's and gpt-oss's are untested)")
    if config.batch_invariant:
        missing = [what for what, has in (("attention soft-capping", arch.attn_logit_softcap is not None),
                                          ("attention sinks", arch.attention_sinks),
                                          ("latent attention", arch.mla is not None)) if has]
        if missing:
            raise ConfigError(f"batch_invariant: {arch.architecture}'s {' and '.join(missing)} has no "
                              "batch-invariant kernel yet")
    if arch.mla is not None:
        _check_mla_options(config, arch)
    if arch.moe is None:
        if config.enable_expert_parallel:
            raise ConfigError(f"enable_expert_parallel: {arch.architecture} has no mixture-of-experts layers")
        return
    if config.enable_lora and config.enable_expert_parallel:
        raise ConfigError(f"enable_lora with enable_expert_parallel ({arch.architecture}) is not supported yet")
    ep_size = config.tensor_parallel_size * config.data_parallel_size
    if config.enable_expert_parallel and ep_size > arch.moe.num_experts:
        raise ConfigError(f"enable_expert_parallel over {ep_size} ranks: {arch.architecture} has only "
                          f"{arch.moe.num_experts} experts per layer")


def _check_mla_options(config: EngineConfig, arch) -> None:
    """What multi-head latent attention (DeepSeek, layers/mla.py) does not do yet."""
    name = arch.architecture
    if config.kv_cache_dtype != "auto":
        raise ConfigError(f"kv_cache_dtype {config.kv_cache_dtype}: {name}'s latent KV cache is in the model dtype only")
    if config.speculative_config is not None:
        raise ConfigError(f"speculative decoding on {name} is not supported yet (its verify steps are untested "
                          "with latent attention)")


def join_data_parallel(config: EngineConfig, dp: DataParallelRank, device, loaded) -> tuple[ParallelState, DPLockstep]:
    """Join the process group of the replicas that step together: the MoE layers' group (NCCL on
    CUDA, gloo on the CPU) and the lockstep agreement's (gloo); returns the parallel state the model
    is built in and the lockstep."""
    if not config.enable_expert_parallel:
        raise ConfigError("data-parallel replicas step together only with enable_expert_parallel (without it "
                          "they are independent: tokenmill serve --data-parallel-size)")
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise ConfigError("data_parallel_size > 1 with enable_expert_parallel takes tensor_parallel_size and "
                          "pipeline_parallel_size 1 for now")
    spec = config.speculative_config
    if spec is not None and spec.method != "ngram":
        raise ConfigError(f"speculative method {spec.method} with data parallelism and expert parallelism is not "
                          "supported yet (its draft passes are not agreed between the ranks; ngram is)")
    if loaded is not None:
        raise ConfigError("data_parallel_size > 1 builds the model in every rank: pass the model by name, not loaded")
    if not 0 <= dp.rank < dp.size:
        raise ConfigError(f"data-parallel rank {dp.rank} is outside 0..{dp.size - 1}")
    import datetime

    import torch.distributed as dist

    on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=dp.init_method, rank=dp.rank,
                            world_size=dp.size, timeout=datetime.timedelta(minutes=10))
    control = dist.new_group(backend="gloo")
    state = ParallelState(dp_rank=dp.rank, dp_size=dp.size, dp_group=dist.group.WORLD, expert_parallel=True,
                          microbatching=config.enable_microbatching)
    logger.info("data-parallel rank %d of %d joined (experts over %d ranks)", dp.rank, dp.size, state.ep_size)
    return state, DPLockstep(control, torch.device("cpu"))


@dataclass
class StepShape:
    """What one step computed, for roofline accounting: per batch entry, new tokens and context length."""

    query_lens: np.ndarray
    seq_lens: np.ndarray


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int


class LLMEngine:
    def __init__(self, model: Optional[str] = None, config: Optional[EngineConfig] = None, *, dtype="auto",
                 device=None, load_format: str = "auto", loaded: Optional[LoadedModel] = None,
                 draft_loaded: Optional[LoadedModel] = None, tokenizer: Optional[str] = None,
                 data_parallel: Optional[DataParallelRank] = None):
        """`loaded` / `draft_loaded`: an already loaded target / draft model (tests share one load);
        the draft is the one of speculative method draft_model, else loaded from its config.
        `data_parallel`: this engine's rank among replicas that step together (data parallelism with
        expert parallelism: engine/dp_lockstep.py); each rank is an engine in its own process."""
        self.config = config or EngineConfig()
        self.config.validate()
        cfg = self.config
        check_connector_options(cfg)  # refused before anything loads
        if cfg.enable_lora or cfg.batch_invariant or cfg.enable_expert_parallel:  # refused before anything loads
            check_model_options(cfg, loaded.arch if loaded is not None else read_arch(model, load_format))
        # tensor_parallel_size > 1: worker processes hold the other shards (executor/); this process is rank 0.
        self.executor = self._start_tensor_parallel(model, dtype, device, load_format, loaded, tokenizer)
        self.lockstep: Optional[DPLockstep] = None
        self.dp_busy = False  # the last agreement found a replica with unfinished requests (lockstep only)
        self.dp_stop_requested = False  # this replica wants to stop: said in the next agreement
        self.dp_stopped = False  # the agreement said some replica stops: none steps again
        state = ParallelState()
        if data_parallel is not None and data_parallel.size > 1:
            state, self.lockstep = join_data_parallel(cfg, data_parallel, device, loaded)
            if not cfg.enforce_eager:  # a replica would have to replay the agreed size's graph, not its own
                logger.info("data parallelism with expert parallelism: steps run eager")
                self.config = cfg = dataclasses.replace(cfg, enforce_eager=True)
        if self.executor is not None:
            self.loaded = self.executor.loaded
        else:
            with tensor_parallel(state):
                self.loaded = loaded or load_model(model, dtype=dtype, device=device, load_format=load_format,
                                                   max_positions=cfg.max_model_len, seed=cfg.seed,
                                                   tokenizer=tokenizer, quantization=cfg.quantization)
        arch = self.loaded.arch
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = self.config.resolve_max_model_len(arch.max_position_embeddings)
        self.draft = self._load_draft(draft_loaded)
        # Multi-LoRA: adapters checked and kept in host memory here; the runner's device slots take them.
        self.loras = (LoRARegistry(model_shapes(arch), cfg.max_lora_rank, cfg.max_cpu_loras or cfg.max_loras)
                      if cfg.enable_lora else None)
        self.runner = self.executor or ModelRunner(self.loaded.model, self.config, self.max_model_len,
                                                   self.loaded.device, self.loaded.dtype,
                                                   self.draft.model if self.draft is not None else None, self.loras)
        # An engine dropped without shutdown() still stops its workers and breaks the runner's
        # reference cycles (CUDA graphs hold its bound methods) at once, not at a garbage collection.
        self._release = weakref.finalize(self, _release_runner, self.executor,
                                         self.runner if self.executor is None else None)
        # This engine's Triton compiles (counted on CUDA; those after warm-up are warned about).
        self.compile_watch = CompileWatch()
        on_gpu = self.loaded.device.type == "cuda"
        if on_gpu:
            install_hooks()
        with self.compile_watch.watching():
            num_blocks = self.runner.initialize_kv_cache()
            self.runner.warm_up()
            self.runner.capture_cuda_graphs()
        self.kv = KVCacheManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        spec = self.config.speculative_config
        device_type = self.loaded.device.type
        # step_time_target_ms: caps the prompt tokens of steps with decodes once calibrated (below)
        target = self.config.resolve_step_time_target(device_type)
        self.step_budget = (StepBudget(target, self.config.max_num_batched_tokens, self.config.block_size,
                                       synchronous=not on_gpu) if target is not None else None)
        self.scheduler = Scheduler(SchedulerLimits(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                                   self.max_model_len, self.config.resolve_prefill_cap(device_type),
                                                   spec.num_speculative_tokens if spec else 0,
                                                   spec.num_lookahead_tokens if spec else 0,
                                                   self.config.max_loras if self.loras is not None else 0,
                                                   self.config.pipeline_parallel_size,
                                                   self.config.resolve_prefill_step_cap(device_type),
                                                   self._prefill_context_scale(device_type)),
                                   self.kv, self.step_budget,
                                   make_scheduler_connector(self.config, self.runner.kv_spec.bytes_per_block))
        # A KV connector (kv_connector/): the scheduler side here, the worker side in the runner.
        self.kv_connector = self.scheduler.connector
        # Steps kept in flight beyond the one being completed: one with async scheduling; with
        # pipeline stages pp - 1, so that every stage has a step (executor/pipeline.py).
        self.async_scheduling = self.config.async_scheduling
        self.steps_ahead = max(self.config.pipeline_parallel_size - 1, 1 if self.async_scheduling else 0)
        self.max_steps_in_flight = 0  # the most seen at once
        self.outputs = OutputProcessor(self.tokenizer)
        # Structured output: grammars compiled (and cached) on validation, a matcher per request.
        self.structured = StructuredOutputManager(self.tokenizer, arch.vocab_size, list(self.loaded.eos_token_ids))
        self.validator = RequestValidator(self.tokenizer, arch.vocab_size, self.max_model_len, num_blocks,
                                          self.config.block_size, self.structured)
        self._inflight: deque[tuple[SchedulerOutput, AsyncOutput]] = deque()
        self._rng = random.Random(self.config.seed)
        self._ids = itertools.count()
        self.step_log: Optional[list[StepShape]] = None  # set to [] to record every step's shape
        self.generation_tokens = 0
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens) if spec else None
        self.steps_completed = 0  # steps whose results came back
        # With step(emit_unfinished=False): the requests the step changed but did not finish (their
        # state is in self.outputs.states; the engine process sends what is new of it, no copies)
        self.changed_unfinished: list[str] = []
        self.last_step_kind: Optional[str] = None  # "decode", "mixed" or "prefill": the last of those
        if on_gpu:
            self._warm_up_step_path()
            self.compile_watch.mark_warm()
        if self.step_budget is not None:  # after warm-up: its compiles are not the steps' cost
            self.step_budget.calibrate_runner(self.runner, min(self.config.max_num_batched_tokens, self.max_model_len),
                                              self.config.max_num_seqs)

    def _prefill_context_scale(self, device_type: str) -> Optional[float]:
        """On the CPU, where a step's time follows its FLOPs, a per-step prompt cap counts a late
        chunk of a long prompt dearer (its attention over the context); elsewhere plain tokens."""
        if device_type != "cpu":
            return None
        arch = self.loaded.arch
        return prefill_context_scale(arch.hidden_size, arch.active_intermediate_size(), arch.q_size, arch.kv_size,
                                     CPU_ATTENTION_SLOWDOWN)

    def _start_tensor_parallel(self, model, dtype, device, load_format: str, loaded, tokenizer):
        tp, pp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        if tp * pp == 1:
            return None
        from tokenmill.executor.tensor_parallel import TPExecutor, check_supported, check_tensor_parallel
        from tokenmill.loader.load import read_arch

        check_supported(self.config)
        if loaded is not None:
            raise ConfigError("tensor_parallel_size > 1 loads the model in every rank: pass the model by name, "
                              "not loaded")
        arch = read_arch(model, load_format)
        check_tensor_parallel(arch, tp)
        if pp > arch.num_layers:
            raise ConfigError(f"pipeline_parallel_size {pp} is more than the model's {arch.num_layers} layers")
        return TPExecutor.launch(model, self.config, dtype=dtype, device=device, load_format=load_format,
                                 seed=self.config.seed, tokenizer=tokenizer)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step afterwards)."""
        if self.executor is not None:
            self.executor.close()

    def shutdown(self) -> None:
        """Stop the workers and release the model, the KV cache and the CUDA graphs now, so that
        another engine can have the device memory; the engine cannot be used afterwards (idempotent)."""
        if self.__dict__.get("_shut_down"):
            return
        device = self.loaded.device if "loaded" in self.__dict__ else None
        release = self.__dict__.get("_release")
        if release is not None:
            release()  # runs once
        keep = {k: self.__dict__[k] for k in ("config", "tokenizer", "max_model_len") if k in self.__dict__}
        self.__dict__.clear()
        self.__dict__.update(keep, _shut_down=True)
        if device is not None and device.type == "cuda":
            import torch

            torch.cuda.empty_cache()  # hand the freed blocks back to the device, not just the allocator
        _trim_host_heap()
        logger.info("engine shut down")

    def __getattr__(self, name: str):
        # Only reached for a missing attribute: after shutdown() every part but the config is gone.
        if self.__dict__.get("_shut_down"):
            raise RuntimeError(f"this engine has been shut down (LLMEngine.{name} is gone)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _load_draft(self, draft_loaded: Optional[LoadedModel]) -> Optional[LoadedModel]:
        """Speculative method draft_model: its draft, loaded like the target (same loader, dtype and
        device; rotary tables for this engine's context length). None for other methods."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        draft = draft_loaded or load_model(spec.model, dtype=self.loaded.dtype, device=self.loaded.device,
                                           load_format=spec.load_format, max_positions=self.max_model_len,
                                           seed=self.config.seed)
        if draft.arch.vocab_size != self.loaded.arch.vocab_size:
            raise ConfigError(f"the draft model {spec.model!r} has a vocabulary of {draft.arch.vocab_size} tokens "
                              f"but the target's has {self.loaded.arch.vocab_size}: a draft model must share "
                              "the target's vocabulary")
        if draft.dtype != self.loaded.dtype or draft.device != self.loaded.device:
            raise ConfigError(f"the draft model runs in {draft.dtype} on {draft.device}, the target in "
                              f"{self.loaded.dtype} on {self.loaded.device}: they must match")
        logger.info("speculative decoding: draft model %s (%d layers) drafts %d tokens a step", draft.source.name,
                    draft.arch.num_layers, spec.num_speculative_tokens)
        return draft

    def _warm_up_step_path(self) -> None:
        """A few tiny requests through the whole step (input preparation, greedy and sampled rows,
        top-k/top-p, penalties, logprobs, bad words and allowed tokens), so those kernels compile now
        rather than on the first user's request; then the counters and the prefix cache forget them."""
        greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        sampled = SamplingParams(temperature=0.8, seed=0, max_tokens=3, ignore_eos=True)
        penalised = SamplingParams(temperature=0.0, repetition_penalty=1.1, logprobs=2, max_tokens=3, ignore_eos=True)
        mixed = (greedy, sampled,
                 SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1, max_tokens=3, ignore_eos=True), penalised)
        # The sampler compiles a variant per (logits dtype, all rows greedy): the model's dtype when
        # nothing writes into the logits, float32 after penalties or top-k/top-p. So: all greedy,
        # all plain sampling, all greedy with a penalty, then a mixed batch; prompt lengths vary so
        # the staged writes start at differently aligned offsets. A request that does not fit a
        # small configuration (context length, KV blocks) is left out.
        vocab, longest = self.loaded.arch.vocab_size, self.max_model_len - 3
        batches = [(greedy,), (sampled,), (penalised,), mixed]
        if self.tokenizer is not None:  # the token-mask stage's kernels (bad words of several tokens)
            batches.append((SamplingParams(temperature=0.0, bad_words=["a b c"], allowed_token_ids=list(range(
                min(vocab, 64))), max_tokens=3, ignore_eos=True),))
        for batch in batches:
            for i, params in enumerate(batch):
                prompt = [t % vocab for t in range(1, 1 + max(1, min(3 + 6 * i, longest)))]
                try:
                    self.add_request(prompt, params)
                except InvalidRequestError as e:
                    logger.debug("warm-up request left out: %s", e)
            while self.has_unfinished_requests():
                self.step(emit_unfinished=False)
        self.scheduler.num_prefill_tokens = 0
        self.kv.prefix_queries = self.kv.prefix_hits = 0
        self.reset_prefix_cache()
        if self.kv_connector is not None:
            self.kv_connector.reset_stats()
        self.generation_tokens = self.steps_completed = 0
        if self.spec_stats is not None:
            self.spec_stats = SpecDecodeStats(self.spec_stats.num_speculative_tokens)
        self.last_step_kind = None
        self._rng = random.Random(self.config.seed)  # as if nothing had run
        self._ids = itertools.count()

    @property
    def model_name(self) -> str:
        return self.loaded.source.name

    @property
    def vocab_size(self) -> int:
        return self.loaded.arch.vocab_size

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> list[int]:
        return self.validator.tokenize(prompt, add_special_tokens)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Checks that need the model; returns the resolved max_tokens."""
        return self.validator.validate(prompt_ids, params)

    def add_request(self, prompt: PromptType, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, prompt_ids: Optional[list[int]] = None,
                    lora_request: Optional[LoRARequest] = None) -> str:
        """Queue a request (with lora_request: run with that LoRA adapter); raises
        InvalidRequestError (and queues nothing) if it is invalid, LoRAError if its adapter is."""
        params = params or SamplingParams()
        ids = prompt_ids if prompt_ids is not None else self.tokenize(prompt)
        max_tokens = self.validate(ids, params)
        if lora_request is not None:
            self.add_lora(lora_request)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.outputs.states:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        eos = set() if params.ignore_eos else set(self.loaded.eos_token_ids)
        stop_ids = frozenset(eos | set(params.stop_token_ids))
        base_seed = (params.seed & _SEED_MASK) if params.seed is not None else self._rng.getrandbits(63)
        now = time.monotonic()
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = base_seed if i == 0 else (base_seed * 1_000_003 + i) & _SEED_MASK
            children.append(Request(child_id, list(ids), params, seed, max_tokens, stop_ids, arrival_time=now,
                                    parent_id=request_id, index=i, lora_request=lora_request))
        self.outputs.add(request_id, prompt if isinstance(prompt, str) else None, list(ids), children)
        for child in children:
            # Penalties and logprobs read each emitted token's own step: such requests decode plainly.
            child.speculates = self.runner.speculates(params)
            if params.structured_outputs is not None:
                child.structured = True
                self.structured.add(child.request_id, params.structured_outputs)
            self.scheduler.add_request(child)
        return request_id

    # ---- LoRA adapters ------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter (kept in host memory for the requests that name it); LoRAError
        if it is bad, or if LoRA is not enabled."""
        if self.loras is None:
            raise LoRAError(f"LoRA adapter {lora_request.lora_name!r}: LoRA is not enabled; start the engine with "
                            "enable_lora=True (--enable-lora)")
        self.loras.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: requests already queued with it still finish with it. False if unknown."""
        request = self.loras.get(lora_int_id) if self.loras is not None else None
        if request is None:
            return False
        self.loras.remove(lora_int_id)
        self.runner.lora.slots.forget(request)
        return True

    def list_loras(self) -> list[int]:
        """The ids of the adapters added (and not removed)."""
        return self.loras.ids() if self.loras is not None else []

    def abort_request(self, request_id: str, sample: Optional[int] = None) -> Optional[RequestOutput]:
        """Stop a request (or only its sample number `sample`) wherever it is; its blocks go back to
        the pool. Returns its output, final (and the request forgotten) once every sample has ended."""
        user = self.outputs.states.get(request_id)
        if user is None:
            return None
        for state in user.samples if sample is None else user.samples[sample:sample + 1]:
            req = state.request
            if not req.status.finished:
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            self.structured.remove(req.request_id)
            self.outputs.on_finished(req, RequestStatus.FINISHED_ABORTED)
        out = self.outputs.make_output(request_id)
        if out.finished:
            self.outputs.release(request_id)
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._inflight)

    # ---- the loop -------------------------------------------------------------------------
    def step(self, emit_unfinished: bool = True) -> list[RequestOutput]:
        """Schedule and launch one step; process the results that are due. Returns outputs of the
        requests that changed (finished ones with finished=True, and then forgotten); with
        emit_unfinished=False only the finished ones (offline use: no per-step output building)."""
        with self.compile_watch.watching():
            return self._step(emit_unfinished)

    def _step(self, emit_unfinished: bool) -> list[RequestOutput]:
        self.changed_unfinished = []
        launched = False
        results: list[RequestOutput] = []
        completed = 0
        if self.kv_connector is not None:  # loads the worker finished since the last step
            self.scheduler.update_from_kv_connector(self.runner.kv_connector_finished())
        sched = self.scheduler.schedule() if self.scheduler.has_unfinished else None
        if self.lockstep is not None:  # every replica agrees on the step; one without work runs a dummy
            agreement = self.lockstep.run_step(self.runner, sched.num_tokens if sched and sched.batch else 0,
                                               False, lambda agreement: None, stop=self.dp_stop_requested,
                                               busy=self.has_unfinished_requests()).agreement
            self.dp_busy, self.dp_stopped = agreement.busy, agreement.stop
            if agreement.stop:
                return results
        if sched is not None:
            if sched.batch:
                if self.step_log is not None:
                    q = np.fromiter((e.num_tokens for e in sched.batch), np.int64, len(sched.batch))
                    start = np.fromiter((e.start_pos for e in sched.batch), np.int64, len(sched.batch))
                    self.step_log.append(StepShape(q, start + q))
                if self.step_budget is not None:
                    self.step_budget.begin()
                self.runner.execute_model(sched)
                bitmask = None
                if self.structured.in_step(sched):
                    # Structured output: while the forward pass runs, take the step in flight (its
                    # tokens advance the matchers) and fill this step's masks; then sample.
                    completed = self._complete(0, results, emit_unfinished)
                    bitmask = self.structured.bitmask(sched, self.scheduler.requests)
                self._inflight.append((sched, self.runner.sample_tokens(bitmask)))
                self.max_steps_in_flight = max(self.max_steps_in_flight, len(self._inflight))
                if self.step_budget is not None:
                    self.step_budget.launched()
                launched = True
            else:
                if sched.freed_req_ids:
                    self.runner.release(sched.freed_req_ids)
                if sched.kv_connector_metadata is not None:
                    self.runner.kv_connector_no_forward(sched.kv_connector_metadata)
        # Nothing launched: complete the oldest step only (its requests may then be scheduled).
        keep = self.steps_ahead if launched else max(0, len(self._inflight) - 1)
        completed += self._complete(keep, results, emit_unfinished)
        # (A speculating request may wait a step for its in-flight tokens without finishing.)
        waits = self.kv_connector is not None and self.kv_connector.has_pending  # on a transfer: not stuck
        if not launched and not completed and self.scheduler.has_unfinished and not self._inflight:
            if not waits:
                raise RuntimeError("the scheduler could not schedule any request (this is a bug)")
            # Only loads to wait for: block on them (briefly, so new requests are still seen) rather
            # than spin, which held the GIL from the connector's reading threads (a load took 40x longer)
            self.runner.kv_connector_wait_for_loads(LOAD_WAIT_S)
        if not self.scheduler.has_unfinished:  # idle: release the rows of what just finished
            self.runner.release(self.scheduler.take_freed_ids())
        return results

    def _complete(self, keep: int, results: list[RequestOutput], emit_unfinished: bool) -> int:
        """Process in-flight steps, oldest first, until `keep` remain; returns how many."""
        completed = 0
        while len(self._inflight) > keep:
            sched, pending = self._inflight.popleft()
            self.steps_completed += 1
            completed += 1
            self.last_step_kind = sched.kind
            out = pending.get()
            if self.kv_connector is not None:  # another engine may read this step's saves once its outputs leave
                self.runner.kv_connector_flush_saves()
            if self.step_budget is not None:  # the step's measured time feeds the step-time model
                self.step_budget.completed(sched.num_tokens, len(sched.batch))
            results.extend(self._process(sched, out, emit_unfinished))
        return completed

    def _process(self, sched: SchedulerOutput, out: ModelRunnerOutput, emit_unfinished: bool) -> list[RequestOutput]:
        changed: dict[str, None] = {}
        if out.prompt_logprobs is not None:  # before the step's tokens: a finishing output has them all
            self.outputs.on_prompt_logprobs(out.prompt_logprobs)
        if out.num_emitted is None:  # one token per entry (no speculation): the plain loop
            tokens = out.sampled_token_ids
            for i in range(len(out.req_ids)):
                token = int(tokens[i])
                if token >= 0:
                    self._take_tokens(out, i, (token,), 1, changed)
        else:
            self._take_speculative(sched, out, changed)
        results = []
        for user_id in changed:
            if not emit_unfinished and not self.outputs.states[user_id].finished:
                self.changed_unfinished.append(user_id)
                continue
            output = self.outputs.make_output(user_id)
            results.append(output)
            if output.finished:
                self.outputs.release(user_id)
        return results

    def _take_speculative(self, sched: SchedulerOutput, out: ModelRunnerOutput, changed: dict) -> None:
        """A step with speculative decoding: each entry emitted 1 + its accepted drafts."""
        sampled = out.sampled_token_ids[:, 0] >= 0
        if self.spec_stats is not None:
            self.spec_stats.record(out.num_drafts[sampled], out.num_emitted[sampled])
        for i, entry in enumerate(sched.batch):
            if sampled[i]:
                tokens = [int(t) for t in out.sampled_token_ids[i, : int(out.num_emitted[i])]]
                request = self._take_tokens(out, i, tokens, entry.num_tokens if entry.speculative else 1, changed)
                if request is not None:
                    request.expects_drafts = bool(out.next_num_drafts[i] > 0)
                    if request.structured and out.next_draft_ids is not None:  # for its next step's masks
                        request.drafts = [int(t) for t in out.next_draft_ids[i, : int(out.next_num_drafts[i])]]

    def _take_tokens(self, out: ModelRunnerOutput, i: int, tokens, scheduled: int, changed: dict
                     ) -> Optional[Request]:
        """Batch entry i's tokens of one step, in order; none after the one that finishes it.
        Returns the request if it is still live."""
        request = self.scheduler.take_sampled_token(out.req_ids[i], scheduled, len(tokens))
        if request is None:
            return None
        grammar = request.structured
        for token in tokens:
            if grammar and not self.structured.accept(request.request_id, token):
                # The mask allowed it, so this should not happen; never emit a refused token.
                logger.warning("request %s: the grammar refused token %d; finishing it", request.request_id, token)
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                break
            request.output_token_ids.append(token)
            self.generation_tokens += 1
            status = self.outputs.on_token(request, token, i, out.logprobs)
            if status is None and grammar and self.structured.terminated(request.request_id):
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
            if status is not None:
                self._finish(request, status)
                break
        changed[request.parent_id] = None
        return request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(request, status)
        self.outputs.on_finished(request, status)
        if request.structured:
            self.structured.remove(request.request_id)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), self.scheduler.num_waiting, self.kv.usage,
                           self.kv.prefix_hit_rate, self.scheduler.num_preemptions,
                           self.scheduler.num_prefill_tokens, self.generation_tokens)

    def snapshot(self) -> EngineSnapshot:
        """The counters a server shows (its stats and /metrics), as one value safe to hand on."""
        kv, compiles, spec = self.kv, self.compile_watch.stats(), self.spec_stats
        connector = None if self.kv_connector is None else self.kv_connector.stats()
        return EngineSnapshot(len(self.scheduler.running), self.scheduler.num_waiting, kv.usage,
                              kv.num_free_blocks, kv.num_blocks, kv.prefix_hit_rate, self.scheduler.num_preemptions,
                              self.scheduler.num_prefill_tokens, self.generation_tokens,
                              compiles.compiles_after_warm, compiles.seconds_after_warm,
                              None if spec is None else spec.snapshot(),
                              connector if isinstance(connector, HostTierCounts) else None,
                              connector if isinstance(connector, SharedStorageCounts) else None)

    def num_waiting_sequences(self) -> int:
        return self.scheduler.num_waiting  # each of a request's n samples waits

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (and a KV connector's host tier); only when no request runs (False otherwise)."""
        if self.has_unfinished_requests():
            return False
        self.kv.reset_prefix_cache()
        if self.kv_connector is not None:
            self.kv_connector.reset()
        return True

    def check_health(self) -> None:
        """An in-process engine is alive while its caller is (the engine-process client checks more)."""

    def take_gc_pauses(self) -> list[tuple[int, float]]:
        """Collections timed by the engine itself: none in-process (the server's own hook sees them)."""
        return []


def _release_runner(executor, runner) -> None:
    """Stop the tensor-parallel workers (executor) or drop what the runner holds."""
    if executor is not None:
        import atexit

        executor.close()
        atexit.unregister(executor.close)  # its registration would keep rank 0's model alive
        runner = getattr(executor, "runner", None)
    if runner is not None:
        runner.shutdown()


def _trim_host_heap() -> None:
    """Give freed host memory back to the system: glibc keeps large freed heaps otherwise, and the
    process's RSS would stay at its peak after the engine is gone."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl)
        pass


def engine_summary(engine) -> str:
    """One line on what is served and how: model, architecture, dtype, device, context length, KV
    cache, CUDA graphs, speculative decoding (when on)."""
    loaded, config = engine.loaded, engine.config
    blocks = engine.kv.num_blocks
    if loaded.device.type != "cuda":
        graphs = "off (not on CUDA)"
    else:
        graphs = "off (enforce_eager)" if config.enforce_eager else "on"
    dtype = str(loaded.dtype).replace("torch.", "")
    spec = config.speculative_config
    speculation = "" if spec is None else (
        f", speculative decoding {spec.method} k={spec.num_speculative_tokens}"
        + ("" if spec.synthetic_acceptance is None else f" (synthetic acceptance {spec.synthetic_acceptance:g})"))
    return (f"serving {engine.model_name} ({loaded.arch.architecture}, {dtype} on {loaded.device}): "
            f"context length {engine.max_model_len}, KV cache {blocks} blocks x {config.block_size} = "
            f"{blocks * config.block_size} tokens, CUDA graphs {graphs}{speculation}")
