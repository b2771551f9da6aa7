"""Block-wise FP8 checkpoints (HF fine-grained FP8: `quant_method` "fp8", `weight_block_size`
[128, 128], e4m3 `weight` [N, K] and `weight_scale_inv` [ceil(N / 128), ceil(K / 128)] that
multiplies): loaded through the real loader and converted to the per-row scales the kernels read.

The checkpoint is a tiny llama (hidden 256 = 2 blocks, q 256 rows, k/v 128 rows, intermediate 320
= 2.5 blocks: gate/up have a ragged last block row and down_proj a ragged last block column), its
block scales spread over 1/8..1 of each other (a factor per block) so that the conversion rounds
for real; the first 128-row band of every tensor of more than one band has one scale across its
column blocks (those rows must convert exactly).

Measured (this checkpoint, fp32 on the CPU): each converted weight is within one e4m3 rounding
of the block-dequantized one (bound 1/16 relative, or 2^-10 of the row's scale below e4m3's normal
range): max relative error 0.058, mean 0.0063 (over the elements in the normal range), relative
Frobenius error 0.025 per tensor at most; 48 % of the bytes of the rows whose block scales differ
change, none of the rows whose block scales are all equal. The model computes exactly (1e-5) what
the full-precision model carrying the converted weights computes; against the full-precision model
carrying the block-dequantized weights it gives the same greedy tokens and prompt logprobs within
LOGPROB_TOL (measured 0.035 at most, 0.013 on average, for logprobs of about -7).
"""

import json
import math

import pytest
import torch

from tests.quantization.test_fp8 import _assert_same_outputs, _teacher_forced_logprobs
from tokenmill.errors import ModelLoadError
from tokenmill.quantization.fp8 import FP8_MAX, dequantize_blockwise_fp8

BLOCK = 128
DIMS = dict(vocab_size=512, hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
QC = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
      "modules_to_not_convert": ["lm_head"]}
# tokenmill's fused module -> the checkpoint's projections stored in it (in row order)
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}
PROJECTIONS = [p for ps in FUSED.values() for p in ps]
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(6 + 3 * i)] for i in range(4)]
E4M3_MIN_NORMAL = 2.0 ** -6
LOGPROB_TOL = 0.05


def _save_llama(path, seed: int = 0) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**DIMS, tie_word_embeddings=False), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.05)
    model.save_pretrained(path, safe_serialization=True)


def _block_quantize(w: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], block scales [ceil(N / 128), ceil(K / 128)]) as HF's quantizer makes them (a
    block's scale is its largest |w| / 448), after scaling each block by a factor in [1/8, 1]; the
    first band of 128 rows (of a tensor of several) takes one scale, its largest."""
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    factor = 2.0 ** (-3 * torch.rand(nb, kb, generator=gen))
    w = w * factor.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    padded = torch.zeros(nb * BLOCK, kb * BLOCK)
    padded[:n, :k] = w.abs()
    scale = (padded.reshape(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    if nb > 1:
        scale[0] = scale[0].max()
    full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _write_block_checkpoint(src, dst, qc: dict = QC) -> dict:
    """A copy of the HF directory `src` with its projections in the block-wise format; returns
    {checkpoint name of the weight: (e4m3 weight, block scales)}."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    out, stored = {}, {}
    for name, t in tensors.items():
        if not any(f".{p}.weight" in name for p in PROJECTIONS):
            out[name] = t
            continue
        w_q, scale = _block_quantize(t.float(), gen)
        out[name], out[name.replace(".weight", ".weight_scale_inv")] = w_q, scale
        stored[name] = (w_q, scale)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return stored


