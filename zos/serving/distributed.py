"""Several processes, zos metadata on each: tensor parallelism (TP) and data parallelism (DP).

Process groups: ``init_distributed`` starts ``torch.distributed`` (NCCL on CUDA, one GPU per
rank; gloo on a CPU) and a gloo group on the host for small host-side collectives (the step
broadcasts of TP, the padded-size agreement of DP), so that they never wait for the GPU (vLLM
keeps such a CPU group too).

TP (every rank decodes the same batch over its shard of the model, ``models.parallel``):
rank 0 runs the :class:`~zos.serving.engine.Engine` (scheduler, KV block allocator, readback)
and its runner is wrapped in :class:`TPLeader`, which broadcasts each runner call (prefill
sequences, or the ``DecodeStep`` and its ``min_padded_size``) with ``broadcast_object_list``
on the host group before running it. The other ranks build the same Engine (so the same KV
cache shape, buffers, metadata backend and graphs) but never schedule: :func:`tp_follow`
replays the calls on their runner. Every rank therefore stages the same ``DecodeStep`` into
its own zos backend and prep kernels build its own metadata buffers; the sampled tokens the
device backend reads for carried rows are each rank's own, equal because the logits are
(all-reduced hidden states, replicated lm_head). Broadcasting the step rather than deriving
it on every rank keeps one scheduler: nothing host-side (eos, preemption) can diverge.
``check_metadata`` compares a checksum of every rank's metadata buffers after each decode
step (one ``all_gather_object``; for tests, it syncs the device).

DP (every rank its own requests, engine and backend, a full model): :class:`DPRunner`
wraps a rank's runner; before each decode step the ranks agree on the padded size, the
largest of their buckets, with one ``all_reduce(MAX)`` of three int64 on the host group (the
local bucket, whether the rank still has work, and a failed rank, if any), and each stages its
step with that ``min_padded_size``. A rank with no decode in an engine step runs a dummy step
(N = 0, all dummy rows) of the agreed size, so all ranks replay graphs of one size in lockstep,
as DP ranks of vLLM and SGLang do before an expert-parallel layer. :func:`dp_generate` is that
loop.
"""
from __future__ import annotations

import gc
import hashlib
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from zos.buffers import DecodeBuffers
from zos.step import DecodeStep

CHECKSUM_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
                   "block_table", "counts", "sampled")


