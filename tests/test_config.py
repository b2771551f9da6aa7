"""One definition of every option: EngineConfig / LoadConfig fields give the flags and LLM()'s keywords."""

import argparse
import dataclasses
import inspect
import pathlib
from typing import Optional

import pytest

from tokenmill.config import ConfigError, EngineConfig, LoadConfig, field_default, option
from tokenmill.entrypoints import cli, serve_cli
from tokenmill.entrypoints.llm import LLM

FIELDS = [f for cls in (LoadConfig, EngineConfig) for f in dataclasses.fields(cls)]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every leaf command of the CLI by its path ("generate", "bench serve", ...)."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                inner = subcommands(sub)
                found.update({f"{name} {k}": v for k, v in inner.items()} if inner else {name: sub})
    return found


# The commands that run an engine (convert only rewrites a file and proxy only forwards requests:
# neither takes engine options).
COMMANDS = {k: v for k, v in subcommands(cli.build_parser()).items() if k not in ("convert", "proxy")}
BENCH_DEFAULTS = {"model": None, "load_format": None, "dtype": None}  # from the workload
SERVE_ENGINE_DEFAULTS = serve_cli.SERVE_ENGINE_DEFAULTS


def test_the_cli_has_every_command():
    assert {"generate", "chat", "serve", "bench throughput", "bench latency", "bench serve",
            "bench profile"} <= set(COMMANDS)


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_every_field_has_help_and_a_flag_with_its_default(field):
    assert field.metadata.get("help"), f"{field.name} has no help text"
    for name, parser in COMMANDS.items():
        actions = [a for a in parser._actions if a.dest == field.name]
        assert len(actions) == 1, (name, field.name)
        assert "--" + field.name.replace("_", "-") in actions[0].option_strings or field.name == "seed"
        # The workload benches take the model from the workload; fidelity runs any model (the embedded one by default).
        from_workload = name.startswith("bench") and name != "bench fidelity"
        expected = BENCH_DEFAULTS.get(field.name, field_default(field)) if from_workload else field_default(field)
        if name in ("serve", "bench serve") and field.name in SERVE_ENGINE_DEFAULTS:  # the server's own defaults
            expected = SERVE_ENGINE_DEFAULTS[field.name][0]
        assert parser.parse_args(["x"] if name == "generate" else []).__dict__[field.name] == expected


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_every_field_is_an_llm_keyword_with_its_default(field):
    param = inspect.signature(LLM).parameters[field.name]
    assert param.default == field_default(field)
    assert param.kind is (inspect.Parameter.POSITIONAL_OR_KEYWORD if field.name == "model"
                          else inspect.Parameter.KEYWORD_ONLY)


class FakeEngine:
    def __init__(self, model, config, *, dtype, device, load_format, tokenizer=None):
        self.model, self.config, self.dtype, self.device, self.load_format = model, config, dtype, device, load_format
        self.tokenizer_ref = tokenizer


def test_llm_keywords_reach_the_configs(monkeypatch):
    import tokenmill.entrypoints.llm as llm_module

    monkeypatch.setattr(llm_module, "LLMEngine", FakeEngine)
    changed = dict(max_model_len=128, max_num_seqs=3, max_num_batched_tokens=64, max_prefill_tokens_with_decodes=16,
                   max_prefill_tokens_per_step=32,
                   step_time_target_ms=25.0,
                   block_size=32, num_kv_blocks=9, gpu_memory_utilization=0.5, kv_cache_memory_gb=0.25,
                   enable_prefix_caching=False, async_scheduling=False, enforce_eager=True, cuda_graph_max_batch=8,
                   piecewise_cuda_graph_max_tokens=0, fused_small_batch_linear=False, seed=7,
                   tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=3,
                   enable_expert_parallel=True, enable_microbatching=True,
                   enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=5, quantization="fp8", kv_cache_dtype="fp8",
                   batch_invariant=False,  # True refuses LoRA, FP8 and parallelism (checked below)
                   speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                                       "prompt_lookup_min": 1, "model": "/models/draft", "load_format": "dummy",
                                       "num_draft_layers": None, "synthetic_acceptance": 0.5},
                   kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                       "kv_connector_extra_config": {"size_gib": 2}},
                   kv_offloading_size=4.0)
    assert set(changed) == {f.name for f in dataclasses.fields(EngineConfig)}, "a new field: add it here"
    engine = LLM("tiny-llama", load_format="dummy", dtype="float32", device="cpu", tokenizer="/tok", **changed).engine
    assert dataclasses.asdict(engine.config) == changed
    assert (engine.model, engine.load_format, engine.dtype, engine.device) == ("tiny-llama", "dummy", "float32", "cpu")
    assert engine.tokenizer_ref == "/tok"
    assert LLM().engine.tokenizer_ref is None
    assert LLM(batch_invariant=True).engine.config.batch_invariant is True
    assert LLM().engine.config == EngineConfig()


