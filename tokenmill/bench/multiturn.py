"""Multi-turn chat: conversations that resend their growing history (workloads multiturn-*).

Every conversation is open from the start; at most `--concurrency` turns are in flight at once,
taken from a queue of ready conversations, and a conversation whose answer is complete goes to the
back of that queue with its next turn (a closed loop: as users who read, then type, while others are
served; driven through the engine's own step loop in process). A conversation thus returns after
the other conversations' turns, by when a small GPU cache has evicted its history. A turn's prompt
repeats everything before it, so what the prefix caches keep decides its TTFT: with a GPU KV cache
smaller than the conversations' working set (`--working-set-ratio R` sizes num_kv_blocks to 1/R of
it), a returning conversation finds its history on the GPU only if nothing evicted it, and on the
host tier (`--kv-offloading-size`) otherwise. Reports TTFT (p50/p90/p99, over all turns and over the
returning turns 2..T), throughput, the prefix-cache hit rate and the host tier's counters.

TTFT is the engine's own: from add_request to the output processor seeing the first token.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque

import numpy as np

from tokenmill.bench import report
from tokenmill.bench.common import build_engine, reset_prefix_cache, resolve_workload, synchronize
from tokenmill.bench.workloads import generate_conversations, warmup_requests
from tokenmill.models.presets import PRESETS


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    a = np.asarray(values) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def working_set_tokens(conversations) -> int:
    """Tokens of KV the conversations leave behind at their ends (each one's last prompt + answer)."""
    return sum(len(c[-1].prompt_token_ids) + c[-1].max_tokens for c in conversations)


def run_conversations(engine, conversations, concurrency: int, temperature: float) -> dict:
    """Drive the conversations through the engine; per turn (conversation, turn, TTFT s, latency s)."""
    from tokenmill.sampling_params import SamplingParams

    ready = deque(range(len(conversations)))  # conversations whose next turn may be sent
    next_turn = [0] * len(conversations)
    owner: dict[str, int] = {}
    turns, out_tokens = [], 0

    def submit(c: int) -> None:
        turn = conversations[c][next_turn[c]]
        params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=turn.max_tokens)
        owner[engine.add_request(None, params, prompt_ids=turn.prompt_token_ids)] = c

    for _ in range(min(concurrency, len(ready))):
        submit(ready.popleft())
    while engine.has_unfinished_requests():
        for out in engine.step(emit_unfinished=False):
            c = owner.pop(out.request_id)
            m = out.metrics
            turns.append((c, next_turn[c], m.first_token_time - m.arrival_time, m.finished_time - m.arrival_time,
                          m.num_cached_prompt_tokens, m.num_host_cached_prompt_tokens))
            out_tokens += len(out.outputs[0].token_ids)
            next_turn[c] += 1
            if next_turn[c] < len(conversations[c]):
                ready.append(c)  # its user answers after the others' turns
            if ready:
                submit(ready.popleft())
    return {"turns": turns, "output_tokens": out_tokens}


