"""Structured output on the engine side: grammars compiled once per spec, one xgrammar matcher per
request, and the packed token masks the runner applies.

- `StructuredOutputManager.compile(spec)` turns a StructuredOutputsParams into an xgrammar
  CompiledGrammar through a bounded LRU cache keyed by the spec's canonical string. It is
  thread-safe: the async engine calls it from its prepare workers (through LLMEngine.validate), so
  compiling never runs on the step loop; add_request then finds the grammar in the cache. The
  xgrammar TokenizerInfo is built once, on the first grammar, from the engine's tokenizer with the
  model's vocabulary size (the logits' width; ids past the tokenizer's own vocabulary are never
  allowed).
- Each live request with a grammar owns a GrammarMatcher (`add`), advanced with every token the
  request emits (`accept`); a token the matcher refuses is never emitted, and a request whose
  matcher has terminated (the grammar is complete and a stop token came) finishes with "stop".
- `bitmask(sched, requests)`: the step's masks, filled after the step's forward pass was launched
  and the step before it was processed (so each matcher has seen every earlier token, and async
  scheduling goes on: only the step's sampling waits for them). One int32 row per logits row of a
  grammar entry ([rows, ceil(V / 32)], bit j of word w allows token 32 w + j): a verify step's entry
  gets 1 + its drafts rows, row j being the grammar's state after the first j drafts (the matcher
  walks the drafts the device will verify, then rolls back). A row after a draft the grammar
  refuses, or after one that completes it, is all ones: the refused draft is masked in the row
  before it, so it is rejected there. A step without grammar entries gets no mask at all.
"""

import json
import os
import re
import threading
from collections import OrderedDict
from typing import Optional

import numpy as np

from tokenmill.errors import InvalidRequestError
from tokenmill.logger import init_logger
from tokenmill.step_io import GrammarBitmask, SchedulerOutput
from tokenmill.structured_outputs import StructuredOutputsParams

logger = init_logger(__name__)

DEFAULT_CACHE_SIZE = 128  # compiled grammars kept
# xgrammar's native errors start with "[hh:mm:ss] /its/source.cc:123: ": clients get the message only.
_NATIVE_LOG_PREFIX = re.compile(r"\[\d{1,2}:\d{2}:\d{2}\]\s*\S+?:\d+:\s*")
# Threads to fill a step's masks on: half the cores this process may use, at most 8.
DEFAULT_FILL_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) // 2))


