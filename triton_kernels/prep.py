"""Decode-step metadata prep kernels (pure ``@triton.jit``; launchers in zos/kernels.py).

Both kernels run one program per request row of the padded step and read the
real counts from the staged record on the device (never from a launch
argument), so one capture per bucket serves every N <= bucket. The record
layout is csrc/staging.h: a header of HEADER_WORDS words (N at word
NUM_REQS_WORD, the entry count K at NUM_ENTRIES_WORD, the record count M at
NUM_RECORDS_WORD), then K row entries of ENTRY_WORDS words (fields at E_ROW,
E_SRC, E_REC), M records of RECORD_WORDS words (fields at offsets R_TOKEN,
R_POS0, R_COL0, R_COUNT, R_BLK_OFF) and block ids. No offset is written here:
the launcher (zos/kernels.py) passes every one as a constexpr from zos.staging,
which takes them from zos._C.staging, and tests/test_staging.py pins them.

Only rows that change are listed; a row without an entry keeps its place with
nothing to apply. ``scatter_entries`` (program i: entry i, for i < K) writes each
entry into the row map, two int32 [R] arrays at the end of the staging buffer
(``map_src[row] = src - row``, ``map_rec[row] = rec + 1``: all zero is a kept row
with nothing to apply), and ``rebuild_rows`` (program r: row r) reads row r's map
words and zeroes them, so the map is all zero again after every step.

Masks that combine a per-row flag with a per-column mask are written
``tl.where(flag, mask, False)``: Triton's CPU interpreter rejects the plain
``flag & mask`` broadcast. Only token row t = 0 of a request gets its input
token here (q = 1 is what the backends accept today).

Permutations are made safe by a gather to scratch: ``scatter_entries`` also copies
the previous state of every row that moves (src = j != r) into scratch before
``rebuild_rows`` overwrites any row in place, so a row read by another row's
program (swap, 3-cycle, condense) is read before it is written. Rows that keep
their place touch only what changed.
"""
import triton
import triton.language as tl


