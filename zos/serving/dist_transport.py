"""How rank 0's step reaches the TP followers, and how DP ranks agree: shared memory on one
host, ``torch.distributed`` (the gloo host group) across hosts.

``transport``: "auto" (shared memory when every rank runs on this host, i.e. the same host
name and boot id, else the collective), "shm" (shared memory, ValueError across hosts) or
"collective" (``broadcast_object_list`` of the call for TP, ``all_reduce(MAX)`` of three int64
for DP, as across hosts). Setting a transport up is collective over the world's host group:
every rank must make the same call. If the shared-memory file cannot be made or attached on
some rank (e.g. containers with separate /dev/shm), "auto" falls back to the collective on
every rank and "shm" raises RuntimeError on every rank.
"""
from __future__ import annotations

import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist

from zos.serving import step_codec as codec
from zos.serving.shm_agreement import SlotAgreement
from zos.serving.shm_ring import (
    FAILED,
    PeerRankFailed,
    ShmSegment,
    StepRing,
    pid_alive,
)

TRANSPORTS = ("auto", "shm", "collective")


def host_id() -> str:
    """This machine: host name and boot id (two containers of one name differ in neither)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def default_spin_s(ctx) -> float:
    """How long a shared-memory wait spins before it sleeps: 50 ms beside a GPU (the host has
    cores to spare, and waking from a sleep takes tens of microseconds: the whole budget), 1 ms
    on a CPU (the ranks compute on the cores a spinning wait would take)."""
    return 0.05 if ctx.device.type == "cuda" else 0.001


def check_transport(transport) -> str:
    """ValueError unless ``transport`` is one of TRANSPORTS."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
    return transport


class _Peers:
    """Every rank's host and pid (gathered once): which peers can be watched for liveness."""

    def __init__(self, ctx) -> None:
        got = [None] * ctx.world_size
        dist.all_gather_object(got, (host_id(), os.getpid()), group=ctx.cpu_group)
        self.rank, self.hosts, self.pids = ctx.rank, [h for h, _ in got], [p for _, p in got]
        self.same_host = len(set(self.hosts)) == 1

    def dead(self, what: str, seg: ShmSegment | None, grace_s: float) -> PeerRankFailed | None:
        """A PeerRankFailed for a peer of this host that exited (or, with a segment, marked
        itself failed) within ``grace_s``, else None."""
        mine = self.hosts[self.rank]
        peers = [r for r in range(len(self.pids)) if r != self.rank and self.hosts[r] == mine]
        end = time.monotonic() + grace_s
        while True:
            if seg is not None:
                try:
                    seg.check_peers(peers)
                except PeerRankFailed as e:
                    return e
            for r in peers:
                if not pid_alive(self.pids[r]):
                    return PeerRankFailed(f"{what}: rank {r} (pid {self.pids[r]}) exited; rank "
                                          f"{self.rank} stops too", r)
            if time.monotonic() >= end:
                return None
            time.sleep(0.05)


def _open_segment(ctx, transport: str, peers: _Peers, create, attach, what: str):
    """The shared-memory segment of this rank, or None for the collective (see the module
    docstring); collective over the host group."""
    if transport == "collective" or (transport == "auto" and not peers.same_host):
        return None
    if not peers.same_host:
        raise ValueError(f"{what}: transport 'shm' needs every rank on one host, got hosts "
                         f"{sorted(set(peers.hosts))}")
    seg, err, box = None, None, [None]
    if ctx.rank == 0:
        try:
            seg = create()
            box[0] = seg.path
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(box, src=0, group=ctx.cpu_group)
    if ctx.rank and box[0] is not None:
        try:
            seg = attach(box[0])
        except (OSError, ValueError) as e:
            err = f"{type(e).__name__}: {e}"
    errs = [None] * ctx.world_size
    dist.all_gather_object(errs, err if box[0] is not None or ctx.rank == 0 else "no file",
                           group=ctx.cpu_group)
    if ctx.rank == 0 and seg is not None:
        seg.unlink()  # every rank attached (or gave up): the name is no longer needed
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if not bad:
        return seg
    if seg is not None:
        seg.close()
    if transport == "shm":
        raise RuntimeError(f"{what}: shared memory failed on rank {bad[0][0]}: {bad[0][1]}")
    return None


def step_slot_bytes(buffers) -> int:
    """Bytes of the largest runner call over ``buffers`` (R = max_num_reqs rows, W =
    max_num_blocks_per_req, block size bs), as :mod:`~zos.serving.step_codec` lays it out: a
    decode step of R new rows with W blocks each and at most R * W appended blocks, 8 R + 4 (4 R
    + 1 + 3 R W); a prefill of R sequences of W * bs tokens and W blocks, 4 (2 R + R W (bs + 1)).
    """
    r, w = buffers.max_num_reqs, buffers.max_num_blocks_per_req
    return max(8 * r + 4 * (4 * r + 1 + 3 * r * w),
               4 * (2 * r + r * w * (buffers.block_size + 1)))


