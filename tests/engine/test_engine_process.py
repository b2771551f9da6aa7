"""The engine in a process of its own (EngineCoreClient / core_process), driven directly: what it
returns equals the in-process engine and HF transformers; the messages between the two processes
round-trip; an invalid request never reaches the engine process; it stops cleanly."""

import time

import pytest

from tests.engine.conftest import NEW_TOKENS, make_llm
from tokenmill.config import EngineConfig
from tokenmill.serve.core_client import EngineCoreClient
from tokenmill.serve.core_wire import pack, params_from_wire, params_to_wire, unpack
from tokenmill.serve.core_process import EngineLaunch
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_outputs import StructuredOutputsParams

CONFIG = dict(num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=2048)
# fp32 values computed in two processes: MKL's kernels (without MKL_CBWR) may round differently from
# one process to the next (up to 3.2e-3 seen on a logprob, docs/PERFORMANCE.md); tokens and ranks stay exact.
ACROSS_PROCESSES = 1e-2


@pytest.fixture(scope="module")
def client():
    c = EngineCoreClient.launch(EngineLaunch(None, EngineConfig(**CONFIG), dtype="float32", device="cpu"))
    yield c
    c.close()


def run_all(client, requests: dict) -> dict:
    """Add {request_id: (prompt_ids, params)}; step until all finished; the final outputs by id."""
    for rid, (ids, params) in requests.items():
        client.validate(ids, params)
        client.add_request(None, params, rid, ids)
    final = {}
    deadline = time.monotonic() + 300
    while client.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in client.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_greedy_equals_hf(client, chat_prompt_ids, hf_greedy):
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)  # EOS masked, as HF
    final = run_all(client, {f"g{i}": (ids, params) for i, ids in enumerate(chat_prompt_ids[:4])})
    for i, ref in enumerate(hf_greedy[:4]):
        assert final[f"g{i}"].outputs[0].token_ids == ref


def test_sampling_logprobs_and_prompt_logprobs_equal_the_in_process_engine(client, smollm, chat_prompt_ids):
    params = SamplingParams(n=2, max_tokens=12, temperature=0.8, seed=7, logprobs=2, prompt_logprobs=1,
                            ignore_eos=True)
    ids = chat_prompt_ids[0]
    remote = run_all(client, {"s": (ids, params)})["s"]
    llm = make_llm(smollm, **{k: v for k, v in CONFIG.items()})
    local = llm.generate([ids], params, use_tqdm=False)[0]
    assert [c.token_ids for c in remote.outputs] == [c.token_ids for c in local.outputs]
    for r, l in zip(remote.outputs, local.outputs):
        assert r.cumulative_logprob == pytest.approx(l.cumulative_logprob, abs=ACROSS_PROCESSES)
        assert len(r.logprobs) == len(l.logprobs) == 12
        for rd, ld in zip(r.logprobs, l.logprobs):
            assert rd.keys() == ld.keys()
            assert all(rd[t].logprob == pytest.approx(ld[t].logprob, abs=ACROSS_PROCESSES)
                       and rd[t].rank == ld[t].rank for t in rd)
    assert len(remote.prompt_logprobs) == len(ids) and remote.prompt_logprobs[0] is None
    for rd, ld in zip(remote.prompt_logprobs[1:], local.prompt_logprobs[1:]):
        assert rd.keys() == ld.keys()
        assert all(rd[t].logprob == pytest.approx(ld[t].logprob, abs=ACROSS_PROCESSES) for t in rd)


def test_a_final_output_taken_between_steps_is_still_unfinished_work(client, chat_prompt_ids):
    """check_health() (and _call()) take the step messages that came meanwhile; when one finishes the
    last request, its output waits for step(), so has_unfinished_requests() must still say so."""
    before = client.snapshot().generation_tokens
    client.add_request(None, SamplingParams(max_tokens=1, temperature=0.0), "h", chat_prompt_ids[0])
    deadline = time.monotonic() + 120
    while client.snapshot().generation_tokens == before:  # only check_health() reads the messages
        assert time.monotonic() < deadline
        time.sleep(0.02)
        client.check_health()
    assert client.has_unfinished_requests()
    assert [out.request_id for out in client.step() if out.finished] == ["h"]
    assert not client.has_unfinished_requests()


def test_abort_a_sample_then_the_rest(client, chat_prompt_ids):
    params = SamplingParams(n=2, max_tokens=2000, temperature=1.0, seed=1, ignore_eos=True)
    client.add_request(None, params, "a", chat_prompt_ids[1])
    seen = 0
    while seen < 3:
        seen += sum(1 for out in client.step() if out.request_id == "a")
    out = client.abort_request("a", sample=0)
    assert out.outputs[0].finish_reason == "abort" and out.outputs[1].finish_reason is None and not out.finished
    frozen = list(out.outputs[0].token_ids)
    for _ in range(3):
        for o in client.step():
            assert o.outputs[0].token_ids == frozen  # nothing more for the aborted sample
    out = client.abort_request("a")
    assert out.finished and not client.has_unfinished_requests()
    assert client.abort_request("a") is None
    # The engine process freed everything: its counters say so once it has stepped.
    deadline = time.monotonic() + 30
    while client.snapshot().num_free_blocks != client.snapshot().num_blocks:
        assert time.monotonic() < deadline
        client.step()
        time.sleep(0.01)
    assert client.snapshot().num_running == 0 and client.num_waiting_sequences() == 0


