"""Faults of zos inside transformers' continuous batching (issue 15), on a tiny random Llama:

1. a carried request whose earlier block columns the runner rewrote (transformers' prefix
   sharing after a CPU-offload restore; a runner that swaps, shares and frees earlier blocks of
   live requests) must decode through the runner's table, not zos's stale one;
2. enable_zos must not change the model beyond a continuous-batching run (tests further down).

Needs transformers 5.17.0 or 5.25.0 (the ``hf`` extra); skipped with another version."""
import zos._interpret  # noqa: F401  (before transformers imports triton)

import types

import numpy as np
import pytest
import torch

from zos import DecodeBuffers, DeviceMetadataBackend, HostMetadataBackend, PaddingProfile

from helpers import DEVICE, require_transformers

require_transformers()  # before the transformers imports below

from test_hf import (  # noqa: E402
    cb_config,
    gen_config,
    prompts,
    reference,
    run_generate_batch,
    tiny_llama,
)
from transformers.generation.continuous_batching import (  # noqa: E402
    continuous_api,
    offloading_manager,
)

from zos.integrations.hf_internals import TF517, internals  # noqa: E402
from zos.integrations.hf_ios import zos_ios_classes  # noqa: E402
from zos.integrations.hf_rows import ZosDecodeRows  # noqa: E402
from zos.integrations.transformers import (  # noqa: E402
    ZosOptions,
    disable_zos,
    enable_zos,
)


@pytest.fixture
def cpu_offload_pool(monkeypatch):
    """transformers pins its CPU swap pool (``torch.empty(..., pin_memory=True)``), which needs
    an accelerator; without CUDA the pool is allocated unpinned (nothing else changes)."""
    if torch.cuda.is_available():
        return
    real = offloading_manager.torch

    def empty(*args, pin_memory=False, **kw):
        return real.empty(*args, **kw)

    proxy = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real)
                                     if not k.startswith("__")})
    proxy.empty = empty
    monkeypatch.setattr(offloading_manager, "torch", proxy)


@pytest.fixture
def zos_step_log(monkeypatch):
    """Every zos step's DecodeStep, in order (wraps ZosDecodeRows.stage)."""
    steps, original = [], ZosDecodeRows.stage

    def logging_stage(rows, built, **kw):
        steps.append(built.step)
        return original(rows, built, **kw)

    monkeypatch.setattr(ZosDecodeRows, "stage", logging_stage)
    return steps


