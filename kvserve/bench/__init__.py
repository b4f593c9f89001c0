"""The benchmarks, one module per bench, each with ``main(argv)``; ``kvserve bench NAME`` runs one:

* ``offline``: the engine's ``LLM.generate`` against transformers' batched ``generate`` (dynamic or static
  cache: ``hf_baseline``), nano-vllm's workload, and a profile of decode steps (``profile``);
* ``serve``: TTFT and TPOT through a local 1P+1D cluster against the offline engine, one request at a time;
* ``transfer``: the KV hand-off's cost over ``shm``, ``grpc`` and ``nixl``;
* ``cuda_ipc``: the KV hand-off between two processes on a GPU;
* ``kv-curve``: decode tokens/s and KV memory against sequence length, with the KV cache against none;
* ``tiers``: what the host KV tier buys: multi-turn TTFT with a small device pool, and resuming a preempted
  sequence by swap against recompute;
* ``ring``: StreamingLLM's ring buffer: memory and speed over a long generation, and perplexity against the
  full cache and a window without sinks;
* ``load``: an open-loop load test of a running cluster through its public API (``kvserve.bench.loadgen``
  is its engine, which ``scripts/reliability.py`` drives too);
* ``sampling``: what logprobs, penalties and the other per-request sampling features cost per output token;
* ``tracing``: what OpenTelemetry tracing costs through a cluster, on and off;
* ``peer``: ``kvserve up`` against llama.cpp's ``llama-server`` on this host (built once from its sdist), same
  weights and client, at 1 and 16 users;
* ``tp``: tensor parallelism against one rank on this host: tokens/s and the collectives' share of a step;
* ``priority``: high-priority TTFT through a cluster, unloaded and under an overload of low-priority users;
* ``tenants``: one tenant's TTFT solo and beside another tenant's flood, with the router's fair queue and without;
* ``disagg``: a prompt's TTFT through a prefill worker against the decode worker alone, by prompt length (what
  ``--disagg-min-uncached-tokens`` is chosen from);
* ``kernels``: the Triton kernels against PyTorch's SDPA on a CUDA GPU, and the decode tile-config sweep
  (``kernel_sweep``, on ``kernel_inputs``).

``python -m kvserve.bench.kernel_compile`` compiles every kernel variant for a GPU on a machine without one.

``kvserve.bench.report`` holds what they share for timing and reporting.
"""

# module: the name with "_" for "-"
BENCHES = ("offline", "serve", "transfer", "cuda_ipc", "kv-curve", "tiers", "ring", "load", "kernels", "sampling",
           "tracing", "peer", "tp", "priority", "disagg", "tenants")
