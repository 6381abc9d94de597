"""Tests for zos.buckets (tables, policies, the POLICIES registry) and the engine's make_buckets
(exact, seeded, no GPU). The ``zos buckets`` CLI is tested in test_cli.py."""
import inspect
from fractions import Fraction

import numpy as np
import pytest

from zos import buckets as B
from zos.buckets import POLICIES, BucketTable
from zos.serving.types import EngineConfig, make_buckets

VLLM_512 = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


def all_tables():
    """A spread of policy tables plus an irregular explicit one."""
    return [
        B.vllm_policy(), B.vllm_policy(100), B.vllm_policy(num_draft_tokens=3),
        B.vllm_policy(num_draft_tokens=2, spec_rounding="round_up"),
        B.deepinfer_policy(), B.deepinfer_policy(nextn=5), B.deepinfer_policy(4),
        B.deepinfer_policy(nextn=5, spec_rounding="none"), B.deepinfer_policy(97, nextn=2),
        B.vllm_policy(100, num_draft_tokens=4, spec_rounding="none"),
        B.sglang_policy(), B.sglang_policy(512), B.sglang_policy(num_draft_tokens=3),
        B.sglang_policy(attn_tp_size=4, max_running_requests=50),
        B.trtllm_policy(), B.trtllm_policy(512), B.trtllm_policy(100, enable_padding=False),
        B.trtllm_policy(num_draft_tokens=3), B.trtllm_policy(17, num_draft_tokens=4),
        BucketTable([3, 7, 8, 30, 31, 100]),
    ]


# ---- policies: exact counts and sizes ------------------------------------------------------

def test_vllm_default_sizes_and_count():
    t = B.vllm_policy()
    assert list(t.sizes) == VLLM_512 and len(t) == 51 and t.max_size == 512
    assert t.uniform_decode_query_len == 1
    assert B.from_policy("vllm", max_capture_size=512).sizes == t.sizes
    # vLLM itself caps at its grid; zos adds the max (include_max, default)
    assert list(B.vllm_policy(100, include_max=False).sizes) == [1, 2, 4] + list(range(8, 97, 8))
    assert list(B.vllm_policy(100).sizes) == [1, 2, 4] + list(range(8, 97, 8)) + [100]
    assert B.vllm_policy(12, include_max=False).sizes == (1, 2, 4, 8)
    assert B.vllm_policy(12).sizes == (1, 2, 4, 8, 12)


def test_vllm_worst_cases_exact():
    by_bucket = {iv.bucket: iv for iv in B.vllm_policy().intervals()}
    for bucket, n, frac in [(8, 5, Fraction(3, 8)), (256, 249, Fraction(7, 256)),
                            (512, 497, Fraction(15, 512))]:
        iv = by_bucket[bucket]
        assert (iv.lo, iv.hi, iv.worst_n) == (n, bucket, n)
        assert Fraction(iv.worst_waste) == frac
        assert B.vllm_policy().waste(n) == float(frac)
    w = B.vllm_policy().worst_case()  # overall worst is (8, 16]: n = 9 -> 16
    assert (w.bucket, w.worst_n, Fraction(w.worst_waste)) == (16, 9, Fraction(7, 16))


def round_to_q(sizes, q, mx, rounding):
    """Each size rounded up to a multiple of q by counting up ("round_up"), dropped unless a
    multiple ("filter") or kept as is ("none"); kept if <= mx, without duplicates, sorted."""
    out = []
    for s in sizes:
        if s > mx or (rounding == "filter" and s % q):
            continue
        r = s
        while rounding != "none" and r % q:
            r += 1
        if r <= mx and r not in out:
            out.append(r)
    return sorted(out)


def vllm_reference(mx, k, rounding="round_up", include_max=True):
    """vLLM's grid up to mx made multiples of q = 1 + k (round_to_q), plus the largest multiple
    of q <= mx (mx itself with "none")."""
    q = k + 1
    out = round_to_q([1, 2, 4] + list(range(8, 256, 8)) + list(range(256, mx + 1, 16)), q, mx,
                     rounding)
    top = mx
    while rounding != "none" and top % q:
        top -= 1
    if include_max and top > 0 and top not in out:
        out.append(top)
    return tuple(sorted(out))


