"""PNG plots of a run: the TTFT distribution, latency against throughput over a rate sweep."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.serve.metrics import RequestRecord


def plot_ttft(runs: dict[str, Sequence[RequestRecord]], path: str | Path) -> None:
    """TTFT distribution of each run (label -> records): histogram and empirical CDF, in ms (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_h, ax_c) = plt.subplots(1, 2, figsize=(11, 4))
    for label, records in runs.items():
        ttft = np.sort([r.ttft * 1e3 for r in records if r.success])
        if ttft.size == 0:
            continue
        ax_h.hist(ttft, bins=min(50, max(5, ttft.size // 2)), alpha=0.5, label=label)
        ax_c.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", label=label)
    ax_h.set(xlabel="TTFT (ms)", ylabel="requests", title="TTFT histogram")
    ax_c.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.02))
    _save(fig, (ax_h, ax_c), path)


def plot_sweep(rows: Sequence[dict], path: str | Path) -> None:
    """Latency against achieved output throughput over a rate sweep (rows: ``{"request_rate", **summary}``):
    TTFT p50/p90 on the left, TPOT p50 and ITL p50 on the right, each point labelled with its rate (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["output_throughput"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, keys, title in ((axes[0], ("p50_ttft_ms", "p90_ttft_ms"), "TTFT"),
                            (axes[1], ("p50_tpot_ms", "p50_itl_ms"), "per output token")):
        for key in keys:
            ys = [r.get(key) for r in rows]
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=key.replace("_ms", "").replace("_", " "))
        for r, x in zip(rows, xs):
            y = r.get(keys[0])
            if y is not None:
                ax.annotate(f"{r['request_rate']:g}/s", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set(xlabel="output throughput (tokens/s)", ylabel="latency (ms)", title=f"{title} vs throughput")
    _save(fig, axes, path)


def _save(fig, axes, path: str | Path) -> None:
    """Grid and legend on each axis, then the figure as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
