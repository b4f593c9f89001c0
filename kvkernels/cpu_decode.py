"""Paged decode attention on the CPU as a small C kernel (``cpu_decode_attention.c``), built on first use, and
the store of new tokens' K/V beside it (``store_kv``: one C call a layer where the reference makes about ten
ATen calls, 5 of a batch-16 step's 70 ms on the bundled model). The same library holds one sequence's whole
decode step through every layer (``cpu_decode_step.c``, ``decode_step``; ``engine.models.native_decode`` says
why), whose attention splits the sequence's tokens among the threads (``kvserve_decode_one_f32``).

Why: the reference gathers each sequence's blocks into a padded copy (``index_select``) and calls SDPA, whose
CPU kernel is written for long query blocks. A decode step brings one query per sequence, so both cost far
more than the bytes they read: on the bundled model at 16 sequences of 260-320 tokens, 0.95 ms a layer on two
cores for 3.5 MB of K and V, about a third of the step. The C kernel reads the blocks in place, one OpenMP task
per (sequence, KV head), with an exponential of its own over 16 lanes (within about an ulp of expf), in
0.15-0.6x the reference's time (``python -m kvserve.bench.kernels`` on a host
without CUDA measures the two side by side: 11-13 GB/s against 2-5 at 16-64 sequences here).

It runs float32 pools on the CPU, without int8 scales or windows, once a process has ``prepare``d it: built
with ``-O3 -march=native`` by a C compiler with OpenMP (``cc``, as inductor needs one too), or loaded where an
earlier process built it. Everything else takes the reference, and so does every process without a compiler
or with ``KVSERVE_CPU_KERNELS=0``. The library is named by a hash of the sources, the flags and the CPU's flags
(a host with another CPU builds its own), in a directory the caller guarantees private to this user: it is
code this process runs, so nobody else may be able to put a file there (an engine uses its cache directory,
checked by ``kvstore.private_dir``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_decode_attention.c", "cpu_decode_step.c")]
HEADER = Path(__file__).with_name("cpu_lanes.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def enabled() -> bool:
    return os.environ.get("KVSERVE_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


_loaded: list[ctypes.CDLL] = []  # the kernel, once ``prepare`` built or loaded it (at most one a process)


def prepare(directory: Path) -> bool:
    """Build the kernel in ``directory`` (private to this user) unless it is there, and load it; returns
    ``available()``. A worker prepares it at start, so that no request waits for the compiler."""
    if enabled() and not _loaded:
        library = _build_or_load(directory)
        if library is not None:
            _loaded.append(library)
    return available()


def available() -> bool:
    """Whether decode batches that ``applies`` takes run the C kernel."""
    return enabled() and bool(_loaded)


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether this decode batch can take the C kernel (the library is then built or loaded)."""
    float32 = q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
    contiguous = k_cache.is_contiguous() and v_cache.is_contiguous()
    return q.device.type == "cpu" and float32 and contiguous and available()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``reference.paged_decode_attention`` without scales or windows, for ``applies`` batches."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    status = _loaded[0].kvserve_paged_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim, block_size,
        ctypes.c_float(scale), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("paged decode attention: no memory for a sequence's scores")
    return out


def stores(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> bool:  # fmt: skip
    """Whether ``store_kv`` takes these (float32 on the CPU, each token's row of heads contiguous, int64 slots)."""
    rows_whole = all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
    float32 = k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == torch.float32
    contiguous = k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.is_contiguous()
    return (k.device.type == "cpu" and float32 and rows_whole and contiguous
            and slot_mapping.dtype == torch.int64 and available())  # fmt: skip


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:  # fmt: skip
    """``reference.store_kvcache`` without scales, for ``stores`` inputs: one C call for both caches."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    row = k_cache.shape[2] * k_cache.shape[3]
    if k.shape[0] and (k.stride(0) != row or v.stride(0) != row):
        k, v = k.contiguous(), v.contiguous()
    status = _loaded[0].kvserve_store_kv_f32(
        k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0],
        row, num_slots,
    )  # fmt: skip
    if status != 0:
        raise IndexError(f"store_kvcache: a slot outside the pool's {num_slots} slots")


class Layer(ctypes.Structure):
    """``struct layer`` of ``cpu_decode_step.c``: a decoder layer's tensors (None: the model has no such one)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o",
                "post_norm", "gate_up", "gate_up_bias", "down", "down_bias", "k_cache", "v_cache")]  # fmt: skip


