"""LoRA adapters served by name (vLLM's conventions): the server's registry and its two routes.

`tokenmill serve --enable-lora --lora-modules name=path ...` loads each adapter into the engine at
start-up (ids 1, 2, ... in order); POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST
/v1/unload_lora_adapter {"lora_name"} (or "lora_int_id") change the set while the server runs. A
request whose `model` is an adapter's name runs with that adapter; /v1/models lists each adapter
with its base model as `parent`.

The registry lives on the app (one per API server process). With --api-server-count above 1 every
process starts with the --lora-modules adapters, but loading and unloading at run time is refused
(400): a change made in one process would not be seen by the others, and two processes could give
two adapters the same engine id.

Unloading takes the name out of the registry first (new requests by that name get the usual 404),
then removes the adapter from the engine, which keeps serving the requests that use it still.
Engine ids are never reused within a server's life, so an id always means one adapter.

Run-time loading is a way into the server's files for anyone holding the API key, so it is off
unless the operator turns it on (--allow-runtime-lora-updating; both routes are a 400 otherwise),
and then reads only directories under the operator's --lora-root DIRs: a lora_path (absolute, or
relative to a root) is resolved with its symlinks, and so are the adapter's files; anything outside
a root, missing, not a directory or without adapter_config.json gets one and the same error text,
so answers tell nothing about the files outside. Adapter names are letters, digits, `.`, `_` and `-`
(a letter or digit first), and /v1/models shows no server paths.

This module imports no server dependency: `tokenmill serve` parses --lora-modules with it.
"""

import asyncio
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from tokenmill.config import ConfigError
from tokenmill.errors import InvalidRequestError
from tokenmill.lora.request import LoRARequest

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch: `$` would let a final newline in
NAME_RULE = "1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit"
# The files of a PEFT adapter directory the engine may read (lora/adapter.py).
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
# The one answer to every lora_path refused: whether a path exists, and what is there, is never told.
REFUSED_PATH = ("lora_path is not a LoRA adapter directory (with adapter_config.json) under a directory this "
                "server loads adapters from (--lora-root)")


@dataclass(frozen=True)
class LoRAModule:
    """One adapter the server serves: the engine's LoRARequest and the base model it was made for
    (None: the first served model name)."""

    request: LoRARequest
    base_model_name: Optional[str] = None

    @property
    def name(self) -> str:
        return self.request.lora_name

    @property
    def path(self) -> str:
        return self.request.lora_path


@dataclass(frozen=True)
class LoRAModuleSpec:
    """A --lora-modules entry before it has an id."""

    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_lora_module(value: str) -> LoRAModuleSpec:
    """One --lora-modules value: `name=path`, or vLLM's JSON form
    '{"name": "a", "path": "/p", "base_model_name": "m"}' (base_model_name optional)."""
    text = value.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--lora-modules {value!r}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"--lora-modules {value!r}: the JSON form must be an object")
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
        if unknown:
            raise ConfigError(f"--lora-modules {value!r}: unknown key(s) {', '.join(unknown)} (known: name, path, "
                              "base_model_name)")
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"--lora-modules {value!r}: \"name\" must be a non-empty string")
        if not isinstance(path, str) or not path.strip():
            raise ConfigError(f"--lora-modules {value!r}: \"path\" must be a non-empty string")
        if base is not None and (not isinstance(base, str) or not base.strip()):
            raise ConfigError(f"--lora-modules {value!r}: \"base_model_name\" must be a non-empty string if given")
        return LoRAModuleSpec(name.strip(), path.strip(), base.strip() if base else None)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ConfigError(f"--lora-modules {value!r}: expected name=path or a JSON object "
                          '{"name": ..., "path": ..., "base_model_name": ...}')
    return LoRAModuleSpec(name.strip(), path.strip())


def check_adapter_dir(path: str) -> Optional[str]:
    """What is plainly wrong with an adapter path before the engine reads it (None: nothing seen);
    the engine checks the contents."""
    if not os.path.exists(path):
        return f"the LoRA adapter path {path!r} does not exist"
    if not os.path.isdir(path):
        return f"the LoRA adapter path {path!r} is not a directory (give the directory PEFT saved)"
    return None


