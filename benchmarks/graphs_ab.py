"""The side-by-side figures of benchmarks/graphs_gpu_check.sh: per workload and tree the median of
the rounds' results, and this tree's against the base tree's (within 2% passes).

    python benchmarks/graphs_ab.py $OUT/runs --out $OUT/graphs_ab.json

$OUT/runs/<workload>-<tree>-<round>/ each holds one `tokenmill bench` JSON; workload is small
(offline-small: output tok/s, higher is better) or lat (latency-8b: ms per output token, lower is better).
"""

import argparse
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import emit  # noqa: E402

# workload prefix -> (bench workload, summary field, higher is better)
METRICS = {"small": ("offline-small", "output_tok_per_s", True), "lat": ("latency-8b", "tpot_ms", False)}
TOLERANCE = 0.02


def collect(runs_dir: str) -> dict:
    """{workload prefix: {tree: [value of each round, in round order]}} from the rounds' JSONs."""
    found: dict = {}
    for d in sorted(glob.glob(os.path.join(runs_dir, "*-*-*"))):
        prefix, tree, _round = os.path.basename(d).split("-", 2)
        if prefix not in METRICS:
            continue
        for path in glob.glob(os.path.join(d, "*.json")):
            with open(path) as f:
                value = json.load(f).get("summary", {}).get(METRICS[prefix][1])
            if value is not None:
                found.setdefault(prefix, {}).setdefault(tree, []).append(float(value))
    return found


def summarize(runs_dir: str) -> dict:
    result: dict = {"tolerance": TOLERANCE}
    for prefix, trees in collect(runs_dir).items():
        workload, field, higher_better = METRICS[prefix]
        entry = {"metric": field, "higher_is_better": higher_better, "rounds": trees,
                 "median": {tree: statistics.median(v) for tree, v in trees.items()}}
        if "new" in trees and "base" in trees:
            new, base = entry["median"]["new"], entry["median"]["base"]
            entry["ratio_new_over_base"] = new / base
            # how much worse this tree is than the base, as a fraction (negative: better)
            entry["regression"] = (base - new) / base if higher_better else (new - base) / base
            entry["within_tolerance"] = entry["regression"] <= TOLERANCE
        result[workload] = entry
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs_dir")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    emit(summarize(args.runs_dir), args.out)


if __name__ == "__main__":
    main()
