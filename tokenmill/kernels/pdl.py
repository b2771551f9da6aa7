"""Programmatic dependent launch (PDL, Hopper and later).

A kernel launched with PDL may start while the kernel before it on the stream is still finishing:
its programs get on the SMs during the previous kernel's tail instead of after it. In exchange it
must call `gdc_wait()` before it reads anything an earlier kernel wrote, or writes anything one may
still read; only loads of data no kernel writes (weights) may come before the wait. Each PDL
kernel then calls `gdc_launch_dependents()`, which lets the next one launch early in turn.

Batch-1 decode is a chain of ~225 small kernels, so the per-kernel ramp-up and drain add up; the
decode-path kernels (the batch-1 GEMV, qkv_prep, attention and its split merge) take a PDL
constexpr and are launched with `launch_pdl=True` when `pdl_enabled` says so. TOKENMILL_PDL=0
turns it off (for comparisons).
"""

import functools
import os

import torch

from tokenmill.kernels._dispatch import use_triton


@functools.lru_cache(maxsize=None)
def _device_supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` launch with PDL (CUDA, compute capability >= 9.0)."""
    if not use_triton(t) or os.environ.get("TOKENMILL_PDL", "1") == "0":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _device_supports_pdl(index)


def pdl_launch(enabled: bool) -> dict:
    """Launch options for a kernel[grid](...) call: `launch_pdl` only when on (the interpreter
    does not know the option)."""
    return {"launch_pdl": True} if enabled else {}
