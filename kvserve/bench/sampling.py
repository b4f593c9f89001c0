"""What a request's sampling features cost per output token: TPOT with each against plain decoding, same engine.

    kvserve bench sampling [--model M] [--batch-sizes 1,16] [--prompt-len 128] [--max-tokens 32]
        [--rounds 5] [--only NAME] [--save-result sampling.json]

One engine runs each workload's batch (``--batch-sizes`` prompts of ``--prompt-len`` random tokens,
``--max-tokens`` new tokens each, EOS ignored) under each side's ``SamplingParams``, the sides alternating
round by round (this machine drifts). TPOT is the time of the decode steps after every request has its
first token, divided by the tokens each request got in them. Reported per batch size and side: the median
TPOT and its ratio to the plain side's. Sides:

* ``plain``: greedy, nothing else;
* ``logprobs=5``: the token's log-probability and 5 alternatives (``engine.logprobs``); target <= 1.10x;
* ``penalties``: repetition, presence and frequency penalties (``engine.logits_processors``);
* ``bias+min_p``: a 16-token ``logit_bias``, ``min_tokens`` and ``min_p`` at temperature 0.8;
* ``json schema``: a structured output (``engine.structured_output``), an array of at least 200 integers, so
  that no request finishes before ``--max-tokens``; target <= 1.15x at batch 16.

Then the time to first token of one ``--prompt-len`` request with a JSON schema never seen before (its grammar
compiles while the request waits), with the same schema again (cached), and without one; and parallel
sampling: one request of ``n=8`` (temperature 1, seeded) against the same eight choices as eight requests one
after another, output tokens/s and the prompt tokens each computed (target >= 3x, the prompt once).
"""

from __future__ import annotations

import argparse
import random
import time

from kvserve.bench import report

SIDES = {
    "plain": {},
    "logprobs=5": {"logprobs": 5},
    "penalties": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    "bias+min_p": {"temperature": 0.8, "seed": 7, "min_p": 0.05, "min_tokens": 4,
                   "logit_bias": {t: 1.0 for t in range(100, 116)}},
    "json schema": {"structured_output": ("json", {"type": "array", "minItems": 200,
                                                   "items": {"type": "integer", "minimum": 0, "maximum": 999}})},
}  # fmt: skip


def _settings(side: dict):
    """``SIDES`` values as ``SamplingParams`` keywords (a structured output as the engine's type)."""
    from engine.structured_output import StructuredOutput

    if "structured_output" not in side:
        return side
    kind, schema = side["structured_output"]
    return {**side, "structured_output": StructuredOutput.json(schema) if kind == "json" else None}


def first_token_s(engine, prompt: list[int], params) -> float:
    """Seconds from adding one request to its first token (the request is then aborted)."""
    start = time.perf_counter()
    rid = engine.add_request(prompt, params)
    while not any(out.new_token_ids for out in engine.step() if out.request_id == rid):
        pass
    elapsed = time.perf_counter() - start
    engine.abort(rid)
    return elapsed


def _generate_s(llm, prompt: list[int], params_list) -> tuple[float, int]:
    """(seconds, prompt tokens computed) of the requests ``params_list``, one after another: every token the
    scheduled steps computed, less one per output token after each choice's first (its decode steps)."""
    scheduler, computed = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def counting():
        batch = schedule()
        computed.append(batch.num_tokens)
        return batch

    scheduler.schedule = counting
    try:
        start, decoded = time.perf_counter(), 0
        for params in params_list:
            decoded += sum(len(out.token_ids) - 1 for out in llm.generate([prompt], params))
        return time.perf_counter() - start, sum(computed) - decoded
    finally:
        del scheduler.schedule  # the class's method again


