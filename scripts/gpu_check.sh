#!/usr/bin/env bash
# Every GPU check of issue 8 (and of issues 3 and 4) in one run, for a session lent an NVIDIA GPU (the device tool).
#   here first:  bash scripts/gpu_wheels.sh          (the packages the GPU machine lacks, into .whl/)
#                pytest -m soak tests/deploy/test_gpu_check_script.py   (every step's command line, on the CPU)
#   then:        device run, command "bash scripts/gpu_check.sh", carry [".whl"], timeout_s 580
# Each step runs under its own limit (seconds; 525 together, so that with the wheels' install the command
# takes at most 9 minutes; the machine's start comes on top); its output is also written to $OUT/<step>.txt,
# and its exit line says how long it took. (The second 2026-12-04 run, on a fresh H200, needed: kernels-bench
# 40 s, gpu-tests 161 s on 4 workers, random-model 14, offline 92, nixl 15, nano-vllm 26, cluster 58, spec 23,
# tiers 16, sampling 21, moe-model 15, moe-offline 32; the limits below follow, gpu-tests on 8 workers.)
#   kernels-bench  42  decode tile-config sweep (bf16, int8_v, int8 at batch 64, ctx 8192, 32:8, d128; bf16
#                      d128 ctx 2048 and d64): INT8 vs bf16, and _MEASURED_CONFIGS entries for this GPU
#   gpu-tests     130  every test marked gpu under tests/ (kernels in bf16 at large shapes, graphs vs eager,
#                      the engine vs transformers, launches per layer, cuda_ipc, a 1P+1D cluster on the GPU),
#                      on 8 pytest-xdist workers (Triton's compiles, ptxas processes, are most of their time);
#                      only the files that hold one are collected (others import what the GPU machine lacks:
#                      openai, jsonschema)
#   random-model   17  a random Qwen2-0.5B (24 layers, bf16) in /tmp/qwen2-0.5b
#   offline       100  kvserve bench offline: a profile of decode steps (launches per layer, GPU busy; eager
#                      and CUDA graphs), then batches of 1, 64, 256 prompts of 128 tokens, 128 new tokens
#                      each: the engine against transformers' static cache + torch.compile (which
#                      compiles per batch size, so batch 256 runs the engine alone, as in issue 8's table);
#                      each batch's "bound by" line (engine/step_diagnosis.py against the H200's table peaks)
#   nixl           18  kvserve bench transfer: a 2,048-token KV of that model, VRAM to VRAM between two NIXL
#                      agents (UCX: cuda_ipc or NVLink on one GPU), and over the grpc transport (on
#                      2026-12-04 the PyPI wheel's UCX took VRAM for host memory: nixl is then reported as
#                      not measured, and grpc still is)
#   nano-vllm      30  nano-vllm's workload (128 requests, 100-1,024 tokens in and out), the engine alone
#   cluster        65  kvserve bench serve --device cuda: TTFT/TPOT of a 1P+1D cluster on this GPU against the
#                      offline engine, the KV hand-off of a 2,048-token prompt, and the cuda_ipc stores
#                      of that KV from another process (kvserve bench cuda_ipc) against a plain device copy
#   spec           27  kvserve bench offline --speculative ngram on that random model (token-id copy prompts; its
#                      random weights seldom copy, so this is mostly the verify step's cost on a GPU; verify
#                      steps run eagerly: their query lengths vary with each sequence's proposals)
#   tiers          18  kvserve bench tiers --bandwidth-only: the host KV tier's store (device -> pinned host)
#                      and load (back) GB/s for 16, 128, 1,024 blocks of that model, against a plain copy
#   sampling       24  kvserve bench sampling on that model: decode TPOT with logprobs=5, penalties, logit_bias
#                      + min_p against plain decoding, batches of 1 and 16 (the fused sampler's overheads)
#   moe-model      17  a random Qwen3-30B-A3B (its width, 128 experts, 8 per token) in 2 layers, bf16
#   moe-offline    35  kvserve bench offline on it against transformers' generate (8 prompts of 32-128 tokens,
#                      32 new tokens each): the grouped-GEMM experts (torch._grouped_mm) and their decode
#                      graphs on the GPU, tokens/s and identical greedy outputs
#   tp             60  only on a machine of two or more GPUs (a machine of one prints that it skipped), outside the
#                      525 s: the device tool lends one-GPU machines only, so the whole call (about 15 minutes)
#                      runs where no 9-minute limit holds, or as GPU_CHECK_ONLY='random-model tp tp-tests';
#                      kvserve bench tp, the model split over 2 GPUs (NCCL) against 1,
#                      the split engine replaying the decode CUDA graphs each rank captured
#   tp-tests      300  there too: tests/cluster/test_tensor_parallel_gpu.py (two_gpus, left out of gpu-tests):
#                      the ranks' decode graphs against eager at TP 2 and 1, a hung rank's timeout, rank 1's KV
#                      through CUDA IPC, and 1P+1D clusters at TP 2 -> 1 and 1 -> 2 over cuda_ipc with the
#                      offline engine's tokens
# GPU_CHECK_SMOKE=1 (tests/deploy/test_gpu_check_script.py, on a CPU) runs the same command lines with tiny sizes
# on the model directory GPU_CHECK_MODEL, with $PYTHON and no wheels; a step marked --smoke-parse (it needs
# CUDA, or minutes of a CPU) then only parses its command line.
set -uo pipefail
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
smoke=${GPU_CHECK_SMOKE:-0}
py=${PYTHON:-python3}
if [ "$smoke" = 1 ]; then
    model=${GPU_CHECK_MODEL:?GPU_CHECK_SMOKE=1 needs GPU_CHECK_MODEL, a small model directory}
    batch_sizes=1,2 prompt_len=8 max_tokens=4 profile_batch=2 profile_steps=2 nano_requests=3 nano_lengths=4,8
    device=cpu transfer_tokens=64 tier_blocks=4,8
    gpu_tests=tests/engine/test_cuda_graph.py spec_tokens=8 moe_model=$model moe_prompts=2 moe_tokens=4 sampling_rounds=1 sampling_tokens=4 test_workers=0  # (collecting all of tests/ takes ~10 s of a CPU to run no test)
    export PYTHONPATH=. PYTHONUNBUFFERED=1
