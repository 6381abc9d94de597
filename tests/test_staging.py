"""The staging record: Python mirror, C++ header and packer output agree; the kernels and
the numba builder read it only through the exported layout; the upload's stream."""
import dataclasses
import importlib.util
import inspect

import numpy as np
import pytest
import torch
import triton.language as tl

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
from zos.triton_kernels import prep

from helpers import DEVICE, TraceGen, expected

# The layout of csrc/staging.h, word by word: every name zos._C.staging exports.
LAYOUT = dict(HEADER_WORDS=8, LIST_WORDS=3, RECORD_WORDS=5,
              NUM_REQS=0, NUM_TOKENS=1, PREV_REQS=2, NUM_RECORDS=3, NUM_BLOCK_IDS=4, Q=5,
              NUM_LISTED=6, SEQ=7, SEQ_MASK=(1 << 30) - 1, L_ROW=0, L_SRC=1, L_REC=2,
              R_TOKEN=0, R_POS0=1, R_COL0=2, R_COUNT=3, R_BLK_OFF=4)
HEADER_FIELDS = ("NUM_REQS", "NUM_TOKENS", "PREV_REQS", "NUM_RECORDS", "NUM_BLOCK_IDS", "Q",
                 "NUM_LISTED", "SEQ")
LIST_FIELDS = ("L_ROW", "L_SRC", "L_REC")
RECORD_FIELDS = ("R_TOKEN", "R_POS0", "R_COL0", "R_COUNT", "R_BLK_OFF")


def test_constants_match_native():
    assert staging.HEADER_WORDS == _C.staging.HEADER_WORDS == 8
    assert staging.LIST_WORDS == _C.staging.LIST_WORDS == 3
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
    assert sorted(LAYOUT[f] for f in HEADER_FIELDS) == list(range(LAYOUT["HEADER_WORDS"]))
    assert sorted(LAYOUT[f] for f in LIST_FIELDS) == list(range(LAYOUT["LIST_WORDS"]))
    assert sorted(LAYOUT[f] for f in RECORD_FIELDS) == list(range(LAYOUT["RECORD_WORDS"]))


@pytest.mark.parametrize("c,m,nblk", [(0, 0, 0), (1, 1, 1), (3, 2, 7), (1024, 51, 20000)])
def test_sizes(c, m, nblk):
    want = LAYOUT["HEADER_WORDS"] + 3 * c + LAYOUT["RECORD_WORDS"] * m + nblk
    assert staging.total_words(c, m, nblk) == _C.staging.total_words(c, m, nblk) == want


@pytest.mark.parametrize("r,w", [(1, 1), (8, 4), (1024, 2048)])
def test_capacity(r, w):
    want = LAYOUT["HEADER_WORDS"] + (3 + LAYOUT["RECORD_WORDS"]) * r + r * w
    assert staging.capacity_words(r, w) == _C.staging.capacity_words(r, w) == want
    assert DecodeBuffers(r, w, 16).staging.numel() == want


# The prep kernels' constexpr globals (zos.triton_kernels.prep) and the zos.staging name each
# one takes its value from.
KERNEL_LAYOUT = dict(HEADER_WORDS="HEADER_WORDS", LIST_WORDS="LIST_WORDS",
                     RECORD_WORDS="RECORD_WORDS", NUM_REQS_WORD="NUM_REQS",
                     NUM_RECORDS_WORD="NUM_RECORDS", NUM_LISTED_WORD="NUM_LISTED",
                     SEQ_WORD="SEQ", SEQ_MASK="SEQ_MASK",
                     **{f: f for f in LIST_FIELDS + RECORD_FIELDS})
RING_STATE_NAMES = ("CTR", "LAST", "CUR", "CUR_N", "CUR_M", "CUR_C", "CUR_SEQ", "FINISHED")


def test_kernels_read_every_offset_from_zos_staging():
    """Each offset the prep kernels read is a constexpr global of their module, taken from
    zos.staging; the ring state's words are distinct, fit in RING_STATE_WORDS, and the host
    sees the values the kernels read."""
    for name, source in KERNEL_LAYOUT.items():
        value = getattr(prep, name)
        assert isinstance(value, tl.constexpr), name
        assert value.value == getattr(staging, source) == LAYOUT[source], name
    words = [getattr(prep, name).value for name in RING_STATE_NAMES]
    assert sorted(words) == list(range(len(RING_STATE_NAMES)))
    assert len(words) <= kernels.RING_STATE_WORDS == prep.RING_STATE_WORDS
    assert kernels.RING_STATE == dict(zip(RING_STATE_NAMES, words))
    assert kernels.IN_PLACE == prep.IN_PLACE.value < -1  # not a row, not "new" (-1)


