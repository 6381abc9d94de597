"""GraphRunner: one decode step = stage metadata, then a CUDA-graph replay (or an eager run).

A captured graph holds, per bucket B (token rows): ``backend.build`` (the device backend's
prep kernels; nothing for the host backend), the model forward on the buffers' prefix views
of B token rows, ``compute_logits``, greedy argmax, and the write of the sampled tokens into
``buffers.sampled`` for rows r < N, with N read from ``buffers.counts[0]`` on the device: dummy
rows are never sampled, and no host value of N is frozen into the graph. A step with no graph
(no bucket holds it, CPU, or graphs off) runs the same body eagerly.

Graphs are captured up front (``graph_capture="eager"``: every bucket before the first step) or
lazily (``"lazy"``): a bucketed step whose size has no graph yet runs eagerly, and that eager run
is the size's warm-up; its graph is captured right after, for the next step of that size
(``zos.graphs.GraphCache``: a memory budget and least-recently-used eviction).

With speculative decoding (a :class:`zos.spec.SpecDecoder`, q = 1 + K token rows per request)
the graph holds prep, the n-gram drafter (draft tokens into token rows 1..K), the forward of all
q rows, the argmax and the greedy verification, which writes ``buffers.accepted``,
``buffers.sampled`` (the bonus token, the next step's row-0 input) and ``spec.output``.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zos._checks import check_int
from zos.backend import MetadataBackend
from zos.buffers import StepMetadata
from zos.graphs import EVICTED, NOT_CAPTURED, CudaGraphCapturer, GraphCache, warm_up
from zos.spec import SpecDecoder
from zos.step import DecodeStep


def check_graph_options(graph_capture: str, graph_memory_budget: int | None) -> None:
    """ValueError unless graph_capture is "eager" or "lazy" and graph_memory_budget is None or
    (lazy only) an int >= 0 (bytes); TypeError for a budget that is not an int."""
    if graph_capture not in ("eager", "lazy"):
        raise ValueError(f"graph_capture: expected 'eager' or 'lazy', got {graph_capture!r}")
    if graph_memory_budget is None:
        return
    check_int("graph_memory_budget", graph_memory_budget, 0)
    if graph_capture != "lazy":
        raise ValueError(f"graph_memory_budget: only with graph_capture='lazy', got "
                         f"{graph_memory_budget} with {graph_capture!r}")


@dataclass(frozen=True)
class DecodeResult:
    """What one ``GraphRunner.decode`` did.

    Attributes:
        path: "graph" (a captured graph replayed) or "eager".
        num_reqs: real request rows N.
        padded_size: token rows the step ran with (the bucket, N * q unbucketed, or the
            bucket of ``min_padded_size`` when that is larger).
        bucket: the bucket (token rows), or None when no bucket holds N * q.
        prep_us: host microseconds of metadata work: ``stage``, plus ``build`` when eager.
        upload_bytes: bytes the backend uploaded host-to-device for this step.
        eager_reason: why an eager step had no graph, None on the graph path: "no bucket"
            (N * q above the largest bucket), "graphs off" (no graph cache: graphs disabled,
            no CUDA, or ``capture()`` not called), or the cache's ``zos.graphs`` reason:
            "not captured yet", "evicted", "over budget", "capture failed" (the exception is
            in ``cache.failures``).
        capture_s: host seconds spent capturing this size's graph right after the step (lazy
            capture), else 0.
    """

    path: str
    num_reqs: int
    padded_size: int
    bucket: int | None
    prep_us: float
    upload_bytes: int
    eager_reason: str | None = None
    capture_s: float = 0.0


class GraphRunner:
    """Runs decode steps of ``model`` on ``backend``'s static buffers, through CUDA graphs.

    Args:
        model: a ``zos.serving.models.LlamaForCausalLM`` (``forward(input_ids, positions, kv_caches,
            meta, is_prefill)`` and ``compute_logits``).
        kv_caches: the model's paged KV caches, one per layer.
        backend: the metadata backend; owns ``buffers`` (DecodeBuffers) and ``buckets``
            (BucketTable or None). A DeviceMetadataBackend must be built with
            ``capture_prep=False``: its ``build`` is captured inside this runner's graphs.
        use_cuda_graph: capture graphs in ``capture()`` (only on CUDA, with buckets).
        graph_capture: "eager" (every bucket in ``capture()``) or "lazy" (each bucket after its
            first step, see the module docstring).
        graph_memory_budget: lazy only: bytes the graph cache may hold (its shared pool plus
            each graph's own memory, ``zos.graphs.GraphCache``), or None for no bound.
        spec: a SpecDecoder over the same buffers for speculative decoding (q = 1 + K), or None
            (plain decode, q = 1).

    Raises:
        ValueError: q != 1 without ``spec`` (or ``spec`` over other buffers), a device backend
            that captured its own prep graphs, an unknown graph_capture, or a
            graph_memory_budget with eager capture or below 0.
        TypeError: a graph_memory_budget that is not an int.
    """

    def __init__(self, model, kv_caches: Sequence[torch.Tensor], backend: MetadataBackend, *,
                 use_cuda_graph: bool, graph_capture: str = "eager",
                 graph_memory_budget: int | None = None, spec: SpecDecoder | None = None) -> None:
        check_graph_options(graph_capture, graph_memory_budget)
        self.model, self.kv_caches, self.backend = model, list(kv_caches), backend
        self.buffers = b = backend.buffers
        if spec is None and b.uniform_decode_query_len != 1:
            raise ValueError(f"uniform_decode_query_len {b.uniform_decode_query_len} > 1 needs "
                             f"a SpecDecoder (spec=) to verify the draft rows")
        if spec is not None and spec.buffers is not b:
            raise ValueError("spec must be built over the backend's buffers")
        self.spec = spec
        if getattr(backend, "captures_prep", False):
            raise ValueError("the device backend must be built with capture_prep=False: its "
                             "build is captured inside this runner's graphs")
        self.use_cuda_graph = use_cuda_graph
        self.graph_capture, self.graph_memory_budget = graph_capture, graph_memory_budget
        self.cache: GraphCache | None = None  # made by capture()
        self._up_front_seconds = 0.0
        self.graph_memory = {"allocated_bytes": 0, "reserved_bytes": 0}
        self._rows = torch.arange(b.max_num_reqs, dtype=torch.int32, device=b.device)
        self._nvtx = torch.cuda.is_available()
        # Plain decode leaves ``accepted`` as the backend set it when it took the buffers
        # over (1 per row); with ``spec`` the verifier writes it.

    # ---- capture ---------------------------------------------------------------------------

    def capture(self) -> int:
        """Make the graph cache and, with eager capture, capture one graph per bucket (largest
        first, one shared memory pool).

        No-op (returns 0, no cache: every step eager) unless ``use_cuda_graph``, the buffers are
        on CUDA and the backend has buckets. Must run before the first decode step. Eager
        capture warms up and captures every bucket, which executes the body and re-applies the
        staged record: before the first step that record is N = 0 (every row a dummy row: no
        KV write, no sampled write); it records ``capture_seconds`` and ``graph_memory`` (bytes of
        torch.cuda.memory_allocated/reserved added). Lazy capture captures nothing here.

        Returns: the number of graphs captured.

        Raises:
            RuntimeError: a decode step already ran on these buffers, capture() ran before, or
                a capture failed (eager capture; a lazy one records it and runs that size
                eagerly, ``GraphCache``).
        """
        b, buckets = self.buffers, self.backend.buckets
        if not (self.use_cuda_graph and b.device.type == "cuda" and buckets is not None):
            return 0
        if self.backend.prev_num_reqs or self.cache is not None:
            raise RuntimeError("capture() must run once, before the first decode step")
        capturer = CudaGraphCapturer(self._body)
        self.cache = GraphCache(capturer, budget_bytes=self.graph_memory_budget,
                                release_pool=capturer.release_pool)
        if self.graph_capture == "lazy":
            return 0
        # No step staged yet: every row is a dummy row (the backend reset the buffers when it
        # took them over), so warm-up and capture write dummy rows only.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # torch.cuda.graph empties it too: a comparable baseline
        alloc0, res0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        warm_up(buckets.sizes, self._body)
        for s in sorted(buckets.sizes, reverse=True):
            if not self.cache.capture(s):  # no budget here: only a failure says False
                err = self.cache.failures[s]
                raise RuntimeError(f"capture of the {s}-row graph failed: {err}") from err
        self._up_front_seconds = time.perf_counter() - t0
        self.graph_memory = {"allocated_bytes": torch.cuda.memory_allocated() - alloc0,
                             "reserved_bytes": torch.cuda.memory_reserved() - res0}
        return len(self.cache)

    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """``{padded size: graph}`` of the graphs held now (empty without a cache)."""
        return self.cache.graphs if self.cache is not None else {}

    @property
    def num_graphs(self) -> int:
        """Graphs held now (one per bucket after eager capture), 0 off CUDA."""
        return len(self.cache) if self.cache is not None else 0

    @property
    def num_captures(self) -> int:
        """Graphs captured so far (lazy: re-captures after eviction counted too)."""
        return self.cache.captures if self.cache is not None else 0

    @property
    def capture_seconds(self) -> float:
        """Host seconds spent capturing: eager, warm-up included; lazy, the captures so far."""
        if self.cache is None:
            return 0.0
        return self._up_front_seconds or self.cache.capture_seconds

    # ---- decode ----------------------------------------------------------------------------

    def decode(self, step: DecodeStep, *, min_padded_size: int = 0) -> DecodeResult:
        """Run one decode step; sampled tokens land in ``buffers.sampled[:N]`` (on the device;
        with ``spec``, also ``buffers.accepted[:N]`` and ``spec.output[:N]``).

        Request rows [N, padded_size // q) are dummy rows: their ``sampled`` entries keep their
        old values.
        The graph of the step's bucket is replayed if the cache holds it; otherwise the body runs
        eagerly, and under lazy capture (reason "not captured yet" or "evicted") that size's
        graph is captured right after, within the cache's budget (``DecodeResult.capture_s``).
        ``min_padded_size`` (token rows, default 0) pads the step to at least that many rows
        (``MetadataBackend.stage``): data-parallel ranks run the padded size they agreed on.
        With it, N = 0 is a dummy step: ``min_padded_size`` dummy rows through the same graph
        or eager body, no KV written, nothing sampled, and every earlier row dropped.

        Raises:
            ValueError: an empty step (N = 0) without ``min_padded_size``, or the packer's and
                ``stage``'s validation errors.
        """
        if step.num_reqs == 0 and not min_padded_size:
            raise ValueError("decode: empty step (no request rows) and no min_padded_size")
        self._push("zos.prep")
        t0 = time.perf_counter()
        plan = self.backend.stage(step, min_padded_size=min_padded_size)
        graph, reason = self._lookup(plan.padded_size, plan.bucketed)
        if graph is None:
            self.backend.build(plan.padded_size)
        prep_us = (time.perf_counter() - t0) * 1e6
        self._pop()
        if graph is not None:
            self._push("zos.replay")
            graph.replay()
            self._pop()
        else:
            self._body(plan.padded_size, build=False, nvtx=True)
        capture_s = 0.0
        if reason in (NOT_CAPTURED, EVICTED):  # lazy: this eager run was the warm-up
            t1 = time.perf_counter()
            self.cache.capture(plan.padded_size)  # records only: live state is not touched
            capture_s = time.perf_counter() - t1
        return DecodeResult("graph" if graph is not None else "eager", plan.num_reqs,
                            plan.padded_size, plan.padded_size if plan.bucketed else None,
                            prep_us, int(self.backend.last_upload_bytes), reason, capture_s)

    def _lookup(self, padded_size: int, bucketed: bool):
        """``(graph, None)``, or ``(None, reason)`` for an eager step (see DecodeResult)."""
        if not bucketed:
            return None, "no bucket"
        if self.cache is None:
            return None, "graphs off"
        graph = self.cache.get(padded_size)
        return graph, (None if graph is not None else self.cache.reason(padded_size))

    def _body(self, padded_size: int, build: bool = True, nvtx: bool = False) -> None:
        """Build (if asked), forward, sample for ``padded_size`` token rows; what a graph
        holds."""
        b, spec = self.buffers, self.spec
        if build:
            self.backend.build(padded_size)
        if spec is not None:
            spec.propose(padded_size)  # draft tokens into token rows 1..K
        md = b.views(0, padded_size)
        if nvtx:
            self._push("zos.forward")
        with torch.no_grad():
            hidden = self.model.forward(md.input_ids, md.positions, self.kv_caches, md, False)
            if nvtx:
                self._pop()
                self._push("zos.sample")
            tokens = self.model.compute_logits(hidden).argmax(-1).to(torch.int32)
            if spec is not None:  # accepted, sampled and output of rows < N (N on the device)
                spec.verify(tokens, padded_size)
            else:
                real = self._rows[:padded_size] < b.counts[0]  # N read on the device
                b.sampled[:padded_size].copy_(torch.where(real, tokens,
                                                          b.sampled[:padded_size]))
        if nvtx:
            self._pop()

    # ---- prefill ---------------------------------------------------------------------------

    def prefill(self, seqs: Sequence[tuple[Sequence[int], Sequence[int]]]
                ) -> tuple[list[int], float, int]:
        """One eager packed prefill from position 0; greedy next token of each sequence.

        Args:
            seqs: ``(tokens, block_ids)`` per sequence: token ids (ints in
                [0, backend.vocab_size); positions 0..len-1, all written into the KV cache
                through their slots) and the sequence's blocks (at least
                ``ceil(len / block_size)``, ids a request can hold: in [1, num_kv_blocks) with
                the null block 0, else in [0, num_kv_blocks), as the backend's packer checks).

        Returns:
            ``(tokens, prep_us, upload_bytes)``: the sampled next token per sequence (host
            ints), host microseconds spent building the prefill inputs and metadata, and the
            bytes of those host tensors (copied to the device unless it is the CPU).

        Raises:
            TypeError: tokens or block ids that are not integers (the sequence named).
            ValueError: no sequences, an empty sequence, too few / too many blocks, a token
                outside the vocabulary or a block id a request cannot hold (the sequence and
                the value named). Nothing runs.
        """
        b, backend = self.buffers, self.backend
        bs, w = b.block_size, b.max_num_blocks_per_req
        first_block = 1 if b.padding.null_block == 0 else 0
        if not seqs:
            raise ValueError("prefill: no sequences")
        t0 = time.perf_counter()
        toks = [np.asarray(t) for t, _ in seqs]
        blocks = [np.asarray(bl) for _, bl in seqs]
        for i, (t, bl) in enumerate(zip(toks, blocks)):
            for name, a in (("tokens", t), ("block_ids", bl)):
                if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                    raise TypeError(f"prefill: sequence {i}: {name} must be a 1-D sequence of "
                                    f"ints, got {a.dtype} of shape {a.shape}")
            if not t.size or not -(-t.size // bs) <= bl.size <= w:
                raise ValueError(f"prefill: sequence {i} has {t.size} tokens and {bl.size} "
                                 f"blocks (block size {bs}, at most {w} blocks)")
        lens = np.array([t.size for t in toks], np.int64)
        flat_toks = np.concatenate(toks)
        for name, flat, sizes, lo, hi in (
                ("token", flat_toks, lens, 0, backend.vocab_size),
                ("block id", np.concatenate(blocks), [bl.size for bl in blocks], first_block,
                 backend.num_kv_blocks)):
            bad = (flat < lo) | (flat >= hi)
            if bad.any():  # one pass over all sequences; the first offender named
                k = int(bad.argmax())
                i = int(np.searchsorted(np.cumsum(sizes), k, side="right"))
                raise ValueError(f"prefill: sequence {i}: {name} {flat[k]} is outside "
                                 f"[{lo}, {hi})")
        table = np.zeros((len(seqs), w), np.int32)
        for i, bl in enumerate(blocks):
            table[i, :bl.size] = bl
        self._push("zos.prep")  # after the checks: a refused prefill leaves no range open
        pos = np.concatenate([np.arange(n) for n in lens])
        row = np.repeat(np.arange(len(seqs)), lens)
        slots = table[row, pos // bs].astype(np.int64) * bs + pos % bs
        dev = b.device
        qsl = np.zeros(len(seqs) + 1, np.int32)
        qsl[1:] = np.cumsum(lens)
        num_tokens = int(qsl[-1])
        meta = StepMetadata(
            input_ids=torch.from_numpy(flat_toks.astype(np.int32)).to(dev),
            positions=torch.from_numpy(pos.astype(np.int32)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            seq_lens=torch.from_numpy(lens.astype(np.int32)).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            block_table=torch.from_numpy(table).to(dev),
            counts=None, num_reqs=len(seqs), num_tokens=num_tokens, padded_size=num_tokens,
            query_lens_host=lens.tolist(), seq_lens_host=lens.tolist())
        last = torch.from_numpy(qsl[1:].astype(np.int64) - 1).to(dev)
        prep_us = (time.perf_counter() - t0) * 1e6
        nbytes = sum(t.numel() * t.element_size() for t in (
            meta.input_ids, meta.positions, last, meta.slot_mapping, meta.seq_lens,
            meta.query_start_loc, meta.block_table))
        self._pop()
        if self.spec is not None:  # the prompt becomes the drafter's history
            self.spec.write_history(meta.input_ids, meta.slot_mapping)
        self._push("zos.prefill")
        with torch.no_grad():
            hidden = self.model.forward(meta.input_ids, meta.positions, self.kv_caches, meta,
                                        True)
            out = self.model.compute_logits(hidden[last]).argmax(-1).tolist()
        self._pop()
        return out, prep_us, nbytes

    def _push(self, name: str) -> None:
        if self._nvtx:
            torch.cuda.nvtx.range_push(name)

    def _pop(self) -> None:
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
