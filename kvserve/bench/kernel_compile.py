"""Compile every kernel variant for a GPU architecture on a machine without a GPU.

``python -m kvserve.bench.kernel_compile [--arch 90] [--jobs N]``.

Runs each host wrapper on empty CPU tensors with the launch intercepted, then
hands the exact launch (argument types, constexprs, launch options, and the
16-byte alignment Triton would see on a GPU) to ``triton.compile`` for
``--arch`` (default sm_90). Prints registers, register spills, shared memory
and how the global loads were lowered, and exits non-zero when a variant fails
to compile or spills registers. Variants compile side by side, one process per CPU
(``--jobs``): LLVM and ptxas use one core each. Uses Triton internals (``ASTSource``,
``GPUTarget``, ``JITFunction.run``), so it may need updating with Triton.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kvkernels import activation, decode_attention, norm, prefill_attention, rotary, sampling, store_kv

_POINTER_TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int8: "*i8",
                  torch.int32: "*i32", torch.int64: "*i64"}  # fmt: skip


def capture_launches(wrapper, *args, **kwargs) -> list[tuple]:
    """``(kernel, args, kwargs)`` of every launch ``wrapper(*args, **kwargs)`` makes, without running them."""
    launches = []

    def record(kernel, *launch_args, grid, warmup, **launch_kwargs):
        launches.append((kernel, launch_args, launch_kwargs))

    original = JITFunction.run
    JITFunction.run = record
    try:
        wrapper(*args, **kwargs)
    finally:
        JITFunction.run = original
    return launches


def compile_launch(kernel, args, kwargs, arch: int):
    """Compile one captured launch the way the JIT would specialize it on a GPU."""
    kwargs = dict(kwargs)
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
    bound = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    constexpr_params = {param.num for param in kernel.params if param.is_constexpr}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = bound[name]
        if i in constexpr_params or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[name], constexprs[name] = "constexpr", value  # the JIT also specializes ints equal to 1
        elif isinstance(value, torch.Tensor):
            signature[name] = _POINTER_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # CUDA allocations are 256-byte aligned
        elif isinstance(value, int):
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def resource_usage(compiled) -> dict[str, int]:
    """Registers, spill stack and local memory per thread, read from the cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        listing = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
    line = next(line for line in listing.splitlines() if "REG:" in line)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return {name: int(fields[name]) for name in ("REG", "STACK", "LOCAL")}


