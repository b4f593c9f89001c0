"""Speculative decoding (``engine.speculative``): proposals verified in one step never change a token.

Every engine test compares against the same engine's output with speculation off, computed in the same
process: greedy and seeded sampled requests must be equal token for token, since each emitted token is the
target's own sample at its position. The proposer and the acceptance rule are checked against brute-force
references.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from engine_testing import greedy
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_service.settings import DecodeSettings
from engine import LLM, SamplingParams
from engine.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from engine.speculative import (
    FIRST_BACKOFF,
    WINDOW,
    AcceptanceTracker,
    accepted_lengths,
    ngram_proposal,
)
from kvserve.settings import UpSettings
from protos.kvserve.v1 import kvserve_pb2 as pb
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from rpc.convert import sampling_from_proto, sampling_to_proto
from rpc.requests import build_request
from rpc.settings import settings_from_argv

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
NUM_BLOCKS = 512

# -- the configuration --------------------------------------------------------------------------------------


def test_the_config_is_spelled_as_vllm_spells_it_and_each_bad_field_is_named():
    assert SpeculativeConfig.parse(NGRAM).as_dict() == NGRAM
    assert SpeculativeConfig.parse(json.dumps(NGRAM)) == SpeculativeConfig.parse(NGRAM)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    flag = settings_from_argv(DecodeSettings, ["--speculative-config", json.dumps(NGRAM)])
    assert flag.engine_config().speculative_config == NGRAM  # the worker flag takes the same JSON
    up = settings_from_argv(UpSettings, ["--speculative-config", json.dumps(NGRAM)])  # kvserve up passes it on
    assert settings_from_argv(DecodeSettings, up.engine_argv()).speculative_config == NGRAM
    for bad, field in [
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({**NGRAM, "method": "medusa"}, "method"),
        ({**NGRAM, "lookahead": 3}, "lookahead"),
        ({**NGRAM, "prompt_lookup_min": 5}, "prompt_lookup_min"),
        ({**NGRAM, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ]:
        with pytest.raises(ValueError, match=f"speculative_config.{field}"):
            SpeculativeConfig.parse(bad)
        with pytest.raises(ValueError, match=f"speculative_config.{field}"):
            LLM("default", num_blocks=8, speculative_config=bad)
    with pytest.raises(ValueError, match="not JSON"):
        SpeculativeConfig.parse("{method: ngram}")


# -- the proposer and the acceptance rule, against brute force ----------------------------------------------


def _reference_proposal(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # the most recent earlier occurrence
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 3),
       st.integers(0, 3))  # fmt: skip
def test_ngram_proposals_equal_a_brute_force_lookup(tokens, k, lo, extra):
    got = ngram_proposal(np.asarray(tokens, dtype=np.int64), k, lo, lo + extra).tolist()
    assert got == _reference_proposal(tokens, k, lo, lo + extra)


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=5), st.integers(0, 2)), min_size=1,
                max_size=6))  # fmt: skip
def test_the_kept_run_is_the_leading_agreement(rows):
    k = max(len(p) for p, _ in rows)
    proposals = np.zeros((len(rows), k), dtype=np.int64)
    targets = np.full((len(rows), k + 1), 7, dtype=np.int64)
    want = []
    for i, (proposed, bonus) in enumerate(rows):
        proposals[i, : len(proposed)] = proposed
        # the target agrees with the proposals up to a point chosen by ``bonus``'s parity, then may differ
        sampled = [t if j < len(proposed) - bonus else (t + 1) % 3 for j, t in enumerate(proposed)]
        targets[i, : len(sampled)] = sampled
        kept = 0
        while kept < len(proposed) and proposed[kept] == sampled[kept]:
            kept += 1
        want.append(kept)
    num = np.asarray([len(p) for p, _ in rows], dtype=np.int64)
    assert accepted_lengths(proposals, num, targets).tolist() == want


def test_a_sequence_whose_guesses_fail_stops_proposing_and_tries_again_later():
    tracker = AcceptanceTracker()
    for _ in range(WINDOW):
        assert tracker.wants_proposals()
        tracker.record(0, 4)
    assert [tracker.wants_proposals() for _ in range(FIRST_BACKOFF)] == [False] * FIRST_BACKOFF
    assert tracker.wants_proposals()  # tries again; a second failed window pauses it twice as long
    for _ in range(WINDOW):
        tracker.record(0, 4)
    assert tracker.paused_steps == 2 * FIRST_BACKOFF
    tracker.paused_steps = 0
    for _ in range(WINDOW):
        tracker.record(3, 4)
    assert tracker.paused_steps == 0 and tracker.backoff == FIRST_BACKOFF  # a window that pays resets it
    assert (tracker.num_proposed, tracker.num_accepted) == (12 * WINDOW, 3 * WINDOW)  # the trace's summary


# -- the engine: the same tokens with speculation on and off -----------------------------------------------


def _copy_prompts(tokenizer, count: int) -> list[str]:
    """Prompts that ask to repeat or lightly edit a passage: their answers copy from their input."""
    passages = [
        "def area(width, height):\n    return width * height\n",
        "The quick brown fox jumps over the lazy dog near the river bank.",
        "for i in range(10):\n    total += values[i] * weights[i]\n",
        "Paris is the capital of France. Berlin is the capital of Germany.",
        "SELECT name, price FROM products WHERE price > 10 ORDER BY price;",
    ]
    asks = ["Repeat this exactly:\n{p}\n{p}\nAgain:\n", "Copy the text below twice.\n{p}\nCopy:\n{p}\n",
            "Rewrite with the same words:\n{p}\nRewritten:\n", "{p}\n{p}\n{p}\n"]  # fmt: skip
    return [asks[i % len(asks)].format(p=passages[i % len(passages)]) for i in range(count)]


@pytest.fixture(scope="module")
def engines():
    base = LLM("default", num_blocks=NUM_BLOCKS, max_num_seqs=64)
    spec = LLM("default", num_blocks=NUM_BLOCKS, max_num_seqs=64, speculative_config=NGRAM)
    return base, spec


def test_greedy_output_is_unchanged_in_mixed_batches_with_stops_inside_accepted_runs(engines, tokenizer):
    base, spec = engines
    prompts = _copy_prompts(tokenizer, 24)
    params = [greedy(20) for _ in prompts]
    for i in range(0, 24, 4):
        params[i] = greedy(20, speculative=False)  # it shares the batch without speculating
    plain = base.generate(prompts, params)
    # a stop string taken from the middle of an answer (the copy prompts' answers are mostly accepted runs)
    stopped = list(range(1, 24, 4))
    for i in stopped:
        text = plain[i].text
        params[i] = greedy(20, stop=[text[len(text) // 2 : len(text) // 2 + 3]])
    for i, out in zip(stopped, base.generate([prompts[i] for i in stopped], [params[i] for i in stopped]),
                      strict=True):  # fmt: skip
        plain[i] = out
    stats_before = spec.engine.speculator.stats.num_accepted
    fast = spec.generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert [o.text for o in fast] == [o.text for o in plain]
    assert [o.finish_reason for o in fast] == [o.finish_reason for o in plain]
    assert sum(o.finish_reason == "stop" for o in fast) >= 4
    stats = spec.engine.speculator.stats
    assert stats.num_accepted - stats_before > 50 and stats.acceptance_rate > 0.5
    pool = spec.engine.block_manager
    assert pool.num_free_blocks == pool.num_blocks


def test_seeded_sampling_is_unchanged_and_keeps_the_target_distribution(engines, tokenizer):
    """The same seeds give the same tokens with and without speculation (each row samples with its
    position's noise); over 32 seeds per setting, the token frequencies at each position agree (chi-square)."""
    base, spec = engines
    prompt = _copy_prompts(tokenizer, 1)[0]
    # (a penalty on repeats makes a copy rarely accepted: a mild one, and the sampler's own test below)
    settings_ = [dict(temperature=0.8, top_p=0.95, top_k=50), dict(temperature=0.7, repetition_penalty=1.05)]
    for options in settings_:
        params = [SamplingParams(seed=seed, max_tokens=6, ignore_eos=True, **options) for seed in range(32)]
        plain = [o.token_ids for o in base.generate([prompt] * 32, params)]
        accepted_before = spec.engine.speculator.stats.num_accepted
        fast = [o.token_ids for o in spec.generate([prompt] * 32, params)]
        assert fast == plain
        assert spec.engine.speculator.stats.num_accepted > accepted_before  # runs were accepted, not just row 0
        again = [o.token_ids for o in spec.generate([prompt] * 4, params[:4])]
        assert again == fast[:4]  # a seeded request repeats, in another batch
        for position in range(6):
            assert _chi_square_p_value([t[position] for t in fast], [t[position] for t in plain]) > 0.01


def test_a_verify_rows_penalty_counts_the_proposals_before_it():
    """Row j of a verify step has seen the sequence and its first j proposals: the same tokens as a plain
    sampler call for a sequence that already holds them, greedy and seeded."""
    from engine.sampler import Sampler

    @dataclass(eq=False)
    class Seq:
        params: SamplingParams
        token_ids: list[int]
        sampling_seed: int = 7
        prompt_token_ids: tuple[int, ...] = (3, 5)  # the proposals are output: the OpenAI penalties count them
        grammar: None = None

        @property
        def num_tokens(self) -> int:
            return len(self.token_ids)

    vocab, history, proposals = 32, [3, 5, 3], [9, 4, 9]
    logits = torch.randn(len(proposals) + 1, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, [9, 4]] += 4.0  # the proposals are the likely tokens, so the penalty decides
    for params in (SamplingParams(temperature=0, repetition_penalty=2.0),
                   SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=1.0),
                   SamplingParams(temperature=0.9, repetition_penalty=1.5, top_k=8, seed=1)):  # fmt: skip
        seq = Seq(params, list(history))
        rows = range(len(proposals) + 1)
        together = Sampler(vocab, torch.device("cpu"), 0)(
            logits, [seq] * len(rows), [len(history) + j for j in rows], [proposals[:j] for j in rows]).tokens.tolist()
        alone = [Sampler(vocab, torch.device("cpu"), 0)(logits[j : j + 1], [Seq(params, history + proposals[:j])])
                 .tokens for j in rows]  # fmt: skip
        assert together == [int(t) for t in alone]


