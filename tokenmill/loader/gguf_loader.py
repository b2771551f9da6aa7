"""GGUF files -> an HF-style config, HF-named float32 weights and a tokenizer.

The first load of a file converts it into an HF directory (config.json, model.safetensors,
tokenizer files) in the user cache, keyed by the file's hash; later loads read that directory.
Mixture-of-experts files (llama.cpp's layout: each layer's experts stacked in one 3D tensor per
projection, `blk.N.ffn_{gate,up,down}_exps`; early Mixtral files: one tensor per expert,
`blk.N.ffn_gate.E`) become HF's per-expert checkpoint names, written expert by expert.
"""

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from tokenmill.errors import ModelLoadError, UnsupportedArchitectureError
from tokenmill.loader.gguf_dequant import dequantize
from tokenmill.loader.gguf_reader import GGUFFile
from tokenmill.loader.safetensors_weights import save_safetensors_streaming
from tokenmill.logger import init_logger

logger = init_logger(__name__)

CACHE_FORMAT = "v2"  # bump when the converted layout changes (v2: config.json loads in HF transformers)


@dataclass(frozen=True)
class _Family:
    """How one GGUF architecture maps onto an HF one."""

    architecture: str  # HF's name of the architecture, and its model type
    model_type: str
    # llama.cpp's converter interleaves the rotary halves of q/k rows for the archs that rotate
    # adjacent pairs (llama, mistral); the NeoX-rotation archs (Qwen, OLMoE) keep HF's row order.
    permute_qk: bool = False
    # Mixture of experts: the HF module holding the router and experts (None: a dense model), each
    # expert's gate/up/down names, the config field of the expert count.
    moe_block: Optional[str] = None
    expert_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    experts_key: str = "num_experts"
    # llama.cpp's top-k weight renormalisation for the arch when the file has no
    # `{arch}.expert_weights_norm` (None: always, as Mixtral's softmax over the top k does).
    renormalize: Optional[bool] = False
    # The HF config can list layers without experts (Qwen's mlp_only_layers); elsewhere every layer has them.
    dense_layers: bool = False
    shared_expert: bool = False
    # Gemma: llama.cpp's converter stores each RMSNorm weight as 1 + w (HF's checkpoints hold w), and
    # the layer has four norms, named otherwise than Llama's two.
    gemma: bool = False


_DENSE = {
    "llama": _Family("LlamaForCausalLM", "llama", permute_qk=True),
    "mistral": _Family("MistralForCausalLM", "mistral", permute_qk=True),
    "qwen2": _Family("Qwen2ForCausalLM", "qwen2"),
    "qwen3": _Family("Qwen3ForCausalLM", "qwen3"),
    "gemma2": _Family("Gemma2ForCausalLM", "gemma2", gemma=True),
    "gemma3": _Family("Gemma3ForCausalLM", "gemma3_text", gemma=True),
}
# llama.cpp writes Mixtral as arch "llama" with `llama.expert_count`; the others have archs of their own.
_MOE = {
    "llama": _Family("MixtralForCausalLM", "mixtral", permute_qk=True, moe_block="block_sparse_moe",
                     expert_projs=("w1", "w3", "w2"), experts_key="num_local_experts", renormalize=None),
    "qwen2moe": _Family("Qwen2MoeForCausalLM", "qwen2_moe", moe_block="mlp", dense_layers=True, shared_expert=True),
    "qwen3moe": _Family("Qwen3MoeForCausalLM", "qwen3_moe", moe_block="mlp", renormalize=True, dense_layers=True),
    "olmoe": _Family("OlmoeForCausalLM", "olmoe", moe_block="mlp"),
}
_SUPPORTED = "llama, mistral, qwen2, qwen3, gemma2, gemma3; with experts: llama (Mixtral), olmoe, qwen2moe, qwen3moe"

# GGUF tensor name -> HF name ("{i}" is the layer index).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Gemma's four norms per layer (ffn_norm is the norm before the MLP, as in Llama).
_GEMMA_NORM_NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                     "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_ROUTER = "ffn_gate_inp"
_SHARED_EXPERT_NAMES = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# All experts of one projection stacked: gate/up [E, I, H], down [E, H, I] (torch order).
_STACKED_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
# One expert's projection: llama.cpp's first Mixtral files (before April 2024), which it still reads.
_SPLIT_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# (HF name, shape, read): a weight to write, read (dequantized to float32) only when written.
PlannedWeight = tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]


