"""The LLM's lifecycle on the CPU: shutdown(), `with LLM(...)`, and freeing on `del` without a
garbage collection (no reference cycles hold the weights or the KV cache)."""

import gc
import weakref

import psutil
import pytest

from tokenmill import LLM, SamplingParams

SMALL = dict(num_kv_blocks=32, max_model_len=128, max_num_seqs=2, dtype="float32")
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _refs(llm: LLM) -> list[weakref.ref]:
    engine = llm.llm_engine
    return [weakref.ref(next(engine.loaded.model.parameters())), weakref.ref(engine.loaded.model),
            weakref.ref(engine.runner.kv_caches[0][0])]


def test_shutdown_frees_the_engine_and_a_second_one_works_and_frees_on_del():
    with LLM(**SMALL) as llm:
        assert llm.get_tokenizer() is llm.llm_engine.tokenizer is not None
        first = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].text
        refs = _refs(llm)
    assert all(r() is None for r in refs)  # released at the end of the block, the LLM still referenced
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["again"], GREEDY, use_tqdm=False)
    llm.shutdown()  # idempotent

    rss = psutil.Process().memory_info().rss
    second = LLM(**SMALL)
    assert second.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].text == first
    weights = sum(p.numel() * p.element_size() for p in second.llm_engine.loaded.model.parameters())
    refs = _refs(second)
    built = psutil.Process().memory_info().rss
    gc.collect()
    gc.disable()  # what frees it must be reference counting alone
    try:
        del second
        assert all(r() is None for r in refs)
        freed = built - psutil.Process().memory_info().rss
    finally:
        gc.enable()
    assert built - rss > weights // 2 and freed > weights // 2, (rss, built, freed, weights)


def test_shutdown_stops_tensor_parallel_workers(tmp_path):
    from tests.test_hf_dir_models import _save_random_hf_model

    _save_random_hf_model("llama3.1", False, tmp_path)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, dtype="float32", device="cpu", num_kv_blocks=32)
    executor = llm.llm_engine.executor
    workers = list(executor._procs)
    assert workers and all(p.is_alive() for p in workers)
    ref = weakref.ref(executor)
    del executor
    llm.shutdown()
    assert not any(p.is_alive() for p in workers)
    assert ref() is None  # nothing (atexit's registration included) keeps rank 0's model alive
