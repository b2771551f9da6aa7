"""Reading a LoRA adapter as PEFT saves it, and checking it against the model before it is used.

A PEFT LoRA directory holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors are
named `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight` (a
mixture-of-experts layer's shared expert: `mlp.shared_expert`), with A of
shape [r, in] and B of shape [out, r]. The adapter adds `scaling * B @ A @ x` to the module's output,
with scaling = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (`use_rslora`). The rank of each
module is read from its tensors (so `rank_pattern` needs nothing more).

Only plain LoRA on the seven projections of a decoder layer is accepted (in a mixture-of-experts
layer, the shared expert's; its experts take none); everything else (DoRA, bias
training, modules_to_save, embeddings, alpha patterns, Conv1D layouts, pickled weights) is refused
with a LoRAError that names it, before anything reaches the device. Nothing is ever unpickled.
"""

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from tokenmill.errors import LoRAError
from tokenmill.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT's module name -> (tokenmill's fused projection, its slice)
TARGETS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp|mlp\.shared_expert)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")

# Config keys whose presence with a non-neutral value means something this loader does not implement.
_REFUSED = {
    "use_dora": (True,), "lora_bias": (True,), "fan_in_fan_out": (True,),
}


@dataclass
class LoRAWeights:
    """One module's adapter: A [r, in] and B [out, r] with the scaling folded into B (fp32, CPU)."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    """A checked adapter in host memory: (layer, PEFT module name) -> its weights."""

    request: LoRARequest
    rank: int  # the largest module rank
    modules: dict[tuple[int, str], LoRAWeights] = field(default_factory=dict)

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id

    def nbytes(self) -> int:
        return sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size() for w in self.modules.values())


@dataclass(frozen=True)
class ModuleShapes:
    """What the model's projections look like, to check an adapter against: PEFT module name ->
    (in_features, out_features) of the attention and the dense MLP, the number of decoder layers,
    and the layers whose MLP is a mixture of experts: there the MLP projections are the shared
    expert's (`shared_intermediate` wide), or none (the experts themselves take no adapter)."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]
    sparse_layers: frozenset[int] = frozenset()
    shared_intermediate: int = 0

    def part(self, layer: int, module: str) -> Optional[str]:
        """Where PEFT names layer's `module` ("self_attn", "mlp", "mlp.shared_expert"); None: nowhere."""
        if module in _ATTENTION:
            return "self_attn"
        if layer not in self.sparse_layers:
            return "mlp"
        return "mlp.shared_expert" if self.shared_intermediate else None

    def shape(self, layer: int, module: str) -> tuple[int, int]:
        if module in _MLP and layer in self.sparse_layers:
            h, s = self.shapes["q_proj"][0], self.shared_intermediate
            return (s, h) if module == "down_proj" else (h, s)
        return self.shapes[module]


def model_shapes(arch) -> ModuleShapes:
    """The PEFT-side shapes of a Llama-family model's projections (models/config.py's ModelArchConfig)."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv, i = arch.num_heads * d, arch.num_kv_heads * d, arch.intermediate_size
    moe = arch.moe
    sparse = frozenset(n for n in range(arch.num_layers) if moe is not None and moe.is_sparse(n))
    return ModuleShapes(arch.num_layers, {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }, sparse, moe.shared_expert_intermediate_size if moe is not None else 0)


def _read_config(path: str, name: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter {name!r}: {path!r} is not a directory")
    if not os.path.isfile(config_path):
        raise LoRAError(f"LoRA adapter {name!r}: {config_path} is missing (a PEFT adapter directory has "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: {config_path} could not be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {config_path} must hold a JSON object")
    return config


def _check_config(config: dict, name: str) -> float:
    """Refuse what is not plain LoRA; returns lora_alpha."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, bad in _REFUSED.items():
        if config.get(key) in bad:
            raise LoRAError(f"LoRA adapter {name!r}: {key}={config[key]!r} is not supported")
    if config.get("bias", "none") not in (None, "none"):
        raise LoRAError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise LoRAError(f"LoRA adapter {name!r}: modules_to_save {config['modules_to_save']!r} is not supported "
                        "(it replaces whole modules of the base model)")
    if config.get("alpha_pattern"):
        raise LoRAError(f"LoRA adapter {name!r}: alpha_pattern is not supported")
    if config.get("trainable_token_indices"):
        raise LoRAError(f"LoRA adapter {name!r}: trainable_token_indices is not supported")
    if config.get("target_parameters"):
        raise LoRAError(f"LoRA adapter {name!r}: target_parameters is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise LoRAError(f"LoRA adapter {name!r}: target_modules {unknown} are not supported; "
                            f"tokenmill applies LoRA to {', '.join(TARGETS)}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha must be a positive number, got {alpha!r}")
    return float(alpha)


