"""zos's decode metadata written into vLLM runner v2's persistent input tensors.

vLLM 0.26's model runner v2 (``vllm/v1/worker/gpu/``) captures its CUDA graphs over persistent
tensors: ``InputBuffers.input_ids`` / ``positions`` / ``query_start_loc`` / ``seq_lens``,
``BlockTables.input_block_tables[g]`` and ``BlockTables.slot_mappings[g]``. A pure-decode step
(one token per request) prepared by zos (:class:`~zos.buffers.StepMetadata`, built from a
:class:`~zos.integrations.vllm_steps.VllmStep`) reaches them through
:func:`write_vllm_decode_inputs`: one launch, the real row count read on the device, runner v2's
padding written as ``prepare_inputs`` / ``prepare_pos_seq_lens`` / ``gather_block_tables`` /
``compute_slot_mappings`` write it (query_start_loc of padded rows = N, seq_lens 0 up to
max_num_reqs, zeroed block rows up to the padded row count, PAD_SLOT_ID -1 from N to the end of
the slot mapping); what runner v2 leaves stale (ids and positions past N, block columns past a
row's blocks) zos leaves too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from zos._checks import check_int
from zos.buffers import StepMetadata
from zos.triton_kernels.vllm_layout import write_vllm_decode_inputs as _kernel

PAD_SLOT_ID = -1  # vLLM's slot of a token that writes no KV (v1/attention/backends/utils.py)


def _check_tensor(name: str, t, dtype: torch.dtype, ndim: int, device: torch.device) -> None:
    """TypeError unless ``t`` is a ``dtype`` tensor; ValueError unless it is ``ndim``-D on
    ``device`` and contiguous in its last dimension (the kernel's pointer arithmetic)."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        raise TypeError(f"{name} must be a {dtype} tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != ndim or t.device != device or t.stride(-1) != 1:
        raise ValueError(f"{name} must be {ndim}-D, contiguous in its last dimension, on "
                         f"{device}; got shape {tuple(t.shape)} on {t.device}")


@dataclass(frozen=True)
class VllmDecodeInputs:
    """The runner v2 tensors a decode step writes (KV-cache group 0), all on one device.

    Attributes:
        input_ids: int32 [max_num_tokens] (``input_buffers.input_ids``).
        positions: int64 [max_num_tokens] (``input_buffers.positions``).
        query_start_loc: int32 [max_num_reqs + 1] (``input_buffers.query_start_loc``).
        seq_lens: int32 [max_num_reqs] (``input_buffers.seq_lens``).
        block_table: int32 [max_num_reqs, W'] (``block_tables.input_block_tables[0]``), rows
            contiguous.
        slot_mapping: int64 [max_num_tokens] (``block_tables.slot_mappings[0]``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor

    def check(self) -> tuple[int, int]:
        """(max_num_reqs, max_num_tokens) after checking every tensor's dtype, shape, device
        and contiguity against the attributes' (TypeError for a dtype, ValueError else)."""
        want = {"input_ids": (torch.int32, 1), "positions": (torch.int64, 1),
                "query_start_loc": (torch.int32, 1), "seq_lens": (torch.int32, 1),
                "block_table": (torch.int32, 2), "slot_mapping": (torch.int64, 1)}
        for name, (dtype, ndim) in want.items():
            _check_tensor(name, getattr(self, name), dtype, ndim, self.input_ids.device)
        max_reqs, max_tokens = self.seq_lens.numel(), self.input_ids.numel()
        for name, size in (("positions", max_tokens), ("slot_mapping", max_tokens),
                           ("query_start_loc", max_reqs + 1),
                           ("block_table", max_reqs)):
            if getattr(self, name).shape[0] != size:
                raise ValueError(f"{name} must have {size} rows (max_num_tokens = {max_tokens}, "
                                 f"max_num_reqs = {max_reqs}), got {getattr(self, name).shape[0]}")
        if max_tokens < max_reqs:
            raise ValueError(f"input_ids ({max_tokens} tokens) must hold a token per row of "
                             f"seq_lens ({max_reqs})")
        return max_reqs, max_tokens


def write_vllm_decode_inputs(meta: StepMetadata, carry: torch.Tensor, idx_mapping: torch.Tensor,
                             last_sampled_tokens: torch.Tensor, out: VllmDecodeInputs,
                             padded_reqs: int) -> None:
    """Write the decode step of ``meta`` (zos's views, one token per request row, its real row
    count N in ``meta.counts[0]`` on the device) into ``out`` in runner v2's layout, padded to
    ``padded_reqs`` request rows (vLLM's ``batch_desc.num_reqs``; >= N, which only the device
    knows). One launch on the current stream, capturable in a CUDA graph (N is read there; every
    tensor must then keep its address, as runner v2's persistent ones do).

    zos's token of row r (``meta.input_ids[r]``) is not a token here but the row's request
    index in vLLM's request state: the caller stages each new row with its index as the token
    (in [0, last_sampled_tokens.shape[0]): ``ZosVllmPrep``'s backend takes ``vocab_size =
    max_num_reqs``, so zos's packer refuses any other), and this launch writes every row's index
    into ``carry`` (int32 [>= N], zos's ``DecodeBuffers.sampled``: the token zos gives a carried
    row in the next step), so a request keeps its index through zos's remap with no upload. It
    also writes the index into ``idx_mapping`` (int32 [>= N], runner v2's
    ``InputBatch.idx_mapping``). The input tokens are vLLM's: row r's is
    ``last_sampled_tokens[idx, 0]`` (int64 [max_num_reqs, 1], ``req_states.last_sampled_tokens``).

    Raises:
        TypeError / ValueError: a tensor of ``out`` off its dtype, shape or device
            (:meth:`VllmDecodeInputs.check`), ``carry`` / ``idx_mapping`` /
            ``last_sampled_tokens`` off theirs (dtype: TypeError; 1-D / 2-D, contiguous in the
            last dimension, on ``out``'s device; ``carry`` and ``idx_mapping`` of at least N
            rows), ``meta`` not a decode step of one token per row or
            on another device, its block table wider than ``out``'s, or ``padded_reqs`` not an
            int in [1, max_num_reqs]; nothing is written then.
    """
    max_reqs, max_tokens = out.check()
    padded_reqs = check_int("padded_reqs", padded_reqs)
    if padded_reqs > max_reqs:
        raise ValueError(f"padded_reqs must be <= max_num_reqs = {max_reqs}, got {padded_reqs}")
    if meta.counts is None or meta.padded_size != meta.block_table.shape[0]:
        raise ValueError("meta must be a decode step of one token per request row (a "
                         "DecodeBuffers view with uniform_decode_query_len 1)")
    if meta.input_ids.device != out.input_ids.device:
        raise ValueError(f"meta is on {meta.input_ids.device}, out on {out.input_ids.device}")
    for name, t in (("carry", carry), ("idx_mapping", idx_mapping)):
        _check_tensor(name, t, torch.int32, 1, out.input_ids.device)
        if t.numel() < meta.num_reqs:
            raise ValueError(f"{name} holds {t.numel()} rows, the step {meta.num_reqs}")
    _check_tensor("last_sampled_tokens", last_sampled_tokens, torch.int64, 2,
                  out.input_ids.device)
    rows, width = meta.block_table.shape
    if rows > max_reqs or width > out.block_table.shape[1]:
        raise ValueError(f"meta's block table [{rows}, {width}] does not fit out's "
                         f"{tuple(out.block_table.shape)}")
    launch_unchecked(meta, carry, idx_mapping, last_sampled_tokens, out, padded_reqs, max_reqs,
                     max_tokens)


def launch_unchecked(meta: StepMetadata, carry: torch.Tensor, idx_mapping: torch.Tensor,
                     last_sampled_tokens: torch.Tensor, out: VllmDecodeInputs, padded_reqs: int,
                     max_reqs: int, max_tokens: int) -> None:
    """:func:`write_vllm_decode_inputs`'s launch without its checks, for a caller that made
    them once for tensors it launches over every step (``max_reqs, max_tokens`` from
    :meth:`VllmDecodeInputs.check`; ``meta`` any view of the same buffers: the kernel reads
    the real row count from ``meta.counts``)."""
    _kernel[(max_reqs + 1,)](
        meta.counts, meta.input_ids, carry, idx_mapping, last_sampled_tokens,
        last_sampled_tokens.stride(0),
        meta.positions, meta.seq_lens, meta.block_table,
        meta.block_table.stride(0), meta.slot_mapping, out.input_ids, out.positions,
        out.query_start_loc, out.seq_lens, out.block_table, out.block_table.stride(0),
        out.slot_mapping, padded_reqs, max_reqs, max_tokens, meta.block_table.shape[1],
        out.block_table.shape[1], PAD_SLOT_ID, BLOCK=256)
