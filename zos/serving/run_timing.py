"""Wall time of an engine run split into prefill and decode, per step, and its spread.

``zos demo`` compares two metadata backends by what a user of a serving engine feels: the time
between two tokens of a running request (TPOT) and the time spent on prefill, measured apart,
over repeated runs in alternating order. One engine step (``Engine.step``) is an optional
prefill followed by one decode of every running row; :func:`timed_steps` times every step's
wall clock (its read-back of sampled tokens included), and :func:`split_step` assigns it:

* the prefill part is the prefill record's own ``seconds`` (its forward and the copy of its
  sampled tokens to the host, which on a GPU waits for the work queued before it);
* the decode part is the rest of the step: decode launch, the wait for its tokens (synchronous
  engine) or for the previous step's (overlapped engine), bookkeeping. Per decode step that is
  the TPOT of every request in the step. A step without a decode counts whole as prefill.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepTime:
    """One engine step: its number, ``prefill_s`` and ``decode_s`` (host wall seconds, see the
    module docstring), and whether it ran a decode (``decoded``)."""

    step: int
    prefill_s: float
    decode_s: float
    decoded: bool


def split_step(step: int, wall_s: float, records: Sequence) -> StepTime:
    """Split one engine step of ``wall_s`` seconds by its ``records`` (``StepRecord`` s with
    ``kind`` "prefill"/"decode" and ``seconds``): prefill = the prefill records' seconds (capped
    at the wall), decode = the rest when a decode ran, else 0 (the rest counts as prefill).
    ValueError for a negative ``wall_s``."""
    if wall_s < 0:
        raise ValueError(f"wall_s: must be >= 0, got {wall_s}")
    decoded = any(r.kind == "decode" for r in records)
    prefill = min(wall_s, sum(r.seconds for r in records if r.kind == "prefill"))
    if not decoded:
        return StepTime(step, wall_s, 0.0, False)
    return StepTime(step, prefill, wall_s - prefill, True)


def timed_steps(engine) -> list[StepTime]:
    """Time every ``engine.step`` call from now on: wraps the instance's ``step`` (the engine's
    public per-step call, which ``Engine.run`` makes) and returns the list it appends a
    :class:`StepTime` to, one per step that produced records."""
    inner, times = engine.step, []

    def step(*args, **kwargs):
        t0 = time.perf_counter()
        records = inner(*args, **kwargs)
        wall = time.perf_counter() - t0
        if records:
            times.append(split_step(records[0].step, wall, records))
        return records

    engine.step = step
    return times


def run_phases(times: Sequence[StepTime]) -> dict:
    """One run's totals: ``prefill_s`` and ``decode_s`` (sums), ``decode_steps``, and
    ``tpot_s`` (decode part of each decode step, in order)."""
    tpot = [t.decode_s for t in times if t.decoded]
    return dict(prefill_s=sum(t.prefill_s for t in times), decode_s=sum(tpot),
                decode_steps=len(tpot), tpot_s=tpot)


def spread(xs: Sequence[float]) -> dict | None:
    """``{"median", "min", "max", "q1", "q3", "n"}`` of ``xs`` (quartiles by the inclusive
    method; all equal for one value), or None for no values."""
    if not xs:
        return None
    xs = sorted(float(x) for x in xs)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
    return dict(median=statistics.median(xs), min=xs[0], max=xs[-1], q1=q1, q3=q3, n=len(xs))


def overlap(a: dict | None, b: dict | None) -> bool | None:
    """Whether the [min, max] ranges of two :func:`spread` results overlap (None if either is
    missing): overlapping runs cannot tell the two apart."""
    if a is None or b is None:
        return None
    return a["min"] <= b["max"] and b["min"] <= a["max"]


def alternating(backends: Sequence[str], repeats: int) -> list[str]:
    """The run order: ``repeats`` rounds, the backends in order in even rounds and reversed
    in odd ones (host, zos, zos, host, host, zos ...), so neither always runs first."""
    order = []
    for i in range(repeats):
        order += list(backends) if i % 2 == 0 else list(reversed(backends))
    return order
