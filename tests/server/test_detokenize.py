"""The server path detokenizes outside the engine thread and gives what LLM.generate gives: text,
finish and stop reasons, token ids, logprob pieces (AsyncLLMEngine in-process, embedded model)."""

import asyncio
import threading
from dataclasses import replace

import pytest

from tokenmill.config import EngineConfig
from tokenmill.serve.async_engine import AsyncLLMEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import CompletionOutput
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time"]


def make_engine(smollm) -> LLMEngine:
    return LLMEngine(config=EngineConfig(num_kv_blocks=128, max_num_seqs=16), loaded=smollm)


def text_prompts(prompts):
    return lambda tools: [(p, tools.tokenize(p)) for p in prompts]


def served(smollm, prompts, params) -> tuple[dict[int, list], LLMEngine]:
    """Every output the stream gave, by prompt index; and the engine (to check it is clean)."""
    engine = make_engine(smollm)
    aengine = AsyncLLMEngine(engine)

    async def main():
        aengine.start()
        seen: dict[int, list] = {}
        try:
            async for index, out in aengine.submit(text_prompts(prompts), params):
                seen.setdefault(index, []).append(out)
            await asyncio.sleep(0.3)  # the aborts of stopped samples reach the engine
            return seen
        finally:
            await aengine.stop()

    return asyncio.run(main()), engine


def assert_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests() and not engine.outputs.states
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def assert_same(local: CompletionOutput, remote: CompletionOutput) -> None:
    assert (remote.text, remote.token_ids, remote.finish_reason, remote.stop_reason) == \
        (local.text, local.token_ids, local.finish_reason, local.stop_reason)
    if local.logprobs is None:
        assert remote.logprobs is None
        return
    assert [{t: lp.decoded_token for t, lp in e.items()} for e in remote.logprobs] == \
        [{t: lp.decoded_token for t, lp in e.items()} for e in local.logprobs]
    assert [e[t].logprob for e, t in zip(remote.logprobs, remote.token_ids)] == \
        pytest.approx([e[t].logprob for e, t in zip(local.logprobs, local.token_ids)], abs=1e-4)


CASES = {
    "stop-and-logprobs": SamplingParams(max_tokens=12, temperature=0, stop=[" of", " a"], logprobs=2),
    "min-tokens": SamplingParams(max_tokens=12, temperature=0, stop=[" of", ","], min_tokens=3),
    "include-stop": SamplingParams(max_tokens=12, temperature=0, stop=["city", "answer"],
                                   include_stop_str_in_output=True),
    "n2-seeded": SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=2, stop=[" the", "."]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_served_outputs_equal_llm_generate(smollm, case):
    params = CASES[case]
    local = LLM.from_engine(make_engine(smollm)).generate(PROMPTS, params, use_tqdm=False)
    seen, engine = served(smollm, PROMPTS, params)
    for i, out in enumerate(local):
        final = seen[i][-1]
        assert final.finished and sum(o.finished for o in seen[i]) == 1  # one final output per prompt
        assert len(final.outputs) == params.n
        for a, b in zip(out.outputs, final.outputs):
            assert_same(a, b)
    assert any(c.stop_reason in params.stop_strings for out in local for c in out.outputs)
    assert_clean(engine)


def test_detokenization_runs_off_the_engine_thread(smollm, monkeypatch):
    """Every decode of a served request with a stop string and logprobs runs on the detokenizing
    thread; what streams shows never holds a piece of the stop string."""
    names = set()
    decode = smollm.tokenizer.decode

    def recording(*args, **kwargs):
        names.add(threading.current_thread().name)
        return decode(*args, **kwargs)

    monkeypatch.setattr(smollm.tokenizer, "decode", recording)
    params = SamplingParams(max_tokens=12, temperature=0, stop=[" answer"], logprobs=2)
    seen, engine = served(smollm, PROMPTS[:1], params)
    assert names == {"tokenmill-detokenize"}
    final = seen[0][-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == " answer"
    assert all(e[t].decoded_token is not None for e, t in zip(final.logprobs, final.token_ids))
    for out in seen[0][:-1]:
        c = out.outputs[0]
        assert final.text.startswith(c.text) and " answer" not in c.text and not c.finished()
    assert_clean(engine)


def test_a_stop_string_ends_one_sample_not_its_sibling(smollm):
    free = SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=2, ignore_eos=True)
    unstopped = LLM.from_engine(make_engine(smollm)).generate(PROMPTS[1:], free, use_tqdm=False)[0].outputs
    first, second = unstopped[0].text, unstopped[1].text
    words = [w for w in first.split() if w not in second]
    assert words, (first, second)
    stop = words[0]
    seen, engine = served(smollm, PROMPTS[1:], replace(free, stop=[stop]))
    cut, sibling = seen[0][-1].outputs
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == first[:first.index(stop)]
    assert len(cut.token_ids) < 10
    assert sibling.finish_reason == "length" and sibling.text == second and len(sibling.token_ids) == 10
    assert_clean(engine)

