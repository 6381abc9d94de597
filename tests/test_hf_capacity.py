"""Requests a small KV cache cannot hold, and cancels in flight under it
(zos/integrations/hf_capacity.py): transformers' own manager dies (``RuntimeError: No requests
can be scheduled and no requests can be offloaded``, every request failed); a zos-enabled
manager refuses such a request when it arrives, fails alone a request that outgrows the cache,
and stays alive, the other requests exact. On a tiny random Llama; on CUDA also under zos's
fastest mode (graphs and asynchronous batching).

Needs transformers 5.17.0 or 5.25.0 (the ``hf`` extra); skipped with another version."""
import zos._interpret  # noqa: F401  (before transformers imports triton)

import contextlib
import random
import time

import pytest

from helpers import DEVICE, require_transformers

require_transformers()  # before the transformers imports below

from test_hf import (  # noqa: E402
    cb_config,
    full_attention_manager,
    gen_config,
    prompts,
    reference,
    tiny_llama,
)
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.continuous_batching import continuous_api  # noqa: E402

from zos.integrations.hf_capacity import blocks_for  # noqa: E402
from zos.integrations.transformers import ZosOptions, disable_zos, enable_zos  # noqa: E402

CUDA = DEVICE == "cuda"
MODES = [(False, False)] + ([(True, True)] if CUDA else [])  # (graphs, async)


@pytest.mark.parametrize("prompt_len,new,block_size,batch_tokens", [
    (1, 1, 4, 32), (3, 5, 4, 32), (9, 8, 4, 8), (47, 2, 4, 32), (30, 19, 4, 32), (31, 1, 4, 32),
    (17, 9, 8, 16), (64, 3, 16, 64), (65, 12, 16, 64), (5, 30, 4, 4)])
def test_blocks_for_is_what_transformers_allocates(monkeypatch, prompt_len, new, block_size,
                                                   batch_tokens):
    """The reference is transformers' scheduler itself: one request alone in a cache large
    enough, synchronous batching; the most blocks it held at any step equals blocks_for."""
    model = tiny_llama(1)
    held, prepare = [0], continuous_api.ContinuousBatchProcessor.prepare_next_batch

    def recording(bp):
        ok = prepare(bp)
        table = full_attention_manager(bp.cache)[0].block_table
        held[0] = max([held[0], *(len(table.get(r, ())) for r in bp.scheduler.active_requests)])
        return ok

    monkeypatch.setattr(continuous_api.ContinuousBatchProcessor, "prepare_next_batch", recording)
    [p] = prompts(prompt_len, [prompt_len], model.config.vocab_size)
    out = model.generate_batch([p], generation_config=gen_config(new), progress_bar=False,
                               continuous_batching_config=cb_config(
                                   num_blocks=128, block_size=block_size,
                                   max_batch_tokens=batch_tokens, max_requests_per_batch=4))
    assert len(next(iter(out.values())).generated_tokens) == new
    assert held[0] == blocks_for(prompt_len, new, block_size, batch_tokens, in_flight=0)


def small_cache(graphs, asynchronous, **kw):
    """12 blocks of 4 tokens, 4 rows, 32 batch tokens: freed blocks are reused at once."""
    return cb_config(num_blocks=12, block_size=4, max_requests_per_batch=4, max_batch_tokens=32,
                     use_cuda_graph=graphs, use_async_batching=asynchronous, **kw)


@contextlib.contextmanager
def running(model, gen, cb):
    """A started manager of a zos-enabled ``model``; stopped and zos disabled on exit, however
    the test ends (a manager's thread left running keeps pytest from exiting)."""
    enable_zos(model, ZosOptions())
    manager = None
    try:
        manager = model.init_continuous_batching(generation_config=gen,
                                                 continuous_batching_config=cb)
        manager.start()
        yield manager
    finally:
        if manager is not None:
            manager.stop(block=True, timeout=60)
        disable_zos(model)


def results(manager, want: int, timeout: float = 60) -> dict:
    """{request id: GenerationOutput} of the next ``want`` finished requests."""
    got = {}
    while len(got) < want:
        res = manager.get_result(timeout=timeout)
        assert res is not None, f"no result after {timeout} s; have {sorted(got)}"
        if res.is_finished():
            got[res.request_id] = res
    return got


