"""The staging record: Python mirror, C++ header and packer output agree; the kernels and
the numba builder read it only through the exported layout; the upload's stream."""
import numpy as np
import pytest
import torch

from zos import (
    _C,
    BucketTable,
    DecodeBuffers,
    DeviceMetadataBackend,
    HostMetadataBackend,
    StepPacker,
    host_backend,
    kernels,
    staging,
)
from zos.step import DecodeStep

from helpers import DEVICE, TraceGen, expected

# The layout of csrc/staging.h, word by word: every name zos._C.staging exports.
LAYOUT = dict(HEADER_WORDS=8, RECORD_WORDS=5,
              NUM_REQS=0, NUM_TOKENS=1, PREV_REQS=2, NUM_RECORDS=3, NUM_BLOCK_IDS=4, Q=5,
              R_TOKEN=0, R_POS0=1, R_COL0=2, R_COUNT=3, R_BLK_OFF=4)
HEADER_FIELDS = ("NUM_REQS", "NUM_TOKENS", "PREV_REQS", "NUM_RECORDS", "NUM_BLOCK_IDS", "Q")
RECORD_FIELDS = ("R_TOKEN", "R_POS0", "R_COL0", "R_COUNT", "R_BLK_OFF")


def test_constants_match_native():
    assert staging.HEADER_WORDS == _C.staging.HEADER_WORDS == 8
    assert staging.RECORD_WORDS == _C.staging.RECORD_WORDS == 5


@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_every_constant_pinned(name):
    """Each exported constant has its layout value, and the Python mirror is the native one."""
    assert getattr(_C.staging, name) == LAYOUT[name]
    assert getattr(staging, name) == getattr(_C.staging, name) == LAYOUT[name]
    assert type(getattr(staging, name)) is int


def test_native_exports_exactly_the_layout():
    """No constant of the header is left out of the pins above, and the fields fit."""
    assert {k for k in dir(_C.staging) if k.isupper()} == set(LAYOUT)
    assert sorted(LAYOUT[f] for f in HEADER_FIELDS) == list(range(len(HEADER_FIELDS)))
    assert max(LAYOUT[f] for f in HEADER_FIELDS) < LAYOUT["HEADER_WORDS"]
    assert sorted(LAYOUT[f] for f in RECORD_FIELDS) == list(range(LAYOUT["RECORD_WORDS"]))


@pytest.mark.parametrize("n,m,nblk", [(0, 0, 0), (1, 1, 1), (3, 2, 7), (1024, 51, 20000)])
def test_sizes(n, m, nblk):
    want = LAYOUT["HEADER_WORDS"] + 2 * n + LAYOUT["RECORD_WORDS"] * m + nblk
    assert staging.total_words(n, m, nblk) == _C.staging.total_words(n, m, nblk) == want


@pytest.mark.parametrize("r,w", [(1, 1), (8, 4), (1024, 2048)])
def test_capacity(r, w):
    want = LAYOUT["HEADER_WORDS"] + (2 + LAYOUT["RECORD_WORDS"]) * r + r * w
    assert staging.capacity_words(r, w) == _C.staging.capacity_words(r, w) == want
    assert DecodeBuffers(r, w, 16).staging.numel() == want


def test_kernels_get_every_offset():
    """The launcher passes each offset the prep kernels read from zos.staging."""
    snap = dict(NUM_REQS_WORD=staging.NUM_REQS, HEADER_WORDS=staging.HEADER_WORDS)
    assert kernels._SNAPSHOT_LAYOUT == snap
    assert kernels._REBUILD_LAYOUT == dict(
        snap, NUM_RECORDS_WORD=staging.NUM_RECORDS, RECORD_WORDS=staging.RECORD_WORDS,
        **{f: getattr(staging, f) for f in RECORD_FIELDS})


def small_packer():
    return StepPacker(max_num_reqs=8, uniform_decode_query_len=1, block_size=4,
                      max_num_blocks_per_req=4, num_kv_blocks=64, vocab_size=100)


