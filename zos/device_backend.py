"""zos's metadata backend: one small upload per step, metadata rebuilt on the device."""
from __future__ import annotations

from zos._interpret import check_triton_device

import torch

from zos._C import PinnedUpload
from zos.backend import MetadataBackend, StepPlan
from zos.buckets import BucketTable
from zos.buffers import DecodeBuffers
from zos.graphs import capture_per_bucket
from zos.kernels import launch_prep
from zos.staging import HEADER_WORDS
from zos.step import DecodeStep


class DeviceMetadataBackend(MetadataBackend):
    """Builds each step's metadata with the prep kernels, from device state.

    Per step, on the host: ``StepPacker.pack`` (C++, no GIL) writes the staging
    record into one of two pinned buffers, and one H2D copy of that record is
    enqueued natively (``PinnedUpload``: CUDA driver API, no torch dispatch);
    its size is 8 + 2N + 5M + L int32 words (N rows; M records: new rows and
    rows with appended blocks; L block ids: new rows' whole rows and appended
    blocks), independent of context length and block-table width for carried
    rows. On the device: ``launch_prep`` (two kernels) rebuilds every
    field in place. The two pinned buffers alternate, each fenced by an event
    recorded after its copy, so the host never overwrites a record that an
    enqueued copy has not read yet (docs/ZOS.md, "Kernels inside the graph").

    Streams: the upload is enqueued on one stream fixed here (``stream``; by default
    the current stream of the buffers' device when the backend is built), whose raw
    handle is cached so that ``stage`` costs no stream query per step. ``build`` (the prep
    kernels or their graph) runs on the stream current at the time of the call; run it on
    that same stream (the usual case: both are the default stream). On another stream it
    must be ordered after the upload (``torch.cuda.current_stream().wait_stream(
    backend.stream)``), and the next ``stage`` after it (``backend.stream.wait_stream(...)``):
    prep reads the staging buffer that the next upload overwrites. Change the stream with
    the ``stream`` property, between steps.

    Args:
        buffers, num_kv_blocks, vocab_size, buckets: see :class:`MetadataBackend`.
        capture_prep: on CUDA, capture the prep kernels once per bucket into a
            CUDA graph at construction and replay it in ``build`` (the real row
            count comes from the staged record, so one graph serves every N in
            the bucket). A runner that captures prep together with the model
            passes False and calls ``build`` inside its own capture.
        stream: the ``torch.cuda.Stream`` the upload is enqueued on, on the buffers'
            device; None (default) takes ``torch.cuda.current_stream(device)`` now, at
            construction (later changes of the current stream are not followed). Must be
            None for CPU buffers.

    Raises:
        ValueError: as :class:`MetadataBackend`; or ``stream`` is on another device than
            the buffers, or given for CPU buffers; or CPU buffers on a machine whose Triton
            compiles for the GPU (set ``TRITON_INTERPRET=1`` before triton is imported:
            ``zos._interpret.check_triton_device``).
        TypeError: ``stream`` is not a ``torch.cuda.Stream``.
        RuntimeError: on CUDA, the driver cannot be loaded (:class:`zos._C.PinnedUpload`).
    """

    name = "zos"

    def __init__(self, buffers: DecodeBuffers, *, num_kv_blocks: int, vocab_size: int,
                 buckets: BucketTable | None = None, capture_prep: bool = False,
                 stream: torch.cuda.Stream | None = None) -> None:
        check_triton_device(buffers.device, "DeviceMetadataBackend: buffers")
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
        words = buffers.staging.numel()
        self._pinned = [torch.zeros(words, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._pinned_np = [p.numpy() for p in self._pinned]
        self._upload = None
        if cuda:
            with torch.cuda.device(self._device_index):  # the fences live on the buffers' GPU
                self._upload = PinnedUpload(buffers.staging.data_ptr(), self._pinned[0].data_ptr(),
                                            self._pinned[1].data_ptr(), 4 * words)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._take_over()
        if capture_prep and cuda and buckets is not None:
            self._capture(buckets)
        if cuda:  # the first upload lands after the reset (and capture) enqueued above
            current = torch.cuda.current_stream(self._device_index)
            if current != self._stream:
                self._stream.wait_stream(current)

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

    def _stage(self, step: DecodeStep, min_padded_size: int = 0) -> StepPlan:
        """Pack ``step`` and enqueue its one H2D copy into ``buffers.staging``.

        On CUDA the copy is issued natively (:class:`zos._C.PinnedUpload`) on
        ``self.stream`` (its handle cached: no stream query per step); ``build`` must run
        on that stream (see the class docstring). Raises ValueError/TypeError (from the
        packer) before anything is written to the device or to the packer's mirror, and
        RuntimeError if the driver rejects the copy (the packer is then reset: the next
        step must be all new rows).
        """
        up = self._upload
        k = up.acquire() if up is not None else 0
        words = self.packer.pack(step.req_ids, step.new_rows, step.new_tokens,
                                 step.new_positions, step.new_block_indptr, step.new_block_ids,
                                 step.append_rows, step.append_block_ids, self._pinned_np[k],
                                 step.rewrite_rows, step.rewrite_block_indptr,
                                 step.rewrite_block_ids)
        if up is not None:
            try:
                up.submit(k, 4 * words, self._stream_handle)
            except RuntimeError:
                self.packer.reset()  # the device never got this step: start over from new rows
                raise
        else:
            self.buffers.staging[:words].copy_(self._pinned[0][:words])
        self.last_upload_bytes = 4 * words
        return self.plan(step.num_reqs, min_padded_size)

    @property
    def captures_prep(self) -> bool:
        """Whether this backend replays prep graphs of its own (``capture_prep=True``)."""
        return bool(self._graphs)

    def build(self, padded_size: int) -> None:
        """Rebuild token rows [0, padded_size) on the device (graph replay if captured).

        Runs on the current stream, which must be ``self.stream`` or ordered after it (the
        staged record is read from device memory).
        """
        if padded_size == 0:  # an empty step: no rows, and no real row either
            self.buffers.counts.zero_()
            return
        graph = self._graphs.get(padded_size)
        if graph is not None:
            graph.replay()
        else:
            launch_prep(self.buffers, padded_size)

    def __del__(self) -> None:
        if getattr(self, "_upload", None) is not None:
            try:  # no copy may read the pinned buffers once they are freed
                self._upload.synchronize()
            except RuntimeError:  # at interpreter exit the CUDA context may be gone already
                pass

    def _capture(self, buckets: BucketTable) -> None:
        self.buffers.staging[:HEADER_WORDS].zero_()  # warm-up with N = 0: dummy rows only
        self._graphs = capture_per_bucket(buckets.sizes, lambda s: launch_prep(self.buffers, s))
