"""The batched device sampler against a per-row reference, its random streams and its distributions."""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import pytest
import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from kvkernels.reference import uniform_noise

CPU = torch.device("cpu")
UINT64 = (1 << 64) - 1


@dataclass(eq=False)
class Seq:
    """The part of an engine ``Sequence`` the sampler reads; ``num_tokens`` is the position it samples."""

    params: SamplingParams
    token_ids: list[int]
    sampling_seed: int
    num_tokens: int = 0
    prompt_token_ids: list[int] | None = None  # default: the tokens it starts with
    grammar: None = None  # no structured output (tests/engine/test_structured_output.py)

    def __post_init__(self) -> None:
        self.num_tokens = self.num_tokens or len(self.token_ids)
        if self.prompt_token_ids is None:
            self.prompt_token_ids = list(self.token_ids)

    def append(self, token: int) -> None:
        self.token_ids.append(token)
        self.num_tokens += 1


# -- an independent per-row reference: splitmix64 on Python integers, then the sampling on one row --------


def _finalize(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & UINT64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & UINT64
    return z ^ (z >> 31)


def reference_uniforms(seed: int, position: int, vocab_size: int) -> list[float]:
    state = _finalize((_finalize(seed & UINT64) + position) & UINT64)
    bits = [_finalize((state + (t + 1) * 0x9E3779B97F4A7C15) & UINT64) for t in range(vocab_size)]
    return [((b >> 41) + 0.5) / 2**23 for b in bits]


EOS = {2, 5}


def reference_token(logits: torch.Tensor, seq: Seq) -> int:
    """One row ``(vocab,)`` -> the token, one rule after another as ``SamplingParams`` states them."""
    p, row = seq.params, logits.clone()
    for t, bias in p.logit_bias.items():
        row[t] += bias
    output = seq.token_ids[len(seq.prompt_token_ids) :]
    if len(output) < p.min_tokens:
        for t in [*p.stop_token_ids, *([] if p.ignore_eos else EOS)]:
            row[t] = float("-inf")
    if p.repetition_penalty != 1.0:
        for t in set(seq.token_ids):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.presence_penalty + p.frequency_penalty * output.count(t)
    if p.temperature == 0:
        return int(row.argmax())
    row = row / p.temperature
    if p.min_p > 0:
        probs = row.softmax(-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < row.numel():
        row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        ordered, order = torch.sort(row, descending=True)
        probs = ordered.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        row = row.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    # Gumbel-max: the exponential race argmax(p / E), E = -log(u), in logs (log p = logit - a row constant)
    noise = -torch.tensor(reference_uniforms(seq.sampling_seed, seq.num_tokens, row.numel())).log()
    return int((row - noise.log()).argmax())


MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.5),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, repetition_penalty=0.7),
    SamplingParams(temperature=2.0, top_k=10_000),
    SamplingParams(temperature=0.5, top_p=0.3, top_k=3),
    SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(temperature=0.8, frequency_penalty=-1.0, min_p=0.1),
    SamplingParams(temperature=0, logit_bias={3: 4.0, 9: -100.0}, min_tokens=6, stop_token_ids=[7]),
    SamplingParams(temperature=1.1, min_tokens=4, logit_bias={5: 3.0, 2: 2.0}, min_p=0.05),
    SamplingParams(temperature=0.9, min_tokens=8, ignore_eos=True, presence_penalty=-2.0, repetition_penalty=1.1),
]


def test_noise_is_splitmix64_of_seed_position_and_token():
    seeds = [0, 1, -1, -(1 << 63), (1 << 63) - 1, 1234567890123]
    positions = [0, 7, 1, 4095, 10**9, 3]
    noise = uniform_noise(torch.tensor(seeds), torch.tensor(positions), 50)
    expected = torch.tensor([reference_uniforms(s, p, 50) for s, p in zip(seeds, positions, strict=True)])
    assert torch.equal(noise, expected)  # integer hashing, then (k + 0.5) / 2**23: exact in float32
    assert 0 < noise.min() and noise.max() < 1


def test_mixed_batch_equals_per_row_sampling_step_after_step():
    vocab = 64
    gen = torch.Generator().manual_seed(0)
    seqs = [
        Seq(p, torch.randint(vocab, (5 + i,), generator=gen).tolist(), sampling_seed=seed)
        for i, (p, seed) in enumerate(
            zip(MIXED, [3, -9, 11, 1 << 62, 5, -(1 << 40), 0, 42, 8, 6, -2, 13, 0, 1], strict=True)
        )  # fmt: skip
    ]
    sampler = Sampler(vocab, CPU, seed=0, eos_token_ids=frozenset(EOS))
    for _ in range(12):  # the penalty rows see the tokens appended step after step
        logits = torch.randn(len(seqs), vocab, generator=gen) * 3
        before = logits.clone()
        tokens = sampler(logits, seqs).tokens
        assert tokens.dtype == torch.int64 and tokens.shape == (len(seqs),)
        assert tokens.tolist() == [reference_token(logits[i], s) for i, s in enumerate(seqs)]
        assert torch.equal(logits, before)
        for seq, token in zip(seqs, tokens.tolist(), strict=True):
            seq.append(token)