else
    model=/tmp/qwen2-0.5b
    batch_sizes=1,64,256 prompt_len=128 max_tokens=128 profile_batch=64 profile_steps=5 nano_requests=128
    nano_lengths=100,1024 device=cuda transfer_tokens=2048 tier_blocks=16,128,1024 spec_tokens=32 test_workers=8
    gpu_tests=$(grep -rlE 'mark\.gpu' tests --include='test_*.py' | sort)  # (the files that hold a gpu test)
    moe_model=/tmp/qwen3-30b-a3b moe_prompts=8 moe_tokens=32 sampling_rounds=1 sampling_tokens=32
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "carry .whl (bash scripts/gpu_wheels.sh)"; exit 1; }
    export PYTHONPATH=".:/tmp/site" PYTHONUNBUFFERED=1
fi

# Runs `python -m MODULE ARGS...` as if for real, but exits 0 as soon as MODULE's argparse accepted ARGS
# (its `parse_args` errors and exits 2 otherwise); exits 3 if MODULE never parsed a command line.
parse_only='
import argparse, runpy, sys
parse_args = argparse.ArgumentParser.parse_args
def parsed(self, args=None, namespace=None):
    parse_args(self, args, namespace)
    print("command line accepted:", " ".join(sys.argv[1:]))
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parsed
module = sys.argv[2]  # sys.argv: -c -m MODULE ARGS...
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
sys.exit(3)
'

# GPU_CHECK_ONLY="NAME[:SECONDS] ..." runs only those steps (a rerun of what failed), each under the limit given;
# GPU_CHECK_TESTS replaces the gpu-tests step's paths (the test files to rerun).
only=${GPU_CHECK_ONLY:-}
[ -n "${GPU_CHECK_TESTS:-}" ] && gpu_tests=$GPU_CHECK_TESTS
step() {  # step NAME SECONDS [--smoke-parse] -m MODULE ARGS...
    local name=$1 limit=$2 started=$SECONDS
    shift 2
    if [ -n "$only" ]; then
        local chosen
        chosen=$(tr ' ' '\n' <<<"$only" | grep -E "^$name(:|$)") || return 0
        [[ $chosen == *:* ]] && limit=${chosen#*:}
    fi
    local command=("$py")
    if [ "$1" = --smoke-parse ]; then
        shift
        [ "$smoke" = 1 ] && command=("$py" -c "$parse_only")
    fi
    echo "=== $name: python3 $*"
    timeout -k 3 "$limit" "${command[@]}" "$@" 2>&1 | tee "$out/$name.txt"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - started)) s of $limit"
}

{ git log -1 --format='commit %h %s' 2>/dev/null
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$py" -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
} 2>&1 | tee "$out/machine.txt"
step kernels-bench 42 -m kvserve.bench.kernels --sweep-only
step gpu-tests 130 -m pytest -q -rs -m "gpu and not two_gpus" -p no:cacheprovider -n "$test_workers" --dist loadgroup \
    --continue-on-collection-errors $gpu_tests
step random-model 17 --smoke-parse -m kvserve.cli model random --like qwen2-0.5b --out "$model" --dtype bfloat16
step offline 100 -m kvserve.bench.offline --model "$model" --baseline hf-static --batch-sizes "$batch_sizes" \
    --baseline-max-batch 64 --prompt-len "$prompt_len" --max-tokens "$max_tokens" --profile \
    --profile-batch "$profile_batch" --profile-steps "$profile_steps"
step nixl 18 --smoke-parse -m kvserve.bench.transfer --device "$device" --model "$model" --tokens "$transfer_tokens" --repeats 3
step nano-vllm 30 -m kvserve.bench.offline --model "$model" --baseline none --workload nano-vllm \
    --nano-requests "$nano_requests" --nano-lengths "$nano_lengths"
step cluster 65 --smoke-parse -m kvserve.bench.serve --device cuda --model "$model"
step spec 27 -m kvserve.bench.offline --speculative ngram --model "$model" --max-tokens "$spec_tokens" \
    --spec-rounds 1
step tiers 18 -m kvserve.bench.tiers --bandwidth-only --device "$device" --model "$model" --blocks "$tier_blocks"
step sampling 24 -m kvserve.bench.sampling --model "$model" --batch-sizes "1,16" --max-tokens "$sampling_tokens" \
    --rounds "$sampling_rounds"
step moe-model 17 --smoke-parse -m kvserve.cli model random --like qwen3-30b-a3b --layers 2 --out "$moe_model" \
    --dtype bfloat16
step moe-offline 35 -m kvserve.bench.offline --model "$moe_model" --num-prompts "$moe_prompts" --min-len 32 \
    --max-len 128 --max-tokens "$moe_tokens" --profile-batch "$moe_prompts" --profile-steps 4
if [ "$smoke" = 1 ] || [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    step tp 60 --smoke-parse -m kvserve.bench.tp --model "$model" --batch-sizes "1,64" --rounds 1
    step tp-tests 300 -m pytest -q -rs -s -m two_gpus -p no:cacheprovider tests/cluster/test_tensor_parallel_gpu.py
else
    echo "=== tp: skipped: tensor parallelism needs two or more GPUs, this machine has $(nvidia-smi -L 2>/dev/null | wc -l)"
fi
