"""n-gram speculative decoding through the real server and the official `openai` client: streamed
greedy outputs equal those of a server without speculation, several tokens arrive in one chunk,
usage and max_tokens hold, and /metrics counts the drafts (only on the server that speculates).

Two servers with the embedded model: the session's plain one (shared with
tests/server/test_openai_client.py) and one with speculation.
"""

import asyncio
import json
import re

import httpx
import pytest

from tests.server.conftest import SMALL_ENGINE, ServerProcess

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# Asked to repeat a passage, the model copies it, so the n-grams of the prompt predict its output.
COPY = [{"role": "user", "content": "Copy this text exactly: The cat sat on the mat. The cat sat on the mat. "
                                    "The cat sat on the mat."}]
PASSAGE = "The cat sat on the mat. The dog sat on the log. " * 3


@pytest.fixture(scope="module")
def servers(small_server):
    """The session's plain SMALL_ENGINE server (tests/server/conftest.py) and one that speculates."""
    spec = ServerProcess(SMALL_ENGINE + ["--speculative-config", json.dumps(NGRAM)])
    try:
        yield {"plain": small_server, "spec": spec.wait_ready()}
    finally:
        spec.stop()


def _client(server: ServerProcess):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _stream(chunks) -> dict:
    """Text, per-chunk token counts, finish reason and usage of a streamed chat or completion."""
    text, sizes, finish, usage = "", [], None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text += (delta.content or "") if delta is not None else (choice.text or "")
            ids = (choice.model_extra or {}).get("token_ids") or []
            if ids:
                sizes.append(len(ids))
            finish = choice.finish_reason or finish
    return {"text": text, "sizes": sizes, "finish": finish, "usage": usage}


def _chat(server: ServerProcess, max_tokens: int) -> dict:
    return _stream(_client(server).chat.completions.create(
        model=MODEL, messages=COPY, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}))


def _completion(server: ServerProcess, max_tokens: int) -> dict:
    return _stream(_client(server).completions.create(
        model=MODEL, prompt=PASSAGE, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))


def _spec_metrics(server: ServerProcess) -> dict[str, float]:
    """The tokenmill:spec_decode_* samples of /metrics, keyed by name (+ [position])."""
    return _samples(httpx.get(server.url + "/metrics", timeout=10).text)


