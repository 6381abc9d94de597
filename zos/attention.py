"""Paged decode attention in Triton (flash-decoding with split-KV), CUDA-graph capturable.

:func:`paged_decode_attention` computes the same outputs as the gather-based reference
``decode_attention`` of the serving model (zos/serving/models/attention.py) but reads only the
blocks each request row owns (no gather of all ``W`` block-table columns); kernels in
``triton_kernels/paged_attention.py``. The launch grid depends only on tensor shapes and fixed
constants, never on device values, so a call can be captured once in a CUDA graph and replayed
with new ``seq_lens`` / ``block_table`` contents.
"""
from zos._interpret import interpreted  # sets TRITON_INTERPRET before triton is imported

import math

import torch
import triton

from zos._checks import check_int
from zos.triton_kernels.paged_attention import (
    paged_decode_reduce_kernel,
    paged_decode_split_kernel,
)

__all__ = ["default_num_splits", "paged_decode_attention", "paged_decode_attention_kv"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LOG2E = 1.4426950408889634

# Default split rule: aim for _TARGET_PROGRAMS split programs (132 SMs of an H100/H200 x 4
# resident programs each), give every split at least _MIN_TILES_PER_SPLIT tiles of the longest
# addressable context (W * block_size), and never more than _MAX_SPLITS splits. Fixed constants
# (not the device's SM count) keep the grid a function of shapes only.
_NUM_SMS = 132
_PROGRAMS_PER_SM = 4
_TARGET_PROGRAMS = _NUM_SMS * _PROGRAMS_PER_SM
_MIN_TILES_PER_SPLIT = 4
_MAX_SPLITS = 64
_NUM_WARPS = 4
_NUM_STAGES = 2


def _block_n(dtype: torch.dtype) -> int:
    """Keys per tile: 64 for 16-bit caches, 32 for float32 (same bytes per tile)."""
    return 32 if dtype == torch.float32 else 64


def default_num_splits(num_reqs: int, num_kv_heads: int, max_blocks: int, block_size: int,
                       block_n: int = 64) -> int:
    """Number of KV splits used when ``num_splits`` is None.

    ``cdiv(_TARGET_PROGRAMS, num_reqs * num_kv_heads)`` (enough ``(row, kv_head, split)``
    programs to fill 132 SMs x 4), capped at ``tiles // _MIN_TILES_PER_SPLIT`` where ``tiles =
    cdiv(max_blocks * block_size, block_n)`` (each split spans at least 4 tiles of the longest
    context the block table can address) and at ``_MAX_SPLITS`` (64); at least 1. Depends on
    shapes only, never on ``seq_lens`` values.
    """
    tiles = triton.cdiv(max_blocks * block_size, block_n)
    want = triton.cdiv(_TARGET_PROGRAMS, max(1, num_reqs * num_kv_heads))
    cap = min(_MAX_SPLITS, max(1, tiles // _MIN_TILES_PER_SPLIT))
    return max(1, min(want, cap))



def _need_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"paged_decode_attention: {name} must be a torch.Tensor, got "
                        f"{type(t).__name__}")


def check_same_kv(where: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError (prefixed ``where``) unless ``v_cache`` matches ``k_cache`` in shape, dtype and
    device: the rule of every launcher over separate K and V caches."""
    if (v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype
            or v_cache.device != k_cache.device):
        raise ValueError(f"{where}: v_cache must match k_cache in shape, dtype and device, got "
                         f"{tuple(v_cache.shape)} {v_cache.dtype} {v_cache.device} against "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} {k_cache.device}")


def check_dtypes(where: str, q: torch.Tensor, cache: torch.Tensor, cache_name: str) -> None:
    """TypeError (prefixed ``where``) unless ``cache`` is bfloat16, float16 or float32 and ``q``
    has its dtype: the kernels' loads and dots assume one float dtype."""
    if cache.dtype not in _DTYPES:
        raise TypeError(f"{where}: {cache_name} dtype must be bfloat16, float16 or float32, got "
                        f"{cache.dtype}")
    if q.dtype != cache.dtype:
        raise TypeError(f"{where}: q dtype {q.dtype} != {cache_name} dtype {cache.dtype}")


def check_out(where: str, out: torch.Tensor | None, q: torch.Tensor) -> None:
    """ValueError / TypeError (prefixed ``where``) unless ``out`` is None or has ``q``'s shape
    and dtype (the launchers write it in place)."""
    if out is None:
        return
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"{where}: out must have q's shape {tuple(q.shape)}, got "
                         f"{tuple(out.shape)}")
    if out.dtype != q.dtype:
        raise TypeError(f"{where}: out dtype {out.dtype} != q dtype {q.dtype}")


def check_scale(where: str, scale) -> None:
    """TypeError unless ``scale`` is a Python int or float (not bool), ValueError unless it is
    finite and > 0 (prefixed ``where``)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{where}: scale must be a Python float, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{where}: scale must be finite and > 0, got {scale}")


def _check_args(q, kv_cache, block_table, seq_lens, scale, out, num_splits) -> None:
    """Checks of :func:`paged_decode_attention` (one ``[2, ...]`` cache); reads no device value."""
    where = "paged_decode_attention"
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        _need_tensor(name, t)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"{where}: kv_cache must be [2, num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got shape {tuple(kv_cache.shape)}")
    _check_common(where, "kv_cache", kv_cache, q, block_table, seq_lens, scale, out, num_splits)


def _check_kv_args(q, k_cache, v_cache, block_table, seq_lens, scale, out, num_splits) -> None:
    """Checks of :func:`paged_decode_attention_kv` (separate K and V caches)."""
    where = "paged_decode_attention_kv"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _need_tensor(name, t)
    if k_cache.dim() != 4:
        raise ValueError(f"{where}: k_cache must be [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got shape {tuple(k_cache.shape)}")
    check_same_kv(where, k_cache, v_cache)
    if not v_cache.is_contiguous():
        raise ValueError(f"{where}: v_cache must be contiguous, got strides "
                         f"{tuple(v_cache.stride())}")
    _check_common(where, "k_cache", k_cache, q, block_table, seq_lens, scale, out, num_splits,
                  lead=0)


def _check_common(where, cache_name, cache, q, block_table, seq_lens, scale, out, num_splits,
                  lead=1) -> None:
    """Shape, dtype, device and layout checks shared by both entry points; ``cache`` is
    ``[2, nb, bs, hkv, hd]`` (lead = 1) or ``[nb, bs, hkv, hd]`` (lead = 0)."""
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        _need_tensor(name, t)
    if out is not None:
        _need_tensor("out", out)
    num_blocks, block_size, hkv, hd = cache.shape[lead:]
    if min(num_blocks, block_size, hkv, hd) < 1:
        raise ValueError(f"{where}: {cache_name} has an empty dimension, shape "
                         f"{tuple(cache.shape)}")
    if q.dim() != 3:
        raise ValueError(f"{where}: q must be 3-D [T, num_heads, head_dim], got shape "
                         f"{tuple(q.shape)}")
    if q.shape[2] != hd:
        raise ValueError(f"{where}: q head_dim {q.shape[2]} != {cache_name} head_dim {hd} "
                         f"(q shape {tuple(q.shape)}, {cache_name} shape {tuple(cache.shape)})")
    if q.shape[1] < 1 or q.shape[1] % hkv != 0:
        raise ValueError(f"{where}: q num_heads {q.shape[1]} must be a positive multiple of "
                         f"{cache_name} num_kv_heads {hkv}")
    if block_table.dim() != 2:
        raise ValueError(f"{where}: block_table must be 2-D [R, W], got shape "
                         f"{tuple(block_table.shape)}")
    r, w = block_table.shape
    if r < 1 or w < 1:
        raise ValueError(f"{where}: block_table must have R >= 1 rows and W >= 1 columns, got "
                         f"shape {tuple(block_table.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != r:
        raise ValueError(f"{where}: seq_lens must be 1-D [R={r}], got shape "
                         f"{tuple(seq_lens.shape)}")
    if q.shape[0] < r or q.shape[0] % r != 0:
        raise ValueError(f"{where}: q has T={q.shape[0]} token rows, which must be a positive "
                         f"multiple of R={r} (block_table rows)")
    check_dtypes(where, q, cache, cache_name)
    if block_table.dtype != torch.int32:
        raise TypeError(f"{where}: block_table must be int32, got {block_table.dtype}")
    if seq_lens.dtype != torch.int32:
        raise TypeError(f"{where}: seq_lens must be int32, got {seq_lens.dtype}")
    check_out(where, out, q)
    named = [("q", q), ("block_table", block_table), ("seq_lens", seq_lens)]
    if out is not None:
        named.append(("out", out))
    for name, t in named:
        if t.device != cache.device:
            raise ValueError(f"{where}: {name} is on {t.device}, {cache_name} on {cache.device}")
    if not cache.is_contiguous():
        raise ValueError(f"{where}: {cache_name} must be contiguous, got strides "
                         f"{tuple(cache.stride())}")
    check_scale(where, scale)
    if num_splits is not None:
        check_int(f"{where}: num_splits", num_splits)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, *,
                           out: torch.Tensor | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Uniform-decode paged attention over one layer's KV cache (flash-decoding, split-KV).

    Algorithm: flash-decoding (Dao, Haziza, Massa, Sizov, 2023, "Flash-Decoding for
    long-context inference"): each request row's keys are cut into ``num_splits`` contiguous
    ranges processed in parallel with an online softmax, each writing a float32 partial output
    and its log-sum-exp; a second kernel combines the splits, as in vLLM's paged attention v2
    and FlashInfer's split-KV decode. All query heads of one KV-head group (and all ``q_len``
    tokens of a row) are processed together, so each K/V tile is read once per group. Only the
    blocks covering positions ``< seq_len`` are read. Computed in float32. No host sync and no
    host read of device values; the grid depends on shapes only (CUDA-graph capturable).

    Args:
        q: ``[T, num_heads, head_dim]``, bfloat16 / float16 / float32 (same dtype as
            ``kv_cache``), any strides. ``T = R * q_len``: token row ``r * q_len + t`` belongs
            to request row ``r`` and sits at position ``seq_lens[r] - q_len + t``; it attends
            causally to key positions ``0 ..`` its position (inclusive). A position < 0 (e.g. a
            dummy row with seq_len 1 and q_len 2) is clamped to 0 (attends to key 0 only).
        kv_cache: one layer's cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous, K at ``[0]``, V at ``[1]``; block 0 is the null block. Not written.
            GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
        block_table: int32 ``[R, W]``, block ids (in ``[0, num_blocks)``, not checked) of each
            request row; only columns ``j < cdiv(seq_lens[r], block_size)`` are read. Any
            strides (copied first unless its rows are contiguous).
        seq_lens: int32 ``[R]``, any stride (copied first unless contiguous, e.g. a column of
            a wider tensor), tokens of each row's sequence including this step's, in
            ``[1, W * block_size]`` (not checked on the host; the kernel clamps to that range,
            so bad values never read outside the row's block-table columns). Dummy rows:
            seq_len 1 and a row of null blocks (reads block 0 only).
        scale: softmax scale applied to ``q . k`` (usually ``head_dim ** -0.5``), a Python
            float.
        out: optional ``[T, num_heads, head_dim]`` in q's dtype on q's device (any strides);
            written in place and returned. Allocated when None.
        num_splits: number of KV splits (>= 1); None picks :func:`default_num_splits` from
            ``R``, ``num_kv_heads`` and ``W`` on a GPU, and 1 in Triton's CPU interpreter.
            Capped at the number of ``BLOCK_N``-token tiles in ``W * block_size``. With 1 split
            the result is written directly (no reduce).

    Returns:
        ``out``: ``[T, num_heads, head_dim]`` in q's dtype.

    Scratch: with more than one split, two float32 buffers are allocated per call,
    ``[T, num_heads, num_splits, head_dim]`` (partial outputs) and ``[T, num_heads,
    num_splits]`` (log-sum-exp), with ``torch.empty`` (the caching allocator; inside a CUDA
    graph capture they come from the graph's private pool and stay valid for replays).

    Raises:
        TypeError: a non-tensor argument, a dtype other than the expected one (q vs kv_cache,
            kv_cache not bf16/fp16/fp32, block_table / seq_lens not int32, out vs q), scale not
            a float, num_splits not an int. The message names the argument and the value.
        ValueError: a shape mismatch (q not 3-D, kv_cache not ``[2, ...]`` 5-D, head_dim
            mismatch, num_heads not a multiple of num_kv_heads, block_table not 2-D or empty,
            seq_lens not ``[R]``, T not a positive multiple of R, out's shape), tensors on
            different devices, a non-contiguous kv_cache, scale not finite and > 0,
            num_splits < 1.
    """
    _check_args(q, kv_cache, block_table, seq_lens, scale, out, num_splits)
    return _launch(q, kv_cache[0], kv_cache[1], block_table, seq_lens, scale, out, num_splits)


def paged_decode_attention_kv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                              *, out: torch.Tensor | None = None,
                              num_splits: int | None = None) -> torch.Tensor:
    """:func:`paged_decode_attention` over separate K and V caches (the same kernels, no copy).

    For runners that keep one tensor per layer for keys and one for values, such as
    transformers' ``PagedAttentionCache`` (``key_cache[i]``: ``[(num_blocks + 2) * block_size,
    num_kv_heads, head_dim]``, viewed as ``[num_blocks + 2, block_size, num_kv_heads,
    head_dim]``).

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` each, contiguous,
            same shape, dtype and device; not written. Block ids in ``block_table`` index them.
        q, block_table, seq_lens, scale, out, num_splits: as :func:`paged_decode_attention`.

    Returns:
        ``out``: ``[T, num_heads, head_dim]`` in q's dtype.

    Raises:
        TypeError, ValueError: as :func:`paged_decode_attention`, naming ``k_cache`` for the
            cache checks; ValueError if ``v_cache`` differs from ``k_cache`` in shape, dtype or
            device, or is not contiguous.
    """
    _check_kv_args(q, k_cache, v_cache, block_table, seq_lens, scale, out, num_splits)
    return _launch(q, k_cache, v_cache, block_table, seq_lens, scale, out, num_splits)


def _launch(q, k_cache, v_cache, block_table, seq_lens, scale, out, num_splits) -> torch.Tensor:
    """Launch the split (and reduce) kernels on checked arguments; caches ``[nb, bs, hkv, hd]``."""
    _, block_size, hkv, hd = k_cache.shape
    t_rows, hq, _ = q.shape
    r, w = block_table.shape
    q_len = t_rows // r
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    if seq_lens.stride(0) != 1:  # the kernel reads seq_lens[r] at offset r
        seq_lens = seq_lens.contiguous()

    block_n = _block_n(q.dtype)
    tiles = triton.cdiv(w * block_size, block_n)
    interp = interpreted(paged_decode_split_kernel, q.device)  # how the kernel was defined
    if num_splits is None:  # the interpreter runs programs one by one: splitting only costs
        num_splits = 1 if interp else default_num_splits(r, hkv, w, block_size, block_n)
    num_splits = min(num_splits, tiles)
    block_m = max(16, triton.next_power_of_2(q_len * group))
    block_d = max(16, triton.next_power_of_2(hd))
    direct = num_splits == 1
    # float32: exact (IEEE) products, no TF32. The CPU interpreter's bf16 tl.dot is broken
    # (Triton 3.9 returns garbage), so interpreted 16-bit products are done in float32 too.
    ieee_dot = q.dtype == torch.float32 or interp
    if direct:
        part_out = part_lse = out  # unused by the kernel when DIRECT
    else:
        part_out = torch.empty((t_rows, hq, num_splits, hd), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((t_rows, hq, num_splits), dtype=torch.float32, device=q.device)

    paged_decode_split_kernel[(r, hkv, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, part_out, part_lse, out,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        block_table.stride(0), w, float(scale) * _LOG2E,
        NUM_KV_HEADS=hkv, HEAD_DIM=hd, PAGE_SIZE=block_size, Q_LEN=q_len, GROUP=group,
        NUM_SPLITS=num_splits,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, IEEE_DOT=ieee_dot, DIRECT=direct,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)
    if not direct:
        paged_decode_reduce_kernel[(t_rows, hq)](
            part_out, part_lse, out, out.stride(0), out.stride(1), out.stride(2), hq,
            HEAD_DIM=hd, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d, num_warps=_NUM_WARPS)
    return out
