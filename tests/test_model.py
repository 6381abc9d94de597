"""Paged Llama: KV write, decode/prefill attention vs a dense reference, transformers parity."""
import dataclasses
import math

import pytest
import torch

from zos import PAD_SLOT_ID
from zos.serving.models import (
    allocate_kv_cache,
    decode_attention,
    from_hf_model,
    prefill_attention,
    store_kv,
    torch_ops,
    weights,
)

from helpers import DEVICE as DEV
from helpers import attention_meta, require_smollm2, to_device

I32, I64 = torch.int32, torch.int64


def _tables(seq_lens, bs, num_kv_blocks, width, gen):
    """Random non-contiguous block table [R, width] (unused columns: random stale ids)."""
    perm = (torch.randperm(num_kv_blocks - 1, generator=gen) + 1).tolist()
    table = torch.randint(1, num_kv_blocks, (len(seq_lens), width), generator=gen, dtype=I32)
    for r, sl in enumerate(seq_lens):
        nb = -(-sl // bs)
        table[r, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=I32)
    return table


def _fill(cache, table, r, kv, bs):
    """Write a request's dense K/V ([2, L, H, D]) into the cache by plain indexing."""
    for pos in range(kv.shape[1]):
        cache[:, table[r, pos // bs], pos % bs] = kv[:, pos]


def _dense(q, k, v, q_pos, scale):
    """Dense causal GQA reference: q [L, Hq, D] at positions q_pos, k/v [S, Hkv, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    s = s.masked_fill(torch.arange(k.shape[0])[None, None] > q_pos[None, :, None], -math.inf)
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).float()


def _to(meta):
    """Copy of meta with its tensors on DEV."""
    return to_device(meta, DEV)


@pytest.mark.parametrize("strided_slots", [False, True])
@pytest.mark.parametrize("num_tokens", [5, 17])
def test_store_kv(num_tokens, strided_slots):
    gen = torch.Generator().manual_seed(num_tokens)
    cache = torch.randn(2, 6, 4, 3, 8, generator=gen).to(DEV)
    big = torch.randn(num_tokens, 2, 3, 8, generator=gen).to(DEV)
    k, v = big[:, 0], big[:, 1]  # row-strided views, as from a fused projection
    slots = torch.randperm(24, generator=gen)[:num_tokens].to(I64)
    slots[::3] = PAD_SLOT_ID
    slots = slots.to(DEV)
    if strided_slots:  # a column of a wider tensor: read by index, not by offset
        slots = torch.stack([slots, torch.full_like(slots, 5)], 1)[:, 0]
    ref = cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            ref[0].view(24, 3, 8)[s], ref[1].view(24, 3, 8)[s] = k[t], v[t]
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, ref)
    with pytest.raises(TypeError, match="slot_mapping"):
        store_kv(k, v, cache, slots.to(I32))
    with pytest.raises(TypeError, match="store_kv: k must be"):
        store_kv(k.double(), v, cache, slots)
    with pytest.raises(ValueError, match="v must be"):
        store_kv(k, v[:, :2], cache, slots)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("q_len", [1, 2])
def test_decode_attention(q_len, impl):
    """Uniform-decode attention (zos's Triton paged attention, and the torch ops the model runs
    on a CPU) against a dense causal reference."""
    attend = decode_attention if impl == "triton" else torch_ops.decode_attention
    gen = torch.Generator().manual_seed(q_len)
    bs, hq, hkv, d, nb = 4, 6, 2, 8, 40
    seq_lens = [1, 4, 8, 13, 7, 2] if q_len == 1 else [2, 4, 8, 13, 7, 3]
    width = max(-(-s // bs) for s in seq_lens) + 1
    cache = torch.randn(2, nb, bs, hkv, d, generator=gen)
    table = _tables(seq_lens, bs, nb, width, gen)
    table = torch.cat([table, torch.zeros(1, width, dtype=I32)])  # dummy row: null block 0
    cache[:, 0] = 0
    kvs = [torch.randn(2, s, hkv, d, generator=gen) for s in seq_lens]
    for r, kv in enumerate(kvs):
        _fill(cache, table, r, kv, bs)
    rows = len(seq_lens) + 1
    q = torch.randn(rows * q_len, hq, d, generator=gen)
    meta = attention_meta(torch.full((rows * q_len,), PAD_SLOT_ID, dtype=I64),
                          torch.tensor(seq_lens + [1], dtype=I32),
                          torch.arange(rows + 1, dtype=I32) * q_len, table)
    out = attend(q.to(DEV), cache.to(DEV), _to(meta), d ** -0.5).cpu()
    for r, (s, kv) in enumerate(zip(seq_lens, kvs)):
        rq = slice(r * q_len, (r + 1) * q_len)
        ref = _dense(q[rq], kv[0], kv[1], torch.arange(s - q_len, s), d ** -0.5)
        torch.testing.assert_close(out[rq], ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out[-q_len:]).all()


def test_prefill_attention():
    gen = torch.Generator().manual_seed(7)
    bs, hq, hkv, d, nb = 4, 4, 1, 16, 32
    seq_lens, q_lens = [9, 13, 4, 16, 1], [9, 5, 1, 16, 1]  # full, chunked, 1-token, exact blocks
    cache = torch.randn(2, nb, bs, hkv, d, generator=gen)
    table = _tables(seq_lens, bs, nb, 5, gen)
    kvs = [torch.randn(2, s, hkv, d, generator=gen) for s in seq_lens]
    for r, kv in enumerate(kvs):
        _fill(cache, table, r, kv, bs)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    qsl = torch.tensor([0] + q_lens, dtype=I32).cumsum(0).to(I32)
    meta = attention_meta(torch.zeros(sum(q_lens), dtype=I64), torch.tensor(seq_lens, dtype=I32),
                          qsl, table, query_lens_host=q_lens, seq_lens_host=seq_lens)
    out = prefill_attention(q.to(DEV), cache.to(DEV), _to(meta), 0.3).cpu()
    for r, (s, ql, kv) in enumerate(zip(seq_lens, q_lens, kvs)):
        rq = slice(int(qsl[r]), int(qsl[r + 1]))
        ref = _dense(q[rq], kv[0], kv[1], torch.arange(s - ql, s), 0.3)
        torch.testing.assert_close(out[rq], ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="query_lens_host"):
        prefill_attention(q, cache, dataclasses.replace(meta, query_lens_host=None,
                                                       seq_lens_host=None), 0.3)


class PagedDriver:
    """Tiny hand-written engine: shuffled block pool, packed prefill, padded decode batches."""

    def __init__(self, model, num_kv_blocks=64, block_size=4, width=8, seed=0):
        c = model.config
        self.model, self.bs, self.width = model, block_size, width
        self.caches = allocate_kv_cache(c.num_hidden_layers, num_kv_blocks, block_size,
                                        c.num_key_value_heads, c.head_dim, torch.float32, DEV)
        gen = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_kv_blocks - 1, generator=gen) + 1).tolist()
        self.blocks, self.lens = {}, {}

    def _row(self, rid, n_new):
        """Reserve slots for n_new tokens of request rid; return (positions, slots, table row)."""
        blocks, start = self.blocks.setdefault(rid, []), self.lens.get(rid, 0)
        pos = list(range(start, start + n_new))
        while len(blocks) * self.bs < start + n_new:
            blocks.append(self.free.pop())
        self.lens[rid] = start + n_new
        row = blocks + [0] * (self.width - len(blocks))
        return pos, [blocks[p // self.bs] * self.bs + p % self.bs for p in pos], row

    def step(self, chunks, pad_rows=0, prefill=True):
        """chunks: [(rid, token ids)]; returns float32 logits of each chunk's last token."""
        ids, pos, slots, table, qls = [], [], [], [], []
        for rid, toks in chunks:
            p, s, row = self._row(rid, len(toks))
            ids, pos, slots, table = ids + toks, pos + p, slots + s, table + [row]
            qls.append(len(toks))
        sls = [self.lens[rid] for rid, _ in chunks] + [1] * pad_rows  # dummy rows at the tail
        ids, pos = ids + [0] * pad_rows, pos + [0] * pad_rows
        slots = slots + [PAD_SLOT_ID] * pad_rows
        table, qls = table + [[0] * self.width] * pad_rows, qls + [1] * pad_rows
        meta = _to(attention_meta(
            torch.tensor(slots, dtype=I64), torch.tensor(sls, dtype=I32),
            torch.tensor([0] + qls, dtype=I32).cumsum(0).to(I32), torch.tensor(table, dtype=I32),
            query_lens_host=qls if prefill else None, seq_lens_host=sls if prefill else None))
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids, dtype=I64, device=DEV),
                                torch.tensor(pos, dtype=I32, device=DEV), self.caches, meta,
                                is_prefill=prefill)
            last = torch.tensor(qls[:len(chunks)], device=DEV).cumsum(0) - 1
            return self.model.compute_logits(hidden[last]).cpu()


def _greedy(drv, prompts, n_new, bucket):
    """Packed prefill (prompt 1 chunked in two steps), then n_new - 1 padded decode steps."""
    first = drv.step([(0, prompts[0]), (1, prompts[1][:3])])[:1]
    rest = drv.step([(1, prompts[1][3:])] + [(i, p) for i, p in enumerate(prompts) if i > 1])
    logits = [torch.cat([first, rest])]
    toks = [logits[0].argmax(-1).tolist()]
    for _ in range(n_new - 1):
        chunks = [(i, [t]) for i, t in enumerate(toks[-1])]
        logits.append(drv.step(chunks, pad_rows=bucket - len(prompts), prefill=False))
        toks.append(logits[-1].argmax(-1).tolist())
    return torch.stack(logits, 1), torch.tensor(toks).T  # [R, n_new, V], [R, n_new]


@pytest.mark.parametrize("tied", [False, True])
def test_small_llama_matches_transformers(tied):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    cfg = HFConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500.0,
                   max_position_embeddings=128, initializer_range=0.1, tie_word_embeddings=tied,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf = HFLlama(cfg).eval().to(DEV)
    model = from_hf_model(hf, device=DEV)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 11, 8)]
    n_new = 7
    logits, toks = _greedy(PagedDriver(model), prompts, n_new, bucket=4)
    for r, p in enumerate(prompts):
        full = torch.tensor([p + toks[r].tolist()], device=DEV)
        with torch.no_grad():
            ref = hf(full).logits[0, len(p) - 1:len(p) - 1 + n_new].cpu()
            out = hf.generate(full[:, :len(p)], attention_mask=torch.ones_like(full[:, :len(p)]),
                              do_sample=False, max_new_tokens=n_new).cpu()
        torch.testing.assert_close(logits[r], ref, atol=1e-4, rtol=1e-4)
        assert out[0, len(p):].tolist() == toks[r].tolist()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(hf_model, tokenizer, our model loaded back from a fresh cache)."""
    require_smollm2()
    hf, tok = weights.load_smollm2_hf()
    hf = hf.to(DEV)
    cache = str(tmp_path_factory.mktemp("zos_cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weights, "load_smollm2_hf", lambda *a, **k: (hf, tok))
        first, _, _ = weights.load_smollm2(cache_dir=cache, device=DEV)
        mp.setattr(weights, "load_smollm2_hf", lambda *a, **k: pytest.fail("GGUF read"))
        model, tok2, hf_config = weights.load_smollm2(cache_dir=cache, device=DEV)
    assert (first.zos_source, model.zos_source) == ("gguf", "cache")
    assert hf_config.num_hidden_layers == 30 and tok2.chat_template == tok.chat_template
    for (n, a), b in zip(first.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), n
    return hf, tok, model


def test_smollm2_greedy_matches_transformers(smollm2):
    hf, tok, model = smollm2
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]  # transformers 5: a BatchEncoding, 4.x: a list
    prompts = [p if isinstance(p, list) else list(p["input_ids"]) for p in prompts]
    n_new = 12
    drv = PagedDriver(model, num_kv_blocks=64, block_size=16, width=5)
    _, toks = _greedy(drv, prompts, n_new, 4)
    eos = model.config.eos_token_id
    for r, p in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor([p], device=DEV)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=n_new).cpu()
        ref = out[0, len(p):].tolist()
        assert toks[r].tolist()[:len(ref)] == ref
        assert len(ref) == n_new or ref[-1] == eos


def test_smollm2_tokens_depend_on_context_and_block_table(smollm2, monkeypatch):
    """With real weights, "both backends agree" means something: every request gets its own
    completion, and a deliberately wrong block table (rows 0 and 1 swapped after each prep)
    changes the tokens. Random std-0.02 weights pass neither check (context-blind output)."""
    from zos import DeviceMetadataBackend
    from zos.serving.engine import Engine, EngineConfig, Request

    _, tok, model = smollm2
    questions = ["Name a red fruit.", "What is 2 + 2?", "Say hello in French."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]
    prompts = [p if isinstance(p, list) else list(p["input_ids"]) for p in prompts]
    cfg = EngineConfig(block_size=16, num_kv_blocks=32, max_num_seqs=4, max_model_len=64,
                       buckets=[4])

    def run() -> dict:
        reqs = [Request(i, list(p), 6) for i, p in enumerate(prompts)]
        return Engine(model, cfg, DEV).run(reqs).outputs

    good = run()
    assert len({tuple(v) for v in good.values()}) == len(prompts), good
    build = DeviceMetadataBackend.build

    def swapped_build(self, padded_size):
        build(self, padded_size)
        bt = self.buffers.block_table
        bt[:2] = bt[:2].flip(0).clone()

    monkeypatch.setattr(DeviceMetadataBackend, "build", swapped_build)
    bad = run()
    assert bad != good
