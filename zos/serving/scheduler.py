"""The engine's scheduler: the waiting queue, the rows of the decode batch and their KV blocks.

:class:`~zos.serving.engine.Engine` asks it, once per engine step: which rows leave
(:meth:`Scheduler.retire`), which waiting requests to prefill (:meth:`Scheduler.admit`), what the
next decode launch runs (:meth:`Scheduler.schedule_decode`), and what to do with the tokens a
launch kept (:meth:`Scheduler.accept_kept`). It never touches the device.

Positions. ``Request.num_computed`` counts the tokens whose KV is in the cache as of the last
launch read back. A launch runs q token rows per request (1, or 1 + K with K draft tokens) and
keeps between 1 and q of them per row. A row's blocks cover the positions its launch may write:
up to num_computed + q, and q more for a carried row whose previous launch is not read yet (the
overlapped engine stages step t + 1 while step t runs).

Certain finishes. Every launch keeps at least one token per row, so a row whose tokens known
plus its launches in flight reach ``max_new_tokens`` is not launched again (vLLM's async
scheduling never schedules past max_tokens): it leaves at the next :meth:`retire` and its tokens
in flight finish it when they are read. The rule is applied where its answer can change: to the
rows of a launch as it is scheduled (+1, that launch) and to the rows of a launch read while the
next one is in flight (+1, the next one), both before the next step's retire. A finish by eos is
known only when read.

Dropped tokens. A request that gave its blocks back since a launch (finished by an eos read one
step late, or preempted while a launch was in flight) drops that launch's tokens: its KV is
gone. It cannot run again before those tokens are read: preemption happens only while a launch
is scheduled, the engine reads every launch but the newest one before its next step, and a
preempted request comes back through :meth:`admit` at a later step.

Cost. What a launch reads or bumps for every row is kept in numpy arrays by row
(:class:`~zos.serving.row_state.RowState`): a steady step (rows carried, no arrivals or finishes)
is a fixed number of numpy ops over the N rows, one loop appending each row's tokens to its
output, and Python work only for the rows that change (placed, moved, finished, preempted, given
a block).
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np

from zos.serving.request_queue import RequestQueue
from zos.serving.row_layout import place_rows
from zos.serving.row_state import Launch, RowState
from zos.serving.types import EngineConfig, Request
from zos.step import DecodeStep


class Scheduler(RequestQueue):
    """Requests from queued to finished for one engine of ``config`` (a model of
    ``vocab_size`` tokens); see the module doc for the rules. Queueing and admission
    (``add``, ``check``, ``admit``, ``admit_prefilled``; ``allocator``, ``waiting``) are its
    :class:`~zos.serving.request_queue.RequestQueue`'s.

    Attributes:
        rows: request of each row of the last decode launch (None: a hole, filled or closed
            by the next launch's row layout, ``place_rows``).
        row_of: {running request: its row}.
        joining: prefilled requests that join the next decode launch, in order.
        leaving: requests whose rows become holes at the next :meth:`retire`.
        num_preemptions: preemptions so far.
        state: the running rows' per-row arrays (:class:`~zos.serving.row_state.RowState`).
    """

    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        super().__init__(config, vocab_size)
        self.rows: list[Request | None] = []
        self.row_of: dict[Request, int] = {}
        self.joining: list[Request] = []
        self.leaving: set[Request] = set()
        self.num_preemptions = 0
        self.state = RowState(config.max_num_seqs, config.block_size)  # per-row arrays

    def has_work(self) -> bool:
        """Whether a request waits, runs or is about to join a decode launch."""
        return bool(self.waiting or self.row_of or self.joining)

    # ---- requests in (queueing and admission: RequestQueue) --------------------------------

    def num_running(self) -> int:
        """Rows taken: running requests and those joining the next launch."""
        return len(self.row_of) + len(self.joining)

    def start(self, reqs: Sequence[Request], first_tokens: Sequence[int]) -> None:
        """Append each prefilled request's first token (its KV in place: ``num_computed``
        set); those it does not finish join the next decode launch, in order."""
        eos = self.config.eos_token_id
        for req, token in zip(reqs, first_tokens):
            req.output.append(token)
            if token == eos or len(req.output) >= req.max_new_tokens:
                self._stop(req, 1)
            else:
                self.joining.append(req)

    # ---- one decode launch -----------------------------------------------------------------

    def schedule_decode(self, q: int, in_flight: bool) -> tuple[DecodeStep, Launch] | None:
        """The next decode launch: every running row plus the joining requests, each running q
        token rows. ``in_flight``: the previous launch is not read yet (overlap). Allocates the
        blocks each row may write (preempting when none is free), lays the rows out, counts
        the launch (``Request.num_launches``) and marks the rows it is certain to finish.

        Returns ``(step, launch)``: the DecodeStep and the request of each row (a
        :class:`~zos.serving.row_state.Launch`, for :meth:`accept`), or None when no row is
        left to run."""
        fresh, self.joining = self.joining, []
        grown = self._grow_blocks(fresh, q, in_flight)  # may preempt, from fresh too
        moved = self._place(fresh)
        if not self.rows:
            return None
        for i in self.state.count_launch(len(self.rows)).tolist():  # certain finishes
            self.leaving.add(self.rows[i])
        step = self._decode_step(fresh, *self.state.appends(*grown, moved))
        return step, self.state.launch(self.rows)

    def _place(self, fresh: list[Request]) -> bool:
        """Row layout (``place_rows``): new rows fill holes, the last rows close the rest.
        Returns whether a carried row moved."""
        moved = False
        for i in place_rows(self.rows, fresh):
            self.row_of[self.rows[i]] = i
            moved |= self.state.place(self.rows[i], i)
        return moved

    def _grow_blocks(self, fresh: list[Request], q: int, in_flight: bool):
        """Blocks so that each row covers num_computed + q positions, + q for a carried row with
        a launch in flight: the rows short of blocks (carried ones found by a vectorized
        compare, in row order, then ``fresh``) take them one at a time; when none is free the
        most recently admitted request among them is preempted (maybe the one that needs it).
        Returns the carried requests that got blocks, their rows (ascending, before the row
        layout), how many blocks each got and those block ids in the order appended."""
        bs, span, rows, st = (self.config.block_size, q * (2 if in_flight else 1), self.rows,
                              self.state)
        carried, missing = st.short_of_blocks(len(rows), span)
        short, missing = list(map(rows.__getitem__, carried.tolist())), missing.tolist()
        k = len(short)
        for r in fresh:
            if len(r.blocks) * bs < r.num_computed + q:
                short.append(r)
                missing.append(-(-(r.num_computed + q) // bs) - len(r.blocks))
        got = self.allocator.allocate(sum(missing)) if short else []
        if got is not None:  # enough for all: the blocks one at a time would hand out
            if len(got) == len(short):  # one each
                for req, b in zip(short, got):
                    req.blocks.append(b)
            else:
                for req, end, n in zip(short, accumulate(missing), missing):
                    req.blocks += got[end - n:end]
            if k:
                st.add_blocks(carried, np.array(missing[:k], np.int64))
            return short[:k], carried, missing[:k], got[:sum(missing[:k])]
        appended = {}
        for i, req in enumerate(short):  # too few: one at a time, preempting
            while len(req.blocks) * bs < req.num_computed + (span if i < k else q) and (
                    req in self.row_of or req in fresh):
                got = self.allocator.allocate(1)
                if got is None:
                    self._preempt_newest(fresh, appended)
                    continue
                req.blocks += got
                st.grew(req)
                if i < k:
                    appended.setdefault(req, []).extend(got)
        return (list(appended), np.array([self.row_of[r] for r in appended], np.int64),
                [len(b) for b in appended.values()], [b for bl in appended.values() for b in bl])

    def _decode_step(self, fresh: list[Request], append_rows: np.ndarray,
                     append_block_ids: np.ndarray) -> DecodeStep:
        """The launch's DecodeStep: each new row whole (token, position, blocks), the carried
        rows' appended blocks."""
        ids = self.state.req_ids[:len(self.rows)].copy()
        if fresh:
            return DecodeStep.build(ids, {self.row_of[r]: (r.output[-1], r.num_computed, r.blocks)
                                          for r in fresh},
                                    zip(append_rows.tolist(), append_block_ids.tolist()))
        return DecodeStep(ids, append_rows=append_rows, append_block_ids=append_block_ids)

    # ---- tokens back -----------------------------------------------------------------------

    def accept(self, launch: Launch, tokens: Sequence[Sequence[int]],
               more_in_flight: bool) -> None:
        """:meth:`accept_kept` with the tokens kept given per row (sequences of ints)."""
        counts = np.array([len(t) for t in tokens], np.int64)
        kept = np.array([t for row in tokens for t in row], np.int64)
        self.accept_kept(launch, kept, counts, more_in_flight)

    def accept_kept(self, launch: Launch, kept: np.ndarray, counts: np.ndarray | None,
                    more_in_flight: bool) -> None:
        """The tokens one launch kept (``launch``: what :meth:`schedule_decode` returned):
        ``kept`` (int [sum(counts)]) holds row 0's tokens, then row 1's, ...; ``counts`` (int
        [N]) how many each row kept, None for one each. The row's KV advances by its count and
        its output takes its tokens up to the first eos or its ``max_new_tokens`` (the rest are
        dropped). A request that gave its blocks back since the launch drops them all.
        ``more_in_flight``: a later launch is still unread, so a row one token short of
        max_new_tokens is a certain finish.

        The rows still bound where they were launched take their tokens vectorized
        (``RowState.take``); the rows their tokens stop and the launch's other rows (moved, or
        retired with a launch in flight) are then handled one by one, in row order."""
        more = int(more_in_flight)
        stopped, others = self.state.take(launch, kept, counts, more, self.config.eos_token_id)
        if not stopped and not others:
            return
        events = dict.fromkeys(stopped, True)
        events.update((i, False) for i in others if launch[i].blocks)
        ends = None if counts is None else np.cumsum(counts).tolist()
        for i in sorted(events):
            a = 1 if counts is None else int(counts[i])
            if events[i]:
                self._stop(launch[i], a)
            else:
                end = i + 1 if ends is None else ends[i]
                self._take(launch[i], kept[end - a:end].tolist(), more)

    def _take(self, req: Request, kept: list[int], more: int) -> None:
        """One row's kept tokens when its request is not where it was launched."""
        out, eos = req.output, self.config.eos_token_id
        out += kept
        req.num_computed += len(kept)
        self.state.output_grew(req)
        if len(out) + more >= req.max_new_tokens or (eos is not None and eos in kept):
            self._stop(req, len(kept))

    def _stop(self, req: Request, n: int) -> None:
        """``req`` got its last ``n`` tokens and reached eos or max_new_tokens within them (its
        output ends at the first stop, the tokens after it are dropped, and it finishes), or
        will reach max_new_tokens with the launch in flight (it leaves)."""
        out, eos = req.output, self.config.eos_token_id
        for i in range(len(out) - n, len(out)):
            if out[i] == eos or i + 1 >= req.max_new_tokens:
                del out[i + 1:]
                self.finish(req, "eos" if out[i] == eos else "length")
                return
        self.leaving.add(req)  # a certain finish

    def finish(self, req: Request, reason: str) -> None:
        """Finish ``req`` ("eos" or "length"): its blocks go back, its row leaves at the next
        :meth:`retire`, its tokens still in flight are dropped, its req_id may be reused."""
        req.finish_reason = reason
        self.state.release(req)
        self.allocator.free(req.blocks)
        req.blocks = []
        self._live.discard(req.req_id)
        self.leaving.add(req)

    def retire(self) -> None:
        """Rows of the requests in :attr:`leaving` become holes."""
        for req in self.leaving:
            i = self.row_of.pop(req, None)
            if i is not None:
                self.rows[i] = None
            self.state.release(req)
        self.leaving.clear()

    # ---- preemption ------------------------------------------------------------------------

    def _preempt_newest(self, fresh: list[Request], appended: dict) -> None:
        """Preempt the most recently admitted request among the running rows and ``fresh``,
        taking it out of the launch being scheduled: its row becomes a hole (or it leaves
        ``fresh``) and the blocks appended to it are forgotten."""
        victim = max([r for r in self.rows if r is not None] + fresh, key=lambda r: r.admit_seq)
        appended.pop(victim, None)
        self.preempt(victim)
        if victim in fresh:
            fresh.remove(victim)

    def preempt(self, req: Request) -> None:
        """Recompute preemption (vLLM's default): every block goes back, its row (if it holds
        one) becomes a hole, and ``req`` is queued at the front, to be prefilled again with
        prompt + output; its tokens in flight are dropped."""
        self.state.release(req)
        i = self.row_of.pop(req, None)
        if i is not None:
            self.rows[i] = None
        self.allocator.free(req.blocks)
        req.blocks, req.num_computed, req.num_preemptions = [], 0, req.num_preemptions + 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
