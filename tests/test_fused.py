"""Fused Llama-layer kernels (zos/serving/models/fused.py) against the plain torch formulas they
replace, and the fused model against the unfused layer composition."""
import pytest
import torch
import torch.nn.functional as F

from zos import PAD_SLOT_ID
from zos.serving.models import allocate_kv_cache, prefill_attention, random_llama, store_kv
from zos.serving.models import fused as fz

from helpers import DEVICE as DEV
from helpers import LLAMA_CFG, attention_meta

F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64
SENTINEL = 1234.5  # exactly representable in every float dtype here
# float32: row reductions in another order than torch (an ulp); bf16: bit-exact on the CPU,
# an ulp of slack for the GPU's reduction order / exp.
TOL = {F32: dict(atol=2e-6, rtol=2e-6), BF16: dict(atol=1e-2, rtol=1e-2)}


# --- torch references: the formulas of the unfused model ---------------------------------------

def ref_rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def ref_rope(x, cos, sin):
    """x [T, H, D], cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def ref_silu_and_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _randn(*shape, gen, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


@pytest.fixture
def tiling(request, monkeypatch):
    """``"gpu_tiling"`` forces the launchers' GPU tiling (one row per program for the norms,
    ~1024 values per RoPE program), so the CPU interpreter also checks the layout the GPU uses
    (at some sizes: many programs are slow there); ``"native"`` keeps the launcher's choice."""
    if request.param == "gpu_tiling":
        monkeypatch.setattr(fz, "interpreted", lambda device: False)
    return request.param


# (num_tokens, tiling): every size natively, two with the GPU tiling.
SIZES = [(0, "native"), (1, "native"), (1, "gpu_tiling"), (5, "native"), (17, "native"),
         (17, "gpu_tiling"), (97, "native")]


# --- rms_norm ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("hidden", [576, 64])
@pytest.mark.parametrize("num_tokens,tiling", SIZES, indirect=["tiling"])
def test_rms_norm(num_tokens, hidden, dtype, tiling):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + hidden)
    x = _randn(num_tokens, hidden, gen=gen, dtype=dtype, scale=3.0)
    res = _randn(num_tokens, hidden, gen=gen, dtype=dtype)
    w = _randn(hidden, gen=gen, dtype=dtype) + 1.0
    eps = 1e-5
    out = fz.rms_norm(x, w, eps)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, ref_rms_norm(x, w, eps), **TOL[dtype])
    x0, res0 = x.clone(), res.clone()
    out, s = fz.rms_norm(x, w, eps, residual=res)
    assert torch.equal(s, x + res)  # one rounding of the sum in x's dtype, as torch
    torch.testing.assert_close(out, ref_rms_norm(x + res, w, eps), **TOL[dtype])
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs not written


def test_rms_norm_strided_rows():
    gen = torch.Generator().manual_seed(3)
    big = _randn(7, 100, gen=gen, dtype=F32)
    x, res = big[:, :40], big[:, 50:90]  # row stride 100
    w = _randn(40, gen=gen, dtype=F32)
    out, s = fz.rms_norm(x, w, 1e-6, residual=res)
    assert torch.equal(s, x + res)
    torch.testing.assert_close(out, ref_rms_norm(x + res, w, 1e-6), **TOL[F32])


# --- rope_and_store_kv -------------------------------------------------------------------------

def _rope_case(num_tokens, hq, hkv, hd, dtype, gen, strided=False):
    width = (hq + 2 * hkv) * hd
    qkv = _randn(num_tokens, width + (8 if strided else 0), gen=gen, dtype=dtype)[:, :width]
    pos = torch.randint(0, 1000, (num_tokens,), generator=gen)
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat((pos[:, None] * inv, pos[:, None] * inv), -1)
    return qkv, emb.cos().to(dtype).to(DEV), emb.sin().to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("hq,hkv,hd", [(9, 3, 64), (4, 2, 16)])
