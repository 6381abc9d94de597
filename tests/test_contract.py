"""The runner contract (docs/ZOS.md, "The runner contract"), checked on our own runners.

1. A static scan: no module outside the core library (``zos/serving/**``,
   ``zos/integrations/**``, ``bench/*.py``) reads or writes an underscore attribute that the
   core library (``zos/*.py``) defines, or the ``.packer`` of a backend. The private names are
   collected from the core modules' ASTs (``self._x = ...`` / ``cls._x = ...`` assignments,
   ``def _x`` methods, class-level ``_x`` attributes), so a new private name is covered the day
   it is added; an access through ``self`` / ``cls`` is the module's own state. Names that
   only other libraries define (transformers' ``_bulk_input_tensor``, ``_attn_implementation``,
   ``_compute_stream``) are not zos's and are not flagged. Imports of zos's private modules
   (``zos._checks``, ``zos._interpret``) are imports, not attribute accesses of a library
   object, and are not what this checks.
2. The build ordering: on a CPU with a fake ``torch.cuda`` (the decisions of
   ``zos.stream_order.BuildOrder``, and a real backend's build through them), and on CUDA
   (skipped here) a build on a second stream with no ordering by the runner, eagerly and
   inside a CUDA graph replayed on that stream, against the same steps built on the
   backend's own stream.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from zos import DecodeBuffers, DecodeStep, DeviceMetadataBackend
from zos.stream_order import BuildOrder

from helpers import DEVICE, TraceGen, expected

ROOT = Path(__file__).resolve().parent.parent
CORE = sorted((ROOT / "zos").glob("*.py"))
OUTSIDE = sorted([*(ROOT / "zos" / "serving").rglob("*.py"),
                  *(ROOT / "zos" / "integrations").rglob("*.py"),
                  *(ROOT / "bench").glob("*.py")])
FORBIDDEN_PUBLIC = {"packer"}  # public on the backend, but not part of the contract
BS, W, NUM_BLOCKS, VOCAB, SIZES = 4, 6, 400, 1000, (8, 16, 24)
FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
          "block_table", "counts")


def private_names(sources) -> set[str]:
    """Underscore names the core library defines on its objects: ``self._x`` / ``cls._x``
    assignment targets, methods and class attributes named ``_x`` (dunders excluded)."""
    names = set()

    def private(n: str) -> bool:
        return n.startswith("_") and not (n.startswith("__") and n.endswith("__"))

    for src in sources:
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                if (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                        and private(node.attr)):
                    names.add(node.attr)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        if private(item.name):
                            names.add(item.name)
                    targets = (item.targets if isinstance(item, ast.Assign) else
                               [item.target] if isinstance(item, ast.AnnAssign) else [])
                    names.update(t.id for t in targets
                                 if isinstance(t, ast.Name) and private(t.id))
    return names


def violations(source: str, names: set[str], path: str = "<source>") -> list[str]:
    """``path:line: expr.attr`` for each access of a name in ``names`` (or ``.packer``) on an
    object other than ``self`` / ``cls``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr not in names and node.attr not in FORBIDDEN_PUBLIC:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.fixture(scope="module")
def core_private():
    return private_names(p.read_text() for p in CORE)


def test_core_private_names_are_collected(core_private):
    # Names the runners used to reach for, and a few of each kind (assignment, method).
    assert {"_take_over", "_stage", "_graphs", "_upload", "_ring", "_seq",
            "_prep_args"} <= core_private
    assert "__init__" not in core_private and "packer" not in core_private


