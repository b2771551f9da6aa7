"""The graph bank's plan (which graphs a runner captures, from the weakest attention backend's
support level and the options) and the one dispatch of a step; host-side only (capture: tests/gpu)."""

import numpy as np
import pytest
from torch import nn

from tokenmill.layers.attention import Attention, CudaGraphSupport
from tokenmill.runner.cuda_graphs import (GraphKey, GraphMode, GraphPlan, dispatch_graph, resolve_graph_plan,
                                          uniform_query_len, weakest_graph_support)
from tokenmill.runner.piecewise_graphs import piecewise_sizes

FULL, PIECEWISE, NONE = GraphMode.FULL, GraphMode.PIECEWISE, GraphMode.NONE
LIMITS = dict(enabled=True, max_num_seqs=32, cuda_graph_max_batch=512, max_num_tokens=256, piecewise_max_tokens=128)


def plan(support=CudaGraphSupport.UNIFORM_BATCH, **overrides) -> GraphPlan:
    return resolve_graph_plan(support, **{**LIMITS, "verify_query_len": 4, **overrides})


@pytest.mark.parametrize("support, families, draft", [
    (CudaGraphSupport.NEVER, {(PIECEWISE, 0, False)}, 0),
    (CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE, {(PIECEWISE, 0, False), (FULL, 1, False)}, 32),
    (CudaGraphSupport.UNIFORM_BATCH, {(PIECEWISE, 0, False), (FULL, 1, False), (FULL, 4, False)}, 32),
    (CudaGraphSupport.ALWAYS, {(PIECEWISE, 0, False), (FULL, 1, False), (FULL, 4, False)}, 32),
], ids=["never", "single-token-decode", "uniform-batch", "always"])
def test_plan_follows_the_support_level(support, families, draft):
    p = plan(support)
    assert set(p.sizes) == families and p.draft_max_batch == draft
    assert p.sizes.get((PIECEWISE, 0, False)) == tuple(piecewise_sizes(128))
    for family in families - {(PIECEWISE, 0, False)}:  # decode and verify batches up to max_num_seqs
        assert p.sizes[family] == (1, 2, 4, 8, 16, 24, 32)


def test_plan_eager_only():
    assert plan(enabled=False).sizes == {} and plan(enabled=False).draft_max_batch == 0  # CPU or enforce_eager
    # NEVER without piecewise graphs: nothing to capture, every step eager
    assert plan(CudaGraphSupport.NEVER, piecewise_max_tokens=0).sizes == {}


def test_plan_limits_sizes_by_the_step_budget():
    p = plan(max_num_tokens=40, piecewise_max_tokens=2048)
    assert p.sizes[(FULL, 1, False)][-1] == 32  # max_num_seqs
    assert p.sizes[(FULL, 4, False)] == (1, 2, 4, 8, 10)  # 40 tokens // 4 per request
    assert p.sizes[(PIECEWISE, 0, False)][-1] == 40
    assert (PIECEWISE, 0, False) not in plan(max_num_tokens=8).sizes  # steps under 16 tokens: none
    plain = plan(verify_query_len=None)  # no speculative decoding: no verify or draft graphs
    assert plain.draft_max_batch == 0 and (FULL, 4, False) not in plain.sizes


def test_plan_with_lora_keys():
    p = plan(lora=True)
    assert set(p.sizes) == {(PIECEWISE, 0, False), (FULL, 1, False), (FULL, 4, False),
                            (PIECEWISE, 0, True), (FULL, 1, True)}  # verify steps with adapters: piecewise
    assert GraphKey(FULL, 8, 1, True) in p.keys() and GraphKey(FULL, 8, 4, True) not in p.keys()


def test_dispatch_smallest_captured_size_then_piecewise_then_eager():
    p = plan(lora=True)
    captured = set(p.keys())

    def go(num_reqs, num_tokens, q, lora=False):
        return dispatch_graph(p, captured, num_reqs, num_tokens, q, lora)

    assert go(3, 3, 1) == GraphKey(FULL, 4, 1)
    assert go(3, 3, 1).padded(3, 3) == (4, 4)
    assert go(32, 32, 1) == GraphKey(FULL, 32, 1)
    assert go(33, 33, 1) == GraphKey(PIECEWISE, 64)  # beyond the largest decode graph
    assert go(5, 20, 4) == GraphKey(FULL, 8, 4)  # verify: keyed by its query length
    assert go(5, 20, 4).padded(5, 20) == (8, 32)
    assert go(5, 20, 3) == GraphKey(PIECEWISE, 32)  # no graphs of 3 tokens per request
    assert go(2, 100, None) == GraphKey(PIECEWISE, 128) and go(2, 100, None).padded(2, 100) == (2, 128)
    eager = go(2, 129, None)
    assert eager == GraphKey(NONE, 129) and eager.padded(2, 129) == (2, 129)
    assert go(3, 3, 1, lora=True) == GraphKey(FULL, 4, 1, True)
    assert go(5, 20, 4, lora=True) == GraphKey(PIECEWISE, 32, 0, True)


def test_dispatch_runs_eagerly_where_nothing_is_captured():
    p = plan()
    assert dispatch_graph(p, set(), 3, 3, 1, False) == GraphKey(NONE, 3)  # before capture
    only_large = {GraphKey(FULL, 32, 1)}
    assert dispatch_graph(p, only_large, 3, 3, 1, False) == GraphKey(NONE, 3)  # never a larger size than planned
    assert dispatch_graph(GraphPlan(), set(), 1, 1, 1, False) == GraphKey(NONE, 1)


def test_uniform_query_len():
    def never():
        raise AssertionError("asked only when every entry has q > 1")

    assert uniform_query_len(np.array([1, 1, 1]), never) == 1
    assert uniform_query_len(np.array([4, 4]), lambda: True) == 4
    assert uniform_query_len(np.array([4, 4]), lambda: False) is None  # equal prompt chunks
    assert uniform_query_len(np.array([1, 4]), never) is None


def test_weakest_support_over_the_models_attention_layers():
    def layer(i):
        return Attention(2, 1, 8, 0.35, i)

    target = nn.ModuleList([layer(0), layer(1)])
    assert weakest_graph_support(target, None) is CudaGraphSupport.UNIFORM_BATCH  # the paged Triton backend
    draft = nn.ModuleList([layer(0)])
    draft[0].cuda_graph_support = CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert weakest_graph_support(target, draft) is CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert weakest_graph_support(nn.Linear(2, 2)) is CudaGraphSupport.ALWAYS  # no attention: no limit
