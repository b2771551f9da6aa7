"""The roofline report: measured device ceilings and the floor of each step the engine ran.

For one step (per batch entry: q new tokens, context length s after the step):

  bytes = weight bytes
        + KV read    = sum_entries s * kv_bytes_per_token
        + KV written = sum_entries q * kv_bytes_per_token
          (kv_bytes_per_token = 2 (K and V) x layers x kv_heads x head_dim x the cache's bytes per
          value: the model dtype's, or 1 for an FP8 cache; multi-head latent attention, DeepSeek:
          layers x (kv_lora_rank + qk_rope_head_dim) x bytes, the one latent row a token caches)
  FLOPs = 2 x non-embedding parameters x new tokens
        + 2 x LM-head parameters x LM-head rows
        + attention: per layer 4 x heads x head_dim x sum over new tokens of the context each attends
          to (for an entry with q new tokens ending at s: sum_{i=1..q} (s - q + i)); latent
          attention 2 x heads x min(qk + v head dims (expanded), 2 x kv_lora_rank + rope (absorbed))
  floor = max(bytes / copy bandwidth, FLOPs / matmul rate)

Mixture-of-experts models: of each sparse layer's experts the weight bytes count only those the
step's tokens select, and the FLOPs only each token's top_k (tokens x top_k x 3 x hidden x
expert width x 2 per layer); the router, attention and any shared expert count as dense layers do.
Routing depends on the data and the engine does not report it (counting it would cost a device
sync per step), so a step of T new tokens is taken to read the expected number of distinct experts
under uniform, independent routing, per sparse layer:

  distinct = E x (1 - (1 - k/E)^T)      (E experts, top k; exactly k at T = 1, batch-1 decode)

Skewed routing touches fewer experts than this on average, so with it the true floor is lower.
The report says so (its `moe` entry) and gives the mean distinct experts per step.

With FP8 linear weights the weight bytes count 1 per linear-layer parameter, and the linear
layers' FLOPs (2 x non-embedding parameters x new tokens, run as FP8 matmuls) go at the measured
FP8 matmul rate, the LM head and attention at the 16-bit one:
  compute time = linear FLOPs / FP8 rate + other FLOPs / matmul rate.

Two conventions are computed (both are reported; "as-run" is the headline number):

* ``as-run`` (default): what the runner must physically move and compute for the schedule it ran.
  The LM head is applied to one row per batch entry (the runner computes logits only at
  ``logits_indices``), and an untied input-embedding table is not read whole: only the rows of the
  new tokens are gathered.
* ``spec``: the literal formula of the project brief: all parameters x dtype bytes (embeddings
  once when tied), and the LM head counted for every new token. This floor is higher (so its
  percentage is higher) for prefill-heavy steps (LM-head FLOPs) and for untied models (the input
  embedding table, 6.5% of Llama-3.1-8B's bytes). Both count a MoE model's experts as above.

Activations are ignored in both: the floor is a lower bound on the step's time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple, Optional, Sequence

import numpy as np

from tokenmill.models.config import ModelArchConfig

KINDS = ("decode", "prefill", "mixed")


@dataclass
class Ceilings:
    device_type: str  # "cuda" or "cpu"
    device_name: str
    copy_bytes_per_s: float  # bytes read + written per second
    matmul_flops_per_s: float
    matmul_dtype: str
    method: str
    fp8_matmul_flops_per_s: Optional[float] = None  # e4m3 x e4m3 -> bf16 (torch._scaled_mm), when measured
    gpus: int = 1  # the rates are the sum over this many devices, each taken to match the measured one

    def over_gpus(self, n: int) -> "Ceilings":
        """These ceilings (one device's) summed over n devices of the same kind: a run with tensor,
        pipeline or data parallelism over n GPUs is measured against all of them. The floor this
        gives leaves the all-reduce out, and a pipeline at batch 1 (one stage busy at a time)
        cannot reach it."""
        if n < 1:
            raise ValueError(f"over_gpus takes at least 1 device, got {n}")
        if self.gpus != 1:
            raise ValueError("over_gpus scales one device's ceilings")
        if n == 1:
            return self
        fp8 = None if self.fp8_matmul_flops_per_s is None else self.fp8_matmul_flops_per_s * n
        return replace(self, copy_bytes_per_s=self.copy_bytes_per_s * n, matmul_flops_per_s=self.matmul_flops_per_s * n,
                       fp8_matmul_flops_per_s=fp8, gpus=n, method=f"{self.method}; one device's, times {n} devices")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["copy_TB_per_s"] = self.copy_bytes_per_s / 1e12
        d["matmul_TFLOP_per_s"] = self.matmul_flops_per_s / 1e12
        if self.fp8_matmul_flops_per_s:
            d["fp8_matmul_TFLOP_per_s"] = self.fp8_matmul_flops_per_s / 1e12
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Ceilings":
        return cls(d["device_type"], d["device_name"], float(d["copy_bytes_per_s"]), float(d["matmul_flops_per_s"]),
                   d.get("matmul_dtype", "?"), d.get("method", "?"), d.get("fp8_matmul_flops_per_s"),
                   int(d.get("gpus", 1)))


def run_ceilings(device, args) -> Ceilings:
    """The ceilings a bench run is measured against: one device's (FP8's matmul rate too where
    args.quantization is fp8), summed over the GPUs of a parallel run (gpus_of). On the CPU the
    ranks share one machine's cores and memory, so nothing is summed there."""
    ceilings = measure_ceilings(device, fp8=getattr(args, "quantization", None) == "fp8")
    return ceilings.over_gpus(gpus_of(args)) if ceilings.device_type == "cuda" else ceilings