@pytest.mark.parametrize("mx,k,rounding,expected", [
    (42, 6, "round_up", (7, 14, 21, 28, 35, 42)),  # 6 requests x 7 rows fit exactly
    (96, 2, "round_up", (3, 6, 9, 18, 24, 33, 42, 48, 57, 66, 72, 81, 90, 96)),
    (96, 2, "filter", (24, 48, 72, 96)),
    (42, 6, "filter", (42,)),  # no grid size is a multiple of 7: only the max
    (4, 3, "round_up", (4,)),
    (12, 0, "round_up", (1, 2, 4, 8, 12)),
])
def test_vllm_spec_exact(mx, k, rounding, expected):
    assert B.vllm_policy(mx, num_draft_tokens=k, spec_rounding=rounding).sizes == expected
    assert vllm_reference(mx, k, rounding) == expected


def test_vllm_spec_default_is_round_up():
    assert B.from_policy("vllm", max_capture_size=42, num_draft_tokens=6).sizes == (
        7, 14, 21, 28, 35, 42)
    default = inspect.signature(B.vllm_policy).parameters["spec_rounding"].default
    assert default == B.SPEC_ROUNDINGS[0] == "round_up"
    # q = 3 at 512: 512 rounds up to 513 > max and is dropped; vLLM stops at 498, zos adds 510
    assert B.vllm_policy(512, num_draft_tokens=2).sizes[-3:] == (480, 498, 510)
    assert B.vllm_policy(512, num_draft_tokens=2, include_max=False).sizes[-3:] == (465, 480, 498)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("rounding", B.SPEC_ROUNDINGS)
@pytest.mark.parametrize("include_max", [True, False])
@pytest.mark.parametrize("mx", [512, 100, 42, 7])
def test_vllm_spec_against_reference(mx, k, rounding, include_max):
    q = k + 1
    ref = vllm_reference(mx, k, rounding, include_max)
    if not ref:
        with pytest.raises(ValueError, match="num_draft_tokens"):
            B.vllm_policy(mx, num_draft_tokens=k, spec_rounding=rounding, include_max=include_max)
        return
    t = B.vllm_policy(mx, num_draft_tokens=k, spec_rounding=rounding, include_max=include_max)
    assert t.sizes == ref and t.uniform_decode_query_len == q
    assert t.uniform_decode == (rounding != "none")
    if rounding == "none":
        return
    assert all(s % q == 0 for s in t.sizes)
    if rounding == "round_up":
        assert t.sizes[0] == q
    if include_max:
        assert t.max_size == mx // q * q


def test_vllm_spec_errors():
    with pytest.raises(ValueError, match="num_draft_tokens: 600"):
        B.vllm_policy(num_draft_tokens=600)
    with pytest.raises(ValueError, match="spec_rounding"):
        B.vllm_policy(spec_rounding="nearest")


def test_deepinfer_counts():
    t = B.deepinfer_policy(256, nextn=0)
    assert len(t) == 35 and t.max_size == 256 and t.sizes[:5] == (1, 2, 4, 8, 16)
    raw = B.deepinfer_policy(256, nextn=5, spec_rounding="none")  # DeepInfer's own table
    assert len(raw) == 195 and raw.max_size == 1536 and raw.uniform_decode_query_len == 6
    assert not raw.uniform_decode and raw.sizes[-3:] == (1520, 1528, 1536)
    # the same 195 sizes are the q = 1 table of 1536 requests: what bench_graphs.py captures
    assert B.deepinfer_policy(1536).sizes == raw.sizes
    t5 = B.deepinfer_policy(256, nextn=5)  # default: rounded up to multiples of q = 6
    assert len(t5) == 193 and t5.uniform_decode and t5.max_size == 1536
    assert t5.sizes[:10] == (6, 12, 18, 24, 36, 42, 48, 60, 66, 72)
    assert t5.sizes[-3:] == (1524, 1530, 1536)
    assert B.from_policy("deepinfer", max_num_seqs=256, nextn=5).sizes == t5.sizes
    filt = B.deepinfer_policy(256, nextn=5, spec_rounding="filter")
    assert filt.sizes == tuple(range(24, 1537, 24)) and len(filt) == 64
    assert B.deepinfer_policy(4).sizes == (1, 2, 4)  # interval clipped to max
    assert B.deepinfer_policy(3, interval=1).sizes == (1, 2, 3)
    assert B.deepinfer_policy(8, nextn=2).sizes == (3, 6, 9, 18, 24)  # raw 1, 2, 4, 8, 16, 24
    with pytest.raises(ValueError, match="spec_rounding"):
        B.deepinfer_policy(nextn=1, spec_rounding="down")


