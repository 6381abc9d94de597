"""What zos changes in transformers' ``ContinuousBatchingManager`` for a zos-enabled model
(a model with ``_zos_options``; managers of other models keep transformers' behaviour, but for
the zeroed KV cache below).

:func:`install_manager_hook` wraps six of its methods once per process:

* ``__init__``: what the user left to transformers (None) becomes zos's fastest mode
  (:func:`fastest_mode`);
* ``_create_batch_processor``: a new KV cache is zeroed, for every manager
  (:func:`clear_kv_cache`: what an earlier manager left in that memory reached the warm-ups'
  samplers as NaN); for a zos-enabled model the batch processor gets zos's IOs
  (:mod:`zos.integrations.hf_ios`), its scheduler finishes cancelled requests and schedules
  again after them (:func:`finish_cancelled`), and a request its cache cannot hold is refused,
  or failed alone, never the manager (:mod:`zos.integrations.hf_capacity`);
* ``switch_to_cb_friendly_attn``: the model runs on ``paged|zos`` (``zos`` in 5.25: zos's
  decode for zos's steps, zos's varlen attention for prefill and mixed ones: transformers
  builds no mask for that name), never flash; with torch.compile configs on ``paged|sdpa``
  (``sdpa``), transformers' own;
* ``warmup``: transformers' warm-up, then zos's (:func:`_warm_up_zos`, the allocator's cache
  kept between its captures), both with the garbage collector held off
  (:class:`zos.graphs.collector_held`): one batch per graph
  key of zos's (a decode batch per key of :func:`zos_warmup_counts`, once for both IO pairs; a
  prefill step per padded query size of :func:`varlen_warmup_counts`, per IO pair): every graph
  of a zos-served run is captured there, none during a user's requests (transformers' own
  decode warm-up runs only for its block-table path, which sdpa has not, and its varlen
  warm-up covers one size);
* ``start``: a kept batch processor (``stop(keep_for_next_session=True)``) that zos serves
  puts the model back on zos's attention, which that stop undid; a manager with graphs whose
  batch processor zos serves and that was not
  warmed up (or whose processor is new) runs zos's warm-up first (transformers' server starts
  its manager without a warm-up; zos serve at start-up), leaving the random number generators
  as they were, the collector held off; a failed warm-up is recorded as the manager's fatal
  error (the server then answers 503) and raised;
* ``add_request``: per-request sampling options that would put NaN, inf or an index out of
  range into the sampler are refused (:func:`check_request_options`).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
import time
import warnings
from dataclasses import dataclass

import torch

from zos.graphs import collector_held
from zos.integrations.hf_capacity import fail_unschedulable, refuse_oversized
from zos.integrations.hf_internals import internals
from zos.integrations.hf_ios import zos_ios_classes
from zos.integrations.hf_rows import num_sampled
from zos.integrations.hf_scheduler import split_steps

log = logging.getLogger("zos")


def _compiled(cb_config) -> bool:
    """Whether a continuous-batching config asks for torch.compile (zos then serves no step)."""
    return (cb_config.varlen_compile_config is not None
            or cb_config.decode_compile_config is not None)


# Logits processors transformers 5.17 has not marked ready for continuous batching whose CUDA
# graph capture gave transformers' tokens on the H200 (tests/test_hf_sampling.py in best mode,
# greedy and sampled, 2026-12-03). Others failed there: SuppressTokensLogitsProcessor copies a
# host tensor, NoRepeatNGramLogitsProcessor raises on its input, EtaLogitsWarper checks its
# distribution on the host, TopHLogitsWarper's capture fails.
CAPTURED_ON_GPU = frozenset({"MinPLogitsWarper", "TypicalLogitsWarper", "EpsilonLogitsWarper",
                             "SequenceBiasLogitsProcessor", "LogitNormalization",
                             "ForcedEOSTokenLogitsProcessor"})


def uncaptured_processors(model, generation_config, cb_config) -> list[str]:
    """Class names of the logits processors transformers' continuous batching runs for
    ``generation_config`` (``model._get_logits_processor``, as its manager builds them) that
    are neither marked ready for it by transformers (``supports_continuous_batching`` True:
    its temperature, top-k and top-p warpers) nor in :data:`CAPTURED_ON_GPU`, leaving out
    those it drops (marked False, with ``cb_config.drop_unsupported_processors``). Such a
    processor may not survive a CUDA graph capture, and a failed capture leaves the process's
    CUDA state unusable."""
    if generation_config is None:
        return []
    names = []
    for proc in model._get_logits_processor(generation_config):
        ready = getattr(proc, "supports_continuous_batching", None)
        if (ready is True or type(proc).__name__ in CAPTURED_ON_GPU
                or (ready is False and cb_config.drop_unsupported_processors)):
            continue
        names.append(type(proc).__name__)
    return names


def fastest_mode(cb_config, model, generation_config=None):
    """``cb_config`` with what the user left to transformers (None) set to zos's fastest mode
    on CUDA: CUDA graphs on both paths (zos's decode steps and transformers' prefill and mixed
    steps, which zos's varlen attention runs: one replay per step, every graph captured in the
    warm-up) and asynchronous batching on (bench/NOTES.md has the H200 runs behind the choice).
    transformers' own default for an attention that needs a mask is both off. Graphs stay off,
    with a one-line RuntimeWarning, when ``generation_config`` asks for a logits processor
    that may not survive a capture (:func:`uncaptured_processors`): a run that works without
    zos must not die in zos's capture. The caller's config is not changed; on a CPU, or with
    compile configs, it is returned as it is."""
    chosen = None not in (cb_config.use_cuda_graph, cb_config.use_async_batching)
    if model.device.type != "cuda" or _compiled(cb_config) or chosen:
        return cb_config
    cb_config = copy.deepcopy(cb_config)
    if cb_config.use_cuda_graph is None:
        eager = uncaptured_processors(model, generation_config, cb_config)
        if eager:
            warnings.warn(f"zos: transformers has not marked the logits processors {eager} "
                          f"ready for continuous batching: CUDA graphs left off (set "
                          f"use_cuda_graph to choose)", RuntimeWarning, stacklevel=3)
        cb_config.use_cuda_graph = not eager  # both paths: (varlen/prefill, decode)
    if cb_config.use_async_batching is None:
        cb_config.use_async_batching = True
    return cb_config


def with_query_padding(cb_config, options):
    """``cb_config`` with ``options.q_padding_interval_size`` (a
    :class:`~zos.integrations.transformers.ZosOptions`) where it leaves the interval to
    transformers (0) and runs CUDA graphs on some path; otherwise ``cb_config`` itself (without
    graphs transformers would take a nonzero interval as a request for them). The caller's
    config is not changed."""
    graphs = cb_config.use_cuda_graph
    if (options.q_padding_interval_size is None or cb_config.q_padding_interval_size
            or not (any(graphs) if isinstance(graphs, (tuple, list)) else graphs)):
        return cb_config
    cb_config = copy.deepcopy(cb_config)
    cb_config.q_padding_interval_size = options.q_padding_interval_size
    return cb_config


@torch.no_grad()
def clear_kv_cache(cache) -> None:
    """Zero every layer's K and V tensor of a new ``PagedAttentionCache``, in place, and wait
    for it.

    transformers allocates them with ``torch.empty`` and zeroes only its read-trash block, but
    its warm-up reads slots no request wrote (its varlen warm-up reads a past as long as the
    cache; zos's decode warm-up a block's worth), and samples. In a fresh process that memory
    is the driver's zeroed pages; in one that ran managers before, the caching allocator hands
    back what they left (an int32 -1 reads as a float NaN), the warm-up's logits become NaN and
    ``torch.multinomial`` aborts the process with a device-side assert. Zeroed, every manager
    starts where a fresh process does, and a request still reads only what it wrote.
    """
    tensors = internals().kv_tensors(cache)
    for t in tensors:
        t.zero_()
    if tensors and tensors[0].is_cuda:  # the compute streams do not wait for this stream
        torch.cuda.current_stream(tensors[0].device).synchronize()


def check_request_options(options: dict, vocab_size: int) -> None:
    """Refuse a request's sampling options that would put NaN or inf into the sampler, or an
    index out of range into a kernel, before the request is queued. transformers' per-request
    processors (``cb_logits_processors.py``) check types only: a temperature of 0 divides the
    logits by zero, and a top-k above the vocabulary gathers past it (a device-side assert
    that ends the process), and the padded rows of a later step may read such a value. The
    ranges are those transformers' own warpers enforce in ``generate()``
    (``TemperatureLogitsWarper``: > 0; ``TopKLogitsWarper``: a positive int;
    ``TopPLogitsWarper``: in [0, 1]), with top-k at most ``vocab_size``. Other keys are left to
    transformers' checks (an unknown one fails the request in its manager).

    Raises:
        ValueError: ``temperature`` not a finite number > 0, ``top_k`` not an int in
            [1, vocab_size], or ``top_p`` not a number in [0, 1] (the field and value named).
    """
    if "temperature" in options:
        t = options["temperature"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise ValueError(f"temperature must be a finite number > 0, got {t!r}")
    if "top_k" in options:
        k = options["top_k"]
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size:
            raise ValueError(f"top_k must be an int in [1, vocab_size={vocab_size}], got {k!r}")
    if "top_p" in options:
        p = options["top_p"]
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(f"top_p must be a number in [0, 1], got {p!r}")


def finish_cancelled(scheduler) -> None:
    """Make ``scheduler.clear_cancelled_requests`` mark each request it removes FINISHED, and
    let new requests be scheduled again once one was removed.

    transformers removes a cancelled request from its queues and frees its blocks at the start
    of the next ``prepare_next_batch``, but leaves its status as it was (DECODING). Under
    asynchronous batching that batch is prepared while the previous one, which holds the
    request, is still in flight; its ``update_batch`` then treats the request as live: it
    appends a token to a cancelled request, delivers its output, and, where a block of the
    request filled up in that batch, looks the request up in the block table it has left
    (``KeyError`` in ``mark_shareable_blocks_as_complete``: the manager's thread dies and every
    later request fails). A FINISHED request is what ``update_batch`` already skips under
    asynchronous batching (it consumes its token); transformers' own offloading marks the
    states it drops that way. Synchronous batching never updates a batch after the next one is
    prepared, so nothing changes there.

    transformers' offloading sets ``block_new_requests`` (waiting requests are not scheduled)
    and only a request finishing in ``update_batch`` clears it. When the requests left active
    are cancelled instead, nothing clears it: the waiting requests are never scheduled and the
    manager idles forever (seen with 12 blocks of 4 tokens and cancels in flight). A cancelled
    request's blocks are freed as a finished one's are, so its removal clears the flag too.

    transformers looks every cancelled request up in the waiting order, a deque (one scan of
    the queue per cancelled request: past saturation, thousands of waiting requests times every
    closed stream). It is handed an empty order instead, and the removed requests leave the
    real one in one pass (every entry of a removed id: transformers removes one, and an id
    added twice would leave a stale entry behind). Every writer of the order runs on the
    manager's thread, as this does."""
    from collections import deque

    from transformers.generation.continuous_batching.requests import RequestStatus

    clear = scheduler.clear_cancelled_requests

    def clear_cancelled_requests():
        order, scheduler.waiting_requests_order = scheduler.waiting_requests_order, deque()
        try:
            states = clear()
        finally:
            scheduler.waiting_requests_order = order
        if states and order:
            gone = {state.request_id for state in states}
            scheduler.waiting_requests_order = deque(r for r in order if r not in gone)
        for state in states:
            state._status = RequestStatus.FINISHED  # as the offloading's soft reset: no setter
        if states:
            scheduler.block_new_requests = False
        return states

    scheduler.clear_cancelled_requests = clear_cancelled_requests


