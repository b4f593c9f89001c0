"""GPU benchmark of the Triton kernels: ``python -m kvserve.bench.kernels [--quick] [--sweep | --sweep-only]``.

* paged decode attention, bf16, block size 16, shuffled block tables, against
  ``scaled_dot_product_attention`` (flash backend, ``enable_gqa=True``) on the
  same K/V laid out contiguously ``[batch, kv_heads, ctx, head_dim]``, timed in
  the same run. Bandwidth is the K/V (and scale) bytes the kernel must read
  divided by its time;
* INT8 KV (``int8_v``, ``int8``) against bf16 at long context;
* ``store_kvcache`` of 16k tokens against a plain copy of the same bytes;
* ``--sweep``: every decode tile config of a small grid on a few shapes (``kvserve.bench.kernel_sweep``).

Times are medians from ``triton.testing.do_bench``, which clears the L2 cache
before every run. Without CUDA it measures the CPU's decode attention instead: the C kernel
(``kvkernels.cpu_decode``) against the PyTorch reference, float32, the two sides alternated, each call
after a pass over 64 MiB that pushes the pool out of the caches (as a decode step's weights do).
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from kvserve.bench import kernel_inputs as inputs
from kvserve.bench.kernel_sweep import run_sweep

HEAD_LAYOUTS = ((32, 8, 128), (14, 2, 64))  # (query heads, kv heads, head_dim)


def _bench(fn) -> float:
    """Median microseconds of ``fn()``."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def _fits(num_bytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return num_bytes < 0.7 * free


def bench_decode(batches, contexts, layouts) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import kvkernels
    from kvkernels.decode_config import choose_num_splits, count_sms, default_tile_config

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
                q = torch.randn(batch, num_q_heads, head_dim, generator=generator).to(inputs.DEVICE, inputs.DTYPE)
                k = torch.randn(batch, num_kv_heads, ctx, head_dim, device=inputs.DEVICE, dtype=inputs.DTYPE)
                v = torch.randn_like(k)
                k_cache, v_cache, block_tables = inputs.paged_copy(k, v, generator)
                seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=inputs.DEVICE)
                scale = head_dim**-0.5
                ours = functools.partial(
                    kvkernels.paged_decode_attention, q, k_cache, v_cache, block_tables, seq_lens, scale
                )
                theirs = functools.partial(sdpa, q[:, :, None, :], k, v, scale)
                ours_us = _bench(ours)
                tile_tokens = default_tile_config(head_dim, "auto", q.device)[0]
                splits = choose_num_splits(batch, num_kv_heads, ctx, tile_tokens, count_sms(q.device))
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
    import kvkernels

    print(f"\nINT8 KV vs bf16 decode, batch {batch}, context {ctx}")
    print(f"{'heads':>8} {'d':>4} {'kv dtype':>8} {'us':>9} {'TB/s':>6} {'vs bf16':>8}")
    generator = torch.Generator().manual_seed(1)
    for num_q_heads, num_kv_heads, head_dim in layouts:
        tokens = batch * ctx
        if not _fits(4 * tokens * num_kv_heads * head_dim * 2 + 256 * 2**20):
            print(f"{num_q_heads:>3}:{num_kv_heads:<4} {head_dim:>4}  skipped: memory")
            continue
        q = torch.randn(batch, num_q_heads, head_dim, generator=generator).to(inputs.DEVICE, inputs.DTYPE)
        k = torch.randn(batch, num_kv_heads, ctx, head_dim, device=inputs.DEVICE, dtype=inputs.DTYPE)
        k_cache, v_cache, block_tables = inputs.paged_copy(k, torch.randn_like(k), generator)
        del k
        k_int8, k_scale = inputs.quantize_cache(k_cache)
        v_int8, v_scale = inputs.quantize_cache(v_cache)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=inputs.DEVICE)
        per_token = num_kv_heads * head_dim
        variants = {  # name -> (k, v, k_scale, v_scale, bytes read per token)
            "bf16": (k_cache, v_cache, None, None, per_token * 4),
            "int8_v": (k_cache, v_int8, None, v_scale, per_token * 3 + num_kv_heads * 4),
            "int8": (k_int8, v_int8, k_scale, v_scale, per_token * 2 + num_kv_heads * 8),
        }
        bf16_us = None
        for name, (kc, vc, ks, vs, token_bytes) in variants.items():
            us = _bench(functools.partial(kvkernels.paged_decode_attention, q, kc, vc, block_tables, seq_lens,
                                          head_dim**-0.5, k_scale=ks, v_scale=vs))  # fmt: skip
            bf16_us = bf16_us or us
            print(f"{num_q_heads:>3}:{num_kv_heads:<4} {head_dim:>4} {name:>8} {us:9.1f} "
                  f"{tokens * token_bytes / us / 1e6:6.2f} {bf16_us / us:7.2f}x")  # fmt: skip
        del q, k_cache, v_cache, k_int8, v_int8, variants
        torch.cuda.empty_cache()


