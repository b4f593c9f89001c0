"""Comparing a tensor-parallel engine's greedy outputs with one device's.

Under tensor parallelism a layer's sums run in another order (each rank's partial product, then the
all-reduce), so float32 logits differ in the last bits: the tokens are the same unless two candidates tie
that closely. ``assert_same_greedy`` compares outputs asked with ``logprobs=2``: the same tokens, each's
log-probability within ``LOGPROB_TOLERANCE``, except where one device's own two best candidates are within
``TIE`` of each other, which it reports, and where the comparison of that sequence stops.
"""

from __future__ import annotations

LOGPROB_TOLERANCE = 1e-4  # measured on the bundled model at TP=2: at most 1.6e-5
TIE = 1e-3


def assert_same_greedy(single: list, split: list) -> list[str]:
    """Where tokens differed at a near tie (empty when all were equal); fails on anything else."""
    ties = []
    assert len(single) == len(split)
    for n, (a, b) in enumerate(zip(single, split, strict=True)):
        assert len(a.token_ids) == len(b.token_ids)
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            mine, theirs = a.logprobs[i], b.logprobs[i]
            if x != y:
                (best, lp1), (second, lp2) = mine.top[:2]
                assert {x, y} == {best, second} and lp1 - lp2 < TIE, (
                    f"request {n}, token {i}: {x} on one device, {y} split; its two best {best} ({lp1:.6f}) and "
                    f"{second} ({lp2:.6f}) are no tie")  # fmt: skip
                ties.append(f"request {n}, token {i}: {best} and {second}, {lp1 - lp2:.2e} apart")
                break
            assert abs(mine.logprob - theirs.logprob) < LOGPROB_TOLERANCE, (n, i, mine.logprob, theirs.logprob)
    return ties