def _chi_square_p_value(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test that ``a`` and ``b`` come from one categorical distribution: the p-value of
    Pearson's statistic over the 2 x values contingency table, with (values - 1) degrees of freedom."""
    values = sorted(set(a) | set(b))
    if len(values) == 1:
        return 1.0
    table = np.array([[a.count(v) for v in values], [b.count(v) for v in values]], dtype=np.float64)
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    dof = len(values) - 1  # the chi-square survival function is the upper regularized gamma Q(dof/2, x/2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))  # fmt: skip


def test_the_wire_and_the_openai_body_carry_the_per_request_switch():
    off = sampling_to_proto(SamplingParams(speculative=False))
    assert off.HasField("speculative") and sampling_from_proto(off).speculative is False
    assert sampling_from_proto(pb.SamplingOptions()).speculative is True  # unset: the worker speculates
    assert build_request("hi", speculative=False).sampling.speculative is False
    assert not build_request("hi").sampling.HasField("speculative")
    assert CompletionRequest(prompt=[1, 2], speculative=False).to_protos("r")[0].sampling.HasField("speculative")
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], speculative=False)
    assert chat.to_proto("r").sampling.speculative is False
    assert not CompletionRequest(prompt="hi").to_protos("r")[0].sampling.HasField("speculative")


