"""Offline throughput: the workload through `LLM.generate`, timed, with the roofline report.

Order: measure the ceilings (before the engine takes the device's memory), build the engine, warm
up (a few requests of the workload's shape with other token ids, so Triton compiles and CUDA
graphs are captured outside the timed region), then for each repeat: forget the prefix cache (a
repeat must not reuse the previous run's prompts), set `engine.step_log = []`, time
`llm.generate(...)` between device synchronisations. With `--compare transformers` tokenmill is
freed afterwards and the same requests run through transformers' continuous batching.
"""

from __future__ import annotations

import statistics
import sys
import time

from tokenmill.bench import report
from tokenmill.bench.common import (build_engine, format_spec, free_device_memory, median_index, reset_prefix_cache,
                                    resolve_workload, spec_snapshot, spec_summary, synchronize)
from tokenmill.bench.roofline import (dense_bytes_of, format_roofline, kv_dtype_bytes_of, run_ceilings, run_roofline,
                                      step_kind)
from tokenmill.bench.step_timer import StepKinds, StepTimer
from tokenmill.bench.lora import spread, synthetic_adapters
from tokenmill.bench.workloads import generate_requests, summarize, warmup_requests


def _params(requests, temperature: float):
    from tokenmill.sampling_params import SamplingParams

    return [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=r.max_tokens) for r in requests]


def _per_step_points(step_log, seconds, kinds=None) -> list[list]:
    """[batch entries, new tokens, seconds (host-timed), kind] per step (for the batch-size plot)."""
    kinds = kinds if kinds is not None and len(kinds) == len(step_log) else [step_kind(s) for s in step_log]
    return [[int(len(s.query_lens)), int(s.query_lens.sum()), round(float(t), 7), kind]
            for s, t, kind in zip(step_log, seconds, kinds)]


def _run_tokenmill(args, w, log) -> dict:
    from tokenmill.entrypoints.llm import LLM

    engine = build_engine(args, w)
    llm = LLM.from_engine(engine)
    loaded = engine.loaded
    device, arch = loaded.device, loaded.arch
    dtype_bytes = loaded.dtype.itemsize
    requests = generate_requests(w, arch.vocab_size)
    expected = summarize(requests)
    if w.expected_output_tokens is not None and expected["output_tokens"] != w.expected_output_tokens:
        raise AssertionError(f"workload {w.name}: {expected['output_tokens']} output tokens requested, "
                             f"{w.expected_output_tokens} expected")
    prompts = [r.prompt_token_ids for r in requests]
    params = _params(requests, w.temperature)
    adapters = synthetic_adapters(args, arch)  # --num-loras: spread evenly over the requests
    loras = spread(adapters, len(requests))
    warm = warmup_requests(w, arch.vocab_size, count=args.warmup_requests) if args.warmup_requests > 0 else []
    started = time.perf_counter()
    if warm:
        llm.generate([r.prompt_token_ids for r in warm], _params(warm, w.temperature), use_tqdm=False,
                     lora_request=spread(adapters, len(warm)))
    synchronize(device)
    warmup_s = time.perf_counter() - started
    log(f"engine ready ({loaded.load_seconds:.1f} s load, {warmup_s:.1f} s warm-up of {len(warm)} requests)")
    runs = []
    for i in range(args.repeat):
        reset_prefix_cache(engine)
        engine.step_log = []
        spec_before = spec_snapshot(engine)
        timer = StepTimer(engine).install()
        step_kinds = StepKinds(engine).install()
        synchronize(device)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        synchronize(device)
        elapsed = time.perf_counter() - t0
        timer.uninstall()
        kinds = step_kinds.uninstall()
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        step_log, seconds = engine.step_log, timer.step_seconds()
        engine.step_log = None
        roof = run_roofline(step_log, arch, dtype_bytes, args.ceilings, elapsed, seconds, kinds,
                            dense_bytes_of(engine.config), kv_dtype_bytes_of(engine.config))
        stats = engine.stats()
        spec = spec_summary(spec_snapshot(engine).since(spec_before)) if spec_before is not None else None
        run = {"elapsed_s": elapsed, "output_tokens": out_tokens, "prompt_tokens": expected["prompt_tokens"],
               "output_tok_per_s": out_tokens / elapsed,
               "total_tok_per_s": (out_tokens + expected["prompt_tokens"]) / elapsed,
               "requests_per_s": len(requests) / elapsed, "num_steps": len(step_log),
               "num_preemptions": stats.num_preemptions, "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
               "roofline": roof, "speculative": spec,
               "kv_offload": engine.snapshot().kv_offload,  # the host tier's counters so far (with --kv-offloading-size)
               "per_step": _per_step_points(step_log, seconds, kinds) if args.keep_steps else None}
        runs.append(run)
        log(f"run {i + 1}/{args.repeat}: {run['output_tok_per_s']:.0f} output tok/s, "
            f"{run['total_tok_per_s']:.0f} total tok/s, {len(requests) / elapsed:.2f} req/s, {elapsed:.2f} s, "
            f"{out_tokens} output tokens, {len(step_log)} steps, roofline {roof['roofline_pct']:.1f}%"
            + (f"; {format_spec(spec)}" if spec else ""))
        if out_tokens != expected["output_tokens"]:
            log(f"WARNING: {out_tokens} output tokens generated, {expected['output_tokens']} requested")
    engine_info = {"num_kv_blocks": engine.kv.num_blocks, "block_size": engine.config.block_size,
                   "max_model_len": engine.max_model_len, "config": vars(engine.config).copy(),
                   "arch": {"architecture": arch.architecture, "num_parameters": arch.num_parameters(),
                            "layers": arch.num_layers, "hidden": arch.hidden_size, "heads": arch.num_heads,
                            "kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "vocab": arch.vocab_size,
                            "tied_embeddings": arch.tie_word_embeddings,
                            "num_active_parameters": arch.num_active_parameters()},
                   "load_s": loaded.load_seconds, "warmup_s": warmup_s,
                   "loras": {"count": len(adapters), "rank": args.lora_rank} if adapters else None}
    return {"device": str(device), "dtype": str(loaded.dtype).replace("torch.", ""), "requests": requests,
            "warmup": warm, "runs": runs, "engine": engine_info, "workload_tokens": expected}


