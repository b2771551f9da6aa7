"""`tokenmill bench fidelity`: how far each engine configuration's outputs are from a float32 reference.

On a GPU, bf16, FP8 weights, FP8 KV cache and both, with HF transformers in bf16 beside:

    tokenmill bench fidelity --device cuda --candidates bf16,fp8,fp8-kv,fp8+fp8-kv --hf bf16 --out bench-results

(add `bf16-alone` to the candidates for batch invariance, `--hf-quantization fp8` for transformers'
FineGrainedFP8Config beside, `--tag NAME` to name the result file.) On the CPU the same command with
`--device cpu` works, slowly; FP8 weights are dequantized there.

What runs, in this order, every engine alone on the device (each freed before the next):

1. The prompt set: tokenmill/bench/data/fidelity_prompts.json (72 prompts written for this bench:
   24 chat conversations, 24 pieces of code to continue, 24 of prose), or `--prompts FILE`.
   Chat prompts are rendered through the model's chat template as `LLM.chat` does (generation
   prompt added, tokenized without special tokens); `--plain-chat`, or a model without a template,
   gives them as plain "role: content" lines instead. Code and prose are plain text, tokenized as
   `LLM.generate` does. `--num-prompts N` takes N of them, from the kinds in turn. Every engine and
   peer gets the same token ids (tokenized once, by the reference).
2. The reference: tokenmill with dtype float32 (no quantization, KV cache "auto"; every other
   engine flag as given), all prompts in one `generate` call, greedy, `--output-len` tokens
   (stopping at EOS unless `--ignore-eos`).
3. Teacher forcing: each prompt followed by the reference's output is given as a prompt with
   `prompt_logprobs=K` (K = MAX_LOGPROBS = 20, the API's most) and max_tokens=1, for the reference
   too. At the position before each reference output token we read the top K (and the logprob of
   the reference's token, which prompt logprobs always include).
4. Each candidate (an engine configuration, see --help: --candidates / --candidate): greedy
   generation and teacher forcing as for the reference, all prompts in one `generate` call
   ("batched") or each prompt by itself ("alone"). It has the engine flags given, with its own
   options over them (--dtype, --quantization and --kv-cache-dtype are thus the defaults of
   candidates that name none). A shorthand whose option this tokenmill lacks (fp8-kv before
   kv_cache_dtype existed) is skipped and reported; an unknown --candidate key is an error.
5. HF transformers peers (`--hf`, when transformers is installed): the same weights loaded from a
   safetensors directory (a GGUF model is the directory tokenmill's own GGUF reader and dequantizer
   write, loader/gguf_loader.py, with a config.json transformers reads; the `gguf` package is not
   needed), greedy per prompt alone with a KV cache, and one forward pass per teacher-forced
   sequence for the full logits.

Metrics of a candidate (or peer) against the reference, over the reference's output positions:

- greedy `token_agreement`: per prompt, the number of generated tokens equal to the reference's
  before the first difference, summed over prompts, over the total number of reference tokens;
  `prompts_identical`: the share of prompts whose output is exactly the reference's. Per-prompt
  counts are in the JSON.
- teacher-forced `top1_agreement`: the share of positions where the candidate's most likely token
  is the reference's most likely token (both from their own teacher-forced runs).
- `kl_coarse` (mean and max over positions; per-prompt means), KL(ref || cand) of coarsened
  next-token distributions, a guaranteed lower bound of the full KL. At each position the bins are
  the tokens whose reference probability is known (its top K and the teacher-forced token) plus
  one bin for all other tokens. The reference's bins are exact (the "rest" bin gets one minus the
  sum). Of the candidate, prompt logprobs report its top K and the teacher-forced token: a
  reference token missing from those has a candidate probability somewhere in [0, q_K] (q_K: the
  candidate's K-th largest probability), and the candidate's unreported tokens hold together
  F = 1 - (the sum of what it reported). kl_coarse is the smallest KL(ref bins || cand bins) over
  every candidate distribution consistent with what was reported: a small convex problem, solved
  exactly at each position (the unknown q_i = min(q_K, p_i / c), with c found by bisection from the
  optimality conditions). Hence kl_coarse <= the coarsened KL <= the full-vocabulary KL (merging
  tokens into a bin never increases KL: the log-sum inequality); it equals the coarsened KL
  whenever the candidate reports every token of the reference's top K. (The reported logprobs are
  float32: below about 1e-8 both KLs are rounding noise, and there the bound can exceed kl_exact.)
- `kl_exact` (mean, max, per-prompt means): the full-vocabulary KL(ref || cand) = sum over the
  vocabulary of p (log p - log q), from the log-softmax (float32; the sum in float64) of the very
  logits the engine computes its prompt logprobs from. The bench takes those rows with an
  instance-level wrapper of the engine's prompt-logprob computation (`FullLogprobsCapture`),
  which sees each slice of logits with the (request, position) of its rows; the engine's own
  results are untouched. The reference's rows are kept in host memory (positions x vocabulary x 4
  bytes: 72 x 64 x 49152 x 4 = 0.9 GB for the default run); each candidate's rows are compared to
  them on the device as they come and not kept. It needs the engine's runner in this process (not
  tensor or pipeline parallel: then null, logged), and `--no-exact-kl` turns it off. For HF peers
  kl_exact comes from their full logits against the same reference rows, and kl_coarse from their
  top K and teacher-forced token through the same coarsening: the gap between the two is the
  coarsening's.

Caveat: teacher forcing runs the output positions as prompt (prefill) tokens, so it measures the
prefill path; an FP8 KV cache shows there only as far as prefill attention reads K/V back from the
quantized cache (the CPU path does; a kernel that attends to a chunk's own fresh K/V shows it only
for earlier chunks). Greedy generation measures the decode path. `reference.
teacher_forced_argmax_equals_greedy` says how often the reference's own prefill argmax repeats its
decoded token (prefill and decode differ numerically even in float32).
"""

from __future__ import annotations

import dataclasses
import difflib
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from tokenmill.config import ConfigError
from tokenmill.logger import init_logger

logger = init_logger(__name__)

DEFAULT_PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "fidelity_prompts.json")
DEFAULT_OUTPUT_LEN = 64
DEFAULT_CANDIDATES = "bf16"
MODES = ("batched", "alone")

# Shorthand tokens of --candidates, joined with "+"; a name may end in -alone or -batched.
SHORTHANDS: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "float32"}, "float32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"}, "bfloat16": {"dtype": "bfloat16"},
    "fp16": {"dtype": "float16"}, "float16": {"dtype": "float16"}, "half": {"dtype": "float16"},
    "fp8": {"quantization": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"}, "kv-fp8": {"kv_cache_dtype": "fp8"},
    "bi": {"batch_invariant": True}, "batch-invariant": {"batch_invariant": True},
}
# The reference's own settings, whatever the flags say (those of fields this tokenmill has).
REFERENCE_OVERRIDES: dict[str, Any] = {"dtype": "float32", "quantization": None, "kv_cache_dtype": "auto",
                                       "batch_invariant": False}
