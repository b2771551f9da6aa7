"""The checks a request passes before it is queued, from the model's fixed facts only (tokenizer,
vocabulary, context length, KV-cache size, grammar compiler): so the API server process can run
them as well as the engine, and a request refused here never reaches the engine.

A text prompt is measured before it is tokenized: no token is longer than the tokenizer's longest
vocabulary entry (in characters; a byte-level entry has a character per byte), so a text longer than
max_model_len times that cannot fit the context, and is refused without spending the CPU time of
tokenizing it (megabytes of text take tens of seconds).
"""

from typing import Optional

from tokenmill.engine.kv_cache_manager import fits_problem
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams


def longest_token_chars(tokenizer) -> int:
    """The length in characters of the tokenizer's longest vocabulary entry (added tokens included)."""
    vocab = tokenizer.get_vocab()
    return max((len(t) for t in vocab), default=1) or 1


def check_prompt_chars(text: str, max_chars: int, max_model_len: int, what: str = "the prompt") -> None:
    """InvalidRequestError if `text` is too long to fit the context whatever its tokens (before tokenizing);
    max_chars: max_model_len x longest_token_chars."""
    if len(text) > max_chars:
        raise InvalidRequestError(f"{what} has {len(text)} characters, more than the {max_chars} that could fit the "
                                  f"context length of {max_model_len} tokens")


class RequestValidator:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, num_blocks: int, block_size: int,
                 structured=None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.structured = structured  # a StructuredOutputManager: grammars are compiled (and cached) here
        self._max_prompt_chars: Optional[int] = None

    @property
    def max_prompt_chars(self) -> int:
        """The most characters a text prompt that fits the context can have (computed on first use)."""
        if self._max_prompt_chars is None:  # a race only computes it twice
            self._max_prompt_chars = self.max_model_len * longest_token_chars(self.tokenizer)
        return self._max_prompt_chars

    def tokenize(self, prompt, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass the prompt as token ids")
            check_prompt_chars(prompt, self.max_prompt_chars, self.max_model_len)
            ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidRequestError("a prompt must be a string or a list of token ids")
        self.check_prompt_ids(ids)
        return ids

    def check_prompt_ids(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]!r} is outside the vocabulary (size {vocab})")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Every check that needs the model; returns the resolved max_tokens."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling parameters must be SamplingParams, got {type(params).__name__}")
        params.validate()
        params.check_vocab(self.vocab_size)
        params.resolve_bad_words(self.tokenizer)
        self.check_prompt_ids(prompt_ids)
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens, but the context length is {self.max_model_len}")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt_ids)
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens the "
                                      "context leaves for output")
        problem: Optional[str] = fits_problem(len(prompt_ids), max_tokens, self.max_model_len, self.num_blocks,
                                              self.block_size)
        if problem:
            raise InvalidRequestError(problem)
        if params.structured_outputs is not None and self.structured is not None:
            self.structured.compile(params.structured_outputs)  # an invalid grammar is refused here
        return max_tokens
