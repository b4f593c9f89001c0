"""The disaggregated cluster as real processes: router, prefill and decode workers, embedded Redis, gRPC on loopback."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
from cluster_utils import cluster, discard, prometheus_values
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from waiting import wait_until

from cluster_state.registry import Registry
from decode_service.prefill_client import REFRESH_S
from engine import SamplingParams
from engine.structured_output import StructuredOutput
from kvserve.client import Client, build_request
from security.auth import Security
from security.identity import Identity

GREEDY = {"temperature": 0, "max_tokens": 32, "ignore_eos": True}
COLOR_COUNT = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                "count": {"type": "integer", "minimum": 1, "maximum": 20}},
               "required": ["color", "count"], "additionalProperties": False}  # fmt: skip
# the module's decode worker speculates, so every answer here also checks that speculation changes no token
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'


@pytest.fixture(scope="module")
def one_by_one(tmp_path_factory):
    c = cluster(1, 1, tmp_path_factory.mktemp("logs-1p1d"), decode_argv=["--speculative-config", NGRAM])
    yield c
    discard(c)


def test_greedy_through_1p1d_equals_offline_engine(one_by_one, engine_prompts, hf_greedy):
    with Client(one_by_one.endpoint, timeout_s=120) as client:
        for prompt, expected in zip(engine_prompts, hf_greedy, strict=True):
            # 16 tokens each (32 for three of them in test_async_client_mirrors_the_sync_one)
            result = client.generate(prompt, **{**GREEDY, "max_tokens": 16})
            assert result.token_ids == expected[:16]
            assert result.transfer_backend == "shm" and result.prefill_worker == "prefill-0"
            assert result.finish_reason == "length" and result.usage["prompt_tokens"] == len(prompt)


def test_the_decode_worker_speculates_on_the_prefill_workers_first_token_and_counts_it(one_by_one, llm):
    """A copy-heavy prompt: the prefill worker samples the first token, the decode worker proposes and verifies
    the rest; the answer is the offline engine's (which does not speculate), with and without the option."""
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    prompt = f"Repeat this code exactly:\n{code}{code}{code}\nRepeated:\n"
    [offline] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    url = one_by_one.child("decode-0").metrics_url
    before = prometheus_values(url, "kvserve_spec_accepted_tokens_total")
    with Client(one_by_one.endpoint, timeout_s=120) as client:
        served = client.generate(prompt, **GREEDY)
        middle = prometheus_values(url, "kvserve_spec_accepted_tokens_total")
        plain = client.generate(prompt, **GREEDY, speculative=False)
    after = prometheus_values(url, "kvserve_spec_accepted_tokens_total")
    assert served.token_ids == plain.token_ids == offline.token_ids
    key = 'method="ngram",role="decode"'
    assert middle[key] - before.get(key, 0.0) >= 8  # most of the copy was accepted
    assert after[key] == middle[key]  # the request that turned it off proposed nothing
    rate = prometheus_values(url, "kvserve_spec_acceptance_rate")[key]
    assert 0 < rate <= 1


def test_seeded_sampling_through_the_cluster_equals_the_offline_engine(one_by_one, llm, engine_prompts):
    # the prefill worker samples the first token, the decode worker the rest, from one seed's stream
    options = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 77, "max_tokens": 24, "ignore_eos": True}
    [offline] = llm.generate([engine_prompts[4]], SamplingParams(**options))
    with Client(one_by_one.endpoint, timeout_s=120) as client:
        served = client.generate(engine_prompts[4], **options)
    assert served.transfer_backend == "shm"
    assert served.token_ids == offline.token_ids


def test_logprobs_through_1p1d_are_transformers_the_prefill_worker_computing_the_prompts(one_by_one, hf_model,
                                                                                         engine_prompts):  # fmt: skip
    """The prefill worker computes the prompt's log-probabilities and the first token's, and they travel with
    its reply; the decode worker the rest (speculating: from the verify pass). Within 1e-4 of transformers'
    log_softmax (fp32, other schedules: tests/engine/test_logprobs.py)."""
    import torch

    prompt = engine_prompts[5]
    options = {**GREEDY, "max_tokens": 8, "logprobs": 2, "prompt_logprobs": 1, "min_tokens": 4}
    with Client(one_by_one.endpoint, timeout_s=120) as client:
        result = client.generate(prompt, **options)
    assert result.prefill_worker == "prefill-0" and result.transfer_backend == "shm"
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt + result.token_ids])).logits[0].float().log_softmax(-1)
    assert result.prompt_token_ids == prompt and len(result.prompt_logprobs) == len(prompt) - 1
    for p, entry in enumerate(result.prompt_logprobs, start=1):
        assert entry.token_id == prompt[p] and abs(entry.logprob - float(expected[p - 1, prompt[p]])) < 1e-4
        assert len(entry.top) == 1 and abs(entry.top[0][1] - float(expected[p - 1].max())) < 1e-4
    assert [e.token_id for e in result.logprobs] == result.token_ids and len(result.token_ids) == 8
    for j, entry in enumerate(result.logprobs):
        row = expected[len(prompt) - 1 + j]
        assert abs(entry.logprob - float(row[entry.token_id])) < 1e-4
        assert [lp for _, lp in entry.top] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)


