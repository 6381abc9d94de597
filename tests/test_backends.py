"""Both metadata backends against the per-request truth, step after step: seeded traces,
traces drawn by hypothesis over odd sizes, hand-written cases, bad input, and two backends
taking the same buffers over one after the other."""
import gc
import threading
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zos import BucketTable, DecodeBuffers, DecodeStep, DeviceMetadataBackend, HostMetadataBackend

from helpers import DEVICE, Req, TraceGen, collect_inside_a_runners_capture, expected

BS, W, NUM_BLOCKS, VOCAB = 4, 6, 400, 1000
FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
          "block_table", "counts")
BACKENDS = {"device": DeviceMetadataBackend, "host": HostMetadataBackend}


def make(kind, max_num_reqs=24, buckets=(1, 2, 4, 8, 16), capture=False, *, block_size=BS,
         max_blocks=W, num_kv_blocks=NUM_BLOCKS, **buffer_kw):
    bufs = DecodeBuffers(max_num_reqs, max_blocks, block_size, device=DEVICE, **buffer_kw)
    table = BucketTable(list(buckets)) if buckets else None
    kw = dict(capture_prep=capture) if kind == "device" else {}
    return BACKENDS[kind](bufs, num_kv_blocks=num_kv_blocks, vocab_size=VOCAB, buckets=table,
                          **kw)


def check(md, rows, padded, **truth_kw):
    want = expected(rows, padded, **{"block_size": BS, "max_blocks": W, **truth_kw})
    for f in FIELDS:
        got = getattr(md, f).cpu().numpy()
        assert got.tolist() == want[f].tolist(), f


CAPTURE = [False, True] if DEVICE == "cuda" else [False]


@pytest.mark.parametrize("capture", CAPTURE)
@pytest.mark.parametrize("seed", range(6))
def test_random_trace_matches_truth(seed, capture):
    gen = TraceGen(seed, max_num_reqs=24, block_size=BS, max_blocks=W, num_kv_blocks=NUM_BLOCKS,
                   vocab=VOCAB, big=True)
    dev, host = make("device", capture=capture), make("host")
    paths = set()
    for _ in range(40):
        step, rows = gen.next_step()
        md, mh = dev.prepare(step), host.prepare(step)
        paths.add(dev.plan(step.num_reqs).bucketed)
        check(md, rows, md.padded_size)
        check(mh, rows, mh.padded_size)
        toks = torch.from_numpy(gen.sampled(rows))
        for b in (dev, host):
            b.buffers.sampled[: len(rows)] = toks.to(DEVICE)
    assert paths == {True, False}, "trace must cover bucketed and eager (too large) steps"


# --- carried rows whose earlier blocks the runner rewrote (issue 15, kind 1) ------------------

@pytest.mark.parametrize("seed", range(4))
def test_random_trace_with_rewritten_rows_matches_truth(seed):
    """Carried rows whose block lists change other than by an append (blocks swapped for free
    ones, shared with other rows, permuted; in place, moved, with a block crossed the same
    step): both backends equal the per-request truth at every step."""
    gen = TraceGen(seed, max_num_reqs=24, block_size=BS, max_blocks=W, num_kv_blocks=NUM_BLOCKS,
                   vocab=VOCAB, big=True, rewrite=0.25)
    dev, host = make("device"), make("host")
    prev, rewritten, moved = [], 0, 0
    for _ in range(30):
        step, rows = gen.next_step()
        for b in (dev, host):
            md = b.prepare(step)
            check(md, rows, md.padded_size)
        rewritten += len(step.rewrite_rows)
        moved += sum(1 for i in step.rewrite_rows.tolist()
                     if i >= len(prev) or prev[i] != rows[i].rid)
        prev = [r.rid for r in rows]
        toks = torch.from_numpy(gen.sampled(rows)).to(DEVICE)
        for b in (dev, host):
            b.buffers.sampled[: len(rows)] = toks
    assert rewritten >= 20 and moved >= 3, (rewritten, moved)


def _run_script(kind, script):
    """Feeds ``script`` (per step: req_ids, new, appends, rewrites) to a backend; the truth of
    each request is kept by id (tokens sampled: 100 + row). Returns each step's metadata."""
    b = make(kind, max_num_reqs=4, buckets=(4,))
    truth, got = {}, []
    for req_ids, new, appends, rewrites in script:
        for i, rid in enumerate(req_ids):
            if i in new:
                truth[rid] = Req(rid, new[i][0], new[i][1], list(new[i][2]))
            elif i in rewrites:
                truth[rid].blocks = list(rewrites[i])
        for i, blk in appends:
            truth[req_ids[i]].blocks.append(blk)
        rows = [truth[rid] for rid in req_ids]
        md = b.prepare(DecodeStep.build(req_ids, new, appends, rewrites))
        check(md, rows, md.padded_size)
        got.append({f: getattr(md, f).tolist() for f in ("positions", "slot_mapping")})
        got[-1]["block_table"] = md.block_table[: len(rows)].tolist()
        b.buffers.sampled[: len(rows)] = torch.arange(len(rows), dtype=torch.int32) + 100
        for i, r in enumerate(rows):
            r.token, r.pos = 100 + i, r.pos + 1
    return got


REWRITE_SCRIPT = [
    # step 0: request 1 at position 6 (blocks 7, 8), 2 at 3 (block 9), 4 at 1 (20, 21, 22)
    ([1, 2, 4], {0: (5, 6, [7, 8]), 1: (6, 3, [9]), 2: (7, 1, [20, 21, 22])}, [], {}),
    # step 1: request 1's first block swapped for 11, in place; 2 crosses into block 12
    ([1, 2, 4], {}, [(1, 12)], {0: [11, 8]}),
    # step 2: request 1 moves to row 2 and crosses a block within its rewrite (13, 14, 15);
    # request 4 moves to row 0 and shrinks to one block, over a row that held two
    ([4, 2, 1], {}, [], {0: [23], 2: [13, 14, 15]}),
    # step 3: request 4 crosses: appended after its rewritten list; 1 carried, no append
    ([4, 2, 1], {}, [(0, 24)], {}),
    # step 4: request 2 gets blocks ahead (30, 32) by a rewrite
    ([4, 2, 1], {}, [], {1: [9, 12, 30, 32]}),
    # step 5: request 2 shrinks in place with its first block swapped; 1's blocks permuted
    ([4, 2, 1], {}, [], {1: [31, 12, 30], 2: [15, 13, 14]}),
]


def _row(*blocks):
    return list(blocks) + [0] * (W - len(blocks))


@pytest.mark.parametrize("kind", BACKENDS)
def test_rewritten_rows_exact(kind):
    """Hand-written: in place, moved, with a block crossed, growing, shrinking, then carried
    and appended to; exact block tables and slots (block * 4 + position % 4) of every step."""
    got = _run_script(kind, REWRITE_SCRIPT)
    assert got[1]["block_table"][0] == _row(11, 8) and got[1]["slot_mapping"][0] == 35
    assert got[2]["block_table"] == [_row(23), _row(9, 12), _row(13, 14, 15)]
    assert got[2]["positions"][:3] == [3, 5, 8] and got[2]["slot_mapping"][:3] == [95, 49, 60]
    assert got[3]["block_table"][0] == _row(23, 24) and got[3]["slot_mapping"][:3] == [96, 50, 61]
    assert got[4]["block_table"][1] == _row(9, 12, 30, 32)
    assert got[4]["slot_mapping"][:3] == [97, 51, 62]
    assert got[5]["block_table"] == [_row(23, 24), _row(31, 12, 30), _row(15, 13, 14)]
    assert got[5]["slot_mapping"][:3] == [98, 120, 59]


