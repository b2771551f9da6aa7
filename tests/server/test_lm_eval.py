"""lm-evaluation-harness's `local-completions` model against the real server, on a small local
multiple-choice loglikelihood task (tests/data/lm_eval/): it sends each context + choice as token
ids with echo, logprobs 1 and max_tokens 1 and sums the prompt logprobs of the choice's tokens. Each
choice's loglikelihood is compared with HF transformers' own over the same tokens."""

import os
import shutil

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

DATA = os.path.join(os.path.dirname(__file__), os.pardir, "data", "lm_eval")
DOCS = 4  # of the task's 22: each one is 4 requests through the server and 4 HF forward passes


@pytest.mark.slow
def test_lm_eval_local_completions_matches_hf(chunked_server, smollm, hf_smollm, tmp_path, monkeypatch):
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from tokenmill.loader.gguf_loader import convert_gguf_to_hf_dir
    from tokenmill.loader.resolve import embedded_model_path

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = chunked_server  # 8-token steps: contexts prefill in chunks (tests/server/conftest.py)
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    shutil.copy(os.path.join(DATA, "tiny_mc.jsonl"), task_dir / "tiny_mc.jsonl")
    yaml = open(os.path.join(DATA, "tiny_mc.yaml")).read().replace("DATA_FILE", str(task_dir / "tiny_mc.jsonl"))
    (task_dir / "tiny_mc.yaml").write_text(yaml)

    seen = []  # (tokens, context length, (loglikelihood, is_greedy)) of every request lm-eval sent
    parse = LocalCompletionsAPI.parse_logprobs

    def recording(outputs, tokens=None, ctxlens=None, **kwargs):
        results = parse(outputs, tokens=tokens, ctxlens=ctxlens, **kwargs)
        seen.extend(zip(tokens, ctxlens, results))
        return results

    monkeypatch.setattr(LocalCompletionsAPI, "parse_logprobs", staticmethod(recording))
    tokenizer_dir = convert_gguf_to_hf_dir(embedded_model_path())
    model_args = (f"model=smollm2-135m-instruct,base_url={server.base_url}/completions,tokenizer={tokenizer_dir},"
                  "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=2,max_retries=1")
    results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=["tokenmill_tiny_mc"],
                                      task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                      limit=DOCS)
    samples = results["samples"]["tokenmill_tiny_mc"]
    assert len(samples) == DOCS and len(seen) == DOCS * 4
    for tokens, ctxlen, (loglik, is_greedy) in seen:
        with torch.no_grad():
            logits = hf_smollm(torch.tensor([tokens])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        cont = range(ctxlen, len(tokens))
        ref = sum(lp[i - 1, tokens[i]].item() for i in cont)
        assert abs(loglik - ref) < 1e-3, (tokens, ctxlen, loglik, ref)
        assert is_greedy == all(int(lp[i - 1].argmax()) == tokens[i] for i in cont)
    # The harness scored every document from those same values.
    for s in samples:
        assert len(s["filtered_resps"]) == 4
    acc = results["results"]["tokenmill_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    server.wait_idle()
