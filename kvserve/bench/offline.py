"""Offline throughput: the engine's ``LLM.generate`` against transformers' batched ``generate``, same run.

    kvserve bench offline [--model M] [--baseline hf|hf-static|none] [--no-compile]
        [--num-prompts 64 --min-len 16 --max-len 256 --max-tokens 64]      random lengths (the default)
        [--batch-sizes 1,64,256 --prompt-len 128 --max-tokens 256]         one row per batch size
        [--workload nano-vllm [--nano-requests 256 --nano-lengths 100,1024]]
        [--profile [--profile-batch 64 --profile-steps 10]]
        [--diagnose [--diagnose-steps 32]]
    kvserve bench offline --speculative ngram [--spec-tokens 4 --max-tokens 128 --spec-rounds 3]
    kvserve bench offline --tiny [--batch-sizes 1,64,256 --tiny-prompt-len 16 --tiny-steps 48 --tiny-rounds 5]
        [--tiny-cpu-time]

Workloads, each timed after a warm-up, in one dtype and one thread count for both sides:

* random lengths: ``--num-prompts`` prompts of ``--min-len``..``--max-len`` tokens, ``--max-tokens``
  new tokens each, against the baseline (greedy, EOS ignored, the number of identical outputs printed);
* ``--batch-sizes``: per batch size, that many ``--prompt-len``-token prompts with ``--max-tokens``
  new tokens each, the engine and then the baseline, row by row;
* ``--workload nano-vllm``: nano-vllm's benchmark, the engine alone: 256 requests whose prompt and
  output lengths are uniform in 100..1,024, temperature 0.6, EOS ignored.

``--baseline`` (``kvserve.bench.hf_baseline``): ``hf`` is transformers' dynamic cache, ``hf-static`` its
static cache, which ``generate`` compiles with torch.compile on CUDA (``--no-compile`` turns that off).
``--tiny`` times the decode step alone on a tiny random model, where host work dominates, against
transformers' (``kvserve.bench.tiny``); it ignores ``--model`` and the other workloads.
After each timed run the engine's step diagnosis (``engine.step_diagnosis``) prints what bound its steps,
decode and prefill apart: ``bound by: memory bandwidth 71% | compute 9% | host 20%`` (shares of the device's
peak bandwidth and compute, and the host's share of the step time). ``--diagnose`` first prints, per
``--batch-sizes`` entry (default 1 and 16), the diagnosis' host share of ``--diagnose-steps`` decode steps
beside torch.profiler's reading of the very same steps (``kvserve.bench.host_share``).
``--profile`` first prints what ``kvserve.bench.profile`` finds in a few decode steps, on an engine with
``enforce_eager=True`` (the kernel launches per layer, GPU busy) and on the default one (CUDA graphs).
A mixture-of-experts model (Qwen3-MoE) ends with the share of a decode step (``--profile-batch`` sequences,
``--profile-steps`` steps after ``--prompt-len``-token prompts) spent routing and grouping by expert.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time

import torch

from kvserve.bench.hf_baseline import BASELINES, TransformersBaseline
from kvserve.bench.host_share import compare_host_share
from kvserve.bench.profile import DecodeProfile, moe_routing_share, profile_decode_steps

NANO_VLLM_TEMPERATURE = 0.6
WARM_UP_SEED = 1_000_000  # the warm-up prompts' seeds, never a batch size


def make_prompts(num: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def run_engine(llm, prompts: list[list[int]], params) -> tuple[float, list[list[int]]]:
    """(seconds, output token ids) of one ``generate``; ``params`` one for all prompts, or one per prompt."""
    _sync(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(llm)
    return time.perf_counter() - start, [o.token_ids for o in outs]


def _sync(llm) -> None:
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize(llm.engine.runner.device)


def diagnosis_totals(llm) -> dict | None:
    """The step diagnosis' totals now (None when the engine runs without it), for ``print_bound_by``."""
    return None if llm.engine.diagnosis is None else llm.engine.diagnosis.totals()


def print_bound_by(llm, before: dict | None) -> None:
    """What bound the steps since ``before`` (``diagnosis_totals``): one line per kind of step that ran."""
    if before is None:
        return
    diagnosis = llm.engine.diagnosis
    for kind, totals in diagnosis.totals().items():
        spent = totals - before[kind]
        if spent.num_steps:
            print(f"      bound by: {diagnosis.utilization(spent).line()}  ({kind}: {spent.num_steps:.0f} steps, "
                  f"{spent.wall_s / spent.num_steps * 1e3:.1f} ms each)", flush=True)  # fmt: skip


