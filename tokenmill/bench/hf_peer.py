"""The peer: HF transformers continuous batching on the same workload, in the same process.

The model is the same architecture with random weights (`AutoModelForCausalLM.from_config`), built
directly on the device. We drive transformers' ContinuousBatchingManager ourselves instead of
`generate_batch`, for two reasons: `generate_batch` takes one `max_new_tokens` for all requests,
while the manager's `add_request` takes it per request (so HF generates exactly each request's
budget, like tokenmill); and the manager's warm-up (CUDA graph capture) and a few warm-up requests
then stay outside the timed region. EOS is disabled with `eos_token_id=-1` (the manager's own
"no EOS" value). Sampling matches the workload: temperature 0.6, no top-k / top-p.

Version differences (checked against 5.24 here; the GPU image has 5.17) are handled by looking at
signatures instead of version numbers: keyword arguments a version does not take are not passed,
and the attention implementation is "paged|sdpa" before 5.23 (after which the "paged|" prefix is
deprecated and "sdpa" means the same). If a version's `add_request` had no per-request
`max_new_tokens`, every request would run to the largest budget and only the tokens within each
request's own budget are counted (reported as `per_request_budget: false`).
"""

from __future__ import annotations

import inspect
import time
from typing import Optional, Sequence

from tokenmill.bench.workloads import BenchRequest

# transformers' model_type for each architecture a preset names (its MoE classes, e.g. Qwen3MoeConfig,
# read the preset's expert fields under the same names).
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2",
                "MistralForCausalLM": "mistral", "Qwen3MoeForCausalLM": "qwen3_moe",
                "Qwen2MoeForCausalLM": "qwen2_moe", "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe"}


def hf_config(model: str):
    """A transformers config for a tokenmill preset name, or from an HF model directory."""
    import os

    from transformers import AutoConfig

    from tokenmill.models.presets import PRESETS, get_preset

    if model.lower() in PRESETS:
        cfg = get_preset(model)
        cfg.pop("torch_dtype", None)
        arch = cfg["architectures"][0]
        if arch not in _MODEL_TYPES:
            raise ValueError(f"no transformers model type known for {arch}")
        return AutoConfig.for_model(_MODEL_TYPES[arch], **cfg)
    if os.path.isdir(model):
        return AutoConfig.from_pretrained(model)
    raise ValueError(f"--compare transformers needs a preset or an HF directory, got {model!r}")


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def default_attn_implementation() -> str:
    import transformers

    return "sdpa" if _version_tuple(transformers.__version__) >= (5, 23) else "paged|sdpa"


def _supported_kwargs(fn, **kwargs) -> dict:
    """The keyword arguments `fn` names in its signature (a **kwargs catch-all does not count: some
    versions route unknown names there as deprecated options)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _cb_config(overrides: dict):
    """A ContinuousBatchingConfig with the given fields (those this version knows), or None."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not overrides:
        return None
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        try:
            from transformers import ContinuousBatchingConfig
        except ImportError:
            return None
    return ContinuousBatchingConfig(**_supported_kwargs(ContinuousBatchingConfig.__init__, **overrides))


def _workload_hints(requests: Sequence[BenchRequest]):
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    return WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
                         max_generated_length=max(r.max_tokens for r in requests), num_requests=len(requests))


