"""GGUF files -> an HF-style config, HF-named float32 weights and a tokenizer.

The first load of a file converts it into an HF directory (config.json, model.safetensors,
tokenizer files) in the user cache, keyed by the file's hash; later loads read that directory.
"""

import hashlib
import json
import os
import shutil
import tempfile
import time
from typing import Any, Iterator

import torch

from tokenmill.errors import ModelLoadError, UnsupportedArchitectureError
from tokenmill.loader.gguf_dequant import dequantize
from tokenmill.loader.gguf_reader import GGUFFile
from tokenmill.logger import init_logger

logger = init_logger(__name__)

CACHE_FORMAT = "v2"  # bump when the converted layout changes (v2: config.json loads in HF transformers)

_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM"}

# GGUF tensor name -> HF name ("{i}" is the layer index).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


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


def hf_config_from_gguf(gguf: GGUFFile) -> dict[str, Any]:
    md = gguf.metadata
    arch = md.get("general.architecture")
    if arch not in _ARCH:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCH)})"
        )

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
        "architectures": [_ARCH[arch]],
        "model_type": arch,  # GGUF's architecture names are HF's model types for these four
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
    if "rope_freqs.weight" in gguf.tensors:
        info = gguf.tensors["rope_freqs.weight"]
        cfg["rope_freq_factors"] = dequantize(gguf.raw(info), info.ggml_type, info.shape).float().tolist()
    return cfg


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows.

    llama.cpp interleaves the two rotary halves of each head (row j of the first half and row j of
    the second become rows 2j and 2j+1); rows come back as [head, pair, half] -> [head, half, pair].
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk."):
        _, idx, piece = base.split(".", 2)
        if piece not in _LAYER_NAMES:
            raise ModelLoadError(f"unexpected GGUF tensor {name}")
        return f"model.layers.{idx}.{_LAYER_NAMES[piece]}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise ModelLoadError(f"unexpected GGUF tensor {name}")


def iter_gguf_weights(gguf: GGUFFile, cfg: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight, dequantized and with q/k rows restored."""
    llama_layout = gguf.metadata.get("general.architecture") in ("llama", "mistral")
    for name, info in gguf.tensors.items():
        if name == "rope_freqs.weight":
            continue
        tensor = dequantize(gguf.raw(info), info.ggml_type, info.shape).float()
        if llama_layout and ".attn_q." in name:
            tensor = _unpermute_rows(tensor, cfg["num_attention_heads"])
        elif llama_layout and ".attn_k." in name:
            tensor = _unpermute_rows(tensor, cfg["num_key_value_heads"])
        yield _hf_name(name), tensor


def _build_tokenizer(gguf: GGUFFile):
    from tokenmill.loader.gguf_tokenizer import build_gguf_tokenizer

    if gguf.metadata.get("tokenizer.ggml.model") == "gpt2":
        return build_gguf_tokenizer(gguf.metadata)
    if "tokenizer.ggml.tokens" not in gguf.metadata:
        return None
    # Sentencepiece vocabularies: transformers' converter (slow, but cached after this).
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gguf.path), gguf_file=os.path.basename(gguf.path))


def convert_gguf_to_hf_dir(path: str) -> str:
    """The cached HF directory for this GGUF file, converting it on first use."""
    from safetensors.torch import save_file

    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}")
    started = time.perf_counter()
    target = os.path.join(cache_root(), "gguf", f"{file_digest(path)[:24]}-{CACHE_FORMAT}")
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    gguf = GGUFFile(path)
    try:
        cfg = hf_config_from_gguf(gguf)
        weights = dict(iter_gguf_weights(gguf, cfg))
        tokenizer = _build_tokenizer(gguf)
    finally:
        gguf.close()
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(target))
    try:
        save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"source": os.path.basename(path)})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump({"gguf": os.path.abspath(path)}, f)
        try:
            os.rename(tmp, target)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
