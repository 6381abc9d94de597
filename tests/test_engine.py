"""The continuous-batching engine: zos and host backends agree token for token, both equal a
per-request full-recompute reference, dummy rows stay dummy, and the block allocator's rules."""
import random

import pytest

from zos.buffers import NULL_BLOCK, PAD_SLOT_ID
from zos.serving.engine import Engine, EngineConfig, Request
from zos.serving.kv_blocks import BlockAllocator
from zos.serving.row_layout import place_rows

from helpers import DEVICE, LLAMA_BLOCK_SIZE, LLAMA_CFG, greedy_reference

VOCAB, BS = LLAMA_CFG.vocab_size, LLAMA_BLOCK_SIZE


def make_requests(seed, n=14):
    rng = random.Random(seed)
    return [Request(i, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 11))],
                    rng.randint(1, 18)) for i in range(n)]


def truncate(tokens, eos):
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


class Watch:
    """Wraps the runner's decode: after every decode step checks the dummy rows [N, padded) of
    the device buffers, and records the row layout of each step."""

    def __init__(self, engine):
        self.engine, self.layouts, self.paths, self.padded = engine, [], set(), set()
        self._decode = engine.runner.decode
        engine.runner.decode = self

    def __call__(self, step):
        res = self._decode(step)
        b, n, p = self.engine.buffers, res.num_reqs, res.padded_size
        assert b.slot_mapping[n:p].tolist() == [PAD_SLOT_ID] * (p - n)
        assert b.seq_lens[n:p].tolist() == [1] * (p - n)
        assert b.input_ids[n:p].tolist() == [0] * (p - n)
        assert (b.block_table[n:p] == NULL_BLOCK).all()
        assert (b.slot_mapping[:n] >= 0).all() and (b.block_table[:n, 0] > 0).all()
        self.layouts.append(step.req_ids.tolist())
        self.paths.add(res.path)
        self.padded.add((n, p, res.bucket))
        return res


def drive(model, backend, requests, eos, arrive_at=6):
    """Run ``requests``: the first half queued up front, the rest arriving after step
    ``arrive_at`` (mid-run). Returns (outputs, step records, watch, engine)."""
    cfg = EngineConfig(block_size=BS, num_kv_blocks=16, max_num_seqs=6, max_model_len=32,
                       max_prefill_tokens=24, eos_token_id=eos, backend=backend,
                       use_cuda_graph=True, buckets=[1, 2, 4])
    engine = Engine(model, cfg, DEVICE)
    watch = Watch(engine)
    half = len(requests) // 2
    for r in requests[:half]:
        engine.add_request(r)
    while engine.has_unfinished() or engine.num_steps < arrive_at:
        if engine.num_steps == arrive_at:
            for r in requests[half:]:
                engine.add_request(r)
        engine.step()
    return {r.req_id: r.output for r in requests}, engine.records, watch, engine


def check_layouts(layouts):
    """Rows are stable: a request present in two consecutive steps keeps its row unless it was
    moved from the tail into a hole (condense). Returns how many rows moved."""
    moved = 0
    for prev, cur in zip(layouts, layouts[1:]):
        where = {rid: i for i, rid in enumerate(prev)}
        for i, rid in enumerate(cur):
            if rid in where and where[rid] != i:
                assert where[rid] >= len(cur) and i < where[rid], (prev, cur)
                moved += 1
    return moved


@pytest.mark.parametrize("seed", [0, 1])
def test_backends_match_each_other_and_reference(llama, seed):
    reqs = make_requests(seed)
    full = {r.req_id: greedy_reference(llama, r.prompt, r.max_new_tokens) for r in reqs}
    counts = {}
    for toks in full.values():  # eos: the token most requests generate (not as the last token)
        for t in set(toks[:-1]):
            counts[t] = counts.get(t, 0) + 1
    eos = max(sorted(counts), key=counts.get)
    want = {rid: truncate(toks, eos) for rid, toks in full.items()}
    assert sum(len(want[r]) < len(full[r]) for r in want) >= 2, "eos must stop some requests"
    got = {}
    for backend in ("zos", "host"):
        out, records, watch, engine = drive(llama, backend, make_requests(seed), eos)
        got[backend] = (out, [(s.kind, s.path, s.num_reqs, s.padded_size) for s in records])
        assert out == want, backend
        assert engine.num_preemptions > 0, "the run must preempt (few blocks)"
        assert check_layouts(watch.layouts) > 0, "the run must condense"
        assert any(n > 4 and b is None for n, _, b in watch.padded), "N above the largest bucket"
        assert any(p > n for n, p, _ in watch.padded), "padded steps with dummy rows"
        assert any(s.kind == "prefill" and s.step > 7 for s in records), "mid-run admissions"
        assert watch.paths == ({"eager"} if DEVICE == "cpu" else {"graph", "eager"})
        assert engine.allocator.num_free == engine.config.num_kv_blocks - 1, "blocks leaked"
        assert not engine.has_unfinished()
    assert got["zos"] == got["host"]


