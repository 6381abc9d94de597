"""Per-row numpy state of the scheduler's decode rows: a steady decode step does Python work only
for the rows that change, and a fixed number of numpy ops over the N rows.

While a request holds a decode row, what every step reads or bumps lives in :class:`RowState`'s
arrays, indexed by row: its request id (``DecodeStep.req_ids``), the positions its blocks cover
beyond ``num_computed`` (``slack``), the tokens it may still generate (``left``), its output
list and the launch count it joined at. A launch's block check ("short of blocks": slack < the
positions the launch may write) and certain-finish check (left <= 1) are one compare each; the
read-back of a launch lowers slack and left of its rows in one op and appends their tokens in
one loop. Python touches a row only when it changes: a request placed in a row or moved
(:meth:`RowState.place`), unbound (:meth:`RowState.release`: finished, preempted or retired),
given blocks (:meth:`RowState.grew`). ``Request.num_computed`` and ``Request.num_launches`` read
the arrays while the request is bound (``Request.row_state``) and their own fields otherwise.

Launch stamps. Each placement of a request in a row gets a new stamp (an unbound row has stamp
-1), and every placement or release a new layout ``epoch``. A :class:`Launch` keeps its rows'
stamps and the epoch; when it is read, the rows whose stamp is unchanged (all of them when the
epoch is) still hold the same live request at the same index, so its tokens go to that row
without looking at the request.
"""
from __future__ import annotations

import numpy as np

_FREE = np.iinfo(np.int64).max // 4  # slack of a row with no live request: never short
_NONE = np.zeros(0, np.int64)
_NO_APPENDS = (np.zeros(0, np.int32), np.zeros(0, np.int32))  # empty: never written


class Launch(list):
    """The requests of one decode launch, by row (a list); ``stamps`` (int64 [N]): each row's
    placement stamp at launch time; ``epoch``: the RowState's layout epoch then."""

    def __init__(self, rows, stamps: np.ndarray, epoch: int) -> None:
        super().__init__(rows)
        self.stamps, self.epoch = stamps, epoch


