"""Launchers of the prep kernels: check the buffers, then launch with fixed grids."""
from __future__ import annotations

import triton

from zos import staging
from zos.buffers import DecodeBuffers
from zos.triton_kernels.prep import rebuild_rows, snapshot_moved_rows


def launch_prep(buffers: DecodeBuffers, padded_reqs: int) -> None:
    """Rebuild the metadata of request rows [0, padded_reqs) in place.

    Reads the staged record in ``buffers.staging`` (real row count N at word 0),
    ``buffers.sampled`` and ``buffers.accepted`` (int32 [max_reqs], written by the
    previous step's sampler), and the previous step's rows. Writes, in place,
    ``input_ids``, ``positions``, ``slot_mapping`` (token rows [0, padded_reqs*q)),
    ``seq_lens``, ``query_start_loc``, ``block_table``, ``num_blocks`` (request
    rows) and ``counts``; rows [N, padded_reqs) get dummy values. Two launches,
    no host synchronisation and no host value of N: capturable once per bucket.

    Raises:
        ValueError: padded_reqs outside [1, buffers.max_reqs].
    """
    if not isinstance(padded_reqs, int) or not 1 <= padded_reqs <= buffers.max_reqs:
        raise ValueError(f"padded_reqs must be an int in [1, {buffers.max_reqs}], got {padded_reqs!r}")
    b = buffers
    w = b.max_blocks_per_seq
    block_w = min(256, triton.next_power_of_2(w))
    grid = (padded_reqs,)
    snapshot_moved_rows[grid](
        b.staging, b.positions, b.num_blocks, b.block_table,
        b.scratch_pos, b.scratch_num_blocks, b.scratch_block_table, w,
        Q=b.q, BLOCK_W=block_w, HEADER=staging.HEADER_WORDS)
    rebuild_rows[grid](
        b.staging, b.sampled, b.accepted,
        b.input_ids, b.positions, b.slot_mapping, b.seq_lens, b.query_start_loc,
        b.block_table, b.num_blocks, b.counts,
        b.scratch_pos, b.scratch_num_blocks, b.scratch_block_table,
        w, b.block_size, b.pad_token_id, b.seq_len_fill,
        Q=b.q, Q_POW2=triton.next_power_of_2(b.q), BLOCK_W=block_w,
        HEADER=staging.HEADER_WORDS, RECORD=staging.RECORD_WORDS, M_WORD=staging.NUM_RECORDS)