def _block_dequantized(stored: dict) -> dict:
    """{tokenmill linear module name: its full weight, block-dequantized (fused shards concatenated)}."""
    out = {}
    for layer in range(DIMS["num_hidden_layers"]):
        for fused, parts in FUSED.items():
            out[f"model.layers.{layer}.{fused}"] = torch.cat(
                [dequantize_blockwise_fp8(*stored[f"model.layers.{layer}.{p}.weight"], (BLOCK, BLOCK))
                 for p in parts])
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("blockwise")
    _save_llama(root / "full")
    stored = _write_block_checkpoint(root / "full", root / "fp8")
    return root, stored


def _linears(model) -> dict:
    from tokenmill.layers.linear import LinearBase

    return {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}


def _with_weights(path, weights: dict):
    """The full-precision model at `path` with its linear layers' weights replaced."""
    from tokenmill.loader import load_model

    reference = load_model(str(path), device="cpu", dtype="float32")
    for name, m in _linears(reference.model).items():
        m.weight.data.copy_(weights[name])
    return reference


def test_loaded_weights_are_the_block_dequantized_ones_within_one_rounding(checkpoint):
    from tokenmill.loader import load_model

    root, stored = checkpoint
    loaded = load_model(str(root / "fp8"), device="cpu", dtype="float32")
    want = _block_dequantized(stored)
    linears = _linears(loaded.model)
    assert set(linears) == set(want)
    worst_rel, worst_frob, sums = 0.0, 0.0, [0.0, 0, 0, 0]
    for name, m in linears.items():
        assert m.weight.dtype == torch.float8_e4m3fn and "weight_scale_inv" not in dict(m.named_parameters())
        assert m.weight_scale.shape == (m.out_features,) and m.weight_scale.dtype == torch.float32
        got = m.weight.float() * m.weight_scale[:, None]
        ref = want[name]
        err = (got - ref).abs()
        row_scale = m.weight_scale[:, None].expand_as(ref)
        normal = ref.abs() >= E4M3_MIN_NORMAL * row_scale  # in e4m3's normal range at the row's scale
        rel = err[normal] / ref.abs()[normal]
        assert rel.max() <= 1 / 16 + 1e-6, name  # one e4m3 rounding: half of 2^-3 relative
        assert (err[~normal] <= 2.0 ** -10 * row_scale[~normal] * (1 + 1e-6)).all(), name  # half a subnormal step
        worst_rel = max(worst_rel, rel.max().item())
        worst_frob = max(worst_frob, ((got - ref).norm() / ref.norm()).item())
        sums[0] += rel.sum().item()
        sums[1] += rel.numel()
        # the converted scale is each row's largest block scale ...
        parts = FUSED[name.split(".", 3)[3]]
        layer = name.split(".")[2]
        blocks = torch.cat([stored[f"model.layers.{layer}.{p}.weight"][1].repeat_interleave(BLOCK, 0)[
            :stored[f"model.layers.{layer}.{p}.weight"][0].shape[0]] for p in parts])
        assert torch.equal(m.weight_scale, blocks.amax(dim=1))
        # ... so rows whose block scales are all equal (the first band of each tensor of several) keep their bytes
        uniform = (blocks == blocks[:, :1]).all(dim=1)
        stored_bytes = torch.cat([stored[f"model.layers.{layer}.{p}.weight"][0] for p in parts])
        assert uniform.sum() >= BLOCK
        assert torch.equal(m.weight[uniform].view(torch.uint8), stored_bytes[uniform].view(torch.uint8)), name
        assert torch.equal(got[uniform], ref[uniform])
        changed = m.weight[~uniform].view(torch.uint8) != stored_bytes[~uniform].view(torch.uint8)
        sums[2] += changed.sum().item()
        sums[3] += changed.numel()
    # what it costs here (module docstring): measured max 0.058, mean 0.0063, Frobenius 0.025, 48 % re-rounded
    assert 0.04 < worst_rel and worst_frob < 0.04  # it does round (the checkpoint is not trivial)
    assert sums[0] / sums[1] < 0.01  # the mean relative error
    assert 0.3 < sums[2] / sums[3] < 0.7  # the bytes that change in the rows whose block scales differ


