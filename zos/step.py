"""What the scheduler hands a metadata backend for one decode step."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)


def _as(name: str, value, dtype: np.dtype) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype == dtype and arr.ndim == 1 and arr.flags.c_contiguous:
        return arr
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    out = np.ascontiguousarray(arr, dtype=dtype)
    if arr.size and not np.array_equal(out, arr):
        raise ValueError(f"{name} has values that do not fit {dtype}")
    return out


@dataclass
class DecodeStep:
    """One decode step as the scheduler knows it (host numpy arrays).

    Rows are request rows (one per running request, in the order the step runs
    them); token rows are ``row * q + t``. Only what changed is described: a row
    that is not in ``new_rows`` holds a request of the previous step, and its
    token (the one sampled for it), position (+ accepted tokens), block-table row
    and slots are rebuilt from device state.

    Attributes:
        req_ids: int64 [N], request id of each row; unique.
        new_rows: int32 [M], rows whose request was not in the previous step
            (arrival, resume after preemption, absent last step) or restarts.
        new_tokens: int32 [M], the input token of each new row.
        new_positions: int32 [M], position of that token (tokens already in the
            KV cache for this request).
        new_block_indptr: int32 [M+1], CSR offsets of each new row's block ids.
        new_block_ids: int32 [L], each new row's whole block-table row (ids in
            [1, num_kv_blocks); block 0 is the null block).
        append_rows: int32 [A], carried rows that get a block this step.
        append_block_ids: int32 [A], the block appended after that row's last.

    Raises:
        TypeError: a field holds non-integers.
        ValueError: a field is not 1-D or a value does not fit the dtype.
    """

    req_ids: np.ndarray
    new_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    new_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    new_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    new_block_indptr: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int32))
    new_block_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    append_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    append_block_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    def __post_init__(self) -> None:
        self.req_ids = _as("req_ids", self.req_ids, _I64)
        for name in ("new_rows", "new_tokens", "new_positions", "new_block_indptr",
                     "new_block_ids", "append_rows", "append_block_ids"):
            setattr(self, name, _as(name, getattr(self, name), _I32))

    @property
    def num_reqs(self) -> int:
        """Request rows N of this step."""
        return len(self.req_ids)

    @classmethod
    def build(
        cls,
        req_ids: Sequence[int],
        new: Mapping[int, tuple[int, int, Sequence[int]]] | None = None,
        appends: Iterable[tuple[int, int]] = (),
    ) -> DecodeStep:
        """Convenience constructor from Python objects.

        Args:
            req_ids: request id per row.
            new: ``{row: (token, position, block_ids)}`` for new rows.
            appends: ``(row, block_id)`` pairs, in append order.
        """
        new = dict(new or {})
        rows = sorted(new)
        blocks = [list(new[r][2]) for r in rows]
        indptr = np.zeros(len(rows) + 1, np.int64)
        indptr[1:] = np.cumsum([len(b) for b in blocks], dtype=np.int64)
        appends = list(appends)
        return cls(
            req_ids=np.asarray(req_ids, np.int64),
            new_rows=np.asarray(rows, np.int64),
            new_tokens=np.asarray([new[r][0] for r in rows], np.int64),
            new_positions=np.asarray([new[r][1] for r in rows], np.int64),
            new_block_indptr=indptr,
            new_block_ids=np.asarray([b for bl in blocks for b in bl], np.int64),
            append_rows=np.asarray([a[0] for a in appends], np.int64),
            append_block_ids=np.asarray([a[1] for a in appends], np.int64),
        )
