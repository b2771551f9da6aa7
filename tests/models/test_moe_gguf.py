"""Mixture-of-experts models from GGUF files in llama.cpp's layout (each layer's experts stacked in
`blk.N.ffn_{gate,up,down}_exps`): the twin of each tiny random HF model (tests/models/gguf_twin.py)
loads into the same config and exactly the same weights as the safetensors directory, with the
same tokenizer (and so does an early Mixtral file, one tensor per expert); greedy text through the
engine is HF's; the converted directory loads in transformers; Q8_0 experts dequantize as the
`gguf` package does; an MoE architecture or routing tokenmill lacks is refused by name."""

import dataclasses
import os
import weakref
from typing import NamedTuple, Optional

import gguf
import pytest
import torch
from gguf.constants import ExpertGatingFuncType, GGMLQuantizationType as Q

from tests.engine.conftest import make_llm
from tests.helpers import full_logits
from tests.models.gguf_twin import GGUF_ARCH, finish, quantize_round_trip, write_gguf_twin
from tests.models.moe_helpers import EOS, FAMILIES, VOCAB, save_random_moe_model
from tokenmill.errors import ModelLoadError, UnsupportedArchitectureError
from tokenmill.loader import load_model
from tokenmill.loader.gguf_reader import GGUFFile
from tokenmill.loader.load import LoadedModel
from tokenmill.sampling_params import SamplingParams

Q8_FAMILIES = ["qwen3_moe", "mixtral"]
# Q8_0 experts (steps of 1/127 of each 32-value block's largest magnitude) move these models' logits
# by about 3e-4 (relative); the bound leaves room for other seeds.
Q8_LOGITS_REL_ERR = 2e-3


class Twins(NamedTuple):
    hf: torch.nn.Module  # HF's model
    ours: LoadedModel  # tokenmill's load of the HF directory
    twin: LoadedModel  # ... of its F32 GGUF twin
    q8: Optional[LoadedModel]  # ... of its twin with Q8_0 experts (Q8_FAMILIES)
    gguf_path: str  # the F32 twin


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> dict[str, Twins]:
    """Each family's models; conversions go to a cache of this module's own, so each run converts afresh."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENMILL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        for family in FAMILIES:
            path = tmp_path_factory.mktemp(family)
            hf = save_random_moe_model(family, path)
            f32 = write_gguf_twin(path, path / "f32.gguf")
            q8 = write_gguf_twin(path, path / "q8.gguf", expert_type=Q.Q8_0) if family in Q8_FAMILIES else None
            out[family] = Twins(hf, load_model(str(path), dtype="float32", device="cpu"),
                                load_model(f32, dtype="float32", device="cpu"),
                                q8 and load_model(q8, dtype="float32", device="cpu"), f32)
    return out


def _sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 33)]


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_twin_equals_safetensors(family, twins):
    ours, twin = twins[family].ours, twins[family].twin
    assert twin.source.kind == "gguf" and twin.arch.architecture == ours.arch.architecture
    # The same config, except how the dense layers are said (Qwen2-MoE's decoder_sparse_step 2 is
    # mlp_only_layers [0, 2] in GGUF, which marks sparse layers by their router tensors).
    layers = range(ours.arch.num_layers)
    assert [twin.arch.moe.is_sparse(i) for i in layers] == [ours.arch.moe.is_sparse(i) for i in layers]
    how_sparse = dict(sparse_step=1, dense_layers=())
    assert dataclasses.replace(twin.arch, moe=dataclasses.replace(twin.arch.moe, **how_sparse)) == \
        dataclasses.replace(ours.arch, moe=dataclasses.replace(ours.arch.moe, **how_sparse))
    want = dict(ours.model.named_parameters())
    got = dict(twin.model.named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert torch.equal(p, want[name]), f"{family} ({GGUF_ARCH[family]}): {name}"
    for a, b in zip(full_logits(twin.model, _sequences()), full_logits(ours.model, _sequences())):
        assert torch.equal(a, b)
    text = "hello moe 12 experts, zz top!"
    assert twin.tokenizer(text)["input_ids"] == ours.tokenizer(text)["input_ids"]
    assert twin.eos_token_ids == ours.eos_token_ids == [EOS]


def test_twin_greedy_text_matches_hf(twins):
    """One engine, on the Mixtral twin (arch llama: q/k rows restored, experts under
    block_sparse_moe): prompts as text through the GGUF tokenizer, greedy tokens as HF's generate."""
    hf, twin = twins["mixtral"].hf, twins["mixtral"].twin
    prompts = ["hello 123 world", "mixture of experts " * 3]
    llm = make_llm(twin, num_kv_blocks=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = twin.tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=EOS)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt


