#!/usr/bin/env bash
# tokenmill on the GPU in one call: GPU tests, kernel micro-benchmark, standard benchmarks.
#
#   OUT=/some/dir PHASES="tests kernels small latency" bash benchmarks/gpu_check.sh
#
# Phases (run in the order given; each is guarded, so one failure does not stop the rest):
#   tests     pytest -m gpu tests/kernels, then tests/gpu tests/runner tests/test_sliding_window.py -> $OUT/gpu_tests.xml
#   kernels   benchmarks/kernel_bench.py --quick                -> $OUT/kernel_bench.json
#   gemv      kernel_bench's batch-1 GEMV sweep only (Llama-3.1-8B shapes) -> $OUT/kernel_bench_gemv.json
#   overhead  benchmarks/step_overhead.py: host vs device time of eager (prefill / mixed) steps, Llama-3.1-8B
#             preset, with a host profile                          -> $OUT/step_overhead.json
#   small     offline-small throughput, defaults, $REPEAT runs (default 3)
#   eager     offline-small throughput, --enforce-eager, 1 run
#   noasync   offline-small throughput, --no-async-scheduling, 1 run
#   latency   latency-8b (batch-1 decode), $LAT_REPEAT runs (default 5)
#   latency-unfused  the same with --no-fused-small-batch-linear (cuBLAS + separate norm/activation)
#   latency-base  latency-8b from the tokenmill package in $BASE_TREE (an earlier commit, for a side-by-side
#             A/B on the same GPU; make it with `mkdir -p build/base && git archive REV tokenmill | tar -x -C
#             build/base` and carry build/base), tagged base
#   small-base  offline-small from the tokenmill package in $BASE_TREE, $REPEAT runs, tagged base (see latency-base)
#   latency-spec  latency-8b with speculation: $SPEC_CONFIG (default n-gram, k = 3, synthetic acceptance
#             0.7), $LAT_REPEAT runs, tagged spec (side by side with `latency` in the same call)
#   small-spec  offline-small with n-gram speculation (k = 3, real lookups: random prompts match
#             nothing), $REPEAT runs, tagged spec-ngram
#   serve-spec  serve-8b as `serve`, with $SPEC_CONFIG, tagged spec
#   structured  bench structured: structured-small (Qwen3-0.6B preset, batch 64) with and without
#             JSON-schema grammars, $REPEAT runs; the grammars use the tokenizer $TOKENIZER (default
#             smollm2-135m-instruct: the embedded model's, from the installed package or a GGUF path)
#   8b        offline-8b throughput, $REPEAT runs
#   prefill   prefill-8b throughput, $REPEAT runs
#   serve     serve-8b through `tokenmill serve` (launched here), Poisson at $SERVE_RATE req/s (default 8);
#             $SERVE_EXTRA goes to the server's flags, $SERVE_REQUESTS bounds the requests
#   serve-sweep  serve-8b on one launched server at each of $SERVE_RATES req/s (default "8,16,32,64"), then
#             `--goodput` (the highest rate with ITL p99 <= 30 ms and TTFT p99 <= 1000 ms: doubling from 8,
#             then 3 bisections, 200 requests a probe); $SERVE_EXTRA goes to the server's flags (e.g.
#             "--step-time-target-ms 25"), $SERVE_REQUESTS (default: the workload's 500) bounds the
#             requests per rate and per probe; tagged sweep. Per rate: output tok/s, TTFT, ITL, mixed steps and
#             the server's gen-2 GC pauses (`python -m tokenmill.bench.report serve-table bench.json` prints
#             them as a markdown table; the phase prints it too). Other goodput flags through BENCH_ARGS
#             in a call of this phase alone (e.g. BENCH_ARGS="--goodput-itl-p99-ms 25"). With 500 requests a
#             rate the phase takes most of a call: run it alone, or with SERVE_REQUESTS=200
#   compare   offline-small throughput, 1 run, then transformers continuous batching on the same requests
#   profile   `tokenmill bench profile` (torch profiler, per-kernel time) of latency-8b decode and of
#             full-batch offline-small decode                      -> $OUT/profiles.tar.gz
# Default PHASES: "tests kernels small eager noasync latency". A device call is limited to 10 minutes:
# run the long phases in calls of their own (e.g. PHASES=compare; PHASES="8b prefill"; PHASES=serve).
#
# What comes back under $OUT (at most 8 files, no folders): gpu_kernel_tests.xml, gpu_tests.xml,
# kernel_bench.json, profiles.tar.gz, bench.json (every benchmark result of this call, merged; rewritten after each phase), bench.png (one
# combined figure), summary.txt (the summary table) and gpu_check.log (everything, tee'd).
# Scratch results go to a fresh temporary directory outside $OUT.
#
# Environment: OUT, PHASES, REPEAT, LAT_REPEAT, SERVE_RATE, SERVE_RATES, SERVE_EXTRA, SERVE_REQUESTS, SPEC_CONFIG, TOKENIZER, BASE_TREE (default build/base), PROFILES (workloads the profile phase
# traces, default "latency-8b offline-small"), PYTHON (default python3), BUDGET_S (seconds
# this script may take in all, default 585: each phase gets what is left, minus a margin for the final
# merge, and is interrupted with SIGINT when it runs out), BENCH_ARGS (extra flags for every bench).