def zos_warmup_counts(backend, max_requests: int, padded_q) -> list[int]:
    """Request counts of decode warm-ups that capture every graph key a zos decode step of 1 ..
    ``max_requests`` requests can use: ``("zos", padded size, sampled rows)``, the padded size
    from ``backend``'s buckets (n itself without a bucket policy: one key per n), the sampled
    rows transformers' row count for the batch (:func:`~zos.integrations.hf_rows.num_sampled` of
    ``padded_q(n)``; ``padded_q``: transformers' padded query tokens of a decode batch of n
    requests, ``ModelRunner.maybe_pad_inputs``: for sdpa a multiple of its
    ``q_padding_interval_size``). One count per key, the largest n with that key, in increasing
    order."""
    largest = {}
    for n in range(1, max_requests + 1):
        sampled = num_sampled(range(n), padded_q(n), max_requests, use_padding=True)
        largest[backend.plan(n).padded_size, sampled] = n
    return sorted(largest.values())


MAX_VARLEN_WARMUP = 256  # padded query sizes captured in the warm-up, per IO pair


@dataclass(frozen=True)
class WarmupKind:
    """What zos's warm-up captured of one kind of graph (decode or prefill): ``graphs``
    captured (one warm-up step each; the step replays a graph that exists), ``seconds`` of wall
    time, ``reserved_bytes``: growth of the device memory the caching allocator holds over
    them (the graphs' pool, on CUDA; 0 on a CPU)."""

    graphs: int
    seconds: float
    reserved_bytes: int


