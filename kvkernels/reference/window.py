"""Windowed attention of one sequence (``ring``, package docstring): its queries over its sinks, scored with
``q_sink``, and over the keys inside their windows, scored with ``q``; its blocks form a ring."""

from __future__ import annotations

import torch

from kvkernels.reference.paged_kv import gather_positions


def decode_windowed(q, q_sink, k_cache, v_cache, k_scale, v_scale, table_row, length, ring_row, scale):
    """One query ``q``/``q_sink`` ``(1, q_heads, dim)`` at position ``length - 1`` of a sequence of ``length``
    tokens (> 0) whose kernel row is ``ring_row``: ``(1, q_heads, dim)``."""
    num_sinks, window, sink_blocks, ring_blocks = ring_row
    positions = _visible(length - 1, length, num_sinks, window)  # every one of them visible to the query
    keys = gather_positions(k_cache, k_scale, table_row, positions, sink_blocks, ring_blocks, q.dtype)
    values = gather_positions(v_cache, v_scale, table_row, positions, sink_blocks, ring_blocks, q.dtype)
    return _attend_window(q, q_sink, keys, values, min(num_sinks, length), scale)


def prefill_windowed(q, q_sink, k, v, k_cache, v_cache, k_scale, v_scale, table_row, total, ring_row, scale):
    """Causal windowed attention of a sequence's new tokens ``q``/``q_sink``/``k``/``v`` ``(new, heads, dim)``,
    the last of its ``total`` tokens, over its cached keys and themselves: ``(new, q_heads, dim)``."""
    num_sinks, window, sink_blocks, ring_blocks = ring_row
    num_cached = total - q.shape[0]
    cached = _visible(num_cached, num_cached, num_sinks, window)  # the cached keys any row reads
    keys = gather_positions(k_cache, k_scale, table_row, cached, sink_blocks, ring_blocks, q.dtype)
    values = gather_positions(v_cache, v_scale, table_row, cached, sink_blocks, ring_blocks, q.dtype)
    # keys in order: cached sinks, new sinks, cached window, new window (sinks first for _attend_window)
    new = torch.arange(num_cached, total)
    key_positions = torch.cat([cached, new])
    order = torch.argsort((key_positions >= num_sinks).int(), stable=True)
    key_positions = key_positions[order].to(q.device)
    queries = new.to(q.device)[:, None]
    visible = (key_positions[None, :] <= queries) & (
        (key_positions[None, :] < num_sinks) | (key_positions[None, :] > queries - window)
    )  # fmt: skip
    return _attend_window(
        q, q_sink, torch.cat([keys, k])[order.to(q.device)], torch.cat([values, v])[order.to(q.device)],
        int((key_positions < num_sinks).sum()), scale, visible,
    )  # fmt: skip


def _visible(first_query: int, length: int, num_sinks: int, window: int) -> torch.Tensor:
    """Positions below ``length`` that a query at ``first_query`` or later may see: the sinks, then what is
    inside the first query's window (int64, ascending)."""
    sinks = torch.arange(min(num_sinks, length))
    recent = torch.arange(min(max(num_sinks, first_query - window + 1), length), length)
    return torch.cat([sinks, recent])


def _attend_window(q, q_sink, keys, values, num_sink_keys, scale, visible=None):
    """Queries ``q``/``q_sink`` ``(n, q_heads, dim)`` over ``keys``/``values`` ``(k, kv_heads, dim)``, whose first
    ``num_sink_keys`` are sinks (scored with ``q_sink``) and the rest window keys (scored with ``q``);
    ``visible (n, k)`` masks keys per query (None: all visible). A row that sees nothing gets zeros."""
    n, num_q_heads, dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_q_heads // num_kv_heads

    def rows(x):  # (n, q_heads, dim) -> (kv_heads, n * group, dim): a KV head's queries as rows
        return x.float().view(n, num_kv_heads, group, dim).transpose(0, 1).reshape(num_kv_heads, n * group, dim)

    k = keys.float().transpose(0, 1)  # (kv_heads, k, dim)
    scores = torch.cat([torch.bmm(rows(q_sink), k[:, :num_sink_keys].transpose(1, 2)),
                        torch.bmm(rows(q), k[:, num_sink_keys:].transpose(1, 2))], dim=-1) * scale  # fmt: skip
    scores = scores.view(num_kv_heads, n, group, -1)  # (kv_heads, n, group, k)
    if visible is not None:
        scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if visible is not None:
        probs = probs.nan_to_num(0.0)  # a row with no visible key: all -inf, NaN -> 0
    out = torch.bmm(probs.view(num_kv_heads, n * group, -1), values.float().transpose(0, 1))  # (kv, n * group, dim)
    return out.view(num_kv_heads, n, group, dim).transpose(0, 1).reshape(n, num_q_heads, dim).to(q.dtype)
