"""Load-test a running cluster through its public API, open-loop (vLLM's ``bench serve``, SGLang's
``bench_serving`` and AIPerf measure the same way).

    kvserve bench load [--target 127.0.0.1:50051] [--backend grpc|openai] [--dataset random|shared-prefix|copy|jsonl]
                       [--request-rate R [--burstiness B] | --sweep-rates 1,2,4,8] [--max-concurrency C]
                       [--num-requests N | --duration S] [--warmup N] [--slo ttft_ms=500,tpot_ms=50]
                       [--save-result FILE.json] [--plot FILE.png]

Every request asks for exactly its output length (``ignore_eos``), greedy unless ``--temperature`` says
otherwise. The warm-up requests go first, at once, and count nowhere. The report: request and output-token
throughput; TTFT, TPOT (per output token after the first), ITL (between streamed messages) and end-to-end
latency (mean, p50, p90, p99, over the successful requests); errors by gRPC status; the fraction of prompt
tokens the server had cached; goodput (requests per second meeting every ``--slo`` bound); and this
client's own cost: its code's time per request (request building and message handling, timed inline),
its process CPU time per request (everything: gRPC or HTTP stack, event loop, progress bar) and how late
its sends were against the arrival schedule. A lag near zero and CPU well under one core mean the figures
are the server's, not the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

from kvserve.bench import report
from kvserve.bench.backends import GrpcBackend, OpenAIBackend
from kvserve.bench.datasets import DATASETS, copy_requests, jsonl_requests, random_requests, shared_prefix_requests
from kvserve.bench.loadgen import BenchRequest, LoadResult, run_load
from kvserve.bench.server_metrics import scrape, server_figures

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")
LATENCIES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "end-to-end"}


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft_ms=500,tpot_ms=50"`` -> ``{"ttft_ms": 500.0, "tpot_ms": 50.0}``."""
    slo = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in SLO_KEYS or not value:
            raise argparse.ArgumentTypeError(f"--slo takes {'/'.join(SLO_KEYS)}=<ms>, comma-separated; got {part!r}")
        slo[key] = float(value)
    return slo


