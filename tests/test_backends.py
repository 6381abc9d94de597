"""Both metadata backends against the per-request truth, step after step."""
import numpy as np
import pytest
import torch
from tracegen import TraceGen, expected

from zos import BucketTable, DecodeBuffers, DecodeStep, DeviceMetadataBackend, HostMetadataBackend

from conftest import DEVICE

BS, W, NUM_BLOCKS, VOCAB = 4, 6, 400, 1000
FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc",
          "block_table", "counts")


def make(kind, max_num_reqs=24, buckets=(1, 2, 4, 8, 16), capture=False):
    bufs = DecodeBuffers(max_num_reqs, W, BS, device=DEVICE)
    table = BucketTable(list(buckets)) if buckets else None
    if kind == "host":
        return HostMetadataBackend(bufs, num_kv_blocks=NUM_BLOCKS, vocab_size=VOCAB, buckets=table)
    return DeviceMetadataBackend(bufs, num_kv_blocks=NUM_BLOCKS, vocab_size=VOCAB, buckets=table,
                                 capture_prep=capture)


def check(md, rows, padded):
    want = expected(rows, padded, block_size=BS, max_blocks=W)
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


def test_permutations_in_place():
    """Swaps, 3-cycles, condense and reversal on a full batch with long rows."""
    dev = make("device", max_num_reqs=8, buckets=(8,))
    rows = list(range(8))
    blocks = {r: [1 + W * r + c for c in range(W)] for r in rows}
    pos = {r: 4 * BS + r % 3 for r in rows}  # all W blocks given: no appends needed
    first = DecodeStep.build([100 + r for r in rows], {i: (i, pos[r], blocks[r]) for i, r in enumerate(rows)})
    dev.prepare(first)
    dev.buffers.sampled[:8] = torch.arange(8, dtype=torch.int32) + 500
    orders = [[1, 0, 2, 3, 4, 5, 6, 7], [2, 0, 1, 3, 4, 5, 7, 6], list(range(7, -1, -1)), [7, 1, 2, 6]]
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
    md = dev.prepare(DecodeStep.build([1, 2, 3], {0: (7, 9, [5, 6, 7]), 1: (8, 1, [9]), 2: (9, 2, [10])}))
    md = dev.prepare(DecodeStep.build([3], {0: (4, 2, [11])}))  # request 3 restarts in row 0
    assert md.block_table[0].tolist() == [11, 0, 0, 0, 0, 0]  # no stale 6, 7 from request 1
    assert md.block_table[1:3].eq(0).all() and md.seq_lens[1:].eq(1).all()
    assert md.slot_mapping[1:].eq(-1).all() and md.positions[1:].eq(0).all()
    assert md.query_start_loc.tolist() == list(range(9)) and md.counts.tolist() == [1, 1]


@pytest.mark.parametrize("kind", ["device", "host"])
def test_block_boundary_and_int64_slots(kind):
    big = 2**27  # block id * block_size overflows int32
    bufs = DecodeBuffers(2, 2, 32, device=DEVICE)
    cls = DeviceMetadataBackend if kind == "device" else HostMetadataBackend
    dev = cls(bufs, num_kv_blocks=big + 10, vocab_size=VOCAB)
    md = dev.prepare(DecodeStep.build([1], {0: (3, 31, [big + 1])}))
    assert md.slot_mapping.tolist() == [(big + 1) * 32 + 31]
    md = dev.prepare(DecodeStep.build([1], appends=[(0, big + 2)]))  # position 32: next block
    assert md.positions.tolist() == [32] and md.slot_mapping.tolist() == [(big + 2) * 32]


@pytest.mark.parametrize("kind", ["device", "host"])
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


@pytest.mark.parametrize("kind", ["device", "host"])
def test_departed_request_needs_payload_to_return(kind):
    b = make(kind)
    b.prepare(DecodeStep.build([1, 2], {0: (5, 0, [7]), 1: (6, 0, [8])}))
    b.prepare(DecodeStep.build([1]))  # request 2 is out for this step
    with pytest.raises(ValueError, match="request 2.*no new-row payload"):
        b.prepare(DecodeStep.build([1, 2]))
    md = b.prepare(DecodeStep.build([1, 2], {1: (6, 1, [8])}))
    assert md.positions.tolist() == [2, 1] and md.slot_mapping.tolist() == [30, 33]