def pack(packer, step, capacity=256):
    out = np.full(capacity, -7, np.int32)
    words = packer.pack(step.req_ids, step.new_rows, step.new_tokens, step.new_positions,
                        step.new_block_indptr, step.new_block_ids, step.append_rows,
                        step.append_block_ids, out)
    assert (out[words:] == -7).all()
    return staging.parse(out[:words]), out[:words]


def test_record_layout():
    p = small_packer()
    view, rec = pack(p, DecodeStep.build([7, 8, 9], {0: (11, 3, [5]), 1: (12, 4, [6, 9]),
                                                     2: (13, 0, [2])}))
    assert rec[:8].tolist() == [3, 3, 0, 3, 4, 1, 0, 0]
    assert view.row_src.tolist() == [-1, -1, -1] and view.row_rec.tolist() == [0, 1, 2]
    assert view.records.tolist() == [[11, 3, 0, 1, 0], [12, 4, 0, 2, 1], [13, 0, 0, 1, 3]]
    assert view.blocks.tolist() == [5, 6, 9, 2]
    # Rotate, request 7 crosses into its second block (append), request 10 arrives.
    view, rec = pack(p, DecodeStep.build([9, 7, 8, 10], {3: (14, 0, [3])}, appends=[(1, 21)]))
    assert rec[:8].tolist() == [4, 4, 3, 2, 2, 1, 0, 0]
    assert view.row_src.tolist() == [2, 0, 1, -1] and view.row_rec.tolist() == [-1, 1, -1, 0]
    assert view.records.tolist() == [[14, 0, 0, 1, 0], [-1, -1, 1, 1, 1]]
    assert view.blocks.tolist() == [3, 21]
    assert len(rec) == staging.HEADER_WORDS + 2 * 4 + 5 * 2 + 2


def test_record_words_by_name():
    """Every header word and record field of a packed record, read through the constants."""
    p = small_packer()
    pack(p, DecodeStep.build([7, 8], {0: (11, 3, [5]), 1: (12, 4, [6, 9])}))
    # Swap, request 7 crosses into its second block, request 20 arrives with two blocks.
    view, rec = pack(p, DecodeStep.build([8, 7, 20], {2: (13, 6, [2, 4])}, appends=[(1, 30)]))
    h = LAYOUT["HEADER_WORDS"]
    assert [int(rec[LAYOUT[f]]) for f in HEADER_FIELDS] == [3, 3, 2, 2, 3, 1]
    assert rec[max(LAYOUT[f] for f in HEADER_FIELDS) + 1 : h].tolist() == [0, 0]  # reserved
    assert view.num_reqs == rec[staging.NUM_REQS] and view.prev_reqs == rec[staging.PREV_REQS]
    assert view.row_src.tolist() == rec[h : h + 3].tolist() == [1, 0, -1]
    assert view.row_rec.tolist() == rec[h + 3 : h + 6].tolist() == [-1, 1, 0]
    assert view.records.shape == (rec[staging.NUM_RECORDS], LAYOUT["RECORD_WORDS"])
    assert [int(view.records[0, LAYOUT[f]]) for f in RECORD_FIELDS] == [13, 6, 0, 2, 0]
    assert [int(view.records[1, LAYOUT[f]]) for f in RECORD_FIELDS] == [-1, -1, 1, 1, 2]
    assert view.blocks.tolist() == [2, 4, 30]
    assert len(rec) == staging.total_words(3, 2, 3) == h + 2 * 3 + LAYOUT["RECORD_WORDS"] * 2 + 3


# Another layout: header fields shuffled into a longer header, record fields shuffled into
# longer records, every unused word holding GARBAGE. The prep kernels and the numba builder
# given it as their offsets must produce the same metadata: they hard-code none.
SHUFFLED = dict(HEADER_WORDS=11, RECORD_WORDS=7,
                NUM_REQS=9, NUM_TOKENS=3, PREV_REQS=0, NUM_RECORDS=6, NUM_BLOCK_IDS=2, Q=10,
                R_TOKEN=5, R_POS0=3, R_COL0=0, R_COUNT=6, R_BLK_OFF=1)
GARBAGE = 1 << 20


