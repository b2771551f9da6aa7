"""What the benchmarks share: the workload from the flags, the engine from the workload, device sync."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
from typing import Optional

from tokenmill.bench.workloads import Workload, custom_workload, get_workload
from tokenmill.models.presets import PRESETS


def resolve_workload(args, default: str) -> Workload:
    base = get_workload(args.workload or default)
    return custom_workload(base, model=args.model, num_prompts=args.num_prompts, input_len=args.input_len,
                           output_len=args.output_len, seed=args.workload_seed,
                           request_rate=getattr(args, "request_rate", None),
                           load_format=args.load_format, dtype=args.dtype)


# What --synthetic-acceptance turns on when no --speculative-config is given.
SYNTHETIC_DEFAULT_SPECULATION = {"method": "ngram", "num_speculative_tokens": 3}


def probability(text: str) -> float:
    """A flag's value in [0, 1] (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def speculative_config(args):
    """The run's SpeculativeConfig (or None): --speculative-config, with --synthetic-acceptance set
    into it; that shorthand alone means n-gram drafts of 3 tokens."""
    from tokenmill.config import SpeculativeConfig

    spec = getattr(args, "speculative_config", None)
    rate = getattr(args, "synthetic_acceptance", None)
    if isinstance(spec, dict):
        spec = SpeculativeConfig(**spec)
    if rate is None:
        return spec
    if spec is None:
        return SpeculativeConfig(**SYNTHETIC_DEFAULT_SPECULATION, synthetic_acceptance=rate)
    return dataclasses.replace(spec, synthetic_acceptance=rate)


def engine_namespace(args, w: Workload) -> argparse.Namespace:
    """The engine flags with the workload's model, load format and dtype filled in where not given,
    and --synthetic-acceptance folded into the speculative config."""
    ns = copy.copy(args)
    ns.model = w.model
    ns.load_format = w.load_format if w.load_format else ("dummy" if w.model.lower() in PRESETS else "auto")
    ns.dtype = w.dtype or "auto"
    ns.speculative_config = speculative_config(args)
    from tokenmill.bench.lora import lora_engine_args

    lora_engine_args(ns)
    return ns


def build_engine(args, w: Workload):
    from tokenmill.entrypoints.cli import engine_from_args

    return engine_from_args(engine_namespace(args, w))


def synchronize(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device) -> Optional[int]:
    """Collect garbage and return cached blocks; returns the bytes still allocated (CUDA) or None."""
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return int(torch.cuda.memory_allocated(device))
    return None


def reset_prefix_cache(engine) -> bool:
    """Forget cached prefixes so a repeat cannot reuse the previous run's prompts (the host tier's too)."""
    if callable(getattr(engine, "reset_prefix_cache", None)) and engine.reset_prefix_cache():
        return True
    kv = getattr(engine, "kv", None)
    if kv is not None and hasattr(kv, "reset_prefix_cache"):
        kv.reset_prefix_cache()
        return True
    return False


def median_index(values: list[float]) -> int:
    """Index of the median element (the lower one for an even count)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return order[(len(order) - 1) // 2]


def spec_snapshot(engine):
    """A frozen copy of the engine's speculative-decoding counts, or None without speculation."""
    stats = getattr(engine, "spec_stats", None)
    return None if stats is None else stats.snapshot()


def spec_summary(counts) -> Optional[dict]:
    """The JSON form of a run's SpecDecodeCounts (None: no speculation). acceptance_rate: accepted
    / draft tokens; mean_accepted_length: tokens per verifying request-step (1 + accepted drafts);
    acceptance_by_position[i]: of the drafts that reached position i, the fraction accepted up to
    and including it. With no draft verified (nothing matched) the ratios are None."""
    if counts is None:
        return None
    verified = counts.verify_steps > 0
    return {"num_speculative_tokens": counts.num_speculative_tokens, "num_drafts": counts.verify_steps,
            "num_draft_tokens": counts.drafts, "num_accepted_tokens": counts.accepted,
            "acceptance_rate": counts.acceptance_rate if verified else None,
            "mean_accepted_length": counts.mean_accepted_length if verified else None,
            "acceptance_by_position": [r if d else None for r, d in zip(counts.acceptance_by_position,
                                                                      counts.drafted_at)],
            "num_draft_tokens_by_position": list(counts.drafted_at),
            "num_accepted_tokens_by_position": list(counts.accepted_at)}


def format_spec(spec: Optional[dict]) -> str:
    """One line of a run's speculative-decoding figures ("" when off)."""
    if not spec:
        return ""
    if not spec["num_drafts"]:
        return f"speculative decoding (k={spec['num_speculative_tokens']}): no draft verified (nothing matched)"
    by_position = ", ".join("-" if r is None else f"{r:.2f}" for r in spec["acceptance_by_position"])
    return (f"speculative decoding (k={spec['num_speculative_tokens']}): acceptance "
            f"{100 * spec['acceptance_rate']:.1f}% ({spec['num_accepted_tokens']}/{spec['num_draft_tokens']} draft "
            f"tokens), {spec['mean_accepted_length']:.2f} tokens per verifying step, by position [{by_position}]")
