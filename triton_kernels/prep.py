"""Decode-step metadata prep kernels (pure ``@triton.jit``; launchers in zos/kernels.py).

Both kernels run one program per request row r of the padded step and read the
real row count N from the staged record on the device (never from a launch
argument), so one capture per bucket serves every N <= bucket. The record
layout is csrc/staging.h: a header of HEADER_WORDS words (N at word
NUM_REQS_WORD, the record count M at word NUM_RECORDS_WORD), then row_src [N],
row_rec [N], M records of RECORD_WORDS words (fields at offsets R_TOKEN, R_POS0,
R_COL0, R_COUNT, R_BLK_OFF) and block ids. No offset is written here: the
launcher (zos/kernels.py) passes every one as a constexpr from zos.staging, which
takes them from zos._C.staging, and tests/test_staging.py pins them.

Masks that combine a per-row flag with a per-column mask are written
``tl.where(flag, mask, False)``: Triton's CPU interpreter rejects the plain
``flag & mask`` broadcast. Token row t = 0 of a real request gets its input
token here, rows 1..q-1 the pad token: with draft tokens (q > 1) the drafter of
zos/spec.py writes them after prep, inside the same graph.

Permutations are made safe by a gather to scratch: ``snapshot_moved_rows``
copies the previous state of every row that moves (remap[r] = j != r) into
scratch before ``rebuild_rows`` overwrites any row in place, so a row read by
another row's program (swap, 3-cycle, condense) is read before it is written.
Rows that keep their place (remap[r] == r) touch only what changed.
"""
import triton
import triton.language as tl


@triton.jit
def snapshot_moved_rows(staging_ptr, positions_ptr, num_blocks_per_row_ptr, block_table_ptr,
                        scratch_pos_ptr, scratch_nb_ptr, scratch_bt_ptr, bt_stride,
                        Q: tl.constexpr, BLOCK_W: tl.constexpr,
                        NUM_REQS_WORD: tl.constexpr, HEADER_WORDS: tl.constexpr):
    """Copy the previous state of every row that moves into scratch (one program per row).

    Reads staging (int32 record; N at word NUM_REQS_WORD, row_src at HEADER_WORDS),
    positions int32 [R*Q], num_blocks_per_row int32 [R], block_table int32 [R, bt_stride];
    writes scratch_pos int32 [R] (first position of row r's source), scratch_nb int32 [R] and
    scratch_bt int32 [R, bt_stride] (its columns in use) for rows r < N with
    remap[r] = j >= 0, j != r.
    """
    r = tl.program_id(0)
    n = tl.load(staging_ptr + NUM_REQS_WORD)
    if r < n:
        j = tl.load(staging_ptr + HEADER_WORDS + r)
        if (j >= 0) & (j != r):
            j64 = j.to(tl.int64)
            tl.store(scratch_pos_ptr + r, tl.load(positions_ptr + j64 * Q))
            nb = tl.load(num_blocks_per_row_ptr + j)
            tl.store(scratch_nb_ptr + r, nb)
            for c0 in range(0, nb, BLOCK_W):
                cols = c0 + tl.arange(0, BLOCK_W)
                keep = cols < nb
                v = tl.load(block_table_ptr + j64 * bt_stride + cols, mask=keep)
                tl.store(scratch_bt_ptr + r.to(tl.int64) * bt_stride + cols, v, mask=keep)


