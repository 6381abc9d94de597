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
  event-record node in the graph, recorded at every replay); on the copy path each stage
  first makes ``backend.stream`` wait for it, so its copy comes after that build; on the
  mapped path the build itself tells the host when it has finished reading its slot (the
  ring's done word, written by the prep kernels), and only a stage that must wait for it
  makes ``backend.stream`` wait for ``built`` before the fence it polls (which tells a build
  that never ran from one still running);
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
is captured, every later stage on the copy path pays one event wait and one record, inside its
one native call (``zos._C.PinnedUpload.submit``); on the mapped path only a stage that waits for
its slot does (``zos._C.MappedRing.acquire``).
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
        capturing: whether the stream of the last such build was capturing.
        on_stream: a function of no arguments: whether the current stream is ``stream``,
            capturing or not (one C call; set with ``stream``). A caller that launches on
            ``stream`` itself asks the stream whether it is capturing (``eager_on_stream``
            is both).
    """

    def __init__(self, stream, join: Callable[[int, int], None], *, wait_for_stage: bool,
                 cuda=torch.cuda) -> None:
        self._cuda, self._join, self.wait_for_stage = cuda, join, wait_for_stage
        self.staged = cuda.Event(external=True)
        self.built = cuda.Event(external=True)
        self.joined = False
        self.capturing = False
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
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
        if self._cuda is torch.cuda and raw is not None and capturing is not None:
            # The current stream's raw handle, with no Stream object made (Triton's launcher
            # reads it the same way), and the capture query without torch.cuda's wrapper: one C
            # call each, not ~1 us of wrappers.
            device, handle = self._device, stream.cuda_stream
            self.on_stream = lambda: raw(device) == handle
        else:
            cuda, device, stream_id = self._cuda, self._device, stream.stream_id
            self.on_stream = lambda: cuda.current_stream(device).stream_id == stream_id
            capturing = cuda.is_current_stream_capturing
        self._capturing = capturing

    def eager_on_stream(self) -> bool:
        """Whether a build enqueued now runs eagerly on the backend's stream: the current
        stream is that stream and is not capturing (stream order alone orders the build)."""
        return self.on_stream() and not self._capturing()

    def before_build(self):
        """Call right before a build's kernels are enqueued. Returns None when the build runs
        eagerly on the backend's stream (:meth:`eager_on_stream`: stream order suffices);
        else the current stream, made to wait for the stage where the build reads its device
        work (the copy path; the first build off the stream: everything on it so far), and
        sets ``capturing`` (whether that stream is capturing). Pass it to
        :meth:`after_build`."""
        if self.eager_on_stream():
            return None
        cuda = self._cuda
        self.capturing = capturing = cuda.is_current_stream_capturing()
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