def run(args, log=None) -> dict:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    w = resolve_workload(args, "multiturn-8b")
    if w.turns < 2:
        raise SystemExit(f"workload {w.name} is not a multi-turn one (turns = {w.turns})")
    concurrency = args.concurrency or w.concurrency or 1
    vocab = PRESETS.get(w.model.lower(), {}).get("vocab_size")
    conversations = generate_conversations(w, vocab)
    ws = working_set_tokens(conversations)
    if args.working_set_ratio is not None:
        # The GPU KV cache holds 1/R of the working set (at least what the conversations in flight need).
        longest = max(len(c[-1].prompt_token_ids) + c[-1].max_tokens for c in conversations)
        need = concurrency * math.ceil(longest / args.block_size) + 1
        args.num_kv_blocks = max(math.ceil(ws / args.working_set_ratio / args.block_size), need)
    engine = build_engine(args, w)
    device = engine.loaded.device
    capacity = engine.kv.num_blocks * engine.config.block_size
    log(f"workload {w.name}: {len(conversations)} conversations x {w.turns} turns, {concurrency} in flight; "
        f"working set {ws} tokens = {ws / capacity:.2f}x the GPU KV cache ({capacity} tokens)"
        + (f", host tier {engine.config.kv_offloading_size} GiB" if engine.config.kv_offloading_size else ""))
    warm = warmup_requests(w, engine.vocab_size, count=args.warmup_requests) if args.warmup_requests > 0 else []
    if warm:
        from tokenmill.entrypoints.llm import LLM
        from tokenmill.sampling_params import SamplingParams

        LLM.from_engine(engine).generate([r.prompt_token_ids for r in warm], [SamplingParams(
            temperature=w.temperature, ignore_eos=True, max_tokens=r.max_tokens) for r in warm], use_tqdm=False)
    reset_prefix_cache(engine)
    host_before = engine.snapshot().kv_offload
    synchronize(device)
    t0 = time.perf_counter()
    done = run_conversations(engine, conversations, concurrency, w.temperature)
    synchronize(device)
    elapsed = time.perf_counter() - t0
    turns = done["turns"]
    ttft_all = [t[2] for t in turns]
    ttft_later = [t[2] for t in turns if t[1] > 0]
    prompt_tokens = sum(len(t.prompt_token_ids) for c in conversations for t in c)
    cached = sum(t[4] for t in turns)
    host = engine.snapshot().kv_offload
    host_delta = None
    if host is not None:
        host_delta = {f: getattr(host, f) - getattr(host_before, f) for f in
                      ("hit_tokens", "lookup_tokens", "bytes_saved", "bytes_loaded", "blocks_saved", "blocks_loaded",
                       "load_seconds", "failed_loads")}
        host_delta["num_slots"] = host.num_slots
        secs = host_delta["load_seconds"]
        host_delta["load_GBps"] = host_delta["bytes_loaded"] / secs / 1e9 if secs > 0 else None
    stats = engine.stats()
    summary = {"ttft_ms": _percentiles(ttft_all), "ttft_later_turns_ms": _percentiles(ttft_later),
               "latency_ms": _percentiles([t[3] for t in turns]), "elapsed_s": elapsed,
               "output_tokens": done["output_tokens"], "output_tok_per_s": done["output_tokens"] / elapsed,
               "prompt_tokens": prompt_tokens, "cached_prompt_tokens": cached,
               "host_cached_prompt_tokens": sum(t[5] for t in turns),
               "computed_prompt_fraction": 1.0 - cached / prompt_tokens if prompt_tokens else None,
               "num_preemptions": stats.num_preemptions, "working_set_tokens": ws, "gpu_kv_tokens": capacity,
               "working_set_ratio": ws / capacity, "host_tier": host_delta}
    result = report.metadata("multiturn")
    result.update({"tag": args.tag, "workload": w.to_dict(), "model": w.model, "device": str(device),
                   "dtype": str(engine.loaded.dtype).replace("torch.", ""), "concurrency": concurrency,
                   "engine": {"num_kv_blocks": engine.kv.num_blocks, "block_size": engine.config.block_size,
                              "kv_offloading_size": engine.config.kv_offloading_size},
                   "per_turn": [list(t) for t in turns] if args.keep_requests else None, "summary": summary})
    engine.shutdown()
    return result


def print_summary(result: dict, out=None) -> None:
    out = out or sys.stdout
    s = result["summary"]
    t, later = s["ttft_ms"], s["ttft_later_turns_ms"]
    print(f"{result['workload']['name']} ({result['device']}, working set {s['working_set_ratio']:.2f}x GPU KV): "
          f"TTFT p50 {t['p50']:.1f} ms, p90 {t['p90']:.1f} ms (turns 2+: p50 {later['p50']:.1f} ms); "
          f"{s['output_tok_per_s']:.0f} output tok/s, {s['elapsed_s']:.2f} s; prompt tokens computed "
          f"{100 * s['computed_prompt_fraction']:.1f}%, {s['num_preemptions']} preemptions", file=out)
    host = s["host_tier"]
    if host is not None:
        rate = f", {host['load_GBps']:.2f} GB/s" if host.get("load_GBps") else ""
        print(f"host tier: {host['hit_tokens']} prompt tokens loaded ({host['bytes_loaded'] / 2**20:.1f} MiB in "
              f"{host['load_seconds']:.3f} s{rate}), {host['bytes_saved'] / 2**20:.1f} MiB saved, "
              f"{host['failed_loads']} failed loads", file=out)

