"""GPU benchmark of the Triton kernels: ``python -m kernels.bench [--quick] [--sweep | --sweep-only]``.

* paged decode attention, bf16, block size 16, shuffled block tables, against
  ``scaled_dot_product_attention`` (flash backend, ``enable_gqa=True``) on the
  same K/V laid out contiguously ``[batch, kv_heads, ctx, head_dim]``, timed in
  the same run. Bandwidth is the K/V (and scale) bytes the kernel must read
  divided by its time;
* INT8 KV (``int8_v``, ``int8``) against bf16 at long context;
* ``store_kvcache`` of 16k tokens against a plain copy of the same bytes;
* ``--sweep``: every decode tile config of a small grid on a few shapes (bf16, the INT8 caches, d64),
  timed as CUDA-graph replays; it prints the INT8 caches' speed against bf16 and the entries of
  ``decode_attention._MEASURED_CONFIGS`` for this GPU, ready to paste.

Times are medians from ``triton.testing.do_bench``, which clears the L2 cache
before every run (the sweep's: ``do_bench_cudagraph``). Needs CUDA; elsewhere it
says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from dataclasses import dataclass, field

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
                tile_tokens = default_tile_config(head_dim, "auto", q.device)[0]
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


# The sweep's shapes: (KV cache dtype, batch, ctx, query heads, kv heads, head_dim). bf16 d128 at ctx 8192 is
# what the INT8 caches are compared with (the target: int8_v >= 1.2x, int8 >= 1.4x its speed).
SWEEP_SHAPES = (
    ("auto", 64, 8192, 32, 8, 128),
    ("int8_v", 64, 8192, 32, 8, 128),
    ("int8", 64, 8192, 32, 8, 128),
    ("auto", 64, 2048, 32, 8, 128),  # where the H200's measured entry comes from; compiles nothing new
    ("auto", 64, 2048, 14, 2, 64),
)
SWEEP_GRID = tuple(itertools.product((32, 64, 128), (4, 8), (2, 3)))  # (tile tokens, warps, stages)
INT8_TARGETS = {"int8_v": 1.2, "int8": 1.4}


def _bench_graph(fn) -> float:
    """Median microseconds of ``fn()`` replayed in a CUDA graph: the kernels alone, no launch overhead (the
    engine replays its decode steps as graphs too). No L2 flush: the sweep's KV is far larger than L2."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=5, return_mode="median") * 1e3


Config = tuple[int, int, int]  # (tile tokens, warps, stages)


@dataclass
class SweepResult:
    """One shape's sweep: microseconds per (config, splits), and the splits the heuristic picks per config."""

    kv_dtype: str
    shape: tuple[int, int, int, int, int]  # batch, ctx, query heads, kv heads, head_dim
    shipped: Config
    times: dict[tuple[Config, int], float] = field(default_factory=dict)
    heuristic_splits: dict[Config, int] = field(default_factory=dict)

    def engine_time(self, config: Config) -> float | None:
        """What the engine would get with ``config``: its time at the splits the heuristic picks."""
        return self.times.get((config, self.heuristic_splits.get(config)))

    def best(self) -> tuple[float, Config] | None:
        """The fastest config at the heuristic's splits, and its time."""
        timed = [(us, config) for config in self.heuristic_splits if (us := self.engine_time(config)) is not None]
        return min(timed, default=None)


def bench_sweep(kv_dtype: str, batch: int, ctx: int, num_q_heads: int = 32, num_kv_heads: int = 8,
                head_dim: int = 128) -> SweepResult:  # fmt: skip
    """Time every config of ``SWEEP_GRID`` with one split and with the heuristic's splits on one shape and KV
    cache dtype (``auto``: bf16); print the fastest first and where the shipped config ranks."""
    from kernels.decode_attention import _num_sms, choose_num_splits, default_tile_config, paged_decode_attention

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(batch, num_q_heads, head_dim, generator=generator).to(DEVICE, DTYPE)
    k = torch.randn(batch, num_kv_heads, ctx, head_dim, device=DEVICE, dtype=DTYPE)
    k_cache, v_cache, block_tables = _paged_copy(k, torch.randn_like(k), generator)
    del k
    k_scale = v_scale = None
    if kv_dtype == "int8":
        k_cache, k_scale = _quantize_cache(k_cache)
    if kv_dtype in ("int8", "int8_v"):
        v_cache, v_scale = _quantize_cache(v_cache)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    kv_bytes = sum(t.numel() * t.element_size() for t in (k_cache, v_cache, k_scale, v_scale) if t is not None)
    num_sms = _num_sms(q.device)
    result = SweepResult(kv_dtype, (batch, ctx, num_q_heads, num_kv_heads, head_dim),
                         shipped=default_tile_config(head_dim, kv_dtype, q.device))  # fmt: skip
    for config in SWEEP_GRID:
        result.heuristic_splits[config] = choose_num_splits(batch, num_kv_heads, ctx, config[0], num_sms)
        for splits in sorted({1, result.heuristic_splits[config]}):  # each is a kernel to compile
            run = functools.partial(paged_decode_attention, q, k_cache, v_cache, block_tables, seq_lens,
                                    head_dim**-0.5, k_scale=k_scale, v_scale=v_scale, num_splits=splits,
                                    tile_config=config)  # fmt: skip
            try:
                result.times[config, splits] = _bench_graph(run)
            except Exception as error:  # e.g. out of shared memory for this config
                print(f"  tile/warps/stages {config} splits {splits}: {type(error).__name__}")
    del q, k_cache, v_cache, k_scale, v_scale
    torch.cuda.empty_cache()

    name = "bf16" if kv_dtype == "auto" else kv_dtype
    print(f"\ndecode config sweep, {name}, batch {batch}, ctx {ctx}, {num_q_heads}:{num_kv_heads}, d {head_dim}, "
          f"CUDA-graph replay (shipped: tile/warps/stages {result.shipped})")  # fmt: skip
    print(f"{'tile':>5} {'warps':>5} {'stages':>6} {'splits':>6} {'us':>8} {'TB/s':>6}")
    for (config, splits), us in sorted(result.times.items(), key=lambda item: item[1])[:8]:
        mark = "  (the heuristic's splits)" if splits == result.heuristic_splits[config] else ""
        print(f"{config[0]:>5} {config[1]:>5} {config[2]:>6} {splits:>6} {us:8.1f} {kv_bytes / us / 1e6:6.2f}{mark}")
    engine_times = sorted(us for config in SWEEP_GRID if (us := result.engine_time(config)) is not None)
    shipped_us = result.engine_time(result.shipped)
    if shipped_us is not None:
        best_us, best_config = result.best()
        rank = engine_times.index(shipped_us) + 1
        print(f"shipped config at the heuristic's splits: {shipped_us:.1f} us, rank {rank} of {len(engine_times)}; "
              f"best: {best_config} {best_us:.1f} us")  # fmt: skip
    return result