def summarize(result: LoadResult, request_rate: float, slo: dict[str, float] | None = None) -> dict:
    """The figures of one run, under the keys ``--save-result`` writes."""
    ok, duration = result.ok(), result.duration_s
    prompt_tokens = sum(r.num_prompt_tokens for r in ok)
    out = {
        "request_rate": request_rate,
        "num_requests": len(result.records),
        "completed": len(ok),
        "errors": dict(result.errors),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": sum(r.num_tokens for r in ok) / duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": sum(r.num_tokens for r in ok),
        "cached_prompt_fraction": sum(r.num_cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
        "ttft_ms": report.distribution(r.ttft_s * 1000 for r in ok),
        "tpot_ms": report.distribution(r.tpot_s * 1000 for r in ok if r.num_tokens > 1),
        "itl_ms": report.distribution(gap * 1000 for r in ok for gap in r.itl_s()),
        "e2e_ms": report.distribution(r.e2e_s * 1000 for r in ok),
        "client": {
            "code_us_per_request": report.distribution(r.client_s * 1e6 for r in result.records)["mean"],
            "cpu_ms_per_request": result.cpu_s * 1000 / max(1, len(result.records)),
            "cpu_cores_used": result.cpu_s / duration,
            "send_lag_ms": report.distribution(r.lag_s * 1000 for r in result.records),
        },
    }
    if slo:
        good = [r for r in ok if all(_value_ms(r, key) <= bound for key, bound in slo.items())]
        out["goodput"] = {"slo": slo, "good_requests": len(good), "request_goodput": len(good) / duration}
    return out


def _value_ms(record, key: str) -> float:
    value = {"ttft_ms": record.ttft_s, "tpot_ms": record.tpot_s, "e2e_ms": record.e2e_s}[key] * 1000
    return 0.0 if math.isnan(value) else value  # a single-token answer has no TPOT to miss


def format_summary(s: dict) -> str:
    rate = "all at once" if math.isinf(s["request_rate"]) else f"{s['request_rate']:g} req/s"
    lines = [f"requests: {s['completed']}/{s['num_requests']} completed in {s['duration_s']:.2f} s ({rate})",
             f"errors by status: {s['errors'] or 'none'}",
             f"throughput: {s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output tokens/s",
             f"cached prompt tokens: {100 * s['cached_prompt_fraction']:.1f}% of {s['total_input_tokens']}",
             ]  # fmt: skip
    if "goodput" in s:
        g = s["goodput"]
        lines.append(f"goodput under {g['slo']}: {g['request_goodput']:.2f} req/s ({g['good_requests']} requests)")
    rows = [(label, *(s[key][q] for q in ("mean", "p50", "p90", "p99"))) for key, label in LATENCIES.items()]
    lines += ["", report.table(("latency (ms)", "mean", "p50", "p90", "p99"), rows), ""]
    c = s["client"]
    lines.append(f"client overhead: {c['code_us_per_request']:.0f} us of its own code and "
                 f"{c['cpu_ms_per_request']:.2f} ms of CPU per request ({c['cpu_cores_used']:.2f} cores); "
                 f"send lag p50 {c['send_lag_ms']['p50']:.2f} ms, p99 {c['send_lag_ms']['p99']:.2f} ms")  # fmt: skip
    return "\n".join(lines)


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    from engine.bundled import resolve_model
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(args.model))
    vocab = tokenizer.hf.vocab_size
    if args.dataset == "random":
        num = args.num_requests or (100 if args.duration is None else 1000)
        return random_requests(num, args.input_len, args.output_len, args.range_ratio, vocab, args.seed)
    if args.dataset == "shared-prefix":
        return shared_prefix_requests(args.num_prefixes, args.questions_per_prefix, args.prefix_len, args.input_len,
                                      args.output_len, vocab, args.seed)  # fmt: skip
    if args.dataset == "copy":
        return copy_requests(args.num_requests or 16, tokenizer, args.output_len)
    if not args.dataset_path:
        raise SystemExit("kvserve bench load: --dataset jsonl needs --dataset-path FILE")
    return jsonl_requests(args.dataset_path, tokenizer, args.output_len)


