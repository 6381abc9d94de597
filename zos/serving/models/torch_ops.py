"""The paged Llama's kernels as plain torch ops: what the model runs on a CPU.

On a CPU Triton runs kernels in its interpreter, one program at a time, which makes the fused
model kernels (:mod:`.fused`) and the Triton paged attention the slowest part of a step. The
functions here compute the same values with plain torch ops (same signatures, same checks, same
roundings as the torch formulas the fused kernels are tested against), so a CPU run spends its
time in torch's own CPU kernels. zos's prep kernels are not replaced: they still run in the
interpreter, so a CPU run still goes through zos's code path.

* :func:`rms_norm`, :func:`rope_and_store_kv`, :func:`silu_and_mul`: as :mod:`.fused`
  (argument checks are :mod:`.fused`'s own helpers, so both accept and refuse the same input).
* :func:`decode_attention`: uniform-decode attention through the block table: each request
  row's K/V gathered from its blocks (columns ``j < cdiv(max(seq_lens), block_size)``), keys
  past the row's position masked, softmax in float32, as :func:`.attention.prefill_attention`.

These ops read device values on the host (the longest sequence, the slots to write), so a
model running them is not CUDA-graph capturable; :class:`.llama.LlamaForCausalLM` picks them on
a CPU only, unless told otherwise (``kernels="torch"``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from zos.buffers import StepMetadata

from . import fused
from .attention import _attend, _check_attn

__all__ = ["decode_attention", "rms_norm", "rope_and_store_kv", "silu_and_mul"]


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """:func:`.fused.rms_norm` in torch ops: ``weight * (xf * rsqrt(mean(xf^2) + eps)).to(
    x.dtype)`` with ``xf = x.float()``; with ``residual`` ``(norm(s), s)`` for ``s = x +
    residual`` in x's dtype.

    Args:
        x: ``[T, hidden]`` float32 / bfloat16 / float16. Not written.
        weight: ``[hidden]``, x's dtype and device.
        eps: added to the mean square.
        residual: optional ``[T, hidden]``, x's dtype and device. Not written.

    Returns:
        ``[T, hidden]`` new tensor of x's dtype; ``(out, s)`` with ``residual``.

    Raises:
        TypeError, ValueError: as :func:`.fused.rms_norm` (the same checks).
    """
    fused.check_rms_norm(x, weight, residual)
    if residual is None:
        return _norm(x, weight, eps).contiguous()
    s = x + residual
    return _norm(s, weight, eps).contiguous(), s.contiguous()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x ``[T, H, D]`` with cos/sin ``[T, 1, D]`` (products and sum in x's
    dtype)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_and_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                      num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """:func:`.fused.rope_and_store_kv` in torch ops: rotate-half RoPE on q and k, rotated k
    and v written to ``kv_cache`` at ``slot_mapping``.

    Args:
        qkv: ``[T, (num_heads + 2 * num_kv_heads) * head_dim]``. Not written.
        cos, sin: ``[T, head_dim]`` in qkv's dtype.
        kv_cache: ``[2, num_kv_blocks, block_size, num_kv_heads, head_dim]``, qkv's dtype,
            contiguous; written in place at the slots of ``slot_mapping`` only.
        slot_mapping: int64 ``[T]``; a slot ``< 0`` (PAD_SLOT_ID) or ``>= num_kv_blocks *
            block_size`` writes nothing. Slots are read on the host.
        num_heads, num_kv_heads, head_dim: positive; head_dim even.

    Returns:
        Rotated q, a new contiguous ``[T, num_heads, head_dim]`` tensor of qkv's dtype.

    Raises:
        TypeError, ValueError: as :func:`.fused.rope_and_store_kv` (the same checks).
    """
    fused.check_rope_and_store_kv(qkv, cos, sin, kv_cache, slot_mapping, num_heads,
                                  num_kv_heads, head_dim)
    t, hq, hkv, hd = qkv.shape[0], num_heads, num_kv_heads, head_dim
    c, s = cos[:, None, :], sin[:, None, :]
    q = _rotate(qkv[:, :hq * hd].reshape(t, hq, hd), c, s).contiguous()
    k = _rotate(qkv[:, hq * hd:(hq + hkv) * hd].reshape(t, hkv, hd), c, s)
    v = qkv[:, (hq + hkv) * hd:].reshape(t, hkv, hd)
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    keep = (slot_mapping >= 0) & (slot_mapping < num_slots)
    slots = slot_mapping[keep]
    kv_cache[0].view(num_slots, hkv, hd)[slots] = k[keep]
    kv_cache[1].view(num_slots, hkv, hd)[slots] = v[keep]
    return q


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`.fused.silu_and_mul` in torch ops: ``F.silu(gate) * up`` for ``gate, up =
    gate_up.chunk(2, -1)``.

    Args:
        gate_up: ``[T, 2 * I]`` float32 / bfloat16 / float16. Not written.

    Returns:
        A new contiguous ``[T, I]`` tensor of gate_up's dtype.

    Raises:
        TypeError, ValueError: as :func:`.fused.silu_and_mul` (the same checks).
    """
    fused.check_silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) * up).contiguous()


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: StepMetadata,
                     scale: float) -> torch.Tensor:
    """Uniform-decode paged attention through the block table, in torch ops (the values of
    :func:`.attention.decode_attention`, computed another way).

    Args:
        q: ``[T, num_heads, head_dim]`` with ``T = R * q_len``; token row ``r * q_len + t`` of
            request row ``r`` sits at position ``p = seq_lens[r] - q_len + t`` and attends to
            key positions ``0 .. max(p, 0)`` (a negative position, a dummy row with seq_len 1
            and q_len 2, attends to key 0 only, as the Triton kernel does).
        kv_cache: one layer's cache ``[2, num_kv_blocks, block_size, num_kv_heads, head_dim]``,
            q's dtype, already holding this step's K/V. Not written.
        meta: ``block_table`` int32 ``[R, W]`` (columns ``j < cdiv(seq_lens[r], block_size)``
            of row ``r`` are read; the others, null or stale blocks, are not), ``seq_lens``
            int32 ``[R]`` in ``[1, W * block_size]`` (read on the host).
        scale: softmax scale.

    Returns:
        ``[T, num_heads, head_dim]`` in q's dtype (computed in float32).

    Raises:
        ValueError: shape or device mismatches, T not a multiple of R, a seq_len outside
            ``[1, W * block_size]``. TypeError: dtypes.
    """
    where = "decode_attention"
    _check_attn(q, kv_cache, meta, where)
    bt, seq_lens = meta.block_table, meta.seq_lens
    r, w = bt.shape
    bs = kv_cache.shape[2]
    if r == 0 or q.shape[0] % r:
        raise ValueError(f"{where}: q has T={q.shape[0]} token rows, which must be a positive "
                         f"multiple of R={r} (block_table rows)")
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 1 or hi > w * bs:
        raise ValueError(f"{where}: seq_lens must be in [1, W * block_size = {w * bs}], got "
                         f"min {lo}, max {hi}")
    q_len, hkv, hd = q.shape[0] // r, kv_cache.shape[3], kv_cache.shape[4]
    width = -(-hi // bs)
    cols = torch.arange(width, device=bt.device)
    used = cols[None, :] < (seq_lens[:, None] + bs - 1) // bs  # columns that hold the row's keys
    idx = torch.where(used, bt[:, :width], 0).long()  # the others: never read, index 0
    k = kv_cache[0][idx].reshape(r, width * bs, hkv, hd)
    v = kv_cache[1][idx].reshape(r, width * bs, hkv, hd)
    pos = seq_lens[:, None] - q_len + torch.arange(q_len, device=bt.device)[None, :]  # [R, Lq]
    keys = torch.arange(width * bs, device=bt.device)
    allowed = keys[None, None, :] <= pos.clamp(min=0)[:, :, None]  # [R, Lq, Lk]
    out = _attend(q.reshape(r, q_len, q.shape[1], hd), k, v, allowed, scale)
    return out.reshape(q.shape)