def relayout(record, to):
    """``record`` (in the native layout) rewritten in layout ``to``."""
    view = staging.parse(record)
    n, m, nblk = view.num_reqs, len(view.records), len(view.blocks)
    h, rw = to["HEADER_WORDS"], to["RECORD_WORDS"]
    out = np.full(h + 2 * n + rw * m + nblk, GARBAGE, np.int32)
    for f in HEADER_FIELDS:
        out[to[f]] = record[getattr(staging, f)]
    out[h : h + n], out[h + n : h + 2 * n] = view.row_src, view.row_rec
    recs = out[h + 2 * n : h + 2 * n + rw * m].reshape(m, rw)
    for f in RECORD_FIELDS:
        recs[:, to[f]] = view.records[:, getattr(staging, f)]
    out[h + 2 * n + rw * m :] = view.blocks
    return out


def test_kernels_and_host_builder_follow_the_layout(monkeypatch):
    bs, w, num_kv_blocks, vocab, r = 4, 6, 400, 1000, 16
    monkeypatch.setattr(kernels, "_SNAPSHOT_LAYOUT", dict(
        NUM_REQS_WORD=SHUFFLED["NUM_REQS"], HEADER_WORDS=SHUFFLED["HEADER_WORDS"]))
    monkeypatch.setattr(kernels, "_REBUILD_LAYOUT", dict(
        kernels._SNAPSHOT_LAYOUT, NUM_RECORDS_WORD=SHUFFLED["NUM_RECORDS"],
        RECORD_WORDS=SHUFFLED["RECORD_WORDS"], **{f: SHUFFLED[f] for f in RECORD_FIELDS}))
    build_rows = host_backend._make_build_rows(
        *(SHUFFLED[k] for k in ("HEADER_WORDS", "RECORD_WORDS", "NUM_REQS", "NUM_RECORDS",
                                *RECORD_FIELDS)))
    monkeypatch.setattr(host_backend, "_build_rows",
                        lambda rec, *args: build_rows(relayout(rec, SHUFFLED), *args))
    kw = dict(num_kv_blocks=num_kv_blocks, vocab_size=vocab, buckets=BucketTable([4, 8, 16]))
    bufs = DecodeBuffers(r, w, bs, device=DEVICE)
    bufs.staging = torch.zeros(SHUFFLED["HEADER_WORDS"] + (2 + SHUFFLED["RECORD_WORDS"]) * r
                               + r * w, dtype=torch.int32, device=DEVICE)
    dev = DeviceMetadataBackend(bufs, **kw)
    host = HostMetadataBackend(DecodeBuffers(r, w, bs, device=DEVICE), **kw)
    gen = TraceGen(3, max_num_reqs=r, block_size=bs, max_blocks=w, num_kv_blocks=num_kv_blocks,
                   vocab=vocab)
    for _ in range(12):
        step, rows = gen.next_step()
        plan = dev.stage(step)
        words = dev.last_upload_bytes // 4
        native = bufs.staging[:words].cpu().numpy()
        shuffled = torch.from_numpy(relayout(native, SHUFFLED))
        bufs.staging[: len(shuffled)] = shuffled.to(DEVICE)
        dev.build(plan.padded_size)
        for md in (dev.metadata(plan), host.prepare(step)):
            want = expected(rows, md.padded_size, block_size=bs, max_blocks=w)
            for f, v in want.items():
                assert getattr(md, f).cpu().numpy().tolist() == v.tolist(), f
        toks = torch.from_numpy(gen.sampled(rows)).to(DEVICE)
        for b in (dev, host):
            b.buffers.sampled[: len(rows)] = toks


