"""DPLockstep (engine/dp_lockstep.py) over gloo on the CPU: three ranks with unequal work (one with
none) agree on every step's padded size and graph mode with one all-reduce, and a rank without work
runs a dummy step of the agreed size on a real ModelRunner (tiny-llama, dummy weights)."""

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp



def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Per rank: (tokens scheduled, graphs possible) for each step. Rank 2 never has work; step 3 has none
# anywhere; rank 1 cannot use graphs in step 1.
WORK = [
    [(5, True), (3, True), (0, True), (0, True), (16, True)],
    [(2, True), (7, False), (1, True), (0, True), (0, True)],
    [(0, True), (0, True), (0, True), (0, True), (0, True)],
]
EXPECTED = [  # (padded with pad=next multiple of 4 when graphs are used, use_graphs, max, min)
    (8, True, 5, 0),
    (7, False, 7, 0),
    (4, True, 1, 0),
    (0, False, 0, 0),
    (16, True, 16, 0),
]


class RecordingRunner:
    """A real ModelRunner whose dummy_run calls are recorded."""

    def __init__(self):
        from tokenmill.config import EngineConfig
        from tokenmill.loader import load_model
        from tokenmill.runner.model_runner import ModelRunner

        loaded = load_model("tiny-llama", load_format="dummy", device="cpu", dtype="float32")
        config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_kv_blocks=8)
        self.runner = ModelRunner(loaded.model, config, 128, loaded.device, loaded.dtype)
        self.runner.initialize_kv_cache()
        self.calls: list[list] = []

    def dummy_run(self, num_tokens: int, num_reqs: int = 1, sample: bool = False, piecewise: bool = False,
                  lora=None):
        hidden = self.runner.dummy_run(num_tokens, num_reqs, sample=sample, piecewise=piecewise, lora=lora)
        self.calls.append([num_tokens, int(hidden.shape[0])])
        return hidden


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    from tokenmill.engine.dp_lockstep import DPLockstep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        runner = RecordingRunner()
        lockstep = DPLockstep(pad=lambda n: -(-n // 4) * 4)
        record = {"agreements": [], "real_steps": [], "ran_dummy": []}
        for step, (tokens, graph_ok) in enumerate(WORK[rank]):
            def real_step(agreement, tokens=tokens, step=step):
                record["real_steps"].append([step, tokens, agreement.padded_tokens])
                return tokens

            result = lockstep.run_step(runner, tokens, graph_ok, real_step)
            a = result.agreement
            record["agreements"].append([a.padded_tokens, a.use_graphs, a.max_tokens, a.min_tokens])
            record["ran_dummy"].append(result.ran_dummy)
            assert (result.output == tokens) if tokens else result.output is None
        record["dummy_calls"] = runner.calls
        record["dummy_steps"] = lockstep.dummy_steps
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("lockstep")
    world = len(WORK)
    mp.spawn(_rank_main, args=(world, free_port(), str(out)), nprocs=world, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_every_rank_gets_the_same_agreement(records):
    expected = [list(e) for e in EXPECTED]
    for rank, record in enumerate(records):
        assert record["agreements"] == expected, rank


def test_a_rank_without_work_runs_dummy_steps_of_the_agreed_size(records):
    idle = records[2]
    assert idle["real_steps"] == []
    assert idle["ran_dummy"] == [True, True, True, False, True]  # not when no rank has work (step 3)
    assert idle["dummy_calls"] == [[8, 8], [7, 7], [4, 4], [16, 16]]  # the real runner ran that many tokens
    assert idle["dummy_steps"] == 4


def test_ranks_with_work_run_their_own_steps_and_dummies_when_they_run_out(records):
    r0, r1 = records[0], records[1]
    assert r0["real_steps"] == [[0, 5, 8], [1, 3, 7], [4, 16, 16]]
    assert r0["dummy_calls"] == [[4, 4]]  # step 2: rank 1 has one token, rank 0 none
    assert r1["real_steps"] == [[0, 2, 8], [1, 7, 7], [2, 1, 4]]
    assert r1["dummy_calls"] == [[16, 16]]
    assert [r["ran_dummy"][3] for r in records] == [False, False, False]


def test_an_agreement_with_no_tokens_is_idle():
    from tokenmill.engine.dp_lockstep import StepAgreement

    assert StepAgreement(0, False, 0, 0).idle and not StepAgreement(3, True, 3, 0).idle
