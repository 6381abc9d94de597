"""The sparse staging record: only rows that change are listed (csrc/staging.h).

A step's record is 8 + 3K + 5M + L words, K the rows that are new, moved or get blocks;
a row that keeps its place with nothing to apply costs nothing. Checked on a hand-built
trace (exact records), then both backends against the per-request truth over seeded
traces that keep most rows in place (arrivals in place, swaps, 3-cycles, shuffles,
growth and shrink, block appends) at odd sizes.
"""
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
    kernels,
    staging,
)

from helpers import DEVICE, Req, expected

BS, W, VOCAB = 4, 4, 100


def pack(packer, step, capacity=512):
    out = np.full(capacity, -7, np.int32)
    words = packer.pack(step.req_ids, step.new_rows, step.new_tokens, step.new_positions,
                        step.new_block_indptr, step.new_block_ids, step.append_rows,
                        step.append_block_ids, out)
    assert (out[words:] == -7).all()
    return staging.parse(out[:words]), out[:words]


# Five requests; each step below lists its rows (request ids), new rows and appends.
HAND = [
    # Step 1: all new. Request 10 at position 3 fills its first block.
    (DecodeStep.build([10, 11, 12, 13, 14], {0: (1, 3, [1]), 1: (2, 1, [2, 11]),
                                             2: (3, 4, [3, 4]), 3: (4, 0, [5]),
                                             4: (5, 2, [6])})),
    # Step 2: request 13 leaves, 15 arrives in its row; request 10 (position 4) gets block 9.
    DecodeStep.build([10, 11, 12, 15, 14], {3: (7, 5, [7, 8])}, appends=[(0, 9)]),
    # Step 3: rows 0 and 4 swap; request 14, now in row 0, reaches position 4: block 10.
    DecodeStep.build([14, 11, 12, 15, 10], appends=[(0, 10)]),
    # Step 4: nothing changes: every request advances in place within its blocks.
    DecodeStep.build([14, 11, 12, 15, 10]),
]


def test_hand_built_records():
    p = StepPacker(max_num_reqs=8, uniform_decode_query_len=1, block_size=BS,
                   max_num_blocks_per_req=W, num_kv_blocks=64, vocab_size=VOCAB)
    view, rec = pack(p, HAND[0])
    assert view.entries.tolist() == [[r, -1, r] for r in range(5)]
    assert len(rec) == 8 + 3 * 5 + 5 * 5 + 7 == staging.total_words(5, 5, 7)

    view, rec = pack(p, HAND[1])
    assert rec[:8].tolist() == [5, 5, 5, 2, 3, 1, 2, 0]
    assert view.entries.tolist() == [[3, -1, 0], [0, 0, 1]]  # new row 3; row 0 in place + block
    assert view.records.tolist() == [[7, 5, 0, 2, 0], [-1, -1, 1, 1, 2]]
    assert view.blocks.tolist() == [7, 8, 9]
    assert len(rec) == 8 + 3 * 2 + 5 * 2 + 3 == 27

    view, rec = pack(p, HAND[2])
    assert rec[:8].tolist() == [5, 5, 5, 1, 1, 1, 2, 0]
    assert view.entries.tolist() == [[0, 4, 0], [4, 0, -1]]  # the swap, row 0 with its block
    assert view.records.tolist() == [[-1, -1, 1, 1, 0]] and view.blocks.tolist() == [10]
    assert view.row_src.tolist() == [4, 1, 2, 3, 0] and view.row_rec.tolist() == [0, -1, -1, -1, -1]
    assert len(rec) == 8 + 3 * 2 + 5 * 1 + 1 == 20

    view, rec = pack(p, HAND[3])
    assert rec.tolist() == [5, 5, 5, 0, 0, 1, 0, 0]  # K = 0: the header alone
    assert view.row_src.tolist() == list(range(5)) and view.row_rec.tolist() == [-1] * 5

    # Step 5 without appends: requests 12 and 15 reach position 8, past their two blocks.
    with pytest.raises(ValueError, match=r"request 1[25]\) at position 8 needs block column 2"):
        pack(p, DecodeStep.build([14, 11, 12, 15, 10]))
    with pytest.raises(ValueError, match=r"request 15\) at position 8 needs block column 2"):
        pack(p, DecodeStep.build([14, 11, 12, 15, 10], appends=[(2, 20)]))
    view, rec = pack(p, DecodeStep.build([14, 11, 12, 15, 10], appends=[(3, 21), (2, 20)]))
    assert view.entries.tolist() == [[3, 3, 0], [2, 2, 1]]  # in order of first append
    assert view.records.tolist() == [[-1, -1, 2, 1, 0], [-1, -1, 2, 1, 1]]
    assert len(rec) == 8 + 3 * 2 + 5 * 2 + 2


@pytest.mark.parametrize("kind", ["device", "host"])
def test_hand_built_metadata(kind):
    cls = DeviceMetadataBackend if kind == "device" else HostMetadataBackend
    bufs = DecodeBuffers(8, W, BS, device=DEVICE)
    b = cls(bufs, num_kv_blocks=64, vocab_size=VOCAB, buckets=BucketTable([8]))
    truth = {}  # request -> Req
    for i, step in enumerate(HAND):
        for k, row in enumerate(step.new_rows.tolist()):
            lo, hi = step.new_block_indptr[k], step.new_block_indptr[k + 1]
            truth[int(step.req_ids[row])] = Req(int(step.req_ids[row]), int(step.new_tokens[k]),
                                                int(step.new_positions[k]),
                                                step.new_block_ids[lo:hi].tolist())
        for row, blk in zip(step.append_rows.tolist(), step.append_block_ids.tolist()):
            truth[int(step.req_ids[row])].blocks.append(blk)
        rows = [truth[int(r)] for r in step.req_ids]
        md = b.prepare(step)
        for f, v in expected(rows, md.padded_size, block_size=BS, max_blocks=W).items():
            assert getattr(md, f).cpu().numpy().tolist() == v.tolist(), (i, f)
        toks = [50 + 7 * i + j for j in range(len(rows))]
        for r, t in zip(rows, toks):
            r.token, r.pos = t, r.pos + 1
        bufs.sampled[: len(rows)] = torch.tensor(toks, dtype=torch.int32)


