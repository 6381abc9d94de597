"""Tests of zos.attention.paged_decode_attention (Triton flash-decoding over the paged cache).

The reference is plain torch in float32: per request row, gather the row's blocks up to seq_len,
causal per query row (a negative position clamps to key 0), softmax. Every block a row does not
own (except the null block 0), the unused columns of its block-table row and the slots of its
last block past seq_len hold NaN / huge values, so any read outside the row's keys shows up.
On CPU the kernels run in Triton's interpreter (slow): shapes are small and the parameter sets
are a representative choice, not a cross product.
"""
import pytest
import torch

from zos.attention import default_num_splits, paged_decode_attention

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def reference(q, kv_cache, block_table, seq_lens, scale):
    """float32 attention of each query row over its own keys (the semantics of the docstring)."""
    r_rows = block_table.shape[0]
    t_rows, hq, hd = q.shape
    q_len = t_rows // r_rows
    _, _, bs, hkv, _ = kv_cache.shape
    group = hq // hkv
    out = torch.empty(t_rows, hq, hd, dtype=torch.float32, device=q.device)
    for r in range(r_rows):
        seq_len = int(seq_lens[r])
        nb = cdiv(seq_len, bs)
        idx = block_table[r, :nb].long()
        k = kv_cache[0, idx].reshape(nb * bs, hkv, hd)[:seq_len].float()
        v = kv_cache[1, idx].reshape(nb * bs, hkv, hd)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [L, hq, hd]
        v = v.repeat_interleave(group, dim=1)
        for t in range(q_len):
            pos = max(seq_len - q_len + t, 0)
            scores = torch.einsum("hd,khd->hk", q[r * q_len + t].float(), k[: pos + 1]) * scale
            out[r * q_len + t] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[: pos + 1])
    return out


def make_case(device, dtype, hq, hkv, hd, bs, q_len, seq_lens, *, extra_cols=2, dummy_rows=0,
              seed=0):
    """Random q and cache; rows own shuffled (non-contiguous) blocks; everything else poisoned.

    Returns (q, kv_cache, block_table, seq_lens). Dummy rows (seq_len 1, all-null block-table
    row) are appended after the real rows; block 0 holds finite random values.
    """
    torch.manual_seed(seed)
    need = [cdiv(s, bs) for s in seq_lens]
    w = max(need + [1]) + extra_cols
    num_garbage = 3
    num_blocks = 1 + sum(need) + num_garbage
    kv = torch.randn(2, num_blocks, bs, hkv, hd, dtype=torch.float32)
    huge = torch.finfo(dtype).max
    pool = (torch.randperm(num_blocks - 1) + 1).tolist()
    rows = []
    for s, nb in zip(seq_lens, need, strict=True):
        ids = [pool.pop() for _ in range(nb)]
        # Slots of the row's last block at or past seq_len: stale data, never read.
        last = ids[-1]
        kv[:, last, s - (nb - 1) * bs:] = float("nan")
        rows.append(ids)
    garbage = pool  # the remaining ids: valid, owned by nobody
    assert len(garbage) == num_garbage
    for i, b in enumerate(garbage):
        kv[:, b] = float("nan") if i % 2 == 0 else huge
    table = torch.zeros(len(seq_lens) + dummy_rows, w, dtype=torch.int32)
    for r, ids in enumerate(rows):
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        fill = torch.tensor(garbage, dtype=torch.int32)[torch.randint(0, num_garbage,
                                                                      (w - len(ids),))]
        table[r, len(ids):] = fill
    lens = torch.tensor(list(seq_lens) + [1] * dummy_rows, dtype=torch.int32)
    r_rows = len(seq_lens) + dummy_rows
    q = torch.randn(r_rows * q_len, hq, hd)
    return (q.to(dtype).to(device), kv.to(dtype).to(device), table.to(device),
            lens.to(device))


