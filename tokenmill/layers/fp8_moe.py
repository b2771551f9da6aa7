"""FP8 (e4m3) experts for mixture-of-experts layers: `Fp8MoEMethod`, the method `Fp8Config` gives a
FusedMoE layer (layers/fp8_linear.py's config; the kernels are kernels/fused_moe.py's).

At run time every expert's w13 [2I, H] and w2 [H, I] are e4m3 with one fp32 scale per output row,
`w13_weight_scale` [E, 2I] and `w2_weight_scale` [E, H] (W ~ scale[:, None] * W_q, the dense FP8
layers' form). Two sources:

- online (`Fp8Config()`): each expert's projection is quantized as it streams in (the weight
  loader), so no full-precision copy of the experts is kept. A row's scale is taken over the whole
  checkpoint row, so tensor-parallel ranks (which hold slices of w2's rows) quantize as one process.
- a block-wise checkpoint (`Fp8Config(from_checkpoint=True, block_size=(bn, bk))`, HF's fine-grained
  FP8 as Qwen3-30B-A3B-FP8 ships it): per expert and projection an e4m3 `weight` and its
  `weight_scale_inv` [ceil(N / bn), ceil(K / bk)]. The block scales are loaded repeated over the
  rows of their block (w2's for every column block of the row, whatever this rank's columns), then
  each row is requantized to its largest block scale (quantization/fp8.requantize_blockwise_fp8),
  as the dense layers are. Why per-row rather than block scales in the kernel: one kernel form for
  both sources and the dense layers, with the scale applied once per output instead of once per
  K block; the cost is one more e4m3 rounding of the elements whose block scale is below their
  row's largest (within 1/16 of the element; tests/quantization/test_fp8_moe.py measures it).

On CUDA the kernels read the e4m3 bytes (weight-only: the activations stay in the model dtype;
decode steps, where the experts' weight bytes are the cost, gain as much as W8A8 would, and the
activations take no quantization error; an e4m3 x e4m3 grouped GEMM for large prefills is not
written yet). Elsewhere the experts are dequantized once per dtype and run through the reference,
as Fp8LinearMethod does on the CPU. FP8 checkpoints of MoE models with per-tensor or per-channel
scales are refused (get_moe_method).
"""

import torch
from torch import nn

from tokenmill.kernels.fused_moe import dequantize_experts_fp8, fused_moe, fused_moe_ref
from tokenmill.layers.fused_moe import FusedMoE, FusedMoEMethodBase
from tokenmill.layers.linear import LayerLoader, new_parameter
from tokenmill.quantization.fp8 import FP8_DTYPE, quantize_weight_fp8, requantize_blockwise_fp8