def test_loaded_model_computes_with_the_converted_weights(checkpoint):
    """Against the full-precision model carrying the converted weights: the same greedy tokens and
    prompt logprobs within 1e-5; against it carrying the block-dequantized weights: the same greedy
    tokens, the prompt tokens' logprobs within LOGPROB_TOL (one e4m3 rounding of some weights)."""
    from tests.engine.conftest import make_llm
    from tokenmill.loader import load_model

    root, stored = checkpoint
    loaded = load_model(str(root / "fp8"), device="cpu", dtype="float32")
    converted = {name: m.weight.float() * m.weight_scale[:, None] for name, m in _linears(loaded.model).items()}
    llm = make_llm(loaded)
    _assert_same_outputs(llm, make_llm(_with_weights(root / "full", converted)), PROMPTS)
    tokens, logprobs = _teacher_forced_logprobs(llm, PROMPTS)
    want_tokens, want = _teacher_forced_logprobs(make_llm(_with_weights(root / "full", _block_dequantized(stored))),
                                                 PROMPTS)
    assert tokens == want_tokens
    worst = 0.0
    for prompt, got, ref in zip(PROMPTS, logprobs, want):
        for token, g, w in zip(prompt[1:], got[1:], ref[1:]):
            worst = max(worst, abs(g[token].logprob - w[token].logprob))
    assert worst < LOGPROB_TOL, worst


class _Rank:
    """Layers built as rank `rank` of `size` (the state layers read at construction; no process group:
    the loaders need none)."""

    def __init__(self, rank: int, size: int):
        from tokenmill.distributed import ParallelState

        self.state = ParallelState(tp_rank=rank, tp_size=size)

    def __enter__(self):
        from tokenmill.distributed import _BUILDING

        self.token = _BUILDING.set(self.state)

    def __exit__(self, *exc):
        from tokenmill.distributed import _BUILDING

        _BUILDING.reset(self.token)


