"""The native halves of zos inside vLLM (csrc/vllm_mirror.cpp), without vLLM: the host arrays of
runner v2's InputBatch (``zos._C.vllm_batch_arrays``) against a numpy reference written from
runner v2's ``prepare_inputs`` (vllm/v1/worker/gpu/model_runner.py, 0.26.0), and the mirror's
errors on scheduler outputs it cannot read. Its steps against vLLM's own objects:
tests/test_vllm_steps.py."""
from types import SimpleNamespace

import numpy as np
import pytest

from zos._C import VllmMirror, vllm_batch_arrays


def state(rng, reqs):
    computed = rng.integers(0, 500, reqs).astype(np.int32)
    prefill = rng.integers(1, 500, reqs).astype(np.int32)
    return computed, prefill, np.minimum(computed, prefill).astype(np.int32)


@pytest.mark.parametrize("n,extra,seed", [(1, 0, 0), (7, 1, 1), (13, 19, 2), (256, 0, 3)])
def test_batch_arrays_match_runner_v2(n, extra, seed):
    rng = np.random.default_rng(seed)
    reqs = n + 5
    computed, prefill, cprefill = state(rng, reqs)
    index = {f"r{i}": int(j) for i, j in enumerate(rng.permutation(reqs))}
    req_ids = [f"r{i}" for i in rng.permutation(reqs)[:n]]
    padded = n + extra
    new_rows = np.sort(rng.permutation(n)[: rng.integers(0, n + 1)]).astype(np.int32)
    new_tokens = np.full(len(new_rows), -1, np.int32)
    got = vllm_batch_arrays(req_ids, index, computed, prefill, cprefill, padded, new_rows,
                            new_tokens)
    idx = np.array([index[r] for r in req_ids], np.int32)
    upper = np.zeros(padded, np.int32)
    upper[:n] = computed[idx] + 1
    want = (idx, computed[idx], upper, prefill[idx], cprefill[idx], cprefill[idx] < prefill[idx],
            np.ones(n, np.int32), np.minimum(np.arange(padded + 1, dtype=np.int32), n),
            np.arange(n + 1, dtype=np.int32))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.tolist() == w.tolist()
    assert new_tokens.tolist() == idx[new_rows].tolist()


def test_batch_arrays_refuse_before_writing():
    rng = np.random.default_rng(5)
    computed, prefill, cprefill = state(rng, 4)
    rows, tokens = np.array([1], np.int32), np.full(1, -1, np.int32)
    args = (computed, prefill, cprefill)
    two = {"a": 0, "b": 1}
    with pytest.raises(ValueError, match="req_id_to_index has no request 'b'"):
        vllm_batch_arrays(["a", "b"], {"a": 0}, *args, 2, rows, tokens)
    with pytest.raises(ValueError, match="request index 4 outside the request state's 4 rows"):
        vllm_batch_arrays(["a", "b"], {"a": 0, "b": 4}, *args, 2, rows, tokens)
    with pytest.raises(ValueError, match="padded must be >= the step's rows 2, got 1"):
        vllm_batch_arrays(["a", "b"], two, *args, 1, rows, tokens)
    with pytest.raises(ValueError, match=r"new_rows\[0\] = 1 is not a row of the step's 1"):
        vllm_batch_arrays(["a"], two, *args, 1, rows, tokens)
    with pytest.raises(ValueError, match="new_tokens holds 2 rows, new_rows 1"):
        vllm_batch_arrays(["a", "b"], two, *args, 2, rows, np.zeros(2, np.int32))
    with pytest.raises(TypeError, match="prefill_len must have dtype int32, got int64"):
        vllm_batch_arrays(["a", "b"], two, computed, prefill.astype(np.int64), cprefill, 2,
                          rows, tokens)
    with pytest.raises(ValueError, match="new_tokens must be contiguous"):
        vllm_batch_arrays(["a", "b"], two, *args, 2, rows, np.zeros(4, np.int32)[::2])
    frozen = np.zeros(1, np.int32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="new_tokens is read-only"):
        vllm_batch_arrays(["a", "b"], two, *args, 2, rows, frozen)
    assert tokens.tolist() == [-1]


