"""GPU micro-benchmark of tokenmill's Triton kernels at real model shapes.

Times every kernel with triton.testing.do_bench (median, L2 flushed between runs), reports the
achieved bandwidth (bytes moved / time) against the device-to-device copy bandwidth measured
here, tries several tile configs (and split counts) for paged attention, checks each attention
config against the torch reference, and writes everything to a JSON file.

    python benchmarks/kernel_bench.py [--out PATH] [--quick] [--models qwen3-0.6b,llama3.1-8b]

The linear layers at 1, 2, 4 and 8 rows (batch-1 decode and speculative verify steps: the fused
GEMV against the norm / SiLU-and-mul kernel + cuBLAS at the same row count, tile-config sweeps,
achieved bandwidth, each row count's time over one row's):

    python benchmarks/kernel_bench.py --skip-attention --skip-small-ops --models llama3.1-8b [--skinny-rows 1,4]

The mixture-of-experts MLPs (kernels/fused_moe.py: the Triton paths against torch._grouped_mm, and
the Triton paths with e4m3 experts beside them) at Qwen3-30B-A3B and Mixtral-8x7B shapes, 1 to 8192
tokens:

    python benchmarks/kernel_bench.py --skip-attention --skip-small-ops --skip-skinny [--moe-tokens 1,64]

--out defaults to $OUT/kernel_bench.json when $OUT is set, else ./kernel_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from tokenmill.kernels import (activation, attention, fused_moe, norm, qkv_prep, qkv_rope_gemv, rotary,  # noqa: E402
                               skinny_gemm)

DTYPE = torch.bfloat16
DEVICE = "cuda"  # --smoke switches to "cpu" (Triton interpreter) to check the script itself


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    intermediate: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


MODELS = {
    "qwen3-0.6b": Model("qwen3-0.6b", 1024, 3072, 16, 8, 128),
    "llama3.1-8b": Model("llama3.1-8b", 4096, 14336, 32, 8, 128),
}

# (block_m, block_n, num_warps, num_stages); None = attention_config's default.
PREFILL_CONFIGS = [None, (128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 32, 4, 4)]
DECODE_CONFIGS = [None, (16, 128, 4, 3), (16, 32, 4, 4), (16, 64, 4, 2), (16, 64, 8, 3), (32, 64, 4, 3)]
DECODE_SPLITS = [1, 4, 8, 16, 32]


def median_ms(fn: Callable[[], object]) -> float:
    if DEVICE != "cuda":  # smoke mode: one untimed-quality call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read + written."""
    n = (2 << 30) // 2 if DEVICE == "cuda" else 1 << 20
    x = torch.empty(n, dtype=torch.bfloat16, device=DEVICE).normal_()
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    del x, y
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return 2 * n * 2 / (ms * 1e-3) / 1e9


class Recorder:
    def __init__(self, copy_gbps: float):
        self.copy_gbps = copy_gbps
        self.rows: list[dict] = []

    def add(self, op: str, model: str, shape: str, ms: float, nbytes: Optional[float] = None,
            flops: Optional[float] = None, **extra) -> dict:
        row = dict(op=op, model=model, shape=shape, ms=round(ms, 5), **extra)
        if nbytes is not None:
            gbps = nbytes / (ms * 1e-3) / 1e9
            row.update(bytes=int(nbytes), gbps=round(gbps, 1), pct_of_copy=round(100 * gbps / self.copy_gbps, 1))
        if flops is not None:
            row["tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
        self.rows.append(row)
        return row


# ----------------------------------------------------------------------------------------------
# Element-wise / normalisation kernels
# ----------------------------------------------------------------------------------------------


def bench_small_ops(rec: Recorder, m: Model, token_counts: list[int]) -> None:
    esz = torch.finfo(DTYPE).bits // 8
    dev = DEVICE
    w = torch.randn(m.hidden, device=dev, dtype=DTYPE)
    for t in token_counts:
        x = torch.randn(t, m.hidden, device=dev, dtype=DTYPE)
        res = torch.randn_like(x)
        shape = f"T={t} H={m.hidden}"
        ms = median_ms(lambda: norm.rms_norm_triton(x, w, 1e-6))
        rec.add("rms_norm", m.name, shape, ms, nbytes=2 * x.numel() * esz,
                torch_ms=round(median_ms(lambda: norm.rms_norm_ref(x, w, 1e-6)), 5))
        ms = median_ms(lambda: norm.rms_norm_triton(x, w, 1e-6, res))  # residual updated in place
        rec.add("rms_norm+residual", m.name, shape, ms, nbytes=4 * x.numel() * esz,
                torch_ms=round(median_ms(lambda: norm.rms_norm_ref(x, w, 1e-6, res)), 5))

        qkv_width = (m.num_q_heads + 2 * m.num_kv_heads) * m.head_dim
        qkv = torch.randn(t, qkv_width, device=dev, dtype=DTYPE)
        q = qkv[:, : m.num_q_heads * m.head_dim].view(t, m.num_q_heads, m.head_dim)
        k = qkv[:, m.num_q_heads * m.head_dim: (m.num_q_heads + m.num_kv_heads) * m.head_dim]
        k = k.view(t, m.num_kv_heads, m.head_dim)
        wd = torch.randn(m.head_dim, device=dev, dtype=DTYPE)
        ms = median_ms(lambda: norm.rms_norm_triton(q, wd, 1e-6))
        rec.add("qk_norm(q view)", m.name, f"T={t} {m.num_q_heads}x{m.head_dim}", ms,
                nbytes=2 * q.numel() * esz)

        gate_up = torch.randn(t, 2 * m.intermediate, device=dev, dtype=DTYPE)
        ms = median_ms(lambda: activation.silu_and_mul_triton(gate_up))
        rec.add("silu_and_mul", m.name, f"T={t} I={m.intermediate}", ms,
                nbytes=3 * t * m.intermediate * esz,
                torch_ms=round(median_ms(lambda: activation.silu_and_mul_ref(gate_up)), 5))

        cache = _cos_sin_cache(max(8192 if DEVICE == "cuda" else 64, t), m.head_dim)
        positions = torch.randint(0, cache.shape[0], (t,), device=dev)
        ms = median_ms(lambda: rotary.rotary_triton(positions, q, k, cache))
        rec.add("rotary(qkv views)", m.name, f"T={t} {m.num_q_heads}+{m.num_kv_heads}x{m.head_dim}", ms,
                nbytes=2 * (q.numel() + k.numel()) * esz + t * m.head_dim * 4)

        page = 16
        pages = triton.cdiv(t, page) + 1
        k_cache = torch.empty(pages, page, m.num_kv_heads, m.head_dim, device=dev, dtype=DTYPE)
        v_cache = torch.empty_like(k_cache)
        v = qkv[:, (m.num_q_heads + m.num_kv_heads) * m.head_dim:].view(t, m.num_kv_heads, m.head_dim)
        slots = torch.randperm(pages * page, device=dev)[:t].to(torch.int32)
        ms = median_ms(lambda: attention.write_kv_cache_triton(k, v, k_cache, v_cache, slots))
        rec.add("write_kv_cache", m.name, f"T={t} {m.num_kv_heads}x{m.head_dim}", ms,
                nbytes=4 * k.numel() * esz)


def _cos_sin_cache(max_pos: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=DEVICE) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float32, device=DEVICE)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


