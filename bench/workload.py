"""A steady decode workload for the prep benchmark.

N rows run at all times. Each step every carried row advances one token (and
takes a new block when it crosses a block boundary); ``replace`` of the rows
finish and are replaced in place by arrivals whose prompt lengths are drawn
from the Azure LLM inference trace 2023 (conversation). Carried rows start with
contexts spread over [0, max_context): their length sets the host baseline's
block-table width but must not change zos's upload.
"""
from __future__ import annotations

import numpy as np

from zos import DecodeStep
from zos.serving.trace import load_trace


def trace_prompt_lengths() -> np.ndarray:
    """ContextTokens of every request of the conversation trace (int64), read through
    :func:`zos.serving.trace.load_trace` as the demo reads it."""
    return np.array([prompt for _, prompt, _ in load_trace("conv")], np.int64)


class SteadyWorkload:
    """N rows at all times; ``first_step`` then ``next_step`` give DecodeSteps (see module doc).
    Each request owns an arena of W block ids, so ``num_kv_blocks`` is 1 + (2N + 1) * W."""

    def __init__(self, n, *, block_size=16, max_context=32768, replace=0.05, seed=0):
        self.rng = np.random.default_rng(seed)
        self.n, self.bs, self.max_ctx, self.replace = n, block_size, max_context, replace
        self.w = max_context // block_size
        self.prompts = trace_prompt_lengths()
        self.num_arenas = 2 * n + 1  # each request owns an arena of w block ids
        self.num_kv_blocks = 1 + self.num_arenas * self.w
        self.next_id = 0
        self.pos = np.zeros(n, np.int64)
        self.nblocks = np.zeros(n, np.int64)
        self.base = np.zeros(n, np.int64)
        self.ids = np.zeros(n, np.int64)

    def _arrive(self, row, pos):
        self.next_id += 1
        self.ids[row] = self.next_id
        self.base[row] = 1 + (self.next_id % self.num_arenas) * self.w
        self.pos[row] = pos
        self.nblocks[row] = pos // self.bs + 1
        return (int(self.rng.integers(0, 32000)), int(pos),
                range(int(self.base[row]), int(self.base[row] + self.nblocks[row])))

    def first_step(self) -> DecodeStep:
        """Every row new, with contexts spread over [0, max_context - 2048)."""
        pos = self.rng.integers(0, self.max_ctx - 2048, self.n)
        new = {r: self._arrive(r, int(pos[r])) for r in range(self.n)}
        return DecodeStep.build(self.ids.copy(), new)

    def next_step(self) -> DecodeStep:
        """Advance every row one token; replace ``replace`` of them with arrivals."""
        self.pos += 1
        done = self.pos >= self.max_ctx - 1
        k = int(round(self.replace * self.n))
        if k:
            done[self.rng.choice(self.n, k, replace=False)] = True
        new = {}
        for r in np.flatnonzero(done):
            prompt = int(min(self.rng.choice(self.prompts), self.max_ctx - 2048))
            new[int(r)] = self._arrive(int(r), prompt)
        grow = np.flatnonzero(~done & (self.pos // self.bs >= self.nblocks))
        appends = [(int(r), int(self.base[r] + self.nblocks[r])) for r in grow]
        self.nblocks[grow] += 1
        return DecodeStep.build(self.ids.copy(), new, appends)


def workload_steps(n, max_context, count):
    """The first step and ``count`` more of a :class:`SteadyWorkload` of size ``n`` (seeded
    with ``n``: every backend gets the same steps), each built when it is asked for, as a
    scheduler builds a step right before it is staged: its arrays are then as warm in the
    host's caches as in a serving loop (prebuilt steps would all be cold)."""
    wl = SteadyWorkload(n, max_context=max_context, seed=n)
    yield wl.first_step()
    for _ in range(count):
        yield wl.next_step()
