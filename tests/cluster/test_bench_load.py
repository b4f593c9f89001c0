"""``kvserve bench load`` against a real 1P+1D cluster (processes, embedded Redis), through both doors: its
report's counts and percentiles hang together, its JSON has the promised keys, its PNGs are written, and a
burst on a decode worker with a queue limit of 2 shows up as errors by status. Plus the parts that need no
cluster: arrivals, datasets, the SLO syntax."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics

import pytest
from cluster_utils import cluster, discard

from kvserve.bench.datasets import jsonl_requests, random_requests, shared_prefix_requests
from kvserve.bench.load import main, parse_slo
from kvserve.bench.loadgen import arrival_gaps
from kvserve.bench.speculative import copy_prompts

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.fixture(scope="module")
def full_cluster(tmp_path_factory):
    """A decode worker of 32 blocks (16 tokens each) that lets at most 2 requests wait for blocks (the runs that
    must not fail keep at most 2 small requests in flight) and speculates with n-gram prompt lookup."""
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    c = cluster(1, 1, tmp_path_factory.mktemp("logs"), http=True,
                decode_argv=["--num-blocks", "32", "--max-waiting", "2", "--speculative-config", spec])  # fmt: skip
    yield c
    discard(c)


def _load(tmp_path, name: str, *argv: str) -> dict:
    out = tmp_path / f"{name}.json"
    main([*argv, "--no-progress", "--save-result", str(out), "--plot", str(tmp_path / f"{name}.png")])
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
    return json.loads(out.read_text())


def _check_consistent(result: dict, num: int, output_len: int) -> None:
    assert result["num_requests"] == result["completed"] == num and result["errors"] == {}
    assert result["total_output_tokens"] == num * output_len  # ignore_eos: exactly the asked length
    assert result["output_token_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration_s"])
    for key in LATENCY_KEYS:
        d = result[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
    for q in ("mean", "p50", "p90", "p99"):  # every request's end-to-end time includes its TTFT
        assert result["e2e_ms"][q] >= result["ttft_ms"][q]
    assert 0 <= result["cached_prompt_fraction"] <= 1
    assert result["client"]["code_us_per_request"] > 0 and result["client"]["cpu_ms_per_request"] > 0


def test_grpc_run_report_json_and_plot(full_cluster, tmp_path):
    metrics = [c.metrics_url for c in full_cluster.children]  # the decode and prefill workers' and the router's
    result = _load(tmp_path, "grpc", "--target", full_cluster.endpoint, "--num-requests", "10", "--input-len", "32",
                   "--output-len", "6", "--request-rate", "20", "--max-concurrency", "2", "--warmup", "2",
                   "--seed", "3", "--slo", "ttft_ms=600000,tpot_ms=1",
                   *(f"--metrics-url={url}" for url in metrics))  # fmt: skip
    _check_consistent(result, 10, 6)
    server = result["server"]  # counted by the servers during the measured run (the warm-up came before)
    assert server["router_requests"] == {'status="OK"': 10}
    assert server["worker_requests"]['outcome="finished",role="decode"'] == 10
    assert server["kv_transfer_bytes"] > 0 and 0 < server["server_ttft_ms_mean"] <= result["ttft_ms"]["mean"]
    assert result["total_input_tokens"] == 10 * 32
    assert result["goodput"]["slo"] == {"ttft_ms": 600000, "tpot_ms": 1}
    assert result["goodput"]["good_requests"] == 0  # nobody decodes a token in 1 ms here
    assert result["args"]["request_rate"] == 20 and result["args"]["target"] == full_cluster.endpoint


def test_a_copy_workload_reports_the_decode_workers_speculation(full_cluster, tmp_path, tokenizer):
    metrics = [c.metrics_url for c in full_cluster.children]
    result = _load(tmp_path, "copy", "--target", full_cluster.endpoint, "--dataset", "copy", "--num-requests", "2",
                   "--output-len", "24", "--max-concurrency", "1", *(f"--metrics-url={url}" for url in metrics))
    _check_consistent(result, 2, 24)
    assert result["total_input_tokens"] == sum(len(tokenizer.encode(p)) for p in copy_prompts(2))
    server = result["server"]
    assert server["spec_proposed_tokens"] > 0  # a passage being repeated: the n-gram lookup finds it
    assert 0 < server["spec_acceptance_rate"] <= 1 and 0 < server["spec_mean_accepted_length"] <= 4


def test_openai_backend_sweep_writes_one_run_per_rate(full_cluster, tmp_path):
    result = _load(tmp_path, "sweep", "--backend", "openai", "--target", full_cluster.http_endpoint,
                   "--dataset", "shared-prefix", "--num-prefixes", "2", "--questions-per-prefix", "3",
                   "--prefix-len", "32", "--input-len", "8", "--output-len", "4", "--sweep-rates", "8,inf",
                   "--max-concurrency", "2")  # fmt: skip
    assert [run["request_rate"] for run in result["runs"]] == [8, "inf"]
    for run in result["runs"]:
        _check_consistent(run, 6, 4)
        assert run["total_input_tokens"] == 6 * 40


def test_a_burst_on_a_full_worker_is_counted_by_status(full_cluster, tmp_path):
    """Ten prompts of 200 tokens at once, 13 of the 32 blocks each: two hold blocks, two may wait for blocks, the
    rest are refused with RESOURCE_EXHAUSTED."""
    result = _load(tmp_path, "burst", "--target", full_cluster.endpoint, "--num-requests", "10", "--input-len", "200",
                   "--output-len", "2")  # fmt: skip
    assert result["errors"].get("RESOURCE_EXHAUSTED", 0) >= 1, result["errors"]
    assert result["completed"] + sum(result["errors"].values()) == 10
    assert result["completed"] >= 1


def test_poisson_gaps_have_the_asked_mean_and_burstiness_keeps_it():
    for burstiness in (1.0, 0.5, 4.0):
        gaps = arrival_gaps(5.0, burstiness, random.Random(0))
        sample = [next(gaps) for _ in range(20000)]
        assert statistics.mean(sample) == pytest.approx(0.2, rel=0.05)
    steady, bursty = (arrival_gaps(5.0, b, random.Random(0)) for b in (4.0, 0.5))
    assert statistics.stdev(next(steady) for _ in range(5000)) < statistics.stdev(next(bursty) for _ in range(5000))
    assert next(arrival_gaps(math.inf, 1.0, random.Random(0))) == 0.0


def test_datasets_lengths():
    reqs = random_requests(200, 100, 20, 0.5, 49152, seed=0)
    assert all(50 <= len(r.prompt) == r.num_prompt_tokens <= 150 and 10 <= r.max_tokens <= 30 for r in reqs)
    assert len({len(r.prompt) for r in reqs}) > 20
    shared = shared_prefix_requests(3, 4, 64, 16, 8, 49152, seed=0)
    assert len(shared) == 12 and len({tuple(r.prompt[:64]) for r in shared}) == 3
    assert all(len(r.prompt) == 80 for r in shared)


def test_jsonl_prompts_and_sharegpt_take_token_counts_from_the_tokenizer(tmp_path, tokenizer):
    plain = tmp_path / "prompts.jsonl"
    plain.write_text('{"prompt": "Hello there, how are you?"}\n\n{"text": "Tell me a joke."}\n')
    reqs = jsonl_requests(plain, tokenizer, output_len=7)
    assert [r.prompt for r in reqs] == ["Hello there, how are you?", "Tell me a joke."]
    assert [r.num_prompt_tokens for r in reqs] == [len(tokenizer.encode(r.prompt)) for r in reqs]
    assert [r.max_tokens for r in reqs] == [7, 7]
    sharegpt = tmp_path / "sharegpt.json"
    turns = [{"from": "human", "value": "Why is the sky blue?"}, {"from": "gpt", "value": "Rayleigh scattering."}]
    sharegpt.write_text(json.dumps([{"conversations": turns}]))
    [req] = jsonl_requests(sharegpt, tokenizer, output_len=7)
    assert req.prompt == "Why is the sky blue?"
    assert req.max_tokens == len(tokenizer.encode("Rayleigh scattering."))


def test_slo_syntax():
    assert parse_slo("ttft_ms=500, tpot_ms=50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    with pytest.raises(argparse.ArgumentTypeError):
        parse_slo("ttft=500")
