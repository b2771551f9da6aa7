"""load_model: from a model reference to a model on its device, with its tokenizer."""

import inspect
import json
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from tqdm.auto import tqdm

from tokenmill.errors import ModelLoadError
from tokenmill.layers.fused_moe import process_moe_weights_after_loading
from tokenmill.loader.resolve import ModelSource, resolve_model
from tokenmill.logger import init_logger
from tokenmill.models.config import ModelArchConfig, arch_config_from_hf
from tokenmill.models.registry import get_model_class

logger = init_logger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    arch: ModelArchConfig
    tokenizer: Optional[object]
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: list[int] = field(default_factory=list)
    load_seconds: float = 0.0


def resolve_device(device) -> torch.device:
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for, but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {device!r} is not supported (cpu or cuda)")
    return dev


def resolve_dtype(dtype, device: torch.device, checkpoint_dtype: Optional[str]) -> torch.dtype:
    """'auto': float32 on CPU; on CUDA the checkpoint's half type, else bfloat16."""
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    elif dtype in (None, "auto"):
        if device.type == "cpu":
            chosen = torch.float32
        else:
            chosen = _DTYPES.get(str(checkpoint_dtype), torch.bfloat16)
            if chosen == torch.float32:
                chosen = torch.bfloat16
    elif str(dtype).lower() in _DTYPES:
        chosen = _DTYPES[str(dtype).lower()]
    else:
        raise ModelLoadError(f"unknown dtype {dtype!r} (float32, bfloat16, float16 or auto)")
    if chosen not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelLoadError(f"dtype {chosen} is not supported for model weights")
    _check_dtype_on_device(chosen, device)
    return chosen


def _check_dtype_on_device(dtype: torch.dtype, device: torch.device) -> None:
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ModelLoadError(f"{torch.cuda.get_device_name(device)} does not support bfloat16; use --dtype float16")
    try:  # the ops the model needs must exist for this dtype on this device
        a = torch.ones(2, 2, dtype=dtype, device=device)
        torch.nn.functional.linear(a, a)
    except RuntimeError as e:
        raise ModelLoadError(f"dtype {dtype} is not supported on {device}: {e}") from None


def _read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise ModelLoadError(f"corrupt config.json in {directory}: {e}") from None


