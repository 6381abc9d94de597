"""The scheduler's per-row numpy state (``zos.serving.row_state``) against the per-row scheduler it
replaced (``PerRowScheduler`` below: every launch visits every row in Python), over seeded random
traces: arrivals mid-run, eos and length finishes, preemption (few KV blocks), rows moved by the
row layout, plain (q = 1) and draft (q = 1 + k) launches, synchronous and overlapped (a launch
read one step late). Each step's DecodeStep, rows, and every request's output, finish reason,
num_computed, num_launches, blocks and preemptions must be identical; after every step each bound
row's arrays must equal the plain per-row values (blocks covering positions, num_computed =
prompt + output - 1 for a running request, tokens left), and the vectorized block need must
equal the per-row rule for several spans."""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import pytest

from zos.serving.row_layout import place_rows
from zos.serving.scheduler import Scheduler
from zos.serving.types import EngineConfig, Request
from zos.step import DecodeStep

BS, VOCAB, EOS = 4, 12, 3


class PerRowScheduler(Scheduler):
    """:class:`~zos.serving.scheduler.Scheduler` with the per-row launch, accept, finish, retire
    and preemption it had before its row arrays, verbatim less docstrings (no RowState:
    requests keep their own num_computed and num_launches)."""

    def __init__(self, config, vocab_size):
        super().__init__(config, vocab_size)
        self.req_ids_by_row = np.zeros(config.max_num_seqs, np.int64)

    def schedule_decode(self, q: int,
                        in_flight: bool) -> tuple[DecodeStep, list[Request]] | None:
        fresh, self.joining = self.joining, []
        appended = self._grow_blocks(fresh, q, in_flight)  # may preempt, from fresh too
        self._place(fresh)
        if not self.rows:
            return None
        self._count_launch()
        return self._decode_step(fresh, appended), list(self.rows)

    def _place(self, fresh: list[Request]) -> None:
        for i in place_rows(self.rows, fresh):
            self.row_of[self.rows[i]] = i
            self.req_ids_by_row[i] = self.rows[i].req_id

    def _count_launch(self) -> None:
        for req in self.rows:
            req.num_launches += 1
            if len(req.output) + 1 >= req.max_new_tokens:
                self.leaving.add(req)

    def _grow_blocks(self, fresh: list[Request], q: int,
                     in_flight: bool) -> dict[Request, list[int]]:
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
        row_of, ids = self.row_of, self.req_ids_by_row[:len(self.rows)].copy()
        appends = sorted(((row_of[r], b) for r, bl in appended.items() for b in bl),
                         key=lambda e: e[0])
        if fresh:
            return DecodeStep.build(ids, {row_of[r]: (r.output[-1], r.num_computed, r.blocks)
                                          for r in fresh}, appends)
        return DecodeStep(ids, append_rows=np.array([i for i, _ in appends], np.int32),
                          append_block_ids=np.array([b for _, b in appends], np.int32))

    def accept(self, reqs: Sequence[Request], tokens: Sequence[Sequence[int]],
               more_in_flight: bool) -> None:
        eos, more = self.config.eos_token_id, int(more_in_flight)
        for req, kept in zip(reqs, tokens):
            if req.blocks:  # else finished or preempted since the launch: its KV is gone
                out = req.output
                out += kept
                req.num_computed += len(kept)
                if (len(out) + more >= req.max_new_tokens  # rarely true
                        or (eos is not None and eos in kept)):
                    self._stop(req, len(kept))

    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        self.allocator.free(req.blocks)
        req.blocks = []
        self._live.discard(req.req_id)
        self.leaving.add(req)

    def retire(self) -> None:
        for req in self.leaving:
            i = self.row_of.pop(req, None)
            if i is not None:
                self.rows[i] = None
        self.leaving.clear()

    def _preempt_newest(self, fresh: list[Request], appended: dict) -> None:
        victim = max([r for r in self.rows if r is not None] + fresh,
                     key=lambda r: r.admit_seq)
        appended.pop(victim, None)
        self.preempt(victim)
        if victim in fresh:
            fresh.remove(victim)
        else:
            self.rows[self.row_of.pop(victim)] = None

    def preempt(self, req: Request) -> None:
        self.allocator.free(req.blocks)
        req.blocks, req.num_computed, req.num_preemptions = [], 0, req.num_preemptions + 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)


def make_requests(seed, n):
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))],
                    rng.randint(1, 20)) for i in range(n)]


def kept_tokens(seed, launch_no, rows, q):
    """The tokens each row of launch ``launch_no`` keeps: 1..q of them, seeded."""
    rng = random.Random(seed * 100_003 + launch_no)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, q))] for _ in rows]