@pytest.mark.skipif(DEVICE != "cuda", reason="a stalled stream needs a GPU")
@pytest.mark.parametrize("capture", [False, True])
def test_stalled_stream_many_steps_in_flight(capture):
    """Overlap's worst case for the two pinned records: a spin kernel stalls the upload stream,
    then 8 steps are staged and built back to back without any host wait, so several copies
    that read a pinned record are pending when the host packs the next one. Every step's
    metadata (copied on the stream right after its build) must equal the truth."""
    from zos.serving.profiling import gpu_busy

    gen = TraceGen(11, max_num_reqs=24, block_size=BS, max_blocks=W, num_kv_blocks=NUM_BLOCKS,
                   vocab=VOCAB, big=True)
    warm = make("device", capture=capture)  # Triton compiles its kernels here, not under the
    warm.prepare(TraceGen(3, max_num_reqs=24, block_size=BS, max_blocks=W,  # stall below
                          num_kv_blocks=NUM_BLOCKS, vocab=VOCAB, big=True).next_step()[0])
    dev = make("device", capture=capture)
    steps = []
    for _ in range(8):
        step, rows = gen.next_step()
        rows = [Req(r.rid, r.token, r.pos, list(r.blocks)) for r in rows]  # truth at this step
        steps.append((step, rows, torch.from_numpy(gen.sampled(gen.rows)).to(DEVICE)))
    torch.cuda.synchronize()
    elapsed = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    spin_done = torch.cuda.Event()
    gpu_busy(300_000, elapsed)  # 0.3 s: far longer than staging 8 steps on the host
    spin_done.record()
    got = []
    for k, (step, rows, toks) in enumerate(steps):
        md = dev.prepare(step)
        got.append((md.padded_size, {f: getattr(md, f).clone() for f in FIELDS}))
        dev.buffers.sampled[: len(rows)].copy_(toks)
        if k == 1:
            assert not spin_done.query(), "the stream must still be stalled after two steps"
    torch.cuda.synchronize()
    assert elapsed.item() >= 300_000_000
    for (_, rows, _), (padded, fields) in zip(steps, got):
        want = expected(rows, padded, block_size=BS, max_blocks=W)
        for f in FIELDS:
            assert fields[f].cpu().numpy().tolist() == want[f].tolist(), f


class DrawRng:
    """The ``numpy.random.Generator`` methods TraceGen calls, each choice drawn from hypothesis
    (so that hypothesis chooses, and shrinks, every arrival, departure and permutation)."""

    def __init__(self, data):
        self.data = data

    def random(self):
        return self.data.draw(st.floats(0, 1, exclude_max=True))

    def integers(self, low, high, size=None):
        ints = st.integers(low, high - 1)
        if size is None:
            return self.data.draw(ints)
        return np.array(self.data.draw(st.lists(ints, min_size=size, max_size=size)), np.int64)

    def choice(self, a, size=None, replace=True):
        if size is None:
            return self.data.draw(st.sampled_from(list(a)))
        assert isinstance(a, int) and not replace  # TraceGen draws distinct rows only
        return np.array(self.data.draw(st.permutations(range(a)))[:size])

    def permutation(self, x):
        return np.array(self.data.draw(st.permutations(range(x) if isinstance(x, int) else x)))


@st.composite
def trace_configs(draw):
    """Odd sizes: buffers of 1 to 11 rows, 1 to 7 block columns of 1 to 5 tokens, a small KV
    pool (arrivals wait and carried rows get preempted for want of blocks), 0 to 3 buckets (no
    bucket: every step eager; steps above the largest bucket run eager too), any pad token and
    seq_len fill, 1 to 10 steps."""
    max_num_reqs = draw(st.integers(1, 11))
    block_size = draw(st.integers(1, 5))
    max_blocks = draw(st.integers(2 if block_size == 1 else 1, 7))  # >= 2 token slots per row
    sizes = draw(st.lists(st.integers(1, max_num_reqs), unique=True, max_size=3)
                 | st.lists(st.integers(1, max_num_reqs), unique=True, min_size=1, max_size=3))
    return dict(max_num_reqs=max_num_reqs, block_size=block_size, max_blocks=max_blocks,
                num_kv_blocks=draw(st.integers(2, 40)), buckets=sorted(sizes),
                pad_token_id=draw(st.integers(0, VOCAB - 1)), seq_len_fill=draw(st.integers(1, 3)),
                num_steps=draw(st.integers(1, 10)), rewrite=draw(st.sampled_from([0.0, 0.3])))


@settings(max_examples=15, deadline=None)
@given(cfg=trace_configs(), data=st.data())
def test_drawn_traces_match_truth(cfg, data):
    """Both backends, fed the same drawn trace, equal the per-request truth on every row of
    the padded step (real rows and dummy rows) at every step."""
    sizes = dict(block_size=cfg["block_size"], max_blocks=cfg["max_blocks"])
    ledger = dict(pad_token_id=cfg["pad_token_id"], seq_len_fill=cfg["seq_len_fill"])
    pool = dict(num_kv_blocks=cfg["num_kv_blocks"])
    backends = [make(kind, cfg["max_num_reqs"], cfg["buckets"], **pool, **sizes, **ledger)
                for kind in BACKENDS]
    gen = TraceGen(DrawRng(data), max_num_reqs=cfg["max_num_reqs"], vocab=VOCAB, big=True,
                   rewrite=cfg["rewrite"], **pool, **sizes)
    for _ in range(cfg["num_steps"]):
        step, rows = gen.next_step()
        n = len(rows)
        padded = n and min((s for s in cfg["buckets"] if s >= n), default=n)
        for b in backends:
            md = b.prepare(step)
            assert (md.num_reqs, md.padded_size) == (n, padded)
            check(md, rows, padded, **sizes, **ledger)
        toks = torch.from_numpy(gen.sampled(rows)).to(DEVICE)
        for b in backends:
            b.buffers.sampled[: len(rows)] = toks


def test_permutations_in_place():
    """Swaps, 3-cycles, condense and reversal on a full batch with long rows."""
    dev = make("device", max_num_reqs=8, buckets=(8,))
    rows = list(range(8))
    blocks = {r: [1 + W * r + c for c in range(W)] for r in rows}
    pos = {r: 4 * BS + r % 3 for r in rows}  # all W blocks given: no appends needed
    first = DecodeStep.build([100 + r for r in rows],
                             {i: (i, pos[r], blocks[r]) for i, r in enumerate(rows)})
    dev.prepare(first)
    dev.buffers.sampled[:8] = torch.arange(8, dtype=torch.int32) + 500
    orders = [[1, 0, 2, 3, 4, 5, 6, 7], [2, 0, 1, 3, 4, 5, 7, 6], list(range(7, -1, -1)),
              [7, 1, 2, 6]]
    prev = rows
    for order in orders:
        ids = [prev[i] for i in order]  # rows of the previous step, by request
        md = dev.prepare(DecodeStep.build([100 + r for r in ids]))
        for r in ids:
            pos[r] += 1
        tok = {r: 500 + prev.index(r) for r in ids}
        assert md.input_ids[: len(ids)].tolist() == [tok[r] for r in ids]
        assert md.positions[: len(ids)].tolist() == [pos[r] for r in ids]
        assert md.block_table[: len(ids)].tolist() == [blocks[r] for r in ids]
        assert md.block_table[len(ids):].eq(0).all() and md.slot_mapping[len(ids):].eq(-1).all()
        dev.buffers.sampled[: len(ids)] = torch.arange(len(ids), dtype=torch.int32) + 500
        prev = ids


