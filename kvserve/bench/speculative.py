"""What speculative decoding buys: tokens/s with n-gram prompt lookup against the same engine without it.

    kvserve bench offline --speculative ngram [--spec-tokens 4] [--max-tokens 128] [--spec-rounds 3]
        [--model M] [--save-result spec.json]

Two engines of the same model, one with ``speculative_config={"method": "ngram", "num_speculative_tokens":
k}``, run the same greedy requests, alternating side by side round by round (this machine drifts; each
round runs both). Workloads:

* **copy, batch 1**: prompts that ask to repeat or lightly edit a passage of prose or code, one at a time
  (a model without a tokenizer, such as ``kvserve model random``'s, gets a random passage of token ids
  twice and then its first half instead);
* **copy, batch 8**: the same prompts eight at a time;
* **random prompt, greedy, batch 1**: prompts of random token ids, answered greedily (a small model's greedy
  answer to noise often falls into a loop, which the n-gram then predicts);
* **random prompt, sampled, batch 1**: the same prompts sampled at temperature 1 (seeded): answers that
  seldom repeat, so the n-gram seldom finds anything to propose;
* **repeating noise, sampled, batch 1**: prompts drawn from 16 token ids, sampled at temperature 1: every
  recent pair of tokens has occurred before, so the n-gram proposes at almost every step and is almost always
  wrong; the off-switch's case, where speculation must cost next to nothing.

Reported per workload: output tokens/s of each side (median over rounds) and their ratio, the acceptance
rate, the mean accepted length (proposals accepted per verify step), and that both sides produced the same
tokens; where a greedy workload's tokens differ, the first difference and how far apart the plain side's top two
candidates were there (logprobs, one more plain run): a near tie that the verify step's other kernel rounds
the other way in bf16, or a real disagreement. Targets (issue "Speculative decoding"): copy batch 1 >= 1.5x,
random text (both sampled workloads) >= 0.95x. ``--only NAME`` runs the workloads whose name starts with NAME.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvserve.bench import report

_PASSAGES = (
    "def merge(left, right):\n    out = []\n    while left and right:\n        out.append(left.pop(0) if "
    "left[0] <= right[0] else right.pop(0))\n    return out + left + right\n",
    "The committee met on Tuesday to review the budget. After a long discussion, it approved the new "
    "library, the repairs to the bridge and the extra hours at the clinic.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def norm(self):\n"
    "        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is lower, so "
    "water boils at a lower temperature and food takes longer to cook.",
)
_ASKS = ("Repeat the following text exactly.\n\n{p}\nRepeated:\n",
         "Copy this code, renaming nothing:\n{p}\nCopy:\n",
         "Here is a passage:\n{p}\nWrite it out again word for word:\n")  # fmt: skip


def copy_prompts(count: int) -> list[str]:
    return [_ASKS[i % len(_ASKS)].format(p=_PASSAGES[i % len(_PASSAGES)]) for i in range(count)]


def copy_token_prompts(count: int, vocab: int, length: int = 48, seed: int = 1) -> list[list[int]]:
    """Token-id copy prompts for a model without a tokenizer: a passage, the passage again, its first half."""
    passages = random_prompts(count, vocab, length, seed)
    return [p + p + p[: length // 2] for p in passages]


def random_prompts(count: int, vocab: int, length: int = 64, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def noise_prompts(count: int, vocab: int, length: int = 96, alphabet: int = 16, seed: int = 2) -> list[list[int]]:
    """Random prompts over a few token ids, so that their n-grams repeat without any pattern to follow."""
    rng = random.Random(seed)
    letters = rng.sample(range(100, vocab), alphabet)
    return [[rng.choice(letters) for _ in range(length)] for _ in range(count)]


def _timed(llm, prompts, params, batch: int) -> tuple[float, int, list[list[int]]]:
    """(seconds, output tokens, outputs) of ``prompts`` sent ``batch`` at a time (``params``: one per prompt)."""
    start, tokens, outs = time.perf_counter(), 0, []
    for i in range(0, len(prompts), batch):
        for out in llm.generate(prompts[i : i + batch], params[i : i + batch]):
            tokens += len(out.token_ids)
            outs.append(out.token_ids)
    return time.perf_counter() - start, tokens, outs


def first_difference(llm, prompts: list, plain: list[list[int]], ngram: list[list[int]]) -> str | None:
    """Where the two sides' greedy outputs first differ, with the plain side's two best candidates there and
    their log-probability gap (``llm`` is the plain engine, asked again with ``logprobs=2``); None if equal."""
    from engine import SamplingParams

    for i, (a, b) in enumerate(zip(plain, ngram, strict=True)):
        if a == b:
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        if at == min(len(a), len(b)):
            return f"request {i}: one side stopped at token {at}, the other went on"
        again = llm.generate([prompts[i]], SamplingParams(temperature=0, max_tokens=at + 1, ignore_eos=True,
                                                          logprobs=2))[0]  # fmt: skip
        (first, lp1), (second, lp2) = again.logprobs[at].top[:2]
        same_prefix = "" if again.token_ids[:at] == a[:at] else " (this rerun's own tokens differ before it)"
        return (f"request {i}, token {at}: plain {a[at]}, ngram {b[at]}; plain's two best there {first} "
                f"({lp1:.4f}) and {second} ({lp2:.4f}), {lp1 - lp2:.4f} nats apart{same_prefix}")
    return None


def run(model: str, k: int, max_tokens: int, rounds: int, only: str | None = None) -> dict:
    from engine import LLM, SamplingParams
    from engine.bundled import resolve_model

    config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    text = (resolve_model(model) / "tokenizer.json").is_file()
    common = {"num_blocks": 1024, "max_num_seqs": 16, "skip_tokenizer_init": not text}
    engines = {"plain": LLM(model, **common), "ngram": LLM(model, speculative_config=config, **common)}
    vocab = engines["plain"].engine.model_config.vocab_size
    greedy = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)] * 8
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True) for i in range(8)]
    copies = copy_prompts if text else (lambda n: copy_token_prompts(n, vocab))
    workloads = [("copy, batch 1", copies(4), greedy, 1), ("copy, batch 8", copies(8), greedy, 8),
                 ("random prompt, greedy, batch 1", random_prompts(4, vocab), greedy, 1),
                 ("random prompt, sampled, batch 1", random_prompts(4, vocab), sampled, 1),
                 ("repeating noise, sampled, batch 1", noise_prompts(4, vocab), sampled, 1)]  # fmt: skip
    workloads = [w for w in workloads if only is None or w[0].startswith(only)]
    for llm in engines.values():  # warm-up
        llm.generate(copies(1), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stats = engines["ngram"].engine.speculator.stats
    rows = []
    for name, prompts, params, batch in workloads:
        speeds = {side: [] for side in engines}
        outputs = {}
        before = (stats.num_verify_steps, stats.num_proposed, stats.num_accepted)
        for r in range(rounds):
            for side in (list(engines) if r % 2 == 0 else list(reversed(engines))):  # alternate who goes first
                seconds, tokens, outs = _timed(engines[side], prompts, params, batch)
                speeds[side].append(tokens / seconds)
                outputs[side] = outs
        steps, proposed, accepted = (now - then for now, then in zip(
            (stats.num_verify_steps, stats.num_proposed, stats.num_accepted), before, strict=True))  # fmt: skip
        plain, ngram = statistics.median(speeds["plain"]), statistics.median(speeds["ngram"])
        rows.append({"workload": name, "plain tok/s": plain, "ngram tok/s": ngram, "ratio": ngram / plain,
                     "proposed": proposed, "acceptance rate": accepted / proposed if proposed else 0.0,
                     "mean accepted length": accepted / steps if steps else 0.0,
                     "same tokens": outputs["plain"] == outputs["ngram"]})  # fmt: skip
        if not rows[-1]["same tokens"] and params[0].temperature == 0:
            rows[-1]["first difference"] = first_difference(engines["plain"], prompts, outputs["plain"],
                                                            outputs["ngram"])  # fmt: skip
    return {"k": k, "max_tokens": max_tokens, "rounds": rounds, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench offline --speculative ngram", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default="default")
    parser.add_argument("--spec-tokens", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--spec-rounds", type=int, default=3, help="rounds per workload, both sides each round")
    parser.add_argument("--only", default=None, help="the workloads whose name starts with this")
    parser.add_argument("--save-result", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    result = run(args.model, args.spec_tokens, args.max_tokens, args.spec_rounds, args.only)
    print(f"speculative decoding, n-gram k={result['k']}, {result['max_tokens']} tokens per request, "
          f"median of {result['rounds']} alternating rounds")  # fmt: skip
    header = [name for name in result["rows"][0] if name != "first difference"]
    print(report.table(header, [[row[name] for name in header] for row in result["rows"]]))
    for row in result["rows"]:
        print(f"{row['workload']}: ngram is {row['ratio']:.2f}x plain, acceptance {row['acceptance rate']:.0%}, "
              f"{row['mean accepted length']:.2f} tokens accepted per verify step, "
              f"same tokens: {row['same tokens']}")  # fmt: skip
        if row.get("first difference"):
            print(f"    first difference: {row['first difference']}")
    if args.save_result:
        report.save_json(args.save_result, result)


if __name__ == "__main__":
    main()