@pytest.mark.parametrize("num_tokens,tiling", SIZES, indirect=["tiling"])
def test_rope_and_store_kv(num_tokens, hq, hkv, hd, dtype, tiling):
    gen = torch.Generator().manual_seed(num_tokens * 100 + hd)
    qkv, cos, sin = _rope_case(num_tokens, hq, hkv, hd, dtype, gen, strided=num_tokens % 2 == 1)
    num_blocks, bs = 40, 4  # 160 slots: room for 97 distinct ones plus untouched ones
    cache = torch.full((2, num_blocks, bs, hkv, hd), SENTINEL, dtype=dtype, device=DEV)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens]
    if num_tokens >= 5:  # padding rows and out-of-range slots write nothing
        slots[1], slots[3] = PAD_SLOT_ID, num_blocks * bs
        slots[-1] = -7
    slots = slots.to(I64).to(DEV)
    qkv0 = qkv.clone()

    q = fz.rope_and_store_kv(qkv, cos, sin, cache, slots, hq, hkv, hd)

    t = num_tokens
    q_ref = ref_rope(qkv[:, :hq * hd].view(t, hq, hd), cos[:, None], sin[:, None])
    k_ref = ref_rope(qkv[:, hq * hd:(hq + hkv) * hd].reshape(t, hkv, hd), cos[:, None],
                     sin[:, None])
    v_ref = qkv[:, (hq + hkv) * hd:].reshape(t, hkv, hd)
    cache_ref = torch.full_like(cache, SENTINEL)
    store_kv(k_ref, v_ref, cache_ref, slots)
    assert q.shape == (t, hq, hd) and q.dtype == dtype and q.is_contiguous()
    assert torch.equal(q, q_ref)  # both products and the sum rounded as torch rounds them
    assert torch.equal(cache, cache_ref)
    assert torch.equal(qkv, qkv0)
    written = ((slots >= 0) & (slots < num_blocks * bs)).sum().item()
    untouched = (cache == SENTINEL).all(-1).all(-1).view(2, -1)  # [2, slots]
    assert untouched.sum().item() == 2 * (num_blocks * bs - written)


# --- silu_and_mul ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("inter", [1536, 7])
@pytest.mark.parametrize("num_tokens,tiling", SIZES, indirect=["tiling"])
def test_silu_and_mul(num_tokens, inter, dtype, tiling):
    gen = torch.Generator().manual_seed(num_tokens * 10 + inter)
    gate_up = _randn(num_tokens, 2 * inter, gen=gen, dtype=dtype, scale=4.0)
    out = fz.silu_and_mul(gate_up)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, ref_silu_and_mul(gate_up), **TOL[dtype])


# --- argument validation -----------------------------------------------------------------------

def test_rms_norm_errors():
    x, w = torch.zeros(3, 8, device=DEV), torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match="^rms_norm: weight"):
        fz.rms_norm(x, torch.ones(9, device=DEV), 1e-5)
    with pytest.raises(TypeError, match="^rms_norm: weight"):
        fz.rms_norm(x, w.to(BF16), 1e-5)
    with pytest.raises(ValueError, match="^rms_norm: x"):
        fz.rms_norm(x[0], w, 1e-5)
    with pytest.raises(TypeError, match="^rms_norm: x"):
        fz.rms_norm(x.to(torch.int32), w, 1e-5)
    with pytest.raises(ValueError, match="^rms_norm: x"):
        fz.rms_norm(torch.zeros(8, 3, device=DEV).T, w, 1e-5)  # column-major
    with pytest.raises(ValueError, match="^rms_norm: residual"):
        fz.rms_norm(x, w, 1e-5, residual=torch.zeros(2, 8, device=DEV))
    with pytest.raises(TypeError, match="^rms_norm: residual"):
        fz.rms_norm(x, w, 1e-5, residual=torch.zeros(3, 8, dtype=BF16, device=DEV))
    with pytest.raises(TypeError, match="^rms_norm: residual"):
        fz.rms_norm(x, w, 1e-5, residual=[0.0] * 8)


def test_silu_and_mul_errors():
    with pytest.raises(ValueError, match="^silu_and_mul: gate_up"):
        fz.silu_and_mul(torch.zeros(3, 7, device=DEV))
    with pytest.raises(ValueError, match="^silu_and_mul: gate_up"):
        fz.silu_and_mul(torch.zeros(3, 2, 4, device=DEV))
    with pytest.raises(TypeError, match="^silu_and_mul: gate_up"):
        fz.silu_and_mul(torch.zeros(3, 8, dtype=I64, device=DEV))


