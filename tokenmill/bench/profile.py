"""Where the time goes: a torch-profiler trace of a window of engine steps, summarised per kernel.

The workload's requests are all added, the engine steps until `--skip-steps` steps have run (so the
window sits in the steady state, e.g. full-batch decode), then `--steps` steps run under
torch.profiler. The report gives, per kernel (on a CPU run: per torch op) and per kernel family (GEMM, attention, norm, ...),
the device time per step and its share, the device-busy fraction of the wall time, and, for every
distinct linear layer shape of the model, the weight-streaming bandwidth of that GEMM alone at the
window's batch size against the measured copy bandwidth (each GEMM's own roofline). A Chrome trace
(`.json.gz`) is written next to the JSON with `--trace`.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import sys
import time
from collections import defaultdict

from tokenmill.bench import report
from tokenmill.bench.common import build_engine, resolve_workload, synchronize
from tokenmill.bench.roofline import measure_ceilings
from tokenmill.bench.workloads import generate_requests

# Kernel family by name: first match wins (Triton kernels carry their Python function's name).
FAMILIES = [
    ("gemm", r"splitkreduce"),  # cuBLAS's split-K reduction, before "reduce" below catches it
    ("attention", r"attention|attn|flash|reduce_splits"),
    ("qkv-prep", r"qkv_prep"),  # q/k norm + rotary + KV write, fused
    ("kv-write", r"kv_cache|write_kv|reshape_and_cache"),
    ("norm", r"rms|norm"),
    ("rotary", r"rotary|rope"),
    ("activation", r"silu|act_and_mul|gelu"),
    ("sampling", r"gumbel|merge_chunks|sampl|top_?k|top_?p|min_p|penalt|logit_bias|logprob|argmax|temperature|softmax|sort"),
    ("input-prep", r"prepare|input_prep|post_update|staged|slot|gather_block|positions"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|sm90|splitk|matmul|cublas|aten::(mm|addmm|bmm|linear)$"),
    ("copy", r"memcpy|memset|copy|fill|cat|index|elementwise|vectorized|reduce"),
]


def kernel_family(name: str) -> str:
    low = name.lower()
    for family, pattern in FAMILIES:
        if re.search(pattern, low):
            return family
    return "other"


def _device_events(prof):
    """(name, start_us, duration_us) of every device-side event (kernels, memcpy, memset)."""
    out = []
    for ev in prof.events():
        dev_type = getattr(ev, "device_type", None)
        if dev_type is None or "CUDA" not in str(dev_type):
            continue
        start, end = ev.time_range.start, ev.time_range.end
        out.append((ev.name, float(start), float(end - start)))
    return out


def _cpu_op_events(prof):
    """Without a GPU: (name, start_us, self time_us) of the torch ops, the CPU's equivalent of kernels."""
    return [(ev.name, float(ev.time_range.start), float(ev.self_cpu_time_total)) for ev in prof.events()
            if ev.name.startswith("aten::") and ev.self_cpu_time_total > 0]


def summarize_kernels(events, steps: int, wall_s: float) -> dict:
    per_kernel = defaultdict(lambda: [0, 0.0])
    per_family = defaultdict(float)
    for name, _, dur in events:
        per_kernel[name][0] += 1
        per_kernel[name][1] += dur
        per_family[kernel_family(name)] += dur
    total_us = sum(d for _, _, d in events)
    # Busy time: the union of the event intervals (kernels of one stream do not overlap; the side
    # stream's copies may).
    busy_us, end = 0.0, -1.0
    for _, start, dur in sorted((e for e in events), key=lambda e: e[1]):
        stop = start + dur
        if stop <= end:
            continue
        busy_us += stop - max(start, end)
        end = stop
    kernels = sorted(({"name": n[:160], "family": kernel_family(n), "calls_per_step": c / steps,
                       "us_per_step": t / steps, "share_pct": 100 * t / total_us if total_us else 0.0,
                       "us_per_call": t / c if c else 0.0}
                      for n, (c, t) in per_kernel.items()), key=lambda k: -k["us_per_step"])
    wall_us = wall_s * 1e6
    return {
        "steps": steps, "wall_ms_per_step": wall_us / steps / 1e3,
        "device_ms_per_step": total_us / steps / 1e3, "busy_ms_per_step": busy_us / steps / 1e3,
        "device_busy_pct": 100 * busy_us / wall_us if wall_us else 0.0,
        "kernel_launches_per_step": sum(c for c, _ in per_kernel.values()) / steps,
        "families": {f: {"ms_per_step": t / steps / 1e3, "share_pct": 100 * t / total_us if total_us else 0.0}
                     for f, t in sorted(per_family.items(), key=lambda kv: -kv[1])},
        "kernels": kernels,
    }