def cache_root() -> str:
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill"
    )
    return root


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _family(gguf: GGUFFile) -> tuple[str, _Family]:
    """The file's GGUF architecture and its HF family; an unsupported one is refused by name."""
    md = gguf.metadata
    arch = md.get("general.architecture")
    experts = int(md.get(f"{arch}.expert_count") or 0)
    has_experts = experts or any(_STACKED_EXPERTS.fullmatch(n) or _SPLIT_EXPERT.fullmatch(n) for n in gguf.tensors)
    family = _MOE.get(arch) if has_experts or arch not in _DENSE else _DENSE[arch]
    if family is None:
        what = f" with {experts or 'its'} experts (a mixture of experts)" if has_experts else ""
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r}{what} is not supported (supported: {_SUPPORTED})")
    return arch, family


def hf_config_from_gguf(gguf: GGUFFile) -> dict[str, Any]:
    md = gguf.metadata
    arch, family = _family(gguf)

    def get(key: str, default=None):
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF file {gguf.path} lacks the metadata key {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = int(md.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    eos = md.get("tokenizer.ggml.eos_token_id")
    cfg = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "float32",
    }
    if family.moe_block is not None:
        cfg.update(_moe_config(gguf, arch, family, cfg, get))
    if family.gemma:
        cfg.update(_gemma_config(gguf, arch, cfg))
    if "rope_freqs.weight" in gguf.tensors:
        info = gguf.tensors["rope_freqs.weight"]
        cfg["rope_freq_factors"] = dequantize(gguf.raw(info), info.ggml_type, info.shape).float().tolist()
    return cfg


def _moe_config(gguf: GGUFFile, arch: str, family: _Family, cfg: dict[str, Any], get) -> dict[str, Any]:
    """The HF config fields of a mixture-of-experts file: from its metadata, checked against (or,
    where llama.cpp writes no key, read from) the shapes of its tensors."""
    md, tensors = gguf.metadata, gguf.tensors
    num_experts = int(get("expert_count"))
    fields: dict[str, Any] = {family.experts_key: num_experts, "num_experts_per_tok": int(get("expert_used_count"))}
    func = md.get(f"{arch}.expert_gating_func")
    if func is not None and int(func) != 1:  # gguf's ExpertGatingFuncType: 1 softmax, 2 sigmoid
        raise ModelLoadError(f"GGUF file {gguf.path}: expert_gating_func {int(func)} is not supported "
                             "(tokenmill routes by softmax)")
    scale = md.get(f"{arch}.expert_weights_scale")
    if scale is not None and float(scale) != 1.0:
        raise ModelLoadError(f"GGUF file {gguf.path}: expert_weights_scale {scale} is not supported")

    layers = range(cfg["num_hidden_layers"])
    sparse = [i for i in layers if f"blk.{i}.{_ROUTER}.weight" in tensors]
    dense = [i for i in layers if i not in sparse]
    if not sparse:
        raise ModelLoadError(f"GGUF file {gguf.path} says {num_experts} experts but no layer has a router "
                             f"(blk.N.{_ROUTER}.weight)")
    if dense and not family.dense_layers:
        raise ModelLoadError(f"GGUF file {gguf.path}: layers {dense} have no experts; {family.architecture} "
                             "has experts on every layer")
    if family.dense_layers:
        fields.update(decoder_sparse_step=1, mlp_only_layers=dense)

    def width(tensor: str, key: str, dim: int) -> Optional[int]:
        """A width from the first sparse layer's tensor, which must agree with the metadata key if present."""
        info = tensors.get(f"blk.{sparse[0]}.{tensor}.weight")
        from_key = md.get(f"{arch}.{key}")
        if info is None:
            return None if from_key is None else int(from_key)
        if from_key is not None and int(from_key) != info.shape[dim]:
            raise ModelLoadError(f"GGUF file {gguf.path}: {arch}.{key} is {from_key}, but "
                                 f"blk.{sparse[0]}.{tensor}.weight has shape {info.shape}")
        return info.shape[dim]

    expert_width = width("ffn_gate_exps", "expert_feed_forward_length", 1) or \
        width("ffn_gate.0", "expert_feed_forward_length", 0)
    if expert_width is None:
        raise ModelLoadError(f"GGUF file {gguf.path} lacks blk.{sparse[0]}.ffn_gate_exps.weight")
    # Qwen's config holds the experts' width apart from the dense layers'; Mixtral's and OLMoE's in intermediate_size.
    fields["moe_intermediate_size" if family.dense_layers else "intermediate_size"] = expert_width
    if family.shared_expert:
        fields["shared_expert_intermediate_size"] = width("ffn_gate_shexp", "expert_shared_feed_forward_length", 0) or 0

    norm = md.get(f"{arch}.expert_weights_norm")
    if family.renormalize is None:
        if norm is not None and not norm:
            raise ModelLoadError(f"GGUF file {gguf.path}: {arch}.expert_weights_norm is false, but "
                                 f"{family.architecture} always renormalises the top-k weights")
    else:
        fields["norm_topk_prob"] = family.renormalize if norm is None else bool(norm)
    if arch == "qwen2moe":
        fields["qkv_bias"] = f"blk.{sparse[0]}.attn_q.bias" in tensors
    if arch == "olmoe" and md.get("olmoe.attention.clamp_kqv") is not None:
        fields["clip_qkv"] = float(md["olmoe.attention.clamp_kqv"])
    if family.model_type == "mixtral":
        fields["sliding_window"] = None  # llama.cpp's Mixtral attends to the whole context
    return fields


def _gemma_config(gguf: GGUFFile, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma's HF config fields from llama.cpp's keys. The layer kinds are HF's default (Gemma 2:
    alternate; Gemma 3: every 6th layer global), as llama.cpp hardcodes them; the sliding layers'
    rotary base is HF's default (10k) and the global layers' is rope.freq_base."""
    md = gguf.metadata
    fields: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
                              # llama.cpp scales q by head_dim ** -0.5 except for Gemma 3 27B (hidden / heads)
                              "query_pre_attn_scalar": cfg["head_dim"]}
    if cfg["hidden_size"] == 5376 and cfg["num_attention_heads"] == 32 and arch == "gemma3":
        fields["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    window = md.get(f"{arch}.attention.sliding_window")
    fields["sliding_window"] = None if window is None else int(window)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if md.get(f"{arch}.{key}") is not None:
            fields[key] = float(md[f"{arch}.{key}"])
        elif arch == "gemma3":
            fields[key] = None
    scaling = md.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling != "none":
        fields["rope_scaling"] = {"rope_type": scaling, "factor": float(md.get(f"{arch}.rope.scaling.factor", 1.0))}
    return fields


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows.

    llama.cpp interleaves the two rotary halves of each head (row j of the first half and row j of
    the second become rows 2j and 2j+1); rows come back as [head, pair, half] -> [head, half, pair].
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str, family: _Family) -> str:
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, idx, piece = base.split(".", 2)
        hf = _GEMMA_NORM_NAMES.get(piece) if family.gemma and piece in _GEMMA_NORM_NAMES else _LAYER_NAMES.get(piece)
        if family.moe_block is not None and piece == _ROUTER:
            hf = f"{family.moe_block}.gate"
        elif family.shared_expert:
            hf = _SHARED_EXPERT_NAMES.get(piece, hf)
        if hf is None:
            raise ModelLoadError(f"GGUF tensor {name} is not part of the {family.architecture} layout tokenmill reads")
        return f"model.layers.{idx}.{hf}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise ModelLoadError(f"GGUF tensor {name} is not part of the {family.architecture} layout tokenmill reads")


def _read(gguf: GGUFFile, info, shape: tuple[int, ...], expert: Optional[int] = None,
          heads: Optional[int] = None, minus_one: bool = False) -> torch.Tensor:
    """One tensor (or one expert's slab of a stacked one) as float32 of `shape`; `heads`: undo
    llama.cpp's q/k row interleave over that many heads; `minus_one`: a Gemma norm stored as 1 + w."""
    raw, stored = gguf.raw(info), info.shape
    if expert is not None:
        # Expert e's rows are bytes [e * n, (e + 1) * n): rows are whole quantization blocks.
        n = info.nbytes // stored[0]
        raw, stored = raw[expert * n : (expert + 1) * n], stored[1:]
    tensor = dequantize(raw, info.ggml_type, stored).float().reshape(shape)
    if minus_one:
        tensor = tensor - 1.0
    return _unpermute_rows(tensor, heads) if heads else tensor


def _expert_name(family: _Family, layer, expert, proj: str) -> str:
    """HF's checkpoint name of one expert's projection ("gate", "up" or "down")."""
    hf_proj = family.expert_projs[("gate", "up", "down").index(proj)]
    return f"model.layers.{layer}.{family.moe_block}.experts.{expert}.{hf_proj}.weight"


def plan_gguf_weights(gguf: GGUFFile, cfg: dict[str, Any]) -> list[PlannedWeight]:
    """Every HF weight of the file with its shape, each read only when asked for: a stacked expert
    tensor becomes one weight per expert (HF's per-expert checkpoint names), read slab by slab."""
    _, family = _family(gguf)
    # Rows to restore, for the archs llama.cpp permutes (k with the KV head count, as it permuted them).
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]} if family.permute_qk else {}
    plan: list[PlannedWeight] = []
    for name, info in gguf.tensors.items():
        if name == "rope_freqs.weight":
            continue  # in config.json (rope_freq_factors)
        stacked, split = _STACKED_EXPERTS.fullmatch(name), _SPLIT_EXPERT.fullmatch(name)
        if stacked is not None:
            layer, proj = stacked.groups()
            num = cfg[family.experts_key]
            if len(info.shape) != 3 or info.shape[0] != num:
                raise ModelLoadError(f"GGUF tensor {name} has shape {info.shape}; expected [{num}, rows, columns]")
            plan += [(_expert_name(family, layer, e, proj), info.shape[1:],
                      functools.partial(_read, gguf, info, info.shape[1:], expert=e)) for e in range(num)]
            continue
        if split is not None:
            layer, proj, expert = split.groups()
            plan.append((_expert_name(family, layer, expert, proj), info.shape,
                         functools.partial(_read, gguf, info, info.shape)))
            continue
        piece = name.split(".")[2] if name.startswith("blk.") else None
        shape = info.shape
        if piece == "ffn_gate_inp_shexp" and len(shape) == 1:
            shape = (1, *shape)  # llama.cpp keeps the shared expert's gate as [H]; HF's is a [1, H] Linear
        minus_one = family.gemma and name.endswith("norm.weight")
        plan.append((_hf_name(name, family), shape,
                     functools.partial(_read, gguf, info, shape, heads=heads.get(piece), minus_one=minus_one)))
    return plan


