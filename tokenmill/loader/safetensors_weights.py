"""HF checkpoint tensors from *.safetensors files (single file or sharded with an index)."""

import glob
import json
import os
from typing import Iterator

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