def test_no_module_outside_the_core_touches_library_internals(core_private):
    assert OUTSIDE and all(p.exists() for p in OUTSIDE)
    found = []
    for p in OUTSIDE:
        found += violations(p.read_text(), core_private, str(p.relative_to(ROOT)))
    assert not found, "outside the runner contract:\n" + "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("backend.packer.reset()\n", ["backend.packer"]),
    ("x = self.backend.packer.prev_num_reqs\n", ["self.backend.packer"]),
    ("be._graphs[4].replay()\n", ["be._graphs"]),
    ("runner.backend._take_over()\n", ["runner.backend._take_over"]),
    ("engine.backend._seq = 0\n", ["engine.backend._seq"]),
    ("f(getattr(b, 'x'))._upload.submit(0, 4, 0)\n", ["f(getattr(b, 'x'))._upload"]),
    # allowed: own state, the contract, names zos does not define (transformers')
    ("self._graphs = {}\nself._take_over()\n", []),
    ("backend.reset()\nn = backend.prev_num_reqs\nbackend.build(8)\n", []),
    ("io._bulk_input_tensor[0]\nmodel.config._attn_implementation\n", []),
])
def test_scan_flags_a_planted_violation(core_private, source, expected):
    got = [v.split(": ", 1)[1] for v in violations(source, core_private)]
    assert got == expected


def test_private_names_from_a_synthetic_core():
    core = ("class A:\n    _slots = 1\n    _typed: int = 2\n"
            "    def __init__(self):\n        self._x = 1\n        self.y = 2\n"
            "    def _helper(self):\n        cls = type(self)\n        cls._z = 3\n"
            "    def __repr__(self):\n        return ''\n")
    names = private_names([core])
    assert names == {"_slots", "_typed", "_x", "_helper", "_z"}
    assert violations("a._x\na.y\na._helper()\na.__repr__()\na._other\n", names) == [
        "<source>:1: a._x", "<source>:3: a._helper"]


# ---- build ordering on a CPU, with a fake torch.cuda -----------------------------------------

class FakeStream:
    def __init__(self, sid: int) -> None:
        self.stream_id, self.device_index = sid, 0


class FakeEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.cuda_event = log, name, 0

    def record(self, stream) -> None:
        self.log.append(("record", self.name, stream.stream_id))

    def wait(self, stream) -> None:
        self.log.append(("wait", self.name, stream.stream_id))


class FakeCuda:
    """What BuildOrder uses of torch.cuda: a current stream, a capture flag, events."""

    def __init__(self, log: list) -> None:
        self.log, self.current, self.capturing, self._names = log, FakeStream(1), False, iter(
            ["staged", "built"])

    def Event(self, external: bool = False):  # noqa: N802  (torch.cuda.Event)
        assert external, "build ordering needs external events (they cross a capture)"
        ev = FakeEvent(self.log, next(self._names))
        ev.cuda_event = 100 + len(self.log)
        return ev

    def current_stream(self, device=None):
        return self.current

    def is_current_stream_capturing(self) -> bool:
        return self.capturing


def make_order(wait_for_stage=True):
    log, joins = [], []
    cuda = FakeCuda(log)
    order = BuildOrder(FakeStream(1), lambda built, staged: joins.append((built, staged)),
                       wait_for_stage=wait_for_stage, cuda=cuda)
    return order, cuda, log, joins


def test_events_exist_before_any_build():
    order, _, log, joins = make_order()
    # torch skips a wait on an event never recorded (under capture too): both are recorded
    assert log == [("record", "staged", 1), ("record", "built", 1)] and joins == []


@pytest.mark.parametrize("wait_for_stage", [False, True])
def test_build_on_the_backend_stream_needs_no_event(wait_for_stage):
    order, cuda, log, joins = make_order(wait_for_stage)
    del log[:]
    for _ in range(3):
        s = order.before_build()
        order.after_build(s)
    assert s is None and log == [] and joins == [] and not order.joined


@pytest.mark.parametrize("capturing", [False, True])
def test_copy_path_build_off_the_stream_waits_for_the_stage_and_marks_its_end(capturing):
    order, cuda, log, joins = make_order(wait_for_stage=True)
    del log[:]
    cuda.current, cuda.capturing = FakeStream(7), capturing
    s = order.before_build()
    order.after_build(s)
    assert joins == [(order.built.cuda_event, order.staged.cuda_event)] and order.joined
    first = [("record", "staged", 1)] if not capturing else []  # the stage had no event yet
    assert log == first + [("wait", "staged", 7), ("record", "built", 7)]
    del log[:]
    s = order.before_build()  # joined already: the stage records ``staged`` natively
    order.after_build(s)
    assert log == [("wait", "staged", 7), ("record", "built", 7)] and len(joins) == 1
    assert order.off_stream_builds == 2


