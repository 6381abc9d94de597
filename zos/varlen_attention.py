"""Packed variable-length causal attention over a slot-indexed KV cache, for prefill and mixed
batches (kernel in ``triton_kernels/varlen_attention.py``).

Each sequence's queries attend only to that sequence's keys, read from the cache through a
per-key slot index; no mask tensor, no gather of the keys, no repeat of KV heads. This is the
attention of a step whose requests have several query tokens (a prefill chunk) next to
one-token rows, as FlashAttention's ``flash_attn_varlen_func`` computes it over gathered keys
and FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` over pages. The grid depends on tensor
shapes only (CUDA-graph capturable with padded shapes).
"""
from zos._interpret import interpreted  # sets TRITON_INTERPRET before triton is imported

import torch
import triton

from zos.attention import check_dtypes, check_out, check_same_kv, check_scale
from zos.triton_kernels.varlen_attention import varlen_attention_kernel

__all__ = ["varlen_attention"]

_LOG2E = 1.4426950408889634
_NUM_WARPS = 4
_NUM_STAGES = 2
_BLOCK_S = 128  # sequences per step of the kernel's (sequence, tile) search


def _check(q, k_cache, v_cache, kv_slots, cu_seqlens_q, cu_seqlens_k, scale, out) -> None:
    where = "varlen_attention"
    named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("kv_slots", kv_slots),
             ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    for name, t in named + ((("out", out),) if out is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or min(q.shape[1:]) < 1:
        raise ValueError(f"{where}: q must be [T_q, num_heads, head_dim], got shape "
                         f"{tuple(q.shape)}")
    if k_cache.dim() != 3 or min(k_cache.shape) < 1:
        raise ValueError(f"{where}: k_cache must be [num_slots, num_kv_heads, head_dim], got "
                         f"shape {tuple(k_cache.shape)}")
    check_same_kv(where, k_cache, v_cache)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{where}: {name} must be contiguous, got strides "
                             f"{tuple(t.stride())}")
    hkv, hd = k_cache.shape[1:]
    if q.shape[2] != hd:
        raise ValueError(f"{where}: q head_dim {q.shape[2]} != k_cache head_dim {hd}")
    if q.shape[1] % hkv != 0:
        raise ValueError(f"{where}: q num_heads {q.shape[1]} must be a multiple of k_cache "
                         f"num_kv_heads {hkv}")
    check_dtypes(where, q, k_cache, "k_cache")
    if kv_slots.dim() != 1 or kv_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{where}: kv_slots must be 1-D int32 or int64, got shape "
                         f"{tuple(kv_slots.shape)} {kv_slots.dtype}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t.dim() != 1 or t.shape[0] < 2:
            raise ValueError(f"{where}: {name} must be 1-D [num_seqs + 1] with num_seqs >= 1, "
                             f"got shape {tuple(t.shape)}")
        if t.dtype != torch.int32:
            raise TypeError(f"{where}: {name} must be int32, got {t.dtype}")
    for name, t in (("kv_slots", kv_slots), ("cu_seqlens_q", cu_seqlens_q),
                    ("cu_seqlens_k", cu_seqlens_k)):
        if t.shape[0] > 1 and t.stride(0) != 1:  # the kernel reads them as dense arrays
            raise ValueError(f"{where}: {name} must be contiguous, got stride {t.stride(0)}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"{where}: cu_seqlens_k shape {tuple(cu_seqlens_k.shape)} != "
                         f"cu_seqlens_q shape {tuple(cu_seqlens_q.shape)}")
    check_out(where, out, q)
    for name, t in named[:1] + named[2:] + ((("out", out),) if out is not None else ()):
        if t.device != k_cache.device:
            raise ValueError(f"{where}: {name} is on {t.device}, k_cache on {k_cache.device}")
    check_scale(where, scale)


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     kv_slots: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, scale: float, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed sequences, keys read from a cache through slot indices.

    Args:
        q: ``[T_q, num_heads, head_dim]``, bfloat16 / float16 / float32, any strides. Rows
            ``cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1`` are sequence ``s``'s queries; its
            query ``i`` sits at position ``kv_len - q_len + i`` (``q_len``, ``kv_len``: its
            query and key counts) and attends to its keys ``0 ..`` that position (causal,
            aligned to the last key, as transformers' continuous-batching mask and
            FlashAttention's causal varlen). Rows past ``cu_seqlens_q[-1]`` (padding) belong
            to no sequence.
        k_cache, v_cache: ``[num_slots, num_kv_heads, head_dim]`` each, q's dtype, contiguous
            (transformers' ``PagedAttentionCache.key_cache[i]`` / ``value_cache[i]``); not
            written. GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
        kv_slots: int32 / int64 ``[T_k]``, contiguous: key ``j`` of sequence ``s`` is slot
            ``kv_slots[cu_seqlens_k[s] + j]`` of the caches (values not checked on the host).
        cu_seqlens_q, cu_seqlens_k: int32 ``[num_seqs + 1]``, contiguous, cumulative query and
            key counts from 0, nondecreasing, each sequence with ``q_len <= kv_len`` (not
            checked on the host: no device value is read; the kernel never reads a query row
            ``>= T_q`` or a ``kv_slots`` entry ``>= T_k``). A sequence with ``q_len = 0``
            (padding) writes nothing.
        scale: softmax scale of ``q . k`` (usually ``head_dim ** -0.5``), a Python float.
        out: optional ``[T_q, num_heads, head_dim]`` in q's dtype on q's device; the rows of
            sequences are written in place, other rows are left as they are. None: a zeroed
            tensor is allocated (rows of no sequence stay 0).

    Returns:
        ``out``.

    Raises:
        TypeError: a non-tensor argument; q's or out's dtype not the caches'; caches not
            bf16/fp16/fp32; cu_seqlens not int32; scale not a float.
        ValueError: a shape mismatch (q not 3-D, caches not 3-D or different, head_dim,
            num_heads not a multiple of num_kv_heads, kv_slots not 1-D int32/int64, cu_seqlens
            not 1-D with >= 2 entries or of different lengths, out's shape), non-contiguous
            caches, kv_slots or cu_seqlens, tensors on different devices, scale not finite and
            > 0.
    """
    _check(q, k_cache, v_cache, kv_slots, cu_seqlens_q, cu_seqlens_k, scale, out)
    t_q, hq, hd = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    num_seqs = cu_seqlens_q.shape[0] - 1
    if out is None:
        out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    if t_q == 0:
        return out
    interp = interpreted(varlen_attention_kernel, q.device)
    block_m = max(64, triton.next_power_of_2(group))
    block_q = block_m // group
    block_n = 32 if q.dtype == torch.float32 else 64
    ieee_dot = q.dtype == torch.float32 or interp
    grid = (triton.cdiv(t_q, block_q) + num_seqs, hkv)
    varlen_attention_kernel[grid](
        q, k_cache, v_cache, kv_slots, cu_seqlens_q, cu_seqlens_k, out,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        num_seqs, t_q, kv_slots.shape[0], float(scale) * _LOG2E,
        NUM_KV_HEADS=hkv, HEAD_DIM=hd, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(hd)),
        BLOCK_S=_BLOCK_S, IEEE_DOT=ieee_dot,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)
    return out
