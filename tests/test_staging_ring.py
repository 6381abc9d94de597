"""The sparse record and the zero-copy staging ring, on any device.

The packer's work is O(changed rows) (a row that keeps its request and gets no block is
neither visited nor listed), the sparse record builds the same buffers as the dense one in
both backends, and the ring's slots, fences and device-side step counter hold with up to K
steps in flight: on the CPU a simulated stream defers every build and fence until the host
waits for one, so a slot rewritten too early would show in the metadata."""
import dataclasses

import numpy as np
import pytest
import torch

from zos import (
    BucketTable,
    DecodeBuffers,
    DecodeStep,
    DeviceMetadataBackend,
    HostMetadataBackend,
    StepPacker,
    device_backend,
    kernels,
    staging,
)
from zos.staging_ring import DoneWordFences, MappedPointer, StagingRing

from helpers import DEVICE, Req, TraceGen, expected

BS, W, NUM_BLOCKS, VOCAB = 4, 6, 400, 1000
FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
          "block_table", "counts")
ROW_STATE = FIELDS + ("num_blocks_per_row",)


def packer(r=24, w=W, bs=BS, dense=False):
    p = StepPacker(max_num_reqs=r, uniform_decode_query_len=1, block_size=bs,
                   max_num_blocks_per_req=w, num_kv_blocks=NUM_BLOCKS, vocab_size=VOCAB)
    p.list_every_row = dense
    return p


def pack(p, step, out):
    return p.pack(step.req_ids, step.new_rows, step.new_tokens, step.new_positions,
                  step.new_block_indptr, step.new_block_ids, step.append_rows,
                  step.append_block_ids, out, rewrite_rows=step.rewrite_rows,
                  rewrite_block_indptr=step.rewrite_block_indptr,
                  rewrite_block_ids=step.rewrite_block_ids)


def spoil(step, rng):
    """``step`` made invalid one way or another (a dropped append, a bad block id, a
    duplicate request id, a rewritten row's block id past the pool or a rewritten row also
    appended to), or None when it has nothing to spoil that way."""
    kind = int(rng.integers(0, 5))
    rw = (step.rewrite_rows, step.rewrite_block_indptr, step.rewrite_block_ids)
    if kind == 3 and len(step.rewrite_block_ids):
        ids = step.rewrite_block_ids.copy()
        ids[0] = NUM_BLOCKS
        return DecodeStep(step.req_ids, step.new_rows, step.new_tokens, step.new_positions,
                          step.new_block_indptr, step.new_block_ids, step.append_rows,
                          step.append_block_ids, rw[0], rw[1], ids)
    if kind == 4 and len(step.rewrite_rows):
        return DecodeStep(step.req_ids, step.new_rows, step.new_tokens, step.new_positions,
                          step.new_block_indptr, step.new_block_ids,
                          np.append(step.append_rows, step.rewrite_rows[:1]),
                          np.append(step.append_block_ids, np.int32(1)), *rw)
    if kind == 0 and len(step.append_rows):
        return DecodeStep(step.req_ids, step.new_rows, step.new_tokens, step.new_positions,
                          step.new_block_indptr, step.new_block_ids, step.append_rows[1:],
                          step.append_block_ids[1:], *rw)
    if kind == 1 and len(step.new_block_ids):
        ids = step.new_block_ids.copy()
        ids[-1] = NUM_BLOCKS
        return DecodeStep(step.req_ids, step.new_rows, step.new_tokens, step.new_positions,
                          step.new_block_indptr, ids, step.append_rows, step.append_block_ids,
                          *rw)
    if kind == 2 and step.num_reqs >= 2:
        ids = step.req_ids.copy()
        ids[-1] = ids[0]
        return DecodeStep(ids, step.new_rows, step.new_tokens, step.new_positions,
                          step.new_block_indptr, step.new_block_ids, step.append_rows,
                          step.append_block_ids, *rw)
    return None


