#!/usr/bin/env bash
# LoRA on the GPU, side by side with the base model in one call: offline-8b without adapters and with
# 8 rank-16 adapters spread evenly over the requests, latency-8b without and with one rank-16 adapter,
# then the LoRA GPU tests. Results (JSON) and logs go to $OUT; status.txt lists each part's exit code.
#   OUT=/tmp/x bash benchmarks/lora_gpu_check.sh        (REPEAT: offline runs, default 1; T: seconds a part;
#   PARTS: which parts, default "8b-base 8b-lora lat-base lat-lora gpu-tests kernel-tests")
set -u
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
PARTS=${PARTS:-8b-base 8b-lora lat-base lat-lora gpu-tests kernel-tests}
source "$(dirname "$0")/_gpu_parts.sh"
part 8b-base "${B[@]}" throughput --workload offline-8b --repeat "${REPEAT:-1}" --cuda-graph-max-batch 128 \
    --out "$OUT" --tag base --no-plot
part 8b-lora "${B[@]}" throughput --workload offline-8b --repeat "${REPEAT:-1}" --cuda-graph-max-batch 128 \
    --num-loras 8 --lora-rank 16 --out "$OUT" --tag lora8-r16 --no-plot
part lat-base "${B[@]}" latency --workload latency-8b --repeat 3 --cuda-graph-max-batch 8 --out "$OUT" --tag base \
    --no-plot
part lat-lora "${B[@]}" latency --workload latency-8b --repeat 3 --cuda-graph-max-batch 8 --num-loras 1 \
    --lora-rank 16 --out "$OUT" --tag lora1-r16 --no-plot
part gpu-tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu/test_lora_cuda.py
part kernel-tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/kernels/test_lora_epilogue.py tests/kernels/test_lora_kernels.py tests/kernels/test_skinny_gemm.py \
    tests/kernels/test_qkv_rope_gemv.py
