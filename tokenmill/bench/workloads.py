"""The standard workloads of BENCHMARKS.md, by name, and custom workloads from flags.

Request generation follows the nano-vllm README benchmark exactly (the order of the `randint`
calls matters): with Python's global `random` seeded once,

    prompt_token_ids = [[randint(0, 10000) for _ in range(randint(100, max_input_len))]
                        for _ in range(num_seqs)]
    max_tokens = [randint(100, max_output_len) for _ in range(num_seqs)]

i.e. all prompts first (for each request: its length, then its ids), then all output lengths.
With seed 0 this gives 133,966 output tokens for offline-small (256 requests, 100..1024 / 100..1024)
and 37,032 for offline-8b (128 requests, 100..1024 / 100..512); tests/bench checks both.

Multi-turn workloads (`turns` > 1, `tokenmill bench multiturn`): num_requests conversations, each
a shared system prompt of system_len tokens, then `turns` user turns (input_len) each answered by
output_len tokens; turn t resends the whole history (system, every earlier user turn and answer)
plus its new user turn, as a chat client does. The answers in the history are drawn here, not the
model's (dummy weights say nothing), so the requests do not depend on what was generated.

We use a private `random.Random(seed)` instead of the global generator: the sequence is the same
(the global functions are bound methods of one Random instance) and nobody else's state is touched.
Token ids are drawn from 0..min(10000, vocab_size - 1) so tiny test vocabularies work; for every
real preset the upper bound is 10000, as in nano-vllm.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Optional

from tokenmill.models.presets import PRESETS


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0  # seconds after the start (serve workloads); 0 = all at once


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # a preset name (dummy weights) or a model path
    num_requests: int
    input_len: tuple[int, int]  # inclusive range; (n, n) = fixed length
    output_len: tuple[int, int]
    dtype: str = "bfloat16"
    load_format: str = "dummy"
    seed: int = 0
    max_token_id: int = 10000
    temperature: float = 0.6
    request_rate: Optional[float] = None  # requests/s, Poisson; None or inf = all at once
    expected_output_tokens: Optional[int] = None
    description: str = ""
    # Engine options this workload needs (merged under the user's flags).
    engine_overrides: dict = field(default_factory=dict)
    # Multi-turn conversations (bench multiturn): turns per conversation, the shared system prompt's
    # length, and conversations in flight at once (each sends its next turn when its answer is done).
    turns: int = 1
    system_len: int = 0
    concurrency: Optional[int] = None

    def to_dict(self) -> dict:
        d = {"name": self.name, "model": self.model, "num_requests": self.num_requests,
             "input_len": list(self.input_len), "output_len": list(self.output_len), "dtype": self.dtype,
             "load_format": self.load_format, "seed": self.seed, "max_token_id": self.max_token_id,
             "temperature": self.temperature, "request_rate": self.request_rate,
             "expected_output_tokens": self.expected_output_tokens, "description": self.description}
        if self.turns > 1:
            d.update(turns=self.turns, system_len=self.system_len, concurrency=self.concurrency)
        return d


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("offline-small", "qwen3-0.6b", 256, (100, 1024), (100, 1024), expected_output_tokens=133_966,
             description="Qwen3-0.6B architecture, dummy weights, the nano-vllm README benchmark"),
    Workload("offline-8b", "llama-3.1-8b", 128, (100, 1024), (100, 512), expected_output_tokens=37_032,
             description="Llama-3.1-8B architecture, dummy weights, same generator"),
    Workload("latency-8b", "llama-3.1-8b", 1, (128, 128), (256, 256),
             description="decode time per token at batch 1"),
    Workload("serve-8b", "llama-3.1-8b", 500, (100, 1024), (100, 512), request_rate=8.0,
             description="500 requests with Poisson arrivals through the HTTP server"),
    Workload("prefill-8b", "llama-3.1-8b", 8, (4096, 4096), (1, 1),
             description="8 prompts of 4096 tokens, 1 output token: prefill rate"),
    Workload("offline-70b", "llama-3.1-70b", 128, (100, 1024), (100, 512), expected_output_tokens=37_032,
             description="Llama-3.1-70B architecture, dummy weights, offline-8b's requests (tensor parallel)"),
    Workload("latency-70b", "llama-3.1-70b", 1, (128, 128), (256, 256),
             description="decode time per token at batch 1, Llama-3.1-70B architecture (tensor parallel)"),
    # Mixture of experts: Qwen3-30B-A3B's shape with the 8B workloads' requests, so the figures compare.
    Workload("latency-moe", "qwen3-30b-a3b", 1, (128, 128), (256, 256), expected_output_tokens=256,
             description="decode time per token at batch 1, Qwen3-30B-A3B architecture (128 experts, top 8)"),
    Workload("offline-moe", "qwen3-30b-a3b", 128, (100, 1024), (100, 512), expected_output_tokens=37_032,
             description="Qwen3-30B-A3B architecture, dummy weights, offline-8b's requests"),
    # Gemma 3 27B: five sliding-window layers (1024 tokens) to each global one; the 8B workloads' requests.
    Workload("latency-gemma", "gemma-3-27b", 1, (128, 128), (256, 256), expected_output_tokens=256,
             description="decode time per token at batch 1, Gemma 3 27B architecture"),
    Workload("offline-gemma", "gemma-3-27b", 128, (100, 1024), (100, 512), expected_output_tokens=37_032,
             description="Gemma 3 27B architecture, dummy weights, offline-8b's requests"),
    # gpt-oss-20b's shape (32 experts, top 4, sinks, alternating 128-token windows), the same requests.
    Workload("latency-gpt-oss", "gpt-oss-20b", 1, (128, 128), (256, 256), expected_output_tokens=256,
             description="decode time per token at batch 1, gpt-oss-20b architecture (32 experts, top 4)"),
    Workload("offline-gpt-oss", "gpt-oss-20b", 128, (100, 1024), (100, 512), expected_output_tokens=37_032,
             description="gpt-oss-20b architecture, dummy weights, offline-8b's requests"),
    # DeepSeek-V2-Lite (multi-head latent attention, 64 experts top 6): the 8B workloads' requests.
    Workload("latency-deepseek", "deepseek-v2-lite", 1, (128, 128), (256, 256), expected_output_tokens=256,
             description="decode time per token at batch 1, DeepSeek-V2-Lite architecture (MLA, 64 experts, top 6)"),
    Workload("offline-deepseek", "deepseek-v2-lite", 128, (100, 1024), (100, 512), expected_output_tokens=37_032,
             description="DeepSeek-V2-Lite architecture, dummy weights, offline-8b's requests"),
    Workload("structured-small", "qwen3-0.6b", 64, (128, 128), (128, 128), temperature=1.0,
             description="batch 64 with and without JSON-schema grammars (bench structured)"),
    Workload("structured-tiny", "smollm2-135m", 4, (16, 16), (8, 8), dtype="auto", temperature=1.0,
             expected_output_tokens=None, description="bench structured on the CPU (tests)"),
    Workload("tiny", "tiny-llama", 8, (16, 64), (8, 32), dtype="auto", expected_output_tokens=None,
             description="a few short requests on the tiny-llama preset, for the CPU CI test"),
    Workload("tiny-moe", "tiny-qwen3-moe", 8, (16, 64), (8, 32), dtype="auto",
             description="a few short requests on the tiny-qwen3-moe preset (CPU tests of the MoE paths)"),
    Workload("latency-tiny", "tiny-llama", 1, (32, 32), (32, 32), dtype="auto",
             description="batch-1 latency on the tiny-llama preset (CPU tests)"),
    # Chat clients resending their growing history: 64 conversations of 8 turns end near 2,000
    # tokens each, a prefix working set of about 130k tokens (bench multiturn --working-set-ratio
    # sizes the GPU KV cache to a fraction of it, so prefixes must come back from the host tier).
    Workload("multiturn-8b", "llama-3.1-8b", 64, (64, 192), (64, 128), turns=8, system_len=256, concurrency=8,
             description="64 conversations x 8 turns resending their history, 8 in flight (bench multiturn)"),
    Workload("multiturn-tiny", "tiny-llama", 6, (8, 24), (4, 8), dtype="auto", turns=3, system_len=16,
             concurrency=2, description="bench multiturn on the tiny-llama preset (CPU tests)"),
]}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; workloads: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def parse_range(text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '100:1024' or '100..1024' -> (100, 1024)."""
    text = str(text).strip().replace("..", ":")
    lo, _, hi = text.partition(":")
    lo_i = int(lo)
    hi_i = int(hi) if hi else lo_i
    if lo_i < 1 or hi_i < lo_i:
        raise ValueError(f"bad length range {text!r}: need 1 <= lo <= hi")
    return lo_i, hi_i


