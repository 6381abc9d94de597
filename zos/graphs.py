"""One CUDA graph per bucket: the capture both the prep-only backend and the runner use."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def capture_per_bucket(sizes: Iterable[int],
                       body: Callable[[int], None]) -> dict[int, torch.cuda.CUDAGraph]:
    """Capture ``body(size)`` once per size, largest first, all graphs sharing one memory pool.

    ``body`` runs once per size on a side stream first (Triton compiles, cuBLAS picks its
    kernels), so it must be safe to execute: the callers stage a record of N = 0, which only
    writes dummy rows. Returns ``{size: graph}``; replaying a graph reruns ``body(size)``
    on the buffers it captured (the real row count is read from device memory).
    """
    sizes = sorted(sizes, reverse=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in sizes:
            body(s)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool, graphs = torch.cuda.graph_pool_handle(), {}
    for s in sizes:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            body(s)
        graphs[s] = g
    torch.cuda.synchronize()
    return graphs
