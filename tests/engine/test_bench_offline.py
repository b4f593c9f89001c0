"""``kvserve bench offline`` end to end on a tiny random model, every mode, and the decode profile on the CPU.

The GPU run prints what these runs print, at full size: a flag or a code path broken here would cost a
device call. Timings are not checked, only that each section ran and printed sensible figures.
"""

from __future__ import annotations

import re

import pytest
import torch
from tiny_model import TINY_SHAPE, write_tiny_model

from kvserve.bench import offline
from kvserve.bench.host_share import STEP_RANGE, device_call_host_share, operator_host_share
from kvserve.bench.profile import LAYER_RANGE, count_trace, profile_decode_steps


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices on a shared 2-core machine: more threads only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rows(printed: str) -> list[list[str]]:
    """The table rows of ``--batch-sizes``: lines that start with a batch size."""
    return [line.split() for line in printed.splitlines() if line.strip() and line.split()[0].isdigit()]


@pytest.mark.parametrize("baseline", ["hf", "hf-static"])
def test_batch_rows_against_each_baseline(tiny_model, baseline, capsys):
    offline.main(["--model", tiny_model, "--baseline", baseline, "--no-compile", "--batch-sizes", "1,3",
                  "--prompt-len", "8", "--max-tokens", "4"])  # fmt: skip
    printed = capsys.readouterr().out
    assert f"engine/{baseline}" in printed
    rows = _rows(printed)
    assert [row[0] for row in rows] == ["1", "3"]
    for _, engine_rate, baseline_rate, ratio in rows:
        assert float(ratio.rstrip("x")) == pytest.approx(float(engine_rate) / float(baseline_rate), rel=0.02)


def test_static_cache_baseline_matches_dynamic_greedy_tokens(tiny_model):
    from kvserve.bench.hf_baseline import TransformersBaseline

    prompts = offline.make_prompts(3, 5, 9, TINY_SHAPE["vocab_size"], seed=1)  # left padding included
    runs = [TransformersBaseline(tiny_model, torch.float32, torch.device("cpu"), static=static, compiled=False)
            .run(prompts, 5) for static in (False, True)]  # fmt: skip
    (_, dynamic), (_, static) = runs
    assert [len(t) for t in static] == [5, 5, 5]
    assert static == dynamic


def test_random_lengths_is_the_default_workload(tiny_model, capsys):
    offline.main(["--model", tiny_model, "--num-prompts", "3", "--min-len", "4", "--max-len", "9", "--max-tokens", "3"])
    printed = capsys.readouterr().out
    assert "3 prompts of 4-9 tokens, 3 new tokens each" in printed
    assert "speed-up" in printed and "identical greedy outputs:" in printed


def test_nano_vllm_workload_engine_only(tiny_model, capsys):
    offline.main(["--model", tiny_model, "--workload", "nano-vllm", "--nano-requests", "4", "--nano-lengths", "3,7"])
    printed = capsys.readouterr().out
    assert "nano-vllm workload: 4 requests, prompts and outputs of 3-7 tokens" in printed
    line = next(line for line in printed.splitlines() if line.startswith("kvserve engine :"))
    num_tokens = int(line.split()[3])
    assert 4 * 3 <= num_tokens <= 4 * 7
    assert "speed-up" not in printed  # no baseline


def test_bad_nano_lengths_are_refused(capsys):
    with pytest.raises(SystemExit):
        offline.parse_args(["--workload", "nano-vllm", "--nano-lengths", "9,3"])
    assert "--nano-lengths" in capsys.readouterr().err


def test_profile_runs_on_the_cpu_and_leaves_the_engine_empty(tiny_model):
    from engine import LLM

    llm = LLM(tiny_model, skip_tokenizer_init=True, enforce_eager=True, num_blocks=64)
    profile = profile_decode_steps(llm, batch_size=3, prompt_len=20, num_steps=2)
    assert profile.launches_per_step == 0 and profile.launches_per_layer == 0  # no device kernels on a CPU
    assert profile.gpu_busy is None
    assert profile.wall_ms > 0
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == 64


def test_profile_flag_prints_launches_and_busy(tiny_model, capsys):
    offline.main(["--model", tiny_model, "--baseline", "none", "--batch-sizes", "2", "--prompt-len", "6",
                  "--max-tokens", "3", "--profile", "--profile-batch", "2", "--profile-steps", "2"])  # fmt: skip
    printed = capsys.readouterr().out
    for line in ("launches per layer (eager): 0.0", "GPU busy (eager): n/a", "GPU busy (graphs): n/a"):
        assert line in printed
    assert [row[0] for row in _rows(printed)] == ["2"]


