"""``scripts/gpu_check.sh`` is run once, by a session lent a GPU: it must not fail on a typo.

On the CPU its smoke mode runs the same command lines with tiny sizes (the steps that need CUDA, or minutes
of a CPU, only have their command lines parsed), so a wrong module path, flag or value fails here. The
wheels it installs are checked against the versions this venv tests with when ``.whl`` has been fetched.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from tiny_model import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
WHEELS = ROOT / ".whl"
STEPS = re.findall(r"^step (\S+) (\d+) ", SCRIPT.read_text(), flags=re.MULTILINE)  # (name, seconds)
DEVICE_STEPS_BUDGET_S = 525  # 9 minutes of command time (the machine's start is not in it), less the wheels' install


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_step_limits_fit_one_device_call():
    names = [name for name, _ in STEPS]
    assert names == ["kernels-bench", "gpu-tests", "random-model", "offline", "nixl", "nano-vllm",
                     "cluster", "spec", "tiers", "sampling", "moe-model", "moe-offline"]
    assert sum(int(seconds) for _, seconds in STEPS) <= DEVICE_STEPS_BUDGET_S


# on demand (~40 s of ten processes), before a device call: pytest -m soak tests/deploy/test_gpu_check_script.py
@pytest.mark.soak
def test_smoke_run_starts_every_step_and_each_exits_0(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_SMOKE="1", GPU_CHECK_MODEL=write_tiny_model(tmp_path / "model"),
               PYTHON=sys.executable, OUT=str(out), OMP_NUM_THREADS="1")  # fmt: skip
    run = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    for name, _ in STEPS:
        assert f"=== {name}: exit 0" in run.stdout, run.stdout[-4000:]
        assert (out / f"{name}.txt").is_file()
    offline = (out / "offline.txt").read_text()
    for line in ("launches per layer (eager)", "GPU busy (eager)", "GPU busy (graphs)", "engine/hf-static"):
        assert line in offline
    assert "nano-vllm workload: 3 requests" in (out / "nano-vllm.txt").read_text()
    assert "logprobs=5" in (out / "sampling.txt").read_text()
    # nixl: two NIXL agents cost ~20 s of a CPU (tests/cluster/test_transfer_nixl.py moves KV through them)
    for parsed_only in ("random-model", "nixl", "cluster"):  # they need CUDA or minutes of a CPU
        assert "command line accepted:" in (out / f"{parsed_only}.txt").read_text()


def _pins() -> dict[str, str]:
    text = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    return {name: pinned for name, pinned in re.findall(r"\b([A-Za-z][\w.-]*)==([\w.]+)", text)}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.skipif(not WHEELS.is_dir(), reason="no .whl here: run scripts/gpu_wheels.sh before a GPU run")
def test_carried_wheels_are_the_versions_this_venv_tests_with():
    pins = _pins()
    assert {name: version(name) for name in pins} == pins
    carried = [wheel.name.split("-")[:2] for wheel in WHEELS.glob("*.whl")]
    assert sorted((_normalized(name), v) for name, v in carried) == sorted(
        (_normalized(name), v) for name, v in pins.items()
    )  # one wheel per pinned package, and nothing else: two versions of one would stop the whole install