@pytest.mark.parametrize("kernel", ["scatter_listed_rows", "rebuild_rows", "select_slot"])
def test_kernel_signatures_take_no_layout(kernel):
    """No layout constant is a kernel parameter: the signatures keep the real arguments."""
    params = set(inspect.signature(getattr(prep, kernel).fn).parameters)
    layout_names = set(KERNEL_LAYOUT) | set(RING_STATE_NAMES) | {"IN_PLACE"}
    assert not params & layout_names


def load_prep_kernels(layout, monkeypatch):
    """A second copy of zos.triton_kernels.prep whose constexpr globals take ``layout``'s
    values (zos.staging is patched while the copy is imported, and restored after)."""
    with monkeypatch.context() as m:
        for name, value in layout.items():
            m.setattr(staging, name, value)
        spec = importlib.util.spec_from_file_location("zos_prep_relayout", prep.__file__)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    assert module.HEADER_WORDS.value == layout["HEADER_WORDS"]
    assert staging.HEADER_WORDS == LAYOUT["HEADER_WORDS"]
    return module


def small_packer():
    return StepPacker(max_num_reqs=8, uniform_decode_query_len=1, block_size=4,
                      max_num_blocks_per_req=4, num_kv_blocks=64, vocab_size=100)


def pack(packer, step, capacity=256):
    out = np.full(capacity, -7, np.int32)
    words = packer.pack(step.req_ids, step.new_rows, step.new_tokens, step.new_positions,
                        step.new_block_indptr, step.new_block_ids, step.append_rows,
                        step.append_block_ids, out, rewrite_rows=step.rewrite_rows,
                        rewrite_block_indptr=step.rewrite_block_indptr,
                        rewrite_block_ids=step.rewrite_block_ids)
    assert (out[words:] == -7).all()
    return staging.parse(out[:words]), out[:words]


def test_record_layout():
    p = small_packer()
    view, rec = pack(p, DecodeStep.build([7, 8, 9], {0: (11, 3, [5]), 1: (12, 4, [6, 9]),
                                                     2: (13, 0, [2])}))
    assert rec[:8].tolist() == [3, 3, 0, 3, 4, 1, 3, 0]
    assert view.listed.tolist() == [[0, -1, 0], [1, -1, 1], [2, -1, 2]]
    assert view.row_src.tolist() == [-1, -1, -1] and view.row_rec.tolist() == [0, 1, 2]
    assert view.records.tolist() == [[11, 3, 0, 1, 0], [12, 4, 0, 2, 1], [13, 0, 0, 1, 3]]
    assert view.blocks.tolist() == [5, 6, 9, 2]
    # Rotate, request 7 crosses into its second block (append), request 10 arrives.
    view, rec = pack(p, DecodeStep.build([9, 7, 8, 10], {3: (14, 0, [3])}, appends=[(1, 21)]))
    assert rec[:8].tolist() == [4, 4, 3, 2, 2, 1, 4, 0]
    assert view.listed.tolist() == [[0, 2, -1], [1, 0, 1], [2, 1, -1], [3, -1, 0]]
    assert view.row_src.tolist() == [2, 0, 1, -1] and view.row_rec.tolist() == [-1, 1, -1, 0]
    assert view.records.tolist() == [[14, 0, 0, 1, 0], [-1, -1, 1, 1, 1]]
    assert view.blocks.tolist() == [3, 21]
    assert len(rec) == staging.HEADER_WORDS + 3 * 4 + 5 * 2 + 2
    # Nothing changes: the record is the header alone, every row carried in place.
    view, rec = pack(p, DecodeStep.build([9, 7, 8, 10]))
    assert rec.tolist() == [4, 4, 4, 0, 0, 1, 0, 0]
    assert view.row_src.tolist() == [0, 1, 2, 3] and view.row_rec.tolist() == [-1] * 4
    # Request 8 leaves, 10 takes its row: one listed row; an append in place lists its row.
    view, rec = pack(p, DecodeStep.build([9, 7, 10], appends=[(0, 22)]))
    assert view.listed.tolist() == [[0, 0, 0], [2, 3, -1]]
    assert view.records.tolist() == [[-1, -1, 1, 1, 0]] and view.blocks.tolist() == [22]


