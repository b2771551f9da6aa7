#!/usr/bin/env bash
# Prefill/decode disaggregation on one GPU, beside a single engine at the same request rate:
#   single  bench serve --launch: one `tokenmill serve` (serve-8b: Llama-3.1-8B shapes, dummy weights) at
#           $RATE req/s, $REQUESTS requests
#   pd      a prefill `tokenmill serve` (SharedStorageConnector kv_producer, $PREFILL_UTIL of the GPU) and a
#           decode one (kv_consumer, the rest up to 0.9) on the same GPU, `tokenmill proxy` in front; the
#           same requests at the same rate through the proxy (benchmarks/pd_bench.py)
# TTFT and ITL (p50/p90/p99) side by side, and the engines' kv_transfer counters (tokens the decode
# engine loaded instead of computing, failed loads).
#   OUT=/tmp/x bash benchmarks/pd_gpu_check.sh
#   knobs: RATE (default 4), REQUESTS (default 200), PREFILL_UTIL (default 0.45), PARTS (default
#   "single pd"), T (seconds a part may take, default 420), DRY=1 (the same pipeline on the CPU with the
#   tiny dummy model, seconds)
# $OUT gets: single/ and pd/ (bench JSON, server logs, pd/pd_servers.json), single.log, pd.log,
# status.txt, pd.json (the figures side by side) and pd.md.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
PY=${PYTHON:-python3}
PARTS=${PARTS:-single pd}
RATE=${RATE:-4}
REQUESTS=${REQUESTS:-200}
PREFILL_UTIL=${PREFILL_UTIL:-0.45}
T=${T:-420}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
source benchmarks/_gpu_parts.sh

WORKLOAD=serve-8b
SINGLE=(--workload "$WORKLOAD" --num-prompts "$REQUESTS" --request-rate "$RATE")
PD=(--workload "$WORKLOAD" --num-prompts "$REQUESTS" --request-rate "$RATE" --prefill-util "$PREFILL_UTIL")
if [ -n "${DRY:-}" ]; then  # the whole pipeline on the CPU in seconds: tiny model, short requests
    RATE=${DRY_RATE:-4}
    REQUESTS=${DRY_REQUESTS:-8}
    CPU=(--device cpu --num-kv-blocks 256)
    SHAPE=(--input-len 24:64 --output-len 4:8)
    SINGLE=(--workload "$WORKLOAD" --model tiny-llama --dtype float32 "${CPU[@]}" "${SHAPE[@]}"
            --num-prompts "$REQUESTS" --request-rate "$RATE")
    PD=(--workload "$WORKLOAD" --model tiny-llama --dtype float32 --num-prompts "$REQUESTS" --request-rate "$RATE"
        --engine-args "${CPU[*]}" --bench-args "${SHAPE[*]}")
fi

part single "${B[@]}" serve "${SINGLE[@]}" --launch --no-plot --tag single --out "$OUT/single"
part pd "$PY" benchmarks/pd_bench.py "${PD[@]}" --tag pd --out "$OUT/pd"

"$PY" - "$OUT" <<'EOF'
import glob, json, os, sys

out = sys.argv[1]
report, lines = {}, ["| engines | rate | ok / failed | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | output tok/s |",
                     "|---|---|---|---|---|---|"]
fmt = lambda v, spec=".1f": "?" if v is None else format(v, spec)
for name in ("single", "pd"):
    found = sorted(glob.glob(os.path.join(out, name, "serve-*.json")))
    if not found:
        report[name] = {"error": f"no result in {out}/{name} (see {name}.log)"}
        continue
    with open(found[-1]) as f:
        result = json.load(f)
    rate = result["rates"][0]
    s = rate["summary"]
    keys = ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "tpot_ms_p50",
            "output_tok_per_s", "completed", "failed", "errors")
    report[name] = {"request_rate": rate["request_rate"], "device": result.get("device_name"),
                    "git_commit": result.get("git_commit"), "server_command": result.get("server_command"),
                    **{k: s.get(k) for k in keys}}
    lines.append(f"| {name} | {rate['request_rate']} | {s.get('completed')} / {s.get('failed')} | "
                 f"{fmt(s.get('ttft_ms_p50'))} / {fmt(s.get('ttft_ms_p90'))} / {fmt(s.get('ttft_ms_p99'))} | "
                 f"{fmt(s.get('itl_ms_p50'), '.2f')} / {fmt(s.get('itl_ms_p90'), '.2f')} / "
                 f"{fmt(s.get('itl_ms_p99'), '.2f')} | {fmt(s.get('output_tok_per_s'), '.0f')} |")
servers = os.path.join(out, "pd", "pd_servers.json")
if os.path.exists(servers):
    with open(servers) as f:
        pd = json.load(f)
    report["pd_servers"] = pd
    d, p = pd.get("decode") or {}, pd.get("prefill") or {}
    lines.append(f"\ndecode engine: {d.get('tokenmill:kv_transfer_loaded_tokens_total', '?')} prompt tokens loaded "
                 f"from the prefill engine, {d.get('tokenmill:kv_transfer_failed_loads_total', '?')} failed loads, "
                 f"{d.get('tokenmill:num_kv_blocks', '?')} KV blocks; prefill engine: "
                 f"{p.get('tokenmill:kv_transfer_blocks_saved_total', '?')} blocks written, "
                 f"{p.get('tokenmill:num_kv_blocks', '?')} KV blocks")
with open(os.path.join(out, "pd.json"), "w") as f:
    json.dump(report, f, indent=1)
with open(os.path.join(out, "pd.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
echo "summary rc=$?" | tee -a "$OUT/status.txt"