def _eos_ids(arch: ModelArchConfig, tokenizer, directory: Optional[str]) -> list[int]:
    ids = list(arch.eos_token_ids)
    if directory:
        gen_path = os.path.join(directory, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return sorted(set(ids))


def load_tokenizer(reference: str):
    """A tokenizer by itself (LoadConfig.tokenizer): from an HF directory, a GGUF file, or the
    embedded model's name."""
    source = resolve_model(reference, "auto")
    directory = source.path
    if source.kind == "gguf":
        from tokenmill.loader.gguf_loader import convert_gguf_to_hf_dir

        directory = convert_gguf_to_hf_dir(source.path)
    from tokenmill.loader.tokenizer import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(directory)
    if tokenizer is None:
        raise ModelLoadError(f"no tokenizer files in {directory}")
    return tokenizer


def read_arch(model: Optional[str] = None, load_format: str = "auto"):
    """The model's ModelArchConfig without building it (to check a parallel layout first)."""
    source = resolve_model(model, load_format)
    if source.kind == "dummy":
        from tokenmill.models.presets import PRESETS, get_preset

        if source.path.lower() in PRESETS or not os.path.isdir(source.path):
            return arch_config_from_hf(get_preset(source.path))
        return arch_config_from_hf(_read_config(source.path))
    directory = source.path
    if source.kind == "gguf":
        from tokenmill.loader.gguf_loader import convert_gguf_to_hf_dir

        directory = convert_gguf_to_hf_dir(source.path)
    return arch_config_from_hf(_read_config(directory))


def load_model(model: Optional[str] = None, *, dtype="auto", device=None, load_format: str = "auto",
               max_positions: Optional[int] = None, seed: int = 0, tokenizer: Optional[str] = None,
               quantization: Optional[str] = None, revision: Optional[str] = None,
               download_dir: Optional[str] = None, with_tokenizer: bool = True) -> LoadedModel:
    """quantization: quantize the linear layers after loading ("fp8", loader/quantize.py);
    revision, download_dir: for a Hugging Face Hub id (loader/hub.py); with_tokenizer=False: the
    weights only (a tensor-parallel worker rank, which never sees text)."""
    started = time.perf_counter()
    dev = resolve_device(device)
    source = resolve_model(model, load_format, revision, download_dir)
    directory = None
    if source.kind == "dummy":
        from tokenmill.models.presets import PRESETS, get_preset

        if source.path.lower() in PRESETS:
            hf_cfg = get_preset(source.path)
        elif os.path.isdir(source.path):
            directory = source.path
            hf_cfg = _read_config(source.path)
        else:
            hf_cfg = get_preset(source.path)  # raises, naming the presets
    else:
        directory = source.path
        if source.kind == "gguf":
            from tokenmill.loader.gguf_loader import convert_gguf_to_hf_dir

            directory = convert_gguf_to_hf_dir(source.path)
        hf_cfg = _read_config(directory)
    arch = arch_config_from_hf(hf_cfg)
    from tokenmill.loader.quantize import (convert_block_fp8_checkpoint, expect_fp8_checkpoint, expert_quantization,
                                           log_expert_quantization, quantize_model, resolve_quantization)

    plan = resolve_quantization(quantization, hf_cfg)
    if plan is not None and arch.mla is not None:  # MLAAttention reads kv_b_proj's weight as 16/32-bit numbers
        raise ModelLoadError(f"FP8 weights on {arch.architecture} are not supported yet (its latent attention "
                             "absorbs kv_b_proj's weight unquantized)")
    torch_dtype = resolve_dtype(dtype, dev, arch.torch_dtype)
    model_cls = get_model_class(arch.architecture)
    with torch.device(dev), expert_quantization(plan, arch.architecture):  # experts in their final form
        net = model_cls(arch, max_positions=max_positions, dtype=torch_dtype, device=dev)
    log_expert_quantization(net, plan)
    if plan is not None and plan.from_checkpoint:
        if source.kind == "dummy":
            raise ModelLoadError("an FP8 checkpoint's config with dummy weights: use quantization=\"fp8\" on a "
                                 "full-precision model instead")
        expect_fp8_checkpoint(net, plan.block_size, plan.unquantized)
    tokenizer_ref, tokenizer = tokenizer, None
    if source.kind == "dummy":
        from tokenmill.loader.dummy import initialize_dummy_weights

        initialize_dummy_weights(net, seed=seed)
        if directory is not None and tokenizer_ref is None and with_tokenizer:
            from tokenmill.loader.tokenizer import load_hf_tokenizer

            tokenizer = load_hf_tokenizer(directory)
    else:
        _load_checkpoint(net, directory, plan)
        if plan is not None and plan.block_size is not None:
            convert_block_fp8_checkpoint(net)  # block scales -> the per-row scales the kernels read
        if tokenizer_ref is None and with_tokenizer:
            from tokenmill.loader.tokenizer import load_hf_tokenizer

            tokenizer = load_hf_tokenizer(directory)
    process_moe_weights_after_loading(net)
    if tokenizer_ref is not None:
        tokenizer = load_tokenizer(tokenizer_ref)  # replaces the model's (dummy presets have none)
        if len(tokenizer) > arch.vocab_size:
            raise ModelLoadError(f"the tokenizer {tokenizer_ref} has {len(tokenizer)} tokens, more than the "
                                 f"model's vocabulary ({arch.vocab_size})")
    if plan is not None and not plan.from_checkpoint:
        quantize_model(net, plan.method)
    net.eval()
    drop_weight_loaders(net)
    elapsed = time.perf_counter() - started
    logger.info("loaded %s (%s, %s on %s) in %.2fs", source.name, arch.architecture, torch_dtype, dev, elapsed)
    return LoadedModel(net, arch, tokenizer, source, torch_dtype, dev, _eos_ids(arch, tokenizer, directory), elapsed)


def drop_weight_loaders(net: torch.nn.Module) -> None:
    """Remove the bound methods the layers hang on their parameters for loading (weight_loader and
    the like): each makes a cycle module -> parameter -> method -> module, so the weights would only
    be freed by a garbage collection; nothing loads into the parameters after load_model."""
    for _, param in net.named_parameters(remove_duplicate=False):
        for name, value in list(vars(param).items()):
            if inspect.ismethod(value):
                delattr(param, name)


def _load_checkpoint(net, directory: str, plan=None) -> None:
    from tokenmill.loader.quantize import skip_checkpoint_tensor
    from tokenmill.loader.safetensors_weights import iter_safetensors, safetensors_files

    files = safetensors_files(directory)
    device = next(net.parameters()).device

    def stream():
        for name, tensor in iter_safetensors(directory):
            if skip_checkpoint_tensor(name, plan):
                continue
            # Straight to the device; the dtype conversion happens in the parameter's copy_.
            yield name, tensor.to(device, non_blocking=True)
            bar.update(1)

    with tqdm(desc="loading weights", unit="tensor", disable=len(files) < 2, leave=False) as bar:
        try:
            loaded = net.load_weights(stream())
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"checkpoint in {directory} does not fit the model: {e}") from None
    missing = net.expected_weights() - loaded
    if missing:
        raise ModelLoadError(f"checkpoint in {directory} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