async def _run(args: argparse.Namespace, requests: list[BenchRequest], rates: list[float],
               before: dict[str, float]) -> list[LoadResult]:  # fmt: skip
    """The warm-up, then one run per rate; ``before`` gets the servers' metrics as the measured part starts."""
    backend = OpenAIBackend(args.api_key) if args.backend == "openai" else GrpcBackend(api_key=args.api_key)
    target = args.target or ("127.0.0.1:8000" if args.backend == "openai" else "127.0.0.1:50051")
    sampling = {"temperature": args.temperature, "ignore_eos": True}
    common = {"backend": backend, "sampling": sampling, "timeout_s": args.timeout}
    if args.warmup:
        await run_load(target, requests[: args.warmup], max_concurrency=args.max_concurrency, **common)
    if args.metrics_url:
        before.update(await asyncio.to_thread(scrape, args.metrics_url))
    results = []
    for rate in rates:
        results.append(await run_load(target, requests, num_requests=args.num_requests, duration_s=args.duration,
                                      request_rate=rate, burstiness=args.burstiness, seed=args.seed,
                                      max_concurrency=args.max_concurrency, progress=not args.no_progress,
                                      **common))  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    rates = [float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else [args.request_rate]

    requests = build_requests(args)
    before: dict[str, float] = {}
    results = asyncio.run(_run(args, requests, rates, before))
    summaries = [summarize(result, rate, args.slo) for result, rate in zip(results, rates, strict=True)]
    if args.metrics_url:  # over the whole run (every rate of a sweep)
        server = server_figures(before, scrape(args.metrics_url))
        summaries[-1]["server"] = server
        print("\nserver-side, from /metrics: " + json.dumps(server, indent=1))
    _report(args, results, summaries)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve bench load", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=None,
                        help="the router: HOST:PORT for grpc (default 127.0.0.1:50051), an http(s) URL or HOST:PORT "
                             "of its HTTP API for openai (default 127.0.0.1:8000)")  # fmt: skip
    parser.add_argument("--backend", choices=["grpc", "openai"], default="grpc")
    parser.add_argument("--model", default="default", help="whose tokenizer counts jsonl prompts")
    parser.add_argument("--api-key", default=None, help="the router's API key (default: $KVSERVE_API_KEY)")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=DATASETS, default="random")
    data.add_argument("--dataset-path", default=None, help="the JSONL (or ShareGPT JSON) file of --dataset jsonl")
    data.add_argument("--input-len", type=int, default=128, help="prompt tokens (shared-prefix: after the prefix)")
    data.add_argument("--output-len", type=int, default=32, help="output tokens (jsonl: when the file has no reply)")
    data.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len*(1±ratio)")
    data.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct system prompts")
    data.add_argument("--questions-per-prefix", type=int, default=8)
    data.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens of each system prompt")
    load = parser.add_argument_group("load")
    count = load.add_mutually_exclusive_group()
    count.add_argument("--num-requests", type=int, default=None,
                       help="requests to send (default: random 100, else the dataset's size), "
                            "cycling the dataset")  # fmt: skip
    count.add_argument("--duration", type=float, default=None, help="seconds to keep sending")
    load.add_argument("--request-rate", type=float, default=math.inf, help="arrivals per second (default inf: at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--sweep-rates", default=None, help="comma-separated rates, one run each, e.g. 1,2,4,8")
    load.add_argument("--warmup", type=int, default=0, help="requests sent first and left out of the figures")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    out = parser.add_argument_group("report")
    out.add_argument("--slo", type=parse_slo, default=None, help="e.g. ttft_ms=500,tpot_ms=50: adds goodput")
    out.add_argument("--save-result", default=None, help="write the figures and the arguments as JSON")
    out.add_argument("--plot", default=None, help="write a PNG: latency CDFs and load over time, or the sweep curve")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--metrics-url", action="append", default=[],
                     help="a process's /metrics (repeat for each; kvserve up prints them): "
                          "adds server-side figures")  # fmt: skip
    return parser


def _report(args: argparse.Namespace, results: list[LoadResult], summaries: list[dict]) -> None:
    """Print each run's figures (and a sweep's table), then save and plot them as ``args`` asks."""
    for summary in summaries:
        print(f"\n=== {args.backend} backend, {args.dataset} dataset\n{format_summary(summary)}")
    if len(summaries) > 1:
        rows = [(f"{s['request_rate']:g}", s["request_throughput"], s["output_token_throughput"], s["ttft_ms"]["p50"],
                 s["ttft_ms"]["p99"], s["tpot_ms"]["p50"], s["e2e_ms"]["p50"], s["e2e_ms"]["p99"],
                 sum(s["errors"].values())) for s in summaries]  # fmt: skip
        print("\n" + report.table(("rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "E2E p50",
                                   "E2E p99", "errors"), rows))  # fmt: skip
    if args.save_result:
        arguments = {k: v for k, v in vars(args).items() if k != "api_key"}  # no secret in a result file
        result = {**summaries[0], "args": arguments} if len(summaries) == 1 else {"runs": summaries, "args": arguments}
        report.save_json(args.save_result, result)
        print(f"saved {args.save_result}")
    if args.plot:
        from kvserve.bench.plots import plot_run, plot_sweep

        title = f"kvserve bench load: {args.backend}, {args.dataset}, in {args.input_len} / out {args.output_len}"
        if len(summaries) > 1:
            plot_sweep(summaries, args.plot, title)
        else:
            plot_run(results[0], args.plot, title)
        print(f"saved {Path(args.plot)}")