# (dtype, num_heads, num_kv_heads, head_dim, block_size, q_len, seq_lens)
CASES = [
    (torch.float32, 3, 3, 64, 16, 1, [1, 15, 16, 17]),
    (torch.float32, 9, 3, 64, 1, 1, [1, 17, 40]),
    (torch.float32, 4, 1, 128, 32, 2, [1, 15, 33, 64]),
    (torch.float32, 9, 3, 64, 32, 3, [2, 17, 16, 1]),
    (torch.float32, 2, 1, 40, 16, 2, [3, 17]),  # head_dim not a power of two (masked pad)
    (torch.float16, 9, 3, 64, 16, 1, [15, 16, 17, 1]),
    (torch.float16, 4, 1, 128, 1, 3, [1, 5, 16]),
    (torch.float16, 8, 1, 64, 16, 3, [2, 30]),  # q_len * group = 24 -> BLOCK_M 32
    (torch.bfloat16, 9, 3, 64, 16, 2, [1, 17, 1000]),
    (torch.bfloat16, 3, 3, 128, 32, 1, [16, 17, 1]),
]


def _case_id(c):
    dtype, hq, hkv, hd, bs, q_len, lens = c
    return f"{str(dtype)[6:]}-h{hq}/{hkv}-d{hd}-bs{bs}-q{q_len}-L{'_'.join(map(str, lens))}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_reference(device, case):
    dtype, hq, hkv, hd, bs, q_len, lens = case
    q, kv, bt, sl = make_case(device, dtype, hq, hkv, hd, bs, q_len, lens, dummy_rows=1)
    scale = hd ** -0.5
    out = paged_decode_attention(q, kv, bt, sl, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), reference(q, kv, bt, sl, scale), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_num_splits_agree(device, dtype):
    """1, 2 and 7 splits (7 > the tiles of the short rows: splits without keys) agree."""
    q, kv, bt, sl = make_case(device, dtype, 9, 3, 64, 16, 2, [1, 17, 200, 40], extra_cols=8,
                              dummy_rows=1, seed=1)
    ref = reference(q, kv, bt, sl, 0.125)
    outs = [paged_decode_attention(q, kv, bt, sl, 0.125, num_splits=s) for s in (1, 2, 7)]
    for out in outs:
        torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    torch.testing.assert_close(outs[1], outs[2], **TOL[dtype])


def test_full_block_table_and_clamped_seq_lens(device):
    """Rows that fill all W columns; seq_lens past W * block_size are clamped to it (no read
    past the row), below 1 to 1."""
    dtype = torch.float32
    q, kv, bt, sl = make_case(device, dtype, 4, 2, 64, 16, 1, [48, 33, 48], extra_cols=0,
                              seed=6)
    assert bt.shape[1] * 16 == 48
    ref = reference(q, kv, bt, sl, 0.125)
    torch.testing.assert_close(paged_decode_attention(q, kv, bt, sl, 0.125), ref,
                               **TOL[dtype])
    bad = torch.tensor([1000, 33, 49], dtype=torch.int32, device=device)
    torch.testing.assert_close(paged_decode_attention(q, kv, bt, bad, 0.125, num_splits=2), ref,
                               **TOL[dtype])
    zero = torch.tensor([0, -5, 1], dtype=torch.int32, device=device)
    one = torch.ones(3, dtype=torch.int32, device=device)
    torch.testing.assert_close(paged_decode_attention(q, kv, bt, zero, 0.125),
                               reference(q, kv, bt, one, 0.125), **TOL[dtype])


def test_dummy_rows_read_block_zero_only(device):
    """Dummy rows (seq_len 1, null-block row) with q_len 2: the position -1 clamps to key 0.

    Block 0 holds finite values; every block except block 0 and the real row's is NaN / huge.
    """
    dtype = torch.float16
    q, kv, bt, sl = make_case(device, dtype, 4, 2, 64, 16, 2, [20], dummy_rows=3, seed=2)
    for splits in (None, 3):
        out = paged_decode_attention(q, kv, bt, sl, 0.125, num_splits=splits)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), reference(q, kv, bt, sl, 0.125), **TOL[dtype])
        # Both query rows of a dummy row see key 0 of block 0 only: output = V[block 0, slot 0].
        v0 = kv[1, 0, 0].float().repeat_interleave(2, dim=0)
        for row in range(2, 8):
            torch.testing.assert_close(out[row].float(), v0, **TOL[dtype])