def gpus_of(args) -> int:
    """How many devices a bench run's engine uses: tensor x pipeline x data parallel sizes."""
    n = 1
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        n *= int(getattr(args, name, None) or 1)
    return n


def device_name(device) -> str:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _do_bench_median_ms(fn) -> float:
    from triton.testing import do_bench

    try:
        return float(do_bench(fn, return_mode="median"))
    except TypeError:  # a Triton without return_mode
        res = do_bench(fn, quantiles=[0.5])
        return float(res[0] if isinstance(res, (list, tuple)) else res)


def _median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ceilings(device, *, copy_bytes: Optional[int] = None, matmul_n: Optional[int] = None,
                     repeats: int = 5, fp8: bool = False) -> Ceilings:
    """Copy bandwidth (bytes read + written) and matmul rate of `device`.

    CUDA: ``y.copy_(x)`` on 2 GiB and a bf16 8192^3 product, each the median of
    ``triton.testing.do_bench``; with `fp8` (and FP8 tensor cores) also an e4m3 8192^3 product
    with row-wise scales through scaled_mm_e4m3 (torch._scaled_mm with fast accumulation), the FP8
    linear layers' own call. CPU: a 512 MiB copy and an fp32 2048^3 product, each the median of
    `repeats` ``perf_counter`` timings. Memory is released before returning."""
    import torch

    dev = torch.device(device)
    name = device_name(dev)
    if dev.type == "cuda":
        n = copy_bytes or (2 << 30)
        mm = matmul_n or 8192
        torch.cuda.synchronize(dev)
        x = torch.ones(n, dtype=torch.uint8, device=dev)
        y = torch.empty_like(x)
        ms = _do_bench_median_ms(lambda: y.copy_(x))
        copy_bw = 2 * n / (ms * 1e-3)
        x = y = None  # released (a del would leave the timed lambda a dangling name)
        a = torch.randn(mm, mm, dtype=torch.bfloat16, device=dev)
        b = torch.randn(mm, mm, dtype=torch.bfloat16, device=dev)
        c = torch.empty(mm, mm, dtype=torch.bfloat16, device=dev)
        ms = _do_bench_median_ms(lambda: torch.matmul(a, b, out=c))
        flops = 2 * mm ** 3 / (ms * 1e-3)
        fp8_flops = None
        if fp8 and torch.cuda.get_device_capability(dev) >= (8, 9):
            from tokenmill.quantization.fp8 import scaled_mm_e4m3

            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b8: column-major, as _scaled_mm takes it
            sa = torch.ones(mm, 1, dtype=torch.float32, device=dev)
            sb = torch.ones(1, mm, dtype=torch.float32, device=dev)
            ms = _do_bench_median_ms(lambda: scaled_mm_e4m3(a8, sa, b8, sb, torch.bfloat16))
            fp8_flops = 2 * mm ** 3 / (ms * 1e-3)
            del a8, b8
        del a, b, c
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        method = (f"y.copy_(x) on {n / 2**30:g} GiB and bf16 {mm}^3 matmul"
                  + (f" (and e4m3 {mm}^3 _scaled_mm)" if fp8_flops else "") + ", triton.testing.do_bench median")
        return Ceilings("cuda", name, copy_bw, flops, "bfloat16", method, fp8_flops)
    n = copy_bytes or (512 << 20)
    mm = matmul_n or 2048
    x = torch.ones(n, dtype=torch.uint8)
    y = torch.empty_like(x)
    s = _median_seconds(lambda: y.copy_(x), repeats)
    copy_bw = 2 * n / s
    x = y = None  # released (a del would leave the timed lambda a dangling name)
    a = torch.randn(mm, mm, dtype=torch.float32)
    b = torch.randn(mm, mm, dtype=torch.float32)
    c = torch.empty(mm, mm, dtype=torch.float32)
    s = _median_seconds(lambda: torch.matmul(a, b, out=c), repeats)
    flops = 2 * mm ** 3 / s
    method = f"y.copy_(x) on {n / 2**20:g} MiB and fp32 {mm}^3 matmul, perf_counter median of {repeats}"
    return Ceilings("cpu", name, copy_bw, flops, "float32", method)


