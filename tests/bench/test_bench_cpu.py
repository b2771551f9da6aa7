"""CPU tests of `tokenmill bench`: workloads, the roofline floor, and each command end to end on tiny shapes."""

import asyncio
import json
import random
import threading

import numpy as np
import pytest

from tokenmill.bench.roofline import (Ceilings, attention_context_sum, embedding_parameters, run_roofline, step_floor,
                                      step_kind)
from tokenmill.bench.workloads import (WORKLOADS, generate_conversations, generate_requests, get_workload, parse_range,
                                      summarize)
from tokenmill.engine.llm_engine import StepShape
from tokenmill.entrypoints.cli import main
from tokenmill.models.config import ModelArchConfig, MoEConfig


# ---- workloads ----------------------------------------------------------------------------------

def test_standard_workload_totals():
    small = summarize(generate_requests(get_workload("offline-small")))
    assert small == {"num_requests": 256, "prompt_tokens": 142_827, "output_tokens": 133_966}
    big = summarize(generate_requests(get_workload("offline-8b")))
    assert big == {"num_requests": 128, "prompt_tokens": 71_296, "output_tokens": 37_032}
    # The 70B-class workloads send the 8B ones' requests, so their figures compare directly.
    assert summarize(generate_requests(get_workload("offline-70b"))) == big
    assert [r.prompt_token_ids for r in generate_requests(get_workload("latency-70b"))] == \
        [r.prompt_token_ids for r in generate_requests(get_workload("latency-8b"))]


def test_model_family_workloads_send_the_8b_requests():
    """Every other latency-* and offline-* workload (mixtures of experts, the other families) sends
    latency-8b's or offline-8b's requests on its own preset, so their figures compare; every workload
    with an expected output total generates exactly that many."""
    own = {"latency-8b", "offline-8b", "latency-tiny", "offline-small"}
    families = [w for name, w in WORKLOADS.items() if name.split("-")[0] in ("latency", "offline") and name not in own]
    assert {"latency-moe", "offline-moe", "latency-gemma", "offline-gemma", "latency-gpt-oss",
            "offline-gpt-oss"} <= {w.name for w in families}
    for w in families:
        dense = get_workload(w.name.split("-")[0] + "-8b")
        assert generate_requests(w) == generate_requests(dense), w.name
    assert get_workload("latency-moe").model == "qwen3-30b-a3b" and get_workload("offline-gemma").model == "gemma-3-27b"
    assert get_workload("latency-gpt-oss").model == "gpt-oss-20b"
    for w in WORKLOADS.values():
        if w.expected_output_tokens is not None:
            assert summarize(generate_requests(w))["output_tokens"] == w.expected_output_tokens, w.name


def test_generator_is_the_nano_vllm_one():
    """Same sequence as the nano-vllm README snippet on Python's global generator."""
    state = random.getstate()
    try:
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
        outs = [random.randint(100, 1024) for _ in range(256)]
    finally:
        random.setstate(state)
    reqs = generate_requests(get_workload("offline-small"))
    assert [r.prompt_token_ids for r in reqs] == prompts
    assert [r.max_tokens for r in reqs] == outs


def test_other_workloads():
    lat = generate_requests(get_workload("latency-8b"))
    assert len(lat) == 1 and len(lat[0].prompt_token_ids) == 128 and lat[0].max_tokens == 256
    pre = generate_requests(get_workload("prefill-8b"))
    assert len(pre) == 8 and all(len(r.prompt_token_ids) == 4096 and r.max_tokens == 1 for r in pre)
    serve = generate_requests(get_workload("serve-8b"))
    times = [r.arrival_time for r in serve]
    assert len(serve) == 500 and times == sorted(times) and times[0] == 0
    assert 500 / 8 * 0.8 < times[-1] < 500 / 8 * 1.2  # Poisson at 8 req/s
    tiny = generate_requests(get_workload("tiny"), vocab_size=1024)
    assert all(max(r.prompt_token_ids) < 1024 for r in tiny)
    assert set(WORKLOADS) >= {"offline-small", "offline-8b", "latency-8b", "serve-8b", "prefill-8b", "tiny"}
    assert parse_range("128") == (128, 128) and parse_range("100:1024") == (100, 1024)
    assert parse_range("100..1024") == (100, 1024)


# ---- the roofline floor ---------------------------------------------------------------------------

ARCH = ModelArchConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=8, intermediate_size=16,
                       num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, tie_word_embeddings=False)


def _ceil(copy, matmul):
    return Ceilings("cpu", "test", float(copy), float(matmul), "float32", "by hand")


def test_step_floor_by_hand():
    # Parameters: attention 8*(8+2*4) + 8*8 = 192, MLP 3*8*16 = 384, norms 2*8 = 16 -> 592 per layer;
    # 2 layers + 2 untied tables of 100*8 + final norm 8 = 2792; non-embedding 1192, one table 800.
    assert ARCH.num_parameters() == 2792
    # A 3-token prefill (context 3) and a decode at context 10: 4 new tokens, 2 entries.
    shape = StepShape(np.array([3, 1]), np.array([3, 10]))
    assert attention_context_sum(shape.query_lens, shape.seq_lens) == (1 + 2 + 3) + 10
    # KV per token: 2 x 2 layers x 1 kv head x 4 x 2 bytes = 32; read (3+10)*32 = 416, written 4*32 = 128.
    # Attention FLOPs: 4 x 2 layers x 2 heads x 4 x 16 = 1024.
    # spec: bytes 2792*2 + 416 + 128 = 6128; FLOPs 2*1192*4 + 2*800*4 + 1024 = 16960.
    b, f, s = step_floor(shape, ARCH, 2, _ceil(1000, 1000), "spec")
    assert (b, f) == (6128, 16960) and s == pytest.approx(16.96)
    # as-run: input table gathered (4 rows of 8), LM head on 2 rows:
    # bytes (2792 - 800 + 32)*2 + 544 = 4592; FLOPs 9536 + 2*800*2 + 1024 = 13760.
    b, f, s = step_floor(shape, ARCH, 2, _ceil(1000, 1000))
    assert (b, f) == (4592, 13760) and s == pytest.approx(13.76)
    # Bandwidth-bound with a slow copy: 4592 / 100.
    assert step_floor(shape, ARCH, 2, _ceil(100, 1000)).seconds == pytest.approx(45.92)
    # FP8 linear weights: the 1192 non-embedding parameters at 1 byte instead of 2.
    assert step_floor(shape, ARCH, 2, _ceil(1000, 1000), dense_bytes=1.0).bytes == 4592 - 1192


