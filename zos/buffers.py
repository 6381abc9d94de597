"""Static decode buffers: one allocation per field at the largest size, every
bucket a prefix view (the layout vLLM's model runner v2 uses).

Rows [N, B) of a padded step are dummy rows that follow the padding ledger of
docs/ZOS.md: token ``pad_token_id`` (a valid id), position 0, seq_len
``seq_len_fill`` (default 1, never 0), slot PAD_SLOT_ID (-1, no KV write), and a
block-table row of the null block 0 (reserved, never given to a request).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zos import staging

PAD_SLOT_ID = -1
NULL_BLOCK = 0


@dataclass(frozen=True)
class DecodeMetadata:
    """Views of one step's metadata, padded to ``padded_tokens`` token rows.

    Attributes (R = padded_tokens // q request rows, T = padded_tokens):
        input_ids: int32 [T], token ids (dummy rows: pad token).
        positions: int32 [T], position of each token (dummy rows: 0).
        slot_mapping: int64 [T], KV slot = block_id * block_size + offset
            (dummy rows: PAD_SLOT_ID -1).
        seq_lens: int32 [R], tokens of the request including this step's
            (dummy rows: seq_len_fill).
        query_start_loc: int32 [R+1], token-row offsets, r * q (uniform decode).
        block_table: int32 [R, W], block ids; columns past the row's blocks hold
            the null block 0.
        counts: int32 [2] on the device, (num_reqs, num_tokens): the one count
            every consumer reads to tell real rows from dummy rows.
        num_reqs, num_tokens, padded_tokens: the same counts on the host.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    counts: torch.Tensor
    num_reqs: int
    num_tokens: int
    padded_tokens: int


class DecodeBuffers:
    """Device buffers that the prep kernels write and CUDA graphs read.

    Args:
        max_reqs: request rows held (the scheduler's max_num_seqs; may exceed
            the largest bucket: larger steps run eagerly on the same buffers).
        max_blocks_per_seq: block-table width W.
        block_size: tokens per KV block.
        q: token rows per request row, 1 + draft tokens.
        device: where the buffers live.
        pad_token_id: token of dummy rows (must be a valid id).
        seq_len_fill: seq_len of dummy rows, the attention backend's fill value
            (vLLM: ``get_cuda_graph_seq_len_fill_value``); must be >= 1.

    Raises:
        ValueError: a size is not positive, or seq_len_fill < 1 / pad_token_id < 0.
    """

    def __init__(self, max_reqs: int, max_blocks_per_seq: int, block_size: int, *, q: int = 1,
                 device: torch.device | str = "cpu", pad_token_id: int = 0,
                 seq_len_fill: int = 1) -> None:
        for name, v in (("max_reqs", max_reqs), ("max_blocks_per_seq", max_blocks_per_seq),
                        ("block_size", block_size), ("q", q)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if seq_len_fill < 1:
            raise ValueError(f"seq_len_fill must be >= 1 (0 has produced NaN), got {seq_len_fill}")
        if pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a valid token id, got {pad_token_id}")
        self.max_reqs, self.q, self.block_size = max_reqs, q, block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.pad_token_id, self.seq_len_fill = pad_token_id, seq_len_fill
        self.device = torch.device(device)
        r, t, w = max_reqs, max_reqs * q, max_blocks_per_seq
        i32 = dict(dtype=torch.int32, device=self.device)
        self.input_ids = torch.full((t,), pad_token_id, **i32)
        self.positions = torch.zeros(t, **i32)
        self.slot_mapping = torch.full((t,), PAD_SLOT_ID, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.full((r,), seq_len_fill, **i32)
        self.query_start_loc = torch.arange(0, (r + 1) * q, q, **i32)
        self.block_table = torch.full((r, w), NULL_BLOCK, **i32)
        self.counts = torch.zeros(2, **i32)
        # Row state carried to the next step: blocks in use per row (columns past
        # it are 0), the token sampled for each row, tokens accepted per row.
        self.num_blocks = torch.zeros(r, **i32)
        self.sampled = torch.zeros(r, **i32)
        self.accepted = torch.ones(r, **i32)
        # The staged upload, and the gather scratch of rows that moved.
        self.staging = torch.zeros(staging.capacity_words(r, w), **i32)
        self.scratch_pos = torch.zeros(r, **i32)
        self.scratch_num_blocks = torch.zeros(r, **i32)
        self.scratch_block_table = torch.zeros((r, w), **i32)

    def views(self, num_reqs: int, padded_tokens: int) -> DecodeMetadata:
        """Prefix views for a step of ``num_reqs`` requests padded to ``padded_tokens`` token
        rows. ValueError unless 0 <= padded_tokens <= max_reqs * q and q divides it."""
        if not 0 <= padded_tokens <= self.max_reqs * self.q or padded_tokens % self.q:
            raise ValueError(f"padded_tokens must be a multiple of q={self.q} in [0, "
                             f"{self.max_reqs * self.q}], got {padded_tokens}")
        r = padded_tokens // self.q
        return DecodeMetadata(
            input_ids=self.input_ids[:padded_tokens],
            positions=self.positions[:padded_tokens],
            slot_mapping=self.slot_mapping[:padded_tokens],
            seq_lens=self.seq_lens[:r],
            query_start_loc=self.query_start_loc[: r + 1],
            block_table=self.block_table[:r],
            counts=self.counts,
            num_reqs=num_reqs,
            num_tokens=num_reqs * self.q,
            padded_tokens=padded_tokens,
        )