# -- a draft model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, model_dir):
    """A 2-layer Qwen2 of width 64 with random weights and the bundled model's tokenizer: a draft whose guesses
    are nearly always wrong."""
    import shutil

    from kvserve.testing.random_model import write_random_model

    path = write_random_model(tmp_path_factory.mktemp("draft"), "qwen2-tiny", dtype=torch.float32,
                              overrides={"vocab_size": 49152})  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, path / name)
    return path


# the random draft on demand (pytest -m soak), outside make test's 15 minutes
@pytest.mark.parametrize("draft", ["target", pytest.param("random", marks=pytest.mark.soak)])
def test_a_draft_model_changes_no_token_and_its_acceptance_follows_its_quality(engines, tokenizer, random_draft,
                                                                               draft):  # fmt: skip
    """A draft equal to the target is accepted nearly always (the same model under the same noise); a
    random-weight draft nearly never, so its verify steps reject nearly every proposal. Both give exactly the
    target's greedy and seeded tokens; after every step no sequence holds a block past what its tokens need
    (a rejected proposal's blocks went back at once), and at the end every block, the target's and the
    draft's, is free."""
    base, _ = engines
    model = "default" if draft == "target" else str(random_draft)
    # a step budget below the prompts' length: the draft catches up on a prompt in chunks, as the target does
    llm = LLM("default", num_blocks=NUM_BLOCKS, max_num_seqs=64, max_num_batched_tokens=48,
              speculative_config={"method": "draft", "model": model, "num_speculative_tokens": 4})  # fmt: skip
    engine, pool = llm.engine, llm.engine.block_manager
    prompts = _copy_prompts(tokenizer, 4)  # two greedy, two seeded; 16 tokens each: 4 draft runs and a verify
    params = [greedy(16) if i % 2 else SamplingParams(seed=i, temperature=0.9, top_p=0.9, max_tokens=16,
                                                      ignore_eos=True) for i in range(4)]  # fmt: skip
    want = [o.token_ids for o in base.generate(prompts, params)]
    got = {f"d-{i}": [] for i in range(4)}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, f"d-{i}")
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= pool.num_blocks_for(seq.num_tokens)
    assert list(got.values()) == want
    stats = engine.speculator.stats
    if draft == "target":
        assert stats.acceptance_rate > 0.9
    else:
        assert stats.num_proposed - stats.num_accepted > 100 and stats.acceptance_rate < 0.1
    assert pool.num_free_blocks == NUM_BLOCKS
    engine.step()  # (the draft lets go of finished sequences at the next step)
    draft_pool = engine.speculator.draft.block_manager
    assert draft_pool.num_free_blocks == draft_pool.num_blocks


def test_a_draft_with_another_vocabulary_is_refused_naming_the_field(tmp_path):
    from kvserve.testing.random_model import write_random_model

    other = write_random_model(tmp_path, "qwen2-tiny", dtype=torch.float32)  # 1,024 tokens
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary has 1024 tokens"):
        LLM("default", num_blocks=8, speculative_config={"method": "draft", "model": str(other),
                                                          "num_speculative_tokens": 2})  # fmt: skip
    with pytest.raises(ValueError, match="speculative_config.model: method 'draft' needs"):
        SpeculativeConfig.parse({"method": "draft", "num_speculative_tokens": 2})