def test_a_rows_token_does_not_depend_on_the_rest_of_its_batch():
    vocab = 100
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.2)
    target = Seq(params, [1, 2, 3], sampling_seed=77)
    others = [Seq(p, [4, 5, 6, i], sampling_seed=i) for i, p in enumerate(MIXED)]
    for _ in range(20):
        row = torch.randn(1, vocab, generator=gen)
        # alone on a fresh sampler (another engine: another engine seed), and in the middle of a batch
        [alone] = Sampler(vocab, CPU, seed=123)(row, [Seq(params, list(target.token_ids), 77)]).tokens.tolist()
        batch = [*others[:4], target, *others[4:]]
        rest = torch.randn(len(others) - 4, vocab, generator=gen)
        logits = torch.cat([torch.randn(4, vocab, generator=gen), row, rest])
        tokens = Sampler(vocab, CPU, seed=0)(logits, batch).tokens.tolist()
        assert tokens[4] == alone
        target.append(alone)


def _expected_probs(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    weights = [math.exp(x / temperature) for x in logits]
    weights = [w if w >= min_p * max(weights) else 0.0 for w in weights]
    ranked = sorted(range(len(logits)), key=lambda t: -logits[t])[: top_k or len(logits)]
    total, kept, before = sum(weights[t] for t in ranked), [], 0.0
    for t in ranked:
        if before >= top_p:
            break
        kept.append(t)
        before += weights[t] / total
    mass = sum(weights[t] for t in kept)
    return [weights[t] / mass if t in kept else 0.0 for t in range(len(logits))]


@pytest.mark.parametrize("vary", ["position", "seed"])
@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"),
                         [(1.0, 0, 1.0, 0), (0.6, 4, 1.0, 0), (1.5, 0, 0.7, 0), (1.0, 0, 1.0, 0.3)])  # fmt: skip
def test_token_frequencies_follow_the_filtered_softmax(vary, temperature, top_k, top_p, min_p):
    logits = [1.0, 0.5, 2.0, -1.0, 0.0, 1.5]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    n = 20_000
    if vary == "position":
        seqs = [Seq(params, [0], sampling_seed=2024, num_tokens=p) for p in range(1, n + 1)]
    else:
        seqs = [Seq(params, [0], sampling_seed=s, num_tokens=10) for s in range(n)]
    tokens = Sampler(len(logits), CPU, seed=0)(torch.tensor([logits]).expand(n, -1), seqs).tokens
    counts = torch.bincount(tokens, minlength=len(logits)).tolist()
    expected = [n * p for p in _expected_probs(logits, temperature, top_k, top_p, min_p)]
    assert all(c == 0 for c, e in zip(counts, expected, strict=True) if e == 0)
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True) if e > 0)
    assert chi2 < 25, (counts, expected)  # 5 degrees of freedom at most: P(chi2 > 25) < 2e-4


def test_top_k_one_and_a_tiny_top_p_are_greedy():
    vocab = 500
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(40, vocab, generator=gen) * 2
    seqs = [
        Seq(SamplingParams(temperature=0.5 + i / 10, top_k=1) if i % 2 else SamplingParams(temperature=1.7, top_p=1e-6),
            [1], sampling_seed=i, num_tokens=i + 1)
        for i in range(40)
    ]  # fmt: skip
    assert torch.equal(Sampler(vocab, CPU, seed=0)(logits, seqs).tokens, logits.argmax(-1))


def test_penalty_state_of_a_finished_sequence_is_not_inherited():
    vocab = 32
    penalty = SamplingParams(temperature=0, repetition_penalty=4.0)
    logits = torch.zeros(1, vocab)
    logits[0, 7], logits[0, 9] = 2.0, 1.0  # token 7 wins unless it was seen (2 / 4 < 1)
    sampler = Sampler(vocab, CPU, seed=0)
    seen_seven = [Seq(penalty, [7, i + 10], sampling_seed=0) for i in range(20)]
    assert sampler(logits.expand(20, -1), seen_seven).tokens.tolist() == [9] * 20
    del seen_seven
    gc.collect()  # their rows of seen tokens go back to the sampler, to be reused
    fresh = [Seq(penalty, [i + 10], sampling_seed=0) for i in range(20)]
    assert sampler(logits.expand(20, -1), fresh).tokens.tolist() == [7] * 20


def test_stream_seeds_are_reproducible_per_engine_seed_and_wrap_to_int64():
    assert [Sampler(8, CPU, 5).stream_seed(None) for _ in range(2)] == [Sampler(8, CPU, 5).stream_seed(None)] * 2
    one = Sampler(8, CPU, 5)
    drawn = [one.stream_seed(None) for _ in range(3)]
    assert len(set(drawn)) == 3 and all(-(1 << 63) <= s < 1 << 63 for s in drawn)
    assert Sampler(8, CPU, 6).stream_seed(None) != drawn[0]
    assert one.stream_seed(42) == 42 and one.stream_seed(-1) == -1 and one.stream_seed((1 << 64) + 5) == 5
    assert one.stream_seed(1 << 63) == -(1 << 63)


@pytest.mark.parametrize(("ignore_eos", "expected"), [(False, [4, 4, 4, 2, 2]), (True, [2, 2, 2, 7, 7])])
def test_min_tokens_holds_back_eos_and_stop_tokens_until_reached(ignore_eos, expected):
    vocab = 16
    logits = torch.zeros(1, vocab)
    logits[0, 2], logits[0, 7], logits[0, 4] = 9.0, 8.0, 1.0  # EOS, then a stop token, then an ordinary one
    seq = Seq(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7], ignore_eos=ignore_eos), [1, 3], 0)
    sampler = Sampler(vocab, CPU, 0, eos_token_ids=frozenset({2}))
    if ignore_eos:
        logits[0, 2] = 7.0  # EOS is an ordinary token now; the stop token still waits
        logits[0, 7] = 9.0
    drawn = []
    for _ in range(5):
        drawn.append(int(sampler(logits, [seq]).tokens[0]))
        seq.append(drawn[-1])
    assert drawn == expected
