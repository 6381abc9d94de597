"""What the scheduler hands a metadata backend for one decode step.

Who checks a step (each rule once, in the layer that owns it; every check runs before anything
is written):

- :class:`DecodeStep` (here): each field on its own: a sequence of ints or an integer array,
  1-D, every value fitting its dtype (int64 ``req_ids``, int32 the rest), converted without a
  cast; ``DecodeStep.build`` also the shape of its arguments (``new``, ``appends``,
  ``rewrites``). No rule that relates two fields or two steps.
- ``zos._C`` (``csrc/bindings.cpp``, ``StepPacker.pack`` / ``stage_call``): what the native
  code reads through raw pointers: numpy arrays of dtype int64 / int32 in native byte order,
  1-D, C-contiguous (a field replaced after a DecodeStep was built is caught here), ``out``
  writeable, and the lengths that tie fields together (``new_tokens`` and ``new_positions``
  of len(new_rows), the two indptrs of their rows + 1, ``append_block_ids`` of
  len(append_rows), the three ``rewrite_*`` all or none).
- the packer (``csrc/packer.cpp``), the authority on values and on the previous step: unique
  request ids and rows, rows in [0, N), at most max_num_reqs rows, tokens in the vocabulary,
  positions, indptrs starting at 0, non-decreasing and ending at the ids' length, block ids in
  the pool (never the null block), blocks covering each row's positions, the record fitting
  ``out``; it commits its mirror of the rows only when the whole step passed.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields

import numpy as np

_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)
_RANGE = {d: (int(np.iinfo(d).min), int(np.iinfo(d).max)) for d in (_I32, _I64)}


def _ints(name: str, values, dtype: np.dtype, label=None) -> np.ndarray:
    """``values`` as a 1-D ``dtype`` array, else a TypeError / ValueError naming the field.

    An array (numpy, or anything with ``__array__``) must have an integer dtype; any other
    iterable must hold Python or numpy ints (no bools, floats, strings or sequences). Every
    value must fit ``dtype``: nothing is truncated, wrapped or rounded. ``label(i)`` names
    element ``i`` in messages (default ``name[i]``).
    """
    label = label or (lambda i: f"{name}[{i}]")
    lo, hi = _RANGE[dtype]
    if hasattr(values, "__array__"):
        arr = np.asarray(values)
        if arr.dtype == dtype and arr.ndim == 1 and arr.flags.c_contiguous:
            return arr
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got an array of dtype {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
        if arr.size and (arr.min() < lo or arr.max() > hi):
            i = int(np.flatnonzero((arr < lo) | (arr > hi))[0])
            raise ValueError(f"{label(i)} = {arr[i]} does not fit {dtype} [{lo}, {hi}]")
        return np.ascontiguousarray(arr, dtype=dtype)
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__} "
                        f"{values!r}")
    values = list(values)
    if not values:
        return np.zeros(0, dtype)
    for t in set(map(type, values)):  # one check per element type, not per element
        if issubclass(t, (bool, np.bool_)) or not issubclass(t, (int, np.integer)):
            i = next(i for i, v in enumerate(values) if type(v) is t)
            raise TypeError(f"{label(i)} must be an int, got {t.__name__} {values[i]!r}")
    if min(values) < lo or max(values) > hi:
        i = next(i for i, v in enumerate(values) if not lo <= v <= hi)
        raise ValueError(f"{label(i)} = {values[i]} does not fit {dtype} [{lo}, {hi}]")
    return np.array(values, dtype=dtype)


def _block_lists(name: str, kind: str, rows: list, lists: list) -> tuple[np.ndarray, np.ndarray]:
    """CSR of one block list per row: (indptr int64 [len(rows)+1], ids int32 [L]).

    ``lists[k]`` (any iterable of ints, or an integer array) belongs to row ``rows[k]``;
    messages name ``name``, the element, ``kind`` and the row.
    """
    flat, ends = [], [0]
    for r, block_ids in zip(rows, lists):
        try:
            if isinstance(block_ids, (str, bytes)):
                raise TypeError
            flat.extend(block_ids)
        except TypeError:
            raise TypeError(f"{name} of {kind} {r} must be a sequence of ints, got "
                            f"{type(block_ids).__name__} {block_ids!r}") from None
        ends.append(len(flat))
    indptr = np.array(ends, np.int64)

    def label(i: int) -> str:
        k = int(np.searchsorted(indptr, i, "right")) - 1
        return f"{name}[{i - indptr[k]}] of {kind} {rows[k]}"

    return indptr, _ints(name, flat, _I32, label)


def _keyed_rows(name: str, arg, value: str, field_name: str):
    """``(mapping, rows, keys)`` of a ``{row: value}`` argument of ``DecodeStep.build`` (None:
    empty): ``rows`` int32, sorted; ``keys`` the mapping's keys in that order. TypeError unless
    a mapping; the keys are checked as ``field_name`` (message naming the key)."""
    if arg is None:
        arg = {}
    if not isinstance(arg, Mapping):
        raise TypeError(f"{name} must be a mapping {{row: {value}}}, got {type(arg).__name__}")
    keys = list(arg)
    rows = _ints(field_name, keys, _I32, lambda i: f"{field_name}: the key {keys[i]!r} of {name}")
    order = np.argsort(rows, kind="stable")
    return arg, rows[order], [keys[i] for i in order]


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
        rewrite_rows: int32 [X], carried rows whose block list changed other than by an
            append (prefix-sharing swaps, copy-on-write, swap-in from CPU offload,
            defragmentation): their token and position carry over as for any carried row,
            their block-table row is replaced. Such a row is not in ``append_rows``.
        rewrite_block_indptr: int32 [X+1], CSR offsets of each rewritten row's block ids.
        rewrite_block_ids: int32 [Y], each rewritten row's whole block-table row after this
            step (blocks appended this step included).

    Every field takes a numpy integer array or a sequence of ints; nothing is cast. The
    rules that relate fields or steps are the native core's (module docstring).

    Raises:
        TypeError: a field is not a sequence of ints (a float, bool, string or nested
            sequence in it, or an array of a non-integer dtype); the field is named.
        ValueError: a field is not 1-D, or a value does not fit its dtype (int64 for
            ``req_ids``, int32 for the others); the field, element and value are named.
    """

    req_ids: np.ndarray
    new_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    new_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    new_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    new_block_indptr: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int32))
    new_block_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    append_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    append_block_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    rewrite_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    rewrite_block_indptr: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int32))
    rewrite_block_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    def __post_init__(self) -> None:
        self.req_ids = _ints("req_ids", self.req_ids, _I64)
        for name in _FIELD_NAMES[1:]:
            setattr(self, name, _ints(name, getattr(self, name), _I32))

    @classmethod
    def of_arrays(cls, arrays: Sequence[np.ndarray]) -> DecodeStep:
        """A step of the eleven fields in order, numpy arrays already 1-D, C-contiguous and of
        the fields' dtypes (a native producer's, ``zos._C.VllmMirror``), without the
        constructor's per-field checks: staging the step (``StepPacker.pack_step`` /
        ``stage_call``) still checks dtypes, shapes and the lengths that tie fields together.
        Raises ValueError when ``arrays`` is not eleven items."""
        if len(arrays) != len(_FIELD_NAMES):
            raise ValueError(f"arrays: DecodeStep has {len(_FIELD_NAMES)} fields, got "
                             f"{len(arrays)}")
        step = cls.__new__(cls)
        step.__dict__.update(zip(_FIELD_NAMES, arrays))
        return step

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
        rewrites: Mapping[int, Sequence[int]] | None = None,
    ) -> DecodeStep:
        """Convenience constructor from Python objects.

        Args:
            req_ids: request id per row (ints, or an integer array).
            new: ``{row: (token, position, block_ids)}`` for new rows (``block_ids`` any
                iterable of ints, or an integer array).
            appends: ``(row, block_id)`` pairs, in append order.
            rewrites: ``{row: block_ids}`` for carried rows whose block list changed other
                than by an append: the row's whole block list after this step.

        Raises:
            TypeError, ValueError: as the constructor, naming the field it would fill
                (``req_ids``, ``new_rows``, ``new_tokens``, ``new_positions``,
                ``new_block_ids``, ``append_rows``, ``append_block_ids``, ``rewrite_rows``,
                ``rewrite_block_ids``) and the row; also an argument of the wrong shape
                (``new``, an entry of it, ``appends``, ``rewrites``).
        """
        new, rows, keys = _keyed_rows("new", new, "(token, position, block_ids)", "new_rows")
        entries, lists = [], []
        for r in keys:
            try:
                token, position, block_ids = new[r]
            except (TypeError, ValueError):
                raise TypeError(f"new[{r}] must be (token, position, block_ids), got "
                                f"{new[r]!r}") from None
            entries.append((token, position))
            lists.append(block_ids)
        indptr, flat = _block_lists("new_block_ids", "new row", keys, lists)

        rewrites, rw_rows, rw_keys = _keyed_rows("rewrites", rewrites, "block_ids",
                                                 "rewrite_rows")
        rw_indptr, rw_flat = _block_lists("rewrite_block_ids", "rewritten row", rw_keys,
                                          [rewrites[r] for r in rw_keys])

        if not isinstance(appends, Iterable):
            raise TypeError(f"appends must be an iterable of (row, block_id) pairs, got "
                            f"{type(appends).__name__}")
        pairs = []
        for k, a in enumerate(appends):
            try:
                row, block_id = a
            except (TypeError, ValueError):
                raise TypeError(f"appends[{k}] must be a (row, block_id) pair, got {a!r}") from None
            pairs.append((row, block_id))
        return cls(
            req_ids=_ints("req_ids", req_ids, _I64),
            new_rows=rows,
            new_tokens=_ints("new_tokens", [e[0] for e in entries], _I32,
                             lambda i: f"new_tokens of new row {keys[i]}"),
            new_positions=_ints("new_positions", [e[1] for e in entries], _I32,
                                lambda i: f"new_positions of new row {keys[i]}"),
            new_block_indptr=indptr,
            new_block_ids=flat,
            append_rows=_ints("append_rows", [p[0] for p in pairs], _I32),
            append_block_ids=_ints("append_block_ids", [p[1] for p in pairs], _I32),
            rewrite_rows=rw_rows,
            rewrite_block_indptr=rw_indptr,
            rewrite_block_ids=rw_flat,
        )


_FIELD_NAMES = tuple(f.name for f in fields(DecodeStep))
