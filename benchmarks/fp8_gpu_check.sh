#!/usr/bin/env bash
# FP8 weights and the FP8 KV cache on the GPU, side by side with bf16 in one call: the FP8 GPU tests,
# the FP8 GEMV sweep, a profile of a batch-1 FP8 decode, then latency-8b, prefill-8b and offline-8b
# without and with --quantization fp8 (and --kv-cache-dtype fp8 for offline-8b), Llama-3.1-8B preset,
# dummy weights. Results (JSON) and logs go to $OUT; status.txt lists each part's exit code and seconds.
#   OUT=/tmp/x bash benchmarks/fp8_gpu_check.sh   (REPEAT: offline/prefill runs, default 1; T: seconds a part;
#   PARTS: default "tests sweep profile lat-bf16 lat-fp8 prefill-bf16 prefill-fp8 8b-bf16 8b-fp8 8b-fp8kv";
#   also "profile-8b": where a step of offline-8b with FP8 weights and the FP8 cache spends its time;
#   sweep: the FP8 batch-1 GEMV's tile configs at Llama-3.1-8B shapes, benchmarks/kernel_bench.py --skinny-fp8)
set -u
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
PARTS=${PARTS:-tests sweep profile lat-bf16 lat-fp8 prefill-bf16 prefill-fp8 8b-bf16 8b-fp8 8b-fp8kv}
source "$(dirname "$0")/_gpu_parts.sh"
part tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/quantization/test_fp8.py tests/kernels/test_kv_fp8.py \
    tests/kernels/test_fp8_gemm.py tests/kernels/test_fp8_prologue_quant.py \
    tests/kernels/test_attention.py tests/kernels/test_qkv_prep.py tests/kernels/test_qkv_rope_gemv.py \
    tests/gpu/test_fp8_cuda.py
part profile "${B[@]}" profile --workload latency-8b --quantization fp8 --cuda-graph-max-batch 8 --skip-steps 40 \
    --steps 20 --out "$OUT" --tag fp8
part profile-8b "${B[@]}" profile --workload offline-8b --quantization fp8 --kv-cache-dtype fp8 \
    --cuda-graph-max-batch 128 --skip-steps 150 --steps 20 --out "$OUT" --tag fp8-fp8kv
part sweep "$PY" benchmarks/kernel_bench.py --skinny-fp8 --skinny-rows 1 --skip-attention --skip-small-ops \
    --models llama3.1-8b --out "$OUT/kernel-bench-skinny-fp8.json"
part lat-bf16 "${B[@]}" latency --workload latency-8b --repeat 3 --cuda-graph-max-batch 8 --out "$OUT" --tag bf16 --no-plot
part lat-fp8 "${B[@]}" latency --workload latency-8b --repeat 3 --cuda-graph-max-batch 8 --quantization fp8 \
    --out "$OUT" --tag fp8 --no-plot
part prefill-bf16 "${B[@]}" throughput --workload prefill-8b --repeat "${REPEAT:-1}" --out "$OUT" --tag bf16 --no-plot
part prefill-fp8 "${B[@]}" throughput --workload prefill-8b --repeat "${REPEAT:-1}" --quantization fp8 --out "$OUT" \
    --tag fp8 --no-plot
part 8b-bf16 "${B[@]}" throughput --workload offline-8b --repeat "${REPEAT:-1}" --cuda-graph-max-batch 128 \
    --out "$OUT" --tag bf16 --no-plot
part 8b-fp8 "${B[@]}" throughput --workload offline-8b --repeat "${REPEAT:-1}" --cuda-graph-max-batch 128 \
    --quantization fp8 --out "$OUT" --tag fp8 --no-plot
part 8b-fp8kv "${B[@]}" throughput --workload offline-8b --repeat "${REPEAT:-1}" --cuda-graph-max-batch 128 \
    --quantization fp8 --kv-cache-dtype fp8 --out "$OUT" --tag fp8-fp8kv --no-plot