def custom_workload(base: Optional[Workload], *, model: Optional[str] = None, num_prompts: Optional[int] = None,
                    input_len: Optional[str] = None, output_len: Optional[str] = None, seed: Optional[int] = None,
                    request_rate: Optional[float] = None, load_format: Optional[str] = None,
                    dtype: Optional[str] = None) -> Workload:
    """A workload from flags, starting from `base` (or offline-small's shape) and overriding what is given."""
    w = base or replace(WORKLOADS["offline-small"], name="custom", expected_output_tokens=None, description="custom")
    changes: dict = {}
    if model is not None and model != w.model:
        changes["model"] = model
        if load_format is None:
            changes["load_format"] = "dummy" if model.lower() in PRESETS else "auto"
    if load_format is not None:
        changes["load_format"] = load_format
    if dtype is not None:
        changes["dtype"] = dtype
    if num_prompts is not None:
        changes["num_requests"] = num_prompts
    if input_len is not None:
        changes["input_len"] = parse_range(input_len)
    if output_len is not None:
        changes["output_len"] = parse_range(output_len)
    if seed is not None:
        changes["seed"] = seed
    if request_rate is not None:
        changes["request_rate"] = request_rate
    shape_keys = {"model", "num_requests", "input_len", "output_len", "seed"}
    if shape_keys & set(changes):  # a different request set: the name and the expected total no longer hold
        changes["expected_output_tokens"] = None
        if base is not None and not base.name.endswith("+custom"):
            changes["name"] = base.name + "+custom"
    return replace(w, **changes) if changes else w