def test_n_choices_hand_the_prompt_over_once_and_each_is_its_own_seeded_stream(one_by_one, llm):
    """A request of n=4 through 1P1D: the prefill worker computes its prompt once (its prompt-token counter grows
    by the prompt's length, not four times that), and choice i is the offline engine's request with seed + i."""
    prompt = "Write one sentence about the sea, the wind and a small boat that sails at dawn:"
    options = {"temperature": 1.0, "seed": 40, "max_tokens": 12, "ignore_eos": True}
    url = one_by_one.child("prefill-0").metrics_url
    before = sum(prometheus_values(url, "kvserve_prefill_prompt_tokens_total").values())
    with Client(one_by_one.endpoint, timeout_s=120) as client:
        results = client.generate(prompt, n=4, **options)
    after = sum(prometheus_values(url, "kvserve_prefill_prompt_tokens_total").values())
    num_prompt = results[0].usage["prompt_tokens"]
    assert after - before == num_prompt and results[0].prefill_worker == "prefill-0"
    offline = [llm.generate([prompt], SamplingParams(**{**options, "seed": 40 + i}))[0].token_ids for i in range(4)]
    assert [r.token_ids for r in results] == offline and len({tuple(t) for t in offline}) == 4


def test_structured_outputs_through_1p1d_the_prefill_worker_drawing_the_first_token_under_the_grammar(
        one_by_one, llm, tokenizer):  # fmt: skip
    """The prefill worker draws each request's first token under its grammar; the decode worker replays it into
    its own matcher and goes on under it. Every answer matches its JSON schema or choice list and ends "stop",
    and is the offline engine's, token for token (seeded and greedy). Unconstrained, each request's first token
    (the same seed's draw) is one its grammar forbids, so a prefill worker blind to the grammar breaks them all."""
    prompts = ["Describe the weather at the seaside today in a few words:",
               "Write one sentence about a small boat at dawn:", "Name a colour and a number, please:"]  # fmt: skip
    choices = ["sunny", "rainy", "foggy"]
    sampled = {"temperature": 1.0, "max_tokens": 24}
    requests = [(p, {**sampled, "seed": 60 + i}, "json", COLOR_COUNT) for i, p in enumerate(prompts)]
    requests += [(p, {"temperature": 0, "max_tokens": 24}, "json", COLOR_COUNT) for p in prompts]
    requests.append((prompts[0], {**sampled, "seed": 7, "max_tokens": 8}, "choice", choices))
    texts, spec = [p for p, *_ in requests], {"json": StructuredOutput.json, "choice": StructuredOutput.choice}

    blind = llm.generate(texts, [SamplingParams(**{**o, "max_tokens": 1}) for _, o, *_ in requests])
    for (_, _, kind, value), out in zip(requests, blind, strict=True):
        first = tokenizer.decode(out.token_ids)  # a JSON object starts "{" (no whitespace), a choice with a choice
        assert not first.startswith("{") if kind == "json" else not any(c.startswith(first) for c in value), first
    offline = llm.generate(texts, [SamplingParams(**o, structured_output=spec[k](v)) for _, o, k, v in requests])

    with Client(one_by_one.endpoint, timeout_s=120) as client, ThreadPoolExecutor(len(requests)) as pool:
        served = list(pool.map(lambda r: client.generate(r[0], **r[1], structured_outputs={r[2]: r[3]}), requests))
    for (_, _, kind, value), result, expected in zip(requests, served, offline, strict=True):
        assert result.transfer_backend == "shm" and result.prefill_worker == "prefill-0"
        assert result.finish_reason == "stop", result.text
        if kind == "json":
            jsonschema.validate(json.loads(result.text), value)
        else:
            assert result.text in value
        assert result.token_ids == expected.token_ids
    assert len({r.text for r in served[:3]}) > 1  # sampled, not one answer three times


def test_32_concurrent_requests_all_correct(one_by_one, engine_prompts, hf_greedy):
    with Client(one_by_one.endpoint, timeout_s=300) as client:
        with ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(client.generate, engine_prompts[i % 8], **{**GREEDY, "max_tokens": 12})
                       for i in range(32)]  # fmt: skip
            results = [f.result() for f in futures]
    for i, result in enumerate(results):
        assert result.token_ids == hf_greedy[i % 8][:12]


def test_streaming_text_matches_tokens(one_by_one, tokenizer):
    with Client(one_by_one.endpoint, timeout_s=60) as client:
        chunks = list(client.stream("Tell me a story about a dragon.", max_tokens=20, temperature=0))
    assert len(chunks) == 20 or chunks[-1].finish_reason == "stop"
    assert chunks[-1].timings["ttft_ms"] > 0
    text = "".join(c.text for c in chunks)
    assert text == tokenizer.decode([t for c in chunks for t in c.token_ids])