set -o pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

OUT=${OUT:-$PWD/gpu-check-out}
PHASES=${PHASES:-"tests kernels small eager noasync latency"}
REPEAT=${REPEAT:-3}
LAT_REPEAT=${LAT_REPEAT:-5}
SERVE_RATE=${SERVE_RATE:-8}
SERVE_RATES=${SERVE_RATES:-"8,16,32,64"}
SERVE_EXTRA=${SERVE_EXTRA:-}
SERVE_REQUESTS=${SERVE_REQUESTS:-}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-585}
BENCH_ARGS=${BENCH_ARGS:-}
PROFILES=${PROFILES:-"latency-8b offline-small"}
BASE_TREE=${BASE_TREE:-build/base}
TOKENIZER=${TOKENIZER:-smollm2-135m-instruct}
SPEC_CONFIG=${SPEC_CONFIG:-'{"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance": 0.7}'}
NGRAM_CONFIG='{"method": "ngram", "num_speculative_tokens": 3}'
MARGIN_S=25

mkdir -p "$OUT"
# The server's dependencies are not on the GPU machine: install the wheels carried in .whl/
# (benchmarks/fetch_server_wheels.sh downloads them).
# Each run installs into a folder of its own: two runs side by side (one per GPU) must not
# install into the same folder at the same time (a half-written package makes `serve` unavailable).
if compgen -G ".whl/*.whl" > /dev/null; then
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/tm-site.XXXXXX")
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:$SITE"
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tokenmill-gpu-check.XXXXXX")
RES="$WORK/results"
mkdir -p "$RES"
LOG="$OUT/gpu_check.log"
START=$(date +%s)
STATUS=()

log() { echo "$*" | tee -a "$LOG"; }

remaining() { echo $(( START + BUDGET_S - MARGIN_S - $(date +%s) )); }

# run_phase NAME CMD...: time-limited, tee'd, guarded.
run_phase() {
    local name=$1; shift
    local left; left=$(remaining)
    if [ "$left" -lt 30 ]; then
        log "=== phase $name: SKIPPED (only ${left}s of the ${BUDGET_S}s budget left)"
        STATUS+=("$name: SKIPPED (no time left)")
        return
    fi
    log "=== phase $name ($(date -u +%H:%M:%S), ${left}s left): $*"
    local t0; t0=$(date +%s)
    timeout --signal=INT --kill-after=20 "$left" "$@" 2>&1 | tee -a "$LOG"
    local rc=$?
    local dt=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ]; then
        STATUS+=("$name: ok (${dt}s)")
    elif [ $rc -eq 124 ]; then
        STATUS+=("$name: FAILED (timed out after ${dt}s)"); log "FAILED phase $name (timed out)"
    else
        STATUS+=("$name: FAILED (exit $rc, ${dt}s)"); log "FAILED phase $name (exit $rc)"
    fi
    merge_results ""
}