@dataclass
class DistContext:
    """This process's place: ``rank`` of ``world_size``, its ``device`` (cuda:LOCAL_RANK or
    cpu), ``backend`` of the default group ("nccl" or "gloo") and ``cpu_group`` (gloo) for
    host-side collectives."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    cpu_group: object


def init_distributed(*, rank: int | None = None, world_size: int | None = None,
                     init_method: str | None = None, device: str | None = None,
                     timeout_s: float = 600.0) -> DistContext:
    """Start ``torch.distributed`` (once per process) and return this rank's context.

    Args:
        rank, world_size, init_method: None under ``torchrun`` (read from RANK, WORLD_SIZE,
            MASTER_ADDR, MASTER_PORT: ``env://``); given by a spawner otherwise (e.g.
            ``file:///tmp/x``).
        device: "cuda" or "cpu"; None picks cuda when available. On CUDA the rank uses GPU
            LOCAL_RANK (default: rank) and NCCL; on a CPU, gloo.
        timeout_s: collective timeout (a rank that died does not hang the others forever).

    Raises:
        ValueError: ``device`` not "cuda"/"cpu", or "cuda" without a GPU.
    """
    if device not in (None, "cuda", "cpu"):
        raise ValueError(f"device must be 'cuda', 'cpu' or None, got {device!r}")
    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but no GPU is visible")
    backend = "nccl" if cuda else "gloo"
    if cuda:  # the GPU first: NCCL's communicator is made on the current device
        local = os.environ.get("LOCAL_RANK", rank if rank is not None else os.environ["RANK"])
        torch.cuda.set_device(int(local))
    if not dist.is_initialized():
        kw = dict(backend=backend, timeout=timedelta(seconds=timeout_s),
                  init_method=init_method or "env://")
        if rank is not None:
            kw.update(rank=rank, world_size=world_size)
        dist.init_process_group(**kw)
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return DistContext(rank, world, dev, backend, cpu_group)


def shutdown_distributed(ctx: DistContext) -> None:
    """Leave ``torch.distributed`` on every rank: collect garbage and synchronize the GPU, so
    that no CUDA graph with an NCCL collective captured in it (the TP decode graphs) outlives
    its communicator, then a barrier on the host group and ``destroy_process_group``. Callers
    drop their engines first. (On 2 x H200, torch 2.11 and NCCL 2.28, a TP rank that destroyed
    the process group with its engine's graphs alive and no barrier hung there.)

    Raises:
        RuntimeError: the barrier timed out (a rank did not reach it) or the group failed."""
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    dist.barrier(group=ctx.cpu_group)
    dist.destroy_process_group()


def metadata_checksum(buffers: DecodeBuffers) -> str:
    """A 64-bit BLAKE2b digest (hex) of the whole of the buffers' ``CHECKSUM_FIELDS`` (every
    row, not only the step's): equal digests mean byte-identical metadata. Syncs the device."""
    h = hashlib.blake2b(digest_size=8)
    for name in CHECKSUM_FIELDS:
        h.update(getattr(buffers, name).cpu().numpy().tobytes())
    return h.hexdigest()


def _check_metadata(buffers: DecodeBuffers, ctx: DistContext, log: list) -> None:
    """Gather every rank's checksum; RuntimeError on all ranks if they differ."""
    got = [None] * ctx.world_size
    dist.all_gather_object(got, metadata_checksum(buffers), group=ctx.cpu_group)
    log.append(got)
    if len(set(got)) != 1:
        raise RuntimeError(f"tensor parallelism: metadata buffers differ across ranks after "
                           f"decode step {len(log)}: checksums {got}")


class TPLeader:
    """Rank 0's runner under TP: broadcasts each call, then runs it on the wrapped runner.

    Every other attribute is the wrapped :class:`~zos.serving.runner.GraphRunner`'s, so the
    Engine uses it unchanged (``engine.runner = TPLeader(engine.runner, ctx)``). ``stop()``
    releases the followers; ``broadcast_us`` (host us per call) and ``checksums`` (per decode
    step, every rank's digest, with ``check_metadata``) are recorded.
    """

    def __init__(self, runner, ctx: DistContext, *, check_metadata: bool = False) -> None:
        self.runner, self.ctx, self.check_metadata = runner, ctx, check_metadata
        self.broadcast_us: list[float] = []
        self.checksums: list[list[str]] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _send(self, op: tuple) -> None:
        t0 = time.perf_counter()
        dist.broadcast_object_list([op], src=0, group=self.ctx.cpu_group)
        self.broadcast_us.append((time.perf_counter() - t0) * 1e6)

    def decode(self, step: DecodeStep, *, min_padded_size: int = 0):
        """Broadcast, then ``GraphRunner.decode`` (same arguments, same result)."""
        self._send(("decode", step, min_padded_size))
        res = self.runner.decode(step, min_padded_size=min_padded_size)
        if self.check_metadata:
            _check_metadata(self.runner.buffers, self.ctx, self.checksums)
        return res

    def prefill(self, seqs):
        """Broadcast, then ``GraphRunner.prefill`` (same arguments, same result)."""
        seqs = [(list(t), list(b)) for t, b in seqs]
        self._send(("prefill", seqs))
        return self.runner.prefill(seqs)

    def stop(self) -> None:
        """Tell the followers that no call follows (they return from :func:`tp_follow`)."""
        self._send(("stop",))


def tp_follow(runner, ctx: DistContext, *, check_metadata: bool = False) -> list[list[str]]:
    """A follower rank's loop: run each call rank 0's :class:`TPLeader` broadcasts on
    ``runner`` until it stops. Returns the checksums seen (with ``check_metadata``, which
    must match the leader's)."""
    log: list[list[str]] = []
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=ctx.cpu_group)
        op = box[0]
        if op[0] == "stop":
            return log
        if op[0] == "decode":
            runner.decode(op[1], min_padded_size=op[2])
            if check_metadata:
                _check_metadata(runner.buffers, ctx, log)
        else:
            runner.prefill(op[1])


def tp_generate(engine, requests, ctx: DistContext, *, check_metadata: bool = False):
    """Run ``requests`` under TP: rank 0 schedules (``engine.run``) and returns its
    ``RunResult`` and its :class:`TPLeader`; other ranks follow and return ``(None, log)``.
    Every rank must call it with an Engine of the same config over its shard.

    Raises:
        ValueError: an engine with draft tokens, on every rank before any collective: the
            accepted counts reach rank 0's packer only (``observe_accepted``), so the other
            ranks' packers would drift; speculative decoding under TP is not supported.
    """
    if engine.spec is not None:
        raise ValueError("tp_generate: speculative decoding under tensor parallelism is not "
                         f"supported (num_draft_tokens={engine.config.num_draft_tokens})")
    if ctx.rank != 0:
        return None, tp_follow(engine.runner, ctx, check_metadata=check_metadata)
    leader = engine.runner = TPLeader(engine.runner, ctx, check_metadata=check_metadata)
    try:
        result = engine.run(requests)
    finally:
        leader.stop()
    return result, leader


@dataclass
class DPStats:
    """Per engine step of :func:`dp_generate`: ``local`` (this rank's own padded size, 0
    without a decode), ``agreed`` (the size every rank ran, 0: nobody decoded), ``dummy``
    (whether this rank ran a dummy step), ``agree_us`` (host us of the agreement)."""

    local: list[int] = field(default_factory=list)
    agreed: list[int] = field(default_factory=list)
    dummy: list[bool] = field(default_factory=list)
    agree_us: list[float] = field(default_factory=list)


class PeerRankFailed(RuntimeError):
    """Raised on every data-parallel rank that learns, at an agreement, that another rank
    failed its engine step (:class:`DPRunner`)."""


class DPRunner:
    """A DP rank's runner: each decode agrees on the padded size first (see the module
    docstring); other attributes are the wrapped GraphRunner's. ``stats`` records each step.

    Every rank's engine must have the same ``max_num_seqs`` and bucket table (the agreed size
    is one of the ranks' own; a size past another rank's buffers raises ValueError there, from
    ``MetadataBackend.stage``), and every rank must make the same number of calls to
    :meth:`decode` plus :meth:`idle_step` (one per engine step: :func:`dp_generate`).

    The agreement also carries a failure flag: a rank whose engine step raised (a step its
    backend refuses, a prefill or read-back error) sends one more agreement flagged as failed
    (:meth:`report_failure`, called by :func:`dp_generate`), and every other rank raises
    :class:`PeerRankFailed` at that agreement, instead of waiting for it until the collective
    timeout. ``collective_failed`` records that the all_reduce itself raised (then no flagged
    agreement is tried).
    """

    def __init__(self, runner, ctx: DistContext) -> None:
        self.runner, self.ctx, self.stats = runner, ctx, DPStats()
        self._t = torch.zeros(3, dtype=torch.int64)
        self.decoded, self.any_active, self.collective_failed = False, True, False

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def agree(self, local: int, active: bool, *, failed: bool = False) -> tuple[int, bool]:
        """One ``all_reduce(MAX)`` of (local padded size, active, failed rank + 1 or 0) on the
        host group: the padded size every rank runs and whether any rank still has work. An
        agreement that carries a failure is not recorded in ``stats``.

        Raises:
            PeerRankFailed: another rank reported a failed engine step.
            RuntimeError: the collective itself failed or timed out (``collective_failed``).
        """
        t0 = time.perf_counter()
        self._t[0], self._t[1] = local, int(active)
        self._t[2] = self.ctx.rank + 1 if failed else 0
        try:
            dist.all_reduce(self._t, op=dist.ReduceOp.MAX, group=self.ctx.cpu_group)
        except Exception:
            self.collective_failed = True
            raise
        padded, self.any_active, failed_rank = int(self._t[0]), bool(self._t[1]), int(self._t[2])
        if failed_rank:
            if failed:
                return padded, self.any_active
            raise PeerRankFailed(f"data parallelism: rank {failed_rank - 1} failed its engine "
                                 f"step; rank {self.ctx.rank} stops too")
        s = self.stats
        s.agree_us.append((time.perf_counter() - t0) * 1e6)
        s.local.append(local)
        s.agreed.append(padded)
        return padded, self.any_active

    def decode(self, step: DecodeStep, *, min_padded_size: int = 0):
        """Agree, then ``GraphRunner.decode`` padded to the agreed size.

        Raises: what :meth:`agree` and ``GraphRunner.decode`` raise."""
        local = max(self.runner.backend.plan(step.num_reqs).padded_size, min_padded_size)
        padded, _ = self.agree(local, True)
        self.decoded = True
        self.stats.dummy.append(False)
        return self.runner.decode(step, min_padded_size=padded)

    def idle_step(self, active: bool) -> None:
        """This rank did not decode this engine step: agree with size 0, then a dummy step
        of the agreed size if another rank decodes.

        Raises: what :meth:`agree` and ``GraphRunner.decode`` raise."""
        padded, _ = self.agree(0, active)
        self.stats.dummy.append(padded > 0)
        if padded:
            self.runner.decode(DecodeStep.build([]), min_padded_size=padded)

    def report_failure(self) -> None:
        """This rank's engine step raised: one agreement flagged as failed, which meets the
        other ranks' current or next agreement (whether the step failed before or after its
        own), so they stop. Nothing is tried if the collective itself failed; an error of the
        flagged agreement (e.g. its timeout) is swallowed: the caller re-raises the original."""
        if self.collective_failed:
            return
        try:
            self.agree(0, True, failed=True)
        except Exception:  # noqa: BLE001, S110 - the original error is what the caller raises
            pass


def dp_generate(engine, requests, ctx: DistContext) -> tuple[dict, DPStats]:
    """Run this rank's ``requests`` on ``engine`` in lockstep with the other DP ranks (each
    calls it with its own engine and requests; one agreement per engine step, see
    :class:`DPRunner`, which wraps ``engine.runner`` here). Returns ``({req_id: tokens},
    stats)``.

    Raises:
        PeerRankFailed: another rank's engine step raised.
        Exception: this rank's own engine-step error, after the other ranks were told
            (:meth:`DPRunner.report_failure`).
    """
    if not isinstance(engine.runner, DPRunner):
        engine.runner = DPRunner(engine.runner, ctx)
    dp = engine.runner
    reqs = sorted(requests, key=lambda r: r.arrival)
    engine.add_requests(reqs)
    while True:
        active = engine.has_unfinished()
        dp.decoded = False
        try:
            if active:
                engine.step()
            if not dp.decoded:
                dp.idle_step(active)
        except PeerRankFailed:
            raise
        except Exception:
            dp.report_failure()
            raise
        if not dp.any_active:
            return {r.req_id: list(r.output) for r in reqs}, dp.stats
