"""Tests of zos.varlen_attention.varlen_attention (packed causal attention, keys through slots).

The reference is plain torch in float64: per sequence, its keys gathered through the slot
index, each query at position kv_len - q_len + i attending to keys 0 .. position, softmax.
Every cache slot no sequence owns holds NaN, so a read outside a sequence's keys shows up;
rows of no sequence (padding) must stay as ``out`` had them. On CPU the kernel runs in Triton's
interpreter (slow): shapes are small and the cases a representative choice.
"""
import pytest
import torch

from zos.varlen_attention import varlen_attention

from helpers import DEVICE

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def reference(q, k_cache, v_cache, kv_slots, cu_q, cu_k, scale):
    """float64 attention of each sequence's queries over its own keys (the docstring's rule);
    rows of no sequence are NaN (never compared)."""
    t_q, hq, hd = q.shape
    group = hq // k_cache.shape[1]
    out = torch.full((t_q, hq, hd), float("nan"), dtype=torch.float64)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        slots = kv_slots[k0:k1].long().cpu()
        k = k_cache.cpu()[slots].double().repeat_interleave(group, dim=1)  # [kv_len, hq, hd]
        v = v_cache.cpu()[slots].double().repeat_interleave(group, dim=1)
        for i in range(q1 - q0):
            pos = (k1 - k0) - (q1 - q0) + i
            scores = torch.einsum("hd,khd->hk", q[q0 + i].cpu().double(), k[: pos + 1]) * scale
            out[q0 + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[: pos + 1])
    return out


def make_case(dtype, hq, hkv, hd, seqs, *, pad_rows=0, pad_seqs=0, slot_dtype=torch.int64,
              seed=0):
    """``seqs``: (q_len, kv_len) per sequence. Keys of every sequence in shuffled slots of a
    cache whose other slots are NaN; ``pad_rows`` query rows after the last sequence and
    ``pad_seqs`` empty sequences (q_len = kv_len = 0) at the end, as transformers pads a graphed
    step. Returns (q, k_cache, v_cache, kv_slots, cu_q, cu_k)."""
    g = torch.Generator().manual_seed(seed)
    total_k = sum(k for _, k in seqs)
    num_slots = total_k + 7
    k_cache = torch.full((num_slots, hkv, hd), float("nan"))
    v_cache = torch.full((num_slots, hkv, hd), float("nan"))
    slots = torch.randperm(num_slots, generator=g)[:total_k]
    k_cache[slots] = torch.randn(total_k, hkv, hd, generator=g)
    v_cache[slots] = torch.randn(total_k, hkv, hd, generator=g)
    t_q = sum(q for q, _ in seqs) + pad_rows
    q = torch.randn(t_q, hq, hd, generator=g)
    cu_q, cu_k = [0], [0]
    for q_len, kv_len in list(seqs) + [(0, 0)] * pad_seqs:
        cu_q.append(cu_q[-1] + q_len)
        cu_k.append(cu_k[-1] + kv_len)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return (q.to(dtype).to(DEVICE), k_cache.to(dtype).to(DEVICE), v_cache.to(dtype).to(DEVICE),
            slots.to(slot_dtype).to(DEVICE), torch.tensor(cu_q, **i32), torch.tensor(cu_k, **i32))


CASES = [
    # (hq, hkv, hd, [(q_len, kv_len), ...]) : what the case covers
    (4, 2, 16, [(5, 5)]),  # one fresh prefill, q_len == kv_len
    (6, 2, 16, [(3, 11), (1, 7), (9, 9), (1, 1)]),  # chunk after a past, decode rows, GQA 3
    (9, 3, 64, [(70, 70), (1, 40), (33, 100)]),  # SmolLM2's heads; tiles past one BLOCK_Q
    (4, 4, 24, [(2, 2), (0, 5), (17, 40)]),  # MHA, head_dim not a power of 2, an empty query
    (8, 1, 16, [(1, 3)] * 9 + [(12, 30)]),  # MQA group 8, many one-token rows
    # more sequences than the kernel searches at once (128): tiles found across chunks
    (2, 1, 16, [(1, 2)] * 130 + [(0, 4), (9, 12)] + [(1, 1)] * 5 + [(40, 41)]),
]


