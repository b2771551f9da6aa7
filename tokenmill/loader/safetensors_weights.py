"""HF checkpoint tensors from *.safetensors files (single file or sharded with an index), and a
writer that streams tensors into one."""

import glob
import json
import math
import os
import struct
from typing import Any, Callable, Iterator, Optional

import torch

from tokenmill.errors import ModelLoadError


def safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"corrupt safetensors index {index}: {e}") from None
        files = sorted({os.path.join(directory, name) for name in weight_map.values()})
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise ModelLoadError(f"shards named in {index} are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {directory} (tokenmill never loads pickled .bin files)")
    return files


def iter_safetensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on CPU) for each tensor, one at a time, from memory-mapped files."""
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(directory):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"corrupt or truncated safetensors file {path}: {e}") from None


def save_safetensors_streaming(path: str, weights: list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]],
                               metadata: Optional[dict[str, str]] = None) -> None:
    """Write float32 tensors to a safetensors file one at a time: `weights` is (name, shape, read)
    and each read() runs only when its bytes are written, so at most one tensor is in memory
    (safetensors' save_file wants them all at once). The header comes first, from the shapes."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, shape, _ in weights:
        if name in header:
            raise ModelLoadError(f"two tensors are named {name} in {path}")
        nbytes = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors' own writer keeps it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, read in weights:
            tensor = read()
            if tensor.dtype != torch.float32 or tuple(tensor.shape) != tuple(shape):
                raise ModelLoadError(f"{name}: read {tensor.dtype} {tuple(tensor.shape)}, "
                                     f"planned float32 {tuple(shape)}")
            f.write(tensor.contiguous().numpy().data)
            del tensor  # before the next read, not after it
