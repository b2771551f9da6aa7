"""Tile-config sweep of the fused-MoE kernels (tokenmill/kernels/fused_moe.py) on the GPU: prints the
GROUPED_TILES and GEMV_TILES entries to paste into that module.

    python benchmarks/moe_tune.py [--models qwen3-30b-a3b,mixtral-8x7b] [--tokens 1,8,64,512,8192] [--quick]
    TRITON_INTERPRET=1 python benchmarks/moe_tune.py --smoke    # toy shapes on the CPU: checks the script

Per model and token count, on the path fused_moe_triton takes there (fused_moe.use_gemv_path):

- GEMV: each launch's configs timed alone (launch 2 over launch 1's output); the fastest of each.
- grouped: for each tile height block_m within a factor of two of the default rule's, the token
  sort once, then each launch's configs over it; the block_m whose sort + best launch 1 + best
  launch 2 is fastest, with those two (one sort serves both launches, so they share block_m).

Configs that do not compile (shared memory, registers) are skipped. The winners are checked
against fused_moe_ref and timed end to end beside the configs the module picks today. Entries are
keyed by the token bucket (the power of two at or above the token count). --out writes every
timing as JSON ($OUT/moe_tune.json when $OUT is set).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton.testing import do_bench  # noqa: E402

from tokenmill.kernels import fused_moe as fm  # noqa: E402

# name -> (experts, hidden, intermediate, top_k)
MODELS = {
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
BLOCK_MS = (16, 32, 64, 128)
# (block_n, block_k, group_m, num_warps, num_stages) of the grouped launches; --quick takes the first
GROUPED_SPACE = {
    "full": dict(block_n=(32, 64, 128, 256), block_k=(32, 64, 128, 256), group_m=(1, 8, 32), num_warps=(4, 8),
                 num_stages=(2, 3, 4, 5)),
    "quick": dict(block_n=(64, 128), block_k=(64, 128), group_m=(8,), num_warps=(4, 8), num_stages=(3, 4)),
    "smoke": dict(block_n=(16, 32), block_k=(16,), group_m=(8,), num_warps=(4,), num_stages=(2,)),
}
# (block_n, block_k, num_warps, num_stages) of the GEMV launches
GEMV_SPACE = {
    "full": dict(block_n=(4, 8, 16, 32, 64), block_k=(64, 128, 256, 512, 1024), num_warps=(2, 4, 8),
                 num_stages=(1, 2, 3, 4)),
    "quick": dict(block_n=(8, 16, 32), block_k=(256, 512), num_warps=(4, 8), num_stages=(3,)),
    "smoke": dict(block_n=(16, 32), block_k=(16, 32), num_warps=(4,), num_stages=(1,)),
}
DEVICE = "cuda"  # --smoke: "cpu" (the Triton interpreter)
DTYPE = torch.bfloat16


def timed_ms(fn: Callable[[], object]) -> float:
    if DEVICE != "cuda":  # smoke mode: one call, the number meaningless
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def grouped_configs(space: dict, block_m: int, n_out: int, k: int, elem_bytes: int, b_tiles: int) -> list[dict]:
    """The grouped launch's configs of `space` at this block_m that launch as given (fused_moe's
    _fit_tile leaves them unchanged: no wider than the problem, within the shared-memory budget)."""
    out = []
    for values in itertools.product(*(space[f] for f in fm.GROUPED_FIELDS[1:])):
        cfg = dict(zip(fm.GROUPED_FIELDS, (block_m, *values)))
        if fm._fit_tile(cfg, n_out, k, elem_bytes, b_tiles) == cfg:
            out.append(cfg)
    return out


def gemv_configs(space: dict, n_out: int, k: int) -> list[dict]:
    """The GEMV launch's configs of `space`, clamped to the problem as fused_moe clamps them, once each."""
    out = []
    for values in itertools.product(*(space[f] for f in fm.GEMV_FIELDS)):
        cfg = fm._fit_tile(dict(zip(fm.GEMV_FIELDS, values)), n_out, k, 0, 0)
        if cfg not in out:
            out.append(cfg)
    return out