@pytest.mark.parametrize("rewrite", [0.0, 0.2])
@pytest.mark.parametrize("seed", range(5))
def test_packer_sparse_record_equals_dense_record(seed, rewrite):
    """On seeded traces with invalid steps mixed in, the sparse and the dense packer accept
    and refuse the same steps (same message) and their records say the same for every row;
    with ``rewrite``, carried rows' block lists are also rewritten (DecodeStep.rewrite_rows)."""
    gen = TraceGen(seed, max_num_reqs=24, block_size=BS, max_blocks=W,
                   num_kv_blocks=NUM_BLOCKS, vocab=VOCAB, big=True, rewrite=rewrite)
    sparse, dense = packer(), packer(dense=True)
    rng = np.random.default_rng(seed + 100)
    out_s, out_d = np.zeros(8192, np.int32), np.zeros(8192, np.int32)
    refused, rewritten, refused_rewrites = 0, 0, 0
    for _ in range(250):
        step, rows = gen.next_step()
        bad = spoil(step, rng) if rng.random() < 0.2 else None
        if bad is not None:
            msgs = []
            for p, out in ((sparse, out_s), (dense, out_d)):
                before = out.copy()
                with pytest.raises(ValueError) as err:
                    pack(p, bad, out)
                assert (out == before).all()  # nothing written
                msgs.append(str(err.value))
            assert msgs[0] == msgs[1]
            refused += 1
            refused_rewrites += "rewrite" in msgs[0]
        ws, wd = pack(sparse, step, out_s), pack(dense, step, out_d)
        vs, vd = staging.parse(out_s[:ws]), staging.parse(out_d[:wd])
        assert len(vd.listed) == step.num_reqs
        assert len(vs.listed) == int(((vs.row_src != np.arange(step.num_reqs))
                                      | (vs.row_rec >= 0)).sum())
        assert (vs.listed[:, staging.L_ROW] == np.sort(vs.listed[:, staging.L_ROW])).all()
        for f in ("row_src", "row_rec", "records", "blocks"):
            assert getattr(vs, f).tolist() == getattr(vd, f).tolist(), f
        head = [staging.NUM_REQS, staging.NUM_TOKENS, staging.PREV_REQS, staging.NUM_RECORDS,
                staging.NUM_BLOCK_IDS, staging.Q]
        assert out_s[head].tolist() == out_d[head].tolist()
        rewritten += len(step.rewrite_rows)
        gen.sampled(rows)
    assert refused > 10
    assert (rewritten > 50 and refused_rewrites >= 2) if rewrite else rewritten == 0


@pytest.mark.parametrize("due_row", [5, 129])  # in a whole chunk of 64 rows, in the last chunk
@pytest.mark.parametrize("fails_in", ["rewrite", "capacity"])
def test_a_refused_pack_leaves_no_row_marked_touched(due_row, fails_in):
    """A pack that appends to the one row whose blocks run out, then is refused after it
    marked the rows it touches (a rewritten list too short for its row, or a record larger
    than ``out``), must not leave that row marked: the next pack, which forgets the append,
    is refused naming the row, and the one after, with the append, is accepted."""
    n, bs, w = 130, 4, 8
    p = packer(r=n, w=w, bs=bs)
    out = np.zeros(staging.capacity_words(n, w), np.int32)
    ids = list(range(1000, 1000 + n))
    # Every row at position 0 with 2 blocks, except due_row at 3 with 1: its deadline is now.
    new = {i: (7, 0, [1 + 2 * i, 2 + 2 * i]) for i in range(n)}
    new[due_row] = (7, 3, [1 + 2 * due_row])
    pack(p, DecodeStep.build(ids, new), out)
    append = [(due_row, 399)]
    if fails_in == "rewrite":  # row 100 at position 1 keeps 0 blocks: refused when computed
        bad = DecodeStep.build(ids, appends=append, rewrites={100: []})
        with pytest.raises(ValueError, match="row 100 .*needs 1 blocks, got 0"):
            pack(p, bad, out)
    else:
        with pytest.raises(ValueError, match="capacity"):
            pack(p, DecodeStep.build(ids, appends=append), out[:8])
    with pytest.raises(ValueError, match=f"row {due_row} .*append a block"):
        pack(p, DecodeStep.build(ids), out)
    words = pack(p, DecodeStep.build(ids, appends=append), out)
    assert staging.parse(out[:words]).listed.tolist() == [[due_row, due_row, 0]]