def test_dense_record_lists_every_row():
    """list_every_row: the same rows, records and blocks, every row listed."""
    sparse, dense = small_packer(), small_packer()
    dense.list_every_row = True
    steps = [DecodeStep.build([7, 8, 9], {0: (11, 3, [5]), 1: (12, 4, [6, 9]), 2: (13, 0, [2])}),
             DecodeStep.build([7, 9, 8], appends=[(0, 21)]), DecodeStep.build([7, 9, 8])]
    for step in steps:
        vs, _ = pack(sparse, step)
        vd, rec = pack(dense, step)
        assert vd.listed[:, 0].tolist() == list(range(step.num_reqs))
        assert len(rec) == staging.total_words(step.num_reqs, len(vd.records), len(vd.blocks))
        for f in ("row_src", "row_rec", "records", "blocks"):
            assert getattr(vs, f).tolist() == getattr(vd, f).tolist(), f


def test_record_layout_with_rewritten_rows():
    """A rewritten row (in place or moved) is listed with a record of its whole list (col0 =
    0, token = pos0 = -1) after the appended rows' records, its blocks after theirs; sparse
    and dense records agree."""
    sparse, dense = small_packer(), small_packer()
    dense.list_every_row = True

    def both(step):
        (vs, rec), (vd, _) = pack(sparse, step), pack(dense, step)
        for f in ("row_src", "row_rec", "records", "blocks"):
            assert getattr(vs, f).tolist() == getattr(vd, f).tolist(), f
        return vs, rec

    both(DecodeStep.build([7, 8, 9], {0: (11, 3, [5]), 1: (12, 4, [6, 9]), 2: (13, 0, [2])}))
    # Request 7 crosses into a block (append); request 8's blocks swapped in place.
    view, rec = both(DecodeStep.build([7, 8, 9], appends=[(0, 21)], rewrites={1: [10, 11]}))
    assert rec[:7].tolist() == [3, 3, 3, 2, 3, 1, 2]
    assert view.listed.tolist() == [[0, 0, 0], [1, 1, 1]]
    assert view.records.tolist() == [[-1, -1, 1, 1, 0], [-1, -1, 0, 2, 1]]
    assert view.blocks.tolist() == [21, 10, 11]
    # Requests 7 and 8 swap rows; 8 (moved) gets a copy-on-write block, 9 (in place) grows
    # ahead to three blocks; 7 moves with nothing else.
    view, rec = both(DecodeStep.build([8, 7, 9], rewrites={2: [3, 4, 15], 0: [12, 11]}))
    assert rec[:7].tolist() == [3, 3, 3, 2, 5, 1, 3]
    assert view.listed.tolist() == [[0, 1, 0], [1, 0, -1], [2, 2, 1]]
    assert view.records.tolist() == [[-1, -1, 0, 2, 0], [-1, -1, 0, 3, 2]]
    assert view.blocks.tolist() == [12, 11, 3, 4, 15]
    assert len(rec) == staging.total_words(3, 2, 5)


def test_rewritten_rows_move_their_deadlines():
    """The mirror takes a rewritten row's block count: a list that grew needs no append until
    its new last block is full, one that shrank needs one as soon as it runs out (refused,
    naming the row, when it is missing, with nothing committed)."""
    for dense in (False, True):
        p = small_packer()
        p.list_every_row = dense
        pack(p, DecodeStep.build([7, 8], {0: (11, 3, [5]), 1: (12, 2, [6])}))
        # Request 8 (position 3) grows ahead to [6, 9, 10]: no append at positions 4..11.
        pack(p, DecodeStep.build([7, 8], appends=[(0, 21)], rewrites={1: [6, 9, 10]}))
        for _ in range(3):  # request 8 at positions 4..6: nothing listed
            view, _ = pack(p, DecodeStep.build([7, 8]))
            assert len(view.listed) == (2 if dense else 0) and p.rows_visited == 0
        pack(p, DecodeStep.build([7, 8], appends=[(0, 22)]))  # 7 at 8, 8 at 7: no append
        # Request 8 (position 8) shrinks to [6, 9, 30] -> still 3 blocks; then to 2 blocks at
        # a position they cover is refused.
        with pytest.raises(ValueError, match=r"rewrite_block_ids: row 1 \(request 8\) at "
                                             r"position 8 needs 3 blocks, got 2"):
            pack(p, DecodeStep.build([7, 8], rewrites={1: [6, 9]}))
        view, _ = pack(p, DecodeStep.build([7, 8], rewrites={1: [6, 9, 30]}))
        assert view.records.tolist() == [[-1, -1, 0, 3, 0]]
        for _ in range(2):  # request 8 at positions 9, 10, 11: its third block
            pack(p, DecodeStep.build([7, 8]))
        pack(p, DecodeStep.build([7, 8], appends=[(0, 23)]))  # request 7 at 12
        with pytest.raises(ValueError, match=r"row 1 \(request 8\) at position 12 needs block "
                                             r"column 3 but holds 3 blocks; append a block"):
            pack(p, DecodeStep.build([7, 8]))
        view, _ = pack(p, DecodeStep.build([7, 8], appends=[(1, 31)]))
        assert view.records.tolist() == [[-1, -1, 3, 1, 0]]