# ---- the floor ---------------------------------------------------------------------------


class StepFloor(NamedTuple):
    bytes: float
    flops: float
    seconds: float


def kv_bytes_per_token(arch: ModelArchConfig, dtype_bytes: int) -> int:
    if arch.mla is not None:  # one latent row per token and layer, no per-head K/V
        return arch.num_layers * arch.mla.cache_width * dtype_bytes
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype_bytes


def attention_flops_per_pair(arch: ModelArchConfig) -> int:
    """FLOPs of one (query, cached key) pair in one layer: q.k and p.v over every head. Latent
    attention takes the cheaper of its two forms (expanded keys and values, or the absorbed latent)."""
    if arch.mla is not None:
        m = arch.mla
        return 2 * arch.num_heads * min(m.qk_head_dim + m.v_head_dim, 2 * m.kv_lora_rank + m.qk_rope_head_dim)
    return 4 * arch.num_heads * arch.head_dim


def embedding_parameters(arch: ModelArchConfig) -> int:
    """vocab x hidden: the size of one embedding table (the LM head has the same shape)."""
    return arch.vocab_size * arch.hidden_size


def non_embedding_parameters(arch: ModelArchConfig) -> int:
    tables = 1 if arch.tie_word_embeddings else 2
    return arch.num_parameters() - tables * embedding_parameters(arch)


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """The expected number of distinct experts T tokens select, each its top_k, under uniform and
    independent routing: E x (1 - (1 - k/E)^T); exactly k for one token, 0 for none."""
    if tokens <= 1:
        return float(top_k * max(tokens, 0))
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def routed_expert_parameters(arch: ModelArchConfig) -> tuple[int, int]:
    """(sparse layers, parameters of one routed expert: gate, up and down); (0, 0) for dense models."""
    moe = arch.moe
    if moe is None or moe.num_experts == 0:
        return 0, 0
    layers = sum(moe.is_sparse(i) for i in range(arch.num_layers))
    return layers, 3 * arch.hidden_size * moe.intermediate_size


def linear_parameters(arch: ModelArchConfig, new_tokens: int) -> tuple[float, int]:
    """(parameters a step of new_tokens reads, parameters each token multiplies with), embedding
    tables left out. Dense models: both are the non-embedding parameters. MoE: the routed experts
    count as the expected distinct experts the step selects (read) and as top_k (per token)."""
    dense = non_embedding_parameters(arch)
    layers, per_expert = routed_expert_parameters(arch)
    if layers == 0:
        return dense, dense
    moe = arch.moe
    always = dense - layers * moe.num_experts * per_expert  # attention, router, shared expert, norms
    read = always + layers * expected_distinct_experts(moe.num_experts, moe.top_k, new_tokens) * per_expert
    return read, always + layers * moe.top_k * per_expert


