"""Both metadata backends with draft tokens (q = 1 + k > 1) against a per-request truth: positions
advance by each row's accepted count (read on the device, handed to the host one step late or at
once), seq_lens = position + q, slots for all q token rows, blocks allocated for the worst case
(every draft accepted), rows permuted, arriving and leaving, dummy rows reporting arbitrary
accepted counts."""
import numpy as np
import pytest
import torch

from zos import BucketTable, DecodeBuffers, DecodeStep, DeviceMetadataBackend, HostMetadataBackend

from helpers import DEVICE

VOCAB, PAD = 500, 3
BACKENDS = {"device": DeviceMetadataBackend, "host": HostMetadataBackend,
            "device_dense": lambda *a, **kw: DeviceMetadataBackend(*a, dense_record=True, **kw),
            "host_dense": lambda *a, **kw: _dense_host(*a, **kw),
            "host_ids_on_device": lambda *a, **kw: HostMetadataBackend(
                *a, input_ids_from_device=True, **kw)}


def _dense_host(*a, **kw):
    """The host-built backend over the dense record (every row listed)."""
    be = HostMetadataBackend(*a, **kw)
    be.packer.list_every_row = True
    return be


def make(kind, q, *, max_num_reqs=12, block_size=2, width=40, num_kv_blocks=4000, buckets=True):
    bufs = DecodeBuffers(max_num_reqs, width, block_size, uniform_decode_query_len=q,
                         device=DEVICE, pad_token_id=PAD)
    table = BucketTable([q * s for s in (1, 2, 4, 8)], uniform_decode_query_len=q) if buckets \
        else None
    return BACKENDS[kind](bufs, num_kv_blocks=num_kv_blocks, vocab_size=VOCAB, buckets=table)