# ----------------------------------------------------------------------------------------------
# Paged attention
# ----------------------------------------------------------------------------------------------


@dataclass
class AttnCase:
    label: str
    reqs: list[tuple[int, int]]  # (q_len, seq_len)


def attention_cases(quick: bool) -> list[AttnCase]:
    cases = [
        AttnCase("decode B=1 ctx=8k", [(1, 8192)]),
        AttnCase("decode B=8 ctx=4k", [(1, 4096)] * 8),
        AttnCase("decode B=64 ctx=2k", [(1, 2048)] * 64),
        AttnCase("decode B=256 ctx=1k", [(1, 1024)] * 256),
        AttnCase("prefill 1x4096", [(4096, 4096)]),
        AttnCase("prefill 8x512", [(512, 512)] * 8),
        AttnCase("chunked 512@4k + 64 dec", [(512, 4096)] + [(1, 2048)] * 64),
    ]
    if not quick:
        cases += [
            AttnCase("decode B=1 ctx=32k", [(1, 32768)]),
            AttnCase("decode B=32 ctx=8k", [(1, 8192)] * 32),
            AttnCase("prefill 2x2048 on 6k ctx", [(2048, 8192)] * 2),
        ]
    return cases


def _make_attn_inputs(m: Model, reqs: list[tuple[int, int]], page: int = 16):
    dev = DEVICE
    gen = torch.Generator(device=dev).manual_seed(0)
    pages_per_req = [triton.cdiv(s, page) for _, s in reqs]
    total_pages = sum(pages_per_req)
    max_pages = max(pages_per_req)
    perm = torch.randperm(total_pages, device=dev, generator=gen).to(torch.int32)
    block_tables = torch.zeros(len(reqs), max_pages, dtype=torch.int32, device=dev)
    start = 0
    for b, n in enumerate(pages_per_req):
        block_tables[b, :n] = perm[start:start + n]
        start += n
    shape = (total_pages, page, m.num_kv_heads, m.head_dim)
    k_cache = torch.randn(shape, device=dev, dtype=DTYPE, generator=gen)
    v_cache = torch.randn(shape, device=dev, dtype=DTYPE, generator=gen)
    q_lens = [q for q, _ in reqs]
    q = torch.randn(sum(q_lens), m.num_q_heads, m.head_dim, device=dev, dtype=DTYPE, generator=gen)
    qsl = torch.tensor([0] + q_lens, device=dev).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, qsl, seq_lens, block_tables


def _attn_cost(m: Model, reqs: list[tuple[int, int]]) -> tuple[float, float]:
    """(minimum bytes moved: every K/V token once + q + out, causal matmul flops)."""
    esz = torch.finfo(DTYPE).bits // 8
    kv = sum(s for _, s in reqs) * m.num_kv_heads * m.head_dim * 2 * esz
    qo = sum(q for q, _ in reqs) * m.num_q_heads * m.head_dim * 2 * esz
    visible = sum(q * (s - q) + q * (q + 1) / 2 for q, s in reqs)  # keys summed over queries
    return kv + qo, 4.0 * visible * m.num_q_heads * m.head_dim


