"""Tokenizers of HF model directories."""

import json
import os
from typing import Optional

from tokenmill.errors import ModelLoadError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# tokenizer_config.json's names of the generic class (transformers 5 and 4): AutoTokenizer resolves them to it
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_hf_tokenizer(directory: str) -> Optional[object]:
    """The directory's tokenizer, or None when it has no tokenizer files (then prompts are token ids)."""
    if not any(os.path.isfile(os.path.join(directory, name)) for name in _TOKENIZER_FILES):
        return None
    try:
        if _generic_fast_tokenizer(directory):
            # The class AutoTokenizer would pick, without its import of every model's config (2 s a process)
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(directory)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # transformers raises many kinds here
        raise ModelLoadError(f"cannot load the tokenizer in {directory}: {e}") from None


def _generic_fast_tokenizer(directory: str) -> bool:
    """Whether the directory names the generic tokenizer.json class (no model-specific tokenizer class)."""
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return False
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("tokenizer_class") in _GENERIC_CLASSES
