"""Speculative decoding kernels (pure ``@triton.jit``; launchers in zos/spec.py).

Both run one program per request row r of the padded step and read the real row count N from
``counts[0]`` on the device (written by the prep kernels), so one capture per bucket serves every
N; rows r >= N are not touched. A request row has Q = 1 + K token rows: row 0 holds the last
accepted token, rows 1..K the draft tokens.

The token history of a request is paged like its KV cache: ``token_cache[slot]`` is the token at
the position whose KV lives in ``slot`` (slot = block_table[r, p // block_size] * block_size +
p % block_size). Prefill writes the prompt's tokens there, the drafter row 0's token, the
verifier the tokens it accepts; a rejected draft's entry is overwritten when that position is
written again, like its KV. Nothing moves when a row moves: the block table says where.
"""
import triton
import triton.language as tl


@triton.jit
def _history(token_cache_ptr, bt_row_ptr, p, mask, block_size):
    """Tokens at positions ``p`` of one request (through its block-table row); -1 off ``mask``."""
    blk = tl.load(bt_row_ptr + p // block_size, mask=mask, other=0)
    return tl.load(token_cache_ptr + blk.to(tl.int64) * block_size + p % block_size, mask=mask,
                   other=-1)


@triton.jit
def propose_ngram(counts_ptr, input_ids_ptr, positions_ptr, slot_mapping_ptr, block_table_ptr,
                  bt_stride, token_cache_ptr, block_size,
                  Q: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr,
                  MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr):
    """Prompt-lookup (n-gram) drafts for request row r (one program per row of the padded step).

    Reads counts int32 [2] (N), input_ids int32 [R*Q] (row 0: the request's last token, at
    positions[r*Q]), positions int32 [R*Q], slot_mapping int64 [R*Q], block_table int32
    [R, bt_stride], token_cache int32 [num_slots]. With L = position + 1 tokens of history, for
    n = MAX_N down to MIN_N (longest first) it looks for the latest start s <= L - 1 - n with
    history[s:s+n] == history[L-n:L] and proposes history[s+n : s+n+K] (vLLM's and
    TensorRT-LLM's prompt-lookup decoding); positions past the history, or no match at all,
    propose row 0's token. Writes token_cache[slot of row 0] = row 0's token and
    input_ids[r*Q + 1 + j] = draft j for j < K, for rows r < N only.
    """
    r = tl.program_id(0)
    n_reqs = tl.load(counts_ptr)
    if r < n_reqs:
        r64 = r.to(tl.int64)
        pos0 = tl.load(positions_ptr + r64 * Q)
        tok0 = tl.load(input_ids_ptr + r64 * Q)
        tl.store(token_cache_ptr + tl.load(slot_mapping_ptr + r64 * Q), tok0)
        bt = block_table_ptr + r64 * bt_stride
        hist_len = pos0 + 1
        start = pos0 * 0 - 1  # position of the first proposed token (an int32 tensor: the
        # compiler needs one type for a variable assigned under a runtime condition)
        for n in tl.static_range(MAX_N, MIN_N - 1, -1):
            if (start < 0) & (hist_len > n):
                last_s = hist_len - 1 - n  # the match must be followed by a known token
                c0 = (last_s // BLOCK) * BLOCK
                found = pos0 * 0 - 1
                while (c0 >= 0) & (found < 0):
                    s = c0 + tl.arange(0, BLOCK)
                    match = s <= last_s
                    for i in tl.static_range(n):
                        p = hist_len - n + i  # suffix token i (the last is row 0's token)
                        sfx = tl.where(p == pos0, tok0,
                                       tl.load(token_cache_ptr + tl.load(bt + p // block_size)
                                               .to(tl.int64) * block_size + p % block_size))
                        match = match & (_history(token_cache_ptr, bt, s + i, match,
                                                  block_size) == sfx)
                    found = tl.max(tl.where(match, s, -1))
                    c0 -= BLOCK
                if found >= 0:
                    start = found + n
        j = tl.arange(0, K_POW2)
        p = start + j
        known = tl.where(start >= 0, (p < pos0) & (j < K), False)
        draft = _history(token_cache_ptr, bt, p, known, block_size)
        draft = tl.where(known, draft, tok0)
        tl.store(input_ids_ptr + r64 * Q + 1 + j, draft, mask=j < K)


@triton.jit
def verify_greedy(counts_ptr, input_ids_ptr, slot_mapping_ptr, target_ptr, token_cache_ptr,
                  sampled_ptr, accepted_ptr, output_ptr,
                  Q: tl.constexpr, Q_POW2: tl.constexpr):
    """Greedy verification of request row r (one program per row of the padded step).

    Reads counts int32 [2] (N), input_ids int32 [R*Q] (rows 1..Q-1: the drafts), slot_mapping
    int64 [R*Q], target int32 [R*Q] (the target model's argmax at each token row). Draft t
    (token row t + 1) is accepted while every draft before it was and it equals target[t]:
    a = 1 + accepted drafts tokens are kept, target[0 .. a-1], the last of them the bonus token
    (Leviathan et al. 2023 / Chen et al. 2023, greedy case). For rows r < N writes accepted[r] =
    a, sampled[r] = target[a-1] (the next step's row-0 token), output[r, 0] = a and
    output[r, 1 + t] = target[t] for t < a (output int32 [R, Q + 1]), and token_cache[slot] =
    input token for token rows t < a (the history up to the bonus token). Rows r >= N: nothing.
    """
    r = tl.program_id(0)
    n_reqs = tl.load(counts_ptr)
    if r < n_reqs:
        r64 = r.to(tl.int64)
        t = tl.arange(0, Q_POW2)
        rows = r64 * Q + t
        tm = t < Q
        target = tl.load(target_ptr + rows, mask=tm, other=-1)
        draft = tl.load(input_ids_ptr + rows + 1, mask=t < Q - 1, other=-1)
        ok = (draft == target) & (t < Q - 1)
        a = tl.min(tl.where(ok, Q_POW2, t)) + 1  # first rejected draft + 1 (bonus row)
        tl.store(accepted_ptr + r, a)
        tl.store(sampled_ptr + r, tl.sum(tl.where(t == a - 1, target, 0)))
        out = output_ptr + r64 * (Q + 1)
        tl.store(out, a)
        tl.store(out + 1 + t, target, mask=t < a)
        ids = tl.load(input_ids_ptr + rows, mask=tm, other=0)
        slots = tl.load(slot_mapping_ptr + rows, mask=tm, other=-1)
        tl.store(token_cache_ptr + slots, ids, mask=tm & (t < a) & (slots >= 0))
