"""`tokenmill bench throughput|latency|serve|multiturn|structured|profile|fidelity`: registered into the main CLI by `register(subparsers)`."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Optional

from tokenmill.bench.workloads import WORKLOADS


def _add_common(p: argparse.ArgumentParser, default_workload: str, default_repeat: int,
                engine_defaults: Optional[dict] = None) -> None:
    from tokenmill.entrypoints.cli import add_engine_args

    g = p.add_argument_group("workload and output")
    g.add_argument("--workload", default=None, choices=sorted(WORKLOADS),
                   help=f"a standard workload (default: {default_workload}); the flags below override its fields")
    g.add_argument("--num-prompts", type=int, default=None, help="number of requests (default: the workload's)")
    g.add_argument("--input-len", default=None,
                   help="prompt length: N or LO:HI (uniform, inclusive) (default: the workload's)")
    g.add_argument("--output-len", default=None,
                   help="output length: N or LO:HI (uniform, inclusive) (default: the workload's)")
    g.add_argument("--workload-seed", type=int, default=None, help="seed of the request generator (default: 0)")
    g.add_argument("--repeat", type=int, default=default_repeat, help="timed runs (the median is reported)")
    g.add_argument("--warmup-requests", type=int, default=8, help="untimed requests before the timed runs")
    g.add_argument("--out", default="bench-results", help="directory for the JSON (and PNG) results")
    g.add_argument("--tag", default=None,
                   help="a label added to the result file name and the summary (default: none)")
    g.add_argument("--no-plot", action="store_true", help="write no PNG")
    # Left unset, these come from the workload (preset, dummy weights, its dtype).
    add_engine_args(p, defaults={**{name: (None, "the workload's") for name in ("model", "load_format", "dtype")},
                                 **(engine_defaults or {})})
    from tokenmill.bench.common import probability
    from tokenmill.bench.lora import add_lora_args

    add_lora_args(p)

    s = p.add_argument_group("speculative decoding")
    s.add_argument("--synthetic-acceptance", type=probability, default=None, metavar="A",
                   help="for random weights, which accept nothing: every verify step drafts k tokens and accepts "
                        "each with probability A whatever the tokens (0..1), so the verify cost is real and the "
                        "tokens per step follow A; sets synthetic_acceptance in --speculative-config, and alone "
                        'implies --speculative-config \'{"method": "ngram", "num_speculative_tokens": 3}\'; '
                        "the results report acceptance rate, mean accepted length and acceptance by position "
                        "(default: off)")


def register(subparsers) -> None:
    from tokenmill.entrypoints.cli import add_command

    bench = add_command(subparsers, "bench", help="throughput, latency and serving benchmarks with a roofline report",
                        description="Benchmarks; results go to --out as JSON (+ PNG).")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    tp = add_command(sub, "throughput", help="offline throughput through the LLM API")
    _add_common(tp, "offline-small", 1)
    tp.add_argument("--compare", choices=["transformers"], default=None,
                    help="also run HF transformers continuous batching on the same requests, then print the ratio "
                         "(default: none)")
    tp.add_argument("--compare-repeat", type=int, default=1, help="timed runs of the peer")
    tp.add_argument("--hf-attn", default=None, help="transformers attn_implementation (default: paged|sdpa, or "
                                                    "sdpa from transformers 5.23)")
    tp.add_argument("--hf-num-blocks", type=int, default=None, help="transformers CB cache blocks (default: its own)")
    tp.add_argument("--hf-max-batch-tokens", type=int, default=None,
                    help="transformers CB tokens per batch (default: its own)")
    tp.add_argument("--no-keep-steps", dest="keep_steps", action="store_false",
                    help="leave the per-step points out of the JSON (default: kept)")
    tp.set_defaults(func=functools.partial(_run, "throughput"))

    lat = add_command(sub, "latency", help="batch-1 decode latency (time per output token, TTFT)")
    _add_common(lat, "latency-8b", 5)
    lat.set_defaults(func=functools.partial(_run, "latency"))

    sv = add_command(sub, "serve", help="load the HTTP server with Poisson arrivals; TTFT, ITL, throughput")
    from tokenmill.entrypoints.serve_cli import SERVE_ENGINE_DEFAULTS

    _add_common(sv, "serve-8b", 1, SERVE_ENGINE_DEFAULTS)  # the launched server's own defaults
    sv.set_defaults(warmup_requests=4)
    sv.add_argument("--launch", action="store_true", help="start `tokenmill serve` as a subprocess")
    sv.add_argument("--base-url", default=None,
                    help="a running server, e.g. http://127.0.0.1:8000 (default: none: the one --launch starts)")
    sv.add_argument("--port", type=int, default=None, help="port for --launch (default: a free one)")
    sv.add_argument("--server-args", default="", help="extra flags for `tokenmill serve` (one string)")
    sv.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    sv.add_argument("--request-rate", type=float, default=None,
                    help="requests/s, Poisson (default: the workload's; inf = all at once)")
    sv.add_argument("--rates", default=None, help="a sweep, e.g. 2,4,8, overriding --request-rate (default: none)")
    sv.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    sv.add_argument("--request-timeout", type=float, default=3600.0, help="seconds, for the whole run")
    sv.add_argument("--keep-requests", action="store_true", help="keep every request's TTFT in the JSON")
    gp = sv.add_argument_group("goodput (the highest rate that meets latency targets)")
    gp.add_argument("--goodput", action="store_true",
                    help="find the highest request rate whose ITL p99 and TTFT p99 meet the thresholds below (and "
                         "no request fails): from --goodput-start, double until a rate fails (or --goodput-max-rate "
                         "passes), then bisect between the last pass and the first fail; every probe is in the "
                         "JSON's goodput.probes. With --rates, runs after that sweep on the same server; alone, "
                         "instead of the single --request-rate run (default: off)")
    gp.add_argument("--goodput-itl-p99-ms", type=float, default=30.0, help="ITL p99 threshold, ms")
    gp.add_argument("--goodput-ttft-p99-ms", type=float, default=1000.0, help="TTFT p99 threshold, ms")
    gp.add_argument("--goodput-start", type=float, default=None,
                    help="first rate probed, req/s (default: the workload's rate, after --request-rate)")
    gp.add_argument("--goodput-max-rate", type=float, default=None,
                    help="highest rate probed, req/s (default: 64 x the start rate)")
    gp.add_argument("--goodput-rounds", type=int, default=3, help="bisection rounds after the first failing rate")
    gp.add_argument("--goodput-requests", type=int, default=200,
                    help="requests per probe (the workload's first N, Poisson arrivals at the probe's rate, seeded)")
    sv.set_defaults(func=functools.partial(_run, "serve"))

    mt = add_command(sub, "multiturn", help="multi-turn chat: conversations resending their history; TTFT with "
                                            "the GPU prefix cache and the host tier (--kv-offloading-size)")
    _add_common(mt, "multiturn-8b", 1)
    mt.add_argument("--concurrency", type=int, default=None,
                    help="conversations in flight at once (default: the workload's)")
    mt.add_argument("--working-set-ratio", type=float, default=None, metavar="R",
                    help="size the GPU KV cache (num_kv_blocks) to 1/R of the conversations' KV working set, "
                         "e.g. 4 (default: --num-kv-blocks or the memory budget)")
    mt.add_argument("--keep-requests", action="store_true", help="keep every turn's TTFT in the JSON")
    mt.set_defaults(func=functools.partial(_run, "multiturn"), no_plot=True, warmup_requests=4)

    st = add_command(sub, "structured", help="step time of one batch with and without JSON-schema grammars")
    _add_common(st, "structured-small", 3)
    st.add_argument("--grammar-threads", type=int, default=None,
                    help="threads the matchers fill a step's masks on (default: the engine's)")
    st.set_defaults(func=functools.partial(_run, "structured"), no_plot=True, warmup_requests=64)

    pf = add_command(sub, "profile", help="torch-profiler breakdown of a window of engine steps, per kernel")
    _add_common(pf, "offline-small", 1)
    pf.add_argument("--skip-steps", type=int, default=200, help="steps run before the profiled window")
    pf.add_argument("--steps", type=int, default=20, help="steps in the profiled window")
    pf.add_argument("--trace", action="store_true", help="also write a Chrome trace (.trace.json.gz)")
    pf.set_defaults(func=functools.partial(_run, "profile"), no_plot=True)

    from tokenmill.bench.fidelity import add_args as add_fidelity_args

    fd = add_command(sub, "fidelity", help="numerical fidelity: engine configurations (dtype, FP8 weights, FP8 KV "
                                           "cache, batching) against a float32 reference, and HF transformers",
                     description="Greedy token agreement, teacher-forced top-1 agreement and KL divergence of "
                                 "each candidate against tokenmill in float32 on the same device; see "
                                 "tokenmill/bench/fidelity.py for the exact definitions.")
    add_fidelity_args(fd)
    fd.set_defaults(func=functools.partial(_run, "fidelity"), no_plot=True, log_level_default="INFO")


def _finish(kind: str, result: dict, args) -> int:
    from tokenmill.bench import report

    os.makedirs(args.out, exist_ok=True)
    stem = report.result_stem(kind, result["workload"]["name"], args.tag)
    path = report.write_json(result, os.path.join(args.out, stem + ".json"))
    print(f"wrote {path}", file=sys.stderr)
    if not args.no_plot:
        try:
            from tokenmill.bench.plots import plot_result

            png = plot_result(result, os.path.join(args.out, stem + ".png"))
            if png:
                print(f"wrote {png}", file=sys.stderr)
        except ImportError as e:
            print(f"no figure (matplotlib missing: {e})", file=sys.stderr)
        except Exception as e:  # a figure is never worth failing a benchmark for
            print(f"no figure: {type(e).__name__}: {e}", file=sys.stderr)
    return 0


def _run(kind: str, args) -> int:
    """Run bench module `kind` (throughput, latency, profile, serve): its run(), summary, files."""
    import importlib

    module = importlib.import_module(f"tokenmill.bench.{kind}")
    result = module.run(args)
    module.print_summary(result)
    return _finish(kind, result, args)