def test_health_and_reflection_on_every_process(one_by_one):
    """Workers serve over mutual TLS with the cluster's certificates only (the launcher's here); the router's
    public port stays plain."""
    for child in one_by_one.children:
        security = Security(None) if child.role == "router" else one_by_one.security
        with security.channel(child.address, Identity(child.role, child.name)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            services = {s.name for a in answers for s in a.list_services_response.service}
            assert "grpc.health.v1.Health" in services and any(s.startswith("kvserve.v1.") for s in services)
        if child.role != "router":
            with grpc.insecure_channel(child.address) as plain, pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def _decode_free_blocks(cluster_) -> tuple[int, int]:
    registry = Registry(cluster_.redis_url, security=cluster_.security)
    [worker] = [w for w in registry.workers("decode") if w.worker_id == "decode-0"]
    return worker.free_blocks, worker.total_blocks


def test_cancelled_stream_frees_its_blocks(one_by_one, engine_prompts):
    def all_free() -> bool:
        free, total = _decode_free_blocks(one_by_one)
        return free == total

    with Client(one_by_one.endpoint, timeout_s=60) as client:
        request = build_request(engine_prompts[6], max_tokens=500, temperature=0, ignore_eos=True)
        stream = client._stubs[0].Generate(request)
        next(stream), next(stream)
        wait_until(lambda: not all_free(), 10, "the running request showing up as used blocks", interval_s=0.2)
        stream.cancel()
    wait_until(all_free, 10, "every block free after the cancel", interval_s=0.3)


def test_async_client_mirrors_the_sync_one(one_by_one, engine_prompts, hf_greedy):
    import asyncio

    from kvserve.client import AsyncClient

    async def ask():
        async with AsyncClient(one_by_one.endpoint, timeout_s=120) as client:
            results = await asyncio.gather(*(client.generate(p, **GREEDY) for p in engine_prompts[:3]))
            chunks = [c async for c in client.stream(engine_prompts[0], **GREEDY)]
        return results, chunks

    results, chunks = asyncio.run(ask())
    assert [r.token_ids for r in results] == hf_greedy[:3]
    assert [t for c in chunks for t in c.token_ids] == hf_greedy[0] and chunks[-1].finish_reason == "length"


def test_generate_command_streams_to_the_terminal(one_by_one):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "kvserve.cli", "generate", "What is the capital of France?", "--chat",
           "--max-tokens", "16", "--temperature", "0", "--address", one_by_one.endpoint]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "KV via shm" in done.stderr and "TTFT" in done.stderr


@pytest.mark.soak  # ~24 s: grpc hand-offs run across hosts in test_multihost.py, two decode workers in test_faults.py
def test_2p2d_over_grpc_transfer(tmp_path, engine_prompts, hf_greedy):
    c = cluster(2, 2, tmp_path, decode_argv=["--kv-transport", "grpc"])
    try:
        with Client(c.endpoint, timeout_s=300) as client:
            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda p: client.generate(p, **GREEDY), engine_prompts))
        assert [r.token_ids for r in results] == hf_greedy
        assert {r.transfer_backend for r in results} == {"grpc"}
        # the router counts its own calls, so a burst is spread over both workers of each role
        assert {r.decode_worker for r in results} == {"decode-0", "decode-1"}
        assert {r.prefill_worker for r in results} == {"prefill-0", "prefill-1"}
    finally:
        c.stop()


def test_no_prefill_worker_means_local_prefill(one_by_one, engine_prompts, hf_greedy):
    """The module's cluster, once its prefill worker has stopped (so this comes after every test that uses it)."""
    prefill = one_by_one.child("prefill-0")
    prefill.terminate()
    prefill.proc.wait(timeout=60)
    registry = Registry(one_by_one.redis_url, security=one_by_one.security)
    try:
        wait_until(lambda: not registry.workers("prefill"), 10, "the stopped prefill worker leaving the registry")
    finally:
        registry.stop()
    time.sleep(REFRESH_S + 0.2)  # the decode worker's next view of the registry lists no prefill worker
    with Client(one_by_one.endpoint, timeout_s=120) as client:
        result = client.generate(engine_prompts[3], **GREEDY)
    assert result.token_ids == hf_greedy[3] and result.transfer_backend == "local"


@pytest.mark.soak  # ~16 s: test_multihost.py tears a prefill host down mid-request, test_faults.py kills one
def test_a_killed_prefill_worker_costs_no_request(tmp_path, engine_prompts, hf_greedy):
    """Neither the request it was prefilling nor the next one (a cluster of its own: the module's is shared)."""
    # the prefill worker holds each batch open for 5 s, so the request is surely inside it when it dies
    c = cluster(1, 1, tmp_path, prefill_argv=["--max-wait-ms", "5000"])
    try:
        prefill = c.child("prefill-0").proc
        with Client(c.endpoint, timeout_s=120) as client, ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.generate, engine_prompts[4], **GREEDY)
            time.sleep(2.0)
            assert not pending.done()
            prefill.send_signal(signal.SIGKILL)
            result = pending.result()
            assert result.token_ids == hf_greedy[4] and result.transfer_backend == "local"
            prefill.wait()
            after = client.generate(engine_prompts[5], **GREEDY)  # the registry still lists the dead worker a while
        assert after.token_ids == hf_greedy[5] and after.transfer_backend == "local"
    finally:
        c.stop()
