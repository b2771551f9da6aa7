"""Engine and loader configuration: typed dataclasses, validated on construction, read by every layer.

Each option is written once, here: its type, its default and its help text (`option(...)`). The
command-line flags (`tokenmill.entrypoints.cli.add_engine_args`) and the keywords of `LLM(...)` are
generated from these fields, so adding a field is the only edit a new option needs.
"""

import dataclasses
import numbers
import os
import typing
from dataclasses import dataclass
from typing import Any, Optional, Union

from tokenmill.errors import TokenmillError

_SCALARS = (bool, int, float, str)
_TYPE_NAMES = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}


class ConfigError(TokenmillError, ValueError):
    """An option (engine, loader or server) is out of range or inconsistent."""


SPECULATIVE_METHODS = ("ngram", "draft_model", "layer_truncated")


def option(default: Any = dataclasses.MISSING, help: str = "", *, default_help: Optional[str] = None,
           aliases: tuple[str, ...] = (), choices: Optional[tuple] = None, minimum: Optional[float] = None,
           cli_type: Optional[typing.Callable] = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field with the metadata the flag and keyword generators read.

    help: the flag's help text; the generated help adds "(default: ...)": the value, or
    `default_help` where the value alone does not say it (None: "the model's context length").
    aliases: more flag spellings (for a boolean, one starting with --no- sets it to False).
    choices: the values allowed; minimum: the smallest value allowed. cli_type: the flag's parser
    where the annotation is not a plain int/float/str/bool (optionally None).
    """
    metadata = {"help": help, "default_help": default_help, "aliases": tuple(aliases), "choices": choices,
                "minimum": minimum, "cli_type": cli_type}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def scalar_type(annotation: Any) -> tuple[Optional[type], bool]:
    """(bool/int/float/str, or None for any other type; whether None is allowed) of an annotation."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) is Union else (annotation,)
    rest = [a for a in args if a is not type(None)]
    scalar = rest[0] if len(rest) == 1 and rest[0] in _SCALARS else None
    return scalar, len(rest) < len(args)


def field_default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _type_ok(value: Any, scalar: type) -> bool:
    if scalar is bool or isinstance(value, bool):
        return isinstance(value, bool) and scalar is bool
    if scalar is int:
        return isinstance(value, numbers.Integral)
    if scalar is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, scalar)


