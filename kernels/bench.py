"""GPU benchmark of the Triton kernels: ``python -m kernels.bench [--quick] [--sweep]``.

* paged decode attention, bf16, block size 16, shuffled block tables, against
  ``scaled_dot_product_attention`` (flash backend, ``enable_gqa=True``) on the
  same K/V laid out contiguously ``[batch, kv_heads, ctx, head_dim]``, timed in
  the same run. Bandwidth is the K/V (and scale) bytes the kernel must read
  divided by its time;
* INT8 KV (``int8_v``, ``int8``) against bf16 at long context;
* ``store_kvcache`` of 16k tokens against a plain copy of the same bytes.

Times are medians from ``triton.testing.do_bench``, which clears the L2 cache
before every run. Needs CUDA; elsewhere it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import torch

BLOCK_SIZE = 16
DEVICE = "cuda"
DTYPE = torch.bfloat16  # the smoke test swaps in float16 (the CPU interpreter gets bf16 tl.dot wrong)
HEAD_LAYOUTS = ((32, 8, 128), (14, 2, 64))  # (query heads, kv heads, head_dim)


def _bench(fn) -> float:
    """Median microseconds of ``fn()``."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def _paged_copy(k: torch.Tensor, v: torch.Tensor, generator: torch.Generator):
    """Contiguous ``k, v [batch, kv_heads, ctx, d]`` -> paged caches behind a shuffled block table."""
    batch, num_kv_heads, ctx, head_dim = k.shape
    blocks_per_seq = ctx // BLOCK_SIZE
    order = torch.randperm(batch * blocks_per_seq, generator=generator).to(k.device)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    caches = []
    for contiguous in (k, v):
        # [batch, heads, ctx, d] -> [batch * blocks, block_size, heads, d], scattered to the shuffled blocks.
        pages = contiguous.permute(0, 2, 1, 3).reshape(batch * blocks_per_seq, BLOCK_SIZE, num_kv_heads, head_dim)
        cache = torch.empty(pages.shape, dtype=pages.dtype, device=pages.device)  # contiguous, like the pool
        cache[order] = pages
        caches.append(cache)
    return caches[0], caches[1], block_tables


def _quantize_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.reference import quantize_int8

    values, scales = quantize_int8(cache.flatten(0, 1))
    return values.view(cache.shape), scales.view(cache.shape[:3])


