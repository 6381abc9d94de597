"""The zero-copy staging ring: K staging records the prep kernels read where the host wrote
them, and a done word the kernels write back (docs/ZOS.md, "The staging record", "The done
word").

Step n's record goes into slot n mod K. The graph finds it without any per-step upload: the
prep kernels keep a ring state on the device (``zos.kernels.PrepState``: CTR, the slot of
the next new record, and LAST, the SEQ of the last record applied), take slot CTR when its
record's SEQ is the one after LAST and advance CTR and LAST themselves. The host writes
slot k only after the build that last read it has finished. The kernels say so themselves:
the last program of each build writes the SEQ of the record it applied into the done word,
after every program has finished reading the record. ``acquire`` reads the done word: a
slot whose record's SEQ it has reached is free, at the cost of one load and no driver call;
otherwise (the host K steps ahead of the device) it waits for the word, polling a fence that
tells it when a build that never ran (a stage without its build) leaves it waiting for
nothing.

On CUDA the records and the done word live in pinned host memory mapped into the device's
address space (``zos._C.MappedRing``: cuMemHostAlloc with DEVICEMAP, the device address from
cuMemHostGetDevicePointer), driven from C++. Triton gets them as CPU torch tensors over that
memory: Triton's CUDA launcher turns every pointer argument into a device address with
cuPointerGetAttribute(DEVICE_POINTER), which resolves a mapped host address
(triton/backends/nvidia/driver.c, ``extractPointer``). A one-word probe kernel checks this when
the ring is built; if the launcher refuses the tensor, the ring falls back to
:class:`MappedPointer` (an object with ``data_ptr()`` returning the device address and
``dtype``, which Triton also accepts). Without CUDA the records and the word are a plain CPU
tensor, which the interpreted kernels read and write directly, and :class:`DoneWordFences`
runs the native ring's acquire/commit logic on them; there every build has run by the time
the host stages again, so its ``wait`` (which tests replace to hold steps in flight) finds a
record that was never built.

A build that applies the record applied last again (no stage since the previous build, as a
warm-up does) writes a SEQ the done word already holds, so the word cannot tell when it ends:
the backend announces it (``fence_repeat``) and the next ``acquire`` first waits for every
build enqueued so far, by a fence. A graph the runner replays twice after one stage is not seen
by zos: the runner contract allows one build per stage (docs/ZOS.md, rule 1).
"""
from __future__ import annotations

import zos._interpret  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import numpy as np
import torch
import triton
import triton.language as tl

from zos import staging
from zos._checks import check_int

# Words the CPU ring holds after its slots (the done word, then the rest of a 64-byte line, as
# csrc/upload.cpp's kDoneWords).
DONE_WORDS = 16


@triton.jit
def _probe_kernel(ring_ptr, done_ptr):
    tl.store(done_ptr, tl.load(ring_ptr))


def _mapped_views(ring, device: torch.device):
    """The pointer arguments the prep kernels get for a native ``MappedRing`` (module
    docstring): (records, done word) as CPU tensors over the mapped memory if Triton's
    launcher accepts them and a kernel copies the host's word from the first slot into the
    done word through them, else as :class:`MappedPointer` objects.

    Raises:
        RuntimeError: neither carries the word the host wrote.
    """
    slots, done = ring.array(), ring.done_array()
    errors = []
    for views in ((torch.from_numpy(slots).view(-1), torch.from_numpy(done)),
                  (MappedPointer(ring.device_ptr), MappedPointer(ring.done_device_ptr))):
        kind = type(views[0]).__name__
        slots[0, 0] = canary = 0x5A5A1234
        try:
            _probe_kernel[(1,)](*views)
            torch.cuda.synchronize(device)
            got = int(done[0])
        except (TypeError, ValueError, RuntimeError) as e:  # the launcher refused it
            errors.append(f"{kind}: {e}")
            continue
        finally:
            slots[0, 0] = done[0] = 0
        if got == canary:
            return views
        errors.append(f"{kind}: carried {got:#x}, not {canary:#x}")
    raise RuntimeError("the prep kernels cannot read the mapped staging ring ("
                       + "; ".join(errors) + "); use staging='copy'")


class MappedPointer:
    """A device address of int32 words as a Triton pointer argument.

    Attributes:
        address: the device address (int).
        dtype: ``torch.int32``, the element type Triton specialises the kernel for.
    """

    dtype = torch.int32

    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        """The device address, as Triton's launcher reads it."""
        return self.address


def applied(done: int, seq: int, newest: int) -> bool:
    """Whether the build of the record with SEQ ``seq`` has finished, when the done word holds
    ``done`` and ``newest`` is the SEQ of the record committed last: builds apply records in
    SEQ order and none runs ahead of the last commit, so ``done`` lies in [seq, newest]
    modulo SEQ_MASK + 1 (csrc/upload.cpp, ``MappedRing::applied``)."""
    return ((done - seq) & staging.SEQ_MASK) <= ((newest - seq) & staging.SEQ_MASK)