def _variants(dtype: torch.dtype):
    """(name, wrapper, args, kwargs) for every kernel, KV cache dtype and head layout the engine uses."""
    for num_q_heads, num_kv_heads, head_dim in ((32, 8, 128), (14, 2, 64)):
        for kv_cache_dtype in ("auto", "int8_v", "int8"):
            cache = torch.empty(64, 16, num_kv_heads, head_dim, dtype=dtype)
            k_cache = cache.to(torch.int8) if kv_cache_dtype == "int8" else cache
            v_cache = cache.to(torch.int8) if kv_cache_dtype != "auto" else cache
            scales = torch.empty(64, 16, num_kv_heads)
            quant = {"k_scale": scales if kv_cache_dtype == "int8" else None,
                     "v_scale": scales if kv_cache_dtype != "auto" else None}  # fmt: skip
            q = torch.empty(100, num_q_heads, head_dim, dtype=dtype)
            k = torch.empty(100, num_kv_heads, head_dim, dtype=dtype)
            block_tables = torch.zeros(2, 16, dtype=torch.int32)
            seq_lens = torch.tensor([70, 90], dtype=torch.int32)
            cu_seqlens_q = torch.tensor([0, 50, 100], dtype=torch.int32)
            tag = f"{num_q_heads}:{num_kv_heads} d{head_dim} {kv_cache_dtype}"
            decode = decode_attention.paged_decode_attention
            decode_args = (q[:2], k_cache, v_cache, block_tables, seq_lens, 0.1)
            ring = torch.tensor([[4, 64, 1, 6], [0, 1 << 30, 0, 1 << 30]], dtype=torch.int32)  # sinks + window, full
            for num_splits in (4, 1):  # split-K + reduction, and the single-split path that writes directly
                yield f"decode {num_splits} split(s) {tag}", decode, decode_args, quant | {"num_splits": num_splits}
                yield f"decode ring {num_splits} split(s) {tag}", decode, decode_args, quant | {
                    "num_splits": num_splits, "q_sink": q[:2], "ring": ring}  # fmt: skip
            prefill_args = (q, k, k, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, 0.1)
            yield f"prefill {tag}", prefill_attention.paged_prefill_attention, prefill_args, quant
            yield f"prefill ring {tag}", prefill_attention.paged_prefill_attention, prefill_args, quant | {
                "q_sink": q, "ring": ring}  # fmt: skip
            store_args = (k, k, k_cache, v_cache, torch.zeros(100, dtype=torch.int64))
            yield f"store {tag}", store_kv.store_kvcache, store_args, quant
    for hidden, intermediate, (num_q_heads, num_kv_heads, head_dim) in ((896, 4864, (14, 2, 64)),
                                                                        (4096, 14336, (32, 8, 128))):  # fmt: skip
        x = torch.empty(100, hidden, dtype=dtype)
        weight = torch.empty(hidden, dtype=dtype)
        yield f"add+norm h{hidden}", norm.add_rms_norm, (x, x, weight, 1e-6), {}
        yield f"norm h{hidden}", norm.add_rms_norm, (x, None, weight, 1e-6), {}
        qkv = torch.empty(100, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
        q = qkv[:, : num_q_heads * head_dim].view(100, num_q_heads, head_dim)  # strided views, as the model has
        k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(100, num_kv_heads, head_dim)
        yield f"rotary {num_q_heads}:{num_kv_heads} d{head_dim}", rotary.rotary_embedding, \
            (q, k, torch.empty(100, head_dim)), {}
        gate_up = torch.empty(100, 2 * intermediate, dtype=dtype)
        yield f"silu*mul i{intermediate}", activation.silu_and_mul, (gate_up,), {}
    rows = torch.empty(256, dtype=torch.int64)  # the sampler's draw: float32 logits, whatever the model dtype
    yield "gumbel argmax v151936", sampling.gumbel_argmax, (torch.empty(256, 151936), rows, rows), {}


def check_variant(index: int, arch: int, dtype_name: str) -> list[tuple[str, dict[str, int] | str]]:
    """``(label, resource usage or the compile error)`` of each kernel that variant ``index`` launches."""
    name, wrapper, args, kwargs = list(_variants(getattr(torch, dtype_name)))[index]
    results, seen = [], set()
    for kernel, launch_args, launch_kwargs in capture_launches(wrapper, *args, **kwargs):
        label = f"{name} / {kernel.fn.__name__}"
        if label in seen:
            continue
        seen.add(label)
        try:
            results.append((label, resource_usage(compile_launch(kernel, launch_args, launch_kwargs, arch))))
        except Exception as error:  # report every variant, then fail
            results.append((label, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability without the dot (80, 90, ...)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="variants compiled at once, each in a process of its own (default: one per CPU)")
    options = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    count = sum(1 for _ in _variants(getattr(torch, options.dtype)))
    jobs = [(index, options.arch, options.dtype) for index in range(count)]
    if options.jobs > 1:  # LLVM and ptxas are single-threaded: one variant per process
        with ProcessPoolExecutor(options.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(check_variant, *zip(*jobs, strict=True)))
    else:
        results = [check_variant(*job) for job in jobs]
    failures = 0
    for label, usage in (item for variant in results for item in variant):
        if isinstance(usage, str):
            failures += 1
            print(f"FAIL  {label}: {usage}")
            continue
        spills = usage["STACK"] + usage["LOCAL"]
        failures += spills > 0
        status = "SPILL" if spills else "ok   "
        print(f"{status} {label:58} regs {usage['REG']:3}  spill bytes {spills}")
    print(f"sm_{options.arch}: {'all variants compile without spills' if not failures else f'{failures} problem(s)'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