def test_split_expert_mixtral_file(twins, tmp_path, monkeypatch):
    """llama.cpp's first Mixtral files keep each expert apart (`blk.N.ffn_gate.E.weight`): the same weights."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    ours = twins["mixtral"].ours
    path = write_gguf_twin(os.path.dirname(twins["mixtral"].gguf_path), tmp_path / "split.gguf", split_experts=True)
    f = GGUFFile(path)
    assert "blk.1.ffn_down.3.weight" in f.tensors and not any("_exps" in name for name in f.tensors)
    f.close()
    split = load_model(path, dtype="float32", device="cpu")
    want = dict(ours.model.named_parameters())
    for name, p in split.model.named_parameters():
        assert torch.equal(p, want[name]), name


def test_converted_directory_loads_in_transformers(twins, tmp_path, monkeypatch):
    """The HF directory a Qwen2-MoE GGUF file becomes (per-expert names, the shared expert's gate
    as [1, H]) is one transformers loads, computing what the original model computes."""
    from transformers import AutoModelForCausalLM

    from tokenmill.loader.gguf_loader import convert_gguf_to_hf_dir

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    hf, path = twins["qwen2_moe"].hf, twins["qwen2_moe"].gguf_path
    model = AutoModelForCausalLM.from_pretrained(convert_gguf_to_hf_dir(path), dtype=torch.float32).eval()
    ids = torch.tensor(_sequences()[:1])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, hf(ids).logits)


@pytest.mark.parametrize("family", Q8_FAMILIES)
def test_q8_0_experts(family, twins):
    """Q8_0 experts are the gguf package's own round trip of the HF weights, exactly (dequantized
    expert slab by expert slab); everything else stays exact; the logits move within Q8_LOGITS_REL_ERR."""
    ours, q8 = twins[family].ours, twins[family].q8
    want = dict(ours.model.named_parameters())
    for name, p in q8.model.named_parameters():
        if ".experts." in name:
            ref = torch.stack([quantize_round_trip(w, Q.Q8_0) for w in want[name]])
            assert torch.equal(p, ref), name
            assert not torch.equal(p, want[name])
        else:
            assert torch.equal(p, want[name]), name
    for a, b in zip(full_logits(q8.model, _sequences()), full_logits(ours.model, _sequences())):
        err = ((a - b).norm() / b.norm()).item()
        assert 0 < err < Q8_LOGITS_REL_ERR, f"{family}: relative error {err}"


def test_converter_writes_one_tensor_at_a_time(tmp_path):
    """The converter's safetensors writer reads each tensor only when it writes it, the previous one
    already dropped (expert slab by slab for the experts); the file is valid safetensors."""
    from safetensors import safe_open

    from tokenmill.loader.safetensors_weights import save_safetensors_streaming

    tensors = {f"t{i}": torch.randn(3, i + 1) for i in range(4)}
    alive, seen_alive = weakref.WeakSet(), []

    def reader(name):
        def read():
            seen_alive.append(len(alive))
            tensor = tensors[name].clone()
            alive.add(tensor)
            return tensor
        return read

    path = str(tmp_path / "w.safetensors")
    save_safetensors_streaming(path, [(n, tuple(t.shape), reader(n)) for n, t in tensors.items()], {"source": "x"})
    assert seen_alive == [0, 0, 0, 0]
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"source": "x"} and list(f.keys()) == list(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor)
    with pytest.raises(ModelLoadError, match="t0: read torch.float32 \\(3, 1\\), planned float32 \\(3, 2\\)"):
        save_safetensors_streaming(path, [("t0", (3, 2), reader("t0"))])


def test_unsupported_moe_arch_names_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "deepseek.gguf")
    writer = gguf.GGUFWriter(path, "deepseek2")
    writer.add_block_count(1)
    writer.add_expert_count(4)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", torch.zeros(4, 8, 32).numpy())
    finish(writer)
    with pytest.raises(UnsupportedArchitectureError, match="'deepseek2' with 4 experts.*qwen3moe"):
        load_model(path, dtype="float32", device="cpu")


def test_sigmoid_routing_refused(tmp_path):
    """What the layout can say but tokenmill's MoE cannot run is refused, naming it: sigmoid routing."""
    from tokenmill.loader.gguf_loader import hf_config_from_gguf

    path = str(tmp_path / "sigmoid.gguf")
    writer = gguf.GGUFWriter(path, "qwen3moe")
    for key, value in dict(embedding_length=64, feed_forward_length=96, block_count=1, expert_count=4,
                           expert_used_count=2, expert_gating_func=ExpertGatingFuncType.SIGMOID).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_head_count(4)
    finish(writer)
    f = GGUFFile(path)
    try:
        with pytest.raises(ModelLoadError, match="expert_gating_func 2"):
            hf_config_from_gguf(f)
    finally:
        f.close()
