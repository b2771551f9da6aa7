"""tokenmill's torch dequantization equals the gguf package's reference for each block format."""

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as Q

from tokenmill.loader.gguf_dequant import dequantize


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.F16, Q.BF16])
def test_dequant_matches_gguf(qtype):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((8, 256)).astype(np.float32)
    packed = quants.quantize(values, qtype)
    expected = quants.dequantize(packed, qtype)
    ours = dequantize(packed.reshape(-1).view(np.uint8), qtype, (8, 256))
    assert torch.equal(ours.float(), torch.from_numpy(expected).float())
    # and the format really approximates the input
    assert np.abs(expected - values).max() < 0.5
