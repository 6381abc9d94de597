"""vLLM runner v2's decode inputs from zos's buffers (pure ``@triton.jit``; launcher in
zos/integrations/vllm_buffers.py).

One program per request row of vLLM's buffers (``max_num_reqs``) and one more for the slot
tail. The real row count N is read on the device from zos's ``counts`` (so one capture per
padded size serves every N), the padded row count R' is the launch's. Program r < N reads the
row's request index in vLLM's request state from zos's token of row r (``zos_ids[r]``), writes
it to ``idx_mapping[r]`` and ``carry[r]`` (zos's ``sampled`` row state, so that a carried row's
token next step is its index again), writes the token vLLM sampled last for that request
(``last_sampled_tokens[idx, 0]``, as runner v2's ``combine_sampled_and_draft_tokens`` does for
a decode row), copies zos's row r
(position widened to int64, seq_len, block-table columns, slot) and writes
``query_start_loc[r + 1] = r + 1``; a program N <= r < max_num_reqs writes runner v2's padding:
``seq_lens[r] = 0``, ``query_start_loc[r + 1] = N`` and, for r < R', a block-table row of zeros
(its every column); the last program writes ``query_start_loc[0] = 0`` and PAD_SLOT_ID into
``slot_mapping[N:max_num_tokens]``. No program reads a word another one writes.
"""
import triton
import triton.language as tl


@triton.jit
def write_vllm_decode_inputs(counts_ptr, zos_ids_ptr, carry_ptr, idx_ptr, sampled_ptr,
                             sampled_stride, pos_ptr, seq_ptr, bt_ptr, bt_stride, slot_ptr,
                             out_ids_ptr, out_pos_ptr, out_qsl_ptr, out_seq_ptr, out_bt_ptr,
                             out_bt_stride, out_slot_ptr, padded_reqs, max_num_reqs,
                             max_num_tokens, zos_width, vllm_width, pad_slot_id,
                             BLOCK: tl.constexpr):
    r = tl.program_id(0)
    n = tl.load(counts_ptr)
    cols = tl.arange(0, BLOCK)
    if r == max_num_reqs:
        tl.store(out_qsl_ptr, 0)
        for start in range(n, max_num_tokens, BLOCK):
            offs = start + cols
            tl.store(out_slot_ptr + offs, tl.full([BLOCK], pad_slot_id, tl.int64),
                     mask=offs < max_num_tokens)
    elif r < n:
        idx = tl.load(zos_ids_ptr + r)
        tl.store(idx_ptr + r, idx)
        tl.store(carry_ptr + r, idx)
        tl.store(out_ids_ptr + r, tl.load(sampled_ptr + idx * sampled_stride).to(tl.int32))
        tl.store(out_pos_ptr + r, tl.load(pos_ptr + r).to(tl.int64))
        tl.store(out_seq_ptr + r, tl.load(seq_ptr + r))
        tl.store(out_slot_ptr + r, tl.load(slot_ptr + r))
        tl.store(out_qsl_ptr + r + 1, r + 1)
        for start in range(0, zos_width, BLOCK):
            offs = start + cols
            row = tl.load(bt_ptr + r * bt_stride + offs, mask=offs < zos_width)
            tl.store(out_bt_ptr + r * out_bt_stride + offs, row, mask=offs < zos_width)
    else:
        tl.store(out_seq_ptr + r, 0)
        tl.store(out_qsl_ptr + r + 1, n)
        if r < padded_reqs:
            for start in range(0, vllm_width, BLOCK):
                offs = start + cols
                tl.store(out_bt_ptr + r * out_bt_stride + offs, tl.zeros([BLOCK], tl.int32),
                         mask=offs < vllm_width)