def test_step_floor_tied_and_kinds():
    tied = ModelArchConfig(architecture="Qwen3ForCausalLM", vocab_size=100, hidden_size=8, intermediate_size=16,
                           num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, tie_word_embeddings=True)
    shape = StepShape(np.array([1]), np.array([5]))
    spec = step_floor(shape, tied, 2, _ceil(1, 1), "spec")
    run = step_floor(shape, tied, 2, _ceil(1, 1))
    assert spec == run  # one token, one entry, tied table: both conventions agree
    assert spec.bytes == tied.num_parameters() * 2 + 5 * 32 + 32
    assert step_kind(StepShape(np.array([1, 1]), np.array([4, 9]))) == "decode"
    assert step_kind(StepShape(np.array([7]), np.array([7]))) == "prefill"
    assert step_kind(StepShape(np.array([7, 1]), np.array([7, 9]))) == "mixed"


def test_run_roofline_sums_steps():
    steps = [StepShape(np.array([3, 1]), np.array([3, 10])), StepShape(np.array([1, 1]), np.array([4, 11]))]
    c = _ceil(1000, 1000)
    floor = sum(step_floor(s, ARCH, 2, c).seconds for s in steps)
    r = run_roofline(steps, ARCH, 2, c, measured_s=4 * floor, step_seconds=[2 * floor, 2 * floor])
    assert r["floor_s"] == pytest.approx(floor) and r["roofline_pct"] == pytest.approx(25.0)
    assert r["by_kind"]["mixed"]["steps"] == 1 and r["by_kind"]["decode"]["steps"] == 1
    assert r["by_kind"]["prefill"]["steps"] == 0
    assert r["by_kind"]["decode"]["measured_s"] == pytest.approx(2 * floor)


# 2 layers, each sparse: 4 experts of width 4, top 2.
MOE_ARCH = ModelArchConfig(architecture="Qwen3MoeForCausalLM", vocab_size=100, hidden_size=8, intermediate_size=16,
                           num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, tie_word_embeddings=False,
                           moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=4, renormalize=True))


def test_moe_step_floor_by_hand():
    """Experts' bytes: the expected distinct experts the step's tokens select; their FLOPs: top_k per token."""
    from tokenmill.bench.roofline import expected_distinct_experts, linear_parameters

    # Per layer: attention 192 + norms 16 + router 8*4 = 32 + 4 experts of 3*8*4 = 96 each -> 624;
    # 2 layers + 2 tables of 800 + final norm 8 = 2856; non-embedding 1256, of which 488 outside the experts.
    assert MOE_ARCH.num_parameters() == 2856
    assert expected_distinct_experts(4, 2, 0) == 0 and expected_distinct_experts(4, 2, 1) == 2
    assert expected_distinct_experts(4, 2, 4) == pytest.approx(4 * (1 - 0.5 ** 4))  # 3.75
    assert expected_distinct_experts(128, 8, 10 ** 6) == pytest.approx(128)
    # Batch-1 decode at context 10: exactly top_k = 2 experts a layer, read = 488 + 2*2*96 = 872 = per token.
    assert linear_parameters(MOE_ARCH, 1) == (872, 872)
    # bytes: (2856 - (1256 - 872) + 8 - 800 gathered input table) * 2 + KV 10*32 + 32 = 3712;
    # FLOPs: 2*872 + LM head 2*800 + attention 4*2*2*4*10 = 3984.
    b, f, _ = step_floor(StepShape(np.array([1]), np.array([10])), MOE_ARCH, 2, _ceil(1000, 1000))
    assert (b, f) == (3712, 3984)
    # 4 new tokens (a 3-token prefill and a decode): 3.75 experts a layer read, 2 per token computed.
    # read 488 + 2*3.75*96 = 1208 -> bytes (2856 - 48 + 32 - 800)*2 + 416 + 128 = 4624;
    # FLOPs 2*872*4 + 2*800*2 + 1024 = 11200 (all experts would give 2*1256*4 = 10048 in the linear part alone).
    shape = StepShape(np.array([3, 1]), np.array([3, 10]))
    b, f, _ = step_floor(shape, MOE_ARCH, 2, _ceil(1000, 1000))
    assert (b, f) == (pytest.approx(4624), 11200)
    # spec: the whole input table and the LM head for all 4 tokens: (2808*2 + 544, 6976 + 6400 + 1024).
    b, f, _ = step_floor(shape, MOE_ARCH, 2, _ceil(1000, 1000), "spec")
    assert (b, f) == (pytest.approx(6160), 14400)
    # FP8 weights: the 1208 linear parameters read at 1 byte instead of 2.
    assert step_floor(shape, MOE_ARCH, 2, _ceil(1000, 1000), dense_bytes=1.0).bytes == pytest.approx(4624 - 1208)