def deepinfer_reference(seqs, nextn, interval, rounding):
    """DeepInfer's raw sizes by counting (powers of two below the interval, then every interval
    below the max, then the max), made multiples of q by round_to_q."""
    q = 1 + nextn
    mx = seqs * q
    step = min(interval, mx)
    raw, p = [], 1
    while p < step:
        raw.append(p)
        p *= 2
    s = step
    while s < mx:
        raw.append(s)
        s += step
    return tuple(round_to_q(raw + [mx], q, mx, rounding))


@pytest.mark.parametrize("seqs", [1, 5, 17, 97, 256])
@pytest.mark.parametrize("nextn", [0, 1, 2, 5, 6])
@pytest.mark.parametrize("interval", [1, 3, 8])
@pytest.mark.parametrize("rounding", B.SPEC_ROUNDINGS)
def test_deepinfer_against_reference(seqs, nextn, interval, rounding):
    q = 1 + nextn
    t = B.deepinfer_policy(seqs, nextn=nextn, interval=interval, spec_rounding=rounding)
    assert t.sizes == deepinfer_reference(seqs, nextn, interval, rounding)
    assert t.uniform_decode_query_len == q and t.max_size == seqs * q
    assert t.uniform_decode == (rounding != "none" or q == 1)
    if t.uniform_decode:
        assert all(s % q == 0 for s in t.sizes)


def test_sglang_default_lists():
    assert len(B.sglang_policy(256)) == 36 and len(B.sglang_policy(512)) == 52
    assert B.sglang_policy(256).sizes[:6] == (1, 2, 4, 8, 12, 16)
    bs, mul = B.sglang_batch_sizes(256, num_draft_tokens=3)
    assert len(bs) == 51 and mul == 1 and bs[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]
    t = B.sglang_policy(256, num_draft_tokens=3)  # token rows: bs * q
    assert t.uniform_decode_query_len == 4 and t.sizes == tuple(b * 4 for b in bs)
    assert B.sglang_batch_sizes(100)[0][-2:] == [96, 100]  # max_bs appended


@pytest.mark.parametrize("tp,cp,k,pool", [(1, 1, 0, None), (2, 1, 0, 64), (4, 1, 0, 50),
                                          (4, 2, 0, None), (3, 2, 1, 70), (8, 1, 3, 33),
                                          (2, 4, 0, 7), (1, 1, 2, 5)])
