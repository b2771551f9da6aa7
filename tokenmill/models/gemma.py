"""Gemma 2 and Gemma 3 text (Gemma2ForCausalLM, Gemma3ForCausalLM): the Llama decoder's attention
and projections, with what Gemma does otherwise. The config side (models/config.py) reads the layer
kinds (sliding and global layers interleaved), the attention scale query_pre_attn_scalar ** -0.5,
Gemma 3's local rotary base and Gemma 2's soft-caps; the shared attention block applies them.

- Every RMSNorm multiplies by (1 + w): the checkpoint's w gets 1 added at load, so the shared norm
  kernels run unchanged (q/k norms of Gemma 3 included).
- Four norms per layer: the attention and MLP outputs are normalised again before they join the
  residual stream.
- The MLP is GeGLU: gelu_tanh(gate) * up.
- The embedding is multiplied by sqrt(hidden_size), rounded to the model dtype as HF does.
- Gemma 2 soft-caps the final logits: cap * tanh(logits / cap).
"""

from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.config import ModelArchConfig
from tokenmill.models.llama import (LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, MLPFactory,
                                    _norm_then_project)


class GemmaMLP(LlamaMLP):
    def forward(self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """down(gelu_tanh(gate) * up) of norm(hidden + residual), and the new residual stream."""
        gate_up, residual = _norm_then_project(self.gate_up_proj, hidden, residual, norm)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up), residual


def gemma_mlp(cfg: ModelArchConfig, layer_idx: int, dtype, device) -> nn.Module:
    return GemmaMLP(cfg, dtype, device)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, layer_idx: int, dtype, device,
                 make_mlp: MLPFactory = gemma_mlp):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(cfg, rotary, layer_idx, dtype, device)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = make_mlp(cfg, layer_idx, dtype, device)
        self.post_feedforward_layernorm = norm()

    def forward(self, positions, hidden, residual: Optional[torch.Tensor]):
        # As in the Llama layer the residual add rides in the next pre-norm; each output is
        # normalised on its own first (its post-norm), before it joins the stream.
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm)
        hidden, residual = self.mlp(self.post_attention_layernorm(hidden), residual, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm(hidden), residual


class GemmaModel(LlamaModel):
    decoder_layer = GemmaDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # HF rounds sqrt(hidden) to the embedding's dtype before multiplying (bf16: 2048 ** 0.5 -> 45.25).
        weight = self.embed_tokens.weight
        return self.embed_tokens(input_ids) * torch.tensor(weight.shape[1] ** 0.5, dtype=weight.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    model_class = GemmaModel
    make_mlp = staticmethod(gemma_mlp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._with_unit_offset(self._language_model_only(weights)))

    # Gemma3ForConditionalGeneration checkpoints: the text model under either of HF's layouts.
    _LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                                ("language_model.lm_head.", "lm_head."))
    _VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")

    @classmethod
    def _language_model_only(cls, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith(cls._VISION_PREFIXES):
                continue
            for prefix, ours in cls._LANGUAGE_MODEL_PREFIXES:
                if name.startswith(prefix):
                    name = ours + name[len(prefix):]
                    break
            yield name, tensor

    @staticmethod
    def _with_unit_offset(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's norm weights w as the 1 + w the norm kernels multiply by (in float32,
        as HF adds them, then back to the checkpoint's dtype)."""
        for name, tensor in weights:
            if name.endswith("norm.weight"):
                tensor = (tensor.float() + 1.0).to(tensor.dtype)
            yield name, tensor

