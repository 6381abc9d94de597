"""The host-built baseline: the same metadata built on the host and copied each step.

This is how engines without device-side prep work (vLLM v1's InputBatch and
BlockTable, SGLang's ForwardBatch): keep the rows on the host, apply the step's
changes there, then copy every field of rows [0, B) to the device. We make it as
strong as we can: the step is validated and remapped by the same C++ packer,
the rows are rebuilt by numba-compiled loops into pinned arrays (a row that
moves is gathered to scratch first, the others are updated in place), and the
block table is uploaded compacted to the columns in use (B x C, not B x W).
"""
from __future__ import annotations

import time

import numba
import numpy as np
import torch

from zos import staging
from zos.backend import MetadataBackend, StepPlan
from zos.buckets import BucketTable
from zos.buffers import DecodeBuffers
from zos.step import DecodeStep


def _make_build_rows(HEADER_WORDS, RECORD_WORDS, NUM_REQS, NUM_RECORDS,
                     R_TOKEN, R_POS0, R_COL0, R_COUNT, R_BLK_OFF,
                     NUM_LISTED, LIST_WORDS, L_ROW, L_SRC, L_REC):
    """The numba row builder for one staging layout (word offsets, from zos.staging).

    The layout is bound as closure variables, not read from module globals: numba freezes
    both at compile time, but only closure variables are part of its on-disk cache key, so
    a rebuilt ``_C`` with another layout recompiles instead of reusing a stale cache.
    """

    @numba.njit(cache=True, nogil=True)
    def _build_rows(rec, sampled, accepted, q, block_size, pad_token_id, seq_len_fill,
                    pad_slot_id, null_block, padded_reqs, input_ids, positions, slot_mapping,
                    seq_lens, qsl, block_table, num_blocks_per_row, scratch_pos, scratch_nb,
                    scratch_bt, bt_compact, row_src, row_rec):  # pragma: no cover - numba
        """Apply one staging record (csrc/staging.h) to the host rows; returns C, the
        block-table columns to upload, and writes rows [0, padded_reqs) x [0, C) of
        the block table into ``bt_compact`` (row-major, stride C). ``row_src`` and
        ``row_rec`` (int32 [R]) get each row's previous row (-1: new) and record index
        (-1: none) for rows [0, N); an unlisted row holds its request in place."""
        n = rec[NUM_REQS]
        m = rec[NUM_RECORDS]
        c = rec[NUM_LISTED]
        rec0 = HEADER_WORDS + LIST_WORDS * c
        blk0 = rec0 + RECORD_WORDS * m
        for r in range(n):
            row_src[r] = r
            row_rec[r] = -1
        for k in range(c):
            e = HEADER_WORDS + LIST_WORDS * k
            row_src[rec[e + L_ROW]] = rec[e + L_SRC]
            row_rec[rec[e + L_ROW]] = rec[e + L_REC]
        for r in range(n):  # gather rows that move, before any row is overwritten
            j = row_src[r]
            if j >= 0 and j != r:
                scratch_pos[r] = positions[j * q]
                nb = num_blocks_per_row[j]
                scratch_nb[r] = nb
                scratch_bt[r, :nb] = block_table[j, :nb]
        cols = 0
        for r in range(padded_reqs):
            old_nb = num_blocks_per_row[r]
            if r < n:
                src = row_src[r]
                k = row_rec[r]
                at = rec0 + RECORD_WORDS * k  # row r's record (k >= 0 for every new row)
                if src >= 0:
                    token = sampled[src]
                    if src == r:
                        pos0 = positions[r * q] + accepted[src]
                        nb_src = old_nb
                    else:
                        pos0 = scratch_pos[r] + accepted[src]
                        nb_src = scratch_nb[r]
                        block_table[r, :nb_src] = scratch_bt[r, :nb_src]
                else:
                    token = rec[at + R_TOKEN]
                    pos0 = rec[at + R_POS0]
                    nb_src = 0
                nb_new = nb_src
                if k >= 0:
                    col0 = rec[at + R_COL0]
                    cnt = rec[at + R_COUNT]
                    off = blk0 + rec[at + R_BLK_OFF]
                    block_table[r, col0:col0 + cnt] = rec[off:off + cnt]
                    nb_new = col0 + cnt
                # past the row's blocks: a previous occupant's or (a rewritten list that
                # shrank) the columns gathered from scratch
                block_table[r, nb_new:max(old_nb, nb_src)] = null_block
                num_blocks_per_row[r] = nb_new
                for t in range(q):
                    p = pos0 + t
                    positions[r * q + t] = p
                    slot_mapping[r * q + t] = (np.int64(block_table[r, p // block_size])
                                               * block_size + p % block_size)
                input_ids[r * q] = token
                for t in range(1, q):  # draft rows: a drafter on the device fills them
                    input_ids[r * q + t] = pad_token_id
                seq_lens[r] = pos0 + q
            else:
                block_table[r, :old_nb] = null_block
                num_blocks_per_row[r] = 0
                nb_new = 0
                for t in range(q):
                    input_ids[r * q + t] = pad_token_id
                    positions[r * q + t] = 0
                    slot_mapping[r * q + t] = pad_slot_id
                seq_lens[r] = seq_len_fill
            qsl[r + 1] = (r + 1) * q
            cols = max(cols, old_nb, nb_new)
        qsl[0] = 0
        for r in range(padded_reqs):
            bt_compact[r * cols:(r + 1) * cols] = block_table[r, :cols]
        return cols

    return _build_rows


_build_rows = _make_build_rows(staging.HEADER_WORDS, staging.RECORD_WORDS, staging.NUM_REQS,
                               staging.NUM_RECORDS, staging.R_TOKEN, staging.R_POS0,
                               staging.R_COL0, staging.R_COUNT, staging.R_BLK_OFF,
                               staging.NUM_LISTED, staging.LIST_WORDS, staging.L_ROW,
                               staging.L_SRC, staging.L_REC)


class HostMetadataBackend(MetadataBackend):
    """Builds each step's metadata on the host and copies it to the same buffers.

    Per step: pack (C++), read the previous step's sampled tokens back (one
    synchronous D2H copy of P int32: a host-built batch cannot know its input
    tokens otherwise), rebuild rows in numba, then seven H2D copies (input_ids,
    positions, slot_mapping, seq_lens, query_start_loc, counts, the compacted
    block table) and one device copy that scatters the block table into its
    strided rows. ``build`` does nothing: the data is already on its way.

    With ``input_ids_from_device`` the read-back goes: carried rows' input ids are gathered
    on the device from ``buffers.sampled`` by the row's previous index (uploaded with the
    rest, 4N bytes), as vLLM V1 does under async scheduling, so ``stage`` never waits for the
    previous step's tokens and the host can run a step ahead of the GPU (an overlapped engine).

    With draft tokens (q > 1) every ``stage`` also reads the previous step's accepted counts
    back synchronously (``buffers.accepted``, P int32), in both modes: the positions of
    carried rows depend on them. That wait is what a host-built path pays for speculative
    decoding; ``accepted_wait_seconds`` sums it. Token rows 1..q-1 of each request get the pad
    token here (as in the prep kernels); a drafter on the device (``zos.spec``) writes them
    after the copies.

    Args: see :class:`MetadataBackend`; ``input_ids_from_device`` as above.
    """

    name = "host"

    def __init__(self, buffers: DecodeBuffers, *, num_kv_blocks: int, vocab_size: int,
                 buckets: BucketTable | None = None, input_ids_from_device: bool = False
                 ) -> None:
        super().__init__(buffers, num_kv_blocks=num_kv_blocks, vocab_size=vocab_size,
                         buckets=buckets)
        b = buffers
        cuda = b.device.type == "cuda"
        q = b.uniform_decode_query_len
        r, t, w = b.max_num_reqs, b.max_num_reqs * q, b.max_num_blocks_per_req

        def pinned(n, dtype=torch.int32, fill=0):
            return torch.full((n,), fill, dtype=dtype, pin_memory=cuda)

        self._h = dict(input_ids=pinned(t, fill=b.pad_token_id), positions=pinned(t),
                       slot_mapping=pinned(t, torch.int64, b.padding.pad_slot_id),
                       seq_lens=pinned(r, fill=b.seq_len_fill),
                       query_start_loc=pinned(r + 1), counts=pinned(2))
        self._sampled = pinned(r)
        self.input_ids_from_device = input_ids_from_device
        self._row_src = pinned(r)  # previous row of each row (-1: new), for the device gather
        self._row_rec = np.zeros(r, np.int32)
        self._row_src_dev = torch.zeros(r, dtype=torch.int32, device=b.device)
        self._gather_idx = torch.zeros(r, dtype=torch.int32, device=b.device)
        self._gathered = torch.zeros(r, dtype=torch.int32, device=b.device)
        # Tokens each previous row kept: 1 in plain decode; with drafts (q > 1) read back
        # synchronously in every stage (a host-built batch cannot place its positions
        # otherwise), the time spent waiting summed in ``accepted_wait_seconds``.
        self._accepted = pinned(r, fill=1)
        self._accepted_np = self._accepted.numpy()
        self.accepted_wait_seconds = 0.0
        self._bt_compact = pinned(r * w)
        self._bt_device = torch.zeros(r * w, dtype=torch.int32, device=b.device)
        self._record = np.zeros(b.staging.numel(), np.int32)
        self._block_table = np.full((r, w), b.padding.null_block, np.int32)
        self._num_blocks_per_row = np.zeros(r, np.int32)
        self._scratch_pos = np.zeros(r, np.int32)
        self._scratch_nb = np.zeros(r, np.int32)
        self._scratch_bt = np.zeros((r, w), np.int32)
        # Token rows the last stage wrote; at first every row (the buffers are reset below).
        self._staged_rows = t
        # Recorded after each stage's copies. External: a build captured into a graph waits for
        # it at every replay (cudaEventWaitExternal). Recorded once now, so that it exists.
        self._fence = torch.cuda.Event(external=True) if cuda else None
        if cuda:
            self._fence.record(torch.cuda.current_stream(b.device))
        self._np = {k: v.numpy() for k, v in self._h.items()}
        self._np.update(sampled=self._sampled.numpy(), bt_compact=self._bt_compact.numpy())
        self._take_over()

    def _stage(self, step: DecodeStep, plan: StepPlan) -> StepPlan:
        """Pack, rebuild on the host and enqueue the copies of rows [0, bucket)."""
        b, h, q = self.buffers, self._h, self.buffers.uniform_decode_query_len
        if self._fence is not None:
            self._fence.synchronize()  # the last step's copies have read the pinned arrays
        prev = self.packer.prev_num_reqs
        if prev and q > 1:  # the positions of carried rows depend on the accepted counts
            t0 = time.perf_counter()
            self._accepted[:prev].copy_(b.accepted[:prev])  # synchronous read-back
            self.accepted_wait_seconds += time.perf_counter() - t0
            self.packer.apply_accepted(self._accepted_np[:prev], 0)
        self.packer.pack_step(step, self._record)
        if prev and not self.input_ids_from_device:
            self._sampled[:prev].copy_(b.sampled[:prev])  # synchronous read-back
        t, r = plan.padded_size, plan.padded_size // b.uniform_decode_query_len
        self._staged_rows = t
        a = self._np
        cols = _build_rows(self._record, a["sampled"], self._accepted_np,
                           b.uniform_decode_query_len, b.block_size,
                           b.pad_token_id, b.seq_len_fill, b.padding.pad_slot_id,
                           b.padding.null_block, r, a["input_ids"], a["positions"],
                           a["slot_mapping"], a["seq_lens"], a["query_start_loc"],
                           self._block_table, self._num_blocks_per_row, self._scratch_pos,
                           self._scratch_nb, self._scratch_bt, a["bt_compact"],
                           self._row_src.numpy(), self._row_rec)
        h["counts"][0], h["counts"][1] = plan.num_reqs, plan.num_tokens
        sizes = dict(input_ids=t, positions=t, slot_mapping=t, seq_lens=r,
                     query_start_loc=r + 1, counts=2)
        nbytes = 0
        for name, size in sizes.items():
            getattr(b, name)[:size].copy_(h[name][:size], non_blocking=True)
            nbytes += size * h[name].element_size()
        if cols:
            self._bt_device[: r * cols].copy_(self._bt_compact[: r * cols], non_blocking=True)
            b.block_table[:r, :cols].copy_(self._bt_device[: r * cols].view(r, cols))
            nbytes += 4 * r * cols
        n = plan.num_reqs
        if self.input_ids_from_device and prev and n:
            src = self._row_src_dev[:n]
            src.copy_(self._row_src[:n], non_blocking=True)
            nbytes += 4 * n
            idx, got = self._gather_idx[:n], self._gathered[:n]
            torch.clamp(src, min=0, out=idx)
            torch.index_select(b.sampled, 0, idx, out=got)
            row0 = b.input_ids[: n * q: q]  # token row 0 of each request row
            torch.where(src >= 0, got, row0, out=row0)
        if self._fence is not None:
            self._fence.record()
        self.last_upload_bytes = nbytes
        return plan

    def build(self, padded_size: int) -> None:
        """Nothing to compute: ``stage`` already enqueued the copies, on the stream current at
        the stage. On CUDA the current stream waits for them here (an event wait; under
        capture an event-wait node, so a graph replayed on any stream reads the copied
        rows). The other direction is the runner's: the next ``stage`` writes the buffers
        (and may read ``sampled`` back) on its stream, so a runner whose model and sampler run
        on another stream orders that stage after them (docs/ZOS.md, "The runner contract",
        rule 3).

        Raises:
            TypeError, ValueError: ``padded_size`` is not an int multiple of q in
                [N * q, max_num_reqs * q] (:meth:`check_build`), or, outside a CUDA graph
                capture, exceeds the token rows the last ``stage`` wrote (its plan's
                ``padded_size``: the rows past them hold an earlier step's values).
        """
        padded_size = self.check_build(padded_size)
        if padded_size > self._staged_rows and not (
                self._fence is not None and torch.cuda.is_current_stream_capturing()):
            raise ValueError(f"build: padded_size {padded_size} exceeds the "
                             f"{self._staged_rows} token rows the last stage wrote (its "
                             f"plan.padded_size); rows past them hold an earlier step's values")
        if self._fence is not None:
            self._fence.wait(torch.cuda.current_stream(self.buffers.device))
