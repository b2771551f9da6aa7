"""Speculative decoding with n-gram drafts on a prompt-copying workload, against plain decoding,
side by side in one process: the embedded model (fp32, CPU by default), one request at a time,
greedy. Reports acceptance rate, tokens per verifying step and ms per output token for both.

    python benchmarks/spec_decode_cpu.py [--max-tokens 64] [--k 3] [--device cpu] [--out FILE]
"""

import argparse
import time

from _report import emit

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

PASSAGE = ("The river rises in the northern hills, runs south through three market towns, and reaches the "
           "sea at a wide, shallow estuary where herons feed at low tide.")
CODE = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n"
PROMPTS = [
    f"Repeat this passage word for word:\n\n{PASSAGE}",
    f"Copy this code exactly, then stop:\n\n{CODE}",
    f"Rewrite this passage, changing 'river' to 'stream' and nothing else:\n\n{PASSAGE}",
    f"Rename the function 'area' to 'rect_area' in this code and print the whole code:\n\n{CODE}",
    "Write the list 'alpha, beta, gamma, delta' five times, one per line.",
    "Copy this sentence exactly: The cat sat on the mat. The cat sat on the mat. The cat sat on the mat.",
]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    engine = llm.engine
    tokens = steps = 0
    outputs = []
    started = time.perf_counter()
    for ids in prompts:
        before = engine.steps_completed
        out = llm.generate([ids], params, use_tqdm=False)[0]
        outputs.append(out.outputs[0].token_ids)
        tokens += len(out.outputs[0].token_ids)
        steps += engine.steps_completed - before
    seconds = time.perf_counter() - started
    result = {"output_tokens": tokens, "steps": steps, "seconds": round(seconds, 3), "token_ids": outputs,
              "ms_per_output_token": round(1e3 * seconds / tokens, 2)}
    if engine.spec_stats is not None:
        s = engine.spec_stats
        result.update(acceptance_rate=round(s.acceptance_rate, 3), tokens_per_verify_step=round(s.mean_accepted_length, 2),
                      accepted_by_position=[round(n / max(s.verify_steps, 1), 3) for n in s.accepted_at])
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = LLMEngine(None, EngineConfig(max_num_seqs=1), dtype=args.dtype, device=args.device)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    spec = LLMEngine(config=EngineConfig(max_num_seqs=1, speculative_config=spec_cfg), loaded=base.loaded)
    tok = base.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    plain_llm, spec_llm = LLM.from_engine(base), LLM.from_engine(spec)
    run(plain_llm, prompts[:1], params)  # warm both up
    run(spec_llm, prompts[:1], params)
    spec.spec_stats = type(spec.spec_stats)(args.k)
    result = {"device": args.device, "dtype": args.dtype, "k": args.k, "max_tokens": args.max_tokens,
              "prompts": len(prompts), "plain": run(plain_llm, prompts, params), "ngram": run(spec_llm, prompts, params)}
    result["speedup"] = round(result["plain"]["ms_per_output_token"] / result["ngram"]["ms_per_output_token"], 2)
    result["same_tokens"] = result["plain"].pop("token_ids") == result["ngram"].pop("token_ids")
    emit(result, args.out)


if __name__ == "__main__":
    main()
