"""cuda_ipc hand-off on a GPU: a second process writes a 2,048-token prompt's KV into an exported pool.

    kvserve bench cuda_ipc [--tokens 2048] [--repeats 20]

The KV has Qwen2-0.5B's shape (24 layers, 2 KV heads x 64, bfloat16). An owner process allocates the
pool and exports its handle; this process, which has not used CUDA before, opens it once (what a
prefill worker does with a decode worker's pool) and times the per-layer stores of K and V into the
destination slots, against a plain device copy of the same bytes. ``kvserve bench serve --device cuda``
runs the same measurement with its model's KV shape.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import torch

from kvstore import KVCacheSpec

QWEN2_05B = KVCacheSpec(num_layers=24, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)

# The pool's owner: allocate, print the handle, hold the pool until told to go.
OWNER = textwrap.dedent(
    """
    import json, sys, torch
    from kvstore import KVCache, KVCacheSpec
    from kvstore.ipc_pool import export_cuda_ipc
    fields = json.loads(sys.argv[1])
    fields["dtype"] = getattr(torch, fields["dtype"])
    pool = KVCache(KVCacheSpec(**fields), int(sys.argv[2]), "cuda")
    print(export_cuda_ipc(pool).decode(), flush=True)
    sys.stdin.readline()
    """
)


@dataclass(frozen=True)
class HandOff:
    """One prompt's KV written into another process's pool: ``hand_off_ms`` (the per-layer stores through
    the opened handle) against ``copy_ms`` (one device copy of as many bytes in this process)."""

    num_tokens: int
    nbytes: int
    hand_off_ms: float
    copy_ms: float


def spec_json(spec: KVCacheSpec) -> str:
    return json.dumps({"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                       "block_size": spec.block_size, "dtype": str(spec.dtype).removeprefix("torch."),
                       "kv_cache_dtype": spec.kv_cache_dtype})  # fmt: skip


def measure_hand_off(spec: KVCacheSpec, num_tokens: int, repeats: int = 20) -> HandOff:
    """Start an owner process holding a pool of ``spec``, open its exported handle here and time writing
    ``num_tokens`` tokens' K and V of every layer into scattered blocks of it: the mean of ``repeats``
    back-to-back runs after one warm-up, timed with CUDA events."""
    num_blocks = -(-num_tokens // spec.block_size) + 16
    owner = subprocess.Popen([sys.executable, "-c", OWNER, spec_json(spec), str(num_blocks)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        handle = owner.stdout.readline().strip().encode()
        if not handle:
            raise RuntimeError(f"the pool's owner process exited ({owner.wait()}) before exporting a handle")
        return _time_stores(spec, num_blocks, handle, num_tokens, repeats)
    finally:
        owner.stdin.write("done\n")
        owner.stdin.flush()
        owner.wait(timeout=30)


def _time_stores(spec: KVCacheSpec, num_blocks: int, handle: bytes, num_tokens: int, repeats: int) -> HandOff:
    import kvkernels
    from kvstore.ipc_pool import open_cuda_ipc_pool

    remote = open_cuda_ipc_pool(spec, num_blocks, handle)
    k = torch.randn(num_tokens, spec.num_kv_heads, spec.head_dim, device="cuda").to(spec.dtype)
    v = torch.randn_like(k)
    blocks = torch.randperm(num_blocks, device="cuda")[: -(-num_tokens // spec.block_size)]
    slots = (blocks[:, None] * spec.block_size + torch.arange(spec.block_size, device="cuda")).flatten()[:num_tokens]

    def hand_off() -> None:
        for layer in remote.layers:
            kvkernels.store_kvcache(k, v, layer.k_cache, layer.v_cache, slots, k_scale=layer.k_scale,
                                  v_scale=layer.v_scale)  # fmt: skip

    nbytes = 2 * k.numel() * k.element_size() * spec.num_layers
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    hand_off_ms, copy_ms = (_mean_ms(fn, repeats) for fn in (hand_off, lambda: dst.copy_(src)))
    return HandOff(num_tokens, nbytes, hand_off_ms, copy_ms)


def _mean_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def format_hand_off(result: HandOff) -> str:
    rows = (("cuda_ipc hand-off", result.hand_off_ms), ("plain device copy", result.copy_ms))
    return "\n".join(f"{name:20} {ms * 1000:9.1f} us  {result.nbytes / ms / 1e6:8.1f} GB/s  "
                     f"({result.nbytes / 2**20:.1f} MiB, {result.num_tokens} tokens)" for name, ms in rows)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench cuda_ipc", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():  # leaves torch's CUDA state uninitialised
        print("kvserve bench cuda_ipc needs a CUDA device; skipped")
        return
    print(format_hand_off(measure_hand_off(QWEN2_05B, args.tokens, args.repeats)))


if __name__ == "__main__":
    main()