def run(args, log=None) -> dict:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    w = resolve_workload(args, "offline-small")
    import torch

    from tokenmill.loader.load import resolve_device

    device = resolve_device(args.device)
    log(f"workload {w.name}: {w.num_requests} requests, prompts {w.input_len}, outputs {w.output_len}, "
        f"model {w.model} ({w.load_format}, {w.dtype}) on {device}")
    ceilings = run_ceilings(device, args)
    args.ceilings = ceilings
    log(f"ceilings{f' of {ceilings.gpus} GPUs' if ceilings.gpus > 1 else ''}: copy {ceilings.copy_bytes_per_s / 1e9:.1f} GB/s, matmul "
        f"{ceilings.matmul_flops_per_s / 1e12:.2f} TFLOP/s ({ceilings.method})")
    tm = _run_tokenmill(args, w, log)
    runs = tm["runs"]
    mid = median_index([r["elapsed_s"] for r in runs])
    med = runs[mid]
    for i, r in enumerate(runs):  # per-step points of the median run only (they feed the plots)
        if i != mid:
            r["per_step"] = None
    result = report.metadata("throughput")
    result.update({
        "tag": args.tag, "workload": w.to_dict(), "model": w.model, "dtype": tm["dtype"],
        "device": tm["device"], "device_name": ceilings.device_name, "ceilings": ceilings.to_dict(),
        "engine": tm["engine"], "workload_tokens": tm["workload_tokens"], "repeat": args.repeat,
        "results": {"runs": runs, "median_run": mid,
                    "output_tok_per_s_median": statistics.median(r["output_tok_per_s"] for r in runs),
                    "output_tok_per_s_all": [r["output_tok_per_s"] for r in runs]},
        "roofline": med["roofline"], "speculative": med["speculative"],
    })
    summary = {"output_tok_per_s": med["output_tok_per_s"],  # the median run (by elapsed time)
               "total_tok_per_s": med["total_tok_per_s"], "requests_per_s": med["requests_per_s"],
               "elapsed_s": med["elapsed_s"], "output_tokens": med["output_tokens"], "num_steps": med["num_steps"],
               "roofline_pct": med["roofline"]["roofline_pct"], "roofline_pct_spec": med["roofline"]["roofline_pct_spec"],
               "peer_ratio": None, "speculative": med["speculative"]}
    result["summary"] = summary  # print_summary shows it, with the roofline, once
    if args.compare:
        requests, warm = tm["requests"], tm["warmup"]
        del tm
        left = free_device_memory(device)
        if left is not None:
            log(f"tokenmill freed; {left / 2**20:.0f} MiB still allocated on the device")
        from tokenmill.bench.hf_peer import run_hf_peer

        dtype = getattr(torch, result["dtype"])
        log(f"running transformers continuous batching on the same {len(requests)} requests ...")
        peer = run_hf_peer(w.model, requests, warm[:2], device, dtype, temperature=w.temperature,
                           repeat=args.compare_repeat, attn_implementation=args.hf_attn,
                           cb_overrides={"num_blocks": args.hf_num_blocks,
                                         "max_batch_tokens": args.hf_max_batch_tokens},
                           seed=int(result["engine"]["config"].get("seed") or 0))
        peer["ratio"] = summary["output_tok_per_s"] / peer["output_tok_per_s"]
        result["peer"] = peer
        summary["peer_output_tok_per_s"] = peer["output_tok_per_s"]
        summary["peer_ratio"] = peer["ratio"]
        log(f"{peer['peer']} ({peer['attn_implementation']}): {peer['output_tok_per_s']:.0f} output tok/s; "
            f"tokenmill / transformers = {peer['ratio']:.2f}x")
    return result


def print_summary(result: dict, out=None) -> None:
    out = out or sys.stdout  # looked up per call (a test may have replaced it)
    s = result["summary"]
    w = result["workload"]
    print(f"{w['name']} on {result['device_name']} ({result['dtype']}): {s['output_tok_per_s']:.0f} output tok/s "
          f"(median run of {result['repeat']}), {s['total_tok_per_s']:.0f} total tok/s, {s['requests_per_s']:.2f} req/s, "
          f"{s['elapsed_s']:.2f} s, {s['output_tokens']} output tokens, {s['num_steps']} steps", file=out)
    if s.get("speculative"):
        print(format_spec(s["speculative"]), file=out)
    print(format_roofline(result["roofline"]), file=out)
    if s.get("peer_ratio") is not None:
        print(f"transformers: {s['peer_output_tok_per_s']:.0f} output tok/s -> ratio tokenmill / transformers "
              f"{s['peer_ratio']:.2f}", file=out)
