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
class StepMetadata:
    """The model inputs and attention metadata of one step: the one metadata type of zos.

    Decode steps get prefix views of :class:`DecodeBuffers` (``DecodeBuffers.views``), padded to
    ``padded_size`` token rows; the serving harness's eager prefill builds one from host lists.
    With T = padded_size token rows and R = T // q request rows (q = uniform_decode_query_len):

    Attributes:
        input_ids: int32 [T], token ids (dummy rows: the pad token).
        positions: int32 [T], position of each token (dummy rows: 0).
        slot_mapping: int64 [T], KV slot = block_id * block_size + offset
            (dummy rows: PAD_SLOT_ID -1, no KV write).
        seq_lens: int32 [R], tokens of the request including this step's
            (dummy rows: seq_len_fill, >= 1).
        query_start_loc: int32 [R+1], token-row offsets (decode: r * q).
        block_table: int32 [R, W], block ids; columns past the row's blocks hold
            the null block 0.
        counts: int32 [2] on the device, (num_reqs, num_tokens): the one count
            every consumer reads to tell real rows from dummy rows; None in prefill.
        num_reqs, num_tokens, padded_size: the same counts on the host (a decode
            graph's body is built with num_reqs = 0: it reads ``counts`` instead).
        query_lens_host, seq_lens_host: host ``list[int]`` of length R, set for eager
            prefill only (variable-length attention needs them without a device sync).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    counts: torch.Tensor | None
    num_reqs: int
    num_tokens: int
    padded_size: int
    query_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None


class DecodeBuffers:
    """Device buffers that the prep kernels write and CUDA graphs read.

    Args:
        max_num_reqs: request rows held (the scheduler's max_num_seqs; may exceed
            the largest bucket: larger steps run eagerly on the same buffers).
        max_num_blocks_per_req: block-table width W.
        block_size: tokens per KV block.
        uniform_decode_query_len: q, token rows per request row, 1 + draft tokens
            (vLLM's name).
        device: where the buffers live.
        pad_token_id: token of dummy rows (must be a valid id).
        seq_len_fill: seq_len of dummy rows, the attention backend's fill value
            (vLLM: ``get_cuda_graph_seq_len_fill_value``); must be >= 1.

    Raises:
        ValueError: a size is not positive, or seq_len_fill < 1 / pad_token_id < 0.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int, *,
                 uniform_decode_query_len: int = 1, device: torch.device | str = "cpu",
                 pad_token_id: int = 0, seq_len_fill: int = 1) -> None:
        q = uniform_decode_query_len
        for name, v in (("max_num_reqs", max_num_reqs),
                        ("max_num_blocks_per_req", max_num_blocks_per_req),
                        ("block_size", block_size), ("uniform_decode_query_len", q)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if seq_len_fill < 1:
            raise ValueError(f"seq_len_fill must be >= 1 (0 has produced NaN), got {seq_len_fill}")
        if pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a valid token id, got {pad_token_id}")
        self.max_num_reqs, self.uniform_decode_query_len = max_num_reqs, q
        self.max_num_blocks_per_req, self.block_size = max_num_blocks_per_req, block_size
        self.pad_token_id, self.seq_len_fill = pad_token_id, seq_len_fill
        self.device = torch.device(device)
        self.owner = None  # the backend that writes these buffers (MetadataBackend sets it)
        r, t, w = max_num_reqs, max_num_reqs * q, max_num_blocks_per_req
        i32 = dict(dtype=torch.int32, device=self.device)
        self.input_ids = torch.empty(t, **i32)
        self.positions = torch.empty(t, **i32)
        self.slot_mapping = torch.empty(t, dtype=torch.int64, device=self.device)
        self.seq_lens = torch.empty(r, **i32)
        self.query_start_loc = torch.arange(0, (r + 1) * q, q, **i32)
        self.block_table = torch.empty((r, w), **i32)
        self.counts = torch.empty(2, **i32)
        # Row state carried to the next step: blocks in use per row (columns past
        # it are 0), the token sampled for each row, tokens accepted per row.
        self.num_blocks_per_row = torch.empty(r, **i32)
        self.sampled = torch.empty(r, **i32)
        self.accepted = torch.empty(r, **i32)
        # The staged upload, and the gather scratch of rows that moved.
        self.staging = torch.zeros(staging.capacity_words(r, w), **i32)
        self.scratch_pos = torch.zeros(r, **i32)
        self.scratch_num_blocks_per_row = torch.zeros(r, **i32)
        self.scratch_block_table = torch.zeros((r, w), **i32)
        self.reset()

    def reset(self) -> None:
        """Every row a dummy row and no row state (blocks, sampled and accepted tokens): the
        state right after allocation. A backend calls it when it takes the buffers over, so
        nothing an earlier backend wrote survives (in place, on the buffers' stream)."""
        self.input_ids.fill_(self.pad_token_id)
        self.positions.zero_()
        self.slot_mapping.fill_(PAD_SLOT_ID)
        self.seq_lens.fill_(self.seq_len_fill)
        self.block_table.fill_(NULL_BLOCK)
        self.counts.zero_()
        self.num_blocks_per_row.zero_()
        self.sampled.zero_()
        self.accepted.fill_(1)
        self.staging[: staging.HEADER_WORDS].zero_()

    def views(self, num_reqs: int, padded_size: int) -> StepMetadata:
        """Prefix views for a step of ``num_reqs`` requests padded to ``padded_size`` token
        rows. ValueError unless 0 <= padded_size <= max_num_reqs * q and q divides it."""
        q = self.uniform_decode_query_len
        if not 0 <= padded_size <= self.max_num_reqs * q or padded_size % q:
            raise ValueError(f"padded_size must be a multiple of uniform_decode_query_len={q} in "
                             f"[0, {self.max_num_reqs * q}], got {padded_size}")
        r = padded_size // q
        return StepMetadata(
            input_ids=self.input_ids[:padded_size],
            positions=self.positions[:padded_size],
            slot_mapping=self.slot_mapping[:padded_size],
            seq_lens=self.seq_lens[:r],
            query_start_loc=self.query_start_loc[: r + 1],
            block_table=self.block_table[:r],
            counts=self.counts,
            num_reqs=num_reqs,
            num_tokens=num_reqs * q,
            padded_size=padded_size,
        )
