"""``kvserve tune``: the virtual-clock replay it measures with, the coordinate descent over the knobs (dominated
values never measured, the budget's leftovers listed), and a whole run on the tiny model writing the table,
the plots and a configuration file that ``LLM(**load_config(...))`` takes."""

from __future__ import annotations

import json
import math
import time

import pytest

from engine import LLMEngine
from engine.config_file import load_config
from engine.llm import LLM
from kvserve.bench import tune
from kvserve.bench.datasets import random_requests
from kvserve.bench.tune_replay import RatePoint, replay


def test_the_replay_jumps_over_idle_time_and_times_each_request_from_its_arrival(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir), skip_tokenizer_init=True, num_blocks=64)
    requests = random_requests(4, 20, 6, 0.0, 1000)
    try:
        started = time.monotonic()
        sparse = replay(engine, requests, rate=1e-6)  # about 1e6 s apart, on the virtual clock
        assert time.monotonic() - started < sparse.span_s / 1000  # no real waiting for the arrivals
        assert sparse.span_s > 1e4 and len(sparse.ttft_s) == 4 and sparse.num_output_tokens == 4 * 6
        assert max(running for running, _ in sparse.kv_samples) == 1  # never two at once
        burst = replay(engine, requests, rate=math.inf)  # all at once: they share the steps
        assert max(running for running, _ in burst.kv_samples) == 4
        assert not engine.has_unfinished_requests() and engine.block_manager.pool.num_free_blocks == 64
    finally:
        engine.close()


def _fake_measure(goodputs: dict[tuple, float], measured: list[dict]):
    def measure(self, setting, floor=0, beat=None):
        measured.append(dict(setting))
        key = tuple(setting[k] for k in ("max_num_batched_tokens", "max_num_seqs"))
        trial = tune.Trial(dict(setting), [RatePoint(1.0)], goodputs.get(key, 0.5))
        self.trials.append(trial)
        return trial

    return measure


def test_coordinate_descent_keeps_the_best_and_never_measures_a_dominated_value(monkeypatch):
    # max_num_batched_tokens: 4096 (default) 0.5 req/s, 2048 better, 1024 worse; max_num_seqs: 64 the best at 2048
    goodputs = {(4096, 256): 0.5, (2048, 256): 0.8, (1024, 256): 0.7, (2048, 64): 1.0, (2048, 32): 0.9}
    measured: list[dict] = []
    monkeypatch.setattr(tune.Tuner, "measure", _fake_measure(goodputs, measured))
    tuner = tune.Tuner({}, [], 1.0, 1.0, deadline=math.inf)
    chosen = tuner.sweep(tune.default_setting())
    assert (chosen["max_num_batched_tokens"], chosen["max_num_seqs"]) == (2048, 64)
    at_2048 = {**tune.default_setting(), "max_num_batched_tokens": 2048}
    seqs_tried = [s["max_num_seqs"] for s in measured
                  if s["max_num_seqs"] != 256 and s == {**at_2048, "max_num_seqs": s["max_num_seqs"]}]
    assert seqs_tried == [64, 32]  # downwards from 256: 64 beats it, 32 does not, so 16, 8, 4 are dominated
    assert [s["max_num_batched_tokens"] for s in measured[:3]] == [4096, 2048, 1024]  # 512, 256: dominated
    assert not tuner.skipped


def _fake_replay(limit: float, calls: list, miss_seeds=()):
    """A replay that meets a 1 s TTFT p99 up to ``limit`` req/s (except on ``miss_seeds``), recording each call."""

    def replay(engine, requests, rate, seed=0):
        calls.append((rate, seed))
        point = RatePoint(rate)
        point.ttft_s = [0.5 if rate <= limit and seed not in miss_seeds else 2.0]
        point.tpot_s = [0.01]
        return point

    return replay


