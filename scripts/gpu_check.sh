#!/usr/bin/env bash
# The GPU checks of issues 3 and 4 in one run, for a session lent an NVIDIA GPU (the device tool).
#   here first:  bash scripts/gpu_wheels.sh          (the packages the GPU machine lacks, into .whl/)
#   then:        device run, command "bash scripts/gpu_check.sh", carry [".whl"], timeout_s 560
# About 5 minutes on an H200. Each step's output is also written to $OUT/<step>.txt.
#   kernels-bench  issue 3's table: decode vs SDPA (flash), INT8 KV vs bf16, store_kvcache vs a copy, tile sweep
#   gpu-tests      every test marked gpu: Triton kernels in bf16 at large shapes, the engine on CUDA
#                  (random Qwen2-0.5B-shaped model vs transformers), the cuda_ipc hand-off between two processes
#   cuda-ipc       issue 4's hand-off of a 2,048-token Qwen2-0.5B-shaped KV into another process's pool
#   offline        the engine vs transformers generate on a random Qwen2-0.5B (24 layers), same run
set -uo pipefail
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "carry .whl (bash scripts/gpu_wheels.sh)"; exit 1; }
export PYTHONPATH=".:/tmp/site" PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    echo "=== $name: exit ${PIPESTATUS[0]}"
}

{ git log -1 --format='commit %h %s' 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
} 2>&1 | tee "$out/machine.txt"
step kernels-bench 200 python3 -m kernels.bench --sweep
step gpu-tests 200 python3 -m pytest -q -s -rs -m gpu -p no:cacheprovider tests/kernels tests/test_cuda_ipc.py \
    tests/test_engine_device.py
step cuda-ipc 60 python3 -m kvserve.bench.cuda_ipc
step random-model 90 python3 -c 'from engine.random_model import write_random_model as w; w("/tmp/qwen2-0.5b", "qwen2-0.5b", device="cuda")'
step offline 120 python3 -m kvserve.bench.offline --model /tmp/qwen2-0.5b --num-prompts 256 --min-len 16 \
    --max-len 1024 --max-tokens 128 --max-num-batched-tokens 8192
