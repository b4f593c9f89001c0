"""StreamingLLM's ring buffer: flat memory and speed over a long generation, and perplexity against the full
cache and a window without sinks.

    kvserve bench ring [--tokens 32768] [--every 1024] [--sinks 4] [--window 1020]
                       [--ppl-tokens 12288] [--only generate|perplexity] [--plot ring.png]

* generate: one request generates ``--tokens`` tokens with ``streaming_sinks`` + ``streaming_window`` on the
  bundled model; every ``--every`` tokens the process's resident memory and the tokens/s since the last sample
  are recorded. Memory should stop growing once the ring is full, and tokens/s stay level.
* perplexity: teacher-forced perplexity over a long text, per position bucket, for three caches: the full
  cache (up to the model's context), sinks + window, and the same window with no sinks. The text is the
  docstrings of this Python's standard library, module by module (``long_text``). The engine scores the
  tokens itself: each chunk goes through its own step inputs, model, ring and attention kernels (the
  engine's staging and the block manager's ring), and the logits of every row are kept.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import time
import warnings
from pathlib import Path

import numpy as np

from kvserve.bench import report

TEXT_MODULES = ("argparse", "collections", "functools", "itertools", "json", "logging", "os", "pathlib", "re",
                "subprocess", "threading", "typing", "unittest", "email.message", "http.client", "urllib.request",
                "asyncio", "datetime", "decimal", "fractions", "statistics", "textwrap", "inspect", "pickle",
                "socket", "sqlite3", "tarfile", "zipfile", "shutil", "tempfile", "contextlib", "dataclasses",
                "enum", "abc", "io", "string", "random", "math", "heapq", "bisect", "queue", "sched", "csv",
                "configparser", "gettext", "locale", "calendar", "difflib", "pprint", "doctest", "pdb",
                "cProfile", "timeit", "traceback", "warnings", "weakref", "copy", "types", "operator",
                "ipaddress", "mailbox", "smtplib", "ftplib", "imaplib", "xml.dom.minidom", "html.parser")  # fmt: skip


def rss_mib() -> float:
    """This process's resident memory now (Linux ``/proc``), in MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import resource

    return pages * resource.getpagesize() / 2**20


def long_text() -> str:
    """The docstrings of ``TEXT_MODULES`` and of their public members, in a fixed order (English prose about
    code, the same on every run of one Python version)."""
    parts = []
    for name in TEXT_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(vars(module)):
            member = vars(module)[attr]
            if attr.startswith("_") or getattr(member, "__module__", None) != module.__name__:
                continue
            with warnings.catch_warnings():  # (typing.io and typing.re warn when their docstring is read)
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = inspect.getdoc(member)
            if doc and len(doc) > 80:
                parts.append(f"{attr}: {doc}")
    return "\n\n".join(p for p in parts if p)


# -- generate ------------------------------------------------------------------------------------------------


def generate(llm, num_tokens: int, every: int, sinks: int, window: int, progress=None) -> list[dict]:
    """Rows of (tokens generated, RSS MiB, tokens/s over the last ``every``, the most blocks the request held
    since the last row and their MiB of KV), each also handed to ``progress`` as it is taken (a long run shows
    how it goes). The RSS includes the KV pool, allocated whole at start-up; the blocks are the request's."""
    from engine import SamplingParams

    engine = llm.engine
    prompt = llm.tokenizer.encode("Once upon a time, in a library that never closed,")
    params = SamplingParams(temperature=0.8, seed=0, max_tokens=num_tokens, ignore_eos=True,
                            streaming_window=window, streaming_sinks=sinks)  # fmt: skip
    rid = engine.add_request(prompt, params)
    block_mib = engine.runner.kv_spec.bytes_per_block() / 2**20
    rows, done, last_time, last_done, blocks = [], 0, time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        blocks = max(blocks, len(engine.block_manager.block_table(rid)))  # (before the step that may free them)
        for out in engine.step():
            done = out.num_output_tokens
        blocks = max(blocks, len(engine.block_manager.block_table(rid)))
        if done - last_done >= every or not engine.has_unfinished_requests():
            now = time.perf_counter()
            rows.append({"tokens": done, "rss_mib": rss_mib(), "tok_s": (done - last_done) / (now - last_time),
                         "blocks": blocks, "kv_mib": blocks * block_mib})  # fmt: skip
            if progress is not None:
                progress(rows[-1])
            last_time, last_done, blocks = now, done, 0
    return rows