def test_run_totals_and_progress(llama):
    seen = []
    cfg = EngineConfig(block_size=BS, num_kv_blocks=40, max_num_seqs=4, max_model_len=32,
                       max_prefill_tokens=64, backend="zos", buckets=[1, 2, 4])
    reqs = make_requests(3, n=5)
    res = Engine(llama, cfg, DEVICE).run(reqs, progress=seen.append)
    assert res.outputs == {r.req_id: greedy_reference(llama, r.prompt, r.max_new_tokens)
                           for r in reqs}
    t = res.totals
    assert seen == res.steps and t["steps"] == len(res.steps)
    assert t["tokens"] == sum(r.max_new_tokens for r in reqs) and t["requests"] == 5
    assert t["prefill_steps"] + t["decode_steps"] == t["steps"] and t["preemptions"] == 0
    assert all(s.upload_bytes > 0 and s.metadata_us > 0 for s in res.steps)


def test_request_validation(llama):
    engine = Engine(llama, EngineConfig(block_size=BS, num_kv_blocks=10, max_num_seqs=2,
                                        max_model_len=16, bucket_policy=None), DEVICE)
    for bad in (Request(0, [], 3), Request(1, [VOCAB], 3), Request(2, [1] * 10, 7),
                Request(3, [1], 0)):
        with pytest.raises(ValueError):
            engine.add_request(bad)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        Engine(llama, EngineConfig(block_size=BS, num_kv_blocks=4, max_model_len=16), DEVICE)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(llama, EngineConfig(block_size=BS, num_kv_blocks=10**4,
                                   max_model_len=llama.config.max_position_embeddings + 1), DEVICE)


@pytest.mark.parametrize("bad,exc,match", [
    (Request(1, (3, 4), 2), TypeError, "request 1: prompt must be a list of int token ids, got "
                                       "tuple"),
    (Request(1, [3, 4.0], 2), TypeError, r"request 1: prompt\[1\]: expected an int"),
    (Request(1, [True], 2), TypeError, r"request 1: prompt\[0\]: expected an int"),
    (Request(1, [3], 2.5), TypeError, "request 1: max_new_tokens: expected an int"),
    (Request(1, [3], True), TypeError, "request 1: max_new_tokens: expected an int"),
    (Request("1", [3], 2), TypeError, "req_id: expected an int"),
], ids=["tuple prompt", "float token", "bool token", "float max_new_tokens",
        "bool max_new_tokens", "str req_id"])
def test_request_types_refused_before_anything_changes(llama, bad, exc, match):
    """A request whose fields are not ints (or whose prompt is not a list) is refused by
    add_request and admit_prefilled before it is queued or takes a block; the engine then
    runs other requests, and the same id later, to the reference."""
    cfg = EngineConfig(block_size=BS, num_kv_blocks=20, max_num_seqs=2, max_model_len=16,
                       bucket_policy=None)
    engine = Engine(llama, cfg, DEVICE)
    free = engine.allocator.num_free
    with pytest.raises(exc, match=match):
        engine.add_request(bad)
    with pytest.raises(exc, match=match):
        engine.admit_prefilled(bad, 5)
    assert not engine.has_unfinished() and engine.allocator.num_free == free
    res = engine.run([Request(1, [3, 4], 3)])
    assert res.outputs[1] == greedy_reference(llama, [3, 4], 3)