def test_rewrite_shrinks_deadline():
    """A rewritten list shorter than the old one: the row's deadline comes earlier, and a step
    past it without an append is refused though the old list would have covered it."""
    for dense in (False, True):
        p = small_packer()
        p.list_every_row = dense
        pack(p, DecodeStep.build([7], {0: (11, 1, [5, 6, 9])}))  # blocks ahead: up to 11
        pack(p, DecodeStep.build([7], rewrites={0: [5]}))  # position 2: one block, up to 3
        pack(p, DecodeStep.build([7]))  # position 3
        with pytest.raises(ValueError, match=r"row 0 \(request 7\) at position 4 needs block "
                                             r"column 1 but holds 1 blocks; append a block"):
            pack(p, DecodeStep.build([7]))
        view, _ = pack(p, DecodeStep.build([7], appends=[(0, 40)]))
        assert view.records.tolist() == [[-1, -1, 1, 1, 0]] and view.blocks.tolist() == [40]


def test_record_words_by_name():
    """Every header word, listed-row and record field of a packed record, read through the
    constants."""
    p = small_packer()
    pack(p, DecodeStep.build([7, 8], {0: (11, 3, [5]), 1: (12, 4, [6, 9])}))
    # Swap, request 7 crosses into its second block, request 20 arrives with two blocks.
    step = DecodeStep.build([8, 7, 20], {2: (13, 6, [2, 4])}, appends=[(1, 30)])
    out = np.zeros(64, np.int32)
    words = p.pack(step.req_ids, step.new_rows, step.new_tokens, step.new_positions,
                   step.new_block_indptr, step.new_block_ids, step.append_rows,
                   step.append_block_ids, out, seq=77)
    rec, view = out[:words], staging.parse(out[:words])
    h, lw = LAYOUT["HEADER_WORDS"], LAYOUT["LIST_WORDS"]
    assert [int(rec[LAYOUT[f]]) for f in HEADER_FIELDS] == [3, 3, 2, 2, 3, 1, 3, 77]
    assert view.num_reqs == rec[staging.NUM_REQS] and view.prev_reqs == rec[staging.PREV_REQS]
    assert view.seq == 77
    listed = rec[h : h + 3 * lw].reshape(3, lw)
    assert [[int(e[LAYOUT[f]]) for f in LIST_FIELDS] for e in listed] == [
        [0, 1, -1], [1, 0, 1], [2, -1, 0]]
    assert view.row_src.tolist() == [1, 0, -1] and view.row_rec.tolist() == [-1, 1, 0]
    assert view.records.shape == (rec[staging.NUM_RECORDS], LAYOUT["RECORD_WORDS"])
    assert [int(view.records[0, LAYOUT[f]]) for f in RECORD_FIELDS] == [13, 6, 0, 2, 0]
    assert [int(view.records[1, LAYOUT[f]]) for f in RECORD_FIELDS] == [-1, -1, 1, 1, 2]
    assert view.blocks.tolist() == [2, 4, 30]
    assert len(rec) == staging.total_words(3, 2, 3) == h + 3 * lw + LAYOUT["RECORD_WORDS"] * 2 + 3


# Another layout: header fields shuffled into a longer header, listed-row and record fields
# shuffled into longer entries, every unused word holding GARBAGE. The prep kernels (a copy of
# their module imported with it as zos.staging) and the numba builder given it as their
# offsets must produce the same metadata: they hard-code none.
SHUFFLED = dict(HEADER_WORDS=11, LIST_WORDS=4, RECORD_WORDS=7,
                NUM_REQS=9, NUM_TOKENS=3, PREV_REQS=0, NUM_RECORDS=6, NUM_BLOCK_IDS=2, Q=10,
                NUM_LISTED=4, SEQ=8, L_ROW=2, L_SRC=0, L_REC=3,
                R_TOKEN=5, R_POS0=3, R_COL0=0, R_COUNT=6, R_BLK_OFF=1)
