"""AsyncLLMEngine in-process, around a tiny dummy model (fast on a CPU)."""

import asyncio
import os
import threading
import time

import pytest

from tokenmill.config import EngineConfig
from tokenmill.serve.async_engine import AsyncLLMEngine, EngineDeadError, EngineObserver, EngineOverloadedError
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


async def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_waiting_bound_counts_sequences_and_stop(tiny):
    engine = make_engine(tiny, max_num_seqs=2)
    aengine = AsyncLLMEngine(engine, max_waiting=3)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        aengine.start()
        first = aengine.submit(ids_prompt([1, 2, 3]), SamplingParams(max_tokens=200, ignore_eos=True, n=2))
        await first.accepted()
        await wait_until(lambda: aengine.stats.num_running == 2)  # both samples run, none waits
        # 2 prompts x n=2 = 4 sequences: more than may ever wait (3), so never admissible: 400, not 503
        with pytest.raises(InvalidRequestError, match="4 sequences"):
            await aengine.submit(lambda e: [(None, [4]), (None, [5])], SamplingParams(n=2)).accepted()
        second = aengine.submit(ids_prompt([4, 5]), SamplingParams(max_tokens=200, ignore_eos=True, n=2))
        await second.accepted()  # 2 sequences wait now
        with pytest.raises(EngineOverloadedError, match="2 sequences waiting"):
            await aengine.submit(ids_prompt([6]), SamplingParams(n=2)).accepted()  # 2 + 2 > 3
        third = aengine.submit(ids_prompt([6]), long)  # 2 + 1 <= 3
        await third.accepted()
        with pytest.raises(EngineOverloadedError):
            await aengine.submit(ids_prompt([7]), long).accepted()
        await aengine.stop()  # aborts what runs and waits
        for stream in (first, second, third):
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError):
            await aengine.submit(ids_prompt([1]), long).accepted()

    asyncio.run(main())
    assert_clean(engine)


def test_prompts_are_prepared_off_the_engine_thread(tiny):
    """Tokenizing and validating run on a prepare worker: a slow one does not stall other streams,
    an error there refuses that submission only (no traceback), and a submission aborted while it is
    prepared is never queued."""
    engine = make_engine(tiny)
    aengine = AsyncLLMEngine(engine)
    # Runs longer than the 1 s of preparing (about 1 ms a step on an idle CPU; 2048 is the context).
    params = SamplingParams(max_tokens=2040, temperature=0, ignore_eos=True)
    threads = []

    def slow(tools):
        threads.append(threading.current_thread().name)
        time.sleep(1.0)
        return [(None, tools.tokenize([1, 2, 3]))]

    def broken(tools):
        raise TypeError("a tokenizer's own complaint")

    async def main():
        aengine.start()
        try:
            running = aengine.submit(ids_prompt([5, 6, 7]), params)
            await running.accepted()
            slow_stream = aengine.submit(slow, SamplingParams(max_tokens=2))
            slow_accepted = asyncio.create_task(slow_stream.accepted())
            gaps, last = [], time.monotonic()
            async for _, out in running:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                if slow_accepted.done():
                    break
            assert slow_accepted.done() and not running.finished  # it streamed all the while
            running.abort()
            assert (await final_outputs(slow_stream))[0].outputs[0].token_ids
            with pytest.raises(InvalidRequestError, match="could not be processed: TypeError"):
                await aengine.submit(broken, params).accepted()
            gone = aengine.submit(slow, params)
            gone.abort()
            await asyncio.sleep(1.5)
            assert aengine.stats.num_active_groups == 0 and not engine.has_unfinished_requests()
            return max(gaps[1:])
        finally:
            await aengine.stop()

    longest_gap = asyncio.run(main())
    assert threads and all(name.startswith("tokenmill-prepare") for name in threads)
    assert longest_gap < 0.5  # the 1 s of preparing never blocked the running stream's steps
    assert_clean(engine)


class RecordingObserver:
    """An EngineObserver that counts its calls."""

    def __init__(self):
        self.calls = {"first_token": 0, "inter_token": 0, "step_interval": 0, "finished": 0}

    def first_token(self, seconds: float) -> None:
        self.calls["first_token"] += 1

    def inter_token(self, seconds: float) -> None:
        self.calls["inter_token"] += 1

    def step_interval(self, kind: str, seconds: float) -> None:
        assert kind in ("decode", "mixed", "prefill")
        self.calls["step_interval"] += 1

    def finished(self, output, seconds: float) -> None:
        self.calls["finished"] += 1


def test_observer_protocol(tiny):
    observer: EngineObserver = RecordingObserver()
    aengine = AsyncLLMEngine(make_engine(tiny), observer=observer)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, n=2)

    async def main():
        aengine.start()
        try:
            await final_outputs(aengine.submit(lambda e: [(None, [1, 2]), (None, [3, 4])], params))
        finally:
            await aengine.stop()

    asyncio.run(main())
    calls = observer.calls
    assert calls["first_token"] == 2 and calls["finished"] == 2  # once per engine request
    assert calls["inter_token"] == 2 * 2 * 4  # 4 later tokens of each of 4 samples
    assert calls["step_interval"] > 0


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
