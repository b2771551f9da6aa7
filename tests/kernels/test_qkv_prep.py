"""qkv_prep: the fused q/k norm + rotary + KV write against the torch reference and against the
separate kernels it replaces (interpreter at small shapes on CPU, real model shapes on CUDA)."""

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from tokenmill.kernels import qkv_prep as qkv_prep_module
from tokenmill.kernels.attention import write_kv_cache_ref, write_kv_cache_triton
from tokenmill.kernels.norm import rms_norm_ref, rms_norm_triton
from tokenmill.kernels.qkv_prep import qkv_prep, qkv_prep_ref, qkv_prep_triton
from tokenmill.kernels.rotary import rotary_ref, rotary_triton
from tokenmill.layers.rotary import RotaryEmbedding, rope_inv_freq

from tests.kernels.common import DEVICES, TOL, rel_err  # noqa: F401

EPS = 1e-6
PAGE = 16


@dataclass
class Shape:
    name: str
    hq: int
    hk: int
    d: int
    qk_norm: bool
    rope: str  # "default" or "llama3"


QWEN3_SMALL = Shape("qwen3", 16, 8, 128, True, "default")
LLAMA_SMALL = Shape("llama", 4, 2, 64, False, "llama3")
GROUP3_SMALL = Shape("group3-norm", 6, 2, 64, True, "default")  # a group that is not a power of two
DIM48_SMALL = Shape("dim48-norm", 2, 1, 48, True, "default")  # head_dim not a power of two
QWEN3_0_6B = Shape("qwen3-0.6b", 16, 8, 128, True, "default")
LLAMA_3_8B = Shape("llama3.1-8b", 32, 8, 128, False, "llama3")


def rotary_table(shape: Shape, max_pos: int, device) -> torch.Tensor:
    if shape.rope == "llama3":
        inv_freq = rope_inv_freq(shape.d, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    else:
        inv_freq = rope_inv_freq(shape.d, 1000000.0)
    return RotaryEmbedding(shape.d, max_pos, inv_freq, device=device).cos_sin_cache


@dataclass
class Step:
    qkv: torch.Tensor  # [T, (Hq + 2 Hk) D], as the qkv projection writes it
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cos_sin: torch.Tensor
    q_w: Optional[torch.Tensor]
    k_w: Optional[torch.Tensor]

    def caches(self, num_pages: int):
        """Fresh NaN-filled (k_cache, v_cache): slots nobody writes stay NaN."""
        hk, d = self.k.shape[1:]
        return tuple(torch.full((num_pages, PAGE, hk, d), float("nan"), dtype=self.k.dtype, device=self.k.device)
                     for _ in range(2))


def make_step(shape: Shape, tokens: int, num_pages: int, dtype, device, max_pos: int = 4096) -> Step:
    hq, hk, d = shape.hq, shape.hk, shape.d
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=device, dtype=dtype)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(tokens, hk, d)
    v = qkv[:, (hq + hk) * d:].view(tokens, hk, d)
    positions = torch.randint(0, max_pos, (tokens,), device=device)
    slots = torch.randperm(num_pages * PAGE, device=device)[:tokens]
    slots[1::3] = -1  # padding tokens: nothing is stored for them
    q_w = k_w = None
    if shape.qk_norm:
        q_w = (1 + 0.2 * torch.randn(d, device=device)).to(dtype)
        k_w = (1 + 0.2 * torch.randn(d, device=device)).to(dtype)
    return Step(qkv, q, k, v, positions, slots, rotary_table(shape, max_pos, device), q_w, k_w)


def run_fused(fn, s: Step, k_cache, v_cache):
    return fn(s.positions, s.q, s.k, s.v, s.cos_sin, k_cache, v_cache, s.slots, s.q_w, s.k_w, EPS)