def test_out_argument_and_strided_inputs(device):
    """A given ``out`` (a strided view) is written in place and returned; q, seq_lens (a
    column of a wider tensor) and block_table (a column slice) may be strided."""
    dtype = torch.float32
    q, kv, bt, sl = make_case(device, dtype, 9, 3, 64, 16, 1, [5, 33], seed=3)
    q_wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=dtype, device=device)
    q_wide[..., ::2] = q
    q_strided = q_wide[..., ::2]
    out_wide = torch.full((q.shape[0], 2 * q.shape[1], q.shape[2]), 7.0, dtype=dtype,
                          device=device)
    out = out_wide[:, 1::2]
    sl_strided = torch.stack([torch.full_like(sl, 10 ** 6), sl], 1)[:, 1]
    bt_strided = torch.stack([torch.zeros_like(bt), bt], 2)[:, :, 1]
    assert not sl_strided.is_contiguous() and bt_strided.stride(1) == 2
    got = paged_decode_attention(q_strided, kv, bt_strided, sl_strided, 0.125, out=out,
                                 num_splits=2)
    assert got is out
    torch.testing.assert_close(out, reference(q, kv, bt, sl, 0.125), **TOL[dtype])
    assert (out_wide[:, 0::2] == 7.0).all()  # untouched


def test_default_num_splits_rule():
    # Small batch, long context: ceil(528 / (R * Hkv)) splits.
    assert default_num_splits(1, 3, 1024, 16) == 64  # 528 / 3 -> 176, capped at 64
    assert default_num_splits(64, 3, 256, 16) == 3  # 528 / 192 -> 3
    assert default_num_splits(64, 8, 1024, 16) == 2
    assert default_num_splits(256, 8, 1024, 16) == 1
    # Short tables: at least 4 tiles per split; at least one split.
    assert default_num_splits(1, 1, 4, 16) == 1  # 64 tokens = 1 tile
    assert default_num_splits(1, 1, 64, 16) == 4  # 1024 tokens = 16 tiles -> 4
    assert default_num_splits(2, 1, 64, 16, block_n=32) == 8


def _valid_args(device):
    q = torch.zeros(4, 6, 16, device=device)
    kv = torch.zeros(2, 5, 4, 2, 16, device=device)
    bt = torch.zeros(2, 3, dtype=torch.int32, device=device)
    sl = torch.ones(2, dtype=torch.int32, device=device)
    return dict(q=q, kv_cache=kv, block_table=bt, seq_lens=sl, scale=0.25)


def _noncontiguous_cache(a):
    big = torch.zeros(2, 5, 4, 2, 32, device=a["kv_cache"].device)
    return big[..., :16]


# (test id, argument, bad value from the valid arguments, exception)
BAD = [
    ("q-2d", "q", lambda a: a["q"][0], ValueError),
    ("q-not-tensor", "q", lambda a: a["q"].tolist(), TypeError),
    ("q-head_dim", "q", lambda a: a["q"][:, :, :8], ValueError),
    ("q-heads-not-multiple", "q", lambda a: a["q"][:, :5], ValueError),
    ("q-T-not-multiple-of-R", "q", lambda a: a["q"][:3], ValueError),
    ("q-T-zero", "q", lambda a: a["q"][:0], ValueError),
    ("q-dtype", "q", lambda a: a["q"].half(), TypeError),
    ("kv_cache-4d", "kv_cache", lambda a: a["kv_cache"][0], ValueError),
    ("kv_cache-shape0", "kv_cache", lambda a: a["kv_cache"].repeat(2, 1, 1, 1, 1), ValueError),
    ("kv_cache-noncontiguous", "kv_cache", _noncontiguous_cache, ValueError),
    ("kv_cache-float64", "kv_cache", lambda a: a["kv_cache"].double(), TypeError),
    ("block_table-1d", "block_table", lambda a: a["block_table"][0], ValueError),
    ("block_table-int64", "block_table", lambda a: a["block_table"].long(), TypeError),
    ("block_table-no-columns", "block_table", lambda a: a["block_table"][:, :0], ValueError),
    ("seq_lens-length", "seq_lens", lambda a: a["seq_lens"][:1], ValueError),
    ("seq_lens-2d", "seq_lens", lambda a: a["seq_lens"][:, None], ValueError),
    ("seq_lens-int64", "seq_lens", lambda a: a["seq_lens"].long(), TypeError),
    ("scale-tensor", "scale", lambda a: torch.tensor(0.25), TypeError),
    ("scale-nan", "scale", lambda a: float("nan"), ValueError),
]


