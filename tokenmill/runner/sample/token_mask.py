"""allowed_token_ids and bad_words (vLLM's names and rules): tokens a request may never sample.

- allowed_token_ids: every other token gets -inf. Each such row holds a packed bitmask in a
  per-row table [R, ceil(V / 32)] int32 (bit j of word w allows token 32 w + j), applied with the
  structured-output kernel (kernels/token_bitmask.py); rows without the list hold all ones.
- bad_words (SamplingParams.bad_words_token_ids, one or two token sequences a word): a word of one
  token is banned always; of several, its last token is banned when the tokens before the sampled
  one equal the word's other tokens (kernels/token_mask.py: one Triton program per logits row on
  CUDA, torch ops elsewhere). Words are stored right-aligned in a [R, S, L] prefix table and a
  [R, S] table of last tokens (S = 2 * MAX_BAD_WORDS spellings, L = MAX_BAD_WORD_TOKENS - 1).

The tokens before the sampled one. The runner keeps no token history on the device outside
speculative decoding, so rows with words of several tokens keep their own: a ring [R, W] (W =
MAX_BAD_WORD_TOKENS) where the token at position q sits in column q % W. Admission writes the
last W known tokens (the prompt, plus earlier outputs after a preemption). Each later token is
picked up at the start of the row's next sampling step, on the device: a row sampling position p
whose p - 1 was not known at admission finds the token of p - 1 in last_sampled (the
post-update of the step that sampled it wrote it there, earlier on the same stream) and writes it
at column (p - 1) % W before reading its last L columns. This is exact under async scheduling
(the step in flight has already written last_sampled when the next step's sampler runs on the
device, whatever the host knows), with chunked prefill (a chunk that does not sample has p - 1
below the admission count and writes nothing), for each of n samples (each has a row) and after
preemption (the new row starts from the engine's tokens). Every token of such a row is
written before it is read, because the row is in every step that samples for it and this stage
runs in each of them. Requests with words of several tokens never speculate
(SpeculativeDecoder.eligible), so one logits row a step reaches such a row. The runner binds
last_sampled (bind_last_sampled) once its request states exist.

needed() reads numpy mirrors only; nothing is allocated before the first request that uses
a feature, and a batch where no row uses them runs nothing.
"""

from typing import Optional

import numpy as np
import torch

from tokenmill.kernels.token_bitmask import apply_token_bitmask
from tokenmill.kernels.token_mask import NO_TOKEN, WILDCARD, apply_bad_words
from tokenmill.logger import init_logger
from tokenmill.step_io import NewRequestData
from tokenmill.runner.request_states import RowParams
from tokenmill.runner.sample.stage import SampleBatch, SamplingStage
from tokenmill.runner.staged_write import StagedWriteTensor
from tokenmill.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS

logger = init_logger(__name__)

MAX_WORDS = 2 * MAX_BAD_WORDS  # token sequences a row: each word as given and after a space
PREFIX = MAX_BAD_WORD_TOKENS - 1  # tokens before a word's last one
RING = MAX_BAD_WORD_TOKENS  # the history ring's width (> PREFIX, so a read never meets the write)
NOT_TRACKED = 2**62  # the admission count of a row without words of several tokens: never reads last_sampled


