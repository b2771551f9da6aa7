"""GPU micro-benchmarks of the FP8 kernels at Llama-3.1-8B's shapes: the decode-sized W8A8 matmul
(kernels/fp8_gemm.py) against torch._scaled_mm (cuBLAS, row-wise scales) and the bf16 F.linear of
the same shapes at decode batch sizes, over a sweep of tile configs; optionally the quantizing
prologues and decode attention over an e4m3 KV cache.

Each time is the median of the op replayed in a CUDA graph (as in the engine's decode graphs).
Bandwidth counts the weight bytes (the activations are small beside them); "% of copy" divides by
the copy bandwidth measured in the same run. Per row count, the four projections of one decoder
layer are summed for the engine's config, the best config per shape, cuBLAS FP8 and bf16.

    python benchmarks/fp8_kernel_bench.py [--out PATH] [--rows 16,64,112,128,256] [--no-sweep] [--prologues 112,8192]
        [--attention] [--prefill-attention]

--prologues: also the kernels that quantize the matmul's input (the SiLU-and-mul and the RMSNorm
writing e4m3 themselves, against the 16-bit kernel followed by the per-token
quantization) at those row counts, Llama-3.1-8B widths; bandwidth over the bytes read and written.

--attention: decode attention over a bf16 and an e4m3 cache (offline-8b's batch and context
lengths and two others) at several tile configs; bandwidth over the cache bytes read.

--prefill-attention: causal prefill attention (prefill-8b's step) at several tile configs.
--prefill-gemm ROWS: torch._scaled_mm at Llama-3.1-8B's projections, with and without fast accumulation.

--out defaults to $OUT/fp8_kernel_bench.json when $OUT is set, else ./fp8_kernel_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from tokenmill.kernels.activation import silu_and_mul_quant_fp8_triton, silu_and_mul_triton  # noqa: E402
from tokenmill.kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm_config, fp8_gemm_triton  # noqa: E402
from tokenmill.kernels.fp8_quant import quantize_per_token_fp8_triton  # noqa: E402
from tokenmill.kernels.norm import rms_norm_quant_fp8_triton, rms_norm_triton  # noqa: E402
from tokenmill.quantization.fp8 import quantize_activation_fp8, quantize_weight_fp8  # noqa: E402

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
SWEEP = [Fp8GemmConfig(bm, bn, bk, split, warps, stages)
         for bm, bn, bk, split, warps, stages in [
             (64, 64, 128, 1, 4, 4), (64, 64, 128, 2, 4, 4), (64, 64, 128, 4, 4, 4), (64, 128, 128, 1, 4, 4),
             (64, 128, 128, 2, 4, 4), (64, 32, 128, 1, 4, 4), (64, 32, 128, 2, 4, 5), (64, 64, 256, 1, 4, 3),
             (64, 64, 128, 2, 4, 6), (128, 64, 128, 1, 4, 4), (128, 64, 128, 2, 4, 4), (128, 128, 128, 1, 8, 4),
             (128, 128, 128, 2, 8, 4), (128, 32, 128, 2, 4, 4), (128, 64, 128, 2, 8, 4), (128, 64, 256, 2, 8, 3)]]


def label(c: Fp8GemmConfig) -> str:
    return f"m{c.block_m}n{c.block_n}k{c.block_k}s{c.split_k}w{c.num_warps}st{c.num_stages}"


def graph_ms(fn) -> float:
    return float(do_bench_cudagraph(fn, rep=20, return_mode="median"))


def bench_prologues(rows_list: list[int], copy_gbps: float, hidden: int = 4096, inter: int = 14336) -> list[dict]:
    """The SiLU-and-mul and the RMSNorm with the e4m3 quantization fused in, against the unfused pair."""
    dev = torch.device("cuda")
    out = []
    for m in rows_list:
        gate_up = torch.randn(m, 2 * inter, device=dev, dtype=torch.bfloat16)
        x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
        res = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
        nw = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
        silu_bytes = m * inter * 5  # [gate | up] in bf16 read, e4m3 written
        norm_bytes = m * hidden * 7  # x and the residual read, the residual and e4m3 written
        cases = [("silu unfused", silu_bytes, lambda: quantize_per_token_fp8_triton(silu_and_mul_triton(gate_up)))]
        cases.append(("silu fused", silu_bytes, lambda: silu_and_mul_quant_fp8_triton(gate_up)))
        cases.append(("norm unfused", norm_bytes, lambda: quantize_per_token_fp8_triton(rms_norm_triton(x, nw, 1e-5, res)[0])))
        cases.append(("norm fused", norm_bytes, lambda: rms_norm_quant_fp8_triton(x, nw, 1e-5, res)))
        for name, nbytes, fn in cases:
            ms = graph_ms(fn)
            pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbps
            out.append(dict(rows=m, kernel=name, us=round(ms * 1e3, 2), pct_of_copy=round(pct, 1)))
            print(f"rows {m:5d} {name:24s} {ms * 1e3:8.1f} us  {pct:5.1f} % of copy", flush=True)
    return out


# (block_m, block_n, num_warps, num_stages) of the decode attention sweep; None: attention_config's
ATTN_CONFIGS = [None, (16, 32, 4, 3), (16, 64, 4, 2), (16, 64, 4, 4), (16, 64, 8, 3), (16, 128, 4, 2), (16, 128, 4, 3),
                (16, 128, 8, 3), (16, 256, 8, 2), (16, 128, 8, 4)]
ATTN_CASES = [("offline-8b decode B=110 ctx~700", [128 + (i * 37) % 1150 for i in range(110)]),
              ("decode B=32 ctx=2k", [2048] * 32), ("decode B=8 ctx=4k", [4096] * 8)]


def bench_attention(copy_gbps: float, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                    page: int = 16) -> list[dict]:
    """Decode attention (one query a request) over a bf16 and an e4m3 cache, per tile config."""
    from tokenmill.kernels.attention import paged_attention_ref, paged_attention_triton

    dev = torch.device("cuda")
    out_rows = []
    for label_, seq_lens in ATTN_CASES:
        torch.manual_seed(0)
        pages = [(s + page - 1) // page for s in seq_lens]
        block_tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device=dev)
        perm = torch.randperm(sum(pages), device=dev).to(torch.int32)
        start = 0
        for b, n in enumerate(pages):
            block_tables[b, :n] = perm[start:start + n]
            start += n
        shape = (sum(pages), page, kv_heads, head_dim)
        k16 = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        v16 = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        q = torch.randn(len(seq_lens), heads, head_dim, device=dev, dtype=torch.bfloat16)
        qsl = torch.arange(len(seq_lens) + 1, device=dev, dtype=torch.int32)
        sl = torch.tensor(seq_lens, device=dev, dtype=torch.int32)
        kv_scale = torch.ones(2, device=dev)
        for cache in ("bf16", "fp8"):
            k, v = (k16, v16) if cache == "bf16" else (k16.to(torch.float8_e4m3fn), v16.to(torch.float8_e4m3fn))
            scale_arg = None if cache == "bf16" else kv_scale
            ref = paged_attention_ref(q, k, v, qsl, sl, block_tables, head_dim ** -0.5, kv_scale=scale_arg).float()
            nbytes = 2 * sum(seq_lens) * kv_heads * head_dim * k.element_size()
            out = torch.empty_like(q)
            for cfg in ATTN_CONFIGS:
                hints = {} if cfg is None else dict(zip(("block_m", "block_n", "num_warps", "num_stages"), cfg))
                fn = lambda: paged_attention_triton(q, k, v, qsl, sl, block_tables, head_dim ** -0.5, out=out,  # noqa: E731
                                                    kv_scale=scale_arg, max_query_len=1, max_seq_len=max(seq_lens),
                                                    **hints)
                name = "default" if cfg is None else "m{}n{}w{}s{}".format(*cfg)
                try:
                    fn()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    ms = graph_ms(fn)
                except Exception as e:
                    print(f"attention {label_} {cache} {name}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
                    continue
                pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbps
                out_rows.append(dict(case=label_, cache=cache, config=name, us=round(ms * 1e3, 2),
                                     pct_of_copy=round(pct, 1), rel_err=float(f"{err:.2e}")))
                print(f"attention {label_:34s} {cache:4s} {name:12s} {ms * 1e3:8.1f} us {pct:5.1f} % of copy "
                      f"err {err:.1e}", flush=True)
        del k16, v16
        torch.cuda.empty_cache()
    return out_rows


# (block_m, block_n, num_warps, num_stages) of the prefill attention sweep; None: attention_config's
PREFILL_CONFIGS = [None, (128, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 2), (256, 64, 8, 4), (256, 128, 8, 2),
                   (256, 128, 8, 3), (256, 64, 16, 3), (256, 128, 16, 2), (512, 64, 16, 3)]


def bench_prefill_attention(heads: int = 32, kv_heads: int = 8, head_dim: int = 128, page: int = 16,
                            prompts: int = 2, prompt_len: int = 4096) -> list[dict]:
    """Causal prefill attention over a bf16 cache (prefill-8b's step: 2 prompts of 4,096 tokens),
    per tile config; TFLOP/s over the visible (causal) scores, 4 flops a score a head dim."""
    from tokenmill.kernels.attention import paged_attention_triton

    dev = torch.device("cuda")
    torch.manual_seed(0)
    pages = (prompt_len + page - 1) // page
    block_tables = torch.randperm(prompts * pages, device=dev).to(torch.int32).view(prompts, pages)
    shape = (prompts * pages, page, kv_heads, head_dim)
    k = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    v = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    q = torch.randn(prompts * prompt_len, heads, head_dim, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(0, prompts + 1, device=dev, dtype=torch.int32) * prompt_len
    sl = torch.full((prompts,), prompt_len, device=dev, dtype=torch.int32)
    flops = 4 * prompts * prompt_len * (prompt_len + 1) / 2 * heads * head_dim
    out = torch.empty_like(q)
    base = None
    rows = []
    for cfg in PREFILL_CONFIGS:
        hints = {} if cfg is None else dict(zip(("block_m", "block_n", "num_warps", "num_stages"), cfg))
        fn = lambda: paged_attention_triton(q, k, v, qsl, sl, block_tables, head_dim ** -0.5, out=out,  # noqa: E731
                                            max_query_len=prompt_len, max_seq_len=prompt_len, **hints)
        name = "default" if cfg is None else "m{}n{}w{}s{}".format(*cfg)
        try:
            fn()
            got = out.float().clone()
            ms = float(do_bench(fn, rep=50, return_mode="median"))
        except Exception as e:
            print(f"prefill attention {name}: {type(e).__name__}: {str(e)[:160]}", file=sys.stderr)
            continue
        if base is None:
            base = got
        diff = (got - base).abs().max().item()
        tflops = flops / (ms * 1e-3) / 1e12
        rows.append(dict(case=f"prefill {prompts} x {prompt_len}", config=name, us=round(ms * 1e3, 1),
                         tflops=round(tflops, 1), max_abs_diff_vs_default=float(f"{diff:.2e}")))
        print(f"prefill attention {name:12s} {ms * 1e3:9.1f} us {tflops:6.1f} TFLOP/s diff {diff:.1e}", flush=True)
    return rows


def bench_prefill_gemm(rows: int) -> list[dict]:
    """torch._scaled_mm (row-wise scales) at prefill sizes, with cuBLAS's default accumulation
    (promoted to fp32 along K) and with use_fast_accum; error against a float64 product."""
    dev = torch.device("cuda")
    out = []
    for name, n, k in SHAPES:
        torch.manual_seed(n + k)
        w_q, w_s = quantize_weight_fp8(torch.randn(n, k, device=dev) / k ** 0.5)
        x_q, x_s = quantize_activation_fp8(torch.randn(rows, k, device=dev, dtype=torch.bfloat16))
        ref = (x_q.double() * x_s.double()) @ (w_q.double() * w_s.double()[:, None]).t()
        for fast in (False, True):
            fn = lambda fast=fast: torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=w_s[None, :],  # noqa: E731
                                                    out_dtype=torch.bfloat16, use_fast_accum=fast)
            err = ((fn().double() - ref).norm() / ref.norm()).item()
            ms = float(do_bench(fn, rep=100, return_mode="median"))
            tflops = 2 * rows * n * k / (ms * 1e-3) / 1e12
            out.append(dict(rows=rows, linear=name, fast_accum=fast, us=round(ms * 1e3, 1), tflops=round(tflops, 1),
                            rel_err=float(f"{err:.2e}")))
            print(f"scaled_mm M={rows} {name:8s} fast_accum={fast!s:5s} {ms * 1e3:8.1f} us {tflops:7.1f} TFLOP/s "
                  f"err {err:.2e}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_kernel_bench.json"))
    ap.add_argument("--rows", default="16,64,112,128,256")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false",
                    help="only the engine's config (and cuBLAS, bf16) per shape")
    ap.add_argument("--attention", action="store_true", help="also decode attention over bf16 and e4m3 caches")
    ap.add_argument("--prefill-attention", action="store_true", help="also causal prefill attention's tile configs")
    ap.add_argument("--prefill-gemm", type=int, default=0, help="rows for _scaled_mm with and without fast accumulation")
    ap.add_argument("--prologues", default="", help="row counts for the quantizing prologue kernels (none by default)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3) / 1e9
    prologues = bench_prologues([int(r) for r in args.prologues.split(",")], copy_gbps) if args.prologues else []
    attention_rows = bench_attention(copy_gbps) if args.attention else []
    prefill_rows = bench_prefill_attention() if args.prefill_attention else []
    prefill_gemm = bench_prefill_gemm(args.prefill_gemm) if args.prefill_gemm else []
    rows_list = [int(r) for r in args.rows.split(",") if r]
    results, summary = [], []
    for m in rows_list:
        layer = dict(engine=0.0, best=0.0, cublas_fp8=0.0, bf16=0.0)
        nbytes_layer = 0
        for name, n, k in SHAPES:
            torch.manual_seed(n + k + m)
            w = torch.randn(n, k, device=dev) / k ** 0.5
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w_q, w_s = quantize_weight_fp8(w)
            x_q, x_s = quantize_activation_fp8(x)
            w16 = w.to(torch.bfloat16)
            ref = (x_q.float() * x_s) @ (w_q.float() * w_s[:, None]).t()
            times = {}
            times["cublas_fp8"] = graph_ms(lambda: torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=w_s[None, :],
                                                                    out_dtype=torch.bfloat16))
            times["bf16"] = graph_ms(lambda: F.linear(x, w16))
            engine_cfg = fp8_gemm_config(m, n, k)  # None: the engine takes cuBLAS at this shape
            configs = ([engine_cfg] if engine_cfg else []) + [c for c in SWEEP if c != engine_cfg and args.sweep]
            sweep = {}
            for cfg in configs:
                try:
                    out = fp8_gemm_triton(x_q, x_s, w_q, w_s, torch.bfloat16, config=cfg)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    ms = graph_ms(lambda cfg=cfg: fp8_gemm_triton(x_q, x_s, w_q, w_s, torch.bfloat16, config=cfg))
                except Exception as e:  # e.g. out of shared memory
                    print(f"{name} M={m} {label(cfg)}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                    continue
                sweep[label(cfg)] = dict(ms=ms, rel_err=float(f"{err:.2e}"))
            if not sweep:  # the engine takes cuBLAS here and nothing was swept
                sweep["cublas"] = dict(ms=times["cublas_fp8"], rel_err=None)
            best_label = min(sweep, key=lambda lb: sweep[lb]["ms"])
            pct = lambda ms: round(100 * n * k / (ms * 1e-3) / 1e9 / copy_gbps, 1)  # noqa: E731
            engine_ms = sweep[label(engine_cfg)]["ms"] if engine_cfg else times["cublas_fp8"]
            row = dict(rows=m, linear=name, n=n, k=k, engine_config=label(engine_cfg) if engine_cfg else "cublas",
                       engine_ms=round(engine_ms, 5), best_config=best_label,
                       best_ms=round(sweep[best_label]["ms"], 5), cublas_fp8_ms=round(times["cublas_fp8"], 5),
                       bf16_ms=round(times["bf16"], 5), engine_pct_of_copy=pct(engine_ms),
                       best_pct_of_copy=pct(sweep[best_label]["ms"]), cublas_fp8_pct_of_copy=pct(times["cublas_fp8"]),
                       sweep=sweep)
            results.append(row)
            print(f"M={m:4d} {name:8s} engine {row['engine_ms'] * 1e3:7.1f} us ({row['engine_pct_of_copy']:5.1f} %) "
                  f"{row['engine_config']:22s} best {row['best_ms'] * 1e3:7.1f} us {best_label:22s} "
                  f"cublas-fp8 {row['cublas_fp8_ms'] * 1e3:7.1f} us bf16 {row['bf16_ms'] * 1e3:7.1f} us", flush=True)
            layer["engine"] += row["engine_ms"]
            layer["best"] += row["best_ms"]
            layer["cublas_fp8"] += row["cublas_fp8_ms"]
            layer["bf16"] += row["bf16_ms"]
            nbytes_layer += n * k
        summary.append(dict(rows=m, **{f"{key}_layer_ms": round(v, 5) for key, v in layer.items()},
                            engine_layer_pct_of_copy=round(100 * nbytes_layer / (layer["engine"] * 1e-3) / 1e9
                                                           / copy_gbps, 1),
                            engine_vs_cublas_fp8=round(layer["cublas_fp8"] / layer["engine"], 3)))
        print(f"M={m:4d} layer: engine {layer['engine'] * 1e3:.1f} us, best {layer['best'] * 1e3:.1f} us, "
              f"cublas-fp8 {layer['cublas_fp8'] * 1e3:.1f} us, bf16 {layer['bf16'] * 1e3:.1f} us", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(dev), copy_gbps=round(copy_gbps, 1), summary=summary, results=results,
                       prologues=prologues,
                       attention=attention_rows, prefill_attention=prefill_rows,
                       prefill_gemm=prefill_gemm), f, indent=1)
    print(f"copy {copy_gbps:.0f} GB/s; wrote {args.out}")


if __name__ == "__main__":
    main()
