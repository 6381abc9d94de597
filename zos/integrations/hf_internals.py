"""Every transformers internal zos's integration relies on, named in one place, with one adapter
per release line: :class:`TF517` (transformers 5.17.0) and :class:`TF525` (5.25.0).

zos works inside transformers' continuous batching (its IO objects, manager, KV cache and
attention registry): these are internals, not an API, and they changed between the two lines.
5.25 rewrote the KV cache (one zeroed byte tensor split into sectors, one allocator per
attention type; a block is every layer's K and V page, interleaved, so a layer's page view
holds block ``b`` at page ``b * pages_stride``; trash blocks at the start, per allocator),
made the model update the paged cache itself before the attention function (zos passes the
cache out of band, as ``zos_cache``, so that it does not), dropped the ``paged|`` prefix of
attention names, renamed ``max_seqlen_q/k`` to ``max_length_q/k`` and keeps ``cu_seq_lens_k``
a dict by layer type. The rest of what zos uses (the IO methods it overrides, the model
runner's padding and graph store, the scheduler's queues, the manager's hooks) is the same in
both: :data:`SHARED` names it, the integration modules use it directly, and a release that
lacks any of it is refused as one that lacks an adapter's piece.

:func:`internals` returns the adapter of the installed transformers, or raises one line naming
the tested releases and, for another release, the first internal it lacks.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

from zos.buffers import PaddingProfile

TESTED = ("5.17.0", "5.25.0")
_CB = "transformers.generation.continuous_batching"

#: the internals zos uses the same way on both lines, by the integration module that uses them:
#: zos overrides or wraps these methods, or calls them (checked with each line's own)
SHARED = (
    # hf_ios: the IO classes zos's IOs subclass, and the methods they override
    (f"{_CB}.input_outputs", "ContinuousBatchingIOs.prepare_batch_tensors"),
    (f"{_CB}.input_outputs", "ContinuousBatchingIOs.get_model_kwargs"),
    (f"{_CB}.input_outputs", "ContinuousBatchingIOs.carry_over_tokens"),
    (f"{_CB}.input_outputs", "ContinuousBatchingIOs._get_graph_key"),
    (f"{_CB}.input_outputs", "ContinuousBatchingAsyncIOs.get_cb_kwargs"),
    (f"{_CB}.input_outputs", "ContinuousBatchingAsyncIOs.retrieve_device_outputs"),
    (f"{_CB}.input_outputs", "ContinuousBatchingAsyncIOs.swap_io_pairs"),
    # hf_manager: the manager's methods zos wraps; the runner's padding and step it calls
    (f"{_CB}.continuous_api", "ContinuousBatchingManager._create_batch_processor"),
    (f"{_CB}.continuous_api", "ContinuousBatchingManager.switch_to_cb_friendly_attn"),
    (f"{_CB}.continuous_api", "ContinuousBatchingManager.warmup"),
    (f"{_CB}.continuous_api", "ContinuousBatchingManager.start"),
    (f"{_CB}.continuous_api", "ContinuousBatchingManager.add_request"),
    (f"{_CB}.model_runner", "ModelRunner.maybe_pad_inputs"),
    (f"{_CB}.model_runner", "ModelRunner.compute_batch"),
    # hf_capacity, hf_manager: the batch processor's and scheduler's methods zos wraps or calls
    (f"{_CB}.continuous_api", "ContinuousBatchProcessor.prepare_next_batch"),
    (f"{_CB}.continuous_api", "ContinuousBatchProcessor._update_tp_group_state"),
    (f"{_CB}.continuous_api", "ContinuousBatchProcessor._handle_request_error"),
    (f"{_CB}.scheduler", "Scheduler.add_waiting_request"),
    (f"{_CB}.scheduler", "Scheduler.clear_cancelled_requests"),
    (f"{_CB}.scheduler", "Scheduler.finish_request"),
    # hf_scheduler: what transformers' FIFO scheduler runs, called with other candidates
    (f"{_CB}.scheduler", "Scheduler._process_candidates"),
    (f"{_CB}.scheduler", "Scheduler._get_waiting_candidates"),
    (f"{_CB}.scheduler", "Scheduler._cleanup_waiting_queue"),
    (f"{_CB}.scheduler", "FIFOScheduler.schedule_batch"),
    (f"{_CB}.requests", "RequestStatus.DECODING"),
    (f"{_CB}.requests", "RequestStatus.PREFILLING"),
    (f"{_CB}.offloading_manager", "OffloadingManager.free_request_cpu_cache"),
    (f"{_CB}.requests", "RequestStatus.FINISHED"),
)


class TF517:
    """transformers 5.17: ``PagedAttentionCache`` with per-layer ``key_cache`` / ``value_cache``
    tensors ``[(num_blocks + 2) * block_size, num_kv_heads, head_dim]``, blocks ``0 ..
    num_blocks - 1`` handed out, two trash blocks past them (``read_trash_index``: zeroed,
    never written; ``write_trash_index``: written by padding, never read); the attention
    function writes K/V itself (the model passes ``cache`` through)."""

    line = "5.17"
    #: what a zos-served manager runs the model on, and transformers' own CB sdpa
    attn = "paged|zos"
    cb_sdpa = "paged|sdpa"
    #: attentions of a model zos can serve, and the names its dispatcher is registered under
    accepted_attn = ("sdpa", "paged|sdpa", "paged|zos")
    registered = ("paged|zos", "paged|sdpa")
    #: the model kwarg under which zos's attention finds the KV cache
    cache_kwarg = "cache"
    #: ``ContinuousBatchingConfig``'s field of tokens per KV block
    page_field = "block_size"
    #: (module, attribute) pairs this line needs; the first missing one is named on refusal
    REQUIRED = ((f"{_CB}.cache", "PagedAttentionCache.get_num_free_blocks"),
                (f"{_CB}.utils", "create_warmup_future_states"),
                ("transformers.integrations.sdpa_paged", "sdpa_attention_paged_forward"))

    # -- the cache -----------------------------------------------------------------------
    def unservable(self, cache) -> str | None:
        """Why zos cannot decode over ``cache`` (one line), or None: zos serves one group of
        full-attention layers."""
        if cache.num_groups != 1 or cache.num_sliding_attention_groups:
            return (f"zos supports models whose layers all use full attention (one cache "
                    f"group), got {cache.num_groups} groups")
        return None

    def page_size(self, cache) -> int:
        """Tokens per KV block."""
        return cache.block_size

    def num_blocks(self, cache) -> int:
        """Blocks requests can hold."""
        return cache.num_blocks

    def free_blocks(self, cache) -> int:
        return cache.get_num_free_blocks()

    def below_safety_margin(self, scheduler) -> bool:
        """Whether the cache has less free room than the scheduler's safety margin (a share of
        it), where transformers' schedulers admit no new prefill beside other requests."""
        return scheduler.cache.get_num_free_blocks() < scheduler.safety_margin * \
            scheduler.cache.num_blocks

    def blocks_in_use(self, cache, request_id: str) -> int:
        return cache.blocks_in_use(request_id)

    def max_tokens_read(self, cache) -> int:
        """The most KV tokens one request can hold (a bound for the block-table width)."""
        return cache.num_pages

    def block_tables(self, cache) -> dict:
        """request id -> list of block ids (transformers' own lists, rewritten in place)."""
        return cache.group_cache_managers[0].block_table

    def block_id_scale(self, cache) -> int:
        """zos's page id of transformers' block ``b`` is ``b * scale``."""
        return 1

    def padding_profile(self, cache) -> PaddingProfile:
        return PaddingProfile.transformers(cache.num_blocks, cache.block_size)

    def num_kv_blocks(self, cache) -> int:
        """zos's ``num_kv_blocks``: the page ids of requests' blocks are below it (5.17: the
        pool, the trash blocks past it)."""
        return cache.num_blocks

    def layer_pages(self, cache, layer_idx: int):
        """``(k_pages, v_pages, group)``: the layer's K and V as contiguous ``[pages,
        page_size, num_kv_heads, head_dim]`` views (no copy; ``view(-1, H, D)`` is the token
        view transformers' write and read indices address) and the index of its group in those
        index lists; built once per cache and layer (the attention asks at every call).
        ValueError for a layer outside the only full-attention group."""
        memo = cache.__dict__.setdefault("_zos_layer_pages", {})
        pages = memo.get(layer_idx)
        if pages is None:
            pages = memo[layer_idx] = self._layer_pages(cache, layer_idx)
        return pages

    def _layer_pages(self, cache, layer_idx: int):
        group, j = cache.layer_index_to_group_indices[layer_idx]
        if group != 0 or cache.sliding_windows[layer_idx] != 1:
            raise ValueError(f"zos attention: layer {layer_idx} is in cache group {group} with "
                             f"sliding window {cache.sliding_windows[layer_idx]}; zos supports "
                             f"one full-attention group")
        shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
        return cache.key_cache[j].view(shape), cache.value_cache[j].view(shape), group

    def kv_tensors(self, cache) -> tuple:
        """The tensors that hold the cache's K/V (zeroed by zos for a new cache)."""
        return (*cache.key_cache, *cache.value_cache)

    def decode_fast_path(self, cache) -> bool:
        """Whether the scheduler marks short decode batches for the block-table path."""
        return cache.max_blocks_per_request > 0

    def after_warmup(self, cache) -> None:
        """What transformers' own warm-up does to the cache once its fake requests are freed."""

    def blocks_for(self, prompt_len: int, max_new_tokens: int, block_size: int,
                   max_batch_tokens: int, in_flight: int) -> int:
        """KV blocks transformers' scheduler allocates to a request alone in its batches: the
        prompt in chunks of ``max_batch_tokens`` tokens, then decode steps until the KV holds
        ``prompt_len + max_new_tokens - 1 + in_flight`` tokens (``in_flight``: 1 under
        asynchronous batching, whose last step runs while the last token is in flight).
        5.17's ``Scheduler._allocate_blocks_if_needed``: a step of n tokens that finds fewer
        than n free slots in its request's blocks (or no block) takes ``(n - free + 1) //
        block_size + 1`` more (one block for a decode step whose blocks are full)."""
        blocks = filled = 0
        while filled < prompt_len:
            n = min(prompt_len - filled, max_batch_tokens)
            free = blocks * block_size - filled
            if free < n or blocks == 0:
                blocks += (n - free + 1) // block_size + 1
            filled += n
        kv = prompt_len + max_new_tokens - 1 + in_flight
        return max(blocks, -(-kv // block_size))

    def create_warmup_future_states(self, *args):
        from transformers.generation.continuous_batching.utils import (
            create_warmup_future_states,
        )
        return create_warmup_future_states(*args)

    def mark_complete(self, cache, state, num_blocks: int) -> None:
        """What an update of a batch does when ``num_blocks`` of ``state``'s blocks filled."""
        cache.mark_shareable_blocks_as_complete(state, num_blocks)

    # -- the model's kwargs ------------------------------------------------------------------
    def to_model(self, kwargs: dict) -> dict:
        """transformers' model kwargs of a step the model runs on zos's attention."""
        return kwargs

    def varlen_args(self, kwargs: dict, group: int, layer_type: str):
        """``(write_index, read_index, cu_seq_lens_k)`` of a prefill or mixed step for the
        layer's group (index tensors into its token view)."""
        return kwargs["write_index"][group], kwargs["read_index"][group], kwargs["cu_seq_lens_k"]

    def decode_kwargs(self, md, ids_2d, logits_indices, processor_args, cache) -> dict:
        """The model kwargs of a zos decode step (transformers' ``PagedAttentionArgs`` names):
        the model runs ``md.padded_size`` rows (``ids_2d``: ``md.input_ids`` and
        ``md.positions`` as ``[1, padded_size]`` views), the processors and sampler
        ``len(logits_indices)``."""
        return dict(input_ids=ids_2d[0], position_ids=ids_2d[1],
                    cu_seq_lens_q=md.query_start_loc, cu_seq_lens_k=md.query_start_loc,
                    max_seqlen_q=1, max_seqlen_k=1, logits_indices=logits_indices,
                    logits_processor_args=processor_args, attention_mask=None, read_index=[],
                    write_index=[], cache=cache, block_table=None, use_cache=False,
                    zos_metadata=md)

    def install_server(self, options) -> None:
        """Make transformers' server serve its model with zos (:mod:`zos.integrations.serve`)."""
        from zos.integrations.serve import install_517
        install_517(options)

    def fallback_attention(self):
        """transformers' attention for a call zos does not serve (a mask, or no paged cache)."""
        from transformers.integrations.sdpa_paged import sdpa_attention_paged_forward
        return sdpa_attention_paged_forward


class TF525(TF517):
    """transformers 5.25: ``PagedAttentionCache`` with one zeroed byte tensor and one allocator
    per attention type (``cache.cache_allocators``); zos serves a cache whose only allocator is
    ``FullAttentionCacheAllocator`` itself (MLA's compressed latents subclass it). Block ``b``
    of a layer is page ``b * pages_stride`` of the allocator's page view of that layer
    (``pages_stride = block_physical_stride // tokens_per_page``: every layer's K and V page
    interleaved); blocks are handed out from sector 2 on; page 0 (sector 0) is the zeroed read
    trash, never written (zos's null block); ``write_trash_index`` (sector 1) the pad slot.
    The model runs ``cache.update`` itself when it gets ``cache``: zos's model kwargs carry it
    as ``zos_cache`` instead, and zos's attention writes K/V."""

    line = "5.25"
    attn = "zos"
    cb_sdpa = "sdpa"
    accepted_attn = ("sdpa", "zos")
    registered = ("zos",)
    cache_kwarg = "zos_cache"
    page_field = "page_size"
    REQUIRED = ((f"{_CB}.cache", "PagedAttentionCache.can_store_request_tokens"),
                (f"{_CB}.cache_allocators",
                 "FullAttentionCacheAllocator.get_cache_for_block_table"),
                (f"{_CB}.cache_allocators.cache_pool", "CachePool.count_free_blocks"),
                (f"{_CB}.cache", "PagedAttentionCache.compute_free_capacity"),
                (f"{_CB}.requests", "create_warmup_future_states"))

    @staticmethod
    def _full(cache):
        return cache.cache_allocators["full_attention"]

    def unservable(self, cache) -> str | None:
        from transformers.generation.continuous_batching.cache_allocators import (
            FullAttentionCacheAllocator,
        )
        kinds = {name: type(a).__name__ for name, a in cache.cache_allocators.items()}
        if list(kinds) != ["full_attention"] or \
                type(self._full(cache)) is not FullAttentionCacheAllocator:
            return (f"zos supports models whose layers all use full attention (one "
                    f"FullAttentionCacheAllocator), got {kinds}")
        return None

    def page_size(self, cache) -> int:
        return self._full(cache).tokens_per_page

    def num_blocks(self, cache) -> int:
        return self._full(cache).num_blocks

    def free_blocks(self, cache) -> int:
        alloc = self._full(cache)
        return (cache.pool.num_free_sectors * alloc.blocks_per_sector
                + cache.pool.count_free_blocks(alloc.index))

    def below_safety_margin(self, scheduler) -> bool:
        return scheduler.cache.compute_free_capacity() < scheduler.safety_margin

    def blocks_in_use(self, cache, request_id: str) -> int:
        return len(self._full(cache).block_table.get(request_id, ()))

    def max_tokens_read(self, cache) -> int:
        return cache.max_tokens_read

    def block_tables(self, cache) -> dict:
        return self._full(cache).block_table

    def block_id_scale(self, cache) -> int:
        alloc = self._full(cache)
        return alloc.block_physical_stride // alloc.tokens_per_page

    def padding_profile(self, cache) -> PaddingProfile:
        alloc = self._full(cache)
        return PaddingProfile("transformers 5.25", pad_slot_id=alloc.write_trash_index,
                              null_block=0,
                              pool_start=2 * alloc.blocks_per_sector * self.block_id_scale(cache))

    def num_kv_blocks(self, cache) -> int:
        """Pages of the last layer's page view (the shortest: each layer's view starts at its
        own page of block 0), which hold every block of every layer."""
        alloc = self._full(cache)
        return alloc.get_cache_for_block_table(alloc.layer_indices[-1])[0].shape[0]

    def _layer_pages(self, cache, layer_idx: int):
        alloc = cache.layer_to_allocator[layer_idx]
        if alloc is not self._full(cache) or self.unservable(cache) is not None:
            raise ValueError(f"zos attention: layer {layer_idx} is served by "
                             f"{type(alloc).__name__}; zos supports one full-attention "
                             f"allocator")
        num_pages = self.num_kv_blocks(cache)  # the same number of pages for every layer
        k, v = alloc.get_cache_for_block_table(layer_idx)
        return k[:num_pages], v[:num_pages], alloc.index

    def kv_tensors(self, cache) -> tuple:
        return (cache.cache_tensor,)

    def decode_fast_path(self, cache) -> bool:
        return cache.max_decode_fast_path_length > 0

    def after_warmup(self, cache) -> None:
        """5.25's warm-up ends with ``cache.reset()``: the sectors its fake requests pulled into
        the allocator go back to the pool, and the prefix ledger is cleared."""
        cache.reset()

    def blocks_for(self, prompt_len: int, max_new_tokens: int, block_size: int,
                   max_batch_tokens: int, in_flight: int) -> int:
        """5.25 allocates exactly (``FullAttentionCacheAllocator._compute_blocks_needed``): the
        blocks of the most tokens the request's KV holds, however its prompt is chunked."""
        return -(-(prompt_len + max_new_tokens - 1 + in_flight) // block_size)

    def create_warmup_future_states(self, *args):
        from transformers.generation.continuous_batching.requests import (
            create_warmup_future_states,
        )
        return create_warmup_future_states(*args)

    def mark_complete(self, cache, state, num_blocks: int) -> None:
        cache.mark_complete_blocks(state, {"full_attention": num_blocks})

    def to_model(self, kwargs: dict) -> dict:
        kwargs[self.cache_kwarg] = kwargs.pop("cache")
        return kwargs

    def varlen_args(self, kwargs: dict, group: int, layer_type: str):
        cu_k = kwargs["cu_seq_lens_k"]
        return (kwargs["write_index"][group], kwargs["read_index"][group],
                cu_k[layer_type] if isinstance(cu_k, dict) else cu_k)

    def decode_kwargs(self, md, ids_2d, logits_indices, processor_args, cache) -> dict:
        return dict(input_ids=ids_2d[0], position_ids=ids_2d[1],
                    cu_seq_lens_q=md.query_start_loc,
                    cu_seq_lens_k={"full_attention": md.query_start_loc},
                    max_length_q=1, max_length_k={"full_attention": 1},
                    logits_indices=logits_indices, logits_processor_args=processor_args,
                    attention_mask=None, read_index=[], write_index=[], zos_cache=cache,
                    block_table=None, use_cache=False, is_causal=True, zos_metadata=md)

    def install_server(self, options) -> None:
        """5.25's server runs the model in a process of its own: :mod:`.serve_525`."""
        from zos.integrations.serve_525 import install
        install(options)

    def fallback_attention(self):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward


_LINES = {"5.17": TF517, "5.25": TF525}  # patch releases of a tested line take its adapter
_ADAPTERS: dict = {}


def _missing(adapter_cls) -> str | None:
    """The first of ``adapter_cls.REQUIRED`` and :data:`SHARED` the installed transformers
    lacks, or None."""
    for module, attr in (*adapter_cls.REQUIRED, *SHARED):
        try:
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            return f"{module}.{attr}"
    return None


def internals():
    """The adapter of the installed transformers (one instance per release).

    Raises:
        RuntimeError: transformers is not installed, or is not a tested release (one line:
            the tested releases, the installed one, and the first internal that the adapter of
            the line it looks like needs and it lacks).
    """
    try:
        found = sys.modules["transformers"].__version__
    except KeyError:
        try:
            import transformers
        except ImportError as e:  # pragma: no cover - the extra is missing
            raise RuntimeError(f"zos.integrations.transformers needs transformers "
                               f"{' or '.join(TESTED)} (pip install -e \".[hf]\")") from e
        found = transformers.__version__
    adapter = _ADAPTERS.get(found)
    if adapter is not None:
        return adapter
    cls = _LINES.get(".".join(found.split(".")[:2]))
    if cls is None:
        nearest = TF525 if importlib.util.find_spec(f"{_CB}.cache_allocators") else TF517
        gap = _missing(nearest)
        raise RuntimeError(
            f"zos.integrations.transformers supports transformers 5.17 and 5.25 (tested: "
            f"{', '.join(TESTED)}; their continuous-batching internals change between "
            f"releases), found {found}: "
            + (f"{gap} is missing" if gap else f"untested (it looks like the {nearest.line} "
                                               f"line)"))
    gap = _missing(cls)
    if gap is not None:
        raise RuntimeError(f"zos.integrations.transformers: transformers {found} lacks {gap}, "
                           f"an internal zos's {cls.line} adapter needs")
    return _ADAPTERS.setdefault(found, cls())
