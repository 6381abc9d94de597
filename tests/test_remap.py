"""compute_remap (zos._C) against a Python dict reference: exhaustive small batches, seeded
large ones, and batches drawn by hypothesis (any int64 ids, duplicates included)."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zos import compute_remap

INT64 = st.integers(-2**63, 2**63 - 1)


def reference(prev, curr):
    where = {rid: j for j, rid in enumerate(prev)}
    return [where.get(rid, -1) for rid in curr]


def run(prev, curr, extra=0):
    out = np.full(len(curr) + extra, 12345, np.int32)
    missing = compute_remap(np.asarray(prev, np.int64), np.asarray(curr, np.int64), out)
    return out, missing


def small_batches(universe=5, max_len=3):
    for k in range(max_len + 1):
        yield from itertools.permutations(range(universe), k)


def test_exhaustive_small():
    batches = list(small_batches())
    for prev in batches:
        for curr in batches:
            out, missing = run(prev, curr, extra=1)
            ref = reference(prev, curr)
            assert out[: len(curr)].tolist() == ref
            assert out[len(curr)] == 12345  # nothing written past N
            assert missing == ref.count(-1)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("p,n", [(0, 17), (17, 0), (97, 123), (123, 97), (1024, 1024), (5000, 3)])
def test_random_against_dict(seed, p, n):
    rng = np.random.default_rng(seed)
    ids = rng.choice(2**62, size=p + n, replace=False).astype(np.int64) - 2**61
    prev = ids[:p]
    carried = rng.choice(prev, size=min(p, (7 * n) // 10), replace=False)
    curr = np.concatenate([carried, ids[p : p + n - len(carried)]])
    rng.shuffle(curr)
    out, missing = run(prev, curr)
    ref = reference(prev.tolist(), curr.tolist())
    assert out.tolist() == ref and missing == ref.count(-1)


@st.composite
def prev_and_curr(draw):
    """Two batches of distinct int64 ids (0 to 70 of them, ids near 0 and the int64 extremes
    included: hypothesis favours them): curr carries any subset of prev, in any order, among
    new ids."""
    size = draw(st.integers(0, 70))
    pool = draw(st.lists(INT64, unique=True, min_size=size, max_size=size))
    p = draw(st.integers(0, size))
    prev, fresh = pool[:p], pool[p:]
    keep = draw(st.lists(st.booleans(), min_size=p, max_size=p))
    carried = [rid for rid, k in zip(prev, keep) if k]
    curr = draw(st.permutations(carried + fresh[: draw(st.integers(0, len(fresh)))]))
    return prev, curr


@settings(max_examples=150, deadline=None)
@given(batches=prev_and_curr(), extra=st.integers(0, 3))
def test_drawn_against_dict(batches, extra):
    prev, curr = batches
    out, missing = run(prev, curr, extra)
    ref = reference(prev, curr)
    assert out[: len(curr)].tolist() == ref and missing == ref.count(-1)
    assert out[len(curr):].tolist() == [12345] * extra  # nothing written past N


def first_duplicate(ids):
    """(id, first position, second position) of the first repeat in ``ids``, or None."""
    seen = {}
    for j, x in enumerate(ids):
        if x in seen:
            return x, seen[x], j
        seen[x] = j
    return None


@settings(max_examples=200, deadline=None)
@given(prev=st.lists(st.integers(-3, 5), max_size=9), curr=st.lists(st.integers(-3, 5),
                                                                      max_size=9))
def test_drawn_duplicates_named_before_writing(prev, curr):
    """Few distinct ids, so repeats are common: the first repeat of prev, else of curr, is named
    with both positions and nothing is written; without repeats, the dict reference."""
    out = np.full(len(curr) + 1, 12345, np.int32)
    dup = [(name, first_duplicate(ids)) for name, ids in (("prev", prev), ("curr", curr))]
    dup = [(name, d) for name, d in dup if d is not None]
    if dup:
        name, (rid, i, j) = dup[0]
        with pytest.raises(ValueError, match=rf"^{name}_req_ids: request id {rid} appears twice, "
                                             rf"at positions {i} and {j}$"):
            compute_remap(np.asarray(prev, np.int64), np.asarray(curr, np.int64), out)
        assert (out == 12345).all()
    else:
        missing = compute_remap(np.asarray(prev, np.int64), np.asarray(curr, np.int64), out)
        ref = reference(prev, curr)
        assert out.tolist() == ref + [12345] and missing == ref.count(-1)


def test_all_carried_and_all_new():
    prev = np.arange(100, dtype=np.int64) * 7
    out, missing = run(prev, prev[::-1].copy())
    assert missing == 0 and out.tolist() == list(range(99, -1, -1))
    out, missing = run(prev, prev + 1)
    assert missing == 100 and (out == -1).all()


def test_reuses_table_across_sizes():
    # Growth then shrink then growth: stale entries of an earlier call never leak.
    for n in (3, 4000, 2, 4000, 0, 5):
        prev = np.arange(n, dtype=np.int64)
        curr = np.arange(n // 2, n + n // 2, dtype=np.int64)
        out, missing = run(prev, curr)
        assert out.tolist() == reference(prev.tolist(), curr.tolist())


@pytest.mark.parametrize("prev,curr,match", [
    ([1, 2, 1], [1], r"prev_req_ids: request id 1 appears twice, at positions 0 and 2"),
    ([1], [4, 5, 6, 5], r"curr_req_ids: request id 5 appears twice, at positions 1 and 3"),
])
def test_duplicates_raise_before_writing(prev, curr, match):
    out = np.full(8, 7, np.int32)
    with pytest.raises(ValueError, match=match):
        compute_remap(np.asarray(prev, np.int64), np.asarray(curr, np.int64), out)
    assert (out == 7).all()


def test_argument_errors():
    i64 = np.arange(4, dtype=np.int64)
    out = np.zeros(4, np.int32)
    with pytest.raises(TypeError, match="prev_req_ids must have dtype int64"):
        compute_remap(i64.astype(np.int32), i64, out)
    with pytest.raises(TypeError, match="curr_req_ids must be a numpy array"):
        compute_remap(i64, [0, 1], out)
    with pytest.raises(TypeError, match="out must have dtype int32"):
        compute_remap(i64, i64, out.astype(np.int64))
    with pytest.raises(ValueError, match="curr_req_ids must be 1-D"):
        compute_remap(i64, i64.reshape(2, 2), out)
    with pytest.raises(ValueError, match="prev_req_ids must be contiguous"):
        compute_remap(np.arange(8, dtype=np.int64)[::2], i64, out)
    with pytest.raises(ValueError, match="out has 3 elements, needs at least 4"):
        compute_remap(i64, i64, out[:3])
    ro = out.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        compute_remap(i64, i64, ro)
    assert (out == 0).all()


def test_pinned_tensor_view():
    torch = pytest.importorskip("torch")
    buf = torch.full((6,), 9, dtype=torch.int32)
    missing = compute_remap(np.array([3, 4], np.int64), np.array([4, 5, 3], np.int64), buf.numpy())
    assert missing == 1 and buf.tolist() == [1, -1, 0, 9, 9, 9]