def test_shrink_within_bucket_clears_tail_and_reused_row():
    dev = make("device", max_num_reqs=8, buckets=(8,))
    md = dev.prepare(DecodeStep.build([1, 2, 3], {0: (7, 9, [5, 6, 7]), 1: (8, 1, [9]),
                                                  2: (9, 2, [10])}))
    md = dev.prepare(DecodeStep.build([3], {0: (4, 2, [11])}))  # request 3 restarts in row 0
    assert md.block_table[0].tolist() == [11, 0, 0, 0, 0, 0]  # no stale 6, 7 from request 1
    assert md.block_table[1:3].eq(0).all() and md.seq_lens[1:].eq(1).all()
    assert md.slot_mapping[1:].eq(-1).all() and md.positions[1:].eq(0).all()
    assert md.query_start_loc.tolist() == list(range(9)) and md.counts.tolist() == [1, 1]


@pytest.mark.parametrize("kind", BACKENDS)
def test_block_boundary_and_int64_slots(kind):
    big = 2**27  # block id * block_size overflows int32
    bufs = DecodeBuffers(2, 2, 32, device=DEVICE)
    cls = BACKENDS[kind]
    dev = cls(bufs, num_kv_blocks=big + 10, vocab_size=VOCAB)
    md = dev.prepare(DecodeStep.build([1], {0: (3, 31, [big + 1])}))
    assert md.slot_mapping.tolist() == [(big + 1) * 32 + 31]
    md = dev.prepare(DecodeStep.build([1], appends=[(0, big + 2)]))  # position 32: next block
    assert md.positions.tolist() == [32] and md.slot_mapping.tolist() == [(big + 2) * 32]


@pytest.mark.parametrize("kind", BACKENDS)
def test_restart_in_place_and_moved(kind):
    """A request still in the previous batch that restarts (recompute): its payload wins."""
    b = make(kind, max_num_reqs=4, buckets=(4,))
    b.prepare(DecodeStep.build([1, 2], {0: (5, 6, [7, 8]), 1: (6, 2, [9])}))
    b.buffers.sampled[:2] = torch.tensor([50, 60], dtype=torch.int32)
    md = b.prepare(DecodeStep.build([1, 2], {0: (11, 1, [12])}))  # request 1 restarts in row 0
    assert md.input_ids[:2].tolist() == [11, 60] and md.positions[:2].tolist() == [1, 3]
    assert md.block_table[:2].tolist() == [[12] + [0] * (W - 1), [9] + [0] * (W - 1)]
    md = b.prepare(DecodeStep.build([2, 1], {0: (13, 0, [14])}))  # request 2 restarts, moved
    assert md.input_ids[:2].tolist() == [13, 50] and md.positions[:2].tolist() == [0, 2]
    assert md.slot_mapping[:2].tolist() == [14 * BS, 12 * BS + 2]


@pytest.mark.parametrize("kind", BACKENDS)
def test_departed_request_needs_payload_to_return(kind):
    b = make(kind)
    b.prepare(DecodeStep.build([1, 2], {0: (5, 0, [7]), 1: (6, 0, [8])}))
    b.prepare(DecodeStep.build([1]))  # request 2 is out for this step
    with pytest.raises(ValueError, match="request 2.*no new-row payload"):
        b.prepare(DecodeStep.build([1, 2]))
    md = b.prepare(DecodeStep.build([1, 2], {1: (6, 1, [8])}))
    assert md.positions.tolist() == [2, 1] and md.slot_mapping.tolist() == [30, 33]


def test_empty_step_zeroes_counts():
    b = make("device")
    b.prepare(DecodeStep.build([1, 2], {0: (5, 0, [7]), 1: (6, 0, [8])}))
    md = b.prepare(DecodeStep.build([]))
    assert md.counts.tolist() == [0, 0] and md.padded_size == 0


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("padded,exc,match", [
    (2, ValueError, "padded_size 2 is below the 3 real token rows"),
    (0, ValueError, "padded_size 0 is below the 3 real token rows"),
    (-4, ValueError, r"padded_size must be a multiple .* in \[0, 24\], got -4"),
    (25, ValueError, r"in \[0, 24\], got 25"),
    ("4", TypeError, "padded_size"),
    (4.0, TypeError, "padded_size"),
])
def test_build_refuses_a_padded_size_below_the_staged_rows(kind, padded, exc, match):
    """``build`` covers every real row of the step staged last: a smaller or invalid padded
    size is refused before anything is launched, and the step then builds right; the next
    step carries its rows from the right positions and slots."""
    b = make(kind)
    rows = [Req(1, 10, 5, [1, 2]), Req(2, 11, 6, [3, 4]), Req(3, 12, 6, [5, 6])]
    plan = b.stage(DecodeStep.build([1, 2, 3], {i: (r.token, r.pos, r.blocks)
                                                for i, r in enumerate(rows)}))
    assert plan.padded_size == 4
    before = snapshot(b.buffers)
    with pytest.raises(exc, match=match):
        b.build(padded)
    assert unchanged(b.buffers, before)  # refused before any launch
    b.build(np.int64(plan.padded_size))  # a numpy int is an int
    check(b.metadata(plan), rows, 4)
    b.buffers.sampled[:3] = torch.tensor([20, 21, 22], dtype=torch.int32)
    md = b.prepare(DecodeStep.build([1, 2, 3]))
    check(md, [Req(1, 20, 6, [1, 2]), Req(2, 21, 7, [3, 4]), Req(3, 22, 7, [5, 6])], 4)


def test_host_build_refuses_rows_its_stage_did_not_write():
    """The host-built backend's stage writes the rows of its plan only: outside a capture a
    larger build would hand the model an earlier step's rows, and is refused. (The device
    backend builds any padded size from the staged record: checked too.)"""
    rows = [Req(i + 1, 10 + i, 5, [2 * i + 1, 2 * i + 2]) for i in range(5)]
    step = DecodeStep.build([1, 2, 3, 4, 5], {i: (r.token, r.pos, r.blocks)
                                              for i, r in enumerate(rows)})
    for kind in BACKENDS:
        b = make(kind)
        b.prepare(step)  # rows 0-4 real, padded to 8
        b.buffers.sampled[:5] = torch.arange(20, 25, dtype=torch.int32)
        plan = b.stage(DecodeStep.build([1, 2]))
        assert plan.padded_size == 2
        if kind == "host":
            with pytest.raises(ValueError, match="padded_size 8 exceeds the 2 token rows"):
                b.build(8)
            b.build(2)
            check(b.metadata(plan), [Req(1, 20, 6, [1, 2]), Req(2, 21, 6, [3, 4])], 2)
        else:
            b.build(8)  # rows 2-7 become dummy rows
            check(b.buffers.views(2, 8), [Req(1, 20, 6, [1, 2]), Req(2, 21, 6, [3, 4])], 8)


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("kw,exc,match", [
    (dict(buckets=[1, 2, 4]), TypeError, "buckets must be a zos.BucketTable"),
    (dict(num_kv_blocks=64.0), TypeError, "num_kv_blocks: expected an int"),
    (dict(num_kv_blocks=True), TypeError, "num_kv_blocks: expected an int"),
    (dict(vocab_size=100.5), TypeError, "vocab_size: expected an int"),
    (dict(vocab_size="100"), TypeError, "vocab_size: expected an int"),
], ids=["buckets list", "float pool", "bool pool", "float vocab", "str vocab"])
def test_backend_arguments_of_the_wrong_type_refused(kind, kw, exc, match):
    bufs = DecodeBuffers(8, 4, 4, device=DEVICE)
    with pytest.raises(exc, match=match):
        BACKENDS[kind](bufs, **{"num_kv_blocks": 64, "vocab_size": 100, **kw})
    assert bufs.owner is None  # not taken over