def test_tensor_parallel_shards_take_their_block_scales(checkpoint, monkeypatch):
    """TP = 2 in one process: each rank's q/k/v, gate/up (shards of 128 and 64 rows, 160 rows that
    split a block) and down_proj (160 columns of 320: rank 1 starts mid-block) layers load their
    rows and columns of the block scales; converted (the row-parallel scale a max over the ranks),
    the ranks' weights are exactly one process's, split."""
    import tokenmill.layers.linear as linear_mod
    from tokenmill.layers.fp8_linear import Fp8Config
    from tokenmill.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    _, stored = checkpoint
    hidden, inter, heads, kv_heads = DIMS["hidden_size"], DIMS["intermediate_size"], 4, 2
    head_dim = hidden // heads

    def build(rank, size):
        with _Rank(rank, size):
            layers = {"self_attn.qkv_proj": QKVParallelLinear(hidden, head_dim, heads, kv_heads),
                      "mlp.gate_up_proj": MergedColumnParallelLinear(hidden, [inter, inter]),
                      "mlp.down_proj": RowParallelLinear(inter, hidden)}
        for fused, m in layers.items():
            m.set_linear_method(Fp8Config(from_checkpoint=True, block_size=(BLOCK, BLOCK)).get_linear_method(m))
            for shard, p in zip(("q", "k", "v") if "qkv" in fused else (0, 1) if "gate" in fused else (None,),
                                FUSED[fused]):
                w_q, scale = stored[f"model.layers.0.{p}.weight"]
                for param, tensor in ((m.weight, w_q), (m.weight_scale_inv, scale)):
                    param.weight_loader(param, tensor) if shard is None else param.weight_loader(param, tensor, shard)
        return layers

    one = build(0, 1)
    ranks = [build(r, 2) for r in range(2)]
    want = _block_dequantized(stored)
    for fused, m in one.items():
        full = want[f"model.layers.0.{fused}"]
        for rank, layers in enumerate(ranks):
            part = layers[fused]
            first, _ = part.linear_method.scale_block_cols(part)
            cols = torch.arange(part._col_offset(), part._col_offset() + part.in_features)
            local = part.weight.float() * part.weight_scale_inv[:, cols // BLOCK - first]
            if fused == "mlp.down_proj":
                assert torch.equal(local, full[:, cols]), (fused, rank)
            elif fused == "mlp.gate_up_proj":
                rows = [torch.arange(rank * inter // 2, (rank + 1) * inter // 2) + s * inter for s in (0, 1)]
                assert torch.equal(local, full[torch.cat(rows)]), (fused, rank)
            else:
                q, kv = heads * head_dim, kv_heads * head_dim
                rows = [torch.arange(rank * q // 2, (rank + 1) * q // 2),
                        *(torch.arange(rank * kv // 2, (rank + 1) * kv // 2) + q + s * kv for s in (0, 1))]
                assert torch.equal(local, full[torch.cat(rows)]), (fused, rank)
    # the conversion, with the row-parallel layers' max over the ranks done by hand
    down_max = torch.maximum(*(r["mlp.down_proj"].weight_scale_inv.amax(dim=1) for r in ranks))
    monkeypatch.setattr(linear_mod, "tp_all_reduce_max", lambda x, state: torch.maximum(x, down_max))
    for layers in [one, *ranks]:
        for m in layers.values():
            m.linear_method.process_weights_after_loading(m)
            assert "weight_scale_inv" not in m._parameters
    down = [r["mlp.down_proj"] for r in ranks]
    assert torch.equal(down[0].weight_scale, one["mlp.down_proj"].weight_scale)
    assert torch.equal(down[1].weight_scale, one["mlp.down_proj"].weight_scale)
    assert torch.equal(torch.cat([d.weight.view(torch.uint8) for d in down], dim=1),
                       one["mlp.down_proj"].weight.view(torch.uint8))
    gate_up = [r["mlp.gate_up_proj"] for r in ranks]
    half = inter // 2
    for rank, g in enumerate(gate_up):
        rows = torch.cat([torch.arange(rank * half, (rank + 1) * half) + s * inter for s in (0, 1)])
        assert torch.equal(g.weight.view(torch.uint8), one["mlp.gate_up_proj"].weight[rows].view(torch.uint8))
        assert torch.equal(g.weight_scale, one["mlp.gate_up_proj"].weight_scale[rows])


def test_tensor_parallel_load_equals_one_process(checkpoint):
    """TP = 2 (gloo, two processes) on the block-wise checkpoint: the greedy tokens equal one process's."""
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    root, _ = checkpoint
    path = str(root / "fp8")
    common = dict(dtype="float32", device="cpu", max_num_seqs=8, num_kv_blocks=128)
    prompts = [[(5 * i + 11 * j) % 500 + 1 for j in range(4 + 5 * i)] for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in LLM(path, **common).generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(path, tensor_parallel_size=2, **common)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    finally:
        llm.engine.close()


def _edit(root, name: str, edit) -> str:
    """A copy of the block-wise checkpoint at root/fp8 with `edit(tensors, config)` applied."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst = root / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(root / "fp8", dst)
    tensors = load_file(str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    edit(tensors, cfg)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_what_is_wrong_is_refused(checkpoint):
    from tokenmill.loader import load_model

    root, _ = checkpoint
    scale = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    down = "model.layers.0.mlp.down_proj.weight_scale_inv"

    def config(**qc):
        return lambda t, c: c["quantization_config"].update(qc)

    def drop(t, c):
        del t[scale]

    def shape(name, new_shape):
        def edit(t, c):
            t[name] = torch.ones(new_shape)
        return edit

    def bf16_weight(t, c):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16)

    def nan_scale(t, c):
        t[down][0, 1] = math.nan

    cases = [
        (config(weight_block_size=[64, 64]), r"weight_block_size \[64, 64\]: only \[128, 128\] blocks are supported"),
        (config(weight_block_size=[128, 64]), r"only \[128, 128\] blocks"),
        (config(fmt="e5m2"), "only e4m3"),
        (config(modules_to_not_convert=["lm_head", "model.layers.0.mlp.down_proj"]),
         r"modules_to_not_convert \['model.layers.0.mlp.down_proj'\]: layers left unquantized other than the LM head"),
        (drop, r"lacks 1 weights, e.g. \['model.layers.1.self_attn.qkv_proj.weight_scale_inv:k'\]"),
        # k_proj has 128 rows and 256 columns: one block row, two block columns
        (shape(scale, (1, 1)),
         r"weight_scale_inv of QKVParallelLinear shard k: checkpoint \(1, 1\), expected \(1, 2\)"),
        (shape(scale, (2, 2)), r"checkpoint \(2, 2\), expected \(1, 2\)"),
        (shape(scale, (128, 256)), r"checkpoint \(128, 256\), expected \(1, 2\)"),  # per element
        # down_proj: 256 x 320, three block columns (the last ragged)
        (shape(down, (2, 2)), r"weight_scale_inv of RowParallelLinear: checkpoint \(2, 2\), expected \(2, 3\)"),
        (bf16_weight, "stores this weight as torch.bfloat16, not float8_e4m3fn"),
        (nan_scale, r"model.layers.0.mlp.down_proj: .*weight_scale_inv has negative or non-finite values"),
    ]
    for i, (edit, message) in enumerate(cases):
        with pytest.raises(ModelLoadError, match=message):
            load_model(_edit(root, f"bad{i}", edit), device="cpu", dtype="float32")


def test_configs_as_checkpoints_ship_them():
    """Qwen3-FP8's / DeepSeek-V3's quantization_config (no modules_to_not_convert, or null), the
    "ignored_layers" alias naming the LM head, UE8M0 scales; per-tensor fp8 stays per-tensor; MoE
    routers left in full precision are kept apart, other linear layers refused."""
    from tokenmill.loader.quantize import QuantizationPlan, resolve_quantization

    block = QuantizationPlan("fp8", True, (128, 128))
    qwen3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    for qc in (qwen3, {**qwen3, "modules_to_not_convert": None}, {**qwen3, "ignored_layers": ["lm_head"]},
               {**qwen3, "scale_fmt": "ue8m0"}):
        assert resolve_quantization(None, {"quantization_config": qc}) == block
    assert resolve_quantization("fp8", {"quantization_config": qwen3}) == block
    assert resolve_quantization(None, {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}
                                ) == QuantizationPlan("fp8", True, None)
    # Qwen3-30B-A3B-FP8's: the MoE routers (and the norms) listed as not converted
    routers = ["lm_head", "model.layers.0.input_layernorm", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert resolve_quantization(None, {"quantization_config": {**qwen3, "modules_to_not_convert": routers}}) == \
        QuantizationPlan("fp8", True, (128, 128), ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate"))
    with pytest.raises(ModelLoadError, match=r"modules_to_not_convert \['model.layers.0.mlp.gate_proj'\]"):
        resolve_quantization(None, {"quantization_config": {**qwen3, "ignored_layers": ["model.layers.0.mlp.gate_proj"]}})


def test_a_dropped_model_is_freed_by_reference_counting(checkpoint):
    """Weight loaders hold their layer weakly (layers/linear.py LayerLoader): a loaded model, full
    precision or block-wise FP8, has no reference cycle, so dropping it frees it with the garbage
    collector off."""
    import gc
    import weakref

    from tokenmill.loader import load_model

    root, _ = checkpoint
    for path in (root / "full", root / "fp8"):
        loaded = load_model(str(path), device="cpu", dtype="float32")
        gc.disable()
        try:
            model = weakref.ref(loaded.model)
            del loaded
            assert model() is None, path.name
        finally:
            gc.enable()