def test_rope_and_store_kv_errors():
    hq, hkv, hd, t = 4, 2, 16, 3
    qkv = torch.zeros(t, (hq + 2 * hkv) * hd, device=DEV)
    cs = torch.zeros(t, hd, device=DEV)
    cache = torch.zeros(2, 4, 4, hkv, hd, device=DEV)
    slots = torch.zeros(t, dtype=I64, device=DEV)
    call = lambda **kw: fz.rope_and_store_kv(**{**dict(
        qkv=qkv, cos=cs, sin=cs, kv_cache=cache, slot_mapping=slots, num_heads=hq,
        num_kv_heads=hkv, head_dim=hd), **kw})
    call()
    for kw, exc, name in [
        (dict(qkv=qkv[:, :-1]), ValueError, "qkv"),
        (dict(qkv=qkv.to(BF16)), TypeError, "cos"),
        (dict(cos=cs[:2]), ValueError, "cos"),
        (dict(sin=cs.to(BF16)), TypeError, "sin"),
        (dict(kv_cache=cache[:, :, :, :1]), ValueError, "kv_cache"),
        (dict(kv_cache=cache.transpose(1, 2)), ValueError, "kv_cache"),
        (dict(kv_cache=cache.to(BF16)), TypeError, "kv_cache"),
        (dict(slot_mapping=slots.to(torch.int32)), TypeError, "slot_mapping"),
        (dict(slot_mapping=slots[:2]), ValueError, "slot_mapping"),
        (dict(head_dim=15, qkv=torch.zeros(t, 8 * 15, device=DEV)), ValueError, "head_dim"),
        (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    ]:
        with pytest.raises(exc, match=f"^rope_and_store_kv: {name}"):
            call(**kw)


# --- the fused model against the unfused composition -------------------------------------------

def _unfused_forward(model, input_ids, positions, caches, meta):
    """The model's forward before fusion (torch RMSNorm / RoPE / SiLU, separate residual adds),
    prefill attention."""
    c = model.config
    hq, hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    x = F.embedding(input_ids, model.embed_tokens)
    t = x.shape[0]
    cos = model.rope_cos.index_select(0, positions).to(x.dtype)[:, None, :]
    sin = model.rope_sin.index_select(0, positions).to(x.dtype)[:, None, :]
    for layer, cache in zip(model.layers, caches):
        ln = layer.input_layernorm
        qkv = F.linear(ref_rms_norm(x, ln.weight, ln.eps), layer.qkv_proj)
        q = ref_rope(qkv[:, :hq * hd].view(t, hq, hd), cos, sin)
        k = ref_rope(qkv[:, hq * hd:(hq + hkv) * hd].view(t, hkv, hd), cos, sin)
        store_kv(k, qkv[:, (hq + hkv) * hd:].view(t, hkv, hd), cache, meta.slot_mapping)
        o = prefill_attention(q, cache, meta, hd ** -0.5)
        x = x + F.linear(o.reshape(t, hq * hd), layer.o_proj)
        ln = layer.post_attention_layernorm
        gate_up = F.linear(ref_rms_norm(x, ln.weight, ln.eps), layer.gate_up_proj)
        x = x + F.linear(ref_silu_and_mul(gate_up), layer.down_proj)
    return ref_rms_norm(x, model.norm.weight, model.norm.eps)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_model_matches_unfused(dtype):
    model = random_llama(LLAMA_CFG, seed=0, dtype=dtype, device=DEV)
    c, bs, n = LLAMA_CFG, 4, 7
    ids = torch.randint(0, c.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    ids, pos = ids.to(DEV), torch.arange(n, device=DEV)
    table = torch.tensor([[3, 1]], dtype=torch.int32, device=DEV)
    slots = (table[0, pos // bs].long() * bs + pos % bs).to(I64)
    meta = attention_meta(slots, torch.tensor([n], dtype=torch.int32, device=DEV),
                          torch.tensor([0, n], dtype=torch.int32, device=DEV), table,
                          query_lens_host=[n], seq_lens_host=[n])
    caches = [allocate_kv_cache(c.num_hidden_layers, 5, bs, c.num_key_value_heads, c.head_dim,
                                dtype, DEV) for _ in range(2)]
    with torch.no_grad():
        out = model(ids, pos, caches[0], meta, is_prefill=True)
        ref = _unfused_forward(model, ids, pos, caches[1], meta)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for a, b in zip(*caches):
        torch.testing.assert_close(a, b, **TOL[dtype])
