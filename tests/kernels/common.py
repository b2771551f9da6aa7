"""What the kernel tests share: the devices they run on, tolerances, and error measures.

The CPU cases run the Triton kernels in Triton's interpreter (tests/conftest.py turns it on when
there is no GPU); the CUDA cases are marked `gpu`.
"""

import os

import pytest
import torch

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
CPU = pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETER, reason="Triton on CPU needs TRITON_INTERPRET=1"))
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])
DEVICES = [CPU, CUDA]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; unwritten (NaN) elements fail."""
    assert out.shape == ref.shape
    assert not out.isnan().any(), "unwritten (NaN) elements"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture
def nan_empty(monkeypatch):
    """Fresh float tensors start as NaN, so an element the kernel forgets to write shows up."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def fp8_llama_mlp(device, dtype=torch.bfloat16):
    """Llama-3.1-8B's gate/up and down with seeded FP8 weights (quantized at load as the engine
    does) and the RMSNorm before gate/up: (gate_up, down, norm)."""
    from tokenmill.layers.fp8_linear import Fp8Config
    from tokenmill.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from tokenmill.layers.norm import RMSNorm

    torch.manual_seed(0)
    gate_up = MergedColumnParallelLinear(4096, [14336, 14336], dtype=dtype, device=device)
    down = RowParallelLinear(14336, 4096, dtype=dtype, device=device)
    norm = RMSNorm(4096, 1e-5, dtype=dtype, device=device)
    for layer in (gate_up, down):
        layer.weight.data.normal_(0, 0.02)
        layer.set_linear_method(Fp8Config().get_linear_method(layer))  # online: keeps the weights just drawn
        layer.linear_method.process_weights_after_loading(layer)
    norm.weight.data.uniform_(0.5, 1.5)
    return gate_up, down, norm
