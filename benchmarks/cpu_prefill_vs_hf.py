"""CPU prefill: tokenmill against HF transformers on the same weights, in one process.

Both load the embedded default (SmolLM2-135M-Instruct GGUF) in fp32 on the CPU; each times a
1-token greedy generation from a prompt of exactly N tokens (random ids), prefix caching off.
tokenmill runs with the default step budget (8192 tokens: one step for any prompt the 8192-token
context allows; the longest that leaves room for the generated token is 8191) and also with a
smaller budget (--chunked-budget, default 2048), which splits the prompt into chunked-prefill
steps. HF and the engines run in turn for --repeat rounds, so that load from other processes falls
on all alike; ratios are of the minimum times (and of the medians).

    python benchmarks/cpu_prefill_vs_hf.py --lengths 1024 8191 --out cpu_prefill.json
    python benchmarks/cpu_prefill_vs_hf.py --lengths 1024 --profile   # where tokenmill's time goes
"""

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import statistics
import subprocess
import time

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("cpu_prefill_vs_hf")
DEFAULT_BUDGET = EngineConfig.max_num_batched_tokens


def tokenmill_llm(budget: int, max_len: int) -> LLM:
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=1, enable_prefix_caching=False,
                          num_kv_blocks=max_len // 16 + 2)
    return LLM.from_engine(LLMEngine(None, config, dtype="float32", device="cpu"))


def hf_model():
    from transformers import AutoModelForCausalLM

    from tokenmill.loader.resolve import embedded_model_path

    path = embedded_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def time_tokenmill(llm: LLM, ids: list[int]) -> float:
    t0 = time.perf_counter()
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert len(out[0].outputs[0].token_ids) == 1
    return elapsed


@torch.inference_mode()
def time_hf(model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False, pad_token_id=2)
    return time.perf_counter() - t0


def profile_tokenmill(llm: LLM, ids: list[int], top: int = 30) -> str:
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def summary(times: list[float]) -> dict:
    return {"min_s": min(times), "median_s": statistics.median(times), "runs_s": times}


def measure(n: int, hf, llms: dict, repeat: int, gen: torch.Generator) -> dict:
    """Runs of HF and of each tokenmill engine in turn, `repeat` rounds (so that load from other
    processes falls on all alike); the minimum is the figure least disturbed by it."""
    ids = torch.randint(10, 49000, (n,), generator=gen).tolist()
    times = {name: [] for name in ["hf", *llms]}
    for _ in range(repeat):
        times["hf"].append(time_hf(hf, ids))
        for name, llm in llms.items():
            times[name].append(time_tokenmill(llm, ids))
    row = {"prompt_tokens": n, **{name: summary(t) for name, t in times.items()}}
    for name in llms:
        row[f"ratio_{name}"] = row[name]["min_s"] / row["hf"]["min_s"]
        row[f"ratio_{name}_median"] = row[name]["median_s"] / row["hf"]["median_s"]
    return row


def run(lengths: list[int], repeat: int, profile: bool, chunked_budget: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    warm = torch.randint(10, 49000, (32,), generator=gen).tolist()
    hf = hf_model()
    time_hf(hf, warm)
    longest = max(lengths) + 16
    # The default budget holds any prompt the context allows: one step. Also a chunked prefill.
    llms = {"tokenmill": tokenmill_llm(DEFAULT_BUDGET, longest)}
    if chunked_budget:
        llms[f"tokenmill_chunked_{chunked_budget}"] = tokenmill_llm(chunked_budget, longest)
    for llm in llms.values():
        time_tokenmill(llm, warm)
    results = []
    for n in lengths:
        if profile:
            ids = torch.randint(10, 49000, (n,), generator=gen).tolist()
            logger.info("cProfile of tokenmill, %d tokens:\n%s", n, profile_tokenmill(llms["tokenmill"], ids))
        row = measure(n, hf, {k: v for k, v in llms.items() if k == "tokenmill" or chunked_budget < n}, repeat, gen)
        logger.info("%s", json.dumps(row))
        results.append(row)
    return {"commit": commit(), "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "load_avg_after": os.getloadavg(), "repeat": repeat, "default_budget": DEFAULT_BUDGET, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8191])
    ap.add_argument("--repeat", type=int, default=3, help="rounds of runs per prompt length")
    ap.add_argument("--chunked-budget", type=int, default=2048,
                    help="also time tokenmill with this step budget (chunked prefill); 0: not")
    ap.add_argument("--profile", action="store_true", help="log a cProfile of each tokenmill prefill")
    ap.add_argument("--out", help="write the JSON here as well")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = run(args.lengths, args.repeat, args.profile, args.chunked_budget)
    text = json.dumps(report, indent=1)
    logger.info("%s", text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
