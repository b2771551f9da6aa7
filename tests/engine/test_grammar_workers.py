"""Grammar matchers in worker processes (structured_outputs_workers): outputs are token for token
those of the engine-thread matchers, with and without speculation (drafts walked in the workers),
n > 1 and aborts; a completed grammar finishes its request; the workers stop on close."""

import json
import re

import pytest

from tests.engine.conftest import assert_no_leaks, make_llm
from tests.engine.test_structured_output import COPY, NGRAM, SCHEMAS, _chat
from tokenmill.sampling_params import SamplingParams

pytest.importorskip("xgrammar")


def _requests(llm):
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS[:6]):
        prompts.append(_chat(llm, f"Answer in JSON following this schema: {json.dumps(schema)}"))
        params.append(SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=48, n=1 + (i == 3),
                                     structured_outputs={"json": schema}))
    prompts.append(_chat(llm, f"Repeat this text exactly, nothing else: {COPY}"))
    params.append(SamplingParams(temperature=0, max_tokens=40,
                                 structured_outputs={"regex": r"(the cat sat on the (rug|dog)\. ){3}"}))
    prompts.append(_chat(llm, "Say something."))  # a plain request beside them
    params.append(SamplingParams(temperature=0, max_tokens=12))
    return prompts, params


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_workers_match_the_engine_thread(smollm, speculative):
    extra = {"speculative_config": NGRAM} if speculative else {}
    inline = make_llm(smollm, **extra)
    pooled = make_llm(smollm, structured_outputs_workers=2, **extra)
    try:
        assert pooled.engine.structured.uses_workers
        prompts, params = _requests(inline)
        want = inline.generate(prompts, params, use_tqdm=False)
        got = pooled.generate(prompts, params, use_tqdm=False)
        for w, g, p in zip(want, got, params):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
            if p.structured_outputs is not None and p.structured_outputs.json is not None:
                for c in g.outputs:
                    json.loads(c.text)
        assert re.fullmatch(r"(the cat sat on the (rug|dog)\. ){3}", got[6].outputs[0].text)
        if speculative:
            assert pooled.engine.spec_stats.accepted > 0
        # an abort mid-run leaves nothing behind in the engine or the workers
        engine = pooled.engine
        rid = engine.add_request(prompts[0], params[0])
        engine.step()
        engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        assert_no_leaks(pooled)
        assert not engine.structured.live
        procs = list(engine.structured.pool._procs)
    finally:
        pooled.engine.close()
    assert procs and not any(p.is_alive() for p in procs)
