"""The scenarios of tests/test_native_stage.py, run in a process whose loader finds the fake
CUDA driver (tests/fake_cuda/fake_libcuda.c) as libcuda.so.1: ``python stage_checks.py NAME...``
prints one JSON object, each name -> "ok" or the failure's traceback."""
import ctypes
import faulthandler
import json
import sys
import traceback

import numpy as np

from zos import DecodeStep, staging
from zos._C import MappedRing, PinnedUpload, StepPacker, call_with_relaxed_capture_mode

FAKE = ctypes.CDLL("libcuda.so.1")  # the library zos._C opens: one copy per process
SEQ = staging.SEQ
# Request 5 is at position 3 (block [7], 4 tokens per block): it moves to row 1 at position 4
# in the second step, which opens block column 1, so that step appends.
STEPS = [DecodeStep.build([5, 6], {0: (1, 3, [7]), 1: (2, 0, [8])}),
         DecodeStep.build([6, 5], appends=[(1, 9)]), DecodeStep.build([6, 5])]
FRESH = DecodeStep.build([7, 8], {0: (3, 1, [10]), 1: (4, 2, [11])})  # all rows new


def packer():
    return StepPacker(max_num_reqs=24, uniform_decode_query_len=1, block_size=4,
                      max_num_blocks_per_req=6, num_kv_blocks=400, vocab_size=1000)


def fault(name, value):
    ctypes.c_int.in_dll(FAKE, name).value = value


def count(name):
    return ctypes.c_long.in_dll(FAKE, name).value


def last(name):
    return ctypes.c_uint64.in_dll(FAKE, name).value


def raises(exc, text, fn, *args):
    try:
        fn(*args)
    except exc as e:
        assert text in str(e), f"{type(e).__name__}: {e!r} lacks {text!r}"
        return
    raise AssertionError(f"no {exc.__name__} ({text!r})")


def record(step, seq, ref):
    """The words ``ref`` (a packer in step with the one under test) packs for ``step``."""
    out = np.zeros(256, np.int32)
    return out[:ref.pack_step(step, out, seq)].tolist()


def ring_records_and_launches():
    """Each stage writes pack's record, with its SEQ, into slot n mod K and launches the graph
    it is given on the bound stream; the slot of a record whose build finished is reused."""
    ring, p, ref = MappedRing(2, 256, 0), packer(), packer()
    stage, slots = p.stage_call(ring, 5, 0), ring.array()
    launches = count("fake_launches")
    for n, step in enumerate(STEPS):
        if n == 2:
            ring.done_array()[0] = 1  # record 1's build finished: slot 0 is free again
        words = stage(step, n + 1, 70 + n)
        assert slots[n % 2, :words].tolist() == record(step, n + 1, ref)
        assert (last("fake_last_graph"), last("fake_last_stream")) == (70 + n, 5)
    assert count("fake_launches") - launches == 3 and ring.waits == 0


def unbuilt_slot_resets_the_packer():
    """A stage whose slot holds a record that no build read (the fence completes, the done word
    never reaches its SEQ) raises, and the packer forgets the previous step."""
    ring, p = MappedRing(2, 256, 0), packer()
    stage = p.stage_call(ring, 5, 0)
    stage(STEPS[0], 1)
    stage(STEPS[1], 2)
    raises(RuntimeError, "was staged but no build read", stage, STEPS[2], 3)
    assert p.prev_num_reqs == 0 and ring.waits == 1


def capturing_stream_is_refused_before_anything():
    """On a capturing stream nothing is written, committed, launched or forgotten, and no event
    is queried or waited for (that would invalidate the capture); a call bound to the legacy
    default stream (0) never asks."""
    ring, p = MappedRing(2, 256, 0), packer()
    stage = p.stage_call(ring, 5, 0)
    stage(STEPS[0], 1)
    dst, src = np.zeros(256, np.int32), [np.zeros(256, np.int32) for _ in range(2)]
    up = PinnedUpload(dst.ctypes.data, src[0].ctypes.data, src[1].ctypes.data, 4 * 256, 0)
    up_stage, copies = packer().stage_call(up, 5, 0), count("fake_copies")
    before, launches = ring.array().copy(), count("fake_launches")
    unsafe = count("fake_unsafe_in_capture")
    fault("fake_capturing", 1)
    for graph in (0, 70):
        raises(RuntimeError, "stage: the backend's stream is capturing", stage, STEPS[1], 2, graph)
        raises(RuntimeError, "stage: the backend's stream is capturing", up_stage, STEPS[0], 1,
               graph)
    assert count("fake_unsafe_in_capture") == unsafe and count("fake_copies") == copies
    queries = count("fake_capture_queries")
    ring0, p0 = MappedRing(2, 256, 0), packer()
    assert p0.stage_call(ring0, 0, 0)(STEPS[0], 1, 70) > 0
    assert count("fake_capture_queries") == queries
    fault("fake_capturing", 0)
    assert (ring.array() == before).all() and p.prev_num_reqs == 2
    assert count("fake_launches") - launches == 1  # ring0's
    assert stage(STEPS[1], 2) > 0  # the mirror kept step 1: its carried rows pass


