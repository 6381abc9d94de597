"""The engine's step (scheduler, decode mode, the read-back's queue of launches in flight) against
a simulated device, without a model: the runner's decode and prefill are replaced by a device
that keeps every row's sequence itself (a new row from the DecodeStep, a carried row by its
request id, as zos's prep does) and emits the tokens of a fixed next-token rule, keeping a
seeded random 1..q of them per row with draft tokens. Fast, so it runs many configurations:
plain and speculative (k = 1, 3), synchronous and overlapped, eos, preemption with launches in
flight. Checked: outputs equal the rule's reference; every launch's blocks cover the positions
it writes; no row is launched once its finish by length is certain; accepted counts reach the
backend in launch order, one step late under overlap; no block leaks."""
import random

import pytest
import torch

from zos.serving.engine import Engine, EngineConfig, Request
from zos.serving.readback import SampledReadback
from zos.serving.runner import DecodeResult

from helpers import DEVICE, LLAMA_CFG

VOCAB, BS = LLAMA_CFG.vocab_size, 4


def next_token(seq):
    """The simulated model: the greedy next token of a sequence."""
    return (seq[-1] * 31 + len(seq) * 17 + seq[0] * 5) % VOCAB


def reference(req, eos):
    seq, out = list(req.prompt), []
    while len(out) < req.max_new_tokens:
        out.append(next_token(seq))
        seq.append(out[-1])
        if out[-1] == eos:
            break
    return out


class Device:
    """Stands in for ``runner.decode`` / ``runner.prefill`` and the backend's
    ``observe_accepted``; checks the engine at every launch."""

    def __init__(self, engine, seed):
        self.engine, self.rng = engine, random.Random(seed)
        self.q = engine.buffers.uniform_decode_query_len
        self.seqs = {}  # req_id -> the row's sequence on the device (prompt + tokens so far)
        self.tables = {}  # req_id -> the row's block-table row on the device
        self.launched = []  # accepted counts per launch, in launch order
        self.observed = []  # (counts, steps_ago) handed to the backend, in order
        engine.runner.decode, engine.runner.prefill = self.decode, self.prefill
        engine.backend = self

    def prefill(self, seqs):
        return [next_token(list(toks)) for toks, _ in seqs], 1.0, 8

    def decode(self, step):
        eng, q = self.engine, self.q
        by_id = {r.req_id: r for r in eng.rows}
        new = dict(zip(step.new_rows.tolist(), step.new_positions.tolist()))
        ptr, ids = step.new_block_indptr.tolist(), step.new_block_ids.tolist()
        tables = {rid: self.tables[rid] for i, rid in enumerate(step.req_ids.tolist())
                  if i not in new}  # carried rows (KeyError: a row the device never had)
        tables.update({step.req_ids[r].item(): ids[ptr[j]:ptr[j + 1]]
                       for j, r in enumerate(step.new_rows.tolist())})
        for r, b in zip(step.append_rows.tolist(), step.append_block_ids.tolist()):
            tables[step.req_ids[r].item()].append(b)
        self.tables = tables
        counts = []
        for i, rid in enumerate(step.req_ids.tolist()):
            req = by_id[rid]
            assert eng.rows[i] is req
            if i in new:  # a new row: the host's state is exact (nothing of it in flight)
                self.seqs[rid] = req.prompt + req.output
                assert new[i] == len(self.seqs[rid]) - 1 == req.num_computed
            seq = self.seqs[rid]
            assert self.tables[rid] == req.blocks, rid  # what the DecodeStep told the device
            # KV safety: blocks cover the q positions this launch writes
            assert len(req.blocks) * BS >= len(seq) - 1 + q, (rid, len(seq), req.blocks)
            # no launch once a finish by length is certain (one token per launch in flight)
            flying = sum(req in p.rows for p in eng.readback.pending)
            assert len(req.output) + flying < req.max_new_tokens, rid
            a = self.rng.randint(1, q)
            kept = []
            for _ in range(a):
                kept.append(next_token(seq))
                seq.append(kept[-1])
            counts.append(a)
            if q == 1:
                eng.buffers.sampled[i] = kept[0]
            else:
                eng.spec.output[i, :1 + a] = torch.tensor([a] + kept, dtype=torch.int32)
        blocks = [b for r in eng.rows for b in r.blocks]
        assert len(blocks) == len(set(blocks)) and 0 not in blocks
        self.launched.append(counts)
        return DecodeResult("eager", step.num_reqs, step.num_reqs * q, None, 1.0, 8, "test")

    def observe_accepted(self, accepted, steps_ago):
        # steps_ago: launches made after the one these counts belong to (the j-th read)
        assert steps_ago == len(self.launched) - 1 - len(self.observed)
        self.observed.append((accepted.tolist(), steps_ago))