def bench_attention(rec: Recorder, m: Model, quick: bool) -> list[dict]:
    best_rows = []
    scale = m.head_dim ** -0.5
    for case in attention_cases(quick):
        args = _make_attn_inputs(m, case.reqs)
        q = args[0]
        mql = max(ql for ql, _ in case.reqs)
        msl = max(s for _, s in case.reqs)
        nbytes, flops = _attn_cost(m, case.reqs)
        ref = attention.paged_attention_ref(*args, scale)
        out = torch.empty_like(q)
        decode = mql == 1
        variants: list[tuple[str, dict]] = []
        for cfg in DECODE_CONFIGS if decode else PREFILL_CONFIGS:
            hints = {} if cfg is None else dict(zip(("block_m", "block_n", "num_warps", "num_stages"), cfg))
            variants.append(("default" if cfg is None else "m{}n{}w{}s{}".format(*cfg), hints))
        variants.append(("default, max_seq_len=None (graph rule)", {"max_seq_len": None}))
        if decode:
            variants += [(f"default, splits={s}", {"num_splits": s}) for s in DECODE_SPLITS]
        case_rows = []
        for name, hints in variants:
            kw = dict(max_query_len=mql, max_seq_len=msl)
            kw.update(hints)
            fn = lambda: attention.paged_attention_triton(*args, scale, out=out, **kw)  # noqa: E731
            try:
                fn()
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = median_ms(fn)
            except Exception as exc:  # e.g. a config that does not fit in shared memory
                rec.rows.append(dict(op="paged_attention", model=m.name, shape=case.label, config=name,
                                     error=f"{type(exc).__name__}: {exc}"[:200]))
                continue
            case_rows.append(rec.add("paged_attention", m.name, case.label, ms, nbytes=nbytes, flops=flops,
                                     config=name, rel_err=float(f"{err:.2e}")))
        ok = [r for r in case_rows if r["rel_err"] < 1e-2]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            default = next((r for r in case_rows if r["config"] == "default"), None)
            best_rows.append(dict(model=m.name, shape=case.label, best_config=best["config"], best_ms=best["ms"],
                                  default_ms=default["ms"] if default else None,
                                  gbps=best.get("gbps"), tflops=best.get("tflops")))
        if not decode and hasattr(torch.nn.functional, "scaled_dot_product_attention"):
            _bench_sdpa(rec, m, case)
        del args, ref, out
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return best_rows


def _bench_sdpa(rec: Recorder, m: Model, case: AttnCase) -> None:
    """Yardstick: torch SDPA (flash) on one dense request of the same q_len / seq_len, if uniform."""
    if len(set(case.reqs)) != 1:
        return
    (q_len, seq_len), batch = case.reqs[0], len(case.reqs)
    if q_len != seq_len:
        return
    dev = DEVICE
    q = torch.randn(batch, m.num_q_heads, q_len, m.head_dim, device=dev, dtype=DTYPE)
    k = torch.randn(batch, m.num_kv_heads, seq_len, m.head_dim, device=dev, dtype=DTYPE)
    v = torch.randn_like(k)
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    try:
        ms = median_ms(fn)
    except Exception:
        return
    nbytes, flops = _attn_cost(m, case.reqs)
    rec.add("torch_sdpa(dense)", m.name, case.label, ms, nbytes=nbytes, flops=flops, config="-")


# ----------------------------------------------------------------------------------------------


def print_table(rec: Recorder, best_rows: list[dict]) -> None:
    print(f"\ncopy bandwidth: {rec.copy_gbps:.0f} GB/s (read + write)")
    print(f"{'op':22s} {'model':12s} {'shape':28s} {'config':28s} {'ms':>9s} {'GB/s':>7s} {'%copy':>6s} {'TFLOP/s':>8s}")
    for r in rec.rows:
        if "error" in r:
            continue
        if r["op"] == "paged_attention" and r.get("config") != "default":
            continue  # the per-config detail lives in the JSON and the summary below
        print(f"{r['op']:22s} {r['model']:12s} {r['shape']:28s} {str(r.get('config', '')):28s} {r['ms']:9.4f} "
              f"{r.get('gbps', float('nan')):7.0f} {r.get('pct_of_copy', float('nan')):6.1f} "
              f"{r.get('tflops', float('nan')):8.1f}")
    print("\nattention: best config per case")
    for b in best_rows:
        print(f"  {b['model']:12s} {b['shape']:28s} best={b['best_config']:30s} {b['best_ms']:.4f} ms "
              f"(default {b['default_ms']} ms)")


# (block_n, block_k, num_warps, num_stages) for the batch-1 GEMV
SKINNY_CONFIGS = [(8, 512, 4, 3), (16, 256, 4, 3), (32, 128, 4, 3), (4, 1024, 4, 3), (16, 512, 8, 3),
                  (32, 256, 8, 3), (64, 64, 4, 3), (8, 256, 4, 3)]
# ... and for 2 to 8 rows (_gemv_multi_kernel; num_stages is the depth of its load pipeline, 1 = none)
SKINNY_MULTI_CONFIGS = [(16, 512, 4, 3), (16, 256, 4, 4), (32, 256, 4, 3), (32, 256, 8, 4), (32, 128, 4, 4),
                        (16, 128, 4, 4), (64, 128, 4, 3), (32, 256, 4, 1)]
SKINNY_ROWS = [1, 2, 4, 8]
SKINNY_FP8 = False  # --skinny-fp8
# one row with FP8 weights: the same bytes a tile as the 16-bit configs, and more
SKINNY_FP8_CONFIGS = [(8, 1024, 4, 3), (16, 512, 4, 3), (16, 1024, 8, 3), (8, 2048, 8, 3), (4, 2048, 4, 3),
                      (32, 512, 8, 3), (16, 2048, 8, 3), (8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 8, 3),
                      (32, 256, 4, 3)]


def _linear_shapes(m: Model) -> list[tuple[str, int, int]]:
    q = (m.num_q_heads + 2 * m.num_kv_heads) * m.head_dim
    return [("qkv", q, m.hidden), ("o", m.hidden, m.num_q_heads * m.head_dim), ("gate_up", 2 * m.intermediate, m.hidden),
            ("down", m.hidden, m.intermediate)]


def graph_ms(fn: Callable[[], object]) -> float:
    """Median time of fn replayed inside a CUDA graph: no launch overhead, as in the decode graphs."""
    if DEVICE != "cuda":
        return median_ms(fn)
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))


COLD_L2 = False  # --cold-l2: the swept GEMVs read weights that are not in L2, as in a decode step


