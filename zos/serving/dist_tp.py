"""Tensor parallelism (TP): every rank decodes the same batch over its shard of the model.

Rank 0 runs the :class:`~zos.serving.engine.Engine` (scheduler, KV block allocator, readback)
and its runner is wrapped in :class:`TPLeader`, which publishes each runner call (prefill
sequences, or the ``DecodeStep`` and its ``min_padded_size``) to the followers before running
it, through a :class:`~zos.serving.dist_transport.StepChannel`: a shared-memory ring of flat
int arrays on one host, ``broadcast_object_list`` across hosts. The other ranks build the same
Engine (so the same KV cache shape, buffers, metadata backend and graphs) but never schedule:
:func:`tp_follow` replays the calls on their runner. Every rank therefore stages the same
``DecodeStep`` into its own zos backend and prep kernels build its own metadata buffers; the
sampled tokens the device backend reads for carried rows are each rank's own, equal because the
logits are (all-reduced hidden states, replicated lm_head). Broadcasting the step rather than
deriving it on every rank keeps one scheduler: nothing host-side (eos, preemption) can diverge.

Speculative decoding: the accepted counts of a step are equal on every rank too (equal logits,
equal drafts), but only rank 0's engine reads them back; :func:`tp_generate` wraps rank 0's
``engine.backend`` so that each ``observe_accepted`` is published as well and every follower's
packer gets the same counts, with the same ``steps_ago``, between the same two steps.

Failures: a follower that exits or fails makes rank 0 raise
:class:`~zos.serving.shm_ring.PeerRankFailed` naming it (at the ring, within its timeout, or
when a collective of the model errors because the peer is gone); a failed rank 0 marks the
ring, and the followers stop with PeerRankFailed too.
"""
from __future__ import annotations

import time

from zos.serving.dist_context import DistContext, compare_metadata
from zos.serving.dist_transport import StepChannel
from zos.serving.shm_ring import PeerRankFailed
from zos.step import DecodeStep


class TPLeader:
    """Rank 0's runner under TP: publishes each call, then runs it on the wrapped runner.

    Every other attribute is the wrapped :class:`~zos.serving.runner.GraphRunner`'s, so the
    Engine uses it unchanged (``engine.runner = TPLeader(engine.runner, ctx)``; the
    followers call :func:`tp_follow` at the same time: the channel's setup is collective).
    ``stop()`` releases the followers; ``broadcast_us`` (host us per published call) and
    ``checksums`` (per decode step, every rank's digest, with ``check_metadata``) are recorded.
    ``transport``, ``timeout_s``: see :class:`~zos.serving.dist_transport.StepChannel`;
    ``channel.kind`` says which one runs ("shm" or "collective").

    Raises (each call): PeerRankFailed when a follower exited or failed; what the runner raises.
    """

    def __init__(self, runner, ctx: DistContext, *, check_metadata: bool = False,
                 transport: str = "auto", timeout_s: float = 300.0) -> None:
        self.runner, self.ctx, self.check_metadata = runner, ctx, check_metadata
        self.channel = StepChannel(ctx, runner.buffers, transport=transport,
                                   timeout_s=timeout_s)
        self.broadcast_us: list[float] = []
        self.checksums: list[list[str]] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _send(self, op: tuple) -> None:
        t0 = time.perf_counter()
        self.channel.publish(op)
        self.broadcast_us.append((time.perf_counter() - t0) * 1e6)

    def _guard(self, fn, *args, **kw):
        """Run one call; an error while a follower is gone becomes PeerRankFailed."""
        try:
            return fn(*args, **kw)
        except PeerRankFailed:
            raise
        except Exception as e:
            peer = self.channel.peer_failure()
            if peer is not None:
                raise peer from e
            raise

    def decode(self, step: DecodeStep, *, min_padded_size: int = 0):
        """Publish, then ``GraphRunner.decode`` (same arguments, same result)."""
        def run():
            self._send(("decode", step, min_padded_size))
            res = self.runner.decode(step, min_padded_size=min_padded_size)
            if self.check_metadata:
                compare_metadata(self.runner.buffers, self.ctx, self.checksums)
            return res

        return self._guard(run)

    def prefill(self, seqs):
        """Publish, then ``GraphRunner.prefill`` (same arguments, same result)."""
        seqs = [(list(t), list(b)) for t, b in seqs]

        def run():
            self._send(("prefill", seqs))
            return self.runner.prefill(seqs)

        return self._guard(run)

    def observe_accepted(self, accepted, steps_ago: int) -> None:
        """Publish a step's accepted counts (speculative decoding; the engine's backend calls
        this through :class:`AcceptedForwarder`); the caller hands them to its own backend."""
        self._guard(self._send, ("accepted", accepted, steps_ago))

    def stop(self) -> None:
        """Tell the followers that no call follows (they return from :func:`tp_follow`)."""
        self._guard(self._send, ("stop",))
        self.channel.close()

    def abort(self) -> None:
        """Rank 0 failed: the followers waiting on the ring stop with PeerRankFailed."""
        self.channel.abort()


