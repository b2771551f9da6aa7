"""Grammar work in processes of their own, beside the engine thread.

xgrammar's matcher calls hold the GIL, so on the engine's thread a step's token acceptance and
mask filling add to the engine's own host work (output processing, scheduling) instead of running
beside it; at batch 64 that was most of a grammar step's time (docs/PERFORMANCE.md). With
`structured_outputs_workers = K` (EngineConfig) the matchers live in K worker processes instead,
each owning the requests hashed to it:

- `add(req_id, spec)` / `remove(req_id)`: a matcher is made (the worker compiles the spec into its
  own cache; the engine compiled it too, on validation, for the error message) or dropped. These
  messages are not answered; each worker handles its pipe in order, so a step message sent later
  finds the matcher.
- `step(work)`: for each grammar entry, the tokens the previous step emitted (accepted in order,
  stopping at a refused token or where the grammar completes) and, for the next step, the rows to
  fill: one, or 1 + the drafts the device will verify (row j after the first j drafts, then rolled
  back, as in StructuredOutputManager.bitmask). The masks are written into one shared-memory array
  [rows, ceil(V / 32)] int32; `wait()` returns, per request, how many of its tokens were accepted
  and whether its grammar completed. The engine sends the step, processes the previous step's
  output meanwhile, and waits only before it needs the results.

A worker that dies turns the next wait into a RuntimeError (the engine then fails like any bug in
its step); `close()` stops the workers and frees the shared memory.
"""

from __future__ import annotations

import multiprocessing
import weakref
import zlib
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from tokenmill.logger import init_logger
from tokenmill.structured_outputs import StructuredOutputsParams

logger = init_logger(__name__)


@dataclass
class GrammarWork:
    """One grammar entry of a step: tokens to accept (the previous step's), then rows to fill."""

    req_id: str
    tokens: list[int]  # emitted by the previous step, to accept first
    first_row: int = -1  # of the shared mask; -1: nothing to fill (the entry does not sample)
    drafts: tuple[int, ...] = ()  # walked after row 0: rows first_row + 1 ... first_row + len(drafts)


@dataclass
class GrammarResult:
    req_id: str
    accepted: int  # tokens accepted, in order (fewer than sent: refused, or after completion)
    terminated: bool  # the grammar completed (a stop token accepted)


def worker_of(req_id: str, num_workers: int) -> int:
    return zlib.crc32(req_id.encode()) % num_workers


