"""The zero-copy staging ring: K staging records the prep kernels read where the host wrote
them, one fence per slot (docs/ZOS.md, "The staging record").

Step n's record goes into slot n mod K. The graph finds it without any per-step upload: the
prep kernels keep a ring state on the device (``zos.kernels.PrepState``: CTR, the slot of
the next new record, and LAST, the SEQ of the last record applied), take slot CTR when its
record's SEQ is the one after LAST and advance CTR and LAST themselves. The host writes
slot k only after the build that last read it has finished: at each ``acquire`` the slot
committed last gets its fence (recorded on the stream after that step's build was
enqueued), and the host waits for the next slot's fence, which is pending only when the
host is K steps ahead of the device.

On CUDA the records live in pinned host memory mapped into the device's address space
(``zos._C.MappedRing``: cuMemHostAlloc with DEVICEMAP, the device address from
cuMemHostGetDevicePointer) and the fences are CUDA events, both driven from C++. Triton
gets the records as a CPU torch tensor over that memory: Triton's CUDA launcher turns every
pointer argument into a device address with cuPointerGetAttribute(DEVICE_POINTER), which
resolves a mapped host address (triton/backends/nvidia/driver.c, ``extractPointer``). A
one-word probe kernel checks this when the ring is built; if the launcher refuses the
tensor, the ring falls back to a :class:`MappedPointer` (an object with ``data_ptr()``
returning the device address and ``dtype``, which Triton also accepts). Without CUDA the records
are a plain CPU tensor, which the interpreted kernels read directly, and the fences are
:class:`ImmediateFences`: complete at once, with the same acquire/commit logic as the
native ring, so tests can replace ``query`` and ``wait`` to hold steps in flight.
"""
from __future__ import annotations

import zos._interpret  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

import numpy as np
import torch
import triton
import triton.language as tl

from zos import staging
from zos._checks import check_int


@triton.jit
def _probe_kernel(ring_ptr, out_ptr):
    tl.store(out_ptr, tl.load(ring_ptr))


def _mapped_view(ring, device: torch.device):
    """The pointer argument the prep kernels get for a native ``MappedRing`` (module
    docstring): a CPU tensor over the mapped memory if Triton's launcher accepts it and the
    kernel reads the host's word through it, else a :class:`MappedPointer`.

    Raises:
        RuntimeError: neither reads the word the host wrote.
    """
    slots = ring.array()
    out = torch.zeros(1, dtype=torch.int32, device=device)
    errors = []
    for view in (torch.from_numpy(slots).view(-1), MappedPointer(ring.device_ptr)):
        slots[0, 0] = canary = 0x5A5A1234
        try:
            out.zero_()
            _probe_kernel[(1,)](view, out)
            torch.cuda.synchronize(device)
            got = int(out.item())
        except (TypeError, ValueError, RuntimeError) as e:  # the launcher refused it
            errors.append(f"{type(view).__name__}: {e}")
            continue
        finally:
            slots[0, 0] = 0
        if got == canary:
            return view
        errors.append(f"{type(view).__name__}: read {got:#x}, not {canary:#x}")
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


class ImmediateFences:
    """One fence per ring slot, complete at once (CPU: every build has finished when the
    host stages the next step). The acquire/commit logic is the native ring's
    (``zos._C.MappedRing``); ``record``, ``query`` and ``wait`` are the only device calls and
    do nothing here.

    Attributes:
        num_slots: K.
        waits: acquires that found their slot's fence pending (never here, unless ``query``
            is replaced).
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.waits = 0
        self._next = 0
        self._pending = -1

    def record(self, slot: int) -> None:
        """Record slot ``slot``'s fence after the work enqueued so far (nothing on a CPU)."""

    def query(self, slot: int) -> bool:
        """Whether slot ``slot``'s fence is complete (always, on a CPU)."""
        return True

    def wait(self, slot: int) -> None:
        """Block until slot ``slot``'s fence is complete (nothing to wait for on a CPU)."""

    def acquire(self, stream: int = 0) -> int:
        """Fence the slot committed last, wait for the next slot's fence; returns that slot."""
        if self._pending >= 0:
            self.record(self._pending)
            self._pending = -1
        if not self.query(self._next):
            self.waits += 1
            self.wait(self._next)
        return self._next

    def commit(self) -> None:
        """The acquired slot holds a staged record: the next acquire fences it."""
        self._pending = self._next
        self._next = (self._next + 1) % self.num_slots

    def synchronize(self) -> None:
        """Fence the slot committed last and wait for every slot."""
        if self._pending >= 0:
            self.record(self._pending)
            self._pending = -1
        for k in range(self.num_slots):
            self.wait(k)


class StagingRing:
    """``num_slots`` staging records of ``slot_words`` int32 words that the prep kernels read in
    place, each slot fenced (module docstring).

    Args:
        num_slots: K >= 1, steps the host may run ahead of the device.
        slot_words: words per record (``zos.staging.capacity_words``).
        device: the buffers' device: on CUDA the records are mapped pinned memory
            (:class:`zos._C.MappedRing` over the device's primary context, on any thread:
            nothing needs to have touched CUDA before), elsewhere a CPU tensor with
            :class:`ImmediateFences`.

    Attributes:
        slots: int32 numpy [num_slots, slot_words], the host's view (the packer writes a
            slot's row).
        device_view: what the kernels get as the ring's pointer: on CUDA a CPU tensor over
            the mapped memory or a :class:`MappedPointer` (module docstring), the CPU
            tensor otherwise.
        fences: the native ring (CUDA) or :class:`ImmediateFences`.

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
                self.device_view = _mapped_view(self.fences, torch.device("cuda", index))
            self.slots = self.fences.array()
        else:
            self._records = torch.zeros((num_slots, slot_words), dtype=torch.int32)
            self.slots = self._records.numpy()
            self.device_view = self._records
            self.fences = ImmediateFences(num_slots)

    def acquire(self, stream: int = 0) -> np.ndarray:
        """Fence the slot staged last on ``stream`` (a raw CUstream handle; 0 on a CPU), wait
        for the next slot's fence; returns that slot's record (int32 numpy [slot_words])."""
        return self.slots[self.fences.acquire(stream)]

    def commit(self) -> None:
        """The acquired slot now holds the step's record."""
        self.fences.commit()

    @property
    def waits(self) -> int:
        """Acquires that found their slot still in use (the host was K steps ahead)."""
        return self.fences.waits

    def synchronize(self) -> None:
        """Wait until no build reads any slot (before the records are freed)."""
        self.fences.synchronize()

    def seq_of(self, slot: int) -> int:
        """The SEQ word of slot ``slot``'s record."""
        return int(self.slots[slot, staging.SEQ])
