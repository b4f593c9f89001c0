"""cuda_ipc hand-off on a GPU: a second process writes a 2,048-token prompt's KV into an exported pool.

    kvserve bench cuda_ipc [--tokens 2048] [--repeats 20]

The KV has Qwen2-0.5B's shape (24 layers, 2 KV heads x 64, bfloat16). The owner process allocates
the pool and exports its handle; this process opens it once and times the per-layer stores of K and V
into the destination slots (what a prefill worker does), against a plain device copy of the same bytes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

import torch

SPEC = {"num_layers": 24, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}

OWNER = textwrap.dedent(
    """
    import sys, torch
    from kvstore import KVCache, KVCacheSpec
    from kvstore.transfer import export_cuda_ipc
    spec = KVCacheSpec(dtype=torch.bfloat16, **{spec})
    pool = KVCache(spec, {num_blocks}, "cuda")
    print(export_cuda_ipc(pool).decode(), flush=True)
    sys.stdin.readline()
    """
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvserve bench cuda_ipc", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kvserve bench cuda_ipc needs a CUDA device; skipped")
        return

    import kernels
    from kvstore import KVCacheSpec
    from kvstore.transfer import open_cuda_ipc_pool

    spec = KVCacheSpec(dtype=torch.bfloat16, **SPEC)
    num_blocks = args.tokens // spec.block_size + 16
    script = OWNER.format(spec=SPEC, num_blocks=num_blocks)
    owner = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        handle = owner.stdout.readline().strip().encode()
        remote = open_cuda_ipc_pool(spec, num_blocks, handle)
        k = torch.randn(args.tokens, spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        perm = torch.randperm(num_blocks - 16, device="cuda")[: args.tokens // spec.block_size]
        slots = (perm[:, None] * spec.block_size + torch.arange(spec.block_size, device="cuda")).flatten()

        def hand_off():
            for layer in remote.layers:
                kernels.store_kvcache(k, v, layer.k_cache, layer.v_cache, slots)

        nbytes = 2 * k.numel() * k.element_size() * spec.num_layers
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        for name, fn in (("cuda_ipc hand-off", hand_off), ("plain device copy", lambda: dst.copy_(src))):
            fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.repeats):
                fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / args.repeats
            print(f"{name:20} {ms * 1000:9.1f} us  {nbytes / ms / 1e6:8.1f} GB/s  ({nbytes / 2**20:.1f} MiB)")
    finally:
        owner.stdin.write("done\n")
        owner.stdin.flush()
        owner.wait(timeout=30)


if __name__ == "__main__":
    main()
