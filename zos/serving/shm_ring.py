"""Shared memory between the ranks of one host: the segment, and the step ring of TP.

Both live in one file under ``/dev/shm`` (a tmpfs) that every rank maps: rank 0 creates it, the
others attach, and rank 0 unlinks it once all are attached, so nothing is left behind if a
process dies. The file starts with a control block of int64 words:

* words 0-3: magic, world size, slot count, slot payload bytes;
* per rank r (one 64-byte line each): its pid, its state (:data:`RUNNING`, :data:`DONE`,
  :data:`FAILED`) and its ack (the last ring message it has read).

:class:`StepRing` (one writer, rank 0; every other rank a reader) then holds ``num_slots``
slots, each a 64-byte header of int64 words (sequence number, kind, payload bytes, five
kind-specific ints) and a payload of flat integer arrays. Message i (1, 2, ...) goes to slot
(i - 1) mod num_slots. The writer reuses a slot only once every reader's ack has reached the
message it held, writes the payload and the header words, then, after a memory fence, the
sequence number; a reader waits for the sequence number, copies the payload out, fences and
acks. No slot is ever written while a reader may be reading it, so there is no torn read to
detect (vLLM's ``MessageQueue`` uses the same written-flag / read-flags protocol).

The DP agreement over the same kind of segment is :mod:`zos.serving.shm_agreement`.

Every wait is bounded: it spins (``os.sched_yield``) for ``spin_s``, then sleeps in short
steps, checks every ``CHECK_S`` that the ranks it waits for are alive (their pid, zombies
included) and have not marked themselves :data:`FAILED`, and gives up after ``timeout_s``:
each of those raises :class:`PeerRankFailed` naming the rank.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
import uuid

import numpy as np

from zos._checks import check_int

MAGIC = 0x7A6F_7373_686D_0001  # "zosshm" v1
RUNNING, DONE, FAILED = 1, 2, 3
LINE = 64  # bytes: one cache line per rank / slot header, no false sharing
CHECK_S = 0.02  # seconds between liveness checks while waiting
SHM_DIR = "/dev/shm"

_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier: a lock acquire and release (a pthread mutex, i.e. atomic
    read-modify-write instructions). Orders the payload stores before the sequence-number
    store on weakly ordered CPUs (Arm); on x86 stores are not reordered with each other."""
    _FENCE.acquire()
    _FENCE.release()


