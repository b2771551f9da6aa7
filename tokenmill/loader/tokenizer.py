"""Tokenizers of HF model directories."""

import os
from typing import Optional

from tokenmill.errors import ModelLoadError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_hf_tokenizer(directory: str) -> Optional[object]:
    """The directory's tokenizer, or None when it has no tokenizer files (then prompts are token ids)."""
    if not any(os.path.isfile(os.path.join(directory, name)) for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # transformers raises many kinds here
        raise ModelLoadError(f"cannot load the tokenizer in {directory}: {e}") from None