def bench_store(num_tokens: int = 16384, num_kv_heads: int = 8, head_dim: int = 128) -> None:
    import kvkernels

    print(f"\nstore_kvcache, {num_tokens} tokens, {num_kv_heads} kv heads, d {head_dim}, bf16 (vs a plain copy)")
    generator = torch.Generator().manual_seed(2)
    num_blocks = num_tokens // inputs.BLOCK_SIZE + 64
    shape = (num_blocks, inputs.BLOCK_SIZE, num_kv_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(inputs.DEVICE, inputs.DTYPE)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * inputs.BLOCK_SIZE, generator=generator)[:num_tokens].to(inputs.DEVICE)
    moved = 2 * 2 * k.numel() * k.element_size()  # K and V, read once and written once
    source = torch.empty(2 * k.numel(), dtype=inputs.DTYPE, device=inputs.DEVICE)
    destination = torch.empty_like(source)
    copy_us = _bench(lambda: destination.copy_(source))
    print(f"{'variant':>14} {'us':>8} {'TB/s':>6} {'vs copy':>8}")
    print(f"{'tensor copy':>14} {copy_us:8.1f} {moved / copy_us / 1e6:6.2f} {1.0:7.2f}x")
    for name in ("bf16", "int8_v", "int8"):
        k_cache = torch.empty(shape, dtype=torch.int8 if name == "int8" else inputs.DTYPE, device=inputs.DEVICE)
        v_cache = torch.empty(shape, dtype=torch.int8 if name != "bf16" else inputs.DTYPE, device=inputs.DEVICE)
        k_scale = torch.empty(shape[:3], device=inputs.DEVICE) if name == "int8" else None
        v_scale = torch.empty(shape[:3], device=inputs.DEVICE) if name != "bf16" else None
        us = _bench(functools.partial(kvkernels.store_kvcache, k, v, k_cache, v_cache, slots, k_scale=k_scale,
                                      v_scale=v_scale))  # fmt: skip
        print(f"{'store ' + name:>14} {us:8.1f} {moved / us / 1e6:6.2f} {copy_us / us:7.2f}x"
              + ("" if name == "bf16" else "  (TB/s counts bf16 bytes)"))  # fmt: skip


def bench_cpu_decode(batches, contexts, rounds: int = 20) -> None:
    """The C decode kernel against the reference on this CPU (``kvserve.bench.kernels`` without CUDA)."""
    import statistics
    import time

    from engine.model_runner import prepare_cpu_decode
    from kvkernels import cpu_decode, reference

    if not prepare_cpu_decode():
        print("the C decode kernel cannot be built here (no C compiler, or KVSERVE_CPU_KERNELS=0)")
        return
    print(f"\npaged decode attention on the CPU, float32, block 16, shuffled block tables, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'heads':>8} {'d':>4} {'batch':>5} {'ctx':>5} {'C us':>8} {'GB/s':>6} {'reference us':>12} "
          f"{'GB/s':>6} {'C/reference':>11}")  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    evict = torch.empty(16 << 20)  # 64 MiB
    for num_q_heads, num_kv_heads, head_dim in ((9, 3, 64), *HEAD_LAYOUTS[:1]):
        for batch in batches:
            for ctx in contexts:
                k = torch.randn(batch, num_kv_heads, ctx, head_dim, generator=generator)
                k_cache, v_cache, block_tables = inputs.paged_copy(k, torch.randn_like(k), generator)
                q = torch.randn(batch, num_q_heads, head_dim, generator=generator)
                seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
                args = (q, k_cache, v_cache, block_tables, seq_lens, head_dim**-0.5)
                sides = {"c": cpu_decode.paged_decode_attention, "reference": reference.paged_decode_attention}
                times = {name: [] for name in sides}
                for _ in range(rounds):
                    for name, fn in sides.items():
                        evict.fill_(1.0)
                        began = time.perf_counter()
                        fn(*args)
                        times[name].append(time.perf_counter() - began)
                c_us, ref_us = (statistics.median(times[name]) * 1e6 for name in ("c", "reference"))
                kv_bytes = 2 * batch * num_kv_heads * ctx * head_dim * 4
                print(f"{num_q_heads:>3}:{num_kv_heads:<4} {head_dim:>4} {batch:>5} {ctx:>5} {c_us:8.0f} "
                      f"{kv_bytes / c_us / 1e3:6.1f} {ref_us:12.0f} {kv_bytes / ref_us / 1e3:6.1f} "
                      f"{c_us / ref_us:11.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark the Triton kernels on a CUDA GPU.")
    parser.add_argument("--quick", action="store_true", help="a few shapes only (about 20 seconds)")
    parser.add_argument("--sweep", action="store_true", help="also sweep decode tile configs (kernel_sweep)")
    parser.add_argument("--sweep-only", action="store_true", help="only the sweep, not the tables")
    options = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU here: the Triton kernels are not measured; the CPU's decode attention is")
        bench_cpu_decode(batches=(4, 16) if options.quick else (1, 4, 16, 64), contexts=(256, 1024))
        return 0
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    if options.quick and not options.sweep_only:
        bench_decode(batches=(1, 64), contexts=(2048,), layouts=HEAD_LAYOUTS[:1])
        bench_int8(batch=64, ctx=8192, layouts=HEAD_LAYOUTS[:1])
        bench_store()
    elif not options.sweep_only:
        bench_decode(batches=(1, 8, 64, 256), contexts=(512, 2048, 8192), layouts=HEAD_LAYOUTS)
        bench_int8(batch=64, ctx=8192, layouts=HEAD_LAYOUTS)
        bench_store()
    if options.sweep or options.sweep_only:
        run_sweep(torch.cuda.get_device_name())
    return 0


if __name__ == "__main__":
    sys.exit(main())