def _parallel_sampling(llm, prompt: list[int], max_tokens: int, rounds: int) -> list[list[object]]:
    from engine import SamplingParams

    base = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
    together, apart = [], []
    for r in range(rounds):
        seed = 1000 * r
        together.append(_generate_s(llm, prompt, [SamplingParams(**base, n=8, seed=seed)]))
        apart.append(_generate_s(llm, prompt, [SamplingParams(**base, seed=seed + i) for i in range(8)]))
    tokens = 8 * max_tokens
    rate = [tokens / report.median(t for t, _ in together), tokens / report.median(t for t, _ in apart)]
    return [["n=8, one request", rate[0], together[0][1], rate[0] / rate[1]],
            ["8 requests, one at a time", rate[1], apart[0][1], 1.0]]


def _schema_ttft(engine, prompt: list[int], rounds: int) -> list[list[object]]:
    from engine import SamplingParams
    from engine.structured_output import StructuredOutput

    rows: dict[str, list[float]] = {"no schema": [], "schema first seen": [], "schema cached": []}
    for r in range(rounds):
        schema = {"type": "object", "properties": {f"field_{r}_{time.time_ns()}": {"type": "integer"}}}
        spec = StructuredOutput.json(schema)
        rows["no schema"].append(first_token_s(engine, prompt, SamplingParams(temperature=0, max_tokens=4)))
        for name in ("schema first seen", "schema cached"):
            params = SamplingParams(temperature=0, max_tokens=4, structured_output=spec)
            rows[name].append(first_token_s(engine, prompt, params))
    return [[name, report.median(t) * 1e3] for name, t in rows.items()]


def decode_tpot(engine, prompts: list[list[int]], params) -> float:
    """Seconds per decode step once every request of the batch has its first token."""
    ids = [engine.add_request(p, params) for p in prompts]
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    start, num_tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step())
    return (time.perf_counter() - start) / max(num_tokens / len(ids), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve bench sampling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="run the sides whose name starts with this (and plain)")
    parser.add_argument("--save-result", default=None)
    args = parser.parse_args(argv)

    from engine import LLM, SamplingParams
    from engine.bundled import resolve_model
    from engine.tokenizer import has_tokenizer

    llm = LLM(args.model, skip_tokenizer_init=not has_tokenizer(resolve_model(args.model)))  # (a random model has none)
    vocab = llm.engine.model_config.vocab_size
    grammars = llm.engine.tokenizer is not None  # (a structured output needs the model's tokenizer)
    if not grammars:
        print("no tokenizer: the structured-output side and the schema TTFT are skipped")
    sides = {name: s for name, s in SIDES.items() if name == "plain" or name.startswith(args.only)}
    sides = {name: s for name, s in sides.items() if grammars or "structured_output" not in s}
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        rng = random.Random(batch)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        params = {name: SamplingParams(**{"temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": True,
                                          **_settings(s)}) for name, s in sides.items()}  # fmt: skip
        decode_tpot(llm.engine, prompts[:1], params["plain"])  # warm-up
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name in sides:
                times[name].append(decode_tpot(llm.engine, prompts, params[name]))
        plain = report.median(times["plain"])
        rows += [{"batch": batch, "side": name, "tpot_ms": report.median(t) * 1e3, "ratio": report.median(t) / plain}
                 for name, t in times.items()]  # fmt: skip
    print(report.table(["side", "batch", "TPOT ms", "x plain"],
                       [[r["side"], r["batch"], r["tpot_ms"], r["ratio"]] for r in rows]))  # fmt: skip
    ttft = []
    if grammars:
        prompt = [random.Random(0).randrange(vocab) for _ in range(args.prompt_len)]
        ttft = _schema_ttft(llm.engine, prompt, args.rounds)
        print(report.table(["first token", "ms"], ttft))
    prompt = [random.Random(1).randrange(vocab) for _ in range(args.prompt_len)]
    parallel = _parallel_sampling(llm, prompt, args.max_tokens, args.rounds)
    print(report.table(["parallel sampling", "tokens/s", "prompt tokens computed", "x apart"], parallel))
    if args.save_result:
        report.save_json(args.save_result, {"rows": rows, "ttft_ms": dict(ttft), "parallel": parallel,
                                            "args": vars(args)})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