def linear_rooflines(model, num_tokens: int, copy_bytes_per_s: float, device) -> list[dict]:
    """Each distinct linear weight shape alone at `num_tokens` rows: time, bytes, fraction of copy bandwidth."""
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    act_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() > 1)
    seen, rows = set(), []
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if w is None or w.dim() != 2 or not hasattr(mod, "in_features") or tuple(w.shape) in seen:
            continue
        seen.add(tuple(w.shape))
        x = torch.randn(num_tokens, w.shape[1], dtype=act_dtype, device=device)
        if w.element_size() == 1:  # FP8 weights: the layer's own matmul (quantization/fp8.py)
            fn = lambda: mod(x)  # noqa: E731
        else:
            fn = lambda: F.linear(x, w)  # noqa: E731
        ms = float(do_bench(fn, warmup=10, rep=50, return_mode="median"))
        nbytes = w.numel() * w.element_size() + (x.numel() + num_tokens * w.shape[0]) * x.element_size()
        flops = 2 * num_tokens * w.numel()
        rows.append({"layer": name, "shape": list(w.shape), "tokens": num_tokens, "us": ms * 1e3,
                     "gbps": nbytes / (ms * 1e-3) / 1e9, "copy_bw_pct": 100 * nbytes / (ms * 1e-3) / copy_bytes_per_s,
                     "tflops": flops / (ms * 1e-3) / 1e12})
    return rows


def run(args, log=None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tokenmill.loader.load import resolve_device
    from tokenmill.sampling_params import SamplingParams

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    w = resolve_workload(args, "offline-small")
    device = resolve_device(args.device)
    ceilings = measure_ceilings(device)
    engine = build_engine(args, w)
    requests = generate_requests(w, engine.loaded.arch.vocab_size)
    for r in requests:
        engine.add_request(None, SamplingParams(temperature=w.temperature, ignore_eos=True, max_tokens=r.max_tokens),
                           prompt_ids=r.prompt_token_ids)
    for _ in range(args.skip_steps):
        engine.step(emit_unfinished=False)
    engine.step_log = []
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step(emit_unfinished=False)
        synchronize(device)
        wall = time.perf_counter() - t0
    shapes, engine.step_log = engine.step_log, None
    batch_sizes = [len(s.query_lens) for s in shapes]
    new_tokens = [int(s.query_lens.sum()) for s in shapes]
    events = _device_events(prof) if device.type == "cuda" else _cpu_op_events(prof)
    summary = summarize_kernels(events, args.steps, wall)
    log(f"{args.steps} steps, batch {min(batch_sizes)}..{max(batch_sizes)}, {wall / args.steps * 1e3:.3f} ms/step wall, "
        f"{summary['busy_ms_per_step']:.3f} ms/step device busy ({summary['device_busy_pct']:.1f} %), "
        f"{summary['kernel_launches_per_step']:.0f} kernels/step")
    gemms = []
    if device.type == "cuda":
        tokens = max(1, round(sum(new_tokens) / len(new_tokens)))
        gemms = linear_rooflines(engine.loaded.model, tokens, ceilings.copy_bytes_per_s, device)
    trace = None
    if args.trace:
        os.makedirs(args.out, exist_ok=True)
        raw = os.path.join(args.out, "trace.tmp.json")
        prof.export_chrome_trace(raw)
        trace = os.path.join(args.out, report.result_stem("profile", w.name, args.tag) + ".trace.json.gz")
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
    result = report.metadata("profile")
    result.update({
        "tag": args.tag, "workload": w.to_dict(), "model": w.model, "device": str(device),
        "device_name": ceilings.device_name, "ceilings": ceilings.to_dict(),
        "window": {"skip_steps": args.skip_steps, "steps": args.steps, "batch_min": min(batch_sizes),
                   "batch_max": max(batch_sizes), "new_tokens_mean": sum(new_tokens) / len(new_tokens)},
        "summary": summary, "linear_rooflines": gemms, "trace": trace,
    })
    return result


def print_summary(result: dict, out=None) -> None:
    out = out or sys.stdout  # looked up per call (a test may have replaced it)
    s, win = result["summary"], result["window"]
    print(f"profile of {result['workload']['name']} on {result['device_name']}: steps {win['skip_steps']}.."
          f"{win['skip_steps'] + win['steps']} (batch {win['batch_min']}..{win['batch_max']}): "
          f"{s['wall_ms_per_step']:.3f} ms/step wall, {s['busy_ms_per_step']:.3f} ms/step device busy "
          f"({s['device_busy_pct']:.1f} %), {s['kernel_launches_per_step']:.0f} kernels/step", file=out)
    for fam, v in s["families"].items():
        print(f"  {fam:<11} {v['ms_per_step']:8.3f} ms/step  {v['share_pct']:5.1f} %", file=out)
    print("  top kernels (us/step, calls/step, us/call):", file=out)
    for k in s["kernels"][:25]:
        print(f"    {k['us_per_step']:9.1f} {k['calls_per_step']:6.1f} {k['us_per_call']:8.2f}  [{k['family']}] "
              f"{k['name'][:110]}", file=out)
    for g in result["linear_rooflines"]:
        print(f"  linear {g['layer']:<40} {str(g['shape']):<14} x{g['tokens']}: {g['us']:8.1f} us "
              f"{g['gbps']:7.0f} GB/s ({g['copy_bw_pct']:.1f} % of copy) {g['tflops']:.1f} TFLOP/s", file=out)

