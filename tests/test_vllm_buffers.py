"""zos's decode metadata in vLLM runner v2's persistent tensors (zos/integrations/vllm_buffers.py):
every word runner v2 writes for a decode step, and nothing it leaves stale, against a reference
written from vLLM 0.26's ``prepare_inputs`` / ``prepare_pos_seq_lens`` / ``gather_block_tables``
/ ``compute_slot_mappings`` (vllm/v1/worker/gpu/)."""
import zos._interpret  # noqa: F401  (before anything imports triton)

import numpy as np
import pytest
import torch

from zos.buffers import DecodeBuffers
from zos.device_backend import DeviceMetadataBackend
from zos.integrations.vllm_buffers import VllmDecodeInputs, write_vllm_decode_inputs
from zos.step import DecodeStep

from helpers import DEVICE

BS, W, STALE = 4, 6, 7777  # block size, zos's block-table width, what no write may touch


def zos_step(n, seed):
    """zos's metadata of a decode step of n new rows (random positions and blocks)."""
    rng = np.random.default_rng(seed)
    pos = rng.integers(0, W * BS, n)
    nblocks = pos // BS + 1
    blocks = rng.permutation(np.arange(1, 1 + int(nblocks.sum()))).astype(np.int32)
    step = DecodeStep(np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int32),
                      rng.integers(0, 50, n).astype(np.int32), pos.astype(np.int32),
                      np.concatenate([[0], np.cumsum(nblocks)]).astype(np.int32), blocks,
                      [], [], [], [0], [])
    buffers = DecodeBuffers(24, W, BS, device=DEVICE)
    backend = DeviceMetadataBackend(buffers, num_kv_blocks=1 + len(blocks), vocab_size=50)
    return backend.prepare(step)


