"""How long a running stream waits while a long prompt arrives, on the CPU with the embedded model:
one request decodes; after a few of its tokens a prompt of N tokens is added; the stream's longest
gap between two tokens until the long prompt's first token is reported, with the prefill time.

    python benchmarks/cpu_stream_gap.py [--prompt-tokens 8001] [--cap N] [--out FILE]

--cap sets max_prefill_tokens_with_decodes (default: the engine's CPU default).
"""

import argparse
import time

from _report import emit

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


def measure(engine: LLMEngine, prompt_tokens: int) -> dict:
    vocab = engine.loaded.arch.vocab_size
    stream = engine.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
    times, long_id, added, first_long = [], None, None, None
    while first_long is None:
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id == stream:
                times.append(now)
            elif out.request_id == long_id and out.outputs[0].token_ids:
                first_long = now
        if long_id is None and len(times) >= 4:
            long_id = engine.add_request([(7 * i) % vocab for i in range(prompt_tokens)],
                                         SamplingParams(temperature=0, max_tokens=1))
            added = time.perf_counter()
    engine.abort_request(stream)
    while engine.has_unfinished_requests():
        engine.step()
    during = [b - a for a, b in zip(times, times[1:]) if b > added]
    return {"prompt_tokens": prompt_tokens, "prefill_s": round(first_long - added, 2),
            "stream_tokens_during_prefill": len(during), "longest_gap_s": round(max(during, default=0.0), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=8001)
    ap.add_argument("--cap", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    config = EngineConfig(max_num_seqs=4,
                          max_prefill_tokens_with_decodes=args.cap, enable_prefix_caching=False)
    engine = LLMEngine(None, config, dtype="float32", device="cpu")
    result = {"cap": engine.scheduler.limits.max_prefill_tokens_with_decodes, **measure(engine, args.prompt_tokens)}
    emit(result, args.out)


if __name__ == "__main__":
    main()
