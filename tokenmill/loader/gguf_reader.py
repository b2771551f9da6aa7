"""A fast, safe reader of GGUF files: header, metadata and tensor index; tensor data is memory-mapped.

The `gguf` package's reader parses every string of the vocabulary through numpy memmap slicing,
which takes seconds; this one parses the header with `struct` from the mapped bytes. Nothing is
unpickled: GGUF is a plain binary format.
"""

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types.
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest first); GGUF stores the reverse
    ggml_type: int
    offset: int  # absolute offset of the data in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"truncated GGUF file {self.path}: header ends at byte {len(self.buf)}")

    def unpack(self, fmt: str, size: int):
        self.need(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q", 8)
        self.need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _FLOAT32:
            # The shortest decimal with this float32 value: what the writer was given (1e-06, not
            # 9.99999997e-07), so config.json says what the original config said.
            return float(str(np.float32(self.unpack("<f", 4))))
        if vtype in _SCALARS:
            return self.unpack(*_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.unpack("<I", 4)
            count = self.unpack("<Q", 8)
            if etype in _NUMPY:
                size = np.dtype(_NUMPY[etype]).itemsize * count
                self.need(size)
                arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos).copy()
                self.pos += size
                return arr
            return [self.value(etype) for _ in range(count)]
        raise ModelLoadError(f"corrupt GGUF file {self.path}: unknown metadata type {vtype} at byte {self.pos}")


class GGUFFile:
    """Metadata (`.metadata`, a dict) and tensors (`.tensors`, name -> info) of one GGUF file."""

    def __init__(self, path: str):
        from gguf.constants import GGML_QUANT_SIZES

        self.path = path
        try:
            self._file = open(path, "rb")
        except OSError as e:
            raise ModelLoadError(f"cannot open GGUF file {path}: {e.strerror}") from None
        size = os.fstat(self._file.fileno()).st_size
        if size < 24:
            raise ModelLoadError(f"truncated GGUF file {path}: only {size} bytes")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._map, path)
        if bytes(self._map[:4]) != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic {bytes(self._map[:4])!r})")
        cur.pos = 4
        self.version = cur.unpack("<I", 4)
        if self.version < 2:
            raise ModelLoadError(f"GGUF version {self.version} of {path} is too old (need 2 or later)")
        n_tensors = cur.unpack("<Q", 8)
        n_kv = cur.unpack("<Q", 8)
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I", 4))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I", 4)
            dims = [cur.unpack("<Q", 8) for _ in range(n_dims)]
            ggml_type = cur.unpack("<I", 4)
            offset = cur.unpack("<Q", 8)
            infos.append((name, dims, ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, offset in infos:
            if ggml_type not in GGML_QUANT_SIZES:
                raise ModelLoadError(f"GGUF tensor {name} has unknown type {ggml_type}")
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            count = int(np.prod(dims)) if dims else 1
            nbytes = count // block * type_size
            start = data_start + offset
            if start + nbytes > size:
                raise ModelLoadError(
                    f"truncated GGUF file {path}: tensor {name} needs bytes up to {start + nbytes}, file has {size}"
                )
            self.tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file."""
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def close(self) -> None:
        self._map.close()
        self._file.close()