class PeerRankFailed(RuntimeError):
    """Another rank failed, exited, or did not answer in time; ``rank`` names it (None when
    unknown). Raised instead of waiting for a collective that cannot complete."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs: trust kill(0)
    return state not in (b"Z", b"X")


class ShmSegment:
    """The mapped file and its control block (see the module docstring).

    Args:
        path: the file; rank 0 creates it with ``size`` bytes, other ranks attach.
        rank, world_size: this process's place; ``world_size`` >= 2.
        size: total bytes (rank 0 only; others read it from the file).
        what: "tensor parallelism" / "data parallelism", for messages.
        timeout_s: how long a wait may last before :class:`PeerRankFailed`.
        spin_s: how long a wait spins before it sleeps.
        num_slots, slot_bytes: rank 0 writes them into the control block (a ring's shape;
            0 for the agreement); other ranks read them from it.

    Raises:
        ValueError: world_size < 2, rank outside [0, world_size), or a file that is not one.
        OSError: the file cannot be created or opened.
    """

    def __init__(self, path: str, rank: int, world_size: int, size: int = 0, *,
                 what: str = "ranks", timeout_s: float = 300.0, spin_s: float = 0.05,
                 num_slots: int = 0, slot_bytes: int = 0) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"shared memory: need world_size >= 2 and rank in [0, world_size), "
                             f"got rank {rank} of {world_size}")
        self.path, self.rank, self.world_size, self.what = path, rank, world_size, what
        self.timeout_s, self.spin_s = float(timeout_s), float(spin_s)
        if rank == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
            size = os.fstat(fd).st_size
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self._mm, np.uint8)
        self.ctl = self.buf[:self.data_offset(world_size)].view(np.int64)
        if rank == 0:
            self.ctl[1:4] = world_size, num_slots, slot_bytes
            fence()
            self.ctl[0] = MAGIC
        elif self.ctl[0] != MAGIC or self.ctl[1] != world_size:
            raise ValueError(f"shared memory: {path} is not a zos segment of {world_size} ranks")
        self.num_slots, self.slot_bytes = int(self.ctl[2]), int(self.ctl[3])
        w = self._rank_words(rank)
        self.ctl[w + 1] = RUNNING
        self.ctl[w] = os.getpid()

    @staticmethod
    def data_offset(world_size: int) -> int:
        """Bytes of the control block: one line of header, one line per rank."""
        return LINE * (1 + world_size)

    @staticmethod
    def _rank_words(r: int) -> int:
        return (LINE * (1 + r)) // 8

    @staticmethod
    def new_path() -> str:
        """A fresh file name under /dev/shm (the temp directory where there is none)."""
        import tempfile

        d = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
        return os.path.join(d, f"zos-{os.getpid()}-{uuid.uuid4().hex[:12]}")

    def unlink(self) -> None:
        """Remove the file name (the mappings stay valid); rank 0, once all ranks attached."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def pid(self, r: int) -> int:
        """Rank ``r``'s process id (0 before it attached)."""
        return int(self.ctl[self._rank_words(r)])

    def state(self, r: int) -> int:
        """Rank ``r``'s state: 0 (not attached), RUNNING, DONE or FAILED."""
        return int(self.ctl[self._rank_words(r) + 1])

    def set_state(self, state: int) -> None:
        """Mark this rank DONE or FAILED (peers waiting on it stop with PeerRankFailed)."""
        self.ctl[self._rank_words(self.rank) + 1] = state

    def check_peers(self, ranks) -> None:
        """PeerRankFailed for the first of ``ranks`` that marked itself FAILED or whose
        process is gone."""
        for r in ranks:
            st, pid = self.state(r), self.pid(r)
            if st == FAILED:
                raise PeerRankFailed(f"{self.what}: rank {r} failed; rank {self.rank} stops "
                                     f"too", r)
            if pid and not pid_alive(pid):
                raise PeerRankFailed(f"{self.what}: rank {r} (pid {pid}) exited; rank "
                                     f"{self.rank} stops too", r)

    def wait(self, ready, waiting_for, doing: str) -> None:
        """Return once ``ready()`` is true. ``waiting_for()`` lists the ranks it still waits
        for (checked for failure and liveness every CHECK_S; the first is named on timeout).

        Raises:
            PeerRankFailed: a rank waited for failed or exited, or ``timeout_s`` passed.
        """
        if ready():
            return
        t0 = time.monotonic()
        check = t0 + CHECK_S
        while not ready():
            now = time.monotonic()
            if now - t0 < self.spin_s:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, (now - t0) * 0.01))
            if now >= check:
                late = waiting_for()
                self.check_peers(late)
                if now - t0 > self.timeout_s:
                    r = late[0] if late else None
                    raise PeerRankFailed(f"{self.what}: rank {r} did not {doing} within "
                                         f"{self.timeout_s:g} s (lagging or hung); rank "
                                         f"{self.rank} stops", r)
                check = now + CHECK_S

    def close(self) -> None:
        """Drop the mapping (views of it must be gone)."""
        self.buf = self.ctl = self._heads = self._payloads = self.slots = None
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere: the GC unmaps it later
            pass