def _fits(num_bytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return num_bytes < 0.7 * free


def bench_decode(batches, contexts, layouts) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import kernels
    from kernels.decode_attention import _num_sms, choose_num_splits, default_tile_config

    def sdpa(q, k, v, scale):  # q [batch, q_heads, 1, d], k/v [batch, kv_heads, ctx, d]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    print("\npaged decode attention, bf16, block 16, shuffled block tables  (vs SDPA flash, contiguous KV)")
    print(f"{'heads':>8} {'d':>4} {'batch':>5} {'ctx':>5} {'splits':>6} {'ours us':>9} {'TB/s':>6} "
          f"{'sdpa us':>9} {'TB/s':>6} {'ours/sdpa':>9} {'max|diff|':>9}")  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    for num_q_heads, num_kv_heads, head_dim in layouts:
        for batch in batches:
            for ctx in contexts:
                kv_bytes = 2 * batch * num_kv_heads * ctx * head_dim * 2  # K + V, bf16
                if not _fits(2 * kv_bytes + 2 * 256 * 2**20):  # paged copy + contiguous copy + L2 flush
                    print(f"{num_q_heads:>3}:{num_kv_heads:<4} {head_dim:>4} {batch:>5} {ctx:>5}  skipped: memory")
                    continue
                q = torch.randn(batch, num_q_heads, head_dim, generator=generator).to(DEVICE, DTYPE)
                k = torch.randn(batch, num_kv_heads, ctx, head_dim, device=DEVICE, dtype=DTYPE)
                v = torch.randn_like(k)
                k_cache, v_cache, block_tables = _paged_copy(k, v, generator)
                seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
                scale = head_dim**-0.5
                ours = functools.partial(
                    kernels.paged_decode_attention, q, k_cache, v_cache, block_tables, seq_lens, scale
                )
                theirs = functools.partial(sdpa, q[:, :, None, :], k, v, scale)
                ours_us = _bench(ours)
                tile_tokens = default_tile_config(head_dim, False)[0]
                splits = choose_num_splits(batch, num_kv_heads, ctx, tile_tokens, _num_sms(q.device))
                try:
                    sdpa_us = _bench(theirs)
                    diff = (ours().float() - theirs()[:, :, 0].float()).abs().max().item()
                    sdpa_cols = f"{sdpa_us:9.1f} {kv_bytes / sdpa_us / 1e6:6.2f} {ours_us / sdpa_us:9.2f} {diff:9.4f}"
                except RuntimeError as error:  # flash backend unavailable for this shape / build
                    sdpa_cols = f"{'n/a':>9}  ({str(error).splitlines()[0][:60]})"
                print(f"{num_q_heads:>3}:{num_kv_heads:<4} {head_dim:>4} {batch:>5} {ctx:>5} {splits:>6} "
                      f"{ours_us:9.1f} {kv_bytes / ours_us / 1e6:6.2f} {sdpa_cols}")  # fmt: skip
                del q, k, v, k_cache, v_cache, ours, theirs
                torch.cuda.empty_cache()


def bench_int8(batch: int, ctx: int, layouts) -> None:
    import kernels

    print(f"\nINT8 KV vs bf16 decode, batch {batch}, context {ctx}")
    print(f"{'heads':>8} {'d':>4} {'kv dtype':>8} {'us':>9} {'TB/s':>6} {'vs bf16':>8}")
    generator = torch.Generator().manual_seed(1)
    for num_q_heads, num_kv_heads, head_dim in layouts:
        tokens = batch * ctx
        if not _fits(4 * tokens * num_kv_heads * head_dim * 2 + 256 * 2**20):
            print(f"{num_q_heads:>3}:{num_kv_heads:<4} {head_dim:>4}  skipped: memory")
            continue
        q = torch.randn(batch, num_q_heads, head_dim, generator=generator).to(DEVICE, DTYPE)
        k = torch.randn(batch, num_kv_heads, ctx, head_dim, device=DEVICE, dtype=DTYPE)
        k_cache, v_cache, block_tables = _paged_copy(k, torch.randn_like(k), generator)
        del k
        k_int8, k_scale = _quantize_cache(k_cache)
        v_int8, v_scale = _quantize_cache(v_cache)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
        per_token = num_kv_heads * head_dim
        variants = {  # name -> (k, v, k_scale, v_scale, bytes read per token)
            "bf16": (k_cache, v_cache, None, None, per_token * 4),
            "int8_v": (k_cache, v_int8, None, v_scale, per_token * 3 + num_kv_heads * 4),
            "int8": (k_int8, v_int8, k_scale, v_scale, per_token * 2 + num_kv_heads * 8),
        }
        bf16_us = None
        for name, (kc, vc, ks, vs, token_bytes) in variants.items():
            us = _bench(functools.partial(kernels.paged_decode_attention, q, kc, vc, block_tables, seq_lens,
                                          head_dim**-0.5, k_scale=ks, v_scale=vs))  # fmt: skip
            bf16_us = bf16_us or us
            print(f"{num_q_heads:>3}:{num_kv_heads:<4} {head_dim:>4} {name:>8} {us:9.1f} "
                  f"{tokens * token_bytes / us / 1e6:6.2f} {bf16_us / us:7.2f}x")  # fmt: skip
        del q, k_cache, v_cache, k_int8, v_int8, variants
        torch.cuda.empty_cache()


def bench_store(num_tokens: int = 16384, num_kv_heads: int = 8, head_dim: int = 128) -> None:
    import kernels

    print(f"\nstore_kvcache, {num_tokens} tokens, {num_kv_heads} kv heads, d {head_dim}, bf16 (vs a plain copy)")
    generator = torch.Generator().manual_seed(2)
    num_blocks = num_tokens // BLOCK_SIZE + 64
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE, DTYPE)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=generator)[:num_tokens].to(DEVICE)
    moved = 2 * 2 * k.numel() * k.element_size()  # K and V, read once and written once
    source = torch.empty(2 * k.numel(), dtype=DTYPE, device=DEVICE)
    destination = torch.empty_like(source)
    copy_us = _bench(lambda: destination.copy_(source))
    print(f"{'variant':>14} {'us':>8} {'TB/s':>6} {'vs copy':>8}")
    print(f"{'tensor copy':>14} {copy_us:8.1f} {moved / copy_us / 1e6:6.2f} {1.0:7.2f}x")
    for name in ("bf16", "int8_v", "int8"):
        k_cache = torch.empty(shape, dtype=torch.int8 if name == "int8" else DTYPE, device=DEVICE)
        v_cache = torch.empty(shape, dtype=torch.int8 if name != "bf16" else DTYPE, device=DEVICE)
        k_scale = torch.empty(shape[:3], device=DEVICE) if name == "int8" else None
        v_scale = torch.empty(shape[:3], device=DEVICE) if name != "bf16" else None
        us = _bench(functools.partial(kernels.store_kvcache, k, v, k_cache, v_cache, slots, k_scale=k_scale,
                                      v_scale=v_scale))  # fmt: skip
        print(f"{'store ' + name:>14} {us:8.1f} {moved / us / 1e6:6.2f} {copy_us / us:7.2f}x"
              + ("" if name == "bf16" else "  (TB/s counts bf16 bytes)"))  # fmt: skip