def launch_error_resets_the_packer_and_keeps_the_slot():
    """A failed launch: RuntimeError naming the call, the packer reset, the slot not
    committed (the next stage writes the same slot)."""
    ring, p, ref = MappedRing(2, 256, 0), packer(), packer()
    stage, slots = p.stage_call(ring, 5, 0), ring.array()
    stage(STEPS[0], 1, 70)
    fault("fake_launch_error", 400)
    raises(RuntimeError, "cuGraphLaunch failed: fake driver error", stage, STEPS[1], 2, 71)
    fault("fake_launch_error", 0)
    assert p.prev_num_reqs == 0
    ref.reset()
    words = stage(FRESH, 2, 71)
    assert slots[1, :words].tolist() == record(FRESH, 2, ref) and slots[0, SEQ] == 1


def packer_error_changes_nothing():
    """A step the packer refuses: ValueError, no slot written or committed, nothing launched,
    the previous step still the reference."""
    ring, p = MappedRing(2, 256, 0), packer()
    stage = p.stage_call(ring, 5, 0)
    stage(STEPS[0], 1)
    before, launches = ring.array().copy(), count("fake_launches")
    bad = DecodeStep(np.array([6, 6], np.int64), *[getattr(STEPS[1], f) for f in (
        "new_rows", "new_tokens", "new_positions", "new_block_indptr", "new_block_ids",
        "append_rows", "append_block_ids")])
    raises(ValueError, "appears twice", stage, bad, 2, 70)
    assert (ring.array() == before).all() and count("fake_launches") == launches
    assert p.prev_num_reqs == 2 and stage(STEPS[1], 2) > 0


def upload_records_copies_and_errors():
    """On the copy path each stage packs into the next pinned buffer, copies it to the staging
    buffer (here host memory) and launches after it; a failed copy resets the packer."""
    dst, src = np.zeros(256, np.int32), [np.zeros(256, np.int32) for _ in range(2)]
    up = PinnedUpload(dst.ctypes.data, src[0].ctypes.data, src[1].ctypes.data, 4 * 256, 0)
    p, ref = packer(), packer()
    stage = p.stage_call(up, 5, 0)
    copies, launches = count("fake_copies"), count("fake_launches")
    for n, step in enumerate(STEPS):
        words = stage(step, n + 1, 70 + n)
        assert dst[:words].tolist() == record(step, n + 1, ref)
        assert src[n % 2][:words].tolist() == dst[:words].tolist()
    assert count("fake_copies") - copies == 3 and count("fake_launches") - launches == 3
    fault("fake_copy_error", 700)
    raises(RuntimeError, "failed: fake driver error", stage, STEPS[2], 4)
    fault("fake_copy_error", 0)
    assert p.prev_num_reqs == 0


def arguments_are_checked_first():
    """Argument errors name the argument and leave everything as it was."""
    ring, p = MappedRing(2, 256, 0), packer()
    stage = p.stage_call(ring, 5, 0)
    before = ring.array().copy()
    for args, exc, text in [
            ((STEPS[0],), TypeError, "stage(step, seq, graph_exec=0, /) takes 2 or 3 arguments"),
            ((STEPS[0], 1, 0, 0), TypeError, "takes 2 or 3 arguments, got 4"),
            ((STEPS[0], True), TypeError, "seq must be an int, got bool"),
            ((STEPS[0], 1.0), TypeError, "seq must be an int, got float"),
            ((STEPS[0], 1 << 30), ValueError, "seq must be in [0, 1073741823], got 1073741824"),
            ((STEPS[0], 1, -1), ValueError, "graph_exec must be in [0, 9223372036854775807]"),
            ((STEPS[0], 1, 1 << 64), ValueError, "graph_exec must be in"),
            ((object(), 1), TypeError, "step must be a zos.DecodeStep")]:
        raises(exc, text, stage, *args)
    raises(TypeError, "takes no keyword arguments", lambda: stage(STEPS[0], 1, graph_exec=0))
    raises(ValueError, "device must be >= 0, got -1", p.stage_call, ring, 5, -1)
    raises(TypeError, "sink must be a zos._C.MappedRing or zos._C.PinnedUpload", p.stage_call,
           object(), 5, 0)
    assert (ring.array() == before).all() and p.prev_num_reqs == 0