class DoneWordFences:
    """The native ring's acquire/commit logic (``zos._C.MappedRing``) over a CPU ring: a slot
    is free once the done word has reached the SEQ of the record it holds.

    Args:
        slots: int32 numpy [num_slots, slot_words], the records.
        done: int32 numpy [1], the done word the interpreted kernels write.

    Attributes:
        num_slots: K.
        waits: acquires that found their slot's record not yet built.
    """

    def __init__(self, slots: np.ndarray, done: np.ndarray) -> None:
        self.slots, self.done = slots, done
        self.num_slots = slots.shape[0]
        self.waits = 0
        self._next = 0
        self._commits = 0
        self._repeat = False

    @property
    def done_seq(self) -> int:
        """The done word: the SEQ of the record whose build finished last."""
        return int(self.done[0])

    def applied(self, seq: int, newest: int) -> bool:
        """Whether the build of the record with SEQ ``seq`` has finished (:func:`applied`)."""
        return applied(self.done_seq, seq, newest)

    def acquire(self, stream: int = 0) -> int:
        """The next slot, once the build of the record it holds (if any) has finished, and a
        repeated build (:meth:`fence_repeat`) too."""
        if self._repeat:
            self._repeat = False
            self.drain()
        k = self._next
        if self._commits >= self.num_slots:
            seq, newest = int(self.slots[k, staging.SEQ]), int(self.slots[k - 1, staging.SEQ])
            if not self.applied(seq, newest):
                self.waits += 1
                self.wait(seq, newest)
        return k

    def wait(self, seq: int, newest: int) -> None:
        """Block until the build of record ``seq`` has finished. On a CPU every build has run
        when the host stages again, so the record was never built.

        Raises:
            RuntimeError: always (rule 2 of docs/ZOS.md, "The runner contract").
        """
        raise RuntimeError(
            f"zos: the record with SEQ {seq} was staged but no build read it (the done word "
            f"is at SEQ {self.done_seq}): every stage must be followed by its build before the "
            f"next stage (docs/ZOS.md, \"The runner contract\", rule 2)")

    def fence_repeat(self) -> None:
        """A build that applies the record applied last again was enqueued: the next acquire
        (or synchronize) first waits for every build enqueued so far (:meth:`drain`)."""
        self._repeat = True

    def drain(self) -> None:
        """Wait for every build enqueued so far (nothing to wait for on a CPU; tests replace
        it to run a held stream)."""

    def commit(self) -> None:
        """The acquired slot holds a staged record: the next acquire takes the following
        slot."""
        self._commits += 1
        self._next = (self._next + 1) % self.num_slots

    def synchronize(self, teardown: bool = False) -> None:
        """Wait until the build of the record committed last (and a repeated build) has
        finished (``teardown``: no capture mode on the CPU)."""
        if self._repeat:
            self._repeat = False
            self.drain()
        if self._commits:
            newest = int(self.slots[self._next - 1, staging.SEQ])
            if not self.applied(newest, newest):
                self.wait(newest, newest)


class StagingRing:
    """``num_slots`` staging records of ``slot_words`` int32 words that the prep kernels read in
    place, and the done word they write back (module docstring).

    Args:
        num_slots: K >= 1, steps the host may run ahead of the device.
        slot_words: words per record (``zos.staging.capacity_words``).
        device: the buffers' device: on CUDA the records are mapped pinned memory
            (:class:`zos._C.MappedRing` over the device's primary context, on any thread:
            nothing needs to have touched CUDA before), elsewhere a CPU tensor with
            :class:`DoneWordFences`.

    Attributes:
        slots: int32 numpy [num_slots, slot_words], the host's view (the packer writes a
            slot's row).
        device_view: what the kernels get as the ring's pointer: on CUDA a CPU tensor over
            the mapped memory or a :class:`MappedPointer` (module docstring), the CPU
            tensor otherwise.
        done_view: the same for the done word (int32 [1]): ``launch_prep``'s ``done``.
        fences: the native ring (CUDA) or :class:`DoneWordFences`.

    Raises:
        TypeError: num_slots or slot_words not an int.
        ValueError: num_slots or slot_words < 1.
        RuntimeError: on CUDA, the driver cannot be loaded or the memory not mapped.
    """

    def __init__(self, num_slots: int, slot_words: int, device: torch.device) -> None:
        self.num_slots = num_slots = check_int("num_slots", num_slots)
        self.slot_words = slot_words = check_int("slot_words", slot_words)
        if device.type == "cuda":
            from zos._C import MappedRing

            index = device.index if device.index is not None else torch.cuda.current_device()
            # The ring retains the device's primary context (torch's) and makes it current
            # for its driver calls itself: it works on a thread that never touched CUDA.
            self.fences = MappedRing(num_slots, slot_words, index)
            with torch.cuda.device(index):
                self.device_view, self.done_view = _mapped_views(
                    self.fences, torch.device("cuda", index))
            self.slots = self.fences.array()
        else:
            words = num_slots * slot_words
            self._memory = torch.zeros(words + DONE_WORDS, dtype=torch.int32)
            self.device_view = self._memory[:words].view(num_slots, slot_words)
            self.done_view = self._memory[words : words + 1]
            self.slots = self.device_view.numpy()
            self.fences = DoneWordFences(self.slots, self.done_view.numpy())

    def acquire(self, stream: int = 0) -> np.ndarray:
        """The next slot's record (int32 numpy [slot_words]), once the build of the record it
        holds has finished (``stream``: the stage's raw CUstream handle, 0 on a CPU, where a
        waiting acquire places its fence)."""
        return self.slots[self.fences.acquire(stream)]

    def commit(self) -> None:
        """The acquired slot now holds the step's record."""
        self.fences.commit()

    @property
    def waits(self) -> int:
        """Acquires that found their slot still in use (the host was K steps ahead)."""
        return self.fences.waits

    @property
    def done_seq(self) -> int:
        """The done word: the SEQ of the record whose build finished last."""
        return self.fences.done_seq

    def synchronize(self, teardown: bool = False) -> None:
        """Wait until no build reads any slot (before the records are freed); ``teardown``:
        as ``zos._C.MappedRing.synchronize`` (a ``__del__``)."""
        self.fences.synchronize(teardown)

    def seq_of(self, slot: int) -> int:
        """The SEQ word of slot ``slot``'s record."""
        return int(self.slots[slot, staging.SEQ])
