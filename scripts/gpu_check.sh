#!/usr/bin/env bash
# The GPU checks of issues 3 and 4, as one script for a session lent an NVIDIA GPU (the device tool).
# The GPU machine lacks some packages: download wheels for Python 3.12 into .whl/ first (xxhash, pytest,
# pluggy, iniconfig, packaging, hypothesis, sortedcontainers, attrs) as the device README describes, and
# carry .whl. Results go to $OUT (or /tmp/gpu-out).
set -uo pipefail
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/test_cuda_ipc.py 2>&1 | tee "$out/gpu-tests.txt"
timeout 240 python3 -m kernels.bench 2>&1 | tee "$out/kernels-bench.txt"
timeout 60 python3 -m kvserve.bench_cuda_ipc 2>&1 | tee "$out/cuda-ipc.txt"
