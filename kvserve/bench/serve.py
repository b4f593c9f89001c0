"""Disaggregation overhead: TTFT and TPOT through a local 1P+1D cluster vs the offline engine, same prompts.

    kvserve bench serve [--device cpu|cuda] [--model default|DIR] [--num-prompts 8] [--prompt-len 256]
                        [--max-tokens 32] [--handoff-tokens 2048] [--backend auto|shm|grpc|nixl] [--netns]

Requests go one at a time, so the figures are latencies, not throughput. The offline engine runs in
this process; the cluster's workers run as separate processes on the same device (on a GPU each of the
three processes keeps to its share of the GPU's memory). Each prompt goes to the offline engine and then
to the cluster, alternating, so that both see the machine in the same state; both decode greedily, and
their tokens must be equal (exit status 1 when they are not).

Prompts are token ids, so no tokenizer is loaded anywhere: a random model directory (``kvserve model
random``) serves as well as a real one. The KV hand-off is measured on ``--handoff-tokens`` prompts: what
the prefill worker reports (the prefill, during which its layers store the KV straight into the decode
worker's pool with ``shm``/``cuda_ipc``, and the hand-off's cost after it), and on a GPU the cuda_ipc
stores alone, from another process, with this model's KV shape (``kvserve.bench.cuda_ipc``).

``--netns`` (CPU): the cluster runs over three test hosts instead (``kvserve.testing.multihost``: Redis and the router,
the prefill worker, the decode worker, each in a network namespace with its own /dev/shm), so the KV crosses
a real network link over nixl or grpc (auto: nixl when NIXL is installed); the offline engine stays here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.bench.offline import make_prompts
from kvserve.bench.report import median, table
from kvserve.testing import netns
from rpc.threads import host_cores


@dataclass
class Sample:
    """One prompt's latencies (ms) and greedy tokens; ``timings`` and ``backend`` as the cluster reports them."""

    ttft_ms: float
    tpot_ms: float
    token_ids: list[int]
    timings: dict[str, float] = field(default_factory=dict)
    backend: str = ""