def attention_context_sum(query_lens: np.ndarray, seq_lens: np.ndarray) -> int:
    """Sum over new tokens of the number of positions each attends to (causal, itself included)."""
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    return int(np.sum(q * (s - q) + q * (q + 1) // 2))


def step_floor(shape, arch: ModelArchConfig, dtype_bytes: int, ceilings: Ceilings,
               convention: str = "as-run", dense_bytes: Optional[float] = None,
               kv_dtype_bytes: Optional[int] = None) -> StepFloor:
    """(bytes, FLOPs, seconds) of the floor of one step; `shape` is a StepShape (query_lens, seq_lens).
    dense_bytes: bytes per non-embedding parameter read (of MoE experts, those selected) when the
    linear layers are stored otherwise than in the model dtype (FP8 weights: 1; their per-row
    scales, about 0.1 %, are not counted; their FLOPs then go at the FP8 matmul rate when the
    ceilings have one). kv_dtype_bytes: the
    KV cache's bytes per value when not the model dtype's (FP8: 1)."""
    q = np.asarray(shape.query_lens, dtype=np.int64)
    s = np.asarray(shape.seq_lens, dtype=np.int64)
    new_tokens = int(q.sum())
    entries = int(q.size)
    emb = embedding_parameters(arch)
    dense = non_embedding_parameters(arch)
    read, per_token = linear_parameters(arch, new_tokens)  # MoE: the experts this step selects
    kv_tok = kv_bytes_per_token(arch, kv_dtype_bytes or dtype_bytes)
    all_read = arch.num_parameters() - (dense - read)  # of the routed experts, only those selected
    if convention == "spec":
        weight_params = all_read
        lm_head_rows = new_tokens
    elif convention == "as-run":
        weight_params = all_read
        if not arch.tie_word_embeddings:  # the input table is gathered, not streamed
            weight_params += min(new_tokens, arch.vocab_size) * arch.hidden_size - emb
        lm_head_rows = entries
    else:
        raise ValueError(f"unknown roofline convention {convention!r} (as-run or spec)")
    nbytes = weight_params * dtype_bytes + int(s.sum()) * kv_tok + new_tokens * kv_tok
    if dense_bytes is not None:
        nbytes += read * (dense_bytes - dtype_bytes)
    attn = arch.num_layers * attention_flops_per_pair(arch) * attention_context_sum(q, s)
    linear_flops = 2 * per_token * new_tokens
    flops = linear_flops + 2 * emb * lm_head_rows + attn
    compute_s = flops / ceilings.matmul_flops_per_s
    if dense_bytes == 1.0 and ceilings.fp8_matmul_flops_per_s:
        compute_s = linear_flops / ceilings.fp8_matmul_flops_per_s + (flops - linear_flops) / ceilings.matmul_flops_per_s
    seconds = max(nbytes / ceilings.copy_bytes_per_s, compute_s)
    return StepFloor(float(nbytes), float(flops), float(seconds))


def step_kind(shape) -> str:
    """decode: every entry has one new token; prefill: none has; mixed: both kinds in one step.

    (A prefill chunk of exactly one token counts as a decode entry: a StepShape cannot tell.)"""
    q = np.asarray(shape.query_lens)
    ones = int(np.count_nonzero(q == 1))
    if ones == q.size:
        return "decode"
    if ones == 0:
        return "prefill"
    return "mixed"


def _pct(floor: float, measured: Optional[float]) -> Optional[float]:
    if not measured or measured <= 0:
        return None
    return 100.0 * floor / measured


def run_roofline(step_log: Sequence, arch: ModelArchConfig, dtype_bytes: int, ceilings: Ceilings,
                 measured_s: float, step_seconds: Optional[Sequence[float]] = None,
                 kinds: Optional[Sequence[str]] = None, dense_bytes: Optional[float] = None,
                 kv_dtype_bytes: Optional[int] = None) -> dict:
    """The roofline report of one run: floor / measured time, overall and by kind of step.

    `step_seconds` (host-side intervals, one per step, see step_timer) gives each kind its own
    measured time and percentage; without it only the floors and counts are split by kind.
    `kinds` (one per step, as the scheduler saw them: step_timer.StepKinds) sorts the steps;
    without it each step's shape decides (step_kind), which takes a speculative verify step (last
    token + drafts) for a prefill chunk."""
    if step_seconds is not None and len(step_seconds) != len(step_log):
        step_seconds = None
    if kinds is not None and (len(kinds) != len(step_log) or not set(kinds) <= set(KINDS)):
        kinds = None
    by_kind = {k: {"steps": 0, "new_tokens": 0, "floor_s": 0.0, "floor_s_spec": 0.0, "bytes": 0.0, "flops": 0.0,
                   "memory_bound_steps": 0, "measured_s": 0.0 if step_seconds is not None else None}
               for k in KINDS}
    total = {"floor_s": 0.0, "floor_s_spec": 0.0, "bytes": 0.0, "flops": 0.0, "memory_bound_steps": 0}
    for i, shape in enumerate(step_log):
        f = step_floor(shape, arch, dtype_bytes, ceilings, "as-run", dense_bytes, kv_dtype_bytes)
        f_spec = step_floor(shape, arch, dtype_bytes, ceilings, "spec", dense_bytes, kv_dtype_bytes)
        kind = by_kind[kinds[i] if kinds is not None else step_kind(shape)]
        mem_bound = f.bytes / ceilings.copy_bytes_per_s >= f.seconds - 1e-15
        for d in (kind, total):
            d["floor_s"] += f.seconds
            d["floor_s_spec"] += f_spec.seconds
            d["bytes"] += f.bytes
            d["flops"] += f.flops
            d["memory_bound_steps"] += int(mem_bound)
        kind["steps"] += 1
        kind["new_tokens"] += int(np.sum(shape.query_lens))
        if step_seconds is not None:
            kind["measured_s"] += float(step_seconds[i])
    for k in KINDS:
        d = by_kind[k]
        d["roofline_pct"] = _pct(d["floor_s"], d["measured_s"])
        d["roofline_pct_spec"] = _pct(d["floor_s_spec"], d["measured_s"])
        d["share_of_floor"] = d["floor_s"] / total["floor_s"] if total["floor_s"] > 0 else 0.0
    return {
        "convention": "as-run (LM head on one row per batch entry; untied input embedding: gathered rows only)",
        "num_steps": len(step_log),
        "measured_s": measured_s,
        "floor_s": total["floor_s"],
        "roofline_pct": _pct(total["floor_s"], measured_s),
        "floor_s_spec": total["floor_s_spec"],
        "roofline_pct_spec": _pct(total["floor_s_spec"], measured_s),
        "bytes": total["bytes"],
        "flops": total["flops"],
        "memory_bound_steps": total["memory_bound_steps"],
        "per_step_time_source": "host-side step intervals (approximate)" if step_seconds is not None else None,
        "by_kind": by_kind,
        "moe": moe_routing_summary(step_log, arch),
        "ceilings": ceilings.to_dict(),
    }


def moe_routing_summary(step_log: Sequence, arch: ModelArchConfig) -> Optional[dict]:
    """How the floor counted a mixture-of-experts model's experts (None for dense models)."""
    layers, per_expert = routed_expert_parameters(arch)
    if layers == 0:
        return None
    moe = arch.moe
    distinct = [expected_distinct_experts(moe.num_experts, moe.top_k, int(np.sum(s.query_lens))) for s in step_log]
    return {"num_experts": moe.num_experts, "top_k": moe.top_k, "sparse_layers": layers,
            "expert_parameters": per_expert,
            "experts_read": "expected distinct experts under uniform routing, E*(1-(1-k/E)^T) per sparse layer for "
                            "a step of T new tokens (exactly top_k at T = 1); not the engine's actual routing",
            "mean_distinct_experts_per_step": float(np.mean(distinct)) if distinct else None}


def format_roofline(r: dict) -> str:
    c = r["ceilings"]
    lines = [f"roofline: {r['roofline_pct']:.1f}% of the floor ({r['floor_s']:.3f} s floor / {r['measured_s']:.3f} s "
             f"measured; spec formula {r['roofline_pct_spec']:.1f}%) over {r['num_steps']} steps; ceilings: copy "
             f"{c['copy_bytes_per_s'] / 1e9:.1f} GB/s, matmul {c['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s "
             f"({c['matmul_dtype']})"]
    moe = r.get("moe")
    if moe:
        mean = moe["mean_distinct_experts_per_step"]
        lines.append(f"  experts: {moe['num_experts']}, top {moe['top_k']}, on {moe['sparse_layers']} layers; bytes "
                     f"count the expected distinct experts per step under uniform routing, E*(1-(1-k/E)^T) "
                     f"(mean {0.0 if mean is None else mean:.1f} per layer), FLOPs the top {moe['top_k']} per token")
    for k in KINDS:
        d = r["by_kind"][k]
        if not d["steps"]:
            continue
        pct = f", {d['roofline_pct']:.1f}% of its ~{d['measured_s']:.3f} s" if d.get("roofline_pct") is not None else ""
        lines.append(f"  {k:8s} {d['steps']:6d} steps, {d['new_tokens']:8d} tokens, floor {d['floor_s']:.3f} s "
                     f"({100 * d['share_of_floor']:.0f}% of the floor){pct}")
    return "\n".join(lines)


def dense_bytes_of(config) -> Optional[float]:
    """Bytes per linear-layer weight under the engine config's quantization (None: the model dtype)."""
    return 1.0 if getattr(config, "quantization", None) == "fp8" else None


def kv_dtype_bytes_of(config) -> Optional[int]:
    """Bytes per KV-cache value under the engine config's kv_cache_dtype (None: the model dtype)."""
    return 1 if str(getattr(config, "kv_cache_dtype", "auto")).startswith("fp8") else None
