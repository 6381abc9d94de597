"""Build ordering: a step's build runs after its stage, and the next stage after that build,
whatever stream the build runs on (docs/ZOS.md, "The runner contract").

A :class:`~zos.device_backend.DeviceMetadataBackend` enqueues its stage work (the staging
ring's fences, or the copy of the record) on one stream, ``backend.stream``. Its build (the
prep kernels) reads the staged record; the next stage rewrites a record only after the build
that read it, by a fence on ``backend.stream`` (or, on the copy path, a copy enqueued there).
A build enqueued on that stream is ordered by the stream itself. A build on any other stream
(an eager build under ``torch.cuda.stream(other)``, a warm-up on a side stream, or a build
captured into a CUDA graph, which the runner may replay on any stream) is ordered by events
instead, so that no runner can get the order wrong:

* ``built``: recorded on the build's stream right after the prep kernels (under capture: an
  event-record node in the graph, recorded at every replay); each stage first makes
  ``backend.stream`` wait for it, so its fences (and its copy) come after that build;
* ``staged`` (copy path): recorded on ``backend.stream`` at the end of each stage, after the
  copy; such a build first makes its stream wait for it (under capture: an event-wait node in
  the graph, so every replay waits for the copy of the stage before it). On the mapped path
  the record is in host memory, written before the build is enqueued: the build needs no
  wait (the first build off the stream waits once for everything enqueued on
  ``backend.stream`` before it, e.g. the buffers' reset).

Both are "external" events (``torch.cuda.Event(external=True)``: ``cudaEventRecordExternal``
and ``cudaEventWaitExternal`` under capture): an ordinary event wait across a capture's
boundary is an error. A backend whose builds all run eagerly on ``backend.stream`` never turns
the stage side on and pays one stream query per eager build; once a build runs elsewhere or
is captured, every later stage pays one event wait (mapped) or one wait and one record
(copy), inside its one native call (``zos._C.MappedRing.acquire`` / ``PinnedUpload.submit``).
The runner still orders its own kernels: the model and the sampler after the build, the next
build after the sampler that wrote ``buffers.sampled`` (docs/ZOS.md, "The runner contract").
"""
from __future__ import annotations

from collections.abc import Callable

import torch


class BuildOrder:
    """The build-ordering events of one backend (module docstring).

    Args:
        stream: the backend's stream (``torch.cuda.Stream``).
        join: called once, as ``join(built, staged)`` with the raw event handles (``staged``
            0 unless ``wait_for_stage``), when the first build runs off ``stream`` or under
            capture: it turns the stage side on (the backend passes its native ring's or
            upload's ``set_build_events``).
        wait_for_stage: whether a build must wait for device work of its stage (the copy
            path's copy), i.e. whether stages record ``staged`` and builds wait for it.
        cuda: the ``torch.cuda`` namespace (``Event``, ``current_stream``,
            ``is_current_stream_capturing``); the CPU tests pass a fake one.

    Attributes:
        joined: whether the stage side is on (a build ran off ``stream`` or was captured).
        off_stream_builds: builds that ran off ``stream`` or under capture (ordered by the
            events).
    """

    def __init__(self, stream, join: Callable[[int, int], None], *, wait_for_stage: bool,
                 cuda=torch.cuda) -> None:
        self._cuda, self._join, self.wait_for_stage = cuda, join, wait_for_stage
        self.staged = cuda.Event(external=True)
        self.built = cuda.Event(external=True)
        self.joined = False
        self.off_stream_builds = 0
        self.stream = stream
        # Created and complete now: torch skips a wait on an event never recorded, also when
        # capturing, which would leave a captured build unordered.
        self.staged.record(stream)
        self.built.record(stream)

    @property
    def stream(self):
        """The backend's stream; set it when the backend's stream changes (between steps)."""
        return self._stream

    @stream.setter
    def stream(self, stream) -> None:
        # ``built`` keeps its last record: the next stage, on the new stream, waits for it.
        self._stream = stream
        self._device = stream.device_index
        self._stream_id = stream.stream_id
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if self._cuda is torch.cuda and raw is not None:
            # The current stream's raw handle, with no Stream object made (Triton's launcher
            # reads it the same way): the per-build check costs ~0.1 us, not ~1 us.
            device, handle = self._device, stream.cuda_stream
            self._on_stream = lambda: raw(device) == handle
        else:
            self._on_stream = lambda: self._cuda.current_stream(
                self._device).stream_id == self._stream_id

    def before_build(self):
        """Call right before a build's kernels are enqueued. Returns None when the build runs
        eagerly on the backend's stream (stream order suffices); else the current stream,
        made to wait for the stage where the build reads its device work (the copy path; the
        first build off the stream: everything on it so far). Pass it to :meth:`after_build`."""
        cuda = self._cuda
        capturing = cuda.is_current_stream_capturing()
        if not capturing and self._on_stream():
            return None
        current = cuda.current_stream(self._device)
        self.off_stream_builds += 1
        first = not self.joined
        if first:
            self.joined = True
            self._join(self.built.cuda_event,
                       self.staged.cuda_event if self.wait_for_stage else 0)
            if not capturing:  # after everything on the backend's stream so far (a capture
                self.staged.record(self._stream)  # synchronizes the device anyway)
        if self.wait_for_stage or (first and not capturing):
            self.staged.wait(current)
        return current

    def after_build(self, stream) -> None:
        """Call right after the build's kernels, with what :meth:`before_build` returned."""
        if stream is not None:
            self.built.record(stream)
