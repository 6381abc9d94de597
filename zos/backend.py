"""The interface both metadata backends share, so a decode runner can swap them."""
from __future__ import annotations

from dataclasses import dataclass

from zos._C import StepPacker
from zos._checks import check_int
from zos.buckets import BucketTable
from zos.buffers import DecodeBuffers, StepMetadata
from zos.step import DecodeStep


@dataclass(frozen=True)
class StepPlan:
    """Sizes of a staged step (host ints).

    Attributes:
        num_reqs: real request rows N.
        num_tokens: real token rows N * q.
        padded_size: token rows the step runs with (B): the bucket of num_tokens,
            or num_tokens itself when no bucket holds it (``bucketed`` False:
            the step runs eagerly, on the same buffers).
        bucketed: whether a bucket (a captured graph) holds this step.
    """

    num_reqs: int
    num_tokens: int
    padded_size: int
    bucketed: bool


class MetadataBackend:
    """Base of the two backends: owns the step packer and the bucket choice.

    The runner contract (docs/ZOS.md, "The runner contract", lists what each call reads and
    writes): a step is ``stage(step)`` (host work and upload, outside any graph) then
    ``build(plan.padded_size)`` (device work; for the device backend capturable in a CUDA
    graph together with the model), or both at once with ``prepare``; the model reads
    ``metadata(plan)`` (or ``buffers.views(0, padded_size)`` inside a graph); the sampler
    writes ``buffers.sampled[r]`` for rows r < ``buffers.counts[0]`` (and, with draft tokens,
    the verifier ``buffers.accepted``); ``observe_accepted`` hands the packer the accepted
    counts; ``reset()`` forgets the previous step between runs; ``prev_num_reqs`` says how
    many rows the previous step had; ``stream`` is where the stage work goes. That is all a
    runner needs: nothing else of a backend (its packer, its underscore attributes) is part
    of the contract (``tests/test_contract.py`` checks our own runners).

    A backend takes its buffers over when it is built: it resets them (every row a
    dummy row, no row state, ``accepted`` 1 per row) and becomes ``buffers.owner``, so two
    backends built one after the other over the same buffers never see each other's rows;
    the earlier one refuses further steps.

    Args:
        buffers: the static device buffers this backend writes (reset here).
        num_kv_blocks: KV blocks in the cache pool that requests can hold: ids in
            [1, num_kv_blocks) when the buffers' profile has the null block 0 (vLLM), in
            [0, num_kv_blocks) when its null block lies past the pool (transformers).
        vocab_size: token ids accepted in new rows are in [0, vocab_size); the
            buffers' pad token must be one of them.
        buckets: bucket table in token rows; None runs every step unpadded.

    Raises:
        TypeError: num_kv_blocks or vocab_size not an int, buckets not a BucketTable.
        ValueError: a bucket larger than the buffers or not divisible by q,
            ``buffers.pad_token_id`` outside [0, vocab_size), a padding profile that does not
            fit the pool (``PaddingProfile.check_pool``), or a packer size out of range.
    """

    name = "base"

    def __init__(self, buffers: DecodeBuffers, *, num_kv_blocks: int, vocab_size: int,
                 buckets: BucketTable | None = None) -> None:
        q = buffers.uniform_decode_query_len
        num_kv_blocks = check_int("num_kv_blocks", num_kv_blocks)
        vocab_size = check_int("vocab_size", vocab_size)
        if buckets is not None and not isinstance(buckets, BucketTable):
            raise TypeError(f"buckets must be a zos.BucketTable (e.g. BucketTable(sizes)) or "
                            f"None, got {type(buckets).__name__}")
        if buckets is not None and buckets.max_size > buffers.max_num_reqs * q:
            raise ValueError(f"buckets.max_size {buckets.max_size} exceeds the buffers' "
                             f"{buffers.max_num_reqs * q} token rows")
        if buckets is not None and any(s % q for s in buckets.sizes):
            raise ValueError(f"every bucket must be divisible by uniform_decode_query_len = {q}")
        buffers.padding.check_pool(num_kv_blocks, buffers.block_size)
        if not 0 <= buffers.pad_token_id < vocab_size:
            raise ValueError(f"buffers.pad_token_id {buffers.pad_token_id} is outside the "
                             f"vocabulary [0, {vocab_size}): dummy rows would embed it")
        self.buckets = buckets
        #: the pool and vocabulary this backend checks steps against (see Args)
        self.num_kv_blocks, self.vocab_size = num_kv_blocks, vocab_size
        self._plans: dict[int, StepPlan] = {}
        self._metadata: dict[tuple[int, int], StepMetadata] = {}
        self.last_upload_bytes = 0  # bytes the last ``stage`` sent to the device
        self.packer = StepPacker(buffers.max_num_reqs, buffers.uniform_decode_query_len,
                                 buffers.block_size, buffers.max_num_blocks_per_req,
                                 num_kv_blocks, vocab_size, buffers.padding.null_block)
        self.buffers = buffers  # taken over by _take_over(), once nothing else can fail

    def _take_over(self) -> None:
        """Reset the buffers and become their owner: the last thing a subclass's constructor
        does before it first writes them, so a constructor that fails leaves the previous
        owner's buffers as they were."""
        self.buffers.reset()
        self.buffers.owner = self

    def plan(self, num_reqs: int, min_padded_size: int = 0) -> StepPlan:
        """Bucket choice for ``num_reqs`` request rows (docs/ZOS.md: rounding is monotone).
        Memoised: the per-step cost is one dict lookup.

        ``min_padded_size`` (token rows, default 0): the step runs with at least this many
        rows; a larger size than the bucket of ``num_reqs`` pads the step further with dummy
        rows (data parallelism: every rank runs the largest padded size of the ranks, as vLLM
        and SGLang pad DP ranks). The plan is ``bucketed`` when that size is itself a bucket.
        Callers check it (``stage`` does): here it is assumed valid.
        """
        plan = self._plans.get(num_reqs)
        if plan is None:
            t = num_reqs * self.buffers.uniform_decode_query_len
            b = self.buckets.padded_size(t) if self.buckets is not None and t > 0 else None
            plan = self._plans[num_reqs] = StepPlan(num_reqs, t, b if b is not None else t,
                                                    b is not None)
        if min_padded_size > plan.padded_size:
            b = self.buckets
            plan = StepPlan(num_reqs, plan.num_tokens, min_padded_size,
                            b is not None and b.padded_size(min_padded_size) == min_padded_size)
        return plan

    def check_min_padded_size(self, min_padded_size) -> int:
        """``min_padded_size`` as a Python int; ValueError/TypeError unless it is an int in
        [0, max_num_reqs * q] divisible by q (the rows the buffers hold)."""
        return self.buffers.check_padded_size(min_padded_size, field="min_padded_size", lo=0)

    def stage(self, step: DecodeStep, *, min_padded_size: int = 0) -> StepPlan:
        """Host work of one step, outside any graph: validate and pack ``step`` (C++) and
        enqueue its upload; returns the step's sizes.

        ``min_padded_size`` (token rows, default 0): pad the step to at least this many rows
        (see :meth:`plan`); with it a step of N = 0 request rows is a dummy step of
        ``min_padded_size`` dummy rows (a data-parallel rank with no requests; every earlier
        row is dropped, so the next step's rows are all new).

        Raises:
            ValueError, TypeError: bad input (field, row, request and value named), or a
                ``min_padded_size`` that is not an int in [0, max_num_reqs * q] divisible by q;
                nothing was written to the device and the previous step is still the
                reference.
            RuntimeError: another backend has taken these buffers over since this one was built;
                for the device backend also (``DeviceMetadataBackend._stage``): its stream is
                capturing a CUDA graph (before anything), or a device error (a record staged and
                never built, a failed copy; the packer is then reset).
        """
        if self.buffers.owner is not self:
            raise RuntimeError(f"{type(self).__name__}: another backend "
                               f"({type(self.buffers.owner).__name__}) has taken these buffers "
                               f"over; build a new backend to use them again")
        if type(min_padded_size) is not int or min_padded_size:  # 0: the plain step
            min_padded_size = self.check_min_padded_size(min_padded_size)
        return self._stage(step, self.plan(len(step.req_ids), min_padded_size))

    def _stage(self, step: DecodeStep, plan: StepPlan) -> StepPlan:
        """``stage`` after its checks, with the step's plan (``plan(N, min_padded_size)``)."""
        raise NotImplementedError

    def build(self, padded_size: int) -> None:
        """Device work of the step staged last: writes the buffers' token rows
        [0, padded_size) (and request rows [0, padded_size // q)) in place; rows past the
        staged N become dummy rows. Capturable in a CUDA graph for the device backend, with
        the real N read from device memory, so one capture serves every N <= padded_size.

        Raises:
            TypeError, ValueError: ``padded_size`` is not an int multiple of q in
                [N * q, max_num_reqs * q] (:meth:`check_build`); nothing is launched.
        """
        raise NotImplementedError

    def check_build(self, padded_size) -> int:
        """``padded_size`` as a Python int, checked against the rule of :meth:`build`: a padded
        size the buffers hold (``DecodeBuffers.check_padded_size``) that covers the N * q real
        token rows of the step staged last (N = ``prev_num_reqs``): a smaller one would leave
        real rows unbuilt, and the next step would carry them from dummy rows (their KV
        written into the null block).

        Raises:
            TypeError: not an int.
            ValueError: out of range, not a multiple of q, or below N * q (the value named).
        """
        b, n = self.buffers, self.packer.prev_num_reqs
        q = b.uniform_decode_query_len
        if type(padded_size) is int and n * q <= padded_size <= b.max_num_reqs * q \
                and padded_size % q == 0:  # the per-step case, without a call
            return padded_size
        v = b.check_padded_size(padded_size, lo=0)  # the type, the range, q
        if v < n * q:
            raise ValueError(f"build: padded_size {v} is below the {n * q} real token rows of "
                             f"the step staged last (N = {n}): build the step's "
                             f"plan.padded_size")
        return v

    def prepare(self, step: DecodeStep) -> StepMetadata:
        """Stage and build one step; returns views padded to the step's bucket."""
        plan = self.stage(step)
        self.build(plan.padded_size)
        return self.metadata(plan)

    def metadata(self, plan: StepPlan) -> StepMetadata:
        """Views of the buffers for ``plan`` (memoised: views are made once per size)."""
        key = (plan.num_reqs, plan.padded_size)
        md = self._metadata.get(key)
        if md is None:
            md = self._metadata[key] = self.buffers.views(plan.num_reqs, plan.padded_size)
        return md

    def observe_accepted(self, accepted, steps_ago: int) -> None:
        """Hand the packer the exact accepted counts of an earlier step (q > 1).

        With draft tokens a carried row advances by its accepted count (1 + accepted drafts,
        in [1, q]), which the device knows at once and the host one step late. Until the counts
        of a step arrive, the packer's mirror advances each row by q, every draft accepted: an
        upper bound, so validation asks for the blocks of that worst case (the scheduler
        allocates them; vLLM does the same for its draft slots). Giving the counts tightens the
        mirror to the exact positions.

        Args:
            accepted: int32 numpy [P], the counts of each row of that step, in [1, q]
                (``buffers.accepted[:P]`` copied back).
            steps_ago: 0 for the last staged step (a synchronous engine, before staging the
                next), 1 for the one before (an overlapped engine, which reads step t - 1's
                output while step t runs). Call it for every step, with one of the two, or the
                bound drifts by q - count per step and valid steps are refused.

        Raises:
            ValueError: a wrong length, a count outside [1, q], steps_ago not 0 or 1 (nothing
                changed).
        """
        self.packer.apply_accepted(accepted, steps_ago)

    @property
    def prev_num_reqs(self) -> int:
        """Request rows N of the step staged last (the rows a carried row of the next step can
        come from); 0 before the first step, after a step of N = 0 and after :meth:`reset`."""
        return self.packer.prev_num_reqs

    @property
    def stream(self):
        """The ``torch.cuda.Stream`` that ``stage`` enqueues its device work on, or None: here
        (the host-built backend) the stream current at each ``stage`` (its copies go there,
        and ``build`` makes the stream current at the build wait for them), or no stream at
        all (CPU buffers). The device backend overrides it."""
        return None

    def reset(self) -> None:
        """Forget the previous step, on the host: every row of the next step must be new (a
        runner calls it between runs, or after a step that zos did not stage, such as a
        prefill, so that the next step's rows come with their payloads). The buffers and the
        device are not touched; the next step rewrites every row it covers."""
        self.packer.reset()