GARBAGE = 1 << 20


def relayout(record, to):
    """``record`` (in the native layout) rewritten in layout ``to``."""
    view = staging.parse(record)
    c, m, nblk = len(view.listed), len(view.records), len(view.blocks)
    h, lw, rw = to["HEADER_WORDS"], to["LIST_WORDS"], to["RECORD_WORDS"]
    out = np.full(h + lw * c + rw * m + nblk, GARBAGE, np.int32)
    for f in HEADER_FIELDS:
        out[to[f]] = record[getattr(staging, f)]
    listed = out[h : h + lw * c].reshape(c, lw)
    for f in LIST_FIELDS:
        listed[:, to[f]] = view.listed[:, getattr(staging, f)]
    recs = out[h + lw * c : h + lw * c + rw * m].reshape(m, rw)
    for f in RECORD_FIELDS:
        recs[:, to[f]] = view.records[:, getattr(staging, f)]
    out[h + lw * c + rw * m :] = view.blocks
    return out


def test_kernels_and_host_builder_follow_the_layout(monkeypatch):
    bs, w, num_kv_blocks, vocab, r = 4, 6, 400, 1000, 16
    shuffled = load_prep_kernels(SHUFFLED, monkeypatch)
    for kernel in ("scatter_listed_rows", "rebuild_rows"):
        monkeypatch.setattr(kernels, kernel, getattr(shuffled, kernel))
    build_rows = host_backend._make_build_rows(
        *(SHUFFLED[k] for k in ("HEADER_WORDS", "RECORD_WORDS", "NUM_REQS", "NUM_RECORDS",
                                *RECORD_FIELDS, "NUM_LISTED", "LIST_WORDS", *LIST_FIELDS)))
    monkeypatch.setattr(host_backend, "_build_rows",
                        lambda rec, *args: build_rows(relayout(rec, SHUFFLED), *args))
    kw = dict(num_kv_blocks=num_kv_blocks, vocab_size=vocab, buckets=BucketTable([4, 8, 16]))
    bufs = DecodeBuffers(r, w, bs, device=DEVICE)
    bufs.staging = torch.zeros(SHUFFLED["HEADER_WORDS"] + (SHUFFLED["LIST_WORDS"]
                                                           + SHUFFLED["RECORD_WORDS"]) * r
                               + r * w, dtype=torch.int32, device=DEVICE)
    dev = DeviceMetadataBackend(bufs, staging="copy", **kw)  # the record in bufs.staging
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


def test_carried_rows_cost_no_word():
    """Record size is independent of context length; rows that move cost one entry, rows
    that keep their place nothing."""
    p = StepPacker(max_num_reqs=64, uniform_decode_query_len=1, block_size=16,
                   max_num_blocks_per_req=2048, num_kv_blocks=10**6, vocab_size=100)
    ids = list(range(64))
    pack(p, DecodeStep.build(ids, {i: (1, 30000, list(range(1 + 2000 * i, 1 + 2000 * i + 1876)))
                                   for i in ids}), capacity=10**6)
    _, rec = pack(p, DecodeStep.build(ids[::-1]), capacity=10**6)
    assert len(rec) == staging.HEADER_WORDS + 3 * 64
    _, rec = pack(p, DecodeStep.build(ids[::-1]), capacity=10**6)
    assert len(rec) == staging.HEADER_WORDS


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
    with pytest.raises(ValueError, match="the staging record needs 26 words, capacity is 25"):
        pack(p, step, capacity=25)
    view, _ = pack(p, step, capacity=26)  # nothing was committed by the failed call
    assert view.prev_reqs == 0 and view.row_src.tolist() == [-1, -1]


def test_pack_step_reads_a_decode_step_like_pack():
    """``pack_step`` (the DecodeStep's arrays read by name) writes ``pack``'s record, rewritten
    rows included; an object that is not a DecodeStep gets a TypeError naming the attribute,
    and a refused step leaves ``out`` unchanged."""
    steps = [DecodeStep.build([7, 8], {0: (11, 3, [5]), 1: (12, 4, [6, 9])}),
             DecodeStep.build([8, 7], appends=[(1, 10)], rewrites={0: [6, 11]})]
    by_arrays, by_step = small_packer(), small_packer()
    for step in steps:
        want = pack(by_arrays, step)[1]
        out = np.full(256, -7, np.int32)
        words = by_step.pack_step(step, out)
        assert out[:words].tolist() == want.tolist()
    with pytest.raises(TypeError, match="no attribute req_ids"):
        by_step.pack_step(object(), out)
    bad = DecodeStep.build([8, 8])
    before = out.copy()
    with pytest.raises(ValueError, match="appears twice"):
        by_step.pack_step(bad, out)
    assert (out == before).all()