def test_moe_roofline_reports_its_routing_rule():
    from tokenmill.bench.roofline import format_roofline
    from tokenmill.models.config import arch_config_from_hf
    from tokenmill.models.presets import get_preset

    steps = [StepShape(np.array([1]), np.array([10])), StepShape(np.array([3, 1]), np.array([3, 11]))]
    r = run_roofline(steps, MOE_ARCH, 2, _ceil(1000, 1000), measured_s=100.0)
    assert r["moe"]["mean_distinct_experts_per_step"] == pytest.approx((2 + 3.75) / 2)
    assert (r["moe"]["num_experts"], r["moe"]["top_k"], r["moe"]["sparse_layers"]) == (4, 2, 2)
    assert "E*(1-(1-k/E)^T)" in r["moe"]["experts_read"] and "uniform routing" in format_roofline(r)
    assert run_roofline(steps, ARCH, 2, _ceil(1000, 1000), measured_s=100.0)["moe"] is None
    # Qwen3-30B-A3B at batch 1 reads its 8 experts a layer: about 6 GB a token (BENCHMARKS.md).
    qwen = arch_config_from_hf(get_preset("qwen3-30b-a3b"))
    decode = step_floor(StepShape(np.array([1]), np.array([128])), qwen, 2, _ceil(4.28e12, 700e12))
    gathered = qwen.num_active_parameters() - embedding_parameters(qwen) + qwen.hidden_size
    assert decode.bytes == pytest.approx(2 * gathered + 129 * 2 * 48 * 4 * 128 * 2)
    assert 5.9e9 < decode.bytes < 6.2e9 and 1.35e-3 < decode.seconds < 1.45e-3


def test_ceilings_of_a_parallel_run_sum_its_gpus():
    """A run over N GPUs (tensor x pipeline x data parallel) is measured against N devices' rates:
    the floor of a bandwidth-bound step is 1/N of one device's, and the JSON says how many."""
    from argparse import Namespace

    from tokenmill.bench.roofline import gpus_of

    one = Ceilings("cuda", "x", 4.0e12, 700e12, "bfloat16", "copy", 1400e12)
    four = one.over_gpus(4)
    assert (four.copy_bytes_per_s, four.matmul_flops_per_s, four.fp8_matmul_flops_per_s, four.gpus) == \
        (16.0e12, 2800e12, 5600e12, 4)
    assert one.over_gpus(1) is one and one.gpus == 1
    assert Ceilings.from_dict(four.to_dict()) == four and Ceilings.from_dict(one.to_dict()).gpus == 1
    decode = StepShape(np.array([1]), np.array([100]))
    assert step_floor(decode, ARCH, 2, four).seconds == pytest.approx(step_floor(decode, ARCH, 2, one).seconds / 4)
    with pytest.raises(ValueError, match="one device"):
        four.over_gpus(2)
    assert gpus_of(Namespace(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)) == 8
    assert gpus_of(Namespace(tensor_parallel_size=4)) == 4 and gpus_of(Namespace()) == 1


# ---- the commands, end to end on the CPU ----------------------------------------------------------

def _load(path):
    with open(path) as f:
        return json.load(f)


def test_throughput_tiny_with_transformers(tmp_path):
    out = tmp_path / "res"
    rc = main(["bench", "throughput", "--workload", "tiny", "--device", "cpu", "--out", str(out),
               "--num-prompts", "4", "--output-len", "4:12", "--warmup-requests", "2",
               "--compare", "transformers", "--hf-num-blocks", "32", "--hf-max-batch-tokens", "256"])
    assert rc == 0
    r = _load(out / "throughput-tiny+custom.json")
    for key in ("workload", "model", "dtype", "device_name", "versions", "date", "command", "ceilings", "results",
                "roofline"):
        assert r.get(key) is not None, key
    assert r["versions"]["torch"] and "triton" in r["versions"]
    s = r["summary"]
    assert s["output_tok_per_s"] > 0 and s["output_tokens"] == r["workload_tokens"]["output_tokens"]
    assert 0 < r["roofline"]["roofline_pct"] <= 100
    assert r["roofline"]["num_steps"] == s["num_steps"] > 0
    assert sum(k["steps"] for k in r["roofline"]["by_kind"].values()) == s["num_steps"]
    peer = r["peer"]
    assert peer["runs"][0]["output_tokens"] == s["output_tokens"] and peer["runs"][0]["num_errors"] == 0
    assert peer["output_tok_per_s"] > 0 and s["peer_ratio"] == pytest.approx(s["output_tok_per_s"] / peer["output_tok_per_s"])
    assert (out / "throughput-tiny+custom.png").exists()


def test_hf_config_of_the_moe_presets():
    """--compare transformers builds HF's MoE classes from the presets, with their expert fields."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from tokenmill.bench.hf_peer import hf_config
    from tokenmill.models.config import arch_config_from_hf
    from tokenmill.models.presets import get_preset

    qwen = hf_config("qwen3-30b-a3b")
    assert type(qwen).__name__ == "Qwen3MoeConfig"
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size, qwen.norm_topk_prob,
            qwen.hidden_size, qwen.num_hidden_layers, qwen.mlp_only_layers) == (128, 8, 768, True, 2048, 48, [])
    assert type(hf_config("qwen3-235b-a22b")).__name__ == "Qwen3MoeConfig"
    mixtral = hf_config("mixtral-8x7b")
    assert type(mixtral).__name__ == "MixtralConfig"
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (8, 2)
    # The tiny preset's HF model has exactly the parameters tokenmill counts (same architecture).
    tiny = AutoModelForCausalLM.from_config(hf_config("tiny-qwen3-moe"))
    assert type(tiny).__name__ == "Qwen3MoeForCausalLM"
    ours = arch_config_from_hf(get_preset("tiny-qwen3-moe"))
    assert sum(p.numel() for p in tiny.parameters()) == ours.num_parameters()


def test_moe_throughput_tiny_with_transformers(tmp_path):
    """The MoE bench path end to end: tokenmill on the tiny Qwen3-MoE preset with its roofline's
    expert accounting, then HF's Qwen3MoeForCausalLM on the same requests."""
    out = tmp_path / "res"
    rc = main(["bench", "throughput", "--workload", "tiny-moe", "--device", "cpu", "--out", str(out), "--no-plot",
               "--num-prompts", "3", "--output-len", "4:8", "--warmup-requests", "1",
               "--compare", "transformers", "--hf-num-blocks", "32", "--hf-max-batch-tokens", "256"])
    assert rc == 0
    r = _load(out / "throughput-tiny-moe+custom.json")
    assert r["engine"]["arch"]["architecture"] == "Qwen3MoeForCausalLM"
    moe = r["roofline"]["moe"]
    assert (moe["num_experts"], moe["top_k"], moe["sparse_layers"]) == (8, 2, 2)
    assert 2 <= moe["mean_distinct_experts_per_step"] <= 8
    assert 0 < r["roofline"]["roofline_pct"] <= 100
    run = r["peer"]["runs"][0]
    assert run["output_tokens"] == r["summary"]["output_tokens"] and run["num_errors"] == 0


