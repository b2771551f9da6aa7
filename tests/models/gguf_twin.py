"""Write the GGUF twin of a small HF mixture-of-experts directory, laid out as llama.cpp's converter
lays it out: the `gguf` package's names (its own HF -> GGUF table, not tokenmill's), each layer's
experts stacked into one [E, rows, columns] tensor per projection, q/k rows interleaved for arch
`llama` (Mixtral), the shared expert's gate as a vector, the byte-level BPE tokenizer as metadata.
Beyond llama.cpp: the Qwen-MoE test models' dense layers (`mlp_only_layers`) keep the dense names,
`blk.N.ffn_{gate,up,down}`, which tokenmill reads (llama.cpp's qwen*moe archs want experts everywhere)."""

import json
import os
import re

import numpy as np
import torch

# HF model type -> llama.cpp's architecture (Mixtral is "llama" with experts).
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama"}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight")


def _interleave_rotary_halves(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row order for arch llama: per head, row j of each rotary half side by side."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert HF weights -> one stacked tensor per layer and projection, under the name
    llama.cpp's converter maps (`model.layers.N.mlp.experts.gate_proj.weight`); the rest unchanged."""
    out, experts = {}, {}
    for name, tensor in state.items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            layer, block, expert, proj = match.groups()
            experts.setdefault(f"model.layers.{layer}.{block}.experts.{proj}.weight", {})[int(expert)] = tensor
    for name, by_id in experts.items():
        out[name] = torch.stack([by_id[e] for e in range(len(by_id))])
    return out


def _split_expert_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral's per-expert weights under the GGUF names of the first llama.cpp files (the `gguf`
    package's tables no longer have them); the rest unchanged."""
    proj = {"w1": "gate", "w3": "up", "w2": "down"}
    out = {}
    for name, tensor in state.items():
        match = _EXPERT.fullmatch(name)
        out[name if match is None else f"blk.{match[1]}.ffn_{proj[match[4]]}.{match[3]}.weight"] = tensor
    return out


def _add_tokenizer(writer, hf_dir: str) -> None:
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        spec = json.load(f)
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec["added_tokens"] if t["special"]}
    vocab.update(special)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control, 1: normal
    writer.add_token_merges(merges)
    with open(os.path.join(hf_dir, "config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)


def write_gguf_twin(hf_dir, path, expert_type=None, split_experts: bool = False) -> str:
    """The GGUF file at `path` of the HF directory: F32 tensors, the stacked experts in
    `expert_type` (a GGMLQuantizationType; None: F32) quantized by the `gguf` package.
    split_experts: one tensor per expert, `blk.N.ffn_gate.E.weight`, as llama.cpp's first Mixtral
    files had them (Mixtral only)."""
    import gguf
    from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES
    from safetensors.torch import load_file

    hf_dir, path = str(hf_dir), str(path)
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = GGUF_ARCH[cfg["model_type"]]
    n_layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    hidden = cfg["hidden_size"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(cfg.get("head_dim") or hidden // heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "olmoe":
        writer.add_clamp_kqv(cfg["clip_qkv"])
        writer.add_expert_weights_norm(cfg["norm_topk_prob"])  # the others leave llama.cpp's default
    _add_tokenizer(writer, hf_dir)

    names = gguf.get_tensor_name_map({v: k for k, v in MODEL_ARCH_NAMES.items()}[arch], n_layers)
    # llama.cpp's Qwen-MoE archs have no dense layers (the test models do): their MLPs take the dense names.
    dense_names = gguf.get_tensor_name_map(MODEL_ARCH.LLAMA, n_layers)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    state = _split_expert_names(state) if split_experts else _stack_experts(state)
    for hf_name, tensor in state.items():
        name = hf_name if hf_name.startswith("blk.") else \
            names.get_name(hf_name, try_suffixes=(".weight", ".bias")) or \
            dense_names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if arch == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
            tensor = _interleave_rotary_halves(tensor, heads if ".attn_q." in name else kv_heads)
        if name.endswith(".ffn_gate_inp_shexp.weight"):
            tensor = tensor.reshape(-1)  # llama.cpp's shape: [hidden]
        array = tensor.float().contiguous().numpy()
        if expert_type is not None and "_exps." in name:
            writer.add_tensor(name, gguf.quants.quantize(array, expert_type), raw_dtype=expert_type)
        else:
            writer.add_tensor(name, array)
    finish(writer)
    return path


def finish(writer) -> None:
    """Write a GGUFWriter's header, metadata and tensors to its file, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_round_trip(tensor: torch.Tensor, qtype) -> torch.Tensor:
    """The `gguf` package's own quantize -> dequantize of a tensor (the reference for a quantized twin)."""
    from gguf import quants

    array = tensor.float().contiguous().numpy()
    return torch.from_numpy(np.asarray(quants.dequantize(quants.quantize(array, qtype), qtype)).copy())
