"""cuda_ipc: a second real process opens the decode pool's exported handle and writes KV into its blocks.

The opener may be a process that has never used CUDA (a prefill worker opens pools on its event-loop
thread; ``kvserve bench cuda_ipc`` opens one first thing): opening must set CUDA up itself, not crash.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from service_utils import TEST_SECURITY

pytestmark = pytest.mark.gpu

OWNER = textwrap.dedent(
    """
    import sys, torch
    from kvstore import KVCache, KVCacheSpec
    from transfer.blocks import checksum_blocks
    from kvstore.ipc_pool import export_cuda_ipc
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


def test_second_process_writes_into_exported_pool():
    import kvkernels
    from kvstore import KVCacheSpec
    from protos.kvserve.v1 import kvserve_pb2 as pb
    from transfer.cuda_ipc import CudaIpcTransport
    from transfer.interface import Origin

    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        handle = owner.stdout.readline().strip().encode()
        spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
        dest = pb.KVDestination(backend="cuda_ipc", worker_id="decode-0", num_blocks=64, cuda_ipc_handle=handle)
        transport = CudaIpcTransport.open(dest, Origin(spec, "fp", "prefill-0", TEST_SECURITY))
        remote = transport.pool
        k = torch.full((32, 2, 64), 1.5, dtype=torch.bfloat16, device="cuda")
        v = torch.full_like(k, -2.0)
        slots = torch.cat([torch.arange(5 * 16, 6 * 16), torch.arange(9 * 16, 10 * 16)]).cuda()
        layer = remote.layers[3]
        kvkernels.store_kvcache(k, v, layer.k_cache, layer.v_cache, slots)
        torch.cuda.synchronize()
        mine = asyncio.run(transport.finish("r", [5, 9], transport.take(remote, [5, 9])))
        owner.stdin.write("done\n")
        owner.stdin.flush()
        status, theirs = owner.stdout.readline().split()
        assert status == "written" and theirs == mine
    finally:
        owner.kill()
        owner.wait()


# A process that has never touched CUDA: opens the handle (argv), prints the bytes of blocks 5 and 9 as it
# reads them through the mapping, then writes K=1.5, V=-2.0 into layer 3's blocks 20 and 21.
FRESH_OPENER = textwrap.dedent(
    """
    import sys, torch
    assert not torch.cuda.is_initialized()
    from kvstore import KVCacheSpec
    from transfer.blocks import read_blocks
    from kvstore.ipc_pool import open_cuda_ipc_pool
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    remote = open_cuda_ipc_pool(spec, 64, sys.argv[1].encode())
    print(read_blocks(remote, [5, 9]).hex(), flush=True)
    layer = remote.layers[3]
    layer.k_cache[[20, 21]] = 1.5
    layer.v_cache[[20, 21]] = -2.0
    torch.cuda.synchronize()
    print("written", flush=True)
    """
)
REPO = Path(__file__).resolve().parents[2]


def test_fresh_process_opens_exported_pool():
    from kvstore import KVCache, KVCacheSpec
    from kvstore.ipc_pool import export_cuda_ipc
    from transfer.blocks import read_blocks

    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    written = torch.randint(0, 256, (spec.total_bytes(64),), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(0))  # fmt: skip
    pool = KVCache(spec, 64, "cuda")
    pool.buffer.copy_(written)
    torch.cuda.synchronize()
    expected = read_blocks(KVCache(spec, 64, "cpu", buffer=written.clone()), [5, 9])  # the host copy's bytes
    opener = subprocess.run([sys.executable, "-c", FRESH_OPENER, export_cuda_ipc(pool).decode()], cwd=REPO,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert opener.returncode == 0, opener.stderr[-3000:]
    seen, status = opener.stdout.split()
    assert bytes.fromhex(seen) == expected
    assert status == "written"
    layer = pool.layers[3]
    assert bool((layer.k_cache[[20, 21]] == 1.5).all()) and bool((layer.v_cache[[20, 21]] == -2.0).all())
    host = KVCache(spec, 64, "cpu", buffer=written).layers[3]
    others = [b for b in range(64) if b not in (20, 21)]
    assert torch.equal(layer.k_cache[others].cpu().view(torch.int16), host.k_cache[others].view(torch.int16))


def test_bench_cuda_ipc_runs_in_a_fresh_process():
    bench = subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "cuda_ipc", "--tokens", "256",
                            "--repeats", "2"], cwd=REPO, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert bench.returncode == 0, bench.stderr[-3000:]
    assert "cuda_ipc hand-off" in bench.stdout and "256 tokens" in bench.stdout
