#!/usr/bin/env bash
# DeepSeek's multi-head latent attention on the GPU in one call: its GPU tests (the latent decode
# kernel against its reference at kv_lora_rank 512 / rope 64 with 16 and 128 heads and 4k-32k contexts
# in bf16, inside a CUDA graph; the interpreter tests' CUDA cases; DeepSeek's grouped routing kernel;
# the tiny DeepSeek-V2 / V3 models on CUDA with graphs and eager against HF), the decode kernel's bandwidth over the latent bytes against
# copy bandwidth (benchmarks/mla_decode_bench.py; target >= 70%), on request its launch sweep, and the
# DeepSeek-V2-Lite workloads (latency-deepseek with graphs and eager, offline-deepseek).
#   OUT=/tmp/x bash benchmarks/mla_gpu_check.sh
#   OUT=/tmp/x PARTS="sweep" bash benchmarks/mla_gpu_check.sh
#   knobs: PARTS (default "tests kbench latency latency-eager offline"; also sweep), T (seconds a part
#   may take, default 170), KBENCH_ARGS (default: 16 and 128 heads)
# $OUT gets each part's log, status.txt, mla_tests.xml, mla_decode.json (mla_sweep.json) and the bench
# JSON (bench/).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
PARTS=${PARTS:-tests kbench latency latency-eager offline}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
source benchmarks/_gpu_parts.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
git rev-parse HEAD > "$OUT/git.txt" 2>&1

part tests "$PY" -m pytest -q -rs --maxfail=8 -p no:cacheprovider -m gpu --junitxml "$OUT/mla_tests.xml" \
    tests/gpu/test_mla_cuda.py tests/kernels/test_mla_attention.py tests/gpu/test_families_cuda.py \
    tests/kernels/test_fused_moe.py -k "mla or deepseek or grouped"
part kbench "$PY" benchmarks/mla_decode_bench.py ${KBENCH_ARGS:---heads 16 128} --out "$OUT/mla_decode.json"
part sweep "$PY" benchmarks/mla_decode_bench.py --heads 16 --batches 1 8 32 64 --contexts 4096 32768 --sweep \
    --out "$OUT/mla_sweep.json"
# DeepSeek-V2-Lite's bf16 weights take 31 GB.
part latency "${B[@]}" latency --workload latency-deepseek --repeat 3 --out "$OUT/bench" --no-plot
part latency-eager "${B[@]}" latency --workload latency-deepseek --repeat 3 --enforce-eager --tag eager \
    --out "$OUT/bench" --no-plot
part offline "${B[@]}" throughput --workload offline-deepseek --out "$OUT/bench" --no-plot
echo "done" >> "$OUT/status.txt"