merge_results() {  # merge_results [--png]: rewrite $OUT/bench.json (and summary.txt) from the results so far
    compgen -G "$RES/*.json" > /dev/null || return 0
    local png_args=()
    [ -n "$1" ] && png_args=(--png "$OUT/bench.png")
    "$PY" -m tokenmill.bench.report merge "$OUT/bench.json" "$RES"/*.json "${png_args[@]}" > "$OUT/summary.txt" 2>>"$LOG" \
        || log "(merging the results failed)"
}

BENCH=("$PY" -m tokenmill.entrypoints.cli bench)
# shellcheck disable=SC2206
EXTRA=($BENCH_ARGS)

log "tokenmill gpu_check: phases [$PHASES], out $OUT, scratch $WORK, budget ${BUDGET_S}s, $(date -u +%FT%TZ)"
log "git: $(git rev-parse HEAD 2>/dev/null)$(git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo ' (+local changes)')"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$LOG"
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$LOG"

for phase in $PHASES; do
    case "$phase" in
        tests|ktests|rtests)
            # Kernel tests in parallel processes (their time is mostly Triton compiles); the runner
            # tests serially (one of them checks how much device memory the engine takes).
            [ "$phase" != rtests ] && run_phase kernel-tests "$PY" -m pytest -q -m gpu -n 6 tests/kernels \
                --junitxml "$OUT/gpu_kernel_tests.xml" -p no:cacheprovider
            [ "$phase" != ktests ] && run_phase runner-tests "$PY" -m pytest -q -m gpu tests/gpu tests/runner tests/test_sliding_window.py \
                --junitxml "$OUT/gpu_tests.xml" -p no:cacheprovider ;;
        kernels)
            run_phase kernels "$PY" benchmarks/kernel_bench.py --quick --out "$OUT/kernel_bench.json" ;;
        gemv)
            run_phase gemv "$PY" benchmarks/kernel_bench.py --skip-attention --skip-small-ops --models llama3.1-8b \
                --out "$OUT/kernel_bench_gemv.json" ;;
        overhead)
            run_phase overhead "$PY" benchmarks/step_overhead.py --model llama-3.1-8b --out "$OUT/step_overhead.json" ;;
        small)
            run_phase small "${BENCH[@]}" throughput --workload offline-small --repeat "$REPEAT" --tag default \
                --out "$RES" "${EXTRA[@]}" ;;
        eager)
            run_phase eager "${BENCH[@]}" throughput --workload offline-small --repeat 1 --enforce-eager --tag eager \
                --out "$RES" "${EXTRA[@]}" ;;
        noasync)
            run_phase noasync "${BENCH[@]}" throughput --workload offline-small --repeat 1 --no-async-scheduling \
                --tag no-async --out "$RES" "${EXTRA[@]}" ;;
        latency)
            run_phase latency "${BENCH[@]}" latency --workload latency-8b --repeat "$LAT_REPEAT" --out "$RES" "${EXTRA[@]}" ;;
        latency-spec)
            run_phase latency-spec "${BENCH[@]}" latency --workload latency-8b --repeat "$LAT_REPEAT" \
                --speculative-config "$SPEC_CONFIG" --tag spec --out "$RES" "${EXTRA[@]}" ;;
        small-spec)
            run_phase small-spec "${BENCH[@]}" throughput --workload offline-small --repeat "$REPEAT" \
                --speculative-config "$NGRAM_CONFIG" --tag spec-ngram --out "$RES" "${EXTRA[@]}" ;;
        serve-spec)
            run_phase serve-spec "${BENCH[@]}" serve --workload serve-8b --launch --request-rate "$SERVE_RATE" \
                --speculative-config "$SPEC_CONFIG" --tag spec --out "$RES" "${EXTRA[@]}"
            grep -h "WARNING\|ERROR" "$RES"/server-*.log 2>/dev/null | tail -40 | tee -a "$LOG" ;;
        structured)
            run_phase structured "${BENCH[@]}" structured --workload structured-small --repeat "$REPEAT" \
                --tokenizer "$TOKENIZER" --out "$RES" "${EXTRA[@]}" ;;
        latency-unfused)
            run_phase latency-unfused "${BENCH[@]}" latency --workload latency-8b --repeat "$LAT_REPEAT" \
                --no-fused-small-batch-linear --tag unfused --out "$RES" "${EXTRA[@]}" ;;
        latency-base)
            if [ -d "$BASE_TREE/tokenmill" ]; then
                # -P: the current directory (this tree) does not go before the base tree on the path
                PYTHONPATH="$PWD/$BASE_TREE:$PYTHONPATH" run_phase latency-base "$PY" -P -m tokenmill.entrypoints.cli bench \
                    latency --workload latency-8b \
                    --repeat "$LAT_REPEAT" --tag base --out "$RES" "${EXTRA[@]}"
            else
                log "=== phase latency-base: SKIPPED (no $BASE_TREE/tokenmill)"; STATUS+=("latency-base: SKIPPED (no base tree)")
            fi ;;
        small-base)
            if [ -d "$BASE_TREE/tokenmill" ]; then
                PYTHONPATH="$PWD/$BASE_TREE:$PYTHONPATH" run_phase small-base "$PY" -P -m tokenmill.entrypoints.cli bench \
                    throughput --workload offline-small --repeat "$REPEAT" --tag base --out "$RES" "${EXTRA[@]}"
            else
                log "=== phase small-base: SKIPPED (no $BASE_TREE/tokenmill)"; STATUS+=("small-base: SKIPPED (no base tree)")
            fi ;;
        8b)
            run_phase 8b "${BENCH[@]}" throughput --workload offline-8b --repeat "$REPEAT" --out "$RES" "${EXTRA[@]}" ;;
        prefill)
            run_phase prefill "${BENCH[@]}" throughput --workload prefill-8b --repeat "$REPEAT" --out "$RES" "${EXTRA[@]}" ;;
        serve)
            SERVE_N=()
            [ -n "$SERVE_REQUESTS" ] && SERVE_N=(--num-prompts "$SERVE_REQUESTS")
            run_phase serve "${BENCH[@]}" serve --workload serve-8b --launch --request-rate "$SERVE_RATE" \
                --server-args "$SERVE_EXTRA" "${SERVE_N[@]}" --out "$RES" "${EXTRA[@]}"
            # The server's own warnings (e.g. a Triton kernel compiled on the step path) into our log.
            grep -h "WARNING\|ERROR" "$RES"/server-*.log 2>/dev/null | tail -40 | tee -a "$LOG" ;;
        serve-sweep)
            SWEEP_N=()
            [ -n "$SERVE_REQUESTS" ] && SWEEP_N=(--num-prompts "$SERVE_REQUESTS" --goodput-requests "$SERVE_REQUESTS")
            run_phase serve-sweep "${BENCH[@]}" serve --workload serve-8b --launch --rates "$SERVE_RATES" --goodput \
                --server-args "$SERVE_EXTRA" "${SWEEP_N[@]}" --tag sweep --out "$RES" "${EXTRA[@]}"
            grep -h "WARNING\|ERROR" "$RES"/server-*-sweep.log 2>/dev/null | tail -40 | tee -a "$LOG" ;;
        compare)
            run_phase compare "${BENCH[@]}" throughput --workload offline-small --repeat 1 --compare transformers \
                --tag compare --out "$RES" "${EXTRA[@]}" ;;
        profile)
            [[ " $PROFILES " == *" latency-8b "* ]] && run_phase profile-latency "${BENCH[@]}" profile \
                --workload latency-8b --skip-steps 40 --steps 50 --trace --out "$WORK/profiles" "${EXTRA[@]}"
            [[ " $PROFILES " == *" offline-small "* ]] && run_phase profile-small "${BENCH[@]}" profile \
                --workload offline-small --skip-steps 300 --steps 20 --trace --out "$WORK/profiles" "${EXTRA[@]}"
            [ -d "$WORK/profiles" ] && tar -C "$WORK" -czf "$OUT/profiles.tar.gz" profiles ;;
        *)
            log "unknown phase '$phase' (tests kernels gemv overhead small eager noasync latency latency-spec small-spec serve-spec latency-unfused latency-base small-base 8b prefill serve serve-sweep compare profile)"
            STATUS+=("$phase: unknown") ;;
    esac
done

merge_results --png
log ""
log "=== summary ($(( $(date +%s) - START ))s in all)"
for s in "${STATUS[@]}"; do log "  $s"; done
[ -s "$OUT/summary.txt" ] && cat "$OUT/summary.txt" | tee -a "$LOG"
rm -rf "$WORK"
case "${STATUS[*]}" in *FAILED*) exit 1 ;; esac
exit 0