# Shared by the reference and every candidate: what the model is and where it runs.
SHARED_OPTIONS = ("model", "load_format", "tokenizer", "device")
_HF_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
              "fp16": "float16", "float16": "float16", "half": "float16"}

KL_DEFINITION = (
    "kl_coarse: KL(ref || cand) over bins = the tokens whose reference logprob is known (its top K and the "
    "teacher-forced token) + one bin for all other tokens; the reference's bins are exact; a reference token "
    "missing from the candidate's reported top K (and teacher-forced token) gets the candidate probability in "
    "[0, q_K] (q_K: the candidate's K-th largest probability), with the candidate's unreported mass "
    "1 - sum(reported) shared between those and the rest bin, chosen to minimise the KL: the smallest KL of "
    "any candidate distribution consistent with what was reported, so kl_coarse <= coarsened KL <= full KL "
    "(a lower bound; equal to the coarsened KL when the candidate reports every reference top-K token). "
    "kl_exact: sum over the full vocabulary of p (log p - log q), from the full log-softmax of the logits the "
    "engine computes its prompt logprobs from (HF peers: their full logits), null where not captured.")


# ---- the prompt set ---------------------------------------------------------------------------------

def load_prompts(path: Optional[str] = None) -> tuple[str, list[dict]]:
    """(the set's name, its prompts) from a prompt file (default: the packaged one). A prompt is a
    dict with "id", "kind" and either "text" or "messages" (chat turns: role and content)."""
    path = path or DEFAULT_PROMPTS
    with open(path) as f:
        data = json.load(f)
    prompts = data["prompts"] if isinstance(data, dict) else data
    for i, p in enumerate(prompts):
        if not isinstance(p, dict) or ("text" in p) == ("messages" in p):
            raise ConfigError(f"{path}: prompt {i} needs exactly one of 'text' and 'messages'")
        p.setdefault("id", f"prompt-{i}")
        p.setdefault("kind", "chat" if "messages" in p else "text")
    name = data.get("name") if isinstance(data, dict) else None
    return name or os.path.splitext(os.path.basename(path))[0], prompts


def select_prompts(prompts: list[dict], n: Optional[int]) -> list[dict]:
    """The first n prompts taken from the kinds in turn (chat, code, prose, chat, ...), each kind in
    file order, so a small n still mixes them; all of them for n None."""
    if n is None or n >= len(prompts):
        return list(prompts)
    if n < 1:
        raise ConfigError(f"--num-prompts must be at least 1, got {n}")
    by_kind: dict[str, list[dict]] = {}
    for p in prompts:
        by_kind.setdefault(p["kind"], []).append(p)
    queues = [list(v) for v in by_kind.values()]
    chosen: list[dict] = []
    while len(chosen) < n:
        for q in queues:
            if q and len(chosen) < n:
                chosen.append(q.pop(0))
    return chosen


def _plain_chat(messages: list[dict]) -> str:
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


def tokenize_prompts(llm, prompts: list[dict], plain_chat: bool = False) -> tuple[list[list[int]], str]:
    """Token ids of every prompt with the engine's tokenizer, and how chat prompts were rendered
    ("chat template" or "plain"). A model without a tokenizer (a dummy preset without --tokenizer)
    gets each text's UTF-8 bytes modulo its vocabulary."""
    engine = llm.engine
    tok = engine.tokenizer
    templated = not plain_chat and tok is not None and bool(getattr(tok, "chat_template", None))
    if tok is None:
        logger.warning("the model has no tokenizer: prompts are their UTF-8 bytes modulo the vocabulary "
                       "(--tokenizer gives one)")
    ids = []
    for p in prompts:
        if "messages" in p and templated:
            text = llm.render_chat(p["messages"], add_generation_prompt=True)
            ids.append(engine.tokenize(text, add_special_tokens=False))
            continue
        text = _plain_chat(p["messages"]) if "messages" in p else p["text"]
        if tok is None:
            ids.append([b % engine.vocab_size for b in text.encode()])
        else:
            ids.append(engine.tokenize(text))
    return ids, ("chat template" if templated else "plain")


# ---- candidates -------------------------------------------------------------------------------------

@dataclass
class Candidate:
    name: str
    options: dict = field(default_factory=dict)  # LLM(...) keywords: dtype, quantization, kv_cache_dtype, ...
    mode: str = "batched"
    from_shorthand: bool = False


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets and quotes (a value may be JSON)."""
    parts, depth, quote, cur = [], 0, None, []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _value(text: str) -> Any:
    """A KEY=VALUE value: none/null, true/false, a number or JSON where it parses, else the string."""
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    try:
        return json.loads(text)
    except ValueError:
        return text.strip()


def parse_candidates(text: Optional[str]) -> list[Candidate]:
    """--candidates: comma-separated names made of shorthand tokens joined by "+" (fp32, bf16, fp16,
    fp8 = FP8 weights, fp8-kv = FP8 KV cache, bi = batch-invariant mode, alone / batched),
    optionally ending in -alone or -batched: "bf16,bf16-alone,fp8,fp8-kv,fp8+fp8-kv,bf16+bi"."""
    out = []
    for name in _split_top_level(text or ""):
        base, mode = name, "batched"
        for m in MODES:
            if base.endswith("-" + m):
                base, mode = base[: -len(m) - 1], m
        options: dict[str, Any] = {}
        for token in base.split("+"):
            token = token.strip().lower()
            if token in MODES:
                mode = token
            elif token in SHORTHANDS:
                options.update(SHORTHANDS[token])
            else:
                close = difflib.get_close_matches(token, list(SHORTHANDS) + list(MODES), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"unknown candidate token {token!r} in {name!r}{hint}; known: "
                                 f"{', '.join(list(SHORTHANDS) + list(MODES))}; or use --candidate KEY=VALUE,...")
        out.append(Candidate(name, options, mode, from_shorthand=True))
    return out


def parse_candidate_spec(text: str) -> Candidate:
    """--candidate: KEY=VALUE pairs separated by commas: name (default: made of the pairs), mode
    (batched or alone) and any LLM(...) keyword (an EngineConfig or LoadConfig field): dtype,
    quantization, kv_cache_dtype, max_num_seqs, enforce_eager, ..."""
    options, name, mode = {}, None, "batched"
    for part in _split_top_level(text):
        key, eq, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ConfigError(f"--candidate {text!r}: {part!r} is not KEY=VALUE")
        if key == "name":
            name = value.strip()
        elif key == "mode":
            mode = value.strip().lower()
            if mode not in MODES:
                raise ConfigError(f"--candidate {text!r}: mode must be one of {', '.join(MODES)}, got {mode!r}")
        else:
            options[key] = _value(value)
    if name is None:
        name = "+".join(f"{k}={v}" for k, v in options.items()) or "default"
        name += "-alone" if mode == "alone" else ""
    return Candidate(name, options, mode)


def option_names() -> set[str]:
    from tokenmill.config import EngineConfig, LoadConfig

    return {f.name for cls in (LoadConfig, EngineConfig) for f in dataclasses.fields(cls)}


def unknown_options(c: Candidate) -> list[str]:
    """The candidate's options that are no LLM(...) keyword of this tokenmill (or are shared ones)."""
    known = option_names() - set(SHARED_OPTIONS)
    return [k for k in c.options if k not in known]


