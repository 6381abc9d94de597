"""Python mirror of the staging record layout defined in ``csrc/staging.h``.

One decode step uploads one flat int32 record (header, per-row remap and record
index, row records, block ids); see ``csrc/staging.h`` for the layout, which is
the single source of truth. The Triton kernels and the numba host builder read
the record through these constants; ``tests/test_staging.py`` checks them
against the native module.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HEADER_WORDS = 8
RECORD_WORDS = 5
# Header words.
NUM_REQS, NUM_TOKENS, PREV_REQS, NUM_RECORDS, NUM_BLOCK_IDS, Q = range(6)
# Record fields.
R_TOKEN, R_POS0, R_COL0, R_COUNT, R_BLK_OFF = range(5)


def capacity_words(max_num_reqs: int, max_num_blocks_per_req: int) -> int:
    """Largest record for ``max_num_reqs`` rows: every row new with a full block-table row."""
    return HEADER_WORDS + (2 + RECORD_WORDS) * max_num_reqs + max_num_reqs * max_num_blocks_per_req


@dataclass(frozen=True)
class StagingView:
    """Sections of one record as numpy views (for tests and debugging)."""

    num_reqs: int
    prev_reqs: int
    row_src: np.ndarray  # int32 [N]: previous row, or -1 for a new row
    row_rec: np.ndarray  # int32 [N]: record index, or -1
    records: np.ndarray  # int32 [M, 5]: (token, pos0, col0, count, blk_off)
    blocks: np.ndarray  # int32 [L]


def parse(record: np.ndarray) -> StagingView:
    """Split a packed record (int32 numpy array) into its sections."""
    n, m, l = int(record[NUM_REQS]), int(record[NUM_RECORDS]), int(record[NUM_BLOCK_IDS])
    rec0 = HEADER_WORDS + 2 * n
    blk0 = rec0 + RECORD_WORDS * m
    return StagingView(
        num_reqs=n,
        prev_reqs=int(record[PREV_REQS]),
        row_src=record[HEADER_WORDS : HEADER_WORDS + n],
        row_rec=record[HEADER_WORDS + n : rec0],
        records=record[rec0:blk0].reshape(m, RECORD_WORDS),
        blocks=record[blk0 : blk0 + l],
    )
