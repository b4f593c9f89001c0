"""The load tool's figures (matplotlib, Agg: no display needed).

``plot_run``: CDFs of TTFT, TPOT, ITL and end-to-end latency; output tokens per second and requests in flight
over the run (one-second bins, or finer for short runs). ``plot_sweep``: the throughput–latency curve of a
rate sweep, one point per rate.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvserve.bench.loadgen import LoadResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(result: LoadResult, path: str | Path, title: str = "") -> None:
    plt = _pyplot()
    ok = result.ok()
    fig, (cdf, rate) = plt.subplots(1, 2, figsize=(13, 4.8))
    series = {"TTFT": [r.ttft_s for r in ok], "TPOT": [r.tpot_s for r in ok if r.num_tokens > 1],
              "ITL": [gap for r in ok for gap in r.itl_s()], "end-to-end": [r.e2e_s for r in ok]}  # fmt: skip
    for name, values in series.items():
        ms = np.sort(np.asarray(values, dtype=float) * 1000)
        if ms.size:
            cdf.plot(ms, np.arange(1, ms.size + 1) / ms.size, label=name)
    cdf.set(xscale="log", xlabel="latency (ms, log scale)", ylabel="fraction of requests (ITL: of gaps)",
            title="latency CDFs")  # fmt: skip
    cdf.grid(alpha=0.3)
    cdf.legend()

    span = max(result.duration_s, 1e-3) + (result.records[0].start if result.records else 0.0)
    width = 1.0 if span >= 20 else span / 20
    edges = np.arange(0.0, span + width, width)
    times = [r.start + at for r in result.records for at in r.chunk_s]
    tokens = [n for r in result.records for n in r.chunk_tokens]
    per_bin, _ = np.histogram(times, bins=edges, weights=tokens)
    rate.step(edges[:-1], per_bin / width, where="post", label="output tokens/s")
    rate.set(xlabel="time since the start (s)", ylabel="output tokens/s", title="throughput and requests in flight")
    rate.grid(alpha=0.3)
    flight = rate.twinx()
    starts = np.array([r.start for r in result.records])
    ends = starts + np.array([r.e2e_s for r in result.records])
    mids = edges[:-1] + width / 2
    flight.plot(mids, [int(((starts <= t) & (ends > t)).sum()) for t in mids], color="tab:orange",
                label="requests in flight")  # fmt: skip
    flight.set_ylabel("requests in flight")
    lines = rate.get_legend_handles_labels()[0] + flight.get_legend_handles_labels()[0]
    rate.legend(lines, [line.get_label() for line in lines], loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(runs: list[dict], path: str | Path, title: str = "") -> None:
    """``runs``: summaries (``kvserve.bench.load.summarize``) of one sweep, with their ``request_rate``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    x = [run["output_token_throughput"] for run in runs]
    for key, label in (("ttft_ms", "TTFT"), ("e2e_ms", "end-to-end")):
        for q, style in (("p50", "-o"), ("p99", "--s")):
            ax.plot(x, [run[key][q] for run in runs], style, label=f"{label} {q}")
    for run, xi in zip(runs, x, strict=True):
        ax.annotate(f"{run['request_rate']:g} req/s", (xi, run["e2e_ms"]["p50"]), textcoords="offset points",
                    xytext=(4, 6), fontsize=8)  # fmt: skip
    ax.set(xlabel="output tokens/s (achieved)", ylabel="latency (ms, log scale)", yscale="log",
           title=title or "throughput against latency, one point per request rate")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
