#!/usr/bin/env bash
# serve-8b goodput with `tokenmill serve`'s old and new defaults, side by side in one call: one launched
# server each, the same Poisson loads at each of $RATES req/s ($REQUESTS requests a rate), first with
# the step-time target off (the defaults before the target became `auto`), then with no flag at all
# (today's defaults: --step-time-target-ms auto on one CUDA device). Goodput: the highest rate whose
# ITL p99 <= 30 ms and TTFT p99 <= 1 s with no failed request (every lower rate passing too).
#   OUT=/tmp/x bash benchmarks/serve_defaults_gpu_check.sh
#   knobs: RATES (default 16,24,32), REQUESTS (default 500), PARTS (default "old new"), T (seconds a
#   part may take, default 270), DRY=1 (the same pipeline on the CPU with a tiny dummy model, seconds)
# $OUT gets: old/ and new/ (each the bench JSON and the server's log), old.log, new.log, status.txt,
# serve_defaults.json (both sweeps, goodput each, the target the new server chose) and serve_defaults.md.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
PARTS=${PARTS:-old new}
RATES=${RATES:-16,24,32}
REQUESTS=${REQUESTS:-500}
T=${T:-270}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
source benchmarks/_gpu_parts.sh

WORKLOAD=(--workload serve-8b --num-prompts "$REQUESTS")
if [ -n "${DRY:-}" ]; then  # the whole pipeline on the CPU in seconds: tiny model, short requests, low rates
    RATES=${DRY_RATES:-2,4}
    REQUESTS=${DRY_REQUESTS:-6}
    WORKLOAD=(--workload serve-8b --model tiny-llama --load-format dummy --dtype float32 --device cpu
              --num-prompts "$REQUESTS" --input-len 8:24 --output-len 4:8 --num-kv-blocks 256)
fi
COMMON=("${WORKLOAD[@]}" --launch --rates "$RATES" --warmup-requests 4 --no-plot)

part old "${B[@]}" serve "${COMMON[@]}" --step-time-target-ms off --tag old-defaults --out "$OUT/old"
part new "${B[@]}" serve "${COMMON[@]}" --tag new-defaults --out "$OUT/new"

RATES="$RATES" REQUESTS="$REQUESTS" "$PY" - "$OUT" <<'EOF'
import glob, json, os, re, sys

from tokenmill.bench.serve import goodput_of_rates

out = sys.argv[1]
report = {"rates": os.environ.get("RATES"), "requests_per_rate": os.environ.get("REQUESTS"), "configs": {}}
lines = ["| defaults | rate | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | mixed steps mean / p99 ms | verdict |",
         "|---|---|---|---|---|---|---|"]
for name in ("old", "new"):
    results = sorted(glob.glob(os.path.join(out, name, "serve-*.json")))
    if not results:
        report["configs"][name] = {"error": f"no result in {out}/{name} (see {name}.log)"}
        continue
    with open(results[-1]) as f:
        result = json.load(f)
    g = goodput_of_rates(result)
    target = None
    for log in glob.glob(os.path.join(out, name, "server-*.log")):
        with open(log, errors="replace") as f:
            m = re.findall(r"step-time target ([0-9.]+) ms(?: \(auto[^)]*\))?", f.read())
        target = float(m[-1]) if m else target
    report["configs"][name] = {"server_command": result.get("server_command"), "device": result.get("device_name"),
                               "git_commit": result.get("git_commit"), "step_time_target_ms": target, **g}
    for r in g["rates"]:
        mixed = r["mixed_steps"] or {}
        fmt = lambda v, spec=".0f": "?" if v is None else format(v, spec)
        lines.append(f"| {name} | {r['request_rate']:g} | {fmt(r['output_tok_per_s'])} | {fmt(r['ttft_ms_p50'])} / "
                     f"{fmt(r['ttft_ms_p99'])} | {fmt(r['itl_ms_p50'], '.1f')} / {fmt(r['itl_ms_p99'], '.1f')} | "
                     f"{fmt(mixed.get('mean_ms'), '.1f')} / <= {fmt(mixed.get('p99_le_ms'))} | "
                     + ("pass" if r["passed"] else "fail: " + "; ".join(r["fail_reasons"])) + " |")
for name, c in report["configs"].items():
    if "error" not in c:
        target = "off" if c["step_time_target_ms"] is None else f"{c['step_time_target_ms']:g} ms"
        lines.append(f"\n{name} defaults: goodput {c['goodput_req_per_s']} req/s; step-time target {target}; "
                     f"{c['device']}")
with open(os.path.join(out, "serve_defaults.json"), "w") as f:
    json.dump(report, f, indent=1)
with open(os.path.join(out, "serve_defaults.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
echo "summary rc=$?" | tee -a "$OUT/status.txt"
