"""How busy the GPU was over a window of wall-clock time, sampled from outside the process
under test: ``nvidia-smi``'s ``utilization.gpu`` (NVML: the percent of each sample period in
which at least one kernel ran), one sample every ``interval_ms``, each with the time
``nvidia-smi`` stamped on it. A figure near 100% means the GPU was the bottleneck (the
host kept it fed); below, the GPU waited for the host. It does not say how well the kernels
used the GPU (a small kernel counts as busy), and the period of each sample is NVML's (1/6 s
to 1 s on recent GPUs), so windows of a few seconds or more are the ones to read.

Usage::

    util = GpuUtil().start()       # nothing sampled where nvidia-smi is missing (or exe=None)
    ...                            # the load
    util.stop()
    util.window(start, end)        # {"mean": %, "p50": %, "samples": n} or None

``start`` and ``end`` are ``time.time()`` seconds.
"""
from __future__ import annotations

import datetime as dt
import os
import shutil
import statistics
import subprocess
import threading


def parse_line(line: str) -> tuple[float, float] | None:
    """``"2026/12/07 05:10:11.123, 87"`` (nvidia-smi's local time, utilization %) to
    (``time.time()`` seconds, percent); None for a line that is not a sample (a header,
    ``[N/A]``)."""
    try:
        stamp, pct = (x.strip() for x in line.split(","))
        when = dt.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return when, float(pct)
    except ValueError:
        return None


class GpuUtil:
    """A background ``nvidia-smi -lms`` of one GPU (``index``; default: the first of
    ``CUDA_VISIBLE_DEVICES``, else 0) and its samples, [(``time.time()`` s, percent)]."""

    def __init__(self, interval_ms: int = 100, index: str | None = None,
                 exe: str | None = "nvidia-smi") -> None:
        self.samples: list[tuple[float, float]] = []
        self.exe = shutil.which(exe) if exe else None  # None: nothing sampled
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        self.index = index or visible or "0"
        self.interval_ms = interval_ms
        self._proc = self._reader = None

    def start(self) -> GpuUtil:
        if self.exe:
            self._proc = subprocess.Popen(
                [self.exe, "--query-gpu=timestamp,utilization.gpu", "--format=csv,noheader,nounits",
                 f"-lms={self.interval_ms}", "-i", self.index],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_line(line)
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._reader.join(timeout=10)

    def window(self, start: float, end: float) -> dict | None:
        """The samples stamped in [start, end]: their mean and median percent and count; None
        without one."""
        xs = [p for t, p in self.samples if start <= t <= end]
        if not xs:
            return None
        return dict(mean=round(statistics.fmean(xs), 1), p50=statistics.median(xs),
                    samples=len(xs))