class GrammarWorkerPool:
    def __init__(self, tokenizer_info_json: str, vocab_size: int, num_workers: int, max_rows: int,
                 fill_threads: int = 1):
        self.num_words = -(-vocab_size // 32)
        self.max_rows = max_rows
        self.num_workers = num_workers
        self.shm = shared_memory.SharedMemory(create=True, size=max_rows * self.num_words * 4)
        self.mask = np.ndarray((max_rows, self.num_words), dtype=np.int32, buffer=self.shm.buf)
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA state
        self._conns, self._procs = [], []
        for k in range(num_workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"tokenmill-grammar-{k}", daemon=True,
                               args=(child, tokenizer_info_json, self.shm.name, max_rows, self.num_words,
                                     fill_threads))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        for k, conn in enumerate(self._conns):  # each worker says when its tokenizer info is built
            if conn.recv() != "ready":
                raise RuntimeError(f"grammar worker {k} failed to start")
        self._waiting: list[int] = []
        # Stops the workers and frees the shared memory when the pool is closed or collected.
        self._finalizer = weakref.finalize(self, _shut_down, self._conns, self._procs, self.shm)
        logger.info("structured outputs: %d grammar worker processes", num_workers)

    # ---- matchers -------------------------------------------------------------------------------
    def add(self, req_id: str, spec: StructuredOutputsParams) -> None:
        self._send(worker_of(req_id, self.num_workers), ("add", req_id, spec.key(), spec))

    def remove(self, req_id: str) -> None:
        self._send(worker_of(req_id, self.num_workers), ("remove", req_id))

    # ---- a step ---------------------------------------------------------------------------------
    def step(self, work: list[GrammarWork]) -> None:
        """Send a step's work (fills rows of self.mask); wait() collects the results."""
        if self._waiting:
            raise RuntimeError("a grammar step is already in flight")
        per: list[list[GrammarWork]] = [[] for _ in range(self.num_workers)]
        for w in work:
            per[worker_of(w.req_id, self.num_workers)].append(w)
        for k, items in enumerate(per):
            if items:
                self._send(k, ("step", items))
                self._waiting.append(k)

    def wait(self) -> list[GrammarResult]:
        results: list[GrammarResult] = []
        waiting, self._waiting = self._waiting, []
        for k in waiting:
            try:
                reply = self._conns[k].recv()
            except EOFError:
                raise RuntimeError(f"grammar worker {k} died") from None
            if isinstance(reply, BaseException):
                raise RuntimeError(f"grammar worker {k} failed: {reply!r}")
            results.extend(reply)
        return results

    def close(self) -> None:
        self._finalizer()

    def _send(self, k: int, message) -> None:
        try:
            self._conns[k].send(message)
        except (OSError, BrokenPipeError):
            raise RuntimeError(f"grammar worker {k} died") from None


def _shut_down(conns, procs, shm) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
            conn.close()
        except (OSError, BrokenPipeError):
            pass
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    shm.close()
    shm.unlink()


def _worker_main(conn, tokenizer_info_json: str, shm_name: str, max_rows: int, num_words: int,
                 fill_threads: int) -> None:
    """A worker's loop: matchers by request id, a compile cache, masks into the shared array."""
    import xgrammar as xgr

    from tokenmill.engine.structured_output import StructuredOutputManager

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    shm = shared_memory.SharedMemory(name=shm_name)
    import torch

    mask = torch.from_numpy(np.ndarray((max_rows, num_words), dtype=np.int32, buffer=shm.buf))
    batch = xgr.BatchGrammarMatcher(fill_threads) if fill_threads > 1 else None
    cache: dict[str, object] = {}
    matchers: dict[str, object] = {}
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        kind = message[0]
        if kind == "stop":
            break
        if kind == "add":
            _, req_id, key, spec = message
            compiled = cache.get(key)
            if compiled is None:
                compiled = cache[key] = StructuredOutputManager._compile(compiler, spec)
            matchers[req_id] = xgr.GrammarMatcher(compiled)
        elif kind == "remove":
            matchers.pop(message[1], None)
        elif kind == "step":
            try:
                conn.send(_do_step(message[1], matchers, mask, batch))
            except BaseException as e:  # report, then keep serving: the engine decides
                conn.send(e)
    del mask
    shm.close()


def _do_step(items: list[GrammarWork], matchers: dict, mask, batch) -> list[GrammarResult]:
    results = []
    walks = []  # (matcher, first row, drafts)
    for w in items:
        matcher = matchers.get(w.req_id)
        if matcher is None:  # finished or removed meanwhile
            continue
        accepted = 0
        for token in w.tokens:
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                break
            accepted += 1
        terminated = bool(matcher.is_terminated())
        results.append(GrammarResult(w.req_id, accepted, terminated))
        if w.first_row >= 0 and not terminated:  # (the engine set the step's rows to all ones)
            walks.append((matcher, w.first_row, w.drafts))
    accepted_drafts = [0] * len(walks)
    live = list(range(len(walks)))
    depth = 0
    while live:
        if batch is not None:
            batch.batch_fill_next_token_bitmask([walks[i][0] for i in live], mask,
                                                [walks[i][1] + depth for i in live])
        else:
            for i in live:
                walks[i][0].fill_next_token_bitmask(mask, walks[i][1] + depth)
        going = []
        for i in live:
            matcher, _, drafts = walks[i]
            if depth < len(drafts) and matcher.accept_token(int(drafts[depth])):
                accepted_drafts[i] += 1
                if not matcher.is_terminated():
                    going.append(i)
        live = going
        depth += 1
    for (matcher, _, _), n in zip(walks, accepted_drafts):
        if n:
            matcher.rollback(n)
    return results


def tokenizer_info_json(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> str:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=list(stop_token_ids) or None)
    return info.serialize_json()


__all__ = ["GrammarWork", "GrammarResult", "GrammarWorkerPool", "tokenizer_info_json", "worker_of"]
