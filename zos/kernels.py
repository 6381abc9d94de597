"""Launchers of the prep kernels: check the buffers, then launch with fixed grids."""
from __future__ import annotations

import zos._interpret  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

from typing import Any

import torch
import triton

from zos.buffers import DecodeBuffers
from zos.triton_kernels import prep
from zos.triton_kernels.prep import rebuild_rows, scatter_listed_rows

# The ring state's word offsets (CTR, LAST, CUR, CUR_N, CUR_M, CUR_C, CUR_SEQ, FINISHED) and
# the row map's IN_PLACE, as plain ints for the host: the kernels read the same values as
# constexpr globals of zos.triton_kernels.prep, where they are defined (with the staging
# layout).
RING_STATE = {name: getattr(prep, name).value
              for name in ("CTR", "LAST", "CUR", "CUR_N", "CUR_M", "CUR_C", "CUR_SEQ",
                           "FINISHED")}
RING_STATE_WORDS = prep.RING_STATE_WORDS
IN_PLACE = prep.IN_PLACE.value


class PrepState:
    """The device words the prep kernels keep besides the buffers: the ring state and the
    row map.

    Attributes:
        state: int32 [RING_STATE_WORDS] on the buffers' device (CTR, LAST, CUR and the
            header copy: see ``RING_STATE``), zeros: the first new record has SEQ 1 and lies
            in slot 0.
        row_map: int32 [max_num_reqs, 2] on the buffers' device: (src, rec) of the rows the
            running build lists, (IN_PLACE, -1) for every row between builds (launch 1
            writes the listed rows' entries, launch 2 reads and resets them).
        done: int32 [1] on the buffers' device: the done word of builds given none (the
            SEQ of the record applied last; the copy path's, which no host reads).
    """

    def __init__(self, buffers: DecodeBuffers) -> None:
        i32 = dict(dtype=torch.int32, device=buffers.device)
        self.state = torch.zeros(RING_STATE_WORDS, **i32)
        self.row_map = torch.empty((buffers.max_num_reqs, 2), **i32)
        self.row_map[:, 0] = IN_PLACE
        self.row_map[:, 1] = -1
        self.done = torch.zeros(1, **i32)


def _default_state(buffers: DecodeBuffers) -> PrepState:
    """The state of ``launch_prep`` calls without a ring (one per buffers object)."""
    state = getattr(buffers, "_zos_prep_state", None)
    if state is None:
        state = buffers._zos_prep_state = PrepState(buffers)
    return state


def launch_prep(buffers: DecodeBuffers, padded_size: int, *, ring: Any = None,
                num_slots: int = 1, slot_words: int | None = None,
                state: PrepState | None = None, done: Any = None) -> None:
    """Rebuild the metadata of a step padded to ``padded_size`` token rows, in place.

    Reads the staged record (layout: csrc/staging.h; real row count N at word
    ``zos.staging.NUM_REQS``; the kernels read every offset as a constexpr global of
    zos.triton_kernels.prep) from slot
    ``state``'s CTR of ``ring`` (``num_slots`` records of ``slot_words`` int32 words: a
    :class:`zos.staging_ring.StagingRing`'s device view) when that record is new, else from
    the slot applied last; by default (``ring`` None) from ``buffers.staging``, one slot, as
    the copy path uploads it. Also reads ``buffers.sampled`` and ``buffers.accepted`` (int32
    [max_num_reqs], written by the previous step's sampler) and the previous step's rows.
    Writes, in place, ``input_ids``, ``positions``, ``slot_mapping`` (token rows
    [0, padded_size)), ``seq_lens``, ``query_start_loc``, ``block_table``,
    ``num_blocks_per_row`` (request rows [0, padded_size // q)) and ``counts``, and the ring
    state; rows past the real N get the dummy values of ``buffers.padding`` (the runner's
    PaddingProfile). When the build has finished reading the record, its SEQ is written to
    ``done`` (int32 [1]: the ring's done word, ``StagingRing.done_view``; by default
    ``state.done``). Two launches, grid (padded_size // q,), no host synchronisation and no
    host value of N or of the slot: capturable once per bucket.

    Raises:
        TypeError, ValueError: padded_size not an int multiple of q in [1, max_num_reqs * q]
            (``DecodeBuffers.check_padded_size``); nothing is launched.
    """
    b, q = buffers, buffers.uniform_decode_query_len
    padded_size = b.check_padded_size(padded_size)
    if ring is None:
        ring, num_slots, slot_words = b.staging, 1, b.staging.numel()
    st = state if state is not None else _default_state(b)
    padded_reqs = padded_size // q
    w = b.max_num_blocks_per_req
    block_w = min(256, triton.next_power_of_2(w))
    grid = (padded_reqs,)
    scatter_listed_rows[grid](
        ring, st.state, num_slots, slot_words, st.row_map,
        b.positions, b.num_blocks_per_row, b.block_table,
        b.scratch_pos, b.scratch_num_blocks_per_row, b.scratch_block_table, w,
        Q=q, BLOCK_W=block_w)
    rebuild_rows[grid](
        ring, st.state, num_slots, slot_words, st.row_map,
        done if done is not None else st.done, b.sampled, b.accepted,
        b.input_ids, b.positions, b.slot_mapping, b.seq_lens, b.query_start_loc,
        b.block_table, b.num_blocks_per_row, b.counts,
        b.scratch_pos, b.scratch_num_blocks_per_row, b.scratch_block_table,
        w, b.block_size, b.pad_token_id, b.seq_len_fill, b.padding.pad_slot_id,
        b.padding.null_block,
        Q=q, Q_POW2=triton.next_power_of_2(q), BLOCK_W=block_w)