def test_sglang_alignment_filter(tp, cp, k, pool):
    bs, mul = B.sglang_batch_sizes(256, num_draft_tokens=k, attn_tp_size=tp, attn_cp_size=cp,
                                   max_running_requests=pool)
    assert mul == (tp if tp % cp == 0 else tp * cp)
    assert bs == sorted(set(bs)) and all(b * (1 + k) % mul == 0 for b in bs)
    if pool is not None:
        cap = -(-pool // mul) * mul  # SGLang rounds the pool up to mul_base
        assert max(bs) <= cap
        if cap * (1 + k) % mul == 0:
            assert cap in bs  # the largest admissible batch keeps a graph
    t = B.sglang_policy(256, num_draft_tokens=k, attn_tp_size=tp, attn_cp_size=cp,
                        max_running_requests=pool)
    assert t.alignment == mul and all(s % mul == 0 and s % (1 + k) == 0 for s in t.sizes)


def test_sglang_known_filtered_list():
    assert B.sglang_batch_sizes(256, attn_tp_size=4, max_running_requests=50) == (
        [4, 8, 12, 16, 24, 32, 40, 48, 52], 4)
    assert B.sglang_batch_sizes(256, max_running_requests=10)[0] == [1, 2, 4, 8, 10]


def test_trtllm_sizes():
    assert B.trtllm_policy().sizes == (1, 2, 4) + tuple(range(8, 129, 8))
    assert B.trtllm_policy(512).sizes[-6:] == (128, 192, 256, 320, 384, 448, 512)[1:]
    assert B.trtllm_policy(300).sizes[-4:] == (128, 192, 256, 300)
    assert B.trtllm_policy(6).sizes == (1, 2, 4, 6)
    assert B.trtllm_policy(enable_padding=False).sizes == tuple(range(1, 32)) + (32, 64, 128)
    assert B.trtllm_policy(1000, enable_padding=False).sizes[-4:] == (128, 256, 512, 1000)


def test_trtllm_graph_keys():
    sizes = B.trtllm_batch_sizes(128)
    assert B.trtllm_graph_keys(128, 0) == [(b, 0) for b in sizes]
    # one-engine speculation (MTP, Eagle3 one-model): no draft-length-0 graphs
    assert B.trtllm_graph_keys(128, 3) == [(b, 3) for b in sizes]
    assert B.trtllm_graph_keys(128, 3, one_engine=False) == [(b, 3) for b in sizes]
    keys = B.trtllm_graph_keys(128, 3, one_engine=False, max_concurrency=16)
    assert len(keys) == 2 * len(sizes) and set(keys) == {(b, d) for b in sizes for d in (3, 0)}
    keys0 = B.trtllm_graph_keys(128, 0, one_engine=False, max_concurrency=16)
    assert keys0 == [(b, 0) for b in sizes]


def trtllm_reference(mx, padding):
    """TensorRT-LLM's batch sizes by counting: with padding 1, 2, 4, every 8 up to 128, then
    every 64 while <= mx; without, 1..31, 32, 64, 128 and powers of two from 256 below the next
    power of two >= mx; cut to <= mx, mx appended if missing."""
    if padding:
        out = [1, 2, 4] + list(range(8, 129, 8))
        while out[-1] + 64 <= mx:
            out.append(out[-1] + 64)
    else:
        out, p, top = list(range(1, 32)) + [32, 64, 128], 256, 1
        while top < mx:  # top: the smallest power of two >= mx
            top *= 2
        while p < top:
            out.append(p)
            p *= 2
    out = [b for b in out if b <= mx]
    return out if out and out[-1] == mx else out + [mx]


@pytest.mark.parametrize("mx", [1, 5, 17, 97, 128, 300, 513])
@pytest.mark.parametrize("k", [0, 1, 2, 4, 6])
@pytest.mark.parametrize("padding", [True, False])
def test_trtllm_draft_tables_against_reference(mx, k, padding):
    """Key (b, k) is bucket b * (1 + k): every graph key of draft length k is a q-uniform size."""
    q = 1 + k
    bs = trtllm_reference(mx, padding)
    assert B.trtllm_batch_sizes(mx, enable_padding=padding) == bs
    t = B.trtllm_policy(mx, num_draft_tokens=k, enable_padding=padding)
    assert t.sizes == tuple(b * q for b in bs) and t.uniform_decode_query_len == q
    assert t.uniform_decode and t.max_size == mx * q
    assert [b * (1 + d) for b, d in B.trtllm_graph_keys(mx, k, enable_padding=padding)] == list(
        t.sizes)


# ---- the table itself ----------------------------------------------------------------------

@pytest.mark.parametrize("t", all_tables(), ids=repr)
def test_padded_size_minimal_and_monotone(t):
    prev = 0
    for n in range(1, t.max_size + 1):
        got = t.padded_size(n)
        assert got == min(b for b in t.sizes if b >= n)
        assert got >= prev
        prev = got
    for n in (t.max_size + 1, t.max_size + 1000):
        assert t.padded_size(n) is None
    for s in t.sizes:
        assert s in t and t.padded_size(s) == s and t.waste(s) == 0.0


@pytest.mark.parametrize("t", all_tables(), ids=repr)
def test_padded_sizes_vectorized(t):
    rng = np.random.default_rng(1234)
    ns = rng.integers(1, t.max_size + 50, size=2000)
    ref = np.array([t.padded_size(int(n)) or -1 for n in ns])
    out = t.padded_sizes(ns)
    assert out.dtype == np.int64 and np.array_equal(out, ref)
    assert np.array_equal(t.padded_sizes(ns.reshape(40, 50)), ref.reshape(40, 50))
    assert t.padded_sizes(np.array([], dtype=np.int64)).shape == (0,)


@pytest.mark.parametrize("t", all_tables(), ids=repr)
def test_intervals_cover_and_worst(t):
    ivs = t.intervals()
    assert [iv.bucket for iv in ivs] == list(t.sizes) and ivs[0].lo == 1
    step = t.uniform_decode_query_len if t.uniform_decode else 1
    for a, b in zip(ivs, ivs[1:]):
        assert b.lo == a.hi + 1
    for iv in ivs:
        assert iv.worst_n == iv.lo - 1 + step
        assert iv.worst_waste == (iv.bucket - iv.worst_n) / iv.bucket
        assert iv.worst_waste == max(t.waste(n) for n in range(iv.worst_n, iv.hi + 1, step))
    assert t.worst_case().worst_waste == max(iv.worst_waste for iv in ivs)


def test_table_basics():
    t = BucketTable([2, 4, 8], uniform_decode_query_len=2, alignment=2, name="x")
    assert len(t) == 3 and list(t) == [2, 4, 8] and 4 in t and 3 not in t
    assert t.max_size == 8 and t.uniform_decode_query_len == 2 and t.alignment == 2
    assert "x" in repr(t) and "n=3" in repr(t)
    assert t.waste(5) == 3 / 8 and t._lut.dtype == np.int32 and t._lut.shape == (9,)
    assert BucketTable(np.array([1, 3])).sizes == (1, 3)
    with pytest.raises(ValueError, match="above"):
        t.waste(9)


@pytest.mark.parametrize("kwargs,exc,field", [
    (dict(sizes=[]), ValueError, "sizes"),
    (dict(sizes=[1, 2.0]), TypeError, r"sizes\[1\]"),
    (dict(sizes=[1, "4"]), TypeError, r"sizes\[1\]"),
    (dict(sizes=[True, 2]), TypeError, r"sizes\[0\]"),
    (dict(sizes=[0, 2]), ValueError, r"sizes\[0\]"),
    (dict(sizes=[-4]), ValueError, r"sizes\[0\]"),
    (dict(sizes=[1, 4, 4]), ValueError, r"sizes\[2\].*increasing"),
    (dict(sizes=[4, 2]), ValueError, r"sizes\[1\].*increasing"),
    (dict(sizes=[4, 6], alignment=4), ValueError, r"sizes\[1\].*alignment"),
    (dict(sizes=[2, 3], uniform_decode_query_len=2), ValueError, r"sizes\[1\].*q=2"),
    (dict(sizes=[1], uniform_decode_query_len=0), ValueError, "uniform_decode_query_len"),
    (dict(sizes=[1], uniform_decode_query_len=1.5), TypeError, "uniform_decode_query_len"),
    (dict(sizes=[1], alignment=0), ValueError, "alignment"),
    (dict(sizes=[1], alignment=False), TypeError, "alignment"),
])
def test_validation_errors(kwargs, exc, field):
    with pytest.raises(exc, match=field):
        BucketTable(**kwargs)


def test_non_uniform_allows_non_multiples_of_q():
    assert BucketTable([2, 3], uniform_decode_query_len=2, uniform_decode=False).sizes == (2, 3)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "3", None])