class StepRing(ShmSegment):
    """The TP ring: rank 0 :meth:`publish` es, every other rank :meth:`receive` s, in order.

    ``num_slots`` slots of ``slot_bytes`` payload (rank 0 sets them; see :meth:`size`).
    """

    HEADER_WORDS = LINE // 8  # seq, kind, nbytes, args[5]
    MAX_ARGS = 5

    @classmethod
    def size(cls, world_size: int, num_slots: int, slot_bytes: int) -> int:
        """Bytes of a ring file."""
        return cls.data_offset(world_size) + num_slots * (LINE + slot_bytes)

    @classmethod
    def create(cls, world_size: int, num_slots: int, slot_bytes: int, **kw) -> StepRing:
        """Rank 0: a new ring file (see :class:`ShmSegment` for ``kw``). TypeError unless
        num_slots and slot_bytes are ints, ValueError unless num_slots >= 1, slot_bytes >= 0."""
        num_slots = check_int("num_slots", num_slots)
        slot_bytes = check_int("slot_bytes", slot_bytes, 0)
        slot_bytes = -(-slot_bytes // LINE) * LINE
        return cls(cls.new_path(), 0, world_size, cls.size(world_size, num_slots, slot_bytes),
                   num_slots=num_slots, slot_bytes=slot_bytes, **kw)

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.next_seq = 1  # writer: next message to publish; reader: next to receive
        self.readers = list(range(1, self.world_size))
        self._acks = [self._rank_words(r) + 2 for r in self.readers]
        self._states = [self._rank_words(r) + 1 for r in self.readers]
        base, size = self.data_offset(self.world_size), LINE + self.slot_bytes
        offs = [base + i * size for i in range(self.num_slots)]
        self._heads = [self.buf[o:o + LINE].view(np.int64) for o in offs]
        self._payloads = [self.buf[o + LINE:o + size] for o in offs]

    def _slot(self, seq: int) -> tuple[np.ndarray, np.ndarray]:
        i = (seq - 1) % self.num_slots
        return self._heads[i], self._payloads[i]

    def _lagging(self, seq: int) -> list[int]:
        return [r for r, w in zip(self.readers, self._acks) if self.ctl[w] < seq]

    def publish(self, kind: int, args, arrays) -> None:
        """Rank 0: write one message: ``kind`` (int > 0), up to 5 ints ``args`` and the
        ``arrays`` (contiguous numpy arrays, written back to back). Waits (bounded) for the
        slot to be free.

        Raises:
            OverflowError: the arrays do not fit a slot (nothing written).
            PeerRankFailed: a reader failed, exited or lagged past ``timeout_s``.
        """
        nbytes = sum(a.nbytes for a in arrays)
        if nbytes > self.slot_bytes:
            raise OverflowError(f"{nbytes} bytes do not fit a ring slot of {self.slot_bytes}")
        seq = self.next_seq
        free = seq - self.num_slots  # every reader must have read the slot's old message
        if free > 0:
            ctl, acks = self.ctl, self._acks
            if min(ctl[w] for w in acks) < free:
                self.wait(lambda: min(ctl[w] for w in acks) >= free,
                          lambda: self._lagging(free), f"read message {free}")
        for r, w in zip(self.readers, self._states):  # a reader's own error: stop now
            if self.ctl[w] == FAILED:
                self.check_peers([r])
        head, payload = self._slot(seq)
        if arrays:
            np.concatenate([a.view(np.uint8) for a in arrays], out=payload[:nbytes])
        head[1], head[2] = kind, nbytes
        head[3:3 + len(args)] = args
        fence()
        head[0] = seq
        self.next_seq = seq + 1

    def receive(self) -> tuple[int, list, np.ndarray]:
        """A reader: the next message as ``(kind, args (5 ints), payload uint8 copy)``;
        waits (bounded) for it.

        Raises:
            PeerRankFailed: rank 0 failed or exited, or nothing came within ``timeout_s``.
        """
        seq = self.next_seq
        head, payload = self._slot(seq)
        if head[0] != seq:
            self.wait(lambda: head[0] == seq, lambda: [0], f"publish message {seq}")
        fence()
        kind, nbytes = int(head[1]), int(head[2])
        args = head[3:3 + self.MAX_ARGS].tolist()
        data = payload[:nbytes].copy()
        fence()
        self.ctl[self._rank_words(self.rank) + 2] = seq
        self.next_seq = seq + 1
        return kind, args, data

    def drain(self) -> None:
        """Rank 0: wait (bounded) until every reader has read every message published."""
        last = self.next_seq - 1
        ctl, acks = self.ctl, self._acks
        self.wait(lambda: min(ctl[w] for w in acks) >= last, lambda: self._lagging(last),
                  f"read message {last}")