def output(new=(), cached=(), computed=(), new_blocks=None, finished=()):
    """A scheduler output of vLLM 0.26's field names (``vllm/v1/core/sched/output.py``): ``new``
    as (req_id, prompt length, block ids) prefilled whole, ``cached`` one token each."""
    cached = list(cached)
    sched = {r: p for r, p, _ in new} | {r: 1 for r in cached}
    return SimpleNamespace(
        finished_req_ids=set(finished), preempted_req_ids=set(),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=0,
                                            prefill_token_ids=[1] * p, prompt_token_ids=None)
                            for r, p, b in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=cached, resumed_req_ids=set(), num_computed_tokens=list(computed),
            new_block_ids=new_blocks if new_blocks is not None else [None] * len(cached)),
        num_scheduled_tokens=sched, total_num_scheduled_tokens=sum(sched.values()),
        scheduled_spec_decode_tokens={})


def test_mirror_refuses_a_missed_output_and_keeps_its_state():
    m = VllmMirror(4, 4, 8, False)
    assert m.step(output(new=[("a", 5, [1, 2])])) is None
    with pytest.raises(ValueError, match="cached request 'b' was never scheduled as new"):
        m.step(output(cached=["a", "b"], computed=[5, 3], finished=["a"]))
    assert m.num_requests == 1  # 'a' was not dropped by the refused output
    (zids, rows, tokens, pos, indptr, flat, *_), req_ids = m.step(output(cached=["a"],
                                                                         computed=[5]))
    assert req_ids == ["a"] and rows.tolist() == [0] and pos.tolist() == [5]
    assert indptr.tolist() == [0, 2] and flat.tolist() == [1, 2] and tokens.tolist() == [0]


def test_mirror_refuses_a_request_finished_and_scheduled_in_one_output():
    """A request both preempted (or finished) and scheduled as cached: refused before the
    mirror changes, so its slot is not handed to a new request while still written."""
    m = VllmMirror(4, 4, 8, False)
    m.step(output(new=[("a", 5, [1, 2])]))
    bad = output(new=[("b", 3, [7])], cached=["a"], computed=[5], new_blocks=[([9, 10],)])
    bad.preempted_req_ids = {"a"}
    with pytest.raises(ValueError, match="request 'a' is finished or preempted and scheduled"):
        m.step(bad)
    assert m.num_requests == 1
    m.step(output(new=[("b", 3, [7])]))
    (_, rows, _, pos, _, flat, *_), req_ids = m.step(output(cached=["a", "b"], computed=[5, 3]))
    assert req_ids == ["a", "b"] and pos.tolist() == [5, 3] and flat.tolist() == [1, 2, 7]


@pytest.mark.parametrize("field,value,exc,match", [
    ("new_block_ids", [5], TypeError, "new_block_ids must be a list or tuple, got int"),
    ("num_computed_tokens", ["5"], TypeError, "num_computed_tokens must hold ints, got str"),
    ("num_computed_tokens", [5, 6], ValueError, "one entry per cached request"),
])
def test_mirror_names_a_field_it_cannot_read(field, value, exc, match):
    m = VllmMirror(4, 4, 8, False)
    m.step(output(new=[("a", 5, [1, 2])]))
    bad = output(cached=["a"], computed=[5])
    setattr(bad.scheduled_cached_reqs, field, value)
    with pytest.raises(exc, match=match):
        m.step(bad)


@pytest.mark.parametrize("args,match", [
    ((4, 4, 0), r"max_num_blocks_per_req must be in \[1, 2\^31\), got 0"),
    ((1, 4, 1 << 62), r"max_num_blocks_per_req must be in \[1, 2\^31\)"),
    ((1 << 16, 4, 1 << 16), r"max_num_blocks_per_req \* block_size must be < 2\^31"),
])
def test_mirror_sizes_are_checked(args, match):
    with pytest.raises(ValueError, match=match):
        VllmMirror(*args, False)
