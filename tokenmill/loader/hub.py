"""Hugging Face Hub ids (`org/name`): the model's snapshot directory, from huggingface_hub's cache
or downloaded into it (HF_HUB_OFFLINE honoured), with the id as the model's name."""

import os
import re
from typing import Optional

from tokenmill.errors import ModelLoadError
from tokenmill.logger import init_logger

logger = init_logger(__name__)

# What a load needs: config, safetensors (and their index), tokenizer and chat-template files;
# never pickled checkpoints or other formats' copies of the weights.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# huggingface_hub's cache layout: <cache>/models--org--name/snapshots/<revision>/
_SNAPSHOT = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")
_TRUE = {"1", "on", "yes", "true"}


def is_hub_id(reference: str) -> bool:
    """`org/name` that is not a local path (a relative path that exists is the local one)."""
    return bool(_HUB_ID.fullmatch(reference)) and ".." not in reference and not os.path.exists(reference)


def hub_name(directory: str) -> Optional[str]:
    """`org/name` for a snapshot directory of huggingface_hub's cache, else None."""
    m = _SNAPSHOT.search(os.path.abspath(directory).replace(os.sep, "/"))
    return f"{m.group(1)}/{m.group(2)}" if m else None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_snapshot(repo_id: str, revision: Optional[str] = None, download_dir: Optional[str] = None) -> str:
    """The local snapshot directory of a Hub model: from the cache (download_dir, else huggingface_hub's
    own: $HF_HUB_CACHE or $HF_HOME/hub), downloading what is missing unless HF_HUB_OFFLINE is set."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError:  # pragma: no cover -- a dependency of transformers
        raise ModelLoadError(f"{repo_id!r} looks like a Hugging Face Hub id, which needs huggingface_hub: "
                             "pip install huggingface_hub") from None
    where = download_dir or "the Hugging Face cache"
    at = f" at revision {revision!r}" if revision else ""
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=ALLOW_PATTERNS,
                                 local_files_only=offline())
    except RepositoryNotFoundError:
        raise ModelLoadError(f"model {repo_id!r} not found: no such local path, and the Hugging Face Hub has no "
                             "such model (or it is private or gated: log in with `hf auth login` or set "
                             "HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub") from None
    except LocalEntryNotFoundError:
        if offline():
            raise ModelLoadError(f"model {repo_id!r}{at} is not in {where} and HF_HUB_OFFLINE is set: download it "
                                 "once with network access (unset HF_HUB_OFFLINE), or give --download-dir a "
                                 "cache that holds it") from None
        raise ModelLoadError(f"model {repo_id!r}{at} is not in {where} and the Hugging Face Hub cannot be "
                             "reached: check the network (or its proxy settings)") from None
    except OSError as e:  # disk full, permissions, a download cut off
        raise ModelLoadError(f"cannot fetch model {repo_id!r}{at} into {where}: {e}") from None
    logger.info("model %s%s: %s", repo_id, at, path)
    return path


def local_model(model: Optional[str], load_format: str = "auto", revision: Optional[str] = None,
                download_dir: Optional[str] = None) -> Optional[str]:
    """The model reference the engine gets: a Hub id becomes its snapshot directory (fetched here,
    once, before any engine or worker process starts; the directory keeps the id as the model's
    name), anything else stays as it is."""
    if model is None or load_format == "dummy" or not is_hub_id(model):
        return model
    return hub_snapshot(model, revision, download_dir)
