"""Variable-length (packed) causal attention over a slot-indexed KV cache, for prefill and mixed
batches (pure ``@triton.jit``; the launcher is :func:`zos.varlen_attention.varlen_attention`,
which checks shapes, dtypes and devices and picks the tile sizes).

Layouts read/written here, all strides in elements:

* ``q``: ``[T_q, num_heads, HEAD_DIM]``; query token ``i`` of sequence ``s`` is row
  ``cu_q[s] + i``, head ``h`` at ``row * stride_qt + h * stride_qh``, element ``d`` at
  ``+ d * stride_qd``.
* ``k_cache`` / ``v_cache``: contiguous ``[num_slots, NUM_KV_HEADS, HEAD_DIM]``; KV head ``g`` of
  slot ``slot`` at ``slot * NUM_KV_HEADS * HEAD_DIM + g * HEAD_DIM``.
* ``kv_slots``: int32 or int64 ``[T_k]``: key ``j`` of sequence ``s`` lives in slot
  ``kv_slots[cu_k[s] + j]``.
* ``cu_q`` / ``cu_k``: int32 ``[num_seqs + 1]`` cumulative query / key counts. Sequence ``s``
  has ``q_len = cu_q[s+1] - cu_q[s]`` queries and ``kv_len = cu_k[s+1] - cu_k[s]`` keys; its
  query ``i`` sits at position ``kv_len - q_len + i`` and attends to keys ``0 ..`` that
  position (causal, aligned to the last key: a chunk of a prefill sees the chunks before it).
  Rows past ``T_q`` and keys past ``T_k`` are never touched, whatever the counts say.
* ``out``: ``[T_q, num_heads, HEAD_DIM]`` in q's dtype; only rows of sequences are written.

``varlen_attention_kernel`` grid: ``(cdiv(T_q, BLOCK_Q) + num_seqs, NUM_KV_HEADS)``: enough
programs for every ``BLOCK_Q``-token tile of every sequence (each sequence adds at most one
partial tile), so the grid depends on shapes only. Program ``p`` finds its (sequence, tile) from
the per-sequence tile counts (cumulative sums over ``BLOCK_S`` sequences at a time: one compiled
kernel for any number of sequences); programs past the last tile write nothing. One program
handles the ``BLOCK_Q`` tokens x ``GROUP`` query heads of one KV head as the M dimension of
``tl.dot`` (row ``m``: token ``m // GROUP``, head ``kv_head * GROUP + m % GROUP``), so each K/V
tile is loaded once per KV-head group, and reads only the keys up to its last token's position.
Scores, the online softmax (base 2) and the accumulator are float32.

Masks never combine a scalar boolean with a block boolean (Triton's CPU interpreter rejects the
broadcast; see triton_kernels/kv_cache.py): scalars are compared against blocks instead.
"""
import triton
import triton.language as tl


@triton.jit
def varlen_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_slots_ptr,
    cu_q_ptr,
    cu_k_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    num_seqs,
    total_q,
    total_k,
    qk_scale_log2,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    """Attention of one (sequence, query tile, KV head) (see the module doc).

    ``qk_scale_log2``: the softmax scale times log2(e). ``IEEE_DOT``: both products in float32
    with ``input_precision="ieee"`` (float32 inputs: no TF32; and 16-bit inputs under the CPU
    interpreter, whose bf16 ``tl.dot`` is broken); otherwise 16-bit products (P rounded to V's
    dtype) with float32 accumulation.
    """
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # (sequence, tile) of this program: the sequences whose tiles all come before tile ``pid``
    # (running count of tiles <= pid) are those before its sequence; BLOCK_S at a time.
    seq = 0
    before = 0  # tiles of those sequences
    running = 0  # tiles of the sequences of earlier chunks
    for c0 in range(0, num_seqs, BLOCK_S):
        s_idx = c0 + tl.arange(0, BLOCK_S)
        s_ok = s_idx < num_seqs
        lo = tl.load(cu_q_ptr + s_idx, mask=s_ok, other=0)
        hi = tl.load(cu_q_ptr + s_idx + 1, mask=s_ok, other=0)
        tiles = tl.where(s_ok, (tl.maximum(hi - lo, 0) + BLOCK_Q - 1) // BLOCK_Q, 0)
        passed = ((running + tl.cumsum(tiles, 0)) <= pid) & s_ok
        seq += tl.sum(passed.to(tl.int32), 0)
        before += tl.sum(tl.where(passed, tiles, 0), 0)
        running += tl.sum(tiles, 0)
    tile = pid - before
    live = seq < num_seqs
    seq_c = tl.minimum(seq, num_seqs - 1)
    q_start = tl.load(cu_q_ptr + seq_c)
    q_len = tl.load(cu_q_ptr + seq_c + 1) - q_start
    k_start = tl.load(cu_k_ptr + seq_c)
    kv_len = tl.load(cu_k_ptr + seq_c + 1) - k_start
    q_len = tl.where(live, q_len, 0)

    # Query rows of the tile: m -> (token t of the tile, head g of the group).
    m = tl.arange(0, BLOCK_M)
    t = m // GROUP
    g = m % GROUP
    tok_local = tile * BLOCK_Q + t
    tok = q_start + tok_local
    m_valid = (t < BLOCK_Q) & (tok_local < q_len) & (tok < total_q) & (tok >= 0)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    tok64 = tok.to(tl.int64)
    head = (kvh * GROUP + g).to(tl.int64)
    q_mask = m_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :] * stride_qd, mask=q_mask, other=0.0)
    q_pos = kv_len - q_len + tok_local  # [BLOCK_M]: the last key each row attends to

    # Keys 0 .. the tile's last position (none for a dead program).
    last_tok = tl.minimum((tile + 1) * BLOCK_Q, q_len)
    end = tl.minimum(kv_len - q_len + last_tok, kv_len)
    end = tl.where(live, tl.maximum(end, 0), 0)
    row_size = NUM_KV_HEADS * HEAD_DIM
    kv_head_off = kvh.to(tl.int64) * HEAD_DIM
    n = tl.arange(0, BLOCK_N)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, end, BLOCK_N):
        key = n0 + n
        k_idx = k_start + key
        k_valid = (key < end) & (k_idx < total_k) & (k_idx >= 0)
        slot = tl.load(kv_slots_ptr + k_idx, mask=k_valid, other=0).to(tl.int64)
        kv_off = slot[:, None] * row_size + kv_head_off + d[None, :]
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if IEEE_DOT:
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = sc * qk_scale_log2
        allowed = (key[None, :] <= q_pos[:, None]) & k_valid[None, :] & m_valid[:, None]
        sc = tl.where(allowed, sc, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        # A row with no allowed key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(sc - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh
             + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty), mask=q_mask)
