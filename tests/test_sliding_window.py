"""Sliding-window attention: config parsing as HF reads it, and tiny random Mistral / Qwen2 models
with an 8-token window whose logits and greedy output equal HF transformers' over prompts far
longer than the window."""

import json

import pytest
import torch

from tests.engine.conftest import make_llm
from tests.helpers import full_logits
from tests.kernels.common import CUDA
from tests.test_hf_dir_models import _save_random_hf_model
from tokenmill.errors import ModelLoadError
from tokenmill.loader import load_model
from tokenmill.models.config import arch_config_from_hf
from tokenmill.sampling_params import SamplingParams

WINDOW = 8
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def _window_of(arch: str, **fields):
    return arch_config_from_hf({"architectures": [arch], **BASE, **fields}).sliding_window


def test_config_windows_as_hf_reads_them():
    assert _window_of("MistralForCausalLM", sliding_window=4096) == 4096
    assert _window_of("MistralForCausalLM", sliding_window=None) is None
    assert _window_of("LlamaForCausalLM", sliding_window=4096) is None  # HF's Llama has no window
    # Qwen2 / Qwen3: only with use_sliding_window, on the layers from max_window_layers on.
    assert _window_of("Qwen2ForCausalLM", sliding_window=131072, max_window_layers=0) is None
    assert _window_of("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=64, max_window_layers=0) == 64
    assert _window_of("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=64, max_window_layers=2) is None
    assert _window_of("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=64,
                      layer_types=["sliding_attention"] * 2) == 64
    assert _window_of("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=64,
                      layer_types=["full_attention"] * 2) is None


def test_config_refuses_windows_on_some_layers():
    with pytest.raises(ModelLoadError, match="1 of 2 layers"):
        _window_of("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=64, max_window_layers=1)
    with pytest.raises(ModelLoadError, match="1 of 2 layers"):
        _window_of("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=64,
                   layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ModelLoadError, match="sliding_window must be >= 1"):
        _window_of("MistralForCausalLM", sliding_window=0)


# How each kind's config.json turns the 8-token window on for every layer.
WINDOW_FIELDS = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=0, layer_types=None),
}


def _windowed_pair(kind: str, path, device: str = "cpu"):
    """HF's and tokenmill's load of one random model directory whose config sets the window."""
    from transformers import AutoModelForCausalLM

    _save_random_hf_model(kind, False, path)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(WINDOW_FIELDS[kind])
    cfg = {k: v for k, v in cfg.items() if v is not None}
    cfg_path.write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.sliding_window == WINDOW
    ours = load_model(str(path), dtype="float32", device=device)
    assert ours.arch.sliding_window == WINDOW
    return hf, ours


@pytest.mark.parametrize("kind", list(WINDOW_FIELDS))
def test_logits_match_hf_with_window(kind, tmp_path):
    hf, ours = _windowed_pair(kind, tmp_path)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 40, 150)]
    for seq, logits in zip(seqs, full_logits(ours.model, seqs)):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        err = ((logits - ref).norm() / ref.norm()).item()
        assert err < 1e-4, f"{kind}, {len(seq)} tokens: relative error {err}"
    # The window matters at these lengths: full attention gives other logits.
    for layer in ours.model.model.layers:
        layer.self_attn.attn.sliding_window = None
    full = full_logits(ours.model, seqs[2:])[0]
    assert ((full - ref).norm() / ref.norm()).item() > 1e-2


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=16), dict(block_size=32, num_kv_blocks=64)],
                         ids=["one-step-prefill", "chunked-prefill", "block-size-32"])
def test_greedy_matches_hf_with_window(engine, device, tmp_path):
    """Prefill, chunked prefill and decode through the engine (on CUDA: the Triton kernel, CUDA
    graphs and the batch-1 fused decode path) against HF's greedy generation on the CPU."""
    hf, ours = _windowed_pair("mistral", tmp_path, device)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (45, 3, 70)]
    new = 24
    llm = make_llm(ours, **engine)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, min_tokens=new), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref


def test_the_window_reaches_the_runner_and_its_warm_up(tmp_path, monkeypatch):
    """The model's attention spec carries the window, and warm-up launches the windowed attention
    variants (a variant first met under load would compile on the step path)."""
    from tokenmill.runner import warmup

    _, ours = _windowed_pair("mistral", tmp_path)
    llm = make_llm(ours)
    assert llm.engine.runner.attn_spec.sliding_window == WINDOW
    seen = []
    monkeypatch.setattr(warmup, "paged_attention", lambda *a, **kw: seen.append(kw["sliding_window"]))
    assert warmup.warm_up_attention(llm.engine.runner) == len(seen) > 0
    assert set(seen) == {WINDOW}
