"""Speculative decoding on a prompt-copying workload, against plain decoding, side by side in one
process: the embedded model (or --model), one request at a time, greedy. For each method (n-gram
prompt lookup, the layer-truncated self-draft, the target as its own draft model) reports
acceptance rate, tokens per verifying step, steps, ms per output token and whether the tokens equal
plain decoding's.

    python benchmarks/spec_decode_copying.py [--model PATH] [--device cpu|cuda] [--dtype float32]
        [--max-tokens 64] [--k 3] [--draft-layers 8,16] [--methods ngram,layer_truncated,draft_model] [--out FILE]
"""

import argparse
import time

from _report import emit

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.loader.resolve import embedded_model_path
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


def spec_config(method: str, args) -> dict:
    cfg = {"method": method, "num_speculative_tokens": args.k}
    if method == "ngram":
        cfg.update(prompt_lookup_max=4, prompt_lookup_min=2)
    elif method.startswith("layer_truncated"):
        cfg.update(method="layer_truncated", num_draft_layers=int(method.split(":")[1]))
    elif method == "draft_model":
        cfg["model"] = args.model or embedded_model_path()  # the target as its own draft
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="target model (default: the embedded one)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft-layers", default="8", help="layer_truncated: the target's first N layers (a comma-"
                                                         "separated list runs each)")
    ap.add_argument("--methods", default="ngram,layer_truncated", help="comma-separated: ngram, layer_truncated, "
                                                                       "draft_model (the target drafting itself)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine_args = dict(max_num_seqs=1, max_model_len=2048, num_kv_blocks=512)  # several engines share a GPU
    base = LLMEngine(args.model, EngineConfig(**engine_args), dtype=args.dtype, device=args.device)
    tok = base.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    plain_llm = LLM.from_engine(base)
    run(plain_llm, prompts[:1], params)  # warm-up
    plain = run(plain_llm, prompts, params)
    result = {"device": args.device, "dtype": args.dtype, "k": args.k, "max_tokens": args.max_tokens,
              "prompts": len(prompts), "plain": plain}
    methods = []
    for method in args.methods.split(","):
        methods += [f"{method}:{n}" for n in args.draft_layers.split(",")] if method == "layer_truncated" else [method]
    for method in methods:
        spec = LLMEngine(config=EngineConfig(**engine_args, speculative_config=spec_config(method, args)),
                         loaded=base.loaded)
        spec_llm = LLM.from_engine(spec)
        run(spec_llm, prompts[:1], params)  # warm-up
        spec.spec_stats = type(spec.spec_stats)(args.k)
        r = run(spec_llm, prompts, params)
        r["speedup"] = round(plain["ms_per_output_token"] / r["ms_per_output_token"], 2)
        r["same_tokens"] = r.pop("token_ids") == plain["token_ids"]
        result[method] = r
        del spec_llm, spec
    plain.pop("token_ids")
    emit(result, args.out)


if __name__ == "__main__":
    main()