@triton.jit
def rebuild_rows(staging_ptr, sampled_ptr, accepted_ptr,
                 input_ids_ptr, positions_ptr, slot_mapping_ptr, seq_lens_ptr, qsl_ptr,
                 block_table_ptr, num_blocks_per_row_ptr, counts_ptr,
                 scratch_pos_ptr, scratch_nb_ptr, scratch_bt_ptr,
                 bt_stride, block_size, pad_token_id, seq_len_fill, pad_slot_id, null_block,
                 Q: tl.constexpr, Q_POW2: tl.constexpr, BLOCK_W: tl.constexpr,
                 NUM_REQS_WORD: tl.constexpr, NUM_RECORDS_WORD: tl.constexpr,
                 HEADER_WORDS: tl.constexpr, RECORD_WORDS: tl.constexpr,
                 R_TOKEN: tl.constexpr, R_POS0: tl.constexpr, R_COL0: tl.constexpr,
                 R_COUNT: tl.constexpr, R_BLK_OFF: tl.constexpr):
    """Rebuild request row r (one program per row of the padded step) in place.

    Reads staging (int32 record, offsets as constexprs: see the module docstring), sampled
    int32 [R] and accepted int32 [R] (the previous step's, indexed by its rows), the scratch
    of snapshot_moved_rows, and row r's own previous num_blocks_per_row. Writes input_ids
    int32 [R*Q] (token row r*Q), positions int32 [R*Q], slot_mapping int64 [R*Q]
    (block * block_size + offset), seq_lens int32 [R], query_start_loc int32 [R+1] (entry
    r+1; program 0 also entry 0), block_table int32 [R, bt_stride] (columns written and the
    previous occupant's cleared to null_block), num_blocks_per_row int32 [R], and
    program 0 counts int32 [2] = (N, N*Q). Rows r >= N get the dummy values of the padding
    ledger, from the buffers' PaddingProfile: pad_token_id, position 0, seq_len_fill,
    slot pad_slot_id (int64) and null_block in the columns a previous occupant used.
    """
    r = tl.program_id(0)
    r64 = r.to(tl.int64)
    n = tl.load(staging_ptr + NUM_REQS_WORD)
    num_records = tl.load(staging_ptr + NUM_RECORDS_WORD)
    t = tl.arange(0, Q_POW2)
    tmask = t < Q
    tok_rows = r64 * Q + t
    row_bt = block_table_ptr + r64 * bt_stride
    old_nb = tl.load(num_blocks_per_row_ptr + r)
    # query_start_loc is r * q through the padding (non-decreasing, no stale tail).
    tl.store(qsl_ptr + r + 1, (r + 1) * Q)
    if r == 0:
        tl.store(qsl_ptr, 0)
        tl.store(counts_ptr, n)
        tl.store(counts_ptr + 1, n * Q)
    if r < n:
        src = tl.load(staging_ptr + HEADER_WORDS + r)
        rec = tl.load(staging_ptr + HEADER_WORDS + n + r)
        rec_ptr = staging_ptr + HEADER_WORDS + 2 * n + RECORD_WORDS * rec
        blk_base = staging_ptr + HEADER_WORDS + 2 * n + RECORD_WORDS * num_records
        has_rec = rec >= 0
        moved = (src >= 0) & (src != r)
        in_place = src == r
        if src >= 0:
            # Carried row: token sampled for it, position advanced by accepted tokens.
            token = tl.load(sampled_ptr + src)
            prev_pos = tl.where(moved, tl.load(scratch_pos_ptr + r),
                                tl.load(positions_ptr + r64 * Q))
            pos0 = prev_pos + tl.load(accepted_ptr + src)
            nb_src = tl.where(moved, tl.load(scratch_nb_ptr + r), old_nb)
        else:
            token = tl.load(rec_ptr + R_TOKEN)
            pos0 = tl.load(rec_ptr + R_POS0)
            nb_src = old_nb * 0
        col0 = tl.where(has_rec, tl.load(rec_ptr + R_COL0, mask=has_rec, other=0), nb_src)
        cnt = tl.where(has_rec, tl.load(rec_ptr + R_COUNT, mask=has_rec, other=0), 0)
        blk_off = tl.where(has_rec, tl.load(rec_ptr + R_BLK_OFF, mask=has_rec, other=0), 0)
        nb_new = col0 + cnt
        # Block-table row: kept columns from scratch (moved rows only), payload
        # columns [col0, nb_new), and the null block over what a previous
        # occupant left in [nb_new, old_nb).
        start = tl.where(in_place, col0, 0)
        end = tl.maximum(nb_new, old_nb)
        for c0 in range(start, end, BLOCK_W):
            cols = c0 + tl.arange(0, BLOCK_W)
            kept = tl.where(moved, cols < col0, False)
            fresh = (cols >= col0) & (cols < nb_new)
            v_kept = tl.load(scratch_bt_ptr + r64 * bt_stride + cols, mask=kept,
                             other=null_block)
            v_new = tl.load(blk_base + blk_off + cols - col0, mask=fresh, other=0)
            tl.store(row_bt + cols, tl.where(fresh, v_new, v_kept), mask=cols < end)
        tl.store(num_blocks_per_row_ptr + r, nb_new)
        # Token rows: positions, slots (int64), input token.
        pos = pos0 + t
        col = pos // block_size
        from_payload = col >= col0
        kept = tmask & (col < col0)
        b_kept_moved = tl.load(scratch_bt_ptr + r64 * bt_stride + col,
                               mask=tl.where(moved, kept, False), other=0)
        b_kept_here = tl.load(row_bt + col, mask=tl.where(in_place, kept, False), other=0)
        b_new = tl.load(blk_base + blk_off + col - col0, mask=tmask & from_payload, other=0)
        blk = tl.where(from_payload, b_new, tl.where(moved, b_kept_moved, b_kept_here))
        slot = blk.to(tl.int64) * block_size + (pos % block_size).to(tl.int64)
        tl.store(positions_ptr + tok_rows, pos, mask=tmask)
        tl.store(slot_mapping_ptr + tok_rows, slot, mask=tmask)
        # Row 0: the token sampled (or, with drafts, the last one accepted); rows 1..q-1
        # the pad token until a drafter (zos/spec.py) writes its draft tokens there.
        tl.store(input_ids_ptr + tok_rows, tl.where(t == 0, token, pad_token_id), mask=tmask)
        tl.store(seq_lens_ptr + r, pos0 + Q)
    else:
        # Dummy row: the padding ledger of docs/ZOS.md, values of the PaddingProfile.
        for c0 in range(0, old_nb, BLOCK_W):
            cols = c0 + tl.arange(0, BLOCK_W)
            tl.store(row_bt + cols, cols * 0 + null_block, mask=cols < old_nb)
        tl.store(num_blocks_per_row_ptr + r, 0)
        tl.store(input_ids_ptr + tok_rows, pad_token_id + t * 0, mask=tmask)
        tl.store(positions_ptr + tok_rows, t * 0, mask=tmask)
        tl.store(slot_mapping_ptr + tok_rows, (t * 0).to(tl.int64) + pad_slot_id, mask=tmask)
        tl.store(seq_lens_ptr + r, seq_len_fill)