def test_the_goodput_is_found_by_bisection_each_rung_on_its_own_arrivals(monkeypatch):
    calls: list = []
    monkeypatch.setattr("kvserve.bench.tune_replay.replay", _fake_replay(3.3, calls))
    tuner = tune.Tuner({}, [], 1.0, 1.0, deadline=math.inf)
    tuner.rates = [0.25, 0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5, 2.0, 3.0, 4.0, 6.0]
    trial = tune.Trial({})
    tuner.search(None, trial, floor=0, start=4)
    assert trial.goodput == 3.0
    assert calls == [(1.0, 4), (2.0, 8), (4.0, 10), (3.0, 9)]  # 4 replays for 12 rungs; none below 1.0
    calls.clear()
    low = tune.Trial({})
    monkeypatch.setattr("kvserve.bench.tune_replay.replay", _fake_replay(0.6, calls))
    tuner.search(None, low, floor=0, start=4)
    assert low.goodput == 0.5 and [rate for rate, _ in calls] == [1.0, 0.5, 0.7]
    calls.clear()
    tuner.search(None, floored := tune.Trial({}), floor=5, start=6)  # a candidate against a best of 1.0 req/s
    assert floored.goodput == 0.0 and floored.floor == 1.15 and [rate for rate, _ in calls] == [1.3, 1.15]


def test_a_candidate_that_beats_the_best_once_but_not_on_other_arrivals_is_not_taken(monkeypatch):
    calls: list = []
    monkeypatch.setattr("kvserve.bench.tune_replay.replay", _fake_replay(1.6, calls, miss_seeds={tune.CONFIRM_SEED}))
    monkeypatch.setattr("engine.LLMEngine", lambda **options: type("Engine", (), {"close": lambda self: None})())
    tuner = tune.Tuner({}, [], 1.0, 1.0, deadline=math.inf)
    tuner.rates = [0.25, 0.5, 0.7, 0.85, 1.0, 1.15, 1.3, 1.5, 2.0, 3.0, 4.0, 6.0]
    best = tune.Trial({}, [RatePoint(1.0)], goodput=1.0)
    lucky = tuner.measure({"block_size": 32}, floor=4, beat=1.0)
    assert lucky.goodput == 1.5 and calls[-1] == (1.5, tune.CONFIRM_SEED) and not lucky.confirmed
    assert not tuner.better(lucky, best)
    monkeypatch.setattr("kvserve.bench.tune_replay.replay", _fake_replay(1.6, calls))
    assert tuner.better(tuner.measure({"block_size": 32}, floor=4, beat=1.0), best)


def test_what_the_budget_leaves_is_listed_not_measured(monkeypatch):
    measured: list[dict] = []
    monkeypatch.setattr(tune.Tuner, "measure", _fake_measure({}, measured))
    tuner = tune.Tuner({}, [], 1.0, 1.0, deadline=0.0)  # already spent: only the default is measured
    assert tuner.sweep(tune.default_setting()) == tune.default_setting() and len(measured) == 1
    assert {"kv_cache_dtype": "int8"}.items() <= next(s for s in tuner.skipped if s["kv_cache_dtype"] == "int8").items()
    assert len(tuner.skipped) == sum(len(values) - 1 for _, values in tune.KNOBS)


def test_a_run_writes_the_table_the_plots_and_a_config_file_the_engine_takes(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "tune"
    status = tune.main(["--model", str(tiny_model_dir), "--num-requests", "4", "--input-len", "24", "--output-len",
                        "4", "--budget", "1s", "--output-dir", str(out), "--ttft-p99", "30", "--tpot-p99", "5",
                        "--repeats", "1"])
    assert status == 0
    assert {p.name for p in out.iterdir()} == {"tuning.md", "tuning.json", "throughput_latency.png",
                                               "kv_memory.png", "kvserve.yaml"}  # fmt: skip
    result = json.loads((out / "tuning.json").read_text())
    assert result["trials"][0]["goodput_rps"] > 0 and result["not_measured"]  # 1 s: the default only
    assert "| default **(chosen)** |" in (out / "tuning.md").read_text()
    options = load_config(out / "kvserve.yaml")
    assert options["block_size"] == result["chosen"]["block_size"] and options["max_num_seqs"] == 256
    llm = LLM(**{**options, "model": str(tiny_model_dir), "skip_tokenizer_init": True, "num_blocks": 32})
    try:
        assert len(llm.generate([[1, 2, 3]])[0].token_ids) > 0
    finally:
        llm.engine.close()
    assert "tuned / default goodput (medians of 1):" in capsys.readouterr().out


def test_a_bad_budget_is_refused():
    with pytest.raises(ValueError, match="90s, 10m, 1h"):
        tune.parse_budget("ten minutes")
    assert tune.parse_budget("90s") == 90 and tune.parse_budget("10m") == 600 and tune.parse_budget("2") == 2
