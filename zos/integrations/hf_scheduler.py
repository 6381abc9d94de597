"""Prefill and decode in separate steps: a schedule for transformers' continuous batching in
which no step mixes the two (``ZosOptions(mixed_steps=False)``; ``zos serve``'s default).

Why: transformers' FIFO scheduler puts every decoding request and then as many prefill tokens
as the token budget holds into one step. Under load, when a request arrives every step or two,
nearly every step is such a mixed step, and a mixed step is transformers' varlen path:
``prepare_batch_tensors`` loops over the requests in Python and extends the cache's read index
by one int per past token of every decoding request (a ~1k-token context: ~1k ints per row per
step), then copies it to the device. zos builds decode-only steps on the device, where none of
this runs; a mixed step cannot be one of them. On the CPU (tiny model, 128 requests of 1,000
prompt tokens, ``bench/NOTES.md`` 2026-12-06) such steps took a median 30 ms of host time at
~49 requests, growing with the requests' contexts.

The schedule (SGLang's separate prefill and decode batches): each step is either

* prefill-only: the requests being prefilled, then the waiting ones, in transformers' order
  and under its token, cache and request budgets, when any are schedulable and either no
  request decodes, or the previous step was not a prefill-only step and the cache has the free
  room of transformers' safety margin (below it transformers admits no prefill beside
  decoding requests either); or
* decode-only: the decoding requests, in transformers' order and budgets (zos's device-built
  step);

if the chosen kind schedules nothing (the cache cannot hold a new request), the other is
tried in the same call. So while requests keep arriving and the cache has room, prefill and
decode steps alternate: a decoding request that fits the step's budgets gets a token at least
every second step. Requests the cache cannot grow are reported decoding ones first, as
transformers' FIFO order reports them (its offloading evicts from the end of that list).
Everything else (budgets, offloading, prefix sharing, cancellation) is transformers' own,
through the same scheduler methods its FIFO scheduler uses (named in
:data:`zos.integrations.hf_internals.SHARED`).
"""
from __future__ import annotations


def split_steps(scheduler) -> None:
    """Make ``scheduler`` (transformers' ``FIFOScheduler``, an instance) schedule prefill-only
    and decode-only batches (module docstring): its ``schedule_batch`` is replaced on the
    instance; its return value keeps transformers' contract (``(requests or None when the cache
    holds none of them, decode fast path, query tokens, KV tokens read)``)."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    from zos.integrations.hf_internals import internals

    tfi = internals()
    last_was_prefill = False

    def schedule_batch(token_budget: int, cache_budget: int):
        nonlocal last_was_prefill
        decoding, prefilling = [], []
        for state in scheduler.active_requests.values():
            if state.status == RequestStatus.DECODING:
                decoding.append(state)
            elif state.status == RequestStatus.PREFILLING:
                prefilling.append(state)
        waiting = not scheduler.block_new_requests and bool(scheduler.waiting_requests)
        prefill = (bool(prefilling) or waiting) and (not decoding or not (
            last_was_prefill or tfi.below_safety_margin(scheduler)))
        failed, starved = False, {}
        for prefill_step in ((True, False) if prefill else (False, True)):
            # the waiting queue is read only for a prefill-only step: a decode-only step costs
            # nothing per waiting request (thousands of them past saturation)
            candidates = (prefilling + (scheduler._get_waiting_candidates() if waiting else [])
                          if prefill_step else decoding)
            if not candidates:
                continue
            removed: set[str] = set()
            scheduled, one_failed, fast, q, kv = scheduler._process_candidates(
                candidates, token_budget, cache_budget, removed)
            if removed:
                scheduler._cleanup_waiting_queue(removed)
            failed |= one_failed
            starved[not prefill_step] = scheduler.starved_requests  # a list per call
            scheduler.starved_requests = starved.get(True, []) + starved.get(False, [])
            if scheduled:
                last_was_prefill = prefill_step
                return scheduled, fast, q, kv
        last_was_prefill = False
        return (None if failed else []), False, 0, 0

    scheduler.schedule_batch = schedule_batch
