"""Host cost of the engine-process channel per step, for B running requests that each got one new
token (plain decoding) after `--context` generated tokens. No model, no GPU, no sockets: the
serialisation and bookkeeping alone, which both processes do on their step path.

- engine side, from state (what core_process does): `state_delta` of each request read from the
  OutputProcessor's live state, then msgpack;
- engine side, through RequestOutputs (the alternative it replaced: OutputProcessor.make_output,
  which copies each request's cumulative token and logprob lists, then `output_delta`), for comparison;
- API server side: unpack, then EngineCoreClient._apply (RequestOutputs rebuilt for the
  detokenizing thread).

    python benchmarks/engine_channel_bench.py --batch 256 --context 300 --out channel.json
"""

import argparse
import json
import os
import time

import numpy as np

from tokenmill.serve.core_client import EngineCoreClient, _Live, _Sample
from tokenmill.serve.core_wire import RequestProgress, output_delta, pack, state_delta, unpack
from tokenmill.engine.engine_snapshot import EngineSnapshot
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.outputs import Logprob
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=300, help="tokens each request has generated already")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--logprobs", type=int, default=0, help="top-k logprobs per token (0: none)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    B, T, k = args.batch, args.context, args.logprobs
    params = SamplingParams(max_tokens=T + args.steps + 1, logprobs=k if k else None)
    processor = OutputProcessor(None, detokenize=False)
    requests = []
    for i in range(B):
        r = Request(f"0/r{i}", [1] * 100, params, 0, T + args.steps + 1, frozenset())
        processor.add(r.request_id, None, r.prompt_token_ids, [r])
        requests.append(r)
    engine_progress = [RequestProgress() for _ in range(B)]
    copy_progress = [RequestProgress() for _ in range(B)]
    client = EngineCoreClient.__new__(EngineCoreClient)  # the API server's side, fed the messages directly
    client._live = {f"r{i}": _Live(None, [1] * 100, [_Sample(logprobs=[] if k else None)], 0.0) for i in range(B)}
    client._gc_pauses, client._adds_taken, client._unseen_adds = [], 0, []
    snapshot = EngineSnapshot().to_wire()
    times = {"engine_from_state": [], "engine_through_outputs": [], "server": []}
    sizes = []

    def grow(n: int) -> None:  # each request's sample gets tokens up to n
        for r in requests:
            state = processor.states[r.request_id].samples[0]
            while len(r.output_token_ids) < n:
                t = int(rng.integers(0, 128000))
                r.output_token_ids.append(t)
                if state.logprobs is not None:
                    state.logprobs.append({t: Logprob(-1.0, 1)} | {j: Logprob(-2.0, j + 2) for j in range(k)})
                    state.cumulative_logprob = (state.cumulative_logprob or 0.0) - 1.0

    for step in range(args.steps):
        grow(T + step)
        ids = [r.request_id for r in requests]
        t0 = time.perf_counter()
        deltas = [state_delta(processor.states[rid], engine_progress[i]) for i, rid in enumerate(ids)]
        data = pack(["step", step, "decode", deltas, snapshot, [], 0])
        t1 = time.perf_counter()
        copied = [output_delta(processor.make_output(rid), copy_progress[i]) for i, rid in enumerate(ids)]
        pack(["step", step, "decode", copied, snapshot, [], 0])
        t2 = time.perf_counter()
        got = client._handle(unpack(data))
        t3 = time.perf_counter()
        assert len(got) == B and copied == deltas
        if step:  # the first step sends every earlier token at once
            times["engine_from_state"].append(t1 - t0)
            times["engine_through_outputs"].append(t2 - t1)
            times["server"].append(t3 - t2)
            sizes.append(len(data))
    res = {"batch": B, "context": T, "logprobs": k, "cpu_count": os.cpu_count(),
           "message_bytes_median": int(np.median(sizes))}
    res.update({f"{name}_ms_median": 1e3 * float(np.median(v)) for name, v in times.items()})
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
