"""The staging record layout for Python, taken from the native module.

One decode step uploads one flat int32 record (header, per-row remap and record
index, row records, block ids). ``csrc/staging.h`` defines the layout, the single
source of truth; ``zos._C.staging`` exports every constant of it, and this module
re-exports them, so nothing here is a literal. The Triton kernels (through the
launchers in ``zos/kernels.py``) and the numba host builder read the record
through these names; ``tests/test_staging.py`` pins every value.

All values are in int32 words:

    HEADER_WORDS    header length (reserved words included)
    RECORD_WORDS    length of one row record
    NUM_REQS, NUM_TOKENS, PREV_REQS, NUM_RECORDS, NUM_BLOCK_IDS, Q
                    indices of the header fields (N, N * q, P, M, L, q)
    R_TOKEN, R_POS0, R_COL0, R_COUNT, R_BLK_OFF
                    offsets of the fields inside a row record
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zos._C import staging as _native

HEADER_WORDS: int = _native.HEADER_WORDS
RECORD_WORDS: int = _native.RECORD_WORDS
# Header words.
NUM_REQS: int = _native.NUM_REQS
NUM_TOKENS: int = _native.NUM_TOKENS
PREV_REQS: int = _native.PREV_REQS
NUM_RECORDS: int = _native.NUM_RECORDS
NUM_BLOCK_IDS: int = _native.NUM_BLOCK_IDS
Q: int = _native.Q
# Record fields.
R_TOKEN: int = _native.R_TOKEN
R_POS0: int = _native.R_POS0
R_COL0: int = _native.R_COL0
R_COUNT: int = _native.R_COUNT
R_BLK_OFF: int = _native.R_BLK_OFF


def total_words(num_reqs: int, num_records: int, num_block_ids: int) -> int:
    """Words of a record with N = ``num_reqs`` rows, M = ``num_records`` row records and
    L = ``num_block_ids`` block ids: ``HEADER_WORDS + 2N + RECORD_WORDS * M + L``
    (``zos._C.staging.total_words``)."""
    return _native.total_words(num_reqs, num_records, num_block_ids)


def capacity_words(max_num_reqs: int, max_num_blocks_per_req: int) -> int:
    """Largest record for ``max_num_reqs`` rows: every row new with a full block-table row
    (``zos._C.staging.capacity_words``), in int32 words."""
    return _native.capacity_words(max_num_reqs, max_num_blocks_per_req)


@dataclass(frozen=True)
class StagingView:
    """Sections of one record as numpy views (for tests and debugging).

    Attributes:
        num_reqs: N, request rows of the step.
        prev_reqs: P, request rows of the previous step.
        row_src: int32 [N]: the previous row each row holds, or -1 for a new row.
        row_rec: int32 [N]: index of the row's record, or -1.
        records: int32 [M, RECORD_WORDS]: one row record per line, fields at
            R_TOKEN, R_POS0, R_COL0, R_COUNT, R_BLK_OFF.
        blocks: int32 [L]: block ids the records refer to.
    """

    num_reqs: int
    prev_reqs: int
    row_src: np.ndarray
    row_rec: np.ndarray
    records: np.ndarray
    blocks: np.ndarray


def parse(record: np.ndarray) -> StagingView:
    """Split a packed record (int32 numpy array [words]) into views of its sections.

    Nothing is copied: the views share ``record``'s memory.
    """
    n, m = int(record[NUM_REQS]), int(record[NUM_RECORDS])
    num_blocks = int(record[NUM_BLOCK_IDS])
    rec0 = HEADER_WORDS + 2 * n
    blk0 = rec0 + RECORD_WORDS * m
    return StagingView(
        num_reqs=n,
        prev_reqs=int(record[PREV_REQS]),
        row_src=record[HEADER_WORDS : HEADER_WORDS + n],
        row_rec=record[HEADER_WORDS + n : rec0],
        records=record[rec0:blk0].reshape(m, RECORD_WORDS),
        blocks=record[blk0 : blk0 + num_blocks],
    )
