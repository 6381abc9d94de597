"""The engine's scheduler alone (no device, no model), one rule at a time with exact values: the
certain-finish rule under overlap, tokens dropped after a preemption or an eos with a launch in
flight, blocks for the positions a launch may write (q, 2q with a launch in flight), the
preemption of the newest request, the DecodeStep of a launch, and the checks of a request."""
import pytest

from zos.serving.scheduler import Scheduler
from zos.serving.types import EngineConfig, Request

BS = 4


def scheduler(num_kv_blocks=64, eos=None, max_num_seqs=4):
    return Scheduler(EngineConfig(block_size=BS, num_kv_blocks=num_kv_blocks,
                                  max_num_seqs=max_num_seqs, max_model_len=64,
                                  eos_token_id=eos), vocab_size=100)


def started(s, *reqs):
    """Queue, admit and "prefill" ``reqs``: first token 50 + req_id each."""
    s.add(reqs)
    admitted = s.admit()
    assert admitted == list(reqs)
    for r in admitted:
        r.num_computed = len(r.prompt)
    s.start(admitted, [50 + r.req_id for r in admitted])


def test_overlap_certain_finish_and_launch_count():
    """max_new_tokens 4, overlapped: launch A, then B before A is read; reading A (B in flight)
    leaves 2 + 1 in sight, C goes out; reading B (C in flight) makes 3 + 1 = 4: the row leaves
    before a fourth launch, and C's token finishes it. Three launches, as synchronously."""
    s = scheduler()
    req = Request(7, [1, 2, 3], 4)
    started(s, req)
    step_a, rows_a = s.schedule_decode(1, in_flight=False)
    assert step_a.new_rows.tolist() == [0] and step_a.new_positions.tolist() == [3]
    step_b, rows_b = s.schedule_decode(1, in_flight=True)
    assert step_b.new_rows.tolist() == [] and not s.leaving
    s.accept(rows_a, [(11,)], more_in_flight=True)
    assert not s.leaving and req.num_computed == 4
    s.retire()
    _, rows_c = s.schedule_decode(1, in_flight=True)
    s.accept(rows_b, [(12,)], more_in_flight=True)
    assert s.leaving == {req} and req.finish_reason is None
    s.retire()
    assert s.rows == [None] and s.schedule_decode(1, in_flight=True) is None
    s.accept(rows_c, [(13,)], more_in_flight=False)
    assert req.output == [57, 11, 12, 13] and req.finish_reason == "length"
    assert req.num_launches == 3 and req.blocks == []
    assert s.allocator.num_free == 63


def test_overlap_one_token_left_is_launched_once():
    """max_new_tokens 2 (one from the prefill): its first launch is its last; the next launch,
    staged before that one is read, runs without it (vLLM's async scheduling: never schedule
    past max_tokens)."""
    s = scheduler()
    one, more = Request(0, [1], 2), Request(1, [2], 5)
    started(s, one, more)
    _, rows_a = s.schedule_decode(1, in_flight=False)
    assert s.leaving == {one}
    s.retire()
    _, rows_b = s.schedule_decode(1, in_flight=True)
    assert rows_a == [one, more] and rows_b == [more] and s.row_of == {more: 0}
    s.accept(rows_a, [(3,), (4,)], more_in_flight=True)
    assert one.output == [50, 3] and one.finish_reason == "length" and one.num_launches == 1


def test_a_row_that_gave_its_blocks_back_drops_tokens_in_flight():
    """A launch in flight when its request is preempted or finishes by eos: its tokens are
    dropped; the preempted request is queued at the front with its output kept."""
    s = scheduler(eos=9)
    a, b = Request(0, [1], 10), Request(1, [2], 10)
    started(s, a, b)
    _, rows1 = s.schedule_decode(1, in_flight=False)
    _, rows2 = s.schedule_decode(1, in_flight=True)
    s.preempt(b)
    s.accept(rows1, [(9,), (5,)], more_in_flight=True)  # a: eos; b: preempted
    assert a.output == [50, 9] and a.finish_reason == "eos"
    assert b.output == [51] and list(s.waiting) == [b] and b.num_computed == 0
    s.accept(rows2, [(6,), (7,)], more_in_flight=False)
    assert a.output == [50, 9] and b.output == [51]
    assert s.allocator.num_free == 63


def test_tokens_kept_stop_at_eos_or_length_in_the_middle():
    s = scheduler(eos=9)
    a, b, c = Request(0, [1], 3), Request(1, [2], 10), Request(2, [3], 10)
    started(s, a, b, c)
    _, rows = s.schedule_decode(4, in_flight=False)
    s.accept(rows, [[4, 5, 6], [7, 9, 8], [1, 2]], more_in_flight=False)
    assert [a.output, b.output, c.output] == [[50, 4, 5], [51, 7, 9], [52, 1, 2]]
    assert [a.finish_reason, b.finish_reason, c.finish_reason] == ["length", "eos", None]
    assert c.num_computed == 3


@pytest.mark.parametrize("q,in_flight,want", [(1, False, 2), (1, True, 2), (3, False, 2),
                                              (3, True, 3), (2, True, 2), (4, True, 3)])
def test_blocks_cover_what_the_launch_may_write(q, in_flight, want):
    """Prompt 3: a new row covers num_computed 3 + q positions, whole in the DecodeStep; after
    one token read (num_computed 4) the carried row covers 4 + q (+ q with a launch in
    flight): ceil((4 + q (+ q)) / 4) blocks, the new ones appended."""
    s = scheduler()
    req = Request(0, [1, 2, 3], 20)
    started(s, req)
    step, rows = s.schedule_decode(q, in_flight=False)
    first = -(-(3 + q) // BS)
    assert step.new_block_ids.tolist() == req.blocks and len(req.blocks) == first
    s.accept(rows, [[5]], more_in_flight=False)
    step, _ = s.schedule_decode(q, in_flight=in_flight)
    assert len(req.blocks) == want == -(-(4 + q * (2 if in_flight else 1)) // BS)
    assert step.append_rows.tolist() == [0] * (want - first)
    assert step.append_block_ids.tolist() == req.blocks[first:]


def test_no_free_block_preempts_the_newest_request():
    """3 usable blocks: a (admitted first) and b hold one each; both need a second: a takes
    the last one, b (the newest) is preempted and gives its block back, which nobody needs."""
    s = scheduler(num_kv_blocks=4)
    a, b = Request(0, [1, 2, 3], 10), Request(1, [4, 5, 6], 10)
    started(s, a, b)
    _, rows = s.schedule_decode(1, in_flight=False)
    s.accept(rows, [(7,), (8,)], more_in_flight=False)
    step, rows = s.schedule_decode(1, in_flight=False)
    assert rows == [a] and list(s.waiting) == [b] and s.num_preemptions == 1
    assert len(a.blocks) == 2 and step.append_rows.tolist() == [0]
    assert b.blocks == [] and s.allocator.num_free == 1


@pytest.mark.parametrize("req_id,exc,match", [
    ("a", TypeError, "req_id: expected an int"), (True, TypeError, "req_id: expected an int"),
    (2 ** 63, ValueError, "req_id does not fit int64"), (-2 ** 63 - 1, ValueError, "must be >=")])
def test_req_id_checked_when_queued(req_id, exc, match):
    s = scheduler()
    with pytest.raises(exc, match=match):
        s.add([Request(0, [1], 2), Request(req_id, [1], 2)])
    assert not s.waiting  # all or none
    s.add([Request(2 ** 63 - 1, [1], 2), Request(-2 ** 63, [1], 2)])