def test_padded_size_rejects(bad):
    with pytest.raises(ValueError, match="n"):
        B.vllm_policy().padded_size(bad)


@pytest.mark.parametrize("bad", [np.array([0, 1]), np.array([1.0, 2.0]), np.array([-3])])
def test_padded_sizes_rejects(bad):
    with pytest.raises(ValueError, match="ns"):
        B.vllm_policy().padded_sizes(bad)


@pytest.mark.parametrize("fn,kwargs", [
    (B.vllm_policy, dict(max_capture_size=0)), (B.deepinfer_policy, dict(max_num_seqs=0)),
    (B.deepinfer_policy, dict(nextn=-1)), (B.sglang_policy, dict(attn_tp_size=0)),
    (B.sglang_policy, dict(max_bs=1, attn_tp_size=2, num_draft_tokens=0)),
    (B.trtllm_policy, dict(max_batch_size=0)), (B.trtllm_graph_keys, dict(max_draft_len=-1)),
])
def test_policy_argument_errors(fn, kwargs):
    with pytest.raises(ValueError):
        fn(**kwargs)


def test_llamacpp_note():
    assert "cudaGraphExecUpdate" in B.LLAMACPP_NOTE


# ---- the registry ----------------------------------------------------------------------------

def test_registry_names_and_units():
    assert list(POLICIES) == ["vllm", "deepinfer", "sglang", "trtllm"]
    assert {n: (p.unit, p.max_unit) for n, p in POLICIES.items()} == {
        "vllm": ("token rows", "token rows"), "deepinfer": ("token rows", "requests"),
        "sglang": ("token rows", "requests"), "trtllm": ("token rows", "requests")}


