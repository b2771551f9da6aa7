#!/usr/bin/env bash
# The model families beyond Llama on the GPU in one call: their GPU tests (each family's tiny random
# HF model with graphs and eager against HF, the new attention kernels' sweeps), each family preset's
# latency workload with CUDA graphs and eager (medians of 3) and its offline workload, and `bench
# fidelity` of the real Gemma 3 270M GGUF in bf16 beside HF bf16.
#   OUT=/tmp/x bash benchmarks/families_gpu_check.sh
#   OUT=/tmp/x PARTS="latency-gemma offline-gemma" bash benchmarks/families_gpu_check.sh
#   knobs: PARTS (default: tests, mla-kbench, then latency-F latency-F-eager offline-F for each F in
#   FAMILIES, then fidelity), FAMILIES (default "gemma gpt-oss deepseek"), T (seconds a part may take, default 170), GEMMA_GGUF (the
#   270M file; the fidelity part is skipped without it), FIDELITY_PROMPTS (default 16)
# $OUT gets each part's log, status.txt, families_tests.xml, the bench JSON (bench/) and fidelity/.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
FAMILIES=${FAMILIES:-gemma gpt-oss deepseek}
if [[ -z "${PARTS:-}" ]]; then
    PARTS="tests mla-kbench"
    for f in $FAMILIES; do PARTS="$PARTS latency-$f latency-$f-eager offline-$f"; done
    PARTS="$PARTS fidelity"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
source benchmarks/_gpu_parts.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
git rev-parse HEAD > "$OUT/git.txt" 2>&1

TESTS=(tests/gpu/test_families_cuda.py)
for f in tests/gpu/test_gpt_oss_cuda.py tests/gpu/test_mla_cuda.py tests/kernels/test_attention_softcap.py \
         tests/kernels/test_attention_sinks.py tests/kernels/test_mla_attention.py tests/kernels/test_fused_moe_bias.py; do
    [[ -f $f ]] && TESTS+=("$f")
done
part tests "$PY" -m pytest -q -rs --maxfail=8 -p no:cacheprovider -m gpu --junitxml "$OUT/families_tests.xml" "${TESTS[@]}"
# MLA's decode kernel over the latent cache bytes against copy bandwidth (target >= 70 %)
part mla-kbench "$PY" benchmarks/mla_decode_bench.py --heads 16 128 --out "$OUT/mla_decode.json"
for f in $FAMILIES; do
    part "latency-$f" "${B[@]}" latency --workload "latency-$f" --repeat 3 --out "$OUT/bench" --no-plot
    part "latency-$f-eager" "${B[@]}" latency --workload "latency-$f" --repeat 3 --enforce-eager --tag eager \
        --out "$OUT/bench" --no-plot
    part "offline-$f" "${B[@]}" throughput --workload "offline-$f" --out "$OUT/bench" --no-plot
done
if [[ -n "${GEMMA_GGUF:-}" ]]; then
    part fidelity "${B[@]}" fidelity --model "$GEMMA_GGUF" --device cuda --candidates bf16 --hf bfloat16 \
        --num-prompts "${FIDELITY_PROMPTS:-16}" --out "$OUT/fidelity"
fi
echo "done" >> "$OUT/status.txt"
