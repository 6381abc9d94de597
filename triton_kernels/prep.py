"""Decode-step metadata prep kernels (pure ``@triton.jit``; launchers in zos/kernels.py).

Both kernels run one program per request row of the padded step and read the real row
count N from the staged record (never from a launch argument), so one capture per bucket
serves every N <= bucket. The record (layout: csrc/staging.h) lies in a ring of
``num_slots`` records of ``slot_words`` words at ``ring_ptr``: pinned host memory mapped
into the device's address space (zero-copy), or the device buffer the copy path uploads
into (one slot). Which slot a build reads is decided on the device from the ring state
(int32 words at CTR, LAST, CUR and CUR_N, CUR_M, CUR_C, CUR_SEQ: the constexpr globals
below):
``select_slot`` takes slot CTR when its record's SEQ is the one after LAST (a record staged
since the last build), else the slot of the last record applied (a build repeated without
a new record, as warm-up does, applies that record again). ``rebuild_rows`` program 0
advances CTR and LAST when the record was new.

Layout. The kernels read every word offset of the record as a module-level ``tl.constexpr``
global of this module (HEADER_WORDS, LIST_WORDS, RECORD_WORDS, the header words, the fields
L_* of a listed row and R_* of a row record, SEQ_MASK), each taken from zos.staging, which
re-exports csrc/staging.h through zos._C.staging: the one source of the layout, pinned by
tests/test_staging.py. No offset is a literal here and none is a launch argument; the ring
state's word offsets and IN_PLACE are defined here, for the kernels and zos.kernels alike.
Triton reads ``tl.constexpr`` globals when it compiles a kernel (and in its interpreter), keys
its cache on their values and refuses a value changed after compiling; another layout is
another copy of this module (tests/test_staging.py imports one with a shuffled layout).

Ordering (docs/ZOS.md, "The staging record", "Ordering: why the row map cannot race").
Between programs: within one launch no program reads a word that another program of the
same launch writes.
``scatter_listed_rows`` (launch 1) reads the ring state, the record and the previous state of
source rows; it writes only the row map, scratch (rows of listed entries, distinct) and,
program 0, CUR and the copy of the record's header (CUR_N, CUR_M, CUR_C, CUR_SEQ).
``rebuild_rows`` (launch 2, after launch 1 on the same stream) reads CUR and that header
copy, the record's entries, the row map and scratch of its own row r, its own row's previous
state and ``sampled``/``accepted``; it writes only row r (and resets row r's row-map entry),
and program 0 the counts, ``query_start_loc[0]``, CTR and LAST, which no other program of
launch 2 reads; each program then counts itself done in FINISHED (an atomic add), and the last
one writes the done word (docs/ZOS.md, "The done word"). Inside one program: its warps do not
run in step, so a word one warp writes may be read late by another. ``rebuild_rows`` reads
every word it will write (row r's row-map entry, position, block count and block-table
columns, LAST) before one ``tl.debug_barrier()`` and writes only after it;
``scatter_listed_rows`` writes no word it reads.

Masks that combine a per-row flag with a per-column mask are written
``tl.where(flag, mask, False)``: Triton's CPU interpreter rejects the plain
``flag & mask`` broadcast. Token row t = 0 of a real request gets its input
token here, rows 1..q-1 the pad token: with draft tokens (q > 1) the drafter of
zos/spec.py writes them after prep, inside the same graph.
"""
import triton
import triton.language as tl

from zos import staging as _layout