# -- perplexity ----------------------------------------------------------------------------------------------


def score(engine, tokens: list[int], params, chunk: int) -> np.ndarray:
    """Negative log-likelihood ``(len(tokens) - 1,)`` of each token after the first, teacher-forced, through
    the engine's own step inputs, model and KV (a ring when ``params`` asks for a window)."""
    import torch

    from engine.input_batch import stage_step

    seq = engine._new_sequence(tokens, params, f"score-{id(params)}")
    block_manager, runner = engine.block_manager, engine.runner
    nll = np.empty(len(tokens) - 1, dtype=np.float64)
    target = torch.tensor(tokens[1:] + [0], device=runner.device)
    try:
        with torch.inference_mode():
            start = 0
            while start < len(tokens) - 1:
                n = seq.num_tokens_to_compute(start, min(chunk, len(tokens) - 1 - start))
                if not block_manager.allocate(seq.seq_id, start + n, ring=seq.ring):
                    raise RuntimeError("the KV pool cannot hold the scored text")
                seq.block_table, seq.num_computed_tokens = block_manager.block_table_array(seq.seq_id), start
                step = stage_step(runner.staging, [seq], [n], 0, runner.block_size)
                hidden = runner.model(step.input_ids, step.positions, runner.kv_cache.layers, step.meta)
                logprobs = torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)
                picked = logprobs.gather(1, target[start : start + n, None])[:, 0]
                nll[start : start + n] = (-picked).double().cpu().numpy()
                start += n
    finally:
        block_manager.free(seq.seq_id)
    return nll


def perplexity(llm, num_tokens: int, sinks: int, window: int, bucket: int) -> tuple[list[dict], dict]:
    """Rows of perplexity per ``bucket`` positions for the three caches, and what was measured."""
    from engine import SamplingParams

    engine = llm.engine
    text = long_text()
    tokens = llm.tokenizer.encode(text)[:num_tokens]
    if len(tokens) < num_tokens:
        raise ValueError(f"the text has {len(tokens)} tokens; ask for at most that many (--ppl-tokens)")
    full_len = min(num_tokens, engine.max_model_len - 1)
    caches = {
        "full": (tokens[:full_len], SamplingParams()),
        "sinks+window": (tokens, SamplingParams(streaming_window=window, streaming_sinks=sinks)),
        "window only": (tokens, SamplingParams(streaming_window=sinks + window, streaming_sinks=0)),
    }
    nll, seconds = {}, {}
    for name, (text_tokens, params) in caches.items():
        began = time.perf_counter()
        nll[name] = score(engine, text_tokens, params, chunk=512)
        seconds[name] = time.perf_counter() - began
    rows = []
    for first in range(0, num_tokens - 1, bucket):
        row = {"positions": f"{first + 1}-{min(first + bucket, num_tokens - 1)}"}  # (position 0 is not scored)
        for name, values in nll.items():
            part = values[first : first + bucket]
            row[name] = math.exp(float(part.mean())) if part.size else math.nan
        rows.append(row)

    def ppl(values: np.ndarray, first: int, end: int) -> float:
        part = values[first:end]
        return math.exp(float(part.mean())) if part.size else math.nan

    past = sinks + window  # scored tokens from here on have lost tokens of their context to the window
    spans = {"every position it ran": (0, num_tokens), f"{past + 1}-{full_len - 1} (both run, past the window)":
             (past, full_len - 1), f"{full_len}- (past the full cache)": (full_len - 1, num_tokens)}  # fmt: skip
    about = {
        "text_tokens": len(tokens),
        "full_cache_tokens": full_len,
        "seconds": seconds,
        "spans": {span: {name: ppl(v, *bounds) for name, v in nll.items()} for span, bounds in spans.items()},
    }
    return rows, about


# -- report --------------------------------------------------------------------------------------------------