def gil_released_only_around_a_wait():
    """A stage (and an acquire) whose slot or pinned buffer is free makes every driver call
    holding the GIL: a thread that drops it waits for a busy Python thread to let go (up to
    its switch interval) to take it back. One that must wait for the device drops it around
    the wait."""
    def calls(fn, *args):  # (driver calls holding the GIL, without it) made by fn(*args)
        held, free = count("fake_with_gil"), count("fake_without_gil")
        fn(*args)
        return count("fake_with_gil") - held, count("fake_without_gil") - free

    ring, p = MappedRing(2, 256, 0), packer()
    stage = p.stage_call(ring, 5, 0)
    assert ring.ready()
    assert calls(stage, STEPS[0], 1, 70) == (2, 0)  # the capture query and the launch
    assert calls(stage, STEPS[1], 2, 71) == (2, 0)
    assert not ring.ready()  # slot 0 holds record 1, which no build has read
    # the capture query holds it; the wait records and polls a fence without it (then finds
    # the record never built)
    held, free = count("fake_with_gil"), count("fake_without_gil")
    raises(RuntimeError, "was staged but no build read", stage, STEPS[2], 3)
    assert count("fake_with_gil") - held == 1 and count("fake_without_gil") - free >= 2
    ring.done_array()[0] = 2
    assert ring.ready() and calls(ring.acquire, 5) == (0, 0)  # the done word, no driver call

    dst, src = np.zeros(256, np.int32), [np.zeros(256, np.int32) for _ in range(2)]
    up = PinnedUpload(dst.ctypes.data, src[0].ctypes.data, src[1].ctypes.data, 4 * 256, 0)
    stage = packer().stage_call(up, 5, 0)
    # capture query, the buffer's query, its (done) wait, the copy, its fence, the launch
    assert calls(stage, STEPS[0], 1, 70) == (6, 0)
    fault("fake_event_busy", 1)  # the next buffer's copy is still running
    assert not up.ready() and up.ready()  # (the first query took the fault)
    fault("fake_event_busy", 1)
    # capture query, the buffer's query; the wait, the copy, its fence, the launch
    assert calls(stage, STEPS[1], 2, 71) == (2, 4)
    assert calls(up.acquire)[1] == 0
    fault("fake_event_busy", 1)
    assert calls(up.acquire) == (1, 1)  # the query; the wait


def capture_mode_now():
    """This thread's capture mode in the fake driver (0: global, CUDA's default)."""
    mode = ctypes.c_int(0)
    FAKE.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))  # mode <- the thread's
    FAKE.cuThreadExchangeStreamCaptureMode(ctypes.byref(ctypes.c_int(mode.value)))
    return mode.value


def event_calls_leave_another_threads_capture_alone():
    """While another thread captures a graph in the global mode (torch's default), zos's event
    queries and waits (the upload's acquire, ready and synchronize, the ring's fence wait and
    drain) run in the thread-local mode, so the driver neither refuses them nor breaks that
    capture; the thread's mode is global again after each."""
    fault("fake_other_thread_capturing", 1)
    broken = count("fake_captures_broken")
    dst, src = np.zeros(256, np.int32), [np.zeros(256, np.int32) for _ in range(2)]
    up = PinnedUpload(dst.ctypes.data, src[0].ctypes.data, src[1].ctypes.data, 4 * 256, 0)
    stage = packer().stage_call(up, 5, 0)
    stage(STEPS[0], 1, 70)
    fault("fake_event_busy", 1)
    stage(STEPS[1], 2, 71)  # waits: not ready, then synchronize
    assert up.ready() and up.acquire() in (0, 1)
    up.synchronize()
    ring, p = MappedRing(2, 256, 0), packer()
    stage = p.stage_call(ring, 5, 0)
    stage(STEPS[0], 1, 70)
    stage(STEPS[1], 2, 71)
    fault("fake_event_busy", 1)  # the fence is queried (busy once, then done)
    raises(RuntimeError, "was staged but no build read", stage, STEPS[2], 3)
    ring.done_array()[0] = 2  # both records built
    ring.fence_repeat()
    ring.acquire(5)  # drains: records a fence and waits for it
    assert count("fake_captures_broken") == broken
    assert capture_mode_now() == 0
    fault("fake_other_thread_capturing", 0)
    # the stand-in refuses a query in the global mode (what the guard prevents)
    fault("fake_other_thread_capturing", 1)
    assert FAKE.cuEventQuery(None) == 900 and count("fake_captures_broken") == broken + 1
    fault("fake_other_thread_capturing", 0)