def _now(device) -> float:
    """Wall time once the device's queued work is done (seconds)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _reserved(device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def varlen_warmup_counts(padded_q, max_batch_tokens: int) -> list[int]:
    """Query token counts of prefill warm-ups that capture every graph key a prefill or mixed
    step of 2 .. ``max_batch_tokens`` query tokens can use under zos's varlen attention
    (:func:`~zos.integrations.hf_rows.varlen_graph_key` of ``padded_q(t)``; ``padded_q``:
    transformers' padding of a varlen step, ``ModelRunner.maybe_pad_inputs``; a one-request
    warm-up of one query token would be zos's decode step). One count per key, the smallest
    with that key (the fewest KV blocks for the warm-up request), in increasing order."""
    smallest = {}
    for t in range(max_batch_tokens, 1, -1):
        smallest[padded_q(t)] = t
    return sorted(smallest.values())


@torch.no_grad()
def _warmup_step(bp, model, n: int, query_length: int, past: int, fast: bool) -> None:
    """One batch of ``n`` warm-up requests through ``bp``, each with ``query_length`` query
    tokens after ``past`` cached ones, as the scheduler would hand it over (decode fast path
    ``fast``, transformers' padding), then its blocks freed: with graphs on, the batch's graph
    is captured (or replayed if it exists). transformers' ``run_one_warmup`` pads decode
    batches as its block-table path does, which a batch of a model without that path (sdpa)
    never takes, and warms up one varlen size. Without autograd whatever the caller's mode
    (transformers' ``ContinuousBatchingManager.warmup`` sets none, and its server starts the
    manager with autograd on): a step's K/V write into the cache would otherwise make the cache
    part of an autograd graph that keeps every warm-up forward's activations alive."""
    from transformers.generation.continuous_batching.requests import RequestStatus

    cache, runner, ios = bp.cache, bp.model_runner, bp.inputs_and_outputs
    status = RequestStatus.DECODING if query_length == 1 else RequestStatus.PREFILLING
    states = internals().create_warmup_future_states(n, status, query_length, past, cache)
    try:
        if len(states) < n:
            raise RuntimeError(f"zos: no KV blocks for a warm-up batch of {n} requests of "
                               f"{query_length + past} tokens")
        q, kv = runner.maybe_pad_inputs(n * query_length, past, fast)
        ios.prepare_batch_tensors(states, bp.logit_processor, fast, q, kv, use_padding=True)
        runner.compute_batch(model, ios.get_model_kwargs(use_padding=True))
    finally:
        for fs in states:
            cache.free_blocks(fs.state.request_id)


_KEPT = threading.Lock()  # guards _kept_depth and the saved functions
_kept_depth = 0
_kept_saved: dict = {}


@contextlib.contextmanager
def _cache_kept_between_captures(device):
    """Within: each CUDA graph capture leaves the caching allocators' cached memory as it is.
    ``torch.cuda.graph`` empties the device and pinned-host caches before every capture, so
    the eager run before the next capture allocates all its memory from the driver again (on
    the H200 12-14% of a SmolLM2 warm-up: bench/NOTES.md, 2026-12-05). The caches are emptied
    once here, before the first capture (vLLM's piecewise graph backend does the same: only
    its first capture collects garbage and empties the cache). The two functions are the
    process's: while any warm-up is within (nested or in another thread: counted), a call to
    them from elsewhere does nothing either; the last one out restores them. No-op off CUDA."""
    global _kept_depth
    if device.type != "cuda":
        yield
        return
    with _KEPT:
        if _kept_depth == 0:
            torch.cuda.empty_cache()
            _kept_saved.update({(mod, name): getattr(mod, name) for mod, name in
                                ((torch.cuda, "empty_cache"), (torch._C, "_host_emptyCache"))
                                if hasattr(mod, name)})
            for mod, name in _kept_saved:
                setattr(mod, name, lambda: None)
        _kept_depth += 1
    try:
        yield
    finally:
        with _KEPT:
            _kept_depth -= 1
            if _kept_depth == 0:
                for (mod, name), fn in _kept_saved.items():
                    setattr(mod, name, fn)
                _kept_saved.clear()


def _warm_up_zos(bp, model) -> dict[str, WarmupKind]:
    """Capture every graph of zos's key space for ``bp`` (a ``ContinuousBatchProcessor`` with
    zos's IOs): with decode graphs on, every decode graph (:func:`zos_warmup_counts`; once, as
    one graph serves both IO pairs of asynchronous batching); with varlen graphs on, one
    prefill step per padded query size (:func:`varlen_warmup_counts`) on each IO pair; the
    smallest first. Returns ``{"decode": WarmupKind, "prefill": WarmupKind}`` (empty when there
    is nothing to capture), also logged (logger ``"zos"``, INFO). The random number
    generators' state is restored after them:
    a warm-up samples (the eager run before each capture), and a seeded run must draw what
    transformers' own would after its warm-up. Keys whose warm-up needs more KV blocks than the
    cache has free, and varlen keys past the first :data:`MAX_VARLEN_WARMUP` (a padding
    interval far below ``max_batch_tokens``), are left to their first use, with a
    RuntimeWarning.

    Raises:
        whatever a capture raises (transformers logs its own warm-up's errors and goes on; a
        failed capture leaves CUDA's generator unusable for the process, so zos does not hide
        one).
    """
    ios, runner, cache = bp.inputs_and_outputs, bp.model_runner, bp.cache
    if ios.zos is None or not (runner.use_cuda_graph_decode or runner.use_cuda_graph_varlen):
        return {}
    tfi = internals()
    fast = tfi.decode_fast_path(cache)  # what the scheduler says of a short decode batch
    page = tfi.page_size(cache)
    past = page - 1  # a decode warm-up's query token is its block's last
    free = tfi.free_blocks(cache)
    counts, tokens = [], []
    if runner.use_cuda_graph_decode:
        counts = zos_warmup_counts(ios.zos.backend, ios.zos.buffers.max_num_reqs,
                                   lambda n: runner.maybe_pad_inputs(n, past, fast)[0])
        if counts and counts[-1] > free:
            warnings.warn(f"zos: the KV cache has {free} free blocks, so decode graphs of more "
                          f"requests ({[n for n in counts if n > free]}) are captured on first "
                          f"use", RuntimeWarning, stacklevel=3)
            counts = [n for n in counts if n <= free]
    if runner.use_cuda_graph_varlen:
        tokens = varlen_warmup_counts(lambda t: runner.maybe_pad_inputs(t, 0, False)[0],
                                      cache.max_batch_tokens)
        fits = [t for t in tokens if -(-t // page) <= free]
        if len(fits) > MAX_VARLEN_WARMUP or len(fits) < len(tokens):
            warnings.warn(f"zos: {len(tokens)} prefill graph sizes, {len(fits)} within the KV "
                          f"cache's {free} free blocks; the warm-up captures "
                          f"{min(len(fits), MAX_VARLEN_WARMUP)}, the rest on first use (a "
                          f"larger q_padding_interval_size gives fewer sizes)", RuntimeWarning,
                          stacklevel=3)
        tokens = fits[:MAX_VARLEN_WARMUP]
    pairs = len(getattr(ios, "io_pairs", ())) or 1
    # per kind: its warm-up steps on one IO pair (smallest first: on the H200 largest first
    # took 1.1-1.2x as long), and the pairs it runs on (each pair's steps swap in their own
    # tensors; zos's decode graphs serve both pairs of ZosAsyncIOs)
    shared = getattr(ios, "shares_decode_graphs", False)
    kinds = {"decode": ([(n, 1, past, fast) for n in counts], 1 if shared else pairs),
             "prefill": ([(1, t, 0, False) for t in tokens], pairs)}
    log.info("zos: warm-up: capturing %d decode and %d prefill graphs",
             *(len(todo) * on for todo, on in kinds.values()))
    report = {}
    with (torch.random.fork_rng(devices=[bp.model_device]),
          _cache_kept_between_captures(bp.model_device)):
        for kind, (todo, on_pairs) in kinds.items():
            t0, mem0 = _now(bp.model_device), _reserved(bp.model_device)
            for _ in range(on_pairs):
                for step in todo:
                    _warmup_step(bp, model, *step)
                if on_pairs > 1:
                    ios.swap_io_pairs()
            report[kind] = WarmupKind(len(todo) * on_pairs, _now(bp.model_device) - t0,
                                      _reserved(bp.model_device) - mem0)
    tfi.after_warmup(cache)
    log.info("zos: warm-up: %s", describe_warmup(report))
    return report


def describe_warmup(report: dict[str, WarmupKind]) -> str:
    """One line of a warm-up's report (:func:`_warm_up_zos`): graphs, seconds and memory per
    kind."""
    return ", ".join(f"{k.graphs} {kind} graphs in {k.seconds:.1f} s "
                     f"(+{k.reserved_bytes / 2**30:.2f} GiB reserved)"
                     for kind, k in report.items()) or "nothing to capture"


def install_manager_hook() -> None:
    """Wrap ``ContinuousBatchingManager``'s methods once (module docstring)."""
    from transformers.generation.continuous_batching import continuous_api as api
    manager = api.ContinuousBatchingManager
    if getattr(manager._create_batch_processor, "_zos_hook", False):
        return
    original_init, original_create = manager.__init__, manager._create_batch_processor
    original_switch, original_warmup = manager.switch_to_cb_friendly_attn, manager.warmup
    original_start, original_add = manager.start, manager.add_request

    def zos_on(model) -> bool:
        return getattr(model, "_zos_options", None) is not None

    def __init__(self, model, generation_config, continuous_batching_config,
                 workload_hints=None):
        if zos_on(model):
            continuous_batching_config = with_query_padding(
                fastest_mode(continuous_batching_config, model, generation_config),
                model._zos_options)
        original_init(self, model, generation_config, continuous_batching_config,
                      workload_hints)

    tfi = internals()

    def _create_batch_processor(self):
        options = getattr(self.model, "_zos_options", None)
        cfg = self.continuous_batching_config
        compiled = _compiled(cfg)
        previous = getattr(self, "batch_processor", None)
        if (options is not None and compiled
                and self.model.config._attn_implementation == tfi.attn):
            # every step of such a run is transformers': its own attention, with its mask;
            # the model gets its attention back when the manager stops
            self.model.set_attn_implementation(tfi.cb_sdpa)
            if self._original_attn_impl is None:
                self._original_attn_impl = tfi.attn
        bp = original_create(self)
        if bp is not previous:  # a new cache (transformers resets and returns its own)
            clear_kv_cache(bp.cache)
        classes = zos_ios_classes()
        if options is None or isinstance(bp.inputs_and_outputs, classes):
            return bp
        impl = self.model.config._attn_implementation
        why = None
        if compiled:
            why = "torch.compile configs are not supported"
        elif impl != tfi.attn:
            why = f"the manager runs this model on {impl!r}, not {tfi.attn!r}"
        serves = why is None
        if not serves:
            warnings.warn(f"zos: {why}; this run keeps transformers' own path for every step",
                          RuntimeWarning, stacklevel=2)
        cls = classes[1] if bp.use_async_batching else classes[0]
        ios = cls(cache=bp.cache, config=bp.config, continuous_batching_config=cfg,
                  device=bp.model_device, model_dtype=bp.model_dtype,
                  logit_processor=bp.logit_processor, options=options, serves=serves)
        bp.inputs_and_outputs = ios
        bp.model_runner.inputs_and_outputs = ios
        # offloads and restores must stay ordered with the steps that read their blocks
        bp.offloading_manager._compute_stream = ios.compute_stream
        finish_cancelled(bp.scheduler)
        if not options.mixed_steps:
            if isinstance(bp.scheduler, api.FIFOScheduler):
                split_steps(bp.scheduler)
            else:
                warnings.warn(f"zos: mixed_steps=False applies to transformers' FIFO "
                              f"scheduler; this manager keeps its "
                              f"{type(bp.scheduler).__name__}", RuntimeWarning, stacklevel=2)
        refuse_oversized(bp)
        fail_unschedulable(bp)
        return bp

    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        """transformers' switch for other models; a zos-enabled model on ``sdpa`` (or 5.17's
        ``paged|sdpa``) goes to zos's attention (``paged|zos``; ``zos`` in 5.25), never to a
        flash attention (zos decodes over the sdpa-shaped cache: 5.25's
        ``auto_switch_to_flash`` is not applied), and, as transformers does, gets its own back
        when the manager stops."""
        impl = model.config._attn_implementation
        if not zos_on(model) or impl not in tfi.accepted_attn:
            return original_switch(self, model, *args, **kwargs)
        if impl != tfi.attn:
            model.set_attn_implementation(tfi.attn)
            self._original_attn_impl = impl
        return None

    def warmup(self):
        """transformers' warm-up, then zos's (:func:`_warm_up_zos`, its report in
        ``self.zos_warmup``). transformers' samples and is not undone: a seeded run draws
        what transformers' own run draws after it. For a zos-enabled model both run with the
        garbage collector held off after one collection (:class:`zos.graphs.collector_held`:
        torch's captures no longer collect first, and an automatic collection inside one that
        frees an earlier object's CUDA graph breaks it)."""
        if not zos_on(self.model):
            return original_warmup(self)
        with collector_held(collect=True):
            original_warmup(self)
            self.zos_warmup = _warm_up_zos(self.batch_processor, self.model)

    def start(self):
        """transformers' method; for a zos-enabled model whose kept batch processor decodes
        with zos, the model is first put back on zos's attention (``stop(...,
        keep_for_next_session=True)`` gave it its own back, and ``start`` alone, unlike
        ``init_continuous_batching``, does not switch it again: zos's inputs would reach
        sdpa), and a run with graphs warms zos's graphs up first.

        Raises:
            RuntimeError: the kept processor decodes with zos and the model now runs on an
                attention zos cannot switch from (nothing started); or zos's warm-up failed
                (recorded as the manager's fatal error).
        """
        bp = self.batch_processor
        if (zos_on(self.model) and not self.is_running() and bp is not None
                and getattr(bp.inputs_and_outputs, "zos", None) is not None
                and self.model.config._attn_implementation != tfi.attn):
            impl = self.model.config._attn_implementation
            if impl not in tfi.accepted_attn:
                raise RuntimeError(f"zos: this manager's batch processor decodes with zos, but "
                                   f"the model now runs on {impl!r}; stop it without "
                                   f"keep_for_next_session and start a new manager")
            self.switch_to_cb_friendly_attn(self.model)  # its own back at the next stop
        if (zos_on(self.model) and not self.is_running()
                and any(self.continuous_batching_config.cuda_graph_booleans)):
            fresh = self.batch_processor is None  # a new processor has no graph
            if fresh:  # created outside the fork below: it seeds the generators (set_tp_seed)
                self.batch_processor = self._create_batch_processor()
            if self.batch_processor.inputs_and_outputs.zos is not None and (
                    fresh or not self.warmed_up):
                try:  # zos's alone: every graph such a run replays is one of zos's keys
                    with (torch.random.fork_rng(devices=[self.model.device]),  # tf runs none
                          collector_held(collect=True)):
                        self.zos_warmup = _warm_up_zos(self.batch_processor, self.model)
                    self.warmed_up = True
                except Exception as e:  # the server must see a dead manager, not a silent one
                    self.background_thread_status.record_fatal_error(e)
                    raise
        return original_start(self)

    def add_request(self, input_ids, request_id=None, max_new_tokens=None, streaming=False,
                    record_timestamps=False, eos_token_id=None, **logit_processor_kwargs):
        """transformers' method; for a zos-enabled model the per-request sampling options are
        checked first (:func:`check_request_options`): a ValueError, and nothing queued."""
        if zos_on(self.model):
            check_request_options(logit_processor_kwargs,
                                  self.model.config.get_text_config().vocab_size)
        return original_add(self, input_ids, request_id, max_new_tokens, streaming,
                            record_timestamps, eos_token_id, **logit_processor_kwargs)

    hooks = dict(__init__=__init__, _create_batch_processor=_create_batch_processor,
                 switch_to_cb_friendly_attn=switch_to_cb_friendly_attn, warmup=warmup,
                 start=start, add_request=add_request)
    for name, fn in hooks.items():
        fn._zos_hook = True
        fn.__doc__ = fn.__doc__ or getattr(manager, name).__doc__
        setattr(manager, name, fn)
