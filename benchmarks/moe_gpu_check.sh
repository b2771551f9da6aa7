#!/usr/bin/env bash
# The fused-MoE kernels on the GPU in one call: their GPU tests (sweeps against the torch reference with
# 16-bit and e4m3 experts, no host sync, graph capture, torch._grouped_mm, a tiny FP8 MoE model), the
# kernel bench's moe section (Triton, bf16 and e4m3 experts, against torch._grouped_mm at Qwen3-30B-A3B
# and Mixtral shapes) and the tile sweep (benchmarks/moe_tune.py); on request the MoE workloads:
# latency-moe, offline-moe, and offline-moe's first COMPARE_PROMPTS requests beside HF transformers (its
# Qwen3MoeForCausalLM; the whole workload would take it too long).
#   OUT=/tmp/x bash benchmarks/moe_gpu_check.sh
#   OUT=/tmp/x PARTS="latency offline compare" bash benchmarks/moe_gpu_check.sh   # the bench workloads
#   knobs: PARTS (default "tests kbench tune"; also latency, offline, latency-fp8, offline-fp8, profile,
#   compare), T (seconds a part may take, default 170), TUNE_ARGS (default --quick), KBENCH_ARGS (e.g.
#   --moe-tokens 1,8192), COMPARE_PROMPTS (default 32)
# $OUT gets each part's log, status.txt, moe_tests.xml, kernel_bench JSON, moe_tune.json and the
# bench JSON (bench/).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
PARTS=${PARTS:-tests kbench tune}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
source benchmarks/_gpu_parts.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
git rev-parse HEAD > "$OUT/git.txt" 2>&1

part tests "$PY" -m pytest -q -rs --maxfail=8 -p no:cacheprovider -m gpu --junitxml "$OUT/moe_tests.xml" \
    tests/kernels/test_fused_moe.py tests/quantization/test_fp8_moe.py
part kbench "$PY" benchmarks/kernel_bench.py --skip-small-ops --skip-skinny --skip-attention ${KBENCH_ARGS:-} \
    --out "$OUT/kernel_bench.json"
part tune "$PY" benchmarks/moe_tune.py ${TUNE_ARGS:---quick} --out "$OUT/moe_tune.json"
# Qwen3-30B-A3B's bf16 weights take 61 GB: on an 80 GB card the KV cache gets what is left.
part latency "${B[@]}" latency --workload latency-moe --repeat 3 --out "$OUT/bench" --no-plot
part offline "${B[@]}" throughput --workload offline-moe --out "$OUT/bench" --no-plot
# FP8 experts (online e4m3 quantization of every linear layer, the experts included) beside bf16
part latency-fp8 "${B[@]}" latency --workload latency-moe --repeat 3 --quantization fp8 --tag fp8 --out "$OUT/bench" \
    --no-plot
part offline-fp8 "${B[@]}" throughput --workload offline-moe --quantization fp8 --tag fp8 --out "$OUT/bench" --no-plot
part profile "${B[@]}" profile --workload latency-moe --skip-steps 40 --steps 20 --out "$OUT/bench"
part compare "${B[@]}" throughput --workload offline-moe --num-prompts "${COMPARE_PROMPTS:-32}" --compare transformers \
    --tag compare --out "$OUT/bench" --no-plot