class Step(ctypes.Structure):
    """``struct step`` of ``cpu_decode_step.c``: the model's sizes, its layers, and one decode step's inputs."""

    _fields_ = [*((name, ctypes.c_int64) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                "rotary_dim", "intermediate", "block_size", "num_slots")), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("threads", ctypes.c_int), ("layers", ctypes.POINTER(Layer)),
                ("final_norm", ctypes.c_void_p), ("cos_sin", ctypes.c_void_p), ("block_table", ctypes.c_void_p),
                ("seq_len", ctypes.c_int32), ("slot", ctypes.c_int64),
                ("x", ctypes.c_void_p), ("work", ctypes.c_void_p), ("parts", ctypes.POINTER(ctypes.c_void_p)),
                ("num_parts", ctypes.c_int64)]  # fmt: skip


def step_work(step: Step) -> int:
    """The floats of scratch ``decode_step`` needs for ``step``'s model."""
    return _loaded[0].kvserve_decode_step_work_f32(ctypes.byref(step))


def pack_step(step: Step, parts: int) -> list[torch.Tensor]:
    """The layers' matrices (``step.layers``') as ``decode_step`` reads them, in ``parts`` streams, one a thread
    (``kvserve_decode_step_pack_f32`` says why); ``step`` reads them from now on. The caller keeps the tensors
    (and ``step``'s array of their addresses, ``step._streams``) alive."""
    if not 1 <= parts <= 64:
        raise ValueError(f"decode step: {parts} streams; 1 to 64")
    step.num_parts = parts
    sizes = (ctypes.c_int64 * parts)()
    _loaded[0].kvserve_decode_step_pack_f32(ctypes.byref(step), None, sizes)
    streams = [torch.empty(size) for size in sizes]
    addresses = (ctypes.c_void_p * parts)(*(t.data_ptr() for t in streams))
    _loaded[0].kvserve_decode_step_pack_f32(ctypes.byref(step), addresses, sizes)
    step.parts, step._streams = addresses, addresses
    return streams


def decode_step(step: Step) -> None:
    """One sequence's decode step through every layer (``cpu_decode_step.c``), for ``available()`` processes:
    ``step.x`` holds the token's embedding before and the final norm's output after."""
    status = _loaded[0].kvserve_decode_step_f32(ctypes.byref(step))
    if status == -1:
        raise IndexError(f"decode step: slot {step.slot} outside the pool's {step.num_slots} slots")
    if status != 0:
        raise MemoryError("decode step: no memory for the sequence's attention scores")


def _build_or_load(directory: Path) -> ctypes.CDLL | None:
    """The compiled kernel from ``directory``, built there now if no earlier process built it for this source
    and CPU; None without a compiler, or where the build fails (logged)."""
    source = b"".join(path.read_bytes() for path in (*SOURCES, HEADER))
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    path = directory / f"cpu_decode_attention-{key}.so"
    if not path.exists():
        compiler = shutil.which(os.environ.get("CC", "cc"))
        if compiler is None:
            log.info("no C compiler: CPU decode attention runs the PyTorch reference")
            return None
        building = path.with_suffix(f".{os.getpid()}.tmp")  # then renamed: a concurrent build never loads half a file
        result = subprocess.run([compiler, *FLAGS, "-o", str(building), *map(str, SOURCES), "-lm"],
                                capture_output=True, text=True)  # fmt: skip
        if result.returncode != 0:
            building.unlink(missing_ok=True)
            log.warning("could not build the CPU decode attention kernel (the PyTorch reference runs): %s",
                        result.stderr.strip()[-500:])  # fmt: skip
            return None
        os.replace(building, path)
    library = ctypes.CDLL(str(path))
    function = library.kvserve_paged_decode_f32
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
        [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int]  # fmt: skip
    store = library.kvserve_store_kv_f32
    store.restype = ctypes.c_int
    store.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
    for name, restype in (("kvserve_decode_step_f32", ctypes.c_int), ("kvserve_decode_step_work_f32", ctypes.c_int64)):
        getattr(library, name).restype = restype
        getattr(library, name).argtypes = [ctypes.POINTER(Step)]
    pack = library.kvserve_decode_step_pack_f32
    pack.restype = ctypes.c_int
    pack.argtypes = [ctypes.POINTER(Step), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64)]
    return library


def _cpu_flags() -> str:
    """The CPU's feature flags (a library built with ``-march=native`` for one CPU may not run on another)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()
