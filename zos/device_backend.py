"""zos's metadata backend: one small record per step, metadata rebuilt on the device."""
from __future__ import annotations

from zos._interpret import check_triton_device

from collections.abc import Callable

import numpy as np
import torch

from zos._C import PinnedUpload, launch_graph
from zos._checks import check_int
from zos.backend import MetadataBackend, StepPlan
from zos.buckets import BucketTable
from zos.buffers import DecodeBuffers, StepMetadata
from zos.graphs import capture_per_bucket
from zos.kernels import PrepState, launch_prep
from zos.staging import HEADER_WORDS, SEQ_MASK
from zos.staging_ring import StagingRing
from zos.step import DecodeStep
from zos.stream_order import BuildOrder

STAGING_MODES = ("mapped", "copy")


class DeviceMetadataBackend(MetadataBackend):
    """Builds each step's metadata with the prep kernels, from device state.

    Per step, on the host: one native call (``StepPacker.stage_call``'s function: C++, no
    pybind11 dispatch, the DecodeStep's arrays read by name, the GIL released only by a stage
    whose slot is still in use, for the whole call: a release costs a wait for every busy
    Python thread beside it to let go, up to the switch interval, 5 ms) validates the step
    and writes the staging record, 8 + 3C + 5M + L int32 words (C listed rows: those whose
    request is new or moved, or that get blocks or a rewritten block list; M records: new
    rows, rows with appended blocks and rewritten rows; L block ids: new and rewritten rows'
    whole lists and appended blocks): a row that keeps its request and gets no block costs
    no word and, in plain decode on an AVX2 host, no loop iteration (its share of two vector
    compares; a last chunk of fewer than 64 rows runs a plain loop). On the device:
    ``launch_prep`` (two kernels) rebuilds every field in place. ``prepare`` with a prep
    graph (``capture_prep=True``) launches it from the same native call: once a step of N
    rows has passed through ``prepare``, a later step of N rows issued on ``stream`` costs
    that call and a few Python operations.

    Where the record goes (``staging``):

    - ``"mapped"`` (default): into slot n mod K of a :class:`zos.staging_ring.StagingRing`
      of K = ``ring_slots`` records in mapped pinned host memory, which the prep kernels
      read in place (no copy call); they pick the slot themselves from a ring state on the
      device, and write the SEQ of each record they have finished reading into the ring's
      done word, so the host rewrites a slot only after the build that read it has finished
      at the cost of one load (it waits only when K steps ahead). ``last_upload_bytes`` is
      then the record's bytes, which the GPU reads from host memory.
    - ``"copy"``: into one of two pinned buffers, and one H2D copy of it into
      ``buffers.staging`` is enqueued natively (``PinnedUpload``: CUDA driver API, no torch
      dispatch), each buffer fenced by an event recorded after its copy (the fallback;
      same results).

    On a CPU both run the same kernels in Triton's interpreter; "mapped" reads the ring's
    CPU tensor directly, "copy" copies the record into ``buffers.staging``.

    Streams: the stage work (the ring's fences, or the copy) is enqueued on one stream fixed
    here (``stream``; by default the current stream of the buffers' device when the backend
    is built), whose raw handle is bound into the native stage, so that ``stage`` makes no
    torch stream query per step (on a stream other than the legacy default one, the native
    stage asks the driver whether it is capturing: a stage is host work outside any graph).
    ``build`` (the prep kernels or their graph) runs on the stream current at the time of the
    call. On ``stream`` (the usual case: both are the default stream) stream order is enough;
    on any other stream, or captured into a CUDA graph that a runner replays on any stream,
    the backend orders it itself (``zos.stream_order.BuildOrder``: the next stage waits for
    the build, and on the copy path the build for the stage's copy, by events), so no
    runner can read a record before it is staged or overwrite one a build still reads.
    Change the stream with the ``stream`` property, between steps. docs/ZOS.md, "The runner
    contract".

    Args:
        buffers, num_kv_blocks, vocab_size, buckets: see :class:`MetadataBackend`.
        capture_prep: on CUDA, capture the prep kernels once per bucket into a
            CUDA graph at construction and replay it in ``build`` (the real row
            count comes from the staged record, so one graph serves every N in
            the bucket). A runner that captures prep together with the model
            passes False and calls ``build`` inside its own capture.
        epilogue: ``epilogue(padded_size)``, called right after the prep kernels of every
            build (eager, captured by a runner, or into this backend's prep graphs, so that
            ``prepare``'s one native call launches it too; with ``capture_prep`` also here,
            by the warm-up and capture of every bucket, with N = 0): a runner's own launches
            that read the built metadata (e.g. a copy into an engine's persistent tensors).
            It must enqueue device work on the current stream only, capturable, reading the
            row count N on the device (``buffers.counts[0]``), never on the host.
        stream: the ``torch.cuda.Stream`` the upload (or the ring's fences) is enqueued on,
            on the buffers' device; None (default) takes ``torch.cuda.current_stream(device)``
            now, at construction (later changes of the current stream are not followed).
            Must be None for CPU buffers.
        staging: ``"mapped"`` or ``"copy"`` (above).
        ring_slots: K, records in the mapped ring (>= 1; "mapped" only): steps the host may
            stage ahead of the device before it waits.
        dense_record: list every row in the record (the dense record, for comparisons);
            default False, the sparse record.

    Raises:
        ValueError: as :class:`MetadataBackend`; ``stream`` is on another device than
            the buffers, or given for CPU buffers; ``staging`` not one of the modes;
            ``ring_slots`` not a positive int; CPU buffers on a machine whose Triton
            compiles for the GPU (set ``TRITON_INTERPRET=1`` before triton is imported:
            ``zos._interpret.check_triton_device``).
        TypeError: ``stream`` is not a ``torch.cuda.Stream``.
        RuntimeError: on CUDA, the driver cannot be loaded or the ring's memory not mapped
            (:class:`zos._C.PinnedUpload`, :class:`zos._C.MappedRing`).
    """

    name = "zos"

    def __init__(self, buffers: DecodeBuffers, *, num_kv_blocks: int, vocab_size: int,
                 buckets: BucketTable | None = None, capture_prep: bool = False,
                 stream: torch.cuda.Stream | None = None, staging: str = "mapped",
                 ring_slots: int = 4, dense_record: bool = False,
                 epilogue: Callable[[int], None] | None = None) -> None:
        check_triton_device(buffers.device, "DeviceMetadataBackend: buffers")
        if staging not in STAGING_MODES:
            raise ValueError(f"staging must be one of {STAGING_MODES}, got {staging!r}")
        ring_slots = check_int("ring_slots", ring_slots) if staging == "mapped" else ring_slots
        cuda = buffers.device.type == "cuda"
        self._device_index = None
        if cuda:
            self._device_index = buffers.device.index
            if self._device_index is None:
                self._device_index = torch.cuda.current_device()
            if stream is None:
                stream = torch.cuda.current_stream(self._device_index)
        self._stream = self._checked_stream(stream)
        # The raw cudaStream_t as an int, read once: ``stage`` passes it to the native copy.
        self._stream_handle = stream.cuda_stream if stream is not None else 0
        super().__init__(buffers, num_kv_blocks=num_kv_blocks, vocab_size=vocab_size,
                         buckets=buckets)
        self.packer.list_every_row = bool(dense_record)
        self.staging_mode = staging
        words = buffers.staging.numel()
        self._discard = np.zeros(words, np.int32)  # records no build reads (padded size 0)
        self._seq = 0  # SEQ of the last record staged for a build
        self._built = 0  # SEQ staged when the last build was enqueued (== _seq: a repeat)
        self._prep = PrepState(buffers)
        self._epilogue = epilogue
        self._upload = self._ring = self._native = None  # _native: the ring's or the upload's
        if staging == "mapped":
            self._ring = StagingRing(ring_slots, words, buffers.device)
            if cuda:
                self._native = self._ring.fences  # zos._C.MappedRing
            self._prep_args = dict(ring=self._ring.device_view, num_slots=ring_slots,
                                   slot_words=words, state=self._prep,
                                   done=self._ring.done_view)
        else:
            self._pinned = [torch.zeros(words, dtype=torch.int32, pin_memory=cuda)
                            for _ in range(2)]
            self._pinned_np = [p.numpy() for p in self._pinned]
            if cuda:
                self._upload = self._native = PinnedUpload(  # fences in the primary context
                    buffers.staging.data_ptr(), self._pinned[0].data_ptr(),
                    self._pinned[1].data_ptr(), 4 * words, self._device_index)
            self._prep_args = dict(ring=buffers.staging, num_slots=1, slot_words=words,
                                   state=self._prep)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_execs: dict[int, int] = {}  # padded size -> its graph's cudaGraphExec_t
        # N -> (metadata, prep graph's cudaGraphExec_t) where N's padded size has a prep graph:
        # ``prepare``'s one lookup, filled by the first step of N rows that passed.
        self._graph_steps: dict[int, tuple[StepMetadata, int]] = {}
        self._take_over()
        if capture_prep and cuda and buckets is not None:
            self._capture(buckets)
        if cuda:  # the first upload lands after the reset (and capture) enqueued above
            current = torch.cuda.current_stream(self._device_index)
            if current != self._stream:
                self._stream.wait_stream(current)
        self._order = None  # on CUDA: builds off ``stream`` are ordered by events
        self._stage_call = self._on_stream = None  # on CUDA: the native stage, its stream check
        if cuda:
            self._order = BuildOrder(self._stream, self._native.set_build_events,
                                     wait_for_stage=self._upload is not None)
            self._bind_stage()

    def _bind_stage(self) -> None:
        """(Re)binds the native stage to ``self.stream`` (construction, the ``stream`` setter)."""
        self._stage_call = self.packer.stage_call(self._native, self._stream_handle,
                                                  self._device_index)
        self._on_stream = self._order.on_stream

    def _checked_stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream | None:
        """``stream`` if it can carry the upload to these buffers, else TypeError/ValueError."""
        if self._device_index is None:
            if stream is not None:
                raise ValueError("stream must be None for CPU buffers (the copy is a plain "
                                 "tensor copy)")
            return None
        if not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
        if stream.device.index != self._device_index:
            raise ValueError(f"stream is on {stream.device}, the buffers on "
                             f"cuda:{self._device_index}")
        return stream

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The stream ``stage`` enqueues the upload on (None for CPU buffers).

        Set it between steps to move the upload (same checks as the constructor's
        ``stream``; None is not accepted on CUDA): the new stream first waits for the old
        one, so the next upload lands after everything enqueued there. ``build`` must then
        run on the new stream (see the class docstring).
        """
        return self._stream

    @stream.setter
    def stream(self, stream: torch.cuda.Stream | None) -> None:
        stream = self._checked_stream(stream)
        if stream is not None and stream != self._stream:
            stream.wait_stream(self._stream)
        self._stream = stream
        self._stream_handle = stream.cuda_stream if stream is not None else 0
        if self._order is not None:
            self._order.stream = stream
            self._bind_stage()

    def _stage(self, step: DecodeStep, plan: StepPlan) -> StepPlan:
        """Pack ``step`` into the next ring slot (or copy its record into ``buffers.staging``).

        "mapped": the slot is taken once the done word shows that the build of the record it
        holds has finished (a wait only when the host is K steps ahead). "copy": the H2D
        copy is issued natively on ``self.stream`` (its handle bound: no torch stream query
        per step). ``build`` must run on that stream (see the class docstring). A step of
        padded size 0 runs no prep kernel: its record is validated and committed to the
        packer's mirror but written nowhere the device reads. Raises ValueError/TypeError
        (from the packer) before anything is written to the device, to a slot the device
        reads or to the packer's mirror; on CUDA RuntimeError, before anything, for a step of
        padded size > 0 while ``self.stream`` is capturing a CUDA graph (a stage is host work
        outside any graph; a step of padded size 0 writes nothing the device reads);
        RuntimeError if the driver rejects a call or a mapped stage finds a record staged and
        never built (the packer is then reset: the next step must be all new rows).
        """
        if plan.padded_size == 0:  # no build reads it: keep the SEQ chain for the next one
            self.packer.pack_step(step, self._discard)
            self.last_upload_bytes = 0
            return plan
        seq = (self._seq + 1) & SEQ_MASK
        if self._stage_call is not None:  # CUDA: slot (or buffer), pack (and copy): one call
            words = self._stage_call(step, seq)
        elif self._ring is not None:  # CPU: the same slot logic in Python
            try:
                slot = self._ring.acquire(self._stream_handle)
            except RuntimeError:
                self.packer.reset()  # as the native stage: the device never got a step
                raise
            words = self.packer.pack_step(step, slot, seq)
            self._ring.commit()
        else:  # CPU copy path: a plain tensor copy
            words = self.packer.pack_step(step, self._pinned_np[0], seq)
            self.buffers.staging[:words].copy_(self._pinned[0][:words])
        self._seq = seq
        self.last_upload_bytes = 4 * words
        return plan

    def prepare(self, step: DecodeStep) -> StepMetadata:
        """``stage(step)``, ``build(plan.padded_size)``, ``metadata(plan)``.

        Once a step of N rows has passed through ``prepare``, a step of N rows whose padded
        size has a prep graph, issued with ``self.stream`` current, is one native call (the
        stage and the graph's launch, ``StepPacker.stage_call``) and one dict lookup: the
        per-step path of a runner that does not capture the prep itself. Raises as ``stage``
        and ``build``.
        """
        graph_step = self._graph_steps.get(len(step.req_ids))
        if graph_step is not None and self.buffers.owner is self and self._on_stream():
            seq = (self._seq + 1) & SEQ_MASK
            self.last_upload_bytes = 4 * self._stage_call(step, seq, graph_step[1])
            self._seq = self._built = seq
            return graph_step[0]
        plan = self.stage(step)
        self.build(plan.padded_size)
        md = self.metadata(plan)
        graph_exec = self._graph_execs.get(plan.padded_size, 0)
        if graph_exec:  # the next steps of N rows take the path above
            self._graph_steps[plan.num_reqs] = (md, graph_exec)
        return md

    @property
    def prep_graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """The prep graphs of ``capture_prep=True`` by padded size (a copy; empty otherwise).
        ``build`` launches them; replaying one directly skips the build ordering (measurements
        only), and a graph ``reset()`` here leaves ``build`` launching a freed graph."""
        return dict(self._graphs)

    @property
    def captures_prep(self) -> bool:
        """Whether this backend replays prep graphs of its own (``capture_prep=True``)."""
        return bool(self._graphs)

    def build(self, padded_size: int) -> None:
        """Rebuild token rows [0, padded_size) of the step staged last on the device, in
        place; ``counts`` gets (N, N * q), rows past N become dummy rows. With
        ``capture_prep=True`` one ``cuGraphLaunch`` of the bucket's prep graph
        (``zos._C.launch_graph``), else the prep kernels. Capturable in a CUDA graph (N is
        read from device memory): under a capture the prep kernels themselves are captured.

        Enqueued on the current stream, whichever it is: on ``self.stream`` stream order
        places it after the stage and before the next one; on any other stream, or under
        capture (the graph may be replayed on any stream), the backend orders it by events
        (``zos.stream_order``: the next stage waits for the build; on the copy path the
        build's stream, or the graph, waits for the stage's copy). The step's consumers
        (model, sampler) run on the build's stream or are ordered after it by the runner.

        Raises:
            TypeError, ValueError: ``padded_size`` is not an int multiple of q in
                [N * q, max_num_reqs * q] (:meth:`check_build`); nothing is launched.
        """
        padded_size = self.check_build(padded_size)
        order = self._order
        joined = order.before_build() if order is not None else None
        if padded_size == 0:  # an empty step: no rows, and no real row either
            self.buffers.counts.zero_()
            if self._epilogue is not None:
                self._epilogue(0)
        else:
            graph_exec = self._graph_execs.get(padded_size)
            capturing = joined is not None and order.capturing
            if not capturing:  # a device build now (a capture runs nothing)
                if self._built == self._seq and self._ring is not None:
                    self._ring.fences.fence_repeat()  # the done word cannot see a repeat end
                self._built = self._seq
            if padded_size not in self._graphs or capturing:
                # No graph of this size, or captured into the caller's graph: the kernels
                # themselves (a graph launch cannot be captured on a stream).
                self._launch_prep(padded_size)
            elif graph_exec is not None:
                # One cuGraphLaunch on the current stream (``self.stream`` when the ordering
                # found the build there): replay() would also refill the random generators'
                # state (two fills), which the prep graph does not read.
                stream = (self._stream_handle if joined is None else
                          torch._C._cuda_getCurrentRawStream(self._device_index))
                launch_graph(graph_exec, stream, self._device_index)
            else:  # torch < 2.9: no raw_cuda_graph_exec
                self._graphs[padded_size].replay()
        if joined is not None:
            order.after_build(joined)

    @property
    def build_order(self) -> BuildOrder | None:
        """The events that order builds off ``self.stream`` (``zos.stream_order``); None for
        CPU buffers (no streams)."""
        return self._order

    @property
    def ring(self) -> StagingRing | None:
        """The mapped staging ring ("mapped"), else None."""
        return self._ring

    def __del__(self) -> None:
        # No copy or build may read the pinned records once they are freed: wait while the
        # build events (which a ring's wait orders after builds on other streams) are alive.
        # teardown: the garbage collector may run this inside the thread's own graph capture,
        # which a wait in the per-step mode would break.
        order = getattr(self, "_order", None)
        for sync in (getattr(self, "_upload", None), getattr(self, "_ring", None)):
            if sync is not None:
                try:
                    sync.synchronize(teardown=True)
                except RuntimeError:  # at interpreter exit the CUDA context may be gone
                    pass
        native = getattr(self, "_native", None)
        if order is not None and native is not None:
            native.set_build_events(0, 0)  # the events die with this backend, the ring may not

    def _launch_prep(self, padded_size: int) -> None:
        """The prep kernels for ``padded_size`` rows and the epilogue (a prep graph's body)."""
        launch_prep(self.buffers, padded_size, **self._prep_args)
        if self._epilogue is not None:
            self._epilogue(padded_size)

    def _capture(self, buckets: BucketTable) -> None:
        # Warm-up finds no new record (every ring slot and the staging header hold N = 0,
        # SEQ 0) and applies an N = 0 record: dummy rows only, the ring state unchanged.
        self.buffers.staging[:HEADER_WORDS].zero_()
        self._graphs = capture_per_bucket(buckets.sizes, self._launch_prep)
        if all(hasattr(g, "raw_cuda_graph_exec") for g in self._graphs.values()):  # torch >= 2.9
            self._graph_execs = {s: g.raw_cuda_graph_exec() for s, g in self._graphs.items()}
