"""Two torchrun "nodes" on the loopback interface (two torchrun invocations, --nnodes 2, one process
each) serve one model with tensor parallelism 2: node 0's rank 0 runs the server and the engine,
node 1's rank 1 is its worker; the completions equal a single process's greedy tokens."""

import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.server.conftest import free_port
from tests.test_hf_dir_models import _save_random_hf_model
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3], [8, 8, 1, 200, 31, 77, 64], [400, 2, 11]]


def _torchrun(node: int, master_port: int, model: str, port: int, log):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(master_port),
           "-m", "tokenmill.entrypoints.cli", "serve", model, "--tensor-parallel-size", "2", "--device", "cpu",
           "--dtype", "float32", "--num-kv-blocks", "128", "--max-num-seqs", "8", "--port", str(port)]
    env = dict(os.environ)
    env.pop("TOKENMILL_API_KEY", None)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow
def test_two_torchrun_nodes_serve_one_model(tmp_path):
    _save_random_hf_model("llama3.1", False, tmp_path)
    model, port, master = str(tmp_path), free_port(), free_port()
    logs = [tempfile.NamedTemporaryFile("w+", suffix=f"-node{n}.log", delete=False) for n in (0, 1)]
    nodes = [_torchrun(n, master, model, port, logs[n]) for n in (0, 1)]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert all(p.poll() is None for p in nodes), [open(f.name).read()[-3000:] for f in logs]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, [open(f.name).read()[-3000:] for f in logs]
            time.sleep(0.5)
        body = {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        single = LLM(model, dtype="float32", device="cpu", num_kv_blocks=128)
        want = [o.outputs[0].token_ids for o in single.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
        assert got == want
    finally:
        for p in reversed(nodes):
            if p.poll() is None:
                p.terminate()
        for p in nodes:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
