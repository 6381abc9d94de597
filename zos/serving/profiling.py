"""Copy and GPU-time accounting from ``torch.profiler`` traces, and a GPU spin kernel that
stands in for a model step or stalls a stream (CUDA only)."""
from __future__ import annotations

import zos._interpret  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LONG_GAP_US = 20.0  # a gap between GPU activities longer than this is counted as host-caused


@dataclass(frozen=True)
class DeviceActivity:
    """Totals of the device activities recorded while a function ran.

    Attributes:
        h2d_bytes: bytes of host-to-device memcpys.
        h2d_copies: number of host-to-device memcpys.
        d2h_bytes: bytes of device-to-host memcpys.
        gpu_us: summed durations (microseconds) of kernels, memcpys and memsets.
        busy_us: microseconds during which at least one of them ran (their union: work
            that overlaps on several streams counts once).
        span_us: microseconds from the first one's start to the last one's end.
        long_gap_us: the idle time inside the span made of gaps longer than
            ``LONG_GAP_US`` (the GPU waiting for the host; the short gaps between the kernels
            of one CUDA graph replay are left out).
    """

    h2d_bytes: int
    h2d_copies: int
    d2h_bytes: int
    gpu_us: float
    busy_us: float = 0.0
    span_us: float = 0.0
    long_gap_us: float = 0.0


def profile_device(fn: Callable[[], None]) -> DeviceActivity:
    """Run ``fn`` under ``torch.profiler`` (CPU + CUDA) and total its device activity.

    Reads the Kineto trace: events of category ``gpu_memcpy`` carry their size in
    ``args["bytes"]`` and their direction in the name ("Memcpy HtoD ...").
    Kernels launched from a CUDA graph replay are included.

    Raises:
        RuntimeError: CUDA is not available (on the CPU there is no H2D copy to count).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("profile_device needs CUDA: on the CPU there are no H2D copies")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.remove(path)
    h2d = h2d_n = d2h = 0
    gpu_us = 0.0
    spans = []
    for ev in events:
        cat = ev.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        gpu_us += float(ev.get("dur", 0.0))
        spans.append((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))))
        if cat == "gpu_memcpy":
            nbytes = int(ev.get("args", {}).get("bytes", 0))
            if "HtoD" in ev.get("name", ""):
                h2d, h2d_n = h2d + nbytes, h2d_n + 1
            elif "DtoH" in ev.get("name", ""):
                d2h += nbytes
    return DeviceActivity(h2d, h2d_n, d2h, gpu_us, *timeline(spans))


def timeline(spans: list[tuple[float, float]]) -> tuple[float, float, float]:
    """``(busy, span, long_gap)`` of activity intervals ``(start, end)`` (any order, any unit):
    the length of their union, first start to last end, and the gaps in between longer than
    ``LONG_GAP_US``. All zero for no intervals."""
    busy = end = long_gap = 0.0
    for i, (a, b) in enumerate(sorted(spans)):
        if i == 0 or a > end:
            if i and a - end > LONG_GAP_US:
                long_gap += a - end
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    span = max(b for _, b in spans) - min(a for a, _ in spans) if spans else 0.0
    return busy, span, long_gap


@triton.jit
def _globaltimer_ns():
    """The GPU's global timer (PTX ``%globaltimer``), int64 nanoseconds; re-read on every call."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _spin(elapsed_ptr, duration_ns):
    """Busy-wait until ``duration_ns`` ns of %globaltimer have passed (launch one program);
    writes the ns actually spent to ``elapsed_ptr`` (int64 [1]), which keeps the loop live."""
    start = _globaltimer_ns()
    now = start
    while now - start < duration_ns:
        now = _globaltimer_ns()
    tl.store(elapsed_ptr, now - start)


def gpu_busy(us: float, elapsed: torch.Tensor) -> None:
    """Enqueue ~``us`` microseconds of GPU work on the current stream (no host wait).

    One program of one warp spins on %globaltimer (public Triton API, in place of the
    private ``torch.cuda._sleep``, whose cycle count depended on the SM clock). Writes the
    spent nanoseconds into ``elapsed`` (CUDA int64 [1]). Needs a GPU: the Triton CPU
    interpreter cannot run inline PTX.
    """
    _spin[(1,)](elapsed, int(us * 1000), num_warps=1)
