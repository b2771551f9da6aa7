"""The token counts piecewise CUDA graphs are captured for (the capture itself needs CUDA: tests/gpu)."""

import pytest

from tokenmill.runner.piecewise_graphs import piecewise_sizes


@pytest.mark.parametrize("max_tokens", [16, 64, 100, 2048, 8192])
def test_sizes_cover_every_step_up_to_the_largest(max_tokens):
    sizes = piecewise_sizes(max_tokens)
    assert sizes == sorted(set(sizes)) and sizes[0] == 16 and sizes[-1] == max_tokens
    for tokens in range(1, max_tokens + 1):
        padded = next(s for s in sizes if s >= tokens)
        # Small steps at most double (they cost about the same whatever their size); past 256
        # tokens, padding adds fewer than 256 tokens.
        assert padded - tokens < max(16, tokens) and (tokens <= 256 or padded - tokens < 256), (tokens, padded)
