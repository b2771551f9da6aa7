"""SamplingParams: how to pick each next token and when to stop. Validated on construction.

Shared by the engine (stopping, detokenizing) and the runner (the sampler), so it lives below both.
"""

import math
from dataclasses import dataclass, field, fields
from typing import Optional, Union

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_outputs import StructuredOutputsParams

# Bounds that keep per-request device tables small.
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 32
MAX_BAD_WORDS = 100
MAX_BAD_WORD_TOKENS = 16  # tokens of one bad word (each of its two spellings)
MAX_CACHE_SALT_CHARS = 4096
# The sampler holds these fields in float32: a value must stay finite there, and a non-zero one non-zero.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
# A positive temperature divides the logits in float32: below this the scaled logits overflow.
MIN_POSITIVE_TEMPERATURE = 1e-30
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1) means all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    logprobs: Optional[int] = None  # number of top alternatives to return beside the sampled token
    prompt_logprobs: Optional[int] = None  # the same for every prompt token after the first
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Optional[StructuredOutputsParams] = None  # constrain the output (JSON, regex, ...)
    bad_words: Optional[list[str]] = None  # words never generated
    allowed_token_ids: Optional[list[int]] = None  # sample only among these
    # Requests share prefix-cache blocks only with requests of the same salt (engine/block_hash.py)
    cache_salt: Optional[str] = None
    # bad_words as token-id sequences (resolve_bad_words, with the engine's tokenizer)
    bad_words_token_ids: list[list[int]] = field(init=False, repr=False, default_factory=list)
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias must map token ids to numbers") from None
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
            if abs(value) > FLOAT32_MAX or 0 < abs(value) < FLOAT32_TINY:
                bad(f"{name} must be representable as a 32-bit float (magnitude 0 or between "
                    f"{FLOAT32_TINY:.4g} and {FLOAT32_MAX:.4g}), got {value!r}")
        if 0 < self.temperature < MIN_POSITIVE_TEMPERATURE:
            bad(f"temperature must be 0 (greedy) or at least {MIN_POSITIVE_TEMPERATURE:g}, got {self.temperature!r}")
        if self.cache_salt is not None:
            if not isinstance(self.cache_salt, str) or not self.cache_salt:
                bad(f"cache_salt must be a non-empty string, got {self.cache_salt!r}"[:200])
            if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
                bad(f"cache_salt may be at most {MAX_CACHE_SALT_CHARS} characters long, got {len(self.cache_salt)}")
            try:
                self.cache_salt.encode("utf-8")
            except UnicodeEncodeError:
                bad("cache_salt cannot be encoded as UTF-8")

        if not is_int(self.n) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or not 0 <= self.top_k < 2**31:
            bad(f"top_k must be -1, 0 (off) or a positive integer below 2**31, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not -2**63 <= self.seed < 2**64):
            bad(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.min_tokens and self.structured_outputs is not None:
            # A grammar that completes earlier would then allow only the end-of-sequence token, which
            # min_tokens forbids.
            bad("min_tokens cannot be combined with structured_outputs: the grammar decides where the output ends")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            bad("stop must be a non-empty string or a list of non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported")
        if not isinstance(self.repetition_penalty, (int, float)) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                bad(f"{name} must be in [-2, 2], got {value!r}")
        if self.logit_bias is not None:
            if any(not math.isfinite(v) or 0 < abs(v) < FLOAT32_TINY for v in self.logit_bias.values()):
                bad("logit_bias values must be finite numbers representable as 32-bit floats")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries")
            if any(t < 0 for t in self.logit_bias) or any(not -100 <= v <= 100 for v in self.logit_bias.values()):
                bad("logit_bias keys must be token ids >= 0 and values in [-100, 100]")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or any(not isinstance(w, str) or not w
                                                                     for w in self.bad_words):
                bad("bad_words must be a list of non-empty strings")
            if len(self.bad_words) > MAX_BAD_WORDS:
                bad(f"at most {MAX_BAD_WORDS} bad_words are supported, got {len(self.bad_words)}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or any(
                    not is_int(t) or t < 0 for t in self.allowed_token_ids):
                bad("allowed_token_ids must be a list of token ids (integers >= 0)")
            if not self.allowed_token_ids:
                bad("allowed_token_ids must not be empty: no token could be sampled")

    def resolve_bad_words(self, tokenizer) -> None:
        """Tokenize bad_words into bad_words_token_ids (the engine calls it on validation).

        As vLLM does, each word is tokenized without special tokens both as given and with one
        leading space (" " + word.lstrip()), since most tokenizers spell a word differently at the
        start of a text and after a space; the sequences are deduplicated. It recomputes from
        bad_words every time, so validating the same parameters again changes nothing."""
        if not self.bad_words:
            self.bad_words_token_ids = []
            return
        if tokenizer is None:
            raise InvalidRequestError("bad_words needs the model's tokenizer, and this model has none; "
                                      "ban token ids with logit_bias instead")
        sequences: list[list[int]] = []
        for word in self.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise InvalidRequestError(f"bad word {word!r} takes {len(ids)} tokens; at most "
                                              f"{MAX_BAD_WORD_TOKENS} are supported")
                if ids and ids not in sequences:
                    sequences.append(ids)
        self.bad_words_token_ids = sequences

    @property
    def multi_token_bad_words(self) -> bool:
        """Whether some bad word takes several tokens (its ban depends on the tokens before it)."""
        return any(len(w) > 1 for w in self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        """Build from a mapping, refusing unknown fields by name."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**values)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the parameters must exist in the model's vocabulary."""
        for t in list(self.stop_token_ids) + list(self.logit_bias or {}):
            if t >= vocab_size:
                raise InvalidRequestError(f"token id {t} is outside the vocabulary (size {vocab_size})")
        if self.allowed_token_ids is not None:
            outside = [t for t in self.allowed_token_ids if t >= vocab_size]
            if outside:
                raise InvalidRequestError(f"allowed_token_ids holds {outside[0]}, outside the vocabulary "
                                          f"(size {vocab_size})")
            if len(self.allowed_token_ids) > vocab_size:
                raise InvalidRequestError(f"allowed_token_ids holds {len(self.allowed_token_ids)} ids, more than "
                                          f"the vocabulary's {vocab_size}")
