"""What the benchmarks share: the workload from the flags, the engine from the workload, device sync."""

from __future__ import annotations

import argparse
import copy
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


def engine_namespace(args, w: Workload) -> argparse.Namespace:
    """The engine flags with the workload's model, load format and dtype filled in where not given."""
    ns = copy.copy(args)
    ns.model = w.model
    ns.load_format = w.load_format if w.load_format else ("dummy" if w.model.lower() in PRESETS else "auto")
    ns.dtype = w.dtype or "auto"
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
    """Forget cached prefixes so a repeat cannot reuse the previous run's prompts."""
    kv = getattr(engine, "kv", None)
    if kv is not None and hasattr(kv, "reset_prefix_cache"):
        kv.reset_prefix_cache()
        return True
    return False


def median_index(values: list[float]) -> int:
    """Index of the median element (the lower one for an even count)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return order[(len(order) - 1) // 2]