def run_unfused(s: Step, k_cache, v_cache, triton: bool):
    """The chain the fused op replaces, as LlamaAttention.forward ran it before."""
    norm, rotary, write = (rms_norm_triton, rotary_triton, write_kv_cache_triton) if triton \
        else (rms_norm_ref, rotary_ref, write_kv_cache_ref)
    tokens, hq, d = s.q.shape
    q, k, v = s.q, s.k, s.v
    if s.q_w is not None:
        q = norm(q.reshape(-1, d), s.q_w, EPS).view(tokens, hq, d)
        k = norm(k.reshape(-1, d), s.k_w, EPS).view(tokens, -1, d)
    else:  # the Triton rotary works in place: keep the step's own qkv untouched
        q, k = q.clone(), k.clone()
    q, k = rotary(s.positions, q, k, s.cos_sin)
    write(k, v, k_cache, v_cache, s.slots)
    return q


def assert_within_ulp(out: torch.Tensor, ref: torch.Tensor):
    """|out - ref| <= one unit in the last place of the largest element of each head."""
    bound = torch.finfo(out.dtype).eps * ref.float().abs().amax(-1, keepdim=True)
    bad = (out.float() - ref.float()).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements differ by more than 1 ulp"


def assert_same_cache(out: torch.Tensor, ref: torch.Tensor, exact: bool):
    assert torch.equal(out.isnan(), ref.isnan()), "written slots differ"
    written = ~ref.isnan()
    if exact:
        assert torch.equal(out[written], ref[written])
    else:
        assert_within_ulp(out.nan_to_num(0.0), ref.nan_to_num(0.0))


