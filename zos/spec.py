"""Speculative decoding on the device: an n-gram (prompt-lookup) drafter and greedy verification,
both capturable inside the decode graph (grid from the padded size only, N read on the device).

A decode step with K draft tokens runs q = 1 + K token rows per request (``DecodeBuffers`` built
with ``uniform_decode_query_len = q``). Inside one graph: the prep kernels write row 0 (the last
accepted token), :meth:`SpecDecoder.propose` writes rows 1..K (the drafts), the model runs all q
rows, and :meth:`SpecDecoder.verify` accepts the longest prefix of drafts equal to the target's
argmax plus the bonus token, writing ``buffers.accepted`` and ``buffers.sampled`` (read by the
next step's prep) and ``output`` (read back by the host, one step late under overlap).

The token history the drafter searches is paged like the KV cache: ``token_cache[slot]`` holds
the token whose KV is at ``slot``, so no history row is uploaded or moved when rows move; the
prefill writes the prompt's tokens (:meth:`SpecDecoder.write_history`), the drafter and the
verifier the rest (triton_kernels/spec.py).
"""
from __future__ import annotations

from zos._interpret import check_triton_device  # sets TRITON_INTERPRET before triton

import torch
import triton

from zos._checks import check_int
from zos.buffers import DecodeBuffers
from zos.triton_kernels.spec import propose_ngram, verify_greedy


class SpecDecoder:
    """Device state and launchers of n-gram speculative decoding over ``buffers``.

    Args:
        buffers: the decode buffers, with ``uniform_decode_query_len`` = 1 + num_draft_tokens.
        num_kv_blocks: KV blocks of the cache pool (the token cache holds one int32 per slot,
            ``num_kv_blocks * block_size``).
        num_draft_tokens: K >= 1, draft tokens per request and step.
        min_n, max_n: n-gram lengths tried, longest first (vLLM's prompt_lookup_min/max;
            defaults 1 and 3).

    Attributes:
        token_cache: int32 [num_kv_blocks * block_size], the token at each KV slot.
        output: int32 [max_num_reqs, q + 1]: ``output[r, 0]`` the tokens row r kept (a in
            [1, q]), ``output[r, 1:1 + a]`` those tokens (accepted drafts' targets, then the
            bonus); entries past a, and rows >= N, keep older values.

    Raises:
        TypeError: num_draft_tokens, min_n, max_n or num_kv_blocks not an int.
        ValueError: q != 1 + num_draft_tokens, num_draft_tokens < 1, 1 <= min_n <= max_n
            violated, or num_kv_blocks < 2; CPU buffers on a machine whose Triton compiles for
            the GPU (``zos._interpret.check_triton_device``).
    """

    def __init__(self, buffers: DecodeBuffers, *, num_kv_blocks: int, num_draft_tokens: int,
                 min_n: int = 1, max_n: int = 3) -> None:
        check_triton_device(buffers.device, "SpecDecoder: buffers")
        q = buffers.uniform_decode_query_len
        num_draft_tokens = check_int("num_draft_tokens", num_draft_tokens)
        if q != 1 + num_draft_tokens:
            raise ValueError(f"buffers.uniform_decode_query_len must be 1 + num_draft_tokens = "
                             f"{1 + num_draft_tokens}, got {q}")
        min_n, max_n = check_int("min_n", min_n), check_int("max_n", max_n)
        if min_n > max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        num_kv_blocks = check_int("num_kv_blocks", num_kv_blocks, 2)
        self.buffers, self.num_draft_tokens = buffers, num_draft_tokens
        self.min_n, self.max_n = min_n, max_n
        i32 = dict(dtype=torch.int32, device=buffers.device)
        self.token_cache = torch.zeros(num_kv_blocks * buffers.block_size, **i32)
        self.output = torch.zeros((buffers.max_num_reqs, q + 1), **i32)

    def write_history(self, tokens: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Record prefilled tokens: ``token_cache[slot_mapping[i]] = tokens[i]`` for slots >= 0
        (eager; a prefill's tokens int32 [T] and slots int64 [T] on the buffers' device).

        Raises:
            ValueError: shapes differ, or a slot is past the token cache.
        """
        if tokens.shape != slot_mapping.shape or tokens.dim() != 1:
            raise ValueError(f"tokens {tuple(tokens.shape)} and slot_mapping "
                             f"{tuple(slot_mapping.shape)} must be equal 1-D shapes")
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        if slots.numel() and int(slots.max()) >= self.token_cache.numel():
            raise ValueError(f"slot_mapping: slot {int(slots.max())} is past the token cache "
                             f"({self.token_cache.numel()} slots)")
        self.token_cache[slots] = tokens[keep].to(torch.int32)

    def propose(self, padded_size: int) -> None:
        """Draft tokens into ``buffers.input_ids`` rows r*q + 1 .. r*q + K for rows r < N
        (``counts[0]``), from each row's history; also writes row 0's token into the token
        cache. Run after prep, before the forward. One launch, grid (padded_size // q,).

        Raises:
            TypeError, ValueError: padded_size not an int multiple of q in
                [1, max_num_reqs * q] (``DecodeBuffers.check_padded_size``).
        """
        b, q = self.buffers, self.buffers.uniform_decode_query_len
        grid = (b.check_padded_size(padded_size) // q,)
        propose_ngram[grid](
            b.counts, b.input_ids, b.positions, b.slot_mapping, b.block_table,
            b.max_num_blocks_per_req, self.token_cache, b.block_size,
            Q=q, K=self.num_draft_tokens, K_POW2=triton.next_power_of_2(self.num_draft_tokens),
            MIN_N=self.min_n, MAX_N=self.max_n, BLOCK=128)

    def verify(self, target: torch.Tensor, padded_size: int) -> None:
        """Greedy verification of rows r < N against ``target`` (int32 1-D [>= padded_size],
        any stride: copied first unless contiguous; the target model's argmax per token row):
        writes ``buffers.accepted``, ``buffers.sampled`` (the bonus token), ``output`` and the
        accepted tokens' history. Rows >= N untouched. One launch, grid (padded_size // q,).

        Raises:
            TypeError, ValueError: padded_size as in :meth:`propose`.
            ValueError: target not int32 1-D on the buffers' device or shorter than
                padded_size.
        """
        b, q = self.buffers, self.buffers.uniform_decode_query_len
        grid = (b.check_padded_size(padded_size) // q,)
        if (target.dtype != torch.int32 or target.device != b.input_ids.device
                or target.dim() != 1 or target.shape[0] < padded_size):
            raise ValueError(f"target must be int32 1-D [>= {padded_size}] on "
                             f"{b.input_ids.device}, got {target.dtype} "
                             f"{tuple(target.shape)} on {target.device}")
        if target.stride(0) != 1:  # the kernel reads token row t at offset t
            target = target.contiguous()
        verify_greedy[grid](
            b.counts, b.input_ids, b.slot_mapping, target, self.token_cache,
            b.sampled, b.accepted, self.output,
            Q=q, Q_POW2=triton.next_power_of_2(q))
