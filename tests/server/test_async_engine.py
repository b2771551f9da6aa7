"""AsyncLLMEngine in-process, around a tiny dummy model (fast on a CPU)."""

import asyncio
import os
import threading
import time

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    from tokenmill.loader import load_model

    return load_model("tiny-llama", load_format="dummy", device="cpu", dtype="float32")


def make_engine(tiny, **overrides) -> LLMEngine:
    config = dict(num_kv_blocks=128, max_num_seqs=16, max_num_batched_tokens=512)
    return LLMEngine(config=EngineConfig(**{**config, **overrides}), loaded=tiny)


def ids_prompt(ids):
    return lambda engine: [(None, engine.tokenize(ids))]


async def final_outputs(stream):
    finals = {}
    async for index, out in stream:
        if out.finished:
            finals[index] = out
    return finals


def assert_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.runner.states.row_of
    assert not engine.outputs.states


def test_concurrent_requests_match_the_sync_engine(tiny):
    prompts = [[1 + i, 2 + i, 3 + 2 * i, 4] for i in range(12)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM.from_engine(make_engine(tiny)).generate(prompts, params,
                                                                                             use_tqdm=False)]
    engine = make_engine(tiny)
    aengine = AsyncLLMEngine(engine)

    async def main():
        aengine.start()
        try:
            streams = [aengine.submit(ids_prompt(p), params) for p in prompts]
            results = await asyncio.gather(*(final_outputs(s) for s in streams))
        finally:
            await aengine.stop()
        return results

    results = asyncio.run(main())
    assert [r[0].outputs[0].token_ids for r in results] == expected
    assert_clean(engine)


def test_invalid_request_is_reported_to_it_only(tiny):
    engine = make_engine(tiny)
    aengine = AsyncLLMEngine(engine)
    params = SamplingParams(max_tokens=5, temperature=0)

    async def main():
        aengine.start()
        try:
            good = aengine.submit(ids_prompt([1, 2, 3]), params)
            bad = aengine.submit(ids_prompt([1, 10**6]), params)  # outside the vocabulary
            too_long = aengine.submit(ids_prompt([1] * 3000), params)  # past the context
            group = aengine.submit(lambda e: [(None, [1, 2]), (None, [5, -3])], params)  # one bad prompt
            later = aengine.submit(ids_prompt([4, 5, 6]), params)
            for stream in (bad, too_long, group):
                with pytest.raises(InvalidRequestError):
                    await stream.accepted()
            return await final_outputs(good), await final_outputs(later)
        finally:
            await aengine.stop()

    good, later = asyncio.run(main())
    assert len(good[0].outputs[0].token_ids) == 5 and len(later[0].outputs[0].token_ids) == 5
    assert_clean(engine)


def test_abort_frees_blocks_and_the_idle_thread_sleeps(tiny):
    engine = make_engine(tiny)
    aengine = AsyncLLMEngine(engine)
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True, n=2)

    async def main():
        aengine.start()
        try:
            stream = aengine.submit(lambda e: [(None, [1, 2, 3]), (None, [7, 8, 9, 10])], params)
            seen = 0
            async for _, out in stream:
                seen += 1
                if seen == 6:
                    break
            assert aengine.stats.kv_cache_usage > 0
            stream.abort()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                s = aengine.stats
                if s.num_active_groups == 0 and s.kv_cache_usage == 0 and s.num_running == 0:
                    break
                await asyncio.sleep(0.05)
            assert aengine.stats.kv_cache_usage == 0 and aengine.stats.num_free_blocks == aengine.stats.num_blocks
            # Idle: the engine thread blocks on its command queue (no steps, next to no CPU time).
            await asyncio.sleep(0.2)
            steps, cpu = aengine.stats.num_steps, _thread_cpu_seconds(aengine._thread)
            await asyncio.sleep(1.0)
            assert aengine.stats.num_steps == steps
            if cpu is not None:
                assert _thread_cpu_seconds(aengine._thread) - cpu < 0.05
            assert not engine.runner.states.row_of  # the runner rows were released too
        finally:
            await aengine.stop()

    asyncio.run(main())
    assert_clean(engine)


def _thread_cpu_seconds(thread: threading.Thread):
    path = f"/proc/self/task/{thread.native_id}/stat"
    if not os.path.exists(path):
        return None
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_call_runs_on_the_engine_thread(tiny):
    engine = make_engine(tiny)
    aengine = AsyncLLMEngine(engine)

    async def main():
        aengine.start()
        try:
            name = await aengine.call(lambda e: threading.current_thread().name)
            with pytest.raises(ZeroDivisionError):
                await aengine.call(lambda e: 1 / 0)
            return name
        finally:
            await aengine.stop()

    assert asyncio.run(main()) == "tokenmill-engine"


def test_waiting_bound_and_stop(tiny):
    engine = make_engine(tiny, max_num_seqs=2)
    aengine = AsyncLLMEngine(engine, max_waiting=1)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        aengine.start()
        first = aengine.submit(ids_prompt([1, 2, 3]), SamplingParams(max_tokens=200, ignore_eos=True, n=4))
        await first.accepted()  # 2 run, 2 wait
        second = aengine.submit(ids_prompt([4, 5]), params)
        with pytest.raises(EngineOverloadedError):
            await second.accepted()
        await aengine.stop()  # aborts what runs
        with pytest.raises(EngineDeadError):
            async for _ in first:
                pass
        with pytest.raises(EngineDeadError):
            await aengine.submit(ids_prompt([1]), params).accepted()

    asyncio.run(main())
    assert_clean(engine)


def test_an_engine_failure_fails_every_request_and_later_ones(tiny):
    engine = make_engine(tiny)
    aengine = AsyncLLMEngine(engine)

    def broken_step():
        raise RuntimeError("boom")

    async def main():
        aengine.start()
        try:
            await aengine.call(lambda e: setattr(e, "step", broken_step))
            stream = aengine.submit(ids_prompt([1, 2, 3]), SamplingParams(max_tokens=4))
            with pytest.raises(EngineDeadError, match="boom"):
                async for _ in stream:
                    pass
            assert not aengine.is_running and isinstance(aengine.error, RuntimeError)
            with pytest.raises(EngineDeadError):
                await aengine.submit(ids_prompt([1]), SamplingParams()).accepted()
        finally:
            await aengine.stop()

    asyncio.run(main())