def plot(generated: list[dict] | None, ppl: list[dict] | None, bucket: int, path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (2 if generated else 0) + (1 if ppl else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    axes = list(axes[0])
    if generated:
        x = [r["tokens"] for r in generated]
        memory, speed = axes.pop(0), axes.pop(0)
        memory.plot(x, [r["rss_mib"] for r in generated], "o-", markersize=3, label="process RSS (KV pool included)")
        memory.plot(x, [r["kv_mib"] for r in generated], "s-", markersize=3, label="KV the request holds")
        memory.set(xlabel="tokens generated", ylabel="MiB", title="memory", ylim=(0, None))
        memory.grid(alpha=0.3)
        memory.legend()
        speed.plot(x, [r["tok_s"] for r in generated], "o-", markersize=3, color="tab:green")
        speed.set(xlabel="tokens generated", ylabel="tokens/s (since the last sample)", title="speed", ylim=(0, None))
        speed.grid(alpha=0.3)
    if ppl:
        ax = axes.pop(0)
        mids = [i * bucket + bucket / 2 for i in range(len(ppl))]
        for name in ("full", "sinks+window", "window only"):
            ax.plot(mids, [r[name] for r in ppl], "o-", markersize=3, label=name)
        ax.set(xlabel="position in the text (tokens)", ylabel="perplexity (log scale)", yscale="log",
               title="perplexity per position bucket")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _show(row: dict) -> None:
    print(f"  {row['tokens']} tokens: RSS {row['rss_mib']:.0f} MiB, {row['tok_s']:.1f} tok/s, {row['blocks']} blocks "
          f"({row['kv_mib']:.1f} MiB of KV)", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench ring", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens to generate (generate)")
    parser.add_argument("--every", type=int, default=1024, help="sample memory and speed every this many tokens")
    parser.add_argument("--sinks", type=int, default=4, help="streaming_sinks")
    parser.add_argument("--window", type=int, default=1020, help="streaming_window")
    parser.add_argument("--ppl-tokens", type=int, default=12288, help="tokens of text to score (perplexity)")
    parser.add_argument("--bucket", type=int, default=1024, help="positions per perplexity bucket")
    parser.add_argument("--only", choices=("generate", "perplexity"), default=None, help="run one part only")
    parser.add_argument("--plot", default="ring.png", help="the PNG to write")
    parser.add_argument("--save-result", default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.every < 1 or args.ppl_tokens < 2 or args.bucket < 1:
        parser.error("--tokens, --every and --bucket must be at least 1, --ppl-tokens at least 2")
    from engine import LLM

    llm = LLM("default")
    generated = ppl = about = None
    if args.only != "perplexity":
        generated = generate(llm, args.tokens, args.every, args.sinks, args.window, _show)
        print(f"generate: {args.tokens} tokens, sinks {args.sinks} + window {args.window}")
        columns = ("tokens", "rss_mib", "tok_s", "blocks", "kv_mib")
        print(report.table(("tokens", "RSS MiB", "tok/s", "blocks held", "KV MiB held"),
                           [[r[c] for c in columns] for r in generated]))  # fmt: skip
    if args.only != "generate":
        ppl, about = perplexity(llm, args.ppl_tokens, args.sinks, args.window, args.bucket)
        print(f"\nperplexity: {about['text_tokens']} tokens of Python's standard-library docstrings; full cache over "
              f"the first {about['full_cache_tokens']} (the model's context), caches of "
              f"{args.sinks + args.window} tokens otherwise")  # fmt: skip
        names = ("full", "sinks+window", "window only")
        print(report.table(("positions", *names), [(r["positions"], *(r[n] for n in names)) for r in ppl]))
        print(report.table(("positions", *names), [(span, *(values[n] for n in names))
                                                   for span, values in about["spans"].items()]))  # fmt: skip
    plot(generated, ppl, args.bucket, args.plot, f"StreamingLLM ring: sinks {args.sinks} + window {args.window}")
    print(f"saved {args.plot}")
    if args.save_result:
        report.save_json(
            args.save_result, {"generate": generated, "perplexity": ppl, "about": about, "args": vars(args)}
        )