def generate_requests(w: Workload, vocab_size: Optional[int] = None) -> list[BenchRequest]:
    """The workload's requests, in the nano-vllm generation order (see the module docstring)."""
    rng = random.Random(w.seed)
    top = w.max_token_id if vocab_size is None else min(w.max_token_id, vocab_size - 1)
    (in_lo, in_hi), (out_lo, out_hi) = w.input_len, w.output_len
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(in_lo, in_hi))] for _ in range(w.num_requests)]
    outputs = [rng.randint(out_lo, out_hi) for _ in range(w.num_requests)]
    arrivals = poisson_arrivals(w.num_requests, w.request_rate, w.seed)
    return [BenchRequest(p, o, a) for p, o, a in zip(prompts, outputs, arrivals)]


def poisson_arrivals(n: int, rate: Optional[float], seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process at `rate` req/s, first at 0; all 0 when rate is None/inf.

    Drawn from its own generator (seed + 1), so the request contents do not depend on the rate."""
    if rate is None or rate == float("inf") or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, times = 0.0, []
    for i in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def warmup_requests(w: Workload, vocab_size: Optional[int], count: int = 8, max_tokens: int = 16) -> list[BenchRequest]:
    """Requests of the workload's shape but with other token ids (seed + 12345), so that the warm-up
    leaves nothing in the prefix cache that the timed run could hit."""
    rng = random.Random(w.seed + 12345)
    top = w.max_token_id if vocab_size is None else min(w.max_token_id, vocab_size - 1)
    (in_lo, in_hi), (out_lo, out_hi) = w.input_len, w.output_len
    n = max(1, min(count, w.num_requests))
    return [BenchRequest([rng.randint(0, top) for _ in range(rng.randint(in_lo, in_hi))],
                         min(max_tokens, rng.randint(out_lo, out_hi))) for _ in range(n)]


def generate_conversations(w: Workload, vocab_size: Optional[int] = None) -> list[list[BenchRequest]]:
    """The multi-turn workload's conversations: for each, its turns in order, each prompt the whole
    history so far plus the new user turn (see the module docstring)."""
    rng = random.Random(w.seed)
    top = w.max_token_id if vocab_size is None else min(w.max_token_id, vocab_size - 1)
    (in_lo, in_hi), (out_lo, out_hi) = w.input_len, w.output_len
    system = [rng.randint(0, top) for _ in range(w.system_len)]  # one system prompt for every conversation
    conversations = []
    for _ in range(w.num_requests):
        history, turns = list(system), []
        for _ in range(w.turns):
            history += [rng.randint(0, top) for _ in range(rng.randint(in_lo, in_hi))]
            answer = [rng.randint(0, top) for _ in range(rng.randint(out_lo, out_hi))]
            turns.append(BenchRequest(list(history), len(answer)))
            history += answer
        conversations.append(turns)
    return conversations


def summarize(requests: list[BenchRequest]) -> dict:
    return {"num_requests": len(requests),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests)}
