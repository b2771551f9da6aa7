"""What structured output costs a step: one batch with and without JSON-schema grammars, side by side.

The workload's requests (structured-small: 64 requests of 128 random prompt tokens, up to 128
output tokens, sampled at temperature 1 with seeds, EOS ignored) run as one batch, twice per repeat
and alternating: plainly, then each request with a JSON schema of a fixed mix (open-ended objects
and arrays whose minimum lengths the run cannot reach, so no grammar completes and the batch stays
whole). Every step is timed (bench/step_timer.py); the figure compared is the mean time of the
decode steps that hold the whole batch (every request decoding one token), so both runs are
measured at the same batch size even when a grammar ends some requests early. The ratio of the two
means is the cost of grammars per step: mask filling on the host (overlapped with the forward pass),
the mask copy, the bitmask kernel and the float32 logits copy the sampler's stages work on.

The host time the matchers take to fill each step's masks is measured too (StructuredOutputManager
.bitmask wrapped on the instance), and every grammar output is checked to parse as JSON and to be a
prefix of valid JSON when cut by max_tokens (xgrammar only lets valid tokens through).

A dummy preset has no tokenizer, and a grammar needs one: `--tokenizer` (a LoadConfig option) gives
one (the workload's default is the embedded model's); ids past its vocabulary are never allowed.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from tokenmill.bench import report
from tokenmill.bench.common import build_engine, median_index, reset_prefix_cache, resolve_workload, synchronize
from tokenmill.bench.step_timer import StepKinds, StepTimer
from tokenmill.bench.workloads import generate_requests

_TEXT = {"type": "string"}
# Arrays with a minimum length that 128 tokens cannot reach: no grammar completes within the run,
# so the batch stays whole and both runs are compared at the same batch size.
SCHEMA_MIX = [
    {"type": "object", "properties": {"notes": {"type": "array", "items": _TEXT, "minItems": 100}},
     "required": ["notes"]},
    {"type": "object", "properties": {"name": _TEXT, "age": {"type": "integer"},
                                      "tags": {"type": "array", "items": _TEXT, "minItems": 100}},
     "required": ["name", "age", "tags"]},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}, "text": _TEXT},
                                "required": ["id", "text"]}, "minItems": 40},
    {"type": "object", "properties": {"title": _TEXT, "score": {"type": "number"},
                                      "refs": {"type": "array", "items": {"type": "integer"}, "minItems": 100}},
     "required": ["title", "score", "refs"]},
]


def _params(w, max_tokens: int, i: int, grammar: bool):
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.structured_outputs import StructuredOutputsParams

    spec = StructuredOutputsParams(json=SCHEMA_MIX[i % len(SCHEMA_MIX)]) if grammar else None
    return SamplingParams(temperature=w.temperature, seed=i, max_tokens=max_tokens, ignore_eos=True,
                          structured_outputs=spec)


def _time_calls(obj, name: str) -> list[float]:
    """Wrap obj.name on the instance; the list gets each call's seconds (`del obj.name` undoes it)."""
    original, seconds = getattr(obj, name), []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    setattr(obj, name, timed)
    return seconds


def _run_batch(engine, requests, w, grammar: bool) -> dict:
    """One timed batch; the whole-batch decode steps' times and the host mask-filling times."""
    batch = len(requests)
    # Host time of the masks' filling, and of the engine taking a step's output (both on a grammar
    # step's critical path), by wrapping the bound methods on the instances.
    fill_s = _time_calls(engine.structured, "bitmask")
    process_s = _time_calls(engine, "_process")
    reset_prefix_cache(engine)
    engine.step_log = []
    kinds = StepKinds(engine).install()
    timer = StepTimer(engine).install()
    synchronize(engine.loaded.device)
    start = time.perf_counter()
    ids = [engine.add_request(None, _params(w, r.max_tokens, i, grammar), prompt_ids=r.prompt_token_ids)
           for i, r in enumerate(requests)]
    outputs = {}
    try:
        while engine.has_unfinished_requests():
            for out in engine.step(emit_unfinished=False):
                outputs[out.request_id] = out
    finally:
        elapsed = time.perf_counter() - start
        timer.uninstall()
        step_kinds = kinds.uninstall()
        del engine.structured.bitmask  # back to the class's methods
        del engine._process
    steps, engine.step_log = engine.step_log, None
    seconds = timer.step_seconds()
    full = [s for s, shape, kind in zip(seconds, steps, step_kinds)
            if kind == "decode" and len(shape.query_lens) == batch]
    texts = [outputs[i].outputs[0].text for i in ids]
    tokens = sum(len(outputs[i].outputs[0].token_ids) for i in ids)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "num_steps": len(steps),
            "full_batch_decode_steps": len(full),
            "full_batch_step_ms_mean": 1e3 * float(np.mean(full)) if full else None,
            "full_batch_step_ms_median": 1e3 * float(np.median(full)) if full else None,
            "mask_fill_ms_mean": 1e3 * float(np.mean(fill_s)) if fill_s else None,
            "mask_fill_ms_p99": 1e3 * float(np.percentile(fill_s, 99)) if fill_s else None,
            "process_output_ms_mean": 1e3 * float(np.mean(process_s)) if process_s else None,
            "finished_by_grammar": sum(outputs[i].outputs[0].finish_reason == "stop" for i in ids),
            "texts": texts if grammar else None}


