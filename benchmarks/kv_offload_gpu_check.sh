#!/usr/bin/env bash
# The host-memory KV tier (--kv-offloading-size) on one GPU, side by side with it off:
#   tests           tests/gpu/test_kv_offload_cuda.py (outputs with the tier equal those without it)
#   mt_off / mt_on  bench multiturn multiturn-8b (64 conversations x 8 turns resending their history,
#                   8 in flight), the GPU KV cache sized to 1/$RATIO of the conversations' working set:
#                   TTFT p50 (all turns, and turns 2+) without and with the tier (its loads in the step
#                   that needs them, the default)
#   mt_async        the same with the tier's loads asynchronous (load_async: the request waits LOADING)
#   tp_off / tp_on  bench throughput offline-8b (nothing reused): what the tier costs when it never hits
#   copy            host<->device bandwidth of the tier's batched copies (8B block shape) against a
#                   measured pinned-copy ceiling (benchmarks/kv_offload_copy_bench.py)
#   OUT=/tmp/x bash benchmarks/kv_offload_gpu_check.sh
#   knobs: PARTS (default "tests mt_off mt_on mt_async tp_off tp_on copy"), RATIO (working set / GPU KV, default 4),
#   HOST_GIB (the tier's size, default 24), T (seconds a part may take, default 400), DRY=1 (the same
#   pipeline on the CPU with the tiny dummy model, seconds)
# $OUT gets: each part's log and JSON (mt_off/, mt_on/, mt_async/, tp_off/, tp_on/, copy.json), status.txt,
# kv_offload.json (the figures side by side) and kv_offload.md.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
PARTS=${PARTS:-tests mt_off mt_on mt_async tp_off tp_on copy}
RATIO=${RATIO:-4}
HOST_GIB=${HOST_GIB:-24}
T=${T:-400}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
source benchmarks/_gpu_parts.sh

MT=(--workload multiturn-8b --working-set-ratio "$RATIO")
TP=(--workload offline-8b --no-plot)
COPY=()
if [ -n "${DRY:-}" ]; then  # the whole pipeline on the CPU in seconds: tiny model, short conversations
    HOST_GIB=${DRY_HOST_GIB:-0.01}
    MT=(--workload multiturn-tiny --device cpu --working-set-ratio "$RATIO")
    TP=(--workload tiny --device cpu --no-plot --num-kv-blocks 64)
    COPY=(--device cpu --blocks 4,16 --layers 4 --kv-heads 2 --head-dim 32 --cache-blocks 64 --repeat 2)
fi

part tests "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu --junitxml "$OUT/kv_offload_tests.xml" \
    tests/gpu/test_kv_offload_cuda.py
part mt_off "${B[@]}" multiturn "${MT[@]}" --tag off --out "$OUT/mt_off"
part mt_on "${B[@]}" multiturn "${MT[@]}" --kv-offloading-size "$HOST_GIB" --tag on --out "$OUT/mt_on"
ASYNC='{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"size_gib": '"$HOST_GIB"', "load_async": true}}'
part mt_async "${B[@]}" multiturn "${MT[@]}" --kv-transfer-config "$ASYNC" --tag async --out "$OUT/mt_async"
part tp_off "${B[@]}" throughput "${TP[@]}" --tag off --out "$OUT/tp_off"
part tp_on "${B[@]}" throughput "${TP[@]}" --kv-offloading-size "$HOST_GIB" --tag on --out "$OUT/tp_on"
part copy "$PY" benchmarks/kv_offload_copy_bench.py --out "$OUT/copy.json" "${COPY[@]}"

"$PY" - "$OUT" <<'PYEOF'
import glob, json, os, sys

out = sys.argv[1]


def load(pattern):
    found = sorted(glob.glob(os.path.join(out, pattern)))
    if not found:
        return None
    with open(found[-1]) as f:
        return json.load(f)


report, lines = {}, []
for name in ("mt_off", "mt_on", "mt_async"):
    r = load(f"{name}/multiturn-*.json")
    if r is None:
        report[name] = {"error": f"no result (see {name}.log)"}
        continue
    s = r["summary"]
    report[name] = {"ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
                    "ttft_later_turns_p50_ms": s["ttft_later_turns_ms"]["p50"],
                    "output_tok_per_s": s["output_tok_per_s"], "computed_prompt_fraction": s["computed_prompt_fraction"],
                    "working_set_ratio": s["working_set_ratio"], "num_preemptions": s["num_preemptions"],
                    "host_tier": s["host_tier"], "git_commit": r.get("git_commit")}
    lines.append(f"| {name} | {s['ttft_ms']['p50']:.1f} | {s['ttft_later_turns_ms']['p50']:.1f} | "
                 f"{s['ttft_ms']['p90']:.1f} | {s['output_tok_per_s']:.0f} | {100 * s['computed_prompt_fraction']:.1f}% | "
                 f"{s['working_set_ratio']:.2f}x |")
if lines:
    lines = ["| multiturn | TTFT p50 ms | turns 2+ p50 ms | TTFT p90 ms | output tok/s | prompt computed | "
             "working set / GPU KV |", "|---|---|---|---|---|---|---|"] + lines
for name in ("tp_off", "tp_on"):
    r = load(f"{name}/throughput-*.json")
    report[name] = ({"error": f"no result (see {name}.log)"} if r is None else
                    {"output_tok_per_s": r["summary"]["output_tok_per_s"], "elapsed_s": r["summary"]["elapsed_s"],
                     "device": r.get("device_name"), "git_commit": r.get("git_commit"),
                     "kv_offload": r["results"]["runs"][r["results"]["median_run"]].get("kv_offload")})
if "output_tok_per_s" in report.get("tp_off", {}) and "output_tok_per_s" in report.get("tp_on", {}):
    ratio = report["tp_on"]["output_tok_per_s"] / report["tp_off"]["output_tok_per_s"]
    report["throughput_on_over_off"] = ratio
    lines.append(f"\noffline-8b (nothing reused): {report['tp_off']['output_tok_per_s']:.0f} output tok/s off, "
                 f"{report['tp_on']['output_tok_per_s']:.0f} on ({ratio:.3f}x)")
copy = load("copy.json")
report["copy"] = copy
if copy is not None:
    c = copy["ceiling"]
    lines.append(f"\npinned-copy ceiling: device->host {c['d2h_GBps']:.1f} GB/s, host->device {c['h2d_GBps']:.1f} GB/s")
    for t in copy["tier"]:
        lines.append(f"- tier, {t['blocks']} blocks: save {t['save_GBps']:.1f} GB/s ({t['save_pct_of_ceiling']:.0f}%), "
                     f"load {t['load_GBps']:.1f} GB/s ({t['load_pct_of_ceiling']:.0f}%)")
with open(os.path.join(out, "kv_offload.json"), "w") as f:
    json.dump(report, f, indent=1)
with open(os.path.join(out, "kv_offload.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
echo "summary rc=$?" | tee -a "$OUT/status.txt"