def check_field_types(config: Any) -> None:
    """Every scalar field holds a value of its annotated type, within its choices and minimum if it has them."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        scalar, optional = scalar_type(hints[f.name])
        if value is None and (optional or scalar is None):
            continue
        if scalar is not None and not _type_ok(value, scalar):
            raise ConfigError(f"{f.name} must be {_TYPE_NAMES[scalar]}{' or None' if optional else ''}, "
                              f"got {value!r}")
        choices, minimum = f.metadata.get("choices"), f.metadata.get("minimum")
        if choices and value not in choices:
            raise ConfigError(f"{f.name} must be one of {', '.join(map(str, choices))}; got {value!r}")
        if minimum is not None and value is not None and value < minimum:
            raise ConfigError(f"{f.name} must be >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class DataParallelRank:
    """One engine's place among the data-parallel replicas that step together."""

    rank: int
    size: int
    init_method: str  # torch.distributed's rendezvous, e.g. tcp://127.0.0.1:PORT


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts tokens that one target step verifies.

    Methods: `ngram` (prompt lookup in the request's own tokens), `draft_model` (a smaller model
    with the target's vocabulary drafts greedily, with a KV cache of its own) and `layer_truncated`
    (the target's first num_draft_layers decoder layers, its final norm and LM head draft greedily,
    sharing the target's KV cache: no second model, no extra memory).
    """

    method: str = option("ngram", "how drafts are made: ngram (prompt lookup in the request's own tokens), "
                                  "draft_model (a smaller model with the target's vocabulary), layer_truncated "
                                  "(the target's first num_draft_layers layers)",
                         choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = option(3, "draft tokens per request per step", minimum=1)
    prompt_lookup_max: int = option(4, "ngram: the longest n-gram matched", minimum=1)
    prompt_lookup_min: int = option(2, "ngram: the shortest n-gram matched", minimum=1)
    model: Optional[str] = option(None, "draft_model: the draft's path (HF directory, GGUF file, or a preset "
                                        "name with load_format dummy)", default_help="none")
    load_format: str = option("auto", "draft_model: how to read the draft (dummy: random weights, for "
                                      "benchmarks)", choices=("auto", "hf", "gguf", "dummy"))
    num_draft_layers: Optional[int] = option(
        None, "layer_truncated: how many of the target's first decoder layers draft", default_help="none",
        minimum=1)
    # For benchmarks with random weights, which accept nothing: every step drafts k tokens and the
    # rejection step accepts each with this probability, whatever the tokens (the verify cost is real).
    synthetic_acceptance: Optional[float] = option(
        None, "benchmarks: accept each draft with this probability regardless of the tokens", default_help="off")

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.synthetic_acceptance is not None and not 0.0 <= self.synthetic_acceptance <= 1.0:
            raise ConfigError(f"synthetic_acceptance must be in [0, 1], got {self.synthetic_acceptance}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                              f"({self.prompt_lookup_max})")
        if self.method == "draft_model" and not self.model:
            raise ConfigError('speculative method draft_model needs "model": the draft model\'s path')
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(f'"model" names a draft model, which only method draft_model uses (method is '
                              f"{self.method})")
        if self.method != "draft_model" and self.load_format != "auto":
            raise ConfigError(f'"load_format" is the draft model\'s, which only method draft_model uses '
                              f"(method is {self.method})")
        if self.method == "layer_truncated" and self.num_draft_layers is None:
            raise ConfigError('speculative method layer_truncated needs "num_draft_layers": how many of the '
                              "target's first layers draft")
        if self.method != "layer_truncated" and self.num_draft_layers is not None:
            raise ConfigError(f'"num_draft_layers" is only for method layer_truncated (method is {self.method})')

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a speculating request needs beyond its scheduled tokens: a draft that runs the
        target's layers or a model of its own writes K/V for its k draft steps ahead of what the
        next step verifies; n-gram lookup writes nothing."""
        return self.num_speculative_tokens if self.method in ("draft_model", "layer_truncated") else 0


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# The connector kv_offloading_size stands for (tokenmill/kv_connector/host_tier.py)
OFFLOADING_CONNECTOR = "OffloadingConnector"
SHARED_STORAGE_CONNECTOR = "SharedStorageConnector"  # prefill/decode disaggregation on one host


@dataclass
class KVTransferConfig:
    """A KV connector (tokenmill/kv_connector/): moves KV blocks between this engine's GPU cache and
    elsewhere. vLLM's shape: {"kv_connector": NAME, "kv_role": ..., "kv_connector_extra_config": {...}}."""

    kv_connector: str = option(OFFLOADING_CONNECTOR, "the connector's name (kv_connector/factory.py lists them)")
    kv_role: str = option("kv_both", "kv_producer (saves KV for others), kv_consumer (loads it) or kv_both",
                          choices=KV_ROLES)
    kv_connector_extra_config: dict = option(
        default_factory=dict, help='the connector\'s own options (OffloadingConnector: {"size_gib": G}; '
                                  'SharedStorageConnector: {"path": DIR, "max_store_gib": G, "ttl_s": S})',
        default_help="{}")

    def __post_init__(self) -> None:
        check_field_types(self)
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError(f"kv_connector_extra_config must be a JSON object, got "
                              f"{self.kv_connector_extra_config!r}")


# On the CPU a step of a few hundred prompt tokens takes about a second for the embedded model:
# with decodes running, a long prompt is taken in chunks of this size so streams keep moving
# (docs/PERFORMANCE.md, CPU).
CPU_PREFILL_TOKENS_WITH_DECODES = 256
# On the CPU every step's prompt tokens, with or without decodes: a request that arrives during a
# long prompt's prefill waits for one such chunk, not the whole prompt (docs/PERFORMANCE.md, CPU).
CPU_PREFILL_TOKENS_PER_STEP = 256
STEP_TIME_TARGET_WORDS = ("auto", "off")


def parse_step_time_target(text: str):
    """--step-time-target-ms: a number of milliseconds, `auto` or `off`."""
    word = text.strip().lower()
    if word in STEP_TIME_TARGET_WORDS or word == "none":
        return "off" if word == "none" else word
    try:
        return float(word)
    except ValueError:
        raise ValueError(f"not a number, auto or off: {text!r}") from None


parse_step_time_target.__name__ = "step-time target"  # argparse: "invalid step-time target value: ..."


@dataclass
class EngineConfig:
    """The engine's options. Every field is also a flag (--max-num-seqs) and an `LLM(...)` keyword."""

    max_model_len: Optional[int] = option(
        None, "context length in tokens", default_help="the model's, capped at 32768", minimum=2)
    max_num_seqs: int = option(256, "requests running at once (= runner rows)", minimum=1)
    max_num_batched_tokens: int = option(8192, "tokens per engine step (prefill chunks + decodes)", minimum=1)
    # A cap shortens the longest steps but makes more of them mixed (see docs/PERFORMANCE.md, serve-8b).
    max_prefill_tokens_with_decodes: Optional[int] = option(
        None, "prompt tokens a step may take while it also runs decodes; bounds inter-token latency",
        default_help=f"{CPU_PREFILL_TOKENS_WITH_DECODES} on the CPU unless step_time_target_ms is set, up to the "
                     "step budget on CUDA", minimum=1)
    # A new request waits at most one step of this many prompt tokens behind a long prompt.
    max_prefill_tokens_per_step: Optional[int] = option(
        None, "prompt tokens any step may take, with or without decodes: a longer prompt is prefilled in chunks, "
              "so a request that arrives meanwhile is scheduled at the next step (shorter prompts first)",
        default_help=f"{CPU_PREFILL_TOKENS_PER_STEP} on the CPU, none on CUDA", minimum=1)
    # engine/step_budget.py: a lower target holds inter-token latency down but spreads prompts over
    # more steps (a longer time to first token). `tokenmill serve` defaults to auto.
    step_time_target_ms: Union[float, str, None] = option(
        None, "a step that runs decodes takes only the prompt tokens a step-time model (timed at start-up, "
              "updated from measured steps) predicts fit in this many milliseconds beside them (at least one "
              "KV block's worth; within max_num_batched_tokens and max_prefill_tokens_with_decodes); steps "
              "without decodes are not limited. auto: on one CUDA device, the larger of "
              "22 ms and twice the calibrated decode step of max_num_seqs requests; off on the CPU and with "
              "tensor or pipeline parallelism. off: no target", default_help="off (tokenmill serve: auto)",
        cli_type=parse_step_time_target)
    block_size: int = option(16, "tokens per KV-cache block", choices=(8, 16, 32, 64, 128))
    num_kv_blocks: Optional[int] = option(
        None, "explicit KV-cache size in blocks", default_help="derived from memory", minimum=1)
    gpu_memory_utilization: float = option(0.9, "CUDA: fraction of device memory tokenmill may use")
    kv_cache_memory_gb: Optional[float] = option(
        None, "CPU: KV-cache size in GiB", default_help="what max_num_seqs full-length requests need, <= 1 GiB")
    enable_prefix_caching: bool = option(
        True, "reuse the KV cache of shared prompt prefixes", aliases=("--no-prefix-caching",))
    async_scheduling: bool = option(True, "schedule step N+1 while step N runs")
    enforce_eager: bool = option(False, "CUDA: no CUDA graphs")
    cuda_graph_max_batch: int = option(512, "CUDA: largest decode batch captured as a CUDA graph", minimum=1)
    # runner/piecewise_graphs.py; larger steps, where the device time dominates, run eagerly.
    piecewise_cuda_graph_max_tokens: int = option(
        2048, "CUDA: prefill and mixed steps of up to this many tokens replay piecewise CUDA graphs "
              "(attention eager between them); 0: always eager", minimum=0)
    # kernels/skinny_gemm.py
    fused_small_batch_linear: bool = option(
        True, "CUDA: one-token steps (batch-1 decode) run each linear layer as one Triton GEMV with the "
              "RMSNorm / SiLU-and-mul before it fused in; off: cuBLAS and separate kernels")
    # quantization/: weights quantized at load
    quantization: Optional[str] = option(
        None, "quantize the model's linear layers at load: fp8 (e4m3 weights, a scale per output row; "
              "FP8 matmuls on Hopper and later, dequantized elsewhere)", choices=("fp8",), default_help="off")
    # runner/kv_cache.py, kernels/attention.py: the paged KV cache's element type
    kv_cache_dtype: str = option(
        "auto", "KV-cache element type: auto (the model dtype) or fp8 (e4m3 with one scale per layer for K and one "
                "for V: the checkpoint's self_attn.k_scale / v_scale when it has them, else 1.0; the cache holds "
                "twice the tokens of a 16-bit one)", choices=("auto", "fp8", "fp8_e4m3"))
    # layers/batch_invariant.py, kernels/batch_invariant.py
    batch_invariant: bool = option(
        False, "batch-invariant numerics: each request's logits (so its greedy and seeded output) are the same "
               "whatever else runs in its steps (batch size, prefill or decode, chunking, graph padding), "
               "through kernels with one fixed reduction order; slower")
    seed: int = option(0, "seeds dummy weights and requests that bring no seed of their own",
                       aliases=("--engine-seed",))
    # executor/: worker processes, one per rank (torch.distributed: NCCL on CUDA, gloo on the CPU).
    tensor_parallel_size: int = option(1, "tensor-parallel ranks: each layer's weights split over this many "
                                          "worker processes (GPUs)", aliases=("-tp",), minimum=1)
    pipeline_parallel_size: int = option(1, "pipeline stages: the layers split over this many ranks", aliases=("-pp",),
                                         minimum=1)
    data_parallel_size: int = option(1, "tokenmill serve: independent engine replicas behind one server "
                                        "(each with tensor_parallel_size x pipeline_parallel_size ranks)",
                                     aliases=("-dp",), minimum=1)
    # layers/moe_dispatch.py, engine/dp_lockstep.py
    enable_expert_parallel: bool = option(
        False, "mixture-of-experts layers place whole experts on the tensor_parallel_size x data_parallel_size "
               "ranks (instead of splitting each expert over the tensor-parallel ranks); with "
               "data_parallel_size > 1 the replicas step together, each rank's tokens going to every "
               "rank's experts", aliases=("-ep",))
    enable_microbatching: bool = option(
        False, "with expert parallelism over several ranks: each MoE layer runs its tokens as two "
               "micro-batches, one's exchange between the ranks overlapping the other's experts")
    # lora/: adapters in GPU slots, chosen per request (LoRARequest).
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT directories) on top of the model, one per request")
    max_loras: int = option(1, "LoRA adapters resident on the device at once (and distinct adapters in one batch)",
                            minimum=1)
    max_lora_rank: int = option(16, "the largest LoRA rank accepted (the slots' size)", minimum=1)
    max_cpu_loras: Optional[int] = option(
        None, "LoRA adapters kept loaded in host memory (least recently used evicted)", default_help="max_loras",
        minimum=1)
    speculative_config: Optional[SpeculativeConfig] = option(
        None, 'speculative decoding as JSON: {"method": "ngram", "num_speculative_tokens": 3, '
              '"prompt_lookup_max": 4, "prompt_lookup_min": 2}, {"method": "draft_model", "model": PATH, '
              '"num_speculative_tokens": 4} (a draft with the target\'s vocabulary; "load_format": "dummy" for '
              'random weights) or {"method": "layer_truncated", "num_draft_layers": N, '
              '"num_speculative_tokens": 4} (the target\'s first N layers draft)', default_help="off")

    kv_transfer_config: Optional[KVTransferConfig] = option(
        None, 'a KV connector as JSON: {"kv_connector": NAME, "kv_role": "kv_both", "kv_connector_extra_config": '
              '{...}}; OffloadingConnector is the host-memory tier (kv_offloading_size)', default_help="none")
    kv_offloading_size: Optional[float] = option(
        None, "GiB of host memory (pinned on CUDA) that keeps KV blocks evicted from the GPU prefix cache, "
              "loaded back when a prompt reuses them", default_help="off")

    def __post_init__(self) -> None:
        if isinstance(self.kv_transfer_config, dict):
            try:
                self.kv_transfer_config = KVTransferConfig(**self.kv_transfer_config)
            except TypeError as e:
                raise ConfigError(f"kv_transfer_config: {e}") from None
        if isinstance(self.speculative_config, dict):
            try:
                self.speculative_config = SpeculativeConfig(**self.speculative_config)
            except TypeError as e:
                raise ConfigError(f"speculative_config: {e}") from None
        if isinstance(self.step_time_target_ms, str):
            word = self.step_time_target_ms.strip().lower()
            self.step_time_target_ms = None if word in ("off", "none") else word
        if self.step_time_target_ms == "auto" and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            self.step_time_target_ms = None  # not supported with several ranks yet: auto means off there
        self.validate()

    def validate(self) -> None:
        check_field_types(self)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ConfigError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        target = self.step_time_target_ms
        if target is not None and target not in STEP_TIME_TARGET_WORDS and not (
                isinstance(target, numbers.Real) and not isinstance(target, bool) and target > 0):
            raise ConfigError(f"step_time_target_ms must be > 0, auto or off, got {target!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.enable_microbatching and not self.enable_expert_parallel:
            raise ConfigError("enable_microbatching splits the exchange of expert parallelism: it needs "
                              "enable_expert_parallel")
        if self.batch_invariant:
            self._check_batch_invariant()
        self._check_kv_transfer()

    def _check_kv_transfer(self) -> None:
        size, kv = self.kv_offloading_size, self.kv_transfer_config
        if size is not None and not size > 0:
            raise ConfigError(f"kv_offloading_size must be > 0 GiB, got {size}")
        if size is not None and kv is not None and kv.kv_connector != OFFLOADING_CONNECTOR:
            raise ConfigError(f"kv_offloading_size runs the {OFFLOADING_CONNECTOR}; kv_transfer_config names "
                              f"{kv.kv_connector} (one connector at a time)")

    def resolve_kv_transfer(self) -> Optional[KVTransferConfig]:
        """The connector to run: kv_transfer_config, or the host tier that kv_offloading_size asks for."""
        kv = self.kv_transfer_config
        if self.kv_offloading_size is None:
            return kv
        extra = dict(kv.kv_connector_extra_config) if kv is not None else {}
        extra["size_gib"] = self.kv_offloading_size
        return KVTransferConfig(OFFLOADING_CONNECTOR, kv.kv_role if kv is not None else "kv_both", extra)

    def _check_batch_invariant(self) -> None:
        """What batch-invariant mode does not cover yet is refused, not run with batch-dependent numerics."""
        unsupported = {"quantization": self.quantization is not None, "enable_lora": self.enable_lora,
                       "speculative_config": self.speculative_config is not None,
                       "pipeline_parallel_size > 1": self.pipeline_parallel_size > 1,
                       "enable_expert_parallel": self.enable_expert_parallel}
        named = [name for name, on in unsupported.items() if on]
        if named:
            raise ConfigError(f"batch_invariant does not support {', '.join(named)} yet (their kernels or "
                              f"reductions still depend on the batch)")

    def resolve_prefill_cap(self, device_type: str) -> Optional[int]:
        """max_prefill_tokens_with_decodes on this device: on the CPU, where a step of thousands of
        prompt tokens takes seconds, a long prompt is chunked while other requests decode (unless a
        step-time target chooses the chunks)."""
        if self.max_prefill_tokens_with_decodes is None and device_type == "cpu" and self.step_time_target_ms is None:
            return CPU_PREFILL_TOKENS_WITH_DECODES
        return self.max_prefill_tokens_with_decodes

    def resolve_prefill_step_cap(self, device_type: str) -> Optional[int]:
        """max_prefill_tokens_per_step on this device: on the CPU a step of thousands of prompt tokens
        takes seconds, which every request that arrives meanwhile would wait."""
        if self.max_prefill_tokens_per_step is None and device_type == "cpu":
            return CPU_PREFILL_TOKENS_PER_STEP
        return self.max_prefill_tokens_per_step

    def resolve_step_time_target(self, device_type: str) -> Union[float, str, None]:
        """step_time_target_ms on this device: a number, "auto" (on CUDA only; chosen at calibration,
        engine/step_budget.py) or None (no target)."""
        target = self.step_time_target_ms
        if target == "off" or (target == "auto" and device_type != "cuda"):
            return None
        return target

    def resolve_max_model_len(self, model_max: int) -> int:
        if self.max_model_len is None:
            return min(model_max, 32768)
        if self.max_model_len > model_max:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's context length {model_max}")
        return self.max_model_len


@dataclass
class LoadConfig:
    """What to load and where: the loader's options, also flags and `LLM(...)` keywords."""

    model: Optional[str] = option(
        None, "HF directory, GGUF file, Hugging Face Hub id (org/name), or preset name with --load-format dummy",
        default_help="the embedded smollm2-135m-instruct")
    revision: Optional[str] = option(None, "a Hub model's branch, tag or commit",
                                     default_help="the default branch")
    download_dir: Optional[str] = option(
        None, "the cache Hub models are read from and downloaded into (huggingface_hub's layout)",
        default_help="huggingface_hub's: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub")
    load_format: str = option("auto", "how to read the model (auto: from the path; dummy: random weights)",
                              choices=("auto", "hf", "gguf", "dummy"))
    tokenizer: Optional[str] = option(
        None, "the tokenizer to use instead of the model's: an HF directory, a GGUF file, or "
              "smollm2-135m-instruct (e.g. for a dummy preset, which has none)", default_help="the model's own")
    # A name, or a torch.dtype from Python; the loader checks it.
    dtype: Any = option("auto", "weights and activations: auto, float32, bfloat16 or float16 (auto: float32 on "
                                "CPU; on CUDA the checkpoint's half type, else bfloat16)", cli_type=str)
    # A name, or a torch.device from Python; the loader checks it.
    device: Any = option(None, "cpu or cuda", default_help="cuda if available", cli_type=str)

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        check_field_types(self)
