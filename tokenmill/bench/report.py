"""Run metadata, JSON output, merging result files and the summary table.

Every result file holds: kind (throughput/latency/serve), workload, model, dtype, device name,
torch/triton/transformers versions, date, command line, git commit, ceilings, results, roofline.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from typing import Any, Iterable, Optional


def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "triton", "transformers", "tokenmill"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed, or no version attribute
            out[mod] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
    except Exception:
        pass
    return out


def git_commit() -> Optional[str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode != 0:
        return None
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def metadata(kind: str, argv: Optional[list[str]] = None) -> dict:
    argv = sys.argv if argv is None else argv
    return {
        "kind": kind,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in argv),
        "host": platform.node(),
        "versions": versions(),
        "git_commit": git_commit(),
    }


def _clean(obj: Any) -> Any:
    """JSON-safe: dataclasses to dicts, numpy scalars to Python, NaN/inf to None."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _clean(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        try:
            obj = obj.item()
        except (ValueError, TypeError):
            return str(obj)
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    return obj


def write_json(result: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_clean(result), f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path


def result_stem(kind: str, workload: str, tag: Optional[str]) -> str:
    stem = f"{kind}-{workload}"
    return f"{stem}-{tag}" if tag else stem


# ---- merging and the summary table ------------------------------------------------------------


def merge(paths: Iterable[str]) -> dict:
    """{"results": [...]} from result files (a file that is itself a merge is flattened)."""
    results = []
    for p in paths:
        try:
            with open(p) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            results.append({"kind": "error", "file": p, "error": str(e)})
            continue
        if isinstance(data, dict) and "results" in data and isinstance(data["results"], list) and "kind" not in data:
            results.extend(data["results"])
        else:
            data.setdefault("file", os.path.basename(p))
            results.append(data)
    return {"merged_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "results": results}


def _fmt(x, spec: str = ".0f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _spec_note(spec: Optional[dict]) -> str:
    """The speculative-decoding figures of a result for the table's "other" column ("" when off)."""
    if not spec:
        return ""
    rate = spec.get("acceptance_rate")
    return (f", spec accept {_fmt(None if rate is None else 100 * rate, '.0f')}%, "
            f"{_fmt(spec.get('mean_accepted_length'), '.2f')} tok/verify")


def summary_rows(merged: dict) -> list[list[str]]:
    rows = [["kind", "workload", "tag", "tok/s", "roofline %", "peer ratio", "other", "device"]]
    for r in merged["results"]:
        kind = r.get("kind", "?")
        name = (r.get("workload") or {}).get("name", "?") if isinstance(r.get("workload"), dict) else r.get("workload", "?")
        tag = r.get("tag") or ""
        dev = r.get("device_name", "")
        s = r.get("summary") or {}
        if kind == "throughput":
            other = (f"{_fmt(s.get('elapsed_s'), '.2f')} s, {_fmt(s.get('total_tok_per_s'))} total tok/s, "
                     f"{s.get('output_tokens', '-')} out tok, {s.get('num_steps', '-')} steps"
                     + _spec_note(s.get("speculative")))
            rows.append([kind, name, tag, _fmt(s.get("output_tok_per_s")), _fmt(s.get("roofline_pct"), ".1f"),
                         _fmt(s.get("peer_ratio"), ".2f"), other, dev])
        elif kind == "latency":
            other = (f"TPOT {_fmt(s.get('tpot_ms'), '.2f')} ms, {_fmt(s.get('decode_step_ms'), '.2f')} ms/step, "
                     f"TTFT {_fmt(s.get('ttft_ms'), '.1f')} ms, BW {_fmt(s.get('bandwidth_pct'), '.1f')}%"
                     + _spec_note(s.get("speculative")))
            rows.append([kind, name, tag, _fmt(s.get("decode_tok_per_s")), _fmt(s.get("roofline_pct"), ".1f"), "-",
                         other, dev])
        elif kind == "serve":
            for rate in r.get("rates") or []:
                a = rate.get("summary", {})
                other = (f"rate {rate.get('request_rate')}, TTFT p50/p99 {_fmt(a.get('ttft_ms_p50'), '.0f')}/"
                         f"{_fmt(a.get('ttft_ms_p99'), '.0f')} ms, ITL p50/p99 {_fmt(a.get('itl_ms_p50'), '.1f')}/"
                         f"{_fmt(a.get('itl_ms_p99'), '.1f')} ms, {a.get('failed', '-')} failed"
                         + _spec_note(rate.get("speculative")))
                rows.append([kind, name, tag, _fmt(a.get("output_tok_per_s")), "-", "-", other, dev])
            g = r.get("goodput")
            if g:
                # the output rate at the goodput: of the fastest probe that met the targets
                at = [p for p in g.get("probes") or [] if p.get("passed")]
                best = (max(at, key=lambda p: p.get("request_rate") or 0) if at else {}).get("summary") or {}
                other = (f"goodput {_fmt(g.get('goodput_req_per_s'), 'g', 'none')} req/s (ITL p99 <= "
                         f"{_fmt(g.get('itl_p99_ms_max'), 'g')} ms, TTFT p99 <= {_fmt(g.get('ttft_p99_ms_max'), 'g')} ms, "
                         f"{len(g.get('probes') or [])} probes)")
                rows.append([kind, name, tag, _fmt(best.get("output_tok_per_s")), "-", "-", other, dev])
        elif kind == "structured":
            other = (f"batch {s.get('batch')}: step {_fmt(s.get('plain_step_ms'), '.2f')} ms plain, "
                     f"{_fmt(s.get('json_step_ms'), '.2f')} ms JSON ({_fmt(s.get('ratio'), '.3f')}x), "
                     f"mask fill {_fmt(s.get('mask_fill_ms_mean'), '.2f')} ms")
            rows.append([kind, name, tag, "-", "-", "-", other, dev])
        else:
            rows.append([kind, name, tag, "-", "-", "-", r.get("error", ""), dev])
    return rows


SERVE_TABLE_COLUMNS = ["rate", "output tok/s", "TTFT p99", "ITL p50/p99", "mixed steps mean/p99", "GC gen-2 pauses"]


def _rate_label(rate) -> str:
    return str(rate) if isinstance(rate, str) else f"{rate:g}"


def serve_table_row(entry: dict) -> list[str]:
    """One rate of a serve result (an entry of "rates" or of goodput "probes") as the serve table's cells.
    Milliseconds throughout; "p99 <= X" is a server histogram's bucket bound (it gives no finer answer)."""
    a = entry.get("summary") or {}
    mixed = (entry.get("server_steps") or {}).get("mixed")
    if entry.get("server_side") is None:
        mixed_cell = "-"  # no /metrics
    elif not mixed:
        mixed_cell = "none"
    else:
        mixed_cell = f"{mixed['mean_ms']:.1f} / <= {_fmt(mixed.get('p99_le_ms'), 'g', 'inf')} ms"
    def gc_cell(gc: Optional[dict]) -> str:
        if gc is None:
            return "-"  # not exported
        if not gc.get("count"):
            return "0"
        return f"{gc['count']}, mean {gc['mean_ms']:.1f} ms, max <= {_fmt(gc.get('max_le_ms'), 'g', 'inf')} ms"

    gc = gc_cell(entry.get("gc_gen2"))
    if entry.get("engine_gc_gen2") is not None:  # an engine process of its own: its pauses stop the steps
        gc = f"server {gc}; engine {gc_cell(entry['engine_gc_gen2'])}"
    return [_rate_label(entry.get("request_rate")), _fmt(a.get("output_tok_per_s")),
            f"{_fmt(a.get('ttft_ms_p99'), '.0f')} ms",
            f"{_fmt(a.get('itl_ms_p50'), '.1f')} / {_fmt(a.get('itl_ms_p99'), '.1f')} ms", mixed_cell, gc]


def markdown_table(rows: list[list[str]]) -> str:
    """A GitHub markdown table; the first row is the header."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join("---" for _ in rows[0]) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def serve_table(result: dict) -> str:
    """The serve result's rates as a markdown table: rate | output tok/s | TTFT p99 | ITL p50/p99 |
    mixed steps mean/p99 | GC gen-2 pauses (count, mean and the bucket bound of the largest; the server
    process's, and the engine process's too where the server exports them apart). With a
    goodput search, its probes follow in a second table of the same columns and a pass/fail column, and
    a line with the goodput. `python -m tokenmill.bench.report serve-table FILE` prints it from a file."""
    parts = []
    rates = result.get("rates") or []
    if rates:
        parts.append(markdown_table([SERVE_TABLE_COLUMNS] + [serve_table_row(e) for e in rates]))
    g = result.get("goodput")
    if g:
        probes = [serve_table_row(p) + ["pass" if p.get("passed") else
                                        "fail: " + "; ".join(p.get("fail_reasons") or [])]
                  for p in g.get("probes") or []]
        if probes:
            parts.append(markdown_table([SERVE_TABLE_COLUMNS + ["goodput"]] + probes))
        value = g.get("goodput_req_per_s")
        parts.append(f"goodput (ITL p99 <= {_fmt(g.get('itl_p99_ms_max'), 'g')} ms, TTFT p99 <= "
                     f"{_fmt(g.get('ttft_p99_ms_max'), 'g')} ms): "
                     + ("none" if value is None else f"{value:g} req/s")
                     + (f" ({g['note']})" if g.get("note") else ""))
    return "\n\n".join(parts) if parts else "(no rates)"


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """python -m tokenmill.bench.report merge OUT.json IN.json... [--png OUT.png] | table IN.json... |
    serve-table IN.json... (the markdown rate table of every serve result: see serve_table)"""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tokenmill.bench.report", allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge result files into one and print the summary table")
    m.add_argument("out")
    m.add_argument("inputs", nargs="*")
    m.add_argument("--png", default=None, help="also draw one figure: the summary, then every result's own figure")
    t = sub.add_parser("table", help="print the summary table of result files")
    t.add_argument("inputs", nargs="+")
    st = sub.add_parser("serve-table", help="print the markdown rate table (rate, output tok/s, TTFT p99, ITL "
                                            "p50/p99, mixed steps, GC gen-2 pauses) of serve result files")
    st.add_argument("inputs", nargs="+")
    args = p.parse_args(argv)
    merged = merge(args.inputs)
    if args.cmd == "serve-table":
        serves = [r for r in merged["results"] if r.get("kind") == "serve"]
        for r in serves:
            if len(serves) > 1:
                name = (r.get("workload") or {}).get("name", "?")
                print(f"### {r.get('file', '?')}: {name} {r.get('tag') or ''}".rstrip() + "\n")
            print(serve_table(r) + ("\n" if len(serves) > 1 else ""))
        if not serves:
            print("no serve results in " + ", ".join(args.inputs), file=sys.stderr)
            return 1
        return 0
    if args.cmd == "merge":
        write_json(merged, args.out)
        if args.png:
            from tokenmill.bench.plots import plot_combined

            try:
                plot_combined(merged, args.png)
            except Exception as e:  # a figure is never worth failing the run for
                print(f"warning: no summary figure: {e}", file=sys.stderr)
    print(format_table(summary_rows(merged)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
