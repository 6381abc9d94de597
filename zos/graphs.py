"""CUDA graphs keyed by padded size: every bucket captured up front, or each on first use under a
graph-memory budget with least-recently-used eviction.

``GraphCache`` is the bookkeeping (which sizes hold a graph, what they cost, which to evict); it
calls a capture function and never touches CUDA itself, so it is tested on a CPU with a fake one.
``CudaGraphCapturer`` is the CUDA capture function: one ``CaptureSafeGraph`` per size, all in
one shared memory pool, with capture time and memory measured. ``warm_up`` runs a body once per
size before capture; ``capture_per_bucket`` is warm-up plus capture of every size (the prep-only
backend uses it).

Where this comes from: vLLM and SGLang capture every bucket at start-up, largest first, in one
graph memory pool (vllm/v1/worker/gpu_model_runner.py ``capture_model``, sglang
cuda_graph_runner.py); llama.cpp keeps a cache of graphs keyed by the graph's shape and captures
on first use (ggml-cuda.cu, ``ggml_cuda_graph``). The budget and LRU eviction are zos's.
"""
from __future__ import annotations

import gc
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from zos._C import call_with_relaxed_capture_mode
from zos._checks import check_int

# Why a bucketed step has no graph (GraphCache.reason).
NOT_CAPTURED = "not captured yet"
EVICTED = "evicted"
OVER_BUDGET = "over budget"
CAPTURE_FAILED = "capture failed"
LOG_LIMIT = 4096  # GraphCache.log keeps the last this many events


_held_lock = threading.RLock()  # reentrant: a finalizer run by the collection may open a block
_held_depth = 0  # collector_held blocks now open, in any thread
_held_was_enabled = False  # the collector's state when the outermost block opened


class collector_held:
    """Python's garbage collector off for a ``with`` block (restored after), for CUDA graph
    captures.

    An automatic collection can run at any allocation of Python objects, so inside a capture it
    may free cyclic garbage that holds a plain ``torch.cuda.CUDAGraph`` (a runner's, a
    transformers manager's); freeing such a graph while a capture is open invalidates that
    capture (torch refuses ``CUDAGraph::reset`` with "operation not permitted when stream is
    capturing"; zos's own graphs are ``CaptureSafeGraph``). Since torch 2.9
    ``torch.cuda.graph`` no longer collects before a capture (pytorch/pytorch#158193; the
    fault it opened: pytorch/pytorch#161037, NVIDIA/TransformerEngine#2092, whose fix likewise
    holds the collector off during captures).

    Blocks may nest and may be open in several threads at once (the collector is process-wide):
    the collector stays off until the last open block closes, then returns to the state it had
    when the first one opened. What the block's own code does to the collector is its own: a
    ``gc.enable()`` inside turns the hold off, a ``gc.disable()`` inside is undone at the end.
    An explicit ``gc.collect()`` (transformers' manager calls one when it stops) is not held off.

    Args:
        collect: run one full collection (``gc.collect()``) before turning the collector off, so
            garbage left from before is freed outside any capture; only when no block is open
            (in another thread one may be around a capture, which that collection would break).
            It costs a walk over every tracked object: for warm-ups, not for a capture in the
            middle of serving.
    """

    def __init__(self, collect: bool = False) -> None:
        self.collect = collect

    def __enter__(self) -> None:
        global _held_depth, _held_was_enabled
        with _held_lock:
            if _held_depth == 0:
                if self.collect:
                    gc.collect()
                _held_was_enabled = gc.isenabled()
                gc.disable()
            _held_depth += 1

    def __exit__(self, *exc) -> None:
        global _held_depth
        with _held_lock:
            _held_depth -= 1
            if _held_depth == 0 and _held_was_enabled:
                gc.enable()


