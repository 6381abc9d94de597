"""Padding profiles (zos.buffers.PaddingProfile): validation, and dummy rows written with each
runner's values by both backends over seeded traces (vLLM's slot -1 and null block 0, SGLang's
slot 0, transformers' trash blocks past a pool whose block 0 is handed out)."""
import dataclasses

import numpy as np
import pytest
import torch

from zos import (
    NULL_BLOCK,
    PAD_SLOT_ID,
    BucketTable,
    DecodeBuffers,
    DecodeStep,
    DeviceMetadataBackend,
    HostMetadataBackend,
    PaddingProfile,
)

from helpers import DEVICE, TraceGen

VOCAB = 1000
FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_table", "counts")


def reference(rows, padded, *, bs, w, profile, shift):
    """Rows [0, padded) from the per-request truth: real rows from their request (block ids
    shifted by ``shift``), dummy rows and unused columns from the profile."""
    n = len(rows)
    ids = np.full(padded, profile.pad_token_id, np.int64)
    pos = np.zeros(padded, np.int64)
    slots = np.full(padded, profile.pad_slot_id, np.int64)
    seq = np.full(padded, profile.seq_len_fill, np.int64)
    table = np.full((padded, w), profile.null_block, np.int64)
    for i, r in enumerate(rows):
        blocks = [b + shift for b in r.blocks]
        ids[i], pos[i], seq[i] = r.token, r.pos, r.pos + 1
        table[i, : len(blocks)] = blocks
        slots[i] = blocks[r.pos // bs] * bs + r.pos % bs
    return dict(input_ids=ids, positions=pos, slot_mapping=slots, seq_lens=seq,
                block_table=table, counts=np.array([n, n]))


def shifted(step, shift):
    """``step`` with every block id moved by ``shift`` (the trace hands out ids from 1)."""
    return dataclasses.replace(step, new_block_ids=(step.new_block_ids + shift).astype(np.int32),
                               append_block_ids=(step.append_block_ids + shift).astype(np.int32))


def profiles(num_kv_blocks, bs):
    """(profile, pool given to the backend, block-id shift of the trace): the trace hands out
    ids [1, num_kv_blocks); transformers' pool holds ids [0, num_kv_blocks - 1)."""
    tf = PaddingProfile.transformers(num_kv_blocks - 1, bs)
    return [(PaddingProfile.VLLM, num_kv_blocks, 0),
            (dataclasses.replace(PaddingProfile.SGLANG, seq_len_fill=3, pad_token_id=7),
             num_kv_blocks, 0),
            (tf, num_kv_blocks - 1, -1)]


@pytest.mark.parametrize("kind", ["device", "host"])
@pytest.mark.parametrize("seed,max_num_reqs,bs,w,num_kv_blocks",
                         [(0, 5, 4, 6, 97), (1, 17, 3, 5, 61), (2, 11, 5, 3, 17)])
@pytest.mark.parametrize("which", range(3))
def test_dummy_rows_follow_the_profile(kind, seed, max_num_reqs, bs, w, num_kv_blocks, which):
    profile, pool, shift = profiles(num_kv_blocks, bs)[which]
    bufs = DecodeBuffers(max_num_reqs, w, bs, device=DEVICE, padding=profile)
    assert bufs.padding == profile
    cls = DeviceMetadataBackend if kind == "device" else HostMetadataBackend
    sizes = sorted({1, 2, max_num_reqs // 2 or 1, max_num_reqs})
    backend = cls(bufs, num_kv_blocks=pool, vocab_size=VOCAB, buckets=BucketTable(sizes))
    gen = TraceGen(seed, max_num_reqs=max_num_reqs, block_size=bs, max_blocks=w,
                   num_kv_blocks=num_kv_blocks, vocab=VOCAB)
    padded_seen = 0
    for _ in range(25):
        step, rows = gen.next_step()
        md = backend.prepare(shifted(step, shift))
        want = reference(rows, md.padded_size, bs=bs, w=w, profile=profile, shift=shift)
        for f in FIELDS:
            assert getattr(md, f).cpu().tolist() == want[f].tolist(), f
        padded_seen += md.padded_size - len(rows)
        bufs.sampled[: len(rows)] = torch.from_numpy(gen.sampled(rows)).to(DEVICE)
    assert padded_seen > 0, "the trace must produce dummy rows"


def test_transformers_profile_values():
    p = PaddingProfile.transformers(37, 16)
    assert (p.null_block, p.pad_slot_id, p.seq_len_fill, p.pad_token_id) == (37, 38 * 16, 1, 0)
    assert (PaddingProfile.VLLM.pad_slot_id, PaddingProfile.VLLM.null_block) == (PAD_SLOT_ID,
                                                                                NULL_BLOCK)
    assert PaddingProfile.SGLANG.pad_slot_id == 0


@pytest.mark.parametrize("field,value,match", [
    ("pad_slot_id", -2, "pad_slot_id must be -1"), ("null_block", -1, "null_block must be >= 0"),
    ("seq_len_fill", 0, "seq_len_fill must be >= 1"), ("pad_token_id", -1, "pad_token_id"),
])
def test_profile_rejects_bad_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        PaddingProfile("bad", **{field: value})
    with pytest.raises(TypeError, match=field):
        PaddingProfile("bad", **{field: 1.0})


@pytest.mark.parametrize("field,value", [
    ("pad_slot_id", 2 ** 63), ("null_block", 2 ** 31), ("seq_len_fill", 2 ** 31),
    ("pad_token_id", 2 ** 31), ("pool_start", 2 ** 31)])
def test_profile_rejects_values_its_buffers_cannot_hold(field, value):
    """pad_slot_id fills int64 slot_mapping, the others int32 fields: one past each dtype's
    largest value is refused by the profile (not by torch inside DecodeBuffers), the largest
    accepted."""
    with pytest.raises(ValueError, match=f"{field} {value} does not fit int"):
        PaddingProfile("big", **{field: value})
    if field in ("pad_token_id", "seq_len_fill"):  # DecodeBuffers' own overrides
        with pytest.raises(ValueError, match=f"{field} {value} does not fit int"):
            DecodeBuffers(2, 2, 4, device=DEVICE, **{field: value})
    if field != "pool_start":
        assert getattr(PaddingProfile("big", **{field: value - 1}), field) == value - 1


def test_profile_with_trash_below_the_pool_start():
    """transformers 5.25's layout: trash at the start of the pool (null block 0, the pad slot in
    block 2), requests' blocks from ``pool_start`` 4 on. The pad slot below pool_start is
    accepted and dummy rows get it; the same slot at or past pool_start is refused, and so is a
    null block between 0 and pool_start."""
    prof = PaddingProfile("t525", pad_slot_id=2 * 8, null_block=0, pool_start=4)
    bufs = DecodeBuffers(4, 4, 8, device=DEVICE, padding=prof)
    dev = DeviceMetadataBackend(bufs, num_kv_blocks=16, vocab_size=VOCAB)
    md = dev.prepare(DecodeStep.build([5], {0: (3, 9, [4, 6])}))
    assert md.slot_mapping.tolist()[:1] == [6 * 8 + 1]
    assert md.block_table[0].tolist() == [4, 6, 0, 0]
    bufs = DecodeBuffers(4, 4, 8, device=DEVICE, padding=PaddingProfile(
        "t525", pad_slot_id=2 * 8, null_block=0, pool_start=2))
    with pytest.raises(ValueError, match="pad_slot_id 16 lies in block 2"):
        DeviceMetadataBackend(bufs, num_kv_blocks=16, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="pool_start must be >= 0 with the null block 0 or"):
        PaddingProfile("t525", null_block=1, pool_start=4)
    with pytest.raises(ValueError, match="pool_start must be >= 0"):
        PaddingProfile("t525", pool_start=-1)


def test_profile_must_fit_the_pool():
    """A null block or pad slot inside the blocks requests hold is refused when the backend is
    built, naming the field; a transformers profile with the null block past the pool lets the
    packer accept block 0 and refuse the null block."""
    bufs = DecodeBuffers(4, 4, 8, device=DEVICE, padding=PaddingProfile("x", null_block=5))
    with pytest.raises(ValueError, match="null_block 5 is a block requests hold"):
        DeviceMetadataBackend(bufs, num_kv_blocks=9, vocab_size=VOCAB)
    bufs = DecodeBuffers(4, 4, 8, device=DEVICE, padding=PaddingProfile("x", pad_slot_id=8 * 3))
    with pytest.raises(ValueError, match="pad_slot_id 24 lies in block 3"):
        HostMetadataBackend(bufs, num_kv_blocks=9, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="num_blocks: must be >= 1, got 0"):
        PaddingProfile.transformers(0, 8)
    with pytest.raises(TypeError, match="block_size: expected an int, got 8.0"):
        PaddingProfile.transformers(9, 8.0)
    bufs = DecodeBuffers(4, 4, 8, device=DEVICE, padding=PaddingProfile.transformers(9, 8))
    dev = DeviceMetadataBackend(bufs, num_kv_blocks=9, vocab_size=VOCAB)
    md = dev.prepare(DecodeStep.build([5], {0: (3, 2, [0])}))
    assert md.slot_mapping.tolist() == [2] and md.block_table[0].tolist() == [0, 9, 9, 9]
    with pytest.raises(ValueError, match=r"block id 9 outside \[0, 9\)"):
        dev.prepare(DecodeStep.build([6], {0: (3, 2, [9])}))
    with pytest.raises(TypeError, match="PaddingProfile"):
        DecodeBuffers(4, 4, 8, device=DEVICE, padding="vllm")
