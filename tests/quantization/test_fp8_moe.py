"""FP8 experts (layers/fp8_moe.py) in whole models, on the CPU in fp32.

Online (`quantization="fp8"`) on tests/models/test_moe_families.py's tiny random Qwen3-MoE: every
linear layer and every expert is e4m3 with per-row scales; the model computes exactly what the
full-precision model holding the dequantized weights computes (logits and the engine's greedy
tokens), and its logits are within ONLINE_HF_TOL of HF's fp32 model.

Block-wise checkpoint (HF fine-grained FP8, [128, 128] blocks) written here from a Qwen3-MoE of
hidden 256 and expert width 160 (2 x 2 blocks an expert projection, the last ragged), laid out as
Qwen3-30B-A3B-FP8 is (per-expert weights and `weight_scale_inv`, the routers in full precision and
listed in `modules_to_not_convert` with the norms), its block scales spread over 1/8..1 as
tests/quantization/test_fp8_blockwise.py does: the experts load
within one e4m3 rounding of the block-dequantized weights (the conversion to per-row scales), the
model computes exactly what a full-precision model holding the converted weights computes, and its
logits are within BLOCK_TOL of the model holding the block-dequantized weights.

Measured (fp32, CPU; relative Frobenius errors of the logits per sequence, of the weights per
tensor): online FP8 against HF fp32, 0.0070 and 0.0090 (the dequantized model's logits: equal, 0.0);
block-wise, each expert projection converted to per-row scales against its block-dequantized
weight 0.0065 on average, 0.019 at most (15 % of the experts' elements change by one e4m3
rounding), and the logits against the block-dequantized model's 0.0011 and 0.0013: what converting
the block scales to per-row ones costs here, with block scales spread over 1/8..1 of each other
(wider than a trained checkpoint's neighbouring blocks).
"""

import json
import shutil

import pytest
import torch

from tests.engine.conftest import make_llm
from tests.helpers import full_logits
from tests.models.moe_helpers import COMMON, VOCAB, save_byte_tokenizer, save_random_moe_model
from tests.quantization.test_fp8_blockwise import QC, _block_quantize
from tokenmill.errors import ModelLoadError
from tokenmill.kernels.fused_moe import dequantize_experts_fp8
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.linear import LinearBase
from tokenmill.loader import load_model
from tokenmill.quantization.fp8 import (FP8_DTYPE, dequantize_blockwise_fp8, dequantize_weight_fp8,
                                        quantize_weight_fp8)
from tokenmill.sampling_params import SamplingParams

ONLINE_HF_TOL = 0.02  # measured 0.009 at most (module docstring)
BLOCK_TOL = 0.01  # measured 0.0013 at most


def _sequences(n=(7, 40), seed=1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (length,), generator=gen).tolist() for length in n]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _quantized(name: str, t: torch.Tensor, routers: bool = True) -> bool:
    """Whether tokenmill holds this checkpoint tensor in FP8: the linear layers' and experts'
    matrices (not the embedding, the LM head or the norms; the routers unless `routers` is False)."""
    return (t.dim() == 2 and "embed_tokens" not in name and not name.startswith("lm_head")
            and (routers or not name.endswith("mlp.gate.weight")))