@pytest.mark.parametrize("first", [5.0, True, "5"])
def test_admit_prefilled_refuses_a_first_token_not_an_int(llama, first):
    cfg = EngineConfig(block_size=BS, num_kv_blocks=20, max_num_seqs=2, max_model_len=16,
                       bucket_policy=None)
    engine = Engine(llama, cfg, DEVICE)
    free = engine.allocator.num_free
    with pytest.raises(TypeError, match="request 1: first_token: expected an int"):
        engine.admit_prefilled(Request(1, [3, 4], 3), first)
    assert not engine.has_unfinished() and engine.allocator.num_free == free
    engine.admit_prefilled(Request(1, [3, 4], 3), 5)  # the same id, now valid
    while engine.has_unfinished():
        engine.step()


def test_request_ids_unique_and_queueing_all_or_none(llama):
    """A req_id waiting or running is refused before anything is queued or placed (the packer
    keys rows by request id); a batch with one bad request queues none of them; an id can be
    reused once its request finished."""
    cfg = EngineConfig(block_size=BS, num_kv_blocks=20, max_num_seqs=2, max_model_len=16,
                       bucket_policy=None)
    engine = Engine(llama, cfg, DEVICE)
    engine.add_request(Request(1, [3, 4], 5))
    with pytest.raises(ValueError, match="request 1: req_id is already waiting or running"):
        engine.add_request(Request(1, [5], 2))
    with pytest.raises(ValueError, match="request 2: prompt"):
        engine.run([Request(3, [1], 2), Request(2, [], 2)])
    with pytest.raises(ValueError, match="request 4: req_id given twice"):
        engine.add_requests([Request(4, [1], 2), Request(4, [2], 2)])
    assert [r.req_id for r in engine.waiting] == [1]
    engine.step()  # request 1 is running now
    with pytest.raises(ValueError, match="request 1: req_id is already"):
        engine.run([Request(1, [5], 2)])
    assert [r.req_id for r in engine.waiting] == [] and engine.rows[0].req_id == 1
    while engine.has_unfinished():
        engine.step()
    res = engine.run([Request(1, [3, 4], 2)])  # finished: its id may be used again
    assert res.outputs[1] == greedy_reference(llama, [3, 4], 2)


def test_place_fills_holes_then_condenses():
    a, b, c, x, y = "abcxy"
    rows = [a, None, b, None, c]
    place_rows(rows, [x])
    assert rows == [a, x, b, c]
    rows = [a, None, b, None, c]
    place_rows(rows, [])
    assert rows == [a, c, b]
    rows = [None, a, None]
    place_rows(rows, [x, y, c])
    assert rows == [x, a, y, c]


def test_block_allocator():
    alloc = BlockAllocator(5)
    assert alloc.num_free == 4
    got = alloc.allocate(3)
    assert sorted(got) == [1, 2, 3] and alloc.num_free == 1
    assert alloc.allocate(2) is None and alloc.num_free == 1  # nothing taken
    last = alloc.allocate(1)
    assert last == [4] and alloc.allocate(1) is None
    alloc.free(got)
    with pytest.raises(ValueError, match="double free"):
        alloc.free([got[0]])
    with pytest.raises(ValueError, match="null block"):
        alloc.free([0])
    with pytest.raises(ValueError, match="outside"):
        alloc.free([5])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(last + last)
    assert alloc.num_free == 3  # the failed frees changed nothing
    alloc.free(last)
    handed = []
    for _ in range(5):  # cycle every block through the allocator
        blocks = alloc.allocate(alloc.num_free)
        handed += blocks
        alloc.free(blocks)
    assert set(handed) == {1, 2, 3, 4} and NULL_BLOCK not in handed
    with pytest.raises(ValueError):
        BlockAllocator(1)
    with pytest.raises(ValueError):
        alloc.allocate(-1)


def test_preempts_most_recently_admitted(llama):
    """Two requests outgrow 4 usable blocks: the later one gives its blocks back, is resumed by
    recomputing prompt + output, and both still equal the reference."""
    cfg = EngineConfig(block_size=BS, num_kv_blocks=5, max_num_seqs=2, max_model_len=16,
                       backend="zos", buckets=[1, 2])
    reqs = [Request(0, [5, 6, 7], 12), Request(1, [8, 9, 10], 12)]
    res = Engine(llama, cfg, DEVICE).run(reqs)
    assert [r.num_preemptions for r in reqs][0] == 0 and reqs[1].num_preemptions >= 1
    assert res.outputs == {r.req_id: greedy_reference(llama, r.prompt, 12) for r in reqs}
    assert res.totals["preemptions"] == reqs[1].num_preemptions
