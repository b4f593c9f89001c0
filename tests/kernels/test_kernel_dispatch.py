"""Which implementation ``kvkernels.*`` runs: Triton on CUDA or when interpreting, the reference otherwise."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paged_kv_testing import (  # noqa: F401  (interpreted_triton: an autouse fixture, found by name)
    HAS_CUDA,
    interpreted_triton,
    make_paged_kv,
    random_tensor,
    triton_ops,
)

import kvkernels
from kvkernels import reference

REPO_ROOT = Path(__file__).resolve().parents[2]


def _decode_args(device):
    generator = torch.Generator().manual_seed(0)
    kv = make_paged_kv([9, 40], block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16,
                       generator=generator, device=device)  # fmt: skip
    q = random_tensor(2, 4, 64, dtype=torch.float16, generator=generator, device=device)
    return q, kv.k, kv.v, kv.block_tables, kv.seq_lens, 0.125


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU interpreter")
def test_cpu_tests_really_run_interpreted_triton_kernels():
    from triton.runtime.interpreter import InterpretedFunction

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert all(isinstance(kernel, InterpretedFunction) for kernel in triton_ops().kernels)
    assert kvkernels.use_triton(torch.device("cpu"))


def test_cpu_without_interpreter_runs_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = _decode_args(torch.device("cpu"))

    assert not kvkernels.use_triton(torch.device("cpu"))
    assert torch.equal(kvkernels.paged_decode_attention(*args), reference.paged_decode_attention(*args))  # same call


def test_interpreter_flag_routes_cpu_tensors_to_triton():
    args = _decode_args(torch.device("cpu"))
    if not HAS_CUDA:  # with a GPU the kernel modules are compiled and cannot take CPU tensors
        ops = triton_ops()
        assert torch.equal(kvkernels.paged_decode_attention(*args), ops.decode(*args))


def test_int8_cache_without_scales_is_rejected():
    q, k_cache, v_cache, block_tables, seq_lens, scale = _decode_args(torch.device("cpu"))
    with pytest.raises(ValueError, match="int8"):
        kvkernels.paged_decode_attention(q, k_cache, v_cache.to(torch.int8), block_tables, seq_lens, scale)


def test_import_works_without_triton():
    """With ``triton`` unimportable, ``kvkernels`` imports and always runs the reference, even when interpreting."""
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kvkernels\n"
        "assert not kvkernels.use_triton(torch.device('cpu')) and not kvkernels.use_triton(torch.device('cuda'))\n"
        "k = torch.zeros(1, 16, 1, 8); kvkernels.store_kvcache(torch.ones(1, 1, 8), torch.ones(1, 1, 8), k, k.clone(),"
        " torch.tensor([3]))\n"
        "assert k[0, 3].sum() == 8\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
