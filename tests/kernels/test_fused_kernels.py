"""The decoder layer's fused kernels (add + RMSNorm, rotary, SiLU-and-mul) vs their references and transformers.

Each Triton kernel runs interpreted on the CPU (compiled on a GPU) at small,
odd shapes, in fp16 and fp32 (the interpreter's bf16 arithmetic is wrong), and
is checked twice: against ``kvkernels.reference`` and against an independent
formula (transformers' own RMSNorm and ``apply_rotary_pos_emb``, a float64
SwiGLU). The GPU test counts the kernels an eager decode step launches per layer.
"""

import importlib

import pytest
import torch
from paged_kv_testing import (  # noqa: F401  (interpreted_triton: an autouse fixture, found by name)
    DEVICE,
    HAS_CUDA,
    assert_matches,
    interpreted_triton,
    random_tensor,
    triton_ops,
)

import kvkernels
from kvkernels import reference

DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32")]


def _module(name: str):
    """A fused-kernel module whose kernels run interpreted on the CPU (reloaded if it was imported compiled)."""
    module = importlib.import_module(name)
    if not HAS_CUDA:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import KernelInterface

        triton_ops()  # skips unless Triton itself was imported in interpreter mode
        jitted = [fn for fn in vars(module).values() if isinstance(fn, KernelInterface)]
        if not all(isinstance(fn, InterpretedFunction) for fn in jitted):
            module = importlib.reload(module)
    return module


def _transformers_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(x.shape[-1], eps=eps).to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", [(5, 576), (3, 896), (2, 64)])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
def test_add_rms_norm(dtype, num_tokens, hidden, with_residual):
    generator = torch.Generator().manual_seed(hidden + with_residual)
    x = random_tensor(num_tokens, hidden, dtype=dtype, generator=generator) * 3
    residual = random_tensor(num_tokens, hidden, dtype=dtype, generator=generator) if with_residual else None
    weight = 1 + 0.1 * random_tensor(hidden, dtype=dtype, generator=generator)

    normed, summed = _module("kvkernels.norm").add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_sum = reference.add_rms_norm(x, residual, weight, 1e-6)

    assert_matches(normed, expected_normed)
    if with_residual:
        assert torch.equal(summed, x + residual)  # rounded once to the dtype, like PyTorch's add
    else:
        assert summed is x  # no copy when there is nothing to add
    assert_matches(normed, _transformers_rms_norm(expected_sum, weight, 1e-6))


def test_add_rms_norm_reads_strided_rows_and_empty_batches():
    generator = torch.Generator().manual_seed(1)
    wide = random_tensor(4, 200, dtype=torch.float32, generator=generator)
    x, residual = wide[:, :96], wide[:, 100:196]  # row stride 200
    weight = random_tensor(96, dtype=torch.float32, generator=generator)
    norm = _module("kvkernels.norm")

    normed, summed = norm.add_rms_norm(x, residual, weight, 1e-5)

    assert_matches(normed, reference.add_rms_norm(x, residual, weight, 1e-5)[0])
    assert torch.equal(summed, x + residual)  # one IEEE add per element, rounded once: no order to differ in
    empty, _ = norm.add_rms_norm(x[:0], residual[:0], weight, 1e-5)
    assert empty.shape == (0, 96)


def _cos_sin(num_tokens: int, head_dim: int, generator: torch.Generator) -> torch.Tensor:
    angles = torch.rand(num_tokens, head_dim // 2, generator=generator) * 100  # large positions wrap around
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE)


