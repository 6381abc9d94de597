"""Launchers of the prep kernels: check the buffers, then launch with fixed grids."""
from __future__ import annotations

import zos._interpret  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import triton

from zos import staging
from zos.buffers import DecodeBuffers
from zos.triton_kernels.prep import rebuild_rows, snapshot_moved_rows

# Every staging offset the kernels read, as constexprs (csrc/staging.h through zos.staging).
_SNAPSHOT_LAYOUT = dict(NUM_REQS_WORD=staging.NUM_REQS, HEADER_WORDS=staging.HEADER_WORDS)
_REBUILD_LAYOUT = dict(
    _SNAPSHOT_LAYOUT, NUM_RECORDS_WORD=staging.NUM_RECORDS, RECORD_WORDS=staging.RECORD_WORDS,
    R_TOKEN=staging.R_TOKEN, R_POS0=staging.R_POS0, R_COL0=staging.R_COL0,
    R_COUNT=staging.R_COUNT, R_BLK_OFF=staging.R_BLK_OFF)


def launch_prep(buffers: DecodeBuffers, padded_size: int) -> None:
    """Rebuild the metadata of a step padded to ``padded_size`` token rows, in place.

    Reads the staged record in ``buffers.staging`` (real row count N at word
    ``zos.staging.NUM_REQS``; the kernels get every offset of the layout as a constexpr),
    ``buffers.sampled`` and ``buffers.accepted`` (int32 [max_num_reqs], written by the
    previous step's sampler), and the previous step's rows. Writes, in place,
    ``input_ids``, ``positions``, ``slot_mapping`` (token rows [0, padded_size)),
    ``seq_lens``, ``query_start_loc``, ``block_table``, ``num_blocks_per_row`` (request
    rows [0, padded_size // q)) and ``counts``; rows past the real N get the dummy values of
    ``buffers.padding`` (the runner's PaddingProfile).
    Two launches, grid (padded_size // q,), no host synchronisation and no host value of
    N: capturable once per bucket.

    Raises:
        ValueError: padded_size not a multiple of q in [1, max_num_reqs * q].
    """
    b, q = buffers, buffers.uniform_decode_query_len
    if (not isinstance(padded_size, int) or not 1 <= padded_size <= b.max_num_reqs * q
            or padded_size % q):
        raise ValueError(f"padded_size must be a multiple of uniform_decode_query_len={q} in "
                         f"[1, {b.max_num_reqs * q}], got {padded_size!r}")
    padded_reqs = padded_size // q
    w = b.max_num_blocks_per_req
    block_w = min(256, triton.next_power_of_2(w))
    grid = (padded_reqs,)
    snapshot_moved_rows[grid](
        b.staging, b.positions, b.num_blocks_per_row, b.block_table,
        b.scratch_pos, b.scratch_num_blocks_per_row, b.scratch_block_table, w,
        Q=q, BLOCK_W=block_w, **_SNAPSHOT_LAYOUT)
    rebuild_rows[grid](
        b.staging, b.sampled, b.accepted,
        b.input_ids, b.positions, b.slot_mapping, b.seq_lens, b.query_start_loc,
        b.block_table, b.num_blocks_per_row, b.counts,
        b.scratch_pos, b.scratch_num_blocks_per_row, b.scratch_block_table,
        w, b.block_size, b.pad_token_id, b.seq_len_fill, b.padding.pad_slot_id,
        b.padding.null_block,
        Q=q, Q_POW2=triton.next_power_of_2(q), BLOCK_W=block_w, **_REBUILD_LAYOUT)