def test_plans_and_views_hold_python_ints_and_real_rows_within_the_padding():
    b = make("device")
    plan = b.stage(DecodeStep.build([1], {0: (3, 0, [1])}), min_padded_size=np.int64(8))
    assert [(v, type(v)) for v in vars(plan).values()] == [(1, int), (1, int), (8, int),
                                                          (True, bool)]
    for n, exc in [(9, ValueError), (-1, ValueError), (1.5, TypeError)]:
        with pytest.raises(exc, match="num_reqs"):
            b.buffers.views(n, 8)
    assert b.buffers.views(np.int32(8), 8).num_reqs == 8


def snapshot(buffers):
    """Copies of every tensor of ``buffers`` (fields, row state, staging, scratch)."""
    return {k: v.clone() for k, v in vars(buffers).items() if isinstance(v, torch.Tensor)}


def unchanged(buffers, before):
    return all(torch.equal(before[k], getattr(buffers, k)) for k in before)


GROW = [(1, 9)]  # request 2 (row 1) moves from position 3 to 4: its second block
BAD = [
    ("unknown request", dict(req_ids=[1, 2, 9]), ValueError, "request 9.*no new-row payload"),
    ("duplicate id", dict(req_ids=[1, 1]), ValueError, "request id 1 appears twice"),
    ("null block", dict(req_ids=[1, 2, 3], new={2: (1, 0, [0])}), ValueError, "block id 0"),
    ("block past pool", dict(req_ids=[1, 2, 3], new={2: (1, 0, [NUM_BLOCKS])}), ValueError,
     "block id 400"),
    ("position past max", dict(req_ids=[1, 2, 3], new={2: (1, W * BS, [1] * W)}), ValueError,
     "position 24"),
    ("blocks too few", dict(req_ids=[1, 2, 3], new={2: (1, 8, [1, 2])}), ValueError,
     "needs 3 blocks"),
    ("token past vocab", dict(req_ids=[1, 2, 3], new={2: (VOCAB, 0, [1])}), ValueError,
     "token 1000"),
    ("missing append", dict(req_ids=[1, 2], appends=[]), ValueError,
     "request 2.*needs block column 1"),
    ("append to new row", dict(req_ids=[1, 2, 3], new={2: (1, 0, [1])}, appends=GROW + [(2, 5)]),
     ValueError, "is a new row"),
    ("too many rows", dict(req_ids=list(range(10, 35))), ValueError, "exceed max_num_reqs"),
    ("rewrite a new row", dict(req_ids=[1, 2, 3], new={2: (1, 0, [1])}, rewrites={2: [5]}),
     ValueError, r"rewrite_rows: row 2 \(request 3\) is a new row"),
    ("rewrite and append", dict(req_ids=[1, 2], rewrites={1: [8, 9]}), ValueError,
     r"rewrite_rows: row 1 \(request 2\) also has append_rows entries"),
    ("rewrite too few blocks", dict(req_ids=[1, 2], appends=[], rewrites={1: [5]}), ValueError,
     r"rewrite_block_ids: row 1 \(request 2\) at position 4 needs 2 blocks, got 1"),
    ("rewrite null block", dict(req_ids=[1, 2], rewrites={0: [0]}), ValueError,
     r"rewrite_block_ids: row 0 \(request 1\) has block id 0 outside \[1, 400\)"),
    ("rewrite past pool", dict(req_ids=[1, 2], rewrites={0: [3, NUM_BLOCKS]}), ValueError,
     "rewrite_block_ids: row 0 .*block id 400"),
    ("rewrite too wide", dict(req_ids=[1, 2], rewrites={0: [1] * (W + 1)}), ValueError,
     "rewrite_block_ids: row 0 .* has 7 blocks, more than max_num_blocks_per_req = 6"),
    ("rewrite row past N", dict(req_ids=[1, 2], rewrites={5: [1]}), ValueError,
     r"rewrite_rows\[0\] = 5 is outside \[0, 2\)"),
    ("rewrite unknown request", dict(req_ids=[1, 2, 9], rewrites={2: [3]}), ValueError,
     "request 9.*no new-row payload"),
]


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("name,kw,exc,match", BAD, ids=[b[0] for b in BAD])
def test_invalid_step_changes_nothing(kind, name, kw, exc, match):
    backend = make(kind)
    backend.prepare(DecodeStep.build([1, 2], {0: (5, 2, [7]), 1: (6, 3, [8])}))
    before = snapshot(backend.buffers)
    with pytest.raises(exc, match=match):
        backend.prepare(DecodeStep.build(kw["req_ids"], kw.get("new"), kw.get("appends", GROW),
                                         kw.get("rewrites")))
    assert unchanged(backend.buffers, before)
    md = backend.prepare(DecodeStep.build([1, 2], appends=GROW))  # the mirror is intact
    assert md.positions.tolist() == [3, 4] and md.slot_mapping.tolist() == [31, 36]


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("fields,exc,match", [
    (dict(rewrite_rows=[0, 0], rewrite_block_indptr=[0, 1, 2], rewrite_block_ids=[3, 4]),
     ValueError, "rewrite_rows: row 0 appears twice, at positions 0 and 1"),
    (dict(rewrite_rows=[0], rewrite_block_indptr=[0, 2], rewrite_block_ids=[3]), ValueError,
     r"rewrite_block_indptr\[-1\] must equal len\(rewrite_block_ids\) = 1, got 2"),
    (dict(rewrite_rows=[0], rewrite_block_indptr=[1, 1], rewrite_block_ids=[3]), ValueError,
     r"rewrite_block_indptr\[0\] must be 0, got 1"),
    (dict(rewrite_rows=[0, 1], rewrite_block_indptr=[0, 2, 1], rewrite_block_ids=[3]),
     ValueError, "rewrite_block_indptr must be non-decreasing, drops at 1"),
    (dict(rewrite_rows=[0], rewrite_block_indptr=[0], rewrite_block_ids=[3]), ValueError,
     r"rewrite_block_indptr must have len\(rewrite_rows\) \+ 1 = 2 elements, got 1"),
], ids=["duplicate", "indptr end", "indptr start", "indptr drops", "indptr length"])
def test_invalid_rewrite_arrays_change_nothing(kind, fields, exc, match):
    """Rewrite fields that DecodeStep.build cannot produce (a row twice, a bad CSR), given to
    the constructor: refused by the packer before anything is written."""
    backend = make(kind)
    backend.prepare(DecodeStep.build([1, 2], {0: (5, 2, [7]), 1: (6, 3, [8])}))
    before = snapshot(backend.buffers)
    with pytest.raises(exc, match=match):
        backend.prepare(DecodeStep(req_ids=[1, 2], append_rows=[1], append_block_ids=[9],
                                   **fields))
    assert unchanged(backend.buffers, before)
    md = backend.prepare(DecodeStep.build([1, 2], appends=GROW, rewrites={0: [10]}))
    assert md.positions.tolist() == [3, 4] and md.slot_mapping.tolist() == [43, 36]