def driver_calls():
    """Stream and event calls so far (each counted once, by its caller's GIL)."""
    return count("fake_with_gil") + count("fake_without_gil")


def teardown_inside_own_capture():
    """Python's garbage collector may free zos's objects inside the freeing thread's own graph
    capture (global mode, torch's default). Their teardown waits in the relaxed mode: the driver
    refuses nothing and the capture stays intact, where a per-step wait is refused and breaks
    it. A ring whose builds may still read its records while the stage's stream itself
    captures keeps its memory rather than record a fence into that capture."""
    broken = count("fake_captures_broken")
    dst, src = np.zeros(256, np.int32), [np.zeros(256, np.int32) for _ in range(2)]
    up = PinnedUpload(dst.ctypes.data, src[0].ctypes.data, src[1].ctypes.data, 4 * 256, 0)
    up.submit(up.acquire(), 64, 5)
    ring, p = MappedRing(2, 256, 0), packer()
    stage = p.stage_call(ring, 5, 0)
    stage(STEPS[0], 1, 70)
    ring.done_array()[0] = 1  # its build finished
    ring.fence_repeat()  # and was repeated: teardown drains (records a fence, waits for it)
    fault("fake_own_capture", 1)
    raises(RuntimeError, "cuEventSynchronize", up.synchronize)
    assert count("fake_captures_broken") == broken + 1
    calls = driver_calls()
    up.synchronize(teardown=True)
    del up  # waits for both fences
    assert driver_calls() - calls == 4
    calls, frees = driver_calls(), count("fake_host_frees")
    del stage, p, ring  # the capture query, the drain's record and wait; then the free
    assert driver_calls() - calls == 3 and count("fake_host_frees") == frees + 1
    assert count("fake_captures_broken") == broken + 1 and capture_mode_now() == 0
    fault("fake_own_capture", 0)
    ring, p = MappedRing(2, 256, 0), packer()
    stage = p.stage_call(ring, 5, 0)
    stage(STEPS[0], 1, 70)  # not built yet
    fault("fake_capturing", 1)  # the stage's stream is the capturing one
    fault("fake_own_capture", 1)
    calls, frees = driver_calls(), count("fake_host_frees")
    ring.synchronize(teardown=True)  # the capture query only: no fence, no wait
    assert driver_calls() - calls == 1
    del stage, p, ring  # asks again; still capturing: the memory is kept
    assert driver_calls() - calls == 2 and count("fake_host_frees") == frees
    assert count("fake_captures_broken") == broken + 1


def relaxed_call_inside_own_capture():
    """``call_with_relaxed_capture_mode``: what it calls runs in the relaxed mode (a graph's
    destruction inside the thread's own capture is not refused and breaks nothing), and the
    thread's mode is restored after, also when the call raises."""
    fault("fake_own_capture", 1)
    broken, seen = count("fake_captures_broken"), []
    call_with_relaxed_capture_mode(
        lambda: seen.append((capture_mode_now(), FAKE.cuEventQuery(None))))
    assert seen == [(2, 0)] and capture_mode_now() == 0
    assert count("fake_captures_broken") == broken

    def fails():
        raise KeyError("from fn")
    raises(KeyError, "from fn", call_with_relaxed_capture_mode, fails)
    assert capture_mode_now() == 0
    assert FAKE.cuEventQuery(None) == 900 and count("fake_captures_broken") == broken + 1


if __name__ == "__main__":
    faulthandler.dump_traceback_later(120, exit=True)  # a hang: its stack to the test's stderr
    assert hasattr(FAKE, "fake_launches"), "libcuda.so.1 is not the fake driver"
    results = {}
    for name in sys.argv[1:]:
        for f in ("fake_capturing", "fake_launch_error", "fake_copy_error", "fake_event_busy",
                  "fake_other_thread_capturing", "fake_own_capture"):
            fault(f, 0)
        try:
            globals()[name]()
            results[name] = "ok"
        except Exception:  # reported to the test, which fails with it
            results[name] = traceback.format_exc()
    print(json.dumps(results))