class CaptureSafeGraph(torch.cuda.CUDAGraph):
    """A ``torch.cuda.CUDAGraph`` whose release never breaks a capture in progress.

    Python's garbage collector may free a graph in reference-cycle garbage at any allocation of
    Python objects, also inside a capture that a runner opens with ``torch.cuda.graph`` (which,
    since torch 2.9, no longer collects first: pytorch/pytorch#158193). torch's destructor
    (``CUDAGraph::reset``: ``cudaGraphExecDestroy``) is then refused ("operation not permitted
    when stream is capturing"), and the refusal invalidates that capture
    (pytorch/pytorch#161037). ``collector_held`` keeps zos's own captures free of collections;
    this keeps zos's graphs from breaking anyone's: when freed, the graph resets itself with the
    thread's capture mode relaxed (``zos._C.call_with_relaxed_capture_mode``), which the driver
    allows inside a capture without invalidating it. Every graph zos captures is one
    (``CudaGraphCapturer``). Not covered: what ``reset`` does beside the destruction (torch 2.11
    also drops the cuBLAS workspace of the stream the graph was captured on, see
    ``CudaGraphCapturer``), and graphs other libraries make (transformers' own).
    """

    def __del__(self) -> None:
        try:
            call_with_relaxed_capture_mode(self.reset)
        except Exception:  # at interpreter exit torch or the CUDA context may be gone
            pass
        finally:
            base_del = getattr(super(), "__del__", None)  # newer torch stops a tracker there
            if base_del is not None:
                base_del()


@dataclass(frozen=True)
class CapturedGraph:
    """One capture: ``graph`` (a ``torch.cuda.CUDAGraph``; anything with ``replay()`` for the
    bookkeeping), ``nbytes`` (device bytes this graph alone holds and frees when it is dropped:
    the instantiated graph, outside the allocator), ``pool_bytes`` (bytes the shared memory pool
    grew by during this capture; the pool keeps them while any graph of it lives) and
    ``seconds`` (host wall time of the capture)."""

    graph: Any
    nbytes: int
    pool_bytes: int
    seconds: float