# --- the pad token must be a token of the model (fault 5) -----------------------------------

@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("pad", [VOCAB, VOCAB + 1, 10**6])
def test_pad_token_outside_vocab_refused(kind, pad):
    """Refused when the backend is built (dummy rows would embed it), naming pad_token_id, and
    before anything is written: fresh buffers stay unowned and as allocated."""
    bufs = DecodeBuffers(4, 4, 16, pad_token_id=pad, device=DEVICE)
    bufs.input_ids.fill_(VOCAB - 7)  # not the pad token: a reset would show
    before = snapshot(bufs)
    with pytest.raises(ValueError, match=rf"pad_token_id {pad} is outside the vocabulary "
                                         rf"\[0, {VOCAB}\)"):
        BACKENDS[kind](bufs, num_kv_blocks=NUM_BLOCKS, vocab_size=VOCAB)
    assert bufs.owner is None and unchanged(bufs, before)


@pytest.mark.parametrize("kind", BACKENDS)
def test_pad_token_refused_over_owned_buffers(kind):
    """Over buffers another backend owns (a larger vocabulary): that backend keeps them and
    keeps working, and nothing it wrote changes."""
    bufs = DecodeBuffers(4, 4, 16, pad_token_id=VOCAB, device=DEVICE)
    owner = BACKENDS[kind](bufs, num_kv_blocks=NUM_BLOCKS, vocab_size=VOCAB + 1,
                           buckets=BucketTable([4]))
    owner.prepare(DecodeStep.build([1], {0: (3, 17, [5, 6])}))
    before = snapshot(bufs)
    with pytest.raises(ValueError, match=rf"pad_token_id {VOCAB} is outside"):
        BACKENDS[kind](bufs, num_kv_blocks=NUM_BLOCKS, vocab_size=VOCAB)
    assert bufs.owner is owner and unchanged(bufs, before)
    md = owner.prepare(DecodeStep.build([1]))
    assert md.positions.tolist() == [18, 0, 0, 0] and md.input_ids[1:].tolist() == [VOCAB] * 3


@pytest.mark.parametrize("kind", BACKENDS)
def test_pad_token_last_of_vocab_accepted(kind):
    """vocab_size - 1 is a token: accepted, and it is what the dummy rows hold."""
    bufs = DecodeBuffers(4, 4, 16, pad_token_id=VOCAB - 1, device=DEVICE)
    backend = BACKENDS[kind](bufs, num_kv_blocks=NUM_BLOCKS, vocab_size=VOCAB,
                             buckets=BucketTable([4]))
    assert bufs.owner is backend
    md = backend.prepare(DecodeStep.build([1], {0: (3, 0, [5])}))
    assert md.input_ids.tolist() == [3, VOCAB - 1, VOCAB - 1, VOCAB - 1]


# --- two backends over the same buffers, one after the other (fault 9) ----------------------

def _table_row(*blocks, width=8):
    return list(blocks) + [0] * (width - len(blocks))


@pytest.mark.parametrize("first,second", [("host", "host"), ("device", "host"),
                                          ("host", "device"), ("device", "device")])
def test_backend_built_over_used_buffers_starts_clean(first, second):
    """Requests 1 and 2 in rows 0 and 1 with 7 and 3 blocks, written by one backend; then a
    fresh backend over the same buffers stages request 3 alone, blocks [11, 12]. Every row of
    every field is what the fresh backend's step alone implies: nothing of rows 0 and 1 is
    left past request 3's blocks or in the dummy rows. The earlier backend refuses to go on."""
    bs, width, pad, fill = 4, 8, 7, 2
    kw = dict(num_kv_blocks=64, vocab_size=VOCAB, buckets=BucketTable([4]))
    bufs = DecodeBuffers(4, width, bs, device=DEVICE, pad_token_id=pad, seq_len_fill=fill)
    a = BACKENDS[first](bufs, **kw)
    blocks_1, blocks_2 = [21, 22, 23, 24, 25, 26, 27], [31, 32, 33]
    md = a.prepare(DecodeStep.build([1, 2], {0: (5, 26, blocks_1), 1: (6, 9, blocks_2)}))
    assert md.block_table.tolist() == [blocks_1 + [0], _table_row(*blocks_2),
                                       _table_row(), _table_row()]
    bufs.sampled[:2] = torch.tensor([40, 41], dtype=torch.int32)

    b = BACKENDS[second](bufs, **kw)
    md = b.prepare(DecodeStep.build([3], {0: (9, 5, [11, 12])}))
    assert (md.num_reqs, md.padded_size) == (1, 4)
    # Request 3: token 9 at position 5 = block 12, offset 1 -> slot 12 * 4 + 1; 6 tokens.
    # Rows 1-3 are dummy rows: pad token, position 0, no KV write, seq_len fill, null block.
    want = dict(input_ids=[9, pad, pad, pad], positions=[5, 0, 0, 0],
                slot_mapping=[12 * bs + 1, -1, -1, -1], seq_lens=[6, fill, fill, fill],
                query_start_loc=[0, 1, 2, 3, 4], counts=[1, 1],
                block_table=[_table_row(11, 12), _table_row(), _table_row(), _table_row()])
    for f, v in want.items():
        assert getattr(bufs, f).tolist() == v, f  # the whole buffers: every row
        assert getattr(md, f).tolist() == v, f

    before = snapshot(bufs)
    for step in (DecodeStep.build([1, 2]), DecodeStep.build([4], {0: (1, 0, [13])})):
        with pytest.raises(RuntimeError, match="another backend .* has taken these buffers"):
            a.stage(step)
        with pytest.raises(RuntimeError, match="another backend"):
            a.prepare(step)
    assert unchanged(bufs, before) and bufs.owner is b
    md = b.prepare(DecodeStep.build([3]))  # the fresh backend goes on: position 6, block 12
    assert md.positions.tolist() == [6, 0, 0, 0] and md.slot_mapping[0] == 12 * bs + 2


@pytest.mark.parametrize("first", ["host", "device"])
def test_failed_takeover_leaves_the_owner(first, monkeypatch):
    """A backend whose constructor fails (here: the host backend's host arrays) has not reset
    or taken the buffers: the earlier backend keeps them and goes on."""
    import zos.host_backend as hb

    a = make(first)
    a.prepare(DecodeStep.build([1], {0: (5, 0, [7])}))
    before = {f: getattr(a.buffers, f).clone() for f in ("block_table", "seq_lens", "input_ids")}

    def no_memory(*args, **kwargs):
        raise MemoryError("no host memory")

    monkeypatch.setattr(hb.np, "zeros", no_memory)
    with pytest.raises(MemoryError):
        HostMetadataBackend(a.buffers, num_kv_blocks=NUM_BLOCKS, vocab_size=VOCAB)
    monkeypatch.undo()
    assert a.buffers.owner is a
    for f, t in before.items():
        assert torch.equal(getattr(a.buffers, f), t), f
    md = a.prepare(DecodeStep.build([1]))
    assert md.positions[:1].tolist() == [1] and md.block_table[0, :2].tolist() == [7, 0]


