"""Incremental detokenization and stop-string matching for one sequence.

Decoding token by token goes wrong where a character spans several tokens (byte-level BPE) or where
a tokenizer adds spaces depending on neighbours. So each step decodes a short window ending at the
new token twice, with and without it, and appends the difference; while the window ends in an
incomplete character (U+FFFD), nothing is emitted and the window grows.
"""

from typing import Optional

from tokenmill.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
_CONTEXT = 6  # tokens of left context kept in the window for spacing decisions


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop_strings: Optional[list[str]] = None, include_stop_str: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.tokens)  # tokens before this are already in `text`
        self.text = ""
        self.stop_strings = stop_strings or []
        self.include_stop_str = include_stop_str
        self._max_stop = max((len(s) for s in self.stop_strings), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special,
                                     clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> Optional[str]:
        """Append one token; returns the stop string if the text now contains one (text is cut there)."""
        self.tokens.append(token_id)
        before = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset :])
        if after.endswith(_REPLACEMENT) or len(after) <= len(before):
            return None  # an incomplete character, or a token that decodes to nothing (yet)
        old_len = len(self.text)
        self.text += after[len(before) :]
        self.prefix_offset = max(self.read_offset - _CONTEXT, 0)
        self.read_offset = len(self.tokens)
        if len(self.tokens) > 4 * _CONTEXT:  # keep the window short
            drop = self.prefix_offset
            self.tokens = self.tokens[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> Optional[str]:
        if not self.stop_strings:
            return None
        search_from = max(0, old_len - self._max_stop + 1)
        best = None
        for stop in self.stop_strings:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.include_stop_str else self.text[:at]
        return stop

    def safe_text(self) -> str:
        """The text a stream may show now: all but the tail that could still grow into a stop string."""
        return self.text[: max(len(self.text) - max(self._max_stop - 1, 0), 0)]


def token_piece(tokenizer, token: int) -> Optional[str]:
    """How one token is shown in logprobs (None without a tokenizer)."""
    return tokenizer.decode([token]) if tokenizer is not None else None


class SampleText:
    """The text of one sample as its tokens arrive: detokenized, a stop string found (counted only
    from min_tokens on) and cut. The engine (offline) and the server's detokenizing stage both use
    it, so both give the same text and stop strings."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                  params.stop_strings, params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens
        self.num_tokens = 0

    def add_token(self, token_id: int) -> Optional[str]:
        """Append the next output token; returns the stop string that ends the sample here, if any."""
        self.num_tokens += 1
        stop = self.detokenizer.add_token(token_id)
        return stop if self.num_tokens >= self.min_tokens else None

    def text(self, finished: bool) -> str:
        """All the text once finished; before that, only what a stream may show."""
        return self.detokenizer.text if finished else self.detokenizer.safe_text()
