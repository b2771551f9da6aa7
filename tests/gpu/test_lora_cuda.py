"""Multi-LoRA on CUDA: three adapters and the base model in one batch, with the decode and piecewise
graphs of steps with adapters, the batch-1 fused GEMV path and the Triton LoRA kernels, against HF
transformers + PEFT on the same GPU (fp32), and a Qwen2-MoE's adapter; bf16 greedy within the
drift bf16 allows."""

import pytest
import torch

from tests.lora_adapters import make_adapter, peft_reference
from tests.test_hf_dir_models import _save_random_hf_model
from tokenmill import LoRARequest
from tokenmill.entrypoints.llm import LLM
from tokenmill.runner.cuda_graphs import GraphMode
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-cuda")
    hf = _save_random_hf_model("llama3.1", False, root / "model")
    adapters = [LoRARequest(f"a{i}", i + 1, make_adapter(hf, root / f"a{i}", rank=r, alpha=2 * r, seed=i + 1))
                for i, r in enumerate((8, 16, 4))]
    refs = [hf.cuda()] + [peft_reference(hf, a.lora_path).cuda() for a in adapters]
    return str(root / "model"), adapters, refs


def _prompts(n, vocab=512):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _hf_greedy(model, ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_mixed_adapters_equal_peft_fp32(setup, eager):
    path, adapters, refs = setup
    llm = LLM(path, dtype="float32", device="cuda", enable_lora=True, max_loras=3, max_lora_rank=16,
              enforce_eager=eager, num_kv_blocks=512, max_num_seqs=16, piecewise_cuda_graph_max_tokens=256)
    prompts = _prompts(8)
    choice = [None, adapters[0], adapters[1], adapters[2], adapters[0], None, adapters[1], adapters[2]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=choice)
    for out, ids, lora in zip(outs, prompts, choice):
        ref = refs[0 if lora is None else lora.lora_int_id]
        assert out.outputs[0].token_ids == _hf_greedy(ref, ids), lora
    # batch 1 (the fused GEMV path on CUDA graphs) with an adapter
    one = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=adapters[1])[0]
    assert one.outputs[0].token_ids == _hf_greedy(refs[2], prompts[0])
    if not eager:
        lora_keys = {(k.mode, k.query_len) for k in llm.engine.runner.graphs.graphs if k.lora}
        assert lora_keys == {(GraphMode.FULL, 1), (GraphMode.PIECEWISE, 0)}
        assert llm.engine.runner.graphs.keys(GraphMode.FULL, query_len=1)


def test_bf16_graphs_equal_bf16_eager(setup):
    """The graphs of steps with adapters compute what the eager path does (bf16, same kernels)."""
    path, adapters, _ = setup
    prompts = _prompts(6)
    choice = [adapters[0], None, adapters[1], adapters[2], adapters[0], adapters[1]]
    runs = []
    for eager in (False, True):
        llm = LLM(path, dtype="bfloat16", device="cuda", enable_lora=True, max_loras=3, max_lora_rank=16,
                  enforce_eager=eager, num_kv_blocks=512, max_num_seqs=16, piecewise_cuda_graph_max_tokens=256)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False,
                                                                   lora_request=choice)])
    same = sum(a == b for a, b in zip(*runs))
    assert same >= len(prompts) - 1, runs  # bf16 rounding may part one path at a near tie


def test_moe_adapters_equal_peft_fp32(tmp_path):
    """A Qwen2-MoE with an adapter on its attention, dense MLPs and shared experts (the experts
    take none), with graphs: PEFT's greedy tokens on the same GPU, beside a base request."""
    from tests.models.moe_helpers import EOS, save_random_moe_model

    hf = save_random_moe_model("qwen2_moe", tmp_path / "model")
    lora = LoRARequest("moe", 1, make_adapter(hf, tmp_path / "lora", rank=8, alpha=16, seed=5))
    refs = [hf.cuda(), peft_reference(hf, lora.lora_path).cuda()]
    llm = LLM(str(tmp_path / "model"), dtype="float32", device="cuda", enable_lora=True, max_loras=1,
              max_lora_rank=8, num_kv_blocks=512, max_num_seqs=8, piecewise_cuda_graph_max_tokens=256)
    prompts = _prompts(4, vocab=EOS)
    choice = [lora, None, lora, lora]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=choice)
    for out, ids, req in zip(outs, prompts, choice):
        assert out.outputs[0].token_ids == _hf_greedy(refs[0 if req is None else 1], ids), req