class HFPeer:
    """One model and one running manager; run() a batch of requests and time it."""

    def __init__(self, model: str, device, dtype, *, temperature: float, max_new_tokens: int,
                 attn_implementation: Optional[str] = None, cb_overrides: Optional[dict] = None,
                 hints_from: Optional[Sequence[BenchRequest]] = None, seed: int = 0):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.device = torch.device(device)
        self.attn_requested = attn_implementation or default_attn_implementation()
        torch.manual_seed(seed)
        config = hf_config(model)
        started = time.perf_counter()
        with torch.device(self.device):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                          attn_implementation=self.attn_requested)
        self.model.eval()
        self.build_s = time.perf_counter() - started
        sample = temperature > 0
        self.generation_config = GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature if sample else None,
            top_k=0 if sample else None, top_p=1.0 if sample else None, eos_token_id=-1, pad_token_id=0)
        init_kwargs = _supported_kwargs(self.model.init_continuous_batching,
                                        generation_config=self.generation_config,
                                        continuous_batching_config=_cb_config(cb_overrides or {}),
                                        workload_hints=_workload_hints(hints_from) if hints_from else None)
        init_kwargs = {k: v for k, v in init_kwargs.items() if v is not None}
        started = time.perf_counter()
        self.manager = self.model.init_continuous_batching(**init_kwargs)
        warmup = getattr(self.manager, "warmup", None)
        if callable(warmup):
            try:
                warmup()
            except TypeError:  # a version whose warmup wants arguments: the warm-up requests will do
                pass
        self.manager.start()
        self.warmup_s = time.perf_counter() - started
        self.per_request_budget = "max_new_tokens" in _supported_kwargs(self.manager.add_request, max_new_tokens=1)
        self._batch = 0

    @property
    def attn_implementation(self) -> str:
        return str(getattr(self.model.config, "_attn_implementation", self.attn_requested))

    def run(self, requests: Sequence[BenchRequest], timeout_s: float = 3600.0) -> dict:
        """Generate every request; returns counts, elapsed and per-request token counts."""
        import torch

        self._batch += 1
        budgets, ids = {}, []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        for i, r in enumerate(requests):
            rid = f"bench{self._batch}-{i}"
            kwargs = {"request_id": rid}
            if self.per_request_budget:
                kwargs["max_new_tokens"] = r.max_tokens
            kwargs = _supported_kwargs(self.manager.add_request, **kwargs)
            got = self.manager.add_request(list(r.prompt_token_ids), **kwargs)
            rid = got if isinstance(got, str) else rid
            budgets[rid] = r.max_tokens
            ids.append(rid)
        done: dict[str, object] = {}
        deadline = started + timeout_s
        while len(done) < len(ids):
            result = self.manager.get_result(timeout=1)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError(f"transformers' generation thread stopped with {len(ids) - len(done)} "
                                       "requests unfinished")
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"transformers did not finish {len(ids) - len(done)} requests in {timeout_s} s")
                continue
            finished = result.is_finished() if callable(getattr(result, "is_finished", None)) else True
            if finished and result.request_id in budgets:
                done[result.request_id] = result
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - started
        errors = [str(getattr(done[i], "error", None)) for i in ids if getattr(done[i], "error", None)]
        generated = [len(getattr(done[i], "generated_tokens", []) or []) for i in ids]
        counted = [min(g, budgets[i]) for g, i in zip(generated, ids)]
        return {"elapsed_s": elapsed, "output_tokens": sum(counted), "generated_tokens": sum(generated),
                "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests), "errors": errors[:5],
                "num_errors": len(errors), "short_requests": sum(c < budgets[i] for c, i in zip(counted, ids))}

    def close(self) -> None:
        manager, self.manager = getattr(self, "manager", None), None
        if manager is not None:
            try:
                manager.stop(block=True, timeout=60)
            except Exception:  # a failing stop must not hide the results
                pass
            if hasattr(manager, "destroy"):
                try:
                    manager.destroy()
                except Exception:
                    pass
        self.model = None


def run_hf_peer(model: str, requests: Sequence[BenchRequest], warmup: Sequence[BenchRequest], device, dtype, *,
                temperature: float, repeat: int = 1, attn_implementation: Optional[str] = None,
                cb_overrides: Optional[dict] = None, seed: int = 0) -> dict:
    """`seed`: the torch seed the random weights are drawn with (the bench passes tokenmill's engine
    seed; the two initialisations differ, so the weights do not match, only the seeding does)."""
    import transformers

    peer = HFPeer(model, device, dtype, temperature=temperature,
                  max_new_tokens=max(r.max_tokens for r in list(requests) + list(warmup)),
                  attn_implementation=attn_implementation, cb_overrides=cb_overrides, hints_from=requests, seed=seed)
    try:
        if warmup:
            peer.run(warmup)
        runs = []
        for _ in range(repeat):
            r = peer.run(requests)
            r["output_tok_per_s"] = r["output_tokens"] / r["elapsed_s"]
            r["total_tok_per_s"] = (r["output_tokens"] + r["prompt_tokens"]) / r["elapsed_s"]
            r["requests_per_s"] = len(requests) / r["elapsed_s"]
            runs.append(r)
        attn = peer.attn_implementation
    finally:
        build_s, warmup_s, per_request = peer.build_s, peer.warmup_s, peer.per_request_budget
        peer.close()
    rates = sorted(r["output_tok_per_s"] for r in runs)
    return {"peer": f"transformers {transformers.__version__} continuous batching",
            "transformers_version": transformers.__version__, "attn_implementation_requested":
            attn_implementation or default_attn_implementation(), "attn_implementation": attn,
            "per_request_budget": per_request, "cb_overrides": cb_overrides or {}, "seed": seed, "build_s": build_s,
            "manager_warmup_s": warmup_s, "runs": runs, "output_tok_per_s": rates[(len(rates) - 1) // 2]}