@pytest.mark.parametrize("capturing", [False, True])
def test_mapped_path_build_off_the_stream_marks_its_end(capturing):
    # The record is in host memory: only the first eager build off the stream waits (for
    # everything on the backend's stream, e.g. the reset); each build marks its end, which
    # the stage waits for (natively; ``staged`` is not recorded by the stage: handle 0).
    order, cuda, log, joins = make_order(wait_for_stage=False)
    del log[:]
    cuda.current, cuda.capturing = FakeStream(7), capturing
    s = order.before_build()
    order.after_build(s)
    assert joins == [(order.built.cuda_event, 0)]
    first = [] if capturing else [("record", "staged", 1), ("wait", "staged", 7)]
    assert log == first + [("record", "built", 7)]
    del log[:]
    order.after_build(order.before_build())
    assert log == [("record", "built", 7)] and len(joins) == 1


def test_on_stream_asks_the_current_stream_only():
    # ``on_stream`` (prepare's one-call path) is the current-stream half of eager_on_stream: a
    # capture on the backend's stream is the native stage's to refuse.
    order, cuda, _, _ = make_order()
    assert order.on_stream() and order.eager_on_stream()
    cuda.capturing = True
    assert order.on_stream() and not order.eager_on_stream()
    cuda.current, cuda.capturing = FakeStream(7), False
    assert not order.on_stream() and not order.eager_on_stream()
    order.stream = FakeStream(7)
    assert order.on_stream() and order.eager_on_stream()


def test_capture_on_the_backend_stream_still_orders_the_replay():
    # A graph captured on the backend's own stream may be replayed on any stream.
    order, cuda, log, joins = make_order()
    del log[:]
    cuda.capturing = True
    s = order.before_build()
    order.after_build(s)
    assert log == [("wait", "staged", 1), ("record", "built", 1)] and order.joined


def test_new_stream_is_followed():
    order, cuda, log, joins = make_order()
    order.stream = FakeStream(5)  # ``built`` keeps its record: the next stage waits for it
    assert log == [("record", "staged", 1), ("record", "built", 1)]
    cuda.current = FakeStream(5)
    assert order.before_build() is None and len(log) == 2
    cuda.current = FakeStream(1)
    assert order.before_build() is not None


@pytest.mark.skipif(DEVICE != "cpu", reason="a CPU backend runs the interpreted kernels")
@pytest.mark.parametrize("seed", [0, 1])
def test_backend_build_goes_through_the_ordering(seed, monkeypatch):
    # The device backend's build on a CPU, with the ordering of a CUDA backend whose builds
    # run on another stream: each build waits for its stage and marks its end, around the
    # prep kernels, and the metadata is still the per-request truth.
    gen = TraceGen(seed, max_num_reqs=24, block_size=BS, max_blocks=W, num_kv_blocks=NUM_BLOCKS,
                   vocab=VOCAB)
    be = DeviceMetadataBackend(DecodeBuffers(24, W, BS), num_kv_blocks=NUM_BLOCKS,
                               vocab_size=VOCAB)
    order, cuda, log, joins = make_order()
    cuda.current = FakeStream(9)
    monkeypatch.setattr(be, "_order", order)
    assert be.build_order is order
    builds = 0
    for _ in range(12):
        step, rows = gen.next_step()
        del log[:]
        md = be.prepare(step)
        builds += 1
        for f in FIELDS:
            want = expected(rows, md.padded_size, block_size=BS, max_blocks=W)[f]
            assert getattr(md, f).numpy().tolist() == want.tolist(), f
        assert log[-2:] == [("wait", "staged", 9), ("record", "built", 9)]  # copy path
        be.buffers.sampled[: len(rows)] = torch.from_numpy(gen.sampled(rows))
    assert len(joins) == 1 and order.off_stream_builds == builds


