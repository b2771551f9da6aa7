#!/usr/bin/env bash
# Tensor-parallel workers on CUDA (2 GPUs: nvidia-h100-x2): an LLM(tensor_parallel_size=2) built by a
# script piped to `python -` (no main guard) generates; and with one GPU visible, TP=2's worker rank 1
# fails at start-up (no cuda:1) and the LLM(...) raises TPWorkerError with its error within seconds.
# Writes $OUT/tp_workers.json.   OUT=/tmp/x bash benchmarks/tp_workers_gpu_check.sh
set -u
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - > "$OUT/tp2.txt" 2> "$OUT/tp2.log" <<'SCRIPT'
import json, time
from tokenmill import LLM, SamplingParams
t = time.monotonic()
llm = LLM("tiny-llama", load_format="dummy", tensor_parallel_size=2, device="cuda")
out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print(json.dumps({"tokens": out[0].outputs[0].token_ids, "seconds": time.monotonic() - t}))
SCRIPT
echo "tp2 exit $?" >> "$OUT/status.txt"
CUDA_VISIBLE_DEVICES=0 "$PY" - > "$OUT/tp2_one_gpu.txt" 2> "$OUT/tp2_one_gpu.log" <<'SCRIPT'
import json, time
from tokenmill import LLM
from tokenmill.executor.tensor_parallel import TPWorkerError
t = time.monotonic()
try:
    LLM("tiny-llama", load_format="dummy", tensor_parallel_size=2, device="cuda")
    print(json.dumps({"raised": None}))
except TPWorkerError as e:
    print(json.dumps({"raised": "TPWorkerError", "seconds": time.monotonic() - t, "message": str(e)[-1500:]}))
SCRIPT
echo "tp2_one_gpu exit $?" >> "$OUT/status.txt"
"$PY" - "$OUT" <<'SCRIPT'
import json, sys
out = sys.argv[1]
def last(name):
    try:
        return json.loads(open(f"{out}/{name}").read().strip().splitlines()[-1])
    except Exception as e:
        return {"error": repr(e)}
json.dump({"tp2": last("tp2.txt"), "tp2_one_gpu": last("tp2_one_gpu.txt"),
           "status": open(f"{out}/status.txt").read().split("\n")}, open(f"{out}/tp_workers.json", "w"), indent=1)
SCRIPT
cat "$OUT/tp_workers.json"
