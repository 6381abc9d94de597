"""Copy and GPU-time accounting from ``torch.profiler`` traces (CUDA only)."""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

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