class GraphCache:
    """Graphs keyed by padded size (token rows), least recently used first.

    Memory model: ``used_bytes = pool_bytes + sum(nbytes of cached graphs)``. The pool is shared
    by every graph (each capture reuses what earlier captures freed, so it grows to about the
    largest capture's temporaries) and is released only when the cache holds no graph: then
    ``release_pool()`` is called and ``pool_bytes`` restarts at 0. Evicting a graph frees its
    ``nbytes`` only.

    Budget (``budget_bytes``; None: unbounded), enforced by ``capture(size)``:
      1. before capturing a size captured earlier (its cost ``nbytes`` is known): if the cost
         alone exceeds the budget, it is not captured and marked over budget; otherwise least
         recently used graphs are evicted until ``used_bytes + cost <= budget`` (evicting them
         all releases the pool, so it then fits);
      2. after a capture, least recently used *other* graphs are evicted until ``used_bytes <=
         budget``; if the new graph alone (with the pool) is still over, it is dropped too and
         marked over budget: that size runs eagerly from then on (the first capture of a size can
         overshoot the budget by its own cost, transiently).

    A capture that raises RuntimeError (what CUDA and cuBLAS errors inside a capture raise,
    ``torch.OutOfMemoryError`` included) is recorded (``failures[size]``, the exception; the
    log) with a ``RuntimeWarning``, and its size runs eagerly from then on, never captured
    again, even if the cause was a transient lack of memory: the step that ran eagerly before it
    stays valid, so a serving loop goes on (llama.cpp likewise falls back to running without
    its graph when capture fails).

    Args:
        capture: ``capture(size) -> CapturedGraph``; kept as the attribute ``capture_fn``.
        budget_bytes: an int >= 0, or None.
        release_pool: called when the last graph leaves the cache (None: nothing to call).

    Raises:
        TypeError/ValueError: budget_bytes not None or an int >= 0.
    """

    def __init__(self, capture: Callable[[int], CapturedGraph], *,
                 budget_bytes: int | None = None,
                 release_pool: Callable[[], None] | None = None) -> None:
        if budget_bytes is not None:
            budget_bytes = check_int("budget_bytes", budget_bytes, 0)
        self.capture_fn, self._release = capture, release_pool
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, CapturedGraph] = OrderedDict()  # LRU first
        self._cost: dict[int, int] = {}  # nbytes of each size's last capture
        self._over: set[int] = set()
        self.failures: dict[int, RuntimeError] = {}  # size -> the error its capture raised
        self.pool_bytes = 0
        self.hits = self.misses = self.captures = self.evictions = 0
        self.capture_seconds = 0.0
        # one dict per capture / eviction / refusal, in order (the last LOG_LIMIT)
        self.log: deque[dict] = deque(maxlen=LOG_LIMIT)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, size) -> bool:
        return size in self._entries

    @property
    def sizes(self) -> list[int]:
        """Cached sizes, least recently used first."""
        return list(self._entries)

    @property
    def graphs(self) -> dict[int, Any]:
        """``{size: graph}`` of the cached graphs (a copy)."""
        return {s: e.graph for s, e in self._entries.items()}

    @property
    def used_bytes(self) -> int:
        """``pool_bytes`` plus the ``nbytes`` of every cached graph."""
        return self.pool_bytes + sum(e.nbytes for e in self._entries.values())

    def get(self, size: int):
        """The graph of ``size`` (now the most recently used), or None (counted as a miss)."""
        entry = self._entries.get(size)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(size)
        return entry.graph

    def reason(self, size: int) -> str | None:
        """Why ``size`` has no graph: ``CAPTURE_FAILED``, ``OVER_BUDGET`` (it cannot fit),
        ``EVICTED`` (captured before, evicted since), ``NOT_CAPTURED``; None if it has one."""
        if size in self._entries:
            return None
        if size in self.failures:
            return CAPTURE_FAILED
        if size in self._over:
            return OVER_BUDGET
        return EVICTED if size in self._cost else NOT_CAPTURED

    def capture(self, size: int) -> bool:
        """Make sure ``size`` holds a graph within the budget (see the class docstring);
        returns whether it does. A size marked over budget or whose capture failed is not
        captured again. TypeError / ValueError (before anything is captured or evicted) unless
        size is an int >= 1 (token rows)."""
        size = check_int("size", size)
        if size in self._entries:
            return True
        if size in self._over or size in self.failures:
            return False
        budget = self.budget_bytes
        if budget is not None and size in self._cost:
            if self._cost[size] > budget:  # cannot fit even in an empty cache
                return self._refuse(size)
            self._evict_until(budget - self._cost[size])
        try:
            cap = self.capture_fn(size)
        except RuntimeError as e:
            self.failures[size] = e
            self.log.append(dict(event=CAPTURE_FAILED, size=size,
                                 error=f"{type(e).__name__}: {e}"))
            warnings.warn(f"capture of the {size}-row graph failed ({type(e).__name__}: {e}); "
                          f"that size runs eagerly from now on", RuntimeWarning, stacklevel=2)
            return False
        self.captures += 1
        self.capture_seconds += cap.seconds
        self.pool_bytes += cap.pool_bytes
        self._cost[size] = cap.nbytes
        self._entries[size] = cap
        self.log.append(dict(event="capture", size=size, seconds=cap.seconds,
                             nbytes=cap.nbytes, pool_bytes=cap.pool_bytes))
        if budget is not None:
            self._evict_until(budget, keep=size)
            if self.used_bytes > budget:
                self._evict(size)
                return self._refuse(size)
        return True

    def clear(self) -> None:
        """Drop every graph (the pool is released)."""
        for s in list(self._entries):
            self._evict(s)

    def _evict_until(self, limit: int, keep: int | None = None) -> None:
        """Evict least recently used graphs (never ``keep``) while ``used_bytes > limit``."""
        while self.used_bytes > limit:
            victim = next((s for s in self._entries if s != keep), None)
            if victim is None:
                return
            self._evict(victim)

    def _evict(self, size: int) -> None:
        entry = self._entries.pop(size)
        self.evictions += 1
        self.log.append(dict(event="evict", size=size, nbytes=entry.nbytes))
        del entry
        if not self._entries:
            self.pool_bytes = 0
            if self._release is not None:
                self._release()

    def _refuse(self, size: int) -> bool:
        self._over.add(size)
        self.log.append(dict(event="over budget", size=size, nbytes=self._cost[size]))
        return False


