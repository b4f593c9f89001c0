"""The KV pool's byte budget: what is left of a process's memory for KV once its weights are loaded.

On a CPU the pool takes a fixed 1 GiB unless ``kv_cache_memory_bytes`` says otherwise. On a GPU,
``gpu_memory_utilization`` is vLLM's: the fraction of the GPU's *total* memory this process may use, weights
and activations included, so that processes sharing a GPU each keep to their own share whichever starts
first. ``ModelRunner`` turns the budget into a number of blocks (``KVCacheSpec.num_blocks_for_bytes``).
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig

_DEFAULT_CPU_KV_BYTES = 1 << 30

# What a GPU process needs besides its weights and KV pool, kept out of the pool's budget:
# * the CUDA context, cuBLAS workspaces and loaded kernels, which torch's allocator does not count (about
#   0.5 GiB on a Hopper GPU with lazy module loading);
# * one step's activations, allocated after the pool: a prefill of ``max_num_batched_tokens`` tokens needs
#   under 100 KiB per token for models up to 8B parameters (hidden states, fused QKV and gate/up outputs;
#   logits only for the sampled rows), and the decode CUDA graphs' shared pool is the largest decode batch's
#   activations, far less. 256 KiB per token leaves a 2.5x margin: 1 GiB at the default 4,096 tokens.
CUDA_CONTEXT_BYTES = 768 << 20
ACTIVATION_BYTES_PER_TOKEN = 256 << 10


def default_kv_bytes(config: EngineConfig, device: torch.device) -> int:
    """The KV pool's byte budget when ``config`` sets no ``num_blocks``, asked once the weights are loaded."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        headroom = CUDA_CONTEXT_BYTES + config.max_num_batched_tokens * ACTIVATION_BYTES_PER_TOKEN
        used = torch.cuda.memory_reserved(device)  # the weights (and load-time buffers the allocator kept)
        return kv_cache_budget(total, free, config.gpu_memory_utilization, used, headroom)
    return _DEFAULT_CPU_KV_BYTES


def kv_cache_budget(total: int, free: int, utilization: float, used: int, headroom: int) -> int:
    """Bytes for the KV pool of a process that may use ``utilization`` of a GPU's ``total`` bytes, holds
    ``used`` bytes already (its weights) and needs ``headroom`` more besides the pool (see above).

    Raises ``ValueError`` when that leaves nothing, or when the pool would not fit in the ``free`` bytes the
    GPU has now (other processes on it use more than the rest of its memory).
    """
    allowed = int(total * utilization)
    budget = allowed - used - headroom
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no room for the KV cache: {_gib(allowed)} of the GPU's "
            f"{_gib(total)}, less {_gib(used)} this process holds (weights) and {_gib(headroom)} kept for "
            "activations and the CUDA context; raise gpu_memory_utilization or set kv_cache_memory_bytes"
        )
    if budget > free:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for a KV cache of {_gib(budget)} but the GPU has only "
            f"{_gib(free)} free ({_gib(total - free)} of {_gib(total)} in use, this process's {_gib(used)} "
            "included): lower gpu_memory_utilization here or in the other processes on this GPU"
        )
    return budget


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
