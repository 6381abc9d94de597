"""Fused Llama-layer kernels (zos/serving/models/fused.py) against the plain torch formulas they
replace, the model's torch ops for CPUs (zos/serving/models/torch_ops.py) against the Triton
kernels (in Triton's interpreter on a CPU, compiled on CUDA), and the fused model against the
unfused layer composition and against itself on torch ops."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from zos import PAD_SLOT_ID
from zos.serving.models import allocate_kv_cache, prefill_attention, random_llama, store_kv
from zos.serving.models import fused as fz
from zos.serving.models import torch_ops as tops
from zos.serving.models.llama import LlamaForCausalLM

from helpers import DEVICE as DEV
from helpers import LLAMA_CFG, attention_meta, to_device

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
        monkeypatch.setattr(fz, "interpreted", lambda kernel, device: False)
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
    if num_tokens % 2:  # with the strided qkv, a strided slot_mapping (a column of [T, 2])
        slots = torch.stack([slots, torch.zeros_like(slots)], 1)[:, 0]
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

BOTH = pytest.mark.parametrize("ops", [fz, tops], ids=["triton", "torch"])


@BOTH
def test_rms_norm_errors(ops):
    fz = ops
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


@BOTH
def test_silu_and_mul_errors(ops):
    fz = ops
    with pytest.raises(ValueError, match="^silu_and_mul: gate_up"):
        fz.silu_and_mul(torch.zeros(3, 7, device=DEV))
    with pytest.raises(ValueError, match="^silu_and_mul: gate_up"):
        fz.silu_and_mul(torch.zeros(3, 2, 4, device=DEV))
    with pytest.raises(TypeError, match="^silu_and_mul: gate_up"):
        fz.silu_and_mul(torch.zeros(3, 8, dtype=I64, device=DEV))


@BOTH
def test_rope_and_store_kv_errors(ops):
    fz = ops
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


@pytest.mark.parametrize("kernels", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_model_matches_unfused(dtype, kernels):
    model = random_llama(LLAMA_CFG, seed=0, dtype=dtype, device=DEV)
    model.kernels = kernels
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


# --- torch ops (what the model runs on a CPU) against the Triton kernels ----------------------

@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("num_tokens", [0, 1, 6, 13])
def test_torch_ops_match_triton(num_tokens, dtype):
    """Each torch op gives the Triton kernel's values on tiny shapes: RoPE and the KV it writes
    exactly, the norm and SiLU within the kernels' tolerance against torch; inputs unwritten."""
    gen = torch.Generator().manual_seed(100 + num_tokens)
    hq, hkv, hd, hidden, inter = 4, 2, 16, 48, 7
    x = _randn(num_tokens, hidden, gen=gen, dtype=dtype, scale=3.0)
    res = _randn(num_tokens, hidden, gen=gen, dtype=dtype)
    w = _randn(hidden, gen=gen, dtype=dtype) + 1.0
    torch.testing.assert_close(tops.rms_norm(x, w, 1e-5), fz.rms_norm(x, w, 1e-5), **TOL[dtype])
    (a, sa), (b, sb) = tops.rms_norm(x, w, 1e-5, res), fz.rms_norm(x, w, 1e-5, res)
    assert torch.equal(sa, sb)
    torch.testing.assert_close(a, b, **TOL[dtype])
    gate_up = _randn(num_tokens, 2 * inter, gen=gen, dtype=dtype, scale=4.0)
    torch.testing.assert_close(tops.silu_and_mul(gate_up), fz.silu_and_mul(gate_up),
                               **TOL[dtype])
    qkv, cos, sin = _rope_case(num_tokens, hq, hkv, hd, dtype, gen, strided=True)
    slots = torch.randperm(24, generator=gen)[:num_tokens]
    if num_tokens >= 6:
        slots[0], slots[2], slots[5] = PAD_SLOT_ID, 24, -3  # write nothing
    slots = slots.to(I64).to(DEV)
    caches = [torch.full((2, 6, 4, hkv, hd), SENTINEL, dtype=dtype, device=DEV) for _ in "ab"]
    qkv0 = qkv.clone()
    qa = tops.rope_and_store_kv(qkv, cos, sin, caches[0], slots, hq, hkv, hd)
    qb = fz.rope_and_store_kv(qkv, cos, sin, caches[1], slots, hq, hkv, hd)
    assert qa.shape == (num_tokens, hq, hd) and qa.is_contiguous()
    assert torch.equal(qa, qb) and torch.equal(caches[0], caches[1])
    assert torch.equal(qkv, qkv0)