class TokenMaskStage(SamplingStage):
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self.device = device
        # Host mirrors, per row: whether it has allowed_token_ids, its count of word spellings, and
        # its longest word's prefix length (0 for words of one token).
        self.has_allowed = np.zeros(max_num_reqs, dtype=bool)
        self.word_count = np.zeros(max_num_reqs, dtype=np.int64)
        self.prefix_len = np.zeros(max_num_reqs, dtype=np.int64)
        # Tokens known at admission for rows that track a history (NOT_TRACKED elsewhere).
        self._known = RowParams((NOT_TRACKED,), max_num_reqs, np.int64, device)
        self.known_gpu = self._known.gpu[0]
        self.last_sampled: Optional[torch.Tensor] = None  # RequestStates.last_sampled [R], bound by the runner
        # Allocated on first use.
        self.allowed: Optional[StagedWriteTensor] = None  # [R, ceil(V / 32)] int32 bitmask
        self.prefix: Optional[StagedWriteTensor] = None  # [R, MAX_WORDS * PREFIX] int32
        self.last: Optional[StagedWriteTensor] = None  # [R, MAX_WORDS] int32, -1: no word
        self.history: Optional[StagedWriteTensor] = None  # [R, RING] int32 ring, by position % RING

    def bind_last_sampled(self, last_sampled: torch.Tensor) -> None:
        """The runner's per-row last sampled token (RequestStates.last_sampled), which the
        post-update writes after every step's sampling."""
        self.last_sampled = last_sampled

    # ---- rows -----------------------------------------------------------------------------
    def add_request(self, row: int, new: NewRequestData) -> None:
        params = new.params
        self._add_allowed(row, params.allowed_token_ids)
        words = [w for w in params.bad_words_token_ids if all(t < self.vocab_size for t in w)]
        if len(words) < len(params.bad_words_token_ids):
            logger.warning("request %s: bad-word tokens outside the vocabulary (size %d) are ignored",
                           new.req_id, self.vocab_size)
        words = words[:MAX_WORDS]
        if words:
            prefix, last = self._word_tables()
            table = np.full((MAX_WORDS, PREFIX), WILDCARD, dtype=np.int32)
            for s, word in enumerate(words):
                if len(word) > 1:
                    table[s, PREFIX - (len(word) - 1):] = word[:-1]
            prefix.stage(row, 0, table[: len(words)])
            last.stage(row, 0, [w[-1] for w in words] + [-1] * (MAX_WORDS - len(words)))
        elif self.word_count[row]:
            # The row's last owner had words: clear them, or a batch with words would ban them here.
            self.last.stage(row, 0, [-1] * MAX_WORDS)
        self.word_count[row] = len(words)
        longest = max((len(w) - 1 for w in words), default=0)
        self.prefix_len[row] = longest
        if longest:
            if self.last_sampled is None:
                raise RuntimeError("bad words of several tokens need the runner's last_sampled "
                                   "(TokenMaskStage.bind_last_sampled)")
            self._add_history(row, new.token_ids)
        else:
            self._known.set(row, (NOT_TRACKED,))

    def apply_staged(self) -> None:
        self._known.apply_staged()
        for table in (self.allowed, self.prefix, self.last, self.history):
            if table is not None:
                table.apply()

    def needed(self, rows: np.ndarray) -> bool:
        return bool(self.has_allowed[rows].any() or self.word_count[rows].any())

    # ---- the step -------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, batch: SampleBatch) -> None:
        idx, rows = batch.idx, batch.rows
        if self.has_allowed[rows].any():
            apply_token_bitmask(logits, self.allowed.gpu[idx])
        count = int(self.word_count[rows].max())
        if count:
            ring = self.history.gpu if self.history is not None else None
            prefix = self.prefix.gpu.view(self.max_num_reqs, MAX_WORDS, PREFIX)
            apply_bad_words(logits, idx, batch.positions, self.known_gpu, self.last_sampled, ring, prefix,
                            self.last.gpu, count, int(self.prefix_len[rows].max()))

    # ---- tables ---------------------------------------------------------------------------
    def _add_allowed(self, row: int, allowed: Optional[list[int]]) -> None:
        if allowed:
            if self.allowed is None:
                self.allowed = StagedWriteTensor((self.max_num_reqs, self.num_words), torch.int32, self.device)
                self.allowed.gpu.fill_(-1)
            ids = np.asarray(allowed, dtype=np.int64)
            bits = np.zeros(self.num_words, dtype=np.uint32)
            np.bitwise_or.at(bits, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
            self.allowed.stage(row, 0, bits.view(np.int32))
        elif self.has_allowed[row]:  # the last owner's list must not constrain the new one
            self.allowed.stage(row, 0, np.full(self.num_words, -1, dtype=np.int32))
        self.has_allowed[row] = bool(allowed)

    def _word_tables(self) -> tuple[StagedWriteTensor, StagedWriteTensor]:
        if self.prefix is None:
            self.prefix = StagedWriteTensor((self.max_num_reqs, MAX_WORDS * PREFIX), torch.int32, self.device)
            self.last = StagedWriteTensor((self.max_num_reqs, MAX_WORDS), torch.int32, self.device)
            self.last.gpu.fill_(-1)
        return self.prefix, self.last

    def _add_history(self, row: int, token_ids: list[int]) -> None:
        if self.history is None:
            self.history = StagedWriteTensor((self.max_num_reqs, RING), torch.int32, self.device)
        known = len(token_ids)
        ring = np.full(RING, NO_TOKEN, dtype=np.int32)
        for pos in range(max(0, known - RING), known):
            ring[pos % RING] = token_ids[pos]
        self.history.stage(row, 0, ring)
        self._known.set(row, (known,))
