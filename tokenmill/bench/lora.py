"""Benchmarks with LoRA adapters: `--num-loras N --lora-rank R` makes N random adapters of the
workload's model (PEFT's file layout, every projection targeted), spreads them evenly over the
requests (request i takes adapter i mod N) and turns LoRA on with enough slots for all of them.

The adapters are random (like the dummy weights): they cost what real ones of that rank cost, and
say nothing about output quality.
"""

import json
import os
import tempfile
from typing import Optional

from tokenmill.lora.request import LoRARequest


def add_lora_args(p) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--num-loras", type=int, default=0, metavar="N",
                   help="N random LoRA adapters of the model, spread evenly over the requests (implies "
                        "--enable-lora with --max-loras N; default: none)")
    g.add_argument("--lora-rank", type=int, default=16, metavar="R", help="their rank (default: 16)")


def lora_engine_args(args) -> None:
    """Fold --num-loras into the engine flags (enable_lora, max_loras, max_lora_rank)."""
    n = getattr(args, "num_loras", 0) or 0
    if n < 0:
        raise SystemExit("--num-loras must be >= 0")
    if n:
        args.enable_lora = True
        args.max_loras = max(n, getattr(args, "max_loras", None) or 1)
        args.max_lora_rank = max(args.lora_rank, getattr(args, "max_lora_rank", None) or 1)


def write_random_adapter(path: str, arch, rank: int, seed: int, std: float = 0.02) -> str:
    """A rank-`rank` adapter of every projection of `arch` at `path`, as PEFT saves one (bf16)."""
    import torch
    from safetensors.torch import save_file

    from tokenmill.lora.adapter import CONFIG_FILE, TARGETS, WEIGHTS_FILE, model_shapes

    shapes = model_shapes(arch)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module in TARGETS:
            part = shapes.part(layer, module)
            if part is None:
                continue  # a mixture-of-experts layer without a shared expert: its experts take no adapter
            k, n = shapes.shape(layer, module)
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, k, generator=gen) * std).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(n, rank, generator=gen) * std).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                   "bias": "none", "use_dora": False, "use_rslora": False}, f)
    return path


def synthetic_adapters(args, arch, root: Optional[str] = None) -> list[LoRARequest]:
    """--num-loras random adapters of `arch` under `root` (a new temporary directory by default)."""
    n = getattr(args, "num_loras", 0) or 0
    if not n:
        return []
    root = root or tempfile.mkdtemp(prefix="tokenmill-bench-loras-")
    return [LoRARequest(f"bench-lora-{i}", i + 1,
                        write_random_adapter(os.path.join(root, f"lora-{i}"), arch, args.lora_rank, seed=i))
            for i in range(n)]


def spread(adapters: list[LoRARequest], count: int) -> Optional[list[LoRARequest]]:
    """One adapter per request, evenly (request i: adapter i mod N); None without adapters."""
    if not adapters:
        return None
    return [adapters[i % len(adapters)] for i in range(count)]