def warm_up(sizes: Iterable[int], body: Callable[[int], None]) -> None:
    """Run ``body(size)`` once per size (largest first) on a side stream, then synchronize:
    Triton compiles and autotunes, cuBLAS picks its kernels and CUDA loads its modules, none of
    which may happen during a capture. ``body`` executes: the caller makes that safe (the runner
    stages a record of N = 0, which writes dummy rows only). CUDA only."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in sorted(sizes, reverse=True):
            body(s)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


class CudaGraphCapturer:
    """``capturer(size) -> CapturedGraph``: ``body(size)`` recorded into a ``CaptureSafeGraph``
    in one memory pool shared by all its captures (``torch.cuda.graph_pool_handle()``).

    Capture records, it does not execute: ``torch.cuda.graph`` synchronizes the device, switches
    to the capture stream and calls ``CUDAGraph.capture_begin``, i.e. ``cudaStreamBeginCapture``:
    "when a stream is in capture mode, all operations pushed into the stream will not be
    executed, but will instead be captured into a graph" (CUDA Runtime API reference);
    allocations come from the pool, in stream order. So a capture after a step of the same size
    leaves that step's KV, sampled tokens and metadata as they are: that eager step was the
    warm-up. What does run is the host side of ``body`` (Python, kernel argument packing), so it
    must have no host side effects, must not synchronize or read device values on the host
    (illegal during capture), and every kernel it launches must already be compiled and loaded
    for this size (``warm_up``, or an eager run of the same size; a Triton autotuner would
    otherwise benchmark, i.e. execute, during capture).

    cuBLAS workspaces. PyTorch keeps one cuBLAS (and cuBLASLt) workspace per (handle, stream) and
    a captured GEMM bakes that workspace's address into the graph; destroying *any* graph
    captured on a stream drops the workspace of that stream (torch 2.11, ``CUDAGraph::reset``
    calls ``clearCublasWorkspacesForStream``; pytorch/pytorch#193402), even if live graphs still
    use it: it may be reused for tensors or, once its pool is released, freed, and a later
    capture or replay fails (``CUBLAS_STATUS_INTERNAL_ERROR``) or reads freed memory. So, as
    torch's own cudagraph trees do (``clear_cublas_manager`` in
    ``torch/_inductor/cudagraph_trees.py``), every capture starts and ends with the workspace
    cache cleared: each graph's workspace is allocated inside the capture, from this pool, and
    belongs to the graphs of this pool alone (the pool keeps it while one of them lives;
    replays are sequential, so graphs of one pool may share it); what a destroyed graph drops
    is then never a workspace of a live graph. Python's garbage collector is held off during a
    capture (:class:`collector_held`), so no graph is destroyed in the middle of one (an
    automatic collection can run at any allocation of Python objects in ``body``). Captures run
    on a side stream from torch's stream pool rather than torch's one default capture stream;
    the pool hands streams out round-robin, so capturers may share one: the clearing, not the
    stream, is what protects.

    Measured per capture, after ``torch.cuda.empty_cache()`` and a device synchronize:
    ``pool_bytes``, the growth of ``torch.cuda.memory_reserved()`` (only the pool allocates during
    a capture), and ``nbytes``, the rest of the drop of free device memory
    (``torch.cuda.mem_get_info``: the instantiated graph, in the driver; 0 when it rounds below
    the driver's granularity). ``release_pool()`` forgets the pool (the next capture starts a
    new one); ``GraphCache`` calls it once no graph of the pool is left. CUDA only.

    Raises (from a call): RuntimeError (``torch.OutOfMemoryError`` included) for a CUDA,
    cuBLAS or allocation error during the capture, or an illegal operation in ``body``.
    """

    def __init__(self, body: Callable[[int], None]) -> None:
        self.body = body
        self.pool = None
        self.stream = torch.cuda.Stream()

    def __call__(self, size: int) -> CapturedGraph:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free0, res0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        graph = CaptureSafeGraph()
        with collector_held():
            try:
                torch._C._cuda_clearCublasWorkspaces()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    self.body(size)
            finally:
                torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        pool = torch.cuda.memory_reserved() - res0
        driver = free0 - torch.cuda.mem_get_info()[0] - pool
        return CapturedGraph(graph, max(driver, 0), pool, seconds)

    def release_pool(self) -> None:
        self.pool = None


def capture_per_bucket(sizes: Iterable[int],
                       body: Callable[[int], None]) -> dict[int, Any]:
    """Capture ``body(size)`` once per size, largest first, all graphs sharing one memory pool.

    ``body`` runs once per size on a side stream first (``warm_up``), so it must be safe to
    execute: the callers stage a record of N = 0, which only writes dummy rows. Returns
    ``{size: torch.cuda.CUDAGraph}``; replaying a graph reruns ``body(size)`` on the buffers it
    captured (the real row count is read from device memory). CUDA only.
    """
    sizes = sorted(sizes, reverse=True)
    warm_up(sizes, body)
    capturer = CudaGraphCapturer(body)
    return {s: capturer(s).graph for s in sizes}
