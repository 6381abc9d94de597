"""vLLM's scheduler outputs as zos decode steps (vLLM 0.26, model runner v2).

The host half of zos inside vLLM: :class:`VllmDecodeSteps` reads every ``SchedulerOutput``
the engine core hands the worker, keeps a mirror of each request's block ids and computed
tokens, and turns a pure-decode step into the :class:`~zos.step.DecodeStep` of what changed
since the last zos step (rows in vLLM's batch order). What it reads of vLLM's objects (field
names of ``vllm/v1/core/sched/output.py`` in 0.26.0):

* ``finished_req_ids``, ``preempted_req_ids`` (runner v2 sends a resumed request again as a new
  one, with all its blocks): requests dropped from the mirror;
* ``scheduled_new_reqs``: ``req_id``, ``block_ids`` (a tuple of one list per KV-cache group),
  ``num_computed_tokens``;
* ``scheduled_cached_reqs``: ``req_ids``, ``resumed_req_ids`` (blocks replaced, not
  appended), ``new_block_ids`` (per request None or a tuple of lists), ``num_computed_tokens``,
  ``num_output_tokens`` (0 while the request still prefills; under asynchronous scheduling the
  tokens in flight count);
* ``num_scheduled_tokens`` (request id -> tokens this step, in the scheduler's order),
  ``total_num_scheduled_tokens``, ``scheduled_spec_decode_tokens``.

Row order is vLLM's (``sort_batch_req_ids`` in ``vllm/v1/worker/gpu/model_runner.py``: uniform
decodes first, then by query length; stable, so a pure-decode step keeps the scheduler's
order). A row's position is its request's ``num_computed_tokens`` (runner v2's ``positions``),
its block-table row every block the scheduler gave the request (what runner v2 gathers). A
pure-decode step is one where every scheduled request runs one token, has produced output,
and no draft token is scheduled; any other step is vLLM's to prepare (``build`` returns None),
as are models with more than one KV-cache group (hybrid, sliding window).

Under asynchronous scheduling (vLLM's default) the host does not know the token a request
sampled last: new rows stage the placeholder token 0 and ``VllmStep.new_req_ids`` names their
requests, whose tokens the device reads from vLLM's ``last_sampled_tokens``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zos._checks import check_int
from zos.step import DecodeStep

PAD_SLOT_ID = -1  # vLLM's slot of a token that writes no KV (v1/attention/backends/utils.py)


@dataclass
class _Request:
    blocks: list[int]  # the request's block ids (KV-cache group 0), the scheduler's
    num_computed_tokens: int


@dataclass(frozen=True)
class VllmStep:
    """One pure-decode step of vLLM as zos stages it (host only).

    Attributes:
        step: what changed since the last zos step; ``step.req_ids`` are zos's ids (int64, one
            per request lifetime: a request that leaves and comes back is new).
        req_ids: vLLM's request id of each row, in vLLM's batch order.
        new_req_ids: vLLM's request id of each of ``step.new_rows``: their input token is the
            one vLLM last sampled for that request (``last_sampled_tokens``), not
            ``step.new_tokens`` (placeholders, 0).
    """

    step: DecodeStep
    req_ids: list[str]
    new_req_ids: list[str]


class VllmDecodeSteps:
    """The mirror of vLLM's requests and the rows of the last zos step.

    Args:
        block_size: tokens per KV block (vLLM's ``cache_config.block_size``).
        max_num_reqs: rows zos's buffers hold (vLLM's ``max_num_seqs``).
        max_num_blocks_per_req: block-table width (``cdiv(max_model_len, block_size)``).

    Raises:
        TypeError / ValueError: a size is not an int >= 1.
    """

    def __init__(self, *, block_size: int, max_num_reqs: int,
                 max_num_blocks_per_req: int) -> None:
        self.block_size = check_int("block_size", block_size)
        self.max_num_reqs = check_int("max_num_reqs", max_num_reqs)
        self.max_num_blocks_per_req = check_int("max_num_blocks_per_req", max_num_blocks_per_req)
        self.requests: dict[str, _Request] = {}
        self.single_group = True  # False once a request holds blocks of two KV-cache groups
        # vLLM request id -> (zos id, position, block list, its length then) of the last zos
        # step's rows: a step that
        # is not zos's empties it (zos's row state on the device no longer follows vLLM's)
        self.prev: dict[str, tuple[int, int, list[int]]] = {}
        self.next_id = 0

    def observe(self, scheduler_output) -> None:
        """Update the mirror from one step's ``SchedulerOutput`` (every step, prefill and mixed
        ones too, before :meth:`build`): finished and preempted requests leave, new ones come
        with all their blocks, cached ones get this step's blocks and computed tokens."""
        so = scheduler_output
        for gone in (so.finished_req_ids, so.preempted_req_ids or ()):
            for rid in gone:
                self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.single_group &= len(new.block_ids) == 1
            self.requests[new.req_id] = _Request(list(new.block_ids[0]), new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for rid, blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                         cached.num_computed_tokens):
            req = self.requests[rid]
            if blocks is not None:
                self.single_group &= len(blocks) == 1
                if rid in cached.resumed_req_ids:  # runner v1's resume: blocks replaced
                    req.blocks = list(blocks[0])
                else:
                    req.blocks.extend(blocks[0])
            req.num_computed_tokens = computed

    def is_pure_decode(self, scheduler_output) -> bool:
        """Every scheduled request runs one token of a request that has produced output, no
        draft tokens, no new request, one KV-cache group, at most ``max_num_reqs`` rows."""
        so = scheduler_output
        n = len(so.num_scheduled_tokens)
        cached = so.scheduled_cached_reqs
        return (self.single_group and 0 < n <= self.max_num_reqs
                and so.total_num_scheduled_tokens == n and not so.scheduled_new_reqs
                and not so.scheduled_spec_decode_tokens and len(cached.req_ids) == n
                and min(cached.num_output_tokens) > 0)

    def build(self, scheduler_output) -> VllmStep | None:
        """The zos step of ``scheduler_output`` (after :meth:`observe` of it), or None when it
        is not a pure-decode step or a row's position or blocks lie past the block table; the
        rows of a built step are the reference of the next one's (whether it is staged or refused
        later is the caller's: :meth:`forget` after a refusal)."""
        so = scheduler_output
        if not self.is_pure_decode(so):
            self.prev = {}
            return None
        bs, top = self.block_size, self.max_num_blocks_per_req * self.block_size
        req_ids = list(so.num_scheduled_tokens)  # vLLM's order for a uniform step
        prev_get = self.prev.get
        ids, rows = [], {}
        new_rows, new_req_ids, new_positions, indptr, flat = [], [], [], [0], []
        app_rows, app_blocks = [], []
        next_id = self.next_id
        for i, rid in enumerate(req_ids):
            req = self.requests[rid]
            pos, blocks = req.num_computed_tokens, req.blocks
            if pos >= top or not pos // bs < len(blocks) <= self.max_num_blocks_per_req:
                self.prev = {}
                return None
            prev = prev_get(rid)
            # carried: in the last zos step one position back, with the same block list (the
            # mirror's list object: observe() replaces it when vLLM does, else only appends)
            if prev is not None and prev[1] == pos - 1 and prev[2] is blocks:
                zid, k = prev[0], prev[3]
                app_rows.extend([i] * (len(blocks) - k))
                app_blocks.extend(blocks[k:])
            else:
                zid = next_id
                next_id += 1
                new_rows.append(i)
                new_req_ids.append(rid)
                new_positions.append(pos)
                flat.extend(blocks)
                indptr.append(len(flat))
            ids.append(zid)
            rows[rid] = (zid, pos, blocks, len(blocks))
        i32, none = np.int32, np.zeros(0, np.int32)
        step = DecodeStep(np.array(ids, np.int64), np.array(new_rows, i32),
                          np.zeros(len(new_rows), i32), np.array(new_positions, i32),
                          np.array(indptr, i32), np.array(flat, i32),
                          np.array(app_rows, i32), np.array(app_blocks, i32),
                          none, np.zeros(1, i32), none)
        self.prev, self.next_id = rows, next_id
        return VllmStep(step, req_ids, new_req_ids)

    def forget(self) -> None:
        """No row carries over to the next step (a built step was refused or not run)."""
        self.prev = {}
