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

import numpy as np

from zos._checks import check_int
from zos.step import DecodeStep


@dataclass
class _Request:
    blocks: list[int]  # the request's block ids (KV-cache group 0), the scheduler's
    num_computed_tokens: int
    prefill_len: int  # tokens prefilled before its first decode (runner v2's prefill_len)


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
        self.requests: dict[str, _Request] = {}
        self.single_group = True  # False once a request holds blocks of two KV-cache groups
        # vLLM request id -> (zos id, position, number of blocks) of the last zos step's rows;
        # a step that is not zos's empties it (zos's row state on the device no longer follows
        # vLLM's)
        self.prev: dict[str, tuple[int, int, int]] = {}
        self.next_id = 0

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
        self.prev = {}

    def _observe(self, so) -> None:
        """The mirror after ``so``: finished and preempted requests leave, new ones come with
        all their blocks, cached ones get this step's blocks and computed tokens."""
        for gone in (so.finished_req_ids, so.preempted_req_ids or ()):
            for rid in gone:
                self.requests.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.single_group &= len(new.block_ids) == 1
            tokens = (new.prompt_token_ids if new.prefill_token_ids is None
                      else new.prefill_token_ids)
            self.requests[new.req_id] = _Request(list(new.block_ids[0]), new.num_computed_tokens,
                                                 len(tokens))
        cached = so.scheduled_cached_reqs
        for rid, blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                         cached.num_computed_tokens):
            req = self.requests.get(rid)
            if req is None:
                raise ValueError(f"scheduler_output: cached request {rid!r} was never scheduled "
                                 f"as new: step() must see every SchedulerOutput, in order")
            if blocks is not None:
                self.single_group &= len(blocks) == 1
                if rid in cached.resumed_req_ids:  # runner v1's resume: blocks replaced
                    req.blocks = list(blocks[0])
                else:
                    req.blocks.extend(blocks[0])
            req.num_computed_tokens = computed

    def _build(self, so) -> VllmStep | None:
        n = len(so.num_scheduled_tokens)
        if (self.speculative or not self.single_group or not 0 < n <= self.max_num_reqs
                or so.total_num_scheduled_tokens != n or so.scheduled_new_reqs
                or so.scheduled_spec_decode_tokens):
            self.prev = {}
            return None
        bs, top = self.block_size, self.max_num_blocks_per_req * self.block_size
        req_ids = list(so.num_scheduled_tokens)  # vLLM's order for a uniform step
        prev_get = self.prev.get
        ids, rows = [], {}
        new_rows, new_positions, indptr, flat = [], [], [0], []
        app_rows, app_blocks = [], []
        next_id = self.next_id
        for i, rid in enumerate(req_ids):
            req = self.requests[rid]
            pos, blocks = req.num_computed_tokens, req.blocks
            if (pos < req.prefill_len or pos >= top
                    or not pos // bs < len(blocks) <= self.max_num_blocks_per_req):
                self.prev = {}
                return None
            prev = prev_get(rid)
            # carried: in the last zos step one position back (its block list can only have
            # grown since: vLLM replaces a request's blocks only when it prefills again)
            if prev is not None and prev[1] == pos - 1:
                zid, _, k = prev
                app_rows.extend([i] * (len(blocks) - k))
                app_blocks.extend(blocks[k:])
            else:
                zid = next_id
                next_id += 1
                new_rows.append(i)
                new_positions.append(pos)
                flat.extend(blocks)
                indptr.append(len(flat))
            ids.append(zid)
            rows[rid] = (zid, pos, len(blocks))
        i32, none = np.int32, np.zeros(0, np.int32)
        step = DecodeStep(np.array(ids, np.int64), np.array(new_rows, i32),
                          np.zeros(len(new_rows), i32), np.array(new_positions, i32),
                          np.array(indptr, i32), np.array(flat, i32),
                          np.array(app_rows, i32), np.array(app_blocks, i32),
                          none, np.zeros(1, i32), none)
        self.prev, self.next_id = rows, next_id
        return VllmStep(step, req_ids)