class AcceptedForwarder:
    """Rank 0's ``engine.backend`` under TP with draft tokens: ``observe_accepted`` is
    published to the followers (:meth:`TPLeader.observe_accepted`), then applied; every other
    attribute is the backend's."""

    def __init__(self, backend, leader: TPLeader) -> None:
        self.backend, self.leader = backend, leader

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def observe_accepted(self, accepted, steps_ago: int) -> None:
        """As ``MetadataBackend.observe_accepted``, on every rank."""
        self.leader.observe_accepted(accepted, steps_ago)
        self.backend.observe_accepted(accepted, steps_ago)


def tp_follow(runner, ctx: DistContext, *, check_metadata: bool = False,
              transport: str = "auto", timeout_s: float = 300.0) -> list[list[str]]:
    """A follower rank's loop: run each call rank 0's :class:`TPLeader` publishes on
    ``runner`` (and hand published accepted counts to ``runner.backend``) until it stops.
    Returns the checksums seen (with ``check_metadata``, which must match the leader's).
    ``transport``, ``timeout_s``: as the leader's.

    Raises:
        PeerRankFailed: rank 0 failed or exited (or, on the ring, sent nothing within
            ``timeout_s``).
        Exception: this rank's own runner error (rank 0 is told through the ring).
    """
    channel = StepChannel(ctx, runner.buffers, transport=transport, timeout_s=timeout_s)
    log: list[list[str]] = []
    try:
        while True:
            op = channel.receive()
            if op[0] == "stop":
                return log
            if op[0] == "decode":
                runner.decode(op[1], min_padded_size=op[2])
                if check_metadata:
                    compare_metadata(runner.buffers, ctx, log)
            elif op[0] == "accepted":
                runner.backend.observe_accepted(op[1], op[2])
            else:
                runner.prefill(op[1])
    except PeerRankFailed:
        raise
    except Exception as e:
        channel.abort()
        peer = channel.peer_failure()
        if peer is not None:
            raise peer from e
        raise
    finally:
        channel.close()


def tp_generate(engine, requests, ctx: DistContext, *, check_metadata: bool = False,
                transport: str = "auto", timeout_s: float = 300.0):
    """Run ``requests`` under TP: rank 0 schedules (``engine.run``) and returns its
    ``RunResult`` and its :class:`TPLeader`; other ranks follow and return ``(None, log)``.
    Every rank must call it with an Engine of the same config over its shard. With draft
    tokens, rank 0's ``engine.backend`` is wrapped (:class:`AcceptedForwarder`) for the run.

    Raises:
        ValueError: an unknown ``transport``, or "shm" across hosts (every rank).
        PeerRankFailed: another rank failed or exited.
    """
    if ctx.rank != 0:
        return None, tp_follow(engine.runner, ctx, check_metadata=check_metadata,
                               transport=transport, timeout_s=timeout_s)
    runner, backend = engine.runner, engine.backend
    leader = engine.runner = TPLeader(runner, ctx, check_metadata=check_metadata,
                                      transport=transport, timeout_s=timeout_s)
    if engine.spec is not None:
        engine.backend = AcceptedForwarder(backend, leader)
    try:
        result = engine.run(requests)
    except BaseException:
        leader.abort()
        leader.channel.close()
        raise
    finally:
        engine.runner, engine.backend = runner, backend
    leader.stop()
    return result, leader