def print_int8_ratios(results: list[SweepResult]) -> None:
    """INT8 speed against bf16 on the same shape, with the shipped configs and with the best ones."""
    bf16 = {r.shape: r for r in results if r.kv_dtype == "auto"}
    for r in results:
        reference = bf16.get(r.shape)
        if r.kv_dtype == "auto" or reference is None or r.best() is None or reference.best() is None:
            continue
        shipped, reference_shipped = r.engine_time(r.shipped), reference.engine_time(reference.shipped)
        shipped_ratio = f"{reference_shipped / shipped:.2f}x" if shipped and reference_shipped else "n/a"
        print(f"{r.kv_dtype} vs bf16, batch {r.shape[0]}, ctx {r.shape[1]}, {r.shape[2]}:{r.shape[3]}, "
              f"d {r.shape[4]}: shipped configs {shipped_ratio}, best configs "
              f"{reference.best()[0] / r.best()[0]:.2f}x (target {INT8_TARGETS[r.kv_dtype]}x)")  # fmt: skip


def _mean_slowdown(config: Config, sweeps: list[SweepResult]) -> float:
    """Mean over ``sweeps`` of ``config``'s time over the best time (inf where ``config`` has none)."""
    times = [r.engine_time(config) for r in sweeps]
    if None in times:
        return float("inf")
    return sum(us / r.best()[0] for us, r in zip(times, sweeps, strict=True)) / len(sweeps)


def print_table_entries(results: list[SweepResult], gpu: str) -> None:
    """``_MEASURED_CONFIGS`` entries for this GPU, ready to paste: per (head dim, KV cache dtype), the config
    with the lowest mean slowdown against each swept shape's best, at the heuristic's splits (as the engine
    runs it), with the figures that chose it."""
    from kernels.tiles import padded

    by_key: dict[tuple[int, str], list[SweepResult]] = {}
    for r in results:
        if r.best() is not None:
            by_key.setdefault((padded(r.shape[4]), r.kv_dtype), []).append(r)
    print(f"\nmeasured entries for _MEASURED_CONFIGS in kernels/decode_attention.py ({gpu}):")
    print(f'    "{gpu}": {{')
    for (head_dim, kv_dtype), sweeps in by_key.items():
        config = min(SWEEP_GRID, key=lambda c, sweeps=sweeps: _mean_slowdown(c, sweeps))
        if _mean_slowdown(config, sweeps) == float("inf"):
            continue
        for r in sweeps:
            batch, ctx, num_q_heads, num_kv_heads, _ = r.shape
            shipped_us = r.engine_time(r.shipped)
            shipped = "n/a" if shipped_us is None else f"{shipped_us:.1f} us"
            print(f"        # kernels.bench --sweep, batch {batch}, ctx {ctx}, {num_q_heads}:{num_kv_heads}: "
                  f"{r.engine_time(config):.1f} us, against {shipped} for {r.shipped}.")  # fmt: skip
        print(f'        ({head_dim}, "{kv_dtype}"): {config},')
    print("    },")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark the Triton kernels on a CUDA GPU.")
    parser.add_argument("--quick", action="store_true", help="a few shapes only (about 20 seconds)")
    parser.add_argument("--sweep", action="store_true", help="also sweep decode tile configs (SWEEP_SHAPES)")
    parser.add_argument("--sweep-only", action="store_true", help="only the sweep, not the tables")
    options = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels.bench needs a CUDA GPU; none is available here, so there is nothing to measure.")
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
        results = []
        for shape in SWEEP_SHAPES:
            results.append(bench_sweep(*shape))
            if results[-1].kv_dtype != "auto":  # printed at once: the step's time limit may cut the last sweeps
                print_int8_ratios([r for r in results if r.kv_dtype == "auto"] + results[-1:])
        print_table_entries(results, torch.cuda.get_device_name())
    return 0


if __name__ == "__main__":
    sys.exit(main())
