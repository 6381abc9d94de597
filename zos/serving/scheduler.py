"""The engine's scheduler: the waiting queue, the rows of the decode batch and their KV blocks.

:class:`~zos.serving.engine.Engine` asks it, once per engine step: which rows leave
(:meth:`Scheduler.retire`), which waiting requests to prefill (:meth:`Scheduler.admit`), what the
next decode launch runs (:meth:`Scheduler.schedule_decode`), and what to do with the tokens a
launch kept (:meth:`Scheduler.accept`). It never touches the device.

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
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import accumulate

import numpy as np

from zos._checks import check_int
from zos.serving.kv_blocks import BlockAllocator
from zos.serving.row_layout import place_rows
from zos.serving.types import EngineConfig, Request
from zos.step import DecodeStep

_I64 = np.iinfo(np.int64)


class Scheduler:
    """Requests from queued to finished for one engine of ``config`` (a model of
    ``vocab_size`` tokens); see the module doc for the rules.

    Attributes:
        allocator: the KV block allocator (block 0 is the null block).
        waiting: requests queued for prefill, in order (preempted ones go back to the front).
        rows: request of each row of the last decode launch (None: a hole, filled or closed
            by the next launch's row layout, ``place_rows``).
        row_of: {running request: its row}.
        joining: prefilled requests that join the next decode launch, in order.
        leaving: requests whose rows become holes at the next :meth:`retire`.
        num_preemptions: preemptions so far.
    """

    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        self.config, self.vocab_size = config, vocab_size
        self.allocator = BlockAllocator(config.num_kv_blocks)
        self.waiting: deque[Request] = deque()
        self.rows: list[Request | None] = []
        self.row_of: dict[Request, int] = {}
        self.joining: list[Request] = []
        self.leaving: set[Request] = set()
        self.num_preemptions = 0
        self._live: set[int] = set()  # req_ids waiting or running (not finished)
        self._admitted = 0  # admissions so far: each request's admit_seq
        self._req_ids = np.zeros(config.max_num_seqs, np.int64)  # DecodeStep.req_ids by row

    def has_work(self) -> bool:
        """Whether a request waits, runs or is about to join a decode launch."""
        return bool(self.waiting or self.row_of or self.joining)

    # ---- requests in -----------------------------------------------------------------------

    def add(self, reqs: Iterable[Request]) -> None:
        """Queue ``reqs`` in order, all or none (see ``Engine.add_requests`` for the errors)."""
        reqs, ids = list(reqs), set()
        for req in reqs:
            self.check(req)
            if req.req_id in ids:
                raise ValueError(f"request {req.req_id}: req_id given twice")
            ids.add(req.req_id)
        self.waiting.extend(reqs)
        self._live |= ids

    def check(self, req: Request) -> None:
        """Raise unless ``req`` may be queued (see ``Engine.add_requests``)."""
        cfg, vocab, rid = self.config, self.vocab_size, req.req_id
        check_int(f"request {rid!r}: req_id", rid, int(_I64.min))
        if rid > _I64.max:  # DecodeStep.req_ids is int64; the packer keys rows by it
            raise ValueError(f"request {rid}: req_id does not fit int64")
        if not req.prompt or any(not 0 <= t < vocab for t in req.prompt):
            raise ValueError(f"request {rid}: prompt must be non-empty ids in [0, {vocab})")
        if req.max_new_tokens < 1 or len(req.prompt) + req.max_new_tokens > cfg.max_model_len:
            raise ValueError(f"request {rid}: need max_new_tokens >= 1 and prompt + "
                             f"max_new_tokens <= max_model_len {cfg.max_model_len}")
        if rid in self._live:
            raise ValueError(f"request {rid}: req_id is already waiting or running")

    def admit(self) -> list[Request]:
        """Waiting requests, in order, while a row, blocks for their prefill (prompt + output +
        1 positions: a resumed request recomputes its output) and the prefill budget allow."""
        cfg, out, used = self.config, [], 0
        running = len(self.row_of) + len(self.joining)
        while self.waiting and running + len(out) < cfg.max_num_seqs:
            req = self.waiting[0]
            n = len(req.prompt) + len(req.output)
            if out and used + n > cfg.max_prefill_tokens:
                break
            blocks = self.allocator.allocate(-(-(n + 1) // cfg.block_size))
            if blocks is None:
                break
            self.waiting.popleft()
            req.blocks, req.admit_seq, self._admitted = blocks, self._admitted, self._admitted + 1
            out.append(req)
            used += n
        return out

    def admit_prefilled(self, req: Request, first_token: int) -> None:
        """Admit ``req`` with the KV of its prompt taken as in the cache: blocks for prompt + 1
        positions. Raises ValueError (nothing changed) for an invalid request, a first token
        outside the vocabulary, no free row or too few free blocks; the caller then starts it
        (:meth:`start`)."""
        self.check(req)
        if len(self.row_of) + len(self.joining) >= self.config.max_num_seqs:
            raise ValueError(f"request {req.req_id}: no free row (max_num_seqs "
                             f"{self.config.max_num_seqs})")
        if not 0 <= first_token < self.vocab_size:
            raise ValueError(f"request {req.req_id}: first_token {first_token} is outside the "
                             f"vocabulary")
        blocks = self.allocator.allocate(-(-(len(req.prompt) + 1) // self.config.block_size))
        if blocks is None:
            raise ValueError(f"request {req.req_id}: not enough free KV blocks")
        req.blocks, req.num_computed = blocks, len(req.prompt)
        self._live.add(req.req_id)
        req.admit_seq, self._admitted = self._admitted, self._admitted + 1

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

    def schedule_decode(self, q: int, in_flight: bool) -> tuple[DecodeStep, list[Request]] | None:
        """The next decode launch: every running row plus the joining requests, each running q
        token rows. ``in_flight``: the previous launch is not read yet (overlap). Allocates the
        blocks each row may write (preempting when none is free), lays the rows out, counts
        the launch (``Request.num_launches``) and marks the rows it is certain to finish.

        Returns ``(step, rows)``: the DecodeStep and the request of each row, or None when no
        row is left to run."""
        fresh, self.joining = self.joining, []
        appended = self._grow_blocks(fresh, q, in_flight)  # may preempt, from fresh too
        self._place(fresh)
        if not self.rows:
            return None
        self._count_launch()
        return self._decode_step(fresh, appended), list(self.rows)

    def _place(self, fresh: list[Request]) -> None:
        """Row layout (``place_rows``): new rows fill holes, the last rows close the rest."""
        for i in place_rows(self.rows, fresh):
            self.row_of[self.rows[i]] = i
            self._req_ids[i] = self.rows[i].req_id

    def _count_launch(self) -> None:
        """Each row is launched once more; this launch gives it at least one token, so a row
        one token short of max_new_tokens is a certain finish."""
        for req in self.rows:
            req.num_launches += 1
            if len(req.output) + 1 >= req.max_new_tokens:
                self.leaving.add(req)

    def _grow_blocks(self, fresh: list[Request], q: int,
                     in_flight: bool) -> dict[Request, list[int]]:
        """Blocks so that each row covers num_computed + q positions, + q for a carried row with
        a launch in flight: the rows short of blocks, carried ones in row order, then ``fresh``,
        take them one at a time; when none is free the most recently admitted request among
        them is preempted (maybe the one that needs it). Returns {carried request: blocks
        appended, in order}."""
        bs, span = self.config.block_size, q * (2 if in_flight else 1)
        short = [(r, span, True) for r in self.rows
                 if r is not None and len(r.blocks) * bs < r.num_computed + span]
        short += [(r, q, False) for r in fresh if len(r.blocks) * bs < r.num_computed + q]
        missing = [-(-(r.num_computed + s) // bs) - len(r.blocks) for r, s, _ in short]
        got, appended = self.allocator.allocate(sum(missing)), {}
        if got is not None:  # enough for all: the blocks one at a time would hand out
            for (req, _, carried), end, n in zip(short, accumulate(missing), missing):
                req.blocks += got[end - n:end]
                if carried:
                    appended[req] = got[end - n:end]
            return appended
        for req, s, carried in short:  # too few: one at a time, preempting
            while len(req.blocks) * bs < req.num_computed + s and (req in self.row_of
                                                                     or req in fresh):
                got = self.allocator.allocate(1)
                if got is None:
                    self._preempt_newest(fresh, appended)
                    continue
                req.blocks += got
                if carried:
                    appended.setdefault(req, []).extend(got)
        return appended

    def _decode_step(self, fresh: list[Request], appended: dict) -> DecodeStep:
        """The launch's DecodeStep: each new row whole (token, position, blocks), appended
        blocks by row in the order appended."""
        row_of, ids = self.row_of, self._req_ids[:len(self.rows)].copy()
        appends = sorted(((row_of[r], b) for r, bl in appended.items() for b in bl),
                         key=lambda e: e[0])
        if fresh:
            return DecodeStep.build(ids, {row_of[r]: (r.output[-1], r.num_computed, r.blocks)
                                          for r in fresh}, appends)
        return DecodeStep(ids, append_rows=np.array([i for i, _ in appends], np.int32),
                          append_block_ids=np.array([b for _, b in appends], np.int32))

    # ---- tokens back -----------------------------------------------------------------------

    def accept(self, reqs: Sequence[Request], tokens: Sequence[Sequence[int]],
               more_in_flight: bool) -> None:
        """The tokens one launch kept, per row (``reqs``: the launch's rows): the row's KV
        advances by their count and its output takes them up to the first eos or its
        ``max_new_tokens`` (the rest are dropped). A request that gave its blocks back since
        the launch drops them all. ``more_in_flight``: a later launch is still unread, so a
        row one token short of max_new_tokens is a certain finish."""
        eos, more = self.config.eos_token_id, int(more_in_flight)
        for req, kept in zip(reqs, tokens):
            if req.blocks:  # else finished or preempted since the launch: its KV is gone
                out = req.output
                out += kept
                req.num_computed += len(kept)
                if (len(out) + more >= req.max_new_tokens  # rarely true
                        or (eos is not None and eos in kept)):
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
        else:
            self.rows[self.row_of.pop(victim)] = None

    def preempt(self, req: Request) -> None:
        """Recompute preemption (vLLM's default): every block goes back and ``req`` is queued
        at the front, to be prefilled again with prompt + output; its tokens in flight are
        dropped."""
        self.allocator.free(req.blocks)
        req.blocks, req.num_computed, req.num_preemptions = [], 0, req.num_preemptions + 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