@pytest.mark.parametrize("name", list(POLICIES))
def test_registry_matches_builder_signature(name):
    pol = POLICIES[name]
    params = inspect.signature(pol.builder).parameters
    if name == "sglang":  # max_bs is its own; the rest go through **kwargs to sglang_batch_sizes
        params = {**params, **inspect.signature(B.sglang_batch_sizes).parameters}
    assert params[pol.max_keyword].default == pol.default_max
    assert pol.draft_keyword in params
    assert all(o in params for o in pol.options)
    assert pol.build().sizes == B.from_policy(name).sizes == pol.builder().sizes
    assert pol.build(64).sizes == B.from_policy(name, **{pol.max_keyword: 64}).sizes


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("k", [0, 1, 2, 5, 6])
def test_registry_units_and_largest_size(name, k):
    """Every policy's default table with k draft tokens is uniform decode: sizes multiples of q,
    the largest the largest multiple of q its max allows."""
    pol = POLICIES[name]
    q = 1 + k
    for m in (1, 3, 7, 12, 42, 64, 97, 100, 300):
        if pol.largest_size(m, q) < q:  # vLLM's max counts token rows: fewer than one request
            with pytest.raises(ValueError, match="num_draft_tokens"):
                pol.build(m, num_draft_tokens=k)
            continue
        t = pol.build(m, num_draft_tokens=k)
        assert t.uniform_decode_query_len == q and t.uniform_decode
        assert all(s % q == 0 for s in t.sizes), (m, t.sizes)
        assert t.max_size == pol.largest_size(m, q) // q * q, (m, t.sizes)


def test_from_policy_unknown_and_explicit():
    assert B.from_policy("explicit", sizes=[2, 4], uniform_decode_query_len=2).sizes == (2, 4)
    with pytest.raises(ValueError, match="name"):
        B.from_policy("tgi")


# ---- with_max and the engine's tables ------------------------------------------------------