def _check_json(texts: list[str], finished: int) -> int:
    """How many outputs parse as JSON (those the grammar completed must)."""
    ok = 0
    for text in texts:
        try:
            json.loads(text)
            ok += 1
        except ValueError:
            pass
    if ok < finished:
        raise AssertionError(f"{finished} grammar outputs finished but only {ok} parse as JSON")
    return ok


def run(args, log=None) -> dict:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    w = resolve_workload(args, "structured-small")
    if getattr(args, "tokenizer", None) is None:
        args.tokenizer = "smollm2-135m-instruct"
    engine = build_engine(args, w)
    if engine.tokenizer is None:
        raise SystemExit("structured output needs a tokenizer: pass --tokenizer")
    if args.grammar_threads is not None:
        engine.structured.fill_threads = args.grammar_threads
    requests = generate_requests(w, engine.loaded.arch.vocab_size)
    for grammar in (False, True):  # warm-up: kernels, graphs, grammar compilation
        _run_batch(engine, requests[: max(1, min(args.warmup_requests, len(requests)))], w, grammar)
    runs = {"plain": [], "json": []}
    for i in range(args.repeat):
        for name in ("plain", "json"):
            r = _run_batch(engine, requests, w, name == "json")
            if r["texts"] is not None:
                r["json_valid"] = _check_json(r.pop("texts"), r["finished_by_grammar"])
            else:
                r.pop("texts")
            runs[name].append(r)
            mean = r["full_batch_step_ms_mean"]
            log(f"run {i + 1}/{args.repeat} {name}: {r['full_batch_decode_steps']} whole-batch decode steps, "
                f"mean {mean if mean is None else round(mean, 3)} ms"
                + (f", mask fill {r['mask_fill_ms_mean']:.3f} ms/step" if r["mask_fill_ms_mean"] else "")
                + f", output processing {r['process_output_ms_mean']:.3f} ms/step")
    med = {name: runs[name][median_index([r["full_batch_step_ms_mean"] or 0.0 for r in rs])]
           for name, rs in runs.items()}
    plain_ms, json_ms = med["plain"]["full_batch_step_ms_mean"], med["json"]["full_batch_step_ms_mean"]
    ratio = json_ms / plain_ms if plain_ms and json_ms else None
    result = report.metadata("structured")
    result.update({
        "tag": args.tag, "workload": w.to_dict(), "model": w.model, "tokenizer": args.tokenizer,
        "dtype": str(engine.loaded.dtype).replace("torch.", ""), "device": str(engine.loaded.device),
        "repeat": args.repeat, "schemas": SCHEMA_MIX, "grammar_threads": engine.structured.fill_threads,
        "engine": {"config": vars(engine.config).copy()},
        "results": runs,
        "summary": {"batch": len(requests), "plain_step_ms": plain_ms, "json_step_ms": json_ms,
                    "ratio": ratio,
                    "plain_step_ms_runs": [r["full_batch_step_ms_mean"] for r in runs["plain"]],
                    "json_step_ms_runs": [r["full_batch_step_ms_mean"] for r in runs["json"]],
                    "mask_fill_ms_mean": med["json"]["mask_fill_ms_mean"],
                    "mask_fill_ms_p99": med["json"]["mask_fill_ms_p99"],
                    "process_output_ms_plain": med["plain"]["process_output_ms_mean"],
                    "process_output_ms_json": med["json"]["process_output_ms_mean"],
                    "json_valid": med["json"].get("json_valid"),
                    "finished_by_grammar": med["json"]["finished_by_grammar"]},
    })
    return result


def print_summary(result: dict, out=None) -> None:
    out = out or sys.stdout
    s = result["summary"]
    fmt = (lambda v: "n/a" if v is None else f"{v:.3f}")
    print(f"{result['workload']['name']} ({result['model']}, batch {s['batch']}, {result['dtype']}): whole-batch "
          f"decode step {fmt(s['plain_step_ms'])} ms plain, {fmt(s['json_step_ms'])} ms with JSON-schema grammars "
          f"(ratio {fmt(s['ratio'])}, median of {result['repeat']}); masks filled on the host in "
          f"{fmt(s['mask_fill_ms_mean'])} ms per step (p99 {fmt(s['mask_fill_ms_p99'])}); "
          f"{s['json_valid']} outputs parse as JSON, {s['finished_by_grammar']} completed by the grammar", file=out)
