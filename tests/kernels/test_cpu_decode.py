"""The CPU's decode attention against attention written out per sequence in float64: the reference
(``kvkernels.reference.paged_decode_attention``, what the Triton kernel is checked against) and the C kernel
(``kvkernels.cpu_decode``). Lengths from different length classes, empty rows, table entries past a sequence's
blocks that hold garbage, groups split to bound one gather; for the C kernel head dims that are not a multiple
of its 16 lanes, a task per sequence and a task per KV head, and the choice between it and the reference."""

from __future__ import annotations

import pytest
import torch

import kvkernels
from engine.model_runner import prepare_cpu_decode
from kvkernels import cpu_decode, reference
from kvkernels.reference import attention
from kvkernels.reference.attention import _length_groups


def _naive(q, k_cache, v_cache, block_tables, seq_lens, scale):
    num_seqs, num_q_heads, _ = q.shape
    group = num_q_heads // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        blocks = block_tables[i, : -(-length // k_cache.shape[1])].long()
        k = k_cache[blocks].flatten(0, 1)[:length].double()  # (len, kv_heads, dim)
        v = v_cache[blocks].flatten(0, 1)[:length].double()
        for h in range(num_q_heads):
            weights = torch.softmax(k[:, h // group] @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ v[:, h // group]
    return out


@pytest.fixture(scope="module")
def c_kernel(tmp_path_factory):
    if not cpu_decode.prepare(tmp_path_factory.mktemp("kernels")):
        pytest.skip("no C compiler here (or KVSERVE_CPU_KERNELS=0): the CPU decode kernel cannot be built")
    return cpu_decode.paged_decode_attention


@pytest.mark.parametrize(("implementation", "max_gather", "head_dim", "block_size"), [
    ("reference", 1 << 24, 8, 4),
    ("reference", 256, 8, 4),  # 256 elements: every group split to single rows
    ("c", None, 8, 4),
    ("c", None, 80, 4),  # 5 x 16 lanes
    ("c", None, 35, 4),  # 2 x 16 lanes and a tail of 3
    ("c", None, 16, 6),  # blocks of no power of two: a division finds a row's block, not a shift
])  # fmt: skip
def test_cpu_decode_matches_attention_written_out(monkeypatch, request, implementation, max_gather, head_dim,
                                                   block_size):  # fmt: skip
    decode = reference.paged_decode_attention if implementation == "reference" else request.getfixturevalue("c_kernel")
    if max_gather is not None:
        monkeypatch.setattr(attention, "_MAX_GATHER_ELEMENTS", max_gather)
    torch.manual_seed(0)
    num_kv_heads, num_q_heads = 2, 6
    seq_lens = torch.tensor([5, 0, 1, 17, 40, 3, 0, 33, 8, 64], dtype=torch.int32)
    width = 20  # wider than any sequence needs: the entries past its blocks are out-of-range garbage
    k_cache = torch.randn(80, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.full((len(seq_lens), width), 10_000, dtype=torch.int32)
    free = torch.randperm(80).tolist()
    for i, length in enumerate(seq_lens.tolist()):
        needed = -(-length // block_size)
        block_tables[i, :needed] = torch.tensor([free.pop() for _ in range(needed)], dtype=torch.int32)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim)
    out = decode(q, k_cache, v_cache, block_tables, seq_lens, 0.3)
    torch.testing.assert_close(out.double(), _naive(q, k_cache, v_cache, block_tables, seq_lens, 0.3),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    assert out[1].abs().sum() == 0 and out[6].abs().sum() == 0


def test_reference_decode_equal_lengths_is_one_group():
    lens = torch.full((256,), 48)
    assert _length_groups(lens, 32) == [None]
    assert [g.tolist() for g in _length_groups(torch.tensor([0, 3, 4, 5, 9]), 32)] == [[1, 2], [3], [4]]


@pytest.mark.parametrize("num_seqs", [1, 3, 16])  # a task per KV head below 2 x threads, per sequence from there
def test_c_kernel_matches_the_reference_whatever_the_threads(c_kernel, num_seqs):
    """The bundled model's heads (9 query, 3 KV, 64 wide) on scattered blocks of 16: the reference's values
    within float32 rounding (also where scores are large), and the same bits on 1 and 2 threads (a head's sums
    run in the same order whichever task holds it)."""
    decode = c_kernel
    generator = torch.Generator().manual_seed(1)
    k_cache = torch.randn(200, 16, 3, 64, generator=generator)
    v_cache = torch.randn(200, 16, 3, 64, generator=generator)
    seq_lens = torch.randint(1, 300, (num_seqs,), generator=generator, dtype=torch.int32)
    block_tables = torch.randperm(200, generator=generator)[: num_seqs * 10].view(num_seqs, 10).int()
    seq_lens = seq_lens.clamp(max=160)
    q = torch.randn(num_seqs, 9, 64, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode(q, k_cache, v_cache, block_tables, seq_lens, 0.125)
        torch.set_num_threads(2)
        two = decode(q, k_cache, v_cache, block_tables, seq_lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125)
    torch.testing.assert_close(one, expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(one, two)
    # scores in the thousands: exp overflows unless the softmax subtracts each head's largest first
    sharp = decode(q * 500, k_cache, v_cache, block_tables, seq_lens, 0.125)
    expected = reference.paged_decode_attention(q * 500, k_cache, v_cache, block_tables, seq_lens, 0.125)
    torch.testing.assert_close(sharp, expected, atol=1e-3, rtol=1e-3)  # a score's rounding, times 500


def test_the_cpu_takes_the_c_kernel_for_float32_pools_only(c_kernel, monkeypatch, tmp_path):
    """kvkernels' entry point: the C kernel for float32 pools once prepared, the reference for others and with
    the kernel turned off; and a process without a compiler builds nothing and keeps the reference."""
    calls = []
    monkeypatch.setattr(cpu_decode, "paged_decode_attention", lambda *args: calls.append(args) or args[0])
    if kvkernels.use_triton(torch.device("cpu")):  # TRITON_INTERPRET=1: the CPU runs Triton, not C
        monkeypatch.setattr(kvkernels, "use_triton", lambda device: False)
    k_cache = torch.randn(8, 4, 2, 8)
    q, tables, lens = torch.randn(2, 4, 8), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 8])
    kvkernels.paged_decode_attention(q, k_cache, k_cache, tables, lens, 0.3)
    assert len(calls) == 1
    kvkernels.paged_decode_attention(q.half(), k_cache.half(), k_cache.half(), tables, lens, 0.3)
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
    kvkernels.paged_decode_attention(q, k_cache, k_cache, tables, lens, 0.3)
    monkeypatch.delenv("KVSERVE_CPU_KERNELS")
    monkeypatch.setattr(cpu_decode, "_loaded", [])  # a new process, whose compiler fails
    monkeypatch.setenv("CC", "false")
    assert not cpu_decode.prepare(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no half-built library left behind
    kvkernels.paged_decode_attention(q, k_cache, k_cache, tables, lens, 0.3)
    assert len(calls) == 1


def test_a_kernel_directory_others_can_write_is_refused(monkeypatch, tmp_path):
    """The library is code every worker runs: where its directory is open to other users (who could have put
    their own library there), the worker keeps the reference and builds or loads nothing."""
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels").chmod(0o777)
    monkeypatch.setattr(cpu_decode, "_loaded", [])
    assert not prepare_cpu_decode()
    assert not cpu_decode.available() and list((tmp_path / "kernels").iterdir()) == []


def test_c_store_writes_the_slots_the_reference_writes(c_kernel):
    """The C store (kvkernels' CPU entry point for float32 pools) against the reference's ``index_copy_``: K
    and V as the attention layer has them (strided views of one projection), padding slots (-1) skipped;
    a slot outside the pool raises before anything is written."""
    if kvkernels.use_triton(torch.device("cpu")):
        pytest.skip("TRITON_INTERPRET=1: the CPU stores through Triton")
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(7, 9 * 8 + 2 * 3 * 8, generator=generator)
    k = qkv[:, 72:96].view(7, 3, 8)  # rows 120 floats apart, each token's heads contiguous
    v = qkv[:, 96:].view(7, 3, 8)
    slots = torch.tensor([5, -1, 0, 31, 12, -1, 20])
    caches = [torch.randn(8, 4, 3, 8, generator=generator) for _ in range(2)]
    expected = [c.clone() for c in caches]
    assert cpu_decode.stores(k, v, *caches, slots)
    kvkernels.store_kvcache(k, v, *caches, slots)
    reference.store_kvcache(k, v, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    before = [c.clone() for c in caches]
    with pytest.raises(IndexError, match="outside the pool's 32 slots"):
        kvkernels.store_kvcache(k, v, *caches, torch.tensor([5, -1, 0, 32, 12, -1, 20]))
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])
