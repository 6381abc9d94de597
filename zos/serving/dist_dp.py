"""Data parallelism (DP): every rank its own requests, engine and backend, a full model.

:class:`DPRunner` wraps a rank's runner; before each decode step the ranks agree on the padded
size, the largest of their buckets, with one element-wise max of three int64 (the local bucket,
whether the rank still has work, and a failed rank, if any) through an
:class:`~zos.serving.dist_transport.Agreement`: per-rank slots in shared memory on one host
(each rank writes its slot and reads everyone's: no collective, a few microseconds when the
ranks arrive together), ``all_reduce(MAX)`` on the gloo host group across hosts. Each rank
then stages its step with that ``min_padded_size`` and picks its graph on the host. A rank with
no decode in an engine step runs a dummy step (N = 0, all dummy rows) of the agreed size, so
all ranks replay graphs of one size in lockstep, as DP ranks of vLLM and SGLang do before an
expert-parallel layer. :func:`dp_generate` is that loop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from zos.serving.dist_context import DistContext
from zos.serving.dist_transport import Agreement
from zos.serving.shm_ring import PeerRankFailed
from zos.step import DecodeStep


@dataclass
class DPStats:
    """Per engine step of :func:`dp_generate`: ``local`` (this rank's own padded size, 0
    without a decode), ``agreed`` (the size every rank ran, 0: nobody decoded), ``dummy``
    (whether this rank ran a dummy step), ``agree_us`` (host us of the agreement)."""

    local: list[int] = field(default_factory=list)
    agreed: list[int] = field(default_factory=list)
    dummy: list[bool] = field(default_factory=list)
    agree_us: list[float] = field(default_factory=list)


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
    timeout. ``collective_failed`` records that the agreement itself raised (then no flagged
    agreement is tried). ``transport`` ("auto", "shm", "collective") and ``timeout_s``: see
    :class:`~zos.serving.dist_transport.Agreement` (its setup is collective: every rank builds
    its DPRunner at the same time); ``agreement.kind`` says which one runs.
    """

    def __init__(self, runner, ctx: DistContext, *, transport: str = "auto",
                 timeout_s: float = 300.0) -> None:
        self.runner, self.ctx, self.stats = runner, ctx, DPStats()
        self.agreement = Agreement(ctx, transport=transport, timeout_s=timeout_s)
        self.decoded, self.any_active, self.collective_failed = False, True, False

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def agree(self, local: int, active: bool, *, failed: bool = False) -> tuple[int, bool]:
        """One element-wise max over the ranks of (local padded size, active, failed rank + 1
        or 0) (``self.agreement``: shared memory or ``all_reduce(MAX)``): the padded size every
        rank runs and whether any rank still has work. An agreement that carries a failure is
        not recorded in ``stats``.

        Raises:
            PeerRankFailed: another rank reported a failed engine step, or (shared memory) it
                exited or did not agree within ``timeout_s`` (``collective_failed``).
            RuntimeError: the collective itself failed or timed out (``collective_failed``).
        """
        t0 = time.perf_counter()
        try:
            got = self.agreement.all_max((local, int(active),
                                          self.ctx.rank + 1 if failed else 0))
        except Exception:
            self.collective_failed = True
            raise
        padded, self.any_active, failed_rank = int(got[0]), bool(got[1]), int(got[2])
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
        self.agreement.abort()


def dp_generate(engine, requests, ctx: DistContext, *, transport: str = "auto",
                timeout_s: float = 300.0) -> tuple[dict, DPStats]:
    """Run this rank's ``requests`` on ``engine`` in lockstep with the other DP ranks (each
    calls it with its own engine and requests; one agreement per engine step, see
    :class:`DPRunner`, which wraps ``engine.runner`` here). Returns ``({req_id: tokens},
    stats)``. ``transport``, ``timeout_s``: of the DPRunner made here (see :class:`DPRunner`).

    Raises:
        PeerRankFailed: another rank's engine step raised (or, shared memory, it exited).
        Exception: this rank's own engine-step error, after the other ranks were told
            (:meth:`DPRunner.report_failure`).
    """
    if not isinstance(engine.runner, DPRunner):
        engine.runner = DPRunner(engine.runner, ctx, transport=transport, timeout_s=timeout_s)
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