class StepChannel:
    """Rank 0's runner calls to its TP followers: a :class:`StepRing` or the collective.

    Args:
        ctx: this rank's DistContext (the TP group is the whole world).
        buffers: the runner's DecodeBuffers: they bound a message (``max_num_reqs`` rows of
            ``max_num_blocks_per_req`` blocks, prefill of as many tokens each).
        transport: see the module docstring. timeout_s: bound of any ring wait.
        num_slots: ring slots (rank 0 runs at most this many calls ahead of a follower).
        spin_s: how long a ring wait spins (None: :func:`default_spin_s`).

    Raises:
        ValueError: an unknown transport, or "shm" across hosts. RuntimeError: "shm" and the
            file failed on some rank.
    """

    what = "tensor parallelism"

    def __init__(self, ctx, buffers, *, transport: str = "auto", timeout_s: float = 300.0,
                 num_slots: int = 4, spin_s: float | None = None) -> None:
        check_transport(transport)
        self.ctx, self.peers = ctx, _Peers(ctx)
        slot = step_slot_bytes(buffers)
        kw = dict(what=self.what, timeout_s=timeout_s,
                  spin_s=default_spin_s(ctx) if spin_s is None else spin_s)
        self.ring: StepRing | None = _open_segment(
            ctx, transport, self.peers,
            lambda: StepRing.create(ctx.world_size, num_slots, slot, **kw),
            lambda p: StepRing(p, ctx.rank, ctx.world_size, **kw), self.what)
        self.kind = "shm" if self.ring is not None else "collective"

    def publish(self, op: tuple) -> None:
        """Rank 0: send one call: ``("decode", step, min_padded_size)``, ``("prefill",
        seqs)``, ``("accepted", counts, steps_ago)`` or ``("stop",)``.

        Raises: PeerRankFailed (ring), what the collective raises."""
        if self.ring is None:
            dist.broadcast_object_list([op], src=0, group=self.ctx.cpu_group)
            return
        if op[0] == "decode":
            msg = codec.encode_decode(op[1], op[2])
        elif op[0] == "prefill":
            msg = codec.encode_prefill(op[1])
        elif op[0] == "accepted":
            msg = codec.encode_accepted(op[1], op[2])
        else:
            msg = (codec.STOP, (), [])
        try:
            self.ring.publish(*msg)
        except OverflowError:  # bigger than a slot (not with the runner's own bounds)
            self.ring.publish(codec.OVERFLOW, (), [])
            dist.broadcast_object_list([op], src=0, group=self.ctx.cpu_group)

    def receive(self) -> tuple:
        """A follower: the next call (as :meth:`publish` took it).

        Raises: PeerRankFailed (ring: rank 0 failed, exited or went silent), what the
            collective raises."""
        if self.ring is not None:
            kind, args, payload = self.ring.receive()
            if kind != codec.OVERFLOW:
                return codec.decode_message(kind, args, payload)
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.ctx.cpu_group)
        return box[0]

    def peer_failure(self, grace_s: float = 1.0) -> PeerRankFailed | None:
        """After an error: a PeerRankFailed if a rank of this host exited or (ring) marked
        itself failed within ``grace_s``, else None (the error was this rank's own)."""
        return self.peers.dead(self.what, self.ring, grace_s)

    def abort(self) -> None:
        """This rank failed: peers waiting on the ring stop with PeerRankFailed at once."""
        if self.ring is not None:
            self.ring.set_state(FAILED)

    def close(self) -> None:
        """Unmap the ring (the file was unlinked at setup)."""
        if self.ring is not None:
            self.ring.close()
            self.ring = None


class Agreement:
    """The DP ranks' element-wise max of three int64 per engine step: a
    :class:`SlotAgreement` or ``all_reduce(MAX)`` on the host group (arguments and errors as
    :class:`StepChannel`)."""

    what = "data parallelism"

    def __init__(self, ctx, *, transport: str = "auto", timeout_s: float = 300.0,
                 spin_s: float | None = None) -> None:
        check_transport(transport)
        self.ctx, self.peers = ctx, _Peers(ctx)
        kw = dict(what=self.what, timeout_s=timeout_s,
                  spin_s=default_spin_s(ctx) if spin_s is None else spin_s)
        self.slots: SlotAgreement | None = _open_segment(
            ctx, transport, self.peers, lambda: SlotAgreement.create(ctx.world_size, **kw),
            lambda p: SlotAgreement(p, ctx.rank, ctx.world_size, **kw), self.what)
        self.kind = "shm" if self.slots is not None else "collective"
        self._t = torch.zeros(3, dtype=torch.int64)

    def all_max(self, values) -> np.ndarray:
        """Element-wise max of every rank's three ints (int64 [3]).

        Raises: PeerRankFailed (shared memory), what the collective raises."""
        if self.slots is not None:
            return self.slots.all_max(values)
        self._t[0], self._t[1], self._t[2] = values
        dist.all_reduce(self._t, op=dist.ReduceOp.MAX, group=self.ctx.cpu_group)
        return self._t.numpy().copy()

    def abort(self) -> None:
        """This rank failed: peers waiting on it stop with PeerRankFailed at once."""
        if self.slots is not None:
            self.slots.set_state(FAILED)

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None
