"""The tiny model's decode step time, an older commit's engine against this tree's, in one run.

    .venv/bin/python scripts/step_time.py [--before 26972fc] [--now DIR] [--batch-sizes 64,1,256]
                                          [--prompt-len 16 --steps 48 --rounds 5] [--cpu-time]

A refactor must not add host work to the decode step; on the tiny model (``kvserve.bench.tiny``: 2 layers,
width 64, fp32) host work is most of the step, so this is where it shows. The script makes a temporary
``git worktree`` of ``--before``, writes the tiny model once, and starts one worker process per tree, its
working directory and ``PYTHONPATH`` at that tree, so ``import engine`` there is that tree's engine. Both
workers load this tree's ``kvserve/bench/tiny.py`` by path and time steps through the public engine API both
trees have (``LLMEngine``, ``add_request``, ``step``, ``SamplingParams``), one thread each. Rounds alternate
which tree goes first, to cancel the machine's drift, and each figure is the median over rounds. ``--now``
measures another copy of the tree (a scratch copy with changes to try) in place of this checkout;
``--cpu-time`` times each worker's CPU time instead of wall time (a machine other jobs share).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "kvserve" / "bench" / "tiny.py"
DEFAULT_BEFORE = "26972fc"  # the last commit before the engine/service refactor


def _load_tiny():
    """``kvserve.bench.tiny`` from this tree's file, whichever tree's packages are importable."""
    spec = importlib.util.spec_from_file_location("tiny_bench", TINY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(model_dir: str, max_batch: int, prompt_len: int, steps: int, cpu_time: bool) -> None:
    """Answer each batch size read from stdin with ``{"step_s": ...}``: one untimed run, then a timed one."""
    import torch

    torch.set_num_threads(1)
    tiny = _load_tiny()
    if cpu_time:
        tiny.CLOCK = time.process_time
    engine = tiny.make_engine(model_dir, max_batch, prompt_len + steps + 3)
    for line in sys.stdin:
        prompts = tiny.make_prompts(int(line), prompt_len, seed=int(line))
        step_s, _ = tiny.engine_step_s(engine, prompts, steps)
        print(json.dumps({"step_s": step_s}), flush=True)


class Worker:
    def __init__(self, tree: Path, model_dir: Path, args: argparse.Namespace) -> None:
        env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
        sizes = [str(max(args.batch_sizes)), str(args.prompt_len), str(args.steps), str(int(args.cpu_time))]
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(model_dir), *sizes]
        self.process = subprocess.Popen(command, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)  # fmt: skip

    def step_s(self, batch: int) -> float:
        self.process.stdin.write(f"{batch}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker in {self.process.args[1]} exited with {self.process.wait()}")
        return json.loads(line)["step_s"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def compare(args: argparse.Namespace, before_tree: Path, model_dir: Path) -> list[tuple[int, float, float]]:
    """(batch, before seconds, after seconds) per batch size: medians of alternating rounds."""
    workers = {"before": Worker(before_tree, model_dir, args), "after": Worker(args.now, model_dir, args)}
    try:
        rows = []
        for batch in args.batch_sizes:
            times: dict[str, list[float]] = {name: [] for name in workers}
            for w in workers.values():
                w.step_s(batch)  # warm-up at this size
            for r in range(args.rounds):
                for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    times[name].append(workers[name].step_s(batch))
            rows.append((batch, statistics.median(times["before"]), statistics.median(times["after"])))
            print(f"batch {batch}: before {[round(t * 1e3, 2) for t in times['before']]} ms, "
                  f"after {[round(t * 1e3, 2) for t in times['after']]} ms", flush=True)  # fmt: skip
        return rows
    finally:
        for w in workers.values():
            w.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=DEFAULT_BEFORE, help="the commit to compare with")
    parser.add_argument("--now", type=Path, default=ROOT, help="the tree to measure as now (default: this one)")
    parser.add_argument("--batch-sizes", type=lambda t: [int(x) for x in t.split(",")], default=[64, 1, 256])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu-time", action="store_true", help="time CPU time, not wall time")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        model_dir, max_batch, prompt_len, steps, cpu_time = args.worker
        worker(model_dir, int(max_batch), int(prompt_len), int(steps), cpu_time == "1")
        return
    with tempfile.TemporaryDirectory() as tmp:
        before_tree = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(before_tree),
                        args.before], check=True)  # fmt: skip
        try:
            model_dir = _load_tiny().write_tiny_model(Path(tmp) / "model")
            rows = compare(args, before_tree, model_dir)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before_tree)], check=True)
    clock = "CPU" if args.cpu_time else "wall"
    print(f"\ndecode step of the tiny model ({clock} time), {args.prompt_len}-token prompts, median of {args.rounds} "
          "rounds")  # fmt: skip
    print(f"{'batch':>5} {args.before + ' ms':>14} {'now ms':>10} {'now/before':>11}")
    for batch, before_s, after_s in rows:
        print(f"{batch:>5} {before_s * 1e3:14.2f} {after_s * 1e3:10.2f} {after_s / before_s:10.2f}x")


if __name__ == "__main__":
    main()