def test_latency_tiny(tmp_path):
    rc = main(["bench", "latency", "--workload", "latency-tiny", "--device", "cpu", "--out", str(tmp_path),
               "--repeat", "2", "--output-len", "8", "--tag", "t"])
    assert rc == 0
    r = _load(tmp_path / "latency-latency-tiny+custom-t.json")
    s = r["summary"]
    assert s["output_tokens"] == 8 and s["tpot_ms"] > 0 and s["ttft_ms"] > 0
    assert 0 < s["bandwidth_pct"] <= 100 and 0 < s["roofline_pct"] <= 100


def test_multiturn_conversations_resend_their_history():
    w = get_workload("multiturn-tiny")
    convs = generate_conversations(w, 1024)
    assert len(convs) == w.num_requests and all(len(c) == w.turns for c in convs)
    for c in convs:
        for prev, turn in zip(c, c[1:]):  # each turn repeats the previous prompt, its answer, then more
            assert turn.prompt_token_ids[: len(prev.prompt_token_ids)] == prev.prompt_token_ids
            assert len(turn.prompt_token_ids) >= len(prev.prompt_token_ids) + prev.max_tokens + w.input_len[0]
    assert len({tuple(c[0].prompt_token_ids[: w.system_len]) for c in convs}) == 1  # one system prompt
    assert generate_conversations(w, 1024) == convs


def test_multiturn_tiny_with_the_host_tier(tmp_path):
    rc = main(["bench", "multiturn", "--workload", "multiturn-tiny", "--device", "cpu", "--out", str(tmp_path),
               "--working-set-ratio", "3", "--kv-offloading-size", "0.01", "--tag", "t", "--warmup-requests", "1"])
    assert rc == 0
    r = _load(tmp_path / "multiturn-multiturn-tiny-t.json")
    s = r["summary"]
    assert s["working_set_ratio"] > 2 and s["ttft_ms"]["p50"] > 0 and s["ttft_later_turns_ms"]["p50"] > 0
    assert s["output_tokens"] == sum(t.max_tokens for c in generate_conversations(get_workload("multiturn-tiny"), 1024)
                                     for t in c)
    host = s["host_tier"]  # returning conversations found their evicted history on the host
    assert host["hit_tokens"] > 0 and host["bytes_loaded"] > 0 and s["host_cached_prompt_tokens"] > 0


class _FakeServer:
    """An OpenAI-style streaming server: one chunk per token, except a two-token chunk in the middle."""

    def __init__(self):
        from aiohttp import web

        async def health(request):
            return web.Response(text="ok")

        async def models(request):
            return web.json_response({"data": [{"id": "fake"}]})

        async def completions(request):
            body = await request.json()
            assert body["stream"] and body["ignore_eos"] and isinstance(body["prompt"], list)
            n = body["max_tokens"]
            resp = web.StreamResponse()
            await resp.prepare(request)
            sent = 0
            while sent < n:
                k = 2 if (sent == 2 and n - sent >= 2) else 1
                await asyncio.sleep(0.002)
                chunk = {"choices": [{"index": 0, "text": "", "token_ids": list(range(k))}], "usage": None}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                sent += k
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_serve_against_a_fake_server(tmp_path):
    pytest.importorskip("aiohttp")
    server = _FakeServer()
    try:
        rc = main(["bench", "serve", "--workload", "tiny", "--device", "cpu", "--base-url",
                   f"http://127.0.0.1:{server.port}", "--rates", "50,inf", "--out", str(tmp_path)])
    finally:
        server.close()
    assert rc == 0
    r = _load(tmp_path / "serve-tiny.json")
    assert [x["request_rate"] for x in r["rates"]] == [50.0, "inf"]
    expected = summarize(generate_requests(get_workload("tiny"), 1024))["output_tokens"]
    for rate in r["rates"]:
        s = rate["summary"]
        assert s["completed"] == 8 and s["failed"] == 0 and s["output_tokens"] == expected
        assert s["requests_with_chunks_not_tokens"] == 0 and s["multi_token_chunks"] == 8
        assert 0 < s["ttft_ms_p50"] <= s["ttft_ms_p99"] and 0 < s["itl_ms_p50"] <= s["itl_ms_p99"]
        assert s["output_tok_per_s"] > 0


