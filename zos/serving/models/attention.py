"""Paged attention for the zos Llama: KV-cache allocation, KV write, decode and prefill.

The metadata is :class:`zos.buffers.StepMetadata` (decode: views of the static buffers;
prefill: built by the runner with the host lists ``query_lens_host`` / ``seq_lens_host``).

KV cache of one layer: ``[2, num_kv_blocks, block_size, num_kv_heads, head_dim]``, K at ``[0]``,
V at ``[1]``. Block 0 is the reserved null block (dummy rows point at it, nothing real is ever
written there). A flat slot is ``block_id * block_size + offset``.
GQA convention (as transformers' ``repeat_kv``): query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``.
"""
from __future__ import annotations

import zos._interpret  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import torch
import triton

from zos._checks import check_int
from zos.attention import paged_decode_attention
from zos.buffers import StepMetadata
from zos.triton_kernels.kv_cache import store_kv_kernel


def allocate_kv_cache(num_layers: int, num_kv_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Allocate zero-initialised paged KV caches.

    Returns ``num_layers`` tensors, each ``[2, num_kv_blocks, block_size, num_kv_heads,
    head_dim]`` of ``dtype`` on ``device`` (K at index 0, V at index 1). Raises TypeError if a
    size is not an int, ValueError if it is < 1 (``check_int``).
    """
    for name, val in (("num_layers", num_layers), ("num_kv_blocks", num_kv_blocks),
                      ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim)):
        check_int(f"allocate_kv_cache: {name}", val)
    shape = (2, num_kv_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def _check_cache(kv_cache: torch.Tensor, where: str) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"{where}: kv_cache must be [2, num_kv_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {tuple(kv_cache.shape)}")


def _check_types(where: str, kv_cache: torch.Tensor, tensors: dict) -> None:
    """TypeError for a dtype other than the expected one, ValueError for another device."""
    for name, (t, dtype) in tensors.items():
        if t.dtype != dtype:
            raise TypeError(f"{where}: {name} must be {dtype}, got {t.dtype}")
        if t.device != kv_cache.device:
            raise ValueError(f"{where}: {name} is on {t.device}, kv_cache on {kv_cache.device}")


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each token row's K and V into its paged-cache slot (one Triton launch, no host sync).

    Args:
        k, v: ``[T, num_kv_heads, head_dim]``, same dtype as ``kv_cache``; each row's
            ``num_kv_heads * head_dim`` values contiguous (a row stride is allowed).
        kv_cache: ``[2, num_kv_blocks, block_size, num_kv_heads, head_dim]``, contiguous; written in
            place at the slots of ``slot_mapping``.
        slot_mapping: int64 ``[T]``, any stride (copied first unless contiguous); rows with
            slot ``< 0`` (PAD_SLOT_ID) or ``>= num_kv_blocks * block_size`` write nothing.

    Raises:
        ValueError: a shape or device mismatch, a non-contiguous cache (names the field).
        TypeError: a dtype mismatch (names the field).
    """
    _check_cache(kv_cache, "store_kv")
    if not kv_cache.is_contiguous():
        raise ValueError("store_kv: kv_cache must be contiguous")
    _, num_kv_blocks, block_size, hkv, hd = kv_cache.shape
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (hkv, hd) or t.shape[0] != k.shape[0]:
            raise ValueError(f"store_kv: {name} must be [{k.shape[0]}, {hkv}, {hd}], got "
                             f"{tuple(t.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"store_kv: slot_mapping must be [{k.shape[0]}], got "
                         f"{tuple(slot_mapping.shape)}")
    _check_types("store_kv", kv_cache, {"k": (k, kv_cache.dtype), "v": (v, kv_cache.dtype),
                                        "slot_mapping": (slot_mapping, torch.int64)})
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k = k if k.stride(2) == 1 and k.stride(1) == hd else k.contiguous()
    v = v if v.stride(2) == 1 and v.stride(1) == hd else v.contiguous()
    if slot_mapping.stride(0) != 1:  # the kernel reads row t's slot at offset t
        slot_mapping = slot_mapping.contiguous()
    row_size = hkv * hd
    block = min(triton.next_power_of_2(row_size), 1024)
    grid = (num_tokens, triton.cdiv(row_size, block))
    store_kv_kernel[grid](k, v, kv_cache[0], kv_cache[1], slot_mapping, k.stride(0), v.stride(0),
                          row_size, num_kv_blocks * block_size, BLOCK=block)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Masked GQA attention in float32 over a batch of requests.

    q ``[B, Lq, Hq, D]``, k/v ``[B, Lk, Hkv, D]``, allowed bool ``[B, Lq, Lk]`` (True = may attend);
    returns ``[B, Lq, Hq, D]`` in q's dtype.
    """
    b, lq, hq, d = q.shape
    hkv = k.shape[2]
    qf = q.float().reshape(b, lq, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, Lq, D]
    kf = k.float().permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, Lk, D]
    vf = v.float().permute(0, 2, 1, 3).unsqueeze(2)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, Hkv, G, Lq, Lk]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf)  # [B, Hkv, G, Lq, D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, lq, hq, d).to(q.dtype)


def _check_attn(q: torch.Tensor, kv_cache: torch.Tensor, meta: StepMetadata,
                where: str) -> None:
    _check_cache(kv_cache, where)
    hkv, hd = kv_cache.shape[3], kv_cache.shape[4]
    if q.dim() != 3 or q.shape[2] != hd or q.shape[1] % hkv != 0:
        raise ValueError(f"{where}: q must be [T, num_heads, {hd}] with num_heads a multiple of "
                         f"{hkv}, got {tuple(q.shape)}")
    bt = meta.block_table
    if bt.dim() != 2 or meta.seq_lens.shape != (bt.shape[0],):
        raise ValueError(f"{where}: block_table must be [R, W] and seq_lens [R], got "
                         f"{tuple(bt.shape)} and {tuple(meta.seq_lens.shape)}")
    _check_types(where, kv_cache, {"q": (q, kv_cache.dtype), "block_table": (bt, torch.int32),
                                   "seq_lens": (meta.seq_lens, torch.int32)})


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: StepMetadata,
                     scale: float) -> torch.Tensor:
    """Uniform-decode paged attention: :func:`zos.attention.paged_decode_attention` (Triton,
    flash-decoding) on ``meta.block_table`` and ``meta.seq_lens``, no gather; static shapes,
    no host sync (CUDA-graph capturable), and the same kernel in Triton's CPU interpreter.

    Args:
        q: ``[T, num_heads, head_dim]`` with ``T = R * q_len``; token row ``r * q_len + t``
            belongs to request row ``r`` and sits at position ``seq_lens[r] - q_len + t``
            (causal inside the ``q_len`` tokens; a negative position attends to key 0 only).
        kv_cache: one layer's cache ``[2, num_kv_blocks, block_size, num_kv_heads, head_dim]``,
            same dtype as q, already holding this step's K/V (see :func:`store_kv`). Not
            written. Only the blocks covering positions < seq_len of each row are read (a dummy
            row, seq_len 1 and a null row, reads block 0 only).
        meta: uses ``block_table`` int32 ``[R, W]`` and ``seq_lens`` int32 ``[R]``.
        scale: softmax scale (usually ``head_dim ** -0.5``).

    Returns:
        ``[T, num_heads, head_dim]`` in q's dtype (computed in float32).

    Raises:
        ValueError / TypeError: shape, device or dtype mismatches (from the launcher).
    """
    return paged_decode_attention(q, kv_cache, meta.block_table, meta.seq_lens, scale)


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: StepMetadata,
                      scale: float) -> torch.Tensor:
    """Eager variable-length prefill attention over the paged cache (not capturable).

    Request ``i`` owns the ``query_lens_host[i]`` packed token rows starting at the running sum
    of earlier query lengths; its sequence has ``seq_lens_host[i]`` tokens (cached context plus
    this step's), so its queries sit at positions ``seq_len - query_len .. seq_len - 1`` and
    attend causally to all earlier positions. K/V are read through ``block_table[i]`` after
    :func:`store_kv` (so this also serves chunked prefill and recompute after preemption).

    Args:
        q: ``[T, num_heads, head_dim]``, ``T = sum(query_lens_host)``.
        kv_cache: one layer's cache ``[2, num_kv_blocks, block_size, num_kv_heads, head_dim]``.
        meta: ``block_table`` int32 ``[R, W]``, ``seq_lens`` int32 ``[R]`` (checked for shape
            only), host lists ``query_lens_host`` / ``seq_lens_host`` of length R.
        scale: softmax scale.

    Returns:
        ``[T, num_heads, head_dim]`` in q's dtype (computed in float32).

    Raises:
        ValueError: host lists missing or inconsistent (lengths, sum != T, query_len > seq_len,
            seq_len beyond W * block_size), shape or device mismatches. TypeError: dtypes.
    """
    _check_attn(q, kv_cache, meta, "prefill_attention")
    qls, sls = meta.query_lens_host, meta.seq_lens_host
    r, w = meta.block_table.shape
    if qls is None or sls is None:
        raise ValueError("prefill_attention: meta.query_lens_host and meta.seq_lens_host are "
                         "required")
    if len(qls) != r or len(sls) != r:
        raise ValueError(f"prefill_attention: query_lens_host/seq_lens_host must have R={r} "
                         f"entries, got {len(qls)} and {len(sls)}")
    if sum(qls) != q.shape[0]:
        raise ValueError(f"prefill_attention: sum(query_lens_host)={sum(qls)} != T={q.shape[0]}")
    bs = kv_cache.shape[2]
    hkv, hd = kv_cache.shape[3], kv_cache.shape[4]
    out = torch.empty_like(q)
    start = 0
    for i, (ql, sl) in enumerate(zip(qls, sls)):
        if not 0 <= ql <= sl or sl > w * bs:
            raise ValueError(f"prefill_attention: request {i} has query_len {ql}, seq_len {sl} "
                             f"(need 0 <= query_len <= seq_len <= W * block_size = {w * bs})")
        if ql == 0:
            continue
        nb = -(-sl // bs)
        idx = meta.block_table[i, :nb].long()
        k = kv_cache[0].index_select(0, idx).reshape(nb * bs, hkv, hd)[:sl]
        v = kv_cache[1].index_select(0, idx).reshape(nb * bs, hkv, hd)[:sl]
        qpos = torch.arange(sl - ql, sl, device=q.device)
        allowed = torch.arange(sl, device=q.device)[None, :] <= qpos[:, None]
        out[start:start + ql] = _attend(q[None, start:start + ql], k[None], v[None],
                                        allowed[None], scale)[0]
        start += ql
    return out