def block_m_candidates(num_tokens: int, top_k: int, num_experts: int) -> list[int]:
    """Tile heights within a factor of two of the default rule's."""
    default = fm._grouped_default(num_tokens, top_k, num_experts)[0]
    return [b for b in BLOCK_MS if default // 2 <= b <= 2 * default]


def entry_line(key: tuple, cfg: dict, fields: tuple, note: str) -> str:
    """One table line as fused_moe.py writes it: `    (E, N, K, bucket): (fields...),  # note`."""
    return f"    {key}: {tuple(cfg[f] for f in fields)},  # {note}"


def _best(label: str, configs: list[dict], run: Callable[[dict], object], log: list) -> tuple[dict, float]:
    """The fastest config of `configs` for run(cfg), every timing appended to log."""
    best, best_ms = None, float("inf")
    for cfg in configs:
        try:
            run(cfg)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            ms = timed_ms(lambda: run(cfg))
        except Exception as exc:  # a config that does not compile here
            log.append(dict(launch=label, config=cfg, error=f"{type(exc).__name__}: {exc}"[:200]))
            continue
        log.append(dict(launch=label, config=cfg, ms=round(ms, 5)))
        if ms < best_ms:
            best, best_ms = cfg, ms
    assert best is not None, f"{label}: no config ran"
    return best, best_ms


def tune(name: str, num_tokens: int, space: str) -> dict:
    """The best configs of one model at one token count: {path, entries: [(table, key, cfg, note)], ...}."""
    E, H, inter, k = MODELS[name]
    esz = torch.empty((), dtype=DTYPE).element_size()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(num_tokens, H, device=DEVICE, dtype=DTYPE, generator=gen)
    w13 = torch.randn(E, 2 * inter, H, device=DEVICE, dtype=DTYPE, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, inter, device=DEVICE, dtype=DTYPE, generator=gen) / inter ** 0.5
    logits = torch.randn(num_tokens, E, device=DEVICE, dtype=DTYPE, generator=gen)
    weights, ids = fm.moe_route(logits, k, renormalize=True)
    bucket = fm.token_bucket(num_tokens)
    keys = {"gate_up": (E, 2 * inter, H, bucket), "down": (E, H, inter, bucket)}
    current = fm.moe_config(E, inter, H, num_tokens, k, DTYPE)
    log: list = []
    if fm.use_gemv_path(num_tokens, k, E):
        gu, gu_ms = _best("gemv gate_up", gemv_configs(GEMV_SPACE[space], inter, H),
                          lambda c: fm.gemv_gate_up(x, w13, ids, c), log)
        h = fm.gemv_gate_up(x, w13, ids, gu)
        down, down_ms = _best("gemv down", gemv_configs(GEMV_SPACE[space], H, inter),
                              lambda c: fm.gemv_down(h, w2, weights, ids, c), log)
        tuned = dict(path="gemv", gate_up=gu, down=down)
        table, fields, parts = "GEMV_TILES", fm.GEMV_FIELDS, {"gate_up": gu_ms, "down": down_ms}
    else:
        totals = {}
        for block_m in block_m_candidates(num_tokens, k, E):
            sort = fm.moe_sort_tokens(ids, E, block_m)
            sort_ms = timed_ms(lambda: fm.moe_sort_tokens(ids, E, block_m))
            gu, gu_ms = _best(f"grouped gate_up m{block_m}",
                              grouped_configs(GROUPED_SPACE[space], block_m, inter, H, esz, 2),
                              lambda c: fm.grouped_gate_up(x, w13, k, sort, c), log)
            h = fm.grouped_gate_up(x, w13, k, sort, gu)
            down, down_ms = _best(f"grouped down m{block_m}",
                                  grouped_configs(GROUPED_SPACE[space], block_m, H, inter, esz, 1),
                                  lambda c: fm.grouped_down(h, w2, weights, sort, c), log)
            totals[block_m] = (sort_ms + gu_ms + down_ms, gu, down, {"sort": sort_ms, "gate_up": gu_ms,
                                                                    "down": down_ms})
        _, gu, down, parts = min(totals.values(), key=lambda t: t[0])
        tuned = dict(path="grouped", gate_up=gu, down=down)
        table, fields = "GROUPED_TILES", fm.GROUPED_FIELDS
    ref = fm.fused_moe_ref(x, w13, w2, weights, ids)
    out = fm.fused_moe_triton(x, w13, w2, weights, ids, config=tuned)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    tuned_ms = timed_ms(lambda: fm.fused_moe_triton(x, w13, w2, weights, ids, config=tuned))
    current_ms = timed_ms(lambda: fm.fused_moe_triton(x, w13, w2, weights, ids, config=current))
    note = (f"{name} T={num_tokens}: {tuned_ms:.4f} ms end to end (now {current_ms:.4f}); "
            + ", ".join(f"{part} {ms:.4f}" for part, ms in parts.items()))
    entries = [(table, keys[launch], tuned[launch], fields, note) for launch in ("gate_up", "down")]
    return dict(model=name, tokens=num_tokens, path=tuned["path"], rel_err=float(f"{err:.2e}"),
                tuned_ms=round(tuned_ms, 5), current_ms=round(current_ms, 5), tuned=tuned, current=current,
                entries=entries, timings=log)


def _enter_smoke_mode() -> None:
    global DEVICE, DTYPE, MODELS, TOKENS
    assert os.environ.get("TRITON_INTERPRET") == "1", "--smoke needs TRITON_INTERPRET=1"
    DEVICE, DTYPE = "cpu", torch.float16
    MODELS = {"smoke": (8, 32, 16, 2)}
    TOKENS = [1, 40]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = os.path.join(os.environ["OUT"], "moe_tune.json") if os.environ.get("OUT") else None
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tokens", default=None, help="token counts, comma-separated (default 1 to 8192, powers of 2)")
    parser.add_argument("--quick", action="store_true", help="a smaller config space")
    parser.add_argument("--out", default=default_out, help="every timing as JSON")
    parser.add_argument("--smoke", action="store_true",
                        help="check the script on CPU with TRITON_INTERPRET=1 at toy shapes (numbers meaningless)")
    args = parser.parse_args()
    if args.smoke:
        _enter_smoke_mode()
    else:
        assert torch.cuda.is_available(), "moe_tune needs a CUDA device"
    space = "smoke" if args.smoke else "quick" if args.quick else "full"
    tokens = [int(v) for v in args.tokens.split(",")] if args.tokens else TOKENS
    results = []
    for name in MODELS if args.smoke else args.models.split(","):
        for T in tokens:
            t0 = time.time()
            r = tune(name, T, space)
            results.append(r)
            print(f"{name} T={T} ({r['path']}): {r['tuned_ms']} ms tuned, {r['current_ms']} ms now, "
                  f"err {r['rel_err']} ({time.time() - t0:.0f} s)", flush=True)
    for table in ("GROUPED_TILES", "GEMV_TILES"):
        lines = [entry_line(key, cfg, fields, note) for r in results for t, key, cfg, fields, note in r["entries"]
                 if t == table]
        if lines:
            print(f"\n# {table} entries for tokenmill/kernels/fused_moe.py ({DTYPE}, "
                  f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu smoke'})")
            print("\n".join(lines))
    if args.out:
        for r in results:
            r["entries"] = [dict(table=t, key=list(key), config=cfg) for t, key, cfg, _, _ in r["entries"]]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(dtype=str(DTYPE), space=space, results=results), indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