def test_count_trace_attributes_kernels_to_layers_and_merges_intervals():
    def event(cat, name, ts, dur, correlation=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}

    events = [
        event("user_annotation", LAYER_RANGE, 100, 50),
        event("cuda_runtime", "cudaLaunchKernel", 110, 5, correlation=1),  # inside the layer
        event("cuda_driver", "cuLaunchKernelEx", 140, 5, correlation=2),  # inside the layer (Triton)
        event("cuda_runtime", "cudaLaunchKernel", 160, 5, correlation=3),  # after it: the logits
        event("cuda_runtime", "cudaMemcpyAsync", 170, 5, correlation=4),  # not a launch
        event("cuda_runtime", "cudaGraphLaunch", 180, 5, correlation=5),
        event("kernel", "gemm", 200, 10, correlation=1),
        event("kernel", "attention", 205, 10, correlation=2),  # overlaps gemm: 200..215 busy
        event("kernel", "logits", 230, 5, correlation=3),
        event("kernel", "graph kernel", 240, 4, correlation=5),
        event("kernel", "graph kernel", 244, 2, correlation=5),  # one launch, two kernels
        event("kernel", "no launch in the trace", 250, 1, correlation=9),
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 200},
    ]
    counts = count_trace(events)
    assert counts.num_kernels == 6
    assert counts.num_layer_kernels == 2
    assert counts.num_unattributed == 1
    assert counts.num_host_launches == 4
    assert counts.kernel_us == pytest.approx(15 + 5 + 6 + 1)


def test_bound_by_lines_and_the_host_share_against_the_profiler(tiny_model, capsys):
    offline.main(["--model", tiny_model, "--baseline", "none", "--batch-sizes", "2", "--prompt-len", "8",
                  "--max-tokens", "4", "--diagnose", "--diagnose-steps", "3"])  # fmt: skip
    printed = capsys.readouterr().out
    bound = [line.strip() for line in printed.splitlines() if line.strip().startswith("bound by:")]
    kinds = [re.fullmatch(r"bound by: memory bandwidth \d+% \| compute \d+% \| host \d+%  \((\w+): (\d+) steps, "
                          r"[\d.]+ ms each\)", line).groups() for line in bound]  # fmt: skip
    assert sorted(kinds) == [("decode", "3"), ("prefill", "1")]  # the row's 4 tokens: one prefill, 3 decode steps
    assert [row[0] for row in _rows(printed)] == ["2"]
    shares = re.search(r"batch   2: Python tracer on: diagnosis ([\d.]+)% \| torch.profiler, same definition "
                       r"([\d.]+)%", printed)  # fmt: skip
    assert shares is not None and all(0 < float(share) < 100 for share in shares.groups())
    assert "operators only: diagnosis" in printed and "no profiler: diagnosis" in printed


def test_trace_host_shares_count_device_time_inside_the_steps_only():
    def event(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    steps = [event("python_function", "llm_engine.py(230): step", 0, 100),
             event("python_function", "llm_engine.py(230): step", 200, 100)]  # fmt: skip
    calls = [
        event("python_function", "nn.Module: CausalLM_0", 10, 50),
        event("python_function", "model.py(185): forward", 12, 40),  # inside the module call: counted once
        event("python_function", "sampler.py(85): __call__", 220, 30),
        event("python_function", "sampler.py(85): __call__", 120, 30),  # between the steps: not counted
        event("python_function", "nn.Module: CausalLM_0", 230, 10, tid=2),  # another thread: not counted
    ]
    share = device_call_host_share(steps + calls, "llm_engine.py(230): step",
                                   ("nn.Module: CausalLM_", "model.py(185): forward", "sampler.py(85): __call__"))
    assert share == pytest.approx(1 - (50 + 30) / 200)
    ops = [event("user_annotation", STEP_RANGE, 0, 100), event("user_annotation", STEP_RANGE, 200, 100),
           event("cpu_op", "aten::linear", 10, 40), event("cpu_op", "aten::addmm", 20, 20),  # nested
           event("cpu_op", "aten::argmax", 90, 20),  # runs past the step's end: 10 of it inside
           event("cpu_op", "aten::copy_", 250, 10)]  # fmt: skip
    assert operator_host_share(ops) == pytest.approx(1 - (40 + 10 + 10) / 200)


def test_tiny_times_engine_and_transformers_steps_per_batch(capsys):
    offline.main(["--tiny", "--batch-sizes", "1,3", "--tiny-prompt-len", "5", "--tiny-steps", "2",
                  "--tiny-rounds", "2"])  # fmt: skip
    printed = capsys.readouterr().out
    rows = _rows(printed)
    assert [row[0] for row in rows] == ["1", "3"]
    for _, engine_ms, hf_ms, ratio, model_ms, host_us in rows:
        assert float(engine_ms) > 0 and float(hf_ms) > 0 and float(ratio) > 0
        assert 0 < float(model_ms) <= float(engine_ms)
        assert float(host_us) >= 0
    assert "decode attention at batch 3, 7 tokens each: reference" in printed