def _rewrite(src, dst, edit, quantization_config=None) -> None:
    """A copy of the HF directory src with every FP8-held tensor replaced by edit(name, tensor),
    which returns {name: tensor} (so it may add a block-scale tensor beside the weight); with a
    quantization_config (a checkpoint's), the routers stay as they are."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in state.items():
        out.update(edit(name, t) if _quantized(name, t, routers=quantization_config is None) else {name: t})
    save_file(out, str(dst / "model.safetensors"))
    if quantization_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(cfg))


def _dequantized_from(fp8_model, full_model) -> None:
    """full_model's weights set to fp8_model's, dequantized (the same architecture, module by module)."""
    fp8_modules = dict(fp8_model.named_modules())
    with torch.no_grad():
        for name, m in full_model.named_modules():
            q = fp8_modules[name]
            if isinstance(m, FusedMoE):
                m.w13_weight.copy_(dequantize_experts_fp8(q.w13_weight, q.w13_weight_scale, torch.float32))
                m.w2_weight.copy_(dequantize_experts_fp8(q.w2_weight, q.w2_weight_scale, torch.float32))
            elif isinstance(m, LinearBase) and q.weight.dtype == FP8_DTYPE:
                m.weight.copy_(dequantize_weight_fp8(q.weight, q.weight_scale, torch.float32))


# ----------------------------------------------------------------------------------------------
# Online quantization
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    """(HF fp32 model, tokenmill's FP8 load of it, tokenmill's load of the dequantized checkpoint)."""
    root = tmp_path_factory.mktemp("fp8_moe")
    hf = save_random_moe_model("qwen3_moe", root / "hf")

    def round_trip(name, t):
        return {name: dequantize_weight_fp8(*quantize_weight_fp8(t), torch.float32)}

    _rewrite(root / "hf", root / "dequantized", round_trip)
    fp8 = load_model(str(root / "hf"), dtype="float32", device="cpu", quantization="fp8")
    full = load_model(str(root / "dequantized"), dtype="float32", device="cpu")
    return hf, fp8, full, root


def test_online_experts_are_e4m3_with_row_scales(online):
    _, fp8, full, _ = online
    sparse = [layer.mlp.experts for layer in fp8.model.model.layers if hasattr(layer.mlp, "experts")]
    assert len(sparse) == 2  # layer 1 is dense (mlp_only_layers)
    ref = {n: p for n, p in full.model.named_parameters()}
    for name, m in fp8.model.named_modules():
        if isinstance(m, FusedMoE):
            assert m.w13_weight.dtype == m.w2_weight.dtype == FP8_DTYPE
            assert m.w13_weight_scale.shape == (8, 64) and m.w2_weight_scale.shape == (8, 64)
            # the checkpoint's experts quantized per row, as the round trip above quantizes them
            assert torch.equal(dequantize_experts_fp8(m.w13_weight, m.w13_weight_scale, torch.float32),
                               ref[f"{name}.w13_weight"])
            assert torch.equal(dequantize_experts_fp8(m.w2_weight, m.w2_weight_scale, torch.float32),
                               ref[f"{name}.w2_weight"])


def test_online_logits_are_the_dequantized_models_and_near_hf(online):
    hf, fp8, full, _ = online
    seqs = _sequences()
    ours, deq = full_logits(fp8.model, seqs), full_logits(full.model, seqs)
    errs = []
    for seq, a, b in zip(seqs, ours, deq):
        assert _rel(a, b) < 1e-6
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        errs.append(_rel(a, ref))
    assert max(errs) < ONLINE_HF_TOL, errs


def test_online_engine_greedy_matches_the_dequantized_engine(online):
    _, fp8, full, _ = online
    prompts = _sequences((5, 29), seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    got = [o.outputs[0].token_ids for o in make_llm(fp8).generate(prompts, greedy, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in make_llm(full).generate(prompts, greedy, use_tqdm=False)]
    assert got == want


def test_online_dummy_weights_are_the_full_precision_ones_quantized(online):
    """Dummy weights with quantization="fp8": each expert is the full-precision dummy model's,
    quantized per row (the scales are drawn from nothing, so every other weight keeps its values)."""
    _, _, _, root = online
    fp8 = load_model(str(root / "hf"), load_format="dummy", dtype="float32", device="cpu", quantization="fp8")
    full = load_model(str(root / "hf"), load_format="dummy", dtype="float32", device="cpu")
    want = dict(full.model.named_parameters())
    for name, m in fp8.model.named_modules():
        if isinstance(m, FusedMoE):
            for weight in ("w13_weight", "w2_weight"):
                w = want[f"{name}.{weight}"]
                for e in range(w.shape[0]):
                    w_q, s = quantize_weight_fp8(w[e])
                    assert torch.equal(getattr(m, weight)[e], w_q) and torch.equal(getattr(m, f"{weight}_scale")[e], s)
    assert torch.equal(fp8.model.model.embed_tokens.weight, full.model.model.embed_tokens.weight)


def test_experts_are_never_allocated_in_the_model_dtype(online, monkeypatch):
    """The FP8 method is the layers' from their construction (loader/quantize.expert_quantization):
    no [E, 2I, H] stack in the model dtype exists first, so peak memory is the FP8 model's."""
    from tokenmill.layers.fused_moe import UnquantizedFusedMoEMethod

    def refuse(*args):
        raise AssertionError("full-precision experts allocated")

    monkeypatch.setattr(UnquantizedFusedMoEMethod, "create_weights", refuse)
    _, _, _, root = online
    load_model(str(root / "hf"), dtype="float32", device="cpu", quantization="fp8")
    with pytest.raises(AssertionError, match="full-precision experts"):
        load_model(str(root / "hf"), dtype="float32", device="cpu")