@pytest.mark.skipif(DEVICE != "cpu", reason="a CPU backend runs the interpreted kernels")
def test_cpu_backend_builds_without_ordering():
    bufs = DecodeBuffers(4, 2, 16)
    be = DeviceMetadataBackend(bufs, num_kv_blocks=8, vocab_size=50)
    assert be.build_order is None and be.stream is None
    md = be.prepare(DecodeStep.build([3], {0: (5, 16, [1, 2])}))
    assert md.positions.tolist() == [16] and md.slot_mapping.tolist() == [32]


# ---- build ordering on CUDA --------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _build_elsewhere(seed, *, staging, graphs, schedule):
    """A seeded trace whose builds run on a second stream that the runner never orders against
    the backend's stream (``schedule``: "side" every step; "alternate" the backend's stream and
    the side stream in turn, so the ordering turns on mid-run). The runner orders only its own
    kernels, as the contract asks: a build after the previous step's sampler (a wait enqueued
    after the stage, so it does not order the stage's work). Each build's stream lags (a GPU
    sleep before it), and every third stage's stream lags too, with no host sync in the run:
    without the backend's events a build would read a record not yet copied, or the next
    stage overwrite a record a build still reads. With ``graphs`` the builds are captured (on
    torch's capture stream) and replayed on those streams. Every step's metadata must equal the
    per-request truth."""
    gen = TraceGen(seed, max_num_reqs=24, block_size=BS, max_blocks=W, num_kv_blocks=NUM_BLOCKS,
                   vocab=VOCAB)
    bufs = DecodeBuffers(24, W, BS, device="cuda")
    be = DeviceMetadataBackend(bufs, num_kv_blocks=NUM_BLOCKS, vocab_size=VOCAB,
                               staging=staging)
    side = torch.cuda.Stream()
    captured = {}
    if graphs:
        for s in SIZES:  # warm-up (Triton compiles) on N = 0: dummy rows only
            be.build(s)
        torch.cuda.synchronize()
        for s in SIZES:
            captured[s] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured[s]):
                be.build(s)
    snaps, wants, keep = [], [], []
    prev = be.stream
    for k in range(40):
        step, rows = gen.next_step()
        if k % 3 == 0:
            with torch.cuda.stream(be.stream):
                torch.cuda._sleep(200_000)  # the stage's copy lands late
        plan = be.stage(step)
        size = plan.padded_size
        if graphs and size:  # a step of padded size 0 runs no prep (no graph either)
            size = next(s for s in SIZES if s >= size)
        on = side if schedule == "side" or k % 2 else be.stream
        if on != prev:
            on.wait_stream(prev)  # the runner's own order: this build after the last sampler
        with torch.cuda.stream(on):
            torch.cuda._sleep(100_000)  # the build's stream lags behind the host
            if graphs and size:
                captured[size].replay()
            else:
                be.build(size)
            md = bufs.views(plan.num_reqs, size)
            snaps.append({f: getattr(md, f).clone() for f in FIELDS})
            wants.append(expected(rows, size, block_size=BS, max_blocks=W))
            toks = torch.from_numpy(gen.sampled(rows)).pin_memory()
            keep.append(toks)
            bufs.sampled[: len(rows)].copy_(toks, non_blocking=True)  # the sampler
        prev = on
    torch.cuda.synchronize()
    for k, (snap, want) in enumerate(zip(snaps, wants)):
        for f in FIELDS:
            assert snap[f].cpu().numpy().tolist() == want[f].tolist(), (k, f)
    return be


@cuda_only
@pytest.mark.parametrize("staging", ["mapped", "copy"])
@pytest.mark.parametrize("schedule", ["side", "alternate"])
def test_eager_build_on_a_second_stream_matches_truth(staging, schedule):
    be = _build_elsewhere(3, staging=staging, graphs=False, schedule=schedule)
    assert be.build_order.joined and be.build_order.off_stream_builds > 0


@cuda_only
@pytest.mark.parametrize("staging", ["mapped", "copy"])
@pytest.mark.parametrize("schedule", ["side", "alternate"])
def test_graph_replayed_on_a_second_stream_matches_truth(staging, schedule):
    be = _build_elsewhere(5, staging=staging, graphs=True, schedule=schedule)
    assert be.build_order.joined
