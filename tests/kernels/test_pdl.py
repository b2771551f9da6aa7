"""When kernels launch with programmatic dependent launch (kernels/pdl.py)."""

import pytest
import torch

from tokenmill.kernels.pdl import pdl_enabled, pdl_launch


def test_off_on_the_cpu_and_by_environment(monkeypatch):
    assert not pdl_enabled(torch.zeros(1))
    assert pdl_launch(False) == {} and pdl_launch(True) == {"launch_pdl": True}
    if torch.cuda.is_available():
        monkeypatch.setenv("TOKENMILL_PDL", "0")
        assert not pdl_enabled(torch.zeros(1, device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_for_hopper(monkeypatch):
    monkeypatch.delenv("TOKENMILL_PDL", raising=False)
    major = torch.cuda.get_device_capability()[0]
    assert pdl_enabled(torch.zeros(1, device="cuda")) == (major >= 9)