def choice_grammar(choices: list) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = DEFAULT_CACHE_SIZE,
                 max_threads: int = 2, fill_threads: int = DEFAULT_FILL_THREADS):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self.max_threads = max_threads
        self._lock = threading.Lock()
        self._compiler = None  # an xgrammar GrammarCompiler, built with the first grammar
        self._cache: "OrderedDict[str, object]" = OrderedDict()
        self.num_compiled = 0  # compilations (cache misses), for tests and logs
        self.matchers: dict[str, object] = {}  # request id -> GrammarMatcher (engine thread only)
        self._bitmask = None  # a torch int32 [rows, W] scratch that the matchers fill
        # Threads an xgrammar BatchGrammarMatcher fills a step's rows on (more cost more to start
        # than they save at small batches; docs/PERFORMANCE.md has the measurement).
        self.fill_threads = fill_threads
        self._batch = None  # the BatchGrammarMatcher, built on first use
        self._batch_threads = None

    @property
    def num_words(self) -> int:
        return -(-self.vocab_size // 32)

    # ---- compiling (any thread) ---------------------------------------------------------------
    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("structured outputs need the model's tokenizer, and this model has none")
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                # Our own cache keeps what is compiled; xgrammar's would hold a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
                logger.info("structured outputs: xgrammar tokenizer info built (%d tokens)", self.vocab_size)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        """The CompiledGrammar of `spec` (from the cache when it was compiled before); an invalid
        schema, regex or grammar raises InvalidRequestError naming the problem."""
        key = spec.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiler = self._get_compiler()
        try:
            compiled = self._compile(compiler, spec)
        except InvalidRequestError:
            raise
        except Exception as e:  # xgrammar reports bad input as RuntimeError / ValueError / its own types
            message = " ".join(_NATIVE_LOG_PREFIX.sub("", str(e)).split())[:400] or type(e).__name__
            raise InvalidRequestError(f"structured_outputs.{spec.kind} could not be compiled: {message}") from None
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler, spec: StructuredOutputsParams):
        kind = spec.kind
        if kind == "json":
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            # Compact JSON (no free whitespace): a small model cannot pad its output with blank lines.
            return compiler.compile_json_schema(schema, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec.choice))
        return compiler.compile_grammar(spec.grammar)

    # ---- matchers (the engine thread) -----------------------------------------------------------
    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        self.matchers[request_id] = xgr.GrammarMatcher(self.compile(spec))

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's matcher by `token`; False if the grammar refuses it."""
        return bool(self.matchers[request_id].accept_token(int(token)))

    def terminated(self, request_id: str) -> bool:
        return bool(self.matchers[request_id].is_terminated())

    def in_step(self, sched: SchedulerOutput) -> bool:
        """Whether some entry of the step has a grammar (then its sampling waits for bitmask())."""
        return bool(self.matchers) and any(e.req_id in self.matchers for e in sched.batch)

    def bitmask(self, sched: SchedulerOutput, requests: dict) -> Optional[GrammarBitmask]:
        """The step's packed masks for its grammar entries (see the module docstring); None when it
        has none. `requests`: the live requests by id (a speculating entry's drafts)."""
        entries = [e for e in sched.batch if e.req_id in self.matchers]
        if not entries:
            return None
        import torch
        import xgrammar as xgr

        # Each entry's logits rows: 1, or 1 + k for a verify step (its drafts are verified up to
        # num_tokens - 1 of them, as the runner cuts them).
        counts = [e.num_tokens if e.speculative else 1 for e in entries]
        total = sum(counts)
        if self._bitmask is None or self._bitmask.shape[0] < total:
            self._bitmask = xgr.allocate_token_bitmask(max(total, 8), self.vocab_size)
        if self._batch is None or self._batch_threads != self.fill_threads:
            self._batch, self._batch_threads = xgr.BatchGrammarMatcher(self.fill_threads), self.fill_threads
        mask = self._bitmask[:total]
        # numpy, not torch: a torch CPU op may leave its OpenMP pool spinning on the cores the
        # matchers' threads need next
        mask.numpy().fill(-1)
        req_ids, offsets = [], []
        walks = []  # (matcher, first row, drafts to walk)
        row = 0
        for entry, count in zip(entries, counts):
            req_ids += [entry.req_id] * count
            offsets += range(count)
            if entry.samples:
                request = requests.get(entry.req_id)
                drafts = request.drafts[: count - 1] if (entry.speculative and request is not None) else []
                walks.append((self.matchers[entry.req_id], row, drafts))
            row += count
        accepted = [0] * len(walks)
        live = list(range(len(walks)))
        depth = 0
        while live:  # row `depth` of every walk still going, in one threaded call
            self._batch.batch_fill_next_token_bitmask([walks[w][0] for w in live], mask,
                                                      [walks[w][1] + depth for w in live])
            going = []
            for w in live:
                matcher, _, drafts = walks[w]
                if depth < len(drafts) and matcher.accept_token(drafts[depth]):
                    accepted[w] += 1
                    if not matcher.is_terminated():
                        going.append(w)
            live = going
            depth += 1
        for (matcher, _, _), n in zip(walks, accepted):
            if n:
                matcher.rollback(n)
        assert mask.dtype == torch.int32
        offsets_arr = np.asarray(offsets, dtype=np.int64) if total > len(entries) else None
        return GrammarBitmask(req_ids, mask.numpy().copy(), offsets_arr)
