"""Phi-3 / Phi-3.5 / Phi-4-mini (Phi3ForCausalLM): the Llama decoder, with two differences in how the
checkpoint is laid out and one in the config (models/config.py reads it: LongRoPE, partial rotary).

- The checkpoint stores q/k/v as one `qkv_proj` tensor (q rows, then k, then v) and gate/up as one
  `gate_up_proj` (gate rows, then up). Each is split into the separate shards our fused layers load,
  so tensor parallelism takes each rank's rows of q, k and v (and gate, up) as for any Llama checkpoint.
- Partial rotary (Phi-4-mini rotates the first 3/4 of each head): HF rotates dims [0, r) as pairs
  (i, i + r/2) and leaves [r, D) alone, while the rotary kernels pair (i, i + D/2) across the whole
  head. The q and k rows of each head are permuted at load so that HF's rotated pairs sit at
  (i, i + D/2) for i < r/2 and the passed-through dims fill the rest; the table gives those cos 1,
  sin 0 (layers/rotary.py). q.k is unchanged by a permutation both share, and v is not touched.
"""

from typing import Iterable, Iterator

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.models.llama import LlamaForCausalLM


def rotary_first_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Source dim of each head dim in our layout: HF's rotated halves [0, r/2) and [r/2, r) start the
    two halves of the head, the passed-through dims [r, D) follow in each."""
    half_rot, half_pass = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat((torch.arange(0, half_rot), torch.arange(rotary_dim, rotary_dim + half_pass),
                      torch.arange(half_rot, rotary_dim), torch.arange(rotary_dim + half_pass, head_dim)))


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._as_llama_tensors(weights))

    def _as_llama_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under the Llama layout's names: fused projections split into
        views of their rows (no copy), q and k in the rotary-first layout under partial rotary."""
        cfg = self.config
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for name, tensor in weights:
            fused = ".qkv_proj." in name or ".gate_up_proj." in name
            if fused and not name.endswith((".weight", ".bias")):  # an FP8 checkpoint's scales, say
                raise ModelLoadError(f"checkpoint tensor {name!r}: only unquantized fused Phi-3 projections load")
            if ".qkv_proj." in name:
                q, k, v = tensor.split([q_size, kv_size, kv_size], dim=0)
                yield name.replace(".qkv_proj.", ".q_proj."), self._rotary_first(q)
                yield name.replace(".qkv_proj.", ".k_proj."), self._rotary_first(k)
                yield name.replace(".qkv_proj.", ".v_proj."), v
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            elif ".q_proj." in name or ".k_proj." in name:  # a checkpoint saved unfused
                yield name, self._rotary_first(tensor)
            else:
                yield name, tensor

    def _rotary_first(self, rows: torch.Tensor) -> torch.Tensor:
        """q or k projection rows (all heads) reordered within each head; unchanged under full rotary."""
        cfg = self.config
        if cfg.rotary_dim == cfg.head_dim:
            return rows
        perm = rotary_first_permutation(cfg.head_dim, cfg.rotary_dim).to(rows.device)
        heads = rows.shape[0] // cfg.head_dim
        return rows.reshape(heads, cfg.head_dim, -1)[:, perm].reshape(rows.shape)