def _paged_case(gen, seq_lens, q_len, bs=4, hq=6, hkv=2, hd=8, nb=24, null_block=0):
    """A cache of random K/V, a block table of distinct random blocks per row (columns past a
    row's blocks: ``null_block``), q for ``q_len`` tokens per row."""
    width = max(-(-s // bs) for s in seq_lens) + 1
    cache = torch.randn(2, nb, bs, hkv, hd, generator=gen)
    perm = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    table = torch.full((len(seq_lens), width), null_block, dtype=torch.int32)
    for r, s in enumerate(seq_lens):
        for j in range(-(-s // bs)):
            table[r, j] = perm.pop()
    q = torch.randn(len(seq_lens) * q_len, hq, hd, generator=gen)
    meta = attention_meta(torch.full((len(q),), PAD_SLOT_ID, dtype=I64),
                          torch.tensor(seq_lens, dtype=torch.int32),
                          torch.arange(len(seq_lens) + 1, dtype=torch.int32) * q_len, table)
    return q, cache, meta


@pytest.mark.parametrize("q_len", [1, 2, 3])
@pytest.mark.parametrize("seq_lens", [[1], [5, 1, 12, 7], [16, 3, 1]])
def test_torch_decode_attention_matches_triton(seq_lens, q_len):
    """Attention through the block table in torch against zos's Triton paged attention, every
    row included (dummy rows with seq_len 1; with q_len > 1 their negative positions attend to
    key 0 in both), on a table whose unused columns point outside the pool."""
    from zos.serving.models import decode_attention

    gen = torch.Generator().manual_seed(len(seq_lens) * 10 + q_len)
    seq_lens = [max(s, 1) for s in seq_lens]
    q, cache, meta = _paged_case(gen, seq_lens, q_len, null_block=24)  # 24: past the pool
    meta = to_device(meta, DEV)
    q, cache = q.to(DEV), cache.to(DEV)
    ours = tops.decode_attention(q, cache, meta, 0.35)
    triton_meta = dataclasses.replace(meta, block_table=meta.block_table.clamp(max=23))
    ref = decode_attention(q, cache, triton_meta, 0.35)  # Triton reads only the used columns
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    bad = dataclasses.replace(meta, seq_lens=torch.zeros_like(meta.seq_lens))
    with pytest.raises(ValueError, match="^decode_attention: seq_lens must be in"):
        tops.decode_attention(q, cache, bad, 0.35)


def _model_pair(dtype):
    """The small random Llama twice, one on the Triton kernels, one on the torch ops."""
    models = {}
    for kernels in ("triton", "torch"):
        m = random_llama(LLAMA_CFG, seed=0, dtype=dtype, device=DEV)
        m.kernels = kernels
        models[kernels] = m
    return models


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_model_torch_kernels_match_triton(dtype):
    """A packed prefill of two requests, then two padded decode steps (a dummy row each), on the
    Triton kernels and on the torch ops: same hidden states (within the kernels' tolerance),
    same KV caches, same greedy tokens (float32; in bfloat16 one rounding apart in a norm moves
    a value by an ulp, which the next layers carry, and a near tie could flip a token)."""
    c, bs = LLAMA_CFG, 4
    out = {}
    for kernels, model in _model_pair(dtype).items():
        caches = allocate_kv_cache(c.num_hidden_layers, 8, bs, c.num_key_value_heads,
                                   c.head_dim, dtype, DEV)
        table = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32, device=DEV)
        gen = torch.Generator().manual_seed(5)
        lens = [7, 3]
        ids = torch.randint(0, c.vocab_size, (sum(lens),), generator=gen).to(DEV)
        pos = torch.cat([torch.arange(n) for n in lens]).to(DEV)
        row = torch.tensor([0] * lens[0] + [1] * lens[1], device=DEV)
        slots = (table[row, pos // bs].long() * bs + pos % bs)
        meta = attention_meta(slots, torch.tensor(lens, dtype=torch.int32, device=DEV),
                              torch.tensor([0, 7, 10], dtype=torch.int32, device=DEV), table,
                              query_lens_host=lens, seq_lens_host=lens)
        hidden, tokens = [], []
        with torch.no_grad():
            h = model(ids, pos, caches, meta, is_prefill=True)[[6, 9]]
            hidden.append(h)
            nxt = model.compute_logits(h).argmax(-1)
            for step in range(2):  # decode: rows 0, 1 real, row 2 a dummy row
                p = torch.tensor([lens[0] + step, lens[1] + step, 0], device=DEV)
                bt = torch.cat([table, torch.zeros(1, 3, dtype=torch.int32, device=DEV)])
                sl = torch.cat([table[[0, 1], p[:2] // bs].long() * bs + p[:2] % bs,
                                torch.tensor([PAD_SLOT_ID], device=DEV)]).to(I64)
                dmeta = attention_meta(sl, (p + 1).to(torch.int32).clamp(min=1).where(
                    torch.tensor([True, True, False], device=DEV), 1).to(torch.int32),
                    torch.arange(4, dtype=torch.int32, device=DEV), bt)
                x = torch.cat([nxt, torch.zeros(1, dtype=nxt.dtype, device=DEV)])
                h = model(x, p, caches, dmeta, is_prefill=False)
                hidden.append(h)
                nxt = model.compute_logits(h[:2]).argmax(-1)
                tokens.append(nxt.tolist())
        out[kernels] = hidden, caches, tokens
    (ht, ct, tt), (hc, cc, tc) = out["triton"], out["torch"]
    tol = TOL[F32] if dtype == F32 else dict(atol=4e-2, rtol=2e-2)  # bf16: an ulp carried
    for a, b in zip(ht, hc):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(ct, cc):
        torch.testing.assert_close(a, b, **tol)
    if dtype == F32:
        assert tt == tc


@pytest.mark.parametrize("backend", ["host", "zos"])
def test_engine_tokens_same_on_torch_and_triton_kernels(backend):
    """The engine's tokens, both metadata backends, with the model on Triton kernels and on
    torch ops: identical (prefill, preemption by recompute and padded decode steps)."""
    from zos.serving.engine import Engine, EngineConfig, Request

    cfg = EngineConfig(block_size=4, num_kv_blocks=9, max_num_seqs=3, max_model_len=24,
                       backend=backend, use_cuda_graph=False, bucket_policy=None)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, LLAMA_CFG.vocab_size, (n,), generator=gen).tolist()
               for n in (5, 9, 2, 7)]
    outs = {}
    for kernels, model in _model_pair(F32).items():
        engine = Engine(model, cfg, DEV)
        res = engine.run([Request(i, list(p), 8) for i, p in enumerate(prompts)])
        outs[kernels] = res.outputs, res.totals["preemptions"]
    assert outs["torch"] == outs["triton"]
    assert outs["torch"][1] >= 1  # the tight pool preempted: recompute is covered too


def test_model_kernels_argument():
    assert LlamaForCausalLM(LLAMA_CFG, kernels="torch").kernels == "torch"
    with pytest.raises(ValueError, match="kernels: expected one of"):
        LlamaForCausalLM(LLAMA_CFG, kernels="cuda")