def weight_copies(w: torch.Tensor, scale: Optional[torch.Tensor]) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """[(w, scale)], or with --cold-l2 enough copies of them to span 4x the L2 cache: a graph that
    cycles through them reads each weight from memory, where one weight replayed alone stays (partly)
    in L2 (the H200's 50 MB hold all of an FP8 q/k/v or o projection)."""
    if not COLD_L2 or DEVICE != "cuda":
        return [(w, scale)]
    n = -(-4 * torch.cuda.get_device_properties(0).L2_cache_size // (w.numel() * w.element_size()))
    return [(w, scale)] + [(w.clone(), None if scale is None else scale.clone()) for _ in range(n - 1)]


def cycled_ms(fn: Callable, copies: list) -> float:
    """graph_ms of fn(w, scale) over every copy, per call."""
    return graph_ms(lambda: [fn(wc, sc) for wc, sc in copies]) / len(copies)


def _config_label(cfg: dict) -> str:
    return "n{block_n}k{block_k}w{num_warps}s{num_stages}".format(**cfg)


def bench_skinny(rec: Recorder, m: Model, rows_list: Optional[list[int]] = None) -> list[dict]:
    """Linear layers at 1 to 8 rows (batch-1 decode, speculative verify steps) inside CUDA graphs:
    the unfused chain (norm or SiLU-and-mul kernel, then cuBLAS) against the skinny GEMV with the
    op fused in, at the same row count, over a sweep of tile configs. Bandwidth counts the weight
    bytes (read once whatever the row count)."""
    import torch.nn.functional as F

    best = []
    esz = torch.tensor([], dtype=DTYPE).element_size()
    one_row_ms: dict[str, float] = {}  # linear -> the 1-row kernel's time at its default config
    for rows in sorted(rows_list or SKINNY_ROWS):  # one row first: the others are compared to it
        assert 1 <= rows <= skinny_gemm.MAX_ROWS, f"--skinny-rows: 1 to {skinny_gemm.MAX_ROWS}"
        for name, n, k in _linear_shapes(m):
            w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) / k ** 0.5
            nbytes = n * k * esz
            w_kernel, w_scale = w, None  # --skinny-fp8: the kernel reads e4m3 weights and their row scales
            if SKINNY_FP8:
                from tokenmill.quantization.fp8 import dequantize_weight_fp8, quantize_weight_fp8

                w_kernel, w_scale = quantize_weight_fp8(w)
                w = dequantize_weight_fp8(w_kernel, w_scale, DTYPE)  # the chain and the reference use these values
                nbytes = n * k
            prologue = {"qkv": skinny_gemm.ADD_RMSNORM, "gate_up": skinny_gemm.ADD_RMSNORM,
                        "down": skinny_gemm.SILU_MUL}.get(name, skinny_gemm.PLAIN)
            norm_w = torch.ones(k, device=DEVICE, dtype=DTYPE)
            x = torch.randn(rows, 2 * k if prologue == skinny_gemm.SILU_MUL else k, device=DEVICE, dtype=DTYPE)
            r = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
            r_chain = r.clone()  # the norm kernel writes x + r into it, replay after replay
            if prologue == skinny_gemm.SILU_MUL:
                chain = lambda: F.linear(activation.silu_and_mul(x), w)  # noqa: E731
            elif prologue == skinny_gemm.ADD_RMSNORM:
                chain = lambda: F.linear(norm.rms_norm(x, norm_w, 1e-5, r_chain)[0], w)  # noqa: E731
            else:
                chain = lambda: F.linear(x, w)  # noqa: E731
            ref = skinny_gemm.skinny_linear_ref(x, w, prologue, r, norm_w, 1e-5)
            ref = (ref[0] if isinstance(ref, tuple) else ref).float()
            unfused = graph_ms(chain)
            shape = f"{name} M={rows} N={n} K={k}"
            rec.add("cublas_chain", m.name, shape, unfused, nbytes=nbytes, config="-", rows=rows)
            default = skinny_gemm.skinny_gemm_config(n, k, DTYPE, prologue, rows, w_kernel.dtype)
            default_label = _config_label(default)
            sweep = [dict(block_n=c[0], block_k=c[1], num_warps=c[2], num_stages=c[3])
                     for c in (SKINNY_CONFIGS if rows == 1 else SKINNY_MULTI_CONFIGS)]
            if default_label not in {_config_label(c) for c in sweep}:
                sweep.append(default)
            timings, errs = {}, {}
            copies = weight_copies(w_kernel, w_scale)
            for conf in sweep:
                label = _config_label(conf)
                def fn(wc=w_kernel, sc=w_scale, conf=conf):
                    return skinny_gemm.skinny_linear_triton(x, wc, prologue, r, norm_w, 1e-5, config=conf,
                                                            weight_scale=sc)
                try:
                    out = fn()
                    out = (out[0] if isinstance(out, tuple) else out).float()
                    errs[label] = ((out - ref).norm() / ref.norm()).item()
                    ms = cycled_ms(fn, copies)
                except Exception as e:  # a config that does not compile (e.g. out of registers or shared memory)
                    print(f"skinny {m.name} {name} M={rows} {label}: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                timings[label] = ms
                rec.add("skinny_fused", m.name, shape, ms, nbytes=nbytes, config=label, rows=rows,
                        rel_err=float(f"{errs[label]:.2e}"))
            if not timings:
                continue
            best_label, best_ms = min(timings.items(), key=lambda kv: kv[1])
            default_ms = timings.get(default_label)
            if rows == 1 and default_ms is not None:
                one_row_ms[name] = default_ms
            base = one_row_ms.get(name)
            pct = lambda ms: round(100 * nbytes / (ms * 1e-3) / 1e9 / rec.copy_gbps, 1)  # noqa: E731
            best.append(dict(model=m.name, linear=name, n=n, k=k, prologue=prologue, unfused_chain_ms=round(unfused, 5),
                             best_config=best_label, best_ms=round(best_ms, 5), default_config=default_label,
                             default_ms=None if default_ms is None else round(default_ms, 5),
                             unfused_pct_of_copy=pct(unfused), best_pct_of_copy=pct(best_ms),
                             # added with the several-row kernel (older files lack these; rows=1 there)
                             rows=rows, bytes=nbytes, unfused_gbps=round(nbytes / (unfused * 1e-3) / 1e9, 1),
                             best_gbps=round(nbytes / (best_ms * 1e-3) / 1e9, 1),
                             default_pct_of_copy=None if default_ms is None else pct(default_ms),
                             default_rel_err=None if default_label not in errs else float(f"{errs[default_label]:.2e}"),
                             # this row count's time over one row's, both at the default config (the
                             # verify-step target: <= 1.1 at 4 rows)
                             default_vs_one_row=(None if base is None or default_ms is None
                                                 else round(default_ms / base, 3)),
                             best_vs_one_row=None if base is None else round(best_ms / base, 3)))
            del w
    return best


def bench_qkv_rope(rec: Recorder, m: Model, rows_list: Optional[list[int]] = None) -> list[dict]:
    """The q/k/v projection with rotary and the KV-cache write at 1 to 8 tokens, in CUDA graphs:
    one kernel (kernels/qkv_rope_gemv.py) against the skinny GEMV followed by qkv_prep, as the
    model runs it when the rotary is not fused."""
    out = []
    n, k = (m.num_q_heads + 2 * m.num_kv_heads) * m.head_dim, m.hidden
    esz = torch.tensor([], dtype=DTYPE).element_size()
    w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) / k ** 0.5
    w_kernel, w_scale = w, None  # --skinny-fp8: e4m3 weights and their row scales, one row's configs swept
    if SKINNY_FP8:
        from tokenmill.quantization.fp8 import dequantize_weight_fp8, quantize_weight_fp8

        w_kernel, w_scale = quantize_weight_fp8(w)
        w, esz = dequantize_weight_fp8(w_kernel, w_scale, DTYPE), 1
    norm_w = torch.ones(k, device=DEVICE, dtype=DTYPE)
    page = 16
    cache = _cos_sin_cache(8192 if DEVICE == "cuda" else 64, m.head_dim)
    k_cache = torch.zeros(64, page, m.num_kv_heads, m.head_dim, device=DEVICE, dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    q_size, kv_size = m.num_q_heads * m.head_dim, m.num_kv_heads * m.head_dim
    for rows in sorted(rows_list or SKINNY_ROWS):
        if not qkv_rope_gemv.fusable(n, k, m.head_dim, DTYPE, tokens=rows):
            continue
        x = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
        r = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
        positions = torch.randint(0, cache.shape[0], (rows,), device=DEVICE)
        slots = torch.randperm(64 * page, device=DEVICE)[:rows]

        def fused(config=None, wc=w_kernel, sc=w_scale):
            return qkv_rope_gemv.skinny_qkv_rope_triton(x, wc, r, norm_w, 1e-5, positions, cache, slots, k_cache,
                                                        v_cache, m.num_q_heads, m.num_kv_heads, config=config,
                                                        weight_scale=sc)

        def separate():
            qkv, _ = skinny_gemm.skinny_linear_triton(x, w_kernel, skinny_gemm.ADD_RMSNORM, r, norm_w, 1e-5,
                                                      weight_scale=w_scale)
            q, kk, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            return qkv_prep.qkv_prep(positions, q.view(rows, m.num_q_heads, m.head_dim),
                                     kk.view(rows, m.num_kv_heads, m.head_dim), v.view(rows, m.num_kv_heads, m.head_dim),
                                     cache, k_cache, v_cache, slots)

        err = rel_err_of(fused()[0], separate())
        fused_ms, separate_ms = graph_ms(fused), graph_ms(separate)
        shape = f"qkv+rope M={rows} N={n} K={k}"
        rec.add("qkv_rope_fused", m.name, shape, fused_ms, nbytes=n * k * esz, rows=rows, rel_err=float(f"{err:.2e}"))
        rec.add("skinny+qkv_prep", m.name, shape, separate_ms, nbytes=n * k * esz, rows=rows)
        sweep = {}
        copies = weight_copies(w_kernel, w_scale)
        if SKINNY_FP8 and rows == 1:  # the one-token kernel's tiles over e4m3 weights
            for bn, bk, nw, ns in SKINNY_FP8_CONFIGS:
                cfg = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                if not qkv_rope_gemv.fusable(n, k, m.head_dim, DTYPE, cfg, rows):
                    continue
                cfg_err = rel_err_of(fused(cfg)[0], separate())
                ms = cycled_ms(lambda wc, sc: fused(cfg, wc, sc), copies)
                sweep[f"{bn}x{bk}w{nw}s{ns}"] = dict(ms=round(ms, 5), pct_of_copy=round(100 * n * k / (ms * 1e-3)
                                                                                        / (rec.copy_gbps * 1e9), 1),
                                                     rel_err=float(f"{cfg_err:.2e}"))
        out.append(dict(model=m.name, rows=rows, fp8=SKINNY_FP8, fused_ms=round(fused_ms, 5),
                        separate_ms=round(separate_ms, 5), rel_err=float(f"{err:.2e}"), sweep=sweep))
    return out


def rel_err_of(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()

def skinny_layer_totals(rows: list[dict]) -> list[dict]:
    """Per model and row count: the four linear layers of one decoder layer summed (unfused chain,
    fused best and fused default), and the fused default against one row's."""
    out = []
    keys = sorted({(r["model"], r["rows"]) for r in rows})
    for model, m_rows in keys:
        layer = [r for r in rows if r["model"] == model and r["rows"] == m_rows]
        if len(layer) != 4:
            continue
        total = {f: (None if any(r[f] is None for r in layer) else round(sum(r[f] for r in layer), 5))
                 for f in ("unfused_chain_ms", "best_ms", "default_ms")}
        out.append(dict(model=model, rows=m_rows, **total))
    for t in out:
        one = next((o for o in out if o["model"] == t["model"] and o["rows"] == 1), None)
        t["default_vs_one_row"] = None if one is None or one["default_ms"] is None or t["default_ms"] is None \
            else round(t["default_ms"] / one["default_ms"], 3)
        t["unfused_vs_one_row_fused"] = None if one is None or one["default_ms"] is None \
            else round(t["unfused_chain_ms"] / one["default_ms"], 3)
    return out


# ----------------------------------------------------------------------------------------------
# Mixture-of-experts
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeModel:
    name: str
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int


MOE_MODELS = {
    "qwen3-30b-a3b": MoeModel("qwen3-30b-a3b", 2048, 768, 128, 8),
    "mixtral-8x7b": MoeModel("mixtral-8x7b", 4096, 14336, 8, 2),
}
MOE_TOKENS = [1, 8, 64, 512, 8192]
MOE_BOTH_PATHS_UP_TO = 64  # token counts at which both Triton paths are timed (the GEMV threshold's range)
MOE_GEMMS_FROM = 512  # token counts from which the grouped GEMMs are also timed alone beside torch._grouped_mm


def _timed(fn: Callable[[], object]) -> tuple[float, bool]:
    """(ms, in a CUDA graph): graph_ms, or median_ms where capture fails."""
    try:
        return graph_ms(fn), DEVICE == "cuda"
    except Exception as exc:  # e.g. an op that cannot be captured
        print(f"moe: graph capture failed ({type(exc).__name__}: {exc}); timing eagerly", file=sys.stderr)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return median_ms(fn), False


def _fp8_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(w13_q, w13_scale, w2_q, w2_scale): the experts in e4m3, quantized per expert and row."""
    from tokenmill.quantization.fp8 import quantize_weight_fp8

    out = []
    for w in (w13, w2):
        pairs = [quantize_weight_fp8(w[e]) for e in range(w.shape[0])]
        out += [torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])]
    return tuple(out)


def _bench_moe_gemms(rec: Recorder, m: MoeModel, shape: str, x, w13, w2, weights, ids) -> dict:
    """The grouped path's two GEMM launches alone (sort done beforehand; gate/up with its row gather
    and SiLU-and-mul, down with the routing weight) beside torch._grouped_mm's two products over the
    same pairs, already sorted and gathered: the layer's GEMMs against PyTorch's grouped GEMM."""
    T, k = ids.shape
    inter, H = m.intermediate, m.hidden
    cfg = fused_moe.moe_config(m.num_experts, inter, H, T, k, DTYPE, path="grouped")
    sort = fused_moe.moe_sort_tokens(ids.to(torch.int32), m.num_experts, cfg["gate_up"]["block_m"])
    h = fused_moe.grouped_gate_up(x, w13, k, sort, cfg["gate_up"])
    order, offs, _ = fused_moe.grouped_mm_order(ids, m.num_experts)
    x_sorted, h_sorted = x[order // k].contiguous(), h[order].contiguous()
    products = {"gate/up": (2 * T * k * H * 2 * inter, lambda: fused_moe.grouped_gate_up(x, w13, k, sort, cfg["gate_up"]),
                            lambda: torch._grouped_mm(x_sorted, w13.transpose(1, 2), offs=offs)),
                "down": (2 * T * k * inter * H, lambda: fused_moe.grouped_down(h, w2, weights, sort, cfg["down"]),
                         lambda: torch._grouped_mm(h_sorted, w2.transpose(1, 2), offs=offs))}
    out = {}
    for name, (flops, triton_fn, torch_fn) in products.items():
        ms, graphed = _timed(triton_fn)
        rec.add("moe_gemm", m.name, shape, ms, flops=flops, config=f"triton {name}", graph=graphed)
        out[f"gemm {name} triton"] = round(ms, 5)
        try:
            ms_ref, graphed = _timed(torch_fn)
        except Exception as exc:  # _grouped_mm takes bf16 on sm90+ only
            rec.rows.append(dict(op="moe_gemm", model=m.name, shape=shape, config=f"torch._grouped_mm {name}",
                                 error=f"{type(exc).__name__}: {exc}"[:200]))
            continue
        rec.add("moe_gemm", m.name, shape, ms_ref, flops=flops, config=f"torch._grouped_mm {name}", graph=graphed)
        out[f"gemm {name} torch._grouped_mm"] = round(ms_ref, 5)
        out[f"gemm {name} triton / grouped_mm"] = round(ms / ms_ref, 3)
    return out


def bench_moe(rec: Recorder, m: MoeModel, token_counts: list[int]) -> list[dict]:
    """The experts' MLPs at T tokens, routed by softmax top-k over random logits: fused_moe_triton
    at its own path choice (and, up to MOE_BOTH_PATHS_UP_TO tokens, each path forced) against
    torch._grouped_mm (fused_moe.grouped_mm_moe), the same Triton paths with the experts in e4m3
    (per-row scales, layers/fp8_moe.py's form; rows "triton fp8 ..."), plus the routing and the
    token sort alone. TFLOP/s counts the routed pairs' products (6 H I flops a pair); GB/s the
    weight bytes of the experts the routing chose, each read once (one byte a weight for e4m3)."""
    E, H, inter, k = m.num_experts, m.hidden, m.intermediate, m.top_k
    esz = torch.tensor([], dtype=DTYPE).element_size()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = torch.randn(E, 2 * inter, H, device=DEVICE, dtype=DTYPE, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, inter, device=DEVICE, dtype=DTYPE, generator=gen) / inter ** 0.5
    fp8 = _fp8_experts(w13, w2)
    summary = []
    for T in token_counts:
        x = torch.randn(T, H, device=DEVICE, dtype=DTYPE, generator=gen)
        logits = torch.randn(T, E, device=DEVICE, dtype=DTYPE, generator=gen)
        weights, ids = fused_moe.moe_route(logits, k, renormalize=True)
        experts_read = int(ids.unique().numel())
        nbytes = experts_read * 3 * inter * H * esz
        flops = 6.0 * T * k * H * inter
        shape = f"T={T} E={E} k={k} H={H} I={inter}"
        ref = fused_moe.fused_moe_ref(x, w13, w2, weights, ids)
        chosen = fused_moe.moe_config(E, inter, H, T, k, DTYPE)
        variants = [(f"triton ({chosen['path']})", None)]
        if T <= MOE_BOTH_PATHS_UP_TO:
            variants += [(f"triton {p} (forced)", fused_moe.moe_config(E, inter, H, T, k, DTYPE, path=p))
                         for p in ("gemv", "grouped")]
        row = dict(model=m.name, tokens=T, path=chosen["path"], experts_read=experts_read, weight_bytes=nbytes)
        for label, cfg in variants:
            fn = lambda cfg=cfg: fused_moe.fused_moe_triton(x, w13, w2, weights, ids, config=cfg)  # noqa: E731
            err = rel_err_of(fn(), ref)
            ms, graphed = _timed(fn)
            rec.add("moe", m.name, shape, ms, nbytes=nbytes, flops=flops, config=label, rel_err=float(f"{err:.2e}"),
                    graph=graphed)
            row[label] = round(ms, 5)
        ref8 = fused_moe.fused_moe_fp8_ref(x, *fp8, weights, ids)
        for label, cfg in variants:
            label = label.replace("triton", "triton fp8", 1)
            fn = lambda cfg=cfg: fused_moe.fused_moe_triton(  # noqa: E731
                x, fp8[0], fp8[2], weights, ids, config=cfg, w13_scale=fp8[1], w2_scale=fp8[3])
            err = rel_err_of(fn(), ref8)
            ms, graphed = _timed(fn)
            rec.add("moe", m.name, shape, ms, nbytes=nbytes // esz, flops=flops, config=label,
                    rel_err=float(f"{err:.2e}"), graph=graphed)
            row[label] = round(ms, 5)
        try:
            fn = lambda: fused_moe.grouped_mm_moe(x, w13, w2, weights, ids)  # noqa: E731
            err = rel_err_of(fn(), ref)
            ms, graphed = _timed(fn)
            rec.add("moe", m.name, shape, ms, nbytes=nbytes, flops=flops, config="torch._grouped_mm",
                    rel_err=float(f"{err:.2e}"), graph=graphed)
            row["torch._grouped_mm"] = round(ms, 5)
        except Exception as exc:  # _grouped_mm takes bf16 on sm90+ only
            rec.rows.append(dict(op="moe", model=m.name, shape=shape, config="torch._grouped_mm",
                                 error=f"{type(exc).__name__}: {exc}"[:200]))
        # the layer's own choice (fused_moe: Triton, or torch._grouped_mm where use_grouped_mm says)
        layer = "torch._grouped_mm" if fused_moe.use_grouped_mm(E, inter, H, T, DTYPE, x.device) else "triton"
        ms, graphed = _timed(lambda: fused_moe.fused_moe(x, w13, w2, weights, ids))
        rec.add("moe", m.name, shape, ms, nbytes=nbytes, flops=flops, config=f"layer ({layer})", graph=graphed)
        row[f"layer ({layer})"] = round(ms, 5)
        if T >= MOE_GEMMS_FROM:
            row.update(_bench_moe_gemms(rec, m, shape, x, w13, w2, weights, ids))
        ms, _ = _timed(lambda: fused_moe.moe_route(logits, k, renormalize=True))
        rec.add("moe_route", m.name, shape, ms, nbytes=T * E * esz, config="softmax top-k")
        if chosen["path"] == "grouped":
            block_m = chosen["gate_up"]["block_m"]
            ms, _ = _timed(lambda: fused_moe.moe_sort_tokens(ids, E, block_m))
            rec.add("moe_sort", m.name, shape, ms, nbytes=T * k * 4, config=f"block_m={block_m}")
        summary.append(row)
    return summary


def _enter_smoke_mode() -> None:
    """Toy shapes on CPU through the Triton interpreter: exercises every code path of this script."""
    global DEVICE, DTYPE, PREFILL_CONFIGS, DECODE_CONFIGS, DECODE_SPLITS, SKINNY_CONFIGS, SKINNY_MULTI_CONFIGS
    global SKINNY_ROWS, attention_cases, MOE_MODELS, MOE_TOKENS, MOE_GEMMS_FROM
    assert os.environ.get("TRITON_INTERPRET") == "1", "--smoke needs TRITON_INTERPRET=1"
    DEVICE, DTYPE = "cpu", torch.float16
    MODELS["smoke"] = Model("smoke", 64, 96, 4, 2, 32)
    PREFILL_CONFIGS = [None, (32, 16, 4, 2)]
    DECODE_CONFIGS = [None, (16, 32, 4, 3)]
    DECODE_SPLITS = [2]
    SKINNY_CONFIGS = [(8, 32, 4, 2)]
    SKINNY_MULTI_CONFIGS = [(8, 32, 4, 2)]
    SKINNY_ROWS = [1, 3]
    MOE_MODELS = {"smoke-moe": MoeModel("smoke-moe", 32, 16, 8, 2)}
    MOE_TOKENS = [1, 5, 40]
    MOE_GEMMS_FROM = 40
    attention_cases = lambda quick: [  # noqa: E731
        AttnCase("decode B=3", [(1, 40), (1, 7), (1, 33)]),
        AttnCase("prefill 2x24", [(24, 24)] * 2),
        AttnCase("chunked 9@40 + 2 dec", [(9, 40), (1, 20), (1, 3)]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = os.path.join(os.environ["OUT"], "kernel_bench.json") if os.environ.get("OUT") else "kernel_bench.json"
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--skip-small-ops", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-skinny", action="store_true", help="no batch-1 GEMV (skinny_gemm) sweep")
    parser.add_argument("--cold-l2", action="store_true",
                        help="the GEMV sweeps cycle through weight copies 4x the L2 cache (weights read from memory)")
    parser.add_argument("--skinny-fp8", action="store_true",
                        help="the skinny sweep with FP8 (e4m3) weights and row scales (bandwidth over 1 byte a weight)")
    parser.add_argument("--skinny-rows", default=None,
                        help="row counts of the GEMV sweep, comma-separated (default 1,2,4,8; at most "
                             f"{skinny_gemm.MAX_ROWS}); 1 is the batch-1 decode, 4 a verify step of 3 drafts")
    parser.add_argument("--skip-moe", action="store_true", help="no mixture-of-experts section")
    parser.add_argument("--moe-models", default=",".join(MOE_MODELS))
    parser.add_argument("--moe-tokens", default=None,
                        help="token counts of the MoE section, comma-separated (default 1,8,64,512,8192)")
    parser.add_argument("--smoke", action="store_true",
                        help="check the script on CPU with TRITON_INTERPRET=1 at toy shapes (numbers meaningless)")
    args = parser.parse_args()
    if args.smoke:
        _enter_smoke_mode()
    else:
        assert torch.cuda.is_available(), "kernel_bench needs a CUDA device"
    torch.manual_seed(0)
    t0 = time.time()

    rec = Recorder(copy_bandwidth_gbps())
    token_counts = [1, 256, 4096] if args.quick else [1, 32, 256, 2048, 8192]
    if args.smoke:
        token_counts = [1, 5]
    rows_list = [int(v) for v in args.skinny_rows.split(",")] if args.skinny_rows else SKINNY_ROWS
    if args.cold_l2:
        global COLD_L2
        COLD_L2 = True
    if args.skinny_fp8:
        global SKINNY_FP8, SKINNY_CONFIGS
        SKINNY_FP8, SKINNY_CONFIGS = True, SKINNY_FP8_CONFIGS
    best_rows: list[dict] = []
    skinny_rows: list[dict] = []
    qkv_rope_rows: list[dict] = []
    for name in ("smoke",) if args.smoke else args.models.split(","):
        m = MODELS[name]
        if not args.skip_small_ops:
            bench_small_ops(rec, m, token_counts)
        if not args.skip_skinny:
            skinny_rows += bench_skinny(rec, m, rows_list)
            qkv_rope_rows += bench_qkv_rope(rec, m, rows_list)
        if not args.skip_attention:
            best_rows += bench_attention(rec, m, args.quick)
    moe_rows: list[dict] = []
    if not args.skip_moe:
        moe_tokens = [int(v) for v in args.moe_tokens.split(",")] if args.moe_tokens else MOE_TOKENS
        for name in MOE_MODELS if args.smoke else args.moe_models.split(","):
            moe_rows += bench_moe(rec, MOE_MODELS[name], moe_tokens)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()  # the next model's experts

    cuda = DEVICE == "cuda"
    result = dict(
        device=torch.cuda.get_device_name() if cuda else "cpu (smoke)",
        sm_count=torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        torch=torch.__version__, triton=triton.__version__, dtype=str(DTYPE),
        copy_bandwidth_gbps=round(rec.copy_gbps, 1), seconds=round(time.time() - t0, 1), cold_l2=COLD_L2,
        results=rec.rows, attention_best=best_rows, skinny_linear=skinny_rows,
        skinny_layer=skinny_layer_totals(skinny_rows), qkv_rope=qkv_rope_rows, moe=moe_rows,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(rec, best_rows)
    if skinny_rows:
        print("\nlinear layers at M rows in a CUDA graph: op + cuBLAS (unfused) vs the fused GEMV "
              "(ms, % of copy bandwidth; x1: against one row's fused default)")
        for r in skinny_rows:
            print(f"  {r['model']:12s} {r['linear']:8s} M={r['rows']} unfused {r['unfused_chain_ms']:.4f} "
                  f"({r['unfused_pct_of_copy']}%)  fused best {r['best_config']:12s} {r['best_ms']:.4f} "
                  f"({r['best_pct_of_copy']}%)  default {r['default_config']} {r['default_ms']} "
                  f"({r['default_pct_of_copy']}%, x1 {r['default_vs_one_row']}, err {r['default_rel_err']})")
        for t in result["skinny_layer"]:
            print(f"  {t['model']:12s} layer    M={t['rows']} unfused {t['unfused_chain_ms']}  fused best {t['best_ms']}"
                  f"  default {t['default_ms']} (x1 {t['default_vs_one_row']})")
    for t in qkv_rope_rows:
        print(f"  {t['model']:12s} qkv+rope M={t['rows']} one kernel {t['fused_ms']}  GEMV + qkv_prep {t['separate_ms']}"
              f"  (err {t['rel_err']}{', e4m3 weights' if t['fp8'] else ''})")
        for c, v in t["sweep"].items():
            print(f"      {c:14s} {v['ms']:.4f} ms  {v['pct_of_copy']}% of copy  err {v['rel_err']}")
    if moe_rows:
        print("\nmixture of experts (ms, CUDA graphs): Triton at its path choice, each path forced, the same with "
              "e4m3 experts (fp8), torch._grouped_mm")
        for r in moe_rows:
            times = "  ".join(f"{name} {ms}" for name, ms in r.items() if name.startswith(("triton", "torch", "layer (")))
            print(f"  {r['model']:14s} T={r['tokens']:<5d} experts read {r['experts_read']:3d}  {times}")
            gemms = "  ".join(f"{name[5:]} {v}" for name, v in r.items() if name.startswith("gemm "))
            if gemms:
                print(f"  {'':14s} the GEMMs alone (ms): {gemms}")
    print(f"\nwrote {args.out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