def _read_tensors(path: str, name: str) -> dict[str, torch.Tensor]:
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise LoRAError(f"LoRA adapter {name!r}: only adapter_model.bin is there; pickled weights are not "
                            f"loaded (save the adapter with safe_serialization=True to get {WEIGHTS_FILE})")
        raise LoRAError(f"LoRA adapter {name!r}: {weights} is missing")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(weights, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: {weights} could not be read: {e}") from None


def load_adapter(request: LoRARequest, shapes: ModuleShapes, max_rank: int) -> LoRAAdapter:
    """Read and check the adapter `request` names against the model's `shapes`; LoRAError if
    anything about it is wrong or unsupported."""
    name, path = request.lora_name, request.lora_path
    config = _read_config(path, name)
    tensors = _read_tensors(path, name)
    experts = next((key for key in tensors if ".mlp.experts." in key), None)
    if experts is not None:  # said first: PEFT's config for experts has patterns refused below
        raise LoRAError(f"LoRA adapter {name!r}: {experts} adapts a mixture-of-experts layer's experts, which take "
                        "no adapter yet (the attention, dense MLP and shared-expert projections do)")
    alpha = _check_config(config, name)
    rslora = bool(config.get("use_rslora", False))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _TENSOR.search(key)
        if m is None:
            what = "embedding LoRA" if "lora_embedding" in key else "a tensor"
            raise LoRAError(f"LoRA adapter {name!r}: {what} {key!r} is not supported (only lora_A / lora_B of "
                            f"{', '.join(TARGETS)} in the decoder layers)")
        layer, part, module, half = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in TARGETS:
            raise LoRAError(f"LoRA adapter {name!r}: module {module!r} ({key}) is not one tokenmill applies LoRA "
                            f"to ({', '.join(TARGETS)})")
        if layer >= shapes.num_layers:
            raise LoRAError(f"LoRA adapter {name!r}: {key} is for layer {layer}, but the model has "
                            f"{shapes.num_layers} layers")
        where = shapes.part(layer, module)
        if part != where:
            there = f"its {module} is under {where}" if where else "its MLP is experts only"
            raise LoRAError(f"LoRA adapter {name!r}: {key} does not fit this model: in layer {layer} {there}")
        if tensor.dim() != 2:
            raise LoRAError(f"LoRA adapter {name!r}: {key} must be a matrix, got shape {tuple(tensor.shape)}")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise LoRAError(f"LoRA adapter {name!r}: {os.path.join(path, WEIGHTS_FILE)} holds no LoRA weights")
    adapter = LoRAAdapter(request, rank=0)
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{next(iter(pair))} "
                            f"without lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        r = a.shape[0]
        k, n = shapes.shape(layer, module)
        if a.shape != (r, k) or b.shape != (n, r):
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                            f"{tuple(b.shape)}; the model needs ({r}, {k}) and ({n}, {r}) (an adapter of "
                            f"another base model?)")
        if r > max_rank:
            raise LoRAError(f"LoRA adapter {name!r}: rank {r} (layer {layer} {module}) is above max_lora_rank "
                            f"{max_rank}; start the engine with a larger max_lora_rank")
        scaling = alpha / (math.sqrt(r) if rslora else r)
        adapter.modules[(layer, module)] = LoRAWeights(a.float().contiguous(), (b.float() * scaling).contiguous())
        adapter.rank = max(adapter.rank, r)
    return adapter


def describe(adapter: LoRAAdapter) -> str:
    modules = sorted({m for _, m in adapter.modules})
    return (f"LoRA adapter {adapter.request.lora_name!r} (id {adapter.lora_int_id}, rank {adapter.rank}, "
            f"{', '.join(modules)})")