def test_serve_launches_the_real_server(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("aiohttp")
    try:
        import tokenmill.entrypoints.serve_cli  # noqa: F401
    except ImportError:
        pytest.skip("no `tokenmill serve` in this checkout")
    rc = main(["bench", "serve", "--workload", "tiny", "--device", "cpu", "--launch", "--num-prompts", "4",
               "--output-len", "4:8", "--request-rate", "inf", "--warmup-requests", "1", "--out", str(tmp_path),
               "--server-timeout", "120"])
    assert rc == 0
    r = _load(tmp_path / "serve-tiny+custom.json")
    s = r["rates"][0]["summary"]
    assert s["completed"] == 4 and s["failed"] == 0 and s["requests_short_of_max_tokens"] == 0
    assert s["requests_with_chunks_not_tokens"] == 0 and s["ttft_ms_p50"] > 0
    assert (tmp_path / "server-tiny+custom.log").exists()
    # The server's own step intervals, scraped from /metrics around the load: 4 prompts of 4-8
    # tokens make at least a few decode steps after the prefill.
    steps = r["rates"][0]["server_steps"]
    assert steps["decode"]["count"] >= 2 and steps["decode"]["mean_ms"] > 0
    assert sum(v["count"] for v in steps.values()) >= 4
    # The server's own ITL histogram saw every gap between the requests' tokens (>= 3 per request),
    # and the compile counter is exported (0 on the CPU: interpreted kernels do not compile).
    seen = r["rates"][0]["server_side"]
    (itl,) = seen["itl"].values()
    assert itl["count"] >= 4 * 3 and itl["mean_ms"] > 0
    assert seen["kernel_compiles"] == 0


def test_summary_table_and_merge(tmp_path):
    from tokenmill.bench import report

    a = {"kind": "throughput", "workload": {"name": "w"}, "summary": {"output_tok_per_s": 10.0, "roofline_pct": 5.0}}
    report.write_json(a, str(tmp_path / "a.json"))
    merged = report.merge([str(tmp_path / "a.json"), str(tmp_path / "missing.json")])
    table = report.format_table(report.summary_rows(merged))
    assert "throughput" in table and "error" in table


def test_profile_tiny(tmp_path):
    rc = main(["bench", "profile", "--workload", "tiny", "--device", "cpu", "--out", str(tmp_path),
               "--num-prompts", "3", "--input-len", "12", "--output-len", "10", "--skip-steps", "3", "--steps", "4"])
    assert rc == 0
    (path,) = tmp_path.glob("profile-*.json")
    result = json.loads(path.read_text())
    assert result["window"] == {"skip_steps": 3, "steps": 4, "batch_min": 3, "batch_max": 3, "new_tokens_mean": 3.0}
    summary = result["summary"]
    assert summary["wall_ms_per_step"] > 0 and summary["kernel_launches_per_step"] > 0
    # On the CPU the "kernels" are torch ops; the linear layers' matmuls must be among them.
    assert summary["families"]["gemm"]["ms_per_step"] > 0
    assert sum(k["share_pct"] for k in summary["kernels"]) == pytest.approx(100, rel=1e-6)


def test_step_histogram_parsing():
    from tokenmill.bench.serve import histogram_summary, histograms

    def step_histograms(text):
        return histograms(text, "tokenmill:step_interval_seconds", "kind")

    def scrape(decode_buckets, mixed_buckets):
        lines = ["# HELP tokenmill:step_interval_seconds ...", "# TYPE tokenmill:step_interval_seconds histogram"]
        for kind, buckets in (("decode", decode_buckets), ("mixed", mixed_buckets)):
            for le, c in buckets:
                lines.append(f'tokenmill:step_interval_seconds_bucket{{model_name="m",kind="{kind}",le="{le}"}} {c}')
            lines.append(f'tokenmill:step_interval_seconds_count{{model_name="m",kind="{kind}"}} {buckets[-1][1]}')
            lines.append(f'tokenmill:step_interval_seconds_sum{{model_name="m",kind="{kind}"}} {0.005 * buckets[-1][1]}')
        return "\n".join(lines)

    before = step_histograms(scrape([("0.005", 10.0), ("0.03", 10.0), ("+Inf", 10.0)],
                                    [("0.005", 0.0), ("0.03", 0.0), ("+Inf", 0.0)]))
    after = step_histograms(scrape([("0.005", 108.0), ("0.03", 110.0), ("+Inf", 110.0)],
                                   [("0.005", 0.0), ("0.03", 3.0), ("+Inf", 4.0)]))
    s = histogram_summary(before, after)
    assert s["decode"] == {"count": 100, "mean_ms": pytest.approx(5.0), "p50_le_ms": 5.0, "p99_le_ms": 30.0,
                           "max_le_ms": 30.0}
    assert s["mixed"]["count"] == 4 and s["mixed"]["p50_le_ms"] == 30.0 and s["mixed"]["p99_le_ms"] == float("inf")
    assert s["mixed"]["max_le_ms"] == float("inf")


def test_server_side_counters_and_histograms():
    from tokenmill.bench.serve import server_side

    def scrape(compiles, gc_count):
        return "\n".join([
            'tokenmill:kernel_compiles_after_warmup_total{model_name="m"} %s' % compiles,
            'tokenmill:kernel_compile_seconds_after_warmup_total{model_name="m"} %s' % (0.5 * compiles),
            'tokenmill:gc_pause_seconds_bucket{model_name="m",generation="2",le="0.01"} 0.0',
            'tokenmill:gc_pause_seconds_bucket{model_name="m",generation="2",le="0.05"} %s' % gc_count,
            'tokenmill:gc_pause_seconds_bucket{model_name="m",generation="2",le="+Inf"} %s' % gc_count,
            'tokenmill:gc_pause_seconds_count{model_name="m",generation="2"} %s' % gc_count,
            'tokenmill:gc_pause_seconds_sum{model_name="m",generation="2"} %s' % (0.02 * gc_count)])

    seen = server_side(scrape(3, 1), scrape(5, 4))
    assert seen["kernel_compiles"] == 2 and seen["kernel_compile_s"] == pytest.approx(1.0)
    assert seen["gc_pauses"]["2"] == {"count": 3, "mean_ms": pytest.approx(20.0), "p50_le_ms": 50.0, "p99_le_ms": 50.0,
                                      "max_le_ms": 50.0}
    assert seen["steps"] == {} and seen["itl"] == {}



def test_launched_server_gets_the_engine_flags_changed():
    """`bench serve --launch` passes on the engine flags that differ from the defaults, and only those."""
    import argparse

    from tokenmill.bench.serve import server_command
    from tokenmill.bench.workloads import get_workload
    from tokenmill.entrypoints.cli import add_engine_args
    from tokenmill.entrypoints.serve_cli import SERVE_ENGINE_DEFAULTS

    p = argparse.ArgumentParser()
    add_engine_args(p, defaults=SERVE_ENGINE_DEFAULTS)  # as `bench serve` registers them
    args = p.parse_args(["--piecewise-cuda-graph-max-tokens", "0", "--max-prefill-tokens-with-decodes", "512",
                         "--no-fused-small-batch-linear"])
    args.server_args = "--api-key k"
    cmd = server_command(args, get_workload("serve-8b"), 8123)
    joined = " ".join(cmd)
    assert "--piecewise-cuda-graph-max-tokens 0" in joined and "--max-prefill-tokens-with-decodes 512" in joined
    assert "--no-fused-small-batch-linear" in cmd and cmd[-2:] == ["--api-key", "k"]
    # what is passed on parses back into the same engine options
    from tokenmill.entrypoints.cli import build_parser, engine_config_from_args

    served = build_parser().parse_args(cmd[3:])
    assert engine_config_from_args(served) == engine_config_from_args(args)
    assert "--max-num-seqs" not in cmd and "--enforce-eager" not in cmd


# ---- speculative decoding in the benchmarks -------------------------------------------------------
# With synthetic acceptance a verify step drafts k tokens and accepts each with that probability;
# 13 output tokens are the prefill's one plus three full verify steps of k = 3 (1 + 3 x 4), so every
# draft has all k tokens and the figures are exact.

def _check_spec(spec, rate: float, k: int = 3) -> None:
    assert spec["num_speculative_tokens"] == k and spec["num_drafts"] > 0
    assert spec["acceptance_rate"] == rate
    assert spec["mean_accepted_length"] == (1.0 + k if rate == 1.0 else 1.0)
    assert spec["acceptance_by_position"] == [rate] * k
    assert spec["num_accepted_tokens"] == sum(spec["num_accepted_tokens_by_position"])
    assert spec["num_draft_tokens"] == sum(spec["num_draft_tokens_by_position"])


@pytest.mark.parametrize("rate", [1.0, 0.0])
def test_latency_with_synthetic_acceptance(tmp_path, rate, capsys):
    rc = main(["bench", "latency", "--workload", "latency-tiny", "--device", "cpu", "--out", str(tmp_path),
               "--repeat", "1", "--output-len", "13", "--warmup-requests", "1", "--no-plot",
               "--synthetic-acceptance", str(rate)])
    assert rc == 0
    r = _load(tmp_path / "latency-latency-tiny+custom.json")
    s = r["summary"]
    _check_spec(s["speculative"], rate)
    assert r["speculative"] == s["speculative"] == r["results"]["runs"][0]["speculative"]
    assert r["engine"]["config"]["speculative_config"]["synthetic_acceptance"] == rate
    # ms per output token counts the tokens emitted: a verify step's 1 + accepted tokens share its time
    assert s["output_tokens"] == 13
    assert s["tokens_per_decode_step"] == pytest.approx(4.0 if rate == 1.0 else 1.0)
    assert s["decode_step_ms"] == pytest.approx(s["tpot_ms"] * s["tokens_per_decode_step"])
    assert s["decode_steps"] == (3 if rate == 1.0 else 12)  # verify steps count as decode steps
    assert r["roofline"]["by_kind"]["decode"]["steps"] == s["decode_steps"]
    assert 0 < s["bandwidth_pct"] <= 100
    out = capsys.readouterr().out
    assert "ms per output token" in out and "ms per decode step" in out
    assert f"acceptance {100 * rate:.1f}%" in out and f"{s['speculative']['mean_accepted_length']:.2f} tokens per verifying step" in out


def test_latency_without_speculation_has_no_spec_figures(tmp_path):
    rc = main(["bench", "latency", "--workload", "latency-tiny", "--device", "cpu", "--out", str(tmp_path),
               "--repeat", "1", "--output-len", "6", "--warmup-requests", "1", "--no-plot"])
    assert rc == 0
    s = _load(tmp_path / "latency-latency-tiny+custom.json")["summary"]
    assert s["speculative"] is None and s["tokens_per_decode_step"] == 1.0 and s["decode_steps"] == 5
    assert s["decode_step_ms"] == pytest.approx(s["tpot_ms"])


def test_throughput_with_a_speculative_config_and_synthetic_acceptance(tmp_path, capsys):
    """--synthetic-acceptance sets synthetic_acceptance inside a given --speculative-config (k = 2
    here: 13 tokens = 1 + 4 verify steps of 3)."""
    rc = main(["bench", "throughput", "--workload", "tiny", "--device", "cpu", "--out", str(tmp_path),
               "--num-prompts", "3", "--output-len", "13", "--warmup-requests", "1", "--no-plot",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
               "--synthetic-acceptance", "1"])
    assert rc == 0
    r = _load(tmp_path / "throughput-tiny+custom.json")
    s = r["summary"]
    _check_spec(s["speculative"], 1.0, k=2)
    assert s["speculative"]["num_drafts"] == 3 * 4 and s["output_tokens"] == 3 * 13
    assert r["engine"]["config"]["speculative_config"]["num_speculative_tokens"] == 2
    assert r["roofline"]["by_kind"]["decode"]["steps"] == 4  # verify steps, as the scheduler saw them
    captured = capsys.readouterr()
    out = captured.out
    assert "acceptance 100.0%" in out and "3.00 tokens per verifying step" in out
    assert (captured.out + captured.err).count("roofline: ") == 1  # the summary is printed once


def test_serve_launch_forwards_speculation_and_reports_acceptance(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("aiohttp")
    rc = main(["bench", "serve", "--workload", "tiny", "--device", "cpu", "--launch", "--num-prompts", "3",
               "--output-len", "13", "--request-rate", "inf", "--warmup-requests", "1", "--out", str(tmp_path),
               "--server-timeout", "120", "--no-plot", "--synthetic-acceptance", "1.0"])
    assert rc == 0
    r = _load(tmp_path / "serve-tiny+custom.json")
    cmd = r["server_command"]
    spec_config = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec_config["method"] == "ngram" and spec_config["num_speculative_tokens"] == 3
    assert spec_config["synthetic_acceptance"] == 1.0
    rate = r["rates"][0]
    s = rate["summary"]
    assert s["completed"] == 3 and s["failed"] == 0 and s["output_tokens"] == 3 * 13
    assert s["multi_token_chunks"] > 0 and s["requests_with_chunks_not_tokens"] == 0
    # scraped from the server's /metrics around the load (the warm-up's requests not counted)
    _check_spec(rate["speculative"], 1.0)
    assert rate["speculative"]["num_drafts"] == 3 * 3
    assert r["summary"]["speculative"] == rate["speculative"]


def test_synthetic_acceptance_flag(capsys):
    from tokenmill.bench.common import engine_namespace, speculative_config
    from tokenmill.bench.serve import server_command
    from tokenmill.config import SpeculativeConfig
    from tokenmill.entrypoints.cli import build_parser, engine_config_from_args

    parser = build_parser()
    alone = parser.parse_args(["bench", "serve", "--synthetic-acceptance", "0.5"])
    assert speculative_config(alone) == SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                          synthetic_acceptance=0.5)
    given = parser.parse_args(["bench", "latency", "--speculative-config", '{"num_speculative_tokens": 5}',
                               "--synthetic-acceptance", "0.25"])
    assert speculative_config(given) == SpeculativeConfig(num_speculative_tokens=5, synthetic_acceptance=0.25)
    plain = parser.parse_args(["bench", "serve"])
    assert speculative_config(plain) is None
    w = get_workload("serve-8b")
    assert "--speculative-config" not in server_command(plain, w, 8000)
    # forwarded to a launched server, and parsed back there into the same engine options
    cmd = server_command(alone, w, 8000)
    served = build_parser().parse_args(cmd[3:])
    assert engine_config_from_args(served).speculative_config == speculative_config(alone)
    assert engine_config_from_args(served) == engine_config_from_args(engine_namespace(alone, w))
    for bad in ("1.5", "-0.1", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", "latency", "--synthetic-acceptance", bad])
        assert "--synthetic-acceptance" in capsys.readouterr().err


def test_spec_counters_parsed_from_a_scrape():
    from tokenmill.bench.serve import server_side, spec_counts

    def scrape(drafts, tokens, accepted, per_pos_drafted, per_pos_accepted):
        lines = [f'tokenmill:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
                 f'tokenmill:spec_decode_num_draft_tokens_total{{model_name="m"}} {tokens}',
                 f'tokenmill:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}']
        for p, (d, a) in enumerate(zip(per_pos_drafted, per_pos_accepted)):
            lines.append(f'tokenmill:spec_decode_num_draft_tokens_per_pos_total{{model_name="m",position="{p}"}} {d}')
            lines.append(f'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{p}"}} {a}')
        return "\n".join(lines)

    before = scrape(10, 28, 14, [10, 10, 8], [8, 4, 2])
    after = scrape(30, 88, 50, [30, 30, 28], [26, 16, 8])
    counts = spec_counts(after)
    assert (counts.num_speculative_tokens, counts.verify_steps, counts.drafts, counts.accepted) == (3, 30, 88, 50)
    assert counts.drafted_at == (30, 30, 28) and counts.accepted_at == (26, 16, 8)
    assert spec_counts("tokenmill:engine_steps_total{model_name=\"m\"} 3") is None
    spec = server_side(before, after)["speculative"]
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (20, 60, 36)
    assert spec["acceptance_rate"] == pytest.approx(36 / 60) and spec["mean_accepted_length"] == pytest.approx(1 + 36 / 20)
    assert spec["acceptance_by_position"] == pytest.approx([18 / 20, 12 / 20, 6 / 20])
    assert server_side("", "")["speculative"] is None


def test_spec_counts_snapshot_since_and_summary():
    from tokenmill.bench.common import format_spec, spec_summary
    from tokenmill.engine.spec_stats import SpecDecodeCounts, SpecDecodeStats

    stats = SpecDecodeStats(3)
    # three entries: 3 drafts all accepted, 2 drafts none accepted, no drafts (a plain decode)
    stats.record(np.array([3, 2, 0]), np.array([4, 1, 1]))
    first = stats.snapshot()
    assert first == SpecDecodeCounts(3, verify_steps=2, drafts=5, accepted=3, drafted_at=(2, 2, 1),
                                     accepted_at=(1, 1, 1))
    stats.record(np.array([3]), np.array([2]))  # one of three accepted
    assert first.verify_steps == 2  # a snapshot does not move with the tally
    run = stats.snapshot().since(first)
    assert run == SpecDecodeCounts(3, 1, 3, 1, (1, 1, 1), (1, 0, 0))
    s = spec_summary(run)
    assert (s["acceptance_rate"], s["mean_accepted_length"], s["acceptance_by_position"]) == (1 / 3, 2.0, [1.0, 0.0, 0.0])
    assert "33.3%" in format_spec(s) and "2.00 tokens per verifying step" in format_spec(s)
    empty = spec_summary(SpecDecodeCounts(3))
    assert empty["acceptance_rate"] is None and empty["mean_accepted_length"] is None
    assert empty["acceptance_by_position"] == [None] * 3 and "no draft verified" in format_spec(empty)
    assert spec_summary(None) is None and format_spec(None) == ""


@pytest.mark.slow  # the 135M preset (the tokenizer needs its vocabulary) on the CPU: a few seconds
def test_structured_bench_tiny(tmp_path, capsys):
    """bench structured: both runs timed at the same batch size, the ratio and mask-fill times
    reported, JSON outputs checked; a dummy preset gets the embedded model's tokenizer."""
    rc = main(["bench", "structured", "--workload", "structured-tiny", "--device", "cpu", "--out", str(tmp_path),
               "--repeat", "1", "--warmup-requests", "1", "--num-prompts", "2", "--output-len", "4"])
    assert rc == 0
    r = _load(next(tmp_path.glob("structured-structured-tiny*.json")))
    s = r["summary"]
    assert r["tokenizer"] == "smollm2-135m-instruct" and s["batch"] == 2
    assert s["plain_step_ms"] > 0 and s["mask_fill_ms_mean"] > 0
    plain, grammar = r["results"]["plain"][0], r["results"]["json"][0]
    assert plain["full_batch_decode_steps"] > 0 and plain["mask_fill_ms_mean"] is None
    assert grammar["json_valid"] >= grammar["finished_by_grammar"]
    assert "with JSON-schema grammars" in capsys.readouterr().out


def test_throughput_and_latency_with_lora_adapters(tmp_path):
    """--num-loras: random adapters of the preset spread over the requests (every request runs with
    one: the slots were written for each), in throughput and latency."""
    rc = main(["bench", "throughput", "--workload", "tiny", "--device", "cpu", "--out", str(tmp_path),
               "--num-prompts", "6", "--output-len", "4:8", "--warmup-requests", "0", "--num-loras", "3",
               "--lora-rank", "4", "--tag", "lora"])
    assert rc == 0
    r = _load(tmp_path / "throughput-tiny+custom-lora.json")
    assert r["engine"]["loras"] == {"count": 3, "rank": 4}
    assert r["engine"]["config"]["enable_lora"] and r["engine"]["config"]["max_loras"] == 3
    assert r["summary"]["output_tokens"] == r["workload_tokens"]["output_tokens"]
    rc = main(["bench", "latency", "--workload", "latency-tiny", "--device", "cpu", "--out", str(tmp_path),
               "--repeat", "1", "--output-len", "4", "--num-loras", "1", "--tag", "lora"])
    assert rc == 0
    r = _load(tmp_path / "latency-latency-tiny+custom-lora.json")
    assert r["engine"]["loras"] == {"count": 1, "rank": 16} and r["summary"]["output_tokens"] == 4


def test_latency_with_fp8_weights_counts_their_bytes(tmp_path):
    """--quantization fp8: the engine runs FP8 linear weights and the roofline counts them at one
    byte each, so the same run's decode bytes per token are lower than bf16's."""
    runs = {}
    for tag, extra in (("plain", []), ("fp8", ["--quantization", "fp8"])):
        rc = main(["bench", "latency", "--workload", "latency-tiny", "--device", "cpu", "--out", str(tmp_path),
                   "--repeat", "1", "--output-len", "4", "--tag", tag, *extra])
        assert rc == 0
        runs[tag] = _load(tmp_path / f"latency-latency-tiny+custom-{tag}.json")
    assert runs["fp8"]["engine"]["config"]["quantization"] == "fp8"
    roof = [r["roofline"]["bytes"] for r in (runs["plain"], runs["fp8"])]
    assert roof[1] < roof[0]


def test_fp8_kv_cache_bytes_and_the_fp8_matmul_ceiling():
    """--kv-cache-dtype fp8 counts one byte per cached value, and with FP8 weights the linear
    layers' FLOPs go at the FP8 matmul rate when the ceilings have one (a prefill step)."""
    from tokenmill.bench.roofline import Ceilings, kv_dtype_bytes_of, step_floor
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import StepShape
    from tokenmill.models.config import arch_config_from_hf
    from tokenmill.models.presets import get_preset

    arch = arch_config_from_hf(get_preset("llama-3.1-8b"))
    assert kv_dtype_bytes_of(EngineConfig(kv_cache_dtype="fp8")) == 1 and kv_dtype_bytes_of(EngineConfig()) is None
    decode = StepShape(query_lens=[1] * 64, seq_lens=[2048] * 64)
    ceil = Ceilings("cuda", "x", 4.0e12, 700e12, "bfloat16", "-", None)
    full, fp8kv = (step_floor(decode, arch, 2, ceil, "as-run", None, kv) for kv in (None, 1))
    kv_bytes_bf16 = 64 * 2049 * 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    assert abs((full.bytes - fp8kv.bytes) - kv_bytes_bf16 / 2) < 1e-3 * kv_bytes_bf16
    prefill = StepShape(query_lens=[8192], seq_lens=[8192])
    slow = step_floor(prefill, arch, 2, ceil, "as-run", 1.0)
    fast = step_floor(prefill, arch, 2, Ceilings("cuda", "x", 4.0e12, 700e12, "bfloat16", "-", 1400e12),
                      "as-run", 1.0)
    assert slow.flops == fast.flops and 0.5 * slow.seconds < fast.seconds < 0.75 * slow.seconds