@pytest.mark.parametrize("seed", [1, 3])
def test_prefix_sharing_after_cpu_offload(seed, monkeypatch, cpu_offload_pool, zos_step_log):
    """The issue's scenario: 16 blocks of 4 tokens, 8 requests, 4 per batch, a CPU swap pool of
    10 blocks, block sharing on (the default). transformers offloads requests, restores them
    into new blocks and then swaps their complete blocks for identical shared ones in place,
    freeing the others, which it hands out again. Greedy tokens with zos equal transformers'
    own and generate() (before the fix, one request of each seed decoded from a reused block).
    In 5.25's runs of this scenario no carried row's list changed (0 rewritten rows for both
    seeds), so the rewrite count is checked on 5.17 only;
    test_identical_requests_share_their_completed_blocks rewrites rows on both."""
    evicted = []
    original = offloading_manager.OffloadingManager.offload_requests

    def counting(self):
        n = original(self)
        evicted.append(n)
        return n

    monkeypatch.setattr(offloading_manager.OffloadingManager, "offload_requests", counting)
    model = tiny_llama(seed)
    lens = torch.randint(1, 16, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
    inputs = prompts(seed, lens, model.config.vocab_size)
    kw = dict(num_blocks=16, block_size=4, max_requests_per_batch=4, cpu_offload_space=1e-5)
    want = [reference(model, p, 16) for p in inputs]
    theirs, _ = run_generate_batch(model, inputs, 16, zos=False, **kw)
    zos_step_log.clear()
    ours, timings = run_generate_batch(model, inputs, 16, zos=True, **kw)
    assert sum(evicted) > 0, "the pool must be small enough for transformers to offload"
    assert theirs == want
    assert ours == want
    if internals().line == "5.17":
        assert sum(len(s.rewrite_rows) for s in zos_step_log) > 0, "no carried row was rewritten"


@pytest.mark.parametrize("batch_tokens", [10, 32])
def test_identical_requests_share_their_completed_blocks(batch_tokens, zos_step_log):
    """Requests with the same prompt decode the same tokens greedily, so each block they fill
    has a twin; with block sharing on (the default) transformers de-duplicates a block that
    completes, rewriting a live request's block list in place while zos carries the request.
    zos takes the runner's list as the truth for that row (a rewritten row): tokens equal
    generate()'s. With 10 batch tokens the three prefills run one step apart; with 32 together."""
    model = tiny_llama(13)
    inputs = prompts(13, (10,), model.config.vocab_size) * 3
    want = [reference(model, p, 14) for p in inputs]
    ours, timings = run_generate_batch(model, inputs, 14, zos=True, max_batch_tokens=batch_tokens)
    assert ours == want and [p for p, _ in timings].count("zos") > 0
    assert sum(len(s.rewrite_rows) for s in zos_step_log) > 0, "no block was de-duplicated"


def test_runner_moving_earlier_blocks(monkeypatch, zos_step_log):
    """A runner that, before every step, moves one complete block of each live request to a
    free block (copying its K/V, as swap-in or defragmentation would), frees the old block and
    fills it with noise, in place in transformers' list or as a new list (block sharing off, so
    the block manager is a plain free list). Greedy tokens with zos equal generate()."""
    ios_cls = zos_ios_classes()[0]
    original = ios_cls.prepare_batch_tensors
    rng = np.random.default_rng(0)
    moves = []

    def moving(io, requests_in_batch, *args, **kw):
        cache = io.cache
        mover = BlockMover(cache)
        for fs in requests_in_batch:
            rid = fs.state.request_id
            blocks = mover.table.get(rid)
            complete = fs.state.position_offset // mover.page
            if not blocks or complete == 0:
                continue
            c = int(rng.integers(0, complete))
            new = mover.move(blocks[c])
            if new is None:
                continue
            if rng.random() < 0.5:
                blocks[c] = new  # in place: the same list object
            else:
                mover.table[rid] = blocks[:c] + [new] + blocks[c + 1:]
            moves.append(rid)
        return original(io, requests_in_batch, *args, **kw)

    monkeypatch.setattr(ios_cls, "prepare_batch_tensors", moving)
    model = tiny_llama(7)
    inputs = prompts(7, (9, 3, 14, 6, 11), model.config.vocab_size)
    want = [reference(model, p, 12) for p in inputs]
    ours, timings = run_generate_batch(model, inputs, 12, zos=True, num_blocks=48,
                                       allow_block_sharing=False)
    assert len(moves) > 20
    assert ours == want
    assert sum(len(s.rewrite_rows) for s in zos_step_log) > 10


class BlockMover:
    """Moves one block of a live request to a free block of transformers' pool, copying its K/V
    of every layer, then frees the old one and fills its K/V with noise (5.17: its block
    manager's free list and ``copy_cache``; 5.25: its cache pool and the allocator's
    ``copy_blocks``). ``table``: request id -> block list; ``page``: tokens per block."""

    def __init__(self, cache):
        self.cache = cache
        if hasattr(cache, "cache_allocators"):  # 5.25
            self.alloc = cache.cache_allocators["full_attention"]
            self.table, self.page = self.alloc.block_table, self.alloc.tokens_per_page
        else:
            self.alloc = None
            self.table, self.page = cache.group_cache_managers[0].block_table, cache.block_size

    def move(self, old: int) -> int | None:
        """The new block of ``old`` (None, nothing moved, when no block is free)."""
        cache, alloc = self.cache, self.alloc
        if alloc is None:
            bm = cache._block_manager
            if bm.num_free_blocks == 0:
                return None
            (new,) = bm.get_free_blocks(1, None, False, 0)
            cache.copy_cache([old], [new])
            for layer in (*cache.key_cache, *cache.value_cache):
                view = layer.view(-1, cache.block_size, *layer.shape[1:])
                view[old] = torch.randn_like(view[old])
            bm.free_blocks([old], shareable=False)
            return new
        pool = cache.pool
        if pool.count_free_blocks(alloc.index) == 0:
            if pool.num_free_sectors == 0:
                return None
            pool.allocate_sector(alloc.index)
        (new,) = pool.get_free_blocks(alloc.index, 1)
        alloc.copy_blocks([old], [new])
        stride = alloc.block_physical_stride // alloc.tokens_per_page
        for layer in alloc.layer_indices:
            for pages in alloc.get_cache_for_block_table(layer):
                pages[old * stride] = torch.randn_like(pages[old * stride])
        pool.free_blocks(alloc.index, [old])
        return new


# --- carry detection against a fake runner, at the level of the DecodeStep ------------------

class _FakeRunner:
    """Stands for transformers' scheduler and cache manager: request states, one block list per
    request (``block_table``), a free list. Each step it advances every request by one token,
    appends a block when a request crosses one, and rewrites earlier columns of live requests:
    swaps a block for a free one (old one freed), shares another request's block, replaces
    the whole list object, permutes a list in place. Requests leave and arrive."""

    def __init__(self, seed, num_blocks, block_size, max_len):
        self.rng = np.random.default_rng(seed)
        self.block_size, self.max_len = block_size, max_len
        self.free = [int(b) for b in self.rng.permutation(num_blocks)]
        self.block_table, self.live, self.next_rid = {}, [], 0
        self.rewrites = 0

    def _arrive(self):
        pos = int(self.rng.integers(0, 3 * self.block_size))
        need = pos // self.block_size + 1
        if len(self.free) < need + 2:
            return
        state = types.SimpleNamespace(request_id=f"r{self.next_rid}", position_offset=pos,
                                      tokens_to_process=[int(self.rng.integers(0, 97))])
        self.next_rid += 1
        self.block_table[state.request_id] = [self.free.pop() for _ in range(need)]
        self.live.append(state)

    def _rewrite(self, state):
        rng, rid = self.rng, state.request_id
        blocks = self.block_table[rid]
        c = int(rng.integers(0, len(blocks)))
        kind = rng.integers(0, 4)
        others = [b for s in self.live if s is not state for b in self.block_table[s.request_id]]
        if kind == 0 and self.free:  # swap for a free block, free the old one
            self.free.insert(0, blocks[c])
            blocks[c] = self.free.pop()
        elif kind == 1 and others:  # share another request's block
            blocks[c] = others[int(rng.integers(0, len(others)))]
        elif kind == 2 and self.free:  # a new list object (swap-in)
            self.free.insert(0, blocks[c])
            self.block_table[rid] = blocks[:c] + [self.free.pop()] + blocks[c + 1:]
        elif len(blocks) >= 2:  # defragmentation: permuted in place
            blocks[:] = [blocks[i] for i in rng.permutation(len(blocks))]
        else:
            return
        self.rewrites += 1

    def step(self):
        """The FutureRequestState-like rows of the next step, after the runner's changes."""
        rng = self.rng
        for state in list(self.live):
            state.position_offset += 1
            blocks = self.block_table[state.request_id]
            crossed = state.position_offset // self.block_size >= len(blocks)
            if (state.position_offset >= self.max_len or rng.random() < 0.1
                    or (crossed and not self.free)):  # finished (or preempted): blocks freed
                self.live.remove(state)
                self.free[:0] = self.block_table.pop(state.request_id)
                continue
            if crossed:
                blocks.append(self.free.pop())
        for state in self.live:
            if rng.random() < 0.3:
                self._rewrite(state)
        for _ in range(int(rng.integers(0 if self.live else 1, 3))):
            self._arrive()
        rng.shuffle(self.live)
        return [types.SimpleNamespace(state=s, query_length=1, has_new_token=True)
                for s in self.live[:8]]


@pytest.mark.parametrize("kind", ["device", "host"])
@pytest.mark.parametrize("seed", range(3))
def test_carry_detection_with_fake_runner(kind, seed):
    """ZosDecodeRows.build_step against a runner that rewrites earlier blocks of live requests:
    each
    step, staged by either backend, gives exactly the runner's block table (the transformers
    padding profile: the null block past the blocks) and slot mapping; a carried request
    becomes a rewritten row exactly when an earlier column changed."""
    bs, nb, w = 4, 64, 8
    runner = _FakeRunner(seed, nb, bs, w * bs)
    bufs = DecodeBuffers(8, w, bs, device=DEVICE, padding=PaddingProfile.transformers(nb, bs))
    cls = DeviceMetadataBackend if kind == "device" else HostMetadataBackend
    backend = cls(bufs, num_kv_blocks=nb, vocab_size=97)
    rows_state = types.SimpleNamespace(  # what build_step reads of a ZosDecodeRows
        block_size=bs, tfi=TF517(), id_scale=1, buffers=bufs, prev={}, next_id=0,
        cache=types.SimpleNamespace(group_cache_managers=[
            types.SimpleNamespace(block_table=runner.block_table)]))
    held = {}  # request id -> the block list zos was last given for it
    rewritten = 0
    for _ in range(40):
        requests = runner.step()
        built = ZosDecodeRows.build_step(rows_state, requests, None)
        assert built is not None
        step = built.step
        rows_state.prev = built.rows
        new, rw = set(step.new_rows.tolist()), set(step.rewrite_rows.tolist())
        for i, fs in enumerate(requests):
            rid, pos = fs.state.request_id, fs.state.position_offset
            blocks = runner.block_table[rid][: pos // bs + 1]
            before = held.get(rid)
            if i not in new:
                assert (i in rw) == (blocks[: len(before)] != before), (rid, before, blocks)
            held[rid] = list(blocks)
        rewritten += len(rw)
        md = backend.prepare(step)
        n = len(requests)
        want_bt = [held[fs.state.request_id] + [nb] * (w - len(held[fs.state.request_id]))
                   for fs in requests]
        assert md.block_table[:n].tolist() == want_bt
        want_slots = [held[fs.state.request_id][p // bs] * bs + p % bs
                      for fs in requests for p in [fs.state.position_offset]]
        assert md.slot_mapping[:n].tolist() == want_slots
        assert md.positions[:n].tolist() == [fs.state.position_offset for fs in requests]
        held = {fs.state.request_id: held[fs.state.request_id] for fs in requests}
    assert runner.rewrites >= 10 and rewritten >= 5, (runner.rewrites, rewritten)


# --- enable_zos leaves the model as transformers leaves it (issue 15, kind 2) ----------------

def test_generate_after_generate_batch_with_zos_enabled():
    """With zos enabled, transformers' manager runs the model on zos's attention (``paged|zos``,
    ``zos`` in 5.25) and restores
    ``sdpa`` when it stops: ``model.generate()`` after ``generate_batch`` gives generate()'s
    tokens, a second ``generate_batch`` runs zos again, and after ``disable_zos`` one runs
    transformers' decode only; every run's tokens equal generate()."""
    model = tiny_llama(5)
    inputs = prompts(5, (3, 8, 5), model.config.vocab_size)
    want = [reference(model, p, 5) for p in inputs]
    timings, seen = [], []
    ios_cls = zos_ios_classes()[0]

    def run():
        out = model.generate_batch(inputs, generation_config=gen_config(5),
                                   continuous_batching_config=cb_config(), progress_bar=False)
        return [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[1]))]

    original = ios_cls.get_model_kwargs

    def watching(io, *args, **kw):  # the attention the model runs with, during the run
        seen.append(model.config._attn_implementation)
        return original(io, *args, **kw)

    enable_zos(model, ZosOptions(timings=timings))
    try:
        ios_cls.get_model_kwargs = watching
        assert run() == want
        assert set(seen) == {internals().attn} and model.config._attn_implementation == "sdpa"
        assert [reference(model, p, 5) for p in inputs] == want  # generate() works again
        zos_steps = [p for p, _ in timings].count("zos")
        assert zos_steps >= 3
        assert run() == want and [p for p, _ in timings].count("zos") == 2 * zos_steps
    finally:
        ios_cls.get_model_kwargs = original
        disable_zos(model)
    timings.clear()
    assert run() == want and timings == []  # transformers' own decode: zos never called
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("attn,supports_flash", [("sdpa", False), ("cb_sdpa", True),
                                                 ("sdpa", True)])
def test_switch_to_cb_friendly_attn_with_zos(attn, supports_flash, monkeypatch):
    """transformers' own test_switch_to_cb_friendly_attn (tests/generation/
    test_continuous_batching.py) with zos enabled, on a CPU and a tiny Llama: creating the
    manager switches to zos's attention; starting then stopping it restores the original. With
    flash reported available, a flash-capable zos model still goes to zos's attention (zos's
    decode needs it); a persistent manager switches again when reused and restores again."""
    monkeypatch.setattr(continuous_api, "is_flash_attn_2_available", lambda **kw: True)
    tfi = internals()
    attn = tfi.cb_sdpa if attn == "cb_sdpa" else attn  # transformers' CB sdpa of the release
    model = tiny_llama(6)
    model.set_attn_implementation(attn)
    model._supports_flash_attn = supports_flash
    enable_zos(model)
    try:
        manager = model.init_continuous_batching(
            continuous_batching_config=cb_config(num_blocks=8, block_size=32))
        assert model.config._attn_implementation == tfi.attn
        manager.start()
        manager.stop(block=True, keep_for_next_session=True)
        assert model.config._attn_implementation == attn
        again = model.init_continuous_batching()  # the cached manager
        assert again is manager and model.config._attn_implementation == tfi.attn
        again.start()
        again.stop(block=True)
        assert model.config._attn_implementation == attn
    finally:
        model.destroy_cached_continuous_batching_manager()
        disable_zos(model)