def _transformers_rotary(q, k, cos_sin):
    """transformers' ``apply_rotary_pos_emb`` in float32, its cos/sin laid out as ``cat([angles, angles])``."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)  # (tokens, head_dim)
    q_rot, k_rot = apply_rotary_pos_emb(q.float(), k.float(), cos, sin, unsqueeze_dim=1)
    return q_rot.to(q.dtype), k_rot.to(k.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim",
    [pytest.param(9, 3, 64, id="smollm2-9:3-d64"), pytest.param(4, 1, 128, id="4:1-d128"),
     pytest.param(3, 3, 32, id="3:3-d32")],
)  # fmt: skip
def test_rotary_embedding(dtype, num_q_heads, num_kv_heads, head_dim):
    generator = torch.Generator().manual_seed(head_dim + num_q_heads)
    num_tokens = 3
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = random_tensor(num_tokens, q_size + 2 * kv_size, dtype=dtype, generator=generator)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)  # strided views, as the model passes them
    q = q.view(num_tokens, num_q_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    cos_sin = _cos_sin(num_tokens, head_dim, generator)
    before = qkv.clone()

    q_rot, k_rot = _module("kvkernels.rotary").rotary_embedding(q, k, cos_sin)

    expected_q, expected_k = reference.rotary_embedding(q, k, cos_sin)
    assert_matches(q_rot, expected_q)
    assert_matches(k_rot, expected_k)
    hf_q, hf_k = _transformers_rotary(q, k, cos_sin)
    assert_matches(q_rot, hf_q)
    assert_matches(k_rot, hf_k)
    assert torch.equal(qkv, before)  # the projection output (and v in it) is left alone
    assert q_rot.is_contiguous() and k_rot.is_contiguous()


def test_rotary_rejects_mismatched_shapes():
    q = torch.zeros(2, 4, 64, device=DEVICE)
    k = torch.zeros(2, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        _module("kvkernels.rotary").rotary_embedding(q, k, torch.zeros(2, 32, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, intermediate", [(3, 1536), (2, 100), (1, 1024)])
def test_silu_and_mul(dtype, num_tokens, intermediate):
    generator = torch.Generator().manual_seed(intermediate)
    gate_up = random_tensor(num_tokens, 2 * intermediate, dtype=dtype, generator=generator) * 4

    out = _module("kvkernels.activation").silu_and_mul(gate_up)

    assert_matches(out, reference.silu_and_mul(gate_up))
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert_matches(out, (gate * torch.sigmoid(gate) * up).to(dtype))


def test_public_entry_points_dispatch_to_the_triton_kernels():
    """Under the interpreter (or on CUDA) ``kvkernels.*`` runs the Triton kernels, exactly."""
    generator = torch.Generator().manual_seed(2)
    x = random_tensor(2, 64, dtype=torch.float16, generator=generator)
    weight = random_tensor(64, dtype=torch.float16, generator=generator)
    q = random_tensor(2, 2, 64, dtype=torch.float16, generator=generator)
    cos_sin = _cos_sin(2, 64, generator)
    norm, rotary, activation = (_module(f"kvkernels.{name}") for name in ("norm", "rotary", "activation"))

    assert kvkernels.use_triton(x.device)
    assert torch.equal(kvkernels.add_rms_norm(x, x, weight, 1e-6)[0], norm.add_rms_norm(x, x, weight, 1e-6)[0])
    assert torch.equal(kvkernels.rotary_embedding(q, q, cos_sin)[0], rotary.rotary_embedding(q, q, cos_sin)[0])
    assert torch.equal(kvkernels.silu_and_mul(x), activation.silu_and_mul(x))


MAX_LAUNCHES_PER_LAYER = 12


@pytest.mark.gpu
@pytest.mark.gpu
def test_decode_step_launches_at_most_12_kernels_per_layer(tmp_path):
    """Eager decode steps of 8 sequences on a random Qwen2-0.5B-shaped model (4 layers, bf16, q/k/v biases).

    Expected per layer: add + RMSNorm, QKV GEMM, rotary, KV store, decode
    attention (+ its reduction when split), o_proj, add + RMSNorm, gate/up
    GEMM, SiLU-and-mul, down_proj: 10 or 11.
    """
    from engine import LLM
    from kvserve.bench.profile import profile_decode_steps
    from kvserve.testing.random_model import write_random_model

    model_dir = write_random_model(tmp_path, "qwen2-0.5b", num_layers=4, dtype=torch.bfloat16, device="cuda")
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", skip_tokenizer_init=True, block_size=16,
              num_blocks=256, enforce_eager=True)  # fmt: skip

    profile = profile_decode_steps(llm, batch_size=8, prompt_len=100, num_steps=3)

    print(f"decode step: {profile.launches_per_step:.1f} kernels, {profile.launches_per_layer:.2f} per layer")
    assert 0 < profile.launches_per_layer <= MAX_LAUNCHES_PER_LAYER