def check_row_state(s):
    """Every bound row's arrays against the request's plain values; the vectorized block need
    against the per-row rule."""
    st, rows = s.state, s.rows
    bound = [i for i, r in enumerate(rows) if r is not None and r.row_state is st]
    for i in bound:
        r = rows[i]
        assert r.row_index == i and st.req_ids[i] == r.req_id and st.outs[i] is r.output
        assert st.covered[i] == len(r.blocks) * BS
        assert r.num_computed == len(r.prompt) + len(r.output) - 1
        assert st.left[i] == r.max_new_tokens - len(r.output)
    assert all(st.stamps[i] == -1 for i in range(len(st.stamps)) if i not in bound)
    for span in (1, 2, 3, 5, 8):
        want = [i for i in bound if len(rows[i].blocks) * BS < rows[i].num_computed + span]
        got, missing = st.short_of_blocks(len(rows), span)
        assert got.tolist() == want
        assert missing.tolist() == [-(-(rows[i].num_computed + span) // BS)
                                    - len(rows[i].blocks) for i in want]


def drive(cls, seed, k, overlap, api, num_kv_blocks):
    """Run a seeded trace on a scheduler of class ``cls``; returns the per-step snapshots and
    counts of (preemptions, eos finishes, carried rows moved)."""
    q = 1 + k
    cfg = EngineConfig(block_size=BS, num_kv_blocks=num_kv_blocks, max_num_seqs=6,
                       max_model_len=40, max_prefill_tokens=24, eos_token_id=EOS)
    s, reqs = cls(cfg, VOCAB), make_requests(seed, 16)
    arrive = {0: reqs[:6], 3: reqs[6:11], 9: reqs[11:]}
    pending, trace, launches, moved = deque(), [], 0, 0
    for t in range(400):
        s.add(arrive.get(t, []))
        s.retire()
        admitted = s.admit()
        for r in admitted:
            r.num_computed = len(r.prompt) + len(r.output)
        s.start(admitted, [(r.req_id * 7 + len(r.output)) % VOCAB for r in admitted])
        before = {id(r): i for i, r in enumerate(s.rows) if r is not None}
        launch = s.schedule_decode(q, bool(pending))
        if launch is not None:
            step, rows = launch
            moved += sum(before.get(id(r), i) != i for i, r in enumerate(rows))
            trace.append(("launch", [r.req_id for r in rows],
                          {f: getattr(step, f).tolist() for f in vars(step)}))
            pending.append((launches, rows))
            launches += 1
        while len(pending) > (1 if overlap and launch is not None else 0):
            no, rows = pending.popleft()
            tokens, more = kept_tokens(seed, no, rows, q), bool(pending)
            if api == "lists" or type(s) is PerRowScheduler:
                s.accept(rows, tokens, more)
            else:
                kept = np.array([x for row in tokens for x in row], np.int32)
                counts = None if q == 1 else np.array([len(x) for x in tokens], np.int32)
                s.accept_kept(rows, kept, counts, more)
        if type(s) is Scheduler:
            check_row_state(s)
        trace.append(("state", [(r.req_id, list(r.output), r.finish_reason, r.num_computed,
                                 r.num_launches, list(r.blocks), r.num_preemptions)
                                for r in reqs],
                      sorted(r.req_id for r in s.leaving), [r.req_id for r in s.waiting],
                      [None if r is None else r.req_id for r in s.rows],
                      s.allocator.num_free, s.num_preemptions))
        if t > 9 and not s.has_work() and not pending:
            break
    assert all(r.finish_reason is not None for r in reqs), "the trace did not finish"
    assert s.allocator.num_free == num_kv_blocks - 1, "blocks leaked"
    return trace, (s.num_preemptions, sum(r.finish_reason == "eos" for r in reqs), moved)


@pytest.mark.parametrize("api", ["arrays", "lists"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("k", [0, 2])
def test_row_state_scheduler_equals_the_per_row_scheduler(k, overlap, api):
    seen = np.zeros(3, int)
    for seed in range(8):
        blocks = 14 + seed % 3 * 6  # few blocks: preemption
        want, _ = drive(PerRowScheduler, seed, k, overlap, api, blocks)
        got, counts = drive(Scheduler, seed, k, overlap, api, blocks)
        for a, b in zip(got, want):
            assert a == b, seed
        assert len(got) == len(want)
        seen += counts
    assert (seen > 0).all(), f"(preemptions, eos finishes, moved rows) = {seen}: a case untested"


def test_request_values_follow_the_row_and_come_back_when_it_leaves():
    """num_computed and num_launches read the row arrays while bound (moved rows included) and
    the request's own fields after it leaves, with the same values."""
    cfg = EngineConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=4, max_model_len=40)
    s = Scheduler(cfg, VOCAB)
    a, b, c = Request(0, [1, 2], 3), Request(1, [1], 9), Request(2, [4, 5, 6], 9)
    s.add([a, b, c])
    admitted = s.admit()
    for r in admitted:
        r.num_computed = len(r.prompt)
    s.start(admitted, [5, 6, 7])
    _, rows = s.schedule_decode(1, in_flight=False)
    assert [r.row_index for r in rows] == [0, 1, 2] and a.row_state is s.state
    s.accept_kept(rows, np.array([8, 9, 10], np.int32), None, more_in_flight=False)
    assert [r.num_computed for r in rows] == [3, 2, 4] and a.num_launches == 1
    s.retire()
    _, rows = s.schedule_decode(1, in_flight=False)  # a: its last token, a certain finish
    assert rows == [a, b, c] and s.leaving == {a} and a.num_launches == 2
    s.accept_kept(rows, np.array([1, 2, 11], np.int32), None, more_in_flight=False)
    assert a.row_state is None and a.finish_reason == "length" and a.output == [5, 8, 1]
    assert a.num_computed == 4 and a.num_launches == 2
    s.retire()
    _, rows = s.schedule_decode(1, in_flight=False)  # c moves into a's row
    assert rows == [c, b] and c.row_index == 0 and c.num_computed == 5 and c.num_launches == 3
    s.accept_kept(rows, np.array([4, 5], np.int32), None, more_in_flight=False)
    assert c.output == [7, 10, 11, 4] and b.output == [6, 9, 2, 5] and b.num_computed == 4
    s.preempt(c)
    assert c.row_state is None and c.num_computed == 0 and c.num_launches == 3
    assert s.rows == [None, b] and s.state.stamps[0] == -1 and list(s.waiting) == [c]