# The staging record (csrc/staging.h via zos.staging), in int32 words.
HEADER_WORDS = tl.constexpr(_layout.HEADER_WORDS)  # header length
LIST_WORDS = tl.constexpr(_layout.LIST_WORDS)  # one listed-row entry (row, src, rec)
RECORD_WORDS = tl.constexpr(_layout.RECORD_WORDS)  # one row record
NUM_REQS_WORD = tl.constexpr(_layout.NUM_REQS)  # header: N
NUM_RECORDS_WORD = tl.constexpr(_layout.NUM_RECORDS)  # header: M
NUM_LISTED_WORD = tl.constexpr(_layout.NUM_LISTED)  # header: C
SEQ_WORD = tl.constexpr(_layout.SEQ)  # header: the record's sequence number
SEQ_MASK = tl.constexpr(_layout.SEQ_MASK)  # the SEQ after s is (s + 1) & SEQ_MASK
L_ROW = tl.constexpr(_layout.L_ROW)  # listed row: its row
L_SRC = tl.constexpr(_layout.L_SRC)  # listed row: previous row, -1 for a new row
L_REC = tl.constexpr(_layout.L_REC)  # listed row: its record, or -1
R_TOKEN = tl.constexpr(_layout.R_TOKEN)  # row record: input token (new rows)
R_POS0 = tl.constexpr(_layout.R_POS0)  # row record: its position (new rows)
R_COL0 = tl.constexpr(_layout.R_COL0)  # row record: first block-table column written
R_COUNT = tl.constexpr(_layout.R_COUNT)  # row record: block ids written
R_BLK_OFF = tl.constexpr(_layout.R_BLK_OFF)  # row record: its first block id in BLOCKS

# The ring state the prep kernels keep on the device (zos.kernels.PrepState.state), int32
# words: CTR, the slot the next new record lies in; LAST, the SEQ of the last record applied;
# CUR, the slot the running build applies, and CUR_N, CUR_M, CUR_C, CUR_SEQ, its record's N,
# M, C and SEQ (written by launch 1, read by launch 2 from device memory); FINISHED, the
# programs of the running launch 2 that have finished (0 between builds).
CTR = tl.constexpr(0)
LAST = tl.constexpr(1)
CUR = tl.constexpr(2)
CUR_N = tl.constexpr(3)
CUR_M = tl.constexpr(4)
CUR_C = tl.constexpr(5)
CUR_SEQ = tl.constexpr(6)
FINISHED = tl.constexpr(7)
RING_STATE_WORDS = 8  # words of the ring state
# A row-map entry (src, rec) that launch 1 did not write: the row holds its request in place.
IN_PLACE = tl.constexpr(-2)


@triton.jit
def select_slot(ring_ptr, state_ptr, num_slots, slot_words):
    """The ring slot this build applies: CTR if its record is the one after LAST, else the
    slot applied last (int32 scalar)."""
    ctr = tl.load(state_ptr + CTR)
    last = tl.load(state_ptr + LAST)
    seq = tl.load(ring_ptr + ctr.to(tl.int64) * slot_words + SEQ_WORD)
    fresh = seq == ((last + 1) & SEQ_MASK)
    return tl.where(fresh, ctr, (ctr + num_slots - 1) % num_slots)


@triton.jit
def scatter_listed_rows(ring_ptr, state_ptr, num_slots, slot_words, row_map_ptr,
                        positions_ptr, num_blocks_per_row_ptr, block_table_ptr,
                        scratch_pos_ptr, scratch_nb_ptr, scratch_bt_ptr, bt_stride,
                        Q: tl.constexpr, BLOCK_W: tl.constexpr):
    """Launch 1: program k applies listed entry k of the record (k < C).

    Reads the ring state (int32 [RING_STATE_WORDS]) and the record (int32; C at word
    NUM_LISTED_WORD, entries (row, src, rec) from HEADER_WORDS), and for an entry whose row
    moves (src >= 0, src != row) the previous position, block count and block-table columns
    of row src (positions int32 [R*Q], num_blocks_per_row int32 [R], block_table int32
    [R, bt_stride]).
    Writes row_map int32 [R, 2] at the entry's row = (src, rec), the moved row's scratch
    (scratch_pos int32 [R], scratch_nb int32 [R], scratch_bt int32 [R, bt_stride]), and
    program 0 the ring state's CUR = the slot this build applies and CUR_N, CUR_M, CUR_C,
    CUR_SEQ = that record's N, M, C and SEQ (device copies, so that launch 2 reads the
    header from device memory).
    """
    k = tl.program_id(0)
    slot = select_slot(ring_ptr, state_ptr, num_slots, slot_words)
    rec = ring_ptr + slot.to(tl.int64) * slot_words
    c = tl.load(rec + NUM_LISTED_WORD)
    if k == 0:
        tl.store(state_ptr + CUR, slot)
        tl.store(state_ptr + CUR_N, tl.load(rec + NUM_REQS_WORD))
        tl.store(state_ptr + CUR_M, tl.load(rec + NUM_RECORDS_WORD))
        tl.store(state_ptr + CUR_C, c)
        tl.store(state_ptr + CUR_SEQ, tl.load(rec + SEQ_WORD))
    if k < c:
        entry = rec + HEADER_WORDS + LIST_WORDS * k
        row = tl.load(entry + L_ROW)
        src = tl.load(entry + L_SRC)
        tl.store(row_map_ptr + 2 * row, src)
        tl.store(row_map_ptr + 2 * row + 1, tl.load(entry + L_REC))
        if (src >= 0) & (src != row):
            j64 = src.to(tl.int64)
            tl.store(scratch_pos_ptr + row, tl.load(positions_ptr + j64 * Q))
            nb = tl.load(num_blocks_per_row_ptr + src)
            tl.store(scratch_nb_ptr + row, nb)
            for c0 in range(0, nb, BLOCK_W):
                cols = c0 + tl.arange(0, BLOCK_W)
                keep = cols < nb
                v = tl.load(block_table_ptr + j64 * bt_stride + cols, mask=keep)
                tl.store(scratch_bt_ptr + row.to(tl.int64) * bt_stride + cols, v, mask=keep)