def _greedy(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _vocab(llm) -> int:
    return llm.engine.model_config.vocab_size


def random_lengths(llm, baseline: TransformersBaseline | None, args: argparse.Namespace) -> None:
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, _vocab(llm))
    max_tokens = args.max_tokens or 64
    new_tokens = args.num_prompts * max_tokens
    print(f"\n{args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, {max_tokens} new tokens each")
    llm.generate(prompts[:2], _greedy(4))  # warm-up
    before = diagnosis_totals(llm)
    engine_s, engine_tokens = run_engine(llm, prompts, _greedy(max_tokens))
    print(f"kvserve engine : {engine_s:7.2f} s  {new_tokens / engine_s:8.1f} output tokens/s", flush=True)
    print_bound_by(llm, before)
    if baseline is None:
        return
    hf_s, hf_tokens = baseline.run(prompts, max_tokens)
    print(f"{baseline.name:<15}: {hf_s:7.2f} s  {new_tokens / hf_s:8.1f} output tokens/s")
    print(f"speed-up       : {hf_s / engine_s:.2f}x")
    same = sum(a == b for a, b in zip(engine_tokens, hf_tokens, strict=True))
    print(f"identical greedy outputs: {same}/{len(prompts)} (padding changes transformers' numerics slightly)")


def batch_rows(llm, baseline: TransformersBaseline | None, batch_sizes: list[int], prompt_len: int,
               max_tokens: int, baseline_max_batch: int | None = None) -> None:  # fmt: skip
    """One row per batch size: the engine, then the baseline (up to ``baseline_max_batch`` prompts), on the
    same prompts (engine warm-up prompts differ from the timed ones, so the prefix cache cannot skip the
    timed prefill)."""
    name = baseline.name if baseline else "baseline"
    print(f"\n{prompt_len}-token prompts, {max_tokens} new tokens each, greedy, EOS ignored (output tokens/s)")
    print(f"{'batch':>5} {'engine':>10} {name:>10} {'engine/' + name:>17}")
    for batch in batch_sizes:
        prompts = make_prompts(batch, prompt_len, prompt_len, _vocab(llm), seed=batch)
        # (a seed of its own: random.Random(-n) draws what random.Random(n) does)
        llm.generate(make_prompts(batch, prompt_len, prompt_len, _vocab(llm), seed=WARM_UP_SEED + batch), _greedy(2))
        before = diagnosis_totals(llm)
        engine_s, _ = run_engine(llm, prompts, _greedy(max_tokens))
        engine_rate = batch * max_tokens / engine_s
        if baseline is None or (baseline_max_batch is not None and batch > baseline_max_batch):
            print(f"{batch:>5} {engine_rate:10.1f} {'-':>10}", flush=True)
        else:
            baseline_rate = batch * max_tokens / baseline.run(prompts, max_tokens)[0]
            print(f"{batch:>5} {engine_rate:10.1f} {baseline_rate:10.1f} {engine_rate / baseline_rate:16.2f}x",
                  flush=True)  # fmt: skip
        print_bound_by(llm, before)


def nano_vllm_workload(llm, num_requests: int, min_len: int, max_len: int) -> None:
    """nano-vllm's benchmark: random prompt and output lengths, sampled at temperature 0.6, EOS ignored."""
    from engine import SamplingParams

    rng = random.Random(0)
    vocab = min(10_000, _vocab(llm))
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_requests)]
    params = [SamplingParams(temperature=NANO_VLLM_TEMPERATURE, ignore_eos=True,
                             max_tokens=rng.randint(min_len, max_len)) for _ in range(num_requests)]  # fmt: skip
    llm.generate(prompts[:2], _greedy(4))  # warm-up
    before = diagnosis_totals(llm)
    seconds, tokens = run_engine(llm, prompts, params)
    num_tokens = sum(len(t) for t in tokens)
    print(f"\nnano-vllm workload: {num_requests} requests, prompts and outputs of {min_len}-{max_len} tokens, "
          f"temperature {NANO_VLLM_TEMPERATURE}, EOS ignored")  # fmt: skip
    print(f"kvserve engine : {num_tokens} output tokens in {seconds:.2f} s = {num_tokens / seconds:.1f} tok/s",
          flush=True)  # fmt: skip
    print_bound_by(llm, before)


def _busy(profile: DecodeProfile) -> str:
    return "n/a (no CUDA)" if profile.gpu_busy is None else f"{profile.gpu_busy:.0%}"


def print_profiles(eager: DecodeProfile, graphs: DecodeProfile, batch: int, prompt_len: int, steps: int) -> None:
    print(f"\nprofile of {steps} decode steps at batch {batch} after {prompt_len}-token prompts")
    for mode, p in (("eager ", eager), ("graphs", graphs)):
        print(f"{mode}: {p.launches_per_step:.0f} kernels and {p.host_launches_per_step:.0f} host launches per step, "
              f"{p.wall_ms:.2f} ms per step, {p.kernel_ms:.2f} ms of it in kernels")  # fmt: skip
    print(f"launches per layer (eager): {eager.launches_per_layer:.1f}")
    print(f"launches per layer (graphs, a whole step's kernels over the layers): {graphs.launches_per_layer:.1f}")
    print(f"GPU busy (eager): {_busy(eager)}")
    print(f"GPU busy (graphs): {_busy(graphs)}", flush=True)