@pytest.mark.parametrize("sizes,q,n,expected", [
    ([1, 2, 4, 8], 1, 12, (1, 2, 4, 8, 12)), ([1, 2, 4, 8], 1, 8, (1, 2, 4, 8)),
    ([1, 2, 4, 8], 1, 5, (1, 2, 4, 5)), ([1, 2, 4, 8], 1, 1, (1,)),
    ([2, 4], 2, 10, (2, 4, 10)), ([3, 9], 3, 6, (3, 6)),
])
def test_with_max(sizes, q, n, expected):
    t = BucketTable(sizes, uniform_decode_query_len=q, name="x")
    w = t.with_max(n)
    assert w.sizes == expected and w.max_size == n
    assert (w.name, w.uniform_decode_query_len, w.alignment) == ("x", q, 1)
    assert (w is t) == (n == t.max_size)


@pytest.mark.parametrize("kwargs,n,exc,match", [
    (dict(uniform_decode_query_len=2), 5, ValueError, "n: 5 is not a multiple of 2"),
    (dict(alignment=4, uniform_decode_query_len=2), 6, ValueError, "n: 6 is not a multiple of 4"),
    (dict(), 0, ValueError, "n"), (dict(), 2.0, TypeError, "n"),
])
def test_with_max_errors(kwargs, n, exc, match):
    with pytest.raises(exc, match=match):
        BucketTable([4, 8], **kwargs).with_max(n)


def test_with_max_non_uniform():
    t = BucketTable([2, 3], uniform_decode_query_len=2, uniform_decode=False)
    assert t.with_max(5).sizes == (2, 3, 5)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("k", [0, 1, 4, 6])
def test_make_buckets_reaches_max_num_seqs(name, k):
    q = 1 + k
    pol = POLICIES[name]
    for m in [*range(1, 131), 257, 500]:
        t = make_buckets(EngineConfig(max_num_seqs=m, bucket_policy=name), k)
        assert t.max_size == m * q and t.uniform_decode_query_len == q, (m, t.sizes)
        assert all(s % q == 0 for s in t.sizes), (m, t.sizes)
        ns = np.arange(1, m + 1) * q  # every request count, q rows each
        padded = t.padded_sizes(ns)
        assert (padded >= ns).all() and (padded <= m * q).all(), m
        value = m if pol.max_unit == "requests" else m * q
        own = pol.build(value, num_draft_tokens=k).sizes
        assert t.sizes == tuple(s for s in own if s < m * q) + (m * q,), m  # only the max added


def test_make_buckets_vllm_spec_full_batch():
    """6 requests x 7 rows: 42 is a bucket (vLLM's own rounded grid at 42 is 7, ..., 42)."""
    assert make_buckets(EngineConfig(max_num_seqs=6, bucket_policy="vllm"), 6).sizes == (
        7, 14, 21, 28, 35, 42)
    t = make_buckets(EngineConfig(max_num_seqs=5, buckets=[3, 6]), 2)
    assert t.sizes == (3, 6) and t.uniform_decode_query_len == 3
    for bad, exc in ((-1, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="num_draft_tokens"):
            make_buckets(EngineConfig(), bad)


@pytest.mark.parametrize("m,expected", [
    (12, (1, 2, 4, 8, 12)), (3, (1, 2, 3)), (20, (1, 2, 4, 8, 16, 20)),
    (50, (1, 2, 4, *range(8, 49, 8), 50)), (100, (1, 2, 4, *range(8, 97, 8), 100)),
    (64, (1, 2, 4, *range(8, 65, 8))),
])
def test_make_buckets_vllm_off_grid(m, expected):
    assert make_buckets(EngineConfig(max_num_seqs=m, bucket_policy="vllm")).sizes == expected


def test_make_buckets_explicit_and_errors():
    assert make_buckets(EngineConfig(bucket_policy=None)) is None
    # explicit buckets are taken as given (a batch above 4 runs eagerly)
    assert make_buckets(EngineConfig(max_num_seqs=8, buckets=[1, 2, 4])).sizes == (1, 2, 4)
    t = BucketTable([2, 4])
    assert make_buckets(EngineConfig(buckets=t)) is t
    for bad in ("tgi", "explicit", 3):
        with pytest.raises(ValueError, match="bucket_policy"):
            make_buckets(EngineConfig(bucket_policy=bad))
