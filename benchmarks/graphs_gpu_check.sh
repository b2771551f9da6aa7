#!/usr/bin/env bash
# The one CUDA-graph bank on the GPU, in one call: the GPU tests of decode, verify, piecewise, LoRA and
# draft graphs and of the step path without syncs; then offline-small and latency-8b (dummy weights) on
# this tree and on a base tree side by side, alternating (new base / base new / ...), one timed run per
# process, ROUNDS rounds. Logs, status.txt (each part's exit code and seconds) and JSON go to $OUT;
# $OUT/graphs_ab.json holds each workload's medians per tree and this tree's ratio to the base.
#   mkdir -p build/base && git archive main tokenmill | tar -x -C build/base     # beforehand; carry build/base
#   OUT=/tmp/x bash benchmarks/graphs_gpu_check.sh
# PARTS: "tests bench" (default), "tests" or "bench"; ROUNDS: default 3; BASE_TREE: default build/base;
# BUDGET_S: seconds for the whole call, default 560 (parts past it are skipped and say so).
set -u
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
PARTS=${PARTS:-tests bench}
ROUNDS=${ROUNDS:-3}
BASE_TREE=${BASE_TREE:-build/base}
BUDGET_S=${BUDGET_S:-560}
START=$(date +%s)
source "$(dirname "$0")/_gpu_parts.sh"  # the carried wheels on PYTHONPATH
export PYTHONUNBUFFERED=1
NEW_PATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BASE_PATH="$PWD/$BASE_TREE${PYTHONPATH:+:$PYTHONPATH}"

want() { [[ " $PARTS " == *" $1 "* ]]; }

# step NAME LIMIT CMD...: CMD into $OUT/NAME.log within LIMIT seconds and what is left of the budget.
step() {
    local name=$1 limit=$2; shift 2
    local left=$(( START + BUDGET_S - $(date +%s) ))
    if (( left < 30 )); then
        echo "$name skipped (${left}s of the budget left)" | tee -a "$OUT/status.txt"
        return
    fi
    (( limit > left )) && limit=$left
    local t0; t0=$(date +%s)
    timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$OUT/status.txt"
}

# bench WORKLOAD TREE ROUND: one process of `tokenmill bench` on this tree (new) or the base tree.
bench() {
    local prefix=$1 tree=$2 round=$3 path=$NEW_PATH
    [ "$tree" = base ] && path=$BASE_PATH
    local dir="$OUT/runs/$prefix-$tree-$round"
    mkdir -p "$dir"
    local args=(throughput --workload offline-small)
    [ "$prefix" = lat ] && args=(latency --workload latency-8b --cuda-graph-max-batch 8)
    # -P: the working directory (this tree) does not go before PYTHONPATH
    step "$prefix-$tree-$round" 170 env PYTHONPATH="$path" "$PY" -P -m tokenmill.entrypoints.cli bench "${args[@]}" \
        --repeat 1 --out "$dir" --tag "$tree" --no-plot
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
git rev-parse HEAD > "$OUT/git.txt" 2>&1

if want tests; then
    step tests 330 env PYTHONPATH="$NEW_PATH" "$PY" -m pytest -q -rs -p no:cacheprovider \
        --junitxml "$OUT/graphs_gpu_tests.xml" tests/gpu/test_runner_cuda.py tests/gpu/test_spec_decode_cuda.py \
        tests/gpu/test_spec_draft_cuda.py tests/gpu/test_lora_cuda.py tests/gpu/test_no_sync.py
fi

if want bench; then
    if [ ! -d "$BASE_TREE/tokenmill" ]; then
        echo "bench skipped (no $BASE_TREE/tokenmill: make it with git archive, see the top of this script)" \
            | tee -a "$OUT/status.txt"
    else
        for tree in new base; do  # which tokenmill each side imports
            env PYTHONPATH="$( [ $tree = new ] && echo "$NEW_PATH" || echo "$BASE_PATH" )" "$PY" -P -c \
                "import tokenmill; print('$tree', tokenmill.__file__)" >> "$OUT/trees.txt" 2>&1
        done
        for round in $(seq 1 "$ROUNDS"); do
            order="new base"
            (( round % 2 == 0 )) && order="base new"
            for prefix in small lat; do
                for tree in $order; do
                    bench "$prefix" "$tree" "$round"
                done
            done
        done
        "$PY" "$(dirname "$0")/graphs_ab.py" "$OUT/runs" --out "$OUT/graphs_ab.json" | tee -a "$OUT/status.txt"
    fi
fi
