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

The mirror is native (``zos._C.VllmMirror``, ``csrc/vllm_mirror.cpp``): one call per scheduler
output reads these fields through the C API, with a slot of per-request arrays for each request
and one dict lookup per row.

Under asynchronous scheduling (vLLM's default) the host does not know the token a request
sampled last: every row's input token is vLLM's (``last_sampled_tokens``, read on the device by
:func:`zos.integrations.vllm_buffers.write_vllm_decode_inputs`). A new row's staged token is a
placeholder (0) here; :class:`~zos.integrations.vllm_prep.ZosVllmPrep` replaces it with the
row's request index in vLLM's state, which zos then carries as row state.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zos._C import VllmMirror
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
            ``step.new_tokens`` are placeholders (0, writeable): the input tokens are
            vLLM's (module docstring).
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
        TypeError / ValueError: a size is not an int >= 1 (or 2^31 or more, or the block
            table spans 2^31 positions or more), ``num_speculative_tokens`` not an int >= 0.
    """

    def __init__(self, *, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int,
                 num_speculative_tokens: int = 0) -> None:
        self._mirror = VllmMirror(
            check_int("block_size", block_size), check_int("max_num_reqs", max_num_reqs),
            check_int("max_num_blocks_per_req", max_num_blocks_per_req),
            check_int("num_speculative_tokens", num_speculative_tokens, lo=0) > 0)

    def step(self, scheduler_output) -> VllmStep | None:
        """Read one ``SchedulerOutput`` (every step's, in order: the mirror follows them all)
        and return its zos step, or None when it is not a pure-decode step or a row's position
        or blocks lie past the block table (then it is vLLM's to prepare). The rows of a
        returned step are the reference of the next one's: :meth:`forget` if it is not run.

        Raises:
            ValueError: before the mirror changes, a cached request the earlier outputs never
                brought (a step was skipped) or one the same output finishes or preempts.
            TypeError / ValueError: a field of ``scheduler_output`` of another type or length
                than vLLM 0.26's (the mirror may be part-way through the output then).
        """
        out = self._mirror.step(scheduler_output)
        if out is None:
            return None
        arrays, req_ids = out  # no rewritten rows: vLLM only appends to a decoding request
        return VllmStep(DecodeStep.of_arrays((*arrays, _NONE, _ZERO, _NONE)), req_ids)

    def forget(self) -> None:
        """No row carries over to the next step (a returned step was refused or not run)."""
        self._mirror.forget()
