"""The step diagnosis (``engine.step_diagnosis``) on the bundled model: the bytes and FLOPs of known steps against
numbers worked out here from its config.json alone, utilisations within [0, 1] (clipped there), a host share that
rises with host work, and the gauge a worker exports."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from engine import LLMEngine, SamplingParams
from rpc.metrics import export_step_utilization

PROMPTS = [list(range(1000, 1020)), list(range(2000, 2007))]  # 20 and 7 tokens
MAX_TOKENS = 3  # the first token from one prefill step of both prompts, the other two from two decode steps

# bytes of one element of K, of V, and of the INT8 scales per token and KV head (K's and V's together)
KV_ELEMENT_BYTES = {"auto": (4, 4, 0), "int8": (1, 1, 8)}


def _expected(model_dir: Path, kv_cache_dtype: str) -> dict[str, tuple[int, int]]:
    """(bytes, FLOPs) of the prefill step and of the two decode steps together, from config.json's numbers."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    inter = cfg["intermediate_size"]
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    # a Llama whose LM head is its embedding table, without biases, in float32 (4 bytes)
    assert cfg["tie_word_embeddings"] and not cfg["attention_bias"] and not cfg["mlp_bias"]
    assert cfg["torch_dtype"] == "float32"
    per_layer = (hidden * (heads + 2 * kv_heads) * head_dim  # q, k, v
                 + heads * head_dim * hidden  # o
                 + 3 * hidden * inter  # gate, up, down
                 + 2 * hidden)  # two RMSNorms  # fmt: skip
    body = layers * per_layer + hidden  # and the final norm
    k_bytes, v_bytes, scale_bytes = KV_ELEMENT_BYTES[kv_cache_dtype]
    kv_per_token_layer = kv_heads * (head_dim * (k_bytes + v_bytes) + scale_bytes)

    def step(seqs: list[tuple[int, int]]) -> tuple[int, int]:
        """Each (tokens with KV before, tokens computed); every sequence samples one row."""
        tokens = sum(n for _, n in seqs)
        weights = 4 * (body + vocab * hidden + tokens * hidden)  # layers, LM head, the embedding rows looked up
        kv = layers * kv_per_token_layer * (sum(s + n for s, n in seqs) + tokens)  # read the context, write the new
        keys_scored = sum(s + j + 1 for s, n in seqs for j in range(n))  # causal: query j sees s + j + 1 keys
        flops = 2 * body * tokens + 4 * layers * heads * head_dim * keys_scored + 2 * hidden * vocab * len(seqs)
        return weights + kv, flops

    prefill = step([(0, 20), (0, 7)])
    first, second = step([(20, 1), (7, 1)]), step([(21, 1), (8, 1)])
    return {"prefill": prefill, "decode": (first[0] + second[0], first[1] + second[1])}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_bytes_and_flops_of_known_steps_follow_from_the_config(model_dir, kv_cache_dtype):
    engine = LLMEngine(model=str(model_dir), skip_tokenizer_init=True, num_blocks=16, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt in PROMPTS:
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    totals = engine.diagnosis.totals()
    assert {kind: t.num_steps for kind, t in totals.items()} == {"prefill": 1, "decode": 2}
    got = {kind: (int(t.bytes), int(t.flops)) for kind, t in totals.items()}
    assert got == _expected(model_dir, kv_cache_dtype)


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(model=str(model_dir), skip_tokenizer_init=True, num_blocks=64)


def _decode_steps(engine: LLMEngine, num_steps: int):
    """The decode totals of ``num_steps`` steps."""
    before = engine.diagnosis.totals()["decode"]
    for _ in range(num_steps):
        engine.step()
    return engine.diagnosis.totals()["decode"] - before


def test_host_work_raises_the_host_share_and_every_share_stays_in_0_1(engine, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(list(range(3000 + 50 * i, 3032 + 50 * i)), params) for i in range(4)]
    try:
        engine.step()  # the prompts
        plain = _decode_steps(engine, 6)
        device_per_step = plain.device_s / plain.num_steps
        schedule = engine.scheduler.schedule

        def slow_schedule():  # host work: 5 times a step's device time more per step
            time.sleep(5 * device_per_step)
            return schedule()

        monkeypatch.setattr(engine.scheduler, "schedule", slow_schedule)
        slowed = _decode_steps(engine, 6)
    finally:
        for request_id in ids:
            engine.abort(request_id)
    before, after = engine.diagnosis.utilization(plain), engine.diagnosis.utilization(slowed)
    for shares in (before, after, engine.diagnosis.recent()):
        assert all(0 <= getattr(shares, r) <= 1 for r in ("memory_bandwidth", "compute", "host")), shares
    # the sleep alone is 5/6 of a step whose device time stayed put: a wide margin for a busy machine
    assert after.host > before.host + 0.2, (before, after)
    assert after.memory_bandwidth < before.memory_bandwidth  # the same bytes over a longer step


def test_utilization_is_clipped_at_1_against_peaks_given_as_flags(model_dir):
    engine = LLMEngine(model=str(model_dir), skip_tokenizer_init=True, num_blocks=16,
                       peak_memory_bandwidth_gbs=1e-6, peak_tflops=1e-9)  # fmt: skip
    peaks = engine.diagnosis.peaks
    assert (peaks.memory_bandwidth, peaks.flops) == pytest.approx((1e3, 1e3))
    assert peaks.copy_bandwidth is None  # no probe ran
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    recent = engine.diagnosis.recent()
    assert (recent.memory_bandwidth, recent.compute) == (1.0, 1.0)
    assert 0 <= recent.host < 1


def test_without_the_diagnosis_nothing_is_counted(model_dir):
    engine = LLMEngine(model=str(model_dir), skip_tokenizer_init=True, num_blocks=16, step_diagnosis=False)
    assert engine.diagnosis is None
    engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs[-1].token_ids) == 2


def test_the_gauge_reads_the_recent_shares_at_scrape_time(engine):
    export_step_utilization("diagnosis-test", engine.diagnosis)
    engine.add_request(list(range(4000, 4016)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    recent = engine.diagnosis.recent()
    for resource in ("memory_bandwidth", "compute", "host"):
        value = REGISTRY.get_sample_value("kvserve_step_utilization", {"role": "diagnosis-test", "resource": resource})
        assert value == getattr(recent, resource)
        assert 0 < value <= 1