def print_host_shares(llm, batch_sizes: list[int], prompt_len: int, steps: int) -> None:
    """Per batch size, the diagnosis' host share of decode steps beside torch.profiler's (``bench.host_share``)."""
    print(f"\nhost share of {steps} decode steps after {prompt_len}-token prompts: the step diagnosis against "
          "torch.profiler on the same profiled steps")  # fmt: skip
    for batch in batch_sizes:
        shares = compare_host_share(llm, batch, prompt_len, steps)
        gap = shares.diagnosis - shares.profiler
        relative = f"{gap / shares.profiler:+.0%}" if shares.profiler > 0 else "n/a"
        print(f"batch {batch:>3}: Python tracer on: diagnosis {shares.diagnosis:.2%} | torch.profiler, same "
              f"definition {shares.profiler:.2%} (difference {gap * 100:+.2f} points, {relative} of the "
              "profiler's)")  # fmt: skip
        print(f"           operators only: diagnosis {shares.operators_diagnosis:.2%} | torch.profiler, outside "
              f"torch operators {shares.outside_operators:.2%}")  # fmt: skip
        print(f"           no profiler: diagnosis {shares.unprofiled:.2%}", flush=True)


def print_moe_share(llm, batch: int, prompt_len: int, steps: int) -> None:
    """A mixture-of-experts model: the share of a decode step spent routing tokens and grouping them by
    expert (``kvserve.bench.profile.moe_routing_share``), on an eager step (hooks see no replayed graph)."""
    if llm.engine.runner.graphs is not None:
        print("\nMoE routing share: n/a under CUDA graphs (run with an eager engine)", flush=True)
        return
    share = moe_routing_share(llm, batch, prompt_len, steps)
    step = f"MoE decode step at batch {batch} after {prompt_len}-token prompts: {share.step_ms:.2f} ms"
    print(f"\n{step}, {share.moe_ms:.2f} ms of it in the MoE MLPs, {share.experts_ms:.2f} ms in their experts' GEMMs")
    print(f"MoE routing and grouping: {share.routing_share:.1%} of a decode step", flush=True)


