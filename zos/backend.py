"""The interface both metadata backends share, so a decode runner can swap them."""
from __future__ import annotations

from dataclasses import dataclass

from zos._C import StepPacker
from zos.buckets import BucketTable
from zos.buffers import DecodeBuffers, DecodeMetadata
from zos.step import DecodeStep


@dataclass(frozen=True)
class StepPlan:
    """Sizes of a staged step (host ints).

    Attributes:
        num_reqs: real request rows N.
        num_tokens: real token rows N * q.
        padded_tokens: token rows the step runs with: the bucket of num_tokens,
            or num_tokens itself when no bucket holds it (``bucketed`` False:
            the step runs eagerly, on the same buffers).
        bucketed: whether a bucket (a captured graph) holds this step.
    """

    num_reqs: int
    num_tokens: int
    padded_tokens: int
    bucketed: bool


class MetadataBackend:
    """Base of the two backends: owns the step packer and the bucket choice.

    A step is ``stage(step)`` (host work and upload, outside any graph) then
    ``build(plan)`` (device work; for the device backend capturable in a CUDA
    graph, for the host backend nothing), or both at once with ``prepare``.

    Args:
        buffers: the static device buffers this backend writes.
        num_blocks: KV blocks in the cache (ids in [1, num_blocks); 0 is null).
        vocab_size: token ids accepted in new rows are in [0, vocab_size).
        buckets: bucket table in token rows; None runs every step unpadded.
    """

    name = "base"

    def __init__(self, buffers: DecodeBuffers, *, num_blocks: int, vocab_size: int,
                 buckets: BucketTable | None = None) -> None:
        if buffers.q != 1:
            # The layout carries q token rows per request, but the packer's mirror advances a
            # carried row by q: with drafts it must learn the accepted counts (one step late).
            raise ValueError(f"buffers.q must be 1 (speculative decoding is not implemented "
                             f"in the backends yet), got {buffers.q}")
        if buckets is not None and buckets.max_size > buffers.max_reqs * buffers.q:
            raise ValueError(f"buckets.max_size {buckets.max_size} exceeds the buffers' "
                             f"{buffers.max_reqs * buffers.q} token rows")
        if buckets is not None and any(s % buffers.q for s in buckets.sizes):
            raise ValueError(f"every bucket must be divisible by q = {buffers.q} (uniform decode)")
        self.buffers = buffers
        self.buckets = buckets
        self._plans: dict[int, StepPlan] = {}
        self._metadata: dict[tuple[int, int], DecodeMetadata] = {}
        self.last_upload_bytes = 0  # bytes the last ``stage`` sent to the device
        self.packer = StepPacker(buffers.max_reqs, buffers.q, buffers.block_size,
                                 buffers.max_blocks_per_seq, num_blocks, vocab_size)

    def plan(self, num_reqs: int) -> StepPlan:
        """Bucket choice for ``num_reqs`` request rows (docs/ZOS.md: rounding is monotone).
        Memoised: the per-step cost is one dict lookup."""
        plan = self._plans.get(num_reqs)
        if plan is None:
            t = num_reqs * self.buffers.q
            b = self.buckets.padded_size(t) if self.buckets is not None and t > 0 else None
            plan = self._plans[num_reqs] = StepPlan(num_reqs, t, b if b is not None else t,
                                                    b is not None)
        return plan

    def stage(self, step: DecodeStep) -> StepPlan:
        """Host work of one step, outside any graph: validate and pack ``step`` (C++) and
        enqueue its upload on the current stream; returns the step's sizes.

        Raises:
            ValueError, TypeError: bad input (field, row, request and value named); nothing
                was written to the device and the previous step is still the reference.
        """
        raise NotImplementedError

    def build(self, plan: StepPlan) -> None:
        """Device work of the step staged last: writes the buffers' rows [0, plan.padded_tokens)
        (token rows) in place. Capturable in a CUDA graph for the device backend."""
        raise NotImplementedError

    def prepare(self, step: DecodeStep) -> DecodeMetadata:
        """Stage and build one step; returns views padded to the step's bucket."""
        plan = self.stage(step)
        self.build(plan)
        return self.metadata(plan)

    def metadata(self, plan: StepPlan) -> DecodeMetadata:
        """Views of the buffers for ``plan`` (memoised: views are made once per size)."""
        key = (plan.num_reqs, plan.padded_tokens)
        md = self._metadata.get(key)
        if md is None:
            md = self._metadata[key] = self.buffers.views(plan.num_reqs, plan.padded_tokens)
        return md

    def reset(self) -> None:
        """Forget the previous step (every row of the next step must be new)."""
        self.packer.reset()
