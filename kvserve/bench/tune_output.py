"""What ``kvserve tune`` reads and writes besides the sweep itself: the workload (``kvserve bench load``'s
datasets), the table, the plots, the configuration file, the prefill:decode split of a cluster, and the
closing side-by-side measurement of the default and the chosen configuration."""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
from pathlib import Path
from typing import Any

from kvserve.bench import report
from kvserve.bench.datasets import DATASETS


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("workload (kvserve bench load's datasets)")
    data.add_argument("--model", default="default")
    data.add_argument("--device", default="auto")
    data.add_argument("--dataset", choices=DATASETS, default="random")
    data.add_argument("--dataset-path", default=None, help="the JSONL (or ShareGPT JSON) file of --dataset jsonl")
    data.add_argument("--input-len", type=int, default=256)
    data.add_argument("--output-len", type=int, default=64)
    data.add_argument("--range-ratio", type=float, default=0.0)
    data.add_argument("--num-requests", type=int, default=32, help="requests per measured rate")
    data.add_argument("--num-prefixes", type=int, default=4)
    data.add_argument("--questions-per-prefix", type=int, default=6)
    data.add_argument("--prefix-len", type=int, default=256)
    data.add_argument("--seed", type=int, default=0)


def workload(args: argparse.Namespace) -> tuple[dict[str, Any], list]:
    """(the engine options every setting shares, the requests). Random token ids need no tokenizer."""
    from engine.bundled import resolve_model
    from engine.model_config import ModelConfig
    from kvserve.bench.datasets import random_requests, shared_prefix_requests
    from kvserve.bench.load import build_requests

    vocab = ModelConfig.from_dir(resolve_model(args.model)).vocab_size
    if args.dataset == "random":
        requests = random_requests(args.num_requests, args.input_len, args.output_len, args.range_ratio, vocab,
                                   args.seed)  # fmt: skip
    elif args.dataset == "shared-prefix":
        requests = shared_prefix_requests(args.num_prefixes, args.questions_per_prefix, args.prefix_len,
                                          args.input_len, args.output_len, vocab, args.seed)  # fmt: skip
    else:
        args.duration = None
        requests = build_requests(args)
    token_ids = args.dataset in ("random", "shared-prefix")
    return {"model": args.model, "device": args.device, "skip_tokenizer_init": token_ids}, requests[: args.num_requests]