def _offline_engine(args: argparse.Namespace):
    from engine import LLMEngine, SamplingParams

    memory = {"num_blocks": 512} if args.device == "cpu" else {"gpu_memory_utilization": args.offline_gpu_share}
    engine = LLMEngine(model=args.model, device=args.device, skip_tokenizer_init=True, **memory)
    engine.add_request([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def _time_offline(engine, prompt: list[int], max_tokens: int) -> Sample:
    from engine import SamplingParams

    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    first, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.token_ids
        first = first or time.perf_counter()
    end = time.perf_counter()
    return Sample((first - start) * 1e3, (end - first) * 1e3 / max(1, max_tokens - 1), list(tokens))


def _time_served(client, prompt: list[int], max_tokens: int) -> Sample:
    start = time.perf_counter()
    first, tokens, last = None, [], None
    for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        first = first or time.perf_counter()
        tokens += chunk.token_ids
        last = chunk
    end = time.perf_counter()
    return Sample((first - start) * 1e3, (end - first) * 1e3 / max(1, max_tokens - 1), tokens, last.timings,
                  last.transfer_backend)  # fmt: skip


def _run(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[list[Sample], list[Sample]]:
    """Each prompt offline, then through the cluster, alternating, so both see the same machine."""
    from kvserve.client import Client
    from kvserve.launcher.cluster import free_base_port, start_cluster
    from kvserve.settings import parse_up

    engine_argv = ["--model", args.model, "--device", args.device, "--skip-tokenizer-init", "true"]
    if args.device == "cpu":
        engine_argv += ["--num-blocks", "512"]
    decode_argv = [] if args.backend == "auto" else ["--kv-transport", args.backend]
    with ExitStack() as stack:
        if args.netns:
            from kvserve.testing.multihost import multihost_cluster

            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvserve-bench-")))
            endpoint = stack.enter_context(multihost_cluster(engine_argv, logs, decode_argv,
                                                             threads=args.worker_threads)).endpoint  # fmt: skip
        else:
            up = parse_up([*engine_argv, *decode_argv, "--port", str(free_base_port(2)), "--http-port", "0",
                           *(["--threads", str(args.worker_threads)] if args.worker_threads else []),
                           "--prefill-gpu-memory-utilization", str(args.prefill_gpu_share),
                           "--decode-gpu-memory-utilization", str(args.decode_gpu_share)])  # fmt: skip
            cluster = start_cluster(up)
            stack.callback(cluster.stop)
            endpoint = cluster.endpoint
        engine = _offline_engine(args)
        offline, served = [], []
        with Client(endpoint, timeout_s=300) as client:
            client.generate(prompts[0][:8], max_tokens=2, temperature=0)  # warm-up
            for prompt in prompts:
                offline.append(_time_offline(engine, prompt, args.max_tokens))
                served.append(_time_served(client, prompt, args.max_tokens))
    return offline, served


def _model_kv_spec(model: str):
    """The KV layout this model's workers use on a GPU (bfloat16, blocks of 16)."""
    import torch

    from engine.bundled import resolve_model
    from engine.model_config import ModelConfig
    from kvstore import KVCacheSpec

    config = ModelConfig.from_dir(resolve_model(model))
    return KVCacheSpec(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                       block_size=16, dtype=torch.bfloat16)  # fmt: skip


def _mismatches(offline: list[Sample], served: list[Sample]) -> list[str]:
    lines = []
    for i, (a, b) in enumerate(zip(offline, served, strict=True)):
        if a.token_ids != b.token_ids:
            at = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
                      min(len(a.token_ids), len(b.token_ids)))  # fmt: skip
            lines.append(f"prompt {i}: tokens differ from position {at} (offline {a.token_ids[at : at + 4]}, "
                         f"cluster {b.token_ids[at : at + 4]})")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench serve", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", default="default", help="'default' (bundled) or a model directory")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--handoff-tokens", type=int, default=2048, help="prompt length of the hand-off figures")
    parser.add_argument("--handoff-prompts", type=int, default=3, help="prompts of that length (median)")
    parser.add_argument("--backend", choices=["auto", "shm", "grpc", "nixl"], default="auto",
                        help="KV hand-off; auto: shm on a CPU, cuda_ipc on a GPU; with --netns nixl, else grpc")
    parser.add_argument("--worker-threads", type=int, default=host_cores(),
                        help="each worker's torch threads (default: every core, as the offline engine has: "
                        "requests go one at a time, so the workers take turns)")  # fmt: skip
    parser.add_argument("--netns", action="store_true",
                        help="the cluster over three test hosts (network namespaces: root, `ip`; CPU only)")
    gpu = parser.add_argument_group("GPU memory: fractions of the GPU's total memory, the three processes share it")
    gpu.add_argument("--prefill-gpu-share", type=float, default=0.3, help="the prefill worker's")
    gpu.add_argument("--decode-gpu-share", type=float, default=0.4, help="the decode worker's")
    gpu.add_argument("--offline-gpu-share", type=float, default=0.2, help="the offline engine's (this process)")
    args = parser.parse_args(argv)
    if args.netns and (args.device != "cpu" or args.backend == "shm"):
        parser.error("--netns runs on the CPU, and its hosts share no memory: no shm")
    if args.netns and (reason := netns.unavailable()):
        parser.error(f"--netns: {reason}")
    if args.netns and args.backend == "auto":  # forced: a lazily started agent would leave the first ones to grpc
        from transfer.backend import nixl_installed

        args.backend = "nixl" if nixl_installed() else "grpc"

    from engine.bundled import resolve_model
    from engine.model_config import ModelConfig

    vocab = ModelConfig.from_dir(resolve_model(args.model)).vocab_size
    prompts = make_prompts(args.num_prompts, args.prompt_len, args.prompt_len, vocab, seed=1)
    long = make_prompts(args.handoff_prompts, args.handoff_tokens, args.handoff_tokens, vocab, seed=2)
    offline, served = _run(args, prompts + long)
    n = args.num_prompts
    print(f"{args.model} on {args.device}: {n} prompts of {args.prompt_len} tokens, {args.max_tokens} new tokens, "
          "one at a time")  # fmt: skip
    rows = [(name, median(s.ttft_ms for s in samples[:n]), median(s.tpot_ms for s in samples[:n]))
            for name, samples in (("offline engine", offline), (f"1P+1D cluster ({served[0].backend})", served))]
    rows.append(("ratio cluster/offline", rows[1][1] / rows[0][1], rows[1][2] / rows[0][2]))  # fmt: skip
    print(table(("median", "TTFT ms", "TPOT ms"), rows))
    ttft_served, ttft_offline = (median(s.ttft_ms for s in samples[n:]) for samples in (served, offline))
    prefill, after = (median(s.timings[key] for s in served[n:]) for key in ("prefill_ms", "transfer_ms"))
    print(f"hand-off of a {args.handoff_tokens}-token prompt ({served[n].backend}, median of {len(long)}): TTFT "
          f"cluster {ttft_served:.1f} ms vs offline {ttft_offline:.1f} ms; the prefill worker's prefill "
          f"{prefill:.1f} ms (storing the KV into the decode worker's pool as it goes, for shm/cuda_ipc), then "
          f"{after:.1f} ms to hand it off (verify or push)")  # fmt: skip
    if args.device == "cuda":
        from kvserve.bench.cuda_ipc import format_hand_off, measure_hand_off

        print(f"the cuda_ipc stores alone, {args.handoff_tokens} tokens of this model's KV, from another process:")
        print(format_hand_off(measure_hand_off(_model_kv_spec(args.model), args.handoff_tokens)))
    wrong = _mismatches(offline, served)
    print(f"greedy tokens: cluster == offline engine for {len(served) - len(wrong)}/{len(served)} prompts")
    if wrong:
        print("\n".join(wrong))
        sys.exit(1)


if __name__ == "__main__":
    main()
