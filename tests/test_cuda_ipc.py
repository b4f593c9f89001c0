"""cuda_ipc: a second real process opens the decode pool's exported handle and writes KV into its blocks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.gpu

OWNER = textwrap.dedent(
    """
    import sys, torch
    from kvstore import KVCache, KVCacheSpec
    from kvstore.transfer import checksum_blocks, export_cuda_ipc
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    pool = KVCache(spec, 64, "cuda")
    print(export_cuda_ipc(pool).decode(), flush=True)
    sys.stdin.readline()  # the writer is done
    torch.cuda.synchronize()
    layer = pool.layers[3]
    ok = bool((layer.k_cache[[5, 9]] == 1.5).all()) and bool((layer.v_cache[[5, 9]] == -2.0).all())
    print("written" if ok else "missing", checksum_blocks(pool, [5, 9]), flush=True)
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_second_process_writes_into_exported_pool():
    import kernels
    from kvstore import KVCacheSpec
    from kvstore.transfer import checksum_blocks, open_cuda_ipc_pool

    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        handle = owner.stdout.readline().strip().encode()
        spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
        remote = open_cuda_ipc_pool(spec, 64, handle)
        k = torch.full((32, 2, 64), 1.5, dtype=torch.bfloat16, device="cuda")
        v = torch.full_like(k, -2.0)
        slots = torch.cat([torch.arange(5 * 16, 6 * 16), torch.arange(9 * 16, 10 * 16)]).cuda()
        layer = remote.layers[3]
        kernels.store_kvcache(k, v, layer.k_cache, layer.v_cache, slots)
        torch.cuda.synchronize()
        mine = checksum_blocks(remote, [5, 9])
        owner.stdin.write("done\n")
        owner.stdin.flush()
        status, theirs = owner.stdout.readline().split()
        assert status == "written" and theirs == mine
    finally:
        owner.kill()
        owner.wait()