@pytest.mark.parametrize("bs,w", [(2 ** 20, 2 ** 11), (2 ** 30, 2), (1, 2 ** 31)])
def test_packer_refuses_a_request_reaching_int32_seq_lens(bs, w):
    """seq_lens are int32 and a row's seq_len reaches max_num_blocks_per_req * block_size:
    a configuration whose requests could span 2^31 tokens is refused at construction."""
    with pytest.raises(ValueError, match=r"max_num_blocks_per_req \* block_size must be < 2\^31"):
        packer(r=1, w=w, bs=bs)


@pytest.mark.parametrize("backend_cls", [DeviceMetadataBackend, HostMetadataBackend])
def test_packer_accepts_seq_lens_up_to_int32_max(backend_cls):
    """One block of 2^31 - 1 tokens: position 2^31 - 3 then, carried, the last position
    2^31 - 2, whose seq_len is 2^31 - 1, the largest int32 (built by each backend); the
    position after it is refused."""
    bs = 2 ** 31 - 1
    backend = backend_cls(DecodeBuffers(1, 1, bs, device=DEVICE), num_kv_blocks=3,
                          vocab_size=VOCAB)
    md = backend.prepare(DecodeStep.build([7], {0: (1, bs - 2, [2])}))
    assert (md.positions.tolist(), md.seq_lens.tolist()) == ([bs - 2], [bs - 1])
    md = backend.prepare(DecodeStep.build([7]))
    assert (md.positions.tolist(), md.seq_lens.tolist()) == ([bs - 1], [bs])
    assert md.slot_mapping.tolist() == [2 * bs + bs - 1]
    with pytest.raises(ValueError, match=f"reaches position {bs}"):
        backend.prepare(DecodeStep.build([7]))
    assert md.seq_lens.tolist() == [bs]  # nothing written


