"""``NativeDecode``: one sequence's decode step through every decoder layer in one C call (see its docstring)."""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

import torch

from kvkernels import cpu_decode
from kvstore import LayerKV

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engine.models.attention import AttentionMetadata
    from engine.models.model import CausalLM


def refusal(model: CausalLM, kv_layers: list[LayerKV]) -> str | None:
    """Why ``model``'s decode steps over ``kv_layers`` cannot take ``NativeDecode``; None where they can."""
    config = model.config
    if not cpu_decode.available():
        return "the C kernels are not built here (no C compiler, or KVSERVE_CPU_KERNELS=0)"
    if model.group is not None:
        return "tensor parallel ranks"
    if config.moe_layers or config.sliding_window is not None or config.sandwich_norms or config.hidden_act != "silu":
        return "experts, sliding windows, sandwich norms or another activation than SiLU"
    if list(model.ropes) != ["global"] or config.rotary_dim % 2:
        return "more than one rotary table, or an odd rotary width"
    tensors = [p for p in model.model.layers.parameters()] + [model.model.norm.weight]
    tensors += [t for kv in kv_layers for t in (kv.k_cache, kv.v_cache)]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return "a tensor that is not contiguous float32 on the CPU"
    if any(kv.k_scale is not None for kv in kv_layers):
        return "a quantized KV pool"
    return None


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeDecode:
    """The decoder layers of one sequence's decode step on the CPU, in one call of ``cpu_decode_step.c``.

    One user's decode step reads every weight once and does two FLOPs a weight: its time is the weights' bytes
    over the memory bandwidth, if the code keeps up with the memory. Inductor's code for a layer did not: it sums
    each row of a product in one chain of vector adds (a dependent add every four cycles), rebuilds the normed
    input inside the row's loop, and each layer is a Python call with a few dozen size checks and buffer
    allocations. Here a row is summed in four independent vectors, the 30 layers are one call, and attention
    splits the sequence's tokens among the threads (``kvserve_decode_one_f32``: a sequence's 3 KV heads kept two
    threads unevenly busy, 1.4 against 1.0 ms a step).

    The threads split each product's rows, and each reads its rows of every product from a copy of its own, laid
    out in the order it reads them (``kvkernels.cpu_decode.pack_step``): one run of memory from the first layer
    to the last, as one stream over all the weights reads. Each thread's half of each matrix in turn (the
    weights where they lie) jumps 120 times a step, and read 425 MB in 9.2-9.5 ms where a stream took 7.4 in
    this host's faster bandwidth mode (12.9 against 12.0 in its slower one). The copy costs the layers' bytes
    again (425 MB on the bundled model, logged at start); the plain weights stay for every other path.

    On the bundled model, one engine alternating the C step with inductor's layers (greedy, 256-token prompt):
    17.0-17.3 against 21.5-22.1 ms a step in the slower mode (32-34 GB/s read), 12.8-13.3 against 17.9-18.7 in
    the faster (55-57 GB/s), the same tokens.

    Llama-family layers (RMSNorm, q/k/v and MLP biases, q/k head norms, partial rotary, SiLU gated MLP) over a
    float32 KV pool without scales or windows; ``refusal`` says what else decodes through inductor's graph.
    The tensors' addresses are taken once: parameters and the pool do not move while an engine lives."""

    def __init__(self, model: CausalLM, kv_layers: list[LayerKV]) -> None:
        config = model.config
        self.kv_layers = kv_layers
        attention = [layer.self_attn for layer in model.model.layers]
        mlps = [layer.mlp for layer in model.model.layers]
        self.layers = (cpu_decode.Layer * config.num_layers)(*(cpu_decode.Layer(
            input_norm=_address(layer.input_layernorm.weight), qkv=_address(a.qkv_proj.weight),
            qkv_bias=_address(a.qkv_proj.bias), q_norm=_address(a.q_norm.weight) if hasattr(a, "q_norm") else None,
            k_norm=_address(a.k_norm.weight) if hasattr(a, "k_norm") else None, o=_address(a.o_proj.weight),
            post_norm=_address(layer.post_attention_layernorm.weight), gate_up=_address(m.gate_up_proj.weight),
            gate_up_bias=_address(m.gate_up_proj.bias), down=_address(m.down_proj.weight),
            down_bias=_address(m.down_proj.bias), k_cache=_address(kv.k_cache), v_cache=_address(kv.v_cache))
            for layer, a, m, kv in zip(model.model.layers, attention, mlps, kv_layers, strict=True)))  # fmt: skip
        k_cache = kv_layers[0].k_cache  # (blocks, block_size, kv_heads, head_dim)
        self.block_size = k_cache.shape[1]
        self.step = cpu_decode.Step(
            num_layers=config.num_layers, hidden=config.hidden_size, num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, rotary_dim=config.rotary_dim,
            intermediate=config.intermediate_size, block_size=self.block_size,
            num_slots=k_cache.shape[0] * k_cache.shape[1], eps=config.rms_norm_eps, scale=attention[0].scale,
            layers=ctypes.cast(self.layers, ctypes.POINTER(cpu_decode.Layer)),
            final_norm=model.model.norm.weight.data_ptr(),
        )  # fmt: skip
        self.work = torch.empty(cpu_decode.step_work(self.step))
        self.step.work = self.work.data_ptr()
        self.weights = list(model.parameters())  # (kept alive while their addresses are held)
        # a copy of the layers' matrices, one stream a thread (``kvserve_decode_step_pack_f32`` says why)
        self.streams = cpu_decode.pack_step(self.step, torch.get_num_threads())
        self.nbytes = sum(t.numel() * t.element_size() for t in self.streams)
        log.info("one sequence's decode step reads a copy of the layers' matrices in %d streams: %.0f MB",
                 len(self.streams), self.nbytes / 1e6)  # fmt: skip

    def __call__(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_layers: list[LayerKV],
                 meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        """``x (1, hidden)``: the token's embedding; ``cos_sin (1, rotary_dim)``: its rotation -> the final
        norm's output ``(1, hidden)``, the new token's K and V stored in its slot."""
        if kv_layers is not self.kv_layers:
            raise ValueError("NativeDecode runs over the KV layers it was built for")
        out = x.to(torch.float32, copy=True).contiguous()
        cos_sin = cos_sin.contiguous()
        table = meta.block_tables[0].to(torch.int32).contiguous()
        length = int(meta.seq_lens[0])
        step = self.step
        step.threads = torch.get_num_threads()
        step.cos_sin, step.block_table, step.x = cos_sin.data_ptr(), table.data_ptr(), out.data_ptr()
        step.seq_len, step.slot = length, int(meta.slot_mapping[0])
        cpu_decode.decode_step(step)
        return out