@pytest.mark.parametrize("name,mutate,exc", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validation(device, name, mutate, exc):
    """Each bad argument raises before any launch, naming the argument."""
    args = _valid_args(device)
    args[name] = mutate(args)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        paged_decode_attention(**args)


@pytest.mark.parametrize("kw,exc", [
    (dict(out="zeros"), TypeError),
    (dict(out="wrong_shape"), ValueError),
    (dict(out="wrong_dtype"), TypeError),
    (dict(num_splits=0), ValueError),
    (dict(num_splits=2.0), TypeError),
], ids=["out-not-tensor", "out-shape", "out-dtype", "num_splits-0", "num_splits-float"])
def test_validation_keywords(device, kw, exc):
    args = _valid_args(device)
    q = args["q"]
    name = next(iter(kw))
    val = kw[name]
    if val == "zeros":
        val = [0.0]
    elif val == "wrong_shape":
        val = torch.zeros(4, 6, 8, device=device)
    elif val == "wrong_dtype":
        val = torch.zeros_like(q, dtype=torch.float16)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        paged_decode_attention(**args, **{name: val})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device mismatch needs a GPU")
def test_validation_device():
    args = _valid_args("cuda")
    args["seq_lens"] = args["seq_lens"].cpu()
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_graph_replay(dtype):
    """Capture once; change seq_lens / block_table in place; replay matches the reference."""
    hq, hkv, hd, bs, q_len = 9, 3, 64, 16, 2
    q0, kv0, bt0, sl0 = make_case("cuda", dtype, hq, hkv, hd, bs, q_len, [40, 300, 1],
                                  extra_cols=20, dummy_rows=1, seed=4)
    q1, kv1, bt1, sl1 = make_case("cuda", dtype, hq, hkv, hd, bs, q_len, [333, 2, 17],
                                  extra_cols=1, dummy_rows=1, seed=5)
    w = max(bt0.shape[1], bt1.shape[1])
    nb = max(kv0.shape[1], kv1.shape[1])
    q = q0.clone()
    kv = torch.zeros(2, nb, bs, hkv, hd, dtype=dtype, device="cuda")
    kv[:, : kv0.shape[1]] = kv0
    bt = torch.zeros(bt0.shape[0], w, dtype=torch.int32, device="cuda")
    bt[:, : bt0.shape[1]] = bt0
    sl = sl0.clone()
    out = torch.empty_like(q)
    paged_decode_attention(q, kv, bt, sl, hd ** -0.5, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host sync inside the launcher would raise
    try:
        paged_decode_attention(q, kv, bt, sl, hd ** -0.5, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kv, bt, sl, hd ** -0.5, out=out)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), reference(q, kv, bt, sl, hd ** -0.5), **TOL[dtype])
    # New step: new queries, cache, table and lengths, written in place.
    q.copy_(q1)
    kv.zero_()
    kv[:, : kv1.shape[1]] = kv1
    bt.zero_()
    bt[:, : bt1.shape[1]] = bt1
    sl.copy_(sl1)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), reference(q, kv, bt, sl, hd ** -0.5), **TOL[dtype])
