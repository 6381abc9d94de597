"""Static decode buffers: one allocation per field at the largest size, every
bucket a prefix view (the layout vLLM's model runner v2 uses).

Rows [N, B) of a padded step are dummy rows that follow the padding ledger of
docs/ZOS.md, with the values of the buffers' :class:`PaddingProfile` (the runner's
convention): token ``pad_token_id`` (a valid id), position 0, seq_len ``seq_len_fill``
(never 0), slot ``pad_slot_id`` and a block-table row of the ``null_block``. The default,
``PaddingProfile.VLLM``, is vLLM's: slot PAD_SLOT_ID (-1, no KV write) and the null
block 0 (reserved, never given to a request).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from zos import staging
from zos._checks import check_int

PAD_SLOT_ID = -1  # vLLM's pad slot (PaddingProfile.VLLM.pad_slot_id)
NULL_BLOCK = 0  # vLLM's null block (PaddingProfile.VLLM.null_block)
_I32_MAX, _I64_MAX = 2 ** 31 - 1, 2 ** 63 - 1


@dataclass(frozen=True)
class PaddingProfile:
    """What a runner expects in dummy rows: the padding convention, validated when built.

    Runners differ (docs/ZOS.md, the padding ledger): vLLM writes slot -1 for padding (its
    KV write skips negative slots) and keeps block 0 out of its pool as the null block;
    SGLang writes padding to slot 0 (``req_to_token`` entry 0 is never handed out);
    transformers 5.17 hands out every block from 0 and keeps two extra blocks past its
    pool: a zeroed read trash (the null block) and a write trash (the pad slot);
    transformers 5.25 keeps its trash at the start (page 0 the zeroed read trash, a write
    trash page after it) and hands out pages from ``pool_start`` on.

    Attributes:
        name: a label for messages.
        pad_slot_id: slot_mapping value of dummy rows: -1 (the KV write must skip it) or a
            slot >= 0 in a block no request holds (the KV write stores into it).
        null_block: block id of dummy rows' block-table columns: 0 (reserved inside the pool,
            request block ids in [1, num_kv_blocks)) or >= num_kv_blocks (outside the pool,
            request block ids in [0, num_kv_blocks)); checked against the pool by the backend.
        seq_len_fill: seq_lens value of dummy rows, >= 1 (0 has produced NaN).
        pad_token_id: input_ids value of dummy rows, >= 0 (checked against the vocabulary by
            the backend).
        pool_start: the lowest block id a request can hold (0: the pool starts at 0, or at 1
            past a null block 0); blocks below it other than the null block are trash a pad
            slot may lie in.

    Raises:
        TypeError: a field is not an int.
        ValueError: pad_slot_id < -1, null_block < 0, seq_len_fill < 1, pad_token_id < 0,
            pool_start < 0, a null block in [1, pool_start), or a value its buffer's dtype
            cannot hold (pad_slot_id int64, the others int32).
    """

    name: str
    pad_slot_id: int = PAD_SLOT_ID
    null_block: int = NULL_BLOCK
    seq_len_fill: int = 1
    pad_token_id: int = 0
    pool_start: int = 0

    VLLM: ClassVar[PaddingProfile]
    SGLANG: ClassVar[PaddingProfile]

    def __post_init__(self) -> None:
        # The one check of the pad values: DecodeBuffers' overrides come through here too.
        for f in ("pad_slot_id", "null_block", "seq_len_fill", "pad_token_id", "pool_start"):
            v = check_int(f"PaddingProfile {self.name!r}: {f}", getattr(self, f), lo=None)
            # the buffers' dtypes: int64 slots, int32 block ids, tokens and lengths
            top, dtype = (_I64_MAX, "int64") if f == "pad_slot_id" else (_I32_MAX, "int32")
            if v > top:
                raise ValueError(f"PaddingProfile {self.name!r}: {f} {v} does not fit "
                                 f"{dtype}")
            object.__setattr__(self, f, v)
        if self.pad_slot_id < -1:
            raise ValueError(f"PaddingProfile {self.name!r}: pad_slot_id must be -1 (no KV "
                             f"write) or a slot >= 0, got {self.pad_slot_id}")
        if self.null_block < 0:
            raise ValueError(f"PaddingProfile {self.name!r}: null_block must be >= 0, got "
                             f"{self.null_block}")
        if self.seq_len_fill < 1:
            raise ValueError(f"PaddingProfile {self.name!r}: seq_len_fill must be >= 1 (0 has "
                             f"produced NaN), got {self.seq_len_fill}")
        if self.pad_token_id < 0:
            raise ValueError(f"PaddingProfile {self.name!r}: pad_token_id must be a valid token "
                             f"id, got {self.pad_token_id}")
        if self.pool_start < 0 or 0 < self.null_block < self.pool_start:
            raise ValueError(f"PaddingProfile {self.name!r}: pool_start must be >= 0 with the "
                             f"null block 0 or >= pool_start, got pool_start "
                             f"{self.pool_start}, null_block {self.null_block}")

    @staticmethod
    def transformers(num_blocks: int, block_size: int) -> PaddingProfile:
        """transformers 5.17's convention for a ``PagedAttentionCache`` of ``num_blocks`` blocks
        (ids 0 .. num_blocks - 1 handed out): the null block is its read trash, block
        ``num_blocks`` (zeroed, never written), and the pad slot its write trash,
        ``(num_blocks + 1) * block_size`` (``cache.write_trash_index``, never read). No block it
        hands out is reserved. TypeError unless both are ints, ValueError unless >= 1."""
        num_blocks = check_int("PaddingProfile.transformers: num_blocks", num_blocks)
        block_size = check_int("PaddingProfile.transformers: block_size", block_size)
        return PaddingProfile("transformers", pad_slot_id=(num_blocks + 1) * block_size,
                              null_block=num_blocks)

    def check_pool(self, num_kv_blocks: int, block_size: int) -> None:
        """ValueError unless this profile fits a KV pool of ``num_kv_blocks`` blocks of
        ``block_size`` tokens: the null block is 0 or outside the pool, and a pad slot >= 0 is
        in the null block (SGLang's slot 0) or in a block outside ``[pool_start,
        num_kv_blocks)`` (transformers' write trash), never in a block a request can hold."""
        if self.null_block != 0 and self.null_block < num_kv_blocks:
            raise ValueError(f"PaddingProfile {self.name!r}: null_block {self.null_block} is a "
                             f"block requests hold (ids in [0, {num_kv_blocks})); it must be 0 "
                             f"or >= num_kv_blocks")
        if self.pad_slot_id >= 0:
            blk = self.pad_slot_id // block_size
            if blk != self.null_block and self.pool_start <= blk < num_kv_blocks:
                raise ValueError(f"PaddingProfile {self.name!r}: pad_slot_id {self.pad_slot_id} "
                                 f"lies in block {blk}, which requests can hold (pool of "
                                 f"{num_kv_blocks} blocks of {block_size}); dummy rows would "
                                 f"overwrite its KV")


PaddingProfile.VLLM = PaddingProfile("vllm")
PaddingProfile.SGLANG = PaddingProfile("sglang", pad_slot_id=0)


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
            (dummy rows: the profile's pad slot; vLLM's PAD_SLOT_ID -1 writes no KV).
        seq_lens: int32 [R], tokens of the request including this step's
            (dummy rows: seq_len_fill, >= 1).
        query_start_loc: int32 [R+1], token-row offsets (decode: r * q).
        block_table: int32 [R, W], block ids; dummy rows and the columns past a real
            row's blocks hold the profile's null block (vLLM: 0).
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
        pad_token_id: token of dummy rows (must be a valid id); overrides the profile's.
        seq_len_fill: seq_len of dummy rows, the attention backend's fill value
            (vLLM: ``get_cuda_graph_seq_len_fill_value``); must be >= 1; overrides the
            profile's.
        padding: the runner's :class:`PaddingProfile` (default ``PaddingProfile.VLLM``);
            ``buffers.padding`` is it with ``pad_token_id`` / ``seq_len_fill`` applied.

    Raises:
        TypeError: a size is not an int, padding is not a PaddingProfile, or
            pad_token_id / seq_len_fill is not an int (checked by PaddingProfile).
        ValueError: a size is < 1, or seq_len_fill < 1 / pad_token_id < 0 (checked by
            PaddingProfile, the one place the pad values are checked).
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int, *,
                 uniform_decode_query_len: int = 1, device: torch.device | str = "cpu",
                 pad_token_id: int | None = None, seq_len_fill: int | None = None,
                 padding: PaddingProfile | None = None) -> None:
        max_num_reqs = check_int("max_num_reqs", max_num_reqs)
        max_num_blocks_per_req = check_int("max_num_blocks_per_req", max_num_blocks_per_req)
        block_size = check_int("block_size", block_size)
        q = check_int("uniform_decode_query_len", uniform_decode_query_len)
        if padding is None:
            padding = PaddingProfile.VLLM
        if not isinstance(padding, PaddingProfile):
            raise TypeError(f"padding must be a PaddingProfile, got {type(padding).__name__}")
        overrides = {k: v for k, v in (("pad_token_id", pad_token_id),
                                       ("seq_len_fill", seq_len_fill)) if v is not None}
        # replace() runs PaddingProfile's checks on the overrides (the one check of them).
        padding = replace(padding, **overrides) if overrides else padding
        self.padding = padding
        pad_token_id, seq_len_fill = padding.pad_token_id, padding.seq_len_fill
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
        # it hold the profile's null block), the token sampled for each row, tokens accepted
        # per row.
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
        self.slot_mapping.fill_(self.padding.pad_slot_id)
        self.seq_lens.fill_(self.seq_len_fill)
        self.block_table.fill_(self.padding.null_block)
        self.counts.zero_()
        self.num_blocks_per_row.zero_()
        self.sampled.zero_()
        self.accepted.fill_(1)
        self.staging[: staging.HEADER_WORDS].zero_()

    def check_padded_size(self, padded_size, *, field: str = "padded_size",
                          lo: int = 1) -> int:
        """``padded_size`` as a Python int, checked: a padded size in token rows that these
        buffers hold, a multiple of q = ``uniform_decode_query_len`` in
        [lo, max_num_reqs * q]. The one check of a padded size: every public call that takes
        one from its caller (``views``, ``zos.kernels.launch_prep``, both backends' ``build``
        through ``MetadataBackend.check_build``, ``SpecDecoder.propose`` / ``verify``,
        ``MetadataBackend.stage``'s ``min_padded_size``) calls it, with the same message.

        Raises:
            TypeError: not an int (``field`` named).
            ValueError: out of that range or not a multiple of q (``field`` and the value
                named).
        """
        q, top = self.uniform_decode_query_len, self.max_num_reqs * self.uniform_decode_query_len
        v = check_int(field, padded_size, lo=None)  # the type; the range in one message below
        if not lo <= v <= top or v % q:
            raise ValueError(f"{field} must be a multiple of uniform_decode_query_len={q} in "
                             f"[{lo}, {top}], got {padded_size!r}")
        return v

    def views(self, num_reqs: int, padded_size: int) -> StepMetadata:
        """Prefix views for a step of ``num_reqs`` requests padded to ``padded_size`` token
        rows. TypeError / ValueError unless padded_size is an int in [0, max_num_reqs * q]
        that q divides (:meth:`check_padded_size`) and num_reqs an int in
        [0, padded_size // q] (the real rows are among the padded ones)."""
        q = self.uniform_decode_query_len
        padded_size = self.check_padded_size(padded_size, lo=0)
        r = padded_size // q
        num_reqs = check_int("num_reqs", num_reqs, lo=0)
        if num_reqs > r:
            raise ValueError(f"num_reqs {num_reqs} exceeds the {r} request rows of padded_size "
                             f"{padded_size}")
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
