"""Fused elementwise kernels of the Llama layer (pure ``@triton.jit``; the launchers are in
:mod:`zos.serving.models.fused`, which check shapes, dtypes and devices).

Numerics follow the plain-torch composition they replace, op by op: every op that torch runs in
the model dtype is computed here in float32 and rounded to the model dtype at the same point
(for bf16/fp16 the float32 product of two model-dtype values is exact, so the single rounding
matches torch's ``opmath`` evaluation; for fp32 the casts are no-ops). The launchers pass
``enable_fp_fusion=False`` so a multiply followed by an add is never contracted into an FMA.

Divisions and square roots use ``tl.div_rn`` / ``tl.sqrt_rn`` (IEEE round-to-nearest, as torch
computes them; Triton's ``/`` is an approximate division on NVIDIA GPUs).

All strides are in elements; the innermost dimension of every operand is contiguous.
"""
import triton
import triton.language as tl


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to ``DTYPE`` to nearest even (torch's conversion).

    bfloat16 is rounded by bit manipulation rather than ``x.to(tl.bfloat16)``: same result on the
    GPU, but Triton's CPU interpreter truncates in that cast, which would make the CPU tests
    differ from torch by an ulp. NaN stays a quiet NaN (0x7FC0, as torch).
    """
    if DTYPE == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        b = tl.where(x != x, 0x7FC0, b)
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    n_rows,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """RMSNorm of rows ``program_id(0) * ROWS + [0, ROWS)`` (grid ``(cdiv(T, ROWS),)``,
    ``BLOCK >= n_cols``; the launcher uses ``ROWS = 1`` on the GPU).

    Without residual: ``out = w * (x_f32 / sqrt(mean(x_f32^2) + eps)).to(dtype)``, the product in
    the model dtype. With residual (vLLM's ``fused_add_rms_norm``): ``s = x + res`` in the model
    dtype is stored to ``res_out`` and normalised instead of ``x``.
    """
    dtype = out_ptr.dtype.element_ty
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]).to(tl.int64)  # [ROWS, 1]
    col = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = (row < n_rows) & (col < n_cols)  # [ROWS, BLOCK]
    x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + col, mask=mask, other=0.0)
        x = _round(x.to(tl.float32) + r.to(tl.float32), dtype)
        tl.store(res_out_ptr + row * stride_res_out + col, x, mask=mask)
    xf = x.to(tl.float32)
    sq = tl.sum(xf * xf, axis=1)[:, None]  # [ROWS, 1]
    var = tl.div_rn(sq, tl.zeros_like(sq) + n_cols)  # n_cols may be a specialised constexpr 1
    # 1 / sqrt, both correctly rounded (torch's CPU rsqrt); one per row, cheap on the GPU.
    normed = _round(xf * tl.div_rn(1.0, tl.sqrt_rn(var + eps)), dtype)
    w = tl.load(w_ptr + col, mask=col < n_cols, other=0.0)
    y = _round(w.to(tl.float32) * normed.to(tl.float32), dtype)
    tl.store(out_ptr + row * stride_out + col, y, mask=mask)


@triton.jit
def rope_store_kv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qkv,
    stride_cos,
    stride_sin,
    n_rows,
    num_heads,
    num_kv_heads,
    num_slots,
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """Rotate-half RoPE of q and k, K/V written to the paged cache.

    Work items are (token row, rotated head) pairs ``p = t * (num_heads + num_kv_heads) + h``;
    grid ``(cdiv(T * (num_heads + num_kv_heads), PAIRS),)``, program ``i`` handles pairs
    ``i * PAIRS + [0, PAIRS)``. Rotated head ``h < num_heads`` is query head ``h`` (rotated into
    ``q_out[t, h]``); ``h = num_heads + j`` is KV head ``j`` (k rotated, v copied, both into cache
    slot ``slot_mapping[t]`` unless that is ``< 0`` or ``>= num_slots``).

    Layouts: ``qkv`` row ``t`` at ``t * stride_qkv`` holds q heads, k heads, v heads, each
    ``HEAD_DIM`` contiguous values; ``cos`` / ``sin`` row ``t`` holds ``HEAD_DIM`` values;
    ``q_out`` is contiguous ``[T, num_heads, HEAD_DIM]``; ``k_cache`` / ``v_cache`` are contiguous
    ``[num_slots, num_kv_heads, HEAD_DIM]`` (one layer's ``kv_cache[0]`` / ``kv_cache[1]``).
    ``out = x * cos + cat(-x2, x1) * sin`` with both products and the sum rounded to the model
    dtype, as torch evaluates it.
    """
    dtype = q_out_ptr.dtype.element_ty
    half = HEAD_DIM // 2
    n_rot = num_heads + num_kv_heads
    p = (tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)[:, None]).to(tl.int64)  # [PAIRS, 1]
    t = p // n_rot
    h = p % n_rot
    d = tl.arange(0, HALF_BLOCK)[None, :]  # [1, HALF_BLOCK]
    valid = (t < n_rows) & (d < half)  # [PAIRS, HALF_BLOCK]

    # q heads and k heads are adjacent in a qkv row: rotated head h starts at h * HEAD_DIM.
    src = qkv_ptr + t * stride_qkv + h * HEAD_DIM + d
    x1 = tl.load(src, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=valid, other=0.0).to(tl.float32)
    cs = cos_ptr + t * stride_cos + d
    sn = sin_ptr + t * stride_sin + d
    c1 = tl.load(cs, mask=valid, other=0.0).to(tl.float32)
    c2 = tl.load(cs + half, mask=valid, other=0.0).to(tl.float32)
    s1 = tl.load(sn, mask=valid, other=0.0).to(tl.float32)
    s2 = tl.load(sn + half, mask=valid, other=0.0).to(tl.float32)
    p1 = _round(x1 * c1, dtype).to(tl.float32) + _round((-x2) * s1, dtype).to(tl.float32)
    p2 = _round(x2 * c2, dtype).to(tl.float32) + _round(x1 * s2, dtype).to(tl.float32)
    o1 = _round(p1, dtype)
    o2 = _round(p2, dtype)

    q_mask = valid & (h < num_heads)
    q_dst = q_out_ptr + (t * num_heads + h) * HEAD_DIM + d
    tl.store(q_dst, o1, mask=q_mask)
    tl.store(q_dst + half, o2, mask=q_mask)

    is_kv = valid & (h >= num_heads)
    slot = tl.load(slot_ptr + t + tl.zeros_like(d), mask=is_kv, other=-1).to(tl.int64)
    kv_mask = is_kv & (slot >= 0) & (slot < num_slots)
    kh = h - num_heads
    dst = (slot * num_kv_heads + kh) * HEAD_DIM + d
    tl.store(k_cache_ptr + dst, o1, mask=kv_mask)
    tl.store(k_cache_ptr + dst + half, o2, mask=kv_mask)
    v_src = qkv_ptr + t * stride_qkv + (n_rot + kh) * HEAD_DIM + d
    v1 = tl.load(v_src, mask=kv_mask, other=0.0)
    v2 = tl.load(v_src + half, mask=kv_mask, other=0.0)
    tl.store(v_cache_ptr + dst, v1, mask=kv_mask)
    tl.store(v_cache_ptr + dst + half, v2, mask=kv_mask)


@triton.jit
def silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n_rows,
    n_cols,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out = silu(gate) * up`` for rows ``program_id(0) * ROWS + [0, ROWS)``, columns of block
    ``program_id(1)``; grid ``(cdiv(T, ROWS), cdiv(n_cols, BLOCK))`` (``ROWS = 1`` on the GPU).

    Row ``t`` of ``x`` is ``[gate (n_cols) | up (n_cols)]``. ``silu(g) = g / (1 + exp(-g))`` in
    float32 rounded to the model dtype, then the product rounded to the model dtype (torch's
    ``F.silu(gate) * up``).
    """
    dtype = out_ptr.dtype.element_ty
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]).to(tl.int64)  # [ROWS, 1]
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = (row < n_rows) & (col < n_cols)
    g = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + col, mask=mask, other=0.0).to(tl.float32)
    s = _round(tl.div_rn(g, 1.0 + tl.exp(-g)), dtype)
    y = _round(s.to(tl.float32) * u, dtype)
    tl.store(out_ptr + row * stride_out + col, y, mask=mask)
