"""`tokenmill bench fidelity` on the CPU: the coarsened KL bound, the candidate syntax, the prompt set, and
one end-to-end run (4 prompts x 8 tokens of the embedded model: fp32 and bf16 candidates, the HF peer)."""

import contextlib
import fnmatch
import io
import json
import os
import tomllib

import numpy as np
import pytest
import torch

from tokenmill.bench import fidelity as fid
from tokenmill.config import ConfigError
from tokenmill.entrypoints.cli import main

K = 20


# ---- the coarsened KL --------------------------------------------------------------------------------------

def _topk(full_lp: torch.Tensor, targets) -> fid.TopK:
    return fid._pack(fid.topk_from_full(full_lp, targets, K), [len(targets)], K)


def _pairs(n=64, vocab=300, seed=0):
    """Reference and candidate log-softmax rows: random logits, the candidate a perturbed and
    sharpened or flattened copy, so its top K both overlaps the reference's and misses some of it."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3
    scale = torch.linspace(0.5, 2.0, n, dtype=torch.float64)[:, None]
    noise = torch.linspace(0.0, 3.0, n, dtype=torch.float64)[:, None]
    cand = ref * scale + noise * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    return ref.log_softmax(-1), cand.log_softmax(-1)


def test_coarse_kl_is_a_lower_bound_of_the_full_kl():
    ref, cand = _pairs()
    targets = ref.argmax(-1).tolist()  # teacher forcing along the reference's greedy tokens
    coarse = fid.coarse_kl_lower_bound(_topk(ref, targets), _topk(cand, targets))
    exact = fid.kl_full(ref, cand).numpy()
    assert np.isfinite(coarse).all() and (coarse >= 0).all()
    assert (coarse <= exact + 1e-12).all()
    assert (coarse > 0).all()  # every pair differs
    # not a trivial bound: it keeps most of the divergence on these rows
    assert coarse.sum() > 0.5 * exact.sum()
    same = fid.coarse_kl_lower_bound(_topk(ref, targets), _topk(ref, targets))
    assert np.abs(same).max() < 1e-12


def _coarsened(p_full: np.ndarray, q_full: np.ndarray, bins: np.ndarray) -> float:
    p = np.append(p_full[bins], 1 - p_full[bins].sum())
    q = np.append(q_full[bins], 1 - q_full[bins].sum())
    return float(np.sum(p * np.log(p / q)))


def test_coarse_kl_is_the_coarsened_kl_when_the_candidate_reports_every_reference_token():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 300, generator=g, dtype=torch.float64)
    logits[:, :K] += 10  # a gap after the first K tokens
    ref = logits.log_softmax(-1)
    # small changes: the candidate's top K is the reference's, so nothing is unknown
    cand = (logits + 0.05 * torch.randn(logits.shape, generator=g, dtype=torch.float64)).log_softmax(-1)
    targets = ref.argmax(-1).tolist()
    r, c = _topk(ref, targets), _topk(cand, targets)
    assert all(set(r.ids[i]) == set(c.ids[i]) for i in range(len(targets)))
    coarse = fid.coarse_kl_lower_bound(r, c)
    for i in range(len(targets)):
        want = _coarsened(ref[i].exp().numpy(), cand[i].exp().numpy(), r.ids[i][r.ids[i] >= 0])
        assert coarse[i] == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_coarse_kl_is_the_minimum_over_consistent_candidates():
    """With reference tokens missing from the candidate's report, the bound is the optimum of the convex
    problem: scipy's solver over the same constraints finds nothing lower, and the bound is attained."""
    optimize = pytest.importorskip("scipy.optimize")
    ref, cand = _pairs(n=24, seed=5)
    targets = ref.argmax(-1).tolist()
    r, c = _topk(ref, targets), _topk(cand, targets)
    coarse = fid.coarse_kl_lower_bound(r, c)
    rng = np.random.default_rng(0)
    checked = solved = 0
    for i in range(len(targets)):
        rids, cids = r.ids[i][r.ids[i] >= 0], c.ids[i][c.ids[i] >= 0]
        p = np.exp(r.logprobs[i][: len(rids)])
        qc = dict(zip(cids.tolist(), np.exp(c.logprobs[i][: len(cids)])))
        unknown = [j for j, t in enumerate(rids) if t not in qc]
        if not unknown:
            continue
        checked += 1
        cap, free = float(np.exp(c.kth[i])), 1 - sum(qc.values())
        rest_known = sum(v for t, v in qc.items() if t not in set(rids.tolist()))
        p_rest = 1 - p.sum()

        def objective(x):
            q = np.array([qc.get(t, 0.0) for t in rids])
            q[unknown] = x
            q_rest = rest_known + free - x.sum()
            return float(np.sum(p * np.log(p / q)) + p_rest * np.log(p_rest / q_rest))

        x0 = np.full(len(unknown), min(cap, free / (len(unknown) + 1)) / 2)
        res = optimize.minimize(objective, x0, method="SLSQP", bounds=[(1e-15, cap)] * len(unknown),
                                constraints=[{"type": "ineq", "fun": lambda x: free - x.sum()}],
                                options={"ftol": 1e-14, "maxiter": 500})
        if res.success and free - res.x.sum() >= -1e-12:  # (SLSQP may stop outside the constraints)
            solved += 1
            assert coarse[i] <= res.fun + 1e-9
            assert coarse[i] == pytest.approx(res.fun, rel=1e-3, abs=1e-9)
        # and no consistent candidate distribution is below it: random feasible points
        x = rng.uniform(0, cap, size=(200, len(unknown)))
        x *= np.minimum(1.0, free / x.sum(1))[:, None]
        assert min(objective(v) for v in x) >= coarse[i] - 1e-12
    assert checked >= 5 and solved >= 5


