"""Paged decode attention kernels, flash-decoding with split-KV (pure ``@triton.jit``; the
launcher is :func:`zos.attention.paged_decode_attention`, which checks shapes, dtypes and
devices and picks the tile sizes).

Layouts read/written here, all strides in elements:

* ``q``: token row ``r * Q_LEN + t`` of request row ``r``, query head ``h`` starts at
  ``row * stride_qt + h * stride_qh``; element ``d`` at ``+ d * stride_qd``.
* ``k_cache`` / ``v_cache``: ``kv_cache[0]`` / ``kv_cache[1]`` of a contiguous
  ``[2, num_blocks, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM]`` cache (block size, KV heads and head
  size are constexprs: fixed per model, so masks and alignment are known at compile time):
  token ``pos`` of request row ``r`` lives in block ``blk = block_table[r, pos // PAGE_SIZE]``
  at offset ``pos % PAGE_SIZE``, KV head ``g`` at
  ``(blk * PAGE_SIZE + offset) * NUM_KV_HEADS * HEAD_DIM + g * HEAD_DIM``.
* ``block_table``: int32 ``[R, max_blocks]``, row ``r`` at ``r * bt_stride``, columns
  contiguous; ``seq_lens``: int32 ``[R]``. Only columns
  ``pos // PAGE_SIZE`` of positions ``pos < seq_len`` are read; nothing at or past ``seq_len``
  is loaded, so stale or garbage blocks (NaN included) never reach the result.
* ``part_out``: float32 ``[T, num_heads, NUM_SPLITS, HEAD_DIM]``, each split's output already
  normalised by its own softmax sum; ``part_lse``: float32 ``[T, num_heads, NUM_SPLITS]``, its
  log-sum-exp **in base 2** of the scaled scores (``-inf`` for a split without keys for that
  query row).
* ``out``: ``[T, num_heads, HEAD_DIM]`` in q's dtype, strides ``stride_ot``, ``stride_oh``,
  ``stride_od``.

``paged_decode_split_kernel`` grid: ``(R, NUM_KV_HEADS, NUM_SPLITS)``. One program handles all
``Q_LEN * GROUP`` query rows (query tokens x query heads) that read KV head
``program_id(1)``, as the M dimension of ``tl.dot`` (padded with masked rows up to
``BLOCK_M >= 16``), so each K/V tile is loaded once per KV-head group. Row ``m`` of the tile is
token ``m // GROUP``, query head ``kv_head * GROUP + m % GROUP``. The row's ``seq_len`` keys
(clamped to ``[1, max_blocks * PAGE_SIZE]``) are cut into tiles of ``BLOCK_N`` tokens and the
tiles into ``NUM_SPLITS`` contiguous ranges of ``cdiv(tiles, NUM_SPLITS)`` tiles; split ``s``
takes range ``s`` (possibly empty: it then writes ``part_lse = -inf`` and a zero
``part_out``, as does a query row none of whose keys fall in the range). Scores, the online
softmax (base 2) and the accumulator are float32. A tile may span several pages: each key's
block id is looked up in the block table. Query row ``m`` sits at position
``max(seq_len - Q_LEN + t, 0)`` and attends to keys ``0 .. position`` (causal; a negative
position clamps to key 0).
With ``DIRECT`` (only valid for ``NUM_SPLITS == 1``) the program writes the final output to
``out`` and skips ``part_out``/``part_lse``.

``paged_decode_reduce_kernel`` grid: ``(T, num_heads)``; combines the ``NUM_SPLITS`` partial
outputs of one (token row, query head) with weights ``2 ** (lse_s - max_s lse_s)``.

Masks never combine a scalar boolean with a block boolean (Triton's CPU interpreter rejects the
broadcast; see triton_kernels/kv_cache.py): scalars are compared against blocks instead.
"""
import triton
import triton.language as tl


@triton.jit
def paged_decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    bt_stride,
    max_blocks,
    qk_scale_log2,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    Q_LEN: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """Attention of one (request row, KV head, split) over its key range (see the module doc).

    ``qk_scale_log2`` is the softmax scale times log2(e): scores are kept in base 2 (exp2).
    ``IEEE_DOT``: both products in float32 with ``input_precision="ieee"`` (float32 caches, so
    no TF32; and bf16/fp16 under the CPU interpreter, whose bf16 ``tl.dot`` returns garbage in
    Triton 3.9). Otherwise the products take 16-bit inputs (P rounded to the cache dtype) with
    float32 accumulation, on tensor cores.
    Writes ``part_out``/``part_lse`` entries ``[r * Q_LEN + t, kv_head * GROUP + g, split]``
    for every real query row, or ``out`` directly when ``DIRECT``.
    """
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    r64 = r.to(tl.int64)

    # Query rows of the tile: m -> (token t, head g of the group).
    m = tl.arange(0, BLOCK_M)
    t = m // GROUP
    g = m % GROUP
    m_valid = m < Q_LEN * GROUP
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    tok = r64 * Q_LEN + t.to(tl.int64)
    head = (kvh * GROUP + g).to(tl.int64)
    q_mask = m_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=q_mask, other=0.0)

    # Keys of this row, clamped to what the block-table row can address.
    seq_len = tl.load(seq_lens_ptr + r)
    seq_len = tl.minimum(tl.maximum(seq_len, 1), max_blocks * PAGE_SIZE)
    q_pos = tl.maximum(seq_len - Q_LEN + t, 0)  # [BLOCK_M]

    # This split's contiguous range of whole tiles.
    num_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    bt_row = block_table_ptr + r64 * bt_stride
    row_size = NUM_KV_HEADS * HEAD_DIM  # elements of one cache slot (constexpr)
    kv_head_off = kvh.to(tl.int64) * HEAD_DIM
    n = tl.arange(0, BLOCK_N)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + n
        k_valid = pos < end
        blk = tl.load(bt_row + pos // PAGE_SIZE, mask=k_valid, other=0).to(tl.int64)
        slot = blk * PAGE_SIZE + (pos % PAGE_SIZE).to(tl.int64)
        kv_off = slot[:, None] * row_size + kv_head_off + d[None, :]
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)

        if IEEE_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale_log2
        # pos <= q_pos implies pos < seq_len; k_valid also drops keys past this split.
        allowed = (pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no allowed key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if DIRECT:
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh
                 + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        entry = (tok * (NUM_KV_HEADS * GROUP) + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_out_ptr + entry[:, None] * HEAD_DIM + d[None, :], o, mask=q_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + entry, lse, mask=m_valid)


@triton.jit
def paged_decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    num_heads,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Combine the split partials of (token row ``program_id(0)``, head ``program_id(1)``).

    ``out = sum_s w_s * part_out_s / sum_s w_s`` with ``w_s = 2 ** (lse_s - max lse)``; splits
    with ``lse = -inf`` (no keys) get weight 0. Every query row has key 0 in split 0, so the
    maximum is finite.
    """
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_valid = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    base = (tok * num_heads + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s_valid, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    w = tl.exp2(lse - lse_max)
    w = tl.where(s_valid, w, 0.0)
    o = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                mask=s_valid[:, None] & d_valid[None, :], other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d * stride_od,
             res.to(out_ptr.dtype.element_ty), mask=d_valid)