def backend_kw():
    return dict(num_kv_blocks=400, vocab_size=1000, buckets=BucketTable([4, 8, 16]))


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU buffers")
def test_upload_stream_cpu():
    assert DeviceMetadataBackend(DecodeBuffers(16, 6, 4), **backend_kw()).stream is None
    with pytest.raises(ValueError, match="stream must be None for CPU buffers"):
        DeviceMetadataBackend(DecodeBuffers(16, 6, 4), stream=object(), **backend_kw())


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA streams")
def test_upload_stream_cuda():
    """The upload's stream: chosen at construction, checked, movable; a trace staged and
    built on a side stream (and then moved back) matches the truth."""
    bufs = DecodeBuffers(16, 6, 4, device="cuda")
    assert DeviceMetadataBackend(bufs, **backend_kw()).stream == torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        dev = DeviceMetadataBackend(bufs, **backend_kw())
    assert dev.stream == side
    with pytest.raises(TypeError, match="torch.cuda.Stream"):
        DeviceMetadataBackend(bufs, stream=0, **backend_kw())
    with pytest.raises(TypeError, match="torch.cuda.Stream"):
        dev.stream = None
    assert dev.stream == side
    gen = TraceGen(5, max_num_reqs=16, block_size=4, max_blocks=6, num_kv_blocks=400,
                   vocab=1000)
    for i in range(20):
        if i == 10:
            dev.stream = torch.cuda.current_stream()
        with torch.cuda.stream(dev.stream):
            step, rows = gen.next_step()
            md = dev.prepare(step)
            want = expected(rows, md.padded_size, block_size=4, max_blocks=6)
            for f, v in want.items():
                assert getattr(md, f).cpu().numpy().tolist() == v.tolist(), f
            bufs.sampled[: len(rows)] = torch.from_numpy(gen.sampled(rows)).to("cuda")


def test_carried_rows_cost_two_words():
    """Upload size is independent of context length for carried rows."""
    p = StepPacker(max_num_reqs=64, uniform_decode_query_len=1, block_size=16,
                   max_num_blocks_per_req=2048, num_kv_blocks=10**6, vocab_size=100)
    ids = list(range(64))
    pack(p, DecodeStep.build(ids, {i: (1, 30000, list(range(1 + 2000 * i, 1 + 2000 * i + 1876)))
                                   for i in ids}), capacity=10**6)
    _, rec = pack(p, DecodeStep.build(ids[::-1]), capacity=10**6)
    assert len(rec) == staging.HEADER_WORDS + 2 * 64


def test_packer_remap_agrees_with_compute_remap():
    """The packer's incremental index gives compute_remap's answer on every step."""
    from zos import compute_remap

    gen = TraceGen(7, max_num_reqs=24, block_size=4, max_blocks=6, num_kv_blocks=400, vocab=100,
                   big=True)
    gen.next_id = 2**62  # large ids, far from the row numbers
    p = StepPacker(max_num_reqs=24, uniform_decode_query_len=1, block_size=4,
                   max_num_blocks_per_req=6, num_kv_blocks=400, vocab_size=100)
    prev = np.zeros(0, np.int64)
    for _ in range(200):
        step, rows = gen.next_step()
        view, _ = pack(p, step, capacity=4096)
        want = np.zeros(step.num_reqs, np.int32)
        compute_remap(prev, step.req_ids, want)
        carried = np.setdiff1d(np.arange(step.num_reqs), step.new_rows)
        assert view.row_src[carried].tolist() == want[carried].tolist()
        assert (view.row_src[step.new_rows] == -1).all()
        gen.sampled(rows)
        prev = step.req_ids


def test_packer_duplicates():
    p = small_packer()
    pack(p, DecodeStep.build([1, 2], {0: (1, 0, [1]), 1: (1, 0, [2])}))
    new = {2: (1, 0, [3]), 3: (1, 0, [4])}
    for ids, where in [([1, 2, 9, 9], "9 appears twice, at positions 2 and 3"),
                       ([2, 1, 5, 2], "2 appears twice, at positions 0 and 3"),
                       ([1, 2, 5, 1], "1 appears twice, at positions 0 and 3")]:
        with pytest.raises(ValueError, match=where):
            pack(p, DecodeStep.build(ids, new))
    view, _ = pack(p, DecodeStep.build([2, 1]))  # the index is intact after the errors
    assert view.row_src.tolist() == [1, 0]


def test_record_larger_than_out():
    p = small_packer()
    step = DecodeStep.build([1, 2], {0: (1, 0, [1]), 1: (1, 0, [2])})
    with pytest.raises(ValueError, match="the staging record needs 24 words, capacity is 23"):
        pack(p, step, capacity=23)
    view, _ = pack(p, step, capacity=24)  # nothing was committed by the failed call
    assert view.prev_reqs == 0 and view.row_src.tolist() == [-1, -1]
