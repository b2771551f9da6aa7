"""The host-memory KV tier on CUDA (pinned host memory, copies on a side stream): the CPU test's
workload (tests/engine/test_kv_offload.py: GPU eviction and host reload, preemption, a LoRA adapter,
a cache salt, greedy and seeded) gives the outputs it gives without the tier, with loads in the step
that needs them (the forward pass waits on the copy's event) and asynchronous ones, CUDA graphs on."""

import pytest
import torch

from tests.engine.conftest import assert_no_leaks
from tests.engine.test_kv_offload import offloading, run, tier, tiny_adapter, workload
from tokenmill.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def tiny_cuda():
    return load_model("tiny-llama", load_format="dummy", device="cuda", dtype="float32")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return tiny_adapter(tmp_path_factory.mktemp("lora") / "a")


@pytest.fixture(scope="module")
def plain_cuda(tiny_cuda, adapter):
    llm = tier(tiny_cuda)
    out = run(llm, workload(adapter))
    assert llm.engine.scheduler.num_preemptions > 0
    return [[tokens for tokens, _, _ in batch] for batch in out]


@pytest.mark.parametrize("load_async", [False, True], ids=["in-step-loads", "async-loads"])
def test_outputs_equal_those_without_the_host_tier_on_cuda(tiny_cuda, adapter, plain_cuda, load_async):
    llm = tier(tiny_cuda, kv_transfer_config=offloading(load_async=load_async))
    got = run(llm, workload(adapter))
    assert [[tokens for tokens, _, _ in batch] for batch in got] == plain_cuda
    assert sum(h for batch in got[1:] for _, _, h in batch) > 0  # later rounds reloaded from the host
    host = llm.engine.snapshot().kv_offload
    assert host.blocks_saved > 0 and host.blocks_loaded > 0 and host.load_seconds > 0 and host.failed_loads == 0
    assert llm.engine.runner.kv_connector.store.is_pinned()
    assert_no_leaks(llm)
