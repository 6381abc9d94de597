"""The engine's decode step and read-back with speculative decoding (q = 1 + K token rows).

``SpecDecodeMixin`` holds the :class:`~zos.serving.engine.Engine` methods of this path, split
from engine.py to keep each file small; they use the engine's state (rows, allocator, readback,
pending launches). Unlike plain decode, a row advances by its accepted count, known only after
the step: every running row is looked at in every step (no wake-up schedule), blocks are
allocated for the worst case and the accepted counts go back to the backend
(``observe_accepted``). ``num_computed`` is exact as of the last step read back. Synchronous
engine: step t is read back before t + 1 is staged, so a row writes positions num_computed ..
num_computed + K. Overlapped engine: step t + 1 is staged while t runs, so a carried row may
first advance by up to q in step t: its blocks cover num_computed + 2q, and its counts reach the
backend one step late (steps_ago = 1). A row is not launched once its finish by length is
certain from the launches in flight (at least one token each).
"""
from __future__ import annotations

import time

import numpy as np

from zos.serving.row_layout import place_rows
from zos.step import DecodeStep


class SpecDecodeMixin:
    """The speculative decode step and read-back of :class:`~zos.serving.engine.Engine`."""

    def _ensure_spec_blocks(self, fresh: list) -> dict:
        """Blocks so that every row (carried, in row order, then new) covers the positions it
        may write (see the module doc); preempts the most recently admitted request when none is
        free. Returns {request: blocks appended to a carried row}."""
        bs, q = self.config.block_size, self.buffers.uniform_decode_query_len
        rows, row_of = self.rows, self._row_of
        in_flight = q if self.overlap and self.readback.pending else 0  # step t still unread
        appended: dict = {}
        for req in [r for r in rows if r is not None] + list(fresh):
            reach = req.num_computed + q + (0 if req in fresh else in_flight)
            while (req in row_of or req in fresh) and len(req.blocks) * bs < reach:
                got = self.allocator.allocate(1)
                if got is not None:
                    req.blocks.append(got[0])
                    if req not in fresh:
                        appended.setdefault(req, []).append(got[0])
                    continue
                self._preempt_newest(rows, row_of, fresh, appended)
        return appended

    def _decode_spec(self, fresh: list):
        """One speculative decode launch of every running row plus ``fresh`` (new rows); queues
        the copy of ``spec.output`` for :meth:`_drain_spec`. Returns the StepRecord (None if
        nothing runs)."""
        t0 = time.perf_counter()
        appended = self._ensure_spec_blocks(fresh)
        rows, row_of = self.rows, self._row_of
        for i in place_rows(rows, fresh):
            row_of[rows[i]] = i
        if not rows:
            return None
        # by row, each row's blocks in the order they were appended (a stable sort on the row)
        appends = sorted(((row_of[r], b) for r, bl in appended.items() for b in bl),
                         key=lambda e: e[0])
        step = DecodeStep.build([r.req_id for r in rows],
                                {row_of[r]: (r.output[-1], r.num_computed, r.blocks)
                                 for r in fresh}, appends)
        res = self.runner.decode(step)
        for req in rows:
            req.num_launches += 1
        self.readback.push(self.spec.output, list(rows))
        self._pending.append((set(), self._launches))  # drops, and the launch it belongs to
        self._launches += 1
        if self.overlap:
            self._retire_certain_finishes()
        return self._record("decode", res.path, res.num_reqs, res.padded_size, res.prep_us,
                            res.upload_bytes, t0, res.eager_reason)

    def _drain_spec(self) -> None:
        """Read the oldest pending step's accepted tokens: hand the counts to the backend, then
        append each row's tokens with the stop checks (eos or max_new_tokens in the middle of a
        row's tokens stops it there; the rest are dropped). A request finished or preempted since
        the launch drops its tokens."""
        reqs, outs = self.readback.pop()
        drop, launch = self._pending.popleft()
        accepted = np.array([o[0] for o in outs], np.int32)
        # 0: the step staged last (synchronous engine); 1: the one before (overlap)
        self.backend.observe_accepted(accepted, self._launches - 1 - launch)
        self.spec_rows += len(reqs)
        self.spec_tokens += int(accepted.sum())
        for req, out in zip(reqs, outs):
            if req in drop or req.finish_reason is not None:
                continue
            a = out[0]
            req.num_computed += a  # tokens at positions num_computed .. + a - 1 are now valid KV
            for tok in out[1:1 + a]:
                if self._append(req, tok):
                    break
        if self.readback.pending:  # overlap: launches still in flight, tokens known now
            self._retire_certain_finishes()

    def _retire_certain_finishes(self) -> None:
        """Under overlap, a row whose finish by length is already certain is not launched
        again (the plain engine's rule, vLLM's in async scheduling: never schedule past
        max_tokens): each launch in flight gives it at least one token (the verifier keeps
        >= 1 per row), so once its tokens known plus one per launch in flight reach
        max_new_tokens it is retired at the next step, and its tokens in flight finish it when
        read. A finish by eos is not known until read: such rows keep being launched. Checked
        after each launch and after each read-back that leaves launches in flight."""
        flying: dict = {}
        for p, (drop, _) in zip(self.readback.pending, self._pending):
            for req in p.rows:
                if req not in drop:
                    flying[req] = flying.get(req, 0) + 1
        for req, n in flying.items():
            if req.finish_reason is None and len(req.output) + n >= req.max_new_tokens:
                self._ending.add(req)