class _MovingWorkload:
    """N in [n_lo, n_hi] rows with moves: each step every carried row advances a token (an
    appended block when it crosses one), ~5% of rows are replaced in place, and now and
    then rows swap, the batch grows or it shrinks (the last rows move into the holes)."""

    def __init__(self, seed, n_lo, n_hi, block_size, max_blocks):
        self.rng = np.random.default_rng(seed)
        self.n_lo, self.n_hi, self.bs, self.w = n_lo, n_hi, block_size, max_blocks
        self.next_id, self.next_block = 0, 1
        self.rows = []  # [request id, position, blocks]

    def _new(self):
        self.next_id += 1
        pos = int(self.rng.integers(0, self.w * self.bs // 2))
        blocks = list(range(self.next_block, self.next_block + pos // self.bs + 1))
        self.next_block += len(blocks)
        return [self.next_id, pos, blocks]

    def next_step(self):
        rng, rows = self.rng, self.rows
        new = set()
        for r in rows:
            r[1] += 1
        for i in range(len(rows)):
            if rows[i][1] + 1 >= self.w * self.bs or rng.random() < 0.05:
                rows[i] = self._new()
                new.add(i)
        u = rng.random()
        if u < 0.3 and len(rows) >= 2:  # swaps
            for _ in range(int(rng.integers(1, 8))):
                i, j = rng.choice(len(rows), 2, replace=False)
                rows[i], rows[j] = rows[j], rows[i]
                new = {j if k == i else i if k == j else k for k in new}
        elif u < 0.4 or len(rows) < self.n_lo:  # growth
            for _ in range(int(rng.integers(1, 16)) if rows else self.n_lo):
                if len(rows) < self.n_hi:
                    new.add(len(rows))
                    rows.append(self._new())
        elif u < 0.5:  # shrink: drop rows, the last ones move into the holes
            for _ in range(int(rng.integers(1, 16))):
                if len(rows) > self.n_lo:
                    i = int(rng.integers(0, len(rows)))
                    last = len(rows) - 1
                    rows[i] = rows[last]
                    new = {i if k == last else k for k in new if k != i}
                    rows.pop()
        appends = []
        for i, r in enumerate(rows):
            if i not in new and r[1] // self.bs >= len(r[2]):
                r[2].append(self.next_block)
                appends.append((i, self.next_block))
                self.next_block += 1
        payload = {i: (int(rng.integers(0, VOCAB)), rows[i][1], rows[i][2]) for i in new}
        return DecodeStep.build([r[0] for r in rows], payload, appends)


@pytest.mark.skipif(DEVICE != "cuda", reason="a stalled stream needs a GPU")
@pytest.mark.parametrize("ring_slots", [2, 4])
@pytest.mark.parametrize("fused", [False, True], ids=["stage-build", "prepare"])
def test_stalled_ring_matches_host_built(ring_slots, fused):
    """The zero-copy ring under a stalled stream, N >= 256 with moves: a spin kernel queued
    before each prep graph replay keeps the GPU behind, so the host stages up to K steps
    ahead and rewrites each slot as soon as the done word shows its build finished. Steps
    run as ``stage`` then ``build``, or as ``prepare`` (one native call stages the step and
    launches its graph). After every step every metadata
    buffer of the padded step is compared on the device with the host-built backend (its
    buffers on the CPU, uploaded after the replay); the mismatches are summed there and read
    once at the end."""
    from zos.serving.profiling import gpu_busy

    steps, bs, w, r = 2000, 16, 64, 320
    wl = _MovingWorkload(16, 256, r, bs, w)
    kw = dict(num_kv_blocks=1 << 24, vocab_size=VOCAB, buckets=BucketTable([256, 288, 320]))
    dev = DeviceMetadataBackend(DecodeBuffers(r, w, bs, device="cuda"), capture_prep=True,
                                ring_slots=ring_slots, **kw)
    host = HostMetadataBackend(DecodeBuffers(r, w, bs, device="cpu"), **kw)
    mismatches = torch.zeros(len(FIELDS), dtype=torch.int64, device="cuda")
    elapsed = torch.zeros(1, dtype=torch.int64, device="cuda")
    rng = np.random.default_rng(0)
    sizes = []
    for _ in range(steps):
        step = wl.next_step()
        gpu_busy(4000, elapsed)  # the build below waits behind 4 ms of GPU work: longer
        # than the host's step here (the host-built reference, the compares), so the host
        # runs K steps ahead and waits for the done word
        if fused:
            md = dev.prepare(step)
        else:
            plan = dev.stage(step)
            dev.build(plan.padded_size)
            md = dev.metadata(plan)
        want, n = host.prepare(step), step.num_reqs
        sizes.append(n)
        for i, f in enumerate(FIELDS):
            ref = getattr(want, f).pin_memory().to("cuda", non_blocking=True)
            mismatches[i] += (getattr(md, f) != ref).sum()
        toks = torch.from_numpy(rng.integers(0, VOCAB, n).astype(np.int32))
        host.buffers.sampled[:n] = toks
        dev.buffers.sampled[:n].copy_(toks.pin_memory(), non_blocking=True)
    torch.cuda.synchronize()
    assert dict(zip(FIELDS, mismatches.tolist())) == dict.fromkeys(FIELDS, 0)
    assert min(sizes) >= 256
    assert dev.ring.waits > 0, "the host never caught up with the ring: the GPU did not lag"


def _same_fields_then_sample(i, want, got, rng, num_reqs, *backends):
    """Assert every field of step ``i`` equal in ``want`` (host-built) and ``got``, then give
    every backend the same random sampled tokens for its ``num_reqs`` rows."""
    for f in FIELDS:
        bad = (getattr(want, f) != getattr(got, f).cpu()).sum().item()
        assert bad == 0, f"step {i}: {bad} entries of {f} differ"
    toks = torch.from_numpy(rng.integers(0, VOCAB, num_reqs).astype(np.int32))
    for b in backends:
        b.buffers.sampled[:num_reqs].copy_(toks)


@pytest.mark.skipif(DEVICE != "cuda", reason="the warps of one program race only on a GPU")
@pytest.mark.parametrize("staging,capture", [("mapped", False), ("mapped", True),
                                             ("copy", False), ("copy", True)])
def test_long_rows_at_1024_match_host_built(staging, capture):
    """Rows of hundreds of blocks at N ~ 1,000 (the shape that found the intra-program race of
    issue 16 on the H200: one warp reset a row-map entry before another warp of the same program
    had read it, leaving 32-column runs of a block-table row unwritten). Every field of every
    step is compared with the host-built backend, with moves, arrivals and appended blocks."""
    steps, bs, w, r = 30, 16, 2048, 1024
    wl = _MovingWorkload(7, 896, r, bs, w)
    kw = dict(num_kv_blocks=1 << 24, vocab_size=VOCAB, buckets=BucketTable([896, 960, 1024]))
    dev = DeviceMetadataBackend(DecodeBuffers(r, w, bs, device="cuda"), capture_prep=capture,
                                staging=staging, **kw)
    host = HostMetadataBackend(DecodeBuffers(r, w, bs, device="cpu"), **kw)
    rng = np.random.default_rng(1)
    for i in range(steps):
        step = wl.next_step()
        want, got = host.prepare(step), dev.prepare(step)
        torch.cuda.synchronize()
        _same_fields_then_sample(i, want, got, rng, step.num_reqs, host, dev)


def _prep_graph_backends(staging, *, seed, rows):
    """A workload of 40 to ``rows`` rows with moves (block size 16, 64 block columns), a CUDA
    backend with a prep graph for ``rows`` (``staging``) and the host-built backend on the
    CPU over the same pool."""
    bs, w = 16, 64
    kw = dict(num_kv_blocks=1 << 20, vocab_size=VOCAB, buckets=BucketTable([rows]))
    dev = DeviceMetadataBackend(DecodeBuffers(rows, w, bs, device="cuda"), capture_prep=True,
                                staging=staging, **kw)
    host = HostMetadataBackend(DecodeBuffers(rows, w, bs, device="cpu"), **kw)
    return _MovingWorkload(seed, 40, rows, bs, w), dev, host


@pytest.mark.skipif(DEVICE != "cuda", reason="stream capture needs a GPU")
@pytest.mark.parametrize("staging", ["mapped", "copy"])
def test_build_of_a_backend_with_prep_graphs_is_capturable(staging):
    """``build`` of a backend that launches prep graphs of its own (``capture_prep=True``),
    called inside a caller's capture (a graph launch cannot be captured on a stream): the
    caller's graph holds the prep kernels, and replaying it after each stage rebuilds every
    field as the host-built backend does, with moves, arrivals and appended blocks."""
    steps, r = 12, 64
    wl, dev, host = _prep_graph_backends(staging, seed=11, rows=r)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    rng = np.random.default_rng(2)
    for i in range(steps):
        step = wl.next_step()
        want, plan = host.prepare(step), dev.stage(step)
        assert plan.padded_size == r
        if i == 0:  # captured once, on a side stream; replayed for every step after its stage
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(graph, stream=side):
                dev.build(r)
            torch.cuda.current_stream().wait_stream(side)
        graph.replay()
        got = dev.metadata(plan)
        torch.cuda.synchronize()
        _same_fields_then_sample(i, want, got, rng, step.num_reqs, host, dev)


@pytest.mark.skipif(DEVICE != "cuda", reason="stream capture needs a GPU")
@pytest.mark.parametrize("staging", ["mapped", "copy"])
def test_a_backend_collected_inside_a_runners_capture_leaves_it_intact(staging, collector_on):
    """A backend with prep graphs, staged and built, then dropped as cyclic garbage, is freed by
    a collection inside a runner's ``torch.cuda.graph`` capture (torch >= 2.9 does not collect
    before one; an automatic collection may run at any allocation): its graphs and its
    teardown leave that capture intact, and the runner's graph replays right (a graph freed
    the plain way breaks the capture: pytorch/pytorch#161037)."""
    wl, dev, _ = _prep_graph_backends(staging, seed=3, rows=64)
    dev.stage(wl.next_step())
    dev.build(64)
    freed = weakref.ref(dev)
    dev.me = dev  # a reference cycle: only a collection frees it
    garbage = [dev]
    del dev
    collect_inside_a_runners_capture(garbage, freed)


@pytest.mark.skipif(DEVICE != "cuda", reason="prep graphs need a GPU")
@pytest.mark.parametrize("staging", ["mapped", "copy"])
def test_prepare_launches_the_prep_graph_from_the_stage_call(staging, monkeypatch):
    """``prepare`` of a backend with prep graphs, on its own stream, once a step of N rows has
    passed: the stage's native call launches the graph (``build`` is not called); the first
    step of each N, and any step on another stream, stage and build apart (off the stream
    the build is ordered by events). Every field equals the host-built backend's after every
    step."""
    steps, r = 24, 64
    wl, dev, host = _prep_graph_backends(staging, seed=5, rows=r)
    builds, build = [], dev.build
    monkeypatch.setattr(dev, "build", lambda size: (builds.append(size), build(size)))
    side, rng = torch.cuda.Stream(), np.random.default_rng(3)
    seen, fused = set(), 0
    for i in range(steps):
        step = wl.next_step()
        off_stream = i % 3 == 2
        with torch.cuda.stream(side if off_stream else torch.cuda.current_stream()):
            got = dev.prepare(step)
        want = host.prepare(step)
        torch.cuda.synchronize()
        apart = off_stream or step.num_reqs not in seen
        assert builds == ([got.padded_size] if apart else []), i
        fused += not apart
        seen.add(step.num_reqs)
        builds.clear()
        _same_fields_then_sample(i, want, got, rng, step.num_reqs, host, dev)
    assert dev.build_order.off_stream_builds == steps // 3
    assert fused >= 4


@pytest.mark.skipif(DEVICE != "cuda", reason="prep graphs need a GPU")
@pytest.mark.parametrize("staging", ["mapped", "copy"])
def test_a_taken_over_backend_refuses_its_one_call_prepare(staging):
    """A backend whose buffers another backend has taken over refuses ``prepare`` also for an N
    whose steps take the one native call (which would write its record and launch its prep
    graph into the new owner's buffers): RuntimeError, every buffer of the new owner unchanged."""
    bufs = DecodeBuffers(8, 4, 16, device="cuda")
    kw = dict(num_kv_blocks=100, vocab_size=VOCAB, buckets=BucketTable([8]), capture_prep=True,
              staging=staging)
    old = DeviceMetadataBackend(bufs, **kw)
    old.prepare(DecodeStep.build([1, 2], {0: (3, 0, [1]), 1: (4, 5, [2])}))
    old.prepare(DecodeStep.build([1, 2]))  # N = 2 has passed: the next step is one call
    torch.cuda.synchronize()
    new = DeviceMetadataBackend(bufs, **kw)
    torch.cuda.synchronize()
    before = {k: v.clone() for k, v in vars(bufs).items() if isinstance(v, torch.Tensor)}
    with pytest.raises(RuntimeError, match="another backend"):
        old.prepare(DecodeStep.build([1, 2]))
    torch.cuda.synchronize()
    assert before and all(torch.equal(v, getattr(bufs, k)) for k, v in before.items())
    assert new.prev_num_reqs == 0


def _prepare_and_compare(i, step, stream, dev, host, rng):
    """``dev.prepare(step)`` on ``stream``, every field against the host-built backend's."""
    with torch.cuda.stream(stream):
        got = dev.prepare(step)
    want = host.prepare(step)
    torch.cuda.synchronize()
    _same_fields_then_sample(i, want, got, rng, step.num_reqs, host, dev)


def _next_one_call_step(wl, dev, host, stream, rng):
    """Prepares (and checks) the workload's steps on ``stream`` until one whose N has passed
    through ``prepare``: returns its index and that step, not prepared, which ``prepare`` takes
    as its one native call (the stage and the prep graph's launch)."""
    step = None
    for i in range(12):
        prev, step = step, wl.next_step()
        if prev is not None and step.num_reqs == prev.num_reqs:
            assert step.num_reqs in dev._graph_steps
            return i, step
        _prepare_and_compare(i, step, stream, dev, host, rng)
    pytest.fail("no two steps in a row with the same N")


@pytest.mark.skipif(DEVICE != "cuda", reason="stream capture needs a GPU")
@pytest.mark.parametrize("staging", ["mapped", "copy"])
def test_stage_and_prepare_refuse_a_capturing_backend_stream(staging):
    """A stage is host work outside any graph: with the backend's own stream capturing, ``stage``
    and ``prepare`` (also for an N whose steps launch the prep graph from the stage call) raise
    before anything, the packer keeps the previous step, and after the capture the same step
    stages and builds every field as the host-built backend does."""
    r = 64
    wl, dev, host = _prep_graph_backends(staging, seed=13, rows=r)
    side, rng = torch.cuda.Stream(), np.random.default_rng(4)
    side.wait_stream(torch.cuda.current_stream())
    dev.stream = side
    i, step = _next_one_call_step(wl, dev, host, side, rng)
    before = dev.prev_num_reqs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for call in (dev.stage, dev.prepare):
            with pytest.raises(RuntimeError, match="the backend's stream is capturing"):
                call(step)
    assert dev.prev_num_reqs == before
    _prepare_and_compare(i, step, side, dev, host, rng)


@pytest.mark.skipif(DEVICE != "cuda", reason="stream capture needs a GPU")
@pytest.mark.parametrize("on_side_stream", [False, True])
@pytest.mark.parametrize("staging", ["mapped", "copy"])
def test_prepare_beside_another_threads_capture(staging, on_side_stream):
    """Another thread captures a CUDA graph in torch's default (global) capture mode while this
    one prepares a step (the one native call: the stage, with an event query on the copy path
    and a drain of the ring's fence on the mapped one, and the prep graph's launch), on the
    default stream or a side one: the driver refuses nothing, the step's fields equal the
    host-built backend's, and the other thread's graph is intact (it replays). PyTorch's NCCL
    watchdog broke captures so with its event queries (pytorch/pytorch#104487, #148594)."""
    r = 64
    wl, dev, host = _prep_graph_backends(staging, seed=17, rows=r)
    side, rng = torch.cuda.Stream(), np.random.default_rng(6)
    stream = side if on_side_stream else torch.cuda.current_stream()
    side.wait_stream(torch.cuda.current_stream())
    dev.stream = stream
    i, step = _next_one_call_step(wl, dev, host, stream, rng)
    if dev.ring is not None:
        dev.ring.fences.fence_repeat()  # the next stage drains: an event record and wait
    x = torch.zeros(4, device="cuda")
    graph, inside, staged, failed = torch.cuda.CUDAGraph(), threading.Event(), threading.Event(), []

    def capture():  # another thread's capture, in the global mode, open while the step stages
        try:
            with torch.cuda.graph(graph):
                x.add_(1)
                inside.set()
                staged.wait(60)
                x.add_(1)
        except BaseException as e:  # reported below
            failed.append(e)
        finally:
            inside.set()

    gc.collect()  # no backend left by an earlier test is freed in the window (a free syncs)
    gc.disable()
    t = threading.Thread(target=capture)
    try:
        t.start()
        assert inside.wait(60)
        with torch.cuda.stream(stream):
            got = dev.prepare(step)
    finally:
        staged.set()
        t.join(60)
        gc.enable()
    assert not t.is_alive() and not failed, failed
    want = host.prepare(step)
    torch.cuda.synchronize()
    _same_fields_then_sample(i, want, got, rng, step.num_reqs, host, dev)
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4



@pytest.mark.skipif(DEVICE != "cuda", reason="stream capture needs a GPU")
@pytest.mark.parametrize("on_side_stream", [False, True])
@pytest.mark.parametrize("staging", ["mapped", "copy"])
def test_backend_freed_inside_its_threads_capture(staging, on_side_stream):
    """A backend freed (its last reference dropped, then the garbage collector run) inside a
    CUDA graph capture of the same thread, in torch's default global mode, after a step: its
    teardown waits for its copies' fences, or drains the ring, in the relaxed capture mode, so
    the capture completes and its graph replays. A wait in the per-step mode is refused there
    and breaks the capture (torch's caching allocator defers the event calls of a block freed
    during a capture for the same reason). Without prep graphs: a torch ``CUDAGraph`` freed
    during a capture breaks it (torch's own limit; docs/ZOS.md, "The runner contract", rule 4)."""
    side = torch.cuda.Stream()
    stream = side if on_side_stream else torch.cuda.current_stream()
    side.wait_stream(torch.cuda.current_stream())
    dev = DeviceMetadataBackend(DecodeBuffers(8, W, BS, device="cuda"), num_kv_blocks=NUM_BLOCKS,
                                vocab_size=VOCAB, buckets=BucketTable([8]), staging=staging,
                                capture_prep=False)
    dev.stream = stream
    with torch.cuda.stream(stream):
        dev.prepare(DecodeStep.build([5, 6], {0: (1, 3, [7]), 1: (2, 0, [8])}))
    if dev.ring is not None:
        dev.ring.fences.fence_repeat()  # its teardown drains: an event record and wait
    freed, x, graph = weakref.ref(dev), torch.zeros(4, device="cuda"), torch.cuda.CUDAGraph()
    gc.collect()  # earlier tests' garbage is not freed in the capture (torch.cuda.graph does
    # not collect it first unless torch.compiler.config.force_cudagraph_gc is set)
    with torch.cuda.graph(graph):
        x.add_(1)
        del dev
        gc.collect()
        alive = freed() is not None
        x.add_(1)
    assert not alive
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 4

# --- the epilogue: a runner's launch after every build, inside the prep graphs ----------------

@pytest.mark.parametrize("capture", CAPTURE)
def test_epilogue_reads_every_build(capture):
    """``epilogue(padded_size)`` runs after the prep kernels of each build (in the prep graph
    under ``capture_prep``): a copy of the built positions and row count taken there equals
    the step's metadata, for bucketed, eager and empty steps."""
    gen = TraceGen(5, max_num_reqs=24, block_size=BS, max_blocks=W, num_kv_blocks=NUM_BLOCKS,
                   vocab=VOCAB, big=True)
    seen_positions = torch.full((24,), -1, dtype=torch.int32, device=DEVICE)
    seen_counts = torch.full((2,), -1, dtype=torch.int32, device=DEVICE)
    sizes = []

    def copy_out(padded_size):  # also runs at construction: warm-up and capture per bucket
        sizes.append(padded_size)
        seen_positions.copy_(bufs.positions[:24])
        seen_counts.copy_(bufs.counts)

    bufs = DecodeBuffers(24, W, BS, device=DEVICE)
    dev = DeviceMetadataBackend(bufs, num_kv_blocks=NUM_BLOCKS, vocab_size=VOCAB,
                                buckets=BucketTable([1, 2, 4, 8, 16]),
                                capture_prep=capture, epilogue=copy_out)
    assert sorted(set(sizes)) == ([1, 2, 4, 8, 16] if capture else [])
    for _ in range(25):
        step, rows = gen.next_step()
        sizes.clear()
        md = dev.prepare(step)
        n = len(rows)
        assert seen_counts.tolist() == md.counts.tolist() == [n, n]
        assert seen_positions[:n].tolist() == md.positions[:n].tolist()
        assert sizes in ([], [md.padded_size]) if capture else sizes == [md.padded_size]
        seen_counts.fill_(-1)
        toks = torch.from_numpy(gen.sampled(rows))
        bufs.sampled[:n] = toks.to(DEVICE)
    dev.prepare(DecodeStep.build([]))  # the empty step: build(0)
    assert seen_counts.tolist() == [0, 0]
