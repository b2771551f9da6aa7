"""Incremental detokenization and stop-string matching for one sequence.

Decoding token by token goes wrong where a character spans several tokens (byte-level BPE) or where
a tokenizer adds spaces depending on neighbours. So each step decodes a short window ending at the
new token twice, with and without it, and appends the difference; while the window ends in an
incomplete character (U+FFFD), nothing is emitted and the window grows.
"""

from typing import Optional

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
