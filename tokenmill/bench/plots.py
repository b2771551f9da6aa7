"""PNG figures next to the JSON (matplotlib, Agg backend). A missing matplotlib skips the figure."""

from __future__ import annotations

from typing import Optional

from tokenmill.bench.roofline import KINDS

_COLORS = {"decode": "tab:blue", "prefill": "tab:orange", "mixed": "tab:green"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(result: dict) -> str:
    w = result.get("workload") or {}
    tag = f" [{result['tag']}]" if result.get("tag") else ""
    return f"{w.get('name', '?')}{tag}: {result.get('model', '?')} {result.get('dtype', '')} on {result.get('device_name', '?')}"


def _save(plt, fig, path: str, dpi: int = 100) -> str:
    """Lay out, write the PNG, and free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_throughput(result: dict, path: str) -> str:
    plt = _plt()
    runs = result["results"]["runs"]
    med = runs[result["results"]["median_run"]]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    # 1. step throughput against batch size
    ax = axes[0]
    points = med.get("per_step") or []
    for kind in KINDS:
        xs, ys = [], []
        for entries, tokens, secs, k in points:
            if k == kind and secs > 0:
                xs.append(entries)
                ys.append(tokens / secs)
        if xs:
            ax.scatter(xs, ys, s=6, alpha=0.5, color=_COLORS[kind], label=f"{kind} steps")
    ax.set_xlabel("batch size (requests in the step)")
    ax.set_ylabel("tokens / s in the step (host-timed)")
    ax.set_title("step throughput against batch size")
    ax.set_yscale("log")
    if points:
        ax.legend(fontsize=8)
    # 2. roofline fraction per kind of step
    ax = axes[1]
    roof = med["roofline"]
    names, pcts, shares = [], [], []
    for kind in KINDS:
        d = roof["by_kind"][kind]
        if d["steps"]:
            names.append(f"{kind}\n({d['steps']} steps)")
            pcts.append(d.get("roofline_pct") or 0.0)
            shares.append(d["share_of_floor"])
    names.append("whole run")
    pcts.append(roof["roofline_pct"] or 0.0)
    bars = ax.bar(names, pcts, color=[_COLORS.get(n.split("\n")[0], "tab:gray") for n in names])
    for b, p in zip(bars, pcts):
        ax.annotate(f"{p:.1f}%", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("floor / measured time (%)")
    ax.set_title("roofline fraction per kind of step")
    # 3. output tok/s per repeat (and the peer)
    ax = axes[2]
    labels = [f"run {i + 1}" for i in range(len(runs))]
    values = [r["output_tok_per_s"] for r in runs]
    colors = ["tab:blue"] * len(runs)
    peer = result.get("peer")
    if peer:
        for i, r in enumerate(peer["runs"]):
            labels.append(f"transformers {i + 1}")
            values.append(r["output_tok_per_s"])
            colors.append("tab:red")
    bars = ax.bar(labels, values, color=colors)
    for b, v in zip(bars, values):
        ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title("output throughput" + (f" (ratio {peer['ratio']:.2f}x)" if peer else ""))
    fig.suptitle(_title(result), fontsize=10)
    return _save(plt, fig, path)


def plot_latency(result: dict, path: str) -> str:
    plt = _plt()
    runs = result["results"]["runs"]
    med = runs[result["results"]["median_run"]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    itl = med.get("itl_ms") or []
    ax.plot(range(2, len(itl) + 2), itl, lw=0.8, label="inter-token time")
    ax.axhline(med["tpot_ms"], color="tab:red", ls="--", lw=1, label=f"TPOT {med['tpot_ms']:.3f} ms")
    floor_ms = 1e3 * med["bytes_per_decode_token"] / result["ceilings"]["copy_bytes_per_s"]
    ax.axhline(floor_ms, color="tab:green", ls=":", lw=1, label=f"bandwidth floor {floor_ms:.3f} ms")
    ax.set_xlabel("output token")
    ax.set_ylabel("ms")
    ax.set_title(f"{_title(result)}\nTTFT {med['ttft_ms']:.2f} ms, bandwidth {med['bandwidth_pct']:.1f}% of copy",
                 fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_serve(result: dict, path: str) -> str:
    plt = _plt()
    rates = result["rates"]
    xs = [r["request_rate"] for r in rates]
    labels = [str(x) if isinstance(x, str) else ("inf" if x == float("inf") else f"{x:g}") for x in xs]
    pos = list(range(len(xs)))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    axes[0].plot(pos, [r["summary"]["output_tok_per_s"] or 0 for r in rates], "o-")
    axes[0].set_ylabel("output tokens / s")
    axes[0].set_title("throughput against request rate")
    for ax, metric, title in ((axes[1], "ttft_ms", "TTFT"), (axes[2], "itl_ms", "inter-token latency")):
        for p in ("p50", "p90", "p99"):
            ax.plot(pos, [r["summary"].get(f"{metric}_{p}") or 0 for r in rates], "o-", label=p)
        ax.set_ylabel("ms")
        ax.set_title(f"{title} percentiles against request rate")
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(pos)
        ax.set_xticklabels(labels)
        ax.set_xlabel("request rate (req/s)")
    fig.suptitle(_title(result), fontsize=10)
    return _save(plt, fig, path)


def plot_summary(merged: dict, path: str) -> Optional[str]:
    """One figure for a merged file: output tok/s and roofline % of every throughput/latency/serve result."""
    plt = _plt()
    labels, tps, roof = [], [], []
    for r in merged["results"]:
        kind = r.get("kind")
        w = r.get("workload") or {}
        name = f"{kind}\n{w.get('name', '?')}" + (f"\n{r['tag']}" if r.get("tag") else "")
        s = r.get("summary") or {}
        if kind == "throughput":
            labels.append(name)
            tps.append(s.get("output_tok_per_s") or 0)
            roof.append(s.get("roofline_pct") or 0)
            if s.get("peer_output_tok_per_s"):
                labels.append(f"transformers\n{w.get('name', '?')}")
                tps.append(s["peer_output_tok_per_s"])
                roof.append(0)
        elif kind == "latency":
            labels.append(name)
            tps.append(s.get("decode_tok_per_s") or 0)
            roof.append(s.get("bandwidth_pct") or 0)
        elif kind == "serve":
            for rate in r.get("rates") or []:
                labels.append(f"{name}\n@{rate['request_rate']}/s")
                tps.append(rate["summary"].get("output_tok_per_s") or 0)
                roof.append(0)
    if not labels:
        return None
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(labels)), 8))
    for ax, values, ylabel in ((axes[0], tps, "output tok/s (latency: decode tok/s)"),
                               (axes[1], roof, "roofline % (latency: bandwidth %)")):
        bars = ax.bar(range(len(labels)), values)
        for b, v in zip(bars, values):
            ax.annotate(f"{v:.0f}" if ax is axes[0] else f"{v:.1f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel(ylabel)
    axes[0].set_title(f"tokenmill benchmarks ({merged.get('merged_at', '')})")
    return _save(plt, fig, path, dpi=90)


def plot_result(result: dict, path: str) -> Optional[str]:
    kind = result.get("kind")
    if kind == "throughput":
        return plot_throughput(result, path)
    if kind == "latency":
        return plot_latency(result, path)
    if kind == "serve":
        return plot_serve(result, path)
    return None


def plot_combined(merged: dict, path: str) -> Optional[str]:
    """One PNG for a merged file: the summary figure on top, then each result's own figure, stacked
    (for when only a few files may come back from a machine)."""
    import os
    import tempfile

    import numpy as np

    plt = _plt()
    images = []
    with tempfile.TemporaryDirectory() as tmp:
        parts = []
        top = plot_summary(merged, os.path.join(tmp, "summary.png"))
        if top:
            parts.append(top)
        for i, r in enumerate(merged["results"]):
            try:
                p = plot_result(r, os.path.join(tmp, f"r{i}.png"))
            except Exception:  # one odd result must not cost the others their figure
                p = None
            if p:
                parts.append(p)
        for p in parts:
            img = plt.imread(p)
            if img.shape[2] == 3:
                img = np.concatenate([img, np.ones(img.shape[:2] + (1,), img.dtype)], axis=2)
            images.append(img)
    if not images:
        return None
    width = max(im.shape[1] for im in images)
    padded = [np.concatenate([im, np.ones((im.shape[0], width - im.shape[1], 4), im.dtype)], axis=1)
              if im.shape[1] < width else im for im in images]
    plt.imsave(path, np.concatenate(padded, axis=0))
    return path