def test_waiting_sequences_count_at_once(client, chat_prompt_ids):
    """Sequences just sent count as waiting before the engine has said so (the overload bound)."""
    params = SamplingParams(n=3, max_tokens=2, temperature=0.0)
    before = client.num_waiting_sequences()
    client.add_request(None, params, "w", chat_prompt_ids[2])
    assert client.num_waiting_sequences() >= before + 3
    run_all(client, {})
    assert client.num_waiting_sequences() == 0


def test_invalid_requests_are_refused_before_the_engine_process(client):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        client.validate([10**9], SamplingParams())
    with pytest.raises(InvalidRequestError, match="context length"):
        client.validate([1] * 9000, SamplingParams())
    with pytest.raises(InvalidRequestError, match="could not be compiled"):
        client.validate([1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    with pytest.raises(InvalidRequestError, match="already in use"):
        client.add_request(None, SamplingParams(max_tokens=2000, ignore_eos=True), "dup", [1, 2])
        client.add_request(None, SamplingParams(), "dup", [1, 2])
    client.abort_request("dup")
    assert client.reset_prefix_cache() in (True, False)
    run_all(client, {})
    assert client.reset_prefix_cache() is True


def test_sampling_params_round_trip():
    p = SamplingParams(n=2, temperature=0.5, top_k=5, top_p=0.9, seed=3, max_tokens=None, stop=["x", "yz"],
                       stop_token_ids=[4], logit_bias={17: -2.5, 3: 1.0}, logprobs=3, bad_words=["foo"],
                       allowed_token_ids=[1, 2, 3], structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    back = params_from_wire(unpack(pack(params_to_wire(p))))
    assert back == p
    assert back.logit_bias == {17: -2.5, 3: 1.0} and back.structured_outputs.json == {"type": "object"}


def test_a_model_that_cannot_load_is_a_clear_error():
    from tokenmill.serve.core_client import EngineProcessError

    with pytest.raises(EngineProcessError, match="no-such-model"):
        EngineCoreClient.launch(EngineLaunch("/no-such-model", EngineConfig(**CONFIG), device="cpu"))


def test_a_second_api_server_gets_its_own_outputs(client, chat_prompt_ids, hf_greedy):
    """A second client (--api-server-count) on the same engine: requests of both run batched
    together, each client gets exactly its own, ids may repeat across clients."""
    other = EngineCoreClient(client.engine_dir, 1, engine_pid=client.pid)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)
        for c, first in ((client, 0), (other, 1)):
            for i in range(first, 6, 2):
                c.add_request(None, params, f"r{i}", chat_prompt_ids[i])
        other.add_request(None, params, "r0", chat_prompt_ids[0])  # the same id as one of the first's
        final = {client: {}, other: {}}
        deadline = time.monotonic() + 300
        while client.has_unfinished_requests() or other.has_unfinished_requests():
            assert time.monotonic() < deadline
            for c in (client, other):
                for out in c.step():
                    if out.finished:
                        final[c][out.request_id] = out
        assert sorted(final[client]) == ["r0", "r2", "r4"] and sorted(final[other]) == ["r0", "r1", "r3", "r5"]
        for c in (client, other):
            for rid, out in final[c].items():
                assert out.outputs[0].token_ids == hf_greedy[int(rid[1:])]
    finally:
        other.close()
    run_all(client, {})  # the first goes on alone


def test_every_feature_together_through_the_engine_process(features_alone):
    """test_features_together's requests (grammars with n-gram speculation, bad words, allowed
    tokens, logit bias, prompt logprobs, n=2), with chunked prefill, preemption, the prefix cache
    and a step-time target, through an engine process: token for token each request run alone in
    process."""
    from tests.engine.test_features_together import BUSY

    requests, _, _, alone = features_alone  # each run alone in process (tests/engine/conftest.py)
    busy = EngineCoreClient.launch(EngineLaunch(None, EngineConfig(step_time_target_ms=20.0, **BUSY),
                                                dtype="float32", device="cpu"))
    try:
        final = run_all(busy, {f"f{i}": (p, q) for i, (p, q) in enumerate(requests)})
        assert busy.snapshot().num_preemptions > 0 and busy.snapshot().spec_decode.accepted > 0
        assert busy.snapshot().num_free_blocks == busy.snapshot().num_blocks
    finally:
        busy.close()
    for i, want in enumerate(alone):
        got = final[f"f{i}"]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    lp = final["f5"].prompt_logprobs
    assert len(lp) == len(requests[5][0]) and lp[0] is None and all(lp[1:])
