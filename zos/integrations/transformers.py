"""zos inside Hugging Face transformers' continuous batching (``generate_batch``,
``ContinuousBatchingManager``), transformers 5.17 and 5.25 (``pip install -e ".[hf]"``).

The internals zos relies on differ between the two lines; :mod:`zos.integrations.hf_internals`
names them all, with one adapter per line. The attention names below are 5.17's: 5.25 dropped
the ``paged|`` prefix, so ``paged|zos`` is ``zos`` there and transformers' ``paged|sdpa`` is
``sdpa``; 5.25's model updates the paged cache itself when it gets the cache, so zos hands it
the cache as ``zos_cache`` and its attention writes K/V, as in 5.17.

Plug-in point: the IO object of transformers' batch processor. transformers builds every
step's inputs in ``ContinuousBatchingIOs.prepare_batch_tensors`` (a Python loop over the
requests, one ``torch.tensor`` + copy per field), the model reads them through
``get_model_kwargs``, and the function its model runner runs or captures in a CUDA graph
(``_forward_process_and_sample``: forward, logits processors, sampling) first calls the IO
object's ``carry_over_tokens``. :func:`enable_zos` wraps five methods of
``ContinuousBatchingManager`` (:mod:`zos.integrations.hf_manager`: zos's fastest mode where the
user left the choice to transformers, CUDA graphs and asynchronous batching on CUDA; zos's IOs,
:mod:`zos.integrations.hf_ios`, in place of transformers' synchronous or asynchronous ones;
``paged|zos``, never flash, with the model's own attention back when the manager stops;
cancelled requests finished for the batch in flight; every graph of a zos-served run captured
in the warm-up, which a manager with graphs runs before it starts), and registers one dispatcher
as ``"paged|sdpa"`` and ``"paged|zos"`` in ``AttentionInterface`` (zos's decode for zos's
steps, zos's varlen attention for the other steps under ``paged|zos``, transformers'
``paged|sdpa`` for a model on that name). Everything else is transformers': its scheduler,
block manager, offloading, graph capture and store, streams and double-buffered IO pairs, logits
processors, sampler and output handling. The batch order is transformers' (row i of a step is
``requests_in_batch[i]``). Working inside transformers' graph machinery rather than a graph cache
of zos's own keeps one graph store, one memory pool and transformers' capture rules, and leaves
transformers' prefill graphs as they are.

Per step:

* decode-only (every request has one query token and samples; its position fits the block table;
  N <= max_requests_per_batch): zos. :class:`~zos.integrations.hf_rows.ZosDecodeRows` builds a
  :class:`~zos.step.DecodeStep` from what changed (a request that was in the previous zos step
  at the previous position is carried: two record words, plus a block id when it crosses a
  block; any other request is a new row with its token, position and block list), the packer
  validates it and writes its record into zos's staging ring (mapped host memory, a slot
  rewritten once the prep kernels' done word shows its build finished; no copy call). Inside the
  step's graph (key ``("zos", padded size, sampled rows)`` in transformers' store, captured in
  the warm-up):
  the previous batch's sampled tokens into ``buffers.sampled``, zos's prep kernels, the rows
  whose token is still in flight (asynchronous batching) from the previous output, the model
  with ``"paged|zos"`` attention (K/V written at ``slot_mapping``, zos's paged decode kernel
  over transformers' per-layer K/V tensors viewed as ``[num_blocks + 2, block_size,
  num_kv_heads, head_dim]``, no copy), logits processors and sampling into transformers'
  ``output_ids``.
* prefill or mixed: transformers' own methods build the step (its ``cu_seq_lens_q/k``,
  ``read_index``, ``write_index``; no 4-D mask, which transformers builds for ``paged|sdpa``
  only), and :func:`zos_paged_attention` runs zos's varlen attention
  (:func:`zos.varlen_attention.varlen_attention`) over the cache in place; with transformers'
  varlen graphs on, inside the graph of the step's padded query size (key ``("zos_varlen",
  padded query tokens)``, captured in the warm-up; the step reads the whole read-index row,
  :func:`zos.integrations.hf_ios.varlen_graphed`). The next zos step stages every row as new:
  5 record words, 2 row words and the row's block ids per request.

Block ids: transformers 5.17 hands out blocks 0 .. num_blocks - 1 and keeps two blocks past them
(``cache.read_trash_index``: a zeroed block never written; ``write_trash_index``: written by
padding, never read). zos's buffers use :meth:`zos.PaddingProfile.transformers`: the null block
is the read-trash block and the pad slot the write-trash slot, so ids map one to one and no block
transformers hands out is reserved (the packer accepts block 0 under that profile). 5.25
interleaves every layer's K and V pages in one block: zos's page id of block b is ``b *
pages_stride`` in the layer's page view, its null block page 0 (the zeroed read trash) and its
pad slot the allocator's write trash (:class:`zos.integrations.hf_internals.TF525`).

What zos does not serve keeps transformers' own path, with a one-line ``RuntimeWarning``: an
attention other than ``sdpa`` / ``paged|sdpa`` (e.g. ``paged|eager``, flash), models with
sliding-window layers (:func:`enable_zos` then leaves the model as it is), torch.compile
configs (every step of that run is transformers'). Other transformers releases are refused with
one line (:func:`zos.integrations.hf_internals.internals`); beam search /
``num_return_sequences`` > 1 forks are not special-cased (forked requests are new rows to zos).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from zos._checks import check_int
from zos.attention import paged_decode_attention_kv
from zos.buckets import POLICIES
from zos.buffers import StepMetadata
from zos.integrations.hf_internals import TESTED, internals
from zos.integrations.hf_manager import install_manager_hook
from zos.varlen_attention import varlen_attention

METADATA_BACKENDS = ("device", "host")
SUPPORTED_TRANSFORMERS = TESTED  # the releases whose internals zos's adapters name


def _transformers():
    """The transformers module, once :func:`~zos.integrations.hf_internals.internals` has an
    adapter for it (RuntimeError, one line, otherwise)."""
    internals()
    import transformers
    return transformers


@dataclass(frozen=True)
class ZosOptions:
    """Options of a zos-enabled model.

    Attributes:
        max_num_blocks_per_req: block-table width W of zos's buffers; a decode batch with a
            request at position >= W * block_size runs transformers' path. None: enough for
            ``config.max_position_embeddings``, capped by the cache's block count.
        timings: if not None, a list to which each step appends ``(path, seconds)``: the host
            time of ``prepare_batch_tensors``, path ``"zos"`` or ``"transformers"``.
        bucket_policy: a name in ``zos.buckets.POLICIES`` (default ``"vllm"``): steps are
            padded to its buckets (up to max_requests_per_batch; the padded rows write KV to
            transformers' write-trash slot, read its zeroed read-trash block, and their sampled
            tokens are never read). With transformers' CUDA graphs on, each bucket's whole step
            is captured once and replayed; with them off, on CUDA, zos's prep kernels of each
            bucket are. None: a zos step runs N rows (with graphs on, one graph per N, each
            captured in the warm-up: ``max_requests_per_batch`` graphs per IO pair).
        metadata_backend: ``"device"`` (default): :class:`~zos.DeviceMetadataBackend`, zos's
            record and prep kernels. ``"host"``: :class:`~zos.HostMetadataBackend`, the same
            steps with every field built on the host and copied (the host-built baseline),
            everything else unchanged (zos's attention, graphs and buckets): for benchmarks
            that tell what device-side metadata buys from what zos's attention and whole-step
            graph buy.
        q_padding_interval_size: tokens; transformers' ``ContinuousBatchingConfig`` field of the
            same name (a prefill or mixed step's query is padded to a multiple of it, capped at
            ``max_batch_tokens``), set for a manager whose config leaves it to transformers (0,
            which means 64) and runs CUDA graphs. With graphs, the warm-up captures one prefill
            graph per padded size and IO pair: 128 halves them (16 instead of 32 at 2,048 batch
            tokens) for up to 64 more padded tokens a step. None (default): transformers'.
            ``zos serve``: 128 (:data:`zos.integrations.serve.SERVE_Q_PADDING_INTERVAL`).
        mixed_steps: True (default): transformers' FIFO scheduler, whose steps mix decoding
            requests with prefill tokens (transformers' host-built varlen path). False: prefill
            and decode in separate steps, alternating while requests wait
            (:mod:`zos.integrations.hf_scheduler`), so every decode step is zos's. Applies to
            a manager on transformers' ``"fifo"`` scheduler; another one is kept, with a
            one-line warning. ``zos serve``: False.
    """

    max_num_blocks_per_req: int | None = None
    timings: list | None = None
    bucket_policy: str | None = "vllm"
    metadata_backend: str = "device"
    q_padding_interval_size: int | None = None
    mixed_steps: bool = True


def zos_paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        **kwargs):
    """zos's attention dispatcher, registered as ``"paged|sdpa"`` and ``"paged|zos"`` in
    transformers 5.17, as ``"zos"`` in 5.25 (transformers' ``AttentionInterface`` signature;
    the release's names and cache layout: :mod:`zos.integrations.hf_internals`). The paged
    cache comes as ``cache`` (5.17) or ``zos_cache`` (5.25, where ``cache`` would make the model
    update it itself); each layer's K and V are read as ``[pages, page_size, num_kv_heads,
    head_dim]`` page views of it, no copy
    (:meth:`~zos.integrations.hf_internals.TF517.layer_pages`).
    Three cases:

    * a ``zos_metadata`` kwarg (a decode step built by zos): writes this step's K/V
      (``key``/``value``: ``[1, num_kv_heads, T, head_dim]``) into the layer's pages at
      ``slot_mapping`` (int64 [T]; dummy rows: the write-trash slot), in place, then returns
      the paged decode attention of ``query`` (``[1, num_heads, T, head_dim]``) over
      ``block_table`` / ``seq_lens``;
    * no mask (zos's name: transformers builds none for it), a prefill or mixed step of
      continuous batching: writes K/V at transformers' ``write_index`` as its ``cache.update``
      does, then :func:`zos.varlen_attention.varlen_attention` over ``cu_seq_lens_q`` /
      ``cu_seq_lens_k`` (5.25: the full-attention entry of its dict), keys read in place
      through transformers' ``read_index`` (its ``write_index`` when the step reads no past:
      every request a first chunk). transformers' own CB sdpa instead gathers every key of the
      batch, repeats KV heads and runs dense attention under a ``[T, all keys]`` mask it fills
      and copies each step;
    * otherwise (a mask: a model on 5.17's ``paged|sdpa``; no paged cache): transformers'
      sdpa attention for that case, unchanged.

    Returns ``([1, T, num_heads, head_dim], None)``. ``dropout`` is not applied (inference:
    transformers passes 0 for a model in eval mode).

    Raises:
        ValueError: the layer is not full attention in the cache's only group (sliding
            windows: :func:`enable_zos` refuses such models); the varlen attention's
            ValueError / TypeError for inputs outside its contract.
    """
    tfi = internals()
    md: StepMetadata | None = kwargs.get("zos_metadata")
    cache = kwargs.get(tfi.cache_kwarg)
    if md is None and (attention_mask is not None or cache is None):
        return tfi.fallback_attention()(module, query, key, value, attention_mask,
                                        dropout=dropout, scaling=scaling, **kwargs)
    kp, vp, group = tfi.layer_pages(cache, module.layer_idx)
    kc, vc = kp.view(-1, *kp.shape[2:]), vp.view(-1, *vp.shape[2:])  # token rows, no copy
    scale = float(scaling if scaling is not None else module.scaling)
    q = query[0].transpose(0, 1)
    if md is None:
        write, read, cu_k = tfi.varlen_args(kwargs, group, "full_attention")
        kc.index_copy_(0, write, key[0].transpose(0, 1))
        vc.index_copy_(0, write, value[0].transpose(0, 1))
        out = varlen_attention(q, kc, vc, read if read.numel() else write,
                               kwargs["cu_seq_lens_q"], cu_k, scale)
        return out.unsqueeze(0), None
    kc.index_copy_(0, md.slot_mapping, key[0].transpose(0, 1))
    vc.index_copy_(0, md.slot_mapping, value[0].transpose(0, 1))
    out = paged_decode_attention_kv(q, kp, vp, md.block_table, md.seq_lens, scale)
    return out.unsqueeze(0), None


def _triton_interpreted() -> bool:
    """Whether triton.language's own jit functions run in the interpreter (set at its import)."""
    import triton.language as tl
    return type(tl.standard.max).__name__ == "InterpretedFunction"


def enable_zos(model, options: ZosOptions | None = None) -> bool:
    """Make ``model.generate_batch`` / its ``ContinuousBatchingManager`` prepare decode-only
    batches with zos, and decode through zos's paged attention.

    The model itself is not changed: transformers' manager switches it to a continuous-batching
    attention when it starts and restores the original when it stops (``paged|zos`` for a
    model loaded with ``sdpa``; a zos-enabled model is never switched to a flash attention), so
    ``model.generate()`` works before, between and after ``generate_batch`` runs. zos registers
    one dispatcher in ``AttentionInterface`` under ``"paged|sdpa"`` and ``"paged|zos"``: a
    decode step prepared by zos (a ``zos_metadata`` kwarg) runs zos's paged decode, another
    step under ``paged|zos`` zos's varlen attention, and a model on ``paged|sdpa``
    transformers' own, unchanged (for every model in the process).

    Call before the manager is created (a manager cached with ``persistent_manager=True``
    keeps its IOs: destroy it first). :func:`disable_zos` undoes it.

    Args:
        model: a transformers ``PreTrainedModel`` with continuous batching (``generate_batch``)
            whose attention is ``"sdpa"`` or ``"paged|sdpa"``.
        options: :class:`ZosOptions` (defaults when None).

    Returns:
        True if zos serves the model; False, with a one-line ``RuntimeWarning`` and the model
        unchanged, where zos cannot (:func:`unsupported`: another attention implementation,
        sliding-window layers): transformers' own continuous batching then runs as it would.

    Raises:
        RuntimeError: transformers is not a tested release (5.17 or 5.25, one line naming what
            is missing); or, on a CPU, triton was imported before zos
            (its interpreter is then off).
        ValueError: an unknown ``options.bucket_policy`` or ``options.metadata_backend``, an
            ``options.q_padding_interval_size`` below 1.
        TypeError: options is not a ZosOptions; ``options.q_padding_interval_size`` not an
            int; ``options.mixed_steps`` not a bool.
    """
    tf = _transformers()
    options = ZosOptions() if options is None else options
    if not isinstance(options, ZosOptions):
        raise TypeError(f"options must be a ZosOptions, got {type(options).__name__}")
    if options.bucket_policy is not None and options.bucket_policy not in POLICIES:
        raise ValueError(f"options.bucket_policy must be None or one of {list(POLICIES)}, got "
                         f"{options.bucket_policy!r}")
    if options.metadata_backend not in METADATA_BACKENDS:
        raise ValueError(f"options.metadata_backend must be one of {METADATA_BACKENDS}, got "
                         f"{options.metadata_backend!r}")
    if options.q_padding_interval_size is not None:
        check_int("options.q_padding_interval_size", options.q_padding_interval_size)
    if not isinstance(options.mixed_steps, bool):
        raise TypeError(f"options.mixed_steps must be a bool, got "
                        f"{type(options.mixed_steps).__name__}")
    why = unsupported(model)
    if why is not None:
        warnings.warn(f"zos: {why}; this model keeps transformers' own continuous batching",
                      RuntimeWarning, stacklevel=2)
        return False
    if model.device.type == "cpu" and not _triton_interpreted():
        raise RuntimeError("a model on the CPU needs Triton's interpreter for zos's kernels, "
                           "chosen before triton is imported: import zos.integrations."
                           "transformers before transformers (its model classes import triton) "
                           "on a machine without CUDA, or set TRITON_INTERPRET=1 in the "
                           "environment")
    # One dispatcher under both names: with a ``zos_metadata`` kwarg (only zos's IOs pass one)
    # zos's decode; with transformers' mask (``paged|sdpa``) exactly transformers' attention,
    # so other models see no change.
    for name in internals().registered:
        tf.AttentionInterface.register(name, zos_paged_attention)
    install_manager_hook()
    model._zos_options = options
    return True


def unsupported(model) -> str | None:
    """Why zos cannot serve ``model``'s decode steps (one line), or None.

    zos decodes and prefills with full attention over transformers' paged cache of K and V:
    other attention implementations (``eager``, flash), models with sliding-window layers (e.g.
    Gemma 3's layout) and models whose cache holds compressed latents (MLA: a config with
    ``kv_lora_rank``, e.g. DeepSeek-V3's) keep transformers' path."""
    impl, accepted = model.config._attn_implementation, internals().accepted_attn
    if impl not in accepted:
        return f"attn_implementation {impl!r} is not one of {accepted}"
    text = model.config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:  # transformers' cache groups: every layer sliding if a window is set
        sliding = getattr(text, "sliding_window", None) is not None
    else:
        sliding = any(t != "full_attention" for t in layer_types)
    if sliding:
        return "the model has sliding-window layers (zos serves full attention only)"
    if getattr(text, "kv_lora_rank", None) is not None:  # transformers' MLA cache layout
        return "the model caches compressed latents (MLA), not K and V per head"
    return None


def disable_zos(model) -> None:
    """Undo :func:`enable_zos`: managers created from now on run transformers' own path (the
    model's attention is left as it is: enable_zos never changes it), and a cached persistent
    manager (``generate_batch(..., persistent_manager=True)``), whose batch processor holds
    zos's IOs, is destroyed."""
    if getattr(model, "_zos_options", None) is None:
        return
    model.destroy_cached_continuous_batching_manager()
    del model._zos_options