@pytest.mark.parametrize("graphs,asynchronous", MODES)
def test_request_the_cache_cannot_hold_fails_alone(graphs, asynchronous):
    """A 49-token prompt needs 13 blocks of 4 as transformers allocates them (5.17: a chunk of
    32, then 17, each rounded up by a block; 5.25: exactly): refused when it arrives, with the
    sizes named; a request without a token limit
    (``max_new_tokens`` None) outgrows the 12 blocks and fails alone with the tokens it made;
    a request after both gets generate()'s tokens from the same live manager."""
    model = tiny_llama(7)
    vocab = model.config.vocab_size
    big, unbounded, small = prompts(7, (49, 6, 9), vocab)
    gen = GenerationConfig(max_new_tokens=None, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    with running(model, gen, small_cache(graphs, asynchronous)) as manager:
        manager.add_request(big, request_id="big", max_new_tokens=1)
        refused = results(manager, 1)["big"]
        assert "13 KV blocks" in refused.error and "the cache has 12" in refused.error
        manager.add_request(unbounded, request_id="unbounded")
        failed = results(manager, 1)["unbounded"]
        manager.add_request(small, request_id="small", max_new_tokens=10)
        done = results(manager, 1)["small"]
        assert manager.is_running() and manager.background_thread_status.fatal_error is None
    assert "cannot get the KV blocks" in failed.error
    assert 6 + len(failed.generated_tokens) >= 12 * 4 - 1
    assert failed.generated_tokens == reference(model, unbounded, len(failed.generated_tokens))
    assert done.error is None and done.generated_tokens == reference(model, small, 10)


@pytest.mark.parametrize("seed", [0, 1, 2] if CUDA else [0])
@pytest.mark.parametrize("graphs,asynchronous", MODES)
def test_cancels_in_flight_under_a_small_cache(seed, graphs, asynchronous):
    """Streaming requests of 2 .. 44 tokens with 1 .. 16 new (some too large for 12 blocks of 4,
    refused), four in flight: after a random result a request is cancelled after a random delay
    (its next step in flight under asynchronous batching) and another, which needs the freed
    blocks, added. The manager stays alive and keeps scheduling (transformers' offloading stops
    new requests until a request finishes; with the active ones cancelled instead, seed 0
    left four requests waiting forever), nothing cancelled finishes with an error, and every
    request that was neither cancelled nor refused has generate()'s tokens."""
    model = tiny_llama(11)
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    todo = [(rng.randrange(1, vocab), rng.randrange(2, 45), rng.randrange(1, 17))
            for _ in range(24)]
    with running(model, gen_config(16), small_cache(graphs, asynchronous)) as manager:
        sent, live, cancelled, finished = {}, set(), set(), {}

        def add():
            first, n, new = todo[len(sent)]
            rid = f"r{len(sent)}"
            sent[rid] = ([(first + 7 * i) % (vocab - 1) + 1 for i in range(n)], new)
            manager.add_request(sent[rid][0], request_id=rid, max_new_tokens=new,
                                streaming=True)
            live.add(rid)

        for _ in range(4):
            add()
        while live:
            res = manager.get_result(timeout=60)
            assert res is not None and manager.is_running()
            rid = res.request_id
            if res.is_finished():
                finished[rid] = res
                live.discard(rid)
            elif rid in live and rng.random() < 0.3:
                time.sleep(rng.uniform(0, 0.003))
                manager.cancel_request(rid)
                live.discard(rid)
                cancelled.add(rid)
            else:
                continue
            if len(sent) < len(todo):
                add()
        assert manager.background_thread_status.fatal_error is None
    refused = {r for r, out in finished.items() if out.error is not None}
    assert not refused & cancelled
    for rid in refused:
        assert "KV blocks" in finished[rid].error, finished[rid].error
    kept = set(sent) - cancelled - refused
    assert kept and kept <= set(finished)
    for rid in kept:
        prompt, new = sent[rid]
        assert finished[rid].generated_tokens == reference(model, prompt, new), rid


def test_failed_request_left_in_the_waiting_dict_only():
    """transformers 5.17 keeps a request it prefix-matched and then skipped in the waiting
    dict but not in the waiting order (it is active too). When that request is the one the
    cache cannot hold, zos fails it and drops it from both queues instead of raising from the
    order (a ValueError would stop the manager). The state is set up by hand on a zos batch
    processor, whose ``prepare_next_batch`` raises transformers' NO_ROOM once."""
    from test_hf_manager import zos_batch_processor
    from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

    from zos.integrations.hf_capacity import NO_ROOM, fail_unschedulable

    with zos_batch_processor(2, 8) as (_, bp):
        sched = bp.scheduler
        state = RequestState(request_id="a", initial_tokens=[1, 2, 3], max_new_tokens=2)
        state.status = RequestStatus.PREFILLING
        sched.active_requests["a"] = state
        sched.add_waiting_request(RequestState(request_id="b", initial_tokens=[4, 5],
                                               max_new_tokens=2))
        sched.waiting_requests["a"] = state  # in the dict, not in the order
        raised = []

        def prepare():
            if not raised:
                raised.append(1)
                sched.starved_requests = [(state, 1)]
                raise RuntimeError(NO_ROOM)
            return False

        bp.prepare_next_batch = prepare
        fail_unschedulable(bp)
        assert bp.prepare_next_batch() is False
        assert state.status == RequestStatus.FINISHED
        assert "a" not in sched.active_requests and "a" not in sched.waiting_requests
        assert list(sched.waiting_requests_order) == ["b"]
