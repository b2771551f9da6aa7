"""Prefill/decode disaggregation under `tokenmill bench serve`: start a prefill `tokenmill serve`
(SharedStorageConnector, kv_producer), then a decode one (kv_consumer) on the same device, then
`tokenmill proxy` in front; run `tokenmill bench serve --base-url <proxy>`; scrape both engines'
kv_transfer counters; stop everything (benchmarks/pd_gpu_check.sh runs it beside a single engine).

    python benchmarks/pd_bench.py --out DIR [--workload serve-8b] [--request-rate 4] [--num-prompts 200]
        [--model PRESET] [--dtype D] [--prefill-util 0.45] [--decode-util 0.9] [--engine-args "..."]
        [--bench-args "..."]

On one GPU the prefill engine starts first and takes --prefill-util of the device; the decode engine
then takes what is left up to --decode-util (the KV budget subtracts the memory already in use,
runner/kv_cache.py). Writes DIR/pd_servers.json (commands, each engine's kv_transfer counters and
KV cache size) beside bench serve's own JSON in DIR.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tokenmill.bench.serve import LaunchedServer, free_port  # noqa: E402
from tokenmill.bench.workloads import get_workload  # noqa: E402

CLI = [sys.executable, "-m", "tokenmill.entrypoints.cli"]


def scrape(url: str) -> dict:
    """Every unlabeled-or-model-labeled sample of a /metrics page, by name (first of each)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError as e:
        return {"error": str(e)}
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(tokenmill:[^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) not in values:
            values[m.group(1)] = float(m.group(3))
    return values


def store_root(wanted: int = 8 << 30) -> tuple[str, int]:
    """Where the block files go: /dev/shm (memory) when it has `wanted` bytes free (a container's is
    often 64 MiB), else the roomier of it and the temporary directory; and its free bytes."""
    roots = [r for r in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(r) and os.access(r, os.W_OK)]
    free = {r: shutil.disk_usage(r).free for r in roots}
    if free.get("/dev/shm", 0) >= wanted:
        return "/dev/shm", free["/dev/shm"]
    best = max(roots, key=free.get)
    return best, free[best]


def transfer_counters(metrics: dict) -> dict:
    keep = ("tokenmill:kv_transfer_", "tokenmill:num_kv_blocks", "tokenmill:prompt_tokens_total",
            "tokenmill:generation_tokens_total", "tokenmill:num_preemptions")
    return {k: v for k, v in metrics.items() if k.startswith(keep)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--workload", default="serve-8b")
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--model", default=None, help="a preset (dummy weights) (default: the workload's)")
    p.add_argument("--dtype", default=None, help="(default: the workload's)")
    p.add_argument("--prefill-util", type=float, default=0.45, help="--gpu-memory-utilization of the prefill engine")
    p.add_argument("--decode-util", type=float, default=0.9, help="--gpu-memory-utilization of the decode engine")
    p.add_argument("--engine-args", default="", help="extra flags for both engines (one string)")
    p.add_argument("--bench-args", default="", help="extra flags for bench serve (one string)")
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--tag", default="pd")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    w = get_workload(args.workload)
    extra = shlex.split(args.engine_args)
    model = args.model or w.model
    base = [model, "--load-format", w.load_format or "dummy", "--dtype", args.dtype or w.dtype]
    root, free = store_root()
    kv_dir = tempfile.mkdtemp(prefix="tokenmill-pd-", dir=root)
    store_gib = round(min(4.0, free / 2**30 / 2), 2)  # the producer's bound on what it leaves there
    on_cpu = "cpu" in extra

    def connector(role: str) -> list[str]:
        options = {"path": kv_dir, "max_store_gib": store_gib}
        return ["--kv-transfer-config", json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                                                    "kv_connector_extra_config": options})]

    def util(u: float) -> list[str]:
        return [] if on_cpu else ["--gpu-memory-utilization", str(u)]

    servers: list[LaunchedServer] = []
    report = {"workload": args.workload, "request_rate": args.request_rate, "num_prompts": args.num_prompts,
              "kv_dir": kv_dir, "kv_dir_free_gib": round(free / 2**30, 2), "max_store_gib": store_gib}
    rc = 1
    try:
        ports = {name: free_port() for name in ("prefill", "decode", "proxy")}
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        cmds = {
            "prefill": CLI + ["serve", *base, "--port", str(ports["prefill"]), *util(args.prefill_util),
                              *connector("kv_producer"), *extra],
            "decode": CLI + ["serve", *base, "--port", str(ports["decode"]), *util(args.decode_util),
                             *connector("kv_consumer"), *extra],
            "proxy": CLI + ["proxy", "--prefill", urls["prefill"], "--decode", urls["decode"],
                            "--port", str(ports["proxy"])],
        }
        report["commands"] = {k: shlex.join(v) for k, v in cmds.items()}
        for name in ("prefill", "decode", "proxy"):  # one after the other: each engine's KV budget sees the last
            t0 = time.perf_counter()
            print(f"launching {name}: {report['commands'][name]}", file=sys.stderr, flush=True)
            servers.append(LaunchedServer(cmds[name], urls[name], os.path.join(args.out, f"{name}.log"),
                                          args.server_timeout))
            print(f"{name} healthy after {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        bench = CLI + ["bench", "serve", "--workload", args.workload, "--model", model, "--base-url", urls["proxy"],
                       "--request-rate", str(args.request_rate), "--num-prompts", str(args.num_prompts),
                       "--out", args.out, "--tag", args.tag, "--no-plot", *shlex.split(args.bench_args)]
        report["bench_command"] = shlex.join(bench)
        print(f"running: {report['bench_command']}", file=sys.stderr, flush=True)
        rc = subprocess.run(bench, cwd=ROOT).returncode
        report["bench_rc"] = rc
        report["prefill"] = transfer_counters(scrape(urls["prefill"]))
        report["decode"] = transfer_counters(scrape(urls["decode"]))
    finally:
        for server in reversed(servers):
            server.stop()
        shutil.rmtree(kv_dir, ignore_errors=True)
        with open(os.path.join(args.out, "pd_servers.json"), "w") as f:
            json.dump(report, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