def bench_sweep(batch: int, ctx: int, num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128) -> None:
    """Time every (tile tokens, warps, stages, splits) of a small grid on one shape; print the fastest first.

    For choosing ``decode_attention._CONFIGS`` from measurements: one GPU run
    both reports the shipped config and shows what the alternatives give.
    """
    from kernels.decode_attention import _num_sms, choose_num_splits, default_tile_config, paged_decode_attention

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(batch, num_q_heads, head_dim, generator=generator).to(DEVICE, DTYPE)
    k = torch.randn(batch, num_kv_heads, ctx, head_dim, device=DEVICE, dtype=DTYPE)
    k_cache, v_cache, block_tables = _paged_copy(k, torch.randn_like(k), generator)
    del k
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    kv_bytes = 2 * batch * num_kv_heads * ctx * head_dim * 2
    shipped = default_tile_config(head_dim, False)
    shipped_splits = choose_num_splits(batch, num_kv_heads, ctx, shipped[0], _num_sms(q.device))
    results = []
    grid = itertools.product((32, 64, 128), (4, 8), (2, 3), sorted({1, 2, 4, shipped_splits}))
    for tile, warps, stages, splits in grid:
        run = functools.partial(paged_decode_attention, q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5,
                                num_splits=splits, tile_config=(tile, warps, stages))  # fmt: skip
        try:
            results.append((_bench(run), tile, warps, stages, splits))
        except Exception as error:  # e.g. out of shared memory for this config
            print(f"  tile {tile} warps {warps} stages {stages} splits {splits}: {type(error).__name__}")
    results.sort()
    print(f"\ndecode config sweep, bf16, batch {batch}, ctx {ctx}, {num_q_heads}:{num_kv_heads}, d {head_dim} "
          f"(shipped: tile/warps/stages {shipped}, splits {shipped_splits})")  # fmt: skip
    print(f"{'tile':>5} {'warps':>5} {'stages':>6} {'splits':>6} {'us':>8} {'TB/s':>6}")
    for us, tile, warps, stages, splits in results[:8]:
        mark = "  <- shipped" if ((tile, warps, stages), splits) == (shipped, shipped_splits) else ""
        print(f"{tile:>5} {warps:>5} {stages:>6} {splits:>6} {us:8.1f} {kv_bytes / us / 1e6:6.2f}{mark}")
    mine = [r for r in results if (r[1:4], r[4]) == (shipped, shipped_splits)]
    if mine:
        print(f"shipped config: {mine[0][0]:.1f} us, rank {results.index(mine[0]) + 1} of {len(results)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark the Triton kernels on a CUDA GPU.")
    parser.add_argument("--quick", action="store_true", help="a few shapes only (about 20 seconds)")
    parser.add_argument("--sweep", action="store_true", help="also sweep decode tile configs at batch 64, ctx 2048")
    options = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels.bench needs a CUDA GPU; none is available here, so there is nothing to measure.")
        return 0
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    if options.quick:
        bench_decode(batches=(1, 64), contexts=(2048,), layouts=HEAD_LAYOUTS[:1])
        bench_int8(batch=64, ctx=8192, layouts=HEAD_LAYOUTS[:1])
        bench_store()
    else:
        bench_decode(batches=(1, 8, 64, 256), contexts=(512, 2048, 8192), layouts=HEAD_LAYOUTS)
        bench_int8(batch=64, ctx=8192, layouts=HEAD_LAYOUTS)
        bench_store()
    if options.sweep:
        bench_sweep(batch=64, ctx=2048)
    return 0


if __name__ == "__main__":
    sys.exit(main())
