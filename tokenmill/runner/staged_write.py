"""StagedWriteTensor: a device table updated by diff-only writes.

The CPU stages ragged (row, start, values) writes; `apply()` packs them into one pinned buffer,
makes one host-to-device copy and launches one kernel that scatters them. Nothing is copied for
rows that did not change, and the CPU never writes memory the device may still be reading.
"""

import numpy as np
import torch

from tokenmill.kernels.staged_write import apply_staged_writes


class StagedWriteTensor:
    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device):
        self.device = device
        self.dtype = dtype
        self.gpu = torch.zeros(shape, dtype=dtype, device=device)
        self._np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        self._rows: list[int] = []
        self._starts: list[int] = []
        self._values: list[np.ndarray] = []

    def stage(self, row: int, start: int, values) -> None:
        values = np.asarray(values, dtype=self._np_dtype).reshape(-1)
        if values.size == 0:
            return
        if start + values.size > self.gpu.shape[1]:
            raise ValueError(f"write of {values.size} values at column {start} overflows width {self.gpu.shape[1]}")
        self._rows.append(row)
        self._starts.append(start)
        self._values.append(values)

    def apply(self) -> None:
        if not self._rows:
            return
        lens = np.fromiter((v.size for v in self._values), dtype=np.int64, count=len(self._values))
        offsets = np.zeros_like(lens)
        np.cumsum(lens[:-1], out=offsets[1:])
        meta = np.stack([np.asarray(self._rows, np.int64), np.asarray(self._starts, np.int64), lens, offsets])
        values = np.concatenate(self._values)
        meta_t, values_t = _to_device(meta, self.device), _to_device(values, self.device)
        apply_staged_writes(self.gpu, meta_t[0], meta_t[1], meta_t[2], meta_t[3], values_t)
        self._rows.clear()
        self._starts.clear()
        self._values.clear()


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device, through a fresh pinned copy so the CPU may reuse `array` at once."""
    t = torch.from_numpy(array)
    if device.type == "cpu":
        return t.clone()
    return t.pin_memory().to(device, non_blocking=True)


to_device = _to_device
