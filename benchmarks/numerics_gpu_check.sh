#!/usr/bin/env bash
# Batch-invariant mode on the GPU, side by side with the default in one call: its GPU tests, then
# offline-small and latency-8b without and with --batch-invariant (dummy weights). Results (JSON)
# and logs go to $OUT; status.txt lists each part's exit code and seconds.
#   OUT=/tmp/x bash benchmarks/numerics_gpu_check.sh   (REPEAT: runs of each benchmark, default 3;
#   T: seconds a part; PARTS: default "tests small small-bi lat lat-bi"; also "matmul": the
#   fixed-tile matmul's configs against cuBLAS, benchmarks/bi_matmul_bench.py)
# The fidelity figures (real weights) are `tokenmill bench fidelity --device cuda --candidates
# bf16,bf16-alone,bf16+bi,bf16+bi-alone --hf bf16` on the embedded model (docs/PERFORMANCE.md).
set -u
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
PARTS=${PARTS:-tests small small-bi lat lat-bi}
source "$(dirname "$0")/_gpu_parts.sh"
R=${REPEAT:-3}
part tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/kernels/test_batch_invariant.py \
    tests/kernels/test_qkv_prep.py tests/gpu/test_batch_invariant_cuda.py -k "not cpu or cuda"
part matmul "$PY" benchmarks/bi_matmul_bench.py --out "$OUT/bi_matmul_bench.json"
part small "${B[@]}" throughput --workload offline-small --repeat "$R" --out "$OUT" --tag default --no-plot
part small-bi "${B[@]}" throughput --workload offline-small --repeat "$R" --batch-invariant --out "$OUT" \
    --tag batch-invariant --no-plot
part lat "${B[@]}" latency --workload latency-8b --repeat "$R" --cuda-graph-max-batch 8 --out "$OUT" --tag default \
    --no-plot
part lat-bi "${B[@]}" latency --workload latency-8b --repeat "$R" --cuda-graph-max-batch 8 --batch-invariant \
    --out "$OUT" --tag batch-invariant --no-plot