def write_table(path: Path, rows: list[dict[str, Any]], default: dict[str, Any], chosen: dict[str, Any],
                skipped: list[dict[str, Any]], slo) -> None:  # fmt: skip
    lines = [f"# kvserve tune: goodput at {slo.describe()}", "",
             "| setting (changes from the default) | goodput req/s | within SLO | TTFT p50/p90/p99 ms | "
             "TPOT p50/p90/p99 ms | output tok/s | KV MiB |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in sorted(rows, key=lambda r: -r["goodput_rps"]):
        mark = " **(chosen)**" if row["setting"] == chosen else ""
        goodput = f"{row['goodput_rps']:.3g}" if row["goodput_rps"] else f"< {row['searched_from_rps']:.3g}"
        goodput += "" if row["confirmed"] else " (a second replay missed it)"
        ttft, tpot = ("/".join(f"{row[f'{what}_p{q}_ms']:.0f}" for q in (50, 90, 99)) for what in ("ttft", "tpot"))
        lines.append(f"| {_changes(row['setting'], default)}{mark} | {goodput} | {row['attainment']:.0%} | "
                     f"{ttft} | {tpot} | {row['output_throughput']:.1f} | "
                     f"{row['peak_kv_bytes'] / 2**20:.1f} |")  # fmt: skip
    if skipped:
        lines += ["", "Not measured (the budget ran out): " + "; ".join(_changes(s, default) for s in skipped)]
    path.write_text("\n".join(lines) + "\n")


def _changes(setting: dict[str, Any], default: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting.items() if default.get(k) != v) or "default"


def write_plots(out: Path, trials: list, default: dict[str, Any], slo) -> None:
    from kvserve.bench.plots import _pyplot

    plt = _pyplot()
    q = round(100 * slo.attainment)  # the percentile the attainment bounds
    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(13, 5))
    for trial in trials:
        points = sorted(trial.points, key=lambda p: p.output_throughput)
        x = [p.output_throughput for p in points]
        label = _changes(trial.setting, default)[:40]
        ttft.plot(x, [p.p("ttft", q) * 1e3 for p in points], "-o", label=label, markersize=3)
        tpot.plot(x, [p.p("tpot", q) * 1e3 for p in points], "-o", label=label, markersize=3)
    for ax, what, bound in ((ttft, f"TTFT p{q} (ms)", slo.ttft_s), (tpot, f"TPOT p{q} (ms)", slo.tpot_s)):
        ax.axhline(bound * 1e3, color="grey", linestyle="--", linewidth=1)
        ax.set(xlabel="output tokens/s (achieved)", ylabel=what, yscale="log")
        ax.grid(alpha=0.3)
    ttft.legend(fontsize=7)
    fig.suptitle("throughput against latency, one curve per setting, one point per request rate")
    fig.tight_layout()
    fig.savefig(out / "throughput_latency.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for trial in trials:
        samples = [s for p in trial.points for s in p.kv_samples]
        ax.scatter([s[0] for s in samples], [s[1] / 2**20 for s in samples], s=4,
                   label=_changes(trial.setting, default)[:40])  # fmt: skip
    ax.set(xlabel="sequences running", ylabel="KV cache in use (MiB)", title="KV memory against concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, markerscale=3)
    fig.tight_layout()
    fig.savefig(out / "kv_memory.png", dpi=110)
    plt.close(fig)


def write_config(path: Path, options: dict[str, Any], cluster: dict[str, int] | None) -> None:
    """The chosen configuration as a ``--config`` file: the engine's options at the top level, the split in
    ``up``."""
    import yaml

    body: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
    if cluster:
        body["up"] = cluster
    path.write_text("# written by kvserve tune (see tuning.md)\n" + yaml.safe_dump(body, sort_keys=False))


def compare(tuner, default: dict[str, Any], chosen: dict[str, Any], repeats: int = 3) -> dict[str, list[float]]:
    """The default's and the chosen setting's goodput again, paired: ``repeats`` rounds on engines built once, in
    each of which both sides are searched in lockstep (``Tuner.search``: their replays alternate) on one arrival
    pattern of the round's own, the side that goes first swapping every round. Prints each round's goodputs and
    ratio, the medians, and the median of the rounds' ratios (the pairing takes the pattern's luck out of each
    ratio, the lockstep most of the machine's drift)."""
    import statistics

    from engine import LLMEngine
    from kvserve.bench.tune import RATE_FRACTIONS, Trial, engine_options
    from kvserve.bench.tune_replay import replay

    sides = {"default": default, "tuned": chosen}
    engines = {side: LLMEngine(**tuner.base, **engine_options(s)) for side, s in sides.items()}
    trials: dict[str, list[Trial]] = {side: [] for side in sides}
    try:
        for engine in engines.values():
            replay(engine, tuner.requests[:4], math.inf)  # warm-up
        for repeat in range(repeats):
            order = ("default", "tuned") if repeat % 2 == 0 else ("tuned", "default")
            runs = [(engines[side], Trial(sides[side])) for side in order]
            tuner.search(runs, 0, RATE_FRACTIONS.index(1.0), seed=100 * (repeat + 1))  # in lockstep
            for side, (_, trial) in zip(order, runs, strict=True):
                trials[side].append(trial)
    finally:
        for engine in engines.values():
            engine.close()
    goodputs = {side: [t.goodput for t in ts] for side, ts in trials.items()}
    q = round(100 * tuner.slo.attainment)
    rows = []
    for side, ts in trials.items():
        median = statistics.median(goodputs[side])
        point = next((t.at_goodput() for t in ts if t.goodput == median and t.goodput), None)
        figures = ([f"{point.attainment(tuner.slo):.0%}", *(round(point.p(w, q) * 1e3) for w in ("ttft", "tpot"))]
                   if point is not None else ["-", "-", "-"])  # fmt: skip
        rows.append([side, " ".join(f"{g:g}" for g in goodputs[side]), f"{median:g}", *figures])
    print(report.table(["side by side", "goodput req/s, each round", "median", "within SLO", f"TTFT p{q} ms",
                        f"TPOT p{q} ms"], rows))  # fmt: skip
    ratios = [t / d if d else math.inf for d, t in zip(goodputs["default"], goodputs["tuned"], strict=True)]
    print("tuned / default goodput, each round: " + " ".join(f"{r:.2f}x" for r in ratios))
    print(f"tuned / default goodput (median of {repeats} paired rounds): {statistics.median(ratios):.2f}x")
    return goodputs


def split_workers(args: argparse.Namespace, base: dict[str, Any], chosen: dict[str, Any], requests: list,
                  tuner) -> dict[str, int] | None:  # fmt: skip
    """The prefill:decode split of ``args.workers`` workers with the best goodput, each split a local cluster
    of the chosen engine setting measured in real time down the rate ladder; None when the budget is spent."""
    from kvserve.bench.loadgen import run_load
    from kvserve.bench.tune import engine_options
    from kvserve.bench.tune_replay import RatePoint
    from kvserve.launcher.cluster import free_base_port, start_cluster
    from kvserve.settings import parse_up

    config = Path(tempfile.mkdtemp(prefix="kvserve-tune-")) / "engine.yaml"
    write_config(config, {**engine_options(chosen), **base}, None)
    best, best_goodput = None, -1.0
    for num_prefill in range(args.workers):
        if tuner.out_of_time():
            print(f"kvserve tune: the budget ran out before the split {num_prefill}:{args.workers - num_prefill}")
            break
        split = {"prefill": num_prefill, "decode": args.workers - num_prefill}
        up = parse_up(["--config", str(config), "--prefill", str(split["prefill"]), "--decode",
                       str(split["decode"]), "--port", str(free_base_port(args.workers + 2)), "--http-port", "0",
                       "--log-dir", tempfile.mkdtemp(prefix="kvserve-tune-logs-")])  # fmt: skip
        cluster = start_cluster(up)
        goodput = 0.0
        try:
            for rate in sorted(tuner.rates, reverse=True):
                result = asyncio.run(run_load(cluster.endpoint, requests, request_rate=rate,
                                              sampling={"temperature": 0, "ignore_eos": True}))  # fmt: skip
                point = RatePoint(rate, [r.ttft_s if r.ok else math.inf for r in result.records],
                                  [r.tpot_s for r in result.records])  # fmt: skip
                if point.meets(tuner.slo):
                    goodput = rate
                    break
        finally:
            cluster.stop()
        print(f"kvserve tune: {split['prefill']} prefill + {split['decode']} decode: goodput {goodput:g} req/s")
        if goodput > best_goodput:
            best, best_goodput = split, goodput
    return best