@pytest.mark.parametrize("num_kv_blocks,null_block", [(64, 0), (64, 64), (1 << 31, 0),
                                                       (1 << 40, 0), (1 << 40, 1 << 40)])
@pytest.mark.parametrize("field", ["new_block_ids", "rewrite_block_ids"])
@pytest.mark.parametrize("at", [0, 5, 16, 37])
def test_block_id_range_at_every_offset(num_kv_blocks, null_block, field, at):
    """The block-id range check (one vectorised pass over new and rewritten rows' ids) against
    a plain reference: ids in [first, num_kv_blocks) pass (first = 1 when the null block 0
    lies inside the pool, else 0), every id outside is refused naming the field, the row and
    the id, at any offset of the list and for pools larger than int32 can name."""
    first = 1 if null_block == 0 else 0
    top = min(num_kv_blocks, 1 << 31) - 1  # the largest valid id an int32 can hold
    ids = np.arange(40, dtype=np.int64) % 5 + first
    ids[-1] = top
    bad = [b for b in sorted({first - 1, -5, -(1 << 31), top + 1, num_kv_blocks})
           if not first <= b <= top and -(1 << 31) <= b < (1 << 31)]  # int32 ids only

    def step(block_ids):
        if field == "new_block_ids":
            return DecodeStep.build([7, 8], {0: (1, 0, list(block_ids[:20])),
                                             1: (2, 0, list(block_ids[20:]))})
        return DecodeStep.build([7, 8], rewrites={0: list(block_ids[:20]),
                                                  1: list(block_ids[20:])})

    def packer():
        p = StepPacker(max_num_reqs=8, uniform_decode_query_len=1, block_size=4,
                       max_num_blocks_per_req=20, num_kv_blocks=num_kv_blocks, vocab_size=100,
                       null_block=null_block)
        if field == "rewrite_block_ids":  # the rows must exist before their lists change
            pack(p, DecodeStep.build([7, 8], {0: (1, 0, [first]), 1: (2, 0, [first])}))
        return p

    view, _ = pack(packer(), step(ids), capacity=512)
    assert view.blocks.tolist() == ids.tolist()
    for b in bad:
        wrong = ids.copy()
        wrong[at] = b
        row = 0 if at < 20 else 1
        with pytest.raises(ValueError, match=rf"{field}: row {row} \(request {7 + row}\) has "
                                             rf"block id {b} outside \[{first}, "):
            pack(packer(), step(wrong), capacity=512)


def test_launch_graph_refuses_what_it_cannot_launch():
    """``zos._C.launch_graph``: a negative device is a ValueError before the driver is touched;
    a null graph is refused by the driver (or, without one, by the driver's loading) as a
    RuntimeError naming the CUDA driver."""
    from zos._C import launch_graph

    with pytest.raises(ValueError, match="device must be >= 0, got -1"):
        launch_graph(0, 0, -1)
    with pytest.raises(RuntimeError, match=r"zos \(CUDA driver\): "):
        launch_graph(0, 0, 0)


def test_a_step_of_arrays_is_checked_when_staged():
    """``DecodeStep.of_arrays`` skips the constructor's per-field checks: the packer writes its
    record as the checked step's, and still refuses an array of another dtype (TypeError
    naming the field), before writing anything."""
    checked = DecodeStep.build([7, 8], {0: (11, 3, [5]), 1: (12, 4, [6, 9])})
    fields = [getattr(checked, f.name) for f in dataclasses.fields(DecodeStep)]
    want = pack(small_packer(), checked)[1]
    out = np.full(256, -7, np.int32)
    words = small_packer().pack_step(DecodeStep.of_arrays(fields), out)
    assert out[:words].tolist() == want.tolist()
    fields[3] = fields[3].astype(np.int64)
    before = out.copy()
    with pytest.raises(TypeError, match="new_positions"):
        small_packer().pack_step(DecodeStep.of_arrays(fields), out)
    assert (out == before).all()
    with pytest.raises(ValueError, match="DecodeStep has 11 fields, got 10"):
        DecodeStep.of_arrays(fields[:10])