# ---- candidates and prompts ------------------------------------------------------------------------------

def test_candidate_shorthands_and_specs():
    cands = fid.parse_candidates("bf16,bf16-alone,fp8,fp8-kv,fp8+fp8-kv,fp16+alone")
    got = {c.name: (c.options, c.mode) for c in cands}
    assert got == {"bf16": ({"dtype": "bfloat16"}, "batched"), "bf16-alone": ({"dtype": "bfloat16"}, "alone"),
                   "fp8": ({"quantization": "fp8"}, "batched"), "fp8-kv": ({"kv_cache_dtype": "fp8"}, "batched"),
                   "fp8+fp8-kv": ({"quantization": "fp8", "kv_cache_dtype": "fp8"}, "batched"),
                   "fp16+alone": ({"dtype": "float16"}, "alone")}
    bi = fid.parse_candidates("bf16+bi,bf16+bi-alone")
    assert [(c.options, c.mode) for c in bi] == [({"dtype": "bfloat16", "batch_invariant": True}, "batched"),
                                                 ({"dtype": "bfloat16", "batch_invariant": True}, "alone")]
    assert fid.unknown_options(bi[0]) == []
    spec = fid.parse_candidate_spec('name=x,dtype=bfloat16,mode=alone,max_num_seqs=8,enforce_eager=true,'
                                    'speculative_config={"method": "ngram", "num_speculative_tokens": 2}')
    assert (spec.name, spec.mode) == ("x", "alone")
    assert spec.options == {"dtype": "bfloat16", "max_num_seqs": 8, "enforce_eager": True,
                            "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
    assert fid.unknown_options(spec) == []
    assert fid.unknown_options(fid.parse_candidate_spec("max_num_seq=4")) == ["max_num_seq"]
    with pytest.raises(ConfigError, match="did you mean 'bf16'"):
        fid.parse_candidates("bf61")


def test_an_unknown_candidate_option_fails_before_loading(tmp_path, capsys):
    rc = main(["bench", "fidelity", "--device", "cpu", "--candidates", "", "--candidate", "max_num_seq=4",
               "--out", str(tmp_path)])
    assert rc == 2
    assert "max_num_seq" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_the_packaged_prompt_set():
    name, prompts = fid.load_prompts()
    kinds = {p["kind"] for p in prompts}
    assert len(prompts) >= 64 and kinds == {"chat", "code", "prose"}
    assert len({p["id"] for p in prompts}) == len(prompts)
    assert all(p["messages"] for p in prompts if p["kind"] == "chat")
    four = fid.select_prompts(prompts, 4)
    assert [p["kind"] for p in four] == ["chat", "code", "prose", "chat"]
    # shipped with the package: pyproject's package data covers the file
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["tokenmill.bench"]
    rel = os.path.relpath(fid.DEFAULT_PROMPTS, os.path.dirname(fid.__file__))
    assert any(fnmatch.fnmatch(rel, pat) for pat in patterns)


# ---- end to end ------------------------------------------------------------------------------------------

def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def run_result(tmp_path_factory):
    """One CLI run: fp32 and bf16 candidates against the fp32 reference, one that cannot start, and HF
    fp32 when transformers is installed."""
    out = tmp_path_factory.mktemp("fidelity")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(["bench", "fidelity", "--device", "cpu", "--num-prompts", "4", "--output-len", "8",
                   "--candidates", "fp32,bf16", "--candidate", "name=bad,max_model_len=1",
                   "--hf", "fp32" if _has_transformers() else "none",
                   "--out", str(out), "--tag", "t"])
    assert rc == 0
    files = list(out.iterdir())
    assert [f.name for f in files] == ["fidelity-smollm2-135m-instruct-4x8-t.json"]
    with open(files[0]) as f:
        return json.load(f), stdout.getvalue()


def _by_name(result, name):
    return next(e for e in result["candidates"] + (result["hf_peers"] or []) if e["name"] == name)


def test_cli_writes_the_documented_json(run_result):
    r, printed = run_result
    assert r["kind"] == "fidelity" and r["tag"] == "t" and r["device"] == "cpu"
    for key in ("git_commit", "device_name", "versions", "date", "command", "model", "workload", "reference",
                "candidates", "hf_peers", "kl_definition", "summary", "logprobs_k"):
        assert key in r, key
    assert r["git_commit"] and r["versions"]["torch"]
    w = r["workload"]
    assert w["num_prompts"] == 4 and w["output_len"] == 8 and w["kinds"] == {"chat": 2, "code": 1, "prose": 1}
    assert w["chat_rendering"] == "chat template" and len(w["prompt_tokens"]) == 4
    ref = r["reference"]
    assert ref["engine"]["dtype"] == "float32" and ref["engine"]["quantization"] is None
    assert len(ref["per_prompt_tokens"]) == 4 and ref["output_tokens"] == sum(ref["per_prompt_tokens"]) > 0
    assert 0.5 <= ref["teacher_forced_argmax_equals_greedy"] <= 1.0
    assert r["logprobs_k"] == K and r["exact_kl"] is True
    # the capture put every full row at its position: its logprobs are the engine's reported ones
    assert r["exact_kl_rows_check_max_abs_diff"] < 1e-4
    assert [c["name"] for c in r["candidates"]] == ["fp32", "bf16", "bad"]
    bad = r["candidates"][2]  # a configuration that cannot start is reported, and the others still run
    assert bad["metrics"] is None and "max_model_len" in bad["error"] and r["summary"]["bad"]["status"] == "error"
    for c in r["candidates"][:2]:
        assert c["engine"]["dtype"] == c["options"]["dtype"] and c["mode"] == "batched"
        g, t = c["metrics"]["greedy"], c["metrics"]["teacher_forced"]
        assert len(g["per_prompt_matched"]) == 4 and g["reference_tokens"] == ref["output_tokens"]
        assert all(0 <= m <= n for m, n in zip(g["per_prompt_matched"], ref["per_prompt_tokens"]))
        assert g["token_agreement"] == pytest.approx(sum(g["per_prompt_matched"]) / ref["output_tokens"])
        assert t["positions"] == ref["output_tokens"] and len(t["per_prompt_kl_exact_mean"]) == 4
        assert set(r["summary"][c["name"]]) >= {"token_agreement", "prompts_identical", "top1_agreement",
                                                 "kl_coarse_mean", "kl_exact_mean"}
        assert c["name"] in printed
    assert "greedy agree" in printed and "KL exact" in printed


def test_fp32_candidate_equals_the_reference(run_result):
    r, _ = run_result
    g, t = _by_name(r, "fp32")["metrics"]["greedy"], _by_name(r, "fp32")["metrics"]["teacher_forced"]
    assert g["token_agreement"] == 1.0 and g["prompts_identical"] == 1.0
    assert g["per_prompt_first_divergence"] == [None] * 4
    assert t["top1_agreement"] == 1.0
    assert t["kl_coarse_mean"] < 1e-6 and t["kl_exact_mean"] < 1e-6


def test_bf16_candidate_diverges_measurably(run_result):
    r, _ = run_result
    c = _by_name(r, "bf16")["metrics"]
    g, t = c["greedy"], c["teacher_forced"]
    for x in (g["token_agreement"], g["prompts_identical"], t["top1_agreement"]):
        assert x is not None and 0.0 <= x <= 1.0
    assert t["kl_nonfinite_positions"] == {"coarse": 0, "exact": 0}
    assert t["kl_exact_mean"] > 1e-6 and t["kl_coarse_mean"] > 0
    assert t["kl_coarse_mean"] <= t["kl_exact_mean"] * (1 + 1e-6)  # the coarsening only loses divergence
    assert np.isfinite(t["kl_exact_max"]) and t["kl_exact_max"] >= t["kl_exact_mean"]
    assert all(x is not None and x >= 0 for x in t["per_prompt_kl_exact_mean"])


@pytest.mark.skipif(not _has_transformers(), reason="needs transformers")
def test_hf_fp32_peer_agrees_with_the_reference(run_result):
    r, printed = run_result
    peer = _by_name(r, "hf-fp32")
    assert peer["error"] is None and peer["dtype"] == "float32" and peer["transformers_version"]
    g, t = peer["metrics"]["greedy"], peer["metrics"]["teacher_forced"]
    assert g["token_agreement"] == 1.0 and g["prompts_identical"] == 1.0
    assert t["top1_agreement"] == 1.0
    assert t["kl_exact_mean"] < 1e-5  # the same weights in the same precision: rounding only
    assert "hf-fp32" in printed