class SteadyTrace:
    """Up to ``n`` rows, most of them in place: each step finished requests are replaced in
    their rows by arrivals, and now and then two rows swap, three rotate, all shuffle, the
    batch grows or shrinks by a row; carried rows crossing a block boundary get a block."""

    def __init__(self, seed, n, *, block_size, max_blocks, vocab):
        self.rng = np.random.default_rng(seed)
        self.n, self.bs, self.w, self.vocab = n, block_size, max_blocks, vocab
        self.num_kv_blocks = 1 + 2 * n * max_blocks
        self.free = list(range(1, self.num_kv_blocks))
        self.rows: list[Req] = []
        self.next_id = 0

    def _arrival(self):
        pos = int(self.rng.integers(0, self.w * self.bs - 1))
        blocks, self.free = self.free[: pos // self.bs + 1], self.free[pos // self.bs + 1:]
        self.next_id += 1
        return Req(self.next_id, int(self.rng.integers(0, self.vocab)), pos, blocks)

    def next_step(self):
        rng, rows, new = self.rng, list(self.rows), set()
        if not rows:
            rows = [self._arrival() for _ in range(self.n)]
            new = {r.rid for r in rows}
        for i, r in enumerate(rows):
            if r.rid not in new and (r.pos + 1 >= self.w * self.bs or rng.random() < 0.06):
                self.free += r.blocks
                rows[i] = self._arrival()
                new.add(rows[i].rid)
        k, u = len(rows), rng.random()
        if k >= 2 and u < 0.15:
            i, j = rng.choice(k, 2, replace=False)
            rows[i], rows[j] = rows[j], rows[i]
        elif k >= 3 and u < 0.25:
            i, j, m = rng.choice(k, 3, replace=False)
            rows[i], rows[j], rows[m] = rows[m], rows[i], rows[j]
        elif u < 0.3:
            rows = [rows[i] for i in rng.permutation(k)]
        elif u < 0.4 and k > 1:
            self.free += rows.pop(int(rng.integers(0, k))).blocks  # a row leaves: rows shift
        elif u < 0.5 and k < self.n:
            rows.append(self._arrival())
            new.add(rows[-1].rid)
        appends = []
        for i, r in enumerate(rows):
            if r.rid not in new and r.pos // self.bs >= len(r.blocks):
                r.blocks.append(self.free.pop(0))
                appends.append((i, r.blocks[-1]))
        payload = {i: (r.token, r.pos, r.blocks) for i, r in enumerate(rows) if r.rid in new}
        self.rows = rows
        return DecodeStep.build([r.rid for r in rows], payload, appends), rows

    def sample(self, rows):
        toks = self.rng.integers(0, self.vocab, size=len(rows)).astype(np.int32)
        for r, t in zip(rows, toks):
            r.token, r.pos = int(t), r.pos + 1
        return toks


def listed_rows(step, prev_ids):
    """Rows the record must list: new, moved (or past the previous batch), or appended."""
    ids = step.req_ids.tolist()
    out = set(step.new_rows.tolist()) | set(step.append_rows.tolist())
    out |= {i for i, r in enumerate(ids) if i >= len(prev_ids) or prev_ids[i] != r}
    return out


@pytest.mark.parametrize("n,seed", [(5, 0), (17, 1), (97, 2)])
def test_steady_traces_match_truth(n, seed):
    steps = {5: 40, 17: 30, 97: 12}[n]
    gen = SteadyTrace(seed, n, block_size=BS, max_blocks=W, vocab=VOCAB)
    buckets = BucketTable(sorted({1, (n + 1) // 2, n}))
    kw = dict(num_kv_blocks=gen.num_kv_blocks, vocab_size=VOCAB, buckets=buckets)
    dev = DeviceMetadataBackend(DecodeBuffers(n, W, BS, device=DEVICE), **kw)
    host = HostMetadataBackend(DecodeBuffers(n, W, BS, device=DEVICE), **kw)
    prev_ids, sizes = [], []
    for i in range(steps):
        step, rows = gen.next_step()
        listed = listed_rows(step, prev_ids)
        md = dev.prepare(step)
        # The record lists exactly the rows that change, once each.
        words = dev.last_upload_bytes // 4
        view = staging.parse(dev.buffers.staging[:words].cpu().numpy())
        assert sorted(view.entries[:, staging.E_ROW].tolist()) == sorted(listed)
        m = len(step.new_rows) + len(set(step.append_rows.tolist()))
        assert words == staging.total_words(len(listed), m, len(step.new_block_ids)
                                            + len(step.append_rows))
        assert all(v.eq(0).all() for v in kernels.row_map(dev.buffers))  # zero between steps
        sizes.append(len(listed))
        for b, got in ((dev, md), (host, host.prepare(step))):
            want = expected(rows, got.padded_size, block_size=BS, max_blocks=W)
            for f, v in want.items():
                assert getattr(got, f).cpu().numpy().tolist() == v.tolist(), (b.name, i, f)
        toks = torch.from_numpy(gen.sample(rows)).to(DEVICE)
        for b in (dev, host):
            b.buffers.sampled[: len(rows)] = toks
        prev_ids = step.req_ids.tolist()
    assert min(sizes[1:]) < n  # some steps leave rows out
