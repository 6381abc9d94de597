"""Speculative decoding end to end on the small random Llama (fp32): greedy spec decoding with
the n-gram drafter gives exactly the tokens of plain greedy decoding for every request, k = 1, 2,
4, both backends, synchronous and overlapped engines, with preemption, mid-run arrivals,
condensed rows, eos and length stops in the middle of a row's drafts; dummy rows stay dummy
after every step."""
import random

import pytest

from zos import DecodeBuffers, DeviceMetadataBackend
from zos.buffers import NULL_BLOCK, PAD_SLOT_ID
from zos.serving.engine import Engine, EngineConfig, Request
from zos.serving.runner import GraphRunner
from zos.spec import SpecDecoder

from helpers import DEVICE, LLAMA_BLOCK_SIZE, LLAMA_CFG, greedy_reference

VOCAB, BS = LLAMA_CFG.vocab_size, LLAMA_BLOCK_SIZE


def make_requests(seed, n=10):
    """Prompts that repeat a short pattern (so the drafter finds matches) or are random."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        if i % 2:
            pat = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 4))]
            prompt = (pat * 4)[:rng.randint(3, 11)]
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        reqs.append(Request(i, prompt, rng.randint(1, 17)))
    return reqs


def watch_dummy_rows(engine):
    """After every decode step: token rows [N*q, padded) and request rows [N, padded/q) hold the
    padding ledger's values, real rows the engine's blocks in order; returns the (num_reqs,
    padded_size, path) seen."""
    seen, decode, q = [], engine.runner.decode, engine.buffers.uniform_decode_query_len

    def wrapped(step):
        res = decode(step)
        b, n, p = engine.buffers, res.num_reqs, res.padded_size
        assert b.slot_mapping[n * q:p].tolist() == [PAD_SLOT_ID] * (p - n * q)
        assert b.input_ids[n * q:p].tolist() == [0] * (p - n * q)
        assert b.seq_lens[n:p // q].tolist() == [1] * (p // q - n)
        assert (b.block_table[n:p // q] == NULL_BLOCK).all()
        assert (b.slot_mapping[:n * q] >= 0).all()
        for i, req in enumerate(engine.rows):  # the device's block table is the engine's
            assert b.block_table[i, :len(req.blocks)].tolist() == req.blocks, i
        seen.append((n, p, res.path))
        return res

    engine.runner.decode = wrapped
    return seen


def drive(model, backend, k, requests, eos, *, num_kv_blocks=12, arrive_at=4, overlap=False):
    q = 1 + k
    cfg = EngineConfig(block_size=BS, num_kv_blocks=num_kv_blocks, max_num_seqs=5,
                       max_model_len=28, max_prefill_tokens=24, eos_token_id=eos,
                       backend=backend, buckets=[2 * q], num_draft_tokens=k)
    engine = Engine(model, cfg, DEVICE, overlap=overlap)
    seen = watch_dummy_rows(engine)
    half = len(requests) // 2
    engine.add_requests(requests[:half])
    while engine.has_unfinished() or engine.num_steps < arrive_at:
        if engine.num_steps == arrive_at:
            engine.add_requests(requests[half:])
        engine.step()
    return {r.req_id: r.output for r in requests}, engine, seen


@pytest.fixture(scope="module")
def reference(llama):
    """Plain greedy outputs (full recompute per token), and an eos that stops some of them."""
    out = {}
    for seed in (0, 1):
        full = {r.req_id: greedy_reference(llama, r.prompt, r.max_new_tokens)
                for r in make_requests(seed)}
        counts = {}
        for toks in full.values():
            for t in set(toks[1:-1]):
                counts[t] = counts.get(t, 0) + 1
        eos = max(sorted(counts), key=counts.get)
        want = {rid: t[:t.index(eos) + 1] if eos in t else t for rid, t in full.items()}
        out[seed] = (want, eos)
    return out


@pytest.mark.parametrize("k,seed,overlap", [(1, 0, False), (2, 1, False), (4, 0, False),
                                            (2, 0, True), (4, 1, True)])
def test_spec_equals_plain_greedy(llama, reference, k, seed, overlap):
    """Overlapped: step t + 1 is staged before step t's accepted counts are known (zos reads
    them on the device; the host-built baseline waits for them in its stage)."""
    want, eos = reference[seed]
    got = {}
    for backend in ("zos", "host"):
        out, engine, seen = drive(llama, backend, k, make_requests(seed), eos, overlap=overlap)
        assert out == want, backend
        assert {p for _, _, p in seen} == ({"eager"} if DEVICE == "cpu" else {"graph", "eager"})
        assert engine.num_preemptions > 0, "the run must preempt (few blocks)"
        assert any(p > n * (1 + k) for n, p, _ in seen), "padded steps with dummy rows"
        assert any(n > 2 and p == n * (1 + k) for n, p, _ in seen), "N above the largest bucket"
        assert engine.allocator.num_free == engine.config.num_kv_blocks - 1, "blocks leaked"
        # some rows kept drafts, some kept none: both paths of the verifier ran
        assert engine.spec_tokens > engine.spec_rows, "no draft was ever accepted"
        assert engine.spec_tokens < engine.spec_rows * (1 + k), "every draft was accepted"
        got[backend] = [(n, p) for n, p, _ in seen]
    assert got["zos"] == got["host"]


def test_length_stop_in_the_middle_of_drafts(llama):
    """Rows stop at max_new_tokens exactly, even when the step kept more tokens; the last request
    reaches max_model_len (prompt 9 + 15 = 24) with drafts past it; the run's totals report the
    acceptance."""
    k = 4
    reqs = [Request(i, [7, 8, 9] * 3, n) for i, n in enumerate((2, 3, 6, 15))]
    want = {r.req_id: greedy_reference(llama, r.prompt, r.max_new_tokens) for r in reqs}
    cfg = EngineConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=4, max_model_len=24,
                       buckets=[5, 10, 20], num_draft_tokens=k)
    res = Engine(llama, cfg, DEVICE).run(reqs)
    assert res.outputs == want
    assert all(len(res.outputs[r.req_id]) == r.max_new_tokens for r in reqs)
    tot = res.totals
    assert tot["num_draft_tokens"] == k and 1 <= tot["mean_tokens_per_row"] <= 1 + k
    rows, kept = tot["spec_rows"], tot["spec_tokens"]
    # the device kept more tokens than the requests took (one each came from the prefill): a
    # row stopped in the middle of its accepted drafts and the rest were dropped
    assert kept > sum(len(o) for o in res.outputs.values()) - len(reqs)
    assert tot["acceptance_rate"] == (kept - rows) / (k * rows)


def test_spec_config_errors(llama):
    bufs = [DecodeBuffers(4, 8, BS, uniform_decode_query_len=3, device=DEVICE) for _ in range(2)]
    backend = DeviceMetadataBackend(bufs[0], num_kv_blocks=40, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="over the backend's buffers"):
        GraphRunner(llama, [], backend, use_cuda_graph=False,
                    spec=SpecDecoder(bufs[1], num_kv_blocks=40, num_draft_tokens=2))
    with pytest.raises(ValueError, match=r"\+ 4 draft positions"):  # 2K under overlap
        Engine(llama, EngineConfig(block_size=BS, num_kv_blocks=200,
                                   max_model_len=LLAMA_CFG.max_position_embeddings - 3,
                                   num_draft_tokens=2), DEVICE, overlap=True)
    with pytest.raises(ValueError, match="num_draft_tokens: must be >= 0, got -1"):
        Engine(llama, EngineConfig(block_size=BS, num_kv_blocks=64, max_model_len=24,
                                   num_draft_tokens=-1), DEVICE)
    for bad in (2.0, True):
        with pytest.raises(TypeError, match="num_draft_tokens: expected an int"):
            Engine(llama, EngineConfig(block_size=BS, num_kv_blocks=64, max_model_len=24,
                                       num_draft_tokens=bad), DEVICE)
    with pytest.raises(ValueError, match="draft positions"):
        Engine(llama, EngineConfig(block_size=BS, num_kv_blocks=200,
                                   max_model_len=LLAMA_CFG.max_position_embeddings,
                                   num_draft_tokens=2), DEVICE)


def test_admit_prefilled_writes_the_drafter_history(llama):
    """A request admitted as prefilled (its KV taken as in the cache) has its prompt in the token
    history at its slots, so the drafter can match it."""
    cfg = EngineConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=2, max_model_len=40,
                       buckets=[3, 6], num_draft_tokens=2)
    engine = Engine(llama, cfg, DEVICE)
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    req = Request(5, prompt, 4)
    engine.admit_prefilled(req, first_token=30)
    cache = engine.spec.token_cache.cpu().tolist()
    got = [cache[req.blocks[p // BS] * BS + p % BS] for p in range(len(prompt))]
    assert got == prompt


def test_blocks_appended_in_order_when_a_step_crosses_two(llama):
    """Block size 1 and k = 4: a row that keeps a > 1 tokens gets a blocks in one step.
    The allocator hands out ids in descending order, so the blocks a row gets in one step must
    reach the device in the order the engine holds them (not sorted by id)."""
    reqs = [Request(i, [7, 8, 9] * 3, n) for i, n in enumerate((6, 26))]  # output repeats
    want = {r.req_id: greedy_reference(llama, r.prompt, r.max_new_tokens) for r in reqs}
    cfg = EngineConfig(block_size=1, num_kv_blocks=96, max_num_seqs=2, max_model_len=40,
                       buckets=[5, 10], num_draft_tokens=4)
    engine = Engine(llama, cfg, DEVICE)
    engine.allocator._free = type(engine.allocator._free)(sorted(engine.allocator._free,
                                                                 reverse=True))
    seen = watch_dummy_rows(engine)
    appends, inner = [], engine.runner.decode

    def decode(step):
        appends.append(step.append_rows.tolist())
        return inner(step)

    engine.runner.decode = decode
    res = engine.run(reqs)
    assert res.outputs == want and seen
    assert any(len(a) > len(set(a)) for a in appends), "no row got two blocks in one step"


def _run_counting(model, reqs, k, overlap, num_kv_blocks=96):
    """Runs ``reqs`` (copies) with k drafts; returns (outputs, {req_id: decode launches},
    {req_id: accepted count of each launch, in order}, preemptions)."""
    cfg = EngineConfig(block_size=BS, num_kv_blocks=num_kv_blocks, max_num_seqs=6,
                       max_model_len=28, max_prefill_tokens=64, buckets=[6 * (1 + k)],
                       num_draft_tokens=k)
    engine = Engine(model, cfg, DEVICE, overlap=overlap)
    accepted, pop = {}, engine.readback.pop

    def recording():
        rows, outs = pop()
        for req, out in zip(rows, outs):
            accepted.setdefault(req.req_id, []).append(out[0])
        return rows, outs

    engine.readback.pop = recording
    reqs = [Request(r.req_id, list(r.prompt), r.max_new_tokens) for r in reqs]
    res = engine.run(reqs)
    return (res.outputs, {r.req_id: r.num_launches for r in reqs}, accepted,
            engine.num_preemptions)


def _overlap_launches(budget, accepted):
    """The launches the overlapped engine makes for a request of ``budget`` tokens (one from its
    prefill) whose launches accept ``accepted`` tokens each: launch j (1-based) goes out while
    the tokens known (the prefill's and those of launches 1 .. j-2, read back) plus one per
    launch in flight (launch j-1, for j >= 2) stay below the budget."""
    j = 0
    while 1 + sum(accepted[:max(j - 1, 0)]) + (1 if j >= 1 else 0) < budget:
        j += 1
    return j


@pytest.mark.parametrize("k", [1, 2, 4])
def test_overlap_never_launches_a_certain_finish(llama, k):
    """Issue 15, kind 3: under overlap with drafts a row is not launched once its finish by
    length is certain (tokens known + 1 per launch in flight >= max_new_tokens). Launch counts
    per request equal the rule's count from the accepted counts of each launch (the same in
    both engines), which is the synchronous engine's count whenever no launch of the request
    kept a draft (a kept draft is learnt one launch late); max_new_tokens 2 is launched once,
    as in the synchronous engine (twice before the fix); tokens are unchanged."""
    rng = random.Random(k)
    reqs = []
    for i, budget in enumerate((2, 9, 3, 14, 1, 6, 2, 11)):
        pat = [rng.randrange(VOCAB) for _ in range(3)]
        prompt = (pat * 3)[:rng.randint(3, 9)] if i % 2 else [rng.randrange(VOCAB)
                                                               for _ in range(rng.randint(1, 8))]
        reqs.append(Request(i, prompt, budget))
    out_sync, n_sync, acc_sync, _ = _run_counting(llama, reqs, k, overlap=False)
    out_over, n_over, acc_over, _ = _run_counting(llama, reqs, k, overlap=True)
    assert out_over == out_sync
    kept_draft = 0
    for r in reqs:
        a = acc_sync.get(r.req_id, [])
        assert acc_over.get(r.req_id, [])[:len(a)] == a  # the same accepted counts per launch
        assert n_sync[r.req_id] == len(a)
        assert n_over[r.req_id] == _overlap_launches(r.max_new_tokens, a), r
        if all(x == 1 for x in a):  # every launch gave one token: the synchronous count
            assert n_over[r.req_id] == n_sync[r.req_id], r
        kept_draft += any(x > 1 for x in a)
    assert n_over[0] == n_sync[0] == 1 and n_over[4] == n_sync[4] == 0
    assert kept_draft > 0, "no launch kept a draft: the rule's other branch is untested"


def test_overlap_certain_finish_takes_no_block(llama):
    """The issue's preemption case: 13 KV blocks, 6 requests of 2-4 tokens, k = 2. Before the fix
    the overlapped engine launched rows already certain to finish, and those launches took the
    last free blocks: two requests were preempted; now none is, as in the synchronous engine,
    with the same tokens."""
    rng = random.Random(104)
    reqs = [Request(i, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))],
                    rng.choice([2, 2, 2, 3, 3, 4])) for i in range(6)]
    out_sync, _, _, pre_sync = _run_counting(llama, reqs, 2, overlap=False, num_kv_blocks=13)
    out_over, _, _, pre_over = _run_counting(llama, reqs, 2, overlap=True, num_kv_blocks=13)
    assert out_over == out_sync
    assert pre_sync == 0 and pre_over == 0
