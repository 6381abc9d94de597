"""The staging record layout for Python, taken from the native module.

One decode step uploads one flat int32 record (header, entries of the rows that
change, row records, block ids). ``csrc/staging.h`` defines the layout, the single
source of truth; ``zos._C.staging`` exports every constant of it, and this module
re-exports them, so nothing here is a literal. The Triton kernels (through the
launchers in ``zos/kernels.py``) and the numba host builder read the record
through these names; ``tests/test_staging.py`` pins every value.

Only rows that change are listed: an entry (row, src, rec) per new row (src -1), moved
row (src != row) or row with appended blocks (rec >= 0); every row r < N without an
entry keeps its place with nothing to apply (src = r, rec = -1).

All values are in int32 words:

    HEADER_WORDS    header length (reserved words included)
    ENTRY_WORDS     length of one row entry
    RECORD_WORDS    length of one row record
    ROW_MAP_WORDS   words per row of the device-only row map at the end of the staging
                    buffer (see csrc/staging.h)
    NUM_REQS, NUM_TOKENS, PREV_REQS, NUM_RECORDS, NUM_BLOCK_IDS, Q, NUM_ENTRIES
                    indices of the header fields (N, N * q, P, M, L, q, K)
    E_ROW, E_SRC, E_REC
                    offsets of the fields inside a row entry
    R_TOKEN, R_POS0, R_COL0, R_COUNT, R_BLK_OFF
                    offsets of the fields inside a row record
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zos._C import staging as _native

HEADER_WORDS: int = _native.HEADER_WORDS
ENTRY_WORDS: int = _native.ENTRY_WORDS
RECORD_WORDS: int = _native.RECORD_WORDS
ROW_MAP_WORDS: int = _native.ROW_MAP_WORDS
# Header words.
NUM_REQS: int = _native.NUM_REQS
NUM_TOKENS: int = _native.NUM_TOKENS
PREV_REQS: int = _native.PREV_REQS
NUM_RECORDS: int = _native.NUM_RECORDS
NUM_BLOCK_IDS: int = _native.NUM_BLOCK_IDS
Q: int = _native.Q
NUM_ENTRIES: int = _native.NUM_ENTRIES
# Entry fields.
E_ROW: int = _native.E_ROW
E_SRC: int = _native.E_SRC
E_REC: int = _native.E_REC
# Record fields.
R_TOKEN: int = _native.R_TOKEN
R_POS0: int = _native.R_POS0
R_COL0: int = _native.R_COL0
R_COUNT: int = _native.R_COUNT
R_BLK_OFF: int = _native.R_BLK_OFF


def total_words(num_entries: int, num_records: int, num_block_ids: int) -> int:
    """Words of a record with K = ``num_entries`` row entries, M = ``num_records`` row
    records and L = ``num_block_ids`` block ids:
    ``HEADER_WORDS + ENTRY_WORDS * K + RECORD_WORDS * M + L``
    (``zos._C.staging.total_words``)."""
    return _native.total_words(num_entries, num_records, num_block_ids)


def capacity_words(max_num_reqs: int, max_num_blocks_per_req: int) -> int:
    """Words of the staging buffer for ``max_num_reqs`` rows: the largest record (every row
    listed and new, with a full block-table row), then the device-only row map of
    ``ROW_MAP_WORDS`` per row (``zos._C.staging.capacity_words``)."""
    return _native.capacity_words(max_num_reqs, max_num_blocks_per_req)


@dataclass(frozen=True)
class StagingView:
    """Sections of one record as numpy arrays (for tests and debugging).

    Attributes:
        num_reqs: N, request rows of the step.
        prev_reqs: P, request rows of the previous step.
        entries: int32 [K, ENTRY_WORDS]: one listed row per line, fields at
            E_ROW, E_SRC, E_REC (a view of the record).
        row_src: int32 [N]: the previous row each row holds, or -1 for a new row
            (expanded from the entries: a copy).
        row_rec: int32 [N]: index of the row's record, or -1 (a copy, as row_src).
        records: int32 [M, RECORD_WORDS]: one row record per line, fields at
            R_TOKEN, R_POS0, R_COL0, R_COUNT, R_BLK_OFF (a view).
        blocks: int32 [L]: block ids the records refer to (a view).
    """

    num_reqs: int
    prev_reqs: int
    entries: np.ndarray
    row_src: np.ndarray
    row_rec: np.ndarray
    records: np.ndarray
    blocks: np.ndarray


def parse(record: np.ndarray) -> StagingView:
    """Split a packed record (int32 numpy array [words]) into its sections.

    ``entries``, ``records`` and ``blocks`` are views sharing ``record``'s memory;
    ``row_src`` and ``row_rec`` are the entries expanded to every row (rows not listed
    keep their place with nothing to apply).
    """
    n, m = int(record[NUM_REQS]), int(record[NUM_RECORDS])
    k, num_blocks = int(record[NUM_ENTRIES]), int(record[NUM_BLOCK_IDS])
    rec0 = HEADER_WORDS + ENTRY_WORDS * k
    blk0 = rec0 + RECORD_WORDS * m
    entries = record[HEADER_WORDS:rec0].reshape(k, ENTRY_WORDS)
    row_src = np.arange(n, dtype=np.int32)
    row_rec = np.full(n, -1, np.int32)
    row_src[entries[:, E_ROW]] = entries[:, E_SRC]
    row_rec[entries[:, E_ROW]] = entries[:, E_REC]
    return StagingView(
        num_reqs=n,
        prev_reqs=int(record[PREV_REQS]),
        entries=entries,
        row_src=row_src,
        row_rec=row_rec,
        records=record[rec0:blk0].reshape(m, RECORD_WORDS),
        blocks=record[blk0 : blk0 + num_blocks],
    )