def tiny_table(batch_sizes: list[int], prompt_len: int, steps: int, rounds: int, cpu_time: bool = False) -> None:
    """``kvserve.bench.tiny``'s table, on one thread: engine and transformers ms per decode step, their
    ratio, the engine's ms in its model and host us per sequence; then attention against SDPA."""
    import tempfile

    from kvserve.bench import tiny
    from kvserve.bench.report import table

    torch.set_num_threads(1)
    tiny.CLOCK = time.process_time if cpu_time else time.perf_counter
    clock = "CPU" if cpu_time else "wall"
    print(f"tiny model ({tiny.TINY_PRESET}, float32, 1 thread, {clock} time): {prompt_len}-token prompts, "
          f"{steps} decode steps timed, median of {rounds} alternating rounds", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        rows = tiny.run(tiny.write_tiny_model(tmp), batch_sizes, prompt_len, steps, rounds)
    header = ["batch", "engine ms", "hf ms", "engine/hf", "engine model ms", "host us/seq"]
    print(table(header, [[r["batch"], r["engine_s"] * 1e3, r["hf_s"] * 1e3, r["engine_s"] / r["hf_s"],
                          r["model_s"] * 1e3, r["host_per_seq_s"] * 1e6] for r in rows]))  # fmt: skip
    print("host us/seq = (engine step - its time inside model forward and logits) / batch")
    batch, length = max(batch_sizes), prompt_len + steps
    paged, sdpa = tiny.attention_vs_sdpa_s(batch, length)
    print(f"decode attention at batch {batch}, {length} tokens each: reference {paged * 1e6:.0f} us, "
          f"SDPA over the tokens gathered {sdpa * 1e6:.0f} us ({paged / sdpa:.2f}x)", flush=True)  # fmt: skip


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve bench offline", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--baseline", choices=BASELINES, default="hf", help="transformers' generate to compare with")
    parser.add_argument("--no-compile", action="store_true", help="hf-static without torch.compile")
    parser.add_argument("--baseline-max-batch", type=int, default=None,
                        help="--batch-sizes rows above this run the engine alone (each new batch size "
                        "recompiles hf-static)")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt (64; rows: 256)")
    parser.add_argument("--batch-sizes", type=_int_list, default=None, help="comma-separated, e.g. 1,64,256")
    parser.add_argument("--prompt-len", type=int, default=128, help="of --batch-sizes rows and of --profile")
    parser.add_argument("--workload", choices=["random", "nano-vllm"], default=None,
                        help="default: random lengths, unless --batch-sizes is given")  # fmt: skip
    parser.add_argument("--nano-requests", type=int, default=256)
    parser.add_argument("--nano-lengths", type=_int_list, default=[100, 1024], help="min,max prompt/output length")
    parser.add_argument("--profile", action="store_true", help="profile decode steps, eager and with CUDA graphs")
    parser.add_argument("--profile-batch", type=int, default=64)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--diagnose", action="store_true",
                        help="the step diagnosis' host share against torch.profiler's, per --batch-sizes entry")
    parser.add_argument("--diagnose-steps", type=int, default=32, help="decode steps compared per batch size")
    parser.add_argument("--tiny", action="store_true", help="decode step time on a tiny model vs transformers")
    parser.add_argument("--tiny-prompt-len", type=int, default=16)
    parser.add_argument("--tiny-steps", type=int, default=48, help="decode steps timed per round")
    parser.add_argument("--tiny-rounds", type=int, default=5)
    parser.add_argument("--tiny-cpu-time", action="store_true", help="time CPU time, not wall (a busy machine)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--speculative", choices=["ngram"], default=None,
                        help="speculative decoding against none instead (kvserve.bench.speculative; its own flags)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="share of the GPU's total memory for the engine (transformers: the rest)")  # fmt: skip
    args = parser.parse_args(argv)
    if len(args.nano_lengths) != 2 or not 1 <= args.nano_lengths[0] <= args.nano_lengths[1]:
        parser.error(f"--nano-lengths takes MIN,MAX with 1 <= MIN <= MAX, got {args.nano_lengths}")
    if args.workload is None and not args.batch_sizes:
        args.workload = "random"
    return args


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    spec = [i for i, a in enumerate(argv) if a == "--speculative" or a.startswith("--speculative=")]
    if spec:  # its own workloads and flags (the method is checked by parse_args' choices first)
        from kvserve.bench import speculative

        at = spec[0]
        span = 1 if "=" in argv[at] else 2
        parse_args(argv[at : at + span])
        speculative.main(argv[:at] + argv[at + span :])
        return
    args = parse_args(argv)
    if args.tiny:
        tiny_table(args.batch_sizes or [1, 64, 256], args.tiny_prompt_len, args.tiny_steps, args.tiny_rounds,
                   args.tiny_cpu_time)  # fmt: skip
        return
    from engine import LLM
    from engine.bundled import resolve_model

    # Token-id prompts in, token ids out: no tokenizer needed (random models of real shapes have none).
    options = dict(max_num_batched_tokens=args.max_num_batched_tokens, skip_tokenizer_init=True,
                   gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    if args.profile:
        eager_llm = LLM(args.model, enforce_eager=True, **options)
        eager = profile_decode_steps(eager_llm, args.profile_batch, args.prompt_len, args.profile_steps)
        del eager_llm  # its KV pool, before the next engine takes its own
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    llm = LLM(args.model, **options)
    runner = llm.engine.runner
    print(f"dtype {runner.dtype}, device {runner.device}, {torch.get_num_threads()} threads", flush=True)
    print(runner.graphs.summary() if runner.graphs is not None else "decode CUDA graphs: none (eager)", flush=True)
    if llm.engine.diagnosis is not None:
        print(llm.engine.diagnosis.peaks.describe(), flush=True)
    if args.profile:
        graphs = profile_decode_steps(llm, args.profile_batch, args.prompt_len, args.profile_steps)
        print_profiles(eager, graphs, args.profile_batch, args.prompt_len, args.profile_steps)
    if args.diagnose:
        print_host_shares(llm, args.batch_sizes or [1, 16], args.prompt_len, args.diagnose_steps)
    baseline = None
    if args.baseline != "none" and (args.batch_sizes or args.workload == "random"):
        baseline = TransformersBaseline(resolve_model(args.model), runner.dtype, runner.device,
                                        static=args.baseline == "hf-static", compiled=not args.no_compile)  # fmt: skip
    if args.batch_sizes:
        batch_rows(llm, baseline, args.batch_sizes, args.prompt_len, args.max_tokens or 256, args.baseline_max_batch)
    if args.workload == "nano-vllm":
        nano_vllm_workload(llm, args.nano_requests, *args.nano_lengths)
    elif args.workload == "random":
        random_lengths(llm, baseline, args)
    if llm.engine.model_config.num_experts:
        print_moe_share(llm, args.profile_batch, args.prompt_len, args.profile_steps)


if __name__ == "__main__":
    main()
