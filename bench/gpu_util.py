"""How busy the GPU was over a window of wall-clock time, sampled from outside the process
under test: NVML's utilization rate (``nvmlDeviceGetUtilizationRates().gpu``: the percent of
NVML's last sample period, 1/6 s to 1 s, in which at least one kernel ran), read through
nvidia-ml-py (``pynvml``) by a thread of the benchmark's process every ``interval_s`` and
stamped with ``time.time()``. Near 100% the GPU was the bottleneck (the host kept it fed); below
it the GPU waited for the host. It does not say how well the kernels used the GPU (a small
kernel counts as busy); with NVML's sample period, windows of a few seconds or more are the
ones to read.

Usage::

    util = GpuUtil(nvml_reader(f"GPU-{torch.cuda.get_device_properties(0).uuid}")).start()
    ...                            # the load
    util.stop()
    util.window(start, end)        # {"mean": %, "p50": %, "samples": n}, None without samples

``start`` and ``end`` are ``time.time()`` seconds. ``nvml_reader`` gives None where
nvidia-ml-py or the driver's NVML is missing; ``GpuUtil(None)`` then samples nothing.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable


def nvml_reader(uuid: str) -> Callable[[], float] | None:
    """A callable returning the GPU's utilization percent now (NVML), for the GPU of ``uuid``
    (``"GPU-..."``, as NVML and nvidia-smi name it: CUDA's and NVML's device indices may
    differ); None without nvidia-ml-py or NVML."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception:  # ImportError, or pynvml.NVMLError (no driver, no such GPU)
        return None
    return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


class GpuUtil:
    """Samples ``read()`` every ``interval_s`` on a daemon thread between :meth:`start` and
    :meth:`stop`: ``samples``, [(``clock()`` s, percent)]. ``read`` None: nothing sampled."""

    def __init__(self, read: Callable[[], float] | None, interval_s: float = 0.1,
                 clock: Callable[[], float] = time.time) -> None:
        self.read, self.interval_s, self.clock = read, interval_s, clock
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> GpuUtil:
        if self.read is not None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="gpu-util")
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append((self.clock(), self.read()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def window(self, start: float, end: float) -> dict | None:
        """The samples taken in [start, end]: their mean and median percent and count; None
        without one."""
        xs = [p for t, p in self.samples if start <= t <= end]
        if not xs:
            return None
        return dict(mean=round(statistics.fmean(xs), 1), p50=statistics.median(xs),
                    samples=len(xs))