@triton.jit
def scatter_entries(staging_ptr, map_src_off, map_rec_off, positions_ptr,
                    num_blocks_per_row_ptr, block_table_ptr,
                    scratch_pos_ptr, scratch_nb_ptr, scratch_bt_ptr, bt_stride,
                    Q: tl.constexpr, BLOCK_W: tl.constexpr,
                    NUM_ENTRIES_WORD: tl.constexpr, HEADER_WORDS: tl.constexpr,
                    ENTRY_WORDS: tl.constexpr, E_ROW: tl.constexpr, E_SRC: tl.constexpr,
                    E_REC: tl.constexpr):
    """Write row entry i into the row map and snapshot a moved row (program i, i < K).

    Reads staging (int32 record; K at word NUM_ENTRIES_WORD, entries at HEADER_WORDS; the
    row map at words map_src_off and map_rec_off of the same buffer), positions int32 [R*Q],
    num_blocks_per_row int32 [R], block_table int32 [R, bt_stride]; writes map_src int32 [R]
    (src - row) and map_rec int32 [R] (rec + 1) at the entry's row, and for a moved row r
    (src = j >= 0, j != r) scratch_pos int32 [R] (first position of row j), scratch_nb int32
    [R] and scratch_bt int32 [R, bt_stride] (its columns in use) at r.
    """
    map_src_ptr = staging_ptr + map_src_off
    map_rec_ptr = staging_ptr + map_rec_off
    i = tl.program_id(0)
    k = tl.load(staging_ptr + NUM_ENTRIES_WORD)
    if i < k:
        entry = staging_ptr + HEADER_WORDS + ENTRY_WORDS * i
        r = tl.load(entry + E_ROW)
        j = tl.load(entry + E_SRC)
        tl.store(map_src_ptr + r, j - r)
        tl.store(map_rec_ptr + r, tl.load(entry + E_REC) + 1)
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
def rebuild_rows(staging_ptr, map_src_off, map_rec_off, sampled_ptr, accepted_ptr,
                 input_ids_ptr, positions_ptr, slot_mapping_ptr, seq_lens_ptr, qsl_ptr,
                 block_table_ptr, num_blocks_per_row_ptr, counts_ptr,
                 scratch_pos_ptr, scratch_nb_ptr, scratch_bt_ptr,
                 bt_stride, block_size, pad_token_id, seq_len_fill,
                 Q: tl.constexpr, Q_POW2: tl.constexpr, BLOCK_W: tl.constexpr,
                 NUM_REQS_WORD: tl.constexpr, NUM_RECORDS_WORD: tl.constexpr,
                 NUM_ENTRIES_WORD: tl.constexpr, HEADER_WORDS: tl.constexpr,
                 ENTRY_WORDS: tl.constexpr, RECORD_WORDS: tl.constexpr,
                 R_TOKEN: tl.constexpr, R_POS0: tl.constexpr, R_COL0: tl.constexpr,
                 R_COUNT: tl.constexpr, R_BLK_OFF: tl.constexpr):
    """Rebuild request row r (one program per row of the padded step) in place.

    Reads staging (int32 record, offsets as constexprs: see the module docstring), row r's
    words of the row map map_src / map_rec int32 [R] (staging words map_src_off + r and
    map_rec_off + r, written by scatter_entries; zeroed here), sampled int32 [R] and accepted
    int32 [R] (the previous step's, indexed by its rows), the scratch of scatter_entries, and
    row r's own previous num_blocks_per_row. Writes input_ids int32 [R*Q] (token row r*Q),
    positions int32 [R*Q], slot_mapping int64 [R*Q]
    (block * block_size + offset), seq_lens int32 [R], query_start_loc int32 [R+1] (entry
    r+1; program 0 also entry 0), block_table int32 [R, bt_stride] (columns written and the
    previous occupant's cleared to the null block 0), num_blocks_per_row int32 [R], and
    program 0 counts int32 [2] = (N, N*Q). Rows r >= N get the dummy values of the padding
    ledger.
    """
    map_src_ptr = staging_ptr + map_src_off
    map_rec_ptr = staging_ptr + map_rec_off
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
        # Row r's entry from the row map (zero: kept in place, nothing to apply), then
        # the map is zero again for the next step.
        src = r + tl.load(map_src_ptr + r)
        rec = tl.load(map_rec_ptr + r) - 1
        tl.store(map_src_ptr + r, src * 0)
        tl.store(map_rec_ptr + r, rec * 0)
        num_entries = tl.load(staging_ptr + NUM_ENTRIES_WORD)
        rec_base = staging_ptr + HEADER_WORDS + ENTRY_WORDS * num_entries
        rec_ptr = rec_base + RECORD_WORDS * rec
        blk_base = rec_base + RECORD_WORDS * num_records
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
            v_kept = tl.load(scratch_bt_ptr + r64 * bt_stride + cols, mask=kept, other=0)
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
        tl.store(input_ids_ptr + tok_rows, token + t * 0, mask=tmask & (t == 0))
        tl.store(seq_lens_ptr + r, pos0 + Q)
    else:
        # Dummy row: the padding ledger of docs/ZOS.md.
        for c0 in range(0, old_nb, BLOCK_W):
            cols = c0 + tl.arange(0, BLOCK_W)
            tl.store(row_bt + cols, cols * 0, mask=cols < old_nb)
        tl.store(num_blocks_per_row_ptr + r, 0)
        tl.store(input_ids_ptr + tok_rows, pad_token_id + t * 0, mask=tmask)
        tl.store(positions_ptr + tok_rows, t * 0, mask=tmask)
        tl.store(slot_mapping_ptr + tok_rows, (t * 0 - 1).to(tl.int64), mask=tmask)
        tl.store(seq_lens_ptr + r, seq_len_fill)
