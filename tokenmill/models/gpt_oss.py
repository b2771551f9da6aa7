"""gpt-oss (GptOssForCausalLM): the mixture-of-experts decoder of models/moe.py, with what gpt-oss does
otherwise. The config side (models/config.py) turns on attention sinks and the o_proj bias, reads
the sliding and full layers from `layer_types`, and the experts' biases and clamped SwiGLU; the
shared layers run them (layers/attention.py, layers/fused_moe.py). This module maps the checkpoint:

- The experts are stored as transformers holds them: `experts.gate_up_proj` [E, H, 2I] with gate
  and up interleaved in the last dim (gate = [..., ::2], up = [..., 1::2]), `gate_up_proj_bias`
  [E, 2I] likewise, `down_proj` [E, I, H], `down_proj_bias` [E, H]. They are de-interleaved and
  transposed into the fused layer's layout (w13 [E, 2I, H], gate rows then up rows; w2 [E, H, I]).
- Released checkpoints store the experts in MXFP4 (`*_blocks` / `*_scales`, quantization/mxfp4.py),
  with the gate/up rows interleaved likewise; they are dequantized to the model dtype at load.
- The router is `mlp.router` (our `mlp.gate`, renamed by the architecture table), the sinks
  `self_attn.sinks` (our `self_attn.attn.sinks`).
"""

from typing import Iterable, Iterator

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.models.moe import MoeForCausalLM
from tokenmill.quantization.mxfp4 import dequantize_mxfp4


def deinterleave(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """gate/up interleaved along `dim` (gate at even, up at odd indices) -> gate half, then up half."""
    n = t.shape[dim]
    evens = torch.arange(0, n, 2, device=t.device)
    return torch.cat((t.index_select(dim, evens), t.index_select(dim, evens + 1)), dim=dim)


class GptOssForCausalLM(MoeForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._as_moe_tensors(weights))

    def _as_moe_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under the names and in the layout MoeForCausalLM loads (module
        docstring); an MXFP4 pair (blocks, scales) is dequantized once both have streamed in."""
        dtype = self.lm_head.weight.dtype
        pending: dict[str, torch.Tensor] = {}  # an MXFP4 half waiting for its other half
        for name, tensor in weights:
            if name.endswith(("_blocks", "_scales")):
                stem, _, part = name.rpartition("_")
                other = pending.pop(f"{stem}_{'scales' if part == 'blocks' else 'blocks'}", None)
                if other is None:
                    pending[name] = tensor
                    continue
                blocks, scales = (tensor, other) if part == "blocks" else (other, tensor)
                # [E, N, K]: rows of the stored (not transposed) projection, gate/up interleaved
                dense = dequantize_mxfp4(blocks, scales, dtype)
                if stem.endswith(".gate_up_proj"):
                    yield stem, deinterleave(dense, 1)
                elif stem.endswith(".down_proj"):
                    yield stem, dense
                else:
                    raise ModelLoadError(f"checkpoint tensor {name!r}: only the experts' projections load from MXFP4")
            elif name.endswith(".self_attn.sinks"):
                yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
            elif name.endswith(".experts.gate_up_proj"):
                yield name, deinterleave(tensor, 2).transpose(1, 2)
            elif name.endswith(".experts.down_proj"):
                yield name, tensor.transpose(1, 2)
            elif name.endswith(".experts.gate_up_proj_bias"):
                yield name.replace(".gate_up_proj_bias", ".w13_bias"), deinterleave(tensor, 1)
            elif name.endswith(".experts.down_proj_bias"):
                yield name.replace(".down_proj_bias", ".w2_bias"), tensor
            else:
                yield name, tensor
        if pending:
            raise ModelLoadError(f"MXFP4 checkpoint: {sorted(pending)[:3]} without their blocks or scales")
