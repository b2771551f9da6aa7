"""Engine configuration: one typed dataclass, validated on construction, read by every layer."""

from dataclasses import dataclass
from typing import Optional

from tokenmill.errors import TokenmillError


class ConfigError(TokenmillError, ValueError):
    """An engine option is out of range or inconsistent."""


@dataclass
class EngineConfig:
    max_model_len: Optional[int] = None  # default: the model's context length, capped at 32768
    max_num_seqs: int = 256  # requests running at once (= runner rows)
    max_num_batched_tokens: int = 8192  # tokens per step (prefill chunks + decodes)
    # Prompt tokens a step may take while it also runs decodes (None: up to the step budget). A
    # cap shortens the longest steps but makes more of them mixed (see docs/PERFORMANCE.md, serve-8b).
    max_prefill_tokens_with_decodes: Optional[int] = None
    block_size: int = 16
    num_kv_blocks: Optional[int] = None  # explicit KV cache size; else derived from memory
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory tokenmill may use
    kv_cache_memory_gb: Optional[float] = None  # CPU: KV cache size (default: what max_num_seqs needs, <= 1 GiB)
    enable_prefix_caching: bool = True
    async_scheduling: bool = True  # schedule step N+1 while step N runs
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    cuda_graph_max_batch: int = 512  # largest decode batch captured
    # CUDA: prefill and mixed steps of up to this many tokens replay piecewise CUDA graphs (all but
    # attention; runner/piecewise_graphs.py); larger ones, where the device time dominates, run
    # eagerly. 0: always eager.
    piecewise_cuda_graph_max_tokens: int = 2048
    # CUDA: one-token steps (batch-1 decode) run their linear layers through one Triton GEMV each, with the
    # RMSNorm / SiLU-and-mul before them fused in (kernels/skinny_gemm.py); False: cuBLAS + separate ops
    fused_small_batch_linear: bool = True
    seed: int = 0

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens >= 1, f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        need(self.max_prefill_tokens_with_decodes is None or self.max_prefill_tokens_with_decodes >= 1,
             f"max_prefill_tokens_with_decodes must be >= 1, got {self.max_prefill_tokens_with_decodes}")
        need(self.block_size in (8, 16, 32, 64, 128), f"block_size must be 8, 16, 32, 64 or 128, got {self.block_size}")
        need(self.max_model_len is None or self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1, f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        need(0 < self.gpu_memory_utilization <= 1, f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        need(self.piecewise_cuda_graph_max_tokens >= 0,
             f"piecewise_cuda_graph_max_tokens must be >= 0, got {self.piecewise_cuda_graph_max_tokens}")
        need(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0, "kv_cache_memory_gb must be > 0")

    def resolve_max_model_len(self, model_max: int) -> int:
        if self.max_model_len is None:
            return min(model_max, 32768)
        if self.max_model_len > model_max:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's context length {model_max}")
        return self.max_model_len
