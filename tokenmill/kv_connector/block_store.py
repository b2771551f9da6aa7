"""KV blocks as files in a directory shared by engines on one host (/dev/shm: memory, not disk).

One file per block, named by its prefix-cache key (engine/block_hash.py: SHA-256 over the whole
prefix, the LoRA adapter and the cache salt), so equal names mean equal KV on engines that run the
same model. A file is a 64-byte header (magic, the block layout's tag, the payload's length, the
key) and the block's bytes as blocks.gather_blocks stages them. Writers write a temporary name and
rename it, so a reader sees a whole block or none; a reader checks the header and the length and
raises BlockStoreError on anything else (the caller recomputes).
"""

import contextlib
import os
import re
import shutil
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.logger import init_logger

logger = init_logger(__name__)

MAGIC = b"TMKVBLK1"
HEADER = struct.Struct("<8s16sQ32s")  # magic, layout tag, payload bytes, key: 64 bytes
SUFFIX = ".kv"
_NAME = re.compile(r"^[0-9a-f]{64}\.kv(\.tmp\.\d+\.\d+)?$")  # ours: a block or a temporary one


def default_store_path() -> str:
    """/dev/shm/tokenmill-kv where there is a /dev/shm (memory), else under the temporary directory."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(root, "tokenmill-kv")


class BlockStoreError(Exception):
    """A block file that is missing, short, or not a block of this layout."""


@dataclass
class StoreBounds:
    """How much a writer keeps: its oldest files go past max_bytes, and any older than ttl_s."""

    max_bytes: int
    ttl_s: float


class BlockFileStore:
    """The directory's files; lookups and removals by key, reads and writes of whole blocks."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(path, exist_ok=True)
        # Blocks this process wrote and may still be there, oldest first: key -> (time, bytes). Only
        # the writer's side bounds the directory (StoreBounds); a reader removes what it loaded.
        self.written: "OrderedDict[bytes, tuple[float, int]]" = OrderedDict()
        self.written_bytes = 0
        self._lock = threading.Lock()  # writes run on several threads

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.path).free

    def file_of(self, key: bytes) -> str:
        return os.path.join(self.path, key.hex() + SUFFIX)

    def has(self, key: bytes) -> bool:
        return os.path.exists(self.file_of(key))

    def remove(self, key: bytes) -> None:
        try:
            os.unlink(self.file_of(key))
        except FileNotFoundError:
            pass

    def clear(self) -> int:
        """Remove every block file (and leftover temporary one) of the directory; returns how many."""
        removed = 0
        for name in os.listdir(self.path):
            if _NAME.match(name):
                try:
                    os.unlink(os.path.join(self.path, name))
                    removed += 1
                except FileNotFoundError:
                    pass
        self.written.clear()
        self.written_bytes = 0
        return removed

    def write(self, key: bytes, tag: bytes, block: torch.Tensor) -> bool:
        """Write one block (a contiguous uint8 CPU tensor) unless its file is there already; False then."""
        path = self.file_of(key)
        if os.path.exists(path):
            return False
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, tag, block.numel(), key))
                f.write(memoryview(block.numpy()).cast("B"))
            os.replace(tmp, path)  # atomic: a reader never sees half a block
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with self._lock:
            self.written[key] = (time.monotonic(), block.numel())
            self.written_bytes += block.numel()
        return True

    def read_into(self, key: bytes, tag: bytes, out: torch.Tensor) -> None:
        """Fill `out` (a contiguous uint8 CPU tensor, one block) from the key's file, or raise BlockStoreError."""
        try:
            with open(self.file_of(key), "rb") as f:
                head = f.read(HEADER.size)
                if len(head) != HEADER.size:
                    raise BlockStoreError(f"block {key.hex()[:12]}: short header")
                magic, file_tag, size, file_key = HEADER.unpack(head)
                if magic != MAGIC or file_key != key:
                    raise BlockStoreError(f"block {key.hex()[:12]}: not a block file of this key")
                if file_tag != tag or size != out.numel():
                    raise BlockStoreError(f"block {key.hex()[:12]}: another block layout ({size} bytes)")
                got = f.readinto(memoryview(out.numpy()).cast("B"))
                if got != size:
                    raise BlockStoreError(f"block {key.hex()[:12]}: {got} of {size} bytes")
        except FileNotFoundError:
            raise BlockStoreError(f"block {key.hex()[:12]}: no file") from None

    def evict(self, bounds: StoreBounds, incoming: int = 0, now: Optional[float] = None) -> int:
        """Remove this writer's oldest files while it holds more than max_bytes less `incoming` (about
        to be written), and any older than ttl_s (a reader that never came: its request aborted, or
        the reader died); returns how many."""
        now = time.monotonic() if now is None else now
        removed = 0
        while self.written:
            key, (born, size) = next(iter(self.written.items()))
            if self.written_bytes + incoming <= bounds.max_bytes and now - born <= bounds.ttl_s:
                break
            del self.written[key]
            self.written_bytes -= size
            self.remove(key)  # (gone already when a reader loaded it)
            removed += 1
        return removed