def vllm_tensors(max_reqs, max_tokens, width):
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return VllmDecodeInputs(
        input_ids=torch.full((max_tokens,), STALE, **i32),
        positions=torch.full((max_tokens,), STALE, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.full((max_reqs + 1,), STALE, **i32),
        seq_lens=torch.full((max_reqs,), STALE, **i32),
        block_table=torch.full((max_reqs, width), STALE, **i32),
        slot_mapping=torch.full((max_tokens,), STALE, dtype=torch.int64, device=DEVICE))


def vllm_state(seed):
    """Runner v2's tokens sampled last (50 request slots: zos_step's tokens are the rows'
    request indices), and the two int32 tensors the write fills: idx_mapping and zos's
    carried row state, stale."""
    rng = np.random.default_rng(seed)
    sampled = torch.from_numpy(rng.integers(0, 49_152, (50, 1))).to(DEVICE)
    return sampled, *(torch.full((24,), STALE, dtype=torch.int32, device=DEVICE)
                      for _ in range(2))


def runner_v2_reference(meta, sampled, n, padded, max_reqs, max_tokens, width):
    """Runner v2's tensors after a decode step of the n rows of meta (zos's token of a row
    being its request index), padded to `padded`."""
    ref = {k: v.cpu().clone() for k, v in vllm_tensors(max_reqs, max_tokens, width)
           .__dict__.items()}
    idx = meta.input_ids[:n].cpu().long()
    # combine_sampled_and_draft_tokens: a decode row's token is its request's last sampled
    ref["input_ids"][:n] = sampled.cpu()[idx, 0].int()
    ref["positions"][:n] = meta.positions[:n].cpu().long()  # prepare_pos_seq_lens
    ref["seq_lens"][:n] = meta.seq_lens[:n].cpu()
    ref["seq_lens"][n:] = 0  # its extra program zeroes seq_lens[num_reqs:max_num_reqs]
    # prepare_inputs: cumsum of one token per request, then num_tokens for every padded row
    ref["query_start_loc"][: n + 1] = torch.arange(n + 1)
    ref["query_start_loc"][n + 1:] = n
    # gather_block_tables: each request's blocks, padded rows [n, padded) zeroed in full
    for r in range(n):
        k = int(meta.seq_lens[r] - 1) // BS + 1
        ref["block_table"][r, :k] = meta.block_table[r, :k].cpu()
    ref["block_table"][n:padded] = 0
    # compute_slot_mappings: the real tokens' slots, PAD_SLOT_ID from num_tokens to the end
    ref["slot_mapping"][:n] = meta.slot_mapping[:n].cpu()
    ref["slot_mapping"][n:] = -1
    return ref


@pytest.mark.parametrize("n,padded,max_reqs,max_tokens,width",
                         [(1, 1, 1, 1, W), (3, 4, 24, 33, W + 2), (7, 8, 9, 300, W),
                          (13, 16, 40, 40, 11)])
def test_decode_inputs_equal_runner_v2s(n, padded, max_reqs, max_tokens, width):
    meta = zos_step(n, seed=n)
    sampled, idx, carry = vllm_state(seed=n)
    out = vllm_tensors(max_reqs, max_tokens, width)
    write_vllm_decode_inputs(meta, carry, idx, sampled, out, padded)
    # each row's request index (zos's token of the row) into idx_mapping and the carried state
    for t in (idx, carry):
        assert t[:n].tolist() == meta.input_ids[:n].tolist()
        assert t[n:].eq(STALE).all()
    ref = runner_v2_reference(meta, sampled, n, padded, max_reqs, max_tokens, width)
    for name, want in ref.items():
        got = getattr(out, name).cpu()
        if name == "block_table":  # columns past a real row's blocks: stale in vLLM, zos's 0
            for r in range(n):
                k = int(meta.seq_lens[r] - 1) // BS + 1
                assert got[r, k:W].eq(0).all() and got[r, W:].eq(STALE).all(), r
                got[r, k:W] = STALE
        assert torch.equal(got, want), name


def test_bad_tensors_are_refused_before_any_write():
    meta = zos_step(3, seed=0)
    sampled, idx, carry = vllm_state(seed=0)
    out = vllm_tensors(8, 8, W)
    bad = [(dict(positions=out.positions.int()), TypeError, "positions must be a torch.int64"),
           (dict(seq_lens=out.seq_lens[:4]), ValueError, "query_start_loc must have 5 rows"),
           (dict(block_table=out.block_table[:, : W - 1]), ValueError, "does not fit"),
           (dict(input_ids=out.input_ids[:4], positions=out.positions[:4],
                 slot_mapping=out.slot_mapping[:4]), ValueError, "must hold a token per row")]
    for change, error, message in bad:
        with pytest.raises(error, match=message):
            write_vllm_decode_inputs(meta, carry, idx, sampled,
                                     VllmDecodeInputs(**{**out.__dict__, **change}), 4)
    for padded in (0, 9):
        with pytest.raises(ValueError, match="padded_reqs"):
            write_vllm_decode_inputs(meta, carry, idx, sampled, out, padded)
    with pytest.raises(TypeError, match="idx_mapping must be a torch.int32"):
        write_vllm_decode_inputs(meta, carry, idx.long(), sampled, out, 4)
    with pytest.raises(TypeError, match="carry must be a torch.int32"):
        write_vllm_decode_inputs(meta, carry.long(), idx, sampled, out, 4)
    with pytest.raises(TypeError, match="last_sampled_tokens must be a torch.int64"):
        write_vllm_decode_inputs(meta, carry, idx, sampled.int(), out, 4)
    with pytest.raises(ValueError, match="idx_mapping must be 1-D, contiguous"):
        write_vllm_decode_inputs(meta, carry, torch.stack([idx, idx], 1)[:, 0], sampled, out, 4)
    with pytest.raises(ValueError, match="idx_mapping holds 2 rows, the step 3"):
        write_vllm_decode_inputs(meta, carry, idx[:2], sampled, out, 4)
    with pytest.raises(ValueError, match="carry holds 2 rows, the step 3"):
        write_vllm_decode_inputs(meta, carry[:2], idx, sampled, out, 4)
    assert all(t.eq(STALE).all() for t in (*out.__dict__.values(), idx, carry))