class RowState:
    """Arrays of ``max_num_seqs`` rows (int64; ``outs``: a list).

    Attributes:
        req_ids: request id of each row (``DecodeStep.req_ids`` of the next launch).
        stamps: placement stamp of each row, -1 where no live request is bound.
        covered: positions the bound request's blocks cover (blocks x block_size).
        budget: [2, max_num_seqs]: ``slack`` (row 0): covered - num_computed (huge when
            unbound, so an unbound row never needs a block), and ``left`` (row 1): tokens the
            request may still generate, max_new_tokens - len(output). A kept token lowers both.
        launch_base: ``launches`` - num_launches of the bound request.
        outs: the bound request's ``output`` list (None when unbound).
        launches: launches counted so far; epoch: placements and releases so far.
    """

    def __init__(self, max_num_seqs: int, block_size: int) -> None:
        self.block_size = block_size
        self.req_ids = np.zeros(max_num_seqs, np.int64)
        self.stamps = np.full(max_num_seqs, -1, np.int64)
        self.covered = np.zeros(max_num_seqs, np.int64)
        self.launch_base = np.zeros(max_num_seqs, np.int64)
        self.budget = np.zeros((2, max_num_seqs), np.int64)
        self.budget[0] = _FREE
        self.slack, self.left = self.budget  # views
        self.outs: list[list[int] | None] = [None] * max_num_seqs
        self.launches = self.epoch = 0

    # ---- a bound request's values (``Request`` properties) -----------------------------------

    def num_computed_at(self, row: int) -> int:
        """num_computed of the request bound to ``row`` (covered - slack)."""
        return int(self.covered[row] - self.slack[row])

    def set_num_computed(self, row: int, value: int) -> None:
        """Set it (the slack follows; the blocks covering positions do not change)."""
        self.slack[row] = self.covered[row] - value

    def num_launches_at(self, row: int) -> int:
        """num_launches of the request bound to ``row`` (launches - its launch base)."""
        return int(self.launches - self.launch_base[row])

    def set_num_launches(self, row: int, value: int) -> None:
        """Set it (the launch base follows)."""
        self.launch_base[row] = self.launches - value

    # ---- rows that change (Python, one row at a time) ----------------------------------------

    def place(self, req, row: int) -> bool:
        """Bind ``req`` to ``row``: a request moved from another row takes its values along, a
        new one brings its own fields; either way the row gets a new stamp. Returns whether it
        moved."""
        moved = req.row_state is self
        if moved:  # carry the arrays' values
            old = req.row_index
            self.covered[row], self.launch_base[row] = self.covered[old], self.launch_base[old]
            self.budget[:, row] = self.budget[:, old]
            self.unbind_row(old)
        else:
            self.covered[row] = len(req.blocks) * self.block_size
            self.set_num_computed(row, req.num_computed)
            self.set_num_launches(row, req.num_launches)
            self.left[row] = req.max_new_tokens - len(req.output)
        self.req_ids[row], self.outs[row] = req.req_id, req.output
        self.stamps[row], self.epoch = self.epoch, self.epoch + 1
        req.bind_row(self, row)
        return moved

    def release(self, req) -> None:
        """Unbind ``req`` (if bound here): its num_computed and num_launches go back to its own
        fields and its row becomes unbound (stamp -1: its launches in flight no longer match)."""
        if req.row_state is not self:
            return
        row = req.row_index
        req.bind_row(None, -1)
        req.num_computed, req.num_launches = self.num_computed_at(row), self.num_launches_at(row)
        self.unbind_row(row)
        self.epoch += 1

    def unbind_row(self, row: int) -> None:
        """Mark ``row`` as holding no live request."""
        self.stamps[row], self.covered[row], self.slack[row], self.outs[row] = -1, 0, _FREE, None

    def grew(self, req) -> None:
        """``req.blocks`` changed: refresh the positions its row covers (if bound here)."""
        if req.row_state is self:
            row, covered = req.row_index, len(req.blocks) * self.block_size
            self.slack[row] += covered - self.covered[row]
            self.covered[row] = covered

    def output_grew(self, req) -> None:
        """``req.output`` changed outside :meth:`take`: refresh its tokens left (if bound)."""
        if req.row_state is self:
            self.left[req.row_index] = req.max_new_tokens - len(req.output)

    def appends(self, grown: list, rows: np.ndarray, counts: list[int], block_ids: list[int],
                moved: bool) -> tuple[np.ndarray, np.ndarray]:
        """A launch's ``append_rows`` and ``append_block_ids`` (int32 [A] each), by row, in the
        order appended: the requests ``grown`` got ``counts`` blocks each (``block_ids``, in
        that order) at ``rows`` (ascending) before the row layout; ``moved``: the layout moved
        some rows, so their rows are read from the requests and sorted (stable)."""
        if not grown:
            return _NO_APPENDS
        if moved:
            rows = np.array([r.row_index for r in grown], np.int64)
        rows, ids = np.repeat(rows.astype(np.int32), counts), np.array(block_ids, np.int32)
        if moved:
            order = np.argsort(rows, kind="stable")
            rows, ids = rows[order], ids[order]
        return rows, ids

    # ---- every row at once (vectorized over rows 0..n-1) -------------------------------------

    def short_of_blocks(self, n: int, span: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows (ascending) whose blocks do not cover num_computed + ``span`` positions, and
        the blocks each is missing."""
        rows = (self.slack[:n] < span).nonzero()[0]
        if not rows.size:
            return rows, _NONE
        return rows, -((self.slack[rows] - span) // self.block_size)

    def add_blocks(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """``rows`` (bound, int [R]) got ``counts`` (int [R]) blocks each."""
        positions = counts * self.block_size
        self.covered[rows] += positions
        self.slack[rows] += positions

    def count_launch(self, n: int) -> np.ndarray:
        """One more launch for rows 0..n-1 (every bound row); returns the rows that launch is
        certain to finish (one token left, or none), ascending."""
        self.launches += 1
        return (self.left[:n] <= 1).nonzero()[0]

    def launch(self, rows: list) -> Launch:
        """The launch of ``rows`` (rows 0..N-1), with their stamps."""
        return Launch(rows, self.stamps[:len(rows)].copy(), self.epoch)

    def take(self, launch: Launch, kept: np.ndarray, counts: np.ndarray | None, more: int,
             eos: int | None) -> tuple[list[int], list[int]]:
        """The rows of ``launch`` still bound where they were launched take their kept tokens
        (``kept``, ``counts``: see ``Scheduler.accept_kept``): slack and left lowered by one
        numpy op, the tokens appended to their outputs in one loop.

        Returns ``(stopped, others)``: those rows that their tokens stop (an eos among them, or
        at most ``more`` tokens left: a finish, certain or reached), and the launch's other
        rows (moved, or no longer bound), for the caller to handle one by one; both ascending
        launch rows.
        """
        n = len(launch)
        if launch.epoch == self.epoch:  # a steady step: the launch's rows are rows 0..n-1
            idx, rows, others = slice(0, n), range(n), []
        else:
            same = launch.stamps == self.stamps[:n]
            idx = same.nonzero()[0]
            rows, others = idx.tolist(), (~same).nonzero()[0].tolist()
        self.budget[:, idx] -= 1 if counts is None else counts[idx]
        stop = self.left[idx] <= more
        if eos is not None:
            hit = kept == eos
            if hit.any():
                if counts is not None:  # rows with an eos among their tokens
                    hit = np.bincount(np.repeat(np.arange(n), counts)[hit], minlength=n) > 0
                stop |= hit[idx]
        outs = self.outs
        if counts is None:
            if others:
                for i, t in zip(rows, kept[idx].tolist()):
                    outs[i].append(t)
            else:
                for out, t in zip(outs, kept.tolist()):
                    out.append(t)
        else:
            flat, ends, cl = kept.tolist(), np.cumsum(counts).tolist(), counts.tolist()
            for i in rows:
                outs[i] += flat[ends[i] - cl[i]:ends[i]]
        stopped = stop.nonzero()[0]
        return (stopped if isinstance(idx, slice) else idx[stopped]).tolist(), others