def _build_tokenizer(gguf: GGUFFile):
    from tokenmill.loader.gguf_tokenizer import build_gguf_tokenizer

    if gguf.metadata.get("tokenizer.ggml.model") == "gpt2":
        return build_gguf_tokenizer(gguf.metadata)
    if "tokenizer.ggml.tokens" not in gguf.metadata:
        return None
    # Sentencepiece vocabularies: transformers' converter (slow, but cached after this).
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gguf.path), gguf_file=os.path.basename(gguf.path))


def _write_hf_dir(directory: str, gguf: GGUFFile, cfg: dict[str, Any], tokenizer) -> None:
    # Tensor by tensor (a stacked expert tensor expert by expert): the host holds one, not the model.
    save_safetensors_streaming(os.path.join(directory, "model.safetensors"), plan_gguf_weights(gguf, cfg),
                               metadata={"format": "pt", "source": os.path.basename(gguf.path)})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    with open(os.path.join(directory, "source.json"), "w") as f:
        json.dump({"gguf": os.path.abspath(gguf.path)}, f)


def convert_gguf_to_hf_dir(path: str) -> str:
    """The cached HF directory for this GGUF file, converting it on first use."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}")
    started = time.perf_counter()
    target = os.path.join(cache_root(), "gguf", f"{file_digest(path)[:24]}-{CACHE_FORMAT}")
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    gguf = GGUFFile(path)
    try:
        cfg = hf_config_from_gguf(gguf)
        tokenizer = _build_tokenizer(gguf)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(target))
        try:
            _write_hf_dir(tmp, gguf, cfg, tokenizer)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        gguf.close()
    try:
        os.rename(tmp, target)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s to %s in %.1fs", path, target, time.perf_counter() - started)
    return target



_EXPORT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                  "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def export_gguf_as_hf(path: str, out_dir: str, dtype: str = "float32") -> str:
    """Write the HF directory of a GGUF file (config.json, model.safetensors, tokenizer files) to
    out_dir, its weights in `dtype`; the conversion itself comes from (or goes into) the cache."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if dtype not in _EXPORT_DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (choose from {', '.join(_EXPORT_DTYPES)})")
    torch_dtype = _EXPORT_DTYPES[dtype]
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ModelLoadError(f"{out_dir} already exists and is not an empty directory")
    cached = convert_gguf_to_hf_dir(path)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(cached):
        if name not in ("model.safetensors", "config.json", "source.json"):
            shutil.copy2(os.path.join(cached, name), os.path.join(out_dir, name))
    with open(os.path.join(cached, "config.json")) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    weights_path = os.path.join(out_dir, "model.safetensors")
    if torch_dtype == torch.float32:
        shutil.copyfile(os.path.join(cached, "model.safetensors"), weights_path)
    else:
        with safe_open(os.path.join(cached, "model.safetensors"), framework="pt") as f:
            weights = {k: f.get_tensor(k).to(torch_dtype) for k in f.keys()}
            metadata = f.metadata()
        save_file(weights, weights_path, metadata=metadata)
    logger.info("wrote %s (%s) from %s", out_dir, cfg["torch_dtype"], path)
    return out_dir
