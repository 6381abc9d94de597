"""Prefill and decode in separate steps (``ZosOptions(mixed_steps=False)``,
zos/integrations/hf_scheduler.py): on a workload where transformers' FIFO scheduler mixes
decoding requests with prefill chunks, no step mixes them, prefill steps never follow each
other while a request decodes, every request gets its tokens (equal to ``generate()``'s, float32
greedy), and the same holds under a small cache that makes transformers offload. On a tiny
random Llama, on the CPU (and on CUDA in zos's fastest mode).

Needs transformers 5.17.0 or 5.25.0 (the ``hf`` extra); skipped with another version."""
import zos._interpret  # noqa: F401  (before transformers imports triton)

import pytest

from helpers import DEVICE, require_transformers

require_transformers()  # before the transformers imports below

from test_hf import cb_config, gen_config, prompts, reference, tiny_llama  # noqa: E402
from transformers.generation.continuous_batching import continuous_api  # noqa: E402
from transformers.generation.continuous_batching.requests import RequestStatus  # noqa: E402

from zos.integrations import hf_manager  # noqa: E402
from zos.integrations.hf_internals import internals  # noqa: E402
from zos.integrations.transformers import ZosOptions, disable_zos, enable_zos  # noqa: E402

MODES = [(False, False)] + ([(True, True)] if DEVICE == "cuda" else [])  # (graphs, async)
LENGTHS = [5, 17, 40, 3, 23, 9, 31]


def recorded_run(monkeypatch, mixed_steps, lengths=LENGTHS, new=7, graphs=False,
                 asynchronous=False, **cb_kw):
    """Outputs of a zos-enabled ``generate_batch`` and its batches as scheduled: per batch,
    ``(kinds, decoding, below, read_waiting)``: per request True (it was decoding) / False (a
    prefill chunk), whether any request was decoding when the batch was scheduled, whether the
    cache was below transformers' safety margin then, and whether the scheduler read the
    waiting queue for it; and how many times transformers offloaded requests."""
    model = tiny_llama(3)
    batches, offloads = [], []
    offload = continuous_api.OffloadingManager.offload_requests
    monkeypatch.setattr(continuous_api.OffloadingManager, "offload_requests",
                        lambda self: offloads.append(1) or offload(self))

    def record(scheduler):
        schedule, waiting_candidates = scheduler.schedule_batch, scheduler._get_waiting_candidates
        read = []
        scheduler._get_waiting_candidates = lambda: read.append(1) or waiting_candidates()

        def schedule_batch(*args):
            decoding = {rid for rid, st in scheduler.active_requests.items()
                        if st.status == RequestStatus.DECODING}
            below = internals().below_safety_margin(scheduler)
            read.clear()
            out = schedule(*args)
            if out[0]:
                batches.append(([fs.state.request_id in decoding for fs in out[0]],
                                bool(decoding), below, bool(read)))
            return out

        scheduler.schedule_batch = schedule_batch

    hook = "finish_cancelled" if mixed_steps else "split_steps"  # wraps after the schedule
    real = getattr(hf_manager, hook)
    monkeypatch.setattr(hf_manager, hook, lambda s: (real(s), record(s)))
    inputs = prompts(11, lengths, model.config.vocab_size)
    enable_zos(model, ZosOptions(mixed_steps=mixed_steps))
    try:
        out = model.generate_batch(inputs, generation_config=gen_config(new), progress_bar=False,
                                   continuous_batching_config=cb_config(
                                       use_cuda_graph=graphs, use_async_batching=asynchronous,
                                       **dict(dict(num_blocks=64, max_requests_per_batch=4,
                                                   max_batch_tokens=16), **cb_kw)))
    finally:
        disable_zos(model)
    got = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]
    want = [reference(model, p, new) for p in inputs]
    return got, want, batches, len(offloads)


@pytest.mark.parametrize("graphs,asynchronous", MODES)
def test_no_step_mixes_prefill_and_decode(monkeypatch, graphs, asynchronous):
    got, want, batches, _ = recorded_run(monkeypatch, False, graphs=graphs,
                                         asynchronous=asynchronous)
    assert got == want
    assert all(len(set(kinds)) == 1 for kinds, *_ in batches), batches
    prefill = [not kinds[0] for kinds, *_ in batches]
    # two prefill steps in a row only when nothing decodes at the second ...
    for i in range(1, len(batches)):
        assert not (prefill[i - 1] and prefill[i] and batches[i][1]), (i, batches)
    # ... and new requests are not held back until nothing decodes
    assert any(p and decoding for p, (_, decoding, *_) in zip(prefill, batches))
    # a decode-only step does not read the waiting queue (thousands of requests past
    # saturation); on this workload the cache never refuses a prefill, after which a
    # decode-only step would follow a prefill attempt that read it
    assert not any(read for p, (*_, read) in zip(prefill, batches) if not p)
    assert any(read for p, (*_, read) in zip(prefill, batches) if p)


def test_transformers_schedule_mixes_them_on_this_workload(monkeypatch):
    """The workload above is one where the schedule matters: transformers' own mixes."""
    got, want, batches, _ = recorded_run(monkeypatch, True)
    assert got == want
    assert any(len(set(kinds)) == 2 for kinds, *_ in batches)


def test_separate_steps_under_a_cache_that_offloads(monkeypatch):
    """12 blocks of 4 tokens for 4 rows: requests are offloaded and restored; every request
    still gets exactly its tokens, no step mixes, and below transformers' safety margin a
    request that decodes goes before a new prefill."""
    got, want, batches, offloads = recorded_run(monkeypatch, False, lengths=[9, 14, 6, 11, 3],
                                                new=9, num_blocks=12, max_batch_tokens=32)
    assert got == want and offloads > 0
    assert all(len(set(kinds)) == 1 for kinds, *_ in batches)
    assert not any(not kinds[0] and decoding and below for kinds, decoding, below, _ in batches)


def test_other_schedulers_are_kept_with_a_warning():
    model = tiny_llama(3)
    inputs = prompts(5, [6, 9], model.config.vocab_size)
    enable_zos(model, ZosOptions(mixed_steps=False))
    try:
        with pytest.warns(RuntimeWarning, match="keeps its PrefillFirstScheduler"):
            out = model.generate_batch(inputs, generation_config=gen_config(4),
                                       progress_bar=False, continuous_batching_config=cb_config(
                                           scheduler_type="prefill_first"))
    finally:
        disable_zos(model)
    assert [out[k].generated_tokens for k in sorted(out)] == [
        reference(model, p, 4) for p in inputs]


def test_mixed_steps_must_be_a_bool():
    with pytest.raises(TypeError, match="options.mixed_steps must be a bool, got str"):
        enable_zos(tiny_llama(3), ZosOptions(mixed_steps="no"))