def test_streams_equal_those_without_speculation_and_metrics_count_drafts(servers):
    plain, spec = servers["plain"], servers["spec"]
    assert _spec_metrics(plain) == {}  # a server without speculation exports no speculative metrics
    before = _spec_metrics(spec)
    assert before["tokenmill:spec_decode_num_drafts_total"] == 0  # present, zero, from the start

    # A chat that copies the passage, cut by max_tokens.
    ref, got = _chat(plain, 20), _chat(spec, 20)
    assert got["text"] == ref["text"] and "The cat sat on the mat" in got["text"]
    assert got["finish"] == ref["finish"] == "length"
    assert got["usage"].completion_tokens == ref["usage"].completion_tokens == sum(got["sizes"]) == 20
    assert got["usage"].prompt_tokens == ref["usage"].prompt_tokens
    assert got["usage"].total_tokens == got["usage"].prompt_tokens + 20
    assert max(ref["sizes"]) == 1 and max(got["sizes"]) > 1  # several tokens in one chunk: drafts accepted
    assert len(got["sizes"]) < len(ref["sizes"])

    # A completion that continues a repeating passage (ignore_eos: exactly max_tokens tokens).
    ref, got = _completion(plain, 24), _completion(spec, 24)
    assert got["text"] == ref["text"] and got["finish"] == ref["finish"] == "length"
    assert got["usage"].completion_tokens == sum(got["sizes"]) == 24 and max(got["sizes"]) > 1

    after = _spec_metrics(spec)
    drafts = after["tokenmill:spec_decode_num_drafts_total"]
    draft_tokens = after["tokenmill:spec_decode_num_draft_tokens_total"]
    accepted = after["tokenmill:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= draft_tokens <= 3 * drafts
    per_pos = [after[f"tokenmill:spec_decode_num_accepted_tokens_per_pos_total[{p}]"] for p in range(3)]
    drafted = [after[f"tokenmill:spec_decode_num_draft_tokens_per_pos_total[{p}]"] for p in range(3)]
    assert sum(per_pos) == accepted and sum(drafted) == draft_tokens
    assert per_pos[0] >= per_pos[1] >= per_pos[2] and drafted[0] == drafts
    assert after["tokenmill:spec_decode_acceptance_rate"] == pytest.approx(accepted / draft_tokens)
    assert after["tokenmill:spec_decode_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)
    # 44 tokens in fewer steps than tokens: the server's own token counter agrees with the clients'
    m = spec.wait_idle()
    assert m["tokenmill:generation_tokens_total"] == 44
    assert m["tokenmill:engine_steps_total"] < 44


def _samples(text: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(r'^(tokenmill:spec_decode_\w+)\{([^}]*)\}\s+(\S+)$', text, re.M):
        position = re.search(r'position="(\d+)"', m.group(2))
        out[m.group(1) + (f"[{position.group(1)}]" if position else "")] = float(m.group(3))
    return out


@pytest.mark.parametrize("speculate", [True, False])
def test_metrics_cross_from_the_engine_thread(speculate):
    """In process, on a tiny dummy model with synthetic acceptance 1: the engine thread publishes a
    frozen copy of its counts after every step, and /metrics renders it (nothing without speculation)."""
    from tokenmill.config import EngineConfig
    from tokenmill.serve.async_engine import AsyncLLMEngine
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.spec_stats import SpecDecodeCounts
    from tokenmill.serve.openai.metrics import ServerMetrics
    from tokenmill.sampling_params import SamplingParams

    spec = {**NGRAM, "synthetic_acceptance": 1.0} if speculate else None
    engine = LLMEngine("tiny-llama", EngineConfig(num_kv_blocks=64, max_num_seqs=4, speculative_config=spec),
                       load_format="dummy", dtype="float32", device="cpu")
    aengine = AsyncLLMEngine(engine)
    metrics = ServerMetrics("tiny")
    metrics.attach(aengine)
    assert _samples(metrics.render().decode()) == ({} if not speculate else {
        **{f"tokenmill:spec_decode_{n}_total": 0.0 for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
        **{f"tokenmill:spec_decode_{n}_per_pos_total[{p}]": 0.0 for n in ("num_draft_tokens", "num_accepted_tokens")
           for p in range(3)},
        "tokenmill:spec_decode_acceptance_rate": 0.0, "tokenmill:spec_decode_mean_accepted_length": 0.0})
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)  # 1 + 3 verify steps of 4

    async def main():
        aengine.start()
        try:
            streams = [aengine.submit(lambda tools, i=i: [(None, [1 + i, 2, 3, 4])], params) for i in range(2)]
            return [[out async for _, out in s][-1] for s in streams]
        finally:
            await aengine.stop()

    finals = asyncio.run(main())
    assert all(len(f.outputs[0].token_ids) == 13 for f in finals)
    got = _samples(metrics.render().decode())
    if not speculate:
        assert got == {} and aengine.stats.spec_decode is None
        return
    snapshot = aengine.stats.spec_decode
    assert isinstance(snapshot, SpecDecodeCounts) and snapshot == engine.spec_stats.snapshot()
    assert got["tokenmill:spec_decode_num_drafts_total"] == 2 * 3
    assert got["tokenmill:spec_decode_num_draft_tokens_total"] == got["tokenmill:spec_decode_num_accepted_tokens_total"] == 18
    for p in range(3):
        assert got[f"tokenmill:spec_decode_num_draft_tokens_per_pos_total[{p}]"] == 6
        assert got[f"tokenmill:spec_decode_num_accepted_tokens_per_pos_total[{p}]"] == 6
    text = metrics.render().decode()
    assert 'tokenmill:spec_decode_acceptance_rate{model_name="tiny"} 1.0' in text
    assert 'tokenmill:spec_decode_mean_accepted_length{model_name="tiny"} 4.0' in text
    assert re.search(r"^# TYPE tokenmill:spec_decode_num_accepted_tokens_per_pos(_total)? counter$", text, re.M)
    assert re.search(r"^# TYPE tokenmill:spec_decode_acceptance_rate gauge$", text, re.M)


@pytest.mark.slow  # 22 schemas + their 11 greedy ones, 16 at a time
def test_json_schemas_through_the_openai_client_with_and_without_speculation(servers):
    """Every schema of the engine tests, sent by the openai client as response_format json_schema
    (greedy and sampled) to the server with speculation, and the greedy ones to the one without
    (sampled without speculation: test_openai_client.py's test_response_format_json_schema): every
    output parses and validates; greedy outputs are the same on both servers."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    from tests.engine.test_structured_output import SCHEMAS

    def ask(server, i, schema):
        r = _client(server).chat.completions.create(
            model=MODEL, max_tokens=60, temperature=0.0 if i % 2 else 0.9, seed=i,
            messages=[{"role": "user", "content": f"Answer in JSON following this schema: {json.dumps(schema)}"}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        return r.choices[0]

    assert len(SCHEMAS) > 20
    texts = {}
    with ThreadPoolExecutor(16) as pool:
        for name, server in servers.items():
            asked = [(i, schema) for i, schema in enumerate(SCHEMAS) if name == "spec" or i % 2]
            choices = list(pool.map(lambda a: ask(server, *a), asked))
            for choice, (_, schema) in zip(choices, asked):
                assert choice.finish_reason == "stop", (name, choice.message.content)
                jsonschema.validate(json.loads(choice.message.content), schema)
            texts[name] = [c.message.content for c in choices]
    assert texts["spec"][1::2] == texts["plain"]
