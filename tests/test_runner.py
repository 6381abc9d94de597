"""GraphRunner's eager path: samples only rows < N (dummy rows keep their sampled values),
matches a full-recompute reference, and reports path, bucket and upload size."""
import pytest
import torch

from zos import BucketTable, DecodeBuffers, DecodeStep, DeviceMetadataBackend, HostMetadataBackend
from zos.serving.models import allocate_kv_cache
from zos.serving.runner import GraphRunner

from helpers import DEVICE, LLAMA_BLOCK_SIZE, LLAMA_CFG, greedy_reference

CFG = LLAMA_CFG
BS, W, NUM_BLOCKS, SENTINEL = LLAMA_BLOCK_SIZE, 4, 32, 55


def make_runner(model, kind, max_num_reqs=8, q=1):
    bufs = DecodeBuffers(max_num_reqs, W, BS, uniform_decode_query_len=q, device=DEVICE)
    kw = dict(num_kv_blocks=NUM_BLOCKS, vocab_size=CFG.vocab_size,
              buckets=BucketTable([2, 4], uniform_decode_query_len=q))
    backend = (DeviceMetadataBackend(bufs, **kw) if kind == "zos"
               else HostMetadataBackend(bufs, **kw))
    caches = allocate_kv_cache(CFG.num_hidden_layers, NUM_BLOCKS, BS, CFG.num_key_value_heads,
                               CFG.head_dim, torch.float32, DEVICE)
    return GraphRunner(model, caches, backend, use_cuda_graph=False)


@pytest.mark.parametrize("kind", ["zos", "host"])
def test_eager_decode_samples_real_rows_only(llama, kind):
    runner = make_runner(llama, kind)
    sampled = runner.buffers.sampled
    sampled.fill_(SENTINEL)
    assert runner.capture() == 0  # graphs off (and no CUDA here)
    seqs = {10: [7], 11: [3], 12: [90]}  # request id -> tokens so far

    def check(res, n, padded, bucket, rids):
        assert (res.path, res.num_reqs, res.padded_size, res.bucket) == ("eager", n, padded,
                                                                           bucket)
        assert res.upload_bytes > 0 and res.prep_us > 0
        got = sampled.tolist()
        for row, rid in enumerate(rids):
            assert got[row] == greedy_reference(llama, seqs[rid], 1)[0], (row, rid)
            seqs[rid].append(got[row])
        return got

    # Step 1: three new rows (token at position 0, one block each), bucket 4: row 3 is dummy.
    res = runner.decode(DecodeStep.build([10, 11, 12], {i: (seqs[10 + i][0], 0, [1 + i])
                                                        for i in range(3)}))
    got = check(res, 3, 4, 4, [10, 11, 12])
    assert got[3:] == [SENTINEL] * 5
    # Step 2: request 12 left; two carried rows in bucket 2: row 2 keeps its old token.
    res = runner.decode(DecodeStep.build([10, 11]))
    after = check(res, 2, 2, 2, [10, 11])
    assert after[2:] == got[2:]
    # Step 3: five rows, above the largest bucket: unpadded, no bucket.
    seqs.update({13: [5], 14: [6], 15: [8]})
    res = runner.decode(DecodeStep.build([10, 11, 13, 14, 15],
                                         {2: (5, 0, [4]), 3: (6, 0, [5]), 4: (8, 0, [6])}))
    final = check(res, 5, 5, None, [10, 11, 13, 14, 15])
    assert final[5:] == [SENTINEL] * 3
    assert runner.buffers.accepted.tolist() == [1] * 8


def test_prefill_and_errors(llama):
    runner = make_runner(llama, "zos")
    prompts = [[1, 2, 3, 4, 5], [9], [4, 4, 4, 4, 4, 4, 4, 4, 4]]
    tokens, us, nbytes = runner.prefill([(p, [1 + 3 * i, 2 + 3 * i, 3 + 3 * i])
                                         for i, p in enumerate(prompts)])
    assert tokens == [greedy_reference(llama, p, 1)[0] for p in prompts] and us > 0 and nbytes > 0
    with pytest.raises(ValueError, match="blocks"):
        runner.prefill([([1] * 5, [1])])
    kv = [c.clone() for c in runner.kv_caches]
    for seq, exc, match in [
            (([1, 2], [0]), ValueError, r"sequence 1: block id 0 is outside \[1, 32\)"),
            (([1, 2], [NUM_BLOCKS]), ValueError, r"block id 32 is outside \[1, 32\)"),
            (([1, 2], [-1]), ValueError, r"block id -1 is outside"),
            (([1, CFG.vocab_size], [2]), ValueError, f"token {CFG.vocab_size} is outside"),
            (([-1, 2], [2]), ValueError, r"sequence 1: token -1 is outside"),
            (([1.0, 2], [2]), TypeError, "sequence 1: tokens must be a 1-D sequence of ints"),
            (([1, 2], [2.0]), TypeError, "block_ids must be a 1-D sequence of ints"),
            (([[1, 2]], [2]), TypeError, "tokens must be a 1-D")]:
        with pytest.raises(exc, match=match):  # the first sequence is valid: nothing runs
            runner.prefill([([1, 2], [3]), seq])
    assert all(torch.equal(a, b) for a, b in zip(kv, runner.kv_caches))  # no KV written
    with pytest.raises(ValueError, match="empty"):
        runner.decode(DecodeStep.build([]))
    with pytest.raises(ValueError, match="needs a SpecDecoder"):
        make_runner(llama, "zos", q=2)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", ["zos", "host"])
def test_graph_replay_matches_eager(llama, kind):
    """Same steps through captured graphs and eagerly: same sampled tokens, same dummy rows."""
    graph, eager = make_runner(llama, kind), make_runner(llama, kind)
    graph.use_cuda_graph = True
    assert graph.capture() == 2 and graph.capture_seconds > 0
    steps = [DecodeStep.build([10, 11, 12], {i: (7 + i, 0, [1 + i]) for i in range(3)}),
             DecodeStep.build([10, 11]), DecodeStep.build([11, 10], appends=[]),
             DecodeStep.build([10, 11, 13, 14, 15], {2: (5, 0, [4]), 3: (6, 0, [5]),
                                                     4: (8, 0, [6])})]
    for r in (graph, eager):
        r.buffers.sampled.fill_(SENTINEL)
    for step in steps:
        rg, re_ = graph.decode(step), eager.decode(step)
        assert rg.path == ("graph" if rg.bucket is not None else "eager") and re_.path == "eager"
        assert graph.buffers.sampled.tolist() == eager.buffers.sampled.tolist()
        for f in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_table"):
            assert torch.equal(getattr(graph.buffers, f), getattr(eager.buffers, f)), f
