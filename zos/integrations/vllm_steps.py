"""vLLM's scheduler outputs as zos decode steps (vLLM 0.26, model runner v2).

The host half of zos inside vLLM: :class:`VllmDecodeSteps` reads every ``SchedulerOutput``
the engine core hands the worker, keeps a mirror of each request's block ids and computed
tokens, and turns a pure-decode step into the :class:`~zos.step.DecodeStep` of what changed
since the last zos step (rows in vLLM's batch order). What it reads of vLLM's objects (field
names of ``vllm/v1/core/sched/output.py`` in 0.26.0):

* ``finished_req_ids``, ``preempted_req_ids`` (runner v2 sends a resumed request again as a new
  one, with all its blocks): requests dropped from the mirror;
* ``scheduled_new_reqs``: ``req_id``, ``block_ids`` (a tuple of one list per KV-cache group),
  ``num_computed_tokens``, ``prefill_token_ids`` (runner v2: the prompt, and for a resumed
  request the output so far; ``prompt_token_ids`` where None);
* ``scheduled_cached_reqs``: ``req_ids``, ``resumed_req_ids`` (runner v1: blocks replaced,
  not appended), ``new_block_ids`` (per request None or a tuple of lists),
  ``num_computed_tokens``;
* ``num_scheduled_tokens`` (request id -> tokens this step, in the scheduler's order),
  ``total_num_scheduled_tokens``, ``scheduled_spec_decode_tokens``.

Row order is vLLM's (``sort_batch_req_ids`` in ``vllm/v1/worker/gpu/model_runner.py``: uniform
decodes first, then by query length; stable, so a pure-decode step keeps the scheduler's
order). A row's position is its request's ``num_computed_tokens`` (runner v2's ``positions``),
its block-table row every block the scheduler gave the request (what runner v2 gathers). A
pure-decode step is one where every scheduled request runs one token past its prefill
(``num_computed_tokens >= len(prefill_token_ids)``: runner v2's ``is_prefilling`` rule; a
resumed request's last one-token prefill chunk is not a decode) and no draft token is
scheduled; any other step is vLLM's to prepare (``step`` returns None), as is every step of a
model with more than one KV-cache group, and of an engine with speculative decoding (under
asynchronous scheduling the scheduler's ``num_computed_tokens`` counts drafts not yet
verified, an upper bound of runner v2's positions). The caller checks that the one group is
full attention (sliding-window and Mamba groups are not zos's).

Under asynchronous scheduling (vLLM's default) the host does not know the token a request
sampled last: new rows stage the placeholder token 0, and every row's input token is vLLM's
(``last_sampled_tokens``, read on the device by
:func:`zos.integrations.vllm_buffers.write_vllm_decode_inputs`).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from zos._checks import check_int
from zos.step import DecodeStep

_NONE, _ZERO = np.zeros(0, np.int32), np.zeros(1, np.int32)  # shared by steps: read only
_NONE.flags.writeable = _ZERO.flags.writeable = False


@dataclass(frozen=True)
class VllmStep:
    """One pure-decode step of vLLM as zos stages it (host only).

    Attributes:
        step: what changed since the last zos step; ``step.req_ids`` are zos's ids (int64, one
            per request lifetime: a request that leaves and comes back is new).
            ``step.new_tokens`` are placeholders (0): the input tokens are vLLM's.
        req_ids: vLLM's request id of each row, in vLLM's batch order.
    """

    step: DecodeStep
    req_ids: list[str]


class VllmDecodeSteps:
    """The mirror of vLLM's requests and the rows of the last zos step.

    Each request vLLM runs holds a slot of the mirror's arrays (its block ids, computed tokens,
    prefill length, and its zos id, position and block count in the last zos step), so a step
    costs a dict lookup per row and numpy over the rows; only requests that get blocks in a
    step are visited one by one.

    Args:
        block_size: tokens per KV block (vLLM's ``cache_config.block_size``).
        max_num_reqs: rows zos's buffers hold (vLLM's ``max_num_seqs``).
        max_num_blocks_per_req: block-table width (``cdiv(max_model_len, block_size)``).
        num_speculative_tokens: vLLM's ``speculative_config.num_speculative_tokens`` (0: none);
            above 0 no step is zos's (module docstring).

    Raises:
        TypeError / ValueError: a size is not an int >= 1, ``num_speculative_tokens`` not an
            int >= 0.
    """

    def __init__(self, *, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int,
                 num_speculative_tokens: int = 0) -> None:
        self.block_size = check_int("block_size", block_size)
        self.max_num_reqs = check_int("max_num_reqs", max_num_reqs)
        self.max_num_blocks_per_req = check_int("max_num_blocks_per_req", max_num_blocks_per_req)
        self.speculative = check_int("num_speculative_tokens", num_speculative_tokens, lo=0) > 0
        self.single_group = True  # False once a request holds blocks of two KV-cache groups
        self.slot_of: dict[str, int] = {}  # vLLM request id -> its slot
        self._free: list[int] = []
        self._slots = 0  # the arrays' rows
        self._grow(max_num_reqs)
        self._stamp = 0  # counts _build calls: a step's stamp is >= 1
        # the stamp of the last zos step, 0 after a step that is not zos's (zos's row state
        # on the device no longer follows vLLM's): a row carries over only from that step
        self._prev = 0
        self.next_id = 0
        self._cached_slots = np.zeros(0, np.intp)  # the last output's cached requests' slots

    def _grow(self, slots: int) -> None:
        """Room for ``slots`` requests (the arrays keep their rows)."""
        old, self._slots = self._slots, slots
        width = self.max_num_blocks_per_req
        new = {"blocks": np.zeros((slots, width), np.int32),
               **{name: np.zeros(slots, np.int64) for name in (
                   "num_blocks", "computed", "prefill_len", "zid", "last_stamp", "last_pos",
                   "last_num_blocks")}}
        for name, arr in new.items():
            if old:
                arr[:old] = getattr(self, name)
            setattr(self, name, arr)
        self._free.extend(range(slots - 1, old - 1, -1))

    def step(self, scheduler_output) -> VllmStep | None:
        """Read one ``SchedulerOutput`` (every step's, in order: the mirror follows them all)
        and return its zos step, or None when it is not a pure-decode step or a row's position
        or blocks lie past the block table (then it is vLLM's to prepare). The rows of a
        returned step are the reference of the next one's: :meth:`forget` if it is not run.

        Raises:
            ValueError: a cached request the earlier outputs never brought (a step was
                skipped).
        """
        self._observe(scheduler_output)
        return self._build(scheduler_output)

    def forget(self) -> None:
        """No row carries over to the next step (a returned step was refused or not run)."""
        self._prev = 0

    def _set_blocks(self, slot: int, start: int, block_ids: list[int]) -> None:
        """Block ids ``block_ids`` at columns ``start`` on of ``slot`` (those past the block
        table are counted, not kept: a row holding them is vLLM's to prepare)."""
        end = start + len(block_ids)
        keep = min(end, self.max_num_blocks_per_req)
        if keep > start:
            self.blocks[slot, start:keep] = block_ids[:keep - start]
        self.num_blocks[slot] = end

    def _observe(self, so) -> None:
        """The mirror after ``so``: finished and preempted requests leave, new ones come with
        all their blocks, cached ones get this step's blocks and computed tokens."""
        slot_of = self.slot_of
        for gone in (so.finished_req_ids, so.preempted_req_ids or ()):
            for rid in gone:
                slot = slot_of.pop(rid, None)
                if slot is not None:
                    self._free.append(slot)
        for new in so.scheduled_new_reqs:
            self.single_group &= len(new.block_ids) == 1
            tokens = (new.prompt_token_ids if new.prefill_token_ids is None
                      else new.prefill_token_ids)
            slot = slot_of.get(new.req_id)  # live and sent again as new: its slot is reused
            if slot is None:
                if not self._free:
                    self._grow(2 * self._slots)
                slot = slot_of[new.req_id] = self._free.pop()
            self._set_blocks(slot, 0, new.block_ids[0])
            self.computed[slot] = new.num_computed_tokens
            self.prefill_len[slot] = len(tokens)
            self.last_stamp[slot] = -1  # a new lifetime: in no zos step yet
        cached = so.scheduled_cached_reqs
        try:
            slots = np.fromiter(map(slot_of.__getitem__, cached.req_ids), np.intp,
                                len(cached.req_ids))
        except KeyError as e:
            raise ValueError(f"scheduler_output: cached request {e.args[0]!r} was never "
                             f"scheduled as new: step() must see every SchedulerOutput, in "
                             f"order") from None
        self._cached_slots = slots
        self.computed[slots] = cached.num_computed_tokens
        new_block_ids = cached.new_block_ids
        if new_block_ids.count(None) != len(new_block_ids):
            self._append_blocks(cached, slots)

    def _append_blocks(self, cached, slots: np.ndarray) -> None:
        """The blocks ``cached`` (a ``CachedRequestData``) gives its requests (at ``slots``)."""
        got = [i for i, blocks in enumerate(cached.new_block_ids) if blocks is not None]
        groups = [cached.new_block_ids[i] for i in got]
        self.single_group &= all(len(g) == 1 for g in groups)
        if cached.resumed_req_ids:  # runner v1's resume: a resumed request's blocks replaced
            for i, g in zip(got, groups):
                slot = int(slots[i])
                replaced = cached.req_ids[i] in cached.resumed_req_ids
                self._set_blocks(slot, 0 if replaced else int(self.num_blocks[slot]), g[0])
            return
        lists = [g[0] for g in groups]
        rows = slots[got]
        start = self.num_blocks[rows]
        if all(len(blocks) == 1 for blocks in lists):  # a decode step's: one block each
            keep = start < self.max_num_blocks_per_req  # past the block table: counted only
            self.blocks[rows[keep], start[keep]] = np.fromiter(
                (blocks[0] for blocks in lists), np.int64, len(lists))[keep]
            self.num_blocks[rows] = start + 1
            return
        counts = np.fromiter(map(len, lists), np.int64, len(lists))
        rows_of = np.repeat(rows, counts)
        cols = np.arange(len(rows_of)) + np.repeat(start - np.cumsum(counts) + counts, counts)
        keep = cols < self.max_num_blocks_per_req  # past the block table: counted, not kept
        self.blocks[rows_of[keep], cols[keep]] = np.fromiter(
            chain.from_iterable(lists), np.int64, len(rows_of))[keep]
        self.num_blocks[rows] = start + counts

    def _build(self, so) -> VllmStep | None:
        self._stamp += 1
        n = len(so.num_scheduled_tokens)
        if (self.speculative or not self.single_group or not 0 < n <= self.max_num_reqs
                or so.total_num_scheduled_tokens != n or so.scheduled_new_reqs
                or so.scheduled_spec_decode_tokens):
            self._prev = 0
            return None
        req_ids = list(so.num_scheduled_tokens)  # vLLM's order for a uniform step
        cached = so.scheduled_cached_reqs
        slots = (self._cached_slots if req_ids == cached.req_ids
                 else np.fromiter(map(self.slot_of.__getitem__, req_ids), np.intp, n))
        pos, num_blocks = self.computed[slots], self.num_blocks[slots]
        width = self.max_num_blocks_per_req
        if ((pos < self.prefill_len[slots]) | (pos >= width * self.block_size)
                | (pos // self.block_size >= num_blocks) | (num_blocks > width)).any():
            self._prev = 0
            return None
        # carried: a row of the last zos step one position back (its block list can only have
        # grown since: vLLM replaces a request's blocks only when it prefills again)
        carried = (self.last_stamp[slots] == self._prev) & (self.last_pos[slots] == pos - 1)
        new_rows, new_positions, indptr, flat = _NONE, _NONE, _ZERO, _NONE
        if not carried.all():  # rows new to zos: a fresh zos id, every block
            new_rows = np.flatnonzero(~carried).astype(np.int32)
            new_slots = slots[new_rows]
            self.zid[new_slots] = np.arange(self.next_id, self.next_id + len(new_rows))
            self.next_id += len(new_rows)
            new_counts = num_blocks[new_rows]
            indptr = np.zeros(len(new_rows) + 1, np.int32)
            np.cumsum(new_counts, out=indptr[1:])
            flat = self.blocks[new_slots][np.arange(width) < new_counts[:, None]]
            new_positions = pos[new_rows].astype(np.int32)
        # carried rows that got blocks since: the blocks past the ones zos holds
        before = self.last_num_blocks[slots]
        grown = np.flatnonzero(carried & (num_blocks > before))
        app_rows = app_blocks = _NONE
        if len(grown):
            counts = num_blocks[grown] - before[grown]
            app_rows = np.repeat(grown.astype(np.int32), counts)
            cols = np.arange(len(app_rows)) + np.repeat(before[grown] - np.cumsum(counts)
                                                        + counts, counts)
            app_blocks = self.blocks[slots[app_rows], cols]
        self.last_stamp[slots] = self._prev = self._stamp
        self.last_pos[slots], self.last_num_blocks[slots] = pos, num_blocks
        step = DecodeStep(self.zid[slots], new_rows, np.zeros(len(new_rows), np.int32),
                          new_positions, indptr, flat, app_rows, app_blocks, _NONE, _ZERO, _NONE)
        return VllmStep(step, req_ids)