class Truth:
    """Requests with their exact position, blocks and next input token; a scheduler that keeps
    rows (holes filled by arrivals, some steps permuted) and allocates blocks for the position
    bound the host has: exact (lag 0) or one step of q ahead (lag 1). With ``rewrite``, that
    share of carried rows gets a rewritten block list each step (DecodeStep.rewrite_rows): blocks
    replaced by fresh ones or permuted, surplus blocks dropped or blocks added ahead."""

    def __init__(self, seed, q, block_size, lag, rewrite=0.0):
        self.rng = np.random.default_rng(seed)
        self.q, self.bs, self.lag, self.rewrite = q, block_size, lag, rewrite
        self.rows, self.next_id, self.next_block = [], 1, 1
        self.bound_slack = {}  # req_id -> q - accepted of the last step (unknown yet at lag 1)

    def _blocks(self, n):
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def step(self, max_rows):
        rng, q, bs = self.rng, self.q, self.bs
        keep = [r for r in self.rows if rng.random() > 0.15]
        if rng.random() < 0.3:
            keep = [keep[i] for i in rng.permutation(len(keep))]
        while len(keep) < max_rows and rng.random() < 0.5:
            pos = int(rng.integers(0, 9))
            r = dict(id=self.next_id, pos=pos, token=int(rng.integers(0, VOCAB)),
                     blocks=self._blocks(-(-(pos + q) // bs)))
            self.next_id += 1
            at = int(rng.integers(0, len(keep) + 1))
            keep.insert(at, r)
        appends, rewrites = [], {}
        for i, r in enumerate(keep):
            if r in self.rows:  # carried: the host's bound of the position
                bound = r["pos"] + self.bound_slack.get(r["id"], 0)
                if self.rewrite and rng.random() < self.rewrite:
                    rewrites[i] = r["blocks"] = self._rewritten(r["blocks"], bound)
                    continue
                while len(r["blocks"]) * bs < bound + q:
                    b = self._blocks(1)[0]
                    r["blocks"].append(b)
                    appends.append((i, b))
        fresh = {i: (r["token"], r["pos"], list(r["blocks"])) for i, r in enumerate(keep)
                 if r not in self.rows}
        self.rows = keep
        return DecodeStep.build([r["id"] for r in keep], fresh, appends, rewrites)

    def _rewritten(self, blocks, bound):
        """A new list for a row whose position may reach ``bound``: as many blocks as that
        needs, up to two more, each old one kept, replaced by a fresh one, or all permuted."""
        rng, need = self.rng, -(-(bound + self.q) // self.bs)
        blocks = [b if rng.random() < 0.5 else self._blocks(1)[0] for b in blocks]
        if rng.random() < 0.3:
            blocks = [blocks[i] for i in rng.permutation(len(blocks))]
        size = need + int(rng.integers(0, 3))
        return (blocks + self._blocks(max(0, size - len(blocks))))[:size]

    def run(self, accepted, sampled):
        """The step ran: row i kept accepted[i] tokens, its next input is sampled[i]."""
        for r, a, s in zip(self.rows, accepted, sampled):
            r["pos"] += int(a)
            r["token"] = int(s)
            self.bound_slack[r["id"]] = (self.q - int(a)) if self.lag else 0

    def expected(self, padded_reqs, width):
        q, bs = self.q, self.bs
        ids = np.full(padded_reqs * q, PAD, np.int32)
        pos = np.zeros(padded_reqs * q, np.int32)
        slots = np.full(padded_reqs * q, -1, np.int64)
        seq = np.ones(padded_reqs, np.int32)
        table = np.zeros((padded_reqs, width), np.int32)
        for i, r in enumerate(self.rows):
            ids[i * q] = r["token"]
            seq[i] = r["pos"] + q
            table[i, :len(r["blocks"])] = r["blocks"]
            for t in range(q):
                p = r["pos"] + t
                pos[i * q + t] = p
                slots[i * q + t] = r["blocks"][p // bs] * bs + p % bs
        return dict(input_ids=ids, positions=pos, slot_mapping=slots, seq_lens=seq,
                    block_table=table,
                    query_start_loc=np.arange(0, (padded_reqs + 1) * q, q, dtype=np.int32),
                    counts=np.array([len(self.rows), len(self.rows) * q], np.int32))


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("kind", list(BACKENDS))
@pytest.mark.parametrize("q,seed,rewrite", [(2, 0, 0.0), (3, 1, 0.0), (5, 2, 0.0), (2, 3, 0.3),
                                            (3, 4, 0.3)])
def test_trace_with_accepted_counts_matches_truth(kind, q, seed, lag, rewrite):
    b = make(kind, q)
    truth = Truth(seed, q, b.buffers.block_size, lag, rewrite)
    prev_acc, buf, rewritten = None, b.buffers, 0
    for _ in range(14):
        step = truth.step(max_rows=11)
        rewritten += len(step.rewrite_rows)
        md = b.prepare(step)
        want = truth.expected(md.padded_size // q, buf.max_num_blocks_per_req)
        for f, v in want.items():
            assert getattr(md, f).cpu().numpy().tolist() == v.tolist(), f
        n = step.num_reqs
        # the step "ran": each row keeps 1..q tokens (all rejected and all accepted both
        # drawn), dummy rows report garbage that nothing may read
        acc = truth.rng.integers(1, q + 1, n).astype(np.int32)
        smp = truth.rng.integers(0, VOCAB, n).astype(np.int32)
        buf.accepted[:n] = torch.from_numpy(acc).to(DEVICE)
        buf.accepted[n:] = -7
        buf.sampled[:n] = torch.from_numpy(smp).to(DEVICE)
        truth.run(acc, smp)
        if lag == 0:
            b.observe_accepted(acc, 0)
        elif prev_acc is not None:
            b.observe_accepted(prev_acc, 1)
        prev_acc = acc
    assert rewritten >= 10 if rewrite else rewritten == 0, rewritten


def test_positions_cross_two_blocks_in_one_step():
    q, bs = 5, 2  # five token rows over three blocks of two
    for kind in BACKENDS:
        b = make(kind, q, block_size=bs)
        md = b.prepare(DecodeStep.build([7], {0: (11, 1, [4, 5, 6])}))
        assert md.slot_mapping.tolist()[:5] == [9, 10, 11, 12, 13]
        b.buffers.accepted[0] = 5
        b.buffers.sampled[0] = 42
        b.observe_accepted(np.array([5], np.int32), 0)  # positions 6..10: columns 3..5
        with pytest.raises(ValueError, match="append a block"):
            b.prepare(DecodeStep.build([7], appends=[(0, 8), (0, 9)]))
        md = b.prepare(DecodeStep.build([7], appends=[(0, 8), (0, 9), (0, 10)]))
        assert md.positions.tolist()[:5] == [6, 7, 8, 9, 10]
        assert md.slot_mapping.tolist()[:5] == [16, 17, 18, 19, 20]
        assert md.input_ids.tolist()[:5] == [42, PAD, PAD, PAD, PAD]
        assert md.seq_lens.tolist()[:1] == [11]


def test_host_bound_is_worst_case_until_counts_arrive():
    """Without counts the packer assumes every draft accepted; counts of the step before
    (steps_ago = 1) lower the bound, counts of the last step (0) make it exact."""
    q = 3
    b = make("device", q, block_size=4)
    b.prepare(DecodeStep.build([1], {0: (5, 0, [1])}))  # positions 0..2
    b.buffers.accepted[0] = 1
    # bound 3 -> rows at 3..5 need a second block, although the row is really at 1
    with pytest.raises(ValueError, match="append a block"):
        b.prepare(DecodeStep.build([1]))
    b.prepare(DecodeStep.build([1], appends=[(0, 2)]))  # really at 1 (accepted 1)
    assert b.buffers.positions.tolist()[:3] == [1, 2, 3]
    b.observe_accepted(np.array([1], np.int32), 1)  # the step before kept 1: bound 1 now
    b.buffers.accepted[0] = 2
    b.observe_accepted(np.array([2], np.int32), 0)  # and the last kept 2: exactly 3
    md = b.prepare(DecodeStep.build([1]))
    assert md.positions.tolist()[:3] == [3, 4, 5]
    with pytest.raises(ValueError, match=r"outside \[1, q = 3\]"):
        b.observe_accepted(np.array([4], np.int32), 0)
    with pytest.raises(ValueError, match="had 1 rows, got 2"):
        b.observe_accepted(np.array([1, 1], np.int32), 0)
    with pytest.raises(ValueError, match="steps_ago must be 0"):
        b.observe_accepted(np.array([1], np.int32), 2)


@pytest.mark.parametrize("kind", ["device", "host"])
def test_upload_bytes_do_not_grow_with_draft_tokens(kind):
    """The same steps (whole block rows given at arrival, so no appends) upload the same record
    for k = 0, 1, 2, 4 draft tokens: the record carries no per-token-row word."""
    sizes = {}
    for q in (1, 2, 3, 5):
        b = make(kind, q, block_size=16, width=8)
        rows = {i: (i + 1, 3 * i, [2 * i + 1, 2 * i + 2]) for i in range(7)}
        got = [b.last_upload_bytes if b.prepare(DecodeStep.build(list(range(7)), rows)) else 0]
        for s in range(4):
            ids = list(range(7)) if s % 2 == 0 else [6, 0, 1, 2, 3, 4, 5]
            if q > 1:
                b.observe_accepted(np.ones(7, np.int32), 0)
            b.prepare(DecodeStep.build(ids))
            got.append(b.last_upload_bytes)
        sizes[q] = got
    if kind == "device":
        assert sizes[1] == sizes[2] == sizes[3] == sizes[5]
    else:  # the host path's copies grow with the token rows: that is its cost, not zos's
        assert sizes[5][1] > sizes[1][1]