def _cases(device):
    if device == "cpu":
        return [(shape, t, dt) for shape in (QWEN3_SMALL, LLAMA_SMALL, GROUP3_SMALL, DIM48_SMALL) for t in (1, 7)
                for dt in (torch.float32, torch.bfloat16)]
    return [(shape, t, dt) for shape in (QWEN3_0_6B, LLAMA_3_8B) for t in (1, 37, 300, 8192)
            for dt in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grid", ["token-kv-head", "token"])
def test_qkv_prep(device, grid, monkeypatch):
    """Fused Triton == the separate Triton kernels (bit-exact in the interpreter, within 1 ulp on the
    GPU where the compiler may contract differently) and close to the torch reference."""
    monkeypatch.setattr(qkv_prep_module, "TOKEN_GRID_MIN_TOKENS", 1 if grid == "token" else 1 << 30)
    exact = device == "cpu"
    torch.manual_seed(0)
    for shape, tokens, dtype in _cases(device):
        # Triton's interpreter rounds to bf16 by truncation, torch to nearest: looser against torch.
        ref_tol = 2 * TOL[dtype] if device == "cpu" and dtype == torch.bfloat16 else TOL[dtype]
        num_pages = tokens // PAGE + 2
        s = make_step(shape, tokens, num_pages, dtype, device)
        qkv_before = s.qkv.clone()
        ref_caches, fused_caches, unfused_caches = s.caches(num_pages), s.caches(num_pages), s.caches(num_pages)

        q_ref = run_fused(qkv_prep_ref, s, *ref_caches)
        q_fused = run_fused(qkv_prep_triton, s, *fused_caches)
        q_unfused = run_unfused(s, *unfused_caches, triton=True)
        assert torch.equal(s.qkv, qkv_before), "the qkv buffer must be left as it was"
        assert q_fused.is_contiguous() and q_fused.dtype == dtype

        case = (shape.name, tokens, dtype)
        if exact:
            assert torch.equal(q_fused, q_unfused), case
        else:
            assert_within_ulp(q_fused, q_unfused)
        for out, unf in zip(fused_caches, unfused_caches):
            assert_same_cache(out, unf, exact)
        assert rel_err(q_fused, q_ref) < ref_tol, case
        for out, ref in zip(fused_caches, ref_caches):
            assert torch.equal(out.isnan(), ref.isnan()), case
            assert rel_err(out.nan_to_num(0.0), ref.nan_to_num(0.0)) < ref_tol, case


@pytest.mark.parametrize("shape", [QWEN3_SMALL, LLAMA_SMALL], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_matches_old_composition(shape, dtype):
    """The torch reference is exactly the chain the model ran before (norm, rotary, KV write)."""
    torch.manual_seed(1)
    s = make_step(shape, 9, 2, dtype, "cpu")
    new_caches, old_caches = s.caches(2), s.caches(2)
    q_new = run_fused(qkv_prep_ref, s, *new_caches)
    q_old = run_unfused(s, *old_caches, triton=False)
    torch.testing.assert_close(q_new, q_old, rtol=0, atol=0)
    for new, old in zip(new_caches, old_caches):
        torch.testing.assert_close(new, old, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_no_tokens(device):
    s = make_step(QWEN3_SMALL, 0, 1, torch.float32, device)
    k_cache, v_cache = s.caches(1)
    q = run_fused(qkv_prep_triton, s, k_cache, v_cache)
    assert q.shape == (0, QWEN3_SMALL.hq, QWEN3_SMALL.d)
    assert k_cache.isnan().all() and v_cache.isnan().all()


def test_dispatch_cpu_uses_reference():
    torch.manual_seed(2)
    s = make_step(LLAMA_SMALL, 4, 1, torch.float32, "cpu")
    caches, ref_caches = s.caches(1), s.caches(1)
    q = run_fused(qkv_prep, s, *caches)
    torch.testing.assert_close(q, run_fused(qkv_prep_ref, s, *ref_caches), rtol=0, atol=0)
    for c, r in zip(caches, ref_caches):
        torch.testing.assert_close(c, r, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_out_argument(device):
    """With `out` (piecewise CUDA graphs' shared q buffer) the rotated q lands there, equal to the
    reference's, through the dispatcher and the Triton function alike."""
    torch.manual_seed(3)
    s = make_step(QWEN3_SMALL, 5, 1, torch.float32, device)
    q_ref = run_fused(qkv_prep_ref, s, *s.caches(1))
    for fn in (qkv_prep, qkv_prep_triton):
        out = torch.full_like(q_ref, float("nan"))
        got = fn(s.positions, s.q, s.k, s.v, s.cos_sin, *s.caches(1), s.slots, s.q_w, s.k_w, EPS, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert rel_err(out, q_ref) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_fixed_grid_rows_are_the_same_in_every_step(device, monkeypatch):
    """fixed_grid (batch-invariant mode): a token's rotated q and cache row are bitwise the same
    in a step of 1 token and in one past TOKEN_GRID_MIN_TOKENS (where the default grid changes)."""
    torch.manual_seed(1)
    if device == "cpu":  # the interpreter at small shapes: the default grid would switch at 4 tokens
        monkeypatch.setattr(qkv_prep_module, "TOKEN_GRID_MIN_TOKENS", 4)
    shape = QWEN3_0_6B if device == "cuda" else GROUP3_SMALL
    tokens = qkv_prep_module.TOKEN_GRID_MIN_TOKENS + 4
    pages = tokens // PAGE + 2
    s = make_step(shape, tokens, pages, torch.bfloat16, device)
    s.slots = torch.arange(tokens, device=device)  # every token stores its k/v
    caches = s.caches(pages)
    full = qkv_prep_triton(s.positions, s.q, s.k, s.v, s.cos_sin, *caches, s.slots, s.q_w, s.k_w, EPS,
                           fixed_grid=True)
    for t in (0, 3, tokens - 1):
        one_caches = s.caches(pages)
        sl = slice(t, t + 1)
        one = qkv_prep_triton(s.positions[sl], s.q[sl], s.k[sl], s.v[sl], s.cos_sin, *one_caches, s.slots[sl],
                              s.q_w, s.k_w, EPS, fixed_grid=True)
        assert torch.equal(one[0], full[t]), t
        assert torch.equal(one_caches[0][t // PAGE, t % PAGE], caches[0][t // PAGE, t % PAGE]), t