# (weight, its run-time scales, its checkpoint block scales) of each projection's stacked parameter
_PARAMS = {"gate": ("w13_weight", "w13_weight_scale", "w13_weight_scale_inv"),
           "up": ("w13_weight", "w13_weight_scale", "w13_weight_scale_inv"),
           "down": ("w2_weight", "w2_weight_scale", "w2_weight_scale_inv")}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8MoEMethod(FusedMoEMethodBase):
    """e4m3 experts with per-row scales (module docstring); `config` is an Fp8Config."""

    def __init__(self, config):
        self.config = config

    @property
    def online(self) -> bool:
        return not self.config.from_checkpoint

    # ---- weights ----
    def create_weights(self, layer: FusedMoE, dtype: torch.dtype, device: torch.device) -> None:
        e, i, h = layer.num_local_experts, layer.intermediate_size_per_rank, layer.hidden_size
        layer.w13_weight = new_parameter(layer, (e, 2 * i, h), FP8_DTYPE, device, self._load_weight)
        layer.w2_weight = new_parameter(layer, (e, h, i), FP8_DTYPE, device, self._load_weight)
        if self.online:
            for name, rows in (("w13_weight_scale", 2 * i), ("w2_weight_scale", h)):
                scale = new_parameter(layer, (e, rows), torch.float32, device, fill=1.0)
                scale.derived = True  # set by its weight's loader: not a checkpoint tensor, not drawn by dummy init
                layer.register_parameter(name, scale)
            # dummy weights: full-precision values drawn for the weight, quantized as a checkpoint's
            layer.w13_weight.dummy_fill = LayerLoader(layer, self._dummy_fill)
            layer.w2_weight.dummy_fill = LayerLoader(layer, self._dummy_fill)
            return
        bk = self.config.block_size[1]
        # w13: its rows' blocks along H; w2: every column block of the full row (the row's scale
        # is their max, the same on every tensor-parallel rank)
        for name, shape in (("w13_weight_scale_inv", (e, 2 * i, _cdiv(h, bk))),
                            ("w2_weight_scale_inv", (e, h, _cdiv(layer.intermediate_size, bk)))):
            layer.register_parameter(name, new_parameter(layer, shape, torch.float32, device,
                                                         self._load_block_scales, fill=1.0))

    def _load_weight(self, layer: FusedMoE, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        if shard_id in ("gate_up", "down"):  # transformers' fused layout: one expert at a time
            if not self.online:
                raise ValueError(f"FP8 checkpoint with the experts fused ({shard_id}_proj [E, ...]): only "
                                 f"per-expert tensors (experts.<e>.<proj>.weight) are supported")
            full_i = layer.intermediate_size
            for expert in range(loaded.shape[0]):
                if shard_id == "down":
                    self._load_weight(layer, param, loaded[expert], f"{expert}.down")
                else:
                    self._load_weight(layer, param, loaded[expert, :full_i], f"{expert}.gate")
                    self._load_weight(layer, param, loaded[expert, full_i:], f"{expert}.up")
            return
        if not self.online:
            if loaded.dtype != FP8_DTYPE:
                raise ValueError(f"experts {shard_id}: the FP8 checkpoint stores this weight as {loaded.dtype}, "
                                 f"not float8_e4m3fn")
            layer.weight_loader(param, loaded, shard_id)
            return
        # whole checkpoint rows: every rank's slice of a row gets that row's one scale
        w_q, scale = quantize_weight_fp8(loaded.to(param.device))
        layer.weight_loader(param, w_q, shard_id)  # checks the shard and the shape, places this rank's part
        expert, proj = shard_id.split(".")
        _place_rows(layer, getattr(layer, _PARAMS[proj][1]), scale, int(expert), proj)

    def _load_block_scales(self, layer: FusedMoE, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        """One expert projection's block scales [ceil(rows / bn), ceil(cols / bk)], each block row
        repeated over its bn weight rows (the last may be ragged), then placed as the weight's rows."""
        expert, _, proj = str(shard_id).partition(".")
        if proj not in _PARAMS or not expert.isdigit():
            raise ValueError(f"experts: block scales of an unknown shard {shard_id!r} (the fused layout has none)")
        bn, bk = self.config.block_size
        rows, cols = ((layer.hidden_size, layer.intermediate_size) if proj == "down"
                      else (layer.intermediate_size, layer.hidden_size))
        want = (_cdiv(rows, bn), _cdiv(cols, bk))
        if tuple(loaded.shape) != want:
            raise ValueError(f"shape mismatch loading weight_scale_inv of expert {expert} {proj}_proj: checkpoint "
                             f"{tuple(loaded.shape)}, expected {want} (one scale per {bn}x{bk} block of the "
                             f"{rows}x{cols} weight)")
        per_row = loaded.to(param.device, torch.float32).repeat_interleave(bn, dim=0)[:rows]
        _place_rows(layer, param, per_row, int(expert), proj)

    def _dummy_fill(self, layer: FusedMoE, param: nn.Parameter, values: torch.Tensor) -> None:
        """Random full-precision values [E_local, N, K] for an online weight: each expert rounded to the
        model dtype (what a full-precision dummy model holds) and quantized per row."""
        scale = layer.w2_weight_scale if param is layer.w2_weight else layer.w13_weight_scale
        for e in range(values.shape[0]):
            w_q, s = quantize_weight_fp8(values[e].to(param.device, layer.params_dtype))
            param.data[e].copy_(w_q)
            scale.data[e].copy_(s)

    @torch.no_grad()
    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        layer.__dict__.pop("_fp8_widened", None)
        if self.online:
            return
        col_offset = layer.shard_rank * layer.intermediate_size_per_rank  # w2's columns on this rank
        bk = self.config.block_size[1]
        for weight_name, scale_name, inv_name in (_PARAMS["gate"], _PARAMS["down"]):
            blocks = getattr(layer, inv_name).data
            if not bool(torch.isfinite(blocks).all()) or bool((blocks < 0).any()):
                raise ValueError(f"experts: the checkpoint's {inv_name} has negative or non-finite values")
            w_q = getattr(layer, weight_name).data
            cols = torch.arange(w_q.shape[2], device=w_q.device) + (col_offset if weight_name == "w2_weight" else 0)
            scales = torch.empty(w_q.shape[:2], dtype=torch.float32, device=w_q.device)
            for e in range(w_q.shape[0]):  # one expert at a time: the temporaries stay small
                w_q[e], scales[e] = requantize_blockwise_fp8(w_q[e], blocks[e], cols // bk)
            delattr(layer, inv_name)
            layer.register_parameter(scale_name, nn.Parameter(scales, requires_grad=False))

    # ---- the forward pass ----
    def apply(self, layer: FusedMoE, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = layer.route(router_logits)
        if layer.expert_map is not None:  # other ranks' experts become -1, which the kernel skips
            ids = layer.expert_map[ids.long()]
        if x.is_cuda:
            return fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids,
                             w13_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale)
        w13, w2 = self._widened(layer, x.dtype)
        return fused_moe_ref(x, w13, w2, weights, ids)

    @staticmethod
    def _widened(layer: FusedMoE, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized experts off CUDA (the reference's values), once per layer and dtype:
        widening e4m3 is most of a CPU step's time."""
        cache = layer.__dict__.setdefault("_fp8_widened", {})
        if dtype not in cache:
            cache[dtype] = (dequantize_experts_fp8(layer.w13_weight, layer.w13_weight_scale, dtype),
                            dequantize_experts_fp8(layer.w2_weight, layer.w2_weight_scale, dtype))
        return cache[dtype]


def _place_rows(layer: FusedMoE, param: nn.Parameter, rows: torch.Tensor, expert: int, proj: str) -> None:
    """Put per-row data of one expert's checkpoint projection (rows [checkpoint rows, ...]: scales or
    block scales) where the layer's weight loader puts that projection's rows on this rank."""
    local = layer._local_index(expert)
    if local is None:
        return  # another rank's expert
    if proj == "down":  # w2 is split by columns: every rank holds every row
        param.data[local].copy_(rows)
        return
    i = layer.intermediate_size_per_rank
    offset = 0 if proj == "gate" else i
    param.data[local].narrow(0, offset, i).copy_(rows.narrow(0, layer.shard_rank * i, i))
