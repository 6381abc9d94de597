"""zos's metadata backend: one small upload per step, metadata rebuilt on the device."""
from __future__ import annotations

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

    Args:
        buffers, num_kv_blocks, vocab_size, buckets: see :class:`MetadataBackend`.
        capture_prep: on CUDA, capture the prep kernels once per bucket into a
            CUDA graph at construction and replay it in ``build`` (the real row
            count comes from the staged record, so one graph serves every N in
            the bucket). A runner that captures prep together with the model
            passes False and calls ``build`` inside its own capture.
    """

    name = "zos"

    def __init__(self, buffers: DecodeBuffers, *, num_kv_blocks: int, vocab_size: int,
                 buckets: BucketTable | None = None, capture_prep: bool = False) -> None:
        super().__init__(buffers, num_kv_blocks=num_kv_blocks, vocab_size=vocab_size,
                         buckets=buckets)
        cuda = buffers.device.type == "cuda"
        words = buffers.staging.numel()
        self._pinned = [torch.zeros(words, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self._pinned_np = [p.numpy() for p in self._pinned]
        self._upload = None
        if cuda:
            self._device_index = buffers.device.index
            if self._device_index is None:
                self._device_index = torch.cuda.current_device()
            with torch.cuda.device(self._device_index):  # the fences live on the buffers' GPU
                self._upload = PinnedUpload(buffers.staging.data_ptr(), self._pinned[0].data_ptr(),
                                            self._pinned[1].data_ptr(), 4 * words)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture_prep and cuda and buckets is not None:
            self._capture(buckets)

    def _stage(self, step: DecodeStep) -> StepPlan:
        """Pack ``step`` and enqueue its one H2D copy into ``buffers.staging``.

        On CUDA the copy is issued natively (:class:`zos._C.PinnedUpload`) on the
        current stream. Raises ValueError/TypeError (from the packer) before
        anything is written to the device or to the packer's mirror.
        """
        up = self._upload
        k = up.acquire() if up is not None else 0
        words = self.packer.pack(step.req_ids, step.new_rows, step.new_tokens,
                                 step.new_positions, step.new_block_indptr, step.new_block_ids,
                                 step.append_rows, step.append_block_ids, self._pinned_np[k])
        if up is not None:
            try:  # private but cheap (0.2 us against 6 us for torch.cuda.current_stream())
                up.submit(k, 4 * words, torch._C._cuda_getCurrentRawStream(self._device_index))
            except RuntimeError:
                self.packer.reset()  # the device never got this step: start over from new rows
                raise
        else:
            self.buffers.staging[:words].copy_(self._pinned[0][:words])
        self.last_upload_bytes = 4 * words
        return self.plan(step.num_reqs)

    @property
    def captures_prep(self) -> bool:
        """Whether this backend replays prep graphs of its own (``capture_prep=True``)."""
        return bool(self._graphs)

    def build(self, padded_size: int) -> None:
        """Rebuild token rows [0, padded_size) on the device (graph replay if captured)."""
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
