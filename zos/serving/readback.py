"""Sampled tokens back to the host without a blocking copy: the engine's side of overlap.

After each decode launch the engine enqueues a non-blocking D2H copy of ``sampled[:N]`` into
one of a ring of pinned buffers and records an event; it reads the tokens later (one step late
under overlap, at once otherwise) by waiting on that event only. This is how SGLang's overlap
scheduler and vLLM's async scheduling get their outputs: the host never waits on the stream
as a whole, only on the one copy it needs.

``SampledReadback.pending`` is the engine's one queue of decode launches in flight, oldest
first: a launch is pushed right after it is enqueued and popped when its tokens are read.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Pending:
    """One decode step's tokens on their way to the host.

    Attributes:
        rows: what the engine needs to route the tokens: one entry per real row (the engine
            passes the launch, ``zos.serving.row_state.Launch``: the request of each row).
        slot: index of the pinned buffer holding the copy.
        event: CUDA event recorded after the copy (None off CUDA: the copy is synchronous).
    """

    rows: list
    slot: int
    event: torch.cuda.Event | None


class SampledReadback:
    """A ring of ``depth`` pinned int32 buffers of ``max_num_reqs`` x ``width`` entries.

    Args:
        max_num_reqs: rows per copy at most.
        device: where ``sampled`` lives; pinned memory and events only on CUDA.
        depth: copies that may be pending at once (>= 1; the engine needs 2 under overlap:
            one in flight while one is read).
        width: int32 values per row (1: a sampled token; speculative decoding copies
            ``SpecDecoder.output``, q + 1: the accepted count and the tokens).

    Raises:
        ValueError: depth < 1, or ``push`` with more pending copies than ``depth``.
    """

    def __init__(self, max_num_reqs: int, device: torch.device, depth: int = 3,
                 width: int = 1) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.cuda, self.width = device.type == "cuda", width
        self._bufs = [torch.zeros((max_num_reqs, width), dtype=torch.int32, pin_memory=self.cuda)
                      for _ in range(depth)]
        self._views = [b.numpy() for b in self._bufs]  # the same memory, read without torch
        self._events = [torch.cuda.Event() if self.cuda else None for _ in range(depth)]
        self._next = 0
        self.pending: deque[Pending] = deque()
        self.wait_seconds = 0.0  # host time spent waiting in pop (benchmarks subtract it)

    def push(self, sampled: torch.Tensor, rows: list) -> None:
        """Enqueue the copy of ``sampled[:len(rows)]`` (int32 [>= len(rows)], or [.., width],
        on the device) on the current stream, after the work that writes it; ``rows`` travels
        with it to :meth:`pop`."""
        if len(self.pending) == len(self._bufs):
            raise ValueError(f"{len(self.pending)} copies pending already (depth "
                             f"{len(self._bufs)}): pop one first")
        k, n = self._next, len(rows)
        self._next = (k + 1) % len(self._bufs)
        self._bufs[k][:n].copy_(sampled[:n].view(n, self.width), non_blocking=self.cuda)
        if self.cuda:
            self._events[k].record()
        self.pending.append(Pending(rows, k, self._events[k]))

    def pop(self) -> tuple[list, np.ndarray]:
        """Wait for the oldest pending copy only; returns its ``rows`` and a copy of its values:
        int32 [len(rows)] (width 1: one token per row), else int32 [len(rows), width]."""
        p = self.pending.popleft()
        if p.event is not None:
            t0 = time.perf_counter()
            p.event.synchronize()
            self.wait_seconds += time.perf_counter() - t0
        got = self._views[p.slot][:len(p.rows)]
        return p.rows, (got[:, 0] if self.width == 1 else got).copy()