@triton.jit
def rebuild_rows(ring_ptr, state_ptr, num_slots, slot_words, row_map_ptr, done_ptr,
                 sampled_ptr, accepted_ptr,
                 input_ids_ptr, positions_ptr, slot_mapping_ptr, seq_lens_ptr, qsl_ptr,
                 block_table_ptr, num_blocks_per_row_ptr, counts_ptr,
                 scratch_pos_ptr, scratch_nb_ptr, scratch_bt_ptr,
                 bt_stride, block_size, pad_token_id, seq_len_fill, pad_slot_id, null_block,
                 Q: tl.constexpr, Q_POW2: tl.constexpr, BLOCK_W: tl.constexpr):
    """Launch 2: rebuild request row r (one program per row of the padded step) in place.

    Reads the ring state's CUR (the slot launch 1 chose) and CUR_N, CUR_M, CUR_C, CUR_SEQ
    (that record's header, copied by launch 1), the record's listed rows' records and block
    ids (offsets: the constexpr globals of this module), row r's row-map entry (IN_PLACE,
    -1 unless launch 1 wrote it: then (src, rec)) and resets it, sampled int32 [R] and accepted
    int32 [R] (the previous step's, indexed by its rows), the scratch of launch 1, and row
    r's own previous state. Writes input_ids int32 [R*Q] (token row r*Q), positions int32
    [R*Q], slot_mapping int64 [R*Q] (block * block_size + offset), seq_lens int32 [R],
    query_start_loc int32 [R+1] (entry r+1; program 0 also entry 0), block_table int32
    [R, bt_stride] (columns written and the previous occupant's cleared to null_block),
    num_blocks_per_row int32 [R], and program 0 counts int32 [2] = (N, N*Q) and, when the
    record was new, the ring state's CTR (next slot) and LAST (its SEQ); every program adds
    one to the ring state's FINISHED when it is done, and the last one resets it and writes
    the record's SEQ to done_ptr (int32 [1]: the ring's done word). Rows r >= N get
    the dummy values of the padding ledger, from the buffers' PaddingProfile:
    pad_token_id, position 0, seq_len_fill, slot pad_slot_id (int64) and null_block in
    the columns a previous occupant used.
    """
    r = tl.program_id(0)
    r64 = r.to(tl.int64)
    ring_slot = tl.load(state_ptr + CUR)
    record = ring_ptr + ring_slot.to(tl.int64) * slot_words
    n = tl.load(state_ptr + CUR_N)
    num_records = tl.load(state_ptr + CUR_M)
    num_listed = tl.load(state_ptr + CUR_C)
    seq = tl.load(state_ptr + CUR_SEQ)
    t = tl.arange(0, Q_POW2)
    tmask = t < Q
    tok_rows = r64 * Q + t
    row_bt = block_table_ptr + r64 * bt_stride
    # Read phase: every word this program writes below (row r's block count, row-map entry,
    # position, block-table columns, and program 0's LAST) is read here, before the barrier.
    old_nb = tl.load(num_blocks_per_row_ptr + r)
    last = tl.load(state_ptr + LAST, mask=r == 0, other=0)  # program 0 alone uses it
    if r < n:
        mapped = tl.load(row_map_ptr + 2 * r64)
        rec = tl.load(row_map_ptr + 2 * r64 + 1)
        src = tl.where(mapped == IN_PLACE, r, mapped)
        body = record + HEADER_WORDS + LIST_WORDS * num_listed
        rec_ptr = body + RECORD_WORDS * rec
        blk_base = body + RECORD_WORDS * num_records
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
        # Token rows' blocks: kept columns (< col0) from scratch (moved) or the row itself
        # (in place: read here, before the block-table writes), new ones from the record.
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
        # Every warp of this program has read what it needs: only now may any warp write
        # (docs/ZOS.md, "Ordering": the program's warps are not in step with each other).
        tl.debug_barrier()
        tl.store(row_map_ptr + 2 * r64, IN_PLACE)  # the map is all IN_PLACE between builds
        tl.store(row_map_ptr + 2 * r64 + 1, -1)
        # Block-table row: kept columns from scratch (moved rows only), payload
        # columns [col0, nb_new), and the null block over what a previous
        # occupant left in [nb_new, old_nb).
        start = tl.where(in_place, col0, 0)
        end = tl.maximum(nb_new, old_nb)
        for c0 in range(start, end, BLOCK_W):
            cols = c0 + tl.arange(0, BLOCK_W)
            kept_c = tl.where(moved, cols < col0, False)
            fresh = (cols >= col0) & (cols < nb_new)
            v_kept = tl.load(scratch_bt_ptr + r64 * bt_stride + cols, mask=kept_c,
                             other=null_block)
            v_new = tl.load(blk_base + blk_off + cols - col0, mask=fresh, other=0)
            tl.store(row_bt + cols, tl.where(fresh, v_new, v_kept), mask=cols < end)
        tl.store(num_blocks_per_row_ptr + r, nb_new)
        tl.store(positions_ptr + tok_rows, pos, mask=tmask)
        tl.store(slot_mapping_ptr + tok_rows, slot, mask=tmask)
        # Row 0: the token sampled (or, with drafts, the last one accepted); rows 1..q-1
        # the pad token until a drafter (zos/spec.py) writes its draft tokens there.
        tl.store(input_ids_ptr + tok_rows, tl.where(t == 0, token, pad_token_id), mask=tmask)
        tl.store(seq_lens_ptr + r, pos0 + Q)
    else:
        tl.debug_barrier()  # old_nb read above, before any warp clears the row
        # Dummy row: the padding ledger of docs/ZOS.md, values of the PaddingProfile.
        for c0 in range(0, old_nb, BLOCK_W):
            cols = c0 + tl.arange(0, BLOCK_W)
            tl.store(row_bt + cols, cols * 0 + null_block, mask=cols < old_nb)
        tl.store(num_blocks_per_row_ptr + r, 0)
        tl.store(input_ids_ptr + tok_rows, pad_token_id + t * 0, mask=tmask)
        tl.store(positions_ptr + tok_rows, t * 0, mask=tmask)
        tl.store(slot_mapping_ptr + tok_rows, (t * 0).to(tl.int64) + pad_slot_id, mask=tmask)
        tl.store(seq_lens_ptr + r, seq_len_fill)
    # query_start_loc is r * q through the padding (non-decreasing, no stale tail).
    tl.store(qsl_ptr + r + 1, (r + 1) * Q)
    if r == 0:
        tl.store(qsl_ptr, 0)
        tl.store(counts_ptr, n)
        tl.store(counts_ptr + 1, n * Q)
        if seq == ((last + 1) & SEQ_MASK):  # a new record: consumed
            tl.store(state_ptr + LAST, seq)
            tl.store(state_ptr + CTR, (ring_slot + 1) % num_slots)
    # The done word: the last program of this launch to finish writes the SEQ of the record
    # this build applied to ``done_ptr`` (the staging ring's mapped word, which the host reads
    # before it rewrites a slot). Every read of the record by this program precedes the
    # barrier (its values feed the stores above); the atomic orders them (release) before
    # the count, and launch 1 finished reading before this launch began.
    tl.debug_barrier()
    finished = tl.atomic_add(state_ptr + FINISHED, 1, sem="acq_rel")
    if finished == tl.num_programs(0) - 1:
        tl.store(state_ptr + FINISHED, 0)
        tl.store(done_ptr, seq)