# ----------------------------------------------------------------------------------------------
# Block-wise FP8 checkpoints
# ----------------------------------------------------------------------------------------------


def _save_wide_qwen3_moe(path, seed: int = 3):
    """A Qwen3-MoE whose expert projections span several 128 x 128 blocks (hidden 256, expert
    width 160: 2 x 2 blocks, the last ragged), every layer sparse."""
    import transformers as tf
    from transformers import AutoModelForCausalLM

    cfg = tf.Qwen3MoeConfig(**{**COMMON, "hidden_size": 256}, num_hidden_layers=2, head_dim=64,
                            intermediate_size=320, moe_intermediate_size=160, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    save_byte_tokenizer(path)


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    """(the block-wise FP8 load, {checkpoint weight name: its block-dequantized fp32 value}, root)."""
    root = tmp_path_factory.mktemp("fp8_moe_block")
    _save_wide_qwen3_moe(root / "hf")
    gen = torch.Generator().manual_seed(4)
    dequantized = {}

    def to_blocks(name, t):
        w_q, scales = _block_quantize(t, gen)
        dequantized[name] = dequantize_blockwise_fp8(w_q, scales, (128, 128))
        return {name: w_q, name.replace(".weight", ".weight_scale_inv"): scales}

    layers = range(2)
    qc = {**QC, "modules_to_not_convert": ["lm_head"] + [f"model.layers.{i}.{m}" for i in layers for m in (
        "input_layernorm", "mlp.gate", "post_attention_layernorm")]}
    _rewrite(root / "hf", root / "fp8", to_blocks, qc)
    _rewrite(root / "hf", root / "dequantized", lambda name, t: {name: dequantized.get(name, t)})
    return load_model(str(root / "fp8"), dtype="float32", device="cpu"), dequantized, root


def test_block_experts_within_one_rounding_of_the_block_dequantized(block):
    """Converting to per-row scales rounds an element once more where its block's scale is below
    its row's largest: within 1/16 of it (e4m3's normal range), or 2^-10 of the row's scale below;
    the first 128 rows of gate and up (one scale across their column blocks) convert exactly."""
    fp8, dequantized, _ = block
    worst = 0.0
    for index, layer in enumerate(fp8.model.model.layers):
        m = layer.mlp.experts
        assert not hasattr(m, "w13_weight_scale_inv") and m.w13_weight_scale.shape == (4, 320)
        assert layer.mlp.gate.weight.dtype == torch.float32  # the router, as the checkpoint keeps it
        w13 = dequantize_experts_fp8(m.w13_weight, m.w13_weight_scale, torch.float32)
        w2 = dequantize_experts_fp8(m.w2_weight, m.w2_weight_scale, torch.float32)
        for e in range(4):
            prefix = f"model.layers.{index}.mlp.experts.{e}"
            gate, up, down = (dequantized[f"{prefix}.{p}_proj.weight"] for p in ("gate", "up", "down"))
            for got, want, scale in ((w13[e, :160], gate, m.w13_weight_scale[e, :160]),
                                     (w13[e, 160:], up, m.w13_weight_scale[e, 160:]),
                                     (w2[e], down, m.w2_weight_scale[e])):
                bound = torch.maximum(want.abs() / 16, scale[:, None] * 2.0 ** -10) * (1 + 1e-6)
                assert ((got - want).abs() <= bound).all(), prefix
                worst = max(worst, _rel(got, want))
            assert torch.equal(w13[e, :128], gate[:128]) and torch.equal(w13[e, 160:288], up[:128])
    assert 0 < worst < 0.03, worst  # measured 0.019 (module docstring)


def test_block_model_computes_with_its_converted_weights(block):
    fp8, _, root = block
    seqs = _sequences()
    full = load_model(str(root / "hf"), dtype="float32", device="cpu")
    _dequantized_from(fp8.model, full.model)
    ref = load_model(str(root / "dequantized"), dtype="float32", device="cpu")
    errs = []
    for a, b, c in zip(full_logits(fp8.model, seqs), full_logits(full.model, seqs), full_logits(ref.model, seqs)):
        assert _rel(a, b) < 1e-6  # exactly the converted weights' model
        errs.append(_rel(a, c))
    assert max(errs) < BLOCK_TOL, errs


def test_per_channel_fp8_experts_refused(block):
    """An FP8 checkpoint of experts with per-tensor (or per-channel) scales is refused by name."""
    _, _, root = block
    per_tensor = root / "per_tensor"
    shutil.copytree(root / "hf", per_tensor)
    cfg = json.loads((per_tensor / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (per_tensor / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="Qwen3MoeForCausalLM: FP8 checkpoints of mixture-of-experts.*per-tensor"):
        load_model(str(per_tensor), dtype="float32", device="cpu")


@pytest.mark.parametrize("source", ["online", "block"])
def test_tensor_parallel_ranks_quantize_as_one_process(block, source):
    """TP = 2 in one process (each rank's layer built apart): each rank holds 80 of an
    expert's 160 intermediate features (rank 1's w2 columns start mid-block); its e4m3 bytes
    and scales are exactly one process's, split (a w2 row's scale is taken over the whole row).
    With expert parallelism each rank holds two whole experts, exactly one process's."""
    from safetensors.torch import load_file

    from tokenmill.distributed import _BUILDING, ParallelState
    from tokenmill.layers.fp8_linear import Fp8Config
    from tokenmill.layers.fused_moe import process_moe_weights_after_loading

    _, _, root = block
    state = load_file(str(root / ("hf" if source == "online" else "fp8") / "model.safetensors"))
    config = Fp8Config() if source == "online" else Fp8Config(from_checkpoint=True, block_size=(128, 128))
    prefix = "model.layers.0.mlp.experts"

    def build(rank, size, expert_parallel=False):
        # layers built as this rank (no process group: the loaders need none)
        token = _BUILDING.set(ParallelState(tp_rank=rank, tp_size=size, expert_parallel=expert_parallel))
        try:
            m = FusedMoE(4, 2, 256, 160, True, dtype=torch.float32)
        finally:
            _BUILDING.reset(token)
        m.set_moe_method(config.get_moe_method(m))
        for e in range(4):
            for proj in ("gate", "up", "down"):
                name = f"{prefix}.{e}.{proj}_proj.weight"
                param = m.w2_weight if proj == "down" else m.w13_weight
                param.weight_loader(param, state[name], f"{e}.{proj}")
                if source == "block":
                    inv = m.w2_weight_scale_inv if proj == "down" else m.w13_weight_scale_inv
                    inv.weight_loader(inv, state[name + "_scale_inv"], f"{e}.{proj}")
        process_moe_weights_after_loading(m)
        return m

    one, ranks = build(0, 1), [build(r, 2) for r in range(2)]
    w2_bytes = torch.cat([r.w2_weight.view(torch.uint8) for r in ranks], dim=2)
    assert torch.equal(w2_bytes, one.w2_weight.view(torch.uint8))
    for r in ranks:
        assert torch.equal(r.w2_weight_scale, one.w2_weight_scale)
    for rank, r in enumerate(ranks):
        rows = torch.cat([torch.arange(rank * 80, (rank + 1) * 80) + s * 160 for s in (0, 1)])
        assert torch.equal(r.w13_weight.view(torch.uint8), one.w13_weight[:, rows].view(torch.uint8))
        assert torch.equal(r.w13_weight_scale, one.w13_weight_scale[:, rows])
    for rank in range(2):
        ep = build(rank, 2, expert_parallel=True)
        mine = slice(2 * rank, 2 * rank + 2)
        for name in ("w13_weight", "w2_weight"):
            assert torch.equal(getattr(ep, name).view(torch.uint8), getattr(one, name)[mine].view(torch.uint8))
            assert torch.equal(getattr(ep, f"{name}_scale"), getattr(one, f"{name}_scale")[mine])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 0.1)])  # bf16: W8A8 dense layers
def test_online_on_cuda_matches_the_cpu(online, dtype, tol):
    """On CUDA the experts run through the Triton kernels on the e4m3 bytes (and, in bf16, the
    linear layers through the W8A8 paths): the logits stay near the CPU's dequantized model's."""
    _, _, full, root = online
    gpu = load_model(str(root / "hf"), dtype=dtype, device="cuda", quantization="fp8")
    seqs = _sequences()
    for a, b in zip(full_logits(gpu.model, seqs), full_logits(full.model, seqs)):
        assert _rel(a.float().cpu(), b) < tol
