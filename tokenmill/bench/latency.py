"""Batch-1 latency: one request (latency-8b: 128 prompt tokens, 256 output tokens), timed per token.

We drive the engine loop directly and timestamp every step's output: the first token's time
gives TTFT (prefill + first sample), the gaps between later tokens the decode time per output
token (TPOT = (t_last - t_first) / (n - 1), n counting the tokens emitted, not the steps). The
decode time per engine step is the same span over the decode steps that emitted tokens
(`decode_step_ms`); without speculation every step emits one token and it equals TPOT; with
speculation a verify step emits 1 + its accepted drafts (`tokens_per_decode_step`), so comparing
`decode_step_ms` of two runs, with and without speculation, gives the cost of a verify step against
a one-token decode step. The tokens of one step arrive together, so `itl_ms` then holds zeros.

The bandwidth fraction is the decode bytes per token (weights, of a mixture of experts only the
experts a step selects, + KV read and written, summed over the decode steps, over the tokens they
emitted) over TPOT, against the measured copy bandwidth; the
roofline % over all steps is reported as for throughput. With speculation the result's `speculative`
(and each run's) holds the acceptance figures of the timed request (bench/common.py: spec_summary).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from tokenmill.bench import report
from tokenmill.bench.common import (build_engine, format_spec, median_index, reset_prefix_cache, resolve_workload,
                                    spec_snapshot, spec_summary, synchronize)
from tokenmill.bench.roofline import (dense_bytes_of, format_roofline, kv_bytes_per_token, kv_dtype_bytes_of,
                                      run_ceilings, run_roofline, step_floor)
from tokenmill.bench.step_timer import StepKinds
from tokenmill.bench.lora import synthetic_adapters
from tokenmill.bench.workloads import generate_requests, warmup_requests


def time_one_request(engine, prompt_ids: list[int], params, lora_request=None) -> tuple[float, list[float], list[float]]:
    """(start time, arrival time of each output token, arrival time of each step output that brought
    new tokens) for one request run alone (with lora_request's adapter if given)."""
    synchronize(engine.loaded.device)
    start = time.perf_counter()
    request_id = engine.add_request(None, params, prompt_ids=prompt_ids, lora_request=lora_request)
    times: list[float] = []
    arrivals: list[float] = []
    finished = False
    while not finished or engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n > len(times):
                arrivals.append(now)
                times.extend([now] * (n - len(times)))
            finished = finished or out.finished
    return start, times, arrivals


def run(args, log=None) -> dict:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    from tokenmill.loader.load import resolve_device
    from tokenmill.sampling_params import SamplingParams

    w = resolve_workload(args, "latency-8b")
    device = resolve_device(args.device)
    if w.num_requests != 1:
        log(f"latency runs one request; using the first of the {w.num_requests} of {w.name}")
    ceilings = run_ceilings(device, args)
    log(f"ceilings{f' of {ceilings.gpus} GPUs' if ceilings.gpus > 1 else ''}: copy {ceilings.copy_bytes_per_s / 1e9:.1f} GB/s, matmul "
        f"{ceilings.matmul_flops_per_s / 1e12:.2f} TFLOP/s")
    engine = build_engine(args, w)
    arch, dtype_bytes = engine.loaded.arch, engine.loaded.dtype.itemsize
    dense_bytes, kv_bytes = dense_bytes_of(engine.config), kv_dtype_bytes_of(engine.config)
    req = generate_requests(w, arch.vocab_size)[0]
    params = SamplingParams(temperature=w.temperature, ignore_eos=True, max_tokens=req.max_tokens)
    adapters = synthetic_adapters(args, arch)  # --num-loras: the request runs with the first
    lora = adapters[0] if adapters else None
    for warm in warmup_requests(w, arch.vocab_size, count=max(1, min(args.warmup_requests, 2)),
                                max_tokens=req.max_tokens):  # full length: every decode shape compiled
        time_one_request(engine, warm.prompt_token_ids,
                         SamplingParams(temperature=w.temperature, ignore_eos=True, max_tokens=warm.max_tokens), lora)
    kv_tok = kv_bytes_per_token(arch, kv_bytes or dtype_bytes)
    runs = []
    for i in range(args.repeat):
        reset_prefix_cache(engine)
        engine.step_log = []
        spec_before = spec_snapshot(engine)
        step_kinds = StepKinds(engine).install()
        start, times, arrivals = time_one_request(engine, req.prompt_token_ids, params, lora)
        kinds = step_kinds.uninstall()
        steps, engine.step_log = engine.step_log, None
        spec = spec_summary(spec_snapshot(engine).since(spec_before)) if spec_before is not None else None
        elapsed = times[-1] - start
        n = len(times)
        ttft = times[0] - start
        tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else float("nan")  # per token emitted
        # per decode step that emitted tokens (a verify step emits 1 + its accepted drafts)
        decode_emits = len(arrivals) - 1
        step_s = (arrivals[-1] - arrivals[0]) / decode_emits if decode_emits > 0 else float("nan")
        # Decode steps as the scheduler saw them: a verify step's entry holds the last token and its
        # drafts, so counting one-token steps would miss it.
        decode = [s for s, kind in zip(steps, kinds) if kind == "decode"]
        # bytes per decode token: weights + KV read (+ written), from the as-run floor of each decode
        # step, over the tokens those steps emitted (every token after the first)
        dec_bytes = [step_floor(s, arch, dtype_bytes, ceilings, "as-run", dense_bytes, kv_bytes).bytes for s in decode]
        dec_bytes_spec = [step_floor(s, arch, dtype_bytes, ceilings, "spec", dense_bytes, kv_bytes).bytes
                          for s in decode]
        mean_bytes = float(np.sum(dec_bytes)) / (n - 1) if dec_bytes and n > 1 else float("nan")
        mean_bytes_spec = float(np.sum(dec_bytes_spec)) / (n - 1) if dec_bytes_spec and n > 1 else float("nan")
        bw = mean_bytes / tpot / ceilings.copy_bytes_per_s if n > 1 else float("nan")
        bw_spec = mean_bytes_spec / tpot / ceilings.copy_bytes_per_s if n > 1 else float("nan")
        itl = np.diff(np.asarray(times)) if n > 1 else np.zeros(0)
        roof = run_roofline(steps, arch, dtype_bytes, ceilings, elapsed, kinds=kinds, dense_bytes=dense_bytes,
                            kv_dtype_bytes=kv_bytes)
        run_ = {"elapsed_s": elapsed, "output_tokens": n, "ttft_ms": 1e3 * ttft, "tpot_ms": 1e3 * tpot,
                "decode_tok_per_s": 1.0 / tpot if n > 1 else None, "tok_per_s": n / elapsed,
                "decode_step_ms": 1e3 * step_s, "decode_steps": len(decode),
                "tokens_per_decode_step": (n - 1) / decode_emits if decode_emits > 0 else None,
                "bytes_per_decode_token": mean_bytes,
                "bytes_per_decode_step": float(np.mean(dec_bytes)) if dec_bytes else None,
                "bandwidth_pct": 100 * bw, "bandwidth_pct_spec": 100 * bw_spec,
                "kv_bytes_per_token": kv_tok, "itl_ms": (1e3 * itl).round(4).tolist(),
                "itl_ms_p50": float(np.percentile(1e3 * itl, 50)) if itl.size else None,
                "itl_ms_p99": float(np.percentile(1e3 * itl, 99)) if itl.size else None,
                "num_steps": len(steps), "roofline": roof, "speculative": spec}
        runs.append(run_)
        log(f"run {i + 1}/{args.repeat}: TTFT {run_['ttft_ms']:.2f} ms, TPOT {run_['tpot_ms']:.3f} ms "
            f"({run_['decode_tok_per_s']:.1f} tok/s), {run_['decode_step_ms']:.3f} ms per decode step, "
            f"bandwidth {run_['bandwidth_pct']:.1f}% of copy, roofline {roof['roofline_pct']:.1f}%"
            + (f"; {format_spec(spec)}" if spec else ""))
    mid = median_index([r["tpot_ms"] for r in runs])
    med = runs[mid]
    for j, r in enumerate(runs):
        if j != mid:
            r["itl_ms"] = None
    result = report.metadata("latency")
    result.update({
        "tag": args.tag, "workload": w.to_dict(), "model": w.model,
        "dtype": str(engine.loaded.dtype).replace("torch.", ""), "device": str(device),
        "device_name": ceilings.device_name, "ceilings": ceilings.to_dict(), "repeat": args.repeat,
        "engine": {"config": vars(engine.config).copy(), "num_parameters": arch.num_parameters(),
                   "num_active_parameters": arch.num_active_parameters(),
                   "loras": {"count": len(adapters), "rank": args.lora_rank} if adapters else None},
        "results": {"runs": runs, "median_run": mid,
                    "tpot_ms_median": statistics.median(r["tpot_ms"] for r in runs),
                    "ttft_ms_median": statistics.median(r["ttft_ms"] for r in runs)},
        "roofline": med["roofline"],
        "speculative": med["speculative"],
        "summary": {"tpot_ms": med["tpot_ms"], "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
                    "decode_tok_per_s": med["decode_tok_per_s"], "decode_step_ms": med["decode_step_ms"],
                    "tokens_per_decode_step": med["tokens_per_decode_step"], "decode_steps": med["decode_steps"],
                    "bandwidth_pct": med["bandwidth_pct"],
                    "bandwidth_pct_spec": med["bandwidth_pct_spec"], "roofline_pct": med["roofline"]["roofline_pct"],
                    "output_tokens": med["output_tokens"], "speculative": med["speculative"]},
    })
    return result


def print_summary(result: dict, out=None) -> None:
    out = out or sys.stdout  # looked up per call (a test may have replaced it)
    s = result["summary"]
    step = s.get("decode_step_ms")
    per_step = "" if step is None else (f", {step:.3f} ms per decode step "
                                        f"({s.get('tokens_per_decode_step') or 0:.2f} tokens per step)")
    print(f"{result['workload']['name']} on {result['device_name']} ({result['dtype']}): TPOT {s['tpot_ms']:.3f} ms "
          f"per output token ({s['decode_tok_per_s']:.1f} tok/s decode, median of {result['repeat']}){per_step}, "
          f"TTFT {s['ttft_ms']:.2f} ms, decode bandwidth {s['bandwidth_pct']:.1f}% of the measured copy bandwidth "
          f"(spec formula {s['bandwidth_pct_spec']:.1f}%)", file=out)
    if s.get("speculative"):
        print(format_spec(s["speculative"]), file=out)
    print(format_roofline(result["roofline"]), file=out)
