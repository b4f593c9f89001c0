"""The decode tile-config sweep of ``python -m kvserve.bench.kernels --sweep``: every config of ``SWEEP_GRID`` on each
of ``SWEEP_SHAPES`` (bf16, the INT8 caches, d64), timed as CUDA-graph replays (``do_bench_cudagraph``); it
prints the INT8 caches' speed against bf16 and the entries of ``decode_config._MEASURED_CONFIGS`` for this
GPU, ready to paste.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch

from kvserve.bench import kernel_inputs as inputs

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
    from kvkernels.decode_attention import paged_decode_attention
    from kvkernels.decode_config import choose_num_splits, count_sms, default_tile_config

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(batch, num_q_heads, head_dim, generator=generator).to(inputs.DEVICE, inputs.DTYPE)
    k = torch.randn(batch, num_kv_heads, ctx, head_dim, device=inputs.DEVICE, dtype=inputs.DTYPE)
    k_cache, v_cache, block_tables = inputs.paged_copy(k, torch.randn_like(k), generator)
    del k
    k_scale = v_scale = None
    if kv_dtype == "int8":
        k_cache, k_scale = inputs.quantize_cache(k_cache)
    if kv_dtype in ("int8", "int8_v"):
        v_cache, v_scale = inputs.quantize_cache(v_cache)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=inputs.DEVICE)
    kv_bytes = sum(t.numel() * t.element_size() for t in (k_cache, v_cache, k_scale, v_scale) if t is not None)
    num_sms = count_sms(q.device)
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
    from kvkernels.tiles import padded

    by_key: dict[tuple[int, str], list[SweepResult]] = {}
    for r in results:
        if r.best() is not None:
            by_key.setdefault((padded(r.shape[4]), r.kv_dtype), []).append(r)
    print(f"\nmeasured entries for _MEASURED_CONFIGS in kvkernels/decode_config.py ({gpu}):")
    print(f'    "{gpu}": {{')
    for (head_dim, kv_dtype), sweeps in by_key.items():
        config = min(SWEEP_GRID, key=lambda c, sweeps=sweeps: _mean_slowdown(c, sweeps))
        if _mean_slowdown(config, sweeps) == float("inf"):
            continue
        for r in sweeps:
            batch, ctx, num_q_heads, num_kv_heads, _ = r.shape
            shipped_us = r.engine_time(r.shipped)
            shipped = "n/a" if shipped_us is None else f"{shipped_us:.1f} us"
            print(f"        # kvserve.bench.kernels --sweep, batch {batch}, ctx {ctx}, {num_q_heads}:{num_kv_heads}: "
                  f"{r.engine_time(config):.1f} us, against {shipped} for {r.shipped}.")  # fmt: skip
        print(f'        ({head_dim}, "{kv_dtype}"): {config},')
    print("    },")


def run_sweep(gpu: str) -> list[SweepResult]:
    """Sweep every shape of ``SWEEP_SHAPES``, printing each INT8 ratio as soon as it is known (a time limit on
    the run may cut the last sweeps), then the table entries for ``gpu``."""
    results = []
    for shape in SWEEP_SHAPES:
        results.append(bench_sweep(*shape))
        if results[-1].kv_dtype != "auto":
            print_int8_ratios([r for r in results if r.kv_dtype == "auto"] + results[-1:])
    print_table_entries(results, gpu)
    return results