def make_requests(seed, n):
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))],
                    rng.randint(1, 16)) for i in range(n)]


def run(llama, k, overlap, seed, *, num_kv_blocks, eos=None, n=12):
    cfg = EngineConfig(block_size=BS, num_kv_blocks=num_kv_blocks, max_num_seqs=5,
                       max_model_len=32, max_prefill_tokens=20, eos_token_id=eos,
                       bucket_policy=None, use_cuda_graph=False, num_draft_tokens=k)
    engine = Engine(llama, cfg, DEVICE, overlap=overlap)
    device = Device(engine, seed)
    blocks = engine.allocator.allocate(engine.allocator.num_free)
    random.Random(seed).shuffle(blocks)  # blocks handed out in no particular id order
    engine.allocator.free(blocks)
    reqs = make_requests(seed, n)
    engine.add_requests(reqs[:n // 2])
    while engine.has_unfinished() or engine.num_steps < 3:
        if engine.num_steps == 3:  # mid-run arrivals
            engine.add_requests(reqs[n // 2:])
        engine.step()
    assert engine.allocator.num_free == num_kv_blocks - 1, "blocks leaked"
    assert not engine.rows or all(r is None for r in engine.rows)
    return reqs, engine, device


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tokens_equal_the_reference_with_eos_and_preemption(llama, k, overlap, seed):
    reqs = make_requests(seed, 12)
    counts = {}
    for r in reqs:
        for t in reference(r, None)[:-1]:
            counts[t] = counts.get(t, 0) + 1
    eos = max(sorted(counts), key=counts.get)
    reqs, engine, device = run(llama, k, overlap, seed, num_kv_blocks=14, eos=eos)
    assert {r.req_id: r.output for r in reqs} == {r.req_id: reference(r, eos) for r in reqs}
    assert any(r.finish_reason == "eos" for r in reqs)
    assert engine.num_preemptions > 0, "the run must preempt (few blocks)"
    if k:  # every launch's counts, in launch order, one step late under overlap
        assert [c for c, _ in device.observed] == device.launched
        assert max(s for _, s in device.observed) == (1 if overlap else 0)
        assert engine.spec_rows == sum(map(len, device.launched))
        assert engine.spec_tokens == sum(map(sum, device.launched))
    else:
        assert device.observed == []


@pytest.mark.parametrize("overlap", [False, True])
def test_plain_decode_launches_each_row_once_per_token(llama, overlap):
    """Without eos or preemption a request of max_new_tokens n is decoded in exactly n - 1
    launches (its first token comes from the prefill), overlapped too: a row whose last
    token is in flight leaves instead of being launched again."""
    reqs, engine, _ = run(llama, 0, overlap, 5, num_kv_blocks=64)
    assert engine.num_preemptions == 0
    assert {r.req_id: r.num_launches for r in reqs} == {r.req_id: r.max_new_tokens - 1
                                                        for r in reqs}
    assert all(r.output == reference(r, None) for r in reqs)


def test_readback_is_one_fifo_queue_across_the_ring():
    """Copies come back oldest first with the rows pushed with them, through the ring's reuse
    of its buffers (width 3: a spec output row)."""
    rb = SampledReadback(4, torch.device(DEVICE), depth=2, width=3)
    src = torch.arange(12, dtype=torch.int32, device=DEVICE).view(4, 3)
    got, want = [], []
    for i in range(5):
        n = 1 + i % 4
        rb.push(src + 100 * i, list(range(n)))
        want.append((list(range(n)), (src[:n] + 100 * i).tolist()))
        if len(rb.pending) == 2:
            got.append(rb.pop())
    while rb.pending:
        got.append(rb.pop())
    assert [(rows, v.shape, v.tolist()) for rows, v in got] == [
        (rows, (len(rows), 3), v) for rows, v in want]