def check_adapter_name(name: str) -> Optional[str]:
    """What is wrong with an adapter name (None: nothing)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return f"the LoRA adapter name {name!r} is not allowed: {NAME_RULE}"
    return None


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve_adapter_path(path: str, roots: Sequence[str]) -> Optional[str]:
    """The real path of adapter directory `path` (absolute, or relative to a root) if it and its
    adapter files, symlinks resolved, are inside one of `roots` (real paths) and it holds
    adapter_config.json; None otherwise."""
    if not path or "\x00" in path:
        return None
    for candidate in ([path] if os.path.isabs(path) else [os.path.join(r, path) for r in roots]):
        real = os.path.realpath(candidate)
        root = next((r for r in roots if _inside(real, r)), None)
        if root is None or not os.path.isdir(real) or not os.path.isfile(os.path.join(real, _ADAPTER_FILES[0])):
            continue
        files = [os.path.join(real, f) for f in _ADAPTER_FILES]
        if all(_inside(os.path.realpath(f), root) for f in files if os.path.lexists(f)):
            return real
    return None


def assign_ids(specs: list[LoRAModuleSpec], served_model_names: list[str]) -> list[LoRAModule]:
    """Ids 1, 2, ... in order; names unique and distinct from the served model names (ConfigError)."""
    modules: list[LoRAModule] = []
    seen: set[str] = set()
    for spec in specs:
        problem = check_adapter_name(spec.name)
        if problem:
            raise ConfigError(f"--lora-modules: {problem}")
        if spec.name in served_model_names:
            raise ConfigError(f"--lora-modules: the adapter name {spec.name!r} is also a served model name; "
                              "give the adapter another name")
        if spec.name in seen:
            raise ConfigError(f"--lora-modules: the adapter name {spec.name!r} is given twice")
        seen.add(spec.name)
        modules.append(LoRAModule(LoRARequest(spec.name, len(modules) + 1, spec.path), spec.base_model_name))
    return modules


class LoRARegistryError(Exception):
    """A load or unload the registry refuses: `status` and `code` for the API error."""

    def __init__(self, status: int, message: str, code: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class LoRARegistry:
    """Adapter name -> LoRAModule for one API server process. Reads (lookup, list) happen on the
    event loop; loads and unloads are serialized by a lock (each awaits the engine)."""

    def __init__(self, served_model_names: Sequence[str], modules: Sequence[LoRAModule] = (), *, enabled: bool = False,
                 dynamic: bool = True, dynamic_refusal: str = "", runtime_updating: bool = False,
                 roots: Sequence[str] = ()):
        self.served_model_names = list(served_model_names)
        self.enabled = enabled
        self.dynamic = dynamic  # run-time loading and unloading possible (one API server process)
        self.dynamic_refusal = dynamic_refusal
        self.runtime_updating = runtime_updating  # the operator allows it (--allow-runtime-lora-updating)
        self.roots = [os.path.realpath(r) for r in roots]  # run-time loads read only under these
        self._modules: dict[str, LoRAModule] = {}
        for m in modules:
            if m.name in self._modules or m.name in self.served_model_names:
                raise ConfigError(f"the LoRA adapter name {m.name!r} is used twice")
            self._modules[m.name] = m
        self._next_id = max((m.request.lora_int_id for m in modules), default=0) + 1
        self._lock: Optional[asyncio.Lock] = None  # made on the event loop, when first needed

    # ---- reads ---------------------------------------------------------------------------------
    def get(self, name: str) -> Optional[LoRAModule]:
        return self._modules.get(name)

    def modules(self) -> list[LoRAModule]:
        return list(self._modules.values())

    def names(self) -> list[str]:
        return list(self._modules)

    def parent_of(self, module: LoRAModule) -> str:
        return module.base_model_name or self.served_model_names[0]

    # ---- changes -------------------------------------------------------------------------------
    def _check_dynamic(self) -> None:
        if not self.enabled:
            raise LoRARegistryError(400, "LoRA is not enabled on this server: start it with --enable-lora to load "
                                         "adapters", code="lora_not_enabled")
        if not self.runtime_updating:
            raise LoRARegistryError(400, "loading and unloading LoRA adapters at run time is off on this server (the "
                                         "operator can allow it with --allow-runtime-lora-updating and --lora-root)",
                                    code="lora_update_disabled")
        if not self.dynamic:
            raise LoRARegistryError(400, self.dynamic_refusal, code="lora_update_unsupported")

    def _guard(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def load(self, name: str, path: str, add: Callable[[LoRARequest], Any]) -> LoRAModule:
        """Register adapter `name` from `path` once `await add(request)` (the engine's add_lora) has
        loaded it; LoRARegistryError if refused, the engine's error (LoRAError) if it fails."""
        self._check_dynamic()
        problem = check_adapter_name(name)
        if problem:
            raise LoRARegistryError(400, problem, code="invalid_lora_name", param="lora_name")
        if not path or not path.strip():
            raise LoRARegistryError(400, "lora_path must be a non-empty string", code="invalid_lora_path",
                                    param="lora_path")
        async with self._guard():
            if name in self.served_model_names:
                raise LoRARegistryError(400, f"`{name}` is the name of a served base model; give the adapter another "
                                             "name", code="lora_name_in_use", param="lora_name")
            if name in self._modules:
                raise LoRARegistryError(400, f"the LoRA adapter `{name}` is already loaded; unload it first to "
                                             "replace it", code="lora_already_loaded", param="lora_name")
            real = resolve_adapter_path(path, self.roots)
            if real is None:
                raise LoRARegistryError(400, REFUSED_PATH, code="invalid_lora_adapter", param="lora_path")
            request = LoRARequest(name, self._next_id, real)  # the checked path, not one a link could move
            self._next_id += 1  # never reused, even if the load fails
            try:
                await add(request)
            except InvalidRequestError as e:  # the engine's LoRAError: said with the client's path
                raise type(e)(str(e).replace(real, path)) from None
            module = LoRAModule(request)
            self._modules[name] = module
            return module

    async def unload(self, name: Optional[str], lora_int_id: Optional[int],
                     remove: Callable[[int], Any]) -> LoRAModule:
        """Take adapter `name` (or the one with `lora_int_id`) out of the registry, then out of the
        engine (`await remove(id)`). Requests already running with it keep running."""
        self._check_dynamic()
        async with self._guard():
            module = self._find(name, lora_int_id)
            del self._modules[module.name]  # new requests by this name: unknown model from now on
            await remove(module.request.lora_int_id)
            return module

    def _find(self, name: Optional[str], lora_int_id: Optional[int]) -> LoRAModule:
        if not name and lora_int_id is None:
            raise LoRARegistryError(400, "give lora_name (or lora_int_id) of the adapter to unload",
                                    code="invalid_lora_name", param="lora_name")
        if name:
            module = self._modules.get(name)
            if module is None:
                if name in self.served_model_names:
                    raise LoRARegistryError(400, f"`{name}` is a served base model, not a LoRA adapter; it cannot "
                                                 "be unloaded", code="invalid_lora_name", param="lora_name")
                shown = name if len(name) <= 100 else f"{name[:100]}... ({len(name)} characters)"
                raise LoRARegistryError(404, f"the LoRA adapter `{shown}` is not loaded"
                                        + self._loaded_hint(), code="lora_not_found", param="lora_name")
            if lora_int_id is not None and lora_int_id != module.request.lora_int_id:
                raise LoRARegistryError(400, f"the LoRA adapter `{name}` has lora_int_id "
                                             f"{module.request.lora_int_id}, not {lora_int_id}",
                                        code="invalid_lora_name", param="lora_int_id")
            return module
        for module in self._modules.values():
            if module.request.lora_int_id == lora_int_id:
                return module
        raise LoRARegistryError(404, f"no loaded LoRA adapter has lora_int_id {lora_int_id}" + self._loaded_hint(),
                                code="lora_not_found", param="lora_int_id")

    def _loaded_hint(self) -> str:
        if not self._modules:
            return " (none is loaded)"
        return " (loaded: " + ", ".join(f"{m.name} (id {m.request.lora_int_id})" for m in self._modules.values()) + ")"
