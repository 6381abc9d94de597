"""The staging record layout for Python, taken from the native module.

One decode step stages one flat int32 record (header, the listed rows with their
previous row and record index, row records, block ids). ``csrc/staging.h`` defines the
layout, the single source of truth; ``zos._C.staging`` exports every constant of it, and this module
re-exports them, so nothing here is a literal. The Triton kernels (as the
``tl.constexpr`` globals of ``zos.triton_kernels.prep``, made from these names) and the
numba host builder read the record through these names; ``tests/test_staging.py`` pins
every value.

All values are in int32 words:

    HEADER_WORDS    header length
    LIST_WORDS      length of one listed-row entry
    RECORD_WORDS    length of one row record
    NUM_REQS, NUM_TOKENS, PREV_REQS, NUM_RECORDS, NUM_BLOCK_IDS, Q, NUM_LISTED, SEQ
                    indices of the header fields (N, N * q, P, M, L, q, C, sequence number)
    L_ROW, L_SRC, L_REC
                    offsets of the fields inside a listed-row entry (row, previous row or
                    -1, record index or -1)
    R_TOKEN, R_POS0, R_COL0, R_COUNT, R_BLK_OFF
                    offsets of the fields inside a row record
    SEQ_MASK        sequence numbers lie in [0, SEQ_MASK]; the next after s is
                    (s + 1) & SEQ_MASK

A row r < N that is not listed holds, in place, the request it held in the previous step
and gets no block (csrc/staging.h).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zos._C import staging as _native

HEADER_WORDS: int = _native.HEADER_WORDS
LIST_WORDS: int = _native.LIST_WORDS
RECORD_WORDS: int = _native.RECORD_WORDS
# Header words.
NUM_REQS: int = _native.NUM_REQS
NUM_TOKENS: int = _native.NUM_TOKENS
PREV_REQS: int = _native.PREV_REQS
NUM_RECORDS: int = _native.NUM_RECORDS
NUM_BLOCK_IDS: int = _native.NUM_BLOCK_IDS
Q: int = _native.Q
NUM_LISTED: int = _native.NUM_LISTED
SEQ: int = _native.SEQ
SEQ_MASK: int = _native.SEQ_MASK
# Listed-row fields.
L_ROW: int = _native.L_ROW
L_SRC: int = _native.L_SRC
L_REC: int = _native.L_REC
# Record fields.
R_TOKEN: int = _native.R_TOKEN
R_POS0: int = _native.R_POS0
R_COL0: int = _native.R_COL0
R_COUNT: int = _native.R_COUNT
R_BLK_OFF: int = _native.R_BLK_OFF


def total_words(num_listed: int, num_records: int, num_block_ids: int) -> int:
    """Words of a record with C = ``num_listed`` listed rows, M = ``num_records`` row records
    and L = ``num_block_ids`` block ids: ``HEADER_WORDS + LIST_WORDS * C + RECORD_WORDS * M
    + L`` (``zos._C.staging.total_words``)."""
    return _native.total_words(num_listed, num_records, num_block_ids)


def capacity_words(max_num_reqs: int, max_num_blocks_per_req: int) -> int:
    """Largest record for ``max_num_reqs`` rows: every row listed and new with a full
    block-table row (``zos._C.staging.capacity_words``), in int32 words."""
    return _native.capacity_words(max_num_reqs, max_num_blocks_per_req)


@dataclass(frozen=True)
class StagingView:
    """Sections of one record as numpy arrays (for tests and debugging).

    Attributes:
        num_reqs: N, request rows of the step.
        prev_reqs: P, request rows of the previous step.
        seq: the record's sequence number.
        listed: int32 [C, LIST_WORDS]: one listed row per line, fields at L_ROW, L_SRC, L_REC
            (a view of the record).
        row_src: int32 [N]: the previous row each row holds, or -1 for a new row (an
            unlisted row r holds r); a new array.
        row_rec: int32 [N]: index of the row's record, or -1; a new array.
        records: int32 [M, RECORD_WORDS]: one row record per line, fields at
            R_TOKEN, R_POS0, R_COL0, R_COUNT, R_BLK_OFF (a view).
        blocks: int32 [L]: block ids the records refer to (a view).
    """

    num_reqs: int
    prev_reqs: int
    seq: int
    listed: np.ndarray
    row_src: np.ndarray
    row_rec: np.ndarray
    records: np.ndarray
    blocks: np.ndarray


def parse(record: np.ndarray) -> StagingView:
    """Split a packed record (int32 numpy array [words]) into its sections; ``row_src`` and
    ``row_rec`` expand the listed rows to every row [0, N)."""
    n, m = int(record[NUM_REQS]), int(record[NUM_RECORDS])
    c, num_blocks = int(record[NUM_LISTED]), int(record[NUM_BLOCK_IDS])
    rec0 = HEADER_WORDS + LIST_WORDS * c
    blk0 = rec0 + RECORD_WORDS * m
    listed = record[HEADER_WORDS:rec0].reshape(c, LIST_WORDS)
    row_src = np.arange(n, dtype=np.int32)
    row_rec = np.full(n, -1, np.int32)
    row_src[listed[:, L_ROW]] = listed[:, L_SRC]
    row_rec[listed[:, L_ROW]] = listed[:, L_REC]
    return StagingView(
        num_reqs=n,
        prev_reqs=int(record[PREV_REQS]),
        seq=int(record[SEQ]),
        listed=listed,
        row_src=row_src,
        row_rec=row_rec,
        records=record[rec0:blk0].reshape(m, RECORD_WORDS),
        blocks=record[blk0 : blk0 + num_blocks],
    )