@pytest.mark.parametrize("hq,hkv,hd,seqs", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(hq, hkv, hd, seqs, dtype):
    q, kc, vc, slots, cu_q, cu_k = make_case(dtype, hq, hkv, hd, seqs, seed=len(seqs) + hd)
    scale = hd ** -0.5
    got = varlen_attention(q, kc, vc, slots, cu_q, cu_k, scale)
    want = reference(q, kc, vc, slots, cu_q, cu_k, scale)
    torch.testing.assert_close(got.double().cpu(), want, **TOL[dtype])


def test_strided_query_and_float16():
    """q as transformers' attention passes it (``query[0].transpose(0, 1)``: a strided view of
    ``[num_heads, T_q, head_dim]``), in float16."""
    seqs = [(6, 10), (1, 4), (3, 3)]
    q, kc, vc, slots, cu_q, cu_k = make_case(torch.float16, 6, 2, 16, seqs, seed=5)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, head-major storage
    assert not q_t.is_contiguous()
    got = varlen_attention(q_t, kc, vc, slots, cu_q, cu_k, 0.25)
    want = reference(q, kc, vc, slots, cu_q, cu_k, 0.25)
    torch.testing.assert_close(got.double().cpu(), want, **TOL[torch.float16])


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_padding_rows_and_sequences_untouched(slot_dtype):
    """A padded step (rows past cu_q[-1], empty sequences past the real ones, as transformers'
    graphs pad; kv_slots longer than cu_k[-1], its tail stale: under graphs zos passes
    transformers' whole read-index row, and the tail here names the NaN slots): real rows match
    the reference, padding rows keep out's values."""
    seqs = [(4, 9), (1, 6), (7, 7)]
    q, kc, vc, slots, cu_q, cu_k = make_case(torch.float32, 4, 2, 16, seqs, pad_rows=5,
                                             pad_seqs=3, slot_dtype=slot_dtype)
    owned = set(slots.tolist())
    stale = [i for i in range(kc.shape[0]) if i not in owned] * 3
    slots = torch.cat([slots, torch.tensor(stale, dtype=slot_dtype, device=slots.device)])
    out = torch.full_like(q, 7.0)
    got = varlen_attention(q, kc, vc, slots, cu_q, cu_k, 0.25, out=out)
    assert got is out
    want = reference(q, kc, vc, slots, cu_q, cu_k, 0.25)
    real = int(cu_q[-1])
    torch.testing.assert_close(got[:real].double().cpu(), want[:real], **TOL[torch.float32])
    assert (got[real:] == 7.0).all()


def test_default_out_zeroes_padding_rows():
    q, kc, vc, slots, cu_q, cu_k = make_case(torch.float32, 2, 1, 16, [(3, 3)], pad_rows=2)
    got = varlen_attention(q, kc, vc, slots, cu_q, cu_k, 0.5)
    assert got.shape == q.shape and (got[3:] == 0).all() and torch.isfinite(got[:3]).all()


def _args():
    return list(make_case(torch.float32, 4, 2, 16, [(2, 3)])) + [0.25]


@pytest.mark.parametrize("index,value,err,match", [
    (0, torch.zeros(2, 4), ValueError, "q must be"),
    (1, torch.zeros(5, 2, 16, dtype=torch.float16), ValueError, "v_cache must match"),
    (3, torch.zeros(3, dtype=torch.float32), ValueError, "kv_slots must be 1-D int32 or int64"),
    (4, torch.tensor([0, 2], dtype=torch.int64), TypeError, "cu_seqlens_q must be int32"),
    (4, torch.tensor([0], dtype=torch.int32), ValueError, "num_seqs >= 1"),
    (5, torch.tensor([0, 1, 3], dtype=torch.int32), ValueError, "cu_seqlens_k shape"),
    (6, 0.0, ValueError, "scale must be finite"),
    (6, "0.25", TypeError, "scale must be a Python float"),
    (0, [1.0], TypeError, "q must be a torch.Tensor"),
    # strided views, made on the device (a copy to it would be contiguous)
    (3, lambda d: torch.zeros(6, dtype=torch.int64, device=d)[::2], ValueError,
     "kv_slots must be contiguous"),
    (4, lambda d: torch.tensor([0, 9, 2, 9], dtype=torch.int32, device=d)[::2], ValueError,
     "cu_seqlens_q must be contiguous"),
])
def test_bad_arguments(index, value, err, match):
    args = _args()
    if isinstance(value, torch.Tensor):
        value = value.to(args[1].device)
    elif callable(value):
        value = value(args[1].device)
    args[index] = value
    with pytest.raises(err, match=match):
        varlen_attention(*args)


def test_bad_heads_and_dtype():
    q, kc, vc, slots, cu_q, cu_k = _args()[:6]
    with pytest.raises(ValueError, match="multiple of k_cache num_kv_heads"):
        varlen_attention(q[:, :3], kc, vc, slots, cu_q, cu_k, 0.25)
    with pytest.raises(TypeError, match="q dtype"):
        varlen_attention(q.double(), kc, vc, slots, cu_q, cu_k, 0.25)
    with pytest.raises(ValueError, match="out must have q's shape"):
        varlen_attention(q, kc, vc, slots, cu_q, cu_k, 0.25, out=q[:1])