def test_unknown_llm_keyword_names_it(monkeypatch):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_num_seq' \(did you mean 'max_num_seqs'"):
        LLM(max_num_seq=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'frobnicate'$"):
        LLM(frobnicate=True)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_num_seqs="8"), "max_num_seqs must be an integer, got '8'"),
    (dict(max_num_seqs=True), "max_num_seqs must be an integer"),
    (dict(max_model_len=1.5), "max_model_len must be an integer or None"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching must be True or False"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(batch_invariant=True, quantization="fp8", enable_lora=True),
     "batch_invariant does not support quantization, enable_lora yet"),
    (dict(batch_invariant=True, pipeline_parallel_size=2),
     "batch_invariant does not support pipeline_parallel_size > 1"),
    (dict(batch_invariant=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "batch_invariant does not support speculative_config"),
    (dict(block_size=7), "block_size must be one of 8, 16, 32, 64, 128; got 7"),
    (dict(max_model_len=1), "max_model_len must be >= 2, got 1"),
    (dict(num_kv_blocks=0), "num_kv_blocks must be >= 1, got 0"),
    (dict(kv_cache_memory_gb=0.0), "kv_cache_memory_gb must be > 0"),
    (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras \(2\) must be at least max_loras \(4\)"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1, got 0"),
    (dict(kv_offloading_size=0.0), "kv_offloading_size must be > 0 GiB"),
    (dict(kv_offloading_size=1.0, kv_transfer_config={"kv_connector": "NixlConnector"}),
     "kv_offloading_size runs the OffloadingConnector; kv_transfer_config names NixlConnector"),
    (dict(kv_transfer_config={"kv_role": "kv_sender"}), "kv_role must be one of kv_producer, kv_consumer, kv_both"),
    (dict(kv_transfer_config={"kv_connector_extra_config": []}), "kv_connector_extra_config must be a JSON object"),
])
def test_bad_values_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("spec,message", [
    ({"method": "draft_model"}, 'method draft_model needs "model"'),
    ({"method": "draft_model", "model": ""}, 'method draft_model needs "model"'),
    ({"method": "layer_truncated"}, 'method layer_truncated needs "num_draft_layers"'),
    ({"method": "layer_truncated", "num_draft_layers": 0}, "num_draft_layers must be >= 1, got 0"),
    ({"method": "ngram", "model": "/m"}, '"model" names a draft model, which only method draft_model uses'),
    ({"method": "layer_truncated", "num_draft_layers": 2, "load_format": "dummy"},
     '"load_format" is the draft model\'s'),
    ({"method": "draft_model", "model": "/m", "num_draft_layers": 2}, '"num_draft_layers" is only for method '
                                                                      "layer_truncated"),
    ({"method": "draft_model", "model": "/m", "load_format": "pt"}, "load_format must be one of auto, hf, gguf, dummy"),
    ({"method": "eagle"}, "method must be one of ngram, draft_model, layer_truncated; got 'eagle'"),
])
def test_bad_speculative_configs_say_what_is_wrong(spec, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(speculative_config=spec)


def test_speculative_methods_and_their_lookahead():
    from tokenmill.config import SpeculativeConfig

    assert SpeculativeConfig(num_speculative_tokens=3).num_lookahead_tokens == 0  # n-gram writes no K/V
    draft = SpeculativeConfig(method="draft_model", model="/m", load_format="dummy", num_speculative_tokens=4)
    assert (draft.model, draft.load_format, draft.num_lookahead_tokens) == ("/m", "dummy", 4)
    truncated = SpeculativeConfig(method="layer_truncated", num_draft_layers=6, num_speculative_tokens=2)
    assert truncated.num_lookahead_tokens == 2
    assert "draft_model" in EngineConfig.__dataclass_fields__["speculative_config"].metadata["help"]
    assert "n-gram drafts only" not in EngineConfig.__dataclass_fields__["speculative_config"].metadata["help"]


def test_load_config_checks_its_choices():
    with pytest.raises(ConfigError, match="load_format must be one of auto, hf, gguf, dummy; got 'pt'"):
        LoadConfig(load_format="pt")
    assert LoadConfig(pathlib.Path("/models/m")).model == "/models/m"


@dataclasses.dataclass
class Draft:
    method: str = "ngram"
    num_tokens: int = 3


@dataclasses.dataclass
class GrownConfig(EngineConfig):
    """EngineConfig with fields added later: the field is all it takes to get a flag."""

    draft_temperature: Optional[float] = option(None, "a new optional float", default_help="none")
    speculative: Optional[Draft] = option(None, "a new nested option, as JSON", default_help="off")
    use_draft: bool = option(False, "a new switch")


def test_a_new_field_gets_its_flag():
    p = argparse.ArgumentParser()
    cli.add_config_args(p, GrownConfig)
    args = p.parse_args(["--draft-temperature", "0.5", "--speculative", '{"num_tokens": 5}', "--use-draft"])
    assert args.draft_temperature == 0.5 and args.speculative == Draft(num_tokens=5) and args.use_draft is True
    assert p.parse_args([]).speculative is None and p.parse_args(["--no-use-draft"]).use_draft is False
    help_text = p.format_help()
    assert "--speculative SPECULATIVE" in help_text and "--use-draft, --no-use-draft" in help_text


def test_engine_flags_round_trip():
    p = argparse.ArgumentParser()
    cli.add_engine_args(p)
    args = p.parse_args(["--max-num-seqs", "8", "--no-prefix-caching", "--kv-cache-memory-gb", "0.5",
                         "--enforce-eager", "--engine-seed", "3"])
    flags = cli.engine_flags(args)
    assert flags == ["--max-num-seqs", "8", "--kv-cache-memory-gb", "0.5", "--no-enable-prefix-caching",
                     "--enforce-eager", "--seed", "3"]
    assert cli.engine_config_from_args(p.parse_args(flags)) == cli.engine_config_from_args(args)
    assert cli.engine_flags(p.parse_args([])) == []


def test_cpu_default_chunks_long_prompts_beside_decodes():
    """On the CPU a long prompt is taken in chunks while other requests decode, unless the user set a cap."""
    from tokenmill.config import CPU_PREFILL_TOKENS_WITH_DECODES

    assert EngineConfig().resolve_prefill_cap("cpu") == CPU_PREFILL_TOKENS_WITH_DECODES
    assert EngineConfig().resolve_prefill_cap("cuda") is None
    assert EngineConfig(max_prefill_tokens_with_decodes=1024).resolve_prefill_cap("cpu") == 1024
    # a step-time target chooses the chunks itself (engine/step_budget.py); an explicit cap still holds
    assert EngineConfig(step_time_target_ms=50).resolve_prefill_cap("cpu") is None
    assert EngineConfig(step_time_target_ms=50, max_prefill_tokens_with_decodes=64).resolve_prefill_cap("cpu") == 64


def test_cpu_defaults_chunk_every_step():
    """On the CPU every step's prompt tokens are capped (a new request waits one chunk at most); CUDA
    keeps the step open."""
    from tokenmill.config import CPU_PREFILL_TOKENS_PER_STEP

    config = EngineConfig()
    assert (config.resolve_prefill_step_cap("cpu"), config.resolve_prefill_step_cap("cuda")) == (
        CPU_PREFILL_TOKENS_PER_STEP, None)
    assert EngineConfig(max_prefill_tokens_per_step=64).resolve_prefill_step_cap("cuda") == 64