def test_speculative_rows_rejected():
    bufs = DecodeBuffers(4, W, BS, uniform_decode_query_len=2, device=DEVICE)
    with pytest.raises(ValueError, match="buffers.uniform_decode_query_len must be 1"):
        DeviceMetadataBackend(bufs, num_kv_blocks=NUM_BLOCKS, vocab_size=VOCAB)


def test_empty_step_zeroes_counts():
    b = make("device")
    b.prepare(DecodeStep.build([1, 2], {0: (5, 0, [7]), 1: (6, 0, [8])}))
    md = b.prepare(DecodeStep.build([]))
    assert md.counts.tolist() == [0, 0] and md.padded_size == 0


def snapshot(backend):
    b = backend.buffers
    return {k: v.clone() for k, v in vars(b).items() if isinstance(v, torch.Tensor)}


GROW = [(1, 9)]  # request 2 (row 1) moves from position 3 to 4: its second block
BAD = [
    ("unknown request", dict(req_ids=[1, 2, 9]), ValueError, "request 9.*no new-row payload"),
    ("duplicate id", dict(req_ids=[1, 1]), ValueError, "request id 1 appears twice"),
    ("null block", dict(req_ids=[1, 2, 3], new={2: (1, 0, [0])}), ValueError, "block id 0"),
    ("block past pool", dict(req_ids=[1, 2, 3], new={2: (1, 0, [NUM_BLOCKS])}), ValueError, "block id 400"),
    ("position past max", dict(req_ids=[1, 2, 3], new={2: (1, W * BS, [1] * W)}), ValueError, "position 24"),
    ("blocks too few", dict(req_ids=[1, 2, 3], new={2: (1, 8, [1, 2])}), ValueError, "needs 3 blocks"),
    ("token past vocab", dict(req_ids=[1, 2, 3], new={2: (VOCAB, 0, [1])}), ValueError, "token 1000"),
    ("missing append", dict(req_ids=[1, 2], appends=[]), ValueError, "request 2.*needs block column 1"),
    ("append to new row", dict(req_ids=[1, 2, 3], new={2: (1, 0, [1])}, appends=GROW + [(2, 5)]),
     ValueError, "is a new row"),
    ("too many rows", dict(req_ids=list(range(10, 35))), ValueError, "exceed max_num_reqs"),
]


@pytest.mark.parametrize("kind", ["device", "host"])
@pytest.mark.parametrize("name,kw,exc,match", BAD, ids=[b[0] for b in BAD])
def test_invalid_step_changes_nothing(kind, name, kw, exc, match):
    backend = make(kind)
    backend.prepare(DecodeStep.build([1, 2], {0: (5, 2, [7]), 1: (6, 3, [8])}))
    before = snapshot(backend)
    with pytest.raises(exc, match=match):
        backend.prepare(DecodeStep.build(kw["req_ids"], kw.get("new"), kw.get("appends", GROW)))
    after = snapshot(backend)
    assert all(torch.equal(before[k], after[k]) for k in before)
    md = backend.prepare(DecodeStep.build([1, 2], appends=GROW))  # the mirror is intact
    assert md.positions.tolist() == [3, 4] and md.slot_mapping.tolist() == [31, 36]


def test_decode_step_type_errors():
    with pytest.raises(TypeError, match="req_ids must hold integers"):
        DecodeStep(req_ids=np.array([1.5]))
    with pytest.raises(ValueError, match="new_rows must be 1-D"):
        DecodeStep(req_ids=[1], new_rows=np.zeros((1, 1), np.int32))
    with pytest.raises(ValueError, match="new_tokens has values that do not fit int32"):
        DecodeStep(req_ids=[1], new_tokens=[2**40])