def base_options(args) -> dict:
    """Every LoadConfig and EngineConfig field from the parsed flags (their defaults where absent)."""
    from tokenmill.config import EngineConfig, LoadConfig, field_default

    return {f.name: getattr(args, f.name, field_default(f))
            for cls in (LoadConfig, EngineConfig) for f in dataclasses.fields(cls)}


def reference_options(base: dict) -> dict:
    known = option_names()
    return {**base, **{k: v for k, v in REFERENCE_OVERRIDES.items() if k in known}}


# ---- per-position top-K logprobs and the coarsened KL -------------------------------------------------

@dataclass
class TopK:
    """A run's reported next-token logprobs at every teacher-forced output position (all prompts'
    positions concatenated, prompt i's rows offsets[i]:offsets[i + 1])."""

    ids: np.ndarray  # [N, M] int64: tokens with a known logprob (the top K, then the target), -1 padding
    logprobs: np.ndarray  # [N, M] float64, -inf padding
    kth: np.ndarray  # [N] float64: the K-th largest logprob; every unreported token's logprob is <= it
    argmax: np.ndarray  # [N] int64: the most likely token
    offsets: np.ndarray  # [num_prompts + 1]

    def per_prompt(self, values: np.ndarray) -> list[np.ndarray]:
        return [values[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]


def _pack(rows: list[list[tuple[int, float]]], counts: Sequence[int], k: int) -> TopK:
    width = max([len(r) for r in rows] + [1])
    n = len(rows)
    ids = np.full((n, width), -1, dtype=np.int64)
    lps = np.full((n, width), -np.inf)
    kth = np.full(n, -np.inf)
    argmax = np.full(n, -1, dtype=np.int64)
    for i, r in enumerate(rows):
        r = sorted(r, key=lambda x: -x[1])
        if r:
            ids[i, : len(r)] = [t for t, _ in r]
            lps[i, : len(r)] = [v for _, v in r]
            argmax[i] = r[0][0]
        if len(r) >= k:  # fewer known than K: the vocabulary is smaller than K, nothing is unreported
            kth[i] = r[k - 1][1]
    return TopK(ids, lps, kth, argmax, np.concatenate(([0], np.cumsum(counts))).astype(np.int64))


def topk_from_prompt_logprobs(outputs, prompt_lens: Sequence[int], counts: Sequence[int], k: int) -> TopK:
    """From teacher-forced RequestOutputs: prompt_logprobs[P + t] is the distribution before output
    token t (P: the original prompt's length)."""
    rows = []
    for out, plen, count in zip(outputs, prompt_lens, counts):
        lp = out.prompt_logprobs
        for t in range(count):
            entry = lp[plen + t]
            rows.append([(int(tid), float(x.logprob)) for tid, x in entry.items()])
    return _pack(rows, counts, k)


def topk_from_full(full_logprobs, targets: Sequence[int], k: int) -> list[list[tuple[int, float]]]:
    """Rows as prompt logprobs would report them (top k and the target) from full log-softmax rows."""
    import torch

    k = min(k, full_logprobs.shape[-1])
    vals, ids = torch.topk(full_logprobs, k, dim=-1)
    tgt = torch.as_tensor(list(targets), dtype=torch.int64, device=full_logprobs.device)
    tgt_lp = full_logprobs.gather(1, tgt[:, None])[:, 0]
    rows = []
    for i, v, t, tv in zip(ids.tolist(), vals.tolist(), tgt.tolist(), tgt_lp.tolist()):
        row = dict(zip(i, v))
        row.setdefault(t, tv)
        rows.append(list(row.items()))
    return rows


def _solve_unreported(p: np.ndarray, cap: np.ndarray, rest_known: np.ndarray, free: np.ndarray,
                      p_rest: np.ndarray, iterations: int = 100) -> np.ndarray:
    """The candidate probabilities q [N, M] of the reference tokens it did not report (p > 0 where
    they are; 0 elsewhere) that minimise sum p log(p/q) + p_rest log(p_rest / q_rest), with
    0 <= q <= cap, sum q <= free, q_rest = rest_known + free - sum q. Convex; its optimality
    conditions give q = min(cap, p / c): c from p_rest = c q_rest when the mass bound does not
    bind, else from sum q = free. Both equations are monotone in c: bisection on log c."""
    live = p > 0
    capc = cap[:, None]

    def q_of(logc):
        return np.where(live, np.minimum(capc, p / np.exp(logc)[:, None]), 0.0)

    n = p.shape[0]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        # Mass bound not binding: g(c) = c (rest_known + free - S(c)) - p_rest = 0, g nondecreasing.
        lo, hi = np.full(n, -700.0), np.full(n, 700.0)
        for _ in range(iterations):
            mid = (lo + hi) / 2
            g = np.exp(mid) * (rest_known + free - q_of(mid).sum(1)) - p_rest
            up = g < 0
            lo, hi = np.where(up, mid, lo), np.where(up, hi, mid)
        q = q_of(hi)
        binding = (p_rest <= 0) | (q.sum(1) > free * (1 + 1e-12) + 1e-300)
        if binding.any():
            # sum q = free (or every q at its cap if that fits): S(c) nonincreasing in c.
            full = np.where(live, capc, 0.0)
            fits = full.sum(1) <= free
            lo, hi = np.full(n, -700.0), np.full(n, 700.0)
            for _ in range(iterations):
                mid = (lo + hi) / 2
                over = q_of(mid).sum(1) > free
                lo, hi = np.where(over, mid, lo), np.where(over, hi, mid)
            q_bound = np.where(fits[:, None], full, q_of(hi))
            q = np.where(binding[:, None], q_bound, q)
    return q


def _xlogy_ratio(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """p log(p / q) with 0 log 0 = 0 and q floored at 1e-300."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - np.log(np.maximum(q, 1e-300))), 0.0)


def coarse_kl_lower_bound(ref: TopK, cand: TopK) -> np.ndarray:
    """[N] the coarsened KL(ref || cand) lower bound at every position (see the module docstring)."""
    rvalid, cvalid = ref.ids >= 0, cand.ids >= 0
    p = np.where(rvalid, np.exp(ref.logprobs), 0.0)
    qc = np.where(cvalid, np.exp(cand.logprobs), 0.0)
    match = (ref.ids[:, :, None] == cand.ids[:, None, :]) & rvalid[:, :, None] & cvalid[:, None, :]
    reported = match.any(2)  # [N, M]: the candidate reported this reference token
    q_rep = (match * qc[:, None, :]).sum(2)
    in_r = match.any(1)  # [N, Mc]: a candidate-reported token is one of the reference's bins
    rest_known = (qc * ~in_r).sum(1)  # reported candidate mass in the rest bin
    free = np.maximum(0.0, 1.0 - qc.sum(1))  # the candidate's unreported mass
    p_rest = np.maximum(0.0, 1.0 - p.sum(1))
    unknown = rvalid & ~reported
    q_unk = _solve_unreported(np.where(unknown, p, 0.0), np.exp(cand.kth), rest_known, free, p_rest)
    q_rest = np.maximum(rest_known + free - q_unk.sum(1), 0.0)
    kl = (_xlogy_ratio(np.where(reported, p, 0.0), q_rep).sum(1)
          + _xlogy_ratio(np.where(unknown, p, 0.0), q_unk).sum(1) + _xlogy_ratio(p_rest, q_rest))
    return np.maximum(kl, 0.0)


def kl_full(ref_logprobs, cand_logprobs):
    """[n] exact KL(ref || cand) of full log-softmax rows [n, V] (float64 sums)."""
    r = ref_logprobs.double()
    return (r.exp() * (r - cand_logprobs.double())).sum(-1)


# ---- exact full-vocabulary rows, from the engine's own prompt-logprob logits ------------------------------

class FullLogprobsCapture:
    """Takes the full-vocabulary log-softmax at the output positions of a teacher-forced run.

    Wraps, on the instances only, the engine's add_request (to learn the i-th request's id: the
    run submits one request per prompt, in prompt order) and its runner's prompt-logprob
    computation (runner/prompt_logprobs.py), whose logits function it hands on wrapped: each slice
    of logits the engine computes prompt logprobs from passes by, with the plan's spans giving the
    (request, position) of every row. The engine's results are unchanged. Without `reference`, the
    rows are kept (host, float32); with it (the reference's kept rows), each row's exact KL against
    them is computed on the device and kept instead. A position computed twice (after a
    preemption) keeps its first value, as the engine does."""

    def __init__(self, engine, first_positions: Sequence[int], counts: Sequence[int],
                 reference: Optional[list] = None):
        self.engine = engine
        self.first = list(first_positions)
        self.counts = list(counts)
        self.reference = reference
        self.index_of: dict[str, int] = {}
        self.rows: list = [None] * len(self.counts)
        self.kl = [np.full(c, np.nan) for c in self.counts]
        self.filled = [np.zeros(c, dtype=bool) for c in self.counts]

    @staticmethod
    def unavailable(engine) -> Optional[str]:
        """Why the rows cannot be taken from this engine (None: they can)."""
        computer = getattr(getattr(engine, "runner", None), "prompt_logprobs", None)
        if computer is None or not callable(getattr(computer, "compute", None)):
            return ("the engine's model runner is not in this process (tensor or pipeline parallel), so its "
                    "logits cannot be read")
        return None

    def __enter__(self) -> "FullLogprobsCapture":
        engine, computer = self.engine, self.engine.runner.prompt_logprobs
        add_request, compute = engine.add_request, computer.compute

        def counted_add_request(*args, **kwargs):
            request_id = add_request(*args, **kwargs)
            self.index_of[request_id] = len(self.index_of)
            return request_id

        def capturing_compute(hidden, plan, compute_logits):
            done = [0]

            def logits_fn(h):
                logits = compute_logits(h)
                self._take(plan, done[0], logits)
                done[0] += int(logits.shape[0])
                return logits

            return compute(hidden, plan, logits_fn)

        engine.add_request = counted_add_request
        computer.compute = capturing_compute
        return self

    def __exit__(self, *exc) -> None:
        for obj, name in ((self.engine, "add_request"), (self.engine.runner.prompt_logprobs, "compute")):
            if name in vars(obj):
                delattr(obj, name)
        self.engine = None  # the capture must not keep the engine (and its device memory) alive

    def _take(self, plan, first_row: int, logits) -> None:
        import torch

        n = int(logits.shape[0])
        for span in plan.spans:
            idx = self.index_of.get(span.req_id)
            if idx is None:
                continue
            lo, hi = max(span.offset, first_row), min(span.offset + span.count, first_row + n)
            if lo >= hi:
                continue
            # rows lo..hi hold prompt positions span.start + (row - span.offset); output t = position - first
            t0 = span.start + (lo - span.offset) - self.first[idx]
            a, b = max(t0, 0), min(t0 + (hi - lo), self.counts[idx])
            if a >= b:
                continue
            fresh = ~self.filled[idx][a:b]
            if not fresh.any():
                continue
            r0 = lo - first_row + (a - t0)
            with torch.no_grad():
                lp = logits[r0: r0 + (b - a)].float().log_softmax(-1)
                if self.reference is None:
                    if self.rows[idx] is None:
                        self.rows[idx] = torch.full((self.counts[idx], lp.shape[-1]), float("nan"))
                    keep = torch.from_numpy(np.flatnonzero(fresh))
                    self.rows[idx][a + keep] = lp[keep.to(lp.device)].cpu()
                else:
                    ref = self.reference[idx][a:b].to(lp.device)
                    if ref.shape[-1] != lp.shape[-1]:
                        raise RuntimeError(f"vocabulary of {lp.shape[-1]} logits against the reference's "
                                           f"{ref.shape[-1]}")
                    kl = kl_full(ref, lp).cpu().numpy()
                    self.kl[idx][a:b] = np.where(fresh, kl, self.kl[idx][a:b])
            self.filled[idx][a:b] = True

    def complete(self) -> bool:
        return all(f.all() for f in self.filled)


def rows_match_reported(rows: list, topk: TopK) -> float:
    """The largest |captured full-row logprob - the engine's reported logprob| over every reported
    (position, token) of the reference: the check that the capture put each row where it belongs."""
    import torch

    worst = 0.0
    for i, (a, b) in enumerate(zip(topk.offsets[:-1], topk.offsets[1:])):
        ids = torch.from_numpy(topk.ids[a:b])
        valid = ids >= 0
        got = rows[i].gather(1, ids.clamp(min=0)).double()
        want = torch.from_numpy(topk.logprobs[a:b])
        if bool(valid.any()):
            worst = max(worst, float((got - want).abs()[valid].max()))
    return worst


# ---- running the engines ------------------------------------------------------------------------------

def _free(device) -> None:
    from tokenmill.bench.common import free_device_memory

    gc.collect()
    left = free_device_memory(device)
    if left:
        logger.info("freed; %.0f MiB still allocated on the device", left / 2**20)


def _build_llm(options: dict):
    from tokenmill.entrypoints.llm import LLM

    opts = dict(options)
    return LLM(opts.pop("model", None), **opts)


def _close_llm(llm, device) -> None:
    try:
        llm.engine.close()
    finally:
        llm.engine = None
        _free(device)


def _run_mode(llm, prompts: list[list[int]], params, mode: str, desc: str):
    if mode == "batched":
        return llm.generate(prompts, params, use_tqdm=True)
    from tqdm.auto import tqdm

    return [llm.generate([p], params, use_tqdm=False)[0]
            for p in tqdm(prompts, desc=desc, unit="prompt", dynamic_ncols=True)]


def greedy_outputs(llm, prompts, output_len: int, mode: str, ignore_eos: bool) -> list[list[int]]:
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos)
    return [list(o.outputs[0].token_ids) for o in _run_mode(llm, prompts, params, mode, "greedy, alone")]


def teacher_forced(llm, prompts, ref_outputs, mode: str, k: int, capture: Optional[FullLogprobsCapture]):
    """The run's TopK along the reference's outputs (and the capture filled, if given)."""
    from contextlib import nullcontext

    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k, ignore_eos=True)
    seqs = [list(p) + list(o) for p, o in zip(prompts, ref_outputs)]
    with capture if capture is not None else nullcontext():
        outs = _run_mode(llm, seqs, params, mode, "teacher forcing, alone")
    counts = [len(o) for o in ref_outputs]
    return topk_from_prompt_logprobs(outs, [len(p) for p in prompts], counts, k)


def greedy_metrics(ref_outputs: list[list[int]], outputs: list[list[int]]) -> dict:
    matched, identical, first_diff = [], [], []
    for ref, out in zip(ref_outputs, outputs):
        m = 0
        while m < min(len(ref), len(out)) and ref[m] == out[m]:
            m += 1
        matched.append(m)
        identical.append(list(ref) == list(out))
        first_diff.append(None if identical[-1] else m)
    total = sum(len(r) for r in ref_outputs)
    return {"token_agreement": sum(matched) / total if total else None,
            "prompts_identical": sum(identical) / len(identical) if identical else None,
            "matched_tokens": sum(matched), "reference_tokens": total, "prompts": len(identical),
            "identical_prompts": sum(identical), "per_prompt_matched": matched,
            "per_prompt_tokens": [len(o) for o in outputs], "per_prompt_first_divergence": first_diff}


def _mean(x) -> Optional[float]:
    x = np.asarray(x, dtype=np.float64)
    return float(x.mean()) if x.size and np.isfinite(x).all() else None


def _max(x) -> Optional[float]:
    x = np.asarray(x, dtype=np.float64)
    return float(x.max()) if x.size and np.isfinite(x).all() else None


def teacher_metrics(ref: TopK, cand: TopK, exact: Optional[list[np.ndarray]]) -> dict:
    top1 = (ref.argmax == cand.argmax).astype(np.float64)
    coarse = coarse_kl_lower_bound(ref, cand)
    flat = np.concatenate(exact) if exact is not None else None
    # A mean over positions is null where some position's KL is not finite (NaN or infinite logits):
    # how many is counted beside it.
    return {"positions": int(len(top1)), "top1_agreement": _mean(top1),
            "kl_nonfinite_positions": {"coarse": int((~np.isfinite(coarse)).sum()),
                                       "exact": int((~np.isfinite(flat)).sum()) if flat is not None else None},
            "kl_coarse_mean": _mean(coarse), "kl_coarse_max": _max(coarse),
            "kl_exact_mean": _mean(flat) if flat is not None else None,
            "kl_exact_max": _max(flat) if flat is not None else None,
            "per_prompt_top1": [_mean(x) for x in ref.per_prompt(top1)],
            "per_prompt_kl_coarse_mean": [_mean(x) for x in ref.per_prompt(coarse)],
            "per_prompt_kl_exact_mean": [_mean(x) for x in exact] if exact is not None else None}


def _engine_info(llm) -> dict:
    engine = llm.engine
    return {"dtype": str(engine.loaded.dtype).replace("torch.", ""), "quantization": engine.config.quantization,
            "kv_cache_dtype": getattr(engine.config, "kv_cache_dtype", None),
            "config": vars(engine.config).copy(), "load_s": engine.loaded.load_seconds}


# ---- the HF transformers peer ---------------------------------------------------------------------------

def hf_model_dir(model: Optional[str], load_format: str) -> tuple[Optional[str], Optional[str]]:
    """(a safetensors directory transformers can load with the model's weights, or None; why not).
    A GGUF model: the directory tokenmill's loader converts it into (its own reader and dequantizer)."""
    from tokenmill.loader.resolve import resolve_model

    source = resolve_model(model, load_format)
    if source.kind == "dummy":
        return None, "the model has random (dummy) weights, which transformers cannot reproduce"
    if source.kind == "gguf":
        from tokenmill.loader.gguf_loader import convert_gguf_to_hf_dir

        return convert_gguf_to_hf_dir(source.path), None
    return source.path, None


def parse_hf(text: str, candidate_dtypes: Sequence[str]) -> list[str]:
    """--hf: none, auto (the dtypes the candidates ran in), or dtypes (bf16,fp32,...)."""
    low = (text or "none").strip().lower()
    if low in ("none", "off", ""):
        return []
    if low == "auto":
        return list(dict.fromkeys(candidate_dtypes))
    out = []
    for d in _split_top_level(low):
        if d not in _HF_DTYPES:
            raise ConfigError(f"--hf: unknown dtype {d!r} (auto, none, or of {', '.join(_HF_DTYPES)})")
        out.append(_HF_DTYPES[d])
    return list(dict.fromkeys(out))


def _hf_forward(model, ids, *, cache=None, cache_kw: str = "past_key_values", use_cache: bool = True,
                keep: Optional[int] = None):
    """(logits, the cache after the call) of one forward pass; keep: only the last `keep` positions' logits."""
    kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": use_cache}
    if cache is not None:
        kwargs[cache_kw] = cache
    if keep is not None:
        kwargs["logits_to_keep"] = keep
    out = model(**kwargs)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = getattr(out, "past_key_values", None)
    return out.logits, new_cache


class HFFidelityPeer:
    """transformers' model of the same weights in one dtype (optionally FP8 through FineGrainedFP8Config)."""

    def __init__(self, model_dir: str, device, dtype: str, quantization: Optional[str] = None):
        import inspect

        import torch
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
        if quantization == "fp8":
            from transformers import FineGrainedFP8Config

            kwargs["quantization_config"] = FineGrainedFP8Config()
            kwargs["device_map"] = str(self.device)
        started = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        if quantization is None:
            self.model.to(self.device)
        self.model.eval()
        self.load_s = time.perf_counter() - started
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keeps_logits = "logits_to_keep" in params

    @property
    def attn_implementation(self) -> Optional[str]:
        return getattr(self.model.config, "_attn_implementation", None)

    def greedy(self, prompt: list[int], max_new: int, stop_ids: set[int]) -> list[int]:
        import torch

        with torch.no_grad():
            logits, cache = _hf_forward(self.model, torch.tensor([prompt], device=self.device))
            tokens: list[int] = []
            while True:
                token = int(logits[0, -1].argmax())
                tokens.append(token)
                if len(tokens) >= max_new or token in stop_ids:
                    return tokens
                logits, new_cache = _hf_forward(self.model, torch.tensor([[token]], device=self.device),
                                                cache=cache, cache_kw=self.cache_kw)
                cache = new_cache if new_cache is not None else cache

    def teacher_logprobs(self, prompt: list[int], output: list[int]):
        """[len(output), vocab] float32 log-softmax before each output token."""
        import torch

        seq = list(prompt) + list(output)
        keep = len(output) + 1 if self.keeps_logits else None
        with torch.no_grad():
            logits, _ = _hf_forward(self.model, torch.tensor([seq], device=self.device), use_cache=False, keep=keep)
            logits = logits[0]
            start = logits.shape[0] - (len(output) + 1) if keep is not None else len(prompt) - 1
            return logits[start: start + len(output)].float().log_softmax(-1)

    def close(self) -> None:
        self.model = None


def run_hf_peer(name: str, model_dir: str, device, dtype: str, quantization: Optional[str], prompts, ref_outputs,
                ref_topk: TopK, ref_rows: Optional[list], output_len: int, stop_ids: set[int], k: int) -> dict:
    import torch
    import transformers
    from tqdm.auto import tqdm

    entry: dict[str, Any] = {"name": name, "peer": "transformers", "dtype": dtype, "quantization": quantization,
                             "transformers_version": transformers.__version__, "model_dir": model_dir,
                             "metrics": None, "error": None}
    peer = HFFidelityPeer(model_dir, device, dtype, quantization)
    try:
        entry["attn_implementation"] = peer.attn_implementation
        entry["load_s"] = peer.load_s
        outputs, rows, exact = [], [], []
        for i, (p, ref) in enumerate(tqdm(list(zip(prompts, ref_outputs)), desc=name, unit="prompt",
                                          dynamic_ncols=True)):
            outputs.append(peer.greedy(p, output_len, stop_ids))
            lp = peer.teacher_logprobs(p, ref)
            rows += topk_from_full(lp, ref, k)
            if ref_rows is not None:
                r = ref_rows[i].to(lp.device)
                v = min(r.shape[-1], lp.shape[-1])
                if r.shape[-1] != lp.shape[-1]:
                    logger.warning("%s: %d logits against the reference's %d: the KL is over the first %d",
                                   name, lp.shape[-1], r.shape[-1], v)
                exact.append(kl_full(r[:, :v], torch.log_softmax(lp[:, :v], -1)).cpu().numpy())
        topk = _pack(rows, [len(o) for o in ref_outputs], k)
        entry["metrics"] = {"greedy": greedy_metrics(ref_outputs, outputs),
                            "teacher_forced": teacher_metrics(ref_topk, topk, exact if ref_rows is not None else None)}
    finally:
        peer.close()
        del peer
        _free(device)
    return entry


# ---- the benchmark --------------------------------------------------------------------------------------

def _candidate_entry(c: Candidate) -> dict:
    return {"name": c.name, "mode": c.mode, "options": dict(c.options), "engine": None, "metrics": None,
            "skipped": None, "error": None}


def run(args) -> dict:
    import torch

    from tokenmill.bench import report
    from tokenmill.bench.roofline import device_name
    from tokenmill.loader.load import resolve_device
    from tokenmill.sampling_params import MAX_LOGPROBS

    k = MAX_LOGPROBS
    output_len = args.output_len
    if output_len < 1:
        raise ConfigError(f"--output-len must be at least 1, got {output_len}")
    candidates = parse_candidates(args.candidates) + [parse_candidate_spec(s) for s in (args.candidate or [])]
    if not candidates:
        raise ConfigError("no candidates: give --candidates and/or --candidate")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ConfigError(f"candidate names must differ: {names}")
    for c in candidates:  # a typo in --candidate fails before anything loads
        bad = unknown_options(c)
        if bad and not c.from_shorthand:
            close = difflib.get_close_matches(bad[0], sorted(option_names() - set(SHARED_OPTIONS)), n=1)
            raise ConfigError(f"--candidate {c.name}: {bad[0]!r} is no engine option of this tokenmill"
                             + (f" (did you mean {close[0]!r}?)" if close else ""))
    parse_hf(args.hf, [])  # a bad --hf fails before anything loads
    device = resolve_device(args.device)
    set_name, all_prompts = load_prompts(args.prompts)
    chosen = select_prompts(all_prompts, args.num_prompts)
    base = base_options(args)
    base["device"] = str(device)

    started = time.perf_counter()
    logger.info("reference: float32, batched, %d prompts, up to %d tokens each", len(chosen), output_len)
    ref_llm = _build_llm(reference_options(base))
    try:
        prompts, rendering = tokenize_prompts(ref_llm, chosen, args.plain_chat)
        ref_info = _engine_info(ref_llm)
        eos_ids = set(ref_llm.engine.loaded.eos_token_ids)
        model_name = ref_llm.engine.model_name
        ref_outputs = greedy_outputs(ref_llm, prompts, output_len, "batched", args.ignore_eos)
        counts = [len(o) for o in ref_outputs]
        firsts = [len(p) - 1 for p in prompts]
        exact_note = None if args.exact_kl else "off (--no-exact-kl)"
        if exact_note is None:
            exact_note = FullLogprobsCapture.unavailable(ref_llm.engine)
        capture = FullLogprobsCapture(ref_llm.engine, firsts, counts) if exact_note is None else None
        if capture is not None:
            size = sum(counts) * ref_llm.engine.vocab_size * 4
            logger.info("keeping the reference's full-vocabulary rows for the exact KL: %.2f GB of host memory",
                        size / 1e9)
        ref_topk = teacher_forced(ref_llm, prompts, ref_outputs, "batched", k, capture)
        ref_rows, capture_check = None, None
        if capture is not None:
            if capture.complete():
                ref_rows = capture.rows
                capture_check = rows_match_reported(ref_rows, ref_topk)
                if capture_check > 1e-3:
                    logger.warning("the captured full rows differ from the engine's reported logprobs by up to %.3g",
                                   capture_check)
            else:
                exact_note = "some positions' logits were not seen (this is a bug of the bench)"
                logger.warning("exact KL: %s", exact_note)
        if exact_note is not None:
            (logger.info if not args.exact_kl else logger.warning)(
                "no exact KL: %s; only the coarsened lower bound", exact_note)
        greedy_pos = np.concatenate([np.asarray(o, dtype=np.int64) for o in ref_outputs])
        self_consistency = float((ref_topk.argmax == greedy_pos).mean()) if len(greedy_pos) else None
    finally:
        _close_llm(ref_llm, device)
    reference = {"name": "reference", "mode": "batched", "options": {k_: v for k_, v in REFERENCE_OVERRIDES.items()
                                                                     if k_ in option_names()},
                 "engine": ref_info, "output_tokens": sum(counts), "per_prompt_tokens": counts,
                 "outputs": ref_outputs, "teacher_forced_argmax_equals_greedy": self_consistency}

    entries = []
    for c in candidates:
        entry = _candidate_entry(c)
        entries.append(entry)
        bad = unknown_options(c)
        if bad:
            entry["skipped"] = f"this tokenmill's engine has no option {', '.join(bad)}"
            logger.warning("candidate %s skipped: %s", c.name, entry["skipped"])
            continue
        logger.info("candidate %s: %s, %s", c.name, c.options or "the flags' options", c.mode)
        try:
            _run_candidate(entry, c, base, device, prompts, ref_outputs, ref_topk, ref_rows, firsts, counts,
                           output_len, args.ignore_eos, k)
        except Exception as e:  # one failing configuration (a missing kernel, a bad option) leaves the others
            from tokenmill.errors import TokenmillError

            entry["metrics"], entry["error"] = None, f"{type(e).__name__}: {e}"
            if isinstance(e, TokenmillError):  # a bad option or a model that does not load: the message says it
                logger.warning("candidate %s failed: %s", c.name, entry["error"])
            else:
                logger.exception("candidate %s failed", c.name)
            _free(device)
            continue
        g, t = entry["metrics"]["greedy"], entry["metrics"]["teacher_forced"]
        logger.info("candidate %s: greedy agreement %s, top-1 %s, KL coarse %s, exact %s", c.name,
                    _fmt(g["token_agreement"], ".4f"), _fmt(t["top1_agreement"], ".4f"),
                    _fmt(t["kl_coarse_mean"], ".3e"), _fmt(t["kl_exact_mean"], ".3e"))

    hf_peers = _run_hf_peers(args, device, entries, prompts, ref_outputs, ref_topk, ref_rows, output_len,
                             set() if args.ignore_eos else eos_ids, k)

    kinds: dict[str, int] = {}
    for p in chosen:
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    result = report.metadata("fidelity")
    result.update({
        "tag": args.tag, "model": model_name, "device": str(device), "device_name": device_name(device),
        "workload": {"name": f"{model_name}-{len(chosen)}x{output_len}", "prompt_set": set_name,
                     "prompt_file": os.path.abspath(args.prompts or DEFAULT_PROMPTS), "num_prompts": len(chosen),
                     "prompt_ids": [p["id"] for p in chosen], "kinds": kinds, "chat_rendering": rendering,
                     "output_len": output_len, "ignore_eos": bool(args.ignore_eos),
                     "prompt_tokens": [len(p) for p in prompts]},
        "logprobs_k": k, "exact_kl": ref_rows is not None, "exact_kl_note": exact_note,
        "exact_kl_rows_check_max_abs_diff": capture_check,
        "kl_definition": KL_DEFINITION, "reference": reference, "candidates": entries, "hf_peers": hf_peers,
        "elapsed_s": time.perf_counter() - started,
    })
    result["summary"] = summary(result)
    return result


def _run_candidate(entry: dict, c: Candidate, base: dict, device, prompts, ref_outputs, ref_topk: TopK,
                   ref_rows: Optional[list], firsts, counts, output_len: int, ignore_eos: bool, k: int) -> None:
    """Build the candidate's engine, run it greedy and teacher forced, fill entry's engine, metrics
    and outputs, and free it."""
    llm = _build_llm({**base, **c.options})
    try:
        entry["engine"] = _engine_info(llm)
        outputs = greedy_outputs(llm, prompts, output_len, c.mode, ignore_eos)
        cap = None
        if ref_rows is not None:
            reason = FullLogprobsCapture.unavailable(llm.engine)
            if reason is None:
                cap = FullLogprobsCapture(llm.engine, firsts, counts, reference=ref_rows)
            else:
                logger.warning("candidate %s: no exact KL: %s", c.name, reason)
        topk = teacher_forced(llm, prompts, ref_outputs, c.mode, k, cap)
        exact = cap.kl if cap is not None and cap.complete() else None
        if cap is not None and exact is None:
            logger.warning("candidate %s: some positions' logits were not seen: no exact KL", c.name)
        entry["metrics"] = {"greedy": greedy_metrics(ref_outputs, outputs),
                            "teacher_forced": teacher_metrics(ref_topk, topk, exact)}
        entry["outputs"] = outputs
    finally:
        _close_llm(llm, device)


def _run_hf_peers(args, device, entries, prompts, ref_outputs, ref_topk, ref_rows, output_len, stop_ids, k):
    """The HF peers' entries, or None when --hf asks for none or transformers is missing."""
    ran = [e["engine"]["dtype"] for e in entries if e.get("engine")]
    dtypes = parse_hf(args.hf, ran)
    if not dtypes:
        return None
    try:
        import transformers  # noqa: F401
    except ImportError:
        logger.warning("transformers is not installed: no HF peer")
        return None
    model_dir, why = hf_model_dir(args.model, args.load_format)
    wanted = [(d, None) for d in dtypes] + [(d, args.hf_quantization) for d in dtypes if args.hf_quantization]
    peers = []
    for dtype, quant in wanted:
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
        name = f"hf-{short}" + (f"-{quant}" if quant else "")
        base = {"name": name, "peer": "transformers", "dtype": dtype, "quantization": quant, "metrics": None,
                "error": None}
        if model_dir is None:
            logger.warning("HF peer %s: %s", name, why)
            peers.append({**base, "error": why})
            continue
        if quant == "fp8" and device.type != "cuda":
            base["error"] = "transformers' FineGrainedFP8Config needs a CUDA device"
            logger.warning("HF peer %s: %s", name, base["error"])
            peers.append(base)
            continue
        logger.info("HF peer %s: %d prompts, greedy alone and teacher forced", name, len(prompts))
        try:
            peers.append(run_hf_peer(name, model_dir, device, dtype, quant, prompts, ref_outputs, ref_topk,
                                     ref_rows, output_len, stop_ids, k))
        except Exception as e:  # a peer that cannot run (a version without FP8, no kernels) is reported
            base["error"] = f"{type(e).__name__}: {e}"
            logger.warning("HF peer %s failed: %s", name, base["error"])
            peers.append(base)
            _free(device)
    return peers


def summary(result: dict) -> dict:
    """name -> the headline figures of every candidate and peer (None where it did not run)."""
    out = {}
    for e in list(result["candidates"]) + list(result.get("hf_peers") or []):
        m = e.get("metrics")
        g, t = (m["greedy"], m["teacher_forced"]) if m else ({}, {})
        out[e["name"]] = {"token_agreement": g.get("token_agreement"), "prompts_identical": g.get("prompts_identical"),
                          "top1_agreement": t.get("top1_agreement"), "kl_coarse_mean": t.get("kl_coarse_mean"),
                          "kl_exact_mean": t.get("kl_exact_mean"),
                          "status": "ok" if m else (e.get("skipped") and "skipped") or "error"}
    return out


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_summary(result: dict, out=None) -> None:
    from tokenmill.bench.report import format_table

    out = out or sys.stdout  # looked up per call (a test may have replaced it)
    w = result["workload"]
    ref = result["reference"]
    print(f"fidelity of {result['model']} on {result['device_name']}: {w['num_prompts']} prompts "
          f"({', '.join(f'{n} {k}' for k, n in w['kinds'].items())}; chat: {w['chat_rendering']}), "
          f"{ref['output_tokens']} reference tokens (float32, greedy); teacher forcing with the top "
          f"{result['logprobs_k']} logprobs", file=out)
    rows = [["candidate", "dtype", "quant", "kv", "mode", "greedy agree", "identical", "top-1", "KL coarse",
             "KL exact"]]
    notes = []
    for e in list(result["candidates"]) + list(result.get("hf_peers") or []):
        eng = e.get("engine") or {}
        m = e.get("metrics")
        if m is None:
            notes.append(f"{e['name']}: {e.get('skipped') or e.get('error') or 'did not run'}")
            rows.append([e["name"], e.get("dtype") or eng.get("dtype") or "-"] + ["-"] * 8)
            continue
        g, t = m["greedy"], m["teacher_forced"]
        hf = e.get("peer") == "transformers"
        rows.append([e["name"], e.get("dtype") if hf else eng.get("dtype"),
                     (e.get("quantization") if hf else eng.get("quantization")) or "-",
                     "-" if hf else (eng.get("kv_cache_dtype") or "-"), "alone" if hf else e["mode"],
                     _fmt(g["token_agreement"], ".4f"), f"{g['identical_prompts']}/{g['prompts']}",
                     _fmt(t["top1_agreement"], ".4f"), _fmt(t["kl_coarse_mean"], ".3e"),
                     _fmt(t["kl_exact_mean"], ".3e")])
    print(format_table(rows), file=out)
    for note in notes:
        print(note, file=out)
    if not result.get("exact_kl"):
        print(f"no exact KL: {result.get('exact_kl_note')}", file=out)
    print("KL: mean KL(reference || candidate) per position; coarse = a lower bound from the top-K logprobs "
          "(see kl_definition in the JSON)", file=out)


# ---- the command line -----------------------------------------------------------------------------------

def add_args(p) -> None:
    from tokenmill.entrypoints.cli import add_engine_args

    g = p.add_argument_group("fidelity")
    g.add_argument("--candidates", default=DEFAULT_CANDIDATES,
                   help="engine configurations compared with the float32 reference, comma-separated; each name is "
                        "tokens joined by '+': fp32 / bf16 / fp16 (dtype), fp8 (FP8 weights: quantization=fp8), "
                        "fp8-kv (FP8 KV cache: kv_cache_dtype=fp8), bi (batch_invariant=True), alone / batched; "
                        "a name may end in -alone "
                        "(each prompt run by itself instead of all in one generate call). E.g. "
                        "bf16,bf16-alone,fp8,fp8-kv,fp8+fp8-kv. A candidate naming no dtype runs in --dtype; one "
                        "whose option this tokenmill lacks is skipped (reported). '' for none")
    g.add_argument("--candidate", action="append", default=[], metavar="KEY=VALUE,...",
                   help="one more candidate (repeatable): name=NAME, mode=batched|alone, and any LLM(...) keyword "
                        "(an engine or loader option: dtype=bfloat16, quantization=fp8, kv_cache_dtype=fp8, "
                        "max_num_seqs=8, enforce_eager=true, ...; values are JSON where they parse), e.g. "
                        "--candidate name=bf16-eager,dtype=bfloat16,enforce_eager=true (default: none)")
    g.add_argument("--prompts", default=None,
                   help="a prompt file like tokenmill/bench/data/fidelity_prompts.json: {\"prompts\": [{\"id\", "
                        "\"kind\", \"text\" or \"messages\"}]} (default: that file, 72 prompts: 24 chat, 24 code, "
                        "24 prose)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="use N prompts, taken from the kinds in turn (default: all)")
    g.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT_LEN,
                   help="greedy tokens per prompt in the reference run (fewer where it reaches EOS)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate --output-len tokens whatever comes (default: stop at EOS)")
    g.add_argument("--plain-chat", action="store_true",
                   help="chat prompts as plain 'role: content' lines instead of through the chat template "
                        "(default: the model's chat template, as LLM.chat renders it)")
    g.add_argument("--no-exact-kl", dest="exact_kl", action="store_false",
                   help="no full-vocabulary KL (it keeps the reference's full rows in host memory: output "
                        "positions x vocabulary x 4 bytes); the coarsened lower bound only (default: exact KL on)")
    g.add_argument("--hf", default="auto",
                   help="HF transformers peers, each a dtype: auto (the dtypes the candidates ran in), none, or "
                        "a list such as bf16 or bf16,fp32; skipped when transformers is not installed")
    g.add_argument("--hf-quantization", default=None, choices=["fp8"],
                   help="also an HF peer per --hf dtype with transformers' FineGrainedFP8Config (CUDA; a null "
                        "entry, logged, where it cannot run) (default: none)")
    g.add_argument("--out", default="bench-results", help="directory for the JSON result")
    g.add_argument("--tag", default=None, help="a label added to the result file name (default: none)")
    add_engine_args(p, defaults={
        "dtype": ("auto", "auto; the dtype of candidates that name none: the reference is float32 whatever "
                          "this says"),
        "quantization": (None, "off; applies to candidates that name none: the reference is never quantized"),
        "kv_cache_dtype": ("auto", "auto; applies to candidates that name none: the reference's is always auto")})