@pytest.mark.parametrize("bs,w", [(16, 8), (5, 7), (1, 40)])
def test_unchanged_rows_cost_no_visit(bs, w):
    """A steady batch: every step the packer visits only the rows that cross into a block
    (once as changed rows, once as rows whose deadline is now), lists only them, and a step that
    forgets one such append is refused naming it, with nothing committed."""
    n = 64
    p = packer(r=n, w=w, bs=bs)
    out = np.zeros(staging.capacity_words(n, w), np.int32)
    pos = [(3 * i) % (w * bs // 2) for i in range(n)]
    blocks = [[1 + (i * w + c) % (NUM_BLOCKS - 1) for c in range(pos[i] // bs + 1)]
              for i in range(n)]
    ids = list(range(500, 500 + n))
    pack(p, DecodeStep.build(ids, {i: (7, pos[i], blocks[i]) for i in range(n)}), out)
    crossed = 0
    for _ in range(w * bs // 2 - 1):
        pos = [x + 1 for x in pos]
        appends = [(i, 1 + (i * w + pos[i] // bs) % (NUM_BLOCKS - 1)) for i in range(n)
                   if pos[i] % bs == 0]
        step = DecodeStep.build(ids, appends=appends)
        if appends:
            forgot = DecodeStep.build(ids, appends=appends[1:])
            row = appends[0][0]
            with pytest.raises(ValueError, match=f"row {row} .*append a block"):
                pack(p, forgot, out)
        words = pack(p, step, out)
        a = len(appends)
        assert p.rows_visited == 2 * a
        assert words == staging.total_words(a, a, a)
        view = staging.parse(out[:words])
        assert view.listed.tolist() == [[i, i, k] for k, (i, _) in enumerate(appends)]
        crossed += a
    assert crossed >= n


def make(kind, *, dense=False, **kw):
    bufs = DecodeBuffers(24, W, BS, device=DEVICE)
    common = dict(num_kv_blocks=NUM_BLOCKS, vocab_size=VOCAB, buckets=BucketTable([4, 8, 16]))
    if kind == "host":
        be = HostMetadataBackend(bufs, **common)
        be.packer.list_every_row = dense
        return be
    return DeviceMetadataBackend(bufs, staging=kind, dense_record=dense, **common, **kw)


@pytest.mark.parametrize("rewrite", [0.0, 0.25])
@pytest.mark.parametrize("seed", range(2))
def test_sparse_and_dense_records_build_identical_buffers(seed, rewrite):
    """Both backends, sparse and dense records, mapped ring and copy: identical metadata (and
    identical device row state between the device variants) after every step, equal to the
    truth; with ``rewrite``, carried rows' block lists are also rewritten."""
    gen = TraceGen(seed, max_num_reqs=24, block_size=BS, max_blocks=W,
                   num_kv_blocks=NUM_BLOCKS, vocab=VOCAB, big=True, rewrite=rewrite)
    device = [make("mapped"), make("copy", dense=True), make("mapped", dense=True, ring_slots=1)]
    host = [make("host"), make("host", dense=True)]
    for _ in range(16):
        step, rows = gen.next_step()
        mds = [b.prepare(step) for b in device + host]
        padded = {md.padded_size for md in mds}
        assert len(padded) == 1
        want = expected(rows, padded.pop(), block_size=BS, max_blocks=W)
        for md in mds:
            for f in FIELDS:
                assert getattr(md, f).cpu().numpy().tolist() == want[f].tolist(), f
        for f in ROW_STATE:
            ref = getattr(device[0].buffers, f).cpu()
            for b in device[1:]:
                assert torch.equal(getattr(b.buffers, f).cpu(), ref), f
        toks = torch.from_numpy(gen.sampled(rows)).to(DEVICE)
        for b in device + host:
            b.buffers.sampled[: len(rows)] = toks


# --- the ring, with steps held in flight on a simulated stream (CPU) --------------------------

class HeldStream:
    """A stream whose work runs only when the host waits for a fence: a stalled GPU."""

    def __init__(self):
        self.queue = []
        self.builds_done = 0

    def enqueue(self, fn):
        self.queue.append(fn)

    def run_one(self):
        self.queue.pop(0)()

    @classmethod
    def holding_builds(cls, monkeypatch):
        """A held stream that the device backend's builds (its ``launch_prep``) are enqueued
        on: each runs, and counts in ``builds_done``, only when the stream runs it."""
        stream, real = cls(), device_backend.launch_prep

        def deferred(*args, **kw):
            def run():
                real(*args, **kw)
                stream.builds_done += 1
            stream.enqueue(run)

        monkeypatch.setattr(device_backend, "launch_prep", deferred)
        return stream


class HeldFences(DoneWordFences):
    """The ring's acquire logic over ``HeldStream``: a wait runs the stream until the build of
    the slot's record has written the done word. Checks at each acquire that the build that
    last read the slot has run."""

    def __init__(self, ring, stream):
        super().__init__(ring.slots, ring.done_view.numpy())
        self.stream = stream
        self.acquires = self.drains = 0

    def wait(self, seq, newest):
        while not self.applied(seq, newest):
            self.stream.run_one()

    def drain(self):  # a fence after everything enqueued so far
        self.drains += 1
        while self.stream.queue:
            self.stream.run_one()

    def acquire(self, stream=0):
        slot = super().acquire(stream)
        assert slot == self.acquires % self.num_slots
        # Step n writes slot n mod K: the build of step n - K, which read it, has run.
        assert self.stream.builds_done >= self.acquires - self.num_slots + 1
        self.acquires += 1
        return slot


@pytest.mark.skipif(DEVICE != "cpu", reason="simulates the stream on the CPU")
@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_ring_steps_in_flight(monkeypatch, num_slots):
    """Up to K builds in flight, the host wrapping the ring several times: each slot is
    rewritten only after its fence, the host waits only when K steps ahead, and every step's
    metadata (read when its build runs) equals the truth."""
    stream = HeldStream.holding_builds(monkeypatch)
    dev = make("mapped", ring_slots=num_slots)
    fences = dev.ring.fences = HeldFences(dev.ring, stream)
    gen = TraceGen(7, max_num_reqs=24, block_size=BS, max_blocks=W, num_kv_blocks=NUM_BLOCKS,
                   vocab=VOCAB)
    got, truth = [], []
    steps = 3 * num_slots + 4
    for n in range(steps):
        step, rows = gen.next_step()
        truth.append([Req(r.rid, r.token, r.pos, list(r.blocks)) for r in rows])
        plan = dev.stage(step)
        dev.build(plan.padded_size)
        assert n + 1 - stream.builds_done == min(n + 1, num_slots)  # builds in flight
        md = dev.metadata(plan)
        stream.enqueue(lambda md=md: got.append(
            (md.padded_size, {f: getattr(md, f).clone() for f in FIELDS})))
        toks = torch.from_numpy(gen.sampled(rows))
        stream.enqueue(lambda toks=toks: dev.buffers.sampled[: len(toks)].copy_(toks))
    while stream.queue:
        stream.run_one()
    assert fences.waits == steps - num_slots
    for rows, (padded, fields) in zip(truth, got):
        want = expected(rows, padded, block_size=BS, max_blocks=W)
        for f in FIELDS:
            assert fields[f].numpy().tolist() == want[f].tolist(), f
    state = dev._prep.state.tolist()
    assert state[kernels.RING_STATE["CTR"]] == steps % num_slots
    assert state[kernels.RING_STATE["LAST"]] == steps


@pytest.mark.skipif(DEVICE != "cpu", reason="simulates the stream on the CPU")
@pytest.mark.parametrize("num_slots", [1, 2])
def test_repeated_build_is_waited_for_before_a_slot_is_rewritten(monkeypatch, num_slots):
    """A build with no stage since the previous one applies the same record again and writes
    a SEQ the done word already holds: the next stage waits for it (by a fence after every
    build enqueued so far) before it rewrites a slot; with K = 1 that is the slot the repeat
    reads. The step after it gets its own record."""
    stream = HeldStream.holding_builds(monkeypatch)
    dev = make("mapped", ring_slots=num_slots)
    fences = dev.ring.fences = HeldFences(dev.ring, stream)
    plan = dev.stage(DecodeStep.build([5], {0: (11, 1, [7])}))
    dev.build(plan.padded_size)
    stream.run_one()  # record 1 built: the done word holds 1
    dev.build(plan.padded_size)  # the repeat, held in the stream
    assert dev.ring.done_seq == 1 and len(stream.queue) == 1 and fences.drains == 0
    plan = dev.stage(DecodeStep.build([5]))
    assert not stream.queue and stream.builds_done == 2 and fences.drains == 1
    dev.build(plan.padded_size)
    stream.run_one()
    assert dev.buffers.positions[:1].tolist() == [2] and dev.ring.done_seq == 2
    assert dev.buffers.input_ids[:1].tolist() == [int(dev.buffers.sampled[0])]


def test_ring_build_without_new_record_and_empty_step():
    """A build with no new record (warm-up) applies the last record again and leaves the ring
    state; a step of padded size 0 takes no slot; a refused step writes no slot."""
    dev = make("mapped", ring_slots=2)
    state = dev._prep.state
    dev.build(4)  # nothing staged: the all-zero slot, N = 0, dummy rows only
    assert dev.buffers.counts.tolist() == [0, 0] and state.tolist()[:2] == [0, 0]
    first = DecodeStep.build([5, 6], {0: (11, 3, [7]), 1: (12, 0, [8])})
    md = dev.prepare(first)
    assert md.positions[:2].tolist() == [3, 0] and state.tolist()[:2] == [1, 1]
    assert dev.ring.seq_of(0) == 1
    dev.buffers.sampled[:2] = torch.tensor([21, 22], dtype=torch.int32, device=DEVICE)
    plan = dev.stage(DecodeStep.build([]))  # padded size 0: validated, no slot
    assert plan.padded_size == 0 and dev.last_upload_bytes == 0
    dev.build(0)
    assert dev.buffers.counts.tolist() == [0, 0] and state.tolist()[:2] == [1, 1]
    slots = dev.ring.slots.copy()
    with pytest.raises(ValueError, match="block id 0 outside"):
        dev.stage(DecodeStep.build([9], {0: (1, 0, [0])}))
    assert (dev.ring.slots == slots).all()
    md = dev.prepare(DecodeStep.build([9], {0: (13, 5, [9, 10])}))
    assert state.tolist()[:2] == [0, 2] and dev.ring.seq_of(1) == 2
    assert md.input_ids.tolist() == [13, 0, 0, 0] and md.positions[:1].tolist() == [5]
    assert md.slot_mapping[:1].tolist() == [10 * BS + 5 % BS]  # column 1: block 10
    dev.build(4)  # repeated without a new record: the same record again, state unchanged
    assert md.positions[:1].tolist() == [5] and state.tolist()[:2] == [0, 2]


def test_ring_arguments():
    with pytest.raises(ValueError, match="ring_slots: must be >= 1, got 0"):
        make("mapped", ring_slots=0)
    with pytest.raises(ValueError, match="staging must be one of"):
        make("zero-copy")
    with pytest.raises(ValueError, match="num_slots: must be >= 1, got 0"):
        StagingRing(0, 8, torch.device("cpu"))


@pytest.mark.skipif(DEVICE != "cuda", reason="the native ring maps memory through CUDA")
def test_stage_call_into_the_native_ring():
    """``StepPacker.stage_call``'s function writes the record ``pack`` writes into slot n mod K with
    its SEQ; a refused step neither writes nor commits a slot; a slot is taken again only
    once the done word (written here by a one-word kernel queued behind a stalled stream, as
    a build would) has reached its record's SEQ, and the host waits only when K steps ahead."""
    import triton
    import triton.language as tl

    from zos._C import MappedRing
    from zos.serving.profiling import gpu_busy

    @triton.jit(do_not_specialize=["value"])  # one compile for every value (1 included)
    def set_word(ptr, value):
        tl.store(ptr, value)

    ring, ref = MappedRing(2, 256, torch.cuda.current_device()), packer()
    p, out = packer(), np.zeros(256, np.int32)
    slots, done = ring.array(), MappedPointer(ring.done_device_ptr)
    stream = torch.cuda.current_stream().cuda_stream
    stage = p.stage_call(ring, stream, torch.cuda.current_device())
    # Request 5 is at position 3 (block [7], 4 tokens per block): it moves to row 1 at
    # position 4 in the second step, which opens block column 1, so that step appends.
    steps = [DecodeStep.build([5, 6], {0: (1, 3, [7]), 1: (2, 0, [8])}),
             DecodeStep.build([6, 5], appends=[(1, 9)]), DecodeStep.build([6, 5])]
    set_word[(1,)](done, 0)  # compiled now, not while the stream below is stalled
    torch.cuda.synchronize()
    elapsed = torch.zeros(1, dtype=torch.int64, device="cuda")
    gpu_busy(200_000, elapsed)  # 0.2 s: the "builds" queued below stay pending
    for n, step in enumerate(steps):
        words = stage(step, n + 1)
        assert words == pack(ref, step, out)
        out[staging.SEQ] = n + 1
        assert slots[n % 2, :words].tolist() == out[:words].tolist()
        if n == 0:
            before = slots.copy()
            with pytest.raises(ValueError, match="appears twice"):
                stage(dataclasses.replace(step, req_ids=np.array([5, 5], np.int64)), 9)
            assert (slots == before).all()
        set_word[(1,)](done, n + 1)  # the build of record n + 1
    assert ring.waits == 1  # the third step's slot held the first record, built after 0.2 s
    assert ring.done_seq >= 1
    ring.synchronize()
    assert ring.done_seq == 3


def test_stage_call_checks_its_binding():
    """``stage_call`` refuses a negative device and a sink that is neither a ring nor an
    upload, before anything (no CUDA needed to refuse)."""
    with pytest.raises(ValueError, match="device must be >= 0, got -1"):
        packer().stage_call(object(), 0, -1)
    with pytest.raises(TypeError, match="sink must be a zos._C.MappedRing or "
                                        "zos._C.PinnedUpload, got <class 'object'>"):
        packer().stage_call(object(), 0, 0)


@pytest.mark.skipif(DEVICE != "cuda", reason="the native ring maps memory through CUDA")
def test_stage_call_refuses_bad_arguments_and_capturing_streams_before_anything():
    """The stage call's arguments, and that its stream is not capturing a CUDA graph, are
    checked before anything: no slot written or committed, the packer's mirror unchanged (the
    next step, whose carried rows only the mirror knows, stages afterwards), no graph
    launched (a bogus graph handle shows it)."""
    from zos._C import MappedRing

    ring, p = MappedRing(2, 256, torch.cuda.current_device()), packer()
    side = torch.cuda.Stream()
    stage = p.stage_call(ring, side.cuda_stream, torch.cuda.current_device())
    assert stage(DecodeStep.build([5, 6], {0: (1, 3, [7]), 1: (2, 0, [8])}), 1) > 0
    step = DecodeStep.build([6, 5], appends=[(1, 9)])  # carried rows: no payload of their own
    before = ring.array().copy()
    bad = [((step,), TypeError, r"stage\(step, seq, graph_exec=0, /\) takes 2 or 3 "
                                r"arguments, got 1"),
           ((step, "2"), TypeError, "seq must be an int, got str"),
           ((step, True), TypeError, "seq must be an int, got bool"),
           ((step, -1), ValueError, r"seq must be in \[0, 1073741823\], got -1"),
           ((step, 1 << 30), ValueError, r"seq must be in \[0, 1073741823\], got 1073741824"),
           ((step, 2, -5), ValueError, r"graph_exec must be in \[0, 9223372036854775807\], "
                                       "got -5"),
           ((object(), 2), TypeError, "step must be a zos.DecodeStep")]
    for args, err, msg in bad:
        with pytest.raises(err, match=msg):
            stage(*args)
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=side):
        for exec_ in (0, 12345):
            with pytest.raises(RuntimeError, match="stage: the backend's stream is capturing"):
                stage(step, 2, exec_)
    assert (ring.array() == before).all() and p.prev_num_reqs == 2 and ring.waits == 0
    assert stage(step, 2) > 0
    assert ring.array()[0, staging.SEQ] == 1 and ring.array()[1, staging.SEQ] == 2


@pytest.mark.parametrize("num_slots", [1, 3])
def test_stage_without_build_is_refused(num_slots):
    """Rule 2 of the runner contract, checked where it bites: a stage that needs the slot of a
    record staged and never built raises RuntimeError (on CUDA once the stream has drained
    without the build: no hang), and the next step, all new rows, runs normally."""
    dev = make("mapped", ring_slots=num_slots)
    for i in range(num_slots):  # K records staged, none built
        dev.stage(DecodeStep.build([10 + i], {0: (1, 0, [9])}))
    slots = dev.ring.slots.copy()
    with pytest.raises(RuntimeError, match="staged but no build read it"):
        dev.stage(DecodeStep.build([20], {0: (3, 1, [9])}))
    assert (dev.ring.slots == slots).all() and dev.prev_num_reqs == 0  # packer reset
    for _ in range(num_slots):  # the device applies the stale records in order, then catches up
        dev.build(4)
    md = dev.prepare(DecodeStep.build([21], {0: (4, 2, [10])}))
    assert md.input_ids[:1].tolist() == [4] and md.positions[:1].tolist() == [2]
    assert dev.ring.done_seq == num_slots + 1


def steady_steps(n, w, bs, num_steps, seed):
    """A bench-like decode trace of ``n`` rows (bench/workload.py in small): the first step
    has every row new with a full block-table row of ``w`` blocks (the largest record a slot
    must hold: capacity_words(n, w) words), then every row advances one token, rows that
    open a block get one appended, and 5% of the rows are replaced in place by arrivals."""
    rng = np.random.default_rng(seed)
    ids, pos, nb = np.arange(1, n + 1), rng.integers(w * bs - bs, w * bs - 8, n), np.full(n, w)
    base = 1 + np.arange(n) * w  # request i's blocks: [base, base + w), all distinct
    next_id = n + 1
    steps = [DecodeStep.build(ids.copy(), {r: (int(rng.integers(0, VOCAB)), int(pos[r]),
                                               range(int(base[r]), int(base[r] + w)))
                                           for r in range(n)})]
    for _ in range(num_steps - 1):
        pos += 1
        done = pos + 1 > w * bs
        done[rng.choice(n, max(1, n // 20), replace=False)] = True
        new = {}
        for r in np.flatnonzero(done):
            ids[r], next_id = next_id, next_id + 1
            pos[r] = int(rng.integers(0, w * bs - 8))
            nb[r] = pos[r] // bs + 1
            new[int(r)] = (int(rng.integers(0, VOCAB)), int(pos[r]),
                           range(int(base[r]), int(base[r] + nb[r])))
        grow = np.flatnonzero(~done & (pos // bs >= nb))
        appends = [(int(r), int(base[r] + nb[r])) for r in grow]
        nb[grow] += 1
        steps.append(DecodeStep.build(ids.copy(), new, appends))
    return steps


@pytest.mark.skipif(DEVICE != "cpu", reason="simulates the stream on the CPU")
def test_ring_full_record_at_512_rows_with_builds_in_flight(monkeypatch):
    """N = 512 (the size the H200 bench first failed at): the first record fills a slot to
    capacity_words exactly (every row new with a full block-table row), later steps replace
    5% of the rows and append blocks; the host runs K = 4 steps ahead of a held stream, so
    every slot is rewritten while the other three are in flight. Each step's buffers equal
    the host backend's, field by field."""
    n, w, bs, k = 512, 8, 16, 4
    steps = steady_steps(n, w, bs, k + 2, seed=512)
    common = dict(num_kv_blocks=1 + n * w, vocab_size=VOCAB,
                  buckets=BucketTable([256, 512]))
    host = HostMetadataBackend(DecodeBuffers(n, w, bs, device=DEVICE), **common)
    stream = HeldStream.holding_builds(monkeypatch)
    dev = DeviceMetadataBackend(DecodeBuffers(n, w, bs, device=DEVICE), staging="mapped",
                                ring_slots=k, **common)
    fences = dev.ring.fences = HeldFences(dev.ring, stream)
    got, want = [], []
    for i, step in enumerate(steps):
        plan = dev.stage(step)
        if i == 0:
            assert dev.last_upload_bytes == 4 * staging.capacity_words(n, w) == \
                4 * dev.ring.slot_words
        dev.build(plan.padded_size)
        md = dev.metadata(plan)
        stream.enqueue(lambda md=md: got.append({f: getattr(md, f).clone() for f in FIELDS}))
        ref = host.prepare(step)
        want.append({f: getattr(ref, f).clone() for f in FIELDS})
    while stream.queue:
        stream.run_one()
    assert fences.waits == len(steps) - k
    for i, (g, h) in enumerate(zip(got, want)):
        for f in FIELDS:
            assert torch.equal(g[f], h[f]), (i, f)


@pytest.mark.skipif(DEVICE != "cuda", reason="the native ring maps memory through CUDA")
def test_native_ring_on_a_fresh_thread():
    """A ring built and used on a thread that has not touched CUDA (transformers' continuous
    batching runs its loop on a background thread) takes its device's primary context
    itself: slots are written there, a repeated build's fence is recorded and waited for there,
    and a stage whose slot holds a record never built polls its fence there and is refused
    (records 1 and 2 staged, only 1 "built" by the host writing the done word)."""
    import threading

    out = {}

    def run():
        try:
            ring = StagingRing(2, 64, torch.device("cuda", torch.cuda.current_device()))
            stream = torch.cuda.current_stream().cuda_stream
            for n in range(2):
                ring.fences.fence_repeat()  # the next acquire records and waits for a fence
                ring.acquire(stream)[staging.SEQ] = n + 1
                ring.commit()
            ring.fences.done_array()[0] = 1  # record 1's build finished: slot 0 is free
            ring.acquire(stream)[staging.SEQ] = 3
            ring.commit()
            with pytest.raises(RuntimeError, match="staged but no build read it"):
                ring.acquire(stream)  # slot 1 holds record 2, which no build read
            out["seqs"] = ring.slots[:, staging.SEQ].tolist()
            out["waits"] = ring.waits
        except BaseException as e:  # re-raised on the test's thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert "error" not in out, out.get("error")
    assert out["seqs"] == [3, 2] and out["waits"] == 1
