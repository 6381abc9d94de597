"""The staging record: Python mirror, C++ header and packer output agree."""
import numpy as np
import pytest

from zos import _C, StepPacker, staging
from zos.step import DecodeStep


def test_constants_match_native():
    assert staging.HEADER_WORDS == _C.HEADER_WORDS == 8
    assert staging.RECORD_WORDS == _C.RECORD_WORDS == 5


def pack(packer, step, capacity=256):
    out = np.full(capacity, -7, np.int32)
    words = packer.pack(step.req_ids, step.new_rows, step.new_tokens, step.new_positions,
                        step.new_block_indptr, step.new_block_ids, step.append_rows,
                        step.append_block_ids, out)
    assert (out[words:] == -7).all()
    return staging.parse(out[:words]), out[:words]


def test_record_layout():
    p = StepPacker(max_num_reqs=8, uniform_decode_query_len=1, block_size=4, max_num_blocks_per_req=4, num_kv_blocks=64, vocab_size=100)
    view, rec = pack(p, DecodeStep.build([7, 8, 9], {0: (11, 3, [5]), 1: (12, 4, [6, 9]), 2: (13, 0, [2])}))
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


def test_carried_rows_cost_two_words():
    """Upload size is independent of context length for carried rows."""
    p = StepPacker(max_num_reqs=64, uniform_decode_query_len=1, block_size=16, max_num_blocks_per_req=2048, num_kv_blocks=10**6,
                   vocab_size=100)
    ids = list(range(64))
    pack(p, DecodeStep.build(ids, {i: (1, 30000, list(range(1 + 2000 * i, 1 + 2000 * i + 1876)))
                                   for i in ids}), capacity=10**6)
    _, rec = pack(p, DecodeStep.build(ids[::-1]), capacity=10**6)
    assert len(rec) == staging.HEADER_WORDS + 2 * 64


def test_packer_remap_agrees_with_compute_remap():
    """The packer's incremental index gives compute_remap's answer on every step."""
    from tracegen import TraceGen

    from zos import compute_remap

    gen = TraceGen(7, max_num_reqs=24, block_size=4, max_blocks=6, num_kv_blocks=400, vocab=100, big=True)
    gen.next_id = 2**62  # large ids, far from the row numbers
    p = StepPacker(max_num_reqs=24, uniform_decode_query_len=1, block_size=4, max_num_blocks_per_req=6, num_kv_blocks=400,
                   vocab_size=100)
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
    p = StepPacker(max_num_reqs=8, uniform_decode_query_len=1, block_size=4, max_num_blocks_per_req=4, num_kv_blocks=64, vocab_size=100)
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
    p = StepPacker(max_num_reqs=8, uniform_decode_query_len=1, block_size=4, max_num_blocks_per_req=4, num_kv_blocks=64, vocab_size=100)
    step = DecodeStep.build([1, 2], {0: (1, 0, [1]), 1: (1, 0, [2])})
    with pytest.raises(ValueError, match="the staging record needs 24 words, capacity is 23"):
        pack(p, step, capacity=23)
    view, _ = pack(p, step, capacity=24)  # nothing was committed by the failed call
    assert view.prev_reqs == 0 and view.row_src.tolist() == [-1, -1]
