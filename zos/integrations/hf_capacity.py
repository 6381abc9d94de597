"""Requests a transformers KV cache cannot hold: refused when they arrive, and failed alone,
never the manager.

transformers' scheduler gives a request the blocks of its next step (5.17 rounds a prefill
chunk up by a block, 5.25 allocates exactly); under asynchronous batching a request is
scheduled once more while its last token is in flight. When the only
request left cannot get its next blocks, or no request can get its first ones, its
``prepare_next_batch`` raises ``RuntimeError(NO_ROOM)`` and the manager's thread dies, failing
every request (on a small cache, a 49-token prompt in 12 blocks of 4 tokens is enough). zos:

* :func:`blocks_for` is what such a request needs alone; :func:`refuse_oversized` makes the
  batch processor fail a new request needing more than the cache has, with a ValueError naming
  the sizes, before it is scheduled (as transformers fails a request whose options it refuses);
* :func:`fail_unschedulable` makes ``prepare_next_batch`` fail the request that cannot be
  placed (the only active request, starved; or, with none active, the first waiting one) and
  schedule again, instead of raising.
"""
from __future__ import annotations

from zos.integrations.hf_internals import internals

# transformers' error when nothing can be scheduled or offloaded (continuous_api.py,
# ContinuousBatchProcessor.prepare_next_batch; the same text in 5.17 and 5.25)
NO_ROOM = "No requests can be scheduled and no requests can be offloaded."


def blocks_for(prompt_len: int, max_new_tokens: int, block_size: int, max_batch_tokens: int,
               in_flight: int) -> int:
    """KV blocks of ``block_size`` tokens transformers' scheduler allocates to a request alone
    in its batches, its prompt in chunks of ``max_batch_tokens`` tokens, until its KV holds
    ``prompt_len + max_new_tokens - 1 + in_flight`` tokens (``in_flight``: 1 under
    asynchronous batching, whose last step runs while the last token is in flight, else 0);
    the installed release's rule (:meth:`~zos.integrations.hf_internals.TF517.blocks_for`)."""
    return internals().blocks_for(prompt_len, max_new_tokens, block_size, max_batch_tokens,
                                  in_flight)


def refuse_oversized(bp) -> None:
    """Make the batch processor ``bp`` fail, with a ValueError, a new request whose
    :func:`blocks_for` exceeds its cache (``max_new_tokens`` None counts one new token): the
    requests the manager hands over in ``_update_tp_group_state`` go through
    ``scheduler.add_waiting_request`` inside transformers' try, which fails the request and
    goes on. Requests re-queued by the offloader or a fork were admitted before and are not
    checked."""
    scheduler, cache, tfi = bp.scheduler, bp.cache, internals()
    page, capacity = tfi.page_size(cache), tfi.num_blocks(cache)
    add, update = scheduler.add_waiting_request, bp._update_tp_group_state
    in_flight = 1 if bp.use_async_batching else 0
    admitting = [False]

    def add_waiting_request(state):
        if admitting[0]:
            new = 1 if state.max_new_tokens is None else state.max_new_tokens
            need = blocks_for(len(state.initial_tokens), new, page, cache.max_batch_tokens,
                              in_flight)
            if need > capacity:
                raise ValueError(
                    f"request {state.request_id!r}: its {len(state.initial_tokens)} prompt "
                    f"tokens and up to {new} new tokens need {need} KV blocks of {page} tokens "
                    f"as transformers allocates them; the cache has {capacity}")
        return add(state)

    def _update_tp_group_state():
        admitting[0] = True
        try:
            return update()
        finally:
            admitting[0] = False

    scheduler.add_waiting_request = add_waiting_request
    bp._update_tp_group_state = _update_tp_group_state


def fail_unschedulable(bp) -> None:
    """Make ``bp.prepare_next_batch`` fail the request that cannot be placed instead of raising
    ``RuntimeError(NO_ROOM)``, then schedule again: the only active request when it is starved
    (it cannot get its next blocks with every other request gone), else, with no request
    active, the first waiting one (it cannot get its first blocks from an empty cache). The
    request gets a ValueError as its error, with the tokens it has; its blocks are freed and
    its state FINISHED, which an update of a batch in flight skips (asynchronous batching).
    Any other RuntimeError, or NO_ROOM with no such request, is raised as before."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    prepare, scheduler, cache = bp.prepare_next_batch, bp.scheduler, bp.cache
    tfi = internals()

    def culprit():
        active = scheduler.active_requests
        starved = [s for s, _ in scheduler.starved_requests if s.request_id in active]
        if len(active) == 1 and starved:
            return starved[-1]
        if not active and scheduler.waiting_requests_order:
            return scheduler.waiting_requests[scheduler.waiting_requests_order[0]]
        return None

    def prepare_next_batch():
        while True:
            try:
                return prepare()
            except RuntimeError as e:
                state = culprit() if str(e) == NO_ROOM else None
                if state is None:
                    raise
                rid = state.request_id
                held = tfi.blocks_in_use(cache, rid)
                bp._handle_request_error(ValueError(
                    f"request {rid!r} cannot get the KV blocks of its next step: it holds "
                    f"{held} of the cache's {tfi.num_blocks(cache)} blocks of "
                    f"{tfi.page_size(cache)} tokens and no other request can make room"), state)
                scheduler.finish_request(rid)
                # 5.17 keeps a prefix-matched request it then skipped in the waiting dict,
                # not in the order
                if (scheduler.waiting_requests.pop(rid, None) is not None
                        and rid in scheduler.waiting_requests_order):
                    scheduler.waiting_requests_order.remove(rid)
                bp.offloading_manager.free_request_cpu_cache(state)
                state._status = RequestStatus.FINISHED  # no setter: its end is delivered
                scheduler.block_new_requests = False  # as when a request finishes

    bp.prepare_next_batch = prepare_next_batch
